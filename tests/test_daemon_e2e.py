"""The daemon as a real subprocess on the simulator with the simulated server behind its proxy."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pandas as pd
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import DaemonProc, open_long_stream, read_dataset, sim_env
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile
from powerprof.sim.server import SimServer

pytestmark = pytest.mark.slow

APIS = [
    ("/completion", lambda n: {"prompt": "p" * 40, "n_predict": n, "stream": True}),
    ("/v1/completions", lambda n: {"prompt": "q" * 60, "max_tokens": n, "stream": True,
                                   "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", lambda n: {"messages": [{"role": "user", "content": "r" * 30}], "max_tokens": n,
                                        "stream": True}),
    ("/v1/chat/completions", lambda n: {"messages": [{"role": "user", "content": "s" * 30}], "max_tokens": n}),
]


class ByteTap:
    """Records every byte the simulated server (running in this process) writes, per X-Sim-Nonce."""

    def __init__(self, monkeypatch):
        self.sent: dict[str, bytearray] = {}
        self.ended: set[str] = set()  # nonces whose response the server has begun to end (write_eof called)
        tap = self
        orig_write, orig_eof = web.StreamResponse.write, web.StreamResponse.write_eof

        async def write(resp, data):
            tap._note(resp, data)
            return await orig_write(resp, data)

        async def write_eof(resp, data=b""):
            req = getattr(resp, "_req", None)
            if req is not None and req.headers.get("X-Sim-Nonce"):
                tap.ended.add(req.headers["X-Sim-Nonce"])
            if data and not resp._eof_sent:
                tap._note(resp, data)
            return await orig_eof(resp, data)

        monkeypatch.setattr(web.StreamResponse, "write", write)
        monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)

    def _note(self, resp, data) -> None:
        req = getattr(resp, "_req", None)
        nonce = req.headers.get("X-Sim-Nonce") if req is not None else None
        if nonce:
            self.sent.setdefault(nonce, bytearray()).extend(bytes(data))


async def _traffic(proxy: str, n: int, seed: int = 7, cut_share: float = 0.25, tokens=(40, 120), tap=None):
    """Requests through the proxy, a share cut by their client at a byte count. With `tap`, a client cuts only while
    the server is still sending: one that reached its cut point after the server ended its response reads the rest.
    Such a cut could not be a disconnect: the proxy may already have handed the client's connection every byte,
    the server's work complete and delivered, and the client's closing over bytes its kernel holds unread is
    nothing a server sees (any HTTP server logs that response as sent whole). Its row then says `ok` (the truth of
    what the proxy did) while the client read less than was sent: the count of cuts was 15 against 14 rows on a
    loaded machine. A client that leaves while the server still sends leaves bytes the proxy must still forward,
    and its next write finds the connection gone: `client_disconnected`, exactly."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        path, body = APIS[i % len(APIS)]
        cut = rng.random() < cut_share and body(1).get("stream")
        plans.append((i, path, body(rng.randint(*tokens)), rng.randint(200, 2000) if cut else None))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i, path, body, cut):
            headers = {"X-Sim-Nonce": f"n{i}", "X-Powerprof-Tag": f"team{i % 3}"}
            r = await s.post(proxy + path, json=body, headers=headers)
            status, ctype = r.status, r.headers.get("Content-Type")
            if cut is None:
                data = await r.read()
            else:
                data = b""
                while len(data) < cut:
                    chunk = await r.content.readany()
                    if not chunk:
                        break
                    data += chunk
                if tap is not None and f"n{i}" in tap.ended:
                    data += await r.read()  # the server was done: too late to be a disconnect the proxy can see
                else:
                    r.close()  # the client goes away mid-stream (no await between the check and the close)
            return i, status, ctype, data, cut

        return await asyncio.gather(*(one(*p) for p in plans))


def cut_while_sending(tap: ByteTap, i: int, body: bytes, cut: int | None) -> bool:
    """Whether request i's client left while the server was still at it (what the proxy sees as a disconnect): it
    read less than the server sent, or the server never ended the response. The simulated server aborts a request
    whose client left, as the real ones do (docs/simulator.md, "A client that leaves"): one whose client had read
    every byte sent so far may never be written to again, its bytes equal and its response never ended."""
    sent = bytes(tap.sent[f"n{i}"])
    return cut is not None and (len(body) < len(sent) or f"n{i}" not in tap.ended)


