"""ZeRO++ weight gathering for stage 3: int8 all-gathers (qwZ) and a secondary partition inside a group (hpZ).

hpZ (hierarchical partitioning): ranks are cut into groups of ``zero_hpz_partition_size`` consecutive ranks (the
GPUs of one node, in the paper). A unit's forward all-gather runs over all N ranks as usual; when the unit is
freed after forward, each rank keeps a *secondary* piece of the full weights, 1/k of them for a group of k, at
its position within the group. The backward all-gather then runs over the group alone, from the secondary
pieces: no inter-node traffic for weights in backward, for k/N x the memory of the primary shard on top of it.

Note: [Secondary partition lifetime]
A secondary piece is cut from the gathered weights when a unit is freed
after a forward that autograd will run backward through (grad enabled), and dropped when the unit is freed
after its backward, at the end of backward for units whose backward never ran, and by ``drop_all`` (the engine
calls it at the end of every backward, before every optimizer step, and on ``reshard``). So it never outlives
the parameters it was cut from: the optimizer step, a checkpoint load or an evaluation forward always find
none, and their gathers come from the primary shards. A gather while a secondary piece exists (the unit's
backward, or its recomputation under activation checkpointing) uses the group. With qwZ the secondary piece is
the int8 packets the forward gather received, so backward sees bit for bit the weights forward saw.

Both gathers go through :class:`~ds_strategy.comm.collectives.Collectives`, one per process group, so the
accounting is per group (``engine.comm_stats("hpz")``). Every rank must create the same process groups in the
same order, so :func:`hpz_collectives` creates every group on every rank, inside a data-parallel group of a mesh
too (Note: [Creating groups inside a sub-group]).
"""

from __future__ import annotations

import torch

from ..comm.collectives import Collectives, PendingCollective
from ..comm.quantized import BLOCK_SIZE, all_gather_int8, decode_int8_packets
from ..comm.subgroups import group_partition, new_groups_everywhere
from .flat_param import FlatParam


def hpz_collectives(world: Collectives, partition_size: int) -> Collectives:
    """Collectives over this rank's group of ``partition_size`` consecutive ranks of ``world``'s group."""
    if world.world_size % partition_size:
        raise ValueError(
            f"ZeroConfig.zero_hpz_partition_size={partition_size} must divide the world size "
            f"{world.world_size}; hpZ groups are made of that many consecutive ranks"
        )
    partition = [
        ranks[first : first + partition_size]
        for ranks in group_partition(world.group)
        for first in range(0, len(ranks), partition_size)
    ]
    mine = new_groups_everywhere(partition)  # every rank creates every group
    return Collectives(mine, use_all_reduce=world.use_all_reduce, timeout=world.timeout)


class WeightGather:
    """How stage 3 gathers a partitioned flat buffer: plain or int8 (qwZ), from the primary shards over all ranks
    or from the secondary pieces over the hpZ group (``group`` given)."""

    def __init__(self, world: Collectives, group: Collectives | None, quantized: bool, block_size: int = BLOCK_SIZE):
        self.world = world
        self.group = group
        self.quantized = quantized
        self.block_size = block_size
        self._secondary: dict[int, torch.Tensor] = {}
        self._received: dict[int, torch.Tensor] = {}  # qwZ + hpZ: gathered packets, until the unit is freed

    # -- gather -------------------------------------------------------------------------------------------------
    def launch(self, fp: FlatParam, label: str, exact: bool = False) -> PendingCollective:
        """Launch the all-gather of ``fp.full``; ``exact`` gathers unquantised from the primary shards."""
        if fp.regions is not None:  # exact, over the whole group: Note: [Whole parameters on owner ranks]
            return self.world.all_gather(fp.full, fp.gather_source(), label=label, regions=fp.regions)
        secondary = self._secondary.get(fp.index)
        if secondary is not None and not exact:
            return self._gather_in_group(fp, secondary, f"{label} [hpZ group]")
        if not self.quantized or exact:
            return self.world.all_gather(fp.full, fp.gather_source(), label=label)
        keep = (lambda packets: self._received.__setitem__(fp.index, packets)) if self.group is not None else None
        return all_gather_int8(
            self.world, fp.full, fp.gather_source(), label=label, block_size=self.block_size, keep_packets=keep
        )

    def _gather_in_group(self, fp: FlatParam, secondary: torch.Tensor, label: str) -> PendingCollective:
        if not self.quantized:
            return self.group.all_gather(fp.full, secondary, label=label)
        packets = torch.empty(secondary.numel() * self.group.world_size, dtype=torch.int8, device=secondary.device)
        pending = self.group.all_gather(packets, secondary, label=f"{label} [int8]")
        return pending.then(lambda: decode_int8_packets(fp.full, packets, self.world.world_size, self.block_size))

    # -- secondary pieces (see Note: [Secondary partition lifetime]) ------------------------------------------
    def before_free(self, fp: FlatParam, keep_for_backward: bool) -> None:
        """Called while ``fp.full`` is still gathered, just before it is freed."""
        received = self._received.pop(fp.index, None)
        if not keep_for_backward or self.group is None or fp.regions is not None:
            self._secondary.pop(fp.index, None)
            return
        if fp.index in self._secondary:
            return
        k, position = self.group.world_size, self.group.rank
        if self.quantized:
            if received is None:  # gathered exactly (export): nothing of forward's weights to keep
                return
            per_group_rank = self.world.world_size // k
            piece = received[position * per_group_rank : (position + 1) * per_group_rank]
        else:
            piece = fp.full.view(k, -1)[position]
        self._secondary[fp.index] = piece.reshape(-1).clone()

    def drop_all(self) -> None:
        self._secondary.clear()
        self._received.clear()
