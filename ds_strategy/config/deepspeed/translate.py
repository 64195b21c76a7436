"""Translate a DeepSpeed JSON config into a ZeroConfig (and its optimizer/scheduler sections), with DeepSpeed's meaning.

Every key DeepSpeed accepts has one rule in ``ds_strategy.config.deepspeed.key_tables`` (mapped, no-op or rejected; see
``rule_kinds``). Keys DeepSpeed does not know are ignored at the top level, with one warning naming them, and
fail inside a section, naming the dotted path: DeepSpeed's own rule. Defaults stay ZeroConfig's, except where a
DeepSpeed config means something else by leaving a key out (see the Note below).

Note: [What an absent key means in a DeepSpeed config]
    ZeroConfig's defaults serve users who never wrote a JSON; a DeepSpeed config is read as DeepSpeed reads it:
    - no ``zero_optimization.stage``: stage 0 (ZeroConfig's default is 2); likewise DeepSpeed's bucket, prefetch,
      persistence, live-parameter and sub-group sizes, whatever ZeroConfig's defaults are;
    - no ``gradient_clipping``: clip at 1.0, DeepSpeed 0.19's default (ZeroConfig's is off); ``"auto"`` leaves
      clipping to the framework, as Hugging Face's integration does;
    - an offload section without ``pin_memory``: pinned, DeepSpeed's default since 0.19.5;
    - ``offload_param`` below stage 3, or ``offload_optimizer`` at stage 0: ignored (with a warning), as DeepSpeed
      ignores them;
    - ``train_batch_size`` is kept and checked against micro-batch x accumulation x world size at setup
      (``ZeroConfig.resolve_batch_sizes``), where the world size is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from ds_strategy.config.deepspeed.key_tables import DEEPSPEED, ZERO_OPTIMIZATION
from ds_strategy.config.deepspeed.optimizer_section import (
    OptimizerSections,
    read_optimizer_sections,
)
from ds_strategy.config.deepspeed.rule_kinds import Kind, Rule, Table
from ds_strategy.config.zero_config import ZeroConfig, ZeroConfigError

# ZeroConfig fields whose default differs from (or may drift from) DeepSpeed's -> the rule holding DeepSpeed's.
_DEEPSPEED_DEFAULTS = {
    "gradient_clipping": DEEPSPEED["gradient_clipping"],
    **{
        name: ZERO_OPTIMIZATION[name]
        for name in (
            "stage",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "max_live_parameters",
            "sub_group_size",
        )
    },
}
_OFFLOAD_MIN_STAGE = {
    "offload_optimizer": ("zero_optimization.offload_optimizer", 1),
    "offload_params": ("zero_optimization.offload_param", 3),
}


class DeepSpeedConfigWarning(UserWarning):
    """A DeepSpeed key ds_strategy accepts but does not act on."""


@dataclasses.dataclass(frozen=True)
class DeepSpeedConfig:
    """A DeepSpeed config as ds_strategy runs it: the ZeRO settings and the optimizer/scheduler sections."""

    zero: ZeroConfig
    sections: OptimizerSections


def translate_deepspeed_config(ds: Mapping[str, Any]) -> DeepSpeedConfig:
    """A DeepSpeed config's mapping read with DeepSpeed's meaning (a file is read by ``ds_strategy.config.sources``,
    whose ``read_deepspeed_config`` and ``config_from_deepspeed`` take either).

    Raises ``ValueError`` naming the dotted key for rejected keys, unknown keys inside sections and bad values;
    warns once (``DeepSpeedConfigWarning``) listing ignored top-level keys and no-op keys set to a non-default.
    """
    if not isinstance(ds, Mapping):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(ds).__name__}: {ds!r}")
    unknown = [str(key) for key in ds if key not in DEEPSPEED]
    fields: dict[str, Any] = {}
    origins: dict[str, str] = {}  # ZeroConfig field -> "deepspeed.key=value" that set it
    no_ops: list[str] = []
    for key, value, rule in _rules({k: v for k, v in ds.items() if k in DEEPSPEED}, DEEPSPEED, prefix=""):
        if rule.kind is Kind.NO_OP:
            if not rule.is_quiet(value):
                no_ops.append(f"{key}={value!r} ({rule.note})")
            continue
        if rule.kind is Kind.REJECTED:
            if not rule.is_quiet(value):
                raise ValueError(f"DeepSpeed {key}={value!r} is not supported: {rule.note}")
            continue
        for name, field_value in rule.translate(key, value).items():
            if name in fields and fields[name] != field_value:
                raise ValueError(
                    f"DeepSpeed {key}={value!r} conflicts with {origins[name]}: both set "
                    f"ZeroConfig.{name}; keep only one"
                )
            fields[name], origins[name] = field_value, f"{key}={value!r}"
    _accumulation_as_micro_batches(fields, origins)
    ignored = _apply_deepspeed_defaults(fields, origins)
    if unknown:
        _warn(f"DeepSpeed config keys ignored (DeepSpeed does not know them either): {', '.join(unknown)}")
    if no_ops or ignored:
        _warn("DeepSpeed config keys accepted with no effect in ds_strategy: " + "; ".join(no_ops + ignored))
    try:
        zero = ZeroConfig(**fields)
    except ZeroConfigError as error:  # defaults are valid, so a field set here is at fault
        raise ValueError(f"DeepSpeed {origins.get(error.field, error.field)}: {error}") from error
    return DeepSpeedConfig(zero, read_optimizer_sections(ds.get("optimizer"), ds.get("scheduler")))


def _rules(options: Any, table: Table, prefix: str) -> Iterator[tuple[str, Any, Rule]]:
    """(dotted key, value, rule) for every key of ``options``, descending into sections."""
    if not isinstance(options, Mapping):
        raise ValueError(f"DeepSpeed {prefix[:-1]} must be a JSON object, got {type(options).__name__}: {options!r}")
    for name, value in options.items():
        key = prefix + str(name)
        rule = table.get(name)
        if rule is None:
            close = difflib.get_close_matches(str(name), table, n=1)
            hint = f"did you mean {prefix + close[0]!r}?" if close else f"DeepSpeed accepts here: {', '.join(table)}"
            raise ValueError(f"DeepSpeed {key} is not a key DeepSpeed accepts; {hint}")
        if isinstance(rule, dict):
            yield from _rules(value, rule, prefix=key + ".")
        else:
            yield key, value, rule


def _accumulation_as_micro_batches(fields: dict[str, Any], origins: dict[str, str]) -> None:
    """Note: [DeepSpeed's gradient_accumulation_steps under pipelining]
    DeepSpeed's PipelineEngine runs each optimizer step as gradient_accumulation_steps micro-batches through the
    pipeline (train_batch_size = micro-batch x micro-batches x data-parallel size). When the config's
    ``pipeline.stages`` pipelines, the count is therefore ``ZeroConfig.pipeline_microbatches`` (the micro-batches
    one framework batch is split into), with one framework batch per step; ``train_micro_batch_size_per_gpu`` is
    one micro-batch, so the data loader's batches hold that many times it (``check_micro_batch``). A stage count
    given only to the strategy leaves ``gradient_accumulation_steps`` as batches per step."""
    accumulation = fields.get("gradient_accumulation_steps")
    if fields.get("pipeline_parallel_size", 1) == 1 or not isinstance(accumulation, int) or accumulation == 1:
        return
    fields["pipeline_microbatches"], fields["gradient_accumulation_steps"] = accumulation, 1
    origins["pipeline_microbatches"] = origins["gradient_accumulation_steps"]


def _apply_deepspeed_defaults(fields: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """Fill in what an absent key means to DeepSpeed (the Note above); returns the settings it ignored."""
    for name, rule in _DEEPSPEED_DEFAULTS.items():
        fields.setdefault(name, rule.default)
    ignored = []
    for name, (section, minimum) in _OFFLOAD_MIN_STAGE.items():
        if fields.get(name, "none") != "none" and fields["stage"] < minimum:
            ignored.append(f"{section}.device={fields.pop(name)!r} (DeepSpeed ignores it below stage {minimum})")
            if name == "offload_optimizer":
                fields.pop("offload_ratio", None)
    places = (fields.get("offload_optimizer", "none"), fields.get("offload_params", "none"))
    if places != ("none", "none"):
        fields.setdefault("pin_memory", True)
        origins.setdefault("pin_memory", "offload pin_memory (DeepSpeed's default: true)")
    return ignored


def _warn(message: str) -> None:
    warnings.warn(message, DeepSpeedConfigWarning, stacklevel=3)
