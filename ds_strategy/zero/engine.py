"""ZeroEngine: one engine for ZeRO stages 0-3, independent of any training framework."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.accounting import combined
from ..comm.collectives import Collectives
from ..comm.group_collectives import waiting_as_long_as_the_group
from ..comm.quantized import reduce_scatter_quantized
from ..comm.sequence_check import CollectiveSequenceCheck
from ..config import ZeroConfig
from ..parallel.dtensor_params import local_tensor, point_param_at, spec_of
from ..precision import GradStats, LossScaler, unscale_and_check_shards
from ..profiler_ranges import profiler_range
from . import full_gradients
from .compile_boundary import eager_hook
from .flat_param import FlatParam
from .full_state_dict import compute_weights, gathered_state_dict, master_weights
from .grad_reducer import GradReducer
from .groups import EngineGroups
from .hpz import WeightGather, hpz_collectives
from .memory_report import WorkingSetPeak, memory_report, unit_bounded_sizes, whole_tensor_ownership
from .model_part import ModelPart
from .param_gatherer import ParamGatherer
from .param_refresh import ParamRefresh
from .param_types import check_shardable
from .placement import place_units
from .schedule_interface import ScheduleInterface
from .sharded_init import materialise_sharded
from .sharded_optimizers import ShardedOptimizers, as_optimizer_list
from .step_runner import DeviceStep, StepContext, StepRunner, StepRunnerFactory
from .unit import ShardedState, Unit
from .wrap_policy import select_unit_modules

log = logging.getLogger(__name__)


def _modules_owning(root: nn.Module, flat_params: list[FlatParam]) -> list[nn.Module]:
    """Submodules of ``root`` that hold one of ``flat_params``' parameters directly."""
    held = {id(p) for fp in flat_params for p in fp.params}
    return [m for m in root.modules() if m is not root and any(id(p) in held for p in m.parameters(recurse=False))]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _model_parallel(collectives: Collectives | None) -> Collectives | None:
    """A model-parallel dimension's collectives, or None for none or one rank."""
    return None if collectives is None or collectives.world_size == 1 else collectives


def _step_runner_factory(step_runner: StepRunnerFactory | None, config: ZeroConfig) -> StepRunnerFactory:
    """The runner given, else the device's; an offloading config without a runner is an error, not a silent
    on-device step (zero never imports offload: Note: [One-way dependency between the engine and offload])."""
    if step_runner is not None:
        return step_runner
    if config.plan.offloads:
        raise ValueError(
            f"ZeroConfig offloads (offload_optimizer={config.offload_optimizer!r}, offload_params="
            f"{config.offload_params!r}) but no step_runner was given: pass "
            f"step_runner=ds_strategy.offload.step_runner_for(config), or build through ds_strategy.compose"
        )
    return DeviceStep


def _modules_outside(root: nn.Module, unit_names: list[str]) -> list[nn.Module]:
    """The modules of ``root`` (every registration of a shared one) inside no unit named in ``unit_names``."""
    return [
        module
        for name, module in root.named_modules(remove_duplicate=False)
        if not any(name == unit or name.startswith(unit + ".") for unit in unit_names)
    ]


def _device_of(module: nn.Module) -> torch.device:
    """Where the flat buffers go: the module's device, or the CPU for a module built on the meta device."""
    for p in module.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


