"""Peak anonymous resident memory of this process over a block of code, sampled from ``/proc/self/status``.

``RssAnon`` counts heap and anonymous mappings only, not file-backed pages (a memory-mapped checkpoint being read),
which ``ru_maxrss`` and ``VmHWM`` include; so it measures what a rank holds, not what the page cache lends it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self


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
