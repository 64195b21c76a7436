"""A Lightning user moving from ``ModelParallelStrategy`` as its docs teach it: the model built in ``__init__``,
``configure_model`` calling torch's ``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``, trains on
``ZeroStrategy(tensor_parallel_size=2)`` at every ZeRO stage exactly as one process trains the same model. At stage
3 ``configure_model`` runs inside the build context that puts new parameters on the meta device; the weights
``parallelize_module`` re-registers as DTensors were made before it and must keep their values (issue 42: they were
moved to meta, and the DTensor ones could not even be rebuilt there). The module also carries the habits
Lightning's own ModelParallelStrategy tests exercise: a torchmetrics metric built in ``__init__``, every weight a
DTensor over the tensor-parallel mesh when training starts (the optimizer holds the engine's flat shards instead
of them, unlike under ModelParallelStrategy), and both tensor-parallel ranks reading the same batches.
"""

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchmetrics
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy

STEPS, BATCH, DIM = 2, 2, 32
STAGES = (0, 1, 2, 3)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 64)
        self.w2 = nn.Linear(DIM, 64)
        self.w3 = nn.Linear(64, DIM)

    def forward(self, x):
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def data() -> torch.Tensor:
    return torch.randn(STEPS * BATCH, DIM, generator=torch.Generator().manual_seed(7))


class FeedForwardModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = FeedForward()
        self.metric = torchmetrics.MeanMetric()

    def configure_model(self):
        plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)

    def on_train_start(self):
        tp_mesh = self.device_mesh["tensor_parallel"]
        self.checks = {
            "all_dtensors": all(isinstance(p, DTensor) and p.device_mesh == tp_mesh for p in self.model.parameters()),
            "metric_real": not self.metric.mean_value.is_meta,
        }
        self.initial = self.trainer.strategy.engine.full_state_dict(rank0_only=False)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x)  # the tensor-parallel ranks must read the same batch
        self.checks["same_batches"] = self.checks.get("same_batches", True) and torch.equal(*gathered)
        loss = self.model(x).sum()
        self.metric.update(loss.detach())
        return loss

    def on_train_end(self):
        self.mean_loss = self.metric.compute().item()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


def _fit(stage: int) -> dict:
    torch.manual_seed(0)
    module = FeedForwardModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ds_strategy.ZeroStrategy(stage=stage, tensor_parallel_size=2),
        max_steps=STEPS,
        **QUIET,
    )
    trainer.fit(module, DataLoader(TensorDataset(data()), batch_size=BATCH))
    final = trainer.strategy.engine.full_state_dict(rank0_only=False)
    return {"initial": module.initial, "final": final, "checks": module.checks, "mean_loss": module.mean_loss}


def _fit_stages(rank: int, world_size: int) -> dict:
    set_lightning_environment(rank)
    torch.set_num_threads(1)
    return {stage: _fit(stage) for stage in STAGES}


def _one_process() -> dict:
    torch.manual_seed(0)
    model = FeedForward()
    initial = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters())
    losses = []
    for x in data().split(BATCH):
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    final = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    return {"initial": initial, "final": final, "mean_loss": sum(losses) / len(losses)}


@pytest.mark.slow
def test_parallelize_module_in_configure_model_on_a_model_built_in_init_trains_as_one_process_at_every_stage():
    ranks = run_ranks(_fit_stages, 2, timeout=300)
    expected = _one_process()
    for stage in STAGES:
        for rank, run in enumerate(ranks):
            where = f"stage {stage}, rank {rank}"
            out = run[stage]
            assert out["checks"] == dict.fromkeys(out["checks"], True), (where, out["checks"])
            assert set(out["initial"]) == set(expected["initial"]), where
            for name, value in expected["initial"].items():
                assert torch.equal(out["initial"][name], value), f"{where}: {name} lost the values built in __init__"
            for name, value in expected["final"].items():
                torch.testing.assert_close(out["final"][name], value, rtol=1e-5, atol=1e-6, msg=f"{where}: {name}")
            assert out["mean_loss"] == pytest.approx(expected["mean_loss"], rel=1e-5), where
