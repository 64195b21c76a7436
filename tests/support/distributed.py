"""Run a test body on several real gloo ranks, one spawned process each, and collect what each returns.

Tests call ``run_ranks(fn, world_size, ...)`` and assert on the returned list. ``fn`` must be importable by
name (defined at module level in a test module or helper) because the spawn start method pickles it by
reference. A failure on any rank becomes an AssertionError in the test process carrying that rank's traceback;
a rank that does not finish in time is killed, and the error carries the stack it was stuck in. Collectives
keep gloo's own (long) timeout: the runner's deadline is what stops a hang.

Note: [Forked ranks and the environment]
Starting a rank as a fresh interpreter (``spawn``) re-imports torch, Lightning, torchmetrics and transformers: about
12 s per test on a quiet 2-core machine and 40 s on a loaded one, which was most of the suite's time. Ranks are
therefore forked from a ``forkserver`` that imported those modules once (its preload list) and never runs a test
itself, so each rank starts from the same pristine, single-threaded state a fresh interpreter would reach, in well
under a second. What a fork cannot give is an environment changed after the server started: glibc reads
``MALLOC_MMAP_THRESHOLD_`` when the process starts, and Triton reads ``TRITON_INTERPRET`` when it is first imported.
So a test that changed ``os.environ`` since the server started (the memory tests set the malloc threshold) gets
spawned ranks, exactly as before. The server is killed when the test process exits: left to notice that by itself, it
finalizes everything it preloaded, which on a loaded machine outlasted the test run by minutes, and it holds nothing.

Note: [What a rank leaves behind]
Each rank runs in a process group of its own, which the processes it starts join (Lightning's launcher, a script, a
compile worker) and keep when the rank has ended and they were re-parented to init. A rank given up on (an error, a
death, the deadline) is killed with its whole group and whatever else is still below it. After ranks that succeeded,
what is left in their groups is given ``process_tree.EXIT_GRACE_S`` to end by itself, and what does not is killed and
fails the run, named: a test must not leave processes behind (see Note: [A test runner started as a rank] in
``process_guard.py`` for the way this once went unnoticed), and waiting here makes the test that started them the one
that reports them.
"""

import atexit
import faulthandler
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from process_tree import EXIT_GRACE_S, descendants, in_groups, kill, snapshot, still_running

_POLL_S = 0.2
_STACK_DUMP_WAIT_S = 1.0
# Spawning a rank re-imports torch, which takes seconds, and many on a loaded machine; that is not the test's time.
_JOIN_TIMEOUT_S = 120.0
# What a forked rank would otherwise import itself; a module missing here is merely imported later, by the rank.
_FORKSERVER_PRELOAD = [
    "import_root",  # first: Note: [The repository root is not an import root] in import_root.py
    "torch",
    "torch.distributed",
    "ds_strategy",
    "lightning.pytorch",
    "transformers",
    "models",
    "training_loops",
]
_forkserver_environment: dict[str, str] | None = None
_PER_TEST_VARIABLES = ("PYTEST_CURRENT_TEST",)  # pytest rewrites it for every test; nothing a rank reads


def _start_context() -> multiprocessing.context.BaseContext:
    """The forkserver while the environment is the one it started with, else spawn: see Note: [Forked ranks and the
    environment]."""
    global _forkserver_environment
    environment = {key: value for key, value in os.environ.items() if key not in _PER_TEST_VARIABLES}
    if _forkserver_environment is None:
        _start_forkserver()
        _forkserver_environment = environment
    return mp.get_context("forkserver" if environment == _forkserver_environment else "spawn")


def _start_forkserver() -> None:
    """The server started from this process's environment, with this folder on ``PYTHONPATH`` only while it starts,
    so that its preload list finds ``import_root``, which puts the suite's other folders on the server's ``sys.path``
    (Note: [Every folder of the suite is an import root]), and the tests' helper modules (the server does not take
    this process's ``sys.path``)."""
    multiprocessing.forkserver.set_forkserver_preload(_FORKSERVER_PRELOAD)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent), saved]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    atexit.register(_stop_forkserver)


def _stop_forkserver() -> None:
    """At exit: the server killed and reaped (Note: [Forked ranks and the environment])."""
    server = multiprocessing.forkserver._forkserver  # the one set_forkserver_preload configures
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)
        server._stop()


