"""The tuner's evaluation on the virtual-time simulated server: every static level, the default, and the tuner in the loop.

Shared by bench/tuner_eval.py (the acceptance figures) and tests/test_tuner_eval.py (small
versions with assertions). The tuner sees exactly what it sees live: per-tick windows whose
latency arrives as counts in the daemon's histogram buckets (powerprof.daemon.latency), so its
p95s carry the same bucket error as live; the scoring uses the exact per-request figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerprof.sim.profiles import get_profile
from powerprof.sim.virtual import RunResult, Tick, VirtualServer
from powerprof.tuner.policy import Tuner, TunerConfig, Window, histogram_counts

SCORE_WINDOW_S = 300.0  # SLO attainment is judged per 5-minute window of finished requests


@dataclass
class Outcome:
    name: str
    j_per_token: float
    req_violation: float  # share of requests over either SLO threshold
    win_violation: float  # share of 5-minute windows whose p95 exceeds the SLO
    explore_s: float = 0.0
    duration_s: float = 0.0
    level_time_s: dict | None = None
    decisions: list | None = None
    bad: list | None = None  # start (s) of each 5-minute window over the SLO
    halves: tuple | None = None  # ((energy J, tokens) before split_s, the same after), for static runs


def tick_window(tk: Tick, prompt, output) -> Window:
    """What the daemon's /metrics would give the tuner for this tick."""
    f = tk.finished
    return Window(tk.t_end_s, tk.t_end_s - tk.t_start_s, tk.level, tk.tokens, tk.energy_j, tk.arrivals, int(f.size),
                  float(prompt[f].sum()), float(output[f].sum()), histogram_counts(tk.ttft_s), histogram_counts(tk.tpot_s),
                  in_flight_s=tk.in_flight_s, awaiting_s=tk.awaiting_s, queue_clock_s=tk.t_end_s - tk.t_start_s)


def score(name: str, r: RunResult, tpot_ms: float | None, ttft_ms: float | None) -> Outcome:
    viol = np.zeros(r.arrival_s.size, bool)
    tpot, ttft = r.tpot_s, r.ttft_s
    if tpot_ms is not None:
        viol |= np.nan_to_num(tpot, nan=0.0) * 1000 > tpot_ms
    if ttft_ms is not None:
        viol |= ttft * 1000 > ttft_ms
    # Per window of finished requests: does its p95 break either SLO?
    win = (r.last_s // SCORE_WINDOW_S).astype(int)
    bad = total = 0
    bad_at: list[int] = []
    for k in np.unique(win):
        m = win == k
        if m.sum() < 5:
            continue
        total += 1
        broke = False
        if tpot_ms is not None:
            t = tpot[m]
            t = t[~np.isnan(t)]
            broke |= t.size > 0 and np.percentile(t, 95) * 1000 > tpot_ms
        if ttft_ms is not None:
            broke |= np.percentile(ttft[m], 95) * 1000 > ttft_ms
        bad += bool(broke)
        if broke:
            bad_at.append(int(k * SCORE_WINDOW_S))
    return Outcome(name, r.j_per_token, float(viol.mean()), bad / total if total else 0.0, duration_s=r.duration_s,
                   level_time_s=dict(r.level_time_s), bad=bad_at)


def evaluate(profile_key: str, trace, cfg: TunerConfig, default: float, tick_s: float = 10.0,
             statics: bool = True, split_s: float | None = None) -> dict:
    """{'static': {level: Outcome}, 'default': Outcome, 'tuner': Outcome, 'oracle': level|None}; with `split_s`,
    also 'pair': the best static level before and after it in hindsight (`best_pair`)."""
    arrival = np.array([r.t_s for r in trace])
    prompt = np.array([r.prompt_tokens for r in trace])
    output = np.maximum(np.array([r.output_tokens for r in trace]), 1)
    levels = sorted(set(cfg.levels) | {float(default)})
    vs = VirtualServer(get_profile(profile_key), levels, knob=cfg.knob)
    out: dict = {"static": {}}
    slo = (cfg.tpot_p95_ms, cfg.ttft_p95_ms)
    if statics:
        for lv in cfg.levels:
            acc = [[0.0, 0.0], [0.0, 0.0]]

            def hold(tk: Tick, lv=lv, acc=acc) -> float:
                h = int(split_s is not None and tk.t_end_s > split_s)
                acc[h][0] += tk.energy_j
                acc[h][1] += tk.tokens
                return lv

            r = vs.run(arrival, prompt, output, hold, lv, tick_s)
            out["static"][lv] = score(f"static {lv:g}", r, *slo)
            out["static"][lv].halves = (tuple(acc[0]), tuple(acc[1]))
    r = vs.run(arrival, prompt, output, lambda tk: default, default, tick_s)
    out["default"] = score(f"default {default:g}", r, *slo)
    tuner = Tuner(cfg, 0.0)

    def control(tk: Tick) -> float:
        tuner.observe(tick_window(tk, prompt, output))
        return tuner.level

    r = vs.run(arrival, prompt, output, control, cfg.reference, tick_s)
    o = score("tuner", r, *slo)
    o.explore_s = tuner.explore_s
    o.decisions = list(tuner.decisions)
    out["tuner"] = o
    ok = [lv for lv, s in out["static"].items() if s.win_violation <= out["default"].win_violation + 0.01]
    out["oracle"] = min(ok, key=lambda lv: out["static"][lv].j_per_token) if ok else None
    if split_s is not None and statics:
        out["pair"] = best_pair(out["static"], out["default"], split_s)
    return out


def best_pair(static: dict, default: Outcome, split_s: float) -> tuple | None:
    """(level before split_s, level after, J/token) with the least J/token among pairs of static levels whose
    5-minute windows over the SLO (counted per half from each level's own run) are within 1 point of the
    default's: the best one could do in hindsight with one static level per regime."""
    n_win = max(1, int(round(default.duration_s / SCORE_WINDOW_S)))
    bad = {lv: (sum(1 for b in o.bad if b < split_s), sum(1 for b in o.bad if b >= split_s)) for lv, o in static.items()}
    allowed = len(default.bad) + 0.01 * n_win
    best = None
    for a, oa in static.items():
        for b, ob in static.items():
            if bad[a][0] + bad[b][1] > allowed:
                continue
            e, tok = oa.halves[0][0] + ob.halves[1][0], oa.halves[0][1] + ob.halves[1][1]
            if tok > 0 and (best is None or e / tok < best[2]):
                best = (a, b, e / tok)
    return best
