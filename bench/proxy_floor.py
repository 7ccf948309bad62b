"""The floor under the proxy's CPU per token: a bare TCP relay next to the proxy alone, user and system time apart.

    .venv/bin/python bench/proxy_floor.py [--streams 64] [--rounds 2] [--tokens 8,32,128] [--kinds bare,proxy,worker,nginx]
                                          [--gap-ms 2] [--staggered] [--requests-per-stream 8] [--baseline TREE]
                                          [--api llamacpp|sglang|chat|completions|messages]

The upstream of bench/proxy_latency.py (SSE events 2 ms apart, one chunk each, 8/32/128 per
response; `--gap-ms 25 --streams 256 --staggered`: the GPU-like pace, each stream's first request
at a random phase of one response's duration, where nearly every chunk is its own wake-up) in one
process; in another, either a bare relay (uvloop protocols: each read written to the other side,
no HTTP, no parsing), `Proxy` with a null recorder (no ledger), or a proxy worker as
`proxy.workers > 1` runs it (`WorkerProxy` with its shipping recorder, the records written to a
socket that this process reads and discards: the daemon's replay is not counted), or nginx
(`nginx`, bench/_nginx.py: one worker process, `proxy_buffering off`, keep-alive upstream; the
native yardstick, skipped with a message where nginx is not installed); the load generator in a
third. `--baseline TREE` adds `base`: the `Proxy` of another source tree under the same load. `--api sglang`: the
upstream speaks SGLang's /generate (each event repeats the text and output_ids so far), not llama.cpp's /completion.
CPU per chunk (tokens + 1 per response) from the relay process's /proc schedstat, split into user
and system time from /proc/<pid>/stat (clock ticks: read over seconds, not per request). The bare
relay's system time is what the kernel charges for one recv and one send per chunk on this
machine; no forwarder in one process gets below it with one chunk per token. A straight line
through the proxy's CPU per response against chunks per response splits it into a cost per chunk
and a cost per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import proxy_latency as pl  # bench/ is on sys.path when a bench runs
from _nginx import start_nginx


def relay_main(up_port: int, port_file: str, kind: str) -> None:
    import uvloop

    async def run():
        loop = asyncio.get_running_loop()
        if kind == "bare":
            class Up(asyncio.Protocol):
                def __init__(self, down):
                    self.down = down

                def connection_made(self, t):
                    self.t = t

                def data_received(self, d):
                    self.down.t.write(d)

                def connection_lost(self, e):
                    self.down.t.close()

            class Down(asyncio.Protocol):
                def connection_made(self, t):
                    self.t, self.up, self.early = t, None, []
                    loop.create_task(self.connect())

                async def connect(self):
                    _, self.up = await loop.create_connection(lambda: Up(self), "127.0.0.1", up_port)
                    for b in self.early:
                        self.up.t.write(b)

                def data_received(self, d):
                    if self.up is None:
                        self.early.append(d)
                    else:
                        self.up.t.write(d)

                def connection_lost(self, e):
                    if self.up is not None:
                        self.up.t.close()

            srv = await loop.create_server(Down, "127.0.0.1", 0, backlog=1024)
            port = srv.sockets[0].getsockname()[1]
        else:
            from aiohttp import web

            from powerprof.daemon.proxy import Proxy

            proxy = Proxy(f"http://127.0.0.1:{up_port}")
            if kind == "worker":
                import socket

                from powerprof.daemon.workers import ShippingRecorder, WorkerProxy

                shipper = ShippingRecorder(4)
                shipper.transport, _ = await loop.create_unix_connection(
                    asyncio.Protocol, sock=socket.socket(fileno=int(os.environ["POWERPROF_FLOOR_FD"])))
                proxy = WorkerProxy(f"http://127.0.0.1:{up_port}", recorder=shipper)
                shipper.proxy, shipper.active = proxy, lambda: proxy.active
            runner = web.AppRunner(proxy.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
            port = runner.addresses[0][1]
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    uvloop.run(run())


def _user_sys_ticks(meter: "pl.CpuMeter") -> tuple[int, int]:
    """User and system clock ticks of the relay's process and its children (nginx: master and worker)."""
    user = system = 0
    for pid in meter.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user, system


def _drain(sock, count: list) -> None:
    while data := sock.recv(1 << 16):
        count[0] += len(data)


