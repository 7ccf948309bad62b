"""The tag API: application-defined windows opened and closed over a local Unix socket.

Server: `tag_app(handler)` serves `POST /tags/{name}/start`, `POST /tags/{name}/stop`, `GET /tags`
on a Unix socket only (file mode 0660: local users in the daemon's group). Client:
`send_tag(socket_path, action, name)`, used by `powerprof tag start|stop NAME`.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import aiohttp
from aiohttp import web

from powerprof.errtext import error_text

NAME_RE = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")


class TagHandler(Protocol):
    async def tag_start(self, name: str) -> dict: ...
    async def tag_stop(self, name: str) -> dict: ...
    def tag_list(self) -> list[str]: ...


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"tag name {name!r} must be 1-128 characters of letters, digits and _ . : @ / -")
    return name


def tag_app(handler: TagHandler) -> web.Application:
    async def act(request: web.Request, fn: Callable[[str], Awaitable[dict]]) -> web.Response:
        try:
            name = check_name(request.match_info["name"])
            out = await fn(name)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(out)

    async def start(request):
        return await act(request, handler.tag_start)

    async def stop(request):
        return await act(request, handler.tag_stop)

    async def listing(_request):
        return web.json_response({"open": handler.tag_list()})

    app = web.Application()
    app.router.add_post("/tags/{name:.+}/start", start)
    app.router.add_post("/tags/{name:.+}/stop", stop)
    app.router.add_get("/tags", listing)
    return app


class TagApiError(RuntimeError):
    pass


async def _send(socket_path: Path, method: str, path: str) -> dict:
    conn = aiohttp.UnixConnector(path=str(socket_path))
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.request(method, "http://powerprof" + path) as r:
            body = await r.text()
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {"error": body}
            if r.status != 200:
                raise TagApiError(doc.get("error") or f"daemon answered {r.status}")
            return doc


def send_tag(socket_path: Path | str, action: str, name: str | None = None) -> dict:
    """Blocking client: action is start, stop or list."""
    p = Path(socket_path)
    if action == "list":
        path, method = "/tags", "GET"
    else:
        check_name(name or "")
        path, method = f"/tags/{name}/{action}", "POST"
    if not p.exists():
        raise TagApiError(f"no daemon socket at {p}: is `powerprof daemon` running (and is this its socket)?")
    try:
        return asyncio.run(_send(p, method, path))
    except (aiohttp.ClientConnectionError, OSError) as e:
        raise TagApiError(f"cannot reach the daemon at {p}: {error_text(e)}") from None
