"""Proxy worker processes on the daemon's own SO_REUSEPORT listening sockets, whose per-request records the daemon replays into its one ledger.

With `proxy.workers = N > 1` the daemon serves no proxy traffic itself: it binds and listens on N
SO_REUSEPORT sockets (the kernel spreads connections over them) and keeps them for its whole life,
so the port is never free; it starts N children (`powerprof.daemon.workers` in an isolated
interpreter, `spawn.py`), each serving one socket it inherits with the same `Proxy`, with a
recorder that ships compact records over a socketpair instead of calling the ledger. Per request:
a start (its fields), its first token on its own (exact time, for TTFT and the first-token edge),
later tokens coalesced per request into one (time of the latest, count) entry per flush (at most
`FLUSH_S` apart), and an end (counts, outcome, timings). A flush is one marshal'd frame; with few
requests in flight it goes out at once, so the short-request edges are read on time. Every
`BEAT_S` a heartbeat carries the worker's clock (the ledger closes no interval its records may
still reach) and its live request ids. The daemon checks each frame's types, gives each record a
request id of its own (unique across workers), mirrors the proxy's `RequestTrace` and calls its
recorder (ledger, latency histograms, tag counters) exactly as the in-process proxy does.

Fail-open: a worker forwards on its own; a daemon that stops reading costs coalesced token records
only (dropped, counted, their requests flagged), never the client's bytes; starts and ends wait.
A worker that dies, or is silent for SILENT_S, has its in-flight requests recorded as
`interrupted` (the error says which worker) and is restarted with backoff. Workers exit when the
daemon dies (PR_SET_PDEATHSIG, and the socket's EOF) and drain like the daemon on SIGTERM.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import marshal
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import astuple

from powerprof.arrival import COUNT_PROBLEM_KINDS
from powerprof.errtext import error_text

from . import streams
from .guard import quiet_bad_requests
from .proxy import REFUSALS_KEPT, SERVER_OPTIONS, Proxy, RequestTrace, bound_refusals
from .spawn import isolated_argv

log = logging.getLogger("powerprof.daemon.workers")

FLUSH_S = 0.02  # tokens of one request are coalesced over at most this long (their placement's resolution)
# A refused connect reaches the daemon in a flush at most FLUSH_S after it, and that frame's read: the scraper waits up
# to this long past a scrape's start for the workers' refusals before it judges its page (`Scraper._take_refusals`).
REFUSALS_LATE_S = 2 * FLUSH_S
SEND_BUFFER_MAX_BYTES = 8 << 20  # a daemon that stops reading: beyond this, token records are dropped (marked)
HELD_MAX_RECORDS = 200_000  # starts, first tokens and ends held for a daemon that does not read, at most
FRAME_MAX_BYTES = 64 << 20
HELLO_TIMEOUT_S = 60.0  # a loaded machine takes seconds to start Python and bind
STOP_TIMEOUT_S = 10.0  # SIGTERM: a worker cuts its requests after 2 s (like the daemon) and sends their records
LATE = 7  # the index of a worker's loop's lateness in its stats (ShippingRecorder._stats)
UNINSPECTED = 8  # …and of its Proxy's uninspected_bodies
UNFORWARDED = 9  # …and of its requests in progress not yet forwarded (Proxy.unforwarded): never shipped one by one
BODY_READER_FAILURES = 10  # …and of its Proxy's own faults reading a request body (Proxy.proxy_failures)
BEAT_S = 0.25  # a worker's heartbeat: its live requests and its clock (the ledger's horizon waits for it)
SILENT_S = 10.0  # a worker silent this long (stopped, wedged) is killed and restarted
# Ended unread spans kept for the ledger: one a worker life that spoke another shape and then the daemon's again (an
# upgrade under the daemon, then one back), a handful at most; the ledger closes intervals within seconds of one.
UNREAD_SPANS_KEPT = 64
RESTART_BACKOFF_S = (1.0, 60.0)  # a worker that keeps dying is restarted after 1, 2, 4 … 60 s
STABLE_S = 60.0  # a worker that lived this long restarts after the shortest delay again
LISTEN_BACKLOG = 1024
_HEAD = struct.Struct("<I")


# --- wire format: length-prefixed marshal frames (both ends are this package; marshal runs no code) ----------


def frame(msg) -> bytes:
    body = marshal.dumps(msg)
    return _HEAD.pack(len(body)) + body


class Unframer:
    """Bytes in, whole messages out (a frame may arrive in pieces)."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> list:
        self._buf += data
        out, pos, buf = [], 0, self._buf
        while len(buf) - pos >= 4:
            (n,) = _HEAD.unpack_from(buf, pos)
            if n > FRAME_MAX_BYTES:
                raise ValueError(f"frame of {n} bytes")
            if len(buf) - pos - 4 < n:
                break
            out.append(marshal.loads(bytes(buf[pos + 4:pos + 4 + n])))
            pos += 4 + n
        del buf[:pos]
        return out


def _start_record(tr: RequestTrace) -> tuple:
    # Its sequences (n choices × prompts) and choices with it: the ledger splits its intervals while it runs, before its
    # end. Its max_tokens too: a first token holding all it allows is the request's end (service.on_tokens reads the
    # edge then), and with the end alone it came too late for that.
    return (tr.request_id, tr.method, tr.endpoint, tr.tag, tr.arrival_ns, tr.arrival_wall_ns, tr.api, tr.model, tr.stream,
            tr.extra.get("sequences", 1), tr.extra.get("choices", 1), tr.extra.get("max_tokens"))


def _end_record(tr: RequestTrace) -> tuple:
    # With its start's fields: a request can end without a start (a body that timed out before it was
    # recorded), and the daemon counts those too, as the in-process proxy's recorder does.
    c = tr.counts
    return (_start_record(tr), tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome, tr.error, tr.first_ns, tr.first_wall_ns,
            tr.last_ns, tr.last_wall_ns, tr.tokens_seen, tr.response_bytes, tr.recorder_error, tr.api, tr.model,
            tr.stream, None if c is None else astuple(c), dict(tr.extra))


# --- the worker's side ------------------------------------------------------------------------------------


