"""Upstream HTTP/1.1 connections for the proxy: a response body is handed on from the socket's callback.

aiohttp's client wakes a task for every chunk it receives (parser → StreamReader → future → task
→ `iter_any`), which cost the proxy about half of its CPU per token. Here the response head is
parsed once, then every `data_received` call decodes the body framing (Content-Length, chunked or
until close) and hands everything that arrived in that read to `on_body(payload, framed)` as one piece, in the same
callback: no task, no future, one client write per read (see docs/benchmarks-history.md, Proxy, second pass). `framed`
is the read itself when it is exactly one chunk of chunked framing (the usual case on a token
stream) or several whole ones, so a chunked client gets it unchanged; otherwise None.

`UpstreamPool(url, ...)` keeps idle keep-alive connections; `Exchange` is one request on one
connection: `send`, `response_head` (awaitable), then `attach(on_body)` and await `done`.
Timeouts: connecting (`connect_timeout_s`) and upstream silence (`read_timeout_s`) while a
request is in flight, checked on one timer per pool for all requests in flight (at most every
second); `on_tick` is called on the same timer so the proxy can notice a client that left while
the upstream is silent.
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections import deque
from urllib.parse import urlsplit

from multidict import CIMultiDict

from powerprof.workload.limits import IDLE_REUSE_S

HEAD_MAX_BYTES = 64 << 10
CHUNK_LINE_MAX_BYTES = 4 << 10
TICK_MAX_S = 1.0
# An idle connection the upstream closes this soon after a streamed answer: the server closes after streams
# (llama-server does, without `Connection: close`), so the pool stops keeping such connections.
CLOSED_AFTER_STREAM_S = 1.0
# A kept-alive connection that closes with no answer this soon after a request went out on it was closed under
# the request (the close crossed it on the wire: the server never began it), and the request is sent again. A
# later close is the server failing a request it had begun (a crash, an OOM kill): sent again, it would be
# generated twice, or crash the next server the same way (nginx does not resend a POST either). Loopback and LAN
# crossings take milliseconds; the margin is for an event loop late on a loaded host.
STALE_CLOSE_MAX_S = 1.0


_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIZES: dict[bytes, int] = {}  # size lines seen (a stream repeats a few): one dict lookup per chunk
_SIZES_MAX = 4096


def _hex_size(s: bytes) -> int:
    """A chunk size line's number; -1 unless it is plain hex digits (int() would also take 0x, _ and signs)."""
    size = _SIZES.get(s)
    if size is not None:
        return size
    if not s or len(s) > 16 or not _HEX.issuperset(s):
        return -1
    size = int(s, 16)
    if len(_SIZES) < _SIZES_MAX:
        _SIZES[s] = size
    return size


def _whole_chunks(data: bytes, start: int, stop: int) -> bytes | None:
    """The payload of `data` when it is nothing but whole chunks of data (the first one's payload is
    data[start:stop]); None if anything else is in it (an extension, the last chunk, a partial chunk)."""
    pieces = [data[start:stop]]
    pos, n = stop + 2, len(data)
    while pos < n:
        end = data.find(b"\r\n", pos, pos + 18)
        if end <= pos:
            return None
        size = _hex_size(data[pos:end])
        stop = end + 2 + size
        if size <= 0 or data[stop : stop + 2] != b"\r\n":
            return None
        pieces.append(data[end + 2 : stop])
        pos = stop + 2
    return b"".join(pieces)


class UpstreamError(Exception):
    """The upstream broke the HTTP exchange (closed early, bad framing, silence past the read timeout)."""


class UpstreamClosed(UpstreamError):
    """The upstream closed the connection after the request went out, before any byte of an answer, and not as a
    kept-alive close crossing it (StaleConnection): the server had the request and may have run it for as long (a crash,
    its process killed), unlike a refused connect, which never reached it."""


