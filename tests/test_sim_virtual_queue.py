"""The virtual server's queue figures (what the daemon's proxy would count) against the requests' own times."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.sim.profiles import get_profile
from powerprof.sim.virtual import VirtualServer
from powerprof.workload.trace import synthetic


def _overlap_s(start, end, t0, t1) -> float:
    """Σ over requests of the time each spent in [start, end) within [t0, t1]: the truth, request by request."""
    return float(np.clip(np.minimum(end, t1) - np.maximum(start, t0), 0, None).sum())


def test_each_ticks_in_flight_and_awaiting_integrals_match_the_requests_own_times():
    # 1.5 req/s: 150 W falls far behind (a queue of hundreds), 300 W keeps up; the level changes half-way.
    tr = synthetic(1800, 1.5, prompt_median=400, output_median=80, seed=3)
    arr = np.array([r.t_s for r in tr])
    prompt = np.array([r.prompt_tokens for r in tr])
    output = np.array([r.output_tokens for r in tr])
    ticks = []

    def control(tk):
        ticks.append(tk)
        return 150.0 if tk.t_end_s < 900 else 300.0

    r = VirtualServer(get_profile("seed-16g"), [150, 300]).run(arr, prompt, output, control, 300.0)
    assert len(ticks) > 100
    for tk in ticks:
        assert tk.in_flight_s == pytest.approx(_overlap_s(r.arrival_s, r.last_s, tk.t_start_s, tk.t_end_s), abs=1e-6)
        assert tk.awaiting_s == pytest.approx(_overlap_s(r.arrival_s, r.first_s, tk.t_start_s, tk.t_end_s), abs=1e-6)
    mean = [tk.in_flight_s / (tk.t_end_s - tk.t_start_s) for tk in ticks]
    # The figures follow the queue: hundreds in flight once 150 W has fallen behind, few once 300 W has drained it.
    assert max(mean) > 100 and mean[-1] < 0.05 * max(mean)
    assert all(tk.awaiting_s <= tk.in_flight_s + 1e-9 for tk in ticks)