class ShippingRecorder:
    """The worker's recorder: batches what the proxy records and writes it to the daemon as frames.

    A daemon that does not read (its socket holds more than SEND_BUFFER_MAX_BYTES) costs coalesced
    token records only: they are dropped, and the tokens dropped are sent per request with the next
    frame that goes out, so its row is flagged. Starts, first tokens and ends are held until the
    daemon reads again (at most HELD_MAX_RECORDS; beyond that the oldest go, counted, and the
    heartbeat's live set lets the daemon end what it lost)."""

    def __init__(self, urgent_max_active: int, active=lambda: 0):
        self.urgent_max_active = urgent_max_active  # at most this many in flight: send at once (edges)
        self.active = active
        self.transport: asyncio.Transport | None = None
        self.dropped = 0  # records not sent: the daemon did not read
        self.proxy: Proxy | None = None
        self.bad_requests = None  # guard.BadRequestLog: the worker's malformed requests, for /metrics
        self.live: dict = {}  # request ids started and not ended (a dict: ordered, cheap to list)
        self._starts: list = []
        self._firsts: list = []
        self._tokens: dict = {}  # request id → [t_ns, n, trace]
        self._ends: list = []
        self._marks: dict = {}  # request id → tokens of its dropped records, not yet told to the daemon
        self._handle: asyncio.Handle | None = None
        self._urgent = False
        self.sent_ns = time.monotonic_ns()  # every record stamped before this has gone out (or was marked)
        self.late_us = 0  # how late this worker's loop woke for its latest heartbeat (the ledger's PROXY_LAG bound)

    def on_start(self, trace: RequestTrace) -> None:
        self.live[trace.request_id] = None
        self._starts.append(_start_record(trace))
        self._schedule(urgent=True)

    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None:
        if trace.first_ns == t_ns and trace.tokens_seen == n:  # the first: exact, on its own
            self._firsts.append((trace.request_id, t_ns, trace.first_wall_ns, n, trace.status, trace.stream,
                                 trace.extra.get("prompt_tokens"), trace.extra.get("cached_tokens")))
            self._schedule(urgent=True)
            return
        e = self._tokens.get(trace.request_id)
        if e is None:
            self._tokens[trace.request_id] = [t_ns, n, trace]
            self._schedule(urgent=False)
        else:
            e[0] = t_ns
            e[1] += n

    def on_end(self, trace: RequestTrace) -> None:
        self.live.pop(trace.request_id, None)
        self._ends.append(_end_record(trace))
        self._schedule(urgent=True)

    def _schedule(self, urgent: bool) -> None:
        if urgent and not self._urgent and self.active() <= self.urgent_max_active:
            if self._handle is not None:
                self._handle.cancel()
            self._urgent = True
            self._handle = asyncio.get_running_loop().call_soon(self.flush)
        elif self._handle is None:
            self._handle = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def _stats(self) -> tuple:
        p = self.proxy
        bad = self.bad_requests.rejected if self.bad_requests is not None else 0
        if p is None:
            return (0, 0, self.dropped, bad, 0, 0, 0, self.late_us, 0, 0, 0)
        return (p.recorder_failures, p.upstream_failures, self.dropped, bad, p.body_timeouts["silent"], p.body_timeouts["slow"],
                p.upstream_retries, self.late_us, p.uninspected_bodies, p.unforwarded, p.proxy_failures)

    def _writable(self) -> bool:
        tr = self.transport
        return tr is not None and not tr.is_closing() and tr.get_write_buffer_size() <= SEND_BUFFER_MAX_BYTES

    def flush(self) -> None:
        self._handle, self._urgent = None, False
        refused = self.proxy is not None and bool(self.proxy._refused_ns)
        if not (self._starts or self._firsts or self._tokens or self._ends or self._marks or refused):
            return
        toks = []
        for rid, (t, n, tr) in self._tokens.items():
            p, k = tr.extra.get("prompt_tokens"), tr.extra.get("cached_tokens")
            toks.append((rid, t, n, -1 if p is None else p, -1 if k is None else k))
        self._tokens = {}
        if not self._writable():
            # Tokens can be lost here (counted, and their requests marked); the edges of a request cannot.
            for rid, _t, n, _p, _k in toks:
                self._marks[rid] = self._marks.get(rid, 0) + n
            self.dropped += len(toks)
            self._bound_held()
            return
        now = time.monotonic_ns()
        # Its proxy's refused connects (at most REFUSALS_KEPT, Proxy.take_refusals) go with the end they came with: the
        # daemon's scraper finds the server down by them (`ProxyWorkers.take_refusals`); kept while it does not read.
        refusals = self.proxy.take_refusals() if refused else []
        msg = (self._starts, self._firsts, toks, self._ends, self._stats(), list(self._marks.items()), now, refusals)
        self._starts, self._firsts, self._ends, self._marks = [], [], [], {}
        self.transport.write(frame(msg))
        self.sent_ns = now

    def _bound_held(self) -> None:
        over = len(self._starts) + len(self._firsts) + len(self._ends) - HELD_MAX_RECORDS
        if over <= 0:
            return
        # The oldest go first: first tokens (their requests marked), then starts (the end carries a
        # start's fields), then ends (the daemon ends those requests from the heartbeat's live set).
        for name in ("_firsts", "_starts", "_ends"):
            held = getattr(self, name)
            k = min(over, len(held))
            if name == "_firsts":
                for f in held[:k]:
                    self._marks[f[0]] = self._marks.get(f[0], 0) + f[3]
            elif name == "_starts":
                for st in held[:k]:
                    self._marks.setdefault(st[0], 0)
            del held[:k]
            self.dropped += k
            over -= k
            if over <= 0:
                return

    def beat(self) -> None:
        """The heartbeat: whatever waits goes first, then this worker's clock and its live requests
        (with those whose end is still held: the daemon has not seen them end)."""
        self.flush()
        tr = self.transport
        if tr is None or tr.is_closing():
            return
        live = list(self.live)
        if self._ends:
            live += [e[0][0] for e in self._ends]
        # Refusals a full link kept back hold the clock too: the scraper waits for it to pass a scrape's start before it
        # takes the workers' refusals (Scraper._take_refusals), and stopped waiting without them.
        held = self._starts or self._firsts or self._ends or (self.proxy is not None and self.proxy._refused_ns)
        if not held:
            self.sent_ns = time.monotonic_ns()
        # Written even when the daemon does not read (a few bytes): its clock, not its records, is the
        # sign of life; a held end keeps its request in `live`, so the daemon ends nothing early.
        tr.write(frame(("beat", self.sent_ns, live, self._stats())))


