"""Energy attribution: pure functions splitting each sample interval's energy among live requests.

An interval is the time between two consecutive GPU samples. Its kind decides where its energy
goes, and every joule goes to exactly one place, so requests + idle + prefill + unproxied = total:

- prefill: some request was in prefill (arrival → first token) during it. Prefill and decode of
  other requests are mixed in one batch there and cannot be told apart by power; reported apart.
- decode: requests were decoding (first → last token) and none was in prefill. The energy is
  split among them in proportion to the tokens each produced inside the interval (equally
  among the decoding ones if none produced a token in it, e.g. a slow step straddling it).
- unproxied: no proxied request was live but the server's own metrics counted tokens: traffic
  that bypassed the proxy.
- idle: nothing ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

IDLE, DECODE, PREFILL, UNPROXIED = 0, 1, 2, 3
KIND_NAMES = ("idle", "decode", "prefill", "unproxied")

# "Not happened yet" for an int64 nanosecond timestamp.
NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Attribution:
    kind: np.ndarray  # (K,) IDLE | DECODE | PREFILL | UNPROXIED
    tokens: np.ndarray  # (K,) proxied tokens produced in each interval
    n_prefill: np.ndarray  # (K,) requests in prefill in each interval
    n_decoding: np.ndarray  # (K,) requests decoding in each interval
    request_energy: np.ndarray  # (R, C) energy given to each request, per energy column
    request_tokens: np.ndarray  # (R,) each request's tokens inside decode intervals
    by_kind: np.ndarray  # (4, C) total energy per kind

    @property
    def total(self) -> np.ndarray:
        return self.by_kind.sum(axis=0)


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
) -> Attribution:
    """Split the energy of K intervals (edges: K+1 instants) among R requests.

    energy_j: (K,) or (K, C), e.g. GPU and CPU columns, split with the same weights.
    Per request r: arrival, first token, last token, end of response (NEVER where not yet).
    Token events: instant, request index, token count (a chunk may carry several tokens).
    server_tokens: (K,) tokens the server's metrics counted per interval, to spot bypass traffic.
    """
    edges = np.asarray(edges_ns, dtype=np.int64)
    energy = np.asarray(energy_j, dtype=float)
    one_col = energy.ndim == 1
    if one_col:
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

    tok = interval_tokens(edges, tok_t_ns, tok_req, tok_n, r_count)
    # Prefill runs from arrival to the first token, or to the end for a request that never got one.
    prefill_end = np.where(first != NEVER, first, end)
    in_prefill = overlaps(edges, arrival, prefill_end, closed_end=False) if r_count else np.zeros((0, k_count), bool)
    has_first = first != NEVER
    decode_end = np.where(last != NEVER, last, end)
    in_decode = (
        overlaps(edges, np.where(has_first, first, NEVER), decode_end, closed_end=True) & has_first[:, None]
        if r_count
        else np.zeros((0, k_count), bool)
    )
    in_decode |= tok > 0  # a token inside an interval is proof of decoding there

    any_prefill = in_prefill.any(axis=0)
    any_decode = in_decode.any(axis=0)
    server = np.zeros(k_count) if server_tokens is None else np.nan_to_num(np.asarray(server_tokens, dtype=float))
    kind = np.full(k_count, IDLE, dtype=np.int8)
    kind[(server > 0) & ~any_prefill & ~any_decode] = UNPROXIED
    kind[any_decode & ~any_prefill] = DECODE
    kind[any_prefill] = PREFILL

    is_decode = kind == DECODE
    weights = np.where(is_decode[None, :], tok, 0.0)
    no_tokens = is_decode & (weights.sum(axis=0) == 0)
    weights[:, no_tokens] = in_decode[:, no_tokens].astype(float)
    col_sum = weights.sum(axis=0)
    share = np.divide(weights, col_sum[None, :], out=np.zeros_like(weights), where=col_sum[None, :] > 0)
    request_energy = share @ energy
    by_kind = np.zeros((4, energy.shape[1]))
    np.add.at(by_kind, kind, energy)
    return Attribution(
        kind=kind,
        tokens=tok.sum(axis=0),
        n_prefill=in_prefill.sum(axis=0),
        n_decoding=in_decode.sum(axis=0),
        request_energy=request_energy,
        request_tokens=np.where(is_decode[None, :], tok, 0.0).sum(axis=1),
        by_kind=by_kind,
    )


def interval_energy_j(counter_j: np.ndarray, t_ns: np.ndarray, power_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Energy of each interval between consecutive samples of one device, and whether it was exact.

    The counter difference where both ends have one and it did not go backwards (driver reload);
    otherwise the trapezoid of the instant power samples. NaN where neither exists.
    """
    c = np.asarray(counter_j, dtype=float)
    t = np.asarray(t_ns, dtype=np.int64)
    p = np.asarray(power_w, dtype=float)
    dc = np.diff(c)
    dt_s = np.diff(t) / 1e9
    trap = 0.5 * (p[1:] + p[:-1]) * dt_s
    exact = ~np.isnan(dc) & (dc >= 0)
    return np.where(exact, dc, trap), exact


def per_token(energy_j: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """J/token, NaN where no token was attributed (never a division by zero posing as a figure)."""
    e = np.asarray(energy_j, dtype=float)
    n = np.asarray(tokens, dtype=float)
    return np.divide(e, n, out=np.full(np.broadcast(e, n).shape, np.nan), where=n > 0)
