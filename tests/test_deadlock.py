"""Ranks that issue different collectives end with a CollectiveMismatchError naming the unit, on every rank,
within ``collective_timeout``, instead of hanging or silently training on mispaired buffers."""
import datetime
import time

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from ds_strategy.comm.collectives import CollectiveMismatchError
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine

TIMEOUT = 2.0  # collective_timeout, seconds
LAYERS, WIDTH, BAD_STEP = 4, 16, 1


class EqualLayers(nn.Module):
    """Four equal Linear units and no root parameters, so every collective of a step has the same size.

    Gloo pairs collectives by the order ranks issue them; when two paired collectives differ in size it aborts
    the process itself (``gloo::EnforceNotMet``), before Python sees anything. With equal sizes a shifted
    sequence goes through, which is the case the engine must catch on its own.
    """

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def _train_until_mismatch(rank: int, order_on_rank1: list[int]) -> dict:
    """Train with ``order_on_rank1`` on rank 1 at BAD_STEP; return the error each rank ends with."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=3 * TIMEOUT))  # gloo gives up its stuck ops too
    torch.manual_seed(0)
    model = EqualLayers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZeroConfig(stage=3, param_persistence_threshold=0, overlap_comm=False, unit_modules=(nn.Linear,),
                        collective_timeout=TIMEOUT)
    engine = ZeroEngine(model, optimizer, config, process_group=group)
    started = None
    try:
        for step in range(BAD_STEP + 2):
            started = time.perf_counter() if step == BAD_STEP else started
            order = order_on_rank1 if rank == 1 and step == BAD_STEP else list(range(LAYERS))
            model(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step)), order).backward()
            engine.step()
    except Exception as error:  # noqa: BLE001 - the test asserts on the type
        return {"type": type(error).__name__, "message": str(error), "seconds": time.perf_counter() - started,
                "step": step}
    return {"type": None}


def _scenarios(rank: int, world_size: int) -> dict:
    """A silent mismatch (rank 1 runs two units swapped) and a skipped unit, each on its own process group."""
    return {"swapped": _train_until_mismatch(rank, [0, 2, 1, 3]),
            "skipped": _train_until_mismatch(rank, [0, 2, 3])}


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(_scenarios, 2, timeout=90)


def test_a_rank_that_skips_a_unit_fails_on_both_ranks_within_the_timeout(outcomes):
    """Rank 1 skips unit layers.1 in forward, so it issues two fewer collectives (that unit's forward and
    backward gathers; its gradient is still reduced, as zeros). Rank 0 waits for a collective rank 1 never
    issues and times out naming it; rank 1 finishes its step and its per-step sequence check times out."""
    for rank in outcomes:
        error = rank["skipped"]
        assert error["type"] == "CollectiveMismatchError", error
        assert error["step"] == BAD_STEP
        assert error["seconds"] < 2 * TIMEOUT + 3.0, error
    waiting, skipper = outcomes[0]["skipped"]["message"], outcomes[1]["skipped"]["message"]
    assert "rank 0: all_reduce for unit layers." in waiting and "did not complete within" in waiting
    assert "rank 1: the check of collective sequences" in skipper and "unit layers." in skipper


def test_a_silent_mismatch_is_named_by_the_per_step_check_on_both_ranks(outcomes):
    """Swapping two equal units pairs every collective with one of the same size, so nothing hangs or fails
    inside the backend: the check before the optimizer step finds the logs differ and names the first
    difference, the same on both ranks."""
    first = "First difference at collective #2: rank 0 issued all_reduce of 1088 B for unit layers.1"
    for rank, outcome in enumerate(outcomes):
        error = outcome["swapped"]
        assert error["type"] == "CollectiveMismatchError", error
        assert error["step"] == BAD_STEP and error["seconds"] < TIMEOUT
        assert f"rank {rank}: the ranks issued different collectives" in error["message"]
        assert first in error["message"] and "rank 1 issued all_reduce of 1088 B for unit layers.2" in error["message"]


def test_mismatch_error_type_is_a_runtime_error():
    assert issubclass(CollectiveMismatchError, RuntimeError)
