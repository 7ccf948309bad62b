"""The tuner against every static power limit, the default and the best static level in hindsight, in virtual time.

    python bench/tuner_eval.py                    # seed card, 4 seeds × (4 h stationary + 8 h diurnal with a shift), ~1 min
    python bench/tuner_eval.py --seeds 3 --json   # one seed, machine-readable
    python bench/tuner_eval.py --set drain_s=120 --set break_restore_above=2   # a variant of the [tuner] knobs

Simulated seed card (sim profile seed-16g), continuous batching with 64 slots
(powerprof/sim/virtual.py: the simulator's step costs and DVFS under the cap, event to event
in virtual time). Two traces: stationary chat traffic (Poisson 1 req/s, prompts ~400, outputs
~80 tokens, 4 h) and a compressed day (8 h period, rate 0.4–1.2 req/s) whose second half is
long-document traffic (prompts ~1500, outputs ~250 tokens, at 0.4× the rate). SLO: TPOT p95
≤ 300 ms and TTFT p95 ≤ 5 s. SLO violations: the share of 5-minute windows whose p95 breaks
either SLO (the SLO is a p95), and the share of requests over either threshold. The oracle is
the static level with the least J/token among those within 1 point of the default's
violations. For the regime-shift trace, also the best pair of static levels, one per half, in
hindsight (the most one static level per regime could save). The detailed table is printed for the first seed; the acceptance lines for every
seed and their mean (one 5-minute window is 2.1 points of a 4 h trace, 1.0 of an 8 h one, so
single seeds are coarse). Every acceptance figure of issue 17 is printed with PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tuner import evaluate  # noqa: E402

from powerprof.tuner.policy import TunerConfigError, config_from_table  # noqa: E402
from powerprof.workload.trace import LengthMix, diurnal, synthetic  # noqa: E402

LEVELS_W = (150, 170, 190, 210, 230, 250, 270, 300)
DEFAULT_W = 300
# TPOT 300 ms: the default breaks it in one stationary 5-minute window of 194 on the tuning seeds, as it
# broke 100 ms (one of 193) before the continuous engine's speculative step was fixed (docs/tuner-evaluation.md: it then decoded
# ~2.9 times too fast); TTFT (prefill-bound, unchanged by the fix) stays 5 s.
SLO = {"tpot_p95_ms": 300.0, "ttft_p95_ms": 5000.0}
# card: (profile, knob, levels, reference/default, SLO, traffic scale). The H200's cap barely binds in
# decode: locked SM clocks (MHz) are its knob, and it serves three times the seed card's traffic.
CARDS = {
    "seed": ("seed-16g", "power", LEVELS_W, DEFAULT_W, SLO, 1.0),
    "h200": ("h200-141g", "clock", (900, 1100, 1300, 1500, 1700, 1980), 1980,
             {"tpot_p95_ms": 60.0, "ttft_p95_ms": 5000.0}, 3.0),
}


def traces(seed: int, hours: float, scale: float = 1.0):
    stationary = synthetic(int(hours * 3600 * scale), scale, prompt_median=400, output_median=80, seed=seed)
    day = 2 * hours * 3600
    shifted = diurnal(day, 0.8 * scale, amplitude=0.5, period_s=day, mix=LengthMix(400, 1.0, 80, 0.8),
                      shift_at_s=day / 2, shift_mix=LengthMix(1500, 0.8, 250, 0.6), shift_rate_factor=0.4, seed=seed + 1)
    return {"stationary": stationary, "diurnal_shift": shifted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=4.0, help="stationary trace length (the diurnal one is twice it)")
    ap.add_argument("--seeds", default="3,5,7,9", help="comma-separated trace seeds")
    ap.add_argument("--card", choices=sorted(CARDS), default="seed",
                    help="seed: seed-16g, power limits; h200: h200-141g, locked SM clocks, 3x the traffic")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a [tuner] knob for this run, as TOML writes its value (drain_s=120, ramp_descend=true)")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    profile, knob, levels, default, slo, scale = CARDS[a.card]
    try:
        knobs = tomllib.loads("\n".join(a.set))
        cfg = config_from_table({**slo, **knobs, "knob": knob}, list(levels), default)
    except (tomllib.TOMLDecodeError, TunerConfigError) as e:
        sys.exit(f"tuner_eval: --set: {e}")
    if not a.json:
        print(f"{profile}: {knob} levels {', '.join(map(str, levels))} {cfg.unit}, default {default}; SLO TPOT p95 ≤ "
              f"{slo['tpot_p95_ms']:g} ms, TTFT p95 ≤ {slo['ttft_p95_ms']:g} ms; traffic ×{scale:g}")
    t0 = time.perf_counter()
    runs = {}
    for seed in seeds:
        for name, tr in traces(seed, a.hours, scale).items():
            # The regime-shift trace changes its length mix half-way: also the best static level per half.
            res = evaluate(profile, tr, cfg, default, split_s=a.hours * 3600 if name == "diurnal_shift" else None)
            runs[(name, seed)] = res
            if seed == seeds[0] and not a.json:
                _table(name, seed, tr, res)
    if a.json:
        print(json.dumps({f"{n}/{s}": _jsonable(r) for (n, s), r in runs.items()}, indent=1))
        return
    print("\n== acceptance (issue 17), per seed ==")
    print(f"{'trace':14s} {'seed':>4s} {'oracle':>6s} {'vs oracle':>9s} {'vs default':>10s} {'Δ windows':>9s} {'exploring':>9s}")
    sums: dict = {}
    for (name, seed), res in runs.items():
        t, d = res["tuner"], res["default"]
        o = res["static"][res["oracle"]]
        row = (t.j_per_token / o.j_per_token - 1, 1 - t.j_per_token / d.j_per_token,
               (t.win_violation - d.win_violation) * 100, t.explore_s / t.duration_s)
        sums.setdefault(name, []).append(row)
        print(f"{name:14s} {seed:4d} {res['oracle']:6g} {row[0]:+9.1%} {-row[1]:+10.1%} {row[2]:+8.1f}pp {row[3]:9.0%}")
    pairs = [(seed, res["pair"], res["default"]) for (name, seed), res in runs.items() if res.get("pair")]
    if pairs:
        print(f"\nregime shift, best static level per half in hindsight (within 1 point of the default's windows over SLO):")
        for seed, (lo, hi, j), d in pairs:
            print(f"  seed {seed}: {lo:g} then {hi:g} {cfg.unit}: {j / d.j_per_token - 1:+.1%} J/token vs default")
        print(f"  mean: {sum(j / d.j_per_token - 1 for _, (_, _, j), d in pairs) / len(pairs):+.1%} "
              "(the most a static level per regime could save)")
    print()
    for name, rows in sums.items():
        vo, vd, dv, ex = (sum(r[k] for r in rows) / len(rows) for k in range(4))
        if name == "stationary":
            print(f"stationary, mean of {len(rows)} seeds: tuner vs best static {vo:+.1%} J/token (want within ±3%): "
                  f"{'PASS' if vo <= 0.03 else 'FAIL'}")
        else:
            print(f"regime shift, mean of {len(rows)} seeds: tuner vs best static {vo:+.1%} J/token (want ≤ −5%): "
                  f"{'PASS' if vo <= -0.05 else 'FAIL'}")
        print(f"{name}, mean: {vd:.1%} less J/token than the default (want ≥ 15%), {dv:+.2f} points of 5-minute windows "
              f"over the SLO (want ≤ +1): {'PASS' if vd >= 0.15 and dv <= 1.0 else 'FAIL'}; {ex:.0%} of the time exploring")
    print(f"\n(bench ran in {time.perf_counter() - t0:.0f} s)")


def _table(name, seed, tr, res) -> None:
    print(f"\n== {name} (seed {seed}): {len(tr)} requests over {res['default'].duration_s / 3600:.1f} h (virtual) ==")
    print(f"{'setting':14s} {'J/token':>8s} {'vs default':>10s} {'windows over SLO':>17s} {'requests over':>14s}")
    d = res["default"]
    for o in list(res["static"].values()) + [d, res["tuner"]]:
        mark = "  ← oracle" if res["oracle"] is not None and o is res["static"].get(res["oracle"]) else ""
        print(f"{o.name:14s} {o.j_per_token:8.3f} {o.j_per_token / d.j_per_token - 1:+10.1%} "
              f"{o.win_violation:17.1%} {o.req_violation:14.1%}{mark}")
    t = res["tuner"]
    print(f"tuner: {t.explore_s / 60:.0f} min exploring of {t.duration_s / 60:.0f} ({t.explore_s / t.duration_s:.1%}); "
          f"{sum(1 for x in t.decisions if x.action == 'backoff')} back-offs; time per level (min): "
          + ", ".join(f"{k:g}: {v / 60:.0f}" for k, v in sorted(t.level_time_s.items())))


def _jsonable(res: dict) -> dict:
    def o(x):
        return {"j_per_token": x.j_per_token, "windows_over_slo": x.win_violation, "requests_over_slo": x.req_violation,
                "explore_s": x.explore_s, "duration_s": x.duration_s}
    return {"static": {str(k): o(v) for k, v in res["static"].items()}, "default": o(res["default"]),
            "tuner": o(res["tuner"]), "oracle_w": res["oracle"]}


if __name__ == "__main__":
    main()
