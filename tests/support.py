"""Small things many tests need: a free loopback port, a real-server package that CI may not skip, the
simulated GPU's power limit as another process left it, and a sweep stopped before its first level."""

from __future__ import annotations

import importlib
import os
import random
import socket
from dataclasses import dataclass

import pytest

from powerprof.sweep import UI


# Ports handed out below the kernel's ephemeral range (where it leaves room): a server a test starts on its port
# later (its address given to the daemon first) found it taken meanwhile by another process's outgoing connection,
# the range's ports being those the kernel hands out (EADDRINUSE at the bind in a fresh-clone run, session 52).
_LOW_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a server a test may start on it later."""
    top = _ephemeral_low()
    for _ in range(50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(_LOW_PORTS_FROM, top) if top > _LOW_PORTS_FROM + 100 else 0))
            except OSError:
                continue  # in use, or in TIME_WAIT: another
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_package(module: str, what: str):
    """Import `module` for a real-server test: a skip saying why where it is missing, a failure under CI.

    CI installs the test extra, so a missing package there means a failed build, which must fail
    the run rather than skip the only tests against real servers (tests/test_real_server_gate.py)."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{what} is not installed (it is in the test extra); "
                                              "with CI=true this is a failure, not a skip")


def sim_limit_w(profile: str = "seed-16g", index: int = 0) -> float:
    """The simulated GPU's power limit (W) as the shared simulator state holds it now: what a
    command in another process set, or put back."""
    from powerprof.sim.nvml import SimNVML

    sim = SimNVML(profile)
    sim.nvmlInit()
    return sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(index)) / 1000


def true_window_energy_j(gpu, rec) -> float:
    """The simulated GPU's true energy (J) over the window a request's figures were measured on: its timing's edges
    (powerprof/arrival.py Timing t0_ns/t1_ns), which are the stream's first and last fresh reads only when it is
    stream-timed. A server-timed window (a client that read late on a loaded host, a buffering hop) hangs the
    server's decode time on one end; its tokens (the row's decode_tokens) are the server's count. Truth taken over
    the stream's reads instead came out 5.5% low in a loaded full-suite run, and 0 J behind a buffering hop."""
    return gpu.true_energy_at_j(rec.timing.t1_ns) - gpu.true_energy_at_j(rec.timing.t0_ns)


def true_batch_figures(truth: list[dict], step_ns: int = 100_000) -> tuple[float, float]:
    """What a concurrent batch's streams (their SimServer truth rows) delivered, from the server's own record and
    independent of powerprof.windows: (decode tok/s, streams decoding at once on average) over the instants where
    one decodes ([first emission, last]) and none is in prefill ([arrival, first emission)), on a 0.1 ms grid.
    The tokens are each stream's emissions after its first (which came out of prefill) at such an instant."""
    import numpy as np

    arrive = np.array([t["t_arrive_ns"] for t in truth])
    first = np.array([t["emissions"][0][0] for t in truth])
    last = np.array([t["emissions"][-1][0] for t in truth])

    def state(at):
        at = np.asarray(at)[:, None]
        decoding = ((first <= at) & (at <= last)).sum(axis=1)
        return decoding, (decoding > 0) & ~((arrive <= at) & (at < first)).any(axis=1)

    decoding, measured = state(np.arange(first.min(), last.max(), step_ns))
    em = np.array([(te, n) for t in truth for te, n in t["emissions"][1:]]).reshape(-1, 2)
    tokens = float(em[state(em[:, 0])[1], 1].sum())
    return tokens / (measured.sum() * step_ns / 1e9), float(decoding[measured].mean())


class _CtrlC(UI):
    """A sweep UI that presses Ctrl-C in the idle baseline, or once the first level has measured a request."""

    def __init__(self, when: str):
        self.when = when

    def idle(self, seconds):
        if self.when == "idle":
            raise KeyboardInterrupt

    def level_progress(self, visit, live):
        if self.when == "first-level" and visit.n_measured >= 1:
            raise KeyboardInterrupt

    def level_start(self, i, n, visit, unit): ...
    def level_done(self, visit, live): ...
    def note(self, text): ...


def stopped_before_first_level(out, when: str = "idle"):
    """A simulated sweep's run directory, Ctrl-C'd before its first level ended (`when`: "idle", in the
    idle baseline, tables with nothing measured; "first-level", with part of its first level measured)."""
    from powerprof.rig import Rig
    from powerprof.sweep import run_sweep

    with Rig("seed-16g") as rig:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(rig, levels_spec="180,300", out_dir=out, idle_s=1, ui=_CtrlC(when), warmup_requests=1,
                      command_line="powerprof sweep --limits 180,300 --simulate")
    return out


