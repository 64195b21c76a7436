"""Mixed-precision pieces of ds_strategy: loss scaling for fp16, the fused gradient check, autocast regions."""

from .autocast import autocast_for
from .grad_stats import GradStats, unscale_and_check_shards
from .loss_scaler import LossScaler

__all__ = ["GradStats", "LossScaler", "autocast_for", "unscale_and_check_shards"]
