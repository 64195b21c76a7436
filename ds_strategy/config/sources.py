"""``load_config``: the one reader of a ZeRO configuration, which every adapter, the CLI and Hydra call.

A source is a ``ZeroConfig``; a mapping of its fields; a DeepSpeed JSON config (recognised by its
``zero_optimization`` key, or read as one when the caller says so: ``from_deepspeed_config``); either of the two
mappings under a top-level ``ds_strategy:`` key, so one accelerate-plus-ZeRO YAML serves both; a YAML or JSON file
holding any of these; or nothing, which is ``$DS_STRATEGY_CONFIG`` (inline JSON or a file path) where the caller reads
the environment (Accelerate and the Trainer, whose own config files cannot carry ZeRO's settings: ``ds-strategy
launch`` puts the ``ds_strategy:`` section of its YAML there), else the defaults. Values are validated when read, so a
bad key fails before training starts, naming the file or variable it came from.

A DeepSpeed config's ``optimizer``/``scheduler`` sections come back beside the ZeRO settings, as written ("auto"
included) in ``LoadedConfig.written_sections`` for the frameworks that fill "auto" themselves (Accelerate's
``DummyOptim``/``DummyScheduler``, the Trainer's arguments), and checked in ``LoadedConfig.sections`` for the adapters
that build them (Lightning and Fabric: Note: [A DeepSpeed config's optimizer wins] in
``ds_strategy.adapters.optimizer_sections``). Concrete sections are checked at load either way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .deepspeed.optimizer_section import OptimizerSections, read_optimizer_sections
from .deepspeed.rule_kinds import AUTO
from .deepspeed.translate import DeepSpeedConfig, translate_deepspeed_config
from .zero_config import ZeroConfig, ZeroConfigError

ENV_VAR = "DS_STRATEGY_CONFIG"
SECTION = "ds_strategy"
OPTIMIZER_SECTIONS = ("optimizer", "scheduler")

Source = ZeroConfig | Mapping | str | os.PathLike | None


@dataclasses.dataclass(frozen=True)
class LoadedConfig:
    """What a configuration source holds: the ZeRO settings, and a DeepSpeed config's optimizer/scheduler sections.

    ``written_sections`` are those present, as written; ``deepspeed`` says whether the source was a DeepSpeed config.
    ``written``: the mapping the settings were read from, as written (empty for a ZeroConfig or the defaults), which
    a launcher hands on to its workers; ``beside``: a file's other top-level keys, when only its ``ds_strategy:``
    section was read (``load_config(..., section_only=True)``: an accelerate YAML, whose keys are accelerate's).
    """

    zero: ZeroConfig
    written_sections: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    deepspeed: bool = False
    written: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    beside: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def sections(self) -> OptimizerSections:
        """The sections as an adapter builds them: checked, "auto" parameters at the class default, and a section
        whose every parameter is "auto" absent (it defers to the program's optimizer or scheduler)."""
        return read_optimizer_sections(self.written_sections.get("optimizer"), self.written_sections.get("scheduler"))


def load_config(
    source: LoadedConfig | Source = None,
    *,
    environment: bool = False,
    deepspeed: bool = False,
    fill_auto: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    section_only: bool = False,
    **fields: Any,
) -> LoadedConfig:
    """The configuration ``source`` describes (see the module docstring), with ``fields`` set on top.

    ``environment``: with no source, read ``$DS_STRATEGY_CONFIG`` (unset or empty: the defaults). ``deepspeed``: read a
    mapping or file as a DeepSpeed config even without a ``zero_optimization`` key. ``fill_auto``: rewrites a DeepSpeed
    config's "auto" values before it is read (the Trainer fills them from its arguments). ``section_only``: read the
    source's ``ds_strategy:`` section alone (absent: the defaults) and keep its other keys in ``beside``. A file or the
    environment that fails names itself in the error; a ``ZeroConfigError`` keeps naming the field.
    """
    if isinstance(source, (LoadedConfig, ZeroConfig)) or (source is None and not environment):
        loaded = source if isinstance(source, LoadedConfig) else LoadedConfig(source or ZeroConfig())
    else:
        options, where = _read_options(source)
        beside: dict[str, Any] = {}
        if section_only:
            beside = dict(options or {})
            options = beside.pop(SECTION, None)
        try:
            loaded = config_from_mapping(options or {}, deepspeed=deepspeed, fill_auto=fill_auto)
            loaded = dataclasses.replace(loaded, beside=beside)
        except ValueError as error:
            if not where:
                raise
            if isinstance(error, ZeroConfigError):
                raise ZeroConfigError(error.field, f"{where}: {error}") from error
            raise ValueError(f"{where}: {error}") from error
    return dataclasses.replace(loaded, zero=loaded.zero.replace(**fields)) if fields else loaded


def read_deepspeed_config(source: Mapping | str | os.PathLike) -> DeepSpeedConfig:
    """A DeepSpeed config (a mapping, or a path to its JSON or YAML file) read with DeepSpeed's meaning: the ZeRO
    settings and the optimizer/scheduler sections (see ``translate_deepspeed_config``)."""
    loaded = load_config(source, deepspeed=True)
    return DeepSpeedConfig(loaded.zero, loaded.sections)


def config_from_deepspeed(source: Mapping | str | os.PathLike) -> ZeroConfig:
    """The ZeroConfig a DeepSpeed config (a mapping, or a path to its file) describes."""
    return load_config(source, deepspeed=True).zero


def load_zero_config(source: Source = None) -> ZeroConfig:
    """The ZeroConfig of ``source``; with none, ``$DS_STRATEGY_CONFIG``'s, else the defaults (Accelerate's reading)."""
    return load_config(source, environment=True).zero


def _read_options(source: Mapping | str | os.PathLike | None) -> tuple[Mapping[str, Any] | None, str]:
    """The mapping ``source`` holds as written (a file read; ``$DS_STRATEGY_CONFIG``, inline JSON or a file path,
    for None) and where it came from, for errors (empty for a mapping, the caller's own object); None when the
    variable is unset or empty."""
    if source is None:
        value = os.environ.get(ENV_VAR, "").strip()
        if not value:
            return None, f"${ENV_VAR}"
        source = json.loads(value) if value.startswith("{") else value
        where = f"${ENV_VAR}"
    else:
        where = "" if isinstance(source, Mapping) else str(source)
    return (source if isinstance(source, Mapping) else _read_config_file(source)), where


def _read_config_file(path: str | os.PathLike) -> dict[str, Any]:
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


def config_from_mapping(
    options: Mapping[str, Any],
    *,
    deepspeed: bool = False,
    fill_auto: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> LoadedConfig:
    """ZeroConfig fields, or a DeepSpeed config, optionally under a top-level ``ds_strategy`` key; a DeepSpeed
    config's optimizer/scheduler sections come back as written, those without "auto" checked already."""
    if not isinstance(options, Mapping):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(options).__name__}: {options!r}")
    if SECTION in options:
        options = options[SECTION] or {}
    if not deepspeed and "zero_optimization" not in options:
        return LoadedConfig(ZeroConfig.from_dict(options), written=options)
    written = options
    if fill_auto is not None:
        options = fill_auto(dict(options))
    sections = {key: options[key] for key in OPTIMIZER_SECTIONS if key in options}
    concrete = {key: value for key, value in sections.items() if not _has_auto(value)}
    read_optimizer_sections(concrete.get("optimizer"), concrete.get("scheduler"))
    zero = translate_deepspeed_config({k: v for k, v in options.items() if k not in OPTIMIZER_SECTIONS}).zero
    return LoadedConfig(zero, sections, deepspeed=True, written=written)


def _has_auto(value: Any) -> bool:
    if isinstance(value, Mapping):
        return any(_has_auto(item) for item in value.values())
    return value == AUTO
