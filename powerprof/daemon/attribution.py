"""Energy attribution: pure functions splitting each sample interval's energy among live requests by their work.

An interval is the time between two consecutive GPU samples. Every joule goes to exactly one of
three places, so requests + idle + unproxied = total:

- the requests live in it (arrival → end of response), in proportion to their work there: prompt
  tokens prefilled (just before the first token, not over a queue wait), tokens decoded, the
  context those tokens were decoded at, and a share of the engine's per-step cost (`WorkCosts`,
  learned online by `daemon.workmodel`);
- unproxied: tokens the server counted beyond the proxy's (bypass traffic), at the cost of an
  average proxied token of the same interval;
- idle: the part of the interval no request was live in, at the idle power; a whole interval
  with nothing live.

Each interval also gets a kind, a label only: prefill (some request was prefilling: mixed
batches), decode, unproxied (only bypass traffic), idle.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

import numpy as np

from powerprof.energy import instant_power_energy_j

IDLE, DECODE, PREFILL, UNPROXIED = 0, 1, 2, 3
KIND_NAMES = ("idle", "decode", "prefill", "unproxied")

# "Not happened yet" for an int64 nanosecond timestamp.
NEVER = np.iinfo(np.int64).max


# Where a joule went (Attribution.by_dest columns).
TO_REQUESTS, TO_IDLE, TO_UNPROXIED = 0, 1, 2
DEST_NAMES = ("requests", "idle", "unproxied")

# Until the fit is mature: a prompt token costs this fraction of a decode token. Prefill runs
# tens to hundreds of prompt tokens per second for every decode token of a single stream
# (compute-bound matmuls over the whole prompt against one weight read per decode step), so
# 1/20 is in the range of common servers and cards; `workmodel` replaces it with the fit.
DEFAULT_PREFILL_PER_DECODE = 0.05
# Until the fit is mature: a prompt is prefilled at this many tokens a second, just before its
# first token (common servers and cards prefill thousands to tens of thousands a second); with
# a fit, `workmodel` derives the rate from the fitted prompt-token cost and the busy power.
DEFAULT_PREFILL_TOK_S = 10_000.0
# The slow end of that range: a prompt placed this slowly may reach intervals the rate in use leaves to the requests
# beside it, so their split there rests on the rate (Attribution.ratio_split), not only on who did work at it.
PREFILL_TOK_S_SLOW = 1_000.0
# The range the fixed ratio stands for ("tens to hundreds of prompt tokens per decode step"): until the fit is mature a
# request's least and most share of an interval the ratio split is given over it, each prompt placed at any rate from
# the slow end to the one in use (Attribution.share_lo, share_hi), so a row can say how far its figure rests on the
# ratio, whichever way.
PREFILL_PER_DECODE_RANGE = (0.01, 0.1)


@dataclass(frozen=True)
class WorkCosts:
    """Energy per unit of work. step_j: the engine's per-step cost (shared by the sequences in the
    step); decode_j: per decoded token; prefill_j: per prompt token; ctx_j: per decoded token per
    token of context. idle_w: idle power (None: unknown, so no part of a busy interval is idle)."""

    step_j: float = 0.0
    decode_j: float = 1.0
    prefill_j: float = DEFAULT_PREFILL_PER_DECODE
    ctx_j: float = 0.0
    idle_w: float | None = None
    prefill_tok_s: float = DEFAULT_PREFILL_TOK_S  # how fast a prompt is prefilled (where it is placed)
    source: str = "fixed"  # fixed (the documented ratio) | fitted
    # The fit's (step_j, decode_j, prefill_j, ctx_j) at its context cost's band's two ends (workmodel.ctx_band): the
    # split at each is what each request's figure would be there (Attribution.band_j); () none.
    ctx_band: tuple = ()


@dataclass(frozen=True)
class Attribution:
    kind: np.ndarray  # (K,) IDLE | DECODE | PREFILL | UNPROXIED (a label)
    tokens: np.ndarray  # (K,) proxied tokens produced in each interval
    n_prefill: np.ndarray  # (K,) requests in prefill in each interval
    n_decoding: np.ndarray  # (K,) requests decoding in each interval
    request_energy: np.ndarray  # (R, C) energy given to each request, per energy column
    request_tokens: np.ndarray  # (R,) each request's tokens (all of them: every token is attributed)
    by_kind: np.ndarray  # (4, C) total energy per interval kind
    dest: np.ndarray  # (K, 3, C) each interval's energy to requests, idle, unproxied
    features: np.ndarray  # (K, 5) duration_s, steps, tokens (bypass included), prefill tokens, context·tokens/1000
    # (K,) intervals whose split rests on the costs' ratios: two or more requests did work there, or one did beside
    # bypass work (a request alone takes the interval's work whatever they are; requests only live there, queued,
    # share by live time, unless a prompt the slow rate places there would take it). A prompt counts as work where it
    # would be placed at PREFILL_TOK_S_SLOW too: which intervals a queued request's prefill reaches rests on the rate.
    # (R, K): each request's share of each interval's energy.
    ratio_split: np.ndarray | None = None
    # (R, 2) each request's energy (the first column) split at the two ends of costs.ctx_band; None where it has none.
    band_j: np.ndarray | None = None
    share: np.ndarray | None = None
    # (R, K) the least and the most of each interval's energy each request takes over the range (a prompt token
    # PREFILL_PER_DECODE_RANGE of a decoded token, prefilled at any rate from PREFILL_TOK_S_SLOW to the one in use),
    # `share` among them; where no interval is ratio_split, or the costs are fitted, both are `share`.
    share_lo: np.ndarray | None = None
    share_hi: np.ndarray | None = None

    @property
    def total(self) -> np.ndarray:
        return self.by_kind.sum(axis=0)

    @property
    def by_dest(self) -> np.ndarray:
        """(3, C): requests, idle, unproxied."""
        return self.dest.sum(axis=0)


def interval_tokens(edges_ns: np.ndarray, tok_t_ns: np.ndarray, tok_req: np.ndarray, tok_n: np.ndarray,
                    n_requests: int) -> np.ndarray:
    """(R, K) tokens of each request in each interval [edges[k], edges[k+1]); outside tokens dropped."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    k_count = max(edges.size - 1, 0)
    out = np.zeros((n_requests, k_count))
    t = np.asarray(tok_t_ns, dtype=np.int64)
    if t.size == 0 or k_count == 0:
        return out
    k = np.searchsorted(edges, t, side="right") - 1
    inside = (k >= 0) & (k < k_count)
    np.add.at(out, (np.asarray(tok_req)[inside], k[inside]), np.asarray(tok_n, dtype=float)[inside])
    return out


