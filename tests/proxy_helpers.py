"""Test helpers: an aiohttp app on a loopback port in its own thread, and a buffering reverse proxy."""

from __future__ import annotations

import asyncio
import threading


async def serve_here(app):
    """(runner, url) of an aiohttp app on a loopback port, in the running loop (the caller cleans the runner up)."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def serve_in_thread(app_factory):
    """Run an aiohttp app (built inside its own loop) on a loopback port; returns (url, stop)."""
    from aiohttp import web

    ready, box = threading.Event(), {}

    def run():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def start():
            runner = web.AppRunner(app_factory(), handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            box["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
            box["runner"] = runner

        loop.run_until_complete(start())
        box["loop"] = loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(box["runner"].cleanup())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(30)

    def stop():
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(30)

    return box["url"], stop


def buffering_proxy(upstream: str):
    """What nginx does by default (proxy_buffering on): read the whole upstream answer, then send it.
    Returns (url, stop)."""
    import aiohttp
    from aiohttp import web

    def factory():
        async def handle(request):
            async with aiohttp.ClientSession() as s:
                async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                     headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                    body = await r.read()
                    return web.Response(body=body, status=r.status, headers={"Content-Type": r.headers.get("Content-Type", "")})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    return serve_in_thread(factory)


def held_answers(upstream: str, hold_s: float, for_s: float):
    """A reverse proxy for GETs (a scraper's /metrics, /slots) that holds each answer `hold_s` before asking
    `upstream`, for the first `for_s` after its first request: what a loaded host does to a daemon's first
    scrapes (its event loop held while the client's requests already run). Returns (url, stop)."""
    import time

    import aiohttp
    from aiohttp import web

    first: list[float] = []

    def factory():
        async def handle(request):
            now = time.monotonic()
            first.append(now) if not first else None
            if now - first[0] < for_s:
                await asyncio.sleep(hold_s)
            async with aiohttp.ClientSession() as s:
                async with s.get(upstream + request.path_qs) as r:
                    return web.Response(body=await r.read(), status=r.status,
                                        headers={"Content-Type": r.headers.get("Content-Type", "")})

        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        return app

    return serve_in_thread(factory)
