"""The Lightning adapter: ``ZeroStrategy`` and its precision plugin, registered under the ``zero*`` names
(with ``pytorch_lightning``'s Trainer too, when that package is installed)."""

import importlib.util

from ..adapters.engine_owner import PRESETS
from ..optional_packages import needs

# the whole adapter needs Lightning: without it, fail here saying what to install
with needs("lightning", "lightning_utilities", needed_by="ds_strategy.lightning"):
    from lightning.pytorch.strategies import StrategyRegistry

    from .grad_norm import grad_norm
    from .precision import ZeroPrecision
    from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)
if importlib.util.find_spec("pytorch_lightning") is not None:
    from . import standalone  # noqa: F401  (registers with pytorch_lightning's StrategyRegistry)

__all__ = ["PRESETS", "ZeroPrecision", "ZeroStrategy", "grad_norm"]
