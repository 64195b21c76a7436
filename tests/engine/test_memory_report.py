"""memory_report() reports the bytes the ZeRO paper's formulas predict (fp32 Adam: params 4Ψ, grads 4Ψ or 4Ψ/N,
Adam state 8Ψ or 8Ψ/N), and they shrink with the world size exactly where the stage says they should."""

import pytest
from distributed import run_ranks
from training_loops import Recipe, train_stages

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

RECIPE = Recipe(model="TinyGPT", steps=1, accumulate=1)
STAGES = (0, 1, 2)


def _psi() -> int:
    import models

    return sum(p.numel() for p in models.TinyGPT().parameters())


def _total(report: dict, kind: str) -> int:
    return sum(report[kind].values())


@pytest.fixture(scope="module")
def reports():
    one = run_ranks(train_stages, 1, RECIPE, STAGES)[0]
    two = run_ranks(train_stages, 2, RECIPE, STAGES)[0]
    return {1: {s: r["memory"] for s, r in one.items()}, 2: {s: r["memory"] for s, r in two.items()}}


def _close(measured: int, expected: float, slack_bytes: int = 0) -> bool:
    return abs(measured - expected) <= 0.05 * expected + slack_bytes


@pytest.mark.parametrize("stage", (1, 2))
def test_optimizer_state_halves_on_two_ranks(reports, stage):
    assert _close(_total(reports[2][stage], "optimizer"), _total(reports[1][stage], "optimizer") / 2)


def test_stage2_gradients_halve_on_two_ranks(reports):
    assert _close(_total(reports[2][2], "grads"), _total(reports[1][2], "grads") / 2)


@pytest.mark.parametrize("stage", (0, 1))
def test_gradients_stay_whole_below_stage2(reports, stage):
    assert _close(_total(reports[2][stage], "grads"), _total(reports[1][stage], "grads"))


@pytest.mark.parametrize("stage", STAGES)
def test_report_matches_zero_paper_formulas_fp32_adam(reports, stage):
    psi, n = _psi(), 2
    report = reports[n][stage]
    assert _close(_total(report, "params"), 4 * psi)
    assert _close(_total(report, "grads"), 4 * psi / n if stage >= 2 else 4 * psi)
    assert _close(_total(report, "optimizer"), 8 * psi / n if stage >= 1 else 8 * psi)
    assert report["params"]["host"] == report["params"]["nvme"] == 0


def test_stage2_gradient_buckets_are_reported_separately(reports):
    buffers = _total(reports[2][2], "buffers")
    assert 0 < buffers <= 4 * _psi()
