"""The checks a ZeroConfig field names beside its default: each turns a value into the normalised one, or raises.

A check is ``check(name, value, earlier) -> value``, where ``earlier`` holds the fields declared before this one,
validated already: a field whose allowed values depend on another (``offload_params`` on ``stage``) is declared after
it. Every error is a ``ZeroConfigError`` naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

AUTO = "auto"
UNITS = "units"  # a bucket or prefetch size bounded by the model's largest unit rather than by an element count

Check = Callable[[str, Any, Mapping[str, Any]], Any]


class ZeroConfigError(ValueError):
    """A ZeroConfig field got a value it does not allow; ``field`` names it so front-ends can say which
    of their own keys produced it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def reject(name: str, value: Any, expected: str) -> ZeroConfigError:
    return ZeroConfigError(name, f"ZeroConfig.{name}={value!r} is not allowed; expected {expected}")


def choice(aliases: Mapping[Any, Any], expected: str | None = None) -> Check:
    """One of ``aliases``' keys, normalised to its value."""
    expected = expected or "one of " + ", ".join(map(repr, dict.fromkeys(aliases.values())))

    def check(name: str, value: Any, earlier: Mapping[str, Any]) -> Any:
        try:
            known = not isinstance(value, bool) and value in aliases
        except TypeError:  # unhashable
            known = False
        if not known:
            raise reject(name, value, expected)
        return aliases[value]

    return check


def flag(name: str, value: Any, earlier: Mapping[str, Any]) -> bool:
    if not isinstance(value, bool):
        raise reject(name, value, "True or False")
    return value


def only_true(why: str) -> Check:
    def check(name: str, value: Any, earlier: Mapping[str, Any]) -> bool:
        if value is not True:
            raise reject(name, value, f"True ({why})")
        return True

    return check


def integer(minimum: int, *, maximum: int | None = None, auto: bool = False, none: bool = False, units: bool = False):
    """A whole number in range (``5e8`` included), or one of the words or None it is told to accept."""
    words = (AUTO,) * auto + (UNITS,) * units
    expected = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    expected += "".join(f' or "{word}"' for word in words) + (" or None" if none else "")

    def check(name: str, value: Any, earlier: Mapping[str, Any]) -> int | str | None:
        if (isinstance(value, str) and value in words) or (none and value is None):
            return value
        whole = isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer()
        if not whole or int(value) < minimum or (maximum is not None and int(value) > maximum):
            raise reject(name, value, expected)
        return int(value)

    return check


def real(minimum: float, *, exclusive: bool = False) -> Check:
    def check(name: str, value: Any, earlier: Mapping[str, Any]) -> float:
        in_range = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        in_range = in_range and (value > minimum if exclusive else value >= minimum)
        if not in_range:
            raise reject(name, value, f"a finite number {'>' if exclusive else '>='} {minimum}")
        return float(value)

    return check


def seconds(name: str, value: Any, earlier: Mapping[str, Any]) -> float:
    """A positive number of seconds, or a ``datetime.timedelta``."""
    return real(0.0, exclusive=True)(
        name, value.total_seconds() if isinstance(value, datetime.timedelta) else value, {}
    )


def needs_stage(check: Check, minimum: int, off: Any = False) -> Check:
    """``check``'s value, refused when it turns on a feature that the ``stage`` declared earlier does not have."""

    def needing(name: str, value: Any, earlier: Mapping[str, Any]) -> Any:
        value, stage = check(name, value, earlier), earlier["stage"]
        if value != off and stage < minimum:
            raise ZeroConfigError(
                name,
                f"ZeroConfig.{name}={value!r} is not allowed with stage={stage!r}; "
                f"it needs stage >= {minimum} (or {name}={off!r})",
            )
        return value

    return needing


def needs_tensor_parallel(name: str, value: Any, earlier: Mapping[str, Any]) -> bool:
    value, size = flag(name, value, earlier), earlier["tensor_parallel_size"]
    if value and size < 2:
        raise ZeroConfigError(
            name,
            f"ZeroConfig.{name}=True is not allowed with tensor_parallel_size={size!r}; "
            f"it needs tensor_parallel_size >= 2",
        )
    return value


def not_pipelined(check: Check) -> Check:
    """``check``'s switch, refused with the ``pipeline_parallel_size`` declared earlier: the pipeline's last stage
    hands the logits to the loop's loss function."""

    def refusing(name: str, value: Any, earlier: Mapping[str, Any]) -> Any:
        value, size = check(name, value, earlier), earlier["pipeline_parallel_size"]
        if value and size != 1:
            raise ZeroConfigError(
                name,
                f"ZeroConfig.{name}=True is not allowed with pipeline_parallel_size={size!r}; the last pipeline "
                f"stage hands whole logits to your loss function (tile it there, or use 1)",
            )
        return value

    return refusing


