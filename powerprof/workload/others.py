"""Whose work beside powerprof's ran on the server and the GPUs: judged per batch (sweep, measure) or over a whole replay.

Two kinds of evidence, each read when none of powerprof's requests is in flight:

- the server's books (servercount.py: its counters and gauges against what powerprof sent), and
- the GPUs' process lists (NVML), against the server's own processes (serverprocs.py).

`OthersWatch` holds both for one stretch of measurement: `begin()` before it, `judge(recs)` after each batch
(or once after a replay, whose requests overlap: the whole replay is one batch). `leave_out_foreign` marks a
window that ran beside others' work; the callers decide what to measure again.
"""

from __future__ import annotations

import os
import time

from .rows import FIGURES
from .servercount import FOREIGN_FIX, FOREIGN_FLAG, ForeignWatch, settled_tally

__all__ = ["FOREIGN_FIX", "FOREIGN_FLAG", "GpuNeighbours", "OthersWatch", "leave_out_foreign", "pid_text"]


def leave_out_foreign(row: dict, why: str) -> None:
    """Mark a window that ran beside others' work (foreign_traffic: what showed it): it keeps its record and loses
    its figures, as an untrusted one does, under its own reason."""
    row["foreign_traffic"] = why
    row["energy_method"] = "none"
    for k in FIGURES:
        if k in row:
            row[k] = None


def pid_text(pids) -> str:
    """'1234 (python3), 99' : the pids with the names this host can see."""
    import psutil

    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} ({psutil.Process(pid).name()})")
        except psutil.Error:
            out.append(str(pid))
    return ", ".join(out)


# A process's share of an engine other than the SM (memory bandwidth, video engines) from which it is working beside
# the server. Kernels count from any sample above 0 (they take the SMs' time); the memory's share is a percentage of
# time DRAM was busy, which a process's own small copies (loading a tensor, a monitoring tool's read-back) touch now
# and then: 1% of the bandwidth slows a memory-bound decode by at most ~1%, inside a level's spread, so it is said,
# not flagged. The server's own processes are never judged (they are found by pid), so their own traffic, tens of
# per cent of the memory's time during decode, raises nothing.
ENGINE_MIN_PCT = 2.0
ENGINE_WORDS = {"mem": "of the memory bandwidth", "enc": "of the video encoder", "dec": "of the video decoder",
                "jpg": "of the JPEG decoder", "ofa": "of the optical-flow engine"}


def _working(util: dict[str, float]) -> str | None:
    """What a process's samples show of its work beside the server, in words, or None (idle or under the bar)."""
    parts = [f"{util['sm']:.0f}% SM utilisation"] if util.get("sm", 0) > 0 else []
    parts += [f"{u:.0f}% {ENGINE_WORDS[e]}" for e, u in util.items() if e in ENGINE_WORDS and u >= ENGINE_MIN_PCT]
    return ", ".join(parts) or None


MPS_SERVER = "nvidia-cuda-mps-server"


def _is_mps_server(nvml, pid: int) -> bool:
    """Whether NVML names `pid` the NVIDIA MPS server (its name's first word's last path part)."""
    from powerprof.collectors.nvml import process_name

    name = process_name(nvml, pid)
    words = name.split() if name else []
    return bool(words) and os.path.basename(words[0]) == MPS_SERVER


