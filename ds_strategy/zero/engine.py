"""ZeroEngine: one engine for ZeRO stages 0-3, independent of any training framework."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import Collectives
from ..comm.quantized import reduce_scatter_quantized
from ..comm.sequence_check import CollectiveSequenceCheck
from ..config import ZeroConfig
from ..precision import GradStats, LossScaler
from ..profiler_ranges import profiler_range
from . import full_gradients
from .comm_books import connect
from .flat_param import FlatParam
from .full_state_dict import compute_weights, gathered_state_dict, master_weights
from .gathering import Gathering
from .grad_reducer import GradReducer
from .groups import EngineGroups
from .layout import Ranks, lay_out
from .materialise import device_of, materialise
from .memory_report import WorkingSetPeak, memory_report, summary, unit_bounded_sizes
from .model_part import ModelPart
from .optimizer_step import OptimizerStep
from .param_gatherer import ParamGatherer
from .param_refresh import ParamRefresh
from .replaced_parameters import adopt_replaced_parameters
from .schedule_interface import ScheduleInterface
from .sharded_optimizers import ShardedOptimizers, as_optimizer_list
from .step_runner import StepContext, StepRunner, StepRunnerFactory, runner_factory
from .unit import Unit, units_by_flat_param
from .wrap_policy import select_unit_modules


class ZeroEngine:
    """Shards a module's trainable parameters, gradients and optimizer state across the ranks of a process group.

    The module is cut into units (see :mod:`.wrap_policy`); each unit's trainable parameters, split by optimizer
    and param group, live in :class:`FlatParam` buffers whose :class:`ShardPolicy` comes from ``config.plan``.
    The host framework drives it with ``backward`` (or a plain ``loss.backward()``), ``clip_grad_norm_``,
    ``step`` and ``no_sync``; nothing here knows about Lightning, Fabric or Accelerate.

    Several optimizers may train one model (Muon on the hidden matrices and AdamW on the rest): each owns its
    parameters' shards, and ``step``, ``zero_grad``, ``clip_grad_norm_`` and ``grad_norm`` take the optimizer to act
    for (None: all of them, as one process clipping ``model.parameters()`` computes one norm over every parameter).

    It is a façade: each job is a collaborator's (ARCHITECTURE.md), the layout of units and flat buffers
    (:func:`.layout.lay_out`), materialisation (:mod:`.materialise`), communication and its books
    (:mod:`.comm_books`), gathering around forwards (:class:`.gathering.Gathering`), reduction
    (:class:`.grad_reducer.GradReducer`) and the optimizer step (:class:`.optimizer_step.OptimizerStep`). What other
    features need from the engine they set through public methods after construction, as torch's pipeline stages
    drive FSDP2: :meth:`set_gradient_divide_factor` (Ulysses) and :meth:`driven_by_schedule` (a pipeline schedule
    hands gradients over).

    Note: [Expert units]
    Experts containers (``EngineGroups.experts``) are units of their own (:func:`.layout.lay_out`), each nested
    in its layer's, holding every parameter inside it (the layer's unit takes none of them), sharded,
    gathered and reduced over the expert-data-parallel group, so that its flat buffers are laid out for that
    group's size and its all-gathers and reduce-scatters never mix two ranks' different experts. Everything
    else, the step, the norm and the overflow check included, treats them as any unit. The expert-parallel
    group's token all-to-alls move as many rows as each rank's tokens chose, so their sizes differ by rank:
    they are counted in ``comm_stats`` but left out of the per-step sequence check, which compares sizes.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        config: ZeroConfig,
        groups: EngineGroups | None = None,
        device: torch.device | str | None = None,
        step_runner: StepRunnerFactory | None = None,
        part: ModelPart | None = None,
        unit_modules: Sequence[tuple[str, nn.Module]] | None = None,
    ):
        """``optimizer``: the optimizer that trains ``module``, several (each holding its own parameters), or None.
        ``groups``: the process groups the engine spans (see :class:`.groups.EngineGroups`; None: ZeRO over the
        default group, nothing else). ``step_runner``: where the optimizer step runs (see :mod:`.step_runner`); by
        default on the device. A config that offloads needs the runner passed (``ds_strategy.offload.
        step_runner_for(config)``; the composition function does it): the engine never reaches for offload itself.
        ``part``: what the engine must know of a larger model ``module`` is part of (a pipeline stage's share: the
        whole model's names, each parameter's norm share and saved name, pieces cut away; see :mod:`.model_part`),
        or None for a whole model. ``unit_modules``: the (name, module) pairs that become units, as the caller
        chose them (the composition function, which checkpoints the same modules); None: chosen here by the
        config's unit policy (:func:`.wrap_policy.select_unit_modules`).
        """
        groups = groups or EngineGroups()
        self.module, self.config, self.plan = module, config, config.plan
        self.sharded_optimizers = ShardedOptimizers(as_optimizer_list(optimizer))
        self.process_group = groups.zero
        self.device = torch.device(device) if device is not None else device_of(module)
        self.part = part or ModelPart()
        self.whole_model_names: tuple[str, ...] = self.part.whole_names
        # communication first: units gather through it
        comm = connect(groups, config)
        self.collectives, self.expert_collectives, self.tp_collectives = comm.zero, comm.experts, comm.tensor_parallel
        self.model_parallel, self.weight_gather, self.books = comm.model_parallel, comm.weight_gather, comm.books
        self.rank, self.world_size, self.experts = self.collectives.rank, self.collectives.world_size, groups.experts
        # then units and their flat buffers, placed or initialised on the device
        factory = runner_factory(step_runner, config)
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        shard_store = factory.shard_store(config.offload_policy, global_rank)
        self._build_units(unit_modules, shard_store)
        materialise(module, self.units, self.device, self.collectives, config, self.part.cut_pieces)
        # after construction's broadcasts; token all-to-alls differ in size by rank (Note: [Expert units])
        self.books.start_sequence_check({"ep": self.experts.parallel} if self.experts is not None else {})
        for fp in self.flat_params:
            fp.allocate_grads(self.plan.comm_dtype, self.collectives.use_all_reduce)
        # then the step runner, which may move shards and masters off the device, before the optimizer is pointed
        # at the masters (once, wherever they now live)
        self.step_runner: StepRunner = factory(
            StepContext(self.flat_params, self.optimizers, config.offload_policy, self.device, global_rank, shard_store)
        )
        self.sharded_optimizers.retarget(self.flat_params)
        self._build_step()

    # -- construction -------------------------------------------------------------------------------------------
    def _build_units(self, unit_modules: Sequence[tuple[str, nn.Module]] | None, shard_store) -> None:
        """The units and their flat buffers as :func:`.layout.lay_out` lays them out, each over its group."""
        if unit_modules is None:
            unit_modules = select_unit_modules(self.module, self.config.unit_modules, self.config.unit_min_params)
        expert_units = list(self.experts.modules) if self.experts is not None else []
        experts = self.expert_collectives
        layout = lay_out(
            self.module,
            list(unit_modules) + expert_units,
            len(expert_units),
            self.sharded_optimizers,
            self.plan,
            self.part,
            Ranks(self.rank, self.world_size),
            Ranks(experts.rank, experts.world_size) if experts is not None else None,
            self.tp_collectives.world_size if self.tp_collectives is not None else 1,
            self.device,
            shard_store.store if shard_store is not None else None,
        )
        self.saved_as = layout.saved_as
        self.units = [
            Unit(u.name, u.module, u.flat_params, experts if u.expert else self.collectives, self.weight_gather)
            for u in layout.units
        ]
        self.flat_params = [fp for unit in self.units for fp in unit.flat_params]
        self.unit_of = units_by_flat_param(self.units)

    def _build_step(self) -> None:
        """The stage-3 gatherer and the gradient reducer, which calls it from autograd's hooks, then the optimizer
        step over what the reducer leaves; all sized by the units (:func:`.memory_report.unit_bounded_sizes`)."""
        config = self.config
        self.working_set = WorkingSetPeak(self.flat_params)
        sizes = unit_bounded_sizes(config.comm_policy, self.units)
        self.loss_scaler = LossScaler(config.precision_policy) if self.plan.loss_scaling else None
        self.gatherer = None
        if self.plan.partitions_parameters:  # without overlap_comm nothing is prefetched: units gather on demand
            prefetch = sizes.prefetch if config.overlap_comm else 0
            self.gatherer = ParamGatherer(
                self.units, self.units[0], config.reshard_after_forward, prefetch, sizes.max_live, self.working_set
            )
        self.gathering = Gathering(self.module, self.units, self.unit_of, self.gatherer, self.weight_gather)
        self.reducer = self._gradient_reducer(sizes.reduce_bucket)
        self.reducer.register_hooks()
        refresher = ParamRefresh(self.flat_params, self.unit_of, sizes.reduce_bucket, config.allgather_bucket_size)
        self.optimizer_step = OptimizerStep(
            self.flat_params,
            self.sharded_optimizers,
            self.reducer,
            self.step_runner,
            refresher,
            self.gatherer,
            self.loss_scaler,
            self.collectives,
            self.model_parallel,
            self.device,
            self.plan.partitions_optimizer,
        )
        self.gathering.register_hooks()

    def _gradient_reducer(self, bucket_numel: int) -> GradReducer:
        """The reducer of every flat buffer's gradients, calling back into the stage-3 gatherer (when there is one)
        as units' reductions are launched and at the end of backward."""
        cfg = self.config
        qgz = None
        if cfg.zero_quantized_gradients:
            qgz = functools.partial(reduce_scatter_quantized, self.collectives, bits=cfg.zero_quantized_gradients_bits)
        return GradReducer(
            self.flat_params,
            self.unit_of,
            self.collectives,
            overlap=cfg.overlap_comm,
            bucket_numel=bucket_numel,
            comm_dtype=self.plan.comm_dtype,
            working_set=self.working_set,
            on_launched=self.gathering.on_flat_param_launched if self.gatherer is not None else None,
            on_backward_end=self.gathering.end_of_backward if self.gatherer is not None else None,
            on_reduced=self.step_runner.on_reduced,
            quantized_reduce_scatter=qgz,
            gradients=self.step_runner.gradients,
        )

    @property
    def comm_groups(self) -> dict[str, Collectives]:
        """The groups ``comm_stats`` counts, by name (see :meth:`comm_stats`)."""
        return self.books.groups

    @property
    def sequence_check(self) -> CollectiveSequenceCheck | None:
        return self.books.sequence_check

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers that train the module, each over its own parameters' shards (empty for none)."""
        return tuple(self.sharded_optimizers.optimizers)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The first of :attr:`optimizers` (the only one, usually), or None."""
        return self.optimizers[0] if self.optimizers else None

    def holds(self, optimizer: object) -> bool:
        """Whether ``optimizer`` (the object itself, or a chain of them) trains this engine's module."""
        return self.sharded_optimizers.holds(optimizer)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give an engine built without it (a model prepared before its optimizers) an optimizer that trains it
        (or a :class:`~.chained_optimizer.ChainedOptimizer` of several): see :meth:`ShardedOptimizers.attach`."""
        self.sharded_optimizers.attach(optimizer, self.flat_params, self.plan)

    def can_attach(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether :meth:`attach_optimizer` can take ``optimizer`` without laying the flat buffers out anew."""
        return self.sharded_optimizers.fits(optimizer, self.flat_params, self.plan)

    # -- what other features set ------------------------------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce gradients as their sum over the engine's group divided by ``factor`` instead of the group's size
        (FSDP2's method of that name), however backward was run. Ulysses sets the data-parallel size: its
        sequence-parallel ranks each hold a part of one sample's gradient, to be summed, not averaged (Note:
        [Ulysses gradient scale] in :mod:`ds_strategy.parallel.ulysses`)."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        self.reducer.divide_factor = factor

    def driven_by_schedule(
        self, stages: Mapping[int, Iterable[nn.Parameter]], finished_later: frozenset[str] = frozenset()
    ) -> ScheduleInterface:
        """Remove the autograd and stage-3 forward hooks and hand back the interface through which a pipeline
        schedule running ``stages`` (each with its parameters) gathers units and hands gradients over itself
        (Note: [Pipeline gradients] in :mod:`ds_strategy.pipeline.runner`); ``finished_later``: see
        :class:`ScheduleInterface`."""
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        return ScheduleInterface(self, stages, finished_later)

    def master_pieces(self, name: str) -> list[tuple[FlatParam, torch.Tensor, int]]:
        """(flat buffer, view of its master, start within the parameter's local flattening) for each piece of the
        trainable parameter ``name`` whose master this rank holds, for code that sets values in place (a copy made
        equal to the one another part saves); :meth:`refresh_from_masters` then updates the compute copies."""
        return [
            (fp, fp.master.narrow(0, slot.offset + start - fp.master_base, length), start)
            for fp in self.flat_params
            for slot, start, length in fp.master_slots()
            if slot.name == name
        ]

    def refresh_from_masters(self) -> None:
        """Bring every compute copy up to date with the masters after they were set in place (collective over the
        engine's group, as after a step)."""
        self.reshard()
        for fp in self.flat_params:
            fp.copy_master_to_params()
        self.optimizer_step.refresh_params()

    # -- forward ----------------------------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Make the root unit usable: called by the root module's forward pre-hook and by adapters whose step
        functions (e.g. a LightningModule's ``training_step``) call submodules without the root's forward."""
        self.gathering.before_forward()

    def wait_for_params(self) -> None:
        """Block until the stage 1/2 parameter refresh is complete (``step`` does this before returning).
        Stage 3 parameters stay partitioned: use :meth:`full_state_dict` or :meth:`gathered`."""
        self.gathering.wait_for_params()

    def reshard(self) -> None:
        """Free every gathered stage-3 unit (after an evaluation forward; before saving)."""
        self.gathering.reshard()

    def gathered(self, unit: Unit) -> contextlib.AbstractContextManager[Unit]:
        """Temporarily hold one unit's full parameters (stage 3), e.g. to export or inspect them."""
        return self.gathering.gathered(unit)

    def gathered_parameters(self) -> contextlib.AbstractContextManager[None]:
        """Every unit's full parameters for the block, kept across its no-grad forwards (stage 3; a no-op below), as
        DeepSpeed's ``GatheredParameters``: see :meth:`.gathering.Gathering.gathered_parameters`."""
        return self.gathering.gathered_parameters()

    def adopt_replaced_parameters(self) -> None:
        """Point parameters that user code moved (``param.data = ...``) back at their flat buffers, keeping their
        values (Note: [Parameters replaced behind the engine's back] in :mod:`.replaced_parameters`)."""
        adopt_replaced_parameters(self.flat_params)

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's whole ``state_dict``, its trainable parameters from the optimizer's masters in the dtype the
        model gave each (fp32 weights of an fp32 model trained in bf16-mixed, not the bf16 compute copy): what every
        export returns (Note: [What an export returns] in :mod:`.full_state_dict`).

        Gathered one flat buffer at a time; never the empty views a partitioned parameter has between uses. With
        ``rank0_only`` other ranks take part in the gathers but return an empty dict.
        """
        return gathered_state_dict(self, master_weights, rank0_only)

    def full_compute_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The module's whole ``state_dict`` as the forward computes with it: under mixed precision the 16-bit
        copies rounded from the masters (DeepSpeed's ``save_16bit_model``), half the bytes of
        :meth:`full_state_dict`, which is what trained. Gathered one unit at a time, as :meth:`full_state_dict`."""
        return gathered_state_dict(self, compute_weights, rank0_only)

    # -- backward ---------------------------------------------------------------------------------------------
    @property
    def syncs_gradients(self) -> bool:
        """False inside :meth:`no_sync`: stage 0/1 gradients then accumulate on each rank without being reduced."""
        return self.reducer.sync

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (stage 0/1); stage 2/3 still reduce every micro-batch."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` in fp32 times the current loss scale under fp16 loss scaling, else ``loss`` itself.

        Backward through the result (``backward`` does) and log ``loss`` itself; the step divides the loss scale
        out again. The product is taken in fp32, as DeepSpeed does, so that an fp16 loss times 2**16 does not
        overflow before backward.
        """
        if self.loss_scaler is not None:
            return loss.float() * self.loss_scaler.scale
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale_loss(loss).backward()

    # -- optimizer step ---------------------------------------------------------------------------------------
    def flat_params_of(self, optimizer: torch.optim.Optimizer | None = None) -> list[FlatParam]:
        """The flat buffers ``optimizer`` steps, or (None) every flat buffer; ValueError for an optimizer that
        does not train this module."""
        return self.optimizer_step.flat_params_of(optimizer)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> GradStats:
        """Divide the loss scale out of this rank's reduced gradients (``optimizer``'s, or all), check every rank's
        for inf/nan and take their global norm, once per step (see :class:`.optimizer_step.OptimizerStep`)."""
        return self.optimizer_step.unscale_gradients(optimizer)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Scale gradients (``optimizer``'s, or all) so their global norm over all shards of all ranks is at most
        ``max_norm``; returns the norm before clipping (see :meth:`.optimizer_step.OptimizerStep.clip_grad_norm_`)."""
        return self.optimizer_step.clip_grad_norm_(max_norm, norm_type, optimizer)

    def clip_grad_value_(self, clip_value: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.optimizer_step.clip_grad_value_(clip_value, optimizer)

    def grad_norm(self, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Global ``norm_type``-norm of the unscaled gradients (``optimizer``'s, or all)."""
        return self.optimizer_step.grad_norm(norm_type, optimizer)

    def full_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s whole averaged gradient, as DeepSpeed's ``safe_get_full_grad`` gives it (a collective: see
        :mod:`.full_gradients`)."""
        return full_gradients.full_grad(self.optimizer_step, param)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """Every trained parameter's gradient norm by name, in one collective (see :mod:`.full_gradients`)."""
        return full_gradients.grad_norms(self.optimizer_step, self.module, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Run ``optimizer`` (None: every optimizer) on this rank's shards, then bring every rank's parameters up
        to date; False when fp16 loss scaling skipped it (see :meth:`.optimizer_step.OptimizerStep.step`). First the
        ranks compare the collectives each issued since the last step (:mod:`ds_strategy.comm.sequence_check`).

        Note: [Stage 1/2 parameter refresh]
        After the step each rank holds updated values only in its own shard.
        The all-gathers that fill in the rest are launched for every unit at once and all waited on before
        ``step`` returns. Deferring the wait to the next forward would overlap them with compute, but any read
        of the parameters in between (a callback, a checkpoint, an EMA) would then see a buffer a collective is
        still writing; correctness wins. Under mixed precision ``copy_master_to_params`` first rounds the updated
        fp32 master into the 16-bit shard, so the all-gathers move 16-bit values.
        """
        with profiler_range("step"):
            if self.sequence_check is not None:
                with profiler_range("step.sequence_check"):
                    self.sequence_check.verify()
            return self.optimizer_step.step(optimizer, self.books.count_step)

    def zero_grad(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drop the gradients ``optimizer`` (None: every optimizer) steps: as DDP's ``opt.zero_grad()`` drops
        those of its own parameters only."""
        self.optimizer_step.zero_grad(optimizer)

    # -- reporting --------------------------------------------------------------------------------------------
    def memory_report(self, peak: bool = False) -> dict[str, dict[str, int]]:
        """Model-state bytes now, or with ``peak`` at the working set's peak (see :mod:`.memory_report`)."""
        return memory_report(self, peak)

    def comm_stats(self, group: str | None = None, last_step: bool = False) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind, summed over the groups that carry training data, or
        for one of ``comm_groups``; ``last_step``: only what the last optimizer step's iteration issued (see
        :meth:`.comm_books.CommBooks.stats`)."""
        return self.books.stats(group, last_step)

    def summary(self) -> str:
        """The setup log's line: units, elements, bytes per rank and where (:func:`.memory_report.summary`)."""
        return summary(self, self.config.stage, len(self.units))

    def remove_hooks(self) -> None:
        """Detach the engine from the module (teardown); also removes this rank's offload files."""
        self.step_runner.close()
        self.books.close()
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        self.gathering.remove_hooks()
