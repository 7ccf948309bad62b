"""Proxy worker processes on one SO_REUSEPORT port, whose per-request records the daemon replays into its one ledger.

With `proxy.workers = N > 1` the daemon serves no proxy traffic itself: it starts N children
(`python -m powerprof.daemon.workers`), each running the same `Proxy` on the proxy address with
SO_REUSEPORT (the kernel spreads connections over them), with a recorder that ships compact
records over a socketpair instead of calling the ledger. Per request: a start (its fields), its
first token on its own (exact time, for TTFT and the first-token edge), later tokens coalesced per
request into one (time of the latest, count) entry per flush (at most `FLUSH_S` apart), and an end
(counts, outcome, timings). A flush is one marshal'd frame; with few requests in flight it goes out
at once, so the short-request edges are read on time. The daemon gives each record a request id
of its own (unique across workers), mirrors the proxy's `RequestTrace` and calls its recorder
(ledger, latency histograms, tag counters) exactly as the in-process proxy does.

Fail-open: a worker forwards on its own; a daemon that stops reading only fills the socket up to
`SEND_BUFFER_MAX_BYTES`, beyond which records are dropped and counted, never the client's bytes.
A worker that dies has its in-flight requests recorded as `interrupted` (the error says which
worker) and is restarted. Workers exit when the daemon dies (PR_SET_PDEATHSIG, and the socket's
EOF) and drain like the daemon on SIGTERM.
"""

from __future__ import annotations

import asyncio
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
from dataclasses import astuple

from . import streams
from .proxy import Proxy, RequestTrace

log = logging.getLogger("powerprof.daemon.workers")

FLUSH_S = 0.02  # tokens of one request are coalesced over at most this long (their placement's resolution)
SEND_BUFFER_MAX_BYTES = 8 << 20  # a daemon that stops reading: records beyond this are dropped and counted
FRAME_MAX_BYTES = 64 << 20
HELLO_TIMEOUT_S = 60.0  # a loaded machine takes seconds to start Python and bind
STOP_TIMEOUT_S = 10.0  # SIGTERM: a worker cuts its requests after 2 s (like the daemon) and sends their records
RESTART_MIN_GAP_S = 1.0  # a worker that dies at once is restarted at most this often
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
    return (tr.request_id, tr.method, tr.endpoint, tr.tag, tr.arrival_ns, tr.arrival_wall_ns, tr.api, tr.model, tr.stream)


def _end_record(tr: RequestTrace) -> tuple:
    # With its start's fields: a request can end without a start (a body that timed out before it was
    # recorded), and the daemon counts those too, as the in-process proxy's recorder does.
    c = tr.counts
    return (_start_record(tr), tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome, tr.error, tr.first_ns, tr.first_wall_ns,
            tr.last_ns, tr.last_wall_ns, tr.tokens_seen, tr.response_bytes, tr.recorder_error, tr.api, tr.model,
            tr.stream, None if c is None else astuple(c), dict(tr.extra))


# --- the worker's side ------------------------------------------------------------------------------------


