"""One :class:`~.collectives.Collectives` per process group and purpose, for collectives issued by code that holds
a group and not an engine: the model's own (Ulysses all-to-alls, tensor-parallel sums, partitioned activations, all
inside forward and backward), and checkpoint-time exchanges. Going through a ``Collectives`` times them out, names a
failed rank and counts them; keeping one per group makes each group's counters add up everything issued over it
here, apart from an engine's own counters (``ZeroEngine.comm_stats``), which measure training traffic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import Collectives
from .process_exit import destroy_process_groups_at_exit

# (process group (the default group for None), purpose) -> (the default group it was made under, its Collectives)
_BY_GROUP: dict = {}


def collectives_for(group=None, timeout: float | None = None) -> Collectives:
    """The ``Collectives`` of ``group`` (None: the default group), made on first use with ``Collectives``'
    default timeout. A ``timeout`` replaces the group's from now on: an adapter sets the configured one at setup,
    and model code that asks later for the group alone gets the same object."""
    collectives = _cached(group, "", lambda: Collectives(group))
    if timeout is not None:
        collectives.timeout = timeout
    return collectives


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
