"""TRL's ``ZeroDPOTrainer`` against TRL's ``DPOTrainer`` on DDP, on 2 real gloo ranks.

The same tiny Llama as policy and, built alike, as reference model; preference texts of random word tokens and the
word-level tokenizer the SFT test uses (no downloads); the arguments of tests/hf_trainer_runs.py in fp32. DDP keeps
the reference model whole on every rank; ZeroDPOTrainer keeps it whole at stage 2 and shards it at stage 3 with an
engine of its own without an optimizer, as TRL's ``prepare_deepspeed`` does under DeepSpeed. Its gathered forward
computes the reference log-probabilities DDP's whole copy computes, so every logged figure must agree to the
tolerance of the SFT comparison (tests/test_hf_trainer.py says why it is not zero).
"""

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
    assert results[2]["ref_engine"] is None  # whole on every rank, as prepare_deepspeed's stage 0
    assert results[3]["ref_engine"] == (3, None)  # sharded, without an optimizer
    assert "sync_ref_model=True needs whole parameters, but ZeRO stage 3" in results["sync_refused"]
