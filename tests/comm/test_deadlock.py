"""Ranks that issue different collectives end with a CollectiveMismatchError naming the unit, on every rank,
within ``collective_timeout``, instead of hanging or training on mispaired buffers."""

import datetime
import random
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from torch import nn

from ds_strategy.comm import rank_failure
from ds_strategy.comm.collectives import Collectives
from ds_strategy.comm.sequence_check import CollectiveSequenceCheck
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine
from ds_strategy.zero.groups import EngineGroups

TIMEOUT = 2.0  # collective_timeout, seconds (gloo's own on these groups, 3 x TIMEOUT, would raise another error)
PEER_TIMEOUT = 60.0  # a collective_timeout that a peer's departure must not have to wait out
LAYERS, WIDTH, BAD_STEP = 4, 16, 1
SLICE_S, LATE_WAITS = 0.02, 60  # a short rank_failure.POLL_S, and how many waits on a peer late by about that


class EqualLayers(nn.Module):
    """Four equal Linear units and no root parameters: a shifted sequence of collectives then hangs (and is
    timed out) rather than pairing buffers of different sizes, which gloo answers by aborting the process."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x.square().mean()


def _short_lived_group():
    """A fresh group whose gloo ops give up after a few seconds, so the process can exit after the error."""
    return dist.new_group(timeout=datetime.timedelta(seconds=3 * TIMEOUT))


def _outcome(error: Exception | None, started: float, step: int | None = None) -> dict:
    return {
        "type": type(error).__name__ if error else None,
        "message": str(error) if error else "",
        "seconds": time.perf_counter() - started,
        "step": step,
    }


def _skip_a_unit(rank: int, overlap: bool) -> dict:
    """Rank 1 runs every unit but layers.1 at BAD_STEP."""
    torch.manual_seed(0)
    model = EqualLayers()
    config = ZeroConfig(
        stage=3,
        param_persistence_threshold=0,
        overlap_comm=overlap,
        unit_modules=(nn.Linear,),
        collective_timeout=TIMEOUT,
    )
    engine = ZeroEngine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, EngineGroups(zero=_short_lived_group())
    )
    started, step = time.perf_counter(), None
    try:
        for step in range(BAD_STEP + 2):
            started = time.perf_counter() if step == BAD_STEP else started
            skipping = rank == 1 and step == BAD_STEP
            order = [i for i in range(LAYERS) if not (skipping and i == 1)]
            model(torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step)), order).backward()
            engine.step()
    except Exception as error:  # noqa: BLE001 - the test asserts on the type
        return _outcome(error, started, step)
    return _outcome(None, started, step)


def _mislabelled_collectives(rank: int, trailing_extra: bool) -> dict:
    """Both ranks all-reduce same-sized buffers for different units (a silent mismatch), or rank 0 issues one
    more than rank 1 at the end of a step, then both run the per-step check."""
    collectives = Collectives(_short_lived_group(), timeout=TIMEOUT)
    check = CollectiveSequenceCheck([collectives])
    started = time.perf_counter()
    try:
        collectives.all_reduce(torch.ones(64), label="unit blocks.0").wait()
        if trailing_extra and rank == 0:
            collectives.all_reduce(torch.ones(64), label="unit blocks.1").wait()
        elif not trailing_extra:
            collectives.all_reduce(torch.ones(64), label=f"unit blocks.{rank + 1}").wait()
        check.verify()
    except Exception as error:  # noqa: BLE001
        return _outcome(error, started)
    return _outcome(None, started)


def _peer_leaves(rank: int) -> dict:
    """Rank 1 closes its connections (as a process that dies does) while rank 0 waits in an all-reduce whose
    timeout is long."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=PEER_TIMEOUT))
    # Both sides have connected only once a collective on the group completed: a rank that closed the group while
    # the other was still connecting would fail that one's new_group ("Connection closed by peer") instead.
    dist.barrier(group=group)
    started = time.perf_counter()
    if rank == 1:
        dist.destroy_process_group(group)
        del group  # the last reference: gloo closes the group's sockets
        return _outcome(None, started)
    try:
        Collectives(group, timeout=PEER_TIMEOUT).all_reduce(torch.ones(64), label="unit blocks.0").wait()
    except Exception as error:  # noqa: BLE001
        return _outcome(error, started)
    return _outcome(None, started)


def _scenarios(rank: int, world_size: int) -> dict:
    return {
        "skip, overlap": _skip_a_unit(rank, overlap=True),
        "skip, no overlap": _skip_a_unit(rank, overlap=False),
        "silent": _mislabelled_collectives(rank, trailing_extra=False),
        "trailing": _mislabelled_collectives(rank, trailing_extra=True),
        "peer leaves": _peer_leaves(rank),
    }


@pytest.fixture(scope="module")
def outcomes():
    return run_ranks(_scenarios, 2, timeout=120)


