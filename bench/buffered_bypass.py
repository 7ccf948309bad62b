"""Measures the daemon's attribution of streams held back on their way (a buffering hop) beside bypass traffic that is steady, starts and stops, or comes in clumps, against the simulator's truth.

The proxied trace is test_daemon_delivery.py's (40 chat and messages streams at 4/s on the simulated vLLM, delivered
in one burst at their end or in 4 kB bursts); beside it, chat requests sent straight to the server (the hop buffers
them too: what the daemon sees of them is only the server's token counter, so their own delivery changes nothing).
Per case: the proxied requests' summed and per-row error, `unproxied` against the bypass requests' true energy, the
rows off by over 10% that carry no mark, and the `complete` intervals whose bypass count is off the truth by more
than an unmarked row keeps (a token and LAG_SHARE of its window's count: docs/daemon.md, "A server restart").

    PYTHONPATH=$PWD python bench/buffered_bypass.py [--runs 1] [--flavour vllm] [--cases steady,onoff,clumps] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _attribution import mixed_trace, run_mixed  # noqa: E402
from powerprof.workload.trace import TraceRequest  # noqa: E402

SCRAPE_S = 0.25  # the daemon's scrape period (scrape.interval_s's default)
OFF_SHARE = 0.10  # a row further than this from its truth must carry a mark
# What marks a request row's figure as possibly off (its energy_note): the burst's own note, a bypass count the proxy's
# lag or a changed bypass pace may have moved, or any other flag the ledger writes there.
MARKS = ("approximate:", "proxy_lag", "bypass", "late", "no-counter-short", "cache")

DELIVERIES = {"one-burst": {"delivery": "buffered"}, "4kB": {"delivery": "bursts", "burst_bytes": 4096}}


def bypass_traffic(case: str, span_s: float, seed: int = 11) -> list[TraceRequest]:
    """Chat requests straight to the server over the proxied trace's `span_s`: `steady` one every 0.4 s; `onoff` one
    every 0.2 s for 1.5 s, then none for 1.5 s (starting and stopping inside held spans: a buffered stream here runs
    1-4 s); `clumps` eight at once every 2.5 s (bursty). Outputs 30-120 tokens, prompts 100-400."""
    rng = np.random.default_rng(seed)
    if case == "none":
        ts = np.zeros(0)
    elif case == "steady":
        ts = np.arange(0.0, span_s, 0.4)
    elif case == "onoff":
        ts = np.array([t for t in np.arange(0.0, span_s, 0.2) if (t % 3.0) < 1.5])
    elif case == "clumps":
        ts = np.repeat(np.arange(0.5, span_s, 2.5), 8)
    else:
        raise ValueError(case)
    return [TraceRequest(float(t), int(rng.integers(100, 400)), int(rng.integers(30, 120)), "bypass") for t in ts]


def _edge_slack(tok: np.ndarray, e: int, windows: np.ndarray | None = None) -> float:
    """How far an interval edge at `e` may move a true count by the daemon's own rule, not a fault: a scrape window's
    bypass tokens are spread evenly over it (docs/daemon.md, "Placed over the time it covers"), so at an edge inside a
    window the share either side is its time's, not where the tokens ran (a clump of bypass requests starting: 48
    tokens in one window). The most that moves over where a `scrape.interval_s` window may lie, or more where one of
    the run's own `windows` (Outcome.scrape_windows_ns) holding `e` moved more: a scrape late or failed on a loaded
    host makes windows of 0.5-2 s, and bypass traffic that starts or stops inside one is spread over all of it: beside
    a loaded suite and CPU hogs (load 10-17 on 2 cores), one of the 13 intervals 7 llama.cpp runs said `complete` and
    off (60 bypass tokens for 26, windows of 0.56-0.68 s) was that spread: 42 tokens allowed, where a 0.25 s window
    allowed 16. (Another came within its bound by 2 tokens; the other 11 are not the spread: docs/daemon.md,
    "A stream held back on its way".)"""
    def moved(w0: int, w1: int) -> float:
        n_all = np.searchsorted(tok, w1, side="right") - np.searchsorted(tok, w0, side="right")
        n_before = np.searchsorted(tok, e, side="right") - np.searchsorted(tok, w0, side="right")
        return abs(float(n_before) - (e - w0) / (w1 - w0) * float(n_all))

    p = int(SCRAPE_S * 1e9)
    worst = max(moved(int(w0), int(w0) + p) for w0 in np.linspace(e - p, e, 26).astype(np.int64))
    if windows is not None and len(windows):
        for w0, w1 in windows[(windows[:, 0] < e) & (windows[:, 1] > e)]:
            worst = max(worst, moved(int(w0), int(w1)))
    return worst


def score(o) -> dict:
    """Every figure the task reports, from one run_mixed Outcome."""
    r = o.requests[o.requests["true_j"].notna()]
    est = r["gpu_energy_j"].fillna(0.0)
    err = (est / r["true_j"] - 1.0).to_numpy()
    notes = r["energy_note"].fillna("")
    marked = notes.apply(lambda s: any(m in s for m in MARKS)).to_numpy()
    lag_said = notes.str.contains("proxy_lag").to_numpy()
    off = np.abs(err) > OFF_SHARE
    iv = o.intervals
    bad_complete, lag_iv, off_tokens = 0, 0, 0.0
    tok = o.bypass_tokens if o.bypass_tokens is not None else np.zeros(0, dtype=np.int64)
    for _, row in iv.iterrows():
        if row["server_tokens"] is None or np.isnan(row["server_tokens"]):
            continue
        a, b = int(row["t_start_utc"].value), int(row["t_end_utc"].value)
        true = float(np.searchsorted(tok, b, side="right") - np.searchsorted(tok, a, side="right"))
        got = float(row["server_tokens"])
        slack = _edge_slack(tok, a, o.scrape_windows_ns) + _edge_slack(tok, b, o.scrape_windows_ns)
        if "proxy_lag" in (row["server_count"] or ""):
            lag_iv += 1
        elif row["server_count"] == "complete" and \
                abs(got - true) > 1.0 + 0.05 * (row["proxy_tokens"] + got) + slack + 1e-6:
            bad_complete += 1
            off_tokens += abs(got - true)
    return {
        "n": int(len(r)),
        "requests_err": float(est.sum() / r["true_j"].sum() - 1.0),
        "row_err_median": float(np.median(np.abs(err))), "row_err_p95": float(np.percentile(np.abs(err), 95)),
        "row_err_max": float(np.abs(err).max()),
        "rows_off": int(off.sum()), "rows_off_unmarked": int((off & ~marked).sum()),
        "rows_off_no_lag_mark": int((off & ~lag_said).sum()),
        "rows_lag_said": int(lag_said.sum()),
        "bypass_truth_j": o.bypass_truth_j, "unproxied_j": o.unproxied_j,
        "unproxied_err": (o.unproxied_j / o.bypass_truth_j - 1.0) if o.bypass_truth_j > 0 else None,
        "unproxied_share_of_requests": o.unproxied_j / float(r["true_j"].sum()),
        "intervals": int(len(iv)), "intervals_proxy_lag": lag_iv, "intervals_complete_off": bad_complete,
        "complete_off_tokens": off_tokens, "bypass_tokens": int(len(tok)),
        "worst_rows": sorted(((round(float(e), 3), n[:90]) for e, n in zip(err, notes) if abs(e) > OFF_SHARE),
                             key=lambda x: -abs(x[0]))[:4],
    }


def run_case(delivery: str, case: str, data_dir: Path | None = None, flavour: str = "vllm", seed: int = 7) -> dict:
    kinds = ("chat", "messages") if flavour == "vllm" else ("chat",)
    trace = mixed_trace(40, 4.0, seed=seed, kinds=kinds, weights=(0.5, 0.5) if len(kinds) == 2 else (1.0,))
    span = max(t.t_s for t in trace) + 1.0
    o = run_mixed(trace, data_dir=data_dir, flavour=flavour, server=DELIVERIES[delivery],
                  bypass=bypass_traffic(case, span))
    s = score(o)
    s["conservation_err"] = float(o.intervals[["requests_energy_j", "idle_energy_j", "unproxied_energy_j"]]
                                  .to_numpy().sum() / o.measured_j - 1.0)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--flavour", default="vllm")
    ap.add_argument("--deliveries", default="one-burst,4kB")
    ap.add_argument("--cases", default="steady,onoff,clumps")
    # The proxied trace's seed. A run is not repeatable by it alone: the daemon, the simulator and the clients run in
    # real time, and where a burst falls against the scrape windows moves with the host's load (the clumps fault of
    # docs/daemon.md showed in 1 run of 4 at the same seed); the ledger's unit tests pin such cases.
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    for d in a.deliveries.split(","):
        for c in a.cases.split(","):
            for k in range(a.runs):
                s = run_case(d, c, flavour=a.flavour, seed=a.seed)
                print(json.dumps({"flavour": a.flavour, "delivery": d, "bypass": c, "run": k,
                                  **{key: (round(v, 4) if isinstance(v, float) else v) for key, v in s.items()}}),
                      flush=True)


if __name__ == "__main__":
    main()
