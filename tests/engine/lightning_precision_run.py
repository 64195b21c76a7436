"""One rank of two Lightning fits under ZeroStrategy, launched by ``test_mixed_precision.py`` (not a test module).

The test starts this script once per rank with LOCAL_RANK/WORLD_SIZE/MASTER_* set, which Lightning treats as an
external launcher, so both fits run in one process group without Lightning relaunching the script:

1. ``Trainer(strategy="zero2", precision="bf16-mixed")``: bf16 compute weights beside fp32 master shards.
2. fp16 with dynamic loss scaling (``ZeroStrategy(precision="16-mixed")``, as Lightning turns a CPU
   ``precision="16-mixed"`` flag into bf16), with an inf injected into rank 1's gradient at ``INJECT_AT``.

Each rank writes what it saw to ``<out>/<fit>-rank<r>.json``.
"""

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ds_strategy.lightning import ZeroStrategy
from ds_strategy.models import GPT, gpt_config

STEPS = 5
INJECT_AT = 2  # batch index whose gradient gets an inf on rank 1
# Plain SGD, whose step follows the gradient: the bf16 fit's losses are then one process's under autocast to bf16
# rounding (AdamW at this rate moves every weight by about lr whatever its gradient, and bf16-rounded gradients near
# zero flip those steps: the losses drifted 4% apart in 5 steps)
LR = 0.5


def _text_windows(count: int) -> TensorDataset:
    """Windows of this file's own text, as printable-ASCII ids: data with something to learn."""
    block = gpt_config("tiny").block_size
    ids = (torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long) - 32).clamp(0, 95)
    starts = torch.arange(count) * 7 % (len(ids) - block - 1)
    return TensorDataset(
        torch.stack([ids[s : s + block] for s in starts]), torch.stack([ids[s + 1 : s + block + 1] for s in starts])
    )


class TinyGPTModule(pl.LightningModule):
    def __init__(self, inject_at: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(gpt_config("tiny"))
        self.inject_at = inject_at
        self.losses, self.params_around_injection = [], {}

    def training_step(self, batch, batch_idx):
        if batch_idx == self.inject_at and self.global_rank == 1:
            self._inject_inf_on_rank0_shard()
        _, loss = self.model(*batch)
        self.losses.append(loss.item())
        return loss

    def _inject_inf_on_rank0_shard(self) -> None:
        """An inf in this rank's gradient of the first element of a flat buffer, which rank 0's shard holds:
        only rank 0 sees it after the reduction, so rank 1 skips only if the ranks agree on the overflow."""
        param = self.trainer.strategy.engine.flat_params[-1].params[0]
        handle = None

        def poison(grad):
            handle.remove()
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        handle = param.register_hook(poison)

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == self.inject_at:
            self.params_around_injection["before"] = self._flat_params()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if batch_idx == self.inject_at:
            self.params_around_injection["after"] = self._flat_params()

    def _flat_params(self) -> torch.Tensor:
        self.trainer.strategy.engine.wait_for_params()
        return torch.cat([p.detach().float().flatten() for p in self.parameters()])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(_text_windows(64), batch_size=4)


def _trainer(strategy, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def fit_bf16_mixed() -> dict:
    module = TinyGPTModule()
    trainer = _trainer("zero2", precision="bf16-mixed")
    trainer.fit(module)
    engine = trainer.strategy.engine
    return {
        "losses": module.losses,
        "precision": trainer.precision_plugin.precision,
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "master_dtypes": sorted({str(fp.master.dtype) for fp in engine.flat_params}),
        "memory": engine.memory_report(),
        "global_step": trainer.global_step,
    }


def fit_fp16_with_injected_overflow() -> dict:
    module = TinyGPTModule(inject_at=INJECT_AT)
    strategy = ZeroStrategy(stage=2, precision="16-mixed", initial_scale_power=8, hysteresis=1)
    trainer = _trainer(strategy, log_every_n_steps=1)
    trainer.fit(module)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    around = module.params_around_injection
    return {
        "losses": module.losses,
        "global_step": trainer.global_step,
        "scheduler_last_epoch": scheduler.last_epoch,
        "lr": scheduler.get_last_lr()[0],
        "unchanged_at_injection": bool(torch.equal(around["before"], around["after"])),
        "logged": {k: float(v) for k, v in trainer.logged_metrics.items()},
        "plugin_state": trainer.precision_plugin.state_dict(),
        "checkpoint_state": trainer._checkpoint_connector.dump_checkpoint().get("ZeroPrecision"),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "gate_removed": "lr_scheduler_step" not in vars(module),
    }


def bf16_autocast_reference(world_size: int = 2) -> list[list[float]]:
    """What the bf16-mixed fit's ranks must log, from one process: the same seeded model and optimizer in fp32 under
    bf16 autocast, each step on the batches Lightning's distributed sampler deals the ranks (for training it always
    shuffles, seeded by ``PL_GLOBAL_SEED``, 0 when unset, at epoch 0), the step following the mean of their losses.
    Per rank, the losses of its own batches."""
    module = TinyGPTModule()
    configured = module.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    windows = _text_windows(64)
    loaders = [
        DataLoader(windows, batch_size=4, sampler=DistributedSampler(windows, world_size, rank, shuffle=True, seed=0))
        for rank in range(world_size)
    ]
    losses = [[] for _ in range(world_size)]
    for _, batches in zip(range(STEPS), zip(*loaders)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step_losses = [module.model(*batch)[1].float() for batch in batches]
        torch.stack(step_losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        for rank, loss in enumerate(step_losses):
            losses[rank].append(loss.item())
    return losses


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name, fit in (("bf16", fit_bf16_mixed), ("fp16", fit_fp16_with_injected_overflow)):
        result = fit()
        rank = torch.distributed.get_rank()
        (out / f"{name}-rank{rank}.json").write_text(json.dumps(result))
