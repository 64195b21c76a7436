"""ZeroPrecision: the Lightning precision plugin a ZeroStrategy owns; it hands clipping and the step to the engine."""
from __future__ import annotations

from typing import Any, Callable

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from ..zero.engine import ZeroEngine


class ZeroPrecision(Precision):
    """Runs Lightning's closure, then the engine's sharded step; clipping uses the global norm over all shards.

    Lightning would otherwise clip ``optimizer.param_groups`` tensors, which are this rank's shards only, and
    call ``optimizer.step`` directly, skipping the parameter refresh.
    """

    def __init__(self, precision: str = "32-true"):
        self.precision = precision
        self.engine: ZeroEngine | None = None

    def optimizer_step(self, optimizer: Optimizer, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        closure_result = self._wrap_closure(model, optimizer, closure)
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return None  # training_step returned None: Lightning's convention for "skip this step"
        self.engine.step()
        return closure_result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.engine.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        self.engine.clip_grad_value_(float(clip_val))