def test_proxy_is_byte_transparent_under_64_streams_with_disconnects(tmp_path, monkeypatch):
    tap = ByteTap(monkeypatch)
    with SimServer(nvml=SimNVML("seed-16g", state_path=None), n_slots=64) as srv:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", srv.url, "--flush-interval", "0.5",
                       env=sim_env(tmp_path))
        try:
            results = asyncio.run(asyncio.wait_for(_traffic(d.info["proxy"], 64, tap=tap), 120))
            time.sleep(0.3)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    cut_count = 0
    for i, status, ctype, body, cut in results:
        assert status == 200
        sent = bytes(tap.sent[f"n{i}"])
        if cut is None:
            assert body == sent, f"request {i}: bytes through the proxy differ from what the server sent"
        else:
            assert sent.startswith(body)
            cut_count += cut_while_sending(tap, i, body, cut)  # (a stream shorter than its cut point was read whole)
    assert cut_count >= 5
    reqs = read_dataset(tmp_path / "data", "requests")
    # SIGTERM lost nothing: every request is there, once, with what the stream said.
    assert len(reqs) == 64 and reqs["request_id"].is_unique
    assert (reqs["outcome"] == "client_disconnected").sum() == cut_count
    ok = reqs[reqs["outcome"] == "ok"]
    assert (ok["generated_tokens"] > 0).all() and ok["model"].notna().all()
    assert set(reqs["tag"]) == {"team0", "team1", "team2"}


