"""``deepspeed.comm`` as scripts call it: ``get_rank``, ``get_world_size``, ``get_local_rank``, ``barrier``,
``all_reduce``, ``broadcast``, ``all_gather``, every collective through :mod:`ds_strategy.comm`'s ``Collectives``
(timed out, counted, naming a failed rank). Before a process group exists they answer for one process."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..comm.collectives import Collectives
from ..comm.group_collectives import waiting_as_long_as_the_group

ReduceOp = dist.ReduceOp
# The Collectives each process group's calls go through, made once (a training loop all-reduces its loss every
# step), by the group object's id with the group kept beside it, so a group made anew after a re-initialisation
# gets its own. Read and written here only.
_BY_GROUP: dict[int, tuple[object, Collectives]] = {}


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """``$LOCAL_RANK``, as torchrun and DeepSpeed's launcher set it (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def barrier(group=None) -> None:
    """Wait for every rank of ``group``, as long as the process group's own timeout (one rank may be writing a
    checkpoint while the others wait)."""
    if dist.is_initialized():
        marker = torch.zeros(1, device=_device())
        waiting_as_long_as_the_group(group).all_reduce(marker, label="deepspeed.comm.barrier").wait()


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` in place over ``group``; with ``async_op`` the pending work (``.wait()``)."""
    if not dist.is_initialized():
        return None
    pending = _collectives(group).all_reduce(tensor, op=op, label="deepspeed.comm.all_reduce")
    if async_op:
        return pending
    pending.wait()
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if not dist.is_initialized():
        return None
    pending = _collectives(group).broadcast(tensor, src=src, label="deepspeed.comm.broadcast")
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    """``tensor_list[r]`` becomes rank ``r``'s ``tensor``, as ``torch.distributed.all_gather``."""
    if not dist.is_initialized():
        tensor_list[0].copy_(tensor)
        return None
    out = torch.empty((len(tensor_list), *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    pending = _collectives(group).all_gather(out.view(-1), tensor.reshape(-1), label="deepspeed.comm.all_gather")
    pending.wait()
    for slot, value in zip(tensor_list, out):
        slot.copy_(value)
    return None


def _collectives(group) -> Collectives:
    pg = dist.group.WORLD if group is None else group
    held = _BY_GROUP.get(id(pg))
    if held is None or held[0] is not pg:
        held = _BY_GROUP[id(pg)] = (pg, Collectives(group))
    return held[1]


def _device() -> torch.device:
    """Where a collective's scratch tensor lives: this rank's GPU under NCCL, else the CPU."""
    if torch.cuda.is_available() and "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
