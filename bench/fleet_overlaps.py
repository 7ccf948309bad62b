"""Bench: `powerprof analyze` (fleet_summary) over two daemons on one host whose intervals overlap in time on a shared
GPU (the double-counting check, analysis/fleet.py _overlaps): N one-second intervals each, the second daemon's offset
by half a second, so every interval of each overlaps two of the other's.

    .venv/bin/python bench/fleet_overlaps.py [--sizes 40000,80000] [--dir /tmp/powerprof-bench-overlaps]

Prints, per size, the wall time of fleet_summary and the double-counted intervals it found (N each: a wrong count
fails the bench). For a before-and-after, run it with PYTHONPATH at a checkout of the code before the change.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_fleet import GPU_B, _daemon_rows  # noqa: E402

from powerprof.analysis.fleet import fleet_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="40000,80000")
    ap.add_argument("--dir", default="/tmp/powerprof-bench-overlaps")
    args = ap.parse_args()
    for n in (int(s) for s in args.sizes.split(",")):
        root = Path(args.dir) / str(n)
        if not (root / "d2").exists():
            shutil.rmtree(root, ignore_errors=True)
            _daemon_rows(root / "d1", "one", GPU_B, 0, n, 200.0, 150.0)
            _daemon_rows(root / "d2", "two", GPU_B, 0.5, n, 200.0, 150.0)
        t = time.perf_counter()
        out = fleet_summary([str(root / "d1"), str(root / "d2")]).to_pylist()
        wall = time.perf_counter() - t
        got = sorted(r["double_counted_intervals"] for r in out)
        assert got == [2 * n] or got == [n, n], f"double-counted intervals {got}, expected {2 * n} on the host's row"
        print(f"{n} intervals per daemon: fleet_summary {wall:.2f} s, double-counted {got}")


if __name__ == "__main__":
    main()
