"""The processes of this machine as ``/proc`` shows them, to find what a test run started and left running.

A process keeps the environment it was started with whatever happens to its parent, so a variable set once at the
start of a run and inherited by every process the run starts finds them all afterwards, including those re-parented
to init when their parent died (``.ci/run`` and ``process_guard.py`` rely on it). A process group finds what one rank
started (``distributed.run_ranks``). Linux only: elsewhere every query answers "nothing", and the checks built on
them check nothing.

Also a script, for ``.ci/run``: ``python tests/support/process_tree.py VARIABLE [GRACE_S]`` gives every other process
whose environment has ``VARIABLE`` set to the value this one has ``GRACE_S`` (default ``EXIT_GRACE_S``) to end, then
lists and kills those still running, and exits 1 when there were any.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_POLL_S = 0.2
# How long a process found running may take to end by itself before it counts as left behind: an interpreter's
# exit (atexit handlers, a worker noticing its parent is gone) takes seconds on a loaded machine.
EXIT_GRACE_S = 20.0


@dataclass(frozen=True)
class Process:
    pid: int
    ppid: int
    pgid: int

    @property
    def command(self) -> str:
        command = _read(self.pid, "cmdline")
        return command.replace(b"\0", b" ").decode(errors="replace").strip() if command else "(ended)"

    def __str__(self) -> str:
        return f"pid {self.pid} (parent {self.ppid}): {self.command}"


def _read(pid: int, name: str) -> bytes | None:
    """``/proc/PID/NAME``, or ``None`` when the process is gone or not ours to read. (This runs after every test:
    plain reads, several times cheaper than ``pathlib``'s.)"""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as file:
            return file.read()
    except OSError:
        return None


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:  # no /proc: not Linux
        return []


def process(pid: int) -> Process | None:
    """The live process ``pid`` (a zombie has ended), or ``None``."""
    stat = _read(pid, "stat")
    if stat is None:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its last ")"
    state, ppid, pgid = stat[stat.rindex(b")") + 2 :].split()[:3]
    return None if state in (b"Z", b"X") else Process(pid, int(ppid), int(pgid))


def snapshot() -> list[Process]:
    """Every live process."""
    return [found for found in map(process, _pids()) if found is not None]


def carrying(variable: str, value: str) -> list[Process]:
    """The live processes started with ``variable=value`` in their environment (only our user's are readable)."""
    wanted = f"{variable}={value}".encode()
    found = []
    for pid in _pids():
        environment = _read(pid, "environ")
        if environment and wanted in environment.split(b"\0") and (alive := process(pid)) is not None:
            found.append(alive)
    return found


def is_below(found: Process, ancestor: int) -> bool:
    """Whether ``ancestor`` is ``found`` or one of its ancestors (a process re-parented to init no longer is)."""
    pid, seen = found.pid, set()
    while pid > 1 and pid not in seen:
        if pid == ancestor:
            return True
        seen.add(pid)
        parent = process(pid)
        pid = parent.ppid if parent is not None else 0
    return False


def in_groups(pgids: Iterable[int], processes: Iterable[Process]) -> list[Process]:
    wanted = set(pgids)
    return [found for found in processes if found.pgid in wanted]


def descendants(pid: int, processes: Iterable[Process]) -> set[int]:
    """``pid`` and every process below it (a process re-parented to init is no longer below anyone)."""
    children: dict[int, list[int]] = {}
    for found in processes:
        children.setdefault(found.ppid, []).append(found.pid)
    below, frontier = {pid}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in below:
                below.add(child)
                frontier.append(child)
    return below


def still_running(find: Callable[[], list[Process]], grace_s: float = EXIT_GRACE_S) -> list[Process]:
    """What ``find`` still answers after giving it ``grace_s`` seconds to become empty (at once when it is)."""
    give_up = time.monotonic() + grace_s
    found = find()
    while found and time.monotonic() < give_up:
        time.sleep(_POLL_S)
        found = find()
    return found


def kill(processes: Iterable[Process]) -> str:
    """Kill them, and return once they have ended (or after ``EXIT_GRACE_S``) what they were, one line each."""
    processes = list(processes)
    listing = "\n".join(f"  {found}" for found in processes)  # before they are gone with their command lines
    for found in processes:
        try:
            os.kill(found.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    still_running(lambda: [found for found in processes if process(found.pid) is not None])
    return listing


def main(variable: str, grace_s: str = str(EXIT_GRACE_S)) -> int:
    """Kill and list every other process started with this process's value of ``variable``; 1 if there were any."""
    value = os.environ.get(variable)
    if not value:
        print(f"process_tree.py: {variable} is not set, so nothing can be attributed to the run", file=sys.stderr)
        return 2

    def others() -> list[Process]:
        return [found for found in carrying(variable, value) if found.pid != os.getpid()]

    left = still_running(others, float(grace_s))
    if not left:
        return 0
    print(
        f"{len(left)} process(es) started by this run ({variable}={value}) were still running after it ended "
        f"(killed now):\n{kill(left)}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
