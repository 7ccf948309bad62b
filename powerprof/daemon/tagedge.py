"""Hold a tag window's edges until each GPU's energy counter refreshes past them, so a window shorter than the refresh is measured.

A counter read is up to one refresh old (100 ms on an H200, 20 ms on an A100): a tag window's edges read at its
start and stop call took a 45 ms job's energy as 0 J (no refresh between them) or a whole refresh's, and a 250 ms
job's 15-32% low (its last refresh before the stop missed the job's end). So each edge waits for the counter to
move after the call (docs/daemon.md, "Tag windows and the counter's refresh"):

- the start edge is the counter read that saw every GPU's counter refreshed twice after the start call: the client
  waits for the answer before its work begins, so the window begins there; what its values hold of the time between
  the last refresh and the read (a poll, or a busy host's wait) is taken out at the power over the refresh before
  (`start_trim_j`);
- the stop edge is the counter read that saw every GPU's counter refreshed after the stop call; what the GPUs drew
  between the stop call and that read's counter values is taken out of the window's energy (`StopEdge.trim_j`), at
  the power each counter shows over its next refresh (the GPU after the client's work: the instant the refresh came
  is known to within a poll, the power after it only from the next one).

Each refresh is dated between the reads around it: where a loaded host spaced those reads out (10-100 ms beside CPU
hogs), the date is that far off and the edge's energy by the power there times it (`start_misdated_j`,
`stop_misdated_j`): a window where that may exceed `MISDATED_MAX_SHARE` of its energy and `MISDATED_MAX_J` says so
(`TAG_LATE_FLAG`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from powerprof.storage.schema import TAG_LATE_FLAG, TAG_UNHELD_FLAG  # noqa: F401 (the ledger's notes say them)

# Between counter reads while waiting for a refresh: a refresh is dated to within this (half of it, at the midpoint
# of the reads around it). A real H200's read costs ~2.6 ms of CPU (docs/hardware.md): this is at most a few
# hundred reads a window's edge, and tags are opened by hand or by a benchmark's harness, not per request.
POLL_S = 0.002
# The coarsest counter refresh is 100 ms (COUNTER_STEP_S): a counter that has not moved in this long is stalled, and
# the edge is taken as it was (its row says it was not held).
HOLD_MAX_S = 0.3


@dataclass
class Refresh:
    """One GPU's counter refresh seen by polling: the new value (J) and when it came (monotonic ns, the middle of the
    last read still showing the old value and the first showing the new one), and how far off that date may be (ns:
    the refresh came between the start of the one read's driver call and the end of the other's; 1-2 ms at
    `POLL_S`, tens of ms where a loaded host starved the poll)."""

    at_ns: int
    value_j: float
    off_ns: int = 0
    # the start of the driver call of the last read `wait_refresh` saw still at this value (a next refresh came after)
    seen_lo_ns: int = 0


def wait_refresh(read: Callable, values_j, after_ns, clock_ns: Callable[[], int] = time.monotonic_ns,
                 sleep: Callable[[float], None] = time.sleep, hold_max_s: float = HOLD_MAX_S,
                 after_lo_ns=None) -> tuple[list[Refresh], tuple] | None:
    """Poll `read()` ((monotonic ns, wall ns, a `collectors.nvml.CounterRead` or None), as `Sampler.read_with` gives)
    until every GPU's counter differs from `values_j` (per GPU, J, last read at `after_ns`): each GPU's first new
    value and the instant it came, and the read that saw the last of them (the edge: every counter in it fresh).
    `after_lo_ns`: per GPU, the start of that last read's driver call (`call_start`, `still_from`; a refresh may have
    come right after it, a loaded host's stall inside the call makes it tens of ms before `after_ns`).
    None where a read failed or some counter did not move within `hold_max_s`."""
    n = len(values_j)
    # the last read still old: its instant, its call's start
    last_ns, last_lo = list(after_ns), list(after_ns if after_lo_ns is None else after_lo_ns)
    got: list[Refresh | None] = [None] * n
    deadline = clock_ns() + int(hold_max_s * 1e9)
    while clock_ns() < deadline:
        sleep(POLL_S)
        whole = read()
        r = whole[2]
        if r is None or len(r) != n:
            return None
        at = r.t_mono_ns if len(getattr(r, "t_mono_ns", ())) == n else (whole[0],) * n
        half = r.t_half_ns if len(getattr(r, "t_half_ns", ())) == n else (0,) * n
        for k in range(n):
            if got[k] is not None:
                if r[k] == got[k].value_j:
                    got[k].seen_lo_ns = at[k] - half[k]
                continue
            if r[k] != values_j[k]:
                mid = (last_ns[k] + at[k]) // 2
                got[k] = Refresh(mid, float(r[k]), max(mid - last_lo[k], at[k] + half[k] - mid), at[k] - half[k])
            else:
                last_ns[k], last_lo[k] = at[k], at[k] - half[k]
        if all(g is not None for g in got):
            return got, whole  # type: ignore[return-value]
    return None


@dataclass
class StopEdge:
    """What a held edge takes out of its window: per GPU, the energy (J) its counter values hold from outside the
    window (a start's: before its read; a stop's: between the stop call and its read), how long a stop's edge was
    held after the call (s), and how far the edge's energy may be off where its refreshes were dated late reads
    apart (`start_misdated_j`, `stop_misdated_j`)."""

    trim_j: tuple
    held_s: float
    misdated_j: tuple = ()  # per GPU, J: how far its refreshes' dates being off (Refresh.off_ns) may move the edge
    off_ms: float = 0.0  # the largest of those (ms)


def start_trim_j(first: list[Refresh], second: list[Refresh], edge: tuple) -> tuple:
    """Per GPU, J: what the held start edge's read (`edge`: (ns, wall ns, CounterRead)) holds of the time before its
    own instant: its value is the counter's at the last refresh (`second`), the read a poll or a busy host's wait
    later, the GPU then at the power over the refresh before (`first` → `second`: the client still waiting). 0 for a
    GPU whose counter moved again before the read (several GPUs at other phases)."""
    out = []
    for r1, r2, e, at in zip(first, second, edge[2], edge[2].t_mono_ns):
        span_ns = r2.at_ns - r1.at_ns
        if e != r2.value_j or span_ns <= 0:
            out.append(0.0)
            continue
        out.append(max((r2.value_j - r1.value_j) * max(at - r2.at_ns, 0) / span_ns, 0.0))
    return tuple(out)


def stop_trim_j(stop_ns, before_j, first: list[Refresh], second: list[Refresh], edge_j) -> tuple:
    """Per GPU, J: the edge's counter value (`edge_j`) less the counter's value at the stop call, that value placed
    back from the first refresh after the call at the power over the next one (`second`), and kept between the value
    read at the call (`before_j`) and the first refresh's: the GPU ran the window's work before the call, not after."""
    out = []
    for k, (t_stop, e0, r1, r2, e_edge) in enumerate(zip(stop_ns, before_j, first, second, edge_j)):
        span_ns = r2.at_ns - r1.at_ns
        after_w = (r2.value_j - r1.value_j) / (span_ns / 1e9) if span_ns > 0 else 0.0
        at_stop = r1.value_j - after_w * max(r1.at_ns - t_stop, 0) / 1e9
        at_stop = min(max(at_stop, e0), r1.value_j)
        out.append(max(float(e_edge) - at_stop, 0.0))
    return tuple(out)


def _misdated_j(r1: Refresh, r2: Refresh, off_ns: int, lever_ns: int) -> float:
    """J: how far a counter value placed `lever_ns` from a refresh dated to within `off_ns` (`r1` or `r2`), at the
    power over `r1` → `r2`, may be off: the power there times that date's error, and the power's own error (its
    span off by both dates, at most) over the lever. The GPU's power taken as steady over them; infinite where the
    dates' errors could span the whole refresh (no bound on that power)."""
    most_w = _most_w(r1, r2)
    if math.isinf(most_w):
        return math.inf
    power_w = max(r2.value_j - r1.value_j, 0.0) / ((r2.at_ns - r1.at_ns) / 1e9)
    return (most_w * off_ns + (most_w - power_w) * max(lever_ns, 0)) / 1e9


