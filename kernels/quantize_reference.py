"""Block-wise symmetric int8 / int4 quantisation (ZeRO++ qwZ/qgZ), in plain PyTorch.

This is the specification of ``quantize.py``'s Triton kernels, the CPU path and their test oracle.

The flat input is cut into blocks of ``block_size`` elements (the last one zero-padded). Each block gets one
fp32 scale ``max|x| * (1/QMAX)`` and its values become ``round(x / scale)`` (round half to even), an integer
in [-QMAX, QMAX], with QMAX = 127 for 8 bits and 7 for 4 bits; dequantising multiplies back, so every element
is off by at most ``scale / 2``. A block with ``max|x| == 0`` would divide by zero: its scale is 1 instead,
which quantises it to zeros and restores it exactly. Inputs must be finite.

The scale is a product with the fp32 constant ``1/QMAX`` rather than a division because PyTorch on CUDA turns
division by a Python scalar into that same product: written this way the reference gives the kernel's bits on
either device.

Note: [Int4 packing]
Two 4-bit values share a byte: element ``2i`` in the low nibble (two's complement, 0..15),
element ``2i + 1`` in the high one, i.e. ``byte = q_odd * 16 + (q_even & 15)``. With both in [-7, 7] that sum
lies in [-112, 127], so it is an ordinary int8 with no wrap-around, and ``byte >> 4`` (arithmetic) gives
``q_odd`` back on any backend. A block of ``block_size`` values is ``block_size / 2`` bytes.
"""

import torch
from torch import Tensor

QMAX = {8: 127, 4: 7}


def block_scales_reference(blocks: Tensor, bits: int = 8) -> Tensor:
    """fp32 scale per row of ``blocks``: ``max|x| / QMAX``, or 1 for an all-zero row."""
    scales = blocks.abs().amax(dim=1) * (1.0 / QMAX[bits])
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize_blockwise_reference(x: Tensor, block_size: int = 256, bits: int = 8) -> tuple[Tensor, Tensor]:
    """Quantise flat ``x`` to ``(q int8 [n_blocks * block_size * bits / 8], scales fp32 [n_blocks])``."""
    n_blocks = -(-x.numel() // block_size)
    if x.numel() == n_blocks * block_size:  # whole blocks: no padded copy (only read below)
        padded = x.float()
    else:
        padded = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=x.device)
        padded[: x.numel()] = x
    blocks = padded.view(n_blocks, block_size)
    scales = block_scales_reference(blocks, bits)
    q = blocks.div(scales[:, None]).round_().to(torch.int8)
    if bits == 4:
        q = q[:, 1::2] * 16 + (q[:, 0::2] & 15)
    return q.flatten(), scales


def dequantize_blockwise_reference(q: Tensor, scales: Tensor, numel: int, dtype: torch.dtype, bits: int = 8) -> Tensor:
    """Undo ``quantize_blockwise_reference``: the first ``numel`` values of ``q * scale``, as ``dtype``."""
    if scales.numel() == 0:
        return torch.empty(0, dtype=dtype, device=q.device)
    if bits == 4:  # (q << 4) >> 4 sign-extends the low nibble; the bits shifted out of an int8 are dropped
        q = torch.stack([(q << 4) >> 4, q >> 4], dim=-1)
    blocks = q.reshape(scales.numel(), -1).float() * scales[:, None]
    return blocks.flatten()[:numel].to(dtype)
