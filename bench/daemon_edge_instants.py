"""Bench: the daemon's per-interval GPU energy against the simulator's truth, with counter reads that take time.

Eight simulated H200s (`h200-141g`: each counter read burns ~3 ms of CPU, 15 ms one call in 50, and the counter
refreshes every 100 ms) under one load that steps between idle, prefill and decode every 50-600 ms (the same on
every GPU, as a tensor-parallel server). The real `NvmlCollector` and `Sampler` (1 Hz ticks) and the daemon's
edge reads (`read_energy_j` under the sampler's lock, every 0.1-0.4 s here) feed the real `Ledger`, as
`daemon/service.py` does; each closed interval's `gpu_energy_j` is compared with the simulator's true energy of
the 8 GPUs between the interval's own edges. Real time (the reads' cost is real CPU), so run it on a quiet
machine, or beside load on purpose (`--hogs N` busy loops).

    .venv/bin/python bench/daemon_edge_instants.py [--seconds 30] [--gpus 8] [--counter-update-s 0.1] [--hogs 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import queue
import random
import subprocess
import sys
import threading
import time

import numpy as np

from powerprof.collectors.nvml import NvmlCollector
from powerprof.collectors.sampler import Sampler
from powerprof.daemon.ledger import Ledger
from powerprof.sim.gpu import Phase
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile


def run(seconds: float, n_gpus: int, counter_update_s: float | None, seed: int) -> dict:
    profile = get_profile("h200-141g")
    if counter_update_s is not None:
        profile = dataclasses.replace(profile, energy_counter_update_s=counter_update_s)
    sim = SimNVML(profile, count=n_gpus, state_path=None, record_history=True)
    coll = NvmlCollector(sim)
    rows: list[dict] = []
    t0_ns = time.monotonic_ns()
    led = Ledger("bench", t0_ns, n_gpus, lambda name, r: rows.extend(r) if name == "intervals" else None, grace_s=0.3)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    sampler = Sampler([coll], interval_s=1.0)
    sampler.subscribe(lambda s: inbox.put(("tick", s)))
    stop = threading.Event()
    rng = random.Random(seed)

    def load() -> None:
        phases = [Phase("idle"), Phase("prefill", 0.9), Phase("decode", 0.3), Phase("decode", 0.6)]
        while not stop.is_set():
            ph = rng.choice(phases)
            for g in sim.gpus:
                g.set_phase(ph)
            stop.wait(rng.uniform(0.05, 0.6))

    def edges() -> None:
        while not stop.wait(rng.uniform(0.1, 0.4)):
            inbox.put(("edge", sampler.read_with("nvml", coll.read_energy_j)))

    threads = [threading.Thread(target=load, daemon=True), threading.Thread(target=edges, daemon=True)]
    sampler.start()
    for t in threads:
        t.start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while not inbox.empty():
            kind, x = inbox.get()
            if kind == "tick":
                if x.data is not None:
                    led.add_gpu_sample(x.t_mono_ns, x.t_wall_ns, x.data)
            elif x[2] is not None:
                led.add_gpu_edge(*x)
        led.advance(time.monotonic_ns())
        time.sleep(0.05)
    stop.set()
    sampler.stop()
    for t in threads:
        t.join()
    led.advance(time.monotonic_ns() + 10**9)
    out = {"dur_s": [], "err_j": [], "true_j": []}
    for r in rows:
        if r["energy_method"] != "counter" or r["gpu_energy_j"] is None:
            continue
        a = t0_ns + round(r["t_start_mono_s"] * 1e9)
        b = a + round(r["duration_s"] * 1e9)
        true = sum(g.true_energy_at_j(b) - g.true_energy_at_j(a) for g in sim.gpus)
        out["dur_s"].append(r["duration_s"])
        out["err_j"].append(r["gpu_energy_j"] - true)
        out["true_j"].append(true)
    return {k: np.array(v) for k, v in out.items()}


def report(res: dict) -> None:
    d, e, t = res["dur_s"], res["err_j"], res["true_j"]
    rel = np.abs(e) / t
    print(f"{d.size} counter intervals; per-interval |error| / true energy:")
    for name, m in (("all", np.ones(d.size, bool)), ("< 0.5 s", d < 0.5), (">= 0.5 s", d >= 0.5)):
        if m.any():
            print(f"  {name:9s} n={m.sum():4d}  median {100 * np.median(rel[m]):6.2f}%  p95 "
                  f"{100 * np.percentile(rel[m], 95):6.2f}%  max {100 * rel[m].max():6.2f}%  mean |e| "
                  f"{np.mean(np.abs(e[m])):6.2f} J  pooled {100 * e[m].sum() / t[m].sum():+6.3f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--counter-update-s", type=float, default=None,
                    help="the simulated counter's refresh (default the profile's 0.1 s; 0: exact at every read)")
    ap.add_argument("--hogs", type=int, default=0, help="busy loops beside the run (a loaded host)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        report(run(args.seconds, args.gpus, args.counter_update_s, args.seed))
    finally:
        for h in hogs:
            h.kill()
            h.wait()


if __name__ == "__main__":
    main()