class GpuNeighbours:
    """Whether a process other than the server's worked on the measured GPUs since the last look.

    NVML lists the processes using each GPU; the server's are found by its listening port or launch
    (workload/serverprocs.py). A process holding memory and running nothing (a notebook with a model
    loaded, idle) is harmless to the figures, so presence alone does not flag: its work does, as NVML's
    per-process utilisation samples show it (nvmlDeviceGetProcessesUtilizationInfo, or
    nvmlDeviceGetProcessUtilization where the driver lacks it): kernels (SM time), and memory bandwidth or
    the video engines used without SM time (copy engines, NVENC/NVDEC), which slow a memory-bound decode
    and add watts as kernels do. Where those samples cannot be read, another process on the GPU may be
    working, and is flagged (its windows could hold its energy). Where the server's processes cannot be
    found, or none of the GPU's is theirs (a container's pid namespace), whose process is whose cannot be
    told: said once, nothing flagged."""

    def __init__(self, collector, server_procs=None):
        self.collector = collector
        self.server_procs = server_procs
        self.since_us = time.time_ns() // 1000
        self.notes: dict[str, str] = {}  # once each: what cannot be told, idle holders
        self.seen: set[int] = set()  # pids flagged as working beside the server
        self.unsure: set[int] = set()  # pids flagged because NVML cannot say whether they worked (not seen working)
        # Per GPU, the pids (not ours, not an MPS server) its process list named at the batch's start: the look before
        # (or mark()). Work charged to the MPS server is taken as the server's clients' only if no other process was
        # listed at either read over the batch: judged at the look alone, another's MPS client that worked and exited
        # before it was missed, its work taken as ours (a note, nothing flagged).
        self._listed: dict[int, set[int]] = {}
        self._list_all()

    def _list_all(self) -> None:
        """Read every measured GPU's process list into `_listed` (a batch starts here)."""
        gpu = self.collector
        if gpu is None:
            return
        from powerprof.collectors.nvml import gpu_processes

        for idx, h in zip(gpu.indexes, gpu.handles):
            procs = gpu_processes(gpu.nvml, h)
            self._listed[idx] = set() if procs is None else {
                p for p in procs if p != os.getpid() and not _is_mps_server(gpu.nvml, p)}

    def mark(self) -> None:
        """Judge from now on (a measurement starts)."""
        self.since_us = time.time_ns() // 1000
        self._list_all()

    def check(self) -> str | None:
        from powerprof.collectors.nvml import gpu_processes, process_util

        gpu = self.collector
        if gpu is None:
            return None
        since, self.since_us = self.since_us, time.time_ns() // 1000
        pids = why_server = None
        for idx, h in zip(gpu.indexes, gpu.handles):
            procs = gpu_processes(gpu.nvml, h)
            # Listed at the batch's start (the look before); this look starts the next batch.
            before = self._listed.get(idx, set())
            self._listed[idx] = set() if procs is None else {
                p for p in procs if p != os.getpid() and not _is_mps_server(gpu.nvml, p)}
            if procs is None:
                self.notes.setdefault(f"list{idx}", f"NVML does not list the processes using GPU {idx}, so another "
                                      "process's work on it cannot be ruled out")
                continue
            if pids is None and why_server is None:
                pids, why_server = self.server_procs() if self.server_procs is not None else (None, "not looked for")
            others = {p for p in procs if p != os.getpid() and (pids is None or p not in pids)}
            # Under NVIDIA MPS the compute list names the MPS server (nvidia-cuda-mps-server), which holds its clients'
            # contexts; whether NVML's per-process samples charge a client's work to the client's pid or to the MPS
            # server's is not documented and not verified here on hardware. Taken for another's process, the server's
            # own work charged to it flagged every batch foreign-traffic: it is neither the server's nor another's,
            # and its samples are judged below by whose clients it serves.
            mps = {p for p in others if _is_mps_server(gpu.nvml, p)}
            others -= mps
            if pids is None:
                if others:
                    self.notes.setdefault(f"whose{idx}", (
                        f"GPU {idx} is used by process(es) {pid_text(procs)}, and the server's own processes cannot be "
                        f"found ({why_server}): whether another process shares the GPU cannot be told"))
                continue
            if not set(procs) & pids:
                if others:
                    self.notes.setdefault(f"ns{idx}", (
                        f"none of the processes NVML lists on GPU {idx} ({pid_text(procs)}) is the server's as found on "
                        "this host (a container's own pid namespace?): whether another process shares the GPU cannot "
                        "be told"))
                continue
            util, how = process_util(gpu.nvml, h, since)
            if util is None:
                if others:
                    self.unsure |= others
                    return (f"process {pid_text(others)} also uses GPU {idx} and NVML cannot say whether it worked "
                            f"beside the server (its per-process utilisation is not supported here: {how}), so its "
                            "work cannot be ruled out")
                continue
            # Samples of a process no longer listed count too: one that ran beside the batch and exited before this
            # look is gone from the lists, not from the driver's samples since the last look.
            theirs = {p: u for p, u in util.items() if p != os.getpid() and p not in pids and p not in mps}
            busy = {p: w for p, u in theirs.items() if (w := _working(u))}
            mps_busy = {p: w for p in mps if (w := _working(util.get(p, {})))}
            # Another's process listed at the batch's start or at this look (one gone by now may have worked and
            # exited between them); one that starts and exits between two reads is not seen (docs/sweep.md).
            listed = others | (before - pids - mps)
            if mps_busy and listed:
                # Work charged to the MPS server while another's process is also on the GPU (an MPS client of
                # someone else's among them, perhaps): whose work it was cannot be told, so it is not ruled out.
                self.unsure |= listed
                return (f"the MPS server (process {pid_text(sorted(mps_busy))}) worked on GPU {idx} (up to "
                        f"{'; '.join(mps_busy.values())}) while process {pid_text(listed)}, not the server's, was "
                        "listed on it over the batch: whether that work was the server's clients' or another's cannot "
                        "be told")
            if mps_busy:
                self.notes.setdefault(f"mps{idx}", (
                    f"GPU {idx}'s MPS server (process {pid_text(sorted(mps_busy))}) showed work in NVML's per-process "
                    "samples, and no process but the server's was listed on the GPU at the batch's start or end: "
                    "taken as the server's clients' work, not "
                    "others' (how NVML charges MPS clients' work is not verified on hardware here)"))
            if busy:
                self.seen |= set(busy)
                return "; ".join(f"process {pid_text([p])} "
                                 + ("ran kernels on" if theirs[p].get("sm", 0) > 0 else "worked without kernels on")
                                 + f" GPU {idx} beside the server (up to {w})" for p, w in sorted(busy.items()))
            for p, u in theirs.items():
                low = {e: v for e, v in u.items() if e in ENGINE_WORDS and v > 0}
                if low:
                    self.notes.setdefault(f"low{idx}.{p}", (
                        f"process {pid_text([p])} used " + ", ".join(f"{v:.0f}% {ENGINE_WORDS[e]}" for e, v in low.items())
                        + f" of GPU {idx} beside the server, under the {ENGINE_MIN_PCT:.0f}% that moves a decode's "
                        "figures measurably: not flagged"))
            if others:
                self.notes.setdefault(f"idle{idx}", (
                    f"process {pid_text(others)} holds memory on GPU {idx} and ran no kernels while powerprof looked: "
                    "harmless to the figures; if it starts working, its windows are flagged " + FOREIGN_FLAG))
        return None


