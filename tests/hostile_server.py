"""A hostile inference server for tests: llama.cpp-shaped, but every answer is whatever the test scripted.

It runs in its own thread and event loop (like a separate process would). `cases` maps a request's
prompt to what `/completion` answers: a final event with hostile counts, raw bytes (malformed
SSE, an oversized body), or a normal stream when the prompt is not scripted. `/props` can be
made endless; `/metrics` and `/slots` answer scripted text. `bytes_sent` counts what each
route wrote, so a test can prove a client stopped reading.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

from aiohttp import web

# The final event of each scripted case; None values are dropped. Each must fail the request.
HOSTILE_FINALS = {
    "huge": {"tokens_predicted": 1_000_000_000_000_000},
    "negative": {"tokens_predicted": -50},
    "fractional": {"tokens_predicted": 5.5},
    "string": {"tokens_predicted": "7"},
    "nan-timings": {"tokens_predicted": 3, "timings": {"predicted_n": 3, "predicted_ms": float("nan")}},
    "negative-timings": {"tokens_predicted": 3, "timings": {"predicted_n": 3, "predicted_ms": -12.0}},
    "huge-prompt": {"tokens_predicted": 3, "tokens_evaluated": 2**40},
}
# Raw bodies: malformed SSE, and an event far over the parser's 4 MiB line bound.
HOSTILE_RAW = {
    "malformed-sse": b'data: {"content": "a", "tokens": [1]}\n\ndata: {not json\n\ndata: [1, 2\n\n',
    "oversized-event": b"data: {\"content\": \"" + b"x" * (6 << 20),
}

OVERSIZED_JSON_BYTES = 4 << 20  # tests lower the client's cap below this rather than send 64 MiB


class HostileServer:
    def __init__(self, endless_props: bool = False, metrics_text: str = "", slots: object = None):
        self.endless_props = endless_props
        self.metrics_text = metrics_text
        self.slots = slots if slots is not None else []
        self.bytes_sent: Counter = Counter()
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()

    # --- routes ----------------------------------------------------------------------------------

    async def props(self, request: web.Request) -> web.StreamResponse:
        if not self.endless_props:
            return web.json_response({"build_info": "hostile", "total_slots": 1, "model_path": "/m.gguf"})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b'{"build_info": "' + b"x" * (1 << 20)
        try:
            for _ in range(200):  # 200 MiB if the client reads it all
                await resp.write(chunk)
                self.bytes_sent["props"] += len(chunk)
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = str(body.get("prompt", ""))
        if prompt == "oversized-json":  # a non-streamed answer far larger than any real completion
            body = b'{"content": "' + b"x" * (OVERSIZED_JSON_BYTES - 20) + b'", "stop": true}'
            self.bytes_sent[prompt] += len(body)
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if prompt in HOSTILE_RAW:
                await resp.write(HOSTILE_RAW[prompt])
                self.bytes_sent[prompt] += len(HOSTILE_RAW[prompt])
                return resp
            for i in range(3):
                await resp.write(f'data: {json.dumps({"content": f"t{i}", "tokens": [i]})}\n\n'.encode())
                await asyncio.sleep(0.005)
            final = {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 3,
                     "tokens_evaluated": 4, "timings": {"predicted_n": 3, "prompt_n": 4, "predicted_ms": 10.0}}
            final.update(HOSTILE_FINALS.get(prompt, {}))
            await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        except (ConnectionError, RuntimeError):
            pass
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def slots_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.slots)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "HostileServer":
        self._thread = threading.Thread(target=self._main, name="hostile-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("hostile server did not start")
        return self

    def _main(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/props", self.props)
        app.router.add_post("/completion", self.completion)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/slots", self.slots_route)
        app.router.add_get("/health", self.health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> "HostileServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
