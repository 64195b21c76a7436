"""Expert parallelism (ds_strategy.parallel.expert_parallel) and ZeRO with experts, on real gloo ranks against the
unsharded model."""

import pytest
from distributed import run_ranks
from expert_parallel_runs import layer_matches_unsharded


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_layers_match_the_unsharded_model(name):
    for result in run_ranks(layer_matches_unsharded, 2, name):
        assert result["loss"] == pytest.approx(result["reference"], abs=1e-5)
        assert result["grad_diff"] < 1e-5
        assert sum(sum(counts) for counts in result["routed"].values()) > 0
