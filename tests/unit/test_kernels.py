"""Each Triton kernel in ds_strategy.kernels computes exactly what its PyTorch reference does.

On a GPU the kernels are compiled and tested on CUDA tensors. On a CPU they run through Triton's interpreter,
which ``tests/conftest.py`` requests (TRITON_INTERPRET=1) before triton is first imported; the tests call the
Triton functions directly or force ``backend="triton"``, since production dispatch keeps CPU tensors on the
reference. The interpreter is slow, so sizes stay modest.
"""

import types

import pytest
import torch

import ds_strategy.kernels as kernels
from ds_strategy.kernels import Backend

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def _interpreted(jit_function) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(jit_function, InterpretedFunction)


@pytest.fixture(scope="module")
def triton_kernels():
    """The Triton kernel modules, runnable here: compiled on a GPU, interpreted on a CPU."""
    import triton.language as tl  # the test extra installs triton: never skipped

    from ds_strategy.kernels import grad_stats, quantize

    if not ON_GPU:
        assert kernels.interpreter_requested() and _interpreted(tl.sum), (
            "triton.language was imported without TRITON_INTERPRET=1, so the kernels cannot run on CPU tensors; "
            "tests/conftest.py sets it, so something imported triton before pytest loaded the conftest"
        )
        assert _interpreted(grad_stats._unscale_and_check_kernel)
    return types.SimpleNamespace(grad_stats=grad_stats, quantize=quantize)


