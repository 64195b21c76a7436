"""CpuAdam, CpuAdagrad and CpuSGD step like torch.optim's AdamW, Adam, Adagrad and SGD (fp32 references) over 10
steps on random data, on sizes that are no multiple of any vector width or tile, and write the 16-bit copy of
the updated parameters in the same pass.

Compared to 1e-6 relative in norm (and 1e-6 absolute per element): torch's default CPU path and the fused kernel
CpuAdam runs differ in rounding by an ulp or so per step.
"""

import pytest
import torch

from ds_strategy.offload import CpuAdagrad, CpuAdam, CpuSGD, cpu_adam

SIZES = [1, 7, 1001, 3 * 64 + 5]  # with TILE shrunk to 64 below: one tile, a partial tile, many tiles
STEPS = 10


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(cpu_adam, "TILE", 64)


def _train(optimizer_cls, size: int, copies: dict | None = None, seed: int = 0, **hyper) -> tuple:
    torch.manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(size))
    optimizer = optimizer_cls([param], **hyper)
    generator = torch.Generator().manual_seed(seed + 1)
    copy = None
    for _ in range(STEPS):
        param.grad = torch.randn(size, generator=generator)
        if copies is not None:
            copy = torch.empty(size, dtype=copies["dtype"])
            optimizer.step(param_copies={param: copy})
        else:
            optimizer.step()
        optimizer.param_groups[0]["lr"] *= 0.9  # a scheduler's change is read at the next step
    return param.detach(), optimizer.state[param], copy


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert (actual - expected).norm() <= 1e-6 * expected.norm()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("weight_decay, amsgrad", [(0.0, False), (0.1, False), (0.1, True)])
def test_cpu_adam_matches_torch_adamw(size, weight_decay, amsgrad):
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay, amsgrad=amsgrad)
    param, state, _ = _train(CpuAdam, size, threads=2, **hyper)
    expected, expected_state, _ = _train(torch.optim.AdamW, size, **hyper)
    _assert_close(param, expected)
    assert state.keys() == expected_state.keys()
    for key in expected_state:
        _assert_close(state[key], expected_state[key])


@pytest.mark.parametrize("size", SIZES)
def test_cpu_adam_l2_mode_matches_torch_adam_with_weight_decay(size):
    hyper = dict(lr=1e-2, weight_decay=0.1, amsgrad=True)
    param, _, _ = _train(CpuAdam, size, adamw_mode=False, **hyper)
    expected, _, _ = _train(torch.optim.Adam, size, **hyper)
    _assert_close(param, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", SIZES)
def test_cpu_adam_writes_the_16bit_copy_of_the_updated_parameters(size, dtype):
    param, _, copy = _train(CpuAdam, size, copies={"dtype": dtype}, threads=2, weight_decay=0.1)
    assert torch.equal(copy, param.to(dtype))


@pytest.mark.parametrize("size", SIZES)
def test_cpu_adagrad_matches_torch_adagrad(size):
    hyper = dict(lr=1e-1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1, eps=1e-10)
    param, state, _ = _train(CpuAdagrad, size, threads=2, **hyper)
    expected, expected_state, _ = _train(torch.optim.Adagrad, size, **hyper)
    _assert_close(param, expected)
    _assert_close(state["sum"], expected_state["sum"])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("nesterov, dampening", [(False, 0.1), (True, 0.0)])
def test_cpu_sgd_with_momentum_matches_torch_sgd(size, nesterov, dampening):
    hyper = dict(lr=1e-1, momentum=0.9, dampening=dampening, weight_decay=0.01, nesterov=nesterov)
    param, state, _ = _train(CpuSGD, size, threads=2, **hyper)
    expected, expected_state, _ = _train(torch.optim.SGD, size, **hyper)
    _assert_close(param, expected)
    _assert_close(state["momentum_buffer"], expected_state["momentum_buffer"])


def test_cpu_adam_equals_torchs_fused_adamw_bitwise_however_the_pass_is_tiled_and_threaded():
    hyper = dict(lr=1e-2, weight_decay=0.1)
    expected, _, _ = _train(torch.optim.AdamW, 1001, fused=True, **hyper)
    assert torch.equal(_train(CpuAdam, 1001, **hyper)[0], expected)  # one call over the shard
    for threads in (1, 3):  # tiles of 64 on 1 or 3 threads, with the copy-out
        param, _, _ = _train(CpuAdam, 1001, copies={"dtype": torch.bfloat16}, threads=threads, **hyper)
        assert torch.equal(param, expected)


def test_cpu_adam_rejects_invalid_hyperparameters():
    with pytest.raises(ValueError, match="CpuAdam: invalid"):
        CpuAdam([torch.nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
