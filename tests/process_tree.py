"""The processes of this machine as ``/proc`` shows them, to find what a test run started and left running.

A process keeps the environment it was started with whatever happens to its parent, so a variable set once at the
start of a run and inherited by every process the run starts finds them all afterwards, including those re-parented
to init when their parent died (``.ci/run`` and ``process_guard.py`` rely on it). A process group finds what one rank
started (``distributed.run_ranks``). Linux only: elsewhere every query answers "nothing", and the checks built on
them check nothing.

Also a script, for ``.ci/run``: ``python tests/process_tree.py VARIABLE [GRACE_S]`` gives every other process whose
environment has ``VARIABLE`` set to the value this one has ``GRACE_S`` (default ``EXIT_GRACE_S``) to end, then lists
and kills those still running, and exits 1 when there were any.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_POLL_S = 0.2
# How long a process found running may take to end by itself before it counts as left behind: an interpreter's
# exit (atexit handlers, a worker noticing its parent is gone) takes seconds on a loaded machine.
EXIT_GRACE_S = 20.0


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    pgid: int
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}): {self.command}"


def snapshot() -> list[Process]:
    """Every live process (zombies, which have ended, are left out)."""
    found = []
    for entry in _PROC.glob("[0-9]*") if _PROC.is_dir() else ():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it ended while we looked
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its last ")"
        state, ppid, pgid = stat[stat.rindex(")") + 2 :].split()[:3]
        if state not in ("Z", "X"):
            found.append(Process(int(entry.name), int(ppid), int(pgid), command or f"[{stat.split()[1]}]"))
    return found


def carrying(variable: str, value: str, processes: Iterable[Process]) -> list[Process]:
    """The processes started with ``variable=value`` in their environment (only our own user's are readable)."""
    wanted = f"{variable}={value}".encode()
    found = []
    for process in processes:
        try:
            environment = (_PROC / str(process.pid) / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environment.split(b"\0"):
            found.append(process)
    return found


def in_groups(pgids: Iterable[int], processes: Iterable[Process]) -> list[Process]:
    wanted = set(pgids)
    return [process for process in processes if process.pgid in wanted]


def descendants(pid: int, processes: Iterable[Process]) -> set[int]:
    """``pid`` and every process below it (a process re-parented to init is no longer below anyone)."""
    children: dict[int, list[int]] = {}
    for process in processes:
        children.setdefault(process.ppid, []).append(process.pid)
    found, frontier = {pid}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def still_running(find: Callable[[], list[Process]], grace_s: float = EXIT_GRACE_S) -> list[Process]:
    """What ``find`` still answers after giving it ``grace_s`` seconds to become empty (at once when it is)."""
    give_up = time.monotonic() + grace_s
    found = find()
    while found and time.monotonic() < give_up:
        time.sleep(_POLL_S)
        found = find()
    return found


def kill(processes: Iterable[Process]) -> None:
    for process in processes:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def describe(processes: Iterable[Process]) -> str:
    return "\n".join(f"  {process}" for process in processes)


def main(variable: str, grace_s: str = str(EXIT_GRACE_S)) -> int:
    """Kill and list every other process started with this process's value of ``variable``; 1 if there were any."""
    value = os.environ.get(variable)
    if not value:
        print(f"process_tree.py: {variable} is not set, so nothing can be attributed to the run", file=sys.stderr)
        return 2

    def others() -> list[Process]:
        return [process for process in carrying(variable, value, snapshot()) if process.pid != os.getpid()]

    left = still_running(others, float(grace_s))
    if not left:
        return 0
    kill(left)
    print(
        f"{len(left)} process(es) started by this run ({variable}={value}) were still running after it ended "
        f"(killed now):\n{describe(left)}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
