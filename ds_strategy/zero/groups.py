"""The process groups a ZeroEngine spans, derived from the run's one device mesh by the composition function."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn

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
    Ulysses' group, which the engine only counts. None or a group of one rank means absent. ``experts``: the
    parameters sharded over an expert-data-parallel group instead of ``zero`` (see :class:`ExpertShards`)."""

    zero: dist.ProcessGroup | None = None
    tensor_parallel: Collectives | None = None
    pipeline: Collectives | None = None
    sequence_parallel: Collectives | None = None
    experts: ExpertShards | None = None


@dataclasses.dataclass(frozen=True)
class ExpertShards:
    """Parameters ZeRO shards over another group than ``zero``: the experts of a mixture-of-experts model under
    expert parallelism (:mod:`ds_strategy.parallel.expert_parallel`), where each rank of an expert-parallel group
    holds different experts. ``modules``: the experts containers by name, each a unit of its own whose parameters
    no other unit takes; ``group``: the expert-data-parallel group (the ranks holding the same experts), over which
    those units shard, gather and reduce; ``parallel``: the expert-parallel group's collectives, over which an
    export gathers each container's rows (rank r holds the r-th consecutive block) and whose token all-to-alls
    ``comm_stats`` counts. Gradients are still divided by the ``zero`` group's size (Note: [Expert gradient scale]
    in :mod:`ds_strategy.parallel.expert_parallel`), and the gradient norm and overflow check, summed over every
    rank, span both kinds: each rank holds a different piece of the experts."""

    modules: tuple[tuple[str, nn.Module], ...]
    group: dist.ProcessGroup | None
    parallel: Collectives
