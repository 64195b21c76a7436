"""Tensor-parallel training on real gloo ranks, against one unsharded process fed the same global batches.

The models are small regression nets whose blocks split Megatron-style (column then row parallel); the sequence
variant carries a sequence dimension so that its norms can be sequence-parallel, whose weight gradients arrive as
``Partial`` sums. Each rank of a (dp, tp) mesh trains on its data-parallel slice of every global batch (the ranks
of one tensor-parallel group see the same slice); the reference averages the slices' losses, as in
``training_loops``.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ds_strategy.config import ZeroConfig
from ds_strategy.models import weight_decay_groups
from ds_strategy.offload import step_runner_for
from ds_strategy.parallel.mesh import build_parallel_mesh
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.groups import EngineGroups

WIDTH, SEQ, IN, OUT = 16, 4, 8, 4


class FeedForward(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """Input projection, two residual feed-forward blocks (the units), a replicated head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList(FeedForward(WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h), y)


def make_batch(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, SEQ, IN, generator=generator), torch.randn(batch_size, SEQ, OUT, generator=generator)


def plan(sequence_parallel: bool) -> dict:
    """Column-parallel ``up``, row-parallel ``down``: one all-reduce per block. With sequence parallelism the
    residual stream between blocks is split along the sequence and the norms run on the split (Megatron-SP)."""
    if not sequence_parallel:
        return {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    return {
        "blocks.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        ),
        "blocks.*.norm": SequenceParallel(),
        "blocks.*.up": ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.down": RowwiseParallel(output_layouts=Shard(1)),
        "head": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }


def _batches(steps: int, accumulate: int, global_batch: int):
    generator = torch.Generator().manual_seed(1234)
    for step in range(steps):
        for micro in range(accumulate):
            yield step, micro, make_batch(generator, global_batch)


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW for training runs; plain SGD with lr 1 for gradient checks, whose update is then the gradient."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1.0)
    return torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)


def _update(before: dict, after: dict) -> dict:
    return {name: before[name] - after[name] for name in before}


def build_tensor_parallel(
    tp: int, stage: int, sequence_parallel: bool = False, zero: dict | None = None, optimizer: str = "adamw"
):
    """The seeded model, split over a (world / tp, tp) mesh when ``tp`` > 1, and its engine on the mesh's groups."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResidualMLP()
    mesh = build_parallel_mesh("cpu", tp)
    if tp > 1:
        parallelize_module(model, mesh.tp_mesh, plan(sequence_parallel))
    config = ZeroConfig(stage=stage, **(zero or {}))
    engine = ZeroEngine(
        model,
        _optimizer(model, optimizer),
        config,
        EngineGroups(zero=mesh.dp_group, tensor_parallel=mesh.tp_collectives),
        step_runner=step_runner_for(config),
    )
    return model, engine, mesh


def run_steps(model, engine, mesh, steps: int, accumulate: int, per_rank: int, clip: float, skip: int = 0):
    """Train on steps ``skip .. steps - 1`` of the global batches; returns (global losses, norms per step)."""
    dp, dp_rank = mesh.dp_size, mesh.dp_rank
    losses, norms, step_loss = [], [], torch.zeros(())
    for step, micro, (x, y) in _batches(steps, accumulate, per_rank * dp):
        if step < skip:
            continue
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        boundary = micro == accumulate - 1
        with engine.no_sync() if not boundary else contextlib.nullcontext():
            loss = model(x[mine], y[mine]) / accumulate
            loss.backward()
        step_loss += loss.detach()
        if boundary:
            norms.append((engine.clip_grad_norm_(clip) if clip else engine.grad_norm()).item())
            engine.step()
            dist.all_reduce(step_loss, group=mesh.dp_group)
            losses.append(step_loss.item() / dp)
            step_loss = torch.zeros(())
    return losses, norms


def train_tensor_parallel(
    rank: int,
    world_size: int,
    stage: int,
    tp: int,
    sequence_parallel: bool = False,
    steps: int = 3,
    accumulate: int = 2,
    per_rank: int = 2,
    clip: float = 0.5,
    zero: dict | None = None,
    optimizer: str = "adamw",
) -> dict:
    """On each rank: losses, gradient norms (before clipping, if ``clip``), the full parameters after training
    and what training changed them by (with ``optimizer="sgd"`` and one step, minus the gradient)."""
    model, engine, mesh = build_tensor_parallel(tp, stage, sequence_parallel, zero, optimizer)
    before = engine.full_state_dict(rank0_only=False)
    losses, norms = run_steps(model, engine, mesh, steps, accumulate, per_rank, clip)
    state = engine.full_state_dict(rank0_only=False)
    params = {n: state[n] for n, _ in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "update": _update(before, params)}


def train_jobs(rank: int, world_size: int, jobs: dict) -> dict:
    """``{name: keyword arguments of train_tensor_parallel}`` trained one after another in one process group."""
    return {name: train_tensor_parallel(rank, world_size, **job) for name, job in jobs.items()}


def train_reference(
    dp: int,
    steps: int = 3,
    accumulate: int = 2,
    per_rank: int = 2,
    clip: float = 0.5,
    optimizer: str = "adamw",
    **_ignored,
) -> dict:
    """One process, unsharded, each global micro-batch split into ``dp`` slices whose losses are averaged."""
    torch.manual_seed(0)
    model = ResidualMLP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _optimizer(model, optimizer)
    losses, norms, step_loss = [], [], 0.0
    for _step, micro, (x, y) in _batches(steps, accumulate, per_rank * dp):
        slices = [slice(r * per_rank, (r + 1) * per_rank) for r in range(dp)]
        loss = torch.stack([model(x[s], y[s]) for s in slices]).mean() / accumulate
        loss.backward()
        step_loss += loss.item()
        if micro == accumulate - 1:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")).item())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step_loss)
            step_loss = 0.0
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "update": _update(before, params)}


def assert_matches(run: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Losses and gradient norms to ``rtol``; each parameter to ``rtol`` in relative norm (see Note: [Why
    parameters are compared in norm] in ``training_loops``)."""
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=rtol, atol=0)
    torch.testing.assert_close(run["norms"], reference["norms"], rtol=rtol, atol=0)
    for what in ("params", "update"):
        assert run[what].keys() == reference[what].keys()
        for name, expected in reference[what].items():
            assert run[what][name].shape == expected.shape, name
            error = ((run[what][name] - expected).norm() / expected.norm()).item()
            assert error < rtol, f"{what} of {name}: relative error {error:.2e}"


