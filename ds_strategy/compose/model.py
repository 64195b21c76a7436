"""compose_model: the one function that turns a user's model into this rank's trained-in-parallel part of it.

Every adapter (Lightning's ZeroStrategy, Fabric's ZeroFabricStrategy, Accelerate's ZeroAccelerator, and through it the
Hugging Face Trainer) calls it; adapters only translate their framework's hooks into its arguments. It has the shape
of torchtitan's ``parallelize_llama``: one pass, in an order each step of which states why it comes where it does.

Note: [The order of composition]
  0. The mesh is built once, before this function (:func:`build_mesh`): Lightning hands it to ``configure_model`` as
     ``self.device_mesh``, and user code builds on it before any model exists. It owns the collectives of each
     model-parallel dimension, which every later step takes from it.
  1. The names of the early optimizer's parameters (Fabric, Accelerate: built before composition), taken before
     steps 2 and 4 replace or delete parameters; an optimizer that has stepped is refused here, before anything
     changes (:mod:`.early_optimizer`).
  2. Tensor parallelism: the user's ``parallelize_fn`` and/or the configured plan turn weights into DTensors. Early,
     because every later step sees parameters: Ulysses reads the local head count, the pipeline cut keeps the
     (already split) pieces, the engine flattens local shards. The function may return the model compiled: the
     adapter hands that back, and every later step works on the model inside the wrapper, under its own names.
  2b. Expert parallelism: every experts container of a mixture-of-experts model (:mod:`ds_strategy.parallel.
     moe_layers` finds them) keeps this rank's experts and routes tokens over the expert-parallel group
     (:mod:`ds_strategy.parallel.expert_parallel`). Beside tensor parallelism (which it does not compose with yet),
     and like it before the cut, placement and the optimizer, which then see this rank's experts only; the engine
     (step 9) shards them over the expert-data-parallel group.
  3. Ulysses attention: the attention function swapped for one that all-to-alls over the sequence-parallel group.
     After tensor parallelism (it splits the heads that rank holds) and before the cut (the cut must not drop it).
     Then sequence tiling (:mod:`ds_strategy.sequence_tiling`): MLPs and the causal-LM loss over tiles of the
     sequence; after tensor parallelism too (a tensor-parallel LM head is refused), and it moves no parameter.
  4. The pipeline cut: this rank keeps its stages' pieces and deletes the rest, in place; the stage plan it
     returns says what the engine must know of the whole model (:mod:`ds_strategy.zero.model_part`). Before
     placement, so that pieces other ranks own are never moved or converted, and before the optimizer is built
     (Lightning's ``configure_optimizers``), so that it holds this rank's parameters only.
  5. The early optimizer rebound, by the names of step 1, to the parameters steps 2 and 4 left.
  6. Placement and dtype, one rule for every adapter: under a "-true" precision the module becomes 16-bit; the whole
     module moves to the device unless the engine places it itself, one unit at a time (stage 3, or a model built on
     the meta device, which it initialises shard by shard): the whole model is never materialised on the device.
  7. The optimizer built, if the adapter builds it late (Lightning), over the cut and placed model.
  8. The engine's units and activation checkpointing: "auto" sizes resolved from the placed model (the one new
     config of the composition, which the engine reads), the units chosen once (under pipelining with no unit
     policy configured, one per block: a stage may hold a single block) and checkpointed. Before the engine, whose
     units are the checkpointed modules (chosen from parameter counts, which stage 3 would empty).
  9. The engine, over the ZeRO group of the mesh and its model-parallel collectives, with the units step 8 chose,
     its step runner given as an argument (offload's, when the config offloads) and under pipelining what it must
     know of the whole model, all at construction; then what Ulysses needs of it, set through a public method.
  10. The pipeline runner, which drives the engine through its schedule interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..config.auto_values import hidden_size_of
from ..offload import step_runner_for
from ..parallel.expert_parallel import is_expert_parallel, shard_experts
from ..parallel.mesh import ParallelMesh, build_parallel_mesh
from ..parallel.moe_layers import find_experts_containers
from ..parallel.pipeline_split import StagePlan, cut_to_stages, plan_stages
from ..parallel.ulysses import attend_with_ulysses, gradient_divide_factor
from ..pipeline import PipelineRunner, model_part
from ..sequence_tiling import apply_sequence_tiling
from ..zero.engine import ZeroEngine
from ..zero.groups import EngineGroups, ExpertShards
from ..zero.sharded_optimizers import as_optimizer_list
from ..zero.wrap_policy import select_unit_modules
from .activation_checkpointing import apply_activation_checkpointing
from .early_optimizer import names_of_parameters, rebind_optimizers
from .tensor_parallel import NOT_PARALLELIZED_HERE, TensorParallelism, apply_tensor_parallelism


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
    "tp"), owning each model-parallel dimension's collectives with the configured ``collective_timeout``."""
    return build_parallel_mesh(
        device_type,
        config.tensor_parallel_size,
        names,
        sequence_parallel_size=config.sequence_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        collective_timeout=config.collective_timeout,
        expert_parallel_size=config.expert_parallel_size,
    )


