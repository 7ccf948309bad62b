"""proxy.workers > 1: proxy processes on SO_REUSEPORT whose records the daemon replays into its one ledger."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
import time
import urllib.request

import aiohttp
import psutil
import pytest

from daemon_helpers import DaemonProc, energy_books_j, read_dataset, sim_env
from powerprof.daemon import streams
from powerprof.daemon.config import ConfigError, load_config
from powerprof.daemon.proxy import Proxy
from powerprof.daemon.workers import FLUSH_S, ProxyWorkers, ShippingRecorder, Unframer, WorkerProxy, frame
from test_daemon_proxy import Rec, Upstream, _run, _serve

TRACE_FIELDS = ("method", "endpoint", "tag", "arrival_ns", "arrival_wall_ns", "api", "model", "stream", "status",
                "first_ns", "first_wall_ns", "last_ns", "last_wall_ns", "end_ns", "end_wall_ns", "tokens_seen",
                "counts", "outcome", "error", "response_bytes", "recorder_error", "extra")


def test_frames_survive_being_cut_anywhere():
    msgs = [("hello", 42), ([(1, "POST", "/completion", None, 5, 6, "llamacpp", "m", True)], [], [(1, 7, 3, -1)], [],
                            (0, 0, 0), [], 8), ("beat", 9, [1], (0, 0, 0))]
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

        def on_start(self, trace):
            self.started.append(trace)

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
    assert by_tag["503"].status == 503
    assert n_replayed < n_events  # coalescing happened: fewer records than the proxy's token events
    assert workers.active == 0


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
    assert shipper.dropped >= 3  # start, first token, end at least: counted, as recorder failures upstream


# --- the daemon with worker processes ------------------------------------------------------------------


def _workers(pid: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(pid).children() if "powerprof.daemon.workers" in " ".join(c.cmdline())]


@pytest.mark.slow
def test_workers_pass_bytes_unchanged_and_the_one_ledger_books_every_request(tmp_path, monkeypatch):
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer
    from powerprof.workload.stream import StreamParser
    from test_daemon_e2e import ByteTap, _traffic

    tap = ByteTap(monkeypatch)
    with SimServer(nvml=SimNVML("seed-16g", state_path=None), n_slots=64) as srv:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", srv.url, "--flush-interval", "0.5",
                       "--interval", "0.25", env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
        try:
            procs = _workers(d.proc.pid)
            assert len(procs) == 2, d.output()
            wall0 = time.time_ns()
            results = asyncio.run(asyncio.wait_for(_traffic(d.info["proxy"], 64), 120))
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
            cut_count += len(body) < len(sent)
    reqs = read_dataset(tmp_path / "data", "requests")
    assert len(reqs) == 64 and reqs["request_id"].is_unique, reqs[["request_id", "tag", "outcome"]]
    assert (reqs["outcome"] == "client_disconnected").sum() == cut_count
    assert set(reqs["tag"]) == {"team0", "team1", "team2"}
    # Token counts as the full parser reads the bytes the server sent, for every whole streamed response.
    from test_daemon_e2e import APIS

    for i, _status, _ctype, body, _cut in results:
        path, make = APIS[i % len(APIS)]
        if make(1).get("stream") and body == bytes(tap.sent[f"n{i}"]):
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
                async with s.post(url + "/completion", json={"prompt": "p" * 20, "n_predict": tokens, "stream": True},
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
    from powerprof.daemon.proxy import RequestTrace

    tr = RequestTrace(request_id=7, method="POST", endpoint="/completion", tag="slow", arrival_ns=10, arrival_wall_ns=20)
    tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome = 30, 40, 408, "client_timeout"
    rec = Rec()
    workers = ProxyWorkers(1, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={},
                           header_timeout_s=10, idle_timeout_s=10)
    (msg,) = Unframer().feed(frame(([], [], [], [_end_record(tr)], (0, 0, 0), [], 0)))
    workers._replay(workers.workers[0], msg)
    (got,) = rec.ended
    assert (got.tag, got.status, got.outcome, got.arrival_ns, got.end_ns) == ("slow", 408, "client_timeout", 10, 30)
    assert workers.active == 0


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
    import json

    d = DaemonProc(tmp_path / "data", "--simulate", "--flush-interval", "5",
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": "2"})
    procs = _workers(d.proc.pid)
    body = json.dumps({"prompt": "long", "n_predict": 5000, "ignore_eos": True, "stream": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request(d.info["proxy"] + "/completion", data=body, method="POST"),
                               timeout=30)
    r.read1(200)  # the stream is flowing
    t0 = time.monotonic()
    rc = d.stop()
    assert rc == 0 and time.monotonic() - t0 < 15, d.output()
    _gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive
    reqs = read_dataset(tmp_path / "data", "requests")  # the worker's last records reached the ledger
    assert list(reqs["outcome"]) == ["interrupted"] and reqs["generated_tokens"].iloc[0] > 0
    assert reqs["error"].isna().all()  # cut by the stop, not by a worker's death
