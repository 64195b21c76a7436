"""ds_strategy: DeepSpeed's ZeRO as a native plugin for the PyTorch ecosystem.

Importing the package registers the ``zero*`` strategy names with Lightning's Trainer.
"""
from .config import ZeroConfig
from .deepspeed_config import config_from_deepspeed
from .zero.engine import ZeroEngine
from .lightning import ZeroPrecision, ZeroStrategy

__all__ = ["ZeroConfig", "ZeroEngine", "ZeroPrecision", "ZeroStrategy", "config_from_deepspeed"]
