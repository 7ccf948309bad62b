"""Proxied requests in flight and awaiting their first token, as gauges and exact time integrals (the tuner's early signal).

A request is in flight from the recorder's start to its end, and awaits its first token until
the proxy sees one (queued at the server, in prefill, or a non-streamed answer not yet back).
Both counts are step functions of time; their integrals (request-seconds) are kept exactly, with
the clock they span, so the difference of two scrapes gives the exact mean over the scrape
interval (Little's law: mean in flight = arrival rate × mean time in the server), not a point
sample. Event times are the trace's own monotonic stamps, held to never run back before the
last integration point (a proxy worker's records arrive a few milliseconds late): the counters
never go backwards.
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


class InFlight:
    """The two counts and their integrals; `start`/`first`/`end` per request id, `state(now_ns)` to read."""

    def __init__(self, t0_ns: int):
        self._t_ns = t0_ns  # the last integration point
        self._t0_ns = t0_ns
        self._open: set = set()
        self._waiting: set = set()
        self._area_ns = 0  # request·ns, in flight
        self._wait_area_ns = 0

    def _advance(self, t_ns: int) -> None:
        if t_ns > self._t_ns:
            dt = t_ns - self._t_ns
            self._area_ns += len(self._open) * dt
            self._wait_area_ns += len(self._waiting) * dt
            self._t_ns = t_ns

    def start(self, rid, t_ns: int) -> None:
        if rid in self._open:
            return
        self._advance(t_ns)
        self._open.add(rid)
        self._waiting.add(rid)

    def first(self, rid, t_ns: int) -> None:
        if rid in self._waiting:
            self._advance(t_ns)
            self._waiting.discard(rid)

    def end(self, rid, t_ns: int) -> None:
        if rid in self._open:
            self._advance(t_ns)
            self._open.discard(rid)
            self._waiting.discard(rid)

    def state(self, now_ns: int) -> InFlightState:
        self._advance(now_ns)
        return InFlightState(len(self._open), len(self._waiting), self._area_ns / 1e9, self._wait_area_ns / 1e9,
                             (self._t_ns - self._t0_ns) / 1e9)
