"""The daemon process: wires sampler, proxy, scraper, tag API, ledger, datasets and /metrics together.

Threads: one sampler thread per collector (they only append to a queue), one flush thread (file
I/O). Everything else (proxy, ledger, tag API, scraping, /metrics) runs in one asyncio loop, so
the ledger needs no locks. SIGTERM/SIGINT: stop accepting, close every interval, flush, exit 0.
SIGHUP: re-read and re-validate the config; keep the old one on error.

One daemon per data dir (an exclusive flock on `<data_dir>/.daemon.lock`); a second one exits 1.
Under systemd the loop pings the watchdog while the writer thread is alive and not stuck.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import resource
import signal
import socket
import stat
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from powerprof.collectors.rapl import RaplError
from powerprof.collectors.sampler import Sample, Sampler
from powerprof.errtext import error_text
from powerprof.paths import cwd_joined
from powerprof.storage.atomic import atomic_path
from powerprof.storage.samples import sample_rows
from powerprof.storage.schema import gpu_uuids_value

from . import opentags, sdnotify, servingstate, streams, tagedge
from .config import Config, ConfigError, is_loopback, listen_host, load_config, missing_parent_text
from .guard import ConnectionGuard, quiet_bad_requests
from .inflight import InFlight
from .latency import RequestLatency
from .ledger import RAPL_HOLD_S, SERVING_ASSERTED_SOURCE, Ledger
from .metrics import NONE, GpuSnapshot, Snapshot, TagLimiter, make_registry, render
from .proxy import SERVER_OPTIONS, Proxy, RequestTrace, scrape_via_name
from .scrape import AT_FINISH, IGNORES_BEST_OF, PREFILLS_CHOICES_APART, RUNS_ON_AFTER_LEAVE, SCRAPE_TIMEOUT_S, Cadence, Scraper, burst_start_ns, new_session
from .store import COMPACTION_LOCK, Dataset, DatasetStore, Flusher, buffer_cap_rows
from .tagapi import PeerPolicy, stop_wait_s, tag_app
from .ticks import Waker, idle_period, sleep_on_grid
from .workmodel import GPUS_UNDECIDED_REASON

log = logging.getLogger("powerprof.daemon")


def _busy(ledger) -> bool:
    """Proxied requests or tags (open, or closing) held by the ledger: the loops run at their fast periods."""
    return bool(ledger.requests or ledger.tags or ledger.closed_tags)


def _read_span(scraper, scrape_at_ns: int) -> tuple[int, int]:
    """Where a scrape that began at `scrape_at_ns` read the counter (monotonic_ns): its GETs' span (`Scraper.read_ns`),
    not the scrape's own, which holds the wait for the proxy workers' refusals after them (up to 40 ms; with an idle
    worker nearly always): stamped in it, a window ended up to that late. A scraper that says none (a test's stand-in):
    the scrape's."""
    span = getattr(scraper, "read_ns", None)
    return span if span is not None else (scrape_at_ns, time.monotonic_ns())


# A request's end edge is read this long after the end: the energy counter lags by up to its
# refresh period (10-100 ms on current drivers).
END_EDGE_DELAY_S = 0.1
# An interval waits up to this many sampling periods for a RAPL read past its end (Ledger's rapl_hold_s): the read
# after an edge is due within one period, late by a loaded host's scheduling.
RAPL_HOLD_PERIODS = 3
# s: how often the daemon looks again at which GPUs the upstream's processes run on (workload/placement.py), whatever
# the GPUs' process lists show: a small context idle at the last look may have begun working since.
PLACEMENT_CHECK_S = 30.0
# s: how often every GPU's process list (nvmlDeviceGet{Compute,Graphics}RunningProcesses, a few NVML calls per GPU) is
# read; a list changed since the last check (a pid on a GPU or gone from one: the server reaching a new GPU) brings the
# check forward, so rows closed from a few seconds after are flagged, not up to PLACEMENT_CHECK_S later. The check
# itself (the host's socket list, the per-process utilisation read) runs only then.
PLACEMENT_LIST_S = 2.0
# Checks in a row that tell nothing (find_placement None, or an error) after which a standing server-gpu-unsampled flag
# is said in the log, once, with why and the fix, and its row note says the GPUs cannot be told (10: 5 min at 30 s).
UNKNOWN_CHECKS_SAY = 10
# Checks in a row that tell nothing after which a helper on an unsampled GPU no longer keeps the check due at every
# list read (_placement_loop): the server away (a restart) made it a full check every PLACEMENT_LIST_S for as long as it
# was away. Its return changes the lists, which brings a check, and that one sets the quick re-checks anew.
HELPER_UNKNOWN_CHECKS = 3
# While a helper stands on an unsampled GPU with every GPU's process list unchanged, the full check (the host's
# process tree, every GPU's list, the samples) backs off: PLACEMENT_LIST_S after the check that found it, then doubled
# at each check up to PLACEMENT_CHECK_S. Before, a helper that never went away (PyTorch's default-device context)
# kept the full check every 2 s for the daemon's life: 30 a minute, 2 once backed off. In between, every list read
# looks at the helper GPUs alone (_helper_moved: their server pids' sizes and samples since the last check), so one
# that grows or begins working is checked at that read, as before.
# Checks in a row at which a GPU judged a helper before has per-process samples that cannot be read (UTIL_TRIES reads
# each) before it counts as serving: until then unknown, its helper state kept. One transient failure (pynvml's
# INSUFFICIENT_SIZE, samples arriving between its two calls) had flagged the GPU and its rows for ~30 s.
UNREAD_HELPER_CHECKS = 3
# The server's counters are read once before the daemon says ready (detection and one scrape: three GETs at most).
BASELINE_WAIT_S = 3 * SCRAPE_TIMEOUT_S
# At a clean stop, one last read of them past the last sample, waited for this long at most (one GET's own limit).
FINAL_SCRAPE_S = SCRAPE_TIMEOUT_S

EXIT_OK, EXIT_RUNTIME, EXIT_CONFIG = 0, 1, 2


# The config key and flag that set each TCP listener's address: what a refused address's message says to change.
_LISTEN_KEYS = {"proxy": ("proxy.listen", "--listen"), "metrics endpoint": ("metrics.listen", "--metrics-listen")}


def _listen_fix(what: str, e: BaseException) -> str:
    """The fix for an address the daemon cannot listen on ("address already in use" said only that)."""
    if what not in _LISTEN_KEYS:
        return ""
    key, flag = _LISTEN_KEYS[what]
    held = (" (another program holds it: another powerprof daemon, or the inference server itself?)"
            if getattr(e, "errno", None) == errno.EADDRINUSE else "")
    return f"{held}; give the {what} another address: {key} in the config, or {flag} HOST:PORT"


async def upstream_problem(url: str, timeout_s: float) -> str | None:
    """Why the upstream at `url` takes no connection now (refused, a name that does not resolve, no answer within
    `timeout_s`), or None when its port takes one. A TCP connection only: no request reaches the server.

    The name is resolved here and each of its addresses tried, as a connection would: `localhost` is ::1 and
    127.0.0.1, and asyncio's own words for both refused ("Multiple exceptions: [Errno 111] Connect call failed
    ('::1', 8080, 0, 0), …") said neither why nor where in a form to read. Each address's reason is said."""
    u = urlsplit(url)
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        return "its port is not a number from 1 to 65535"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(u.hostname, port, type=socket.SOCK_STREAM), timeout_s)
    except asyncio.TimeoutError:
        return f"the name {u.hostname} did not resolve within {timeout_s:g} s"
    except socket.gaierror as e:
        return f"the name {u.hostname} cannot be resolved ({e.strerror or error_text(e)})"
    addresses = list(dict.fromkeys(info[4][0] for info in infos))  # in the resolver's order, each once

    async def why(address: str) -> str | None:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(address, port),
                                               max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return f"no answer within {timeout_s:g} s"
        except OSError as e:
            # asyncio's own words ("Connect call failed ('127.0.0.1', 9)") do not say why; the errno's do.
            return os.strerror(e.errno).lower() if e.errno else error_text(e)
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return None

    reasons = await asyncio.gather(*(why(a) for a in addresses))
    if not addresses or None in reasons:
        return None if addresses else f"the name {u.hostname} resolves to no address"
    if len(addresses) == 1:
        return reasons[0]
    where: dict[str, list[str]] = {}
    for address, reason in zip(addresses, reasons):
        where.setdefault(reason, []).append(address)
    return "; ".join(f"{reason} on {_and(these)}" for reason, these in where.items())


