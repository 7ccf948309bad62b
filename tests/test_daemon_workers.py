"""proxy.workers > 1: proxy processes on SO_REUSEPORT whose records the daemon replays into its one ledger."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import psutil
import pytest

from daemon_helpers import DaemonProc, energy_books_j, open_long_stream, read_dataset, sim_env
from powerprof.daemon import streams
from powerprof.daemon.config import ConfigError, load_config
from powerprof.daemon.proxy import Proxy
from powerprof.daemon.workers import _STATS, FLUSH_S, ProxyWorkers, ShippingRecorder, Unframer, WorkerProxy, frame
from proxy_helpers import serve_here as _serve
from test_daemon_proxy import Rec, Upstream, _run

ZERO = (0,) * len(_STATS)  # a worker's counters (ShippingRecorder._stats), none yet

TRACE_FIELDS = ("method", "endpoint", "tag", "arrival_ns", "arrival_wall_ns", "api", "model", "stream", "status",
                "first_ns", "first_wall_ns", "last_ns", "last_wall_ns", "end_ns", "end_wall_ns", "tokens_seen",
                "counts", "outcome", "error", "response_bytes", "recorder_error", "extra")


def test_frames_survive_being_cut_anywhere():
    msgs = [("hello", 42), ([(1, "POST", "/completion", None, 5, 6, "llamacpp", "m", True)], [], [(1, 7, 3, -1)], [],
                            ZERO, [], 8), ("beat", 9, [1], ZERO)]
    data = b"".join(frame(m) for m in msgs)
    for cut in range(len(data) + 1):
        u = Unframer()
        assert u.feed(data[:cut]) + u.feed(data[cut:]) == msgs


def test_the_monotonic_clock_is_one_clock_across_processes():
    # The workers stamp tokens with time.monotonic_ns() and the daemon places them against its own
    # samples' stamps: on one host CLOCK_MONOTONIC is shared, so a child's reading lies between two of ours.
    t0 = time.monotonic_ns()
    out = subprocess.run([sys.executable, "-c", "import time; print(time.monotonic_ns())"], capture_output=True,
                         text=True, check=True, timeout=60)
    t1 = time.monotonic_ns()
    assert t0 <= int(out.stdout) <= t1


def test_workers_must_be_at_least_one(tmp_path):
    with pytest.raises(ConfigError, match="proxy.workers"):
        load_config(None, env={"POWERPROF_PROXY_WORKERS": "0"})
    assert load_config(None, env={}).get("proxy", "workers") == 1  # the default: the proxy in the daemon


class _Wire:
    """A worker's socket to the daemon, in one process: frames go through the wire format into the replay."""

    def __init__(self, deliver):
        self.unframer, self.deliver, self.bytes = Unframer(), deliver, 0

    def is_closing(self):
        return False

    def get_write_buffer_size(self):
        return 0

    def write(self, data):
        self.bytes += len(data)
        for m in self.unframer.feed(data):
            self.deliver(m)


class _Tee:
    """Both recorders see the same calls; a request tagged `broken` breaks the recording at its first token."""

    def __init__(self, *recs):
        self.recs = recs

    def on_start(self, trace):
        for r in self.recs:
            r.on_start(trace)

    def on_tokens(self, trace, t, n):
        for r in self.recs:
            r.on_tokens(trace, t, n)
        if trace.tag == "broken":
            raise RuntimeError("recording broke")

    def on_end(self, trace):
        for r in self.recs:
            r.on_end(trace)


@pytest.mark.parametrize("urgent_max_active", [0, 4])
def test_replayed_records_equal_what_the_proxy_recorded_with_tokens_coalesced(urgent_max_active):
    # The same proxy run feeds a recorder directly and, through the shipping recorder and the wire
    # format, the daemon's replay: every request's trace must come out the same, and its token events
    # the same tokens at the same or slightly later times (coalesced per request within FLUSH_S).
    class Replayed(Rec):
        def __init__(self):
            super().__init__()
            self.started = []
            self.start_extra = {}

        def on_start(self, trace):
            self.started.append(trace)
            self.start_extra[trace.tag] = dict(trace.extra)  # what was known at its start

    direct, replayed = Rec(), Replayed()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=replayed, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    shipper = ShippingRecorder(urgent_max_active)
    wire = _Wire(lambda m: workers._replay(workers.workers[0], m))
    shipper.transport = wire

    async def main():
        up = Upstream()
        r1, up_url = await _serve(up.app())
        proxy = WorkerProxy(up_url, recorder=_Tee(direct, shipper))
        shipper.proxy, shipper.active = proxy, lambda: proxy.active
        r2, px_url = await _serve(proxy.app())
        async with aiohttp.ClientSession() as s:
            async def stream(i):
                body = {"n_predict": 40 + 7 * i, "stream": True, "seed": i, "delay": 0.002}
                if i == 1:
                    body["prompt"] = ["a", "b"]  # two prompts: two sequences, known to the ledger from the start
                async with s.post(px_url + "/completion", json=body, headers={"X-Powerprof-Tag": f"s{i}"}) as r:
                    return await r.read()

            async def cut():
                r = await s.post(px_url + "/completion", json={"n_predict": 500, "stream": True, "delay": 0.005},
                                 headers={"X-Powerprof-Tag": "cut"})
                await r.content.read(300)
                r.close()

            async def plain():
                async with s.post(px_url + "/completion", json={"n_predict": 9}, headers={"X-Powerprof-Tag": "plain"}) as r:
                    return await r.read()

            async def failing():
                async with s.post(px_url + "/v1/chat/completions", json={"messages": []},
                                  headers={"X-Powerprof-Tag": "503"}) as r:
                    return r.status

            async def broken():
                body = {"n_predict": 30, "stream": True, "seed": 9}
                async with s.post(px_url + "/completion", json=body, headers={"X-Powerprof-Tag": "broken"}) as r:
                    return await r.read()

            await asyncio.gather(*(stream(i) for i in range(6)), cut(), plain(), failing(), broken())
        for _ in range(200):
            if len(direct.ended) == 10:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(3 * FLUSH_S)
        await r2.cleanup()
        await r1.cleanup()

    _run(main())
    assert len(direct.ended) == 10 and len(replayed.started) == 10
    by_tag = {t.tag: t for t in replayed.started}
    assert len({t.request_id for t in replayed.started}) == 10
    # As in-process: a request whose recording broke is not ended through the recorder, but its trace is
    # (the ledger emits it from there), and nothing stays open in the daemon.
    assert {t.tag for t in replayed.ended} == set(by_tag) - {"broken"}
    assert by_tag["broken"].recorder_error and by_tag["broken"].end_ns is not None
    n_events = n_replayed = 0
    for d in direct.ended:
        r = by_tag[d.tag]
        for f in TRACE_FIELDS:
            assert getattr(r, f) == getattr(d, f), (d.tag, f)
        ev_d = [(t, n) for rid, t, n in direct.events if rid == d.request_id]
        ev_r = [(t, n) for rid, t, n in replayed.events if rid == r.request_id]
        n_events, n_replayed = n_events + len(ev_d), n_replayed + len(ev_r)
        assert sum(n for _, n in ev_r) == sum(n for _, n in ev_d) == (0 if d.extra.get("spread") else d.tokens_seen)
        if not ev_d:
            continue
        assert ev_r[0] == ev_d[0] and ev_r[-1][0] == ev_d[-1][0]  # the first exactly; the last at its time
        times_d = [t for t, _ in ev_d]
        assert all(t in times_d for t, _ in ev_r)
        # Coalesced: each replayed event stands for tokens no earlier than the previous one's time.
        covered = 0
        for t, n in ev_r:
            batch = [x for x in ev_d[covered:] if x[0] <= t]
            assert sum(x[1] for x in batch) == n
            covered += len(batch)
    assert by_tag["cut"].outcome == "client_disconnected" and by_tag["plain"].extra.get("spread")
    # The sequences a request runs come with its start (the ledger splits its intervals while it runs), not its end.
    assert [t.extra.get("sequences") for t in direct.ended if t.tag == "s1"] == [2]
    assert replayed.start_extra["s1"].get("sequences") == 2 and "sequences" not in replayed.start_extra["s0"]
    assert by_tag["503"].status == 503
    assert n_replayed < n_events  # coalescing happened: fewer records than the proxy's token events
    assert workers.active == 0


