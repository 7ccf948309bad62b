"""Bench: energy error of a window against the simulator's ground truth, per method and length.

A simulated card (seed-16g by default: counter refreshed every 20 ms, 1 s trailing-average power)
runs a fluctuating server load: prefill / decode (batch 1-4) / idle phases switching at random
50-500 ms intervals. The sampler's 1 Hz ticks and each window's two edge reads go through the
real `NvmlCollector` into the real `EnergyTimeline`; `energy_between` computes the energy with
each of its three methods, the other sources withheld from the readings:

- counter:  nvmlDeviceGetTotalEnergyConsumption at the edges (what the profiler uses),
- power:    instant power at the ticks and edges, trapezoid (cards without a counter),
- avg power: nvmlDeviceGetPowerUsage (1 s trailing average) shifted by half its window, trapezoid.

The simulator's clock is a virtual one advanced here, so hours of load run in seconds. Every
window length runs its own sequence of windows with a random start relative to the ticks, all
on the same load trace, so the methods and lengths are compared on the same power history.

    .venv/bin/python bench/window_accuracy.py [--windows 200] [--profile seed-16g] [--seed 1]
        [--interval 1.0] [--counter-update-s 0.1] [--lengths 0.5 1 2 5 10 30 60]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import time

import numpy as np

from powerprof.collectors.nvml import NvmlCollector
from powerprof.collectors.sampler import Sample
from powerprof.profiler import LOW_CONFIDENCE_S, METHOD_AVG_POWER, METHOD_COUNTER, METHOD_POWER, EnergyTimeline
from powerprof.sim.gpu import Phase
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile
from powerprof.sim.server import PREFILL_COMPUTE_SHARE

LENGTHS_S = (0.5, 1, 2, 5, 10, 30, 60)
T_START_NS = 1_000_000_000_000  # arbitrary origin of the virtual monotonic clock
LEAD_NS = 2_000_000_000  # ticks before a window's start that the timeline already holds

# (method, what a reading withholds): the timeline falls back through profiler.ENERGY_METHODS
# (counter -> avg power -> instant power), so each method is selected by withholding the others.
METHODS = (
    (METHOD_COUNTER, {}),
    (METHOD_POWER, {"energy_j": None, "power_avg_w": None}),
    (METHOD_AVG_POWER, {"energy_j": None, "power_w": None}),
)
LABELS = {METHOD_COUNTER: "counter", METHOD_POWER: "instant power", METHOD_AVG_POWER: "1 s avg power"}


class VirtualClock:
    def __init__(self, t_ns: int):
        self.t_ns = t_ns

    def __call__(self) -> int:
        return self.t_ns


def load_phases(rng, t0_ns: int, t1_ns: int, decode_share: float, batch_growth: float):
    """(t_ns, Phase) changes of a server handling requests: mostly decode, some prefill and idle."""
    out = []
    t = t0_ns
    while t < t1_ns:
        kind = rng.choice(("decode", "prefill", "idle"), p=(0.65, 0.15, 0.20))
        if kind == "decode":
            b = int(rng.integers(1, 5))
            c_b = decode_share * (1.0 + batch_growth * (b - 1))
            ph = Phase("decode", c_b / ((1.0 - decode_share) + c_b))  # as the simulated server does
        elif kind == "prefill":
            ph = Phase("prefill", PREFILL_COMPUTE_SHARE)
        else:
            ph = Phase("idle", 0.0)
        out.append((t, ph))
        t += int(rng.uniform(0.05, 0.5) * 1e9)
    return out


def window_edges(rng, n: int, length_s: float, jitter_s: float) -> list[tuple[int, int]]:
    """n back-to-back windows, each after a random gap, so the start is random against the ticks.

    Every nominal length is a multiple of the simulated counter's refresh period, which would put
    both edges at the same offset from a refresh and cancel the counter's staleness whenever the
    power is equal at both ends; real windows last what the work takes, so the end is jittered
    by up to +-half a refresh period.
    """
    out = []
    t = T_START_NS + LEAD_NS + int(rng.uniform(0, 1e9))
    for _ in range(n):
        t1 = t + int((length_s + rng.uniform(-jitter_s / 2, jitter_s / 2)) * 1e9)
        out.append((t, t1))
        t = t1 + int(rng.uniform(0.1, 2.0) * 1e9)
    return out


def simulate(profile, lengths_s, n_windows: int, interval_s: float, seed: int):
    """Run the load and take every read in time order. Returns ticks, edge samples, truth, avg window."""
    rng = np.random.default_rng(seed)
    clock = VirtualClock(T_START_NS)
    nvml = SimNVML(profile, count=1, clock_ns=clock, state_path=None, record_history=True)
    gpu = nvml.gpus[0]
    collector = NvmlCollector(nvml, [0])
    wl = nvml.profile.workload
    jitter_s = nvml.profile.energy_counter_update_s
    windows = {L: window_edges(rng, n_windows, L, jitter_s) for L in lengths_s}
    t_end = max(w[-1][1] for w in windows.values()) + int(interval_s * 1e9)
    phases = load_phases(rng, T_START_NS, t_end, wl.decode_compute_share, wl.batch_compute_growth)
    period = int(interval_s * 1e9)
    # Events at one instant: phase change first (0), then reads (1).
    events = [(t, 0, ph) for t, ph in phases]
    events += [(T_START_NS + k * period, 1, ("tick", k)) for k in range((t_end - T_START_NS) // period + 1)]
    for L, ws in windows.items():
        for i, (a, b) in enumerate(ws):
            events += [(a, 1, ("edge", (L, i, 0))), (b, 1, ("edge", (L, i, 1)))]
    events.sort(key=lambda e: (e[0], e[1]))
    ticks: list[Sample] = []
    edges: dict[tuple, Sample] = {}
    truth: dict[tuple, float] = {}
    for t, kind, what in events:
        clock.t_ns = t
        if kind == 0:
            gpu.set_phase(what)
            continue
        tag, key = what
        s = Sample("nvml", key if tag == "tick" else -1, t, t, collector.read(), None, None if tag == "tick" else "edge")
        if tag == "tick":
            ticks.append(s)
        else:
            edges[key] = s
            truth[key] = gpu.true_energy_at_j(t)
    avg_window_s = collector.infos[0].power_avg_window_s
    collector.close()
    return windows, ticks, edges, truth, avg_window_s, len(phases)


def withheld(sample: Sample, drop: dict) -> Sample:
    if not drop:
        return sample
    return dataclasses.replace(sample, data=tuple(dataclasses.replace(r, **drop) for r in sample.data))


def window_errors(windows, ticks, edges, truth, avg_window_s):
    """Signed relative error (%) per method and length, and the share of windows flagged low-confidence."""
    tick_t = [s.t_mono_ns for s in ticks]
    errs = {(m, L): [] for m, _ in METHODS for L in windows}
    flagged = {L: [] for L in windows}
    for L, ws in windows.items():
        for i, (a, b) in enumerate(ws):
            e0, e1 = edges[(L, i, 0)], edges[(L, i, 1)]
            true_j = truth[(L, i, 1)] - truth[(L, i, 0)]
            # What a running profiler's timeline holds when the window closes: earlier ticks,
            # the ticks inside, and the two edge reads; nothing after the end.
            lo, hi = bisect.bisect_left(tick_t, a - LEAD_NS), bisect.bisect_right(tick_t, b)
            for method, drop in METHODS:
                tl = EnergyTimeline(1, (avg_window_s,))
                for s in (*ticks[lo:hi], e0, e1):
                    tl.add(withheld(s, drop))
                r = tl.energy_between(e0.t_mono_ns, e1.t_mono_ns)
                assert r.gpu_methods == (method,), (method, r.gpu_methods)
                errs[(method, L)].append(100.0 * (r.gpu_energy_j[0] - true_j) / true_j)
                if method == METHOD_COUNTER:
                    flagged[L].append(r.low_confidence)
    return {k: np.asarray(v) for k, v in errs.items()}, {L: 100.0 * np.mean(f) for L, f in flagged.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=200, help="windows per length")
    ap.add_argument("--profile", default="seed-16g")
    ap.add_argument("--interval", type=float, default=1.0, help="sampler tick interval, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lengths", type=float, nargs="+", default=LENGTHS_S, help="window lengths, s")
    ap.add_argument(
        "--counter-update-s", type=float, default=None,
        help="override the profile's counter refresh period (field notes: 10-100 ms)",
    )
    args = ap.parse_args()
    profile = get_profile(args.profile)
    if args.counter_update_s is not None:
        profile = dataclasses.replace(profile, energy_counter_update_s=args.counter_update_s)
    w0 = time.perf_counter()
    windows, ticks, edges, truth, avg_window_s, n_phases = simulate(profile, args.lengths, args.windows, args.interval, args.seed)
    w1 = time.perf_counter()
    errs, flagged = window_errors(windows, ticks, edges, truth, avg_window_s)
    w2 = time.perf_counter()
    virt_s = (ticks[-1].t_mono_ns - ticks[0].t_mono_ns) / 1e9
    true_w = (max(truth.values()) - min(truth.values())) / virt_s
    print(
        f"profile {args.profile}, counter refresh {profile.energy_counter_update_s * 1e3:g} ms, "
        f"{args.windows} windows per length, ticks every {args.interval} s, "
        f"avg-power window {avg_window_s} s; {virt_s:.0f} s of simulated load, {n_phases} phase changes, "
        f"mean {true_w:.0f} W; simulate {w1 - w0:.1f} s, evaluate {w2 - w1:.1f} s (wall)"
    )
    print()
    print("|error of window energy vs ground truth|: median / p95 / mean signed (bias), % of true energy")
    print()
    head = " | ".join(f"{LABELS[m]} median | p95 | bias" for m, _ in METHODS)
    print(f"| window | flagged (< {LOW_CONFIDENCE_S[METHOD_COUNTER]:g} s) | {head} |")
    print("|---:|:---:|" + "---:|" * (3 * len(METHODS)))
    for L in args.lengths:
        cells = []
        for m, _ in METHODS:
            e = errs[(m, L)]
            a = np.abs(e)
            cells += [f"{np.median(a):.2f}", f"{np.percentile(a, 95):.2f}", f"{e.mean():+.2f}"]
        print(f"| {L:g} s | {flagged[L]:.0f}% | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
