"""compose_model: the one function that turns a user's model into this rank's trained-in-parallel part of it.

Every adapter (Lightning's ZeroStrategy, Fabric's ZeroFabricStrategy, Accelerate's ZeroAccelerator, and through it the
Hugging Face Trainer) calls it; adapters only translate their framework's hooks into its arguments. It has the shape
of torchtitan's ``parallelize_llama``: one pass, in an order each step of which states why it comes where it does.

Note: [The order of composition]
  0. The mesh is built once, before this function (:func:`build_mesh`): Lightning hands it to ``configure_model`` as
     ``self.device_mesh``, and user code builds on it before any model exists.
  1. Tensor parallelism: the user's ``parallelize_fn`` and/or the configured plan turn weights into DTensors. First,
     because every later step sees parameters: Ulysses reads the local head count, the pipeline cut keeps the
     (already split) pieces, the engine flattens local shards.
  2. Ulysses attention: the attention function swapped for one that all-to-alls over the sequence-parallel group.
     After tensor parallelism (it splits the heads that rank holds) and before the cut (the cut must not drop it).
  3. The pipeline cut: this rank keeps its stages' pieces and deletes the rest, in place; tied copies are marked
     for the engine (:mod:`ds_strategy.zero.tied_copies`). Before placement, so that pieces other ranks own are
     never moved or converted, and before the optimizer is built (Lightning's ``configure_optimizers``), so that it
     holds this rank's parameters only.
  4. Placement and dtype, one rule for every adapter: under a "-true" precision the module becomes 16-bit; the whole
     module moves to the device unless the engine places it itself, one unit at a time (stage 3, or a model built on
     the meta device, which it initialises shard by shard): the whole model is never materialised on the device.
  5. The optimizer, if the adapter builds it late (Lightning); one built early (Fabric, Accelerate) was rebound to
     the parameters steps 1 and 3 left (:mod:`.early_optimizer`).
  6. Activation checkpointing of the engine's units: after "auto" sizes are resolved and before the engine, whose
     units are the checkpointed modules (chosen from parameter counts, which stage 3 would empty).
  7. The engine, over the ZeRO group of the mesh, with its step runner given as an argument (offload's, when the
     config offloads); then what other features need from it set through its public methods.
  8. The pipeline runner, which drives the engine through its schedule interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.optim import Optimizer

from ..comm.group_collectives import collectives_for
from ..config import ZeroConfig
from ..config.auto_values import hidden_size_of
from ..offload import step_runner_for
from ..parallel.mesh import ParallelMesh, build_parallel_mesh
from ..parallel.pipeline_split import StagePlan, cut_to_stages, plan_stages
from ..parallel.ulysses import attend_with_ulysses, gradient_divide_factor
from ..zero.engine import ZeroEngine
from ..zero.groups import EngineGroups
from ..zero.sharded_optimizers import as_optimizer_list
from ..zero.tied_copies import mark_tied_copy
from ..zero.wrap_policy import select_unit_modules
from .activation_checkpointing import apply_activation_checkpointing
from .early_optimizer import rebind_optimizer
from .pipeline_runner import PipelineRunner
from .tensor_parallel import apply_tensor_parallelism

Unparallelized = Literal["require", "replicate", "auto"]


@dataclasses.dataclass
class Composed:
    """What :func:`compose_model` made: the module the adapter hands back to the user (a ``parallelize_fn`` may
    return it compiled), the engine (with the optimizer it retargeted), and under pipelining the stage plan and
    runner."""

    module: nn.Module
    engine: ZeroEngine
    stage_plan: StagePlan | None = None
    pipeline: PipelineRunner | None = None


def build_mesh(config: ZeroConfig, device_type: str, names: dict[str, str] | None = None) -> ParallelMesh:
    """Step 0: the run's one mesh, its dimensions under the host framework's ``names`` (default: "pp", "dp", "sp",
    "tp")."""
    return build_parallel_mesh(
        device_type,
        config.tensor_parallel_size,
        names,
        sequence_parallel_size=config.sequence_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
    )


def compose_model(
    module: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] | Callable[[], Optimizer | Sequence[Optimizer] | None] | None,
    config: ZeroConfig,
    *,
    mesh: ParallelMesh | None,
    device: torch.device,
    log: Callable[[str], Any],
    parallelize_fn: Callable[[nn.Module], nn.Module] | None = None,
    unparallelized: Unparallelized = "require",
    place: bool = True,
) -> Composed:
    """Compose ``module`` in the order of Note: [The order of composition].

    ``optimizer``: built over ``module``'s parameters before this call (or several, each over its own parameters:
    Muon and AdamW), or a function that builds it (or them) once the model is cut and placed (step 5), or None (an
    engine without one: evaluation, a frozen teacher). ``mesh``: the mesh
    from :func:`build_mesh`, or None without model parallelism. ``parallelize_fn``: the user's tensor-parallel
    function, already bound to the mesh. ``unparallelized``: what tensor parallelism does with a model that arrives
    with no DTensor parameters and no configured plan: "require" raises (Fabric), "replicate" runs it whole on every
    tensor-parallel rank (Lightning's ModelParallelStrategy), "auto" applies the auto plan (Accelerate). ``place``:
    the adapter's device placement flag (Accelerate's ``device_placement``); stage 3 and meta builds are placed by
    the engine either way. ``log``: the framework's rank-zero logger, for the engine's summary.
    """
    mesh = _model_parallel(mesh, config)
    early = [] if optimizer is None or callable(optimizer) else as_optimizer_list(optimizer)
    stage_plan: StagePlan | None = None

    def parallelize(model: nn.Module) -> nn.Module:  # steps 1-3, which replace or delete parameters
        nonlocal stage_plan
        model = _tensor_parallel(model, mesh, config, parallelize_fn, unparallelized)
        inner = _uncompiled(model)
        if mesh is not None and mesh.sp_group is not None:
            attend_with_ulysses(inner, mesh.sp_group, tensor_parallel_size=mesh.tp_size)
        stage_plan = _cut_for_pipeline(inner, config, mesh)
        return model

    module = rebind_optimizer(module, early, parallelize)
    _place(_uncompiled(module), config, device, place)
    if callable(optimizer):  # an Optimizer (or a list) is not callable: this is the adapter's builder (step 5)
        optimizer = optimizer()
    return _engine_and_runner(module, optimizer, config, mesh, device, log, stage_plan)


def recompose_engine(
    module: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] | None,
    config: ZeroConfig,
    *,
    mesh: ParallelMesh | None,
    device: torch.device,
    log: Callable[[str], Any],
    stage_plan: StagePlan | None = None,
) -> Composed:
    """Steps 6-8 of Note: [The order of composition] over a model :func:`compose_model` already composed (and
    ``stage_plan``, its cut): the last part of ``compose_model``, and on its own a new engine for a model whose
    first engine's flat buffers do not fit its optimizer (Accelerate's Note: [An optimizer prepared after its
    model]); the caller removed the old engine's hooks."""
    return _engine_and_runner(module, optimizer, config, _model_parallel(mesh, config), device, log, stage_plan)