def test_energy_of_requests_idle_and_unproxied_adds_up_to_the_measured_total(tmp_path):
    data = tmp_path / "data"
    d = DaemonProc(data, "--simulate", "seed-16g", "--sim-gpus", "2", "--interval", "0.25", "--flush-interval", "0.5",
                   env=sim_env(tmp_path))
    try:
        sock = d.info["tags"]
        tag = [sys.executable, "-m", "powerprof.cli", "tag"]
        subprocess.run(tag + ["start", "burst", "--socket", sock], check=True, capture_output=True, timeout=30)
        asyncio.run(asyncio.wait_for(_traffic(d.info["proxy"], 32, seed=3, cut_share=0.1, tokens=(60, 150)), 120))
        stop = subprocess.run(tag + ["stop", "burst", "--socket", sock], check=True, capture_output=True, text=True,
                              timeout=30)
        assert re.search(r"tag burst: [\d.]+ s, GPU [\d.]+ J", stop.stdout)
        time.sleep(0.6)
        metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    # Footprint (docs/daemon.md): after traffic, attribution and Parquet flushes, none of the heavy libraries
    # that only analysis uses is loaded (scipy.optimize alone is ~40 MiB resident, pandas ~45 MiB), nor
    # pyarrow (~45 MiB: flushes use storage/flatparquet.py, compaction a child process).
    loaded = {m.group(1) for m in re.finditer(r"site-packages/([A-Za-z_]+)", maps)}
    assert not loaded & {"scipy", "pandas", "duckdb", "matplotlib", "pyarrow"}, sorted(loaded)

    for name in ("powerprof_gpu_power_watts", "powerprof_gpu_energy_joules_total", "powerprof_gpu_sm_clock_hertz",
                 "powerprof_gpu_mem_clock_hertz", "powerprof_gpu_power_limit_watts", "powerprof_tokens_generated_total",
                 "powerprof_joules_per_token", "powerprof_requests_total", "powerprof_cpu_energy_joules_total",
                 "process_resident_memory_bytes", "process_cpu_seconds_total"):
        assert name in metrics, name
    assert 'tag="team1"' in metrics and "request_id" not in metrics
    assert re.search(r'powerprof_build_info\{[^}]*simulated="true"', metrics), metrics[-600:]
    assert "simulated GPU and simulated server (seed-16g)" in d.output()  # said at start, where the operator looks
    # What reading the sensors costs the daemon is on /metrics, per source (docs/daemon.md).
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    reads = {x.labels["source"]: x.value for x in fams["powerprof_sample_reads"].samples if x.name.endswith("_total")}
    cpu = {x.labels["source"]: x.value for x in fams["powerprof_sample_read_cpu_seconds"].samples if x.name.endswith("_total")}
    assert reads["nvml"] >= 2 and reads["rapl"] >= 2 and 0 < cpu["nvml"] < reads["nvml"] * 0.5, (reads, cpu)
    assert "powerprof_edge_read_cpu_seconds_total" in metrics

    reqs = read_dataset(data, "requests")
    intervals = read_dataset(data, "intervals")
    samples = read_dataset(data, "samples")
    tags = read_dataset(data, "tags")
    assert len(reqs) == 32
    # Every row says it is the simulator's: synced into a fleet's folder, a simulated host's rows read as real
    # (session 46's walkthrough: host "vm", a real-looking GPU UUID, no file metadata).
    for t in (reqs, intervals, samples, tags):
        assert t["simulated"].eq(True).all() and len(t), t.columns
    # Every request, interval and tag row says which GPUs the daemon sampled: rows of another GPU set (another
    # daemon.gpus, a second daemon) are then told apart by `analyze`, not blended.
    for t in (reqs, intervals, tags):
        (got,) = set(t["gpu_uuids"])
        assert got.split(",") == sorted(got.split(",")) and len(got.split(",")) == 2, got
    costs = read_dataset(data, "costs")  # a fit of the work model: rows only once it has enough intervals
    assert costs is None or costs.empty or costs["simulated"].eq(True).all()
    # A fit says its GPU set too, the same as the other rows': joined to them, it is told apart from another set's.
    assert costs is None or costs.empty or set(costs["gpu_uuids"]) == set(reqs["gpu_uuids"]), costs.get("gpu_uuids")
    # Energy: requests + idle + unproxied = the total the GPU counters measured.
    gpu = samples[samples["source"] == "nvml"]
    measured = sum(g["energy_j"].max() - g["energy_j"].min() for _, g in gpu.groupby("gpu_index"))
    assert intervals["gpu_energy_j"].sum() == pytest.approx(measured, rel=1e-6)
    parts = intervals[["requests_energy_j", "idle_energy_j", "unproxied_energy_j"]].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(intervals["gpu_energy_j"].to_numpy(), rel=1e-9, abs=1e-9)
    rest = intervals["idle_energy_j"].sum() + intervals["unproxied_energy_j"].sum()
    assert reqs["gpu_energy_j"].sum() > 0.2 * measured
    assert reqs["gpu_energy_j"].sum() + rest == pytest.approx(measured, rel=0.01)
    # Every token the proxy saw is attributed (no prefill sink).
    assert reqs["attributed_tokens"].sum() == pytest.approx(intervals["proxy_tokens"].sum())
    assert "powerprof_gpu_energy_attributed_joules_total" in metrics
    assert reqs["cpu_energy_j"].notna().any()  # simulated RAPL is split the same way
    # The tag window covered the burst: its energy is the intervals' energy inside it, and of the one its stop call falls
    # in, up to that call (its edge is held past a counter refresh after the call, and what the GPUs drew between is
    # taken out: docs/daemon.md, "Tag windows and the counter's refresh"; its start's trim is a poll's few ms of power).
    t = tags.iloc[0]
    assert t["name"] == "burst" and t["closed_by"] == "stop" and t["proxy_tokens"] > 0
    inside = intervals[(intervals["t_start_utc"] >= t["t_start_utc"]) & (intervals["t_end_utc"] <= t["t_end_utc"])]
    last = intervals[(intervals["t_start_utc"] < t["t_end_utc"]) & (intervals["t_end_utc"] > t["t_end_utc"])]
    assert 0.995 * inside["gpu_energy_j"].sum() <= t["gpu_energy_j"], (t["gpu_energy_j"], inside["gpu_energy_j"].sum())
    # An interval row ends at a counter read, whose value is the counter's last refresh: a read between the stop call
    # and the next refresh (a sample 0.5 ms after the call) still shows the refresh before the call, so what the GPUs
    # drew from that refresh to the call is in the row after the call's, which the tag counts up to the call (its stop
    # edge's value is that next refresh's, placed back to the call, never past it). So the tag exceeds these rows by
    # up to one refresh's energy at the call (docs/data.md, daemon_tags): 0.77 J over them in 1 of 25 runs beside two
    # CPU hogs, of 0.88 J (2 GPUs idle at 22 W, a 20 ms refresh). The GPUs' power there: the most of the samples either
    # side of the call (the burst's answers were all read before `tag stop` ran: its power falls to idle, and stays).
    before, after = gpu[gpu["time_utc"] <= t["t_end_utc"]], gpu[gpu["time_utc"] > t["t_end_utc"]]
    near = pd.concat([before[before["time_utc"] == before["time_utc"].max()],
                      after[after["time_utc"] == after["time_utc"].min()]])
    refresh_j = get_profile("seed-16g").energy_counter_update_s * near.groupby("gpu_index")["power_w"].max().sum()
    assert 0 < refresh_j < 15, near  # at most 2 x 320 W over 20 ms
    assert t["gpu_energy_j"] <= inside["gpu_energy_j"].sum() + last["gpu_energy_j"].sum() + refresh_j + 1e-6, (
        t["gpu_energy_j"], inside["gpu_energy_j"].sum(), last["gpu_energy_j"].sum(), refresh_j)