class OthersWatch:
    """The server's books and the GPUs' processes against powerprof's requests, over stretches of measurement.

    `begin()` when none of powerprof's requests is in flight and a stretch starts (a level, a concurrency, a
    replay); `judge(recs)` after each batch `recs` (none of ours in flight again): why it ran beside others'
    work, or None. A replay's requests overlap, so there is no quiet moment inside it: it is judged as one
    batch, begun before its first request and judged after its last. `seen` sums what the server's books
    showed over the flagged batches; `cannot` says once what could not be ruled out."""

    def __init__(self, session, base_url: str, gpu_collector=None, server_procs=None, kind: str | None = None):
        self.session = session
        self.base_url = base_url
        self.kind = kind  # the server's kind: how its /metrics reads (servercount.read_tally)
        self.neighbours = GpuNeighbours(gpu_collector, server_procs)
        self._books: ForeignWatch | None = None
        self.server_blind: str | None = None  # what the server's counters cannot show of other clients ("" none)
        self.seen = {"tokens": 0.0, "requests": 0.0}  # others' work the server's books showed, flagged batches
        self.stale: str | None = None  # once: the server's gauges left over after aborts (servercount.STALE_GAUGES)

    async def begin(self) -> None:
        """Compare from now on: the server's books as they stand, the GPUs' processes from this moment."""
        first = await settled_tally(self.session, self.base_url, self.kind)
        self._books = ForeignWatch(first)
        self.stale = self.stale or self._books.stale
        if self.server_blind is None:
            self.server_blind = first.limits() or ""
        self.neighbours.mark()

    async def judge(self, recs) -> str | None:
        """Why the batch `recs` (just finished: none of ours in flight) ran beside others' work, or None: another
        client's requests on the server (its counters: servercount.ForeignWatch) or another process's kernels on
        the GPUs (GpuNeighbours)."""
        why = []
        if self._books is not None:
            t0, r0 = self._books.seen_tokens, self._books.seen_requests
            server = self._books.judge(await settled_tally(self.session, self.base_url, self.kind), recs)
            self.stale = self.stale or self._books.stale
            if server:
                why.append(server)
                self.seen["tokens"] += self._books.seen_tokens - t0
                self.seen["requests"] += self._books.seen_requests - r0
        gpu = self.neighbours.check()
        if gpu:
            why.append(gpu)
        return "; ".join(why) or None

    def saw(self) -> str:
        """What was seen that was not powerprof's, in words ('' when nothing was)."""
        seen = []
        if self.seen["requests"]:
            seen.append(f"{self.seen['requests']:.0f} finished requests")
        if self.seen["tokens"]:
            seen.append(f"{self.seen['tokens']:.0f} generated tokens")
        nb = self.neighbours
        procs = [f"process(es) {pid_text(nb.seen)} working on the GPU"] if nb.seen else []
        unsure = nb.unsure - nb.seen
        procs += [f"process(es) {pid_text(unsure)} on the GPU (whose work NVML cannot show)"] if unsure else []
        return " and ".join(x for x in (" and ".join(seen) + (" on the server" if seen else ""), *procs) if x)

    def record(self) -> dict:
        """run.json's and --json's account of what was seen: the server's extra tokens and requests, the pids."""
        return {"server_tokens": self.seen["tokens"], "server_requests": self.seen["requests"],
                "gpu_pids": sorted(self.neighbours.seen | self.neighbours.unsure)}

    @property
    def cannot(self) -> list[str]:
        """Once each: what the server's counters and the GPUs' process lists could not rule out, or said."""
        out = [f"other clients of the server: {self.server_blind}"] if self.server_blind else []
        return out + ([self.stale] if self.stale else []) + list(self.neighbours.notes.values())
