"""Pipeline parallelism on real gloo ranks: every schedule at every ZeRO stage matches one unsharded process, the
stages compose with data and tensor parallelism, the gradient-reduction and stage-3 gathering options do the
collectives they promise, and bad layouts fail with the allowed values before any process group exists.

Starting ranks is the slow part, so each rank count runs all of its configurations in one process group
(``pipeline_runs.train_jobs``) once per module, and every configuration is asserted on in its own test. The
references are computed once per distinct run in this process. A gradient check is one SGD step with learning
rate 1 over two accumulated batches: the update is then the gradient, and a reduction or accumulation that
silently did nothing shows in every parameter it touched.
"""

import functools

import pytest
import torch
from distributed import run_ranks
from pipeline_runs import (
    assert_matches,
    microbatch_error,
    mlp_stack,
    tiny_gpt,
    train_jobs,
    train_reference,
)

from ds_strategy.parallel.mesh import mesh_shape
from ds_strategy.parallel.pipeline_split import _balanced, plan_stages, split_blocks

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
STAGES = (0, 1, 2, 3)
PARTITION_ALL = {"param_persistence_threshold": 0}  # the tiny models' parameters would all stay gathered
NATIVE = {"gradient_reduction": "reduce_scatter"}  # counted as reduce-scatters and all-gathers, not all-reduces
REFERENCE_ARGS = ("model_name", "steps", "global_batch", "accumulate", "optimizer", "clip", "blocks")


def job(model_name: str = "mlp", steps: int = 1, global_batch: int = 8, **fields) -> dict:
    """Keyword arguments of ``train_pipeline``: one SGD step over two accumulated batches unless told."""
    fields.setdefault("accumulate", 2)
    return {"model_name": model_name, "steps": steps, "global_batch": global_batch, **fields}


def gradient_check(schedule: str, stage: int) -> dict:
    return job(stage=stage, pipeline_parallel_size=2, pipeline_schedule=schedule, **PARTITION_ALL)


def adamw_run(schedule: str, stage: int) -> dict:
    return job(
        steps=10, accumulate=1, optimizer="adamw", stage=stage, pipeline_parallel_size=2, pipeline_schedule=schedule
    )


def comm_run(stage: int, schedule: str, reduction: str = "once", keep_gathered: bool = True) -> dict:
    """Two steps on pp=2 x dp=2 (the first infers shapes and gathers everything; the second is counted)."""
    return job(
        steps=2,
        accumulate=1,
        stage=stage,
        pipeline_parallel_size=2,
        pipeline_schedule=schedule,
        pipeline_grad_reduction=reduction,
        pipeline_keep_gathered=keep_gathered,
        **PARTITION_ALL,
        **NATIVE,
    )


TIED_GPT_STAGES = (1, 3)
TWO_RANK_JOBS = {
    **{f"grad-{s}-zero{z}": gradient_check(s, z) for s in SCHEDULES for z in STAGES},
    **{f"adamw-{s}-zero{z}": adamw_run(s, z) for s in SCHEDULES for z in STAGES},
    **{
        f"gpt-zero{z}": job("gpt", steps=3, accumulate=1, optimizer="adamw", stage=z, pipeline_parallel_size=2)
        for z in TIED_GPT_STAGES
    },
    "gpt-per-microbatch-keep-gathered-off": job(
        "gpt",
        clip=0.05,
        stage=3,
        pipeline_parallel_size=2,
        pipeline_grad_reduction="per_microbatch",
        pipeline_keep_gathered=False,
        **PARTITION_ALL,
    ),
    "microbatch-error": microbatch_error,
}
COMM_RUNS = {
    "comm-zero2-once": comm_run(2, "1f1b"),
    "comm-zero2-per-microbatch": comm_run(2, "zbv", "per_microbatch"),
    "comm-zero3-keep-gathered": comm_run(3, "1f1b"),
    "comm-zero3-regather": comm_run(3, "zbv", keep_gathered=False),
    "comm-zero3-regather-per-microbatch": comm_run(3, "interleaved_1f1b", "per_microbatch", keep_gathered=False),
}
FOUR_RANK_JOBS = {
    **{f"pp2xdp2-zero{z}": gradient_check("1f1b", z) for z in STAGES},
    **COMM_RUNS,
    "pp2xtp2-llama": job(
        "llama", stage=2, pipeline_parallel_size=2, tensor_parallel_size=2, tensor_parallel_plan="auto"
    ),
    "pp4-llama-interleaved": job(
        "llama", blocks=8, stage=3, pipeline_parallel_size=4, pipeline_schedule="interleaved_1f1b", **PARTITION_ALL
    ),
}


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    results = run_ranks(train_jobs, 2, TWO_RANK_JOBS, timeout=600)
    return {name: [rank[name] for rank in results] for name in TWO_RANK_JOBS}


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    results = run_ranks(train_jobs, 4, FOUR_RANK_JOBS, timeout=600)
    return {name: [rank[name] for rank in results] for name in FOUR_RANK_JOBS}


