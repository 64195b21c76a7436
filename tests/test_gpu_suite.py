"""benchmarks/gpu_suite.py on the host: the whole tiny suite runs and reports, and its sizing, FLOP formulas, report
writing and time boxes do what the docstrings say. Its CUDA path (NCCL, compiled Triton, pinned offload, MFU) needs a
GPU and has not run yet."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_suite
        import suite_harness

        yield gpu_suite, suite_harness
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.slow
def test_the_tiny_suite_on_the_host_runs_every_part_and_writes_its_report(tmp_path):
    out = tmp_path / "suite"
    command = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--device", "cpu", "--size", "tiny"]
    done = subprocess.run(
        [*command, "--nvme-path", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    status = {item["name"]: item["status"] for item in report["items"]}
    skipped = {name for name, state in status.items() if state == "skipped"}
    assert skipped == {"triton kernels compiled", "+compile"}, status  # the two that need CUDA
    assert set(status.values()) == {"pass", "skipped"}, status
    names = set(status)
    assert {f"stage{s} {p}" for s in range(4) for p in ("bf16-mixed", "16-mixed")} <= names
    assert {"stage3 bf16-mixed nvme offload", "memory placement", "memory loading", "zero3", "fsdp2", "torch"} <= names
    largest = next(item for item in report["items"] if item["name"] == "largest model, nvme offload")
    assert largest["note"] == "bound by memory, by the estimate"  # the search stopped below its most layers
    assert "| zero3 |" in out.with_suffix(".md").read_text()


def test_the_flop_formula_is_6nt_plus_the_attention_term_with_n_all_but_the_input_embedding(suite):
    gpu_suite, _ = suite
    config = gpu_suite.llama_config(gpu_suite.CORRECT_SHAPES["tiny"], 16)
    model = gpu_suite.build_llama(config)
    total = sum(p.numel() for p in model.parameters())
    n = gpu_suite.matmul_params(config, total)
    assert n == total - model.model.embed_tokens.weight.numel()
    assert gpu_suite.train_flops(n, 2, 64, 16, 32) == 6 * n * 32 + 12 * 2 * 64 * 16 * 32
    assert gpu_suite.mfu(1e12, 2.0, 1e12) == 0.5 and gpu_suite.mfu(1e12, 2.0, None) is None
    import torch

    assert gpu_suite.peak_flops(torch.device("cpu"), None) is None
    assert gpu_suite.peak_flops(torch.device("cpu"), 989.4) == pytest.approx(989.4e12)


def test_the_size_search_finds_the_last_fitting_layer_count_in_log_steps(suite):
    gpu_suite, _ = suite
    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert gpu_suite.largest_fitting(1, 80, fits) == 37
    assert len(calls) <= 1 + 7  # the low end, then log2(80) halvings
    assert gpu_suite.largest_fitting(1, 80, lambda n: False) is None
    assert gpu_suite.largest_fitting(1, 80, lambda n: True) == 80
    shape, most, seq = gpu_suite.SIZE_SHAPES["tiny"]
    capacity = {"device": 2**40, "host": 2**40, "disk": 0}  # no disk: NVMe offload cannot fit
    assert gpu_suite.size_fits(gpu_suite.llama_config({**shape, "num_hidden_layers": 2}, seq), seq, "cpu", capacity)[0]
    assert not gpu_suite.size_fits(
        gpu_suite.llama_config({**shape, "num_hidden_layers": 2}, seq), seq, "nvme", capacity
    )[0]


def test_budget_shares_carry_what_a_part_leaves_to_the_next(suite):
    _, harness = suite
    now = [0.0]
    budget = harness.Budget(100.0, clock=lambda: now[0])
    assert budget.part_seconds("correctness") == pytest.approx(25.0)
    now[0] = 10.0  # correctness used 10 s of its 25
    assert budget.part_seconds("speed") == pytest.approx(90.0 * 0.45 / 0.75)
    now[0] = 60.0
    assert budget.part_seconds("size") == pytest.approx(40.0)  # the last part gets all that is left


def test_items_are_time_boxed_recorded_and_written_after_each_one(suite, tmp_path):
    _, harness = suite
    report = harness.Report(tmp_path / "r", {"title": "t", "command": "c"})
    runner = harness.Runner(report, harness.Budget(60.0, clock=lambda: 0.0), min_item_s=0.2)
    runner.start_part("correctness")

    def spin():
        while True:
            time.sleep(0.01)

    hung = runner.run("hangs", spin, share=0.02)  # 2% of the part's 15 s; how soon it returns is a benchmark's business
    assert (hung.status, hung.note) == ("timeout", "over its 0.3 s time box")
    assert runner.run("fails", lambda: (False, {"x": 1.5})).status == "fail"
    assert runner.run("raises", lambda: 1 / 0).note.startswith("ZeroDivisionError")
    assert runner.run("skipped", lambda: (True, {}), skip="needs CUDA").status == "skipped"
    runner.start_part("speed")
    assert runner.run("slow", spin, share=0.01).status == "overran"  # out of time is no failure outside correctness
    written = json.loads((tmp_path / "r.json").read_text())
    assert [item["status"] for item in written["items"]] == ["timeout", "fail", "error", "skipped", "overran"]
    assert written["failed"] == 3
    markdown = (tmp_path / "r.md").read_text()
    assert "| correctness | fails | fail |" in markdown and "x 1.5" in markdown
    runner.budget = harness.Budget(0.0)
    assert runner.run("late", lambda: (True, {})).note.startswith("no time left in the speed part")