class WorkerProxy(Proxy):
    """The proxy in a worker: a request whose recording broke still sends its end (in-process the ledger
    sees the end on the shared trace; the daemon's copy needs the record), and the daemon skips its
    recorder's on_end for it, as `Proxy._safe` does in-process."""

    def _safe(self, trace, fn, *args) -> None:
        if trace is not None and trace.recorder_error is not None and fn == self.recorder.on_end:
            try:
                fn(trace)
            except Exception:
                self.recorder_failures += 1
            return
        super()._safe(trace, fn, *args)


class _ParentLink(asyncio.Protocol):
    """The worker's end of the socketpair: EOF means the daemon is gone."""

    def __init__(self, gone: asyncio.Event):
        self.gone = gone

    def connection_lost(self, exc) -> None:
        self.gone.set()


async def _serve(spec: dict, sock: socket.socket) -> int:
    from aiohttp import web

    from .guard import ConnectionGuard

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)  # the daemon re-reads config; workers keep theirs
    shipper = ShippingRecorder(spec["urgent_max_active"])
    transport, _ = await loop.create_unix_connection(lambda: _ParentLink(stop), sock=sock)
    shipper.transport = transport
    proxy = WorkerProxy(spec["upstream"], recorder=shipper, **spec["proxy"])
    shipper.proxy = proxy
    shipper.active = lambda: proxy.active
    shipper.bad_requests = quiet_bad_requests()
    guard = ConnectionGuard(spec["header_timeout_s"], spec["idle_timeout_s"])
    app = proxy.app()
    app.middlewares.append(guard.middleware)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, keepalive_timeout=spec["idle_timeout_s"],
                           **SERVER_OPTIONS)
    await runner.setup()
    # The daemon's listening socket, open since before any worker started: serving it takes no bind.
    await web.SockSite(runner, socket.socket(fileno=spec["listen_fd"])).start()
    guard.watch(runner.server)
    # With the shape of the records it will send (LINK_SHAPE): a worker started after an in-place upgrade speaks the
    # new code's records to a daemon that still reads the old ones.
    transport.write(frame(("hello", os.getpid(), LINK_SHAPE)))

    async def beats():
        loop = asyncio.get_running_loop()
        while True:
            asleep = loop.time()
            await asyncio.sleep(BEAT_S)
            # How late this loop woke: how late it could read the server's tokens then (a loaded host).
            shipper.late_us = max(0, int((loop.time() - asleep - BEAT_S) * 1e6))
            shipper.beat()

    beating = asyncio.create_task(beats())
    await stop.wait()
    beating.cancel()
    await guard.stop()
    await runner.cleanup()  # in-flight requests get shutdown_timeout, then are cut and recorded
    shipper.flush()
    shipper.beat()  # the live set after the drain: requests cut by the stop have ended by now
    if not transport.is_closing():
        if transport.can_write_eof():
            transport.write_eof()
        for _ in range(100):  # let the last frame leave
            if transport.get_write_buffer_size() == 0:
                break
            await asyncio.sleep(0.01)
        transport.close()
    return 0


def worker_main() -> int:
    """One proxy worker (`isolated_argv("powerprof.daemon.workers")`): its spec (JSON) on stdin, the fds of its
    socket to the daemon and of the listening socket in it."""
    spec = json.load(sys.stdin)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG: drain when the daemon dies
    except (OSError, AttributeError):
        pass
    if os.getppid() != spec["parent_pid"]:
        return 1  # the daemon died before the line above
    logging.basicConfig(level=spec["log_level"], format=spec["log_format"])
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    quiet_bad_requests()
    sock = socket.socket(fileno=spec["fd"])
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(spec, sock))
    return uvloop.run(_serve(spec, sock))


# --- the daemon's side ------------------------------------------------------------------------------------

_I, _IN, _S, _SN, _BN, _FN = "int", "int?", "str", "str?", "bool?", "float?"
_START = (_I, _S, _S, _SN, _I, _I, _SN, _SN, _BN, _I, _I, _IN)
_FIRST = (_I, _I, _I, _I, _IN, _BN, _FN, _FN)  # ... its prompt's length and cached count, where said early
_TOK = (_I, _I, _I, "float", "float")
_END_REST = (_IN, _IN, _IN, _SN, _SN, _IN, _IN, _IN, _IN, _I, _I, _SN, _SN, _SN, _BN)
_COUNTS = (_IN, _IN, _SN, _SN, _S, _FN, _BN, _SN, _SN, "bool", _SN, _SN, _SN, "bool", _IN, _I, _IN,
           "bool", "stops", "bool", _SN, _IN, _IN)  # streams.Counts, in its order
# ShippingRecorder._stats: recorder and upstream failures, records dropped, malformed requests, body timeouts (silent,
# slow), upstream retries
_STATS = (_I,) * 11  # ShippingRecorder._stats: its counters, its loop's lateness (µs: LATE), its uninspected bodies, its
# requests not yet forwarded (UNFORWARDED), its body reader's failures (BODY_READER_FAILURES)
_END_LEN = 18  # an end record's parts: its start, _END_REST, its counts, its extra
# A flush's parts: starts, first tokens, tokens, ends, stats, dropped-token marks, watermark, refused connects' times
# (8 since the refusals were shipped; 7 before, a worker of that code another LINK_SHAPE).
_FLUSH_LEN = 8
# The link's record shapes, said in each worker's hello: the daemon checks every record's length exactly, so a worker
# started from code upgraded in place under a running daemon (the counts record grew from 18 to 20 fields) had every
# record refused as an "unreadable frame", restarted, refused, for ever. A hello of another shape is said once and
# that worker is not restarted (ProxyWorkers._upgraded).
LINK_SHAPE = hashlib.sha256(repr((_START, _FIRST, _TOK, _END_REST, _COUNTS, _STATS, _END_LEN,
                                  _FLUSH_LEN)).encode()).hexdigest()[:16]


def _ok(v, kind: str) -> bool:
    if v is None:
        return kind.endswith("?")
    k = kind.rstrip("?")
    if k == "int":
        return type(v) is int or type(v) is bool
    if k == "bool":
        return type(v) is bool
    if k == "float":
        return type(v) in (int, float)
    if k == "stops":  # Counts.choice_stops: a finish reason by choice index
        return type(v) is dict and all(type(i) is int and type(r) is str for i, r in v.items())
    return type(v) is str


