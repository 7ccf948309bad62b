"""Bench: a stream SGLang runs on after its client left, cut by a server restart, against the simulator's truth.

    python bench/restart_run_on.py [--runs 6] [--restart-after 1.0] [--down 0.5]

Two streams of 80 tokens beside one whose client leaves after 40 chunks (bench/cut_accuracy.py's requests), through the
daemon (0.25 s intervals, the default 0.25 s scrapes) in front of the simulated SGLang (continuous batching, H200);
the server restarts `--restart-after` s after the cut, inside its 2 s run-on, down `--down` s. Prints, per run, the cut
stream's row (attributed tokens, GPU energy) against the simulator's truth for it and what its row says of its end.
Run on an older checkout (PYTHONPATH) for the before figures (docs/daemon.md, "ends every run-on").
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import pyarrow.dataset as pads

import cut_accuracy
from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer


def run(restart_after_s: float, down_s: float) -> tuple[dict, dict]:
    """One run: (the cut stream's row, its truth)."""
    tmp = Path(tempfile.mkdtemp(prefix="pp-restart-run-on-"))
    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour="sglang", n_slots=64, batching="continuous").start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp / "data"), "daemon.interval_s": 0.25, "daemon.flush_interval_s": 2.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))

    async def main():
        task = asyncio.create_task(daemon.run())
        for _ in range(600):  # until the scraper has told SGLang (its run-on delays come with it)
            if "proxy" in daemon.urls and daemon.ledger is not None and daemon.ledger.runs_on_after_leave is not None:
                break
            await asyncio.sleep(0.05)
        url = daemon.urls["proxy"]
        async with aiohttp.ClientSession() as s:
            beside = [asyncio.create_task(cut_accuracy._normal(s, url, f"ok{k}")) for k in range(2)]
            await cut_accuracy._cut_decode(s, url, "cutd")
            await asyncio.sleep(restart_after_s)
            await asyncio.wrap_future(srv.restart(down_s))
            await asyncio.gather(*beside, return_exceptions=True)  # cut by the restart, some
        await asyncio.sleep(5.0)  # past the run-on's 2 s and the intervals' hold
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    rows = pads.dataset(tmp / "data" / "requests", partitioning="hive").to_table().to_pylist()
    truth = {t["client_id"]: t for t in srv.truth + srv.truth_cancelled if t.get("client_id")}
    return next(r for r in rows if r["tag"] == "cutd"), truth["cutd"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--restart-after", type=float, default=1.0)
    ap.add_argument("--down", type=float, default=0.5)
    a = ap.parse_args()
    for k in range(a.runs):
        t = time.monotonic()
        row, truth = run(a.restart_after, a.down)
        note = row["energy_note"] or ""
        i = note.find("the server ran on")
        print(f"run {k}: truth {truth['generated']} tokens {truth['energy_j']:.1f} J; row {row['attributed_tokens']:.1f} "
              f"tokens ({100 * (row['attributed_tokens'] / truth['generated'] - 1):+.1f}%) {row['gpu_energy_j']:.1f} J "
              f"({100 * (row['gpu_energy_j'] / truth['energy_j'] - 1):+.1f}%) [{time.monotonic() - t:.0f} s]")
        print("   ", note[i:note.find(")", i) + 1] if i >= 0 else "(no run-on said)")


if __name__ == "__main__":
    main()
