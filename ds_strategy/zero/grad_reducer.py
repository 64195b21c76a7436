"""Gradient reduction: from the gradients autograd produces to averaged gradients in the optimizer's region."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

import torch
from torch.autograd import Variable

from ..comm.collectives import Collectives, PendingCollective
from ..profiler_ranges import profiler_range
from .buckets import bucket_label, plan_buckets
from .compile_boundary import eager_hook
from .flat_param import FlatParam, ParamSlot
from .memory_report import WorkingSetPeak
from .step_runner import DeviceGradients, GradientStore
from .unit import Unit

QuantizedReduceScatter = Callable[..., PendingCollective]  # qgZ: (out fp32, full, label=...) -> PendingCollective


class _Kind(Enum):
    """How a reduction leaves its result (see Note: [Accumulation and reduction])."""

    SCATTERED = "a scratch buffer reduce-scattered, its slice added into grad_shard (stage 2/3)"
    SCATTERED_ONCE = "grad_full reduce-scattered, the slice's mean stored in grad_shard (stage 1)"
    ALL_REDUCED = "the whole grad_full, or its comm-dtype copy, summed on every rank (stage 0/1)"


class _Reduction(NamedTuple):
    """A bucket's gradient reduction in flight: per flat buffer what finishing it reads (``outs``), and the
    scratch it keeps alive."""

    pending: PendingCollective
    fps: tuple[FlatParam, ...]
    outs: tuple[torch.Tensor, ...]
    kind: _Kind
    scratch_numel: int


class _Route(NamedTuple):
    """What a parameter's gradient hook needs: its flat buffer, its slot, its bucket and, at stage 0/1, its view of
    ``grad_full`` (the buffer lives as long as the engine, so the view is made once)."""

    fp: FlatParam
    slot: ParamSlot
    bucket: int
    view: torch.Tensor | None


def _grad_view(fp: FlatParam, slot: ParamSlot) -> torch.Tensor | None:
    """``slot``'s view of ``fp.grad_full``; None when gradients are partitioned (they go to a scratch buffer)."""
    if fp.policy.grads:
        return None
    return fp.grad_full.narrow(0, slot.offset, slot.numel).view(slot.shape)


def _grad_as_view(param: torch.Tensor, slot, view: torch.Tensor) -> torch.Tensor | None:
    """Stage 0/1: ``param.grad`` becomes its view of ``grad_full``, so later backwards accumulate in place.

    A tensor-parallel (DTensor) parameter keeps the dtype it was built with while its local shard lives in the
    16-bit buffer (mixed precision), and torch refuses a ``.grad`` of another dtype than the parameter's: such a
    parameter's ``.grad`` is left None, and the next backward's gradient is added into the view as this one was.
    """
    if slot.tp is None:
        return view
    return slot.tp.as_dtensor(view) if param.dtype == view.dtype else None


