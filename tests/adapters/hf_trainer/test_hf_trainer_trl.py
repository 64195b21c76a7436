"""TRL's ``ZeroDPOTrainer`` and ``ZeroGRPOTrainer`` against TRL's ``DPOTrainer`` and ``GRPOTrainer`` on DDP, on 2 real
gloo ranks.

The same tiny Llama as policy and, built alike, as reference model (GRPO also scores with a tiny Llama reward model
beside a reward function); word-token texts and the word-level tokenizer the SFT test uses (no downloads); the
arguments of tests/adapters/hf_trainer/hf_trainer_runs.py in fp32. DDP keeps the reference model whole on every rank;
the ZeRO trainers keep it whole at stage 2 and shard it at stage 3 with an engine of its own without an optimizer, as
TRL's ``prepare_deepspeed`` does under DeepSpeed (GRPO's reward model too). Their gathered forwards compute the
log-probabilities and rewards DDP's whole copies compute, and GRPO's sampled generation at stage 3 (each unit gathered
per token) draws the same completions, so every logged figure must agree to the tolerance of the SFT comparison
(Note: [Which stages save DDP's weights bit for bit] in tests/adapters/hf_trainer/test_hf_trainer.py says why
it is not zero).
"""

import hf_models
import hf_trainer_runs as runs
import pytest
from distributed import run_ranks
from test_hf_trainer import _assert_logged_equal, _assert_weights_close

pytestmark = pytest.mark.slow


def test_zero_dpo_trainer_logs_and_saves_what_trl_dpo_trainer_does_on_ddp(tmp_path):
    results = run_ranks(runs.dpo_stages_match_ddp, runs.WORLD, str(tmp_path), timeout=900)[0]
    ddp = results["ddp"]
    assert sorted(ddp["logged"]["eval_loss"]) == [3, 6]
    for stage in (2, 3):
        _assert_logged_equal(results[stage]["logged"], ddp["logged"])
        _assert_weights_close(results[stage]["saved"], ddp["saved"])
    assert results[2]["frozen_engines"] == [
        None
    ]  # the reference model whole on every rank: prepare_deepspeed's stage 0
    assert results[3]["frozen_engines"] == [(3, None)]  # sharded, without an optimizer
    assert "sync_ref_model=True needs whole parameters, but ZeRO stage 3" in results["sync_refused"]


def test_zero_grpo_trainer_at_stage_3_logs_and_saves_what_trl_grpo_trainer_does_on_ddp(tmp_path):
    hf_models.build("llama").save_pretrained(tmp_path / "pretrained")  # TRL builds GRPO's reference model from it
    args = (str(tmp_path), str(tmp_path / "pretrained"))
    results = run_ranks(runs.grpo_stage3_matches_ddp, runs.WORLD, *args, timeout=900)[0]
    ddp, zero = results["ddp"], results[3]
    assert len(ddp["logged"]["loss"]) == runs.STEPS
    _assert_logged_equal(zero["logged"], ddp["logged"])
    _assert_weights_close(zero["saved"], ddp["saved"])
    assert zero["frozen_engines"] == [(3, None), (3, None)]  # the reference and the reward model
