"""Bench: the daemon's per-interval GPU energy with and without dropping request edges read as one refresh's value again.

Offline and deterministic: one GPU whose power steps every 50-600 ms (100-600 W), its counter refreshed every 100 ms
(an H200's), ticks at 1 Hz (counter and power) and request edges every 0.1-0.4 s (counter alone), fed to the real
`Ledger` twice: as it is, and with `Ledger._stale_edge` (and the tick's replacing of such an edge) turned off. Each
interval's `gpu_energy_j` is compared with the true energy between its own edges.

    .venv/bin/python bench/daemon_stale_edges.py [--seconds 60] [--seeds 5]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import powerprof.daemon.ledger as ledger  # noqa: E402
from support import LedgerReading  # noqa: E402

S = 1_000_000_000


def run(seed: int, seconds: int, refresh_ns: int = 100_000_000) -> dict:
    rng = random.Random(seed)
    t, steps = 0, []
    while t < (seconds + 2) * S:
        steps.append((t, rng.choice([100.0, 600.0, 400.0, 450.0])))
        t += int(rng.uniform(0.05, 0.6) * S)
    ts = np.array([a for a, _ in steps], dtype=np.int64)
    ps = np.array([p for _, p in steps])
    cum = np.concatenate([[0.0], np.cumsum(ps[:-1] * np.diff(ts) / 1e9)])

    def true_at(x: int) -> float:
        i = int(np.searchsorted(ts, x, side="right")) - 1
        return float(cum[i] + ps[i] * (x - ts[i]) / 1e9)

    phase = rng.randrange(refresh_ns)

    def counter(x: int) -> float:  # the value of the latest refresh at or before x, in mJ as NVML gives it
        return round(true_at(max(((x - phase) // refresh_ns) * refresh_ns + phase, 0)), 3)

    events = [(k * S + 1, "tick") for k in range(seconds + 1)]
    x = 0.0
    while (x := x + rng.uniform(0.1, 0.4)) < seconds:
        events.append((int(x * S), "edge"))
    rows: list[dict] = []
    led = ledger.Ledger("bench", 0, 1, lambda name, r: rows.extend(r) if name == "intervals" else None, grace_s=0.3)
    for t, kind in sorted(events):
        if kind == "tick":
            led.add_gpu_sample(t, t, [LedgerReading(counter(t), float(ps[np.searchsorted(ts, t, side="right") - 1]))])
        else:
            led.add_gpu_edge(t, t, (counter(t),))
        led.advance(t)
    led.advance((seconds + 5) * S)
    err, true = [], []
    for r in rows:
        a = round(r["t_start_mono_s"] * 1e9)
        b = a + round(r["duration_s"] * 1e9)
        err.append(r["gpu_energy_j"] - (true_at(b) - true_at(a)))
        true.append(true_at(b) - true_at(a))
    err, true = np.array(err), np.array(true)
    rel = np.abs(err) / true
    return {"n": len(rows), "zero": int(sum(r["gpu_energy_j"] == 0 for r in rows)), "abs_j": float(np.abs(err).sum()),
            "median": float(np.median(rel)), "p95": float(np.percentile(rel, 95))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    for seed in range(1, args.seeds + 1):
        out = []
        for drop in (True, False):
            if drop:
                r = run(seed, args.seconds)
            else:
                with mock.patch.object(ledger.Ledger, "_stale_edge", lambda self, e: False), \
                        mock.patch.object(ledger, "_same_reads", lambda a, b: False):
                    r = run(seed, args.seconds)
            out.append(f"{'dropped' if drop else 'kept'}: {r['n']} intervals, {r['zero']} at 0 J, sum |error| "
                       f"{r['abs_j']:.0f} J, median {100 * r['median']:.1f}%, p95 {100 * r['p95']:.0f}%")
        print(f"seed {seed}: " + "; ".join(out))


if __name__ == "__main__":
    main()
