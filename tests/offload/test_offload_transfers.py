"""Offload's host<->device copies, ordered and fenced, driven on the host through copies that land as late as
they can (``late_transfers.LateTransfers``): the host step waits until the device has read the parameter shards it
rewrites; reduced gradients leave the device, are summed in host buffers and train exactly as when summed in place;
and pinned host memory is bounded, exact and released. One process: the logic is the same on any number of ranks."""

import contextlib

import models
import pytest
import torch
from late_transfers import LateTransfers

from ds_strategy.config import ZeroConfig
from ds_strategy.estimate import estimate_memory
from ds_strategy.offload import OffloadedStep, pinned, step_runner_for
from ds_strategy.offload.param_offload import ParamOffload
from ds_strategy.zero.engine import ZeroEngine

STEPS, MICRO_BATCHES = 2, 2


def runner_with(transfers, pinned_memory=None):
    """``OffloadedStep`` whose copies go through ``transfers``, as on a device, while the device is the host."""

    class Slow(OffloadedStep):
        def __init__(self, context):
            super().__init__(context, transfers=transfers, pinned=pinned_memory)

    return Slow


def build(zero: dict, runner=None, muon: bool = False):
    """TinyGPT under AdamW, or (``muon``) under Muon on its blocks' matrices and AdamW on the rest."""
    torch.manual_seed(0)
    model = models.TinyGPT()
    optimizer = torch.optim.AdamW(models.param_groups(model), lr=1e-2, fused=True)
    if muon:
        named = list(model.named_parameters())
        matrices = [p for n, p in named if n.startswith("blocks.") and p.ndim == 2]
        rest = [p for n, p in named if not (n.startswith("blocks.") and p.ndim == 2)]
        optimizer = [torch.optim.Muon(matrices, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2, fused=True)]
    config = ZeroConfig(param_persistence_threshold=0, **zero)
    return model, ZeroEngine(model, optimizer, config, step_runner=runner or step_runner_for(config))


def train(model, engine: ZeroEngine, after_backward=lambda: None, evaluate: bool = False) -> dict:
    """Two micro-batches per step, each backward synced (the gradient sums over them), clipped; every parameter
    and the losses. ``evaluate``: a no-grad forward between the last backward and the step (a metric), whose
    gathers copy every shard to the device with no gradient copy after them."""
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        for _ in range(MICRO_BATCHES):
            loss = model(models.TinyGPT.make_batch(generator, 4)) / MICRO_BATCHES
            engine.backward(loss)
            losses.append(loss.item())
        if evaluate:
            with torch.no_grad():
                losses.append(model(models.TinyGPT.make_batch(generator, 4)).item())
        after_backward()
        engine.clip_grad_norm_(1.0)
        engine.step()
    result = {"losses": losses, "params": engine.full_state_dict()}
    engine.remove_hooks()
    return result


def assert_identical(run: dict, reference: dict) -> None:
    assert run["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert torch.equal(run["params"][name], value), name


STAGE3_PARAMS = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}


@pytest.mark.slow
def test_the_host_step_waits_until_the_device_has_read_the_shards_it_rewrites():
    transfers = LateTransfers()
    run = train(*build(STAGE3_PARAMS, runner_with(transfers)), evaluate=True)
    assert transfers.copies_to_device > 0 and transfers.races == 0
    assert_identical(run, train(*build(STAGE3_PARAMS), evaluate=True))


@pytest.mark.slow
def test_without_that_wait_the_device_would_read_rewritten_shards(monkeypatch):
    monkeypatch.setattr(ParamOffload, "wait_device_reads", lambda self: None)
    transfers = LateTransfers()
    train(*build(STAGE3_PARAMS, runner_with(transfers)), evaluate=True)
    transfers.wait_device_reads()
    assert transfers.races > 0  # the race the event closes, seen by the late reads


GRADIENT_RUNS = {
    "stage1 fp32": {"stage": 1, "offload_optimizer": "cpu"},
    "stage1 bf16": {"stage": 1, "offload_optimizer": "cpu", "precision": "bf16-mixed"},  # copied at the step
    "stage2 fp32": {"stage": 2, "offload_optimizer": "cpu"},
    "stage3 fp16, parameters offloaded": {
        **STAGE3_PARAMS,
        "precision": "16-mixed",
        "grad_accum_dtype": "fp32",  # the host sums in fp32; so does the device then, and bit for bit alike
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [{"stage": 2, "offload_optimizer": "cpu"}, STAGE3_PARAMS], ids=["stage2", "stage3"])
def test_muon_beside_adamw_steps_its_whole_matrices_on_the_host_from_gradients_copied_off_the_device(zero):
    """Each optimizer has its host optimizer and its host gradient buffers (issue 39): Muon steps the whole matrices
    on the host, AdamW its shards with the host kernels, and the copies through the device change nothing."""
    transfers = LateTransfers()
    run = train(*build(zero, runner_with(transfers), muon=True))
    assert transfers.side_work > 0
    assert_identical(run, train(*build(zero, muon=True)))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRADIENT_RUNS))
