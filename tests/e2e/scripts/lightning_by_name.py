"""``Trainer(strategy=NAME)`` on 2 CPU processes with the Lightning package named on the command line.

    python lightning_by_name.py lightning.pytorch zero2 OUT_DIR
    python lightning_by_name.py pytorch_lightning zero1 OUT_DIR
    python lightning_by_name.py pytorch_lightning zero0 OUT_DIR 8    # 8 steps (30 by default)

Each package's Trainer accepts only its own classes, so the module, callback and Trainer all come from the named
package. Writes the examples' ``summary.json`` to OUT_DIR.
"""

import importlib
import sys
from pathlib import Path

import torch

import ds_strategy  # noqa: F401  (registers the zero* names with both packages)

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from lightning_gpt import char_loader  # noqa: E402
from run_summary import RunSummary  # noqa: E402

from ds_strategy.lightning import grad_norm  # noqa: E402
from ds_strategy.models import GPT, gpt_config  # noqa: E402

package, strategy_name, out_dir = sys.argv[1:4]
max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 30
pl = importlib.import_module(package)
CONFIG = gpt_config("tiny")
BATCH = 16


class CharGPT(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.gpt = GPT(CONFIG)

    def training_step(self, batch, batch_idx):
        _, loss = self.gpt(*batch)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.gpt.optimizer_param_groups(0.1), lr=3e-3)


class Recorder(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.summary = RunSummary(
            f"{package} strategy={strategy_name!r}", BATCH * CONFIG.block_size * trainer.world_size
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad_norm = grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(pl_module.last_loss, reduce_op="mean").item()
        self.summary.record(loss, self.grad_norm.item())


pl.seed_everything(0)  # the same weights and batches as its stage-0 reference run (tests/e2e/e2e_runs.py)
recorder = Recorder()
trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=strategy_name,
    max_steps=max_steps,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    callbacks=[recorder],
)
module = CharGPT()
trainer.fit(module, char_loader(CONFIG, 200_000, BATCH))
recorder.summary.finish(
    trainer.strategy.memory_report(),
    trainer.strategy.config.stage,
    sum(p.numel() for p in module.parameters()),
    out_dir,
)
