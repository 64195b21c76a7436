"""A DeepSpeed config's optimizer and scheduler sections: DeepSpeed's optimizer from torch's classes, its LR schedules
step for step (against the formula and against DeepSpeed's own classes), and a Lightning run built from them."""

import importlib
import math
import os
import warnings

import lightning as L
import models
import pytest
import torch
from distributed import run_ranks, set_lightning_environment
from quiet_trainer import QUIET
from torch.utils.data import DataLoader, Subset, TensorDataset

from ds_strategy import ZeroFabricStrategy, ZeroStrategy
from ds_strategy.config.deepspeed.optimizer_section import read_optimizer_sections
from ds_strategy.config.deepspeed.translate import DeepSpeedConfigWarning

STEPS = 40
SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"},
    "WarmupDecayLR": {"total_num_steps": 30, "warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 8},
    "WarmupCosineLR": {
        "total_num_steps": 30,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": 5,
        "cos_min_ratio": 0.01,
        "warmup_type": "linear",
    },
    "OneCycle": {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.1,
        "cycle_first_step_size": 8,
        "cycle_second_step_size": 12,
        "decay_lr_rate": 0.5,
        "decay_step_size": 4,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
        "decay_mom_rate": 0.1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001,
        "lr_range_test_step_size": 5,
        "lr_range_test_step_rate": 2.0,
        "lr_range_test_staircase": True,
    },
}


