"""Where the tuner's energy above the best static level goes, on the virtual-time simulator: a decomposition per seed.

    python bench/tuner_diagnose.py                       # stationary trace, seeds 3,5,7,9, seed card
    python bench/tuner_diagnose.py --trace diurnal_shift --seeds 3
    python bench/tuner_diagnose.py --windows --trace diurnal_shift --seeds 3,5   # the extra windows over the SLO
    python bench/tuner_diagnose.py --seeds 75,77 --set energy_pairs=2            # a variant of the [tuner] knobs

For each seed: the tuner and the oracle (bench/tuner_eval.py's best static level in hindsight) run the
same trace; every tick's energy above what the oracle spent per token in the same 5-minute window
(its tokens × the oracle's J/token there) is charged to what the tuner was doing in that tick: a
trial (exploring), a back-off at the reference, or holding/measuring a level below, at or above the
oracle's. The shares add up to the tuner's J/token over the oracle's, up to the residual of
tokens moving between windows. Then the SLO margin rules: each static level's p95/SLO over every
5-minute window as the tuner sees it (the daemon's histogram buckets), against accept_ratio (a
trial below is kept only at or under it) and hold_ratio (a held level above it moves up).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tuner import SCORE_WINDOW_S, score, tick_window  # noqa: E402
from tuner_eval import CARDS, traces  # noqa: E402

from powerprof.sim.profiles import get_profile  # noqa: E402
from powerprof.sim.virtual import VirtualServer  # noqa: E402
from powerprof.tuner.policy import Tuner, TunerConfigError, config_from_table, merge, slo_ratio  # noqa: E402


def run_static(vs, arr, prompt, output, lv, tick_s, cfg):
    ticks = []

    def hold(tk):
        ticks.append(tick_window(tk, prompt, output))
        return lv

    r = vs.run(arr, prompt, output, hold, lv, tick_s)
    return r, ticks


def window_ratios(ticks, cfg) -> np.ndarray:
    """p95/SLO per 5-minute window, from the histograms the tuner reads."""
    by = defaultdict(list)
    for w in ticks:
        by[int(w.t_end_s // SCORE_WINDOW_S)].append(w)
    out = []
    for k in sorted(by):
        m = merge(by[k])
        if m.requests >= cfg.min_requests:
            x = slo_ratio(m, cfg, complete=True)
            if x is not None:
                out.append(x)
    return np.array(out)


def diagnose(profile, tr, cfg, default, tick_s=10.0, tuner_cls=Tuner):
    arr = np.array([r.t_s for r in tr])
    prompt = np.array([r.prompt_tokens for r in tr])
    output = np.maximum(np.array([r.output_tokens for r in tr]), 1)
    vs = VirtualServer(get_profile(profile), sorted(set(cfg.levels) | {float(default)}), knob=cfg.knob)
    slo = (cfg.tpot_p95_ms, cfg.ttft_p95_ms)
    static, sticks = {}, {}
    for lv in cfg.levels:
        r, ticks = run_static(vs, arr, prompt, output, lv, tick_s, cfg)
        static[lv], sticks[lv] = score(f"static {lv:g}", r, *slo), ticks
    d = static[float(default)]
    ok = [lv for lv, s in static.items() if s.win_violation <= d.win_violation + 0.01]
    oracle = min(ok, key=lambda lv: static[lv].j_per_token)
    # The oracle's J/token per 5-minute window.
    eo, no = defaultdict(float), defaultdict(float)
    for w in sticks[oracle]:
        k = int(w.t_end_s // SCORE_WINDOW_S)
        eo[k] += w.energy_j
        no[k] += w.tokens
    j_o = {k: eo[k] / no[k] for k in eo if no[k] > 0}
    jo_all = static[oracle].j_per_token

    tuner = tuner_cls(cfg, 0.0)
    state = ["measure"]  # the state in force during the coming tick
    cat_e = defaultdict(float)
    cat_t = defaultdict(float)
    base = [0.0]
    tok = [0.0]

    def control(tk):
        w = tick_window(tk, prompt, output)
        k = int(tk.t_end_s // SCORE_WINDOW_S)
        jo = j_o.get(k, jo_all)
        s = state[0]
        if s in ("measure", "hold"):
            rel = "below" if tk.level < oracle else ("at" if tk.level == oracle else "above")
            s = f"{s} {rel}"
        cat_e[s] += tk.energy_j - tk.tokens * jo
        cat_t[s] += tk.t_end_s - tk.t_start_s
        base[0] += tk.tokens * jo
        tok[0] += tk.tokens
        tuner.observe(w)
        state[0] = tuner.state
        return tuner.level

    r = vs.run(arr, prompt, output, control, cfg.reference, tick_s)
    t = score("tuner", r, *slo)
    return {"static": static, "oracle": oracle, "tuner": t, "cat_e": dict(cat_e), "cat_t": dict(cat_t),
            "base_j": base[0], "ratios": {lv: window_ratios(sticks[lv], cfg) for lv in cfg.levels},
            "decisions": list(tuner.decisions), "default": d}


def window_p95_ratios(r, cfg) -> dict:
    """Exact p95/SLO (the worse of TPOT and TTFT) per 5-minute window of finished requests, as score() judges them."""
    win = (r.last_s // SCORE_WINDOW_S).astype(int)
    tpot, ttft = r.tpot_s, r.ttft_s
    out = {}
    for k in np.unique(win):
        m = win == k
        if m.sum() < 5:
            continue
        x = 0.0
        if cfg.tpot_p95_ms is not None:
            t = tpot[m]
            t = t[~np.isnan(t)]
            if t.size:
                x = max(x, np.percentile(t, 95) * 1000 / cfg.tpot_p95_ms)
        if cfg.ttft_p95_ms is not None:
            x = max(x, np.percentile(ttft[m], 95) * 1000 / cfg.ttft_p95_ms)
        out[int(k * SCORE_WINDOW_S)] = x
    return out


def classify_window(start_s: float, ticks: list, moves: list, ref: float, default_ratio: float | None,
                    rise: float = 1.1) -> tuple[str, str]:
    """(class, detail) of one 5-minute window where the tuner broke the SLO and the default did not.

    `ticks`: (t_end_s, level, state, work_per_s) per tick; `moves`: (t_s, action, from, to). Classes, first
    that applies: `trial` (a trial ran in the window or the 2 minutes before: its requests finish in it),
    `after move` (the level changed in the window or the 5 minutes before, so the guard's own window had not
    filled), `held, load rising` (a level below the reference held while the work per second in the window
    was more than `rise` × that of the two windows before), `held, steady load`; and `default near` when the
    default's own p95 in that window was over 0.8 of the SLO (a window the default also nearly broke)."""
    lo, hi = start_s - 120.0, start_s + SCORE_WINDOW_S
    states = {s for t, _, s, _ in ticks if lo < t <= hi}
    levels = sorted({lv for t, lv, _, _ in ticks if start_s - SCORE_WINDOW_S < t <= hi})
    now = [w for t, _, _, w in ticks if start_s < t <= hi]
    before = [w for t, _, _, w in ticks if start_s - 2 * SCORE_WINDOW_S < t <= start_s]
    growth = (np.mean(now) / np.mean(before)) if now and before and np.mean(before) > 0 else 1.0
    near = default_ratio is not None and default_ratio > 0.8
    recent = [m for m in moves if start_s - SCORE_WINDOW_S < m[0] <= hi and m[2] != m[3]]
    detail = (f"levels {'/'.join(f'{x:g}' for x in levels)}, work/s ×{growth:.2f} vs the 10 min before, "
              f"default p95 at {default_ratio:.0%}" if default_ratio is not None else "default p95 n/a")
    if recent:
        detail += "; moves: " + ", ".join(f"{t / 60:.0f} min {a} {f:g}→{to:g}" for t, a, f, to in recent)
    if "trial" in states:
        cls = "trial"
    elif recent and any(m[3] < m[2] or m[1] in ("restore", "regime") for m in recent):
        cls = "after move"
    elif all(lv >= ref for lv in levels):
        cls = "at reference"
    elif growth > rise:
        cls = "held, load rising"
    else:
        cls = "held, steady load"
    return cls + (" (default near)" if near else ""), detail


