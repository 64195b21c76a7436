"""Where a ZeroAccelerator's ZeroConfig comes from: an object, a YAML/JSON file, or ``DS_STRATEGY_CONFIG``.

Accelerate's own config file rejects unknown keys, so ZeRO settings reach the worker processes another way:
``ds-strategy launch`` puts the ``ds_strategy:`` section of its YAML into the environment variable
``DS_STRATEGY_CONFIG`` (inline JSON), and a user of plain ``accelerate launch`` may set it to a file path. A file
holds ZeroConfig field names, a DeepSpeed JSON config (recognised by its ``zero_optimization`` key), or either
under a top-level ``ds_strategy:`` key, so one accelerate-plus-ZeRO YAML serves both. Values are validated by
ZeroConfig (or the DeepSpeed translator) when read, so a bad key fails before training starts. A DeepSpeed config's
``optimizer``/``scheduler`` sections are kept as written ("auto" included): ``prepare`` fills them from Accelerate's
``DummyOptim``/``DummyScheduler`` (see :mod:`.dummy_objects`), and checks them once filled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .deepspeed.optimizer_section import read_optimizer_sections
from .deepspeed.rule_kinds import AUTO
from .deepspeed.translate import config_from_deepspeed
from .zero_config import ZeroConfig

ENV_VAR = "DS_STRATEGY_CONFIG"
SECTION = "ds_strategy"
OPTIMIZER_SECTIONS = ("optimizer", "scheduler")


def load_zero_config(source: ZeroConfig | Mapping | str | os.PathLike | None = None) -> ZeroConfig:
    """The ZeroConfig ``source`` describes; with no source, ``$DS_STRATEGY_CONFIG``, else the defaults."""
    return load_config(source)[0]


def load_config(source: ZeroConfig | Mapping | str | os.PathLike | None = None) -> tuple[ZeroConfig, dict[str, Any]]:
    """``load_zero_config``'s ZeroConfig and, from a DeepSpeed config, its ``optimizer``/``scheduler`` sections as
    written (only those present; empty for any other source)."""
    if isinstance(source, ZeroConfig):
        return source, {}
    options, where = read_options(source)
    if options is None:
        return ZeroConfig(), {}
    try:
        return config_from_mapping(options)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from error


def read_options(source: Mapping | str | os.PathLike | None) -> tuple[Mapping[str, Any] | None, str]:
    """The mapping ``source`` holds as written (a file read; ``$DS_STRATEGY_CONFIG``, inline JSON or a file path,
    for None) and where it came from, for errors; None when the variable is unset or empty."""
    if source is None:
        value = os.environ.get(ENV_VAR, "").strip()
        if not value:
            return None, f"${ENV_VAR}"
        source = json.loads(value) if value.startswith("{") else value
        where = f"${ENV_VAR}"
    else:
        where = str(source) if not isinstance(source, Mapping) else "the ZeRO config mapping"
    return (source if isinstance(source, Mapping) else read_config_file(source)), where


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML (``.yaml``/``.yml``) or JSON file's top-level mapping."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ZeRO config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        options = yaml.safe_load(text) or {}
    else:
        options = json.loads(text)
    if not isinstance(options, Mapping):
        raise ValueError(f"ZeRO config file {str(path)!r} must hold a mapping, got {type(options).__name__}")
    return dict(options)


def config_from_mapping(options: Mapping[str, Any]) -> tuple[ZeroConfig, dict[str, Any]]:
    """ZeroConfig fields, or a DeepSpeed config, optionally under a top-level ``ds_strategy`` key; a DeepSpeed
    config's optimizer/scheduler sections come back as written, those without "auto" checked already."""
    if SECTION in options:
        options = options[SECTION] or {}
    if "zero_optimization" not in options:
        return ZeroConfig.from_dict(options), {}
    sections = {key: options[key] for key in OPTIMIZER_SECTIONS if key in options}
    concrete = {key: value for key, value in sections.items() if not _has_auto(value)}
    read_optimizer_sections(concrete.get("optimizer"), concrete.get("scheduler"))
    zero = config_from_deepspeed({key: value for key, value in options.items() if key not in OPTIMIZER_SECTIONS})
    return zero, sections


def _has_auto(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_has_auto(item) for item in value.values())
    return value == AUTO
