"""Daemon soak: CPU % and RSS of `powerprof daemon --simulate` over N minutes at 1 Hz with 8 GPUs.

    .venv/bin/python bench/daemon_soak.py --minutes 10 --gpus 8 [--baseline /work/main] [--rps 5]

Prints the daemon's CPU use (share of one core) and resident memory per minute, and the totals. The daemon runs
under bench/_soak_daemon.py, which names its threads at the OS level and counts the simulated NVML's CPU. Three
parts of the process's CPU are printed apart:
- the simulator's threads (the simulated server and RAPL, named `sim-*`, powerprof/sim/threads.py): real hardware
  has no such threads;
- the simulated NVML (`sim_nvml`): it answers inside the calls of the daemon's sampler thread (the GPUs' physics, a
  look at the load file another process may publish: a `stat` a call); counted on that thread's CPU clock around each
  call, outermost only. Real hardware has the driver's own cost there instead (a real H200's energy counter alone
  ~3 ms of CPU a read, docs/hardware.md), and pynvml's ctypes wrappers;
- `own`: the rest, the daemon's own code (and the timing of the NVML calls, two CPU-clock reads each: the calls a
  second are printed, so its cost can be told).
`own_with_nvml` (own + sim_nvml) is the figure earlier soaks printed as `own`. Per thread, the CPU over the measured
span (after start-up) is printed at the end.

`--baseline TREE` runs a second daemon from that source tree (its `powerprof` package) beside this tree's, at the same
time on the same machine: the two columns and their ratio per minute (a loaded, shared machine moves both alike).
RSS is split into anonymous memory and file-backed pages (shared library code), and PSS (shared pages divided among
the processes that map them) and USS (pages only this process maps) are printed beside it: file-backed library pages
are shared and reclaimable; RSS is the target. `--rps` adds streamed requests through the proxy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from _daemon import wait_for_daemon_info  # bench/ is on sys.path when a bench runs

HERE = Path(__file__).resolve().parent


class Traffic:
    """`rps` streamed completions a second through the proxy, counted: `served` (a 200 read to its end), `failed`
    and the last failure. On /v1/completions as JSON: the daemon's simulated server is vLLM's, which has no
    /completion (before, --rps sent /completion, all answered 404, and the soak ran with no generation, unsaid)."""

    def __init__(self, url: str, rps: float, stop: threading.Event) -> None:
        self.url, self.rps, self.stop = url, rps, stop
        self.served = self.failed = 0
        self.last_error = ""

    def run(self) -> None:
        body = json.dumps({"prompt": "soak", "max_tokens": 32, "stream": True}).encode()
        while not self.stop.wait(1.0 / self.rps):
            req = urllib.request.Request(self.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                self.served += 1
            except urllib.error.HTTPError as e:
                self.failed += 1
                self.last_error = f"HTTP {e.code} {e.read()[:200]!r}"
            except OSError as e:
                self.failed += 1
                self.last_error = repr(e)

    def check(self, label: str, early: bool = False) -> str:
        """Its counts; exits the soak when no request was served (`early`: and some failed, the first may still be
        running on a loaded machine), so a soak without traffic is never reported as one."""
        if self.served == 0 and (self.failed or not early):
            raise SystemExit(f"{label}: --rps {self.rps}: no request served through the proxy ({self.failed} failed; "
                             f"last: {self.last_error or 'none sent'})")
        return f"{label}: {self.served} requests served, {self.failed} failed" + (
            f" (last: {self.last_error})" if self.failed else "")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per OS thread name of `pid`, from /proc/<pid>/task."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def rss_split_mib(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB from /proc/<pid>/status."""
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "RssShmem"):
            vals[k] = int(v.split()[0]) / 1024
    return vals.get("RssAnon", 0.0), vals.get("RssFile", 0.0) + vals.get("RssShmem", 0.0)


def pss_uss_mib(pid: int) -> tuple[float, float]:
    """(PSS, USS) MiB from /proc/<pid>/smaps_rollup: USS = private clean + private dirty pages."""
    vals = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        vals[k] = int(v.split()[0]) / 1024
    return vals.get("Pss", 0.0), vals.get("Private_Clean", 0.0) + vals.get("Private_Dirty", 0.0)


