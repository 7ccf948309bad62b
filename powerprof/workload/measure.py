"""`powerprof measure`: J/token and decode tok/s at the current settings, one windows row per request.

Changes nothing on the GPU and needs no root: it only reads energy counters (through the
Profiler) at the edges of each decode window while the load runs. Concurrent batches get a
row of their own whose energy and tokens are taken over exactly the measured intervals.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import aiohttp
import numpy as np

from .client import RequestParams, RequestRecord, ServerInfo, detect_server
from .load import LoadAborted, LoadPolicy, Prompt, run_load_async
from .rows import window_rows

NO_GPU_NOTE = "no GPU readable here: GPU energy columns are empty; decode tok/s {cpu}"


@dataclass
class Summary:
    """One line of the printed result: a concurrency level."""

    concurrency: int
    n_ok: int
    n_failed: int
    decode_tok_s: float | None  # concurrency 1: median over requests; else the wall-clock aggregate
    gpu_j_per_token: float | None
    total_j_per_token: float | None
    energy_method: str


@dataclass
class MeasureResult:
    server: ServerInfo
    records: list[RequestRecord]
    rows: list[dict]
    summaries: list[Summary]
    notes: list[str] = field(default_factory=list)
    out_path: Path | None = None
    aborted: str | None = None

    def to_dict(self) -> dict:
        """`powerprof measure --json`: stable keys; per-request rows stay in windows.parquet."""
        s = self.server
        return {
            "server": {**s.meta(), "simulated": s.simulated},
            "concurrencies": [asdict(m) for m in self.summaries],
            "notes": list(self.notes),
            "windows_path": None if self.out_path is None else str(self.out_path / "windows.parquet"),
            "aborted": self.aborted,
        }


def summarise(rows: list[dict]) -> list[Summary]:
    out = []
    for c in sorted({r["concurrency"] for r in rows if not r["warmup"]}):
        req = [r for r in rows if r["concurrency"] == c and r["window_kind"] == "request" and not r["warmup"]]
        ok = [r for r in req if r["status"] == "ok"]
        failed = len(req) - len(ok)
        basis = ok if c == 1 else [r for r in rows if r["concurrency"] == c and r["window_kind"] == "batch" and r["status"] == "ok"]
        if c == 1:
            rates = [r["decode_tok_s"] for r in basis if r["decode_tok_s"]]
            tok_s = float(np.median(rates)) if rates else None
        else:
            dur = sum(r["decode_s"] or 0 for r in basis)
            tok_s = sum(r["decode_tokens"] or 0 for r in basis) / dur if dur > 0 else None
        tokens = sum(r["decode_tokens"] or 0 for r in basis)
        gpu = [r["gpu_energy_j"] for r in basis]
        tot = [(r["gpu_energy_j"], r["cpu_energy_j"]) for r in basis]
        gpu_jpt = sum(gpu) / tokens if basis and tokens and all(g is not None for g in gpu) else None
        tot_jpt = (
            sum(g + c_ for g, c_ in tot) / tokens
            if basis and tokens and all(g is not None and c_ is not None for g, c_ in tot)
            else None
        )
        methods = {r["energy_method"] for r in basis} or {"none"}
        out.append(Summary(c, len(ok), failed, tok_s, gpu_jpt, tot_jpt, ",".join(sorted(methods))))
    return out


def measure(
    url: str,
    *,
    prompts: Sequence[Prompt],
    n_requests: int,
    concurrencies: Sequence[int] = (1,),
    params: RequestParams = RequestParams(),
    warmup: int = 1,
    api: str | None = None,
    profiler=None,
    policy: LoadPolicy = LoadPolicy(),
    run_id: str | None = None,
) -> MeasureResult:
    """Run the load at each concurrency with `profiler` (a started Profiler, or None) marking
    every window edge; returns the rows for windows.parquet and a summary per concurrency."""
    run_id = run_id or uuid.uuid4().hex[:12]
    hook = profiler.mark if profiler is not None else None

    async def go():
        records: list[RequestRecord] = []
        aborted = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            server = await detect_server(s, url, api)
            rid = bid = 0
            for k, c in enumerate(concurrencies):
                try:
                    recs = await run_load_async(
                        server, prompts, n_requests, c, params, hook, warmup if k == 0 else 0, policy, s, rid, bid
                    )
                except LoadAborted as e:
                    records += e.records
                    aborted = str(e)
                    break
                records += recs
                rid = max(r.request_id for r in records) + 1
                bid = max(r.batch_id for r in records) + 1
        return server, records, aborted

    server, records, aborted = asyncio.run(go())
    rows, _ = window_rows(records, profiler, run_id, server)
    return MeasureResult(server, records, rows, summarise(rows), aborted=aborted)


def run_measure(
    rig,
    *,
    url: str | None,
    out_dir: Path,
    prompts: Sequence[Prompt],
    n_requests: int,
    concurrencies: Sequence[int],
    params: RequestParams,
    warmup: int = 1,
    api: str | None = None,
    launch: str | None = None,
    launch_timeout_s: float = 300.0,
    interval_s: float = 1.0,
    command_line: str = "",
    sim_decode_tok_s: float | None = None,
) -> MeasureResult:
    """Everything `powerprof measure` does on the `rig` (powerprof.rig.Rig: its GPUs, RAPL and
    server, whatever they are): Profiler, load, windows.parquet and run.json in `out_dir`. Reads
    counters only; changes no setting."""
    from contextlib import ExitStack

    from powerprof import __version__
    from powerprof.profiler import Profiler
    from powerprof.storage.runs import RunWriter, split_storable, table_from_rows

    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty; choose another --out")
    notes: list[str] = []
    with ExitStack() as stack:
        src = rig.sources
        url = stack.enter_context(rig.server(url, launch, launch_timeout_s=launch_timeout_s, sim_decode_tok_s=sim_decode_tok_s))
        notes.extend(rig.notes)
        for p in src.problems:
            if p.source == "nvml" and src.nvml is None:
                cpu = "and CPU energy" if src.rapl is not None else "only"
                notes.append(NO_GPU_NOTE.format(cpu=cpu) + f" ({p.message})")
            elif p.source == "rapl":
                notes.append(f"{p.message}" + (f"; fix: {p.fix}" if p.fix else ""))
        profiler = None
        if src.nvml is not None or src.rapl is not None:
            nv = src.nvml
            profiler = Profiler(nv.nvml if nv else None, nv.indexes if nv else None, src.rapl, interval_s=interval_s)
            stack.enter_context(profiler)
        run_id = uuid.uuid4().hex[:12]
        result = measure(
            url,
            prompts=prompts,
            n_requests=n_requests,
            concurrencies=concurrencies,
            params=params,
            warmup=warmup,
            api=api,
            profiler=profiler,
            run_id=run_id,
        )
        gpus = [{"index": i.index, "uuid": i.uuid, "name": i.name, "driver": i.driver_version} for i in (profiler.gpu_infos if profiler else [])]
    s = result.server
    meta = {
        "kind": "measure",
        "run_id": run_id,
        "version": __version__,
        "command_line": command_line,
        **rig.meta(),
        "server": s.meta(),
        "gpus": gpus,
        "params": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "seed": params.seed,
            "ignore_eos": params.ignore_eos,
            "prompt_cache": params.prompt_cache,
            "n_requests": n_requests,
            "concurrency": list(concurrencies),
            "warmup": warmup,
        },
        "notes": notes,
        "aborted": result.aborted,
    }
    meta["simulated"] = meta["simulated"] or s.simulated
    result.rows, bad, err = split_storable("windows", result.rows)
    if bad:
        notes.append(f"{len(bad)} window row(s) could not be stored and are left out of every figure ({err})")
    writer = RunWriter(out_dir, meta)
    writer.write("windows", table_from_rows("windows", result.rows))
    result.notes = notes
    result.out_path = out_dir
    return result
