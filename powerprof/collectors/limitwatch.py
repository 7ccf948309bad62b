"""Whether each GPU's power limit and SM clock setting held through its readings: what another tool's `nvidia-smi -pl` or `-lgc`/`-rgc` leaves in the samples."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping

from .clock_reasons import (CAP_AT_LIMIT_FRACTION, REASON_APP_CLOCKS, REASON_GPU_IDLE, REASON_SETTING_ONLY,
                            clock_event_reason_names, held_by_a_setting)

# A limit reads back in whole milliwatts, set or not by us: 2 W (the controller's set tolerance,
# control/restore.py DEFAULT_TOLERANCE_W) is far above that rounding and far below any limit step.
LIMIT_TOLERANCE_W = 2.0

# Who moves a power limit under a run: the words of every message that says so.
LIMIT_CHANGERS = "nvidia-smi -pl, a DCGM policy, a power manager, powerprof tune"
# The fixes for a setting that did not hold are stated with the leave-out reasons that name them (arrival.py, the
# lowest layer: SETTING_REASONS); re-exported here for the watches' users.
from powerprof.arrival import CLOCK_FIX, LIMIT_FIX, UNVOUCHED_FIX  # noqa: E402,F401

# GPU index → (power limit W, enforced limit W) a reading should show; None in either place: not judged.
Expected = Mapping[int, tuple[float | None, float | None]]


@dataclass(frozen=True)
class LimitMove:
    """The first reading off its expected limit."""

    index: int
    what: str  # "power limit" or "enforced power limit"
    read_w: float
    expected_w: float


@dataclass(frozen=True)
class ClockMove:
    """The run of readings that showed another SM clock setting (ClockLockWatch's verdict)."""

    index: int
    why: str


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


# A locked SM clock is a ceiling: the driver runs the lock at the highest supported clock at or below the
# MHz asked for (control/levels.supported_clock_mhz; 15 MHz apart on current datacenter GPUs), so a held
# lock reads above it only by NVML's reading, which may sit a few MHz off the clock set. Two steps cover
# that with margin; a lock that is gone shows the boost clock, hundreds of MHz up.
CLOCK_LOCK_TOLERANCE_MHZ = 30.0
CLOCK_LOCK_READINGS = 2  # busy readings above the lock in a row: one odd read is not a lost lock
# Below: a locked GPU that no limiter holds sits at its lock, so 10% under it (140 MHz at 1400) with no
# limiter named is another setting. Without a lock the reference is the highest busy clock the GPU showed
# this sweep, which boost bins move by several percent on their own (voltage, temperature): 15%.
CLOCK_LOW_FRACTION_LOCKED = 0.10
CLOCK_LOW_FRACTION_BOOST = 0.15
CLOCK_LOW_READINGS = 3  # a clock is read low between kernels and as a cap settles: a run, not a read


class ClockLockWatch:
    """Whether the GPU's SM clock was where the level put it, judged from the readings taken while it measures.

    NVML reads no lock back (nvidia-ml-py 13.x has Set/ResetGpuLockedClocks and no getter;
    nvmlDeviceGetMinMaxClockOfPState is the P-state's range, not the lock), so the clock itself is the
    witness. Above: CLOCK_LOCK_READINGS busy readings in a row above the lock by more than the tolerance
    mean the lock is gone (nvidia-smi -rgc, a GPU reset) or raised (nvidia-smi -lgc). Below:
    CLOCK_LOW_READINGS busy readings in a row well under the expected clock (the lock; with no lock,
    `boost_mhz`, the highest busy clock each GPU showed so far, shared across a sweep's levels) while
    no limiter is named (clock_reasons.held_by_a_setting: no power/thermal bit, power under 90% of the
    cap) mean another tool locked it lower or set application clocks. A power cap, heat or idling
    lowering the clock name themselves and never trip it; a busy reading that is neither ends a run;
    an idle one (GpuIdle, or 0% utilisation) says nothing either way.

    find_lock (measure, which sets no clock): a lock there before the watch began, seen as busy readings
    held by a setting with the AppClocks bit (what drivers report for a lock), stands for `locked_mhz`
    above: the highest such reading is the lock, and readings above it mean another tool released
    (nvidia-smi -rgc) or raised it. `during` and `earlier` name the run in the messages."""

    def __init__(self, locked_mhz: float | None, tolerance_mhz: float = CLOCK_LOCK_TOLERANCE_MHZ,
                 readings: int = CLOCK_LOCK_READINGS, boost_mhz: dict | None = None, find_lock: bool = False,
                 during: str = "the level", earlier: str = "earlier in the sweep"):
        self.locked_mhz = None if locked_mhz is None else float(locked_mhz)
        self.tolerance_mhz = float(tolerance_mhz)
        self.readings = int(readings)
        self.boost_mhz = {} if boost_mhz is None else boost_mhz  # GPU index → highest busy clock seen
        self._high: dict[int, list[float]] = {}  # GPU index → its run of readings above the lock
        self._low: dict[int, list[tuple[float, float, float | None, int]]] = {}  # ... below: (MHz, W, limit W, reasons)
        self.find_lock = bool(find_lock) and self.locked_mhz is None
        self.found_mhz: dict[int, float] = {}  # GPU index → the lock found (find_lock)
        self.during, self.earlier = during, earlier

    @property
    def open(self) -> bool:
        """Some GPU's last busy reading was off its clock: a moved setting may have begun."""
        return any(self._high.values()) or any(self._low.values())

    def feed(self, r) -> str | None:
        """Take one GpuReading; why the clock was not the level's once a GPU's run of off readings is long enough."""
        mhz = r.sm_clock_mhz
        if mhz is None:
            return None
        idle = bool((r.clock_event_reasons or 0) & REASON_GPU_IDLE) or r.gpu_util_pct == 0
        if idle:
            return None  # between requests the GPU idles and reads low however it is set
        high = self._high.setdefault(r.index, [])
        low = self._low.setdefault(r.index, [])
        lock_mhz = self.locked_mhz if self.locked_mhz is not None else self.found_mhz.get(r.index)
        if lock_mhz is not None and mhz > lock_mhz + self.tolerance_mhz:
            high.append(mhz)
            low.clear()
        elif self._held_low(r, mhz):
            low.append((mhz, r.power_w if r.power_w is not None else r.power_avg_w,
                        r.enforced_limit_w if r.enforced_limit_w is not None else r.power_limit_w,
                        r.clock_event_reasons or 0))
            high.clear()
        else:
            high.clear()
            low.clear()
            if self.find_lock and (r.clock_event_reasons or 0) & REASON_APP_CLOCKS and held_by_a_setting(
                    r.clock_event_reasons, r.power_w if r.power_w is not None else r.power_avg_w,
                    r.enforced_limit_w if r.enforced_limit_w is not None else r.power_limit_w):
                self.found_mhz[r.index] = max(self.found_mhz.get(r.index, 0.0), mhz)  # the lock holds it there
        if self.locked_mhz is None and not high:
            self.boost_mhz[r.index] = max(self.boost_mhz.get(r.index, 0.0), mhz)
        if len(high) >= self.readings:
            held = "it was locked to" if self.locked_mhz is not None else f"a clock lock found during {self.during} held it at"
            return (f"GPU {r.index}'s SM clock read {max(high):g} MHz ({len(high)} readings in a row) during {self.during}, "
                    f"above the {lock_mhz:g} MHz {held}: another tool released or changed the lock "
                    "(nvidia-smi -rgc or -lgc) or the GPU was reset; the windows measured since are left out of every figure")
        if len(low) >= CLOCK_LOW_READINGS:
            return self._low_reason(r.index, low)
        return None

    def _expected_mhz(self, index: int) -> float | None:
        return self.locked_mhz if self.locked_mhz is not None else self.boost_mhz.get(index)

    def _held_low(self, r, mhz: float) -> bool:
        expected = self._expected_mhz(r.index)
        if expected is None:
            return False
        frac = CLOCK_LOW_FRACTION_LOCKED if self.locked_mhz is not None else CLOCK_LOW_FRACTION_BOOST
        if mhz >= expected - max(self.tolerance_mhz, frac * expected):
            return False
        power_w = r.power_w if r.power_w is not None else r.power_avg_w
        limit_w = r.enforced_limit_w if r.enforced_limit_w is not None else r.power_limit_w
        return held_by_a_setting(r.clock_event_reasons, power_w, limit_w)

    def _low_reason(self, index: int, low) -> str:
        expected = self._expected_mhz(index)
        mhz = max(m for m, *_ in low)
        power_w = max(p for _, p, _, _ in low)
        limits = [lim for *_, lim, _ in low if lim is not None]
        bits = 0
        for *_, b in low:
            bits |= b
        names = ", ".join(clock_event_reason_names(bits)) or "none"
        at = f"at {power_w:.0f} W" + (f" of its {max(limits):g} W limit" if limits else "")
        against = (f"the {expected:g} MHz it was locked to" if self.locked_mhz is not None
                   else f"the {expected:g} MHz it ran at busy {self.earlier}")
        return (f"GPU {index}'s SM clock read {mhz:g} MHz ({len(low)} busy readings in a row) during {self.during}, well "
                f"below {against}, {at} with no power or thermal limiter named (clock event reasons: {names}): "
                "another tool locked the clock lower (nvidia-smi -lgc) or set application clocks (nvidia-smi -ac), so "
                f"{self.during} measured that clock, not its own setting; the windows measured since are left out of every figure")


class ClockLockSigns:
    """Each GPU's SM clock lock as its readings show it, for a process that sets none (the daemon): the MHz a lock
    holds it at, or None (no lock seen, or released).

    The signs ClockLockWatch(find_lock=True) reads: CLOCK_LOCK_READINGS busy readings in a row held by a setting with
    the AppClocks bit (no limiter named, power under 98% of the cap, CAP_AT_LIMIT_FRACTION, where the watch asks 90%:
    clock_reasons.held_by_a_setting) at a clock off the lock held (by more than the tolerance) are a lock there; as
    many busy readings in a row not so held above the lock by more than the tolerance are its release (the boost clock,
    hundreds of MHz up), whatever limiter they name: a power cap or heat only lowers the clock, so a clock above the
    lock proves it gone. A busy GPU at its top
    clock with no lock shows no AppClocks bit, and a power cap or heat names itself: neither ever starts one. Idle
    readings (GpuIdle, 0% utilisation) say nothing (an idle card sits at its idle clock, and a real one lingers at a
    high clock a while after work): a lock is seen only at the next busy readings. A lock at the top clock shows no
    sign (nothing holds the clock below where it would run).

    A run of readings off the state left open keeps `told` from "same" only on a GPU in `matters` (`feed`: the GPUs
    the idle power is of), and only for `expire_s` after its latest reading: one GPU's lone busy reading under another
    tenant's lock, that GPU then idle for good, held every GPU's idle runs for ever (37 of 50 rows flagged)."""

    def __init__(self, tolerance_mhz: float = CLOCK_LOCK_TOLERANCE_MHZ, readings: int = CLOCK_LOCK_READINGS,
                 expire_s: float | None = None):
        self.tolerance_mhz = float(tolerance_mhz)
        self.readings = int(readings)
        self.expire_ns = None if expire_s is None else int(expire_s * 1e9)
        self.locked_mhz: dict[int, float] = {}  # GPU index → the lock's clock (absent: none)
        self._run: dict[int, tuple[bool, list[float]]] = {}  # GPU index → (held, its readings' MHz) off the state
        self._run_ns: dict[int, int | None] = {}  # GPU index → when its open run's latest reading was fed (`feed`)
        self._t_ns: int | None = None  # the sample being fed's
        self._signed = False  # some reading carried an SM clock and its reasons: a lock can be seen at all
        # What the last feed told of the locks: "same" (a busy reading showed the state held, no change under way),
        # "changed" (a GPU's lock was seen set, moved or released), "blind" (no reading ever carried the signs: no lock
        # can be seen) or None (nothing: no busy reading, or a change's run of readings still open).
        self.told: str | None = None

    @property
    def seeing(self) -> bool:
        """Whether some reading carried an SM clock and its reasons: a lock can be seen at all."""
        return self._signed

    def feed(self, readings, t_ns: int | None = None, matters=None) -> tuple:
        """Take one sample's GpuReadings, read at `t_ns`; each GPU's lock MHz (None: none) after them, in the readings'
        order. `matters`: the GPU indexes whose open run keeps `told` from "same" (None: every GPU's)."""
        before = dict(self.locked_mhz)
        self._t_ns = t_ns
        said = [self._feed_one(r) for r in readings]
        if t_ns is not None and self.expire_ns is not None:
            for i in [i for i, last in self._run_ns.items() if last is not None and t_ns - last >= self.expire_ns]:
                self._run.pop(i, None)  # no busy reading closed it for so long: the state as last told
                self._run_ns.pop(i, None)
        if not self._signed:
            self.told = "blind"
        elif self.locked_mhz != before:
            self.told = "changed"
        else:
            vetoes = [i for i in self._run if matters is None or i in matters]
            self.told = "same" if any(said) and not vetoes else None
        return tuple(self.locked_mhz.get(getattr(r, "index", None)) for r in readings)

    def _feed_one(self, r) -> bool:
        """Whether the reading was a busy one that said something of its GPU's lock."""
        mhz, reasons = getattr(r, "sm_clock_mhz", None), getattr(r, "clock_event_reasons", None)
        if mhz is None or reasons is None:
            return False
        self._signed = True
        if reasons & REASON_GPU_IDLE or getattr(r, "gpu_util_pct", None) == 0:
            return False
        lock = self.locked_mhz.get(r.index)
        power_w = r.power_w if r.power_w is not None else r.power_avg_w
        limit_w = r.enforced_limit_w if r.enforced_limit_w is not None else r.power_limit_w
        # The AppClocks bit and no limiter's, under CAP_AT_LIMIT_FRACTION of the cap (not held_by_a_setting's 90%: a
        # lock whose busy draw sat at 90-98% of the cap was never seen, the 93% of a 250 W cap of an H200 at 1400 MHz).
        held = (bool(reasons & REASON_APP_CLOCKS) and not reasons & ~REASON_SETTING_ONLY and power_w is not None
                and (limit_w is None or power_w < CAP_AT_LIMIT_FRACTION * limit_w))
        if held and (lock is None or abs(mhz - lock) > self.tolerance_mhz):
            pass  # a lock where none was, or another one
        elif not held and lock is not None and mhz > lock + self.tolerance_mhz:
            pass  # above the lock: released, whatever limiter is named (a cap or heat only lowers the clock)
        else:
            self._run.pop(r.index, None)
            self._run_ns.pop(r.index, None)
            return True
        was, run = self._run.get(r.index, (held, []))
        run = run if was == held else []
        run.append(mhz)
        self._run[r.index] = (held, run)
        self._run_ns[r.index] = self._t_ns
        if len(run) >= self.readings:
            if held:
                self.locked_mhz[r.index] = max(run)
            else:
                self.locked_mhz.pop(r.index, None)
            self._run.pop(r.index, None)
            self._run_ns.pop(r.index, None)
        return True


class LimitWatch:
    """A sampler subscriber (`sampler.subscribe(watch)`): every GPU reading from now must show `expected`,
    and, given `clocks`, the SM clock setting that watch judges (a ClockMove once its run of off readings is
    long enough; while a run is open no reading vouches for a window, so the run's own windows are not kept).

    `moved` is the first reading that did not (and `t_moved_ns` when it was read); `t_held_ns` the last reading
    before it that still showed every limit as expected: a window that ended by then ran at those limits
    (an edge read comes a few ms after its edge, so a window's own end read counts). Samples reach a
    subscriber in the order they were read, from the sampler's thread."""

    def __init__(self, expected: Expected, tol_w: float = LIMIT_TOLERANCE_W, clocks: ClockLockWatch | None = None):
        self.expected = dict(expected)
        self.tol_w = float(tol_w)
        self.clocks = clocks
        self._lock = threading.Lock()
        self.moved: LimitMove | ClockMove | None = None
        self.t_moved_ns: int | None = None
        self.t_held_ns: int | None = None

    def __call__(self, sample) -> None:
        if getattr(sample, "source", None) != "nvml" or not sample.data:
            return
        with self._lock:
            if self.moved is not None:
                return
            m = limit_moved(sample.data, self.expected, self.tol_w)
            if m is None and self.clocks is not None:
                for r in sample.data:
                    why = self.clocks.feed(r)
                    if why:
                        m = ClockMove(r.index, why)
                        break
            if m is None:
                if self.clocks is None or not self.clocks.open:
                    self.t_held_ns = max(self.t_held_ns or sample.t_mono_ns, sample.t_mono_ns)
            else:
                self.moved, self.t_moved_ns = m, sample.t_mono_ns

    def held_through(self, t_ns: int | None) -> bool:
        """Whether a reading at or after `t_ns` still showed every limit as expected."""
        with self._lock:
            return t_ns is not None and self.t_held_ns is not None and t_ns <= self.t_held_ns
