"""Bytes this rank holds per kind of model state and per place (device / host / nvme), now and at the peak.

Note: [The bound the peak is held to]
Model states are the ZeRO paper's three (parameters, gradients, optimizer state) plus the transient working set:
gathered stage-3 units and gradient scratch. With Adam in fp32 (4 bytes per parameter each for parameters and
gradients, 8 for the two moments; Ψ parameters, N ranks) the paper's formulas are stage 0: 16Ψ, stage 1:
4Ψ + 4Ψ + 8Ψ/N, stage 2: 4Ψ + 4Ψ/N + 8Ψ/N, stage 3: 16Ψ/N (``ds_strategy.estimate`` has the mixed-precision
ones). The working set is bounded by units, not by elements, when the sizes are "units" (the default, see
:func:`unit_bounded_sizes`): gradient scratch (stage 2/3) is at most one reduction bucket in flight plus the
bucket filling, a bucket being the largest unit's elements but at least ``MIN_BUCKET_NUMEL`` (2**18: Note:
[Buckets span units] in :mod:`.buckets`), and stage 3 gathers the unit computing plus one prefetched (and, in
backward, the unit whose reductions are being launched). So ``memory_report(engine, peak=True)``, summed over
kinds and places, stays within formula x 1.05 + the two largest units' parameter bytes + two buckets' gradient
bytes, by construction rather than by timing: the reducer waits for the oldest reduction before scratch passes
the bound, and the gatherer never prefetches past it. ``tests/engine/test_memory_bounds.py`` checks this with
reductions slowed on purpose. Stage 0/1 buckets cost nothing: they reduce the persistent ``grad_full`` buffers.

A whole-tensor optimizer (Muon) keeps each of its parameters whole on one owner rank (Note: [Whole parameters on
owner ranks] in :mod:`.owner_layout`): a rank owns at most Ψ_w/N + P of its Ψ_w elements, P the largest such
parameter, so each partitioned term above (optimizer state and master from stage 1, gradient shards from stage 2,
parameter shards at stage 3) holds at most P elements more than its 1/N; :func:`whole_tensor_ownership` gives the
figures, which the engine's setup summary prints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn

from ..config import UNITS
from .buckets import MIN_BUCKET_NUMEL
from .param_types import plain_tensors

if TYPE_CHECKING:
    from ..config.policies import CommPolicy
    from .flat_param import FlatParam
    from .step_runner import StepRunner
    from .unit import Unit

PLACES = ("device", "host", "nvme")  # where a report (and ds_strategy.estimate) puts bytes
KINDS = ("params", "grads", "optimizer", "buffers")  # of model state, as reported


class WorkingSetSizes(NamedTuple):
    """Element bounds of the working set the reducer and the gatherer keep to."""

    reduce_bucket: int  # gradient scratch in flight before launching waits for the oldest reduction
    prefetch: int  # elements of upcoming units gathered ahead of use
    max_live: int  # gathered elements alive at once, beyond which prefetching stops (gathers on demand go ahead)


def unit_bounded_sizes(comm: CommPolicy, units: list[Unit]) -> WorkingSetSizes:
    """``comm``'s sizes with "units" resolved (see [The bound the peak is held to]): a reduction bucket of the
    largest unit's elements, at least ``MIN_BUCKET_NUMEL``; one unit prefetched, and then at most the root and two
    units gathered."""
    scratch = max((sum(fp.padded_numel for fp in u.flat_params) for u in units), default=0)
    gathered = max((sum(fp.padded_numel for fp in u.partitioned) for u in units[1:]), default=0)
    root = sum(fp.padded_numel for fp in units[0].partitioned) if units else 0
    max_live = int(comm.max_live_parameters)
    if comm.prefetch_bucket_size == UNITS:
        max_live = min(max_live, root + 2 * gathered)
    return WorkingSetSizes(
        max(MIN_BUCKET_NUMEL, scratch) if comm.reduce_bucket_size == UNITS else int(comm.reduce_bucket_size),
        gathered if comm.prefetch_bucket_size == UNITS else int(comm.prefetch_bucket_size),
        max_live,
    )


class WorkingSetPeak:
    """The live bytes of gathered stage-3 buffers and of gradient scratch, and the largest sum seen.

    The reducer reports its scratch as it allocates and frees it, the gatherer calls :meth:`observe` after each
    gather: the only moments the sum can grow. ``peak`` holds both parts at the moment of the largest sum.
    """

    def __init__(self, flat_params: list[FlatParam]):
        # each partitioned buffer with its bytes when gathered, computed once: observed after every gather
        self.partitioned = [(fp, fp.padded_numel * fp.full.element_size()) for fp in flat_params if fp.policy.params]
        self.scratch_bytes = 0
        self.peak = {"params": 0, "buffers": 0}

    def gathered_bytes(self) -> int:
        return sum(nbytes for fp, nbytes in self.partitioned if fp.is_full_allocated)

    def observe(self, scratch_bytes: int | None = None) -> None:
        if scratch_bytes is not None:
            self.scratch_bytes = scratch_bytes
        live = {"params": self.gathered_bytes(), "buffers": self.scratch_bytes}
        if sum(live.values()) > sum(self.peak.values()):
            self.peak = live

    def reset(self) -> None:
        """Start a new peak from what is live now (e.g. before the step to be measured)."""
        self.peak = {"params": 0, "buffers": 0}
        self.observe()


class _Scratch(Protocol):
    peak_scratch_bytes: int


class HeldState(Protocol):
    """What a report reads of an engine (:class:`~.engine.ZeroEngine` is one): typed here, so that this module,
    which the reducer and the gatherer import for :class:`WorkingSetPeak`, imports no engine."""

    flat_params: list[FlatParam]
    module: nn.Module
    world_size: int
    step_runner: StepRunner
    working_set: WorkingSetPeak
    reducer: _Scratch

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...


class WholeTensorOwnership(NamedTuple):
    """Elements of whole-tensor parameters: this rank's, all ranks', the largest parameter's, and the bound."""

    owned: int
    total: int
    largest: int
    world_size: int

    @property
    def bound(self) -> float:
        """What any rank may own: Ψ_w/N + P."""
        return self.total / self.world_size + self.largest


