"""The daemon ledger's `on_tokens` cost per piece, this tree's beside a baseline tree's, in one run.

    PYTHONPATH=TREE .venv/bin/python bench/ledger_on_tokens.py --baseline OTHER_TREE [--rounds 5]

The proxy (or a proxy worker's record, replayed by the daemon) calls `Ledger.on_tokens` once per piece of a stream's
tokens. 50 streams, 200 pieces each, 20 ms apart (a proxy worker's record period), the streams' stamps interleaved as
the event loop sees them; a ledger with one GPU edge read (pieces after it) and the server scraped (`server_seen`: each
event is also listed for the scrape windows), as in the daemon. A one-token piece is placed at its stamp; a piece of
several steps (5 tokens: 250 tokens/s a stream) is spread over the time since the stream's previous piece
(`PIECE_STEPS`). Each case is run on a fresh ledger by both trees, alternating, best of `--rounds`; µs per piece.
The baseline's ledger.py is loaded beside this tree's (its other modules are this tree's: compare trees that differ
in powerprof/daemon/ledger.py only).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

STREAMS = 50
PIECES = 200
PERIOD_NS = 20_000_000


def load_baseline(tree: Path):
    spec = importlib.util.spec_from_file_location("powerprof.daemon._baseline_ledger",
                                                  tree / "powerprof" / "daemon" / "ledger.py")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "powerprof.daemon"  # its relative imports resolve in this tree
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_piece_us(mod, tokens: int) -> float:
    from powerprof.daemon.proxy import RequestTrace

    led = mod.Ledger("bench", 0, 1, lambda kind, rows: None)
    led.add_gpu_edge(0, 0, [0.0])
    # A baseline tree from before reconcile.py kept the scrape state on the ledger itself.
    (led.recon if hasattr(led, "recon") else led).server_seen = True
    t0 = 1_000_000_000
    traces = []
    for i in range(STREAMS):
        tr = RequestTrace(i, "POST", "/v1/chat/completions", None, t0, t0, api="openai-chat", stream=True,
                          first_ns=t0)
        led.on_start(tr)
        traces.append(tr)
    calls = [(tr, t0 + p * PERIOD_NS + i * 300_000, tokens) for p in range(1, PIECES + 1)
             for i, tr in enumerate(traces)]
    on_tokens = led.on_tokens
    start = time.perf_counter()
    for tr, t, n in calls:
        on_tokens(tr, t, n)
    return (time.perf_counter() - start) / len(calls) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="another source tree (a git worktree of main)")
    ap.add_argument("--rounds", type=int, default=5, help="best of this many runs of each case and tree")
    ap.add_argument("--tokens", default="1,5", help="tokens a piece, comma-separated")
    a = ap.parse_args()
    if not (a.baseline / "powerprof" / "daemon" / "ledger.py").is_file():
        sys.exit(f"--baseline {a.baseline}: no powerprof/daemon/ledger.py there")
    if a.rounds < 1:
        sys.exit("--rounds must be at least 1")
    import powerprof.daemon.ledger as this

    base = load_baseline(a.baseline)
    print(f"{'tokens a piece':16s} {'baseline':>10s} {'this tree':>10s}  (us per piece, best of {a.rounds})")
    for tokens in [int(x) for x in a.tokens.split(",")]:
        best = {"b": float("inf"), "t": float("inf")}
        for _ in range(a.rounds):
            best["b"] = min(best["b"], per_piece_us(base, tokens))
            best["t"] = min(best["t"], per_piece_us(this, tokens))
        print(f"{tokens:<16d} {best['b']:10.2f} {best['t']:10.2f}  ({best['t'] / best['b'] - 1:+.0%})")


if __name__ == "__main__":
    main()
