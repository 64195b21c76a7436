"""Expert parallelism (ds_strategy.parallel.expert_parallel) and ZeRO with experts, on real gloo ranks against the
unsharded model."""

import hf_models
import moe_models
import pytest
import torch
from distributed import run_ranks
from expert_parallel_runs import (
    layer_matches_unsharded,
    resumes_at_another_expert_parallel_size,
    zero_with_experts_matches_one_process,
)
from torch import nn

from ds_strategy.parallel.moe_layers import find_experts_containers


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_layers_match_the_unsharded_model(name):
    for result in run_ranks(layer_matches_unsharded, 2, name):
        assert result["loss"] == pytest.approx(result["reference"], abs=1e-5)
        assert result["grad_diff"] < 1e-5
        assert sum(sum(counts) for counts in result["routed"].values()) > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "stage", "ep", "fields"),
    [
        ("qwen3_moe", 3, 2, {}),
        ("deepseek_v3", 2, 4, {}),
        ("qwen3_moe", 1, 4, {}),
        ("deepseek_v3", 3, 2, {"activation_checkpointing": "full"}),
        ("qwen3_moe", 2, 2, {"activation_checkpointing": "selective"}),
        ("qwen3_moe", 2, 2, {"offload_optimizer": "cpu"}),
        ("deepseek_v3", 3, 2, {"offload_optimizer": "cpu", "offload_params": "cpu"}),
    ],
)
def test_zero_with_experts_matches_one_process(name, stage, ep, fields):
    results = run_ranks(zero_with_experts_matches_one_process, 4, name, stage, ep, timeout=300, **fields)
    _assert_trains_as_one_process(results, fields)


@pytest.mark.slow
def test_experts_offloaded_to_nvme_train_as_one_process(tmp_path):
    """Each rank's swap files hold its own experts' shards (their sizes differ from the other parameters' units)."""
    fields = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": str(tmp_path)}
    results = run_ranks(zero_with_experts_matches_one_process, 4, "qwen3_moe", 3, 2, timeout=300, **fields)
    _assert_trains_as_one_process(results, fields)


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "ep"), [(3, 2), (2, 4)])
def test_a_model_built_on_meta_starts_as_a_normal_build_and_trains_as_one_process(stage, ep):
    """Sharded construction: each rank initialises its experts' rows of every whole container, as a normal build
    draws them, and keeps only those (Note: [A sharded build equals a normal build])."""
    results = run_ranks(zero_with_experts_matches_one_process, 4, "qwen3_moe", stage, ep, on_meta=True, timeout=300)
    _assert_trains_as_one_process(results, {})


def _assert_trains_as_one_process(results: list[dict], fields: dict) -> None:
    assert results[0]["initial_equal"]
    for result in results:
        assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-5)
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-5)
    assert results[0]["weight_diff"] < 1e-5
    assert results[0]["comm"]["all_to_all"]["bytes"] > 0  # the token exchange is counted in comm_stats
    offloaded = fields.get("offload_optimizer", "none") != "none"
    assert results[0]["step_runner"] == ("OffloadedStep" if offloaded else "DeviceStep")
    assert (results[0]["checkpointed"] > 0) == ("activation_checkpointing" in fields)


def test_experts_containers_are_found_in_transformers_moe_models():
    import transformers

    found = {
        name: [(n, m.num_experts) for n, m in find_experts_containers(moe_models.build(name))]
        for name in ("qwen3_moe", "deepseek_v3")
    }
    assert found["qwen3_moe"] == [(f"model.layers.{i}.mlp.experts", moe_models.EXPERTS) for i in (0, 1)]
    assert found["deepseek_v3"] == [("model.layers.1.mlp.experts", moe_models.EXPERTS)]  # layer 0 is dense
    mixtral = transformers.MixtralForCausalLM(hf_models.config("mixtral"))
    assert [n for n, _ in find_experts_containers(mixtral)] == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]


class _PerExpertMoe(nn.Module):
    """One module per expert, the layout expert parallelism refuses."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


def test_one_module_per_expert_is_refused_by_name():
    with pytest.raises(ValueError, match="keeps one module per expert \\('experts'\\)"):
        find_experts_containers(_PerExpertMoe())
    with pytest.raises(ValueError, match="has no experts container"):
        find_experts_containers(nn.Linear(4, 4))


@pytest.mark.slow
def test_checkpoint_saved_at_one_expert_parallel_size_resumes_at_another(tmp_path):
    results = run_ranks(resumes_at_another_expert_parallel_size, 4, "qwen3_moe", str(tmp_path), timeout=300)
    for result in results:
        for ep in (4, 1):
            for key, value in result["saved"].items():
                assert torch.equal(result[ep]["loaded"][key], value), (ep, key)
            assert result[ep]["loss"] == pytest.approx(result["loss"], abs=1e-6)
            for key, value in result["after"].items():
                torch.testing.assert_close(result[ep]["after"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    consolidated, saved = results[0]["consolidated"], results[0]["saved"]
    assert consolidated.keys() == saved.keys()  # every expert under the model's own names: [num_experts, ...]
    for key, value in saved.items():
        assert torch.equal(consolidated[key], value), key
