"""Fabric with expert parallelism and the optimizer built before ``fabric.setup`` (the user's usual order): the
experts each rank keeps are new parameters, which the optimizer must follow by name (Note: [An optimizer built before
composition]); 4 ranks, ep=2, stage 2, against one process on the global batches."""

import moe_models
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from expert_parallel_runs import _batch

STEPS = 3
pytestmark = pytest.mark.slow  # a 4-rank Fabric run: not in the fast tier


def _train(rank: int, world_size: int) -> dict:
    import lightning as L

    from ds_strategy import ZeroFabricStrategy

    set_lightning_environment(rank)
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=2, expert_parallel_size=2)
    )
    fabric.launch()
    model = moe_models.build("qwen3_moe")
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    losses = []
    for step in range(STEPS):
        _, mine = _batch(rank, world_size, seed=step)
        loss = model(input_ids=mine, labels=mine).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return {"losses": losses, "state": fabric.strategy.engine.full_state_dict()}


def test_fabric_with_an_early_optimizer_and_expert_parallelism_trains_as_one_process():
    results = run_ranks(_train, 4, timeout=300)
    reference = moe_models.build("qwen3_moe")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(STEPS):
        everything, _ = _batch(0, 4, seed=step)
        loss = reference(input_ids=everything, labels=everything).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert results[0]["losses"] == pytest.approx(losses, abs=1e-5)
    for key, value in reference.state_dict().items():
        assert (results[0]["state"][key] - value).norm() <= 1e-5 * value.norm() + 1e-6, key