def set_torchrun_environment(rank: int, world_size: int) -> None:
    """Inside a rank: the variables torchrun sets, for frameworks (Accelerate) that read them rather than the
    process group the rank already has."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )


def set_lightning_environment(rank: int) -> None:
    """Inside a rank: the variables that tell Lightning (Trainer and Fabric) that its processes exist already, so it
    joins the rank's process group instead of launching the other ranks by re-running ``sys.argv``, which in a rank
    of the suite is the test command (Note: [A test runner started as a rank] in ``process_guard.py``)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks; return values in rank order.

    ``timeout`` (seconds) bounds the run from the moment every rank has joined the process group; start-up has
    its own, generous bound. Whatever the ranks started is gone when it returns (Note: [What a rank leaves behind]).
    """
    ctx = _start_context()
    reports = ctx.Queue()
    test = os.environ.get("PYTEST_CURRENT_TEST", "")  # a forked rank would inherit the one the forkserver started in
    with tempfile.TemporaryDirectory(prefix="ds_strategy_ranks_") as tmp:
        stack_files = [Path(tmp, f"rank{rank}.stack") for rank in range(world_size)]
        for stack_file in stack_files:
            stack_file.touch()
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, Path(tmp, "store"), stack_files[rank], test, fn, args, kwargs, reports),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            values = _collect(procs, reports, stack_files, timeout)
        except BaseException:
            kill(_below(procs))  # given up on: every rank, with what it started
            raise
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            reports.close()
    _assert_nothing_left(procs)
    return values


def _below(procs) -> list:
    """The ranks' processes, their process groups and their descendants (Note: [What a rank leaves behind])."""
    everything = snapshot()
    pids = {proc.pid for proc in procs if proc.pid is not None}
    tree = set().union(*(descendants(pid, everything) for pid in pids))
    return [process for process in everything if process.pid in tree or process.pgid in pids]


def _assert_nothing_left(procs) -> None:
    """The ranks returned: what they started has ``EXIT_GRACE_S`` to end, then is killed and named."""
    pgids = [proc.pid for proc in procs]
    left = still_running(lambda: in_groups(pgids, snapshot()), EXIT_GRACE_S)
    if left:
        groups = ", ".join(f"rank {rank}: {pgid}" for rank, pgid in enumerate(pgids))
        raise AssertionError(
            f"the ranks returned, but processes they started were still running {EXIT_GRACE_S:.0f} s later (killed "
            f"now; process group of {groups}):\n{kill(left)}\nA Trainer or Fabric in a rank launches the ranks "
            "it thinks are missing unless distributed.set_lightning_environment(rank) was called first."
        )


def _collect(procs, reports, stack_files, timeout: float) -> list:
    """Wait for every rank to join and then to return; raise on the first error, a silent death, or a deadline."""
    world_size = len(procs)
    joined, values = set(), {}
    deadline, awaited = time.monotonic() + _JOIN_TIMEOUT_S, f"join the process group within {_JOIN_TIMEOUT_S} s"
    while len(values) < world_size:
        pending = [rank for rank in range(world_size) if rank not in values]
        # A rank that had exited before this poll began has flushed its reports already, if it made any.
        exited = [rank for rank in pending if procs[rank].exitcode is not None]
        if time.monotonic() > deadline:
            late = [rank for rank in pending if rank not in joined] or pending
            raise AssertionError(
                f"rank(s) {late} did not {awaited}; stacks:\n"
                + "\n".join(_dump_stack(procs[rank], stack_files[rank]) for rank in late)
            )
        try:
            rank, kind, payload = reports.get(timeout=_POLL_S)
        except queue.Empty:
            if exited:
                codes = {rank: procs[rank].exitcode for rank in exited}
                raise AssertionError(f"rank(s) exited without reporting a result (rank: exit code): {codes}") from None
            continue
        if kind == "error":
            raise AssertionError(f"rank {rank} of {world_size} raised:\n{payload}")
        if kind == "joined":
            joined.add(rank)
            if len(joined) == world_size:
                deadline, awaited = time.monotonic() + timeout, f"finish within {timeout} s"
        else:
            values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(world_size)]


def _dump_stack(proc, stack_file: Path) -> str:
    """Ask a stuck rank for its Python stacks (via faulthandler) before it is killed."""
    os.kill(proc.pid, signal.SIGUSR1)
    give_up = time.monotonic() + _STACK_DUMP_WAIT_S
    while time.monotonic() < give_up and not stack_file.stat().st_size:
        time.sleep(0.05)
    return f"--- {stack_file.stem} ---\n{stack_file.read_text() or '(no stack: the rank was still starting)'}"


def _worker(rank, world_size, store, stack_file, test, fn, args, kwargs, reports):
    """Body of one rank's process: join the group, run ``fn``, report its pickled value or the traceback."""
    os.setpgid(0, 0)  # a process group of its own: Note: [What a rank leaves behind]
    if test:
        os.environ["PYTEST_CURRENT_TEST"] = test
    torch.set_num_threads(1)
    with open(stack_file, "w") as stack_out:
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
            reports.put((rank, "joined", None))
            try:
                value = fn(rank, world_size, *args, **kwargs)
            finally:
                dist.destroy_process_group()
            reports.put((rank, "value", pickle.dumps(value)))
        except BaseException:
            reports.put((rank, "error", traceback.format_exc()))
