"""The tuner's bench pieces: the diurnal trace generator, the virtual-time server on the simulator's physics, and a short
closed-loop run (the acceptance figures come from bench/tuner_eval.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _tuner import evaluate  # noqa: E402
from tuner_eval import SLO  # noqa: E402

from powerprof.sim.profiles import get_profile  # noqa: E402
from powerprof.sim.virtual import VirtualServer, level_table  # noqa: E402
from powerprof.tuner.policy import TunerConfig  # noqa: E402
from powerprof.workload.trace import LengthMix, diurnal, synthetic  # noqa: E402


def test_diurnal_rate_follows_the_day_and_the_length_mix_shifts_when_told():
    day = 4000.0
    tr = diurnal(day, 2.0, amplitude=0.6, period_s=day, shift_at_s=day / 2, shift_mix=LengthMix(2000, 0.3, 300, 0.3),
                 seed=1)
    t = np.array([r.t_s for r in tr])
    night = ((t < day / 8) | (t > 7 * day / 8)).sum()
    noon = ((t > 3 * day / 8) & (t < 5 * day / 8)).sum()
    assert noon > 2.5 * night  # rate 0.8–3.2/s: the middle quarter carries far more than the two ends
    p = np.array([r.prompt_tokens for r in tr])
    assert np.median(p[t < day / 2 - 60]) < 600 < 1500 < np.median(p[t > day / 2 + 60])
    assert tr == diurnal(day, 2.0, amplitude=0.6, period_s=day, shift_at_s=day / 2,
                         shift_mix=LengthMix(2000, 0.3, 300, 0.3), seed=1)
    with pytest.raises(ValueError):
        diurnal(day, 2.0, amplitude=1.0)
    with pytest.raises(ValueError):
        diurnal(day, 2.0, shift_at_s=10.0)


@pytest.mark.parametrize("level, idle_w", [(1980, 120.6), (1400, 99.7), (900, 87.2)])
def test_the_virtual_server_idles_a_locked_card_at_what_simgpu_idles_it(level, idle_w):
    # An idle tick under a locked clock costs SimGpu's idle draw there (sim/gpu.py `_idle_held`). Before, 78 W at every
    # level: J/token at a level -0.0% (900 MHz) to -0.7% (a 1980 MHz lock) against the live simulated server's.
    p = get_profile("h200-141g")
    ticks = []
    vs = VirtualServer(p, [900, 1400, 1980], knob="clock")
    vs.run(np.array([35.0]), np.array([10]), np.array([2]), lambda tk: ticks.append(tk) or level, level)
    assert ticks[0].energy_j / (ticks[0].t_end_s - ticks[0].t_start_s) == pytest.approx(idle_w, abs=0.1)


def test_the_virtual_server_keeps_the_simulators_physics():
    p = get_profile("seed-16g")
    capped, free = level_table(p, 200), level_table(p, 300)
    s_cap, w_cap = capped.at(0.6)
    s_free, w_free = free.at(0.6)
    assert w_cap <= 200.5 and s_cap < s_free and w_cap < w_free
    tr = synthetic(400, 1.0, prompt_median=300, output_median=60, seed=2)
    a, pr, o = (np.array([getattr(r, k) for r in tr]) for k in ("t_s", "prompt_tokens", "output_tokens"))
    vs = VirtualServer(p, [200, 300])
    r200 = vs.run(a, pr, o, lambda tk: 200, 200)
    r300 = vs.run(a, pr, o, lambda tk: 300, 300)
    for r in (r200, r300):
        assert r.tokens == pytest.approx(o.sum())  # every token generated once
        assert np.all(r.first_s >= r.arrival_s) and np.all(r.last_s >= r.first_s)
    assert r200.j_per_token < r300.j_per_token  # the seed card's trade: less energy…
    assert np.nanmedian(r200.tpot_s) > np.nanmedian(r300.tpot_s)  # …for slower tokens
    # Idle energy between requests is counted: the whole run never draws less than idle power.
    assert r300.energy_j >= p.idle_power_w * r300.duration_s


def test_closed_loop_tuner_saves_energy_with_only_allowed_levels():
    cfg = TunerConfig(levels=(150, 200, 250, 300), reference=300, **SLO)  # the bench's SLO for this card
    tr = synthetic(3600, 1.0, prompt_median=400, output_median=80, seed=5)
    res = evaluate("seed-16g", tr, cfg, 300, statics=False)
    t, d = res["tuner"], res["default"]
    assert t.j_per_token < 0.95 * d.j_per_token
    assert set(t.level_time_s) <= set(cfg.levels)
    assert t.explore_s > 0 and any(x.action == "explore" for x in t.decisions)


def test_best_pair_takes_the_cheapest_static_level_per_half_that_keeps_the_slo_windows():
    from _tuner import Outcome, best_pair

    def o(bad, before, after):  # bad windows (start s); (energy J, tokens) per half
        return Outcome("x", 0.0, 0.0, 0.0, duration_s=6000.0, bad=bad, halves=(before, after))

    static = {150: o([600.0, 4200.0], (80.0, 100.0), (90.0, 100.0)),  # cheapest, but breaks the SLO in both halves
              200: o([4500.0], (90.0, 100.0), (95.0, 100.0)),  # fine before 3000 s only
              300: o([], (100.0, 100.0), (110.0, 100.0))}
    lo, hi, j = best_pair(static, static[300], 3000.0)
    assert (lo, hi) == (200, 300) and j == pytest.approx((90 + 110) / 200)


def test_an_extra_window_is_classified_by_what_the_tuner_was_doing_then():
    from tuner_diagnose import classify_window

    def ticks(level, state, work, t0=0.0, t1=1200.0):
        return [(t, level, state, work) for t in np.arange(t0 + 10, t1 + 1, 10.0)]

    steady = ticks(200, "hold", 100.0)
    assert classify_window(900, steady, [], 300, 0.4)[0] == "held, steady load"
    rising = ticks(200, "hold", 100.0, 0, 900) + ticks(200, "hold", 130.0, 900, 1200)
    assert classify_window(900, rising, [], 300, 0.4)[0] == "held, load rising"
    assert classify_window(900, rising, [], 300, 0.9)[0] == "held, load rising (default near)"
    trial = ticks(200, "hold", 100.0, 0, 850) + ticks(180, "trial", 100.0, 850, 1200)
    assert classify_window(900, trial, [], 300, 0.4)[0] == "trial"
    restored = ticks(300, "backoff", 100.0, 0, 700) + ticks(200, "hold", 100.0, 700, 1200)
    cls, detail = classify_window(900, restored, [(700.0, "restore", 300.0, 200.0)], 300, 0.4)
    assert cls == "after move" and "restore 300→200" in detail
    assert classify_window(900, ticks(300, "measure", 100.0), [], 300, 0.4)[0] == "at reference"
