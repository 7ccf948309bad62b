"""`--launch "CMD"`: start an inference server, wait until it is healthy, and always stop it.

The command runs in its own process group with its output in a log file; readiness is
`/health` answering 200 (or, for servers without `/health`, `/v1/models`). A port something already
listens on is refused before launching: that server would answer the probes and be measured in the
launched one's place. On a timeout or an early exit the error shows the tail of the log. Leaving the context — normally, on an
exception or on Ctrl-C — sends SIGTERM to the whole group, then SIGKILL after a grace period; a
signal arriving during that stop waits until the group is gone. Processes that left the group (a
server that daemonises, `setsid CMD &`) are found by a marker in their environment and stopped too. On Linux
the server is also told to get SIGTERM when powerprof ends (PR_SET_PDEATHSIG, set by a tiny wrapper that then
execs the command), so a powerprof killed with SIGKILL does not leave it running; and a server a previous
powerprof launched that still holds the port once that powerprof is gone (its marker names it) is stopped, with
a note, when it is this user's. SIGTERM/SIGHUP sent to powerprof
itself are turned into `Terminated` (a SystemExit with code 128 + signum) while the server runs,
so they stop it too and powerprof exits like a signalled program (and, should library code
swallow that exit, before the next request: `powerprof.termination`); an atexit hook is the
last line of defence.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import psutil

from powerprof import termination
from powerprof.termination import Terminated, clear, note
from powerprof.workload.auth import auth_headers


class LaunchError(RuntimeError):
    """The server did not become healthy; the message carries the tail of its log."""


# Inherited by everything the launched command starts, also what leaves its process group:
# "<launching powerprof's pid>:<its start time>:<random>", so a later run can tell whether that powerprof is gone.
MARKER_ENV = "POWERPROF_LAUNCH_ID"

# Run by `python -I -S -c` as the launched process: asks Linux for SIGTERM when the powerprof thread that
# started it ends (kill -9 included), then becomes the server (exec keeps the request; a fork of the server
# does not inherit it). A powerprof already gone by then would never signal it: it exits instead.
_DEATHSIG = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as e:
    print(f"cannot start {sys.argv[2]!r}: {e}", file=sys.stderr, flush=True)
    sys.exit(127)
"""


def _new_marker() -> str:
    return f"{os.getpid()}:{psutil.Process().create_time():.3f}:{uuid.uuid4().hex}"


def _launcher_gone(marker: str) -> bool:
    """Whether the powerprof a marker names has ended (its pid gone, or now another process's). False for a
    marker that names none (an older powerprof's) or one that cannot be checked: such a server is left alone."""
    try:
        pid_s, t_s, _ = marker.split(":")
        pid, t = int(pid_s), float(t_s)
    except ValueError:
        return False
    try:
        return abs(psutil.Process(pid).create_time() - t) > 1.0
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _ours(p) -> bool:
    """The process runs as this user (real and effective): the only ones powerprof may stop."""
    try:
        u = p.uids()
    except psutil.Error:
        return False
    return u.real == os.getuid() and u.effective == os.geteuid()


def _host_port(base_url: str) -> tuple[str, int]:
    u = urlsplit(base_url)
    return u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _listener_pid(port: int) -> int | None:
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (psutil.Error, OSError):
        pass
    return None


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())[:200]
    except psutil.Error:
        return "?"


def _listener(port: int) -> str:
    """Who listens on the port, as far as this user may see: 'pid N: cmdline', or why unknown."""
    pid = _listener_pid(port)
    if pid is None:
        return "a process of another user or container: see `ss -ltnp`"
    p = psutil.Process(pid)
    out = f"pid {pid}: {_cmdline(p)}"
    try:
        marker = p.environ().get(MARKER_ENV)
    except (psutil.Error, OSError):
        marker = None
    if marker and not _launcher_gone(marker) and marker.split(":")[0].isdigit():
        out += f"; launched by the powerprof still running as pid {marker.split(':')[0]}"
    return out


