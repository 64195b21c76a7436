"""What ``ds_strategy.comm`` chooses per backend, tested by backend name (no NCCL here): how a wait waits (Note: [What
a wait guarantees on each backend]), which algorithm an all-gather and a gradient reduction use (Note: [Algorithms per
backend]), and that only fp16 loss scaling brings the inf/nan flag to the host at a step."""

import datetime

import models
import pytest
import torch

from ds_strategy.comm import collectives as comm
from ds_strategy.config import ZeroConfig
from ds_strategy.zero.engine import ZeroEngine


@pytest.mark.parametrize(
    "backend, device, mode",
    [
        ("gloo", "cpu", comm.SLICED),
        ("gloo", "cuda", comm.SLICED),  # gloo over CUDA tensors (two ranks on one GPU): gloo's threads run it
        ("nccl", "cuda", comm.STREAM_ORDERED),
        ("cpu:gloo,cuda:nccl", "cuda", comm.STREAM_ORDERED),
        ("cpu:gloo,cuda:nccl", "cpu", comm.SLICED),
        ("mpi", "cpu", comm.BLOCKING),
    ],
)
def test_a_wait_waits_the_way_the_backend_running_the_collective_needs(backend, device, mode):
    assert comm.wait_mode(backend, device) == mode


class RecordingWork:
    """A launched collective that records how it was waited on."""

    def __init__(self):
        self.waits = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return True

    def is_completed(self):
        return True


class NoFailure:
    rank = 0

    def recorded_failure(self):
        return None


def _waited(mode: str, failures=None) -> list:
    work = RecordingWork()
    comm.PendingCollective(work, comm.KindStats(), timeout=30.0, failures=failures, mode=mode).wait()
    return work.waits


def test_a_stream_ordered_wait_gives_nccl_no_timeout_so_the_host_never_spins():
    assert _waited(comm.STREAM_ORDERED, NoFailure()) == [None]


def test_gloo_waits_in_slices_that_read_the_failure_record_and_others_once_with_the_timeout():
    (sliced,) = _waited(comm.SLICED, NoFailure())
    assert sliced <= datetime.timedelta(seconds=comm.rank_failure.POLL_S)
    assert _waited(comm.BLOCKING) == [datetime.timedelta(seconds=30.0)]
    assert _waited(comm.SLICED) == [datetime.timedelta(seconds=30.0)]  # no failure board: one wait


def test_an_all_gather_is_built_from_broadcasts_on_gloo_only():
    assert comm.gathers_with_broadcasts("gloo", "cpu", use_all_reduce=True)
    assert comm.gathers_with_broadcasts("gloo", "cuda", use_all_reduce=True)
    assert not comm.gathers_with_broadcasts("gloo", "cpu", use_all_reduce=False)
    assert not comm.gathers_with_broadcasts("nccl", "cuda", use_all_reduce=True)  # NCCL's all-gather is its fastest
    assert not comm.gathers_with_broadcasts("cpu:gloo,cuda:nccl", "cuda", use_all_reduce=True)


def test_gradients_are_all_reduced_on_gloo_and_reduce_scattered_on_nccl_unless_configured():
    plan = ZeroConfig(stage=2).plan
    assert plan.gradient_collective("gloo") == "all_reduce"
    assert plan.gradient_collective("nccl") == "reduce_scatter"
    assert ZeroConfig(stage=2, gradient_reduction="all_reduce").plan.gradient_collective("nccl") == "all_reduce"


def _items_read(precision: str, monkeypatch) -> int:
    """``Tensor.item`` calls while clipping and stepping an engine under ``precision``."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    engine = ZeroEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=2, precision=precision))
    engine.backward(model(models.TinyGPT.make_batch(torch.Generator().manual_seed(0), 2)))
    calls = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or item(self))
    engine.clip_grad_norm_(1.0)
    engine.step()
    monkeypatch.undo()
    engine.remove_hooks()
    return len(calls)


def test_only_fp16_loss_scaling_reads_the_inf_flag_on_the_host_at_a_step(monkeypatch):
    assert _items_read("bf16-mixed", monkeypatch) == 0  # the norm stays on the device; nothing skips
    assert _items_read("32-true", monkeypatch) == 0
    assert _items_read("16-mixed", monkeypatch) == 1  # whether to skip the step is the host's decision
