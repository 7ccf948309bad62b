"""What proxy workers' records cost on the wire and how late they reach the daemon's recorder.

    .venv/bin/python bench/proxy_worker_records.py [--workers 2] [--streams 1,4,64] [--tokens 32,128]

The upstream of bench/proxy_latency.py (SSE events 2 ms apart) in one process; `ProxyWorkers`
(the daemon's side of `proxy.workers`) with N real worker processes in this one, the load
generator in a third; the recorder
noting, for each record it replays, how long after the worker's own stamp it arrived: a request's
start (arrival), its first token, later tokens (coalesced: after the latest token of their batch)
and its end. Also the record bytes per token and per request. With at most
`attribution.edge_max_inflight` (4) requests in flight in a worker, starts, first tokens and ends
are sent at once (the short-request edges need them); otherwise within 20 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import proxy_latency as pl  # bench/ is on sys.path when a bench runs


class LagRecorder:
    def __init__(self):
        self.start, self.first, self.later, self.end = [], [], [], []
        self.tokens = 0

    def on_start(self, tr):
        self.start.append(time.monotonic_ns() - tr.arrival_ns)

    def on_tokens(self, tr, t_ns, n):
        (self.first if tr.first_ns == t_ns else self.later).append(time.monotonic_ns() - t_ns)
        self.tokens += n

    def on_end(self, tr):
        self.end.append(time.monotonic_ns() - tr.end_ns)


def _q_ms(xs, p):
    return sorted(xs)[int(p * (len(xs) - 1))] / 1e6 if xs else float("nan")


async def run(up_url: str, workers: int, streams: int, tokens: int) -> None:
    from powerprof.daemon.workers import ProxyWorkers

    rec = LagRecorder()
    pw = ProxyWorkers(workers, up_url, "127.0.0.1", 0, recorder=rec, proxy_kwargs={}, header_timeout_s=10,
                      idle_timeout_s=10)
    host, port = await pw.start()
    per_stream = max(2, 32 // streams)
    # The load from another process: in this one it would share the loop whose lateness is measured.
    code = (f"import asyncio, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import proxy_latency as pl; "
            f"asyncio.run(pl.load('http://{host}:{port}', {streams}, {per_stream}, tokens={tokens}))")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    await proc.wait()
    await asyncio.sleep(0.2)  # the last records
    await pw.cleanup()
    n_req = streams * per_stream
    row = "  ".join(f"{name} {_q_ms(xs, 0.5):5.2f}/{_q_ms(xs, 0.95):5.2f}"
                    for name, xs in (("start", rec.start), ("first", rec.first), ("later", rec.later), ("end", rec.end)))
    print(f"{streams:7d}  {tokens:6d}  {pw.record_bytes / rec.tokens:9.1f}  {pw.record_bytes / n_req:9.0f}  "
          f"{len(rec.later) / max(1, rec.tokens - len(rec.first)):9.2f}  {row}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--streams", default="1,4,64")
    ap.add_argument("--tokens", default="32,128")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="powerprof-records-"))
    up = subprocess.Popen([sys.executable, pl.__file__, "--upstream", str(tmp / "up")])
    try:
        for _ in range(600):
            if (tmp / "up").exists() and (tmp / "up").read_text():
                break
            time.sleep(0.05)
        up_url = f"http://127.0.0.1:{(tmp / 'up').read_text()}"
        print(f"{a.workers} workers; tokens 2 ms apart; lag = ms from the worker's stamp to the daemon's replay, p50/p95")
        print("streams  tokens  B/token  B/request  records/token  lag")
        import uvloop

        for tokens in [int(x) for x in a.tokens.split(",")]:
            for streams in [int(x) for x in a.streams.split(",")]:
                uvloop.run(run(up_url, a.workers, streams, tokens))
    finally:
        up.terminate()
        up.wait(10)


if __name__ == "__main__":
    main()
