"""A DeepSpeed JSON config as a Lightning user brings it from Lightning's DeepSpeed strategy (issue 26, item 8): every
DeepSpeed scheduler resumes from ``last_batch_iteration`` as DeepSpeed's own classes do, and a config ``optimizer``
section beside a ``configure_optimizers`` that returns one trains with the config's, with a warning, as Lightning's
DeepSpeed strategy does."""

import importlib
import os
import warnings

import lightning as L
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from test_deepspeed_optimizer_sections import SCHEDULES, STEPS, NoOptimizerModule, _dataset, _formula, _lrs
from torch.utils.data import DataLoader

from ds_strategy import ZeroStrategy
from ds_strategy.config.deepspeed.optimizer_section import read_optimizer_sections
from ds_strategy.config.deepspeed.translate import DeepSpeedConfigWarning

RESUMED_AT = 6


def _ours(name: str, last_batch_iteration: int):
    params = {**SCHEDULES[name], "last_batch_iteration": last_batch_iteration}
    return _lrs(read_optimizer_sections(None, {"type": name, "params": params}).build_scheduler)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_resumes_from_last_batch_iteration(name):
    lrs, _ = _ours(name, RESUMED_AT)
    expected = [_formula(name, i) for i in range(RESUMED_AT, RESUMED_AT + STEPS + 1)]
    assert lrs == pytest.approx(expected, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", SCHEDULES)
def test_resumed_schedule_steps_as_deepspeeds_own_class(name):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the oracle, installed by the test extra: never skipped
    lr_schedules = importlib.import_module("deepspeed.runtime.lr_schedules")
    params = {**SCHEDULES[name], "last_batch_iteration": RESUMED_AT}
    theirs = _lrs(lambda optimizer: getattr(lr_schedules, name)(optimizer, **params))
    ours = _ours(name, RESUMED_AT)
    # DeepSpeed leaves a resumed optimizer's lr as loaded until the first step; from then on both agree.
    assert ours[0][1:] == pytest.approx(theirs[0][1:], rel=1e-12, abs=1e-15)
    assert [x for b in ours[1][1:] for x in b] == pytest.approx([x for b in theirs[1][1:] for x in b], rel=1e-12)


def test_last_batch_iteration_below_minus_one_names_the_key():
    sections = read_optimizer_sections(None, {"type": "WarmupLR", "params": {"last_batch_iteration": -2}})
    with pytest.raises(ValueError, match=r"scheduler\.params\.last_batch_iteration=-2 is not allowed"):
        sections.build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


# -- a config optimizer section beside configure_optimizers --------------------------------------------------------
CONFIG = {
    "zero_optimization": {"stage": 1},
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 4}},
}


class OwnOptimizerAndSchedulerModule(NoOptimizerModule):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


def _fit_with_both(rank: int, world_size: int) -> dict:
    set_lightning_environment(rank)
    warnings.simplefilter("ignore", DeepSpeedConfigWarning)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        max_steps=2,
        **QUIET,
        strategy=ZeroStrategy.from_deepspeed_config(CONFIG),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OwnOptimizerAndSchedulerModule(), DataLoader(_dataset(), batch_size=4))
    return {
        "optimizers": [type(opt).__name__ for opt in trainer.optimizers],
        "schedulers": [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs],
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.slow
def test_config_optimizer_beside_configure_optimizers_trains_with_the_configs_and_warns():
    (outcome,) = run_ranks(_fit_with_both, 1, timeout=240)
    assert outcome["optimizers"] == ["AdamW"]
    assert outcome["schedulers"] == [
        "WarmupLR"
    ]  # DeepSpeed's class name; the module's StepLR stepped the SGD now unused
    assert any(
        "configure_optimizers returned SGD" in w and "training uses the config's optimizer" in w and "1 LR" in w
        for w in outcome["warnings"]
    ), outcome["warnings"]
