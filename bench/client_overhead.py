"""Client-side cost per token event, beside the simulated server's time between tokens.

Measures, in one run:
1. the pure parser (StreamParser.feed) per event, for each protocol;
2. the whole client (aiohttp read loop + parser + timestamps + record) per event, reading a
   stream that a separate process writes as fast as it can over loopback; CPU time of the
   client thread only, and wall time;
3. the simulated server's token interval for each GPU profile (1 / decode tok/s).

The ratio client-cost / token-interval says how much of one core the measurement takes
away from the server it measures. Usage: .venv/bin/python bench/client_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time

import aiohttp
from aiohttp import web

from powerprof.sim.profiles import PROFILES
from powerprof.workload.client import RequestParams, ServerInfo, send_request
from powerprof.workload.stream import StreamParser

N_EVENTS = 20000


def llama_events(n: int) -> list[bytes]:
    ev = [
        b"data: " + json.dumps({"index": 0, "content": " tok", "tokens": [i % 32000], "stop": False, "id_slot": 0,
                                "tokens_predicted": i + 1, "tokens_evaluated": 40}).encode() + b"\n\n"
        for i in range(n)
    ]
    final = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": n,
             "timings": {"prompt_n": 40, "predicted_n": n, "predicted_ms": 1.0}}
    return ev + [b"data: " + json.dumps(final).encode() + b"\n\n"]


def chat_events(n: int) -> list[bytes]:
    head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    ev = [b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}).encode() + b"\n\n"]
    ev += [
        b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}).encode() + b"\n\n"
        for _ in range(n)
    ]
    ev.append(b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}).encode() + b"\n\n")
    ev.append(b"data: [DONE]\n\n")
    return ev


def bench_parser(api: str, events: list[bytes], reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        p = StreamParser(api)
        t0 = time.perf_counter()
        n = 0
        for e in events:
            n += len(p.feed(e))
        p.finish()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _blaster(port_q, api: str, n: int) -> None:
    events = llama_events(n) if api == "llamacpp" else chat_events(n)

    async def handler(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)  # one write per event, as servers do
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/completion", handler)
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(runner.addresses[0][1])
        await asyncio.sleep(120)

    asyncio.run(main())


def bench_client(api: str, n: int = N_EVENTS) -> tuple[float, float, int]:
    q = mp.Queue()
    proc = mp.Process(target=_blaster, args=(q, api, n), daemon=True)
    proc.start()
    try:
        port = q.get(timeout=30)
        server = ServerInfo(f"http://127.0.0.1:{port}", "llamacpp", api)

        async def go():
            async with aiohttp.ClientSession() as s:
                c0, w0 = time.thread_time(), time.perf_counter()
                rec = await send_request(s, server, "x", RequestParams(max_tokens=n), edge_hook=lambda _: None)
                return rec, time.thread_time() - c0, time.perf_counter() - w0

        rec, cpu, wall = asyncio.run(go())
        assert rec.ok, rec.error
        events = len(rec.event_t_ns)
        return cpu / events * 1e6, wall / events * 1e6, events
    finally:
        proc.terminate()
        proc.join(5)


def main() -> None:
    print(f"parser per event (best of 3, {N_EVENTS} events):")
    parser = {}
    for api, evs in (("llamacpp", llama_events(N_EVENTS)), ("openai-chat", chat_events(N_EVENTS))):
        parser[api] = bench_parser(api, evs)
        print(f"  {api:<12} {parser[api]:6.2f} us/event")
    print("client per event (aiohttp read + parser + record; server in another process):")
    client = {}
    for api in ("llamacpp", "openai-chat"):
        cpu, wall, n = bench_client(api)
        client[api] = cpu
        print(f"  {api:<12} {cpu:6.2f} us CPU/event, {wall:6.2f} us wall/event ({n} events)")
    worst = max(client.values())
    print("simulated server token interval, and client CPU as a share of it:")
    for key, p in PROFILES.items():
        interval_us = 1e6 / p.workload.decode_tok_s
        print(f"  {key:<10} {interval_us:8.0f} us/token   client share {worst / interval_us * 100:5.2f} %")


if __name__ == "__main__":
    main()
