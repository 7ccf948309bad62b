"""The tag API: application-defined windows opened and closed over a local Unix socket.

Server: `tag_app(tags)` serves `POST /tags/{name}/start`, `POST /tags/{name}/stop`, `GET /tags`
on a Unix socket only (file mode 0660: local users in the socket's group), and checks each connection's peer
(`PeerPolicy`: SO_PEERCRED). Client: `send_tag(socket_path, action, name)`, used by `powerprof tag start|stop NAME`.
"""

from __future__ import annotations

import errno
import grp
import http.client
import json
import logging
import os
import platform
import re
import socket
import stat
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol

from powerprof.errtext import error_text

if TYPE_CHECKING:  # the annotations' name only: the server imports aiohttp in tag_app
    from aiohttp import web

# \Z, not $: `$` matches before a final newline, so "ab\n" passed, and the CLI said a tag the daemon opened as "ab".
NAME_RE = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}\Z")
log = logging.getLogger("powerprof.daemon.tagapi")
# Linux's SO_PEERGROUPS (4.13+), which Python does not name: 59 on every architecture but sparc and parisc.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", None) or (
    59 if sys.platform == "linux" and not platform.machine().startswith(("sparc", "parisc")) else None)
# CPython's getsockopt takes at most 1024 bytes: 256 gids. A peer with more is judged by its primary group alone, and
# a refusal says why (fail closed; NGROUPS_MAX is 65536).
PEER_GROUPS_MAX = 256
REFUSAL_LOG_EVERY_S = 60.0  # one log line per refused uid this often: a local loop must not fill the journal


@dataclass(frozen=True)
class Peer:
    """Who connected, as the kernel recorded it at connect(): pid, uid, gid and supplementary groups (() where the
    kernel cannot say)."""
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    groups_unread: bool = False  # more supplementary groups than one read holds (PEER_GROUPS_MAX): judged without them