def _check(rec, shape: tuple, what: str) -> None:
    if type(rec) not in (tuple, list) or len(rec) != len(shape) or not all(_ok(v, k) for v, k in zip(rec, shape)):
        raise ValueError(f"malformed {what} record {rec!r:.200}")


def check_message(msg) -> None:
    """A frame's shape and types, checked before any of it reaches the recorder (a string where a time
    belongs would wedge the ledger's every later interval). ValueError says what is wrong."""
    if type(msg) is not tuple or not msg:
        raise ValueError(f"malformed message {msg!r:.200}")
    if msg[0] == "hello":
        return _check(msg, (_S, _I, _S), "hello")
    if msg[0] == "beat":
        _check(msg[:2], (_S, _I), "beat")
        if len(msg) != 4 or type(msg[2]) is not list or not all(type(r) is int for r in msg[2]):
            raise ValueError(f"malformed beat {msg!r:.200}")
        return _check(msg[3], _STATS, "stats")
    if len(msg) != _FLUSH_LEN:
        raise ValueError(f"malformed message of {len(msg)} parts")
    starts, firsts, toks, ends, stats, marks, watermark, refusals = msg
    for part in (starts, firsts, toks, ends, marks, refusals):
        if type(part) is not list:
            raise ValueError(f"malformed message part {part!r:.200}")
    if len(refusals) > REFUSALS_KEPT or not all(type(t) is int for t in refusals):
        raise ValueError(f"malformed refusals {refusals!r:.200}")
    for r in starts:
        _check(r, _START, "start")
    for r in firsts:
        _check(r, _FIRST, "first-token")
    for r in toks:
        _check(r, _TOK, "token")
    for e in ends:
        if type(e) is not tuple or len(e) != _END_LEN or type(e[17]) is not dict:
            raise ValueError(f"malformed end record {e!r:.200}")
        _check(e[0], _START, "end's start")
        _check(e[1:16], _END_REST, "end")
        if e[16] is not None:
            _check(e[16], _COUNTS, "end's counts")
            # The kind becomes a /metrics label: only a known one, and only beside its message.
            if (e[16][11] is None) != (e[16][10] is None) or e[16][11] not in (None, *COUNT_PROBLEM_KINDS):
                raise ValueError(f"malformed end's counts record {e[16]!r:.200}")
    for m in marks:
        _check(m, (_I, _I), "dropped-tokens")
    _check(stats, _STATS, "stats")
    _check((watermark,), (_I,), "watermark")


class _WorkerLink(asyncio.Protocol):
    def __init__(self, owner: "ProxyWorkers", worker: "_Worker"):
        self.owner, self.worker, self.unframer = owner, worker, Unframer()
        self.unread = False  # this life of the worker spoke another record shape and serves on: its records not read

    def data_received(self, data: bytes) -> None:
        self.owner.record_bytes += len(data)
        self.worker.heard_s = time.monotonic()  # an unread worker too: it lives, and is not killed as silent
        if self.unread:
            return  # records of a shape the daemon cannot read (ProxyWorkers._upgraded): its traffic is not attributed
        try:
            msgs = self.unframer.feed(data)
            for m in msgs:
                if type(m) is tuple and m and m[0] == "hello" and (len(m) < 3 or m[2] != LINK_SHAPE):
                    # Before its records are read: each would be refused as unreadable, and the worker restarted.
                    self.owner._upgraded(self.worker, m[2] if len(m) > 2 else None)
                    self.unread = self.worker.unread
                    return
                check_message(m)
        except Exception as e:
            # A worker that sends what it cannot have meant is broken: its link goes, its requests end
            # marked (the failure path of a worker that dies), and it is restarted.
            self.owner._failed(f"unreadable frame from proxy worker {self.worker.index}: {error_text(e)}")
            if self.worker.transport is not None:
                self.worker.transport.close()
            return
        for m in msgs:
            try:
                self.owner._replay(self.worker, m)
            except Exception as e:  # a bug here must not cost the link (and so the worker)
                self.owner._failed(error_text(e))

    def connection_lost(self, exc) -> None:
        self.owner._lost(self.worker)


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.transport: asyncio.Transport | None = None
        self.hello: asyncio.Future | None = None
        self.closed: asyncio.Future | None = None
        self.stats = (0,) * len(_STATS)  # its counters: ShippingRecorder._stats
        self.base = (0,) * len(_STATS)  # the same, summed over its earlier lives
        self.started_s = 0.0
        self.heard_s = 0.0  # when its socket last brought anything
        self.said_hello = False
        self.silenced = False  # killed for its silence (counted as that, not as an exit)
        self.watermark_ns: int | None = None  # every token it stamped before this has reached us (or was marked)
        self.served = 0  # requests it ended, over all its lives
        self.failures = 0  # deaths in a row, each within STABLE_S of its start (the restart backoff)
        self.retired = False  # it spoke another record shape (an upgrade under the daemon): not restarted
        self.unread = False  # it spoke another shape as the last worker: it serves on, its records not read


