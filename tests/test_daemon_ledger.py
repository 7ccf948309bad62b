"""The ledger: closing intervals as samples arrive, per-request and per-tag accounts, bypass traffic."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import pytest

from powerprof.collectors.rapl import RaplCollector
from powerprof.daemon.ledger import Ledger, spread_events
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.streams import Counts
from powerprof.daemon.workmodel import GPUS_UNDECIDED_REASON
from powerprof.profiler import NO_COUNTER_SHORT_FLAG
from powerprof.storage.schema import BYPASS_LOW_FLAG, PROMPT_UNREAD_FLAG, UNSURE_FLAG
from powerprof.sim.powercap import SimPowercap
from powerprof.daemon.ticks import Waker

from support import LedgerReading as R, RowSink as Sink  # noqa: E402

S = 1_000_000_000


def _trace(rid, arrival_s, stream=True):
    return RequestTrace(rid, "POST", "/completion", "t", int(arrival_s * S), 0, api="llamacpp", stream=stream)


def _decoded(led, tr, first_s, step_s, n, last_s, end_s, prompt_tokens):
    """`tr` started, its `n` tokens one every `step_s` from `first_s`, ended at `end_s` with the usage counts."""
    led.on_start(tr)
    for k in range(n):
        led.on_tokens(tr, int((first_s + step_s * k) * S), 1)
    tr.first_ns, tr.last_ns, tr.end_ns = int(first_s * S), int(last_s * S), int(end_s * S)
    tr.counts = Counts(generated_tokens=n, prompt_tokens=prompt_tokens, model=None, stop_reason=None,
                       token_source="usage")
    led.on_end(tr)


def _answered_without_counts(led, tr, status, end_s):
    """`tr` ends with `status` at `end_s`, the server having said nothing of its tokens or prompt."""
    tr.status, tr.end_ns = status, int(end_s * S)
    tr.counts = Counts(None, None, None, None, "none")
    led.on_end(tr)


def _feed(ledger, t_s, energy_j, power_w=200.0):
    ledger.add_gpu_sample(int(t_s * S), int(t_s * S), [R(energy_j, power_w)])


def _idle_measured(led, power_w=20.0):
    """The GPUs' idle power measured before a scene whose first read is at 0 s and 0 J: 0.5 s idle at `power_w` up to
    it, closed. Without, its busy intervals' time no request was live in went to their requests, and their rows say
    uncertain-uncounted (rowtext._idle_unmeasured: the first moments after the daemon's start)."""
    _feed(led, -0.5, -0.5 * power_w, power_w)
    _feed(led, 0.0, 0.0, power_w)
    led.advance(led.grace_ns)



def _deliver(led, tr, parser, t, ev) -> int:
    """One SSE event reaching the proxy at `t`: its tokens counted as the proxy does and given to the ledger."""
    n = parser.count(ev)
    if n:
        tr.first_ns = tr.first_ns or t
        tr.last_ns = t
        tr.tokens_seen += n
        led.on_tokens(tr, t, n)
    return n

def test_requests_are_emitted_with_their_energy_once_their_intervals_close():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = _trace(1, 0.1), _trace(2, 0.2)
    for tr in (a, b):
        led.on_start(tr)
    # From a's arrival, and b's end on the last read, their intervals hold no time with nothing live: no idle power is
    # measured yet, so such time would be theirs, their rows uncertain-uncounted (rowtext._idle_unmeasured).
    _feed(led, 0.1, 1000.0)
    _feed(led, 1.0, 1100.0)  # prefill of both inside [0.1, 1)
    for k in range(10):  # decode in [1, 2): a gets 3 tokens per b's 1
        t = int((1.0 + 0.09 * k) * S)
        led.on_tokens(a, t, 3)
        led.on_tokens(b, t, 1)
    a.first_ns = b.first_ns = int(1.0 * S)  # prefill ended exactly at the edge
    a.last_ns = b.last_ns = int(1.81 * S)
    led.advance(int(1.95 * S))
    assert sink.rows["intervals"] == []  # held: their prompt lengths are not known yet
    a.end_ns = b.end_ns = int(2.0 * S)
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
    # [0.1,1): prefill of 100 and 300 prompt tokens (the fixed ratio); [1,2): 29:9 decoded tokens (each
    # one's first token came out of its prefill: attributed, but not decode work).
    a_j, b_j = 25.0 + 200.0 * 29 / 38, 75.0 + 200.0 * 9 / 38
    assert got[1]["gpu_energy_j"] == pytest.approx(a_j) and got[2]["gpu_energy_j"] == pytest.approx(b_j)
    assert got[1]["attributed_tokens"] == 30 and got[1]["gpu_j_per_token"] == pytest.approx(a_j / 30)
    assert sink.rows["intervals"][0]["prefill_tokens"] == pytest.approx(400.0)
    assert led.totals.energy_by_kind_j[2] == pytest.approx(100.0) and led.totals.j_per_token == pytest.approx(5.0)
    assert led.totals.energy_by_dest_j == pytest.approx((300.0, 0.0, 0.0))
    assert led.totals.tokens_attributed == led.totals.tokens == 40


def test_settled_waits_for_the_ledgers_own_close_past_the_traffic_and_every_row():
    # What bench/_attribution.py waits for after a trace, in place of a fixed 4 s, before the stop's close_all: every
    # interval up to the traffic's end closed by `advance`, no request live or parked.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    assert not led.settled(0)  # no edge yet
    a = _trace(1, 0.1)
    led.on_start(a)
    _feed(led, 0.0, 1000.0)
    _feed(led, 1.0, 1100.0)
    a.first_ns = a.last_ns = int(0.5 * S)
    led.on_tokens(a, int(0.5 * S), 10)
    a.end_ns = int(0.6 * S)
    a.counts = Counts(generated_tokens=10, prompt_tokens=100, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    end = int(0.7 * S)  # the traffic's end
    assert not led.settled(end)  # the request is live: its interval not closed
    led.advance(int(1.05 * S))
    assert not led.settled(end) and sink.rows["requests"] == []  # its closing edge inside the grace period
    led.advance(int(1.2 * S))
    assert len(sink.rows["requests"]) == 1 and led.settled(end)
    assert not led.settled(int(1.5 * S))  # the open interval [1, ...) is not closed past 1.5 s
    led.on_start(_trace(2, 1.3))
    assert not led.settled(end)  # a request live again


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


def _long_whole_answer_beside_a_stream(whole_s: float, scraped: bool):
    """A whole answer (llama.cpp, its timings say its decode) from 1 s to 1 + `whole_s` s beside a stream over its middle
    half, each decoding 20 tokens a second, 3 J a token on 50 W idle (measured), a GPU read every 0.5 s; the server's
    counter read every 0.25 s where `scraped`. Each row's figure over its truth (its tokens' joules and its share of the
    idle power while it was live), less 1: {request_id: error}."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _idle_measured(led, 50.0)
    runs = {1: (1.0, 1.05, 1.0 + whole_s, False), 2: (1.0 + whole_s / 4, 1.05 + whole_s / 4, 1.5 + whole_s * 3 / 4, True)}
    toks = {rid: np.arange(f, e, 0.05) for rid, (a, f, e, _) in runs.items()}
    every = np.sort(np.concatenate(list(toks.values())))
    trs = {rid: RequestTrace(rid, "POST", "/completion", "t", int(a * S), 0, api="llamacpp", stream=st)
           for rid, (a, f, e, st) in runs.items()}
    done, served = {rid: 0 for rid in runs}, 0.0
    for step in range(1, int((whole_s + 4.0) * 20)):
        now = step / 20
        for rid, (a, f, e, st) in runs.items():
            tr, ts = trs[rid], toks[rid]
            if a <= now < a + 0.05:
                led.on_start(tr)
            upto = int(np.searchsorted(ts, now + 1e-9))
            for x in ts[done[rid]:upto] if st else ():
                tr.first_ns, tr.last_ns, tr.tokens_seen = tr.first_ns or int(x * S), int(x * S), tr.tokens_seen + 1
                led.on_tokens(tr, int(x * S), 1)
            done[rid] = upto
            if e <= now < e + 0.05:
                if not st:  # the body at once, its tokens spread back over its decode
                    tr.first_ns, tr.last_ns, tr.tokens_seen = int(ts[0] * S), int(ts[-1] * S), len(ts)
                    tr.extra["spread"] = True
                tr.status, tr.end_ns = 200, int(now * S)
                tr.counts = Counts(generated_tokens=len(ts), prompt_tokens=10, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        counted = float(np.searchsorted(every, now + 1e-9))
        if scraped and step % 5 == 0:
            led.add_server_tokens(int(now * S), counted - served, int((now - 0.25) * S) if step > 5 else None)
            served = counted
        if step % 10 == 0:
            _feed(led, now, 50.0 * now + 3.0 * counted)
        led.advance(int(now * S))
    led.close_all(int((whole_s + 4.5) * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    grid = np.arange(0.0, whole_s + 4.0, 0.001) + 0.0005
    live = sum(((a <= grid) & (grid < e)).astype(float) for a, _, e, _ in runs.values())
    err = {}
    for rid, (a, f, e, st) in runs.items():
        mine = (a <= grid) & (grid < e)
        truth = 3.0 * len(toks[rid]) + float((50.0 * 0.001 / live[mine]).sum())
        err[rid] = (got[rid]["gpu_energy_j"] / truth - 1.0, got[rid]["energy_note"])
    return err


@pytest.mark.parametrize("scraped", [False, True])
@pytest.mark.parametrize("whole_s", [7.5, 100.0])
def test_a_long_whole_answers_spread_gives_each_interval_its_share_not_lumps(whole_s, scraped):
    # A whole answer's tokens are spread over its decode. Placed as 64 events, a 100 s answer's came one every 1.6 s:
    # of the 0.5 s intervals it spans one in three got a lump of them, the others none, and each interval's energy was
    # split by that lumpy work: its row -23% (counter read: -29%), the stream beside it +52% (+46%), both unflagged.
    # Now at most SPREAD_PITCH_S apart: within 2% (7.5 s: within 1% before and after).
    err = _long_whole_answer_beside_a_stream(whole_s, scraped)
    for rid, (e, note) in err.items():
        assert abs(e) < 0.02, (rid, e, note)
        assert note is None or "uncertain" not in note, note


def test_a_long_whole_answer_is_spread_as_a_few_events_a_scrape_window_not_thousands():
    # 20 ms apart, a 110 s answer was 5495 events: 1000 such answers ending at once peaked at 1.2 GB and their closes
    # took 3.5 s of CPU on the daemon's loop. 50 ms apart: 5 to a default 0.25 s scrape window, at most 2400.
    assert spread_events(0, 110 * S) == 2200
    assert spread_events(0, 600 * S) == 2400
    assert spread_events(0, int(0.25 * S)) == 64


@pytest.mark.parametrize("prompt", [500, 100])
def test_short_whole_answers_each_alone_are_costed_their_own_run_not_their_neighbours(prompt):
    # vLLM and SGLang answers not streamed carry no timings: their first token is unseen (first_ns is the arrival).
    # Their prompt was placed ending there, before the request arrived: in the interval the daemon's arrival edge
    # (read just after it) closes, where the request before ran. Three 1-3-token answers each alone, 0.2 s each at
    # 300 W (60 J each, nothing between), edges at the arrivals alone (a rate-limited end edge skipped): before, the
    # first got 0.1 J and each later one its predecessor's run (the simulated vLLM: 20 of 50 rows off 10-74%, silent).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    runs = [(1.0, 1.2, 1), (1.5, 1.7, 2), (2.0, 2.2, 3)]  # arrival, end (s), tokens

    def joules(t):
        return 300.0 * sum(min(max(t - a, 0.0), e - a) for a, e, _ in runs)

    _feed(led, 0.0, 0.0)
    for rid, (a, e, n) in enumerate(runs, start=1):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", f"t{rid}", int(a * S), 0, api="openai-chat", stream=False)
        led.on_start(tr)
        _feed(led, a + 0.0003, joules(a + 0.0003))  # the arrival's edge, read just after it
        # As the proxy records a body without timings (`Proxy._body_done`): its tokens from its arrival to its end.
        tr.first_ns, tr.last_ns, tr.end_ns, tr.tokens_seen = int(a * S), int(e * S), int(e * S), n
        tr.extra["spread"] = True
        tr.counts = Counts(generated_tokens=n, prompt_tokens=prompt, model=None, stop_reason="length",
                           token_source="usage")
        led.on_end(tr)
    _feed(led, 3.0, joules(3.0))
    led.advance(int(3.5 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    # Within 5%: a prompt placed from its arrival has its first 0.3 ms in the interval before its arrival's edge (3 of a
    # 100-token prompt placed over 10 ms at the default 10 000 tokens/s, beside the 100 of the request there: -2.8%).
    for rid in (1, 2, 3):
        assert got[rid]["gpu_energy_j"] == pytest.approx(60.0, rel=0.05), (rid, got[rid]["gpu_energy_j"])
    # Its TTFT is still not seen: the row's is not made up from where its prompt was placed.
    assert got[1]["ttft_s"] == 0.0


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
    # Before the first scrape the server's count was never read: null, not a silent 0.
    assert [r["server_tokens"] for r in sink.rows["intervals"][:2]] == [None, None]
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
    # [0, 0.5) has no work: shared by live time (0.45 s of 0.85 s); [0.5, 1.0): same work as the other.
    assert got[1]["cpu_energy_j"] == pytest.approx(20.0 * 0.45 / 0.85 + 10.0)
    assert got[2]["cpu_energy_j"] is None  # not 30 J: it decoded through the dropped delta
    assert got[2]["gpu_energy_j"] > 0
    tags = {r["name"]: r for r in sink.rows["tags"]}
    assert tags["before"]["cpu_energy_j"] == pytest.approx(40.0)
    assert tags["all"]["cpu_energy_j"] is None  # not 60 J of the 80 J used
    assert any("dropped a delta" in m and "backwards" in m for m in caplog.messages)


def test_a_counter_only_edge_splits_an_interval_with_the_counter_difference():
    # Short requests' edges read the energy counters alone (no power): they are edges all the same.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 1000.0, power_w=300.0)
    led.add_gpu_edge(int(0.4 * S), int(0.4 * S), (1040.0,))
    led.add_gpu_edge(int(0.6 * S), int(0.6 * S), (float("nan"),))  # a failed read is no edge
    _feed(led, 1.0, 1100.0, power_w=300.0)
    led.advance(int(1.5 * S))
    rows = sink.rows["intervals"]
    assert [r["gpu_energy_j"] for r in rows] == [pytest.approx(40.0), pytest.approx(60.0)]
    assert [r["energy_method"] for r in rows] == ["counter", "counter"]


def test_an_interval_whose_counter_did_not_move_says_its_zero_is_no_figure():
    # A request's edge read 30 ms after a tick, within one 100 ms refresh, reads the tick's value: the interval
    # between them stored 0.0 J by the counter, unmarked, while the next interval holds its energy. Kept (the edges'
    # staleness at a request's start and end balances out in its own figure; the sum over intervals stays the
    # counter's), and said.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 1000.0, power_w=300.0)
    led.add_gpu_edge(int(0.03 * S), int(0.03 * S), (1000.0,))  # the tick's value still
    _feed(led, 1.0, 1300.0, power_w=300.0)
    led.advance(int(1.5 * S))
    flat, moved = sink.rows["intervals"]
    assert flat["gpu_energy_j"] == 0.0 and moved["gpu_energy_j"] == pytest.approx(300.0)
    assert "counter did not move" in flat["energy_note"] and "next interval" in flat["energy_note"]
    assert "counter did not move" not in (moved["energy_note"] or "")



def test_an_interval_where_one_gpus_counter_did_not_move_says_which():
    # Two GPUs; GPU 1's counter refreshed between the tick and the edge, GPU 0's did not: the interval's sum held GPU
    # 1's 12 J and none of GPU 0's (its ~9 J in the next interval), a plausible-looking figure, unmarked.
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    led.add_gpu_sample(0, 0, [R(1000.0, 300.0), R(5000.0, 400.0)])
    led.add_gpu_edge(int(0.03 * S), int(0.03 * S), (1000.0, 5012.0))
    led.add_gpu_sample(S, S, [R(1300.0, 300.0), R(5400.0, 400.0)])
    led.advance(int(1.5 * S))
    flat, moved = sink.rows["intervals"]
    assert flat["gpu_energy_j"] == pytest.approx(12.0) and moved["gpu_energy_j"] == pytest.approx(688.0)
    assert "GPU 0" in flat["energy_note"] and "counter did not move" in flat["energy_note"], flat["energy_note"]
    assert "counter did not move" not in (moved["energy_note"] or "")

def test_a_prefill_only_request_gets_its_prompt_work_and_one_with_no_work_seen_says_so():
    # Request 1 decodes through [0, 2); request 2 only prefills (its response ends at its first and
    # only event, 0 tokens) and request 3 ends with no tokens and no prompt length: no work to see.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    dec, pre, blind = _trace(1, 0.0), _trace(2, 0.5), _trace(3, 0.5)
    for tr in (dec, pre, blind):
        led.on_start(tr)
    for k in range(20):
        led.on_tokens(dec, int((0.05 + 0.1 * k) * S), 1)
    dec.first_ns, dec.last_ns, dec.end_ns = int(0.05 * S), int(1.95 * S), int(1.96 * S)
    pre.end_ns = blind.end_ns = int(0.8 * S)
    dec.counts = Counts(generated_tokens=20, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    pre.counts = Counts(generated_tokens=0, prompt_tokens=2000, model=None, stop_reason=None, token_source="usage")
    for tr in (dec, pre, blind):
        led.on_end(tr)
    _feed(led, 0.0, 1000.0)
    _feed(led, 1.0, 1100.0)
    _feed(led, 2.0, 1200.0)
    led.advance(int(2.5 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    # [0,1): 10 tokens, 9 of them decoded (1 each at the fixed ratio; the first came out of the
    # prefill), 10 + 2000 prompt tokens at 0.05.
    assert got[2]["gpu_energy_j"] == pytest.approx(100.0 * 100 / 109.5)
    # Its work is seen; its share of [0, 1) beside request 1 rests on the fixed ratio (no fit yet), and it says that
    # alone: request 3's answer ended as the server ended it (outcome ok), no request gone before its first token.
    assert got[2]["energy_note"].startswith("approximate: 100% of its GPU energy is from intervals other requests did "
                                            "work in too")
    assert "no prompt length" not in got[2]["energy_note"]
    assert got[3]["gpu_energy_j"] is None and "no prompt length" in got[3]["energy_note"]
    assert got[1]["gpu_energy_j"] + got[2]["gpu_energy_j"] == pytest.approx(200.0)  # nothing lost


def test_a_request_counted_one_token_per_chunk_is_marked_estimated():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    oai = RequestTrace(1, "POST", "/v1/completions", None, 0, 0, api="openai-completions", stream=True)
    led.on_start(oai)
    led.on_tokens(oai, int(0.2 * S), 1)
    oai.first_ns = oai.last_ns = int(0.2 * S)
    oai.end_ns = int(0.3 * S)
    oai.counts = Counts(generated_tokens=1, prompt_tokens=None, model=None, stop_reason=None, token_source="counted",
                        tokens_estimated=True)
    led.on_end(oai)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 10.0)
    led.advance(int(1.5 * S))
    assert sink.rows["requests"][0]["tokens_estimated"] is True


def test_a_prompt_hold_is_not_cut_short_by_the_shorter_scrape_hold():
    # A 20 s stream whose prompt length comes only at its end, with the server scraped all along:
    # the scrape's 10 s cap must not release the intervals the prompt hold (30 s) still needs.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a = _trace(1, 0.5)
    led.on_start(a)
    for k in range(22):
        _feed(led, float(k), 100.0 * k)
        if k:
            led.add_server_tokens(int(k * S), 0.0, int((k - 1) * S))
        if k >= 1:
            led.on_tokens(a, int((k + 0.5) * S), 1)
            a.first_ns = a.first_ns or int(1.5 * S)
            a.last_ns = int((k + 0.5) * S)
        led.advance(int((k + 0.2) * S))
    assert sink.rows["intervals"] == []  # 21 s in: still held for the prompt
    a.end_ns = int(21.6 * S)
    a.counts = Counts(generated_tokens=21, prompt_tokens=5000, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    _feed(led, 22.0, 2200.0)
    led.add_server_tokens(int(22 * S), 0.0, int(21 * S))
    led.advance(int(22.5 * S))
    rows = sink.rows["intervals"]
    # (the last interval waits LAG_S for the scrape after it)
    assert len(rows) >= 21 and sum(r["prefill_tokens"] for r in rows) == pytest.approx(5000.0)


def test_tokens_in_an_interval_without_energy_give_no_zero_j_per_token():
    # The counter did not move over the request (a stale or stuck counter): no 0 J posing as a figure.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a = _trace(1, 0.1)
    led.on_start(a)
    led.on_tokens(a, int(0.5 * S), 3)
    # The proxy's count of them, as it keeps it (else the usage's 3 read as 3 more after its chunks: _placed_at_end).
    a.tokens_seen = 3
    a.first_ns, a.last_ns, a.end_ns = int(0.5 * S), int(0.5 * S), int(0.6 * S)
    a.counts = Counts(generated_tokens=3, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    _feed(led, 0.0, 500.0)
    _feed(led, 1.0, 500.0)
    led.advance(int(1.5 * S))
    row = sink.rows["requests"][0]
    assert row["attributed_tokens"] == 3
    assert row["gpu_energy_j"] is None and row["gpu_j_per_token"] is None and "no share" in row["energy_note"]


def _vllm_stream(chunks: int, usage_tokens: int) -> bytes:
    """An OpenAI stream as vLLM sends it with `include_usage`: content chunks with no counts (under
    speculative decoding each holds several tokens), then a usage-only chunk (`choices: []`)."""
    import json
    out = [b'data: {"id":"c","choices":[{"index":0,"text":"ab","finish_reason":null}]}\n\n'] * (chunks - 1)
    out.append(b'data: {"id":"c","choices":[{"index":0,"text":"c","finish_reason":"length"}]}\n\n')
    out.append(b"data: " + json.dumps({"id": "c", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": usage_tokens, "total_tokens": 5 + usage_tokens}}).encode() + b"\n\n")
    return b"".join(out) + b"data: [DONE]\n\n"


def _play_speculative_stream(with_usage: bool, end_s: float, usage_tokens: int = 25):
    """A streamed completion of 10 chunks, 25 tokens (speculative decoding: 2.5 a chunk) from 1 s, 0.15 s apart, its
    usage-only chunk kept or left out, through a ledger whose scraper (every 0.25 s) sees the server count each
    chunk's tokens as it sends it; closed at `end_s` + 0.2 s. (sink, trace, tokens the proxy counted, what on_end
    returned). `usage_tokens`: what the usage chunk (and the scraper) says of the 10 chunks."""
    from powerprof.daemon import streams
    parser = streams.new_parser("openai-completions")
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/completions", "t", int(0.9 * S), 0, api="openai-completions", stream=True)
    led.on_start(tr)
    events = [e + b"\n\n" for e in _vllm_stream(10, usage_tokens).split(b"\n\n") if e and (with_usage or b'"usage"' not in e)]
    ev_at = [int((1.0 + 0.15 * i) * S) for i in range(len(events))]
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)  # the scraper runs from the start
    prev, served, seen, added = int(0.5 * S), 0.0, 0, None
    for step in range(11, int(end_s * 20) + 1):  # every 50 ms from 0.55 s
        now = step * S // 20
        while events and ev_at[0] <= now:
            t, ev = ev_at.pop(0), events.pop(0)
            seen += _deliver(led, tr, parser, t, ev)
            if not events:  # [DONE]: the response ended
                tr.end_ns = t
                tr.counts = streams.summary_counts(parser.finish())
                added = led.on_end(tr)
        if step % 5 == 0:
            n = usage_tokens / 10 * sum(1 for i in range(10) if 1.0 + 0.15 * i - 0.01 <= now / S)
            led.add_server_tokens(now, n - served, prev)
            prev, served = now, n
        if step % 20 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    led.close_all(int((end_s + 0.2) * S))
    return sink, tr, seen, added


def test_a_stream_counted_per_chunk_takes_the_servers_final_count_and_leaves_nothing_unproxied():
    # 10 chunks, 25 tokens (speculative decoding: 2.5 a chunk), the usage-only chunk at 2.6 s; the
    # server's counter, scraped every 0.25 s while the stream runs, counts each chunk's tokens as it
    # sends it. Before: the request was attributed 10 tokens and the other 15 (and their energy)
    # went to `unproxied`, as if they had bypassed the proxy.
    sink, tr, seen, added = _play_speculative_stream(with_usage=True, end_s=4.0)
    assert seen == 10 and tr.counts.generated_tokens == 25 and tr.counts.tokens_estimated
    (row,) = sink.rows["requests"]
    assert row["attributed_tokens"] == 25.0 and row["generated_tokens"] == 25
    assert row["tokens_estimated"] is False  # the count is the server's, not one per chunk
    assert added == pytest.approx(15.0)  # what the service adds to powerprof_tokens_generated_total
    ivs = sink.rows["intervals"]
    assert sum(r["proxy_tokens"] for r in ivs) == pytest.approx(25.0)
    assert sum(r["server_tokens"] or 0.0 for r in ivs) == pytest.approx(0.0, abs=1e-9)
    assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-9)


def test_a_stream_carrying_more_tokens_than_its_servers_usage_is_not_scaled_down_to_it_and_has_no_j_per_token():
    # 10 content chunks (at least one token each) and a final usage of 8: the server's count contradicts its
    # stream (arrival.count_problem). Before: the chunks were scaled down to 8, and the row stored 8
    # generated tokens and J/token over 8, as if fine.
    sink, tr, seen, added = _play_speculative_stream(with_usage=True, end_s=4.0, usage_tokens=8)
    (row,) = sink.rows["requests"]
    assert seen == 10
    assert added == 0.0 and row["attributed_tokens"] == 10.0  # the proxy's own count, not the server's
    assert row["outcome"] == "ok" and row["gpu_energy_j"] > 0  # the row and its energy share are kept
    assert row["generated_tokens"] is None and row["decode_tokens"] is None and row["gpu_j_per_token"] is None
    assert "counted 8 generated tokens but its stream carried 10" in row["error"] and "proxy.upstream" in row["error"]
    assert row["tokens_estimated"] is True  # what is attributed is the one-per-chunk count
    assert "counted 8 generated tokens but its stream carried 10" in tr.counts.count_problem


def _whole_answer_beside_scrapes(counted: int, until_s: float, books: str | None = None):
    """A non-streamed answer whose usage says 30 over 1-3.5 s, the server's counter counting `counted` of them as it
    generates (the proxy sees them only at its end, spread back), scraped every 0.25 s, then quiet until `until_s`. The
    rows emitted. `books`: what each page says of the server's requests (scrape.Scraper.served): None, nothing (llama.cpp,
    SGLang, an older vLLM); "own", vLLM's, the answer running 1-3.5 s and finished then; "bypass", another request
    beside it, running 2-3 s and finished then; "stale", "own" but its running gauge stuck at 1 after it (a vLLM
    before vllm-project/vllm#29928 after an abort); "aborted", "own" but 6 of the counter's tokens not in the finished
    requests' histogram (vllm:request_generation_tokens_sum: a bypass request aborted unfinished generated them);
    "nohist", "own" with no such histogram; "between", the answer's usage true (30) and a bypass answer of 6 tokens
    (the counter's 6 more) started and finished between the scrapes at 2 and 2.25 s: no page shows it running, the
    proxy's answer live beside it hides it from the finished count until the quiet end."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/completions", None, int(0.9 * S), 0, api="openai-completions", stream=None)
    led.on_start(tr)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    prev, served = int(0.5 * S), 0.0
    for step in range(11, int(round(until_s * 20)) + 1):  # 0.55 s ... until_s
        now = step * S // 20
        if step == 70:  # 3.5 s: the body, with usage
            tr.stream = False
            tr.status = 200
            tr.first_ns, tr.last_ns, tr.end_ns = int(1.0 * S), now, now
            tr.tokens_seen = 30
            tr.extra["spread"] = True
            tr.counts = Counts(generated_tokens=30, prompt_tokens=5, model=None, stop_reason=None, token_source="usage")
            led.on_end(tr)
        if step % 5 == 0:
            n = float(min(max(round((now / S - 1.0) * 12 * counted / 30), 0), counted))
            book = None
            if books is not None:
                done = (now >= int(3.5 * S)) + (books == "bypass" and now >= 3 * S)
                running = ((S <= now < int(3.5 * S) or (books == "stale" and now >= S))
                           + (books == "bypass" and 2 * S <= now < 3 * S))
                # vllm:request_generation_tokens_sum: the answer's `counted` once it finished (the bypass one's
                # tokens are not in this counter either)
                book = (float(done), float(running), float(counted if now >= int(3.5 * S) else 0))
                if books == "aborted":  # 6 of the counter's tokens from a request aborted unfinished: in no histogram
                    book = (*book[:2], float(min(book[2], 30)))
                if books == "nohist":  # a page without the histogram
                    book = book[:2]
                if books == "between":  # a bypass answer of 6 running 2.05-2.2 s: finished, never seen running
                    byp = now >= int(2.25 * S)
                    book = (book[0] + byp, book[1], float(30 * (now >= int(3.5 * S)) + 6 * byp))
            led.add_server_tokens(now, n - served, prev, served=book)
            prev, served = now, n
        if step % 20 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    led.close_all(int((until_s + 0.2) * S))
    return sink


def test_a_non_streamed_answer_longer_than_the_scrape_lag_is_not_also_taken_for_bypass():
    # A non-streamed answer of 30 tokens over 1-3.5 s: the server counts them as it generates, the
    # proxy sees them only at the end (spread back). Before: the windows resolved while it ran took
    # its tokens for bypass traffic, and the request was attributed them too (counted twice).
    sink = _whole_answer_beside_scrapes(30, 5.0)
    (row,) = sink.rows["requests"]
    assert row["attributed_tokens"] == pytest.approx(30.0)
    ivs = sink.rows["intervals"]
    assert sum(r["server_tokens"] or 0.0 for r in ivs) == pytest.approx(0.0, abs=1e-9)
    assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("counted", [30, 24])
def test_a_whole_answers_usage_above_the_servers_counter_is_said_with_both_counts(counted):
    # A non-streamed answer whose usage says 30 over 1-3.5 s, the server's counter counting `counted` of them as it
    # generates, then quiet: 24 (the usage 1.25x the counter) is no lag and no bypass traffic (bypass only raises the
    # counter). Before, its row kept 30 and a J/token over them, its intervals `complete`; 30 stays unsaid.
    sink = _whole_answer_beside_scrapes(counted, 8.0)
    (row,) = sink.rows["requests"]
    busy = [r for r in sink.rows["intervals"] if r["proxy_tokens"]]
    if counted == 30:
        assert row["error"] is None and row["gpu_j_per_token"] is not None
        assert busy and not any("usage_above_counter" in r["server_count"] for r in sink.rows["intervals"])
        return
    assert "usage_above_counter: its usage said 30 generated tokens" in row["error"], row["error"]
    assert "counter (/metrics) about 24" in row["error"] and "fix:" in row["error"], row["error"]
    assert row["generated_tokens"] == 30 and row["gpu_j_per_token"] is None and row["gpu_energy_j"] > 0
    assert busy and all("usage_above_counter" in r["server_count"] for r in busy), [r["server_count"] for r in busy]
    assert "usage_above_counter" in row["energy_note"]  # its energy is of intervals whose count is not complete


@pytest.mark.parametrize("books", ["own", "bypass", "between", "stale", "aborted", "nohist", None])
def test_a_whole_answers_usage_below_the_servers_counter_is_said_where_the_servers_books_rule_out_bypass(books):
    # A non-streamed answer whose usage says 30 where the server's counter counted 36 as it generated it (a usage lying
    # low, 0.83x), then quiet. Bypass traffic raises the counter the same way; vLLM's books tell them apart: over a
    # stretch whose quiet ends find no request running and in which the server finished as many requests as the proxy
    # saw end ("own"), no bypass request ran, so the 6 are the answer's own. Before, they were booked as bypass
    # (unproxied) and the row kept generated_tokens 30 and a J/token over them, its intervals `complete`.
    sink = _whole_answer_beside_scrapes(36, 8.0, books)
    (row,) = sink.rows["requests"]
    ivs = sink.rows["intervals"]
    busy = [r for r in ivs if r["proxy_tokens"]]
    bypass = sum(r["server_tokens"] or 0.0 for r in ivs)
    if books == "own":
        assert "usage_below_counter: its usage said 30 generated tokens" in (row["error"] or ""), row["error"]
        assert "counter (/metrics) about 36" in row["error"] and "fix:" in row["error"], row["error"]
        assert row["generated_tokens"] == 30 and row["gpu_j_per_token"] is None and row["gpu_energy_j"] > 0
        assert bypass == pytest.approx(0.0, abs=1e-6)
        assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-6)
        assert busy and all("usage_below_counter" in r["server_count"] for r in busy), [r["server_count"] for r in busy]
        return
    # Another request finished beside it ("bypass"; "between": only the finished count at the quiet end, one more than
    # the proxy's ends, shows it; before, no test failed without that check), a gauge that reads a request running at the quiet end ("stale":
    # stuck, or a bypass request running across it: nothing tells), a counter above its finished requests' tokens
    # ("aborted": a request it never finished, bypass maybe; before, judged the usage's), or the server tells nothing
    # of its requests, or not their tokens (None, "nohist"):
    # the surplus is bypass traffic's, as before, and nothing says usage_below_counter.
    assert row["error"] is None and row["gpu_j_per_token"] is not None, row["error"]
    assert bypass == pytest.approx(6.0, abs=1.0)
    assert not any("usage_below_counter" in r["server_count"] for r in ivs)


@pytest.mark.parametrize("usage", [6, 5])
def test_steady_whole_answers_with_no_quiet_scrape_keep_bounded_state_and_close_within_the_hold(usage):
    # 400 whole answers of 6 tokens, one every 0.3 s, each 0.5 s long (two live at once: never a quiet scrape), the
    # counter exact, vLLM's books on its pages: what the reconciler keeps to judge their usage stays bounded
    # (reconcile.USAGE_REQUESTS_KEPT past the live ones), their intervals are not held for it, and nothing says
    # usage_above_counter. A usage of 5 (below the counter: judged only at a quiet scrape, which never comes) holds
    # them no more: before, every interval waited SCRAPE_HOLD_S (10 s) for it.
    from powerprof.daemon.reconcile import USAGE_REQUESTS_KEPT
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.25 * S), 0.0, served=(0.0, 0.0, 0.0))
    trs, ends, served, counted, prev = {}, {}, 0.0, 0.0, int(0.25 * S)
    most_kept = 0
    for step in range(6, 2560):  # 0.3 s ... 128 s, every 0.05 s; quiet until 3 s (a quiet scrape: a stretch begins)
        now = step * S // 20
        if step % 6 == 0 and 10 <= step // 6 <= 409:  # a new answer every 0.3 s
            rid = step // 6 - 9
            trs[rid] = tr = RequestTrace(rid, "POST", "/v1/completions", None, now, 0, api="openai-completions",
                                         stream=None)
            led.on_start(tr)
            ends[rid] = now + S // 2
        for rid in [r for r, e in ends.items() if e <= now]:
            tr = trs.pop(rid)
            del ends[rid]
            tr.stream = False
            tr.first_ns, tr.last_ns, tr.end_ns = tr.arrival_ns + S // 10, now, now
            tr.tokens_seen = usage
            tr.extra["spread"] = True
            tr.counts = Counts(generated_tokens=usage, prompt_tokens=5, model=None, stop_reason=None,
                               token_source="usage")
            led.on_end(tr)
        # the server counts each live answer's 6 tokens evenly over its last 0.4 s
        counted = sum(min(max((now - (e - 2 * S // 5)) / (2 * S // 5), 0.0), 1.0) * 6 for e in ends.values())
        if step % 5 == 0:
            n_done = min(max(step // 6 - 9, 0), 400) - len(ends)
            done = 6.0 * n_done
            led.add_server_tokens(now, done + counted - served, prev,
                                  served=(float(n_done), float(len(ends)), done))
            prev, served = now, done + counted
        if step % 5 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
        rc = led.recon
        most_kept = max(most_kept, len(rc._usage_counts), len(rc._stretch.requests))
        if 40 * S < now < 110 * S:
            # Steady, the counter keeping up: nothing holds its intervals for the judgment (1.45 s behind at most, as
            # the scrapes' LAG_S lookahead makes them; held to a quiet scrape, SCRAPE_HOLD_S and more).
            assert sink.rows["intervals"][-1]["t_start_mono_s"] > now / S - 2.5
    led.close_all(int(128.2 * S))
    assert most_kept <= USAGE_REQUESTS_KEPT + 4 and len(led.recon._usage_only) < 1000
    assert len(sink.rows["requests"]) == 400
    assert not any("usage_above_counter" in (r["error"] or "") for r in sink.rows["requests"])
    assert not any("usage_above_counter" in r["server_count"] for r in sink.rows["intervals"])


def test_an_error_answer_with_no_work_takes_no_energy_and_its_time_stays_idle():
    # Before: a 413 (or 503, or the proxy's 502) alone in an interval shared it "by live time": it was
    # charged the idle GPU's energy over its life (31 J for one 413 on the simulator) and idle was short.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    err, ok = _trace(1, 0.2, stream=False), _trace(2, 2.2)
    for tr in (err, ok):
        led.on_start(tr)
    _answered_without_counts(led, err, 413, 0.9)
    _answered_without_counts(led, ok, 200, 2.8)  # a slow step: nothing measurable yet, but a request that was answered
    for k in range(4):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(3.5 * S))
    # Its head said 503 before its body was through (a slow upload): not live from then on either.
    slow = RequestTrace(3, "PUT", "/upload", None, int(3.1 * S), 0)
    led.on_start(slow)
    slow.status = 503
    _feed(led, 4.0, 400.0)
    led.advance(int(4.5 * S))
    slow.end_ns = int(4.6 * S)
    led.on_end(slow)
    _feed(led, 5.0, 500.0)
    led.advance(int(5.5 * S))
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    assert rows[1]["gpu_energy_j"] is None and "error answer (HTTP 413)" in rows[1]["energy_note"]
    assert rows[3]["gpu_energy_j"] is None and [r["kind"] for r in sink.rows["intervals"]][3:] == ["idle", "idle"]
    assert rows[2]["gpu_energy_j"] == pytest.approx(100.0)  # a live request with no work seen still shares
    first = sink.rows["intervals"][0]
    assert first["kind"] == "idle" and first["idle_energy_j"] == pytest.approx(100.0)
    assert first["requests_energy_j"] == 0.0


def _alone_with_no_work(trace) -> tuple[dict, dict]:
    """`trace` answered 200 with no token and no prompt length, alone over two seconds of 100 J each: (its row, the
    first interval's)."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.on_start(trace)
    _answered_without_counts(led, trace, 200, 0.9)
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(2.5 * S))
    (row,) = sink.rows["requests"]
    return row, sink.rows["intervals"][0]


def test_a_get_with_no_work_takes_no_energy_whatever_its_status():
    # GET /v1/models (replay's probe), /metrics, /health through the proxy, alone in an interval, were charged the idle
    # GPU's energy over their life (0.013-0.047 J, session 46's walkthrough) where data.md says such rows are null.
    row, first = _alone_with_no_work(RequestTrace(1, "GET", "/v1/models", None, int(0.2 * S), 0))
    assert row["gpu_energy_j"] is None and "a GET request to no generation endpoint" in row["energy_note"]
    assert first["kind"] == "idle" and first["idle_energy_j"] == pytest.approx(100.0), first


def test_a_put_to_a_generation_endpoint_is_live_before_its_first_token():
    # SGLang's /generate takes PUT as well as POST: its prefill before a first token is work, shared by live time as a
    # POST's is, not idle (session 46's review: 15360 J as PUT where 18060 J as POST).
    row, _ = _alone_with_no_work(RequestTrace(1, "PUT", "/generate", None, int(0.2 * S), 0, api="sglang-generate",
                                              stream=True))
    assert row["gpu_energy_j"] == pytest.approx(100.0), row


def test_a_count_less_stream_that_keeps_up_with_the_server_holds_no_scrape_window():
    # An OpenAI stream with no counts (one token a chunk, the prompt length unknown until its end)
    # whose chunks are one token each, as the server counts them: its windows show no surplus, so
    # they resolve as the scrapes come, not when it ends. Before: every window waited for any such
    # live stream (up to the 30 s prompt hold), and on a busy server the work model's fit matured
    # late (a 240-request trace: 200 requests in its warm-up instead of 160).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/completions", None, int(0.9 * S), 0, api="openai-completions", stream=True)
    led.on_start(tr)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    prev, served = int(0.5 * S), 0
    for step in range(11, 161):  # 0.55 s ... 8.0 s, a token every 50 ms from 1 s
        now = step * S // 20
        if now >= S:
            tr.first_ns = tr.first_ns or now
            tr.last_ns = now
            tr.tokens_seen += 1
            led.on_tokens(tr, now, 1)
        if step % 5 == 0:
            n = tr.tokens_seen
            led.add_server_tokens(now, float(n - served), prev)
            prev, served = now, n
        if step % 20 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    assert tr.end_ns is None  # still streaming
    resolved = [sp for sp in led.recon.server_spans if sp.bypass_tokens is not None]
    assert resolved and max(sp.t1_ns for sp in resolved) >= int(6.0 * S)
    assert sum(sp.bypass_tokens for sp in resolved) == pytest.approx(0.0, abs=1e-9)


def test_a_count_less_stream_the_server_counted_more_of_says_so_on_its_row(caplog):
    # The same stream without its usage chunk (`include_usage` not asked for): 10 chunks, 25 tokens by
    # the server's counter. Before: the row said 10 tokens, tokens_estimated and nothing more, while the
    # server's counter had shown the proxy's count low all along; now the row says by how much.
    with caplog.at_level("WARNING", logger="powerprof.daemon.ledger"):
        sink, _tr, _seen, _added = _play_speculative_stream(with_usage=False, end_s=6.0)
    # And the daemon's log says it once, with both fixes: most OpenAI clients never ask for usage, and rows alone
    # were read by nobody watching the daemon (a new user saw 218 J in unproxied with every request proxied).
    said = [m.getMessage() for m in caplog.records if "carried no token counts" in m.getMessage()]
    assert len(said) == 1 and "15 token(s) more" in said[0] and "include_usage" in said[0], said
    assert "--enable-force-include-usage" in said[0] and "(1 such requests so far)" in said[0], said
    (row,) = sink.rows["requests"]
    assert row["attributed_tokens"] == 10.0 and row["tokens_estimated"] is True
    assert row["error"] is not None and "ran 15 token(s) ahead of the proxy's" in row["error"]
    assert "unproxied" in row["error"]
    # Its energy is short of those tokens' too: not a figure resting on the server's counts (energy_note null).
    assert row["energy_note"].startswith("approximate:") and "15 token(s)" in row["energy_note"]
    assert "include_usage" in row["energy_note"]


def test_tag_stop_answers_unknown_energy_while_the_window_is_not_final():
    # tag_stop waits a few sample intervals for the window to close; past that it answered the sums
    # so far (0.0 J with no sample after the edge) as the window's energy. Now None, with a note.
    import asyncio
    from types import SimpleNamespace

    from powerprof.daemon.service import Daemon

    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    S = 1_000_000_000

    async def edge(label):
        return (5 * S if "stop" in label else 1 * S), 0

    fake = SimpleNamespace(waker=Waker(), ledger=led, _edge=edge, cfg=SimpleNamespace(get=lambda sec, key: 0.01),
                           _lost_tags={}, _save_open_tags=lambda: None)
    asyncio.run(Daemon.tag_start(fake, "x"))
    out = asyncio.run(Daemon.tag_stop(fake, "x"))
    assert out["gpu_energy_j"] is None and out["gpu_j_per_token"] is None and "not final" in out["note"]
    assert out["duration_s"] == pytest.approx(4.0)


@dataclass
class RE(R):  # a GpuReading's counter epoch too
    energy_epoch: int = 0


def test_an_interval_one_gpu_has_no_energy_for_is_unknown_not_the_other_gpus_alone():
    # Two GPUs at 100 W each; GPU 1 falls off the bus after 1 s (every reading None from then on).
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    # Both judged serving, as 5 idle and 5 busy intervals would: before that judgement a busy interval is out of the
    # live J/token (rowtext._gpus_undecided: GPU 1's energy may be no work's).
    led.learner.serving = np.array([True, True])
    a = _trace(1, 0.0)  # live from the first read: no idle power is measured yet (rowtext._idle_unmeasured)
    led.on_start(a)
    led.open_tag("run", 0, 0)
    for k in range(4):
        lost = k >= 2
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(None if lost else 100.0 * k, None if lost else 100.0)])
    for j in range(25):
        led.on_tokens(a, int((0.2 + 0.1 * j) * S), 1)
    a.first_ns, a.last_ns, a.end_ns = int(0.2 * S), int(2.6 * S), int(2.7 * S)
    a.counts = Counts(generated_tokens=25, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    led.close_tag("run", 3 * S, 3 * S)
    led.advance(int(3.5 * S))
    iv = sink.rows["intervals"]
    assert [r["gpu_energy_j"] for r in iv] == [pytest.approx(200.0), None, None]  # not 100 J: GPU 1's is unknown
    assert [r["energy_method"] for r in iv] == ["counter", "none", "none"] and iv[1]["avg_gpu_power_w"] is None
    (req,) = sink.rows["requests"]
    assert req["gpu_energy_j"] is None and req["gpu_j_per_token"] is None and "GPU" in req["energy_note"]
    (tag,) = sink.rows["tags"]
    assert tag["gpu_energy_j"] is None and tag["gpu_j_per_token"] is None
    # J/token over the interval whose energy is known only (not its joules over every interval's tokens).
    assert led.totals.j_per_token == pytest.approx(iv[0]["requests_energy_j"] / iv[0]["proxy_tokens"])
    assert led.totals.gpu_energy_j[0] == pytest.approx(300.0)  # the GPU that reads on still counts


def test_the_time_a_gpu_gave_no_energy_reading_is_counted_per_gpu_and_whether_it_is_unread_now():
    # powerprof_gpu_energy_joules_total adds 0 J for an unread GPU: before, nothing said for which time, so a rate()
    # over it read 0 W for a lost GPU. Two GPUs; GPU 1 unread at the edges 2 s and 3 s, back at 4 s.
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    for k in range(4):
        lost = k >= 2
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(None if lost else 100.0 * k, None if lost else 100.0)])
    led.advance(int(3.5 * S))
    # Intervals 1-2 s and 2-3 s have no reading of GPU 1 at one edge or both: 2 s unknown, and unread now.
    assert led.totals.gpu_unknown_s == (0.0, pytest.approx(2.0))
    assert led.totals.gpu_unread_now == (False, True)
    assert led.totals.intervals == 3
    assert led.totals.gpu_energy_j == (pytest.approx(300.0), pytest.approx(100.0))
    for k in (4, 5):  # back (read again): 3-4 s still has no reading at 3 s
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(100.0 * k, 100.0)])
    led.advance(int(5.5 * S))
    assert led.totals.gpu_unknown_s == (0.0, pytest.approx(3.0))
    assert led.totals.gpu_unread_now == (False, False)
    assert led.totals.intervals == 5


def test_an_interval_across_a_gpu_counter_jump_takes_integrated_power_not_the_jump():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for k in range(4):
        jump = 50_000.0 if k >= 2 else 0.0
        led.add_gpu_sample(k * S, k * S, [RE(100.0 * k + jump, 100.0, energy_epoch=1 if k >= 2 else 0)])
    led.advance(int(3.5 * S))
    iv = sink.rows["intervals"]
    assert [r["gpu_energy_j"] for r in iv] == [pytest.approx(100.0)] * 3
    assert [r["energy_method"] for r in iv] == ["counter", "power_integration", "counter"]


def test_a_counter_jump_next_to_a_counter_only_edge_is_integrated_as_the_profiler_does_not_lost():
    # A request's end edge reads the counter alone (no power). Across a reset the counter is no figure, and the
    # trapezoid had no power at that edge: the interval before it was `none` and its energy unknown. The
    # profiler's integration (energy.instant_power_energy_j) holds the last power reading up to such an edge:
    # 300 W, then idle (55 W) once the request ended at 2.5 s; the tick at 3 s reads idle.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.add_gpu_sample(0, 0, [RE(0.0, 300.0)])
    led.add_gpu_sample(1 * S, 1 * S, [RE(300.0, 300.0)])
    led.add_gpu_sample(2 * S, 2 * S, [RE(600.0, 300.0)])
    led.add_gpu_edge(int(2.5 * S), int(2.5 * S), [5.0])  # the counter restarted (a driver reload)
    led.add_gpu_sample(3 * S, 3 * S, [RE(32.5, 55.0)])
    led.advance(int(3.5 * S))
    iv = sink.rows["intervals"]
    assert [r["energy_method"] for r in iv] == ["counter", "counter", "power_integration", "counter"]
    assert [r["gpu_energy_j"] for r in iv] == [pytest.approx(300.0), pytest.approx(300.0), pytest.approx(150.0),
                                               pytest.approx(27.5)]


def test_a_gpu_no_server_uses_gives_its_energy_to_idle_not_to_the_requests():
    # Two GPUs sampled, the server on GPU 0 only (a host whose other GPU is idle or runs nothing
    # proxied). GPU 0 draws 70 W idle and 400 W while a request decodes; GPU 1 draws 70 W throughout.
    # Before: every busy interval's 470 J went to the request, GPU 1's 70 J included (+17.5% per
    # request; +24% on the simulator, 2 H200s, server on one).
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    e = [0.0, 0.0]
    t = 0
    for _ in range(8):  # idle: the idle power of each GPU is measured
        led.add_gpu_sample(t * S, t * S, [R(e[0], 70.0), R(e[1], 70.0)])
        e = [e[0] + 70.0, e[1] + 70.0]
        t += 1
    reqs = []
    for k in range(40):  # one request after another, each live through its own whole interval
        tr = _trace(100 + k, t - 0.001)
        led.on_start(tr)
        for j in range(10):
            led.on_tokens(tr, int((t + 0.05 + 0.09 * j) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = int((t + 0.05) * S), int((t + 0.86) * S), int((t + 0.999) * S)
        tr.counts = Counts(generated_tokens=10, prompt_tokens=0, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
        reqs.append(tr)
        led.add_gpu_sample(t * S, t * S, [R(e[0], 400.0), R(e[1], 70.0)])
        e = [e[0] + 400.0, e[1] + 70.0]
        t += 1
        led.advance(int((t - 0.5) * S))
    led.add_gpu_sample(t * S, t * S, [R(e[0], 70.0), R(e[1], 70.0)])
    led.advance(int((t + 1) * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert len(got) == 40
    # Once GPU 1 is seen to draw no more when work runs (5 busy intervals), its 70 J is idle.
    late = [got[100 + k]["gpu_energy_j"] for k in range(10, 40)]
    assert late == [pytest.approx(400.0, rel=0.01)] * 30
    assert led.learner.serving.tolist() == [True, False]
    iv = sink.rows["intervals"]
    for row in iv:  # every joule still lands in exactly one place
        assert row["requests_energy_j"] + row["idle_energy_j"] + row["unproxied_energy_j"] == pytest.approx(row["gpu_energy_j"])
    assert led.totals.energy_by_dest_j[1] >= 30 * 70.0  # GPU 1's energy in busy intervals is idle


def _steady_traffic_on_two_gpus(gpu1_serves, lead_s=0.0, told=None, tell=None, even=False):
    """Two GPUs, requests back to back from `lead_s` on (idle before) with 0.1-0.25 s gaps inside 1 s reads. GPU 0 draws
    100 W idle, 300 W while a request is live; GPU 1 60 W throughout (serving nothing), or half GPU 0's (serving too).
    Returns the requests' spans, their rows by id, the ledger and each row's error against its truth (%). `told`: the
    serving GPUs the daemon's placement check (or daemon.gpus) tells the ledger before the first read; `tell`: a
    callable given the ledger then (the daemon's own check telling it). even: each request 0.9 s, 0.1 s apart (a load
    too even for the power to judge which GPUs serve until the traffic stops)."""
    rnd = np.random.default_rng(3)
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    if told is not None:
        led.tell_serving(told, "told by the test")
    if tell is not None:
        tell(led)
    t, reqs = lead_s, []
    while t < 58.0:
        live = 0.9 if even else float(rnd.uniform(0.5, 1.2))
        reqs.append((t, t + live))
        t += live + (0.1 if even else float(rnd.uniform(0.1, 0.25)))

    def energy_j(x):
        return 100.0 * x + 200.0 * sum(max(0.0, min(b, x) - a) for a, b in reqs if a < x)

    ev = [(float(s), -1, -1) for s in range(61)]
    for i, (a, b) in enumerate(reqs):
        ev += [(a, 0, i), (b, 2, i)] + [(a + 0.05 + 0.02 * k, 1, i) for k in range(int((b - a - 0.06) / 0.02))]
    trs = {}
    for x, kind, i in sorted(ev):
        if kind == -1:
            gpu1 = R(energy_j(x) / 2, 100.0) if gpu1_serves else R(60.0 * x, 60.0)
            led.add_gpu_sample(int(x * S), int(x * S), [R(energy_j(x), 200.0), gpu1])
            led.advance(int(x * S))
        elif kind == 0:
            trs[i] = _trace(i + 1, x)
            led.on_start(trs[i])
        elif kind == 1:
            tr = trs[i]
            tr.first_ns = tr.first_ns or int(x * S)
            tr.last_ns = int(x * S)
            led.on_tokens(tr, int(x * S), 1)
        else:
            tr = trs[i]
            tr.end_ns = int(x * S)
            tr.counts = Counts(generated_tokens=int((reqs[i][1] - reqs[i][0] - 0.06) / 0.02), prompt_tokens=20,
                               model=None, stop_reason=None, token_source="usage")
            led.on_end(tr)
    led.close_all(62 * S)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    truth_w = 450.0 if gpu1_serves else 300.0
    err = {i + 1: 100 * (got[i + 1]["gpu_energy_j"] / (truth_w * (b - a)) - 1) for i, (a, b) in enumerate(reqs)}
    return reqs, got, led, err, sink


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_a_gpu_no_server_uses_is_found_under_steady_traffic_with_no_idle_intervals(gpu1_serves):
    # No interval idle: the real daemon's intervals are not cut at the gaps with more than 4 requests in flight.
    # Before: with one idle interval of the 5 the judging needed, GPU 1 was never judged; its 60 W went to the
    # requests, every row +18.8% median (max +21.4%), unflagged.
    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(gpu1_serves)
    late = [err[i + 1] for i, (a, b) in enumerate(reqs) if a > 35]
    assert len(late) > 15
    assert abs(float(np.median(late))) < 3, late  # each row's own error is the split's among the gaps (±10%)
    assert len(led.learner._g_idle) < 5  # judged from the busy intervals alone
    assert led.learner.serving.tolist() == [True, gpu1_serves]


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_rows_split_before_the_serving_gpus_are_judged_are_flagged_with_a_bound(gpu1_serves):
    # The same steady traffic after 3 s idle: the idle power is measured at once, but 3 idle intervals judge no GPU, so
    # until 30 busy intervals are in every GPU's energy is the work's. Before: GPU 1's 60 W in those rows, unflagged,
    # 29 of 53 rows +20.2% median (+13.6% to +23.9%), none marked. Now those rows say UNSURE_FLAG with a bound at least
    # their excess; the rest (judged) unflagged and within 5%; where GPU 1 serves too, the rows after the judgement
    # stay unflagged.
    reqs, got, led, err, sink = _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0)
    assert led.learner.serving.tolist() == [True, gpu1_serves]
    flagged = [i for i, r in got.items() if "may be the draw of a GPU serving none" in (r["energy_note"] or "")]
    assert len(flagged) > 20
    assert set(flagged) == {i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")}
    last_flagged_s = max(reqs[i - 1][0] for i in flagged)
    later = [i for i in got if reqs[i - 1][0] > last_flagged_s]
    assert len(later) > 15 and not any(UNSURE_FLAG in (got[i]["energy_note"] or "") for i in later)
    assert max(abs(err[i]) for i in later) < 5.5, [err[i] for i in later]
    for i in flagged:
        bound_j = float(got[i]["energy_note"].split("may be the draw")[0].split("up to ")[-1].split(" J")[0])
        a, b = reqs[i - 1]
        assert bound_j >= got[i]["gpu_energy_j"] - (450.0 if gpu1_serves else 300.0) * (b - a) - 0.5
    if not gpu1_serves:
        assert max(err[i] for i in flagged) > 10  # what the flag says
    assert led.flagged_requests[UNSURE_FLAG] == len(flagged)
    iv = [r for r in sink.rows["intervals"] if "knew which of the sampled GPUs" in (r["energy_note"] or "")]
    assert iv and all(r["kind"] != "idle" for r in iv)


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_rows_split_with_the_serving_gpus_told_are_not_flagged(gpu1_serves):
    # The same scene, the daemon told which GPUs serve before the first read (its placement check: the GPUs the server's
    # processes hold; or a set daemon.gpus, all sampled ones). Before, the telling named in the rows' fix (daemon.gpus)
    # set nothing: the same rows flagged as untold (29 of 53). Now none is, each within 5.5% of its truth.
    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0, told=[True, gpu1_serves])
    assert len(got) > 50
    assert not [i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")]
    assert max(abs(e) for e in err.values()) < 5.5, err
    assert GPUS_UNDECIDED_REASON not in led.totals.jpt_left_out and not led.totals.serving_undecided


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_a_told_mask_the_power_judges_otherwise_leaves_which_serve_undecided_warned_and_its_rows_flagged(gpu1_serves,
                                                                                                        caplog):
    # The told mask is the other one: GPU 1 told serving while it draws 60 W serving nothing (an idle context taken for
    # the server's), or told idle while its power follows the work (a worker not found as the server's; or, told right,
    # another server whose load follows the traffic: the review's +50%). Before, the judgement overrode the told mask
    # silently and stood (right or wrong: which is, nothing in the ledger can say). Now, once judged, neither is picked:
    # a WARNING naming both, the rows split from then on flagged (gpus-undecided), /metrics' gauge absent.
    import logging

    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")
    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0, told=[True, not gpu1_serves])
    warned = [r for r in caplog.records if "undecided" in r.getMessage() and r.levelno == logging.WARNING
              and "tells" in r.getMessage()]
    assert len(warned) == 1 and "the GPUs' power judges" in warned[0].getMessage(), [r.getMessage() for r in warned]
    assert led.learner.serving is None and led.learner.serving_from == "disagree" and led.totals.serving_undecided
    late = [i + 1 for i, (a, b) in enumerate(reqs) if a > 45]
    assert late and all(UNSURE_FLAG in (got[i]["energy_note"] or "") for i in late), [got[i]["energy_note"] for i in late]
    assert led.totals.jpt_left_out[GPUS_UNDECIDED_REASON][0] > 0


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_an_asserted_serving_mask_splits_at_once_and_a_power_judgement_against_it_is_warned_naming_the_key(gpu1_serves,
                                                                                                          caplog):
    # daemon.serving_gpus = [0] (Daemon._open tells it at once): the server unseen (a container), so the placement
    # check tells nothing. Untold, the rows before the power's judgement were flagged (29 of 53 here; for good under a
    # load too even to judge). Asserted right (GPU 1 idle at 60 W): none flagged, each within 5.5%. Asserted wrong (GPU 1
    # serving too): the power's judgement disagrees, warned naming the key and its fix, the rows after it flagged.
    from powerprof.daemon.ledger import SERVING_ASSERTED_SOURCE

    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")
    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(
        gpu1_serves, lead_s=3.0, tell=lambda led: led.tell_serving([True, False], SERVING_ASSERTED_SOURCE))
    flagged = [i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if not gpu1_serves:
        assert not flagged and max(abs(e) for e in err.values()) < 5.5, (flagged, err)
        assert led.learner.serving_from == "both" and not said, said
        return
    warned = [m for m in said if "daemon.serving_gpus tells" in m]
    assert len(warned) == 1 and "fix: correct daemon.serving_gpus" in warned[0], said
    assert any("the GPUs daemon.serving_gpus asserts serving" in m for m in said), said
    assert led.learner.serving_from == "disagree"
    late = [i + 1 for i, (a, b) in enumerate(reqs) if a > 45]
    assert late and set(late) <= set(flagged)


@pytest.mark.parametrize("even", [False, True], ids=["varied", "even"])
@pytest.mark.parametrize("gpu1_serves", [False, True], ids=["right", "tp-pair-as-one"])
def test_rows_split_by_an_assertion_the_power_has_not_confirmed_say_so_and_are_counted(gpu1_serves, even, caplog):
    # daemon.serving_gpus = [0], the server unseen. Until the GPUs' power judges the same, its rows rest on the
    # operator's word alone: they say serving-asserted (kept in J/token: flagged out, an even load, the case the key is
    # for, had every row flagged as without it), the interval rows too, counted; a judgement against it says how many
    # were written so. Before, no mark: asserted wrong under an even load 55 of 55 rows -33.3%, energy_note empty
    # (a review's scene); varied, the 29 before the judgement -33.2%, unsaid and uncounted.
    from powerprof.daemon.ledger import SERVING_ASSERTED_SOURCE
    from powerprof.storage.schema import SERVING_ASSERTED_FLAG

    caplog.set_level(logging.WARNING, logger="powerprof.daemon.ledger")
    reqs, got, led, err, sink = _steady_traffic_on_two_gpus(
        gpu1_serves, lead_s=3.0, even=even, tell=lambda led: led.tell_serving([True, False], SERVING_ASSERTED_SOURCE))
    said = {i for i, r in got.items() if SERVING_ASSERTED_FLAG in (r["energy_note"] or "")}
    flagged = {i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")}
    # Every row not flagged out rests on the assertion alone (until the power judged) or on both agreeing after.
    before = {i + 1 for i, (a, b) in enumerate(reqs) if b < 30}
    assert before <= said and led.flagged_requests[SERVING_ASSERTED_FLAG] == len(said), (len(said), len(before))
    if even:
        assert said == set(got), (len(said), len(got))
    wrong = {i for i in set(got) - flagged if abs(err[i]) > 6}
    assert wrong <= said, sorted(wrong - said)
    assert any(SERVING_ASSERTED_FLAG in (r["energy_note"] or "") for r in sink.rows["intervals"])
    warned = [r.getMessage() for r in caplog.records if "daemon.serving_gpus tells" in r.getMessage()]
    if gpu1_serves:
        assert len(warned) == 1 and "request row(s) already written" in warned[0], warned
    else:
        assert not warned and not flagged


@pytest.mark.parametrize("mask,gpu1_serves", [([True, False], True), ([True, True], False), ([True, False], False)],
                         ids=["tp-pair-as-one", "idle-gpu1-as-serving", "right"])
def test_a_tag_over_intervals_split_by_an_unconfirmed_assertion_says_serving_asserted(mask, gpu1_serves):
    # A tag open 5..50 s over the even-load scene, daemon.serving_gpus asserted. Before, its note said nothing of the
    # assertion (-33.3% / +21.4% J/token at `powerprof tag stop`), and of a GPU the mask left out it said "drew no more
    # when it ran than when idle, so their 6300 J ... is idle", as if the power had said so.
    from powerprof.daemon.ledger import SERVING_ASSERTED_SOURCE
    from powerprof.storage.schema import SERVING_ASSERTED_FIX, SERVING_ASSERTED_FLAG

    def tell(led):
        led.tell_serving(mask, SERVING_ASSERTED_SOURCE)
        adv = led.advance

        def advance(t_ns):
            if t_ns == 5 * S:
                led.open_tag("w", 5 * S, 5 * S)
            if t_ns == 50 * S:
                led.close_tag("w", 50 * S, 50 * S)
            return adv(t_ns)
        led.advance = advance

    _, _, led, _, sink = _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0, even=True, tell=tell)
    (tag,) = sink.rows["tags"]
    note = tag["energy_note"] or ""
    assert f"{SERVING_ASSERTED_FLAG}: 45 busy interval(s) of its 45 were split by daemon.serving_gpus" in note, note
    assert SERVING_ASSERTED_FIX in note, note
    assert "drew no more" not in note, note
    if not all(mask):
        assert "daemon.serving_gpus leaves out GPU(s) gpu1" in note, note


def test_metrics_say_the_serving_mask_is_the_operators_word_and_count_its_rows():
    # powerprof_gpu_serving showed an asserted mask as known, so observe.py and the tuner weighed levels by it unsaid.
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.ledger import SERVING_ASSERTED_SOURCE
    from powerprof.daemon.metrics import Snapshot, make_registry, render
    from powerprof.storage.schema import SERVING_ASSERTED_FLAG

    mid = []

    def tell(led):
        led.tell_serving([True, False], SERVING_ASSERTED_SOURCE)
        adv = led.advance
        led.advance = lambda t_ns: (adv(t_ns), mid.append(led.totals.serving_asserted))[0]

    led = _steady_traffic_on_two_gpus(False, lead_s=3.0, even=True, tell=tell)[2]
    assert mid[10] and mid[40], mid  # split by the assertion alone while the even load goes on
    for tot in (led.totals, type(led.totals)(serving_asserted=True, flagged_requests={SERVING_ASSERTED_FLAG: 7})):
        text = render(make_registry(type("H", (), {"snapshot": Snapshot(
            serving_asserted=tot.serving_asserted, flagged_requests=dict(tot.flagged_requests))})))
        got = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
        assert got["powerprof_gpu_serving_asserted"] == float(tot.serving_asserted)
        assert got["powerprof_requests_serving_asserted_total"] == tot.flagged_requests[SERVING_ASSERTED_FLAG] > 0


@pytest.mark.parametrize("saved", [[True, False], [True, True]])
def test_the_last_runs_judgement_is_provisional_kept_anew_and_said_against_this_runs(saved, caplog):
    # The mask the last run's power judged, read back at start (servingstate.load): nothing shows the server still on
    # those GPUs, so it is never taken: the rows before this run's judgement stay flagged as without it (29 of 53 here,
    # GPU 1 idle at 60 W), and the judgement is said against it (the same: INFO; else a WARNING, this run's standing:
    # saved [T, T], a server moved off GPU 1 since, taken, would have put GPU 1's 60 W in every row, +20%, unflagged).
    # The judgement taken is handed on to be kept (on_judged). Before, nothing was kept or said.
    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")
    kept: list = []

    def start(led):
        led.saved_serving, led.on_judged = (saved, 0.0), kept.append

    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(False, lead_s=3.0, tell=start)
    flagged = [i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")]
    assert len(flagged) == 29 and kept == [[True, False]], (len(flagged), kept)
    said = [r for r in caplog.records if "the last run's judgement" in r.getMessage()]
    assert len(said) == 1 and (said[0].levelno == logging.INFO) == (saved == [True, False]), [r.getMessage() for r in said]
    assert led.saved_serving is None


@pytest.mark.parametrize("asserted", [False, True])
def test_a_differing_last_judgement_says_only_what_became_of_the_rows_before_this_one(asserted, caplog):
    # Saved [T, T], this run's power judges [T, F]. The WARNING said the rows before the judgement were "flagged
    # gpus-undecided as without it" also where daemon.serving_gpus split them unflagged (0 of 53 flagged: a review's
    # repro). Now it says what happened: the undecided intervals and their flag, or the assertion's.
    from powerprof.daemon.ledger import SERVING_ASSERTED_SOURCE
    from powerprof.storage.schema import SERVING_ASSERTED_FLAG

    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")

    def start(led):
        if asserted:
            led.tell_serving([True, False], SERVING_ASSERTED_SOURCE)
        led.saved_serving = ([True, True], 0.0)

    got = _steady_traffic_on_two_gpus(False, lead_s=3.0, tell=start)[1]
    flagged = [i for i, r in got.items() if UNSURE_FLAG in (r["energy_note"] or "")]
    said = [r.getMessage() for r in caplog.records if "the last run's judgement" in r.getMessage()]
    assert len(said) == 1 and (f"flagged {GPUS_UNDECIDED_REASON}" in said[0]) == bool(flagged), (said, len(flagged))
    assert (SERVING_ASSERTED_FLAG in said[0]) == asserted and bool(flagged) != asserted, said


def test_a_saved_time_the_log_cannot_format_never_costs_the_rows_their_energy():
    # A saved time of NaN (servingstate.load refuses it now; a log line must not stop the accounting all the same)
    # raised in _say_judged between the fit and the rows' energy: the close failed there, one interval's energy lost from
    # live rows (15280 -> 15228 J, a row -16.7% unflagged; a review's scene). Now the rows are as with a readable time.
    def start(saved_s):
        return lambda led: setattr(led, "saved_serving", ([True, False], saved_s))

    got_ok = _steady_traffic_on_two_gpus(False, lead_s=3.0, tell=start(0.0))[1]
    got = _steady_traffic_on_two_gpus(False, lead_s=3.0, tell=start(float("nan")))[1]
    assert {i: r["gpu_energy_j"] for i, r in got.items()} == {i: r["gpu_energy_j"] for i, r in got_ok.items()}


@pytest.mark.parametrize("follows", [False, True])
def test_a_foreign_servers_context_makes_the_told_mask_provisional_its_rows_flagged_till_the_power_agrees(follows):
    # The daemon's own placement check on a stand-in: the server (4242) holds 14 GiB on GPU 0, another process (9999,
    # not the server's: another server, or a TP worker not found as its) 14 GiB on GPU 1. follows: GPU 1's load follows
    # the same traffic (a balancer in front of both), the proxied work's truth GPU 0's alone (300 W). Before, the check
    # told nothing and the power, judging alone, took GPU 1 serving: the 24 rows after the judgement unflagged, +50.1%
    # median. Now the check tells [T, F] provisional: every row flagged until the power judges; a disagreement stays
    # flagged, an agreement (GPU 1 drawing 60 W whatever the traffic) unflags the rows after it.
    from types import SimpleNamespace

    from powerprof.daemon.service import Daemon
    from powerprof.sim.nvml import SimNVML

    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(0, 4242, 14 << 30, lambda: 1.0)
    sim.add_process(1, 9999, 14 << 30, lambda: 1.0)

    def check(led):
        Daemon._check_placement(SimpleNamespace(
            _server_procs=lambda: ({4242}, None), collector=SimpleNamespace(nvml=sim, infos=sim.gpus[:2]),
            gpu_uuids={i: sim.gpus[i].uuid for i in (0, 1)}, _unsampled=(), ledger=led, _idle_said=False,
            _helper_said=False))
        told.append(led._told_serving)

    told: list = []
    reqs, got, led, _, _ = _steady_traffic_on_two_gpus(follows, lead_s=3.0, tell=check)
    assert led.learner.judged.tolist() == [True, follows]
    err = {i + 1: 100 * (got[i + 1]["gpu_energy_j"] / (300.0 * (b - a)) - 1) for i, (a, b) in enumerate(reqs)}
    unflagged = [i for i, r in got.items() if UNSURE_FLAG not in (r["energy_note"] or "")]
    if follows:
        assert led.learner.serving is None and led.learner.serving_from == "disagree"
        assert not unflagged, [err[i] for i in unflagged]
    else:
        assert led.learner.serving_from == "both" and len(unflagged) > 15
        assert max(abs(err[i]) for i in unflagged) < 5.5, [err[i] for i in unflagged]
        first_unflagged_s = min(reqs[i - 1][0] for i in unflagged)
        assert all(i in unflagged for i in got if reqs[i - 1][0] > first_unflagged_s + 2)
    assert told[0][0].tolist() == [True, False] and told[0][2]  # provisional


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_the_line_naming_the_serving_gpus_is_said_once_per_change(gpu1_serves, caplog):
    # Once judged all serving, the line came at every close (compared with the local mask the all-serving branch sets
    # to None): 15 times in 20 s on the review's daemon. Now once, as where one GPU serves none of the work.
    import logging

    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")
    _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0)
    runs_on = [r.getMessage() for r in caplog.records if "the proxied work runs on" in r.getMessage()]
    assert len(runs_on) == 1, runs_on
    assert ("every sampled GPU takes part" in runs_on[0]) == gpu1_serves and "(judged from their power)" in runs_on[0]


@pytest.mark.parametrize("gpu1_serves", [False, True])
def test_the_log_says_which_gpus_serve_is_not_known_with_the_fix_while_it_is_not(gpu1_serves, caplog, monkeypatch):
    # Untold: the log says so at the first such interval and again every UNDECIDED_SAY_S while they go on (here 10 s),
    # and the live J/token's left-out counters give them their own reason. Before: nothing in the log (under a load too
    # even to judge, J/token blank for good, silent), the left-out intervals counted as uncertain-uncounted among ~6
    # other causes.
    import logging

    from powerprof.daemon import ledger as ledger_mod

    monkeypatch.setattr(ledger_mod, "UNDECIDED_SAY_S", 10.0)
    caplog.set_level(logging.INFO, logger="powerprof.daemon.ledger")
    reqs, got, led, err, _ = _steady_traffic_on_two_gpus(gpu1_serves, lead_s=3.0)
    said = [r.getMessage() for r in caplog.records if "serve the proxied work is not known" in r.getMessage()]
    assert 2 <= len(said) <= 4, said  # judged after ~30 busy intervals
    assert all("where it can see the server's processes" in m and GPUS_UNDECIDED_REASON in m for m in said)
    n_iv, n_tok = led.totals.jpt_left_out[GPUS_UNDECIDED_REASON]
    assert n_iv >= 25 and n_tok > 0 and UNSURE_FLAG not in led.totals.jpt_left_out, led.totals.jpt_left_out
    assert not led.totals.serving_undecided  # judged by the end


def test_a_told_mask_of_no_sampled_gpu_withdraws_the_earlier_telling():
    from support import LedgerReading as R

    # The server told on GPU 0, then seen on unsampled GPUs alone (told [F, F]). Before, the all-False mask was ignored
    # silently and [T, F] stood; now the telling is withdrawn: which serve undecided, its rows flagged.
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    led.tell_serving([True, False], "told by the test")
    for x in range(3):
        led.add_gpu_sample(x * S, x * S, [R(100.0 * x, 100.0), R(60.0 * x, 60.0)])
        led.advance(x * S)
    assert led.learner.serving.tolist() == [True, False]
    led.tell_serving([False, False], "told by the test")
    for x in range(3, 6):
        led.add_gpu_sample(x * S, x * S, [R(100.0 * x, 100.0), R(60.0 * x, 60.0)])
        led.advance(x * S)
    assert led.learner.told is None and led.learner.serving is None


def test_serving_is_undecided_while_untold_and_unjudged_and_told_gpus_wait_for_no_judgement():
    # GPU 0 300 W, GPU 1 60 W, a request live 0.2-2.5 s: undecided until told; /metrics leaves powerprof_gpu_serving
    # out meanwhile (before: 1 on every GPU, read as all serving).
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    tr = _trace(1, 0.2)
    _decoded(led, tr, 0.3, 0.1, 20, 2.2, 2.5, prompt_tokens=5)
    for x in range(5):
        led.add_gpu_sample(x * S, x * S, [R(300.0 * x, 300.0), R(60.0 * x, 60.0)])
        led.advance(x * S)
    assert led.totals.intervals > 0 and led.totals.serving_undecided
    led.tell_serving([True, False], "told by the test")
    for x in range(5, 8):
        led.add_gpu_sample(x * S, x * S, [R(300.0 * x, 300.0), R(60.0 * x, 60.0)])
        led.advance(x * S)
    assert not led.totals.serving_undecided and led.learner.serving.tolist() == [True, False]
    assert led.totals.serving_mask == (True, False)


def _server_on_gpu0_gpu1_idle(lose_gpu1_at=None, early_tag=False, gpu_names=None):
    """GPU 0 serves (70 W idle, 400 W busy), GPU 1 draws 70 W throughout; a tag over the last 20 of 40 requests.
    `lose_gpu1_at`: from that request on GPU 1 (judged not serving) gives no energy reading."""
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1, gpu_names=gpu_names)
    e = [0.0, 0.0]
    t = 0
    for _ in range(8):
        if early_tag and t == 1:
            led.open_tag("early", t * S, t * S)
        if early_tag and t == 6:
            led.close_tag("early", t * S, t * S)
        led.add_gpu_sample(t * S, t * S, [R(e[0], 70.0), R(e[1], 70.0)])
        e = [e[0] + 70.0, e[1] + 70.0]
        t += 1
    for k in range(40):
        if k == 20:
            led.open_tag("batch", t * S, t * S)
        tr = _trace(100 + k, t - 0.001)
        led.on_start(tr)
        for j in range(10):
            led.on_tokens(tr, int((t + 0.05 + 0.09 * j) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = int((t + 0.05) * S), int((t + 0.86) * S), int((t + 0.999) * S)
        tr.counts = Counts(generated_tokens=10, prompt_tokens=0, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
        lost = lose_gpu1_at is not None and k >= lose_gpu1_at
        led.add_gpu_sample(t * S, t * S, [R(e[0], 400.0), R(None, None) if lost else R(e[1], 70.0)])
        e = [e[0] + 400.0, e[1] + 70.0]
        t += 1
        led.advance(int((t - 0.5) * S))
    led.close_tag("batch", t * S, t * S)
    lost = lose_gpu1_at is not None
    led.add_gpu_sample(t * S, t * S, [R(e[0], 70.0), R(None, None) if lost else R(e[1], 70.0)])
    led.advance(int((t + 3) * S))
    assert led.learner.serving.tolist() == [True, False]
    sink.ledger = led
    return sink


def test_a_tags_j_per_token_is_of_the_serving_gpus_as_its_requests_are():
    # Before: the tag summed both GPUs, 9400 J / 200 tokens = 47.0 J/token against its requests' 40.0 (+17.5%),
    # and its note said nothing of GPU 1.
    sink = _server_on_gpu0_gpu1_idle()
    req = {r["request_id"]: r for r in sink.rows["requests"]}
    assert {round(req[100 + k]["gpu_j_per_token"], 1) for k in range(20, 40)} == {40.0}
    (tag,) = sink.rows["tags"]
    assert tag["gpu_j_per_token"] == pytest.approx(40.0, rel=0.01)
    assert tag["gpu_energy_j"] == pytest.approx(8000.0, rel=0.01)  # GPU 0's: its J/token's
    assert "GPU(s) gpu1 drew no more" in tag["energy_note"] and "1400 J" in tag["energy_note"]
    assert "all sampled GPUs 9400 J" in tag["energy_note"]


def test_a_tag_closing_before_the_daemon_judged_which_gpus_serve_says_it_holds_every_gpus_energy():
    # Before: a tag wholly before the judgement held both GPUs' energy (GPU 1 idle beside the server) and its note said
    # nothing of it (only a tag with GPUs judged idle inside it mentioned its intervals before the judgement).
    sink = _server_on_gpu0_gpu1_idle(early_tag=True)
    tags = {r["name"]: r for r in sink.rows["tags"]}
    early = tags["early"]
    assert early["gpu_energy_j"] == pytest.approx(5 * 140.0, rel=0.01)  # both GPUs' energy
    assert "which GPUs serve not yet judged" in (early["energy_note"] or "")
    assert "every sampled GPU's energy" in early["energy_note"]
    assert "which GPUs serve not yet judged" not in (tags["batch"]["energy_note"] or "")


def test_losing_a_gpu_that_serves_nothing_leaves_the_requests_energy_whole_and_names_it():
    # Before: every request from the loss on had no energy (GPU energy unknown) until the daemon restarted.
    sink = _server_on_gpu0_gpu1_idle(lose_gpu1_at=30)
    req = {r["request_id"]: r for r in sink.rows["requests"]}
    assert [req[100 + k]["gpu_energy_j"] for k in range(30, 40)] == [pytest.approx(400.0, rel=0.01)] * 10
    assert all(req[100 + k]["gpu_j_per_token"] == pytest.approx(40.0, rel=0.01) for k in range(30, 40))
    lost = [r for r in sink.rows["intervals"] if r["gpu_energy_j"] is None]
    assert lost, "the node total is unknown where GPU 1 gave no reading"
    assert all("GPU(s) gpu1 gave no" in r["energy_note"] and "restarting the daemon" in r["energy_note"] for r in lost)
    assert all(r["requests_energy_j"] == pytest.approx(400.0, rel=0.01) for r in lost if r["kind"] != "idle")
    (tag,) = sink.rows["tags"]
    assert tag["gpu_energy_j"] == pytest.approx(8000.0, rel=0.01)
    assert tag["gpu_j_per_token"] == pytest.approx(40.0, rel=0.01)
    assert "GPU(s) gpu1 gave no" in tag["energy_note"] and "restarting the daemon" in tag["energy_note"]


def test_the_notes_name_a_gpu_by_its_nvml_index_and_uuid_not_its_position_among_the_sampled():
    # daemon.gpus = [2, 5]: before, the notes said "sampled GPU(s) [1]", a position, which is GPU 5.
    names = ["gpu2 (GPU-2222)", "gpu5 (GPU-5555)"]
    sink = _server_on_gpu0_gpu1_idle(lose_gpu1_at=30, gpu_names=names)
    lost = [r for r in sink.rows["intervals"] if r["gpu_energy_j"] is None]
    assert lost and all("gpu5 (GPU-5555)" in r["energy_note"] and "[1]" not in r["energy_note"] for r in lost)
    (tag,) = sink.rows["tags"]
    assert "GPU(s) gpu5 (GPU-5555) drew no more" in tag["energy_note"]
    assert "GPU(s) gpu5 (GPU-5555) gave no" in tag["energy_note"] and "[1]" not in tag["energy_note"]


def test_a_lost_idle_gpu_leaves_the_intervals_idle_energy_empty_and_the_serving_gpus_energy_in_the_totals():
    # Before: after the loss an interval read gpu_energy_j None, requests 400, idle_energy_j 0.0 (the lost GPU counted
    # 0 J) and the note said nothing of idle. Then (until this change) the whole interval's idle, the serving GPU's own
    # share with it, was taken out of the daemon's idle total and the interval counted in gpu_unknown_intervals, which
    # the tuner refuses a window on: a GPU serving nothing, lost for good, stopped the tuner for good.
    whole = _server_on_gpu0_gpu1_idle()
    sink = _server_on_gpu0_gpu1_idle(lose_gpu1_at=30)
    lost = [r for r in sink.rows["intervals"] if r["gpu_energy_j"] is None]
    assert lost and all(r["idle_energy_j"] is None for r in lost)  # the row's idle stays unknown
    assert all("idle_energy_j" in r["energy_note"] for r in lost)
    kept = [r for r in sink.rows["intervals"] if r["gpu_energy_j"] is not None]
    assert all(r["idle_energy_j"] is not None for r in kept)
    # Counted as idle-unknown only: not in the count the tuner refuses a window on.
    assert sink.ledger.totals.idle_unknown_intervals == len(lost)
    assert whole.ledger.totals.idle_unknown_intervals == 0
    assert sink.ledger.totals.gpu_unknown_intervals == 0
    # Every read GPU's energy stays in the totals: requests + idle + unproxied is the read energy, the lost GPU's
    # alone (unknown) out; the requests' own energy is whole.
    read = sum(r["gpu_energy_j"] for r in kept) + sum(r["requests_energy_j"] + (r["unproxied_energy_j"] or 0.0)
                                                        for r in lost)
    by_dest = sink.ledger.totals.energy_by_dest_j
    assert sum(by_dest) > read  # the serving GPU's idle share in the lost intervals is in, not taken out
    assert sum(sink.ledger.totals.energy_by_kind_j) == pytest.approx(sum(by_dest), rel=1e-6)
    assert by_dest[0] == pytest.approx(whole.ledger.totals.energy_by_dest_j[0], rel=0.02)
    assert by_dest[1] < whole.ledger.totals.energy_by_dest_j[1]  # the lost GPU's idle alone out



def _scrape_one_token_to_4_s(led) -> None:
    """Scrapes every 0.25 s to 3.5 s, the server counting one token at 1.02 s (in the window to 1.25 s), power fed each
    second, intervals advanced as the daemon does; then everything closed at 4 s."""
    for k in range(1, 13):
        now = int((0.5 + 0.25 * k) * S)
        led.add_server_tokens(now, 1.0 if k == 3 else 0.0, now - S // 4)
        if k % 4 == 2:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    led.close_all(int(4 * S))


def test_a_stream_whose_only_token_comes_in_its_closing_chunk_is_attributed_that_token():
    # vLLM with max_tokens=1 (a classifier, a yes/no): the role chunk, then the closing chunk with empty
    # content and finish_reason (the token is in it, the usage says so), then the usage chunk. The proxy
    # counts no chunk with content. Before: the request was attributed 0 tokens, its token and its
    # energy went to `unproxied` through the server's counter as if it had bypassed the proxy (on the
    # simulator, 1-token requests came out up to 47% low).
    import json

    from powerprof.daemon import streams
    parser = streams.new_parser("openai-chat")
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/chat/completions", "t", int(1.0 * S), 0, api="openai-chat", stream=True)
    led.on_start(tr)
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    events = [
        b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                                       "finish_reason": None}]}).encode() + b"\n\n",
        b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": ""},
                                                       "finish_reason": "length"}]}).encode() + b"\n\n",
        b"data: " + json.dumps({**chunk, "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 1,
                                                                  "total_tokens": 21}}).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    seen = 0
    for i, ev in enumerate(events):
        t = int((1.02 + 0.001 * i) * S)
        seen += _deliver(led, tr, parser, t, ev)
    tr.end_ns = int(1.03 * S)
    tr.counts = streams.summary_counts(parser.finish())
    led.on_end(tr)
    assert seen == 0 and tr.counts.generated_tokens == 1
    _scrape_one_token_to_4_s(led)
    (row,) = sink.rows["requests"]
    assert row["attributed_tokens"] == 1.0 and row["generated_tokens"] == 1
    assert row["gpu_j_per_token"] is not None
    ivs = sink.rows["intervals"]
    assert sum(r["proxy_tokens"] for r in ivs) == pytest.approx(1.0)
    assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("limit,prompt", [(None, None), (None, 4000), (1, None)],
                         ids=["no-max-tokens", "no-max-tokens-prompt-said", "max-tokens-1"])
def test_a_stream_that_said_no_count_says_so_on_its_row_and_its_intervals(limit, prompt):
    # vLLM's max_tokens 1 answer without include_usage: the role chunk, the closing chunk (its one token, empty
    # content, finish_reason length), [DONE]. Where the request set no max_tokens, nothing says the token: its row has
    # no generated_tokens, and the server's counter counts that token in an interval whose unproxied then holds a
    # proxied request's work. Before, the row's energy_note was null (1.9-5 J of ~80 J, simulated) or 'no share ...
    # (the response did not say it)' with no fix, and the interval said nothing, server_count `complete`. Where the
    # request's max_tokens is 1, the limit says it (StreamParser max_tokens): its token counted, nothing to say.
    import json

    from powerprof.daemon import streams
    parser = streams.new_parser("openai-chat", max_tokens=limit)
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/chat/completions", "t", int(1.0 * S), 0, api="openai-chat", stream=True)
    tr.extra["prompt_chars"] = 4000
    if limit is not None:
        tr.extra["max_tokens"] = limit
    if prompt is not None:  # its prompt's length said (a share by its prefill), its tokens not
        tr.extra["prompt_tokens"] = prompt
    led.on_start(tr)
    chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    events = [
        b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None},
                                                       "finish_reason": None}]}).encode() + b"\n\n",
        b"data: " + json.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": ""},
                                                       "finish_reason": "length"}]}).encode() + b"\n\n",
        b"data: [DONE]\n\n",
    ]
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    for i, ev in enumerate(events):
        _deliver(led, tr, parser, int((1.02 + 0.001 * i) * S), ev)
    tr.end_ns = int(1.03 * S)
    tr.counts = streams.summary_counts(parser.finish())
    led.on_end(tr)
    _scrape_one_token_to_4_s(led)
    (row,) = sink.rows["requests"]
    ivs = sink.rows["intervals"]
    if limit is not None:
        assert row["generated_tokens"] == 1 and row["attributed_tokens"] == pytest.approx(1.0)
        assert "no tokens" not in str(row["energy_note"])
        assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-9)
        assert not any("carried no token counts" in str(r["energy_note"]) for r in ivs)
        return
    assert row["generated_tokens"] is None and row["token_source"] == "none"
    note = row["energy_note"] or ""
    # Its note says the tokens are unknown, why, and the fix; its share rests on its prompt's work alone: said by the
    # server, or its body's estimate (before, that one had no share: its prefill costed at 0).
    assert "no tokens" in note and "include_usage" in note, row
    assert row["gpu_energy_j"] > 0 and note.startswith("approximate: no tokens: "), row
    assert (row["prompt_tokens_estimate"] is None) is (prompt is not None), row
    said = [r for r in ivs if r["unproxied_energy_j"] > 0]
    assert said, ivs  # the server's count of its token went to unproxied
    for r in said:  # server_count complete (the server's count is whole), the note says whose it may be
        assert "carried no token counts" in str(r["energy_note"]) and "include_usage" in r["energy_note"], r


def _chat(rid, arrival_s, chars):
    tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(arrival_s * S), 0, api="openai-chat", stream=True)
    tr.extra["prompt_chars"] = chars
    return tr


def _twin_streams(led, step_s, done_end_s, cut_end_s):
    """Two chat streams alike (2000-character prompts, 10 tokens each from 0.1 s, `step_s` apart), started on `led`:
    the first ends at done_end_s with its prompt counted by the server (500 tokens), the second's client leaves at
    cut_end_s before its usage. Not yet ended on the ledger."""
    done, cut = _chat(1, 0.05, 2000), _chat(2, 0.05, 2000)
    for tr in (done, cut):
        led.on_start(tr)
    for k in range(10):
        for tr in (done, cut):
            led.on_tokens(tr, int((0.1 + step_s * k) * S), 1)
    last = int((0.1 + step_s * 9) * S)
    done.first_ns, done.last_ns, done.end_ns = int(0.1 * S), last, int(done_end_s * S)
    cut.first_ns, cut.last_ns, cut.end_ns = int(0.1 * S), last, int(cut_end_s * S)
    done.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length",
                         token_source="usage")
    cut.counts = Counts(generated_tokens=10, prompt_tokens=None, model=None, stop_reason=None,
                        token_source="counted", tokens_estimated=True)
    cut.outcome = "client_disconnected"
    return done, cut


def _end_and_cost(led, *traces) -> None:
    """`traces` ended on `led`, then one interval of 100 J over [0, 1 s] closed around them (the ledger at 1.5 s)."""
    for tr in traces:
        led.on_end(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 100.0)
    led.advance(int(1.5 * S))


@pytest.mark.parametrize("stream, api, fix", [(True, "openai-chat", True), (False, "openai-chat", False),
                                              (True, "llamacpp", False), (True, "openai-responses", False)])
def test_a_prompt_never_said_is_said_with_the_fix_only_where_there_is_one(stream, api, fix):
    # include_usage is an OpenAI chat or completions stream's option: a whole answer (llama-server's n: 2) and a native
    # stream were told to ask for it (session 46's walkthrough against the real llama-server), and a Responses stream
    # (its usage comes unasked in response.completed; no stream_options) once its body was sized.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, quiet = _twin_streams(led, 0.05, 0.6, 0.6)
    quiet.outcome, quiet.stream, quiet.api = "ok", stream, api
    _end_and_cost(led, done, quiet)
    note = {r["request_id"]: r for r in sink.rows["requests"]}[2]["energy_note"]
    assert ("the stream carried no usage" in note and "include_usage" in note) is fix, note
    assert fix or note.startswith("approximate: the server's answer did not say the prompt's length"), note


def test_a_stream_cut_before_its_usage_is_costed_its_prompt_at_the_servers_own_ratio_and_says_so(caplog):
    # Two chat streams alike (2000-character prompts, 10 tokens each in one interval); the server counted the
    # first's prompt (500 tokens: 4 characters a token here), the second's client left before its usage. Before:
    # the second got no prefill work and its prompt's energy went to the first (1.8x its twin's energy).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, cut = _twin_streams(led, 0.05, 0.6, 0.6)
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.ledger"):
        _end_and_cost(led, done, cut)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["gpu_energy_j"] == pytest.approx(got[1]["gpu_energy_j"]) == pytest.approx(50.0)
    assert got[2]["prompt_tokens"] is None and got[2]["prompt_tokens_estimate"] == pytest.approx(500.0)
    assert got[1]["prompt_tokens_estimate"] is None and "estimate" not in got[1]["energy_note"]
    assert "split among them by the fixed ratio" in got[1]["energy_note"]  # its twin beside it, no fit yet
    note = got[2]["energy_note"]
    assert note.startswith("approximate:") and "client left" in note and "2000 prompt characters" in note
    assert led.prompts_estimated == {"client_left": 1}
    assert "costed at an estimate of 500 prompt tokens" in caplog.text


def _tools_none_twins(verdict: bool | None) -> tuple[Ledger, Sink]:
    """Two twin streams, the second cut, its 800 characters of `tools` sent with tool_choice "none", this server's
    verdict on rendering them `verdict` (None: undecided), costed: the ledger and its rows."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _idle_measured(led)  # 20 W: of the interval's 100 J, 9 J idle (0-0.05 s, 0.6-1 s), 91 J the two streams'
    if verdict is not None:
        led.tools_when_none["openai-chat"] = verdict
        led.tools_none_tally["openai-chat"] = [3, 0] if verdict else [0, 3]
    done, cut = _twin_streams(led, 0.05, 0.6, 0.6)
    cut.extra["prompt_tools_none_chars"] = 800
    _end_and_cost(led, done, cut)
    return led, sink


@pytest.mark.parametrize("verdict", [None, False, True], ids=["undecided", "not_rendered", "rendered"])
def test_a_cut_stream_whose_tool_choice_none_tools_are_undecided_is_said_and_kept_in_j_per_token(verdict):
    # A stream cut before its usage, costed its prompt from its body, 800 of its 2000 characters `tools` sent with
    # tool_choice "none": while this server's counted prompts have not shown whether it renders them, its prefill may be
    # costed at 500 tokens or at 300, and its row says so with both. It is NOT marked UNSURE_FLAG (left out): its split
    # error is mirrored in the rows sharing its intervals, which stay in, so leaving it out biased the host's J/token
    # (on the simulator's SGLang the tools' share of its error 2.1-3.7 points); kept in, the host's sum is unbiased.
    led, sink = _tools_none_twins(verdict)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    note = got[2]["energy_note"] or ""
    assert "tool_choice" in note and got[2]["gpu_energy_j"] > 0, note
    assert ("may or may not render them" in note) is (verdict is None), note
    assert UNSURE_FLAG not in note and UNSURE_FLAG not in (got[1]["energy_note"] or ""), note
    # Not on /metrics' powerprof_requests_uncertain_uncounted_total either: that counts rows left out.
    assert led.flagged_requests.get(UNSURE_FLAG, 0) == 0, led.flagged_requests


def test_analyze_keeps_a_ledger_row_whose_tools_are_undecided_in_j_per_token(tmp_path):
    # The ledger's own rows, written as the daemon writes them, through `powerprof analyze`: the cut stream whose
    # tools sent with tool_choice "none" are undecided (above: its prefill 500 or 300 tokens) stays in the host's
    # J/token beside its twin measured whole (both rows' 20 tokens; before, it was left out as uncertain and its
    # twin's mirrored error stayed in), and no request is counted uncertain.
    from powerprof.analysis.fleet import fleet_summary
    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import DatasetStore

    _, sink = _tools_none_twins(None)
    store = DatasetStore(tmp_path / "d", datasets(), host="h")
    for table in ("requests", "intervals"):
        store.append(table, sink.rows[table])
    assert store.flush()
    [h] = fleet_summary([str(tmp_path / "d")]).to_pylist()
    assert h["requests"] == 2 and h["uncertain_requests"] == 0, h
    assert h["attributed_tokens"] == pytest.approx(20.0) and h["gpu_j_per_token"] == pytest.approx(4.55), h


def test_a_batch_of_prompts_cut_before_its_usage_is_costed_their_sum_each_with_its_template():
    # A /v1/completions prompt list gave the proxy no size: its prefill was costed at 0 (silently, before the row said
    # prompt-unread). Its prompts' characters are summed, each prompt with the template's own tokens (`a`).
    from powerprof.daemon.promptlen import PromptLengths

    pl = PromptLengths()
    for k in range(40):  # the server counts 10 + chars / 4 tokens a prompt
        pl.learn("openai-completions", 400 + 40 * k, 10 + (400 + 40 * k) / 4)
    one = pl.estimate("openai-completions", 2000, None)
    two = pl.estimate("openai-completions", 4000, None, 2)
    assert one[0] == pytest.approx(510, rel=1e-6) and two[0] == pytest.approx(1020, rel=1e-6), (one, two)
    assert "4000 prompt characters of 2 prompts" in two[1], two
    assert pl.estimate("openai-completions", None, 7, 2)[0] == 7.0  # ids are their count, whatever the prompts

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, cut = _twin_streams(led, 0.05, 0.6, 0.6)
    cut.extra.update(prompt_chars=4000, prompt_count=2)
    _end_and_cost(led, done, cut)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(1000.0), got[2]
    assert "4000 prompt characters of 2 prompts" in got[2]["energy_note"] and PROMPT_UNREAD_FLAG not in got[2]["energy_note"]


def test_a_llamacpp_prompt_of_ids_and_text_mixed_is_its_ids_and_its_texts_estimate():
    # llama-server takes a prompt mixing token ids and text: the ids are tokens, exactly; the text is estimated as any
    # text, at this server's learned ratio, and learned from with the ids taken out. Before: unsized, not costed.
    from powerprof.daemon.promptlen import PromptLengths

    pl = PromptLengths()
    got = pl.estimate("llamacpp", 400, 30)
    assert got[0] == pytest.approx(30 + 100) and "30 prompt token ids" in got[1] and "400 prompt characters" in got[1]
    for k in range(40):  # the server counts 10 + chars / 5 tokens of text, plus the ids
        chars = 400 + 40 * k
        pl.learn("llamacpp", chars, 10 + chars / 5 + 25, ids=25)
    assert pl.estimate("llamacpp", 1000, 60)[0] == pytest.approx(60 + 10 + 200, rel=1e-6)
    assert pl.estimate("llamacpp", 1000, None)[0] == pytest.approx(210, rel=1e-6)  # the ratio is the text's alone
    assert pl.estimate("llamacpp", None, 60)[0] == 60.0


def test_a_prompt_whose_body_was_never_read_is_said_not_costed_and_counted():
    # A body over the proxy's inspection bound (1 MiB) streams on unread: its prompt's size was unknown and its prefill
    # costed at 0 with nothing said (the simulator: a 7501-token prompt's row -63%, the stream beside it +26%). Its
    # bytes bound nothing useful (1.1 MB of a field beside a 30 kB prompt, base64 images): not costed, and said so.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, unread = _twin_streams(led, 0.05, 0.6, 0.6)
    unread.outcome = "ok"
    del unread.extra["prompt_chars"]
    unread.extra["body_bytes"] = 1_130_000
    _end_and_cost(led, done, unread)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] is None
    note = got[2]["energy_note"]
    assert f"{PROMPT_UNREAD_FLAG}: its request body (1130000 bytes) was not read" in note and "include_usage" in note, note
    # The stream beside it holds that prefill's energy, and says so (c11: +25%, silent before).
    beside = got[1]["energy_note"]
    assert f"{PROMPT_UNREAD_FLAG}: 100% of its GPU energy is from intervals over the prefill of a request" in beside, beside
    assert led.flagged_requests[PROMPT_UNREAD_FLAG] == 2


def _unread_rows(api, stream, outcome, unsized="a content part of type 'image_url'"):
    """The twin streams' rows, the second's body read and sizeless (`unsized`) or unread (None), its length unsaid."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, other = _twin_streams(led, 0.05, 0.6, 0.6)
    other.api, other.stream, other.outcome = api, stream, outcome
    del other.extra["prompt_chars"]
    if unsized is None:
        other.extra["body_bytes"] = 1_130_000
    else:
        other.extra["prompt_unsized"] = unsized
    _end_and_cost(led, done, other)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    return got[2]["energy_note"], got[1]["energy_note"]


def test_a_prompt_unread_rows_fix_fits_its_api_and_outcome_and_what_was_wrong_with_the_body():
    # Before, every sizeless body's row said "ask for include_usage", whatever its API or outcome (a cut stream, whose
    # usage comes after its client left; Responses, Messages, /generate, whole answers: no such option), and the rows
    # beside it "keep request bodies under 1 MiB" though that body had been read.
    running = '"continuous_usage_stats": true'
    for api, stream, outcome, want, unwanted in [
            ("openai-chat", True, "client_disconnected", running, "keep request bodies"),
            ("openai-completions", True, "ok", '"include_usage": true}', running),
            ("openai-responses", True, "client_disconnected", "none the client can ask for", "include_usage"),
            ("openai-responses", True, "ok", "none the client can ask for", "include_usage"),
            ("anthropic-messages", True, "client_disconnected", "none the client can ask for", "include_usage"),
            ("sglang-generate", True, "client_disconnected", "none the client can ask for", "include_usage"),
            ("llamacpp", True, "client_disconnected", "none the client can ask for", "include_usage"),
            ("openai-chat", False, "ok", "none the client can ask for", "include_usage")]:
        note, beside = _unread_rows(api, stream, outcome)
        fix = note[note.index(PROMPT_UNREAD_FLAG):]
        fix = fix[fix.index("fix:"):]
        assert want in fix and unwanted not in fix and "1 MiB" not in fix, (api, stream, outcome, fix)
        assert "1 MiB" not in beside and "read, with no prompt size in it" in beside, beside
    # A stateful Responses turn cut before its usage: its client can send the conversation itself in `input`, which
    # the proxy sizes (before: "none the client can ask for", untrue for it).
    # The rows beside it say so too (before: "an image or audio part ...; fix: include_usage, continuous_usage_stats",
    # neither a Responses option).
    for key in ("previous_response_id", "conversation"):
        note, beside = _unread_rows("openai-responses", True, "client_disconnected",
                                    unsized=f"a `{key}` (the stored conversation is not in the body)")
        fix = note[note.index("fix:"):]
        assert "send the conversation in the body's `input`" in fix and "none the client can ask" not in fix, fix
        assert "a stateful Responses turn" in beside and "image" not in beside, beside
        assert "send the conversation in the body's `input`" in beside and "include_usage" not in beside, beside
    note, beside = _unread_rows("openai-chat", True, "ok", unsized=None)
    assert "keep request bodies under 1 MiB" in note.split(PROMPT_UNREAD_FLAG)[1], note
    assert "keep request bodies under 1 MiB" in beside and "read, with no prompt size" not in beside, beside


def _image_stream_past_hold(b_end_s):
    """A text chat (500 tokens, told at 3 s) beside an image chat (body sizeless) whose usage comes at b_end_s; rows."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = _chat(1, 0.05, 2000), _chat(2, 0.05, 0)
    del b.extra["prompt_chars"]
    b.extra["prompt_unsized"] = "a content part of type 'image_url'"
    for tr in (a, b):
        led.on_start(tr)
    a.first_ns = b.first_ns = int(1.0 * S)
    e, t = 0.0, 0.0
    _feed(led, 0.0, e)
    while t < b_end_s + 2:
        t = round(t + 0.5, 3)
        e += 100.0
        for tr, stop in ((a, 3.0), (b, b_end_s)):
            if 1.0 <= t <= stop:
                led.on_tokens(tr, int((t - 0.01) * S), 5)
                tr.last_ns = int((t - 0.01) * S)
            if t == stop:
                tr.end_ns = int(stop * S)
                tr.counts = Counts(generated_tokens=int(5 * ((stop - 1.0) / 0.5 + 1)), model=None, stop_reason="length",
                                   prompt_tokens=500 if tr is a else 3000, token_source="usage")
                led.on_end(tr)
        _feed(led, t, e)
        led.advance(int((t + 0.05) * S))
    led.advance(int((t + 2) * S))
    return {r["request_id"]: r["energy_note"] or "" for r in sink.rows["requests"]}, led


def test_a_sizeless_stream_told_after_the_prompt_hold_says_its_prefill_went_uncosted():
    # An image stream that asked for usage and ran past the 30 s hold: its prefill intervals closed costed 0 before
    # its usage came. Before, its own row said nothing and the one beside it "its prompt's length unsaid" (it came,
    # later). Now both say so.
    notes, led = _image_stream_past_hold(20.0)
    assert PROMPT_UNREAD_FLAG not in notes[1] and PROMPT_UNREAD_FLAG not in notes[2], notes
    notes, led = _image_stream_past_hold(40.0)
    own = notes[2][notes[2].index(PROMPT_UNREAD_FLAG):]
    assert "had not said the prompt's length when the intervals over its prefill closed" in own, own
    beside = notes[1][notes[1].index(PROMPT_UNREAD_FLAG):]
    assert "its prompt's length unsaid when those intervals closed" in beside, beside
    assert led.flagged_requests[PROMPT_UNREAD_FLAG] == 2


def test_a_finished_stream_that_showed_no_token_is_costed_its_prompts_estimate():
    # A stream the server finished (outcome ok) with no token shown and no usage (a max_tokens the proxy did not read,
    # the one token in a chunk it took for none) got no prefill work though its prompt's size was known: the simulator's
    # 4000-word completions came out -99% with a note claiming its share rested on its prompt's work.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, quiet = _chat(1, 0.05, 2000), _chat(2, 0.05, 2000)
    for tr in (done, quiet):
        led.on_start(tr)
    for k in range(10):
        led.on_tokens(done, int((0.1 + 0.05 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns = int(0.1 * S), int(0.55 * S), int(0.6 * S)
    done.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length", token_source="usage")
    quiet.end_ns, quiet.status, quiet.outcome = int(0.6 * S), 200, "ok"
    quiet.counts = Counts(generated_tokens=None, prompt_tokens=None, model=None, stop_reason="length",
                          token_source="counted", tokens_estimated=True, complete=True)
    _end_and_cost(led, done, quiet)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(500.0)
    assert got[2]["gpu_energy_j"] > 0.2 * got[1]["gpu_energy_j"], (got[1]["gpu_energy_j"], got[2]["gpu_energy_j"])
    note = got[2]["energy_note"]
    assert "the stream carried no usage" in note and "costed at an estimate of 500 prompt tokens" in note, note
    assert led.prompts_estimated == {"no_usage": 1}


def test_a_cut_stream_is_named_client_left_even_when_an_interval_before_its_end_closes_first():
    # Under load the intervals before a cut stream's end closed after it had ended: the estimate was taken then and
    # filed as "not_yet" (unsaid 30 s after arrival), the row's note and the metric with it.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, cut = _twin_streams(led, 0.08, 0.85, 0.9)
    for tr in (done, cut):
        led.on_end(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 0.5, 50.0)
    led.advance(int(0.95 * S))  # closes [0, 0.5 s], which ends before the cut stream did (0.9 s)
    _feed(led, 1.0, 100.0)
    led.advance(int(1.5 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert "client left" in got[2]["energy_note"] and "30 s" not in got[2]["energy_note"]
    assert led.prompts_estimated == {"client_left": 1}


def _gone_before_first(led, chars, gone_end_s, tag=None):
    """A chat stream (500 prompt tokens counted, 2000 characters; 10 tokens from 0.1 s) and one of `chars` characters
    arriving at 0.05 s whose client left at `gone_end_s` before its first token (queued or prefilling), both ended on
    `led`; the intervals [0, 1 s) fed, 100 J, inside the tag window `tag` where given, and closed."""
    done, gone = _chat(1, 0.05, 2000), _chat(2, 0.05, chars)
    if tag:
        led.open_tag(tag, 0, 0)
    for tr in (done, gone):
        led.on_start(tr)
    for k in range(10):
        led.on_tokens(done, int((0.1 + 0.05 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns = int(0.1 * S), int(0.55 * S), int(0.6 * S)
    done.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length",
                         token_source="usage")
    gone.end_ns, gone.outcome = int(gone_end_s * S), "client_disconnected"
    for tr in (done, gone):
        led.on_end(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 100.0)
    if tag:
        led.close_tag(tag, S, S)
    led.advance(int(1.5 * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


def test_a_request_gone_before_its_first_token_is_costed_its_estimated_prompt_and_its_neighbours_say_so(caplog):
    # A client that gives up while its long prompt is queued or prefilling (common under load). Before: only requests
    # with a first token were estimated; this one said `no share` and its prompt's energy went to the request beside
    # it, silently (the simulator: 12000-token prompts cut after 0.12 s beside 60-token chats, the chats +61% to +252%).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.ledger"):
        got = _gone_before_first(led, 2000, 0.6)
    gone, done = got[2], got[1]
    assert gone["prompt_tokens"] is None and gone["prompt_tokens_estimate"] == pytest.approx(500.0)
    # Its 500 prompt tokens at 0.05 of a decoded token beside its neighbour's 500 and 9 decoded (its first out of its prefill).
    assert gone["gpu_energy_j"] == pytest.approx(100.0 * 25 / 59.0)
    assert done["gpu_energy_j"] + gone["gpu_energy_j"] == pytest.approx(100.0)
    note = gone["energy_note"]
    # Its tokens unknown (cut before it showed one: `no tokens: …`, their energy in unproxied) and its prefill costed
    # at an estimate: both said.
    assert note.startswith("approximate: ") and "it ended before its first token" in note, note
    assert "no tokens: its response was cut" in note, note
    assert "or never run (queued" in note and "costed at an estimate of 500 prompt tokens" in note and "fix:" in note
    assert "include_usage" not in note
    assert led.prompts_estimated == {"before_first_token": 1}
    assert "before its first token" in caplog.text
    # The request beside it says its share there may be off, counted under its flag.
    assert "gone-prefill-beside: 100% of its GPU energy is from intervals over (or within 1 s after) a request that " \
        "ended before its first token" in done["energy_note"], done["energy_note"]
    assert led.flagged_requests.get("gone-prefill-beside") == 1


def test_a_prompt_gone_before_its_first_token_is_costed_no_more_than_its_time_in_flight_could_prefill():
    # 40 000 characters (10 000 tokens at the server's 4 a token) gone after 0.15 s: at the prefill rate in use
    # (10 000 tokens/s until the fit is mature) 1 500 could have run then, less the 500 of its neighbour's prompt
    # placed in that time (the GPU's prefill is shared).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    got = _gone_before_first(led, 40_000, 0.2)
    gone = got[2]
    assert gone["prompt_tokens_estimate"] == pytest.approx(1000.0)
    note = gone["energy_note"]
    assert ("costed at 1000 prompt tokens, what its 0.15 s in flight could prefill at 10000 tokens/s (the default "
            "prefill rate, the work model's fit not mature) beside the 500 prompt tokens of other requests placed then, "
            "of an estimate of 10000") in note, note


def test_prompts_gone_before_their_first_token_share_what_their_time_in_flight_could_prefill_in_arrival_order():
    # Two 4000-token prompts gone after 0.25 s: at 10 000 tokens/s the GPU had room for 2 500 prompt tokens then, 500 of
    # them its neighbour's. The first to arrive takes the rest, the second none: a server admits them in that order, and
    # vLLM or SGLang drop a request still queued when its client left unrun (each costed whole, the simulator with that
    # abort gave 78 J to one that never ran).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    done, first, second = _chat(1, 0.05, 2000), _chat(2, 0.05, 16_000), _chat(3, 0.05, 16_000)
    for tr in (done, first, second):
        led.on_start(tr)
    for k in range(10):
        led.on_tokens(done, int((0.1 + 0.05 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns = int(0.1 * S), int(0.55 * S), int(0.6 * S)
    done.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length", token_source="usage")
    for tr in (first, second):
        tr.end_ns, tr.outcome = int(0.3 * S), "client_disconnected"
    _end_and_cost(led, done, first, second)
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(2000.0)
    assert got[3]["prompt_tokens_estimate"] == pytest.approx(0.0, abs=1.0)
    assert got[3]["gpu_energy_j"] is None and got[3]["energy_note"].startswith(
        "no share: it ended before its first token, and in its 0.25 s in flight the GPU had no room for its prefill at "
        "10000 tokens/s beside the 2500 prompt tokens of other requests placed then"), got[3]["energy_note"]
    assert led.prompts_estimated == {"before_first_token": 1}  # the one costed none is no estimate used


def _cost_gone_direct(gone, arrival, first, end, prompt, cached, computed, est, rate):
    """Ledger._cost_gone as it was, each gone prompt's neighbours summed over every request: the reference."""
    from powerprof.daemon import attribution as attr
    idx = sorted(np.flatnonzero(gone), key=lambda i: arrival[i])
    prefill_end = np.where(first != attr.NEVER, first, end)
    for i in idx:
        a_ns, e_ns = int(arrival[i]), int(end[i])
        others = np.delete(np.arange(len(gone)), i)
        beside = float(attr.prefill_tokens_at(arrival[others], prefill_end[others], computed[others], a_ns, e_ns,
                                              rate).sum())
        room = max((e_ns - a_ns) / 1e9 * rate - beside, 0.0)
        prompt[i] = min(est[i], room)
        computed[i] = max(prompt[i] - cached[i], 0.0)
    return prompt, computed


@pytest.mark.parametrize("seed", range(40))
def test_gone_prompts_are_costed_as_the_sum_over_every_request_gave(seed):
    # The sum over every request for each gone one was quadratic: 5000 requests gone before their first token cost a
    # close seconds (bench in the commit). The sums in O(log n) (attribution.PlacedPrefill) give the same figures, in
    # scenes with ties, prompts placed at one instant, prompts cached in part and requests still in flight (no end).
    from types import SimpleNamespace
    from powerprof.daemon import attribution as attr
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 120))
    t0 = 1_700_000_000_000_000_000
    arrival = t0 + rng.integers(0, 3_000_000_000, n).astype(np.int64) // (1 if seed % 2 else 100_000_000) * \
        (1 if seed % 2 else 100_000_000)
    end = arrival + rng.integers(-1_000, 2_000_000_000, n).astype(np.int64)
    gone = rng.random(n) < 0.6
    first = np.where(gone, attr.NEVER, np.where(rng.random(n) < 0.3, attr.NEVER, arrival + (end - arrival) // 2))
    end = np.where(~gone & (rng.random(n) < 0.2), attr.NEVER, end)
    prompt = np.where(gone, np.where(rng.random(n) < 0.2, rng.integers(0, 900, n), 0), rng.integers(0, 9000, n))
    prompt = prompt.astype(float)
    cached = np.where(rng.random(n) < 0.3, rng.integers(0, 500, n), 0).astype(float)
    computed = np.maximum(prompt - cached, 0.0)
    est = rng.integers(0, 20_000, n).astype(float)
    rate = float(rng.choice([1_000.0, 16_000.0]))
    want_p, want_c = _cost_gone_direct(gone, arrival, first, end, prompt.copy(), cached, computed.copy(), est, rate)
    got_p, got_c = prompt.copy(), computed.copy()
    stub = SimpleNamespace(_prompt_work=lambda r, done, room: min(est[r.i], room[0]))
    reqs = [SimpleNamespace(i=i, run_on_prefill=False) for i in range(n)]  # none prefilled whole after it left (llama.cpp)
    Ledger._cost_gone(stub, reqs, gone.tolist(), arrival, first.astype(np.int64), end, got_p, cached, got_c,
                      attr.WorkCosts(prefill_tok_s=rate))
    # Equal but for float rounding, which the chain of rooms can carry far: the direct sums moved by 0.2 tokens in a
    # scene of 1250 requests where the estimates were moved by one part in 1e15.
    np.testing.assert_allclose(got_p, want_p, rtol=1e-7, atol=1e-4)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-7, atol=1e-4)


def test_a_gone_prompts_bound_takes_no_prefill_rate_below_the_slow_end(monkeypatch):
    # A fit of few or odd intervals can give a rate far below any server's (100 tokens/s here): the bound would cost
    # the prompt at nothing, its energy in the request beside it.
    from powerprof.daemon import attribution as attr
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    monkeypatch.setattr(led.learner, "costs", lambda setting: attr.WorkCosts(prefill_tok_s=100.0, source="fitted"))
    got = _gone_before_first(led, 40_000, 0.6)
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(50.0)
    assert ("what its 0.55 s in flight could prefill at 1000 tokens/s (the slowest taken, the work model's fitted rate "
            "being below it)") in got[2]["energy_note"], got[2]["energy_note"]


def test_a_request_in_the_step_after_one_gone_before_its_first_token_says_its_share_may_be_off():
    # vLLM and SGLang drop an aborted request between engine steps: the prefill step in flight when the connection
    # closed runs on after the proxy saw its end. The simulator with that abort: chats queued behind such prompts took
    # that step's energy in intervals after the proxy had seen them end, +29%, their rows silent. Here the intervals
    # after the gone request's end close after its row is made.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    gone = _chat(1, 0.05, 2000)
    led.on_start(gone)
    gone.end_ns, gone.outcome = int(0.3 * S), "client_disconnected"
    led.on_end(gone)
    _feed(led, 0.0, 0.0)
    _feed(led, 0.4, 40.0)
    led.advance(int(0.55 * S))
    assert [r["request_id"] for r in sink.rows["requests"]] == [1]
    late = _chat(2, 0.45, 2000)
    led.on_start(late)
    for k in range(10):
        led.on_tokens(late, int((0.5 + 0.04 * k) * S), 1)
    late.first_ns, late.last_ns, late.end_ns = int(0.5 * S), int(0.86 * S), int(0.9 * S)
    late.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length", token_source="usage")
    led.on_end(late)
    _feed(led, 1.0, 100.0)
    _feed(led, 2.0, 200.0)
    led.advance(int(2.5 * S))
    note = {r["request_id"]: r for r in sink.rows["requests"]}[2]["energy_note"]
    assert "gone-prefill-beside: 100% of its GPU energy is from intervals over (or within 1 s after)" in note, note


def test_a_tag_over_a_request_gone_before_its_first_token_says_so_and_blames_no_speculative_decoding():
    # The simulator's tag over such cuts: 934 J in unproxied_energy_j with no bypass traffic, its note blaming streams
    # that "carried no token counts … speculative decoding" and asking for include_usage, which they had asked for.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _gone_before_first(led, 2000, 0.6, tag="win")
    note = sink.rows["tags"][0]["energy_note"] or ""
    assert "1 request(s) in this window were cut by their clients, 1 before their first token" in note, note
    assert "speculative" not in note and "include_usage" not in note, note


def test_a_tag_over_a_whole_answer_cut_with_no_server_scraped_says_it_was_cut_and_may_have_run_on():
    # scrape.server = none: a whole answer whose client left may run on for nobody, unplaced (Ledger._unplaced). The
    # tag's cut note needed unproxied energy or a stream gone before its first token: over such an answer it said
    # nothing of it (the review of scrapefix6).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.run_ons_unknown = True
    led.open_tag("win", 0, 0)
    done, cut = _chat(1, 0.05, 2000), _chat(2, 0.05, 2000)
    cut.stream = False
    cut.extra["max_tokens"] = 400
    for tr in (done, cut):
        led.on_start(tr)
    for k in range(10):
        led.on_tokens(done, int((0.1 + 0.05 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns = int(0.1 * S), int(0.55 * S), int(0.6 * S)
    done.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length",
                         token_source="usage")
    cut.end_ns, cut.outcome = int(0.3 * S), "client_disconnected"
    for tr in (done, cut):
        led.on_end(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 100.0)
    led.close_tag("win", S, S)
    led.advance(int(1.5 * S))
    note = sink.rows["tags"][0]["energy_note"] or ""
    assert "1 request(s) in this window were cut by their clients, 1 of them whole answers" in note, note
    assert "scrape.server" in note, note


def test_an_sglang_batch_answered_400_with_no_limit_marks_its_windows_past_30_s_unbounded():
    # A batch SGLang answers 400 runs its other prompts on to their cap (Ledger._batch_run_on): with a null limit, to
    # the context's end, unknown here (its prompts' size unread: no bound, `batch_context_bound`). Its span was capped
    # at RUN_ON_TO_END_MAX_S, 30 s, leaving the windows 30 s on
    # unmarked, the requests there unflagged. Now to BATCH_SPAN_MAX_S (600 s), its row saying so. (A known limit above SGLANG_BAND_TOKENS, or none sent,
    # SGLang's default, is refused unrun with its whole batch: not recorded, test_only_a_400_to_two_prompts_...)
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led._paces.append(40.0)
    batch = RequestTrace(1, "POST", "/generate", None, int(0.5 * S), 0, api="sglang-generate", stream=False)
    batch.extra["sequences"] = 2
    batch.extra["max_tokens_null"] = True  # sampling_params {"max_new_tokens": null}: to the context's end
    batch.extra["error_message"] = BAND_MSG
    led.on_start(batch)
    batch.end_ns, batch.status, batch.outcome = int(0.6 * S), 400, "error"
    led.recon.server_seen = True  # a server page read (recorded only then); the scrapes below read it again
    led.on_end(batch)
    led.recon.server_seen = False
    late = _chat(2, 40.1, 2000)
    for k in range(42):
        _feed(led, float(k), 100.0 * k)
        if k:
            led.add_server_tokens(int(k * S), 10.0 if k > 40 else 0.0, int((k - 1) * S))
        if k == 40:
            led.on_start(late)
            for j in range(10):
                led.on_tokens(late, int((40.2 + 0.05 * j) * S), 1)
            late.first_ns, late.last_ns, late.end_ns = int(40.2 * S), int(40.65 * S), int(40.7 * S)
            late.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length",
                                 token_source="usage")
            led.on_end(late)
        led.advance(int((k + 0.2) * S))
    ivs = [r for r in sink.rows.get("intervals", []) if r["t_start_mono_s"] >= 30.0]
    assert ivs and all("batch_run_on" in (r["server_count"] or "") for r in ivs), [
        (r["t_start_mono_s"], r["server_count"]) for r in ivs]


@pytest.mark.parametrize("paced", [True, False])
def test_an_sglang_batch_answered_400_with_a_null_limit_marks_its_windows_to_the_end_its_prompts_bound(paced):
    # SGLang runs a null max_new_tokens to the context's end (scheduler.py: min(1 << 30, max_req_len - input - 1)), and
    # the aborted prompt is in the context's last 6 tokens: the context is at most the batch's prompts summed + 6 (600
    # characters a token each, 2 BOS: 608 tokens). Before: marked to no end, every window after it until a restart; now
    # to its prompts' prefill at BATCH_PREFILL_FLOOR_TOK_S (1.2 s) and that many tokens at the streams' pace shared by
    # its 2 sequences (20 tok/s: 30.4 s), or with none yet at BATCH_PACE_FLOOR_TOK_S (5 tok/s) so shared.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    if paced:
        led._paces.append(40.0)
    batch = RequestTrace(1, "POST", "/generate", None, int(0.5 * S), 0, api="sglang-generate", stream=False)
    batch.extra.update(sequences=2, max_tokens_null=True, prompt_chars=600, prompt_count=2, error_message=BAND_MSG_128K)
    led.on_start(batch)
    batch.end_ns, batch.status, batch.outcome = int(0.6 * S), 400, "error"
    led.recon.server_seen = True  # a server page read (recorded only then)
    led.on_end(batch)
    end_s = 0.5 + 608 / 500.0 + 608 / ((40.0 if paced else 5.0) / 2)
    (a0, a1), = led.recon.batch_run_ons.values()
    assert a0 == int(0.5 * S) and a1 == pytest.approx(end_s * S, abs=1e3), led.recon.batch_run_ons
    if not paced:
        return
    led.recon.server_seen = False
    for k in range(42):
        _feed(led, float(k), 100.0 * k)
        if k:
            led.add_server_tokens(int(k * S), 0.0, int((k - 1) * S))
        led.advance(int((k + 0.2) * S))
    ivs = sink.rows.get("intervals", [])
    marked = [r["t_start_mono_s"] for r in ivs if "batch_run_on" in (r["server_count"] or "")]
    assert marked and min(marked) < 1.0 and max(marked) < end_s + 2.0, marked
    assert any(r["t_start_mono_s"] >= end_s + 2.0 for r in ivs), ivs


def _streamed(rid, arrival_s, first_s, end_s, n=10, prompt=500):
    """A chat stream of 2000 characters whose server counted its prompt (`prompt` tokens): `n` tokens from `first_s`,
    ended at `end_s`. Returns (trace, token events, prompt)."""
    tr = _chat(rid, arrival_s, 2000)
    return tr, [(int((first_s + (end_s - 0.05 - first_s) * k / (n - 1)) * S), 1) for k in range(n)], prompt


def _beside(led, done_specs, others, feeds, adv):
    """`done_specs` (`_streamed`) and `others` (ended as set on their traces) started, ended, `feeds` (s, J) fed and
    closed at each of `adv` (s): their rows by request id."""
    for tr, ev, p in done_specs:
        led.on_start(tr)
    for tr in others:
        led.on_start(tr)
    for tr, ev, p in done_specs:
        for t, n in ev:
            led.on_tokens(tr, t, n)
        tr.first_ns, tr.last_ns = ev[0][0], ev[-1][0]
        tr.end_ns = ev[-1][0] + int(0.05 * S)
        tr.counts = Counts(generated_tokens=len(ev), prompt_tokens=p, model=None, stop_reason="length",
                           token_source="usage")
    for tr in [d[0] for d in done_specs] + others:
        led.on_end(tr)
    for t, e in feeds:
        _feed(led, t, e)
    for a in adv:
        led.advance(int(a * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


def test_a_server_error_inside_a_200_stream_before_any_token_is_an_error_answer_not_a_prefill():
    # SGLang answers a streamed chat's too-long prompt with `data: {"error": ...}` inside an HTTP 200 stream (llama.cpp's
    # stream errors likewise): the server never ran it. Before, it was costed as a gone prefill (1500 tokens, 68.8 J of
    # 100) and the request beside it flagged gone-prefill-beside.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    bad = _chat(2, 0.05, 40_000)
    bad.status, bad.end_ns, bad.outcome = 200, int(0.25 * S), "upstream_error"
    bad.counts = Counts(generated_tokens=0, prompt_tokens=None, model=None, stop_reason=None, token_source="counted",
                        server_error="The input (10000 tokens) is longer than the model's context length")
    got = _beside(led, [_streamed(1, 0.05, 0.1, 0.6)], [bad], [(0.0, 0.0), (1.0, 100.0)], [1.5])
    assert got[2]["prompt_tokens_estimate"] is None and got[2]["gpu_energy_j"] is None
    assert got[2]["energy_note"].startswith("no share: an error answer (the server's error inside its HTTP 200 "
                                            "response)"), got[2]["energy_note"]
    assert got[1]["gpu_energy_j"] == pytest.approx(100.0)
    assert "gone-prefill-beside" not in (got[1]["energy_note"] or "")
    assert led.prompts_estimated == {}


def test_a_whole_answer_cut_by_its_client_is_not_placed_as_a_prefill_before_its_end():
    # A non-streamed request whose client left after 10 s: the server prefilled it at its start and decoded since, and
    # the proxy saw none of it. Before, its prefill was placed in the last moments before its end (211 J of 2200), its
    # decode in the request beside it, unflagged there; then it was not costed at all (no figure, its prefill in the
    # request beside it: on the simulated vLLM, which aborts it at once, +183%). Now, the server aborting at once, its
    # prompt is costed at its body's estimate from its arrival, its decode after unseen, and the row says so.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    whole = _chat(2, 0.05, 2000)
    whole.stream = False
    whole.end_ns, whole.outcome = int(10.0 * S), "client_disconnected"
    got = _beside(led, [_streamed(1, 0.05, 0.1, 10.0, n=200)], [whole], [(t, 200.0 * t) for t in range(0, 12)],
                  [12.5])
    note = got[2]["energy_note"]
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(500.0), got[2]
    assert "what it decoded after its prefill, if it got that far, is unseen" in note, note
    assert "none of its work" not in note and got[2]["gpu_energy_j"] > 0, note
    # Its 500 tokens' prefill from its arrival (0.05 s → 0.1 s at the default 10 000 tokens/s), in the first interval.
    prefill = [r["prefill_tokens"] for r in led.emit.rows["intervals"]]
    assert prefill[0] >= 500.0 and sum(prefill[1:]) == pytest.approx(0.0), prefill
    assert "gone-prefill-beside" in got[1]["energy_note"], got[1]["energy_note"]
    assert led.prompts_estimated == {"before_first_token": 1}


@pytest.mark.parametrize("how", ["unreadable", "interrupted", "mid-body"])
def test_requests_the_server_never_ran_or_finished_are_not_gone_before_their_first_token(how):
    # unreadable: a whole answer whose tokens the proxy could not read (outcome ok, a Content-Encoding not inspected),
    # its decode then in the request beside it, was taken for a prompt gone before its first token. interrupted: a
    # request a proxy worker ended (its end record dropped: ended at its arrival) flagged the requests beside it.
    # mid-body: a client that left while sending its body (the server never had it) was costed a prefill.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    other = _chat(2, 0.05, 40_000)
    if how == "unreadable":
        other.status, other.outcome, other.end_ns = 200, "ok", int(0.5 * S)
        other.error = "response Content-Encoding 'br' is not inspected: its tokens were not counted"
    elif how == "interrupted":
        other.end_ns, other.outcome = other.arrival_ns, "interrupted"
        other.error = "proxy worker 0 ended this request but its end record was dropped"
    else:
        other.end_ns, other.outcome = int(0.5 * S), "client_disconnected"
        other.error = "the client left while sending its request body; the server may have generated tokens …"
    led.open_tag("win", 0, 0)
    got = _beside(led, [_streamed(1, 0.05, 0.1, 0.6)], [other], [(0.0, 0.0), (1.0, 100.0)], [])
    led.close_tag("win", S, S)
    led.advance(int(1.5 * S))
    got = {r["request_id"]: r for r in led.emit.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] is None
    assert "before its first token" not in (got[2]["energy_note"] or "")
    assert "gone-prefill-beside" not in (got[1]["energy_note"] or "")
    assert led.prompts_estimated == {}
    assert "cut by their clients" not in (led.emit.rows["tags"][0]["energy_note"] or "")


def test_the_prefix_cache_check_runs_over_a_gone_requests_prefill_not_past_its_end(monkeypatch):
    # A prompt placed over arrival → first token; one gone before its first token over arrival → end, as attribution
    # places it. Before, its `first` (never) made every interval to the close's end count as prefilling once its prompt
    # was costed: the prefix-cache counter was checked there, and a decode-only request beside a bypass hit later said
    # prefix-cache-unsaid.
    asked, notes = {}, {}
    for label, chars in (("no body estimate", None), ("costed", 2000)):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        seen = []
        monkeypatch.setattr(led, "_cache_unsaid", lambda t0, t1, seen=seen: seen.append((t0 / S, t1 / S)) or 0.0)
        gone = _chat(2, 0.05, chars)
        gone.end_ns, gone.outcome = int(0.3 * S), "client_disconnected"
        _beside(led, [_streamed(1, 0.05, 0.1, 0.45), _streamed(3, 2.05, 2.1, 2.9)], [gone],
                [(t / 2, 50.0 * t / 2) for t in range(0, 8)], [4.5])
        asked[label] = seen
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        monkeypatch.setattr(led, "_cache_unsaid", lambda t0, t1: 100.0 if t0 >= 2 * S else 0.0)
        gone = _chat(2, 0.05, chars)
        gone.end_ns, gone.outcome = int(0.3 * S), "client_disconnected"
        got = _beside(led, [_streamed(1, 0.05, 0.1, 3.4, n=60)], [gone], [(t / 2, 50.0 * t / 2) for t in range(0, 8)],
                      [4.5])
        notes[label] = got[1]["energy_note"] or ""
    closes = {k: [sp for sp in v if sp[1] - sp[0] == 0.5] for k, v in asked.items()}  # not the rows' own hit spans
    assert closes["costed"] == closes["no body estimate"] == [(0.0, 0.5), (2.0, 2.5)], asked
    assert "prefix-cache-unsaid" not in notes["costed"] + notes["no body estimate"], notes


def _ticking(incremental, second: bool = False):
    """A 10-token chat (0.02 → 0.5 s) beside a 10 000-token prompt gone at 0.9 s before its first token, 100 W sampled
    every 0.2 s; closed at every 0.1 s tick as the daemon does (`incremental`), or once at the end (3 s). `second`: and
    a second 10 000-token prompt arriving at 0.8 s gone at 1.5 s (the end at 3.5 s)."""
    led = Ledger("d", 0, 1, Sink(), grace_s=0.3)
    nb_tr, nb_ev, _ = _streamed(1, 0.02, 0.05, 0.5, n=10)
    gone, later = _chat(2, 0.05, 40_000), _chat(3, 0.8, 40_000)
    led.on_start(nb_tr)
    led.on_start(gone)
    ends = ((gone, 9), (later, 15)) if second else ((gone, 9),)
    until_s = 3.5 if second else 3.0
    for k in range(0, int(round(until_s * 10)) - 4):
        t = k * 0.1
        for tt, n in nb_ev:
            if t - 0.1 < tt / S <= t:
                led.on_tokens(nb_tr, tt, n)
                nb_tr.first_ns = nb_tr.first_ns or tt
                nb_tr.last_ns = tt
        if k == 5:
            nb_tr.end_ns = int(0.5 * S)
            nb_tr.counts = Counts(generated_tokens=10, prompt_tokens=500, model=None, stop_reason="length",
                                  token_source="usage")
            led.on_end(nb_tr)
        if k == 8 and second:
            led.on_start(later)
        for tr, at in ends:
            if k == at:
                tr.end_ns, tr.outcome = int(t * S), "client_disconnected"
                led.on_end(tr)
        if k % 2 == 0:
            _feed(led, t, 100.0 * t)
        if incremental:
            led.advance(int(t * S))
    led.advance(int(until_s * S))
    led.close_all(int(until_s * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


def test_a_prompt_gone_before_its_first_token_is_costed_alike_however_often_the_intervals_close():
    # Its end known, the prompt hold was over, and the daemon's next close (up to now − grace, before that end) took its
    # intervals with it still live there: its prompt uncosted and no gone span kept, then its prefill placed over the
    # end of its time in flight in the next close, the part in intervals already closed lost to its neighbour,
    # unflagged there (every tick: it 40 J, its neighbour 60 J unflagged; at once: 93.4 J and 6.6 J flagged). Now the
    # intervals from its arrival wait for an edge past its end (bounded as the prompt hold).
    a, b = _ticking(True), _ticking(False)
    assert a[2]["gpu_energy_j"] == pytest.approx(b[2]["gpu_energy_j"], rel=1e-6)
    assert a[2]["prompt_tokens_estimate"] == pytest.approx(b[2]["prompt_tokens_estimate"])
    assert a[1]["gpu_energy_j"] == pytest.approx(b[1]["gpu_energy_j"], rel=1e-6)
    for rows in (a, b):
        assert "gone-prefill-beside" in (rows[1]["energy_note"] or ""), rows[1]["energy_note"]


def test_two_overlapping_prompts_gone_before_their_first_token_are_costed_alike_however_often_the_intervals_close():
    # The hold for the later one (its end past the close's edge) moved the close back to its arrival, before the first
    # one's end, which the edge had been past: that close cut the first one's span with it still live, and its prefill,
    # placed over its time in flight in the next close, fell in intervals already closed, to its neighbour. Now the hold
    # is taken again from each edge it moves back to, until no gone request's span is cut.
    a, b = _ticking(True, second=True), _ticking(False, second=True)
    for rid in (1, 2, 3):
        assert a[rid]["gpu_energy_j"] == pytest.approx(b[rid]["gpu_energy_j"], rel=1e-6), rid
    assert a[2]["prompt_tokens_estimate"] == pytest.approx(b[2]["prompt_tokens_estimate"])


def test_a_tag_counts_a_request_gone_before_its_first_token_whose_row_was_held_back():
    # Its row waits for the request beside it, whose prompt was said early and its cached count not yet (`late_wait`):
    # counted when its row was made, it came after the tag's row had gone out, and the tag never said it.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.open_tag("win", 0, 0)
    nb, gone = _chat(1, 0.05, 2000), _chat(2, 0.05, 2000)
    nb.extra["prompt_tokens"] = 500  # said early (continuous usage), its cached count not yet
    for tr in (nb, gone):
        led.on_start(tr)
    for k in range(60):
        led.on_tokens(nb, int((0.1 + 0.05 * k) * S), 1)
    nb.first_ns, nb.last_ns = int(0.1 * S), int((0.1 + 0.05 * 59) * S)
    gone.end_ns, gone.outcome = int(0.4 * S), "client_disconnected"
    led.on_end(gone)
    for k in range(0, 9):
        _feed(led, k / 2, 50.0 * k / 2)
    led.close_tag("win", S, S)
    led.advance(int(2.0 * S))
    assert [r["request_id"] for r in led.emit.rows.get("requests", [])] == []  # its row held back
    note = led.emit.rows["tags"][0]["energy_note"] or ""
    assert "1 request(s) in this window were cut by their clients, 1 before their first token" in note, note
    nb.end_ns = int(3.2 * S)
    nb.counts = Counts(generated_tokens=60, prompt_tokens=500, model=None, stop_reason="length", token_source="usage")
    led.on_end(nb)
    _feed(led, 4.0, 200.0)
    led.advance(int(4.5 * S))
    led.close_all(int(5 * S))
    assert sorted(r["request_id"] for r in led.emit.rows["requests"]) == [1, 2]


@pytest.mark.parametrize("held", [True, False], ids=["row_held_past_the_tag", "row_out_the_tag_open"])
def test_a_tag_says_a_count_less_streams_surplus_whose_row_was_held_back(held):
    # A stream carrying no counts (one token a chunk, the server counting two a chunk) ended at 0.6 s beside a request
    # whose prompt was said early and its cached count not yet: its row waits for that count (`_late_parked`), past
    # its tag window's row. Counted at its row, the window's note never said why its unproxied held 10.4 J ("carried
    # no token counts ... gpu_j_per_token is high by it"): the tag row read as bypass traffic with every request
    # proxied. It is told at its end's close now. `held` False: no such request, its row written at that close with
    # the tag still open: told there once, not again at its row (`LiveRequest.low_told`; without it, "2 request(s)").
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.open_tag("win", 0, 0)
    nb, low = _chat(1, 0.05, 2000), _chat(2, 0.05, 2000)
    nb.extra["prompt_tokens"] = 500  # said early (continuous usage), its cached count not yet
    for tr in (nb, low) if held else (low,):
        led.on_start(tr)
    nb_t = [0.1 + 0.05 * k for k in range(60)] if held else []
    for t in nb_t:
        led.on_tokens(nb, int(t * S), 1)
    if held:
        nb.first_ns, nb.last_ns = int(0.1 * S), int(nb_t[-1] * S)
    low_t = [0.1 + 0.05 * k for k in range(10)]
    for t in low_t:
        low.tokens_seen += 1
        led.on_tokens(low, int(t * S), 1)
    low.first_ns, low.last_ns, low.end_ns, low.outcome = int(0.1 * S), int(low_t[-1] * S), int(0.6 * S), "ok"
    low.counts = Counts(generated_tokens=10, prompt_tokens=None, model=None, stop_reason=None, token_source="counted",
                        tokens_estimated=True)
    led.on_end(low)
    led.add_server_tokens(0, 0.0)
    _feed(led, 0.0, 0.0)
    for k in range(1, 9):  # scraped every 0.25 s: nb's tokens and two for each of low's chunks
        t0, t1 = (k - 1) / 4, k / 4
        led.add_server_tokens(int(t1 * S), float(sum(t0 < t <= t1 for t in nb_t) + 2 * sum(t0 < t <= t1 for t in low_t)),
                              int(t0 * S))
        _feed(led, t1, 50.0 * t1)
        led.advance(int(t1 * S))
    if not held:
        assert [r["request_id"] for r in led.emit.rows.get("requests", [])] == [2]  # its row out, the tag open
        led.close_tag("win", int(2.5 * S), int(2.5 * S))
        _feed(led, 3.0, 150.0)
        led.advance(int(3.0 * S))
        led.close_all(int(3.5 * S))
    else:
        led.close_tag("win", S, S)
        led.advance(int(2.0 * S))
        assert [r["request_id"] for r in led.emit.rows.get("requests", [])] == []  # its row held back
    (tag,) = led.emit.rows["tags"]
    note = tag["energy_note"] or ""
    print(tag["unproxied_energy_j"], note)
    assert tag["unproxied_energy_j"] > 0 and "1 request(s) in this window carried no token counts" in note, note
    if not held:
        return
    nb.end_ns = int(3.2 * S)
    nb.counts = Counts(generated_tokens=60, prompt_tokens=500, model=None, stop_reason="length", token_source="usage")
    led.on_end(nb)
    _feed(led, 4.0, 200.0)
    led.advance(int(4.5 * S))
    led.close_all(int(5 * S))
    assert sorted(r["request_id"] for r in led.emit.rows["requests"]) == [1, 2]


def test_the_gone_prefill_flag_is_per_sampling_interval_as_the_split_is():
    # A request that ended (0.3 s) before the gone one arrived (0.6 s) in the same 1 s interval took its share of that
    # interval, the gone prompt's estimate in it: it says so (docs/daemon.md, "Prompts are known": per interval, not per
    # request overlap).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    gone = _chat(2, 0.6, 2000)
    gone.end_ns, gone.outcome = int(0.9 * S), "client_disconnected"
    got = _beside(led, [_streamed(1, 0.02, 0.05, 0.3)], [gone], [(0.0, 0.0), (1.0, 100.0), (2.0, 200.0)], [2.5])
    assert "gone-prefill-beside" in (got[1]["energy_note"] or ""), got[1]["energy_note"]


def test_a_prompt_never_counted_by_its_server_is_estimated_at_the_default_ratio_and_names_the_fix():
    # No request has had its prompt counted (streams without include_usage): 4 characters a token, said on the row.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    small, big = _chat(1, 0.05, 40), _chat(2, 0.05, 4000)
    ids = RequestTrace(3, "POST", "/v1/completions", None, int(0.05 * S), 0, api="openai-completions", stream=True)
    ids.extra["prompt_ids"] = 1000
    for tr in (small, big, ids):
        led.on_start(tr)
        for k in range(10):
            led.on_tokens(tr, int((0.1 + 0.05 * k) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = int(0.1 * S), int(0.55 * S), int(0.6 * S)
        tr.counts = Counts(generated_tokens=10, prompt_tokens=None, model=None, stop_reason=None,
                           token_source="counted", tokens_estimated=True)
        led.on_end(tr)
    _feed(led, 0.0, 0.0)
    _feed(led, 1.0, 100.0)
    led.advance(int(1.5 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[2]["prompt_tokens_estimate"] == pytest.approx(1000.0) and got[1]["prompt_tokens_estimate"] == 10.0
    assert got[3]["prompt_tokens_estimate"] == 1000.0 and "1000 prompt token ids" in got[3]["energy_note"]
    # The bigger prompt takes its prefill: 1000 tokens at 0.05 of a decoded token, 9 decoded tokens each.
    assert got[2]["gpu_energy_j"] > 2 * got[1]["gpu_energy_j"]
    assert got[2]["gpu_energy_j"] == pytest.approx(got[3]["gpu_energy_j"])
    assert "include_usage" in got[1]["energy_note"] and "4 characters a token (a default" in got[1]["energy_note"]
    assert led.prompts_estimated == {"no_usage": 3}


def test_streams_sending_several_tokens_a_chunk_give_none_to_unproxied_when_an_earlier_interval_closes():
    # vLLM sending 4 tokens a chunk with include_usage: counted one a chunk until its usage (at the end) scales
    # them, so the server's counter runs ahead of the proxy's while a stream runs, and its scrape windows wait
    # for that end. Two overlapping streams: when the first ends, the intervals up to the second's arrival close.
    # Before: closing them resolved every old-enough window, the second stream's too, and 3 of its 4 tokens a
    # chunk so far (and their energy) went to `unproxied` as bypass traffic (the simulator: 100 such streams,
    # the requests' energy 12.6% low, 862 J in unproxied with no bypass traffic at all).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a = RequestTrace(1, "POST", "/v1/completions", "t", int(0.9 * S), 0, api="openai-completions", stream=True)
    b = RequestTrace(2, "POST", "/v1/completions", "t", int(1.5 * S), 0, api="openai-completions", stream=True)
    plan = [(a, 20, 158), (b, 32, 270)]  # chunks every 0.1 s, from step to step (of 50 ms)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    _feed(led, 0.9, 90.0)  # the edges the daemon reads at an arrival
    prev, served, chunks = int(0.5 * S), 0, {1: 0, 2: 0}
    for step in range(11, 321):  # every 50 ms, 0.55 s ... 16 s
        now = step * S // 20
        if step == 30:
            _feed(led, 1.5, 150.0)
        for tr, first, last in plan:
            if step == 18 and tr is a or step == 30 and tr is b:
                led.on_start(tr)
            if step % 2 == 0 and first <= step <= last:
                tr.first_ns = tr.first_ns or now
                tr.last_ns = now
                tr.tokens_seen += 1
                led.on_tokens(tr, now, 1)
                chunks[tr.request_id] += 1
            if step == last + 1:
                tr.end_ns = now
                tr.counts = Counts(generated_tokens=4 * chunks[tr.request_id], prompt_tokens=5, model=None, stop_reason=None,
                                   token_source="usage", tokens_estimated=True)
                assert led.on_end(tr) == pytest.approx(3 * chunks[tr.request_id])
        if step % 5 == 0:
            n = 4 * sum(chunks.values())
            led.add_server_tokens(now, float(n - served), prev)
            prev, served = now, n
        if step % 20 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    led.close_all(int(16.2 * S))
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    assert chunks == {1: 70, 2: 120}
    assert rows[1]["attributed_tokens"] == pytest.approx(280.0) and rows[2]["attributed_tokens"] == pytest.approx(480.0)
    ivs = sink.rows["intervals"]
    assert sum(r["server_tokens"] or 0.0 for r in ivs) == pytest.approx(0.0, abs=1e-9)
    assert sum(r["unproxied_energy_j"] for r in ivs) == pytest.approx(0.0, abs=1e-9)
    assert rows[1]["gpu_energy_j"] + rows[2]["gpu_energy_j"] == pytest.approx(sum(r["requests_energy_j"] for r in ivs))


def _chunked_streams(first_token_alone: bool, count_per_step: bool, phase_ms: int = 0):
    """Three honest streams one after another (no bypass traffic), each of 40 tokens sent 4 a chunk every 100 ms and
    counted one a chunk until its usage (40) scales them, through a ledger scraping the server every 250 ms. The
    server's counter rises one token a 25 ms step over each chunk's 100 ms (`count_per_step`: a stream interval) or by
    the chunk's 4 at its send (speculative decoding); `first_token_alone`: the first chunk holds the prefill's token
    alone (then 9 chunks of 4 and one of 3), else 10 of 4. `phase_ms`: the streams' offset against the scrapes.
    Returns the interval rows."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    sizes = [1] + [4] * 9 + [3] if first_token_alone else [4] * 10
    plan = []  # (trace, [(chunk at step, its tokens)]) over 5 ms steps
    for i in range(3):
        start = 200 + 260 * i + phase_ms // 5  # 1 s apart and a bit, so each meets the scrapes at another phase
        tr = RequestTrace(i + 1, "POST", "/v1/completions", "t", (start - 4) * S // 200, 0, api="openai-completions",
                          stream=True)
        plan.append((tr, [(start + 20 * j, n) for j, n in enumerate(sizes)]))
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    prev, served, counted = int(0.5 * S), 0.0, 0.0
    for step in range(101, 1200):  # every 5 ms, to 6 s
        now = step * S // 200
        for tr, chunks in plan:
            if step == chunks[0][0] - 4:
                led.on_start(tr)
            for at, n in chunks:
                # The server's count of this chunk: per 25 ms step over the 100 ms before it (the first, at once), or all
                # at its send.
                if count_per_step and at != chunks[0][0]:
                    counted += n / 20 if at - 20 < step <= at else 0.0
                elif step == at:
                    counted += n
                if step == at:
                    tr.first_ns = tr.first_ns or now
                    tr.last_ns = now
                    tr.tokens_seen += 1
                    led.on_tokens(tr, now, 1)
            if step == chunks[-1][0] + 1:
                tr.end_ns = now
                tr.counts = Counts(generated_tokens=sum(sizes), prompt_tokens=5, model=None, stop_reason=None,
                                   token_source="usage", tokens_estimated=True)
                led.on_end(tr)
        if step % 50 == 0:
            led.add_server_tokens(now, counted - served, prev)
            prev, served = now, counted
            led.note_proxy_delay(now, 0.001)  # the proxy's loop on time, measured as the daemon does
        if step % 200 == 0:
            _feed(led, now / S, 100.0 * now / S)
        led.advance(now)
    led.close_all(int(6.2 * S))
    return sink.rows["intervals"]


@pytest.mark.parametrize("phase_ms", [0, 40, 90, 160])
@pytest.mark.parametrize("first_token_alone,count_per_step", [(True, True), (False, True), (False, False)])
def test_honest_streams_of_several_tokens_a_chunk_are_not_flagged_whenever_the_server_counted_them(
        first_token_alone, count_per_step, phase_ms):
    # A stream counted one token a chunk whose usage says 4 a chunk: where in each chunk's time the server counted its
    # tokens, nothing tells (step by step over it: a server's stream interval; all at the chunk: speculative decoding),
    # nor whether its first chunk held the prefill's token alone. No bypass traffic ran: no interval may say its count
    # is low or off, and none but a token's worth in all may go to bypass traffic (the tolerance: a token, what a
    # record's own delay moves whatever the placing, LAG_TOKENS). Before, scaled at the chunks' stamps, the stream-
    # interval scene's windows ran up to 3 tokens behind the counter, and its first chunk 2.6 ahead: counter_below and
    # proxy_lag on honest rows (the simulator's scene: 5-15 of 30 busy intervals in 2 runs of 3).
    ivs = _chunked_streams(first_token_alone, count_per_step, phase_ms)
    assert sum(r["proxy_tokens"] for r in ivs) == pytest.approx(3 * 40)
    said = [(r["t_start_mono_s"], r["server_count"]) for r in ivs if r["server_count"] != "complete"]
    assert not said, said
    assert sum(r["server_tokens"] or 0.0 for r in ivs) <= 1.0


def test_lockstep_streams_whose_step_falls_inside_a_scrapes_get_are_not_said_proxy_lag():
    # Four streams decoded together, one token each a 50 ms step (a continuous batch), every token through the proxy
    # 1 ms after the server counted it, no bypass traffic; the scraper's GETs take 6 ms and some hold a step. Where in
    # the GET the counter was read moves that step's 4 tokens between two windows, more than a token plus 5% of their
    # 20: but both windows booked no bypass token, so the read moved none (`CountReconciler._quiet_edges`). Before,
    # each interval beside such an edge said proxy_lag (the simulator, 4 streams of 40: 13 of 34 busy intervals), every
    # window's bypass 0.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    traces = [RequestTrace(i + 1, "POST", "/completion", "t", int(0.95 * S), 0, api="llamacpp", stream=True)
              for i in range(4)]
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    prev, served, counted = int(0.5 * S), 0.0, 0.0
    for ms in range(501, 6001):  # every 1 ms to 6 s
        now = ms * S // 1000
        if ms == 950:
            for tr in traces:
                led.on_start(tr)
        step = 1000 <= ms <= 4000 and ms % 50 == 0
        if step:
            counted += 4  # the server counts the step's token of each stream
        if 1000 < ms <= 4001 and ms % 50 == 1:  # the proxy reads them 1 ms later
            for tr in traces:
                tr.first_ns = tr.first_ns or now
                tr.last_ns = now
                tr.tokens_seen += 1
                led.on_tokens(tr, now, 1)
        if ms == 4002:
            for tr in traces:
                tr.end_ns = now
                led.on_end(tr)
        if ms % 250 == 5:  # a GET from 6 ms before now, stamped at its middle (2 ms after a step, 1 after its tokens)
            mid = now - 3 * S // 1000
            led.add_server_tokens(mid, counted - served, prev, read_ns=(mid - 3 * S // 1000, now))
            led.note_proxy_delay(now, 0.001)
            prev, served = mid, counted
        if ms % 250 == 200:  # 0.25 s intervals, their edges 50 ms before the scrapes (the daemon samples on its own clock)
            _feed(led, now / S, 100.0 * now / S)
        if ms % 10 == 0:
            led.advance(now)
    led.close_all(int(6.2 * S))
    ivs = sink.rows["intervals"]
    assert sum(r["proxy_tokens"] for r in ivs) == pytest.approx(61 * 4)
    assert sum(r["server_tokens"] or 0.0 for r in ivs) <= 1.0
    said = [(r["t_start_mono_s"], r["server_count"]) for r in ivs if r["server_count"] != "complete" and r["proxy_tokens"]]
    assert not said, said


def _bypass_counts_judged(ivs, times):
    """Of interval rows scored against the true bypass token times (monotonic ns): those marked `complete` whose
    server_tokens is off by over 1 token + 5% (start, got, true), and those marked otherwise (start, server_count), the
    last (past the last scrape, `unscraped`) left out."""
    tok = np.array(times, dtype=np.int64)
    off, said = [], []
    for r in ivs:
        a = int(round(r["t_start_mono_s"] * S))
        b = a + int(round(r["duration_s"] * S))
        true = int(np.searchsorted(tok, b, side="right") - np.searchsorted(tok, a, side="right"))
        got = r["server_tokens"] or 0.0
        if r["server_count"] not in ("complete", "unscraped"):
            said.append((r["t_start_mono_s"], r["server_count"]))
        elif r["server_count"] == "complete" and abs(got - true) > 1.0 + 0.05 * got:
            off.append((r["t_start_mono_s"], got, true))
    return off, said


def _bypass_tick(led, ms: int, now: int) -> None:
    """A bypass scene's daemon loop at `ms` (monotonic `now`): the GPU's energy fed each 0.5 s (100 W), the ledger
    advanced each 10 ms."""
    if ms % 500 == 0:
        _feed(led, now / S, 100.0 * now / S)
    if ms % 10 == 0:
        led.advance(now)


def _bypass_closed_and_judged(led, sink, times):
    """A bypass scene's end: every interval closed at 6.2 s; its interval rows, and `_bypass_counts_judged` of them."""
    led.close_all(int(6.2 * S))
    ivs = sink.rows["intervals"]
    return (ivs, *_bypass_counts_judged(ivs, times))


@pytest.mark.parametrize("traffic,get_ms", [("bursts", 200), ("steady", 10), ("steady", 60)])
def test_bypass_tokens_a_scrapes_get_may_move_across_its_edge_mark_the_intervals_beside_it(traffic, get_ms):
    # No proxied request; bypass traffic straight to the server. The scraper's GETs are stamped at their midpoint
    # (every 0.5 s, the intervals' edges there too), but the server read its counter at each GET's start. A server
    # stepping in bursts (100 tokens in 60 ms, inside the first half of a 200 ms GET, once a second: a loaded host's
    # GETs took up to 1 s, median 51 ms, beside 223 tokens in 0.19 s then none) has each burst counted in the window
    # after the one it ran in: every interval's bypass count off by 100. Before, each said `complete` (the test of a
    # read placed anywhere in its GET weighed the proxy's tokens inside it, not the bypass traffic's). A steady pace
    # beside short GETs moves less than a token plus 5% and stays `complete`.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.5 * S), 0.0)
    counted, times = 0.0, []  # the server's count, and when each bypass token ran
    hist: list[tuple[int, float]] = [(0, 0.0)]  # (ms, count then)
    prev, served = int(0.5 * S), 0.0
    half = get_ms // 2
    for ms in range(501, 6001):
        now = ms * S // 1000
        if traffic == "bursts":
            ran = 1000 <= ms < 5000 and 420 <= ms % 1000 < 480 and ms % 3 == 0  # 20 steps of 5 tokens
            n = 5.0 if ran else 0.0
        else:
            n = 1.0 if 1000 <= ms < 5000 and ms % 10 == 0 else 0.0  # 100 tokens/s
        if n:
            counted += n
            times += [now] * int(n)
        hist.append((ms, counted))
        if ms % 500 == half and ms > 1000:  # a GET from `get_ms` before now, stamped at its middle, read at its start
            mid, start = now - half * S // 1000, now - get_ms * S // 1000
            at_read = hist[-1 - get_ms][1]
            led.add_server_tokens(mid, at_read - served, prev, read_ns=(start, now))
            prev, served = mid, at_read
        _bypass_tick(led, ms, now)
    ivs, off, said = _bypass_closed_and_judged(led, sink, times)
    assert sum(r["server_tokens"] or 0.0 for r in ivs) == pytest.approx(len(times), abs=1.0)
    assert not off, off  # before: 8 intervals `complete`, 100 or 0 bypass tokens where 0 or 100 ran
    if traffic == "steady" and get_ms <= 10:  # 0.5 bypass tokens a half GET: `complete`, as before
        assert not said, said


@pytest.mark.parametrize("missed", [60.0, 0.0])
def test_an_answer_counted_a_scrape_late_for_ending_between_the_reads_marks_the_intervals_it_moved(missed):
    # No proxied request; bypass traffic at 100 tokens/s all along. llama-server's count is its counter plus /slots,
    # read one after the other: a 60-token answer that ended between them is in neither at the scrape of 3.25 s,
    # counted at the next (scrape.Scraper.window_read_missed says 60). Scrapes every 0.5 s at the intervals' middles,
    # GETs of 4 ms: the windows either side of that edge each have half their time in an interval beside it, which gets
    # 30 tokens too few or too many. Before, both said `complete` (25.2 and 75.2 where 50 ran): the GET's span moves
    # half a token.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(int(0.25 * S), 0.0)
    counted, times, prev, served = 0.0, [], int(0.25 * S), 0.0
    for ms in range(251, 6001):
        now = ms * S // 1000
        if ms % 10 == 0:  # all along: no start or stop inside a window (spread evenly over it, the daemon's rule)
            counted += 1.0
            times.append(now)
        if ms % 500 == 254 and ms > 500:  # a GET of 4 ms, stamped at its middle
            mid = now - 2 * S // 1000
            at_read = counted - (missed if ms == 3254 else 0.0)
            led.add_server_tokens(mid, max(0.0, at_read - served), prev, read_ns=(now - 4 * S // 1000, now),
                                  read_missed=missed if ms == 3254 else 0.0)
            prev, served = mid, max(served, at_read)
        _bypass_tick(led, ms, now)
    ivs, off, said = _bypass_closed_and_judged(led, sink, times)
    assert sum(r["server_tokens"] or 0.0 for r in ivs) == pytest.approx(served, abs=1.0)  # all the scrapes read
    assert not off, off
    if missed:  # the two intervals beside the edge say proxy_lag (a count that may be high or low), no others
        assert [s for _, s in said] == ["proxy_lag", "proxy_lag"], said
    else:  # nothing ended between the reads: every interval `complete`, as before
        assert not said, said


def test_a_power_limit_changed_while_intervals_are_held_splits_each_with_its_own_settings_costs():
    # The tuner (or a sweep) moves the limit from 300 W to 200 W at 3.5 s while a stream runs whose prompt length
    # comes only at its end, so its intervals are held and close together. Before: all of them were split with the
    # last setting's costs and learned as its (the fit of 200 W took 300 W intervals' energy).
    from powerprof.daemon import attribution as attr
    from powerprof.daemon.workmodel import CostLearner

    class Learner(CostLearner):
        added: list = []

        def add(self, setting, features, energy_j, usable, ends_ns=None):
            self.added.append((setting, len(features), [bool(u) for u in usable]))

        def costs(self, setting):
            return attr.WorkCosts(source="fitted" if setting == (300.0,) else "fixed")

    learner = Learner()
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, learner=learner)
    tr = RequestTrace(1, "POST", "/v1/completions", "t", int(0.5 * S), 0, api="openai-completions", stream=True)
    led.on_start(tr)
    for k in range(8):
        limit = 300.0 if k <= 3 else 200.0
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0, power_limit_w=limit)])
        if k:
            led.on_tokens(tr, int((k - 0.5) * S), 1)
            tr.first_ns, tr.last_ns = tr.first_ns or int(0.5 * S), int((k - 0.5) * S)
        led.advance(int((k + 0.2) * S))
    assert sink.rows["intervals"] == []  # held for the prompt
    tr.end_ns = int(6.6 * S)
    tr.counts = Counts(generated_tokens=7, prompt_tokens=50, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    led.advance(int(7.2 * S))
    rows = sink.rows["intervals"]
    assert [r["work_costs"] for r in rows] == ["fitted"] * 3 + ["fixed"] * 4
    # Each setting's fit gets its own intervals; the one the limit changed in is of both and feeds neither.
    assert learner.added == [((300.0,), 3, [True] * 3), ((200.0,), 4, [False] + [True] * 3)]
    (row,) = sink.rows["requests"]
    assert row["gpu_energy_j"] == pytest.approx(sum(r["requests_energy_j"] for r in rows))


def test_a_request_running_across_utc_midnight_is_one_row_with_the_energy_of_both_dates():
    # The datasets are partitioned by UTC date (requests by arrival, intervals by start): a request that spans
    # midnight must be written once, on its arrival's date, with the energy of the intervals of both dates.
    from datetime import datetime, timezone

    from powerprof.daemon.store import date_of

    midnight = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * S
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = RequestTrace(1, "POST", "/completion", "t", int(1.5 * S), midnight - int(3.5 * S), api="llamacpp", stream=True)
    led.on_start(tr)
    for k in range(10):  # monotonic k s is wall midnight - 5 s + k s
        led.add_gpu_sample(k * S, midnight + (k - 5) * S, [R(100.0 * k, 100.0)])
        if 2 <= k <= 8:
            led.on_tokens(tr, int((k - 0.5) * S), 1)
            tr.first_ns, tr.last_ns = tr.first_ns or int(1.5 * S), int((k - 0.5) * S)
        led.advance(int((k + 0.2) * S))
    tr.end_ns, tr.end_wall_ns = int(7.6 * S), midnight + int(2.6 * S)
    tr.counts = Counts(generated_tokens=7, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    led.advance(int(9.5 * S))
    led.close_all(int(10 * S))
    (row,) = sink.rows["requests"]
    assert date_of(row["t_arrival_utc"]) == "2025-12-31" and date_of(row["t_end_utc"]) == "2026-01-01"
    ivs = sink.rows["intervals"]
    by_date = {}
    for r in ivs:
        by_date[date_of(r["t_start_utc"])] = by_date.get(date_of(r["t_start_utc"]), 0.0) + r["requests_energy_j"]
    assert set(by_date) == {"2025-12-31", "2026-01-01"} and min(by_date.values()) > 0
    assert row["gpu_energy_j"] == pytest.approx(sum(by_date.values())) and row["attributed_tokens"] == 7.0


def _cpu(led, t_s, cpu_j, host_s, server_s, own_s=0.0):
    """A RAPL read (package energy) and a CPU-time read at `t_s`, as the sampler's ticks give them."""
    from powerprof.collectors.cputime import CpuTimeReading
    from powerprof.collectors.rapl import RaplReading

    led.add_rapl_sample(int(t_s * S), [RaplReading("package-0", "package", 0, cpu_j, None)])
    led.add_cputime_sample(int(t_s * S), CpuTimeReading(host_s, server_s, own_s))


def test_cpu_energy_of_intervals_where_other_processes_kept_the_host_busy_is_marked(caplog):
    # RAPL is the whole package's: beside other work, the CPU energy split among the requests is partly theirs. Before,
    # the daemon split it with no judgement (sweep and measure flag it busy-host). Per second: the server uses 1 CPU s,
    # powerprof 0.1; other processes 0.02 s over [0, 2) (quiet, 1.8%) and 1 s over [2, 4) (busy, 47.6%).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    quiet, busy = _trace(1, 0.1), _trace(2, 2.1)
    host = srv = own = 0.0
    for k in range(5):
        _cpu(led, k, 50.0 * k, host, srv, own)
        _feed(led, k, 300.0 * k)
        other = 0.02 if k < 2 else 1.0
        host, srv, own = host + 1.12 + other - 0.02, srv + 1.0, own + 0.1
    led.open_tag("all", 0, 0)
    for tr, t0 in ((quiet, 0.1), (busy, 2.1)):
        led.on_start(tr)
        tr.first_ns = int((t0 + 0.1) * S)
        for j in range(15):
            led.on_tokens(tr, int((t0 + 0.1 + 0.1 * j) * S), 1)
        tr.last_ns, tr.end_ns = int((t0 + 1.5) * S), int((t0 + 1.6) * S)
        tr.counts = Counts(generated_tokens=15, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
    led.close_tag("all", 4 * S, 4 * S)
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.ledger"):
        led.advance(int(4.5 * S))

    pcts = [r["other_cpu_pct"] for r in sink.rows["intervals"]]
    assert pcts == [pytest.approx(100 * 0.02 / 1.12), pytest.approx(100 * 0.02 / 1.12),
                    pytest.approx(100 * 1.0 / 2.1), pytest.approx(100 * 1.0 / 2.1)]
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    assert got[1]["cpu_energy_j"] is not None and got[1]["other_cpu_pct"] == pytest.approx(1.8, abs=0.1)
    assert "busy-host" not in (got[1]["energy_note"] or "")
    # The figure is kept (as the sweep keeps it) and visibly marked, with the share and the fix.
    assert got[2]["cpu_energy_j"] is not None and got[2]["other_cpu_pct"] == pytest.approx(47.6, abs=0.1)
    note = got[2]["energy_note"]
    assert "busy-host" in note and "other processes used 48%" in note and "cpu_energy_j" in note and "fix:" in note
    (tag,) = sink.rows["tags"]
    assert tag["other_cpu_pct"] == pytest.approx(100 * 2.04 / 6.44)  # other processes' CPU time summed ÷ the host's
    # /metrics: the latest closed interval's share and the requests' CPU energy in the busy-host intervals.
    assert led.totals.other_cpu_pct == pytest.approx(47.6, abs=0.1)
    assert led.totals.busy_host_requests_cpu_j == pytest.approx(100.0)
    assert sum("other processes used" in m and "busy-host" in m for m in caplog.messages) == 1  # once per spell


def test_intervals_wait_for_a_cpu_time_read_past_their_end_from_a_lagging_sampler():
    # The CPU-time collector has its own sampler thread, and a busy host is what starves it: its reads reached the
    # ledger 2 s late while RAPL's and NVML's came on time, and the intervals closed on the latest span's rate, the
    # quiet one before the other processes began: 1.8% for intervals where they used 47.6% of the busy CPU time,
    # unmarked. Each interval now waits (at most rapl_hold_s) for a CPU-time read at or past its end.
    from powerprof.collectors.cputime import CpuTimeReading
    from powerprof.collectors.rapl import RaplReading

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, rapl_hold_s=3.0)
    reads, host, srv, own = [], 0.0, 0.0, 0.0
    for k in range(9):
        reads.append((k, CpuTimeReading(host, srv, own)))
        other = 0.02 if k < 3 else 1.0  # other processes busy from 3 s on
        host, srv, own = host + 1.1 + other, srv + 1.0, own + 0.1
    for k in range(9):
        led.add_rapl_sample(k * S, [RaplReading("package-0", "package", 0, 50.0 * k, None)])
        _feed(led, k, 300.0 * k)
        if k >= 2:  # the read of 2 s ago arrives now
            t, r = reads[k - 2]
            led.add_cputime_sample(t * S, r)
        led.advance(int((k + 0.2) * S))
    for t, r in reads[-2:]:
        led.add_cputime_sample(t * S, r)
    led.advance(int(9.5 * S))
    led.close_all(10 * S)
    pct = {round(r["t_start_mono_s"]): r["other_cpu_pct"] for r in sink.rows["intervals"]}
    assert pct[0] is None  # closed before any CPU-time read came: unjudged, said so by the empty share
    assert [pct[k] for k in (1, 2)] == [pytest.approx(1.8, abs=0.1)] * 2, pct
    assert [pct[k] for k in range(3, 8)] == [pytest.approx(47.6, abs=0.1)] * 5, pct


def test_a_server_whose_processes_are_not_found_leaves_the_cpu_share_unjudged_and_says_so_once(caplog):
    from powerprof.collectors.cputime import CpuTimeReading

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.ledger"):
        for k in range(3):
            led.add_cputime_sample(k * S, CpuTimeReading(1.0 * k, None, 0.1 * k, "nothing on this host listens on port 9"))
            _feed(led, k, 300.0 * k)
        led.advance(int(2.5 * S))
    assert [r["other_cpu_pct"] for r in sink.rows["intervals"]] == [None, None]
    assert led.totals.other_cpu_pct is None
    (msg,) = [m for m in caplog.messages if "not found" in m]
    assert "port 9" in msg and "could include other processes' energy" in msg


@dataclass
class RT(R):  # a GpuReading's counter instant too
    energy_t_mono_ns: int | None = None


def test_each_gpus_counter_is_placed_at_its_own_read_instant_in_ticks_and_edges():
    # Eight H200s: each counter read costs ~3 ms (15 ms one call in 50), one GPU after the other, and a sample (or an
    # edge read) is dated at the middle of the whole read. Before, the daemon put every GPU's counter at that one
    # instant: a slow call moves the later GPUs' counters off it. GPU g draws 150 + 100·g W throughout, so each
    # interval's true energy is 4400 W · its length exactly.
    from powerprof.collectors.nvml import CounterRead

    n = 8
    power_w = 150.0 + 100.0 * np.arange(n)

    def energy_j(t_ns, g):  # GPU g's true cumulative energy
        return power_w[g] * t_ns / S + 1000.0

    def reads(start_s, call_s):  # each GPU's counter instant (the middle of its own call) and the read's middle
        ends = start_s + np.cumsum(call_s)
        return [int((e - c / 2) * S) for e, c in zip(ends, call_s)], int((start_s + ends[-1]) / 2 * S)

    def tick(led, start_s, call_s=(0.003,) * n):
        ts, mid = reads(start_s, call_s)
        led.add_gpu_sample(mid, mid, [RT(energy_j(t, g), power_w[g], energy_t_mono_ns=t) for g, t in enumerate(ts)])

    def edge(led, start_s, call_s):
        ts, mid = reads(start_s, call_s)
        got = CounterRead([energy_j(t, g) for g, t in enumerate(ts)])
        got.t_mono_ns = tuple(ts)
        led.add_gpu_edge(mid, mid, got)

    sink = Sink()
    led = Ledger("d", 0, n, sink, grace_s=0.1)
    tick(led, 0.0)
    edge(led, 0.4, (0.003, 0.003, 0.015) + (0.003,) * 5)  # GPU 2's call is a slow one
    tick(led, 1.0)
    edge(led, 1.3, (0.003,) * 6 + (0.015, 0.003))
    tick(led, 2.0, (0.015,) + (0.003,) * 7)
    led.advance(int(3 * S))
    rows = sink.rows["intervals"]
    assert len(rows) == 4 and all(r["energy_method"] == "counter" for r in rows)
    # Before: +1.05%, -0.72%, -0.76%, +1.16% (17, 17, 9 and 32 J): a slow call moved the later GPUs, and the GPUs'
    # offsets about the read's middle, weighted by their unequal power, did not cancel.
    for r in rows:
        assert r["gpu_energy_j"] == pytest.approx(power_w.sum() * r["duration_s"], abs=1e-3), r  # ns rounding


def test_a_tag_edge_is_dated_where_the_ledger_dates_its_sample():
    # A tag's edge is an on-demand sample: its window must start and end where that sample's edge is (the interval
    # edges), or its energy would not be the intervals' inside it.
    ts = [int((0.5 + 0.003 * g + 0.0015) * S) for g in range(4)]
    readings = [RT(100.0 * g, 100.0 * (g + 1), energy_t_mono_ns=t) for g, t in enumerate(ts)]
    led = Ledger("d", 0, 4, Sink())
    led.add_gpu_sample(int(0.4 * S), int(0.4 * S), [RT(0.0, 100.0 * (g + 1)) for g in range(4)])
    led.add_gpu_sample(int(0.506 * S), 7 * S, readings)
    t, wall = Ledger.sample_instant(int(0.506 * S), 7 * S, readings)
    assert led.edges[-1].t_ns == t and led.edges[-1].wall_ns == wall
    assert t == round(np.dot(ts, [1, 2, 3, 4]) / 10)  # weighted by each GPU's power
    assert wall == 7 * S - (int(0.506 * S) - t)


def _avg_only_run(led: Ledger, steps, until_s: float, interval_s: float = 1.0):
    """A simulated card with neither an energy counter nor instant power (only nvmlDeviceGetPowerUsage's 1 s
    trailing average) running `steps` [(t_s, "decode" | "idle")], sampled every interval_s as the daemon does.
    Returns the card (its history is the truth)."""
    import dataclasses

    from powerprof.sim.gpu import Phase, SimGpu
    from powerprof.sim.profiles import get_profile

    prof = dataclasses.replace(get_profile("seed-16g"), has_energy_counter=False, has_instant_power=False,
                               power_avg_window_s=1.0)
    now = [0]
    gpu = SimGpu(prof, 0, "GPU-avg", clock_ns=lambda: now[0], record_history=True)
    events = sorted([(t, kind) for t, kind in steps] + [(k * interval_s, "sample")
                                                        for k in range(int(until_s / interval_s) + 1)])
    for t, kind in events:
        now[0] = int(t * S)
        if kind == "sample":
            led.add_gpu_sample(now[0], now[0], [R(None, None, gpu.average_power_w(), 300.0)])
        else:
            gpu.set_phase(Phase(kind, 0.45 if kind == "decode" else 0.0))
    return gpu


def test_a_gpu_read_by_its_trailing_average_alone_has_its_energy_when_it_was_spent():
    # nvmlDeviceGetPowerUsage is the mean of the last second: read at t it describes [t - 1, t]. Integrated as
    # if it were the power at t, every burst's energy landed 0.5 s late (into the interval after a request, and
    # onto whichever request ran there). Shifted back by half its window, as the profiler does
    # (energy.trailing_average_energy_j), each burst's energy is centred where the simulator spent it.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, avg_windows_s=(1.0,))
    gpu = _avg_only_run(led, [(3.3, "decode"), (5.6, "idle"), (8.2, "decode"), (9.1, "idle")], until_s=13.0)
    led.advance(int(13.0 * S))
    rows = sink.rows["intervals"]
    assert rows and all(r["energy_method"] == "avg_power_integration" for r in rows)
    # wall = monotonic here: the rows' UTC edges are the simulator's instants
    a = np.array([r["t_start_utc"] for r in rows])
    b = np.array([r["t_end_utc"] for r in rows])
    got = np.array([r["gpu_energy_j"] for r in rows])
    truth = np.array([gpu.true_energy_at_j(y) - gpu.true_energy_at_j(x) for x, y in zip(a, b)])
    mid_s, idle = (a + b) / 2 / S, gpu.profile.idle_power_w * (b - a) / S
    for lo, hi in ((2, 7), (7, 12)):  # each burst and the idle second either side of it
        m = (mid_s > lo) & (mid_s < hi)

        def centre_s(e):
            return np.sum((e[m] - idle[m]) * mid_s[m]) / np.sum(e[m] - idle[m])

        assert got[m].sum() == pytest.approx(truth[m].sum(), rel=1e-3)
        # Measured: 0.500 s late unshifted, 0.000 s shifted.
        assert centre_s(got) == pytest.approx(centre_s(truth), abs=0.05)
    # Nothing is closed past what the readings cover: the last interval ends half a window before the last read.
    assert rows[-1]["t_end_utc"] <= int(12.5 * S)


def test_a_request_of_two_choices_costs_twice_one_choice_not_more():
    # Request a has two choices (n = 2, llama.cpp: a task each, its usage summing their prompts), request b one; each
    # sequence has the same 100-token prompt and decodes 10 tokens in [1, 2). Each of a's tokens is decoded at its
    # own sequence's context, and a's two tokens a step are one step: a's work is exactly twice b's. Before, a's
    # tokens were costed at the two sequences' context summed (200 + both sequences' tokens) and counted two steps
    # a step (bench/attribution_mixed.py, 800 requests: n = 2 chat +4.6% over its truth, +0.3% after).
    from powerprof.daemon.attribution import WorkCosts
    from powerprof.daemon.workmodel import CostLearner

    class Fixed(CostLearner):  # costs with a step and a context term, as a mature fit has
        def costs(self, setting):
            return WorkCosts(step_j=2.0, decode_j=1.0, prefill_j=0.0, ctx_j=5.0, source="fitted")

        def add(self, *a, **kw):
            return None

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, learner=Fixed())
    a, b = _trace(1, 0.1), _trace(2, 0.2)
    a.extra["sequences"] = 2
    for tr in (a, b):
        led.on_start(tr)
    _feed(led, 0.0, 1000.0)
    _feed(led, 1.0, 1100.0)
    for k in range(10):
        t = int((1.0 + 0.09 * k) * S)
        led.on_tokens(a, t, 2)
        led.on_tokens(b, t, 1)
    a.first_ns = b.first_ns = int(1.0 * S)
    a.last_ns = b.last_ns = int(1.81 * S)
    a.end_ns = b.end_ns = int(1.9 * S)
    a.counts = Counts(generated_tokens=20, prompt_tokens=200, model=None, stop_reason=None, token_source="usage")
    b.counts = Counts(generated_tokens=10, prompt_tokens=100, model=None, stop_reason=None, token_source="usage")
    led.on_end(a)
    led.on_end(b)
    _feed(led, 2.0, 1400.0)
    led.advance(int(2.2 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    # [0,1) has no work (no prefill cost): shared by live time; [1,2) by work, exactly 2:1.
    decode_a = got[1]["gpu_energy_j"] - 100.0 * 0.9 / 1.7
    decode_b = got[2]["gpu_energy_j"] - 100.0 * 0.8 / 1.7
    assert decode_a + decode_b == pytest.approx(300.0)
    assert decode_a == pytest.approx(2 * decode_b, rel=1e-6)


@pytest.mark.parametrize("mature", [False, True])
def test_requests_that_shared_intervals_split_by_the_fixed_ratio_say_so(mature):
    # Until the work model's fit is mature the fixed ratio splits an interval among the requests in it: each one's share
    # rests on that ratio (on a loaded host the vLLM mixed trace's fit never matured in 800 requests, the median
    # request off by 10.8-12.0% against truth, and no row said so). A request alone in its intervals takes all their work
    # whatever the ratio: nothing to say. Once the fit is mature, nothing either.
    from powerprof.daemon.attribution import WorkCosts
    from powerprof.daemon.workmodel import CostLearner

    from powerprof.daemon.workmodel import Fit

    class Learner(CostLearner):
        def costs(self, setting):
            return WorkCosts(step_j=1.0, decode_j=1.0, prefill_j=0.1, source="fitted") if mature else WorkCosts()

        def add(self, setting, *a, **kw):
            # The close that adds it makes the first mature fit: its intervals were split before, by the fixed ratio,
            # for the reason the fit before it gave (before, the note read the new fit's: "no fit yet").
            was = self.fits.get(setting)
            self.fits[setting] = Fit((0.0,) * 5, 40, 35, 0.95, 0.1, True, "")
            return was

    learner = Learner()
    learner.fits[(None,)] = learner.fits[()] = Fit((0.0,) * 5, 20, 12, None, None, False, "12 busy intervals of 30")

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, learner=learner)
    a, b, c = _trace(1, 0.1), _trace(2, 0.2), _trace(3, 3.1)
    for k in range(6):
        _feed(led, float(k), 1000.0 + 300.0 * k)
        if k == 0:
            led.on_start(a), led.on_start(b)
        if k == 1:
            for j in range(10):
                led.on_tokens(a, int((1.0 + 0.09 * j) * S), 2)
                led.on_tokens(b, int((1.0 + 0.09 * j) * S), 1)
            a.first_ns = b.first_ns = int(1.0 * S)
            a.last_ns = b.last_ns = int(1.81 * S)
            a.end_ns = b.end_ns = int(1.9 * S)
            for tr, n in ((a, 20), (b, 10)):
                tr.counts = Counts(generated_tokens=n, prompt_tokens=100, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        if k == 3:
            _decoded(led, c, 3.2, 0.1, 8, 3.9, 3.95, prompt_tokens=100)
    led.advance(int(5.5 * S))
    notes = {r["request_id"]: r["energy_note"] or "" for r in sink.rows["requests"]}
    assert set(notes) == {1, 2, 3}
    assert "fixed ratio" not in notes[3], notes[3]  # alone in its intervals: the ratio decides nothing
    for rid in (1, 2):
        if mature:
            assert "fixed ratio" not in notes[rid], notes[rid]
        else:
            assert notes[rid].startswith("approximate: 100% of its GPU energy is from intervals other requests did "
                                         "work in too"), notes[rid]
            assert "split among them by the fixed ratio" in notes[rid] and "not mature (12 busy intervals of 30)" in notes[rid]
            assert "fix: " in notes[rid]


def _queued_beside_rows(d_first_s: float, d_prompt: int) -> dict:
    """Request c (arriving at 3.1, a 100-token prompt) decodes 8 tokens over [3.2, 3.9] while d (arriving at 3.15, a
    `d_prompt`-token prompt) waits; d then decodes 4 tokens from `d_first_s`. 300 J an interval; the work model's fit
    not mature (the fixed ratio splits). The request rows, by request id (3: c, 4: d)."""
    from powerprof.daemon.workmodel import CostLearner, Fit

    learner = CostLearner()
    learner.fits[(None,)] = learner.fits[()] = Fit((0.0,) * 5, 20, 12, None, None, False, "12 busy intervals of 30")
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, learner=learner)
    c, d = _trace(3, 3.1), _trace(4, 3.15)
    for k in range(7):
        _feed(led, float(k), 1000.0 + 300.0 * k)
        if k == 3:
            led.on_start(c), led.on_start(d)
            for j in range(8):
                led.on_tokens(c, int((3.2 + 0.1 * j) * S), 1)
            c.first_ns, c.last_ns, c.end_ns = int(3.2 * S), int(3.9 * S), int(3.95 * S)
            c.counts = Counts(generated_tokens=8, prompt_tokens=100, model=None, stop_reason=None, token_source="usage")
            led.on_end(c)
        if k == 4:
            for j in range(4):
                led.on_tokens(d, int((d_first_s + 0.1 * j) * S), 1)
            d.first_ns, d.last_ns, d.end_ns = int(d_first_s * S), int((d_first_s + 0.3) * S), int((d_first_s + 0.35) * S)
            d.counts = Counts(generated_tokens=4, prompt_tokens=d_prompt, model=None, stop_reason=None,
                              token_source="usage")
            led.on_end(d)
    led.advance(int(6.5 * S))
    return {r["request_id"]: r for r in sink.rows["requests"]}


def test_a_request_only_queued_beside_another_leaves_its_split_to_no_ratio():
    # Request d waits (queued: no token, its prompt not yet prefilled) through c's whole decode; then d decodes alone.
    # Each did all the work of the intervals it worked in, whatever the ratio: neither row says the fixed ratio split it
    # (before, c's did: d was live beside it).
    rows = _queued_beside_rows(d_first_s=4.5, d_prompt=100)
    assert set(rows) == {3, 4}
    for rid in (3, 4):
        assert "fixed ratio" not in (rows[rid]["energy_note"] or ""), rows[rid]["energy_note"]
        assert rows[rid]["gpu_energy_j"] > 0


@pytest.mark.parametrize("shape", ["once", "each_task"])
def test_a_prompt_said_once_for_its_choices_is_each_choices_context_and_one_prefill(shape):
    # Request a has two choices of one 100-token prompt, request b one choice of the same prompt; each sequence
    # decodes 10 tokens in [1, 2). vLLM's usage says a's prompt once (100: it computed it once, the second choice
    # found it in the prefix cache), llama.cpp's sums each task's (200). Either way each of a's sequences decodes at
    # 100 + its own tokens, so a's decode work is exactly twice b's; and a's prefill is what its server computed:
    # the prompt once on vLLM (the cache hit is no prefill work), twice on llama.cpp. Before, vLLM's 100 was divided
    # by the two sequences as llama.cpp's 200 is: each of a's tokens costed at 50 + its tokens (bench/attribution_mixed.py
    # --flavour vllm, 800 requests: n = 2 chat -4.6% under its truth).
    from powerprof.daemon.attribution import WorkCosts
    from powerprof.daemon.workmodel import CostLearner

    class Fixed(CostLearner):  # costs with a step, a prefill and a context term, as a mature fit has
        def costs(self, setting):
            return WorkCosts(step_j=2.0, decode_j=1.0, prefill_j=0.5, ctx_j=5.0, prefill_tok_s=1e9, source="fitted")

        def add(self, *a, **kw):
            return None

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, learner=Fixed())
    a, b = _trace(1, 0.1), _trace(2, 0.2)
    a.extra["sequences"] = a.extra["choices"] = 2
    for tr in (a, b):
        led.on_start(tr)
    _feed(led, 0.0, 1000.0)
    _feed(led, 1.0, 1100.0)
    for k in range(10):
        t = int((1.0 + 0.09 * k) * S)
        led.on_tokens(a, t, 2)
        led.on_tokens(b, t, 1)
    a.first_ns = b.first_ns = int(1.0 * S)
    a.last_ns = b.last_ns = int(1.81 * S)
    a.end_ns = b.end_ns = int(1.9 * S)
    each = shape == "each_task"
    a.counts = Counts(generated_tokens=20, prompt_tokens=200 if each else 100, model=None, stop_reason=None,
                      token_source="usage", prompt_each_task=each)
    b.counts = Counts(generated_tokens=10, prompt_tokens=100, model=None, stop_reason=None, token_source="usage",
                      prompt_each_task=True)
    led.on_end(a)
    led.on_end(b)
    _feed(led, 2.0, 1400.0)
    led.advance(int(2.2 * S))
    got = {r["request_id"]: r["gpu_energy_j"] for r in sink.rows["requests"]}
    # [0,1) (100 J) holds the prefills (computed just before the first tokens, at 1.0): split by them; [1,2) (300 J)
    # the decode: a's two sequences at b's context each, exactly twice b's work.
    pre_a, pre_b = 0.5 * (200 if each else 100), 0.5 * 100
    assert got[1] == pytest.approx(100.0 * pre_a / (pre_a + pre_b) + 200.0, rel=1e-6)
    assert got[2] == pytest.approx(100.0 * pre_b / (pre_a + pre_b) + 100.0, rel=1e-6)


def _avg_only_requests_run(led: Ledger, requests, until_s: float, profile: str = "h200-141g", instant: bool = False):
    """A simulated card read by its 1 s trailing average alone (no energy counter, no instant power), sampled every
    second with the ledger advanced after each sample as the daemon does; `requests` [(arrival_s, end_s, tokens)]
    each decode alone on it (64-token probes), their tokens evenly from 20 ms after arrival to the end. Returns the
    card (its history is the truth) and the traces. `instant`: read by its instant power instead (a Pascal card)."""
    import dataclasses

    from powerprof.sim.gpu import Phase, SimGpu
    from powerprof.sim.profiles import get_profile

    prof = dataclasses.replace(get_profile(profile), has_energy_counter=False, has_instant_power=False)
    now = [0]
    gpu = SimGpu(prof, 0, "GPU-avg", clock_ns=lambda: now[0], record_history=True)
    events = [(k * 1.0, 0, "sample", None) for k in range(int(until_s) + 1)]
    traces = []
    for i, (a, e, n) in enumerate(requests):
        tr = _trace(i + 1, a)
        traces.append(tr)
        events.append((a, 1, "start", tr))
        events += [(a + 0.02 + (e - 0.01 - a - 0.02) * j / max(n - 1, 1), 2, "token", tr) for j in range(n)]
        events.append((e, 3, "end", tr))
    for t, _, kind, tr in sorted(events, key=lambda x: (x[0], x[1])):
        now[0] = int(t * S)
        if kind == "sample":
            led.add_gpu_sample(now[0], now[0], [R(None, gpu.instant_power_w(), None, 700.0) if instant
                                                else R(None, None, gpu.average_power_w(), 700.0)])
            led.advance(now[0])
        elif kind == "start":
            gpu.set_phase(Phase("decode", 0.45))
            led.on_start(tr)
        elif kind == "token":
            tr.first_ns = tr.first_ns or now[0]
            tr.last_ns = now[0]
            tr.tokens_seen += 1
            led.on_tokens(tr, now[0], 1)
        else:
            gpu.set_phase(Phase("idle", 0.0))
            tr.end_ns = now[0]
            tr.counts = Counts(generated_tokens=tr.tokens_seen, prompt_tokens=200, model=None, stop_reason=None,
                               token_source="usage")
            led.on_end(tr)
    return gpu, traces


def _true_j(gpu, tr) -> float:
    return gpu.true_energy_at_j(tr.end_ns) - gpu.true_energy_at_j(tr.arrival_ns)


def test_a_short_request_alone_on_a_gpu_without_a_counter_is_not_charged_the_idle_gpu():
    # docs/daemon.md, "A GPU without an energy counter": a 64-token probe (0.45 s, ~130 J on the simulated H200) alone
    # on a GPU read by its 1 s trailing average took its intervals' whole energy, idle seconds included: the idle
    # power was learned from counter intervals only, so on such a GPU it was never known (+96% in
    # bench/attribution_accuracy.py --no-counter, +90-100% here). Each probe straddles an interval edge, as there.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, avg_windows_s=(1.0,))
    probes = [(10.7, 11.15, 64), (14.3, 14.75, 64), (18.55, 19.0, 64)]
    gpu, traces = _avg_only_requests_run(led, probes, until_s=24.0)
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    assert set(rows) == {1, 2, 3}
    for tr in traces:
        got, truth = rows[tr.request_id]["gpu_energy_j"], _true_j(gpu, tr)
        assert got == pytest.approx(truth, rel=0.1), (tr.request_id, got, truth)


def test_a_request_between_two_instant_power_reads_says_no_counter_short():
    # A card without a counter or an average (Pascal: `powerprof daemon --simulate pascal-8g`) is read by its instant
    # power once a second: a request live for 0.55 s of an interval, between two reads, is unseen by both. It was
    # charged the idle power alone with no note (here 10 J against 74 J true, -86%; 10 J for three of five 16-token
    # requests through the simulated daemon), live over half the interval so not no-counter-short. Now said: its row's note, the /metrics count, and out of the daemon's J/token.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, avg_windows_s=(0.0,))
    gpu, traces = _avg_only_requests_run(led, [(10.2, 10.75, 64)], until_s=14.0, profile="pascal-8g", instant=True)
    (row,) = sink.rows["requests"]
    truth = _true_j(gpu, traces[0])
    assert row["gpu_energy_j"] < 0.5 * truth, (row["gpu_energy_j"], truth)  # what the two reads saw: this flag's case
    assert row["energy_note"] and row["energy_note"].startswith("no-counter-short: ") and "fix:" in row["energy_note"], \
        (row["gpu_energy_j"], truth)
    assert "instant power" in row["energy_note"]  # why its intervals count, said
    assert led.totals.flagged_requests[NO_COUNTER_SHORT_FLAG] == 1
    assert led.totals.j_per_token is None
    # A request live through its intervals is read at both ends of each: not flagged, within the 1 Hz reads' error.
    led2 = Ledger("d", 0, 1, sink2 := Sink(), grace_s=0.1, avg_windows_s=(0.0,))
    gpu, traces = _avg_only_requests_run(led2, [(10.0, 17.0, 200)], until_s=20.0, profile="pascal-8g", instant=True)
    (row,) = sink2.rows["requests"]
    assert not (row["energy_note"] or "").count("no-counter-short")
    assert row["gpu_energy_j"] == pytest.approx(_true_j(gpu, traces[0]), rel=0.1)


def test_a_short_request_on_a_gpu_without_a_counter_says_so_and_stays_out_of_the_headline_figure():
    # What the trailing average cannot settle stays visible: a request live for under half of the intervals it took
    # energy from, on a GPU without a counter, rests on the idle power taken out of the rest and on the average's
    # timing. Its row says so (no-counter-short, with the fix), it is counted for /metrics, and the daemon's
    # J/token (the recent intervals') leaves such intervals out. A long request is not flagged.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, avg_windows_s=(1.0,))
    gpu, traces = _avg_only_requests_run(led, [(10.7, 11.15, 64)], until_s=15.0)
    (row,) = sink.rows["requests"]
    assert row["energy_note"] and "no-counter-short" in row["energy_note"] and "fix:" in row["energy_note"]
    assert row["gpu_energy_j"] is not None  # kept, and said
    assert led.totals.flagged_requests[NO_COUNTER_SHORT_FLAG] == 1
    assert led.totals.j_per_token is None  # its intervals were mostly idle: no headline figure from them
    gpu, traces = _avg_only_requests_run(led2 := Ledger("d", 0, 1, sink2 := Sink(), grace_s=0.1, avg_windows_s=(1.0,)),
                                         [(10.2, 16.6, 900)], until_s=20.0)
    (row,) = sink2.rows["requests"]
    assert not (row["energy_note"] or "").count("no-counter-short")
    assert led2.totals.flagged_requests[NO_COUNTER_SHORT_FLAG] == 0
    assert row["gpu_energy_j"] == pytest.approx(_true_j(gpu, traces[0]), rel=0.05)
    assert led2.totals.j_per_token is not None


def _at_finish_run(bypass_tokens: int, latency: bool = False):
    """SGLang's counter: it moves only when a request finishes, by that request's tokens. Four proxied requests of
    50 tokens (10 a second over 5 s, arriving 1 s apart, the proxy seeing each token 10 ms after the server made
    it) and, given `bypass_tokens`, one request straight to the server (over 6.5-9.5 s); scraped every 0.25 s as the
    daemon does for SGLang. `latency`: each scrape also says how many requests finished since the last and their
    summed end-to-end seconds (SGLang's e2e latency histogram). Returns the interval rows."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for k in range(15):
        _feed(led, float(k), 100.0 * k)
    reqs = []
    for i in range(4):
        tr = _trace(i + 1, 1.0 + i)
        tr.extra["prompt_tokens"] = 8
        led.on_start(tr)
        gen = (1.0 + i + 0.1 * np.arange(1, 51)) * S  # when the server generated each of its tokens
        reqs.append((tr, gen, gen + S // 100))
    finishes = [(int(gen[-1]), 50, (gen[-1] - tr.arrival_ns) / S) for tr, gen, _ in reqs]
    finishes += [(int(9.5 * S), bypass_tokens, 3.0)] if bypass_tokens else []
    prev, counted = None, 0
    for t in np.arange(1, 53) * (S // 4):
        for tr, gen, seen in reqs:
            for ts in seen[(seen > t - S // 4) & (seen <= t)]:
                tr.first_ns = tr.first_ns or int(ts)
                tr.last_ns = int(ts)
                tr.tokens_seen += 1
                led.on_tokens(tr, int(ts), 1)
            if tr.end_ns is None and seen[-1] <= t:
                tr.end_ns = int(seen[-1])
                led.on_end(tr)
        n = sum(k for f, k, _ in finishes if f <= t)
        ended = [d for f, _, d in finishes if t - S // 4 < f <= t]
        if latency:
            led.add_server_tokens(int(t), float(n - counted), prev, at_finish=True, finished=(len(ended), sum(ended)))
        else:
            led.add_server_tokens(int(t), float(n - counted), prev, at_finish=True)
        prev, counted = int(t), n
        led.advance(int(t))
    led.close_all(int(14.0 * S))
    return sink.rows["intervals"]


def test_a_counter_that_moves_when_requests_finish_takes_no_proxied_tokens_for_bypass():
    # SGLang counts a request's tokens when it finishes, seconds after the proxy saw them stream. Compared window by
    # window with the proxy's tokens as they came, the counter's jumps at the end of a busy stretch passed for bypass
    # traffic (this run: 96 of 200 proxied tokens; bench/attribution_mixed.py --flavour sglang, no bypass at all:
    # 11% of the requests' energy in unproxied, every kind 14% low).
    rows = _at_finish_run(0)
    assert sum(r["proxy_tokens"] for r in rows) == pytest.approx(200)
    assert sum(r["server_tokens"] or 0 for r in rows) <= 1.0
    assert sum(r["unproxied_energy_j"] for r in rows) <= 1.0


def test_a_counter_that_moves_when_requests_finish_still_finds_bypass_tokens():
    rows = _at_finish_run(30)
    assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(30, abs=1.0)
    assert sum(r["unproxied_energy_j"] for r in rows) > 0


def test_a_bypass_request_counted_at_its_end_is_spread_back_over_its_run():
    # SGLang counts a bypass request's tokens when it finishes: placed in the scrape window of its end, its tokens (and
    # the busy time they mark) were all in the interval from 9 s, none in 7-9 s, where it ran whole (measured before:
    # 0 of the 20 it made there; bench/attribution_accuracy.py --flavour sglang: unproxied 79-86% of the bypass
    # requests' true energy). The server's e2e latency histogram over the same scrape says how long the requests that
    # ended there ran, less the proxied ones' (the proxy timed them): the bypass request's 3 s.
    rows = _at_finish_run(30, latency=True)
    assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(30, abs=1.0)
    during = [r for r in rows if 7.0 <= r["t_start_mono_s"] and r["t_start_mono_s"] + r["duration_s"] <= 9.0 + 1e-9]
    assert len(during) == 2
    assert sum(r["server_tokens"] or 0 for r in during) >= 16, [(r["t_start_mono_s"], r["server_tokens"]) for r in rows]
    assert all(r["unproxied_energy_j"] > 0 for r in during)
    # Without the histogram (an SGLang without it, or unreadable) the window of its end, as before.
    rows = _at_finish_run(30)
    assert sum(r["server_tokens"] or 0 for r in rows if r["t_start_mono_s"] < 9.0) <= 1.0


def test_a_burst_held_past_the_prompt_hold_says_its_run_began_in_intervals_already_closed():
    # A buffering hop held a stream's whole answer longer than the intervals could wait for it: they closed without its
    # tokens (their energy went to idle here, to the requests beside it on a busy server) and its burst is spread over
    # the intervals still open only. Before: its row said only that it came in one burst, its figure low unsaid.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, prompt_hold_s=2.0)
    tr = _trace(1, 0.5)
    led.on_start(tr)
    for k in range(5):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    assert sink.rows["intervals"], "the prompt hold (2 s) should have let the first intervals close"
    closed_to_s = max(r["t_start_mono_s"] + r["duration_s"] for r in sink.rows["intervals"])
    t = int(4.5 * S)  # the whole answer at once, 4 s after its arrival
    tr.extra["deliveries"] = 1
    for k in range(100):
        tr.first_ns = tr.first_ns or t + k * 1000
        tr.last_ns = t + k * 1000
        tr.tokens_seen += 1
        led.on_tokens(tr, t + k * 1000, 1)
    tr.end_ns = t + 200_000
    tr.counts = Counts(generated_tokens=100, prompt_tokens=50, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    for k in range(5, 8):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert note.startswith("approximate:") and "one burst" in note, note
    assert f"{closed_to_s - 0.5:.1f} s of its run ran in intervals closed before its tokens came" in note, note
    assert "its own figure is low" in note and "proxy_buffering off" in note


def test_a_later_burst_held_past_the_prompt_hold_says_the_seconds_it_lost():
    # A stream's later burst held longer than the intervals could wait: the intervals from its previous piece on closed
    # without its tokens, and its 50 tokens were squeezed into those still open. Before: its row said only "2 bursts, up
    # to 3.5 s apart" (the lost second, [1 s, 2 s), unsaid, its figure low).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, prompt_hold_s=2.0)
    tr = _trace(1, 0.5)
    led.on_start(tr)
    for k in range(2):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    tr.first_ns = tr.last_ns = int(1.0 * S)  # 5 tokens (a sequence's flush: no first burst) at 1 s
    tr.tokens_seen = 5
    led.on_tokens(tr, int(1.0 * S), 5)
    for k in range(2, 5):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    closed_to_s = max(r["t_start_mono_s"] + r["duration_s"] for r in sink.rows["intervals"])
    assert closed_to_s >= 2.0, "the prompt hold (2 s) should have let the intervals to 2 s close"
    t = int(4.5 * S)  # the rest, 50 tokens, 3.5 s later
    tr.last_ns = t
    tr.tokens_seen += 50
    led.on_tokens(tr, t, 50)
    tr.end_ns = t + 200_000
    tr.counts = Counts(generated_tokens=55, prompt_tokens=50, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    for k in range(5, 8):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert note.startswith("approximate:") and "2 bursts" in note, note
    assert f"{closed_to_s - 1.0:.1f} s of its run ran in intervals closed before its tokens came" in note, note
    assert "its own figure is low" in note


def _held_stream(pieces, generated: int, late_s: float | None = None, predicted_ms: float | None = None,
                 extra: dict | None = None):
    """A stream arrived at 0.5 s, after three 1 Hz ticks, whose pieces (t_s, tokens) reach the proxy held back, the
    proxy's loop measured `late_s` late at each where given; then its end (what the proxy said of it: `extra`) and four
    more ticks. Its one row."""
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = _trace(1, 0.5)
    tr.extra.update(extra or {})
    led.on_start(tr)
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    for t_s, n in pieces:
        t = int(t_s * S)
        if late_s is not None:
            led.note_proxy_delay(t, late_s)
        _feed(led, t_s, 100.0 * t_s)
        tr.first_ns = tr.first_ns or t
        tr.last_ns = t
        tr.tokens_seen += n
        led.on_tokens(tr, t, n)
    tr.end_ns = tr.last_ns + 200_000
    tr.counts = Counts(generated_tokens=generated, prompt_tokens=50, model=None, stop_reason=None, token_source="usage",
                       predicted_ms=predicted_ms)
    led.on_end(tr)
    for k in range(4, 8):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    return sink


def test_a_small_burst_held_long_is_placed_as_no_more_events_than_its_tokens(monkeypatch):
    # A 3-token stream held back 100 s by a hop: spread at the pitch it was placed as 5000 events of 0.0006 token each
    # (right in sum; memory and the closes' CPU for nothing). As a first burst's: at most its tokens (2 at least).
    ks = []
    pace = Ledger._at_server_pace
    monkeypatch.setattr(Ledger, "_at_server_pace", lambda self, r, a, b, k, n: ks.append(k) or pace(self, r, a, b, k, n))
    _held_stream([(100.5, 3)], 3)
    assert ks == [3], ks


def test_a_first_burst_is_placed_from_the_decode_start_the_servers_timings_say():
    # llama.cpp's timings (`predicted_ms`) cover its whole decode, ending at its last token. A stream whose first piece
    # was a burst of 20 tokens at 3 s, the rest a burst at 5 s, decoded 4 s: from 1 s. Before: the start was taken
    # 4 s before the first burst's end (-1 s), clipped to its arrival (0.5 s), so the first burst was spread over its
    # queue and prefill too (a fifth of its tokens in [0, 1 s), where it generated none).
    sink = _held_stream(((3.0, 20), (5.0, 20)), 40, predicted_ms=4000.0)
    rows = {round(r["t_start_mono_s"]): r["proxy_tokens"] for r in sink.rows["intervals"]}
    assert rows[0] == pytest.approx(0.0, abs=0.01), rows  # queue and prefill: no token
    # The first burst over [1 s, 3 s] (its last event at 3 s itself, in the next interval), the second over (3 s, 5 s].
    assert rows[1] + rows[2] >= 19.0 - 0.01, rows
    assert sum(rows[k] for k in range(1, 6)) == pytest.approx(40.0, abs=0.01), rows  # 5 s itself in [5 s, 6 s)
    (row,) = sink.rows["requests"]
    assert "2 bursts" in row["energy_note"], row["energy_note"]



@pytest.mark.parametrize("late_s", [0.0, 2.5])
def test_bursts_read_while_the_proxys_own_loop_ran_late_say_so(late_s):
    # A stream in 2 bursts 2 s apart. Where the daemon measured the proxy's own event loop 2.5 s late while it ran
    # (a busy host: a loaded 2-core machine's daemon in front of a direct server said "something between the server
    # and the proxy buffers its streams", fix "point proxy.upstream at the server itself", which it was), the proxy
    # may have read the server's pieces late itself: the row and the log say that cause and its fix too.
    sink = _held_stream(((3.0, 20), (5.0, 20)), 40, late_s=late_s)
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert "2 bursts" in note and "proxy_buffering off" in note, note
    # Either way a busy host is named beside a hop, as nothing measured can rule it out (the server itself late, or
    # a stall of the proxy's between two of its measures); measured, the host's fix comes first.
    assert "busy host" in note and "CPU to spare" in note, note
    if late_s:
        assert "the proxy's own event loop ran up to 2.5 s late" in note and "(fix: give the daemon's host CPU" in note, note
    else:
        assert "own event loop" not in note and "(fix: point proxy.upstream" in note, note


def test_a_burst_the_servers_tool_call_parser_held_blames_no_buffering_proxy():
    # SGLang's deepseekv3 parser sends a call whole once it closes: its chunk's running count jumps (6 to 22) after a
    # silence, a second burst. The proxy saw that jump in a chunk carrying the call (tool_call_jumps): the server held
    # it, no hop. Before, the row said "held back between the server and the proxy: a buffering proxy or gateway" with
    # nginx's fix, sending its operator after a proxy that is not there.
    sink = _held_stream(((3.0, 6), (5.0, 16)), 22, extra={"tool_call_jumps": 1})
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert "2 bursts" in note and "tool-call parser held a call" in note, note
    assert "buffering proxy" not in note and "proxy_buffering off" not in note, note
    # Without that word from the proxy, the same bursts are a hop's, as before.
    (row,) = _held_stream(((3.0, 6), (5.0, 16)), 22).rows["requests"]
    assert "buffering proxy" in row["energy_note"] and "tool-call parser" not in row["energy_note"], row["energy_note"]


@pytest.mark.parametrize("paused_s", [1.5, 0.2])
def test_bursts_its_own_client_held_back_blame_no_buffering_hop(paused_s):
    # A client that read nothing for 20 s (a 4 KB receive buffer): the proxy, its writes to it waiting, stopped reading
    # the server (`_ClientSink._drain`), whose tokens then came in bursts. Its energy was right (-2%), but its row said
    # "held back between the server and the proxy: a buffering proxy or gateway" with nginx's fix. The proxy says how long
    # its upstream stood paused for the client (client_held_s): from half the hold on, the row names the client, and
    # that nothing is to fix for its energy.
    sink = _held_stream(((3.0, 20), (5.0, 20)), 40, extra={"client_held_s": paused_s})
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert "2 bursts" in note, note
    if paused_s >= 1.0:  # of a 2 s hold
        assert "held back by its own client" in note and "waited 1.5 s in all" in note, note
        assert "nothing to fix for its energy" in note and "its client's reading pace" in note, note
        assert "buffering proxy" not in note and "proxy_buffering off" not in note, note
    else:  # a short pause explains little of a 2 s hold: the hop's words, as before
        assert "held back by its own client" not in note and "buffering proxy" in note, note


def test_a_large_first_burst_holds_its_windows_until_its_end_though_small_pieces_follow():
    # A stream's first piece came held back (20 tokens generated over [1 s, 3 s), passed at 3 s), then it streamed a
    # token a piece. Its first burst is placed back at its end; the scrape windows from its arrival must wait until
    # then, or the server's count of the burst, ahead of the proxy's over [1 s, 3 s), passes for bypass traffic.
    # Before: the first small piece released the hold: the windows resolved with that count as bypass tokens (no
    # bypass ran), in rows that said `complete`.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    tr = _trace(1, 0.5)
    led.on_start(tr)
    gen = [1.0 + 0.1 * k for k in range(40)]  # the server's tokens, 10/s from 1 s to 4.9 s
    seen = [3.0 if g < 3.0 else g + 0.05 for g in gen]  # the first 20 held to 3 s, the rest streamed
    prev_t = None
    for k in range(1, 29):
        t = 0.25 * k
        for s_ in sorted({s_ for s_ in seen if t - 0.25 < s_ <= t}):  # one piece each instant
            ts, n = int(s_ * S), seen.count(s_)
            tr.first_ns = tr.first_ns or ts
            tr.last_ns = ts
            tr.tokens_seen += n
            led.on_tokens(tr, ts, n)
        if t == 5.0:
            tr.end_ns = int(4.96 * S)
            tr.counts = Counts(generated_tokens=40, prompt_tokens=50, model=None, stop_reason=None,
                               token_source="usage", predicted_ms=3950.0)
            led.on_end(tr)
        if t == int(t):
            _feed(led, t, 100.0 * t)
        count = float(sum(1 for g in gen if (prev_t if prev_t is not None else -1) < g <= t))
        led.add_server_tokens(int(t * S), count if prev_t is not None else 0.0,
                              int(prev_t * S) if prev_t is not None else None)
        prev_t = t
        led.advance(int((t + 0.01) * S))
    rows = sink.rows["intervals"]
    assert rows and max(r["t_start_mono_s"] for r in rows) >= 5.0, [(r["t_start_mono_s"]) for r in rows]
    bypass = sum((r["server_tokens"] or 0.0) for r in rows)
    unproxied_j = sum(r["unproxied_energy_j"] for r in rows)
    # Before: 7 bypass tokens, 43.75 J of the 500 J to unproxied. Now a token at most (the burst's 20 tokens placed as
    # 20 events from its decode's start to its end: a token's placement either side of a window edge).
    assert bypass <= 1.0 + 1e-9 and unproxied_j < 0.025 * sum(r["gpu_energy_j"] for r in rows), \
        [(r["t_start_mono_s"], r["server_tokens"], r["unproxied_energy_j"], r["server_count"]) for r in rows]


def _rapl(led, t_s, cpu_j):
    from powerprof.collectors.rapl import RaplReading

    led.add_rapl_sample(int(t_s * S), [RaplReading("package-0", "package", 0, cpu_j, None)])


def _one_request(led, t0_s, t1_s):
    """A request live over [t0, t1] decoding ten tokens, ended and counted."""
    tr = _trace(1, t0_s)
    led.on_start(tr)
    tr.first_ns = int((t0_s + 0.1) * S)
    for j in range(10):
        led.on_tokens(tr, int((t0_s + 0.1 + (t1_s - t0_s - 0.2) * j / 9) * S), 1)
    tr.last_ns, tr.end_ns = int((t1_s - 0.1) * S), int(t1_s * S)
    tr.counts = Counts(generated_tokens=10, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    return tr


def test_an_interval_waits_for_the_rapl_read_that_covers_its_end():
    # NVML and RAPL are read by two threads on one schedule: on a loaded host RAPL's tick may land just before NVML's,
    # and the read after the edge is a whole period later. Before, the interval closed 0.3 s past its edge anyway, its
    # CPU energy NaN, and the request in it had no cpu_energy_j unsaid (the busy-host test, xfail until the fix).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, rapl=True)
    watts = 40.0  # the package's truth: 40 J in each 1 s interval
    _one_request(led, 1.1, 1.9)
    for k in range(3):
        _rapl(led, k - 0.001, watts * (k - 0.001) + 500.0)
        _feed(led, k, 300.0 * k)
    led.advance(int(2.4 * S))  # the edge at 2 s is past its grace; RAPL's read after it is due at 2.999 s
    assert [r["cpu_energy_j"] for r in sink.rows["intervals"]] == [pytest.approx(watts)]
    assert sink.rows["requests"] == []  # held with its interval, not emitted without its CPU energy
    _rapl(led, 2.999, watts * 2.999 + 500.0)
    _feed(led, 3, 900.0)
    led.advance(int(3.4 * S))
    assert [r["cpu_energy_j"] for r in sink.rows["intervals"]] == [pytest.approx(watts)] * 2
    (row,) = sink.rows["requests"]
    assert 0 < row["cpu_energy_j"] <= watts and row["energy_note"] is None


def test_a_request_without_cpu_energy_says_why_once_rapl_reads_stop():
    # RAPL reads that stop (failing, or a host too loaded to read on time) hold the intervals a bounded time only; then
    # they close without CPU energy, and the request's empty cpu_energy_j is said, with the fix.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, rapl=True, rapl_hold_s=2.0)
    _one_request(led, 1.1, 1.9)
    _rapl(led, 0.0, 500.0)
    for k in range(6):
        _feed(led, k, 300.0 * k)
    led.advance(int(1.5 * S))
    assert sink.rows["intervals"] == []  # no RAPL read past 0 s yet: held
    led.advance(int(5.5 * S))
    assert sink.rows["intervals"] and all(r["cpu_energy_j"] is None for r in sink.rows["intervals"])
    (row,) = sink.rows["requests"]
    assert row["cpu_energy_j"] is None and row["gpu_energy_j"] > 0
    note = row["energy_note"]
    assert "cpu_energy_j" in note and "RAPL" in note and "fix:" in note
    assert led.totals.cpu_unknown_requests == 1


def test_without_rapl_an_empty_cpu_energy_needs_no_note():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _idle_measured(led)  # else its note says its intervals' idle time is in it (idle not yet measured)
    _one_request(led, 1.1, 1.9)
    for k in range(4):
        _feed(led, k, 300.0 * k)
    led.advance(int(3.5 * S))
    (row,) = sink.rows["requests"]
    assert row["cpu_energy_j"] is None and row["energy_note"] is None
    assert led.totals.cpu_unknown_requests == 0


# --- interval rows say why a figure is empty or partial (energy_note) ------------------------------------------------


def test_an_interval_without_cpu_energy_says_why_in_its_own_row():
    # Before: only request rows had energy_note. An interval whose RAPL reads stopped had a null cpu_energy_j and nothing
    # in the row said why (an interval with no request in it: nothing anywhere); without RAPL, the same null, unsaid.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, rapl=True, rapl_hold_s=2.0)
    _rapl(led, 0.0, 500.0)
    for k in range(6):
        _feed(led, k, 300.0 * k)
    led.advance(int(5.5 * S))
    rows = sink.rows["intervals"]
    assert rows and all(r["cpu_energy_j"] is None for r in rows)
    for r in rows:
        note = r.get("energy_note")
        assert note and note.startswith("CPU energy unknown") and "RAPL" in note and "fix:" in note, r
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)  # no RAPL on this host
    for k in range(3):
        _feed(led, k, 300.0 * k)
    led.advance(int(2.5 * S))
    rows = sink.rows["intervals"]
    assert rows and all(r["cpu_energy_j"] is None and "no RAPL" in (r.get("energy_note") or "") and
                        "fix:" in r["energy_note"] for r in rows), rows


def test_an_interval_a_gpu_gave_no_energy_for_says_why_and_a_whole_one_says_nothing():
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.3, rapl=True)
    for k in range(4):  # GPU 1 lost from 2 s on: no reading bounds the intervals after 1 s
        _rapl(led, k - 0.001, 500.0 + 40.0 * k)
        led.add_gpu_sample(int(k * S), int(k * S), [R(300.0 * k, 300.0), R(None, None) if k >= 2 else R(100.0 * k, 100.0)])
    _rapl(led, 4.001, 700.0)
    led.advance(int(3.5 * S))
    rows = sink.rows["intervals"]
    assert [r["gpu_energy_j"] is None for r in rows] == [False, True, True], rows
    assert rows[0]["energy_note"] is None, rows[0]  # every figure there, whole: nothing to say
    for r in rows[1:]:
        assert r["energy_note"].startswith("GPU energy unknown") and "this interval" in r["energy_note"], r
        assert "fix:" in r["energy_note"]


def test_interval_rows_say_a_low_server_count_with_its_fix():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True  # the server is scraped, but not read yet: its bypass traffic unknown
    for k in range(3):
        _feed(led, k, 300.0 * k)
    led.advance(int(2.5 * S))
    rows = sink.rows["intervals"]
    assert rows and all(r["server_count"] == "unread" and r["server_tokens"] is None for r in rows)
    for r in rows:
        assert "bypass-uncounted" in r["energy_note"] and "unread" in r["energy_note"], r
        assert "fix: start the server before the daemon" in r["energy_note"], r


def test_a_request_that_arrived_before_the_first_gpu_read_says_its_energy_before_it_was_not_counted():
    # The daemon reads NVML before its proxy listens; where that read fails, the first edge is the sampler's, and a
    # request that came before it lost the energy of its run up to there. Its row says so (before: nothing).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _one_request(led, 0.5, 1.9)
    for k in range(1, 4):
        _feed(led, k, 300.0 * k)
    led.advance(int(3.5 * S))
    (row,) = sink.rows["requests"]
    assert row["gpu_energy_j"] > 0
    note = row["energy_note"] or ""
    assert note.startswith("before-first-read:") and "0.50 s" in note and "not counted" in note and "fix:" in note, note
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _idle_measured(led)  # else its note says its intervals' idle time is in it (idle not yet measured)
    _feed(led, 0, 0.0)
    _one_request(led, 0.5, 1.9)
    for k in range(1, 4):
        _feed(led, k, 300.0 * k)
    led.advance(int(3.5 * S))
    (row,) = sink.rows["requests"]
    assert row["energy_note"] is None, row["energy_note"]  # read from before its arrival: whole


def test_a_streams_usage_surplus_over_chunks_already_closed_is_late_and_said_not_dropped():
    # A chat stream counted one token a chunk (10 chunks, 0.6-0.9 s), whose end came after the prompt hold had let the
    # intervals it ran in close (a client slow to read the usage chunk, a stalled worker): its `usage` says 30 tokens
    # (speculative decoding, 3 a chunk). No chunk is open to scale and its last is before the first open interval, so
    # the 20 more cannot be placed. Before: dropped in silence (attributed 10, error null, not counted late); now late
    # like any token placed before the open intervals: counted, and said on its row.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, prompt_hold_s=2.0)
    tr = _chat(1, 0.5, 400)
    led.on_start(tr)
    _feed(led, 0.0, 0.0)
    for k in range(10):
        t = int((0.6 + 0.03 * k) * S)
        tr.first_ns = tr.first_ns or t
        tr.last_ns = t
        tr.tokens_seen += 1
        led.on_tokens(tr, t, 1)
    for k in range(1, 5):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    assert sink.rows["intervals"], "the prompt hold (2 s) should have let the first intervals close"
    assert led.edges[0].t_ns > tr.last_ns, "its last chunk must fall before the first open interval"
    tr.end_ns = int(4.5 * S)
    tr.counts = Counts(generated_tokens=30, prompt_tokens=100, model=None, stop_reason=None, token_source="usage",
                       tokens_estimated=True)
    added = led.on_end(tr)
    for k in range(5, 7):
        _feed(led, float(k), 100.0 * k)
        led.advance(int((k + 0.2) * S))
    (row,) = sink.rows["requests"]
    assert added == 20  # the proxy's token count (tokens_by_tag) takes the server's, as where they are placed
    assert led.late_tokens == 20
    assert row["attributed_tokens"] == pytest.approx(10.0) and row["generated_tokens"] == 30
    assert "20 token(s) arrived after their interval had closed and were not attributed" in (row["error"] or ""), row
    # Two thirds of its tokens late: its 450 J over its 10 attributed (45 J/token) out of J/token, both readings said.
    assert f"{UNSURE_FLAG}: 20 of its 30 tokens (67%) arrived after the intervals" in row["energy_note"], row
    assert "45 J/token over its attributed tokens (high by the late ones), 15 over all its tokens" in row["energy_note"]


@pytest.mark.parametrize("gap_ns, said", [(5_000, None), (900_000, None), (1_100_000, "1.1 ms"), (50_000_000, "50.0 ms")])
def test_a_request_at_the_first_on_demand_read_is_not_before_it_but_one_past_the_bound_says_so(gap_ns, said):
    # The start's NVML read failed, and the first GPU edge is the on-demand read the request's own arrival started
    # (service._request_edge): dated at its counter call's middle, a few µs after the arrival stamp on the simulator.
    # Before: flagged before-first-read ("0.00 s"), its figures called low and left out of J/token for a few µs in which
    # the server had not yet begun on it. An arrival within FIRST_READ_SLACK_NS of the first edge counts as at it;
    # one further before still says so, with its gap.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    watts = 300.0
    edge_ns = int(0.5 * S) + gap_ns
    tr = _trace(1, 0.5)
    led.on_start(tr)
    led.add_gpu_edge(edge_ns, edge_ns, (watts * edge_ns / S,))
    tr.first_ns = int(0.6 * S)
    for j in range(10):
        led.on_tokens(tr, int((0.6 + 0.12 * j) * S), 1)
    tr.last_ns, tr.end_ns = int(1.8 * S), int(1.9 * S)
    tr.counts = Counts(generated_tokens=10, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    for k in range(1, 4):
        _feed(led, k, watts * k, watts)
    led.advance(int(3.5 * S))
    (row,) = sink.rows["requests"]
    assert row["gpu_energy_j"] > 0
    note = row["energy_note"]
    if said is None:
        assert note is None or "before-first-read" not in note, note
    else:
        assert note.startswith("before-first-read:") and f"arrived {said} before" in note, note


def test_multi_step_piece_kept_in_order_and_late_part_counted():
    """A stream's multi-step piece is spread over the time since its previous one (`PIECE_STEPS`); its events stay in
    time order behind one placed ahead of it, and the part of the spread before the first open interval is counted late,
    never dropped nor put in a closed interval (the ledger's quick path for the common case must fall back for these).
    Pieces 80 ms apart: under HELD_GAP_NS, not held bursts."""
    ms = 1_000_000
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.add_gpu_edge(0, 0, [0.0])
    led.recon.server_seen = True
    tr = _trace(1, 0.0)
    led.on_start(tr)
    led.on_tokens(tr, 100 * ms, 1)
    r = led.requests[1]
    r.ev_t.append(165 * ms)  # an event placed ahead (a restart's cut)
    r.ev_n.append(1.0)
    led.on_tokens(tr, 180 * ms, 4)  # spread over (100, 180] ms: three events before 165 ms
    assert r.ev_t == [100 * ms, 120 * ms, 140 * ms, 160 * ms, 165 * ms, 180 * ms]
    assert r.ev_n == [1, 1, 1, 1, 1, 1]
    assert [t for t, _ in led.recon.proxied] == [100 * ms, 120 * ms, 140 * ms, 160 * ms, 180 * ms]
    led.edges[0].t_ns = 230 * ms  # the intervals up to 230 ms closed meanwhile
    led.on_tokens(tr, 260 * ms, 4)  # spread over (180, 260] ms: 200 and 220 ms in closed intervals
    assert led.late_tokens == 2 and r.late == 2
    assert r.ev_t[-2:] == [240 * ms, 260 * ms] and sum(r.ev_n) == 8


def test_a_first_burst_held_seconds_is_not_blamed_on_a_proxy_loop_a_few_ms_late():
    # A stream whose first piece is a burst held since its decode began (30 tokens at 3 s, arrived at 0.5 s), then a
    # piece 50 ms after it (a hop's timer flush) and its end. The proxy's loop was measured 30 ms late meanwhile (a
    # loaded host, no more). The busy-host cause was judged against the 50 ms between its last pieces, not the 2.5 s
    # its first burst was held: the row said "the proxy's own event loop ran up to 0.0 s late ... a busy host", the
    # host's fix first, of a buffering hop's hold.
    sink = _held_stream(((3.0, 30), (3.05, 5)), 35, late_s=0.03)
    (row,) = sink.rows["requests"]
    note = row["energy_note"]
    assert "burst" in note and "proxy_buffering off" in note, note
    assert "own event loop" not in note, note
    assert note.index("proxy_buffering off") < note.index("CPU to spare"), note  # the hop's fix first


def test_a_flat_counter_beside_a_gpu_whose_counter_broke_still_says_which():
    # Two GPUs; GPU 0's counter did not move between the tick and the edge 30 ms later, and GPU 1's counter was reset
    # there (a driver reload: a new epoch), so GPU 1's part is integrated from power. The interval's method is then
    # power_integration (the weakest), and the note on GPU 0's 0 J was given only where every GPU took the counter: its
    # sum held none of GPU 0's energy, unmarked.
    from types import SimpleNamespace as NS

    def rd(e0, e1, ep1):
        return [NS(energy_j=e0, power_w=300.0, power_avg_w=None, power_limit_w=None, energy_epoch=0),
                NS(energy_j=e1, power_w=400.0, power_avg_w=None, power_limit_w=None, energy_epoch=ep1)]

    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    led.add_gpu_sample(0, 0, rd(1000.0, 5000.0, 0))
    led.add_gpu_sample(int(0.03 * S), int(0.03 * S), rd(1000.0, 3.0, 1))
    led.add_gpu_sample(S, S, rd(1300.0, 391.0, 1))
    led.advance(int(1.5 * S))
    flat = sink.rows["intervals"][0]
    assert flat["energy_method"] == "power_integration", flat
    assert "GPU 0" in (flat["energy_note"] or "") and "counter did not move" in flat["energy_note"], flat["energy_note"]


def test_a_request_queued_beside_another_where_its_prompt_could_be_placed_leaves_that_split_to_the_fixed_costs():
    # Request d (a 2000-token prompt) waits through c's decode; its first token comes at 4.25. Until the fit is mature
    # its prompt is placed at the default 10 000 tokens/s ([4.05, 4.25]): c, alone in its work in [3, 4), takes all of
    # it. At a rate of the documented range's slow end (thousands a second: 2000 tokens/s, [3.25, 4.25]) d's prefill
    # takes most of [3, 4): c's figure there rests on the fixed costs as much as on the 0.05 ratio, and its row must say
    # so (before 2b3880a it did: d was live beside it).
    from powerprof.daemon import attribution as attr

    t = np.array([3, 4, 5], dtype=np.int64) * S
    args = (t, np.array([100.0, 100.0]), np.array([int(3.1 * S), int(3.15 * S)]),
            np.array([int(3.2 * S), int(4.25 * S)]), np.array([int(3.9 * S), int(4.55 * S)]),
            np.array([int(3.95 * S), int(4.6 * S)]),
            np.array([int((3.2 + 0.1 * j) * S) for j in range(8)] + [int((4.25 + 0.1 * j) * S) for j in range(4)]),
            np.array([0] * 8 + [1] * 4), np.ones(12))
    fixed = attr.attribute(*args, prompt_tokens=np.array([0.0, 2000.0]), costs=attr.WorkCosts())
    slow = attr.attribute(*args, prompt_tokens=np.array([0.0, 2000.0]), costs=attr.WorkCosts(prefill_tok_s=2000.0))
    assert fixed.share[0, 0] == pytest.approx(1.0) and slow.share[0, 0] < 0.2  # c's share of [3, 4) rests on the rate
    assert fixed.ratio_split[0]
    # The range's ends hold the slow rate's split (1000 tokens/s: lower still than 2000's), and bound the one in use.
    assert fixed.share_lo[0, 0] <= slow.share[0, 0] and fixed.share_hi[1, 0] >= slow.share[1, 0] > 0.8
    assert np.all(fixed.share_lo <= fixed.share + 1e-12) and np.all(fixed.share <= fixed.share_hi + 1e-12)
    fitted = attr.attribute(*args, prompt_tokens=np.array([0.0, 2000.0]), costs=attr.WorkCosts(source="fitted"))
    assert fitted.share_lo is fitted.share and fitted.share_hi is fitted.share  # learned costs: no range to give

    rows = _queued_beside_rows(d_first_s=4.25, d_prompt=2000)
    assert "split among them by the fixed ratio" in (rows[3]["energy_note"] or ""), rows[3]["energy_note"]


def test_a_queued_prompt_given_little_by_the_fixed_ratio_says_how_much_more_the_range_would_give_it():
    # The same pair: d's 2000-token prompt is placed at the default 10 000 tokens/s ([4.05, 4.25]), so d takes none of
    # [3, 4) and all of [4, 5); c takes all of [3, 4). At the slow end of the rates (1000 tokens/s: [2.25, 4.25], from
    # its arrival at 3.15) d's prefill takes most of [3, 4). Before, d's row said nothing (none of its energy came from
    # an interval the ratio split): a figure that could be due ~+80% more, unsaid. Now both rows give the range: c's
    # figure down to about -80%, d's up to about +80%, each of its own energy (300 J an interval).
    import re

    rows = _queued_beside_rows(d_first_s=4.25, d_prompt=2000)
    ranges = {}
    for rid in (3, 4):
        note = rows[rid]["energy_note"] or ""
        assert "split among them by the fixed ratio" in note, (rid, note)
        m = re.search(r"at a prompt token of 0\.01-0\.1 of a decoded token, prefilled at 1000-10000 tokens/s, its "
                      r"figure would be ([+-]\d+)% to ([+-]\d+)%", note)
        assert m, (rid, note)
        ranges[rid] = int(m[1]), int(m[2])
    assert ranges[3][0] <= -60 and ranges[3][1] == 0, ranges  # c: all of [3, 4), at most ~20% of it at the slow rate
    assert ranges[4][0] == 0 and ranges[4][1] >= 60, ranges  # d: none of [3, 4), up to ~80% of it more
    assert rows[4]["energy_note"].startswith("approximate: none of its GPU energy is from intervals other requests did "
                                               "work in (or bypass traffic did), where its prompt may have been "
                                               "prefilled, split among them by the fixed ratio"), rows[4]["energy_note"]


def test_the_fixed_ratio_note_never_says_none_of_a_share_it_was_given():
    # A request given 0.3% of its energy from ratio-split intervals (its prompt's fast placement only grazing one),
    # which the range's other end gives 20% more: its row said "none of its GPU energy is from intervals other requests
    # did work in" (pct < 0.5 chose that lead), a false "none". And a range's end a hair below its figure read "-0%".
    from powerprof.daemon.liverequest import LiveRequest
    from powerprof.daemon.rowtext import _approximate_note

    r = LiveRequest(_trace(1, 0.0), gpu_j=100.0, fixed_j=0.3, fixed_lo_j=0.1, fixed_hi_j=20.3, fixed_why="no fit yet")
    note = _approximate_note(r) or ""
    assert "split among them by the fixed ratio" in note, note
    assert "none of its GPU energy" not in note, note
    assert "under 1% of its GPU energy is from intervals other requests did work in too" in note, note
    assert "its figure would be +0% to +20%" in note, note
    # Given none there: "none" holds.
    r = LiveRequest(_trace(2, 0.0), gpu_j=100.0, fixed_j=0.0, fixed_lo_j=0.0, fixed_hi_j=20.0, fixed_why="no fit yet")
    assert "none of its GPU energy is from intervals other requests did work in" in (_approximate_note(r) or "")


def test_the_fixed_ratio_range_says_it_bounds_two_costs_not_the_error():
    # The range is the row's figure over the prompt token's cost and the prefill rate alone. Short answers beside 4 long
    # streams decoding (the simulated vLLM, fit not mature) read +37% where it said -1% to +0%, +131% where it said -49%
    # to +36%; after the whole-answer placement fix 24 of 124 rows still lay outside it, 23 high: the context cost the
    # ratio leaves out (a long stream's token costs more) moves a figure further, by nothing bounded here. The row says
    # so, and which way: a shorter context than those beside it reads high.
    from powerprof.daemon.liverequest import LiveRequest
    from powerprof.daemon.rowtext import _approximate_note

    r = LiveRequest(_trace(1, 0.0), gpu_j=100.0, fixed_j=100.0, fixed_lo_j=99.0, fixed_hi_j=100.0, fixed_why="no fit yet")
    note = _approximate_note(r) or ""
    assert "its figure would be -1% to +0% over those two alone" in note, note
    assert "no bound on its error" in note, note
    assert "a request of shorter context than those beside it reads high, of longer low" in note, note


def test_requests_flagged_best_of_unseen_and_count_open_are_counted_as_their_rows_say_it():
    # Their rows said so and /metrics had no count of them (other flags, prefix-cache-unsaid say, had one): a dashboard
    # could not see how many requests' figures were low.
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.metrics import Snapshot, make_registry, render
    from powerprof.storage.schema import BEST_OF_FLAG, COUNT_OPEN_FLAG

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _idle_measured(led)  # else all three are uncertain-uncounted too (idle not yet measured), which is not counted here
    bo, op, plain = _trace(1, 0.1), _trace(2, 0.1), _trace(3, 0.1)
    bo.extra.update(best_of=3, choices=1)
    for tr in (bo, op, plain):
        led.on_start(tr)
    for k in range(4):
        _feed(led, k, 100.0 * k)
    for tr in (bo, op, plain):
        for j in range(10):
            led.on_tokens(tr, int((0.2 + 0.2 * j) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = int(0.2 * S), int(2.0 * S), int(2.1 * S)
        tr.counts = Counts(generated_tokens=10, prompt_tokens=10, model=None, stop_reason="stop", token_source="usage",
                           count_open=tr is op)
        led.on_end(tr)
    led.advance(int(3.5 * S))
    rows = {r["request_id"]: r["energy_note"] or "" for r in sink.rows["requests"]}
    assert f"{BEST_OF_FLAG}: " in rows[1] and f"{COUNT_OPEN_FLAG}: " in rows[2], rows
    assert BEST_OF_FLAG not in rows[3] and COUNT_OPEN_FLAG not in rows[3], rows
    none = render(make_registry(type("H", (), {"snapshot": Snapshot()}))).decode()
    assert "powerprof_requests_best_of_unseen_total 0.0" in none and "powerprof_requests_count_open_total 0.0" in none
    assert {f: n for f, n in led.totals.flagged_requests.items() if n} == {BEST_OF_FLAG: 1, COUNT_OPEN_FLAG: 1}
    text = render(make_registry(type("H", (), {"snapshot": Snapshot(flagged_requests=led.totals.flagged_requests)})))
    got = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert got["powerprof_requests_best_of_unseen_total"] == 1 and got["powerprof_requests_count_open_total"] == 1


def test_the_serving_gpus_energy_in_the_totals_is_the_same_whether_a_gpu_serving_nothing_reads_or_not():
    # The tuner's energy is the requests' and idle energy less that of the GPUs serving none of the work
    # (Totals.idle_not_serving_j, powerprof_gpu_idle_energy_not_serving_joules_total): GPU 1 lost from request 30 on
    # must not move it. Before, no total told the two apart, and the tuner's figure fell with GPU 1's energy.
    whole = _server_on_gpu0_gpu1_idle()
    sink = _server_on_gpu0_gpu1_idle(lose_gpu1_at=30)

    def serving(led):
        t = led.totals
        return t.energy_by_dest_j[0] + t.energy_by_dest_j[1] - t.idle_not_serving_j

    assert 0 < whole.ledger.totals.idle_not_serving_j <= whole.ledger.totals.gpu_energy_j[1] + 1e-9
    assert sink.ledger.totals.idle_not_serving_j < whole.ledger.totals.idle_not_serving_j - 10 * 70.0 + 1e-6
    assert serving(sink.ledger) == pytest.approx(serving(whole.ledger), rel=1e-9)


def test_a_gpus_energy_total_comes_back_where_it_stopped_plus_the_energy_read_since():
    # powerprof_gpu_energy_joules_total (Totals.gpu_energy_j) goes while a GPU is unread and comes back: never reset
    # (below the value before the loss, a rate() would take it for a counter reset) and never holding the unread time's
    # energy. GPU 1 reads 100 J a second, unread at the edges 2 s and 3 s, read again from 4 s.
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    for k in range(2):
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(100.0 * k, 100.0)])
    led.advance(int(1.5 * S))
    before = led.totals.gpu_energy_j[1]
    assert before == pytest.approx(100.0) and not led.totals.gpu_unread_now[1]
    for k in (2, 3):
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(None, None)])
    led.advance(int(3.5 * S))
    assert led.totals.gpu_unread_now[1] and led.totals.gpu_energy_j[1] == pytest.approx(before)
    for k in (4, 5, 6):
        led.add_gpu_sample(k * S, k * S, [R(100.0 * k, 100.0), R(100.0 * k, 100.0)])
    led.advance(int(6.5 * S))
    back = led.totals.gpu_energy_j[1]
    assert not led.totals.gpu_unread_now[1]
    # Read since: 4-5 s and 5-6 s (3-4 s has no reading at 3 s): 200 J on top of where it stopped, not the counter's
    # 500 J across the gap.
    assert back >= before and back - before == pytest.approx(200.0)
    assert led.totals.gpu_unknown_s[1] == pytest.approx(3.0)


def test_a_request_row_is_counted_by_its_flags_decided_not_by_words_a_client_put_in_its_note():
    # A client's POST to a path of its own choosing ("/v1/x/count-open: y") is a request the proxy does not count: its
    # row's note, and the notes of the requests live beside it, quote that path. Before, the flag counters counted rows
    # whose note held "count-open: ", so each of those rows counted as count-open though none was.
    from powerprof.storage.schema import COUNT_OPEN_FLAG

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    odd = RequestTrace(2, "POST", f"/v1/x/{COUNT_OPEN_FLAG}: y", None, int(0.1 * S), 0, api=None, stream=None,
                       status=200)
    plain = _trace(1, 0.1)
    for tr in (plain, odd):
        led.on_start(tr)
    for k in range(4):
        _feed(led, k, 100.0 * k)
    for j in range(10):
        led.on_tokens(plain, int((0.2 + 0.2 * j) * S), 1)
    plain.first_ns, plain.last_ns, plain.end_ns = int(0.2 * S), int(2.0 * S), int(2.1 * S)
    plain.counts = Counts(generated_tokens=10, prompt_tokens=10, model=None, stop_reason="stop", token_source="usage")
    led.on_end(plain)
    odd.end_ns = int(2.1 * S)
    led.on_end(odd)
    led.advance(int(3.5 * S))
    notes = [r["energy_note"] or "" for r in sink.rows["requests"]]
    # The client's path is quoted (its row's note and its neighbours'), through schema.outside_text: never a flag in it
    # (before, "count-open: " was in both notes, a flag analyze or a reader could take for the daemon's).
    assert any("/v1/x/count?open: y" in n for n in notes) and not any(COUNT_OPEN_FLAG in n for n in notes), notes
    assert led.totals.flagged_requests[COUNT_OPEN_FLAG] == 0


@pytest.mark.parametrize("held_tail,slow_client", [(True, False), (False, False), (True, True)])
def test_a_held_calls_tokens_are_placed_from_its_last_chunk_to_its_end_and_only_its(held_tail, slow_client):
    # Two streams over one 1 s interval (200 J): A, 10 tokens to its end; B, 2 tokens in chunks, then a final count of
    # 100. Where the count passed its running counts by a tool call the server's parser held (Counts.held_tail:
    # arrival.held_call_at_limit), its 98 other tokens were decoded from its last chunk (1.09 s) to its end (1.89 s)
    # and take their share there: B 100 tokens, 233 J. A count that is no held call is placed nowhere by that rule (the
    # proxy flags it): A keeps its energy. Before, a count at the request's limit was placed whatever said it was held,
    # so a liar's count moved A's energy (230 J -> 66.7 J).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = (RequestTrace(rid, "POST", "/v1/chat/completions", "t", int(s * S), 0, api="openai-chat", stream=True)
            for rid, s in ((1, 0.1), (2, 0.2)))
    for t in (a, b):
        t.extra["max_tokens"] = 100
        led.on_start(t)
    led.add_gpu_sample(0, 0, [R(1000.0, 200.0)])
    led.add_gpu_sample(S, S, [R(1100.0, 200.0)])
    for k in range(10):
        t = int((1.0 + 0.09 * k) * S)
        led.on_tokens(a, t, 1)
        a.tokens_seen += 1
        if k < 2:
            led.on_tokens(b, t, 1)
            b.tokens_seen += 1
    a.first_ns = b.first_ns = S
    a.last_ns, b.last_ns = int(1.81 * S), int(1.09 * S)
    a.end_ns, b.end_ns = int(1.9 * S), int(1.89 * S)
    if slow_client:
        # Its client read the end 1.6 s after the upstream sent it (proxy._held_end): placed to the upstream's end,
        # as above; to the client's, half its held tokens fell after the server had finished it.
        b.extra["held_end_ns"], b.end_ns = b.end_ns, int(3.49 * S)
    a.counts = Counts(10, 100, None, "stop", "usage")
    b.counts = Counts(100, 100, None, "length", "usage", choice_stops={0: "length"}, held_tail=held_tail)
    led.on_end(b)
    led.on_end(a)
    led.add_gpu_sample(2 * S, 2 * S, [R(1300.0, 200.0)])
    led.add_gpu_sample(3 * S, 3 * S, [R(1300.0, 0.0)])
    led.add_gpu_sample(4 * S, 4 * S, [R(1300.0, 0.0)])
    led.advance(int(4.2 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    # Its row says its 98 tokens' timing was inferred (HELD_TAIL_FLAG, counted on /metrics), the count kept; A's not.
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.metrics import Snapshot, make_registry, render
    from powerprof.storage.schema import HELD_TAIL_FLAG

    text = render(make_registry(type("H", (), {"snapshot": Snapshot(flagged_requests=led.totals.flagged_requests)})))
    metric = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert HELD_TAIL_FLAG not in (got[1]["energy_note"] or "")
    if held_tail:
        assert got[2]["attributed_tokens"] == pytest.approx(100)
        assert got[1]["gpu_energy_j"] == pytest.approx(200 / 3, rel=0.01) and got[2]["gpu_energy_j"] == pytest.approx(700 / 3, rel=0.01)
        assert f"{HELD_TAIL_FLAG}: 98 of its 100 generated tokens" in (got[2]["energy_note"] or ""), got[2]["energy_note"]
        # The count is the server's over every sequence (n > 1: their sum), not "its max_tokens" as it said before.
        assert "summed over its sequences" in got[2]["energy_note"] and "its max_tokens)" not in got[2]["energy_note"]
        assert metric["powerprof_requests_held_tail_total"] == 1
    else:
        assert HELD_TAIL_FLAG not in (got[2]["energy_note"] or "") and metric["powerprof_requests_held_tail_total"] == 0
        assert got[2]["attributed_tokens"] == pytest.approx(2)
        assert got[1]["gpu_energy_j"] == pytest.approx(230, rel=0.01), got[1]["gpu_energy_j"]


def test_the_first_judgement_of_which_gpus_serve_is_counted_and_exposed():
    # Until the daemon judges which GPUs serve, every GPU's energy is the work's; the judgement (GPU 1 serves none)
    # moves GPU 1's idle energy out of the serving GPUs' figure the tuner weighs levels by. Before: nothing on /metrics
    # said so, and the tuner weighed windows on the two sides (and levels judged on them) against each other.
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.metrics import Snapshot, make_registry, render

    led = _server_on_gpu0_gpu1_idle().ledger
    assert led.totals.serving_changes == 1  # all → GPU 0 alone, counted once, not once per batch of intervals
    text = render(make_registry(type("H", (), {"snapshot": Snapshot(serving_changes=led.totals.serving_changes)})))
    got = {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert got["powerprof_gpu_serving_changes_total"] == 1


def test_which_gpus_serve_is_exposed_per_gpu_so_a_change_is_told_by_gpu():
    # The count alone said a GPU's energy came into or left the serving GPUs' figure, not which: the tuner's rows could
    # not name it. Each GPU's series now says whether its energy is the work's (every one's before the judgement).
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.metrics import GpuSnapshot, Snapshot, make_registry, render

    assert Ledger("d", 0, 2, Sink()).totals.serving_mask is None  # not judged: every GPU's energy is the work's
    led = _server_on_gpu0_gpu1_idle().ledger
    assert led.totals.serving_mask == (True, False)
    gpus = tuple(GpuSnapshot(k, f"GPU-{k}", "fake", None, None, None, None, 0.0, serving=on)
                 for k, on in enumerate(led.totals.serving_mask))
    text = render(make_registry(type("H", (), {"snapshot": Snapshot(gpus=gpus)})))
    got = {(s.labels["gpu"], s.labels["gpu_uuid"]): s.value for f in text_string_to_metric_families(text.decode())
           for s in f.samples if s.name == "powerprof_gpu_serving"}
    assert got == {("0", "GPU-0"): 1.0, ("1", "GPU-1"): 0.0}


def test_intervals_of_unread_traffic_closed_after_the_unread_state_ends_still_say_proxy_unread():
    # The unread state ended (a new worker life spoke the daemon's shape) before the ledger closed the intervals it
    # covered: with only a start kept (proxy_unread_since_ns, copied before each advance), the intervals 1-2 s and
    # 2-3 s closed after it was None and said `off`, their unread traffic's energy idle, unsaid. The ended spans are
    # kept (proxy_unread_spans, the workers' own: ProxyWorkers.unread_spans) and every interval overlapping one says so.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = False
    for k in range(5):
        led.add_gpu_sample(k * S, k * S, [R(1000.0 + 100 * k, 100.0)])
    led.proxy_unread_since_ns = int(1.5 * S)
    led.advance(int(2.2 * S))
    led.proxy_unread_since_ns = None
    led.proxy_unread_spans = ((int(1.5 * S), int(2.6 * S)),)  # as the daemon copies them (service.py)
    led.advance(int(4.5 * S))
    got = [r["server_count"] for r in sink.rows["intervals"]]
    assert got == ["off", "off,proxy_unread", "off,proxy_unread", "off"], got


@pytest.mark.parametrize("scraping,since_s,want", [(False, 1.5, "off,proxy_unread"), (False, None, "off"),
                                                    (True, 1.5, "proxy_unread,unread")])
def test_intervals_while_a_proxy_worker_serves_unread_say_so_where_its_traffic_reads_as_idle(scraping, since_s, want):
    # powerprof upgraded under the daemon: the last proxy worker serves on, its records unread (workers._upgraded). With
    # no server token counter (scrape off, or not read yet) its requests' energy was idle, said nowhere: the log and
    # docs said bypass (`unproxied`). Now the intervals closed since say proxy_unread, left out of J/token, with the fix.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = scraping
    led.proxy_unread_since_ns = None if since_s is None else int(since_s * S)
    for k in range(4):
        led.add_gpu_sample(k * S, k * S, [R(1000.0 + 100 * k, 100.0)])
    led.advance(int(3.5 * S))
    rows = sink.rows["intervals"]
    assert [r["server_count"] for r in rows] == [("off" if not scraping else "unread")] + [want] * 2, rows
    if since_s is not None:
        assert all(r["kind"] == "idle" and "restart the daemon" in r["energy_note"] for r in rows[1:]), rows


def test_a_buffering_proxy_in_front_of_a_call_streamed_two_tokens_a_chunk_is_still_named():
    # A call streamed at 2 tokens a chunk (speculative decoding) behind a buffering nginx that delivered it in 3 pieces
    # 2 s apart: every tool-call chunk carried 2 tokens, and each counted as a parser's "jump", so the row read "the
    # server's tool-call parser held a call ... nothing to fix" and the warning was suppressed, where nginx buffered
    # (fix: proxy_buffering off). A jump is a running count past the stream's usual step now (stream._State.max_step).
    from powerprof.workload.stream import StreamParser
    from test_stream_parser import _CHAT, _compact, _tool_chunk

    def u(n):
        return {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}
    data = _compact(_tool_chunk("", u(2), name="f"), *[_tool_chunk("x", u(4 + 2 * k)) for k in range(20)],
                    {**_CHAT, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                    {**_CHAT, "choices": [], "usage": u(42)}, b"[DONE]")
    p = StreamParser("openai-chat")
    assert sum(e.n_tokens for e in p.feed(data)) == 42
    sink = _held_stream(((1.0, 14), (3.0, 14), (5.0, 14)), 42, extra={"tool_call_jumps": p.tool_call_jumps})
    (row,) = sink.rows["requests"]
    assert "buffering proxy" in row["energy_note"] and "tool-call parser" not in row["energy_note"], row["energy_note"]


def _sglang_cut_at_its_limit(whole: bool) -> dict:
    """A neighbour stream of 200 tokens at 40 tok/s beside a request of max_tokens 4 whose client left: a stream that
    had shown all 4 (before the usage chunk), or a whole answer; the ledger told SGLang's run-on delays. Its row."""
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (2.0, 4.0)

    def chat(rid, a, stream, **extra):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=stream)
        tr.extra.update(prompt_chars=400, **extra)
        return tr

    nb, cut = chat(1, 0.0, True), chat(2, 0.5, not whole, max_tokens=4)
    led.on_start(nb)
    led.on_start(cut)
    for k in range(200):
        led.on_tokens(nb, int((0.1 + 0.025 * k) * S), 1)
    nb.first_ns, nb.last_ns = int(0.1 * S), int((0.1 + 0.025 * 199) * S)
    if whole:
        cut.end_ns = int(0.6 * S)
    else:
        for k in range(4):
            led.on_tokens(cut, int((0.6 + 0.025 * k) * S), 1)
        cut.first_ns, cut.last_ns, cut.end_ns = int(0.6 * S), int(0.675 * S), int(0.68 * S)
    cut.outcome = "client_disconnected"
    led.on_end(cut)
    nb.end_ns, nb.outcome = int(5.1 * S), "ok"
    nb.counts = Counts(generated_tokens=200, prompt_tokens=100, model=None, stop_reason="length", token_source="usage")
    led.on_end(nb)
    e = 0.0
    for k in range(60):
        e += 100.0 * 0.1
        led.add_gpu_sample(int(k * 0.1 * S), int(k * 0.1 * S), [R(e, 100.0)])
    led.advance(int(9 * S))
    led.close_all(int(10 * S))
    (row,) = [r for r in led.emit.rows["requests"] if r["request_id"] == 2]
    return row


def test_a_request_that_had_all_its_max_tokens_is_not_said_to_have_run_on_for_seconds():
    # The review: a stream that had shown all of its max_tokens when its client left (the server had finished it) was
    # said "the server ran on about 2.0 s after its client left … no pace to decode it at", and a whole answer of
    # max_tokens 4 "ran on about 3.9 s" with 4 tokens placed.
    stream = _sglang_cut_at_its_limit(whole=False)
    assert "ran on" not in (stream["energy_note"] or ""), stream["energy_note"]
    whole = _sglang_cut_at_its_limit(whole=True)
    note = whole["energy_note"] or ""
    assert "until its max_tokens (4) were decoded, about 0.0 s" in note and "ran on about 3" not in note, note


def _sglang_batch_slows_after_cut() -> dict:
    """Four streams decode at 40 tokens/s to 1.1 s, then at 20 (prefills joined) to 4.1 s; stream 9 showed 41 tokens (to
    1.1 s), stream 10, from 1.0 s, one (at 1.1 s), their clients leaving at 1.12 and 1.15 s: SGLang decodes each on for
    2 s, about 40 tokens, 300 W throughout. The rows by request id."""
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (2.0, 4.0)

    def chat(rid, a):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=True)
        tr.extra.update(prompt_chars=400, max_tokens=2000)
        return tr

    nbs, cut, one = [chat(k, 0.0) for k in range(1, 5)], chat(9, 0.0), chat(10, 1.0)
    for tr in (*nbs, cut, one):
        led.on_start(tr)
    step_s = [0.025] * 40 + [0.05] * 60  # a token a step a sequence: 40 tokens/s, then 20 from 1.1 s
    nb_ts = list(np.cumsum([0.1, *step_s]))
    events = [(t, tr) for tr in nbs for t in nb_ts] + [(t, cut) for t in nb_ts[:41]] + [(1.1, one)]
    leaves = {cut.request_id: 1.12, one.request_id: 1.15}
    e, k = 0.0, 0
    for t, tr in sorted(events, key=lambda x: (x[0], x[1].request_id)):
        while k * 0.1 <= t:  # the GPU at 300 W, sampled every 0.1 s, the ledger advancing as the daemon's does
            led.add_gpu_sample(int(k * 0.1 * S), int(k * 0.1 * S), [R(e, 300.0)])
            led.advance(int(k * 0.1 * S))
            e, k = e + 30.0, k + 1
        for c in (cut, one):
            if c.end_ns is None and leaves[c.request_id] <= t:
                c.end_ns, c.outcome = int(leaves[c.request_id] * S), "client_disconnected"
                led.on_end(c)
        tr.first_ns = tr.first_ns or int(t * S)
        tr.last_ns = int(t * S)
        tr.tokens_seen += 1
        led.on_tokens(tr, int(t * S), 1)
    for tr in nbs:
        tr.end_ns, tr.outcome = int(4.11 * S), "ok"
        tr.counts = Counts(generated_tokens=101, prompt_tokens=100, model=None, stop_reason="length",
                           token_source="usage")
        led.on_end(tr)
    for j in range(k, 60):
        led.add_gpu_sample(int(j * 0.1 * S), int(j * 0.1 * S), [R(e, 300.0)])
        led.advance(int(j * 0.1 * S))
        e += 30.0
    led.close_all(int(6 * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


def test_a_stream_sglang_runs_on_decodes_at_its_batchs_pace_not_its_own():
    # cut_accuracy (SGLang, H200): a stream cut after 41 tokens ran on at its own pace, read over those 41, which ran
    # ahead of the batch it decoded in once other prompts' prefills joined it: +38% to +76%. One cut after one token
    # before any stream had finished had no pace at all ("no pace to decode it at").
    rows = _sglang_batch_slows_after_cut()
    # 2 s at 20 tokens/s beside its 41 (before: 81 more at its own 40 tokens/s) and beside its one (before: none).
    assert rows[9]["attributed_tokens"] == pytest.approx(41 + 40, rel=0.1), rows[9]
    assert rows[10]["attributed_tokens"] == pytest.approx(1 + 41, rel=0.1), rows[10]
    for rid in (9, 10):
        note = rows[rid]["energy_note"]
        assert "at its batch's (the 4 streams shown beside it then) pace" in note, note
        # Not "until its max_tokens (2000) were decoded": its placed span, rounded down to the nanosecond, read as ended
        # short of the abort by its max_tokens (2 of 4 such streams in a cut_accuracy run, 1 of 4 whole answers).
        assert "until its max_tokens" not in note and "the server ran on about 2.0 s" in note, note
    # Its energy: 300 W split among the 5 streams decoding to 1.1 s, then the 6 to its abort at 3.12 s (each a token a
    # step). Before: 267 J (+60%), its 81 own-pace tokens against the 40 of each stream beside it.
    assert rows[9]["gpu_energy_j"] == pytest.approx(300.0 * (1.1 / 5 + 2.02 / 6), rel=0.1), rows[9]


def test_a_request_sglang_ran_on_for_seconds_is_no_counter_short_request():
    # Its client there 0.15 s, but its figure holds the 2 s the server ran it on (the split's intervals over 2.15 s):
    # before, its row said "counter-short: live 0.15 s, under 0.5 s … good to about a refresh of the GPU's power at
    # each of its edges, not to a percentage (1-3 token requests alone … -96% to +147%)", and counted the flag.
    rows = _sglang_batch_slows_after_cut()
    assert "counter-short" not in rows[10]["energy_note"], rows[10]["energy_note"]


def test_a_run_on_that_may_have_ended_by_itself_is_flagged_uncertain_one_that_cannot_is_not():
    # SGLang runs a cut stream on to its abort 2 s on, or its max_tokens, or its answer's own end (its end of text),
    # which no one sees. The simulator's scene (24 streams ending by themselves after 16-63 tokens beside 4 cut after
    # 5): the cut rows placed 68-90 run-on tokens for the truth's 11-56 (one 228 J for 73), unflagged. Its body says
    # whether it could end first: without ignore_eos (nor min_tokens reaching the abort) its row is uncertain-uncounted
    # (analyze leaves it out of J/token), both readings said; with ignore_eos, or min_tokens past the abort, it is sure,
    # its figure the same (the review's fault: a stream that could not end placed at others' mean, -33% to -49%).
    steps = lambda t0, n: [t0 + 0.025 * i for i in range(n)]  # a token a step a sequence, 40 tokens/s
    beside = [(k, 0.0, steps(0.1, 197), 5.0, False, 400) for k in range(1, 5)]
    cut = (9, 1.0, steps(1.1, 9), 1.31, True, 400)
    got = {}
    for name, extra in (("plain", {}), ("ignore_eos", {"eos_ignored": True}), ("min_tokens", {"min_tokens": 200}),
                        ("short min_tokens", {"min_tokens": 40})):
        led_rows, led = _sglang_scene([*beside, cut], stop_s=7.0, extra={9: extra}, ledger=True)
        got[name] = (led_rows[9], led.flagged_requests.get(UNSURE_FLAG, 0))
    row, flagged = got["plain"]
    note = row["energy_note"]
    # 2 s at 40 tokens/s: 80 tokens placed beside its 9, the most it ran on.
    assert row["attributed_tokens"] == pytest.approx(9 + 80, rel=0.05), row
    assert UNSURE_FLAG in note and "may have ended by itself" in note and "from 0 to 80 tokens" in note, note
    assert flagged == 1
    for name in ("ignore_eos", "min_tokens"):
        sure, flagged = got[name]
        assert UNSURE_FLAG not in sure["energy_note"] and flagged == 0, (name, sure["energy_note"])
        assert sure["gpu_energy_j"] == pytest.approx(row["gpu_energy_j"]), name
        assert sure["attributed_tokens"] == pytest.approx(row["attributed_tokens"]), name
    short, flagged = got["short min_tokens"]
    assert "from 31 (its min_tokens' rest) to 80 tokens" in short["energy_note"] and flagged == 1, short["energy_note"]


def _sglang_scene(streams, stop_s: float = 6.0, told: bool = False, extra: dict | None = None, ledger: bool = False):
    """Streams (request id, arrival s, its chunks' times, its end s, whether its client left then, max_tokens) on a GPU
    at 300 W sampled every 0.1 s, the ledger told SGLang's run-on delays and advancing as the daemon's does, shut down
    (close_all) at stop_s: nothing after it happens. `told`: each stream says its prompt's length at its start
    (continuous usage); `extra`: more of a request's body as the proxy read it, by request id. The rows by request id
    (and the ledger, where `ledger`)."""
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (2.0, 4.0)
    events = []
    for rid, a, ts, end, left, limit in streams:
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=True)
        tr.extra.update(prompt_chars=400, max_tokens=limit, **(extra or {}).get(rid, {}))
        if told:
            tr.extra["prompt_tokens"] = 100
        events += [(a, 0, tr, left), *((t, 1, tr, left) for t in ts), (end, 2, tr, left)]
    e, k = 0.0, 0

    def to(t):
        nonlocal e, k
        while k * 0.1 <= t:
            led.add_gpu_sample(int(k * 0.1 * S), int(k * 0.1 * S), [R(e, 300.0)])
            led.advance(int(k * 0.1 * S))
            e, k = e + 30.0, k + 1

    for t, kind, tr, left in sorted(events, key=lambda x: (x[0], x[1], x[2].request_id)):
        if t > stop_s:
            break
        to(t)
        if kind == 0:
            led.on_start(tr)
        elif kind == 1:
            tr.first_ns = tr.first_ns or int(t * S)
            tr.last_ns = int(t * S)
            tr.tokens_seen += 1
            led.on_tokens(tr, int(t * S), 1)
        else:
            tr.end_ns, tr.outcome = int(t * S), "client_disconnected" if left else "ok"
            if not left:
                tr.counts = Counts(generated_tokens=int(tr.tokens_seen), prompt_tokens=100, model=None,
                                   stop_reason="length", token_source="usage")
            led.on_end(tr)
    to(stop_s)
    led.close_all(int(stop_s * S))
    rows = {r["request_id"]: r for r in led.emit.rows["requests"]}
    return (rows, led) if ledger else rows


_STEPS_40 = [0.1 + 0.025 * i for i in range(41)]  # a token a step a sequence, 40 tokens/s, to 1.1 s


def test_streams_cut_together_run_on_at_their_batchs_pace_not_a_step_over_microseconds():
    # The review (f_masscut.py): a load generator stopped, 16 streams decoding together at 40 tokens/s, each one's
    # chunk written 0.05 ms after the one before it, every client leaving mid-step at 1.112 s; SGLang runs them all on
    # together 2 s at the same pace. The others showed one chunk each in a cut one's run: counted over the microseconds
    # between them, a step's token read as thousands a second, 8 of 16 rows "until its max_tokens (2000) were decoded"
    # (-26% to +12%), the 8 left with no pace beside them +20%. A stream's pace is now read from its own chunks there.
    streams = [(i, 0.0, [t + 0.00005 * i for t in _STEPS_40], 1.112 + 0.00001 * i, True, 2000) for i in range(1, 17)]
    rows = _sglang_scene(streams, stop_s=7.0)
    for rid in range(1, 17):
        note = rows[rid]["energy_note"]
        assert "until its max_tokens" not in note and "the server ran on about 2.0 s" in note, note
        # 41 shown and 80 run on (2 s at 40 tokens/s); 300 W split 16 ways to their aborts at 3.112 s.
        assert rows[rid]["attributed_tokens"] == pytest.approx(41 + 80, rel=0.1), rows[rid]
        assert rows[rid]["gpu_energy_j"] == pytest.approx(300.0 * 3.112 / 16, rel=0.1), rows[rid]


def test_a_cut_stream_beside_streams_that_end_at_its_step_is_no_step_over_microseconds():
    # The review (e_jitter.py): 12 streams end (ok) at the 1.1 s step, the last of the cut stream's 41 tokens; its client
    # leaves at 1.12 s and SGLang decodes it on alone to 3.12 s. The 12 showed one chunk each in its run, 0.05 ms apart:
    # "until its max_tokens (2000) were decoded, about 0.6 s", 234 J against 624 (-62.5%). Nothing shown beside it
    # says its pace alone (60 tokens/s in the scene): it decodes at its own.
    others = [(i, 0.0, [t + 0.0001 + 0.00005 * (i - 1) for t in _STEPS_40], 1.1006 + 0.00005 * (i - 1), False, 2000)
              for i in range(1, 13)]
    rows = _sglang_scene([*others, (99, 0.0, [t + 0.00005 for t in _STEPS_40], 1.12, True, 2000)])
    note = rows[99]["energy_note"]
    assert "until its max_tokens" not in note and "at its own (no stream shown beside it then) pace" in note, note
    assert rows[99]["attributed_tokens"] == pytest.approx(41 + 80, rel=0.1), rows[99]
    # 300 W split 13 ways to the others' last step's end at 1.125 s, all of it its own from there to its abort.
    assert rows[99]["gpu_energy_j"] == pytest.approx(300.0 * (1.125 / 13 + 3.12 - 1.125), rel=0.1), rows[99]


def _sglang_slows(told: bool = False, stop_s: float = 6.0) -> dict:
    """`_sglang_batch_slows_after_cut`'s scene (four streams at 40 tokens/s to 1.1 s then 20 to 4.11 s; 9 cut at 1.12 s
    after 41 tokens, 10 from 1.0 s cut at 1.15 s after one) through `_sglang_scene`. The rows by request id."""
    nb_ts = list(np.cumsum([0.1] + [0.025] * 40 + [0.05] * 60))
    streams = [(k, 0.0, nb_ts, 4.11, False, 2000) for k in range(1, 5)]
    streams += [(9, 0.0, nb_ts[:41], 1.12, True, 2000), (10, 1.0, [1.1], 1.15, True, 2000)]
    return _sglang_scene(streams, stop_s=stop_s, told=told)


def test_a_run_on_is_placed_at_its_batchs_pace_where_the_streams_beside_it_said_their_prompts_early():
    # The review (a2_told.py): with every stream's prompt length said at its start (continuous usage) no prompt hold
    # keeps the intervals open, and only the run-on's own hold (`advance`: the horizon no later than a pending run-on's
    # start) keeps its intervals from closing before it is placed: without it 9's row read -56.5% (42 tokens), its
    # run-on in intervals already closed to the streams beside it (-60.8% in the review's scene, without 10).
    rows = _sglang_slows(told=True)
    assert rows[9]["attributed_tokens"] == pytest.approx(41 + 40, rel=0.1), rows[9]
    assert "at its batch's (the 4 streams shown beside it then) pace" in rows[9]["energy_note"], rows[9]
    # 300 W split 5 ways to 1.0 s, 6 ways (10 from 1.0 s) to their aborts at 3.12 and 3.15 s.
    assert rows[9]["gpu_energy_j"] == pytest.approx(300.0 * (1.0 / 5 + 2.12 / 6), rel=0.1), rows[9]


def test_a_run_on_pending_at_shutdown_is_placed_from_what_the_streams_beside_it_showed():
    # The review (a_shutdown.py 1.5): the daemon shut down 0.38 s after 9's client left, its run-on not yet placed (the
    # proxy had not seen past its abort): `close_all` places it from what the streams beside it showed; without that,
    # 9 read -19.8% and 10 -76%, their run-ons lost to the streams beside them.
    rows = _sglang_slows(stop_s=1.5)
    for rid in (9, 10):
        assert "at its batch's (the 4 streams shown beside it then) pace" in rows[rid]["energy_note"], rows[rid]
    # Truth to the shutdown: 300 W split 5 ways to 1.0 s, then 6 ways (10 from its arrival).
    assert rows[9]["gpu_energy_j"] == pytest.approx(300.0 * (1.0 / 5 + 0.5 / 6), rel=0.1), rows[9]
    assert rows[10]["gpu_energy_j"] == pytest.approx(300.0 * 0.5 / 6, rel=0.1), rows[10]


def test_a_short_request_on_a_counter_says_its_figure_is_good_to_joules_not_a_percentage():
    # A 1-3 token request alone on an H200 (100 ms counter refresh) read -96% to +147% against the simulator's truth,
    # its row with no note or another's reason (a hostile review: scene_a4.py). Its edges may each read the counter a
    # refresh stale: said, with the fix (J/token over many, a faster-refreshing counter); a request of 0.8 s is not.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    short, long_ = _trace(1, 1.0), _trace(2, 3.0)
    for tr, end_s, n in ((short, 1.1, 2), (long_, 3.8, 40)):
        led.on_start(tr)
        for k in range(n):
            led.on_tokens(tr, int((tr.arrival_ns / S + 0.03 + (end_s - tr.arrival_ns / S - 0.05) * k / n) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = tr.arrival_ns + int(0.03 * S), int((end_s - 0.02) * S), int(end_s * S)
        tr.counts = Counts(generated_tokens=n, prompt_tokens=100, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
    for t_s, e in ((0.0, 0.0), (1.0, 80.0), (1.1, 110.0), (2.0, 190.0), (3.0, 270.0), (3.8, 500.0), (5.0, 600.0)):
        _feed(led, t_s, e)
    led.advance(int(6 * S))
    got = {r["request_id"]: r for r in sink.rows["requests"]}
    note = got[1]["energy_note"] or ""
    assert got[1]["gpu_energy_j"] > 0 and note.count("counter-short: live 0.10 s") == 1, note
    assert "not to a percentage" in note and "fix: read J/token summed over many such requests" in note, note
    assert "counter-short" not in (got[2]["energy_note"] or ""), got[2]["energy_note"]


@pytest.mark.parametrize("limit", [40, None], ids=["max_tokens", "no_max_tokens"])
def test_a_whole_answer_llamacpp_runs_on_to_its_end_is_costed_its_max_tokens_at_its_batchs_pace(limit):
    # llama-server looks at a whole answer's connection only after a second without any result to any request: beside a
    # stream (a token every 25 ms) a whole answer whose client left decodes to its max_tokens for nobody
    # (scrape.RUNS_ON_AFTER_LEAVE). Costed as one aborted at once, it had its prompt alone and its 40 tokens' decode
    # went to the stream beside it; a stream cut mid-decode stops within a token there, and runs on not at all. With no
    # max_tokens its end is unknown: costed as one aborted at once, its prompt (not left out: no figure at all).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (None, None)

    def chat(rid, a, stream, **extra):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=stream)
        tr.extra.update(prompt_chars=400, **extra)
        return tr

    done, nb, whole, cutd = chat(1, 0.0, True), chat(2, 0.0, True), chat(3, 0.5, False, **({} if limit is None else {"max_tokens": limit})), \
        chat(4, 0.5, True, max_tokens=400)
    for tr in (done, nb, whole, cutd):
        led.on_start(tr)
    for k in range(20):  # a stream done before, at the batch's 40 tokens/s: the server's latest pace
        led.on_tokens(done, int((0.01 + 0.025 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns, done.outcome = int(0.01 * S), int(0.485 * S), int(0.49 * S), "ok"
    done.counts = Counts(generated_tokens=20, prompt_tokens=100, model=None, stop_reason="length", token_source="usage")
    led.on_end(done)
    for k in range(200):
        led.on_tokens(nb, int((0.1 + 0.025 * k) * S), 1)
        if 0.6 <= 0.1 + 0.025 * k < 0.7:
            led.on_tokens(cutd, int((0.1 + 0.025 * k) * S), 1)
    nb.first_ns, nb.last_ns = int(0.1 * S), int((0.1 + 0.025 * 199) * S)
    cutd.first_ns, cutd.last_ns, cutd.end_ns, cutd.outcome = int(0.6 * S), int(0.675 * S), int(0.68 * S), \
        "client_disconnected"
    led.on_end(cutd)
    whole.end_ns, whole.outcome = int(0.6 * S), "client_disconnected"
    led.on_end(whole)
    nb.end_ns, nb.outcome = int(5.1 * S), "ok"
    nb.counts = Counts(generated_tokens=200, prompt_tokens=100, model=None, stop_reason="length", token_source="usage")
    led.on_end(nb)
    e = 0.0
    for k in range(60):
        e += 100.0 * 0.1
        led.add_gpu_sample(int(k * 0.1 * S), int(k * 0.1 * S), [R(e, 100.0)])
    led.advance(int(9 * S))
    led.close_all(int(10 * S))
    rows = {r["request_id"]: r for r in led.emit.rows["requests"]}
    note = rows[3]["energy_note"] or ""
    if limit is None:
        assert "the server ran on" not in note and "it ended before its first token" in note, note
        # llama-server ran it on to an end nothing tells: not the words of a server that aborts it at once (vLLM's).
        assert "aborts a request whose client left at once" not in note, note
        assert "llama-server ran it on to an end not known" in note and "not costed" in note, note
        assert rows[3]["prompt_tokens_estimate"] > 0 and rows[3]["gpu_energy_j"] > 0, rows[3]
    else:
        assert "until its max_tokens (40) were decoded" in note and "llama-server" in note, note
        assert rows[3]["attributed_tokens"] == pytest.approx(40, abs=1), rows[3]
    # Its own run-on: none (beside the unknown one, its note may say that one's: `Ledger._counted_spans`).
    assert "the server ran on" not in (rows[4]["energy_note"] or ""), rows[4]["energy_note"]


def _llamacpp_whole_run_on(downs=(), leave=0.6, max_tokens=400, end_s=25.0, arrive=0.5, outcome="client_disconnected",
                           runs_on=(None, None), error=None, fail_at=None, fail_closed=False, ledgers=None,
                           opened=None, same_process=False, whole_as=("POST", "/v1/chat/completions", "openai-chat"),
                           serves_generate=True, back_as=("server_restart",), beside=None, with_whole=True,
                           counted_run=None, idle_first=False, each_step=True, guard_s=None, slots_at=None,
                           windows=None, **restart_kw):
    # A whole answer (arrives at `arrive`, max_tokens) whose client leaves at `leave` (or, `outcome` upstream_error, whose
    # connection to the server broke then: the proxy saw its process die), run on by llama-server to its
    # max_tokens (`Ledger._run_on`) at the latest streams' 40 tokens/s, held up to 2 x 400 / 40 = 20 s. 100 W throughout,
    # scraped every 0.1 s; the server down over each (down, up): its old process last scraped at `down`, the new one's
    # first scrape at `up` (its window says server_restart, with `restart_kw`); `runs_on`: the server's
    # RUNS_ON_AFTER_LEAVE (SGLang's: to its next 4 s wait from its start); `ledgers`: a list given the ledger; `opened`:
    # (the first scrape that found it down, the first refused or None: a 503's alone), told to the ledger at each tick
    # from then while down, as the daemon's loop tells it (`Ledger.note_down`), its rows let go at their hold meanwhile
    # (SCRAPE_HOLD_S); `same_process`: the page after the outage says no restart (a router's blip); `whole_as`: the
    # whole answer's method, path and API; `serves_generate`: the ledger's (the server's kind as the daemon sets it);
    # `back_as`: what the page after the outage says (counter_below: a page at or past the old reading, `_down_back`);
    # `beside`: (from, to) s of a stream (id 5) at 40 tokens/s ended whole at `to`, counted by the server too;
    # `with_whole` False: no whole answer sent (the truth of a scene where it was never run); `counted_run`: (from, to) s
    # the server counted the whole answer's run-on's tokens, 40 a second (/slots' n_decoded as it decodes them); `idle_first`: its 100 W
    # measured idle first (`_idle_measured`), its busy intervals' time no request was live in idle, not theirs.
    # `each_step` False: the server's counter alone (`--metrics --no-slots`), each request's tokens counted at its end;
    # `guard_s`: the whole answer's prompt's estimated prefill end (`Ledger._prefill_end_est_ns`), s. `slots_at(t)`: the
    # /slots read with each scrape at t s, {slot id: (task id, busy)} (`Ledger.window_slots`). `windows`: {tenths of a
    # second: add_server_tokens' keywords} for the scrape window ending then, over those above.
    # Returns its row (with `beside`, every row by id).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.count_each_step = each_step
    if guard_s is not None:
        led._prefill_end_est_ns = lambda r: int(guard_s * S)
    if idle_first:
        _idle_measured(led, 100.0)
    led.serves_generate = serves_generate
    if ledgers is not None:
        ledgers.append(led)
    led.runs_on_after_leave = runs_on
    led.scraping = True

    def chat(rid, a, stream, how=("POST", "/v1/chat/completions", "openai-chat"), **extra):
        tr = RequestTrace(rid, how[0], how[1], None, int(a * S), 0, api=how[2], stream=stream)
        tr.extra.update(prompt_chars=400, **extra)
        return tr

    # Sent with ignore_eos: its answer cannot end by itself before its abort or max_tokens, so its run-on there is sure
    # (without, its row says uncertain-uncounted: `Ledger._place_run_on`).
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    done, whole = chat(1, 0.0, True), chat(2, arrive, False, whole_as, eos_ignored=True, **limit)
    for tr in (done, whole) if arrive <= 0.5 and with_whole else (done,):
        led.on_start(tr)
    near = None if beside is None else chat(5, beside[0], True)
    near_n = unscraped_near = 0
    for k in range(20):  # a stream done before, at 40 tokens/s: the server's latest pace
        led.on_tokens(done, int((0.01 + 0.025 * k) * S), 1)
    done.first_ns, done.last_ns, done.end_ns, done.outcome = int(0.01 * S), int(0.485 * S), int(0.49 * S), "ok"
    done.counts = Counts(generated_tokens=20, prompt_tokens=100, model=None, stop_reason="length", token_source="usage")
    led.on_end(done)
    e, prev, ended = 0.0, None, False
    for k in range(int(round(end_s * 10))):
        t = k * 0.1
        if arrive > 0.5 and t - 0.1 < arrive <= t and with_whole:  # arrived since the last tick
            led.on_start(whole)
        if near is not None and near.end_ns is None and t >= beside[0] - 1e-9:
            if near.request_id not in led.requests:
                led.on_start(near)
            for j in range(4):
                ts = t - 0.1 + (j + 1) * 0.025
                if beside[0] < ts <= beside[1] + 1e-9:
                    near.first_ns, near.last_ns = near.first_ns or int(ts * S), int(ts * S)
                    led.on_tokens(near, int(ts * S), 1)
                    near_n += 1
                    unscraped_near += 1 if each_step else 0
            if t >= beside[1] - 1e-9:
                unscraped_near += 0 if each_step else near_n  # the counter alone: counted at its end
                near.end_ns, near.outcome = int(beside[1] * S), "ok"
                near.counts = Counts(generated_tokens=near_n, prompt_tokens=100, model=None, stop_reason=None,
                                     token_source="chunks")
                led.on_end(near)
        if fail_at is not None and t - 0.1 < fail_at <= t:  # another request's connection refused: a death's mark
            failed = chat(3, fail_at, False)
            led.on_start(failed)
            from powerprof.daemon.proxy import CRASHED_NOTE

            failed.end_ns, failed.outcome, failed.status, failed.error = (
                (int(fail_at * S), "upstream_error", 502, CRASHED_NOTE + " x") if fail_closed  # closed, no answer
                else (int(fail_at * S), "upstream_unreachable", 502, "x"))
            led.on_end(failed)
        if not ended and t >= leave - 1e-9 and with_whole:
            whole.end_ns, whole.outcome, whole.error = int(leave * S), outcome, error
            if outcome != "client_disconnected":
                whole.status = 502
            led.on_end(whole)
            ended = True
        e += 100.0 * 0.1
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, 100.0)])
        if any(d + 1e-9 < t < u - 1e-9 for d, u in downs):
            if opened is not None and t >= opened[0] - 1e-9 and prev is not None:
                led.note_down(int(prev * S), int(opened[0] * S), None if opened[1] is None else int(opened[1] * S))
            if opened is not None:
                led.advance(int(t * S))  # the daemon's loop goes on while the server is down: rows leave at their hold
            continue
        restart = not same_process and prev is not None and any(prev < d + 1e-9 and u - 1e-9 < t for d, u in downs)
        if counted_run is not None and prev is not None and each_step:
            unscraped_near += 40.0 * max(0.0, min(t, counted_run[1]) - max(prev, counted_run[0]))
        elif counted_run is not None and prev is not None and prev < counted_run[1] <= t + 1e-9:
            unscraped_near += 40.0 * (counted_run[1] - counted_run[0])  # the counter alone: counted at its end
        if slots_at is not None:
            led.window_slots = (int((t - 0.01) * S), int((t + 0.01) * S), slots_at(t))
        led.add_server_tokens(int(t * S), 20.0 + unscraped_near if prev is not None and prev < 0.5 <= t
                              else float(unscraped_near if prev is not None else 0),
                              None if prev is None else int(prev * S),
                              **{"partial": back_as if restart else (), **(restart_kw if restart else {}),
                                 **(windows or {}).get(k, {})})
        unscraped_near = 0
        prev = t
        led.advance(int(t * S))
    led.close_all(int(end_s * S))
    if beside is not None:
        return {r["request_id"]: r for r in led.emit.rows["requests"]}
    return next(r for r in led.emit.rows["requests"] if r["request_id"] == 2)


@pytest.mark.parametrize("restart", [False, True], ids=["no_restart", "restart"])
def test_a_whole_answer_llamacpp_runs_on_ends_where_the_server_restarts(restart):
    # Restarted 1.5 s after it arrived, the process that ran it is gone: nothing decodes it after the old process's
    # last scrape (`_run_on_cut_ns`), and the energy after it is the new process's (idle here), not a run-on's that
    # never happened. Not restarted, it runs on to its max_tokens at 10.5 s: capped there (`_place_run_on`), its
    # intervals held to 20.6 s (twice its estimate) must end at the cap too. Before, the close that placed it had built
    # its end at 20.6 s: 400 tokens, 2010 J (truth: 0.5 s to 10.5 s at 100 W, 1000 J).
    row = _llamacpp_whole_run_on([(1.5, 2.0)] if restart else [])
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    if not restart:  # decoded 0.51 s to 10.51 s at 40 tokens/s
        assert row["attributed_tokens"] == pytest.approx(400, abs=1), row
        assert row["gpu_energy_j"] == pytest.approx(1000.0, rel=0.03), row
        assert "until its max_tokens (400) were decoded" in note, note
    else:  # decoded from its prefill's end to the old process's last scrape at 1.5 s: 40 tokens
        assert row["attributed_tokens"] == pytest.approx(40, abs=2), row
        assert row["gpu_energy_j"] == pytest.approx(100.0, abs=10.5), row  # none of the new process's
        assert "ran on after its client left, about 0.9 s, until it restarted" in note, note


@pytest.mark.parametrize("max_tokens,downs", [(40, []), (40, [(3.0, 3.5)])], ids=["alone", "restart_after"])
def test_a_whole_answer_llamacpp_run_on_capped_at_max_tokens_is_costed_to_there(max_tokens, downs):
    # 40 tokens at 40 tokens/s: it ends at 1.51 s, though held to 2.6 s (twice its estimate); a restart after its end
    # changes nothing. Before, its intervals to 2.6 s were its own: 40 tokens, 210 J (truth 100 J).
    row = _llamacpp_whole_run_on(downs, max_tokens=max_tokens, end_s=5.0)
    assert row["attributed_tokens"] == pytest.approx(40, abs=1), row
    assert row["gpu_energy_j"] == pytest.approx(100.0, abs=10.5), row  # to the 0.1 s interval its end falls in


@pytest.mark.parametrize("beside,downs,flagged,counted", [((33.0, 38.0), [], True, False),
                                                          ((10.0, 15.0), [], False, True),
                                                          ((33.0, 38.0), [(1.5, 2.0)], False, False)],
                         ids=["past_the_cap", "within_it", "restarted_before"])
def test_a_whole_answer_llamacpp_runs_on_past_the_cap_flags_the_requests_beside_its_rest(beside, downs, flagged,
                                                                                          counted):
    # max_tokens 2000 at 40 tokens/s: held, as ever, only to RUN_ON_TO_END_MAX_S (30 s) after its leave at 0.6 s; its
    # estimated end is 2 x 2000 / 40 = 100 s on, its rest placed nowhere. Before, a stream 33-38 s in was given all of
    # those intervals (500 J for 199 tokens here), unflagged and in the gauge (the simulated llama.cpp's such rows
    # read -5% to +29%, docs/daemon.md). Now flagged with its own fix, left out of the gauge. A stream within the 30 s,
    # or past it where a restart ended the run first, is not by that note. One within the 30 s says the run's tokens,
    # counted by the server, read as bypass (`Ledger._counted_spans`; before, unflagged: the simulated llama.cpp's such
    # rows read -40%..+4%, docs/daemon.md); past a restart that ended the run, neither.
    ledgers = []
    rows = _llamacpp_whole_run_on(downs, max_tokens=2000, end_s=45.0, beside=beside, ledgers=ledgers)
    note = rows[5]["energy_note"] or ""
    said = "its run-on is placed only to 30 s after that leave" in note
    assert said == flagged, note
    assert ("the server counts that run's tokens" in note) == counted, note
    assert (UNSURE_FLAG in note) == (flagged or counted), note
    if flagged:
        assert "max_tokens" in note and "scrape.server" not in note, note
    left = ledgers[0].totals.jpt_left_out.get(UNSURE_FLAG, (0, 0.0))
    assert (left[0] > 0) == (flagged or counted or bool(downs)), ledgers[0].totals.jpt_left_out  # restarted: 0.6-1.5 s


@pytest.mark.parametrize("beside,flagged,each_step", [((5.0, 10.0), True, True), ((14.0, 18.0), False, True),
                                                       ((5.0, 10.0), True, False), ((14.0, 18.0), True, False)],
                         ids=["while_counted", "after_the_count_stood_still", "no_slots_while_run", "no_slots_after"])
def test_a_whole_answer_llamacpp_runs_on_with_no_max_tokens_flags_the_requests_beside_it_till_the_count_stands(
        beside, flagged, each_step):
    # No max_tokens sent: llama-server runs it on to an end not known (its context's), nothing placed, costed as aborted
    # at its leave (0.6 s). The server counts its tokens, 40 a second, until 12 s, then nothing. Before, a stream 5-10 s
    # beside that run was given all of those intervals (500 J for its 200 tokens, the run's work in it or in unproxied),
    # unflagged and in the gauge. Now flagged until the first scrape window that counted nothing (12.0 s + 1 s); a
    # stream after it is not. With the server's counter alone (`--metrics --no-slots`, `each_step` False) the count
    # stands still between request ends while the run decodes, so no stillness ends it: every stream after its leave is
    # flagged. Before, the span ended at 2.6 s (the count still from 0.6 s): the 5-10 s stream beside the run, unflagged.
    ledgers = []
    rows = _llamacpp_whole_run_on([], max_tokens=None, end_s=25.0, beside=beside, ledgers=ledgers,
                                  counted_run=(0.6, 12.0), each_step=each_step)
    note = rows[5]["energy_note"] or ""
    assert ("the server counts that run's tokens" in note) == flagged, note
    assert (UNSURE_FLAG in note) == flagged, note
    assert "llama-server ran it on to an end not known" in (rows[2]["energy_note"] or ""), rows[2]["energy_note"]
    left = ledgers[0].totals.jpt_left_out.get(UNSURE_FLAG, (0, 0.0))
    assert (left[0] > 0) == flagged, ledgers[0].totals.jpt_left_out


@pytest.mark.parametrize("max_tokens,each_step,flagged", [(None, False, True), (400, False, True), (400, True, True),
                                                        (None, True, False)],
                         ids=["no_slots", "no_slots_placed", "placed", "counted_each_step"])
def test_a_whole_answer_llamacpp_run_whose_client_left_flags_the_streams_beside_it_before_the_leave(
        max_tokens, each_step, flagged):
    # A whole answer from 0.5 s, its client gone at 5.0 s, the server counting its run 0.5-12 s (or to its 400
    # max_tokens at 10.5 s); a stream beside it 3.0-4.9 s, ended before the leave, sharing the GPU with it (truth 95 J).
    # The server counts the run's tokens before the leave too, listed by no proxied request. With the counter alone
    # (`--metrics --no-slots`) they are counted at the run's end: unplaced (no max_tokens) that work was in the stream's
    # share, 200 J (+111%), placed on the run's row 122 J (+29%); counted each step beside its placing, read as bypass
    # too: 69 J (-27%). Before, none said uncertain-uncounted (the span began at the leave; here only this harness's
    # proxy_lag left them out): on the simulated llama.cpp (/slots read, max_tokens 1500) the six streams before such a
    # leave read -27% to -33% with only gone-prefill-beside, kept in J/token. Now flagged, out of J/token. Counted
    # each step and unplaced, the bypass is read as it came: 95 J, not flagged (the simulator's: +2% to +4%).
    ledgers = []
    end = 12.0 if max_tokens is None else 10.5
    rows = _llamacpp_whole_run_on([], max_tokens=max_tokens, end_s=25.0, leave=5.0, beside=(3.0, 4.9),
                                  ledgers=ledgers, counted_run=(0.5, end), each_step=each_step)
    note = rows[5]["energy_note"] or ""
    print(rows[5]["gpu_energy_j"], note)
    assert ("the server counts that run's tokens" in note) == flagged, note
    assert (UNSURE_FLAG in note) == flagged, note
    if not flagged:
        assert rows[5]["gpu_energy_j"] == pytest.approx(95.0, rel=0.05), rows[5]


@pytest.mark.parametrize("beside,flagged", [((12.0, 18.0), False), ((5.0, 9.0), True)],
                         ids=["past_its_placed_end", "beside_its_placed_tokens"])
def test_a_placed_llamacpp_run_on_that_slots_show_ended_early_ends_its_span_past_its_placed_tokens(beside, flagged):
    # max_tokens 400 at 40 tokens/s: placed 0.51-10.5 s, its span held to 20.6 s (twice its estimate). llama-server
    # cancelled it at 3.0 s (its slot 0's task 7 idle from then; slot 1 idle throughout). A stream 12-18 s, past its
    # placed tokens and its slot's end, shares with nothing of it: before, flagged all the same (an over-flag); now not.
    # One 5-9 s, beside its placed tokens (they take a share its cancelled run never used): flagged still.
    ledgers = []
    rows = _llamacpp_whole_run_on([], max_tokens=400, end_s=25.0, beside=beside, ledgers=ledgers,
                                  counted_run=(0.6, 3.0), slots_at=lambda t: {0: (7, t < 3.0 - 1e-9), 1: (3, False)})
    note = rows[5]["energy_note"] or ""
    assert ("the server counts that run's tokens" in note) == flagged, note
    assert (UNSURE_FLAG in note) == flagged, note
    assert rows[2]["attributed_tokens"] == pytest.approx(400, abs=1), rows[2]  # placed as before
    if not flagged:  # whole again: its share alone (truth 600 J for 6 s at 100 W over idle)
        assert rows[5]["gpu_energy_j"] == pytest.approx(600.0, rel=0.05), rows[5]


def test_a_whole_answer_llamacpp_run_on_that_stopped_before_its_prefill_guard_ends_after_a_still_second_past_it():
    # No max_tokens, counted 0.6-1.6 s (llama-server cancelling at its first quiet second), its prompt's prefill
    # estimated to end at 3 s: the count stands still from 1.6 s, before that guard. Its span ends a still second past
    # the guard (4 s), so a stream 20-25 s, after 18 s of silence, is not flagged. Before, a stillness begun before the
    # guard was never taken: the span stayed open through the silence and that stream was flagged.
    ledgers = []
    rows = _llamacpp_whole_run_on([], max_tokens=None, end_s=30.0, beside=(20.0, 25.0), ledgers=ledgers,
                                  counted_run=(0.6, 1.6), guard_s=3.0)
    note = rows[5]["energy_note"] or ""
    assert "the server counts that run's tokens" not in note and UNSURE_FLAG not in note, note


def _llamacpp_unknown_span_under_traffic(slots_at, **extra):
    # A llama.cpp whole answer left at 1.0 s, no max_tokens: its counted span has no known end (`Ledger._run_on`). 300 s
    # of 0.1 s scrape windows, 5 tokens each (other traffic: the count never still); `slots_at(t)`: the /slots read
    # then, {slot id: (task id, busy)} (`Ledger.window_slots`); `extra`: its body's terms (choices, id_slot). The span's
    # (start, end) in s, None for no end.
    from powerprof.daemon import attribution as attr
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.count_each_step, led.runs_on_after_leave, led.scraping = True, (None, None), True
    tr = RequestTrace(2, "POST", "/v1/chat/completions", None, int(0.5 * S), 0, api="openai-chat", stream=False)
    tr.extra.update(prompt_chars=400, **extra)
    led.on_start(tr)
    tr.end_ns, tr.outcome = int(1.0 * S), "client_disconnected"
    led.on_end(tr)
    since = int(0.9 * S)
    for k in range(1, 3001):
        t = int((0.9 + 0.1 * k) * S)
        led.window_slots = (t - int(0.01 * S), t + int(0.01 * S), slots_at(t / S))
        led.add_server_tokens(t, 5.0, since)
        since = t
    (a0, a1), = led._counted_spans.values()
    return a0 / S, None if a1 >= int(attr.NEVER) else a1 / S


def test_a_llamacpp_run_on_with_no_known_end_closes_when_its_slot_moves_on_under_steady_traffic():
    # Its slot 0 runs task 7 to 20 s, then task 8 (another request); slot 1 idle, the count moving in every window. The
    # span ends at the first /slots read showing task 7 gone (20.01 s) plus GONE_ABORT_SLACK_S. Before, it never ended
    # (only a still count closed it): every interval after the leave left out of J/token, every row beside flagged.
    span = _llamacpp_unknown_span_under_traffic(lambda t: {0: (7 if t < 20.0 - 1e-9 else 8, True), 1: (3, False)})
    assert span[1] is not None and 20.9 < span[1] < 21.2, span
    # Gone idle instead of to another task: the same.
    span = _llamacpp_unknown_span_under_traffic(lambda t: {0: (7, t < 20.0 - 1e-9), 1: (3, False)})
    assert span[1] is not None and 20.9 < span[1] < 21.2, span


def test_a_slots_page_with_a_list_task_id_reaches_add_server_tokens_without_a_typeerror():
    # A /slots page whose id_task is a list (odd or hostile) passed slot_progress and slot_tasks; the ledger's
    # `_end_counted_by_slots` put (slot, task) in a frozenset: TypeError in add_server_tokens, called with no try in the
    # scrape loop, so the loop ended silently. `slot_tasks` now keeps only int or str task ids (else None).
    from powerprof.daemon.scrape import slot_tasks
    page = [{"id": 0, "id_task": [7], "is_processing": False}, {"id": 1, "id_task": 2, "is_processing": True}]
    assert slot_tasks(page) == {0: (None, False), 1: (2, True)}
    _llamacpp_unknown_span_under_traffic(lambda t: slot_tasks(page))  # before: TypeError: unhashable type: 'list'


@pytest.mark.parametrize("slots", [lambda t: {0: (7, True), 1: (3, False)},
                                   lambda t: {0: (7 if t < 20.0 - 1e-9 else 8, True), 1: (int(t * 10), True)}],
                         ids=["its_task_goes_on", "every_slot_busy"])
def test_a_llamacpp_run_on_with_no_known_end_stays_open_while_its_slot_may_run_it(slots):
    # Task 7 decoding on through the 300 s: the span stays open. Every slot busy at every read after the leave (slot 1's
    # task changing at each): the run may have queued behind them, unseen on any slot, so no read notes its slots and
    # today's rule (a still count) stays.
    assert _llamacpp_unknown_span_under_traffic(slots)[1] is None


def test_a_llamacpp_run_on_that_may_sit_deferred_beside_an_idle_slot_is_not_noted_by_it():
    # llama-server defers a task of n choices until it has a free slot for each (a parent and n-1 child tasks), and one
    # pinned by id_slot while that slot is busy, so either may sit queued beside an idle slot (`Ledger._slots_needed`).
    # n=2: 3 slots, slot 0 task 7 to 10 s, slot 1 idle from 1.95 s, slot 2 task 8 to 12 s; its two tasks take slots 0
    # and 1 at 10 s (9, 10) and decode to 30 s for nobody. Before, slot 1 idle at two reads noted it at 2 s beside
    # tasks 7 and 8: its span ended at 13 s, the rows 13-30 s unflagged.
    def n2(t):
        return {0: (7, True) if t < 10.0 - 1e-9 else (9, t < 30.0 - 1e-9),
                1: (5, True) if t < 1.95 else (5, False) if t < 10.0 - 1e-9 else (10, t < 30.0 - 1e-9),
                2: (8, t < 12.0 - 1e-9)}
    span = _llamacpp_unknown_span_under_traffic(n2, sequences=2, choices=2)
    assert span[1] is not None and 30.0 < span[1] < 31.3, span
    # Pinned to slot 1 (busy with task 5 to 10 s), slot 0 idle: it runs as task 9 on slot 1 from 10 s to 30 s. Before,
    # slot 0 idle at two reads noted it beside task 5: its span ended at 11 s.
    def pinned(t):
        return {0: (3, False), 1: (5, True) if t < 10.0 - 1e-9 else (9, t < 30.0 - 1e-9)}
    span = _llamacpp_unknown_span_under_traffic(pinned, id_slot=1)
    assert span[1] is not None and 30.0 < span[1] < 31.3, span
    # Its needs met (two slots idle beside its n=2 run on slots 0 and 1 to 20 s): noted, it ends at its slots' end.
    span = _llamacpp_unknown_span_under_traffic(
        lambda t: {0: (7, t < 20.0 - 1e-9), 1: (8, t < 20.0 - 1e-9), 2: (3, False), 3: (4, False)},
        sequences=2, choices=2)
    assert span[1] is not None and 20.9 < span[1] < 21.2, span


def test_a_capped_llamacpp_run_on_that_slots_show_ended_early_leaves_past_its_placed_tokens_unflagged():
    # max_tokens 2000 at 40 tokens/s: estimated 100 s after its leave, placed to the held 30 s, its rest to the estimate
    # marked (`Ledger._capped_spans`). llama-server cancelled it at 3.0 s (its slot 0's task 7 idle from then). A stream
    # 40-45 s, past its placed tokens and its slot's end, shares with nothing of it. Before, the counted span was cut
    # there but the capped one not: flagged (uncertain-uncounted) for nothing.
    rows = _llamacpp_whole_run_on([], max_tokens=2000, end_s=50.0, beside=(40.0, 45.0), counted_run=(0.6, 3.0),
                                  slots_at=lambda t: {0: (7, t < 3.0 - 1e-9), 1: (3, False)})
    note = rows[5]["energy_note"] or ""
    assert UNSURE_FLAG not in note, note


def _whole_answer_beside_a_stream(end_s, outcome="ok", scraped=False, tag_s=None):
    # llama.cpp (100 W throughout, 0.1 s reads): a whole answer from 0.5 s decoding 40 tokens/s to `end_s` (answered,
    # its tokens spread over its decode as the proxy gives them, or `outcome` client_disconnected: its client gone then),
    # a stream 2-5 s beside it at 40 tokens/s (truth 150 J: half of 300 J). The ledger's holds (max_hold_s,
    # prompt_hold_s) cut to 10 s; `scraped`: /slots read each 0.1 s, counting both as they decode (each step), else no
    # server scraped (scrape.server = none); `tag_s`: a tag window (from, to) s. The rows by id and the ledger.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.max_hold_ns = led.prompt_hold_ns = int(10 * S)
    led.serves_generate, led.runs_on_after_leave = False, (None, None)
    led.scraping = led.count_each_step = scraped
    whole = RequestTrace(2, "POST", "/v1/chat/completions", None, int(0.5 * S), 0, api="openai-chat", stream=False)
    near = RequestTrace(5, "POST", "/v1/chat/completions", None, int(2.0 * S), 0, api="openai-chat", stream=True)
    for tr in (whole, near):
        tr.extra.update(prompt_chars=400, max_tokens=4000)
    led.on_start(whole)
    e, n_near = 0.0, 0
    for k in range(int(round((end_s + 15.0) * 10))):
        t = k * 0.1
        counted = 0.0
        if k == 20:
            led.on_start(near)
        if 20 <= k <= 50 and near.end_ns is None:
            for j in range(4):
                ts = t - 0.1 + (j + 1) * 0.025
                if 2.0 < ts <= 5.0 + 1e-9:
                    near.first_ns, near.last_ns = near.first_ns or int(ts * S), int(ts * S)
                    led.on_tokens(near, int(ts * S), 1)
                    n_near, counted = n_near + 1, counted + 1
            if k == 50:
                near.end_ns, near.outcome = int(5.0 * S), "ok"
                near.counts = Counts(generated_tokens=n_near, prompt_tokens=100, model=None, stop_reason=None,
                                     token_source="chunks")
                led.on_end(near)
        if k and 0.5 < t <= end_s + 1e-9:
            counted += 40.0 * (t - max(t - 0.1, 0.5))
        if whole.end_ns is None and t >= end_s - 1e-9:
            whole.end_ns, whole.outcome = int(end_s * S), outcome
            if outcome == "ok":
                n = int(round(40.0 * (end_s - 0.5)))
                whole.status, whole.first_ns, whole.last_ns, whole.tokens_seen = 200, int(0.5 * S), int(end_s * S), n
                whole.extra["spread"] = True
                whole.counts = Counts(generated_tokens=n, prompt_tokens=100, model=None, stop_reason="length",
                                      token_source="usage")
            led.on_end(whole)
        e += 10.0
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, 100.0)])
        if tag_s is not None and k == int(round(tag_s[0] * 10)):
            led.open_tag("bench", int(t * S), int(t * S))
        if tag_s is not None and k == int(round(tag_s[1] * 10)):
            led.close_tag("bench", int(t * S), int(t * S))
        if scraped and k:
            led.window_slots = (int((t - 0.01) * S), int((t + 0.01) * S), {0: (7, t <= end_s), 1: (8, 2.0 < t <= 5.0)})
            led.add_server_tokens(int(t * S), counted, int((t - 0.1) * S))
        led.advance(int(t * S))
    led.close_all(int((end_s + 15.0) * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}, led


@pytest.mark.parametrize("end_s,outcome,scraped,flagged",
                         [(20.0, "ok", False, True), (20.0, "client_disconnected", False, True),
                          (8.0, "ok", False, False), (20.0, "ok", True, False)],
                         ids=["answered_past_the_hold", "left_past_the_hold", "answered_within_it", "counted_each_step"])
def test_a_stream_beside_a_whole_answer_held_past_its_hold_is_flagged_where_no_counter_reads_that_answer(
        end_s, outcome, scraped, flagged):
    # A whole answer reveals its tokens only at its end; its intervals are held for it at most max_hold_s (cut to 10 s
    # here), then close with it in flight: with no server counter read (scrape.server = none) its decode there is
    # nobody's, so it is in the shares of the requests beside it. Before, unflagged whether its client stayed or left:
    # the stream 2-5 s beside it read 300 J for the truth's 150 J (+100%; at max_hold_s 120 s, a stream 5-10 s beside one
    # answered at 150 s: 500 J for 250). Now it says so, out of J/token. Within the hold, not by this note; with /slots
    # read each step the answer's tokens read as bypass as they come and the stream's share is fair: not flagged.
    rows, led = _whole_answer_beside_a_stream(end_s, outcome, scraped)
    note = rows[5]["energy_note"] or ""
    print(rows[5]["gpu_energy_j"], note)
    said = "a whole answer beside it was still in flight" in note
    assert said == flagged, note
    if flagged:
        assert UNSURE_FLAG in note, note
        assert led.totals.jpt_left_out.get(UNSURE_FLAG, (0, 0.0))[0] > 0, led.totals.jpt_left_out
    if scraped:
        assert UNSURE_FLAG not in note, note
        assert rows[5]["gpu_energy_j"] == pytest.approx(150.0, rel=0.05), rows[5]


def test_a_whole_answer_itself_past_its_hold_beside_others_says_its_figure_low_or_high():
    # The review's whole_dir.py (its batch-API scene, holds 10 s): whole answers that were themselves in flight past
    # their hold beside others read 153-157 J for a fair 176-202 J (-13..-22%), their own decode there given to the
    # answers beside them, yet the note said "its figure high by up to that" (63-100%). A row whose own tokens came late
    # (after their intervals closed) says low or high; one whose tokens all came in time keeps "high by up to that".
    from powerprof.daemon.liverequest import LiveRequest
    from powerprof.daemon.rowtext import _approximate_note

    said = "intervals closed while a whole answer beside it was still in flight"
    own_late = _approximate_note(LiveRequest(_trace(1, 0.0), gpu_j=155.0, held_whole_beside_j=155.0, late=600.0)) or ""
    assert said in own_late and "its figure low or high" in own_late and "high by up to" not in own_late, own_late
    in_time = _approximate_note(LiveRequest(_trace(2, 0.0), gpu_j=300.0, held_whole_beside_j=300.0)) or ""
    assert said in in_time and "its figure high by up to that" in in_time, in_time


@pytest.mark.parametrize("scraped", [False, True], ids=["none", "counted_each_step"])
def test_a_tag_over_intervals_beside_a_whole_answer_held_past_its_hold_says_its_share(scraped):
    # The review's scene_tag.py: a tag window over intervals whose requests say uncertain-uncounted (a whole answer in
    # flight past its hold, no counter read) kept its J/token with no word (+42% there: 0.797 J/token for 0.561). Now
    # its note says so with the share, as its requests' rows do; with /slots read each step, nothing to say.
    rows, led = _whole_answer_beside_a_stream(20.0, scraped=scraped, tag_s=(1.0, 8.0))
    tag = led.emit.rows["tags"][0]
    note = tag["energy_note"] or ""
    print(tag["gpu_j_per_token"], note)
    assert (f"{UNSURE_FLAG}: 100% of its serving GPUs' energy is from intervals closed while a whole answer" in note) \
        != scraped, note


@pytest.mark.parametrize("scraped", [False, True], ids=["none_scraped", "counted_each_step"])
def test_a_whole_answer_past_its_hold_whose_late_tokens_are_a_material_share_is_left_out_of_j_per_token(scraped):
    # The whole answer beside the stream above (0.5-20 s, 780 tokens, truth 1800 J: 1950 J less the stream's 150 J,
    # 2.31 J/token): its tokens come at its end, and those placed in the intervals that closed under its hold (10 s
    # here, max_hold_s) are late. Its gpu_energy_j counts every interval it was live in, its J/token divided it by its
    # attributed tokens alone. Before, unflagged in J/token: 1650 J / 403 tokens, 4.09 J/token (+77%; scraped, 1010 J,
    # its decode's energy read as bypass as it came: 2.50). Now out of J/token, its note giving both readings.
    rows, led = _whole_answer_beside_a_stream(20.0, "ok", scraped)
    row = rows[2]
    note = row["energy_note"] or ""
    print(row["gpu_energy_j"], row["attributed_tokens"], row["error"], note)
    assert "arrived after their interval had closed" in (row["error"] or ""), row
    assert UNSURE_FLAG in note and "arrived after the intervals they ran in had closed" in note, note
    m = re.search(rf"{UNSURE_FLAG}: ([0-9.]+) of its ([0-9.]+) tokens \(", note)
    assert m and float(m[2]) == pytest.approx(780, abs=1) and 300 <= float(m[1]) <= 480, note
    # Within its hold none is late: not flagged by it.
    rows, _ = _whole_answer_beside_a_stream(8.0, "ok", scraped)
    assert "arrived after the intervals they ran in had closed" not in (rows[2]["energy_note"] or ""), rows[2]


def _sglang_stream_run_on(late=0.0, down=2.0, up=2.5, leave=1.0, extra=None, probe=None, counted=None, **restart_kw):
    # SGLang runs a stream on 2 s after its client left (`Ledger._run_on`). A stream at 40 tokens/s from 0.5 s, its client
    # gone at `leave`; the server down over (down, up): its old process last scraped at `down`, the new one's first
    # scrape stamped `up` (its window says server_restart, with `restart_kw`) and read `late` s after (a long GET: the
    # windows after it wait for it).
    # 100 W throughout, ticks every 0.05 s, scraped every 0.1 s; SGLang counts no aborted request's tokens. Its row.
    # `extra`: its body's terms over max_tokens 1000; `probe`: called with the ledger once made; `counted`: (scrape s,
    # tokens) SGLang counted there (an answer that ended by itself, counted at its end).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.3)
    led.runs_on_after_leave = (2.0, 4.0)
    led.scraping = True
    if probe is not None:
        probe(led)
    tr = RequestTrace(2, "POST", "/v1/chat/completions", None, int(0.5 * S), 0, api="openai-chat", stream=True)
    tr.extra.update({"prompt_chars": 400, "max_tokens": 1000, **(extra or {})})
    led.on_start(tr)
    e, prev, pend, ended, k_tok = 0.0, None, [], False, 0
    for k in range(400):
        t = round(k * 0.05, 3)
        while not ended and 0.51 + 0.025 * k_tok <= min(t, leave):  # a token every 25 ms until its client leaves
            ts = 0.51 + 0.025 * k_tok
            tr.first_ns = tr.first_ns or int(ts * S)
            led.on_tokens(tr, int(ts * S), 1)
            tr.last_ns = int(ts * S)
            k_tok += 1
        if not ended and t >= leave:
            tr.end_ns, tr.outcome = int(leave * S), "client_disconnected"
            led.on_end(tr)
            ended = True
        e += 100.0 * 0.05
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, 100.0)])
        if k % 2 == 0 and not (down + 1e-9 < t < up - 1e-9):
            restart = prev is not None and prev < down + 1e-9 and up - 1e-9 < t
            pend.append((t + (late if restart else 0.0), t, prev, restart))
            prev = t
        while pend and pend[0][0] <= t + 1e-9:  # in order: the scrape loop reads one page at a time
            _, ts, pv, rs = pend.pop(0)
            n = counted[1] if counted is not None and abs(ts - counted[0]) < 1e-9 else 0.0
            led.add_server_tokens(int(ts * S), n, None if pv is None else int(pv * S), at_finish=True,
                                  partial=("server_restart",) if rs else (), **(restart_kw if rs else {}))
        led.advance(int(t * S))
    led.close_all(int(20 * S))
    return next(r for r in led.emit.rows["requests"] if r["request_id"] == 2)


def test_a_run_on_ends_at_the_old_process_last_scrape_not_the_new_one_first():
    # The old process last answered a scrape at 1.5 s (llama.cpp's whole answer) or 2.0 s (SGLang's stream): it died
    # after; the new one's first scrape came at 11.5 s (a 10 s model load) or 2.5 s. Cut at the new one's first scrape,
    # the run-ons took the down time: the whole answer 400 tokens, 1010 J (truth 40, 100 J at 100 W), the stream
    # 79.6 tokens, 200 J (truth 60, 150 J).
    row = _llamacpp_whole_run_on([(1.5, 11.5)])
    assert row["attributed_tokens"] == pytest.approx(40, abs=2), row
    assert row["gpu_energy_j"] == pytest.approx(100.0, abs=10.5), row
    assert "until it restarted" in (row["energy_note"] or ""), row["energy_note"]
    row = _sglang_stream_run_on()
    assert row["attributed_tokens"] == pytest.approx(60, abs=2), row
    assert row["gpu_energy_j"] == pytest.approx(150.0, abs=10.5), row


@pytest.mark.parametrize("server", ["llamacpp", "sglang"])
def test_a_run_on_cut_by_a_restart_ends_midway_to_the_first_scrape_that_found_the_server_down(server):
    # The old process last answered a scrape at 1.5 s (2.0 s), died at 1.59 s (2.09 s), and the scrape at 1.6 s (2.1 s)
    # found nothing listening (`down_ns`, scrape.Scraper.window_down_ns). Truth at 100 W: the whole answer decoded
    # 0.51 s to 1.59 s at 40 tokens/s, 43.2 tokens and 109 J; the stream 0.51 s to 2.09 s, 63.6 tokens and 159 J. Cut
    # at the last scrape, the run-on's last 0.09 s was dropped, nothing said: 40 tokens, 100 J (the stream 60, 150 J).
    # Placed midway (1.55 s; 2.05 s), good to 0.05 s either way, and its row says so.
    if server == "llamacpp":
        row, truth_n, truth_j = _llamacpp_whole_run_on([(1.5, 11.5)], down_ns=int(1.6 * S)), 43.2, 109.0
    else:
        row, truth_n, truth_j = _sglang_stream_run_on(down_ns=int(2.1 * S)), 63.6, 159.0
    note = row["energy_note"] or ""
    assert row["attributed_tokens"] == pytest.approx(truth_n, abs=2.0), row
    assert row["gpu_energy_j"] == pytest.approx(truth_j, abs=5.0), row  # at the 0.1 s intervals' grain
    assert "died between its last scrape and the first that found the server down, 0.10 s later: its end placed " \
           "midway, good to 0.05 s either way" in note, note
    # None found it down (a restart between two scrapes): its end at the last scrape, said to be a lower bound.
    row = _llamacpp_whole_run_on([(1.5, 1.6)]) if server == "llamacpp" else _sglang_stream_run_on(up=2.1)
    assert "a lower bound: no scrape found the server down before the new process's first, 0.10 s later" in \
           (row["energy_note"] or ""), row["energy_note"]


def test_a_close_with_no_answer_and_no_death_seen_is_not_costed_as_a_crash():
    # A router in front of the server refused a whole answer by closing its connection with no byte (the server never
    # had it: truth 0 J). Taken for a crash on the close alone, such a request was costed as run until then: on the
    # simulator 78 J over 4 requests of 0 s each on an idle server, their rows saying "its process died". No scrape saw
    # the server die: it is not costed, and its row says it closed with no answer and may have run.
    from powerprof.daemon.proxy import CRASHED_NOTE
    row = _llamacpp_whole_run_on([], arrive=1.0, leave=1.3, end_s=4.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: refused")
    note = (row["energy_note"] or "") + (row.get("energy_flags") or "")
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert not row["attributed_tokens"] and not row["gpu_energy_j"], row
    assert "its process died" not in note and "may have run" in note, note


@pytest.mark.parametrize("proof", [{"down_refused": True}, {"fail_at": 1.6}, {"resend": True}],
                         ids=["refused_scrape", "proxied_refused", "its_resend_refused"])
def test_a_close_with_no_answer_where_the_server_was_found_down_is_costed_to_the_crash(proof):
    # The same close, where the scrape after it found nothing listening (its process died at 1.55 s), or a proxied
    # request's connect was refused then, or its own resend after a close inside forward.STALE_CLOSE_MAX_S was
    # (proxy.RESEND_REFUSED): costed to the crash, run from its arrival at 0.5 s to the close (about 1 s at 100 W, the
    # only request live: about 100 J).
    from powerprof.daemon.proxy import CRASHED_NOTE, RESEND_REFUSED
    resend = proof.pop("resend", False)
    row = _llamacpp_whole_run_on([(1.5, 2.0)], leave=1.55, end_s=6.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: {RESEND_REFUSED + ': ' if resend else ''}closed",
                                 down_ns=int(1.6 * S), **proof)
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert 60.0 <= (row["gpu_energy_j"] or 0) <= 130.0, row
    assert "closed its connection with no answer" in note, note
    if resend:
        # A stale kept-alive connection's close, its resend refused: the server died, but maybe before it read the
        # request (never run). Worded "a crash: its process died", the row said one reading where the proxy's error
        # says both.
        assert "its process died" not in note and "may never have run" in note and RESEND_REFUSED in note, note
        # 1.05 s after its arrival, longer than a crossing takes: it may have queued unrun behind full slots, its
        # figure the neighbours' (unmarked before, kept in J/token): marked uncertain-uncounted.
        assert UNSURE_FLAG in note and "queued behind full slots" in note, note


def test_a_put_to_sglangs_generate_closed_with_no_answer_where_the_server_was_found_down_is_costed_to_the_crash():
    # SGLang's /generate takes PUT as POST (http_server.py): such a whole answer closed by its server's death ran as a
    # POST's does. Before: `_crash_seen` took POSTs alone, and the PUT's row had no energy (0 J where the POST's, the
    # same trace, is about 100 J).
    from powerprof.daemon.proxy import CRASHED_NOTE
    kw = dict(leave=1.55, end_s=6.0, outcome="upstream_error", error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S),
              down_refused=True)
    post = _llamacpp_whole_run_on([(1.5, 2.0)], whole_as=("POST", "/generate", "sglang-generate"), **kw)
    put = _llamacpp_whole_run_on([(1.5, 2.0)], whole_as=("PUT", "/generate", "sglang-generate"), **kw)
    print(post["gpu_energy_j"], put["gpu_energy_j"], put["energy_note"])
    assert 60.0 <= (post["gpu_energy_j"] or 0) <= 130.0, post
    assert put["gpu_energy_j"] == pytest.approx(post["gpu_energy_j"]), put
    assert "closed its connection with no answer" in (put["energy_note"] or ""), put


@pytest.mark.parametrize("back_as", [("server_restart",), ("counter_below",)], ids=["restart", "counter_below"])
def test_a_death_refused_connects_proved_is_one_though_the_page_back_says_no_restart(back_as):
    # The daemon's proxy's connects refused at 1.56 s (`Scraper._proxy_refused`), then a page at or past the old reading:
    # the window says counter_below (`Scraper._down_back`), not server_restart, with its refused down_ns. Nothing
    # listened: a death all the same. Before, only server_restart recorded one: a whole answer (from 0.5 s, 100 W)
    # closed with no answer at 1.55 s was written not costed (None J, 0 tokens; told as a restart 110 J, 42 tokens), its
    # energy the neighbours' in rows unflagged; a run-on of the old process went on past its death (400 tokens,
    # 1010 J for 41 and 110 told as a restart).
    from powerprof.daemon.proxy import CRASHED_NOTE
    kw = dict(back_as=back_as, down_ns=int(1.56 * S), down_refused=True)
    row = _llamacpp_whole_run_on([(1.5, 1.6)], leave=1.55, end_s=6.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", **kw)
    print(row["attributed_tokens"], row["gpu_energy_j"], row["energy_note"])
    assert 60.0 <= (row["gpu_energy_j"] or 0) <= 130.0, row
    assert "its process died" in (row["energy_note"] or ""), row
    run_on = _llamacpp_whole_run_on([(1.5, 1.6)], **kw)  # its client left at 0.6 s; llama-server runs it on
    print(run_on["attributed_tokens"], run_on["gpu_energy_j"], run_on["energy_note"])
    assert run_on["gpu_energy_j"] == pytest.approx(100.0, abs=10.5), run_on  # to the death, none after


@pytest.mark.parametrize("back_as", [("server_restart",), ("counter_below",)], ids=["restart", "counter_below"])
def test_a_run_on_ended_by_a_death_only_refusals_proved_says_it_died_not_that_it_restarted(back_as):
    # The scene above's run-on (its client gone at 0.6 s, llama-server running it on), its process's death proved by a
    # refused connect at 1.56 s. Where the page back says no restart (counter_below: the proxy's refusals alone proved
    # the death), its row said "... until it restarted (...)", a restart nothing saw; it says the process died, by the
    # refused connection, and no page saying a restart. Told as a restart, it still says so.
    note = _llamacpp_whole_run_on([(1.5, 1.6)], back_as=back_as, down_ns=int(1.56 * S),
                                  down_refused=True)["energy_note"] or ""
    print(note)
    if back_as == ("server_restart",):
        assert "ran on after its client left, about 0.9 s, until it restarted (" in note, note
        return
    assert "until it restarted" not in note, note
    assert ("ran on after its client left, about 0.9 s, until its process died (a connection to the server refused "
            "0.06 s after its last scrape, and no page after it said a restart: ") in note, note


@pytest.mark.parametrize("how", [("PUT", "/v1/chat/completions", "openai-chat"), ("PUT", "/completion", "llamacpp"),
                                 ("PUT", "/v1/completions", "openai-completions")], ids=["chat", "llamacpp", "completions"])
def test_a_put_to_a_path_other_than_sglangs_generate_closed_at_a_crash_is_not_costed_to_it(how):
    # Only SGLang's /generate takes PUT: llama-server answers it 404 on every route, the vLLM and SGLang flavours' other
    # generation routes 405, so such a request never ran. Before: `_crash_seen` took a PUT on any generation API, and
    # each was costed 110 J (truth 0) as run until the crash closed it.
    from powerprof.daemon.proxy import CRASHED_NOTE
    row = _llamacpp_whole_run_on([(1.5, 2.0)], whole_as=how, leave=1.55, end_s=6.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S), down_refused=True)
    print(row["gpu_energy_j"], row["energy_note"])
    assert not row["gpu_energy_j"], row


@pytest.mark.parametrize("method", ["PUT", "POST"])
def test_generate_closed_at_a_crash_is_costed_by_the_servers_kind_not_its_path_alone(method):
    # Only SGLang runs /generate: llama-server (and vLLM) answer it 404 to every method, so such a request closed at
    # the crash never ran. Before: costed by its path alone, PUT and POST /generate on llama-server 110 J each (truth
    # 0). A server whose kind is not known (serves_generate None): costed as SGLang's, flagged with why.
    from powerprof.daemon.proxy import CRASHED_NOTE
    kw = dict(whole_as=(method, "/generate", "sglang-generate"), leave=1.55, end_s=6.0, outcome="upstream_error",
              error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S), down_refused=True, idle_first=True)
    llama = _llamacpp_whole_run_on([(1.5, 2.0)], serves_generate=False, **kw)
    sglang = _llamacpp_whole_run_on([(1.5, 2.0)], **kw)
    unknown = _llamacpp_whole_run_on([(1.5, 2.0)], serves_generate=None, **kw)
    print(llama["gpu_energy_j"], sglang["gpu_energy_j"], unknown["gpu_energy_j"], unknown["energy_note"])
    assert not llama["gpu_energy_j"], llama
    assert 60.0 <= (sglang["gpu_energy_j"] or 0) <= 130.0 and UNSURE_FLAG not in (sglang["energy_note"] or ""), sglang
    assert unknown["gpu_energy_j"] == pytest.approx(sglang["gpu_energy_j"]), unknown
    assert UNSURE_FLAG in unknown["energy_note"] and "whose kind the daemon does not know" in unknown["energy_note"]


@pytest.mark.parametrize("reload_s", [None, 13.0], ids=["restart", "reload_open"])
def test_a_close_with_no_answer_in_flight_at_a_503_found_down_restart_is_costed_to_the_crash(reload_s):
    # llama-server binds its port at once when it restarts and answers every endpoint, /metrics too, 503 "Loading
    # model" while it loads: a scrape finds it down by a 503, nothing refused. A whole answer that arrived at 0.5 s,
    # before the old process's last good scrape at 1.5 s (alive after it was sent), closed with no answer at 1.55 s: in
    # flight at a live server and closed by its death. Needing a refused scrape or a broken connection, it was not costed
    # (0 J, truth about 100 J here); down 10 s or more (`reload_s`: the new process's first page at 13 s), the 503's
    # open window (`Ledger.note_down`) must cost it before SCRAPE_HOLD_S writes its row.
    from powerprof.daemon.proxy import CRASHED_NOTE
    up = 2.0 if reload_s is None else reload_s
    row = _llamacpp_whole_run_on([(1.5, up)], leave=1.55, end_s=up + 10.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S),
                                 opened=None if reload_s is None else (1.6, None))
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert 60.0 <= (row["gpu_energy_j"] or 0) <= 130.0, row
    assert "closed its connection with no answer" in note, note
    # No death shown (no refused scrape, no broken proxied connection): a queuing router in front (llama-swap holding
    # it while it swaps models, a new process after) refuses a request it held, never run, the same way. Worded a sure
    # crash, it read 55 J / 22 tokens for a truth of 0 in review. Both readings, flagged: left out of J/token.
    assert UNSURE_FLAG in note and "refusing it unrun" in note and "its process died" not in note, note
    assert "scrape the server's own port (scrape.url)" in note, note


@pytest.mark.parametrize("beside", [(0.5, 1.45), (0.8, 1.55), (1.0, 2.95)], ids=["ended_before", "ended_at", "live_on"])
def test_the_requests_beside_an_unsure_crash_are_flagged_with_their_gain_had_it_never_run(beside):
    # A whole answer in flight 0.5-1.55 s closed with no answer, a 503 finding the server down, no death shown: costed as
    # the crash it most likely was, unsure (`crash_unsure`: a queuing router refusing a request it held, never run,
    # reads the same). A stream (40 tokens/s) live beside it over `beside`: its share there is low by that request's
    # figure if it never ran. Before, only the close's own row was flagged; the stream's read 50.6 / 42.4 / 82.1 J for
    # 100 / 75 / 109.1 J against the same scene with no such request (-49 / -43 / -25%, no idle measured), its note
    # silent on the close (out of J/token all the same, for another reason: bypass-uncounted over the restart). Now it
    # says what the split re-run without the close gives it and is flagged, as beside a close that may have queued
    # unrun (`queued_short_j`); beside a crash a refused scrape proved, it is not. The re-run's gain is the truth's
    # (44.4 / 35.6 / 27.0 J), the idle power measured first in all three scenes (`idle_first`). Without, the stream
    # ended inside the close's last interval (1.5-1.6 s) said 5 J more: the truth learned the idle power from 0.5-0.8 s,
    # idle only with no close, the re-run none; each row is now flagged for that too (rowtext._idle_unmeasured).
    # (Ends on a tick, 1.5 / 3.0 s, read 10 J more: a request alone in an interval it touches at its end's instant
    # takes it whole, the truth's row gone by then.)
    from powerprof.daemon.proxy import CRASHED_NOTE
    kw = dict(leave=1.55, end_s=12.0, outcome="upstream_error", error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S),
              beside=beside, idle_first=True)
    rows = _llamacpp_whole_run_on([(1.5, 2.0)], **kw)
    truth = _llamacpp_whole_run_on([(1.5, 2.0)], with_whole=False, **kw)
    sure = _llamacpp_whole_run_on([(1.5, 2.0)], down_refused=True, **kw)
    near, near0, note = rows[5], truth[5], rows[5]["energy_note"] or ""
    print(rows[2]["gpu_energy_j"], near["gpu_energy_j"], near0["gpu_energy_j"], note[:600])
    assert UNSURE_FLAG in (rows[2]["energy_note"] or "") and "refusing it unrun" in rows[2]["energy_note"], rows[2]
    assert near0["gpu_energy_j"] - near["gpu_energy_j"] >= 0.1 * near0["gpu_energy_j"], (near, near0)  # the scene
    assert UNSURE_FLAG in note and "refused unrun by a queuing router" in note, note
    assert BYPASS_LOW_FLAG in note, note  # out of J/token before too: its intervals reach the restart (1.5-1.6 s)
    said = float(note.split("had it never run, this figure would be ")[1].split(" J")[0])
    gain = near0["gpu_energy_j"] - near["gpu_energy_j"]
    assert said == pytest.approx(gain, abs=0.2), (said, gain, near0)
    assert UNSURE_FLAG not in (sure[5]["energy_note"] or ""), sure[5]  # a death shown: a sure crash, sure neighbours
    assert sure[5]["gpu_energy_j"] == pytest.approx(near["gpu_energy_j"]), sure[5]


def test_a_503_window_with_no_restart_after_costs_nothing():
    # A router (nginx limit_req, an auth proxy) answers the metrics page 503 from 1.6 s to 13 s, no restart after: the
    # same process back. A whole answer it held from 0.5 s and closed with no answer at 1.55 s never ran (truth 0 J).
    # The window a 503 alone opened (`Ledger.note_down`, none refused) costed it at once as a crash: 119 J in review,
    # about 105 J here. It costs nothing until a page confirms a restart; none does: 0 J, its row saying both readings.
    from powerprof.daemon.proxy import CRASHED_NOTE
    row = _llamacpp_whole_run_on([(1.5, 13.0)], leave=1.55, end_s=23.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", opened=(1.6, None), same_process=True)
    note = (row["energy_note"] or "") + (row.get("energy_flags") or "")
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert not row["attributed_tokens"] and not row["gpu_energy_j"], row
    assert "its process died" not in note and "may have run" in note, note


class _RowWriteTimes(list):
    """Given as the llama.cpp run-on helper's `ledgers`: each ledger's `advance` noted, and the daemon loop's time (s)
    request 2's row went out at appended to `written_s`."""

    def __init__(self, written_s: list):
        super().__init__()
        self.written_s = written_s

    def append(self, led):
        super().append(led)
        advance, emit, now = led.advance, led.emit, [0]

        def timed(now_ns, *a, **kw):
            now[0] = now_ns
            return advance(now_ns, *a, **kw)

        def watched(name, rows):
            if name == "requests" and any(r["request_id"] == 2 for r in rows):
                self.written_s.append(now[0] / S)
            emit(name, rows)

        watched.rows = emit.rows
        led.advance, led.emit = timed, watched


def test_a_close_held_for_a_loading_page_past_down_hold_max_s_is_written_and_said(monkeypatch):
    # A whole answer in flight from 0.5 s closes with no answer at 1.55 s; llama-server's 503 "Loading model" from 1.6 s
    # alone opens the window (`Ledger.note_down`, none refused), so its row waits for a page confirming the restart
    # (`Ledger._down_hold`), at most DOWN_HOLD_MAX_S: cut to 15 s here (past SCRAPE_HOLD_S, as the 120 s is), the page
    # at 40 s comes too late. What a user relies on: the row is written once the cap passes, while the server is still
    # down (not lost, nor held to the stop), costed as the crash it most likely was (sent before the old process's last
    # good scrape), said and flagged: right if that was a crash, high if the page was no restart. Before, it was
    # written at 0 J (flagged), its run's energy in the requests' beside it, unflagged (the review's scene: 4 streams
    # cut beside it +10.3%).
    import powerprof.daemon.ledger as ledger_mod
    from powerprof.daemon.proxy import CRASHED_NOTE
    monkeypatch.setattr(ledger_mod, "DOWN_HOLD_MAX_S", 15.0)
    written_s = []  # the daemon loop's time its row went out at

    ledgers = _RowWriteTimes(written_s)
    row = _llamacpp_whole_run_on([(1.5, 40.0)], leave=1.55, end_s=50.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", opened=(1.6, None), ledgers=ledgers)
    note = row["energy_note"] or ""
    print(written_s, row["attributed_tokens"], row["gpu_energy_j"], note)
    assert written_s and 15.5 <= written_s[0] <= 17.0, written_s  # the cap after its close, the server still down
    assert 95.0 <= row["gpu_energy_j"] <= 115.0, row  # run 0.5 s to 1.55 s alone at 100 W: about 105 J
    # Said: both readings, the wait and its fix (before: the words of a close no scrape saw at all).
    assert "its row waited 15 s for a scrape to confirm the restart" in note and '503 "Loading model"' in note, note
    assert "may never have run" in note and "costed as the crash it most likely was" in note and "fix:" in note, note
    # Flagged: counted apart (analyze's uncertain_requests, the daemon's /metrics counter).
    assert UNSURE_FLAG in note and ledgers[0].flagged_requests[UNSURE_FLAG] == 1, note


@pytest.mark.parametrize("page_s", [33.0, 60.0], ids=["page_within_cap", "page_past_cap"])
def test_a_long_close_held_for_a_loading_page_waits_from_its_death_not_its_arrival(monkeypatch, page_s):
    # A whole answer decoding from 0.5 s (max_tokens 2000, 40 tokens/s) closes with no answer at 19.95 s, past
    # DOWN_HOLD_MAX_S (cut to 15 s) after its arrival; llama-server's 503 "Loading model" alone from 20.0 s opens the
    # window (`Ledger.note_down`). Its row waits for the confirming page at most the cap from that first found-down
    # scrape (20.0 s + 15 s). Before, the cap was counted from its arrival: let go at once at 20.0 s, its row written
    # at 30.0 s (SCRAPE_HOLD_S after its close) flagged unsure and saying it had waited 15 s, though the page at 33 s
    # confirmed the restart (a sure crash, unflagged); with no page, written at 30.0 s, not at the cap.
    import powerprof.daemon.ledger as ledger_mod
    from powerprof.daemon.proxy import CRASHED_NOTE
    monkeypatch.setattr(ledger_mod, "DOWN_HOLD_MAX_S", 15.0)
    written_s = []

    row = _llamacpp_whole_run_on([(19.9, page_s)], leave=19.95, max_tokens=2000, end_s=page_s + 10.0,
                                 outcome="upstream_error", error=f"{CRASHED_NOTE}: closed", opened=(20.0, None),
                                 ledgers=_RowWriteTimes(written_s))
    note = row["energy_note"] or ""
    print(page_s, written_s, row["attributed_tokens"], row["gpu_energy_j"], note)
    if page_s < 35.0:  # the page within the cap: a sure crash, written once it came
        assert written_s and page_s <= written_s[0] <= page_s + 2.0, written_s
        assert UNSURE_FLAG not in note and "waited" not in note, note
    else:  # none within it: let go at the cap after the window opened, while the server is still down
        assert written_s and 35.0 <= written_s[0] <= 36.5, written_s
        assert UNSURE_FLAG in note and "its row waited 15 s" in note, note
    assert 1850.0 <= (row["gpu_energy_j"] or 0) <= 2050.0, row  # run 0.5 s to 19.95 s alone at 100 W: about 1945 J


@pytest.mark.parametrize("end", ["window_dropped", "shutdown"])
def test_a_long_close_written_as_not_run_with_a_share_from_intervals_closed_under_it_is_flagged_partial(end):
    # A whole answer decoding from 0.5 s closes with no answer at 20.0 s; llama-server's 503 "Loading model" alone
    # from 20.0 s opens the window, so its row waits for a page. The ledger's holds (max_hold_s, prompt_hold_s: 120 s
    # and 30 s, cut to 10 s here as a run past them does) closed its first intervals while it was in flight, giving it
    # a share by live time. No page confirms a restart: the same process is back at 25 s (the window dropped), or the
    # daemon stops at 30 s with the server still down. Written as not run, it kept that share: in review 2940 J of a
    # 150 s run's 14950 J, unflagged and with no note, counted in J/token (0 tokens). Partial either way (high if it
    # never ran, low if it ran to its close): flagged, said.
    from powerprof.daemon.proxy import CRASHED_NOTE

    class Short(list):  # given the helper's ledger: its holds cut to 10 s
        def append(self, led):
            led.max_hold_ns = led.prompt_hold_ns = int(10 * S)
            super().append(led)

    ledgers = Short()
    downs, end_s = ([(19.9, 25.0)], 35.0) if end == "window_dropped" else ([(19.9, 1000.0)], 30.0)
    row = _llamacpp_whole_run_on(downs, leave=20.0, max_tokens=2000, end_s=end_s, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", opened=(20.0, None), same_process=True,
                                 ledgers=ledgers)
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert not row["attributed_tokens"], row
    assert row["gpu_energy_j"] and 500.0 <= row["gpu_energy_j"] <= 1200.0, row  # its first ~9.5 s at 100 W, alone
    assert UNSURE_FLAG in note and "partial" in note and "fix:" in note, note
    assert ledgers[0].flagged_requests[UNSURE_FLAG] == 1, note  # counted apart: left out of J/token
    # The daemon scraped the server all along and saw no restart cover the close: "let the daemon scrape the server"
    # (said before) was no fix; only the server's or router's log says whether it ran.
    assert "let the daemon scrape" not in note, note
    assert "fix: none at the proxy: the daemon scrapes the server and saw no restart cover that close" in note, note


def test_a_close_in_a_loading_page_s_window_with_a_proxied_connection_broken_then_is_costed_at_once(monkeypatch):
    # The same close (a whole answer in flight from 0.5 s, closed with no answer at 1.55 s, llama-server's 503 "Loading
    # model" alone from 1.6 s, the confirming page at 40 s past the cap, cut to 15 s), but another request's connection
    # broke at 1.55 s too: a death shown (`_death_shown`), as the page's restart would be. Before, the window ignored it
    # with no scrape refused: held to the cap and written at 0 J (flagged), its run the requests' beside it. Now costed
    # at once as a crash (about 105 J: 0.5 s to 1.55 s alone at 100 W), sure, written long before the cap.
    import powerprof.daemon.ledger as ledger_mod
    from powerprof.daemon.proxy import CRASHED_NOTE
    monkeypatch.setattr(ledger_mod, "DOWN_HOLD_MAX_S", 15.0)
    row = _llamacpp_whole_run_on([(1.5, 40.0)], leave=1.55, end_s=50.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", opened=(1.6, None), fail_at=1.55, idle_first=True)
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert 95.0 <= (row["gpu_energy_j"] or 0) <= 115.0, row
    assert "a crash: its process died" in note and UNSURE_FLAG not in note and "waited" not in note, note


@pytest.mark.parametrize("fail_closed,reload_s", [(False, None), (True, None), (False, 13.0)],
                         ids=["alone", "another_closed", "reload_open"])
def test_a_close_with_no_answer_beside_a_503_and_a_counter_dip_is_not_costed_as_a_crash(fail_closed, reload_s):
    # A router in front of the server answers the metrics page 503 (found down, nothing refused), a counter's dip then
    # makes a restart window, and it holds then closes a request with no answer (it never reached the server: 0 J).
    # Matched on the found-down scrape alone, it was costed as a crash, 84-104 J (truth 0). A router refuses only what
    # arrives after the death (here at 1.52 s, after the last good scrape at 1.5 s): such a close needs proof of a death
    # as the run-on cut's (`Ledger._death_proven`): a refused scrape, or a proxied connection broken then; another
    # request closed with no answer is none (the router closes so too). Nor does the 503's open window cost it
    # (`reload_s`: down until 13 s, told to the ledger at once). Its row says both readings.
    from powerprof.daemon.proxy import CRASHED_NOTE
    up = 2.0 if reload_s is None else reload_s
    row = _llamacpp_whole_run_on([(1.5, up)], arrive=1.52, leave=1.55, end_s=up + 10.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: closed", down_ns=int(1.6 * S),
                                 opened=None if reload_s is None else (1.6, None),
                                 **({"fail_at": 1.6, "fail_closed": True} if fail_closed else {}))
    note = (row["energy_note"] or "") + (row.get("energy_flags") or "")
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert not row["attributed_tokens"] and not row["gpu_energy_j"], row
    assert "its process died" not in note and "may have run" in note, note


def test_a_request_that_arrived_after_the_old_process_last_scrape_is_cut_by_its_death():
    # The old process last answered a scrape at 1.5 s; the whole answer arrived at 1.52 s (the old process took it: the
    # scrape at 1.6 s found nothing listening), its client left at 1.58 s, the process died at 1.59 s, the new one's
    # first scrape at 11.5 s (a 10 s model load). Truth at 100 W: 1.52 s to 1.59 s, about 2 tokens, at most 7 J.
    # Matched only by a restart whose window began after its arrival, none ended its run-on: held to its max_tokens,
    # 400 tokens and 1001 J, its row saying it ran on to them over the new process's load.
    # The scrape at 1.6 s found nothing listening (a refused connection): proof of the death (`Ledger._death_proven`).
    row = _llamacpp_whole_run_on([(1.5, 11.5)], arrive=1.52, leave=1.58, down_ns=int(1.6 * S), down_refused=True)
    assert row["attributed_tokens"] <= 3.0, row
    assert row["gpu_energy_j"] <= 10.0 + 1e-6, row  # the 0.1 s interval it was live in
    note = row["energy_note"] or ""
    assert "until its max_tokens" not in note and "the process that had it" in note, note


@pytest.mark.parametrize("runs_on,end_s,want_tokens", [((2.0, 4.0), 12.0, 159.6), ((None, None), 25.0, 400.0)],
                         ids=["sglang", "llamacpp"])
def test_a_false_found_down_scrape_after_the_arrival_does_not_cut_its_run_on(runs_on, end_s, want_tokens):
    # The same whole answer (arrived 1.52 s, after the last good scrape at 1.5 s, its client gone at 1.54 s), but the
    # scrape at 1.55 s found the server "down" by a 503 (a router's, a loading page's), and a counter's dip then made a
    # restart window: no refused connection, no proxied request failing. The process lived and ran it on: SGLang to
    # its 4 s wait (about 160 tokens, 400 J at 100 W), llama.cpp to its max_tokens (400, 1001 J). Taken for a death,
    # it was cut at 1.55 s: 0.6 tokens and 2.5 J. Not cut, its row says both readings.
    row = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.54, end_s=end_s, runs_on=runs_on,
                                 down_ns=int(1.55 * S))
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert row["attributed_tokens"] == pytest.approx(want_tokens, rel=0.05), row
    assert "uncertain" in note and "if that was its process's death" in note and "fix:" in note, note
    # Its client still there after that scrape (1.58 s): its connection was open, so the process was alive; no doubt.
    later = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.58, end_s=end_s, runs_on=runs_on,
                                   down_ns=int(1.55 * S))
    assert "uncertain" not in (later["energy_note"] or ""), later["energy_note"]
    # The same found-down scrape where its connection was refused, or a proxied request's connection to the server was
    # refused then: a death, cut there.
    for proof in ({"down_refused": True}, {"fail_at": 1.6}):
        cut = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.54, end_s=end_s, runs_on=runs_on,
                                     down_ns=int(1.55 * S), **proof)
        assert cut["attributed_tokens"] <= 3.0, (proof, cut)
        assert "uncertain" not in (cut["energy_note"] or ""), cut["energy_note"]
    # A proxied request closed with no answer then is no proof: a router refusing closes so (beside its 503 on the
    # metrics page, taken for one the live run-on was cut to 0.6 tokens and 2.5 J, its row sure: session 59's review).
    closed = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.54, end_s=end_s, runs_on=runs_on,
                                    down_ns=int(1.55 * S), fail_at=1.56, fail_closed=True)
    assert closed["attributed_tokens"] == pytest.approx(want_tokens, rel=0.05), closed
    assert "uncertain" in (closed["energy_note"] or ""), closed["energy_note"]


@pytest.mark.parametrize("runs_on,end_s", [((2.0, 4.0), 12.0), ((None, None), 25.0)], ids=["sglang", "llamacpp"])
def test_an_uncertain_run_on_is_marked_to_be_left_out_of_j_per_token(runs_on, end_s):
    # The run-on a found-down scrape may or may not have cut (the scene above): its figure is either right or nearly all
    # too much (400 J where a death at 1.55 s gives 2.5 J), and only its note's prose said so, so `analyze` counted it
    # in J/token. Its energy_note carries UNSURE_FLAG (analyze leaves such rows out); the sure ones beside do not.
    leds = []
    row = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.54, end_s=end_s, runs_on=runs_on,
                                 down_ns=int(1.55 * S), ledgers=leds)
    note = row["energy_note"] or ""
    assert f"{UNSURE_FLAG}: a scrape" in note and "if that was its process's death" in note, note
    assert leds[0].flagged_requests.get(UNSURE_FLAG) == 1, leds[0].flagged_requests  # on /metrics too
    assert row["gpu_energy_j"] > 100.0, row  # its best reading stays on the row, marked
    later = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.58, end_s=end_s, runs_on=runs_on,
                                   down_ns=int(1.55 * S))
    assert UNSURE_FLAG not in (later["energy_note"] or ""), later["energy_note"]
    cut = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=1.52, leave=1.54, end_s=end_s, runs_on=runs_on,
                                 down_ns=int(1.55 * S), down_refused=True, ledgers=leds)
    assert UNSURE_FLAG not in (cut["energy_note"] or ""), cut["energy_note"]
    assert leds[1].flagged_requests.get(UNSURE_FLAG, 0) == 0, leds[1].flagged_requests


@pytest.mark.parametrize("downs,back_as,past_reach", [
    ([], (), False), ([(1.5, 1.6)], (), True), ([(1.5, 1.6)], ("counter_below",), False),
    ([(1.5, 1.6)], ("server_restart",), False), ([(5.0, 5.1)], (), True)],
    ids=["alive", "past_reach", "young_page", "restarted", "past_reach_after_its_end"])
def test_a_refused_scrape_then_a_page_past_a_new_processs_reach_leaves_an_sglang_run_on_unsure(downs, back_as,
                                                                                                past_reach):
    # SGLang's whole answer (0.5 s, its client gone at 1.0 s) runs on to its 4 s wait (4.5 s) beside a stream (0.2 s to
    # 3.0 s). Its last scrape at 1.5 s, the next refused (1.55 s), the page at 1.6 s past anything a new process could
    # have counted since (scrape.Scraper.window_past_reach): the same process back, or a restarted one whose counter
    # persisted. Taken for a death (the refusal kept, `_died_unrestarted`), its run-on was cut at 1.525 s: 40.6 tokens
    # and 54 J, unflagged, for 159.6 and 271 where the same process lived on (`alive`), the stream 209 J for 142. Now it
    # runs on, its row says both readings (UNSURE_FLAG), and the windows over the rest of its run-on say run_on_may_end,
    # the stream's row flagged. A page that could be a new process's (young: counter_below) or a restart the page said
    # is a death: cut there, as before. Past reach after its run-on's end (5.0 s): nothing of it in doubt, unflagged.
    late = downs == [(5.0, 5.1)]
    rows = _llamacpp_whole_run_on(downs, arrive=0.5, leave=1.0, end_s=12.0, runs_on=(2.0, 4.0), beside=(0.2, 3.0),
                                  back_as=back_as, down_ns=int((5.05 if late else 1.55) * S), down_refused=True,
                                  past_reach=past_reach)
    run_on, near = rows[2], rows[5]
    note, near_note = run_on["energy_note"] or "", near["energy_note"] or ""
    print(run_on["attributed_tokens"], run_on["gpu_energy_j"], near["gpu_energy_j"], note)
    if not downs or past_reach:
        assert run_on["attributed_tokens"] == pytest.approx(159.6, abs=1), run_on
        assert run_on["gpu_energy_j"] == pytest.approx(270.6, abs=5), run_on
        assert near["gpu_energy_j"] == pytest.approx(142.4, abs=5), near
    if past_reach and not late:
        assert f"{UNSURE_FLAG}: a scrape 1.05 s after its arrival found nothing listening" in note, note
        assert "past anything a new process could have counted" in note and "at most 1.05 s" in note, note
        assert "run_on_may_end" in near_note, near_note
        # The fix the death asks for, on the rows beside it too (before: run_on_may_end's clients' fix alone).
        assert "scrape.url" in near_note and "PROMETHEUS_MULTIPROC_DIR" in near_note, near_note
    else:
        assert UNSURE_FLAG not in note, note
    if downs and not past_reach:
        assert run_on["attributed_tokens"] == pytest.approx(40.6, abs=1), run_on


@pytest.mark.parametrize("unsure_first", [False, True], ids=["restart_alone", "past_reach_then_restart"])
def test_an_unsure_death_then_a_sure_restart_cuts_the_run_on_at_the_restart(unsure_first):
    # SGLang's whole answer (0.5 s, its client gone at 1.0 s, run on to its 4 s wait at 4.5 s) beside a stream (0.2 s to
    # 2.4 s). A refused scrape at 1.55 s, the page at 1.6 s past a new process's reach (unsure: `_death_unsure`); then a
    # refused scrape at 2.55 s and a page at 2.6 s that says server_restart (sure). Whatever the first was, the process
    # running it was dead by the second: taking the earliest death alone, the unsure one hid the sure one, 159.6 tokens
    # and 301 J, the new process's energy to 4.5 s on a dead request; both readings the row said were wrong (the truth
    # is 80.6 tokens at most). Now cut at the sure restart (80.6 tokens, 114 J, as the restart alone), its row still
    # saying the first reading (dead at 1.55 s), the stream's rows beside it flagged run_on_may_end.
    reach = {16: dict(partial=(), down_ns=int(1.55 * S), down_refused=True, past_reach=True)}
    restart = {26: dict(partial=("server_restart",), down_ns=int(2.55 * S), down_refused=True)}
    rows = _llamacpp_whole_run_on([], arrive=0.5, leave=1.0, end_s=12.0, runs_on=(2.0, 4.0), beside=(0.2, 2.4),
                                  windows={**(reach if unsure_first else {}), **restart})
    run_on, near = rows[2], rows[5]
    note, near_note = run_on["energy_note"] or "", near["energy_note"] or ""
    print(run_on["attributed_tokens"], run_on["gpu_energy_j"], near["gpu_energy_j"], note)
    assert run_on["attributed_tokens"] == pytest.approx(80.6, abs=1), run_on
    assert run_on["gpu_energy_j"] == pytest.approx(114.4, abs=5), run_on
    assert "until it restarted" in note, note
    said = f"{UNSURE_FLAG}: a scrape 1.05 s after its arrival found nothing listening" in note
    assert said == unsure_first and ("at most 1.05 s" in note) == unsure_first, note
    assert ("run_on_may_end" in near_note) == unsure_first, near_note


@pytest.mark.parametrize("past_reach,opened", [(True, None), (True, (1.55, 1.55)), (False, None)],
                         ids=["past_reach", "past_reach_told_down", "restarted"])
def test_a_close_with_no_answer_at_a_death_past_a_new_processs_reach_says_both_readings(past_reach, opened):
    # SGLang's whole answer (0.5 s) beside a stream (0.2 s to 3.0 s), its connection closed with no answer at 1.52 s, a
    # scrape refused at 1.55 s, the page at 1.6 s past a new process's reach: a restarted process whose counter
    # persisted (the crash, as costed: 40.8 tokens, 52 J), or the same process back, which saw the close and ran it on
    # to its 4 s wait (4.5 s: 159.6 tokens, 271 J, the stream 142 J). Costed as a sure crash, both rows were unflagged,
    # the stream 221 J (+55%); now the crash's row says both readings and the stream's says run_on_may_end, whether or
    # not the daemon was told of the refusal first (`note_down`, which costs it as a crash at once). A restart the page
    # said keeps it a sure crash, the stream unflagged.
    from powerprof.daemon.proxy import CRASHED_NOTE

    rows = _llamacpp_whole_run_on([(1.5, 1.6)], arrive=0.5, leave=1.52, end_s=12.0, runs_on=(2.0, 4.0),
                                  beside=(0.2, 3.0), back_as=() if past_reach else ("server_restart",),
                                  down_ns=int(1.55 * S), down_refused=True, past_reach=past_reach, opened=opened,
                                  outcome="upstream_error", error=CRASHED_NOTE + ": connection closed")
    crash, near = rows[2], rows[5]
    note, near_note = crash["energy_note"] or "", near["energy_note"] or ""
    print(crash["attributed_tokens"], crash["gpu_energy_j"], near["gpu_energy_j"], note, near_note)
    assert crash["attributed_tokens"] == pytest.approx(40.8, abs=1), crash
    assert (UNSURE_FLAG in note) == past_reach, note
    assert ("the same process back" in note and "to its next 4 s wait" in note) == past_reach, note
    assert ("PROMETHEUS_MULTIPROC_DIR" in note) == past_reach, note
    assert ("run_on_may_end" in near_note) == past_reach, near_note


def test_a_restart_told_by_the_counter_fall_alone_leaves_run_ons():
    # A grown SGLang multi-process counter read at half for one page passes for a restart (scrape.counter_restarted):
    # nothing was down, no start time moved (`restart_by_fall`). The stream its server ran on to 3.0 s decoded to
    # there: 100 tokens, 250 J at 100 W. Cut at that window, 35.6 tokens and 90 J (-64%).
    row = _sglang_stream_run_on(down=1.45, up=1.5, restart_by_fall=True)
    assert row["attributed_tokens"] == pytest.approx(100, abs=2), row
    assert row["gpu_energy_j"] == pytest.approx(250.0, abs=10.5), row
    assert "until it restarted" not in (row["energy_note"] or ""), row["energy_note"]


@pytest.mark.parametrize("runs_on,down,up,leave,down_ns,truth_n,truth_j", [
    ((2.0, 4.0), 1.5, 1.6, 3.0, int(1.55 * S), 100.0, 250.0),
    ((2.0, 4.0), 1.5, 1.6, 3.0, None, 100.0, 250.0),
    ((None, None), 0.6, 0.9, 1.0, int(0.7 * S), 400.0, 1001.0),
    ((None, None), 0.6, 0.9, 1.0, None, 400.0, 1001.0)],
    ids=["sglang_found_down", "sglang_none_found_down", "llamacpp_found_down", "llamacpp_none_found_down"])
def test_a_restart_before_the_client_left_is_not_the_death_of_the_process_that_had_it(runs_on, down, up, leave, down_ns,
                                                                                       truth_n, truth_j):
    # The whole answer (from 0.5 s) is served throughout; its client leaves at `leave`, after a restart window (down,
    # up) that found the server down at `down_ns` (a 503 or refused scrape, then a page whose counter dipped: an SGLang
    # multi-process page behind a router), or by none. A process that dies closes the proxy's connection to it, which
    # ends its requests there as upstream_error: this one's was open when its client left, so that restart was not its
    # process's death. SGLang runs it on to its 4 s wait (4.5 s): decoded 0.51 s to 3.0 s at least, about 100 tokens
    # and 250 J at 100 W; costed to the restart's found-down scrape (f38e2c41), 40.6 tokens and 110 J. llama.cpp runs
    # it on to its max_tokens, 400 tokens. (The scene that change was made for, the process dead at 0.65 s and the
    # client gone at 1.0 s as client_disconnected, does not arise through the proxy.)
    row = _llamacpp_whole_run_on([(down, up)], leave=leave, end_s=12.0 if runs_on[0] else 25.0, runs_on=runs_on,
                                 down_ns=down_ns)
    assert row["attributed_tokens"] >= truth_n - 2.0, row
    assert row["gpu_energy_j"] >= truth_j - 10.5, row
    assert "until it restarted" not in (row["energy_note"] or ""), row["energy_note"]


def test_a_whole_answer_whose_client_left_as_the_server_was_found_down_is_costed_to_the_leaving():
    # The server last answered a scrape at 0.5 s, as the whole answer arrived; its client left at 0.6 s, when a scrape
    # found the server down; the new process's first scrape at 2.0 s. The proxy saw the connection to its process open
    # at 0.6 s (a death would have ended it there as upstream_error): its process died then or after, and it is costed
    # to 0.6 s, 3.6 tokens and 20 J at the 0.1 s intervals' grain, its row saying its end is the leaving. (A process
    # dead at 0.55 s, 1.6 tokens and 5 J, with a client_disconnected at 0.6 s, is not what the proxy records.)
    row = _llamacpp_whole_run_on([(0.55, 2.0)], leave=0.6, down_ns=int(0.6 * S))
    assert row["attributed_tokens"] == pytest.approx(3.6, abs=1.0), row
    assert row["gpu_energy_j"] <= 20.0 + 1e-6, row
    note = row["energy_note"] or ""
    assert "did not run it on after its client left: the process that had it died as its client left" in note, note
    assert "its client's leaving" in note, note


@pytest.mark.parametrize("late", [0.9, 1.2])
def test_a_stream_run_on_placed_before_the_restart_was_known_is_cut_there_too(late):
    # The restart's window (the old process last scraped at 2.0 s) reaches the ledger 0.9-1.2 s after its stamp (a
    # long GET), after the stream's run-on to 3.0 s was placed (`_place_run_ons`): its events past 2.0 s stayed, 100.6
    # tokens (truth 60), the row saying both "nothing decoded it after" the cut and 81 tokens decoded after its client
    # left. They are taken out, and its run-on's tokens with them.
    row = _sglang_stream_run_on(late=late)
    assert row["attributed_tokens"] == pytest.approx(60, abs=2), row
    assert "40 tokens decoded" in row["energy_note"], row["energy_note"]


def test_a_run_on_listed_as_its_max_tokens_end_is_taken_back_where_a_restart_came_first():
    # A sure run-on (ignore_eos) its max_tokens end at 2.0 s (40 of 60 left, 40 tokens/s) is listed as SGLang's length
    # finish (`_place_run_on`); the server died at 1.5 s (its restart's window read 1.0 s late, after that placing), so
    # SGLang never counted it: kept, its tokens lowered the gap, bypass traffic hidden up to them (the review).
    from collections import deque

    class Books(deque):  # what the ledger lists for the scrape windows, and takes back
        def __init__(self):
            super().__init__()
            self.added, self.taken = [], []

        def append(self, x):
            self.added.append(x)
            super().append(x)

        def remove(self, x):
            self.taken.append(x)
            super().remove(x)

    def run(terms=(("eos_ignored", True),), **kw):
        books = Books()
        row = _sglang_stream_run_on(extra={"max_tokens": 60, **dict(terms)},
                                    probe=lambda led: setattr(led.recon, "finished", books), **kw)
        return row, [round(x[1]) for x in books.added if x[0] > 1.2 * S], [round(x[1]) for x in books.taken]

    # Not restarted: listed at its max_tokens' end (2.0 s), its 40 run-on tokens, kept; so with a min_tokens reaching
    # there; not where its answer may have ended by itself (counted then at an end unseen, or aborted: nowhere).
    row, added, taken = run(down=30.0, up=31.0)
    assert row["attributed_tokens"] == pytest.approx(60, abs=1) and (added, taken) == ([40], []), (row, added, taken)
    assert run((("min_tokens", 60),), down=30.0, up=31.0)[1:] == ([40], [])
    assert run((), down=30.0, up=31.0)[1:] == ([], [])
    row, added, taken = run(late=1.0, down=1.5)
    assert row["attributed_tokens"] == pytest.approx(40, abs=2), row  # 20 shown, 20 run on to the death at 1.5 s
    assert (added, taken) == ([40], [40]), (added, taken)


def test_the_intervals_over_a_run_on_that_may_have_ended_by_itself_say_their_bypass_count_may_hold_it():
    # A stream cut at 1.0 s whose answer may end by itself (no ignore_eos) ran on until SGLang's abort at 3.0 s, or
    # ended first, unseen, and SGLang counted its tokens then (here 24 at the 1.6 s scrape): read as bypass tokens, and
    # the intervals there said `complete` (the simulator's scene: the 24 streams beside 4 such -12% to -17%, silent).
    # Their windows now say run_on_may_end (two-way, out of J/token, the requests there flagged), aborted or not (nothing
    # tells); with ignore_eos (sure: placed, not counted at an unseen end) none does. Nothing is listed or taken off:
    # its tokens still read as bypass tokens (listing them hid real bypass traffic where SGLang aborted: 16f65a29).
    got = {}
    for name, extra, counted in (("ended", {}, (1.6, 24.0)), ("aborted", {}, None),
                                 ("ignore_eos", {"eos_ignored": True}, None)):
        box = []
        row = _sglang_stream_run_on(down=30.0, up=31.0, extra=extra, counted=counted, probe=box.append)
        got[name] = (row, box[0].emit.rows["intervals"])
    row, ivs = got["ended"]
    marked = [x for x in ivs if "run_on_may_end" in x["server_count"]]
    assert UNSURE_FLAG in row["energy_note"] and "run_on_may_end" in row["energy_note"], row["energy_note"]
    # Its fix offers no scrape.server = none: that scrapes no server kind, so no SGLang run-on is placed (the
    # simulator's scene: 0 of 24 rows flagged, +9% mean, +36% worst, the cut rows -50% to -70%; before, it was
    # offered; now those rows say uncertain-uncounted, test_daemon_cut_streams.py).
    assert "scrape.server = none" not in row["energy_note"] and "ignore_eos" in row["energy_note"], row["energy_note"]
    assert sum(x["server_tokens"] or 0.0 for x in marked) == pytest.approx(24.0), ivs  # still read, said
    assert all(x["server_count"] == "complete" for x in ivs if 4.5 <= x["t_start_mono_s"] < 15), ivs  # past its windows
    assert any("run_on_may_end" in x["server_count"] for x in got["aborted"][1])
    assert not any("run_on_may_end" in x["server_count"] for x in got["ignore_eos"][1])
    assert UNSURE_FLAG not in (got["ignore_eos"][0]["energy_note"] or "")


def test_the_windows_over_a_run_on_capped_at_its_max_tokens_that_may_end_by_itself_reach_its_abort():
    # Cut at 1.0 s after 20 tokens at 40 tokens/s, max_tokens 30: placed to its max_tokens at that pace, 1.25 s. Its
    # answer free to end, it may stop sooner, or finish its 10 at a real pace slower than the estimate (its batch
    # grown), SGLang counting its 30 at that length finish: here 6 tokens/s, at 2.7 s, before the abort at 3.0 s.
    # Marked only to the capped end (and a second after), those 30 read as bypass tokens in a window saying
    # `complete`; now marked to the abort.
    box = []
    row = _sglang_stream_run_on(down=30.0, up=31.0, extra={"max_tokens": 30}, counted=(2.7, 30.0), probe=box.append)
    ivs = box[0].emit.rows["intervals"]
    assert UNSURE_FLAG in row["energy_note"] and "run_on_may_end" in row["energy_note"], row["energy_note"]
    held = [x for x in ivs if (x["server_tokens"] or 0.0) > 1.0]
    assert held and all("run_on_may_end" in x["server_count"] for x in held), [
        (x["t_start_mono_s"], x["server_tokens"], x["server_count"]) for x in held]


def test_a_sure_capped_run_on_placed_wholly_before_a_closed_interval_is_counted_late_not_a_crash():
    # A whole SGLang answer (ignore_eos, max_tokens 40) whose run-on, capped at its max_tokens, falls wholly before the
    # first interval still open (its early intervals closed under the holds' caps): every placed event was dropped as
    # late, and its listing as SGLang's length finish then read `ts[-1]` of an empty list: IndexError in the split.
    from powerprof.daemon.ledger import _Edge
    from powerprof.daemon.liverequest import LiveRequest

    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.recon.server_seen, led.recon.server_at_finish = True, True
    led.edges.append(_Edge(t_ns=int(10 * S), wall_ns=int(10 * S), counter_j=np.array([0.0]), power_w=np.array([0.0])))
    tr = RequestTrace(1, "POST", "/generate", None, 0, 0, api="sglang-generate", stream=False)
    tr.extra.update(eos_ignored=True, max_tokens=40)
    tr.end_ns = int(1.0 * S)
    r = LiveRequest(tr)
    r.run_on_end_ns = int(3.0 * S)  # SGLang's abort, past its max_tokens' end at 40 tokens/s (2.0 s)
    led._place_run_on(r, int(1.0 * S), 40.0, "a test's")
    assert r.run_on_tokens == pytest.approx(40) and r.run_on_late == pytest.approx(40), (r.run_on_tokens, r.run_on_late)
    assert r.ev_t == [] and r.run_on_listed is None  # nothing placed: counted late, and not listed


@pytest.mark.xfail(strict=True, reason="a known gap (docs/daemon.md): listing them (47667652) made the bypass right and "
                   "the split wrong, the streams beside the last cut answer +50% to +80% in test_daemon_cut_streams.py")
def test_a_whole_answer_llamacpp_runs_on_to_its_end_is_not_read_as_bypass_tokens_when_the_server_counts_it():
    # llama-server counts a whole answer it ran on to its end after its client left (`_run_on`) like any other: its
    # tokens in /slots' n_decoded as it decodes them, then in llamacpp:tokens_predicted_total. The ledger placed them
    # for its energy alone (as SGLang's, which that server counts nowhere), so the scrape windows read them as
    # bypass tokens that never ran: its 40 tokens booked as `unproxied`, their energy taken from the requests.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (None, None)

    def chat(rid, a, stream, **extra):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=stream)
        tr.extra.update(prompt_chars=400, **extra)
        return tr

    done, nb, whole = chat(1, 0.0, True), chat(2, 0.0, True), chat(3, 0.5, False, max_tokens=40)
    tick = S // 40  # the batch's step: a token every 25 ms for each sequence
    done_t = [tick * (k + 1) for k in range(20)]
    nb_t = [int(0.1 * S) + tick * k for k in range(200)]
    run_t = [int(0.62 * S) + tick * k for k in range(40)]  # the run-on's decode, as the server did it (for nobody)
    server = sorted(done_t + nb_t + run_t)
    for tr in (done, nb, whole):
        led.on_start(tr)
    led.add_server_tokens(0, 0.0)  # the baseline
    e, counted, prev = 0.0, 0, 0
    for step in range(1, 241):
        t = step * tick
        led.on_tokens(done, t, 1) if t in done_t else None
        led.on_tokens(nb, t, 1) if t in nb_t else None
        if t == done_t[-1]:
            done.first_ns, done.last_ns, done.end_ns, done.outcome = done_t[0], done_t[-1], t + 5_000_000, "ok"
            done.counts = Counts(generated_tokens=20, prompt_tokens=100, model=None, stop_reason="length",
                                 token_source="usage")
            led.on_end(done)
        if t == int(0.6 * S):
            whole.end_ns, whole.outcome = t, "client_disconnected"
            led.on_end(whole)
        if t == nb_t[-1]:
            nb.first_ns, nb.last_ns, nb.end_ns, nb.outcome = nb_t[0], nb_t[-1], t + 5_000_000, "ok"
            nb.counts = Counts(generated_tokens=200, prompt_tokens=100, model=None, stop_reason="length",
                               token_source="usage")
            led.on_end(nb)
        if step % 4 == 0:
            e += 100.0 * 0.1
            led.add_gpu_sample(t, t, [R(e, 100.0)])
        if step % 10 == 0:  # scraped every 0.25 s
            n = sum(1 for x in server if x <= t)
            led.add_server_tokens(t, float(n - counted), prev)
            counted, prev = n, t
        led.advance(t)
    led.close_all(int(7 * S))
    rows = {r["request_id"]: r for r in led.emit.rows["requests"]}
    bypass = sum(r["server_tokens"] or 0 for r in led.emit.rows["intervals"])
    assert rows[3]["attributed_tokens"] == pytest.approx(40, abs=1), rows[3]
    assert bypass < 3, (bypass, [(r["kind"], r["server_tokens"]) for r in led.emit.rows["intervals"]])
    assert not [r for r in led.emit.rows["intervals"] if r["kind"] == "unproxied"]


def test_a_stream_cut_mid_prefill_on_llamacpp_is_costed_its_whole_prompt_to_its_first_token():
    # llama-server looks at a stream's connection only at its first result: one whose client left mid-prefill prefills
    # its prompt whole for nobody (docs/simulator.md, "A client that leaves"). Costed as one cut short, its prompt was
    # bounded by its 0.1 s in flight (1000 of its 12000 tokens at the default 10 000 tokens/s), the rest of that prefill
    # in the stream beside it.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (None, None)
    nb = RequestTrace(1, "POST", "/v1/chat/completions", None, 0, 0, api="openai-chat", stream=True)
    cut = RequestTrace(2, "POST", "/v1/chat/completions", None, int(0.5 * S), 0, api="openai-chat", stream=True)
    nb.extra.update(prompt_chars=400)
    cut.extra.update(prompt_chars=48000)  # 12000 tokens at the default 0.25 a character
    for tr in (nb, cut):
        led.on_start(tr)
    for k in range(100):
        led.on_tokens(nb, int((0.1 + 0.025 * k) * S), 1)
    cut.end_ns, cut.outcome = int(0.6 * S), "client_disconnected"
    led.on_end(cut)
    nb.first_ns, nb.last_ns, nb.end_ns, nb.outcome = int(0.1 * S), int((0.1 + 0.025 * 99) * S), int(2.6 * S), "ok"
    nb.counts = Counts(generated_tokens=100, prompt_tokens=100, model=None, stop_reason="length", token_source="usage")
    led.on_end(nb)
    e = 0.0
    for k in range(40):
        e += 100.0 * 0.1
        led.add_gpu_sample(int(k * 0.1 * S), int(k * 0.1 * S), [R(e, 100.0)])
    led.advance(int(5 * S))
    led.close_all(int(6 * S))
    rows = {r["request_id"]: r for r in led.emit.rows["requests"]}
    note = rows[2]["energy_note"] or ""
    assert rows[2]["prompt_tokens_estimate"] == pytest.approx(12000, rel=0.01), (rows[2], note)
    assert "prefilled its prompt whole after its client left" in note and "llama-server" in note, note
    assert "ran on" not in (rows[1]["energy_note"] or "")


def test_a_body_its_client_left_mid_way_takes_no_energy_and_its_time_stays_with_the_others():
    # A body streamed on to the server, its client gone mid-body: the server never had it whole, so never ran it. Before,
    # it was live (not passive) and shared intervals with no measurable work by live time: scene.py (2 proxy workers)
    # gave 12 such requests 4.9 J (truth 0), their energy_note saying their tokens were in unproxied.
    from powerprof.daemon.proxy import BODY_LEFT_NOTE

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    left, ok = _trace(1, 0.2), _trace(2, 0.3)
    for tr in (left, ok):
        led.on_start(tr)
    left.outcome, left.end_ns = "client_disconnected", int(1.6 * S)
    left.error = f"{BODY_LEFT_NOTE}; fix: none here: the client closed its connection mid-body"
    led.on_end(left)
    _answered_without_counts(led, ok, 200, 1.8)  # a slow step: nothing measurable, a request that was answered
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(2.5 * S))
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    assert rows[1]["gpu_energy_j"] is None
    assert rows[1]["energy_note"].startswith("no share: its client left while sending its request body")
    assert "unproxied" not in rows[1]["energy_note"]
    assert rows[2]["gpu_energy_j"] == pytest.approx(200.0)


def test_tools_sent_with_tool_choice_none_are_sized_as_the_server_showed_it_renders_them():
    # Whether a server renders `tools` sent with tool_choice "none" is its own (SGLang's chat never; vLLM's chat not
    # with --exclude-tools-when-tool-choice-none): before any such prompt is counted they are counted and the basis
    # says so with its fix; once one is, as it showed. Before: always counted (SGLang: 949 est. for a true 301).
    from powerprof.daemon.promptlen import tools_if_none

    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 3000}}]
    assert tools_if_none({"tools": tools, "tool_choice": "none"}, "openai-chat") == len(
        '[{"type":"function","function":{"name":"f","description":"' + "d" * 3000 + '"}}]')
    assert tools_if_none({"tools": tools}, "openai-chat") is None
    assert tools_if_none({"tools": [], "tool_choice": "none"}, "openai-responses") is None
    for counted, rendered in ((None, None), (1000, False), (1000 + 760, True)):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        if counted is not None:  # a prompt of 4000 characters and 3040 of tools, counted by the server
            for k in range(3):  # after prompts with no such tools (0.25 tokens a character): judged against them
                _counted_chat(led, 10 + k, 4000, 0, 1000)
            tr = _chat(1, 0.0, 7040)
            tr.extra["prompt_tools_none_chars"] = 3040
            led.on_start(tr)
            tr.end_ns, tr.status = int(1e9), 200
            tr.counts = Counts(5, counted, "m", "stop", "usage")
            led.on_end(tr)
        assert led.tools_when_none.get("openai-chat") is rendered
        cut = _chat(2, 2.0, 7040)
        cut.extra["prompt_tools_none_chars"] = 3040
        tokens, how = led._body_estimate(cut)
        if rendered is None:
            assert tokens == 7040 / 4 and "counted, though this server may or may not render them" in how, how
            assert "1000 without them" in how, how
            assert 'fix: send no `tools` with tool_choice "none"' in how, how
        elif rendered is False:
            assert abs(tokens - 1000) < 1 and "left out: this server rendered none" in how, (tokens, how)
            assert "in 1 of 1 clear judgments" in how and "1760 with them" in how, how
        else:  # a verdict of single prompts' judgments, which prompts of odd density can tip: the other reading said
            assert abs(tokens - 1760) < 1 and "counted: this server rendered them in 1 of 1" in how, (tokens, how)
            assert "1000 without them" in how and 'fix: send no `tools` with tool_choice "none"' in how, how


def _counted_chat(led, rid, chars, tools_chars, counted):
    """A chat the server counted (`counted` prompt tokens), `tools_chars` of its `chars` tools sent with tool_choice "none"."""
    tr = _chat(rid, float(rid), chars)
    if tools_chars:
        tr.extra["prompt_tools_none_chars"] = tools_chars
    led.on_start(tr)
    tr.end_ns, tr.status = int((rid + 0.5) * 1e9), 200
    tr.counts = Counts(5, counted, "m", "stop", "usage")
    led.on_end(tr)


def test_whether_tools_sent_with_tool_choice_none_are_rendered_is_judged_only_clearly_and_by_a_tally():
    # Judged against the ratio of prompts with no such tools, only where the count lies near one reading and the
    # tools are far above that ratio's spread; decided by a tally of such judgments. Before, the latest prompt won:
    # (a) on SGLang one dense prompt with tiny tools (338 characters, counted 6001 tokens) flipped a right "not
    # rendered" to "rendered" and a cut chat with 30 tools was estimated at 2527 tokens for a true 501 (+404%), its
    # note silent; (b) on vLLM (rendered) twelve chats with the same tools, judged before any ratio was learned and
    # then against a ratio learned from themselves, read "not rendered": a cut chat with 30 tools 584 for 3862 (-85%).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    for k in range(5):
        _counted_chat(led, 1 + k, 4000, 0, 1000)  # 0.25 tokens a character
    _counted_chat(led, 10, 7040, 3040, 1000)  # its tools not rendered: clear
    assert led.tools_when_none.get("openai-chat") is False
    _counted_chat(led, 11, 6338, 338, 6001)  # near neither reading: no judgment
    assert led.tools_when_none.get("openai-chat") is False
    cut = _chat(20, 20.0, 12131)
    cut.extra["prompt_tools_none_chars"] = 10131
    tokens, how = led._body_estimate(cut)
    without = led.prompt_lengths.estimate("openai-chat", 2000, None)[0]  # the odd prompt counts in the ratio, as any
    assert abs(tokens - without) < 1 and "left out" in how, (tokens, how)
    _counted_chat(led, 12, 7040, 3040, 1760)  # a clear "rendered" against one "not": undecided
    assert led.tools_when_none.get("openai-chat") is None
    tokens, how = led._body_estimate(cut)
    assert abs(tokens - led.prompt_lengths.estimate("openai-chat", 12131, None)[0]) < 1, tokens
    without = round(led.prompt_lengths.estimate("openai-chat", 2000, None)[0])
    assert "may or may not" in how and f"{without} without them" in how, how
    assert 'fix: send no `tools` with tool_choice "none"' in how, how

    # (b) every prompt with the same tools: no ratio without them, so no judgment, and said so on each estimate.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    for k in range(12):
        _counted_chat(led, 1 + k, 10600, 600, 2150)
    assert led.tools_when_none.get("openai-chat") is None
    cut = _chat(20, 20.0, 12500)
    cut.extra["prompt_tools_none_chars"] = 10000
    tokens, how = led._body_estimate(cut)
    assert "may or may not" in how, how


def test_a_turn_naming_one_whose_tools_sent_with_tool_choice_none_were_undecided_says_so():
    # A Responses turn's conversation (its counted prompt less its tools) is what a later turn naming it prefills.
    # Its tools sent with tool_choice "none" were in that count only if the server rendered them: undecided, taking
    # them out may take out tokens never counted. Before: taken out, the later turn's estimate silent on it.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    tr = RequestTrace(1, "POST", "/v1/responses", None, int(1 * S), 0, api="openai-responses", stream=False)
    tr.extra.update(prompt_chars=7040, prompt_tools_none_chars=3040, prompt_uncarried_chars=3040)
    led.on_start(tr)
    tr.end_ns, tr.status = int(1.5 * S), 200
    tr.counts = Counts(5, 1000, "m", "stop", "usage", response_id="resp_a")
    led.on_end(tr)
    assert led.tools_when_none.get("openai-responses") is None and "resp_a" in led.response_context
    nxt = RequestTrace(2, "POST", "/v1/responses", None, int(2 * S), 0, api="openai-responses", stream=True)
    nxt.extra.update(prev_response_id="resp_a", prompt_new_chars=400)
    tokens, how = led._body_estimate(nxt)
    assert "may or may not" in how and "resp_a" not in how, how
    # Its prompt may be read either way, said; not marked UNSURE_FLAG: kept in J/token (its error is mirrored in the
    # rows sharing its intervals, so the host's sum is unbiased).
    assert UNSURE_FLAG not in how, how


def test_tools_rendered_denser_than_prose_are_judged_rendered():
    # A tool's JSON schema takes more tokens a character than prose (the simulator's vLLM: about 0.32 for 0.2): a
    # count past the reading without them by at least half the tools' prose size, and at most twice it beyond,
    # reads "rendered". Before: only within the spread of the prose reading, so vLLM's Responses turns with 20 tools
    # (counted 3122, read 2298 with them, 1000 without) were never judged, each estimate left undecided.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    for k in range(3):
        _counted_chat(led, 1 + k, 4000, 0, 1000)
    for k in range(3):
        _counted_chat(led, 10 + k, 7040, 3040, round(1000 + 3040 * 0.4))
    assert led.tools_when_none.get("openai-chat") is True
    _counted_chat(led, 20, 7040, 3040, 9000)  # far past both: no judgment
    assert led.tools_none_tally["openai-chat"] == [3, 0]


def _queued_close_scene(arrive: float, crash: float = 1.95, k_streams: int = 4, early: int = 2, early_end: float = 0.9,
                        gap: float | None = None, with_whole: bool = True):
    """A whole answer sent at `arrive` and closed by a crash at `crash`, its resend refused (proxy.RESEND_REFUSED), beside
    `k_streams` streams cut by that crash and `early` streams ended whole at `early_end`: all streams from 0 s at 40
    tokens/s, 300 W while any decodes, 60 W after. The old process's last good scrape at the last 0.1 s tick before the
    crash, the scrape 50 ms after it refused. Truth if the whole answer queued behind full slots (never run): 0 J, each
    interval's energy the live streams' alike. Its rows by id (2: the whole answer,
    10..: the cut streams, 20..: the early ones). `gap`: the cut streams decode a token every `gap` s instead;
    `with_whole` False: no whole answer sent (the scene's truth had it queued unrun)."""
    from powerprof.daemon.proxy import CRASHED_NOTE, RESEND_REFUSED
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.runs_on_after_leave = (None, None)
    led.scraping = True

    def chat(rid, a, stream, **extra):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=stream)
        tr.extra.update(**extra)
        return tr

    cut = [chat(10 + i, 0.0, True, prompt_chars=400) for i in range(k_streams)]
    done = [chat(20 + i, 0.0, True, prompt_chars=400) for i in range(early)]
    whole = chat(2, arrive, False, prompt_chars=16000, max_tokens=500)
    toks = {tr.request_id: 0 for tr in cut + done}

    def end(tr, t, outcome, error=None):
        tr.end_ns, tr.outcome, tr.error = int(t * S), outcome, error
        tr.counts = Counts(generated_tokens=toks[tr.request_id], prompt_tokens=100, model=None, stop_reason=None,
                           token_source="chunks")
        led.on_end(tr)

    for tr in cut + done:
        led.on_start(tr)
    e, prev, dt = 0.0, None, 0.1
    for k in range(120):
        t = k * dt
        for tr in cut + done:
            stop = early_end if tr in done else crash
            if gap is not None and tr in cut:  # one token every `gap` s, from `gap` s on
                n = int((min(stop, t) + 1e-9) // gap)
                for j in range(toks[tr.request_id] + 1, n + 1):
                    tr.first_ns = tr.first_ns or int(j * gap * S)
                    tr.last_ns = int(j * gap * S)
                    led.on_tokens(tr, int(j * gap * S), 1)
                    toks[tr.request_id] += 1
                continue
            for j in range(4):
                ts = t - dt + (j + 1) * 0.025
                if 0 < ts <= min(stop, t + 1e-12) and tr.end_ns is None:
                    tr.first_ns = tr.first_ns or int(ts * S)
                    tr.last_ns = int(ts * S)
                    led.on_tokens(tr, int(ts * S), 1)
                    toks[tr.request_id] += 1
        for tr in done:
            if tr.end_ns is None and t >= early_end - 1e-9:
                end(tr, early_end, "ok")
        if with_whole and whole.request_id not in led.requests and whole.end_ns is None and t >= arrive - 1e-9:
            led.on_start(whole)
        if cut[0].end_ns is None and t >= crash - 1e-9:
            if with_whole:
                whole.end_ns, whole.outcome, whole.status = int(crash * S), "upstream_error", 502
                whole.error = f"{CRASHED_NOTE}: {RESEND_REFUSED}: upstream closed the kept-alive connection"
                led.on_end(whole)
            for tr in cut:
                end(tr, crash, "upstream_error", "upstream cut")
        w = 300.0 if t <= crash else 60.0
        e += w * dt
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, w)])
        down, up = crash - 0.02, crash + 0.5
        if down < t < up:
            if t >= crash + 0.05 - 1e-9 and prev is not None:  # the daemon's loop: a refused scrape found it down
                led.note_down(int(prev * S), int((crash + 0.05) * S), int((crash + 0.05) * S))
            led.advance(int(t * S))
            continue
        restart = prev is not None and prev < down < up <= t + 1e-9
        per_tick = 4 if gap is None else dt / gap
        served = (per_tick * k_streams + 4 * (early if t <= early_end + dt else 0)) if t <= crash + dt else 0.0
        led.add_server_tokens(int(t * S), served if prev is not None else 0.0, None if prev is None else int(prev * S),
                              partial=("server_restart",) if restart else (),
                              **({"down_ns": int((crash + 0.05) * S), "down_refused": True} if restart else {}))
        prev = t
        led.advance(int(t * S))
    led.close_all(int(12.0 * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


@pytest.mark.parametrize("arrive", [1.93, 1.91, 1.85, 1.45, 0.96])
def test_a_close_whose_resend_was_refused_long_after_its_arrival_may_have_queued_and_is_flagged_with_its_neighbours(
        arrive):
    # A request the server read but held queued behind full slots, closed by the crash up to forward.STALE_CLOSE_MAX_S
    # later: its resend refused, it was costed as run from its arrival to the close, unflagged, its figure taken from the
    # requests beside it (the review's ledger scene, 4 streams at 300 W: 3.0 / 27.0 / 56.5 J and 4 / 20 / 40 invented
    # tokens for a close 0.10 / 0.50 / 0.99 s after its arrival, the host's J/token -1.3 / -6.0 / -11.3% of the
    # never-run truth; on the simulator's llama.cpp 73-78 J for 0, its neighbours -18..-24%). Longer than a crossing
    # close takes (liverequest.CROSSING_CLOSE_MAX_S) it is flagged uncertain-uncounted, and so are the requests live
    # beside it: out of J/token, what is left is right. A close 20 / 40 ms in may be a crossing's (never begun) or a
    # queued one's, 0 J either way, or run: costed 0.4 / 0.7 J and 0.8 / 1.6 tokens, unflagged before (whether the
    # slots were full at its arrival is not read); now it alone is flagged, its neighbours (low by 0.1 J of 121 J) not.
    rows = _queued_close_scene(arrive)
    whole, cut, early = rows[2], [rows[10 + i] for i in range(4)], [rows[20 + i] for i in range(2)]
    note = whole["energy_note"] or ""
    print(arrive, whole["gpu_energy_j"], whole["attributed_tokens"], note)
    for r in cut + early:
        print(r["request_id"], r["gpu_energy_j"], r["attributed_tokens"], (r["energy_note"] or "")[:200])
    sure = [r for r in rows.values() if UNSURE_FLAG not in (r["energy_note"] or "")]
    if 1.95 - arrive <= 0.05:
        assert 0 < whole["gpu_energy_j"] < 1.0 and UNSURE_FLAG in note and "queued behind full slots" in note, note
        assert "whether the server's slots were full at its arrival" in note, note
        assert all(UNSURE_FLAG not in (r["energy_note"] or "") for r in cut + early)
        return
    assert whole["gpu_energy_j"] > 0 and UNSURE_FLAG in note and "queued behind full slots" in note, note
    # Live over its span, each cut stream is low by a quarter of its figure if it never ran (it is theirs alike: the
    # split re-run without it says so): flagged where that is 1% of theirs or more (rowtext.QUEUED_BESIDE_MIN_SHARE),
    # with how much. Before, on any overlap: a close 0.10 s in (4.2 J) left the four out of J/token for 1.0 J of about
    # 120 J each (0.9%).
    short = whole["gpu_energy_j"] / 4
    for r in cut:
        flagged = short >= 0.01 * r["gpu_energy_j"]
        assert flagged == (arrive < 1.8), (short, r)
        assert (UNSURE_FLAG in (r["energy_note"] or "")) == flagged, r
        if flagged:
            said = float(r["energy_note"].split("had it never run, this figure would be ")[1].split(" J")[0])
            assert "may have waited queued unrun" in r["energy_note"] and said == pytest.approx(short, rel=0.05), r
    for r in early:  # ended before it arrived: sure, and right (0.9 s at 300 W among 6 alike streams: 45 J each)
        assert UNSURE_FLAG not in (r["energy_note"] or "") and r["gpu_energy_j"] == pytest.approx(45.0, rel=0.01), r
    # J/token: theirs alone (45 J for 35 tokens each), and the cut streams' where theirs may be low by under 1%.
    assert sorted(r["request_id"] for r in sure) == ([20, 21] if arrive < 1.8 else [10, 11, 12, 13, 20, 21])


@pytest.mark.parametrize("arrive", [9.4, 9.2])
def test_a_slow_stream_beside_a_close_that_may_have_queued_is_flagged_where_it_would_be_low_by_1pct(arrive):
    # The review's scene: a slow stream (a token every 0.5 s, from 0 s to the crash at 9.95 s) beside a 40 tokens/s one
    # ended at 0.9 s, and a whole answer sent at `arrive`, closed by the crash, its resend refused: it may have queued
    # unrun. Its decode placed at its close is the only work in intervals where the slow stream decoded nothing, so
    # the stream's share there is 0. Had it never run, that energy is the stream's: its figure low by about 2% against
    # the scene with no whole answer. The bound from shares given out in proportion (e7705f50) read 24 J (0.9%, under
    # rowtext.QUEUED_BESIDE_MIN_SHARE) for the split's own counterfactual 144 / 204 J (5.7 / 8.2%): unflagged, in
    # J/token. The split re-run without the queued close gives that gain, said on the row.
    kw = dict(crash=9.95, k_streams=1, early=1, gap=0.5)
    rows, truth = _queued_close_scene(arrive, **kw), _queued_close_scene(arrive, with_whole=False, **kw)
    a, a0 = rows[10], truth[10]
    note = a["energy_note"] or ""
    low = (a0["gpu_energy_j"] - a["gpu_energy_j"]) / a0["gpu_energy_j"]
    print(arrive, a["gpu_energy_j"], a0["gpu_energy_j"], f"{100 * low:.2f}%", note)
    assert UNSURE_FLAG in (rows[2]["energy_note"] or ""), rows[2]  # the queued close itself
    assert low >= 0.01, low  # the scene's truth: low by 1% or more
    assert UNSURE_FLAG in note and "may have waited queued unrun" in note, note
    said = float(note.split("had it never run, this figure would be ")[1].split(" J")[0])
    assert said >= a0["gpu_energy_j"] - a["gpu_energy_j"], (said, a, a0)  # the gain said covers the truth's
    assert 0.01 * a["gpu_energy_j"] <= said <= rows[2]["gpu_energy_j"] + 1e-6, (said, rows[2])  # at most its whole


@pytest.mark.parametrize("arrive,early_end", [(1.0, 0.9), (1.0, 6.0), (2.0, 8.0)])
def test_a_stream_beside_a_queued_close_held_past_the_holds_says_its_gain_is_a_lower_bound(monkeypatch, arrive,
                                                                                          early_end):
    # The slow-stream scene with the ledger's holds cut to 3 s (a 120 s run's shape): intervals closed under the whole
    # answer before its close were split with it live, as run, and the split re-run covers only the close's own step.
    # The re-review read the slow stream's note "235.5 J higher" for 1175.5 J of truth (47%): now it says "at least"
    # and why, and is flagged wherever it was live beside it in those earlier intervals.
    import powerprof.daemon.ledger as ledger_mod

    class Cut(Ledger):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.max_hold_ns = self.prompt_hold_ns = int(3 * S)

    monkeypatch.setitem(globals(), "Ledger", Cut)
    monkeypatch.setattr(ledger_mod, "SCRAPE_HOLD_S", 3.0)
    kw = dict(crash=9.95, k_streams=1, early=1, gap=0.5, early_end=early_end)
    rows, truth = _queued_close_scene(arrive, **kw), _queued_close_scene(arrive, with_whole=False, **kw)
    a, a0 = rows[10], truth[10]
    note = a["energy_note"] or ""
    print(a["gpu_energy_j"], a0["gpu_energy_j"], note)
    assert UNSURE_FLAG in (rows[2]["energy_note"] or ""), rows[2]
    assert a0["gpu_energy_j"] - a["gpu_energy_j"] > 0.2 * a0["gpu_energy_j"], (a, a0)  # the scene: low by 40% or more
    assert UNSURE_FLAG in note and "had it never run, this figure would be at least " in note, note
    assert "a lower bound: the re-run covers only the intervals closed with its close" in note, note
    assert float(note.split("would be at least ")[1].split(" J")[0]) > 0, note


def test_rows_beside_two_whole_answers_answered_together_past_the_holds_are_written_at_their_ends(monkeypatch):
    # Holds cut to 3 s: two whole answers in flight from 1.0 / 1.5 s, both answered whole at 7.0 s (as one close ends
    # them all), beside slow streams (a token every 0.5 s) ended at 5.0 and 11.5 s. Under crash6's row-holding (reverted) each whole answer waited
    # for the other's row, and every row beside them with them: all four written only at close_all, the answered one
    # marked uncertain-uncounted "up to 142.5 J". Each row comes by its end here, none marked.
    import powerprof.daemon.ledger as ledger_mod

    monkeypatch.setattr(ledger_mod, "SCRAPE_HOLD_S", 3.0)
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.max_hold_ns = led.prompt_hold_ns = int(3 * S)
    led.runs_on_after_leave = (None, None)
    led.scraping = True

    def chat(rid, a, stream, **extra):
        tr = RequestTrace(rid, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat", stream=stream)
        tr.extra.update(**extra)
        return tr

    streams = {10: (chat(10, 0.0, True, prompt_chars=400), 11.5), 11: (chat(11, 0.0, True, prompt_chars=400), 5.0)}
    wholes = {1: (chat(1, 1.0, False, prompt_chars=16000, max_tokens=500), 1.0),
              2: (chat(2, 1.5, False, prompt_chars=16000, max_tokens=500), 1.5)}
    toks, written, e, prev, dt = {10: 0, 11: 0}, {}, 0.0, None, 0.1
    for tr, _ in streams.values():
        led.on_start(tr)
    for k in range(150):
        t, served = k * dt, 0.0
        for rid, (tr, b) in streams.items():
            if tr.end_ns is not None:
                continue
            for j in range(toks[rid] + 1, int((min(b, t) + 1e-9) // 0.5) + 1):  # a token every 0.5 s
                tr.first_ns = tr.first_ns or int(j * 0.5 * S)
                tr.last_ns = int(j * 0.5 * S)
                led.on_tokens(tr, int(j * 0.5 * S), 1)
                toks[rid] += 1
                served += 1
            if t >= b - 1e-9:
                tr.end_ns, tr.outcome = int(b * S), "ok"
                tr.counts = Counts(generated_tokens=toks[rid], prompt_tokens=100, model=None, stop_reason="stop",
                                   token_source="usage")
                led.on_end(tr)
        for rid, (tr, a) in wholes.items():
            if tr.request_id not in led.requests and tr.end_ns is None and t >= a - 1e-9:
                led.on_start(tr)
            if tr.end_ns is None and t >= 7.0 - 1e-9:
                tr.first_ns = tr.last_ns = tr.end_ns = int(7.0 * S)
                tr.outcome, tr.status = "ok", 200
                tr.counts = Counts(generated_tokens=200, prompt_tokens=4000, model=None, stop_reason="stop",
                                   token_source="usage")
                led.on_end(tr)
                served += 200
        w = 60.0 + 60.0 * (sum(t <= b for _, b in streams.values()) + sum(a <= t <= 7.0 for _, a in wholes.values()))
        e += w * dt
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, w)])
        led.add_server_tokens(int(t * S), served if prev is not None else 0.0, None if prev is None else int(prev * S))
        prev = t
        led.advance(int(t * S))
        for row in led.emit.rows["requests"]:
            written.setdefault(row["request_id"], (t, row))
    print({rid: (round(t, 1), row["energy_note"]) for rid, (t, row) in written.items()})
    assert sorted(written) == [1, 2, 10, 11], written  # all by 15 s, none waiting for a close_all
    assert all(written[rid][0] <= end + 3.5 for rid, end in ((1, 7.0), (2, 7.0), (10, 11.5), (11, 7.0))), written
    assert not any(UNSURE_FLAG in (row["energy_note"] or "") for _, row in written.values()), written


def test_a_close_whose_resend_met_llama_server_s_loading_page_after_the_last_good_scrape_is_costed_unsure():
    # A whole answer sent at 1.52 s, after the old process's last good scrape (1.5 s), its kept-alive connection closed
    # with no answer at 1.67 s, and its resend met llama-server's 503 "Loading model" (proxy.RESEND_LOADING); the
    # scrapes see that 503 alone from 1.6 s, the new process's page at 12 s. Neither the close nor a scrape proves the
    # death, and sent after the last good scrape it was not costed: null J, unmarked (on the simulator 0 J for 25 J /
    # 16 tokens of truth, the review's test_sim_loading_late). The proxy's own sighting of a new process loading is
    # the scraper's 503 evidence: costed as the crash, unsure (uncertain-uncounted), as one sent before that scrape.
    from powerprof.daemon.proxy import CRASHED_NOTE, RESEND_LOADING
    row = _llamacpp_whole_run_on([(1.5, 12.0)], arrive=1.52, leave=1.67, end_s=20.0, outcome="upstream_error",
                                 error=f"{CRASHED_NOTE}: {RESEND_LOADING}: closed", opened=(1.6, None))
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], note)
    assert 10.0 <= (row["gpu_energy_j"] or 0) <= 20.0, row  # 0.15 s alone at 100 W
    assert UNSURE_FLAG in note and "closed its connection with no answer" in note, note
    assert f"{UNSURE_FLAG}: {RESEND_LOADING} (a new process" in note and "sent before" not in note, note


def test_a_crossing_close_whose_resend_met_the_loading_page_marks_its_neighbours_as_an_unsure_crash():
    # A whole answer closed with no answer 20 ms after its arrival (1.62 s), a 0.2 s stream beside it (1.55-1.75 s):
    # a crossing's time. Its resend refused, its row alone is marked (`resend_crossed`); its resend met llama-server's
    # loading page, it is costed as an unsure crash (`crash_by_page`) and, like any, marks the requests beside it
    # (`crash_unsure_costed`): the stream read 18.3 J for 20.0 J without it (-8.3%) either way (docs/daemon.md says
    # both; until December 2026 it said "its own row alone" for both).
    from powerprof.daemon.proxy import CRASHED_NOTE, RESEND_LOADING, RESEND_REFUSED
    notes = {}
    for how, opened in ((RESEND_LOADING, (1.6, None)), (RESEND_REFUSED, (1.6, 1.6))):
        kw = dict(arrive=1.62, leave=1.64, end_s=20.0, outcome="upstream_error", error=f"{CRASHED_NOTE}: {how}: closed",
                  beside=(1.55, 1.75), opened=opened)
        rows = _llamacpp_whole_run_on([(1.5, 12.0)], **kw)
        truth = _llamacpp_whole_run_on([(1.5, 12.0)], with_whole=False, **kw)
        print(how, rows[2]["gpu_energy_j"], rows[5]["gpu_energy_j"], truth[5]["gpu_energy_j"])
        assert rows[5]["gpu_energy_j"] == pytest.approx(0.917 * truth[5]["gpu_energy_j"], abs=0.1), (rows[5], truth[5])
        notes[how] = rows[5]["energy_note"] or ""
    assert UNSURE_FLAG in notes[RESEND_LOADING] and "may have waited queued" in notes[RESEND_LOADING], notes
    assert UNSURE_FLAG not in notes[RESEND_REFUSED], notes


def test_a_crash_costed_close_that_took_no_share_says_so_not_the_generic_words():
    # A whole answer closed by the crash 20 ms after its arrival, its resend refused (`_queued_close_scene`, no stream
    # ended before): costed as a crash, the split placed none of its work in those 20 ms (0 J, as a crossing should
    # be). Its note was the generic "no share: no tokens and no prompt length (the response did not say it)", silent on
    # the close and the crash; it says them now.
    row = _queued_close_scene(1.93, early=0)[2]
    note = row["energy_note"] or ""
    print(row["gpu_energy_j"], note)
    assert not row["gpu_energy_j"] and "no tokens and no prompt length" not in note, note
    assert note.startswith("no share: the server closed its connection with no answer 0.02 s after its arrival"), note
    assert "the split placed none of its work in those 0.02 s" in note and UNSURE_FLAG not in note, note


def test_a_crash_s_run_on_placed_in_intervals_already_closed_is_counted_late_and_said(monkeypatch):
    # A whole answer in flight from 0.5 s closed by a crash at 20.0 s (the review's test_rep_hold long_run): its decode,
    # 780 tokens at the latest stream's 40 tokens/s, is placed at its close, but its first intervals had closed under
    # the holds' caps while it ran (a whole answer's and its prompt's, max_hold_s and prompt_hold_s, cut to 10 s here
    # as the 120 s and 30 s ones are, the answer longer).
    # Those placed before them were dropped unsaid: its note said "780 tokens decoded (its attributed tokens count
    # them)" for 390 attributed. They are counted late now, and said. Its last event, at its close on an interval's
    # edge, fell in the interval after its end and was lost, unsaid: 768 of 780 attributed and late together; now 780.
    import powerprof.daemon.ledger as ledger_mod
    from powerprof.daemon.proxy import CRASHED_NOTE
    monkeypatch.setattr(ledger_mod, "DOWN_HOLD_MAX_S", 15.0)

    class Short(list):  # given the helper's ledger: its holds cut to 10 s
        def append(self, led):
            led.max_hold_ns = led.prompt_hold_ns = int(10 * S)
            super().append(led)

    row = _llamacpp_whole_run_on([(19.9, 30.0)], arrive=0.5, leave=20.0, end_s=45.0, max_tokens=4000,
                                 outcome="upstream_error", error=f"{CRASHED_NOTE}: closed", opened=(20.0, None),
                                 ledgers=Short())
    note = row["energy_note"] or ""
    print(row["attributed_tokens"], row["gpu_energy_j"], row["error"], note)
    assert "780 tokens decoded" in note and "its attributed tokens count them" not in note, note
    late = float(note.split("pace (an estimate; ")[1].split(" of them fell in intervals closed")[0])
    assert 300 <= late <= 480 and row["attributed_tokens"] + late == pytest.approx(780, abs=0.5), (late, row)
    assert "token(s) arrived after their interval had closed and were not attributed" in row["error"], row  # `_with_late`


def _a_300_w_request_after_idle(led, sink, t0_s, e_at_t0_j, e_after_j):
    """A request live t0-0.01..t0+0.5 s, 10 tokens from t0+0.1 s, the counter at e_at_t0_j at t0 and e_after_j a second
    later (300 W over [t0, t0+0.5], 100 W after: its truth 1 J + 150 J); closed, its row."""
    tr = _trace(1, t0_s - 0.01)
    led.on_start(tr)
    _feed(led, t0_s, e_at_t0_j, 100.0)
    tr.first_ns = tr.last_ns = int((t0_s + 0.1) * S)
    led.on_tokens(tr, tr.first_ns, 1)
    for k in range(1, 10):
        tr.last_ns = int((t0_s + 0.1 + 0.04 * k) * S)
        led.on_tokens(tr, tr.last_ns, 1)
    tr.end_ns = int((t0_s + 0.5) * S)
    tr.counts = Counts(generated_tokens=10, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    _feed(led, t0_s + 1.0, e_after_j, 100.0)
    led.advance(int((t0_s + 1.2) * S))
    led.close_all(int((t0_s + 2) * S))
    [row] = sink.rows["requests"]
    return row


def test_a_request_before_the_idle_power_is_measured_takes_no_idle_seconds_of_its_intervals():
    # The idle power is measured from MIN_IDLE (5) idle intervals; before, with fewer, it was unknown and no part of a
    # busy interval was idle: a request that arrived 10 ms before an interval's end took all of that interval's idle
    # energy (the simulated SGLang, a stream sent 5.5 ms before a 0.93 s idle interval closed: +34% to +42%, unflagged).
    # Now the median of the idle intervals seen so far (from one on) is the idle power until then. 100 W idle 0-4 s,
    # the request live 3.99-4.5 s at 300 W: its truth 1 J + 150 J; before, 100 J + 200 J.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for k in range(4):  # 3 idle intervals: fewer than MIN_IDLE
        _feed(led, float(k), 100.0 * k, 100.0)
        led.advance(int((k + 0.2) * S))
    row = _a_300_w_request_after_idle(led, sink, 4.0, 400.0, 600.0)
    assert row["gpu_energy_j"] == pytest.approx(151.0, abs=1.0), (row, sink.rows["intervals"])



def test_sub_refresh_idle_intervals_among_real_ones_teach_no_idle_power():
    # From MIN_IDLE (5) idle intervals on, the median took every idle interval in, sub-refresh ones too: on a counter
    # refreshed every 100 ms (here at k + 0.05 s, 100 W idle) 14 of 10-20 ms read 0 J and 2 one whole refresh (500 W)
    # beside 7 real ones (0.94-1 s): the median read 0 W and the request below took the idle energy of both intervals it
    # was live in (300 J for the truth's 151; 153 J now: each run of idle intervals, summed to IDLE_MIN_S, teaches one
    # reading, good to a refresh at its ends).
    def counter_j(t):  # 100 W, 300 W over [8, 8.5], as read: the value of the last refresh
        r = np.floor((t - 0.05) / 0.1) * 0.1 + 0.05
        return 100.0 * r + 200.0 * min(max(r - 8.0, 0.0), 0.5)

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    times = [0.0]
    for k in range(1, 8):
        times += [k, k + 0.01, k + 0.02] + ([k + 0.04, k + 0.06] if k in (2, 5) else [])
    for t in times:
        _feed(led, t, counter_j(t), 100.0)
        led.advance(int((t + 0.001) * S))
    row = _a_300_w_request_after_idle(led, sink, 8.0, counter_j(8.0), counter_j(9.0))
    assert row["gpu_energy_j"] == pytest.approx(151.0, abs=3.0), (row, sink.rows["intervals"])


def test_a_min_tokens_run_on_within_its_pace_error_of_the_abort_may_still_end_by_itself():
    # 20 tokens shown, its client gone at 1.0 s, run on 2 s at its 40 tokens/s: 81 placed to SGLang's abort. A min_tokens
    # leaving 85 more was taken as sure (85 > 81: it cannot end by itself before the abort), yet a pace 5% above the
    # estimate decodes them and lets it end first, unseen, counted by SGLang then. Within RUN_ON_MAY_END_PACE_MARGIN
    # (25%) of the placed run it is now unsure (flagged, saying why); one leaving 110 (over 81 x 1.25) stays sure.
    from powerprof.daemon.liverequest import RUN_ON_MAY_END_PACE_MARGIN

    assert RUN_ON_MAY_END_PACE_MARGIN == 0.25
    near = _sglang_stream_run_on(down=30.0, up=31.0, extra={"min_tokens": 105})
    far = _sglang_stream_run_on(down=30.0, up=31.0, extra={"min_tokens": 130})
    assert UNSURE_FLAG in (near["energy_note"] or ""), near["energy_note"]
    assert "its min_tokens' rest (85) is within 25% above that" in near["energy_note"], near["energy_note"]
    assert UNSURE_FLAG not in (far["energy_note"] or ""), far["energy_note"]


@pytest.mark.parametrize("short_j", [0.0, 10.0])
def test_an_idle_interval_shorter_than_the_counter_s_refresh_teaches_no_early_idle_power(short_j):
    # A counter refreshed every 100 ms reads an idle interval of a few ms as 0 J or a whole refresh (here 0 W or 1000 W
    # for 100 W): the daemon's first interval is often that short. Before, the median of the idle intervals seen from
    # one on (fewer than MIN_IDLE) took it in: with the 1 s one (100 W), 50 W or 550 W, and the request below 50 J too
    # many or none of its 0.01 s in [1.01, 2]. Now only runs of idle intervals summed to IDLE_MIN_S (0.3 s) teach it early.
    # 100 W idle; the request live 1.99-2.5 s at 300 W: its truth 1 J + 150 J.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0, 100.0)
    _feed(led, 1.0, 100.0, 100.0)
    _feed(led, 1.01, 100.0 + short_j, 100.0)
    led.advance(int(1.2 * S))
    row = _a_300_w_request_after_idle(led, sink, 2.0, 199.0, 399.0)
    assert row["gpu_energy_j"] == pytest.approx(151.0, abs=1.5), (row, sink.rows["intervals"])



@pytest.mark.parametrize("t0", [0.05, 0.2, 0.5])
def test_a_request_before_any_idle_run_closed_is_flagged_with_its_bound_not_silently_high(t0):
    # The ledger's first read at 0 s, the request live t0-0.01..t0+0.5 s at 300 W, 100 W idle: no run of idle intervals
    # IDLE_MIN_S long had closed, so no idle power was known and its intervals' idle time went to it. Before: 205 J,
    # 220 J, 250 J for the truth's 151 J (+36%, +46%, +66%), unflagged, in J/token. Now flagged uncertain, its note
    # bounding the idle energy in it at its intervals' mean power (at least the true excess); its intervals are left out
    # of the live J/token gauge too.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0, 100.0)
    row = _a_300_w_request_after_idle(led, sink, t0, 100.0 * t0, 100.0 * t0 + 200.0)
    note = row["energy_note"] or ""
    assert row["gpu_energy_j"] > 151.0 * 1.3 and UNSURE_FLAG in note, (row["gpu_energy_j"], note)
    bound_j = float(note.split("up to ")[1].split(" J")[0])
    assert bound_j >= row["gpu_energy_j"] - 151.0, (bound_j, note)
    assert "before the daemon had measured the GPUs' idle power" in note, note
    assert led.flagged_requests.get(UNSURE_FLAG, 0) == 1, led.flagged_requests  # counted apart, out of J/token
    assert led.totals.jpt_left_out.get(UNSURE_FLAG, (0, 0))[0] >= 1, led.totals.jpt_left_out  # and out of the gauge


def test_a_request_before_any_idle_run_closed_bounds_its_cpu_energy_too():
    # The same scene, t0 0.5 s, RAPL flat at 50 W: its cpu_energy_j follows its share of the GPU's, so it took the idle
    # time's too: 75 J for 38 J with the idle power measured first (+97%). Before, its note bounded the GPU figure
    # alone. Now it says cpu_energy_j is high by up to the same intervals' same fraction (49.5 J >= 37 J).
    from powerprof.collectors.rapl import RaplReading

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1, rapl=True)
    for k in range(-1, 5):
        led.add_rapl_sample(int(k * S), [RaplReading("package-0", "package", 0, 50.0 * (k + 1), None)])
    _feed(led, 0.0, 0.0, 100.0)
    row = _a_300_w_request_after_idle(led, sink, 0.5, 50.0, 250.0)
    note = row["energy_note"] or ""
    assert row["cpu_energy_j"] == pytest.approx(75.0, abs=0.5), row
    assert "its cpu_energy_j, split by the same shares, high by up to" in note, note
    bound_j = float(note.split("cpu_energy_j, split by the same shares, high by up to ")[1].split(" J")[0])
    assert row["cpu_energy_j"] - 38.0 <= bound_j <= row["cpu_energy_j"], (bound_j, note)


def test_an_interval_split_before_any_idle_run_closed_says_its_requests_energy_may_be_high_with_the_bound():
    # The same scene, t0 0.5 s: its intervals [0, 0.5] and [0.5, 1.5] gave 50 J + 200 J to the request and 0 J to idle
    # for the truth's 1 J + 150 J and 49 J + 50 J. Before, their energy_note said nothing of it. Now each says
    # requests_energy_j may be high and idle_energy_j low by up to its idle time at its mean power (49 J, 100 J).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    _feed(led, 0.0, 0.0, 100.0)
    _a_300_w_request_after_idle(led, sink, 0.5, 50.0, 250.0)
    busy = [r for r in sink.rows["intervals"] if r["kind"] != "idle"]
    assert [round(r["idle_energy_j"]) for r in busy] == [0, 0], busy
    for r, truth_idle_j in zip(busy, (49.0, 50.0)):
        note = r["energy_note"] or ""
        assert f"{UNSURE_FLAG}: requests_energy_j may be high and idle_energy_j low by up to" in note, note
        bound_j = float(note.split("low by up to ")[1].split(" J")[0])
        assert truth_idle_j <= bound_j <= r["gpu_energy_j"], (bound_j, note)


def test_a_request_that_fills_its_intervals_before_any_idle_run_is_not_flagged():
    # The same start, the request live from the ledger's first read to the next (0-1 s, 300 W, its only interval): no
    # idle time in its intervals, nothing in its figure that an idle power would take out; its row stays counted
    # (300 J, exact).
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    tr = _trace(1, 0.0)
    led.on_start(tr)
    _feed(led, 0.0, 0.0, 300.0)
    tr.first_ns = int(0.1 * S)
    for k in range(10):
        tr.last_ns = int((0.1 + 0.09 * k) * S)
        led.on_tokens(tr, tr.last_ns, 1)
    tr.end_ns = int(1.0 * S)
    tr.counts = Counts(generated_tokens=10, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    _feed(led, 1.0, 300.0, 300.0)
    led.close_all(int(2 * S))
    [row] = sink.rows["requests"]
    assert row["gpu_energy_j"] == pytest.approx(300.0, abs=1.0), row
    assert UNSURE_FLAG not in (row["energy_note"] or ""), row["energy_note"]
    assert UNSURE_FLAG not in led.totals.jpt_left_out, led.totals.jpt_left_out
    assert all(UNSURE_FLAG not in (iv["energy_note"] or "") for iv in sink.rows["intervals"]), sink.rows["intervals"]


def test_a_request_just_after_a_limit_change_is_split_with_the_idle_power_measured_at_the_limit_before():
    # 100 W idle at a 300 W limit 0-3 s (runs measured there), the limit 250 W from the read at 3 s, the request live
    # 3.49-4.0 s at 300 W (its truth 1 J + 150 J) before any idle run closed at 250 W. Before: no idle power at the new
    # limit, the 0.5 s no request was live in [3.5, 4.5] went to it: 250 J, flagged uncertain-uncounted, out of J/token
    # (under steady traffic every row until the new limit's fit matured: ~31 s). A limit does not move an idle draw far
    # below it (workmodel.CostLearner._other_limit_idle_w): 151 J, unflagged.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)

    def feed(t_s, energy_j, limit_w):
        led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(energy_j, 100.0, power_limit_w=limit_w)])

    for k in range(4):
        feed(float(k), 100.0 * k, 300.0 if k < 3 else 250.0)
    tr = _trace(1, 3.49)
    led.on_start(tr)
    feed(3.5, 350.0, 250.0)
    tr.first_ns = tr.last_ns = int(3.6 * S)
    led.on_tokens(tr, tr.first_ns, 1)
    for k in range(1, 10):
        tr.last_ns = int((3.6 + 0.04 * k) * S)
        led.on_tokens(tr, tr.last_ns, 1)
    tr.end_ns = int(4.0 * S)
    tr.counts = Counts(generated_tokens=10, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)
    feed(4.5, 550.0, 250.0)
    led.advance(int(4.7 * S))
    led.close_all(int(5.5 * S))
    [row] = sink.rows["requests"]
    assert row["gpu_energy_j"] == pytest.approx(151.0, abs=1.5), row
    assert UNSURE_FLAG not in (row["energy_note"] or ""), row["energy_note"]
    assert UNSURE_FLAG not in led.totals.jpt_left_out, led.totals.jpt_left_out



# SGLang's scheduler abort of a prompt in the context's last 6 tokens (managers/utils.py validate_input_length), as the
# proxy reads it from a 400's body (proxy.error_message).
BAND_MSG = ("Input length (58 tokens) exceeds the maximum allowed length (58 tokens). Use a shorter input or enable "
            "--allow-auto-truncate.")
# The same abort in a 131,072-token context: a null batch's run bounded by its prompts' size, not by the context
# (`ledger.batch_context`).
BAND_MSG_128K = ("Input length (131066 tokens) exceeds the maximum allowed length (131066 tokens). Use a shorter input "
                 "or enable --allow-auto-truncate.")


def _batch_answered(led, rid, status, extra, end_s=0.5, msg=BAND_MSG):
    """A /v1/completions request with `extra` (the proxy's reading of its body) answered `status` at `end_s`, its body's
    message `msg`."""
    tr = RequestTrace(rid, "POST", "/v1/completions", "t", int(0.2 * S), 0, api="openai-completions", stream=False)
    tr.extra.update(extra)
    if msg is not None:
        tr.extra["error_message"] = msg
    led.on_start(tr)
    _answered_without_counts(led, tr, status, end_s)


def test_only_a_400_to_two_prompts_that_sglangs_band_abort_can_leave_running_is_recorded_as_a_batch_run_on():
    # SGLang's scheduler aborts a prompt in the context's last 6 tokens; one with prompt + max_tokens past the context
    # is refused with its whole batch, unrun (docs/simulator.md). Before: every error to 2+ sequences was recorded (a
    # 2-prompt batch refused for n 0: 30 s of windows marked; n 2 of one prompt: all 4 streams flagged), and under
    # scrape.server = none every one stayed (200 entries after 45 s, never pruned).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    _batch_answered(led, 1, 400, {"sequences": 2})  # no server page read: no window to mark
    assert led.recon.batch_run_ons == {}
    led.recon.server_seen = True
    _batch_answered(led, 2, 500, {"sequences": 2})  # no band abort
    _batch_answered(led, 3, 429, {"sequences": 2})
    _batch_answered(led, 4, 400, {"sequences": 2, "choices": 2})  # n 2 of one prompt
    _batch_answered(led, 5, 400, {"sequences": 2, "max_tokens": 7})  # a band prompt + 7 passes the context: refused
    # Only SGLang's band abort's message: before, any 400 was taken (a batch SGLang refused unrun marked 233 s, a vLLM
    # or llama.cpp bad-parameter 400 under none 3 s each).
    _batch_answered(led, 10, 400, {"sequences": 2, "max_tokens_null": True}, msg="The input (2501 tokens) is longer "
                    "than the model's context length (2048 tokens).")
    _batch_answered(led, 11, 400, {"sequences": 2, "max_tokens": 5}, msg="temperature must be non-negative")
    _batch_answered(led, 12, 400, {"sequences": 2, "max_tokens": 5}, msg=None)  # its body's message unread
    # SGLang's validation 400 echoes the client's input ("temperature": the abort's words, refused unrun): before, any
    # message holding the words marked (83.4 s under none for 2 x 20,000 characters, max_tokens 6); now its start only.
    for rid, field in ((13, "temperature"), (14, "return_logprob")):
        _batch_answered(led, rid, 400, {"sequences": 2, "max_tokens": 6}, msg=(
            f"1 validation error:\n  {{'type': 'float_parsing', 'loc': ('body', '{field}'), 'msg': 'Input should be a "
            "valid number', 'input': 'Input length (58 tokens) exceeds the maximum allowed length (58 tokens)'}"))
    _batch_answered(led, 15, 400, {"sequences": 2, "max_tokens": 6}, msg="exceeds the maximum allowed length")
    assert led.recon.batch_run_ons == {}
    led._paces.append(40.0)  # a pace: a known limit's span ends
    _batch_answered(led, 9, 400, {"sequences": 3})  # no limit sent: SGLang's default (16) passes the band, unrun
    assert led.recon.batch_run_ons == {}
    _batch_answered(led, 6, 400, {"sequences": 2, "max_tokens": 6})
    _batch_answered(led, 7, 400, {"sequences": 4, "choices": 2, "max_tokens_null": True})  # two prompts, n 2: no end
    _batch_answered(led, 8, 400, {"sequences": 3, "max_tokens_null": True})  # overlapping: merged, one, not many
    assert list(led.recon.batch_run_ons) == [8], led.recon.batch_run_ons
    led.serves_generate = False  # known not SGLang: dropped at the next close
    led.recon.server_seen = False  # no window read here (none fed): bypass_over does not run
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(2.5 * S))
    assert led.recon.batch_run_ons == {}


def test_a_batch_run_on_is_pruned_by_time_with_no_scrape_window_read():
    # Pruned before only inside bypass_over, by the windows it reads: with none read, every entry stayed.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.recon.server_seen = True
    led._paces.append(40.0)  # its span ends: twice 6 tokens at 40 tok/s past its arrival
    _batch_answered(led, 1, 400, {"sequences": 2, "max_tokens": 6, "prompt_chars": 40, "prompt_count": 2})  # unknown kind
    assert list(led.recon.batch_run_ons) == [1]
    led.recon.server_seen = False  # as no window read: bypass_over does not run
    for k in range(45):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(44.5 * S))
    assert led.recon.batch_run_ons == {}


def test_a_batch_400_with_no_server_scraped_marks_a_bounded_span_and_many_merge_into_one():
    # scrape.server = none: before, nothing was recorded (no scrape window), the batch's work in the rows beside it
    # unflagged. Now a span from its arrival over its prompts' prefill (their size at BATCH_PREFILL_FLOOR_TOK_S) and its
    # limit at the streams' pace shared by its sequences, a null's limit the context at most (its prompts' size + 6),
    # and a second; no pace yet: 5 tok/s so shared; at most BATCH_SPAN_MAX_S. Many 400s overlapping cost one span.
    from powerprof.daemon.ledger import (BATCH_PACE_FLOOR_TOK_S, BATCH_PREFILL_FLOOR_TOK_S, BATCH_SPAN_MAX_S,
                                         batch_context_bound)
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    _batch_answered(led, 1, 400, {"sequences": 2, "max_tokens": 6, "prompt_chars": 40, "prompt_count": 2})  # no pace
    span_s = 48 / BATCH_PREFILL_FLOOR_TOK_S + 6 / (BATCH_PACE_FLOOR_TOK_S / 2)
    (a0, a1), = led._batch_spans
    assert a0 == int(0.2 * S) and a1 == pytest.approx((0.2 + span_s + 1.0) * S, abs=1e3), led._batch_spans
    assert led.recon.batch_run_ons == {}  # no scrape window to mark
    led._paces.append(40.0)
    null = {"sequences": 2, "max_tokens_null": True, "prompt_chars": 100, "prompt_count": 2}
    assert batch_context_bound(null) == 108
    for rid in range(2, 40):
        _batch_answered(led, rid, 400, null, msg=BAND_MSG_128K)
    (a0, a1), = led._batch_spans  # bounded, one span
    assert a1 == pytest.approx((0.2 + 108 / BATCH_PREFILL_FLOOR_TOK_S + 108 / 20.0 + 1.0) * S, abs=1e3), a1
    _batch_answered(led, 50, 400, {"sequences": 2, "max_tokens_null": True},
                    msg=BAND_MSG_128K)  # its prompts' size unread: no end...
    assert led._batch_spans == [(int(0.2 * S), int((0.2 + BATCH_SPAN_MAX_S + 1.0) * S))]  # ...but the cap's


def test_a_cheap_null_batch_400_marks_at_most_the_span_cap_and_its_row_says_the_cut():
    # The review's repro_a_abuse: a /generate batch of 2 prompts totalling 100,000 characters, null max_new_tokens,
    # under scrape.server = none (answered in 10 ms). Before: marked 40,004 s with no pace, 5,001 s at 40 tok/s (a 1 MB
    # body 4.6 days): one 400 blanked J/token for hours. Now at most BATCH_SPAN_MAX_S (600 s), its row saying where.
    from powerprof.daemon.ledger import BATCH_SPAN_MAX_S
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.run_ons_unknown = True
    led._paces.append(40.0)
    tr = RequestTrace(1, "POST", "/generate", None, int(0.2 * S), 0, api="sglang-generate", stream=False)
    tr.extra.update(sequences=2, max_tokens_null=True, prompt_chars=100_000, prompt_count=2,
                    error_message=BAND_MSG_128K)
    led.on_start(tr)
    _answered_without_counts(led, tr, 400, 0.21)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9)
    assert (a1 - a0) / 1e9 == pytest.approx(BATCH_SPAN_MAX_S + 1.0), led._batch_spans
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(2.5 * S))
    note = {r["request_id"]: r["energy_note"] for r in sink.rows["requests"]}[1]
    assert "marked 600 s from its arrival at most: its bound ran longer" in note, note


@pytest.mark.parametrize("scraped", [True, False])
def test_a_streamed_completions_batch_sglang_aborts_one_prompt_of_is_marked_to_its_abort_task(scraped):
    # Streamed, SGLang answers such a batch 200 with one error event (its scheduler's abort message), then [DONE], and
    # aborts the other prompts 2 s after the stream's end (tokenizer_manager.py create_abort_task). Before: a 200, not
    # recorded: its run unmarked, scraped or not. Now marked to that abort. Its span was the sooner of that abort and
    # its limit at the pace: 0.14 s on the simulator while the others' prefill ran to 2.03 s; now that abort outright.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.recon.server_seen, led.run_ons_unknown = scraped, not scraped
    led._paces.append(200.0)  # 6 tokens at 200 tok/s: 0.03 s, long before the abort
    tr = RequestTrace(1, "POST", "/v1/completions", "t", int(0.2 * S), 0, api="openai-completions", stream=True)
    tr.extra.update(sequences=2, max_tokens=6, prompt_chars=120)
    led.on_start(tr)
    tr.status, tr.end_ns = 200, int(0.3 * S)
    tr.counts = Counts(None, None, None, None, "none", server_error=(
        "Input length (58 tokens) exceeds the maximum allowed length (58 tokens). Use a shorter input or enable "
        "--allow-auto-truncate."))
    led.on_end(tr)
    span = (int(0.2 * S), int(2.3 * S))
    if scraped:
        assert led.recon.batch_run_ons == {1: span}, led.recon.batch_run_ons
    else:
        assert led._batch_spans == [(span[0], span[1] + S)], led._batch_spans
    # Another in-band error, or a 200 to a whole request, is no such abort.
    tr2 = RequestTrace(2, "POST", "/v1/completions", "t", int(0.2 * S), 0, api="openai-completions", stream=True)
    tr2.extra.update(sequences=2, max_tokens=6)
    led.on_start(tr2)
    tr2.status, tr2.end_ns = 200, int(0.3 * S)
    tr2.counts = Counts(None, None, None, None, "none", server_error="out of memory")
    led.on_end(tr2)
    assert len(led.recon.batch_run_ons) + len(led._batch_spans) == 1
    led.recon.server_seen = False  # no window read here (none fed): bypass_over does not run
    for k in range(4):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(3.5 * S))
    notes = {r["request_id"]: r["energy_note"] for r in sink.rows["requests"]}
    assert "cause (1 other sequence(s), up to 6 tokens each, for at most 2.1 s" in notes[1], notes[1]
    assert "cause" not in notes[2], notes[2]


def test_a_400_batchs_row_says_windows_marked_only_where_the_ledger_marked_them():
    # Before: said from its status and sequences alone, so a vLLM batch refused for max_tokens 0 said its windows were
    # marked batch_run_on (none were) and blamed SGLang.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.serves_generate = False  # vLLM or llama.cpp: nothing recorded
    sized = {"sequences": 2, "max_tokens": 6, "prompt_chars": 40, "prompt_count": 2}
    _batch_answered(led, 1, 400, sized)
    led.serves_generate, led.recon.server_seen = None, True
    _batch_answered(led, 2, 400, sized)  # kind unknown yet: recorded
    led.recon.server_seen = False  # no window read here (none fed): bypass_over does not run
    for k in range(3):
        _feed(led, float(k), 100.0 * k)
    led.advance(int(2.5 * S))
    notes = {r["request_id"]: r["energy_note"] for r in sink.rows["requests"]}
    assert "batch_run_on" not in notes[1] and "SGLang" not in notes[1] and "no GPU work" in notes[1], notes[1]
    assert "batch_run_on" in notes[2] and "SGLang runs a batch's other prompts" in notes[2], notes[2]
    # It names what it set off and that it is charged none of it (before: only that the work is in unproxied), and the
    # fix its client has: a limit above 6, so SGLang refuses such a batch whole, unrun.
    assert "cause (1 other sequence(s), up to 6 tokens each, for at most" in notes[2], notes[2]
    assert "charged none of it" in notes[2] and "max_new_tokens (max_tokens) above 6" in notes[2], notes[2]


def _band_generate(led, rid, arrival_s, end_s, **extra):
    """A /generate batch SGLang answered its band abort's 400 at `end_s`, `extra` the proxy's reading of its body. Its
    abort's message says a 131,072-token context unless `extra` gives one (`ledger.batch_context`): a smaller one
    bounds a null's run and sets the length its prefill's rate is taken at. Before, 58 tokens by default: a scene of
    251 tokens a sequence bounded at 64, a prefill scene's rate taken at 64 tokens (not scaled at all)."""
    tr = RequestTrace(rid, "POST", "/generate", None, int(arrival_s * S), 0, api="sglang-generate", stream=False)
    tr.extra.update({"error_message": BAND_MSG_128K, **extra})
    led.on_start(tr)
    _answered_without_counts(led, tr, 400, end_s)
    return tr


def test_a_batch_400s_span_holds_its_prompts_prefill_at_the_streams_rate():
    # The review's test_repro_c_prefill: 24 prompts of 1,500 tokens (6,000 characters) and a band prompt, max_new_tokens
    # 6: SGLang prefills every other prompt first, the last prefill ending 2.25 s after the batch's arrival (808 J for
    # nobody). Before: its span was twice 6 tokens at the pace, 0.14 s (and a second): streams at 2.1 s +19..+222%,
    # unflagged. Now its prompts' size (a token a character) at the rate its streams' time to first token showed,
    # taken at a 2,048-token context (`BATCH_PREFILL_CTX_SHARE`; its 1,500-token prompts fit).
    from powerprof.daemon.ledger import BATCH_PREFILL_CTX_SHARE as k
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    tr, ev, p = _streamed(1, 0.0, 0.1, 0.6, n=40, prompt=1600)  # 1,600 tokens to its first in 0.1 s: 16,000 tok/s
    led.on_start(tr)
    for t, n in ev:
        led.on_tokens(tr, t, n)
    tr.first_ns, tr.last_ns, tr.end_ns = ev[0][0], ev[-1][0], ev[-1][0] + int(0.05 * S)
    tr.counts = Counts(generated_tokens=len(ev), prompt_tokens=p, model=None, stop_reason="length",
                       token_source="usage", cached_tokens=0)  # its server said its cache's part: none
    led.on_end(tr)
    assert [r for r, _ in led._prefill_rates] == [pytest.approx(16000.0)], led._prefill_rates
    msg = ("Input length (2045 tokens) exceeds the maximum allowed length (2042 tokens). Use a shorter input or enable "
           "--allow-auto-truncate.")
    _band_generate(led, 2, 1.0, 1.05, sequences=25, max_tokens=6, prompt_chars=24 * 6000 + 40, prompt_count=25,
                   error_message=msg)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9)
    # The truth's last prefill, and the slack; at most its prompts' characters (a token each) at the rate learned taken
    # at the 2,048-token context, the decode at the pace shared, and the slack (the floor's rate alone: 288 s).
    rate = 16000.0 * (1 + k * 1600) / (1 + k * 2048)
    assert 2.25 + 1.0 <= (a1 - a0) / 1e9 < 144090 / rate + 3.0, led._batch_spans


def _prefill_stream(led, rid, ttft_s, prompt, early=None, final=None, seqs=1):
    """A finished stream of `prompt` tokens, its first token `ttft_s` after its arrival, its cached count said early
    (`extra`) and/or in its final usage."""
    tr, ev, p = _streamed(rid, 0.0, ttft_s, 0.6, n=40, prompt=prompt)
    if early is not None:
        tr.extra["cached_tokens"] = early
    if seqs > 1:
        tr.extra["sequences"] = seqs
    led.on_start(tr)
    for t, n in ev:
        led.on_tokens(tr, t, n)
    tr.first_ns, tr.last_ns, tr.end_ns = ev[0][0], ev[-1][0], ev[-1][0] + int(0.05 * S)
    tr.counts = Counts(generated_tokens=seqs * len(ev), prompt_tokens=p, model=None, stop_reason="length",
                       token_source="usage", cached_tokens=final)


def test_a_batch_400s_prefill_rate_is_learned_low_never_from_a_cache_hit_or_a_batch():
    # The review's repro_c_cache_rate: a stream of 4,000 prompt tokens, 3,990 cached, first token at 20 ms. Before: its
    # cached count said only in its final usage was not taken off (200,000 tok/s learned, a 2-prompt 62,763-id batch's
    # span 1.48 s beside a 1.9 s true prefill at 16,000 tok/s); a server saying no cached count (SGLang's default)
    # taught the same; an 8-prompt stream's first token read all 8,000 tokens (114,286 tok/s); the median was taken.
    # Now only a single sequence whose server said a cached count teaches, that count taken off, and the lowest rate.
    from powerprof.daemon.ledger import BATCH_PREFILL_CTX_SHARE as k, BATCH_PREFILL_FLOOR_TOK_S
    for early, final in ((None, 3990), (3990, None), (3990, 3990), (None, None)):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        _prefill_stream(led, 1, 0.02, 4000, early=early, final=final)
        led.on_end(led.requests[1].trace)
        assert list(led._prefill_rates) == [], (early, final, led._prefill_rates)  # 10 tokens: under the least taught
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    _prefill_stream(led, 1, 0.07, 8000, final=0, seqs=8)  # a batch: its first prompt's prefill alone
    led.on_end(led.requests[1].trace)
    _prefill_stream(led, 2, 0.02, 4000)  # no cached count said: may be a hit
    led.on_end(led.requests[2].trace)
    assert list(led._prefill_rates) == [], led._prefill_rates
    _band_generate(led, 3, 1.0, 1.05, sequences=2, max_tokens=6, prompt_ids=30000 + 32763, prompt_count=2,
                   error_message=BAND_MSG)  # the floor's rate is not scaled, whatever the context
    (a0, a1), = led._batch_spans
    print("span s, floor", (a1 - a0) / 1e9)
    assert (a1 - a0) / 1e9 >= 62763 / BATCH_PREFILL_FLOOR_TOK_S, led._batch_spans
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    for rid, (ttft, prompt, early, final) in enumerate(((0.25, 4000, None, 0), (0.02, 4000, 10, 3990),
                                                        (0.1, 4000, 2000, None), (0.2, 4000, 0, 0)), 1):
        _prefill_stream(led, rid, ttft, prompt, early=early, final=final)  # 16,000, -, 20,000, 20,000 tok/s
        led.on_end(led.requests[rid].trace)
    assert sorted(r for r, _ in led._prefill_rates) == [pytest.approx(16000.0), pytest.approx(20000.0),
                                                         pytest.approx(20000.0)], led._prefill_rates
    msg = ("Input length (32763 tokens) exceeds the maximum allowed length (32762 tokens). Use a shorter input or "
           "enable --allow-auto-truncate.")
    _band_generate(led, 9, 1.0, 1.05, sequences=2, max_tokens=6, prompt_ids=30000 + 32763, prompt_count=2,
                   error_message=msg)
    (a0, a1), = led._batch_spans
    print("span s, learned", (a1 - a0) / 1e9)
    # The lowest rate, each learned on 4,000-token prompts, taken at the 32,768-token context (BATCH_PREFILL_CTX_SHARE).
    prefill_s = 62771 / (16000.0 * (1 + k * 4000) / (1 + k * 32768))
    assert prefill_s + 1.0 <= (a1 - a0) / 1e9 < prefill_s + 1.5, led._batch_spans


@pytest.mark.parametrize("prompts", [2, 8, 16])
def test_a_batch_400s_prefill_is_taken_slow_enough_for_a_small_models_long_prompts(prompts):
    # The review's F4 (repro_c_k): BATCH_PREFILL_CTX_SHARE 1.5e-4 fell short for small models: SmolLM2-135M's attention
    # share is 1.6e-4 a context token (Qwen3-0.6B's 1.3e-4), 3.3e-4 at half the weights' matmul efficiency. A rate learned
    # at 20,000 tok/s on 500-token prompts, a batch of 8 or 16 prompts of 30,000 ids and a band prompt in a 32,768
    # context, max_tokens 6: before, spans of 76.8 s and 143.5 s where Qwen3-0.6B's prefill at half efficiency runs
    # 93.5 s and 186.9 s (the rows between unflagged). Now 4e-4: past SmolLM2-135M's at half efficiency.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    _prefill_stream(led, 1, 0.025, 500, final=0)
    led.on_end(led.requests[1].trace)
    msg = ("Input length (32765 tokens) exceeds the maximum allowed length (32762 tokens). Use a shorter input or "
           "enable --allow-auto-truncate.")
    tr = RequestTrace(2, "POST", "/generate", None, int(1.0 * S), 0, api="sglang-generate", stream=False)
    tr.extra.update(error_message=msg, sequences=prompts + 1, max_tokens=6, prompt_ids=prompts * 30000 + 32765,
                    prompt_count=prompts + 1)
    led.on_start(tr)
    _answered_without_counts(led, tr, 400, 1.05)
    (a0, a1), = led._batch_spans
    truth_s = prompts * 30000 * (1 + 3.3e-4 * 30000) / (20000 * (1 + 3.3e-4 * 500))
    print("span s", (a1 - a0) / 1e9, "prefill truth s", truth_s)
    assert (a1 - a0) / 1e9 >= truth_s, led._batch_spans


def test_a_batch_400s_prefill_rate_learned_on_short_prompts_is_taken_at_its_long_prompts_length():
    # A rate learned on 500-token prompts (20,000 tok/s) was used whole for a batch of two 30,000-id prompts in a
    # 32,768-token context. Prefill slows with its context (attention): at Llama-3-8B's 1.9e-5 a context token and
    # attention at half the weights' matmul efficiency (3.8e-5), those 60,000 tokens take 60,000 (1 + 3.8e-5 * 30,000)
    # / (20,000 (1 + 3.8e-5 * 500)) = 6.3 s, then 6 tokens, where the span was 5.88 s with its slack (the
    # simulator prefills at one rate whatever the context, shorter prompts teaching a lower rate, so it cannot show
    # this). Now each rate is taken at the batch's longest prompt (at most its size and the context the abort's
    # message says): 55.8 s (26.8 s at BATCH_PREFILL_CTX_SHARE 1.5e-4).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    _prefill_stream(led, 1, 0.025, 500, final=0)  # 500 tokens to its first in 25 ms: 20,000 tok/s
    led.on_end(led.requests[1].trace)
    assert [r for r, _ in led._prefill_rates] == [pytest.approx(20000.0)], led._prefill_rates
    msg = ("Input length (32765 tokens) exceeds the maximum allowed length (32768 tokens). Use a shorter input or "
           "enable --allow-auto-truncate.")
    tr = RequestTrace(2, "POST", "/generate", None, int(1.0 * S), 0, api="sglang-generate", stream=False)
    tr.extra.update(error_message=msg, sequences=3, max_tokens=6, prompt_ids=2 * 30000 + 32765, prompt_count=3)
    led.on_start(tr)
    _answered_without_counts(led, tr, 400, 1.05)
    (a0, a1), = led._batch_spans
    truth_s = 60000 * (1 + 3.8e-5 * 30000) / (20000 * (1 + 3.8e-5 * 500))
    print("span s", (a1 - a0) / 1e9, "prefill truth s", truth_s)
    assert (a1 - a0) / 1e9 >= truth_s + 1.0, led._batch_spans


def test_a_null_batch_400s_run_is_bounded_by_the_context_its_abort_says():
    # A null batch runs its prompts to the context's end, and the abort's message says the context (its "maximum allowed
    # length" + 6): a 4,096-token context, two 400-character prompts beside a 16,000-character band one. Before: bounded
    # by their characters summed (16,809 tokens), at 40 tok/s shared by 3 its span ran past BATCH_SPAN_MAX_S and was cut
    # there, its row saying the rows beside its run past 600 s are not flagged. Now 4,096 tokens: under the cap.
    from powerprof.daemon.ledger import BATCH_SPAN_MAX_S
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    led._paces.append(40.0)
    msg = ("Input length (4090 tokens) exceeds the maximum allowed length (4090 tokens). Use a shorter input or enable "
           "--allow-auto-truncate.")
    tr = RequestTrace(1, "POST", "/generate", None, int(1.0 * S), 0, api="sglang-generate", stream=False)
    tr.extra.update(error_message=msg, sequences=3, max_tokens_null=True, prompt_chars=16000 + 2 * 400, prompt_count=3)
    led.on_start(tr)
    _answered_without_counts(led, tr, 400, 1.05)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9, led.requests[1].batch_bound)
    assert not led.requests[1].batch_capped and led.requests[1].batch_bound[1] == 4096, led.requests[1].batch_bound
    # Its others' run: at most 4,096 tokens at 40 tok/s shared by the 3 sequences.
    assert 4096 / (40.0 / 3) <= (a1 - a0) / 1e9 < BATCH_SPAN_MAX_S, led._batch_spans


def _sglang_capped_batch_beside_streams(batch_end_s, streams, monkeypatch, end_s=50.0, dt=0.25, restart_s=None,
                                       bypass=None, latency=False):
    # SGLang, scraped (its counter at-finish: a request's tokens counted at its end), 100 W throughout: a null /generate
    # batch of 2 prompts answered 400 at 0.3 s (128K context: bounded far past the cap, BATCH_SPAN_MAX_S cut to 20 s
    # here), its other prompt decoding for nobody at 40 tokens/s to `batch_end_s`, counted then; streams (from, to) s
    # at 40 tokens/s beside it (ids 10, 11, ...), each counted at its end; `restart_s`: the page of the scrape then says
    # a restart (its process gone, the batch's run with it: its count never comes); `bypass`: (at s, tokens) a bypass
    # request of 0.1 s counted then; `latency`: each window tells its finished requests' summed end-to-end seconds
    # (SGLang's histogram). The rows by id.
    from powerprof.daemon import ledger as ledger_mod
    from powerprof.daemon.scrape import RUNS_ON_AFTER_LEAVE
    monkeypatch.setattr(ledger_mod, "BATCH_SPAN_MAX_S", 20.0)
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.serves_generate, led.runs_on_after_leave, led.scraping = True, RUNS_ON_AFTER_LEAVE["sglang"], True
    led._paces.append(40.0)
    batch = RequestTrace(1, "POST", "/generate", None, int(0.2 * S), 0, api="sglang-generate", stream=False)
    batch.extra.update(sequences=2, max_tokens_null=True, prompt_chars=200_000, prompt_count=2,
                       error_message=BAND_MSG_128K)
    led.on_start(batch)
    near = {}
    for i, (a, z) in enumerate(streams):
        near[10 + i] = [RequestTrace(10 + i, "POST", "/v1/chat/completions", None, int(a * S), 0, api="openai-chat",
                                     stream=True), a, z, 0]
        near[10 + i][0].extra["prompt_chars"] = 400
    e, prev, counted_batch = 0.0, None, False
    for k in range(int(round(end_s / dt)) + 1):
        t = k * dt
        count, done, lat = 0.0, 0, 0.0
        if bypass is not None and prev is not None and prev < bypass[0] <= t:
            count, done, lat = count + bypass[1], done + 1, lat + 0.1
        if prev is not None and prev < 0.3 <= t:
            led.recon.server_seen = True
            _answered_without_counts(led, batch, 400, 0.3)
        for rid, v in near.items():
            tr, a, z, _ = v
            if tr.end_ns is not None or t < a - 1e-9:
                continue
            if rid not in led.requests:
                led.on_start(tr)
            for j in range(int(round(dt / 0.025))):
                ts = t - dt + (j + 1) * 0.025
                if a < ts <= z + 1e-9:
                    tr.first_ns, tr.last_ns = tr.first_ns or int(ts * S), int(ts * S)
                    led.on_tokens(tr, int(ts * S), 1)
                    v[3] += 1
            if t >= z - 1e-9:
                count, done, lat = count + v[3], done + 1, lat + (z - a)
                tr.end_ns, tr.outcome = int(z * S), "ok"
                tr.counts = Counts(generated_tokens=v[3], prompt_tokens=100, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        restart = restart_s is not None and prev is not None and prev < restart_s <= t
        if restart_s is not None and t >= restart_s:
            counted_batch = True  # died with its process: never counted
        if not counted_batch and t >= batch_end_s - 1e-9:
            count, done, lat = count + 40.0 * (batch_end_s - 0.5), done + 1, lat + batch_end_s - 0.2
            counted_batch = True
        e += 100.0 * dt
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, 100.0)])
        if prev is not None:
            led.add_server_tokens(int(t * S), count, int(prev * S), at_finish=True,
                                  partial=("server_restart",) if restart else (),
                                  finished=(done, lat) if latency else None)
        prev = t
        led.advance(int(t * S))
    led.close_all(int(end_s * S))
    return {r["request_id"]: r for r in led.emit.rows["requests"]}


@pytest.mark.parametrize("batch_end_s,restart_s,flagged", [(35.0, None, True), (3.0, None, False), (35.0, 22.0, False)],
                         ids=["runs_past_the_cap", "ended_early", "restarted_past_the_cap"])
def test_rows_beside_a_capped_sglang_batch_still_uncounted_past_the_cap_are_flagged(batch_end_s, restart_s, flagged,
                                                                                      monkeypatch):
    # A batch 400's marked span is cut at BATCH_SPAN_MAX_S (20 s here). SGLang counts a request's tokens at its end: no
    # unlisted token counted since the batch's arrival says its other prompts have not ended, so a run past the cap is
    # still marked (batch_run_on) until the count shows them. Before, a stream 25-28 s beside the run to 35 s read 300 J
    # for the truth's 150 J (+100%), unflagged (600 s cap: streams at 700 and 850 s beside a run to 900 s, 500 J for 250).
    # Its count seen at 3 s (ended early), the span stays at the cap, the stream unflagged (its whole 300 J its own).
    # A restart the page says at 22 s ends its run there: not held past it (held on, the stream was flagged, and every
    # row after it to the batch's bound). One after the run's count (38-41 s) is not flagged either way.
    rows = _sglang_capped_batch_beside_streams(batch_end_s, [(25.0, 28.0), (38.0, 41.0)], monkeypatch,
                                               restart_s=restart_s)
    note, after = rows[10]["energy_note"] or "", rows[11]["energy_note"] or ""
    print(rows[10]["gpu_energy_j"], note, rows[11]["gpu_energy_j"], after)
    assert (BYPASS_LOW_FLAG in note and "batch_run_on" in note) == flagged, note
    assert BYPASS_LOW_FLAG not in after, after
    if not flagged:
        assert rows[10]["gpu_energy_j"] == pytest.approx(300.0, rel=0.05), rows[10]
    assert rows[11]["gpu_energy_j"] == pytest.approx(300.0, rel=0.05), rows[11]


@pytest.mark.parametrize("bypass", [(22.0, 3), (22.0, 20), (10.0, 20)], ids=["3_at_22s", "20_at_22s", "20_at_10s"])
@pytest.mark.parametrize("latency", [True, False], ids=["histogram", "no_histogram"])
def test_a_small_bypass_count_does_not_let_go_of_a_capped_sglang_batch_still_running(bypass, latency, monkeypatch):
    # The review's scene_batch_bypass: the capped batch (cap 20 s) runs to 35 s, and one small bypass request is counted
    # while it runs. Before, any unlisted count over a token let go of its hold: the stream at 25-28 s read 300 J for
    # the truth's 150 J (+100%), unflagged. Now only a count the batch's prompts' end may be: with SGLang's histogram,
    # a request finished whose latency reaches the batch's age (0.1 s is none); without it, at least what a sequence
    # decodes from its prefill's end at its span's pace (its 200,000-character prompts bounded at 400 s of prefill:
    # 20 tokens at 22 s pass then, the hold let go as before, said on its 400's row).
    rows = _sglang_capped_batch_beside_streams(35.0, [(25.0, 28.0), (38.0, 41.0)], monkeypatch, bypass=bypass,
                                               latency=latency)
    note, after = rows[10]["energy_note"] or "", rows[11]["energy_note"] or ""
    print(rows[10]["gpu_energy_j"], note)
    assert (BYPASS_LOW_FLAG in note and "batch_run_on" in note) == latency, note
    assert BYPASS_LOW_FLAG not in after, after
    assert rows[11]["gpu_energy_j"] == pytest.approx(300.0, rel=0.05), rows[11]


def test_a_bypass_count_a_capped_batch_could_not_have_made_by_its_pace_keeps_its_hold():
    # Without the histogram, the count must reach one sequence's decode from the batch's prefill's end (bounded) at its
    # span's pace: past that, 20 tokens are no end of a prompt decoding at 20 tokens a second for 100 s; 3,000 are.
    from powerprof.daemon.ledger import batch_count_may_end
    t0, one = np.array([110 * S]), (np.array([0]), np.array([10 * S]), np.array([20.0]))
    assert [batch_count_may_end(*one, t0, t0 + S // 4, np.array([n]), np.array([np.nan]))[0] for n in (20.0, 3000.0)] \
        == [False, True]
    # With it, a request finished whose latency reaches the batch's age less BATCH_HOLD_SLACK_S, whatever its tokens.
    assert [batch_count_may_end(*one, t0, t0 + S // 4, np.array([n]), np.array([s]))[0]
            for n, s in ((20.0, 109.5), (3000.0, 0.5))] == [True, False]
    # A window ending by a batch's arrival is none of its: batches by windows at once.
    got = batch_count_may_end(np.array([0, 200 * S]), np.array([10 * S, 210 * S]), np.array([20.0, 20.0]), t0,
                              t0 + S // 4, np.array([3000.0]), np.array([np.nan]))
    assert got.tolist() == [True, False]


def test_a_proxied_requests_latency_is_no_capped_batchs_end():
    # SGLang's histogram sums every finished request's latency, the proxy's own too: a 3-token bypass request (0.1 s)
    # ending beside a proxied answer of 30 s, 30.1 s in all, is no end of a batch 25 s old. Before (the sum taken
    # whole), its hold was let go; the proxied one's latency (`recon.finished`) is taken off first.
    from powerprof.daemon.reconcile import _ScrapeWindow
    for listed, held in ((True, True), (False, False)):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        led.recon.batch_run_ons = {1: (0, int(20 * S))}
        led._batch_run_on_batches = {1: [(0, int(20 * S))]}
        led._batch_uncounted = {1: (0, int(7000 * S), int(400 * S), 20.0)}
        sp = _ScrapeWindow(t0_ns=int(25 * S), t1_ns=int(25.25 * S), server_tokens=1203.0, finished_latency=(2, 30.1),
                           partial=(), restarted=False, read_span_ns=None, finished_requests=2, bypass_tokens=3.0)
        led.recon.server_spans = [sp]
        if listed:
            led.recon.finished.append((int(25.1 * S), 1200.0, int(30 * S)))
        led._hold_uncounted_batches(int(26 * S))
        assert (1 in led._batch_uncounted) == held, led._batch_uncounted
        assert (led.recon.batch_run_ons[1][1] == int(26 * S)) == held, led.recon.batch_run_ons


def test_holding_uncounted_batches_reads_the_windows_and_deaths_once_a_call(monkeypatch):
    # The review's perf_hold.py: each held 400 rescanned every window and every death shown, 446 ms a step at 5,000 held
    # 400s over 600 windows. Now the deaths are judged once a call (and the windows read once into arrays): 300 held
    # 400s beside 4 deaths judge 4, not 1,200; none let go (no death, no count since their arrival), their span held on.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led._gone_at = [(int((650 + k) * S), 0, None, None) for k in range(4)]
    calls = []
    monkeypatch.setattr(led, "_batch_death", lambda g: calls.append(g) or False)
    led.recon.batch_run_ons = {1: (int(10 * S), int(600 * S))}
    led._batch_run_on_batches = {1: [(int(10 * S + i * S // 10), int(600 * S)) for i in range(300)]}
    led._batch_uncounted = {i: (int(10 * S + i * S // 10), int(7000 * S), int(7000 * S), 1.0) for i in range(300)}
    led._hold_uncounted_batches(int(700 * S))
    assert len(calls) == 4, len(calls)
    assert len(led._batch_uncounted) == 300 and led.recon.batch_run_ons[1] == (int(10 * S), int(700 * S))


def test_a_batch_400s_pace_is_shared_by_every_sequence_live_beside_it():
    # The review's test_repro_c4_pace_big: a pace learned light (86 tok/s), then 30 streams live and a null batch of 30
    # short id prompts and a band prompt (253 ids): its others ran 251 tokens each at ~19 tok/s a sequence, to 13.35 s
    # from its arrival. Before: twice its bound at 86 tok/s, to 9.83 s: streams at 11.1 s +561%, unflagged. Now the
    # pace is shared by its sequences and those live (the server's aggregate rate does not fall as they join). Its
    # abort's message says the scene's 256-token context: a null runs to 256 tokens (with the 58-token context the
    # helper said before, bounded at 64: a span of 47.2 s for 183.3 s, passing only by the 61 sequences sharing it).
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    led._paces.append(86.0)
    for k in range(30):
        led.on_start(_chat(10 + k, 0.5, 400))
    msg = ("Input length (253 tokens) exceeds the maximum allowed length (250 tokens). Use a shorter input or enable "
           "--allow-auto-truncate.")
    _band_generate(led, 2, 1.0, 1.05, sequences=31, max_tokens_null=True, prompt_ids=30 * 3 + 253, prompt_count=31,
                   error_message=msg)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9, led.requests[2].batch_bound)
    assert led.requests[2].batch_bound[1] >= 251, led.requests[2].batch_bound  # the tokens a sequence ran
    assert (a1 - a0) / 1e9 >= 13.35 + 1.0, led._batch_spans


def test_an_expired_requests_sequences_leave_the_live_count_a_batch_400s_pace_is_shared_by():
    # The review's F3: a request whose on_end never came (a recorder error) is expired at MAX_OPEN_S, but its sequences
    # stayed in the live count for good: 50 such 8-sequence requests, and every later 2-prompt max_tokens-6 batch was
    # marked 62.52 s instead of 2.52 s. Now they leave with it.
    from powerprof.daemon.ledger import MAX_OPEN_S
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    led._paces.append(40.0)
    for k in range(50):
        tr = RequestTrace(100 + k, "POST", "/generate", None, int(0.2 * S), 0, api="sglang-generate", stream=False)
        tr.extra.update(sequences=8)
        led.on_start(tr)
    led._expire(int(0.2 * S) + int((MAX_OPEN_S + 1) * S))
    assert led.requests == {} and led._live_seqs == {}, len(led._live_seqs)
    _band_generate(led, 1, 0.5, 0.6, sequences=2, max_tokens=6, prompt_chars=40, prompt_count=2)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9)
    assert (a1 - a0) / 1e9 < 3.0, led._batch_spans


def test_a_request_whose_recording_broke_leaves_the_live_count_at_its_end():
    # A request whose recording broke gets no on_end (proxy.Proxy._safe, the workers' replay alike), yet the split
    # retires it by its trace's end, out of reach of its expiry: its sequences stayed in the live count for good, and a
    # later batch's pace was shared by them. 50 such 8-sequence requests: a 2-prompt max_tokens-6 batch marked 61.4 s
    # instead of 1.4 s.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.run_ons_unknown = True
    _idle_measured(led)
    led._paces.append(40.0)
    for k in range(50):
        tr = RequestTrace(100 + k, "POST", "/generate", None, int(0.2 * S), 0, api="sglang-generate", stream=False)
        tr.extra.update(sequences=8)
        led.on_start(tr)
        tr.status, tr.end_ns, tr.outcome, tr.recorder_error = 200, int(0.5 * S), "ok", "parser: broken"  # no on_end
    for k in range(1, 21):
        _feed(led, 0.1 * k, 20.0 * k)
    led.advance(int(2.0 * S) + led.grace_ns)
    assert led.requests == {} and led._live_seqs == {}, sum(led._live_seqs.values())
    _band_generate(led, 1, 2.5, 2.6, sequences=2, max_tokens=6, prompt_chars=40, prompt_count=2)
    (a0, a1), = led._batch_spans
    print("span s", (a1 - a0) / 1e9)
    assert (a1 - a0) / 1e9 < 3.0, led._batch_spans


def test_a_restart_ends_a_batch_400s_span_at_its_window():
    # The process that ran the batch's other prompts died in the restart: none ran past its window. Before: marked on
    # to its bound (31.6 s here), the new process's rows flagged for nothing.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.recon.server_seen = True
    led._paces.append(40.0)
    _band_generate(led, 1, 0.5, 0.6, sequences=2, max_tokens_null=True, error_message=BAND_MSG_128K, prompt_chars=600,
                   prompt_count=2)
    assert list(led.recon.batch_run_ons.values())[0][1] > int(30 * S), led.recon.batch_run_ons
    led.add_server_tokens(int(1.0 * S), 0.0, None)
    led.add_server_tokens(int(6.0 * S), 0.0, int(5.0 * S), partial=("server_restart",))
    a, b = led.recon.restarts[-1]
    assert list(led.recon.batch_run_ons.values()) == [(int(0.5 * S), b)], (led.recon.batch_run_ons, (a, b))


def _connect_refused(led, rid, at_s):
    """A proxied request whose connect to the server was refused at `at_s` (upstream_unreachable): a death's mark."""
    tr = _chat(rid, at_s, 100)
    led.on_start(tr)
    tr.end_ns, tr.outcome, tr.status, tr.error = int(at_s * S), "upstream_unreachable", 502, "x"
    led.on_end(tr)


def _cut_mid_answer(led, rid, at_s):
    """A proxied request whose connection to the server broke mid-answer at `at_s` (bytes came, then a reset): what a
    dying process does to the requests it runs, unlike a refused connect (nothing listening for a moment)."""
    tr = _chat(rid, at_s - 0.2, 100)
    led.on_start(tr)
    tr.end_ns, tr.outcome, tr.status, tr.error = int(at_s * S), "upstream_error", 200, "ReadError: connection reset"
    led.on_end(tr)


def _batch_and_first_page(led):
    """A null /generate batch SGLang answered its band abort's 400 at 0.6 s (its span to about 32 s), then a page."""
    led.recon.server_seen = True
    led._paces.append(40.0)
    _band_generate(led, 1, 0.5, 0.6, sequences=2, max_tokens_null=True, error_message=BAND_MSG_128K, prompt_chars=600,
                   prompt_count=2)
    led.add_server_tokens(int(1.0 * S), 0.0, None)
    (_, b), = led.recon.batch_run_ons.values()
    return b


def test_a_death_the_page_says_no_restart_of_leaves_a_batch_400s_span_to_its_bound_a_counters_fall_too():
    # A refused scrape, then a page that says no restart: a death, or nothing listening for a moment while the same
    # process lived on (a Kubernetes Service's pod out of its readiness, a port-forward's hiccup; the scraper cannot tell
    # a young counter's). Its span stays to its bound (an over-flag at worst), a refused connect or even a connection
    # cut mid-answer in the window beside it (a port-forward's hiccup cuts established streams too): the review of
    # batchfix8's fault 1, a refused connect cut it at 0.8 s after its arrival while the batch ran on to ~32 s, the rows
    # between unflagged. A restart told by a counter's fall alone (a multi-process page's dip) cut it at 6 s where the
    # batch ran on to the real one at 21 s.
    for proof in (None, _connect_refused, _cut_mid_answer):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        bound = _batch_and_first_page(led)
        assert bound > int(30 * S), bound
        led.add_server_tokens(int(6.0 * S), 0.0, int(5.0 * S), down_ns=int(5.5 * S), down_refused=True)
        assert led._died_unrestarted, led._gone_at
        if proof is not None:
            proof(led, 2, 5.6)
        print(getattr(proof, "__name__", None), "span end from arrival s",
              (list(led.recon.batch_run_ons.values())[0][1] - 0.5 * S) / 1e9)
        assert list(led.recon.batch_run_ons.values()) == [(int(0.5 * S), bound)], (proof, led.recon.batch_run_ons)
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    _batch_and_first_page(led)
    led.add_server_tokens(int(6.0 * S), 0.0, int(5.0 * S), partial=("server_restart",), restart_by_fall=True)
    led.add_server_tokens(int(21.0 * S), 0.0, int(20.0 * S), partial=("server_restart",))
    assert list(led.recon.batch_run_ons.values()) == [(int(0.5 * S), int(21.0 * S))], led.recon.batch_run_ons


def test_a_restart_after_a_503_ends_a_batch_400s_span_only_where_a_death_is_shown():
    # The review's F2 (repro_a 2): a gateway's 503, then a page whose counter dipped (50M, 503, 25M, then 50,000,400: the
    # same process, one process's share of the page lagging): the scraper says server_restart, not by the fall alone
    # (a 503 came first), nothing refused. Before, that cut a batch's span from 32.1 s to 6.0 s after its arrival while
    # it ran on, the rows between unflagged. Now only a death shown cuts it (`Ledger._batch_death`): the down scrape
    # refused; else its bound, an over-flag at worst. A refused connect is no such proof (nothing listening for a
    # moment), as the review of batchfix8 (fault 1) found, nor a proxied connection cut mid-answer in the window (a
    # gateway's blip cuts established streams too: rev-late F3, taken for proof it cut the span at 5.5 s of 31.6 s).
    for shown in (None, "connect_refused", "cut", "refused"):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        bound = _batch_and_first_page(led)
        if shown == "connect_refused":
            _connect_refused(led, 2, 3.1)
        if shown == "cut":
            _cut_mid_answer(led, 2, 3.1)
        led.add_server_tokens(int(6.0 * S), 0.0, int(1.0 * S), partial=("server_restart",), restart_by_fall=False,
                              down_ns=int(3.0 * S), down_refused=shown == "refused")
        want = int(6.0 * S) if shown == "refused" else bound
        assert list(led.recon.batch_run_ons.values()) == [(int(0.5 * S), want)], (shown, led.recon.batch_run_ons)


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "burst_part"])
def test_a_held_windows_refused_death_in_its_burst_places_its_tokens_in_the_burst(whole):
    # A held slow window (0 to 2.0 s, idle at 50 W) whose 20 bypass tokens ran in its last 0.1 s (250 W) beside a
    # stream that arrived at 1.9 s, a scrape refused at 1.95 s, the page saying no restart. Given whole (before:
    # `service.held_death_part`), its tokens were spread over the stillness: 19 in the idle intervals, `complete`, 120 J
    # unproxied for 25. Now the burst part (1.9 s, 2.0 s] takes them and the death, its window from 0 (dead_from_ns: it
    # may have come anywhere in it).
    from powerprof.daemon.proxy import RequestTrace

    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    _idle_measured(led, 50.0)
    led.scraping = True
    tr = RequestTrace(1, "POST", "/v1/chat/completions", None, int(1.9 * S), 0, api="openai-chat", stream=True)
    tr.extra.update(prompt_chars=40)
    led.add_server_tokens(0, 0.0, None)
    e, n = 0.0, 0
    for k in range(1, 41):
        t = k * 0.1
        if k == 19:
            led.on_start(tr)
        if 21 <= k <= 24:  # its 16 tokens from 2.0 s to 2.4 s, at 40 a second
            for j in range(4):
                ts = t - 0.1 + (j + 1) * 0.025
                tr.first_ns, tr.last_ns = tr.first_ns or int(ts * S), int(ts * S)
                led.on_tokens(tr, int(ts * S), 1)
        if k == 24:
            tr.end_ns, tr.outcome = int(2.4 * S), "ok"
            tr.counts = Counts(generated_tokens=16, prompt_tokens=10, model=None, stop_reason="length",
                               token_source="usage")
            led.on_end(tr)
        p = 250.0 if 20 <= k <= 24 else 50.0
        e += p * 0.1
        led.add_gpu_sample(int(t * S), int(t * S), [R(e, p)])
        read = (int((t - 0.001) * S), int((t + 0.001) * S))
        if k == 20:
            death = dict(down_ns=int(1.95 * S), down_refused=True, read_ns=read)
            if whole:
                led.add_server_tokens(int(2.0 * S), 20.0, 0, **death)
            else:
                led.add_server_tokens(int(1.9 * S), 0.0, 0)
                led.add_server_tokens(int(2.0 * S), 20.0, int(1.9 * S), dead_from_ns=0, **death)
        elif k > 20:
            led.add_server_tokens(int(t * S), 4.0 if k <= 24 else 0.0, int((t - 0.1) * S), read_ns=read)
        led.note_proxy_delay(int(t * S), 0.003)  # a proxy on time: no proxy_lag at its rise
        led.advance(int(t * S))
    led.close_all(int(4.0 * S))
    ivs = led.emit.rows["intervals"]
    idle = [x for x in ivs if x["t_start_mono_s"] + x["duration_s"] <= 1.9 + 1e-6 and x["t_start_mono_s"] >= 0]
    unproxied = sum(x["unproxied_energy_j"] or 0.0 for x in ivs)
    print("unproxied J", unproxied, "idle", sum(x["unproxied_energy_j"] or 0.0 for x in idle))
    assert list(led._gone_at) == [(0, int(2.0 * S), int(1.95 * S), True)], led._gone_at  # the death's window: whole
    if whole:
        assert unproxied == pytest.approx(120.0, abs=1) and {x["server_count"] for x in idle} == {"complete"}, ivs
    else:
        assert unproxied == pytest.approx(25.0, abs=1), ivs
        assert all(not x["unproxied_energy_j"] for x in idle), idle


def test_a_refused_scrape_the_same_process_may_be_back_from_leaves_a_batch_400s_span(monkeypatch):
    # The review's repro_a_refused_alive: a page at 50M tokens, one scrape refused (nothing listening for a moment, the
    # same process alive), the page back at 50M + 400, past anything a new process could have counted since
    # (scrape.FASTEST_SERVER_TOKENS_PER_S): the scraper reads it whole. Its refusal is kept (a restarted process whose
    # counter persisted reads so too: cleared, that death was lost, batchfix8's review fault 2), a death no page said a
    # restart of, which cuts no batch span: before, its span was cut from 31.6 s to 1.0 s after its arrival.
    from test_daemon_counter_dip import DOWN, _scrape_steps, _sglang

    got = []
    _scrape_steps("sglang", [_sglang(50_000_000), DOWN, _sglang(50_000_400)],
                  lambda sc: got.append((sc.window_partial, sc.window_down_ns, sc.window_down_refused)),
                  monkeypatch=monkeypatch)
    (partial, down_ns, refused) = got[2]
    assert partial == () and down_ns == int(1.25 * S), got  # whole: the same process
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    bound = _batch_and_first_page(led)
    led.add_server_tokens(int(1.5 * S), 400.0, int(1.0 * S), partial=partial, down_ns=down_ns, down_refused=refused)
    print("span end from arrival s", (list(led.recon.batch_run_ons.values())[0][1] - 0.5 * S) / 1e9)
    assert list(led.recon.batch_run_ons.values()) == [(int(0.5 * S), bound)], led.recon.batch_run_ons
    assert refused and led._died_unrestarted, (got, led._gone_at)


def test_a_batch_400_sent_to_the_new_process_keeps_its_span_merged_with_one_a_restart_cut():
    # The review's F3 (repro_a 1): batch A at 0.5 s (its span to about 32 s) and batch B at 10.5 s, sent to the new
    # process inside the restart's window (the old process's last page at 1 s, refused from 5 s, the new one's first
    # page at 12 s). Alone, B's span runs to about 42 s and survives the cut; merged with A's, the cut trimmed the one
    # span to 12.0 s: B's rows 12-42 s unflagged. The cut is re-applied at each later broken connection, so a merge
    # formed after the restart (C at 13 s) was cut too. Now each batch a span holds is cut apart (`cut_batches`).
    ends = {}
    for merged in (False, True):
        led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
        led.recon.server_seen = True
        led._paces.append(40.0)
        led.add_server_tokens(int(1.0 * S), 0.0, None)
        kw = dict(sequences=2, max_tokens_null=True, error_message=BAND_MSG_128K, prompt_chars=600, prompt_count=2)
        if merged:
            _band_generate(led, 1, 0.5, 0.6, **kw)
        _band_generate(led, 2, 10.5, 10.6, **kw)
        (_, b_end), = led.recon.batch_run_ons.values()
        assert b_end > int(40 * S), led.recon.batch_run_ons
        led.add_server_tokens(int(12.0 * S), 0.0, int(1.0 * S), partial=("server_restart",), down_ns=int(5.0 * S),
                              down_refused=True)
        ends[merged] = list(led.recon.batch_run_ons.values())
        if merged:
            _band_generate(led, 3, 13.0, 13.1, **kw)
            _connect_refused(led, 4, 14.0)
            ends["later"] = list(led.recon.batch_run_ons.values())
    print({k: [(a / 1e9, b / 1e9) for a, b in v] for k, v in ends.items()})
    assert ends[False] == [(int(10.5 * S), b_end)], ends
    assert ends[True] == [(int(0.5 * S), b_end)], ends  # before: (0.5 s, 12.0 s)
    assert ends["later"] == [(int(0.5 * S), int(13.0 * S) + b_end - int(10.5 * S))], ends


def test_overlapping_batch_400s_scraped_merge_into_one_span():
    # Scraped, each band-abort 400 added its own entry unless one span held it whole, and the windows' check over them is
    # linear in the entries: the review's repro_d2 (20,000 null 400s, a span each overlapping the last) took 3.6, 10.4,
    # 22 and 29.6 s of ledger CPU a block of 5,000. Overlapping spans are merged into one now, as under none.
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    led.recon.server_seen = True
    led._paces.append(40.0)
    for k in range(50):
        _band_generate(led, 1 + k, 0.5 + 0.1 * k, 0.55 + 0.1 * k, sequences=2, max_tokens_null=True,
                       error_message=BAND_MSG_128K, prompt_chars=600,
                       prompt_count=2)
    (a0, a1), = led.recon.batch_run_ons.values()
    assert a0 == int(0.5 * S) and a1 > int(5.4 * S + 30 * S), led.recon.batch_run_ons


def _lock_scene(lock_s=None, release_s=None, until_s=40.0, limit_w=None, changes=None, arrivals=None, dur_s=0.5,
                n_tok=10):
    """A simulated H200 read through NVML every 0.5 s as the daemon does, a 0.5 s request every 2 s (at k·2 + 0.3 s,
    decoding 10 tokens; or at `arrivals` s, `dur_s` long, `n_tok` tokens), another tool's `nvidia-smi -lgc 1400,1400` at `lock_s` and `-rgc` at
    `release_s` (None: none; or `changes`, (s, (min, max) MHz or None) each). Returns (ledger, sink, {request id: its
    true GPU energy while live}, its arrival s by id)."""
    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.sim.gpu import IDLE, Phase
    from powerprof.sim.nvml import SimNVML

    now = [0]
    sim = SimNVML("h200-141g", clock_ns=lambda: now[0], state_path=False, record_history=True)
    gpu = sim.gpus[0]
    if limit_w is not None:
        gpu.set_limit_w(limit_w)
    col = NvmlCollector(sim, clock_ns=lambda: now[0])
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    changes = sorted(changes if changes is not None else
                     [(t, lock) for t, lock in ((lock_s, (1400, 1400)), (release_s, None)) if t is not None],
                     key=lambda c: c[0])
    next_sample = [0.0]

    def to(t_s):  # every sample and clock change up to t_s, in time order
        while True:
            nxt = min([next_sample[0]] + [c for c, _ in changes[:1]])
            if nxt > t_s:
                break
            now[0] = int(round(nxt * S))
            if changes and changes[0][0] == nxt:
                sim.external_clock_change(0, changes.pop(0)[1])
            else:
                led.add_gpu_sample(now[0], now[0], col.read())
                led.advance(now[0])
                next_sample[0] += 0.5
        now[0] = int(round(t_s * S))

    truth, arrival = {}, {}
    for k, a in enumerate(arrivals if arrivals is not None else [2 * k + 0.3 for k in range(int(until_s / 2))]):
        to(a)
        tr = _trace(k, a)
        led.on_start(tr)
        gpu.set_phase(Phase("decode", 0.12))
        for j in range(n_tok):
            t = a + 0.05 + (dur_s - 0.05) / n_tok * j
            to(t)
            led.on_tokens(tr, int(round(t * S)), 1)
            tr.first_ns = tr.first_ns or int(round(t * S))
            tr.last_ns = int(round(t * S))
        to(a + dur_s)
        gpu.set_phase(IDLE)
        tr.end_ns = now[0]
        tr.counts = Counts(generated_tokens=n_tok, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
        truth[k] = gpu.true_energy_at_j(tr.end_ns) - gpu.true_energy_at_j(tr.arrival_ns)
        arrival[k] = a
    to(until_s)
    led.close_all(int((until_s + 1) * S))
    return led, sink, truth, arrival


@pytest.mark.parametrize("limit_w", [None, 250.0, 300.0])
def test_rows_after_a_clock_lock_are_split_with_the_idle_power_measured_under_it_or_flagged(limit_w):
    # Another tool locks the H200's SM clock at 1400 MHz at 15 s: its idle draw 78 -> 99.7 W (sim/gpu.py `_idle_held`).
    # Each request's busy intervals hold 0.5 s no request was live in. Before, the lock started no setting: the 78 W
    # measured before it split the intervals after it, 6 rows +9.3% and one +4.7% unflagged (then 2 rows -7.6% and
    # one -3.8% after the release). Now the lock, seen at the second busy reading under it (AppClocks, the clock held:
    # collectors/limitwatch.ClockLockSigns), starts a setting whose idle power is measured anew: until a run closes
    # there the rows are flagged, then within 1%. The release at 35 s is another change back (its idle power the one
    # measured before the lock). Between a change and its second busy reading, one row each way as before (known limit).
    # Under a 250 W limit the locked decode draws 233 W (93% of the cap, AppClocks only): before, never seen, 6 rows
    # +9.3% and one +4.6%, then 2 -8.7% and one -4.4%, unflagged. Under 300 W the unlocked decode draws 284 W (95%):
    # before, the release was never seen (7 rows -7.6%, one -3.8%).
    led, sink, truth, arrival = _lock_scene(lock_s=15.0, release_s=35.0, until_s=50.0, limit_w=limit_w)
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    seen_s = 19.0  # the lock's second busy reading (16.5 s, 18.5 s)
    for k, a in arrival.items():
        if not (seen_s < a < 35.0 or a > 39.0):  # the release seen at 37.5 s
            continue
        r = rows[k]
        err = r["gpu_energy_j"] / truth[k] - 1
        assert UNSURE_FLAG in (r["energy_note"] or "") or abs(err) < 0.01, (k, a, err, r["energy_note"])
    flagged = [k for k, a in arrival.items() if a > seen_s and UNSURE_FLAG in (rows[k]["energy_note"] or "")]
    assert len(flagged) <= 1, flagged  # one row, before the first idle run under the lock closed
    # The costs rows tell the locked fit from the unlocked one at the same limits (before: both "700", idle 78 / 99.7 W).
    fits = {(r["power_limits_w"], r["sm_clock_locks_mhz"]): r["idle_w"] for r in sink.rows["costs"]}
    limits = f"{limit_w or 700:g}"
    assert fits == {(limits, ""): pytest.approx(78.0, abs=0.5), (limits, "1395"): pytest.approx(99.7, abs=0.5)}, fits


LOCK = (1400, 1400)


@pytest.mark.parametrize("arrivals, changes, until_s, seen", [
    # locked at 22 s in a 38 s idle, seen at 62.5 s; released at 81 s, seen at 84.5 s
    ([2 * k + 0.3 for k in range(10)] + [60 + 2 * k + 0.3 for k in range(20)], [(22.0, LOCK), (81.0, None)], 100.0,
     [(22.0, 63.0), (81.0, 85.0)]),
    # the daemon started on an idle card already locked: seen at 42.5 s; released at 70 s, seen at 72.5 s
    ([40 + 2 * k + 0.3 for k in range(30)], [(0.0, LOCK), (70.0, None)], 100.0, [(0.0, 43.0), (70.0, 73.0)]),
    # released at 41 s in a 40 s idle, seen at 82.5 s; the same lock again at 100 s, seen at 102.5 s
    ([2 * k + 0.3 for k in range(20)] + [80 + 2 * k + 0.3 for k in range(30)], [(10.0, LOCK), (41.0, None),
                                                                               (100.0, LOCK)], 140.0,
     [(10.0, 13.0), (41.0, 83.0), (100.0, 103.0)])])
def test_idle_runs_before_a_lock_change_is_seen_teach_no_setting(arrivals, changes, until_s, seen):
    # An idle card shows no lock, so a lock set or released while it idles (or already there when the daemon starts)
    # is seen only at the next busy readings. Before, every idle run between went to the other setting's idle median:
    # 118 runs at 99.7 W in the unlocked one (78 W true), every row after the release -7.6% (9 of 9; 15 of 15 after a
    # start on a locked card), or the locked one at 78 W, 20 of 20 rows +9.3% after the relock, all unflagged. Now an
    # idle run teaches only once a busy reading tells the locks held, and is dropped where one tells a change: each
    # row from a change's second busy reading on is within 1% or flagged (between a change and it: the known limit).
    led, sink, truth, arrival = _lock_scene(until_s=until_s, changes=changes, arrivals=arrivals)
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    for k, a in arrival.items():
        if any(c <= a < s for c, s in seen):
            continue
        r = rows[k]
        err = r["gpu_energy_j"] / truth[k] - 1
        assert UNSURE_FLAG in (r["energy_note"] or "") or abs(err) < 0.01, (k, a, err, r["energy_note"])
    assert len(led.learner._held) <= led.learner.window


def test_idle_runs_no_busy_reading_tells_the_locks_of_are_filed_from_the_start():
    # 0.1 s requests every 2 s fall between the 0.5 s samples: no reading is ever busy, so none tells the SM clock
    # locks (collectors/limitwatch.ClockLockSigns). Before, every idle run was held for that telling for good: idle
    # power never learned, 40 of 40 rows flagged over 80 s (+110%, the whole idle split in); then, held at most
    # workmodel.LOCK_WAIT_S (60 s): 30 of 40 flagged, and at every daemon start with short requests (a vLLM one-token
    # answer +73%, tests/test_daemon_chat_shapes.py). Before any reading told the locks, a run is filed at once as the
    # locks the first telling will say (taken back out where it says a change): every row exact, none flagged.
    led, sink, truth, arrival = _lock_scene(until_s=80.0, dur_s=0.1, n_tok=2)
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    assert len(rows) == 40
    for k in rows:
        if k == min(rows):
            continue  # the first: before any idle run closed (the start-up limit, flagged)
        assert rows[k]["gpu_energy_j"] == pytest.approx(truth[k], rel=0.01), (k, rows[k]["energy_note"])
        assert "held till a busy reading tells" not in (rows[k]["energy_note"] or ""), rows[k]["energy_note"]
    assert led.learner._idle_runs > 0 and led.learner.held_since_ns is None


def test_a_lone_busy_reading_under_a_lock_on_an_unused_gpu_holds_no_idle_run_for_ever():
    # Two simulated H200s, the server on GPU 0 (locked at 1400 MHz at 40 s, released at 70 s). GPU 1 reads busy once
    # under another tenant's lock, then idles unlocked for good: its run of lock readings never closes. Before, that
    # open run kept every idle run held to the end: 37 of 50 rows flagged (+27.4%), 0 runs filed. Now an open run of a
    # GPU the idle power is not of holds nothing (and one expires after workmodel.LOCK_WAIT_S): as with no such
    # reading, 4 rows flagged and 2 unflagged off by more than 1% (the known limit: a change before its 2nd reading).
    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.sim.gpu import IDLE, Phase
    from powerprof.sim.nvml import SimNVML

    now = [0]
    sim = SimNVML("h200-141g", count=2, clock_ns=lambda: now[0], state_path=False, record_history=True)
    col = NvmlCollector(sim, clock_ns=lambda: now[0])
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    g0, g1 = sim.gpus
    sim.external_clock_change(1, (1400, 1400))
    g1.set_phase(Phase("decode", 0.12))
    events = [(0.3, lambda: (g1.set_phase(IDLE), sim.external_clock_change(1, None))),
              (40.1, lambda: sim.external_clock_change(0, (1400, 1400))), (70.1, lambda: sim.external_clock_change(0, None))]
    next_sample = [0.0]

    def to(t_s):
        while True:
            nxt = min([next_sample[0]] + [e[0] for e in events[:1]])
            if nxt > t_s:
                break
            now[0] = int(round(nxt * S))
            if events and events[0][0] == nxt:
                events.pop(0)[1]()
            else:
                led.add_gpu_sample(now[0], now[0], col.read())
                led.advance(now[0])
                next_sample[0] += 0.5
        now[0] = int(round(t_s * S))

    truth = {}
    for k in range(50):
        a = 5 + 2 * k + 0.3
        to(a)
        tr = _trace(k, a)
        led.on_start(tr)
        g0.set_phase(Phase("decode", 0.12))
        for j in range(10):
            t = a + 0.05 + 0.045 * j
            to(t)
            led.on_tokens(tr, int(round(t * S)), 1)
            tr.first_ns = tr.first_ns or int(round(t * S))
            tr.last_ns = int(round(t * S))
        to(a + 0.5)
        g0.set_phase(IDLE)
        tr.end_ns = now[0]
        tr.counts = Counts(generated_tokens=10, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
        truth[k] = g0.true_energy_at_j(tr.end_ns) - g0.true_energy_at_j(tr.arrival_ns)
    to(110.0)
    led.close_all(int(111 * S))
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    flagged = [k for k in truth if UNSURE_FLAG in (rows[k]["energy_note"] or "")]
    off = [k for k in truth if k not in flagged and abs(rows[k]["gpu_energy_j"] / truth[k] - 1) > 0.01]
    assert len(flagged) <= 4 and len(off) <= 2, (flagged, off)
    assert led.learner._idle_runs > 0


def test_costs_rows_write_no_clock_locks_where_no_reading_could_show_one(monkeypatch):
    # Readings with no SM clock or clock event reasons (ClockLockSigns told "blind"): a lock cannot be seen at all.
    # Before, sm_clock_locks_mhz read "" (none seen) there, as where none was; now null (docs/data.md).
    import dataclasses

    from powerprof.collectors.nvml import NvmlCollector

    read = NvmlCollector.read
    monkeypatch.setattr(NvmlCollector, "read", lambda self: [
        dataclasses.replace(r, sm_clock_mhz=None, clock_event_reasons=None) for r in read(self)])
    led, sink, truth, arrival = _lock_scene(until_s=30.0)
    assert sink.rows["costs"] and {r["sm_clock_locks_mhz"] for r in sink.rows["costs"]} == {None}


@pytest.mark.parametrize("limit_w", [None, 200.0, 250.0, 300.0])
def test_a_busy_gpu_with_no_clock_lock_starts_no_new_setting(limit_w):
    # The same scene with no lock: busy at its top clock (1980 MHz, no clock event reason) or held below it by a 200 W
    # cap (SwPowerCap, a limiter: never a lock's sign). One setting throughout, its idle power the 78 W measured, every
    # row after the first within 1% (measured: 25 rows, 1 setting, both).
    from powerprof.daemon.workmodel import LockedSetting

    led, sink, truth, arrival = _lock_scene(until_s=50.0, limit_w=limit_w)
    assert len(led.learner._n) == 1 and not any(isinstance(s, LockedSetting) for s in led.learner._n), led.learner._n
    rows = {r["request_id"]: r for r in sink.rows["requests"]}
    for k in list(arrival)[1:]:
        assert rows[k]["gpu_energy_j"] == pytest.approx(truth[k], rel=0.01), (k, rows[k]["energy_note"])


def test_a_row_split_by_the_fit_says_how_far_the_context_cost_band_moves_it():
    # The fit trades its decode and context costs (beside CPU hogs, long-context turns -7.4% to +15.4% in sum run to
    # run, unsaid): a row whose figure moves by 15% or more over the context cost's band says how far; one that leans
    # on it less says nothing (at 5%, half a scene's rows said it, no more off than the others: the rows' own spread).
    from powerprof.daemon.liverequest import LiveRequest
    from powerprof.daemon.rowtext import _approximate_note

    r = LiveRequest(_trace(1, 0.0), gpu_j=100.0, ctx_up_j=22.4, ctx_down_j=-7.6)
    note = _approximate_note(r) or ""
    assert "its share of the intervals it shared rests on the work model's context cost" in note, note
    assert "±2 standard errors" in note and "its figure moves by -8% to +22%" in note, note
    # A short one beside long ones: the band's ends move it the other way.
    r = LiveRequest(_trace(2, 0.0), gpu_j=100.0, ctx_up_j=-16.0, ctx_down_j=3.0)
    assert "its figure moves by -16% to +3%" in (_approximate_note(r) or "")
    assert "context cost" not in (_approximate_note(LiveRequest(_trace(3, 0.0), gpu_j=100.0, ctx_up_j=14.9,
                                                                ctx_down_j=-3.0)) or "")
