"""ZeroFabricStrategy: Fabric's strategy hooks translated into ZeroEngine calls; no sharding logic lives here."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.wrappers import _FabricModule, _unwrap_compiled
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from ..adapters.engine_owner import (
    EngineOwnerMixin,
    backward_through_loss_scale,
    release_engine,
    zero_grad_through_engine,
)
from ..adapters.optimizer_sections import optimizers_to_train
from ..adapters.precision_flag import reconcile_precision
from ..adapters.state_dict_type import checked_state_dict_type
from ..comm.peer_failures import name_failed_peers_in, naming_failed_peers
from ..compose import Composed, TensorParallelism, build_mesh, compose_model
from ..config import ZeroConfig
from ..config.sources import LoadedConfig, load_config
from ..parallel.mesh import LIGHTNING_NAMES, ParallelMesh
from ..pipeline.step import pipeline_step, ran_its_backward
from ..precision import autocast_for
from ..precision.init_dtype import init_dtype_context
from ..zero.engine import ZeroEngine
from ..zero.meta_parameters import parameters_on_meta
from .checkpointing import ZeroFabricCheckpointing

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ZeroFabricStrategy(ZeroFabricCheckpointing, EngineOwnerMixin, DDPStrategy):
    """ZeRO data parallelism for Fabric: ``Fabric(strategy="zero2")`` or
    ``Fabric(strategy=ZeroFabricStrategy(stage=1))``.

    Subclasses Fabric's ``DDPStrategy`` for its launchers and process-group setup, but never wraps the model in
    DDP: ``fabric.setup(model, optimizer)`` builds a :class:`ZeroEngine`, which retargets the optimizer onto this
    rank's shards; ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.no_backward_sync`` and
    ``optimizer.step()`` go to the engine. Each model set up gets its own engine (a GAN's generator and
    discriminator, a student beside a frozen teacher or reference model), as DeepSpeed and FSDP allow; see
    :meth:`engine_of` for which engine a call goes to. Set model and optimizer up together
    (``fabric.setup(model, optimizer)``) or the model first (``fabric.setup_module``, or ``fabric.setup(model)``
    alone) and then an optimizer over its parameters (``fabric.setup_optimizers``), which the engine then takes on
    (``ZeroEngine.attach_optimizer``). Config fields are keyword arguments or a :class:`ZeroConfig` (so
    ``precision=`` here is the ZeroConfig field; a Fabric precision plugin goes in ``precision_plugin``).

    Precision: Fabric's ``precision=`` flag is folded into ``ZeroConfig.precision`` (see
    :mod:`ds_strategy.adapters.precision_flag`) and the engine implements it (16-bit buffers, fp32 masters, loss
    scaling); Fabric gets a :class:`ZeroFabricPrecision` that only supplies the autocast region.
    ``ZeroConfig.gradient_clipping``, when set, clips the global gradient norm before every ``optimizer.step()``, as
    DeepSpeed does.

    ``fabric.save``/``fabric.load`` write and read a sharded checkpoint directory, each rank only its shards, and
    load at any world size or ZeRO stage (see :mod:`.checkpointing`); with ``state_dict_type="full"`` (FSDP's name
    and meaning) ``fabric.save`` writes one ``torch.save`` file from rank 0 instead (see
    :mod:`ds_strategy.adapters.state_dict_type`).

    Tensor parallelism (``tensor_parallel_size > 1``) takes Fabric's ``ModelParallelStrategy`` convention: a
    ``parallelize_fn(module, device_mesh) -> module`` applied in setup, over the mesh ``("data_parallel",
    "tensor_parallel")`` (also ``self.device_mesh``), or ``ZeroConfig.tensor_parallel_plan``. ZeRO shards over the
    data-parallel group and ``fabric.setup_dataloaders`` splits batches over it only.

    DeepSpeed-Ulysses (``sequence_parallel_size > 1``) and pipelining (``pipeline_parallel_size > 1``) add the mesh
    dimensions ``"sequence_parallel"`` and ``"pipeline_parallel"``, whose ranks read the same batches too. Under
    Ulysses the loop calls ``shard_sequence`` and ``sequence_parallel_loss`` (:mod:`ds_strategy.parallel.ulysses`)
    over ``self.device_mesh["sequence_parallel"]``; under pipelining it hands each batch to :meth:`pipeline_step`
    instead of calling the model, as a LightningModule does under ``ZeroStrategy``.
    """

    def __init__(
        self,
        config: ZeroConfig | LoadedConfig | Mapping | str | os.PathLike | None = None,
        *,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        state_dict_type: str = "sharded",
        **config_fields: Any,
    ):
        loaded = load_config(config, **config_fields)
        self.state_dict_type = checked_state_dict_type(state_dict_type, type(self).__name__)
        self.config, self.optimizer_sections = loaded.zero, loaded.sections
        self.config_schedulers: dict[Optimizer, Any] = {}  # the config's scheduler by the optimizer it steps
        if parallelize_fn is not None and self.config.tensor_parallel_size == 1:
            raise ValueError("parallelize_fn needs tensor_parallel_size > 1 (the size of its tensor-parallel groups)")
        self.parallelize_fn = parallelize_fn
        self.parallel_mesh: ParallelMesh | None = None
        if self.config.gradient_accumulation_steps != 1:
            raise ValueError(
                f"ZeroConfig.gradient_accumulation_steps={self.config.gradient_accumulation_steps} is not allowed "
                f"with Fabric, whose training loop is yours: accumulate there (fabric.no_backward_sync(model) on all "
                f"but the last micro-batch, the loss divided by their number) and set gradient_accumulation_steps=1"
            )
        self.composed: list[Composed] = []  # one per model set up, in order
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=datetime.timedelta(seconds=self.config.timeout),
            start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)

    @classmethod
    def from_deepspeed_config(cls, ds_config: Mapping | str | os.PathLike, **kwargs: Any) -> ZeroFabricStrategy:
        """Build from a DeepSpeed JSON config (a dict or a path), with DeepSpeed's meaning and its optimizer and
        scheduler sections (see :meth:`setup_module_and_optimizers`); unsupported keys raise a ValueError."""
        return cls(load_config(ds_config, deepspeed=True), **kwargs)

    # -- precision --------------------------------------------------------------------------------------------
    @property
    def precision(self) -> ZeroFabricPrecision:
        if self._precision is None:
            self._precision = ZeroFabricPrecision(self.config.precision)
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        """Fabric hands every strategy the plugin for its ``precision`` flag; keep the flag, not the plugin.

        Left unset until then: Fabric ignores its ``precision`` flag for a strategy that already has a plugin.
        """
        if plugin is not None and not isinstance(plugin, ZeroFabricPrecision):
            self.config = reconcile_precision(self.config, plugin.precision, "Fabric(precision)")
            plugin = ZeroFabricPrecision(self.config.precision)
        self._precision = plugin

    # -- setup ------------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """With tensor, sequence or pipeline parallelism, the ([pp,] dp, [sp,] tp) mesh under ModelParallelStrategy's
        dimension names (and ZeroStrategy's for sp and pp)."""
        super().setup_environment()
        self.precision.device_type = self.root_device.type
        config = self.config
        if config.parallelism_policy.model_parallel:
            self.parallel_mesh = build_mesh(config, self.root_device.type, LIGHTNING_NAMES)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` mesh, as ModelParallelStrategy's ``device_mesh``, with
        ``"pipeline_parallel"`` outside and ``"sequence_parallel"`` before ``"tensor_parallel"`` when used."""
        if self.parallel_mesh is None:
            raise RuntimeError(
                "the device mesh exists after launch, and only with tensor_parallel_size, sequence_parallel_size or "
                "pipeline_parallel_size > 1"
            )
        return self.parallel_mesh.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Batches are split over the data-parallel ranks; a tensor- or sequence-parallel group, and the stages of
        one pipeline, read the same ones."""
        if self.parallel_mesh is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.parallel_mesh.dp_size, "rank": self.parallel_mesh.dp_rank}

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        """``fabric.setup(model, opt_a, opt_b, ...)``: one engine, each optimizer over its own parameters' shards.

        A DeepSpeed config's optimizer section replaces the optimizer given (with a warning), and its scheduler
        section adds a scheduler, returned third (``model, optimizer, scheduler = fabric.setup(model, optimizer)``)
        and stepped by ``optimizer.step()``, as DeepSpeed's engine steps it: the loop does not step it (Note: [A
        DeepSpeed config's optimizer wins] in :mod:`ds_strategy.adapters.optimizer_sections`)."""
        optimizers, scheduler = self._apply_optimizer_sections(module, optimizers, scheduler)
        return self._shard(module, optimizers), optimizers, scheduler

    def _apply_optimizer_sections(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any
    ) -> tuple[list[Optimizer], Any]:
        sections = self.optimizer_sections
        if sections.optimizer is None and sections.scheduler is None:
            return optimizers, scheduler
        if sections.optimizer is not None and scheduler is not None:
            raise ValueError(
                "fabric.setup got a scheduler, but the DeepSpeed config's optimizer section replaces the optimizer it "
                "steps; remove the config's optimizer section or the scheduler"
            )
        optimizers, _, config_scheduler = optimizers_to_train(
            sections,
            module.parameters(),
            optimizers,
            [scheduler] if scheduler is not None else [],
            source="fabric.setup",
            gave="fabric.setup was given",
            theirs="the optimizer passed to fabric.setup",
            warn=rank_zero_warn,
        )
        if config_scheduler is None:
            return optimizers, scheduler
        self.config_schedulers[optimizers[0]] = config_scheduler
        return optimizers, config_scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model alone (an optimizer may follow through ``fabric.setup_optimizers``)."""
        return self._shard(module, None)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer over the parameters of a model set up before it; see ``ZeroEngine.attach_optimizer``."""
        given = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [engine for engine in self.engines if any(id(p) in given for p in engine.module.parameters())]
        if len(owners) != 1:
            raise ValueError(
                f"fabric.setup_optimizers: the {type(optimizer).__name__} must hold parameters of exactly one model "
                f"set up before it (fabric.setup_module(model) first), but holds parameters of {len(owners)}"
            )
        owners[0].attach_optimizer(optimizer)
        zero_grad_through_engine(optimizer, owners[0])
        return optimizer

    def _shard(self, module: nn.Module, optimizers: list[Optimizer] | None) -> nn.Module:
        """A new engine over the model composed by :func:`~ds_strategy.compose.compose_model` (tensor parallelism
        by ``parallelize_fn`` or the configured plan, Ulysses, the pipeline cut, placement, dtype, checkpointing,
        engine, pipeline runner).

        A ``parallelize_fn`` may return the model compiled (``torch.compile``): the engine holds the model inside,
        under its own parameter names (which checkpoints use), and Fabric calls the compiled wrapper, as it hands
        every strategy call the model without it."""
        if self._engine_of_module(module) is not None:
            raise ValueError(f"this {type(module).__name__} was already set up; set each model up once")
        parallelize_fn = None
        if self.parallelize_fn is not None:
            mesh = self.device_mesh
            parallelize_fn = lambda model: self.parallelize_fn(model, mesh)  # noqa: E731
        composed = compose_model(
            module,
            self.config,
            mesh=self.parallel_mesh,
            device=self.root_device,
            log=rank_zero_info,
            optimizers=optimizers or (),
            tensor_parallel=TensorParallelism(parallelize_fn=parallelize_fn),
        )
        self.composed.append(composed)
        for optimizer in optimizers or ():
            zero_grad_through_engine(optimizer, composed.engine)
        return composed.module

    @property
    def engines(self) -> list[ZeroEngine]:
        """The engine of each model set up, in order."""
        return [composed.engine for composed in self.composed]

    @property
    def engine(self) -> ZeroEngine | None:
        """The engine of the first model set up (the only one in a single-model loop); None before setup."""
        return self.engines[0] if self.engines else None

    def engine_of(self, module: nn.Module | None, call: str) -> ZeroEngine:
        """The engine of ``module``; ``None`` stands for the model when only one is set up. ``call`` names the
        Fabric call in errors: before setup, with an unknown model, or with no model while several are set up."""
        if not self.engines:
            raise RuntimeError(
                f"{call} needs the model set up first: model, optimizer = fabric.setup(model, optimizer)"
            )
        if module is None and len(self.engines) == 1:
            return self.engines[0]
        if module is None:
            raise ValueError(f"{call}: {len(self.engines)} models are set up; pass the one meant")
        owner = self._engine_of_module(module)
        if owner is None:
            raise ValueError(f"{call}: this {type(module).__name__} was not set up by fabric.setup")
        return owner

    def teardown(self) -> None:
        """Every engine's hooks removed; the first engine's by :class:`EngineOwnerMixin`, as for one model."""
        for engine in self.engines[1:]:
            release_engine(engine)
        super().teardown()

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None):
        """``fabric.init_module(empty_init=True)`` under stage 3 builds parameters on the meta device (buffers for
        real, as Lightning's build: Note: [Only parameters go to the meta device]), and the engine materialises one
        unit at a time (see :mod:`ds_strategy.zero.sharded_init`); otherwise stage 3 builds on the CPU, for the
        engine to place unit by unit (:mod:`ds_strategy.zero.placement`).

        Every device and dtype is entered by ``with`` only (Fabric returns this from ``fabric.init_module`` as
        called): a context created and never entered must leave the default device alone, not leave it on meta."""
        if not self.config.plan.partitions_parameters:
            with super().module_init_context(empty_init):
                yield
            return
        build = parameters_on_meta() if empty_init else torch.device("cpu")
        with build, self.precision.module_init_context():
            yield

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing: :func:`~ds_strategy.compose.compose_model` places the model in setup, by the one rule for every
        adapter (stage 3 and meta builds are placed unit by unit by the engine)."""

    # -- training ---------------------------------------------------------------------------------------------
    def pipeline_step(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        grad_scale: float = 1.0,
    ) -> torch.Tensor:
        """The loss of ``loss_fn(model output, target)`` on this batch, for a Fabric loop to pass to
        ``fabric.backward`` and log (``fabric.strategy.pipeline_step(model, inputs, target, loss_fn)``); the same
        loop runs with and without pipelining.

        With ``pipeline_parallel_size > 1`` the batch is split into ``pipeline_microbatches`` run through the
        schedule: while ``model`` is in train mode and gradients are enabled, forward and backward (gradients times
        ``grad_scale``: ``1 / accumulated batches`` when the loop accumulates), otherwise forward only. The loss is
        the mean over the micro-batches on the last stage, the same on every rank, without a graph:
        ``fabric.backward`` of it does nothing. Without pipelining it is ``loss_fn(model(inputs), target)`` with
        its graph (see :func:`~ds_strategy.pipeline.step.pipeline_step`)."""
        inner, _ = _unwrap_compiled(model._forward_module if isinstance(model, _FabricModule) else model)
        engine = self.engine_of(inner, "fabric.strategy.pipeline_step")
        runner = next(composed.pipeline for composed in self.composed if composed.engine is engine)
        train = engine.module.training and torch.is_grad_enabled()
        with self.precision.forward_context():  # what Fabric's model wrapper gives the forwards it runs
            inputs = self.precision.convert_input(inputs)
            return pipeline_step(runner, model, inputs, target, loss_fn, train=train, grad_scale=grad_scale)

    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Through the loss scale of ``module``'s engine (``fabric.backward(loss, model=...)``), or with no model
        named, of the one model that trains in fp16, if any (:func:`~ds_strategy.adapters.engine_owner.
        backward_through_loss_scale`). A :meth:`pipeline_step` loss has had its backward already."""
        if ran_its_backward(tensor, self.config.pipeline_parallel_size > 1):
            return
        if module is not None or len(self.engines) == 1:
            self.engine_of(module, "fabric.backward").backward(tensor)
            return
        refusal = (
            "fabric.backward(loss) with several models trained in fp16: each keeps its own loss scale, so name the "
            "model the loss trains: fabric.backward(loss, model=model)"
        )
        backward_through_loss_scale(self.engines, tensor, refusal, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> None:
        """The engine's step of ``optimizer`` (of several training one model, only its parameters), after the
        config's global-norm clip, if any: over every gradient the model holds, one norm (a later optimizer's step
        in the same iteration finds its gradients within the norm already, and leaves them)."""
        engine = next((engine for engine in self.engines if engine.holds(optimizer)), None)
        if engine is None:
            raise ValueError(
                f"optimizer.step(): this {type(optimizer).__name__} trains no model set up by fabric.setup; set it "
                f"up with its model, fabric.setup(model, optimizer)"
            )
        if self.config.gradient_clipping:
            engine.clip_grad_norm_(self.config.gradient_clipping)
        engine.step(optimizer)
        if optimizer in self.config_schedulers:
            self.config_schedulers[optimizer].step()

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip to the global norm over every rank's shards, which equals the unsharded model's gradient norm: of
        ``optimizer``'s parameters, as Fabric clips them (one optimizer of several training a model clips its own).

        A non-finite norm under fp16 loss scaling is an overflow the engine's step will skip, not an error.
        """
        engine = self.engine_of(module, "fabric.clip_gradients")
        total = engine.clip_grad_norm_(float(max_norm), float(norm_type), optimizer=_held(engine, optimizer))
        overflow_expected = engine.loss_scaler is not None
        if error_if_nonfinite and not overflow_expected and not math.isfinite(total.item()):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
                f"pass error_if_nonfinite=False to clip anyway"
            )
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        engine = self.engine_of(module, "fabric.clip_gradients")
        engine.clip_grad_value_(float(clip_val), optimizer=_held(engine, optimizer))


# Where a Fabric loop hands control to code that talks to other ranks (the forward: ZeroFabricPrecision's
# forward_context); Note: [Collectives a library issues] in ds_strategy.comm.peer_failures.
name_failed_peers_in(
    ZeroFabricStrategy,
    (
        "barrier",
        "broadcast",
        "all_reduce",
        "all_gather",
        "reduce_boolean_decision",
        "save_checkpoint",
        "load_checkpoint",
        "pipeline_step",
        "backward",
        "optimizer_step",
        "clip_gradients_norm",
    ),
)


def _held(engine: ZeroEngine, optimizer: Optimizer | None) -> Optimizer | None:
    """``optimizer`` when it trains ``engine``'s model (its parameters are the ones meant), else None (all)."""
    return optimizer if optimizer is not None and engine.holds(optimizer) else None


class ZeroFabricPrecision(Precision):
    """Fabric's side of the engine's precision: every forward runs in autocast to the 16-bit dtype, and "-true"
    also converts the module and floating inputs to it. Loss scaling and fp32 master weights are the engine's."""

    def __init__(self, precision: str):
        self.precision = precision
        plan = ZeroConfig(precision=precision).plan
        self.compute_dtype, self.converts = plan.compute_dtype, plan.converts_module
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the strategy's once it is known

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Unchanged: :func:`~ds_strategy.compose.compose_model` converts a "-true" model in setup, after tensor
        parallelism and the pipeline cut."""
        return module

    def convert_input(self, data: Any) -> Any:
        if not self.converts:
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t
        )

    @contextlib.contextmanager
    def forward_context(self):
        """Autocast, and a peer that fails during the forward (a tensor-parallel redistribution) named."""
        with naming_failed_peers("the forward"), autocast_for(self.precision, self.device_type):
            yield

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """``fabric.init_module()`` under "-true" creates the weights 16-bit, as Fabric's HalfPrecision does."""
        return init_dtype_context(self.precision)

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: accumulate without gradient communication (stage 0/1; stage 2 still reduces)."""

    def __init__(self, strategy: ZeroFabricStrategy):
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return self._strategy.engine_of(module, "fabric.no_backward_sync").no_sync()
