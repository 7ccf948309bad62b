"""Does powerprof's sampling slow the decode server it measures? Batches of 8 with the Profiler at 10 Hz, 1 Hz, none.

In every real-H200 run of bench/gpu_check.py (docs/hardware.md) the check's own concurrency-8 batch, measured with
the Profiler at 10 Hz in the client's process, decoded at 60-68 ms per step, while the CLI's measure (1 Hz) and the
daemon (1 Hz) on the same server minutes later ran batches of 8 at ~30 ms. This run tells the causes apart: one cold
batch of 8 with nothing sampling, then rounds of the same batch under each sampler setting in alternating order, each
batch's step time from the server's own batch log. Read-only (gpu_check's setter guard); writes observer.json.

    python bench/gpu_observer.py --out DIR                          # real GPU: the 8B random-weight server
    python bench/gpu_observer.py --out DIR --simulate --model fake  # the paths, without torch (the test)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check import _generator_rates, install_guard, start_decode_server, wait_server  # noqa: E402

SETTINGS = {"10hz": 0.1, "1hz": 1.0, "none": None}  # the Profiler's interval in seconds (None: no Profiler)


def one_batch(ctx, interval_s: float | None, concurrency: int) -> dict:
    """One measured batch of `concurrency` streams with the Profiler at interval_s; its step time by the server's log."""
    from powerprof.profiler import Profiler
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import builtin_prompts
    from powerprof.workload.measure import measure

    since = time.monotonic_ns()
    params = RequestParams(max_tokens=ctx.max_tokens)
    kw = dict(prompts=builtin_prompts("short"), n_requests=concurrency, concurrencies=(concurrency,), params=params,
              warmup=0)
    if interval_s is None:
        res = measure(ctx.url, **kw)
    else:
        with Profiler(ctx.nvml, [ctx.index], interval_s=interval_s) as profiler:
            res = measure(ctx.url, profiler=profiler, **kw)
    gen = _generator_rates(ctx, concurrency, since)
    if not res.summaries:  # nothing measured (the server gone, a stop): said, and the run goes on
        return {"error": (res.aborted or "no summary")[:300], "generator_tok_s": gen.get("tok_s"),
                "step_ms": gen.get("step_ms_median"), "batches": gen.get("batches")}
    summ = res.summaries[0]
    return {"decode_tok_s": summ.decode_tok_s, "gpu_j_per_token": summ.gpu_j_per_token, "n_ok": summ.n_ok,
            "generator_tok_s": gen.get("tok_s"), "step_ms": gen.get("step_ms_median"), "batches": gen.get("batches")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--simulate", nargs="?", const="h200-141g", default=None)
    ap.add_argument("--model", default="8b", choices=["tiny", "1b", "3b", "8b", "fake"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--sequence", default=None,
                    help="Instead of the rounds: batches of these concurrencies in this order with nothing sampling, "
                         "e.g. 1,1,1,8,8,1,8 (is the first batch of a new size slow?).")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    install_guard(out / "setter_calls.jsonl")
    if a.simulate:
        from powerprof.sim.nvml import SimNVML

        nvml = SimNVML(a.simulate, count=a.gpu + 1)
    else:
        import pynvml as nvml
    nvml.nvmlInit()
    ctx = SimpleNamespace(out=out, index=a.gpu, nvml=nvml, sim_server=None, max_tokens=a.max_tokens)
    proc = start_decode_server(ctx, a.model, "cpu" if a.simulate else "cuda")
    report: dict = {"model": a.model, "simulated": bool(a.simulate), "max_tokens": a.max_tokens, "runs": []}
    try:
        report["server"] = wait_server(ctx, proc, 240)
        ctx.url = report["server"]["url"]
        order = [("cold", "none", 8), ("warm-1", "none", 1)]
        if a.sequence:
            order = [(f"batch {k + 1}", "none", int(c)) for k, c in enumerate(a.sequence.split(","))]
        for r in range(0 if a.sequence else a.rounds):
            names = list(SETTINGS)
            names = names[r % len(names):] + names[:r % len(names)]  # each setting first in one round
            order += [(f"round {r + 1}", name, 8) for name in names]
        for label, name, c in order:
            t0 = time.monotonic()
            run = {"label": label, "sampler": name, "concurrency": c, **one_batch(ctx, SETTINGS[name], c)}
            run["seconds"] = round(time.monotonic() - t0, 1)
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            (out / "observer.json").write_text(json.dumps(report, indent=1))
        steps = {name: [x["step_ms"] for x in report["runs"] if x["sampler"] == name and x["label"].startswith("round")
                        and x["step_ms"]] for name in SETTINGS}
        report["step_ms_median_by_sampler"] = {k: statistics.median(v) if v else None for k, v in steps.items()}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        nvml.nvmlShutdown()
    calls = (out / "setter_calls.jsonl").read_text().splitlines() if (out / "setter_calls.jsonl").exists() else []
    report["setter_calls"] = len(calls)
    (out / "observer.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"step_ms_median_by_sampler": report.get("step_ms_median_by_sampler"), "setter_calls": len(calls)}))
    return 0 if not calls else 2


if __name__ == "__main__":
    sys.exit(main())