class ZeroEngine:
    """Shards a module's trainable parameters, gradients and optimizer state across the ranks of a process group.

    The module is cut into units (see :mod:`.wrap_policy`); each unit's trainable parameters, split by optimizer
    and param group, live in :class:`FlatParam` buffers whose :class:`ShardPolicy` comes from ``config.plan``.
    The host framework drives it with ``backward`` (or a plain ``loss.backward()``), ``clip_grad_norm_``,
    ``step`` and ``no_sync``; nothing here knows about Lightning, Fabric or Accelerate.

    Several optimizers may train one model (Muon on the hidden matrices and AdamW on the rest): each owns its
    parameters' shards, and ``step``, ``zero_grad``, ``clip_grad_norm_`` and ``grad_norm`` take the optimizer to act
    for (None: all of them, as one process clipping ``model.parameters()`` computes one norm over every parameter).
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
        whole model's names, tied copies, pieces cut away; see :mod:`.model_part`), or None for a whole model.
        ``unit_modules``: the (name, module) pairs that become units, as the caller chose them (the composition
        function, which checkpoints the same modules); None: chosen here by the config's unit policy
        (:func:`.wrap_policy.select_unit_modules`).

        What other features need from the engine they set through public methods after construction, as torch's
        pipeline stages drive FSDP2: :meth:`set_gradient_divide_factor` (Ulysses) and :meth:`driven_by_schedule`
        (a pipeline schedule hands gradients over).

        The order below is the order of construction: communication first (units gather through it), then units
        and their flat buffers, placed or initialised on the device; then the step runner, which may move shards
        and masters off the device, before the optimizer is pointed at the masters (once, wherever they now live);
        then the stage-3 gatherer and the gradient reducer, which calls both from autograd's hooks."""
        groups = groups or EngineGroups()
        self.module = module
        self.sharded_optimizers = ShardedOptimizers(as_optimizer_list(optimizer))
        self.config = config
        self.plan = plan = config.plan
        self.process_group = process_group = groups.zero
        self.device = torch.device(device) if device is not None else _device_of(module)
        backend = dist.get_backend(process_group) if dist.is_initialized() else "gloo"
        self.collectives = Collectives(
            process_group,
            use_all_reduce=plan.gradient_collective(backend) == "all_reduce",
            timeout=config.collective_timeout,
        )
        self.rank, self.world_size = self.collectives.rank, self.collectives.world_size
        self.experts = groups.experts  # expert parallelism: Note: [Expert units]
        self.expert_collectives = None
        if self.experts is not None:
            self.expert_collectives = Collectives(
                self.experts.group, use_all_reduce=self.collectives.use_all_reduce, timeout=config.collective_timeout
            )
        self.tp_collectives = _model_parallel(groups.tensor_parallel)
        pp_collectives = _model_parallel(groups.pipeline)
        self.model_parallel = tuple(c for c in (self.tp_collectives, pp_collectives) if c is not None)
        self.part = part or ModelPart()
        self.tied_copies: dict[str, str] = {}  # the trainable ones, by _build_units (Note: [Tied copies])
        self.whole_model_names: tuple[str, ...] = self.part.whole_names
        self._setup_weight_gathering(_model_parallel(groups.sequence_parallel), pp_collectives)
        if self.expert_collectives is not None:  # the experts' gathers and reductions (Note: [Expert units])
            self.comm_groups["edp"] = self.expert_collectives
        factory = _step_runner_factory(step_runner, config)
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        shard_store = factory.shard_store(config.offload_policy, global_rank)
        if unit_modules is None:
            unit_modules = select_unit_modules(module, config.unit_modules, config.unit_min_params)
        expert_units = list(self.experts.modules) if self.experts is not None else []
        self.units = self._build_units(list(unit_modules) + expert_units, shard_store, len(expert_units))
        self.flat_params = [fp for unit in self.units for fp in unit.flat_params]
        self._norm_weights = self._weights_in_norm()
        self._materialise()
        self._start_sequence_check()  # after construction's broadcasts: it compares training traffic only
        if self.experts is not None:  # after the check: token all-to-alls differ in size by rank (Note: [Expert units])
            self.comm_groups["ep"] = self.experts.parallel
        for fp in self.flat_params:
            fp.allocate_grads(plan.comm_dtype, self.collectives.use_all_reduce)
        self.step_runner: StepRunner = factory(
            StepContext(self.flat_params, self.optimizers, config.offload_policy, self.device, global_rank, shard_store)
        )
        self.sharded_optimizers.retarget(self.flat_params)
        self.working_set = WorkingSetPeak(self.flat_params)
        sizes = unit_bounded_sizes(config.comm_policy, self.units)
        self.loss_scaler = LossScaler(config.precision_policy) if plan.loss_scaling else None
        self._grad_stats: dict[tuple[int, ...], GradStats] = {}  # by the flat buffers' indices they cover
        self._master_grads: dict[int, torch.Tensor] = {}  # fp.index -> its optimizer gradient, unscaled once made
        self._unscaled: set[int] = set()
        self.gatherer = None
        if plan.partitions_parameters:  # without overlap_comm nothing is prefetched: units gather on demand
            self.gatherer = ParamGatherer(
                self.units,
                self.units[0],
                config.reshard_after_forward,
                sizes.prefetch if config.overlap_comm else 0,
                sizes.max_live,
                self.working_set,
            )
        self._unit_of = [unit for unit in self.units for _ in unit.flat_params]  # by fp.index
        self._stats_at_step = self._stats_now()  # at the last step's end (or construction), by group ("": summed)
        self._last_step_stats: dict[str, dict] = {}
        self.refresher = ParamRefresh(self.units, sizes.reduce_bucket, config.allgather_bucket_size)
        self._launched_per_unit: dict[Unit, int] = {}
        qgz = (
            functools.partial(reduce_scatter_quantized, self.collectives, bits=config.zero_quantized_gradients_bits)
            if config.zero_quantized_gradients
            else None
        )
        self.reducer = GradReducer(
            self.flat_params,
            self.collectives,
            overlap=config.overlap_comm,
            bucket_numel=sizes.reduce_bucket,
            comm_dtype=plan.comm_dtype,
            working_set=self.working_set,
            on_launched=self._on_flat_param_launched if self.gatherer is not None else None,
            on_backward_end=self._end_of_backward if self.gatherer is not None else None,
            on_reduced=self.step_runner.on_reduced,
            quantized_reduce_scatter=qgz,
            gradients=self.step_runner.gradients,
            collectives_of={
                fp.index: unit.collectives
                for unit in self.units
                if unit.collectives is not self.collectives
                for fp in unit.flat_params
            },
            fences=[i if unit.partitioned else -1 for i, unit in enumerate(self.units) for _ in unit.flat_params],
        )
        self.reducer.register_hooks()
        self._hooks = [
            self.units[0].module.register_forward_pre_hook(eager_hook(lambda module, args: self.before_forward()))
        ]
        self._hooks += [
            module.register_forward_pre_hook(eager_hook(self._gather_root_for))
            for module in _modules_owning(self.module, self.units[0].partitioned)
        ]

    # -- construction -------------------------------------------------------------------------------------------
    def _build_units(self, chosen: list[tuple[str, nn.Module]], shard_store, expert_count: int = 0) -> list[Unit]:
        """Root first, then the unit modules in module order; a parameter shared by two units, or by a unit and a
        module outside every unit (a tied LM head beside an embeddings unit), goes to the root: a unit is gathered
        only for its own forward, the root for the whole step.

        Note: [Expert units]
        The last ``expert_count`` of ``chosen`` are experts containers (``EngineGroups.experts``): each is a unit
        nested in its layer's, holding every parameter inside it (the layer's unit takes none of them), sharded,
        gathered and reduced over the expert-data-parallel group, so that its flat buffers are laid out for that
        group's size and its all-gathers and reduce-scatters never mix two ranks' different experts. Everything
        else, the step, the norm and the overflow check included, treats them as any unit. The expert-parallel
        group's token all-to-alls move as many rows as each rank's tokens chose, so their sizes differ by rank:
        they are counted in ``comm_stats`` but left out of the per-step sequence check, which compares sizes."""
        owners: dict[int, list[int]] = {}
        experts_from = len(chosen) - expert_count
        for i, (_, module) in enumerate(chosen):
            for p in module.parameters():
                if i >= experts_from:
                    owners[id(p)] = [i]
                elif not (owners.get(id(p)) or [-2])[0] >= experts_from:
                    owners.setdefault(id(p), []).append(i)
        for module in _modules_outside(self.module, [name for name, _ in chosen]):
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(-1)
        if self.experts is not None and any(map(self.sharded_optimizers.is_whole_param, self.module.parameters())):
            raise ValueError(
                "an optimizer that updates parameters whole (Muon) does not compose with expert parallelism yet: "
                "give every parameter to an elementwise optimizer (AdamW), or use expert_parallel_size=1"
            )
        optimizers = self.sharded_optimizers
        members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(chosen) + 1)]
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            check_shardable(name, p)
            if len(optimizers) and optimizers.where(p) is None:
                raise ValueError(
                    f"parameter {name!r} requires grad but is in no optimizer param group; "
                    f"freeze it (requires_grad=False) or add it to the optimizer"
                )
            where = owners.get(id(p), [])
            owner = self.part.copy_owners.get(name)
            if owner is not None:
                self.tied_copies[name] = owner
            members[where[0] + 1 if len(where) == 1 else 0].append((owner or name, p))
        names = ["<root>"] + [name for name, _ in chosen]
        modules = [self.module] + [module for _, module in chosen]
        owners = (
            self.sharded_optimizers.owners([p for params in members for _, p in params], self.world_size)
            if self.plan.partitions_optimizer
            else {}
        )
        units, first = [], 0
        store = shard_store.store if shard_store is not None else None
        for i, (name, module, params) in enumerate(zip(names, modules, members)):
            collectives = self.expert_collectives if i > experts_from else self.collectives
            flat = self._flat_params_of(name, params, owners, first, store, collectives)
            units.append(Unit(name, module, flat, collectives, self.weight_gather))
            first += len(flat)
        return units

    def _setup_weight_gathering(self, sequence_parallel: Collectives | None, pipeline: Collectives | None) -> None:
        """The groups ``comm_stats`` counts (the model-parallel ones carry the model's traffic too), ZeRO++ groups
        and weight gathering (qwZ and hpZ), which the units are built with."""
        cfg = self.config
        self.comm_groups = {"world": self.collectives}
        for name, collectives in (("tp", self.tp_collectives), ("sp", sequence_parallel), ("pp", pipeline)):
            if collectives is not None:
                self.comm_groups[name] = collectives
        if cfg.zero_hpz_partition_size > 1 and self.world_size > 1:
            self.comm_groups["hpz"] = hpz_collectives(self.collectives, cfg.zero_hpz_partition_size)
        self.weight_gather = None
        if cfg.zero_quantized_weights or "hpz" in self.comm_groups:
            self.weight_gather = WeightGather(self.collectives, self.comm_groups.get("hpz"), cfg.zero_quantized_weights)

    def _start_sequence_check(self) -> None:
        """The per-step comparison of the collectives each rank issued (``ds_strategy.comm.sequence_check``)."""
        self.sequence_check = None
        if dist.is_initialized() and self.world_size > 1:
            self.sequence_check = CollectiveSequenceCheck(list(self.comm_groups.values()))
            self.comm_groups["monitor"] = self.sequence_check.collectives

    def _flat_params_of(
        self,
        unit_name: str,
        params: list[tuple[str, nn.Parameter]],
        owners: dict[int, int],
        first_index: int,
        shard_store,
        collectives: Collectives,
    ) -> list[FlatParam]:
        """One flat buffer per (optimizer, param group, persistent?, replicated over tensor parallel?, tied copy?)
        among ``params``, in first-appearance order (the last two keep the norm's weighting per buffer: Note:
        [DTensor parameters as flat views]); a whole-tensor group's laid out by ``owners``."""
        plan = self.plan
        tied = set(self.tied_copies.values())
        buckets: dict[tuple[int, int, bool, bool, bool], list[tuple[str, nn.Parameter]]] = {}
        for name, p in params:
            where = self.sharded_optimizers.where(p) or (0, 0)
            key = (*where, plan.is_persistent(p.numel()), self._replicated_over_tp(p), name in tied)
            buckets.setdefault(key, []).append((name, p))
        flat = []
        for (optimizer, group, persistent, replicated, tied_copy), members in buckets.items():
            policy = plan.persistent_sharding if persistent else plan.sharding
            whole = self.sharded_optimizers.is_whole_param(members[0][1])
            if whole:
                self.sharded_optimizers.check_whole(members)
            name = f"{unit_name}/{f'optimizer{optimizer}.' if optimizer else ''}group{group}"
            name += ("/persistent" if persistent else "") + ("/tp_replicated" if replicated else "")
            name += "/tied_copy" if tied_copy else ""
            flat.append(
                FlatParam(
                    first_index + len(flat),
                    name,
                    members,
                    group,
                    policy,
                    collectives.rank,
                    collectives.world_size,
                    plan.dtypes(members[0][1].dtype),
                    self.device,
                    shard_store=shard_store,
                    tied_copy=tied_copy,
                    whole=whole,
                    owners=[owners[id(p)] for _, p in members] if whole and owners else None,
                    optimizer_index=optimizer,
                )
            )
        return flat

    def _replicated_over_tp(self, p: nn.Parameter) -> bool:
        """Whether every tensor-parallel rank holds the whole of ``p`` (always False without tensor parallelism)."""
        if self.tp_collectives is None:
            return False
        spec = spec_of(p)
        return spec is None or spec.replicated

    def _weights_in_norm(self) -> list[float]:
        """Each flat buffer's weight in the global gradient norm: 0 for tied copies another pipeline stage owns
        (counted there), ``1 / tp_size`` for one replicated over the tensor-parallel group (every tp rank holds it:
        counted once in the tp sum), else 1."""
        tp = self.tp_collectives.world_size if self.tp_collectives is not None else 1
        return [
            0.0 if fp.tied_copy else 1.0 if any(slot.tp_sharded for slot in fp.slots) else 1.0 / tp
            for fp in self.flat_params
        ]

    def _materialise(self) -> None:
        """Move the parameters into their flat buffers on the device one unit at a time, every rank starting from
        rank 0's values (as DDP does); see [Unit-by-unit placement] in :mod:`.placement`.

        A model built on the meta device is initialised unit by unit instead (see :mod:`.sharded_init`), unless
        ``sync_module_states`` says rank 0 holds the real model, whose values then stream to the others.
        """

        def broadcast(t: torch.Tensor, collectives: Collectives = self.collectives) -> None:
            if collectives.world_size > 1:  # the unit's group's first rank: experts differ by expert-parallel rank
                collectives.broadcast(t, src=0).wait()

        with torch.no_grad():
            built_on_meta = any(p.is_meta for fp in self.flat_params for p in fp.params)
            if not self.config.sync_module_states:
                self._check_ranks_built_alike(built_on_meta)
            if built_on_meta and not self.config.sync_module_states:
                materialise_sharded(
                    self.module, self.units, broadcast, self.device, self.config.param_init_fn, self.part.cut_pieces
                )
                return
            place_units(self.module, self.units, self.device, broadcast)

    def _check_ranks_built_alike(self, built_on_meta: bool) -> None:
        """Every rank must take the same materialisation path (each issues different collectives). Setup
        plumbing, not training traffic, waited on as long as the process group waits (ranks build at their own
        pace), and counted apart from ``comm_stats``."""
        if self.world_size == 1:
            return
        count = torch.tensor([float(built_on_meta)], device=self.device)
        waiting_as_long_as_the_group(self.process_group).all_reduce(count, label="check: ranks built alike").wait()
        if 0 < count.item() < self.world_size:
            raise ValueError(
                f"{int(count.item())} of {self.world_size} ranks built the model on the meta device "
                f"and the others did not; build it alike on every rank, or pass "
                f"sync_module_states=True to stream rank 0's model to ranks that built it on meta"
            )

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
        if not isinstance(optimizer, torch.optim.Optimizer):
            return False
        try:
            self.sharded_optimizers.indices_of(optimizer)
        except ValueError:
            return False
        return True

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
        trainable parameter ``name`` whose master this rank holds, for code that sets values in place (a tied
        pipeline copy made equal to its owner); :meth:`refresh_from_masters` then updates the compute copies."""
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
        self._refresh_params()

    # -- forward ----------------------------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Make the root unit usable: called by the root module's forward pre-hook and by adapters whose step
        functions (e.g. a LightningModule's ``training_step``) call submodules without the root's forward."""
        root = self.units[0]
        root.wait_gathered()
        if self.gatherer is not None:
            self.gatherer.before_root_forward()

    def _gather_root_for(self, module: nn.Module, args) -> None:
        """Note: [Root parameters outside the root's forward]
        The root unit (parameters no single unit owns: embeddings, final norm, tied weights) is gathered by
        the root module's forward pre-hook, or by ``before_forward`` from adapters whose step functions call
        submodules instead (a LightningModule's ``training_step``). A step may also run a second forward after
        a backward, which released the root (manual optimization: two backwards per step, GANs), without
        either. So every module that holds root parameters gathers the root before it runs if it is sharded;
        a sharded root means a forward is starting, so the prefetch position starts over too. Parameters read
        outside any module's forward (``x @ module.weight`` in the step function) are not covered: call
        ``before_forward`` first.
        """
        if self.units[0].sharded_state is ShardedState.SHARDED:
            self.before_forward()

    def wait_for_params(self) -> None:
        """Block until the stage 1/2 parameter refresh is complete (``step`` does this before returning).
        Stage 3 parameters stay partitioned: use :meth:`full_state_dict` or :meth:`gathered`."""
        for unit in self.units:
            unit.wait_refreshed()

    def reshard(self) -> None:
        """Free every gathered stage-3 unit (after an evaluation forward; before saving)."""
        self.wait_for_params()
        if self.gatherer is not None:
            self.gatherer.release_all()
        if self.weight_gather is not None:
            self.weight_gather.drop_all()

    @contextlib.contextmanager
    def gathered(self, unit: Unit):
        """Temporarily hold one unit's full parameters (stage 3), e.g. to export or inspect them."""
        was_sharded = unit.sharded_state is ShardedState.SHARDED
        unit.wait_gathered(exact=True)
        try:
            yield unit
        finally:
            if was_sharded:
                unit.release()

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Every unit's full parameters for the block, kept across its no-grad forwards (stage 3; a no-op below).

        For generation: ``generate`` runs one forward per token, and each would otherwise gather and free every
        unit again (correct, at one unit's memory). Inside this block each unit is gathered once, so the whole
        model is held on every rank until the block ends, as DeepSpeed's ``GatheredParameters`` holds it; then
        every unit gathered here is freed. Collective: every rank of the engine's group enters it. Not for
        training: a forward with grad enabled frees its units as usual.
        """
        if self.gatherer is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            for unit in self.units:
                stack.enter_context(self.gathered(unit))
            self.gatherer.holding = True
            try:
                yield
            finally:
                self.gatherer.holding = False

    def adopt_replaced_parameters(self) -> None:
        """Note: [Parameters replaced behind the engine's back]
        Every trainable parameter is a view of its flat buffer, which the engine reduces, steps and gathers. Code
        that assigns ``param.data = ...`` (accelerate's ``LocalSGD`` averaging its replicas) moves the parameter
        onto a tensor of its own: the model would then read values no later step updates. This copies each moved
        parameter's values into its place in the buffer (and its fp32 master, when that is a separate tensor) and
        points the parameter back. Only whole buffers can take them (stages 0-2); a partitioned parameter is
        empty between gathers, and replacing it means nothing. Checked before reading the weights out
        (:meth:`full_state_dict`, checkpoints) and by adapters after user code that may replace parameters."""
        with torch.no_grad():
            for fp in self.flat_params:
                if fp.policy.params:
                    continue
                moved = set()
                for slot, p, view in zip(fp.slots, fp.params, fp.param_views()):
                    if local_tensor(p).data_ptr() != view.data_ptr():
                        view.copy_(local_tensor(p))
                        point_param_at(p, view, storage_kept=True)
                        moved.add(slot.name)
                if not moved or fp.master.data_ptr() == fp.master_region().data_ptr():
                    continue
                for slot, start, length in fp.master_slots():  # a separate master: the moved pieces only
                    if slot.name in moved:
                        where = slot.offset + start
                        fp.master.narrow(0, where - fp.master_base, length).copy_(fp.full.narrow(0, where, length))

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

    def _end_of_backward(self) -> None:
        with profiler_range("backward.end"):
            self.gatherer.end_of_backward()
            if self.weight_gather is not None:
                self.weight_gather.drop_all()

    def _on_flat_param_launched(self, fp: FlatParam) -> None:
        if not fp.policy.params:
            return
        unit = self._unit_of[fp.index]
        count = self._launched_per_unit.get(unit, 0) + 1
        if count == len(unit.partitioned):
            self._launched_per_unit.pop(unit, None)
            self.gatherer.on_flat_params_reduced(unit)
        else:
            self._launched_per_unit[unit] = count

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
        if optimizer is None:
            return self.flat_params
        indices = self.sharded_optimizers.indices_of(optimizer)
        return [fp for fp in self.flat_params if fp.optimizer_index in indices]

    def unscale_gradients(self, optimizer: torch.optim.Optimizer | None = None) -> GradStats:
        """Divide the loss scale out of this rank's reduced gradients (``optimizer``'s, or all), check every rank's
        for inf/nan and take their global norm: one pass and one all-reduce (see
        :mod:`ds_strategy.precision.grad_stats`).

        Call after the step's last backward; ``clip_grad_norm_`` and ``step`` call it when they need it, and later
        calls until those gradients are consumed return the same statistics without touching the gradients again
        (a gradient already unscaled for another selection is only read).
        """
        with profiler_range("step.unscale"):
            fps = self.flat_params_of(optimizer)
            key = tuple(fp.index for fp in fps)
            if key not in self._grad_stats:
                inv_scale = self.loss_scaler.inv_scale if self.loss_scaler is not None else 1.0
                self._grad_stats[key] = unscale_and_check_shards(
                    self._optimizer_grads(fps),
                    [1.0 if fp.index in self._unscaled else inv_scale for fp in fps],
                    self.collectives,
                    sharded=self.plan.partitions_optimizer,
                    weights=[self._norm_weights[fp.index] for fp in fps],
                    model_parallel=self.model_parallel,
                    device=self.device,
                )
                self._unscaled.update(key)
            return self._grad_stats[key]

    def _optimizer_grads(self, fps: list[FlatParam]) -> list[torch.Tensor]:
        """Each of ``fps``' reduced gradient in its master's dtype: what clipping scales and the optimizer reads.

        ``grad_shard`` itself, or at stage 0 ``grad_full``, converted to an fp32 copy under mixed precision; with the
        optimizer offloaded at stage 2/3, the fp32 host buffer the reductions were summed into.
        """
        self.reducer.wait_all()
        for fp in fps:
            if fp.index not in self._master_grads:
                self._master_grads[fp.index] = self.reducer.reduced_grad(fp).to(fp.master_dtype)
        return [self._master_grads[fp.index] for fp in fps]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Scale gradients (``optimizer``'s, or all) so their global norm over all shards of all ranks is at most
        ``max_norm``.

        Returns the norm before clipping, of the unscaled gradients; it equals the unsharded model's gradient norm
        (over every parameter when ``optimizer`` is None, as ``clip_grad_norm_(model.parameters())`` takes it).
        """
        total = self.grad_norm(norm_type, optimizer)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in self._gradients_to_clip(self.flat_params_of(optimizer)):
            grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
        return total

    def clip_grad_value_(self, clip_value: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.loss_scaler is not None:
            self.unscale_gradients(optimizer)
        for grad in self._gradients_to_clip(self.flat_params_of(optimizer)):
            grad.clamp_(-clip_value, clip_value)

    def _gradients_to_clip(self, fps: list[FlatParam]) -> list[torch.Tensor]:
        """Each flat buffer's optimizer gradient or, where that is a slice of ``grad_full`` (stage 1 in one dtype
        with all-reduce), the whole ``grad_full``: the parameters' ``.grad`` view it, and must stay the same
        averaged gradient on every rank (Note: [Accumulation and reduction])."""
        return [
            fp.grad_full if fp.grad_full is not None and _same_storage(grad, fp.grad_full) else grad
            for fp, grad in zip(fps, self._optimizer_grads(fps))
        ]

    def grad_norm(self, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Global ``norm_type``-norm of the unscaled gradients (``optimizer``'s, or all); the 2-norm comes from
        ``unscale_gradients``."""
        if norm_type == 2.0:
            return self.unscale_gradients(optimizer).norm
        if self.loss_scaler is not None:
            self.unscale_gradients(optimizer)
        fps = self.flat_params_of(optimizer)
        grads = [g.float() for g in self._optimizer_grads(fps)]
        weights = [self._norm_weights[fp.index] for fp in fps]
        device = self.device  # gradients an offload keeps on the host are reduced beside the device's
        if math.isinf(norm_type):
            local = (
                torch.stack([(g.abs().max() * bool(w)).to(device) for g, w in zip(grads, weights)]).max()
                if grads
                else torch.zeros((), device=device)
            )
            op = dist.ReduceOp.MAX
        else:
            weighted = [(g.pow(norm_type).sum() * w).to(device) for g, w in zip(grads, weights)]
            local = torch.stack(weighted).sum() if grads else torch.zeros((), device=device)
            op = dist.ReduceOp.SUM
        if self.plan.partitions_optimizer:
            self.collectives.all_reduce(local, op=op).wait()
        for group in self.model_parallel:
            group.all_reduce(local, op=op).wait()
        return local if math.isinf(norm_type) else local.pow(1.0 / norm_type)

    def full_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """``param``'s whole averaged gradient, as DeepSpeed's ``safe_get_full_grad`` gives it (a collective: see
        :mod:`.full_gradients`)."""
        return full_gradients.full_grad(self, param)

    def grad_norms(self, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
        """Every trained parameter's gradient norm by name, in one collective (see :mod:`.full_gradients`)."""
        return full_gradients.grad_norms(self, norm_type)

    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Run ``optimizer`` (None: every optimizer) on this rank's shards, then bring every rank's parameters up
        to date.

        First the ranks compare the collectives each issued since the last step and raise
        ``CollectiveMismatchError`` if they differ (see :mod:`ds_strategy.comm.sequence_check`).

        Returns False when fp16 loss scaling found an inf/nan in the gradients stepped on some rank: then no rank
        steps them, parameters and optimizer state stay as they were, those gradients are discarded and the loss
        scaler is updated (see :mod:`ds_strategy.precision.loss_scaler`), once per call, as Lightning's and
        Accelerate's ``GradScaler`` update after each optimizer's step. bf16 and fp32 training never skip.

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
            fps = self.flat_params_of(optimizer)
            if self.loss_scaler is not None:
                overflow = self.unscale_gradients(optimizer).found_inf
                self.loss_scaler.update(overflow)
                if overflow:
                    self.zero_grad(optimizer)
                    self._count_step()
                    return False
            grads = self._optimizer_grads(fps)
            with profiler_range("step.optimizer"):
                stepped = self.sharded_optimizers.indices_of(optimizer) if optimizer is not None else None
                for index, stepping in enumerate(self.optimizers):
                    if stepped is None or index in stepped:
                        pairs = [(fp, grad) for fp, grad in zip(fps, grads) if fp.optimizer_index == index]
                        self.step_runner.step(stepping, pairs)  # and the write-back (see .step_runner)
            self.zero_grad(optimizer)  # consumes the gradients as DeepSpeed's step does: ``.grad`` None till backward
            if self.gatherer is not None:  # a unit still gathered (a forward after the last backward) is now stale
                self.gatherer.release_all()
            self._refresh_params(fps)
            self._count_step()
            return True

    def _refresh_params(self, fps: list[FlatParam] | None = None) -> None:
        """All-gather the updated shards of the whole (never freed) buffers among ``fps`` (None: all), by buckets
        (:mod:`.param_refresh`)."""
        self.refresher.refresh(None if fps is None or fps is self.flat_params else {fp.index for fp in fps})

    def zero_grad(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drop the gradients ``optimizer`` (None: every optimizer) steps: as DDP's ``opt.zero_grad()`` drops
        those of its own parameters only."""
        self._grad_stats.clear()
        for fp in self.flat_params_of(optimizer):
            self._master_grads.pop(fp.index, None)
            self._unscaled.discard(fp.index)
            self.reducer.zero_grads(fp)
            for p in fp.params:
                p.grad = None

    # -- reporting --------------------------------------------------------------------------------------------
    def memory_report(self, peak: bool = False) -> dict[str, dict[str, int]]:
        """Model-state bytes now, or with ``peak`` at the working set's peak (see :mod:`.memory_report`)."""
        return memory_report(self, peak)

    def comm_stats(self, group: str | None = None, last_step: bool = False) -> dict[str, dict[str, float]]:
        """Calls, bytes and seconds waited per collective kind, summed over the groups that carry training data
        ("world"; under hpZ, "hpz"; and the mesh's model-parallel groups "tp", "sp", "pp", whose counters include the
        model's own traffic over them: tensor-parallel sums, Ulysses all-to-alls, pipeline losses and tied weights;
        under expert parallelism "edp", the experts' gathers and reductions, and "ep", the token all-to-alls),
        or for one of ``comm_groups``, which also holds "monitor" (the per-step sequence check's all-gather of 16
        bytes per rank, left out of the sum).

        ``last_step``: only what the last optimizer step's iteration issued, from the end of the step before it
        (or construction) to the end of that step: its forwards, backwards, clipping and step. The collectives per
        step are the figure to watch on a model of many small units (Note: [Buckets span units] in
        :mod:`.buckets`)."""
        if last_step:
            return self._last_step_stats.get(group or "", {})
        if group is not None:
            return self.comm_groups[group].stats.as_dict()
        return combined(c.stats for name, c in self.comm_groups.items() if name != "monitor")

    def _stats_now(self) -> dict[str, dict[str, dict[str, float]]]:
        """``comm_stats`` summed ("") and per group."""
        return {"": self.comm_stats(), **{name: self.comm_stats(name) for name in self.comm_groups}}

    def _count_step(self) -> None:
        """What the step that is ending issued, for ``comm_stats(last_step=True)``."""
        now, before = self._stats_now(), self._stats_at_step
        self._last_step_stats = {
            name: {
                kind: {key: value - before[name][kind][key] if name in before else value for key, value in v.items()}
                for kind, v in stats.items()
            }
            for name, stats in now.items()
        }
        self._stats_at_step = now

    def summary(self) -> str:
        report = self.memory_report()
        mib = {k: sum(v.values()) / 2**20 for k, v in report.items()}
        placed = self.step_runner.describe(report)
        whole = whole_tensor_ownership(self)
        owned = (
            f"; whole-tensor parameters: this rank owns {whole.owned:,} of {whole.total:,} elements (at most "
            f"{whole.bound:,.0f}: 1/N plus the largest, {whole.largest:,})"
            if whole is not None
            else ""
        )
        return (
            f"ZeRO stage {self.config.stage} on {self.world_size} ranks, {len(self.units)} units, "
            f"{sum(fp.numel for fp in self.flat_params):,} trainable params; per rank: "
            + ", ".join(f"{k} {v:.1f} MiB" for k, v in mib.items())
            + (f"; {placed}" if placed else "")
            + owned
        )

    def remove_hooks(self) -> None:
        """Detach the engine from the module (teardown); also removes this rank's offload files."""
        self.step_runner.close()
        if self.sequence_check is not None:
            self.sequence_check.close()
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove_hooks()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
