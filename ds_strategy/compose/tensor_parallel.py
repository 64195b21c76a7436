"""Step 2 of the composition (Note: [The order of composition] in :mod:`.model`) under tensor parallelism: the user's
function, then the configured plan (or the check that the model is parallelized), so the engine finds DTensor
parameters; and the one question an adapter answers about it, :class:`TensorParallelism`."""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.policies import ParallelismPolicy
from ..parallel.auto_plan import apply_tensor_parallel_plan, tensor_parallel_plan
from ..parallel.mesh import ParallelMesh


class Unparallelized(enum.Enum):
    """What becomes of a model that arrives under tensor parallelism with no tensor-parallel parameters and no plan
    configured; a model the user already parallelized is left as it is whatever the choice."""

    REFUSE = "refuse"  # an error saying how to split it (Fabric: its parallelize_fn should have)
    AUTO_PLAN = "auto_plan"  # the automatic plan splits it (Accelerate, which takes no parallelize_fn)
    REPLICATE = "replicate"  # it runs whole on every tensor-parallel rank (Lightning, as ModelParallelStrategy does)


@dataclasses.dataclass(frozen=True)
class TensorParallelism:
    """How an adapter's model becomes tensor-parallel: ``parallelize_fn``, the user's function already bound to the
    mesh (Fabric's), runs first; then the configured ``tensor_parallel_plan``; ``unparallelized`` says what becomes of
    a model neither split. Acts only when the mesh has a tensor-parallel dimension."""

    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None
    unparallelized: Unparallelized = Unparallelized.REFUSE


NOT_PARALLELIZED_HERE = TensorParallelism()  # no function of the user's; a model left unsplit is refused


def apply_tensor_parallelism(
    module: nn.Module,
    mesh: ParallelMesh | None,
    policy: ParallelismPolicy,
    unparallelized: Unparallelized = Unparallelized.REFUSE,
) -> None:
    """Apply ``policy.tensor_parallel_plan`` to ``module`` over ``mesh``'s tensor-parallel dimension, or, when the
    plan is None, require that the user's own code (``configure_model``, ``parallelize_fn``) did it, else do with
    the model what ``unparallelized`` says."""
    if mesh is None or mesh.tp_size == 1:
        return
    plan = policy.tensor_parallel_plan
    if plan is None and not _is_parallelized(module) and unparallelized is Unparallelized.AUTO_PLAN:
        plan = "auto"
    if plan is not None:
        resolved = tensor_parallel_plan(module, mesh.tp_size, sequence_parallel=policy.sequence_parallel, plan=plan)
        apply_tensor_parallel_plan(module, mesh.tp_mesh, resolved, mesh.tp_collectives)
    if _is_parallelized(module):
        return
    if unparallelized is not Unparallelized.REPLICATE:
        raise ValueError(
            f"tensor_parallel_size={mesh.tp_size} but {type(module).__name__} has no tensor-parallel parameters: "
            f"parallelize it in configure_model (parallelize_module on self.device_mesh['tensor_parallel']) or "
            f"pass tensor_parallel_plan='auto' or a plan dict"
        )
    _replicate_over_tp(module, mesh)


def _replicate_over_tp(module: nn.Module, mesh: ParallelMesh) -> None:
    """Give every tensor-parallel rank of a replicated model tp rank 0's values, as DDP gives every rank rank 0's at
    construction: the engine reduces over dp only, so tp ranks that started apart would train apart. Tensors still on
    meta are left to the sharded build, which draws the same values on every rank."""
    tp = mesh.tp_collectives
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.device.type != "meta":
                tp.broadcast(tensor, src=0, label="replicate over tp").wait()


def _is_parallelized(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())
