"""Coalesced collectives without a call per buffer (Note: [Coalesced collectives]): buffers that tile one storage
are all-reduced as the span they cover, and ``all_gather_many`` stages its shards through one all-gather; both leave
every buffer as the per-buffer collectives would."""

import torch
import torch.distributed as dist
from distributed import run_ranks

from ds_strategy.comm.collectives import Collectives, _tiled_span


def test_buffers_end_to_end_in_one_storage_are_all_reduced_as_their_span():
    storage = torch.zeros(10)
    views = [storage.narrow(0, 0, 3), storage.narrow(0, 3, 2), storage.narrow(0, 5, 5)]
    span = _tiled_span(views)
    assert span is not None and span.data_ptr() == storage.data_ptr() and span.numel() == 10
    assert _tiled_span([storage.narrow(0, 0, 3), storage.narrow(0, 4, 2)]) is None  # a gap
    assert _tiled_span([storage.narrow(0, 3, 2), storage.narrow(0, 0, 3)]) is None  # out of order
    assert _tiled_span([torch.zeros(3), torch.zeros(2)]) is None  # two storages


def _reduce_and_gather(rank: int, world_size: int) -> dict:
    collectives = Collectives(use_all_reduce=True)
    sizes = (6, 2, 4)  # multiples of the world size, as flat buffers are padded to
    storage = torch.arange(sum(sizes), dtype=torch.float32) * (rank + 1)
    views = list(storage.split(sizes))
    collectives.all_reduce_many(views).wait()
    fulls = [torch.full((n,), -1.0) for n in sizes]
    shards = [torch.arange(n // world_size, dtype=torch.float32) + 100 * rank + 10 * i for i, n in enumerate(sizes)]
    collectives.all_gather_many(fulls, shards).wait()
    expected = []
    for i, n in enumerate(sizes):
        parts = [torch.arange(n // world_size, dtype=torch.float32) + 100 * r + 10 * i for r in range(world_size)]
        expected.append(torch.cat(parts))
    calls = {kind: stats.calls for kind, stats in collectives.stats.kinds.items() if stats.calls}
    dist.barrier()
    return {"reduced": storage, "fulls": fulls, "expected": expected, "calls": calls}


def test_a_tiled_all_reduce_and_a_staged_all_gather_give_each_buffer_its_collective_result():
    for run in run_ranks(_reduce_and_gather, 2):
        assert torch.equal(run["reduced"], torch.arange(12, dtype=torch.float32) * 3)  # rank 0's x1 + rank 1's x2
        for full, expected in zip(run["fulls"], run["expected"]):
            assert torch.equal(full, expected)
        assert run["calls"] == {"all_reduce": 1, "all_gather": 1}
