"""Partitioned gradients of an offloaded optimizer, summed in host buffers: none stays on the device.

Note: [Reduced gradients leave the device]
With the optimizer offloaded at stage 2/3 the host optimizer reads this rank's gradient shard in fp32, so that is
where the shard is summed, as DeepSpeed does: each reduced slice is handed to :meth:`HostGradients.add` as its
reduction finishes and copied to the flat buffer's host buffer on the side stream while backward goes on (Note:
[Work on the side stream] in :mod:`.transfers`), converted to fp32 on the device first. The reduced slice is then
dropped, so between reductions the device holds no gradient of an offloaded buffer: not the 2 (bf16) or 4 (fp32)
bytes per parameter / N a resident shard would cost, nor its fp32 copy at the step. A second backward before the
step (gradient accumulation) adds onto the sum without the host touching it: the side stream brings the host sum
back, adds the new slice on the device and copies the total out again, in order after the first copy (DeepSpeed's
accumulation "in CPU via GPU"). :meth:`HostGradients.read` waits for the flat buffer's last copy; the step, fp16
unscaling, the inf/nan check and clipping then run on the host buffer itself. The sum is in fp32 whatever
``grad_accum_dtype`` says: it is the master's dtype, which the host step reads. Flat buffers whose optimizer stays
on the device (``offload_ratio`` < 1) keep theirs there (:class:`~ds_strategy.zero.step_runner.DeviceGradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..zero.flat_param import FlatParam
    from ..zero.step_runner import GradientStore
    from .transfers import Done, Transfers


class HostGradients:
    """A :class:`~ds_strategy.zero.step_runner.GradientStore` keeping the flat buffers ``held`` (by index) in the
    host buffers ``buffer_of(fp)`` and the others in ``others``."""

    def __init__(
        self,
        held: set[int],
        buffer_of: Callable[[FlatParam], torch.Tensor],
        transfers: Transfers,
        others: GradientStore,
    ):
        self.held = held
        self._buffer_of = buffer_of
        self._transfers = transfers
        self._others = others
        self._in_flight: dict[int, Done] = {}  # fp.index -> its last copy to the host
        self._summed: set[int] = set()  # flat buffers with something added since the last zero

    def add(self, fp: FlatParam, reduced: torch.Tensor, scale: float) -> None:
        if fp.index not in self.held:
            return self._others.add(fp, reduced, scale)
        host, first = self._buffer_of(fp), fp.index not in self._summed
        pinned = host.is_pinned()

        def copy_out() -> None:
            if first:
                total = torch.zeros(host.shape, dtype=host.dtype, device=reduced.device)
            else:
                total = host.to(reduced.device, non_blocking=pinned)
            total.add_(reduced, alpha=scale)  # as DeviceGradients sums, in the host buffer's dtype
            host.copy_(total, non_blocking=pinned)

        self._in_flight[fp.index] = self._transfers.on_side_stream(copy_out, reduced)
        self._summed.add(fp.index)
        return None

    def read(self, fp: FlatParam) -> torch.Tensor:
        if fp.index not in self.held:
            return self._others.read(fp)
        self._wait(fp)
        host = self._buffer_of(fp)
        if fp.index not in self._summed:
            host.zero_()
            self._summed.add(fp.index)
        return host

    def zero(self, fp: FlatParam) -> None:
        if fp.index not in self.held:
            return self._others.zero(fp)
        self._wait(fp)  # a copy still writing the buffer would land after the next read's zeros
        self._summed.discard(fp.index)
        return None

    def _wait(self, fp: FlatParam) -> None:
        done = self._in_flight.pop(fp.index, None)
        if done is not None:
            done.synchronize()