def ctrl_c_once_the_gpus_are_back(monkeypatch) -> None:
    """Ctrl-C at the sampler's "restored" read: after the last level, as the GPUs are put back."""
    from powerprof.collectors import sampler

    real = sampler.Sampler.sample_now

    def ctrl_c_once_restored(self, label=None, sources=None):
        if label == "restored":
            raise KeyboardInterrupt
        return real(self, label, sources)

    monkeypatch.setattr(sampler.Sampler, "sample_now", ctrl_c_once_restored)



def connection_behaviour(port: int, stream_path: str = "/completion", stream_body: dict | None = None) -> dict:
    """How a server on loopback `port` handles its HTTP connections, as a client on the wire sees them: the
    connection headers of a streamed answer, of a non-streamed one (GET /health) and of a 404, and after each
    whether the connection still answers a second request (`kept_after_*`). The simulator is checked against
    the real llama-server with it (tests/test_sim_server.py, tests/test_real_llama_server.py)."""
    import json
    import re

    body = json.dumps(stream_body or {"prompt": "the power", "n_predict": 8, "max_tokens": 8, "stream": True}).encode()
    stream_req = (f"POST {stream_path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    get_req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    def whole(out: bytes) -> bool:
        head, sep, rest = out.partition(b"\r\n\r\n")
        if not sep:
            return False
        m = re.search(rb"(?i)content-length: (\d+)", head)
        return len(rest) >= int(m.group(1)) if m else rest.endswith(b"0\r\n\r\n")

    def answer(sock, req: bytes) -> dict | None:
        """The connection headers of the answer to `req`; None when the connection closed (or was reset) unanswered."""
        out = b""
        try:
            sock.sendall(req)
            sock.settimeout(10)
            while not whole(out):
                d = sock.recv(65536)
                if not d:
                    break
                out += d
        except (ConnectionResetError, BrokenPipeError):
            pass
        return _conn_headers(out) if out else None

    out: dict = {}
    for name, req in (("stream", stream_req), ("json", get_req), ("404", b"GET /no-such-path HTTP/1.1\r\nHost: x\r\n\r\n")):
        with socket.create_connection(("127.0.0.1", port)) as s:
            out[f"{name}_headers"] = answer(s, req)
            out[f"kept_after_{name}"] = answer(s, get_req) is not None
    return out


def _conn_headers(raw: bytes) -> dict:
    """The status and the connection-management headers of an HTTP answer's head (lower-case names)."""
    lines = raw.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    out = {"status": lines[0].split(" ")[1] if len(lines[0].split(" ")) > 1 else None}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() in ("connection", "keep-alive"):
            out[k.strip().lower()] = v.strip()
    return out


def idle_close_s(port: int, limit_s: float = 15.0) -> float | None:
    """Seconds until the server closes a connection that stays idle after one answer; None: still open after limit_s."""
    import time

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        t0 = None
        s.settimeout(limit_s)
        while True:
            try:
                d = s.recv(65536)
            except socket.timeout:
                return None
            if not d:
                return time.monotonic() - t0
            if t0 is None:
                t0 = time.monotonic()  # the answer's arrival: the idle time starts here


def busy_sim_server(monkeypatch, max_tokens: int = 24) -> None:
    """Every simulated server a Rig starts from now on has another client sending it requests from its start:
    others' work beside the whole run (sim/bystander.py)."""
    import powerprof.rig as rigmod

    real = rigmod.Rig.sim_server

    def busy_server(self, **kw):
        srv = real(self, **kw)
        start = srv.start

        def start_busy():
            start()
            self.sim_bystander_client(srv.url, max_tokens=max_tokens)
            return srv

        srv.start = start_busy
        return srv

    monkeypatch.setattr(rigmod.Rig, "sim_server", busy_server)


def side_by_side(request, jobs: dict, max_processes: int | None = None) -> dict:
    """Start independent real-time scenarios at once, each in a process of its own: {name: (fn, args, kwargs)} →
    {name: Future}; only the jobs whose name a selected test of the calling module asks for, as a fixture or as a
    parameter's value. max_processes: how many run at once (default: all).

    For a module whose fixtures each replay a trace in real time through a simulated server and the daemon (about a
    tenth of a core each): one after the other they took the sum of their times (test_attribution_mixed.py 175 s),
    side by side the longest one's. Each keeps a process, an event loop and a GIL of its own, as it had alone;
    `fn` and what it returns must pickle (a module-level function). The pool closes with the module. A failed
    test's retry runs only the jobs it and the tests after it ask for."""
    import concurrent.futures as cf
    import multiprocessing as mp

    wanted = set()
    items = request.session.items
    retry = getattr(request.session, "powerprof_retry", None)  # a failed test's fresh try (tests/conftest.py)
    if retry is not None and retry.module is request.module:
        items = items[items.index(retry):]  # those before it have run
    for item in items:
        if item.module is request.module:
            wanted.update(item.fixturenames)
            wanted.update(str(v) for v in getattr(getattr(item, "callspec", None), "params", {}).values())
    todo = {name: job for name, job in jobs.items() if name in wanted}
    if not todo:
        return {}
    # spawn, not fork: the pytest process has threads (a fork copies their locks in whatever state they are).
    pool = cf.ProcessPoolExecutor(max_workers=min(len(todo), max_processes or len(todo)), mp_context=mp.get_context("spawn"))
    request.addfinalizer(lambda: pool.shutdown(wait=True, cancel_futures=True))
    return {name: pool.submit(fn, *args, **kwargs) for name, (fn, args, kwargs) in todo.items()}


def systemd_exposure(unit_text: str, name: str, tmp_path) -> float:
    """`systemd-analyze security --offline`'s overall exposure for a unit file (skips, saying why, where it cannot)."""
    import re
    import subprocess

    unit = tmp_path / name
    unit.write_text(unit_text)
    p = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True,
                       timeout=120)
    m = re.search(rf"Overall exposure level for {re.escape(name)}: (\d+\.\d+)", p.stdout + p.stderr)
    if m is None and "offline" in (p.stderr or ""):
        pytest.skip(f"this systemd-analyze cannot check a unit file offline: {p.stderr.strip()[:200]}")
    assert m, p.stdout + p.stderr
    return float(m.group(1))