class ShippingRecorder:
    """The worker's recorder: batches what the proxy records and writes it to the daemon as frames."""

    def __init__(self, urgent_max_active: int, active=lambda: 0):
        self.urgent_max_active = urgent_max_active  # at most this many in flight: send at once (edges)
        self.active = active
        self.transport: asyncio.Transport | None = None
        self.dropped = 0  # records not sent: the daemon did not read
        self.proxy: Proxy | None = None
        self._starts: list = []
        self._firsts: list = []
        self._tokens: dict = {}  # request id → [t_ns, n, trace]
        self._ends: list = []
        self._handle: asyncio.Handle | None = None
        self._urgent = False

    def on_start(self, trace: RequestTrace) -> None:
        self._starts.append(_start_record(trace))
        self._schedule(urgent=True)

    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None:
        if trace.first_ns == t_ns and trace.tokens_seen == n:  # the first: exact, on its own
            self._firsts.append((trace.request_id, t_ns, trace.first_wall_ns, n, trace.status, trace.stream,
                                 trace.extra.get("prompt_tokens")))
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

    def flush(self) -> None:
        self._handle, self._urgent = None, False
        if not (self._starts or self._firsts or self._tokens or self._ends):
            return
        toks = []
        for rid, (t, n, tr) in self._tokens.items():
            p = tr.extra.get("prompt_tokens")
            toks.append((rid, t, n, -1 if p is None else p))
        p = self.proxy
        msg = (self._starts, self._firsts, toks, self._ends,
               (p.recorder_failures, p.upstream_failures, self.dropped) if p is not None else (0, 0, self.dropped))
        n_records = len(self._starts) + len(self._firsts) + len(toks) + len(self._ends)
        self._starts, self._firsts, self._tokens, self._ends = [], [], {}, []
        tr = self.transport
        if tr is None or tr.is_closing() or tr.get_write_buffer_size() > SEND_BUFFER_MAX_BYTES:
            self.dropped += n_records
            return
        tr.write(frame(msg))


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
    guard = ConnectionGuard(spec["header_timeout_s"], spec["idle_timeout_s"])
    app = proxy.app()
    app.middlewares.append(guard.middleware)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, keepalive_timeout=spec["idle_timeout_s"])
    await runner.setup()
    try:
        await web.TCPSite(runner, spec["host"], spec["port"], reuse_address=True, reuse_port=True).start()
    except OSError as e:
        log.error("proxy worker %d cannot listen on %s:%d: %s", spec["index"], spec["host"], spec["port"], e)
        return 1
    guard.watch(runner.server)
    transport.write(frame(("hello", os.getpid())))
    await stop.wait()
    await guard.stop()
    await runner.cleanup()  # in-flight requests get shutdown_timeout, then are cut and recorded
    shipper.flush()
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
    """`python -m powerprof.daemon.workers`: one proxy worker; its spec (JSON) on stdin, the socket's fd in it."""
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
    sock = socket.socket(fileno=spec["fd"])
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_serve(spec, sock))
    return uvloop.run(_serve(spec, sock))


# --- the daemon's side ------------------------------------------------------------------------------------


class _WorkerLink(asyncio.Protocol):
    def __init__(self, owner: "ProxyWorkers", worker: "_Worker"):
        self.owner, self.worker, self.unframer = owner, worker, Unframer()

    def data_received(self, data: bytes) -> None:
        self.owner.record_bytes += len(data)
        try:
            msgs = self.unframer.feed(data)
        except Exception as e:
            self.owner._failed(f"unreadable frame from proxy worker {self.worker.index}: {e}")
            if self.worker.transport is not None:
                self.worker.transport.close()
            return
        for m in msgs:
            try:
                self.owner._replay(self.worker, m)
            except Exception as e:  # a bug here must not cost the link (and so the worker)
                self.owner._failed(f"{type(e).__name__}: {e}")

    def connection_lost(self, exc) -> None:
        self.owner._lost(self.worker)


class _Worker:
    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.transport: asyncio.Transport | None = None
        self.hello: asyncio.Future | None = None
        self.closed: asyncio.Future | None = None
        self.stats = (0, 0, 0)  # its proxy's recorder and upstream failures, records it dropped
        self.base = (0, 0, 0)  # the same, summed over its earlier lives
        self.started_s = 0.0
        self.served = 0  # requests it ended, over all its lives


