"""An accelerate config written for its DeepSpeed back-end (``distributed_type: DEEPSPEED`` with ``deepspeed_config:``),
turned into the DeepSpeed JSON config accelerate's ``DeepSpeedPlugin`` would build from it.

Without ``deepspeed_config_file`` the plugin assembles a config from the section's keys (``zero_stage`` 2 when
absent; ``"auto"`` accumulation and clipping, which the framework fills); with one it reads that JSON, and other
keys that would change it are an error, as in accelerate. Keys that only steer DeepSpeed's own launcher or
``deepspeed.zero.Init`` are named as ignored; multi-node host selection and MoE wrapping are rejected.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

_CONFIG_FILE = "deepspeed_config_file"
_FILE_EXCLUSIVE = (
    "zero_stage",
    "offload_optimizer_device",
    "offload_param_device",
    "offload_optimizer_nvme_path",
    "offload_param_nvme_path",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "zero3_save_16bit_model",
)
IGNORED = {
    "zero3_init_flag": "ZeroAccelerator shards the model when prepare() receives it",
    "deepspeed_multinode_launcher": "processes start through accelerate's own launcher",
}
_REJECTED = {
    "deepspeed_hostfile": "multi-node host files are DeepSpeed's launcher's; use accelerate's num_machines and "
    "main_process_ip",
    "deepspeed_exclusion_filter": "host filters are DeepSpeed's launcher's; use accelerate's multi-node settings",
    "deepspeed_inclusion_filter": "host filters are DeepSpeed's launcher's; use accelerate's multi-node settings",
    "deepspeed_moe_layer_cls_names": "ds_strategy has no expert parallelism",
}


def deepspeed_config_from_accelerate(
    section: Mapping[str, Any], config_dir: Path
) -> tuple[dict[str, Any] | Path, list[str]]:
    """The DeepSpeed config ``deepspeed_config:`` describes (or the JSON file that holds it, for
    ``ds_strategy.config.sources.load_config`` to read), and the keys of it ds_strategy ignores (with why).

    A relative ``deepspeed_config_file`` is looked up from the working directory, as accelerate does, then from
    ``config_dir`` (the YAML's own directory).
    """
    known = (_CONFIG_FILE, *_FILE_EXCLUSIVE, *IGNORED, *_REJECTED)
    for key, value in section.items():
        if key not in known:
            raise ValueError(
                f"deepspeed_config.{key} is not a key accelerate's DeepSpeed plugin takes; expected one "
                f"of {', '.join(known)}"
            )
        if key in _REJECTED and value not in (None, "", "none", []):
            raise ValueError(f"deepspeed_config.{key}={value!r} is not supported: {_REJECTED[key]}")
    ignored = [f"deepspeed_config.{key}={section[key]!r} ({why})" for key, why in IGNORED.items() if key in section]
    if section.get(_CONFIG_FILE) not in (None, "none"):
        both = [key for key in _FILE_EXCLUSIVE if section.get(key) is not None]
        if both:
            raise ValueError(
                f"deepspeed_config.{both[0]} cannot be combined with deepspeed_config_file (accelerate "
                f"rejects that too); set it in the JSON file instead"
            )
        return _config_file(Path(section[_CONFIG_FILE]), config_dir), ignored
    return _assembled(section), ignored


def _assembled(section: Mapping[str, Any]) -> dict[str, Any]:
    """What ``DeepSpeedPlugin.__post_init__`` builds when no config file is given (accelerate 1.x)."""
    optimizer_device = section.get("offload_optimizer_device", "none")
    param_device = section.get("offload_param_device", "none")
    config: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": section.get("gradient_accumulation_steps", "auto"),
        "zero_optimization": {
            "stage": section.get("zero_stage", 2),
            "offload_optimizer": {
                "device": optimizer_device,
                "nvme_path": (section.get("offload_optimizer_nvme_path") if optimizer_device == "nvme" else None),
            },
            "offload_param": {
                "device": param_device,
                "nvme_path": (section.get("offload_param_nvme_path") if param_device == "nvme" else None),
            },
            "stage3_gather_16bit_weights_on_model_save": bool(section.get("zero3_save_16bit_model", False)),
        },
    }
    clipping = section.get("gradient_clipping", "auto")
    if clipping:
        config["gradient_clipping"] = clipping
    return config


def _config_file(path: Path, config_dir: Path) -> Path:
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, config_dir / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"deepspeed_config.deepspeed_config_file={str(path)!r} does not exist (looked in "
        f"{', '.join(str(c.parent) for c in candidates)})"
    )