class Soaked:
    """One daemon under the soak, from one source tree."""

    def __init__(self, label: str, tree: Path, a) -> None:
        self.label, self.tree = label, tree
        self.tmp = Path(tempfile.mkdtemp(prefix=f"powerprof-soak-{label}-"))
        self.data = self.tmp / "data"
        self.nvml_file = self.tmp / "simnvml.txt"
        env = {**os.environ, "POWERPROF_SIM_STATE": str(self.tmp / "sim.json"),
               "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
        cmd = [sys.executable, str(HERE / "_soak_daemon.py"), str(self.nvml_file), "daemon", "--simulate", "a100-40g",
               "--sim-gpus", str(a.gpus), "--interval", str(a.interval), "--data-dir", str(self.data),
               "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--tag-socket", str(self.tmp / "tags.sock")]
        self.proc = subprocess.Popen(cmd, stdout=open(self.tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env,
                                     cwd=str(tree))
        self.rss: list[float] = []
        self.minutes: list[float] = []  # own % per minute

    def started(self) -> dict:
        info = wait_for_daemon_info(self.data)
        if info is None:
            self.proc.kill()
            sys.exit(f"{self.label}: daemon did not start; log in {self.tmp / 'daemon.log'}")
        self.p = psutil.Process(self.proc.pid)
        return info

    def nvml(self) -> tuple[float, int]:
        """(CPU s inside the simulated NVML's calls, calls) so far, as the daemon's wrapper last wrote them."""
        try:
            s, n = self.nvml_file.read_text().split()
            return float(s), int(n)
        except (OSError, ValueError):
            return 0.0, 0

    def read(self) -> dict:
        threads = thread_cpu_s(self.proc.pid)
        nv_s, nv_n = self.nvml()
        return {"t": time.monotonic(), "cpu": sum(self.p.cpu_times()[:2]), "threads": threads,
                "sim": sum(v for k, v in threads.items() if k.startswith("sim-")),
                "bench": sum(v for k, v in threads.items() if k.startswith("bench-")), "nvml": nv_s, "calls": nv_n}

    def start_span(self) -> None:
        self.first = self.last = self.read()

    def minute(self, n: int) -> str:
        now = self.read()
        r = self.p.memory_info().rss / 2**20
        anon, filed = rss_split_mib(self.proc.pid)
        pss, uss = pss_uss_mib(self.proc.pid)
        self.rss.append(r)
        f = self.figures(self.last, now)
        self.minutes.append(f["own"])
        self.last = now
        return (f"{self.label:>8} {n:6d}  {f['all']:8.2f}  {f['own']:5.2f}  {f['nvml']:8.2f}  {f['own'] + f['nvml']:13.2f}"
                f"  {f['sim']:13.2f}  {f['calls']:7.1f}  {r:7.1f}  {anon:8.1f}  {filed:8.1f}  {pss:7.1f}  {uss:7.1f}")

    @staticmethod
    def figures(a: dict, b: dict) -> dict:
        dt = b["t"] - a["t"]
        pct = lambda k: 100 * (b[k] - a[k]) / dt  # noqa: E731
        return {"all": pct("cpu"), "sim": pct("sim"), "nvml": pct("nvml"),
                "own": pct("cpu") - pct("sim") - pct("bench") - pct("nvml"), "calls": (b["calls"] - a["calls"]) / dt}

    def summary(self) -> list[str]:
        end = self.read()
        f = self.figures(self.first, end)
        dt = end["t"] - self.first["t"]
        per = {k: 100 * (v - self.first["threads"].get(k, 0.0)) / dt for k, v in sorted(end["threads"].items())}
        files = list(self.data.rglob("*.parquet"))
        return [f"{self.label}: own CPU {f['own']:.2f} % of one core (minutes {min(self.minutes):.2f}–{max(self.minutes):.2f}); "
                f"simulated NVML {f['nvml']:.2f} % ({f['calls']:.0f} calls/s); own with it {f['own'] + f['nvml']:.2f} %; "
                f"simulator threads {f['sim']:.2f} %; whole process {f['all']:.2f} % over {dt / 60:.1f} min",
                f"{self.label}: per thread over the span, % of one core: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()),
                f"{self.label}: RSS first {self.rss[0]:.1f} MiB, last {self.rss[-1]:.1f} MiB, max {max(self.rss):.1f} MiB; "
                f"{len(files)} Parquet files, {sum(x.stat().st_size for x in files) / 1024:.0f} KiB"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--rps", type=float, default=0.0)
    ap.add_argument("--baseline", default="", help="another source tree (e.g. /work/main): its daemon runs beside this one")
    a = ap.parse_args()
    trees = [("after", HERE.parent)]
    if a.baseline:
        base = Path(a.baseline).resolve()
        if not (base / "powerprof" / "daemon" / "service.py").is_file():
            raise SystemExit(f"--baseline {a.baseline}: no powerprof/daemon/service.py there")
        trees.insert(0, ("before", base))
    soaks = [Soaked(label, tree, a) for label, tree in trees]
    stop = threading.Event()
    traffic: dict[str, Traffic] = {}
    try:
        for s in soaks:
            info = s.started()
            if a.rps > 0:
                traffic[s.label] = Traffic(info["proxy"], a.rps, stop)
                threading.Thread(target=traffic[s.label].run, daemon=True).start()
        print(f"{len(soaks)} daemon(s) ({', '.join(f'{s.label} pid {s.proc.pid} from {s.tree}' for s in soaks)}): "
              f"{a.gpus} simulated GPUs every {a.interval} s, {a.rps} req/s, {a.minutes} min")
        print("    tree minute  cpu_%_all  own_%  sim_nvml_%  own_with_nvml  sim_threads_%  nvml/s  rss_MiB  anon_MiB"
              "  file_MiB  pss_MiB  uss_MiB")
        time.sleep(3.0)  # past start-up's tail (the first samples and scrape): the span is the idle daemon's
        for label, t in traffic.items():
            print(t.check(label, early=True), flush=True)  # requests flow, or the soak stops here
        for s in soaks:
            s.start_span()
        t0 = time.monotonic()
        minute = 0
        while time.monotonic() - t0 < a.minutes * 60:
            time.sleep(max(0.0, min(60.0 * (minute + 1), a.minutes * 60) - (time.monotonic() - t0)))
            minute += 1
            for s in soaks:
                print(s.minute(minute), flush=True)
            if len(soaks) == 2:
                b, f = soaks[0].minutes[-1], soaks[1].minutes[-1]
                print(f"   after/before own {f / b:.2f}" if b > 0 else "", flush=True)
        for s in soaks:
            for line in s.summary():
                print(line)
        for label, t in traffic.items():
            print(t.check(label))
        if len(soaks) == 2:
            fb = [s.figures(s.first, s.last)["own"] for s in soaks]
            print(f"after/before own over the run: {fb[1] / fb[0]:.2f}" if fb[0] > 0 else "")
    finally:
        stop.set()
        for s in soaks:
            s.stop()


if __name__ == "__main__":
    main()
