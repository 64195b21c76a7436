"""ZeRO's configuration: the settings, what they mean, and every way a user writes them.

* ``zero_config``: ``ZeroConfig``, the one place a setting is defaulted, validated and documented;
* ``policies`` and ``plan``: each component's section of it, and what the settings mean for sharding, dtypes and
  communication, derived once;
* ``deepspeed``: a DeepSpeed JSON read with DeepSpeed's meaning (its key rules, its optimizer and scheduler
  sections, its LR schedules); ``auto_values``: DeepSpeed's "auto" sizes;
* ``sources``: ``load_config``, the one reader every adapter, the CLI and Hydra call.
"""

from .sources import LoadedConfig, load_config
from .zero_config import AUTO, OFFLOAD_MODES, UNITS, ZeroConfig, ZeroConfigError

__all__ = ["AUTO", "OFFLOAD_MODES", "UNITS", "LoadedConfig", "ZeroConfig", "ZeroConfigError", "load_config"]
