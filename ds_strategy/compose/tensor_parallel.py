"""What an adapter does with a model before it builds the engine under tensor parallelism: apply the configured
plan (or check that the user's code already parallelized the model), so the engine finds DTensor parameters.

Note: [An optimizer built before tensor parallelism]
Fabric's ``fabric.setup(model, optimizer)`` and Accelerate's ``prepare(model, optimizer)`` receive an optimizer built
over the model's ordinary parameters, and parallelizing the model (``parallelize_module``, a ``parallelize_fn``, a
plan) registers a new DTensor ``Parameter`` in place of each planned weight. The optimizer would then hold tensors
the model no longer has, so its param groups are pointed at the replacements by parameter name, before the engine
retargets it onto the flat shards. That is only sound while the optimizer holds no state (nothing has stepped yet):
state kept for an old tensor would not fit the local shard that replaced it, so such an optimizer is refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import ZeroConfig
from ..parallel.auto_plan import apply_tensor_parallel_plan, tensor_parallel_plan
from ..parallel.mesh import ParallelMesh


def parallelize_for_config(
    module: nn.Module,
    mesh: ParallelMesh | None,
    config: ZeroConfig,
    *,
    default_plan: str | None = None,
    replicate_unparallelized: bool = False,
) -> None:
    """Apply ``config.tensor_parallel_plan`` to ``module`` over ``mesh``'s tensor-parallel dimension, or, when the
    plan is None, require that the user's own code (``configure_model``, ``parallelize_fn``) did it.

    ``default_plan``: the plan for a model that arrives with no tensor-parallel parameters and no plan configured
    (Accelerate's "auto"); a model the user already parallelized is left as it is. ``replicate_unparallelized``:
    such a model instead runs whole on every tensor-parallel rank (Lightning's ModelParallelStrategy does)."""
    if mesh is None or mesh.tp_size == 1:
        return
    plan = config.tensor_parallel_plan
    if plan is None and not _is_parallelized(module):
        plan = default_plan
    if plan is not None:
        resolved = tensor_parallel_plan(module, mesh.tp_size, sequence_parallel=config.sequence_parallel, plan=plan)
        apply_tensor_parallel_plan(module, mesh.tp_mesh, resolved)
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
    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.device.type != "meta":
                dist.broadcast(tensor, group=mesh.tp_group, group_src=0)


def parallelize_with_optimizer(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, parallelize: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    """``parallelize(module)``, the model it returns, with ``optimizer``'s param groups pointed at the parameters
    that replaced the ones it held (see Note: [An optimizer built before tensor parallelism])."""
    if optimizer is None:
        return parallelize(module)
    if any(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer has already stepped (it holds state); tensor parallelism replaces the parameters it "
            "updates, so build it fresh before setup (see Note: [An optimizer built before tensor parallelism])"
        )
    name_of = {id(p): name for name, p in module.named_parameters()}
    parallelized = parallelize(module)
    # a parallelize_fn that compiles (the whole model or its blocks) puts "_orig_mod." into the names
    now = {name.replace("_orig_mod.", ""): p for name, p in parallelized.named_parameters()}
    for group in optimizer.param_groups:
        group["params"] = [now.get(name_of.get(id(p)), p) for p in group["params"]]
    return parallelized


def _is_parallelized(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def refuse_sequence_parallel(config: ZeroConfig, adapter: str) -> None:
    """Ulysses needs the strategy to slice batches' attention and scale gradients (Lightning's ZeroStrategy does);
    an adapter that does neither refuses it rather than train on the wrong gradients."""
    if config.sequence_parallel_size > 1:
        raise ValueError(
            f"ZeroConfig.sequence_parallel_size={config.sequence_parallel_size} is not supported by {adapter} yet; "
            f"use Lightning's ZeroStrategy for DeepSpeed-Ulysses, or sequence_parallel_size=1"
        )
