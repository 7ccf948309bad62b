"""A server restart under proxied and bypass traffic: the daemon's stored bypass (`unproxied`) energy around it
against the simulator's truth, and what the interval rows say (`server_count`).

    python bench/restart_bypass.py [--flavour vllm|sglang|llamacpp] [--down 0.5]

Proxied streams (4 at a time) and bypass streams (1 at a time, straight to the server) run for 16 s; the server
restarts at 6 s, down `--down` s. Each bypass request's true energy (the simulator's, cut ones included) is
spread over the daemon's intervals by its emitted tokens. Prints, per interval near the restart and in sum: true
bypass energy, stored `unproxied_energy_j`, `server_count` (absent before the column existed: run it on an older
checkout for the before figures).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as pads

from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer


async def _stream(session, url: str, rid: str, n: int) -> None:
    body = {"model": "m", "prompt": "x" * 200, "max_tokens": n, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"X-Sim-Request-Id": rid}) as r:
            async for _ in r.content:
                pass
    except Exception:  # noqa: BLE001 - a stream the restart cut
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavour", default="vllm")
    ap.add_argument("--down", type=float, default=0.5)
    ap.add_argument("--restart-at", type=float, default=6.0)
    ap.add_argument("--run", type=float, default=16.0)
    a = ap.parse_args()
    import aiohttp

    tmp = Path(tempfile.mkdtemp(prefix="pp-restart-"))
    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour=a.flavour, n_slots=16, batching="continuous").start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp / "data"), "daemon.interval_s": 0.5, "daemon.flush_interval_s": 2.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))
    ids = itertools.count()
    bypass_ids: set[str] = set()

    async def go():
        task = asyncio.create_task(daemon.run())
        while "proxy" not in daemon.urls:
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async def lane(url, bypass):
                while time.monotonic() - t0 < a.run:
                    rid = str(next(ids))
                    if bypass:
                        bypass_ids.add(rid)
                    await _stream(s, url, rid, 64)
                    await asyncio.sleep(0.05)  # a refused connection (server down) is not a busy loop

            async def restart():
                await asyncio.sleep(a.restart_at)
                await asyncio.wrap_future(srv.restart(a.down))

            await asyncio.gather(*(lane(daemon.urls["proxy"], False) for _ in range(4)), lane(srv.url, True), restart())
        await asyncio.sleep(3.0)
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(go())
    finally:
        srv.stop()
    iv = pads.dataset(tmp / "data" / "intervals", partitioning="hive").to_table().to_pandas().sort_values("t_start_mono_s")
    t_restart = (srv.restarts[0][0] - daemon.t0_ns) / 1e9
    s0 = iv["t_start_mono_s"].to_numpy()
    s1 = s0 + iv["duration_s"].to_numpy()
    true_j = np.zeros(len(iv))
    for row in srv.truth + srv.truth_cancelled:
        if row.get("client_id") in bypass_ids and row.get("energy_j") and row["emissions"]:
            em = (np.asarray(row["emissions"], dtype=np.int64) - daemon.t0_ns) / 1e9
            k = np.searchsorted(s0, em, side="right") - 1
            ok = (k >= 0) & (em < s1[np.clip(k, 0, None)])
            np.add.at(true_j, k[ok], row["energy_j"] / len(em))
    iv["true_bypass_j"] = true_j
    has = "server_count" in iv.columns
    near = iv[(s1 > t_restart - 2.0) & (s0 < t_restart + a.down + 4.0)]
    print(f"{a.flavour}: restart at {t_restart:.2f} s (daemon clock), down {a.down} s")
    print(f"{'start_s':>8s} {'true J':>8s} {'stored J':>9s} {'server_tok':>10s}  server_count")
    for _, r in near.iterrows():
        print(f"{r['t_start_mono_s']:8.2f} {r['true_bypass_j']:8.1f} {r['unproxied_energy_j']:9.1f} "
              f"{r['server_tokens'] if r['server_tokens'] == r['server_tokens'] else float('nan'):10.1f}  "
              f"{r['server_count'] if has else '(no column)'}")
    flagged = iv[iv["server_count"] != "complete"] if has else iv.iloc[0:0]
    print(f"near the restart: true bypass {near['true_bypass_j'].sum():.1f} J, stored unproxied "
          f"{near['unproxied_energy_j'].sum():.1f} J")
    if has:
        print(f"flagged intervals: {len(flagged)} ({', '.join(sorted(set(flagged['server_count'])))}): true bypass "
              f"{flagged['true_bypass_j'].sum():.1f} J, stored {flagged['unproxied_energy_j'].sum():.1f} J")
    print(f"whole run: true bypass {iv['true_bypass_j'].sum():.1f} J, stored unproxied {iv['unproxied_energy_j'].sum():.1f} J")
    # The live J/token gauge (its window, metrics.jpt_window_s = 60 s, holds the whole run) against the simulator's
    # truth for the proxied requests; "every interval" is the rule it had before it left out those whose count is low.
    proxied = [r for r in srv.truth if r.get("client_id") not in bypass_ids and r.get("energy_j") and r["emissions"]]
    true_jpt = sum(r["energy_j"] for r in proxied) / sum(len(r["emissions"]) for r in proxied)
    busy = iv[(iv["proxy_tokens"] > 0) & iv["gpu_energy_j"].notna()]
    every = busy["requests_energy_j"].sum() / busy["proxy_tokens"].sum()
    tot = daemon.ledger.totals
    print(f"J/token: simulator truth (proxied requests, whole) {true_jpt:.4f}; every interval with tokens {every:.4f} "
          f"({100 * (every / true_jpt - 1):+.1f}%); powerprof_joules_per_token {tot.j_per_token:.4f} "
          f"({100 * (tot.j_per_token / true_jpt - 1):+.1f}%), left out {tot.jpt_left_out}")


if __name__ == "__main__":
    main()
