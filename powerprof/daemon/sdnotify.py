"""systemd notifications (READY, STATUS, WATCHDOG) over $NOTIFY_SOCKET: one datagram each, no dependency.

Outside systemd (no NOTIFY_SOCKET) every call does nothing. The watchdog period comes from
$WATCHDOG_USEC (set by WatchdogSec= in the unit); the daemon pings at half of it, and only while
its writer thread is alive and not stuck, so systemd restarts a daemon that silently stopped writing.
"""

from __future__ import annotations

import os
import socket


def notify(message: str, env: dict | None = None) -> bool:
    """Send `message` (e.g. "WATCHDOG=1") to systemd; False when not under systemd or the send failed."""
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # abstract namespace socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_period_s(env: dict | None = None) -> float | None:
    """Seconds between pings (half of WatchdogSec), or None when systemd asked for none."""
    env = os.environ if env is None else env
    usec = env.get("WATCHDOG_USEC")
    pid = env.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return max(0.05, int(usec) / 2e6)
    except ValueError:
        return None