@functools.cache
def _reference(*args) -> dict:
    return train_reference(*args)


def reference(run: dict) -> dict:
    defaults = {"accumulate": 1, "optimizer": "sgd", "clip": 0.0, "blocks": 4}
    return _reference(*({**defaults, **run}[name] for name in REFERENCE_ARGS))


# -- parity with one unsharded process ---------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_sgd_step_over_two_accumulated_batches_gives_the_unsharded_gradient(two_ranks, schedule, stage):
    name = f"grad-{schedule}-zero{stage}"
    assert_matches(two_ranks[name], reference(TWO_RANK_JOBS[name]))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ten_adamw_steps_match_the_unsharded_losses_and_weights(two_ranks, schedule, stage):
    name = f"adamw-{schedule}-zero{stage}"
    assert_matches(two_ranks[name], reference(TWO_RANK_JOBS[name]), params_in_norm=True)


@pytest.mark.parametrize("stage", TIED_GPT_STAGES)
def test_gpt_with_its_head_tied_to_the_embedding_on_another_stage_matches_the_unsharded_run(two_ranks, stage):
    name = f"gpt-zero{stage}"
    assert_matches(two_ranks[name], reference(TWO_RANK_JOBS[name]), params_in_norm=True)


@pytest.mark.parametrize("stage", TIED_GPT_STAGES)
def test_the_tied_head_stays_bitwise_equal_to_the_embedding_it_copies(two_ranks, stage):
    first, last = two_ranks[f"gpt-zero{stage}"]
    assert last["tied"] == {"lm_head.weight": "embed.wte.weight"}
    assert torch.equal(last["params"]["lm_head.weight"], first["params"]["embed.wte.weight"])


def test_per_microbatch_reduction_with_regathering_and_clipping_matches_the_unsharded_gradient(two_ranks):
    name = "gpt-per-microbatch-keep-gathered-off"
    assert_matches(two_ranks[name], reference(TWO_RANK_JOBS[name]))


@pytest.mark.parametrize("name", [n for n in TWO_RANK_JOBS if n.startswith("adamw-")])
def test_train_step_returns_the_same_loss_on_every_pipeline_rank(two_ranks, name):
    first, last = two_ranks[name]
    assert first["raw_losses"] == last["raw_losses"]


@pytest.mark.parametrize("stage", STAGES)
def test_pipeline_and_data_parallel_on_four_ranks_give_the_unsharded_gradient(four_ranks, stage):
    name = f"pp2xdp2-zero{stage}"
    assert_matches(four_ranks[name], reference(FOUR_RANK_JOBS[name]))


@pytest.mark.parametrize("name", COMM_RUNS)
def test_the_counted_runs_give_the_unsharded_gradients(four_ranks, name):
    assert_matches(four_ranks[name], reference(FOUR_RANK_JOBS[name]))


def test_pipeline_and_tensor_parallel_on_four_ranks_give_the_unsharded_gradient(four_ranks):
    assert_matches(four_ranks["pp2xtp2-llama"], reference(FOUR_RANK_JOBS["pp2xtp2-llama"]))


def test_four_stages_of_two_interleaved_chunks_on_four_ranks_give_the_unsharded_gradient(four_ranks):
    name = "pp4-llama-interleaved"
    assert_matches(four_ranks[name], reference(FOUR_RANK_JOBS[name]))


# -- what the options communicate (the second, counted step of each run) -----------------------------------------
def _counted(four_ranks, name: str):
    for result in four_ranks[name]:
        yield result["calls"][-1], result["layout"]


@pytest.mark.parametrize("name", ["comm-zero2-once", "comm-zero3-keep-gathered"])
def test_once_reduce_scatters_each_gradient_buffer_once_per_step(four_ranks, name):
    for calls, layout in _counted(four_ranks, name):
        assert calls["reduce_scatter"] == layout["scattered"]


@pytest.mark.parametrize("name", ["comm-zero2-per-microbatch", "comm-zero3-regather-per-microbatch"])
def test_per_microbatch_reduce_scatters_a_stages_own_buffers_after_every_microbatch(four_ranks, name):
    for calls, layout in _counted(four_ranks, name):
        alone = sum(layout["alone"].values())
        assert alone > 0 and layout["microbatches"] > 1
        assert calls["reduce_scatter"] == alone * layout["microbatches"] + layout["scattered"] - alone


