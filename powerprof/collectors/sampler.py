"""The sampler: one thread per collector on a shared drift-free schedule, plus on-demand samples."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from powerprof.errtext import error_text


class Clock(Protocol):
    def monotonic_ns(self) -> int: ...
    def wall_ns(self) -> int: ...
    def sleep_until(self, t_mono_ns: int, stop: threading.Event) -> bool:
        """Wait until the monotonic clock reaches t; False if `stop` was set first."""


class SystemClock:
    def monotonic_ns(self) -> int:
        return time.monotonic_ns()

    def wall_ns(self) -> int:
        return time.time_ns()

    def sleep_until(self, t_mono_ns: int, stop: threading.Event) -> bool:
        while True:
            left = (t_mono_ns - time.monotonic_ns()) / 1e9
            if left <= 0:
                return not stop.is_set()
            if stop.wait(left):
                return False


class Collector(Protocol):
    source: str

    def read(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """One read of one source. `data` is the collector's reading, None when missing."""

    source: str
    seq: int  # tick number on the shared schedule; -1 for on-demand samples
    t_mono_ns: int  # when the read started (monotonic: use for arithmetic)
    t_wall_ns: int  # the same instant on the UTC wall clock (use for storage only)
    data: Any
    error: str | None = None
    label: str | None = None  # on-demand samples: what asked for it (a window edge)

    @property
    def on_demand(self) -> bool:
        return self.seq < 0

    @property
    def ok(self) -> bool:
        return self.data is not None


Subscriber = Callable[[Sample], None]

MIN_INTERVAL_S = 0.02  # 50 Hz
MAX_INTERVAL_S = 10.0  # 0.1 Hz


def _midpoint(clock: Clock, t0_mono_ns: int, t0_wall_ns: int) -> tuple[int, int]:
    """The middle of a read that began at t0: a sample's instant.

    A real H200's energy-counter read takes ~3 ms (15 ms at p99) and several GPUs are read one after
    another (docs/hardware.md); stamping the start would date every value early, by up to the whole
    read for the last GPU, and shift every window's energy by it. The middle is the unbiased guess.
    """
    half = (clock.monotonic_ns() - t0_mono_ns) // 2
    return t0_mono_ns + half, t0_wall_ns + half


class Sampler:
    """Runs collectors at `interval_s` on one schedule: tick k of every source is due at t0 + k*interval.

    Each source has its own thread, so a slow or hanging source delays only itself; a tick it
    misses is published as a missing sample. Subscribers receive every Sample, serialised, in
    the thread that produced it: they must be quick (append to a buffer, put on a queue).
    """

    def __init__(
        self,
        collectors: Iterable[Collector],
        interval_s: float = 1.0,
        clock: Clock | None = None,
    ):
        if not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
            raise ValueError(
                f"sampling interval {interval_s} s is outside {MIN_INTERVAL_S}-{MAX_INTERVAL_S} s (0.1-50 Hz)"
            )
        self.collectors = list(collectors)
        names = [c.source for c in self.collectors]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate collector sources: {names}")
        for c in self.collectors:
            # A collector with a hard limit on its read interval (RAPL counters wrap) vetoes here.
            check = getattr(c, "check_interval", None)
            if check is not None:
                check(interval_s)
        self.interval_ns = int(round(interval_s * 1e9))
        self.clock = clock or SystemClock()
        self._subscribers: tuple[Subscriber, ...] = ()
        self._publish_lock = threading.Lock()
        self._read_locks = {c.source: threading.Lock() for c in self.collectors}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0_ns: int | None = None
        self.errors = {c.source: 0 for c in self.collectors}
        self.missed = {c.source: 0 for c in self.collectors}
        # What reading costs this process, per source: a real H200's energy counter alone takes ~3 ms
        # of CPU a read (docs/hardware.md), so the cost is reported, not assumed.
        self.reads = {c.source: 0 for c in self.collectors}
        self.read_cpu_s = {c.source: 0.0 for c in self.collectors}
        self.latest: dict[str, Sample] = {}  # replaced, never mutated: readers need no lock

    # --- wiring ------------------------------------------------------------------------------

    def subscribe(self, fn: Subscriber) -> Subscriber:
        with self._publish_lock:
            self._subscribers = self._subscribers + (fn,)
        return fn

    def _publish(self, sample: Sample) -> None:
        with self._publish_lock:
            latest = dict(self.latest)
            latest[sample.source] = sample
            self.latest = latest
            for fn in self._subscribers:
                try:
                    fn(sample)
                except Exception:  # a broken sink must not stop sampling
                    pass

    # --- reading -----------------------------------------------------------------------------

    def _read(self, collector: Collector, seq: int, label: str | None = None) -> Sample:
        # Read and publish under the source's lock, so subscribers see each source's samples in
        # the order they were read (monotonic timestamps) even while sample_now() races a tick.
        with self._read_locks[collector.source]:
            t0_mono, t0_wall = self.clock.monotonic_ns(), self.clock.wall_ns()
            c0 = time.thread_time()
            try:
                data, error = collector.read(), None
            except Exception as e:  # recorded as missing, counted, never fatal
                data, error = None, error_text(e)
                self.errors[collector.source] += 1
            self.reads[collector.source] += 1
            self.read_cpu_s[collector.source] += time.thread_time() - c0
            t_mono, t_wall = _midpoint(self.clock, t0_mono, t0_wall)
            sample = Sample(collector.source, seq, t_mono, t_wall, data, error, label)
            self._publish(sample)
        return sample

    def sample_now(self, label: str | None = None, sources: Iterable[str] | None = None) -> dict[str, Sample]:
        """Read every source (or those named) now, in this thread; safe alongside the ticks."""
        want = None if sources is None else set(sources)
        out = {}
        for c in self.collectors:
            if want is None or c.source in want:
                out[c.source] = self._read(c, -1, label)
        return out

    def read_with(self, source: str, fn: Callable[[], Any]) -> tuple[int, int, Any]:
        """(monotonic ns, wall ns, fn()) for a partial read of `source` (such as the energy counters
        alone) taken under its lock, so it is ordered with that source's ticks; not published."""
        with self._read_locks[source]:
            t0_mono, t0_wall = self.clock.monotonic_ns(), self.clock.wall_ns()
            got = fn()
            return (*_midpoint(self.clock, t0_mono, t0_wall), got)

    # --- the schedule ------------------------------------------------------------------------

    def _loop(self, collector: Collector) -> None:
        k = 0
        period = self.interval_ns
        assert self.t0_ns is not None
        while True:
            due = self.t0_ns + k * period
            if not self.clock.sleep_until(due, self._stop):
                return
            late = self.clock.monotonic_ns() - due
            if late >= period:
                # The previous read overran whole periods: those ticks are missing, not late.
                skipped = late // period
                with self._read_locks[collector.source]:
                    for j in range(k, k + skipped):
                        self.missed[collector.source] += 1
                        t = self.t0_ns + j * period
                        self._publish(Sample(collector.source, j, t, self._wall_at(t), None, "missed: source too slow"))
                k += skipped
            self._read(collector, k)
            k += 1

    def _wall_at(self, t_mono_ns: int) -> int:
        return self.clock.wall_ns() - (self.clock.monotonic_ns() - t_mono_ns)

    def start(self) -> "Sampler":
        if self._threads:
            raise RuntimeError("sampler already started")
        self._stop.clear()
        self.t0_ns = self.clock.monotonic_ns()
        for c in self.collectors:
            t = threading.Thread(target=self._loop, args=(c,), name=f"powerprof-{c.source}", daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        self._threads = []

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
