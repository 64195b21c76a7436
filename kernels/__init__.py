"""Triton kernels for ds_strategy, each beside the plain-PyTorch reference that defines it.

Installed as ``ds_strategy.kernels`` (setup.py's Note: [Where each package comes from]); import it by that name. The
entry points below pick the Triton kernel or the reference per call (``dispatch.select_backend``); the Triton modules
(``grad_stats``, ``quantize``) import ``triton`` and are loaded only when chosen.
"""

from .dispatch import (
    Backend,
    dequantize_blockwise,
    interpreter_requested,
    quantize_blockwise,
    select_backend,
    triton_available,
    unscale_and_check,
)
from .grad_stats_reference import unscale_and_check_reference
from .quantize_reference import dequantize_blockwise_reference, quantize_blockwise_reference

__all__ = [
    "Backend",
    "dequantize_blockwise",
    "dequantize_blockwise_reference",
    "interpreter_requested",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "select_backend",
    "triton_available",
    "unscale_and_check",
    "unscale_and_check_reference",
]
