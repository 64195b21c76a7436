"""Fabric under pipelining with a model whose LM head is tied to its embedding, and the optimizer built before
``fabric.setup`` (the user's usual order). The cut leaves the last stage holding the tied weight under the head's
name only; the optimizer must follow it there (Note: [An optimizer built before composition]) and the run must
equal one process, as Lightning's pipelined runs do (``tests/parallel/test_pipeline_parallel.py``)."""

import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from pipeline_runs import assert_matches, batches, loss_fn, mean_over_dp, tiny_gpt, train_reference

STEPS, GLOBAL_BATCH = 2, 4
pytestmark = pytest.mark.slow  # a 2-rank Fabric run: not in the fast tier


def _train(rank: int, world_size: int, stage: int) -> dict:
    import lightning as L

    from ds_strategy import ZeroFabricStrategy

    torch.set_num_threads(1)
    set_lightning_environment(rank)
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=stage, pipeline_parallel_size=2)
    )
    fabric.launch()
    torch.manual_seed(0)
    model = tiny_gpt()
    assert model.lm_head.weight is model.embed.wte.weight
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    losses = []
    for x, y in batches("gpt", STEPS, GLOBAL_BATCH):
        loss = fabric.strategy.pipeline_step(model, x, y, loss_fn)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_dp(loss, fabric.strategy.parallel_mesh))
    engine = fabric.strategy.engine
    state = engine.full_state_dict(rank0_only=False)
    held = dict(engine.module.named_parameters())
    return {
        "losses": losses,
        "norms": [],
        "params": {k: v for k, v in state.items() if k in held},
        "tied": dict(engine.saved_as),
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_a_tied_model_with_an_early_optimizer_trains_as_one_process(stage):
    results = run_ranks(_train, 2, stage, timeout=300)
    assert any(result["tied"] for result in results)  # the last stage holds the head as a copy of the embedding
    assert_matches(results, train_reference("gpt", STEPS, GLOBAL_BATCH))