def overlaps(edges_ns: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray, closed_end: bool) -> np.ndarray:
    """(R, K) whether span r overlaps interval k; a span [s, e) or [s, e] against [a, b)."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    a, b = edges[:-1][None, :], edges[1:][None, :]
    s = np.asarray(start_ns, dtype=np.int64)[:, None]
    e = np.asarray(end_ns, dtype=np.int64)[:, None]
    after_start = (e >= a) if closed_end else (e > a)
    return (s < b) & after_start & (s < e if not closed_end else s <= e)


def span_overlap_s(edges_ns: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray) -> np.ndarray:
    """(R, K) seconds of span r [s, e) inside interval k."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    a, b = edges[:-1][None, :], edges[1:][None, :]
    s = np.asarray(start_ns, dtype=np.int64)[:, None]
    e = np.asarray(end_ns, dtype=np.int64)[:, None]
    return np.clip(np.minimum(e, b) - np.maximum(s, a), 0, None) / 1e9


def union_busy_s(edges_ns: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray) -> np.ndarray:
    """(K,) seconds of each interval covered by at least one span [s, e)."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    out = np.zeros(max(edges.size - 1, 0))
    s = np.asarray(start_ns, dtype=np.int64)
    e = np.minimum(np.asarray(end_ns, dtype=np.int64), edges[-1] if edges.size else 0)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0 or out.size == 0:
        return out
    order = np.argsort(s)
    s, e = s[order], e[order]
    merged = []
    cs, ce = int(s[0]), int(e[0])
    for a, b in zip(s[1:], e[1:]):
        if a <= ce:
            ce = max(ce, int(b))
        else:
            merged.append((cs, ce))
            cs, ce = int(a), int(b)
    merged.append((cs, ce))
    m = np.array(merged, dtype=np.int64)
    return span_overlap_s(edges, m[:, 0], m[:, 1]).sum(axis=0)


def busy_seconds(edges_ns: np.ndarray, arrival_ns: np.ndarray, end_ns: np.ndarray, active: np.ndarray,
                 bypass_spans: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """(K,) seconds of each interval some active request (arrival → end, NEVER: still live) or bypass traffic
    was live in: the rest of a busy interval is idle."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    arrival = np.asarray(arrival_ns, dtype=np.int64)
    end = np.asarray(end_ns, dtype=np.int64)
    active = np.asarray(active, dtype=bool)
    b0, b1 = (np.zeros(0, np.int64),) * 2 if bypass_spans is None else (np.asarray(x, np.int64) for x in bypass_spans)
    starts = np.concatenate([arrival[active], b0])
    if not starts.size:
        return np.zeros(max(edges.size - 1, 0))
    return union_busy_s(edges, starts, np.concatenate([np.where(end != NEVER, end, edges[-1])[active], b1]))


def prefill_start_ns(arrival_ns: np.ndarray, prefill_end_ns: np.ndarray, prompt_tokens: np.ndarray,
                     prefill_tok_s: float) -> np.ndarray:
    """(R,) when each prompt's prefill began: its length at `prefill_tok_s` before the first token,
    never before arrival. A server runs a prompt in the steps just before that prompt's first
    token; the time before (a queue behind a full batch) is other requests' work."""
    arr = np.asarray(arrival_ns, dtype=np.int64)
    end = np.asarray(prefill_end_ns, dtype=np.int64)
    p = np.nan_to_num(np.asarray(prompt_tokens, dtype=float))
    d_ns = np.minimum(p / max(prefill_tok_s, 1e-9) * 1e9, 1e15).astype(np.int64)
    return np.where(end == NEVER, arr, np.maximum(arr, end - d_ns))


