"""ZeroPrecision: the Lightning precision plugin a ZeroStrategy owns; it hands loss scaling, clipping and the
step to the engine.

The engine implements precision itself (16-bit flat parameter buffers, fp32 master shards, fp32 reduced
gradients; see :class:`~ds_strategy.zero.engine.ZeroEngine`); this plugin adds what belongs to the training loop:
the autocast region of every step, the loss scale applied before backward, the unscale/check/clip/step sequence,
logging of the scaler, and the scaler's state in Lightning checkpoints.

Note: [Skipped fp16 steps and the LR scheduler]
  When the loss scaler finds an inf/nan on any rank, every rank skips the optimizer step (the engine's ``step``
  returns False). Lightning still counts the step in ``trainer.global_step``, exactly as with its own AMP
  plugin, whose ``GradScaler.step`` skips ``optimizer.step()`` silently. Lightning's AMP plugin has no way to
  tell the loop about the skip, so there the LR scheduler advances anyway; here it does not, as in DeepSpeed,
  whose engine steps the scheduler only after a step that was taken. While a LightningModule trains under fp16
  loss scaling (automatic optimization) its ``lr_scheduler_step`` hook is wrapped for the duration of the fit:
  on a skipped step, schedulers with ``interval="step"`` are not stepped; epoch schedulers and the user's own
  ``lr_scheduler_step`` override otherwise run unchanged. The wrapper is an instance attribute, removed again
  at teardown, and never part of any state dict.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.optim import Optimizer

from ..config import ZeroConfig
from ..precision import autocast_for
from ..precision.init_dtype import init_dtype_context
from ..zero.engine import ZeroEngine


class ZeroPrecisionMixin:
    """Runs Lightning's closure, then the engine's unscale/check, clipping and sharded step.

    Lightning would otherwise clip ``optimizer.param_groups`` tensors, which are this rank's shards only, and
    call ``optimizer.step`` directly, skipping the parameter refresh and the overflow check.

    ``precision``: "32-true", "bf16-mixed", "16-mixed", "bf16-true" or "16-true" (and Lightning's aliases).
    Every 16-bit precision runs forward in ``torch.autocast`` to the 16-bit dtype, so fp32 inputs meet the 16-bit
    parameters; "-true" also converts the module and floating inputs to it, as Lightning's ``HalfPrecision``
    does. Under "16-mixed"/"16-true" the loss is multiplied by ``engine.loss_scaler.scale`` before backward, and
    ``loss_scale`` and ``skipped_steps`` are logged at every training step (the scale is the one this step's
    backward uses; ``skipped_steps`` counts overflow skips so far).

    What hooks see: ``on_before_optimizer_step`` and clipping run after the engine has divided the loss scale out
    of the reduced gradient shards that the optimizer reads (``engine.grad_norm()`` reports their norm). At stage
    0/1 the parameters' ``.grad`` views still hold the 16-bit, scaled gradients they accumulated in.
    """

    def __init__(self, precision: str = "32-true", device: str | None = None):
        self.plan = ZeroConfig(precision=precision).plan
        self.precision = self.plan.precision
        self.device = device
        self.engine: ZeroEngine | None = None
        self.last_step_skipped = False
        self._pending_scaler_state: dict | None = None
        self._module = None
        self._gated_module = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.plan.compute_dtype

    def attach_engine(self, engine: ZeroEngine, module: Any) -> None:
        """Use ``engine`` for the steps of LightningModule ``module``; apply scaler state loaded before it existed."""
        self.engine, self._module = engine, module
        if engine.loss_scaler is not None and self._pending_scaler_state is not None:
            engine.loss_scaler.load_state_dict(self._pending_scaler_state)
            self._pending_scaler_state = None
        if engine.loss_scaler is not None and getattr(module, "automatic_optimization", False):
            self._gate_lr_scheduler_step(module)

    # -- module, inputs and the autocast region ---------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Unchanged: :func:`~ds_strategy.compose.compose_model` converts a "-true" module in setup (after tensor
        parallelism and the pipeline cut); under "-mixed" the engine makes its flat buffers 16-bit."""
        return module

    def convert_input(self, data: Any) -> Any:
        if not self.plan.converts_module:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return autocast_for(self.precision, self._device_type())

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """``trainer.init_module()`` under "-true" creates the weights 16-bit, as Lightning's HalfPrecision does."""
        return init_dtype_context(self.precision)

    @contextlib.contextmanager
    def train_step_context(self):
        self._log_loss_scale()
        with self.forward_context():
            yield

    def _device_type(self) -> str:
        if self.engine is not None:
            return self.engine.device.type
        return self.device or ("cuda" if torch.cuda.is_available() else "cpu")

    def _log_loss_scale(self) -> None:
        scaler = self.engine.loss_scaler if self.engine is not None else None
        if scaler is not None and self._module is not None:
            module = self._module
            module.log("loss_scale", scaler.scale, on_step=True, on_epoch=False, rank_zero_only=True)
            module.log("skipped_steps", float(scaler.skipped_steps), on_step=True, on_epoch=False, rank_zero_only=True)

    # -- backward and step ------------------------------------------------------------------------------------
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = self.engine.scale_loss(tensor) if self.engine is not None else tensor
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Closure (forward and backward), unscale and check, Lightning's hooks and clipping, then the step.

        The gradients are unscaled before ``on_before_optimizer_step`` and clipping, as Lightning's AMP plugin
        does, so both see true magnitudes; the clipping norm is the one the unscale pass already computed.
        """
        closure_result = closure()
        skipped_backward = closure_result is None and getattr(model, "automatic_optimization", True)
        if not skipped_backward and self.engine.loss_scaler is not None:
            self.engine.unscale_gradients(optimizer)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return None  # training_step returned None: Lightning's convention for "skip this step"
        self.last_step_skipped = not self.engine.step(optimizer)
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``optimizer``'s parameters, as Lightning clips them (all of them under one optimizer)."""
        self.engine.clip_grad_norm_(float(clip_val), optimizer=_unwrapped(optimizer))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        self.engine.clip_grad_value_(float(clip_val), optimizer=_unwrapped(optimizer))

    # -- skipped steps and the LR scheduler (see Note: [Skipped fp16 steps and the LR scheduler]) ---------------
    def _gate_lr_scheduler_step(self, module: Any) -> None:
        if self._gated_module is module:
            return
        hook = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            configs = module.trainer.lr_scheduler_configs if module._trainer is not None else []
            per_step = any(c.scheduler is scheduler and c.interval == "step" for c in configs)
            if not (self.last_step_skipped and per_step):
                hook(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step
        self._gated_module = module

    def teardown(self) -> None:
        if self._gated_module is not None:
            del self._gated_module.lr_scheduler_step
            self._gated_module = None
        super().teardown()

    # -- checkpoint -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler's state under fp16 (Lightning saves it in the checkpoint); empty otherwise."""
        scaler = self.engine.loss_scaler if self.engine is not None else None
        return {"loss_scaler": scaler.state_dict()} if scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "loss_scaler" not in state_dict:
            return
        if self.engine is not None and self.engine.loss_scaler is not None:
            self.engine.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        else:
            self._pending_scaler_state = state_dict["loss_scaler"]


def _unwrapped(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer inside the ``LightningOptimizer`` that ``self.optimizers()`` hands a manual loop."""
    return getattr(optimizer, "_optimizer", optimizer)


_PRECISION_CLASSES: dict[str, type] = {}


def zero_precision_for(package: str, module: str) -> type:
    """ZeroPrecision on ``package``'s Precision base (``"lightning.pytorch"`` or ``"pytorch_lightning"``).

    The two packages define distinct Precision classes and each Trainer checks for its own, so each gets a
    subclass, exposed as ``ZeroPrecision`` in ``module`` so that it pickles. One class per package, whatever
    ``module`` later callers pass (the first names where it lives), so that ``isinstance`` checks and pickling
    see the same class that user code imports.
    """
    if package not in _PRECISION_CLASSES:
        base = importlib.import_module(f"{package}.plugins.precision").Precision
        _PRECISION_CLASSES[package] = type(
            "ZeroPrecision", (ZeroPrecisionMixin, base), {"__doc__": ZeroPrecisionMixin.__doc__, "__module__": module}
        )
    return _PRECISION_CLASSES[package]


ZeroPrecision = zero_precision_for("lightning.pytorch", __name__)
