"""Loss scaling for fp16 training, following DeepSpeed's ``DynamicLossScaler`` schedule step for step.

Note: [What the loss scaler does on overflow]
fp16 gradients underflow unless the loss is multiplied by a large scale before backward; too large a scale
makes some gradient inf/nan instead. Each optimizer step, every rank unscales its gradient shard and checks
it (``ds_strategy.kernels.unscale_and_check``); the engine sums ``found_inf`` over ranks, in the same
all-reduce as the squared norm (``grad_stats.py``), so that all ranks agree, then calls
``LossScaler.update(found_inf)`` exactly once (``ZeroEngine.step``). On an overflow the engine skips the step on
every rank: the optimizer is not stepped, the gradients are discarded (zeroed), and parameters and optimizer
state stay as they were; the scaler counts the skip and then either spends one unit of hysteresis (the scale
is kept, tolerating isolated spikes) or, with no hysteresis left, halves the scale (never below
``min_loss_scale``). After ``loss_scale_window`` clean steps since the last overflow the scale doubles and
the hysteresis is refilled. Because every rank feeds ``update`` the same agreed flag, the scalers on all
ranks stay identical without communicating.

This follows DeepSpeed's ``deepspeed/runtime/fp16/loss_scaler.py::DynamicLossScaler.update_scale`` exactly,
including two details that are easy to get wrong:
  * with ``consecutive_hysteresis=False`` (DeepSpeed's default) a clean step does NOT refill the
    hysteresis; only a scale increase does. Two overflows separated by clean steps therefore still halve.
  * the scale grows when ``stable = cur_iter - last_overflow_iter - 1`` is positive and a multiple of the
    window, i.e. on the (window + 1)-th consecutive clean step after an overflow (or after the start, where
    ``last_overflow_iter = -1``), and every ``window`` clean steps after that.
Where we differ: DeepSpeed raises as soon as it would halve a scale already at the minimum. We instead count
consecutive overflows that happen with the scale at ``min_loss_scale`` and raise ``RuntimeError`` on the
``max_consecutive_min_scale_skips``-th, so a short burst of bad batches at the floor does not end the run.
The raising call leaves the state unchanged.

With a static ``loss_scale > 0`` the scale never changes; ``update`` only counts steps and skips.
"""

import dataclasses
from typing import Any

from ..config.policies import PrecisionPolicy


@dataclasses.dataclass
class _ScalerState:
    """Everything ``update`` changes; saved whole so a resumed run repeats the exact scale sequence."""

    cur_scale: float
    cur_iter: int = 0
    last_overflow_iter: int = -1
    cur_hysteresis: int = 1
    skipped_steps: int = 0
    consecutive_min_scale_skips: int = 0


class LossScaler:
    """Static or dynamic (DeepSpeed-schedule) loss scale for fp16 training, with ``policy``'s loss-scaling fields.

    ``loss_scale`` > 0 is a fixed scale, 0 selects dynamic scaling starting at ``2**initial_scale_power``; the
    other fields are described in :class:`~ds_strategy.config.ZeroConfig`, which defaults and validates them
    (so this class does neither).
    """

    def __init__(self, policy: PrecisionPolicy):
        self.dynamic = policy.loss_scale == 0
        self.loss_scale_window = policy.loss_scale_window
        self.hysteresis = policy.hysteresis
        self.consecutive_hysteresis = policy.consecutive_hysteresis
        self.min_loss_scale = policy.min_loss_scale
        self.max_consecutive_min_scale_skips = policy.max_consecutive_min_scale_skips
        initial_scale = 2.0**policy.initial_scale_power if self.dynamic else policy.loss_scale
        self._state = _ScalerState(cur_scale=initial_scale, cur_hysteresis=self.hysteresis)

    @property
    def scale(self) -> float:
        """The factor to multiply the next loss by."""
        return self._state.cur_scale

    @property
    def inv_scale(self) -> float:
        """The factor to multiply the next gradients by to unscale them."""
        return 1.0 / self._state.cur_scale

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for overflow since training began."""
        return self._state.skipped_steps

    def update(self, overflow: bool) -> None:
        """Record one optimizer step whose gradients did (``True``) or did not overflow on any rank."""
        overflow = bool(overflow)
        if self.dynamic and overflow:
            self._on_overflow()
        elif self.dynamic:
            self._on_clean_step()
        self._state.skipped_steps += int(overflow)
        self._state.cur_iter += 1

    def _on_overflow(self) -> None:
        """Spend hysteresis or halve the scale; abort after too many overflows at the minimum."""
        state = self._state
        at_min_scale = state.cur_scale <= self.min_loss_scale
        if at_min_scale and state.consecutive_min_scale_skips + 1 >= self.max_consecutive_min_scale_skips:
            raise RuntimeError(
                f"fp16 gradients overflowed on {self.max_consecutive_min_scale_skips} consecutive steps with the "
                f"loss scale already at min_loss_scale={self.min_loss_scale}; training cannot make progress. "
                "Look for inf/nan in the loss or data, lower min_loss_scale, or train in bf16."
            )
        state.consecutive_min_scale_skips = state.consecutive_min_scale_skips + 1 if at_min_scale else 0
        if state.cur_hysteresis <= 1:
            state.cur_scale = max(state.cur_scale / 2, self.min_loss_scale)
        else:
            state.cur_hysteresis -= 1
        state.last_overflow_iter = state.cur_iter

    def _on_clean_step(self) -> None:
        """Refill hysteresis if asked; double the scale every ``loss_scale_window`` stable steps."""
        state = self._state
        state.consecutive_min_scale_skips = 0
        if self.consecutive_hysteresis:
            state.cur_hysteresis = self.hysteresis
        stable_steps = state.cur_iter - state.last_overflow_iter - 1
        if stable_steps > 0 and stable_steps % self.loss_scale_window == 0:
            state.cur_hysteresis = self.hysteresis
            state.cur_scale *= 2

    def state_dict(self) -> dict[str, Any]:
        """The scale and every counter, for checkpoints."""
        return dataclasses.asdict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved; the constructor arguments must match the saving run's."""
        expected = {field.name for field in dataclasses.fields(_ScalerState)}
        if set(state_dict) != expected:
            raise KeyError(f"loss scaler state_dict has keys {sorted(state_dict)}, expected {sorted(expected)}")
        self._state = _ScalerState(**state_dict)
