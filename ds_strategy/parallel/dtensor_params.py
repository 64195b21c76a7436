"""Tensor-parallel (DTensor) parameters whose local shards live in the engine's flat buffers.

Note: [DTensor parameters as flat views]
A tensor-parallel parameter stays a ``DTensor`` (its placements are what torch's parallel styles, Hugging Face's
plans and ``loss_parallel`` dispatch on), and the engine treats its *local* shard as the parameter: the local shape
is what a flat buffer holds, ZeRO shards it over the data-parallel group, and each tensor-parallel rank's engine
holds a different local shard. ``p.data = view`` would replace the DTensor by a plain tensor, so the engine points
the DTensor's ``_local_tensor`` at the view instead: the same Parameter object (optimizers and hooks keep it),
the same global shape and placements, storage in the flat buffer, and stage 3's free and regather work unchanged
because they only resize that storage.

Gradients arrive as DTensors. Most have the parameter's placements; a replicated parameter used on sequence-split
activations (a norm under sequence parallelism) gets a ``Partial`` gradient, each tensor-parallel rank holding
the sum over its own tokens, so it is summed over the tensor-parallel group (``redistribute``) before its local
values join the data-parallel reduction. A parameter replicated over the tensor-parallel group (a plain tensor, or
a DTensor with only ``Replicate`` placements) then has the same reduced gradient on every tensor-parallel rank;
the global norm counts it once by weighting it ``1 / tp_size`` (see ``ds_strategy.precision.grad_stats``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement


@dataclasses.dataclass(frozen=True)
class TensorParallelSpec:
    """The global view of one DTensor parameter: its mesh, placements, global shape and stride."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def replicated(self) -> bool:
        """Whether every rank of the mesh holds the whole parameter (no ``Shard`` placement)."""
        return all(placement.is_replicate() for placement in self.placements)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's local part of ``grad`` in the parameter's placements (a ``Partial`` sum is reduced first)."""
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != self.placements:
                grad = grad.redistribute(self.mesh, self.placements)
            return grad.to_local()
        return grad

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """A DTensor of this spec whose local shard is ``local`` (its storage, not a copy)."""
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )

    def wrap(self, local: torch.Tensor, requires_grad: bool) -> torch.nn.Parameter:
        """A DTensor parameter of this spec whose local shard is ``local``."""
        return torch.nn.Parameter(self.as_dtensor(local), requires_grad=requires_grad)


def spec_of(param: torch.Tensor) -> TensorParallelSpec | None:
    """The spec of a DTensor parameter, None for a plain one."""
    if not isinstance(param, DTensor):
        return None
    return TensorParallelSpec(param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What a flat buffer holds of ``param``: its local shard when it is a DTensor, else itself."""
    return param._local_tensor if isinstance(param, DTensor) else param


def point_param_at(param: torch.Tensor, view: torch.Tensor, storage_kept: bool = False) -> None:
    """Make ``view`` the storage ``param`` reads (Note: [DTensor parameters as flat views]). ``storage_kept``: the
    flat buffer's memory never moves (stages 0-2), so a DTensor's local may be its own storage object over it.

    Note: [DTensor locals and torch.compile]
    Dynamo fakes every tensor a compiled forward reads. DTensor locals that are views of one flat buffer share a
    storage object, and faking a subclass's inner tensors that alias a storage fails in torch ("set the storage of
    a tensor on device cpu to a storage on device meta"); plain parameters, whose ``.data`` are such views, do
    not. ``torch.from_dlpack(view)`` reads and writes the same memory through a storage object of its own (the
    capsule keeps the buffer alive), so nothing aliases in dynamo's eyes. That is safe only while the buffer's
    memory never moves: stage 3 frees and regathers full buffers by resizing their storage, which would leave such
    a local pointing at freed memory, so stage 3 keeps plain views.
    """
    if isinstance(param, DTensor):
        param._local_tensor = torch.from_dlpack(view.detach()) if storage_kept else view
    else:
        param.data = view
