"""Sweep orchestration: per level set → settle → warm up → measure to the CI target; restore at the end."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from powerprof.collectors.sampler import Sample
from powerprof.profiler import Profiler

REASON_SW_POWER_CAP = 0x4
REASON_THERMAL = 0x20 | 0x40  # SwThermal | HwThermal
CAP_ENGAGED_FRACTION = 0.9  # average power below 90% of the limit with no SwPowerCap: cap did nothing


@dataclass(frozen=True)
class SweepSettings:
    level_kind: str  # power_limit | sm_clock
    levels: tuple[float, ...]
    repeats: int = 1
    order: str = "desc"  # desc | asc | random
    seed: int = 0
    warmup_requests: int = 2
    min_requests: int = 5
    max_requests: int = 200
    max_time_s: float = 120.0
    target_ci: float = 0.02  # half-width of the 95% CI of J/token, as a fraction of the median
    concurrency: int = 1
    idle_s: float = 5.0
    settle_timeout_s: float = 10.0
    settle_tolerance: float = 0.05
    max_failures: int = 10

    def __post_init__(self):
        if self.level_kind not in ("power_limit", "sm_clock"):
            raise ValueError(f"unknown level kind {self.level_kind!r}")
        if self.order not in ("desc", "asc", "random"):
            raise ValueError(f"--order must be desc, asc or random, not {self.order!r}")
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if not 0 < self.target_ci < 1:
            raise ValueError("--target-ci must be a fraction between 0 and 1 (e.g. 0.02 for ±2%)")
        if self.min_requests < 2:
            raise ValueError("--min-requests must be at least 2: a confidence interval needs two requests")
        if self.max_requests < self.min_requests:
            raise ValueError("--max-requests must not be below --min-requests")
        if self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")


def visit_order(levels, repeats: int, order: str, seed: int = 0) -> list[tuple[float, int]]:
    """(level, repeat) in the order visited: every repeat passes over all levels (interleaved),
    so slow drift (temperature, background load) spreads over levels instead of biasing one."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    for r in range(repeats):
        lv = list(levels)
        if order == "random":
            rng.shuffle(lv)
        else:
            lv.sort(reverse=(order == "desc"))
        out.extend((v, r) for v in lv)
    return out


def median_ci_halfwidth_frac(values: np.ndarray, n_boot: int = 1000, seed: int = 0) -> float:
    """Half-width of the bootstrap 95% CI of the median, relative to the median."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size < 2:
        return float("inf")
    rng = np.random.default_rng(seed)
    meds = np.median(v[rng.integers(0, v.size, size=(n_boot, v.size))], axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    med = float(np.median(v))
    return float((hi - lo) / 2 / abs(med)) if med else float("inf")


def stop_reason(j_per_token: np.ndarray, elapsed_s: float, s: SweepSettings) -> str | None:
    """Why measuring this level can stop now, or None to go on."""
    n = int(np.isfinite(np.asarray(j_per_token, dtype=float)).sum())
    if n >= s.max_requests:
        return "max-requests"
    if elapsed_s >= s.max_time_s and n >= 2:
        return "max-time"
    if n >= s.min_requests and median_ci_halfwidth_frac(j_per_token) <= s.target_ci:
        return "ci-reached"
    return None


def level_sample_stats(samples: list[Sample], t0_ns: int, t1_ns: int) -> dict:
    """What the sensors said during a level's measured span: clocks, power and clock-event reasons."""
    sm, mem, pw, reasons, temps = [], [], [], 0, []
    for s in samples:
        if s.source != "nvml" or s.data is None or not t0_ns <= s.t_mono_ns <= t1_ns:
            continue
        for r in s.data:
            if r.sm_clock_mhz is not None:
                sm.append(r.sm_clock_mhz)
            if r.mem_clock_mhz is not None:
                mem.append(r.mem_clock_mhz)
            p = r.power_w if r.power_w is not None else r.power_avg_w
            if p is not None:
                pw.append(p)
            if r.clock_event_reasons is not None:
                reasons |= r.clock_event_reasons
            if r.temperature_c is not None:
                temps.append(r.temperature_c)
    med = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
    return {
        "sm_clock_mhz": med(sm),
        "mem_clock_mhz": med(mem),
        "sample_power_w": med(pw),
        "reasons": reasons,
        "max_temperature_c": max(temps) if temps else None,
        "n_samples": len(sm),
    }


def cap_not_engaged(avg_power_w: float | None, limit_w: float | None, reasons: int, n_gpus: int = 1) -> bool:
    """A cap that never bound: power well under it and the driver never reported SwPowerCap."""
    if avg_power_w is None or limit_w is None:
        return False
    return (avg_power_w / max(n_gpus, 1)) < CAP_ENGAGED_FRACTION * limit_w and not (reasons & REASON_SW_POWER_CAP)


class SampleLog:
    """Keeps every Sample of the run (subscriber); the sweep writes them to samples.parquet."""

    def __init__(self):
        self._lock = threading.Lock()
        self.samples: list[Sample] = []
        self.levels: list[tuple[int, str | None, float | None]] = []  # (t_mono_ns, kind, value)

    def __call__(self, s: Sample) -> None:
        with self._lock:
            self.samples.append(s)

    def snapshot(self) -> list[Sample]:
        with self._lock:
            return list(self.samples)

    def set_level(self, kind: str | None, value: float | None, t_ns: int) -> None:
        with self._lock:
            self.levels.append((t_ns, kind, value))

    def level_at(self, t_ns: int) -> tuple[str | None, float | None]:
        kind, value = None, None
        for t, k, v in self.levels:
            if t <= t_ns:
                kind, value = k, v
            else:
                break
        return kind, value
