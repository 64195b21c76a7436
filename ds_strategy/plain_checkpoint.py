"""A ZeRO engine's model and optimizer state in an ordinary single-file checkpoint (Fabric's ``save``,
Accelerate's ``save_state``).

The model is saved whole (``ZeroEngine.full_state_dict``). It loads back by writing into the parameters, which is
only right while they are the engine's whole compute copy and also what the optimizer updates: not under stage 3
(parameters are shards between uses) nor with a separate master copy (fp32 masters under mixed precision, or
masters offloaded to host or NVMe), where ``check_model_loadable`` raises rather than leave the masters stale.

Each rank's optimizer holds state only for its own shard, but those frameworks save what rank 0 returns. So every
rank's ``optimizer.state_dict()`` is gathered and stored as ``{RANK_STATES: [rank 0's, rank 1's, ...]}``, and on
load each rank takes its own entry. The checkpoint therefore resumes exactly, but only with the same world size and
ZeRO config; sharded, reshardable checkpoints are ``ds_strategy.checkpoint``'s job.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from .config import ZeroConfig

RANK_STATES = "ds_strategy_rank_states"


def check_model_loadable(config: ZeroConfig) -> None:
    """Raise unless a whole-model state dict can be loaded into the engine's parameters in place."""
    if config.partitions_parameters or config.master_weights_separate or config.offload_optimizer != "none":
        raise NotImplementedError(
            f"a plain checkpoint cannot be loaded into a ZeRO engine with stage={config.stage}, precision="
            f"{config.precision!r}, offload_optimizer={config.offload_optimizer!r}: writing the parameters would "
            f"leave its parameter shards or master weights stale. It loads at stage <= 2, without offload, with "
            f"'32-true', 'bf16-true' or '16-true' precision")


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gather_optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    """Every rank's optimizer state, in rank order; a collective, so every rank must call it."""
    rank, world_size = _rank_and_world()
    states: list[Any] = [None] * world_size
    if world_size == 1:
        states[0] = optimizer.state_dict()
    else:
        dist.all_gather_object(states, optimizer.state_dict())
    return {RANK_STATES: states}


def load_optimizer_state(optimizer: Optimizer, state: dict[str, Any]) -> None:
    """Load this rank's entry of a ``gather_optimizer_state`` result into ``optimizer``."""
    if RANK_STATES not in state:
        raise ValueError(f"this optimizer state has no {RANK_STATES!r} entry: it was not saved by a ZeRO-sharded run, "
                         f"whose optimizer holds one shard per rank; load it into an unsharded optimizer instead")
    rank, world_size = _rank_and_world()
    saved = len(state[RANK_STATES])
    if saved != world_size:
        raise ValueError(f"the checkpoint holds the optimizer state of {saved} ranks but this run has {world_size}; "
                         f"a plain checkpoint resumes only at the world size it was saved with")
    optimizer.load_state_dict(state[RANK_STATES][rank])
