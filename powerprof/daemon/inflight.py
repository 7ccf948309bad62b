"""Proxied requests in flight and awaiting their first token, as gauges and exact time integrals (the tuner's early signal).

A request is in flight from the recorder's start to its end, and awaits its first token until
the proxy sees one (queued at the server, in prefill, or a non-streamed answer not yet back).
Both counts are step functions of time; their integrals (request-seconds) are kept exactly, with
the clock they span, so the difference of two scrapes gives the exact mean over the scrape
interval (Little's law: mean in flight = arrival rate × mean time in the server), not a point
sample. Event times are the trace's own monotonic stamps, held to never run back before the
last integration point (a proxy worker's records arrive a few milliseconds late): the counters
never go backwards. A request whose recording broke gets no end call (`Proxy._safe`, the workers'
replay) but its trace still gets its `end_ns`: each reading ends those first, at that stamp (held,
like any event, to the last integration point: such a request may count a little past its end).

Requests that never finish never reach the latency histograms, so each reading also gives two
ages, among streamed requests only (a non-streamed answer's first token is its whole answer, so
its wait says nothing of a stall): the oldest still awaiting its first token, and the longest
silence since the last token of one past its first (docs/tuner.md: the guard's view of them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InFlightState:
    """One reading: the counts now and their integrals (request-seconds) over `clock_s` seconds."""

    in_flight: int
    awaiting_first: int
    in_flight_s: float
    awaiting_first_s: float
    clock_s: float
    # Now, among streamed requests in flight (0.0: none): the age of the oldest awaiting its first token, and the
    # longest time since the last token of one that has had its first.
    oldest_awaiting_s: float = 0.0
    longest_silence_s: float = 0.0


class InFlight:
    """The two counts and their integrals; `start`/`first`/`end` per request id, `state(now_ns)` to read."""

    def __init__(self, t0_ns: int):
        self._t_ns = t0_ns  # the last integration point
        self._t0_ns = t0_ns
        self._open: dict = {}  # request id → its trace (or None): one whose end_ns is set has ended
        self._waiting: set = set()
        self._area_ns = 0  # request·ns, in flight
        self._wait_area_ns = 0

    def _advance(self, t_ns: int) -> None:
        if t_ns > self._t_ns:
            dt = t_ns - self._t_ns
            self._area_ns += len(self._open) * dt
            self._wait_area_ns += len(self._waiting) * dt
            self._t_ns = t_ns

    def start(self, rid, t_ns: int, trace=None) -> None:
        if rid in self._open:
            return
        self._advance(t_ns)
        self._open[rid] = trace
        self._waiting.add(rid)

    def first(self, rid, t_ns: int) -> None:
        if rid in self._waiting:
            self._advance(t_ns)
            self._waiting.discard(rid)

    def end(self, rid, t_ns: int) -> None:
        if rid in self._open:
            self._advance(t_ns)
            del self._open[rid]
            self._waiting.discard(rid)

    def state(self, now_ns: int) -> InFlightState:
        ended = sorted((tr.end_ns, rid) for rid, tr in self._open.items() if tr is not None and tr.end_ns is not None)
        for end_ns, rid in ended:  # ended without an end call (its recording broke)
            self.end(rid, end_ns)
        self._advance(now_ns)
        wait_ns = silent_ns = 0
        for rid, tr in self._open.items():  # the requests in flight: tens to hundreds, read once a sampling period
            if tr is None or tr.stream is not True:
                continue
            if rid in self._waiting:
                wait_ns = max(wait_ns, now_ns - tr.arrival_ns)
            elif tr.last_ns is not None:
                silent_ns = max(silent_ns, now_ns - tr.last_ns)
        return InFlightState(len(self._open), len(self._waiting), self._area_ns / 1e9, self._wait_area_ns / 1e9,
                             (self._t_ns - self._t0_ns) / 1e9, wait_ns / 1e9, silent_ns / 1e9)
