"""Decode windows: pure functions over token arrival times (monotonic ns) and token counts.

One request: its decode window runs from the first read that carried generated tokens (the
first comes out of prefill) to the last read; it holds the tokens that arrived after the first
read (generated − 1 when tokens come one per read).

Concurrent requests: the measured intervals are those where at least one request is decoding
and none is in prefill (nor in an attempt whose phase is unknown). Aggregate throughput =
decode tokens arriving inside them ÷ their total wall-clock length, never the sum of
per-request rates. The intervals come back as (t0_ns, t1_ns) rows so that energy can be
taken over exactly the same time, with the most and the mean (time-weighted) of the requests
decoding at once inside them: the concurrency the batch achieved, which a stream sent late lowers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from powerprof.arrival import arrival_quality, reads


@dataclass(frozen=True)
class DecodeWindow:
    t_first_ns: int | None
    t_last_ns: int | None
    generated_tokens: int
    decode_tokens: int  # tokens after the first read: generated − 1 when tokens come one per read
    decode_s: float | None
    decode_tok_s: float | None  # None when the window is empty (fewer than two tokens or zero length)


def decode_window(arrival_ns: np.ndarray, tokens: np.ndarray, generated: int | None = None) -> DecodeWindow:
    """Decode window of one request from its token-bearing events.

    It runs from the first read that carried tokens to the last; its tokens are those that
    arrived after the first read (the first read's came out of prefill, or were produced before
    it and held back: either way not inside the window). `generated` is the server's own total
    (usage, timings) when it gave one; tokens it counted that the stream never showed are taken
    to have come with the last read.
    """
    q = arrival_quality(arrival_ns, tokens, generated)
    n = q.window_tokens
    gen = int(np.asarray(tokens, dtype=np.int64).sum()) if generated is None else int(generated)
    if q.t_first_ns is None:
        return DecodeWindow(None, None, gen, max(gen - 1, 0), None, None)
    dur_s = (q.t_last_ns - q.t_first_ns) / 1e9
    rate = n / dur_s if n > 0 and dur_s > 0 else None
    return DecodeWindow(q.t_first_ns, q.t_last_ns, gen, n, dur_s, rate)


def decode_arrivals(arrival_ns: np.ndarray, tokens: np.ndarray, generated: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times and token counts of one request's decode tokens only (per read).

    Drops the first read (its tokens come out of prefill or before the window). When the
    server's total differs from the counted one, counts are scaled so that they add up to the
    server's total less the first read.
    """
    t, k, _ = reads(arrival_ns, tokens)
    k = k.astype(float)
    if k.size == 0:
        return t, k
    first = k[0]
    k[0] = 0.0
    counted = k.sum()
    if generated is not None and counted > 0 and generated - first != counted:
        k *= max(generated - first, 0) / counted
    return t, k


def measured_intervals(
    t_send_ns: Sequence[int],
    t_first_ns: Sequence[int],
    t_last_ns: Sequence[int],
    blocked: Sequence[tuple[int, int]] = (),
) -> np.ndarray:
    """Intervals (k × 2 int64, t0_ns, t1_ns) where someone decodes and nobody is in prefill.

    Request i is in prefill over [t_send_i, t_first_i) and decoding over [t_first_i, t_last_i].
    `blocked` are extra spans that disqualify time (failed attempts: what the server did for
    them is unknown).
    """
    send = np.asarray(t_send_ns, dtype=np.int64)
    first = np.asarray(t_first_ns, dtype=np.int64)
    last = np.asarray(t_last_ns, dtype=np.int64)
    blk = np.asarray(list(blocked), dtype=np.int64).reshape(-1, 2)
    if first.size == 0:
        return np.empty((0, 2), dtype=np.int64)
    edges = np.unique(np.concatenate([send, first, last, blk.ravel()]))
    if edges.size < 2:
        return np.empty((0, 2), dtype=np.int64)
    a, b = edges[:-1], edges[1:]
    # Elementary segments between consecutive edges have constant state: test each one.
    decoding = ((first[None, :] <= a[:, None]) & (b[:, None] <= last[None, :])).any(axis=1)
    prefill = ((send[None, :] < b[:, None]) & (a[:, None] < first[None, :])).any(axis=1)
    if blk.size:
        prefill |= ((blk[None, :, 0] < b[:, None]) & (a[:, None] < blk[None, :, 1])).any(axis=1)
    ok = decoding & ~prefill
    if not ok.any():
        return np.empty((0, 2), dtype=np.int64)
    # Merge runs of adjacent good segments.
    idx = np.flatnonzero(ok)
    breaks = np.flatnonzero(np.diff(idx) > 1)
    starts = np.concatenate([[idx[0]], idx[breaks + 1]])
    ends = np.concatenate([idx[breaks], [idx[-1]]])
    return np.stack([a[starts], b[ends]], axis=1).astype(np.int64)


def tokens_in_intervals(arrival_ns: np.ndarray, tokens: np.ndarray, intervals: np.ndarray) -> float:
    """Tokens whose arrival falls in (t0, t1] of any interval.

    Half-open on the left: an interval starts when the last prefill ends, at the arrival of a
    first token, which belongs to prefill.
    """
    t = np.asarray(arrival_ns, dtype=np.int64)
    k = np.asarray(tokens, dtype=float)
    iv = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    if t.size == 0 or iv.size == 0:
        return 0.0
    lo = np.searchsorted(t, iv[:, 0], side="right")
    hi = np.searchsorted(t, iv[:, 1], side="right")
    csum = np.concatenate([[0.0], np.cumsum(k)])
    return float((csum[hi] - csum[lo]).sum())


