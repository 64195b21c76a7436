"""The GPT LightningModule and standard-library DataModule that ``ds-strategy autotune --model`` tunes.

Any LightningModule and DataModule can be tuned; these exist so the command needs no user code. Factories
are module-level functions (``functools.partial`` of them is fine) because trials pickle them by reference.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from ..data import CharDataset, stdlib_tokens
from ..models import GPT, gpt_config
from ..optional_packages import needs

# the autotuner's trials are Lightning runs: without Lightning, fail here saying what to install
with needs("lightning", needed_by="ds_strategy.autotune"):
    import lightning as L


class GPTTask(L.LightningModule):
    """Next-byte prediction with AdamW, no weight decay on biases and norms."""

    def __init__(self, preset: str = "tiny", lr: float = 3e-4, weight_decay: float = 0.1):
        super().__init__()
        self.config = gpt_config(preset)
        self.gpt = GPT(self.config)
        self.lr, self.weight_decay = lr, weight_decay

    def training_step(self, batch, batch_idx):
        _, loss = self.gpt(*batch)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.gpt.optimizer_param_groups(self.weight_decay), lr=self.lr)


class StdlibTextData(L.LightningDataModule):
    """Shuffled windows of the standard library's source (Lightning shards them per rank with its distributed
    sampler); ``batch_size`` is the attribute a tuner sets."""

    def __init__(self, preset: str = "tiny", batch_size: int = 4, corpus_bytes: int = 500_000):
        super().__init__()
        self.config = gpt_config(preset)
        self.batch_size, self.corpus_bytes = batch_size, corpus_bytes

    def train_dataloader(self) -> DataLoader:
        dataset = CharDataset(stdlib_tokens(self.config.vocab_size, self.corpus_bytes), self.config.block_size)
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=True, drop_last=True)


def gpt_task(preset: str = "tiny") -> GPTTask:
    return GPTTask(preset)


def stdlib_data(preset: str = "tiny") -> StdlibTextData:
    return StdlibTextData(preset)