def _prefill_start(arr: np.ndarray, end: np.ndarray, p: np.ndarray, prefill_tok_s) -> np.ndarray:
    """Where a prompt of `p` tokens placed at prefill_tok_s before its prefill's end starts (not before its arrival)."""
    d_ns = np.minimum(p / np.maximum(np.asarray(prefill_tok_s, dtype=float), 1e-9) * 1e9, 1e15).astype(np.int64)
    return np.where(end == NEVER, arr, np.maximum(arr, end - d_ns))


def prefill_tokens_at(arrival_ns: np.ndarray, prefill_end_ns: np.ndarray, prompt_tokens: np.ndarray, a_ns: np.ndarray,
                      b_ns: np.ndarray, prefill_tok_s: np.ndarray) -> np.ndarray:
    """Prompt tokens a request prefills in the interval [a, b) with its prompt placed at prefill_tok_s, element by
    element (the arguments broadcast): `prefill_start_ns` and `prefill_tokens` for one interval and one rate each."""
    arr, end = np.asarray(arrival_ns, dtype=np.int64), np.asarray(prefill_end_ns, dtype=np.int64)
    a, b = np.asarray(a_ns, dtype=np.int64), np.asarray(b_ns, dtype=np.int64)
    p = np.nan_to_num(np.asarray(prompt_tokens, dtype=float))
    start = _prefill_start(arr, end, p, prefill_tok_s)
    span = (end - start) / 1e9
    frac = np.divide(np.clip(np.minimum(end, b) - np.maximum(start, a), 0, None) / 1e9, span,
                     out=np.zeros(np.shape(span)), where=span > 0)
    frac = np.where(span <= 0, ((end >= a) & (end < b)).astype(float), frac)  # all of it where its first token is
    return frac * p