def stop_orphan(port: int, grace_s: float = 10.0) -> str | None:
    """Stop the server listening on `port` if an earlier powerprof launched it and is gone (killed with
    SIGKILL, or crashed, before it could stop it): only this user's processes carrying that launch's marker.
    Returns what was done, for the run's notes; None where nothing was ours to stop."""
    pid = _listener_pid(port)
    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        marker = p.environ().get(MARKER_ENV) if _ours(p) else None
    except (psutil.Error, OSError):
        return None
    if not marker or not _launcher_gone(marker):
        return None
    cmd = _cmdline(p)
    procs = [q for q in _marked(marker) if _ours(q)] or [p]
    _signal_each(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal_each(alive, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=5)
    return (f"stopped the server an earlier powerprof launched and left listening on port {port} (pid {pid}: {cmd}): "
            f"that powerprof (pid {marker.split(':')[0]}) is gone, killed or crashed before it could stop it")


def _marked(marker: str) -> list:
    """This user's processes carrying the launch's marker in their environment."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER_ENV) == marker:
                out.append(p)
        except (psutil.Error, OSError):
            pass  # another user's, or gone meanwhile
    return out


DEATH_GRACE_S = 2.0  # death_note: how long a server that crashed on a request may take to exit
LOG_HEAD_BYTES = 1 << 20


def bound_log(path: Path, max_bytes: int) -> None:
    """Keep a log within about max_bytes: its first MiB (what the server was started with), a line
    saying how much was cut, and its newest part (how it ended)."""
    try:
        size = os.path.getsize(path)
        if size <= max_bytes:
            return
        head_n = min(LOG_HEAD_BYTES, max_bytes // 4)
        keep_tail = max_bytes // 2
        with open(path, "rb") as f:
            head = f.read(head_n)
            f.seek(size - keep_tail)
            newest = f.read(keep_tail)
        if b"\n" in head:
            head = head[: head.rindex(b"\n") + 1]
        if b"\n" in newest:
            newest = newest[newest.index(b"\n") + 1:]
        # The server appends (O_APPEND): cut to the head, then append. What it wrote since `size` was taken is read
        # again just before the cut (a server's last lines, written while the tail was read, were lost under load);
        # only what lands between that read and the cut is lost.
        with open(path, "rb") as f:
            f.seek(size)
            late = f.read()
        os.truncate(path, len(head))
        with open(path, "ab") as f:
            f.write(f"[... powerprof cut {size - len(head) - len(newest)} bytes of this log, "
                    f"which it keeps under {max_bytes} bytes ...]\n".encode() + newest + late)
    except OSError:
        pass


def tail(path: Path, n_lines: int = 30, max_bytes: int = 16384) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-n_lines:])


async def _probe(base_url: str) -> int | None:
    """Status of /health, or of /v1/models when /health does not exist; None when nothing answers."""
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers()) as s:
            async with s.get(base_url + "/health") as r:
                if r.status != 404:
                    return r.status
            async with s.get(base_url + "/v1/models") as r:
                return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


FIRST_POLL_S = 0.05  # the shortest wait between two readiness probes (ServerLauncher._wait_healthy)


class ServerLauncher:
    """Context manager around one server process. `ServerLauncher(cmd, "http://127.0.0.1:8080")`."""

    def __init__(
        self,
        cmd: str | list[str],
        base_url: str,
        timeout_s: float = 300.0,
        poll_s: float = 0.5,
        stop_grace_s: float = 10.0,
        log_path: str | Path | None = None,
        env: dict | None = None,
        port_free_wait_s: float = 5.0,
        max_log_bytes: int = 64 << 20,
        log_check_s: float = 2.0,
    ):
        try:
            self.argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        except ValueError as e:
            raise ValueError(f"--launch {cmd!r}: {e}: quotes must pair (it is split into words like a shell line; "
                             "no shell runs it)") from None
        if not self.argv:
            raise ValueError("--launch needs a command")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.stop_grace_s = stop_grace_s
        self.env = env
        self.port_free_wait_s = port_free_wait_s  # a just-stopped server's port takes a moment to close
        self.marker = _new_marker()
        self.notes: list[str] = []  # what the launch did beyond starting the command (an orphan stopped)
        self._own_log = log_path is None  # a temp file of ours, not a path the caller named
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="powerprof-server-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._old_handlers: dict = {}
        self.max_log_bytes = max_log_bytes
        self.log_check_s = log_check_s
        self._log_stop = threading.Event()
        self._log_thread: threading.Thread | None = None

    def _watch_log(self) -> None:
        # A server stuck printing can fill the disk within one configuration.
        while not self._log_stop.wait(self.log_check_s):
            bound_log(self.log_path, self.max_log_bytes)

    def start(self) -> "ServerLauncher":
        try:
            self._spawn()
        except BaseException:
            # Nothing ran (a program that is not there, a port taken): our temp log, empty, would be left in /tmp for
            # nothing, one a try. A log with output in it is kept; so is one the caller named.
            if self.proc is None and self._own_log:
                with contextlib.suppress(OSError):
                    if self.log_path.stat().st_size == 0:
                        self.log_path.unlink()
            raise
        atexit.register(self.stop)
        self._log_stop.clear()
        self._log_thread = threading.Thread(target=self._watch_log, name="powerprof-server-log", daemon=True)
        self._log_thread.start()
        self._install_signal_handlers()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        self._check_port_free()
        env = dict(os.environ if self.env is None else self.env, **{MARKER_ENV: self.marker})
        argv = self.argv
        if sys.platform.startswith("linux"):
            # The wrapper execs the command: a program that is not there must fail here, as Popen's own would.
            if shutil.which(argv[0], path=env.get("PATH", os.defpath)) is None:
                raise LaunchError(f"cannot start {argv[0]!r}: no such program (not found on PATH, or not executable)")
            argv = [sys.executable, "-I", "-S", "-c", _DEATHSIG, str(os.getpid()), *argv]
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # own process group: we can stop its children too
                    env=env,
                )
            except OSError as e:
                raise LaunchError(f"cannot start {self.argv[0]!r}: {e}") from None

    def _check_port_free(self) -> None:
        host, port = _host_port(self.base_url)
        if _accepts(host, port):
            stopped = stop_orphan(port, self.stop_grace_s)
            if stopped:
                self.notes.append(stopped)
        deadline = time.monotonic() + self.port_free_wait_s
        while _accepts(host, port):
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"something already listens on {host}:{port} ({_listener(port)}); it would answer in place of "
                    f"the launched server and be measured instead. Stop it, or give --server a free port "
                    f"(and the same port in --launch)."
                )
            time.sleep(0.1)

    def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        last = None
        while True:
            self._check_alive()
            last = termination.run(_probe(self.base_url))
            if last == 200:
                self._check_alive()  # it may have died while another process answered
                return
            if time.monotonic() >= deadline:
                seen = "no answer" if last is None else f"HTTP {last}"
                raise LaunchError(
                    f"server not healthy at {self.base_url}/health after {self.timeout_s:g} s ({seen}); "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}"
                )
            # Probed often at first, a tenth of the time waited later (poll_s at most): a server up in 1.5 s (a small
            # model, the simulator) is found within 0.15 s, not up to poll_s late each launch, and one loading its model
            # for minutes is probed no more often than every poll_s.
            time.sleep(min(self.poll_s, max(FIRST_POLL_S, (time.monotonic() - t0) / 10)))

    def _check_alive(self) -> None:
        code = self.proc.poll()
        if code is None:
            return
        hint = ("; a command that puts the server in the background (daemonises) cannot be used: run it in "
                "the foreground, so that powerprof owns it and can stop it") if code == 0 else ""
        raise LaunchError(
            f"server exited with code {code} before becoming healthy{hint}; last lines of {self.log_path}:\n"
            f"{tail(self.log_path)}"
        )

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            note(signum)  # re-raised before the next request should this exit be swallowed
            raise Terminated(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except (ValueError, OSError):
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError, TypeError):
                pass
        if self._old_handlers:
            clear()  # the run this launcher served is over: a noted signal has been acted on
        self._old_handlers = {}

    def death_note(self) -> str:
        """'' while the server runs; else how it ended and the tail of its log, for an error met mid-run
        (requests failing with 'connection refused' do not say the server died, nor where its output is)."""
        if self.proc is None:
            return ""
        try:
            # Asked after a request failed: a server that crashed on it may not have exited yet when the client
            # saw the connection drop (a loaded host), so it is given a moment; one still running costs that moment.
            code = self.proc.wait(timeout=DEATH_GRACE_S)
        except subprocess.TimeoutExpired:
            return ""
        how = f"exited with code {code}"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                pass
        return f"the launched server {how} during the run; last lines of {self.log_path}:\n{tail(self.log_path)}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period. Safe to call twice.

        Ctrl-C, SIGTERM or SIGHUP arriving meanwhile are held and re-delivered once the group is
        killed, so a second Ctrl-C cannot leave a slow-to-exit server running.
        """
        pending: list[int] = []
        held = _hold_signals(pending)
        try:
            p = self.proc
            if p is not None:
                strays: list = []
                try:
                    # start_new_session made the server the leader of a group whose id is its pid.
                    _signal_group(p.pid, signal.SIGTERM)
                    strays = _marked(self.marker)
                    _signal_each(strays, signal.SIGTERM)
                    t_end = time.monotonic() + self.stop_grace_s
                    try:
                        p.wait(self.stop_grace_s)
                    except subprocess.TimeoutExpired:
                        pass
                    psutil.wait_procs(strays, timeout=max(0.0, t_end - time.monotonic()))
                finally:
                    # Unconditional: the leader may be gone while children of the group live on,
                    # or the wait may have been cut short by an exception.
                    _signal_group(p.pid, signal.SIGKILL)
                    strays = _marked(self.marker)
                    _signal_each(strays, signal.SIGKILL)
                    try:
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
                    psutil.wait_procs(strays, timeout=5)
        finally:
            _release_signals(held)
            self._log_stop.set()
            if self._log_thread is not None and self._log_thread is not threading.current_thread():
                # A cut of the watcher's still under way beside this last one would append the tail twice.
                self._log_thread.join(5)
            bound_log(self.log_path, self.max_log_bytes)
            self._restore_signal_handlers()
            try:
                atexit.unregister(self.stop)
            except Exception:
                pass
            if pending:
                # Now the handler that was in place before the launch decides (KeyboardInterrupt, exit...).
                signal.raise_signal(pending[0])

    def __enter__(self) -> "ServerLauncher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _hold_signals(pending: list[int]) -> dict:
    """Replace the Python handlers of SIGINT/SIGTERM/SIGHUP by one that only records the signal.

    Swapping handlers rather than blocking with pthread_sigmask: the mask is per thread, and with
    other threads running the kernel hands the signal to one of them, after which Python still runs
    the handler in the main thread. Only possible from the main thread; elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}

    def record(signum, frame):
        pending.append(signum)

    held = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            old = signal.getsignal(sig)
            if old is None or old is signal.SIG_IGN:
                continue  # installed outside Python (cannot be put back) or ignored on purpose
            signal.signal(sig, record)
            held[sig] = old
        except (ValueError, OSError):
            pass
    return held


def _release_signals(held: dict) -> None:
    for sig, old in held.items():
        try:
            signal.signal(sig, old)
        except (ValueError, OSError, TypeError):
            pass


def _signal_each(procs: list, sig: int) -> None:
    for q in procs:
        try:
            q.send_signal(sig)
        except psutil.Error:
            pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
