"""Triton kernel: unscale a flat gradient shard in place, flag inf/nan and sum its squares in one read.

The plain-PyTorch statement of the same function is ``grad_stats_reference.unscale_and_check_reference``.

Note: [One pass over the gradient shard]
Before an fp16/bf16 optimizer step the engine needs three things from every gradient shard: the gradients
divided by the loss scale, whether any of them is inf/nan (then the step is skipped on every rank), and their
squared norm (for clipping). Done separately that is three reads and one write of the shard; here each
program loads one block once, writes it back unscaled, and leaves one partial sum and one inf flag per block;
a ``torch.sum`` over the partials finishes the norm. Two details keep the kernel equal to the reference:
  * the norm and the inf test look at the value *as stored*, i.e. after rounding the unscaled fp32 product
    back to the gradient's dtype, exactly as ``grad.mul_(inv_scale)`` followed by ``grad.float()`` does;
  * when ``found_inf`` is 1 the norm is inf or nan (or a partial sum of whatever was finite) and means
    nothing: the caller skips the step and must not read it. Comparing norms is only meaningful when
    ``found_inf`` is 0. (A finite shard whose squares overflow fp32 gives ``sq_norm = inf`` with
    ``found_inf = 0``; clipping by an infinite norm then zeroes the update, the same as the reference.)
"""

import torch
from torch import Tensor

from ..optional_packages import needs

# dispatch.py loads this module only when Triton is chosen; imported directly without triton, say what to install
with needs("triton", needed_by="ds_strategy.kernels.grad_stats"):
    import triton
    import triton.language as tl

BLOCK_SIZE = 1024


@triton.jit
def _unscale_and_check_kernel(
    grad_ptr, sq_partial_ptr, inf_partial_ptr, numel, inv_scale, UNSCALE: tl.constexpr, BLOCK: tl.constexpr
):
    """Unscale one block of the gradient in place; store its sum of squares and its inf/nan flag."""
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offsets < numel
    grad = tl.load(grad_ptr + offsets, mask=in_range, other=0.0)
    if UNSCALE:
        grad = (grad.to(tl.float32) * inv_scale).to(grad_ptr.dtype.element_ty)
        tl.store(grad_ptr + offsets, grad, mask=in_range)
    value = grad.to(tl.float32)
    not_finite = (value != value) | (tl.abs(value) == float("inf"))
    tl.store(sq_partial_ptr + block, tl.sum(value * value, axis=0))
    tl.store(inf_partial_ptr + block, tl.max(not_finite.to(tl.float32), axis=0))


def unscale_and_check_triton(grad: Tensor, inv_scale: float) -> tuple[Tensor, Tensor]:
    """Triton version of ``unscale_and_check_reference``; ``grad`` must be 1-D and contiguous."""
    numel = grad.numel()
    n_blocks = triton.cdiv(numel, BLOCK_SIZE)
    sq_partial = torch.empty(n_blocks, dtype=torch.float32, device=grad.device)
    inf_partial = torch.empty(n_blocks, dtype=torch.float32, device=grad.device)
    if n_blocks > 0:
        _unscale_and_check_kernel[(n_blocks,)](
            grad, sq_partial, inf_partial, numel, float(inv_scale), UNSCALE=inv_scale != 1.0, BLOCK=BLOCK_SIZE
        )
    return sq_partial.sum(), inf_partial.any().float()