def test_a_settled_n_cmpl_reaches_the_daemons_copy_of_a_workers_request():
    # llama-server ran n_cmpl over n (proxy.settle_n_cmpl, at the answer's end): the daemon's copy of the request held
    # its start's sequences (n's), and an end record that left out a 1 kept them (before: n 2, n_cmpl 1 still 2).
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    replayed = Rec()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=replayed, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    shipper = ShippingRecorder(0)
    shipper.transport = _Wire(lambda m: workers._replay(workers.workers[0], m))

    async def main(up_url):
        proxy = WorkerProxy(up_url, recorder=shipper)
        shipper.proxy, shipper.active = proxy, lambda: proxy.active
        runner, px = await _serve(proxy.app())
        async with aiohttp.ClientSession() as s:
            for tag, extra in (("one", {"n": 2, "n_cmpl": 1}), ("two", {"n_cmpl": 2})):
                body = {"prompt": "the power of", "max_tokens": 5, "ignore_eos": True, **extra}
                async with s.post(px + "/v1/completions", json=body, headers={"X-Powerprof-Tag": tag}) as r:
                    await r.read()
        shipper.flush()
        await runner.cleanup()

    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, decode_tok_s=2000) as srv:
        _run(main(srv.url))
    by_tag = {t.tag: t for t in replayed.ended}
    assert by_tag["one"].extra.get("sequences", 1) == 1 and by_tag["one"].counts.generated_tokens == 5
    assert by_tag["two"].extra.get("sequences", 1) == 2 and by_tag["two"].counts.generated_tokens == 10


def test_a_daemon_that_stops_reading_costs_records_not_client_bytes():
    class Stuck(_Wire):
        def get_write_buffer_size(self):
            return 1 << 40

    shipper = ShippingRecorder(4)
    shipper.transport = Stuck(lambda m: None)

    async def main():
        up = Upstream()
        r1, up_url = await _serve(up.app())
        proxy = Proxy(up_url, recorder=shipper)
        shipper.proxy, shipper.active = proxy, lambda: proxy.active
        r2, px_url = await _serve(proxy.app())
        async with aiohttp.ClientSession() as s:
            body = {"n_predict": 30, "stream": True, "seed": 3}
            async with s.post(px_url + "/completion", json=body) as r:
                via = await r.read()
            async with s.post(up_url + "/completion", json=body) as r:
                assert via == await r.read()
        await asyncio.sleep(3 * FLUSH_S)
        await r2.cleanup()
        await r1.cleanup()

    _run(main())
    # Only coalesced token records are dropped (counted, their tokens marked on the request); the start, first
    # token and end wait for the daemon to read again.
    assert shipper.dropped >= 1
    assert len(shipper._starts) == len(shipper._firsts) == len(shipper._ends) == 1
    (rid, lost), = shipper._marks.items()
    assert lost + shipper._firsts[0][3] == shipper._ends[0][10]  # every token but the first (held)


# --- the daemon with worker processes ------------------------------------------------------------------


def _workers(pid: int) -> list[psutil.Process]:
    """The daemon's live worker processes: one just killed and not yet reaped (a zombie, whose command
    line cannot be read) or already gone is not one."""
    out = []
    for c in psutil.Process(pid).children():
        try:
            if "powerprof.daemon.workers" in " ".join(c.cmdline()):
                out.append(c)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return out


@pytest.mark.slow
def test_workers_pass_bytes_unchanged_and_the_one_ledger_books_every_request(tmp_path, monkeypatch):
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer
    from powerprof.workload.stream import StreamParser
    from test_daemon_e2e import ByteTap, _traffic, cut_while_sending

    tap = ByteTap(monkeypatch)
    with SimServer(nvml=SimNVML("seed-16g", state_path=None), n_slots=64) as srv:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", srv.url, "--flush-interval", "0.5",
                       "--interval", "0.25", env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
        try:
            procs = _workers(d.proc.pid)
            assert len(procs) == 2, d.output()
            wall0 = time.time_ns()
            results = asyncio.run(asyncio.wait_for(_traffic(d.info["proxy"], 64, tap=tap), 120))
            time.sleep(0.5)
            wall1 = time.time_ns()  # a cut stream ends at the proxy a moment after its client left
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs)  # SIGTERM stopped them
    # The kernel spread the 64 connections over both workers (each forwarded a share of the streams).
    served = re.search(r"requests each served: (\d+), (\d+)", d.output())
    assert served and min(int(x) for x in served.groups()) >= 8, d.output()
    assert sum(int(x) for x in served.groups()) == 64
    cut_count = 0
    expected = {}
    for i, status, _ctype, body, cut in results:
        sent = bytes(tap.sent[f"n{i}"])
        assert status == 200
        if cut is None:
            assert body == sent, f"request {i}: bytes through a worker differ from what the server sent"
        else:
            assert sent.startswith(body)
            cut_count += cut_while_sending(tap, i, body, cut)
    reqs = read_dataset(tmp_path / "data", "requests")
    assert len(reqs) == 64 and reqs["request_id"].is_unique, reqs[["request_id", "tag", "outcome"]]
    # Exact: a client cuts only while the server still sends (test_daemon_e2e._traffic says why a later close is `ok`).
    assert cut_count >= 5 and (reqs["outcome"] == "client_disconnected").sum() == cut_count
    assert set(reqs["tag"]) == {"team0", "team1", "team2"}
    # Token counts as the full parser reads the bytes the server sent, for every whole streamed response.
    from test_daemon_e2e import APIS

    for i, _status, _ctype, body, _cut in results:
        path, make = APIS[i % len(APIS)]
        if make(1).get("stream") and body == bytes(tap.sent[f"n{i}"]) and f"n{i}" in tap.ended:
            p = StreamParser(streams.api_for_path(path))
            p.feed(body)
            expected.setdefault(path, []).append(streams.summary_counts(p.finish()).generated_tokens)
    ok = reqs[(reqs["outcome"] == "ok") & reqs["stream"].astype(bool)]
    for path, counts in expected.items():
        assert sorted(ok[ok["endpoint"] == path]["generated_tokens"].astype(int)) == sorted(counts), path
    # Times: the workers' monotonic and wall stamps, in order and inside the traffic's span.
    import pandas as pd

    lo, hi = pd.Timestamp(wall0 // 1000 * 1000, unit="ns", tz="UTC"), pd.Timestamp(wall1, unit="ns", tz="UTC")
    assert (reqs["t_arrival_utc"] >= lo).all() and (reqs["t_end_utc"] <= hi).all()
    streamed = reqs[reqs["t_first_utc"].notna()]
    assert (streamed["t_first_utc"] >= streamed["t_arrival_utc"]).all()
    assert (streamed["t_last_utc"] >= streamed["t_first_utc"]).all() and (streamed["ttft_s"] > 0).all()
    # The one ledger placed every worker's tokens in the daemon's intervals, and the books balance.
    intervals = read_dataset(tmp_path / "data", "intervals")
    assert reqs["attributed_tokens"].sum() == pytest.approx(intervals["proxy_tokens"].sum())
    assert reqs["attributed_tokens"].sum() > 64 * 20
    parts, measured = energy_books_j(tmp_path / "data")
    assert parts == pytest.approx(measured, rel=0.01)
    assert (reqs["gpu_energy_j"] > 0).sum() >= 0.9 * len(reqs)


async def _long_streams(url: str, n: int, tokens: int) -> list:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i):
            try:
                # /v1/completions: the daemon's simulated server is vLLM's, which has no /completion.
                async with s.post(url + "/v1/completions", json={"prompt": "p" * 20, "max_tokens": tokens, "stream": True},
                                  headers={"X-Powerprof-Tag": f"k{i}"}) as r:
                    await r.read()
                    return "ok"
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return "cut"

        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.slow
