"""Request latency and length histograms of the proxied traffic (TTFT, time per output token, prompt and output tokens).

Cumulative counters only (Prometheus histograms), so any reader can take the difference of two
scrapes and get the distribution of the requests that finished in between: `powerprof tune`
reads its windows' TTFT p95, TPOT p95 and length mix that way (docs/tuner.md). Fixed buckets:
latency at 2^(1/3) steps from 1 ms to 131 s (a quantile read from them is within ±13% of the
truth), token counts at powers of two.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

LATENCY_EDGES_S: tuple[float, ...] = tuple(round(0.001 * 2 ** (k / 3), 9) for k in range(52))  # 1 ms … 131 s (2^17 ms)
TOKEN_EDGES: tuple[float, ...] = tuple(float(2**k) for k in range(18))  # 1 … 131072 tokens


@dataclass(frozen=True)
class HistogramState:
    """Cumulative bucket counts over `edges` (the last count is the +Inf bucket), their sum and count."""

    edges: tuple[float, ...]
    counts: tuple[int, ...]
    total: float
    n: int


class Histogram:
    """One histogram's running counts; `state()` gives an immutable copy for the daemon's snapshot."""

    def __init__(self, edges: tuple[float, ...]):
        self.edges = edges
        self._counts = [0] * (len(edges) + 1)
        self._sum = 0.0

    def observe(self, v: float) -> None:
        if v is None or not math.isfinite(v) or v < 0:
            return
        self._counts[bisect.bisect_left(self.edges, v)] += 1
        self._sum += v

    def state(self) -> HistogramState:
        return HistogramState(self.edges, tuple(self._counts), self._sum, sum(self._counts))


class RequestLatency:
    """The four histograms, fed by every request that ended with at least one token."""

    def __init__(self):
        self.ttft_s = Histogram(LATENCY_EDGES_S)
        self.tpot_s = Histogram(LATENCY_EDGES_S)
        self.prompt_tokens = Histogram(TOKEN_EDGES)
        self.output_tokens = Histogram(TOKEN_EDGES)

    def observe(self, arrival_ns: int, first_ns: int | None, last_ns: int | None, generated: int | None,
                prompt: int | None, first_seen: bool = True, shown_first: float | None = 1.0,
                sequences: int = 1) -> None:
        """TTFT from arrival to the first token; TPOT = (last − first) / (generated − shown_first), for a token or
        more after the first piece.

        first_seen False: the first token's time was not observed (a non-streamed answer without the
        server's own timings): no TTFT at all rather than a 0 that would always meet a TTFT SLO.
        shown_first: the tokens the stream had shown at `first_ns` (1: the first token; a stream that came in
        several bursts, its first piece's, Ledger.tokens_at_first). None: the tokens' times are not the server's (a
        stream a buffering proxy delivered in one burst): no TPOT rather than the burst's microseconds, which would
        meet any TPOT bound. sequences: the sequences it generated side by side (`n` choices): each step gave one
        token to each, so the time per output token is per sequence (n = 4 read a quarter of it)."""
        if first_ns is None:
            return
        if first_seen:
            self.ttft_s.observe((first_ns - arrival_ns) / 1e9)
        if generated:
            self.output_tokens.observe(float(generated))
            if shown_first is not None and generated - shown_first >= 1 and last_ns is not None:
                self.tpot_s.observe((last_ns - first_ns) / 1e9 / max((generated - shown_first) / sequences, 1.0))
        if prompt is not None:
            self.prompt_tokens.observe(float(prompt))

    def states(self) -> dict[str, HistogramState]:
        return {"ttft_seconds": self.ttft_s.state(), "tpot_seconds": self.tpot_s.state(),
                "prompt_tokens": self.prompt_tokens.state(), "output_tokens": self.output_tokens.state()}
