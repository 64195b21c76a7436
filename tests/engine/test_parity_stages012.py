"""Stages 0, 1 and 2 on real gloo ranks train exactly like one unsharded process fed the same global batch."""

import pytest
from distributed import run_ranks
from training_loops import Recipe, assert_matches, check_jobs, train_reference, train_stages

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STAGES = (0, 1, 2)
GPT = Recipe(model="TinyGPT")
MLP = Recipe(model="MLP")


@pytest.fixture(scope="module")
def gpt_runs():
    return run_ranks(train_stages, 2, GPT, STAGES), train_reference(GPT, 2)


@pytest.fixture(scope="module")
def mlp_runs():
    return run_ranks(train_stages, 2, MLP, STAGES), train_reference(MLP, 2)


@pytest.mark.parametrize("stage", STAGES)
def test_gpt_with_tied_embeddings_matches_single_process(gpt_runs, stage):
    ranks, reference = gpt_runs
    for rank in ranks:
        assert_matches(rank[stage], reference)


@pytest.mark.parametrize("stage", STAGES)
def test_mlp_matches_single_process(mlp_runs, stage):
    ranks, reference = mlp_runs
    for rank in ranks:
        assert_matches(rank[stage], reference)


EDGE = ("FrozenParamModel", "UnusedParamModel", "BatchNormModel", "OddSizeModel")


@pytest.fixture(scope="module")
def edge_runs():
    jobs = {f"{model}/{stage}": (Recipe(model=model, steps=4), stage) for model in EDGE for stage in (1, 2)}
    jobs["small-buckets"] = (
        Recipe(model="TinyGPT", steps=3, zero={"allgather_bucket_size": 1, "reduce_bucket_size": 1}),
        2,
    )
    return check_jobs(jobs)


@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("model", EDGE)
def test_edge_model_matches_single_process(edge_runs, model, stage):
    ranks, reference = edge_runs[f"{model}/{stage}"]
    for rank in ranks:
        assert_matches(rank, reference)


def test_one_element_buckets_serialise_communication_without_changing_results(edge_runs):
    ranks, reference = edge_runs["small-buckets"]
    for rank in ranks:
        assert_matches(rank, reference)


def test_odd_sized_model_on_four_ranks_matches_single_process():
    recipe = Recipe(model="OddSizeModel", steps=4)
    ranks = run_ranks(train_stages, 4, recipe, STAGES)
    reference = train_reference(recipe, 4)
    for rank in ranks:
        for stage in STAGES:
            assert_matches(rank[stage], reference)
