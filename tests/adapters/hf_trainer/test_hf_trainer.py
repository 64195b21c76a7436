"""``ZeroTrainer`` (and TRL's ``ZeroSFTTrainer``) against transformers' own Trainer on DDP, on 2 real gloo ranks.

Same tiny Llama, data and arguments (accumulation 2, clip 1.0, evaluation and checkpoints every 3 of 6 steps; see
tests/adapters/hf_trainer/hf_trainer_runs.py). Figures: every logged training loss, gradient norm and evaluation loss;
the weights ``save_model`` writes, which must be whole tensors in DDP's dtype, equal bit for bit to the engine's own
gathered fp32 weights, and load with ``from_pretrained`` bit for bit; and a resume from ``checkpoint-3`` that must
reproduce the uninterrupted run's steps 4-6 and final weights, at stages 2 and 3 and on one rank.

Note: [Which stages save DDP's weights bit for bit]
Every rank computes the same per-micro-batch gradients as DDP (same module, same data). DDP accumulates the two
micro-batches locally (under ``no_sync``) and all-reduces once, each rank's sum multiplied by 1/2 first; for 2
ranks ``a/2 + b/2 == (a + b)/2`` exactly, and a sum of two values is commutative. Stage 1 reduces the local sum
once too (a reduce-scatter, then /2), and the gradient norms here stay under ``max_grad_norm`` so neither side
scales them: its weights equal DDP's bit for bit. Stages 2 and 3 cannot without giving up what they are for:
they keep no full gradient between micro-batches, so each micro-batch is reduced on its own and the shard holds
``(a1 + b1)/2 + (a2 + b2)/2`` where DDP has ``((a1 + a2) + (b1 + b2))/2``; and when clipping is active (accumulation
1 gives norms above 1.0) the global norm is summed from the shards' squares, in another order than
``torch.nn.utils.clip_grad_norm_``'s norm of per-tensor norms, so the clip factor can differ by an ulp (measured:
equal for 4 steps, 1 ulp apart at step 5). Matching either would need the whole gradient on every rank. Each
rounding perturbs a step's gradient by about ``eps`` = 2^-23 relative; Adam's normalised update carries that into
the weights at the same relative size; over the run's 6 steps (plus the clip factor) that bounds the difference by
``(STEPS + 2) * eps`` ~ 1e-6 relative per tensor (measured: 1.4e-7). What stage 2/3 ``save_model`` must not do is
lose anything of its own weights: it equals the engine's gathered fp32 state bit for bit.
"""

import json
import math
import types

import hf_models
import hf_trainer_runs as runs
import pytest
import torch
import transformers
from distributed import run_ranks
from safetensors.torch import load_file

from ds_strategy import checkpoint, cli

pytestmark = pytest.mark.slow
RTOL = (runs.STEPS + 2) * torch.finfo(torch.float32).eps  # see Note: [Which stages save DDP's weights bit for bit]


def _assert_logged_equal(got: dict, want: dict, steps=None) -> None:
    for key, values in want.items():
        for step, value in values.items():
            if steps is None or step in steps:
                assert math.isclose(got[key][step], value, rel_tol=RTOL, abs_tol=1e-7), (key, step)


