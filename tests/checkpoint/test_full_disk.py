"""A disk that fills up during a sharded checkpoint save or under NVMe offload fails with an error naming the file
and the OS error, loses nothing already saved, and ends every rank.

A full disk is simulated without root by a file size limit (``RLIMIT_FSIZE``) on one rank: its writes past the
limit really fail, with ``EFBIG`` where a full disk gives ``ENOSPC``; ``SIGXFSZ``, which would otherwise kill the
process, is ignored. Only that rank's process is limited, and only around the save or step under test: a rank that
fails records its error as its process unwinds (``sys.excepthook``), once the disk has room again for the c10d
store, a file under ``run_ranks``; a real job's store lives in memory.
"""

import contextlib
import os
import re
import resource
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_runs import build, global_batches, train
from distributed import run_ranks

from ds_strategy.checkpoint import CheckpointError, latest, load, save
from ds_strategy.checkpoint.directory import _write_synced
from ds_strategy.comm.collectives import PeerFailedError
from ds_strategy.config import ZeroConfig
from ds_strategy.models import GPT, GPTConfig
from ds_strategy.offload import OffloadedStep, OffloadIOError, OffloadSetupError
from ds_strategy.zero.engine import ZeroEngine

pytestmark = pytest.mark.slow  # multi-rank scenarios of tens of seconds: not in the fast tier

EFBIG = "[Errno 27] File too large (EFBIG)"
SHARD_LIMIT = 64 << 10  # below a TinyGPT zero2 shard file on 2 ranks (about 260 KiB)
META_LIMIT = 1 << 20  # above every shard file, below the meta.pt holding a 2 MiB extra tensor


@contextlib.contextmanager
def disk_full_past(nbytes: int, on: bool = True):
    """Within the block, writes of this process past byte ``nbytes`` of any file fail with EFBIG."""
    if not on:
        yield
        return
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def _failed_save(path, model, engine, limit: int, on: bool, **kwargs) -> str | None:
    with disk_full_past(limit, on):
        try:
            save(path, model, engine, **kwargs)
        except CheckpointError as error:
            return str(error)
    return None


def save_onto_a_full_disk(rank: int, world_size: int, root) -> dict:
    """Save ``step1``; then, one step later, with rank 1's disk full: replace ``step1`` and save ``step2``; and
    with rank 0's disk full only for its large ``meta.pt``, save ``step2`` again. Then load ``step1``."""
    torch.set_num_threads(1)
    model, engine = build("zero2")
    train(model, engine, global_batches()[:1])
    save(root / "step1", model, engine)
    saved = [fp.master.clone() for fp in engine.flat_params]
    train(model, engine, global_batches()[1:2])
    errors = {
        "replace": _failed_save(root / "step1", model, engine, SHARD_LIMIT, rank == 1),
        "new": _failed_save(root / "step2", model, engine, SHARD_LIMIT, rank == 1),
        "meta": _failed_save(
            root / "step2", model, engine, META_LIMIT, rank == 0, extra={"blob": torch.zeros(1 << 19)}
        ),
    }
    dist.barrier()
    left, chosen = sorted(os.listdir(root)), latest(root)
    load(root / "step1", model, engine)
    restored = all(torch.equal(a, fp.master) for a, fp in zip(saved, engine.flat_params))
    engine.remove_hooks()
    return {"errors": errors, "left": left, "latest": chosen, "restored": restored}


@pytest.fixture(scope="module")
def full_disk_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("full_disk")
    return root, run_ranks(save_onto_a_full_disk, 2, root)


def test_a_shard_that_cannot_be_written_fails_every_rank_naming_file_and_os_error(full_disk_saves):
    root, ranks = full_disk_saves
    for rank in ranks:
        for attempt, name in (("replace", "step1"), ("new", "step2")):
            assert rank["errors"][attempt] == (
                f"writing the checkpoint {root / name} failed on rank 1: "
                f"{root / f'.{name}.partial' / '__1_0.distcp'} cannot be written: {EFBIG}"
            )


def test_rank0_metadata_that_cannot_be_written_fails_every_rank_naming_it(full_disk_saves):
    root, (rank0, rank1) = full_disk_saves
    named = f"{root / '.step2.partial' / 'meta.pt'} cannot be written: {EFBIG}"
    assert rank0["errors"]["meta"] == named
    assert rank1["errors"]["meta"] == f"publishing {root / 'step2'} failed on rank 0: CheckpointError: {named}"


def test_failed_saves_leave_the_previous_checkpoint_loadable_and_latest_and_nothing_else(full_disk_saves):
    root, ranks = full_disk_saves
    for rank in ranks:
        assert rank["left"] == ["step1"]  # each failed save removed its partial directory
        assert rank["latest"] == root / "step1"
        assert rank["restored"]  # step1 holds what it held before the save that was to replace it


def test_a_write_onto_a_full_device_names_the_file_and_enospc():
    """A real ENOSPC: every write to /dev/full fails with it."""
    with pytest.raises(
        CheckpointError, match=r"^/dev/full cannot be written: \[Errno 28\] No space left on device \(ENOSPC\)$"
    ):
        _write_synced(Path("/dev/full"), lambda f: f.write(b"manifest"))


NVME_LIMIT = 64 << 10  # below every NVMe offload file of the GPT below (about 400 KiB each)


def _nvme_run(nvme_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=4, n_embd=128))
    config = ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(nvme_path))
    return model, ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config, step_runner=OffloadedStep)


def _step(model, engine) -> None:
    tokens = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(engine.rank))
    _, loss = model(tokens, tokens)
    engine.backward(loss)
    engine.step()


def nvme_fills_up(rank: int, world_size: int, nvme_path, when: str) -> str:
    """Rank 0's disk fills ``when`` ("setup": as its NVMe files are created, "step": in its second step); it raises
    and ends as an uncaught error ends a process (``sys.excepthook``), while rank 1 trains on. Returns the error
    each rank raised."""
    torch.set_num_threads(1)
    try:
        with disk_full_past(NVME_LIMIT, on=rank == 0 and when == "setup"):
            model, engine = _nvme_run(nvme_path)
        for step in range(3):
            with disk_full_past(NVME_LIMIT, on=rank == 0 and when == "step" and step == 1):
                _step(model, engine)
    except (OffloadSetupError, OffloadIOError, PeerFailedError) as error:
        if rank == 0:
            sys.excepthook(type(error), error, error.__traceback__)
        return f"{type(error).__name__}: {error}"
    return "finished"


@pytest.mark.parametrize("when", ["setup", "step"])
def test_nvme_offload_on_a_full_disk_ends_every_rank_naming_the_path_and_the_error(tmp_path, when):
    """The 60 s bound is far below the collective timeout: rank 1 leaves on rank 0's record, not by waiting."""
    rank0, rank1 = run_ranks(nvme_fills_up, 2, tmp_path, when, timeout=60)
    root = re.escape(str(tmp_path))
    own = {
        "setup": rf"OffloadSetupError: nvme_path '{root}': cannot allocate 396,544 bytes .* for flat1\.master "
        r"\(File too large\)",
        "step": rf"OffloadIOError: nvme_path '{root}': writing 396,544 bytes at byte 0 of "
        rf"{root}/ds_strategy-offload-[^ ]+-rank0-[0-9a-f]+/flat1\.master failed: \[Errno 27\] File too large "
        r"\(EFBIG\)",
    }[when]
    assert re.match(own, rank0), rank0
    assert re.match(rf"PeerFailedError: rank 1: .* failed because rank 0 failed first with {own}", rank1), rank1
