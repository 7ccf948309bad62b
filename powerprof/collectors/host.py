"""Host collector: CPU utilisation and frequency and memory in use, through an injected psutil."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostReading:
    """The host at one read. None means psutil could not tell, never zero."""

    cpu_util_pct: float | None  # all CPUs, since this collector's previous read
    cpu_freq_mhz: float | None  # current frequency averaged over CPUs
    mem_used_bytes: int | None
    mem_total_bytes: int | None


def _busy_total(t) -> tuple[float, float]:
    # As psutil computes it: guest time is already inside user/nice on Linux, and iowait is idle.
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


class HostCollector:
    """`HostCollector(ps=psutil)`; `source = "host"`.

    CPU utilisation comes from our own cpu_times deltas rather than psutil.cpu_percent(), whose
    state is module-global and would be shared with (and reset by) any other caller.
    """

    source = "host"

    def __init__(self, ps=None):
        if ps is None:
            import psutil as ps
        self.ps = ps
        self._lock = threading.Lock()
        self._prev = self._times()

    def _times(self):
        try:
            return _busy_total(self.ps.cpu_times())
        except Exception:
            return None

    def read(self) -> HostReading:
        with self._lock:
            now = self._times()
            util = None
            if now is not None and self._prev is not None and now[1] > self._prev[1]:
                util = 100.0 * max(0.0, now[0] - self._prev[0]) / (now[1] - self._prev[1])
            if now is not None:
                self._prev = now
        freq = None
        try:
            f = self.ps.cpu_freq()
            if f is not None and f.current and f.current > 0:
                freq = float(f.current)
        except Exception:  # absent in many VMs and containers
            pass
        used = total = None
        try:
            m = self.ps.virtual_memory()
            used, total = int(m.total - m.available), int(m.total)
        except Exception:
            pass
        return HostReading(util, freq, used, total)
