"""The process groups a ZeroEngine spans, derived from the run's one device mesh by the composition function."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class EngineGroups:
    """``zero``: the ranks holding the same weights, over which ZeRO shards and averages gradients (None: the default
    group); data x sequence parallel under Ulysses. ``tensor_parallel``: the group the module's DTensor parameters
    are split over; ``pipeline``: one rank of every pipeline stage. Gradient norms and fp16 overflow checks span the
    last two as well, since each holds a different part of the model; None or a group of one rank means absent."""

    zero: dist.ProcessGroup | None = None
    tensor_parallel: dist.ProcessGroup | None = None
    pipeline: dist.ProcessGroup | None = None
