"""The stationary trace's windows over the SLO, with what the tuner did around each: per seed, every 5-minute window
over the SLO (EXTRA: not over it at the default), the tuner's level and state over the 10 minutes before it, and its
decisions from 30 minutes before (the tenth attempt's diagnosis, docs/tuner-evaluation.md).

    PYTHONPATH=. python bench/tuner_windows.py 107,109,111 [steady_rise_ratio=0.9 ...]   # knobs as TOML lines
"""
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy as np
from _tuner import score, tick_window, SCORE_WINDOW_S
from tuner_eval import traces, CARDS
from powerprof.sim.profiles import get_profile
from powerprof.sim.virtual import VirtualServer
from powerprof.tuner.policy import Tuner, config_from_table

seeds = [int(x) for x in sys.argv[1].split(",")]
sets = sys.argv[2:]
profile, knob, levels, default, slo, scale = CARDS["seed"]
cfg = config_from_table({**slo, **tomllib.loads("\n".join(sets)), "knob": knob}, list(levels), default)
for seed in seeds:
    tr = traces(seed, 4.0, scale)["stationary"]
    arrival = np.array([r.t_s for r in tr]); prompt = np.array([r.prompt_tokens for r in tr])
    output = np.maximum(np.array([r.output_tokens for r in tr]), 1)
    vs = VirtualServer(get_profile(profile), sorted(set(cfg.levels) | {float(default)}), knob=cfg.knob)
    rd = vs.run(arrival, prompt, output, lambda tk: default, default, 10.0)
    d = score("default", rd, cfg.tpot_p95_ms, cfg.ttft_p95_ms)
    tuner = Tuner(cfg, 0.0); tl = []
    def control(tk):
        tuner.observe(tick_window(tk, prompt, output))
        tl.append((tk.t_end_s, tk.level, tuner.level, tuner.state))
        return tuner.level
    rt = vs.run(arrival, prompt, output, control, cfg.reference, 10.0)
    t = score("tuner", rt, cfg.tpot_p95_ms, cfg.ttft_p95_ms)
    # per-window p95s for the tuner
    win = (rt.last_s // SCORE_WINDOW_S).astype(int)
    info = {}
    for b in t.bad:
        m = win == b // 300
        tp = rt.tpot_s[m]; tp = tp[~np.isnan(tp)]
        info[b] = (np.percentile(tp, 95) * 1000 / cfg.tpot_p95_ms if tp.size else 0, np.percentile(rt.ttft_s[m], 95) * 1000 / cfg.ttft_p95_ms)
    print(f"\n##### seed {seed}: tuner {t.j_per_token:.4f} default {d.j_per_token:.4f} ({1 - t.j_per_token / d.j_per_token:.1%}); "
          f"bad tuner {[b // 60 for b in t.bad]} default {[b // 60 for b in d.bad]} min", flush=True)
    for b in t.bad:
        tag = "ALSO-DEFAULT" if b in d.bad else "EXTRA"
        print(f"--- window min {b // 60}-{b // 60 + 5} {tag}: TPOT p95/SLO {info[b][0]:.2f} TTFT {info[b][1]:.2f}")
        seg = [(te, lv, st) for te, lv, nl, st in tl if b - 600 <= te <= b + 300]
        runs = []
        for te, lv, st in seg:
            if runs and runs[-1][1:] == (lv, st): continue
            runs.append((te, lv, st))
        print("    timeline:", "; ".join(f"{te / 60:.1f}m {lv:g}W {st}" for te, lv, st in runs))
        for x in tuner.decisions:
            if b - 1800 <= x.t_s <= b + 300 and x.action not in ("regime",):
                print(f"    {x.t_s / 60:6.1f}m {x.action:8s} {x.from_level:g}->{x.to_level:g} {x.reason[:150]}")
