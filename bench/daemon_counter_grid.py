"""Bench: how many of a daemon's counter reads it takes to find the simulated H200's 100 ms refresh grid.

The daemon's read pattern on one GPU, on a virtual clock: a 1 Hz tick (a few ms of jitter) and, per short request
(0.02 s prefill, 0.15 s decode, then idle; arrivals Poisson, one every `gap` s on average), counter reads at its
arrival, first token and end + END_EDGE_DELAY_S, each 0.5-5 ms after its event, those whose event comes under
EDGE_SPACE_S after the last read's skipped (as the daemon spaces them on an H200: mostly the arrival's alone). The counter is the simulator's
(powerprof/sim/gpu.py `counter_energy_j`: the true energy as of the last multiple of 100 ms of its clock, whose phase
against the reads is random per seed). Prints, per number of reads, how often one estimate (energy.
counter_refresh_grid, the profiler's, and counter_grid_from_pairs, the daemon's, on the latest GRID_READS reads) is
right (period and phase within GRID_AGREE_NS), wrong, or none;
then, for the ledger's CounterGridWatch, the reads at which its grid came into force and whether a wrong grid ever was
in force; and the cost of one estimate (docs/daemon.md, "Short sampling intervals are only as good as the counter's
refresh").

    PYTHONPATH=. .venv/bin/python bench/daemon_counter_grid.py [seeds [gap_s [refresh_s]]]
"""
import dataclasses
import sys
import time

import numpy as np

from powerprof.daemon.ledger import DAEMON_GRID_MIN_PAIRS, GRID_AGREE_NS, CounterGridWatch, grids_agree
from powerprof.daemon.service import END_EDGE_DELAY_S
from powerprof.energy import GRID_MARGIN, GRID_READS, counter_grid_from_pairs, counter_refresh_grid
from powerprof.sim.gpu import IDLE, Phase, SimGpu
from powerprof.sim.profiles import get_profile

S = 1_000_000_000
# The daemon spaces edge reads to spend at most attribution.edge_cpu_share (1%) of a core: ~2.6 ms a read on one
# (simulated or real) H200 spaces them ~0.26 s apart, so a lone 0.17 s request gets its arrival's read alone.
EDGE_SPACE_S = 0.26


def daemon_reads(seed: int, n_reads: int, gap_s: float = 2.0, refresh_s: float = 0.1, space_s: float = EDGE_SPACE_S):
    """(read ns, counter J) in read order, and the true grid (period, phase) in the reads' clock. An edge read comes
    only where the last one's event is space_s back (the daemon's spacing, `Daemon._request_edge`)."""
    rng = np.random.default_rng(seed)
    offset_ns = int(rng.integers(0, int(refresh_s * S)))  # the simulator's clock against the host's
    now = [0]
    prof = dataclasses.replace(get_profile("h200-141g"), energy_counter_update_s=refresh_s)
    gpu = SimGpu(prof, 0, "GPU-grid", clock_ns=lambda: now[0] + offset_ns)
    events = []  # (t_s, kind)
    t, k = rng.uniform(0, gap_s), 0
    while len(events) < 8 * n_reads:  # most edge reads are spaced out: enough events for n_reads reads
        events.append((k + rng.uniform(0, 0.003), "read", 0.0))
        k += 1
        while t < k:
            # (when read, what, the event's instant: where the spacing is judged)
            events += [(t, "prefill", t), (t + rng.uniform(0.0005, 0.005), "edge", t), (t + 0.02, "decode", t),
                       (t + 0.02 + rng.uniform(0.0005, 0.005), "edge", t + 0.02), (t + 0.17, "idle", t),
                       (t + 0.17 + END_EDGE_DELAY_S + rng.uniform(0.0005, 0.005), "edge", t + 0.17)]
            t += rng.exponential(gap_s) + 0.17
    reads, last_edge_s = [], -1.0
    for at, kind, event_s in sorted(events):
        now[0] = int(at * S)
        if kind in ("read", "edge"):
            if kind == "edge":
                if event_s - last_edge_s < space_s:
                    continue
                last_edge_s = event_s
            reads.append((now[0], gpu.counter_energy_j()))
            if len(reads) == n_reads:
                break
        else:
            gpu.set_phase({"prefill": Phase("prefill", 0.9), "decode": Phase("decode", 0.45), "idle": IDLE}[kind])
    period = int(refresh_s * S)
    return reads, (period, (-offset_ns) % period)


