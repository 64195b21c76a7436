"""``ZeroStrategy(state_dict_type="full")``, FSDP's meaning: ``lightning_module_state_dict()`` and ``optimizer_state()``
whole on rank 0 and empty elsewhere, ``trainer.save_checkpoint`` one file as DDP writes it; that file resumes a fit at
another stage, and one device's Trainer resumes from it too, each as one process continues (issue 45, item 3)."""

import lightning.pytorch as pl
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from test_full_state_dict import BATCH, _model, _optimizer
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy import ZeroStrategy

HALF, STEPS = 2, 4
X = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(3))  # every step's global batch


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = _model()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return _optimizer(self.model)


def _trainer(strategy, devices: int, max_steps: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        **QUIET,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )


def _loader(rows: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(rows), batch_size=len(rows))  # one batch an epoch: the same every step


def _fit_save_resume(rank: int, world_size: int, path: str) -> dict:
    set_lightning_environment(rank)
    mine = _loader(X[rank * BATCH // world_size : (rank + 1) * BATCH // world_size])
    trainer = _trainer(ZeroStrategy(stage=2, state_dict_type="full"), world_size, HALF)
    trainer.fit(Module(), mine)
    sizes = (
        len(trainer.strategy.lightning_module_state_dict()),
        len(trainer.strategy.optimizer_state(trainer.optimizers[0])),
    )
    trainer.save_checkpoint(path)
    resumed = _trainer(ZeroStrategy(stage=3, state_dict_type="full"), world_size, STEPS)
    resumed.fit(Module(), mine, ckpt_path=path)
    return {"sizes": sizes, "final": resumed.strategy.engine.full_state_dict(rank0_only=False)}


def _one_process() -> dict:
    model = _model()
    optimizer = _optimizer(model)
    for _ in range(STEPS):
        model(X).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.slow
def test_full_checkpoint_is_one_file_that_resumes_under_zero_and_on_one_device(tmp_path):
    path = str(tmp_path / "half.ckpt")
    ranks = run_ranks(_fit_save_resume, 2, path, timeout=300)
    assert [run["sizes"][0] > 0 for run in ranks] == [True, False]  # whole on rank 0, empty elsewhere
    assert [run["sizes"][1] > 0 for run in ranks] == [True, False]
    saved = torch.load(path)  # one file, plain types only
    assert saved["global_step"] == HALF and len(saved["optimizer_states"]) == 1
    assert sorted(saved["optimizer_states"][0]["state"]) == [1, 2, 4, 5]  # 0 and 3, the frozen layer, have none
    expected = _one_process()
    one_device = _trainer("auto", 1, STEPS)
    module = Module()
    one_device.fit(module, _loader(X), ckpt_path=path)
    finals = [{k.removeprefix("model."): v for k, v in run["final"].items()} for run in ranks]
    for final in [*finals, module.model.state_dict()]:
        for name, value in expected.items():
            torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)
