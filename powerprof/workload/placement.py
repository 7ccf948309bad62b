"""Which GPUs the server's processes hold a context on, against the GPUs measured: a server GPU left unmeasured, a measured GPU the server does not use.

NVML lists the processes using each GPU; the server's are found by its port or launch (serverprocs.py). Every GPU
NVML reports is looked at, not only the measured ones: a server on GPUs 0 and 1 measured on GPU 1 alone has half its
energy in no figure, and its limit stepped on one GPU of two. Where the server's processes cannot be found (a remote
server, a socket list this user may not read) or none of them is on any GPU's list (a container's own pid namespace:
a listed pid whose name NVML gives differently from this namespace's is another process bearing the same number),
nothing can be told and nothing is said here (GpuNeighbours, others.py, says the latter of the measured GPUs).

A small idle context is not serving: a GPU where the server's processes hold under HELPER_MAX_BYTES together, and
under HELPER_MAX_SHARE of what they hold on their busiest GPU, and where NVML's per-process utilisation samples of the
last HELPER_LOOK_S show none of them working (no engine over HELPER_MAX_PCT), is a helper context (a child that
touched CUDA once: PyTorch's default device, a tokenizer or API process), said in the notes and never refused or
flagged. Memory alone does not make a helper: a small model (an embedding, reranker or draft model behind the same
port) holds under 1 GiB and draws full power while it works. Samples NVML cannot give, or one showing work, make the
GPU serving. A small model idle through the look before the load is taken for a helper until a later look sees it
work: sweep and measure look again after every batch of their load, over its samples (LookUnderLoad), and a server GPU
found then stops the run as the first look would have; the daemon looks again whenever a GPU's process list changes (a
pid, or one crossing HELPER_MAX_BYTES), while a helper stands on a GPU it does not sample at a list read that finds it
grown or working and on a schedule backing off from 2 s to 30 s, and every 30 s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


# A bare CUDA context is ~300-600 MiB (PyTorch's on an H100: ~500 MiB); a server's engine holds its weights and KV cache,
# GiBs. Both bounds must hold: a small model split over two GPUs (~400 MiB each) is each GPU's largest, so serving.
HELPER_MAX_BYTES = 1 << 30
HELPER_MAX_SHARE = 0.10
# A helper context works (almost) not at all: no engine over HELPER_MAX_PCT in the samples of the last HELPER_LOOK_S.
HELPER_MAX_PCT = 5.0
HELPER_LOOK_S = 20.0


class GpuPlacementError(ValueError):
    """The server runs on a GPU that is not measured (sweep, measure): refused before anything is measured or changed,
    exit 2 (the --gpus given, or left out, are the mistake)."""


class GpuPlacementStop(GpuPlacementError):
    """The same found by the look under load (LookUnderLoad), once the run has begun: a stop partway, said as one (no
    usage banner), exit 2."""


def cost_words(kind: str) -> str:
    """What leaving a server GPU unmeasured costs, for unmeasured_text, by what the run steps: kind 'power_limit' (a
    sweep of limits), 'sm_clock' (a sweep of clocks), or 'none' (measure, a grid of configurations as launched)."""
    stepped = {"power_limit": "limit", "sm_clock": "clock"}.get(kind)
    return "{its} energy would be in no figure (J/token low)" + (f" and {{its}} {stepped} not stepped" if stepped else "")


@dataclass
class Placement:
    """server: index → UUID of every GPU the server serves from (its processes hold more than a helper context there);
    measured: index → UUID of the GPUs
    measured; unlisted: GPUs whose process list NVML cannot give (the server may be on them too)."""

    server: dict[int, str]
    measured: dict[int, str]
    unlisted: list[int] = field(default_factory=list)
    helpers: dict[int, tuple[str, int]] = field(default_factory=dict)  # index → (UUID, bytes): a helper context only
    largest: int = 0  # the bytes the server's processes hold on their busiest GPU
    # index → why: GPUs judged serving only because NVML's per-process samples could not be read (small, nothing
    # shows them idle): said as such, not as work seen (LookUnderLoad).
    unread: dict[int, str] = field(default_factory=dict)
    sizes: dict[int, int | None] = field(default_factory=dict)  # index → bytes the server's processes hold (None: not said)
    pids: dict[int, frozenset] = field(default_factory=dict)  # index → the server's pids there (_helper_moved)
    # index → the bytes the largest context of a process not the server's holds there (None: a size NVML does not say),
    # listed GPUs with one only: a worker of the server's not found as its (a TP worker no descendant of it) or another
    # server, either drawing with the work on a GPU the server's processes are not on.
    foreign: dict[int, int | None] = field(default_factory=dict)

    @property
    def unmeasured(self) -> dict[int, str]:
        """The server's GPUs that are not measured."""
        return {i: u for i, u in self.server.items() if i not in self.measured}

    @property
    def idle(self) -> dict[int, str]:
        """Measured GPUs holding none of the server's processes (empty where the server is on no GPU's list: unknown)."""
        if not self.server:
            return {}
        return {i: u for i, u in self.measured.items()
                if i not in self.server and i not in self.unlisted and i not in self.helpers}

    def helper_text(self) -> str | None:
        """'a helper context of 300 MiB on GPU 0 (GPU-…): not counted as serving …', or None: the server's small
        contexts on GPUs it does not serve from (not measured: said, not refused)."""
        if not self.helpers:
            return None
        what = ", ".join(f"{b >> 20} MiB on {gpu_name(i, u)}" for i, (u, b) in sorted(self.helpers.items()))
        one = len(self.helpers) == 1
        return (f"the server's processes hold {'a helper context' if one else 'helper contexts'} of {what}: not "
                f"counted as serving (under {HELPER_MAX_BYTES >> 20} MiB and under {HELPER_MAX_SHARE:.0%} of the "
                f"{self.largest >> 20} MiB they hold on their busiest GPU, and no work there in NVML's samples of the last "
                f"{HELPER_LOOK_S:.0f} s); where not measured, {'its' if one else 'their'} draw, not measured, is in no "
                "figure")

    def gpus_option(self) -> str:
        """The --gpus that measures every GPU the server uses and no other."""
        return ",".join(str(i) for i in sorted(self.server))

    def unmeasured_text(self, fix: str | None = None, cost: str | None = None) -> str | None:
        """'the server also runs on GPU 0 (GPU-…): …; add it: --gpus 0,1', or None when every server GPU is measured.
        cost: what leaving it out costs, in words, '{its}' standing for its or their (default a sweep of limits':
        cost_words)."""
        gone = self.unmeasured
        if not gone:
            return None
        what, one, its = _named(gone)
        return (f"the server also runs on {what}, which {'is' if one else 'are'} not measured: "
                + (cost or cost_words("power_limit")).format(its=its) + "; "
                + (fix or f"add {'it' if one else 'them'}: --gpus {self.gpus_option()}"))

    def idle_text(self, fix: str | None = None, cost: str | None = None) -> str | None:
        """The measured GPUs the server does not use, in words with the fix, or None. cost: what measuring them costs,
        in words (default a sweep's and measure's: their idle power in every figure, their limit stepped for nothing)."""
        idle = self.idle
        if not idle:
            return None
        what, one, its = _named(idle)
        return (f"{what} {'holds' if one else 'hold'} none of the server's processes (the server runs on "
                f"{', '.join(gpu_name(i, u) for i, u in sorted(self.server.items()))}): "
                + (cost or f"{its} idle power is in every GPU energy and J/token figure, and a sweep steps {its} limit "
                           "for nothing") + "; "
                + (fix or f"measure only the server's GPUs: --gpus {self.gpus_option()}"))


