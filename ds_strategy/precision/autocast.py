"""The autocast region a ZeRO forward runs in, for each precision setting."""

from __future__ import annotations

import contextlib

import torch

from ..config import ZeroConfig


def autocast_for(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to the 16-bit compute dtype of ``precision``; a no-op for "32-true".

    The parameters are already 16-bit under every 16-bit precision (the engine's flat buffers are in the
    compute dtype); autocast is what lets fp32 inputs meet them in matmuls and keeps autocast's fp32 ops (losses,
    softmax on CPU) in fp32. Ops autocast does not list run in whatever dtype reaches them.
    """
    plan = ZeroConfig(precision=precision).plan
    if not plan.autocasts:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=plan.compute_dtype)