def extra_windows(profile, tr, cfg, default, tick_s=10.0, tuner_cls=Tuner) -> list:
    """The tuner's 5-minute windows over the SLO where the default's was not, each with classify_window's verdict."""
    arr = np.array([r.t_s for r in tr])
    prompt = np.array([r.prompt_tokens for r in tr])
    output = np.maximum(np.array([r.output_tokens for r in tr]), 1)
    vs = VirtualServer(get_profile(profile), sorted(set(cfg.levels) | {float(default)}), knob=cfg.knob)
    slo = (cfg.tpot_p95_ms, cfg.ttft_p95_ms)
    rd = vs.run(arr, prompt, output, lambda tk: default, default, tick_s)
    d_ratio = window_p95_ratios(rd, cfg)
    d_bad = set(score("default", rd, *slo).bad)
    tuner = tuner_cls(cfg, 0.0)
    ticks = []

    def control(tk):
        w = tick_window(tk, prompt, output)
        ticks.append((tk.t_end_s, tk.level, tuner.state,
                      (w.output_tokens + cfg.prefill_weight * w.prompt_tokens) / max(w.duration_s, 1e-9)))
        tuner.observe(w)
        return tuner.level

    rt = vs.run(arr, prompt, output, control, cfg.reference, tick_s)
    t = score("tuner", rt, *slo)
    t_ratio = window_p95_ratios(rt, cfg)
    moves = [(x.t_s, x.action, x.from_level, x.to_level) for x in tuner.decisions]
    out = []
    for b in t.bad:
        if b in d_bad:
            continue
        cls, detail = classify_window(b, ticks, moves, float(cfg.reference), d_ratio.get(b))
        out.append((b, t_ratio.get(b), cls, detail))
    return out