def gpu_name(index: int, uuid: str | None) -> str:
    """'GPU 0 (GPU-…)', as the messages name a GPU."""
    return f"GPU {index}" + (f" ({uuid})" if uuid else "")


def _named(gpus: dict) -> tuple[str, bool, str]:
    """GPUs (index -> UUID) in words, whether there is one, and the possessive that goes with it."""
    one = len(gpus) == 1
    return ", ".join(gpu_name(i, u) for i, u in sorted(gpus.items())), one, "its" if one else "their"


def _same_process(nvml, pid: int) -> bool:
    """Whether the pid on NVML's list is the server's process of that number here, judged by name: in a container's
    own pid namespace NVML's pids are the host's, and a host process may bear a server pid's number. NVML's name (its
    first word's last path part) against this namespace's (psutil: the name, which the kernel cuts to 15 characters,
    the executable's, the command line's first word's, which setproctitle rewrites: vLLM's VLLM::EngineCore): equal,
    or one a prefix of the other where that one is 15 characters or more (the kernel's cut; `python` is not
    `python3`); True where either cannot be read or is empty (nothing shows them different: cannot tell)."""
    import psutil

    from powerprof.collectors.nvml import process_name

    theirs = process_name(nvml, pid)
    if not theirs:
        return True

    def base(text: str) -> str:
        words = text.strip().split()
        return os.path.basename(words[0]) if words else ""

    ours: set[str] = set()
    try:
        p = psutil.Process(pid)
        for read in (p.name, p.exe, lambda: (p.cmdline() or [""])[0]):
            try:
                ours.add(base(read() or ""))
            except (psutil.Error, OSError):
                pass
    except (psutil.Error, OSError):
        return True
    ours.discard("")
    b = base(theirs)
    if not b or not ours:
        return True  # an empty name (spaces only) says nothing: cannot tell, as an unreadable one, no match claimed

    def cut(short: str, long: str) -> bool:
        # A prefix only where the shorter is the kernel's cut (15 characters): `python` is not `python3`.
        return len(short) >= COMM_LEN and long.startswith(short)

    return any(b == o or cut(o, b) or cut(b, o) for o in ours)


