"""What a local client, or a planted file, can do to the running daemon: each test failed on the code before its fix."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import time
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from daemon_helpers import DaemonProc, read_dataset, sim_env


def _refused(tmp_path, *args) -> str:
    """The output of a daemon that must refuse to start (one that starts anyway is stopped, and the test fails)."""
    try:
        d = DaemonProc(tmp_path, "--simulate", *args, env=sim_env(tmp_path.parent))
    except RuntimeError as e:
        return str(e)
    d.stop()
    pytest.fail(f"the daemon started with {args}")


def _metric(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url + "/metrics", timeout=30).read().decode()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.skipif(os.geteuid() != 0, reason="the rule is root's: an unprivileged daemon may use its own shared folders")
@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen"])
def test_root_binds_no_proxy_or_metrics_socket_in_a_folder_others_can_write(tmp_path, flag):
    # Before: root bound `unix:` proxy and /metrics sockets anywhere (only the tag socket was checked): in a folder
    # others can write, one of them could rename root's socket away and put their own in its place, and clients
    # would send their requests to them; a symlink planted at the name was removed and replaced.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "refusing, as root, a socket folder another user could write" in _refused(
        tmp_path / "data", flag, f"unix:{shared / 'p.sock'}")
    assert not (shared / "p.sock").exists()
    # In root's own folder, a planted symlink (or any other non-socket) at the name is refused, never followed.
    own = tmp_path / "own"
    own.mkdir()
    victim = tmp_path / "victim.sock"
    victim.write_text("precious")
    (own / "p.sock").symlink_to(victim)
    assert "exists and is not a socket" in _refused(tmp_path / "data2", flag, f"unix:{own / 'p.sock'}")
    assert (own / "p.sock").is_symlink() and victim.read_text() == "precious"


def test_a_thousand_idle_client_connections_do_not_stop_the_writer_or_metrics(tmp_path):
    # Before: under systemd's default soft limit of 1024 open files, ~1000 idle connections to the proxy (a leaky
    # client, or a benchmark at 500+ concurrent streams: each takes a client and an upstream descriptor) left the
    # daemon no descriptor to open a Parquet file (flush errors: "Too many open files") nor to answer /metrics.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit here ({hard}) leaves no room above the soft one")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # what systemd gives a service, inherited
    try:
        d = DaemonProc(tmp_path / "data", "--simulate", "--flush-interval", "0.2", env=sim_env(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096) if hard == resource.RLIM_INFINITY
                                                   else min(max(soft, 4096), hard), hard))
    socks = []
    try:
        host, port = d.info["proxy"][len("http://"):].rsplit(":", 1)
        for _ in range(1100):
            socks.append(socket.create_connection((host, int(port))))
        time.sleep(1.5)  # several flushes while they are held (the header timeout is 10 s)
        assert _metric(d.info["metrics"], "powerprof_flush_errors_total") == 0
    finally:
        for s in socks:
            s.close()
        assert d.stop() == 0
    assert "Too many open files" not in d.output()


def test_a_client_chosen_model_name_is_stored_bounded_and_marked(tmp_path):
    # Before: a request's `model` (read from its body, up to 1 MiB) went whole into its row whenever the server did not
    # name one (any error answer: vLLM's 404 for an unknown model), so a client could make each buffered row a
    # megabyte and the daemon's memory (MemoryMax=512M) run out within a flush interval.
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML

    async def not_found(_request):
        return web.json_response({"object": "error", "message": "The model does not exist.", "code": 404}, status=404)

    async def main():
        up = web.Application()
        up.router.add_route("*", "/{tail:.*}", not_found)
        runner = web.AppRunner(up)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.1, "daemon.flush_interval_s": 0.1,
            "proxy.listen": "127.0.0.1:0", "proxy.upstream": f"http://127.0.0.1:{port}", "metrics.listen": "",
            "daemon.restore_on_start": False, "scrape.server": "none"})
        d = Daemon(cfg, Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=None)))
        task = asyncio.create_task(d.run())
        for _ in range(400):
            if "proxy" in d.urls:
                break
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as s:
            for model in ("M" * 900_000, "llama-3-8b"):
                async with s.post(d.urls["proxy"] + "/v1/completions", json={"model": model, "prompt": "x"}) as r:
                    assert r.status == 404
                    await r.read()
        await asyncio.sleep(0.5)
        d.stop_event.set()
        rc = await task
        await runner.cleanup()
        return rc

    assert asyncio.run(asyncio.wait_for(main(), 120)) == 0
    reqs = read_dataset(tmp_path / "data", "requests")
    models = sorted(reqs["model"], key=len)
    assert models[0] == "llama-3-8b"  # a real name is kept whole
    long = models[1]
    assert len(long) <= 300 and long.startswith("M" * 100)
    assert "900000 characters" in long  # visibly cut, with the length it had


def test_malformed_requests_are_logged_in_one_line_each_and_rate_limited(tmp_path):
    # Before: every malformed request (a smuggling attempt with Content-Length and Transfer-Encoding, a duplicate
    # Content-Length, an obs-fold, a control character in a header) was logged at ERROR with a 10-line traceback: a
    # local client could flood the journal until its rate limit dropped the daemon's own lines.
    d = DaemonProc(tmp_path / "data", "--simulate", env=sim_env(tmp_path))
    host, port = d.info["proxy"][len("http://"):].rsplit(":", 1)
    bad = [
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
        b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Powerprof-Tag: a\x1b[31mred\r\n\r\n",
    ]
    try:
        for i in range(200):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(bad[i % len(bad)])
                s.settimeout(30)
                assert s.recv(12)[8:] == b" 400"  # each still gets its 400
        assert urllib.request.urlopen(d.info["proxy"] + "/health", timeout=30).status == 200
    finally:
        assert d.stop() == 0
    out = d.output()
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "malformed request" in line]
    assert 1 <= len(lines) <= 10, lines
    assert "Transfer-Encoding can't be present with Content-Length" in lines[0]
    assert "\x1b" not in out  # a client's bytes never reach a terminal raw


@pytest.mark.parametrize("workers", [1, 2])
def test_malformed_requests_are_counted_on_metrics(tmp_path, workers):
    # Before: a malformed request was seen only in the log, whose lines are rate-limited (the first 5, then every
    # 1000th): /metrics had no count, so an alert on a client sending them, or a count of how many, was impossible.
    env = {**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": str(workers)}
    d = DaemonProc(tmp_path / "data", "--simulate", env=env)
    host, port = d.info["proxy"][len("http://"):].rsplit(":", 1)
    bad = (b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n")
    try:
        assert _metric(d.info["metrics"], "powerprof_proxy_malformed_requests_total") == 0
        for i in range(12):  # more than the 5 lines the log shows
            with socket.create_connection((host, int(port))) as s:
                s.sendall(bad[i % 2])
                s.settimeout(30)
                assert s.recv(12)[8:] == b" 400"
        assert urllib.request.urlopen(d.info["proxy"] + "/health", timeout=30).status == 200  # a good one is not counted
        deadline = time.monotonic() + 30  # the snapshot is renewed each tick, a worker's counts come with its heartbeat
        while (n := _metric(d.info["metrics"], "powerprof_proxy_malformed_requests_total")) < 12 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert n == 12
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_trickled_request_body_is_cut_by_the_configured_rate_and_counted(tmp_path, workers):
    # A chunked body trickled a byte at a time, never silent for proxy.body_timeout_s, held its upstream connection
    # for as long as the client liked; now proxy.body_min_bytes_per_s (from the environment here) cuts it, counted.
    env = {**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": str(workers), "POWERPROF_PROXY_BODY_TIMEOUT_S": "0.5",
           "POWERPROF_PROXY_BODY_MIN_BYTES_PER_S": "100"}
    d = DaemonProc(tmp_path / "data", "--simulate", env=env)
    host, port = d.info["proxy"][len("http://"):].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            s.settimeout(0.2)
            out = b""
            for _ in range(100):  # 20 s of a byte every 0.2 s at most
                try:
                    s.sendall(b"1\r\n{\r\n")
                    out += s.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    break
                if b"\r\n\r\n" in out:
                    break
        assert out.startswith(b"HTTP/1.1 408") and b"slower than 100 bytes/s" in out, out
        deadline = time.monotonic() + 30
        name = 'powerprof_proxy_body_timeouts_total{rule="slow"}'
        while (n := _metric(d.info["metrics"], name)) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert n == 1
        assert _metric(d.info["metrics"], 'powerprof_proxy_body_timeouts_total{rule="silent"}') == 0
    finally:
        assert d.stop() == 0
