"""The energy window API: GPU and CPU energy over any interval, read at its edges.

    with Profiler(nvml, gpus=[0]) as prof:
        with prof.window("decode") as w:
            ...
        w.result.gpu_energy_total_j

The sweep, `measure` and user code all go through this one mechanism. The sampler's periodic
ticks and the on-demand samples taken at every edge (`mark`) feed one timeline of cumulative
energy per device; a window's energy is the counter interpolated at its two edges, so it does
not depend on the tick rate. Only where a GPU has no energy counter is power integrated, and the
result says so.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from powerprof.collectors.cputime import CpuTime
from powerprof.collectors.nvml import NvmlCollector
from powerprof.collectors.rapl import cpu_energy_j
from powerprof.collectors.sampler import Clock, Sample, Sampler
from powerprof.energy import (counter_energy_j, counter_refresh_grid, counter_value_instants_ns, counter_window_energy_j,
                              edge_read_delay_s, instant_power_energy_j, trailing_average_energy_j)

# Below these window lengths a figure is reported but flagged low-confidence. From
# bench/window_accuracy.py (docs/benchmarks.md, "Energy windows"): the counter's p95 error is under
# 1% from ~10 s at the 100 ms refresh a real H200 showed (docs/hardware.md; ~3 s would do at 20 ms,
# but a card's refresh is not known in advance); the shifted 1 s average needs ~30 s; instant power
# sampled at 1 Hz misses the load's changes between samples and is never better than a few percent.
EDGE_STOP_S = 5.0  # longest wait for the edge thread's reads, as the sampler waits for its own
# A power-integrated figure whose readings are further apart than this (ticks missed on a loaded
# machine) interpolated blind over the gap: flagged low-confidence whatever the window's length. Two
# 1 s averages: one tick missed at 1 Hz. The counter integrates in the driver: gaps do not matter there.
MAX_POWER_GAP_S = 2.0
# A decode window starts and ends at power steps (prefill -> decode, decode -> idle), and its edge reads land
# after them: by the counter read's own cost (~3 ms on an H200) and the thread's wake-up, while the value is
# up to one refresh old. Each edge therefore moves a few ms of the step's energy across it: a fixed number of
# joules per window, which pooling many windows does not average out. Measured on the simulated H200 (100 ms
# refresh, 3 ms reads; docs/benchmarks.md "Energy windows at power steps"): pooled J/token -2.2% at 0.31 s
# windows, -1.0% at 0.63 s, -0.9% at 1.06 s, -0.4% at 2.1 s. Below this a counter figure is flagged.
EDGE_BIAS_WINDOW_S = 1.0
# The same for a figure integrated from instant power (no counter): its edges are exact only where a reading shows
# the power at the read. A real card refreshes it every ~100 ms (an H200's field 186, docs/hardware.md), so the read
# just after a window's first token can still show the power before it (prefill, or idle). Measured on the simulated
# A100 without a counter, instant power lagging by up to 100 ms (bench/window_accuracy.py --steps --no-counter
# --instant-update-s 0.1; docs/benchmarks.md): pooled J/token -9.9% at 0.3 s windows, -3.7% at 1 s, -1.2% at 3 s,
# -0.65% at 5 s, -0.35% at 10 s (250 W; less at 400 W). Below this a level's instant-power figure is flagged.
POWER_EDGE_BIAS_WINDOW_S = 5.0
# ...where such windows hold more than this share of the figure's decode tokens. On a GPU with a counter, a window
# falls back to power only where the counter broke over it (a reload, a dropped jump): at the worst bias measured
# (-10%, 0.3 s) a share of 5% moves the pooled figure by 0.5%, the error the flag stands for; under it, it cannot.
POWER_EDGE_BIAS_SHARE = 0.05
# An edge whose first read came later than this after it: the start's energy is placed from that read with the
# power after it (energy.counter_window_energy_j), which assumes the power held over the delay, and the end's
# straight line charges the delay the window's power. Loaded 2-core hosts measured up to 66 ms (docs/benchmarks.md,
# "Energy windows at power steps, on a loaded host"); past 100 ms the next event (another request's prefill, a batch
# change) comes into the stretch, so the window is flagged low-confidence and the run's notes say how many.
EDGE_READ_LATE_S = 0.1
# Where no refresh grid places the end edge, it keeps the straight line from the read before it to the read after
# it, which charges the end read's delay d the mean of decode and idle power: the window reads low by up to
# (decode - idle power) x d, i.e. by up to d / its length (seed-16g, 3 s windows, end read 60 ms late: -1.16% pooled
# J/token; 20 ms: -0.23%; docs/benchmarks.md). No sound correction without the refresh period was found (the mirror
# and a forward extrapolation from the read before the end both over-correct on some card), so windows whose end
# read delay is over this share of their length (half the sweep's default 2% CI half-width) are counted and said in
# the run's notes (Profiler.edge_notes). Windows under LOW_CONFIDENCE_S["counter"] are flagged low_confidence anyway,
# and at 10 s this share is EDGE_READ_LATE_S: the per-window flag already covers them; the note is what is new.
END_EDGE_BIAS_SHARE = 0.01
# The counter's refresh grid (energy.counter_refresh_grid) is estimated from a GPU's reads once it holds this many
# (a run's first few minutes of 1 Hz ticks and edge reads): from fewer, prefixes of simulated runs gave a wrong
# period or a phase off by several ms (seed-16g, H200). Until then, and wherever no grid is found, windows take the
# placement without a grid. The estimate is taken again once the reads have doubled, or GRID_READS more came, from
# the latest GRID_READS reads of the counter's current epoch (its cost, under the timeline's lock, stays bounded).
# A grid is taken only where its period's bend is under GRID_MARGIN times every other period's (energy.
# counter_refresh_grid's margin): on the simulated seed-16g (20 ms refresh) a 50 ms grid bent within 15% of the true
# one and was picked from 1037 reads of one run (windows -1.17 -> -0.40% instead of 0.00%); the H200's 100 ms grid
# bends 3-6x less than any other once ~1000 reads are in.
GRID_MIN_READS = 256
GRID_READS = 2000
# A window shorter than the counter's refresh (its grid's period; until that is known, the slowest refresh drivers use,
# 100 ms: field notes, docs/hardware.md) gets no GPU figure on a GPU with a counter: its reads hold one refresh's value
# or two, so the counter says 0 J or about a whole refresh's energy, and instant power, refreshed as seldom on a real
# H200 (field 186: every ~100 ms), mostly shows the power before the window. On the simulated H200 (both refreshed every
# 100 ms) 50 ms decode windows pooled +15.6% on instant power at their edges, +11% on the counter with its 0 J windows
# kept, -26% on the straight line between refresh-dated counter values; at a 300 W cap -6.1 / -3.9 / -32% (the sign
# follows the power before the window) (docs/benchmarks.md, "Windows shorter than the counter's refresh"). Chosen by
# length, never by what a reading said: leaving out only the windows whose counter did not move kept those it moved
# over and lifted 50 ms windows' pooled J/token from +14% to +32%. Such a window says so (method none, low_confidence)
# and `measure` names the reason and the fix (--max-tokens). A GPU without a counter keeps its power figure.
COUNTER_REFRESH_MAX_NS = 100_000_000
GRID_MARGIN = 0.5
LOW_CONFIDENCE_S = {"counter": 10.0, "avg_power_integration": 30.0, "power_integration": float("inf"), "none": float("inf")}

METHOD_COUNTER = "counter"
METHOD_POWER = "power_integration"
METHOD_AVG_POWER = "avg_power_integration"
METHOD_NONE = "none"
# Best first: the order a GPU's energy falls back through, and the rank that says which method a
# sum of windows can claim. The 1 s trailing average has seen every moment of its window, which
# beats instant readings taken once a second (bench/window_accuracy.py).
ENERGY_METHODS = (METHOD_COUNTER, METHOD_AVG_POWER, METHOD_POWER, METHOD_NONE)
# A daemon request row whose GPU energy came mostly from intervals without a counter that no request was live in for
# half their time: the rest of each was taken out at the idle power, so its figure rests on that power and on the
# power readings' timing (docs/daemon.md, A GPU without an energy counter). Said in energy_note, left out of J/token.
NO_COUNTER_SHORT_FLAG = "no-counter-short"
NO_COUNTER_SHORT_BUSY_SHARE = 0.5
# A daemon request row live before the daemon's first GPU read (the start's NVML read failed): the energy of that part
# of its run is in no interval, so its figures are low. Said in energy_note, left out of J/token as above.
BEFORE_FIRST_READ_FLAG = "before-first-read"
# Read from instant power (no counter, no average: Pascal), an interval is seen only at its two reads: a request
# between them is missed whatever its share of the interval, so any interval not live throughout is short.
NO_COUNTER_SHORT_BUSY_SHARE_INSTANT = 1.0
NO_COUNTER_SHORT_FIX = ("a GPU with an energy counter (Volta and newer), or read J/token over many such requests (a tag's "
                        "window, the intervals), not one")


def weakest_method(methods) -> str:
    """The worst of several windows' methods: what a figure built from all of them can claim."""
    return max(methods, key=ENERGY_METHODS.index, default=METHOD_NONE)


