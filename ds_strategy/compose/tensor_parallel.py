"""Step 1 of the composition (Note: [The order of composition] in :mod:`.model`) under tensor parallelism: apply the
configured plan (or check that the user's code already parallelized the model), so the engine finds DTensor
parameters."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..config.policies import ParallelismPolicy
from ..parallel.auto_plan import apply_tensor_parallel_plan, tensor_parallel_plan
from ..parallel.mesh import ParallelMesh


def apply_tensor_parallelism(
    module: nn.Module,
    mesh: ParallelMesh | None,
    policy: ParallelismPolicy,
    *,
    default_plan: str | None = None,
    replicate_unparallelized: bool = False,
) -> None:
    """Apply ``policy.tensor_parallel_plan`` to ``module`` over ``mesh``'s tensor-parallel dimension, or, when the
    plan is None, require that the user's own code (``configure_model``, ``parallelize_fn``) did it.

    ``default_plan``: the plan for a model that arrives with no tensor-parallel parameters and no plan configured
    (Accelerate's "auto"); a model the user already parallelized is left as it is. ``replicate_unparallelized``:
    such a model instead runs whole on every tensor-parallel rank (Lightning's ModelParallelStrategy does)."""
    if mesh is None or mesh.tp_size == 1:
        return
    plan = policy.tensor_parallel_plan
    if plan is None and not _is_parallelized(module):
        plan = default_plan
    if plan is not None:
        resolved = tensor_parallel_plan(module, mesh.tp_size, sequence_parallel=policy.sequence_parallel, plan=plan)
        apply_tensor_parallel_plan(module, mesh.tp_mesh, resolved, mesh.tp_collectives)
    if _is_parallelized(module):
        return
    if not replicate_unparallelized:
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
