"""A DeepSpeed tutorial script (``scripts/deepspeed_tutorial.py``: AdamW and WarmupLR from the config or the
script's own AdamW, accumulation, clipping, DeepSpeed's data loader, checkpoints with client state, resume) runs with
its import line changed to ``import ds_strategy.deepspeed as deepspeed`` and nothing else, on 2 ranks, and trains as
real DeepSpeed trained it: per micro-step losses equal to 1e-6 in fp32 at ZeRO stages 0-3, with CPU offload, with the
config's optimizer and the script's; fp16 dynamic loss scaling skips the same steps. It resumes from DeepSpeed's own
checkpoint and from its own, also at another stage.

DeepSpeed is not needed: its runs were recorded by ``tests/data/deepspeed_initialize/make_references.py`` (the cases are
``deepspeed_initialize_cases.py``), which also kept the checkpoints DeepSpeed wrote. Each run here is the script itself,
executed by ``runpy`` in forked gloo ranks with torchrun's environment, as ``torchrun`` would execute it.

Note: [Tolerances against DeepSpeed's initialize]
fp32: 1e-6 absolute on every micro-step's loss (mean over ranks) and 1e-5 relative on every step's gradient norm.
DeepSpeed's Adam for the config's "AdamW" is its own CPU kernel (FusedAdam, DeepSpeedCPUAdam when offloaded), ours
torch's AdamW (our CPU Adam when offloaded); both compute Adam in fp32, so they differ in rounding only (measured in
the table of docs/deepspeed_initialize.md). A learning-rate schedule one step off, an accumulation scale of 1 instead of
1/2 or a clip skipped moves the second step's loss by 1e-3 or more. fp16: the skipped steps and the learning rates
exactly, losses to 1e-2 relative (where gradients are rounded to 16 bits differs).
"""

import json
import runpy
import sys
from pathlib import Path

import pytest
from deepspeed_initialize_cases import CASES, RESUMED, SAVE_AT, STEPS, WORLD_SIZE
from distributed import run_ranks, set_torchrun_environment
from e2e_runs import DS_STRATEGY, free_port, run

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "deepspeed_tutorial.py"
DATA = HERE.parents[0] / "data" / "deepspeed_initialize"
LOSS_ATOL, NORM_RTOL, FP16_RTOL = 1e-6, 1e-5, 1e-2  # Note: [Tolerances against DeepSpeed's initialize]
ONE_LINE = ("import deepspeed\n", "import ds_strategy.deepspeed as deepspeed\n")

pytestmark = pytest.mark.slow


def converted_script(folder: Path) -> Path:
    """The tutorial script with its one import line changed, and nothing else."""
    source = SCRIPT.read_text()
    assert source.count(ONE_LINE[0]) == 1
    path = folder / "tutorial_ds_strategy.py"
    path.write_text(source.replace(*ONE_LINE))
    return path


def run_tutorial(rank: int, world_size: int, script: str, scratch: str, runs: list) -> dict:
    """Run ``script`` once per ``(label, ds_config, arguments)`` in ``runs`` as torchrun would; rank 0's records."""
    set_torchrun_environment(rank, world_size)
    records = {}
    for label, config, arguments in runs:
        config_path = Path(scratch, f"{label.replace('/', '.')}.rank{rank}.json")
        config_path.write_text(json.dumps(config))
        out = Path(scratch, f"{label.replace('/', '.')}.out.json")
        argv = sys.argv
        sys.argv = [script, "--deepspeed_config", str(config_path), *arguments, "--out", str(out)]
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            sys.argv = argv
        if rank == 0:
            records[label] = json.loads(out.read_text())
    return records


@pytest.fixture(scope="module")
def references() -> dict:
    return json.loads((DATA / "references.json").read_text())


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    """Every case for STEPS steps; the resumed cases also saved at SAVE_AT and resumed (from our checkpoint, at the
    same stage and at stage 1 for a stage-3 save, and from DeepSpeed's), one rank set for all."""
    scratch = tmp_path_factory.mktemp("tutorial")
    script = str(converted_script(scratch))
    runs = [(case, config, [*arguments, "--steps", str(STEPS)]) for case, (config, arguments) in CASES.items()]
    for case in RESUMED:
        config, arguments = CASES[case]
        saved = scratch / f"{case}_checkpoint"
        save = ["--steps", str(SAVE_AT), "--save_dir", str(saved), "--save_every", str(SAVE_AT)]
        resume = ["--steps", str(STEPS - SAVE_AT), "--resume"]
        runs += [
            (f"{case}/saving", config, [*arguments, *save]),
            (f"{case}/resumed", config, [*arguments, *resume, str(saved)]),
            (f"{case}/from_deepspeed", config, [*arguments, *resume, str(DATA / f"{case}_checkpoint")]),
        ]
    stage1 = CASES["stage1"][0]
    runs.append(("stage3@stage1/resumed", stage1, [*resume, str(scratch / "stage3_checkpoint")]))
    return run_ranks(run_tutorial, WORLD_SIZE, script, str(scratch), runs, timeout=600)[0]


