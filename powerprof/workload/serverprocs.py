"""Which processes on this host are the inference server's: whoever listens on its URL's port (with its children), and what powerprof launched.

`ServerProcesses(url, launched)()` answers `(pids, None)` or `(None, why)`: never a guess. A server in
powerprof's own process (the simulated one, or any served in-process) is that process alone: its
children are powerprof's, not the server's. Listing another user's sockets needs that user or root
(Linux shows only the owner's pids; macOS none without root), which the reason then says.
"""

from __future__ import annotations

import ipaddress
import os
import socket

import psutil

from .launcher import _host_port, _marked

SOCKETS_FIX = "run powerprof as the server's user or as root, which may see which process holds the port"


def _local_ips(ps) -> set[str]:
    ips = set()
    try:
        for addrs in ps.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    ips.add(a.address.split("%")[0])
    except Exception:
        pass
    return ips


def _resolve(host: str) -> set[str]:
    try:
        return {ai[4][0].split("%")[0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def _is_local(ip: str, local: set[str]) -> bool:
    try:
        a = ipaddress.ip_address(ip)
    except ValueError:
        return False
    return a.is_loopback or a.is_unspecified or ip in local


class ServerProcesses:
    """The server's processes at `url`, looked up afresh at each call (a server starts workers, restarts).

    launched: a list that holds the ServerLauncher once one is started (rig.server's `launched`): its
    process and everything carrying its launch marker are the server's too.
    """

    def __init__(self, url: str, launched: list | None = None, ps=psutil, pid: int | None = None):
        self.url = url
        self.launched = launched if launched is not None else []
        self.ps = ps
        self.pid = os.getpid() if pid is None else pid
        self._roots: list = []  # psutil.Process of the listeners last found

    def __call__(self) -> tuple[set[int] | None, str | None]:
        host, port = _host_port(self.url)
        local = _local_ips(self.ps)
        ips = _resolve(host)
        if not ips:
            return None, f"{host} does not resolve here"
        if not any(_is_local(ip, local) for ip in ips):
            return None, f"{host} is not this host: RAPL measures this host's CPU, not the server's"
        roots = set()
        la = self.launched[-1] if self.launched else None
        proc = getattr(la, "proc", None)
        if proc is not None and proc.poll() is None:
            roots.add(proc.pid)
        found, why = self._listeners_cached(port, ips | {"0.0.0.0", "::"}, local)
        roots |= found
        if not roots:
            return None, why
        if self.pid in roots:
            # Served from powerprof's own process: its children (a hog started beside it, a launched
            # tool) are not the server's, and its CPU time cannot be split between server and tool.
            return {self.pid}, None
        pids = set(roots)
        for r in roots:
            try:
                pids.update(c.pid for c in self.ps.Process(r).children(recursive=True))
            except psutil.Error:
                pass
        if la is not None and getattr(la, "marker", None):
            pids.update(p.pid for p in _marked(la.marker))
        pids.discard(self.pid)
        return pids, None

    def _listeners_cached(self, port: int, ips: set[str], local: set[str]) -> tuple[set[int], str | None]:
        # Listing the host's sockets costs ~14 ms with 90 processes (it reads every process's fds), more on a
        # big host: the listeners found are kept while they run (psutil checks a pid was not reused).
        if self._roots and all(p.is_running() for p in self._roots):
            return {p.pid for p in self._roots}, None
        pids, why = self._listeners(port, ips, local)
        self._roots = []
        for pid in pids:
            try:
                self._roots.append(self.ps.Process(pid))
            except psutil.Error:
                pass
        return pids, why

    def _listeners(self, port: int, ips: set[str], local: set[str]) -> tuple[set[int], str | None]:
        try:
            conns = self.ps.net_connections(kind="tcp")
        except psutil.AccessDenied:
            return set(), f"listing this host's sockets needs root here; {SOCKETS_FIX}"
        except (psutil.Error, OSError) as e:
            return set(), f"cannot list this host's sockets ({type(e).__name__}: {e})"
        on_port = [c for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   and (c.laddr.ip.split("%")[0] in ips or _is_local(c.laddr.ip.split("%")[0], local))]
        pids = {c.pid for c in on_port if c.pid}
        if pids:
            return pids, None
        if on_port:
            return set(), (f"something listens on port {port}, but not as this user, which cannot see which "
                           f"process it is; {SOCKETS_FIX}")
        return set(), (f"nothing on this host listens on port {port} (a container's forwarded port, or the "
                       "server runs elsewhere)")
