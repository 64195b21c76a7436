"""The Lightning adapter: Trainer(strategy="zero*") with Lightning's own accumulation and clipping trains exactly
like one unsharded process, keeps a process group it did not create, and reports sharded memory."""

import lightning as L
import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from torch.utils.data import DataLoader, Subset, TensorDataset

import ds_strategy  # noqa: F401  (registers the strategy names)

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

STEPS, ACCUMULATE, BATCH, WORLD = 4, 2, 4, 2


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x, y = models.MLP.make_batch(generator, STEPS * ACCUMULATE * BATCH * WORLD)
    return TensorDataset(x, y)


class MLPModule(L.LightningModule):
    """The MLP, built in configure_model (on the meta device under zero3) and trained with two param groups."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def configure_model(self):
        if not hasattr(self, "net"):
            torch.manual_seed(0)
            self.net = models.MLP()

    def training_step(self, batch, batch_idx):
        loss = self.net(batch)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.net(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(models.param_groups(self.net), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)


def _fit(rank: int, world_size: int, strategy: str) -> dict:
    set_lightning_environment(rank)
    if strategy == "zero3-partition-all":  # every tensor partitioned, built on the meta device by configure_model
        strategy = ds_strategy.ZeroStrategy(stage=3, param_persistence_threshold=0)
    module = MLPModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        val_check_interval=ACCUMULATE * 2,
        **QUIET,
        use_distributed_sampler=False,
    )
    mine = Subset(_dataset(), range(rank, len(_dataset()), world_size))  # what a DistributedSampler gives rank r
    trainer.fit(module, DataLoader(mine, batch_size=BATCH), DataLoader(mine, batch_size=BATCH))
    return {
        "state": trainer.strategy.engine.full_state_dict(rank0_only=False),
        "memory": trainer.strategy.memory_report(),
        "group_alive": dist.is_initialized(),
        "losses": torch.stack(module.losses),
        "val_loss": trainer.callback_metrics["val_loss"].item(),
    }


def _reference(param_groups=models.param_groups) -> dict:
    """Rank r trains on the samples r, r + N, r + 2N, ... in order."""
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    x, y = _dataset().tensors
    for micro in range(STEPS * ACCUMULATE):
        slices = []
        for rank in range(WORLD):
            index = [rank + WORLD * (micro * BATCH + j) for j in range(BATCH)]
            slices.append((x[index], y[index]))
        (torch.stack([model(s) for s in slices]).mean() / ACCUMULATE).backward()
        if micro % ACCUMULATE == ACCUMULATE - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return {f"net.{k}": v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "zero3-partition-all"])
def test_trainer_with_accumulation_and_clipping_matches_single_process(strategy):
    ranks = run_ranks(_fit, WORLD, strategy, timeout=180)
    reference = _reference()
    assert ranks[0]["state"].keys() == reference.keys()
    for key, value in reference.items():
        error = (ranks[0]["state"][key] - value).norm() / value.norm()
        assert error < 1e-5, f"{key}: relative error {error:.2e}"
    for rank in ranks:
        assert rank["group_alive"], "the strategy destroyed a process group it did not create"
        assert rank["losses"][-ACCUMULATE:].mean() < rank["losses"][:ACCUMULATE].mean()
        assert rank["val_loss"] == ranks[0]["val_loss"]
        optimizer_bytes = sum(rank["memory"]["optimizer"].values())
        psi = sum(v.numel() for v in reference.values())
        assert optimizer_bytes <= 0.55 * 8 * psi + 4 * 8 * WORLD  # Adam's two moments, 1/N of them, + padding
