"""Unscale + overflow check + squared norm of a flat gradient shard, in plain PyTorch.

This is the specification of ``grad_stats.py``'s Triton kernel: the CPU path, the fallback when Triton is
missing, and the oracle the kernel is tested against.
"""

import torch
from torch import Tensor


def unscale_and_check_reference(grad: Tensor, inv_scale: float) -> tuple[Tensor, Tensor]:
    """Multiply ``grad`` in place by ``inv_scale``; return ``(sq_norm, found_inf)`` as fp32 scalars.

    ``sq_norm`` is the sum of squares of the unscaled values as stored (after rounding to ``grad``'s dtype),
    accumulated in fp32; ``found_inf`` is 1.0 if any stored value is inf, -inf or nan, else 0.0. Both stay on
    ``grad``'s device so the caller can all-reduce them before the one host sync that decides the step.
    """
    if inv_scale != 1.0:
        grad.mul_(inv_scale)
    found_inf = (~torch.isfinite(grad).all()).float()
    sq_norm = grad.float().pow(2).sum()
    return sq_norm, found_inf
