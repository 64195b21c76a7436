"""Public kernel entry points: each call runs the Triton kernel or its PyTorch reference.

``select_backend`` decides per call: the Triton kernel for tensors on a CUDA (or ROCm) device when Triton imports,
the reference for everything else, every CPU tensor included. A caller may force one with ``backend=``
(``Backend.TRITON`` or ``"triton"``, ``Backend.REFERENCE`` or ``"reference"``); the kernel tests force Triton
on CPU tensors, which Triton then runs through its interpreter. The Triton modules are imported on first use,
so a machine without Triton never needs it.

Note: [Triton's interpreter on CPU tensors]
Triton fixes interpret-or-compile when each ``@triton.jit``
function is defined, its own ``triton.language`` helpers included, so ``TRITON_INTERPRET=1`` only takes effect
if it is in the environment before ``triton.language`` is first imported (Lightning and ``torch._dynamo`` may
import it early; ``tests/conftest.py`` sets it before anything else). The interpreter is slow, about 2-10 us
per element, which is why production calls never send CPU tensors to it: the environment variable decides
nothing here, only the tensor's device or an explicit ``backend=`` does. Forcing Triton on a CPU tensor without
the interpreter raises instead of failing inside Triton.

The entry points validate their arguments once; the backends assume valid input.
"""

import enum
import functools
import os

import torch
from torch import Tensor

from .grad_stats_reference import unscale_and_check_reference
from .quantize_reference import QMAX, dequantize_blockwise_reference, quantize_blockwise_reference

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRUTHY = ("1", "true", "yes", "on", "y")


class Backend(enum.Enum):
    """Which implementation of a kernel a call runs."""

    TRITON = "triton"
    REFERENCE = "reference"


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` succeeds (checked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels on the CPU (same spellings as Triton)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


def select_backend(tensor: Tensor, backend: Backend | str | None = None) -> Backend:
    """The implementation a kernel call on ``tensor`` runs: ``backend`` if given, else Triton for CUDA tensors
    (when Triton imports) and the reference otherwise (see the module docstring)."""
    if backend is None:
        on_gpu = tensor.device.type == "cuda"
        return Backend.TRITON if on_gpu and triton_available() else Backend.REFERENCE
    chosen = Backend(backend)
    if chosen is Backend.TRITON:
        if not triton_available():
            raise RuntimeError("backend='triton' was forced but triton is not installed")
        if tensor.device.type == "cpu" and not interpreter_requested():
            raise RuntimeError(
                "backend='triton' was forced on a CPU tensor, which needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before triton is first imported"
            )
    return chosen


def unscale_and_check(grad: Tensor, inv_scale: float, backend: Backend | str | None = None) -> tuple[Tensor, Tensor]:
    """Unscale a flat gradient shard in place; return fp32 scalars ``(sq_norm, found_inf)``.

    ``sq_norm`` is the sum of squares of the unscaled gradient and is meaningless when ``found_inf`` is 1
    (some element is inf or nan). See ``grad_stats.py`` for the kernel and ``grad_stats_reference.py`` for
    the exact definition.
    """
    _require_flat(grad, "grad", _GRAD_DTYPES)
    if select_backend(grad, backend) is Backend.TRITON:
        from .grad_stats import unscale_and_check_triton

        return unscale_and_check_triton(grad, inv_scale)
    return unscale_and_check_reference(grad, inv_scale)


def quantize_blockwise(
    x: Tensor, block_size: int = 256, bits: int = 8, backend: Backend | str | None = None
) -> tuple[Tensor, Tensor]:
    """Quantise flat ``x`` to ``(q int8 [n_blocks * block_size * bits / 8], scales fp32 [n_blocks])``.

    Symmetric, one scale ``max|x| / QMAX`` per block (QMAX 127 for ``bits=8``, 7 for ``bits=4``, two values
    per byte; 1 for an all-zero block); see ``quantize_reference.py``.
    """
    _require_flat(x, "x", _GRAD_DTYPES)
    _require_bits(bits)
    if block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size}")
    if select_backend(x, backend) is Backend.TRITON:
        from .quantize import quantize_blockwise_triton

        return quantize_blockwise_triton(x, block_size, bits)
    return quantize_blockwise_reference(x, block_size, bits)


def dequantize_blockwise(
    q: Tensor, scales: Tensor, numel: int, dtype: torch.dtype, bits: int = 8, backend: Backend | str | None = None
) -> Tensor:
    """Invert ``quantize_blockwise``: a flat ``dtype`` tensor of the first ``numel`` dequantised values."""
    _require_flat(q, "q", (torch.int8,))
    _require_flat(scales, "scales", (torch.float32,))
    _require_bits(bits)
    if not _is_quantized_shape(q.numel() * 8 // bits, scales.numel(), numel):
        raise ValueError(
            f"q ({q.numel()} bytes of {bits}-bit values) and scales ({scales.numel()} blocks) "
            f"are not what quantize_blockwise makes of numel={numel} values"
        )
    if select_backend(q, backend) is Backend.TRITON:
        from .quantize import dequantize_blockwise_triton

        return dequantize_blockwise_triton(q, scales, numel, dtype, bits)
    return dequantize_blockwise_reference(q, scales, numel, dtype, bits)


def _require_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be one of {sorted(QMAX)}, got {bits!r}")


def _require_flat(tensor: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``tensor`` is 1-D, contiguous and of one of ``dtypes``."""
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {dtypes}, got {tensor.dtype}")


def _is_quantized_shape(q_numel: int, n_blocks: int, numel: int) -> bool:
    """Whether quantising ``numel`` values gives ``n_blocks`` equal blocks totalling ``q_numel`` values."""
    if n_blocks == 0:
        return q_numel == 0 and numel == 0
    block_size, remainder = divmod(q_numel, n_blocks)
    return remainder == 0 and q_numel - block_size < numel <= q_numel
