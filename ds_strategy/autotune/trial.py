"""One profiling trial on one rank: a few Lightning training steps under one ZeRO configuration, timed.

Runs inside a fresh process started by :func:`~ds_strategy.autotune.launcher.launch_ranks`, whose environment
makes Lightning treat the ranks as launched externally, so the Trainer starts no processes of its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import ZeroConfig
from ..optional_packages import needs
from ..zero.memory_report import PLACES

# the autotuner's trials are Lightning runs: without Lightning, fail here saying what to install
with needs("lightning", needed_by="ds_strategy.autotune"):
    import lightning as L


@dataclasses.dataclass(frozen=True)
class TrialJob:
    """Everything a rank needs to run one trial; factories are pickled by reference (module-level callables)."""

    model_factory: Callable[[], L.LightningModule]
    datamodule_factory: Callable[[], L.LightningDataModule] | None
    config: ZeroConfig
    warmup: int
    steps: int
    accelerator: str = "cpu"
    batch_arg_name: str = "batch_size"


class StepTimer(L.Callback):
    """Start time of every training step, the end of the last one, tokens per step, and peak model-state bytes."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.items_per_step = 0
        self.peak_state_bytes: dict[str, int] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.stamps.append(time.perf_counter())
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        self.items_per_step = first.numel() if torch.is_tensor(first) else 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._sample(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sample(trainer)

    def on_train_end(self, trainer, pl_module):
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.wait_for_params()
        self.stamps.append(time.perf_counter())

    def _sample(self, trainer) -> None:
        report = trainer.strategy.memory_report()
        totals = {place: sum(report[kind][place] for kind in report) for place in PLACES}
        for place, value in totals.items():
            self.peak_state_bytes[place] = max(self.peak_state_bytes.get(place, 0), value)


def set_micro_batch_size(
    model: L.LightningModule, datamodule: L.LightningDataModule | None, name: str, value: int
) -> None:
    """Set the batch-size attribute the way Lightning's ``Tuner.scale_batch_size`` finds it: on the
    DataModule, else on the LightningModule, else in the LightningModule's ``hparams``."""
    for owner in (datamodule, model):
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, value)
            return
    if name in getattr(model, "hparams", {}):
        model.hparams[name] = value
        return
    raise ValueError(
        f"cannot set the micro-batch size: neither the DataModule nor the LightningModule has a "
        f"{name!r} attribute (or hparams entry); add one, or pass batch_arg_name="
    )


def run_trial(rank: int, world_size: int, job: TrialJob) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; return this rank's step times, items per step and peak state bytes."""
    from ..lightning import ZeroStrategy

    model = job.model_factory()
    datamodule = job.datamodule_factory() if job.datamodule_factory is not None else None
    set_micro_batch_size(model, datamodule, job.batch_arg_name, job.config.train_micro_batch_size_per_gpu)
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator=job.accelerator,
        devices=world_size,
        strategy=ZeroStrategy(job.config),
        max_steps=job.warmup + job.steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=datamodule)
    peak_accelerator = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    intervals = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    return {
        "step_seconds": intervals[job.warmup :],
        "items_per_step": timer.items_per_step,
        "peak_state_bytes": timer.peak_state_bytes,
        "peak_accelerator_bytes": peak_accelerator,
    }
