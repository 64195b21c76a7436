"""``TrainingArguments(fp16=True)`` under ``ZeroTrainer`` on 2 real gloo ranks, on CPU.

There is no DDP fp16 run to match on CPU: accelerate turns on neither autocast nor its GradScaler off a GPU
(``Accelerator.native_amp`` stays False), so transformers' Trainer with ``fp16=True`` trains in fp32, bit for bit
the fp32 run, and never scales a loss. An AMP reference (autocast and ``torch.amp.GradScaler``) would not be one
either: it keeps fp32 weights and casts per operation, where ZeroTrainer, as DeepSpeed, computes with fp16 weights
and steps fp32 masters. So the figures are DeepSpeed's own: every logged loss and the saved weights (fp32, from the
masters, in DDP's dtype rule) stay within a few fp16 roundings of the fp32 run (measured 1.3 ``eps``), and a loss
scale that overflows fp16 skips the step as DeepSpeed's does: no parameter moves from the fp32 masters' start (the
model's own fp32 weights, where DeepSpeed copies them after ``module.half()``), the Trainer does not step its scheduler
(``optimizer_step_was_skipped``), and the scale waits one overflow (hysteresis 2) then halves on each.
"""

import math

import hf_models
import hf_trainer_runs as runs
import pytest
import torch
from distributed import run_ranks

pytestmark = pytest.mark.slow
FP16_RTOL = 4 * torch.finfo(torch.float16).eps


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    return run_ranks(runs.fp16_runs, runs.WORLD, str(tmp_path_factory.mktemp("fp16")), timeout=900)[0]


def test_ddp_trainer_fp16_on_cpu_is_its_fp32_run(fp16_runs):
    ddp, ddp_fp16 = fp16_runs["ddp"], fp16_runs["ddp_fp16"]
    assert ddp_fp16["logged"] == ddp["logged"]
    assert all(torch.equal(ddp_fp16["saved"][key], value) for key, value in ddp["saved"].items())


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trainer_fp16_stays_within_fp16_rounding_of_fp32_and_saves_fp32(fp16_runs, stage):
    ddp, zero = fp16_runs["ddp"], fp16_runs[stage]
    assert zero["scheduler_steps"] == runs.STEPS and zero["loss_scale"] == 2.0**16  # no overflow at DeepSpeed's scale
    for step, value in ddp["logged"]["loss"].items():
        assert math.isclose(zero["logged"]["loss"][step], value, rel_tol=FP16_RTOL), step
    assert {value.dtype for value in zero["saved"].values()} == {torch.float32}
    assert any(not torch.equal(zero["saved"][key], value) for key, value in ddp["saved"].items())  # fp16 it was
    for key, value in ddp["saved"].items():
        assert (zero["saved"][key] - value).norm() <= FP16_RTOL * value.norm(), key


def test_zero_trainer_fp16_overflow_skips_the_step_and_the_scheduler(fp16_runs):
    run = fp16_runs["overflow"]  # initial_scale_power 24: every one of the 6 steps overflows
    assert run["scheduler_steps"] == 0
    assert run["loss_scale"] == 2.0 ** (24 - (runs.STEPS - 1))
    # no step taken: the saved weights are the model's own fp32 weights, as DDP's would be (DeepSpeed rounds its
    # masters through module.half() first; Note: [Masters start from the model's own values])
    initial = hf_models.build("llama").state_dict()
    assert all(torch.equal(run["saved"][key], initial[key]) for key in run["saved"])
