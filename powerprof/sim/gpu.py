"""Physics of one simulated GPU: DVFS under a power cap, decode speed vs SM clock, true energy."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
from pynvml import nvmlClocksEventReasonApplicationsClocksSetting as REASON_APP_CLOCKS
from pynvml import nvmlClocksEventReasonGpuIdle as REASON_GPU_IDLE
from pynvml import nvmlClocksEventReasonHwThermalSlowdown as REASON_HW_THERMAL
from pynvml import nvmlClocksEventReasonSwPowerCap as REASON_SW_POWER_CAP

from .profiles import GpuProfile


@dataclass(frozen=True)
class Phase:
    """What the GPU is running. compute_share: share of a step's time at f_max that scales with SM clock."""

    kind: str  # "idle" | "prefill" | "decode"
    compute_share: float = 0.0


IDLE = Phase("idle", 0.0)
# The SM activity an idle card's clock tree keeps (of dyn_power_w's full activity): a real H200 idled at 78 W at its
# 345 MHz idle clock and at 120.6 W with a model loaded holding 1980 MHz (docs/hardware.md), 42.6 W =
# 300 W × a × (1 − (345/1980)(0.67/1.0)²) for its profile, a = 0.154. The rest of the idle draw does not follow the clock.
IDLE_SM_ACTIVITY = 0.154


def step_time_factor(compute_share: float, f_mhz: np.ndarray | float, f_max_mhz: float):
    """Time of one step relative to the same step at f_max: memory part fixed, compute part ~ 1/f."""
    return (1.0 - compute_share) + compute_share * (f_max_mhz / f_mhz)


