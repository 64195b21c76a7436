"""Communication accounting: the bytes each optimizer step moves are the ZeRO paper's volumes per stage, on 2
and 4 ranks, and the Lightning strategy logs them per step.

Volumes are counted as the paper states them (see ``ds_strategy.comm.collectives``): a reduce-scatter or an
all-gather of a Ψ-element buffer counts Ψ elements, an all-reduce 2Ψ. The runs use fp32, so the
communication dtype's bytes are 4 per element, and ``gradient_reduction="reduce_scatter"`` so that the
sharded collectives themselves run. Ψ is counted from the model; each flat buffer (one per unit and optimizer
param group) is padded to a multiple of N, which is the "plus padding" in the tolerances.
"""

import pytest
from comm_runs import four_rank_runs, model_numels, two_rank_runs

FP32 = 4


def padded(run: dict, units: slice = slice(None)) -> int:
    """Padded elements of the flat buffers of ``units`` (all units by default; unit 0 is the root)."""
    return sum(padded_numel for unit in run["units"][units] for _, padded_numel, _ in unit)


def within_5_percent_plus_padding(measured: int, formula_numel: int, padding_numel: int) -> bool:
    return abs(measured - formula_numel * FP32) <= 0.05 * formula_numel * FP32 + padding_numel * FP32


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request) -> list[dict]:
    return two_rank_runs() if request.param == 2 else four_rank_runs()


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_move_2_psi_per_step_as_a_reduce_scatter_and_an_all_gather(ranks, stage):
    """The gradients are reduce-scattered (Ψ) and the updated shards all-gathered (Ψ): 2Ψ, an all-reduce's
    volume, whatever the stage partitions."""
    psi = model_numels()["total"]
    for rank in ranks:
        run = rank[f"accounting stage {stage}"]
        for step in run["steps"]:
            world = step["world"]
            assert world["reduce_scatter"] == world["all_gather"] == padded(run) * FP32
            assert sum(world.values()) == 2 * padded(run) * FP32
            assert within_5_percent_plus_padding(sum(world.values()), 2 * psi, 2 * (padded(run) - psi))


def test_stage_3_moves_3_psi_per_step_less_the_gathers_of_what_stays_resident(ranks):
    """The paper's 3Ψ is an all-gather of every parameter for forward, another for backward, and a
    reduce-scatter of the gradients. Two of those gathers are not needed and not made: the root unit
    (embeddings, final norm, tied LM head) is gathered once per step and stays resident until backward ends,
    and the unit that ran last in forward is not freed before its backward comes straight after. So a step
    moves exactly 3Ψ - Ψ_root - Ψ_last: for the two-block tiny GPT 2.43Ψ; for a model of L equal blocks and a
    small root it tends to 3Ψ - Ψ/L. The first step still frees the last unit (it is recording the order in
    which units run), so it moves 3Ψ - Ψ_root."""
    numels = model_numels()
    psi, root, last = numels["total"], numels["root"], numels["blocks"][-1]
    for rank in ranks:
        run = rank["accounting stage 3"]
        padded_root, padded_last = padded(run, slice(0, 1)), padded(run, slice(-1, None))
        first, *later = [sum(step["world"].values()) for step in run["steps"]]
        assert first == (3 * padded(run) - padded_root) * FP32
        for measured in later:
            assert measured == (3 * padded(run) - padded_root - padded_last) * FP32
            assert within_5_percent_plus_padding(measured, 3 * psi - root - last, 3 * (padded(run) - psi))
        assert run["steps"][-1]["world"]["reduce_scatter"] == padded(run) * FP32


def test_all_reduce_mode_books_what_its_collectives_move():
    """gloo's default: the gradient reduce-scatter runs as an all-reduce, booked as one (2Ψ), and the
    parameter all-gather of a buffer alone as N broadcasts of Ψ/N, of a bucket of several buffers as one
    coalesced all-gather (Ψ either way): stage 2 then counts 3Ψ per step, not 2Ψ."""
    for rank in two_rank_runs():
        run = rank["accounting stage 2, all-reduce"]
        for step in run["steps"]:
            assert step["world"]["all_reduce"] == 2 * padded(run) * FP32
            assert step["world"]["broadcast"] + step["world"]["all_gather"] == padded(run) * FP32
            assert sum(step["world"].values()) == 3 * padded(run) * FP32


def test_the_lightning_strategy_logs_each_steps_bytes_per_kind():
    for rank in two_rank_runs():
        on = rank["lightning"]["on"]
        logged = [m for m in on["metrics"] if "comm/bytes" in m]
        assert len(logged) == 3
        for metrics in logged:
            assert metrics["comm/reduce_scatter_bytes"] == metrics["comm/all_gather_bytes"] == on["padded"] * FP32
            assert metrics["comm/bytes"] == 2 * on["padded"] * FP32
            assert metrics["comm/wait_seconds"] >= 0
        since_setup = sum(k["bytes"] for k in on["comm_stats"].values())
        construction = on["comm_stats"]["broadcast"]["bytes"]  # rank 0's initial parameters, before any step
        assert sum(m["comm/bytes"] for m in logged) == since_setup - construction


def test_logging_comm_stats_can_be_turned_off():
    for rank in two_rank_runs():
        assert not any(key.startswith("comm/") for m in rank["lightning"]["off"]["metrics"] for key in m)


def test_the_per_step_sequence_check_is_accounted_apart_from_training_traffic():
    for rank in two_rank_runs():
        for step in rank["accounting stage 2"]["steps"]:
            assert step["monitor"] == {**dict.fromkeys(step["monitor"], 0), "all_gather": 2 * 2 * 8}