CATS = ("trial", "backoff", "measure below", "measure at", "measure above", "hold below", "hold at", "hold above")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="3,5,7,9")
    ap.add_argument("--trace", default="stationary", choices=("stationary", "diurnal_shift"))
    ap.add_argument("--card", choices=sorted(CARDS), default="seed")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--decisions", action="store_true", help="print the tuner's decisions too")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a [tuner] knob for this run, as TOML writes its value (energy_pairs=2)")
    ap.add_argument("--windows", action="store_true",
                    help="instead: classify each 5-minute window the tuner broke and the default did not")
    a = ap.parse_args()
    profile, knob, levels, default, slo, scale = CARDS[a.card]
    try:
        cfg = config_from_table({**slo, **tomllib.loads("\n".join(a.set)), "knob": knob}, list(levels), default)
    except (tomllib.TOMLDecodeError, TunerConfigError) as e:
        sys.exit(f"tuner_diagnose: --set: {e}")
    if a.windows:
        counts: dict = defaultdict(int)
        for seed in (int(x) for x in a.seeds.split(",")):
            for b, ratio, cls, detail in extra_windows(profile, traces(seed, a.hours, scale)[a.trace], cfg, default):
                counts[cls] += 1
                print(f"seed {seed:3d} window {b / 60:5.0f}–{b / 60 + 5:.0f} min: p95 at {ratio:.0%} of the SLO; "
                      f"{cls}: {detail}")
        print("extra windows by class: " + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"))
        return
    sums = defaultdict(float)
    n = 0
    for seed in (int(x) for x in a.seeds.split(",")):
        tr = traces(seed, a.hours, scale)[a.trace]
        res = diagnose(profile, tr, cfg, default)
        t, o = res["tuner"], res["static"][res["oracle"]]
        total = t.j_per_token / o.j_per_token - 1
        print(f"\n== {a.trace} seed {seed}: oracle {res['oracle']:g} {cfg.unit}; tuner {total:+.1%} J/token vs oracle; "
              f"windows over SLO tuner {t.win_violation:.1%}, default {res['default'].win_violation:.1%}")
        print(f"{'while':14s} {'time':>6s} {'excess':>8s}   (excess: share of the oracle's energy for the same tokens)")
        for c in CATS:
            if c in res["cat_t"]:
                x = res["cat_e"][c] / res["base_j"]
                sums[c] += x
                sums["t " + c] += res["cat_t"][c] / t.duration_s
                print(f"{c:14s} {res['cat_t'][c] / t.duration_s:6.1%} {x:+8.2%}")
        resid = total - sum(res["cat_e"].values()) / res["base_j"]
        sums["resid"] += resid
        sums["total"] += total
        n += 1
        print(f"{'(residual)':14s} {'':6s} {resid:+8.2%}")
        print(f"p95/SLO per 5-minute window at each static level (as the tuner reads it): "
              f"median / 90th pct / share ≤ {cfg.accept_ratio:g} / share > {cfg.hold_ratio:g} / share > {cfg.guard_ratio:g}")
        for lv in cfg.levels:
            x = res["ratios"][lv]
            if x.size:
                mark = " ← oracle" if lv == res["oracle"] else ""
                print(f"  {lv:6g} {np.median(x):5.2f} {np.percentile(x, 90):5.2f} {np.mean(x <= cfg.accept_ratio):6.0%} "
                      f"{np.mean(x > cfg.hold_ratio):6.0%} {np.mean(x > cfg.guard_ratio):6.0%}  "
                      f"J/token {res['static'][lv].j_per_token:.3f}, windows over {res['static'][lv].win_violation:.1%}{mark}")
        if a.decisions:
            for dd in res["decisions"]:
                print(f"  {dd.t_s / 60:6.1f} min {dd.action:8s} {dd.from_level:g}→{dd.to_level:g} "
                      f"{'' if dd.slo_ratio is None else f'{dd.slo_ratio:.2f} '}{dd.reason}")
    print(f"\n== mean of {n} seeds: tuner {sums['total'] / n:+.2%} vs oracle ==")
    for c in CATS:
        if "t " + c in sums:
            print(f"{c:14s} {sums['t ' + c] / n:6.1%} {sums[c] / n:+8.2%}")
    print(f"{'(residual)':14s} {'':6s} {sums['resid'] / n:+8.2%}")


if __name__ == "__main__":
    main()
