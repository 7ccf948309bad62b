"""Whether each GPU's power limit held through its readings: what another tool's `nvidia-smi -pl` leaves in the samples."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

# A limit reads back in whole milliwatts, set or not by us: 2 W (the controller's set tolerance,
# control/restore.py DEFAULT_TOLERANCE_W) is far above that rounding and far below any limit step.
LIMIT_TOLERANCE_W = 2.0

# Who moves a power limit under a run: the words of every message that says so.
LIMIT_CHANGERS = "nvidia-smi -pl, a DCGM policy, a power manager, powerprof tune"
LIMIT_FIX = ("stop whatever else sets GPU power limits meanwhile (nvidia-smi -pl in a script, DCGM power policies, "
             "a cluster power manager, `powerprof tune` on this GPU) and rerun")

# GPU index → (power limit W, enforced limit W) a reading should show; None in either place: not judged.
Expected = Mapping[int, tuple[float | None, float | None]]


@dataclass(frozen=True)
class LimitMove:
    """The first reading off its expected limit."""

    index: int
    what: str  # "power limit" or "enforced power limit"
    read_w: float
    expected_w: float


def limits_read(readings: Iterable) -> dict[int, tuple[float | None, float | None]]:
    """Each GPU's (power limit, enforced limit) in one read of the GPU collector: what later readings must match."""
    return {r.index: (r.power_limit_w, r.enforced_limit_w) for r in readings}


def limit_moved(readings: Iterable, expected: Expected, tol_w: float = LIMIT_TOLERANCE_W) -> LimitMove | None:
    """The first of `readings` (GpuReadings) whose power limit or enforced limit is off `expected` by more than
    `tol_w`, or None. A GPU or a value not in `expected`, or a reading without it, is not judged."""
    for r in readings:
        want = expected.get(r.index)
        if want is None:
            continue
        for what, w, e in (("power limit", r.power_limit_w, want[0]), ("enforced power limit", r.enforced_limit_w, want[1])):
            if w is not None and e is not None and abs(w - e) > tol_w:
                return LimitMove(r.index, what, float(w), float(e))
    return None


class LimitWatch:
    """A sampler subscriber (`sampler.subscribe(watch)`): every GPU reading from now must show `expected`.

    `moved` is the first reading that did not (and `t_moved_ns` when it was read); `t_held_ns` the last reading
    before it that still showed every limit as expected: a window that ended by then ran at those limits
    (an edge read comes a few ms after its edge, so a window's own end read counts). Samples reach a
    subscriber in the order they were read, from the sampler's thread."""

    def __init__(self, expected: Expected, tol_w: float = LIMIT_TOLERANCE_W):
        self.expected = dict(expected)
        self.tol_w = float(tol_w)
        self._lock = threading.Lock()
        self.moved: LimitMove | None = None
        self.t_moved_ns: int | None = None
        self.t_held_ns: int | None = None

    def __call__(self, sample) -> None:
        if getattr(sample, "source", None) != "nvml" or not sample.data:
            return
        with self._lock:
            if self.moved is not None:
                return
            m = limit_moved(sample.data, self.expected, self.tol_w)
            if m is None:
                self.t_held_ns = max(self.t_held_ns or sample.t_mono_ns, sample.t_mono_ns)
            else:
                self.moved, self.t_moved_ns = m, sample.t_mono_ns

    def held_through(self, t_ns: int | None) -> bool:
        """Whether a reading at or after `t_ns` still showed every limit as expected."""
        with self._lock:
            return t_ns is not None and self.t_held_ns is not None and t_ns <= self.t_held_ns
