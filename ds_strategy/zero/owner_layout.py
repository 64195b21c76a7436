"""Which rank owns each whole parameter of a whole-tensor optimizer: balanced by size over the whole model.

Note: [Whole parameters on owner ranks]
A whole-tensor optimizer (Muon; Note: [Elementwise and whole-tensor optimizers] in :mod:`.optimizer_kinds`) must
see each of its parameters whole, so where ZeRO partitions optimizer state (stage >= 1) each such parameter is
given to one owner rank, as distributed Muon (torchtitan's DistMuon) and torch's ZeroRedundancyOptimizer do. The
engine keeps its flat buffers: the whole-tensor parameters of one (unit, param group) share a flat buffer of their
own, laid out owner by owner, so that rank r's region of the buffer holds exactly the parameters r owns. A region
is therefore as long as what its rank owns there (possibly nothing), not 1/N of the buffer, and the buffer has no
padding. Everything ZeRO does to a region works unchanged: the reduction leaves the region's averaged gradient on
its owner (the same all-reduce at stage 1, a reduce to each owner where a reduce-scatter would run), the owner's
optimizer steps the parameters there, as views shaped like them, and the updated region reaches the other ranks by
the stage's own path (the stage 1/2 refresh, or the stage-3 gather from the shard, which the region is), as
broadcasts from each owner where an all-gather would run (:meth:`~ds_strategy.comm.collectives.Collectives.
all_gather` with ``regions``). ZeRO++ quantisation and hpZ secondary pieces do not apply to these buffers: they
are gathered and reduced exactly, over the whole group.

Owners are chosen once, over the whole model's whole-tensor parameters (not unit by unit), by the longest-first
greedy rule: largest parameter first, each to the rank that owns the fewest elements so far. When a rank receives
its last parameter it is the least loaded, so it holds at most the mean load plus that parameter: every rank owns
at most Ψ_w/N + P elements, Ψ_w the whole-tensor optimizer's parameters and P the largest of them. Sharded model
state per rank (optimizer state, fp32 master, reduced gradient, and at stage 3 the parameter shard) therefore stays
within the ZeRO formula plus P elements' worth of those states, which is what ``memory_report`` and
``ds_strategy.estimate`` state. The rule depends only on the parameters' sizes, in model order, so every rank
computes the same owners without communicating.
"""

from __future__ import annotations


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """The owner rank of each of ``sizes`` (element counts, in model order): largest first, each to the rank owning
    the fewest elements so far (the lowest rank on a tie), so no rank owns more than ``sum/N + max(sizes)``."""
    owners = [0] * len(sizes)
    loads = [0] * world_size
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def owned_elements(sizes: list[int], owners: list[int], world_size: int) -> list[int]:
    """Elements each rank owns under ``owners``."""
    loads = [0] * world_size
    for size, owner in zip(sizes, owners):
        loads[owner] += size
    return loads