def test_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[proxy]\nupstream = 'http://127.0.0.1:8080'\nlisten = 'nowhere'\n")
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "daemon", "--config", str(bad), "--simulate"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "proxy.listen" in p.stderr
    assert not (tmp_path / "state" / "powerprof" / "daemon").exists()


def test_unreachable_upstream_gives_502_and_sighup_keeps_a_good_config(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text("[daemon]\nflush_interval_s = 0.5\n")
    d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", "http://127.0.0.1:9",
                   env=sim_env(tmp_path))
    try:
        for _ in range(3):
            req = urllib.request.Request(d.info["proxy"] + "/v1/completions", data=b'{"prompt":"x"}', method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=20)
            assert e.value.code == 502 and b"unreachable" in e.value.read()
        cfg.write_text("[daemon]\nflush_interval_s = 'often'\n")
        d.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert d.proc.poll() is None
        cfg.write_text("[daemon]\nflush_interval_s = 0.25\n")
        d.signal(signal.SIGHUP)
        time.sleep(1.0)
        metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        assert "powerprof_proxy_upstream_failures_total 3.0" in metrics
    finally:
        rc = d.stop()
    out = d.output()
    assert rc == 0
    assert "new config rejected" in out and "daemon.flush_interval_s" in out
    assert "flush_interval_s=0.25" in out
    reqs = read_dataset(tmp_path / "data", "requests")
    assert list(reqs["status"]) == [502] * 3 and set(reqs["outcome"]) == {"upstream_unreachable"}


def test_a_limit_left_by_a_crashed_sweep_is_restored_at_start_and_logged(tmp_path, monkeypatch):
    from powerprof.control.restore import default_restore_path, new_record, write_json_atomic

    env = sim_env(tmp_path)
    monkeypatch.setenv("POWERPROF_SIM_STATE", env["POWERPROF_SIM_STATE"])
    nvml = SimNVML("seed-16g")  # shares the state file with the daemon's simulator
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    uuid = nvml.nvmlDeviceGetUUID(h)
    nvml.nvmlDeviceSetPowerManagementLimit(h, 180_000)  # what a killed sweep leaves behind
    rec = new_record({uuid: {"index": 0, "name": "sim", "original_limit_mw": 300_000, "default_limit_mw": 300_000,
                             "clocks_locked": False}}, {"profile": "seed-16g", "count": 1})
    path = default_restore_path([uuid])
    write_json_atomic(path, rec)
    d = DaemonProc(tmp_path / "data", "--simulate", "seed-16g", env=env)
    rc = d.stop()
    assert rc == 0
    assert "restore at start" in d.output() and "300 W" in d.output()
    assert nvml.nvmlDeviceGetPowerManagementLimit(h) == 300_000
    assert not path.exists()


def test_sigterm_mid_stream_exits_0_and_records_the_request_as_interrupted(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", "--flush-interval", "5", env=sim_env(tmp_path))
    stream = open_long_stream(d.info["proxy"])  # held open while the daemon stops
    t0 = time.monotonic()
    rc = d.stop()
    stream.close()
    assert rc == 0 and time.monotonic() - t0 < 15
    reqs = read_dataset(tmp_path / "data", "requests")  # flushed at exit although the interval is 5 s
    assert list(reqs["outcome"]) == ["interrupted"] and reqs["generated_tokens"].iloc[0] > 0


def test_sigusr1_meant_for_the_tuner_is_logged_and_ignored(tmp_path):
    # `kill -USR1 $(pidof powerprof)` can pick the daemon: its default action would end it.
    d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", "http://127.0.0.1:9", env=sim_env(tmp_path))
    try:
        d.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while "SIGUSR1 ignored" not in d.output() and time.monotonic() < deadline and d.proc.poll() is None:
            time.sleep(0.1)
        assert d.proc.poll() is None, d.output()
        assert "SIGUSR1 ignored" in d.output()
    finally:
        rc = d.stop()
    assert rc == 0
