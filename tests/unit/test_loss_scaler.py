"""LossScaler follows DeepSpeed's DynamicLossScaler schedule (expected figures derived by hand from its rules)."""

import pytest

from ds_strategy.config import ZeroConfig
from ds_strategy.precision import LossScaler

O, C = True, False  # noqa: E741 (overflow step, clean step: the schedules below read as rows of O and C)

# hysteresis=2, loss_scale_window=4, min_loss_scale=1, initial_scale_power=4 (scale 16). Rules: an overflow
# spends one hysteresis unit, or halves the scale once one unit is left; a clean step doubles the scale (and
# refills hysteresis) when stable = iter - last_overflow_iter - 1 is > 0 and a multiple of 4.
SCRIPT = [O, O, C, C, C, C, C, O, C, O, O, O, O, O, C, C, C, C, C, O, O]
EXPECTED_SCALES = [
    16,  # iter 0  O: hysteresis 2 -> 1, scale kept
    8,  # iter 1  O: hysteresis is 1 -> halve
    8,  # iter 2  C: stable 0
    8,  # iter 3  C: stable 1
    8,  # iter 4  C: stable 2
    8,  # iter 5  C: stable 3
    16,  # iter 6  C: stable 4 -> double, hysteresis refilled to 2
    16,  # iter 7  O: hysteresis 2 -> 1
    16,  # iter 8  C: stable 0; hysteresis NOT refilled (consecutive_hysteresis=False)
    8,  # iter 9  O: hysteresis still 1 -> halve
    4,  # iter 10 O: halve
    2,  # iter 11 O: halve
    1,  # iter 12 O: halve to the minimum
    1,  # iter 13 O: max(1/2, 1) = 1 (first overflow at the minimum)
    1,  # iter 14 C: stable 0
    1,  # iter 15 C: stable 1
    1,  # iter 16 C: stable 2
    1,  # iter 17 C: stable 3
    2,  # iter 18 C: stable 4 -> double, hysteresis refilled to 2
    2,  # iter 19 O: hysteresis 2 -> 1
    1,  # iter 20 O: halve
]


def _scaler(**overrides) -> LossScaler:
    args = dict(initial_scale_power=4, loss_scale_window=4, hysteresis=2, min_loss_scale=1.0)
    return LossScaler(ZeroConfig(**(args | overrides)).precision_policy)


def _run(scaler: LossScaler, script: list[bool]) -> list[float]:
    scales = []
    for overflow in script:
        scaler.update(overflow)
        scales.append(scaler.scale)
    return scales


def test_dynamic_scale_follows_deepspeed_schedule():
    scaler = _scaler()
    assert scaler.scale == 16 and scaler.inv_scale == 1 / 16
    assert _run(scaler, SCRIPT) == EXPECTED_SCALES


def test_skipped_steps_counts_every_overflow():
    scaler = _scaler()
    _run(scaler, SCRIPT)
    assert scaler.skipped_steps == SCRIPT.count(O) == 10


def test_consecutive_hysteresis_refills_on_every_clean_step():
    scaler = _scaler(consecutive_hysteresis=True)
    assert _run(scaler, [O, C, O, O]) == [16, 16, 16, 8]


def test_static_scale_never_changes_but_counts_skips():
    scaler = LossScaler(ZeroConfig(loss_scale=128.0).precision_policy)
    assert _run(scaler, [O, O, O, C, C, C, C, C, C]) == [128.0] * 9
    assert scaler.skipped_steps == 3


def test_overflows_at_min_scale_raise_on_the_limit_and_leave_state_unchanged():
    scaler = LossScaler(
        ZeroConfig(
            initial_scale_power=1, hysteresis=1, min_loss_scale=1.0, max_consecutive_min_scale_skips=3
        ).precision_policy
    )
    assert _run(scaler, [O, O, O]) == [1, 1, 1]  # 2 -> 1, then two overflows at the minimum
    before = scaler.state_dict()
    with pytest.raises(RuntimeError, match="min_loss_scale"):
        scaler.update(O)
    assert scaler.state_dict() == before


def test_clean_step_resets_the_min_scale_overflow_count():
    scaler = LossScaler(
        ZeroConfig(
            initial_scale_power=1, hysteresis=1, min_loss_scale=1.0, max_consecutive_min_scale_skips=3
        ).precision_policy
    )
    _run(scaler, [O, O, O, C, O, O])
    with pytest.raises(RuntimeError):
        scaler.update(O)


def test_state_dict_round_trip_continues_the_identical_sequence():
    split = 9  # after iter 8: hysteresis spent and an overflow recorded, neither visible in the scale
    original = _scaler()
    _run(original, SCRIPT[:split])
    resumed = _scaler()
    resumed.load_state_dict(original.state_dict())
    assert _run(resumed, SCRIPT[split:]) == EXPECTED_SCALES[split:]
    assert resumed.skipped_steps == original.skipped_steps + SCRIPT[split:].count(O)


def test_load_state_dict_rejects_missing_counters():
    state = _scaler().state_dict()
    del state["cur_hysteresis"]
    with pytest.raises(KeyError, match="cur_hysteresis"):
        _scaler().load_state_dict(state)


def test_scaler_reads_the_config_fields_and_their_defaults():
    scaler = LossScaler(ZeroConfig(loss_scale=0.0, initial_scale_power=4, hysteresis=2).precision_policy)
    assert scaler.scale == 16
    assert scaler.loss_scale_window == 1000


def test_invalid_argument_is_named_in_the_error():
    with pytest.raises(ValueError, match="loss_scale_window=0"):
        LossScaler(ZeroConfig(loss_scale_window=0).precision_policy)
