"""Lightning users' tensor-parallel code runs unchanged on ZeroStrategy: ``configure_model`` parallelizes a Hugging
Face Llama over ``self.device_mesh["tensor_parallel"]`` with a plan written as for Lightning's ModelParallelStrategy,
the Trainer's sampler splits batches over the data-parallel ranks only, and training matches one process."""

import hf_models
import lightning as L
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from tensor_parallel_llama import LAYER_PLAN, LLAMA, PER_RANK, STEPS, reference_run, token_data
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import ds_strategy

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier


class LlamaModule(L.LightningModule):
    """``own_plan``: configure_model parallelizes the layers itself; else the strategy's ``tensor_parallel_plan``."""

    def __init__(self, own_plan: bool = True):
        super().__init__()
        self.losses = []
        self.own_plan = own_plan

    def configure_model(self):
        if hasattr(self, "model"):
            return
        self.model = hf_models.build("llama", **LLAMA)
        mesh = self.device_mesh
        self.mesh_names = mesh.mesh_dim_names
        for layer in self.model.model.layers if self.own_plan else ():
            parallelize_module(layer, mesh["tensor_parallel"], LAYER_PLAN)

    def on_fit_start(self):
        self.initial = self.trainer.strategy.engine.full_state_dict(rank0_only=False)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3, eps=1e-6)


def _fit(rank: int, world_size: int, stage: int, tp: int, **tensor_parallel) -> dict:
    """``tensor_parallel``: the strategy's plan fields; none means configure_model applies LAYER_PLAN."""
    set_lightning_environment(rank)
    module = LlamaModule(own_plan=not tensor_parallel)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ds_strategy.ZeroStrategy(stage=stage, tensor_parallel_size=tp, **tensor_parallel),
        max_steps=STEPS,
        **QUIET,
    )
    dp = world_size // tp
    trainer.fit(module, DataLoader(TensorDataset(token_data(dp)), batch_size=PER_RANK))
    losses = torch.stack(module.losses)
    dist.all_reduce(losses, group=trainer.strategy.parallel_mesh.dp_group)
    return {
        "initial": module.initial,
        "state": trainer.strategy.engine.full_state_dict(rank0_only=False),
        "losses": (losses / dp).tolist(),
        "names": module.mesh_names,
        "dtensors": sum(isinstance(p, DTensor) for p in module.parameters()),
    }


@pytest.mark.parametrize(
    "stage, tensor_parallel",
    [(1, {}), (2, {}), (3, {}), (2, {"tensor_parallel_plan": "auto", "sequence_parallel": True})],
    ids=["stage1", "stage2", "stage3", "stage2-auto-plan-sequence-parallel"],
)
def test_configure_model_tensor_parallel_plan_matches_single_process(stage, tensor_parallel):
    ranks = run_ranks(_fit, 2, stage, 2, timeout=300, **tensor_parallel)
    reference = reference_run(dp=1, initial=ranks[0]["initial"])
    for run in ranks:
        assert run["names"] == ("data_parallel", "tensor_parallel")
        norms = 2 * 2 if tensor_parallel.get("sequence_parallel") else 0  # the layers' norms run on sequence shards
        assert run["dtensors"] == 2 * len(LAYER_PLAN) + norms  # the planned weights of both layers (Llama: no biases)
        torch.testing.assert_close(run["losses"], reference["losses"], rtol=1e-5, atol=0)
        for name, expected in reference["state"].items():
            error = ((run["state"][f"model.{name}"] - expected).norm() / expected.norm()).item()
            assert error < 1e-5, f"{name}: relative error {error:.2e}"
