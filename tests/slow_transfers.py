"""A stand-in for a device's copies whose work lands late, so offload's ordering can be tested on the host.

:class:`SlowTransfers` implements ``ds_strategy.offload.transfers.Transfers`` over host tensors. Work issued on a
"stream" runs on that stream's thread, in issue order, ``delay`` seconds after it was issued; its ``Done`` is set
then. A copy to the "device" hands back the values at once (the rest of the run needs them), and reads its host
buffer again ``delay`` seconds later, where a real DMA would: if the buffer changed in between, the host rewrote it
before the device had read it, and ``races`` counts it. Copies to the device may land later than side-stream work
issued after them, as on a device whose compute stream is busy.
"""

import queue
import threading
import time

import torch


class _Done:
    def __init__(self):
        self._event = threading.Event()

    def synchronize(self) -> None:
        self._event.wait()


class _Stream:
    """Runs submitted work in order, each ``delay`` seconds after its submission."""

    def __init__(self, delay: float):
        self.delay = delay
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, work) -> _Done:
        done = _Done()
        self._work.put((time.monotonic() + self.delay, work, done))
        return done

    def _run(self) -> None:
        while True:
            due, work, done = self._work.get()
            time.sleep(max(0.0, due - time.monotonic()))
            work()
            done._event.set()


class SlowTransfers:
    """``read_delay``: how late a copy to the device reads its host buffer (queued behind the compute stream's
    kernels); ``side_delay``: how late side-stream work lands."""

    def __init__(self, read_delay: float = 0.3, side_delay: float = 0.02):
        self._compute, self._side = _Stream(read_delay), _Stream(side_delay)
        self._reads: list[_Done] = []
        self.races = 0
        self.copies_to_device = 0
        self.side_work = 0

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        seen = host.clone()

        def late_read() -> None:
            if not torch.equal(host, seen):
                self.races += 1

        self.copies_to_device += 1
        self._reads.append(self._compute.submit(late_read))
        return seen.clone()

    def wait_device_reads(self) -> None:
        for done in self._reads:
            done.synchronize()
        self._reads.clear()

    def on_side_stream(self, work, *reads: torch.Tensor) -> _Done:
        self.side_work += 1
        return self._side.submit(work)
