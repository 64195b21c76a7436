"""DeepSpeed's LR schedules (``deepspeed/runtime/lr_schedules.py``) as torch LR schedulers, formula for formula.

Each schedule is a pure function of DeepSpeed's ``last_batch_iteration`` i (-1 before the first step) and the
param group's learning rate as the optimizer was built. ``DeepSpeedSchedule`` runs it as a torch
``LRScheduler``, whose own counter ``last_epoch`` is i + 1: torch steps once at construction, where DeepSpeed sets
the iteration -1 value, so after k ``step()`` calls both are at the value for i = k - 1. Every DeepSpeed schedule
also takes ``last_batch_iteration`` (default -1), the iteration it resumes from: the schedule then starts at that
iteration's value and its first ``step()`` moves to the next, as DeepSpeed's does. torch's own resume argument
(``last_epoch``) needs the optimizer's ``initial_lr`` from a loaded checkpoint; this one is an offset in ``get_lr``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

LrAt = Callable[[int, int, float], float]  # (iteration i, param group index, group's base lr) -> lr
MomentumAt = Callable[[int, int], tuple[float, float]]  # (iteration i, group index) -> Adam betas


def _per_group(value: Any, index: int) -> float:
    """DeepSpeed lets a value be one number or a list with one per param group."""
    return value[index] if isinstance(value, (list, tuple)) else value


def warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    """WarmupLR's fraction of the way from min to max lr: log(i + 1) / log(n) or i / n, then 1."""
    steps = max(2, warmup_num_steps)
    if i < 0:
        return 0.0
    if i >= steps:
        return 1.0
    return math.log(i + 1) / math.log(steps) if warmup_type == "log" else i / steps


def lr_range_test(
    lr_range_test_min_lr: float = 1e-3,
    lr_range_test_step_size: int = 2000,
    lr_range_test_step_rate: float = 1.0,
    lr_range_test_staircase: bool = False,
) -> LrAt:
    def lr_at(i: int, group: int, base_lr: float) -> float:
        interval = (i + 1) / lr_range_test_step_size
        interval = math.floor(interval) if lr_range_test_staircase else interval
        return _per_group(lr_range_test_min_lr, group) * (1 + lr_range_test_step_rate * interval)

    return lr_at