class PlacedPrefill:
    """The prompt tokens requests prefill over [a, b), summed over all of them but one (`beside`), where a prompt may be
    changed between the sums (`replace`): what `prefill_tokens_at` summed over the others gives, in O(log n) a sum, not
    O(n). Each request's tokens over time are a line from its prefill's start to its end (all at once at its end where
    the two coincide); their sum up to t is a piecewise-linear F(t), and [a, b) holds F(b) - F(a). The prompts as
    first given are summed once, sorted; a changed prompt is a difference kept in Fenwick trees over the instants
    `at_ns` the sums are asked at (only those). Equal to the direct sum but for float rounding."""

    def __init__(self, arrival_ns, prefill_end_ns, prompt_tokens, prefill_tok_s: float, at_ns):
        self._arr = np.asarray(arrival_ns, dtype=np.int64)
        self._end = np.asarray(prefill_end_ns, dtype=np.int64)
        self._p = np.nan_to_num(np.asarray(prompt_tokens, dtype=float)).copy()
        self._rate = float(prefill_tok_s)
        self._q = np.unique(np.asarray(at_ns, dtype=np.int64))
        self._o = int(self._q[0]) if self._q.size else 0  # times relative to the first instant asked: less cancellation
        self._k = {int(x): k for k, x in enumerate(self._q)}
        x = self._rel(self._q)
        start, end, r, pt = self._pieces(self._arr, self._end, self._p)
        # F at every instant asked, of the prompts as given: every prompt whole once its prefill ended before it, and
        # the lines under way then, Σ r·(x - s) as x·Σr - Σr·s (a line ended counted whole, not as r·(e - s) out of
        # sums over all of them: those cancel, to 1e-5 of a token over a minute of requests).
        order = np.argsort(end, kind="stable")
        cp = np.concatenate(([0.0], np.cumsum(self._p[order])))
        f = cp[np.searchsorted(end[order], self._q, side="left")]
        line = r != 0
        rs = r[line] * self._rel(start[line])
        for edge, sign in ((start[line], 1.0), (end[line], -1.0)):
            order = np.argsort(edge, kind="stable")
            cr = np.concatenate(([0.0], np.cumsum(r[line][order])))
            crs = np.concatenate(([0.0], np.cumsum(rs[order])))
            k = np.searchsorted(edge[order], self._q, side="left")
            f = f + sign * (x * cr[k] - crs[k])
        self._f = f
        self._ql = self._q.tolist()
        self._tree = [[0.0] * 3 for _ in self._ql]  # Fenwick nodes of the changes: Σr, Σr·s of lines; Σ whole prompts

    def _rel(self, t_ns) -> np.ndarray:
        return (np.asarray(t_ns, dtype=np.int64) - self._o).astype(float)

    def _pieces(self, arr, end, p):
        """(start ns, end ns, tokens a ns of a line or 0, tokens placed at one instant or 0), as prefill_tokens_at."""
        start = _prefill_start(arr, end, p, self._rate)
        span_ns = (end - start).astype(float)
        r = np.divide(p, span_ns, out=np.zeros(np.shape(p)), where=span_ns > 0)
        return start, end, r, np.where(span_ns > 0, 0.0, p)

    def _start(self, i: int, p: float) -> int:
        """_prefill_start of request i with a prompt of p tokens, in Python's ints and floats (one request: numpy's
        overhead was most of the time); the same arithmetic, truncation toward zero included."""
        arr, end = int(self._arr[i]), int(self._end[i])
        if end == NEVER:
            return arr
        return max(arr, end - int(min(p / max(self._rate, 1e-9) * 1e9, 1e15)))

    def _own(self, i: int, a_ns: int, b_ns: int) -> float:
        """prefill_tokens_at of request i alone over [a, b)."""
        p, end = float(self._p[i]), int(self._end[i])
        start = self._start(i, p)
        span = (end - start) / 1e9
        if span <= 0:
            return p if a_ns <= end < b_ns else 0.0
        return max(min(end, b_ns) - max(start, a_ns), 0) / 1e9 / span * p

    def _add(self, t_ns: int, w: tuple) -> None:
        """Weights w (Σr, Σr·s of lines, Σ whole prompts) at instant t: counted at every instant asked after it."""
        tr, n = self._tree, len(self._ql)
        k = bisect.bisect_right(self._ql, t_ns) + 1  # 1-based: the first instant asked after t
        while k <= n:
            node = tr[k - 1]
            for j, x in enumerate(w):
                if x:
                    node[j] += x
            k += k & -k

    def _f_at(self, t_ns: int) -> float:
        k, tr = self._k[t_ns] + 1, self._tree
        s0 = s1 = s2 = 0.0
        while k > 0:
            node = tr[k - 1]
            s0 += node[0]
            s1 += node[1]
            s2 += node[2]
            k -= k & -k
        return float(self._f[self._k[t_ns]]) + float(t_ns - self._o) * s0 - s1 + s2

    def beside(self, i: int, a_ns: int, b_ns: int) -> float:
        """Prompt tokens the requests other than `i` prefill over [a, b) (a and b among `at_ns`)."""
        if b_ns <= a_ns:
            return 0.0
        return max(self._f_at(b_ns) - self._f_at(a_ns) - self._own(i, a_ns, b_ns), 0.0)  # each term >= 0: rounding

    def replace(self, i: int, prompt_tokens: float) -> None:
        """Request i's prompt is `prompt_tokens` now."""
        new = float(np.nan_to_num(prompt_tokens))
        if new == self._p[i]:
            return
        end = int(self._end[i])
        for p, w in ((float(self._p[i]), -1.0), (new, 1.0)):
            start = self._start(i, p)
            if end - start > 0:
                r = p / float(end - start)
                rs = r * float(start - self._o)
                self._add(start, (w * r, w * rs, 0.0))
                self._add(end, (-w * r, -w * rs, w * p))
            else:
                self._add(end, (0.0, 0.0, w * p))
        self._p[i] = new


def prefill_tokens(edges_ns: np.ndarray, start_ns: np.ndarray, prefill_end_ns: np.ndarray,
                   prompt_tokens: np.ndarray) -> np.ndarray:
    """(R, K) prompt tokens prefilled in each interval: spread evenly over start → first token
    (all of it in the interval of the first token when the two coincide). Only the intervals
    given get their part: a span running past the last edge keeps the rest for later ones."""
    edges = np.asarray(edges_ns, dtype=np.int64)
    arr = np.asarray(start_ns, dtype=np.int64)
    end = np.asarray(prefill_end_ns, dtype=np.int64)
    p = np.nan_to_num(np.asarray(prompt_tokens, dtype=float))
    span = (end - arr) / 1e9
    frac = np.divide(span_overlap_s(edges, arr, end), span[:, None], out=np.zeros((arr.size, edges.size - 1)),
                     where=span[:, None] > 0)
    point = span <= 0
    if point.any():
        k = np.searchsorted(edges, end[point], side="right") - 1
        ok = (k >= 0) & (k < edges.size - 1)
        rows = np.flatnonzero(point)[ok]
        frac[rows, k[ok]] = 1.0
    return frac * p[:, None]


