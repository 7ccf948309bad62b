"""The sampler's schedule: drift-free, slow/failing sources isolated, sample_now() safe alongside ticks."""

from __future__ import annotations

import threading
import time

import pytest

from powerprof.collectors.rapl import RaplCollector
from powerprof.collectors.sampler import Sampler
from powerprof.sim.powercap import SimPowercap

WAIT_S = 20.0  # real-time bound on any wait in these tests


class VirtualClock:
    """Virtual time for the sampler's N threads: once all of them wait, time jumps to the earliest wake-up.

    A read that "takes" virtual time calls block(seconds), which is a wait like any other, so the
    other sources keep ticking meanwhile, as they would in real time. Nothing sleeps.
    """

    def __init__(self, participants: int, start_ns: int = 10**12):
        self.now = start_ns
        self.n = participants
        self.cond = threading.Condition()
        self.waiting: dict[int, int] = {}
        self.closed = False

    def monotonic_ns(self) -> int:
        with self.cond:
            return self.now

    def wall_ns(self) -> int:
        return self.monotonic_ns() + 1_700_000_000 * 10**9

    def sleep_until(self, t_ns: int, stop: threading.Event) -> bool:
        return self._wait(t_ns, stop)

    def block(self, seconds: float) -> None:
        with self.cond:
            t = self.now + int(round(seconds * 1e9))
        self._wait(t, None)

    def _wait(self, t_ns: int, stop) -> bool:
        me = threading.get_ident()
        with self.cond:
            self.waiting[me] = t_ns
            if len(self.waiting) == self.n:
                self.now = max(self.now, min(self.waiting.values()))
                self.cond.notify_all()
            while not self.closed and self.now < t_ns and not (stop is not None and stop.is_set()):
                self.cond.wait(WAIT_S)
            del self.waiting[me]
            return not self.closed and not (stop is not None and stop.is_set())

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class Src:
    def __init__(self, name, clock=None, cost_s=0.0, fail_every=0):
        self.source = name
        self.clock = clock
        self.cost_s = cost_s
        self.fail_every = fail_every
        self.calls = 0

    def read(self):
        self.calls += 1
        if self.cost_s and self.clock is not None:
            self.clock.block(self.cost_s)
        if self.fail_every and self.calls % self.fail_every == 0:
            raise OSError("sensor fell off the bus")
        return self.calls


def _run_virtual(collectors, clock, until_seq, watch, interval_s=1.0):
    sampler = Sampler(collectors, interval_s=interval_s, clock=clock)
    got: dict[str, list] = {c.source: [] for c in collectors}
    done = threading.Event()

    def sink(s):
        got[s.source].append(s)
        if s.source == watch and s.seq >= until_seq:
            done.set()

    sampler.subscribe(sink)
    sampler.start()
    try:
        assert done.wait(WAIT_S), "virtual run did not finish"
    finally:
        clock.close()
        sampler.stop()
    return sampler, got


def test_no_drift_over_60_s_of_virtual_time_even_when_reads_take_time():
    clock = VirtualClock(participants=2)
    # Each read of `a` takes 3 ms: a sampler that sleeps `interval` after each read drifts 180 ms here.
    a = Src("a", clock, cost_s=0.003)
    b = Src("b")
    sampler, got = _run_virtual([a, b], clock, until_seq=60, watch="a")
    t0 = sampler.t0_ns
    for name in ("a", "b"):
        ticks = [s for s in got[name] if s.seq <= 60]
        assert [s.seq for s in ticks] == list(range(61))
        offsets = [s.t_mono_ns - (t0 + s.seq * 1_000_000_000) for s in ticks]
        # A sample is dated at the middle of its read (1.5 ms into a 3 ms one): a constant offset, not a drift.
        assert max(offsets) - min(offsets) < 1_000_000, f"{name}: drift {max(offsets) - min(offsets)} ns"
        assert max(abs(o) for o in offsets) < 1_000_000 + (1_500_000 if name == "a" else 0), f"{name}: {max(offsets)} ns"
    assert sampler.missed == {"a": 0, "b": 0} and sampler.errors == {"a": 0, "b": 0}


