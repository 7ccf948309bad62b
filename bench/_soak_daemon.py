"""Runs `powerprof daemon` for daemon_soak.py with its threads named at the OS level and the simulated NVML's CPU counted.

    python bench/_soak_daemon.py COUNTER_FILE daemon --simulate ...   (the arguments after COUNTER_FILE are powerprof's)

Bench machinery, not the daemon's: /proc shows every thread of a Python process under the process's name unless the
thread names itself, so each of the daemon's threads is given its Python name (`powerprof-nvml` → `pp-nvml`, the
event loop's `pp-loop`; the simulator's `sim-*` threads name themselves). The simulated NVML answers inside the calls
of the daemon's sampler thread: each public `nvml*` call of `powerprof.sim.nvml.SimNVML` is timed on its thread's CPU
clock (the outermost call only: one calls another), and the sum is written to COUNTER_FILE every 2 s by a thread of
this wrapper (`bench-simnvml`), so the bench prints it apart from the daemon's own CPU. What the timing itself costs
(two CPU-clock reads a call, ~0.75 µs each on the development VM) lands partly inside the counted call and partly in
the daemon's own: daemon_soak.py prints the calls counted, so that cost can be told.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time

from powerprof.sim.threads import name_this_thread

WRITE_EVERY_S = 2.0


def _os_name(name: str) -> str:
    return name if name.startswith(("sim-", "bench-")) else name.replace("powerprof-", "pp-")


def _name_threads() -> None:
    run = threading.Thread._bootstrap_inner

    def named(self):
        name_this_thread(_os_name(self.name))
        return run(self)

    threading.Thread._bootstrap_inner = named
    name_this_thread("pp-loop")  # the main thread runs the event loop


class _Counted:
    """CPU seconds spent inside the simulated NVML's calls, over every thread."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.calls = 0
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, fn):
        counted = self

        def call(*args, **kwargs):
            depth = getattr(counted._depth, "n", 0)
            if depth:
                return fn(*args, **kwargs)
            counted._depth.n = 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.thread_time() - t0
                counted._depth.n = 0
                with counted._lock:
                    counted.cpu_s += dt
                    counted.calls += 1

        call.__name__ = fn.__name__
        return call


def _count_sim_nvml(path: str) -> None:
    from powerprof.sim import nvml as simnvml

    counted = _Counted()
    for name, fn in list(vars(simnvml.SimNVML).items()):
        if name.startswith("nvml") and callable(fn):
            setattr(simnvml.SimNVML, name, counted.wrap(fn))

    def write() -> None:
        while True:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"{counted.cpu_s!r} {counted.calls}\n")
            os.replace(tmp, path)
            time.sleep(WRITE_EVERY_S)

    threading.Thread(target=write, name="bench-simnvml", daemon=True).start()


def main() -> None:
    path = sys.argv[1]
    _name_threads()
    _count_sim_nvml(path)
    sys.argv = ["powerprof", *sys.argv[2:]]
    runpy.run_module("powerprof.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
