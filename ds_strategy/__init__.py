"""ds_strategy: DeepSpeed's ZeRO as a native plugin for the PyTorch ecosystem.

Importing the package registers the ``zero*`` strategy names with Lightning's Trainer (and ``pytorch_lightning``'s,
if installed) and with Fabric. The Accelerate adapter is ``ds_strategy.accelerate.ZeroAccelerator``.
"""
from .config import ZeroConfig
from .deepspeed_config import config_from_deepspeed
from .zero.engine import ZeroEngine
from .lightning import ZeroPrecision, ZeroStrategy
from .fabric import ZeroFabricStrategy
from .estimate import estimate_memory

__all__ = ["ZeroConfig", "ZeroEngine", "ZeroFabricStrategy", "ZeroPrecision", "ZeroStrategy", "config_from_deepspeed",
           "estimate_memory"]
