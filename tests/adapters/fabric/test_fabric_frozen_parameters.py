"""A partly frozen model under Fabric as litgpt's LoRA sets it up: built under ``init_module(empty_init=True)`` (on
meta at stage 3), then ``setup_module``, then ``setup_optimizers`` of an AdamW over ``model.parameters()``, frozen ones
included. Each stage trains as one process does (torch's AdamW skips a parameter without a gradient), and the
all-frozen ``nn.Linear`` built on meta is initialised as a normal build initialises it (issue 45, items 1-2). The
composition matrix runs the same over every entry point on a Hugging Face model (``FROZEN_CELLS``)."""

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from torch import nn

from ds_strategy import ZeroFabricStrategy

STEPS, BATCH = 3, 8
RUNS = ((0, False), (1, False), (2, False), (3, False), (3, True))  # (stage, empty_init)


def _model() -> nn.Sequential:
    """Its first layer frozen: a module with no trainable parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH, 4, generator=generator) for _ in range(STEPS)]


def _fit(rank: int, world_size: int) -> dict:
    set_lightning_environment(rank)
    states = {}
    for stage, empty_init in RUNS:
        fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(stage=stage))
        fabric.launch()
        with fabric.init_module(empty_init=empty_init):
            model = _model()
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
        initial = fabric.strategy.engine.full_state_dict(rank0_only=False)
        per_rank = BATCH // world_size
        for x in _batches():
            fabric.backward(model(x[rank * per_rank : (rank + 1) * per_rank]).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        states[stage, empty_init] = (initial, fabric.strategy.engine.full_state_dict(rank0_only=False))
    return states


def _reference() -> tuple[dict, dict]:
    model = _model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for x in _batches():
        (model(x[: BATCH // 2]).pow(2).mean() / 2 + model(x[BATCH // 2 :]).pow(2).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    return initial, model.state_dict()


@pytest.mark.slow
def test_optimizer_over_a_partly_frozen_model_set_up_after_it_trains_as_one_process():
    ranks = run_ranks(_fit, 2, timeout=300)
    initial, final = _reference()
    for states in ranks:
        for run in RUNS:
            got_initial, got_final = states[run]
            for name, value in initial.items():
                assert torch.equal(got_initial[name], value), (run, name)
            for name, value in final.items():
                torch.testing.assert_close(got_final[name], value, rtol=1e-6, atol=1e-7, msg=f"{run} {name}")
    assert torch.equal(final["0.weight"], initial["0.weight"])
