"""Daemon soak: CPU % and RSS of `powerprof daemon --simulate` over N minutes at 1 Hz with 8 GPUs.

    .venv/bin/python bench/daemon_soak.py --minutes 10 --gpus 8

Prints the daemon's CPU use (share of one core) and resident memory per minute, and the
totals. The simulator's threads (the simulated server and RAPL, named `sim-*` at the OS level,
powerprof/sim/threads.py) run inside the daemon process: their CPU is read per thread from
/proc and printed apart, so `own` is the daemon without its simulated hardware's threads. The
simulated NVML runs inside the calls of the daemon's sampler thread and stays in `own`: the GPUs'
physics and a look at the load file another process may publish (a `stat` per call), about 40 % of
that thread's CPU (docs/benchmarks-history.md, Soak, sixth pass); real hardware has the driver's
own cost there instead. RSS is split into anonymous memory and file-backed pages (shared library code), and
PSS (shared pages divided among the processes that map them) and USS (pages only this process
maps) are printed beside it: file-backed library pages are shared and reclaimable; RSS is the target.
`--rps` adds streamed requests through the proxy.
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
import urllib.request
from pathlib import Path

import psutil

from _daemon import wait_for_daemon_info  # bench/ is on sys.path when a bench runs


def traffic(url: str, rps: float, stop: threading.Event) -> None:
    body = json.dumps({"prompt": "soak", "n_predict": 32, "stream": True}).encode()
    while not stop.wait(1.0 / rps):
        try:
            urllib.request.urlopen(urllib.request.Request(url + "/completion", data=body, method="POST"), timeout=30).read()
        except OSError:
            pass


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


def sim_cpu_s(pid: int) -> float:
    return sum(v for k, v in thread_cpu_s(pid).items() if k.startswith("sim-"))


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--rps", type=float, default=0.0)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="powerprof-soak-"))
    data = tmp / "data"
    env = {**os.environ, "POWERPROF_SIM_STATE": str(tmp / "sim.json")}
    cmd = [sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "a100-40g", "--sim-gpus", str(a.gpus),
           "--interval", str(a.interval), "--data-dir", str(data), "--listen", "127.0.0.1:0",
           "--metrics-listen", "127.0.0.1:0", "--tag-socket", str(tmp / "tags.sock")]
    proc = subprocess.Popen(cmd, stdout=open(tmp / "daemon.log", "wb"), stderr=subprocess.STDOUT, env=env)
    info = wait_for_daemon_info(data)
    if info is None:
        proc.kill()
        sys.exit(f"daemon did not start; log in {tmp / 'daemon.log'}")
    stop = threading.Event()
    if a.rps > 0:
        threading.Thread(target=traffic, args=(info["proxy"], a.rps, stop), daemon=True).start()
    p = psutil.Process(proc.pid)
    print(f"daemon pid {proc.pid}: {a.gpus} simulated GPUs every {a.interval} s, {a.rps} req/s, {a.minutes} min")
    print("minute  cpu_%_of_one_core  own_%  sim_threads_%  rss_MiB  anon_MiB  file_MiB  pss_MiB  uss_MiB")
    t0 = time.monotonic()
    cpu0 = sum(p.cpu_times()[:2])
    sim0 = sim_cpu_s(proc.pid)
    rss = []
    last_t, last_cpu, last_sim = t0, cpu0, sim0
    minute = 0
    try:
        while time.monotonic() - t0 < a.minutes * 60:
            time.sleep(min(60.0, a.minutes * 60 - (time.monotonic() - t0)) if a.minutes >= 1 else a.minutes * 60)
            now, cpu, sim = time.monotonic(), sum(p.cpu_times()[:2]), sim_cpu_s(proc.pid)
            r = p.memory_info().rss / 2**20
            anon, filed = rss_split_mib(proc.pid)
            pss, uss = pss_uss_mib(proc.pid)
            rss.append(r)
            minute += 1
            dt = now - last_t
            print(f"{minute:6d}  {100 * (cpu - last_cpu) / dt:17.2f}  {100 * (cpu - last_cpu - sim + last_sim) / dt:5.2f}"
                  f"  {100 * (sim - last_sim) / dt:13.2f}  {r:7.1f}  {anon:8.1f}  {filed:8.1f}  {pss:7.1f}  {uss:7.1f}", flush=True)
            last_t, last_cpu, last_sim = now, cpu, sim
        total_cpu = sum(p.cpu_times()[:2]) - cpu0
        total_sim = sim_cpu_s(proc.pid) - sim0
        per_thread = thread_cpu_s(proc.pid)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        proc.terminate()
        proc.wait(60)
    files = list(data.rglob("*.parquet"))
    print("CPU s per thread name since start: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_thread.items())))
    print(f"own CPU (without the sim-* threads) {100 * (total_cpu - total_sim) / elapsed:.2f} % of one core; "
          f"simulator threads {100 * total_sim / elapsed:.2f} %")
    print(f"mean CPU {100 * total_cpu / elapsed:.2f} % of one core over {elapsed / 60:.1f} min; "
          f"RSS first {rss[0]:.1f} MiB, last {rss[-1]:.1f} MiB, max {max(rss):.1f} MiB; "
          f"{len(files)} Parquet files, {sum(f.stat().st_size for f in files) / 1024:.0f} KiB; exit {proc.returncode}")


if __name__ == "__main__":
    main()
