"""One rank of the exit-time abort reproducer (torch 2.13.0, Python 3.11, gloo): see
``ds_strategy/comm/process_exit.py``, [Why every process group is destroyed at exit].

    python gloo_exit_race.py RANK PORT bare|ours

Both ranks launch 200 asynchronous all-reduces on tensors Python then drops, and exit without waiting. ``bare``
leaves the process group to the interpreter's shutdown, as torch does: a gloo worker thread then frees a tensor
while the interpreter finalizes and the process aborts with "terminate called without an active exception" (about
1 run in 10 on 2 loaded cores; ``benchmarks/clean_exit.py`` counts). ``ours`` first builds a ``Collectives``, as
every ZeroEngine does, which destroys the process groups at exit: it must always exit 0.
"""

import sys

import torch
import torch.distributed as dist

# imported before the group exists, as in every entry point (see the Note on imports after init_process_group)
from ds_strategy.comm.collectives import Collectives

rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if mode == "ours":
    Collectives()
works = [dist.all_reduce(torch.ones(100_000), async_op=True) for _ in range(200)]
del works
print(f"rank {rank} done", flush=True)
