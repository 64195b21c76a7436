"""The micro-batch a config promises, checked against the first batch the data loader actually yields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import ZeroConfig


def leading_batch_size(batch: Any) -> int | None:
    """The first dimension of the first tensor in ``batch`` (a tensor, or lists/tuples/dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = leading_batch_size(item)
        if size is not None:
            return size
    return None


def check_micro_batch(config: ZeroConfig, batch: Any) -> None:
    """Raise when ``train_micro_batch_size_per_gpu`` is set and the batch's leading dimension differs, as DeepSpeed
    would train on a global batch other than the configured one. Under pipelining the setting is the size of one
    pipeline micro-batch, as in DeepSpeed's PipelineEngine, so a batch holds ``pipeline_microbatch_count`` of them."""
    micro = config.train_micro_batch_size_per_gpu
    actual = leading_batch_size(batch)
    if micro is None or actual is None:
        return
    count = config.pipeline_microbatch_count
    expected = micro * count
    if actual != expected:
        pipelined = f" x {count} pipeline micro-batches" if count > 1 else ""
        raise ValueError(
            f"ZeroConfig.train_micro_batch_size_per_gpu={micro}{pipelined} but the data loader's first batch "
            f"holds {actual} samples; make the loader's batch_size {expected} or change the config"
        )