def error_without_a_plan(rank: int, world_size: int) -> str:
    """What the strategy says of a model that nothing parallelized although tensor_parallel_size is 2."""
    from ds_strategy.compose.tensor_parallel import apply_tensor_parallelism

    mesh = build_parallel_mesh("cpu", 2)
    try:
        apply_tensor_parallelism(ResidualMLP(), mesh, ZeroConfig(tensor_parallel_size=2).parallelism_policy)
    except ValueError as error:
        return str(error)
    return "no error"


GLOBAL_BATCH = 4  # every layout of a checkpoint test trains on the same global batches


def save_after_training(rank: int, world_size: int, tp: int, stage: int, path: str) -> list[float]:
    """Train 2 steps, save a sharded checkpoint at ``path``, train 2 more; returns the last two steps' losses."""
    from ds_strategy.checkpoint import save

    model, engine, mesh = build_tensor_parallel(tp, stage, sequence_parallel=tp > 1)
    run_steps(model, engine, mesh, steps=2, accumulate=2, per_rank=GLOBAL_BATCH // mesh.dp_size, clip=0.5)
    save(path, model, engine)
    return run_steps(model, engine, mesh, 4, 2, GLOBAL_BATCH // mesh.dp_size, clip=0.5, skip=2)[0]


def load_and_continue(rank: int, world_size: int, tp: int, stage: int, path: str, resave: str) -> list[float]:
    """Load ``path`` into a fresh model at this layout, save it again at ``resave``, train the 2 steps after."""
    from ds_strategy.checkpoint import load, save

    model, engine, mesh = build_tensor_parallel(tp, stage, sequence_parallel=tp > 1)
    load(path, model, engine)
    save(resave, model, engine)
    return run_steps(model, engine, mesh, 4, 2, GLOBAL_BATCH // mesh.dp_size, clip=0.5, skip=2)[0]


# Models we did not write the plan for: built seeded, split by the automatic plan, trained on token batches.
def _tiny_gpt():
    import models

    return models.TinyGPT()


def _tiny_llama():
    import hf_models

    return hf_models.build("llama", num_key_value_heads=2)


AUTO_PLAN_MODELS = {"gpt": _tiny_gpt, "llama": _tiny_llama}
SEQUENCE, VOCAB = 16, 96


def _token_batches(steps: int, global_batch: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(0, VOCAB, (global_batch, SEQUENCE + 1), generator=generator) for _ in range(steps)]


def _token_loss(name: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return model((tokens[:, :-1], tokens[:, 1:]))
    return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def train_auto_plan(
    rank: int, world_size: int, name: str, stage: int, tp: int, sequence_parallel: bool, steps: int = 2
) -> dict:
    """``name``'s model split by ``tensor_parallel_plan(model, tp, "auto")`` and trained by ZeRO over dp."""
    from ds_strategy.parallel.auto_plan import apply_tensor_parallel_plan, tensor_parallel_plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AUTO_PLAN_MODELS[name]()
    mesh = build_parallel_mesh("cpu", tp)
    apply_tensor_parallel_plan(
        model, mesh.tp_mesh, tensor_parallel_plan(model, tp, sequence_parallel=sequence_parallel)
    )
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage), EngineGroups(mesh.dp_group, mesh.tp_collectives))
    per_rank, losses, norms = 2, [], []
    for tokens in _token_batches(steps, per_rank * mesh.dp_size):
        loss = _token_loss(name, model, tokens[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank])
        loss.backward()
        norms.append(engine.clip_grad_norm_(1.0).item())
        engine.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh.dp_group)
        losses.append(loss.item() / mesh.dp_size)
    state = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "norms": norms, "params": {n: state[n] for n, _ in model.named_parameters()}}


def train_auto_plan_jobs(rank: int, world_size: int, jobs: dict) -> dict:
    return {key: train_auto_plan(rank, world_size, **job) for key, job in jobs.items()}


def auto_plan_reference(name: str, dp: int, steps: int = 2, dtype: torch.dtype = torch.float32) -> dict:
    """One unsharded process; ``dtype=torch.float64`` trains the same fp32-initialised model in exact-enough
    arithmetic, the yardstick of Note: [A bound derived from fp32's own error] in ``test_tensor_parallel.py``."""
    torch.manual_seed(0)
    model = AUTO_PLAN_MODELS[name]().to(dtype)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    per_rank, losses, norms = 2, [], []
    for tokens in _token_batches(steps, per_rank * dp):
        loss = torch.stack([_token_loss(name, model, part) for part in tokens.split(per_rank)]).mean()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
