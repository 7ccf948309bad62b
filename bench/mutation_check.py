"""Mutation check: hand-made wrong numbers in the arithmetic modules must each fail a fast test.

Each mutation is one source-text replacement in one module (a plausible slip: n for n − 1, a
quarter window for a half). It is applied to a copy of the package and tests in a temporary
folder, never to the worktree, and only the test files that own that arithmetic run (`-x -q`).
A mutation the tests do not catch is a figure that could go wrong silently: the script prints
caught/survived per mutation and exits 1 if any survived (2 if a mutation no longer applies or
the unmutated copy fails its tests).

    .venv/bin/python bench/mutation_check.py [--only SUBSTRING] [--list]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("decode tokens = n instead of n - 1", "powerprof/arrival.py",
             "win = rk[a + 1 : b + 1]", "win = rk[a : b + 1]", ("tests/test_windows.py",)),
    Mutation("decode time 1 ms too long", "powerprof/windows.py",
             "dur_s = (q.t_last_ns - q.t_first_ns) / 1e9", "dur_s = (q.t_last_ns - q.t_first_ns + 1_000_000) / 1e9",
             ("tests/test_windows.py",)),
    Mutation("unwrap_resets adds nothing after a reset", "powerprof/energy.py",
             "np.where(drops, e[:-1], 0.0)", "np.where(drops, 0.0, 0.0)",
             ("tests/test_profiler.py", "tests/test_daemon_ledger.py")),
    Mutation("RAPL wrap without the counter's range", "powerprof/collectors/rapl.py",
             "return d + max_range_uj", "return d", ("tests/test_rapl.py",)),
    Mutation("weighted policy prices time as P_max * tok/s", "powerprof/analysis/sweetspot.py",
             "(1 - params.eta) * p_max / t", "(1 - params.eta) * p_max * t",
             ("tests/test_analysis_sweetspot.py",)),
    Mutation("95% CI at the 5%/95% quantiles (a 90% interval)", "powerprof/analysis/stats.py",
             "[(1 - ci) / 2, 1 - (1 - ci) / 2]", "[(1 - ci), ci]", ("tests/test_analysis_stats.py",)),
    Mutation("average power shifted by a quarter window", "powerprof/energy.py",
             "dtype=np.int64) - int(window_s * 1e9 / 2)", "dtype=np.int64) - int(window_s * 1e9 / 4)",
             ("tests/test_profiler.py",)),
    Mutation("CPU energy subtracted across a dropped RAPL delta", "powerprof/energy.py",
             "return ep[i] != ep[j]", "return np.zeros(np.shape(ep[i]), bool)",
             ("tests/test_rapl.py", "tests/test_profiler.py", "tests/test_daemon_ledger.py")),
    Mutation("instant power ranked above the 1 s average", "powerprof/profiler.py",
             "ENERGY_METHODS = (METHOD_COUNTER, METHOD_AVG_POWER, METHOD_POWER, METHOD_NONE)",
             "ENERGY_METHODS = (METHOD_COUNTER, METHOD_POWER, METHOD_AVG_POWER, METHOD_NONE)",
             ("tests/test_profiler.py",)),
    Mutation("power integrated without the edge interpolation", "powerprof/energy.py",
             "ys = np.concatenate([[np.interp(a, ts, p)], p[inside], [np.interp(b, ts, p)]])",
             "ys = np.concatenate([[p[0]], p[inside], [p[-1]]])", ("tests/test_profiler.py",)),
    Mutation("instant power read after an event joined by a line, as a tick", "powerprof/energy.py",
             "steps = np.flatnonzero(evs[1:]) + 1", "steps = np.flatnonzero(np.zeros_like(evs[1:])) + 1",
             ("tests/test_power_integration.py",)),
    Mutation("a counter that did not move over a window taken as 0 J", "powerprof/energy.py",
             "if t1_ns > t0_ns and not energy_j > 0 else", "if t1_ns > t0_ns and energy_j < 0 else",
             ("tests/test_profiler.py",)),
)


def _copy_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    # tests import benches (window_accuracy, attribution_accuracy); test_rapl reads the systemd unit's permission line
    for name in ("powerprof", "tests", "bench", "systemd"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def _pytest(dest: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                       cwd=dest, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    return p.returncode, time.monotonic() - t, lines[-1] if lines else p.stderr.strip()[-200:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = ap.parse_args()
    muts = [m for m in MUTATIONS if not args.only or args.only in m.name]
    if args.list:
        for m in muts:
            print(f"{m.name}: {m.path}: {m.old!r} -> {m.new!r}  [{' '.join(m.tests)}]")
        return 0
    with tempfile.TemporaryDirectory(prefix="powerprof-mut-") as tmp:
        dest = Path(tmp)
        _copy_tree(dest)
        probe = subprocess.run([sys.executable, "-c", "import powerprof; print(powerprof.__file__)"], cwd=dest,
                               env={**os.environ, "PYTHONPATH": str(dest)}, capture_output=True, text=True)
        if not probe.stdout.strip().startswith(str(dest)):
            print(f"the copy does not shadow the installed package: {probe.stdout.strip() or probe.stderr.strip()}")
            return 2
        all_tests = tuple(sorted({t for m in muts for t in m.tests}))
        rc, secs, tail = _pytest(dest, all_tests)
        print(f"baseline (unmutated copy): {tail} [{secs:.0f} s]")
        if rc != 0:
            print("the unmutated copy fails its tests: fix that first")
            return 2
        results = []
        for m in muts:
            f = dest / m.path
            src = f.read_text()
            if src.count(m.old) != 1:
                results.append((m, "stale", 0.0, f"{m.old!r} occurs {src.count(m.old)} times in {m.path}"))
                continue
            f.write_text(src.replace(m.old, m.new))
            try:
                rc, secs, tail = _pytest(dest, m.tests)
            finally:
                f.write_text(src)
            verdict = {0: "SURVIVED", 1: "caught"}.get(rc, f"error (pytest exit {rc})")
            results.append((m, verdict, secs, tail))
    width = max(len(m.name) for m, *_ in results)
    print(f"\n{'mutation':<{width}} | verdict  | s   | tests")
    for m, verdict, secs, tail in results:
        print(f"{m.name:<{width}} | {verdict:<8} | {secs:3.0f} | {' '.join(Path(t).name for t in m.tests)}: {tail}")
    survived = [m for m, v, *_ in results if v == "SURVIVED"]
    broken = [m for m, v, *_ in results if v not in ("caught", "SURVIVED")]
    print(f"\n{len(results) - len(survived) - len(broken)} caught, {len(survived)} survived, {len(broken)} not run")
    return 1 if survived else (2 if broken else 0)


if __name__ == "__main__":
    sys.exit(main())
