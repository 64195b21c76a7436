"""benchmarks/compare.py's machinery, on the tiny GPT for one timed step: every system trains the same model, and the
bytes it counts agree with each algorithm's known volume and with the engine's own accounting. The same for
benchmarks/tensor_parallel.py (ZeRO against Lightning's ModelParallelStrategy) at tp=2 on 2 ranks."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    argv = [
        "--quick",
        "--systems",
        "ddp,fsdp2,zero2,zero2-nooverlap",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--out-dir",
        str(out),
        "--name",
        "smoke",
        "--timeout",
        "300",
    ]
    sys.path.insert(0, str(BENCHMARKS))  # the benchmark's modules, for this process and the ranks it spawns
    try:
        import compare

        assert compare.main(argv) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert (out / "smoke.md").read_text().count("| zero2 |") == 2  # its row, and its overlap pair's
    results = json.loads((out / "smoke.json").read_text())
    return {**{row["name"]: row for row in results["systems"]}, "overlap_pairs": results["overlap_pairs"]}


def _psi() -> int:
    from ds_strategy.models import GPT, gpt_config

    return sum(p.numel() for p in {id(p): p for p in GPT(gpt_config("tiny")).parameters()}.values())


def test_every_system_ran_and_trains_the_same_model_as_ddp(document):
    assert set(document) == {"ddp", "fsdp2", "zero2", "zero2-nooverlap", "overlap_pairs"}
    for name in ("ddp", "fsdp2", "zero2", "zero2-nooverlap"):
        row = document[name]
        assert row["status"] == "ok" and row["timed_steps"] == 1 and row["tokens_per_s"] > 0
        assert row["loss_delta_vs_ddp"] < 1e-5


def test_counted_bytes_match_each_algorithms_volume(document):
    fp32_grads = 4 * _psi()
    assert document["ddp"]["comm_bytes_per_step"] == 2 * fp32_grads  # one all-reduce of every gradient
    # FSDP2: all-gather in forward and again in backward, one reduce-scatter (each flat buffer padded to N)
    assert document["fsdp2"]["comm_bytes_per_step"] == pytest.approx(3 * fp32_grads, rel=0.01)


def test_overlap_on_and_off_are_paired_by_round(document):
    """``zero2-nooverlap`` runs the same collectives as ``zero2``; their step times are compared round by round."""
    on, off = document["zero2"], document["zero2-nooverlap"]
    assert on["comm_bytes_per_step"] == off["comm_bytes_per_step"]
    [pair] = document["overlap_pairs"]
    assert pair["system"] == "zero2"
    assert pair["ratios"] == [on["round_median_s"][0] / off["round_median_s"][0]]
    assert pair["rounds_not_slower"] == (pair["ratios"][0] <= 1.0)


def test_counted_bytes_match_the_engines_own_comm_stats(document):
    zero2 = document["zero2"]
    assert zero2["comm_bytes_per_step"] == zero2["own_comm_bytes_per_step"]


def test_model_states_per_rank_follow_each_systems_sharding(document):
    psi = _psi()
    assert document["ddp"]["model_state_bytes"] == 16 * psi
    assert document["fsdp2"]["model_state_bytes"] == pytest.approx(8 * psi, rel=0.01)
    assert document["zero2"]["model_state_bytes"] == pytest.approx(10 * psi, rel=0.01)  # 4 + 4/2 + 8/2


@pytest.fixture(scope="module")
def tensor_parallel_run(tmp_path_factory):
    """benchmarks/tensor_parallel.py at its smallest: 2 ranks, tp=2, ours and Lightning's, one timed step."""
    out = tmp_path_factory.mktemp("tp-results")
    argv = ["--quick", "--world-size", "2", "--tp", "2", "--systems", "zero-tp2,lightning-tp2", "--timeout", "300"]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import tensor_parallel

        assert tensor_parallel.main([*argv, "--out-dir", str(out), "--name", "smoke"]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert (out / "smoke.md").read_text().count("| 1 x 2 |") == 2
    return json.loads((out / "smoke.json").read_text())


def test_tensor_parallel_benchmark_trains_the_same_model_as_lightning_with_the_formulas_states(tensor_parallel_run):
    """Both systems see the same GPT, plan and batches; at dp=1 each rank holds 16 bytes per parameter of its
    tensor-parallel share (fp32 weight, gradient, two Adam moments), which is less than the whole model."""
    rows = {row["name"]: row for row in tensor_parallel_run["systems"]}
    assert set(rows) == {"zero-tp2", "lightning-tp2"}
    psi_local = rows["zero-tp2"]["psi_local"]
    for row in rows.values():
        assert row["dp"] == 1 and len(row["step_seconds"]) == 1 and row["loss_delta"] < 1e-5
        assert row["peak_rss_anon_bytes"] > 0 and row["psi_local"] == psi_local
        assert row["formula_bytes"] == 16 * psi_local
    assert tensor_parallel_run["params"] / 2 < psi_local < tensor_parallel_run["params"]
    assert rows["lightning-tp2"]["model_state_bytes"] == 16 * psi_local
    assert rows["zero-tp2"]["model_state_bytes"] == pytest.approx(16 * psi_local, rel=0.02)


def test_moe_benchmark_runs_and_expert_parallelism_divides_the_experts_gathered(tmp_path):
    """benchmarks/moe_expert_parallel.py at its smallest (4 ranks, one timed step): it runs through compose_model as
    shipped, every setting trains the same first loss, and the expert elements stage 3 gathers per step fall by ep."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import moe_expert_parallel

        assert moe_expert_parallel.main(["--quick", "--timeout", "300", "--out-dir", str(tmp_path), "--name", "s"]) == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [row["system"] for row in rows] == ["zero3", "zero3 + ep2", "zero3 + ep4"]
    gathered = [row["expert_gather_elements"] for row in rows]
    assert gathered[0] > 0 and gathered == [gathered[0], gathered[0] // 2, gathered[0] // 4]
    assert all(abs(row["loss_vs_first"]) < 1e-5 for row in rows)
