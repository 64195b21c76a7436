"""A single-file checkpoint (``state_dict_type="full"``) is published whole or not at all: a process killed while
writing it leaves the previous file in place (Note: [Atomic single files] in ``ds_strategy.checkpoint.directory``)."""

import errno
import multiprocessing
import os
import signal

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from ds_strategy.adapters.state_dict_type import save_full_file
from ds_strategy.checkpoint import directory

HALF = b"the first bytes of a checkpoint"


class KilledWhileWriting(TorchCheckpointIO):
    """Writes the start of the file where it is told to, then the process is SIGKILLed (a launcher's kill, the OOM
    killer)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(HALF)
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class DiskFull(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(path, "wb") as f:
            f.write(HALF)
        raise OSError(errno.ENOSPC, "No space left on device")


def _save(checkpoint_io, path) -> None:
    save_full_file(checkpoint_io, {"step": 2}, str(path))


def test_a_save_killed_while_writing_leaves_the_previous_file_and_the_next_save_replaces_it(tmp_path):
    path = tmp_path / "last.ckpt"
    save_full_file(TorchCheckpointIO(), {"step": 1}, str(path))
    killed = multiprocessing.get_context("fork").Process(target=_save, args=(KilledWhileWriting(), path))
    killed.start()
    killed.join()
    assert killed.exitcode == -signal.SIGKILL
    assert torch.load(path)["step"] == 1
    assert directory.partial_path(path).read_bytes() == HALF  # never read: loading opens `path` only
    _save(TorchCheckpointIO(), path)
    assert torch.load(path)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_save_that_fails_removes_its_partial_file_and_keeps_the_previous_one(tmp_path):
    path = tmp_path / "model.pth"
    save_full_file(TorchCheckpointIO(), {"step": 1}, str(path))
    with pytest.raises(OSError, match="No space left"):
        _save(DiskFull(), path)
    assert torch.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]
