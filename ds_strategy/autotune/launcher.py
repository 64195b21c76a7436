"""Run a function on N fresh local processes, one per rank, and collect what each returns or why it did not.

Each rank is a new ``spawn``-ed interpreter with the torch.distributed environment variables set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the function can call
``dist.init_process_group("gloo")`` itself or hand the ranks to Lightning, which then treats them as launched
externally. Nothing that goes wrong on a rank (an exception, a hard crash, a hang) escapes: the outcome says
what happened, and every process is gone when :func:`launch_ranks` returns.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

_POLL_S = 0.2
_LOG_TAIL_CHARS = 2000


@dataclasses.dataclass
class RanksOutcome:
    """What a launch produced: every rank's return value, or the first reason it failed."""

    values: list[Any] | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


def free_port() -> int:
    """A TCP port on localhost nobody listens on right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float,
    threads: int | None = None,
    log_dir: str | os.PathLike | None = None,
    **kwargs: Any,
) -> RanksOutcome:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    ``fn`` must be importable by name (module level): the spawn start method pickles it by reference.
    ``timeout`` bounds the whole launch in seconds, start-up included. ``threads`` sets each rank's torch
    intra-op threads (default: the cores shared evenly). With ``log_dir`` each rank's stdout and stderr go
    to ``rank<r>.log`` there, and a rank that dies without a Python traceback is reported with its log's tail.
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
    }
    logs = [Path(log_dir, f"rank{rank}.log") if log_dir else None for rank in range(world_size)]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            daemon=False,
            args=(rank, world_size, env, threads, logs[rank], fn, args, kwargs, reports),
        )
        for rank in range(world_size)
    ]
    start = time.monotonic()
    try:
        for proc in procs:
            proc.start()
        values, error = _collect(procs, reports, logs, start + timeout, timeout)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        reports.close()
    return RanksOutcome(values, error, time.monotonic() - start)


def _collect(procs, reports, logs, deadline: float, timeout: float) -> tuple[list | None, str | None]:
    values: dict[int, Any] = {}
    seen_dead: dict[int, float] = {}
    while len(values) < len(procs):
        try:
            rank, kind, payload = reports.get(timeout=_POLL_S)
        except queue.Empty:
            now = time.monotonic()
            if now > deadline:
                late = [r for r in range(len(procs)) if r not in values]
                return None, f"timed out after {timeout:.0f} s waiting for rank(s) {late}"
            for r, p in enumerate(procs):
                if r not in values and p.exitcode is not None:
                    # a rank that reported just before exiting may still have its report in the pipe: grace period
                    if now - seen_dead.setdefault(r, now) > 5 * _POLL_S:
                        return None, f"rank {r} exited with code {p.exitcode} without a result{_tail(logs[r])}"
            continue
        if kind == "error":
            return None, _root_cause(procs, logs, rank, payload)
        values[rank] = pickle.loads(payload)
    return [values[r] for r in range(len(procs))], None


def _root_cause(procs, logs, rank: int, payload: str) -> str:
    """A rank's error is often the echo of another rank's death (its peer reset the connection): name the rank
    that died first when one did, with the error as the consequence."""
    time.sleep(5 * _POLL_S)
    for r, p in enumerate(procs):
        if r != rank and p.exitcode not in (None, 0):
            return (
                f"rank {r} exited with code {p.exitcode} without a result{_tail(logs[r])}; "
                f"then rank {rank} raised:\n{payload}"
            )
    return f"rank {rank} raised:\n{payload}"


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    text = log.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    return f"; log tail ({log}):\n{text}" if text.strip() else ""


def _rank_main(rank, world_size, env, threads, log, fn, args, kwargs, reports) -> None:
    """One rank's process: environment, optional log redirection, then ``fn``; its value or traceback is reported."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(rank, world_size, *args, **kwargs)
        reports.put((rank, "value", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides
        reports.put((rank, "error", traceback.format_exc()))
    finally:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