def request_work(costs: WorkCosts, tok: np.ndarray, pre: np.ndarray, ctx: np.ndarray,
                 bypass: np.ndarray | None = None, sequences: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, K) each request's work (in joules at `costs`) in each interval, (K,) the bypass tokens'
    work, and (K,) the step counts.

    The per-step cost is shared by the requests in the steps: each interval's steps are estimated
    as the most tokens a sequence got there (a sequence decoding through the whole interval gets
    one per step; a request's tokens over its `sequences`, (R,): n choices × prompts, 1 where None),
    and split among the requests by their tokens (a request of two sequences is two in each step).
    A request still waiting for its first token takes no share: it may sit in a queue, outside the
    engine's steps.

    Bypass tokens (the server's beyond the proxy's) share the steps too, and cost what the proxied
    ones do on average for their prompts and context (which the proxy never saw)."""
    k_count = tok.shape[1]
    byp = np.zeros(k_count) if bypass is None else np.asarray(bypass, dtype=float)
    per_seq = tok if sequences is None else tok / np.maximum(np.asarray(sequences, dtype=float), 1.0)[:, None]
    steps = per_seq.max(axis=0) if tok.size else np.zeros(k_count)
    steps = np.where((steps == 0) & (byp > 0), 1.0, steps)  # bypass alone: at least one step ran
    part_sum = tok.sum(axis=0) + byp
    step_per_tok = np.divide(costs.step_j * steps, part_sum, out=np.zeros(k_count), where=part_sum > 0)
    own = costs.prefill_j * pre + costs.ctx_j * ctx
    work = step_per_tok[None, :] * tok + costs.decode_j * tok + own
    n_tok = tok.sum(axis=0)
    own_per_tok = np.divide(own.sum(axis=0), n_tok, out=np.zeros(k_count), where=n_tok > 0)
    bypass_work = byp * (step_per_tok + costs.decode_j + own_per_tok)
    return work, bypass_work, steps


def share_range(share: np.ndarray, ratio_split: np.ndarray, costs: WorkCosts, edges: np.ndarray, arrival: np.ndarray,
                prefill_end: np.ndarray, p_tok: np.ndarray, pre_slow: np.ndarray, tok_w: np.ndarray, ctx: np.ndarray,
                server: np.ndarray, sequences: np.ndarray | None, f_busy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, K) twice: each request's least and most share of each ratio-split interval over the range the fixed ratio
    stands for (a prompt token PREFILL_PER_DECODE_RANGE of a decoded token, prefilled at any rate from
    PREFILL_TOK_S_SLOW to the one in use); `share` elsewhere. Exact: checked against a brute-force grid of rates and
    ratios (tests/test_daemon_attribution.py)."""
    share_lo, share_hi = share.copy(), share.copy()
    r_count = share.shape[0]
    # Each ratio-split interval at the ratio's ends (at one rate a request's share moves one way between them) and
    # at the rates from the slow end to the one in use: between those at which a prompt reaching it starts at one
    # of its edges or at its arrival, every prompt's tokens there are linear in the rate, so each share moves one
    # way too: its least and most are at those rates or the range's ends (a rate between the ends can place more
    # of a prompt in an interval than either: 3162 tokens/s all of [1, 2) of a 6324-token prompt due at 3).
    v_lo, v_hi = min(PREFILL_TOK_S_SLOW, costs.prefill_tok_s), costs.prefill_tok_s
    cols = np.flatnonzero(ratio_split)
    n_c = cols.size
    # The prompts that reach each of them (placed at the slow end: every faster placement lies inside that one).
    e_c, e_j = np.nonzero(((pre_slow[:, cols] > 0) & (prefill_end != NEVER)[:, None]).T)  # entries, by column
    c_at, v_at = [np.repeat(np.arange(n_c), 2)], [np.tile([v_lo, v_hi], n_c)]
    for e in (edges[cols][e_c], edges[cols + 1][e_c], arrival[e_j]):
        gap = (prefill_end[e_j].astype(float) - e) / 1e9
        v = np.divide(p_tok[e_j], gap, out=np.zeros(gap.shape), where=gap > 0)
        ok = (v > v_lo) & (v < v_hi)
        c_at.append(e_c[ok]), v_at.append(v[ok])
    cv = np.unique(np.column_stack([np.concatenate(c_at), np.concatenate(v_at)]), axis=0)  # sorted by column
    m_c, m_v = cv[:, 0].astype(np.int64), cv[:, 1]
    m_first = np.searchsorted(m_c, np.arange(n_c))
    n_m = np.bincount(m_c, minlength=n_c)
    # Each entry (a prompt reaching a column) at each of its column's rates, entry by entry.
    p_e = np.repeat(np.arange(e_c.size), n_m[e_c])
    p_m = m_first[e_c][p_e] + np.arange(p_e.size) - (np.cumsum(n_m[e_c]) - n_m[e_c])[p_e]
    k_p = cols[e_c[p_e]]
    pre_p = prefill_tokens_at(arrival[e_j[p_e]], prefill_end[e_j[p_e]], p_tok[e_j[p_e]], edges[k_p], edges[k_p + 1],
                              m_v[p_m])
    pre_sum = np.bincount(p_m, weights=pre_p, minlength=m_c.size)  # (M,) the column's prompt tokens at the rate
    # request_work is linear in the prompt work: a request's own is prefill_j × its prompt tokens, a bypass token
    # costs the interval's prompt work per proxied token (tok_w) too, beside what it costs with none.
    w0, u0, _ = request_work(replace(costs, prefill_j=0.0), tok_w[:, cols], np.zeros((r_count, n_c)), ctx[:, cols],
                             server[cols], sequences)
    n_tok = tok_w[:, cols].sum(axis=0)
    per_pre = 1.0 + np.divide(server[cols], n_tok, out=np.zeros(n_c), where=n_tok > 0)
    fb = f_busy[cols]
    lo, hi = share[:, cols].copy(), share[:, cols].copy()
    e_lo, e_hi = share[e_j, cols[e_c]], share[e_j, cols[e_c]]
    e_first = np.cumsum(n_m[e_c]) - n_m[e_c]  # each entry's first pair (every column has its two ends at least)
    for ratio in PREFILL_PER_DECODE_RANGE:
        d = w0.sum(axis=0)[m_c] + u0[m_c] + ratio * per_pre[m_c] * pre_sum  # (M,)
        pos = d > 0  # a rate that places no work there (its only workers' prompts elsewhere) keeps its split
        d_max = np.maximum.reduceat(np.where(pos, d, -np.inf), m_first, axis=0)
        d_min = np.minimum.reduceat(np.where(pos, d, np.inf), m_first, axis=0)
        # A request of no prompt there: its work is the same at every rate, its share the least where d is most.
        some = np.broadcast_to(np.isfinite(d_min), w0.shape)  # d_max > 0 there too
        lo = np.minimum(lo, np.where(some, fb * np.divide(w0, d_max, out=np.zeros_like(w0), where=some), lo))
        hi = np.maximum(hi, np.where(some, fb * np.divide(w0, d_min, out=np.zeros_like(w0), where=some), hi))
        s_p = np.where(pos[p_m], fb[e_c[p_e]] * (w0[e_j[p_e], e_c[p_e]] + ratio * pre_p)
                       / np.where(pos[p_m], d[p_m], 1.0), share[e_j[p_e], cols[e_c[p_e]]])
        if p_e.size:
            e_lo = np.minimum(e_lo, np.minimum.reduceat(s_p, e_first))
            e_hi = np.maximum(e_hi, np.maximum.reduceat(s_p, e_first))
    # Those whose prompt reaches it: at each rate (its own prompt's tokens move with it).
    lo[e_j, e_c], hi[e_j, e_c] = np.minimum(share[e_j, cols[e_c]], e_lo), np.maximum(share[e_j, cols[e_c]], e_hi)
    share_lo[:, cols], share_hi[:, cols] = lo, hi
    return share_lo, share_hi


def attribute(
    edges_ns: np.ndarray,
    energy_j: np.ndarray,
    arrival_ns: np.ndarray,
    first_ns: np.ndarray,
    last_ns: np.ndarray,
    end_ns: np.ndarray,
    tok_t_ns: np.ndarray,
    tok_req: np.ndarray,
    tok_n: np.ndarray,
    server_tokens: np.ndarray | None = None,
    prompt_tokens: np.ndarray | None = None,
    tok_ctx: np.ndarray | None = None,
    costs: WorkCosts | None = None,
    bypass_spans: tuple[np.ndarray, np.ndarray] | None = None,
    passive: np.ndarray | None = None,
    aside_j: np.ndarray | None = None,
    tok_work: np.ndarray | None = None,
    sequences: np.ndarray | None = None,
) -> Attribution:
    """Split the energy of K intervals (edges: K+1 instants) among R requests by their work.

    energy_j: (K,) or (K, C), e.g. GPU and CPU columns, split with the same weights (those of the
    first column's energy). Per request r: arrival, first token, last token, end of response
    (NEVER where not yet), prompt tokens (NaN or 0 where unknown: no prefill work is counted): those the server
    computed (llama.cpp's n choices prefill n copies; vLLM's prefill one, the other choices hitting the prefix cache).
    Token events: instant, request index, token count (a chunk may carry several), and the
    context each was decoded at (its own sequence's prompt + tokens before it; None: no context term).
    server_tokens: (K,) tokens the server counted beyond the proxy's in each interval (bypass).
    bypass_spans: (start, end) of the times the server was seen doing bypass work (the scrape
    windows its excess came from); None: unknown, so no part of an interval with bypass tokens is idle.
    passive: (R,) requests known to have done no GPU work (an error answer with no token and no prompt
    length): never live, so they take no share by live time and their time is idle.
    tok_work: per token event, the tokens of it that are decode work (None: all of them): a request's
    first token comes out of its prompt's prefill step, so where the prompt's work is counted it is
    counted, not decoded again; every token is still attributed (request_tokens, tokens).
    aside_j: (K,) energy of GPUs that do none of the proxied work (`workmodel.CostLearner.serving`),
    beyond `energy_j`'s first column: idle, whole, and in the interval's total (by_kind, dest).
    sequences: (R,) the sequences each request runs side by side (n choices × prompts; None: one each), for the
    interval's step count (`request_work`).
    """
    costs = costs or WorkCosts()
    edges = np.asarray(edges_ns, dtype=np.int64)
    energy = np.asarray(energy_j, dtype=float)
    if energy.ndim == 1:
        energy = energy[:, None]
    k_count = edges.size - 1
    if energy.shape[0] != k_count:
        raise ValueError(f"{k_count} intervals but {energy.shape[0]} energy rows")
    if k_count > 0 and np.any(np.diff(edges) <= 0):
        raise ValueError("interval edges must be strictly increasing")
    arrival = np.asarray(arrival_ns, dtype=np.int64)
    first = np.asarray(first_ns, dtype=np.int64)
    last = np.asarray(last_ns, dtype=np.int64)
    end = np.asarray(end_ns, dtype=np.int64)
    r_count = arrival.size
    energy = np.nan_to_num(energy, nan=0.0)
    dur_s = np.diff(edges) / 1e9

    tok = interval_tokens(edges, tok_t_ns, tok_req, tok_n, r_count)
    w_n = tok_n if tok_work is None else tok_work
    tok_w = tok if tok_work is None else interval_tokens(edges, tok_t_ns, tok_req, w_n, r_count)
    ctx_w = np.asarray(w_n, dtype=float) * (np.asarray(tok_ctx, dtype=float) / 1000.0) if tok_ctx is not None else None
    ctx = (interval_tokens(edges, tok_t_ns, tok_req, ctx_w, r_count) if ctx_w is not None
           else np.zeros((r_count, k_count)))
    # Prefill runs from arrival to the first token, or to the end for a request that never got one.
    prefill_end = np.where(first != NEVER, first, end)
    active = np.ones(r_count, bool) if passive is None else ~np.asarray(passive, bool)
    in_prefill = (overlaps(edges, arrival, prefill_end, closed_end=False) & active[:, None] if r_count
                  else np.zeros((0, k_count), bool))
    has_first = first != NEVER
    decode_end = np.where(last != NEVER, last, end)
    in_decode = (
        overlaps(edges, np.where(has_first, first, NEVER), decode_end, closed_end=True) & has_first[:, None]
        if r_count
        else np.zeros((0, k_count), bool)
    )
    in_decode |= tok > 0  # a token inside an interval is proof of decoding there
    live = ((overlaps(edges, arrival, end, closed_end=True) & active[:, None]) | in_decode if r_count
            else np.zeros((0, k_count), bool))
    p_tok = np.zeros(r_count) if prompt_tokens is None else np.nan_to_num(np.asarray(prompt_tokens, dtype=float))
    # The prefill end is not clipped to these intervals: a first token after the last edge leaves
    # the rest of the prompt to the next call, so a prompt is counted once in all.
    pre_start = prefill_start_ns(arrival, prefill_end, p_tok, costs.prefill_tok_s)
    pre = prefill_tokens(edges, pre_start, prefill_end, p_tok) if r_count else np.zeros((0, k_count))

    any_prefill = in_prefill.any(axis=0)
    any_live = live.any(axis=0)
    server = np.zeros(k_count) if server_tokens is None else np.nan_to_num(np.asarray(server_tokens, dtype=float))
    kind = np.full(k_count, IDLE, dtype=np.int8)
    kind[(server > 0) & ~any_live] = UNPROXIED
    kind[any_live & ~any_prefill] = DECODE
    kind[any_prefill] = PREFILL

    work, unprox_work, steps = request_work(costs, tok_w, pre, ctx, server, sequences)
    # A prompt placed at the slow end of the prefill rates (before its first token, never before its arrival) works
    # there too: where the rate in use left a request queued beside another's work, a slower one gives it a share.
    pre_slow = (prefill_tokens(edges, prefill_start_ns(arrival, prefill_end, p_tok, min(PREFILL_TOK_S_SLOW,
                                                                                       costs.prefill_tok_s)),
                               prefill_end, p_tok) if r_count else np.zeros((0, k_count)))
    working = ((work > 0) | (pre_slow > 0)).sum(axis=0)
    ratio_split = (working >= 2) | ((working >= 1) & (unprox_work > 0))
    # Where nothing measurable happened (a slow step straddling the interval, a prompt of unknown
    # length) the live requests share by their live time there. Not where bypass tokens did
    # work: a request only waiting beside them did none (its seconds are not joules of work).
    no_work = any_live & (work.sum(axis=0) <= 0) & (unprox_work <= 0)
    if no_work.any():
        live_s = span_overlap_s(edges, arrival, np.where(end != NEVER, end, edges[-1])) * live
        work[:, no_work] = np.where(live_s[:, no_work].sum(axis=0) > 0, live_s[:, no_work], live[:, no_work])
        # Shared by live time at the rate in use, by a prompt the slow rate places there at that one: the rate splits it.
        ratio_split |= no_work & (working >= 1) & ((work > 0).sum(axis=0) >= 2)
    req_work = work.sum(axis=0)
    total_tok = tok.sum(axis=0)

    busy_s = busy_seconds(edges, arrival, end, active, bypass_spans)
    e = energy[:, 0]
    idle_j = np.zeros(k_count)
    if costs.idle_w is not None:
        # Part of a busy interval neither a request nor bypass traffic was live in is idle, at the
        # idle power; where bypass tokens came without their spans their timing is unknown: none.
        timed = (server <= 0) | (bypass_spans is not None)
        idle_j = np.where((any_live | (server > 0)) & timed,
                          np.minimum(e, costs.idle_w * np.clip(dur_s - busy_s, 0, None)), 0.0)
    idle_j = np.where(~any_live & (server <= 0), e, idle_j)
    denom = req_work + unprox_work
    f_idle = np.divide(idle_j, e, out=np.where(~any_live & (server <= 0), 1.0, 0.0), where=e > 0)
    f_busy = 1.0 - f_idle
    f_unprox = f_busy * np.divide(unprox_work, denom, out=np.zeros(k_count), where=denom > 0)
    share = f_busy[None, :] * np.divide(work, denom[None, :], out=np.zeros_like(work), where=denom[None, :] > 0)
    share_lo = share_hi = share
    if costs.source == "fixed" and ratio_split.any():
        share_lo, share_hi = share_range(share, ratio_split, costs, edges, arrival, prefill_end, p_tok, pre_slow, tok_w,
                                         ctx, server, sequences, f_busy)
    band_j = None
    if costs.ctx_band:
        band_j = np.empty((r_count, 2))
        for b, (step_j, decode_j, prefill_j, ctx_j) in enumerate(costs.ctx_band):
            # The prompts stay where the rate in use placed them: only the costs' ratios move.
            alt, alt_unprox, _ = request_work(replace(costs, step_j=step_j, decode_j=decode_j, prefill_j=prefill_j,
                                                      ctx_j=ctx_j), tok_w, pre, ctx, server, sequences)
            alt[:, no_work] = work[:, no_work]  # shared by live time: no costs in it
            d = alt.sum(axis=0) + alt_unprox
            band_j[:, b] = (f_busy[None, :] * np.divide(alt, d[None, :], out=np.zeros_like(alt),
                                                        where=d[None, :] > 0)) @ energy[:, 0]
    request_energy = share @ energy
    dest = np.stack([share.sum(axis=0), f_idle, f_unprox], axis=1)[:, :, None] * energy[:, None, :]
    by_kind = np.zeros((4, energy.shape[1]))
    np.add.at(by_kind, kind, energy)
    if aside_j is not None:
        aside = np.nan_to_num(np.asarray(aside_j, dtype=float))
        dest[:, TO_IDLE, 0] += aside
        np.add.at(by_kind[:, 0], kind, aside)
    features = np.column_stack([dur_s, steps, tok_w.sum(axis=0) + server, pre.sum(axis=0), ctx.sum(axis=0)])
    return Attribution(
        kind=kind,
        tokens=total_tok,
        n_prefill=in_prefill.sum(axis=0),
        n_decoding=in_decode.sum(axis=0),
        request_energy=request_energy,
        request_tokens=tok.sum(axis=1),
        by_kind=by_kind,
        dest=dest,
        features=features,
        ratio_split=ratio_split,
        share=share,
        share_lo=share_lo,
        share_hi=share_hi,
        band_j=band_j,
    )


def interval_energy_j(counter_j: np.ndarray, t_ns: np.ndarray, power_w: np.ndarray,
                      same_epoch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Energy of each interval between consecutive samples of one device, and whether it was exact.

    The counter difference where both ends have one, it did not go backwards (driver reload) and
    `same_epoch` (the collector caught no jump or reset between them); otherwise the instant power readings
    integrated as the profiler does (`energy.instant_power_energy_j`): between two full samples the trapezoid,
    and an interval that ends at a counter-only edge (no power read there) held at its last reading. NaN where
    neither exists.
    """
    c = np.asarray(counter_j, dtype=float)
    t = np.asarray(t_ns, dtype=np.int64)
    p = np.asarray(power_w, dtype=float)
    dc = np.diff(c)
    # 0 J over a positive duration stays exact here, unlike `energy._stale_if_flat`'s window: the next interval holds the
    # refresh it missed, so the split keeps the counter's total; the idle power is learned from runs of such intervals
    # summed, never from one alone (`workmodel.IDLE_MIN_S`).
    exact = ~np.isnan(dc) & (dc >= 0)
    if same_epoch is not None:
        exact &= np.asarray(same_epoch, dtype=bool)
    out = np.where(exact, dc, np.nan)
    have = np.flatnonzero(~np.isnan(p))
    for k in np.flatnonzero(~exact):
        # Only the readings that bound the interval matter: the last at or before its start, the first at or after its end.
        i, j = np.searchsorted(have, k, side="right") - 1, np.searchsorted(have, k + 1, side="left")
        if i >= 0 and j < have.size:
            out[k] = instant_power_energy_j(t[have[i]:have[j] + 1], p[have[i]:have[j] + 1], int(t[k]), int(t[k + 1]))
    return out, exact


def per_token(energy_j: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """J/token, NaN where no token was attributed (never a division by zero posing as a figure)."""
    e = np.asarray(energy_j, dtype=float)
    n = np.asarray(tokens, dtype=float)
    return np.divide(e, n, out=np.full(np.broadcast(e, n).shape, np.nan), where=n > 0)