def _and(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


class StartupError(RuntimeError):
    """Something outside the config stops the daemon from starting (port taken, no NVML)."""


def datasets() -> list[Dataset]:
    from powerprof.storage.schema import COLUMNS, DAEMON_DATASETS

    time_column = {"samples": "time_utc", "requests": "t_arrival_utc", "intervals": "t_start_utc", "tags": "t_start_utc",
                   "costs": "time_utc"}
    return [Dataset(name, COLUMNS[table], time_column[name]) for name, table in DAEMON_DATASETS.items()]


def restore_pending(rig) -> None:
    """Put back power limits a crashed sweep left behind, and say so in the log. A simulator state file refused
    (`trust.PlaceRefused`) is no failed restore: it stops the start, said once as its error (it was logged first as
    "restoring the limits left by a crashed sweep failed", though no sweep had crashed)."""
    from powerprof.trust import PlaceRefused

    try:
        report = rig.restore()
    except PlaceRefused:
        raise
    except Exception as e:
        log.error("restoring the limits left by a crashed sweep failed: %s", error_text(e))
        return
    if report.outcomes:
        level = logging.WARNING if report.ok else logging.ERROR
        for line in report.lines():
            log.log(level, "restore at start: %s", line)
    else:
        log.info("restore at start: %s", " ".join(report.lines()))


# Open files the daemon asks for (the soft limit, up to the hard one). systemd gives a service a soft limit of 1024
# (for select(), which nothing here uses) and a hard one of 524288: at 1024, ~500 concurrent proxied requests (a
# client and an upstream descriptor each) or 1000 idle connections left none for a Parquet file or /metrics.
OPEN_FILES_WANTED = 65536
# Descriptors beside the proxy's: Parquet files, the compaction child's pipes, NVML, /metrics, the tag socket, logs.
OPEN_FILES_RESERVE = 256


def raise_open_files_limit(want: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft RLIMIT_NOFILE to `want` (or its hard limit, if lower); the soft limit now in force.
    Children (proxy workers, the compaction child) inherit it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, error_text(e))
    return soft


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs reach the same listener (scheme, host name, port): the proxy's refused connects to its upstream
    prove the scraped server down only where it is the scraped one (not a gateway in front of it, or another)."""
    try:
        ua, ub = urlsplit(a), urlsplit(b)
        pa = ua.port or (443 if ua.scheme == "https" else 80)
        pb = ub.port or (443 if ub.scheme == "https" else 80)
    except ValueError:
        return False
    return (ua.scheme.lower(), (ua.hostname or "").lower(), pa) == (ub.scheme.lower(), (ub.hostname or "").lower(), pb)


def _split_listen(v: str) -> tuple[str, int]:
    host, _, port = v.rpartition(":")
    return host.strip("[]"), int(port)


def http_url(host: str, port: int) -> str:
    """http://HOST:PORT with an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def memory_limit_bytes(proc: Path = Path("/proc/self/cgroup"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup v2 memory bound: the lower of memory.max and memory.high (the unit's MemoryMax= and
    MemoryHigh=: above the high mark the kernel throttles the whole cgroup, the proxy in the request path too, so the
    buffers are sized under it as under the hard limit), or None when both are unlimited or unknown."""
    try:
        for line in proc.read_text().splitlines():
            if line.startswith("0::"):
                folder = cgroup_root / line[3:].lstrip("/")
                bounds = []
                for name in ("memory.max", "memory.high"):
                    try:
                        text = (folder / name).read_text().strip()
                    except FileNotFoundError:
                        continue  # a cgroup without the memory controller has neither file
                    if text != "max":
                        bounds.append(int(text))
                return min(bounds) if bounds else None
    except (OSError, ValueError):
        return None
    return None


# Resident memory measured after traffic (docs/daemon.md, Several proxy processes): the daemon with 8 simulated GPUs,
# and each proxy worker process beside it in the same cgroup (proxy.workers > 1).
DAEMON_RESIDENT_MIB = 70
WORKER_RESIDENT_MIB = 45


def buffered_rows_cap(limit_bytes: int | None, workers: int, n_datasets: int) -> int:
    """Rows per dataset kept while writes fail (daemon.max_buffered_rows = 0): `buffer_cap_rows` of what the memory
    bound leaves once the proxy workers are counted (separate processes in the daemon's cgroup), so buffers, daemon
    and workers fit together."""
    if limit_bytes is None:
        return buffer_cap_rows(None, n_datasets)
    workers_b = (WORKER_RESIDENT_MIB * workers) << 20 if workers > 1 else 0
    return buffer_cap_rows(max(1, limit_bytes - workers_b), n_datasets)


def untrusted_data_dir(data_dir: Path, euid: int | None = None) -> str | None:
    """Why root must not run on `data_dir`; None when only root could have written it (or this process
    is not root). Root writes files, replaces them and deletes old partitions there: in a folder another
    user can write, that user could point any of those names (a symlinked `.daemon.lock`) at any file
    on the machine. The folder and every folder above it must be root's and writable by no one else
    (root's sticky /tmp excepted: others cannot rename in it)."""
    from powerprof.trust import untrusted_folder

    return untrusted_folder(data_dir, euid)


def prepare_socket_path(path: Path, what: str, euid: int | None = None) -> None:
    """Make `path` free for a new Unix socket: a socket nothing listens on (a killed daemon's) is removed; one a
    process listens on, and anything else there (a file, a symlink), is refused, never followed nor replaced. As root, also refused in a folder another user could
    write: they could swap the name for a symlink between the check and the bind or chmod, or later rename root's
    socket away and put their own in its place (the proxy's clients would then send their requests to them)."""
    why = untrusted_data_dir(path.parent, euid)
    if why:
        raise StartupError(f"refusing, as root, a socket folder another user could write for the {what}: {why}")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; not replacing it (give the {what} another path)")
    unknown = _stale_socket_problem(path)
    if unknown is not None:
        key, flag = _SOCKET_KEYS.get(what, ("its config key", "its flag"))
        fix = f"give the {what} another path ({key} in the config, or {flag})"
        if unknown == "":
            raise StartupError(f"another process listens on {path} (another powerprof daemon?): stop it, or {fix}")
        raise StartupError(f"cannot tell whether a process listens on {path} ({unknown}), so it is not replaced: "
                           f"remove it if none does, or {fix}")
    path.unlink(missing_ok=True)


# The config key and flag that set each Unix socket's path: what the message for one taken says to change.
_SOCKET_KEYS = {"tag API": ("tags.socket", "--tag-socket PATH"), "proxy": ("proxy.listen", "--listen unix:PATH"),
                "metrics endpoint": ("metrics.listen", "--metrics-listen unix:PATH")}
# A listener on this machine answers a Unix connect at once; a stale socket refuses it at once.
SOCKET_PROBE_S = 0.5


def _stale_socket_problem(path: Path) -> str | None:
    """None when nothing listens on the Unix socket at `path` (connecting is refused, as on a socket a killed daemon
    left); "" when a process does (it takes a connection, or its queue is full); else why that cannot be told (no
    permission to connect). Unlinking a socket still listened on took it from a running daemon (a second one given
    the same --tag-socket): the first ran on, its clients cut off."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(SOCKET_PROBE_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):  # FileNotFoundError: gone since the lstat
            return None
        except (BlockingIOError, TimeoutError):  # a listener whose queue is full, or that does not accept
            return ""
        except OSError as e:
            return f"connecting to it: {os.strerror(e.errno).lower() if e.errno else error_text(e)}"
    return ""


class BoundSocket(NamedTuple):
    """A Unix socket this daemon bound, as `bound_socket` found it: what `remove_bound_socket` removes at the stop."""

    path: Path
    dev: int
    ino: int
    ctime_ns: int
    fd: int | None  # an O_PATH descriptor on its inode, held to the stop; None where none could be opened


def bound_socket(path: Path) -> BoundSocket:
    """The socket just bound at `path`, its inode held open (O_PATH) for the daemon's life: an inode held cannot be
    freed, so no socket made at the path since (ours renamed away, or unlinked) can take its number, and device and
    inode alone tell it, through a chmod, chgrp or setfacl (which change the change time). Where no descriptor can be
    held (none to spare; no O_PATH off Linux), the change time is what tells a reused inode number."""
    st = os.lstat(path)
    fd = None
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) != (st.st_dev, st.st_ino):  # swapped between the two: hold nothing
            os.close(fd)
            fd = None
    except (AttributeError, OSError):
        if fd is not None:
            os.close(fd)
        fd = None
    return BoundSocket(path, st.st_dev, st.st_ino, st.st_ctime_ns, fd)


def remove_bound_socket(bound: BoundSocket) -> None:
    """Remove the socket `bound_socket` recorded, only while it is still that one: a socket another daemon bound at
    the path since (or anything else put there, a symlink never followed) is left. Left behind, a dead daemon's
    socket refused every `powerprof tag` with a raw connection error."""
    path, dev, ino, ctime_ns, fd = bound
    try:
        st = os.lstat(path)
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == (dev, ino):
            if fd is not None or st.st_ctime_ns == ctime_ns:
                path.unlink()
            else:
                # Its inode number, but not held: a chmod of ours, or a socket made since that got the number.
                log.warning("left the socket %s at the stop: it changed since the bind (a chmod, chgrp or setfacl, or "
                            "a socket another process made there since), and with no descriptor held on it it cannot "
                            "be told from another's. If no daemon listens on it, rm %s", path, path)
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("cannot remove the socket %s at the stop: %s", path, error_text(e))
    finally:
        if fd is not None:
            os.close(fd)


def _shared_folder_to_make_it_in(data_dir: Path) -> Path | None:
    """The root-owned sticky folder others can write (/tmp) that a data dir not yet made would be made in, or None."""
    there = cwd_joined(data_dir)
    if os.path.lexists(there):
        return None
    while not os.path.lexists(there) and there != there.parent:
        there = there.parent
    try:
        st = os.lstat(there)
    except OSError:
        return None
    shared = stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & stat.S_ISVTX and st.st_mode & 0o002
    return there if shared else None


def lock_data_dir(data_dir: Path, euid: int | None = None, parents: bool = False) -> int:
    """An exclusive flock held for the daemon's life, so two daemons never write one data dir (duplicate rows).

    A data dir not there yet is made, mode 0700 (as docs/daemon.md's `mkdir -m 0700`); the folders above it only with
    `parents` (the default data dir, that no one typed: a new user's ~/.local/state may not exist). A path given
    whose parent is missing is refused: `--data-dir /srv/powerprf/data` made the whole mistyped tree, mode 0755."""
    # Checked before anything is made: `mkdir -p` through another user's symlink makes root's folders wherever it points.
    from powerprof.trust import untrusted_contents, untrusted_place

    why = untrusted_place(data_dir, euid)
    if not why:
        parent = cwd_joined(data_dir).parent
        outer = next((p for p in (parent, *parent.parents) if os.path.lexists(p / ".daemon.lock")), None)
        if outer is not None:
            # `--data-dir dd1/requests` was taken: every file it wrote then read as dd1's (analyze: 684 requests where
            # dd1 held 550, its samples and intervals added in, unsaid).
            raise StartupError(
                f"data dir {data_dir} is inside another daemon's data dir {outer}: its datasets would be read as that "
                f"one's rows (its requests/ as requests, its samples as samples). Fix: give a folder outside {outer}")
        if parents:
            parent.mkdir(parents=True, exist_ok=True)
        elif not os.path.lexists(data_dir) and not parent.is_dir():
            raise StartupError(f"data dir {data_dir}: {missing_parent_text(data_dir)}")  # --check says it first
        data_dir.mkdir(mode=0o700, exist_ok=True)
        # And the folders in it (datasets, their days' partitions): `chown root:` of the data dir alone left another
        # user's `requests/` in it, where they could link a partition to any folder (rows written there, files deleted).
        why = untrusted_data_dir(data_dir, euid) or untrusted_contents(data_dir, euid)
    if why:
        shared = _shared_folder_to_make_it_in(data_dir)
        if shared is not None:
            there = cwd_joined(data_dir)
            made = [p for p in (there, *there.parents) if p.parent == shared or shared in p.parents]
            made.reverse()  # the first folder root would make in `shared`, then those below it
            # The data dir is not there yet and would be made in /tmp (anyone may add names there): "chmod go-w it
            # and the folders above" told root to take the write bit off /tmp. Made first, a folder of root's own
            # in /tmp passes (the sticky bit keeps others from renaming it).
            raise StartupError(
                f"refusing to run as root on data dir {data_dir}: it does not exist yet, and root makes no folder in "
                f"{shared}, which others can write (mode {stat.S_IMODE(os.stat(shared).st_mode):o}). Fix: make it "
                f"first (mkdir -m 0700 {made[0]}{', then the folders in it' if len(made) > 1 else ''}), "
                f"or run the daemon as a user of its own (as the unit does: User=powerprof)")
        raise StartupError(
            f"refusing to run as root on data dir {data_dir}: {why}; another user could make root write or "
            f"delete any file through it. Run the daemon as the folder's owner (as the unit does: User=powerprof), "
            f"or give root a folder of its own (chown -R root: it, and chmod go-w it, the folders in it and those above)")
    path = data_dir / ".daemon.lock"
    # Never through a symlink: the lock is truncated and rewritten.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StartupError(
                f"another powerprof daemon (pid {holder}) already writes to {data_dir}; "
                "stop it, or give this one another daemon.data_dir"
            ) from None
        raise StartupError(f"cannot lock {path}: {e}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            os.close(fd)
            raise
        # The lock is held (flock needs no space); only the PID a second daemon's refusal names is missing. A full disk
        # stopped the start here, and the proxy in the clients' path with it: rows wait in memory, as for a disk that
        # fills later.
        log.warning("data dir %s: the disk is full (%s): the daemon runs, its rows wait in memory until there is space",
                    data_dir, e.strerror)
    return fd


class NewPaths:
    """What a start that fails before ready takes back: the folders and lock files it made in and above the data dir,
    only those that were not there before and only while empty (a daemon that could not bind its port left a data
    dir of five empty dataset folders and two lock files behind). Rows are never removed: none is written before."""

    LOCKS = (".daemon.lock", COMPACTION_LOCK)

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir).absolute()
        self.made: list[Path] = []  # the data dir and the folders above it that do not exist yet, deepest first
        p = self.data_dir
        while not os.path.lexists(p) and p != p.parent:
            self.made.append(p)
            p = p.parent
        self.entries = set(os.listdir(self.data_dir)) if not self.made and self.data_dir.is_dir() else set()

    def take_back(self) -> None:
        try:
            names = set(os.listdir(self.data_dir)) - self.entries
        except OSError:
            return
        for name in sorted(names):
            p = self.data_dir / name
            try:
                if name in self.LOCKS and p.is_file() and not p.is_symlink():
                    p.unlink()
                elif p.is_dir() and not p.is_symlink():
                    p.rmdir()  # only if empty
            except OSError:
                pass
        for d in self.made:
            try:
                d.rmdir()
            except OSError:
                break


class _HeldWindow(NamedTuple):
    """A slow scrape window ending a stillness, held until the next scrape's rate says where its burst began."""
    since_ns: int
    t_ns: int
    delta: float
    finished: tuple[float, float] | None  # the scraper's (requests, seconds) finished in it, at-finish servers
    partial: tuple
    read_ns: tuple[int, int]
    # the scraper's (requests finished, in flight, their tokens) at its end (Scraper.served)
    served: tuple[float, float, float] | None
    restart_by_fall: bool = False  # Scraper.restart_by_fall
    down_ns: int | None = None  # Scraper.window_down_ns
    down_refused: bool = False  # Scraper.window_down_refused
    read_missed: float = 0.0  # Scraper.window_read_missed
    # The earliest arrival of the proxied requests live at its scrape (None: none): its burst began no later
    arrived_ns: int | None = None
    past_reach: bool = False  # Scraper.window_past_reach


def held_death_part(held: _HeldWindow, start_ns: int) -> tuple[int, bool]:
    """Where a held slow window split at its burst's `start_ns` may give its death (a restart the page said, or a
    refused down scrape: `Ledger.add_server_tokens` records one): (the split point, whether the first part takes it).
    The first part, (since, start], takes it where its first found-down scrape falls in it: the old process died before
    it. A refused down scrape in the burst that the page says no restart of: the burst part, its death's window from
    `since` all the same (`Ledger.add_server_tokens`' dead_from_ns: it may have come anywhere in it). Given whole, the
    burst's tokens were spread over the stillness before it, its intervals `complete` (20 bypass tokens over 1.9 s of
    idle and 0.1 s of burst: 19 in the idle intervals, 120 J unproxied for 25). Else it is given whole, unsplit (a
    restart the page said, its intervals `server_restart`, with no down scrape or one in the burst). Each part given the
    same restart, the part without the down scrape read down=None, "the start time said it": a running batch's span cut
    from 31.6 s to 5.5 s after its arrival while it ran on (batchfix8's review, fault 3)."""
    said = "server_restart" in held.partial and not held.restart_by_fall
    if not (said or held.down_refused):
        return start_ns, False
    if held.down_ns is not None and held.since_ns < held.down_ns <= start_ns:
        return start_ns, True
    if not said and held.down_ns is not None and start_ns < held.down_ns <= held.t_ns:
        return start_ns, False
    return held.since_ns, False


def gpu_serving(tot, k: int) -> bool | None:
    """Whether the `k`th sampled GPU's energy is the work's in the ledger's totals (powerprof_gpu_serving), None where
    not said: which of several GPUs serve undecided (every GPU's energy the work's: not the same as all serving)."""
    if tot.serving_undecided:
        return None
    return True if tot.serving_mask is None else bool(tot.serving_mask[k]) if k < len(tot.serving_mask) else None


class Daemon:
    def __init__(
        self,
        cfg: Config,
        rig,
        extra_collectors=(),
        config_path: str | None = None,
        overrides: dict | None = None,
        store_write=None,
    ):
        """`rig`: the door (powerprof.rig.Rig) that opens the GPUs, RAPL and, where it has one, a
        default upstream; the daemon never branches on whether they are real, it only says so (its log, every row's
        `simulated`, powerprof_build_info)."""
        self.cfg = cfg
        self.loop_id = uuid.uuid4().hex[:16]  # the proxy's Via name's, one for all its workers and the scraper
        self.host = cfg.host()  # every Parquet row and powerprof_build_info carry it
        self.simulated = rig is not None and rig.simulated  # so does powerprof_build_info{simulated}
        self.rig = rig
        self.extra_collectors = list(extra_collectors)
        self.config_path = config_path
        self.overrides = overrides or {}
        self.store_write = store_write
        self.daemon_id = uuid.uuid4().hex[:12]
        self.samples: deque[Sample] = deque()
        self.snapshot = Snapshot()
        self.tokens_by_tag: Counter = Counter()
        self.requests_by_tag: Counter = Counter()
        self.count_contradictions: Counter = Counter()  # {reason: requests whose server count contradicts its stream}
        self.uncounted_requests: Counter = Counter()  # {kind: requests of GPU work the proxy does not count}
        self.latency = RequestLatency()  # the tuner's view of the traffic (docs/tuner.md)
        self.inflight = InFlight(time.monotonic_ns())  # …and its early signal: requests in flight, awaiting a token
        self.stop_event: asyncio.Event | None = None
        self.reload_requested = False
        self.waker = Waker()  # ends the loops' idle sleeps when work arrives (ticks.py)
        # Ends the scrape loop's fast sleep too, which no request ends: a reload's new periods apply at once.
        self.config_waker = Waker()
        self.urls: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []
        self._sockets: list[BoundSocket] = []  # the Unix sockets this daemon bound: removed at its stop
        self._info_path: Path | None = None  # daemon.json once written: removed at the stop
        self._open_tags_dir: Path | None = None  # where the open tag windows are kept (opentags.py) once ready
        self._lost_tags: dict[str, int] = {}  # windows the daemon before left open (closed_by lost), for tag stop
        self._last_edge_s = 0.0
        self.edge_reads = 0  # on-demand counter reads at short requests' edges
        self.bad_requests = None  # guard.BadRequestLog once run() starts
        self._edge_costs: deque[float] = deque(maxlen=9)  # CPU s of the latest such reads
        self.edge_cpu_total_s = 0.0
        self.guard: ConnectionGuard | None = None
        self._lock_fd: int | None = None
        self._take_back: NewPaths | None = None  # set when a start fails before ready (run)
        self._wd_period = sdnotify.watchdog_period_s()
        self._wd_next = 0.0
        self._wd_bad = False
        self.early_signals: list[int] = []  # SIGINTs that came before the loop's handlers
        # Opened by run(): collectors, the store and its writer, the ledger, the sampler, listeners.
        self.sources = None
        self.upstream: str | None = None
        self.collector = None
        self.gpu_uuids: dict[int, str] = {}
        self.t0_ns = 0
        self.store: DatasetStore | None = None
        self.ledger: Ledger | None = None
        self.tags: TagLimiter | None = None
        self.flusher: Flusher | None = None
        self._serving_keeper: servingstate.Keeper | None = None  # keeps each judged serving mask, off the event loop
        self.sampler: Sampler | None = None
        self.proxy: Proxy | None = None
        self.scraper: Scraper | None = None
        self._scrape_since_ns: int | None = None  # when the baseline was read before ready (None: not then)
        # When the latest scrape began: its read came no sooner (a window's prefix-cache hits are checked from there)
        self._scrape_read_from_ns: int | None = None
        self.latest_gpu: Sample | None = None
        self._gpu_notes: dict[int, str | None] = {}  # NVML index -> its last reading's note
        self._gpu_lost: dict[int, bool] = {}  # NVML index -> lost at its last reading (a change is logged)
        self._tasks: list[asyncio.Task] = []

    # --- recorder: the ledger plus the metric counters -----------------------------------------

    def on_start(self, trace: RequestTrace) -> None:
        # Only generation requests are the queue's: a health check or a model list never gets a first
        # token, and a poller would read as requests stuck awaiting one.
        if trace.api is not None:
            self.inflight.start(trace.request_id, trace.arrival_ns, trace)
        try:
            self.ledger.on_start(trace)
            self._request_edge("request-arrival")
            self.waker.wake()  # the loops to their fast periods (a no-op unless they sleep idle)
        except BaseException:
            # A failed recording gets no later calls (Proxy._safe): it would stay in flight for ever.
            self.inflight.end(trace.request_id, time.monotonic_ns())
            raise

    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None:
        self.inflight.first(trace.request_id, t_ns)
        try:
            # Per token chunk: an untagged request's label without the limiter's call.
            self.tokens_by_tag[self.tags.label(trace.tag) if trace.tag else NONE] += n
            self.ledger.on_tokens(trace, t_ns, n)
            if trace.first_ns == t_ns:
                # A first piece holding every token its max_tokens allows (vLLM's one token in the closing chunk) ends
                # the request's work: its edge is its end's, read once the counter has caught up. Read at once, the
                # rate limit then left out the end's, and its last joules went to an interval it was no longer live in
                # (idle): a 1-token answer alone read -33% about one run in two.
                limit = trace.extra.get("max_tokens")
                done = limit is not None and trace.tokens_seen >= limit * max(trace.extra.get("sequences", 1), 1)
                self._request_edge("request-end" if done else "request-first-token")
        except BaseException:
            self.inflight.end(trace.request_id, time.monotonic_ns())
            raise

    def note_proxy_delay(self, t_ns: int, delay_s: float) -> None:
        """How late the proxy's event loop ran (proxy workers' heartbeats; this loop's own ticks where it serves the
        proxy itself): the bound on a delay of the proxy's own that the ledger's bypass count checks (reconcile.PROXY_LAG)."""
        self.ledger.note_proxy_delay(t_ns, delay_s)

    def on_end(self, trace: RequestTrace) -> None:
        self.inflight.end(trace.request_id, trace.end_ns if trace.end_ns is not None else time.monotonic_ns())
        if trace.extra.get("spread"):
            self.tokens_by_tag[self.tags.label(trace.tag)] += trace.tokens_seen
        self.requests_by_tag[(self.tags.label(trace.tag), trace.outcome)] += 1
        kind = streams.uncounted_kind(trace.method, trace.endpoint) if trace.api is None else None
        if kind == "embeddings" and trace.extra.get("prompt_tokens") is not None:
            kind = None  # its answer gave its input's length: its work (a prefill) is counted (liverequest.is_unseen)
        if kind is not None and (trace.status is None or trace.status < 400):
            # GPU work whose tokens the proxy cannot read: said on /metrics (and on its row), never a silent zero.
            self.uncounted_requests[kind] += 1
        c = trace.counts
        gen = c.generated_tokens if c is not None and c.generated_tokens is not None else trace.tokens_seen
        if c is not None and c.count_problem is not None:
            self._count_contradicted(trace)
            # Its timing is real and the tuner's guard reads these histograms: TPOT and output length from
            # the proxy's own count (what attribution uses), not the server's contradicted one.
            gen = trace.tokens_seen
        added = self.ledger.on_end(trace)
        self.latency.observe(trace.arrival_ns, trace.first_ns, trace.last_ns, gen,
                             c.prompt_tokens if c is not None else None,
                             # A non-streamed answer with no server timing is spread from its arrival.
                             first_seen=not (trace.extra.get("spread") and trace.first_ns == trace.arrival_ns),
                             # A stream that reached the proxy in one burst: its last - first is the burst's; in
                             # several, the pace after its first piece is the server's.
                             shown_first=self.ledger.tokens_at_first(trace.request_id, gen or 0),
                             sequences=max(trace.extra.get("sequences", 1), 1))
        if added:  # a stream counted one token per chunk, set to the server's final count
            self.tokens_by_tag[self.tags.label(trace.tag) if trace.tag else NONE] += added
        self._request_edge("request-end")

    def _count_contradicted(self, trace: RequestTrace) -> None:
        """A request whose server count contradicts its stream: counted on /metrics by which rule it broke, and
        logged (the first few, then every 100th: a lying server does it for every request)."""
        problem = trace.counts.count_problem
        self.count_contradictions[trace.counts.count_problem_kind] += 1
        n = sum(self.count_contradictions.values())
        if n <= 3 or n % 100 == 0:
            log.warning("request %d: %s; its row has no generated_tokens or J/token (%d such requests so far)",
                        trace.request_id, problem, n)

    def _request_edge(self, label: str) -> None:
        """With few requests in flight, read the GPU energy counters alone now (an interval edge of
        the request's own), at a bounded rate: a short request is then measured over its span, not
        over a whole sampling interval shared with idle time (docs/daemon.md, Short requests)."""
        if self.proxy is None or self.sampler is None or not self.sampler._threads:
            return
        if self.proxy.active > self.cfg.get("attribution", "edge_max_inflight"):
            return
        now = time.monotonic()
        # A real H200's counter read costs ~3 ms of CPU per GPU (docs/hardware.md): the reads' own
        # measured cost, not only their count, sets how often they may run.
        cost_s = sorted(self._edge_costs)[len(self._edge_costs) // 2] if self._edge_costs else 0.0  # the median
        gap = max(1.0 / self.cfg.get("attribution", "edge_max_per_s"), cost_s / self.cfg.get("attribution", "edge_cpu_share"))
        if now - self._last_edge_s < gap:
            return
        self._last_edge_s = now
        loop = asyncio.get_running_loop()

        def read() -> None:
            if self.stop_event is not None and self.stop_event.is_set():
                return  # shutting down: the last sample closes every interval
            fut = loop.run_in_executor(None, self._timed_edge_read)
            fut.add_done_callback(self._edge_read)  # in the loop's thread, where the ledger lives

        # The driver refreshes the counter every 10-100 ms: read at an end that late, or the request's
        # last joules land in the idle interval after it (the idle split takes the wait back out).
        if label == "request-end":
            loop.call_later(END_EDGE_DELAY_S, read)
        else:
            read()

    def _timed_edge_read(self):
        c0 = time.thread_time()
        got = self.sampler.read_with("nvml", self.collector.read_energy_j)
        return got, time.thread_time() - c0

    def _edge_read(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None or self.ledger is None:
            return
        (t_ns, wall_ns, energy_j), cpu_s = fut.result()
        # The median of the latest reads: the driver's cost can change (load, GPU count, firmware),
        # and one read stalled for a second must not space the next ones by minutes.
        self._edge_costs.append(cpu_s)
        self.edge_reads += 1
        self.edge_cpu_total_s += cpu_s
        if energy_j is not None:
            self.ledger.add_gpu_edge(t_ns, wall_ns, energy_j)

    # --- tag API ---------------------------------------------------------------------------------

    async def _edge(self, label: str) -> tuple[int, int, tagedge.StopEdge | None, bool]:
        """A tag window's edge (a stop's where `label` starts tag-stop:), held until every GPU's counter refreshed past
        the call (tagedge.py): (its instant, its wall time, for a stop what its window gives back, whether it was
        held). Not held (a full sample at once, as before) on GPUs without a counter or one that did not move within
        tagedge.HOLD_MAX_S."""
        stop = label.startswith("tag-stop:")
        loop = asyncio.get_running_loop()
        held = await loop.run_in_executor(None, lambda: self._hold_edge(stop))
        at = self.ledger.add_gpu_edge(*held[1]) if held is not None else None  # in the loop's thread, as every edge
        if at is None:
            got = await loop.run_in_executor(None, lambda: self.sampler.sample_now(label, sources=["nvml"]))
            s = got.get("nvml")
            if s is None or s.data is None:
                return time.monotonic_ns(), time.time_ns(), None, False
            # the instant the ledger dates this edge at
            return (*Ledger.sample_instant(s.t_mono_ns, s.t_wall_ns, s.data), None, False)
        if not stop:
            return (*at, held[3], True)
        return (*at, await loop.run_in_executor(None, lambda: self._stop_trim(*held[:3])), True)

    def _read_counters(self) -> tuple:
        return self.sampler.read_with("nvml", self.collector.read_energy_j)

    def _hold_edge(self, stop: bool) -> tuple | None:
        """(the first counter read, the read that saw every GPU's energy counter refreshed after it: the edge, each
        GPU's refresh, for a start what its edge holds of before it); None without a counter, or where one did not
        move in time. A start waits for a second refresh: the power before the client's work, for its trim."""
        first = self._read_counters()
        at0 = getattr(first[2], "t_mono_ns", ())
        if first[2] is None or len(at0) != len(first[2]):
            return None
        r1 = tagedge.wait_refresh(self._read_counters, tuple(first[2]), at0, self.sampler.clock.monotonic_ns,
                                  after_lo_ns=tagedge.call_start(first[2]))
        if r1 is None or stop:
            return None if r1 is None else (first, r1[1], r1[0], None)
        r2 = tagedge.wait_refresh(self._read_counters, tuple(f.value_j for f in r1[0]), tagedge.still_at(r1[1], r1[0]),
                                  self.sampler.clock.monotonic_ns, after_lo_ns=tagedge.still_from(r1[1], r1[0]))
        if r2 is None:
            return None
        return first, r2[1], r2[0], tagedge.StopEdge(tagedge.start_trim_j(r1[0], r2[0], r2[1]), 0.0,
                                                     tagedge.start_misdated_j(r1[0], r2[0], r2[1]),
                                                     tagedge.off_ms(r1[0], r2[0]))

    def _stop_trim(self, first: tuple, edge: tuple, fresh: list) -> tagedge.StopEdge:
        """What a held stop edge's window gives back: the energy drawn between the stop call (`first` read) and the
        edge's counter values, at the power each counter shows over its next refresh."""
        at0 = first[2].t_mono_ns
        held_s = max(edge[0] - min(at0), 0) / 1e9
        r2 = tagedge.wait_refresh(self._read_counters, tuple(f.value_j for f in fresh), tagedge.still_at(edge, fresh),
                                  self.sampler.clock.monotonic_ns, after_lo_ns=tagedge.still_from(edge, fresh))
        if r2 is None:  # stalled since: the measured part alone (what came after the first refresh)
            r2 = (fresh, None)
        return tagedge.StopEdge(tagedge.stop_trim_j(at0, tuple(first[2]), fresh, r2[0], tuple(edge[2])), held_s,
                                tagedge.stop_misdated_j(at0, tuple(first[2]), fresh, r2[0]), tagedge.off_ms(fresh, r2[0]))

    def _recover_lost_tags(self, data_dir: Path) -> None:
        """Windows a daemon that did not stop cleanly left open (opentags.py): a row each, and said; before, a kill -9
        lost them without a word, and `tag stop` answered "not open"."""
        who, lost = opentags.take_lost(data_dir)
        if lost:
            self.store.append("tags", opentags.lost_rows(who, lost))
        for name, wall0_ns in sorted(lost.items()):
            log.warning("tag %s was open when the daemon before (%s) stopped without closing it (killed or crashed): "
                        "written with closed_by lost and no figures; start it again", name, who or "unknown")
        self._lost_tags.update(lost)

    def _save_open_tags(self) -> None:
        if self._open_tags_dir is not None:
            opentags.save(self._open_tags_dir, self.daemon_id, {n: t.wall0_ns for n, t in self.ledger.tags.items()})

    async def tag_start(self, name: str) -> dict:
        if name in self.ledger.tags:
            raise ValueError(f"tag {name!r} is already open")
        t, wall, *held = await self._edge(f"tag-start:{name}")
        self.ledger.open_tag(name, t, wall, held=held[1] if held else None, start_edge=held[0] if held else None)
        self._lost_tags.pop(name, None)
        self._save_open_tags()
        self.waker.wake()
        log.info("tag %s started", name)
        return {"name": name, "started": True}

    async def tag_stop(self, name: str) -> dict:
        if name not in self.ledger.tags:
            if name in self._lost_tags:
                raise ValueError(f"tag {name!r} is not open: it was open when the daemon before stopped without closing "
                                 "it (killed or crashed), and its row says closed_by lost, with no figures; start it again")
            raise ValueError(f"tag {name!r} is not open")
        t, wall, *held = await self._edge(f"tag-stop:{name}")
        self.ledger.close_tag(name, t, wall, stop_edge=held[0] if held else None, held=held[1] if held else None)
        self._save_open_tags()
        tag = self.ledger.closed_tags[-1]
        deadline = time.monotonic() + stop_wait_s(self.cfg.get("daemon", "interval_s"))
        while tag in self.ledger.closed_tags and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        row = self.ledger.tag_row(tag)
        out = {k: row[k] for k in ("name", "duration_s", "gpu_energy_j", "cpu_energy_j", "unproxied_energy_j",
                                   "proxy_tokens", "gpu_j_per_token", "server_count", "energy_note")}
        if tag in self.ledger.closed_tags:
            # Not final by the deadline (the sampler is behind or a read hangs): its sums so far are too
            # small, so none is given (nor their energy_note); the final row still lands in tags/ once its intervals
            # close.
            out.update(gpu_energy_j=None, cpu_energy_j=None, unproxied_energy_j=None, gpu_j_per_token=None,
                       energy_note=None, note="energy not final yet (the samples past the window's end are late); "
                                              "the final figures land in tags/")
            log.warning("tag %s stopped; its energy was not final within the wait, answered as unknown", name)
        else:  # a null energy (a GPU unread) logged as such: "%.1f" of None was a logging error
            log.info("tag %s stopped: %s J over %.1f s", name,
                     "unknown" if row["gpu_energy_j"] is None else f"{row['gpu_energy_j']:.1f}", row["duration_s"] or 0)
        return out

    def tag_list(self) -> list[str]:
        return self.ledger.open_tag_names()

    # --- the loop ----------------------------------------------------------------------------------

    def _on_sample(self, s: Sample) -> None:
        self.samples.append(s)  # sampler threads: only append (deque appends are thread-safe)

    def _drain(self) -> int:
        """Samples the sampler threads queued, into the ledger and the samples dataset; returns how many."""
        rows, n = [], 0
        while self.samples:
            n += 1
            s = self.samples.popleft()
            try:
                rows.extend(sample_rows(s, self.t0_ns, self.gpu_uuids))
            except Exception as e:
                log.debug("sample row failed: %s", error_text(e))
            if s.data is None:
                continue
            if s.source == "nvml":
                for r in s.data:
                    lost = r.lost  # as at its read: the collector's state by now may be a later read's
                    # When trouble starts and when a lost GPU answers again (reopened), not every tick.
                    if r.note and (not self._gpu_notes.get(r.index) or lost != self._gpu_lost.get(r.index, False)):
                        log.warning("gpu%d: %s", r.index, r.note)
                    self._gpu_notes[r.index] = r.note
                    self._gpu_lost[r.index] = lost
                self.ledger.add_gpu_sample(s.t_mono_ns, s.t_wall_ns, s.data)
                self.latest_gpu = s
            elif s.source == "rapl":
                self.ledger.add_rapl_sample(s.t_mono_ns, s.data)
            elif s.source == "cputime":
                self.ledger.add_cputime_sample(s.t_mono_ns, s.data)
        self.store.append("samples", rows)
        return n

    def _update_snapshot(self) -> None:
        tot = self.ledger.totals
        gpus = []
        latest = self.latest_gpu.data if self.latest_gpu is not None else ()
        for k, info in enumerate(self.collector.infos):
            r = latest[k] if k < len(latest) else None
            gpus.append(
                GpuSnapshot(
                    index=info.index,
                    uuid=info.uuid,
                    name=info.name,
                    power_w=(r.power_w if r.power_w is not None else r.power_avg_w) if r else None,
                    sm_clock_mhz=r.sm_clock_mhz if r else None,
                    mem_clock_mhz=r.mem_clock_mhz if r else None,
                    power_limit_w=r.power_limit_w if r else None,
                    energy_j=tot.gpu_energy_j[k] if k < len(tot.gpu_energy_j) else 0.0,
                    up=0.0 if info.index in self.collector.lost else 1.0,
                    energy_unknown_s=tot.gpu_unknown_s[k] if k < len(tot.gpu_unknown_s) else 0.0,
                    energy_unread=bool(tot.gpu_unread_now[k]) if k < len(tot.gpu_unread_now) else False,
                    serving=gpu_serving(tot, k),
                )
            )
        # The latest closed interval's end (the edge the open ones start at), on the readings' own clock: a sample
        # delivered late keeps it back, so the tuner never reads accounts for a time they do not yet cover.
        edges = self.ledger.edges
        behind_s = max(0.0, (time.monotonic_ns() - edges[0].t_ns) / 1e9) if edges else None
        self.snapshot = Snapshot(
            accounts_behind_s=behind_s,
            gpus=tuple(gpus),
            cpu_energy_j=tot.cpu_energy_j,
            energy_by_kind_j=tot.energy_by_kind_j,
            energy_by_dest_j=tot.energy_by_dest_j,
            tokens_closed=tot.tokens,
            tokens_attributed=tot.tokens_attributed,
            work_costs=tot.costs,
            joules_per_token=tot.j_per_token,
            tokens_by_tag=dict(self.tokens_by_tag),
            requests_by_tag=dict(self.requests_by_tag),
            count_contradictions=dict(self.count_contradictions),
            uncounted_requests=dict(self.uncounted_requests),
            prompts_estimated=dict(self.ledger.prompts_estimated),
            latency=self.latency.states(),
            inflight=self.inflight.state(time.monotonic_ns()),
            # Only once read: a server whose counters never answered (SGLang without --enable-metrics: /metrics
            # 404) showed 0 here, a count for "never read".
            server_tokens=self.scraper.total if self.scraper is not None and self.scraper.has_baseline() else None,
            server_tokens_partial=tuple(self.scraper.partial) if self.scraper is not None else (),
            buffered_rows=self.store.buffered(),
            dropped_rows=sum(self.store.dropped_rows.values()),
            dropped_not_forwarded_rows=sum(self.store.dropped_not_forwarded_rows.values()),
            flush_errors=self.store.flush_errors,
            quarantined_rows=sum(self.store.quarantined_rows.values()),
            buffer_cap_rows=self.store.max_buffered_rows,
            writer_up=self.flusher.alive(self._stuck_after_s()),
            writer_errors=self.flusher.errors,
            writer_beat_age_s=max(0.0, time.monotonic() - self.flusher.beat),
            sources={src: (n, self.sampler.read_cpu_s[src], self.sampler.missed[src], self.sampler.errors[src])
                     for src, n in self.sampler.reads.items()} if self.sampler else {},
            edge_reads=self.edge_reads,
            edge_read_cpu_s=self.edge_cpu_total_s,
            proxy_recorder_failures=self.proxy.recorder_failures if self.proxy else 0,
            proxy_upstream_failures=self.proxy.upstream_failures if self.proxy else 0,
            proxy_upstream_retries=self.proxy.upstream_retries if self.proxy else 0,
            proxy_active=self.proxy.active if self.proxy else 0,
            proxy_records_dropped=getattr(self.proxy, "records_dropped", 0),
            proxy_body_timeouts=dict(getattr(self.proxy, "body_timeouts", {})),
            proxy_uninspected_bodies=getattr(self.proxy, "uninspected_bodies", 0),
            proxy_body_reader_failures=getattr(self.proxy, "proxy_failures", 0),
            proxy_lost_unforwarded=getattr(self.proxy, "lost_unforwarded", 0),
            proxy_malformed_requests=(self.bad_requests.rejected if self.bad_requests is not None else 0)
            + getattr(self.proxy, "malformed_requests", 0),
            proxy_worker_restarts=dict(getattr(self.proxy, "restarts", {})),
            proxy_workers_unread=getattr(self.proxy, "unread_workers", 0),
            late_tokens=self.ledger.late_tokens,
            other_cpu_pct=tot.other_cpu_pct,
            busy_host_requests_cpu_j=tot.busy_host_requests_cpu_j,
            cpu_unknown_requests=tot.cpu_unknown_requests,
            flagged_requests=dict(tot.flagged_requests),
            jpt_left_out=tot.jpt_left_out,
            idle_unknown_intervals=tot.idle_unknown_intervals,
            gpu_unknown_intervals=tot.gpu_unknown_intervals,
            intervals=tot.intervals,
            idle_not_serving_j=tot.idle_not_serving_j,
            serving_changes=tot.serving_changes,
            serving_asserted=tot.serving_asserted,
        )

    def _helper_pids(self) -> list[int]:
        """The daemon's own child processes (proxy workers, the compaction child): their CPU time is powerprof's,
        never "other processes'" in the busy-host judgement. Read from the sampler's thread: only attribute reads."""
        procs = [w.proc for w in getattr(self.proxy, "workers", None) or ()]
        procs.append(getattr(self.flusher, "_child", None))
        return [p.pid for p in procs if p is not None]

    def _stuck_after_s(self) -> float:
        """How long the writer's loop may go without turning before it counts as stuck."""
        return max(300.0, 3 * self.flusher.interval_s)

    def _watchdog(self, now: float) -> None:
        """Ping systemd's watchdog while the writer lives; say why in `systemctl status` when it does not."""
        if self._wd_period is None or now < self._wd_next:
            return
        self._wd_next = now + self._wd_period
        if self.flusher.alive(self._stuck_after_s()):
            if self._wd_bad:
                self._wd_bad = False
                sdnotify.notify("STATUS=running")
            sdnotify.notify("WATCHDOG=1")
        elif not self._wd_bad:
            self._wd_bad = True
            why = "is stuck" if self.flusher.running else "died"
            log.error("the Parquet writer thread %s (last error: %s); no more watchdog pings, so systemd restarts "
                      "the daemon", why, self.flusher.last_error or self.store.last_error)
            sdnotify.notify(f"STATUS=Parquet writer {why}; waiting for the watchdog restart")

    async def _tick_loop(self) -> None:
        # Four passes per sampling interval, at most 4 Hz: intervals close within a quarter interval
        # of their 0.3 s grace, and the idle daemon does not wake ten times a second for nothing.
        period = min(0.25, self.cfg.get("daemon", "interval_s") / 4)
        while not self.stop_event.is_set():
            try:
                drained = self._drain()
                edges = self.ledger.edges
                first = edges[0] if edges else None
                # Intervals closed while a proxy worker serves unread say so (ledger.proxy_unread_since_ns).
                self.ledger.proxy_unread_since_ns = getattr(self.proxy, "unread_since_ns", None)
                # and those closed after the state ended, by its ended spans (ledger.proxy_unread_spans)
                self.ledger.proxy_unread_spans = tuple(getattr(self.proxy, "unread_spans", ()))
                self.ledger.advance(time.monotonic_ns(), getattr(self.proxy, "watermark_ns", None))
                # The snapshot moves only with a new sample (the GPU gauges) or closed intervals (the totals): built
                # then, not at every pass (idle, 3 passes in 4 had nothing new, and the build was a quarter of the
                # loop's CPU). /metrics builds its own at each scrape (_metrics_app), so it never reads one stale.
                if drained or (edges[0] if edges else None) is not first:
                    self._update_snapshot()
            except Exception:
                log.exception("accounting step failed; continuing")
            self._watchdog(time.monotonic())
            if self.reload_requested:
                self.reload_requested = False
                self.reload()
            # A bare sleep, as the scrape loop's: wait_for on the stop event made and cancelled a task at each pass
            # (a tenth of the idle loop's CPU). A stop is seen within one period, as the scrape loop's. On the grid
            # the scrape loop and the connection guard sleep on: they wake the loop together (ticks.py).
            asleep = time.monotonic()
            # Idle (no request, no tag) it passes once a sample, at most once a second: its intervals close at most
            # that much later, and a request or a tag ends the sleep (self.waker). Four wake-ups a second idle were a
            # fifth of the idle daemon's own CPU (docs/daemon.md, Footprint).
            led = self.ledger
            if _busy(led):
                slept = await sleep_on_grid(period)
            else:
                # Within half the watchdog's ping period too (the pings ride on these passes): a pass a hair short of
                # the ping's time and the next a second later made a 2 s WatchdogSec's ping come 2 s late.
                cap = self.cfg.get("daemon", "interval_s")
                if self._wd_period is not None:
                    cap = min(cap, self._wd_period / 2)
                slept = await sleep_on_grid(idle_period(period, cap), self.waker)
            if isinstance(self.proxy, Proxy) and self.proxy.recorder is self:
                # This loop serves the proxy (proxy.workers = 1): how late it woke is how late the proxy could
                # read the server's tokens then (proxy workers send their own with their heartbeats).
                self.note_proxy_delay(time.monotonic_ns(), time.monotonic() - asleep - slept)

    async def _scrape_baseline(self, down: str | None = None) -> None:
        """Read the server's counters once before saying ready: the count starts there. Taken by the scrape loop's
        first pass instead, a loaded host delayed it past the start of requests sent at the ready, and the baseline
        took their first tokens in for good (1169 of 1200 in one loaded run). Bounded: a server not up (or too slow)
        is read by the loop later, and a count that may have lost tokens by then says so (Scraper.partial).
        `down`: why the server was just found not to answer; not waited for then (a silent host, BASELINE_WAIT_S)."""
        t0 = time.monotonic_ns()
        why = down
        if down is None:
            try:
                await asyncio.wait_for(self.scraper.scrape(), BASELINE_WAIT_S)
            except asyncio.TimeoutError:
                why = f"no whole answer within {BASELINE_WAIT_S:g} s"
        if self.scraper.has_baseline():
            t0, t1 = _read_span(self.scraper, t0)
            self._scrape_since_ns = (t0 + t1) // 2
            self._scrape_read_from_ns = t0
        else:
            # Why, with the URL: "no answer in time, or no counters" left a refused connection and a server
            # without counters alike.
            why = why or self.scraper.last_error or (
                f"no token counter powerprof knows on its /metrics or /slots (scrape.server = "
                f"{self.cfg.get('scrape', 'server')}: set it, or scrape.url, to the server's)")
            log.warning("the server's token counters at %s could not be read before ready (%s): they are read from "
                        "the scrape loop's first answer on", self.scraper.base, why)
        self.scraper.ready = True

    async def _scrape_loop(self) -> None:
        since, held = self._scrape_since_ns, None
        read_from = getattr(self, "_scrape_read_from_ns", None)
        check_faults = 0  # prefix-cache checks that failed: logged the first three, then every hundredth
        cadence = Cadence(self.cfg.get("scrape", "interval_s"), self.cfg.get("scrape", "idle_interval_s"))
        while not self.stop_event.is_set():
            cadence.fast_s = self.cfg.get("scrape", "interval_s")  # both live on SIGHUP
            cadence.idle_s = self.cfg.get("scrape", "idle_interval_s")
            # Proxied requests and tags being measured keep the scrape fast (docs/daemon.md, Scrape cadence).
            led = self.ledger
            # Scraped at the idle period (still: no request, no counter rise lately): only such a window's rise may be a
            # burst that began late in it (below). One long for a slow read or a late loop while requests ran is not:
            # placed at its end, its tokens left the proxy's before them as more than the server counted, and the rise
            # back read as bypass tokens that never ran (the real llama-server: 33, rows saying only `server_restart`;
            # tests/test_daemon_scrape.py). Read before `due` counts the requests live now: a window the first request
            # after a stillness ends (woken at its arrival) is still a slow one (docs/daemon.md, Scrape cadence).
            now = time.monotonic()
            still = cadence.period_s(now) > cadence.fast_s
            if cadence.due(now, _busy(led)):
                t0 = time.monotonic_ns()
                delta = await self.scraper.scrape()
                t0, t1 = _read_span(self.scraper, t0)
                t = (t0 + t1) // 2  # the counter was read somewhere in the request
                cadence.scraped(time.monotonic(), delta)
                at_finish = self.scraper.kind in AT_FINISH  # known once detected (scrape.server = "auto")
                led.choices_prefilled_apart = self.scraper.kind in PREFILLS_CHOICES_APART
                led.count_each_step = self.scraper.window_each_step
                # Its /slots with the span they were read in: a run-on's span with no known end closes by them.
                seen = getattr(self.scraper, "window_slots", None)
                led.window_slots = None if seen is None else (t0, t1, seen)
                led.serves_generate = None if self.scraper.kind in (None, "none") else self.scraper.kind == "sglang"
                led.best_of_ignored = self.scraper.kind in IGNORES_BEST_OF or self.scraper.vllm_v1
                led.runs_on_after_leave = RUNS_ON_AFTER_LEAVE.get(self.scraper.kind or "")
                opened = self.scraper.down_open() if delta is None else None
                if opened is not None and since is not None:
                    # Found down (nothing listening, or a 502/503: a reloading llama-server's): a death, known now,
                    # not at the new process's first page (a model load later, after SCRAPE_HOLD_S wrote the rows of
                    # the whole answers it closed unanswered). A 503 alone costs only those sent before `since`.
                    led.note_down(since, *opened)
                if delta is not None:
                    # The prefix-cache hits of the whole window, slow or not: checked against the requests' said counts.
                    # A fault in that check must not end this loop (nothing here is caught): it ended for good, unsaid
                    # until shutdown, and every interval after closed `unscraped`. Its tokens are still placed.
                    # From the previous scrape's start to this one's end, not midpoint to midpoint: each read came
                    # anywhere in its GET (and a loaded host resumes this loop late after it), so a request whose hit span
                    # (arrival to first token) fell between the previous read and its midpoint had its hit counted here,
                    # in a window that began after its span: matched to none, its said hit was flagged
                    # prefix-cache-unsaid. The windows overlap by a GET; the matching counts each hit once all the same.
                    try:
                        self.ledger.add_cache_hits(None if since is None else min(since, read_from or since), t1,
                                                   self.scraper.cache_hits)
                    except Exception:
                        # Throttled: a fault at every window logged a traceback at every scrape for as long as it ran.
                        check_faults += 1
                        if check_faults <= 3 or check_faults % 100 == 0:
                            log.exception("checking a scrape window's prefix-cache hits failed (%d so far); its hits go "
                                          "unchecked, its tokens are counted", check_faults)
                    if held is not None:  # the held slow window's burst began where this window's rate says
                        start = burst_start_ns(held.since_ns, held.t_ns, held.delta, delta / max(1, t - held.t_ns))
                        if held.arrived_ns is not None:
                            # A request that arrived in it ran from its arrival: the window a proxy worker's record
                            # woke late (its request told the daemon after the server had counted its first tokens)
                            # held them, and the next window's faster rate put them after the request's tokens the
                            # proxy placed, which then had no count under them (docs/daemon.md, Scrape cadence).
                            start = max(held.since_ns, min(start, held.arrived_ns))
                        # Its death (a restart, a refused down scrape) with one part alone (`held_death_part`); the
                        # other says the restart (its rows flagged) by the fall alone, which records no death.
                        start, first = held_death_part(held, start)
                        death = dict(restart_by_fall=held.restart_by_fall, down_ns=held.down_ns,
                                     down_refused=held.down_refused, past_reach=held.past_reach,
                                     dead_from_ns=held.since_ns)
                        none = dict(restart_by_fall=True, down_ns=None, down_refused=False)
                        if start > held.since_ns:
                            self.ledger.add_server_tokens(start, 0.0, held.since_ns, at_finish, partial=held.partial,
                                                          **(death if first else none))
                        self.ledger.add_server_tokens(held.t_ns, held.delta, start, at_finish, held.finished,
                                                      partial=held.partial, read_ns=held.read_ns, served=held.served,
                                                      read_missed=held.read_missed, **(none if first else death))
                        held = None
                    # Why this window's count may be low (a restart, a late first read): its intervals say so.
                    partial = self.scraper.window_partial
                    if delta > 0 and since is not None and still and t - since > 1.5e9 * cadence.fast_s:
                        # a slow window ending a stillness: placed at the next scrape
                        held = _HeldWindow(since, t, delta, self.scraper.finished, partial, (t0, t1), self.scraper.served,
                                           self.scraper.restart_by_fall, self.scraper.window_down_ns,
                                           self.scraper.window_down_refused, self.scraper.window_read_missed,
                                           min((r.trace.arrival_ns for r in led.requests.values()), default=None),
                                           self.scraper.window_past_reach)
                    else:
                        # The delta covers the time since the previous scrape: spread over it (docs/daemon.md).
                        # With the GET's span: the counter was read somewhere in it (docs/daemon.md, "A counter read
                        # before its stamp").
                        self.ledger.add_server_tokens(t, delta, since, at_finish, self.scraper.finished, partial=partial,
                                                      read_ns=(t0, t1), served=self.scraper.served,
                                                      restart_by_fall=self.scraper.restart_by_fall,
                                                      down_ns=self.scraper.window_down_ns,
                                                      down_refused=self.scraper.window_down_refused,
                                                      read_missed=self.scraper.window_read_missed,
                                                      past_reach=self.scraper.window_past_reach)
                    since = self._scrape_since_ns = t  # where the next window, the final scrape's too, starts
                    read_from = self._scrape_read_from_ns = t0
            # A bare sleep (no task per wait, as wait_for makes): it wakes every fast period to poll, on the accounting
            # loop's grid (ticks.py); still and idle, at the idle scrapes' instants (Cadence.poll_s), woken by a request.
            # Read again: a reload that came while this pass scraped woke no sleeper, and the period read at the top
            # would be slept out (a 5 s one when 0.2 s was set).
            cadence.fast_s = self.cfg.get("scrape", "interval_s")
            cadence.idle_s = self.cfg.get("scrape", "idle_interval_s")
            poll = cadence.poll_s(time.monotonic(), _busy(led))
            await sleep_on_grid(poll, self.waker if poll > cadence.fast_s else self.config_waker)
        if held is not None:
            self.ledger.add_server_tokens(held.t_ns, held.delta, held.since_ns, self.scraper.kind in AT_FINISH,
                                          held.finished, partial=held.partial, read_ns=held.read_ns, served=held.served,
                                          restart_by_fall=held.restart_by_fall, down_ns=held.down_ns,
                                          down_refused=held.down_refused, read_missed=held.read_missed,
                                          past_reach=held.past_reach)

    async def _final_scrape(self) -> None:
        """At a clean stop, after the last sample: read the server's counters once more, so the last interval's count
        covers it (`complete`). Before, it always said `unscraped` (its end past the latest scrape). Bounded by
        FINAL_SCRAPE_S; a server that does not answer in time (or a failed read) leaves it `unscraped`, as it is."""
        if self.scraper is None or not self.scraper.has_baseline():
            return
        t0 = time.monotonic_ns()
        errors = self.scraper.errors
        try:
            delta = await asyncio.wait_for(self.scraper.scrape(), FINAL_SCRAPE_S)
            why = self.scraper.last_error if self.scraper.errors > errors else "no count"
        except asyncio.TimeoutError:
            delta, why = None, f"no answer within {FINAL_SCRAPE_S:g} s"
        if delta is None:
            log.info("the server's counters could not be read at shutdown (%s): the last interval says unscraped", why)
            return
        t0, t1 = _read_span(self.scraper, t0)
        t = (t0 + t1) // 2
        since = self._scrape_since_ns
        self.ledger.add_cache_hits(None if since is None else min(since, self._scrape_read_from_ns or since), t1,
                                   self.scraper.cache_hits)
        self.ledger.add_server_tokens(t, delta, self._scrape_since_ns, self.scraper.kind in AT_FINISH,
                                      self.scraper.finished, partial=self.scraper.window_partial, read_ns=(t0, t1),
                                      served=self.scraper.served, restart_by_fall=self.scraper.restart_by_fall,
                                      down_ns=self.scraper.window_down_ns,
                                      down_refused=self.scraper.window_down_refused,
                                      read_missed=self.scraper.window_read_missed,
                                      past_reach=self.scraper.window_past_reach)

    # --- reload ------------------------------------------------------------------------------------

    def reload(self) -> None:
        try:
            new = load_config(self.config_path, overrides=self.overrides)
        except ConfigError as e:
            log.error("SIGHUP: new config rejected, keeping the running one: %s", e)
            return
        live, restart = self.cfg.reload_changes(new)
        self.cfg = new
        self._apply(live)
        if any(k.startswith("scrape.") for k in live):
            # The scrape loop sleeps out the period it read before the reload (a 3600 s one, an hour), or woke at the
            # SIGHUP before the new one was read: its next pass reads the new periods now.
            self.config_waker.wake()
            self.waker.wake()
        if restart:
            log.warning("SIGHUP: %s changed; these take effect after a restart", ", ".join(restart))
        log.info("SIGHUP: config reloaded (%s)", ", ".join(f"{k}={v}" for k, v in live.items()) or "no live changes")

    def _apply(self, live: dict) -> None:
        c = self.cfg
        logging.getLogger("powerprof").setLevel(c.get("daemon", "log_level").upper())
        self.flusher.interval_s = c.get("daemon", "flush_interval_s")
        self.flusher.compact_interval_s = c.get("daemon", "compact_interval_s")
        self.store.retention_days = c.get("daemon", "retention_days") or None
        self.store.retention_max_bytes = int(c.get("daemon", "retention_max_mb") * 1e6) or None
        self.store.max_buffered_rows = self._buffer_cap()
        self.ledger.jpt_window_ns = int(c.get("metrics", "jpt_window_s") * 1e9)
        if any(k.startswith("metrics.tags") or k == "metrics.max_tags" for k in live):
            self.tags = TagLimiter(c.get("metrics", "tags"), c.get("metrics", "max_tags"))

    # --- start and stop ----------------------------------------------------------------------------

    def _buffer_cap(self) -> int:
        """daemon.max_buffered_rows, or (0) `buffered_rows_cap` under the cgroup's memory bound."""
        rows = self.cfg.get("daemon", "max_buffered_rows")
        return rows or buffered_rows_cap(memory_limit_bytes(), self.cfg.get("proxy", "workers"), len(datasets()))

    async def _serve(self, app: web.Application, listen: str, what: str, server_options: dict | None = None) -> str:
        if self.guard is not None:
            app.middlewares.append(self.guard.middleware)
        # keepalive_timeout: aiohttp's own idle close, the same span as the guard's.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0,
                               keepalive_timeout=self.cfg.get("proxy", "idle_timeout_s"), **(server_options or {}))
        await runner.setup()
        self._runners.append(runner)
        try:
            if listen.startswith("unix:"):
                prepare_socket_path(Path(listen[5:]), what)
                site = web.UnixSite(runner, listen[5:])
            else:
                host, port = _split_listen(listen)
                site = web.TCPSite(runner, host, port, reuse_address=True)
            await site.start()
            if listen.startswith("unix:"):
                self._sockets.append(bound_socket(Path(listen[5:])))
        except OSError as e:
            raise StartupError(f"cannot listen on {listen} for the {what}: {e.strerror or e}{_listen_fix(what, e)}") from None
        if self.guard is not None:
            self.guard.watch(runner.server)
        if listen.startswith("unix:"):
            return listen
        self._warn_beyond_loopback(listen, what)
        sock = runner.addresses[-1]  # the real port when 0 was asked
        return http_url(sock[0], sock[1])

    @staticmethod
    def _warn_beyond_loopback(listen: str, what: str) -> None:
        if not is_loopback(listen_host(listen)):
            log.warning("the %s listens on %s, reachable from other machines, without authentication: "
                        "firewall it (daemon.listen_beyond_loopback is set)", what, listen)

    async def _serve_workers(self, upstream: str, listen: str, proxy_kwargs: dict) -> str:
        """proxy.workers > 1: that many proxy processes on the address (SO_REUSEPORT), their records
        replayed into this process's recorder (`daemon/workers.py`); stopped with the listeners."""
        from .workers import ProxyWorkers

        host, port = _split_listen(listen)
        self.proxy = ProxyWorkers(
            self.cfg.get("proxy", "workers"), upstream, host, port, recorder=self, proxy_kwargs=proxy_kwargs,
            header_timeout_s=self.cfg.get("proxy", "header_timeout_s"),
            idle_timeout_s=self.cfg.get("proxy", "idle_timeout_s"),
            urgent_max_active=self.cfg.get("attribution", "edge_max_inflight"), log_format=log_format())
        self._runners.append(self.proxy)  # its cleanup() stops the workers with the other listeners
        try:
            host, port = await self.proxy.start()
        except (OSError, RuntimeError) as e:
            raise StartupError(f"cannot start the proxy workers on {listen}: {getattr(e, 'strerror', None) or e}"
                               f"{_listen_fix('proxy', e)}") from None
        self._warn_beyond_loopback(listen, "proxy")
        n, limit = self.cfg.get("proxy", "workers"), memory_limit_bytes()
        if limit is not None and limit < (DAEMON_RESIDENT_MIB + WORKER_RESIDENT_MIB * n) << 20:
            log.warning("%d proxy workers in a memory limit of %d MiB: each needs about %d MiB beside the daemon's "
                        "%d MiB; raise MemoryMax (and TasksMax) or lower proxy.workers", n, limit >> 20,
                        WORKER_RESIDENT_MIB, DAEMON_RESIDENT_MIB)
        return http_url(host, port)

    async def _serve_tags(self) -> None:
        path = self.cfg.tag_socket()
        try:
            from powerprof.trust import untrusted_place

            # Checked before the folder is made: `mkdir -p` through another user's symlink makes root's folders there.
            why = untrusted_place(path.parent)
            if why:
                raise StartupError(f"refusing, as root, a socket folder another user could write for the tag API: {why}")
            path.parent.mkdir(parents=True, exist_ok=True)
            peers = PeerPolicy()  # root and this daemon's uid until the socket's group is known, just below
            await self._serve(tag_app(self, peers), f"unix:{path}", "tag API")
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR | stat.S_IRGRP | stat.S_IWGRP)
            # Its change time after the chmod, as the stop will find it where no descriptor holds its inode.
            self._sockets[-1] = self._sockets[-1]._replace(ctime_ns=os.lstat(path).st_ctime_ns)
            # The group the socket got (the setgid folder's under the unit: powerprof-tag), stated again per connection.
            peers.socket_gid = os.stat(path).st_gid
            log.info("tag API on %s: root, uid %d and members of %s may tag", path, peers.own_uid, peers.group_text())
            self.urls["tags"] = str(path)
        except (OSError, StartupError) as e:
            log.error("tag API disabled: cannot open %s: %s", path, e)

    async def run(self) -> int:
        """Open everything, serve until SIGTERM/SIGINT, then close every interval, flush and exit 0."""
        self._install_signal_handlers()
        logging.getLogger("powerprof").setLevel(self.cfg.get("daemon", "log_level").upper())
        self._check_open_files()
        made = NewPaths(self.cfg.data_dir())
        try:
            data_dir = self._open()
        except StartupError:
            # What it made is taken back only under its own lock: refused it, the folder is another daemon's.
            self._release_lock(made if self._lock_fd is not None else None)
            raise
        session = new_session(scrape_via_name(self.loop_id))
        self.guard = ConnectionGuard(self.cfg.get("proxy", "header_timeout_s"), self.cfg.get("proxy", "idle_timeout_s"))
        self.bad_requests = quiet_bad_requests()  # this process's listeners' malformed requests (main() installs it too)
        try:
            await self._start(session, data_dir)
        except StartupError:
            # Not ready: nothing was measured, and nothing it made is left (the lock is released last, by _shutdown).
            self._take_back = made
            await self._shutdown(session)
            raise
        try:
            await self.stop_event.wait()
            log.info("stopping: flushing data")
        finally:
            await self._shutdown(session)
        log.info("stopped")
        return EXIT_OK

    def _release_lock(self, made: NewPaths | None = None) -> None:
        """Close the data dir's lock; with `made`, first take back what a failed start made (the lock file removed
        while still held: another daemon starting then finds it held, not half gone)."""
        if made is not None:
            made.take_back()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _check_open_files(self) -> None:
        limit = raise_open_files_limit()
        pool = self.cfg.get("proxy", "max_connections") or 4096
        need = 2 * pool + OPEN_FILES_RESERVE  # per process: each proxy worker has its own
        if limit != resource.RLIM_INFINITY and limit < need:
            log.warning("the open-files limit is %d: proxy.max_connections = %d needs about %d (a client and an "
                        "upstream descriptor per request); beyond it new connections fail and Parquet files cannot "
                        "be opened. Raise LimitNOFILE= in the unit (or ulimit -n), or lower proxy.max_connections",
                        limit, pool, need)

    def _request_stop(self) -> None:
        self.stop_event.set()
        self.waker.wake()  # seen now, not at an idle loop's next pass
        self.config_waker.wake()  # and by the busy scrape loop, whose final pass places a held window's tokens

    def _request_reload(self) -> None:
        self.reload_requested = True
        self.waker.wake()

    def _install_signal_handlers(self) -> None:
        self.stop_event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        # SIGUSR1 is the tuner's kill switch; `kill -USR1 $(pidof powerprof)` may pick the daemon: log, do not die.
        loop.add_signal_handler(signal.SIGUSR1, lambda: log.warning(
            "SIGUSR1 ignored: the daemon has no use for it (the tuner's kill switch: systemctl kill -s USR1 "
            "powerprof-tune.service)"))
        if self.early_signals:
            log.info("signal received during start-up: stopping")
            self.stop_event.set()

    def _open(self) -> Path:
        """Restore what a crashed sweep left, open the collectors, lock the data dir, build the
        store, ledger and sampler. StartupError (with everything closed again) when it cannot."""
        try:
            return self._open_parts()
        except BaseException as e:
            # Any failure closes the door (the simulated powercap updater and its folder, a simulated server): before,
            # only ValueError and the lock's OSError did, and an OSError after rig.sources left both, with a traceback.
            self.rig.close()
            if isinstance(e, OSError):
                # A message alone is ours, with its fix (the state folder a file); one with an errno is the system's.
                raise StartupError("cannot start: " + (str(e) if e.errno is None else error_text(e))) from None
            raise

    def _open_parts(self) -> Path:
        """_open's steps, in order; the rig left to _open to close on a failure."""
        cfg = self.cfg
        if cfg.get("daemon", "restore_on_start"):
            restore_pending(self.rig)
        try:
            self.sources = self.rig.sources
        except ValueError as e:
            raise StartupError(str(e)) from None
        for p in self.sources.problems:
            log.warning("%s: %s%s", p.source, p.message, f" (fix: {p.fix})" if p.fix else "")
        # Before the data dir is locked: a refusal here leaves nothing to undo but the rig (_open closes it).
        self._serving_asserted = (self._asserted_serving(cfg.get("daemon", "serving_gpus"))
                                  if self.sources.nvml is not None else None)
        data_dir = cfg.data_dir()
        try:
            # Its folders above made only for the default path: one given must have its parent (lock_data_dir).
            self._lock_fd = lock_data_dir(data_dir, parents=not cfg.get("daemon", "data_dir"))
        except OSError as e:
            raise StartupError(f"cannot use data dir {data_dir}: {e}") from None
        if self.sources.nvml is None:
            raise StartupError("no GPU to sample: " + "; ".join(p.message for p in self.sources.problems if p.source == "nvml"))
        self.collector = self.sources.nvml
        self.gpu_uuids = {i.index: i.uuid for i in self.collector.infos}
        self.t0_ns = time.monotonic_ns()
        kwargs = {"write_file": self.store_write} if self.store_write else {}
        self.store = DatasetStore(
            data_dir,
            datasets(),
            max_buffered_rows=self._buffer_cap(),
            retention_days=cfg.get("daemon", "retention_days") or None,
            retention_max_bytes=int(cfg.get("daemon", "retention_max_mb") * 1e6) or None,
            host=self.host,
            daemon_id=self.daemon_id,
            simulated=self.rig.simulated,
            gpu_uuids=gpu_uuids_value(i.uuid for i in self.collector.infos),
            **kwargs,
        )
        self.ledger = Ledger(self.daemon_id, self.t0_ns, len(self.collector.infos), self.store.append,
                             gpu_names=[f"gpu{i.index} ({i.uuid})" for i in self.collector.infos],
                             jpt_window_s=cfg.get("metrics", "jpt_window_s"),
                             avg_windows_s=tuple(i.power_avg_window_s for i in self.collector.infos),
                             rapl=self.sources.rapl is not None,
                             rapl_hold_s=max(RAPL_HOLD_S, RAPL_HOLD_PERIODS * cfg.get("daemon", "interval_s")))
        self.tags = TagLimiter(cfg.get("metrics", "tags"), cfg.get("metrics", "max_tags"))
        self.flusher = Flusher(self.store, cfg.get("daemon", "flush_interval_s"), cfg.get("daemon", "compact_interval_s"),
                               compact_in_child=True)
        self.upstream = cfg.get("proxy", "upstream")
        if not self.upstream:
            self.upstream = self.rig.default_upstream()
            if self.upstream:
                self.urls["sim_upstream"] = self.upstream
        else:
            self.rig.upstream_given()
        # RAPL's CPU energy is the whole package's: whose CPU time the host spends judges it (busy-host), where the
        # door says that energy is real; the server is the upstream's processes on this host.
        cputime = (self.rig.cpu_time_collector(self.upstream, [], helpers=self._helper_pids)
                   if self.sources.rapl is not None and self.upstream else None)
        self.sampler = Sampler(self.sources.collectors + ([cputime] if cputime is not None else []) + self.extra_collectors,
                               interval_s=cfg.get("daemon", "interval_s"))
        self.sampler.subscribe(self._on_sample)
        from powerprof.workload.serverprocs import ServerProcesses

        self._server_procs = ServerProcesses(self.upstream, []) if self.upstream else None
        self._unsampled: tuple[int, ...] = ()
        self._idle_said = False
        self._helper_said = False
        self._helper_unsampled = False  # the last check judged a context on an unsampled GPU a helper
        self._helpers_seen: dict = {}  # the last check's helpers (index → (UUID, bytes))
        self._unread_helper_checks: dict = {}  # index → checks in a row a helper's samples could not be read
        if len(self.collector.infos) > 1:
            # The last run's judgement, provisional (servingstate.py): said against this run's, never taken.
            uuids = [i.uuid for i in self.collector.infos]
            upstream = self.upstream or ""
            self.ledger.saved_serving = servingstate.load(data_dir, uuids, upstream)
            self._serving_keeper = servingstate.Keeper(data_dir, uuids, upstream)  # off the event loop
            self.ledger.on_judged = self._serving_keeper.put
        if self._serving_asserted is not None:
            # Told at once, whatever the placement check finds or cannot find (no upstream, its processes unseen): a
            # server in a container under a load too even for the power to judge had every row flagged for good.
            self.ledger.tell_serving(self._serving_asserted, SERVING_ASSERTED_SOURCE)
        self._check_placement()
        return data_dir

    def _asserted_serving(self, named: list):
        """The mask over the sampled GPUs `daemon.serving_gpus` asserts serving (None where it is empty); StartupError
        naming the key where an entry names no GPU of this machine, or one not sampled (the config checks what it can
        alone: config._serving_not_sampled)."""
        if not named:
            return None
        import numpy as np

        from powerprof.collectors.nvml import resolve_gpu_ids

        indexes, _, unknown = resolve_gpu_ids(self.sources.nvml.nvml, named)
        if unknown is not None:
            raise StartupError(f"config key daemon.serving_gpus = {named!r}: {unknown!r} names no GPU or MIG instance "
                               "on this machine (nvidia-smi -L lists them)")
        sampled = [i.index for i in self.sources.nvml.infos]
        if out := [g for g in indexes if g not in sampled]:
            raise StartupError(f"config key daemon.serving_gpus = {named!r}: GPU {out[0]} is not sampled (the daemon "
                               f"samples GPU(s) {', '.join(map(str, sampled))}): only a sampled GPU's energy can be the "
                               "work's; add it to daemon.gpus, or name only sampled GPUs (empty: let the daemon judge)")
        return np.array([g in indexes for g in sampled])

    def _check_placement(self) -> None:
        """Which GPUs the upstream's processes hold a context on, over every GPU NVML reports: one the daemon does not
        sample is said in the log and marks every interval and request row closed while it lasts
        (SERVER_GPU_UNSAMPLED_FLAG); a sampled GPU it does not use, and a helper context (placement.py), are said
        once. Where nothing can be told (a remote upstream, a restart's moment with no listener, no context yet, an
        exception) the state stands: the flag ends only on a placement read with every server GPU sampled."""
        from powerprof.storage.schema import SERVER_GPU_UNSAMPLED_FLAG
        from powerprof.workload.placement import HELPER_LOOK_S, UTIL_TRIES, find_placement

        if self._server_procs is None:
            return
        answers: list = []

        def procs():
            answers.append(self._server_procs())
            return answers[-1]

        why = None
        # The samples read from the last check's start, and at least HELPER_LOOK_S back: a fixed HELPER_LOOK_S (20 s)
        # against checks backed off to 30 s left 10 s of every 30 seen by the light look alone, and a helper's burst
        # of work there (its samples unread by that look) by nothing. Stamped before the reads, so no sample falls
        # between one check's window and the next's.
        started_us = time.time_ns() // 1000
        last_us = getattr(self, "_helper_look", ({}, None))[1]
        since_us = min(last_us, started_us - int(HELPER_LOOK_S * 1e6)) if last_us is not None else None
        try:
            # UTIL_TRIES reads of the samples, as the look under load takes: while a helper stands the check runs at
            # every list read, and one failed read counted its GPU serving.
            p = find_placement(self.collector.nvml, self.gpu_uuids, procs, since_us=since_us, tries=UTIL_TRIES)
        except Exception as e:  # a check of where the server runs is never the daemon's end
            log.debug("checking which GPUs the server runs on failed: %s", error_text(e))
            p, why = None, f"the check failed: {error_text(e)}"
        if p is None:
            # Nothing can be told (no listener while the server restarts, a socket list denied, no context yet, NVML
            # unable to count): the state stands. Clearing it here left rows unflagged for up to 30 s while the GPU
            # was still unsampled; it is cleared only on a placement read with every server GPU sampled. Standing
            # UNKNOWN_CHECKS_SAY checks in a row, it is said once with why, and the row note says so (the flag kept:
            # nothing shows the server left the unsampled GPU, and its rows may be low by that GPU's energy).
            n = self._unknown_checks = getattr(self, "_unknown_checks", 0) + 1
            if n == 1:
                self._unknown_since = time.time()  # checks come every 2 s or 30 s: n of them is no length of time
            if n >= HELPER_UNKNOWN_CHECKS:
                self._helper_unsampled = False  # nothing seen to re-check: back to the lists' and 30 s cadence
            if n == UNKNOWN_CHECKS_SAY and self._unsampled and self.ledger.unsampled_note:
                if why is None:
                    why = (answers[-1][1] if answers and answers[-1][1] else
                           "none of its processes is on any GPU's list (another pid namespace?), or NVML cannot count "
                           "its GPUs")
                gpus = ", ".join(f"GPU {i}" for i in self._unsampled)
                since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(getattr(self, "_unknown_since", time.time())))
                self.ledger.unsampled_note = (
                    f"{SERVER_GPU_UNSAMPLED_FLAG}: the server was last seen also on {gpus}, not sampled; which GPUs it "
                    f"runs on cannot be told since {since} ({why}), so the flag stands")
                log.warning("which GPUs the server runs on cannot be told since %s, %d checks in a row (%s): rows "
                            "closed from now on keep %s (last seen also on %s, not sampled) and analyze leaves them "
                            "out of J/token; fix: make the upstream's processes findable from the daemon (a local "
                            "upstream, the daemon able to read its socket list), or, if it now runs on sampled GPUs "
                            "only, restart the daemon", since, n, why, SERVER_GPU_UNSAMPLED_FLAG, gpus)
            return
        if getattr(self, "_unknown_checks", 0) >= UNKNOWN_CHECKS_SAY and self._unsampled:
            self._unsampled = None  # told again: the flag's note is set anew below, as the check finds it
            log.info("which GPUs the server runs on can be told again")
        self._unknown_checks = 0
        # A GPU judged a helper at the last check whose samples could not be read now (every try failed) is unknown,
        # not serving: its helper state is kept, and the check kept due, for up to UNREAD_HELPER_CHECKS such checks in
        # a row; then nothing shows it idle any more and it counts as serving (said as unread, not as work seen). A
        # context that grows past the helper bound, or whose samples show work, is serving at once.
        # Before a remembered helper's unread samples are taken for a helper's below; the sampled GPUs' alone (before,
        # any GPU's: a helper's unread samples on a GPU not sampled withdrew the sampled ones' telling).
        samples_read = not any(i in p.measured for i in p.unread)
        before = getattr(self, "_helpers_seen", {})
        unread = getattr(self, "_unread_helper_checks", {})
        unread = {i: unread.get(i, 0) + 1 for i in p.unread if i in before}
        for i, n in unread.items():
            if n < UNREAD_HELPER_CHECKS:
                p.server.pop(i, None)
                p.unread.pop(i, None)
                p.helpers[i] = (before[i][0], p.sizes.get(i) or before[i][1])
        self._unread_helper_checks = {i: n for i, n in unread.items() if n < UNREAD_HELPER_CHECKS}
        self._helpers_seen = dict(p.helpers)
        Daemon._tell_serving(self, p, samples_read)  # as named: tests run the check on a stand-in self
        # The unsampled helpers' pids, sizes and this check's start: what the light look between checks compares, and
        # where the next check's samples begin.
        self._helper_look = ({i: (p.pids.get(i, frozenset()), p.sizes.get(i))
                              for i in p.helpers if i not in p.measured}, started_us)
        # A context judged a helper on a GPU not sampled may be a new worker of the server's that has not loaded its
        # weights or run a kernel yet: the loop checks again every list read while one stands (_placement_loop).
        self._helper_unsampled = any(i not in p.measured for i in p.helpers)
        if not self._helper_said and (helper := p.helper_text()) is not None:
            self._helper_said = True
            log.info("%s", helper)
        gone = tuple(sorted(p.unmeasured))
        if gone != self._unsampled:
            if gone:
                note = f"{SERVER_GPU_UNSAMPLED_FLAG}: " + p.unmeasured_text(
                    f"add {'it' if len(gone) == 1 else 'them'} to daemon.gpus (gpus = [{', '.join(map(str, sorted(p.server)))}]) "
                    "and restart the daemon",
                    "its energy is in no gpu_energy_j of the daemon's, every GPU figure and J/token low by it")
                if unread_now := {i: w for i, w in p.unread.items() if i in gone}:
                    # Said as such, not as work seen: the fix may be NVML's, not daemon.gpus.
                    note += (" (" + ", ".join(f"GPU {i}" for i in sorted(unread_now)) + ": taken as serving because "
                             f"NVML's per-process samples could not be read ({'; '.join(sorted(set(unread_now.values())))})"
                             ", so nothing shows its context idle)")
                log.warning("%s (interval and request rows closed from now on say so in energy_note)", note)
                self.ledger.unsampled_note = note
            else:
                log.warning("the server runs on sampled GPUs only again: rows closed from now on no longer say %s",
                            SERVER_GPU_UNSAMPLED_FLAG)
                self.ledger.unsampled_note = None
            self._unsampled = gone
        if not self._idle_said and (idle := p.idle_text(
                f"leave {'it' if len(p.idle) == 1 else 'them'} out: daemon.gpus = [{', '.join(map(str, sorted(p.server)))}]",
                "its energy counts as idle (the requests' attribution keeps it apart), and with it every host total")):
            self._idle_said = True
            log.info("%s", idle)

    def _tell_serving(self, p, samples_read: bool) -> None:
        """Tells the ledger which sampled GPUs serve (those find_placement counts the server's processes serving on)
        where the check's evidence is whole, else withdraws any earlier telling (which serve then undecided, the rows
        flagged until the GPUs' power judges): every sampled GPU's process list and every per-process sample read.
        Before, any check told, and a set daemon.gpus of several GPUs told them all serving unchecked: a wrong mask
        left rows unflagged, -33% (a missed worker) to +20% (an idle GPU's draw in); and each GPU told serving had to
        hold a helper's bound (1 GiB) of the server's, so a model under it, or NVML saying no sizes, was never told.
        Another process's context past a helper's bound on a GPU told serving none (a TP worker not found as the
        server's, e.g. a Ray worker, or another server: either may draw with the work) makes the mask provisional,
        the rows flagged until the power judges the same: before, nothing was told there, and the power judging alone
        took a foreign server's load following the traffic for the work's (+50% unflagged, a review's scene)."""
        from powerprof.workload.placement import HELPER_MAX_BYTES, HELPER_MAX_SHARE

        infos = self.collector.infos
        serving = [i.index in p.server for i in infos]
        why = ("a sampled GPU's process list could not be read" if any(i.index in p.unlisted for i in infos) else
               "NVML's per-process samples could not be read" if not samples_read else
               "the server's processes hold a context on no sampled GPU" if not any(serving) else None)
        foreign = why is None and any(
            not on and i.index in p.foreign and (p.foreign[i.index] is None  # not said: nothing shows it small
                                                 or p.foreign[i.index] >= HELPER_MAX_BYTES)
            for i, on in zip(infos, serving))
        # A context under a helper's bound and under the largest, counted serving by its share alone (at least
        # HELPER_MAX_SHARE of the largest: its samples not looked at), may be a small model's server's bare CUDA
        # context: an 800 MiB model on GPU 0 and an idle 300 MiB context on GPU 1 were told [T, T], rows unflagged with
        # GPU 1's idle draw in. The largest (or its equal: an even TP's shards) is where a model is: told as found.
        unlooked = why is None and any(
            on and (b := p.sizes.get(i.index)) is not None and b < HELPER_MAX_BYTES
            and HELPER_MAX_SHARE * p.largest <= b < p.largest for i, on in zip(infos, serving))
        if (asserted := getattr(self, "_serving_asserted", None)) is not None:
            Daemon._tell_asserted(self, asserted, None if why or foreign or unlooked else serving)
            return
        said = why or ("another process's context past a helper's bound on a GPU the server's processes are not on: "
                       "told provisional, taken only where the GPUs' power judges the same" if foreign else
                       "a context under a helper's bound counted serving by its size alone, its samples not looked at: "
                       "told provisional, taken only where the GPUs' power judges the same" if unlooked else None)
        if said != getattr(self, "_untold_why", None) and len(infos) > 1:
            self._untold_why = said
            if said is not None:
                log.info("which sampled GPUs serve is not told from the server's processes alone (%s): the rows "
                         "flagged until the GPUs' power judges", said)
        self.ledger.tell_serving(None if why else serving, "the server's processes on NVML's process lists",
                                 provisional=foreign or unlooked)

    def _tell_asserted(self, asserted, found: list | None) -> None:
        """Tells the ledger the mask `daemon.serving_gpus` asserts, whatever the check found; where the check's evidence
        is whole (`found`: its mask) and differs, provisional (the rows flagged until the GPUs' power judges the same as
        the assertion), warned once per such finding: two sources that disagree are neither trusted silently. A check
        that tells nothing (`found` None) leaves the doubt as it was: nothing shows the server's processes moved."""
        was = getattr(self, "_asserted_doubted", None)
        found = was if found is None else found
        doubted = found is not None and found != asserted.tolist()
        if doubted and was != found:
            def named(mask):
                return ", ".join(n for n, on in zip(self.ledger.gpu_names, mask) if on) or "none"
            log.warning("daemon.serving_gpus asserts the proxied work runs on %s, but the server's processes on NVML's "
                        "process lists are on %s: which serve is undecided, the rows flagged (%s) until the GPUs' power "
                        "judges the same as the assertion; fix: correct daemon.serving_gpus (or empty it, to let the "
                        "daemon judge) and restart the daemon", named(asserted), named(found), GPUS_UNDECIDED_REASON)
        elif not doubted and was:
            log.info("the server's processes on NVML's process lists no longer differ from daemon.serving_gpus")
        self._asserted_doubted = found if doubted else None
        self.ledger.tell_serving(asserted, SERVING_ASSERTED_SOURCE, provisional=doubted)

    async def _placement_loop(self) -> None:
        """`_check_placement` whenever a GPU's process list changed (read every PLACEMENT_LIST_S: a server started after
        the daemon, a worker on a new GPU, a context there crossing HELPER_MAX_BYTES), while the last check judged a
        context on an unsampled GPU a helper every PLACEMENT_LIST_S doubling to PLACEMENT_CHECK_S and at any list read
        where that context grew or worked (_helper_moved), and every PLACEMENT_CHECK_S whatever the lists say; off
        the loop's thread:
        listing the host's sockets and every GPU's processes takes tens of ms. Before, the check ran every 30 s only,
        and rows closed up to 30 s after the server reached an unsampled GPU were unflagged."""
        loop = asyncio.get_running_loop()
        # Not read before the first pass: a list that changed between the start's check and this loop brings a check.
        seen: object = object()
        checked = time.monotonic()
        every_s = PLACEMENT_LIST_S  # the full check's interval while a helper stands, the lists unchanged: doubling
        while not self.stop_event.is_set():
            # On the idle loops' grid (a wake-up of its own costs the loop's thread CPU: ticks.py); a stop ends the
            # sleep (config_waker), so a stop waits for no list read. (A reload wakes it only where scrape.* keys
            # changed, which costs one early list read; no reloadable key concerns this loop.)
            await sleep_on_grid(PLACEMENT_LIST_S, self.config_waker)
            if self.stop_event.is_set():
                return
            lists = await loop.run_in_executor(None, self._gpu_pid_lists)
            now = time.monotonic()
            # A helper on an unsampled GPU (set by the last check) keeps the check due: a worker that has not yet run a
            # kernel looks like one, and its first kernels change no list. Every every_s (backing off to
            # PLACEMENT_CHECK_S while the lists stay), and at any list read where the helper GPUs alone show it grew
            # or worked (_helper_moved). At most one check a PLACEMENT_LIST_S.
            if lists == seen and now - checked < PLACEMENT_CHECK_S:
                if not getattr(self, "_helper_unsampled", False):
                    continue
                if now - checked < every_s and not await loop.run_in_executor(None, self._helper_moved):
                    continue
            await loop.run_in_executor(None, self._check_placement)
            # Reset by a list change, and while a helper's samples go unread (UNREAD_HELPER_CHECKS counts checks, so
            # those stay PLACEMENT_LIST_S apart, as before).
            every_s = (PLACEMENT_LIST_S if lists != seen or getattr(self, "_unread_helper_checks", None)
                       else min(2 * every_s, PLACEMENT_CHECK_S))
            seen, checked = lists, time.monotonic()
            self.placement_checks = getattr(self, "placement_checks", 0) + 1

    def _helper_moved(self) -> bool:
        """Whether a helper context on an unsampled GPU (the last check's) changed since: its server pids' bytes there
        differ, or NVML's per-process samples since that check show one of them working (an engine over
        HELPER_MAX_PCT). One list and one sample read per such GPU, no host process tree: the light look between the
        backed-off checks. A read that fails (a list or the samples unread, an exception) is True: the full check runs
        at that list read, reading the samples UTIL_TRIES times and counting a GPU whose samples stay unread
        (UNREAD_HELPER_CHECKS, which also sets its interval back to 2 s). Before, a failed read was False: a helper
        that began working was seen only at the next backed-off check (up to 30 s of rows unflagged)."""
        from powerprof.collectors.gateway import gateway
        from powerprof.collectors.nvml import gpu_processes, process_util
        from powerprof.workload.placement import HELPER_MAX_PCT

        helpers, since_us = getattr(self, "_helper_look", ({}, None))
        try:
            nvml = self.collector.nvml
            gw = gateway(nvml)
            for i, (pids, size) in helpers.items():
                h = gw.query("nvmlDeviceGetHandleByIndex", i)
                procs = gpu_processes(nvml, h) if h is not None else None
                if procs is None:
                    return True  # nothing shows the helper unchanged: the full check tells
                mine = [procs[pid] for pid in pids if pid in procs]
                if (None if any(b is None for b in mine) else sum(mine)) != size:
                    return True
                util, how = process_util(nvml, h, since_us)
                if util is None:
                    log.debug("the light look could not read GPU %d's per-process samples (%s): checking in full", i, how)
                    return True
                if any(u > HELPER_MAX_PCT for pid in pids for u in util.get(pid, {}).values()):
                    return True
        except Exception as e:  # a look at the helpers is never the daemon's end
            log.debug("reading the helper contexts' sizes and samples failed: %s", error_text(e))
            return True
        return False

    def _gpu_pid_lists(self) -> tuple | None:
        """The pids on every GPU NVML reports, each with whether it holds HELPER_MAX_BYTES or more ((index, {(pid,
        big)} or None where it cannot list them), ...), the cheap read that tells whether a placement check is due:
        NVML's process lists, no socket list, no utilisation samples. The size's side of the helper bound is in the key
        because a new CUDA process first holds only its context (300-500 MiB, judged a helper) and grows when it loads
        its weights, its pid unmoved: keyed on pids alone, that growth waited for the 30 s check. None
        where NVML cannot count its GPUs or the read failed (compared as any other answer: no check brought forward
        while it stays so)."""
        from powerprof.collectors.gateway import gateway
        from powerprof.collectors.nvml import gpu_processes
        from powerprof.workload.placement import HELPER_MAX_BYTES

        try:
            nvml = self.collector.nvml
            gw = gateway(nvml)
            count = gw.query("nvmlDeviceGetCount")
            if not isinstance(count, int):
                return None
            out = []
            for i in range(count):
                h = gw.query("nvmlDeviceGetHandleByIndex", i)
                procs = gpu_processes(nvml, h) if h is not None else None
                out.append((i, None if procs is None else frozenset(
                    (pid, None if b is None else b >= HELPER_MAX_BYTES) for pid, b in procs.items())))
            return tuple(out)
        except Exception as e:  # a look at the lists is never the daemon's end
            log.debug("reading the GPUs' process lists failed: %s", error_text(e))
            return None

    async def _start(self, session: aiohttp.ClientSession, data_dir: Path) -> None:
        """Listeners (proxy, /metrics, tag socket), the sampler, the writer and the loops."""
        cfg = self.cfg
        upstream = self.upstream
        down = None
        if upstream and cfg.get("proxy", "listen"):
            # Said at the start, naming the URL and why: the only word of it was the counters' warning below, which
            # said neither (a typo in --upstream, or the server not started, looked like a running daemon).
            down = await upstream_problem(upstream, SCRAPE_TIMEOUT_S)
            if down:
                log.warning("the upstream %s does not answer (%s): the daemon runs, and clients of its proxy get 502 "
                            "until it does. Fix: start the inference server there, or correct proxy.upstream "
                            "(--upstream)", upstream, down)
        scrape_url = cfg.get("scrape", "url") or upstream
        if scrape_url and cfg.get("scrape", "server") != "none":
            self.scraper = Scraper(session, scrape_url, cfg.get("scrape", "server"))
            self.ledger.scraping = True  # intervals before its first read say `unread`, not `off`
            # Before the proxy listens: a request it took during this read (up to BASELINE_WAIT_S on a slow server)
            # would have its tokens taken into the baseline, a count low with nothing to say it (10 of 150).
            await self._scrape_baseline(f"the upstream does not answer: {down}" if down and scrape_url == upstream else None)
        else:
            self.ledger.run_ons_unknown = True  # no server kind known: a cut request's run-on is flagged, not placed
        # RAPL read once before the proxy listens and the sampler starts: the first interval starts at NVML's first
        # read (just below), and a request from the first moment lands in it. Before, RAPL's own thread could read after NVML's:
        # that interval had no CPU energy, nor the request in it (1 loaded full test run in 3). Given to the ledger
        # now, stored as samples only once the listeners are up: a start that fails (a port taken) leaves no sample
        # row behind, and one that starts has the samples its first interval begins at (the books balance).
        start_reads: list[Sample] = []
        if self.sources.rapl is not None:
            try:
                t_ns, wall_ns, readings = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.sampler.read_with("rapl", self.sources.rapl.read))
            except (OSError, RaplError) as e:  # (a permission dropped, a zone gone) as the sampler's reads: logged, not fatal
                log.warning("the start's RAPL read failed, going on without it (the first requests may have no CPU "
                            "energy, marked so): %s", error_text(e))
            else:
                self.ledger.add_rapl_sample(t_ns, readings)
                start_reads.append(Sample("rapl", -1, t_ns, wall_ns, readings, label="start"))
        # NVML read once too, after RAPL's and before the proxy listens: the first interval starts here, so a request
        # from the first moment is measured from its arrival. Before, it began at the sampler's first tick, after the
        # listeners: a request sent at once, that read 0.5 s late, was charged 57 J of its 197 J (-71%), unsaid. Stored
        # as RAPL's is. A failed read leaves the first edge to the sampler, and a request that arrived before it says
        # so (ledger, BEFORE_FIRST_READ_FLAG).
        try:
            t_ns, wall_ns, readings = await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.sampler.read_with("nvml", self.collector.read))
        except Exception as e:  # the sampler's reads are never fatal either (NVML errors, a GPU gone)
            log.warning("the start's NVML read failed, going on without it (a request arriving before the first "
                        "sample will say its GPU energy before it was not counted): %s", error_text(e))
        else:
            self.ledger.add_gpu_sample(t_ns, wall_ns, readings)
            start_reads.append(Sample("nvml", -1, t_ns, wall_ns, readings, label="start"))
        listen = cfg.get("proxy", "listen")
        if listen and upstream:
            proxy_kwargs = dict(
                tag_header=cfg.get("proxy", "tag_header"),
                read_timeout_s=cfg.get("proxy", "read_timeout_s"),
                connect_timeout_s=cfg.get("proxy", "connect_timeout_s"),
                max_connections=cfg.get("proxy", "max_connections"),
                body_timeout_s=cfg.get("proxy", "body_timeout_s"),
                body_min_bytes_per_s=cfg.get("proxy", "body_min_bytes_per_s"),
                loop_id=self.loop_id,  # one for all workers: a request round them comes back to one of its own
            )
            if cfg.get("proxy", "workers") > 1:
                self.urls["proxy"] = await self._serve_workers(upstream, listen, proxy_kwargs)
            else:
                self.proxy = Proxy(upstream, recorder=self, **proxy_kwargs)
                self.urls["proxy"] = await self._serve(self.proxy.app(), listen, "proxy", SERVER_OPTIONS)
            if self.scraper is not None and same_origin(upstream, scrape_url):
                # Its refused connects (its workers' too) are the scraped server's death, as a refused scrape
                # (Scraper._proxy_refused).
                self.scraper.refusals = self.proxy.take_refusals
                # The workers' come a flush late: waited for after the page (Scraper._take_refusals).
                self.scraper.refusals_wait = getattr(self.proxy, "wait_refusals", None)
                self.scraper.refusals_late_s = getattr(self.proxy, "refusals_late_s", 0.0)
        elif listen:
            log.warning("proxy disabled: no proxy.upstream configured")
        if cfg.get("metrics", "listen"):
            self.urls["metrics"] = await self._serve(self._metrics_app(), cfg.get("metrics", "listen"), "metrics endpoint")
        await self._serve_tags()
        for sm in start_reads:  # the listeners are up: the start's reads are this run's first samples
            try:
                self.store.append("samples", sample_rows(sm, self.t0_ns, self.gpu_uuids))
            except Exception as e:  # as _drain: a sample row that fails is not the daemon's end
                log.debug("sample row failed: %s", error_text(e))
        self.sampler.start()
        self.flusher.start()
        self._tasks.append(asyncio.create_task(self._tick_loop()))
        if self.scraper is not None:
            self._tasks.append(asyncio.create_task(self._scrape_loop()))
        if self._server_procs is not None:
            self._tasks.append(asyncio.create_task(self._placement_loop()))
        log.info(
            "powerprof daemon %s running: %d GPU(s), every %.2f s, data in %s, %s",
            self.daemon_id, len(self.collector.infos), cfg.get("daemon", "interval_s"), data_dir,
            ", ".join(f"{k} {v}" for k, v in self.urls.items()),
        )
        for note in self.rig.notes:  # a simulated GPU, beside a real server or not: said where the operator looks
            log.warning("%s (every row's `simulated` column says so)" if self.rig.simulated else "%s", note)
        self._open_tags_dir = data_dir
        self._recover_lost_tags(data_dir)
        self._write_urls(data_dir)
        sdnotify.notify("READY=1")

    def _metrics_app(self) -> web.Application:
        registry = make_registry(self)

        async def metrics(_request):
            # Built here, in the loop's thread where the ledger lives, so a scrape reads the state of its moment
            # (the accounting loop builds one only when a sample or a closed interval moves it).
            try:
                self._drain()  # the samples since the accounting loop's last pass (idle: up to a second ago)
                self._update_snapshot()
            except Exception:
                log.exception("building the /metrics snapshot failed; serving the last one")
            body = await asyncio.get_running_loop().run_in_executor(None, render, registry)
            return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app

    async def _shutdown(self, session: aiohttp.ClientSession) -> None:
        """Stop the loops and listeners, take a last sample, close every interval, flush, release."""
        self._request_stop()
        for t in self._tasks:
            try:
                await asyncio.wait_for(t, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("task failed at shutdown")
        sdnotify.notify("STOPPING=1")
        await self.guard.stop()
        for r in reversed(self._runners):
            try:
                await r.cleanup()
            except Exception:
                log.exception("closing a listener failed")
        try:
            if self.sampler is not None and self.sampler._threads:
                self.sampler.stop()
                try:
                    self.sampler.sample_now("shutdown", sources=["nvml"])
                    if self.sources.rapl is not None:  # after NVML's: the last interval ends at its read
                        self.sampler.sample_now("shutdown", sources=["rapl"])
                except Exception:
                    pass
                await self._final_scrape()  # past that last sample: the listeners are closed, no proxied token is to come
            await session.close()
            if self.flusher is not None:
                self._drain()
                try:
                    self.ledger.close_all(time.monotonic_ns(), time.time_ns())
                finally:  # the last mask judged, kept before the data dir's lock goes, even where close_all raised
                    if self._serving_keeper is not None:
                        self._serving_keeper.close()
                self.flusher.stop()
                if self.store.buffered():
                    log.error("%d rows could not be written at shutdown (%s)", self.store.buffered(), self.store.last_error)
                else:
                    self._save_open_tags()  # every window closed (closed_by shutdown) and written: the file goes
            self.rig.close()
        finally:
            # Nothing has listened since the runners' cleanup; what says where it listened goes once the last rows are
            # written, so its going means the daemon is done (before, it went ahead of the final flush: a script that
            # waited for it read datasets short of their last rows, or started a daemon that found the lock held).
            # Still under the lock: another daemon on this data dir cannot have written its own daemon.json yet.
            for bound in self._sockets:
                remove_bound_socket(bound)
            self._remove_urls()
            self._release_lock(self._take_back)

    def _write_urls(self, data_dir: Path) -> None:
        """Where each listener ended up (port 0 picks one): for tests, scripts and the operator."""
        import json

        try:
            p = Path(data_dir) / "daemon.json"
            with atomic_path(p) as tmp:
                tmp.write_text(json.dumps({"pid": os.getpid(), "daemon_id": self.daemon_id, **self.urls}))
            self._info_path = p
        except OSError as e:
            log.warning("cannot write %s: %s", Path(data_dir) / "daemon.json", e)

    def _remove_urls(self) -> None:
        """At the stop, daemon.json goes, not marked stopped: its readers (tests/daemon_helpers.py, bench/_daemon.py)
        take a daemon.json that is there for a daemon that listens. Only while it is still this daemon's (its PID)."""
        import json

        p = self._info_path
        if p is None:
            return
        try:
            if json.loads(p.read_text()).get("pid") == os.getpid():
                p.unlink()
        except (OSError, ValueError) as e:
            if getattr(e, "errno", None) != errno.ENOENT:
                log.warning("cannot remove %s at the stop: %s", p, error_text(e))


TERMINAL_LOG_FORMAT = "%(asctime)s powerprof[%(process)d] %(levelname)s %(name)s: %(message)s"
JOURNAL_LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # journald stamps time, unit and PID itself


def under_journald(env=None, stderr_fd: int = 2) -> bool:
    """True when stderr is the journal's stream: systemd sets JOURNAL_STREAM to its device:inode
    (a child that inherits the variable but writes elsewhere, e.g. a terminal, does not match)."""
    env = os.environ if env is None else env
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stderr_fd)
    except OSError:
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def log_format(env=None, stderr_fd: int = 2) -> str:
    return JOURNAL_LOG_FORMAT if under_journald(env, stderr_fd) else TERMINAL_LOG_FORMAT


def _run_loop(coro):
    """asyncio.run on uvloop where installed: its libuv loop forwards a streamed chunk with less CPU
    than the default loop (about 15% less proxy CPU per token in bench/proxy_latency.py's setup)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(cfg: Config, rig, config_path=None, overrides=None, extra_collectors=()) -> int:
    from .footprint import refuse_pandas

    refuse_pandas()
    logging.basicConfig(level=logging.INFO, format=log_format())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per proxied request is noise
    quiet_bad_requests()
    # Until run() installs the loop's handlers, a SIGINT is only noted (then stops the daemon cleanly): the
    # default handler would raise KeyboardInterrupt mid-startup, with a traceback and orphaned tasks.
    early: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: early.append(signum))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the loop's handler logs it: see _install_signal_handlers
    d = Daemon(cfg, rig, extra_collectors=extra_collectors, config_path=config_path, overrides=overrides)
    d.early_signals = early
    try:
        return _run_loop(d.run())
    except StartupError as e:
        log.error("%s", e)
        return EXIT_RUNTIME
    except KeyboardInterrupt:  # only if the loop's handler was not installed yet
        log.info("interrupted")
        return 128 + signal.SIGINT
    finally:
        # Shut down already: a further Ctrl-C (a second press, a process-group signal) has nothing left to
        # stop. SIG_IGN, not a Python handler: the interpreter resets those to the default at exit.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