class GradReducer:
    """Collects each parameter's gradient as autograd finishes it and reduces whole flat buffers across ranks.

    Note: [Accumulation and reduction]
      Invariant: after any number of backward calls since the last step, synced or not, in any order, the
      region the optimizer reads (``grad_shard``, or ``grad_full`` at stage 0) holds the mean over ranks of
      everything accumulated once the last synced backward has reduced. Each synced reduction must therefore
      leave ``grad_full`` in a state that later backwards can accumulate onto:
      Gradients not partitioned (stage 0/1): each parameter's ``.grad`` becomes a view of the flat buffer's
      ``grad_full``, so later micro-batches accumulate in place. With ``sync`` off (under ``no_sync``) nothing
      is communicated. A synced backward reduces ``grad_full`` in one of two ways. All-reduce (stage 0; stage 1
      with ``use_all_reduce``): the whole ``grad_full`` becomes the mean on every rank, and the shard is taken
      from it; a later backward adds this rank's new gradients g onto the mean M, and the next all-reduce gives
      mean(M + g) = M + mean(g), so accumulation stays exact. ``.grad`` is then the averaged gradient every rank
      agrees on, as under DDP. Reduce-scatter (stage 1): the mean of this rank's slice goes into ``grad_shard``
      and ``grad_full`` keeps this rank's own sum, which the next reduce-scatter reduces whole again; that local
      sum is not the gradient, so the parameters' ``.grad`` are set to None (the engine's ``clip_grad_norm_``
      and ``grad_norm`` read the reduced shards). Either way, ``no_sync`` on all but the last micro-batch keeps
      to one reduction per optimizer step.
      Gradients partitioned (stage 2/3): a rank never keeps a full gradient buffer, so every micro-batch is
      reduced (DeepSpeed's choice as well): the gradient is copied into a scratch buffer of the flat buffer's
      size, the parameter's ``.grad`` is dropped, and once the flat buffer is complete the scratch is
      reduce-scattered and added into the fp32 ``grad_shard``. That costs one reduce-scatter per micro-batch.

    Note: [Gradient dtypes under mixed precision]
    Autograd produces gradients in the compute dtype, and
    ``grad_full`` (stage 0/1) keeps them so: 2 bytes per parameter in 16-bit training. They travel in
    ``comm_dtype`` (``ZeroConfig.gradient_communication_dtype``: fp32 for fp16 training, whose sums of scaled
    gradients would overflow fp16; bf16 for bf16 training): stage 2/3 scratch buffers are allocated in it, and a
    stage 0/1 ``grad_full`` of another dtype is converted into a temporary for its one reduction. The average is
    taken in the wider dtype. The reduced ``grad_shard`` is where micro-batches accumulate at stage 2/3; it is in
    ``grad_shard_dtype`` (``ZeroConfig.grad_accum_dtype``: by default the compute dtype, 2 bytes per parameter
    as in the ZeRO paper and DeepSpeed; "fp32" for exact accumulation). The engine converts it to an fp32 copy
    for the step and divides the loss scale out of that copy, never in fp16, which would underflow the small
    gradients that loss scaling exists to keep. At stage 0 the optimizer region is ``grad_full`` itself.

    Note: [Collective order]
    Ranks must issue collectives in the same order or gloo/NCCL pair the wrong buffers.
    The flat buffers, in the fixed ``order`` (reverse forward order), are cut once into buckets (Note: [Buckets
    span units] in :mod:`.buckets`); a bucket is reduced, by one coalesced collective, when the last of its
    parameters' gradients has arrived and every bucket before it has been launched; the buckets still missing at
    the end of backward (unused parameters) are launched then, in that order, with zeros for what never arrived.

    Note: [Bucket lifetime]
    A scratch buffer lives from the first gradient copied into it until its bucket's reduction
    has been waited on and added into ``grad_shard``. At most ``bucket_numel`` elements of scratch are in flight:
    launching past that waits for the oldest reductions first, so scratch peaks at two buckets (one in flight,
    one filling). Everything is waited on at the end of backward,
    so the optimizer never reads a shard a reduction is still writing. At stage 0/1 the buffer in flight is
    ``grad_full`` itself (or its copy in ``comm_dtype``): nothing writes it between its launch, after its last
    gradient arrived, and the end of backward. Under qgZ (``quantized_reduce_scatter``) the scratch is read
    once, into quantised packets, when the reduction is launched; the packets and the fp32 ``out`` live until the
    wait, which sums into ``out`` (see :mod:`ds_strategy.comm.quantized`). With ``overlap`` off every reduction
    is waited on as soon as it is launched, inside the hook that launched it, so at most one is ever in flight.
    """

    def __init__(
        self,
        flat_params: list[FlatParam],
        unit_of: Sequence[Unit],
        collectives: Collectives,
        overlap: bool,
        bucket_numel: int,
        comm_dtype: torch.dtype | None = None,
        working_set: WorkingSetPeak | None = None,
        on_launched: Callable[[FlatParam], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
        on_reduced: Callable[[FlatParam, torch.Tensor], None] | None = None,
        quantized_reduce_scatter: QuantizedReduceScatter | None = None,
        gradients: GradientStore | None = None,
    ):
        """``on_launched(fp)``: fp's reduction is in flight (stage 3 frees the unit's weights). ``on_backward_end()``:
        every reduction of this backward has finished. ``on_reduced(fp, grad)``: a synced reduction into a stage 0/1
        optimizer region finished and ``grad`` is final for the step (offload copies it to the host).
        ``quantized_reduce_scatter``: qgZ, used instead of the plain reduce-scatter at stage 2/3. ``gradients``:
        where partitioned (stage 2/3) gradients are summed, the step runner's (by default on the device).
        ``flat_params`` are the engine's, in order (``fp.index`` is each one's position), their gradient buffers
        allocated (``FlatParam.allocate_grads``). ``unit_of``: each one's unit, by ``fp.index`` (Note: [Unit
        ownership] in :mod:`.unit`). A buffer is reduced over its unit's group, which may be another than
        ``collectives`` (experts: Note: [Expert units] in :mod:`.engine`), still divided by ``divide_factor``, and
        never shares a bucket with another group's buffers; a partitioned (stage-3) unit's whole buffers share
        buckets only with each other: a bucket shared with other units' would stay open while the unit's
        partitioned buffers fill theirs."""
        self.order = list(reversed(flat_params))
        self.collectives = collectives
        self._unit_of = unit_of
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self.bucket_numel = bucket_numel
        self.sync = True
        # what the sum over the group is divided by: its size (the mean), unless ZeroEngine.set_gradient_divide_factor
        self.divide_factor: float = collectives.world_size
        self.peak_scratch_bytes = 0
        self.working_set = working_set or WorkingSetPeak([])  # told of every scratch allocation and free
        self.on_launched = on_launched
        self.on_backward_end = on_backward_end
        self.on_reduced = on_reduced
        self.quantized_reduce_scatter = quantized_reduce_scatter
        self.gradients = gradients or DeviceGradients()
        self.buckets = plan_buckets(self.order, bucket_numel, self._bucket_key)
        self._bucket_of = bucket_of = {fp.index: b for b, bucket in enumerate(self.buckets) for fp in bucket}
        self._params_in = [sum(len(fp.params) for fp in bucket) for bucket in self.buckets]
        # per parameter, looked up once per gradient: everything its hook needs, derived once here
        self._route = {
            id(p): _Route(fp, slot, bucket_of[fp.index], _grad_view(fp, slot))
            for fp in flat_params
            for p, slot in zip(fp.params, fp.slots)
        }
        self._ready_count = [0] * len(self.buckets)
        self._scratch: dict[int, torch.Tensor] = {}  # fp.index -> scratch buffer (a view of its bucket's)
        self._scratch_bytes = 0  # of the scratch buffers alive
        self._next = 0
        self._in_flight: deque[_Reduction] = deque()
        self._callback_queued = False
        self._handles = []

    def _comm_dtype(self, fp: FlatParam) -> torch.dtype:
        return self.comm_dtype or fp.grad_dtype

    def _bucket_key(self, fp: FlatParam):
        """What buffers sharing a bucket must agree on; None for a buffer reduced alone (Note: [Buckets span
        units] in :mod:`.buckets`)."""
        if fp.policy.params or fp.regions is not None or (fp.policy.grads and self.quantized_reduce_scatter):
            return None
        unit = self._unit_of[fp.index]
        return (
            fp.policy.grads,
            fp.policy.optimizer,
            self._comm_dtype(fp),
            fp.grad_dtype,
            fp.device,
            id(unit) if unit.partitioned else None,
            id(unit.collectives),
        )

    def _collectives_for(self, fp: FlatParam) -> Collectives:
        return self._unit_of[fp.index].collectives

    def register_hooks(self) -> None:
        for fp in self.order:
            for p in fp.params:
                self._handles.append(p.register_post_accumulate_grad_hook(eager_hook(self._on_grad)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- backward ----------------------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        """Per parameter, so without a profiler range (one costs microseconds): the flat buffer's ranges carry it.
        Kept to a lookup, one copy or add, and a count: its cost is paid per parameter per backward."""
        fp, slot, bucket, view = self._route[id(param)]
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        grad = param.grad if slot.tp is None else slot.tp.local_grad(param.grad)
        if view is None:
            scratch = self._scratch.get(fp.index)
            if scratch is None:
                scratch = self._scratch_for(fp)
            scratch.narrow(0, slot.offset, slot.numel).view(slot.shape).copy_(grad)
            param.grad = None
        elif grad.data_ptr() != view.data_ptr():
            view.add_(grad)
            param.grad = _grad_as_view(param, slot, view)
        count = self._ready_count[bucket] + 1
        self._ready_count[bucket] = count
        if count == self._params_in[bucket]:
            self._launch_ready()

    # -- gradients handed over by a caller (pipeline schedules) --------------------------------------------------
    def collect(self, params, scale: float) -> None:
        """Add ``scale`` times each parameter's ``.grad`` into its flat buffer's accumulation region and drop the
        ``.grad``, for gradients autograd's hooks did not deliver (Note: [Pipeline gradients] in
        :mod:`ds_strategy.pipeline.runner`). At stage 2/3 that region is the scratch buffer the next
        :meth:`reduce` of its flat buffer reduce-scatters, at stage 0/1 ``grad_full``. A reduction still reading
        one of those regions (the previous micro-batch's) is finished first."""
        params = list(params)
        targets = {self._route[id(p)][0].index for p in params}
        if any(fp.index in targets for reduction in self._in_flight for fp in reduction.fps):
            self.wait_all()
        for param in params:
            if param.grad is None:
                continue
            fp, slot, _, _ = self._route[id(param)]
            grad = param.grad if slot.tp is None else slot.tp.local_grad(param.grad)
            region = self._scratch_for(fp) if fp.policy.grads else fp.grad_full
            region.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1), alpha=scale)
            param.grad = None

    def reduce(self, flat_params: list[FlatParam]) -> None:
        """Launch the reductions of ``flat_params`` (in that order, the same on every rank) for what
        :meth:`collect` gathered, as a synced backward would (under ``no_sync`` only stage 2/3 communicate)."""
        for fp in flat_params:
            if fp.policy.grads or self.sync:
                self._launch([fp])

    def finish(self) -> None:
        """End a backward the caller drove: every reduction waited on, then ``on_backward_end``."""
        self.wait_all()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _scratch_for(self, fp: FlatParam) -> torch.Tensor:
        """``fp``'s scratch buffer: at its bucket's first gradient, one allocation for every buffer of the bucket
        that has none (a pipeline schedule may reduce a bucket's buffers one by one and refill some early)."""
        scratch = self._scratch.get(fp.index)
        if scratch is None:
            missing = [other for other in self.buckets[self._bucket_of[fp.index]] if other.index not in self._scratch]
            storage = torch.zeros(sum(o.padded_numel for o in missing), dtype=self._comm_dtype(fp), device=fp.device)
            offset = 0
            for other in missing:
                self._scratch[other.index] = storage.narrow(0, offset, other.padded_numel)
                offset += other.padded_numel
            self._scratch_bytes += storage.numel() * storage.element_size()
            self.peak_scratch_bytes = max(self.peak_scratch_bytes, self._scratch_bytes)
            self.working_set.observe(self._scratch_bytes)
            scratch = self._scratch[fp.index]
        return scratch

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and self._ready_count[self._next] < self._params_in[self._next]:
                return
            self._next += 1
            if bucket[0].policy.grads or self.sync:
                self._launch(bucket)

    def _launch(self, bucket: list[FlatParam]) -> None:
        """One collective for ``bucket``'s flat buffers (all of one kind: see ``_bucket_key``)."""
        first = bucket[0]
        collectives = self._collectives_for(first)
        label = bucket_label("gradients", bucket)
        with profiler_range("grad.reduce", label):
            if first.policy.grads:
                scratches = [self._scratch_for(fp) for fp in bucket]
                if first.regions is not None:  # owner layout: exact, each region to its owner (never quantised)
                    outs = [scratches[0].narrow(0, first.shard_offset, first.shard_numel)]
                    pending = collectives.reduce_scatter(outs[0], scratches[0], label=label, regions=first.regions)
                elif self.quantized_reduce_scatter is not None:
                    outs = [torch.empty(first.shard_numel, dtype=torch.float32, device=scratches[0].device)]
                    pending = self.quantized_reduce_scatter(outs[0], scratches[0], label=label)
                else:
                    outs = [
                        scratch.narrow(0, fp.shard_offset, fp.shard_numel)
                        if collectives.use_all_reduce
                        else torch.empty(fp.shard_numel, dtype=scratch.dtype, device=scratch.device)
                        for fp, scratch in zip(bucket, scratches)
                    ]
                    pending = collectives.reduce_scatter_many(outs, scratches, label=label)
                launched = _Reduction(pending, tuple(bucket), tuple(outs), _Kind.SCATTERED, sum(map(len, scratches)))
            elif first.policy.optimizer and not collectives.use_all_reduce:
                # reducing regions to their owners writes into what it sends: never grad_full itself
                sends = [fp.grad_full.to(self._comm_dtype(fp), copy=fp.regions is not None) for fp in bucket]
                outs = [
                    fp.grad_shard
                    if fp.grad_shard.dtype == send.dtype
                    else torch.empty(fp.shard_numel, dtype=send.dtype, device=send.device)
                    for fp, send in zip(bucket, sends)
                ]
                if first.regions is not None:
                    pending = collectives.reduce_scatter(outs[0], sends[0], label=label, regions=first.regions)
                else:
                    pending = collectives.reduce_scatter_many(outs, sends, label=label)
                launched = _Reduction(pending, tuple(bucket), tuple(outs), _Kind.SCATTERED_ONCE, 0)
            else:
                sends = [fp.grad_full.to(self._comm_dtype(fp)) for fp in bucket]
                pending = collectives.all_reduce_many(sends, label=label)
                launched = _Reduction(pending, tuple(bucket), tuple(sends), _Kind.ALL_REDUCED, 0)
            self._in_flight.append(launched)
            if self.on_launched is not None:
                for fp in bucket:
                    self.on_launched(fp)
            while self._in_flight and (
                not self.overlap
                or self._scratch_in_flight() > self.bucket_numel
                or self._in_flight[0].pending.is_completed()
            ):
                self._finish_oldest()

    def _scratch_in_flight(self) -> int:
        return sum(reduction.scratch_numel for reduction in self._in_flight)

    def _finish_oldest(self) -> None:
        with profiler_range("grad.finish", self._in_flight[0].fps[0].name):
            reduction = self._in_flight.popleft()
            reduction.pending.wait()
            divisor = self.divide_factor
            if reduction.kind is _Kind.SCATTERED:
                for fp, out in zip(reduction.fps, reduction.outs):
                    self.gradients.add(fp, out, 1.0 / divisor)
                    scratch = self._scratch.pop(fp.index)
                    self._scratch_bytes -= scratch.numel() * scratch.element_size()
                self.working_set.observe(self._scratch_bytes)
                return
            for fp, out in zip(reduction.fps, reduction.outs):
                if reduction.kind is _Kind.ALL_REDUCED:
                    _store_all_reduced(fp, out, divisor)
                else:
                    _store_mean(fp.grad_shard, out, divisor)
                    for p in fp.params:  # grad_full keeps this rank's own sum; no rank may read it as the gradient
                        p.grad = None
                if self.on_reduced is not None and self.sync:
                    self.on_reduced(fp, self.reduced_grad(fp))

    def _end_of_backward(self) -> None:
        with profiler_range("backward.end"):
            self._launch_ready(force=True)
            self.wait_all()
            self._next = 0
            self._ready_count = [0] * len(self._ready_count)
            self._callback_queued = False
            if self.on_backward_end is not None:
                self.on_backward_end()

    def wait_all(self) -> None:
        """Finish every reduction in flight (the optimizer must not read a shard still being written)."""
        while self._in_flight:
            self._finish_oldest()

    # -- optimizer step ----------------------------------------------------------------------------------------
    def reduced_grad(self, fp: FlatParam) -> torch.Tensor:
        """The averaged gradient of the region the optimizer updates (shard, or whole buffer at stage 0)."""
        if fp.policy.grads:
            return self.gradients.read(fp)
        return fp.reduced_grad_shard() if fp.policy.optimizer else fp.grad_full

    def zero_grads(self, fp: FlatParam) -> None:
        if fp.grad_full is not None:
            fp.grad_full.zero_()
        if fp.policy.grads:
            self.gradients.zero(fp)


def _store_all_reduced(fp: FlatParam, summed: torch.Tensor, divisor: float) -> None:
    """After an all-reduce of ``grad_full`` (``summed`` is it, or its copy in the communication dtype): the sum over
    ``divisor`` (the mean) into the optimizer's shard, taken from ``summed`` before anything is rounded, then into
    ``grad_full``."""
    if fp.policy.optimizer:
        mine = summed.narrow(0, fp.shard_offset, fp.shard_numel)
        if fp.grad_shard.data_ptr() != mine.data_ptr():
            if fp.grad_shard.element_size() >= mine.element_size():
                fp.grad_shard.copy_(mine).div_(divisor)
            else:
                fp.grad_shard.copy_(mine / divisor)
    _store_mean(fp.grad_full, summed, divisor)


def _store_mean(target: torch.Tensor, summed: torch.Tensor, divisor: float) -> None:
    """``target = summed / divisor``, dividing in the wider of the two dtypes (``summed`` may be ``target``)."""
    if summed.data_ptr() == target.data_ptr() and summed.dtype == target.dtype:
        target.div_(divisor)
    elif target.element_size() >= summed.element_size():
        target.copy_(summed).div_(divisor)
    else:
        target.copy_(summed.div_(divisor))
