"""Peak anonymous resident memory of this process over a block of code, sampled from ``/proc/self/status``, and
the allocator setting that lets it fall again when large host blocks are freed.

``RssAnon`` counts heap and anonymous mappings only, not file-backed pages (a memory-mapped checkpoint being read),
which ``ru_maxrss`` and ``VmHWM`` include; so it measures what a rank holds, not what the page cache lends it.

Note: [Large host blocks are mapped and unmapped]
glibc serves a block above its mmap threshold (128 KiB at start) with a mapping of its own, unmapped on free, and
smaller ones from its heaps, which it cannot give back while anything above them lives. But each time a mapped
block is freed the threshold rises to that block's size (up to 32 MiB), so after the first stage-3 unit buffer
is freed the next ones, and every gradient bucket and swap read, come from the heaps, between long-lived small
objects: the freed space is reused only by luck and resident memory grows with every unit built or stepped. With
parameters and optimizer on NVMe that was ~9.5 bytes per parameter per rank at 28-85M parameters, the whole of
what offload exists to remove. :func:`map_large_blocks` fixes the threshold (which also stops it moving), so
every block of ``MAP_LARGE_BLOCKS_BYTES`` or more is a mapping returned to the kernel when freed. The offload
runner sets it when an engine that offloads is built; a ``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc
reads it at start) is left as the user chose, and so is a non-glibc C library.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


MAP_LARGE_BLOCKS_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


@functools.cache
def map_large_blocks() -> bool:
    """Serve host blocks of ``MAP_LARGE_BLOCKS_BYTES`` or more from mappings of their own, returned when freed
    (see [Large host blocks are mapped and unmapped]); once per process. Returns whether the setting was made."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MAP_LARGE_BLOCKS_BYTES) == 1


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


class PeakRssAnon:
    """``with PeakRssAnon() as peak: ...`` (or ``peak = PeakRssAnon().start()`` ... ``peak.stop()``); then
    ``peak.peak`` is the highest value sampled and ``peak.growth`` the peak minus the value at the start, in bytes."""

    def __init__(self, interval_s: float = 0.0005):
        self.interval_s = interval_s
        self.baseline = self.peak = 0
        self._stop = threading.Event()

    def start(self) -> Self:
        self.baseline = self.peak = rss_anon_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop sampling; returns the peak."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon_bytes())
        return self.peak

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline
