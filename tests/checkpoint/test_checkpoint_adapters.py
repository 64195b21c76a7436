"""Fabric's ``save``/``load`` and ZeroAccelerator's ``save_state``/``load_state`` write sharded checkpoints that
resume bit for bit in a fresh process group and load at another world size: real gloo ranks, real files.

Each adapter trains the MLP at ZeRO stage 3 (every parameter partitioned) for STEPS optimizer steps with a StepLR
schedule, on the same global batches split evenly across the ranks, and saves model, optimizer and scheduler after
SAVE_AT steps without disturbing the run; that one run is both the uninterrupted reference and the checkpoint.
Resumed runs start from other initial weights, load the checkpoint and train the remaining steps. The Fabric and
Accelerate objects are built inside ``run_ranks`` workers from the environment variables their launchers set.
"""

import os
import shutil

import models
import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks, set_lightning_environment, set_torchrun_environment
from torch.optim.lr_scheduler import StepLR

from ds_strategy.checkpoint import CheckpointError
from ds_strategy.config import ZeroConfig

STEPS, SAVE_AT, GLOBAL_BATCH = 5, 2, 8
CONFIG = ZeroConfig(stage=3, param_persistence_threshold=0)


class FabricRun:
    """``Fabric(strategy=ZeroFabricStrategy(...))`` in a process group that already exists."""

    def __init__(self, rank: int, world_size: int, seed: int):
        import lightning as L

        from ds_strategy import ZeroFabricStrategy

        set_lightning_environment(rank)
        self.fabric = L.Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(CONFIG))
        self.fabric.launch()
        model, optimizer, self.scheduler = _model_optimizer_scheduler(seed)
        self.model, self.optimizer = self.fabric.setup(model, optimizer)
        self.engine = self.fabric.strategy.engine

    def step(self, batch) -> torch.Tensor:
        loss = self.model(batch)
        self.fabric.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return loss.detach()

    def state(self, step: int = 0) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "step": step}

    def save(self, path, step: int) -> None:
        self.fabric.save(path, self.state(step))

    def load(self, path) -> int:
        state = self.state()
        assert self.fabric.load(path, state) == {}
        return state["step"]


class AccelerateRun:
    """``ZeroAccelerator`` in a process group that already exists, seeing the variables torchrun sets."""

    def __init__(self, rank: int, world_size: int, seed: int):
        from ds_strategy.accelerate import ZeroAccelerator

        set_torchrun_environment(rank, world_size)
        # One scheduler step per optimizer step whatever the world size (accelerate's default steps it N times).
        self.accelerator = ZeroAccelerator(CONFIG, cpu=True, step_scheduler_with_optimizer=False)
        model, optimizer, scheduler = _model_optimizer_scheduler(seed)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.engine = self.accelerator.engine

    def step(self, batch) -> torch.Tensor:
        loss = self.model(batch)
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return loss.detach()

    def save(self, path, step: int) -> None:
        self.accelerator.save_state(path)

    def load(self, path) -> int:
        self.accelerator.load_state(path)
        return self.scheduler.scheduler.last_epoch


ADAPTERS = {"fabric": FabricRun, "accelerate": AccelerateRun}


def _model_optimizer_scheduler(seed: int):
    torch.manual_seed(seed)
    model = models.MLP()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2, betas=(0.9, 0.99), eps=1e-6)
    return model, optimizer, StepLR(optimizer, step_size=1, gamma=0.8)


def _global_batch(step: int):
    return models.MLP.make_batch(torch.Generator().manual_seed(step), GLOBAL_BATCH)


def _train(rank: int, world_size: int, adapter: str, path: str, resume: bool) -> dict:
    """Train to STEPS, saving at SAVE_AT or (``resume``) starting from the checkpoint; returns the global mean
    loss of every step after SAVE_AT and the final parameters."""
    run = ADAPTERS[adapter](rank, world_size, seed=1 if resume else 0)
    start = run.load(path) if resume else 0
    rows = GLOBAL_BATCH // world_size
    losses = []
    for step in range(start + 1, STEPS + 1):
        loss = run.step(tuple(t[rank * rows : (rank + 1) * rows] for t in _global_batch(step)))
        dist.all_reduce(loss)
        losses.append(loss / world_size)
        if step == SAVE_AT and not resume:
            run.save(path, step)
    return {
        "start": start,
        "losses": torch.stack(losses[SAVE_AT - start :]),
        "final": run.engine.full_state_dict(rank0_only=False),
    }


def _saved(adapter: str, tmp_path_factory) -> tuple[str, str, dict]:
    """The adapter's uninterrupted 2-rank run, which saved its checkpoint after SAVE_AT steps."""
    path = str(tmp_path_factory.mktemp(adapter) / "ckpt")
    return adapter, path, run_ranks(_train, 2, adapter, path, resume=False, timeout=120)[0]


