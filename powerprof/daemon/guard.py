"""Hostile clients of the daemon's HTTP listeners: a slow request head or an idle connection is closed, a malformed request logged in one line.

aiohttp's server has no deadline for receiving a request head, so a client trickling header bytes
(slowloris) holds a connection for ever. The guard closes a connection that has no request in
progress once it has waited `header_timeout_s` since it opened, or `idle_timeout_s` since its
last response ended, for its next request head. Requests in progress are left alone (the proxy
bounds body reads and the upstream itself). Uses only aiohttp's public API: `Server.connections`,
`request.protocol`, a middleware.

aiohttp logs every request its parser rejects (smuggling attempts, obs-folds, control characters)
at ERROR with a traceback: `BadRequestLog`, a filter on its `aiohttp.server` logger, makes that one
WARNING line with the client's bytes escaped, the first few and then every 1000th, so a client
cannot flood the journal until its rate limit drops the daemon's own lines.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from powerprof.errtext import one_line

from .ticks import sleep_on_grid

log = logging.getLogger("powerprof.daemon.guard")


class ConnectionGuard:
    def __init__(self, header_timeout_s: float, idle_timeout_s: float, period_s: float | None = None):
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.period_s = period_s or max(0.05, min(1.0, header_timeout_s / 4))
        self._busy: dict[int, int] = {}  # id(protocol) → requests in progress
        self._since: dict[int, tuple[float, float]] = {}  # id(protocol) → (waiting since, its deadline span)
        self.closed = 0
        self._servers: list[web.Server] = []
        self._task: asyncio.Task | None = None

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        key = id(request.protocol)
        self._busy[key] = self._busy.get(key, 0) + 1
        try:
            return await handler(request)
        finally:
            self._busy[key] -= 1
            if self._busy[key] <= 0:
                del self._busy[key]
                self._since[key] = (time.monotonic(), self.idle_timeout_s)

    def watch(self, server: web.Server) -> None:
        self._servers.append(server)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="powerprof-connection-guard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            await sleep_on_grid(self.period_s)  # with the daemon's other periodic loops: one wake-up (ticks.py)
            try:
                self.sweep(time.monotonic())
            except Exception:  # the guard must not die; the next turn tries again
                log.exception("connection guard sweep failed")

    def sweep(self, now: float) -> int:
        """Close connections waiting too long for a request head; returns how many were closed."""
        live = set()
        n = 0
        for server in self._servers:
            for proto in list(server.connections):
                key = id(proto)
                live.add(key)
                if key in self._busy:
                    continue
                since, span = self._since.setdefault(key, (now, self.header_timeout_s))
                if now - since > span:
                    transport = proto.transport
                    if transport is not None:
                        transport.close()
                        n += 1
                    self._since.pop(key, None)
        for key in list(self._since):
            if key not in live:
                del self._since[key]
        self.closed += n
        return n


class BadRequestLog(logging.Filter):
    """On `aiohttp.server`: a request its parser rejected becomes one WARNING line, no traceback, the first `first` and
    then every `every`th, with the count so far; every other record passes unchanged."""

    def __init__(self, first: int = 5, every: int = 1000):
        super().__init__()
        self.first, self.every = first, every
        self.rejected = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.rejected += 1
        if self.rejected > self.first and self.rejected % self.every:
            return False
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        # aiohttp's message quotes the offending bytes (repr); anything unprintable left is escaped too.
        why = " ".join(str(exc.message or exc).split())
        why = one_line(why, 300)
        record.msg = "rejected a malformed request from %s (HTTP %s): %s [%d so far; the first %d, then every %dth, logged]"
        record.args = (remote, exc.code, why, self.rejected, self.first, self.every)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def quiet_bad_requests() -> BadRequestLog:
    """Install `BadRequestLog` on aiohttp's server logger (once per process)."""
    logger = logging.getLogger("aiohttp.server")
    for f in logger.filters:
        if isinstance(f, BadRequestLog):
            return f
    f = BadRequestLog()
    logger.addFilter(f)
    return f