@dataclass(frozen=True)
class Aggregate:
    intervals: np.ndarray  # (k, 2) int64 t0_ns, t1_ns
    measured_s: float
    decode_tokens: float  # decode tokens that arrived inside the intervals
    tok_s: float | None  # decode_tokens / measured_s
    # The most streams decoding at one instant inside the intervals: fewer than were sent means the
    # server never ran them together (it queued them), so the figures are those of fewer streams.
    max_streams: int = 0
    # The time-weighted mean of streams decoding inside the intervals: the concurrency the batch achieved. Below
    # the streams sent when they decoded apart (one sent or started late, the rest decoding without it).
    mean_streams: float = 0.0
    # The same mean over the intervals up to the first stream's end: the concurrency its start achieved. Near the
    # streams sent while mean_streams is not, they started together and ended apart (stopped at different lengths).
    start_mean_streams: float = 0.0
    # [the last stream's first token, the first stream's last]: where every stream decodes (None: no such span).
    together_ns: tuple[int, int] | None = None


def _decoding_steps(t_first_ns: Sequence[int], t_last_ns: Sequence[int],
                    intervals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per elementary step inside the intervals: the requests decoding ([t_first, t_last]) and its length in ns."""
    first = np.asarray(t_first_ns, dtype=np.int64)
    last = np.asarray(t_last_ns, dtype=np.int64)
    iv = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    if first.size == 0 or iv.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    edges = np.unique(np.concatenate([first, last, iv.ravel()]))
    a, b = edges[:-1], edges[1:]
    inside = ((iv[None, :, 0] <= a[:, None]) & (b[:, None] <= iv[None, :, 1])).any(axis=1)
    n = ((first[None, :] <= a[:, None]) & (b[:, None] <= last[None, :])).sum(axis=1)
    return n[inside], (b - a)[inside]


def max_decoding(t_first_ns: Sequence[int], t_last_ns: Sequence[int], intervals: np.ndarray) -> int:
    """The most requests decoding ([t_first, t_last]) at one instant inside the intervals."""
    n, _ = _decoding_steps(t_first_ns, t_last_ns, intervals)
    return int(n.max()) if n.size else 0


def mean_decoding(t_first_ns: Sequence[int], t_last_ns: Sequence[int], intervals: np.ndarray) -> float:
    """The time-weighted mean of requests decoding ([t_first, t_last]) inside the intervals (0 when they are empty)."""
    n, dur_ns = _decoding_steps(t_first_ns, t_last_ns, intervals)
    dur = dur_ns.astype(float)
    return float((n * dur).sum() / dur.sum()) if dur.sum() > 0 else 0.0


def clip_intervals(intervals: np.ndarray, t0_ns: int, t1_ns: int) -> np.ndarray:
    """The parts of the intervals inside [t0_ns, t1_ns] (empty ones dropped)."""
    iv = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
    out = np.stack([np.maximum(iv[:, 0], t0_ns), np.minimum(iv[:, 1], t1_ns)], axis=1) if iv.size else iv
    return out[out[:, 1] > out[:, 0]].astype(np.int64)


def concurrent_throughput(
    requests: Sequence[tuple[int, np.ndarray, np.ndarray, int | None]],
    blocked: Sequence[tuple[int, int]] = (),
    within: tuple[int, int] | None = None,
    min_interval_ns: int = 0,
) -> Aggregate:
    """Wall-clock aggregate decode throughput of requests that ran at the same time.

    `requests`: (t_send_ns, arrival_ns, tokens, generated or None) for each successful request.
    `within`: measure only the part of the intervals inside this span (t0_ns, t1_ns), such as `together_ns`.
    `min_interval_ns`: leave out intervals shorter than this (a piece between a late stream's prefill or a blocked
    span and the rest, shorter than the energy counter's refresh: no reading resolves its energy), where a longer
    one remains; chosen by length, so tokens, time and energy all leave the same pieces out.
    """
    sends, firsts, lasts, ts, ks = [], [], [], [], []
    for t_send, arr, tok, gen in requests:
        t, k = decode_arrivals(arr, tok, gen)
        arr = np.asarray(arr, dtype=np.int64)[np.asarray(tok) > 0]
        if arr.size == 0:
            continue
        sends.append(int(t_send))
        firsts.append(int(arr[0]))
        lasts.append(int(arr[-1]))
        ts.append(t)
        ks.append(k)
    iv = measured_intervals(sends, firsts, lasts, blocked)
    if within is not None:
        iv = clip_intervals(iv, *within)
    if min_interval_ns > 0 and iv.size:
        long_ = iv[iv[:, 1] - iv[:, 0] >= min_interval_ns]
        iv = long_ if long_.size else iv
    if not ts:
        return Aggregate(iv, 0.0, 0.0, None, 0, 0.0)
    t_all = np.concatenate(ts)
    k_all = np.concatenate(ks)
    order = np.argsort(t_all, kind="stable")
    n = tokens_in_intervals(t_all[order], k_all[order], iv)
    dur_s = float((iv[:, 1] - iv[:, 0]).sum()) / 1e9 if iv.size else 0.0
    together = (max(firsts), min(lasts)) if max(firsts) < min(lasts) else None
    return Aggregate(iv, dur_s, n, n / dur_s if dur_s > 0 else None, max_decoding(firsts, lasts, iv),
                     mean_decoding(firsts, lasts, iv),
                     mean_decoding(firsts, lasts, clip_intervals(iv, min(firsts), min(lasts))), together)