def _engine_and_runner(
    module: nn.Module,
    optimizer: Optimizer | Sequence[Optimizer] | None,
    config: ZeroConfig,
    mesh: ParallelMesh | None,
    device: torch.device,
    log: Callable[[str], Any],
    stage_plan: StagePlan | None,
) -> Composed:
    """Steps 6-8 over ``mesh`` as :func:`_model_parallel` left it."""
    inner = _uncompiled(module)
    if config.has_auto_values:
        config = config.resolve_auto(hidden_size_of(inner))
    if stage_plan is not None and not config.unit_modules and not config.unit_min_params:
        config = dataclasses.replace(config, unit_modules=(stage_plan.block_class,))  # a stage may hold one block
    units = select_unit_modules(inner, config.unit_modules, config.unit_min_params)
    apply_activation_checkpointing(inner, config.activation_policy, units, mesh.tp_group if mesh is not None else None)
    groups = EngineGroups()
    if mesh is not None:
        groups = EngineGroups(zero=mesh.zero_group, tensor_parallel=mesh.tp_group, pipeline=mesh.pp_group)
    engine = ZeroEngine(inner, optimizer, config, groups, device=device, step_runner=step_runner_for(config))
    if mesh is not None and mesh.sp_size > 1:
        engine.set_gradient_divide_factor(gradient_divide_factor(engine.world_size, mesh.sp_size))
    pipeline = None
    if stage_plan is not None:
        engine.set_state_dict_names(stage_plan.whole_names)
        pipeline = PipelineRunner(
            inner, engine.driven_by_schedule(), stage_plan, mesh, config.parallelism_policy, device
        )
    log(engine.summary())
    return Composed(module, engine, stage_plan, pipeline)


def _model_parallel(mesh: ParallelMesh | None, config: ZeroConfig) -> ParallelMesh | None:
    """``mesh``, or None when it has no model-parallel dimension: ZeRO then shards over the default group. Its
    model-parallel groups' collectives (tensor-parallel sums, Ulysses all-to-alls, the pipeline's loss and tied
    weights) wait as long as the engine's: ``collective_timeout``."""
    if mesh is None or max(mesh.tp_size, mesh.sp_size, mesh.pp_size) == 1:
        return None
    for group in (mesh.tp_group, mesh.sp_group, mesh.pp_group):
        if group is not None:
            collectives_for(group, timeout=config.collective_timeout)
    return mesh


def _uncompiled(module: nn.Module) -> nn.Module:
    """The model inside a ``torch.compile`` wrapper: the engine holds it, under its own parameter names."""
    return module._orig_mod if isinstance(module, OptimizedModule) else module


def _tensor_parallel(
    module: nn.Module,
    mesh: ParallelMesh | None,
    config: ZeroConfig,
    parallelize_fn: Callable[[nn.Module], nn.Module] | None,
    unparallelized: Unparallelized,
) -> nn.Module:
    """Step 1: the user's function, then the configured plan (or the check that the model is parallelized)."""
    if mesh is None or mesh.tp_size == 1:
        return module
    if parallelize_fn is not None:
        module = parallelize_fn(module)
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
    apply_tensor_parallelism(
        _uncompiled(module),
        mesh,
        config.parallelism_policy,
        default_plan="auto" if unparallelized == "auto" else None,
        replicate_unparallelized=unparallelized == "replicate",
    )
    return module


def _cut_for_pipeline(module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None) -> StagePlan | None:
    """Step 3: plan the stages (a split that cannot be made raises before anything is cut), cut ``module`` down to
    this rank's in place, and mark the tied copies it keeps of parameters another stage owns."""
    if config.pipeline_parallel_size == 1:
        return None
    plan = plan_stages(module, mesh.pp_size, mesh.pp_rank, config.pipeline_schedule, config.pipeline_split)
    cut_to_stages(module, plan)
    present = dict(module.named_parameters())
    for name, owner in plan.tied_copies(module).items():
        mark_tied_copy(present[name], owner)
    return plan


def _place(module: nn.Module, config: ZeroConfig, device: torch.device, place: bool) -> None:
    """Step 4: the "-true" dtype, then the device, unless the engine places the model itself (Note: [The order of
    composition])."""
    if config.plan.converts_module:
        module.to(dtype=config.plan.compute_dtype)
    built_on_meta = any(p.is_meta for p in module.parameters())
    if place and not config.plan.partitions_parameters and not built_on_meta:
        module.to(device)