@dataclass(frozen=True)
class EnergyResult:
    t0_ns: int
    t1_ns: int
    gpu_energy_j: tuple[float | None, ...]  # per GPU, in the profiler's GPU order
    gpu_methods: tuple[str, ...]
    cpu_energy_j: float | None  # RAPL package + DRAM, all sockets
    power_gap_s: float = 0.0  # largest gap between the power readings a power-integrated figure rests on
    cpu_time: CpuTime | None = None  # whose CPU time the host spent meanwhile (None: no cputime collector)
    edge_read_delay_s: float = 0.0  # the later of the first reads after each edge, after its edge (EDGE_READ_LATE_S)
    end_edge_bias_share: float = 0.0  # without a grid, the counter's end read delay over the length (END_EDGE_BIAS_SHARE)
    under_refresh: bool = False  # a GPU's figure withheld: the window is shorter than its counter's refresh (COUNTER_REFRESH_MAX_NS)

    @property
    def duration_s(self) -> float:
        return (self.t1_ns - self.t0_ns) / 1e9

    @property
    def gpu_energy_total_j(self) -> float | None:
        vals = [e for e in self.gpu_energy_j if e is not None]
        return float(sum(vals)) if vals and len(vals) == len(self.gpu_energy_j) else None

    @property
    def method(self) -> str:
        """The weakest method used for any GPU: what the number as a whole can claim."""
        return weakest_method(self.gpu_methods)

    @property
    def avg_gpu_power_w(self) -> float | None:
        e = self.gpu_energy_total_j
        return e / self.duration_s if e is not None and self.duration_s > 0 else None

    @property
    def low_confidence(self) -> bool:
        return (self.duration_s < LOW_CONFIDENCE_S[self.method] or self.power_gap_s > MAX_POWER_GAP_S
                or self.edge_read_delay_s > EDGE_READ_LATE_S)


