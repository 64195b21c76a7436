"""The training run the checkpoint tests save and resume: TinyGPT under a ZeRO config, on fixed global batches.

Every run trains on the same STEPS global batches (GLOBAL_BATCH rows, split evenly across however many ranks there
are), so a resumed run can be compared bit for bit with an uninterrupted one.
"""

import models
import torch
import torch.distributed as dist

from ds_strategy.checkpoint import save
from ds_strategy.config import ZeroConfig
from ds_strategy.offload import step_runner_for
from ds_strategy.zero.engine import ZeroEngine

STEPS, GLOBAL_BATCH = 4, 8
CONFIGS = {
    "zero1": {"stage": 1},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3, "param_persistence_threshold": 0},
    "zero3_offload": {
        "stage": 3,
        "param_persistence_threshold": 0,
        "offload_optimizer": "cpu",
        "offload_params": "cpu",
    },
    "zero2_bf16": {"stage": 2, "precision": "bf16-mixed"},
    # A loss scale of 2**17 overflows the first two steps, which are skipped: the scaler's state at the
    # checkpoint is not its initial state, so resuming exactly needs it restored.
    "zero2_fp16": {"stage": 2, "precision": "16-mixed", "initial_scale_power": 17, "hysteresis": 1},
}


def build(config: str):
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    zero = ZeroConfig(**CONFIGS[config])
    return model, ZeroEngine(model, optimizer, zero, step_runner=step_runner_for(zero))


def global_batches() -> list:
    generator = torch.Generator().manual_seed(1234)
    return [models.TinyGPT.make_batch(generator, GLOBAL_BATCH) for _ in range(STEPS)]


def train(model, engine: ZeroEngine, batches: list) -> list[float]:
    """One optimizer step per global batch (clipped); returns the global mean loss of each step."""
    rows = GLOBAL_BATCH // engine.world_size
    losses = []
    for batch in batches:
        loss = model(tuple(t[engine.rank * rows : (engine.rank + 1) * rows] for t in batch))
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        total = loss.detach().float()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / engine.world_size)
    return losses


def saved_after_one_step(path):
    """A one-rank zero2 TinyGPT after one step, saved at ``path``; returns ``(path, model, engine)``."""
    model, engine = build("zero2")
    train(model, engine, global_batches()[:1])
    save(path, model, engine)
    return path, model, engine
