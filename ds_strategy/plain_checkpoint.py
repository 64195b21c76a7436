"""A ZeRO-sharded optimizer's state in an ordinary single-file checkpoint (Fabric's ``save``, Accelerate's
``save_state``).

Each rank's optimizer holds state only for its own shard, but those frameworks save what rank 0 returns. So every
rank's ``optimizer.state_dict()`` is gathered and stored as ``{RANK_STATES: [rank 0's, rank 1's, ...]}``, and on
load each rank takes its own entry. The checkpoint therefore resumes exactly, but only with the same world size and
ZeRO config; sharded, reshardable checkpoints are ``ds_strategy.checkpoint``'s job.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

RANK_STATES = "ds_strategy_rank_states"


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