COMM_LEN = 15  # the kernel cuts a process's name (comm) to 15 characters


def find_placement(nvml, measured: dict[int, str], server_procs, *, since_us: int | None = None,
                   tries: int = 1) -> Placement | None:
    """Where the server's processes hold a context, over every GPU NVML reports (NVML initialised by the caller: an
    open collector). measured: index → UUID of the GPUs measured. server_procs: a callable answering (pids, None) or
    (None, why) (serverprocs.ServerProcesses). None where nothing can be told: the server's processes unknown, NVML
    unable to count its GPUs, or none of the server's processes on any GPU's list (another pid namespace).
    since_us: the per-process samples read from then (µs, wall clock; default the last HELPER_LOOK_S); tries: reads of
    them before a failure counts (see _idle)."""
    from powerprof.collectors.gateway import gateway
    from powerprof.collectors.nvml import gpu_processes, process_util

    if server_procs is None:
        return None
    pids, _why = server_procs()
    if not pids:
        return None
    gw = gateway(nvml)
    count = gw.query("nvmlDeviceGetCount")
    if not isinstance(count, int):
        return None
    held: dict[int, tuple[str, int | None]] = {}  # index → (UUID, bytes the server's processes hold; None: not said)
    theirs: dict[int, tuple[object, set[int]]] = {}  # index → (handle, the server's pids on it)
    unlisted: list[int] = []
    foreign: dict[int, int | None] = {}
    for i in range(count):
        h = gw.query("nvmlDeviceGetHandleByIndex", i)
        procs = gpu_processes(nvml, h) if h is not None else None
        if procs is None:
            unlisted.append(i)
            continue
        ours = {pid for pid in set(procs) & pids if _same_process(nvml, pid)}
        mine = [procs[pid] for pid in ours]
        if others := [b for pid, b in procs.items() if pid not in ours]:
            foreign[i] = None if any(b is None for b in others) else max(others)
        if mine:
            theirs[i] = (h, ours)
            size = None if any(m is None for m in mine) else sum(mine)
            held[i] = (measured.get(i) or gw.query("nvmlDeviceGetUUID", h), size)
    if not held:
        return None
    largest = max((b for _u, b in held.values() if b is not None), default=0)
    server: dict[int, str] = {}
    helpers: dict[int, tuple[str, int]] = {}
    unread: dict[int, str] = {}
    for i, (u, b) in held.items():
        # A size NVML does not say (None) is serving: nothing shows it small.
        if b is not None and b < HELPER_MAX_BYTES and b < HELPER_MAX_SHARE * largest:
            idle, why = _idle(nvml, *theirs[i], process_util, since_us, tries)
            if idle:
                helpers[i] = (u, b)
                continue
            if why is not None:
                unread[i] = why
        server[i] = u
    return Placement(server, dict(measured), unlisted, helpers, largest, unread, {i: b for i, (_u, b) in held.items()},
                     {i: frozenset(ours) for i, (_h, ours) in theirs.items()}, foreign)


def _idle(nvml, handle, pids: set[int], process_util, since_us: int | None = None,
          tries: int = 1) -> tuple[bool, str | None]:
    """Whether NVML's per-process samples since `since_us` (default: the last HELPER_LOOK_S) show none of `pids`
    working on the GPU (no engine over HELPER_MAX_PCT), and None; (False, why) where NVML cannot give them (nothing
    shows the context idle). Read up to `tries` times, UTIL_RETRY_S apart: pynvml's read sizes its buffer by one call
    and fills it by a second, and fails (INSUFFICIENT_SIZE) where samples arrived in between, likelier under load. A
    look that read them before (LookUnderLoad) retries rather than take one such failure for the server's work."""
    import time

    why = None
    for k in range(max(1, tries)):
        if k:
            time.sleep(UTIL_RETRY_S)
        start = since_us if since_us is not None else time.time_ns() // 1000 - int(HELPER_LOOK_S * 1e6)
        util, how = process_util(nvml, handle, start)
        if util is not None:
            return all(u <= HELPER_MAX_PCT for pid in pids for u in util.get(pid, {}).values()), None
        why = how
    return False, why or "NVML gave no samples"


