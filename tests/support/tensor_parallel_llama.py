"""The tiny Hugging Face Llama the adapters' tensor-parallel tests train, with a plan written as for Lightning's
ModelParallelStrategy, the token data, the one training loop the Fabric and Accelerate tests drive, and the
single-process reference they are all compared with."""

import hf_models
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DistributedSampler, TensorDataset

STEPS, PER_RANK = 3, 2
LLAMA = {"num_key_value_heads": 2}  # one KV head per tensor-parallel rank
# What a Lightning user writes for ModelParallelStrategy (lightning's tensor-parallel examples take this shape).
LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def token_data(dp: int) -> torch.Tensor:
    return torch.cat(hf_models.batches(STEPS, dp, per_rank=PER_RANK))


def train_loop(model, optimizer, loader, backward) -> list[float]:
    """A plain loop of the Llama over ``loader``'s token batches; ``backward`` is the framework's."""
    losses = []
    for (ids,) in loader:
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def outcome(engine, model, initial: dict, losses: list[float], names, **extra) -> dict:
    """What each rank reports: initial and final full states, losses, mesh names and DTensor parameter count."""
    return {
        "initial": {f"model.{name}": value for name, value in initial.items()},  # the reference strips "model."
        "state": engine.full_state_dict(rank0_only=False),
        "losses": losses,
        "names": names,
        "dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
        **extra,
    }


def reference_run(dp: int, initial: dict) -> dict:
    """One process from the same initial weights (under stage 3 DTensor's sharded initialisers drew them)."""
    model = hf_models.build("llama", **LLAMA)
    model.load_state_dict({name.removeprefix("model."): value for name, value in initial.items()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    tokens, losses = token_data(dp), []
    # Lightning shuffles training data with DistributedSampler(seed=0) over the data-parallel ranks alone.
    orders = [list(DistributedSampler(TensorDataset(tokens), num_replicas=dp, rank=r, seed=0)) for r in range(dp)]
    for step in range(STEPS):
        slices = [tokens[order[step * PER_RANK : (step + 1) * PER_RANK]] for order in orders]
        loss = torch.stack([model(input_ids=ids, labels=ids).loss for ids in slices]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"state": {n: p.detach() for n, p in model.named_parameters()}, "losses": losses}
