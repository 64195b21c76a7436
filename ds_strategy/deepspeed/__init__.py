"""``import ds_strategy.deepspeed as deepspeed``: DeepSpeed's own API (``initialize``, the engine's methods,
``zero.Init``, ``zero.GatheredParameters``, ``comm``, ``add_config_arguments``, ``init_distributed``) over
ds_strategy's engine, so that a DeepSpeed script runs with that one line changed and no DeepSpeed installed
(docs/deepspeed_initialize.md). Also what migrating from DeepSpeed needs beside it: its checkpoints
(``checkpoint_import``), its accelerate YAML, the table of its keys for the docs.

Its JSON config is read by ``ds_strategy.config.deepspeed``; nothing here imports DeepSpeed.
"""

from .._version import __version__
from . import comm, zero
from .arguments import add_config_arguments, init_distributed
from .engine import DeepSpeedEngine
from .initialize import initialize
from .missing_methods import missing_module_name_error

__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "zero",
]


def __getattr__(name: str):
    """A DeepSpeed name this module lacks: an ``AttributeError`` saying what to use instead."""
    raise missing_module_name_error(name)
