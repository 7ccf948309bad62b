"""The /metrics parse cost of one daemon scrape and one sweep tally, this tree's servercount beside a baseline tree's.

    PYTHONPATH=TREE .venv/bin/python bench/scrape_parse.py --baseline OTHER_TREE

The daemon parses the server's /metrics page in its event loop, which the proxy shares, at every scrape (4 a second
while traffic moves): its cost is paid beside the proxy's per-token work. Two pages, built here in the servers' own
text format: vLLM's (0.11 names, one model, prometheus_client's process and GC families and ~17 histograms of about
20 buckets each, ~100 kB as the module says of a real one) and llama-server's (`--metrics`: a dozen counters and
gauges, ~2 kB). Per page, what a scrape parses (daemon/scrape.py: the token counter, and vLLM's process start time
or llama-server's decode calls) and what a sweep's tally parses (servercount.tally_from_metrics), each timed
2000 times by both trees, alternating, best of 5 (this machine's load moves both alike).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
LAT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _family(name: str, kind: str, samples: list[tuple[str, str, float]]) -> list[str]:
    out = [f"# HELP {name} {name.split(':')[-1].replace('_', ' ')}.", f"# TYPE {name} {kind}"]
    out += [f"{n}{{{labels}}} {v}" if labels else f"{n} {v}" for n, labels, v in samples]
    return out


def vllm_page() -> str:
    lab = f'engine="0",model_name="{MODEL}"'
    lines = []
    for gen in ("0", "1", "2"):
        lines += _family("python_gc_objects_collected_total", "counter",
                         [("python_gc_objects_collected_total", f'generation="{gen}"', 12345.0)])
    lines += _family("python_info", "gauge", [("python_info", 'implementation="CPython",major="3",minor="12"', 1.0)])
    for n, v in (("process_virtual_memory_bytes", 3.2e10), ("process_resident_memory_bytes", 2.1e9),
                 ("process_start_time_seconds", 1.7640001e9), ("process_cpu_seconds_total", 1234.5),
                 ("process_open_fds", 87.0), ("process_max_fds", 1048576.0)):
        lines += _family(n, "counter" if n.endswith("_total") else "gauge", [(n, "", v)])
    for n, v in (("vllm:num_requests_running", 12.0), ("vllm:num_requests_waiting", 0.0),
                 ("vllm:kv_cache_usage_perc", 0.31)):
        lines += _family(n, "gauge", [(n, lab, v)])
    for n, v in (("vllm:num_preemptions_total", 0.0), ("vllm:prompt_tokens_total", 1.2e6),
                 ("vllm:generation_tokens_total", 3.4e6), ("vllm:prefix_cache_queries_total", 1.2e6),
                 ("vllm:prefix_cache_hits_total", 4.0e5)):
        lines += _family(n, "counter", [(n, lab, v)])
        lines.append(f"{n.replace('_total', '_created')}{{{lab}}} 1.7640001e9")
    lines += _family("vllm:request_success_total", "counter",
                     [("vllm:request_success_total", f'{lab},finished_reason="{r}"', v)
                      for r, v in (("stop", 9000.0), ("length", 800.0), ("abort", 12.0))])
    hists = [(h, LAT_BUCKETS) for h in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds")]
    hists += [(h, TOKEN_BUCKETS) for h in (
        "vllm:iteration_tokens_total", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:request_max_num_generation_tokens", "vllm:request_params_max_tokens", "vllm:request_params_n",
        "vllm:request_prefill_kv_computed_tokens", "vllm:num_cached_tokens")]
    for name, buckets in hists:
        samples, cum = [], 0.0
        for i, le in enumerate(buckets):
            cum += 17.0 * (i + 1)
            samples.append((f"{name}_bucket", f'{lab},le="{float(le)}"', cum))
        samples += [(f"{name}_bucket", f'{lab},le="+Inf"', cum), (f"{name}_count", lab, cum),
                    (f"{name}_sum", lab, cum * 0.37), (f"{name}_created", lab, 1.7640001e9)]
        lines += _family(name, "histogram", samples)
    return "\n".join(lines) + "\n"


def llamacpp_page() -> str:
    lines = []
    for n, kind, v in (("llamacpp:prompt_tokens_total", "counter", 123456.0),
                       ("llamacpp:prompt_seconds_total", "counter", 45.6),
                       ("llamacpp:tokens_predicted_total", "counter", 654321.0),
                       ("llamacpp:tokens_predicted_seconds_total", "counter", 4567.8),
                       ("llamacpp:n_decode_total", "counter", 98765.0),
                       ("llamacpp:n_tokens_max", "counter", 4096.0),
                       ("llamacpp:n_busy_slots_per_decode", "counter", 3.4),
                       ("llamacpp:prompt_tokens_seconds", "gauge", 2712.3),
                       ("llamacpp:predicted_tokens_seconds", "gauge", 143.2),
                       ("llamacpp:requests_processing", "gauge", 4.0),
                       ("llamacpp:requests_deferred", "gauge", 0.0)):
        lines += _family(n, kind, [(n, "", v)])
    return "\n".join(lines) + "\n"


def load_tree(tree: Path, tag: str):
    spec = importlib.util.spec_from_file_location(f"powerprof.workload._{tag}_servercount",
                                                  tree / "powerprof" / "workload" / "servercount.py")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "powerprof.workload"  # its relative imports resolve in this tree (limits.py)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_call_us(fn, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="another source tree (a git worktree of main)")
    a = ap.parse_args()
    import powerprof.workload.servercount as this

    base = load_tree(a.baseline, "baseline")
    vllm, llama = vllm_page(), llamacpp_page()
    cases = {
        "vllm scrape": (vllm, lambda m, p: (m.counter_total(p, "vllm:generation_tokens_total"),
                                            m.counter_total(p, "process_start_time_seconds"))),
        "vllm tally": (vllm, lambda m, p: m.tally_from_metrics(p, 0)),
        "llama.cpp scrape": (llama, lambda m, p: (m.counter_total(p, "llamacpp:tokens_predicted_total"),
                                                  m.counter_total(p, "llamacpp:n_decode_total"))),
        "llama.cpp tally": (llama, lambda m, p: m.tally_from_metrics(p, 0)),
    }
    print(f"pages: vLLM {len(vllm.encode()) / 1e3:.1f} kB ({vllm.count(chr(10))} lines), "
          f"llama.cpp {len(llama.encode()) / 1e3:.1f} kB ({llama.count(chr(10))} lines)")
    print(f"{'case':18s} {'baseline':>10s} {'this tree':>10s}  (us per parse, best of 5)")
    for name, (page, fn) in cases.items():
        assert repr(fn(this, page)) == repr(fn(base, page)), name  # the same figures from both trees (Tally: two classes)
        best = {"b": float("inf"), "t": float("inf")}
        for _ in range(5):
            best["b"] = min(best["b"], per_call_us(lambda: fn(base, page)))
            best["t"] = min(best["t"], per_call_us(lambda: fn(this, page)))
        print(f"{name:18s} {best['b']:10.1f} {best['t']:10.1f}  ({best['t'] / best['b'] - 1:+.0%})")


if __name__ == "__main__":
    main()
