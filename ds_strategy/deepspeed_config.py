"""Translate a DeepSpeed JSON config into a ZeroConfig.

Every key a DeepSpeed config may hold here has exactly one rule in the tables below. A rule either copies
the value to a ZeroConfig field, translates it (``reduce_scatter``, ``fp16.enabled``), accepts only the value
ds_strategy already behaves as (``allgather_partitions: true``), ignores it, or rejects it. Any other key
raises, naming its dotted path. Defaults live in ZeroConfig alone: an absent key leaves the field's default.

Accepted and ignored, with no effect:
    ``steps_per_print``, ``wall_clock_breakdown``: DeepSpeed's own logging; Lightning logs instead.
    ``train_batch_size``: implied by micro batch x accumulation x world size, which ds_strategy derives.
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` (and its older ``fp16`` spelling):
        ds_strategy's checkpoint export can always gather full weights, so the flag changes nothing.
    ``offload_optimizer.fast_init``, ``.pipeline``, ``.pipeline_read``, ``.pipeline_write``: the NVMe step always
        creates its files at setup and always overlaps reads and writes with the update.
    ``offload_param.buffer_count``: ds_strategy streams through one pool of host buffers, sized by
        ``offload_optimizer.buffer_count`` (``ZeroConfig.buffer_count``). ``offload_param.max_in_cpu``: an
        offloaded parameter shard lives wholly where ``device`` says.
    ``aio.*``: libaio tuning; ds_strategy's NVMe IO is ``os.pread``/``os.pwrite`` on a thread pool.

Both offload sections may name ``nvme_path`` and ``pin_memory``: equal values are fine, different ones conflict.

``"auto"`` is kept for the sizes ZeroConfig resolves from the hidden size; for ``gradient_clipping``,
``gradient_accumulation_steps``, ``train_micro_batch_size_per_gpu`` and ``train_batch_size`` it means the
ZeroConfig default. ``fp16.enabled`` / ``bf16.enabled`` set to ``"auto"`` leave ``precision`` to the caller.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

from ds_strategy.config import AUTO, ZeroConfig, ZeroConfigError

_Rule = Callable[[str, Any], dict[str, Any]]  # (dotted DeepSpeed key, value) -> ZeroConfig fields it sets
_Table = dict[str, Union[_Rule, "_Table"]]  # a section: key -> rule, or key -> nested section


def _field(name: str) -> _Rule:
    return lambda key, value: {name: value}


def _field_unless_auto(name: str) -> _Rule:
    return lambda key, value: {} if value == AUTO else {name: value}


def _ignored(key: str, value: Any) -> dict[str, Any]:
    return {}


def _only(accepted: bool, reason: str) -> _Rule:
    def rule(key: str, value: Any) -> dict[str, Any]:
        if value is not accepted:
            raise ValueError(f"DeepSpeed {key}={value!r} is not supported; only {accepted!r} is, because {reason}")
        return {}

    return rule


def _rejected(advice: str) -> _Rule:
    def rule(key: str, value: Any) -> dict[str, Any]:
        raise ValueError(f"DeepSpeed {key} is not supported by ds_strategy; {advice}")

    return rule


def _not_yet(what: str) -> _Rule:
    def rule(key: str, value: Any) -> dict[str, Any]:
        raise ValueError(f"DeepSpeed {key} is not supported yet: ds_strategy does not implement {what}; remove it")

    return rule


def _reduce_scatter(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, bool):
        raise ValueError(f"DeepSpeed {key}={value!r} is not allowed; expected true or false")
    return {"gradient_reduction": "reduce_scatter" if value else "all_reduce"}


def _enables(precision: str) -> _Rule:
    def rule(key: str, value: Any) -> dict[str, Any]:
        if value is True:
            return {"precision": precision}
        if value is False or value == AUTO:
            return {}
        raise ValueError(f"DeepSpeed {key}={value!r} is not allowed; expected true, false or \"auto\"")

    return rule


_OFFLOAD_OPTIMIZER: _Table = {
    "device": _field("offload_optimizer"),
    "nvme_path": _field("nvme_path"),
    "pin_memory": _field("pin_memory"),
    "ratio": _field("offload_ratio"),
    "buffer_count": _field("buffer_count"),
    "fast_init": _ignored,
    "pipeline": _ignored,
    "pipeline_read": _ignored,
    "pipeline_write": _ignored,
}
_OFFLOAD_PARAM: _Table = {
    "device": _field("offload_params"),
    "nvme_path": _field("nvme_path"),
    "pin_memory": _field("pin_memory"),
    "buffer_size": _field("buffer_size"),
    "buffer_count": _ignored,
    "max_in_cpu": _ignored,
}
_AIO: _Table = {name: _ignored for name in ("block_size", "queue_depth", "thread_count", "single_submit",
                                            "overlap_events", "use_gds")}
_ZERO_OPTIMIZATION: _Table = {
    "stage": _field("stage"),
    "reduce_bucket_size": _field("reduce_bucket_size"),
    "allgather_bucket_size": _field("allgather_bucket_size"),
    "overlap_comm": _field("overlap_comm"),
    "contiguous_gradients": _field("contiguous_gradients"),
    "reduce_scatter": _reduce_scatter,
    "allgather_partitions": _only(True, "ds_strategy always all-gathers the updated partitions after a step"),
    "round_robin_gradients": _only(False, "ds_strategy reduces gradients in bucket order, not round robin"),
    "stage3_prefetch_bucket_size": _field("prefetch_bucket_size"),
    "stage3_param_persistence_threshold": _field("param_persistence_threshold"),
    "stage3_max_live_parameters": _field("max_live_parameters"),
    "stage3_gather_16bit_weights_on_model_save": _ignored,
    "stage3_gather_fp16_weights_on_model_save": _ignored,
    "zero_quantized_weights": _field("zero_quantized_weights"),
    "zero_quantized_gradients": _field("zero_quantized_gradients"),
    "zero_hpz_partition_size": _field("zero_hpz_partition_size"),
    "sub_group_size": _field("sub_group_size"),
    "offload_optimizer": _OFFLOAD_OPTIMIZER,
    "offload_param": _OFFLOAD_PARAM,
}
_FP16: _Table = {
    "enabled": _enables("16-mixed"),
    "loss_scale": _field("loss_scale"),
    "initial_scale_power": _field("initial_scale_power"),
    "loss_scale_window": _field("loss_scale_window"),
    "hysteresis": _field("hysteresis"),
    "min_loss_scale": _field("min_loss_scale"),
    "consecutive_hysteresis": _only(False, "hysteresis is not refilled by overflow-free steps"),
}
_BF16: _Table = {"enabled": _enables("bf16-mixed")}
_DATA_TYPES: _Table = {"grad_accum_dtype": _field("grad_accum_dtype")}
_DEEPSPEED: _Table = {
    "zero_optimization": _ZERO_OPTIMIZATION,
    "fp16": _FP16,
    "bf16": _BF16,
    "gradient_clipping": _field_unless_auto("gradient_clipping"),
    "gradient_accumulation_steps": _field_unless_auto("gradient_accumulation_steps"),
    "train_micro_batch_size_per_gpu": _field_unless_auto("train_micro_batch_size_per_gpu"),
    "train_batch_size": _ignored,
    "communication_data_type": _field("communication_dtype"),
    "data_types": _DATA_TYPES,
    "steps_per_print": _ignored,
    "wall_clock_breakdown": _ignored,
    "aio": _AIO,
    "optimizer": _rejected("configure the optimizer in configure_optimizers; ds_strategy retargets it"),
    "scheduler": _rejected("configure the scheduler in configure_optimizers; ds_strategy steps it"),
}


def config_from_deepspeed(ds: Mapping[str, Any] | str | os.PathLike) -> ZeroConfig:
    """The ZeroConfig a DeepSpeed config (a dict, or a path to its JSON file) describes.

    Raises ``ValueError`` naming the dotted key for keys ds_strategy does not support and for bad values.
    """
    if isinstance(ds, (str, os.PathLike)):
        with open(ds, encoding="utf-8") as file:
            ds = json.load(file)
    fields: dict[str, Any] = {}
    origins: dict[str, str] = {}  # ZeroConfig field -> "deepspeed.key=value" that set it
    for key, value, updates in _translate(_DEEPSPEED, ds, prefix=""):
        for field, field_value in updates.items():
            if field in fields and fields[field] != field_value:
                raise ValueError(
                    f"DeepSpeed {key}={value!r} conflicts with {origins[field]}: "
                    f"both set ZeroConfig.{field}; keep only one"
                )
            fields[field] = field_value
            origins[field] = f"{key}={value!r}"
    try:
        return ZeroConfig(**fields)
    except ZeroConfigError as error:  # defaults are valid, so a field set here is at fault
        raise ValueError(f"DeepSpeed {origins[error.field]}: {error}") from error


def _translate(table: _Table, options: Any, prefix: str) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """Apply ``table``'s rules to ``options``, yielding (dotted key, value, ZeroConfig fields it sets)."""
    if not isinstance(options, Mapping):
        where = f"DeepSpeed {prefix[:-1]}" if prefix else "a DeepSpeed config"
        raise ValueError(f"{where} must be a JSON object, got {type(options).__name__}: {options!r}")
    for name, value in options.items():
        key = prefix + str(name)
        rule = table.get(name)
        if rule is None:
            close = difflib.get_close_matches(str(name), table, n=1)
            hint = f"did you mean {prefix + close[0]!r}?" if close else f"supported here: {', '.join(table)}"
            raise ValueError(f"DeepSpeed {key} is not supported by ds_strategy; {hint}")
        if isinstance(rule, dict):
            yield from _translate(rule, value, prefix=key + ".")
        else:
            yield key, value, rule(key, value)