class ProxyWorkers:
    """The daemon's side: opens the listening sockets, starts and restarts the workers, replays their
    records into `recorder`.

    Offers what the daemon reads of an in-process `Proxy` (`active`, `recorder_failures`,
    `upstream_failures`) and `cleanup()` like an aiohttp runner, so the daemon's shutdown stops it."""

    def __init__(self, n: int, upstream: str, listen_host: str, listen_port: int, recorder, proxy_kwargs: dict,
                 header_timeout_s: float, idle_timeout_s: float, urgent_max_active: int = 4,
                 log_format: str = "%(levelname)s %(name)s: %(message)s"):
        self.n = n
        self.recorder = recorder
        if proxy_kwargs.get("max_connections"):  # the upstream's bound holds for all workers together
            proxy_kwargs = {**proxy_kwargs, "max_connections": max(1, proxy_kwargs["max_connections"] // n)}
        self.host, self.port = listen_host, listen_port
        self.spec = {"upstream": upstream, "proxy": proxy_kwargs, "header_timeout_s": header_timeout_s,
                     "idle_timeout_s": idle_timeout_s, "urgent_max_active": urgent_max_active,
                     "log_format": log_format}
        self.workers = [_Worker(k) for k in range(n)]
        self.mirrors: dict[tuple[int, int], RequestTrace] = {}
        self.marked: dict[tuple[int, int], int] = {}  # (worker, request) → its tokens whose records were dropped
        self._ids = itertools.count(1)
        self.sockets: list[socket.socket] = []  # one listening socket per worker, open for our whole life
        self._watch: asyncio.TimerHandle | None = None
        self._checked_s = 0.0  # when _check_silence last ran
        self.closing = False
        self.restarts = {"exited": 0, "silent": 0}
        self.replay_failures = 0
        self.lost_requests = 0  # in flight in a worker that died, or lost with its dropped records
        # Not yet forwarded in a worker that died, as its last heartbeat said them: no row (the worker shipped nothing
        # of them), counted and logged here.
        self.lost_unforwarded = 0
        self.record_bytes = 0  # received from the workers
        self.unread_since_ns: int | None = None  # monotonic: since when a worker serves unread (None: none does)
        # The ended spans of that state, (since, until), monotonic, the latest UNREAD_SPANS_KEPT: the ledger closes
        # intervals after the state ends (a new life speaks the daemon's shape first), and those that held unread
        # traffic still say proxy_unread by them (ledger.proxy_unread_spans).
        self.unread_spans: deque = deque(maxlen=UNREAD_SPANS_KEPT)
        # The workers' refused connects to the upstream (time.monotonic_ns(), one clock for all processes) since the
        # last `take_refusals`, as `Proxy._refused_ns`.
        self._refused_ns: list[int] = []
        # While a scrape waits (`wait_refusals`, its own loop's): set as a worker's clock may have moved (a frame or
        # beat replayed, a worker lost).
        self._clock_moved: asyncio.Event | None = None

    # what the daemon reads, as of an in-process Proxy
    refusals_late_s = REFUSALS_LATE_S

    async def wait_refusals(self, at_ns: int, timeout_s: float) -> None:
        """Until every worker's refusals before `at_ns` (time.monotonic_ns()) have come (`watermark_ns`; no worker up:
        at once), at most `timeout_s` (the scraper's: up to REFUSALS_LATE_S past a scrape's start,
        `Scraper._take_refusals`). Woken by the records that may move a worker's clock, not polled: a poll every 10 ms
        woke the daemon's loop 4 times a scrape while an idle worker (its clock said only at its heartbeat) held it."""
        until_s = time.monotonic() + timeout_s
        moved = self._clock_moved = asyncio.Event()
        try:
            while (through := self.watermark_ns) is not None and through < at_ns:
                left_s = until_s - time.monotonic()
                if left_s <= 0:
                    return
                moved.clear()  # one loop: no record is replayed between the look above and this wait
                try:
                    await asyncio.wait_for(moved.wait(), left_s)
                except asyncio.TimeoutError:
                    return
        finally:
            self._clock_moved = None

    def _note_clock_moved(self) -> None:
        if self._clock_moved is not None:
            self._clock_moved.set()

    def take_refusals(self) -> list[int]:
        """As `Proxy.take_refusals`, for all workers: those their records brought (a flush, FLUSH_S at most after the
        refusal on a worker not late; the scraper waits for them, `wait_refusals`)."""
        out, self._refused_ns = self._refused_ns, []
        return out

    @property
    def active(self) -> int:
        return len(self.mirrors)

    @property
    def recorder_failures(self) -> int:
        """Requests whose replay or recording failed (the workers' and ours); records dropped are apart."""
        return self.replay_failures + sum(w.base[0] + w.stats[0] for w in self.workers)

    @property
    def records_dropped(self) -> int:
        """Records a worker could not ship (the daemon did not read): each marked on its request."""
        return sum(w.base[2] + w.stats[2] for w in self.workers)

    @property
    def upstream_failures(self) -> int:
        return sum(w.base[1] + w.stats[1] for w in self.workers)

    @property
    def upstream_retries(self) -> int:
        return sum(w.base[6] + w.stats[6] for w in self.workers)

    @property
    def body_timeouts(self) -> dict:
        """Request bodies the workers answered 408, by rule."""
        return {rule: sum(w.base[k] + w.stats[k] for w in self.workers) for k, rule in ((4, "silent"), (5, "slow"))}

    @property
    def uninspected_bodies(self) -> int:
        """Request bodies the workers streamed on uninspected, over their inspection budget."""
        return sum(w.base[UNINSPECTED] + w.stats[UNINSPECTED] for w in self.workers)

    @property
    def proxy_failures(self) -> int:
        """The workers' own faults reading a request body (a bug), as an in-process Proxy's proxy_failures."""
        return sum(w.base[BODY_READER_FAILURES] + w.stats[BODY_READER_FAILURES] for w in self.workers)

    @property
    def malformed_requests(self) -> int:
        """Requests the workers' HTTP parsers rejected (400, never forwarded)."""
        return sum(w.base[3] + w.stats[3] for w in self.workers)

    @property
    def unread_workers(self) -> int:
        """Workers serving whose records the daemon cannot read (_upgraded): their traffic is forwarded, not attributed."""
        # Counted through a crashing unread worker's restart back-off and start too (until a new life says the
        # daemon's shape: _replay): the gauge at 0 there read as "all read again" to the tuner and to alerts.
        return sum(1 for w in self.workers if w.unread and not w.retired)

    @property
    def watermark_ns(self) -> int | None:
        """Every worker's token records stamped before this have been replayed: the ledger's intervals
        may close up to here. None: no worker is up (its lost tokens cannot come)."""
        marks = [w.watermark_ns for w in self.workers if w.transport is not None and w.watermark_ns is not None]
        return min(marks) if marks else None

    def open_sockets(self) -> None:
        """Bind and listen on the address, one SO_REUSEPORT socket per worker (port 0 picks one port for
        all), before any worker starts; they stay open until cleanup(), so the port is never free for
        another process to take, and connections wait in their queues while a worker restarts."""
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        if self.port:
            # Without SO_REUSEPORT first: a port another process (of this user) serves with SO_REUSEPORT,
            # say a second daemon with workers, would otherwise be joined silently and its traffic split.
            with socket.socket(fam, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((self.host, self.port))
        try:
            for _ in range(self.n):
                s = socket.socket(fam, socket.SOCK_STREAM)
                self.sockets.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind((self.host, self.port))
                s.listen(LISTEN_BACKLOG)
                s.set_inheritable(False)
                self.port = s.getsockname()[1]
        except OSError:
            self.close_sockets()
            raise

    def close_sockets(self) -> None:
        for s in self.sockets:
            s.close()
        self.sockets = []

    async def start(self) -> tuple[str, int]:
        """Open the listening sockets, start the workers, wait until each serves. OSError when the address
        cannot be had; RuntimeError when a worker does not start."""
        self.open_sockets()
        for w in self.workers:
            self._spawn(w)
        try:
            for w in self.workers:
                await asyncio.wait_for(asyncio.shield(w.hello), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await self.cleanup()
            raise RuntimeError(f"proxy workers did not start: {e or 'no answer in %g s' % HELLO_TIMEOUT_S}") from None
        self._checked_s = time.monotonic()
        self._watch = asyncio.get_running_loop().call_later(1.0, self._check_silence)
        log.info("%d proxy workers listening on port %d (pids %s)", self.n, self.port,
                 ", ".join(str(w.proc.pid) for w in self.workers))
        return self.host, self.port

    def _spawn(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        listen = self.sockets[w.index]
        spec = {**self.spec, "index": w.index, "fd": theirs.fileno(), "listen_fd": listen.fileno(),
                "parent_pid": os.getpid(), "log_level": logging.getLogger("powerprof").getEffectiveLevel()}
        try:
            # Started from the loop's thread, which lives as long as the daemon (PR_SET_PDEATHSIG follows the
            # thread). Its own session: a Ctrl-C at the terminal reaches the daemon, which stops the workers.
            w.proc = subprocess.Popen(isolated_argv("powerprof.daemon.workers"), stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(), listen.fileno()),
                                      text=True, start_new_session=True, cwd="/")
            try:
                w.proc.stdin.write(json.dumps(spec))
                w.proc.stdin.close()
            except BrokenPipeError:  # it died at once: its socket's EOF follows, and with it the restart
                pass
        finally:
            theirs.close()
        w.started_s = w.heard_s = time.monotonic()
        w.said_hello = False
        w.watermark_ns = None
        w.hello = loop.create_future()
        w.hello.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: only start() waits
        w.closed = loop.create_future()
        ours.setblocking(False)
        self._connect(w, ours)

    def _connect(self, w: _Worker, sock: socket.socket) -> None:
        async def connect():
            w.transport, _p = await asyncio.get_running_loop().create_unix_connection(
                lambda: _WorkerLink(self, w), sock=sock)

        def done(f: asyncio.Future) -> None:
            if f.cancelled() or f.exception() is not None:
                sock.close()
                self._lost(w)

        asyncio.get_running_loop().create_task(connect()).add_done_callback(done)

    def _check_silence(self) -> None:
        """A worker that sends nothing (not even its heartbeat) for SILENT_S is stopped or wedged: its
        clients wait for nothing. Killed, it is restarted like any worker that dies."""
        if self.closing:
            return
        now = time.monotonic()
        if now - self._checked_s > 3.0:
            # Our own loop stalled: what the workers sent meanwhile is unread, not missing (uvloop runs due
            # timers before it reads sockets). Each gets a fresh window.
            for w in self.workers:
                w.heard_s = max(w.heard_s, now)
        self._checked_s = now
        for w in self.workers:
            limit = SILENT_S if w.said_hello else HELLO_TIMEOUT_S
            if w.proc is not None and w.transport is not None and now - w.heard_s > limit:
                self.restarts["silent"] += 1
                log.error("proxy worker %d (pid %d) sent nothing for %.0f s (stopped or wedged): killing it",
                          w.index, w.proc.pid, now - w.heard_s)
                w.proc.kill()
                w.silenced = True
                w.heard_s = now  # once: its socket's EOF follows, then the restart
        self._watch = asyncio.get_running_loop().call_later(1.0, self._check_silence)

    # --- replay ------------------------------------------------------------------------------------------

    def _failed(self, why: str) -> None:
        self.replay_failures += 1
        if self.replay_failures <= 5 or self.replay_failures % 1000 == 0:
            log.warning("replaying a proxy worker's records failed (traffic unaffected, %d so far): %s",
                        self.replay_failures, why)

    def _call(self, fn, trace: RequestTrace, *args) -> None:
        if trace.recorder_error is not None:
            return
        try:
            fn(trace, *args)
        except Exception as e:  # like Proxy._safe: the record is marked, the rest goes on
            trace.recorder_error = error_text(e)[:300]
            self._failed(trace.recorder_error)

    def _mark(self, tr: RequestTrace, n_tokens: int) -> None:
        """Its row says that records of it were dropped, and how many of its tokens were not placed."""
        note = (f"records of this request were dropped ({n_tokens} token(s) not attributed): the daemon fell behind "
                "reading its proxy worker")
        tr.error = note if tr.error is None else f"{tr.error}; {note}"

    def _replay(self, w: _Worker, msg) -> None:
        if msg[0] == "hello":
            w.said_hello = True
            w.unread = False  # this life speaks the daemon's shape (the code on disk is the daemon's again)
            if not self.unread_workers and self.unread_since_ns is not None:
                self.unread_spans.append((self.unread_since_ns, time.monotonic_ns()))
                self.unread_since_ns = None
            if not w.hello.done():
                w.hello.set_result(msg[1])
            return
        if msg[0] == "beat":
            _beat, w.watermark_ns, live, stats = msg
            self._note_clock_moved()
            w.stats = tuple(stats)
            self._reconcile(w, set(live))
            note = getattr(self.recorder, "note_proxy_delay", None)
            if note is not None:
                # The latest lateness of every worker's loop, the most of them (a token may reach any of them); one
                # silent past its beat is at least that late (stopped on a loaded host: its last beat said nothing).
                # One still starting (no hello yet) serves nothing: its silence delays no token (counted, a restarted
                # worker's start marked windows proxy_lag for nothing).
                now = time.monotonic()
                note(time.monotonic_ns(), max(max(x.stats[LATE] / 1e6, now - x.heard_s - BEAT_S if x.said_hello else 0.0)
                                              for x in self.workers if x.proc is not None))
            return
        starts, firsts, toks, ends, stats, marks, watermark, refusals = msg
        w.stats = tuple(stats)
        if refusals:
            # All workers' together, as one in-process proxy keeps them (a worker's come in order; across workers not).
            self._refused_ns = sorted(self._refused_ns + refusals)
            bound_refusals(self._refused_ns)
        rec, mirrors = self.recorder, self.mirrors
        for rid, method, endpoint, tag, arr, arr_wall, api, model, stream, seqs, choices, limit in starts:
            tr = RequestTrace(request_id=next(self._ids), method=method, endpoint=endpoint, tag=tag, arrival_ns=arr,
                              arrival_wall_ns=arr_wall, api=api, model=model, stream=stream)
            if seqs > 1:
                tr.extra["sequences"] = seqs
            if choices > 1:
                tr.extra["choices"] = choices
            if limit is not None:
                tr.extra["max_tokens"] = limit
            mirrors[(w.index, rid)] = tr
            self._call(rec.on_start, tr)
        for rid, t, wall, n, status, stream, prompt, cached in firsts:
            tr = mirrors.get((w.index, rid))
            if tr is None:
                self.marked[(w.index, rid)] = self.marked.get((w.index, rid), 0) + n
                continue
            tr.first_ns = tr.last_ns = t
            tr.first_wall_ns = tr.last_wall_ns = wall
            tr.tokens_seen += n
            tr.status = status
            if stream is not None:
                tr.stream = stream
            if prompt is not None:
                tr.extra["prompt_tokens"] = prompt
            if cached is not None:
                tr.extra["cached_tokens"] = cached
            self._call(rec.on_tokens, tr, t, n)
        wall_offset = time.time_ns() - time.monotonic_ns()  # wall stamps of later tokens: only rows read them,
        for rid, t, n, prompt, cached in toks:  # and the end record brings the exact last one
            tr = mirrors.get((w.index, rid))
            if tr is None:
                self.marked[(w.index, rid)] = self.marked.get((w.index, rid), 0) + n
                continue
            tr.last_ns, tr.last_wall_ns = t, t + wall_offset
            tr.tokens_seen += n
            if prompt >= 0 and "prompt_tokens" not in tr.extra:
                tr.extra["prompt_tokens"] = prompt
            if cached >= 0 and "cached_tokens" not in tr.extra:
                tr.extra["cached_tokens"] = cached
            self._call(rec.on_tokens, tr, t, n)
        for rid, n in marks:
            self.marked[(w.index, rid)] = self.marked.get((w.index, rid), 0) + n
        for e in ends:
            key = (w.index, e[0][0])
            tr = mirrors.pop(key, None)
            if tr is None:  # never started (or its start was dropped): recorded from the end's copy
                rid, method, endpoint, tag, arr, arr_wall, api, model, stream, _seqs, _choices, _limit = e[0]  # its end's extra has them
                tr = RequestTrace(request_id=next(self._ids), method=method, endpoint=endpoint, tag=tag,
                                  arrival_ns=arr, arrival_wall_ns=arr_wall, api=api, model=model, stream=stream)
                if key in self.marked:  # its start was dropped, not absent: it gets its row, flagged
                    self._call(rec.on_start, tr)
            (_start, tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome, tr.error, tr.first_ns, tr.first_wall_ns,
             tr.last_ns, tr.last_wall_ns, tr.tokens_seen, tr.response_bytes, err, tr.api, tr.model, tr.stream,
             counts, extra) = e
            tr.counts = None if counts is None else streams.Counts(*counts)
            tr.extra.update(extra)
            if key in self.marked:
                self._mark(tr, self.marked.pop(key))
            w.served += 1
            if tr.recorder_error is None:
                tr.recorder_error = err  # as in-process: a request whose recording broke gets no on_end
            self._call(rec.on_end, tr)
        w.watermark_ns = watermark
        self._note_clock_moved()

    def _reconcile(self, w: _Worker, live: set) -> None:
        """A heartbeat lists the worker's requests in flight: one we still hold open that it does not
        list ended in records it had to drop. Ended here, marked, so it takes no later energy."""
        gone = [k for k in self.mirrors if k[0] == w.index and k[1] not in live]
        if not gone:
            return
        for k in gone:
            tr = self.mirrors.pop(k)
            # Ended at the last we know of it: it takes no energy past that (its row says what is missing).
            if tr.last_ns is not None:
                tr.end_ns, tr.end_wall_ns = tr.last_ns, tr.last_wall_ns
            else:
                tr.end_ns, tr.end_wall_ns = tr.arrival_ns, tr.arrival_wall_ns
            tr.outcome = "interrupted"
            tr.error = (f"proxy worker {w.index} ended this request but its end record was dropped (the daemon "
                        "fell behind reading it); ended when its heartbeat no longer listed it")
            if k in self.marked:
                self._mark(tr, self.marked.pop(k))
            self._call(self.recorder.on_end, tr)
        self.lost_requests += len(gone)
        log.warning("proxy worker %d: %d request(s) whose end record was dropped ended from its heartbeat",
                    w.index, len(gone))
        for k in [k for k in self.marked if k[0] == w.index and k[1] not in live]:
            del self.marked[k]  # tokens of requests we never saw start (nor end): counted in records_dropped

    # --- a worker that dies ------------------------------------------------------------------------------

    def _lost(self, w: _Worker) -> None:
        """Its socket closed: the worker exited or is exiting. Its open requests end here, marked; once
        reaped, it is restarted."""
        if w.transport is None and w.proc is None:
            return
        if w.transport is not None:
            w.transport.close()
            w.transport = None
            self._note_clock_moved()  # its clock no longer holds the others' (`watermark_ns`)
        now, wall = time.monotonic_ns(), time.time_ns()
        lost = [k for k in self.mirrors if k[0] == w.index]
        pid = w.proc.pid if w.proc is not None else "?"
        for k in lost:
            tr = self.mirrors.pop(k)
            tr.end_ns, tr.end_wall_ns = now, wall
            tr.outcome = "interrupted"
            tr.error = (f"proxy worker {w.index} (pid {pid}) exited while this request was in flight; what it "
                        "recorded after its last flush is lost")
            self._call(self.recorder.on_end, tr)
        for k in [k for k in self.marked if k[0] == w.index]:
            del self.marked[k]
        self.lost_requests += len(lost)
        unsent = w.stats[UNFORWARDED]  # a gauge, as of its last frame: not summed into base
        self.lost_unforwarded += unsent
        w.base = tuple(a + (0 if i == UNFORWARDED else b) for i, (a, b) in enumerate(zip(w.base, w.stats)))
        w.stats = (0,) * len(_STATS)
        w.watermark_ns = None
        if lost:
            log.error("proxy worker %d (pid %s) is gone: %d request(s) in flight in it recorded as interrupted",
                      w.index, pid, len(lost))
        if unsent:
            # Before, these went with no trace: the worker ships a request only once it forwards it.
            log.error("proxy worker %d (pid %s) is gone: %d request(s) it had not forwarded yet (their bodies still "
                      "coming; the server never saw them) are lost with no row, as of its last heartbeat; counted in "
                      "powerprof_proxy_lost_unforwarded_requests_total", w.index, pid, unsent)
        self._reap(w, time.monotonic() + STOP_TIMEOUT_S)

    def _reap(self, w: _Worker, deadline: float) -> None:
        """Wait for the process without blocking the loop (its socket closes a moment before it exits)."""
        proc = w.proc
        rc = proc.poll() if proc is not None else -1
        if rc is None and time.monotonic() < deadline:
            asyncio.get_running_loop().call_later(0.05, self._reap, w, deadline)
            return
        if rc is None:
            proc.kill()
            rc = proc.wait()
        w.proc = None
        if w.hello is not None and not w.hello.done():
            w.hello.set_exception(RuntimeError(f"proxy worker {w.index} exited with status {rc}"))
        if w.closed is not None and not w.closed.done():
            w.closed.set_result(rc)
        if self.closing:
            if rc != 0:
                log.info("proxy worker %d exited with status %s", w.index, rc)
            return
        if w.retired:
            return  # another record shape (_upgraded): a restart would run the same code
        # Backoff: a worker that keeps dying soon after its start waits 1, 2, 4 … 60 s; one that lived a
        # stable minute starts again from 1 s.
        w.failures = 1 if time.monotonic() - w.started_s >= STABLE_S else w.failures + 1
        lo, hi = RESTART_BACKOFF_S
        delay = min(hi, lo * 2 ** (w.failures - 1))
        if not w.silenced:
            self.restarts["exited"] += 1
        w.silenced = False
        if w.failures <= 3 or delay >= hi and w.failures % 10 == 0:
            log.error("proxy worker %d exited with status %s; restarting it in %g s (%d in a row)%s", w.index, rc,
                      delay, w.failures, "" if w.failures < 3 else "; this line is logged every 10th time from now")
        asyncio.get_running_loop().call_later(delay, self._restart, w)

    def _upgraded(self, w: _Worker, theirs) -> None:
        """Worker `w` said a record shape not the daemon's (LINK_SHAPE): powerprof was upgraded (or downgraded) in
        place under the running daemon. Said once, in words that name the fix; the worker is stopped and not
        restarted (a restart runs the same new code); its listening socket is closed where another worker still
        serves, so the kernel sends its share of connections to those. The last worker is not stopped: with every one
        retired, the port (the daemon's sockets, still bound) accepted nothing and the user's requests hung until
        their clients gave up. The proxy is fail-open: that worker serves and forwards on, its records unread (its
        traffic not attributed: the server's counter shows it as bypass traffic; without a complete one it is idle,
        unmeasured, and the intervals say SERVER_COUNT_PROXY_UNREAD: unread_since_ns), said (unread_workers, the log),
        and restarted if it dies."""
        if all(x.retired for x in self.workers if x is not w):
            w.unread = True
            if self.unread_since_ns is None:
                self.unread_since_ns = time.monotonic_ns()
            if not getattr(self, "_said_unread", False):
                self._said_unread = True
                log.error("powerprof was upgraded under the daemon: proxy worker %d (pid %s), the last one, speaks "
                          "another record shape (%s, the daemon's %s); it keeps serving the port so that traffic flows, "
                          "but its requests are not attributed (no rows; their energy is bypass traffic's, "
                          "`unproxied`, where the daemon reads the server's token counter; otherwise it is in idle, "
                          "unmeasured; the intervals say server_count proxy_unread where it is not measured; "
                          "powerprof_proxy_workers_unread): restart the daemon", w.index,
                          w.proc.pid if w.proc is not None else "?", theirs, LINK_SHAPE)
            w.said_hello = True  # it serves
            if w.hello is not None and not w.hello.done():
                w.hello.set_result(w.proc.pid if w.proc is not None else 0)
            return
        w.retired = True
        if not getattr(self, "_said_upgraded", False):
            self._said_upgraded = True
            log.error("powerprof was upgraded under the daemon: proxy worker %d (pid %s) started from the new code "
                      "speaks another record shape (%s, the daemon's %s), which the daemon cannot read; it is not "
                      "restarted, nor any other worker that does so: restart the daemon", w.index,
                      w.proc.pid if w.proc is not None else "?", theirs, LINK_SHAPE)
        if w.hello is not None and not w.hello.done():
            w.hello.set_exception(RuntimeError(f"proxy worker {w.index} speaks another record shape (powerprof "
                                               "upgraded under the daemon): restart it"))
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()
        if w.transport is not None:
            w.transport.close()  # its EOF ends its requests marked and reaps it (_lost), not restarted
        if any(not x.retired for x in self.workers) and w.index < len(self.sockets):
            self.sockets[w.index].close()  # queued there, a client would wait for a worker that never comes

    def _restart(self, w: _Worker) -> None:
        if self.closing or w.retired:
            return
        try:
            self._spawn(w)
        except OSError as e:
            w.failures += 1
            delay = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** (w.failures - 1))
            if w.failures <= 3 or w.failures % 10 == 0:
                log.error("cannot restart proxy worker %d: %s; retrying in %g s", w.index, e, delay)
            w.closed = None
            asyncio.get_running_loop().call_later(delay, self._restart, w)

    async def cleanup(self) -> None:
        """SIGTERM to every worker; their last records are replayed (requests cut by the stop as
        `interrupted`), then the listening sockets are closed."""
        self.closing = True
        if self._watch is not None:
            self._watch.cancel()
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        waits = [w.closed for w in self.workers if w.closed is not None and not w.closed.done()]
        if waits:
            # Each link's EOF replays the worker's last records and reaps it (killed after STOP_TIMEOUT_S).
            _done, pending = await asyncio.wait(waits, timeout=STOP_TIMEOUT_S + 2)
            for w in self.workers:
                if w.closed is not None and not w.closed.done():
                    log.warning("proxy worker %d did not stop: killed", w.index)
                    if w.proc is not None:
                        w.proc.kill()
                    self._lost(w)
                    if w.proc is not None:
                        w.proc.wait()
        if self.sockets:
            self.close_sockets()
            log.info("proxy workers stopped; requests each served: %s (restarts: %d after exiting, %d silent)",
                     ", ".join(str(w.served) for w in self.workers), self.restarts["exited"], self.restarts["silent"])


if __name__ == "__main__":
    sys.exit(worker_main())
