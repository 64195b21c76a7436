"""One precision reaches the engine: a host framework's precision flag reconciled with ``ZeroConfig.precision``.

Fabric's ``precision=`` and Accelerate's ``mixed_precision=`` name the precision the user wants, and so may
``ZeroConfig.precision`` (for example from a DeepSpeed JSON's ``bf16.enabled``). The engine implements precision,
so the adapters hand the framework a plain full-precision plugin and fold the flag into the config: a flag left at
full precision defers to the config, a config left at its default defers to the flag, and two different explicit
choices are an error naming both.
"""

from __future__ import annotations

import dataclasses

from ..config import ZeroConfig, ZeroConfigError

# Accelerate's ``mixed_precision`` values in ZeroConfig's terms; "fp8" has no ZeRO equivalent and is rejected.
ACCELERATE_MIXED_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}

_DEFAULT = next(f.default for f in dataclasses.fields(ZeroConfig) if f.name == "precision")


def reconcile_precision(config: ZeroConfig, flag: object, source: str) -> ZeroConfig:
    """``config`` with the framework's precision ``flag`` (named ``source`` in errors) folded in."""
    try:
        wanted = config.replace(precision=flag)
    except ZeroConfigError as error:
        raise ValueError(f"{source}={flag!r}: {error}") from error
    if wanted.precision in (_DEFAULT, config.precision):
        return config
    if config.precision == _DEFAULT:
        return wanted
    raise ValueError(
        f"{source}={flag!r} conflicts with ZeroConfig.precision={config.precision!r}; "
        f"set the precision in one place only"
    )