def test_reduced_gradients_leave_the_device_and_train_as_when_summed_in_place(name):
    zero = GRADIENT_RUNS[name]
    transfers = LateTransfers()
    model, engine = build(zero, runner_with(transfers))
    seen = {}

    def after_backward():
        if not seen:
            seen["report"] = engine.memory_report()
            seen["device_shards"] = [fp.grad_shard for fp in engine.flat_params if fp.policy.grads]

    run = train(model, engine, after_backward)
    assert_identical(run, train(*build(zero)))  # the same offload summing on the (host) device, in place
    assert transfers.side_work > 0
    if zero["stage"] >= 2:  # Note: [Reduced gradients leave the device]
        assert seen["device_shards"] and all(shard is None for shard in seen["device_shards"])
        estimate = estimate_memory(
            models.TinyGPT(),
            1,
            zero["stage"],
            "cpu",
            zero.get("offload_params", "none"),
            zero.get("precision", "32-true"),
        )
        assert seen["report"]["grads"]["device"] == estimate.bytes["grads"]["device"] == 0
        assert seen["report"]["grads"]["host"] == estimate.bytes["grads"]["host"] > 0


# -- pinned memory ----------------------------------------------------------------------------------------------
class Driver:
    """Page-locking that records what it was asked and refuses what ``refuse`` says."""

    def __init__(self, refuse=lambda nbytes: False):
        self.registered: dict[int, int] = {}
        self.refuse = refuse

    def register(self, pointer: int, nbytes: int) -> bool:
        if self.refuse(nbytes):
            return False
        self.registered[pointer] = nbytes
        return True

    def unregister(self, pointer: int) -> None:
        del self.registered[pointer]


MIB = 2**20


def test_pinned_memory_is_exact_within_its_budget_and_released():
    driver = Driver(refuse=lambda nbytes: nbytes == 3 * MIB)
    memory = pinned.PinnedHostMemory(4 * MIB, driver.register, driver.unregister)
    small = memory.empty(1000, torch.float32)  # below MIN_PINNED_BYTES: may share pages, stays pageable
    one = memory.empty(MIB // 4, torch.float32)
    two = memory.empty(MIB // 2, torch.float32)
    over = memory.empty(MIB // 2, torch.float32)  # 1 + 2 + 2 MiB > 4 MiB: left pageable
    assert not memory.is_pinned(small) and memory.is_pinned(one) and memory.is_pinned(two)
    assert not memory.is_pinned(over) and memory.refused_bytes == 2 * MIB
    assert sorted(driver.registered.values()) == [MIB, 2 * MIB] and memory.pinned_bytes == 3 * MIB  # not rounded
    memory.unpin(two)
    refused = memory.empty(3 * MIB // 4, torch.float32)  # fits now, but the driver refuses it
    assert not memory.is_pinned(refused) and memory.pinned_bytes == MIB
    copy = memory.copy_of(torch.arange(MIB // 2, dtype=torch.float32))
    assert memory.is_pinned(copy) and torch.equal(copy, torch.arange(MIB // 2, dtype=torch.float32))
    memory.release()
    assert driver.registered == {} and memory.pinned_bytes == 0
    assert over.numel() == MIB // 2  # refused buffers are ordinary host tensors


def test_only_the_buffers_copied_to_or_from_the_device_are_pinned(monkeypatch):
    monkeypatch.setattr(pinned, "MIN_PINNED_BYTES", 0)  # the tiny model's buffers count too
    driver = Driver()
    memory = pinned.PinnedHostMemory(2**40, driver.register, driver.unregister)
    model, engine = build({**STAGE3_PARAMS, "precision": "bf16-mixed"}, runner_with(LateTransfers(), memory))
    generator = torch.Generator().manual_seed(1)
    engine.backward(model(models.TinyGPT.make_batch(generator, 4)))
    engine.step()
    host = engine.step_runner.hosts[0]
    address = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    copied = {address(fp.shard) for fp in engine.flat_params} | {address(t) for t in host._host_grads.values()}
    copied |= {address(host._staging)} if host._staging is not None else set()
    kept = {address(fp.master) for fp in engine.flat_params}
    kept |= {address(v) for state in engine.optimizer.state.values() for v in state.values() if v.numel() > 1}
    assert set(driver.registered) == copied and not kept & copied
    with contextlib.suppress(Exception):
        engine.remove_hooks()
    assert driver.registered == {} and memory.pinned_bytes == 0  # released when the offload closes
