"""How noisy the tuner's energy verdicts are: each trial's observed J/work gain against the static levels' true gain.

    PYTHONPATH=. python bench/tuner_energy_noise.py --seeds 75,77,79,81,83,85,87,89
    PYTHONPATH=. python bench/tuner_energy_noise.py --seeds 3,5 --set energy_pairs=2

Stationary trace (bench/tuner_eval.py's), seed card. Per seed, every static level is run once for its J/work over the
whole trace (energy / (output + prefill_weight × prompt tokens), as the tuner counts work); then the tuner, recording
every judged window. Printed: each judged window's J/work against its level's static J/work, by the tuner's state
(measure, trial, hold); and per trial, the gain the tuner saw against its incumbent's window beside the true gain
between the two static levels, with the incumbent window's own error. The spread of "observed − true" is the noise a
single paired verdict carries (docs/tuner-evaluation.md, fourteenth attempt).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tuner import tick_window  # noqa: E402
from tuner_eval import CARDS, traces  # noqa: E402

from powerprof.sim.profiles import get_profile  # noqa: E402
from powerprof.sim.virtual import VirtualServer  # noqa: E402
from powerprof.tuner.policy import Tuner, TunerConfigError, config_from_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="3,5,7,9")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a [tuner] knob, as TOML writes it")
    a = ap.parse_args()
    profile, knob, levels, default, slo, scale = CARDS["seed"]
    try:
        cfg = config_from_table({**slo, **tomllib.loads("\n".join(a.set)), "knob": knob}, list(levels), default)
    except (tomllib.TOMLDecodeError, TunerConfigError) as e:
        sys.exit(f"tuner_energy_noise: --set: {e}")
    rows, gains = [], []  # (state, window / static); (seed, t, incumbent, trial, observed gain, true gain, inc error)
    for seed in (int(x) for x in a.seeds.split(",")):
        tr = traces(seed, a.hours, scale)["stationary"]
        arr = np.array([r.t_s for r in tr])
        pr = np.array([r.prompt_tokens for r in tr])
        ot = np.maximum(np.array([r.output_tokens for r in tr]), 1)
        vs = VirtualServer(get_profile(profile), sorted(set(cfg.levels) | {float(default)}), knob=knob)
        static = {}
        for lv in cfg.levels:
            acc = [0.0, 0.0]

            def hold(tk, lv=lv, acc=acc):
                w = tick_window(tk, pr, ot)
                acc[0] += w.energy_j
                acc[1] += w.output_tokens + cfg.prefill_weight * w.prompt_tokens
                return lv

            vs.run(arr, pr, ot, hold, lv, 10.0)
            static[lv] = acc[0] / acc[1]
        tu = Tuner(cfg, 0.0)
        judge = tu._judge

        def recorded(t, out, tu=tu, judge=judge, seed=seed, static=static):
            state = tu.state
            s = judge(t, out)
            if s is not None:
                lv = cfg.levels[tu.idx]
                rows.append((state, s.j_per_work / static[lv]))
                if state == "trial" and tu._incumbent is not None:
                    inc = cfg.levels[tu._incumbent_idx]
                    gains.append((seed, t, inc, lv, 1 - s.j_per_work / tu._incumbent.j_per_work,
                                  1 - static[lv] / static[inc], tu._incumbent.j_per_work / static[inc] - 1))
            return s

        tu._judge = recorded  # a measurement hook only: the policy decides exactly as it does unobserved
        vs.run(arr, pr, ot, lambda tk, tu=tu: (tu.observe(tick_window(tk, pr, ot)), tu.level)[1], cfg.reference, 10.0)
    print("judged windows' J/work against their level's static J/work, by state:")
    by = defaultdict(list)
    for state, x in rows:
        by[state].append(x)
    for state, xs in sorted(by.items()):
        x = np.array(xs)
        print(f"  {state:8s} n={x.size:4d}  mean {x.mean():.3f}  sd {x.std():.3f}  5th–95th pct {np.percentile(x, 5):.3f}–"
              f"{np.percentile(x, 95):.3f}")
    print("trials (seed, minute, incumbent → trial): observed gain, true gain, incumbent window's error")
    for seed, t, inc, lv, obs, true, err in gains:
        flag = "  ← refused below on energy" if lv < inc and obs < -cfg.max_loss else ""
        print(f"  {seed:4d} {t / 60:6.1f} {inc:g}→{lv:g}: {obs:+.1%}, true {true:+.1%}, incumbent {err:+.1%}{flag}")
    if gains:
        d = np.array([g[4] - g[5] for g in gains])
        print(f"observed − true gain over {d.size} trials: mean {d.mean():+.1%}, sd {d.std():.1%}")


if __name__ == "__main__":
    main()