def _assert_weights_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert (got[key] - value).norm() <= RTOL * value.norm() + 1e-7, key


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    return tmp, run_ranks(runs.stages_match_ddp, runs.WORLD, str(tmp), timeout=900)[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trainer_logs_and_saves_what_ddp_trainer_does(stage_runs, stage):
    _, results = stage_runs
    ddp, zero = results["ddp"], results[stage]
    _assert_logged_equal(zero["logged"], ddp["logged"])
    assert sorted(zero["logged"]["eval_loss"]) == [3, 6]
    _assert_weights_close(zero["saved"], ddp["saved"])  # stage 3 used to save 18 of 21 tensors with shape [0]
    for key, value in zero["saved"].items():
        assert torch.equal(value, zero["gathered"][key]), key  # the export loses nothing of the engine's weights
        assert torch.equal(zero["reloaded"][key], value), key
        if stage == 1:  # see Note: [Which stages save DDP's weights bit for bit]
            assert torch.equal(value, ddp["saved"][key]), key


def test_bf16_training_saves_fp32_weights_as_ddp_does(stage_runs):
    _, results = stage_runs
    saved = results["bf16"]["saved"]
    assert {value.dtype for value in saved.values()} == {torch.float32}  # the engine computes in bf16 copies
    assert saved.keys() == results["ddp"]["saved"].keys()


def test_load_best_model_at_end_reads_the_best_checkpoint_into_the_shards(stage_runs):
    _, results = stage_runs
    run = results["best3"]
    best = run["best"]  # the lower of the eval losses at steps 3 and 6
    steps = run["logged"]["eval_loss"]
    assert best.endswith(f"checkpoint-{min(steps, key=steps.get)}")
    for key, value in load_file(f"{best}/model.safetensors").items():
        assert torch.equal(run["saved"][key], value), key


def test_lora_at_stage_3_trains_as_ddp_and_saves_only_the_adapters(stage_runs):
    _, results = stage_runs
    ddp, zero = results["lora_ddp"], results["lora3"]
    _assert_logged_equal(zero["logged"], ddp["logged"])
    assert zero["files"] == ddp["files"] and "model.safetensors" not in zero["files"]
    _assert_weights_close(zero["saved"], ddp["saved"])


def test_zero_sft_trainer_logs_and_saves_what_trl_sft_trainer_does_on_ddp(tmp_path):
    results = run_ranks(runs.sft_stages_match_ddp, runs.WORLD, str(tmp_path), timeout=900)[0]
    ddp = results["ddp"]
    for stage in (1, 2, 3):
        _assert_logged_equal(results[stage]["logged"], ddp["logged"])
        _assert_weights_close(results[stage]["saved"], ddp["saved"])


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(stage_runs, stage):
    _, results = stage_runs
    whole, resumed = results[stage], results[f"resumed{stage}"]
    # steps 1-3 of the resumed history are checkpoint-3's trainer_state.json; 4-6 are the resumed run's own
    _assert_logged_equal(resumed["logged"], whole["logged"], steps={4, 5, 6})
    _assert_weights_close(resumed["saved"], whole["saved"])


def test_full_state_dict_checkpoints_are_ddp_trainer_checkpoints_and_resume_at_another_stage(tmp_path):
    results = run_ranks(runs.full_state_dict_runs, runs.WORLD, str(tmp_path), timeout=900)[0]
    ddp, full = results["ddp"], results["full2"]
    _assert_logged_equal(full["logged"], ddp["logged"])
    written, want = (tmp_path / name / f"checkpoint-{runs.EVERY}" for name in ("full2", "ddp"))
    assert not (written / "zero_checkpoint").exists()
    _assert_weights_close(load_file(written / "model.safetensors"), load_file(want / "model.safetensors"))
    saved, expected = (torch.load(path / "optimizer.pt") for path in (written, want))
    assert [g["params"] for g in saved["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    for key, state in expected["state"].items():
        for name, value in state.items():
            assert torch.allclose(saved["state"][key][name], value, rtol=1e-5, atol=1e-8), (key, name)
    for source in ("ddp", "full2"):
        resumed = results[f"resumed_{source}"]
        _assert_logged_equal(resumed["logged"], ddp["logged"], steps={4, 5, 6})
        _assert_weights_close(resumed["saved"], ddp["saved"])


def test_resume_on_one_rank_from_a_two_rank_checkpoint(stage_runs):
    tmp, results = stage_runs
    one_rank = run_ranks(runs.resume_at_one_rank, 1, str(tmp), timeout=600)[0]
    for stage, resumed in one_rank.items():
        _assert_logged_equal(resumed["logged"], results[stage]["logged"], steps={4, 5, 6})
        _assert_weights_close(resumed["saved"], results[stage]["saved"])


def test_hf_deepspeed_json_with_auto_and_optimizer_sections_trains_as_deepspeed_would(tmp_path):
    results = run_ranks(runs.deepspeed_json_runs, runs.WORLD, str(tmp_path), timeout=600)[0]
    _assert_logged_equal(results["zero"]["logged"], results["ddp"]["logged"])
    assert results["no_deepspeed_plugin"]


def test_pipelining_is_refused_under_the_trainer():
    """Its loop runs the whole model on each batch: a cut model would not run at all."""
    from ds_strategy.transformers.trainer_config import trainer_zero_config

    args = types.SimpleNamespace(
        parallelism_config=None, gradient_accumulation_steps=1, max_grad_norm=1.0, per_device_train_batch_size=2
    )
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported under the Hugging Face Trainer"):
        trainer_zero_config({"pipeline_parallel_size": 2}, args)


def test_a_deepspeed_value_that_contradicts_the_training_arguments_is_refused_naming_both():
    from ds_strategy.transformers import fill_from_training_args

    # TrainingArguments' fields that are read, without starting accelerate's distributed state in this process
    precision = dict(fp16=False, fp16_full_eval=False, bf16=False, bf16_full_eval=False)
    adam = dict(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, learning_rate=1e-2)
    batch = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, world_size=2, max_grad_norm=1.0)
    args = types.SimpleNamespace(**precision, **adam, **batch)
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 16, "optimizer": {"params": {}}}
    config["optimizer"]["params"]["lr"] = "auto"
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=16 vs hf per_device_train_batch_size=2"):
        fill_from_training_args(config, args)
    assert fill_from_training_args({**config, "train_micro_batch_size_per_gpu": "auto"}, args)["optimizer"] == {
        "params": {"lr": 1e-2}
    }


def test_consolidate_hf_exports_a_trainer_checkpoint_that_from_pretrained_loads_whole(stage_runs, tmp_path):
    tmp, _ = stage_runs
    step = tmp / "zero3" / f"checkpoint-{runs.EVERY}"  # its config.json sits beside zero_checkpoint/
    assert cli.main(["consolidate", str(step / "zero_checkpoint"), str(tmp_path / "hf"), "--hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for key, value in load_file(step / "model.safetensors").items():
        assert torch.equal(loaded[key], value), key


class _LightningLike(torch.nn.Module):
    """A Hugging Face model held as ``self.backbone`` beside another submodule, as a LightningModule holds it."""

    def __init__(self):
        super().__init__()
        self.backbone = hf_models.build("llama")
        self.probe = torch.nn.Linear(2, 2)


def test_consolidate_hf_strips_the_module_prefix_shards_and_refuses_names_that_do_not_fit(tmp_path):
    module = _LightningLike()
    checkpoint.save(tmp_path / "ckpt", module)
    module.backbone.save_pretrained(tmp_path / "pretrained")  # the config a user trained from
    out = tmp_path / "hf"
    args = ["consolidate", str(tmp_path / "ckpt"), str(out), "--hf", "--config", str(tmp_path / "pretrained")]
    assert cli.main([*args, "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(loaded[key], value) for key, value in module.backbone.state_dict().items())
    # another prefix would leave every weight missing, which from_pretrained would initialise randomly
    assert cli.main([*args[:2], str(tmp_path / "wrong"), *args[3:], "--prefix", "probe."]) == 1
    assert not (tmp_path / "wrong").exists()
