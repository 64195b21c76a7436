"""Accelerate's ``DummyOptim``/``DummyScheduler`` under ZeroAccelerator build the DeepSpeed config's optimizer and
scheduler, filled as accelerate's DeepSpeed back-end fills them, and train like the same objects built by hand.

One 2-rank run (stage 2, gloo) trains STEPS steps with a DeepSpeed config whose AdamW and WarmupDecayLR sections are
mostly "auto"; the same run collects what ``prepare`` refuses. The reference is one process on the global batch
with ``torch.optim.AdamW`` and ds_strategy's WarmupDecayLR built by hand; parameters must match to 1e-6 in relative
norm (fp32; tests/support/training_loops.py says why that bound).
"""

import math

import models
import pytest
import torch
from distributed import run_ranks, set_torchrun_environment
from torch.utils.data import DataLoader, TensorDataset

WORLD, MICRO, STEPS = 2, 4, 6
LR, WEIGHT_DECAY, BETAS, EPS = 3e-2, 0.01, (0.9, 0.999), 1e-8
TOTAL_STEPS, WARMUP_STEPS = 20, 3  # as the user counts them: accelerate divides the total by the processes
DEEPSPEED = {
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 0.0,
    "train_micro_batch_size_per_gpu": MICRO,
    "train_batch_size": MICRO * WORLD,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": list(BETAS), "eps": EPS}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
            "warmup_max_lr": "auto",
            "warmup_min_lr": "auto",
            "warmup_type": "linear",
        },
    },
}


def _dataset() -> TensorDataset:
    x, y = models.MLP.make_batch(torch.Generator().manual_seed(3), MICRO * WORLD * STEPS)
    return TensorDataset(x, y)


def _model() -> models.MLP:
    torch.manual_seed(0)
    return models.MLP()


def _without(*keys: str, **changes) -> dict:
    return {**{key: value for key, value in DEEPSPEED.items() if key not in keys}, **changes}


def _expected_lr(step: int) -> float:
    """DeepSpeed's WarmupDecayLR (linear warmup) after ``step`` scheduler steps, written out: iteration i = step - 1,
    warmup i / n over n steps, then linear decay to 0 at the total, which accelerate divided by the 2 processes."""
    i, warmup, total = step - 1, WARMUP_STEPS, math.ceil(TOTAL_STEPS / WORLD)
    gamma = i / warmup if i < warmup else (total - i) / (total - warmup)
    return LR * max(0.0, gamma)


def _ranks(rank: int, world_size: int) -> dict:
    from accelerate.state import GradientState
    from accelerate.utils import DummyOptim, DummyScheduler

    from ds_strategy.accelerate import ZeroAccelerator

    set_torchrun_environment(rank, world_size)
    accelerator = ZeroAccelerator(DEEPSPEED, cpu=True)
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = DummyScheduler(optimizer, total_num_steps=TOTAL_STEPS, warmup_num_steps=WARMUP_STEPS)
    loader = DataLoader(_dataset(), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    inner = optimizer.optimizer
    results = {
        "optimizer": (
            type(optimizer).__name__,
            type(inner),
            inner.defaults["lr"],
            inner.param_groups[0]["weight_decay"],
            inner.param_groups[0]["betas"],
        ),
        "scheduler": type(scheduler).__name__,
        "lrs": [],
    }
    for batch in loader:
        accelerator.backward(model(batch))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        results["lrs"].append(inner.param_groups[0]["lr"])
    results["state"] = accelerator.engine_of(model).full_state_dict(rank0_only=False)
    GradientState._reset_state()
    results["callable"] = _callable_scheduler(ZeroAccelerator, DummyOptim, DummyScheduler)
    results["errors"] = _errors(ZeroAccelerator, DummyOptim, DummyScheduler)
    return results


def _callable_scheduler(accelerator_class, dummy_optim, dummy_scheduler) -> tuple:
    """``lr_scheduler_callable`` is called with the real optimizer, and wins over the config's section."""
    from accelerate.state import GradientState

    seen = []

    def make(optimizer):
        seen.append(type(optimizer))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)

    accelerator = accelerator_class(DEEPSPEED, cpu=True)
    model = _model()
    optimizer = dummy_optim(model.parameters(), lr=LR)
    scheduler = dummy_scheduler(optimizer, lr_scheduler_callable=make)
    _, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    GradientState._reset_state()
    return seen, type(scheduler.scheduler), optimizer.optimizer.param_groups[0]["lr"]