UTIL_RETRY_S = 0.1  # s between reads of the per-process samples in a look that retries (_idle)
UTIL_TRIES = 3  # reads of them before a failure counts, in the look under load


ALLOW_OPTION = "--allow-unmeasured-server-gpus"


def judge_placement(placement: Placement | None, notes: list[str], *, allow: bool = False,
                    stopped: str = "nothing was changed", cost: str | None = None) -> None:
    """What sweep and measure do with a placement: a server GPU left unmeasured raises GpuPlacementError (naming the
    fix, --gpus of the server's GPUs, and ALLOW_OPTION to go on anyway) or, with allow, goes into the notes as measured
    anyway; a helper context and a measured GPU the server does not use go into the notes. stopped: what the refusal
    left undone; cost: what leaving a GPU out costs (cost_words). Nothing where the placement cannot be told (None)."""
    if placement is None:
        return
    if (helper := placement.helper_text()) is not None:
        notes.append(helper)
    _judge_unmeasured(placement, notes, allow, stopped, cost=cost)
    if (idle := placement.idle_text()) is not None:
        notes.append(idle)


def _judge_unmeasured(placement: Placement, notes: list[str], allow: bool, stopped: str, when: str = "", *,
                      cost: str | None = None, error: type[GpuPlacementError] = GpuPlacementError) -> None:
    """A server GPU not measured: `error`, or with allow a note (when: where it was found, in words)."""
    if (why := placement.unmeasured_text(cost=cost)) is None:
        return
    if not allow:
        raise error(f"{why}; {stopped} (to measure anyway, with those GPUs' energy in no figure: "
                                f"{ALLOW_OPTION})")
    notes.append(f"measured anyway ({ALLOW_OPTION}): {why}{when}")