@pytest.mark.parametrize("scenario", ["skip, overlap", "skip, no overlap"])
def test_a_rank_that_skips_a_unit_fails_on_both_ranks_within_the_timeout(outcomes, scenario):
    """Rank 1 skips layers.1's forward: it issues fewer gathers and a different order of gathers and
    reductions, so some collective on each rank is never matched. Each rank raises our error (gloo's own, longer
    timeout would raise another), naming the collective and unit it was waiting for, instead of hanging."""
    for rank, outcome in enumerate(outcomes):
        error = outcome[scenario]
        assert error["type"] == "CollectiveMismatchError", error
        assert error["step"] == BAD_STEP
        assert error["message"].startswith(f"rank {rank}: ")
        assert "layers." in error["message"], error["message"]


def test_a_silent_mismatch_is_named_by_the_per_step_check_on_both_ranks(outcomes):
    """Same-sized buffers pair without complaint from the backend; the check finds where the logs differ."""
    for rank, outcome in enumerate(outcomes):
        error = outcome["silent"]
        assert error["type"] == "CollectiveMismatchError", error
        assert error["message"].startswith(f"rank {rank}: the ranks issued different collectives")
        assert (
            "First difference at collective #2: rank 0 issued all_reduce of 512 B for unit blocks.1; "
            "rank 1 issued all_reduce of 512 B for unit blocks.2"
        ) in error["message"]


def test_the_rank_with_fewer_collectives_reports_at_the_step_check_instead_of_hanging(outcomes):
    """Rank 0 waits for a collective rank 1 never issues and times out naming it; rank 1, done with its step,
    times out in the per-step check, which names the last collectives it issued."""
    waiting, skipper = (outcome["trailing"] for outcome in outcomes)
    for error in (waiting, skipper):
        assert error["type"] == "CollectiveMismatchError", error
    assert waiting["message"].startswith("rank 0: all_reduce for unit blocks.1 did not complete within 2 s")
    assert skipper["message"].startswith("rank 1: the check of collective sequences before optimizer step #1")
    assert "the last ones: all_reduce of 512 B for unit blocks.0" in skipper["message"]


def test_a_peer_that_leaves_is_reported_as_a_failed_peer_before_the_timeout(outcomes):
    """A wait whose peer closed its connections is not a mismatch: it raises PeerFailedError without waiting out
    collective_timeout, pointing at the other rank's own error (how soon is a benchmark's business)."""
    error = outcomes[0]["peer leaves"]
    assert error["type"] == "PeerFailedError", error
    assert error["seconds"] < PEER_TIMEOUT, error
    because = "rank 0: all_reduce for unit blocks.0 failed because "
    # named once its process has exited (within a second): "left the job" while its exit status can be read, "died
    # without raising" once its parent reaped it; else by the closed connection alone
    named = ("rank 1 left the job", "rank 1 died without raising", "another rank died")
    assert error["message"].startswith(tuple(because + why for why in named)), error


def _hold_the_gil(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def _late_peer(rank: int, collectives: Collectives) -> dict:
    """Rank 1 issues each all-reduce 0.8-1.2 wait slices late, so that rank 0's slices run out about when the
    work completes, while a busy thread on rank 0 holds the GIL between slices (as a loaded job's other threads
    do), which widens the moment between a slice running out and the wait looking at the work."""
    late = random.Random(0)
    stop = threading.Event()
    busy = threading.Thread(target=_hold_the_gil, args=(stop,), daemon=True)
    busy.start()
    errors, sliced = [], 0
    try:
        for _ in range(LATE_WAITS):
            if rank == 1:
                time.sleep(SLICE_S * late.uniform(0.8, 1.2))
            started = time.perf_counter()
            try:
                collectives.all_reduce(torch.ones(4), label="late").wait()
            except Exception as error:  # noqa: BLE001 - the test lists them
                errors.append(f"{type(error).__name__}: {error}")
            sliced += time.perf_counter() - started > SLICE_S
            dist.barrier()
    finally:
        stop.set()
        busy.join()
    return {"errors": errors, "sliced": sliced}


def _timely_waits(rank: int, world_size: int) -> dict:
    """The late peer, and the warnings of a step's sharded collectives and sequence check."""
    rank_failure.POLL_S = SLICE_S  # this rank's process only
    collectives = Collectives(timeout=120.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check = CollectiveSequenceCheck([collectives])
        collectives.reduce_scatter(torch.empty(4), torch.ones(8), label="shard").wait()
        collectives.all_gather(torch.empty(8), torch.ones(4), label="gather").wait()
        check.verify()
    return {**_late_peer(rank, collectives), "warnings": [str(warning.message) for warning in caught]}


@pytest.fixture(scope="module")
def timely():
    return run_ranks(_timely_waits, 2, timeout=120)


def test_a_peer_late_by_about_one_wait_slice_is_waited_for_not_reported_as_a_timeout(timely):
    """See [A slice that runs out is not a timeout]: the old wait called a work that completed just after its
    slice ran out a failed one and raised "did not complete within 120 s" (22 of 60 waits here)."""
    waiter, late = timely
    assert waiter["errors"] == late["errors"] == [], (waiter["errors"] + late["errors"])[:3]
    assert waiter["sliced"] >= LATE_WAITS // 4, waiter  # the slices did run out while the peer was late


def test_sharded_collectives_and_the_step_check_warn_nothing(timely):
    """torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor with a warning on every run."""
    assert [rank["warnings"] for rank in timely] == [[], []]
