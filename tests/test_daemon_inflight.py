"""The daemon's requests in flight and awaiting a first token: gauges and time integrals the tuner reads as its early signal."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import DaemonProc, open_long_stream, sim_env
from powerprof.daemon.config import load_config
from powerprof.daemon.inflight import InFlight
from powerprof.daemon.metrics import Snapshot, TagLimiter, make_registry, render
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.service import Daemon
from powerprof.daemon.streams import api_for_path

S = 1_000_000_000


def test_the_integrals_are_the_exact_areas_under_the_counts():
    q = InFlight(0)
    q.start("a", 1 * S)  # a: in flight 1–9 s, first token at 3 s
    q.start("b", 2 * S)  # b: in flight 2–5 s, never a token (ended while queued)
    q.first("a", 3 * S)
    q.end("b", 5 * S)
    mid = q.state(6 * S)
    assert (mid.in_flight, mid.awaiting_first) == (1, 0)
    assert mid.in_flight_s == pytest.approx(5 + 3)  # a 1→6, b 2→5
    assert mid.awaiting_first_s == pytest.approx(2 + 3)  # a 1→3, b 2→5
    q.end("a", 9 * S)
    end = q.state(10 * S)
    assert (end.in_flight, end.awaiting_first, end.clock_s) == (0, 0, 10.0)
    assert end.in_flight_s == pytest.approx(8 + 3) and end.awaiting_first_s == pytest.approx(5)
    # Unknown ids and repeats change nothing.
    q.end("zz", 11 * S)
    q.first("a", 11 * S)
    assert q.state(12 * S).in_flight_s == pytest.approx(11)


def test_an_event_stamped_before_the_last_reading_never_takes_the_counters_back():
    # A proxy worker's records arrive milliseconds after their stamps: the integral counts from the reading on.
    q = InFlight(0)
    q.start("a", 1 * S)
    before = q.state(4 * S)
    q.end("a", 2 * S)  # stamped before the reading at 4 s
    after = q.state(5 * S)
    assert after.in_flight_s >= before.in_flight_s == pytest.approx(3)
    assert after.in_flight_s == pytest.approx(3) and after.in_flight == 0


def _trace(rid, t_ns, endpoint="/completion"):
    return RequestTrace(request_id=rid, method="POST", endpoint=endpoint, tag=None, arrival_ns=t_ns,
                        arrival_wall_ns=t_ns, api=api_for_path(endpoint))


class _Ledger:
    def __init__(self, fail_on_tokens=False):
        self.fail_on_tokens = fail_on_tokens

    def on_start(self, trace):
        pass

    def on_tokens(self, trace, t_ns, n):
        if self.fail_on_tokens:
            raise RuntimeError("broken recording")

    def on_end(self, trace):
        pass

    def tokens_at_first(self, request_id, generated):
        return 1.0


def _families(d: Daemon, now_ns: int) -> dict:
    d.snapshot = Snapshot(inflight=d.inflight.state(now_ns))
    text = render(make_registry(d)).decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("powerprof_requests_") and ("in_flight" in s.name or "awaiting" in s.name
                                                              or "queue_clock" in s.name)}


def test_the_daemon_recorder_counts_requests_and_exposes_them_on_metrics():
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(0)
    d.ledger, d.tags = _Ledger(), TagLimiter()
    a, b = _trace(1, 1 * S), _trace(2, 2 * S)
    d.on_start(a)
    d.on_start(b)
    a.first_ns = 3 * S
    d.on_tokens(a, 3 * S, 1)
    m = _families(d, 4 * S)
    assert m["powerprof_requests_in_flight"] == 2 and m["powerprof_requests_awaiting_first_token"] == 1
    assert m["powerprof_requests_in_flight_seconds_total"] == pytest.approx(3 + 2)
    assert m["powerprof_requests_awaiting_first_token_seconds_total"] == pytest.approx(2 + 2)
    assert m["powerprof_requests_queue_clock_seconds_total"] == pytest.approx(4)
    a.end_ns = 5 * S
    d.on_end(a)
    m = _families(d, 6 * S)
    assert m["powerprof_requests_in_flight"] == 1 and m["powerprof_requests_awaiting_first_token"] == 1


def test_requests_that_generate_nothing_are_not_counted_in_the_queue():
    # A health check or a model list held open (or polled) never gets a first token: counted, it would
    # read as a request stuck in the server's queue.
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(0)
    d.ledger, d.tags = _Ledger(), TagLimiter()
    gen, health, models = _trace(1, 1 * S), _trace(2, 1 * S, "/health"), _trace(3, 1 * S, "/v1/models")
    for t in (gen, health, models):
        d.on_start(t)
    m = _families(d, 3 * S)
    assert m["powerprof_requests_in_flight"] == 1 and m["powerprof_requests_awaiting_first_token"] == 1
    assert m["powerprof_requests_in_flight_seconds_total"] == pytest.approx(2)
    for t in (health, models, gen):
        t.end_ns = 4 * S
        d.on_end(t)
    assert d.inflight.state(5 * S).in_flight == 0


def test_a_request_whose_recording_failed_leaves_the_count():
    # The proxy calls a failed recording no more (Proxy._safe): no end would ever come to take it out.
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(0)
    d.ledger, d.tags = _Ledger(fail_on_tokens=True), TagLimiter()
    a = _trace(1, 1 * S)
    d.on_start(a)
    with pytest.raises(RuntimeError):
        d.on_tokens(a, 2 * S, 1)
    assert d.inflight.state(3 * S).in_flight == 0


def test_the_ages_of_unfinished_streamed_requests_are_exposed_and_non_streamed_answers_are_left_out():
    """Requests that never finish never reach the latency histograms: the oldest streamed request still awaiting its
    first token and the longest silence of a stream past its first are what show a stalled server to the tuner. A
    non-streamed answer's first token is its whole answer: its wait says nothing of a stall."""
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(0)
    d.ledger, d.tags = _Ledger(), TagLimiter()
    waiting, flowing, plain = _trace(1, 1 * S), _trace(2, 2 * S), _trace(3, 0)
    waiting.stream = flowing.stream = True
    plain.stream = False
    for t in (waiting, flowing, plain):
        d.on_start(t)
    for t_ns in (3 * S, 4 * S):  # the proxy stamps the trace, then records
        flowing.first_ns = flowing.first_ns or t_ns
        flowing.last_ns = t_ns
        d.on_tokens(flowing, t_ns, 1)
    d.snapshot = Snapshot(inflight=d.inflight.state(10 * S))
    m = {s.name: s.value for f in text_string_to_metric_families(render(make_registry(d)).decode()) for s in f.samples}
    assert m["powerprof_requests_oldest_awaiting_first_token_seconds"] == pytest.approx(9)  # not the plain one's 10
    assert m["powerprof_requests_longest_stream_silence_seconds"] == pytest.approx(6)
    for t in (waiting, flowing):
        t.end_ns = 11 * S
        d.on_end(t)
    end = d.inflight.state(12 * S)
    assert (end.oldest_awaiting_s, end.longest_silence_s) == (0.0, 0.0)


