"""Block-wise symmetric int8 quantisation (ZeRO++ qwZ/qgZ), in plain PyTorch.

This is the specification of ``quantize.py``'s Triton kernels, the CPU path and their test oracle.

The flat input is cut into blocks of ``block_size`` elements (the last one zero-padded). Each block gets one
fp32 scale ``max|x| * (1/127)`` and its values become ``round(x / scale)`` (round half to even), an int8 in
[-127, 127]; dequantising multiplies back, so every element is off by at most ``scale / 2``. A block with
``max|x| == 0`` would divide by zero: its scale is 1 instead, which quantises it to zeros and restores it
exactly. Inputs must be finite.

The scale is a product with the fp32 constant ``1/127`` rather than a division by 127 because PyTorch on
CUDA turns division by a Python scalar into that same product: written this way the reference gives the
kernel's bits on either device.
"""

import torch
from torch import Tensor

INT8_MAX = 127


def block_scales_reference(blocks: Tensor) -> Tensor:
    """fp32 scale per row of ``blocks``: ``max|x| / 127``, or 1 for an all-zero row."""
    scales = blocks.abs().amax(dim=1) * (1.0 / INT8_MAX)
    return torch.where(scales > 0, scales, torch.ones_like(scales))


def quantize_blockwise_reference(x: Tensor, block_size: int = 256) -> tuple[Tensor, Tensor]:
    """Quantise flat ``x`` to ``(q int8 [n_blocks * block_size], scales fp32 [n_blocks])``."""
    n_blocks = -(-x.numel() // block_size)
    padded = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    blocks = padded.view(n_blocks, block_size)
    scales = block_scales_reference(blocks)
    q = torch.round(blocks / scales[:, None]).to(torch.int8)
    return q.flatten(), scales


def dequantize_blockwise_reference(q: Tensor, scales: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """Undo ``quantize_blockwise_reference``: the first ``numel`` values of ``q * scale``, as ``dtype``."""
    if scales.numel() == 0:
        return torch.empty(0, dtype=dtype, device=q.device)
    blocks = q.view(scales.numel(), -1).float() * scales[:, None]
    return blocks.flatten()[:numel].to(dtype)
