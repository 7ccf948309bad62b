"""Bench: do the analysis's 95% CIs cover the truth 95% of the time, and is the choice's certainty honest?

Synthetic sweeps with known per-level medians (the simulator's seed-16g card at 180/220/260/300 W:
220 W is 6.8% slower and saves 14.8% J/token vs 300 W) are drawn again and again
(tests/synthetic_runs.py:replicate_windows): every level gets whole rounds of the same prompts,
prompts differ in cost by `spread` (log-uniform, fixed per case: the workload), each window adds
lognormal noise to tok/s and power. Each replicate goes through the product's statistics
(stats.level_series + levels_table) and the coverage of each stated 95% CI is counted:

- J/token: a level's own CI against its true median (the median of this prompt mix at that level),
- loss / saving: the non-reference levels' speed-loss and energy-saving CIs against the true ratios.

The choice study puts two levels within noise of each other (or a level at the slowdown budget's
edge) and reports how often the recommendation is the true best, the stated stability, and how
often the stated 95% range of the choice holds the true best.

    .venv/bin/python bench/analysis_coverage.py [--reps 200] [--boot 2000] [--seed 1] [--only coverage|choice]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from synthetic_runs import replicate_windows, seed_truth, truth_level_median  # noqa: E402

from powerprof.analysis.checks import UNSTABLE_SHARE, saving_within_noise  # noqa: E402
from powerprof.analysis.stats import level_series, levels_table  # noqa: E402
from powerprof.analysis.sweetspot import PolicyParams, choose, policy_index  # noqa: E402

LEVELS = (180.0, 220.0, 260.0, 300.0)

# (label, windows per level as prompts × rounds, noise, prompt spread, slow window, prompt ids)
CASES = [
    (f"n={p * r:<2} ({p}p×{r}) noise {nz:.0%} spread {sp:.0%}" + (" +slow" if slow else "") + ("" if ids else " no-ids"),
     p, r, nz, sp, slow, ids)
    for p, r in ((5, 1), (5, 2), (10, 3))
    for nz, sp, slow, ids in ((0.01, 0.1, False, True), (0.05, 0.1, False, True), (0.01, 0.3, False, True),
                              (0.05, 0.3, False, True), (0.02, 0.2, True, True), (0.02, 0.2, False, False))
]


def coverage(reps: int, n_boot: int, seed: int) -> list[dict]:
    truth = seed_truth("seed-16g")
    lv = np.array(LEVELS)
    tok, jpt = truth.tok_s(lv), truth.j_per_token(lv)
    loss_true, save_true = (1 - tok / tok[-1]) * 100, (1 - jpt / jpt[-1]) * 100
    out = []
    for label, p, r, nz, sp, slow, ids in CASES:
        rng = np.random.default_rng([seed, p, r, int(nz * 1000), int(sp * 100), slow, ids])
        f = np.exp(rng.uniform(-sp / 2, sp / 2, p))
        j_med = np.array([truth_level_median(v, f, nz, +1) for v in jpt])
        hit = {"j": [], "loss": [], "save": []}
        width = {"j": [], "loss": [], "save": []}
        method = set()
        for k in range(reps):
            w = replicate_windows(rng, tok, jpt, LEVELS, n_prompts=p, rounds=r, noise=nz, slow_window=slow,
                                  prompt_ids=ids, prompt_factor=f)
            s = level_series(w, 300.0, n_boot=n_boot, seed=k)[0]
            method.add(s.bootstrap)
            t = levels_table([s]).to_pylist()
            for i, row in enumerate(t):
                lo, hi = row["gpu_j_per_token_ci_low"], row["gpu_j_per_token_ci_high"]
                hit["j"].append(lo <= j_med[i] <= hi)
                width["j"].append((hi - lo) / j_med[i] * 100)
                if i == 3:
                    continue
                for key, col, true in (("loss", "speed_loss_pct", loss_true[i]), ("save", "energy_saving_pct", save_true[i])):
                    lo, hi = row[col + "_ci_low"], row[col + "_ci_high"]
                    hit[key].append(lo <= true <= hi)
                    width[key].append(hi - lo)
        out.append({"case": label, "method": "+".join(sorted(method)),
                    **{f"cov_{k}": float(np.mean(v)) for k, v in hit.items()},
                    **{f"width_{k}": float(np.median(v)) for k, v in width.items()}})
        print(_row(out[-1]), flush=True)
    return out


# (label, levels, speed loss % and energy saving % per level vs the last (the reference), policy)
CHOICE_CASES = [
    ("clear: seed-16g card, budget 10%", None, None, None, "budget"),
    ("a level at 9% loss, budget 10%", (200.0, 240.0, 280.0, 320.0), (15.0, 9.0, 3.0, 0.0), (25.0, 18.0, 8.0, 0.0), "budget"),
    ("two levels 0.5 pp apart, min_energy", (200.0, 240.0, 280.0, 320.0), (15.0, 9.0, 3.0, 0.0), (19.5, 20.0, 8.0, 0.0),
     "min_energy"),
    ("flat J/token, budget 10%", (200.0, 240.0, 280.0, 320.0), (15.0, 9.0, 3.0, 0.0), (0.0, 0.0, 0.0, 0.0), "budget"),
]


def choice(reps: int, n_boot: int, seed: int) -> list[dict]:
    out = []
    for label, levels, loss, saving, policy in CHOICE_CASES:
        if levels is None:
            truth = seed_truth("seed-16g")
            levels = LEVELS
            tok, jpt = truth.tok_s(np.array(levels)), truth.j_per_token(np.array(levels))
        else:
            tok, jpt = 100.0 * (1 - np.array(loss) / 100), 3.0 * (1 - np.array(saving) / 100)
        params = PolicyParams(max_slowdown=0.10, p_max_w=max(levels))
        ref = float(levels[-1])
        # A flat curve ties every level: the one to run is the reference, which costs no speed.
        best = ref if np.ptp(jpt) == 0 else float(levels[int(policy_index(policy, tok, jpt, len(levels) - 1, params))])
        for p, r, nz in ((5, 2, 0.02), (10, 3, 0.02), (10, 3, 0.05)):
            rng = np.random.default_rng([seed, p, r, int(nz * 1000), len(out)])
            f = np.exp(rng.uniform(-0.1, 0.1, p))
            right, stab, in_range, warned, wrong_unwarned = [], [], [], [], []
            for k in range(reps):
                w = replicate_windows(rng, tok, jpt, levels, n_prompts=p, rounds=r, noise=nz, prompt_factor=f)
                s = level_series(w, ref, n_boot=n_boot, seed=k)[0]
                c = choose(s, policy, params)
                table = levels_table([s])
                # What the recommendation line tells the user to run: the reference when the saving is noise.
                no_saving = saving_within_noise(c, table, ref) is not None
                acted = ref if no_saving else c.level_value
                warn = (c.stability < UNSTABLE_SHARE or no_saving
                        or (c.ci_low <= min(levels) and c.ci_high >= max(levels)))
                right.append(acted == best)
                stab.append(c.stability)
                in_range.append(c.ci_low <= best <= c.ci_high)
                warned.append(warn)
                wrong_unwarned.append(acted != best and not warn)
            out.append({"case": f"{label}; {p}p×{r} noise {nz:.0%}", "best": best, "right": np.mean(right),
                        "stability": np.mean(stab), "in_range": np.mean(in_range), "warned": np.mean(warned),
                        "wrong_unwarned": np.mean(wrong_unwarned)})
            d = out[-1]
            print(f"| {d['case']} | {d['best']:g} | {d['right']:.0%} | {d['stability']:.0%} | {d['in_range']:.0%} | "
                  f"{d['warned']:.0%} | {d['wrong_unwarned']:.0%} |", flush=True)
    return out


def _row(d: dict) -> str:
    return (f"| {d['case']} | {d['method']} | {d['cov_j']:.1%} ({d['width_j']:.1f}%) | "
            f"{d['cov_loss']:.1%} ({d['width_loss']:.2f} pp) | {d['cov_save']:.1%} ({d['width_save']:.2f} pp) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=("coverage", "choice"))
    a = ap.parse_args()
    t0 = time.monotonic()
    if a.only != "choice":
        print(f"coverage of the stated 95% CIs, {a.reps} replicate sweeps per case, {a.boot} resamples "
              "(median CI width in brackets)")
        print("| case | bootstrap | J/token | speed loss | energy saving |\n|---|---|---|---|---|")
        coverage(a.reps, a.boot, a.seed)
    if a.only != "coverage":
        print(f"\nthe choice, {a.reps} replicate sweeps per case. true best: the policy on the true curves (a flat curve: "
              "the reference); right: what the line says to run (the reference when it says the saving is noise) is the "
              "true best; stability: mean stated share of resamples; in range: the true best inside the stated 95% range; "
              "warned: an unstable-choice or no-clear-saving warning, or a range over every level; wrong & unwarned: "
              "the line is wrong and nothing warns")
        print("| case | true best | right | stability | in range | warned | wrong & unwarned |\n|---|---|---|---|---|---|---|")
        choice(a.reps, a.boot, a.seed)
    print(f"({time.monotonic() - t0:.0f} s)")


if __name__ == "__main__":
    main()
