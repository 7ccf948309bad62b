"""Bench: what the restore guarantee costs (first set with the restore file vs later sets) and how fast a
signalled or killed run gets its GPUs back. Simulated GPUs; prints figures for docs/benchmarks.md."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "control" / "control_child.py"


def _env(d: Path) -> dict:
    return {**os.environ, "POWERPROF_STATE_DIR": str(d / "powerprof"), "POWERPROF_SIM_STATE": str(d / "sim.json")}


def bench_sets(d: Path, rounds: int = 30) -> None:
    os.environ.update(_env(d))
    from powerprof.control import LimitController
    from powerprof.sim.nvml import SimNVML

    first, later, restore, opened = [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        with LimitController(SimNVML("seed-16g", count=2), [0, 1], handle_signals=False) as ctl:
            t1 = time.perf_counter()
            ctl.set_power_limit_w(200)  # writes + fsyncs the restore file first
            t2 = time.perf_counter()
            for w in (220, 240, 260):
                ctl.set_power_limit_w(w)
            t3 = time.perf_counter()
            ctl.restore()
            t4 = time.perf_counter()
        opened.append(t1 - t0)
        first.append(t2 - t1)
        later.append((t3 - t2) / 3)
        restore.append(t4 - t3)
    med = statistics.median
    print(f"open (2 GPUs: locks, originals, permission probe): median {med(opened) * 1e3:.2f} ms")
    print(f"first set incl. restore file (tmp+fsync+rename): median {med(first) * 1e3:.2f} ms")
    print(f"later set (2 GPUs, read back):                  median {med(later) * 1e3:.2f} ms")
    print(f"ratio first/later set: {med(first) / med(later):.1f}x")
    print(f"restore() (2 GPUs, file removed):               median {med(restore) * 1e3:.2f} ms")


def _stepped_child(d: Path) -> subprocess.Popen:
    """A child controller that has changed the limit (it printed STEPPED) and keeps stepping."""
    p = subprocess.Popen([sys.executable, str(CHILD), "--repeat", "0", "--dwell", "0.05"], stdout=subprocess.PIPE,
                         text=True, env=_env(d))
    for line in p.stdout:
        if line.startswith("STEPPED"):
            break
    return p


def bench_signal(d: Path, rounds: int = 8) -> None:
    """SIGTERM → child exited with every GPU back (the child restores before it exits)."""
    out = []
    for _ in range(rounds):
        p = _stepped_child(d)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)
        out.append(time.perf_counter() - t0)
        assert p.returncode == 128 + signal.SIGTERM
    print(f"SIGTERM to exited-and-restored (child process): median {statistics.median(out) * 1e3:.1f} ms, max {max(out) * 1e3:.1f} ms")


def bench_cli_restore(d: Path, rounds: int = 5) -> None:
    out = []
    for _ in range(rounds):
        p = _stepped_child(d)
        p.kill()
        p.wait(timeout=20)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate"], env=_env(d), capture_output=True,
                           text=True, timeout=60)
        out.append(time.perf_counter() - t0)
        assert r.returncode == 0 and "Restored" in r.stdout, r.stdout + r.stderr
    print(f"`powerprof restore` after kill -9 (whole command incl. Python start): median {statistics.median(out) * 1e3:.0f} ms")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as t:
        bench_sets(Path(t) / "a")
        bench_signal(Path(t) / "b")
        bench_cli_restore(Path(t) / "c")
