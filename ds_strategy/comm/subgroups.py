"""Process groups made inside a sub-group (a data-parallel group of a device mesh), created alike on every rank.

Note: [Creating groups inside a sub-group]
``dist.new_group(ranks)`` must be called by every rank of the default group, with the same ``ranks``, in the same
order. An engine on the whole world can do that alone; an engine on one data-parallel group of a mesh cannot: its
peers in the other data-parallel groups build their own engines, asking for *their* groups. So every rank first
learns every rank's group (one ``all_gather_object`` over the default group at setup), and each rank then creates
the derived groups of all of them, in the order of the lowest rank of each, keeping its own.
"""

from __future__ import annotations

import torch.distributed as dist


def group_partition(group) -> list[tuple[int, ...]]:
    """The global ranks of every rank's ``group`` (None: the default group), the same list on every rank."""
    if group is None or group is dist.group.WORLD:
        return [tuple(range(dist.get_world_size()))]
    mine = tuple(dist.get_process_group_ranks(group))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted(set(everyone), key=min)


def new_groups_everywhere(partition: list[tuple[int, ...]], backend: str | None = None):
    """Create a group for each tuple of global ranks in ``partition`` on every rank; return this rank's (None when
    it is in none of them)."""
    rank, mine = dist.get_rank(), None
    for ranks in partition:
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            mine = group
    return mine
