"""Proxy cost: latency added per request and throughput, direct vs through the daemon's proxy.

    .venv/bin/python bench/proxy_latency.py [--streams 1,32,256] [--requests-per-stream 8]

An upstream process serves deterministic SSE streams (32 tokens, 2 ms apart); the real daemon
(`powerprof daemon --simulate --upstream URL`, recording and attribution on) runs in another
process. For each concurrency the same load goes direct and through the proxy, alternating,
and the table gives median/p95 time to first byte and total time, and requests and tokens per
second. Machine noise affects both sides alike; read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import wait_for_daemon_info  # bench/ is on sys.path when a bench runs

TOKENS = 32
GAP_S = 0.002


def upstream_main(port_file: str) -> None:
    from aiohttp import web

    async def completion(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(TOKENS):
            await resp.write(b'data: {"content":"tok ","tokens":[%d],"stop":false}\n\n' % i)
            await asyncio.sleep(GAP_S)
        await resp.write(b'data: {"content":"","stop":true,"tokens_predicted":%d}\n\n' % TOKENS)
        await resp.write_eof()
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/completion", completion)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(run())


async def load(url: str, streams: int, per_stream: int) -> dict:
    import aiohttp

    ttfb, total = [], []
    body = json.dumps({"prompt": "bench", "n_predict": TOKENS, "stream": True})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker():
            for _ in range(per_stream):
                t0 = time.perf_counter()
                async with s.post(url + "/completion", data=body) as r:
                    first = None
                    async for _chunk in r.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                t1 = time.perf_counter()
                ttfb.append(first - t0)
                total.append(t1 - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    n = streams * per_stream
    return {"ttfb_p50_ms": 1e3 * statistics.median(ttfb), "ttfb_p95_ms": 1e3 * q(ttfb, 0.95),
            "total_p50_ms": 1e3 * statistics.median(total), "total_p95_ms": 1e3 * q(total, 0.95),
            "req_s": n / wall, "tok_s": n * TOKENS / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,32,256")
    ap.add_argument("--requests-per-stream", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="direct/proxy alternations per concurrency")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="powerprof-bench-"))
    port_file = tmp / "port"
    up = subprocess.Popen([sys.executable, __file__, "--upstream", str(port_file)])
    daemon = None
    try:
        for _ in range(400):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        direct = f"http://127.0.0.1:{port_file.read_text()}"
        data = tmp / "data"
        env = {**os.environ, "POWERPROF_SIM_STATE": str(tmp / "sim.json")}
        daemon = subprocess.Popen(
            [sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "--upstream", direct, "--data-dir",
             str(data), "--listen", "127.0.0.1:0", "--metrics-listen", "", "--tag-socket", str(tmp / "t.sock")],
            stdout=open(tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env)
        info = wait_for_daemon_info(data)
        proxy = info["proxy"]
        asyncio.run(load(direct, 4, 2))
        asyncio.run(load(proxy, 4, 2))  # warm both paths
        print(f"{TOKENS} tokens per streamed response, {GAP_S * 1e3:.0f} ms apart; "
              f"{a.requests_per_stream} requests per stream; medians of {a.rounds} alternating rounds")
        print("streams  path    ttfb_p50_ms  ttfb_p95_ms  total_p50_ms  total_p95_ms    req_s    tok_s")
        for streams in [int(x) for x in a.streams.split(",")]:
            res = {"direct": [], "proxy": []}
            for _ in range(a.rounds):
                for name, url in (("direct", direct), ("proxy", proxy)):
                    res[name].append(asyncio.run(load(url, streams, a.requests_per_stream)))
            med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in res.items()}
            for name in ("direct", "proxy"):
                m = med[name]
                print(f"{streams:7d}  {name:6s}  {m['ttfb_p50_ms']:11.2f}  {m['ttfb_p95_ms']:11.2f}  "
                      f"{m['total_p50_ms']:12.2f}  {m['total_p95_ms']:12.2f}  {m['req_s']:7.1f}  {m['tok_s']:7.0f}")
            d, p = med["direct"], med["proxy"]
            print(f"{streams:7d}  added   ttfb {p['ttfb_p50_ms'] - d['ttfb_p50_ms']:+.2f} ms, total "
                  f"{p['total_p50_ms'] - d['total_p50_ms']:+.2f} ms per request (median); "
                  f"throughput proxy/direct {p['tok_s'] / d['tok_s']:.2f}")
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
        up.terminate()
        up.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--upstream":
        upstream_main(sys.argv[2])
    else:
        main()
