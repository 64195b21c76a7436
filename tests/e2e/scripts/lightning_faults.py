"""A 2-rank ``Trainer(devices=2, strategy=ZeroStrategy(stage=2))`` fit on CPU that rank 1 disrupts at step
``FAULT_STEP``, for ``tests/e2e/test_rank_failure.py`` and ``tests/e2e/test_preemption.py``.

    python lightning_faults.py MODE OUT_DIR

MODE ``raise``, ``oom`` or ``sigkill``: in its training_step, rank 1 writes ``OUT_DIR/failed_at`` (its clock) and
raises a ValueError, raises ``torch.OutOfMemoryError``, or SIGKILLs itself, while rank 0 goes on into the step's
collectives. ``collective_timeout`` is ``TIMEOUT`` (300 s), so a run that ends quickly was not timed out.
MODE ``save_sigkill``: a ``ModelCheckpoint`` saves after every step (and ``last.ckpt``); rank 1 SIGKILLs itself as it
starts writing its shard of step ``FAULT_STEP``'s checkpoint (the operator's report of issue 51).
MODE ``sigterm``: rank 1 sends itself SIGTERM in its training_step of step ``FAULT_STEP``; the job must save
``OUT_DIR/ckpts/last.ckpt`` at the end of that step and exit.
MODE ``resume``: ``fit(ckpt_path="last")`` from that checkpoint to ``STEPS``, then, in the same process group, an
uninterrupted fit from the same initial weights; rank 0 writes both runs' losses and final weights to
``OUT_DIR/result.pt``.
"""

import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ds_strategy.checkpoint.storage import ChecksummedWriter
from ds_strategy.lightning import ZeroStrategy

STEPS, FAULT_STEP, ROWS_PER_RANK, WIDTH = 4, 2, 4, 32
TIMEOUT = 300.0


class Regression(pl.LightningModule):
    """Four Linear units; rank 1 acts out ``mode`` in the training_step of step ``FAULT_STEP`` (1-based)."""

    def __init__(self, mode: str, out: Path):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)))
        self.mode, self.out = mode, out
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.global_step + 1 == FAULT_STEP:
            self._disrupt()
        x, y = batch
        loss = (self.layers(x) - y).square().mean()
        self.losses.append(loss.item())
        return loss

    def on_train_start(self):
        if self.mode == "save_sigkill" and self.global_rank == 1:
            write_data = ChecksummedWriter.write_data

            def killed_while_writing(writer, *args, **kwargs):
                if self.trainer.global_step == FAULT_STEP:
                    Path(self.out, "failed_at").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                return write_data(writer, *args, **kwargs)

            ChecksummedWriter.write_data = killed_while_writing

    def _disrupt(self) -> None:
        if self.mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.mode not in ("raise", "oom", "sigkill"):
            return
        Path(self.out, "failed_at").write_text(repr(time.time()))
        if self.mode == "raise":
            raise ValueError("rank 1 broke its training_step on purpose")
        if self.mode == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_end(self):
        self.final = self.trainer.strategy.engine.full_state_dict(rank0_only=False)


def loader() -> DataLoader:
    """One optimizer step per epoch, the rows reshuffled each epoch (as in test_checkpoint_lightning)."""
    generator = torch.Generator().manual_seed(1234)
    rows = 2 * ROWS_PER_RANK
    data = TensorDataset(torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator))
    return DataLoader(data, batch_size=ROWS_PER_RANK, shuffle=True)


def trainer(out: Path, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ZeroStrategy(stage=2, collective_timeout=TIMEOUT),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        **kwargs,
    )


def main(mode: str, out: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=out / "ckpts", save_top_k=0)
    if mode == "save_sigkill":
        checkpoints = ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=1, save_top_k=-1, save_last=True)
    if mode != "resume":
        trainer(out, callbacks=[checkpoints]).fit(Regression(mode, out), loader())
        return
    resumed = Regression(mode, out)
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    for p in resumed.parameters():
        nn.init.normal_(p)
    fit = trainer(out, callbacks=[checkpoints])
    fit.fit(resumed, loader(), ckpt_path="last")
    uninterrupted = Regression(mode, out)
    trainer(out, enable_checkpointing=False).fit(uninterrupted, loader())
    if fit.global_rank == 0:
        torch.save(
            {
                name: {"losses": m.losses, "final": m.final}
                for name, m in (("uninterrupted", uninterrupted), ("resumed", resumed))
            },
            out / "result.pt",
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], Path(sys.argv[2]))
