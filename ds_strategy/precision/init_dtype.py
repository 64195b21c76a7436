"""The dtype ``init_module()`` creates a model in, shared by the Lightning and Fabric adapters.

Under "bf16-true"/"16-true" the weights are created in the 16-bit compute dtype, as Lightning's ``HalfPrecision``
creates them under DDP: the model is never allocated in fp32 only to be converted at setup. Every other precision
creates them in the default dtype (the engine keeps fp32 masters and makes its own 16-bit buffers under "-mixed").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..config import ZeroConfig


def init_dtype_context(precision: str) -> contextlib.AbstractContextManager:
    """Tensors created inside get the 16-bit compute dtype of a "-true" ``precision``; a no-op otherwise."""
    plan = ZeroConfig(precision=precision).plan
    if not plan.converts_module:
        return contextlib.nullcontext()
    return _default_dtype(plan.compute_dtype)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
