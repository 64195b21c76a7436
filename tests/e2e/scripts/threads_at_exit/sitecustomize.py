"""Put on ``PYTHONPATH`` to make every Python process of a run (each rank, whoever launches it) print, at its very
last ``atexit`` hook, the names of the threads it still has. Registered when the interpreter starts, so it runs
after every hook a run registers later (``atexit`` runs hooks last-in first-out), including ds_strategy's process
group teardown: a gloo thread still listed here means some object kept a process group alive past that teardown
(see ``ds_strategy/comm/process_exit.py``, [Why every process group is destroyed at exit])."""

import atexit
import os
import sys


def _thread_names() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended while being listed
            pass
    return names


atexit.register(
    lambda: print(f"threads at exit of pid {os.getpid()}: {sorted(_thread_names())}", file=sys.stderr, flush=True)
)