def _wait_port(path: Path) -> int:
    for _ in range(600):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise SystemExit(f"no port in {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=8)
    ap.add_argument("--gap-ms", type=float, default=2.0, help="time between a response's tokens (25: GPU-like)")
    ap.add_argument("--staggered", action="store_true",
                    help="each stream's first request at a random phase of one response's duration")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", default="8,32,128", help="tokens per response, one case each")
    ap.add_argument("--kinds", default="bare,proxy,worker", help="relays to measure: bare, proxy, worker, nginx")
    ap.add_argument("--api", default="llamacpp", choices=pl.APIS,
                    help="the upstream's dialect: llamacpp (/completion), sglang (/generate), or vLLM's chat, "
                         "completions or messages (/v1/chat/completions, /v1/completions, /v1/messages)")
    ap.add_argument("--baseline", metavar="TREE",
                    help="also `base`: the `Proxy` of another source tree (a git worktree of main, say), same load")
    a = ap.parse_args()
    kinds = a.kinds.split(",") + (["base"] if a.baseline and "base" not in a.kinds.split(",") else [])
    if "base" in kinds and not a.baseline:
        raise SystemExit("kind base needs --baseline TREE")
    tmp = Path(tempfile.mkdtemp(prefix="powerprof-floor-"))
    procs = [subprocess.Popen([sys.executable, pl.__file__, "--upstream", str(tmp / "up")])]
    hz = os.sysconf("SC_CLK_TCK")
    shipped = [0]  # record bytes the worker relay sent
    try:
        up_port = _wait_port(tmp / "up")
        print(f"{a.streams} streams ({a.api}), {a.requests_per_stream} requests per stream, tokens {a.gap_ms:g} ms apart"
              f"{', staggered starts' if a.staggered else ''}; CPU per chunk of the relaying process (best of {a.rounds})")
        print("relay  tokens  total_us  user_us  sys_us   tok_s")
        per_response = {}
        for kind in kinds:
            fds, env = (), None
            if kind == "worker":
                ours, theirs = socket.socketpair()
                fds, env = (theirs.fileno(),), {**os.environ, "POWERPROF_FLOOR_FD": str(theirs.fileno())}
                threading.Thread(target=_drain, args=(ours, shipped), daemon=True).start()
            if kind == "nginx":
                started = start_nginx(up_port, tmp)
                if isinstance(started, str):
                    print(f"nginx: {started}")
                    continue
                proc, url = started
                procs.append(proc)
            else:
                if kind == "base":
                    env = {**os.environ, "PYTHONPATH": str(Path(a.baseline).resolve())}
                procs.append(subprocess.Popen([sys.executable, __file__, "--relay", str(up_port), str(tmp / kind),
                                               "proxy" if kind == "base" else kind], pass_fds=fds, env=env))
                if kind == "worker":
                    theirs.close()
                url = f"http://127.0.0.1:{_wait_port(tmp / kind)}"
            meter = pl.CpuMeter(procs[-1].pid)
            asyncio.run(pl.load(url, 4, 2, api=a.api))
            for tokens in [int(x) for x in a.tokens.split(",")]:
                best = None
                for _ in range(a.rounds):
                    c0, t0, b0 = meter.own_s(), _user_sys_ticks(meter), shipped[0]
                    r = asyncio.run(pl.load(url, a.streams, a.requests_per_stream, a.gap_ms / 1e3, tokens=tokens,
                                            stagger_s=tokens * a.gap_ms / 1e3 if a.staggered else 0.0, api=a.api))
                    time.sleep(0.1)  # the last records
                    c1, t1 = meter.own_s(), _user_sys_ticks(meter)
                    n = a.streams * a.requests_per_stream * (tokens + 1)
                    row = (1e6 * (c1 - c0) / n, 1e6 * (t1[0] - t0[0]) / hz / n, 1e6 * (t1[1] - t0[1]) / hz / n,
                           r["tok_s"], (shipped[0] - b0) / (a.streams * a.requests_per_stream * tokens))
                    best = row if best is None or row[0] < best[0] else best
                per_response.setdefault(kind, []).append((tokens + 1, best[0] * (tokens + 1)))
                extra = f"  {best[4]:.1f} record bytes per token" if kind == "worker" else ""
                print(f"{kind:6s} {tokens:6d}  {best[0]:8.1f}  {best[1]:7.1f}  {best[2]:6.1f}  {best[3]:6.0f}{extra}")
        for kind, pts in per_response.items():
            if len(pts) >= 2:
                (x0, y0), (x1, y1) = pts[0], pts[-1]
                slope = (y1 - y0) / (x1 - x0)
                print(f"{kind}: {slope:.1f} us per chunk + {y0 - slope * x0:.0f} us per request "
                      f"(line through {x0 - 1} and {x1 - 1} tokens)")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--relay":
        relay_main(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
