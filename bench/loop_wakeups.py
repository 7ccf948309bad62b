"""What an idle event loop's wake-ups cost its thread: N tasks each sleeping 0.25 s at a time, apart or on one grid.

    python bench/loop_wakeups.py [--seconds 20]

Prints the loop thread's CPU (user + system, `time.thread_time`) as a share of one core, for 1 task, 2 tasks sleeping
a period after their own turns (started a little apart, as the daemon's loops drift), and 2 tasks sleeping to the next
multiple of the period (`powerprof.daemon.ticks.sleep_on_grid`, the daemon's). On uvloop, as the daemon runs.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from powerprof.daemon.ticks import sleep_on_grid

PERIOD_S = 0.25


async def _apart() -> None:
    while True:
        await asyncio.sleep(PERIOD_S)


async def _grid() -> None:
    while True:
        await sleep_on_grid(PERIOD_S)


async def _run(tasks: list, seconds: float) -> float:
    for k, t in enumerate(tasks):
        asyncio.get_running_loop().create_task(t())
        await asyncio.sleep(0.1 if k + 1 < len(tasks) else 0)  # the loops start apart, as the daemon's do
    t0 = time.thread_time()
    await asyncio.sleep(seconds)
    return 100 * (time.thread_time() - t0) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    for label, tasks in (("1 task", [_apart]), ("2 tasks apart", [_apart, _apart]), ("2 tasks on one grid", [_grid, _grid]),
                         ("1 task", [_apart])):
        pct = uvloop.run(_run(tasks, a.seconds))
        print(f"{label:20s} {pct:.3f} % of one core ({len(tasks) * 4} sleeps a second)", flush=True)


if __name__ == "__main__":
    main()