class StaleConnection(UpstreamError):
    """A kept-alive connection the upstream had closed: it ended with no byte of an answer to the request sent
    on it, so the server never began that request (a close that crossed it on the wire). `waited_s`: how long after
    the request went out it closed."""

    def __init__(self, message: str, waited_s: float = 0.0):
        super().__init__(message)
        self.waited_s = waited_s



_WS = " \t\n\r\x0b\x0c"  # what bytes.strip() strips (str.strip() would also take \x85 and \xa0)
# Control characters in a head, CRLF line ends aside: aiohttp refuses to send them to the client.
_CTL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")


def _text(b: bytes) -> str:
    """Head bytes as text that aiohttp's UTF-8 writer gives back unchanged (latin-1 where not UTF-8)."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return b.decode("latin-1")


def _parse_head(head: bytes) -> tuple[str, int, str, CIMultiDict]:
    lines = head.split(b"\r\n", 1)
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise UpstreamError(f"bad status line from upstream: {lines[0][:80]!r}")
    pairs = []
    if len(lines) > 1:
        text = _text(lines[1])  # one decode for the whole head
        if _CTL.search(text):
            raise UpstreamError(f"control character in a header from upstream: {_CTL.search(text).group()!r}")
        for line in text.split("\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip(_WS):
                raise UpstreamError(f"bad header line from upstream: {line[:80]!r}")
            pairs.append((name, value.strip(_WS)))
    reason = _text(parts[2]) if len(parts) > 2 else ""
    if _CTL.search(reason):
        raise UpstreamError(f"control character in the status line from upstream: {lines[0][:80]!r}")
    return parts[0].decode("ascii"), int(parts[1]), reason, CIMultiDict(pairs)


class Exchange(asyncio.Protocol):
    """One upstream connection; one request at a time on it (HTTP/1.1 keep-alive, no pipelining)."""

    def __init__(self, pool: UpstreamPool):
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.reusable = False
        self.draining = False  # half_close: our side ended, the server's tail being read
        self.reused = False  # taken from the pool's idle connections: the server may have closed it meanwhile
        self.chunked = False  # the last response was chunked (a stream)
        self.idle_since = 0.0  # monotonic s: when it went back to the pool
        self.drain_cut = False  # and the server was still sending when the drain's time was up
        self._write_ok: asyncio.Future | None = None
        self._reset()

    def _reset(self) -> None:
        self.head_method = "GET"
        self.response_head: asyncio.Future | None = None
        self.done: asyncio.Future | None = None
        self.status = 0
        self.headers: CIMultiDict | None = None
        self._buf = b""
        self._mode = ""  # head, length, chunked, close, trailer, end
        self._left = 0  # length: body bytes to come; chunked: bytes left of this chunk's data (-1: a size line next)
        self._early: list[bytes] = []  # body that came before attach()
        self.answered = False  # a byte of the answer to this request came (an interim 100 counts)
        self._sent_s = 0.0  # monotonic s: when this request went out (start)
        self.on_body = None
        self.on_tick = None
        self._last = 0.0
        self.excess = 0  # bytes the upstream sent past the end of its response (beyond its Content-Length): dropped

    # --- protocol callbacks ------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.reusable = False
        if self.pool._forget(self) and self.chunked and time.monotonic() - self.idle_since < CLOSED_AFTER_STREAM_S:
            self.pool.closes_after_streams = True
        if self._write_ok is not None and not self._write_ok.done():
            self._write_ok.set_result(None)  # a waiting write_body finds the connection lost
        if self._mode == "close" and exc is None:
            self._finish()
        elif self._mode == "head" and not self.answered and self.reused:
            if self.chunked:
                self.pool.closes_after_streams = True
            waited_s = time.monotonic() - self._sent_s
            if waited_s < STALE_CLOSE_MAX_S:
                self._fail(StaleConnection("the upstream had closed the kept-alive connection"
                                           f"{f' ({exc})' if exc else ''}; no answer began", waited_s))
            else:
                self._fail(UpstreamClosed(f"upstream closed the connection {waited_s:.1f} s after the request without "
                                          f"answering{f' ({exc})' if exc else ''}: it had begun it (a crash?), so it "
                                          "was not sent again"))
        elif self._mode == "head" and not self.answered:
            # A fresh connection: no close could cross the request, so the server had it (a streamed body's end
            # unsent: `write_body` fails first and says so).
            self._fail(UpstreamClosed(f"upstream closed the connection {time.monotonic() - self._sent_s:.1f} s after "
                                      f"the request without answering{f' ({exc})' if exc else ''} (a crash?)"))
        elif self._mode not in ("", "end"):
            self._fail(UpstreamError(f"upstream closed the connection mid-response{f': {exc}' if exc else ''}"))

    def eof_received(self):
        return False  # close our side too; connection_lost decides whether the body was complete

    def pause_writing(self) -> None:
        if self._write_ok is None or self._write_ok.done():
            self._write_ok = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._write_ok is not None and not self._write_ok.done():
            self._write_ok.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._last = time.monotonic()
        mode = self._mode
        if mode == "chunked" and self._left == -1 and not self._buf:
            # The common case on a stream: one read holds exactly one whole chunk. Its bytes are
            # already the framing the client gets, so they go out as they came.
            end = data.find(b"\r\n", 0, 18)
            if end > 0:
                size = _hex_size(data[:end])
                stop = end + 2 + size
                if size > 0 and data[stop : stop + 2] == b"\r\n":
                    if len(data) == stop + 2:
                        piece = data[end + 2 : stop]
                    else:
                        # Several whole chunks (a read that caught up with more than one token): also
                        # passed on as they came, rather than re-decoded and framed afresh.
                        piece = _whole_chunks(data, end + 2, stop)
                    if piece is not None:
                        on_body = self.on_body
                        if on_body is not None:
                            on_body(piece, data)
                        else:
                            self._early.append(piece)
                        return
        if mode == "length":
            n = len(data)
            if n > self._left:
                # More than its Content-Length: the declared body is forwarded, the rest dropped (as a proxy
                # must: it cannot be the next response), counted, and the connection not reused.
                data, self.excess, self.reusable = data[: self._left], self.excess + n - self._left, False
                n = self._left
            self._left -= n
            self._emit(data)
            if self._left == 0:
                self._finish()
            return
        if mode == "close":
            self._emit(data)
            return
        try:
            self._slow(data)
        except UpstreamError as e:
            self._fail(e)

    # --- framing -----------------------------------------------------------------------------

    def _slow(self, data: bytes) -> None:
        self.answered = True  # (every read of a response head comes here)
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        if self._mode == "head":
            while True:
                end = buf.find(b"\r\n\r\n", pos)
                if end - pos > HEAD_MAX_BYTES or (end < 0 and len(buf) - pos > HEAD_MAX_BYTES):
                    # The same bound whether the head came in one read or in many.
                    raise UpstreamError("upstream response head larger than 64 KiB")
                if end < 0:
                    self._buf = buf[pos:]
                    return
                version, status, reason, headers = _parse_head(buf[pos:end])
                pos = end + 4
                if 100 <= status < 200 and status != 101:
                    continue  # interim (100 Continue, 103 Early Hints): not forwarded
                break
            self._begin(version, status, reason, headers)
            if self._mode == "end":
                self._finish()
                if pos < len(buf):
                    self.reusable = False
                    self.excess += len(buf) - pos
                return
        pieces: list[bytes] = []
        n = len(buf)
        while pos < n:
            mode = self._mode
            if mode == "length":
                take = n - pos
                if take > self._left:  # past its Content-Length: dropped and counted (above)
                    self.excess += take - self._left
                    self.reusable = False
                    take = self._left
                pieces.append(buf[pos : pos + take] if pos or take < n else buf)
                self._left -= take
                pos = n
            elif mode == "close":
                pieces.append(buf[pos:] if pos else buf)
                pos = n
            elif mode == "chunked":
                if self._left > 0:
                    take = min(self._left, n - pos)
                    pieces.append(buf[pos : pos + take])
                    self._left -= take
                    pos += take
                    if self._left == 0:
                        self._left = -2  # the CRLF after the data
                    continue
                if self._left == -2:
                    if n - pos < 2:
                        self._buf = buf[pos:]
                        break
                    if buf[pos : pos + 2] != b"\r\n":
                        raise UpstreamError("bad chunked framing from upstream: no CRLF after a chunk")
                    pos += 2
                    self._left = -1
                    continue
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > CHUNK_LINE_MAX_BYTES:
                        raise UpstreamError("bad chunked framing from upstream: size line too long")
                    self._buf = buf[pos:]
                    break
                size_s = buf[pos:end].split(b";", 1)[0].strip()
                size = _hex_size(size_s)
                if size < 0:
                    raise UpstreamError(f"bad chunk size from upstream: {size_s[:20]!r}")
                pos = end + 2
                if size == 0:
                    self._mode = "trailer"
                else:
                    self._left = size
            elif mode == "trailer":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if n - pos > HEAD_MAX_BYTES:
                        raise UpstreamError("upstream trailers larger than 64 KiB")
                    self._buf = buf[pos:]
                    break
                line = buf[pos:end]
                pos = end + 2
                if not line:
                    self._mode = "end"  # trailers are hop-by-hop: not forwarded
            else:  # end: bytes after a complete response
                self.reusable = False
                self.excess += n - pos
                break
        if pieces:
            self._emit(pieces[0] if len(pieces) == 1 else b"".join(pieces))
        if self._mode == "end" or (self._mode == "length" and self._left == 0):
            self._finish()

    def _begin(self, version: str, status: int, reason: str, headers: CIMultiDict) -> None:
        self.status, self.headers = status, headers
        self.chunked = False
        conn = ",".join(headers.getall("Connection", ())).lower()
        self.reusable = version == "HTTP/1.1" and "close" not in conn and status != 101
        te = ",".join(headers.getall("Transfer-Encoding", ())).lower()
        if self.head_method == "HEAD" or status in (204, 304) or status < 200:
            self._mode = "end"
        elif te:
            if te.rsplit(",", 1)[-1].strip() != "chunked":
                self._mode, self.reusable = "close", False
            else:
                self._mode, self._left, self.chunked = "chunked", -1, True
            if "Content-Length" in headers:
                # Both framings (RFC 9112 §6.1): Transfer-Encoding wins, and the connection is not reused,
                # as such a response may be an attempt at response splitting.
                self.reusable = False
        elif "Content-Length" in headers:
            values = set(headers.getall("Content-Length"))
            value = values.pop()
            if values or not value.isascii() or not value.isdigit():
                raise UpstreamError(f"bad Content-Length from upstream: {headers['Content-Length'][:20]!r}")
            self._left = int(value)
            self._mode = "length" if self._left else "end"
        else:
            self._mode, self.reusable = "close", False
        if self.response_head is not None and not self.response_head.done():
            self.response_head.set_result((status, reason, headers))

    def _emit(self, piece: bytes, framed: bytes | None = None) -> None:
        if self.on_body is not None:
            self.on_body(piece, framed)
        else:
            self._early.append(piece)

    def _finish(self) -> None:
        mode, self._mode = self._mode, "end"
        if mode == "close":
            self.reusable = False
        self._stop_timer()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        self._mode = "end"
        self._stop_timer()
        if self.response_head is not None and not self.response_head.done():
            self.response_head.set_exception(exc)
            if self.done is not None and not self.done.done():
                self.done.cancel()  # nobody awaits the body of a response that never began
        elif self.done is not None and not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    # --- timer -------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        """On the pool's timer while a request is in flight."""
        if self._mode in ("", "end"):
            self._stop_timer()
            return
        if now - self._last > self.pool.read_timeout_s:
            self._fail(asyncio.TimeoutError(f"upstream silent for {self.pool.read_timeout_s:g} s"))
            return
        if self.on_tick is not None:
            self.on_tick()

    def _stop_timer(self) -> None:
        self.pool._busy.discard(self)

    # --- the caller's side -------------------------------------------------------------------

    def start(self, method: str, head: bytes) -> None:
        """Send a request head (and a small body with it); the response head is awaited next."""
        self._reset()
        self.head_method = method
        self.response_head = self.loop.create_future()
        self.done = self.loop.create_future()
        self._mode = "head"
        self._last = self._sent_s = time.monotonic()
        self.pool._watch(self)
        if self.lost or self.transport is None or self.transport.is_closing():
            self._fail(StaleConnection("upstream connection closed") if self.reused
                       else UpstreamError("upstream connection closed"))
            return
        self.transport.write(head)

    async def write_body(self, data: bytes) -> None:
        """A piece of a streamed request body (the caller frames it); waits while the upstream is slow to read."""
        if self.lost or self.transport is None:
            raise UpstreamError("upstream closed the connection")
        self.transport.write(data)
        self._last = time.monotonic()
        if self._write_ok is not None and not self._write_ok.done():
            await self._write_ok
            if self.lost:
                raise UpstreamError("upstream closed the connection")

    def take_early(self) -> bytes:
        """The body that came with the response head, before attach() (to send with the client's head)."""
        early, self._early = self._early, []
        return early[0] if len(early) == 1 else b"".join(early)

    async def peek_body(self, max_bytes: int, timeout_s: float) -> bytes | None:
        """A small whole body (its Content-Length up to `max_bytes`), read before attach() and left there to be relayed;
        None where it is larger, framed otherwise, or not whole within `timeout_s`."""
        try:
            n = int(self.headers.get("Content-Length", "")) if self.headers is not None else -1
        except ValueError:
            return None
        if self.chunked or not 0 <= n <= max_bytes or self.done is None:
            return None
        if n == 0:
            return b""
        try:
            await asyncio.wait_for(asyncio.shield(self.done), timeout_s)
        except Exception:  # cut or slow: not read here (the relay meets it)
            return None
        return b"".join(self._early)

    def attach(self, on_body) -> None:
        """From now on every read of the body goes to on_body(bytes), in the socket callback."""
        early, self._early = self._early, []
        self.on_body = on_body
        if early:
            on_body(early[0] if len(early) == 1 else b"".join(early), None)

    def pause(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def half_close(self, drain_s: float) -> bool:
        """The client left mid-response: end our side of the upstream connection (FIN), which llama.cpp, vLLM,
        SGLang and aiohttp servers take as the client gone and stop generating, but keep reading what the server
        still sends until it closes, at most `drain_s` (then `abort`): the tokens it generated before it noticed
        are counted for the request instead of being left to its counter alone. False where our side cannot be
        ended on its own (TLS): the caller aborts."""
        t = self.transport
        if self.lost or t is None or t.is_closing() or self._mode in ("", "head", "end"):
            return False
        try:
            if not t.can_write_eof():
                return False
            t.write_eof()
        except Exception:
            return False
        self.reusable = False
        self.draining = True
        t.resume_reading()  # a slow client's pause no longer applies: nothing is forwarded
        self.loop.call_later(drain_s, self._drain_over)
        return True

    def _drain_over(self) -> None:
        """A server that ignored the end of our side for `drain_s`: cut (harmless once it has closed)."""
        if not self.lost and self._mode not in ("", "end"):
            self.drain_cut = True
        self.abort()

    def abort(self, exc: BaseException | None = None) -> None:
        """Close the connection now: the server sees the client's disconnect and stops generating. A response
        head still awaited gets `exc` (cancelled without one)."""
        self.reusable = False
        self._stop_timer()
        self.on_body = None
        if self.transport is not None:
            self.transport.close()
        if self.response_head is not None and not self.response_head.done():
            if exc is None:
                self.response_head.cancel()
            else:
                self.response_head.set_exception(exc)
        if self.done is not None and not self.done.done():
            self.done.set_result(None)  # the caller knows why it aborted


class UpstreamPool:
    """Connections to one upstream (`http://` or `https://host:port[/prefix]`), kept alive between requests."""

    def __init__(self, url: str, connect_timeout_s: float, read_timeout_s: float, max_connections: int):
        u = urlsplit(url)
        self.scheme = u.scheme
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        default_port = self.port == (443 if u.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        # Free connection slots (None: no limit) and the requests waiting for one, first come first served; a
        # counter, not an asyncio.Semaphore: a request that finds a slot free takes it without a coroutine.
        self._free: int | None = max_connections if max_connections > 0 else None
        self._waiters: deque[asyncio.Future] = deque()
        self.loop = asyncio.get_running_loop()
        self._idle: deque[Exchange] = deque()
        # One timer for every request in flight (not one per request): read timeouts and on_tick.
        self._busy: set[Exchange] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._ssl = ssl.create_default_context() if u.scheme == "https" else None
        # Learned: the upstream closes its connection after a streamed answer without saying so (llama-server).
        self.closes_after_streams = False

    async def acquire(self, fresh: bool = False) -> Exchange:
        """A connection for one request: a kept-alive one unless `fresh`, else a new one."""
        if self._free is not None:
            if self._free > 0 and not self._waiters:
                self._free -= 1
            else:
                await self._wait_slot()
        try:
            now = time.monotonic()
            while self._idle and not fresh:
                ex = self._idle.pop()
                if (ex.reusable and not ex.lost and ex.transport is not None and not ex.transport.is_closing()
                        and now - ex.idle_since < IDLE_REUSE_S):
                    ex.reused = True
                    return ex
                if ex.transport is not None:
                    ex.transport.close()
            try:
                _t, ex = await asyncio.wait_for(
                    self.loop.create_connection(lambda: Exchange(self), self.host, self.port, ssl=self._ssl,
                                                server_hostname=self.host if self._ssl else None),
                    self.connect_timeout_s)
            except TimeoutError:
                # wait_for's has no message: the log said `unreachable: TimeoutError: ` and nothing else.
                raise TimeoutError(f"no connection within {self.connect_timeout_s:g} s (proxy.connect_timeout_s): "
                                   "the server is down, overloaded or not listening there") from None
            return ex
        except BaseException:
            self._give_slot()
            raise

    async def _wait_slot(self) -> None:
        fut = self.loop.create_future()
        self._waiters.append(fut)
        try:
            await fut  # done: a released slot was handed to this request
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._give_slot()  # handed a slot, then cancelled before it took it: the next one gets it
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _give_slot(self) -> None:
        if self._free is None:
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    def _watch(self, ex: Exchange) -> None:
        self._busy.add(ex)
        if self._timer is None:
            self._timer = self.loop.call_later(min(TICK_MAX_S, self.read_timeout_s), self._tick)

    def _tick(self) -> None:
        self._timer = None
        now = time.monotonic()
        for ex in list(self._busy):
            try:
                ex._tick(now)
            except Exception:  # one request's check must not stop the others'
                ex._stop_timer()
        if self._busy:
            self._timer = self.loop.call_later(min(TICK_MAX_S, self.read_timeout_s), self._tick)

    def release(self, ex: Exchange) -> None:
        """Back to the pool if its response ended cleanly and the upstream keeps it open; closed otherwise."""
        self._give_slot()
        ex.on_body = ex.on_tick = None
        if (ex.reusable and ex._mode == "end" and not ex.lost and ex.transport is not None
                and not (ex.chunked and self.closes_after_streams)):
            ex.transport.resume_reading()
            ex.idle_since = time.monotonic()
            self._idle.append(ex)
        elif ex.transport is not None:
            ex.transport.close()

    def _forget(self, ex: Exchange) -> bool:
        """Out of the idle connections; whether it was one."""
        try:
            self._idle.remove(ex)
        except ValueError:
            return False
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._idle:
            ex = self._idle.pop()
            if ex.transport is not None:
                ex.transport.close()
