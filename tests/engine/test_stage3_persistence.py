"""Stage 3 gathers every parameter a forward reads, whatever stays persistent: trained on 2 gloo ranks at four kinds
of persistence threshold on four Hugging Face models, every loss and parameter equals DDP's under SGD
(tests/engine/stage3_persistence_runs.py).

A unit is a module whose forward hooks gather it (Note: [A unit is a module that runs forward] in
``ds_strategy.zero.wrap_policy``). T5 keeps its blocks in a ``ModuleList``, which auto-detection once chose as the unit:
never called, so never gathered, and its first forward read an empty shard (``size mismatch, got input (32), mat
(32x16), vec (0)`` in block 0's ``q``) at any threshold that partitioned a block's parameters, ``"auto"`` included;
with every parameter below the threshold nothing was partitioned and it trained. A parameter a unit shares with a
module outside every unit (BERT's word embedding, tied to the MLM head) belongs to the root, gathered for the whole
step: its unit is freed after its own forward, before the head reads it.
"""

import hf_models
import pytest
import stage3_persistence_runs as runs
import transformers
from distributed import run_ranks
from torch import nn

from ds_strategy.zero.wrap_policy import select_unit_modules


@pytest.fixture(scope="module")
def threshold_runs():
    return run_ranks(runs.thresholds_match_ddp, 2, timeout=600)


@pytest.mark.slow
def test_tiny_t5_at_the_auto_threshold_trains_like_ddp(threshold_runs):
    for rank in threshold_runs:
        t5 = rank["t5"]
        auto = t5["runs"]["auto"]
        assert auto["threshold"] == 10 * runs.T5["d_model"] and auto["mixed_unit"]
        assert auto["unit_classes"] == ["T5Block"]
        hf_models.assert_trains_like_ddp(auto["trained"], t5["ddp"], "t5 auto")


@pytest.mark.slow
@pytest.mark.parametrize("model", runs.MODELS)
def test_stage3_equals_ddp_at_every_persistence_threshold(threshold_runs, model):
    for rank in threshold_runs:
        result = rank[model]
        assert result["runs"]["split"]["mixed_unit"]  # the threshold splits a unit, as the property needs
        for label, run in result["runs"].items():
            hf_models.assert_trains_like_ddp(run["trained"], result["ddp"], f"{model} {label}")


def test_a_container_never_becomes_a_unit():
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(**runs.T5))
    assert {type(module).__name__ for _, module in select_unit_modules(t5)} == {"T5Block"}
    blocks = nn.Sequential(nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 4))
    assert [name for name, _ in select_unit_modules(blocks, unit_min_params=20)] == ["0.0", "0.1", "0.2", "1"]
    with pytest.raises(ValueError, match="unit_modules names ModuleList .* a container without a forward"):
        select_unit_modules(t5, unit_modules=("ModuleList",))
