"""A checkpoint appears whole or not at all: a rank SIGKILLed mid-save, or a save interrupted while replacing an
older checkpoint, leaves the previous checkpoint loadable, and nothing half-written is ever loaded."""

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from checkpoint_runs import build, global_batches, saved_after_one_step, train
from training_loops import full_state

from ds_strategy.checkpoint import CheckpointError, load, remove, save
from ds_strategy.checkpoint.directory import MANIFEST, partial_path, previous_path

_DEADLINE_S = 120.0


def _rank_main(rank: int, world_size: int, store: Path, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)


def save_twice_victim_stalls_in_second(rank: int, world_size: int, root: Path, victim: int) -> None:
    """Train a step, save, record (rank 0) the state and the next step's loss, train it, save again: in that
    second save the victim rank writes its shard file, announces it and stalls until it is killed."""
    model, engine = build("zero2")
    batches = global_batches()
    train(model, engine, batches[:1])
    save(root / "ckpt", model, engine)
    at_save = full_state(engine, model)
    next_loss = train(model, engine, batches[1:2])
    if rank == 0:
        torch.save({"params": at_save, "next_loss": next_loss}, root / "expected.pt")
    if rank == victim:
        _stall_after_writing(root / "victim_wrote_its_shard")
    save(root / "ckpt", model, engine)


def _stall_after_writing(flag: Path) -> None:
    write_data = dcp.FileSystemWriter.write_data

    def write_then_stall(self, plan, planner):
        write_data(self, plan, planner).wait()
        flag.touch()
        time.sleep(_DEADLINE_S)

    dcp.FileSystemWriter.write_data = write_then_stall


def _kill_victim_once_it_has_written(procs: list, victim: int, flag: Path) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not flag.exists():
        assert all(p.is_alive() for p in procs), f"a rank died before the kill: {[p.exitcode for p in procs]}"
        assert time.monotonic() < deadline, "the victim never reached its second save"
        time.sleep(0.1)
    os.kill(procs[victim].pid, signal.SIGKILL)
    procs[victim].join(_DEADLINE_S)
    assert procs[victim].exitcode == -signal.SIGKILL


@pytest.mark.slow
def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable_and_resumable(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            daemon=True,
            args=(rank, 2, tmp_path / "store", save_twice_victim_stalls_in_second, (tmp_path, 1)),
        )
        for rank in range(2)
    ]
    try:
        for proc in procs:
            proc.start()
        _kill_victim_once_it_has_written(procs, 1, tmp_path / "victim_wrote_its_shard")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    assert (partial_path(tmp_path / "ckpt") / "__1_0.distcp").is_file()  # the killed save had started writing
    expected = torch.load(tmp_path / "expected.pt")
    model, engine = build("zero2")
    load(tmp_path / "ckpt", model, engine)
    loaded = full_state(engine, model)
    assert all(torch.equal(loaded[name], value) for name, value in expected["params"].items())
    assert train(model, engine, global_batches()[1:2]) == pytest.approx(expected["next_loss"], rel=1e-5)


@pytest.fixture
def trained(tmp_path):
    return saved_after_one_step(tmp_path / "ckpt")


def test_interrupted_save_is_never_loaded_and_next_save_clears_it(trained):
    path, model, engine = trained
    partial = partial_path(path)
    shutil.copytree(path, partial)
    (partial / MANIFEST).unlink()  # what a save killed before its last write leaves
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint .*manifest.json is missing"):
        load(partial, model, engine)
    save(path, model, engine)
    assert not partial.exists()


def test_save_interrupted_between_its_renames_falls_back_to_previous_checkpoint(trained):
    path, model, engine = trained
    path.rename(previous_path(path))  # killed after moving the old checkpoint aside, before moving the new in
    with pytest.warns(UserWarning, match="loading the previous checkpoint"):
        load(path, model, engine)
    save(path, model, engine)
    assert (path / MANIFEST).is_file() and not previous_path(path).exists()


def test_saving_over_a_checkpoint_replaces_it_and_leaves_nothing_beside_it(trained):
    path, model, engine = trained
    train(model, engine, global_batches()[1:2])
    save(path, model, engine)
    assert sorted(os.listdir(path.parent)) == ["ckpt"]
    expected = full_state(engine, model)
    fresh, fresh_engine = build("zero2")
    load(path, fresh, fresh_engine)
    assert all(torch.equal(value, expected[name]) for name, value in full_state(fresh_engine, fresh).items())


def test_removed_checkpoint_is_gone(trained):
    path, _, _ = trained
    remove(path)
    assert os.listdir(path.parent) == []