def warmup_lr(
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float | None = None,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> LrAt:
    """min + (max - min) x gamma; max defaults to the optimizer's lr."""

    def lr_at(i: int, group: int, base_lr: float) -> float:
        low = _per_group(warmup_min_lr, group)
        high = base_lr if warmup_max_lr is None else _per_group(warmup_max_lr, group)
        return low + (high - low) * warmup_gamma(i, warmup_num_steps, warmup_type)

    return lr_at


def warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> LrAt:
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    def lr_at(i: int, group: int, base_lr: float) -> float:
        low, high = _per_group(warmup_min_lr, group), _per_group(warmup_max_lr, group)
        steps = max(2, warmup_num_steps)
        if i < steps:
            gamma = warmup_gamma(i, warmup_num_steps, warmup_type)
        else:
            gamma = max(0.0, (total_num_steps - i) / max(1.0, total_num_steps - steps))
        return low + (high - low) * gamma

    return lr_at


def warmup_cosine_lr(
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> LrAt:
    """The optimizer's lr times a ratio: warmup from ``warmup_min_ratio`` to 1, then cosine to ``cos_min_ratio``."""

    def lr_at(i: int, group: int, base_lr: float) -> float:
        steps = max(2, warmup_num_steps)
        if i < 0:
            return 0.0
        if i < steps:
            return base_lr * (
                warmup_min_ratio + warmup_gamma(i, warmup_num_steps, warmup_type) * (1.0 - warmup_min_ratio)
            )
        progress = min(1.0, (i - steps + 1) / max(1, total_num_steps - steps))
        return base_lr * max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    return lr_at


def _one_cycle_scale(i: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    """OneCycle's position in its cycle: 0 -> 1 over the first half, 1 -> 0 over the second."""
    iteration, total = i + 1, first + second
    x = 1.0 + iteration / total - math.floor(1 + iteration / total)
    ratio = first / total
    scale, stairs = (x / ratio, first_stairs) if x <= ratio else ((x - 1) / (ratio - 1), second_stairs)
    if stairs > 0:
        in_cycle = iteration % total
        position = in_cycle * stairs / first if in_cycle <= first else (total - in_cycle) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def one_cycle(
    cycle_min_lr: float,
    cycle_max_lr: float,
    decay_lr_rate: float = 0.0,
    cycle_first_step_size: int = 2000,
    cycle_second_step_size: int | None = None,
    cycle_first_stair_count: int = 0,
    cycle_second_stair_count: int | None = None,
    decay_step_size: int = 0,
    cycle_momentum: bool = True,
    cycle_min_mom: float = 0.8,
    cycle_max_mom: float = 0.9,
    decay_mom_rate: float = 0.0,
) -> tuple[LrAt, MomentumAt | None]:
    """1Cycle: lr up and back down over one cycle (momentum inversely), then lr / (1 + rate x decay intervals)."""
    first = float(cycle_first_step_size)
    second = first if cycle_second_step_size is None else float(cycle_second_step_size)
    second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
    scale = functools.partial(
        _one_cycle_scale, first=first, second=second, first_stairs=cycle_first_stair_count, second_stairs=second_stairs
    )

    def decay_intervals(i: int) -> float:
        return (i - first - second + 1) / decay_step_size

    def lr_at(i: int, group: int, base_lr: float) -> float:
        low, high = _per_group(cycle_min_lr, group), _per_group(cycle_max_lr, group)
        if i < first + second:
            return low + (high - low) * scale(i)
        skip = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        return low if skip else low / (1 + decay_lr_rate * decay_intervals(i))

    def momentum_at(i: int, group: int) -> tuple[float, float]:
        low, high = _per_group(cycle_min_mom, group), _per_group(cycle_max_mom, group)
        if i < 0:  # DeepSpeed starts beta1 at the minimum and pins beta2 to 0.99
            return low, 0.99
        if i < first + second:
            return high - (high - low) * scale(i), 0.99
        skip = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        return (high if skip else high * (1 + decay_mom_rate * decay_intervals(i))), 0.99

    return lr_at, (momentum_at if cycle_momentum else None)


SCHEDULES: dict[str, Callable[..., Any]] = {
    "LRRangeTest": lr_range_test,
    "OneCycle": one_cycle,
    "WarmupLR": warmup_lr,
    "WarmupDecayLR": warmup_decay_lr,
    "WarmupCosineLR": warmup_cosine_lr,
}


class DeepSpeedSchedule(LRScheduler):
    """A DeepSpeed schedule stepping a torch optimizer once per optimizer step (Lightning's ``interval="step"``)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_at: LrAt,
        momentum_at: MomentumAt | None = None,
        last_batch_iteration: int = -1,
    ):
        if (
            not isinstance(last_batch_iteration, int)
            or isinstance(last_batch_iteration, bool)
            or last_batch_iteration < -1
        ):
            raise ValueError(
                f"DeepSpeed scheduler.params.last_batch_iteration={last_batch_iteration!r} is not allowed; expected "
                f"an integer >= -1 (-1: start from the beginning)"
            )
        self.first_iteration = last_batch_iteration  # DeepSpeed's i at construction (torch's last_epoch is 0)
        self.lr_at = lr_at
        # DeepSpeed leaves momentum alone for optimizers without Adam-style betas.
        self.momentum_at = momentum_at if "betas" in optimizer.defaults else None
        super().__init__(optimizer)

    def iteration(self) -> int:
        """DeepSpeed's ``last_batch_iteration``: -1 (or the one resumed from) at construction, +1 per step."""
        return self.first_iteration + self.last_epoch

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.iteration(), index, base) for index, base in enumerate(self.base_lrs)]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.momentum_at is not None:
            for index, group in enumerate(self.optimizer.param_groups):
                group["betas"] = self.momentum_at(self.iteration(), index)

    def state_dict(self) -> dict[str, Any]:
        """torch's state without the formula closures, which the config rebuilds."""
        return {key: value for key, value in super().state_dict().items() if key not in ("lr_at", "momentum_at")}


# Each schedule under DeepSpeed's class name (``deepspeed.runtime.lr_schedules.WarmupLR`` ...), which code written for
# DeepSpeed checks (``type(scheduler).__name__ == "WarmupLR"``, Lightning's DeepSpeed tests).
class LRRangeTest(DeepSpeedSchedule):
    """DeepSpeed's LRRangeTest."""


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's OneCycle."""


class WarmupLR(DeepSpeedSchedule):
    """DeepSpeed's WarmupLR."""


class WarmupDecayLR(DeepSpeedSchedule):
    """DeepSpeed's WarmupDecayLR."""


class WarmupCosineLR(DeepSpeedSchedule):
    """DeepSpeed's WarmupCosineLR."""


SCHEDULE_CLASSES: dict[str, type[DeepSpeedSchedule]] = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def schedule_parameters(name: str) -> Sequence[str]:
    """The ``scheduler.params`` keys DeepSpeed's ``name`` schedule takes: its formula's, and where it resumes."""
    return [*inspect.signature(SCHEDULES[name]).parameters, "last_batch_iteration"]


def build_schedule(optimizer: torch.optim.Optimizer, name: str, params: dict[str, Any]) -> DeepSpeedSchedule:
    params = dict(params)
    last_batch_iteration = params.pop("last_batch_iteration", -1)
    made = SCHEDULES[name](**params)
    lr_at, momentum_at = made if isinstance(made, tuple) else (made, None)
    return SCHEDULE_CLASSES[name](optimizer, lr_at, momentum_at, last_batch_iteration)
