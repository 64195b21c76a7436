"""Accelerate's ``ParallelismConfig`` in ZeroConfig's terms: its ``tp_size`` is ``tensor_parallel_size``, and ZeRO
itself is its ``dp_shard`` dimension; the dimensions ds_strategy lacks are refused by name.

Accelerate is not handed the ``ParallelismConfig``: its own tensor-parallel path expects a model that
``transformers`` already split (``from_pretrained(tp_plan=...)``) and builds a mesh only for CUDA-like devices. The
mesh ds_strategy builds carries Accelerate's dimension names instead, so that Accelerate's data loaders, which read
``torch_device_mesh``, give every rank of a tensor-parallel group the same batches.
"""

from __future__ import annotations

import os
from typing import Any

from ..config import ZeroConfig

USE_PARALLELISM_CONFIG = "ACCELERATE_USE_PARALLELISM_CONFIG"
# ParallelismConfig sizes ds_strategy has no dimension for, with what each would mean.
_REFUSED_SIZES = {
    "dp_replicate_size": "replicated data parallelism (HSDP) around the sharded group",
    "cp_size": "context parallelism",
    "sp_size": "DeepSpeed-Ulysses sequence parallelism through Accelerate",
}


def check_no_launcher_parallelism(parallelism_config: Any) -> None:
    """``accelerate launch --use_parallelism_config`` has Accelerate build a ParallelismConfig from the environment,
    with its own mesh; ds_strategy takes the sizes only from the argument or the ZeroConfig."""
    if parallelism_config is None and os.environ.get(USE_PARALLELISM_CONFIG, "").lower() == "true":
        raise ValueError(
            f"{USE_PARALLELISM_CONFIG} is set (accelerate launch --use_parallelism_config), which has Accelerate "
            f"build its own device mesh; pass ZeroAccelerator(parallelism_config=ParallelismConfig(tp_size=...)) "
            f"or set ZeroConfig.tensor_parallel_size instead, and launch without --use_parallelism_config"
        )


def with_parallelism(config: ZeroConfig, parallelism_config: Any, num_processes: int) -> ZeroConfig:
    """``config`` with ``parallelism_config.tp_size`` as its ``tensor_parallel_size`` (None: ``config`` as is)."""
    if parallelism_config is None:
        return config
    refused = {name: getattr(parallelism_config, name) for name in _REFUSED_SIZES}
    refused = {name: size for name, size in refused.items() if size not in (None, 1)}
    if refused:
        named = ", ".join(f"{name}={size} ({_REFUSED_SIZES[name]})" for name, size in refused.items())
        raise ValueError(
            f"ZeroAccelerator supports ParallelismConfig's tp_size and dp_shard_size only, not {named}; "
            f"set those to 1 (ZeRO shards over the data-parallel ranks, the dp_shard dimension)"
        )
    tp, dp_shard = parallelism_config.tp_size or 1, parallelism_config.dp_shard_size or 1
    if dp_shard * tp != num_processes:
        raise ValueError(
            f"ParallelismConfig(dp_shard_size={dp_shard}, tp_size={tp}) covers {dp_shard * tp} processes but there "
            f"are {num_processes}; make dp_shard_size * tp_size equal the number of processes"
        )
    if config.tensor_parallel_size not in (1, tp):
        raise ValueError(
            f"ParallelismConfig(tp_size={tp}) conflicts with ZeroConfig.tensor_parallel_size="
            f"{config.tensor_parallel_size}; set it in one place only"
        )
    return config.replace(tensor_parallel_size=tp)
