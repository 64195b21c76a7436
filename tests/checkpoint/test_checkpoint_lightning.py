"""The Trainer's own checkpointing under ZeroStrategy: ModelCheckpoint's directories, pruning, and exact resume.

``Trainer(devices=2)`` relaunches ``sys.argv`` for its second rank, so the Trainer runs in a subprocess executing
this file as a script (``main`` below); the tests read what rank 0 wrote. One script run does two fits in one
process group: an uninterrupted 4-step fit whose ModelCheckpoint saves every step and keeps the last three, then a
fresh module (other initial weights) resumed by ``fit(ckpt_path=...)`` from the step-2 checkpoint.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from e2e_runs import run

STEPS, RESUME_FROM, ROWS_PER_RANK = 4, 2, 4


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    run(
        [sys.executable, __file__, str(out)],
        timeout=300,
        cwd=out,
        env={"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent)] + sys.path)},
    )
    return out, torch.load(out / "result.pt", weights_only=False)


def test_model_checkpoint_writes_directories_and_prunes_to_save_top_k(fits):
    out, _ = fits
    assert sorted(os.listdir(out / "ckpts")) == ["step=2.ckpt", "step=3.ckpt", "step=4.ckpt"]
    assert {"manifest.json", "meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} == set(
        os.listdir(out / "ckpts" / "step=2.ckpt")
    )


def test_fit_resumed_from_checkpoint_equals_uninterrupted_fit_bitwise(fits):
    _, result = fits
    uninterrupted, resumed = result["uninterrupted"], result["resumed"]
    assert resumed["losses"] == uninterrupted["losses"][RESUME_FROM:]
    assert resumed["lr"] == uninterrupted["lr"]
    assert uninterrupted["final"].keys() == resumed["final"].keys()
    for name, value in uninterrupted["final"].items():
        assert torch.equal(resumed["final"][name], value), name


def main(out: Path) -> None:
    """Both fits; rank 0 writes ``result.pt``."""
    import lightning.pytorch as pl
    import models
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import ds_strategy  # noqa: F401  (registers the "zero2" strategy name)

    class TinyGPTModule(pl.LightningModule):
        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.model = models.TinyGPT()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(models.param_groups(self.model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def on_train_end(self):
            self.final = self.trainer.strategy.engine.full_state_dict(rank0_only=False)
            self.lr = self.trainer.optimizers[0].param_groups[0]["lr"]

    def loader():
        # One optimizer step per epoch, the rows reshuffled each epoch: resuming at a step boundary is exact.
        batch = models.TinyGPT.make_batch(torch.Generator().manual_seed(1234), 2 * ROWS_PER_RANK)
        return DataLoader(TensorDataset(*batch), batch_size=ROWS_PER_RANK, shuffle=True)

    def trainer(**kwargs):
        return pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="zero2",
            max_steps=STEPS,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )

    checkpoints = ModelCheckpoint(
        dirpath=out / "ckpts", filename="{step}", every_n_train_steps=1, save_top_k=3, monitor="step", mode="max"
    )
    uninterrupted = TinyGPTModule(seed=0)
    trainer(callbacks=[checkpoints]).fit(uninterrupted, loader())
    resumed = TinyGPTModule(seed=1)
    fit = trainer(enable_checkpointing=False)
    fit.fit(resumed, loader(), ckpt_path=out / "ckpts" / f"step={RESUME_FROM}.ckpt")
    if fit.global_rank == 0:
        torch.save(
            {
                name: {"losses": m.losses, "final": m.final, "lr": m.lr}
                for name, m in (("uninterrupted", uninterrupted), ("resumed", resumed))
            },
            out / "result.pt",
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
