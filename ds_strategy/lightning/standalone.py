"""ZeroStrategy and ZeroPrecision for the standalone ``pytorch_lightning`` package.

``pytorch_lightning.Trainer`` accepts only ``pytorch_lightning``'s own strategy and precision classes, which are
distinct from ``lightning.pytorch``'s; these are the same hooks on that package's bases. Importing this module
registers the ``zero*`` names with ``pytorch_lightning``'s registry (``import ds_strategy`` does so when the
package is installed).
"""

from ..optional_packages import needs
from .strategy import zero_strategy_for

# this module is the adapter for the pytorch_lightning package: without it, fail here saying what to install
with needs("pytorch_lightning", needed_by="ds_strategy.lightning.standalone"):
    from pytorch_lightning.strategies import StrategyRegistry

ZeroStrategy = zero_strategy_for("pytorch_lightning", __name__)
ZeroPrecision = ZeroStrategy.precision_class

ZeroStrategy.register_strategies(StrategyRegistry)

__all__ = ["ZeroPrecision", "ZeroStrategy"]
