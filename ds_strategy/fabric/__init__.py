"""The Fabric adapter: ``ZeroFabricStrategy``, registered with Fabric under the same ``zero*`` names as Lightning's."""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from .strategy import ZeroFabricStrategy

ZeroFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = ["ZeroFabricStrategy"]
