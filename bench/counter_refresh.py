"""Bench: decode-window counter energy with the refresh grid estimated from the reads (energy.counter_refresh_grid)
against the straight-line/start-placement figure today, on bench/window_accuracy.py --steps's harness: both edge reads
delayed by d, 150 windows per length, pooled J/token % and p95 |error| %, against the simulator's true energy.
The grid is estimated once from the whole run's reads (as a running profiler's timeline holds them); the profiler
does not use it yet (docs/benchmarks.md, "Energy windows at power steps, on a loaded host").

    PYTHONPATH=. .venv/bin/python bench/counter_refresh.py
"""
import functools
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import window_accuracy as wa
import numpy as np
import powerprof.profiler as prof
from powerprof import energy as en
from powerprof.sim.profiles import get_profile
from powerprof.profiler import METHOD_COUNTER
orig = en.counter_window_energy_j
for card in ("seed-16g", "h200-141g"):
    p = get_profile(card)
    for d in (0.0, 0.005, 0.02, 0.06):
        rs = (d, d + 0.001) if d else wa.EDGE_READ_S
        windows, reads, edge_at, truth, c = wa.simulate_steps(p, [1.0, 3.0], 150, 1.0, 1, p.default_limit_w, edge_read_s=(rs, rs))
        t = np.array([s.data[0].energy_t_mono_ns or s.t_mono_ns for s in reads], dtype=np.int64)
        e = np.array([s.data[0].energy_j for s in reads], float)
        R, phi = en.counter_refresh_grid(t, e)
        cells = []
        for f in (orig, functools.partial(orig, period_ns=R, phase_ns=phi)):
            prof.counter_window_energy_j = f
            errs, pooled, _ = wa.step_window_errors(windows, reads, edge_at, truth, c)
            cells.append(" ".join(f"{L:g}s {pooled[(METHOD_COUNTER, L)]:+.2f} p95 {np.percentile(np.abs(errs[(METHOD_COUNTER, L)]),95):.2f}" for L in (1.0, 3.0)))
        print(card, f"{d*1e3:g} ms grid {R/1e6:g}/{phi/1e6:g} ms |", cells[0], "->", cells[1], flush=True)
