"""The proxy's Python work counted, not timed: function calls per request and per token chunk (cProfile).

    PYTHONPATH=TREE .venv/bin/python bench/proxy_calls.py [--requests 800]

Call counts do not depend on the machine's load, so two source trees compare exactly where the
CPU timings of bench/proxy_latency.py and bench/proxy_floor.py swing with it. Per request: an
upstream process (bench/proxy_latency.py's) answers 1-token streams; `Proxy` with a null
recorder runs in this process under cProfile; a load process sends the requests (32 streams).
Per chunk: an upstream read that is one whole chunk of a llama.cpp stream, from
`Exchange.data_received` to the (null) recorder, in this process with a stub client transport
(no sockets). The loop is uvloop, as in the daemon. The times printed beside are cProfile's and only for comparison within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import proxy_latency as pl  # bench/ is on sys.path when a bench runs


async def per_request(n_requests: int) -> tuple[float, int]:
    from aiohttp import web

    from powerprof.daemon.proxy import Proxy

    tmp = Path(tempfile.mkdtemp(prefix="powerprof-calls-"))
    up = subprocess.Popen([sys.executable, pl.__file__, "--upstream", str(tmp / "port")])
    try:
        for _ in range(600):
            if (tmp / "port").exists() and (tmp / "port").read_text():
                break
            await asyncio.sleep(0.05)
        proxy = Proxy(f"http://127.0.0.1:{(tmp / 'port').read_text()}")
        runner = web.AppRunner(proxy.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        streams, per = 32, max(1, n_requests // 32)

        async def load(s: int, p: int) -> None:
            code = (f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import proxy_latency as pl; "
                    f"asyncio.run(pl.load({url!r}, {s}, {p}, 0.0, tokens=1))")
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
            if await proc.wait() != 0:
                raise SystemExit("the load process failed")

        await load(4, 2)  # warm: connections open, first events parsed
        prof = cProfile.Profile()
        prof.enable()
        await load(streams, per)
        prof.disable()
        await runner.cleanup()
        return pstats.Stats(prof).total_calls / (streams * per), streams * per
    finally:
        up.terminate()
        up.wait(10)


def per_chunk(n_chunks: int = 2000) -> tuple[float, float]:
    from powerprof.daemon import streams
    from powerprof.daemon.forward import Exchange
    from powerprof.daemon.proxy import Proxy, RequestTrace, _ClientSink

    class Transport:  # the client's socket, without the syscall
        def is_closing(self):
            return False

        def write(self, data):
            pass

        def get_write_buffer_size(self):
            return 0

    class Pool:
        loop = None
        read_timeout_s = 600.0

    proxy = Proxy("http://127.0.0.1:1")
    trace = RequestTrace(1, "POST", "/completion", None, time.monotonic_ns(), time.time_ns(), api="llamacpp")
    sink = _ClientSink(proxy, trace)
    sink.transport, sink.chunked, sink.parser = Transport(), True, streams.new_parser("llamacpp")
    sink.parser.count(b'data: {"content":"tok ","tokens":[0],"stop":false}\n\n')  # the first event: parsed whole
    ex = Exchange(Pool())
    ex._mode, ex._left, ex.on_body = "chunked", -1, sink.on_body  # a response head already read
    reads = []
    for i in range(n_chunks):
        event = b'data: {"content":"tok ","tokens":[%d],"stop":false}\n\n' % (i + 1)
        reads.append(b"%x\r\n%b\r\n" % (len(event), event))
    prof = cProfile.Profile()
    prof.enable()
    for data in reads:
        ex.data_received(data)
    prof.disable()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for data in reads:
            ex.data_received(data)
        best = min(best, (time.perf_counter() - t0) / n_chunks)
    if trace.tokens_seen != 8 * n_chunks or trace.recorder_error is not None:
        raise SystemExit(f"chunks not counted as expected: {trace.tokens_seen} tokens, {trace.recorder_error}")
    return pstats.Stats(prof).total_calls / n_chunks, best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=800)
    a = ap.parse_args()
    import powerprof

    calls_chunk, us_chunk = per_chunk()
    import uvloop  # the daemon's loop: asyncio's own runs many more Python calls per request

    calls_req, n = uvloop.run(per_request(a.requests))
    print(f"tree {Path(powerprof.__file__).parent.parent}")
    print(f"per request (1-token stream, {n} requests, null recorder): {calls_req:.0f} Python calls")
    print(f"per chunk (one whole chunk per read, data_received to the recorder): {calls_chunk:.1f} Python calls, "
          f"{us_chunk:.2f} us (best of 7, this machine now)")


if __name__ == "__main__":
    main()
