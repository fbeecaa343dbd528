"""Peak host memory of this process over a stretch of code (Linux ``/proc/self``), for the load benchmark.

Two figures, both as growth over the value when the stretch began:

* ``rss``: the whole resident set (anonymous, file-backed and shared pages), from the kernel's own
  high-water mark ``VmHWM`` after resetting it (``/proc/self/clear_refs``), so no peak is missed;
  where the reset is refused, from samples. A loader that maps the checkpoint shows its mapped pages here.
* ``anon``: anonymous pages only (``RssAnon``: memory the process allocated itself), sampled every
  ``interval_s`` by a thread.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

_STATUS = Path("/proc/self/status")


def read_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM`` and ``RssAnon`` of this process in bytes (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        for line in _STATUS.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    s = read_status()
    return bool(s) and s["VmHWM"] <= s["VmRSS"] + (1 << 20)


class PeakHostMemory:
    """``with PeakHostMemory() as peak: ...`` then ``peak.rss`` and ``peak.anon`` (bytes of growth) and
    ``peak.method`` (``"VmHWM"`` or ``"sampled"``)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.rss = self.anon = 0
        self.method = "sampled"
        self._stop = threading.Event()
        self._peak_rss = self._peak_anon = 0

    def _sample(self) -> None:
        s = read_status()
        if s:
            self._peak_rss = max(self._peak_rss, s["VmRSS"])
            self._peak_anon = max(self._peak_anon, s["RssAnon"])

    def _probe(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakHostMemory":
        if _reset_high_water_mark():
            self.method = "VmHWM"
        start = read_status()
        self._base_rss, self._base_anon = start.get("VmRSS", 0), start.get("RssAnon", 0)
        self._peak_rss, self._peak_anon = self._base_rss, self._base_anon
        self._thread = threading.Thread(target=self._probe, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._sample()
        self._stop.set()
        self._thread.join()
        if self.method == "VmHWM":
            self._peak_rss = max(self._peak_rss, read_status().get("VmHWM", 0))
        self.rss = self._peak_rss - self._base_rss
        self.anon = self._peak_anon - self._base_anon