def json_shape(obj):
    """A JSON value's shape: a dict's keys with their values' shapes, null as None, anything else its type's name.
    What a server's answer promises a parser (which keys, null or absent), its figures left out."""
    if isinstance(obj, dict):
        return {k: json_shape(v) for k, v in obj.items()}
    return None if obj is None else type(obj).__name__


def openai_usages(base: str, api: str, stream: bool, prompt: str, max_tokens: int = 4) -> dict:
    """The usage of one OpenAI-style answer (a stream's usage chunk, include_usage asked), greedy, EOS ignored."""
    import json
    import urllib.request

    path = "/v1/chat/completions" if api == "openai-chat" else "/v1/completions"
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": prompt}]} if api == "openai-chat" else {"prompt": prompt})
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    raw = urllib.request.urlopen(req, timeout=300).read().decode()
    if not stream:
        return json.loads(raw)["usage"]
    docs = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    (usage,) = [d["usage"] for d in docs if d.get("usage")]
    return usage


@dataclass
class LedgerReading:
    """The fields of a GpuReading the daemon's ledger uses (ledger tests feed it these)."""
    energy_j: float | None
    power_w: float | None = 200.0
    power_avg_w: float | None = None
    power_limit_w: float | None = None


class RowSink:
    """The ledger's `emit`: every row it writes, by dataset."""

    def __init__(self):
        self.rows = {"requests": [], "intervals": [], "tags": [], "costs": []}

    def __call__(self, name, rows):
        self.rows[name].extend(rows)


def _due(holder, sample, lag_s: float) -> list:
    """`sample` joins `holder`'s held-back samples; those now `lag_s` old leave, in the order read (under the caller's lock)."""
    import time

    pending = holder.__dict__.setdefault("_lag_pending", [])
    pending.append(sample)
    cut = time.monotonic_ns() - int(lag_s * 1e9)
    n = next((k for k, s in enumerate(pending) if s.t_mono_ns > cut), len(pending))
    due, pending[:] = pending[:n], pending[n:]
    return due


def lagging_timeline(monkeypatch, lag_s: float) -> None:
    """Every `storage.samples.Timeline` `lag_s` behind the GPU, as a sampler thread starved on a loaded host delivers
    its readings: each sample keeps the time it was read, but reaches the timeline (its `samples()`, its tags, what
    it stores) only at the first delivery after it is `lag_s` old, in the order read. Deliveries happen when a later
    sample comes (the sampler's next tick): a deterministic stand-in, no thread of its own."""
    from powerprof.storage.samples import Timeline

    deliver = Timeline.__call__

    def call(self, sample):
        with self._lock:
            due = _due(self, sample, lag_s)
        for s in due:
            deliver(self, s)

    monkeypatch.setattr(Timeline, "__call__", call)


def lagging_daemon(monkeypatch, lag_s: float) -> None:
    """The daemon's samples `lag_s` behind the GPU, as `lagging_timeline`: each reaches the daemon's queue only at the
    first sample after it is `lag_s` old, in the order read."""
    import threading

    from powerprof.daemon.service import Daemon

    deliver = Daemon._on_sample
    lock = threading.Lock()

    def on_sample(self, sample):
        with lock:
            for s in _due(self, sample, lag_s):
                deliver(self, s)

    monkeypatch.setattr(Daemon, "_on_sample", on_sample)


def eio_on_replace_to(monkeypatch, suffix: str) -> None:
    """Every os.replace by powerprof.storage.atomic onto a path ending in `suffix` fails with EIO (a disk's error part
    way through a group's renames); the others go through."""
    import errno  # noqa: PLC0415

    import powerprof.storage.atomic as atomic  # noqa: PLC0415

    real = os.replace

    def replace(src, dst):
        if str(dst).endswith(suffix):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
