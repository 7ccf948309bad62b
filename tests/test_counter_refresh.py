"""The counter's refresh grid estimated from a run's reads, and decode-window energy with each read dated at its
value's own refresh, against the simulator's grid and true energy (bench/window_accuracy.py --steps's harness)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

import powerprof.profiler as prof
from powerprof import energy
from powerprof.profiler import METHOD_COUNTER
from powerprof.sim.profiles import get_profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import window_accuracy as wa  # noqa: E402


def _run(card: str, delay_s: float):
    p = get_profile(card)
    rs = (delay_s, delay_s + 0.001)
    run = wa.simulate_steps(p, [3.0], 40, 1.0, 1, p.default_limit_w, edge_read_s=(rs, rs))
    reads = run[1]
    t = np.array([s.data[0].energy_t_mono_ns or s.t_mono_ns for s in reads], dtype=np.int64)
    e = np.array([s.data[0].energy_j for s in reads], float)
    return p, run, t, e


@pytest.mark.parametrize("card", ["seed-16g", "h200-141g"])
def test_refresh_grid_found_from_the_reads(card):
    p, _, t, e = _run(card, 0.02)
    period_ns, phase_ns = energy.counter_refresh_grid(t, e)
    true_ns = int(round(p.energy_counter_update_s * 1e9))
    assert period_ns == true_ns
    # The simulator refreshes at multiples of the period on its clock: phase 0, within the 1 ms step.
    assert min(phase_ns % true_ns, true_ns - phase_ns % true_ns) <= energy.GRID_STEP_NS


def test_too_few_reads_give_no_grid():
    assert energy.counter_refresh_grid(np.arange(5) * 10**9, np.arange(5.0)) == (0, 0)


@pytest.mark.parametrize("card", ["seed-16g", "h200-141g"])
def test_gridded_windows_unbiased_with_late_reads(card, monkeypatch):
    # Today (no grid): seed-16g 3 s windows, reads 60 ms late: -1.16% pooled J/token (the end edge's straight line);
    # h200-141g: +0.19 to +0.46% (reads up to a 100 ms refresh old). With the estimated grid: within 0.01%.
    _, (windows, reads, edge_at, truth, c), t, e = _run(card, 0.06)
    period_ns, phase_ns = energy.counter_refresh_grid(t, e)
    monkeypatch.setattr(prof, "counter_window_energy_j",
                        functools.partial(energy.counter_window_energy_j, period_ns=period_ns, phase_ns=phase_ns))
    _, pooled, _ = wa.step_window_errors(windows, reads, edge_at, truth, c)
    assert abs(pooled[(METHOD_COUNTER, 3.0)]) < 0.1, pooled
