"""Destroying the process groups while the interpreter is still whole, so that a successful run exits 0.

Note: [Why every process group is destroyed at exit]
A gloo process group runs its collectives on C++ worker threads (``std::thread``) that hold each work, and the
tensors it reads and writes, until a moment after the collective completes (and all along for work launched but
never waited). A tensor whose Python object was dropped meanwhile is freed by the worker, which must take the GIL
to release that object. Python 3.11 ends any thread that asks for the GIL once the interpreter has begun to
finalize (``pthread_exit``); the forced unwinding meets the ``noexcept`` destructor it started from and the process
aborts with "terminate called without an active exception" (exit -6), after the script's last line. A core dump
of the reproducer shows exactly that stack: ``ProcessGroupGloo::runLoop`` > ``~AsyncAllreduceWork`` >
``TensorImpl::decref_pyobject`` > ``gil_scoped_acquire`` > ``take_gil`` > ``PyThread_exit_thread`` >
``std::terminate``. Whether a run aborts is a race between the workers and the interpreter's shutdown (about
1 run in 5 of ``examples/train.py``, whose last collectives come just before it exits). Lightning destroys its
process group at exit only for NCCL (``lightning.fabric.utilities.distributed._init_dist_connection``),
accelerate only in ``end_training()``, and torch 2.13 not at all (pytorch/pytorch#179291 proposed it and was
withdrawn), so on gloo nothing did.

:func:`destroy_process_groups_at_exit` registers, once per process, an ``atexit`` hook. ``atexit`` runs before
finalization begins, and ``dist.destroy_process_group()`` drops torch's references to every group (the default
one, the hpZ subgroups, the sequence check's monitor group). A group is destroyed, joining its worker threads, only
when its last reference goes, so whatever of ours holds a group (every ``Collectives``, the sequence check's cache of
monitor groups) registers a release that the hook calls first: then nothing is left to race. A forgotten holder
shows no symptom but the rare abort; it is what let the abort through once the hook existed (the monitor-group cache
kept the default and the monitor group alive, with their four gloo threads, in every Lightning run). So
``tests/e2e/test_clean_exit.py`` lists the threads real runs still have at its last ``atexit`` hook and fails on any
gloo thread, which catches a holder deterministically. Holders outside ds_strategy (a user's own reference to a
group) are the user's. ``tests/e2e/scripts/gloo_exit_race.py`` is the reproducer (torch 2.13.0, Python 3.11).
A process leaving on an uncaught exception, or after one of its collectives failed, skips the hook: joining a
worker that waits on a peer which will never send could hold the failing process for the whole collective timeout.
"""

from __future__ import annotations

import atexit
import sys
import types
import weakref

import torch.distributed as dist

_registered = False
_collective_failed = False
_releases: list = []  # weak references to callables that drop a reference to a group


def destroy_process_groups_at_exit(release=None) -> None:
    """Make this process destroy every process group when it exits normally (registered once). ``release``, a
    function or bound method that drops references to groups held outside torch, is called first (a method is
    held weakly: its object may go before the process does)."""
    global _registered
    if not _registered:
        atexit.register(_destroy_process_groups)
        _registered = True
    if release is not None:
        _releases[:] = [reference for reference in _releases if reference() is not None]  # holders since gone
        _releases.append(weakref.WeakMethod(release) if isinstance(release, types.MethodType) else lambda: release)


def leave_process_groups_at_exit() -> None:
    """A collective of this process failed: its groups may hold work that never completes, which destroying them
    would wait for, so the exit hook leaves them alone."""
    global _collective_failed
    _collective_failed = True


def _destroy_process_groups() -> None:
    # last_value: an uncaught exception is ending the process
    if dist.is_initialized() and not _collective_failed and not hasattr(sys, "last_value"):
        for reference in _releases:
            release = reference()
            if release is not None:
                release()
        dist.destroy_process_group()
