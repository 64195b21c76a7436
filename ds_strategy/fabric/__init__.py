"""The Fabric adapter: ``ZeroFabricStrategy``, registered with Fabric under the same ``zero*`` names as Lightning's."""

from ..optional_packages import needs

# the whole adapter needs Lightning (Fabric is part of it): without it, fail here saying what to install
with needs("lightning", "lightning_utilities", needed_by="ds_strategy.fabric"):
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from .strategy import ZeroFabricStrategy

ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["ZeroFabricStrategy"]
