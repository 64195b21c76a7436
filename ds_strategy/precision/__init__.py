"""Mixed-precision pieces of ds_strategy: loss scaling for fp16."""

from .loss_scaler import LossScaler

__all__ = ["LossScaler"]
