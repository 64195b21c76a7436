"""Expert parallelism (ds_strategy.parallel.expert_parallel) and ZeRO with experts, on real gloo ranks against the
unsharded model."""

import pytest
from distributed import run_ranks
from expert_parallel_runs import layer_matches_unsharded, zero_with_experts_matches_one_process


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_layers_match_the_unsharded_model(name):
    for result in run_ranks(layer_matches_unsharded, 2, name):
        assert result["loss"] == pytest.approx(result["reference"], abs=1e-5)
        assert result["grad_diff"] < 1e-5
        assert sum(sum(counts) for counts in result["routed"].values()) > 0


@pytest.mark.slow
@pytest.mark.parametrize(("name", "stage", "ep"), [("qwen3_moe", 3, 2), ("deepseek_v3", 2, 4), ("qwen3_moe", 1, 4)])
def test_zero_with_experts_matches_one_process(name, stage, ep):
    results = run_ranks(zero_with_experts_matches_one_process, 4, name, stage, ep, timeout=300)
    for result in results:
        assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-5)
        assert result["norms"] == pytest.approx(result["reference_norms"], rel=1e-5)
    assert results[0]["weight_diff"] < 1e-5
