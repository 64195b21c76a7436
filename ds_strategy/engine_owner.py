"""What every framework adapter that owns a ZeroEngine shares: how it builds one, the strategy names, the reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .activation_memory import apply_activation_checkpointing, remove_activation_checkpointing
from .auto_values import hidden_size_of
from .config import ZeroConfig
from .parallel.mesh import ParallelMesh
from .parallel.pipeline_split import StagePlan, cut_to_stages, plan_stages
from .parallel.ulysses import gradient_scale
from .zero.engine import ZeroEngine

# Strategy names every adapter registers (Lightning, pytorch_lightning, Fabric, Hydra's ``strategy`` group), and
# the ZeroConfig fields each one sets.
PRESETS: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0},
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3},
    "zero2_offload": {"stage": 2, "offload_optimizer": "cpu", "pin_memory": True},
    "zero3_offload": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu", "pin_memory": True},
}


def build_engine(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: ZeroConfig,
    *,
    device: torch.device,
    log: Callable[[str], Any],
    mesh: ParallelMesh | None = None,
    stage_plan: StagePlan | None = None,
) -> ZeroEngine:
    """The one way the adapters build an engine, in this order: ``config``'s "auto" sizes resolved from ``module``'s
    hidden size, and its units checkpointed as ``config.activation_checkpointing`` says, both before stage 3
    shards it (they read parameter shapes, and the checkpointed units must be the engine's units, which are chosen
    from parameter counts); the engine built on ``device``; its summary handed to ``log`` (the framework's
    rank-zero logger). Checkpointing replaces the units' ``forward`` only, so the engine finds the same names and
    its hooks see one forward per unit (Note: [Activation checkpointing under stage 3]). With a ``mesh`` the
    engine shards over its ZeRO group (data x sequence parallel) and multiplies the loss by the sequence-parallel
    size for backward (Note: [Ulysses gradient scale]), and ``partition_activations`` splits checkpointed inputs
    over its tensor-parallel group; without one (or with tp=1) inputs stay whole, as DeepSpeed does without a
    model-parallel unit. With a ``stage_plan`` (``module`` already cut by :func:`cut_for_pipeline`) the engine
    holds this rank's pipeline stages: its units are the plan's blocks, it spans the pipeline group in norms and
    takes gradients from :class:`~ds_strategy.compose.pipeline_runner.PipelineRunner` (Note: [Pipeline gradients]).
    """
    if config.has_auto_values:
        config = config.resolve_auto(hidden_size_of(module))
    from_mesh = {}
    if mesh is not None:
        from_mesh = {
            "process_group": mesh.zero_group,
            "tensor_parallel_group": mesh.tp_group,
            "loss_multiplier": gradient_scale(mesh.sp_size),
        }
    if stage_plan is not None:
        from_mesh.update(
            pipeline_group=mesh.pp_group,
            tied_copies=stage_plan.tied_copies(module),
            whole_model_names=stage_plan.whole_names,
            gradients_from_hooks=False,
        )
        if not config.unit_modules and not config.unit_min_params:  # a stage may hold a single block
            config = dataclasses.replace(config, unit_modules=(stage_plan.block_class,))
    apply_activation_checkpointing(module, config, from_mesh.get("tensor_parallel_group"))
    engine = ZeroEngine(module, optimizer, config, device=device, **from_mesh)
    log(engine.summary())
    return engine


def cut_for_pipeline(module: nn.Module, config: ZeroConfig, mesh: ParallelMesh | None) -> StagePlan | None:
    """With ``pipeline_parallel_size > 1``: plan the stages (errors before any process group work beyond the
    mesh) and cut ``module`` down to this rank's in place; call before the optimizer is built over what remains."""
    if config.pipeline_parallel_size == 1:
        return None
    plan = plan_stages(module, mesh.pp_size, mesh.pp_rank, config.pipeline_schedule, config.pipeline_split)
    cut_to_stages(module, plan)
    return plan


class EngineOwnerMixin:
    """Reports, teardown and name registration for a strategy class whose ``engine`` is a ZeroEngine (or None
    before setup). Mixed in ahead of the framework's strategy base, whose ``teardown`` it extends."""

    engine = None

    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes per kind of model state and place; see :func:`ds_strategy.zero.memory_report`."""
        return self.engine.memory_report()

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind since setup; see ``ZeroEngine.comm_stats``."""
        return self.engine.comm_stats()

    def load_pretrained(self, path, prefix: str = "") -> None:
        """Load pretrained weights into the set-up model, each rank reading only its shards (after
        ``fabric.setup``; in Lightning from a hook such as ``on_fit_start``); see ``ZeroEngine.load_weights``."""
        if self.engine is None:
            raise RuntimeError(
                "load_pretrained needs the model set up first (fabric.setup, or a Lightning hook from on_fit_start on)"
            )
        self.engine.load_weights(path, prefix)

    def teardown(self) -> None:
        if self.engine is not None:
            release_engine(self.engine)
        else:  # setup failed: the error already raised must not be followed by another from moving meta tensors
            _drop_meta_tensors(getattr(self, "lightning_module", None))
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, fields in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"ZeRO {fields}", **fields)


def _drop_meta_tensors(module) -> None:
    """Point the meta parameters and buffers of a module whose setup failed at empty CPU tensors, so teardown's
    ``module.cpu()`` succeeds; such a model is unusable either way, and allocating it whole could run out of memory."""
    if module is None:
        return
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p.is_meta:
                torch.utils.swap_tensors(p, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), p.requires_grad))
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_meta:
                sub._buffers[name] = torch.empty(0, dtype=buffer.dtype)


def release_engine(engine: ZeroEngine) -> None:
    """What a strategy's teardown undoes on its model: full parameters back to shards, the engine's hooks and its
    activation checkpointing removed."""
    engine.reshard()
    engine.remove_hooks()
    remove_activation_checkpointing(engine.module)