def test_a_slow_source_misses_its_own_ticks_and_delays_no_other():
    clock = VirtualClock(participants=3)
    slow = Src("slow", clock, cost_s=2.5)  # every read overruns two and a half periods
    fast = Src("fast")
    flaky = Src("flaky", fail_every=3)
    sampler, got = _run_virtual([slow, fast, flaky], clock, until_seq=30, watch="fast")
    t0 = sampler.t0_ns
    fast_ticks = [s for s in got["fast"] if s.seq <= 30]
    assert [s.seq for s in fast_ticks] == list(range(31))
    assert all(s.t_mono_ns == t0 + s.seq * 1_000_000_000 for s in fast_ticks), "fast source was delayed"
    assert all(s.ok for s in fast_ticks)
    # The slow source: its missed ticks are published as missing samples, not silently skipped.
    slow_missed = [s for s in got["slow"] if not s.ok]
    assert slow_missed and all("missed" in s.error for s in slow_missed)
    assert sampler.missed["slow"] == len(slow_missed) and sampler.missed["fast"] == 0
    seqs = [s.seq for s in got["slow"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # The failing source: its errors are counted and its samples carry the error.
    flaky_bad = [s for s in got["flaky"] if not s.ok]
    assert flaky_bad and all("OSError" in s.error for s in flaky_bad)
    assert sampler.errors["flaky"] == len(flaky_bad) and sampler.errors["fast"] == 0


def test_real_time_run_keeps_the_schedule_within_tolerance():
    src = Src("rt")
    sampler = Sampler([src], interval_s=0.1)
    got = []
    done = threading.Event()

    def sink(s):
        got.append(s)
        if s.seq >= 30:
            done.set()

    sampler.subscribe(sink)
    t_start = time.monotonic()
    with sampler:
        assert done.wait(WAIT_S)
    elapsed = time.monotonic() - t_start
    ticks = [s for s in got if 0 <= s.seq <= 30]
    assert [s.seq for s in ticks] == list(range(31))
    offsets_s = [(s.t_mono_ns - sampler.t0_ns - s.seq * sampler.interval_ns) / 1e9 for s in ticks]
    # A shared, loaded CI machine: generous jitter per tick, but no growth, since every tick is
    # scheduled from t0 and not from the previous one.
    assert min(offsets_s) >= 0
    assert max(offsets_s) < 0.15, offsets_s
    assert 2.9 <= elapsed < 4.0
    assert not sampler._threads, "stop() must join the threads"


class Probe:
    """Counts reads, detects re-entrant (overlapping) reads and torn values."""

    source = "probe"

    def __init__(self):
        self.n = 0
        self.busy = threading.Lock()
        self.overlaps = 0

    def read(self):
        if not self.busy.acquire(blocking=False):
            self.overlaps += 1
            raise AssertionError("overlapping read")
        try:
            self.n += 1
            first = self.n
            time.sleep(0.0002)  # widen the window a concurrent read would tear
            return (first, self.n)
        finally:
            self.busy.release()


def test_sample_now_racing_the_ticks_is_serialised_per_source(tmp_path):
    probe = Probe()
    pc = SimPowercap(tmp_path / "pc", power_w_fn=lambda: 40.0, update_interval_s=0.002).start()
    rapl = RaplCollector(pc.root)
    sampler = Sampler([probe, rapl], interval_s=0.02)
    seen = []
    lock = threading.Lock()

    def sink(s):
        with lock:
            seen.append(s)

    sampler.subscribe(sink)
    per_thread = 40
    results = []

    def hammer(i):
        for j in range(per_thread):
            results.append(sampler.sample_now(label=f"edge-{i}-{j}"))

    with sampler:
        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        time.sleep(0.1)
    pc.close()
    assert probe.overlaps == 0
    probe_samples = [s for s in seen if s.source == "probe" and s.ok]
    assert all(a == b for a, b in (s.data for s in probe_samples)), "torn read"
    serials = [s.data[0] for s in probe_samples]
    assert serials == list(range(1, probe.n + 1)), "each read published exactly once, in read order"
    for source in ("probe", "rapl"):
        stamps = [s.t_mono_ns for s in seen if s.source == source and s.ok]
        assert all(b > a for a, b in zip(stamps, stamps[1:])), f"{source}: timestamps not monotonic"
    on_demand = [s for s in seen if s.on_demand]
    assert len(on_demand) == 2 * 4 * per_thread and all(s.label.startswith("edge-") for s in on_demand)
    assert sum(1 for s in seen if s.seq >= 0 and s.source == "probe") >= 5, "ticks kept running"
    energies = [s.data[0].energy_j for s in seen if s.source == "rapl" and s.ok]
    assert energies == sorted(energies), "RAPL energy went backwards under concurrent reads"
    assert sampler.latest["probe"] is [s for s in seen if s.source == "probe"][-1]


def test_interval_outside_0_1_to_50_hz_is_refused():
    with pytest.raises(ValueError, match="0.1-50 Hz"):
        Sampler([Src("x")], interval_s=0.01)
    with pytest.raises(ValueError, match="0.1-50 Hz"):
        Sampler([Src("x")], interval_s=11)
    with pytest.raises(ValueError, match="duplicate"):
        Sampler([Src("x"), Src("x")])
