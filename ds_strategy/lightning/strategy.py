"""ZeroStrategy: Lightning's hooks translated into ZeroEngine calls; no sharding logic lives here."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..adapters.engine_owner import EngineOwnerMixin, zero_grad_through_engine
from ..adapters.micro_batch import check_micro_batch
from ..adapters.precision_flag import reconcile_precision
from ..adapters.state_dict_type import checked_state_dict_type
from ..comm.accounting import StepCommMeter
from ..comm.peer_failures import name_failed_peers_in
from ..comm.process_exit import destroy_process_groups_at_exit
from ..comm.rank_failure import report_failure
from ..compose import TensorParallelism, Unparallelized, build_mesh, compose_model
from ..config import ZeroConfig
from ..config.sources import LoadedConfig, load_config
from ..parallel.mesh import LIGHTNING_NAMES, ParallelMesh
from ..pipeline.runner import PipelineRunner
from ..pipeline.step import pipeline_step
from ..zero.engine import ZeroEngine
from ..zero.meta_parameters import parameters_on_meta
from .checkpointing import ZeroCheckpointing
from .config_optimizer import apply_optimizer_sections
from .precision import ZeroPrecision, zero_precision_for
from .preemption import add_preemption_checkpoint

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision import Precision


class ZeroStrategyMixin(EngineOwnerMixin):
    """ZeRO data parallelism for the Lightning Trainer: ``Trainer(strategy="zero2")`` or ``ZeroStrategy(stage=1)``.

    Subclasses ``DDPStrategy`` for its launchers and process-group setup, but never wraps the model in DDP:
    the :class:`ZeroEngine` shards parameters, gradients and optimizer state and reduces gradients itself.
    Gradient accumulation and checkpoint scheduling stay with the Trainer. Config fields can be passed as keyword
    arguments or as a :class:`ZeroConfig`.

    This mixin holds the hooks; :func:`zero_strategy_for` puts it on ``lightning.pytorch``'s or
    ``pytorch_lightning``'s DDPStrategy, whose Trainers each accept only their own package's classes.
    """

    strategy_name = "zero"
    precision_class: type  # this package's ZeroPrecision, set by zero_strategy_for

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
        state_dict_type: str = "sharded",
        **config_fields: Any,
    ):
        loaded = load_config(config, **config_fields)
        self.state_dict_type = checked_state_dict_type(state_dict_type, type(self).__name__)
        self.config, self.optimizer_sections = loaded.zero, loaded.sections
        self._micro_batch_checked = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=datetime.timedelta(seconds=self.config.timeout),
            start_method=start_method,
        )
        self.engine: ZeroEngine | None = None
        self.parallel_mesh: ParallelMesh | None = None
        self.pipeline: PipelineRunner | None = None
        self._comm_meter: StepCommMeter | None = None

    @classmethod
    def from_deepspeed_config(cls, ds_config: Mapping | str | os.PathLike, **kwargs: Any) -> ZeroStrategy:
        """Build from a DeepSpeed JSON config (a dict or a path), with DeepSpeed's meaning and its optimizer and
        scheduler sections (used when ``configure_optimizers`` returns None); unsupported keys raise a ValueError."""
        return cls(load_config(ds_config, deepspeed=True), **kwargs)

    # -- precision --------------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ZeroPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = self.precision_class(self.config.precision)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Lightning hands every strategy a generic plugin for the ``precision`` flag; turn it into ours.

        The flag and ``ZeroConfig.precision`` are reconciled
        (:func:`~ds_strategy.adapters.precision_flag.reconcile_precision`): a flag left at "32-true" defers to the
        config. On CPU Lightning itself turns ``precision="16-mixed"`` into "bf16-mixed" before any strategy sees it;
        pass ``ZeroStrategy(precision="16-mixed")`` to train fp16 there.
        """
        if plugin is not None:
            self.config = reconcile_precision(self.config, str(plugin.precision), "Trainer(precision)")
            if not isinstance(plugin, self.precision_class) or plugin.precision != self.config.precision:
                plugin = self.precision_class(self.config.precision)
        self._precision_plugin = plugin

    # -- setup ------------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """The ([pp,] dp, [sp,] tp) mesh under Lightning's names, as ``self.device_mesh`` of the LightningModule,
        before ``configure_model`` runs, exactly as Lightning's ModelParallelStrategy gives it ("sequence_parallel"
        and "pipeline_parallel" are ours). Without tensor, sequence or pipeline parallelism it is the
        (data_parallel, tensor_parallel=1) mesh, for code that reads ``self.device_mesh["data_parallel"]``, and
        the engine shards over the default group as without a mesh."""
        super().setup_environment()
        config = self.config
        mesh = build_mesh(config, self.root_device.type, LIGHTNING_NAMES)
        if config.parallelism_policy.model_parallel:
            self.parallel_mesh = mesh
        self.lightning_module._device_mesh = mesh.mesh
        destroy_process_groups_at_exit(self._release_mesh)  # [Why every process group is destroyed at exit]

    def _release_mesh(self) -> None:
        """Drop the references to the mesh's groups held here and by the LightningModule, before they are destroyed."""
        self.parallel_mesh = None
        if self._lightning_module is not None:
            self._lightning_module._device_mesh = None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Batches are split over the data-parallel ranks; a tensor- or sequence-parallel group, and the stages of
        one pipeline, read the same ones."""
        if self.parallel_mesh is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.parallel_mesh.dp_size, "rank": self.parallel_mesh.dp_rank}

    def setup(self, trainer) -> None:
        """The model composed by :func:`~ds_strategy.compose.compose_model` (tensor parallelism, Ulysses, the
        pipeline cut, placement, checkpointing, engine, pipeline runner), with the Trainer's optimizer built once the
        model is cut down to this rank's stages; then the precision plugin attached to the engine."""
        self.accelerator.setup(trainer)
        dp_size = self.parallel_mesh.dp_size if self.parallel_mesh is not None else self.world_size
        config = self.config.resolve_batch_sizes(dp_size)
        self._check_trainer_matches(trainer, config)
        composed = compose_model(
            self.lightning_module,
            config,
            mesh=self.parallel_mesh,
            device=self.root_device,
            log=rank_zero_info,
            optimizers=functools.partial(self._build_optimizer, trainer),
            # a model without tensor-parallel layers runs whole on every tp rank, as under ModelParallelStrategy
            tensor_parallel=TensorParallelism(unparallelized=Unparallelized.REPLICATE),
        )
        self.engine, self.pipeline = composed.engine, composed.pipeline
        if not self.lightning_module.automatic_optimization:
            # the loop's own zero_grad calls clear their optimizer's gradients; automatic optimization zeroes after
            # the training step, whose backward a pipeline schedule has run already, and the step consumes them
            for optimizer in self.engine.optimizers:
                zero_grad_through_engine(optimizer, self.engine)
        self._comm_meter = StepCommMeter(self.engine.comm_stats) if config.log_comm_stats else None
        self.precision_plugin.attach_engine(self.engine, self.lightning_module)
        self.setup_precision_plugin()

    def _build_optimizer(self, trainer):
        """The optimizers ``configure_optimizers`` returns when fitting (none otherwise), over this rank's stages:
        several train one model under manual optimization (Muon on the hidden matrices, AdamW on the rest), each
        over its own parameters, and each ``optimizer.zero_grad()`` clears its own gradients (Note: [zero_grad
        through the engine])."""
        optimizers = []
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            add_preemption_checkpoint(trainer)  # [Why ZeroStrategy replaces Lightning's SIGTERM handling]
            apply_optimizer_sections(self, self.optimizer_sections)
            optimizers = list(self.optimizers)
            self.record_optimizer_order(optimizers)  # before the engine retargets them onto flat shards
        self.keep_fit_optimizer(fitting=bool(optimizers))
        return optimizers

    def _check_trainer_matches(self, trainer, config: ZeroConfig) -> None:
        """A DeepSpeed config's accumulation and clipping must agree with the Trainer, which owns both loops."""
        if (
            config.gradient_accumulation_steps != 1
            and trainer.accumulate_grad_batches != config.gradient_accumulation_steps
        ):
            raise ValueError(
                f"ZeroConfig.gradient_accumulation_steps={config.gradient_accumulation_steps} but the Trainer has "
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}; the Trainer runs accumulation, so pass "
                f"Trainer(accumulate_grad_batches={config.gradient_accumulation_steps})"
            )
        if config.gradient_clipping and trainer.gradient_clip_val not in (None, config.gradient_clipping):
            raise ValueError(
                f"ZeroConfig.gradient_clipping={config.gradient_clipping} (a DeepSpeed config clips at "
                f"1.0 unless it says otherwise) but Trainer(gradient_clip_val={trainer.gradient_clip_val})"
                f'; set clipping in one place (gradient_clipping: "auto" defers to the Trainer)'
            )
        if config.gradient_clipping:
            trainer.gradient_clip_val = config.gradient_clipping

    # -- training ---------------------------------------------------------------------------------------------
    def pipeline_step(self, inputs: torch.Tensor, target: Any, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]):
        """The loss of ``loss_fn(model output, target)`` on this batch, for a LightningModule's training, validation
        and test steps to return or log; the same step code runs with and without pipelining (see
        :func:`ds_strategy.pipeline.step.pipeline_step`): in training, forward and backward with gradients
        divided by ``accumulate_grad_batches``, in validation and test forward only; under pipelining the loss
        carries no graph and :meth:`backward` does nothing. The LightningModule's ``forward`` must return what the
        last stage returns (the logits of a causal LM).
        """
        module = self.lightning_module
        trainer = module.trainer
        train = module.training and trainer.training
        return pipeline_step(
            self.pipeline,
            module,
            inputs,
            target,
            loss_fn,
            train=train,
            grad_scale=1.0 / trainer.accumulate_grad_batches,
        )

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's backward, except under pipelining: the schedule ran it inside :meth:`pipeline_step`, so only
        the hooks around it run (``on_before_backward``, ``on_after_backward``)."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Lightning's non-boundary accumulation micro-batches: no gradient communication at stage 0/1."""
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    @contextlib.contextmanager
    def model_sharded_context(self):
        """Under stage 3, ``configure_model`` builds its parameters on the meta device and the engine materialises
        and initialises shards only; buffers and other tensors (torchmetrics states) are built for real, see
        Note: [Only parameters go to the meta device]. What the LightningModule held before (a model built in
        ``__init__``, which ``configure_model`` may parallelize) keeps its values: Note: [What the build context
        moves to meta]."""
        if not self.config.plan.partitions_parameters:
            yield
            return
        with parameters_on_meta(existing=self.lightning_module):
            yield

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None):
        """``trainer.init_module(empty_init=True)`` under stage 3 is the build ``configure_model`` gets (as FSDP
        builds on meta): parameters on meta, initialised shard by shard in setup, never uninitialised memory.
        Otherwise Lightning's: on the root device, and with ``empty_init=True`` at stage 0-2 uninitialised (for a
        checkpoint to fill), as DDP and DeepSpeed do."""
        if not (empty_init and self.config.plan.partitions_parameters):
            with super().tensor_init_context(empty_init):
                yield
            return
        with self.root_device, parameters_on_meta(), self.precision_plugin.tensor_init_context():
            yield

    def _before_forward(self) -> None:
        """A LightningModule's steps call submodules, not the root's forward: make the root unit usable (the
        pipeline runner gathers its stages' units itself)."""
        if self.engine is not None and self.pipeline is None:
            self.engine.before_forward()

    def training_step(self, *args: Any, **kwargs: Any):
        if not self._micro_batch_checked and args:
            check_micro_batch(self.engine.config if self.engine is not None else self.config, args[0])
            self._micro_batch_checked = True
        self._before_forward()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        self._before_forward()
        return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        self._before_forward()
        return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        self._before_forward()
        return super().predict_step(*args, **kwargs)

    def _reshard(self) -> None:
        if self.engine is not None:
            self.engine.reshard()

    def on_validation_end(self) -> None:
        self._reshard()
        super().on_validation_end()

    def on_test_end(self) -> None:
        self._reshard()
        super().on_test_end()

    def on_predict_end(self) -> None:
        self._reshard()
        super().on_predict_end()

    def on_exception(self, exception: BaseException) -> None:
        """Record this rank's failure before teardown, so the others leave their collectives naming it
        (see [How a failed rank ends the job] in ``ds_strategy.comm.rank_failure``)."""
        report_failure(exception)
        super().on_exception(exception)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any):
        """The step (through the precision plugin), then its communication to the logger (``log_comm_stats``)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._comm_meter is not None:
            self.lightning_module.log_dict(
                self._comm_meter.step_metrics(), on_step=True, on_epoch=False, rank_zero_only=True
            )
        return output


def zero_strategy_for(package: str, module: str) -> type:
    """ZeroStrategy on ``package``'s DDPStrategy (``"lightning.pytorch"`` or ``"pytorch_lightning"``), with that
    package's ZeroPrecision; exposed as ``ZeroStrategy`` in ``module`` so that it pickles (spawn launchers)."""
    ddp = importlib.import_module(f"{package}.strategies").DDPStrategy
    namespace = {
        "__doc__": ZeroStrategyMixin.__doc__,
        "__module__": module,
        "precision_class": zero_precision_for(package, module),
    }
    return name_failed_peers_in(type("ZeroStrategy", (ZeroCheckpointing, ZeroStrategyMixin, ddp), namespace), SEAMS)


# Where a Lightning fit hands control to code that talks to other ranks: its collectives, the checkpoint's save
# and load (whatever they write: Note: [Collectives a library issues] in ds_strategy.comm.peer_failures), the steps
# (a tensor-parallel forward's DTensor redistributions, torchmetrics' syncs, the pipeline's send/recv) and the step.
SEAMS = (
    "barrier",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_boolean_decision",
    "save_checkpoint",
    "load_checkpoint",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "backward",
    "optimizer_step",
)


ZeroStrategy = zero_strategy_for("lightning.pytorch", __name__)
