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

`--steps` measures decode windows at power steps instead, as a sweep at concurrency 1 has them: idle, a
prefill, then decode from the first token to the last and idle again, at each `--levels` power limit; each
edge is read 1-4 ms after its event (the profiler's edge thread), and the sampler ticks between. The
window is the event's own instants, so the end read already sees idle power. Per level and length: the
per-window error and the pooled J/token's (energy summed over windows against true energy summed):

    .venv/bin/python bench/window_accuracy.py --steps --profile a100-40g --levels 250 400 \
        [--lengths 0.3 1 3 10] [--windows 200]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import time

import numpy as np

from powerprof.collectors.nvml import NvmlCollector
from powerprof.collectors.sampler import Sample
from powerprof.profiler import LOW_CONFIDENCE_S, METHOD_AVG_POWER, METHOD_COUNTER, METHOD_NONE, METHOD_POWER, EnergyTimeline
from powerprof.sim.gpu import IDLE, Phase
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


def methods_for(avg_window_s: float, has_counter: bool = True):
    """The methods a card offers: without an averaging window (GA100 and older) nvmlDeviceGetPowerUsage is
    instant power, so there is no average to integrate, and instant power is either reading (the field, or
    nvmlDeviceGetPowerUsage where the field is missing); without a counter, no counter."""
    if avg_window_s > 0:
        out = METHODS
    else:
        out = (METHODS[0], (METHOD_POWER, {"energy_j": None}))
    return out if has_counter else out[1:]


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
    collector = NvmlCollector(nvml, [0], clock_ns=clock)  # its counter reads dated on the virtual clock
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
    methods = methods_for(avg_window_s)
    errs = {(m, L): [] for m, _ in methods for L in windows}
    flagged = {L: [] for L in windows}
    for L, ws in windows.items():
        for i, (a, b) in enumerate(ws):
            e0, e1 = edges[(L, i, 0)], edges[(L, i, 1)]
            true_j = truth[(L, i, 1)] - truth[(L, i, 0)]
            # What a running profiler's timeline holds when the window closes: earlier ticks,
            # the ticks inside, and the two edge reads; nothing after the end.
            lo, hi = bisect.bisect_left(tick_t, a - LEAD_NS), bisect.bisect_right(tick_t, b)
            for method, drop in methods:
                tl = EnergyTimeline(1, (avg_window_s,))
                for s in (*ticks[lo:hi], e0, e1):
                    tl.add(withheld(s, drop))
                r = tl.energy_between(e0.t_mono_ns, e1.t_mono_ns)
                assert r.gpu_methods == (method,), (method, r.gpu_methods)
                errs[(method, L)].append(100.0 * (r.gpu_energy_j[0] - true_j) / true_j)
                if method == METHOD_COUNTER:
                    flagged[L].append(r.low_confidence)
    return {k: np.asarray(v) for k, v in errs.items()}, {L: 100.0 * np.mean(f) for L, f in flagged.items()}


# --- decode windows at power steps (--steps) ---------------------------------------------------------

EDGE_READ_S = (0.001, 0.004)  # an edge's read lands this long after its event (the profiler's edge thread)
IDLE_GAP_S = (0.05, 1.0)  # between one request's end and the next one's prefill
PREFILL_S = (0.02, 0.2)


def simulate_steps(profile, lengths_s, n_windows: int, interval_s: float, seed: int, limit_w: float,
                   edge_read_s=(EDGE_READ_S, EDGE_READ_S)):
    """Requests one at a time at the power limit `limit_w`: idle, prefill, decode for about L s from the first
    token to the last, idle again. Returns {L: [(t_first, t_last)]}, every read in time order (Sample), the
    first and last token's edge reads per window, the true energy of each window and the averaging window.
    edge_read_s: (start, end), each the (low, high) range its read lands after its event (a loaded host's delay)."""
    rng = np.random.default_rng(seed)
    clock = VirtualClock(T_START_NS)
    nvml = SimNVML(profile, count=1, clock_ns=clock, state_path=None, record_history=True)
    gpu = nvml.gpus[0]
    gpu.set_limit_w(limit_w)
    collector = NvmlCollector(nvml, [0], clock_ns=clock)  # its counter reads dated on the virtual clock
    wl = nvml.profile.workload
    decode = Phase("decode", wl.decode_compute_share)
    prefill = Phase("prefill", PREFILL_COMPUTE_SHARE)
    jitter_s = nvml.profile.energy_counter_update_s
    events = []  # (t_ns, order, what): phase changes (0) before reads (1) at one instant
    windows: dict[float, list[tuple[int, int]]] = {}
    t = T_START_NS + LEAD_NS + int(rng.uniform(0, 1e9))
    for L in lengths_s:
        ws = []
        for i in range(n_windows):
            t += int(rng.uniform(*IDLE_GAP_S) * 1e9)
            events.append((t, 0, prefill))
            t_first = t + int(rng.uniform(*PREFILL_S) * 1e9)
            t_last = t_first + int((L + rng.uniform(-jitter_s / 2, jitter_s / 2)) * 1e9)
            events += [(t_first, 0, decode), (t_last, 0, IDLE)]
            for k, at in enumerate((t_first, t_last)):
                events.append((at + int(rng.uniform(*edge_read_s[k]) * 1e9), 1, ("edge", (L, i, k))))
            ws.append((t_first, t_last))
            t = t_last
        windows[L] = ws
    t_end = t + int(2 * interval_s * 1e9)
    period = int(interval_s * 1e9)
    events += [(T_START_NS + k * period, 1, ("tick", k)) for k in range((t_end - T_START_NS) // period + 1)]
    events.sort(key=lambda e: (e[0], e[1]))
    reads: list[Sample] = []
    edge_at: dict[tuple, int] = {}  # (L, i, k) -> index of its read in `reads`
    for t_ns, kind, what in events:
        clock.t_ns = t_ns
        if kind == 0:
            gpu.set_phase(what)
            continue
        tag, key = what
        reads.append(Sample("nvml", key if tag == "tick" else -1, t_ns, t_ns, collector.read(), None,
                            None if tag == "tick" else "edge"))
        if tag == "edge":
            edge_at[key] = len(reads) - 1
    truth = {(L, i): gpu.true_energy_at_j(b) - gpu.true_energy_at_j(a) for L, ws in windows.items() for i, (a, b) in enumerate(ws)}
    avg_window_s = collector.infos[0].power_avg_window_s
    collector.close()
    return windows, reads, edge_at, truth, (avg_window_s, profile.has_energy_counter)


def step_window_errors(windows, reads, edge_at, truth, card):
    """Per method and length: each window's signed error (%), the pooled error (%) of energy summed over the
    windows (J/token pooled over windows of equal tokens per second) against true energy summed, and the share
    of windows flagged low-confidence. card: (averaging window s, has a counter), as simulate_steps returns."""
    avg_window_s, has_counter = card
    read_t = [s.t_mono_ns for s in reads]
    methods = methods_for(avg_window_s, has_counter)
    errs = {(m, L): [] for m, _ in methods for L in windows}
    pooled = {}
    flagged = {(m, L): [] for m, _ in methods for L in windows}
    no_figure = step_window_errors.no_figure = {L: 0 for L in windows}
    for L, ws in windows.items():
        sums = {m: [0.0, 0.0] for m, _ in methods}
        for i, (a, b) in enumerate(ws):
            # What the profiler's timeline holds when the window's energy is asked: every read up to the end
            # edge's (earlier requests' edges and the ticks included), none after.
            lo = bisect.bisect_left(read_t, a - LEAD_NS)
            hi = edge_at[(L, i, 1)] + 1
            true_j = truth[(L, i)]
            for method, drop in methods:
                tl = EnergyTimeline(1, (avg_window_s,))
                for s in reads[lo:hi]:
                    tl.add(withheld(s, drop))
                r = tl.energy_between(a, b)
                # The counter's column is what a card with a counter stores: a window shorter than its refresh
                # carries no figure (profiler.COUNTER_REFRESH_MAX_NS), counted in `no_figure`, out of the errors.
                if method == METHOD_COUNTER and r.gpu_methods == (METHOD_NONE,):
                    no_figure[L] += 1
                    continue
                assert r.gpu_methods == (method,), (method, r.gpu_methods)
                errs[(method, L)].append(100.0 * (r.gpu_energy_j[0] - true_j) / true_j)
                flagged[(method, L)].append(r.low_confidence)
                sums[method][0] += r.gpu_energy_j[0]
                sums[method][1] += true_j
        for m, (got, true) in sums.items():
            pooled[(m, L)] = 100.0 * (got / true - 1) if true > 0 else float("nan")
    return ({k: np.asarray(v) for k, v in errs.items()}, pooled,
            {k: 100.0 * np.mean(v) if v else float("nan") for k, v in flagged.items()})


def main_steps(args, profile) -> None:
    lengths = args.lengths if args.lengths_given else STEP_LENGTHS_S
    levels = args.levels or [profile.default_limit_w]
    w0 = time.perf_counter()
    print(f"profile {args.profile}{'' if profile.has_energy_counter else ' without its counter'}, decode windows "
          f"at power steps, {args.windows} windows per length and level, instant power refreshed "
          f"{'at every read' if profile.instant_power_update_s <= 0 else f'every {profile.instant_power_update_s * 1e3:g} ms'}, "
          f"ticks every {args.interval} s, edge reads {EDGE_READ_S[0] * 1e3:g}-{EDGE_READ_S[1] * 1e3:g} ms after "
          f"their events, idle gaps {IDLE_GAP_S[0]:g}-{IDLE_GAP_S[1]:g} s, prefill {PREFILL_S[0]:g}-{PREFILL_S[1]:g} s")
    print()
    print("error of window energy vs ground truth, % of true energy: median |error| / p95 |error| / pooled "
          "(energy summed over the windows against true energy summed: the pooled J/token's error); "
          "flagged: low_confidence share")
    print()
    head = None
    for level in levels:
        windows, reads, edge_at, truth, card = simulate_steps(profile, lengths, args.windows, args.interval,
                                                              args.seed, level)
        errs, pooled, flagged = step_window_errors(windows, reads, edge_at, truth, card)
        methods = methods_for(*card)
        if head is None:
            head = " | ".join(f"{LABELS[m]} median | p95 | pooled | flagged" for m, _ in methods)
            print(f"| limit | window | {head} |")
            print("|---:|---:|" + "---:|" * (4 * len(methods)))
        for L in lengths:
            cells = []
            for m, _ in methods:
                a = np.abs(errs[(m, L)])
                if not a.size:  # no window of this length has a figure by this method
                    cells += ["-"] * 4
                    continue
                cells += [f"{np.median(a):.2f}", f"{np.percentile(a, 95):.2f}", f"{pooled[(m, L)]:+.2f}",
                          f"{flagged[(m, L)]:.0f}%"]
            print(f"| {level:g} W | {L:g} s | " + " | ".join(cells) + " |")
        none = {L: n for L, n in step_window_errors.no_figure.items() if n}
        if none:
            print("(counter column at " + ", ".join(f"{L:g} s: {n} of {args.windows} windows" for L, n in none.items())
                  + f" without a figure, shorter than the counter's refresh, left out; {level:g} W)")
    print()
    print(f"({time.perf_counter() - w0:.1f} s wall)")


STEP_LENGTHS_S = (0.3, 1, 3, 10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=200, help="windows per length")
    ap.add_argument("--profile", default="seed-16g")
    ap.add_argument("--interval", type=float, default=1.0, help="sampler tick interval, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lengths", type=float, nargs="+", default=None,
                    help=f"window lengths, s (default {' '.join(map(str, LENGTHS_S))}; "
                         f"{' '.join(map(str, STEP_LENGTHS_S))} with --steps)")
    ap.add_argument("--steps", action="store_true", help="decode windows at power steps (see the module's doc)")
    ap.add_argument("--levels", type=float, nargs="+", default=None,
                    help="power limits, W, for --steps (default: the profile's default limit)")
    ap.add_argument(
        "--counter-update-s", type=float, default=None,
        help="override the profile's counter refresh period (field notes: 10-100 ms)",
    )
    ap.add_argument(
        "--instant-update-s", type=float, default=None,
        help="the driver refreshes instant power this often, a read showing it as of the last refresh "
             "(default: the profile's, 0: the power at the read; a real H200's changed every ~100 ms)",
    )
    ap.add_argument("--no-counter", action="store_true",
                    help="the card has no energy counter (pre-Volta, some vGPU/MIG setups): its rows are left out")
    args = ap.parse_args()
    args.lengths_given = args.lengths is not None
    args.lengths = args.lengths or list(LENGTHS_S)
    try:
        profile = get_profile(args.profile)
    except KeyError as e:
        ap.error(str(e.args[0]))
    if args.counter_update_s is not None:
        profile = dataclasses.replace(profile, energy_counter_update_s=args.counter_update_s)
    if args.instant_update_s is not None:
        profile = dataclasses.replace(profile, instant_power_update_s=args.instant_update_s)
    if args.no_counter:
        if not args.steps:
            ap.error("--no-counter goes with --steps (the load bench compares every method on one card)")
        profile = dataclasses.replace(profile, has_energy_counter=False)
    if args.steps:
        bad = [v for v in args.levels or () if not profile.min_limit_w <= v <= profile.max_limit_w]
        if bad:
            ap.error(f"--levels {' '.join(f'{v:g}' for v in bad)} W: outside {args.profile}'s "
                     f"{profile.min_limit_w:g}-{profile.max_limit_w:g} W")
        main_steps(args, profile)
        return
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
    methods = methods_for(avg_window_s)
    head = " | ".join(f"{LABELS[m]} median | p95 | bias" for m, _ in methods)
    print(f"| window | flagged (< {LOW_CONFIDENCE_S[METHOD_COUNTER]:g} s) | {head} |")
    print("|---:|:---:|" + "---:|" * (3 * len(methods)))
    for L in args.lengths:
        cells = []
        for m, _ in methods:
            e = errs[(m, L)]
            a = np.abs(e)
            cells += [f"{np.median(a):.2f}", f"{np.percentile(a, 95):.2f}", f"{e.mean():+.2f}"]
        print(f"| {L:g} s | {flagged[L]:.0f}% | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
