"""benchmarks/pipeline_parallel.py at its smallest: 2 ranks, dp-only ZeRO against pp=2 under 1F1B, the tiny GPT, one
timed step; the document has every figure the results table reads, each in its range."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp-results")
    argv = ["--quick", "--world-size", "2", "--systems", "dp2-z1,pp2-1f1b-z1", "--timeout", "300"]
    sys.path.insert(0, str(BENCHMARKS))  # the benchmark's modules, for this process and the ranks it spawns
    try:
        import pipeline_parallel

        assert pipeline_parallel.main([*argv, "--out-dir", str(out), "--name", "smoke"]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert (out / "smoke.md").read_text().count("| pp2-1f1b-z1 |") == 3  # its row, and one per pipeline rank
    return {row["name"]: row for row in json.loads((out / "smoke.json").read_text())["systems"]}


def test_pipeline_benchmark_reports_throughput_and_bubbles_in_range(pipeline_run):
    assert set(pipeline_run) == {"dp2-z1", "pp2-1f1b-z1"}
    for row in pipeline_run.values():
        assert len(row["step_seconds"]) == 1 and row["tokens_per_s"] > 0 and row["throughput_vs_dp"] > 0
        assert 0 <= row["idle_in_step"] <= 1 and 0 <= row["schedule_bubble"] <= 1
        assert row["loss_delta"] < 1e-5  # the pipeline trains the same model on the same tokens
    pipeline = pipeline_run["pp2-1f1b-z1"]
    assert (pipeline["pp"], pipeline["dp"], pipeline["microbatches"]) == (2, 1, 8)
    assert pipeline["theoretical_bubble"] == pytest.approx(1 / 9)  # (p - 1) / (m + p - 1)
    assert pipeline_run["dp2-z1"]["theoretical_bubble"] is None


def test_pipeline_benchmark_splits_model_states_by_stage(pipeline_run):
    """Each pipeline rank holds about half the parameters (the tied embedding on both) and, at ZeRO-1 over dp=1,
    16 bytes of model state per parameter, as the formula says."""
    whole = pipeline_run["dp2-z1"]["stages"][0]["psi_local"]
    stages = pipeline_run["pp2-1f1b-z1"]["stages"]
    assert [s["pp_rank"] for s in stages] == [0, 1] and [s["stage_ids"] for s in stages] == [[0], [1]]
    for stage in stages:
        assert whole / 2 <= stage["psi_local"] < whole
        assert stage["formula_bytes"] == 16 * stage["psi_local"]
        assert stage["model_state_bytes"] == pytest.approx(stage["formula_bytes"], rel=0.02)
        assert stage["rss_anon_growth_bytes"] > 0
