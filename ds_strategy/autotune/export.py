"""The tuned configuration as files a run can use: a Hydra ``strategy`` option and a DeepSpeed-style JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..config import ZeroConfig

# ZeroConfig fields the Hydra ``precision`` group owns (see ds_strategy.hydra); a strategy option leaves them out.
_PRECISION_FIELDS = (
    "precision",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
    "max_consecutive_min_scale_skips",
)

# ZeroConfig field -> DeepSpeed key path; the inverse of ds_strategy.config.deepspeed.translate's rules.
_DEEPSPEED_KEYS = {
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "gradient_clipping": ("gradient_clipping",),
    "stage": ("zero_optimization", "stage"),
    "reduce_bucket_size": ("zero_optimization", "reduce_bucket_size"),
    "allgather_bucket_size": ("zero_optimization", "allgather_bucket_size"),
    "overlap_comm": ("zero_optimization", "overlap_comm"),
    "contiguous_gradients": ("zero_optimization", "contiguous_gradients"),
    "prefetch_bucket_size": ("zero_optimization", "stage3_prefetch_bucket_size"),
    "param_persistence_threshold": ("zero_optimization", "stage3_param_persistence_threshold"),
    "max_live_parameters": ("zero_optimization", "stage3_max_live_parameters"),
    "zero_quantized_weights": ("zero_optimization", "zero_quantized_weights"),
    "zero_quantized_gradients": ("zero_optimization", "zero_quantized_gradients"),
    "zero_hpz_partition_size": ("zero_optimization", "zero_hpz_partition_size"),
    "sub_group_size": ("zero_optimization", "sub_group_size"),
}
# Written only when that state is offloaded: ZeroConfig field -> key inside DeepSpeed's offload section.
_OFFLOAD_SECTIONS = {
    "offload_optimizer": (
        "offload_optimizer",
        {
            "offload_optimizer": "device",
            "pin_memory": "pin_memory",
            "offload_ratio": "ratio",
            "buffer_count": "buffer_count",
        },
    ),
    "offload_params": (
        "offload_param",
        {"offload_params": "device", "pin_memory": "pin_memory", "buffer_size": "buffer_size"},
    ),
}
_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def deepspeed_dict(config: ZeroConfig) -> dict[str, Any]:
    """A DeepSpeed config describing ``config``; ``config_from_deepspeed`` reads it back to the same fields."""
    ds: dict[str, Any] = {}
    for field, path in _DEEPSPEED_KEYS.items():
        value = getattr(config, field, None)
        if value is None:
            continue
        node = ds
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    for field, (section, keys) in _OFFLOAD_SECTIONS.items():
        if getattr(config, field, "none") != "none":
            entry = {key: getattr(config, name) for name, key in keys.items()}
            if entry["device"] == "nvme":
                entry["nvme_path"] = config.nvme_path
            ds["zero_optimization"][section] = entry
    if config.gradient_reduction != "auto":
        ds["zero_optimization"]["reduce_scatter"] = config.gradient_reduction == "reduce_scatter"
    if config.communication_dtype is not None:
        ds["communication_data_type"] = config.communication_dtype
    if config.precision == "bf16-mixed":
        ds["bf16"] = {"enabled": True}
    elif config.precision == "16-mixed":
        ds["fp16"] = {"enabled": True, **{name: getattr(config, name) for name in _LOSS_SCALING}}
    return ds


def write_deepspeed_json(path: Path, config: ZeroConfig) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(deepspeed_dict(config), indent=2) + "\n")
    return path


def hydra_strategy_fields(config: ZeroConfig, tuned: Iterable[str]) -> dict[str, Any]:
    """The ``strategy``-group fields to write: the tuned ones and the micro-batch size, in ZeroConfig's order."""
    wanted = set(tuned) | {"stage", "train_micro_batch_size_per_gpu"}
    names = [name for name in ZeroConfig.__dataclass_fields__ if name in wanted and name not in _PRECISION_FIELDS]
    return {name: getattr(config, name) for name in names}


def write_hydra_yaml(path: Path, config: ZeroConfig, tuned: Iterable[str], note: str) -> Path:
    """A Hydra option of the ``strategy`` group, built on the ``zero<stage>`` preset so Hydra type-checks it."""
    import yaml

    tuned = list(tuned)
    fields = hydra_strategy_fields(config, tuned)
    header = [
        f"# Autotuned by `ds-strategy autotune`: {note}.",
        f"# Use it as a strategy option, e.g. `python examples/train.py strategy={path.stem} "
        f"data.batch_size={config.train_micro_batch_size_per_gpu}` (the loader must yield the micro-batch).",
        "# Fields left out keep ZeroConfig's defaults.",
    ]
    if "precision" in tuned:
        header.append(f"# precision was tuned too: add `precision={config.precision}`.")
    body = yaml.safe_dump({"defaults": [f"zero{config.stage}", "_self_"], **fields}, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header) + "\n" + body)
    return path