def _formula(name: str, i: int) -> float:
    """DeepSpeed's documented schedules, written out for the parameters above (i = iteration, -1 before any)."""
    if name == "WarmupLR":
        return 0.01 + 0.09 * min(max(i, 0) / 10, 1.0)
    if name == "WarmupDecayLR":  # log warmup, then linear decay to 0 at step 30
        return 0.1 * (math.log(i + 1) / math.log(8) if 0 <= i < 8 else 0.0 if i < 0 else max(0.0, (30 - i) / 22))
    if name == "WarmupCosineLR":  # base lr 0.5 times the ratio
        if i < 0:
            return 0.0
        if i < 5:
            return 0.5 * (0.1 + 0.9 * i / 5)
        return 0.5 * (0.01 + 0.99 * (1 + math.cos(math.pi * min(1.0, (i - 4) / 25))) / 2)
    if name == "OneCycle":  # up over 8 iterations, down over 12, then min / (1 + 0.5 x intervals of 4)
        t = i + 1
        if t <= 8:
            return 0.01 + 0.09 * t / 8
        if t <= 20:
            return 0.01 + 0.09 * (20 - t) / 12
        return 0.01 / (1 + 0.5 * (t - 20) / 4)
    return 0.001 * (1 + 2.0 * ((i + 1) // 5))  # LRRangeTest, staircase


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.5)


def _lrs(scheduler_factory):
    optimizer = _optimizer()
    scheduler = scheduler_factory(optimizer)
    lrs, betas = [optimizer.param_groups[0]["lr"]], [optimizer.param_groups[0]["betas"]]
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        betas.append(optimizer.param_groups[0]["betas"])
    return lrs, betas


def _ours(name):
    sections = read_optimizer_sections(None, {"type": name, "params": SCHEDULES[name]})
    return _lrs(sections.build_scheduler)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_lr_at_every_step_is_deepspeeds_formula(name):
    lrs, _ = _ours(name)
    assert lrs == pytest.approx([_formula(name, i) for i in range(-1, STEPS)], rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_matches_deepspeeds_own_scheduler_class(name):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the oracle, installed by the test extra: never skipped
    lr_schedules = importlib.import_module("deepspeed.runtime.lr_schedules")
    theirs = _lrs(lambda optimizer: getattr(lr_schedules, name)(optimizer, **SCHEDULES[name]))
    ours = _ours(name)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-12, abs=1e-15)
    # the betas at every step (OneCycle cycles them), flattened: pytest.approx compares no nested sequences
    assert [b for pair in ours[1] for b in pair] == pytest.approx([b for pair in theirs[1] for b in pair], rel=1e-12)


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_built_from_a_scheduler_section_has_deepspeeds_class_name(name):
    """Code written for DeepSpeed checks the class by name (Lightning's DeepSpeed tests: ``WarmupLR``)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    section = {"type": name, "params": SCHEDULES[name]}
    scheduler = read_optimizer_sections(None, section).build_scheduler(optimizer)
    assert type(scheduler).__name__ == name


def _built(optimizer_section):
    return read_optimizer_sections(optimizer_section, None).build_optimizer([torch.nn.Parameter(torch.zeros(2))])


def test_optimizer_section_builds_what_deepspeed_builds():
    adam = _built({"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}})
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0  # adam_w_mode, FusedAdam's wd
    assert tuple(adam.defaults["betas"]) == (0.8, 0.9) and adam.defaults["eps"] == 1e-6
    coupled = _built({"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False, "weight_decay": 0.1}})
    assert type(coupled) is torch.optim.Adam and coupled.defaults["weight_decay"] == 0.1
    torch_adamw = _built({"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}})
    assert type(torch_adamw) is torch.optim.AdamW and torch_adamw.defaults["weight_decay"] == 0.01  # torch's default
    assert type(_built({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}})) is torch.optim.SGD
    assert type(_built({"type": "Adagrad", "params": {"lr": 0.1}})) is torch.optim.Adagrad


def test_all_auto_sections_defer_to_the_programs_optimizer_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sections = read_optimizer_sections(
            {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
            {
                "type": "WarmupDecayLR",
                "params": {
                    "warmup_min_lr": "auto",
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": "auto",
                    "total_num_steps": "auto",
                },
            },
        )
    assert (sections.optimizer, sections.scheduler) == (None, None)


@pytest.mark.parametrize(
    "section, message",
    [
        (
            {"type": "OneBitAdam", "params": {"lr": 1e-3}},
            r"optimizer\.type='OneBitAdam' \(1-bit Adam\) is not supported",
        ),
        ({"type": "Lamb", "params": {"lr": 1e-3}}, r"optimizer\.type='Lamb' \(Lamb \(FusedLamb\)\) is not supported"),
        ({"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}, r"optimizer\.params\.max_grad_norm"),
        ({"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}, r"optimizer\.params\.momentum is not a parameter"),
        ({"type": "adamax", "params": {"lr": 1e-3}}, r"optimizer\.type='adamax' is neither"),
    ],
)
def test_optimizers_we_cannot_build_fail_naming_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        read_optimizer_sections(section, None)


def test_scheduler_value_without_default_left_auto_fails_naming_it():
    with pytest.raises(ValueError, match=r"scheduler\.params\.total_num_steps is required by WarmupDecayLR"):
        read_optimizer_sections(
            None, {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 0.1, "total_num_steps": "auto"}}
        )


# -- Lightning: a module whose configure_optimizers returns None trains from the sections --------------------------
WORLD, BATCH, LIGHTNING_STEPS = 2, 4, 6
DS_CONFIG = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": BATCH,
    "train_batch_size": BATCH * WORLD,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-6}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 4, "warmup_type": "linear"},
    },
}


def _dataset():
    x, y = models.MLP.make_batch(torch.Generator().manual_seed(3), LIGHTNING_STEPS * BATCH * WORLD)
    return TensorDataset(x, y)


class NoOptimizerModule(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = models.MLP()

    def training_step(self, batch, batch_idx):
        return self.net(batch)

    def configure_optimizers(self):
        return None  # Lightning's DeepSpeed convention: the config's optimizer section builds it


def _trainer(**kwargs):
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        max_steps=LIGHTNING_STEPS,
        **QUIET,
        use_distributed_sampler=False,
        **kwargs,
    )


def _fit_from_sections(rank, world_size):
    set_lightning_environment(rank)
    warnings.simplefilter("ignore", DeepSpeedConfigWarning)
    mine = Subset(_dataset(), range(rank, len(_dataset()), world_size))
    module = NoOptimizerModule()
    trainer = _trainer(strategy=ZeroStrategy.from_deepspeed_config(DS_CONFIG))
    trainer.fit(module, DataLoader(mine, batch_size=BATCH))
    result = {
        "state": trainer.strategy.engine.full_state_dict(rank0_only=False),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
    }
    errors = {}
    for name, module_class, config, loader_batch, clip in (
        ("clipping", NoOptimizerModule, DS_CONFIG, BATCH, 0.5),
        ("micro_batch", NoOptimizerModule, DS_CONFIG, BATCH - 1, None),
        ("train_batch_size", NoOptimizerModule, {**DS_CONFIG, "train_batch_size": 3 * BATCH}, BATCH, None),
    ):
        try:
            _trainer(strategy=ZeroStrategy.from_deepspeed_config(config), gradient_clip_val=clip).fit(
                module_class(), DataLoader(mine, batch_size=loader_batch)
            )
        except ValueError as error:
            errors[name] = str(error)
    return result | {"errors": errors}


def _reference():
    """One process on the global batch: torch AdamW, lr from the WarmupLR formula, clipping at 1.0."""
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)
    x, y = _dataset().tensors
    for step in range(LIGHTNING_STEPS):
        optimizer.param_groups[0]["lr"] = 0.05 * min(max(step - 1, 0) / 4, 1.0)
        shards = [[rank + WORLD * (step * BATCH + j) for j in range(BATCH)] for rank in range(WORLD)]
        torch.stack([model((x[index], y[index])) for index in shards]).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return {f"net.{k}": v for k, v in model.state_dict().items()}, 0.05 * min((LIGHTNING_STEPS - 1) / 4, 1.0)


@pytest.mark.slow
def test_lightning_module_without_an_optimizer_trains_from_the_config_sections_and_checks_deepspeeds_rules():
    ranks = run_ranks(_fit_from_sections, WORLD, timeout=240)
    reference, last_lr = _reference()
    for key, value in reference.items():
        error = (ranks[0]["state"][key] - value).norm() / value.norm()
        assert error < 1e-5, f"{key}: relative error {error:.2e}"
    assert ranks[0]["lr"] == pytest.approx(last_lr)
    errors = ranks[0]["errors"]
    assert "gradient_clipping=1.0" in errors["clipping"] and "gradient_clip_val=0.5" in errors["clipping"]
    assert "train_micro_batch_size_per_gpu=4 but the data loader's first batch holds 3" in errors["micro_batch"]
    assert (
        "train_batch_size=12 is not train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=1 x "
        "world size 2" in errors["train_batch_size"]
    )


# -- Fabric: the same config trains with its optimizer and scheduler, the loop stepping neither ---------------------
def _fabric_from_sections(rank, world_size):
    set_lightning_environment(rank)
    warnings.simplefilter("ignore", DeepSpeedConfigWarning)
    fabric = L.Fabric(
        accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy.from_deepspeed_config(DS_CONFIG)
    )
    fabric.launch()
    torch.manual_seed(0)
    net = models.MLP()
    placeholder = torch.optim.SGD(net.parameters(), lr=1.0)  # replaced by the config's AdamW, with a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, optimizer, scheduler = fabric.setup(net, placeholder)
    x, y = _dataset().tensors
    for step in range(LIGHTNING_STEPS):
        index = [rank + WORLD * (step * BATCH + j) for j in range(BATCH)]
        fabric.backward(model((x[index], y[index])))
        optimizer.step()
        optimizer.zero_grad()
    return {
        "state": fabric.strategy.engine.full_state_dict(rank0_only=False),
        "lr": optimizer.param_groups[0]["lr"],
        "optimizer": type(optimizer.optimizer).__name__,
        "scheduler": type(scheduler).__name__,
        "warnings": [str(w.message) for w in caught if "optimizer section" in str(w.message)],
    }


@pytest.mark.slow
def test_fabric_trains_with_the_config_sections_like_lightning():
    """Fabric honours the sections by Lightning's rule: the config's AdamW replaces the optimizer given (warning),
    its WarmupLR steps with ``optimizer.step()``, and the result is the unsharded reference (which Lightning's run
    above matches too)."""
    ranks = run_ranks(_fabric_from_sections, WORLD, timeout=240)
    reference, last_lr = _reference()
    for key, value in reference.items():
        error = (ranks[0]["state"][key.removeprefix("net.")] - value).norm() / value.norm()  # the MLP, unwrapped
        assert error < 1e-5, f"{key}: relative error {error:.2e}"
    assert ranks[0]["lr"] == pytest.approx(last_lr)
    assert (ranks[0]["optimizer"], ranks[0]["scheduler"]) == ("AdamW", "WarmupLR")  # DeepSpeed's class name
    assert "fabric.setup was given SGD" in ranks[0]["warnings"][0]
