"""Buckets span units (Note: [Buckets span units] in ``ds_strategy.zero.buckets``): a step's collectives do not grow
with the number of units of a model that fits one bucket, and bucketing changes no result at any stage, with
accumulation under ``no_sync`` and without it, clipping, offload and either gradient collective."""

import pytest
import torch
from distributed import run_ranks
from training_loops import Recipe, assert_matches, check_jobs

from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

GRADIENT_KINDS = ("all_reduce", "reduce_scatter")
PARAMETER_KINDS = ("all_gather", "broadcast")


def calls_per_step(rank: int, world_size: int, depths: tuple[int, ...], stages: tuple[int, ...]) -> dict:
    """For each (depth, stage): the units, and the gradient and parameter collectives of the third step of a model
    of ``depth`` small blocks."""
    from models import ManySmallBlocks

    torch.set_num_threads(1)
    counts = {}
    for depth in depths:
        for stage in stages:
            torch.manual_seed(0)
            model = ManySmallBlocks(depth)
            engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=stage))
            generator = torch.Generator().manual_seed(rank)
            for _ in range(3):
                engine.backward(model(model.make_batch(generator, 4)))
                engine.step()
            stats = engine.comm_stats(last_step=True)
            counts[depth, stage] = {
                "units": len(engine.units),
                "gradients": sum(stats[kind]["calls"] for kind in GRADIENT_KINDS),
                "parameters": sum(stats[kind]["calls"] for kind in PARAMETER_KINDS),
            }
            engine.remove_hooks()
    return counts


@pytest.fixture(scope="module")
def counted():
    return run_ranks(calls_per_step, 2, (8, 48), (1, 2), timeout=300)[0]


@pytest.mark.parametrize("stage", (1, 2))
def test_a_step_reduces_gradients_once_however_many_units_the_model_has(counted, stage):
    few, many = counted[8, stage], counted[48, stage]
    assert many["units"] > 40 > few["units"]
    assert few["gradients"] == many["gradients"] == 1, (few, many)


@pytest.mark.parametrize("stage", (1, 2))
def test_a_step_gathers_updated_parameters_once_however_many_units_the_model_has(counted, stage):
    few, many = counted[8, stage], counted[48, stage]
    assert few["parameters"] == many["parameters"] == 1, (few, many)


def blocks(**changes) -> Recipe:
    return Recipe(model="ManySmallBlocks", steps=4, **changes)


BLOCKS = blocks()

JOBS = {
    "stage 0": (BLOCKS, 0),
    "stage 1": (BLOCKS, 1),
    "stage 2": (BLOCKS, 2),
    "stage 3, persistent": (BLOCKS, 3),  # every block below the persistence threshold: whole, bucketed like stage 2
    "stage 3, partitioned": (blocks(zero={"param_persistence_threshold": 0}), 3),
    "stage 1, accumulating without no_sync": (blocks(pattern="every"), 1),
    "stage 2, accumulating without no_sync": (blocks(pattern="every"), 2),
    "stage 1, reduce-scatter": (blocks(zero={"gradient_reduction": "reduce_scatter"}), 1),
    "stage 2, reduce-scatter": (blocks(zero={"gradient_reduction": "reduce_scatter"}), 2),
    "stage 2, optimizer offloaded": (blocks(zero={"offload_optimizer": "cpu"}), 2),
    "stage 1, optimizer offloaded": (blocks(zero={"offload_optimizer": "cpu"}), 1),
    "stage 2, buckets of three blocks": (blocks(zero={"reduce_bucket_size": 230}), 2),
}


@pytest.fixture(scope="module")
def bucketed_runs():
    return check_jobs(JOBS)


@pytest.mark.parametrize("job", list(JOBS))
def test_bucketed_reductions_and_gathers_match_single_process(bucketed_runs, job):
    ranks, reference = bucketed_runs[job]
    for rank in ranks:
        assert_matches(rank, reference)
