"""Small models for parity tests, each covering a case a ZeRO engine can get wrong.

Every model here has one calling convention so a test can be written once and run over all of them:
``Model.make_batch(generator, batch_size)`` draws a batch from ``generator`` alone, and ``model(batch)``
returns a scalar loss.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ds_strategy.data import random_token_batch
from ds_strategy.models import GPT, GPTConfig, gpt_config, weight_decay_groups


def param_groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    """Two optimizer groups: weight decay for matrices, none for biases and norm weights."""
    return weight_decay_groups(model, weight_decay)


class TinyGPT(GPT):
    """The "tiny" GPT preset (vocab 96, as the printable-ASCII corpus): tied embeddings, many units."""

    def __init__(self):
        super().__init__(gpt_config("tiny"))

    @staticmethod
    def make_batch(generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        config = gpt_config("tiny")
        return random_token_batch(generator, batch_size, config.block_size, config.vocab_size)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        _, loss = super().forward(*batch)
        return loss


def tiny_gpt() -> TinyGPT:
    """A TinyGPT, initialised on the default device (or left unmaterialised under ``torch.device("meta")``)."""
    return TinyGPT()


class _Regression(nn.Module):
    """Mean-squared error of ``predict(x)`` against ``y``, on Gaussian batches of the model's widths."""

    in_features = 8
    out_features = 4

    @classmethod
    def make_batch(cls, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, cls.in_features, generator=generator)
        y = torch.randn(batch_size, cls.out_features, generator=generator)
        return x, y

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.predict(x), y)


class MLP(_Regression):
    """Plain case: Linear layers with biases and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(self.in_features, 16),
            nn.LayerNorm(16),
            nn.GELU(),
            nn.Linear(16, 16),
            nn.GELU(),
            nn.Linear(16, self.out_features),
        )

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _SmallBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class ManySmallBlocks(_Regression):
    """Many units of a few parameters each (``depth`` blocks of Linear(8, 8) + tanh, two param groups each): the
    buckets of gradients and of updated parameters span units."""

    depth = 24

    def __init__(self, depth: int | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(_SmallBlock(self.in_features) for _ in range(depth or self.depth))
        self.head = nn.Linear(self.in_features, self.out_features)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FrozenParamModel(_Regression):
    """The first layer has ``requires_grad=False``: it must get no gradient and never change."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(self.in_features, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, self.out_features)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)))


class UnusedParamModel(_Regression):
    """``unused`` never takes part in forward, so no gradient is ever produced for it."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(self.in_features, self.out_features)
        self.unused = nn.Linear(self.in_features, self.out_features)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class BatchNormModel(_Regression):
    """BatchNorm1d carries buffers (running statistics) that change in forward, besides parameters."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(self.in_features, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, self.out_features)
        )

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class OddSizeModel(_Regression):
    """53 parameters in all, a prime: no world size of 2, 3 or 4 shards it evenly, so padding is exercised."""

    in_features = 6
    out_features = 3

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(self.in_features, 5), nn.Tanh(), nn.Linear(5, self.out_features))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


EDGE_MODELS = (FrozenParamModel, UnusedParamModel, BatchNormModel, OddSizeModel)


class CheckpointedTinyGPT(TinyGPT):
    """Each block runs under non-reentrant activation checkpointing: backward re-runs the block's forward, so a
    stage-3 unit is used again while it is in its backward state."""

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        x = self.embed(idx)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class DeepTinyGPT(GPT):
    """Six tiny blocks: enough units that gathering everything at once is clearly more than the stage-3 bound."""

    config = GPTConfig(vocab_size=96, block_size=32, n_layer=6, n_head=2, n_embd=32)

    def __init__(self):
        super().__init__(self.config)

    @classmethod
    def make_batch(cls, generator: torch.Generator, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return random_token_batch(generator, batch_size, cls.config.block_size, cls.config.vocab_size)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        _, loss = super().forward(*batch)
        return loss
