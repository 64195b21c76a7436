"""ds_strategy: DeepSpeed's ZeRO as a native plugin for the PyTorch ecosystem.

The engine needs torch alone; each adapter needs its own framework, which its extra installs (from a clone ``pip
install -e ".[lightning]"``, ``[accelerate]``, ``[transformers]``, ``[hydra]``). When Lightning is installed,
importing the package registers the ``zero*`` strategy names with Lightning's Trainer (and ``pytorch_lightning``'s,
if installed) and with Fabric. The Accelerate adapter is ``ds_strategy.accelerate.ZeroAccelerator``, the Hugging
Face Trainer's ``ds_strategy.transformers.ZeroTrainer``.

Note: [Registering the strategy names]
Lightning offers no entry point through which another package adds strategy names (its entry points are callback
factories, loaded after the strategy is resolved), so ``Trainer(strategy="zero3")`` finds the names because the
adapters register them on import, and this package imports them when Lightning is installed: ``import ds_strategy``
is what a Lightning user writes. Without Lightning there is nothing to register and nothing of Lightning is imported;
``ds_strategy.ZeroStrategy`` then fails saying what to install.
"""

import importlib
import importlib.util

from ._version import __version__
from .config import ZeroConfig
from .config.sources import config_from_deepspeed
from .estimate import estimate_memory
from .zero.chained_optimizer import ChainedOptimizer
from .zero.engine import ZeroEngine
from .zero.optimizer_kinds import declare_optimizer

# the Lightning and Fabric adapters' public names, by the subpackage that defines each
_ADAPTER_NAMES = {"ZeroFabricStrategy": "fabric", "ZeroPrecision": "lightning", "ZeroStrategy": "lightning"}

if importlib.util.find_spec("lightning") is not None:
    from .fabric import ZeroFabricStrategy as ZeroFabricStrategy
    from .lightning import ZeroPrecision as ZeroPrecision
    from .lightning import ZeroStrategy as ZeroStrategy

__all__ = [
    "ChainedOptimizer",
    "ZeroConfig",
    "ZeroEngine",
    "__version__",
    "config_from_deepspeed",
    "declare_optimizer",
    "estimate_memory",
    *(name for name in _ADAPTER_NAMES if name in globals()),
]


def __getattr__(name: str):
    """An adapter's name without Lightning: importing the adapter raises the error that says what to install."""
    if name in _ADAPTER_NAMES:
        return getattr(importlib.import_module(f".{_ADAPTER_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
