"""Hydra structured configs, built from the dataclasses they configure so that they hold no defaults of their own.

``StrategyConf`` and ``PrecisionConf`` are ZeroConfig's fields split in two (the ``strategy`` and ``precision``
groups, the latter the fields ZeroConfig declares under its precision section), each with ZeroConfig's own default.
``ModelConf`` is GPTConfig's fields. A field whose type OmegaConf can check (int, float, bool, str, or one of them
or None) keeps it, so ``strategy.stage=abc`` fails in Hydra; the rest (``int | "auto"`` sizes, ``unit_modules``) are
``Any``, and every value is checked by ZeroConfig itself when ``zero_config`` builds one, before any process starts.
The structured configs are closed, so an unknown key (``strategy.stag=1``) fails in Hydra.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Optional

from ..config import ZeroConfig
from ..config.zero_config import PRECISION_SECTION, fields_of
from ..models import GPTConfig

# The ``precision`` group is ZeroConfig's precision section (the precision and its loss scaling); the ``strategy``
# group holds every other field.
PRECISION_FIELDS = tuple(fields_of(PRECISION_SECTION))

_PRIMITIVES = (int, float, bool, str)


def _omegaconf_type(hint: Any) -> Any:
    """``hint`` where OmegaConf can check it, ``Optional`` of a primitive, else ``Any``."""
    if hint in _PRIMITIVES:
        return hint
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if inner in _PRIMITIVES:
            return Optional[inner]  # noqa: UP045 (a runtime value OmegaConf reads, not an annotation)
    return Any


def _default(field: dataclasses.Field) -> dataclasses.Field:
    if field.default is dataclasses.MISSING:
        return dataclasses.field()
    if isinstance(field.default, tuple):  # OmegaConf holds sequences as lists
        return dataclasses.field(default_factory=lambda value=field.default: list(value))
    return dataclasses.field(default=field.default)


def derived_dataclass(name: str, source: type, names: typing.Iterable[str]) -> type:
    """A dataclass with ``source``'s fields ``names``: same defaults, types narrowed to what OmegaConf checks."""
    hints = typing.get_type_hints(source)
    wanted = set(names)
    fields = [
        (f.name, _omegaconf_type(hints[f.name]), _default(f)) for f in dataclasses.fields(source) if f.name in wanted
    ]
    derived = dataclasses.make_dataclass(name, fields)
    derived.__module__ = __name__
    derived.__doc__ = f"{source.__name__}'s fields {', '.join(n for n, _, _ in fields)}, for Hydra."
    return derived


_ZERO_FIELDS = [f.name for f in dataclasses.fields(ZeroConfig)]
StrategyConf = derived_dataclass("StrategyConf", ZeroConfig, [n for n in _ZERO_FIELDS if n not in PRECISION_FIELDS])
PrecisionConf = derived_dataclass("PrecisionConf", ZeroConfig, PRECISION_FIELDS)
ModelConf = derived_dataclass("ModelConf", GPTConfig, [f.name for f in dataclasses.fields(GPTConfig)])


@dataclasses.dataclass
class DataConf:
    """The standard-library character corpus: how much of it, and how it is batched per process."""

    corpus_bytes: int = 1_000_000
    batch_size: int = 16
    num_workers: int = 0


@dataclasses.dataclass
class TrainerConf:
    """The Lightning Trainer arguments the example exposes; the strategy and precision come from their groups."""

    accelerator: str = "cpu"
    devices: Any = 2
    num_nodes: int = 1
    max_steps: int = 150
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = 1.0
    log_every_n_steps: int = 10
    enable_checkpointing: bool = False
