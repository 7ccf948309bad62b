"""The ledger: closing intervals as samples arrive, per-request and per-tag accounts, bypass traffic."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import pytest

from powerprof.collectors.rapl import RaplCollector
from powerprof.daemon.ledger import Ledger
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.streams import Counts
from powerprof.sim.powercap import SimPowercap

S = 1_000_000_000


@dataclass
class R:  # the fields of a GpuReading the ledger uses
    energy_j: float | None
    power_w: float | None
    power_avg_w: float | None = None


class Sink:
    def __init__(self):
        self.rows = {"requests": [], "intervals": [], "tags": [], "costs": []}

    def __call__(self, name, rows):
        self.rows[name].extend(rows)


def _trace(rid, arrival_s, stream=True):
    return RequestTrace(rid, "POST", "/completion", "t", int(arrival_s * S), 0, api="llamacpp", stream=stream)


def _feed(ledger, t_s, energy_j, power_w=200.0):
    ledger.add_gpu_sample(int(t_s * S), int(t_s * S), [R(energy_j, power_w)])


def test_requests_are_emitted_with_their_energy_once_their_intervals_close():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = _trace(1, 0.1), _trace(2, 0.2)
    for tr in (a, b):
        led.on_start(tr)
    _feed(led, 0.0, 1000.0)
    _feed(led, 1.0, 1100.0)  # prefill of both inside [0, 1)
    for k in range(10):  # decode in [1, 2): a gets 3 tokens per b's 1
        t = int((1.0 + 0.09 * k) * S)
        led.on_tokens(a, t, 3)
        led.on_tokens(b, t, 1)
    a.first_ns = b.first_ns = int(1.0 * S)  # prefill ended exactly at the edge
    a.last_ns = b.last_ns = int(1.81 * S)
    led.advance(int(1.95 * S))
    assert sink.rows["intervals"] == []  # held: their prompt lengths are not known yet
    a.end_ns = b.end_ns = int(1.9 * S)
    a.counts = Counts(generated_tokens=30, prompt_tokens=100, model=None, stop_reason=None, token_source="usage")
    b.counts = Counts(generated_tokens=10, prompt_tokens=300, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    led.on_end(b)
    _feed(led, 2.0, 1300.0)
    led.advance(int(2.05 * S))
    assert sink.rows["requests"] == []  # the closing edge is still inside the grace period
    led.advance(int(2.2 * S))
    kinds = [r["kind"] for r in sink.rows["intervals"]]
    assert kinds == ["prefill", "decode"]
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    # [0,1): prefill of 100 and 300 prompt tokens (the fixed ratio); [1,2): 3:1 tokens.
    assert got[1]["gpu_energy_j"] == pytest.approx(25.0 + 150.0) and got[2]["gpu_energy_j"] == pytest.approx(75.0 + 50.0)
    assert got[1]["attributed_tokens"] == 30 and got[1]["gpu_j_per_token"] == pytest.approx(175.0 / 30)
    assert sink.rows["intervals"][0]["prefill_tokens"] == pytest.approx(400.0)
    assert led.totals.energy_by_kind_j[2] == pytest.approx(100.0) and led.totals.j_per_token == pytest.approx(5.0)
    assert led.totals.energy_by_dest_j == pytest.approx((300.0, 0.0, 0.0))
    assert led.totals.tokens_attributed == led.totals.tokens == 40


def test_intervals_wait_for_a_non_streamed_response_then_count_it_as_decode():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = _trace(1, 0.5, stream=False)
    led.on_start(tr)
    for k in range(4):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(3.5 * S))
    assert sink.rows["intervals"] == []  # [0,1) holds too: the request arrived inside it
    # It ends at 3.2 s; the server's timings say it decoded for the last 2.6 s.
    tr.first_ns, tr.last_ns, tr.end_ns, tr.tokens_seen = int(0.6 * S), int(3.2 * S), int(3.2 * S), 52
    tr.extra["spread"] = True
    led.on_end(tr)
    _feed(led, 4.0, 400.0)
    led.advance(int(4.5 * S))
    # Its prefill (0.5-0.6 s) labels [0,1) prefill; the tokens are spread evenly over 0.6-3.2 s.
    # All four intervals are its (no idle power known yet), and so are all its tokens.
    assert [r["kind"] for r in sink.rows["intervals"]] == ["prefill", "decode", "decode", "decode"]
    (row,) = sink.rows["requests"]
    assert row["gpu_energy_j"] == pytest.approx(400.0)
    assert row["attributed_tokens"] == pytest.approx(52)


def test_tag_windows_and_server_tokens_beyond_the_proxy():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0)
    led.open_tag("job", int(1.0 * S), 1)
    with pytest.raises(ValueError, match="already open"):
        led.open_tag("job", int(1.0 * S), 1)
    for k in range(1, 5):
        _feed(led, float(k), 50.0 * k)
    led.add_server_tokens(int(2.5 * S), 40)  # nobody went through the proxy: bypass traffic
    led.close_tag("job", int(3.0 * S), 3)
    led.advance(int(4.5 * S))
    assert len(sink.rows["intervals"]) == 2  # held until the server is scraped past them
    led.add_server_tokens(int(4.45 * S), 0, int(2.5 * S))
    led.add_server_tokens(int(5.5 * S), 0, int(4.45 * S))  # and LAG_S beyond (the proxy sees tokens late)
    led.advance(int(5.6 * S))
    kinds = [r["kind"] for r in sink.rows["intervals"]]
    assert kinds == ["idle", "idle", "unproxied", "idle"]
    assert sink.rows["intervals"][2]["server_tokens"] == 40
    (tag,) = sink.rows["tags"]
    assert tag["name"] == "job" and tag["gpu_energy_j"] == pytest.approx(100.0) and tag["duration_s"] == 2.0
    assert tag["energy_method"] == "counter"


def _proxied_and_scraped(lag_s: float, server_share: float = 1.0):
    """One proxied request decoding 10 tokens a second over 1-5 s, the proxy seeing each token
    `lag_s` after the server counted it; the server scraped every 0.25 s, counting `server_share`
    of what it generated (1: all). Returns the interval rows."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = _trace(1, 0.9)
    tr.extra["prompt_tokens"] = 8
    led.on_start(tr)
    gen = np.arange(10, 50) * (S // 10)  # when the server generated each token (ns)
    seen = gen + int(lag_s * S)  # when the proxy saw it
    for k in range(9):
        _feed(led, float(k), 100.0 * k)
    tr.first_ns = int(seen[0])
    prev, counted = None, 0
    for t in np.arange(1, 32) * (S // 4):
        for ts in seen[(seen > t - S // 4) & (seen <= t)]:
            led.on_tokens(tr, int(ts), 1)
        n = int(np.floor(server_share * (gen <= t).sum()))
        led.add_server_tokens(int(t), float(n - counted), prev)
        prev, counted = int(t), n
        if t >= seen[-1] and tr.end_ns is None:
            tr.last_ns = tr.end_ns = int(seen[-1])
        led.advance(int(t))
    led.close_all(int(8.0 * S))
    return sink.rows["intervals"]


@pytest.mark.parametrize("lag_s", [0.01, 0.2, 0.6])
def test_tokens_the_proxy_sees_after_the_server_counted_them_pass_for_bypass_once_at_most(lag_s):
    # The lag is there all through the stream: the server is always lag_s·10 tokens ahead. Those
    # are taken for bypass once, when the stream starts (nothing tells them from bypass tokens
    # until the stream ends), never again in each window after (as a scrape-by-scrape comparison
    # that forgets its credit did).
    rows = _proxied_and_scraped(lag_s)
    assert sum(r["server_tokens"] or 0 for r in rows) <= lag_s * 10 + 1e-9
    assert sum(r["proxy_tokens"] for r in rows) == 40


def test_a_server_that_under_counts_does_not_hide_later_bypass_tokens():
    # The server counts half the proxied tokens (a /slots-only llama.cpp missing ends): its gap
    # falls for good; bypass tokens counted CREDIT_S after it are bypass traffic again.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for k in range(12):
        _feed(led, float(k), 100.0 * k)
    led.add_server_tokens(int(0.5 * S), 0)  # the first scrape: the baseline
    tr = _trace(1, 0.5)
    led.on_start(tr)
    for k in range(20):
        led.on_tokens(tr, int((1.0 + 0.1 * k) * S), 1)
    tr.first_ns, tr.last_ns, tr.end_ns = int(1.0 * S), int(2.9 * S), int(3.0 * S)
    led.add_server_tokens(int(3.0 * S), 10, int(0.5 * S))  # 10 of the 20
    led.add_server_tokens(int(7.0 * S), 0, int(3.0 * S))
    led.add_server_tokens(int(8.0 * S), 15, int(7.0 * S))  # nobody proxied: bypass
    led.add_server_tokens(int(10.0 * S), 0, int(8.0 * S))
    led.advance(int(10.5 * S))
    led.close_all(int(11.0 * S))
    assert sum(r["server_tokens"] or 0 for r in sink.rows["intervals"]) == pytest.approx(15)


def test_shutdown_writes_open_requests_as_interrupted():
    sink = Sink()
    led = Ledger("d", 0, 1, sink)
    tr = _trace(7, 0.2)
    led.on_start(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 10.0)
    led.open_tag("open-one", int(0.5 * S), 1)
    led.close_all(int(1.0 * S))
    (row,) = sink.rows["requests"]
    assert row["outcome"] == "interrupted"
    assert sink.rows["tags"][0]["closed_by"] == "shutdown"


def test_cpu_energy_across_a_dropped_rapl_delta_is_missing_in_intervals_requests_and_tags(tmp_path, caplog):
    now = [0]
    # 40 W on a 50 J counter whose range is unknown: the wrap in [1.0, 1.5] s looks like going
    # backwards, so the collector drops that delta.
    pc = SimPowercap(tmp_path / "powercap", clock_ns=lambda: now[0], dram=False, power_w_fn=lambda: 40.0,
                     max_energy_range_uj=50_000_000, start_energy_uj=0)
    os.unlink(pc.root / "intel-rapl:0" / "max_energy_range_uj")
    rc = RaplCollector(pc.root, clock_ns=lambda: now[0], opener=pc.opener)
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    early, late = _trace(1, 0.05), _trace(2, 0.1)
    for tr in (early, late):
        led.on_start(tr)
        tr.first_ns = int(0.5 * S)
    led.open_tag("all", 0, 0)
    led.open_tag("before", 0, 0)
    for k in range(5):  # edges every 0.5 s, RAPL read at each
        now[0] = k * S // 2
        pc.update()
        with caplog.at_level(logging.WARNING, logger="powerprof.daemon.ledger"):
            led.add_rapl_sample(now[0], rc.read())
        _feed(led, now[0] / S, 100.0 * k)
        if k == 2:
            led.close_tag("before", now[0], now[0])
    for j in range(4):  # early decodes in [0.5, 1.0), late in [0.5, 2.0)
        led.on_tokens(early, int((0.6 + 0.1 * j) * S), 1)
    for j in range(14):
        led.on_tokens(late, int((0.6 + 0.1 * j) * S), 1)
    early.last_ns, early.end_ns = int(0.9 * S), int(0.95 * S)
    late.last_ns, late.end_ns = int(1.9 * S), int(1.95 * S)
    led.close_tag("all", 2 * S, 2 * S)
    led.advance(int(2.5 * S))

    assert [r["cpu_energy_j"] for r in sink.rows["intervals"]] == [pytest.approx(20.0), pytest.approx(20.0), None,
                                                                    pytest.approx(20.0)]
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[1]["cpu_energy_j"] == pytest.approx(20.0)  # half of [0, 0.5) and of [0.5, 1.0): same work as the other
    assert got[2]["cpu_energy_j"] is None  # not 30 J: it decoded through the dropped delta
    assert got[2]["gpu_energy_j"] > 0
    tags = {r["name"]: r for r in sink.rows["tags"]}
    assert tags["before"]["cpu_energy_j"] == pytest.approx(40.0)
    assert tags["all"]["cpu_energy_j"] is None  # not 60 J of the 80 J used
    assert any("dropped a delta" in m and "backwards" in m for m in caplog.messages)
