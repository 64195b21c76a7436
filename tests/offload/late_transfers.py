"""A stand-in for a device's copies whose work lands as late as it possibly can, so offload's ordering can be tested
on the host, deterministically.

:class:`LateTransfers` implements ``ds_strategy.offload.transfers.Transfers`` over host tensors, like a device whose
streams make progress only when the host waits for them: work issued on a "stream" runs, in issue order, when the
host synchronises on it or on later work of the same stream, never before. A copy to the "device" hands back the
values at once (the rest of the run needs them) and reads its host buffer again when its stream runs, where a real
DMA would: if the buffer changed in between, the host rewrote it before the device had read it, and ``races``
counts it. A wait the code forgot therefore shows every time, as a race or as a gradient that never arrived.
"""

import torch


class _Stream:
    """Runs submitted work in order, only as far as the host waits."""

    def __init__(self):
        self._queued: list = []

    def submit(self, work) -> "_Done":
        done = _Done(self)
        self._queued.append((work, done))
        return done

    def run_through(self, target: "_Done") -> None:
        while not target.finished:
            work, done = self._queued.pop(0)
            work()
            done.finished = True


class _Done:
    def __init__(self, stream: _Stream):
        self._stream = stream
        self.finished = False

    def synchronize(self) -> None:
        self._stream.run_through(self)


class LateTransfers:
    def __init__(self):
        self._compute, self._side = _Stream(), _Stream()
        self._last_read: _Done | None = None
        self.races = 0
        self.copies_to_device = 0
        self.side_work = 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        seen = host.clone()

        def late_read() -> None:
            if not torch.equal(host, seen):
                self.races += 1

        self.copies_to_device += 1
        self._last_read = self._compute.submit(late_read)
        return seen.clone()

    def wait_device_reads(self) -> None:
        if self._last_read is not None:
            self._last_read.synchronize()

    def on_side_stream(self, work, *reads: torch.Tensor) -> _Done:
        self.side_work += 1
        return self._side.submit(work)