def compose_model(
    module: nn.Module,
    config: ZeroConfig,
    *,
    mesh: ParallelMesh | None,
    device: torch.device,
    log: Callable[[str], Any],
    optimizers: Sequence[Optimizer] | Callable[[], Sequence[Optimizer]] = (),
    tensor_parallel: TensorParallelism = NOT_PARALLELIZED_HERE,
    place: bool = True,
) -> Composed:
    """Compose ``module`` in the order of Note: [The order of composition].

    ``mesh``: from :func:`build_mesh`, or None without model parallelism. ``log``: the framework's rank-zero logger,
    for the engine's summary. The adapters differ only in their answers to three questions:

    - ``optimizers``: those built over ``module``'s parameters before this call (Fabric, Accelerate; several, each
      over its own parameters: Muon and AdamW), or a function that builds them once the model is cut and placed
      (Lightning's ``configure_optimizers``), or none (an engine without one: evaluation, a frozen teacher);
    - ``tensor_parallel``: the user's ``parallelize_fn``, already bound to the mesh (Fabric), and what becomes of a
      model that arrives with no tensor-parallel layers and no configured plan (:class:`.Unparallelized`: the
      automatic plan for Accelerate, replicated for Lightning, refused for Fabric);
    - ``place``: the adapter's device placement flag (Accelerate's ``device_placement``); stage 3 and meta builds
      are placed by the engine either way.
    """
    mesh = _model_parallel(mesh)
    early = [] if callable(optimizers) else as_optimizer_list(optimizers)
    names = names_of_parameters(module, early)  # 1
    module, inner = _tensor_parallel(module, mesh, config, tensor_parallel)  # 2
    _expert_parallel(inner, mesh)  # 2b
    _sequence(inner, config, mesh)  # 3
    stage_plan = _cut_for_pipeline(inner, config, mesh)  # 4
    rebind_optimizers(early, names, module)  # 5
    _place(inner, config, device, place)  # 6
    built = as_optimizer_list(optimizers()) if callable(optimizers) else early  # 7
    config, units = _units(inner, config, mesh, stage_plan)  # 8
    engine = _engine(inner, built, config, mesh, device, stage_plan, units)  # 9
    pipeline = _pipeline_runner(inner, engine, config, mesh, device, stage_plan)  # 10
    log(engine.summary())
    return Composed(module, engine, stage_plan, pipeline)


def recompose_engine(
    module: nn.Module,
    optimizers: Sequence[Optimizer],
    config: ZeroConfig,
    *,
    mesh: ParallelMesh | None,
    device: torch.device,
    log: Callable[[str], Any],
    stage_plan: StagePlan | None = None,
) -> Composed:
    """Steps 8-10 of Note: [The order of composition] over a model :func:`compose_model` already composed (and
    ``stage_plan``, its cut): a new engine for a model whose first engine's flat buffers do not fit its optimizer
    (Accelerate's Note: [An optimizer prepared after its model]); the caller removed the old engine's hooks."""
    mesh, inner = _model_parallel(mesh), _uncompiled(module)
    config, units = _units(inner, config, mesh, stage_plan)
    engine = _engine(inner, as_optimizer_list(optimizers), config, mesh, device, stage_plan, units)
    pipeline = _pipeline_runner(inner, engine, config, mesh, device, stage_plan)
    log(engine.summary())
    return Composed(module, engine, stage_plan, pipeline)


def _model_parallel(mesh: ParallelMesh | None) -> ParallelMesh | None:
    """``mesh``, or None when it has no model-parallel dimension: ZeRO then shards over the default group."""
    if mesh is None or max(mesh.tp_size, mesh.sp_size, mesh.pp_size, mesh.ep_size) == 1:
        return None
    return mesh


def _uncompiled(module: nn.Module) -> nn.Module:
    """The model inside a ``torch.compile`` wrapper: the engine holds it, under its own parameter names."""
    return module._orig_mod if isinstance(module, OptimizedModule) else module


def _tensor_parallel(
    module: nn.Module, mesh: ParallelMesh | None, config: ZeroConfig, tensor_parallel: TensorParallelism
) -> tuple[nn.Module, nn.Module]:
    """Step 2: the user's function, then the configured plan (or the check that the model is parallelized); the
    module to hand back (the function may have compiled it) and the model inside it, which later steps work on."""
    if mesh is not None and mesh.tp_size > 1:
        if tensor_parallel.parallelize_fn is not None:
            module = tensor_parallel.parallelize_fn(module)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
        apply_tensor_parallelism(_uncompiled(module), mesh, config.parallelism_policy, tensor_parallel.unparallelized)
    return module, _uncompiled(module)