def whole_tensor_ownership(engine: HeldState) -> WholeTensorOwnership | None:
    """How much of the whole-tensor optimizers' parameters this rank owns, against the bound; None when no flat
    buffer is laid out by owners (no whole-tensor optimizer, or optimizer state not partitioned)."""
    owned_layouts = [fp for fp in engine.flat_params if fp.regions is not None]
    if not owned_layouts:
        return None
    return WholeTensorOwnership(
        owned=sum(fp.shard_numel for fp in owned_layouts),
        total=sum(fp.numel for fp in owned_layouts),
        largest=max(slot.numel for fp in owned_layouts for slot in fp.slots),
        world_size=engine.world_size,
    )


def _place(tensor: torch.Tensor, compute_device: torch.device) -> str:
    """Host means CPU memory while compute runs on an accelerator; on a CPU-only run the CPU is the device."""
    return "host" if tensor.device.type == "cpu" and compute_device.type != "cpu" else "device"


def memory_report(engine: HeldState, peak: bool = False) -> dict[str, dict[str, int]]:
    """``{"params"|"grads"|"optimizer"|"buffers": {"device"|"host"|"nvme": bytes}}`` for this rank.

    params: the compute-dtype parameters this rank holds (full buffers while gathered, shards otherwise, plus
    parameters ZeRO does not manage such as frozen ones). grads: gradient buffers and shards. optimizer: fp32
    master weights when separate from the parameters, plus the optimizer's state tensors. buffers: the peak
    bytes of gradient scratch (reduction buckets) seen so far.

    ``peak``: the state at the working set's peak since construction or ``engine.working_set.reset()`` instead
    of now: the persistent states as they are now, plus the gathered stage-3 buffers and the gradient scratch
    live together at their largest (see [The bound the peak is held to]).

    With offload, what ``engine.step_runner`` placed is reported where it put it (on a CPU-only run too, where
    host and device are the same memory), plus the tensors only it holds (host gradient copies, staging buffers).
    """
    device = engine.flat_params[0].device if engine.flat_params else torch.device("cpu")
    report = {kind: dict.fromkeys(PLACES, 0) for kind in KINDS}
    placed = engine.step_runner.places()

    def add(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            place = placed.get(tensor.untyped_storage().data_ptr()) or _place(tensor, device)
            report[kind][place] += tensor.numel() * tensor.element_size()

    managed = set()
    for fp in engine.flat_params:
        managed.update(id(p) for p in fp.params)
        if fp.is_full_allocated and not (peak and fp.policy.params):
            add("params", fp.full)
        if fp.policy.params:
            add("params", fp.shard)
        add("grads", fp.grad_full)
        shared = (
            fp.grad_full is not None
            and fp.grad_shard is not None
            and (fp.grad_shard.untyped_storage().data_ptr() == fp.grad_full.untyped_storage().data_ptr())
        )
        if fp.grad_shard is not None and not shared:
            add("grads", fp.grad_shard)
        if fp.master.untyped_storage().data_ptr() != fp.master_region().untyped_storage().data_ptr():
            add("optimizer", fp.master)
    for p in engine.module.parameters():
        if id(p) not in managed:
            for plain in plain_tensors(p):
                add("params", plain)
            add("grads", p.grad)
    for optimizer in engine.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    add("optimizer", value)
    if peak:
        report["params"]["device"] += engine.working_set.peak["params"]
        report["buffers"]["device"] += engine.working_set.peak["buffers"]
    else:
        report["buffers"]["device"] += engine.reducer.peak_scratch_bytes
    for kind, tensor in engine.step_runner.own_tensors():
        add(kind, tensor)
    return report


def summary(engine: HeldState, stage: int, unit_count: int) -> str:
    """The engine's setup line: stage, ranks, units, trainable elements, model-state MiB per rank and where the
    step runner placed them, and a whole-tensor optimizer's ownership against its bound."""
    report = memory_report(engine)
    mib = {k: sum(v.values()) / 2**20 for k, v in report.items()}
    placed = engine.step_runner.describe(report)
    whole = whole_tensor_ownership(engine)
    owned = (
        f"; whole-tensor parameters: this rank owns {whole.owned:,} of {whole.total:,} elements (at most "
        f"{whole.bound:,.0f}: 1/N plus the largest, {whole.largest:,})"
        if whole is not None
        else ""
    )
    return (
        f"ZeRO stage {stage} on {engine.world_size} ranks, {unit_count} units, "
        f"{sum(fp.numel for fp in engine.flat_params):,} trainable params; per rank: "
        + ", ".join(f"{k} {v:.1f} MiB" for k, v in mib.items())
        + (f"; {placed}" if placed else "")
        + owned
    )
