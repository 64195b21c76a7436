"""The :class:`~.collectives.Collectives` for code handed a process group rather than one: a user's own loop
(Lightning's ``self.device_mesh["sequence_parallel"].get_group()`` given to ``sequence_parallel_loss``) and
checkpoint-time exchanges. Composition hands model code the mesh's own ``Collectives`` (``ParallelMesh.collectives``:
the configured timeout, counted in ``comm_stats``), and every function that takes a ``group`` takes one of those as
well. Nothing is cached here: a ``Collectives`` made for a bare group is its caller's, counted on its own, so no
caller's settings or counters depend on which caller came first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import Collectives


def collectives_for(group=None) -> Collectives:
    """``group`` itself when it is a ``Collectives`` (the mesh's); for a bare process group (None: the default one), a
    new ``Collectives`` over it with the default timeout. Code that issues many collectives over a bare group makes it
    once and keeps it (``ulysses_sdpa``, ``FusedExpertsParallel``)."""
    return group if isinstance(group, Collectives) else Collectives(group)


def waiting_as_long_as_the_group(group=None) -> Collectives:
    """A ``Collectives`` over ``group`` whose waits last as long as the process group's own timeout (the
    ``init_process_group`` one, 30 minutes by default), for exchanges where one rank does slow work while the others
    wait (rank 0 publishing a checkpoint directory, ranks building a model at their own pace), which a training
    collective's timeout would cut short."""
    return Collectives(group, timeout=_process_group_timeout(group))


def _process_group_timeout(group) -> float:
    """Seconds ``group`` waits in its own collectives; torch keeps it on the group's backend's options only."""
    pg = dist.group.WORLD if group is None else group
    try:
        device = torch.device(dist.distributed_c10d._get_object_coll_device(pg))
        return pg._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()