def peer_of(sock) -> Peer | None:
    """The peer of a connected Unix socket (SO_PEERCRED, struct ucred: three ints; SO_PEERGROUPS, an array of gid_t),
    or None where this platform cannot tell."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    groups: tuple[int, ...] = ()
    unread = False
    if SO_PEERGROUPS is not None:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * PEER_GROUPS_MAX)
            groups = struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4])
        except OSError as e:
            unread = e.errno == errno.ERANGE  # a buffer too small: more groups than it holds
    return Peer(pid, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF, groups, unread)


class PeerPolicy:
    """Who may use the tag socket: root, the daemon's own uid, and a process in the socket file's group (its primary
    group or a supplementary one, as the kernel had them when it connected): the socket's 0660 mode stated again on each
    connection, so a mode or folder set wrong (the unit's `chgrp` failed, a socket folder of the daemon's choosing)
    lets no one else tag. `socket_gid` is set once the socket is made (None until then: root and the daemon only)."""

    def __init__(self, own_uid: int | None = None, socket_gid: int | None = None):
        self.own_uid = os.geteuid() if own_uid is None else own_uid
        self.socket_gid = socket_gid
        self._logged: dict[int, float] = {}

    def group_text(self) -> str:
        if self.socket_gid is None:
            return "no group yet"
        try:
            return f"group {grp.getgrgid(self.socket_gid).gr_name} (gid {self.socket_gid})"
        except KeyError:
            return f"gid {self.socket_gid}"

    def refusal(self, peer: Peer | None) -> str | None:
        """Why `peer` may not tag, or None."""
        if peer is None:
            return "the daemon cannot tell who connected (no SO_PEERCRED on this platform or socket): refused"
        if peer.uid in (0, self.own_uid):
            return None
        if self.socket_gid is not None and self.socket_gid in (peer.gid, *peer.groups):
            return None
        name = self.group_text()
        if peer.groups_unread:
            return (f"uid {peer.uid} (pid {peer.pid}) has more than {PEER_GROUPS_MAX} supplementary groups, more than "
                    f"the daemon can read, so membership of the socket's {name} could not be checked: refused. Fix: "
                    "run `powerprof tag` as a user with that group as its primary group (`sg GROUP -c 'powerprof tag "
                    "…'`), or with fewer groups")
        return (f"uid {peer.uid} (pid {peer.pid}) may not use this tag socket: only root, the daemon's user (uid "
                f"{self.own_uid}) and members of the socket's {name} may. Fix: add the user to that group "
                "(`sudo usermod -aG GROUP USER`, then log in again)")

    def log_refusal(self, why: str, peer: Peer | None) -> None:
        uid = -1 if peer is None else peer.uid
        now = time.monotonic()
        if now - self._logged.get(uid, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            self._logged[uid] = now
            log.warning("tag socket: refused a connection: %s", why)


class TagHandler(Protocol):
    async def tag_start(self, name: str) -> dict: ...
    async def tag_stop(self, name: str) -> dict: ...
    def tag_list(self) -> list[str]: ...


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        # A long one is quoted by its start and length: 5000 characters came back whole, in the CLI and the daemon's 400.
        shown = repr(name) if len(name) <= 128 else f"{name[:40] + '…'!r} ({len(name)} characters)"
        raise ValueError(f"tag name {shown} must be 1-128 characters of ASCII letters, digits and _ . : @ / -")
    if any(part in ("", ".", "..") for part in name.split("/")):
        # A URL path's `.`, `..` and empty segments are collapsed on the way: `tag start ..` answered 404, and a window
        # opened over raw HTTP as `a/../../b` could not be stopped from the CLI.
        raise ValueError(f"tag name {name!r}: its /-separated parts must not be empty, `.` or `..`")
    return name


def tag_app(tags: TagHandler, peers: PeerPolicy | None = None) -> web.Application:
    """The tag API's routes, each request's peer checked first (`peers`; default: root and this process's uid)."""
    # Here, not at the top: `powerprof tag` imports this module for its client, which needs no aiohttp (~0.4 s of
    # CPU a start, most of it the CA bundle aiohttp loads at import).
    from aiohttp import web  # noqa: PLC0415

    peers = PeerPolicy() if peers is None else peers

    @web.middleware
    async def check_peer(request: web.Request, handler):
        transport = request.transport
        peer = peer_of(transport.get_extra_info("socket") if transport is not None else None)
        why = peers.refusal(peer)
        if why:
            peers.log_refusal(why, peer)
            return web.json_response({"error": why}, status=403)
        if request.method == "POST":  # who opened or closed which tag, beside the daemon's own line on the outcome
            log.info("tag request %s from uid %d (pid %d)", request.path, peer.uid, peer.pid)
        return await handler(request)

    async def act(request: web.Request, fn: Callable[[str], Awaitable[dict]]) -> web.Response:
        try:
            name = check_name(request.match_info["name"])
            out = await fn(name)
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(out)

    async def start(request):
        return await act(request, tags.tag_start)

    async def stop(request):
        return await act(request, tags.tag_stop)

    async def listing(_request):
        return web.json_response({"open": tags.tag_list()})

    app = web.Application(middlewares=[check_peer])
    app.router.add_post("/tags/{name:.+}/start", start)
    app.router.add_post("/tags/{name:.+}/stop", stop)
    app.router.add_get("/tags", listing)
    return app


class TagApiError(RuntimeError):
    pass


TAG_TIMEOUT_S = 10.0  # one tag request in all, connect to last byte: read at each call (tests set less)
# The most of an answer's body the client reads: a daemon's largest, the list of 256 open windows (MAX_OPEN_TAGS) of
# 128-character names, is about 34 KiB. Unbounded, a peer sending without end took 335 MiB a second until the timeout.
ANSWER_MAX_BYTES = 1 << 20
# What a refusal of the peer tells the user to give instead.
_GIVE_SOCKET = "give the daemon's tag socket (its config's [tags] socket)"


def stop_wait_s(interval_s: float) -> float:
    """How long the daemon's tag stop waits for the window's intervals to close, at sampling period `interval_s`:
    a stop's client waits this beside TAG_TIMEOUT_S."""
    return 3 * interval_s + 2


class _DeadlineSocket(socket.socket):
    """A socket whose every wait is bounded by one deadline for the whole exchange: settimeout() bounds each recv
    alone, so a peer sending a byte every few seconds kept the client waiting for ever."""

    deadline_s = float("inf")  # time.monotonic() at which the exchange is given up

    def _arm(self) -> None:
        left_s = self.deadline_s - time.monotonic()
        if left_s <= 0:
            raise TimeoutError("timed out")
        self.settimeout(left_s)

    def connect(self, address) -> None:
        # A Unix socket's connect() with a timeout set does not wait on a full listen queue: EAGAIN at once. Tried
        # again until the deadline, so a burst of clients (or a daemon a moment behind) is waited for, and one that
        # never accepts is said as such (it printed "BlockingIOError: [Errno 11] Resource temporarily unavailable").
        while True:
            self._arm()
            try:
                return super().connect(address)
            except BlockingIOError:
                time.sleep(min(0.05, max(0.0, self.deadline_s - time.monotonic())))

    def sendall(self, data, *flags) -> None:
        self._arm()
        super().sendall(data, *flags)

    def recv_into(self, buffer, *args) -> int:  # what http.client's reads come through (socket.makefile)
        self._arm()
        return super().recv_into(buffer, *args)

    def recv(self, bufsize, *args) -> bytes:
        self._arm()
        return super().recv(bufsize, *args)


class _UnixConnection(http.client.HTTPConnection):
    """HTTP/1.1 over the daemon's Unix socket: one request, one connection, `timeout_s` for all of it."""

    def __init__(self, socket_path: Path, timeout_s: float):
        super().__init__("powerprof", timeout=timeout_s)
        self.socket_path = str(socket_path)
        self.deadline_s = time.monotonic() + timeout_s

    def connect(self) -> None:
        s = _DeadlineSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.deadline_s = self.deadline_s
        try:
            s.connect(self.socket_path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def _send(socket_path: Path, method: str, path: str, timeout_s: float) -> dict:
    # The standard library's client, not aiohttp's: a command that sends one request paid for importing aiohttp.
    conn = _UnixConnection(socket_path, timeout_s)
    r = None
    try:
        conn.request(method, path)
        r = conn.getresponse()
        raw = r.read(ANSWER_MAX_BYTES + 1)
        if len(raw) > ANSWER_MAX_BYTES:
            raise TagApiError(f"the peer at {socket_path} sent an answer over {ANSWER_MAX_BYTES >> 20} MiB (a powerprof "
                              f"daemon's is a few KiB), not read further (not a powerprof daemon?): {_GIVE_SOCKET}")
        if r.length:  # after the bound: an answer over it is still unread
            # A bounded read of a Content-Length answer returns what came before the peer closed, without raising:
            # r.length is what was said to come and did not (a cut-off 200 was taken as the daemon's answer, exit 0).
            raise http.client.IncompleteRead(raw, r.length)
        body = raw.decode("utf-8", errors="replace")
    except TimeoutError:
        # "TimeoutError: timed out" said neither what happened nor what to do.
        fix = ("Fix: see the daemon's log (under systemd `journalctl -u powerprof`) and restart it if it is stuck; "
               "or give its own tag socket with --socket")
        if conn.sock is None and r is None:  # an answer begun is one accepted: `Connection: close` drops conn.sock
            raise TagApiError(f"the daemon at {socket_path} did not accept the connection within {timeout_s:g} s "
                              f"(hung or overloaded?). {fix}") from None
        raise TagApiError(f"the daemon at {socket_path} accepted but did not answer within {timeout_s:g} s (hung, or "
                          f"not a powerprof daemon?). {fix}") from None
    finally:
        if r is not None:  # the answer holds the socket open past conn.close(): a peer still sending kept it
            r.close()
        conn.close()
    shown = body if len(body) <= 80 else body[:80] + "…"
    try:
        doc = json.loads(body)
    except ValueError:
        if r.status == 200:  # taken as the daemon's answer, it printed "unknown s, GPU unknown J", exit 0
            raise TagApiError(f"the peer at {socket_path} answered HTTP 200 with {shown!r}, not JSON (not a powerprof "
                              f"daemon?): {_GIVE_SOCKET}") from None
        doc = {"error": body}
    if not isinstance(doc, dict):
        # The daemon answers objects only; another JSON value (a string, a list) was an AttributeError traceback.
        raise TagApiError(f"the peer at {socket_path} answered HTTP {r.status} with {shown!r}, not a JSON object (not "
                          f"a powerprof daemon?): {_GIVE_SOCKET}")
    if r.status != 200:
        raise TagApiError(doc.get("error") or f"daemon answered {r.status}")
    return doc


def _not_http(e: http.client.HTTPException) -> str:
    """What a peer that did not answer in HTTP/1.x sent, in words (http.client's exception names said nothing)."""
    if isinstance(e, http.client.BadStatusLine):
        line = e.line if isinstance(e.line, str) else str(e.line)
        return f"it sent {line[:60]!r}{'…' if len(line) > 60 else ''}, not an HTTP status line"
    if isinstance(e, http.client.UnknownProtocol):
        return f"it spoke {str(e.version)[:60]!r}, not HTTP/1.1"
    if isinstance(e, http.client.LineTooLong):  # "got more than 65536 bytes when reading status line"
        return f"it sent a {str(e).rpartition('when reading ')[2] or 'line'} over 64 KiB"
    return error_text(e)[:200]


def _cut_short(e: http.client.IncompleteRead) -> str:
    """How far a cut-off answer came (a chunked one says no length: `expected` is None)."""
    more = "before its last chunk" if e.expected is None else f"{e.expected} more said to come"
    return f"its answer ended after {len(e.partial)} bytes, {more}"


def _who_may(path: Path, group_bits: int) -> str:
    """Who `path`'s mode lets in (`group_bits`: what its group needs, 0o010 to search a folder, 0o060 to connect to a
    socket) and the fix, for a caller it refused."""
    try:
        st = os.stat(path)
    except OSError:
        return "Fix: run `powerprof tag` with sudo"
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_mode & group_bits != group_bits:
        return (f"its {mode} lets in its owner, uid {st.st_uid}, alone. Fix: run `powerprof tag` as that user or "
                "with sudo")
    try:
        group = f"group {grp.getgrgid(st.st_gid).gr_name}"
    except KeyError:
        group = f"gid {st.st_gid}"
    return (f"its {mode} lets in its owner and {group} alone. Fix: run `powerprof tag` as a member of {group} "
            "(`sudo usermod -aG GROUP $USER`, then log in again), or with sudo")


def _unsearchable(p: Path) -> str:
    """Why `p` could not be looked at: the first folder on its way the caller may not search (the shipped unit's
    /run/powerprof is mode 2750, group powerprof-tag), who may, and the fix."""
    folder = p.parent
    for i in range(1, len(p.parts) + 1):
        try:
            os.stat(Path(*p.parts[:i]))
        except PermissionError:
            folder = Path(*p.parts[: i - 1]) if i > 1 else Path(".")
            break
        except OSError:
            break
    return (f"cannot look into {folder} (permission denied), the folder of the tag socket {p}: "
            f"{_who_may(folder, 0o010)}")


def send_tag(socket_path: Path | str, action: str, name: str | None = None, timeout_s: float | None = None) -> dict:
    """Blocking client: action is start, stop or list; `timeout_s` (default TAG_TIMEOUT_S) for the whole request."""
    if timeout_s is None:
        timeout_s = TAG_TIMEOUT_S
        if action == "stop":
            # The daemon's wait for the window at the largest interval_s: 10 s in all gave up on a stop the daemon
            # completed (interval_s 3 s and up), said as "did not answer (hung…?)".
            from powerprof.daemon.config import INTERVAL_MAX_S  # noqa: PLC0415

            timeout_s += stop_wait_s(INTERVAL_MAX_S)
    p = Path(socket_path)
    if action == "list":
        path, method = "/tags", "GET"
    else:
        check_name(name or "")
        path, method = f"/tags/{name}/{action}", "POST"
    try:
        mode = os.stat(p).st_mode
    except PermissionError:
        raise TagApiError(_unsearchable(p)) from None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise TagApiError(f"no daemon socket at {p}: is `powerprof daemon` running (and is this its socket)?") \
                from None
        mode = None  # unreadable otherwise: the connect below says why
    if mode is not None and not stat.S_ISSOCK(mode):
        # A regular file was told "no daemon listens on it (a socket left by a daemon that was killed?)".
        what = "a regular file" if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode) else "not a socket"
        from powerprof.daemon.config import SYSTEMD_TAG_SOCKET  # noqa: PLC0415

        raise TagApiError(f"{p} is {what}, not a socket: give the daemon's tag socket (its config's [tags] socket; "
                          f"under systemd {SYSTEMD_TAG_SOCKET})")
    try:
        return _send(p, method, path, timeout_s)
    except http.client.RemoteDisconnected:  # before HTTPException and OSError: it is both
        raise TagApiError(f"the peer at {p} closed the connection without answering (a daemon stopping or crashing, "
                          f"or not a powerprof daemon?): see the daemon's log, or {_GIVE_SOCKET}") from None
    except http.client.IncompleteRead as e:  # before HTTPException: it is one
        raise TagApiError(f"the peer at {p} cut its answer short ({_cut_short(e)}: a daemon stopping or crashing, or "
                          f"not a powerprof daemon?): see the daemon's log, or {_GIVE_SOCKET}") from None
    except http.client.HTTPException as e:
        raise TagApiError(f"the peer at {p} did not answer as a powerprof daemon ({_not_http(e)}): {_GIVE_SOCKET}") \
            from None
    except OSError as e:
        if getattr(e, "errno", None) in (errno.EACCES, errno.EPERM):
            raise TagApiError(f"may not connect to {p} (permission denied): {_who_may(p, 0o060)}") from None
        if getattr(e, "errno", None) in (errno.ECONNREFUSED, errno.ENOENT):
            # A socket file nothing listens on: one a killed daemon (kill -9) left, or gone since the check above.
            raise TagApiError(f"no daemon listens on {p} (a socket left by a daemon that was killed, kill -9, or "
                              "crashed?): is `powerprof daemon` running (and is this its socket)?") from None
        raise TagApiError(f"cannot reach the daemon at {p}: {error_text(e)}") from None
