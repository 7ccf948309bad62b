"""Start-up time of the processes the suite and users start: the CLI's help, the daemon to readiness, the simulated server.

    .venv/bin/python bench/startup.py [--runs 5] [--baseline TREE] [--cases help,tag,daemon,serve]

Each case is started `--runs` times as a fresh process, the trees' starts taken in turn (this checkout, then `base`:
another source tree given by `--baseline`, e.g. a `git archive` of an earlier commit), so a load that comes and goes
falls on both; each figure is the median of its starts. The commands are the ones the tests start:
- `help`: `python -m powerprof --help`, to its exit;
- `tag`: `python -m powerprof.cli tag start x --socket MISSING`, to its exit 1 ("no daemon socket"): a `tag start` as
  the tests run it, less the one request to the daemon;
- `daemon`: `python -m powerprof.cli daemon --simulate seed-16g` on ports 0, as `tests/daemon_helpers.py` starts it,
  to its `daemon.json` naming its pid (the launcher's readiness poll, here every 10 ms), then SIGTERM to its exit;
- `serve`: `python -m powerprof.sim.serve --profile seed-16g`, to its first 200 on /health.
Wall time is the host's as it comes (other jobs' load included); CPU time (user + system, from /proc at readiness, from
wait4 at exit) is the process's own, less moved by load. Python writes or reads bytecode as this environment says
(printed at the top): with PYTHONDONTWRITEBYTECODE=1 and no `__pycache__` every start compiles the source it imports.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tree: Path, scratch: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "POWERPROF_SIM_STATE": str(scratch / "sim.json"),
            "POWERPROF_STATE_DIR": str(scratch / "state"), "XDG_STATE_HOME": str(scratch / "xdg")}


def _to_exit(cmd: list[str], env: dict, rc: int = 0) -> dict:
    with open(Path(env["POWERPROF_STATE_DIR"]).parent / "out.log", "wb") as log:  # its text is not what is measured
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    assert p.returncode == rc, f"{cmd} exited {p.returncode}"
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime}


def case_help(tree: Path, scratch: Path) -> dict:
    return _to_exit([sys.executable, "-m", "powerprof", "--help"], _env(tree, scratch))


def case_tag(tree: Path, scratch: Path) -> dict:
    return _to_exit([sys.executable, "-m", "powerprof.cli", "tag", "start", "x", "--socket", str(scratch / "missing")],
                    _env(tree, scratch), rc=1)


def case_daemon(tree: Path, scratch: Path) -> dict:
    data = Path(tempfile.mkdtemp(dir=scratch)) / "data"
    cmd = [sys.executable, "-m", "powerprof.cli", "daemon", "--data-dir", str(data), "--listen", "127.0.0.1:0",
           "--metrics-listen", "127.0.0.1:0", "--simulate", "seed-16g"]
    with open(data.parent / "daemon.log", "wb") as log:
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, env=_env(tree, scratch), stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"daemon exited {p.returncode}: {(data.parent / 'daemon.log').read_text()}")
                try:
                    if json.loads((data / "daemon.json").read_text()).get("pid") == p.pid:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)
            ready_s, ready_cpu_s = time.monotonic() - t0, _cpu_s(p.pid)
            t1 = time.monotonic()
            p.send_signal(signal.SIGTERM)
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        finally:
            if p.returncode is None:
                p.kill()
                p.wait()
    return {"wall_s": ready_s, "cpu_s": ready_cpu_s, "stop_s": time.monotonic() - t1,
            "stop_cpu_s": usage.ru_utime + usage.ru_stime - ready_cpu_s}


def case_serve(tree: Path, scratch: Path) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "powerprof.sim.serve", "--profile", "seed-16g", "--port", str(port)]
    log = open(scratch / "serve.log", "wb")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=_env(tree, scratch), stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            assert p.poll() is None, f"sim.serve exited {p.returncode}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.01)
        return {"wall_s": time.monotonic() - t0, "cpu_s": _cpu_s(p.pid)}
    finally:
        p.terminate()
        p.wait(30)
        log.close()


CASES = {"help": case_help, "tag": case_tag, "daemon": case_daemon, "serve": case_serve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="another source tree, started in turn with this one")
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    trees = {"this": ROOT, **({"base": args.baseline.resolve()} if args.baseline else {})}
    cases = args.cases.split(",")
    print(f"python {sys.version.split()[0]}; PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r} "
          f"PYTHONPYCACHEPREFIX={os.environ.get('PYTHONPYCACHEPREFIX', '')!r}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.runs} starts each; "
          + "; ".join(f"{k}: {v}" for k, v in trees.items()))
    got: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        scratch = Path(tmp)
        for name, tree in trees.items():  # one start each first, not counted: bytecode written, files in the page cache
            for case in cases:
                CASES[case](tree, scratch)
        for _ in range(args.runs):
            for case in cases:
                for name, tree in trees.items():
                    got.setdefault((case, name), []).append(CASES[case](tree, scratch))
    print(f"{'case':8} {'tree':5} {'wall s':>7} {'CPU s':>6} {'stop s':>7} {'stop CPU s':>10}   (medians)")
    for case in cases:
        for name in trees:
            rows = got[(case, name)]

            def med(key):
                vals = [r[key] for r in rows if key in r]
                return f"{statistics.median(vals):.3f}" if vals else "-"

            print(f"{case:8} {name:5} {med('wall_s'):>7} {med('cpu_s'):>6} {med('stop_s'):>7} {med('stop_cpu_s'):>10}")
    print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
