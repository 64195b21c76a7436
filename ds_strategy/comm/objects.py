"""Picklable objects exchanged over a :class:`~.collectives.Collectives` (checkpoint manifests, checksums, a rank-0
error), so that these exchanges are timed out and name a failed rank like every other collective. torch's own
object collectives block without either: a rank that died during a save would leave the others waiting for the
process group's timeout, 30 minutes by default.

An object travels as its pickle in a uint8 tensor: one collective of the lengths, then one of the bytes padded to
the longest. The tensors live on the CPU, or on the current CUDA device for an NCCL group, which carries no CPU
tensors.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import Collectives


def _device(collectives: Collectives) -> torch.device:
    if dist.is_initialized() and dist.get_backend(collectives.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encoded(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _decoded(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())


def all_gather_object(obj: Any, collectives: Collectives, label: str = "objects") -> list[Any]:
    """Every rank's ``obj``, in group rank order, on every rank."""
    device = _device(collectives)
    payload = _encoded(obj, device)
    lengths = torch.zeros(collectives.world_size, dtype=torch.int64, device=device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    collectives.all_gather(lengths, mine, label=f"{label}.lengths").wait()
    longest = int(lengths.max())
    gathered = torch.empty(collectives.world_size * longest, dtype=torch.uint8, device=device)
    collectives.all_gather(gathered, F.pad(payload, (0, longest - payload.numel())), label=label).wait()
    return [_decoded(gathered[r * longest : r * longest + n]) for r, n in enumerate(lengths.tolist())]


def broadcast_object(obj: Any, collectives: Collectives, src: int = 0, label: str = "object") -> Any:
    """Group rank ``src``'s ``obj`` on every rank (the others' ``obj`` is ignored)."""
    device = _device(collectives)
    payload = _encoded(obj, device) if collectives.rank == src else None
    length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    collectives.broadcast(length, src=src, label=f"{label}.length").wait()
    if payload is None:
        payload = torch.empty(int(length), dtype=torch.uint8, device=device)
    collectives.broadcast(payload, src=src, label=label).wait()
    return _decoded(payload)