@dataclass
class Window:
    name: str
    t0_ns: int = 0
    t1_ns: int = 0
    result: EnergyResult | None = None


@dataclass
class _Series:
    t_ns: list = field(default_factory=list)
    y: list = field(default_factory=list)
    epoch: list = field(default_factory=list)  # of a counter: see energy.epoch_broken
    # Read on demand (a window edge: right after an event, where power steps), not by a periodic tick: see
    # energy.instant_power_energy_j.
    on_demand: list = field(default_factory=list)

    def add(self, t: int, v: float | None, epoch: int = 0, on_demand: bool = False) -> None:
        if v is None:
            return
        # On-demand and tick samples come from different threads: keep the series ordered.
        i = len(self.t_ns)
        if self.t_ns and t < self.t_ns[-1]:
            i = int(np.searchsorted(np.asarray(self.t_ns), t, side="right"))
        self.t_ns.insert(i, t)
        self.y.insert(i, v)
        self.epoch.insert(i, epoch)
        self.on_demand.insert(i, on_demand)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.t_ns, dtype=np.int64), np.asarray(self.y, dtype=float)


class EnergyTimeline:
    """Cumulative energy and power per device against the monotonic clock, fed by samples."""

    def __init__(self, n_gpus: int, avg_windows_s: tuple[float, ...] | None = None):
        self._lock = threading.Lock()
        self.gpu_energy = [_Series() for _ in range(n_gpus)]
        self.gpu_power = [_Series() for _ in range(n_gpus)]
        self.gpu_avg_power = [_Series() for _ in range(n_gpus)]
        self.cpu_energy = _Series()
        self.avg_windows_s = avg_windows_s or (1.0,) * n_gpus
        # Why RAPL gave no CPU figure at some read (zone notes, failed reads), first seen first: a
        # GPU+CPU figure left empty must say why.
        self.cpu_problems: dict[str, int] = {}
        # Cumulative CPU seconds (collectors/cputime.py): the host's busy time, the server's, powerprof's.
        self.cpu_time = {"host": _Series(), "server": _Series(), "powerprof": _Series()}
        self.server_note: str | None = None  # why the server's processes are not known, as last read
        # Per GPU: the counter's refresh grid (period_ns, phase_ns; (0, 0) none) and how many reads it came from.
        self._grid = [((0, 0), 0) for _ in range(n_gpus)]

    def add(self, sample: Sample) -> None:
        if sample.source == "rapl":
            with self._lock:
                if sample.data is None:
                    self._cpu_problem(f"RAPL read failed: {sample.error}")
                else:
                    for r in sample.data:
                        if r.note:
                            self._cpu_problem(f"{r.zone}: {r.note}")
        if sample.data is None:
            return
        with self._lock:
            if sample.source == "nvml":
                for k, r in enumerate(sample.data):
                    # The counter at the instant of its own driver call, not the sample's (the middle of
                    # reading every GPU and value): the gap moved every window edge by it.
                    t_e = getattr(r, "energy_t_mono_ns", None)
                    self.gpu_energy[k].add(sample.t_mono_ns if t_e is None else t_e, r.energy_j, getattr(r, "energy_epoch", 0))
                    self.gpu_power[k].add(sample.t_mono_ns, r.power_w, on_demand=sample.on_demand)
                    self.gpu_avg_power[k].add(sample.t_mono_ns, r.power_avg_w, on_demand=sample.on_demand)
            elif sample.source == "rapl":
                self.cpu_energy.add(sample.t_mono_ns, *cpu_energy_j(sample.data))
            elif sample.source == "cputime":
                d = sample.data
                self.cpu_time["host"].add(sample.t_mono_ns, d.host_busy_s)
                self.cpu_time["server"].add(sample.t_mono_ns, d.server_cpu_s)
                self.cpu_time["powerprof"].add(sample.t_mono_ns, d.powerprof_cpu_s)
                self.server_note = d.server_note

    def _cpu_problem(self, text: str) -> None:
        # Numbers (seconds, joules) differ from read to read; the first wording of each kind is kept.
        key = re.sub(r"[0-9.]+", "#", text)
        for k in self.cpu_problems:
            if re.sub(r"[0-9.]+", "#", k) == key:
                self.cpu_problems[k] += 1
                return
        if len(self.cpu_problems) < 8:
            self.cpu_problems[text] = 1

    def latest_ns(self) -> int | None:
        with self._lock:
            ends = [s.t_ns[-1] for s in self.gpu_energy + self.gpu_power + self.gpu_avg_power if s.t_ns]
            if self.cpu_energy.t_ns:
                ends.append(self.cpu_energy.t_ns[-1])
        return min(ends) if ends else None

    def energy_between(self, t0_ns: int, t1_ns: int) -> EnergyResult:
        with self._lock:
            gpu_e: list[float | None] = []
            methods: list[str] = []
            gap_s = delay_s = end_share = 0.0
            under_refresh = False
            for k in range(len(self.gpu_energy)):
                if self.gpu_energy[k].t_ns and 0 < t1_ns - t0_ns < self._counter_refresh_ns(k):
                    e, m = None, METHOD_NONE  # shorter than the counter's refresh: COUNTER_REFRESH_MAX_NS
                    under_refresh = True
                else:
                    e, m = self._gpu_energy(k, t0_ns, t1_ns)
                gpu_e.append(e)
                methods.append(m)
                series = self.gpu_energy[k]
                if m == METHOD_COUNTER and t1_ns > t0_ns and not self._end_gridded(k, t0_ns, t1_ns):
                    end_share = max(end_share, edge_read_delay_s(series.t_ns, t1_ns, t1_ns) / ((t1_ns - t0_ns) / 1e9))
                if m in (METHOD_AVG_POWER, METHOD_POWER):
                    series = self.gpu_avg_power[k] if m == METHOD_AVG_POWER or not self.gpu_power[k].t_ns else self.gpu_power[k]
                    gap_s = max(gap_s, _largest_gap_s(series.t_ns, t0_ns, t1_ns))
                if m != METHOD_NONE:
                    delay_s = max(delay_s, edge_read_delay_s(series.t_ns, t0_ns, t1_ns))
            t, y = self.cpu_energy.arrays()
            cpu = counter_energy_j(t, y, t0_ns, t1_ns, self.cpu_energy.epoch) if t.size >= 2 else float("nan")
            cpu_time = self._cpu_time(t0_ns, t1_ns)
        return EnergyResult(t0_ns, t1_ns, tuple(gpu_e), tuple(methods), None if np.isnan(cpu) else cpu, gap_s, cpu_time,
                            delay_s, end_share, under_refresh)

    def _end_gridded(self, k: int, t0: int, t1: int) -> bool:
        """Whether GPU k's counter window [t0, t1] has its edges placed on the refresh grid (two or more values
        dated inside it: energy._gridded_window_energy_j), not the end's straight line."""
        period_ns, phase_ns = self._counter_grid(k)
        if not period_ns:
            return False
        t = np.asarray(self.gpu_energy[k].t_ns, dtype=np.int64)
        t = t[int(np.searchsorted(t, t0)):int(np.searchsorted(t, t1 + period_ns, side="right"))]  # reads dated inside
        t = counter_value_instants_ns(t, period_ns, phase_ns)
        return int(np.unique(t[(t >= t0) & (t <= t1)]).size) >= 2

    def cputime_latest_ns(self) -> int | None:
        with self._lock:
            s = self.cpu_time["host"]
            return s.t_ns[-1] if s.t_ns else None

    def _cpu_time(self, t0: int, t1: int) -> CpuTime | None:
        """CPU seconds over [t0, t1], each cumulative series interpolated at the edges like an energy counter;
        None for a series whose readings do not span the window (read 1 Hz: never extrapolated)."""
        def over(s: _Series) -> float | None:
            if len(s.t_ns) < 2 or s.t_ns[0] > t0 or s.t_ns[-1] < t1:
                return None
            t, y = s.arrays()
            return float(np.interp(t1, t, y) - np.interp(t0, t, y))

        host = over(self.cpu_time["host"])
        if host is None:
            return None
        return CpuTime(host, over(self.cpu_time["server"]), over(self.cpu_time["powerprof"]))

    def _gpu_energy(self, k: int, t0: int, t1: int) -> tuple[float | None, str]:
        methods = ENERGY_METHODS[:-1]
        if t1 - t0 < self.avg_windows_s[k] * 1e9 and self.gpu_power[k].t_ns:
            # The trailing average spans mostly power from before the window (a decode window after idle or a
            # prefill: -44% at 50 ms, -28% at 0.3 s on the simulated H200); the instant power read at its edges does not.
            methods = (METHOD_COUNTER, METHOD_POWER, METHOD_AVG_POWER)
        for method in methods:
            e = self._by_method[method](self, k, t0, t1)
            if not np.isnan(e):
                return e, method
        return None, METHOD_NONE

    def _counter(self, k: int, t0: int, t1: int) -> float:
        s = self.gpu_energy[k]
        t, y = s.arrays()
        # Across a dropped counter difference (a jump) the counter is no figure: power integration takes over.
        if t.size < 2:
            return float("nan")
        period_ns, phase_ns = self._counter_grid(k)
        return counter_window_energy_j(t, y, t0, t1, np.asarray(s.epoch), period_ns=period_ns, phase_ns=phase_ns)

    def counter_refresh_s(self) -> float | None:
        """The slowest energy-counter refresh among the GPUs read on a counter, from their refresh grids (s); None
        until every such GPU's grid is known (GRID_MIN_READS reads) or without a counter: then a caller assumes the
        coarsest drivers use (energy.COUNTER_STEP_S)."""
        periods = []
        for k, s in enumerate(self.gpu_energy):
            if len(s.t_ns) < 2:
                continue
            period_ns = self._counter_grid(k)[0]
            if not period_ns:
                return None
            periods.append(period_ns / 1e9)
        return max(periods) if periods else None

    def _counter_refresh_ns(self, k: int) -> int:
        """GPU k's counter refresh period: its grid's, or COUNTER_REFRESH_MAX_NS until that is known."""
        return self._counter_grid(k)[0] or COUNTER_REFRESH_MAX_NS

    def _counter_grid(self, k: int) -> tuple[int, int]:
        """GPU k's counter refresh grid from its reads so far (see GRID_MIN_READS), cached."""
        s = self.gpu_energy[k]
        grid, n_at = self._grid[k]
        n = len(s.t_ns)
        if n < GRID_MIN_READS or (n_at and n < min(2 * n_at, n_at + GRID_READS)):
            return grid
        ep = np.asarray(s.epoch[-GRID_READS:])
        keep = ep == ep[-1]  # a reload may restart the counter on another grid
        t, y = s.arrays()
        grid = (counter_refresh_grid(t[-GRID_READS:][keep], y[-GRID_READS:][keep], GRID_MARGIN)
                if keep.sum() >= GRID_MIN_READS else (0, 0))
        self._grid[k] = (grid, n)
        return grid

    def _avg_power(self, k: int, t0: int, t1: int) -> float:
        t, y = self.gpu_avg_power[k].arrays()
        return trailing_average_energy_j(t, y, self.avg_windows_s[k], t0, t1)

    def _instant_power(self, k: int, t0: int, t1: int) -> float:
        # Without a trailing average (window 0) the "average" reading is instant power too.
        for series in (self.gpu_power[k], self.gpu_avg_power[k]):
            t, y = series.arrays()
            if t.size >= 2:
                e = instant_power_energy_j(t, y, t0, t1, np.asarray(series.on_demand, dtype=bool))
                if not np.isnan(e):
                    return e
        return float("nan")

    _by_method = {METHOD_COUNTER: _counter, METHOD_AVG_POWER: _avg_power, METHOD_POWER: _instant_power}