def test_a_killed_worker_is_reported_its_requests_marked_and_it_is_restarted(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", "--flush-interval", "0.5",
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    try:
        before = _workers(d.proc.pid)
        assert len(before) == 2
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", asyncio.run(_long_streams(d.info["proxy"], 16, 300))))
        t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # every stream under way, its tokens seen by the daemon
            metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
            if len(re.findall(r'^powerprof_tokens_generated_total\{tag="k\d+"\} [1-9]', metrics, re.M)) == 16:
                break
            time.sleep(0.1)
        victim = before[0]
        victim.kill()
        t.join(120)
        outcomes = box["r"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _workers(d.proc.pid)
            if len(now) == 2 and victim.pid not in {p.pid for p in now}:
                break
            time.sleep(0.1)
        assert len(now) == 2 and victim.pid not in {p.pid for p in now}, d.output()  # restarted
        after = asyncio.run(_long_streams(d.info["proxy"], 8, 20))  # and serving
        time.sleep(0.5)
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    assert after == ["ok"] * 8
    cut = outcomes.count("cut")
    assert 1 <= cut < 16, outcomes  # 16 connections over 2 workers: some on each
    assert re.search(rf"proxy worker \d \(pid {victim.pid}\) is gone: {cut} request\(s\) in flight in it recorded as "
                     "interrupted", d.output()), d.output()
    assert "exited with status -9; restarting it" in d.output()
    reqs = read_dataset(tmp_path / "data", "requests")
    assert len(reqs) == 24 and reqs["request_id"].is_unique
    lost = reqs[reqs["error"].fillna("").str.contains("proxy worker")]
    # Marked, not silently lost: each cut stream is a row, interrupted, with what its worker had sent so far.
    assert len(lost) == cut and (lost["outcome"] == "interrupted").all()
    assert (lost["attributed_tokens"] > 0).all()
    assert (reqs[~reqs.index.isin(lost.index)]["outcome"] == "ok").all()
    parts, measured = energy_books_j(tmp_path / "data")
    assert parts == pytest.approx(measured, rel=0.01)


@pytest.mark.slow
def test_workers_exit_when_the_daemon_is_killed_9(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    procs = _workers(d.proc.pid)
    assert len(procs) == 2
    d.kill9()
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, [p.pid for p in alive]


def test_an_end_without_a_start_is_still_counted():
    # A request body that times out ends before its start is recorded; in-process the recorder still
    # counts it (requests_total by outcome). The end record carries the start's fields for that.
    from powerprof.daemon.workers import _end_record
    from powerprof.daemon.proxy import NOT_FORWARDED, RequestTrace

    tr = RequestTrace(request_id=7, method="POST", endpoint="/completion", tag="slow", arrival_ns=10, arrival_wall_ns=20)
    tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome = 30, 40, 408, "client_timeout"
    tr.extra[NOT_FORWARDED] = True  # the ledger writes its row from the end alone (no energy)
    rec = Rec()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    (msg,) = Unframer().feed(frame(([], [], [], [_end_record(tr)], ZERO, [], 0, [])))
    workers._replay(workers.workers[0], msg)
    (got,) = rec.ended
    assert (got.tag, got.status, got.outcome, got.arrival_ns, got.end_ns) == ("slow", 408, "client_timeout", 10, 30)
    assert got.extra.get(NOT_FORWARDED) is True
    assert workers.active == 0


def test_the_workers_bodies_streamed_on_uninspected_are_summed_for_metrics():
    # Each worker's Proxy counts the bodies it streamed on uninspected over the inspection budget; the daemon's /metrics
    # reads them as of an in-process Proxy (uninspected_bodies), summed over the workers' lives.
    from powerprof.daemon.workers import UNINSPECTED

    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=Rec(), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    stats = [0] * len(_STATS)
    stats[UNINSPECTED] = 3
    (msg,) = Unframer().feed(frame(([], [], [], [], tuple(stats), [], 0, [])))
    workers._replay(workers.workers[0], msg)
    assert workers.uninspected_bodies == 3
    rec = ShippingRecorder(8)
    rec.proxy = type("P", (), {"recorder_failures": 0, "upstream_failures": 0, "body_timeouts": {"silent": 0, "slow": 0},
                               "upstream_retries": 0, "uninspected_bodies": 5, "unforwarded": 0, "proxy_failures": 0})()
    assert rec._stats()[UNINSPECTED] == 5


def test_the_workers_body_reader_failures_are_summed_for_metrics(monkeypatch):
    # Each worker's Proxy counts its own faults reading a request body (proxy_failures); the daemon's /metrics reads
    # them as of an in-process Proxy, summed over the workers' lives: a worker's death carries its count into its base,
    # and its next life's first beat (counting from 0 again) adds to it, so the counter never goes back.
    from powerprof.daemon.workers import BODY_READER_FAILURES

    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=Rec(), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    monkeypatch.setattr(workers, "_reap", lambda w, deadline: None)
    w = workers.workers[0]
    stats = [0] * len(_STATS)
    stats[BODY_READER_FAILURES] = 2
    (msg,) = Unframer().feed(frame(([], [], [], [], tuple(stats), [], 0, [])))
    workers._replay(w, msg)
    assert workers.proxy_failures == 2
    w.transport = type("T", (), {"close": lambda self: None})()
    workers._lost(w)
    assert workers.proxy_failures == 2, "the dead worker's count was lost with it"
    stats[BODY_READER_FAILURES] = 1
    (msg,) = Unframer().feed(frame(("beat", 0, [], tuple(stats))))
    workers._replay(w, msg)
    assert workers.proxy_failures == 3
    rec = ShippingRecorder(8)
    rec.proxy = type("P", (), {"recorder_failures": 0, "upstream_failures": 0, "body_timeouts": {"silent": 0, "slow": 0},
                               "upstream_retries": 0, "uninspected_bodies": 0, "unforwarded": 0, "proxy_failures": 4})()
    assert rec._stats()[BODY_READER_FAILURES] == 4


def test_a_dead_workers_requests_not_yet_forwarded_are_counted_and_logged(monkeypatch, caplog):
    """A worker ships a request only once it forwards it (on_start), so one killed while clients were still sending
    their bodies lost those requests with no trace (workerdeath.py: 19 of 40 silent clients, no row, no count). Its
    heartbeat now says how many it holds not yet forwarded (Proxy.unforwarded); its death counts and logs them."""
    from powerprof.daemon.workers import UNFORWARDED

    async def main():
        proxy = Proxy("http://127.0.0.1:9", recorder=Rec(), body_timeout_s=5)
        r2, px_url = await _serve(proxy.app())
        r, w = await asyncio.open_connection("127.0.0.1", int(px_url.rsplit(":", 1)[1]))
        w.write(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        await w.drain()
        await asyncio.sleep(0.2)
        during = proxy.unforwarded
        w.close()
        for _ in range(100):
            if proxy.active == 0:
                break
            await asyncio.sleep(0.02)
        await r2.cleanup()
        return during, proxy.unforwarded

    assert _run(main()) == (1, 0)
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=Rec(), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    monkeypatch.setattr(workers, "_reap", lambda w, deadline: None)
    w = workers.workers[0]
    stats = [0] * len(_STATS)
    stats[UNFORWARDED] = 19
    (msg,) = Unframer().feed(frame(("beat", 0, [], tuple(stats))))
    workers._replay(w, msg)
    w.transport = type("T", (), {"close": lambda self: None})()
    with caplog.at_level("ERROR", logger="powerprof.daemon.workers"):
        workers._lost(w)
    assert workers.lost_unforwarded == 19
    assert any("19 request(s) it had not forwarded yet" in r.getMessage() for r in caplog.records), caplog.text
    assert w.base[UNFORWARDED] == 0  # a gauge, not summed over the worker's lives


@pytest.mark.slow
def test_a_second_daemon_does_not_join_a_port_the_first_ones_workers_serve(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"}
    first = DaemonProc(tmp_path / "a", "--simulate", "--listen", f"127.0.0.1:{port}", env=env)
    try:
        with pytest.raises(RuntimeError, match="exited with 1") as e:
            DaemonProc(tmp_path / "b", "--simulate", "--listen", f"127.0.0.1:{port}",
                       env={**env, "POWERPROF_SIM_STATE": str(tmp_path / "sim-b.json")})
        assert f"cannot start the proxy workers on 127.0.0.1:{port}" in str(e.value)
    finally:
        assert first.stop() == 0


@pytest.mark.slow
def test_sigterm_mid_stream_drains_the_workers_and_records_the_request_as_interrupted(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", "--flush-interval", "5",
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    procs = []
    try:
        procs = _workers(d.proc.pid)
        stream = open_long_stream(d.info["proxy"])  # held open while the daemon stops
        t0 = time.monotonic()
        rc = d.stop()
        stream.close()
        assert rc == 0 and time.monotonic() - t0 < 15, d.output()
        _gone, alive = psutil.wait_procs(procs, timeout=5)
        assert not alive
    finally:  # a failure above leaves no daemon nor worker running
        d.stop()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    reqs = read_dataset(tmp_path / "data", "requests")  # the worker's last records reached the ledger
    assert list(reqs["outcome"]) == ["interrupted"] and reqs["generated_tokens"].iloc[0] > 0
    assert reqs["error"].isna().all()  # cut by the stop, not by a worker's death


# --- review s22: each test below failed on the first version of proxy workers ---------------------------

from types import SimpleNamespace  # noqa: E402

from powerprof.daemon.ledger import Ledger  # noqa: E402
from powerprof.daemon.proxy import RequestTrace  # noqa: E402

S = 1_000_000_000
T = 10**12  # a monotonic base


class _ToLedger:
    """What Daemon.on_* does with the ledger (the edges and tag counters left out)."""

    def __init__(self, ledger):
        self.ledger = ledger

    def on_start(self, tr):
        self.ledger.on_start(tr)

    def on_tokens(self, tr, t, n):
        self.ledger.on_tokens(tr, t, n)

    def on_end(self, tr):
        self.ledger.on_end(tr)


def _ledger():
    rows = {}
    led = Ledger("d", T, 1, lambda ds, rs: rows.setdefault(ds, []).extend(rs))
    return led, rows


def _edge(led, k):
    led.add_gpu_sample(T + k * S, 1_700_000_000 * S + k * S,
                       [SimpleNamespace(energy_j=100.0 * k, power_w=100.0, power_avg_w=None, power_limit_w=300.0)])


class _FlakyWire(_Wire):
    """The worker's socket to the daemon, whose buffer is over the limit while `full` (the daemon's loop did
    not read for a moment)."""

    def __init__(self, deliver):
        super().__init__(deliver)
        self.full = False

    def get_write_buffer_size(self):
        return 1 << 40 if self.full else 0


def _trace(rid, arrival):
    return RequestTrace(request_id=rid, method="POST", endpoint="/completion", tag="t", arrival_ns=arrival,
                        arrival_wall_ns=arrival, api="llamacpp", stream=True)


def _pair(led):
    workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=_ToLedger(led), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    workers.workers[0].transport = object()  # up, for the watermark
    shipper = ShippingRecorder(4)
    wire = _FlakyWire(lambda m: workers._replay(workers.workers[0], m))
    shipper.transport = wire
    return workers, shipper, wire


def _tok(shipper, tr, t, n):
    if tr.first_ns is None:
        tr.first_ns = tr.first_wall_ns = t
    tr.last_ns = tr.last_wall_ns = t
    tr.tokens_seen += n
    tr.extra["prompt_tokens"] = 5
    shipper.on_tokens(tr, t, n)


def _end(shipper, tr, t):
    tr.end_ns = tr.end_wall_ns = t
    tr.status = 200
    tr.counts = streams.Counts(tr.tokens_seen, 5, None, "stop", "usage", complete=True)
    shipper.on_end(tr)


def test_under_back_pressure_an_end_is_held_not_dropped_so_no_request_stays_in_flight():
    # A batch that could not go (the daemon's loop busy for a moment) held the END of a request: dropped, the
    # request stayed live in the daemon for 6 h and took every later joule as decode.
    led, rows = _ledger()
    workers, shipper, wire = _pair(led)

    async def main():
        a = _trace(1, T + S // 10)
        shipper.on_start(a)
        _tok(shipper, a, T + S // 5, 1)
        await asyncio.sleep(0.05)
        wire.full = True
        _end(shipper, a, T + S // 4)  # this batch waits
        await asyncio.sleep(0.05)
        wire.full = False
        b = _trace(2, T + S // 3)  # traffic goes on: later batches arrive
        shipper.on_start(b)
        _tok(shipper, b, T + S // 2, 1)
        _end(shipper, b, T + 6 * S // 10)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    for k in range(11):
        _edge(led, k)
    led.advance(T + 60 * S)
    assert shipper.dropped == 0  # nothing but token records may be dropped, and there were none pending
    later = [r for r in rows["intervals"] if r["t_start_mono_s"] >= 1]
    assert sum(r["requests_energy_j"] for r in later) == 0, "idle time booked to a request that had ended"
    assert workers.active == 0
    assert len({r["request_id"] for r in rows.get("requests", [])}) == 2


def test_a_request_whose_start_could_not_go_at_once_still_gets_its_row_and_tokens():
    led, rows = _ledger()
    workers, shipper, wire = _pair(led)

    async def main():
        a = _trace(1, T + S // 10)
        wire.full = True
        shipper.on_start(a)  # held
        await asyncio.sleep(0.05)
        wire.full = False
        _tok(shipper, a, T + S // 5, 1)
        for i in range(20):
            _tok(shipper, a, T + S // 5 + i * S // 50, 1)
        await asyncio.sleep(0.05)
        _end(shipper, a, T + 9 * S // 10)
        await asyncio.sleep(0.05)

    asyncio.run(main())
    for k in range(4):
        _edge(led, k)
    led.advance(T + 60 * S)
    (row,) = rows["requests"]
    assert row["attributed_tokens"] == 21 and row["error"] is None


def test_dropped_token_records_flag_their_request_and_a_lost_end_is_ended_from_the_heartbeat(monkeypatch):
    # Only coalesced token records are dropped under back-pressure, and their request's row says how many
    # tokens were not placed. Beyond HELD_MAX_RECORDS even an end goes: the heartbeat's live set then ends it.
    import powerprof.daemon.workers as wk

    monkeypatch.setattr(wk, "HELD_MAX_RECORDS", 1)
    led, rows = _ledger()
    workers, shipper, wire = _pair(led)
    a, b = _trace(1, T + S // 10), _trace(2, T + S // 10)

    async def main():
        shipper.on_start(a)
        shipper.on_start(b)
        _tok(shipper, a, T + S // 5, 1)
        _tok(shipper, b, T + S // 5, 1)
        await asyncio.sleep(0.05)
        wire.full = True
        for i in range(10):
            _tok(shipper, a, T + S // 4 + i * S // 100, 1)  # coalesced: one record, dropped
        await asyncio.sleep(3 * FLUSH_S)
        _end(shipper, b, T + S // 2)  # held, then pushed out by the next end (the bound is 1)
        _end(shipper, a, T + S // 2)
        await asyncio.sleep(3 * FLUSH_S)
        wire.full = False
        shipper.beat()

    asyncio.run(main())
    assert shipper.dropped == 2  # a's token record, b's end
    for k in range(4):
        _edge(led, k)
    led.advance(T + 60 * S)
    by_id = {r["request_id"]: r for r in rows["requests"]}
    assert workers.active == 0 and len(by_id) == 2
    ra, rb = by_id[1], by_id[2]  # the daemon's ids, in start order
    assert ra["generated_tokens"] == 11 and ra["attributed_tokens"] == 1
    assert "10 token(s) not attributed" in ra["error"]
    assert rb["outcome"] == "interrupted" and "end record was dropped" in rb["error"]
    assert workers.lost_requests == 1


def test_tokens_replayed_after_their_interval_closed_are_held_for_or_flagged():
    # The workers' stamps are theirs: a record the daemon reads after the tick closed its interval cannot
    # be placed. The ledger waits for the workers' watermark; a token still late is counted and flagged.
    led, rows = _ledger()
    workers, shipper, wire = _pair(led)
    a = _trace(1, T + S // 10)

    async def first():
        shipper.on_start(a)
        _tok(shipper, a, T + S // 5, 1)
        await asyncio.sleep(0.05)

    asyncio.run(first())
    for k in range(3):
        _edge(led, k)
    workers.workers[0].watermark_ns = T + S // 2  # its last frame
    pending = []
    wire.deliver, deliver = pending.append, wire.deliver  # the daemon's loop is late reading the socket

    async def later():
        for i in range(50):
            _tok(shipper, a, T + 1 * S + i * S // 100, 1)  # stamped in [T+1 s, T+1.5 s]
        await asyncio.sleep(0.05)

    asyncio.run(later())
    led.advance(T + 2 * S + 4 * S // 10, workers.watermark_ns)  # the tick: [T+1, T+2] waits for the worker
    assert not [r for r in rows.get("intervals", []) if r["t_start_mono_s"] >= 1]
    led.advance(T + 2 * S + 4 * S // 10)  # as without the watermark: closes [T+1, T+2]
    for m in pending:
        deliver(m)  # the records, read after their interval closed
    wire.deliver = deliver

    async def end():
        _end(shipper, a, T + 2 * S + S // 2)
        await asyncio.sleep(0.05)

    asyncio.run(end())
    _edge(led, 3)
    led.advance(T + 60 * S)
    (row,) = rows["requests"]
    assert row["generated_tokens"] == 51 and row["attributed_tokens"] == 1
    assert "50 token(s) arrived after their interval had closed" in row["error"]
    assert led.late_tokens == 50


def test_the_watermark_is_the_lowest_live_workers_and_holds_the_ledger_at_most_max_hold():
    w = ProxyWorkers(3, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={}, header_timeout_s=10,
                     idle_timeout_s=10)
    assert w.watermark_ns is None
    for k, mark in enumerate((5 * S, 3 * S, 1 * S)):
        w.workers[k].watermark_ns = mark
    w.workers[0].transport = w.workers[1].transport = object()  # worker 2 is down: its tokens cannot come
    assert w.watermark_ns == 3 * S
    led, rows = _ledger()
    for k in range(200):
        _edge(led, k)
    led.advance(T + 10 * S, T + 4 * S)
    assert max(r["t_start_mono_s"] for r in rows["intervals"]) == 3  # [3, 4] closed; [4, 5] waits
    led.advance(T + 190 * S, T + 4 * S)  # a worker that never catches up holds at most max_hold_s (120 s)
    assert max(r["t_start_mono_s"] for r in rows["intervals"]) == 189 - 120


def test_max_connections_is_a_bound_for_all_workers_together():
    for total, n in ((5, 4), (1024, 3), (2, 4)):
        w = ProxyWorkers(n, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={"max_connections": total},
                         header_timeout_s=10, idle_timeout_s=10)
        per = w.spec["proxy"]["max_connections"]
        assert per >= 1 and (n * per <= total or per == 1)


def test_a_unix_listen_address_with_workers_is_a_config_error():
    with pytest.raises(ConfigError, match="proxy.workers > 1 needs a TCP proxy.listen"):
        load_config(None, env={"POWERPROF_PROXY_WORKERS": "2", "POWERPROF_PROXY_LISTEN": "unix:/tmp/p.sock"})
    assert load_config(None, env={"POWERPROF_PROXY_LISTEN": "unix:/tmp/p.sock"}).get("proxy", "workers") == 1


def test_a_badly_typed_record_is_refused_whole_and_the_ledger_goes_on():
    # A string where a time belongs reached the ledger and wedged every later interval's close.
    from powerprof.daemon.workers import _WorkerLink, _end_record, _start_record

    led, rows = _ledger()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=_ToLedger(led), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    w = workers.workers[0]
    closed = []
    w.transport = SimpleNamespace(close=lambda: closed.append(1))
    link = _WorkerLink(workers, w)
    bad = _trace(1, T + S // 10)
    bad.arrival_ns = "soon"
    link.data_received(frame(([_start_record(bad)], [], [], [], ZERO, [], T, [])))
    assert closed and workers.replay_failures == 1 and workers.active == 0  # the worker's failure path
    good = _trace(2, T + S // 10)
    good.end_ns = good.end_wall_ns = T + S // 2
    w.transport = SimpleNamespace(close=lambda: closed.append(2))
    link = _WorkerLink(workers, w)
    link.data_received(frame(([_start_record(good)], [], [], [_end_record(good)], ZERO, [], T, [])))
    for k in range(3):
        _edge(led, k)
    led.advance(T + 60 * S)
    assert len(rows["requests"]) == 1 and len(rows["intervals"]) == 2 and closed == [1]


def test_the_workers_refused_connects_cross_the_link_bounded_and_are_taken_once():
    # The scraper finds the server down by the proxy's refused connects (Scraper._proxy_refused); with workers they
    # stayed in the workers' processes. Shipped with their flushes, merged across workers in time order, bounded as
    # one in-process proxy keeps them (the first and latest halves of proxy.REFUSALS_KEPT), taken once.
    from powerprof.daemon.proxy import REFUSALS_KEPT
    from powerprof.daemon.workers import _WorkerLink, check_message

    workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=_ToLedger(_ledger()[0]), proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    for w in workers.workers:
        w.transport = SimpleNamespace(close=lambda: None)
    a, b = (_WorkerLink(workers, w) for w in workers.workers)
    a.data_received(frame(([], [], [], [], ZERO, [], T, [T + 1, T + 5])))
    b.data_received(frame(([], [], [], [], ZERO, [], T, [T + 3])))
    assert workers.replay_failures == 0 and workers.take_refusals() == [T + 1, T + 3, T + 5]
    assert workers.take_refusals() == []
    herd = [T + k for k in range(REFUSALS_KEPT)]
    a.data_received(frame(([], [], [], [], ZERO, [], T, herd)))
    b.data_received(frame(([], [], [], [], ZERO, [], T, [t + REFUSALS_KEPT for t in herd])))
    kept = workers.take_refusals()
    half = REFUSALS_KEPT // 2
    assert kept == herd[:half] + [t + REFUSALS_KEPT for t in herd[-half:]], kept
    with pytest.raises(ValueError, match="refusals"):
        check_message(([], [], [], [], ZERO, [], T, herd + [T]))
    with pytest.raises(ValueError, match="refusals"):
        check_message(([], [], [], [], ZERO, [], T, ["soon"]))

    # The worker's side: its proxy's refusals go with its next flush, once, and alone are a reason to send one.
    sent = []
    ship = ShippingRecorder(4)
    ship.transport = SimpleNamespace(is_closing=lambda: False, get_write_buffer_size=lambda: 0, write=sent.append)
    ship.proxy = SimpleNamespace(_refused_ns=[T + 7], recorder_failures=0, upstream_failures=1,
                                 body_timeouts={"silent": 0, "slow": 0}, upstream_retries=0, uninspected_bodies=0,
                                 unforwarded=0, proxy_failures=0)
    ship.proxy.take_refusals = lambda: [ship.proxy._refused_ns.pop()]
    ship.flush()
    ship.flush()
    msgs = Unframer().feed(b"".join(sent))
    assert len(msgs) == 1 and msgs[0][7] == [T + 7], msgs


def test_a_heartbeat_claims_no_clock_past_refusals_its_full_link_held_back():
    # The scraper waits for every worker's clock (its frames' watermark) to pass a scrape's start before it takes their
    # refusals (Scraper._take_refusals). A worker whose link to the daemon is full keeps its refusals (flush sends
    # nothing); its heartbeat went out all the same with the time now as its clock, so the scraper stopped waiting and
    # judged the page without them. Now a held refusal holds the clock back, as a held start or end does.
    from powerprof.daemon.workers import SEND_BUFFER_MAX_BYTES

    sent = []
    ship = ShippingRecorder(4)
    ship.transport = SimpleNamespace(is_closing=lambda: False, get_write_buffer_size=lambda: SEND_BUFFER_MAX_BYTES + 1,
                                     write=sent.append)
    ship.proxy = SimpleNamespace(_refused_ns=[T + 7], recorder_failures=0, upstream_failures=1,
                                 body_timeouts={"silent": 0, "slow": 0}, upstream_retries=0, uninspected_bodies=0,
                                 unforwarded=0, proxy_failures=0)
    ship.proxy.take_refusals = lambda: [ship.proxy._refused_ns.pop()]
    ship.sent_ns = T
    ship.beat()
    msgs = Unframer().feed(b"".join(sent))
    assert [m[0] for m in msgs] == ["beat"] and msgs[0][1] == T and ship.proxy._refused_ns == [T + 7], msgs


def test_the_wait_for_the_workers_refusals_wakes_on_their_records_not_a_poll():
    # A scrape waits for every worker's clock to pass its start (ProxyWorkers.wait_refusals, Scraper._take_refusals),
    # woken by the records that move a clock, not by a poll (every 10 ms: 4 wake-ups of the daemon's loop a scrape): a
    # beat short of the start waits on, the last clock past it ends the wait then, a worker lost frees the others', and
    # nothing coming ends it at its bound.
    from powerprof.daemon.workers import _WorkerLink

    zero = (0,) * len(_STATS)

    async def go():
        workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={},
                               header_timeout_s=10, idle_timeout_s=10)
        for w in workers.workers:
            w.transport = SimpleNamespace(close=lambda: None)
        links = [_WorkerLink(workers, w) for w in workers.workers]

        def send(k, beat=False, wm_ns=None):
            wm_ns = time.monotonic_ns() if wm_ns is None else wm_ns
            links[k].data_received(frame(("beat", wm_ns, [], zero) if beat else ([], [], [], [], zero, [], wm_ns, [])))

        async def timed(timeout_s, *later):
            at = time.monotonic_ns()
            for delay_s, call in later:
                loop.call_later(delay_s, call)
            t = time.monotonic()
            await workers.wait_refusals(at, timeout_s)
            return time.monotonic() - t

        loop = asyncio.get_running_loop()
        send(0), send(1)
        bound = await timed(0.05)
        both = await timed(5.0, (0.01, lambda: send(0, beat=True, wm_ns=1)), (0.02, lambda: send(0)),
                           (0.04, lambda: send(1, beat=True)))
        lost = await timed(5.0, (0.02, lambda: send(0)), (0.04, lambda: workers._lost(workers.workers[1])))
        return bound, both, lost, workers.watermark_ns

    bound, both, lost, mark = asyncio.run(go())
    assert 0.045 <= bound < 1.0, bound
    assert 0.035 <= both < 1.0 and 0.035 <= lost < 1.0, (both, lost)  # not the 5 s bound
    assert mark is not None  # the worker left up still holds a clock


def test_restarts_back_off_exponentially_and_reset_after_a_stable_minute(caplog):
    import gc

    w = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={}, header_timeout_s=10,
                     idle_timeout_s=10)
    worker = w.workers[0]
    delays, unretrieved = [], []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _l, ctx: unretrieved.append(ctx))
        loop.call_later = lambda d, fn, *a: delays.append(d)  # the restart is not run: only its delay matters
        for k in range(10):
            worker.proc = SimpleNamespace(poll=lambda: 1, pid=100 + k)
            worker.started_s = time.monotonic()  # died at once
            worker.hello = loop.create_future()
            worker.hello.add_done_callback(lambda f: f.cancelled() or f.exception())
            worker.closed = loop.create_future()
            w._reap(worker, time.monotonic() + 1)
        worker.proc, worker.started_s = SimpleNamespace(poll=lambda: 1, pid=7), time.monotonic() - 61
        worker.hello = worker.closed = None
        w._reap(worker, time.monotonic() + 1)
        gc.collect()
        await asyncio.sleep(0)

    with caplog.at_level("ERROR", logger="powerprof.daemon.workers"):
        asyncio.run(main())
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 1]
    assert w.restarts["exited"] == 11
    assert len([r for r in caplog.records if "restarting it in" in r.message]) == 5  # 3 first, the 10th, the reset
    assert not unretrieved, unretrieved


@pytest.mark.slow
def test_the_port_is_never_free_while_workers_restart_and_a_waiting_client_is_served(tmp_path):
    # The daemon held the address bound but not listening: with no worker listening (start-up, all of them
    # restarting), Linux let another process, of another user too (review/port_hijack.py), bind it with
    # SO_REUSEADDR, listen, and read clients' prompts. Now the daemon listens itself for its whole life.
    import json
    import os
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = DaemonProc(tmp_path / "data", "--simulate", "--listen", f"127.0.0.1:{port}",
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    try:
        procs = _workers(d.proc.pid)
        assert len(procs) == 2
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        box = {}

        def client():
            body = json.dumps({"prompt": "my secret prompt", "max_tokens": 3}).encode()  # the simulated server is vLLM's
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                box["status"] = r.status

        t = threading.Thread(target=client)
        t.start()  # no worker serves now: the connection waits in the daemon's accept queue
        taken, tries = 0, 0
        deadline = time.monotonic() + 1.0  # the first restart comes after 1 s
        while time.monotonic() < deadline:
            a = socket.socket()
            a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                a.bind(("127.0.0.1", port))
                a.listen(16)
                taken += 1
            except OSError:
                pass
            finally:
                a.close()
            tries += 1
        t.join(90)
    finally:
        rc = d.stop()
    assert tries > 10 and taken == 0, f"another socket listened on the proxy port {taken} of {tries} times"
    assert box.get("status") == 200, d.output()
    assert rc == 0, d.output()


@pytest.mark.slow
@pytest.mark.parametrize("pythonpath", [True, False], ids=["dev-PYTHONPATH", "no-PYTHONPATH"])
def test_workers_run_no_code_from_the_daemons_working_directory(tmp_path, monkeypatch, pythonpath):
    # `python -m powerprof.daemon.workers` put the working directory first on sys.path: a `powerprof/` in the
    # directory root started the daemon from (/tmp, say) ran as the daemon's user. The worker must import the
    # daemon's own powerprof, whether that came from PYTHONPATH (a checkout) or not (installed).
    from test_daemon_store import _plant

    marker = tmp_path / "PWNED"
    evil = _plant(tmp_path / "cwd", marker)
    (evil / "powerprof" / "daemon" / "workers.py").write_text("raise SystemExit(3)\n")
    if not pythonpath:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(evil)
    rec = Rec()

    async def main():
        up = Upstream()
        r1, up_url = await _serve(up.app())
        w = ProxyWorkers(2, up_url, "127.0.0.1", 0, recorder=rec, proxy_kwargs={}, header_timeout_s=10,
                         idle_timeout_s=10)
        host, port = await w.start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://{host}:{port}/completion", json={"n_predict": 5}) as r:
                    assert r.status == 200
                    await r.read()
            for _ in range(200):
                if rec.ended:
                    break
                await asyncio.sleep(0.02)
        finally:
            await w.cleanup()
            await r1.cleanup()

    _run(main())
    assert not marker.exists(), "code from the daemon's working directory ran in a worker"
    assert len(rec.ended) == 1


@pytest.mark.slow
def test_a_stopped_worker_is_noticed_killed_restarted_and_counted(tmp_path):
    import os
    import signal

    d = DaemonProc(tmp_path / "data", "--simulate", env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    try:
        before = _workers(d.proc.pid)
        victim = before[0]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)  # alive, holding its connections, answering nothing
        deadline = t0 + 60
        while time.monotonic() < deadline:
            now = _workers(d.proc.pid)
            if len(now) == 2 and victim.pid not in {p.pid for p in now}:
                break
            time.sleep(0.2)
        noticed_s = time.monotonic() - t0
        metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        after = asyncio.run(_long_streams(d.info["proxy"], 8, 20))  # all served again
    finally:
        rc = d.stop()
    assert len(now) == 2 and victim.pid not in {p.pid for p in now}, d.output()
    assert noticed_s >= 9, noticed_s  # silent 10 s, not sooner (it sends a heartbeat every 0.25 s)
    assert re.search(rf"proxy worker \d \(pid {victim.pid}\) sent nothing for 1\d s \(stopped or wedged\): killing it",
                     d.output()), d.output()
    assert 'powerprof_proxy_worker_restarts_total{reason="silent"} 1.0' in metrics, metrics
    assert 'powerprof_proxy_worker_restarts_total{reason="exited"} 0.0' in metrics
    assert after == ["ok"] * 8
    assert rc == 0, d.output()


def test_a_silent_worker_is_killed_but_not_after_our_own_loop_stalled():
    w = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={}, header_timeout_s=10,
                     idle_timeout_s=10)
    killed = []

    async def main():
        now = time.monotonic()
        for k, wk in enumerate(w.workers):
            wk.proc = SimpleNamespace(pid=10 + k, kill=lambda k=k: killed.append(k))
            wk.transport, wk.said_hello = object(), True
            wk.heard_s = now - 20  # silent for 20 s ...
        w._checked_s = now - 20  # ... while our loop did not run: their frames wait unread
        w._check_silence()
        assert killed == []
        w.workers[0].heard_s = time.monotonic() - 11  # now one is silent while we run
        w._check_silence()
        w._watch.cancel()

    asyncio.run(main())
    assert killed == [0] and w.restarts["silent"] == 1


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_compressed_request_body_reaches_the_upstream_as_the_client_encoded_it(tmp_path, workers):
    """aiohttp's server would decompress a `Content-Encoding: gzip` body and pass plain bytes still
    labelled gzip; the daemon's proxy listener (in-process, and in each worker) passes the client's bytes."""
    import gzip
    import json

    from aiohttp import web
    from proxy_helpers import serve_in_thread

    body = gzip.compress(json.dumps({"prompt": "p" * 5000, "n_predict": 1}).encode())

    def app():
        async def echo(request):
            return web.json_response({"length": request.headers.get("Content-Length"),
                                      "encoding": request.headers.get("Content-Encoding")})
        a = web.Application()
        a.router.add_post("/v1/embeddings", echo)
        return a

    up_url, stop_up = serve_in_thread(app)
    d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", up_url,
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": workers})
    try:
        req = urllib.request.Request(d.info["proxy"] + "/v1/embeddings", data=body, method="POST",
                                     headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            seen = json.loads(r.read())
    finally:
        assert d.stop() == 0, d.output()
        stop_up()
    assert seen == {"length": str(len(body)), "encoding": "gzip"}


def test_a_contradicted_counts_kind_crosses_the_link_and_an_unknown_kind_is_refused():
    # The daemon's /metrics label was picked by matching "running count" in the message: the kind crosses
    # the link as a name, and only a known one, beside its message, can become a label.
    import dataclasses

    from powerprof.arrival import RUNNING_COUNT_SHORT
    from powerprof.daemon.workers import _end_record, check_message

    tr = _trace(1, T + S // 10)
    tr.end_ns = tr.end_wall_ns = T + S // 2
    tr.counts = streams.Counts(50, 5, None, "stop", "timings", count_problem="the server counted 50 generated "
                               "tokens but ...", count_problem_kind=RUNNING_COUNT_SHORT)
    end = _end_record(tr)
    check_message(([], [], [], [end], ZERO, [], T, []))
    assert streams.Counts(*end[16]).count_problem_kind == RUNNING_COUNT_SHORT
    for kind, problem in (("made_up", "x"), (None, "x"), (RUNNING_COUNT_SHORT, None)):
        tr.counts = dataclasses.replace(tr.counts, count_problem=problem, count_problem_kind=kind)
        with pytest.raises(ValueError, match="counts"):
            check_message(([], [], [], [_end_record(tr)], ZERO, [], T, []))


def test_a_requests_choices_cross_the_link_with_its_start_and_its_prompts_shape_with_its_counts():
    # The ledger divides a prompt said once for n choices (vLLM) by the prompts alone, one summed over tasks
    # (llama.cpp) by all the sequences: both must reach it from a worker as from the in-process proxy.
    from powerprof.daemon.streams import Counts
    from powerprof.daemon.workers import _WorkerLink, _end_record, _start_record

    starts, ends = [], []
    rec = SimpleNamespace(on_start=lambda tr: starts.append(dict(tr.extra)), on_tokens=lambda *a: 0.0,
                          on_end=lambda tr: ends.append(tr.counts) or 0.0)
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    w = workers.workers[0]
    w.transport = SimpleNamespace(close=lambda: None)
    link = _WorkerLink(workers, w)
    tr = _trace(1, T + S // 10)
    tr.extra.update(sequences=4, choices=2)
    tr.end_ns = tr.end_wall_ns = T + S // 2
    tr.counts = Counts(generated_tokens=8, prompt_tokens=20, model=None, stop_reason=None, token_source="usage",
                       prompt_each_task=True)
    link.data_received(frame(([_start_record(tr)], [], [], [], ZERO, [], T, [])))
    assert starts == [{"sequences": 4, "choices": 2}] and workers.replay_failures == 0
    link.data_received(frame(([], [], [], [_end_record(tr)], ZERO, [], T, [])))
    assert workers.replay_failures == 0 and ends[0].prompt_each_task is True


def test_a_cached_count_said_early_with_the_prompt_reaches_the_ledger_through_a_worker():
    # SGLang /generate and continuous usage with details say the cached count on the first event beside the prompt's
    # length: the ledger places the prefill at the part computed (without it, a 900-cached prompt's prefill was
    # charged whole and the request beside it -41%). Both records carry it: the first token's, and a later one's.
    led, _rows = _ledger()
    workers, shipper, wire = _pair(led)
    seen = {}

    async def main():
        a, b = _trace(1, T + S // 10), _trace(2, T + S // 10)
        shipper.on_start(a)
        shipper.on_start(b)
        a.extra["cached_tokens"] = 900
        _tok(shipper, a, T + S // 5, 1)  # the first: its own record
        _tok(shipper, b, T + S // 5, 1)
        b.extra["cached_tokens"] = 3  # said from its second event on: a token record
        _tok(shipper, b, T + S // 4, 1)
        await asyncio.sleep(0.05)
        for r in led.requests.values():
            seen[r.trace.request_id] = (r.trace.extra.get("prompt_tokens"), r.trace.extra.get("cached_tokens"))

    asyncio.run(main())
    assert seen == {1: (5, 900), 2: (5, 3)}


def test_a_count_that_stops_short_and_a_best_of_cross_the_link_with_the_end():
    # count_open (SGLang's chat running count, its end saying none) and the request's best_of / max_tokens reach the
    # ledger from a worker as from the in-process proxy: a worker's end with the new field was refused before, its
    # request's row lost (its worker taken for gone).
    from powerprof.daemon.streams import Counts
    from powerprof.daemon.workers import _WorkerLink, _end_record, _start_record

    ends = []
    rec = SimpleNamespace(on_start=lambda tr: None, on_tokens=lambda *a: 0.0,
                          on_end=lambda tr: ends.append((tr.counts, dict(tr.extra))) or 0.0)
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    w = workers.workers[0]
    w.transport = SimpleNamespace(close=lambda: None)
    link = _WorkerLink(workers, w)
    tr = _trace(1, T + S // 10)
    tr.extra.update(best_of=3, max_tokens=48)
    tr.end_ns = tr.end_wall_ns = T + S // 2
    tr.counts = Counts(generated_tokens=27, prompt_tokens=20, model=None, stop_reason="stop", token_source="usage",
                       count_open=True)
    link.data_received(frame(([_start_record(tr)], [], [], [_end_record(tr)], ZERO, [], T, [])))
    assert workers.replay_failures == 0
    (counts, extra), = ends
    assert counts.count_open is True and extra["best_of"] == 3 and extra["max_tokens"] == 48


def test_a_requests_max_tokens_reaches_the_daemon_with_its_start_before_its_first_token():
    # The daemon reads a first token that holds every token max_tokens allows (vLLM's 1-token answer, its one token in
    # the closing chunk) as the request's end, its edge read once the counter caught up (service.on_tokens). From a
    # worker, max_tokens came with the end alone: at the first token the daemon did not know it, and read the edge as a
    # first token's (the end's last joules to idle: a 1-token answer alone read -33% about one run in two).
    from powerprof.daemon.workers import _start_record, _WorkerLink

    seen = []
    rec = SimpleNamespace(on_start=lambda tr: None, on_end=lambda tr: 0.0,
                          on_tokens=lambda tr, t, n: seen.append((tr.extra.get("max_tokens"), tr.tokens_seen)) or 0.0)
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    w = workers.workers[0]
    w.transport = SimpleNamespace(close=lambda: None)
    link = _WorkerLink(workers, w)
    tr = _trace(1, T)
    tr.extra["max_tokens"] = 1
    first = (1, T + S // 10, T + S // 10, 1, 200, True, None, None)
    link.data_received(frame(([_start_record(tr)], [first], [], [], ZERO, [], T, [])))
    untold = _trace(2, T)  # a request that set no max_tokens
    link.data_received(frame(([_start_record(untold)], [(2, T + S // 5, T + S // 5, 1, 200, True, None, None)], [], [],
                              ZERO, [], T, [])))
    assert workers.replay_failures == 0
    assert seen == [(1, 1), (None, 1)]


def test_a_worker_speaking_another_record_shape_is_said_once_and_not_restarted(caplog):
    # An in-place upgrade under a running daemon (the counts record grew 18 -> 20 fields): a restarted worker's every
    # record was refused as an "unreadable frame", the worker restarted, refused again, for ever, the fix said nowhere.
    import socket

    from powerprof.daemon import workers as wmod
    from powerprof.daemon.workers import _WorkerLink

    led, _rows = _ledger()
    w = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=_ToLedger(led), proxy_kwargs={},
                     header_timeout_s=10, idle_timeout_s=10)
    w.sockets = [socket.socket(), socket.socket()]
    delays, killed = [], []

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_later = lambda d, fn, *a: delays.append(d)
        for k, wk in enumerate(w.workers):
            wk.proc = SimpleNamespace(poll=lambda: None, pid=100 + k, kill=lambda k=k: killed.append(k))
            wk.hello = loop.create_future()
            wk.hello.add_done_callback(lambda f: f.cancelled() or f.exception())
            wk.transport = SimpleNamespace(close=lambda: None)
        # Worker 0 of the daemon's shape is served; worker 1 says another, a counts record of 20 fields behind it.
        _WorkerLink(w, w.workers[0]).data_received(frame(("hello", 100, wmod.LINK_SHAPE)))
        assert w.workers[0].said_hello and not w.workers[0].retired
        for _ in range(2):  # said once, however often
            _WorkerLink(w, w.workers[1]).data_received(frame(("hello", 101, "another-shape"))
                                                       + frame(([], [], [], [], ZERO, [], T, [])))
        assert w.workers[1].retired and killed == [1, 1] and w.replay_failures == 0
        assert w.sockets[1].fileno() == -1 and w.sockets[0].fileno() != -1  # its share goes to worker 0
        w.workers[1].proc = SimpleNamespace(poll=lambda: -9, pid=101)
        w._reap(w.workers[1], time.monotonic() + 1)
        w._restart(w.workers[1])
        await asyncio.sleep(0)

    with caplog.at_level("ERROR", logger="powerprof.daemon.workers"):
        asyncio.run(main())
    for s in w.sockets:
        s.close()
    assert delays == [], delays  # no restart scheduled
    said = [r.getMessage() for r in caplog.records if "upgraded under the daemon" in r.getMessage()]
    assert len(said) == 1 and "restart the daemon" in said[0] and "another-shape" in said[0], said
    assert not [r for r in caplog.records if "restarting it in" in r.getMessage()]


def test_the_unread_gauge_holds_through_an_unread_workers_restart_until_a_life_speaks_the_daemons_shape(monkeypatch):
    """The last worker serving unread (an upgrade in place) that crashes is restarted with back-off (up to 60 s). The
    gauge counted only a running worker and a spawn cleared its state, so it read 0 through the back-off and the
    start: "all read again" to the tuner (which then judged windows of unread traffic as quiet) and to alerts.
    The restart goes through the real path (`_restart` → `_spawn`, its process faked): before, the test set the new
    life's process by hand, and a spawn clearing the worker's unread state again passed it."""
    import socket

    from powerprof.daemon import workers as wmod

    spawned = []

    def popen(*_a, **_k):  # a worker process that starts and says nothing until the test speaks for it
        spawned.append(SimpleNamespace(pid=124 + len(spawned), stdin=SimpleNamespace(write=lambda _s: None,
                                                                                      close=lambda: None),
                                       poll=lambda: None, send_signal=lambda _s: None, kill=lambda: None,
                                       wait=lambda *_: 0))
        return spawned[-1]

    monkeypatch.setattr(wmod.subprocess, "Popen", popen)

    async def main():
        w = ProxyWorkers(2, "http://127.0.0.1:1", "127.0.0.1", 0, recorder=Rec(), proxy_kwargs={},
                         header_timeout_s=10, idle_timeout_s=10)
        w.sockets = [socket.socket(), socket.socket()]  # the listening sockets a spawn passes on (unused here)
        old, last = w.workers
        old.retired = True  # the other worker was retired by the upgrade
        last.proc = SimpleNamespace(pid=123)  # running
        last.hello = asyncio.get_running_loop().create_future()
        wmod._WorkerLink(w, last).data_received(frame(("hello", 123, "another-shape")))
        counts = [w.unread_workers]
        assert w.unread_since_ns is not None  # the intervals closed from here say proxy_unread (ledger)
        last.proc = None  # it crashed: backing off before its restart
        counts.append(w.unread_workers)
        w._restart(last)  # the back-off over: a new life, spawned, not yet said hello
        assert last.proc is spawned[-1] and not last.said_hello
        counts.append(w.unread_workers)
        wmod._WorkerLink(w, last).data_received(frame(("hello", 124, "another-shape")))  # a new life, still newer code
        counts.append(w.unread_workers)
        wmod._WorkerLink(w, last).data_received(frame(("hello", 124, wmod.LINK_SHAPE)))  # the daemon's code again
        counts.append(w.unread_workers)
        assert w.unread_since_ns is None
        # the ended span is kept for the ledger's intervals closed after it (ledger.proxy_unread_spans)
        assert len(w.unread_spans) == 1 and w.unread_spans[0][0] < w.unread_spans[0][1], w.unread_spans
        for s in w.sockets:
            s.close()
        return counts

    assert asyncio.run(main()) == [1, 1, 1, 1, 0]


@pytest.mark.slow
def test_after_an_upgrade_retires_every_worker_one_still_serves_the_port_unattributed(monkeypatch, caplog):
    """An in-place upgrade under a running daemon, then each worker restarted (both killed here): each new worker speaks
    another record shape. Before, every one was stopped and none restarted: the port stayed bound (the daemon's
    sockets) with nothing accepting, and the user's requests waited in its queue until their clients gave up. The proxy
    is fail-open: the last worker keeps serving and forwarding, its records not read (its traffic is not attributed:
    the server's counter shows it as bypass traffic), and /metrics (powerprof_proxy_workers_unread) and the log say so."""
    from powerprof.daemon import workers as wmod

    rec = Rec()
    box = {}

    async def main():
        up = Upstream()
        r1, up_url = await _serve(up.app())
        w = ProxyWorkers(2, up_url, "127.0.0.1", 0, recorder=rec, proxy_kwargs={}, header_timeout_s=10,
                         idle_timeout_s=10)
        host, port = await w.start()
        try:
            monkeypatch.setattr(wmod, "LINK_SHAPE", "the-daemons-older-shape")  # the code on disk is newer now
            for x in w.workers:
                x.proc.kill()
            deadline = time.monotonic() + 90  # restarted after 1 s, then a Python start on a loaded host
            while time.monotonic() < deadline and not all(x.retired or getattr(x, "unread", False) and x.said_hello
                                                            for x in w.workers):
                await asyncio.sleep(0.1)
            box["states"] = [(x.retired, getattr(x, "unread", False)) for x in w.workers]
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post(f"http://{host}:{port}/completion", json={"n_predict": 5},
                                      timeout=aiohttp.ClientTimeout(total=30)) as r:
                        box["status"] = r.status
                        await r.read()
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                box["status"] = repr(e)
            box["unread"] = getattr(w, "unread_workers", None)
        finally:
            await w.cleanup()
            await r1.cleanup()

    with caplog.at_level("ERROR", logger="powerprof.daemon.workers"):
        asyncio.run(asyncio.wait_for(main(), 240))
    assert box["status"] == 200, box  # the user's request was served
    assert sorted(box["states"]) == [(False, True), (True, False)], box  # one retired, one serving unread
    assert box["unread"] == 1 and not rec.ended, box  # its request is not attributed (not read), and said
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "not attributed" in said and "restart the daemon" in said, said


def test_the_links_counts_shape_has_a_type_for_each_of_counts_fields():
    # The daemon checks each end record's counts against workers._COUNTS, one type a streams.Counts field: a field
    # added to Counts without its type there had every worker's end record refused ("malformed end's counts record"),
    # the worker restarted and its requests `interrupted` (found adding Counts.carried_chars).
    from dataclasses import astuple, fields

    from powerprof.daemon import workers
    from powerprof.daemon.streams import Counts

    assert len(workers._COUNTS) == len(fields(Counts))
    c = Counts(5, 7, "m", "stop", "usage", response_id="resp_1", reasoning_tokens=2, carried_chars=10)
    workers._check(astuple(c), workers._COUNTS, "end's counts")