def _most_w(r1: Refresh, r2: Refresh) -> float:
    """W: the most the power over `r1` → `r2` may be, their span short by both dates' errors; infinite where those
    could span it whole."""
    span_ns = r2.at_ns - r1.at_ns - r1.off_ns - r2.off_ns
    return max(r2.value_j - r1.value_j, 0.0) / (span_ns / 1e9) if span_ns > 0 else math.inf


def start_misdated_j(first: list[Refresh], second: list[Refresh], edge: tuple) -> tuple:
    """Per GPU, J: how far the held start edge's energy (the counter's value at its refresh `second`, plus
    `start_trim_j`'s power up to the edge's read) may be off where its refreshes are dated only to within their
    `off_ns`. Where the counter moved again before the edge's read (several GPUs at other phases: `start_trim_j` takes
    nothing out), the edge's value is a later refresh's and misses what came between it and the read: at most the
    power over `first` → `second` (at its most) from the last read still at `second` (its call's start) to the edge's
    call's end."""
    out = []
    half = edge[2].t_half_ns if len(getattr(edge[2], "t_half_ns", ())) == len(edge[2]) else (0,) * len(edge[2])
    for r1, r2, e, at, h in zip(first, second, edge[2], edge[2].t_mono_ns, half):
        if r2.at_ns <= r1.at_ns:
            out.append(0.0)
        elif e == r2.value_j:
            out.append(_misdated_j(r1, r2, r2.off_ns, at - r2.at_ns))
        else:
            most_w = _most_w(r1, r2)
            out.append(most_w * max(at + h - r2.seen_lo_ns, 0) / 1e9 if not math.isinf(most_w) else math.inf)
    return tuple(out)


