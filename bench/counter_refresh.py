"""Bench: decode-window counter energy as a running profiler's `EnergyTimeline` gives it, with and without the
counter's refresh grid it estimates from its reads so far (energy.counter_refresh_grid, profiler.GRID_MIN_READS),
on bench/window_accuracy.py --steps's harness: both edge reads delayed by d, 150 windows per length, pooled J/token %
and p95 |error| %, against the simulator's true energy. One timeline is fed the run's reads in order and asked for
each window when its end edge's read came (as the profiler's edge thread asks), so the run's first windows have no
grid yet (docs/benchmarks.md, "Energy windows at power steps, on a loaded host").

    PYTHONPATH=. .venv/bin/python bench/counter_refresh.py [seed ...]
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import window_accuracy as wa
import numpy as np
import powerprof.profiler as prof
from powerprof.profiler import METHOD_COUNTER, EnergyTimeline
from powerprof.sim.profiles import get_profile


def running_window_errors(windows, reads, edge_at, truth, card, grid: bool):
    """Per length: each window's signed error (%) and the pooled error (%), from one timeline fed in time order."""
    asks = sorted((edge_at[(L, i, 1)], L, i) for L, ws in windows.items() for i in range(len(ws)))
    min_reads = prof.GRID_MIN_READS
    prof.GRID_MIN_READS = min_reads if grid else 1 << 62
    try:
        tl = EnergyTimeline(1, (card[0],))
        errs = {L: [] for L in windows}
        sums = {L: [0.0, 0.0] for L in windows}
        fed = 0
        for at, L, i in asks:
            for s in reads[fed:at + 1]:
                tl.add(s)
            fed = at + 1
            a, b = windows[L][i]
            r = tl.energy_between(a, b)
            assert r.gpu_methods == (METHOD_COUNTER,), r.gpu_methods
            got, true = r.gpu_energy_j[0], truth[(L, i)]
            errs[L].append(100.0 * (got - true) / true)
            sums[L][0] += got
            sums[L][1] += true
        return {L: np.asarray(v) for L, v in errs.items()}, {L: 100.0 * (g / t - 1) for L, (g, t) in sums.items()}, tl
    finally:
        prof.GRID_MIN_READS = min_reads


def main(seeds):
    for seed in seeds:
        for card in ("seed-16g", "h200-141g"):
            p = get_profile(card)
            for d in (0.0, 0.005, 0.02, 0.06):
                rs = (d, d + 0.001) if d else wa.EDGE_READ_S
                run = wa.simulate_steps(p, [1.0, 3.0], 150, 1.0, seed, p.default_limit_w, edge_read_s=(rs, rs))
                cells = []
                for grid in (False, True):
                    errs, pooled, tl = running_window_errors(*run, grid=grid)
                    cells.append(" ".join(f"{L:g}s {pooled[L]:+.2f} p95 {np.percentile(np.abs(errs[L]), 95):.2f}"
                                          for L in (1.0, 3.0)))
                (R, phi), n = tl._grid[0]
                print(f"seed {seed} {card} {d * 1e3:g} ms grid {R / 1e6:g}/{phi / 1e6:g} ms from {n} reads |",
                      cells[0], "->", cells[1], flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1])
