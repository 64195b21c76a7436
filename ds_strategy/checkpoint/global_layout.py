"""Where a tensor-parallel rank's local elements sit in the global tensor, so checkpoints store global tensors.

Note: [Tensor-parallel pieces in global coordinates]
A checkpoint stores every tensor as the 1-D flattening of its *global* shape, whatever split wrote it, so that a
checkpoint saved at one (dp, tp) layout loads at any other. A DTensor parameter's flat buffer holds its local
shard; a contiguous range of that shard is one contiguous global range for a ``Shard(0)`` placement (whole rows),
one range per row for ``Shard(1)``, and strided runs for ``_StridedShard`` (fused q|k|v). This module finds the
runs generally: it lays out the global element indices, splits them with the placements' own ``_split_tensor``
(the function DTensor cuts local shards with), and reads off the maximal runs of consecutive indices in the
range. The index tensor costs 8 bytes per element of one parameter for the duration of one call.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import _StridedShard

from ..parallel.dtensor_params import TensorParallelSpec


def local_to_global(spec: TensorParallelSpec) -> torch.Tensor:
    """For each element of this rank's local shard (row-major), its index in the flattened global tensor."""
    index = torch.arange(math.prod(spec.shape)).view(spec.shape)
    coordinate = spec.mesh.get_coordinate()
    for mesh_dim, placement in enumerate(spec.placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):  # torch 2.13: not is_shard()
            chunks, _ = placement._split_tensor(index, spec.mesh.size(mesh_dim), with_padding=False, contiguous=False)
            index = chunks[coordinate[mesh_dim]]
    return index.reshape(-1)


def global_runs(spec: TensorParallelSpec, start: int, length: int) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each maximal run of local elements ``[start, start + length)``
    that is contiguous in the global flattening."""
    positions = local_to_global(spec)[start : start + length]
    breaks = (torch.nonzero(positions[1:] - positions[:-1] != 1).reshape(-1) + 1).tolist()
    edges = [0, *breaks, length]
    return [(start + lo, int(positions[lo]), hi - lo) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]
