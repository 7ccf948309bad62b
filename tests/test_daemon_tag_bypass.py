"""A tag's J/token beside bypass traffic, against the simulator's truth.

A tag row's `gpu_energy_j` is every GPU joule over its window; its `proxy_tokens` only the tokens through the proxy.
Bypass traffic (requests straight to the server) in the window put its energy over tokens it never counted: the
tag's J/token read high, unmarked, with `server_count` `complete`. Now the row carries the bypass energy of its
window (`unproxied_energy_j`, its intervals' own) and its J/token is (gpu_energy_j − unproxied_energy_j) /
proxy_tokens (docs/daemon.md, Tag API; docs/data.md, daemon_tags)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _attribution import run  # noqa: E402

from powerprof.analysis.fleet import tag_summary  # noqa: E402
from powerprof.cli import main  # noqa: E402
from powerprof.workload.trace import synthetic  # noqa: E402

pytestmark = pytest.mark.slow

N = 48


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    """One tag window over 48 requests, one in three straight to the server (about a third of the tokens)."""
    trace = synthetic(N, 6.0, "bursty", prompt_median=200, output_median=60, seed=7)
    bypass = set(range(1, N, 3))
    o = run(trace, bypass=bypass, interval_s=0.5, data_dir=tmp_path_factory.mktemp("tagbp"), tag="job")
    # The truth of the window, for the proxied traffic: all the GPUs' energy over it (the counters' own, the
    # tag's gpu_energy_j) less the bypass requests' true energy, over the tokens the proxied requests generated.
    proxied = [i for i in range(N) if i not in bypass]
    true_tokens = sum(o.truth[str(i)]["generated"] for i in proxied)
    bypass_tokens = sum(o.truth[str(i)]["generated"] for i in bypass)
    return o, true_tokens, bypass_tokens


def test_the_tags_j_per_token_leaves_the_bypass_traffics_energy_out(outcome):
    o, true_tokens, bypass_tokens = outcome
    assert len(o.tags) == 1, o.tags
    row = o.tags.iloc[0]
    assert row["server_count"] == "complete", row["server_count"]
    assert bypass_tokens > 0.25 * (true_tokens + bypass_tokens)  # the case: a good part of the window's work
    assert row["proxy_tokens"] == pytest.approx(true_tokens, rel=0.01)
    truth = (row["gpu_energy_j"] - o.bypass_truth_j) / true_tokens
    # Before: gpu_energy_j / proxy_tokens, 1.5x the truth (this run: the bypass traffic's energy on the proxied
    # tokens). The bound is the attribution's own on bypass energy (tests/test_attribution_accuracy.py: unproxied
    # 0.9-1.3x the bypass truth) carried over to the window.
    assert row["unproxied_energy_j"] == pytest.approx(o.bypass_truth_j, rel=0.3), (row["unproxied_energy_j"],
                                                                                  o.bypass_truth_j)
    assert row["gpu_j_per_token"] == pytest.approx(truth, rel=0.12), (row["gpu_j_per_token"], truth)
    assert row["gpu_j_per_token"] == pytest.approx((row["gpu_energy_j"] - row["unproxied_energy_j"])
                                                   / row["proxy_tokens"], rel=1e-9)
    # What `powerprof tag stop` was answered: the same figures.
    a = o.tag_answer
    assert a["unproxied_energy_j"] == pytest.approx(row["unproxied_energy_j"], rel=1e-9)
    assert a["gpu_j_per_token"] == pytest.approx(row["gpu_j_per_token"], rel=1e-9)


def test_analyze_gives_the_tag_the_proxied_traffics_j_per_token(outcome, tmp_path):
    o, true_tokens, _ = outcome
    row = o.tags.iloc[0]
    truth = (row["gpu_energy_j"] - o.bypass_truth_j) / true_tokens
    got = tag_summary([str(o.data_dir)]).to_pylist()
    assert [r["name"] for r in got] == ["job"] and got[0]["counted_windows"] == 1, got
    assert got[0]["gpu_j_per_token"] == pytest.approx(truth, rel=0.12), (got[0]["gpu_j_per_token"], truth)
    assert got[0]["unproxied_energy_j"] == pytest.approx(row["unproxied_energy_j"], rel=1e-9)
    res = CliRunner().invoke(main, ["analyze", str(o.data_dir)])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stdout.splitlines() if " job " in x)
    assert f"{got[0]['gpu_j_per_token']:.3f}" in line, res.stdout