def _largest_gap_s(t_ns: list, t0_ns: int, t1_ns: int) -> float:
    """The longest time between consecutive readings of those spanning [t0, t1]."""
    t = np.asarray(t_ns, dtype=np.int64)
    if t.size < 2:
        return 0.0
    i = max(int(np.searchsorted(t, t0_ns, side="right")) - 1, 0)
    j = min(int(np.searchsorted(t, t1_ns, side="left")), t.size - 1)
    return float(np.diff(t[i : j + 1]).max()) / 1e9 if j > i else 0.0


class Profiler:
    """Runs the sampler and answers "how much energy between these two instants"."""

    def __init__(
        self,
        nvml=None,
        gpus: list[int] | None = None,
        rapl=None,
        extra_collectors=(),
        interval_s: float = 1.0,
        clock: Clock | None = None,
        gpu_collector: NvmlCollector | None = None,
        cputime=None,
    ):
        # An already-open collector (from collectors.sources) or one opened here on `nvml`.
        # The collector dates each counter read on its own clock: the sampler's, so the two line up.
        clock_ns = clock.monotonic_ns if clock is not None else time.monotonic_ns
        self.gpu = gpu_collector if gpu_collector is not None else (
            NvmlCollector(nvml, gpus, clock_ns=clock_ns) if nvml is not None else None)
        self._owns_gpu = gpu_collector is None
        self.rapl = rapl
        self.cputime = cputime  # collectors/cputime.py: whose CPU time the host spent (read on the ticks only)
        collectors = [c for c in (self.gpu, rapl, cputime) if c is not None] + list(extra_collectors)
        self.sampler = Sampler(collectors, interval_s=interval_s, clock=clock)
        n = len(self.gpu.indexes) if self.gpu else 0
        self.timeline = EnergyTimeline(n, tuple(i.power_avg_window_s for i in self.gpu_infos))
        self.sampler.subscribe(self.timeline.add)
        self._edge_sources = tuple(c.source for c in (self.gpu, rapl) if c is not None)
        self._edges: queue.Queue = queue.Queue()
        self._edge_thread: threading.Thread | None = None
        self._edge_lock = threading.Lock()
        self._edge_done = threading.Condition()
        self._edges_pending = 0
        self._stopped = False
        self.edge_errors = 0  # edge reads that raised: measure says so
        self.edge_timeouts = 0  # waits for edge reads that gave up (a wedged driver call): said too
        self._edge_reads = 0  # edge reads finished, to tell a new stall from the one already waited out
        self._edge_stuck_at = -1
        self.late_edge_windows = 0  # windows whose edge read came over EDGE_READ_LATE_S after the edge: said
        self.end_bias_windows = 0  # windows whose end read came over END_EDGE_BIAS_SHARE of their length late: said
        self.short_windows = 0  # windows without a GPU figure, shorter than the counter's refresh: said
        self.unread_windows = 0  # windows without a GPU figure for want of a reading over them, not shortness: said
        self.placed_edge_windows = 0  # server-timed windows whose placed edge had no reading near it: said
        self.placed_edge_delay_s = 0.0  # the farthest such reading from its edge

    @property
    def gpu_infos(self):
        return self.gpu.infos if self.gpu else []

    def start(self) -> "Profiler":
        self._stopped = False
        self.sampler.start()
        if self.cputime is not None:
            # A window may open before the tick thread's first read: CPU time is never extrapolated, so read it now.
            self.sampler.sample_now("start", sources=("cputime",))
        return self

    def stop(self) -> None:
        with self._edge_lock:
            self._stopped = True  # edge() is a no-op from here: nothing would stop a new thread
            thread, self._edge_thread = self._edge_thread, None
        if thread is not None:
            self._edges.put(None)
            # Bounded like the sampler's own stop: a driver call wedged in the thread must not
            # hold up what runs after (a sweep restores the GPUs' limits next).
            thread.join(EDGE_STOP_S)
        self.sampler.stop()

    def close(self) -> None:
        self.stop()
        if self.gpu and self._owns_gpu:
            self.gpu.close()

    def __enter__(self) -> "Profiler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def mark(self, label: str | None = None) -> int:
        """Read the energy sources now; returns the monotonic instant of the reading."""
        samples = self.sampler.sample_now(label, sources=self._edge_sources)
        if not samples:
            return self.sampler.clock.monotonic_ns()
        # Every source must have a reading at or after the instant returned (the counter is interpolated, never
        # extrapolated): a GPU's counter is dated by its own driver call, which can come before the sample's middle.
        times = [s.t_mono_ns for s in samples.values()]
        for s in samples.values():
            if s.source == "nvml" and s.data is not None:
                times += [t for r in s.data if (t := getattr(r, "energy_t_mono_ns", None)) is not None]
        return min(times)

    def edge(self, label: str | None = None) -> None:
        """Have the energy sources read as soon as possible, in the profiler's own thread; returns at once.

        For a load generator's event loop: on a real H200 one read of the energy counter costs
        2-3 ms of CPU, 15 ms at p99 (docs/hardware.md), and a loop that waited for it would stamp
        every other stream's tokens late. A window's edge is its event's own timestamp; the
        timeline only needs a reading close after it, and edges that pile up meanwhile share one.
        After stop() it does nothing (the periodic ticks are over too).
        """
        with self._edge_lock:
            if self._stopped:
                return
            if self._edge_thread is None:
                self._edge_thread = threading.Thread(target=self._edge_loop, name="powerprof-edges", daemon=True)
                self._edge_thread.start()
            with self._edge_done:
                self._edges_pending += 1
            self._edges.put(label)

    def flush_edges(self, timeout_s: float = EDGE_STOP_S) -> bool:
        """Wait until every edge asked for so far has been read; False if that took over timeout_s
        (a wedged driver call): the windows then rest on the readings there are."""
        with self._edge_done:
            if self._edges_pending and self._edge_stuck_at == self._edge_reads:
                timeout_s = 0.0  # gave up on this same read before: one stall must not cost every window 5 s
            done = self._edge_done.wait_for(lambda: self._edges_pending == 0, timeout_s)
            if not done and self._edge_stuck_at != self._edge_reads:
                self._edge_stuck_at = self._edge_reads
                self.edge_timeouts += 1
        return done

    def edge_notes(self) -> list[str]:
        """What went wrong with window-edge reads, for a run's notes: windows whose edges rest on
        the nearest periodic readings (wider interpolation) are said, never silent."""
        notes = []
        if self.edge_errors:
            notes.append(f"{self.edge_errors} window-edge sensor reads failed: those windows' edges rest on the "
                         "nearest periodic readings (wider interpolation); fix: check the GPU driver (powerprof devices)")
        if self.edge_timeouts:
            notes.append(f"window-edge sensor reads stalled over {EDGE_STOP_S:g} s ({self.edge_timeouts} times): "
                         "windows closed meanwhile rest on the nearest periodic readings (wider interpolation); "
                         "fix: check the GPU driver (powerprof devices; nvidia-smi -q for a hung GPU)")
        if self.late_edge_windows:
            notes.append(f"{self.late_edge_windows} windows' edge reads came over {EDGE_READ_LATE_S * 1e3:g} ms after "
                         "their edges (a loaded host): their energy assumes the power held over that delay, and they "
                         "are flagged low_confidence; fix: run on a less loaded host (fewer other processes, or "
                         "taskset powerprof onto its own core)")
        if self.short_windows:
            notes.append(f"{self.short_windows} windows (a request's decode, or a piece of a batch's between other "
                         "streams' prefills) were shorter than the GPU energy counter's refresh (10-100 ms; "
                         f"{COUNTER_REFRESH_MAX_NS / 1e6:g} ms until it is known), which no reading resolves (the "
                         "counter holds one or two refreshes' values; instant power, refreshed as seldom, shows the "
                         "power before the window): they carry no GPU energy figure, nor does a level or batch that "
                         "holds one; fix: longer requests (more --max-tokens), streams sent together")
        if self.placed_edge_windows:
            # Behind a buffering hop every window is server-timed and its start is placed: the note that said "a loaded
            # host" for them sent the person after the wrong cause.
            notes.append(f"{self.placed_edge_windows} server-timed windows (a stream not delivered token by token: a "
                         "buffering proxy, a stream held back) have an edge placed by the server's own decode time, "
                         "where no reading was taken (the client learned of it later): their energy there is "
                         f"interpolated between readings up to {self.placed_edge_delay_s * 1e3:.0f} ms away, and they "
                         "are flagged low_confidence; fix: point --server at the server itself, or turn the proxy's "
                         "buffering off (nginx: proxy_buffering off), so the stream times its windows; or sample more "
                         "often (--interval)")
        if self.unread_windows:
            # A sweep costed 3 of 4 windows a level this way behind a buffering hop (a window placed past the response's
            # end, arrival.classify), and nothing said why their energy_method was none.
            notes.append(f"{self.unread_windows} windows carry no GPU energy figure (energy_method none): no GPU "
                         "reading covered them from start to end when they were costed (a counter is interpolated, "
                         "never extrapolated past its last read); they count in no J/token, and a level's rests on "
                         "the windows that have one (flag one-window where one is left); fix: check the GPU driver "
                         "(powerprof devices says what the GPU can report; nvidia-smi -q for a hung GPU)")
        if self.end_bias_windows:
            notes.append(f"{self.end_bias_windows} windows' end-edge reads came over {END_EDGE_BIAS_SHARE:.0%} of their "
                         "length after their end (a loaded host): their energy may read low by up to that share (the "
                         "end's energy counter is interpolated over the delay), and they are flagged low_confidence; "
                         "fix: longer windows (more --max-tokens) or a less loaded host (taskset powerprof onto its "
                         "own core)")
        return notes

    def _edge_loop(self) -> None:
        stop = False
        while not stop:
            got = [self._edges.get()]
            while True:  # everything queued meanwhile is served by the one read below
                try:
                    got.append(self._edges.get_nowait())
                except queue.Empty:
                    break
            labels = [x for x in got if x is not None]
            stop = len(labels) < len(got)
            try:
                if labels:
                    self.mark(labels[0])
            except Exception:  # noqa: BLE001 - a failed edge leaves the window to the ticks; the thread must live on
                self.edge_errors += 1
            finally:
                with self._edge_done:
                    self._edge_reads += 1
                    self._edges_pending -= len(labels)
                    self._edge_done.notify_all()

    def energy_between(self, t0_ns: int, t1_ns: int, placed: bool = False) -> EnergyResult:
        """The energy over [t0_ns, t1_ns]; `placed`: an edge was placed by the server's own decode time (a server-timed
        window, powerprof/arrival.py), not read when it happened, so no reading was taken at it: the delay to the
        nearest reading there is said as that, never as a loaded host's."""
        latest = self.timeline.latest_ns() if self.flush_edges() else t1_ns  # a wedged read holds the source's lock
        if latest is None or latest < t1_ns:
            self.mark("edge")
        self._cputime_after(t1_ns)
        return self._counted(self.timeline.energy_between(t0_ns, t1_ns), placed)

    def _counted(self, r: EnergyResult, placed: bool = False) -> EnergyResult:
        if r.under_refresh:
            self.short_windows += 1
        elif r.gpu_methods and r.gpu_energy_total_j is None:
            self.unread_windows += 1
        late = r.edge_read_delay_s > EDGE_READ_LATE_S
        biased = r.end_edge_bias_share > END_EDGE_BIAS_SHARE and r.duration_s >= EDGE_BIAS_WINDOW_S
        if placed and (late or biased):
            self.placed_edge_windows += 1
            self.placed_edge_delay_s = max(self.placed_edge_delay_s, r.edge_read_delay_s)
        elif late:
            self.late_edge_windows += 1
        elif biased:
            self.end_bias_windows += 1
        return r

    def _cputime_after(self, t1_ns: int) -> None:
        # CPU time is read on the ticks, not at edges (that read costs what an edge must not): a window
        # that ended after the last tick gets one read now, which covers every window before it too.
        if self.cputime is not None and not self._stopped:
            latest = self.timeline.cputime_latest_ns()
            if latest is None or latest < t1_ns:
                self.sampler.sample_now("edge", sources=("cputime",))

    @contextmanager
    def window(self, name: str):
        w = Window(name)
        w.t0_ns = self.mark(f"start:{name}")
        try:
            yield w
        finally:
            w.t1_ns = self.mark(f"end:{name}")
            self._cputime_after(w.t1_ns)
            w.result = self._counted(self.timeline.energy_between(w.t0_ns, w.t1_ns))
