"""The seed's configuration study on the simulated seed card: draft 1-5 x np 1-4, crossed with power limits.

Usage: python bench/config_grid.py [--limits 180,220,260,300] [--decode-tok-s 87] [--max-tokens N] [--out DIR]

Runs `powerprof sweep --simulate seed-16g --launch "python -m powerprof.sim.serve ... --draft {draft}
-np {np}" --vary draft=1,2,3,4,5 --vary np=1,2,3,4 --limits ...` in a subprocess (the real CLI,
the real launcher, a server process per configuration), then prints per configuration at the
reference limit: tok/s, J/token, acceptance and status; the mean tok/s per draft count (one
stream: the slots do not matter); the J/token-optimal configuration and its sweet-spot limit.
The simulated server's speed is the profile's 87 tok/s at draft 3 unless --decode-tok-s says otherwise.
--max-tokens defaults to windows of WINDOW_MARGIN x the short-windows threshold at that speed (`max_tokens_default`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from powerprof.energy import SHORT_COUNTER_WINDOW_S

# The short-windows threshold a run's first configurations are judged by: 10 refreshes of the 100 ms assumed until the
# sweep has estimated the counter's own refresh (powerprof.energy). Draft 3 decodes fastest, so its windows are the
# shortest; half as much again keeps a request whose acceptance ran lucky above it. At 128 tokens and 300 tokens/s
# every window was ~0.45 s and the levels were flagged short-windows (analysis/checks.py).
WINDOW_MARGIN = 1.5


def max_tokens_default(decode_tok_s: float) -> int:
    """--max-tokens (a multiple of 64) for windows of WINDOW_MARGIN x SHORT_COUNTER_WINDOW_S at `decode_tok_s`."""
    return int(-(-WINDOW_MARGIN * SHORT_COUNTER_WINDOW_S * decode_tok_s // 64) * 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limits", default="180,220,260,300")
    ap.add_argument("--decode-tok-s", type=float, default=87.0)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: max_tokens_default(--decode-tok-s)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.max_tokens is None:
        a.max_tokens = max_tokens_default(a.decode_tok_s)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(a.out or tempfile.mkdtemp(prefix="config-grid-")) / "run"
    out.parent.mkdir(parents=True, exist_ok=True)  # the sweep makes no tree of folders from --out
    env = dict(os.environ, POWERPROF_SIM_STATE=str(out.parent / "sim-state.json"))
    template = (f"{sys.executable} -m powerprof.sim.serve --profile seed-16g --port {port} "
                f"--decode-tok-s {a.decode_tok_s} --draft {{draft}} -np {{np}}")
    cmd = [sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "seed-16g", "--server", f"http://127.0.0.1:{port}",
           "--launch", template, "--vary", "draft=1,2,3,4,5", "--vary", "np=1,2,3,4", "--limits", a.limits,
           "--max-tokens", str(a.max_tokens), "--min-requests", "5", "--max-requests", "20", "--target-ci", "3%",
           "--warmup", "1", "--idle-s", "2", "--out", str(out)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if p.returncode:
        sys.exit(f"sweep failed ({p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}")
    lv = pq.read_table(out / "levels.parquet").to_pylist()
    top = max(r["level_value"] for r in lv if r["level_value"] is not None)
    print(f"grid: 20 configurations x limits {a.limits} W, --max-tokens {a.max_tokens}, in {wall:.0f} s; run directory {out}")
    print(f"\nat {top:g} W (the reference):")
    print(f"{'config':<14}{'status':<15}{'tok/s':>8}{'J/token':>9}{'±CI%':>6}{'accept':>8}")
    for r in lv:
        if r["level_value"] not in (top, None):
            continue
        f = lambda x, fmt: format("–", ">" + fmt.split(".")[0]) if x is None else format(x, fmt)  # noqa: E731
        print(f"{r['config_id']:<14}{r['config_status']:<15}{f(r['decode_tok_s'], '8.1f')}{f(r['gpu_j_per_token'], '9.3f')}"
              f"{f(r['ci_reached_pct'], '6.1f')}{f(r['draft_acceptance'] and 100 * r['draft_acceptance'], '7.0f')}%")
    print("\nmean over np (one stream), tok/s and J/token by draft count:")
    for d in range(1, 6):
        rs = [r for r in lv if r["knob_draft"] == d and r["level_value"] == top and r["config_status"] == "ok"]
        if rs:
            print(f"  draft {d}: {sum(r['decode_tok_s'] for r in rs) / len(rs):6.1f} tok/s  "
                  f"{sum(r['gpu_j_per_token'] for r in rs) / len(rs):.3f} J/token  ({len(rs)} configurations)")
    ana = json.loads((out / "analysis" / "analysis.json").read_text())
    conf = ana["configurations"]
    print(f"\nJ/token-optimal configuration: {conf['chosen']}")
    rec = ana["recommendation"]
    print(f"its sweet-spot limit: {rec['level_value']:g} W ({rec['speed_loss_pct']:.1f}% slower, "
          f"{rec['energy_saving_pct']:.1f}% less J/token than {top:g} W)")
    print("warnings:")
    for w in ana["warnings"]:
        print(f"  {w['kind']}: {w['message'][:160]}")


if __name__ == "__main__":
    main()
