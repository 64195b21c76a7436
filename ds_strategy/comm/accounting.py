"""Communication statistics across process groups, and their per-step deltas for a training logger."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .collectives import KINDS, CommStats

StatsDict = dict[str, dict[str, float]]


def combined(stats: Iterable[CommStats]) -> StatsDict:
    """``{kind: {"calls", "bytes", "wait_seconds"}}`` summed over several groups' counters."""
    total = {kind: {"calls": 0, "bytes": 0, "wait_seconds": 0.0} for kind in KINDS}
    for one in stats:
        for kind, values in one.as_dict().items():
            for key, value in values.items():
                total[kind][key] += value
    return total


class StepCommMeter:
    """What ``read()`` (a running :data:`StatsDict`) grew by since the previous :meth:`step_metrics` call.

    Metrics, flat for a logger: ``comm/bytes`` and ``comm/wait_seconds`` over all kinds, and
    ``comm/<kind>_bytes`` for each kind that moved bytes in the step.
    """

    def __init__(self, read: Callable[[], StatsDict], prefix: str = "comm/"):
        self._read = read
        self._prefix = prefix
        self._last = read()

    def step_metrics(self) -> dict[str, float]:
        now = self._read()
        metrics = {f"{self._prefix}bytes": 0.0, f"{self._prefix}wait_seconds": 0.0}
        for kind, values in now.items():
            last = self._last[kind] if values["calls"] >= self._last[kind]["calls"] else dict.fromkeys(values, 0)
            moved = values["bytes"] - last["bytes"]  # (counters reset since: count from zero)
            metrics[f"{self._prefix}bytes"] += moved
            metrics[f"{self._prefix}wait_seconds"] += values["wait_seconds"] - last["wait_seconds"]
            if moved:
                metrics[f"{self._prefix}{kind}_bytes"] = float(moved)
        self._last = now
        return metrics