GRAD_BLOCK = 1024  # grad_stats.BLOCK_SIZE, stated here so the sizes exist without triton
GRAD_SIZES = [0, 1, 1000, GRAD_BLOCK - 1, GRAD_BLOCK + 1, 2**16 + 3]
SPECIALS = {"finite": None, "zeros": 0.0, "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _gradient(numel: int, dtype: torch.dtype, special: str) -> torch.Tensor:
    """A scaled-looking gradient; ``special`` replaces three elements, or every element for "zeros"."""
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1024
    value = SPECIALS[special]
    if special == "zeros":
        grad.zero_()
    elif value is not None and numel > 0:
        grad[[0, numel // 2, numel - 1]] = value
    return grad.to(device=DEVICE, dtype=dtype)


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def _assert_equal_but_for_interpreter_bf16_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal, except that bf16 may differ by one ulp.

    Triton's interpreter truncates fp32 -> bf16 casts, where compiled kernels (and PyTorch) round to nearest
    even. Casts that are exact, such as multiplying by a power-of-two inverse loss scale, are unaffected.
    """
    interpreted = not ON_GPU
    rtol = 2.0**-7 if interpreted and actual.dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=0, equal_nan=True)


def test_dispatch_runs_triton_on_cuda_tensors_only():
    expected = Backend.TRITON if ON_GPU and kernels.triton_available() else Backend.REFERENCE
    assert kernels.select_backend(torch.ones(3, device=DEVICE)) is expected


def test_dispatch_keeps_cpu_tensors_on_the_reference_even_with_the_interpreter_requested(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.select_backend(torch.ones(3)) is Backend.REFERENCE


def test_forcing_triton_on_a_cpu_tensor_without_the_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.unscale_and_check(torch.ones(3), 1.0, backend="triton")


def test_forcing_the_reference_runs_the_reference_on_any_device():
    assert kernels.select_backend(torch.ones(3, device=DEVICE), "reference") is Backend.REFERENCE


@pytest.mark.parametrize("inv_scale", [1.0, 1 / 1024])  # powers of two, as dynamic loss scales are
@pytest.mark.parametrize("special", list(SPECIALS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", GRAD_SIZES)
def test_unscale_and_check_kernel_matches_reference(triton_kernels, numel, dtype, special, inv_scale):
    grad_kernel = _gradient(numel, dtype, special)
    grad_reference = grad_kernel.clone()
    sq_kernel, inf_kernel = triton_kernels.grad_stats.unscale_and_check_triton(grad_kernel, inv_scale)
    sq_reference, inf_reference = kernels.unscale_and_check_reference(grad_reference, inv_scale)

    _assert_bitwise_equal(grad_kernel, grad_reference)
    assert inf_kernel.dtype == sq_kernel.dtype == torch.float32
    assert inf_kernel.item() == inf_reference.item() == float(special in ("inf", "-inf", "nan") and numel > 0)
    if inf_reference.item() == 0:  # with an inf/nan present the norm is meaningless
        torch.testing.assert_close(sq_kernel, sq_reference, rtol=1e-5, atol=0)


def test_unscale_and_check_reference_unscales_in_place_and_sums_unscaled_squares():
    grad = torch.tensor([2048.0, -1024.0, 0.0])
    sq_norm, found_inf = kernels.unscale_and_check_reference(grad, 1 / 1024)
    assert grad.tolist() == [2.0, -1.0, 0.0]
    assert sq_norm.item() == 5.0 and found_inf.item() == 0.0


def test_unscale_and_check_entry_point_runs_the_kernel_when_forced(triton_kernels, monkeypatch):
    grad_stats = triton_kernels.grad_stats
    kernel, calls = grad_stats.unscale_and_check_triton, []

    def recording_kernel(*args):
        calls.append(args)
        return kernel(*args)

    monkeypatch.setattr(grad_stats, "unscale_and_check_triton", recording_kernel)
    sq_norm, found_inf = kernels.unscale_and_check(torch.full((10,), 2.0, device=DEVICE), 0.5, backend="triton")
    assert len(calls) == 1 and sq_norm.item() == 10.0 and found_inf.item() == 0.0


QUANT_SIZES = [0, 1, 63, 64, 65, 1000, 2**14 + 3]


def _values(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spanning several magnitudes, with one all-zero block when there is room for it."""
    generator = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=generator) * torch.logspace(-3, 3, numel) if numel else torch.empty(0)
    x[64:128] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", QUANT_SIZES)
def test_quantize_kernels_match_reference(triton_kernels, numel, dtype, block_size, bits):
    x = _values(numel, dtype).to(DEVICE)
    q_kernel, scales_kernel = triton_kernels.quantize.quantize_blockwise_triton(x, block_size, bits)
    q_reference, scales_reference = kernels.quantize_blockwise_reference(x, block_size, bits)
    _assert_bitwise_equal(q_kernel, q_reference)
    _assert_bitwise_equal(scales_kernel, scales_reference)
    _assert_equal_but_for_interpreter_bf16_rounding(
        triton_kernels.quantize.dequantize_blockwise_triton(q_kernel, scales_kernel, numel, dtype, bits),
        kernels.dequantize_blockwise_reference(q_reference, scales_reference, numel, dtype, bits),
    )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", QUANT_SIZES)
def test_quantize_round_trip_error_is_at_most_half_a_step(numel, dtype, bits):
    block_size, qmax = 64, {8: 127, 4: 7}[bits]
    x = _values(numel, dtype).float()
    q, scales = kernels.quantize_blockwise_reference(x.to(dtype), block_size, bits)
    restored = kernels.dequantize_blockwise_reference(q, scales, numel, torch.float32, bits)

    assert q.dtype == torch.int8 and q.numel() * 8 // bits == scales.numel() * block_size >= numel
    padded = torch.nn.functional.pad(x, (0, scales.numel() * block_size - numel)).view(-1, block_size)
    block_max = padded.abs().amax(dim=1)
    half_step = torch.where(block_max > 0, block_max / qmax, 1.0) / 2
    fp32_rounding = block_max * 2.0**-22  # a few ulps of the largest value, from x / scale and q * scale
    bound = (half_step + fp32_rounding).repeat_interleave(block_size)[:numel]
    assert torch.all((restored - x).abs() <= bound)


def test_int4_uses_every_level_and_packs_two_values_per_byte():
    """The 15 levels -7..7 each survive a round trip in both nibbles (packing: see quantize_reference's Note)."""
    levels = torch.arange(-7.0, 8.0)
    pairs = torch.cartesian_prod(levels, levels)  # every (even, odd) combination
    x = torch.cat([pairs, torch.full_like(pairs, 7.0)], dim=1).flatten()  # blocks of 4 whose max is 7
    q, scales = kernels.quantize_blockwise(x, block_size=4, bits=4)
    assert q.numel() == x.numel() // 2
    assert torch.allclose(kernels.dequantize_blockwise(q, scales, x.numel(), torch.float32, bits=4), x, atol=1e-5)


def test_all_zero_block_gets_scale_one_and_restores_exactly():
    q, scales = kernels.quantize_blockwise(torch.zeros(300), block_size=256)
    assert scales.tolist() == [1.0, 1.0] and not q.any()
    assert kernels.dequantize_blockwise(q, scales, 300, torch.bfloat16).eq(0).all()


def test_dequantize_rejects_mismatched_numel():
    q, scales = kernels.quantize_blockwise(torch.ones(300), block_size=256)
    with pytest.raises(ValueError, match="numel=256"):
        kernels.dequantize_blockwise(q, scales, 256, torch.float32)
    with pytest.raises(ValueError, match="4-bit values"):  # int8 bytes read as int4: twice the values
        kernels.dequantize_blockwise(q, scales, 300, torch.float32, bits=4)


@pytest.mark.parametrize("bits", [2, 16, True])
def test_quantize_rejects_unsupported_bits(bits):
    with pytest.raises(ValueError, match="bits must be one of"):
        kernels.quantize_blockwise(torch.ones(8), block_size=4, bits=bits)
