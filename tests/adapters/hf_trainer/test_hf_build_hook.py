"""The hook that builds a model sharded when a Hugging Face script builds it after stage-3 arguments
(``ds_strategy.transformers.build_hook``), in one process: what ``from_pretrained`` returns while armed and after, and
where each tensor of a fused-expert checkpoint will be read from. The multi-rank runs are in
tests/adapters/hf_trainer/test_hf_script_order.py and tests/adapters/hf_trainer/test_hf_sharded_loading.py.
"""

import hf_models
import hf_sharded_loading_runs
import pytest
import torch
import transformers

from ds_strategy.accelerate.accelerator import DEFERRED_BUILD_ATTR
from ds_strategy.transformers import build_hook, building_whole, sharded_from_pretrained
from ds_strategy.transformers.hf_weights import _Converted, _Initialised, _Stored


class _Arguments:
    """Stands in for the ``TrainingArguments`` whose life arms the hook."""


@pytest.fixture(scope="module")
def causal_lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("hook") / "llama"
    hf_models.build("llama", seed=5).save_pretrained(path)
    return path


def _classifier(path, seed: int = 3):
    torch.manual_seed(seed)
    model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=3, output_loading_info=True
    )
    return model, info, torch.get_rng_state()


def test_armed_from_pretrained_builds_on_meta_as_from_pretrained_reports_and_draws(causal_lm):
    whole, whole_info, whole_rng = _classifier(causal_lm)
    arguments = _Arguments()
    build_hook.arm(arguments)
    try:
        model, info, rng = _classifier(causal_lm)
        with building_whole():
            assert not _classifier(causal_lm)[0].score.weight.is_meta
    finally:
        build_hook.disarm(arguments)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert info == whole_info and info["missing_keys"] == {"score.weight"}
    assert torch.equal(rng, whole_rng)  # the new head was drawn as from_pretrained draws it
    plan = getattr(model, DEFERRED_BUILD_ATTR).weights.plan
    assert isinstance(plan["score.weight"], _Initialised) and torch.equal(
        plan["score.weight"].value, whole.score.weight
    )
    assert isinstance(plan["model.norm.weight"], _Stored)
    assert not build_hook.armed() and not _classifier(causal_lm)[0].score.weight.is_meta


def test_armed_for_as_long_as_the_arguments_live():
    arguments = _Arguments()
    build_hook.arm(arguments)
    assert build_hook.armed()
    del arguments
    assert not build_hook.armed()


def test_fused_experts_are_read_through_transformers_converters(tmp_path):
    hf_sharded_loading_runs.save_checkpoints(tmp_path)
    model = sharded_from_pretrained(transformers.AutoModelForCausalLM, tmp_path / "qwen3_moe")
    plan = getattr(model, DEFERRED_BUILD_ATTR).weights.plan
    config = transformers.Qwen3MoeConfig(**hf_sharded_loading_runs.QWEN3_MOE)
    fused = plan["model.layers.1.mlp.experts.gate_up_proj"]
    assert isinstance(fused, _Converted)
    assert fused.shape == (config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
    assert [key for _, key in fused.group.sources if "gate_proj" in key][:2] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
    ]
    assert sorted(plan) == sorted(model.state_dict())