def stop_misdated_j(stop_ns, before_j, first: list[Refresh], second: list[Refresh]) -> tuple:
    """Per GPU, J: how far `stop_trim_j`'s counter value at the stop call (placed back from the first refresh after
    the call at the power over the next) may be off where those refreshes are dated only to within their `off_ns`;
    at most what came between the value read at the call and that refresh (the value is kept between them), and all of
    that where the counter stalled after the first refresh (no power over the next one: the refresh's value kept)."""
    out = []
    for t_stop, e0, r1, r2 in zip(stop_ns, before_j, first, second):
        misdated_j = _misdated_j(r1, r2, r1.off_ns, r1.at_ns - t_stop) if r2.at_ns > r1.at_ns else math.inf
        out.append(min(misdated_j, max(r1.value_j - float(e0), 0.0)))
    return tuple(out)


def off_ms(*refreshes: list[Refresh]) -> float:
    """The largest date error of these refreshes (ms)."""
    return max((r.off_ns for rs in refreshes for r in rs), default=0) / 1e6


# A tag row's energy_note where its held edges' refreshes were dated too loosely for its figure (ledger._tag_note):
# where what that may move it by is over this share of the least its GPU energy may be and over MISDATED_MAX_J. The tolerance the
# tag windows' energy is held to against the simulator's truth (tests/test_daemon_tag_note.py).
MISDATED_MAX_SHARE = 0.25
MISDATED_MAX_J = 3.0
TAG_LATE_FIX = ("CPU to spare for the daemon (other processes kept its counter polls waiting: a less loaded host, or "
                "the daemon at a higher priority), or a longer window (the error is joules at each edge, not a "
                "percentage of the window)")


# A tag row's energy_note where its edges could not be held past a refresh (ledger._tag_note).
TAG_UNHELD_FIX = ("a window of at least a second (a counter one refresh stale at each edge is then a few percent), "
                  "and the log's NVML errors (a stalled counter)")


def still_at(edge: tuple, fresh: list[Refresh]) -> list[int]:
    """Per GPU, the last instant its counter was seen at its refresh `fresh`: the edge's read where it still shows that
    value (the next refresh came after it), else the refresh itself."""
    return [t if e == f.value_j else f.at_ns for t, e, f in zip(edge[2].t_mono_ns, edge[2], fresh)]


def call_start(counters) -> list[int]:
    """Per GPU, the start of a `CounterRead`'s driver call (monotonic ns): its instant less half the call's length."""
    half = counters.t_half_ns if len(getattr(counters, "t_half_ns", ())) == len(counters) else (0,) * len(counters)
    return [t - h for t, h in zip(counters.t_mono_ns, half)]


def still_from(edge: tuple, fresh: list[Refresh]) -> list[int]:
    """`still_at`'s read, as its driver call's start (`wait_refresh`'s `after_lo_ns`): the edge's call where it still
    shows `fresh`, else the earliest the refresh `fresh` may have come (the counter moved again after it)."""
    return [lo if e == f.value_j else f.at_ns - f.off_ns for lo, e, f in zip(call_start(edge[2]), edge[2], fresh)]
