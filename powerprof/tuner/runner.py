"""The live tuning loop: read the daemon every tick, ask the policy, set the level through the controller, record why.

Safety (docs/tuner.md): levels change only through the LimitController the door gives
(restore file before the first change, the original limit back on every exit, `powerprof
restore` after kill -9); SIGUSR1 pins the reference level until the process ends; figures that
stop coming (daemon down, a scrape failing, counters going backwards) send the GPUs to the
reference level after `stale_s`; dry-run changes nothing and only records recommendations.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import signal
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from powerprof.storage.runs import atomic_write_table
from powerprof.storage.schema import TUNER_DECISIONS, rows_to_table

from .observe import DaemonCounters, ObserveError, window_between
from .policy import Decision, Tuner, TunerConfig

log = logging.getLogger("powerprof.tune")


class DecisionLog:
    """Rows of TUNER_DECISIONS, written as one small Parquet file per flush under `out_dir` (None: kept in memory)."""

    def __init__(self, out_dir: Path | None, gpus: list[int], knob: str):
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.gpus = ",".join(str(g) for g in gpus)
        self.knob = knob
        self.rows: deque[dict] = deque(maxlen=1000)  # the latest, in memory; all of them in the dataset
        self._unflushed: list[dict] = []
        self.host = socket.gethostname()

    def add(self, d: Decision, t0_s: float, applied: bool) -> None:
        row = {"time_utc": time.time_ns(), "t_mono_s": d.t_s - t0_s, "action": d.action, "knob": self.knob,
               "from_level": d.from_level, "to_level": d.to_level, "applied": applied, "reason": d.reason,
               "regime": d.regime, "j_per_token": d.j_per_token, "slo_ratio": d.slo_ratio, "gpus": self.gpus}
        self.rows.append(row)
        self._unflushed.append(row)
        log.info("%s %g→%g %s (%s)", d.action, d.from_level, d.to_level, d.reason, "applied" if applied else "recommended")

    def flush(self) -> None:
        if self.out_dir is None or not self._unflushed:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        part = self.out_dir / f"date={day}" / f"part-{time.time_ns()}.parquet"
        part.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_table(part, rows_to_table(TUNER_DECISIONS, self._unflushed, fill={"host": self.host}))
        self._unflushed = []


class TunerMetrics:
    """The tuner's own /metrics: level, reference, state, decisions by action, dry-run, staleness."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.level = Gauge("powerprof_tuner_level", "Level the tuner holds (W for power, MHz for clock)", ["knob"], registry=r)
        self.reference = Gauge("powerprof_tuner_reference_level", "The reference level", ["knob"], registry=r)
        self.decisions = Counter("powerprof_tuner_decisions", "Tuner decisions by action", ["action"], registry=r)
        self.dry_run = Gauge("powerprof_tuner_dry_run", "1 when the tuner only recommends", registry=r)
        self.stale = Gauge("powerprof_tuner_stale", "1 while the daemon's figures are missing or untrusted", registry=r)
        self.killed = Gauge("powerprof_tuner_killed", "1 after the kill switch: the reference is held", registry=r)
        self.explore_s = Gauge("powerprof_tuner_explore_seconds", "Time spent on trial levels", registry=r)


class TuneRunner:
    """One tuning session over an open controller (or None in dry-run). `run()` returns when `stop` is set."""

    def __init__(self, cfg: TunerConfig, read: Callable[[], DaemonCounters], ctl=None, gpus: list[int] | None = None,
                 out_dir: Path | None = None, registry: CollectorRegistry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if ctl is None and not cfg.dry_run:
            raise ValueError("a controller is needed unless dry_run")
        self.cfg = cfg
        self.read = read
        self.ctl = ctl
        self.clock = clock
        self.t0_s = clock()
        self.tuner = Tuner(cfg, self.t0_s)
        self.log = DecisionLog(out_dir, gpus or [], cfg.knob)
        self.metrics = TunerMetrics(registry)
        self.metrics.dry_run.set(1 if cfg.dry_run else 0)
        self.metrics.reference.labels(cfg.knob).set(cfg.reference)
        self.applied: float | None = None
        self.kill_requested = threading.Event()
        self._last: DaemonCounters | None = None
        self._last_good_s = self.t0_s

    def on_sigusr1(self, *_):
        self.kill_requested.set()

    def _apply(self, level: float) -> None:
        if self.cfg.dry_run or level == self.applied:
            return
        if self.cfg.knob == "power":
            self.ctl.set_power_limit_w(level)
        else:
            self.ctl.lock_sm_clock_mhz(int(level))
        self.applied = level

    def _record(self, ds: list[Decision]) -> None:
        for d in ds:
            self.log.add(d, self.t0_s, applied=not self.cfg.dry_run)
            self.metrics.decisions.labels(d.action).inc()
        if ds:
            self.log.flush()

    def start(self) -> None:
        """The reference level first: the tuner starts from the known-safe setting."""
        d = self.tuner.note(self.clock(), "start", "tuner started at the reference level")
        self._apply(self.tuner.level)
        self._record([d])
        self.metrics.level.labels(self.cfg.knob).set(self.tuner.level)

    def check_kill(self) -> None:
        if self.kill_requested.is_set() and self.tuner.state != "killed":
            d = self.tuner.kill(self.clock())
            self.metrics.killed.set(1)
            self._apply(self.tuner.level)
            self._record([d])
            self.metrics.level.labels(self.cfg.knob).set(self.tuner.level)

    def tick(self) -> None:
        self.check_kill()
        now = self.clock()
        ds: list[Decision] = []
        try:
            c = dataclasses.replace(self.read(), t_s=now)
            last, self._last = self._last, c
            if last is not None:
                if c.upstream_failures > last.upstream_failures:
                    raise ObserveError(f"the inference server is failing ({c.upstream_failures - last.upstream_failures:.0f} "
                                       "requests not delivered)")
                if c.gpu_energy_j <= last.gpu_energy_j:
                    raise ObserveError("the daemon's GPU energy has not moved (its sampling stalled?)")
                w = window_between(last, c, self.tuner.level)
                ds.extend(self.tuner.observe(w))
                self._last_good_s = now
                self.metrics.stale.set(0)
        except ObserveError as e:
            if now - self._last_good_s >= self.cfg.stale_s:
                d = self.tuner.stale(now, f"no trustworthy figures for {now - self._last_good_s:.0f} s ({e})")
                if d is not None:
                    ds.append(d)
                self.metrics.stale.set(1)
        self._apply(self.tuner.level)
        self._record(ds)
        self.metrics.level.labels(self.cfg.knob).set(self.tuner.level)
        self.metrics.explore_s.set(self.tuner.explore_s)

    def run(self, stop: threading.Event, duration_s: float | None = None) -> None:
        self.start()
        end = None if duration_s is None else self.t0_s + duration_s
        next_tick = self.t0_s + self.cfg.tick_s
        while not stop.is_set():
            now = self.clock()
            if end is not None and now >= end:
                break
            self.check_kill()  # the kill switch acts within a fraction of a second, not at the next tick
            if now >= next_tick:
                self.tick()
                next_tick = max(next_tick + self.cfg.tick_s, now)
            stop.wait(min(0.2, max(0.0, next_tick - now)))
        self.log.flush()


def install_kill_switch(runner: TuneRunner) -> None:
    """SIGUSR1 → back to the reference and hold (main thread only, where Python delivers signals)."""
    signal.signal(signal.SIGUSR1, runner.on_sigusr1)
