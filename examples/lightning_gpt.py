"""The LightningModule, data loader and summary callback that ``train.py`` and ``train_deepspeed_json.py`` share."""

import lightning as L
import torch
from run_summary import RunSummary
from torch.utils.data import DataLoader

from ds_strategy.data import CharDataset, stdlib_tokens
from ds_strategy.lightning import grad_norm
from ds_strategy.models import GPT, GPTConfig


def char_loader(config: GPTConfig, corpus_bytes: int, batch_size: int, num_workers: int = 0) -> DataLoader:
    """Shuffled windows of the standard library's source, tokenised to the model's vocabulary."""
    dataset = CharDataset(stdlib_tokens(config.vocab_size, corpus_bytes), config.block_size)
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers)


class CharGPT(L.LightningModule):
    """Next-character prediction with AdamW, no weight decay on biases and norms."""

    def __init__(self, config: GPTConfig, lr: float, weight_decay: float):
        super().__init__()
        self.gpt = GPT(config)
        self.lr, self.weight_decay = lr, weight_decay
        self.last_loss = torch.zeros(())

    def training_step(self, batch, batch_idx):
        _, loss = self.gpt(*batch)
        self.last_loss = loss.detach()
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.gpt.optimizer_param_groups(self.weight_decay), lr=self.lr)


class SummaryCallback(L.Callback):
    """Records one rank-averaged loss and the gradient norm before clipping per optimizer step into a RunSummary and
    shows tokens/s in the progress bar."""

    def __init__(self, entry_point: str, batch_size: int, block_size: int):
        self.entry_point, self.batch_size, self.block_size = entry_point, batch_size, block_size
        self.summary: RunSummary | None = None
        self._step_loss = torch.zeros(())
        self._grad_norm = torch.zeros(())

    def on_train_start(self, trainer, pl_module):
        accumulate = trainer.accumulate_grad_batches
        tokens_per_step = self.batch_size * self.block_size * accumulate * trainer.world_size
        self.summary = RunSummary(self.entry_point, tokens_per_step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._grad_norm = grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]  # Lightning clips after this hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        accumulate = trainer.accumulate_grad_batches
        self._step_loss = self._step_loss + pl_module.last_loss.cpu() / accumulate
        if (batch_idx + 1) % accumulate == 0:
            loss = trainer.strategy.reduce(self._step_loss.to(pl_module.device), reduce_op="mean")
            pl_module.log("tokens_per_s", self.summary.record(loss.item(), self._grad_norm.item()), prog_bar=True)
            self._step_loss = torch.zeros(())
