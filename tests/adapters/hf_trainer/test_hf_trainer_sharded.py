"""``sharded_from_pretrained`` under ``ZeroTrainer`` stage 3, and generation from the stage-3 model, on 2 gloo ranks.

A tiny Llama is saved with ``save_pretrained`` in several safetensors shards. DDP's Trainer trains it loaded with
``from_pretrained``; ZeroTrainer at stage 3 trains it built on meta by ``sharded_from_pretrained``, its weights read
sharded when the Trainer's accelerator prepares it (tests/adapters/hf_trainer/hf_trainer_sharded_runs.py). Then the
stage-3 model generates greedily, by ``model.generate`` and inside TRL's ``unwrap_model_for_generation``, and must
produce what the weights it saved produce in one process, also when the ranks ask for different lengths (the rank done
first keeps running forwards, as transformers' ``synced_gpus`` makes it under DeepSpeed ZeRO-3, or the others' gathers
would hang).
"""

import math

import hf_models
import hf_trainer_sharded_runs as runs
import pytest
import torch
import transformers
from distributed import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer_sharded")
    hf_models.build("llama", seed=5).save_pretrained(tmp / "pretrained", max_shard_size="20KB")
    results = run_ranks(runs.sharded_load_and_generation, 2, str(tmp / "pretrained"), str(tmp), timeout=600)
    return tmp, results


def test_sharded_from_pretrained_trains_like_from_pretrained_on_ddp(sharded_run):
    tmp, results = sharded_run
    assert len(list((tmp / "pretrained").glob("model-*.safetensors"))) > 2
    for rank in results:
        assert rank["on_meta_before_prepare"]  # no rank built or read the whole model before prepare
        assert rank["sharded_after"]
        for key, values in rank["ddp"].items():
            assert sorted(rank["zero"][key]) == sorted(values), key
            for step, value in values.items():
                assert math.isclose(rank["zero"][key][step], value, rel_tol=1e-6, abs_tol=1e-7), (key, step)
        assert "ModuleDict.inner was built by sharded_from_pretrained and then wrapped" in rank["wrapped_error"]


def test_stage3_generate_equals_generation_from_the_saved_weights(sharded_run):
    tmp, results = sharded_run
    one_process = transformers.AutoModelForCausalLM.from_pretrained(tmp / "final")
    want = runs.generate(one_process, pad_token_id=0)
    assert want.shape == (2, 5 + runs.NEW_TOKENS)
    for number, rank in enumerate(results):
        assert torch.equal(rank["generated"], want)
        assert torch.equal(rank["generated_uneven"], runs.uneven_generate(one_process, number))
        assert torch.equal(rank["generated_trl"], want)
        assert torch.equal(rank["generated_gathered"], want)
        assert rank["layers_freed_after_generate"]
        assert rank["layers_held_in_block"] and rank["layers_freed_after_block"]
