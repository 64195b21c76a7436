"""The Lightning adapter: ``ZeroStrategy`` and its precision plugin, registered under the ``zero*`` names."""
from lightning.pytorch.strategies import StrategyRegistry

from .precision import ZeroPrecision
from .strategy import PRESETS, ZeroStrategy

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["PRESETS", "ZeroPrecision", "ZeroStrategy"]
