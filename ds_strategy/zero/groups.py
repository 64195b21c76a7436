"""The process groups a ZeroEngine spans, derived from the run's one device mesh by the composition function."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ..comm.collectives import Collectives


@dataclasses.dataclass(frozen=True)
class EngineGroups:
    """``zero``: the ranks holding the same weights, over which ZeRO shards and averages gradients (None: the default
    group); data x sequence parallel under Ulysses. The engine builds that group's ``Collectives`` itself, since the
    plan picks its algorithm.

    The model-parallel dimensions come as the mesh's own ``Collectives`` (``ParallelMesh.collectives``), so that the
    engine's traffic over them and the model's are counted together in ``comm_stats``: ``tensor_parallel``, the group
    the module's DTensor parameters are split over, and ``pipeline``, one rank of every pipeline stage (gradient
    norms and fp16 overflow checks span both, since each holds a different part of the model); ``sequence_parallel``,
    Ulysses' group, which the engine only counts. None or a group of one rank means absent."""

    zero: dist.ProcessGroup | None = None
    tensor_parallel: Collectives | None = None
    pipeline: Collectives | None = None
    sequence_parallel: Collectives | None = None
