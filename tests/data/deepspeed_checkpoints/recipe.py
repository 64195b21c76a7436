"""What the DeepSpeed fixtures were trained on, shared by ``make_fixtures.py`` (with DeepSpeed) and
``tests/deepspeed_compat/test_deepspeed_checkpoint_import.py`` (without it): the model, the data, the optimizer and the cases.

A one-block GPT of a few thousand parameters: tied embeddings (an alias in the checkpoint), two optimizer param
groups (decay and no decay), and sizes that do not divide by the world size (so DeepSpeed pads partitions).
"""
from __future__ import annotations

import torch

from ds_strategy.data import random_token_batch
from ds_strategy.models import GPT, GPTConfig, weight_decay_groups

CONFIG = GPTConfig(vocab_size=23, block_size=8, n_layer=1, n_head=3, n_embd=15)
GLOBAL_BATCH = 8
SAVE_AT = 2  # optimizer steps DeepSpeed took before saving the fixture
CONTINUE = 3  # steps DeepSpeed took after loading it again: the recorded reference
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.99), 1e-6, 0.1
DEEPSPEED_WORLD_SIZE = 2

# name -> (ZeRO stage, DeepSpeed precision section or None for fp32, ds_strategy precision)
CASES = {
    "zero1_fp32": (1, None, "32-true"),
    "zero2_fp32": (2, None, "32-true"),
    "zero3_fp32": (3, None, "32-true"),
    "zero2_bf16": (2, {"bf16": {"enabled": True}}, "bf16-mixed"),
    "zero3_bf16": (3, {"bf16": {"enabled": True}}, "bf16-mixed"),
    # A loss scale of 2**16 overflows fp16 in the first step (skipped, the scale halves), so the scaler state
    # saved is not its initial one. The window is long enough that the scale never grows: DeepSpeed 0.19.8
    # ZeRO-1/2 unscales a growth step's gradients by the already doubled scale, halving them, which ds_strategy
    # does not copy (see [Tolerances against DeepSpeed] in tests/deepspeed_compat/test_deepspeed_checkpoint_import.py).
    "zero2_fp16": (2, {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000,
                                "hysteresis": 1, "min_loss_scale": 1}}, "16-mixed"),
}
FP16_SCALER = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1.0}


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def build_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS)


def global_batches(steps: int = SAVE_AT + CONTINUE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1234)
    return [random_token_batch(generator, GLOBAL_BATCH, CONFIG.block_size, CONFIG.vocab_size) for _ in range(steps)]


def rank_slice(batch, rank: int, world_size: int):
    rows = GLOBAL_BATCH // world_size
    return tuple(t[rank * rows:(rank + 1) * rows] for t in batch)
