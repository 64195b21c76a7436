"""The Accelerate adapter: ``ZeroAccelerator``, an ``Accelerator`` whose ``prepare`` shards with ZeRO.

Accelerate's config file cannot name a third-party back-end, so ZeRO's settings come from a ``ZeroConfig``, a
YAML/JSON file, or ``$DS_STRATEGY_CONFIG`` (which ``ds-strategy launch`` fills from its YAML's ``ds_strategy:``
section); see :mod:`ds_strategy.config.sources`.
"""

from ..optional_packages import needs

# the whole adapter needs accelerate: without it, fail here saying what to install
with needs("accelerate", needed_by="ds_strategy.accelerate"):
    from ..config.sources import ENV_VAR, load_zero_config
    from .accelerator import ZeroAcceleratedOptimizer, ZeroAccelerator

__all__ = ["ENV_VAR", "ZeroAcceleratedOptimizer", "ZeroAccelerator", "load_zero_config"]
