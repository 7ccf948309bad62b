"""Who may use the tag socket (docs/daemon.md, Tag API): each connection's peer checked (SO_PEERCRED), not the socket
file's mode alone. Another uid is simulated by a forked child that drops to uid 65534 (root only)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading

import pytest
from aiohttp import web

from powerprof.daemon.tagapi import Peer, PeerPolicy, send_tag, tag_app

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="a client under another uid needs root to setuid to it")
THEM = 65534  # nobody
TAGGERS = 65533  # a gid standing for powerprof-tag


def _what_the_child_wrote(pid: int, r: int, w: int) -> bytes:
    """In the parent after the fork: all the child wrote to the pipe (`r`, `w`) until it exited, the child reaped."""
    os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out


def _as_other(folder, sock_name: str, uid: int, gid: int, groups=(), request: bytes | None = None) -> tuple[int, dict]:
    """HTTP status and JSON body the tag socket answers a process of `uid` (primary `gid`, supplementary `groups`).
    The child enters the socket's folder as root, then drops to the uid: it connects by the relative name, so the
    folders above need not be open to it (the folder itself must be searchable: `_folder`), and the kernel records the
    new uid as the peer."""
    request = request or b"POST /tags/t/start HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.chdir(folder)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(sock_name)
            s.sendall(request)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            os.write(w, out)
        except BaseException as e:  # noqa: BLE001 - the child reports anything and exits
            os.write(w, f"CHILD FAILED {type(e).__name__}: {e}".encode())
        finally:
            os._exit(0)
    out = _what_the_child_wrote(pid, r, w)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1."), out[:300]
    return int(head.split()[1]), json.loads(body or b"{}")


def _folder(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o711)
    os.chmod(folder, 0o711)
    return folder


class _Tags:
    def __init__(self):
        self.started: list[str] = []

    async def tag_start(self, name):
        self.started.append(name)
        return {"name": name, "started": True}

    async def tag_stop(self, name):
        return {"name": name}

    def tag_list(self):
        return list(self.started)


class _Server:
    """tag_app served on a real Unix socket from a thread of its own (the forked child talks to it)."""

    def __init__(self, path, policy: PeerPolicy | None, mode: int = 0o666):
        self.handler, self.path, self.policy, self.mode = _Tags(), path, policy, mode
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self):
        self.runner = web.AppRunner(tag_app(self.handler, self.policy))
        await self.runner.setup()
        await web.UnixSite(self.runner, str(self.path)).start()
        # Loose on purpose (a unit whose chgrp failed, a folder of the daemon's choosing): the peer check must hold.
        os.chmod(self.path, self.mode)

    def __enter__(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@AS_ROOT
def test_another_uid_is_refused_with_a_reason_even_where_the_socket_mode_lets_it_connect(tmp_path, caplog):
    # Before: whoever could open the socket file could tag (mode 0666 here, or a socket folder whose chgrp failed):
    # uid 65534 opened a tag, answered 200.
    tmp_path = _folder(tmp_path)
    path = tmp_path / "powerprof.sock"
    with caplog.at_level(logging.INFO, logger="powerprof.daemon.tagapi"), \
            _Server(path, PeerPolicy(own_uid=0, socket_gid=TAGGERS)) as srv:
        status, body = _as_other(tmp_path, path.name, THEM, THEM)
        assert status == 403 and f"uid {THEM}" in body["error"] and "may not use this tag socket" in body["error"]
        assert "usermod -aG" in body["error"] and srv.handler.started == []  # nothing opened
        assert send_tag(path, "start", "mine") == {"name": "mine", "started": True}  # the owner (root): accepted
        assert srv.handler.started == ["mine"]
        # Another refusal from the same uid within the minute is answered, not logged again.
        assert _as_other(tmp_path, path.name, THEM, THEM)[0] == 403
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 1 and f"uid {THEM}" in refusals[0], refusals
    accepted = [r.getMessage() for r in caplog.records if "tag request /tags/mine/start from uid 0 (pid " in r.getMessage()]
    assert accepted and str(os.getpid()) in accepted[0], [r.getMessage() for r in caplog.records]


@AS_ROOT
@pytest.mark.parametrize("how", ["supplementary", "primary", "daemon's own uid"])
def test_members_of_the_sockets_group_and_the_daemons_user_are_accepted(tmp_path, how):
    tmp_path = _folder(tmp_path)
    path = tmp_path / "powerprof.sock"
    own = THEM if how == "daemon's own uid" else 0
    gid, groups = {"supplementary": (THEM, [TAGGERS]), "primary": (TAGGERS, []), "daemon's own uid": (THEM, [])}[how]
    with _Server(path, PeerPolicy(own_uid=own, socket_gid=TAGGERS)) as srv:
        status, body = _as_other(tmp_path, path.name, THEM, gid, groups)
        assert (status, body) == (200, {"name": "t", "started": True})
        assert srv.handler.started == ["t"]
        # Listing is checked as starting is.
        get = b"GET /tags HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
        assert _as_other(tmp_path, path.name, THEM, gid, groups, request=get) == (200, {"open": ["t"]})
    with _Server(path, PeerPolicy(own_uid=0, socket_gid=TAGGERS - 1)):  # a group it is not in
        get = b"GET /tags HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
        assert _as_other(tmp_path, path.name, THEM, THEM, [TAGGERS], request=get)[0] == 403


@AS_ROOT
def test_a_peer_with_more_groups_than_one_read_holds_is_refused_saying_why(tmp_path):
    # CPython's getsockopt reads at most 1024 bytes (256 gids): a second, larger read could never succeed, and the
    # refusal told a member of the socket's group to join it.
    tmp_path = _folder(tmp_path)
    path = tmp_path / "powerprof.sock"
    with _Server(path, PeerPolicy(own_uid=0, socket_gid=TAGGERS)) as srv:
        status, body = _as_other(tmp_path, path.name, THEM, THEM, [*range(40000, 40300), TAGGERS])
        assert status == 403 and "more than 256 supplementary groups" in body["error"], body
        assert "sg " in body["error"] and srv.handler.started == []
        # the primary group is still read
        assert _as_other(tmp_path, path.name, THEM, TAGGERS, [*range(40000, 40300)])[0] == 200


def test_the_policy_before_the_socket_has_a_group_and_where_the_peer_is_unknown():
    p = PeerPolicy(own_uid=998)
    assert p.refusal(Peer(1, 0, 0)) is None and p.refusal(Peer(1, 998, 998)) is None
    assert "may not use" in p.refusal(Peer(7, 1000, 1000, (1000, 27)))  # no socket group yet: root and the daemon only
    p.socket_gid = 27
    assert p.refusal(Peer(7, 1000, 1000, (1000, 27))) is None
    assert "cannot tell who connected" in p.refusal(None)  # fail closed


@AS_ROOT
def test_the_running_daemon_refuses_another_uid_on_its_tag_socket_and_logs_who_tagged(tmp_path):
    # The daemon itself (root here, its own uid): a socket whose group is root's and mode opened to all still lets
    # uid 65534 open no tag; the log names the refused uid and the accepted tag's uid and pid.
    from daemon_helpers import DaemonProc, sim_env

    run = _folder(tmp_path)
    sock = run / "powerprof.sock"
    d = DaemonProc(tmp_path / "data", "--simulate", "--tag-socket", str(sock), env=sim_env(tmp_path))
    try:
        os.chmod(sock, 0o666)
        status, body = _as_other(run, sock.name, THEM, THEM, [TAGGERS])
        assert status == 403 and f"uid {THEM}" in body["error"], body
        assert send_tag(sock, "list") == {"open": []}  # nothing opened by the refused one
        assert send_tag(sock, "start", "mine")["started"] is True
    finally:
        d.stop()
    out = d.output()
    assert f"tag socket: refused a connection: uid {THEM}" in out, out
    assert f"tag request /tags/mine/start from uid 0 (pid {os.getpid()})" in out, out
    assert "root, uid 0 and members of group" in out, out


def _client_as_other(cwd, uid: int, gid: int, socket_path: str) -> str:
    """What `send_tag(socket_path, "list")` raises or answers in a process of `uid`/`gid` started in `cwd`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.chdir(cwd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = f"answered {send_tag(socket_path, 'list', timeout_s=5)}"
        except BaseException as e:  # noqa: BLE001 - the child reports anything and exits
            out = f"{type(e).__name__}: {e}"
        finally:
            os.write(w, out.encode())
            os._exit(0)
    out = _what_the_child_wrote(pid, r, w)
    return out.decode()


def _group_text(gid: int) -> str:
    import grp

    try:
        return f"group {grp.getgrgid(gid).gr_name}"
    except KeyError:
        return f"gid {gid}"


@AS_ROOT
def test_a_tag_socket_in_a_folder_the_caller_cannot_search_is_said_with_its_group_and_the_fix(tmp_path):
    # The shipped unit's /run/powerprof is mode 2750, group powerprof-tag: a user outside that group got a
    # PermissionError traceback from the client's stat of the socket.
    outer = _folder(tmp_path)  # 0711: the child may enter it; the folders above it are root's 0700
    run = outer / "run"
    run.mkdir()
    os.chown(run, 0, TAGGERS)
    os.chmod(run, 0o750)
    said = _client_as_other(outer, THEM, THEM, "run/powerprof.sock")
    assert said.startswith("TagApiError: "), said
    assert "cannot look into run (permission denied)" in said and _group_text(TAGGERS) in said, said
    assert "Fix:" in said and "sudo" in said and "Traceback" not in said, said


@AS_ROOT
def test_a_tag_socket_whose_mode_refuses_the_caller_is_said_with_its_group_and_the_fix(tmp_path):
    # A socket file of mode 0660 whose group the caller is not in: connect() is refused (EACCES), printed as
    # "cannot reach the daemon at P: PermissionError: [Errno 13] Permission denied".
    folder = _folder(tmp_path)
    path = folder / "powerprof.sock"
    with _Server(path, PeerPolicy(own_uid=0, socket_gid=TAGGERS), mode=0o660):
        os.chown(path, 0, TAGGERS)
        said = _client_as_other(folder, THEM, THEM, path.name)
    assert said.startswith("TagApiError: "), said
    assert f"may not connect to {path.name} (permission denied)" in said and _group_text(TAGGERS) in said, said
    assert "Fix:" in said and "sudo" in said and "Errno" not in said, said


def test_a_tag_stop_is_given_the_daemons_longest_wait_for_the_window_beside_the_requests_timeout(monkeypatch):
    # The daemon's stop waits up to 3 sample intervals + 2 s for the window's intervals to close (32 s at the
    # largest interval_s, 10 s): the client's 10 s in all gave up on a stop the daemon then completed, saying "hung".
    import powerprof.daemon.tagapi as tagapi
    from powerprof.daemon.config import INTERVAL_MAX_S

    asked = {}
    monkeypatch.setattr(tagapi, "_send", lambda p, method, path, timeout_s: asked.update({path: timeout_s}) or {})
    monkeypatch.setattr(tagapi.os, "stat", lambda p: os.stat_result((0o140660,) + (0,) * 9))  # "a socket"
    for action in ("start", "stop", "list"):
        tagapi.send_tag("/x.sock", action, None if action == "list" else "t")
    assert asked["/tags/t/start"] == asked["/tags"] == tagapi.TAG_TIMEOUT_S
    assert asked["/tags/t/stop"] == tagapi.TAG_TIMEOUT_S + tagapi.stop_wait_s(INTERVAL_MAX_S) == 10 + 32