def _errors(accelerator_class, dummy_optim, dummy_scheduler) -> dict:
    """What prepare() refuses, with the message it gives, before anything is sharded."""
    from accelerate.state import GradientState

    attempts = {
        "dummy optimizer, no section": (_without("optimizer"), lambda m: (dummy_optim(m.parameters()),)),
        "dummy optimizer, ZeroConfig": ({"stage": 2}, lambda m: (dummy_optim(m.parameters()),)),
        "real optimizer, a section": (DEEPSPEED, lambda m: (torch.optim.AdamW(m.parameters()),)),
        "dummy scheduler, no section": (
            _without("scheduler"),
            lambda m: (opt := dummy_optim(m.parameters()), dummy_scheduler(opt, total_num_steps=4)),
        ),
        "real scheduler, a section": (
            _without("optimizer"),
            lambda m: (opt := torch.optim.AdamW(m.parameters()), torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)),
        ),
        "dummy optimizer, real scheduler": (
            _without("scheduler"),
            lambda m: (
                dummy_optim(m.parameters()),
                torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(m.parameters(), lr=1.0), lambda s: 1.0),
            ),
        ),
        "auto nothing fills": (
            _without(optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}),
            lambda m: (dummy_optim(m.parameters()),),
        ),
        "total steps not given": (DEEPSPEED, lambda m: (opt := dummy_optim(m.parameters()), dummy_scheduler(opt))),
        "loader batch": (DEEPSPEED, lambda m: (DataLoader(_dataset(), batch_size=MICRO + 1),)),
    }
    errors = {}
    for name, (config, objects) in attempts.items():
        accelerator = accelerator_class(config, cpu=True)
        model = _model()
        try:
            accelerator.prepare(model, *objects(model))
            errors[name] = "accepted"
        except ValueError as error:
            errors[name] = str(error)
        GradientState._reset_state()
    return errors


def _reference() -> tuple[dict, list[float]]:
    """One process, global batches of MICRO x WORLD, the real AdamW and WarmupDecayLR built by hand."""
    from ds_strategy.config.deepspeed.lr_schedules import build_schedule

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS)
    scheduler = build_schedule(
        optimizer,
        "WarmupDecayLR",
        {
            "total_num_steps": math.ceil(TOTAL_STEPS / WORLD),
            "warmup_num_steps": WARMUP_STEPS,
            "warmup_max_lr": LR,
            "warmup_min_lr": 0,
            "warmup_type": "linear",
        },
    )
    lrs = []
    for batch in DataLoader(_dataset(), batch_size=MICRO * WORLD):
        model(batch).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(optimizer.param_groups[0]["lr"])
    return model.state_dict(), lrs


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks, WORLD, timeout=300)


def test_dummy_optim_becomes_the_configs_adamw_with_its_lr_and_weight_decay(ranks):
    for rank in ranks:
        assert rank["optimizer"] == ("ZeroAcceleratedOptimizer", torch.optim.AdamW, LR, WEIGHT_DECAY, BETAS)


def test_dummy_scheduler_follows_warmup_decay_lr_with_the_dummys_steps(ranks):
    expected = [_expected_lr(step) for step in range(1, STEPS + 1)]
    for rank in ranks:
        assert rank["scheduler"] == "AcceleratedScheduler"
        assert rank["lrs"] == pytest.approx(expected, abs=1e-12)


def test_training_with_dummies_matches_the_real_objects_built_by_hand(ranks):
    reference, lrs = _reference()
    assert lrs == pytest.approx(ranks[0]["lrs"], abs=1e-12)
    for rank in ranks:
        assert rank["state"].keys() == reference.keys()
        for key, value in reference.items():
            error = (rank["state"][key] - value).norm() / value.norm()
            assert error < 1e-6, f"{key}: relative error {error:.2e}"


def test_lr_scheduler_callable_is_called_with_the_real_optimizer(ranks):
    seen, scheduler_type, lr = ranks[0]["callable"]
    assert seen == [torch.optim.AdamW]
    assert scheduler_type is torch.optim.lr_scheduler.LambdaLR
    assert lr == pytest.approx(LR * 0.5)


@pytest.mark.parametrize(
    "attempt, says",
    [
        ("dummy optimizer, no section", ["DummyOptim", "'optimizer' section"]),
        ("dummy optimizer, ZeroConfig", ["DummyOptim", "'optimizer' section"]),
        ("real optimizer, a section", ["in the config file and in the code", "'optimizer' section", "DummyOptim("]),
        ("dummy scheduler, no section", ["'scheduler' section", "lr_scheduler_callable"]),
        ("real scheduler, a section", ["in the config file and in the code", "'scheduler' section", "DummyScheduler("]),
        ("dummy optimizer, real scheduler", ["You can only specify accelerate.utils.DummyScheduler"]),
        ("auto nothing fills", ["optimizer.params.betas", '"auto"']),
        ("total steps not given", ["scheduler.params.total_num_steps", "DummyScheduler(total_num_steps="]),
        ("loader batch", ["train_batch_size=8", "5 samples per process", "2 processes = 10", "batch_size 4"]),
    ],
)
def test_prepare_refuses_what_accelerates_deepspeed_back_end_refuses(ranks, attempt, says):
    message = ranks[0]["errors"][attempt]
    for words in says:
        assert words in message, message