class LookUnderLoad:
    """The placement looked at again after every batch of the load (sweep, measure, a grid's configuration, a trace's
    replay), over that batch's samples: a small model idle through the look before the load was taken for a helper,
    and any batch's requests may work it (a data-parallel server's or router's first low-concurrency batch may land
    on one replica; another level's may reach the next). NVML's per-process samples since the batch began then show
    that work, and the GPU is the server's: refused in the first look's words, or with allow said in the notes. Only a
    server GPU not already judged unmeasured counts (those were refused or allowed then, or by an earlier batch's look).

    Cheap enough for every batch: where every GPU's process list (pids and sizes) and the server's pid set are the
    last look's and that look found no helper context and no unread samples, nothing a sample could change stands,
    and the look is the lists and the server's processes alone (_process_lists); otherwise find_placement, its sample
    reads only for the helper-sized contexts.

    Refusing, not flagging the levels: the run would have been refused had the model worked during the first look, and
    every figure of it lacks that GPU's energy (and a sweep's limit was not stepped there); a run told whole later by
    flags alone would still have stepped the wrong GPUs. The caller restores any limit it set (its usual stop path)."""

    def __init__(self, nvml, measured: dict[int, str], server_procs, first: Placement | None, *, allow: bool,
                 stopped: str, cost: str | None = None, notes: list[str] | None = None):
        self.nvml, self.measured, self.server_procs, self.first = nvml, dict(measured), server_procs, first
        self.allow, self.stopped, self.cost = allow, stopped, cost
        # The run's notes, holding the first look's (judge_placement): its helper note is replaced where this look
        # finds a GPU it named serving, so no note goes on calling that GPU a helper's.
        self.notes = notes
        self.found: dict[int, str] = {}  # server GPUs an earlier batch's look already judged (allowed): not said again
        # The server's pids and the process lists of the last full look, where it left nothing a sample could change
        # (no helper, nothing unread): a batch finding both the same skips the rest (_process_lists). The pids too:
        # a look with a partial pid set (serverprocs drops a root's children where psutil raises) found the lists
        # settled, and with the lists alone every later batch took this path, a server GPU never seen.
        self._settled: tuple[frozenset, dict] | None = None
        self.looks = self.full_looks = 0  # calls, and those that ran find_placement (what the cheap path saved)

    def rearm(self) -> None:
        """The server restarted (sweep --server-restart-wait rode it out): the next batch's look is a full one, the
        restarted server's processes found again (its pids, its model placement perhaps another)."""
        self._settled = None

    def __call__(self, since_wall_ns: int | None = None, stopped: str | None = None) -> list[str]:
        """The notes of the look (with allow), [] when nothing new was found; raises GpuPlacementStop where the server
        now runs on a GPU not measured. since_wall_ns: when the batch began (time.time_ns() of its first request), the
        samples read from then; None: the last HELPER_LOOK_S. stopped: what the refusal left undone, as the caller
        knows it now (the level it struck, the levels kept), else the words given at construction."""
        if self.server_procs is None:
            return []
        self.looks += 1
        lists = _process_lists(self.nvml)
        # The server's processes read once, for the comparison and the full look alike.
        answer = self.server_procs()
        pids = frozenset(answer[0]) if answer[0] else None
        if lists is not None and pids is not None and (pids, lists) == self._settled:
            return []
        self.full_looks += 1
        # Samples since the batch began (its first request's wall time): the whole batch or replay, not its last
        # HELPER_LOOK_S only (a long one's early work was unseen); NVML keeps what its buffer holds.
        since = since_wall_ns // 1000 if since_wall_ns is not None else None
        again = find_placement(self.nvml, self.measured, lambda: answer, since_us=since, tries=UTIL_TRIES)
        self._settled = ((pids, lists) if again is not None and pids is not None and not again.helpers
                         and not again.unread else None)
        if again is None:
            return []
        before = {**(self.first.unmeasured if self.first is not None else {}), **self.found}
        new = {i: u for i, u in again.unmeasured.items() if i not in before}
        self.found.update(new)
        if not new:
            return []
        helpers = self.first.helpers if self.first is not None else {}
        was = [i for i in new if i in helpers]
        if was and self.notes is not None and (old := self.first.helper_text()) in self.notes:
            k = self.notes.index(old)
            still = again.helper_text()  # the helpers this look still finds, if any
            self.notes[k:k + 1] = [still] if still is not None else []
        what = ", ".join(f"GPU {i}" for i in sorted(new))
        if self.first is None:
            before_words = "the look before the load could tell nothing"
        elif len(was) == len(new):
            before_words = (f"before the load {'it' if len(new) == 1 else 'they'} held only an idle context, taken for "
                            f"a helper's; " + _now_words(again, new))
        else:
            before_words = "before the load the server's processes were not all there"
        found = f"found once the load ran on {what}: {before_words}"
        notes: list[str] = []
        _judge_unmeasured(again, notes, self.allow, f"{found}; {stopped or self.stopped}", when=f" ({found})", cost=self.cost,
                          error=GpuPlacementStop)
        return notes


def _process_lists(nvml) -> dict | None:
    """Every GPU's process list ({index: {pid: bytes}}), as find_placement reads them; None where NVML cannot count
    its GPUs. The look under load's cheap path: the same lists and nothing small, nothing new to judge."""
    from powerprof.collectors.gateway import gateway
    from powerprof.collectors.nvml import gpu_processes

    gw = gateway(nvml)
    count = gw.query("nvmlDeviceGetCount")
    if not isinstance(count, int):
        return None
    out = {}
    for i in range(count):
        h = gw.query("nvmlDeviceGetHandleByIndex", i)
        out[i] = gpu_processes(nvml, h) if h is not None else None
    return out


def _now_words(again: Placement, new: dict[int, str]) -> str:
    """Why the look under load counts GPUs taken for a helper's as serving, in words: their samples unreadable (no
    work seen: nothing shows them idle), or work seen there."""
    unread = {i: w for i, w in again.unread.items() if i in new}
    grown = {i: again.sizes.get(i) for i in new if i not in unread}
    grown = {i: b for i, b in grown.items()
             if b is None or b >= HELPER_MAX_BYTES or b >= HELPER_MAX_SHARE * again.largest}
    if grown and len(grown) == len(new):
        return "the server's processes now hold more there than a helper context (" + ", ".join(
            f"GPU {i}: {'a size NVML does not say' if b is None else f'{b >> 20} MiB'}" for i, b in sorted(grown.items())) + ")"
    if len(unread) == len(new):
        why = "; ".join(sorted(set(unread.values())))
        return (f"NVML's per-process samples could not be read now ({why}, {UTIL_TRIES} tries), so nothing shows "
                f"{'it' if len(new) == 1 else 'them'} idle")
    if unread or grown:
        return ("NVML now shows the server's work, or more than a helper's memory, there"
                + (", or could not read its samples (on " + ", ".join(f"GPU {i}" for i in sorted(unread)) + ")"
                   if unread else ""))
    return "NVML's samples now show the server's work there"
