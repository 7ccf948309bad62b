"""Per-request energy by API kind against the simulator's truth: chat, n = 2 chat, messages, responses, embeddings.

    python bench/attribution_mixed.py            # 400 requests, about a minute of replay
    python bench/attribution_mixed.py --requests 200 --json
    python bench/attribution_mixed.py --requests 800 --flavour vllm   # vLLM's answers (n = 2: its prompt said once)
    python bench/attribution_mixed.py --flavour sglang   # SGLang: chat beside its native /generate (streamed, whole, batch)

The daemon (1 Hz) runs in front of the simulated continuous-batching server in llama.cpp's flavour (llama-server
with `--embeddings` serves all five kinds at once); a bursty synthetic trace gives each request a kind. Printed per
kind: the sum error (Σ estimated / Σ true − 1) and the per-request |error| median and p95 of the work model's
figure; nothing is asserted (tests/test_attribution_mixed.py asserts a small version).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attribution import SGLANG_KINDS, SGLANG_WEIGHTS, mixed_trace, run_mixed, score_mixed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--flavour", default="llamacpp", choices=["llamacpp", "vllm", "sglang"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", metavar="DIR", help="keep the daemon's datasets in DIR")
    a = ap.parse_args()
    t = time.monotonic()
    kinds = dict(kinds=SGLANG_KINDS, weights=SGLANG_WEIGHTS) if a.flavour == "sglang" else {}
    o = run_mixed(mixed_trace(a.requests, a.rate, a.seed, **kinds), data_dir=Path(a.keep) if a.keep else None, flavour=a.flavour)
    s = score_mixed(o)
    s["bench_s"] = time.monotonic() - t
    if a.json:
        print(json.dumps(s, indent=2, default=str))
        return
    print(f"{s['n_requests']} requests ({', '.join(s['notes'])}), {s['n_scored']} scored (arriving once the fit was "
          f"mature); bench {s['bench_s']:.0f} s; conservation {100 * s['conservation_err']:.3f}%")
    for title, key in (("scored (the fit mature)", "kinds"), ("all requests (the warm-up's fixed ratio included)", "kinds_all")):
        print(f"\n{title}")
        print(f"{'kind':<12} {'n':>4} {'true J':>9} {'est J':>9} {'sum err':>8} {'median |err|':>12} {'p95 |err|':>9} "
              f"{'no share':>8}")
        for k, m in sorted(s[key].items()):
            print(f"{k:<12} {m['n']:>4} {m['true_j']:>9.0f} {m['est_j']:>9.0f} {100 * m['sum_err']:>7.1f}% "
                  f"{100 * m['median_abs_err']:>11.1f}% {100 * m['p95_abs_err']:>8.1f}% {m['no_share']:>8}")
    print(f"requests: true {s['requests_true_j']:.0f} J, estimated {s['requests_est_j']:.0f} J; unproxied {s['unproxied_j']:.0f} J")


if __name__ == "__main__":
    main()