def test_keep_gathered_all_gathers_each_partitioned_buffer_once_per_step(four_ranks):
    for calls, layout in _counted(four_ranks, "comm-zero3-keep-gathered"):
        assert sum(layout["partitioned"].values()) > 0
        assert calls["all_gather"] == sum(layout["partitioned"].values()) + layout["root_partitioned"]


@pytest.mark.parametrize("name", ["comm-zero3-regather", "comm-zero3-regather-per-microbatch"])
def test_regathering_all_gathers_a_stages_buffers_for_every_microbatch_forward_and_backward(four_ranks, name):
    for calls, layout in _counted(four_ranks, name):
        per_step = 2 * layout["microbatches"] * sum(layout["partitioned"].values())
        assert calls["all_gather"] == per_step + layout["root_partitioned"]


# -- bad layouts: errors before any process group work -----------------------------------------------------------
def test_a_pipeline_size_not_dividing_the_world_size_is_refused_with_the_sizes_allowed():
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size=3 does not divide the world size 4; allowed: \[1, 2, 4\]"
    ):
        mesh_shape(4, 1, pipeline_parallel_size=3)


def test_pipeline_and_tensor_sizes_whose_product_does_not_divide_the_world_are_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 x tensor_parallel_size=4 = 8 does not divide"):
        mesh_shape(4, 4, pipeline_parallel_size=2)


def test_the_pipeline_dimension_is_outermost_and_only_there_above_one():
    assert mesh_shape(8, 2, pipeline_parallel_size=2) == {"pp": 2, "dp": 2, "tp": 2}
    assert mesh_shape(8, 2) == {"dp": 4, "tp": 2}


def test_an_auto_split_of_blocks_not_dividing_into_the_stages_is_refused_with_the_stage_counts_allowed():
    with pytest.raises(
        ValueError, match=r"6 blocks do not divide into 4 stages \(stage counts allowed: \[1, 2, 3, 6\]\)"
    ):
        plan_stages(mlp_stack(6), 2, 0, "interleaved_1f1b", "auto")


def test_fewer_blocks_than_stages_are_refused():
    with pytest.raises(ValueError, match="4 pipeline stages need at least as many blocks; the model has 3"):
        plan_stages(mlp_stack(3), 4, 0, "1f1b", "auto")


def test_a_split_point_naming_no_block_is_refused_with_the_closest_names():
    with pytest.raises(ValueError, match=r"'blocks\.22' names no block of the model; did you mean \['blocks\.2'"):
        plan_stages(tiny_gpt(4), 2, 0, "1f1b", ["blocks.22"])


def test_split_points_out_of_order_are_refused():
    with pytest.raises(ValueError, match="must name distinct blocks after the first, in order"):
        split_blocks(["b0", "b1", "b2", "b3"], [1] * 4, 3, ["b2", "b1"])


def test_named_split_points_begin_stages_one_onwards():
    plan = plan_stages(tiny_gpt(4), 2, 1, "1f1b", ["blocks.3"])
    assert plan.blocks_of == (range(0, 3), range(3, 4))
    assert plan.stage_ids == (1,)


def test_a_parameter_split_gives_the_embedding_stage_fewer_blocks():
    assert split_blocks(["b0", "b1", "b2", "b3"], [10] * 4, 2, "parameters", extra=(20, 0)) == [
        range(0, 1),
        range(1, 4),
    ]


def test_balanced_runs_minimise_the_largest_stage():
    weights = [5, 1, 1, 1, 1, 1, 5]
    parts = _balanced(weights, 3)
    assert parts == [range(0, 1), range(1, 6), range(6, 7)]
    assert max(sum(weights[i] for i in part) for part in parts) == 5


def test_zbv_puts_the_first_and_last_stage_on_rank_zero_so_nothing_is_tied_across_ranks():
    plan = plan_stages(tiny_gpt(4), 2, 0, "zbv", "auto")
    assert plan.stage_ids == (0, 3)
    assert plan.tied == ()


def test_microbatches_not_dividing_the_batch_are_refused_at_train_step_before_any_collective(two_ranks):
    for result in two_ranks["microbatch-error"]:
        assert result["message"] == (
            "pipeline_microbatches=3 does not divide the batch size 4; micro-batch counts allowed for this batch: "
            "[1, 2, 4]"
        )
        assert not any(result["collectives"].values())