def expert_parallel(name: str, value: Any, earlier: Mapping[str, Any]) -> int:
    """An expert-parallel group size, refused beside what does not compose with it yet, each named: the other
    model-parallel dimensions (the mesh has no place for experts among them yet), stage 0 (whose gradient norm
    spans one group only) and ZeRO++ (its quantized and secondary buffers assume one group per engine). Offload and
    activation checkpointing compose (the composition matrix's expert cells)."""
    value = integer(1)(name, value, earlier)
    if value == 1:
        return value
    if earlier["stage"] == 0:
        raise ZeroConfigError(
            name, f"ZeroConfig.{name}={value!r} is not allowed with stage=0; it needs stage 1, 2 or 3 (or {name}=1)"
        )
    alone = {
        "tensor_parallel_size": 1,
        "sequence_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_gradients": False,
        "zero_hpz_partition_size": 1,
    }
    for other, default in alone.items():
        if earlier[other] != default:
            raise ZeroConfigError(
                name,
                f"ZeroConfig.{name}={value!r} is not allowed with {other}={earlier[other]!r}: expert parallelism "
                f"does not compose with it yet; use {other}={default!r} (or {name}=1)",
            )
    return value


def nvme_path(name: str, value: Any, earlier: Mapping[str, Any]) -> str | None:
    """A non-empty path, required when anything is offloaded to NVMe."""
    if value is not None and not (isinstance(value, (str, os.PathLike)) and str(value)):
        raise reject(name, value, "a directory path or None")
    places = earlier["offload_optimizer"], earlier["offload_params"]
    if value is None and "nvme" in places:
        raise ZeroConfigError(
            name,
            f"ZeroConfig.nvme_path=None is not allowed with offload_optimizer={places[0]!r}, offload_params="
            f"{places[1]!r}; NVMe offload needs a directory for its files",
        )
    return None if value is None else os.fspath(value)


def offload_ratio(name: str, value: Any, earlier: Mapping[str, Any]) -> float:
    ratio = real(0.0)(name, value, earlier)
    if ratio > 1.0:
        raise reject(name, value, "a number between 0 and 1")
    if ratio != 1.0 and earlier["offload_optimizer"] == "none":
        raise ZeroConfigError(
            name,
            f"ZeroConfig.offload_ratio={value!r} is not allowed with offload_optimizer='none'; it needs "
            f"offload_optimizer 'cpu' or 'nvme'",
        )
    return ratio


def callable_or_none(name: str, value: Any, earlier: Mapping[str, Any]) -> Callable | None:
    if value is not None and not callable(value):
        raise reject(name, value, "None or a callable taking one module")
    return value


def unit_modules(name: str, value: Any, earlier: Mapping[str, Any]) -> tuple[type[torch.nn.Module] | str, ...]:
    units = (value,) if isinstance(value, (str, type)) else value
    expected = "a tuple of torch.nn.Module subclasses or class-name strings"
    if not isinstance(units, (list, tuple)):
        raise reject(name, value, expected)
    for unit in units:
        is_module_class = isinstance(unit, type) and issubclass(unit, torch.nn.Module)
        if not (is_module_class or (isinstance(unit, str) and unit)):
            raise reject(name, value, expected)
    return tuple(units)


def tensor_parallel_plan(name: str, value: Any, earlier: Mapping[str, Any]) -> str | dict[str, Any] | None:
    if value is None or value == AUTO:
        return value
    if isinstance(value, Mapping) and all(isinstance(key, str) and key for key in value):
        return dict(value)
    raise reject(name, value, 'None (the model parallelizes itself), "auto" or a mapping of module names')


def pipeline_split(splits: tuple[str, ...]) -> Check:
    """A split method's name, or distinct module names as a tuple; whether the names exist is checked at setup."""

    def check(name: str, value: Any, earlier: Mapping[str, Any]) -> str | tuple[str, ...]:
        if isinstance(value, str) and value in splits:
            return value
        names = tuple(value) if isinstance(value, (list, tuple)) else ()
        if names and all(isinstance(item, str) and item for item in names) and len(set(names)) == len(names):
            return names
        raise reject(name, value, '"auto", "parameters" or a list of distinct module names where stages 2..n begin')

    return check
