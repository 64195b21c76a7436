"""ds_strategy: DeepSpeed's ZeRO as a native plugin for the PyTorch ecosystem.

Importing the package registers the ``zero*`` strategy names with Lightning's Trainer (and ``pytorch_lightning``'s,
if installed) and with Fabric. The Accelerate adapter is ``ds_strategy.accelerate.ZeroAccelerator``.
"""

from .config import ZeroConfig
from .deepspeed_config import config_from_deepspeed
from .estimate import estimate_memory
from .fabric import ZeroFabricStrategy
from .lightning import ZeroPrecision, ZeroStrategy
from .zero.chained_optimizer import ChainedOptimizer
from .zero.engine import ZeroEngine
from .zero.optimizer_kinds import declare_optimizer

__all__ = [
    "ChainedOptimizer",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroFabricStrategy",
    "ZeroPrecision",
    "ZeroStrategy",
    "config_from_deepspeed",
    "declare_optimizer",
    "estimate_memory",
]
