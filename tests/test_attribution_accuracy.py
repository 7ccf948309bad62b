"""The daemon's per-request energy against the simulator's truth, on a small production-like trace.

The small version of bench/attribution_accuracy.py (which prints the full acceptance table on
2000 requests): 240 requests, bursty arrivals, one in ten bypassing the proxy, 1 Hz sampling.
The bounds here are looser than the bench's acceptance bounds where the fit has less time to
mature on a short run; the structural ones (conservation, every token attributed) are exact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _attribution import run, score  # noqa: E402
from support import side_by_side  # noqa: E402

from powerprof.workload.trace import TraceRequest, synthetic  # noqa: E402

pytestmark = pytest.mark.slow

N_SGLANG = 160


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Both runs at once, each in its own process (tests/support.py side_by_side): 55 s, not 88 s."""
    n = 240
    trace = synthetic(n, 9.0, "bursty", prompt_median=300, output_median=60, tags=("chat", "rag", "batch"), seed=11)
    sglang_trace = synthetic(N_SGLANG, 9.0, "bursty", prompt_median=300, output_median=60,
                             tags=("chat", "rag", "batch"), seed=11)
    return side_by_side(request, {
        "outcome": (run, (trace,), dict(bypass=set(range(7, n, 10)), tail=[TraceRequest(0.0, 200, 64, "probe")] * 4,
                                        data_dir=tmp_path_factory.mktemp("attr"))),
        "sglang_outcome": (run, (sglang_trace,), dict(bypass=set(range(7, N_SGLANG, 10)),
                                                      data_dir=tmp_path_factory.mktemp("attr-sglang"), flavour="sglang")),
    })


@pytest.fixture(scope="module")
def outcome(runs):
    o = runs["outcome"].result()
    return o, score(o)


def test_every_token_is_attributed_and_every_joule_lands_somewhere(outcome):
    o, s = outcome
    assert s["tokens_attributed_share"] >= 0.99
    assert abs(s["conservation_err"]) <= 0.001
    parts = o.intervals[["requests_energy_j", "idle_energy_j", "unproxied_energy_j"]].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(o.intervals["gpu_energy_j"].to_numpy(), rel=1e-9, abs=1e-9)
    assert (o.requests["attributed_tokens"] == o.requests["generated_tokens"]).mean() >= 0.99


def test_the_work_model_beats_time_and_token_shares_against_truth(outcome):
    _, s = outcome
    m = s["methods"]
    # Compared over every request (the fit's warm-up included, split with the fixed ratio): the scored
    # set (requests after the fit matured) is 5 to 37 requests from run to run on this short trace, as
    # the fit matures sooner or later, and on 1-8 of them the median said nothing (one CI run: time
    # share 0.2%, the work model 2.4%). Over all ~200 requests, three quiet runs: work model 6.6-7.5%
    # median / 20-21% p95, time share 20-22% / 68-71%, token share 21% / 60-62%.
    assert m["work model"]["median_abs_err_all"] < 0.12
    assert m["work model"]["median_abs_err_all"] < 0.75 * min(m["time share"]["median_abs_err_all"],
                                                              m["token share"]["median_abs_err_all"])
    assert m["work model"]["p95_abs_err_all"] < m["token share"]["p95_abs_err_all"]
    if s["n_scored"] >= 20:
        # Measured on this run's configuration alone: 2.9% / 8.5% (before the issue-11 placement work:
        # 5.4% / 13.9%); inside a loaded full-suite run the p95 of its ~37 scored requests reached 34%,
        # so only the median has an absolute bound.
        assert m["work model"]["median_abs_err"] < 0.1


def test_requests_alone_get_their_own_edges_from_the_energy_counter(outcome):
    # Each probe runs alone: the counters are read at its arrival and (0.1 s after) its end, so it
    # is measured over its own span, not a whole 1 s interval.
    o, _ = outcome
    probes = o.requests[o.requests["tail"]]
    assert o.edge_reads >= 2 * len(probes)
    iv = o.intervals
    mids = (probes["t_arrival_utc"].astype("int64") + probes["t_end_utc"].astype("int64")) // 2
    t0, t1 = iv["t_start_utc"].astype("int64"), iv["t_end_utc"].astype("int64")
    for mid in mids:
        own = iv[(t0 <= mid) & (t1 > mid)]
        assert len(own) == 1 and own["duration_s"].iloc[0] < 0.9  # it took about 0.45 s: not a 1 s tick


