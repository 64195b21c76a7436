"""The Lightning adapter: ``ZeroStrategy`` and its precision plugin, registered under the ``zero*`` names
(with ``pytorch_lightning``'s Trainer too, when that package is installed)."""

import importlib.util

from lightning.pytorch.strategies import StrategyRegistry

from ..engine_owner import PRESETS
from .precision import ZeroPrecision
from .strategy import ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)
if importlib.util.find_spec("pytorch_lightning") is not None:
    from . import standalone  # noqa: F401  (registers with pytorch_lightning's StrategyRegistry)

__all__ = ["PRESETS", "ZeroPrecision", "ZeroStrategy"]
