"""Models built sharded load as ``from_pretrained`` loads them, on 2 gloo ranks, bitwise
(tests/adapters/hf_trainer/hf_sharded_loading_runs.py): every parameter partitioned at stage 3, each rank reading its
rows.

- A Qwen3-MoE checkpoint written by ``save_pretrained``: its files hold per-expert ``experts.<i>.gate_proj``/
  ``up_proj``/``down_proj``, the model fused ``experts.gate_up_proj``/``down_proj``; transformers' own weight
  converters fuse them, a layer at a time.
- GPT-2 (head tied to the embedding) with three added tokens: ``resize_token_embeddings`` with mean resizing draws
  the new rows from the checkpoint rows' mean and covariance, as on a whole model.
- A Llama base model's checkpoint (no ``model.`` prefix) into ``LlamaForCausalLM``: the names renamed as
  transformers renames them, the untied ``lm_head`` missing, initialised by ``_init_weights`` from the generator
  state ``from_pretrained`` draws it from, reported as newly initialised, then resized with the embedding.
- ``from_config`` under a stage-3 ``ZeroTrainingArguments``: built on meta, prepared into the values a normal build
  from the same seed has.

The generator stands after building where ``from_pretrained`` (and the resize) leaves it, and ``prepare`` does not
move it.
"""

import hf_sharded_loading_runs as runs
import pytest
from distributed import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_sharded_loading")
    runs.save_checkpoints(root)
    assert len(list((root / "qwen3_moe").glob("*.safetensors"))) > 1
    return run_ranks(runs.sharded_equals_from_pretrained, 2, str(root), timeout=600)


@pytest.mark.parametrize("case", list(runs.CASES))
def test_sharded_from_pretrained_equals_from_pretrained_bitwise(loaded, case):
    for rank in loaded:
        result = rank[case]
        assert result["on_meta"] and result["names"] and result["unequal"] == []
        assert result["rng"]
        ours, theirs = result["reports"]
        assert ours == theirs


def test_a_base_checkpoint_reports_the_new_head_as_newly_initialised(loaded):
    ours, _ = loaded[0]["llama_base_to_causal_lm_resized"]["reports"]
    assert ours["missing_keys"] == {"lm_head.weight"} and not ours["unexpected_keys"]


def test_from_config_under_stage_3_arguments_builds_sharded_into_a_normal_build(loaded):
    for rank in loaded:
        assert rank["from_config"]["on_meta"] and rank["from_config"]["unequal"] == []
