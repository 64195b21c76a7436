"""Offload's copies between host and device: issued on streams, fenced by events, behind one small interface.

:class:`CudaTransfers` is the implementation for a CUDA device; a CPU device needs none (the host is the device, and
offload reads host tensors in place). Tests drive the offload logic on the host through a fake whose work runs only
when the host waits for it (``tests/offload/late_transfers.py``), so that an ordering the code forgot shows as a wrong
value.

Note: [Host buffers a device copy reads]
A copy from pinned host memory to the device (``non_blocking``) returns to the host at once; the device reads the
buffer later, in order with the stream's other work. Until then the host must not rewrite it, or the device reads
values from after the rewrite. Stage-3 parameter offload has exactly that buffer: the parameter shard a gather
copies to the device is the one the host optimizer writes updated parameters into. So every copy out of a host
buffer records an event (:meth:`CudaTransfers.to_device`), and before the step rewrites any shard the host waits
for the last of them (:meth:`CudaTransfers.wait_device_reads`): one wait per step, on copies issued during
backward that are long done by then. This was latent while every NCCL wait blocked the host until the collective,
and with it the copy before it, had finished (Note: [What a wait guarantees on each backend] in
``ds_strategy.comm.collectives``).

Note: [Work on the side stream]
Copies that should overlap compute (a reduced gradient to the host) run on one side stream: it first waits for
what the current stream has issued (so the copy reads finished values), tensors it reads are recorded on it (so
the caching allocator does not hand their memory out again before it is done) and an event marks its end, which
the host waits on before reading the result (:meth:`CudaTransfers.on_side_stream`). Work on the side stream runs
in the order it was issued, so a copy issued later may read what an earlier one wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class Done(Protocol):
    """Work issued off the host; ``synchronize`` returns once it is done."""

    def synchronize(self) -> None: ...


class Transfers(Protocol):
    """What offload asks of a device for its copies (see the module docstring)."""

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A copy of ``host`` on the device, in order with the current stream; its read of ``host`` is fenced
        (Note: [Host buffers a device copy reads])."""

    def wait_device_reads(self) -> None:
        """Block the host until every copy :meth:`to_device` issued has read its host buffer."""

    def on_side_stream(self, work: Callable[[], None], *reads: torch.Tensor) -> Done:
        """Run ``work`` (device work and copies) on the side stream after the current stream's work so far;
        ``reads`` are device tensors it reads (Note: [Work on the side stream])."""


class CudaTransfers:
    """:class:`Transfers` on a CUDA device: the current stream for copies to the device, one side stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device)
        self._reads: dict[int, torch.cuda.Event] = {}  # stream id -> the last copy out of host memory on it

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        pinned = host.is_pinned()
        copy = host.to(self.device, non_blocking=pinned)
        if pinned:  # a pageable source has been read (staged) by the time the copy returns
            stream = torch.cuda.current_stream(self.device)
            event = torch.cuda.Event()
            event.record(stream)
            self._reads[stream.stream_id] = event  # a stream runs in order: its last copy covers the earlier ones
        return copy

    def wait_device_reads(self) -> None:
        for event in self._reads.values():
            event.synchronize()
        self._reads.clear()

    def on_side_stream(self, work: Callable[[], None], *reads: torch.Tensor) -> Done:
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            work()
            done = torch.cuda.Event()
            done.record(self._side)
        for tensor in reads:
            if tensor.device.type == "cuda":
                tensor.record_stream(self._side)
        return done


def transfers_for(device: torch.device) -> Transfers | None:
    """The transfers of ``device``: None on the CPU (no copies: the host is the device)."""
    return CudaTransfers(device) if device.type == "cuda" else None