def assert_same_run(ours: dict, theirs: dict, fp16: bool = False) -> None:
    assert ours["applied"] == theirs["applied"]
    assert ours["lrs"] == pytest.approx(theirs["lrs"], rel=1e-12, abs=1e-12)
    assert (ours["global_steps"], ours["global_samples"]) == (theirs["global_steps"], theirs["global_samples"])
    if fp16:
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=FP16_RTOL)
        return
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=LOSS_ATOL, rel=0)
    norms = [(a, b) for a, b in zip(ours["grad_norms"], theirs["grad_norms"]) if b is not None]
    assert [a for a, _ in norms] == pytest.approx([b for _, b in norms], rel=NORM_RTOL)


@pytest.mark.parametrize("case", [case for case in CASES if "fp16" not in case])
def test_the_script_trains_as_deepspeed_trains_it(case, ours, references):
    assert len(ours[case]["losses"]) == STEPS * 2
    assert_same_run(ours[case], references[case]["full"])


def test_fp16_dynamic_loss_scaling_skips_the_steps_deepspeed_skips(ours, references):
    theirs = references["stage2_fp16"]["full"]
    assert not all(theirs["applied"]), "the case must overflow at least once"
    assert_same_run(ours["stage2_fp16"], theirs, fp16=True)


@pytest.mark.parametrize("case", RESUMED)
def test_resuming_from_deepspeeds_checkpoint_continues_as_deepspeed_did(case, ours, references):
    continued = references[case]["resumed"]
    assert continued["resumed_at"] == SAVE_AT
    assert_same_run(ours[f"{case}/from_deepspeed"], continued)


@pytest.mark.parametrize("case", RESUMED)
def test_resuming_from_its_own_checkpoint_continues_the_uninterrupted_run(case, ours):
    full, resumed = ours[case], ours[f"{case}/resumed"]
    assert resumed["resumed_at"] == SAVE_AT
    assert resumed["losses"] == pytest.approx(full["losses"][2 * SAVE_AT :], abs=LOSS_ATOL, rel=0)
    assert resumed["lrs"] == pytest.approx(full["lrs"][SAVE_AT:], rel=1e-12)
    assert resumed["global_samples"] == full["global_samples"]


def test_a_stage3_checkpoint_resumes_at_stage1(ours):
    assert ours["stage3@stage1/resumed"]["losses"] == pytest.approx(
        ours["stage3"]["losses"][2 * SAVE_AT :], abs=LOSS_ATOL, rel=0
    )


def test_launched_by_ds_strategy_launch_it_resumes_from_deepspeeds_checkpoint(tmp_path, references):
    """The whole way a user runs it: ``ds-strategy launch --num_gpus 2`` (torchrun, ``--local_rank`` passed as
    DeepSpeed's launcher passes it), DeepSpeed's checkpoint converted in a child process, DeepSpeed's continuation."""
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CASES["stage2"][0]))
    out = tmp_path / "run.json"
    checkpoint = DATA / "stage2_checkpoint"
    run(
        [DS_STRATEGY, "launch", "--num_gpus", WORLD_SIZE, "--master_port", free_port(), converted_script(tmp_path)]
        + ["--deepspeed_config", config, "--steps", STEPS - SAVE_AT, "--resume", checkpoint, "--out", out],
        timeout=300,
    )
    assert_same_run(json.loads(out.read_text()), references["stage2"]["resumed"])


def test_the_converted_script_differs_by_one_line(tmp_path):
    ours_lines = converted_script(tmp_path).read_text().splitlines()
    theirs_lines = SCRIPT.read_text().splitlines()
    changed = [(a, b) for a, b in zip(theirs_lines, ours_lines) if a != b]
    assert len(ours_lines) == len(theirs_lines) and changed == [tuple(line.strip() for line in ONE_LINE)]
