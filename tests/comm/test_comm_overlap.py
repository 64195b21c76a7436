"""Overlap: with ``overlap_comm`` reductions run while backward still produces gradients and stage-3 gathers
run ahead of the unit that needs them; without it every collective finishes before anything else happens.
Both give identical results.

The runs record, for one step, the order of gradient hooks, block forwards and collective launches and
completions (an observer on ``Collectives`` and hooks registered after the engine's; see ``comm_runs``).
"""

import pytest
import torch
from comm_runs import two_rank_runs

STAGES = (1, 2, 3)


def events(rank: dict, stage: int, overlap: bool) -> list[tuple]:
    return rank[f"overlap stage {stage} {overlap}"]["events"]


def spans(recorded: list[tuple], prefix: str) -> list[tuple[int, int]]:
    """(launch index, completion index) of each collective whose label starts with ``prefix``."""
    result = []
    for i, event in enumerate(recorded):
        if event[0] == "launch" and event[2].startswith(prefix):
            done = next(j for j in range(i + 1, len(recorded)) if recorded[j] == ("done", *event[1:]))
            result.append((i, done))
    return result


def work_between(recorded: list[tuple], span: tuple[int, int], what: str) -> bool:
    return any(event[0] == what for event in recorded[span[0] + 1 : span[1]])


@pytest.mark.parametrize("stage", STAGES)
def test_with_overlap_a_reduction_is_in_flight_while_backward_produces_gradients(stage):
    for rank in two_rank_runs():
        recorded = events(rank, stage, overlap=True)
        reductions = spans(recorded, "gradients of")
        last_gradient = max(i for i, event in enumerate(recorded) if event[0] == "grad")
        assert reductions and reductions[0][0] < last_gradient, "no reduction launched before backward ended"
        assert any(work_between(recorded, span, "grad") for span in reductions)


def test_with_overlap_stage_3_gathers_the_next_unit_while_the_current_one_computes():
    for rank in two_rank_runs():
        recorded = events(rank, 3, overlap=True)
        gathers = spans(recorded, "unit blocks.")
        assert any(work_between(recorded, span, "forward") for span in gathers), "no forward gather prefetched"
        assert any(work_between(recorded, span, "grad") for span in gathers), "no backward gather prefetched"


@pytest.mark.parametrize("stage", STAGES)
def test_without_overlap_no_computation_runs_while_a_collective_is_in_flight(stage):
    """(A unit's flat buffers, one per param group, are still gathered together, then waited on together.)"""
    for rank in two_rank_runs():
        recorded = events(rank, stage, overlap=False)
        collectives = spans(recorded, "")
        assert collectives and any(event[0] == "grad" for event in recorded)
        for span in collectives:
            assert not work_between(recorded, span, "grad") and not work_between(recorded, span, "forward")


@pytest.mark.parametrize("stage", STAGES)
def test_overlap_on_and_off_give_identical_results(stage):
    for rank in two_rank_runs():
        on, off = rank[f"overlap stage {stage} True"], rank[f"overlap stage {stage} False"]
        assert on["losses"] == off["losses"]
        assert on["params"].keys() == off["params"].keys()
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name
