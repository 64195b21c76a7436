"""ZeroAccelerator: Accelerate's training-loop API translated into ZeroEngine calls; no sharding logic lives here."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch import nn
from torch.optim import Optimizer

from ..adapters.engine_owner import backward_through_loss_scale
from ..adapters.precision_flag import ACCELERATE_MIXED_PRECISION, reconcile_precision
from ..adapters.state_dict_type import checked_state_dict_type
from ..checkpoint.full_optimizer import full_optimizer_state, load_full_optimizer_state
from ..checkpoint.pretrained import WeightSource, load_weights
from ..comm.peer_failures import name_failed_peers_in, naming_failed_peers
from ..compose import (
    Composed,
    TensorParallelism,
    Unparallelized,
    build_mesh,
    compose_model,
    recompose_engine,
)
from ..config import ZeroConfig
from ..config.sources import ENV_VAR, load_config
from ..parallel.mesh import ACCELERATE_NAMES, ParallelMesh
from ..pipeline.step import pipeline_step, ran_its_backward
from ..precision import autocast_for
from ..zero.engine import ZeroEngine
from ..zero.rng_replay import generator_state, set_generator_state
from .checkpointing import ZeroAcceleratorCheckpointing
from .deepspeed_compat import DeepSpeedPluginView, StateWithDeepSpeedView, mark_launched_worker
from .dummy_objects import resolve_dummies
from .parallelism import check_no_launcher_parallelism, prepare_over_data_parallel, with_parallelism

# Accelerate's own sharding back-ends, by the constructor argument and the environment variable that enable them.
_OTHER_SHARDING = {
    "deepspeed_plugin": "ACCELERATE_USE_DEEPSPEED",
    "deepspeed_plugins": "ACCELERATE_USE_DEEPSPEED",
    "fsdp_plugin": "ACCELERATE_USE_FSDP",
    "megatron_lm_plugin": "ACCELERATE_USE_MEGATRON_LM",
}
# A model built on meta for ``prepare`` to materialise sharded (by ds_strategy.transformers: sharded_from_pretrained,
# and from_pretrained/from_config under a stage-3 configuration) carries a DeferredBuild here.
DEFERRED_BUILD_ATTR = "_ds_strategy_deferred_build"


@dataclasses.dataclass(frozen=True)
class DeferredBuild:
    """Where the values of a model built on the meta device come from when ``prepare`` materialises it.

    ``generator_state``: the CPU generator's state when the model was built. Materialisation draws from it, so a
    model built empty by ``from_config`` gets the values a normal build would have had there; afterwards every
    generator is put back as it was before ``prepare``, since a normal build would have drawn at build time, not
    here (on an accelerator the values are a normal build's on that device's generator, see
    ``ds_strategy.zero.hf_init``). ``weights``: read into the shards after materialisation; for a pretrained model,
    every value (the checkpoint's tensors and those ``from_pretrained`` initialised itself), so what
    materialisation drew is all overwritten.
    """

    generator_state: torch.Tensor
    weights: WeightSource | str | os.PathLike | None = None


class ZeroAccelerator(ZeroAcceleratorCheckpointing, Accelerator):
    """An ``Accelerator`` whose ``prepare`` shards the model and optimizer with a :class:`ZeroEngine` instead of
    wrapping the model in DDP.

    ``zero_config`` is a :class:`ZeroConfig`, a mapping of its fields, or a YAML/JSON file (see
    :func:`~ds_strategy.config.load_config`); when omitted it is read from ``$DS_STRATEGY_CONFIG``, which ``ds-strategy
    launch`` sets. Every other argument is Accelerate's. ``backward``, ``clip_grad_norm_``/``clip_grad_value_``,
    ``no_sync``/``accumulate`` and the prepared optimizer's ``step``/``zero_grad`` go to the engine;
    ``save_state``/``load_state`` write and read the model and optimizer as a sharded checkpoint, loadable at any world
    size or ZeRO stage, or with ``state_dict_type="full"`` (FSDP's choice, :mod:`ds_strategy.adapters.state_dict_type`)
    as accelerate's own whole files, gathered onto rank 0 (see :mod:`.checkpointing`).

    Precision: ``mixed_precision`` ("no", "bf16", "fp16") is folded into ``ZeroConfig.precision`` and the engine
    implements it (16-bit buffers, fp32 masters, loss scaling); ``prepare`` only runs the model's forward in autocast to
    the 16-bit dtype (and converts the model first under "-true"). ``ZeroConfig.gradient_accumulation_steps`` and
    ``gradient_clipping`` (as from a DeepSpeed JSON) become Accelerate's accumulation steps and a global-norm clip
    before every optimizer step.

    On a machine without an accelerator the processes run on CPU (``cpu=True``) unless told otherwise: Accelerate
    forms a gloo process group for torchrun-launched ranks only in CPU mode, and ZeRO needs that group.
    Accelerate's own DeepSpeed, FSDP and Megatron-LM back-ends shard too, so configuring one is an error.

    Scripts written for DDP or for accelerate's DeepSpeed back-end find ``model.no_sync()`` on prepared models and, with
    a DeepSpeed config's optimizer/scheduler sections, ``state.deepspeed_plugin`` (see :mod:`.deepspeed_compat`).

    Tensor parallelism: ``parallelism_config=ParallelismConfig(tp_size=2)`` (or ``ZeroConfig.tensor_parallel_size``)
    builds the mesh ``("dp_shard", "tp")`` (``torch_device_mesh``); ZeRO shards over ``dp_shard`` and the prepared
    data loaders split batches over it only (see :mod:`.parallelism`). ``prepare`` splits a model that arrives
    unsplit with ``ZeroConfig.tensor_parallel_plan``, "auto" when that is None (the decoder families
    ``ds_strategy.parallel.auto_plan`` knows); a model whose parameters are already DTensors is left as it is.
    An optimizer built before ``prepare`` is pointed at the split parameters.

    DeepSpeed-Ulysses: ``ParallelismConfig(sp_size=2)`` (or ``ZeroConfig.sequence_parallel_size``) adds the mesh
    dimension ``"sp"``; the loop calls ``shard_sequence`` and ``sequence_parallel_loss``
    (:mod:`ds_strategy.parallel.ulysses`) over ``torch_device_mesh["sp"]``. Pipelining:
    ``ZeroConfig.pipeline_parallel_size`` (Accelerate's ParallelismConfig has no pipeline dimension) adds ``"pp"``
    outermost; the loop hands each batch to :meth:`pipeline_step` instead of calling the model. The ranks of a
    sequence-parallel group and the stages of a pipeline read the same batches.
    """

    def __init__(
        self,
        zero_config: ZeroConfig | Mapping | str | os.PathLike | None = None,
        state_dict_type: str = "sharded",
        **kwargs: Any,
    ):
        _reject_other_sharding(kwargs)
        self.state_dict_type = checked_state_dict_type(state_dict_type, type(self).__name__)
        parallelism_config = kwargs.pop("parallelism_config", None)
        check_no_launcher_parallelism(parallelism_config)
        loaded = load_config(zero_config, environment=True)
        config, self._deepspeed_sections = loaded.zero, loaded.written_sections
        if config.gradient_accumulation_steps != 1:
            steps = kwargs.setdefault("gradient_accumulation_steps", config.gradient_accumulation_steps)
            if steps != config.gradient_accumulation_steps:
                raise ValueError(
                    f"Accelerator(gradient_accumulation_steps={steps}) conflicts with "
                    f"ZeroConfig.gradient_accumulation_steps={config.gradient_accumulation_steps}; "
                    f"set it in one place only"
                )
        kwargs.setdefault("cpu", not torch.accelerator.is_available())
        super().__init__(**kwargs)
        if self.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
            raise ValueError(
                f"ZeroAccelerator shards with ds_strategy's engine, but Accelerate is configured for "
                f"{self.distributed_type.value}; remove that from the accelerate config"
            )
        mixed = str(self.mixed_precision)
        config = reconcile_precision(
            config, ACCELERATE_MIXED_PRECISION.get(mixed, mixed), "Accelerator(mixed_precision)"
        )
        self.zero_config = config = with_parallelism(config, parallelism_config, self.num_processes)
        self.parallel_mesh: ParallelMesh | None = None
        if config.parallelism_policy.model_parallel:
            self.parallel_mesh = build_mesh(config, self.device.type, ACCELERATE_NAMES)
        self.composed: list[Composed] = []  # one per model prepared, in order
        if self._deepspeed_sections:
            self.state = StateWithDeepSpeedView(
                self.state, DeepSpeedPluginView.of(self.zero_config, self._deepspeed_sections)
            )
        mark_launched_worker(self.process_index)
        # each prepared model's state_dict dtypes as given to prepare: the dtypes DDP would save it in
        self._given_dtypes: dict[nn.Module, dict[str, torch.dtype]] = {}

    @property
    def torch_device_mesh(self):
        """With tensor, sequence or pipeline parallelism the ``([pp,] dp_shard, [sp,] tp)`` mesh."""
        return self.parallel_mesh.mesh if self.parallel_mesh is not None else super().torch_device_mesh

    @property
    def data_parallel_size(self) -> int:
        """The processes that read different batches: all of them, or one per data-parallel position."""
        return self.parallel_mesh.dp_size if self.parallel_mesh is not None else self.num_processes

    # -- prepare ----------------------------------------------------------------------------------------------
    @property
    def engines(self) -> list[ZeroEngine]:
        """The engine of each model prepared, in order."""
        return [composed.engine for composed in self.composed]

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine of the model that trains (the first prepared with an optimizer), else of the first model."""
        trainable = [engine for engine in self.engines if engine.optimizers]
        return (trainable or self.engines or [None])[0]

    @property
    def deepspeed_sections(self) -> dict[str, Any]:
        """The DeepSpeed config's ``optimizer``/``scheduler`` sections as written, those present (empty for any other
        config source). A script passes ``DummyOptim``/``DummyScheduler`` for the ones present, as with accelerate's
        DeepSpeed back-end."""
        return dict(self._deepspeed_sections)

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Shard each model with a ZeRO engine of its own and hand each optimizer to its model's engine; data
        loaders and schedulers are Accelerate's as usual.

        An optimizer belongs to the model whose parameters it holds, prepared in this call or an earlier one;
        several may train one model (``prepare(model, muon, adamw)``), each over its own parameters.
        A model prepared without an optimizer (evaluation, a teacher, or an optimizer still to come) gets an
        engine without one: under stage 3 its forward gathers units as usual.

        With a DeepSpeed config, Accelerate's ``DummyOptim``/``DummyScheduler`` become the optimizer and scheduler
        of its ``optimizer``/``scheduler`` sections, their "auto" values filled as accelerate's DeepSpeed back-end
        fills them (see :mod:`.dummy_objects`); the real ones are prepared and returned.
        """
        resolved = resolve_dummies(args, self._deepspeed_sections, self.data_parallel_size, self.split_batches)
        args = resolved.args
        placement = device_placement or [None] * len(args)
        result = list(args)
        models = {i: obj for i, obj in enumerate(args) if isinstance(obj, nn.Module)}
        optimizers = {i: obj for i, obj in enumerate(args) if isinstance(obj, Optimizer)}
        staged = self.zero_config.pipeline_parallel_size > 1  # no model prepared earlier: Note in _attach
        earlier = [] if staged else [engine.module for engine in self.engines]
        owner = {
            i: _owning_model(optimizer, [*models.values(), *earlier], staged) for i, optimizer in optimizers.items()
        }
        mine = {i: [j for j, target in owner.items() if target is model] for i, model in models.items()}
        for model in models.values():  # everything is checked before anything is sharded
            if self.engine_of(model) is not None:
                raise ValueError(f"{type(model).__name__} was already prepared; prepare each model once")
        for i, model in models.items():
            result[i] = self._shard(model, [optimizers[j] for j in mine[i]], placement[i])
            for j in mine[i]:
                result[j] = self._wrap(optimizers[j])
        later = [j for j in optimizers if not any(owner[j] is model for model in models.values())]
        for earlier_model in {id(owner[j]): owner[j] for j in later}.values():
            given = [j for j in later if owner[j] is earlier_model]
            wrapped = self._attach(self.engine_of(earlier_model), [optimizers[j] for j in given])
            for j, optimizer in zip(given, wrapped):
                result[j] = optimizer
        for i in resolved.built_schedulers:
            result[i] = self._prepare_built_scheduler(args[i])
        rest = [
            i
            for i in range(len(args))
            if i not in models and i not in optimizers and i not in resolved.built_schedulers
        ]
        loaders = [args[i] for i in rest if isinstance(args[i], torch.utils.data.DataLoader)]
        if loaders and not self._dataloaders:
            self._check_batch_sizes(loaders[0])
        if rest:
            prepared = super().prepare(
                *(args[i] for i in rest), device_placement=[placement[i] for i in rest] if device_placement else None
            )
            for i, obj in zip(rest, prepared if len(rest) > 1 else (prepared,)):
                result[i] = obj
        return tuple(result) if len(result) > 1 else result[0]

    def engine_of(self, model: nn.Module) -> ZeroEngine | None:
        """The engine that shards ``model``, if this accelerator prepared it."""
        composed = self._composed_of(model)
        return composed.engine if composed is not None else None

    def _composed_of(self, model: nn.Module) -> Composed | None:
        return next((composed for composed in self.composed if composed.engine.module is model), None)

    def _shard(self, model: nn.Module, optimizers: list[Optimizer], placement: bool | None) -> nn.Module:
        """A new engine over the model composed by :func:`~ds_strategy.compose.compose_model` (the auto tensor-parallel
        plan for a model that arrives unsplit, Ulysses, the pipeline cut, placement, dtype, checkpointing, engine,
        pipeline runner), then the pretrained weights of a model built by ``sharded_from_pretrained`` read into it,
        shard by shard."""
        plan = self.zero_config.plan
        deferred = _deferred_build(model)
        self._given_dtypes[model] = {key: value.dtype for key, value in model.state_dict().items()}
        with _generators_from(deferred, self.device):
            composed = compose_model(
                model,
                self.zero_config,
                mesh=self.parallel_mesh,
                device=self.device,
                log=self.print,
                optimizers=optimizers,
                # a model that arrives unsplit gets the automatic tensor-parallel plan
                tensor_parallel=TensorParallelism(unparallelized=Unparallelized.AUTO_PLAN),
                place=self.device_placement if placement is None else placement,
            )
        model, engine = composed.module, composed.engine  # the same module: Accelerate takes no parallelize_fn
        if deferred is not None and deferred.weights is not None:
            load_weights(engine, deferred.weights)
        if plan.autocasts:
            model.forward = _in_autocast(model.forward, self.zero_config.precision, self.device.type)
        self.composed.append(composed)
        self._models.append(model)
        model._is_accelerate_prepared = True
        model.no_sync = functools.partial(self.no_sync, model)  # DDP's method; see .deepspeed_compat
        if plan.partitions_parameters and engine.world_size > 1:
            # transformers' generate (and Seq2SeqTrainer's predict_with_generate) keeps every rank running forwards
            # until all have finished when a model says its parameters are sharded (FSDP2's mark; DeepSpeed ZeRO-3 it
            # recognises by its global config): a rank done early would leave the others' gathers unanswered
            model._is_fsdp_managed_module = True
        return model

    def _attach(self, engine: ZeroEngine, optimizers: list[Optimizer]) -> list[ZeroAcceleratedOptimizer]:
        """Note: [An optimizer prepared after its model]
        The model's engine laid out its flat buffers without param groups. When each buffer falls inside one
        group of an optimizer or outside it (a single optimizer of a single group always fits), the optimizer
        runs elementwise and its step runs on the device, the optimizer is attached to that engine. Otherwise the
        buffers must be laid out anew (several optimizers of one model, whose groups split the buffers; a
        whole-tensor optimizer, whose parameters go to owner ranks): at stage 0-2 every rank holds the whole
        parameters, so a new engine is built over the module, with all of them, in place of the old one; at stage
        3 the parameters exist only as shards, and the model must be prepared together with its optimizers. Under
        pipelining it must be too, whatever the stage (``prepare`` looks for no earlier model): whether a stage's
        buffers fit the optimizer's groups differs from stage to stage, and a new engine on some stages only would
        leave the pipeline's ranks waiting on each other.
        """
        fits = len(optimizers) == 1 and engine.can_attach(optimizers[0])
        if not engine.optimizers and engine.config.stage < 3 and not fits:
            engine.remove_hooks()
            rebuilt = recompose_engine(
                engine.module, optimizers, self.zero_config, mesh=self.parallel_mesh, device=self.device, log=self.print
            )
            self.composed[self.engines.index(engine)] = rebuilt
        else:
            for optimizer in optimizers:
                engine.attach_optimizer(optimizer)  # raises, saying why, where it cannot
        return [self._wrap(optimizer) for optimizer in optimizers]

    def _wrap(self, optimizer: Optimizer) -> ZeroAcceleratedOptimizer:
        engine = next(engine for engine in self.engines if engine.holds(optimizer))
        wrapped = ZeroAcceleratedOptimizer(
            optimizer, engine, self.zero_config.gradient_clipping, whole=self.state_dict_type == "full"
        )
        self._optimizers.append(wrapped)
        wrapped._is_accelerate_prepared = True
        return wrapped

    def _check_batch_sizes(self, loader: torch.utils.data.DataLoader) -> None:
        """The first data loader prepared is the training one (as Lightning's first batch is): its per-process
        batch must be the config's ``train_micro_batch_size_per_gpu`` and, with the accumulation steps and the
        number of data-parallel processes, make its ``train_batch_size``, or DeepSpeed's global batch would change."""
        config, processes = self.zero_config, self.data_parallel_size
        if loader.batch_size is None or (
            config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None
        ):
            return
        micro = loader.batch_size // processes if self.split_batches else loader.batch_size
        accumulation = self.gradient_accumulation_steps
        expected_micro = config.train_micro_batch_size_per_gpu
        if config.train_batch_size is not None:
            resolved = config.resolve_batch_sizes(processes)
            expected_micro = resolved.train_micro_batch_size_per_gpu
            if micro * accumulation * processes != config.train_batch_size:
                raise ValueError(
                    f"ZeroConfig.train_batch_size={config.train_batch_size} but the prepared data loader gives "
                    f"{micro} samples per process x gradient_accumulation_steps={accumulation} x "
                    f"{processes} processes = {micro * accumulation * processes}; make the "
                    f"loader's batch_size {expected_micro * (processes if self.split_batches else 1)} with "
                    f"gradient_accumulation_steps={resolved.gradient_accumulation_steps}, or change the config"
                )
        if expected_micro is not None and micro != expected_micro:
            raise ValueError(
                f"ZeroConfig.train_micro_batch_size_per_gpu={expected_micro} but the prepared data "
                f"loader gives {micro} samples per process; make the loader's batch_size "
                f"{expected_micro * (processes if self.split_batches else 1)} or change the "
                f"config"
            )

    def _prepare_built_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Note: [A scheduler built from the DeepSpeed config steps once per optimizer step]
        Accelerate's ``AcceleratedScheduler`` steps a user's scheduler ``num_processes`` times per optimizer step
        (its length counts the unsharded loader's batches). DeepSpeed's engine steps the config's scheduler once
        per optimizer step, skipping steps whose fp16 gradients overflowed, and accelerate already divided the
        DummyScheduler's ``total_num_steps`` by the number of processes for it. So the built scheduler is wrapped
        as with ``split_batches``: ``scheduler.step()`` in the loop advances it once per boundary.
        """
        owner = next(
            (wrapped for wrapped in self._optimizers if wrapped.optimizer is getattr(scheduler, "optimizer", None)),
            self._optimizers,
        )
        prepared = AcceleratedScheduler(scheduler, owner, step_with_optimizer=True, split_batches=True)
        prepared._is_accelerate_prepared = True
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(
        self, data_loader: torch.utils.data.DataLoader, device_placement=None, slice_fn_for_dispatch=None
    ):
        """Accelerate's, split over the data-parallel ranks of the mesh when there is one (see
        :func:`.parallelism.prepare_over_data_parallel`)."""
        if self.parallel_mesh is None or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        prepared = prepare_over_data_parallel(self, data_loader, device_placement)
        self._dataloaders.append(prepared)
        return prepared

    # -- training ---------------------------------------------------------------------------------------------
    def pipeline_step(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    ) -> torch.Tensor:
        """The loss of ``loss_fn(model output, target)`` on this batch, for the loop to pass to
        ``accelerator.backward`` and log; the same loop runs with and without pipelining.

        With ``pipeline_parallel_size > 1`` the batch is split into ``pipeline_microbatches`` run through the
        schedule: while ``model`` is in train mode and gradients are enabled, forward and backward (gradients
        divided by ``gradient_accumulation_steps``, as :meth:`backward` divides a loss), otherwise forward only. The
        loss is the mean over the micro-batches on the last stage, the same on every rank, without a graph:
        ``accelerator.backward`` of it does nothing. Without pipelining it is ``loss_fn(model(inputs), target)``
        with its graph (see :func:`~ds_strategy.pipeline.step.pipeline_step`)."""
        composed = self._composed_of(model)
        if composed is None:
            raise ValueError(f"accelerator.pipeline_step: this {type(model).__name__} was not prepared by it")
        train, scale = model.training and torch.is_grad_enabled(), 1.0 / self.gradient_accumulation_steps
        # the autocast of the prepared forward, which the schedule does not call (it runs the model's parts)
        with autocast_for(self.zero_config.precision, self.device.type):
            return pipeline_step(composed.pipeline, model, inputs, target, loss_fn, train=train, grad_scale=scale)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Scale for accumulation as Accelerate does, then backward through the loss scale of the model that
        trains in fp16, if any (:func:`~ds_strategy.adapters.engine_owner.backward_through_loss_scale`). A
        :meth:`pipeline_step` loss has had its backward (and its division) already."""
        if ran_its_backward(loss, self.zero_config.pipeline_parallel_size > 1):
            return
        if not self.engines:
            return super().backward(loss, **kwargs)
        refusal = (
            "fp16 loss scaling with several trained models: each engine keeps its own loss scale; "
            "call engine.backward(loss) for each (accelerator.engine_of(model)), or train in bf16"
        )
        backward_through_loss_scale(self.engines, loss / self.gradient_accumulation_steps, refusal, **kwargs)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Accumulate without gradient communication (stage 0/1; stage 2/3 still reduce); ``accumulate`` uses it.

        Whether a backward communicates is decided when it runs (as in FSDP), not when its forward ran (as in
        DDP): a backward outside ``no_sync`` always reduces, so gradients stay right in every pattern.
        """
        engine = self.engine_of(model)
        with engine.no_sync() if engine is not None else super().no_sync(model):
            yield

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None):
        """Accelerate's ``even_batches`` override of the prepared data loaders, without DDP's Join for the models
        this accelerator shards: a ZeRO engine needs every rank to run the same backward calls, so uneven inputs
        end in ``CollectiveMismatchError`` within ``collective_timeout`` instead of being joined."""
        if not any(self.engine_of(model) is not None for model in joinables):
            with super().join_uneven_inputs(joinables, even_batches=even_batches):
                yield
            return
        overridden = []
        if even_batches is not None:
            for loader in self._dataloaders:
                if isinstance(loader, DataLoaderDispatcher):
                    warnings.warn(
                        "Overriding even_batches is only supported for map-style datasets, yet some "
                        "dataloaders given were iterable",
                        stacklevel=3,
                    )
                    continue
                overridden.append((loader.batch_sampler, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
        try:
            yield
        finally:
            for sampler, value in overridden:
                sampler.even_batches = value

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the engine that shards ``parameters`` to its global norm over all ranks' shards,
        which equals the unsharded model's gradient norm (``torch.nn.utils.clip_grad_norm_`` on the module's own
        ``.grad`` cannot: at stage 2/3 they are None). Over the whole model, one norm, or over one optimizer's
        parameters when ``parameters`` are exactly those of one of several optimizers training it."""
        engine, optimizer = self._engine_of_parameters(parameters)
        if engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        return engine.clip_grad_norm_(float(max_norm), float(norm_type), optimizer=optimizer)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        engine, optimizer = self._engine_of_parameters(parameters)
        if engine is None:
            return super().clip_grad_value_(parameters, clip_value)
        engine.clip_grad_value_(float(clip_value), optimizer=optimizer)

    def _engine_of_parameters(self, parameters: Any) -> tuple[ZeroEngine | None, Optimizer | None]:
        """The one engine whose model owns ``parameters`` (a tensor or an iterable of them), or None for
        parameters no engine shards; and the one of its optimizers that holds exactly them, if any."""
        given = {id(p) for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)}
        owners = [engine for engine in self.engines if any(id(p) in given for p in engine.module.parameters())]
        if len(owners) > 1:
            raise ValueError("these parameters belong to several prepared models; clip each model's separately")
        if not owners:
            return None, None
        engine = owners[0]
        held = {
            optimizer: {id(p) for fp in engine.flat_params_of(optimizer) for p in fp.params}
            for optimizer in engine.optimizers
        }
        exactly = [optimizer for optimizer, params in held.items() if params == given and len(held) > 1]
        return engine, (exactly[0] if exactly else None)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's state dict on every rank, as Accelerate's DDP path returns it; see
        ``consolidated_state_dict``."""
        if self.engine_of(model) is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return self.consolidated_state_dict(model, rank0_only=False)

    def consolidated_state_dict(self, model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole state dict of a prepared model, gathered one flat buffer at a time, in the dtype each tensor had
        when the model was prepared: DDP's rule (it trains and saves the module as given, in autocast for
        "bf16"/"fp16"), so an fp32 model trained in bf16 saves fp32 weights, from the fp32 masters (``ZeroEngine.
        full_state_dict``), never the bf16 copy the forward computes with. Every rank calls it; with ``rank0_only``
        the others return an empty dict and hold at most one gathered buffer.

        Its tensors are copies: the parameters themselves are views of the engine's flat buffers, which
        safetensors would take for shared tensors and drop.
        """
        state = self.engine_of(model).full_state_dict(rank0_only=rank0_only)
        given = self._given_dtypes[model]
        return {key: value.to(given.get(key, value.dtype)) for key, value in state.items()}

    def load_pretrained(self, path, prefix: str = "", model: nn.Module | None = None) -> None:
        """Load pretrained weights into a prepared model (default: the one that trains), each rank reading only
        its shards; see :func:`ds_strategy.checkpoint.pretrained.load_weights`."""
        engine = self.engine_of(model) if model is not None else self.engine
        if engine is None:
            raise RuntimeError("load_pretrained needs a model prepared by this accelerator (accelerator.prepare)")
        load_weights(engine, path, prefix)

    # -- reporting --------------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        """This rank's bytes per kind of model state and place; see :func:`ds_strategy.zero.memory_report`."""
        return self.engine.memory_report()


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: on an accumulation boundary ``step`` runs the engine's sharded step (after the
    config's global-norm clip, if any). Its ``state_dict`` is this rank's shard (``save_state`` saves them all), or
    with ``whole`` (``ZeroAccelerator(state_dict_type="full")``) the whole state on rank 0 and an empty dict on the
    others, as FSDP's full optimizer state dict; ``load_state_dict`` then takes each rank's shard of a whole state
    (ours, DDP's or one device's). Both are collectives: every rank calls them."""

    def __init__(self, optimizer: Optimizer, engine: ZeroEngine, clip_norm: float, whole: bool = False):
        super().__init__(optimizer, device_placement=False)
        self.engine = engine
        self.clip_norm = clip_norm
        self.whole = whole

    def state_dict(self) -> dict[str, Any]:
        if not self.whole:
            return super().state_dict()
        return full_optimizer_state(self.engine, self.engine.optimizers.index(self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.whole:
            return super().load_state_dict(state_dict)
        load_full_optimizer_state(self.engine, state_dict, self.engine.optimizers.index(self.optimizer))

    def step(self, closure=None) -> None:
        """The engine's step of this optimizer (of several training one model, only its parameters), after the
        config's global-norm clip over every gradient the model holds (a later optimizer's step in the same
        iteration finds its gradients within the norm already)."""
        if closure is not None:
            raise ValueError("ZeroAccelerator's optimizer.step() takes no closure: the engine steps on its shards")
        if self.gradient_state.sync_gradients:
            if not self.engine.syncs_gradients:
                self._step_local_replica()
            if self.clip_norm:
                self.engine.clip_grad_norm_(self.clip_norm)
            self._is_overflow = not self.engine.step(self.optimizer)  # fp16 skipped the step: step_was_skipped

    def _step_local_replica(self) -> None:
        """A step inside ``model.no_sync()``, as accelerate's ``LocalSGD`` takes it: every rank steps its own replica
        and LocalSGD averages them (``param.data = ...``) every few steps. Only stage 0 has replicas; the averaged
        parameters are taken back into the flat buffers first (Note: [Parameters replaced behind the engine's
        back]). From stage 1 each rank steps only its shard of one model: there are no replicas to average."""
        stage = self.engine.config.stage
        if stage >= 1:
            raise ValueError(
                f"optimizer.step() inside model.no_sync() (as accelerate's LocalSGD takes it) under ZeRO stage "
                f"{stage}: each rank steps only its shard of the parameters, so there are no per-rank replicas to "
                f"train apart and average; use stage 0 for LocalSGD"
            )
        self.engine.adopt_replaced_parameters()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad(self.optimizer)


# Where an accelerate loop hands control to code that talks to other ranks (the forward: _in_autocast); Note:
# [Collectives a library issues] in ds_strategy.comm.peer_failures.
name_failed_peers_in(
    ZeroAccelerator,
    (
        "wait_for_everyone",
        "gather",
        "gather_for_metrics",
        "reduce",
        "pad_across_processes",
        "save_state",
        "load_state",
        "pipeline_step",
        "backward",
        "clip_grad_norm_",
    ),
)
name_failed_peers_in(ZeroAcceleratedOptimizer, ("step",))


def _in_autocast(forward: Any, precision: str, device_type: str) -> Any:
    @functools.wraps(forward)
    def forward_in_autocast(*args: Any, **kwargs: Any) -> Any:
        with naming_failed_peers("the forward"), autocast_for(precision, device_type):
            return forward(*args, **kwargs)

    return forward_in_autocast


def _owning_model(optimizer: Optimizer, models: list[nn.Module], staged: bool) -> nn.Module:
    """The one model among ``models`` that holds every parameter ``optimizer`` updates; ``staged``: under
    pipelining, where ``models`` are those of this ``prepare`` call only."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if held <= {id(p) for p in model.parameters()}:
            return model
    if staged:
        raise ValueError(
            f"{type(optimizer).__name__} holds parameters of no model in this prepare() call: under "
            f"pipeline_parallel_size > 1 an optimizer must be prepared together with its model, "
            f"accelerator.prepare(model, optimizer) (built over the whole model, before the pipeline cut)"
        )
    raise ValueError(
        f"{type(optimizer).__name__} holds parameters of no model being prepared, or of several: "
        f"prepare its model in the same prepare() call or an earlier one (several optimizers may train one "
        f"model, but each optimizer trains one model)"
    )


def _deferred_build(model: nn.Module) -> DeferredBuild | None:
    """The :class:`DeferredBuild` recorded on ``model``, taken off it. Recorded on a submodule, it means a wrapper
    (PEFT's, a LightningModule) whose names the checkpoint lacks: refused, never left random."""
    wrapped = [name for name, module in model.named_modules() if name and DEFERRED_BUILD_ATTR in module.__dict__]
    if wrapped:
        raise ValueError(
            f"{type(model).__name__}.{wrapped[0]} was built by sharded_from_pretrained and then wrapped; its weights "
            f"are read only into the model as built: prepare that model itself (a wrapper that only adds a name "
            f"prefix can load them after prepare with accelerator.load_pretrained(path, prefix=...))"
        )
    return model.__dict__.pop(DEFERRED_BUILD_ATTR, None)


@contextlib.contextmanager
def _generators_from(deferred: DeferredBuild | None, device: torch.device):
    """Inside, the CPU generator is where it was when ``deferred``'s model was built; on exit it and ``device``'s
    are put back as they were (see :class:`DeferredBuild`). Nothing happens for a model built normally."""
    if deferred is None:
        yield
        return
    devices = {torch.device("cpu"), device}
    saved = {d: generator_state(d) for d in devices}
    set_generator_state(torch.device("cpu"), deferred.generator_state)
    try:
        yield
    finally:
        for d, state in saved.items():
            set_generator_state(d, state)


def _reject_other_sharding(kwargs: Mapping[str, Any]) -> None:
    for argument, variable in _OTHER_SHARDING.items():
        if kwargs.get(argument) is not None:
            raise ValueError(f"ZeroAccelerator shards with ds_strategy's engine; do not also pass {argument}")
        if os.environ.get(variable, "").lower() in ("1", "true"):
            raise ValueError(
                f"ZeroAccelerator shards with ds_strategy's engine, but {variable} is set (accelerate's "
                f"own back-end is configured); remove it from the accelerate config and put the ZeRO "
                f"settings in a ds_strategy section or ${ENV_VAR}"
            )
