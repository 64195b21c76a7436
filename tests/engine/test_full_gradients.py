"""Per-parameter gradients at every stage (issue 45, item 7): ``engine.full_grad(param)`` (DeepSpeed's
``safe_get_full_grad``) equals one process's ``param.grad``, ``engine.grad_norms()`` its per-parameter norms in one
collective, and ``ds_strategy.lightning.grad_norm(self, 2)`` in ``on_before_optimizer_step`` what Lightning's
``grad_norm`` logs for the same model in one process (where ``param.grad`` is None at stage 2/3)."""

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from quiet_trainer import QUIET
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy import ZeroStrategy
from ds_strategy.config import ZeroConfig
from ds_strategy.lightning import grad_norm
from ds_strategy.zero.engine import ZeroEngine

BATCH, STAGES = 8, (0, 1, 2, 3)
X = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(2))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].requires_grad_(False)
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _model()
        self.norms = None

    def training_step(self, batch, batch_idx):
        return _loss(self.model, batch[0])

    def on_before_optimizer_step(self, optimizer):
        self.norms = grad_norm(self, norm_type=2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _gradients(rank: int, world_size: int) -> dict:
    set_lightning_environment(rank)
    mine = X[rank * BATCH // world_size : (rank + 1) * BATCH // world_size]
    outcome = {}
    for stage in STAGES:
        model = _model()
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=stage))
        engine.backward(_loss(model, mine))
        outcome[stage] = {
            "grads": {name: engine.full_grad(p) for name, p in model.named_parameters()},
            "norms": engine.grad_norms(2.0),
            "inf_norms": engine.grad_norms("inf"),
        }
        engine.step()
        engine.remove_hooks()
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(stage=3),
        max_steps=1,
        **QUIET,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(mine), batch_size=len(mine)))
    outcome["lightning"] = module.norms
    return outcome


@pytest.mark.slow
def test_full_grad_and_grad_norms_equal_one_process_param_grad_at_every_stage():
    ranks = run_ranks(_gradients, 2, timeout=300)
    model = _model()
    (_loss(model, X[: BATCH // 2]) / 2 + _loss(model, X[BATCH // 2 :]) / 2).backward()
    module = Module()
    module.model.load_state_dict(model.state_dict())
    for p, q in zip(module.parameters(), model.parameters()):
        p.grad = q.grad
    expected_lightning = lightning_grad_norm(module, norm_type=2)
    for outcome in ranks:
        for stage in STAGES:
            got = outcome[stage]
            assert got["norms"].keys() == {n for n, p in model.named_parameters() if p.requires_grad}
            for name, p in model.named_parameters():
                if p.grad is None:
                    assert got["grads"][name] is None, name  # frozen: no gradient, as under torch
                    continue
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-5, atol=1e-7, msg=f"{stage} {name}")
                torch.testing.assert_close(got["norms"][name], p.grad.norm(), rtol=1e-5, atol=1e-7)
                torch.testing.assert_close(got["inf_norms"][name], p.grad.abs().max(), rtol=1e-5, atol=1e-7)
        assert outcome["lightning"].keys() == expected_lightning.keys()
        for key, value in expected_lightning.items():
            torch.testing.assert_close(outcome["lightning"][key], value, rtol=1e-5, atol=1e-7, msg=key)