@pytest.fixture(scope="module")
def fabric_saved(tmp_path_factory):
    return _saved("fabric", tmp_path_factory)


@pytest.fixture(scope="module")
def accelerate_saved(tmp_path_factory):
    return _saved("accelerate", tmp_path_factory)


@pytest.fixture(params=list(ADAPTERS))
def saved(request):
    return request.getfixturevalue(f"{request.param}_saved")


def test_resumed_in_a_fresh_process_group_continues_bitwise(saved):
    adapter, path, uninterrupted = saved
    resumed = run_ranks(_train, 2, adapter, path, resume=True, timeout=120)[0]
    assert resumed["start"] == SAVE_AT
    assert torch.equal(resumed["losses"], uninterrupted["losses"])
    for name, value in uninterrupted["final"].items():
        assert torch.equal(resumed["final"][name], value), name


def test_checkpoint_saved_on_two_ranks_resumes_on_one(saved):
    adapter, path, uninterrupted = saved
    resumed = run_ranks(_train, 1, adapter, path, resume=True, timeout=120)[0]
    assert resumed["start"] == SAVE_AT
    torch.testing.assert_close(resumed["losses"], uninterrupted["losses"], rtol=1e-5, atol=1e-6)
    for name, value in uninterrupted["final"].items():
        torch.testing.assert_close(resumed["final"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_each_rank_wrote_only_its_own_shard_file(saved):
    adapter, path, _ = saved
    sharded = os.path.join(path, "zero_checkpoint") if adapter == "accelerate" else path
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "manifest.json", "meta.pt"} == set(os.listdir(sharded))


def _fabric_load_errors(rank: int, world_size: int, path: str, scratch: str) -> dict:
    """Each bad save or load's error, and whether the model was still as built afterwards."""
    run = FabricRun(rank, world_size, seed=1)
    before = run.engine.full_state_dict()
    torch.save({"other.weight": torch.ones(2)}, os.path.join(scratch, "other_model.pt"))
    attempts = {
        "unknown key": lambda: run.fabric.load(path, {**run.state(), "epoch": 0}),
        "no checkpoint": lambda: run.fabric.load(os.path.join(scratch, "missing"), run.state()),
        "another model's file": lambda: run.fabric.load_raw(os.path.join(scratch, "other_model.pt"), run.model),
        "no model": lambda: run.fabric.save(os.path.join(scratch, "ckpt"), {"step": 1}),
    }
    errors = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except Exception as error:
            errors[what] = (type(error), str(error))
    after = run.engine.full_state_dict()
    return {"errors": errors, "unchanged": all(torch.equal(after[name], value) for name, value in before.items())}


def test_fabric_load_errors_name_the_problem_and_change_nothing(fabric_saved, tmp_path):
    _, path, _ = fabric_saved
    result = run_ranks(_fabric_load_errors, 1, path, str(tmp_path))[0]
    errors = result["errors"]
    assert errors["unknown key"][0] is KeyError and "'epoch'" in errors["unknown key"][1]
    assert errors["no checkpoint"][0] is CheckpointError and "no such checkpoint" in errors["no checkpoint"][1]
    other = errors["another model's file"]  # a single file loads (DDP's), if it holds this model's weights
    assert other[0] is ValueError and "does not fit the model; nothing was loaded" in other[1]
    assert errors["no model"][0] is ValueError and "set up by fabric.setup" in errors["no model"][1]
    assert result["unchanged"]


def _accelerate_load_missing_shard(rank: int, world_size: int, path: str) -> dict:
    run = AccelerateRun(rank, world_size, seed=1)
    before = run.engine.full_state_dict()
    try:
        run.accelerator.load_state(path)
        error = None
    except CheckpointError as raised:
        error = str(raised)
    after = run.engine.full_state_dict()
    return {
        "error": error,
        "scheduler_steps": run.scheduler.scheduler.last_epoch,
        "unchanged": all(torch.equal(after[name], value) for name, value in before.items()),
    }


def test_accelerate_load_state_with_a_missing_shard_names_it_and_changes_nothing(accelerate_saved, tmp_path):
    _, path, _ = accelerate_saved
    damaged = shutil.copytree(path, tmp_path / "damaged")
    os.remove(os.path.join(damaged, "zero_checkpoint", "__1_0.distcp"))
    result = run_ranks(_accelerate_load_missing_shard, 1, damaged)[0]
    assert "__1_0.distcp is missing" in result["error"]
    assert result["scheduler_steps"] == 0 and result["unchanged"]
