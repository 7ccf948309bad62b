"""Cost of one sampler tick with 8 simulated GPUs, RAPL (2 sockets + DRAM) and host: prints figures.

Usage: python bench/sampler_cost.py [--ticks 300] [--seconds 4]

1. Direct reads: every collector's read() once per tick, wall and CPU time, per source and total.
2. The real Sampler at 50 Hz for a few seconds: process CPU time per tick including thread wake-ups,
   and what that means as CPU % at the default 1 Hz.
3. RAPL backends side by side: sysfs (reopen per read) vs pyRAPL (files kept open).
4. The daemon's short-request edges: the energy counters alone vs a full NVML read.

The simulated NVML answers from Python, so its cost is not a real driver's (a real NVML call is a
few to tens of microseconds); the RAPL and host reads are the real file and psutil work.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from powerprof.collectors.host import HostCollector
from powerprof.collectors.nvml import NvmlCollector
from powerprof.collectors.rapl import RaplCollector
from powerprof.collectors.sampler import Sampler
from powerprof.sim.nvml import SimNVML
from powerprof.sim.powercap import SimPowercap


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def direct(collectors, ticks):
    per = {c.source: [] for c in collectors}
    total_wall, total_cpu = [], []
    for _ in range(ticks):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for c in collectors:
            t = time.perf_counter_ns()
            c.read()
            per[c.source].append((time.perf_counter_ns() - t) / 1e3)
        total_wall.append((time.perf_counter_ns() - w0) / 1e3)
        total_cpu.append((time.thread_time_ns() - c0) / 1e3)
    return per, total_wall, total_cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pc = SimPowercap(tmp, sockets=2, dram=True)
        nvml = SimNVML("h200-141g", count=8, state_path=None)
        gpus = NvmlCollector(nvml)
        rapl = RaplCollector(tmp)
        host = HostCollector()
        collectors = [gpus, rapl, host]
        direct(collectors, 20)  # warm caches and imports
        per, wall, cpu = direct(collectors, args.ticks)
        print(f"direct reads, {args.ticks} ticks: 8 simulated GPUs + RAPL ({len(rapl.zones)} zones) + host")
        for src, xs in per.items():
            print(f"  {src:5s} median {statistics.median(xs):8.1f} us   p99 {pct(xs, 99):8.1f} us")
        print(f"  tick  median {statistics.median(wall):8.1f} us   p99 {pct(wall, 99):8.1f} us  (wall)")
        print(f"  tick  median {statistics.median(cpu):8.1f} us   p99 {pct(cpu, 99):8.1f} us  (CPU)")
        print(f"  => CPU at 1 Hz: {statistics.median(cpu) / 1e6 * 100:.3f} %")

        s = Sampler(collectors, interval_s=0.02)
        c0, w0 = time.process_time(), time.monotonic()
        with s:
            time.sleep(args.seconds)
        c1, w1 = time.process_time(), time.monotonic()
        ticks = (w1 - w0) / 0.02
        cpu_per_tick_us = (c1 - c0) / ticks * 1e6
        print(f"Sampler at 50 Hz for {args.seconds:g} s: {cpu_per_tick_us:.0f} us CPU per tick (all threads), "
              f"missed {sum(s.missed.values())}, errors {sum(s.errors.values())}")
        print(f"  => CPU at 1 Hz: {cpu_per_tick_us / 1e6 * 100:.3f} %   at 50 Hz: {cpu_per_tick_us * 50 / 1e6 * 100:.1f} %")

        pyr = RaplCollector(tmp, backend="pyrapl")
        a = [direct([rapl], 1)[1][0] for _ in range(args.ticks)]
        b = [direct([pyr], 1)[1][0] for _ in range(args.ticks)]
        print(f"RAPL read, {len(rapl.zones)} zones: sysfs median {statistics.median(a):.1f} us, "
              f"pyrapl median {statistics.median(b):.1f} us (ratio {statistics.median(a) / statistics.median(b):.2f})")
        pyr.close()
        pc.close()

        # 4. The daemon's short-request edges: the energy counters alone against a full NVML read,
        # both on one GPU and on the 8, and as the daemon takes them (under the sampler's lock).
        one = NvmlCollector(SimNVML("h200-141g", count=1, state_path=None))
        for name, col in (("1 GPU", one), ("8 GPUs", gpus)):
            full = _median_us(col.read, args.ticks)
            alone = _median_us(col.read_energy_j, args.ticks)
            print(f"edge read, {name}: counters alone median {alone:.1f} us, full read median {full:.1f} us "
                  f"(ratio {full / alone:.1f}); at the 20/s cap: {alone * 20 / 1e6 * 100:.3f} % of a core; "
                  f"under the daemon's 1% CPU budget: {min(20.0, 0.01 / (alone / 1e6)):.2f} reads/s")
        s = Sampler([one], interval_s=1.0)
        with s:
            locked = _median_us(lambda: s.read_with("nvml", one.read_energy_j), args.ticks)
        print(f"edge read as the daemon takes it (sampler lock, 1 GPU): median {locked:.1f} us")


def _median_us(fn, n: int) -> float:
    fn()
    xs = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        xs.append((time.perf_counter_ns() - t) / 1e3)
    return statistics.median(xs)


if __name__ == "__main__":
    main()