def _verdict(est, truth) -> int:
    """0 right (period, and phase within GRID_AGREE_NS), 1 wrong, 2 no grid."""
    return 0 if grids_agree(est, truth) else 2 if not est[0] else 1


def main(seeds: int = 10, gap_s: float = 2.0, refresh_s: float = 0.1) -> None:
    ns = (256, 500, 1000, 1500, 2000, 3000, 4000)
    print(f"refresh {refresh_s * 1e3:.0f} ms; one request every {gap_s} s on average; {seeds} seeds; right: the "
          f"period, and the phase within {GRID_AGREE_NS / 1e6:.0f} ms")
    estimators = {f"profiler's (counter_refresh_grid, margin {GRID_MARGIN})":
                  lambda t, e: counter_refresh_grid(t, e, GRID_MARGIN),
                  f"daemon's (counter_grid_from_pairs, {DAEMON_GRID_MIN_PAIRS} pairs)":
                  lambda t, e: counter_grid_from_pairs(t, e, DAEMON_GRID_MIN_PAIRS)}
    tally = {(name, n): [0, 0, 0] for name in estimators for n in ns}  # right, wrong, none
    into_force, wrong_in_force, bands = [], 0, []
    for seed in range(seeds):
        reads, truth = daemon_reads(seed, max(ns), gap_s, refresh_s)
        t = np.array([r[0] for r in reads], dtype=np.int64)
        e = np.array([r[1] for r in reads])
        for name, estimate in estimators.items():
            for n in ns:
                lo = max(0, n - GRID_READS)
                tally[(name, n)][_verdict(estimate(t[lo:n], e[lo:n]), truth)] += 1
        w, first = CounterGridWatch(), None
        for i, (tr, er) in enumerate(reads):
            w.add(tr, er, 0)
            if w.due():
                w.estimate()
                if w.grid[0] and not grids_agree(w.grid, truth):
                    wrong_in_force += 1
                if w.grid[0] and first is None:
                    first = i + 1
                if w.grid[0]:
                    bands.append(w.grid[2] / 1e6)
        into_force.append(first)
    for name in estimators:
        print(" ", name + ": reads right/wrong/none")
        print("   ", "; ".join(f"{n}: {'/'.join(map(str, tally[(name, n)]))}" for n in ns))
    print(f"  CounterGridWatch (estimates from {CounterGridWatch().min_reads} reads on): grid in force from read "
          f"{into_force}; a wrong grid in force at {wrong_in_force} estimates; phase bands "
          f"{min(bands, default=0):.1f}-{max(bands, default=0):.1f} ms")


def cost() -> None:
    rng = np.random.default_rng(0)
    tt = np.sort(rng.uniform(0, 20, GRID_READS) * S).astype(np.int64)  # reads 10 ms apart: every pair judged
    ee = np.cumsum(rng.uniform(0, 1, tt.size))
    took = []
    for _ in range(5):
        a = time.perf_counter()
        counter_grid_from_pairs(tt, ee, DAEMON_GRID_MIN_PAIRS)
        took.append(time.perf_counter() - a)
    print(f"one daemon estimate from {GRID_READS} reads: {1e3 * min(took):.0f}-{1e3 * max(took):.0f} ms")


if __name__ == "__main__":
    args = [float(a) for a in sys.argv[1:]]
    seeds = int(args[0]) if args else 10
    for refresh in ([args[2]] if len(args) > 2 else (0.1, 0.05, 0.02, 0.01)):
        for gap in ([args[1]] if len(args) > 1 else (0.5, 2.0, 10.0)):
            main(seeds, gap, refresh)
    cost()