def _scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.slow
def test_the_live_daemon_reports_a_stream_in_flight_and_its_exact_mean(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", env=sim_env(tmp_path))
    try:
        url = d.info["metrics"] + "/metrics"
        idle = _scrape(url)
        assert idle["powerprof_requests_in_flight"] == 0
        stream = open_long_stream(d.info["proxy"])  # flowing: its first token is already out
        try:
            deadline = time.monotonic() + 10
            while (a := _scrape(url))["powerprof_requests_in_flight"] != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert a["powerprof_requests_in_flight"] == 1 and a["powerprof_requests_awaiting_first_token"] == 0
            time.sleep(1.5)
            b = _scrape(url)
        finally:
            stream.close()
        clock = b["powerprof_requests_queue_clock_seconds_total"] - a["powerprof_requests_queue_clock_seconds_total"]
        assert clock > 1.0
        # One request in flight the whole time, none awaiting: the scrape-to-scrape mean is exactly 1 and 0.
        mean = (b["powerprof_requests_in_flight_seconds_total"] - a["powerprof_requests_in_flight_seconds_total"]) / clock
        assert mean == pytest.approx(1.0, abs=1e-6)
        assert b["powerprof_requests_awaiting_first_token_seconds_total"] == \
            a["powerprof_requests_awaiting_first_token_seconds_total"]
        deadline = time.monotonic() + 10
        while (c := _scrape(url))["powerprof_requests_in_flight"] != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c["powerprof_requests_in_flight"] == 0
    finally:
        d.stop()


def test_a_request_whose_parser_broke_still_leaves_the_count(monkeypatch):
    # The proxy's own recording failure (a stream parser that raised) gets no on_end either (Proxy._safe), but
    # the request ends: the gauge must not keep it in flight for ever (nor the tuner see a queue that is not there).
    import asyncio

    import aiohttp

    from powerprof.daemon import streams
    from powerprof.daemon.proxy import Proxy
    from proxy_helpers import serve_here as _serve
    from test_daemon_proxy import Upstream, _run

    class Broken:
        prompt_tokens = None

        def count(self, piece):
            raise ValueError("parser bug")

    monkeypatch.setattr(streams, "new_parser", lambda api: Broken())
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(time.monotonic_ns())
    d.ledger, d.tags = _Ledger(), TagLimiter()

    async def main():
        r1, up_url = await _serve(Upstream().app())
        proxy = Proxy(up_url, recorder=d)
        r2, px_url = await _serve(proxy.app())
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(px_url + "/completion", json={"n_predict": 5, "stream": True}) as r:
                    assert r.status == 200 and b"tokens_predicted" in await r.read()
        await asyncio.sleep(0)
        await r2.cleanup()
        await r1.cleanup()
        return proxy

    proxy = _run(main())
    assert proxy.recorder_failures == 3 and proxy.active == 0
    q = d.inflight.state(time.monotonic_ns())
    assert (q.in_flight, q.awaiting_first) == (0, 0)


def test_a_trace_that_ended_without_an_end_call_leaves_at_the_next_reading():
    q = InFlight(0)
    a, b = _trace(1, 1 * S), _trace(2, 2 * S)
    q.start(1, a.arrival_ns, a)
    q.start(2, b.arrival_ns, b)
    a.end_ns = 3 * S  # its recording broke: the proxy ended it but called no one
    s = q.state(5 * S)
    assert (s.in_flight, s.awaiting_first) == (1, 1)
    assert s.in_flight_s == pytest.approx(2 + 3)  # a 1→3 exactly, b 2→5
    assert q.state(6 * S).in_flight_s == pytest.approx(2 + 4)
    q.end(1, 7 * S)  # a late end call changes nothing
    assert q.state(8 * S).in_flight == 1


def test_a_worker_request_whose_recording_broke_leaves_the_count():
    # A proxy worker ships the end of a request whose recording broke (its row needs it); the daemon's replay
    # then skips its recorder's on_end, as in-process: the count must still let it go.
    from powerprof.daemon.workers import _STATS, ProxyWorkers, _end_record, _start_record

    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight = InFlight(0)
    d.ledger, d.tags = _Ledger(), TagLimiter()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=d, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    w = workers.workers[0]
    tr = _trace(7, 1 * S)
    workers._replay(w, ([_start_record(tr)], [], [], [], (0,) * len(_STATS), [], 1 * S, []))
    assert d.inflight.state(2 * S).in_flight == 1
    tr.end_ns, tr.end_wall_ns, tr.status, tr.recorder_error = 3 * S, 3 * S, 200, "parser: ValueError: parser bug"
    workers._replay(w, ([], [], [], [_end_record(tr)], (1,) + (0,) * (len(_STATS) - 1), [], 3 * S, []))
    q = d.inflight.state(4 * S)
    assert (q.in_flight, q.awaiting_first) == (0, 0) and q.in_flight_s == pytest.approx(2)
