"""Test helper: drives a LimitController on the simulator the way a sweep would, in its own process.

The parent test sends it signals or SIGKILL and then checks, through the simulator's shared state
file (POWERPROF_SIM_STATE), what it left on the GPUs.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from powerprof.control import ControlError, LevelError
from powerprof.control.levels import parse_gpu_indexes
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="seed-16g")
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--gpus", default="0,1")
    ap.add_argument("--levels", default="180,220,260")
    ap.add_argument("--clocks", default=None, help="lock SM clocks to each of these around the levels")
    ap.add_argument("--dwell", type=float, default=0.03, help="seconds per level")
    ap.add_argument("--repeat", type=int, default=1, help="passes over the levels; 0 = until a signal")
    ap.add_argument("--fail-after", type=int, default=0, help="raise RuntimeError after this many levels")
    ap.add_argument("--restore-file", default=None)
    a = ap.parse_args(argv)

    nvml = SimNVML(a.profile, count=a.count)
    try:
        indexes = parse_gpu_indexes(a.gpus, a.count)
        with Rig(a.profile, nvml=nvml).controller(indexes, restore_path=a.restore_file) as ctl:
            watts = ctl.parse_power_levels(a.levels)
            clocks = ctl.parse_clock_levels(a.clocks) if a.clocks else []
            print("READY", flush=True)
            done = 0
            deadline = time.monotonic() + 60  # bound a --repeat 0 run even if no signal ever comes
            while (a.repeat == 0 or done < a.repeat * len(watts)) and time.monotonic() < deadline:
                w = watts[done % len(watts)]
                ctl.set_power_limit_w(w)
                if clocks:
                    c = clocks[done % len(clocks)]
                    ctl.lock_sm_clock_mhz(c, c)
                done += 1
                print(f"STEPPED {w:g}", flush=True)
                if a.fail_after and done >= a.fail_after:
                    raise RuntimeError(f"workload failed at level {w:g} W")
                time.sleep(a.dwell)
                if clocks:
                    ctl.release_clocks()
    except (LevelError, ControlError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    # An interactive run has Python's SIGINT handler; a child started from a background job inherits
    # SIGINT ignored, which the controller (rightly) leaves alone. Tests model the interactive case.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
