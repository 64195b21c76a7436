"""Pipeline-parallel training on real gloo ranks, against one unsharded process fed the same global batches.

Three models: a stack of identical MLP blocks (``nn.Sequential``), our GPT (whose LM head is tied to the
embedding, so the first and last stage each hold a copy) and a Hugging Face Llama built from a small config.
Each rank of a (pp, dp[, tp]) mesh trains on its data-parallel slice of every global batch, split by the
schedule into micro-batches; the reference takes the mean loss over the whole global batch, which is the same
objective because every slice and micro-batch has the same size.
"""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.compose import build_mesh, compose_model
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig

WIDTH, VOCAB, SEQ = 16, 64, 8


def mlp_stack(blocks: int = 4) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(blocks)])


def tiny_gpt(blocks: int = 4) -> nn.Module:
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=blocks, n_head=2, n_embd=WIDTH, dropout=0.0))


def tiny_llama(blocks: int = 4, heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


MODELS = {"mlp": mlp_stack, "gpt": tiny_gpt, "llama": tiny_llama}


def batches(model: str, steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        if model == "mlp":
            out.append(
                (
                    torch.randn(global_batch, WIDTH, generator=generator),
                    torch.randn(global_batch, WIDTH, generator=generator),
                )
            )
        else:
            tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=generator)
            out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dtype.is_floating_point and target.dtype.is_floating_point:
        return F.mse_loss(output, target)
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def full_output(model_name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if model_name == "mlp":
        return model(x)
    if model_name == "gpt":
        return model(x)[0]
    return model(input_ids=x).logits


def optimizer_for(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """SGD with lr 1 for gradient checks (the update is the gradient); AdamW for training runs."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1.0)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)


def build_pipeline(model_name: str, optimizer: str = "sgd", blocks: int = 4, **fields):
    """The seeded model cut to this rank's stages, its engine on the mesh and the runner."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ZeroConfig(**fields)
    model = MODELS[model_name](blocks)
    mesh = build_mesh(config, "cpu")
    composed = compose_model(
        model,
        config,
        mesh=mesh,
        device=torch.device("cpu"),
        log=lambda _: None,
        optimizers=lambda: [optimizer_for(model, optimizer)],
    )
    return model, composed.engine, composed.pipeline, mesh


def train_pipeline(
    rank: int,
    world_size: int,
    model_name: str,
    steps: int,
    global_batch: int,
    accumulate: int = 1,
    optimizer: str = "sgd",
    clip: float = 0.0,
    **fields,
) -> dict:
    """Train ``steps`` optimizer steps of ``accumulate`` batches each; return the losses (averaged over data
    parallel, and as ``train_step`` returned them), this rank's parameters (whole, under their global names)
    after training, the engine's collective calls per kind during each ``train_step`` and what those follow
    from (``collective_layout``)."""
    model, engine, runner, mesh = build_pipeline(model_name, optimizer, **fields)
    data = batches(model_name, steps * accumulate, global_batch)
    per_rank = global_batch // mesh.dp_size
    losses, raw_losses, norms, calls = [], [], [], []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            lo = mesh.dp_rank * per_rank
            sync = micro == accumulate - 1
            context = engine.no_sync() if not sync else contextlib.nullcontext()
            before = engine.comm_stats()
            with context:
                loss = runner.train_step(x[lo : lo + per_rank], y[lo : lo + per_rank], loss_fn, 1.0 / accumulate)
            calls.append(_calls_since(engine, before))
            raw_losses.append(float(loss))
            losses.append(mean_over_dp(loss, mesh))
        if clip:
            norms.append(float(engine.clip_grad_norm_(clip)))
        engine.step()
    state = engine.full_state_dict(rank0_only=False)
    owned = {name: value for name, value in state.items() if name in dict(model.named_parameters())}
    return {
        "losses": losses,
        "raw_losses": raw_losses,
        "norms": norms,
        "params": owned,
        "tied": dict(engine.saved_as),
        "calls": calls,
        "layout": collective_layout(engine, runner),
    }


def train_jobs(rank: int, world_size: int, jobs: dict) -> dict:
    """``{name: keyword arguments of train_pipeline, or a function of (rank, world_size)}`` run one after another
    in one process group (starting ranks is the slow part); each job builds its own mesh, model and engine."""
    return {
        name: job(rank, world_size) if callable(job) else train_pipeline(rank, world_size, **job)
        for name, job in jobs.items()
    }


def microbatch_error(rank: int, world_size: int) -> dict:
    """What the runner says to a batch of 4 split into 3 micro-batches, and the collectives it counted by then."""
    _, engine, runner, _ = build_pipeline("mlp", pipeline_parallel_size=2, pipeline_microbatches=3)
    before = engine.comm_stats()
    try:
        runner.train_step(torch.zeros(4, WIDTH), torch.zeros(4, WIDTH), loss_fn)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    return {"message": message, "collectives": _calls_since(engine, before)}


def _calls_since(engine, before: dict) -> dict:
    after = engine.comm_stats()
    return {kind: after[kind]["calls"] - before[kind]["calls"] for kind in after}


def collective_layout(engine, runner) -> dict:
    """What the engine's collectives per step follow from: for this rank's reduce-scattered flat buffers, how many
    belong to a single stage (per stage) and how many span stages; for its stage-3 units, how many partitioned
    buffers each stage's units hold and the root unit holds."""
    stage_of = {}
    for stage, module in runner.modules.items():
        for p in module.parameters():
            stage_of.setdefault(id(p), set()).add(stage)
    scattered = [fp for fp in engine.flat_params if fp.policy.grads]
    alone = {s: 0 for s in runner.modules}
    for fp in scattered:
        stages = set().union(*(stage_of.get(id(p), {None}) for p in fp.params))
        if len(stages) == 1 and None not in stages and fp.norm_share:
            alone[stages.pop()] += 1
    partitioned = {s: 0 for s in runner.modules}
    for unit in engine.units[1:]:
        stages = set().union(*(stage_of.get(id(p), set()) for fp in unit.flat_params for p in fp.params))
        for stage in stages:
            partitioned[stage] += len(unit.partitioned)
    return {
        "scattered": len(scattered),
        "alone": alone,
        "partitioned": partitioned,
        "root_partitioned": len(engine.units[0].partitioned),
        "microbatches": runner.num_microbatches,
    }


def mean_over_dp(loss: torch.Tensor, mesh) -> float:
    import torch.distributed as dist

    value = loss.detach().clone()
    if mesh.dp_size > 1:
        dist.all_reduce(value, group=mesh.dp_mesh.get_group())
        value /= mesh.dp_size
    return float(value)


def train_reference(
    model_name: str,
    steps: int,
    global_batch: int,
    accumulate: int = 1,
    optimizer: str = "sgd",
    clip: float = 0.0,
    blocks: int = 4,
) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MODELS[model_name](blocks)
    opt = optimizer_for(model, optimizer)
    data = batches(model_name, steps * accumulate, global_batch)
    losses, norms = [], []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            loss = loss_fn(full_output(model_name, model, x), y)
            (loss / accumulate).backward()
            losses.append(float(loss.detach()))
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def merged_params(results: list[dict]) -> dict:
    """Every rank's parameters under their canonical names (a tied copy's under its owner's)."""
    merged = {}
    for result in results:
        for name, value in result["params"].items():
            merged.setdefault(result["tied"].get(name, name), value)
    return merged


def assert_matches(
    results: list[dict], reference: dict, rtol: float = 1e-5, atol: float = 1e-6, params_in_norm: bool = False
) -> None:
    """Every parameter, loss and norm against the reference. ``params_in_norm``: each parameter tensor to ``rtol``
    in relative norm instead of elementwise, for Adam runs (Note: [Why parameters are compared in norm] in
    ``training_loops``)."""
    merged = merged_params(results)
    assert set(merged) == set(reference["params"]), sorted(set(reference["params"]) ^ set(merged))
    for name, expected in reference["params"].items():
        if params_in_norm:
            error = (merged[name] - expected).norm() / expected.norm().clamp_min(1e-12)
            assert error <= rtol, f"{name}: relative error {error:.2e} > {rtol:.0e}"
        else:
            torch.testing.assert_close(merged[name], expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=atol
        )
        if reference["norms"]:
            torch.testing.assert_close(
                torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=rtol, atol=atol
            )