def _expert_parallel(module: nn.Module, mesh: ParallelMesh | None) -> None:
    """Step 2b: each experts container cut to this rank's experts, routing over the expert-parallel group."""
    if mesh is None or mesh.ep_size == 1:
        return
    for _, experts in find_experts_containers(module):
        shard_experts(experts, mesh.ep_collectives)


def _sequence(module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None) -> None:
    """Step 3: Ulysses attention over the mesh's sequence-parallel collectives, then sequence tiling."""
    if mesh is not None and mesh.sp_collectives is not None:
        attend_with_ulysses(module, mesh.sp_collectives, tensor_parallel_size=mesh.tp_size)
    if config.tiled_mlp or config.tiled_loss:
        apply_sequence_tiling(module, config.activation_policy)


def _cut_for_pipeline(module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None) -> StagePlan | None:
    """Step 4: plan the stages (a split that cannot be made raises before anything is cut) and cut ``module`` down
    to this rank's in place; the plan returned carries the meta pieces cut."""
    if config.pipeline_parallel_size == 1:
        return None
    plan = plan_stages(module, mesh.pp_size, mesh.pp_rank, config.pipeline_schedule, config.pipeline_split)
    return cut_to_stages(module, plan)


def _place(module: nn.Module, config: ZeroConfig, device: torch.device, place: bool) -> None:
    """Step 6: the "-true" dtype, then the device, unless the engine places the model itself (Note: [The order of
    composition])."""
    if config.plan.converts_module:
        module.to(dtype=config.plan.compute_dtype)
    built_on_meta = any(p.is_meta for p in module.parameters())
    if place and not config.plan.partitions_parameters and not built_on_meta:
        module.to(device)


def _units(
    module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None, stage_plan: StagePlan | None
) -> tuple[ZeroConfig, list[tuple[str, nn.Module]]]:
    """Step 8: ``config`` with its "auto" sizes resolved for ``module`` (what the engine reads), and the engine's
    units, chosen once and checkpointed, partitioning inputs over the tensor-parallel group. Under pipelining with
    no unit policy configured, a unit is one block (a stage may hold a single block)."""
    if config.has_auto_values:
        config = config.resolve_auto(hidden_size_of(module))
    unit_classes = config.unit_modules
    if stage_plan is not None and not unit_classes and not config.unit_min_params:
        unit_classes = (stage_plan.block_class,)
    units = select_unit_modules(module, unit_classes, config.unit_min_params)
    apply_activation_checkpointing(
        module, config.activation_policy, units, mesh.tp_collectives if mesh is not None else None
    )
    return config, units


def _engine(
    module: nn.Module,
    optimizers: list[Optimizer],
    config: ZeroConfig,
    mesh: ParallelMesh | None,
    device: torch.device,
    stage_plan: StagePlan | None,
    units: list[tuple[str, nn.Module]],
) -> ZeroEngine:
    """Step 9: the engine over the mesh's ZeRO group and model-parallel collectives, with ``units`` and what it must
    know of the whole model (:func:`~ds_strategy.pipeline.model_part`), then what Ulysses (the gradient divide
    factor) needs of it."""
    groups = EngineGroups()
    if mesh is not None:
        experts = _expert_shards(module, mesh)
        if experts is not None:
            held = {id(m) for _, m in experts.modules}
            units = [(name, unit) for name, unit in units if id(unit) not in held]
        groups = EngineGroups(
            mesh.zero_group, mesh.tp_collectives, mesh.pp_collectives, mesh.sp_collectives, experts=experts
        )
    engine = ZeroEngine(
        module,
        optimizers,
        config,
        groups,
        device=device,
        step_runner=step_runner_for(config),
        part=model_part(module, stage_plan),
        unit_modules=units,
    )
    if mesh is not None and mesh.sp_size > 1:
        engine.set_gradient_divide_factor(gradient_divide_factor(engine.world_size, mesh.sp_size))
    return engine


def _expert_shards(module: nn.Module, mesh: ParallelMesh) -> ExpertShards | None:
    """The experts containers step 2b sharded, for the engine to shard over the expert-data-parallel group."""
    if mesh.ep_size == 1:
        return None
    modules = tuple((name, m) for name, m in module.named_modules() if is_expert_parallel(m))
    return ExpertShards(modules, mesh.edp_group, mesh.ep_collectives)


def _pipeline_runner(
    module: nn.Module,
    engine: ZeroEngine,
    config: ZeroConfig,
    mesh: ParallelMesh | None,
    device: torch.device,
    stage_plan: StagePlan | None,
) -> PipelineRunner | None:
    """Step 10: under pipelining, the runner that drives the engine through its schedule interface."""
    if stage_plan is None:
        return None
    return PipelineRunner(module, engine, stage_plan, mesh, config.parallelism_policy, device)
