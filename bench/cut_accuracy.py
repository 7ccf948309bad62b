"""Bench: the daemon's energy for requests whose clients left mid-stream, and the requests beside them, against the truth.

    python bench/cut_accuracy.py                       # SGLang, vLLM and llama.cpp flavours, two runs each
    python bench/cut_accuracy.py --flavour sglang --runs 1

The daemon (1 s intervals) in front of the simulated continuous-batching server (64 slots, H200 profile): 24 streams
of 80 tokens, 0.4 s apart, beside 4 whole answers of 12000-token prompts whose clients leave 0.25 s in (mid-prefill)
and 4 streams whose clients leave after 40 chunks (41 tokens: mid-decode; SGLang runs both on until its abort,
docs/daemon.md "A request the server runs on after its client left"). Each class's median |error| of `gpu_energy_j`
against the simulator's truth and its range are printed, and the cut streams' tokens against the truth's; with them the
bypass tokens the daemon read (none ran) and their `unproxied` joules, and the rows' energy summed against the truth's;
runs of the same code differ by a few points. Nothing is asserted here (tests/test_daemon_cut_streams.py runs a smaller scene).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import aiohttp
import numpy as np
import pyarrow.dataset as pads

from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer

NORMAL, CUT_DECODE_AT, CUT_PREFILL_AT = 24, (2, 7, 13, 19), (4, 10, 16, 21)  # the latter two: after which normal stream


def _words(n: int) -> str:
    return " ".join(["word"] * n)


async def _post(s, url, tag, body):
    return await s.post(url + "/v1/completions", json={"model": "m", "ignore_eos": True, **body},
                        headers={"X-Sim-Request-Id": tag, "X-Powerprof-Tag": tag})


async def _normal(s, url, tag):
    async with await _post(s, url, tag, {"prompt": _words(300), "max_tokens": 80, "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
        await r.read()


async def _cut_decode(s, url, tag):  # its client leaves after 40 chunks
    r = await _post(s, url, tag, {"prompt": _words(300), "max_tokens": 2000, "stream": True})
    n = 0
    async for line in r.content:
        n += line.startswith(b"data:")
        if n == 40:
            break
    r.close()


async def _cut_prefill(s, url, tag):  # a whole answer whose client leaves during its 12000-token prefill
    t = asyncio.create_task(_post(s, url, tag, {"prompt": _words(12000), "max_tokens": 300, "stream": False}))
    await asyncio.sleep(0.25)
    t.cancel()
    try:
        (await t).close()
    except asyncio.CancelledError:
        pass


def run(flavour: str, data: Path) -> dict:
    """One run of the scene; {class: [(tag, error or None, true tokens, attributed tokens, energy_note)]}."""
    nvml = SimNVML("h200-141g", state_path=None)
    # llama-server's context is split among its slots (4096 each by default): a 12000-token prompt needs more.
    srv = SimServer(nvml, flavour=flavour, n_slots=64, batching="continuous",
                    n_ctx=64 * 16384 if flavour == "llamacpp" else None).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(data), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(data.parent / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))

    async def main():
        task = asyncio.create_task(daemon.run())
        for _ in range(600):  # its proxy up, and the server's kind told (SGLang's run-on delays come with it)
            if "proxy" in daemon.urls and daemon.ledger is not None and daemon.scraper.kind:
                break
            await asyncio.sleep(0.05)
        url = daemon.urls["proxy"]
        async with aiohttp.ClientSession() as s:
            jobs = []
            for k in range(NORMAL):
                jobs.append(asyncio.create_task(_normal(s, url, f"ok{k}")))
                if k in CUT_DECODE_AT:
                    jobs.append(asyncio.create_task(_cut_decode(s, url, f"cutd{k}")))
                if k in CUT_PREFILL_AT:
                    jobs.append(asyncio.create_task(_cut_prefill(s, url, f"cutw{k}")))
                await asyncio.sleep(0.4)
            await asyncio.gather(*jobs)
        await asyncio.sleep(6)  # past the last abort
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id")}
    truth.update({t["client_id"]: t for t in srv.truth_cancelled if t.get("client_id")})
    rows = {r["tag"]: r for r in pads.dataset(data / "requests", partitioning="hive").to_table().to_pylist()
            if isinstance(r["tag"], str)}
    out = {}
    for cls in ("ok", "cutd", "cutw"):
        got = []
        for t in sorted(x for x in truth if x.startswith(cls)):
            r, tr = rows.get(t), truth[t]
            j = None if r is None else r["gpu_energy_j"]
            err = None if j is None or j != j else (j - tr["energy_j"]) / tr["energy_j"]
            got.append((t, err, tr.get("generated"), None if r is None else r["attributed_tokens"],
                        None if r is None else r["energy_note"]))
        out[cls] = got
    # Bypass traffic as the daemon read it (none ran: every request went through the proxy): tokens the server counted
    # beyond the proxy's, and the energy they took (`unproxied`).
    ivs = pads.dataset(data / "intervals", partitioning="hive").to_table(
        columns=["server_tokens", "unproxied_energy_j"]).to_pylist()
    out["bypass"] = (sum(x["server_tokens"] or 0 for x in ivs), sum(x["unproxied_energy_j"] or 0 for x in ivs),
                     sum(r["gpu_energy_j"] or 0 for t, r in rows.items() if t in truth),
                     sum(truth[t]["energy_j"] for t in rows if t in truth))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavour", action="append", choices=["sglang", "vllm", "llamacpp"])
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    names = {"ok": "normal", "cutd": "cut mid-decode", "cutw": "cut mid-prefill"}
    for flavour in args.flavour or ["sglang", "vllm", "llamacpp"]:
        for k in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                res = run(flavour, Path(d) / "data")
            bypass_tokens, bypass_j, rows_j, truth_j = res.pop("bypass")
            print(f"{flavour} run {k + 1}: bypass read (none ran) {bypass_tokens:.0f} tokens, {bypass_j:.0f} J unproxied; "
                  f"the rows' energy {rows_j:.0f} J, the truth's {truth_j:.0f} J")
            for cls, got in res.items():
                errs = [e for _, e, _, _, _ in got if e is not None]
                if not got:
                    continue
                fig = (f"median |error| {100 * float(np.median(np.abs(errs))):.1f}%, "
                       f"{100 * min(errs):+.0f}% to {100 * max(errs):+.0f}%" if errs else "no figure")
                print(f"{flavour} run {k + 1}: {names[cls]} ({len(errs)} of {len(got)} with a figure): {fig}")
                if cls == "ok":  # those beside a request gone before its first token say so (their share an estimate's)
                    flagged = [e for _, e, _, _, n in got if e is not None and "gone-prefill-beside" in (n or "")]
                    print(f"    {len(flagged)} flagged gone-prefill-beside" + (
                        f": {100 * min(flagged):+.0f}% to {100 * max(flagged):+.0f}%" if flagged else ""))
                if cls == "cutd":
                    print("    tokens (row/truth): " + ", ".join(f"{a:.0f}/{g}" for _, _, g, a, _ in got if a is not None))


if __name__ == "__main__":
    main()
