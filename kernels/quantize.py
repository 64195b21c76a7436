"""Triton kernels for block-wise symmetric int8 / int4 quantise / dequantise (ZeRO++ qwZ/qgZ).

The plain-PyTorch statement of the same functions, and the scheme itself, is in ``quantize_reference.py``.
One program handles one block, so the block's ``max|x|`` is a single in-register reduction.

Note: [Matching the reference bit for bit]
Triton's ``/`` on fp32 may compile to an approximate division, and libdevice's ``rint`` does not exist under
the interpreter (``TRITON_INTERPRET=1``), so the kernel spells out both operations that must be exactly
rounded: ``tl.math.div_rn`` for ``x / scale``, and ``_round_half_to_even`` for ``torch.round``. The latter
is exact for |v| < 2**23 (here |v| <= 127.5) because ``v - floor(v)`` is exact there, except for v in
(-0.5, 0), where the fraction may round up to 0.5 or 1.0, and with ``floor(v) = -1`` (odd) both still round up
to 0, the right answer.
"""

import torch
from torch import Tensor

from ..optional_packages import needs
from .quantize_reference import QMAX

# dispatch.py loads this module only when Triton is chosen; imported directly without triton, say what to install
with needs("triton", needed_by="ds_strategy.kernels.quantize"):
    import triton
    import triton.language as tl


@triton.jit
def _round_half_to_even(v):
    """``torch.round`` (ties to even) from floor and compare, valid for |v| < 2**23."""
    floor = tl.floor(v)
    fraction = v - floor
    floor_is_odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
    round_up = (fraction > 0.5) | ((fraction == 0.5) & floor_is_odd)
    return tl.where(round_up, floor + 1.0, floor)


@triton.jit
def _block_scale(max_abs, QMAX: tl.constexpr):
    """The reference's ``block_scales_reference`` for one block: ``max|x| * (1/QMAX)``, or 1 if that is 0."""
    scale = max_abs * (1.0 / QMAX)
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def _quantize_values(x, scale):
    """``round(x / scale)`` as the reference computes it, in fp32."""
    return _round_half_to_even(tl.math.div_rn(x, scale))


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scale_ptr, numel, BLOCK: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr):
    """Quantise one block: store its scale and its ``BLOCK`` values (zeros past ``numel``) as int8, or as
    ``BLOCK / 2`` bytes of two int4 values each (packing: see the reference's Note)."""
    block = tl.program_id(0)
    if BITS == 8:
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
        scale = _block_scale(tl.max(tl.abs(x), axis=0), QMAX)
        tl.store(q_ptr + offsets, _quantize_values(x, scale).to(tl.int8))
    else:
        evens = block.to(tl.int64) * BLOCK + 2 * tl.arange(0, BLOCK // 2)
        even = tl.load(x_ptr + evens, mask=evens < numel, other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + evens + 1, mask=evens + 1 < numel, other=0.0).to(tl.float32)
        scale = _block_scale(tl.maximum(tl.max(tl.abs(even), axis=0), tl.max(tl.abs(odd), axis=0)), QMAX)
        q_even = _quantize_values(even, scale)
        packed = _quantize_values(odd, scale) * 16.0 + tl.where(q_even < 0.0, q_even + 16.0, q_even)
        tl.store(q_ptr + block.to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2), packed.to(tl.int8))
    tl.store(scale_ptr + block, scale)


@triton.jit
def _dequantize_kernel(q_ptr, scale_ptr, out_ptr, numel, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Dequantise one block into ``out`` (fp32 product, rounded once to ``out``'s dtype)."""
    block = tl.program_id(0)
    scale = tl.load(scale_ptr + block)
    if BITS == 8:
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < numel
        q = tl.load(q_ptr + offsets, mask=in_range, other=0)
        tl.store(out_ptr + offsets, (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=in_range)
    else:
        packed = tl.load(q_ptr + block.to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)).to(tl.float32)
        high = tl.floor(packed * 0.0625)  # the arithmetic shift by 4, exact in fp32
        low = packed - 16.0 * high
        low = tl.where(low > 7.0, low - 16.0, low)
        evens = block.to(tl.int64) * BLOCK + 2 * tl.arange(0, BLOCK // 2)
        tl.store(out_ptr + evens, (low * scale).to(out_ptr.dtype.element_ty), mask=evens < numel)
        tl.store(out_ptr + evens + 1, (high * scale).to(out_ptr.dtype.element_ty), mask=evens + 1 < numel)


def quantize_blockwise_triton(x: Tensor, block_size: int = 256, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Triton version of ``quantize_blockwise_reference``; ``block_size`` must be a power of two (>= 2 for 4 bits)."""
    n_blocks = triton.cdiv(x.numel(), block_size)
    q = torch.empty(n_blocks * block_size * bits // 8, dtype=torch.int8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    if n_blocks > 0:
        _quantize_kernel[(n_blocks,)](x, q, scales, x.numel(), BLOCK=block_size, BITS=bits, QMAX=QMAX[bits])
    return q, scales


def dequantize_blockwise_triton(q: Tensor, scales: Tensor, numel: int, dtype: torch.dtype, bits: int = 8) -> Tensor:
    """Triton version of ``dequantize_blockwise_reference``."""
    out = torch.empty(numel, dtype=dtype, device=q.device)
    n_blocks = scales.numel()
    if n_blocks > 0:
        block_size = q.numel() * 8 // bits // n_blocks
        _dequantize_kernel[(n_blocks,)](q, scales, out, numel, BLOCK=block_size, BITS=bits)
    return out
