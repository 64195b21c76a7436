"""ZeroFabricStrategy: Fabric's strategy hooks translated into ZeroEngine calls; no sharding logic lives here."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..deepspeed_config import config_from_deepspeed
from ..engine_owner import EngineOwnerMixin, build_engine
from ..parallel.mesh import LIGHTNING_NAMES, ParallelMesh, build_parallel_mesh
from ..parallel.prepare import parallelize_for_config, parallelize_with_optimizer, refuse_sequence_parallel
from ..precision import autocast_for
from ..precision_flag import reconcile_precision
from ..zero.engine import ZeroEngine
from .checkpointing import ZeroFabricCheckpointing

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class ZeroFabricStrategy(ZeroFabricCheckpointing, EngineOwnerMixin, DDPStrategy):
    """ZeRO data parallelism for Fabric: ``Fabric(strategy="zero2")`` or
    ``Fabric(strategy=ZeroFabricStrategy(stage=1))``.

    Subclasses Fabric's ``DDPStrategy`` for its launchers and process-group setup, but never wraps the model in
    DDP: ``fabric.setup(model, optimizer)`` builds a :class:`ZeroEngine`, which retargets the optimizer onto this
    rank's shards; ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.no_backward_sync`` and
    ``optimizer.step()`` go to the engine. Set model and optimizer up together (``fabric.setup(model, optimizer)``)
    or the model first (``fabric.setup_module``, or ``fabric.setup(model)`` alone) and then an optimizer over its
    parameters (``fabric.setup_optimizers``), which the engine then takes on (``ZeroEngine.attach_optimizer``).
    Config fields are keyword arguments or a :class:`ZeroConfig` (so ``precision=`` here is the ZeroConfig
    field; a Fabric precision plugin goes in ``precision_plugin``).

    Precision: Fabric's ``precision=`` flag is folded into ``ZeroConfig.precision`` (see
    :mod:`ds_strategy.precision_flag`) and the engine implements it (16-bit buffers, fp32 masters, loss scaling);
    Fabric gets a :class:`ZeroFabricPrecision` that only supplies the autocast region. ``ZeroConfig.gradient_clipping``,
    when set, clips the global gradient norm before every ``optimizer.step()``, as DeepSpeed does.

    ``fabric.save``/``fabric.load`` write and read a sharded checkpoint directory, each rank only its shards, and
    load at any world size or ZeRO stage (see :mod:`.checkpointing`).

    Tensor parallelism (``tensor_parallel_size > 1``) takes Fabric's ``ModelParallelStrategy`` convention: a
    ``parallelize_fn(module, device_mesh) -> module`` applied in setup, over the mesh ``("data_parallel",
    "tensor_parallel")`` (also ``self.device_mesh``), or ``ZeroConfig.tensor_parallel_plan``. ZeRO shards over the
    data-parallel group and ``fabric.setup_dataloaders`` splits batches over it only.
    """

    def __init__(
        self,
        config: ZeroConfig | Mapping | None = None,
        *,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        start_method: str = "popen",
        parallelize_fn: Callable[[nn.Module, DeviceMesh], nn.Module] | None = None,
        **config_fields: Any,
    ):
        self.config = ZeroConfig.build(config, **config_fields)
        refuse_sequence_parallel(self.config, "the Fabric strategy")
        if self.config.pipeline_parallel_size > 1:
            raise ValueError(
                f"ZeroConfig.pipeline_parallel_size={self.config.pipeline_parallel_size} is not supported by the "
                f"Fabric strategy: only the Lightning Trainer (ZeroStrategy) runs pipeline schedules; use it, or "
                f"pipeline_parallel_size=1"
            )
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
        self.engine: ZeroEngine | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
        )
        self._backward_sync_control = _ZeroBackwardSyncControl(self)

    @classmethod
    def from_deepspeed_config(cls, ds_config: Mapping | str | os.PathLike, **kwargs: Any) -> ZeroFabricStrategy:
        """Build from a DeepSpeed JSON config (a dict or a path); unsupported keys raise a ValueError."""
        return cls(config_from_deepspeed(ds_config), **kwargs)

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
        """With tensor parallelism, the (dp, tp) mesh under ModelParallelStrategy's dimension names."""
        super().setup_environment()
        self.precision.device_type = self.root_device.type
        if self.config.tensor_parallel_size > 1:
            self.parallel_mesh = build_parallel_mesh(
                self.root_device.type, self.config.tensor_parallel_size, LIGHTNING_NAMES
            )

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` mesh, as ModelParallelStrategy's ``device_mesh``."""
        if self.parallel_mesh is None:
            raise RuntimeError("the device mesh exists after launch, and only with tensor_parallel_size > 1")
        return self.parallel_mesh.mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Batches are split over the data-parallel ranks; a tensor-parallel group reads the same ones."""
        if self.parallel_mesh is None:
            return super().distributed_sampler_kwargs
        return {"num_replicas": self.parallel_mesh.dp_size, "rank": self.parallel_mesh.dp_rank}

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[Optimizer], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"ZeroFabricStrategy supports exactly one optimizer per model, got {len(optimizers)}")
        return self._shard(module, optimizers[0]), optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The model alone (an optimizer may follow through ``fabric.setup_optimizers``)."""
        return self._shard(module, None)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An optimizer over the parameters of the model set up before it; see ``ZeroEngine.attach_optimizer``."""
        if self.engine is None:
            raise ValueError("set the model up first (fabric.setup_module), then its optimizer")
        self.engine.attach_optimizer(optimizer)
        return optimizer

    def _shard(self, module: nn.Module, optimizer: Optimizer | None) -> nn.Module:
        """Tensor parallelism first (``parallelize_fn`` or the configured plan), then the engine over the result."""
        if self.engine is not None:
            raise ValueError("ZeroFabricStrategy shards one model; fabric.setup was already called with another")
        if self.parallel_mesh is not None:
            module = parallelize_with_optimizer(module, optimizer, self._parallelize)
        self.engine = build_engine(
            module, optimizer, self.config, device=self.root_device, log=rank_zero_info, mesh=self.parallel_mesh
        )
        return module

    def _parallelize(self, module: nn.Module) -> nn.Module:
        if self.parallelize_fn is not None:
            module = self.parallelize_fn(module, self.device_mesh)
            if not isinstance(module, nn.Module):
                raise TypeError(f"parallelize_fn must return an nn.Module, got {type(module).__name__}")
        parallelize_for_config(module, self.parallel_mesh, self.config)
        return module

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` under stage 3 builds on the meta device, and the engine
        materialises one unit at a time (see :mod:`ds_strategy.zero.sharded_init`); otherwise stage 3 builds on
        the CPU, for the engine to place unit by unit (:mod:`ds_strategy.zero.placement`)."""
        if not self.config.plan.partitions_parameters:
            return super().module_init_context(empty_init)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else torch.device("cpu"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """Stage 3 never moves the whole model: the engine places it one unit at a time as it flattens it."""
        if not self.config.plan.partitions_parameters:
            super().module_to_device(module)

    # -- training ---------------------------------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.engine.backward(tensor)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> None:
        if self.config.gradient_clipping:
            self.engine.clip_grad_norm_(self.config.gradient_clipping)
        self.engine.step()

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip to the global norm over every rank's shards, which equals the unsharded model's gradient norm.

        A non-finite norm under fp16 loss scaling is an overflow the engine's step will skip, not an error.
        """
        total = self.engine.clip_grad_norm_(float(max_norm), float(norm_type))
        overflow_expected = self.engine.loss_scaler is not None
        if error_if_nonfinite and not overflow_expected and not math.isfinite(total.item()):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}); "
                f"pass error_if_nonfinite=False to clip anyway"
            )
        return total

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.engine.clip_grad_value_(float(clip_val))


class ZeroFabricPrecision(Precision):
    """Fabric's side of the engine's precision: every forward runs in autocast to the 16-bit dtype, and "-true"
    also converts the module and floating inputs to it. Loss scaling and fp32 master weights are the engine's."""

    def __init__(self, precision: str):
        self.precision = precision
        plan = ZeroConfig(precision=precision).plan
        self.compute_dtype, self.converts = plan.compute_dtype, plan.converts_module
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"  # the strategy's once it is known

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.compute_dtype) if self.converts else module

    def convert_input(self, data: Any) -> Any:
        if not self.converts:
            return data
        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t
        )

    def forward_context(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.precision, self.device_type)


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync``: accumulate without gradient communication (stage 0/1; stage 2 still reduces)."""

    def __init__(self, strategy: ZeroFabricStrategy):
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled or self._strategy.engine is None:
            return contextlib.nullcontext()
        return self._strategy.engine.no_sync()