class ProxyWorkers:
    """The daemon's side: starts and restarts the workers, replays their records into `recorder`.

    Offers what the daemon reads of an in-process `Proxy` (`active`, `recorder_failures`,
    `upstream_failures`) and `cleanup()` like an aiohttp runner, so the daemon's shutdown stops it."""

    def __init__(self, n: int, upstream: str, listen_host: str, listen_port: int, recorder, proxy_kwargs: dict,
                 header_timeout_s: float, idle_timeout_s: float, urgent_max_active: int = 4,
                 log_format: str = "%(levelname)s %(name)s: %(message)s"):
        self.n = n
        self.recorder = recorder
        if proxy_kwargs.get("max_connections"):  # the upstream's bound holds for all workers together
            proxy_kwargs = {**proxy_kwargs, "max_connections": -(-proxy_kwargs["max_connections"] // n)}
        self.host, self.port = listen_host, listen_port
        self.spec = {"upstream": upstream, "proxy": proxy_kwargs, "header_timeout_s": header_timeout_s,
                     "idle_timeout_s": idle_timeout_s, "urgent_max_active": urgent_max_active,
                     "log_format": log_format}
        self.workers = [_Worker(k) for k in range(n)]
        self.mirrors: dict[tuple[int, int], RequestTrace] = {}
        self._ids = itertools.count(1)
        self._reserve: socket.socket | None = None
        self.closing = False
        self.restarts = 0
        self.replay_failures = 0
        self.lost_requests = 0  # in flight in a worker that died
        self.record_bytes = 0  # received from the workers

    # what the daemon reads, as of an in-process Proxy
    @property
    def active(self) -> int:
        return len(self.mirrors)

    @property
    def recorder_failures(self) -> int:
        return self.replay_failures + sum(w.base[0] + w.stats[0] + w.base[2] + w.stats[2] for w in self.workers)

    @property
    def upstream_failures(self) -> int:
        return sum(w.base[1] + w.stats[1] for w in self.workers)

    async def start(self) -> tuple[str, int]:
        """Bind the address (port 0 picks one, kept for the daemon's life), start the workers, wait until
        each listens. OSError when the address cannot be had; RuntimeError when a worker does not start."""
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        if self.port:
            # Without SO_REUSEPORT first: a port another process (of this user) serves with SO_REUSEPORT,
            # say a second daemon with workers, would otherwise be joined silently and its traffic split.
            with socket.socket(fam, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((self.host, self.port))
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind((self.host, self.port))  # bound, never listening: it takes no connections
        except OSError:
            s.close()
            raise
        self._reserve = s
        self.port = s.getsockname()[1]
        for w in self.workers:
            self._spawn(w)
        try:
            for w in self.workers:
                await asyncio.wait_for(asyncio.shield(w.hello), HELLO_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await self.cleanup()
            raise RuntimeError(f"proxy workers did not start: {e or 'no answer in %g s' % HELLO_TIMEOUT_S}") from None
        log.info("%d proxy workers listening on port %d (pids %s)", self.n, self.port,
                 ", ".join(str(w.proc.pid) for w in self.workers))
        return self.host, self.port

    def _spawn(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {**self.spec, "host": self.host, "port": self.port, "index": w.index, "fd": theirs.fileno(),
                "parent_pid": os.getpid(), "log_level": logging.getLogger("powerprof").getEffectiveLevel()}
        try:
            # Started from the loop's thread, which lives as long as the daemon (PR_SET_PDEATHSIG follows the
            # thread). Its own session: a Ctrl-C at the terminal reaches the daemon, which stops the workers.
            w.proc = subprocess.Popen([sys.executable, "-m", "powerprof.daemon.workers"], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), text=True,
                                      start_new_session=True)
            w.proc.stdin.write(json.dumps(spec))
            w.proc.stdin.close()
        finally:
            theirs.close()
        w.started_s = time.monotonic()
        w.hello = loop.create_future()
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
            trace.recorder_error = f"{type(e).__name__}: {e}"[:300]
            self._failed(trace.recorder_error)

    def _replay(self, w: _Worker, msg) -> None:
        if msg[0] == "hello":
            if not w.hello.done():
                w.hello.set_result(msg[1])
            return
        starts, firsts, toks, ends, stats = msg
        w.stats = tuple(stats)
        rec, mirrors = self.recorder, self.mirrors
        for rid, method, endpoint, tag, arr, arr_wall, api, model, stream in starts:
            tr = RequestTrace(request_id=next(self._ids), method=method, endpoint=endpoint, tag=tag, arrival_ns=arr,
                              arrival_wall_ns=arr_wall, api=api, model=model, stream=stream)
            mirrors[(w.index, rid)] = tr
            self._call(rec.on_start, tr)
        for rid, t, wall, n, status, stream, prompt in firsts:
            tr = mirrors.get((w.index, rid))
            if tr is None:
                continue
            tr.first_ns = tr.last_ns = t
            tr.first_wall_ns = tr.last_wall_ns = wall
            tr.tokens_seen += n
            tr.status = status
            if stream is not None:
                tr.stream = stream
            if prompt is not None:
                tr.extra["prompt_tokens"] = prompt
            self._call(rec.on_tokens, tr, t, n)
        wall_offset = time.time_ns() - time.monotonic_ns()  # wall stamps of later tokens: only rows read them,
        for rid, t, n, prompt in toks:  # and the end record brings the exact last one
            tr = mirrors.get((w.index, rid))
            if tr is None:
                continue
            tr.last_ns, tr.last_wall_ns = t, t + wall_offset
            tr.tokens_seen += n
            if prompt >= 0 and "prompt_tokens" not in tr.extra:
                tr.extra["prompt_tokens"] = prompt
            self._call(rec.on_tokens, tr, t, n)
        for e in ends:
            tr = mirrors.pop((w.index, e[0][0]), None)
            if tr is None:  # never started (or its start was dropped): recorded from the end's copy
                rid, method, endpoint, tag, arr, arr_wall, api, model, stream = e[0]
                tr = RequestTrace(request_id=next(self._ids), method=method, endpoint=endpoint, tag=tag,
                                  arrival_ns=arr, arrival_wall_ns=arr_wall, api=api, model=model, stream=stream)
            (_start, tr.end_ns, tr.end_wall_ns, tr.status, tr.outcome, tr.error, tr.first_ns, tr.first_wall_ns,
             tr.last_ns, tr.last_wall_ns, tr.tokens_seen, tr.response_bytes, err, tr.api, tr.model, tr.stream,
             counts, extra) = e
            tr.counts = None if counts is None else streams.Counts(*counts)
            tr.extra.update(extra)
            w.served += 1
            if tr.recorder_error is None:
                tr.recorder_error = err  # as in-process: a request whose recording broke gets no on_end
            self._call(rec.on_end, tr)

    # --- a worker that dies ------------------------------------------------------------------------------

    def _lost(self, w: _Worker) -> None:
        """Its socket closed: the worker exited or is exiting. Its open requests end here, marked; once
        reaped, it is restarted."""
        if w.transport is None and w.proc is None:
            return
        if w.transport is not None:
            w.transport.close()
            w.transport = None
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
        self.lost_requests += len(lost)
        w.base = tuple(a + b for a, b in zip(w.base, w.stats))
        w.stats = (0, 0, 0)
        if lost:
            log.error("proxy worker %d (pid %s) is gone: %d request(s) in flight in it recorded as interrupted",
                      w.index, pid, len(lost))
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
        if rc != 0 or not self.closing:
            log.log(logging.INFO if self.closing else logging.ERROR, "proxy worker %d exited with status %s%s",
                    w.index, rc, "" if self.closing else "; restarting it")
        if not self.closing:
            delay = max(0.0, RESTART_MIN_GAP_S - (time.monotonic() - w.started_s))
            asyncio.get_running_loop().call_later(delay, self._restart, w)

    def _restart(self, w: _Worker) -> None:
        if self.closing:
            return
        self.restarts += 1
        try:
            self._spawn(w)
        except OSError as e:
            log.error("cannot restart proxy worker %d: %s; retrying", w.index, e)
            w.closed = None
            asyncio.get_running_loop().call_later(RESTART_MIN_GAP_S, self._restart, w)

    async def cleanup(self) -> None:
        """SIGTERM to every worker; their last records are replayed (requests cut by the stop as
        `interrupted`), then the port is released."""
        self.closing = True
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
        if self._reserve is not None:
            self._reserve.close()
            self._reserve = None
            log.info("proxy workers stopped; requests each served: %s (restarts: %d)",
                     ", ".join(str(w.served) for w in self.workers), self.restarts)


if __name__ == "__main__":
    sys.exit(worker_main())
