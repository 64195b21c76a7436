"""The :class:`~.collectives.Collectives` for code handed a bare process group: a user's own loop (Lightning's
``self.device_mesh["sequence_parallel"].get_group()`` given to ``sequence_parallel_loss``) and checkpoint-time
exchanges. Composition hands model code the mesh's own ``Collectives`` instead (``ParallelMesh.collectives``: the
configured timeout, counted in ``comm_stats``), and every function taking a ``group`` takes one of those as well.
Going through a ``Collectives`` times a collective out, names a failed rank and counts it; keeping one per bare group
here makes its counters add up what was issued over that group by such code, apart from ``comm_stats``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import Collectives
from .process_exit import destroy_process_groups_at_exit

# (process group (the default group for None), purpose) -> (the default group it was made under, its Collectives)
_BY_GROUP: dict = {}


def collectives_for(group=None) -> Collectives:
    """``group`` itself when it is a ``Collectives`` (the mesh's); for a bare process group (None: the default one),
    the one kept here for it, made on first use with ``Collectives``' default timeout."""
    if isinstance(group, Collectives):
        return group
    return _cached(group, "", lambda: Collectives(group))


def waiting_as_long_as_the_group(group=None) -> Collectives:
    """A ``Collectives`` over ``group`` whose waits last as long as the process group's own timeout (the
    ``init_process_group`` one, 30 minutes by default), for exchanges where one rank does slow work while the others
    wait (rank 0 publishing a checkpoint directory, ranks building a model at their own pace), which a training
    collective's timeout would cut short."""
    return _cached(group, "long waits", lambda: Collectives(group, timeout=_process_group_timeout(group)))


def _cached(group, purpose: str, make: Callable[[], Collectives]) -> Collectives:
    """One ``Collectives`` per group and purpose. Entries made under a default group since destroyed are dropped,
    so that none keeps a dead group's threads alive."""
    world = dist.group.WORLD
    for key in [key for key, (made_under, _) in _BY_GROUP.items() if made_under is not world]:
        del _BY_GROUP[key]
    key = (world if group is None else group, purpose)
    if key not in _BY_GROUP:
        if not _BY_GROUP:
            destroy_process_groups_at_exit(_BY_GROUP.clear)  # [Why every process group is destroyed at exit]
        _BY_GROUP[key] = (world, make())
    return _BY_GROUP[key][1]


def _process_group_timeout(group) -> float:
    """Seconds ``group`` waits in its own collectives; torch keeps it on the group's backend's options only."""
    pg = dist.group.WORLD if group is None else group
    try:
        device = torch.device(dist.distributed_c10d._get_object_coll_device(pg))
        return pg._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()
