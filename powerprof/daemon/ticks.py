"""Sleeps of the daemon's periodic loops on one grid of the event loop's clock, so that they wake together."""

from __future__ import annotations

import asyncio

# A grid point closer than this is taken as the one just passed: a loop's timer may fire a hair early (asyncio fires
# those due within its clock's resolution) or its clock read a hair short of the point (a float remainder), and the
# loop would then pass again at once.
MIN_SLEEP_S = 0.001


async def sleep_on_grid(period_s: float) -> float:
    """Sleep until the next multiple of `period_s` on the running loop's clock; returns the sleep asked for.

    Every wake-up of the idle daemon's event loop costs its thread CPU whatever it then runs (the kernel's wake and the
    loop's turn: 0.06-0.1 % of a core for one task sleeping 0.25 s at a time, on the development VM; two tasks waking
    at the same instants cost the same), and loops that each sleep a period after their own work drift apart: the
    accounting loop (4 a second), the scrape loop (4) and the connection guard (1) woke the loop 9 times a second. On
    one grid their periods' common instants are one wake-up (docs/daemon.md, Footprint)."""
    loop = asyncio.get_running_loop()
    d = period_s - loop.time() % period_s
    if d < MIN_SLEEP_S:
        d += period_s
    await asyncio.sleep(d)
    return d