class SimGpu:
    """One card. Power is piecewise constant between state changes, so the energy counter is exact.

    Thread-safe: the simulated server changes the phase while collectors read.
    """

    def __init__(
        self,
        profile: GpuProfile,
        index: int,
        uuid: str,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        limit_w: float | None = None,
        locked_clocks_mhz: tuple[int, int] | None = None,
        record_history: bool = False,
    ):
        self.profile = profile
        self.index = index
        self.uuid = uuid
        self._clock_ns = clock_ns
        self._lock = threading.RLock()
        p = profile
        self._f = np.array(p.sm_clocks_mhz, dtype=float)  # what NVML lists as supported: a lock runs on one of them
        v = p.volt_min_v + (p.volt_max_v - p.volt_min_v) * (self._f - p.sm_clock_min_mhz) / (
            p.sm_clock_max_mhz - p.sm_clock_min_mhz
        )
        # Dynamic power ~ C V^2 f, normalised to the profile's figure at f_max.
        self._dyn_scale = (v / p.volt_max_v) ** 2 * (self._f / p.sm_clock_max_mhz)
        self._limit_w = float(limit_w if limit_w is not None else p.default_limit_w)
        self._locked = locked_clocks_mhz
        self._phase = IDLE
        self._thermal_throttle = False
        # Another process's kernels on this GPU (sim/bystander.py): watts it adds, share of the time it takes.
        self._bystander_w = 0.0
        self._bystander_share = 0.0
        self._bystander_mem = 0.0  # share of the memory bandwidth it streams (copy engines: no SM time needed)
        now = clock_ns()
        self._t_last_ns = now
        self._energy_j = 0.0
        self._temp_c = p.ambient_c + p.thermal_resistance_c_per_w * p.idle_power_w
        # (t_start_ns, power_w, energy_at_start_j): history for the sensors that look back in time.
        self._segments: deque[tuple[int, float, float]] = deque()
        self._state: tuple[float, float, int] = (0.0, 0.0, 0)
        # Ground truth for accuracy tests: every segment since start (unbounded, so opt-in).
        self._history: list[tuple[int, float, float]] | None = [] if record_history else None
        self._phase_listeners: list[Callable[["SimGpu", Phase, int], None]] = []
        self._recompute(now)

    # --- the model -------------------------------------------------------------------------

    def _power_curve(self, phase: Phase) -> np.ndarray:
        """Board power at each DVFS clock for a phase (beside a neighbour streaming `_bystander_mem` of the memory
        bandwidth: the step's memory part stretches by 1/(1 − m), the HBM is busy all that time, and the
        neighbour's share of it through the compute part too)."""
        p = self.profile
        c = phase.compute_share
        m = self._bystander_mem
        mem_part = (1.0 - c) / (1.0 - m)
        s = mem_part + c * p.sm_clock_max_mhz / self._f
        a_sm = (c * p.sm_clock_max_mhz / self._f) / s
        a_mem = mem_part / s
        hbm = a_mem + m * (1.0 - a_mem)
        sm_act = p.sm_base_activity + (1.0 - p.sm_base_activity) * a_sm
        return p.static_power_w + p.mem_power_w * hbm + p.dyn_power_w * self._dyn_scale * sm_act

    def _choose(self, phase: Phase) -> tuple[float, float, int]:
        """DVFS: the highest clock whose power fits under the enforced limit. Returns (f, P, reasons)."""
        p = self.profile
        extra = self._bystander_w
        if phase.kind == "idle":
            # A neighbour's memory traffic alone (copy engines: no kernels) keeps the SM clock idle.
            mem_w = p.mem_power_w * self._bystander_mem
            held_mhz, idle_w = self._idle_held()
            if extra <= 0:
                return held_mhz, idle_w + mem_w, REASON_GPU_IDLE
            # The server idles, another process's kernels run: the clock they get, the idle power plus theirs.
            f, _, reasons = self._choose_busy(Phase("decode", 0.5), extra)
            return f, idle_w + extra + mem_w, reasons
        return self._choose_busy(phase, extra)

    def _volt_v(self, f_mhz: float) -> float:
        """The voltage clock `f_mhz` runs at: linear between the profile's at its lowest and highest DVFS clock (an
        idle clock below the lowest at the lowest's)."""
        p = self.profile
        return max(p.volt_min_v, p.volt_min_v + (p.volt_max_v - p.volt_min_v) * (f_mhz - p.sm_clock_min_mhz) / (
            p.sm_clock_max_mhz - p.sm_clock_min_mhz))

    def _idle_held(self) -> tuple[float, float]:
        """(SM clock MHz, W) of the idle card: its idle clock and power, or, under a clock lock that holds the idle clock
        elsewhere (a floor above it: the lock's lowest clock; a ceiling below it: the ceiling's step), that clock and
        the idle power with only its clock-dependent part moved: dyn_power_w × IDLE_SM_ACTIVITY × (f/f_max)(V/V_max)²
        at the held clock less the same at the idle clock (a lock below the idle clock lowers it, above raises it).
        Scaling the whole idle draw by V² gave the H200 locked at 1400 MHz 135 W and at 1980 MHz 174 W, above the real
        H200's 120.6 W idle at 1980 MHz (docs/hardware.md); now 99.7 W and 120.6 W. A lock moves a real card's idle
        draw both ways: RTX 3090s locked to 210-1950 MHz idled at 15-30 W for 8 W unlocked (ilya-zlobintsev/LACT#908),
        a V100 locked to its lowest clock at 33 W for 45 W (sasha0552/nvidia-pstated#6)."""
        p = self.profile
        idle_mhz = float(p.sm_clock_idle_mhz)
        if self._locked is None:
            return idle_mhz, float(p.idle_power_w)
        lo_mhz, hi_mhz = self._locked
        allowed = (self._f <= hi_mhz) & (self._f >= lo_mhz)
        below = self._f[self._f <= hi_mhz]
        if (lo_mhz <= max(idle_mhz, float(self._f[0])) and idle_mhz <= hi_mhz) or not below.size:  # it idles as unlocked
            return idle_mhz, float(p.idle_power_w)
        held_mhz = float(below[-1] if idle_mhz > hi_mhz or not allowed.any() else self._f[allowed][0])
        return held_mhz, float(p.idle_power_w) + p.dyn_power_w * IDLE_SM_ACTIVITY * (
            self._clock_scale(held_mhz) - self._clock_scale(idle_mhz))

    def _clock_scale(self, f_mhz: float) -> float:
        """(f/f_max)(V/V_max)²: what SM dynamic power at clock `f_mhz` is, relative to f_max's, at the same activity."""
        p = self.profile
        return f_mhz / p.sm_clock_max_mhz * (self._volt_v(f_mhz) / p.volt_max_v) ** 2

    def _choose_busy(self, phase: Phase, extra: float) -> tuple[float, float, int]:
        p = self.profile
        power = self._power_curve(phase) + extra
        hi_mhz = p.sm_clock_max_mhz
        lo_mhz = p.sm_clock_min_mhz
        if self._locked is not None:
            lo_mhz, hi_mhz = self._locked
        if self._thermal_throttle:
            hi_mhz = min(hi_mhz, int(p.sm_clock_min_mhz + 0.6 * (p.sm_clock_max_mhz - p.sm_clock_min_mhz)))
        allowed = (self._f <= hi_mhz) & (self._f >= min(lo_mhz, hi_mhz))
        if not allowed.any():
            allowed = self._f <= max(hi_mhz, self._f[0])
        fits = allowed & (power <= self._limit_w)
        reasons = REASON_HW_THERMAL if self._thermal_throttle else 0
        if fits.any():
            i = int(np.flatnonzero(fits)[-1])
            top = int(np.flatnonzero(allowed)[-1])
            if i < top:
                reasons |= REASON_SW_POWER_CAP
            elif self._locked is not None and self._f[top] < p.sm_clock_max_mhz and not self._thermal_throttle:
                reasons |= REASON_APP_CLOCKS  # the lock holds it (UserDefinedClocks, as drivers report a lock)
        else:
            # Even the lowest clock draws more than the cap: the card sits at its floor (and over it).
            i = int(np.flatnonzero(allowed)[0])
            reasons |= REASON_SW_POWER_CAP
        return float(self._f[i]), float(power[i]), reasons

    def _advance(self, now_ns: int) -> None:
        dt = (now_ns - self._t_last_ns) / 1e9
        if dt <= 0:
            return
        power = self._state[1]
        self._energy_j += power * dt
        p = self.profile
        target = p.ambient_c + p.thermal_resistance_c_per_w * power
        self._temp_c = target + (self._temp_c - target) * math.exp(-dt / p.thermal_time_constant_s)
        self._t_last_ns = now_ns

    def _recompute(self, now_ns: int) -> None:
        self._advance(now_ns)
        self._state = self._choose(self._phase)
        self._segments.append((now_ns, self._state[1], self._energy_j))
        if self._history is not None:
            self._history.append(self._segments[-1])
        horizon = now_ns - int(max(self.profile.power_avg_window_s, 1.0) * 2e9)
        while len(self._segments) > 1 and self._segments[1][0] <= horizon:
            self._segments.popleft()

    # --- what the simulated server drives ---------------------------------------------------

    def set_phase(self, phase: Phase, t_ns: int | None = None) -> None:
        """Run `phase` from now (or from `t_ns`, a moment another process reported, never before the
        last instant already accounted for)."""
        with self._lock:
            if phase == self._phase:
                return
            self._phase = phase
            t = self._clock_ns() if t_ns is None else max(int(t_ns), self._t_last_ns)
            self._recompute(t)
        for cb in self._phase_listeners:
            cb(self, phase, t)

    def on_phase(self, callback: Callable[["SimGpu", Phase, int], None]) -> None:
        """Call `callback(gpu, phase, t_ns)` after every phase change (to share it with other processes)."""
        self._phase_listeners.append(callback)

    def speed_factor(self, compute_share: float | None = None) -> float:
        """Throughput now relative to the same work at f_max (1.0 = no slowdown)."""
        with self._lock:
            c = self._phase.compute_share if compute_share is None else compute_share
            f = self._state[0] if self._phase.kind != "idle" else self._choose(Phase("decode", c))[0]
            # Another process's kernels time-slice the GPU with the server's; its memory traffic leaves the
            # server's memory-bound part (1 − c) only the rest of the bandwidth.
            m = self._bystander_mem
            t = (1.0 - c) / (1.0 - m) + c * self.profile.sm_clock_max_mhz / f
            return (1.0 - self._bystander_share) / float(t)

    def set_bystander(self, power_w: float, share: float, mem_share: float = 0.0) -> None:
        """Another process works on this GPU from now: it draws `power_w` more (its kernels, its video engines),
        takes `share` of the GPU's time from the server, and streams `mem_share` of the memory bandwidth (its
        watts are the memory's, from the model: `_power_curve`) (0, 0, 0: it stopped)."""
        with self._lock:
            self._bystander_w = max(0.0, float(power_w))
            self._bystander_share = min(max(0.0, float(share)), 0.9)
            self._bystander_mem = min(max(0.0, float(mem_share)), 0.9)
            self._recompute(self._clock_ns())

    @property
    def bystander_share(self) -> float:
        return self._bystander_share

    def set_thermal_throttle(self, on: bool) -> None:
        with self._lock:
            self._thermal_throttle = on
            self._recompute(self._clock_ns())

    # --- settings (the NVML facade persists them) -------------------------------------------

    @property
    def limit_w(self) -> float:
        return self._limit_w

    def set_limit_w(self, watts: float) -> None:
        with self._lock:
            self._limit_w = float(watts)
            self._recompute(self._clock_ns())

    @property
    def locked_clocks_mhz(self) -> tuple[int, int] | None:
        return self._locked

    def set_locked_clocks(self, lo_hi: tuple[int, int] | None) -> None:
        with self._lock:
            self._locked = None if lo_hi is None else (int(lo_hi[0]), int(lo_hi[1]))
            self._recompute(self._clock_ns())

    # --- readings ----------------------------------------------------------------------------

    def read(self) -> dict:
        """Everything at one instant: true power and energy plus what the sensors would show."""
        with self._lock:
            now = self._clock_ns()
            self._advance(now)
            f, power, reasons = self._state
            return {
                "t_ns": now,
                "power_w": power,
                "energy_j": self._energy_j,
                "sm_clock_mhz": f,
                "mem_clock_mhz": float(self.profile.mem_clock_mhz),
                "temperature_c": self._temp_c,
                "reasons": reasons,
                "phase": self._phase,
            }

    def true_energy_j(self) -> float:
        with self._lock:
            self._advance(self._clock_ns())
            return self._energy_j

    def true_energy_at_j(self, t_ns: int) -> float:
        """True cumulative energy at a past instant (needs record_history=True)."""
        if self._history is None:
            raise RuntimeError("SimGpu was created without record_history=True")
        with self._lock:
            self._advance(self._clock_ns())
            for t0, pw, e0 in reversed(self._history):
                if t0 <= t_ns:
                    return e0 + pw * (t_ns - t0) / 1e9
            return self._history[0][2]

    def recent_energy_at_j(self, t_ns: int) -> float:
        """True cumulative energy at an instant of the last two seconds (the sensors' history)."""
        with self._lock:
            self._advance(self._clock_ns())
            return self._energy_at(t_ns)

    def true_power_w(self) -> float:
        return self._state[1]

    def counter_energy_j(self) -> float:
        """The driver's counter: the true energy as of its last refresh."""
        with self._lock:
            now = self._clock_ns()
            self._advance(now)
            upd = self.profile.energy_counter_update_s
            if upd <= 0:
                return self._energy_j
            t_ref = (now // int(upd * 1e9)) * int(upd * 1e9)
            return self._energy_at(t_ref)

    def instant_power_w(self) -> float:
        """The driver's instant power: the true power as of its last refresh (profile.instant_power_update_s)."""
        with self._lock:
            now = self._clock_ns()
            upd = int(self.profile.instant_power_update_s * 1e9)
            if upd <= 0:
                return self._state[1]
            t_ref = (now // upd) * upd
            for t0, pw, _ in reversed(self._segments):
                if t0 <= t_ref:
                    return pw
            return self._segments[0][1]

    def _energy_at(self, t_ns: int) -> float:
        for t0, pw, e0 in reversed(self._segments):
            if t0 <= t_ns:
                return e0 + pw * (t_ns - t0) / 1e9
        return self._segments[0][2]

    def average_power_w(self) -> float:
        """Trailing average over the profile's window (what nvmlDeviceGetPowerUsage reports)."""
        with self._lock:
            now = self._clock_ns()
            window_ns = int(self.profile.power_avg_window_s * 1e9)
            if window_ns <= 0:
                return self._state[1]
            start = now - window_ns
            total = 0.0
            segs = list(self._segments)
            for k, (t0, pw, _) in enumerate(segs):
                t1 = segs[k + 1][0] if k + 1 < len(segs) else now
                lo, hi = max(t0, start), min(t1, now)
                if hi > lo:
                    total += pw * (hi - lo)
            covered = now - max(start, segs[0][0]) if segs else 0
            return total / covered if covered > 0 else self._state[1]

    def utilization(self) -> tuple[int, int]:
        """(gpu %, memory %) as NVML reports them: share of time a kernel / memory traffic ran."""
        phase = self._phase
        m = self._bystander_mem
        if phase.kind == "idle":
            return int(round(100 * self._bystander_share)) if self._bystander_w > 0 else 0, int(round(100 * m))
        c = phase.compute_share
        mem_part = (1 - c) / (1 - m)
        a_mem = mem_part / (mem_part + c * self.profile.sm_clock_max_mhz / self._state[0])
        return 100, int(round(100 * (a_mem + m * (1 - a_mem))))
