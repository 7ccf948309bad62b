"""CPU time, cumulative: the whole host's, the inference server's processes' and powerprof's own, through an injected psutil.

RAPL measures the whole package: every process on the host. Beside it, this collector says how much
of the host's CPU time went to the server and to powerprof itself, so a GPU+CPU figure measured while
other processes worked (a training job, a build, another server) is flagged rather than silently
counting their energy (`BUSY_HOST_PCT`, used by `measure` and the levels table).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

# Above this share of the host's busy CPU time used by processes other than the server's and
# powerprof's, a GPU+CPU figure is flagged (busy-host). Package power is idle power plus a part that
# follows busy cores, so other processes' share of the busy CPU time is about their share of the
# above-idle CPU energy: at 10% the CPU part of GPU+CPU J/token carries up to ~10% of its above-idle
# energy that is not the server's, about the CPU part's share of the GPU+CPU figure times that (a few
# % of GPU+CPU on a GPU server), the size of the differences a sweep resolves. A quiet host's own
# background (kernel threads, systemd, a metrics agent) stays at a few % of a server that keeps a
# core busy, so the flag does not fire there.
BUSY_HOST_PCT = 10.0
BUSY_HOST_FLAG = "busy-host"
BUSY_HOST_FIX = "run on a host left to the server (stop the other work), or read the GPU J/token, which RAPL does not touch"
REFRESH_S = 5.0  # how often the server's processes are looked up again (a server starts workers, restarts)


def busy_host_text(other_pct: float, during: str = "this level", figure: str = "the GPU+CPU J/token") -> str:
    """The reason a GPU+CPU figure is flagged: said the same way by every output."""
    return (f"other processes used {other_pct:.0f}% of the host's busy CPU time during {during} (over "
            f"{BUSY_HOST_PCT:g}%); the CPU energy is the whole package's, so {figure} includes theirs")


def unknown_server_text(why: str, figure: str = "the GPU+CPU J/token is") -> str:
    return (f"the inference server's processes were not found on this host ({why}): {figure} the "
            "whole package's CPU energy and could include other processes' energy, which cannot be told apart here")


@dataclass(frozen=True, slots=True)
class CpuTimeReading:
    """Cumulative CPU seconds (all cores) at one read. None means not known, never zero."""

    host_busy_s: float | None  # the whole host: user + nice + system, since boot
    server_cpu_s: float | None  # the server's processes: user + system, since this collector first saw each
    powerprof_cpu_s: float | None  # this process; None when it is the server's own (a server in powerprof's process)
    server_note: str | None = None  # why the server's processes are not known


@dataclass(frozen=True, slots=True)
class CpuTime:
    """CPU seconds (all cores) over one interval: the whole host's busy time and whose it was."""

    host_busy_s: float
    server_cpu_s: float | None
    powerprof_cpu_s: float | None  # None: counted in the server's (same process)

    @property
    def other_cpu_s(self) -> float | None:
        """Everyone else's: host − server − powerprof (tick rounding can make it a hair below 0: 0)."""
        if self.server_cpu_s is None:
            return None
        return max(0.0, self.host_busy_s - self.server_cpu_s - (self.powerprof_cpu_s or 0.0))

    def __add__(self, o: "CpuTime") -> "CpuTime":
        def add(a, b):
            return None if a is None or b is None else a + b

        return CpuTime(self.host_busy_s + o.host_busy_s, add(self.server_cpu_s, o.server_cpu_s),
                       add(self.powerprof_cpu_s, o.powerprof_cpu_s))


def host_busy_s(t) -> float:
    # What processes ran: user + nice + system (guest time is inside user/nice on Linux). Interrupts,
    # steal and idle/iowait are left out: no process's time covers them, so counting them would call
    # the kernel's interrupt work "another process" on every host.
    return t.user + getattr(t, "nice", 0.0) + t.system


