"""Small Hugging Face causal LMs built from configs (no weights downloaded), and the two loops their tests compare:
ZeRO on this rank, and torch DDP on a normally built copy, on the same token batches, each returning its losses and
final parameters, which :func:`assert_trains_like_ddp` compares."""

import torch
import transformers
from torch.nn.parallel import DistributedDataParallel

transformers.logging.set_verbosity_error()

VOCAB, SEQ = 128, 16


def config(name: str, **overrides):
    """GPT-2 (tied embeddings, Conv1D), the Llama family (rotary buffers, GQA) and Mixtral (a mixture of experts);
    no dropout, so that runs drawing from the generator in different orders still compute the same losses."""
    common = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
    if name == "gpt2":
        shape = {
            "n_positions": SEQ,
            "n_embd": 32,
            "n_layer": 2,
            "n_head": 2,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
        return transformers.GPT2Config(**{**shape, **common, **overrides})
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": SEQ,
        **common,
    }
    if name in _LLAMA_FAMILY:
        return getattr(transformers, _LLAMA_FAMILY[name])(**{**shape, **overrides})
    return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **{**shape, **overrides})


# Same decoder layout as Llama: Mistral and Qwen2 (biased q/k/v) and Qwen3 (per-head q_norm/k_norm).
_LLAMA_FAMILY = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
MODEL_CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def build(name: str, meta: bool = False, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """``Model(config)`` under ``torch.manual_seed(seed)``, normally or on the meta device."""
    cls = getattr(transformers, MODEL_CLASSES[name])
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(config(name, **overrides))
    return cls(config(name, **overrides))


def batches(steps: int, world_size: int, per_rank: int = 2, vocab: int = VOCAB) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (per_rank * world_size, SEQ), generator=generator) for _ in range(steps)]


def _mine(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def global_loss(loss: torch.Tensor, world_size: int) -> float:
    value = loss.detach().clone()
    torch.distributed.all_reduce(value)
    return value.item() / world_size


def _train(forward, step, rank: int, world_size: int, steps: list[torch.Tensor]) -> list[float]:
    losses = []
    for batch in steps:
        ids = _mine(batch, rank, world_size)
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        step()
        losses.append(global_loss(loss, world_size))
    return losses


def train_zero(model, engine, rank: int, world_size: int, steps: list[torch.Tensor]) -> dict:
    """ZeRO on this rank: the global losses and the whole parameters after the last step."""
    losses = _train(model, engine.step, rank, world_size, steps)
    state = engine.full_state_dict(rank0_only=False)
    return {"losses": losses, "params": {name: state[name] for name, _ in model.named_parameters()}}


def train_ddp(model, rank: int, world_size: int, steps: list[torch.Tensor]) -> dict:
    """DDP on a normally built copy, under :func:`sgd`: the global losses and the parameters after the last step."""
    optimizer = sgd(model)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    losses = _train(DistributedDataParallel(model), step, rank, world_size, steps)
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def sgd(model, lr: float = 0.1) -> torch.optim.SGD:
    """The optimizer of the runs compared with DDP: plain SGD, whose step is ``lr`` times the gradient, so a gradient
    of the wrong scale moves the parameters (Note: [An optimizer whose update scales with the gradient] in
    ``engine/test_gradient_scale.py``); under AdamW a sum for a mean over 2 ranks moved the losses by 2e-6."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def assert_trains_like_ddp(zero: dict, ddp: dict, what: str = "", rtol: float = 1e-5) -> None:
    """Losses to ``rtol`` elementwise, and each parameter to ``rtol`` in relative norm (Note: [Why parameters are
    compared in norm] in ``training_loops.py``)."""
    torch.testing.assert_close(torch.tensor(zero["losses"]), torch.tensor(ddp["losses"]), rtol=rtol, atol=0.0, msg=what)
    assert zero["params"].keys() == ddp["params"].keys(), what
    for name, expected in ddp["params"].items():
        error = (zero["params"][name] - expected).norm() / expected.norm().clamp_min(1e-12)
        assert error <= rtol, f"{what} {name}: relative error {error:.2e} > {rtol:.0e}"


def adamw(model, lr: float = 1e-3) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6)