def test_edge_reads_keep_to_their_cpu_budget_at_the_real_counters_cost(outcome):
    # The simulated H200 costs what a real one does per counter read (~3 ms of CPU, 15 ms one in
    # 50: docs/hardware.md). At the old fixed cap of 20 reads/s that was 6% of a core per GPU; the
    # daemon now spaces the reads by their own measured cost (attribution.edge_cpu_share, 1%).
    o, _ = outcome
    assert o.edge_reads > 0
    assert o.edge_cpu_s / o.wall_s <= 0.01 * 1.5, (o.edge_reads, o.edge_cpu_s, o.wall_s)


def test_identical_requests_alone_get_the_same_j_per_token(outcome):
    # Four probes on a short run: 1.2% here (1.2-1.4% on the bench's 2000 requests, loaded or not),
    # since each request alone is read at its arrival and 0.1 s after its end (the counter lags by
    # its refresh); before that, 4.3% here and 5.02% once on a loaded CI run. On a loaded machine
    # the simulator's own truth for them spreads too (its engine runs on a late event loop), so
    # the bound is beyond what truth itself shows, not a share of a spread that is really there.
    # Alone this run gives 0.06-0.3% (truth 0.1-0.2%); beside the suite's other xdist worker one
    # probe of four came out 5.7% and 6.0% off in two of six full runs and one partial run (truth 0.2%).
    # Cause: the simulated H200's energy counter refreshes every 100 ms, as a real one does, so each
    # edge reads a value up to 100 ms old (~4-8 J at the edges' power, of ~128 J a probe). Unloaded,
    # the four probes fall at the same phase of the refresh and agree; under load their edge reads
    # scatter across it (loaded, 100 ms: 7.2% and 9.3% spread, truth 2.1% and 7.0%; with the counter
    # refreshed continuously, the same load gave each probe within 0.3-1.1% of truth but one). 8% holds that.
    _, s = outcome
    spread, truth = s["methods"]["work model"]["identical_spread"], s["identical_truth_spread"]
    assert spread <= 0.08 + truth, (spread, truth)


def test_bypass_energy_goes_to_unproxied(outcome):
    # Measured 106.5% on this trace (112.9% before the scrape windows became busy time and the
    # proxy's lag stopped passing for bypass traffic). The bypass requests' own per-token cost is
    # unseen (they are charged the proxied tokens' cost), which alone moves the figure by the
    # difference between the two mixes: on 24 bypass requests, several percent either way. On a loaded
    # machine (the suite twice at once beside a CPU-bound job) 115.1%: the simulated server, the daemon and
    # the load share two cores, and the proxy's lag grows; 122.2% once in a full-suite run on four workers
    # (two per core). Quiet, after this session's ledger fixes: 105.6-110.8%. bench/attribution_accuracy.py
    # reports the figure.
    _, s = outcome
    assert 0.9 <= s["bypass_share_in_unproxied"] <= 1.3, s["bypass_share_in_unproxied"]


@pytest.fixture(scope="module")
def sglang_outcome(runs):
    o = runs["sglang_outcome"].result()
    return o, score(o), set(range(7, N_SGLANG, 10))


def test_bypass_traffic_beside_sglang_is_found_and_proxied_tokens_are_not_taken_for_it(sglang_outcome):
    # SGLang's counter moves when a request finishes. Compared with the proxy's tokens as they streamed, its jumps read
    # as bypass tokens: this run, 3388 "bypass" tokens against the 1171 the bypass requests made, unproxied 134% of
    # their true energy and the proxied requests 3.1% low. Compared with the proxied requests' tokens at their ends:
    # 1171 of 1171, 86% (79% on a loaded machine) with the requests +1.1% (+2.2%) while a bypass request's tokens were
    # placed in the scrape window it finished in; spread back over its run (SGLang's e2e latency histogram less the
    # proxied requests' durations: docs/daemon.md, Bypass traffic), 107% (two runs: 106.7%, 107.4%), the requests
    # -0.6%. The bound is vLLM's (test_bypass_energy_goes_to_unproxied): the bypass requests are charged the proxied
    # tokens' cost per interval there too.
    o, s, bypass = sglang_outcome
    assert abs(s["conservation_err"]) <= 0.001
    true_tokens = sum(o.truth[str(i)]["generated"] for i in bypass)
    assert o.intervals["server_tokens"].sum() == pytest.approx(true_tokens, rel=0.05)
    assert 0.9 <= s["bypass_share_in_unproxied"] <= 1.3, s["bypass_share_in_unproxied"]
    r = o.requests[~o.requests["tail"] & o.requests["true_j"].notna()]
    assert abs(r["gpu_energy_j"].sum() / r["true_j"].sum() - 1) < 0.06