def _proc_s(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


ServerFinder = Callable[[], "tuple[Iterable[int] | None, str | None]"]


class CpuTimeCollector:
    """`CpuTimeCollector(find_server, ps=psutil)`; `source = "cputime"`.

    find_server() -> (pids, None) or (None, why): the server's processes as this host sees them, asked
    again every `refresh_s`. A process that ends keeps the CPU time it was last seen with (the sum never
    falls back); one that started after the collector counts from zero, one that ran before from its
    first sight.

    helpers() -> pids: powerprof's own helper processes (the daemon's proxy workers and compaction child), asked
    at every read (the caller holds them: no process-table scan). Their CPU time is powerprof's, not "other
    processes'": counted as the server's processes are (an ended one keeps its last-seen time). Only the tail a
    helper ran after the last read before it ended is missed (at most one sampling period of it).
    """

    source = "cputime"

    def __init__(self, find_server: ServerFinder | None, ps=None, pid: int | None = None,
                 refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic,
                 helpers: Callable[[], Iterable[int]] | None = None):
        if ps is None:
            import psutil as ps
        self.ps = ps
        self.find_server = find_server
        self.pid = os.getpid() if pid is None else pid
        self.refresh_s = refresh_s
        self.clock = clock
        self._lock = threading.Lock()
        self._t_start = time.time()
        self._c_start = clock()
        # Which processes ran before this collector: the process table now. psutil's create_time is the boot time
        # (whole seconds, from the wall clock) plus start ticks, so comparing it with time.time() misjudged a process
        # started within a second or so of now, and every one after a wall-clock step. A pid reused later reads as old
        # (its time before first sight goes to other processes': the busy-host side, never hiding their work).
        try:
            self._before: set[int] | None = set(ps.pids())
        except Exception:  # no process table (an injected psutil without one): create times, checked below
            self._before = None
        self._procs: dict[int, tuple[object, float, float]] = {}  # pid -> (Process, base s, last s)
        self._gone_s = 0.0
        self._dropped: set[int] = set()  # counted into _gone_s: never counted again (a zombie still listed)
        self._next_refresh = float("-inf")
        self._server_note: str | None = None
        self._known = False
        self.helpers = helpers
        self._helpers: dict[int, tuple[object, float, float]] = {}  # pid -> (Process, base s, last s)
        self._helpers_gone_s = 0.0
        try:
            self._self = ps.Process(self.pid)
        except Exception:
            self._self = None

    def _drop(self, pid: int) -> None:
        _, base, last = self._procs.pop(pid)
        self._gone_s += last - base
        self._dropped.add(pid)

    def read(self) -> CpuTimeReading:
        with self._lock:
            now = self.clock()
            if now >= self._next_refresh:
                self._next_refresh = now + self.refresh_s
                self._refresh(dict(self._procs))
            try:
                host = host_busy_s(self.ps.cpu_times())
            except Exception:
                host = None
            server = None
            if self._known:
                for pid, (p, base, last) in list(self._procs.items()):
                    try:
                        self._procs[pid] = (p, base, max(last, _proc_s(p)))
                    except Exception:  # ended (or no longer ours to read): keeps what it was last seen with
                        self._drop(pid)
                server = self._gone_s + sum(last - base for _, base, last in self._procs.values())
            mine = None
            if self._self is not None and not (self._known and self.pid in self._procs):
                try:
                    mine = _proc_s(self._self)
                except Exception:
                    mine = None
            helpers_s = self._helpers_s()
            if helpers_s is not None:
                mine = helpers_s if mine is None else mine + helpers_s
            return CpuTimeReading(host, server, mine, self._server_note)

    def _helpers_s(self) -> float | None:
        """CPU seconds of powerprof's helper processes since the collector started (None: none given)."""
        if self.helpers is None:
            return None
        try:
            now = set(self.helpers()) - set(self._procs)  # a helper that serves (a server) is the server's
        except Exception:  # the caller's list changing under us: this read keeps what was known
            now = set(self._helpers)
        for pid in list(self._helpers):
            p, base, last = self._helpers[pid]
            try:
                if pid not in now:
                    raise LookupError(pid)
                self._helpers[pid] = (p, base, max(last, _proc_s(p)))
            except Exception:  # ended or no longer a helper: keeps the time it was last seen with
                del self._helpers[pid]
                self._helpers_gone_s += last - base
        for pid in now - set(self._helpers):
            if (entry := self._begin(pid)) is not None:
                self._helpers[pid] = entry
        return self._helpers_gone_s + sum(last - base for _, base, last in self._helpers.values())

    def _refresh(self, before: dict) -> None:
        """Look the server's processes up again; those no longer among them keep their time (as ended)."""
        if self.find_server is None:
            self._known, self._server_note = False, "no server named"
            return
        try:
            pids, why = self.find_server()
        except Exception as e:  # a lookup that fails is a reason, never a crash of the sampler
            pids, why = None, f"looking it up failed: {type(e).__name__}: {e}"
        if pids is None:
            if not self._known:
                self._server_note = why or "not found"
            # Found before and lost now (the server restarting): its processes stay counted until they end.
            return
        self._known, self._server_note = True, None
        pids = set(pids)
        for pid in [p for p in before if p not in pids]:
            self._drop(pid)
        for pid in pids - set(self._procs) - self._dropped:
            if (entry := self._begin(pid)) is not None:
                self._procs[pid] = entry

    def _begin(self, pid: int) -> tuple | None:
        """(process, CPU s it counts from, CPU s now) for a process to follow, or None where it is gone: one
        started since this collector counts all its time, one older only what it uses from now on."""
        try:
            p = self.ps.Process(pid)
            s = _proc_s(p)
            if self._before is not None:
                new = pid not in self._before
            else:  # and never new with more CPU time than could have run since the start, whatever the clock says
                new = (p.create_time() >= self._t_start
                       and s <= (self.clock() - self._c_start) * (os.cpu_count() or 1))
        except Exception:
            return None
        return p, 0.0 if new else s, s


def cpu_shares_pct(host_s, other_s, powerprof_s) -> tuple[float | None, float | None]:
    """(other processes', powerprof's) % of the host's busy CPU time over several windows (per-window CPU
    seconds, None or NaN where unknown): time summed ÷ time summed, each over the windows that know it."""
    def share(part) -> float | None:
        num = den = 0.0
        for h, x in zip(host_s, part):
            if h is None or x is None or h != h or x != x:
                continue
            num, den = num + x, den + h
        return 100.0 * num / den if den > 0 else None

    host_s, other_s, powerprof_s = list(host_s), list(other_s), list(powerprof_s)
    return share(other_s), share(powerprof_s)


# A CPU-time read further than this from an interval says nothing about it (a stalled collector): unjudged.
STALE_S = 5.0


def interval_cpu_s(t_ns, host_s, other_s, edges_ns, stale_s: float = STALE_S) -> tuple[np.ndarray, np.ndarray]:
    """(K,) the host's busy and other processes' CPU seconds over each interval between K+1 edges, from cumulative
    reads (instants `t_ns`): each interval at the rate of the reads around it (the last at or before its start to
    the first at or after its end), so an interval that ends after the latest read (the daemon closes intervals
    before the next tick) takes the latest span's rate. Read on the ticks only, a sub-second interval's share is its
    surrounding second's. NaN where no read spans it within `stale_s`."""
    t = np.asarray(t_ns, dtype=np.int64)
    h = np.asarray(host_s, dtype=float)
    o = np.asarray(other_s, dtype=float)
    edges = np.asarray(edges_ns, dtype=np.int64)
    k_count = max(edges.size - 1, 0)
    if t.size < 2 or k_count == 0:
        return np.full(k_count, np.nan), np.full(k_count, np.nan)
    a, b = edges[:-1], edges[1:]
    hi = np.maximum(np.clip(np.searchsorted(t, b, side="left"), 0, t.size - 1), 1)
    lo = np.minimum(np.clip(np.searchsorted(t, a, side="right") - 1, 0, t.size - 1), hi - 1)
    span_s = (t[hi] - t[lo]) / 1e9
    stale = (t[hi] < a - int(stale_s * 1e9)) | (t[lo] > b + int(stale_s * 1e9)) | (span_s <= 0)
    dur_s = (b - a) / 1e9
    with np.errstate(divide="ignore", invalid="ignore"):
        host = (h[hi] - h[lo]) / span_s * dur_s
        other = np.clip((o[hi] - o[lo]) / span_s, 0.0, None) * dur_s  # tick rounding can make it a hair below 0
    host[stale], other[stale] = np.nan, np.nan
    return host, other
