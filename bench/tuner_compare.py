"""Several [tuner] variants on the same traces, side by side: the figures tuner_eval.py prints, once per variant.

    PYTHONPATH=. python bench/tuner_compare.py --seeds 3,5,7,9,11,13,15,17 \
        --variant fifth: --variant ninth:model_descend=true,model_skip=true \
        --variant twelfth:model_descend=true,model_skip=true,model_no_redescend=true

Each variant is `name:key=value,key=value` (values as TOML writes them; an empty list is the default config). Every
static level and the default run once per trace and seed (bench/_tuner.py's `evaluate`, as tuner_eval.py runs it), then
the tuner once per variant, so each variant's figures are those `tuner_eval.py --set …` prints for it. Per variant and
trace: the mean over the seeds of J/token against the oracle and the default and the points of 5-minute windows over the
SLO beyond the default's (the acceptance figures of issue 17), and the oracle's own J/token and points against the
default; then, per seed, the windows over the SLO of each variant (the default's in brackets), so windows gained and
removed can be read seed by seed; and each variant's model descents (`model_descend`) in all. `--oracle stationary` runs
the static levels on that trace only: the others print no figure against the oracle, several times faster.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tuner import evaluate  # noqa: E402
from tuner_eval import CARDS, traces  # noqa: E402

from powerprof.tuner.policy import TunerConfigError, config_from_table  # noqa: E402


def parse_variant(spec: str, slo: dict, knob: str, levels, default):
    name, _, sets = spec.partition(":")
    if not name:
        raise SystemExit(f"tuner_compare: --variant {spec!r}: want name:key=value,...")
    try:
        knobs = tomllib.loads("\n".join(x for x in sets.split(",") if x.strip()))
        return name, config_from_table({**slo, **knobs, "knob": knob}, list(levels), default)
    except (tomllib.TOMLDecodeError, TunerConfigError) as e:
        raise SystemExit(f"tuner_compare: --variant {name}: {e}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="3,5,7,9")
    ap.add_argument("--hours", type=float, default=4.0)
    ap.add_argument("--card", choices=sorted(CARDS), default="seed")
    ap.add_argument("--traces", default="stationary,diurnal_shift")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME:KEY=VALUE,...")
    ap.add_argument("--oracle", default=None, metavar="TRACES",
                    help="the traces whose static levels are run for the oracle (default: every trace); on the others "
                         "only the default and the variants run (several times faster), and vs oracle is not printed")
    a = ap.parse_args()
    profile, knob, levels, default, slo, scale = CARDS[a.card]
    variants = [parse_variant(v, slo, knob, levels, default) for v in a.variant]
    seeds = [int(x) for x in a.seeds.split(",")]
    wanted = a.traces.split(",")
    with_oracle = set(wanted if a.oracle is None else a.oracle.split(","))
    t0 = time.perf_counter()
    oracles: dict = {}  # trace → [(oracle's J/token against the default, its extra points)]
    rows: dict = {}  # (trace, variant) → [(vs oracle, vs default, Δ points, windows, default windows, descents)]
    for seed in seeds:
        for name, tr in traces(seed, a.hours, scale).items():
            if name not in wanted:
                continue
            split = a.hours * 3600 if name == "diurnal_shift" else None
            base = None
            for vname, cfg in variants:
                res = evaluate(profile, tr, cfg, default, split_s=split, statics=base is None and name in with_oracle)
                if base is None:
                    base = res
                    if name in with_oracle:
                        o, d = res["static"][res["oracle"]], res["default"]
                        oracles.setdefault(name, []).append((o.j_per_token / d.j_per_token - 1,
                                                             (o.win_violation - d.win_violation) * 100))
                t, d = res["tuner"], base["default"]
                o = base["static"][base["oracle"]] if name in with_oracle else t  # no oracle: vs oracle reads 0, not printed
                descents = sum(1 for x in t.decisions if x.action == "explore" and "latency model" in x.reason)
                rows.setdefault((name, vname), []).append(
                    (seed, t.j_per_token / o.j_per_token - 1, t.j_per_token / d.j_per_token - 1,
                     (t.win_violation - d.win_violation) * 100, len(t.bad), len(d.bad), descents))
            print(f"seed {seed} {name} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    print(f"seeds {a.seeds} ({a.card}); vs oracle / vs default / extra windows (points), mean of {len(seeds)} seeds")
    for name in wanted:
        if name in with_oracle:
            om = [sum(x[k] for x in oracles[name]) / len(oracles[name]) for k in (0, 1)]
            print(f"{name:14s} {'(oracle)':12s}        {om[0]:+6.1%} / {om[1]:+5.2f} pts against the default")
        for vname, _ in variants:
            r = rows[(name, vname)]
            m = [sum(x[k] for x in r) / len(r) for k in (1, 2, 3)]
            vo = f"{m[0]:+6.1%}" if name in with_oracle else "   n/a"
            print(f"{name:14s} {vname:12s} {vo} / {m[1]:+6.1%} / {m[2]:+5.2f} pts; windows "
                  f"{sum(x[4] for x in r)} (default {sum(x[5] for x in r)}); model descents {sum(x[6] for x in r)}")
        print(f"{name:14s} per seed, windows over the SLO (default's in brackets) by variant:")
        for i, seed in enumerate(seeds):
            cells = "  ".join(f"{vname} {rows[(name, vname)][i][4]}" for vname, _ in variants)
            print(f"    seed {seed:4d} [{rows[(name, variants[0][0])][i][5]}]  {cells}")
    print(f"(ran in {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
