"""Sleeps of the daemon's periodic loops on one grid of the event loop's clock, so that they wake together."""

from __future__ import annotations

import asyncio

# A grid point closer than this is taken as the one just passed: a loop's timer may fire a hair early (asyncio fires
# those due within its clock's resolution) or its clock read a hair short of the point (a float remainder), and the
# loop would then pass again at once.
MIN_SLEEP_S = 0.001


# An idle daemon's loops (no request, no tag) wake this often, not at their fast periods (docs/daemon.md, Footprint).
IDLE_PERIOD_S = 1.0


def idle_period(fast_s: float, cap_s: float = IDLE_PERIOD_S) -> float:
    """The longest multiple of `fast_s` up to `cap_s` (at least `fast_s`): an idle loop's sleep, on its fast grid."""
    return fast_s * max(1, int(min(cap_s, IDLE_PERIOD_S) / fast_s + 1e-9))


class Waker:
    """Ends the idle sleeps of the loops at once when work arrives (a request, a tag, a stop, a reload): they go back
    to their fast periods then, not at their next idle wake-up. Only sleeps given it are ended: a loop already at its
    fast period is not woken per request."""

    def __init__(self) -> None:
        self._sleeping: set[asyncio.Future] = set()

    def wake(self) -> None:
        for fut in self._sleeping:
            if not fut.done():
                fut.set_result(fut.get_loop().time())  # when it was ended: the sleeper's lateness runs from here


def _ring(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def sleep_on_grid(period_s: float, waker: Waker | None = None) -> float:
    """Sleep until the next multiple of `period_s` on the running loop's clock (or until `waker` ends it); returns the
    sleep asked for (where woken early, what it slept until the wake).

    Every wake-up of the idle daemon's event loop costs its thread CPU whatever it then runs (the kernel's wake and the
    loop's turn: 0.06-0.1 % of a core for one task sleeping 0.25 s at a time, on the development VM; two tasks waking
    at the same instants cost the same), and loops that each sleep a period after their own work drift apart: the
    accounting loop (4 a second), the scrape loop (4) and the connection guard (1) woke the loop 9 times a second. On
    one grid their periods' common instants are one wake-up (docs/daemon.md, Footprint)."""
    loop = asyncio.get_running_loop()
    now = loop.time()
    d = period_s - now % period_s
    if d < MIN_SLEEP_S:
        d += period_s
    if waker is None:
        await asyncio.sleep(d)
        return d
    # asyncio.sleep's own way (a future and a timer), with the future where the waker can end it.
    fut = loop.create_future()
    timer = loop.call_at(now + d, _ring, fut)
    waker._sleeping.add(fut)
    try:
        woke = await fut
    finally:
        timer.cancel()
        waker._sleeping.discard(fut)
    # Woken early: what it slept until the wake, not until it ran again, so that a loop late after the wake (the
    # accounting loop's note_proxy_delay) is measured late. Measured to its resumption, a loop that stalled between a
    # request's arrival and its pass measured 0 s late for it.
    return d if woke is None else min(d, max(0.0, woke - now))
