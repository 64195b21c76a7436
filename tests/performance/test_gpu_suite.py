"""benchmarks/gpu_suite.py on the host: the whole tiny suite runs and reports, two ranks included, and its device
choice, sizing, FLOP formulas, reference replays, report writing and time boxes do what the docstrings say. Its CUDA
path (NCCL, compiled Triton, pinned offload, MFU) needs a GPU and has not run yet."""

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def suite():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import gpu_suite
        import suite_harness

        yield gpu_suite, suite_harness
    finally:
        sys.path.remove(str(BENCHMARKS))


SHARES = {"correctness": 0.25, "speed": 0.45, "size": 0.30}  # three parts' shares of a budget
TWO_RANK_CHECKS = {f"stage{s} vs DDP, overlapped" for s in (1, 2, 3)} | {"stage3 sharded checkpoint round trip"}


@pytest.mark.slow
def test_the_tiny_suite_on_the_host_runs_every_part_two_ranks_included_and_writes_its_report(tmp_path):
    out = tmp_path / "suite"
    command = [sys.executable, str(BENCHMARKS / "gpu_suite.py"), "--device", "cpu", "--size", "tiny"]
    command += ["--budget", "1200"]  # the host rehearsal spends most of its time starting processes
    done = subprocess.run(
        [*command, "--nvme-path", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    status = {item["name"]: item["status"] for item in report["items"]}
    skipped = {name for name, state in status.items() if state == "skipped"}
    assert skipped == {"triton kernels compiled", "+compile", "rank killed in a save"}, status  # those that need CUDA
    assert set(status.values()) == {"pass", "skipped"}, status
    parts = [item["part"] for item in report["items"]]
    order = ["smoke", "correctness", "two_ranks", "speed", "long_context", "size"]
    assert parts[0] == "smoke" and list(dict.fromkeys(parts)) == order
    names = set(status)
    assert {"import ds_strategy", "one ZeRO-3 step", "one offloaded step", "one compiled ZeRO-3 step"} <= names
    assert {f"stage{s} 32-true {o}" for s in range(4) for o in ("sgd", "adamw")} <= names
    assert {f"stage{s} {p}" for s in range(4) for p in ("bf16-mixed", "16-mixed")} <= names
    assert {"stage3 32-true sgd cpu offload", "stage3 bf16-mixed nvme offload", "memory placement"} <= names
    assert TWO_RANK_CHECKS | {"zero3", "fsdp2", "torch", "memory loading"} <= names
    compiled = next(item for item in report["items"] if item["name"] == "one compiled ZeRO-3 step")
    assert compiled["metrics"]["compiled_frames"] > 0
    largest = next(item for item in report["items"] if item["name"] == "largest model, nvme offload")
    assert largest["note"] == "bound by memory, by the estimate"  # the search stopped below its most layers
    assert "| zero3 |" in out.with_suffix(".md").read_text()
    longest = {item["name"]: item["metrics"] for item in report["items"] if item["part"] == "long_context"}
    assert set(longest) == {f"longest sequence {s}" for s in ("plain", "zero3_tiled", "ulysses_sp2")}
    assert all(row["length"] == 256 and row["tokens_per_s"] > 0 for row in longest.values()), longest
    print(f"rehearsal: {report['seconds']:.0f} s, {len(report['items'])} items")


@pytest.mark.slow
def test_the_cuda_only_rank_kill_item_passes_when_rehearsed_on_the_host(tmp_path):
    """``rank_kill.py``, which the suite runs on CUDA only, on the CPU: rank 0 names the killed rank 1 in time and
    the save cut short stays unpublished (the host's own matrix is tests/e2e/test_rank_fault_matrix.py)."""
    command = [sys.executable, str(BENCHMARKS / "rank_kill.py"), "--device", "cpu", "--out", str(tmp_path / "k.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and verdict["passed"], done.stdout[-2000:] + done.stderr[-2000:]
    assert verdict["exit_codes"] == [1, -9]


def test_a_device_without_an_index_gets_this_ranks(suite, monkeypatch):
    _, harness = suite
    assert harness.resolve_device("cpu") == torch.device("cpu")
    assert harness.resolve_device("cuda", local_rank=3, device_count=2) == torch.device("cuda", 1)
    assert harness.resolve_device("cuda", local_rank=1, device_count=1) == torch.device("cuda", 0)  # two ranks, one GPU
    assert harness.resolve_device("cuda:1", device_count=2) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert harness.resolve_device("cuda", device_count=4) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        harness.resolve_device("cuda:1", device_count=1)
    with pytest.raises(ValueError, match="no CUDA device"):
        harness.resolve_device("cuda", device_count=0)


def test_the_smoke_part_runs_first_and_every_part_has_a_share(suite):
    gpu_suite, _ = suite
    names = [part.name for part in gpu_suite.PARTS]
    assert names[0] == "smoke" and {"correctness", "two_ranks", "speed", "long_context", "size"} <= set(names)
    assert len(set(names)) == len(names) and all(part.share > 0 for part in gpu_suite.PARTS)
    assert gpu_suite.parse_args(["--parts", "smoke,two_ranks"]).parts == "smoke,two_ranks"
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["--parts", "smoke,nothing"])


def test_a_compiled_step_that_compiled_nothing_fails(suite, monkeypatch):
    gpu_suite, _ = suite
    monkeypatch.setattr(
        gpu_suite, "train", lambda *a, **k: {"losses": [1.0], "times": [0.1], "compiled_frames": 0, "graph_breaks": 3}
    )
    passed, figures, note = gpu_suite.one_step(torch.device("cpu"), compile=True)
    assert not passed and figures["graph_breaks"] == 3 and "ran eager" in note


def test_an_fp16_row_is_compared_with_a_reference_taking_the_steps_its_loss_scaler_took(suite):
    gpu_suite, _ = suite
    config = gpu_suite.llama_config(gpu_suite.CORRECT_SHAPES["tiny"], 16)
    system = {"kind": "zero", "stage": 2, "precision": "16-mixed", "optimizer": "sgd"}
    system |= {"initial_scale_power": 20, "hysteresis": 1}  # overflows until the scale has halved enough times
    passed, figures = gpu_suite.compare_with_reference(system, None, config, torch.device("cpu"), 1, 16, 10)
    assert passed and figures["skipped_steps"] > 0 and figures["max_rel_loss_error"] <= gpu_suite.FP16_RTOL


def test_the_flop_formula_is_6nt_plus_the_attention_term_with_n_all_but_the_input_embedding(suite):
    gpu_suite, _ = suite
    import suite_training

    config = suite_training.llama_config(suite_training.CORRECT_SHAPES["tiny"], 16)
    model = suite_training.build_llama(config)
    total = sum(p.numel() for p in model.parameters())
    n = suite_training.matmul_params(config, total)
    assert n == total - model.model.embed_tokens.weight.numel()
    assert suite_training.train_flops(n, 2, 64, 16, 32) == 6 * n * 32 + 12 * 2 * 64 * 16 * 32
    assert suite_training.mfu(1e12, 2.0, 1e12) == 0.5 and suite_training.mfu(1e12, 2.0, None) is None
    assert gpu_suite.peak_flops(torch.device("cpu"), None) is None
    assert gpu_suite.peak_flops(torch.device("cpu"), 989.4) == pytest.approx(989.4e12)


def test_the_size_search_finds_the_last_fitting_layer_count_in_log_steps(suite):
    import suite_size

    calls = []

    def fits(n):
        calls.append(n)
        return n <= 37

    assert suite_size.largest_fitting(1, 80, fits) == 37
    assert len(calls) <= 1 + 7  # the low end, then log2(80) halvings
    assert suite_size.largest_fitting(1, 80, lambda n: False) is None
    assert suite_size.largest_fitting(1, 80, lambda n: True) == 80
    shape, most, seq = suite_size.SIZE_SHAPES["tiny"]
    capacity = {"device": 2**40, "host": 2**40, "disk": 0}  # no disk: NVMe offload cannot fit
    config = suite_size.llama_config({**shape, "num_hidden_layers": 2}, seq)
    assert suite_size.size_fits(config, seq, "cpu", capacity)[0]
    assert not suite_size.size_fits(config, seq, "nvme", capacity)[0]


def test_budget_shares_carry_what_a_part_leaves_to_the_next(suite):
    _, harness = suite
    now = [0.0]
    budget = harness.Budget(100.0, SHARES, clock=lambda: now[0])
    assert budget.part_seconds("correctness") == pytest.approx(25.0)
    now[0] = 10.0  # correctness used 10 s of its 25
    assert budget.part_seconds("speed") == pytest.approx(90.0 * 0.45 / 0.75)
    now[0] = 60.0
    assert budget.part_seconds("size") == pytest.approx(40.0)  # the last part gets all that is left
    assert budget.part_seconds("unlisted") == pytest.approx(40.0)  # as does a part without a share


def test_items_are_time_boxed_recorded_and_written_after_each_one(suite, tmp_path):
    _, harness = suite
    report = harness.Report(tmp_path / "r", {"title": "t", "command": "c"})
    runner = harness.Runner(report, harness.Budget(60.0, SHARES, clock=lambda: 0.0), min_item_s=0.2)
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


def _long_context_part(suite, tmp_path, device: str, budget_s: float = 600.0):
    """A runner started on the long-context part, and its context at the tiny size."""
    gpu_suite, harness = suite
    report = harness.Report(tmp_path / "r", {"title": "t", "command": "c"})
    runner = harness.Runner(report, harness.Budget(budget_s, clock=lambda: 0.0), min_item_s=1.0)
    runner.start_part("long_context")
    args = gpu_suite.parse_args(["--size", "tiny", "--parts", "long_context"])
    return runner, harness.SuiteContext(args, torch.device(device), tmp_path)


def test_the_long_context_part_records_each_systems_longest_sequence_within_the_time_box(suite, tmp_path, monkeypatch):
    """The part's own logic, its probes stood in for by a rule (a real one is a process training a model: the slow
    rehearsal above runs those): each system starts where the last one ended, its search stops within its share of
    the time box, and its row says how far beyond the plain one it got."""
    import long_context
    import suite_long_context

    limits, seen = {"plain": 256, "zero3_tiled": 2048, "ulysses_sp2": 4096}, []

    def probe(system, length, cap, device="cpu", timeout=None, model=None):
        seen.append((system, length, timeout, model))
        return long_context.Probe(length, length <= limits[system], 2**20, None, 0.5, 1.0)

    monkeypatch.setattr(long_context, "probe", probe)
    monkeypatch.setattr(
        suite_long_context,
        "LONG_CONTEXT_SIZES",
        {"tiny": suite_long_context.LongContextSize(1.0, 128, 8192, 0.5, suite_long_context.TINY_MODEL)},
    )
    runner, context = _long_context_part(suite, tmp_path, "cpu")
    suite_long_context.run_long_context(runner, context)
    items = {item.name: item for item in runner.report.items}
    assert [item.status for item in items.values()] == ["pass"] * 3, items
    figures = {name.removeprefix("longest sequence "): item.metrics for name, item in items.items()}
    assert {system: f["length"] for system, f in figures.items()} == limits
    assert figures["ulysses_sp2"]["x_plain"] == 16 and figures["plain"]["tokens_per_s"] == 512
    first = {system: next(length for s, length, *_ in seen if s == system) for system in limits}
    assert first == {"plain": 128, "zero3_tiled": 256, "ulysses_sp2": 2048}  # each from the last one's length
    # every probe's timeout fits in its system's share of the 600 s (a third, a half, all of what is left)
    assert all(timeout <= 600 * 0.85 for _, _, timeout, _ in seen)
    assert {model["hidden_size"] for *_, model in seen} == {64}


def test_the_long_context_part_skips_ulysses_on_one_gpu_and_calls_a_search_cut_short_overran(
    suite, tmp_path, monkeypatch
):
    import long_context
    import suite_long_context

    monkeypatch.setattr(long_context, "_cuda_count", lambda: 1)

    def probe(system, length, cap, device="cpu", timeout=None, model=None):
        assert device == "cuda"
        return long_context.Probe(length, False, reason=f"timed out after {timeout:.0f} s waiting for rank(s) [0]")

    monkeypatch.setattr(long_context, "probe", probe)
    clock = itertools.count(step=1000.0)  # a probe takes longer than a search's whole time limit
    monkeypatch.setattr(long_context.time, "monotonic", lambda: next(clock))
    runner, context = _long_context_part(suite, tmp_path, "cuda")
    suite_long_context.run_long_context(runner, context)
    status = {item.name: (item.status, item.note) for item in runner.report.items}
    assert status["longest sequence ulysses_sp2"] == ("skipped", "needs 2 CUDA devices, 1 here")
    assert (
        status["longest sequence plain"][0] == "overran"
        and "before any length fit" in status["longest sequence plain"][1]
    )
    assert not runner.report.failed
