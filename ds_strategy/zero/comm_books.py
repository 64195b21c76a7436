"""The engine's books of its communication: the groups whose traffic ``comm_stats`` counts, the per-step sequence
check over them, and what the last optimizer step's iteration issued.

One job, taken out of :class:`~.engine.ZeroEngine`, which forwards ``comm_stats`` here.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm.accounting import combined
from ..comm.collectives import Collectives
from ..comm.sequence_check import CollectiveSequenceCheck


class CommBooks:
    """``groups``: name -> collectives, in the order they were added ("world" first); "monitor" (the sequence check's
    own all-gather) is kept apart from the sum."""

    def __init__(self, world: Collectives):
        self.groups: dict[str, Collectives] = {"world": world}
        self.sequence_check: CollectiveSequenceCheck | None = None
        self._at_step: dict[str, dict[str, dict[str, float]]] = {}
        self._last_step: dict[str, dict] = {}

    def add(self, name: str, collectives: Collectives | None) -> None:
        """Count ``collectives`` as group ``name`` (None: nothing to count)."""
        if collectives is not None:
            self.groups[name] = collectives

    def start_sequence_check(self, unchecked: dict[str, Collectives]) -> None:
        """The per-step comparison of the collectives each rank issued over the groups added so far
        (``ds_strategy.comm.sequence_check``): after construction's broadcasts, which it must not compare. Then
        ``unchecked`` are counted too, left out of the check (groups whose sizes differ by rank), and the first
        step's books open."""
        if dist.is_initialized() and self.groups["world"].world_size > 1:
            self.sequence_check = CollectiveSequenceCheck(list(self.groups.values()))
            self.groups["monitor"] = self.sequence_check.collectives
        self.groups.update(unchecked)
        self._at_step = self._now()

    def stats(self, group: str | None = None, last_step: bool = False) -> dict[str, dict[str, float]]:
        """See :meth:`.engine.ZeroEngine.comm_stats`."""
        if last_step:
            return self._last_step.get(group or "", {})
        if group is not None:
            return self.groups[group].stats.as_dict()
        return combined(c.stats for name, c in self.groups.items() if name != "monitor")

    def _now(self) -> dict[str, dict[str, dict[str, float]]]:
        """``stats`` summed ("") and per group."""
        return {"": self.stats(), **{name: self.stats(name) for name in self.groups}}

    def count_step(self) -> None:
        """What the step that is ending issued, for ``stats(last_step=True)``."""
        now, before = self._now(), self._at_step
        self._last_step = {
            name: {
                kind: {key: value - before[name][kind][key] if name in before else value for key, value in v.items()}
                for kind, v in stats.items()
            }
            for name, stats in now.items()
        }
        self._at_step = now

    def close(self) -> None:
        if self.sequence_check is not None:
            self.sequence_check.close()
