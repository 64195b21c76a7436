"""Per-step agreement on the sequence of collectives, so a rank that skipped a unit is reported, not hung.

Note: [How a mismatched sequence is caught]
Ranks pair collectives by the order they issue them, not by what
they are, so a rank that skips a unit (one fewer forward call, a backward that never reaches a unit) shifts
every later pairing. Three things can follow, and each ends in :class:`~.collectives.CollectiveMismatchError`
within ``collective_timeout`` on every rank, except as noted for gloo:
  * a wait never completes (the other rank is waiting for a different collective): ``PendingCollective.wait``
    times out and raises, naming the collective and its unit;
  * the backend rejects the pairing: the same wait raises at once. Gloo, when a message arrives larger than
    the buffer it was paired with, aborts the receiving process from its transport thread instead
    (``gloo::EnforceNotMet ... Is there a distributed collective mismatch in your code?``), before Python
    can name anything; the other ranks then get the error from their next wait;
  * the pairing goes through silently (same sizes: two equal blocks swapped), or one rank finishes the step
    with fewer collectives than the other: only a comparison can tell. Before every optimizer step each rank
    all-gathers (count, CRC-32 of the kinds, sizes and labels) of the collectives it issued since the last
    check, over a dedicated process group whose own sequence cannot be shifted by the engine's. Any difference
    raises on every rank, naming the first collective where the logs differ on each rank; a rank stuck in a
    collective, or gone after raising, makes the others' check time out, and that error names this rank's last
    collectives.
The check costs one all-gather of two int64 per rank per optimizer step and a CRC of a short string per
collective; the per-step log keeps at most ``MAX_LOGGED`` labels. After the error the process groups are out of
step and cannot be used again. A gloo worker thread stuck in an unmatched collective stays blocked for the
process group's own ``timeout`` (30 minutes by default), and ``destroy_process_group`` waits for it.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .collectives import CollectiveMismatchError, Collectives
from .process_exit import destroy_process_groups_at_exit
from .subgroups import group_partition, new_groups_everywhere

MAX_LOGGED = 4096
_MONITOR_GROUPS: dict[tuple, tuple[object, object]] = {}  # partition -> (default group, this rank's monitor group)


def _monitor_group(group):
    """A gloo group over the ranks of ``group`` used only for the check, one per partition of the ranks while the
    default group lives. Like every ``new_group``, its first creation happens on every rank of the default group,
    for every rank's group alike (Note: [Creating groups inside a sub-group]): engines are built on every rank.
    """
    partition = tuple(group_partition(group))
    world, monitor = _MONITOR_GROUPS.get(partition, (None, None))
    if world is not dist.group.WORLD:
        monitor = new_groups_everywhere(list(partition), backend="gloo")
        _MONITOR_GROUPS[partition] = (dist.group.WORLD, monitor)
        destroy_process_groups_at_exit(_MONITOR_GROUPS.clear)  # [Why every process group is destroyed at exit]
    return monitor


class CollectiveSequenceCheck:
    """Logs the collectives issued through ``sources`` and compares the log across ranks on :meth:`verify`."""

    def __init__(self, sources: list[Collectives]):
        primary = sources[0]
        self.collectives = Collectives(_monitor_group(primary.group), timeout=primary.timeout)
        self.rank = primary.rank
        self.checks = 0
        self._reset()
        self._sources = sources
        for source in sources:
            source.observers.append(self._observe)

    def close(self) -> None:
        """Stop observing the sources, which may outlive this check (a mesh's collectives outlive an engine)."""
        for source in self._sources:
            source.observers.remove(self._observe)
        self._sources = []

    def _reset(self) -> None:
        self.count = 0
        self.digest = 0
        self.log: list[str] = []

    def _observe(self, event: str, kind: str, label: str, nbytes: int) -> None:
        if event != "launch":
            return
        entry = f"{kind} of {nbytes} B for {label or 'an unlabelled buffer'}"
        self.count += 1
        self.digest = zlib.crc32(entry.encode(), self.digest)
        if len(self.log) < MAX_LOGGED:
            self.log.append(entry)

    def verify(self) -> None:
        """Raise CollectiveMismatchError on every rank unless all ranks issued the same collectives since the
        last call."""
        self.checks += 1
        world = self.collectives.world_size
        mine = torch.tensor([self.count, self.digest], dtype=torch.int64)
        everyone = torch.empty(world * 2, dtype=torch.int64)
        try:
            self.collectives.all_gather(everyone, mine, label=f"collective sequence check #{self.checks}").wait()
        except CollectiveMismatchError as error:
            raise CollectiveMismatchError(
                f"rank {self.rank}: the check of collective sequences before optimizer step #{self.checks} did "
                f"not complete: another rank is stuck in a collective or has failed (its own error names it). "
                f"This rank issued {self.count} collectives since the last step, the last ones: "
                f"{'; '.join(self.log[-3:]) or 'none'}"
            ) from error
        rows = everyone.view(world, 2).tolist()
        if all(row == rows[0] for row in rows):
            self._reset()
            return
        logs: list = [None] * world
        dist.all_gather_object(logs, self.log, group=self.collectives.group)
        raise CollectiveMismatchError(self._describe(rows, logs))

    def _describe(self, rows: list[list[int]], logs: list[list[str]]) -> str:
        index = next(
            (i for i in range(max(map(len, logs))) if len({log[i] if i < len(log) else None for log in logs}) > 1), None
        )
        counts = ", ".join(f"rank {r}: {row[0]}" for r, row in enumerate(rows))
        where = (
            ""
            if index is None
            else f" First difference at collective #{index + 1}: "
            + "; ".join(
                f"rank {r} issued {log[index] if index < len(log) else 'nothing'}" for r, log in enumerate(logs)
            )
            + "."
        )
        return (
            f"rank {self.rank}: the ranks issued different collectives before optimizer step #{self.checks} "
            f"({counts} collectives).{where} Every rank must run the same units, forward and backward, the "
            f"same number of times and in the same order (under ZeRO-3, run the same forward calls on every "
            f"rank, e.g. keep generating dummy tokens until all ranks finish)."
        )
