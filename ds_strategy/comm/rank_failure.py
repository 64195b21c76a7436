"""Which rank failed first and why, kept in the job's c10d store, so that every other rank leaves its collectives
within seconds and says so, instead of waiting out ``collective_timeout``.

Note: [How a failed rank ends the job]
A rank leaves a job in the middle of a step in one of three ways; each is turned into a
:class:`~.peer_failures.PeerFailedError` on every other rank that names the rank and the cause:
  * it raises (an error in ``training_step``, ``torch.OutOfMemoryError``, ...). Before its process unwinds, the
    exception is written to the store as the job's first failure, from the Lightning strategy's ``on_exception``
    and, for every entry point (Fabric, accelerate, a plain loop), from ``sys.excepthook``. The record is one key
    set by ``compare_set``: the first writer wins, so the errors that follow from it on other ranks change nothing.
    A rank blocked in an engine collective waits in slices of ``POLL_S`` and reads the record between slices
    (:class:`~.collectives.PendingCollective`), so it raises within ``POLL_S`` of the record, even while the
    failed process is still alive (tearing down, or stuck in something else);
  * it dies without raising (SIGKILL, the kernel's OOM killer, a segfault). Its sockets close and gloo fails every
    wait on it at once ("Connection closed by peer"). There is no record, so the dead rank is found from the host
    and pid every rank registers here at start: a registered process on this host that is gone or a zombie. A
    dead rank on another host cannot be told from a live one this way and is reported as "another rank";
  * it hosted the store (rank 0, under ``env://`` and Lightning) and died: the store is unreachable, which names it.
A wait that times out with no record and no dead rank is a mismatch (``CollectiveMismatchError``), never a peer
failure, and one that saw a record or a dead rank is never called a mismatch. Costs: one store write per rank at
start, at most one store read per ``POLL_S`` per process while a wait is blocked longer than that
(``FailureBoard.recorded_failure``), nothing while collectives complete in time. The slices apply to gloo only: an
NCCL wait orders streams and never blocks the host, and NCCL's own watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) ends
a job whose peer died or whose collective outlived the process group's timeout (Note: [What a wait guarantees on each
backend] in :mod:`.collectives`). Collectives not issued through ``Collectives`` (Lightning's barriers, DCP during a
save) are not sliced: on gloo they fail on a closed connection, and the error they raise is read against this board
where ds_strategy hands control to the library (Note: [Collectives a library issues] in :mod:`.peer_failures`).

The bound, then: a surviving rank leaves its engine collective within ``POLL_S`` (1 s) of a failure record and at
once on a dead peer, whatever ``collective_timeout`` is, and prints the diagnosis to stderr as it raises (Lightning's
``devices=N`` launcher SIGKILLs the remaining ranks within 5 s of seeing a child exit non-zero, possibly before a
traceback prints). Measured on 2 loaded CPU cores (``tests/e2e/test_rank_failure.py``, collective_timeout 300 s):
1.0 s after a raise or ``torch.OutOfMemoryError``, 0.1 s after a SIGKILL; the whole job is gone 7-12 s after the
failure, the time the processes take to tear down and finalize the interpreter on that machine.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import weakref
from dataclasses import dataclass

import torch.distributed as dist

POLL_S = 1.0  # how often a blocked gloo wait reads the failure record
_PREFIX = "ds_strategy/rank_failure"
_FIRST = f"{_PREFIX}/first"
_LEFT = "exited with status 0"
_UNKNOWN_DEATH = "no failure record: killed (SIGKILL, the OOM killer), crashed, or gone before its status was read"
_BOARD: list = []  # [(weak reference to the default group, its FailureBoard)] once made


@dataclass(frozen=True)
class Failure:
    """The first failure of the job: which rank, and its exception as ``Type: message``."""

    rank: int
    error: str
    at: float  # time.time() on the failed rank

    def describe(self) -> str:
        return f"rank {self.rank} failed first with {self.error}"

    def encode(self) -> str:
        return f"{self.rank}\n{self.at!r}\n{self.error}"

    @classmethod
    def decode(cls, text: str) -> Failure:
        rank, at, error = text.split("\n", 2)
        return cls(int(rank), error, float(at))


class FailureBoard:
    """The job's first-failure record and every rank's (host, pid), in the default process group's store."""

    def __init__(self, store, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._recorded: Failure | None = None
        self._read_at = -float("inf")  # time.monotonic() of the last read by recorded_failure
        self._try(lambda: store.set(f"{_PREFIX}/process/{rank}", f"{socket.gethostname()} {os.getpid()}"))

    def _try(self, operation, default=None):
        """A store operation, or ``default`` when the store is unreachable (its host died)."""
        try:
            return operation()
        except Exception:  # noqa: BLE001 - any store error means the same: no answer
            return default

    def report(self, error: BaseException) -> bool:
        """Record ``error`` as this rank's failure unless another was recorded first; True when this one was."""
        mine = Failure(self.rank, summarize(error), time.time()).encode()
        return self._try(lambda: self.store.compare_set(_FIRST, "", mine), b"").decode(errors="replace") == mine

    def first(self) -> Failure | None:
        """The recorded first failure, if any (one non-blocking store read)."""
        if not self._try(lambda: self.store.check([_FIRST]), False):
            return None
        text = self._try(lambda: self.store.get(_FIRST).decode(errors="replace"))
        return Failure.decode(text) if text else None

    def recorded_failure(self) -> Failure | None:
        """The first failure as last read from the store, which is read again only when the last read is at least
        ``POLL_S`` old (less a tenth, the slack of a slice's timer), however many waits ask: the record, once
        written, never changes."""
        now = time.monotonic()
        if self._recorded is None and now - self._read_at >= 0.9 * POLL_S:
            self._read_at = now
            self._recorded = self.first()
        return self._recorded

    def store_reachable(self) -> bool:
        return self._try(lambda: self.store.check([f"{_PREFIX}/process/{self.rank}"]), False)

    def dead_ranks(self) -> dict[int, str | None]:
        """Registered ranks on this host whose process is gone or a zombie (killed, and not yet reaped), each with
        how it ended when its zombie still shows it ("killed by SIGKILL", "exited with status 1"), else None."""
        here, dead = socket.gethostname(), {}
        for rank in range(self.world_size):
            key = f"{_PREFIX}/process/{rank}"
            # check first: get() blocks for the store's timeout on a key a rank never wrote
            known = rank != self.rank and self._try(lambda: self.store.check([key]), False)
            entry = self._try(lambda: self.store.get(key).decode()) if known else None
            host, _, pid = (entry or "").partition(" ")
            if host == here and pid and not _process_alive(int(pid)):
                dead[rank] = _how_it_ended(int(pid))
        return dead

    def diagnose(self) -> str | None:
        """Why a peer is gone, naming it, or None when nothing shows that any peer failed."""
        failure = self.first()
        if failure is not None and failure.rank != self.rank:
            return failure.describe()
        dead = self.dead_ranks()
        if dead:
            ranks = ", ".join(map(str, dead))
            hows = sorted({how for how in dead.values() if how is not None})
            if hows == [_LEFT]:
                return f"rank {ranks} left the job: it {_LEFT} while this rank waited on it (no failure record)"
            how = f"{', '.join(hows)}, no failure record" if hows else _UNKNOWN_DEATH
            return f"rank {ranks} died without raising ({how})"
        if not self.store_reachable():
            return "rank 0 died: the job's store, which it hosts, is unreachable"
        return None


def board() -> FailureBoard | None:
    """The failure board of the current default process group (made on first use), or None without one."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    world = dist.group.WORLD
    if not _BOARD or _BOARD[0][0]() is not world:  # a weak reference: the board must not keep the group alive
        _BOARD[:] = [
            (
                weakref.ref(world),
                FailureBoard(dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()),
            )
        ]
        _report_uncaught_exceptions()
    return _BOARD[0][1]


def report_failure(error: BaseException) -> None:
    """Record ``error`` as this rank's failure, unless it is an exit or the consequence of another rank's failure:
    a :class:`~.peer_failures.PeerFailedError`, or a library's raw transport error that the board reads as one
    (which is then announced instead; Note: [Collectives a library issues])."""
    from .peer_failures import is_consequence

    if isinstance(error, SystemExit) or is_consequence(error):
        return
    found = board()
    if found is not None:
        found.report(error)


def summarize(error: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def _how_it_ended(pid: int) -> str | None:
    """How the zombie ``pid`` ended, from its wait status in ``/proc/PID/stat`` (field 52, Linux 3.5 on), or None
    once its parent has reaped it (the status is then the parent's alone) or elsewhere than Linux."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        status = int(fields[49])  # fields[0] is field 3, the state
    except (OSError, IndexError, ValueError):
        return None
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(number).name}"
        except ValueError:
            return f"killed by signal {number}"
    return f"exited with status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else None


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (killed, not yet reaped by its parent) does not."""
    if os.path.exists("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_installed = False


def _report_uncaught_exceptions() -> None:
    """Wrap ``sys.excepthook`` (once per process) so that a rank's uncaught exception is recorded before it is
    printed and the process exits, whatever entry point ran it."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(kind, error, traceback):
        from .peer_failures import LIBRARY_COLLECTIVE, peer_failed_error

        report_failure(error)
        failed = peer_failed_error(error, LIBRARY_COLLECTIVE) if isinstance(error, Exception) else None
        if failed is not None:  # printed as our error, the library's chained: Note: [Collectives a library issues]
            failed.__cause__ = error
            kind, error, traceback = type(failed), failed, None
        previous(kind, error, traceback)

    sys.excepthook = hook
