"""`powerprof measure`: J/token and decode tok/s at the current settings, one windows row per request.

Changes nothing on the GPU and needs no root: it only reads energy counters (through the
Profiler) at the edges of each decode window while the load runs. Concurrent batches get a
row of their own whose energy and tokens are taken over exactly the measured intervals.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import aiohttp
import numpy as np

from powerprof.profiler import LOW_CONFIDENCE_S
from powerprof.windows import concurrent_throughput

from .client import RequestParams, RequestRecord, ServerInfo, detect_server
from .load import LoadAborted, LoadPolicy, Prompt, run_load_async

NO_GPU_NOTE = "no GPU readable here: GPU energy columns are empty; decode tok/s {cpu}"
SIM_CPU_IDLE_W = 30.0  # simulated CPU package power with the server idle


@dataclass(frozen=True)
class BatchWindow:
    """A concurrent batch measured over the intervals where all its active requests decode."""

    batch_id: int
    concurrency: int
    intervals: np.ndarray  # (k, 2) t0_ns, t1_ns
    measured_s: float
    decode_tokens: float
    tok_s: float | None
    sum_of_request_rates: float  # shown beside tok_s so nobody mistakes it for throughput


def batch_windows(records: Sequence[RequestRecord]) -> list[BatchWindow]:
    """Aggregate throughput of every concurrent batch (concurrency > 1, warm-ups excluded).

    Failed attempts block the time they spanned: what the server did for them is unknown.
    """
    by_batch: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.batch_id is not None and r.concurrency > 1 and not r.warmup:
            by_batch.setdefault(r.batch_id, []).append(r)
    out = []
    for bid, recs in sorted(by_batch.items()):
        ok = [r for r in recs if r.ok]
        blocked = [(r.t_send_ns, r.t_end_ns) for r in recs if not r.ok]
        # A stream's reads outside its fresh edges (arrival.py) came late by an unknown amount: the
        # time they span is blocked like a failed attempt's, so no interval relies on them.
        for r in ok:
            q = r.quality
            if q.t_first_ns is not None and q.t_first_ns > r.t_first_ns:
                blocked.append((r.t_first_ns, q.t_first_ns))
            if q.t_last_ns is not None and q.t_last_ns < r.t_last_ns:
                blocked.append((q.t_last_ns, r.t_last_ns))
        agg = concurrent_throughput([(r.t_send_ns, *r.arrivals(), r.generated_tokens) for r in ok], blocked)
        out.append(
            BatchWindow(
                bid,
                recs[0].concurrency,
                agg.intervals,
                agg.measured_s,
                agg.decode_tokens,
                agg.tok_s,
                float(sum(r.decode_tok_s for r in ok if r.decode_tok_s)),
            )
        )
    return out


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
    n_trusted: int = 0  # windows the figures come from (request rows at 1, batch rows above)


@dataclass
class MeasureResult:
    server: ServerInfo
    records: list[RequestRecord]
    rows: list[dict]
    summaries: list[Summary]
    notes: list[str] = field(default_factory=list)
    out_path: Path | None = None
    aborted: str | None = None
    excluded: Excluded | None = None


def _utc(ns: int | None):
    return None if ns is None else datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)


def _div(a, b):
    return a / b if a is not None and b else None


def request_timing(r: RequestRecord):
    """The record's Timing (powerprof/arrival.py) and the energy window edges it implies (None: no energy)."""
    tm = r.timing
    if tm is None or tm.kind == "untrusted" or tm.t0_ns is None:
        return tm, None
    return tm, (tm.t0_ns, tm.t1_ns)


def request_energy(profiler, r: RequestRecord):
    """The Profiler's energy over the window the record's timing uses; None when it has none."""
    _, edges = request_timing(r)
    if profiler is None or edges is None or edges[1] <= edges[0]:
        return None
    return profiler.energy_between(*edges)


def request_row(r: RequestRecord, energy=None, run_id: str = "", server: ServerInfo | None = None) -> dict:
    """A WINDOWS row for one attempt; `energy` is the Profiler's EnergyResult over its window
    (`request_energy`: the edges follow the timing used)."""
    tm = r.timing
    trusted = tm is not None and tm.kind != "untrusted"
    gpu_e = energy.gpu_energy_total_j if energy is not None and trusted else None
    cpu_e = energy.cpu_energy_j if energy is not None and trusted else None
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    t = r.server_timings
    q = r.quality if r.ok else None
    decode_s = tm.decode_s if trusted else r.decode_s
    decode_n = tm.decode_tokens if trusted else (r.decode_tokens if r.ok else None)
    server_rate = _div(r.server_decode_tokens, r.server_decode_s)
    return {
        "run_id": run_id,
        "level_kind": "none",
        "repeat": 0,
        "window_kind": "request",
        "request_id": r.request_id,
        "batch_id": r.batch_id,
        "concurrency": r.concurrency,
        "warmup": r.warmup,
        "status": r.status,
        "error": r.error,
        "api": r.api,
        "model": r.model or (server.model if server else None),
        "prompt_id": r.prompt_id,
        "t_send_utc": _utc(r.t_send_wall_ns),
        "t_first_utc": _utc(r.to_wall_ns(r.t_first_ns)),
        "t_last_utc": _utc(r.to_wall_ns(r.t_last_ns)),
        "ttft_s": r.ttft_s,
        "decode_s": decode_s,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.generated_tokens if r.ok else None,
        "decode_tokens": decode_n,
        # An untrusted window has no rate and no J/token: a number there would be a wrong one.
        "decode_tok_s": _div(decode_n, decode_s) if trusted else None,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_e,
        "energy_method": energy.method if energy is not None and trusted else "none",
        "avg_gpu_power_w": energy.avg_gpu_power_w if energy is not None and trusted else None,
        "gpu_j_per_token": _div(gpu_e, decode_n) if trusted else None,
        "total_j_per_token": _div(total, decode_n) if trusted else None,
        "server_prompt_n": t.get("prompt_n"),
        "server_predicted_n": t.get("predicted_n"),
        "server_prompt_ms": t.get("prompt_ms"),
        "server_predicted_ms": t.get("predicted_ms"),
        "server_predicted_per_second": t.get("predicted_per_second"),
        "draft_n": r.draft_n,
        "draft_n_accepted": r.draft_n_accepted,
        "stop_reason": r.stop_reason,
        "low_confidence": energy.low_confidence if energy is not None and trusted else True,
        "attempt": r.attempt,
        "http_status": r.http_status,
        "token_source": r.token_source,
        "server_kind": server.kind if server else None,
        # Text only when the user asked for it (--keep-text); the record holds none otherwise.
        "prompt_text": r.prompt_text,
        "completion_text": r.completion_text,
        "timing": tm.kind if tm is not None else None,
        "timing_reason": tm.reason if tm is not None else None,
        "stream_decode_s": r.decode_s,
        "stream_decode_tok_s": r.decode_tok_s,
        "stream_error_bound_pct": _pct(tm.stream_error_bound) if tm is not None else None,
        "n_reads": q.n_reads if q else None,
        "n_token_events": q.n_events if q else None,
        "max_read_share": q.max_read_share if q else None,
        "max_events_per_read": q.max_events_per_read if q else None,
        "read_gap_p50_s": q.gap_p50_s if q else None,
        "read_gap_max_s": q.gap_max_s if q else None,
        "client_lag_edge_s": r.client_lag_s,
        "client_lag_max_s": r.client_lag_max_s,
        "server_decode_s": r.server_decode_s,
        "server_decode_tokens": r.server_decode_tokens,
        "server_decode_tok_s": server_rate,
        "server_timing_source": r.server_timing_source,
        "stream_vs_server_pct": _pct(tm.disagreement) if tm is not None else None,
        "truncated": r.truncated,
    }


def _pct(x):
    return None if x is None or not np.isfinite(x) else 100.0 * x


def _energy_over(profiler, intervals: np.ndarray):
    """Sum of the Profiler's energy over several intervals; None when nothing is readable."""
    if profiler is None or intervals.size == 0:
        return None, None, "none"
    gpu, cpu, methods = 0.0, 0.0, set()
    gpu_ok = cpu_ok = True
    for t0, t1 in intervals:
        e = profiler.energy_between(int(t0), int(t1))
        methods.add(e.method)
        if e.gpu_energy_total_j is None:
            gpu_ok = False
        else:
            gpu += e.gpu_energy_total_j
        if e.cpu_energy_j is None:
            cpu_ok = False
        else:
            cpu += e.cpu_energy_j
    rank = ["counter", "power_integration", "avg_power_integration", "none"]
    method = max(methods, key=lambda m: rank.index(m) if m in rank else len(rank))
    return (gpu if gpu_ok else None), (cpu if cpu_ok else None), method


def batch_row(b: BatchWindow, recs: Sequence[RequestRecord], profiler, run_id: str, server: ServerInfo) -> dict:
    gpu_e, cpu_e, method = _energy_over(profiler, b.intervals)
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    t0 = int(b.intervals[0, 0]) if b.intervals.size else None
    t1 = int(b.intervals[-1, 1]) if b.intervals.size else None
    ref = recs[0]
    ok = [r for r in recs if r.ok]
    # The batch's intervals come from arrival times: every member's stream must be trusted.
    bad = [_batch_problem(r) for r in ok]
    bad = [b for b in bad if b]
    timing, reason = ("untrusted", f"{len(bad)} of {len(ok)} streams not stream-timed: {bad[0]}") if bad else ("stream", None)
    if bad:
        gpu_e = cpu_e = total = None
    return {
        "run_id": run_id,
        "level_kind": "none",
        "repeat": 0,
        "window_kind": "batch",
        "batch_id": b.batch_id,
        "concurrency": b.concurrency,
        "warmup": False,
        "status": "ok" if b.tok_s is not None and len(ok) == len({r.request_id for r in recs}) else "failed",
        "error": None if b.tok_s is not None else "no interval where every active request decoded",
        "api": ref.api,
        "model": ref.model or server.model,
        "t_send_utc": _utc(min(r.t_send_wall_ns for r in recs)),
        "t_first_utc": _utc(ref.to_wall_ns(t0)),
        "t_last_utc": _utc(ref.to_wall_ns(t1)),
        "decode_s": b.measured_s,
        "generated_tokens": int(sum(r.generated_tokens for r in ok)),
        "decode_tokens": int(round(b.decode_tokens)),
        "decode_tok_s": b.tok_s if not bad else None,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_e,
        "energy_method": method if not bad else "none",
        "avg_gpu_power_w": _div(gpu_e, b.measured_s) if gpu_e is not None else None,
        "gpu_j_per_token": _div(gpu_e, b.decode_tokens),
        "total_j_per_token": _div(total, b.decode_tokens),
        "draft_n": _sum_or_none(r.draft_n for r in ok),
        "draft_n_accepted": _sum_or_none(r.draft_n_accepted for r in ok),
        "low_confidence": b.measured_s < LOW_CONFIDENCE_S.get(method, float("inf")),
        "server_kind": server.kind,
        "timing": timing,
        "timing_reason": reason,
    }


def _batch_problem(r: RequestRecord) -> str | None:
    tm = r.timing
    return tm.reason if tm is not None and tm.kind != "stream" else None


def _sum_or_none(vals):
    vals = list(vals)
    return None if not vals or any(v is None for v in vals) else int(sum(vals))


def trusted(row: dict) -> bool:
    """A window whose figures can be used: not untrusted by the timing rule (old rows have no timing)."""
    return row.get("timing") != "untrusted"


@dataclass(frozen=True)
class Excluded:
    """Windows left out of every figure because their timing cannot be trusted."""

    n: int
    n_windows: int  # windows that would otherwise have counted
    reasons: dict  # reason → count
    fix: str

    def message(self) -> str:
        top = max(self.reasons, key=self.reasons.get)
        return (
            f"{self.n} of {self.n_windows} windows left out of the figures: their token timing cannot be trusted "
            f"({top}); fix: {self.fix}"
        )


def excluded_windows(rows: Sequence[dict], counted_kind=None) -> Excluded | None:
    """What the figures left out: measured (non-warm-up, ok) windows that are untrusted."""
    from powerprof.arrival import fix_for, reason_group

    def measured(r):
        kind = counted_kind(r) if counted_kind else ("request" if r["concurrency"] == 1 else "batch")
        return r["window_kind"] == kind and not r["warmup"] and r["status"] == "ok"

    cand = [r for r in rows if measured(r)]
    bad = [r for r in cand if not trusted(r)]
    if not bad:
        return None
    reasons: dict = {}
    for r in bad:
        key = reason_group(r.get("timing_reason"))
        reasons[key] = reasons.get(key, 0) + 1
    top = max(reasons, key=reasons.get)
    return Excluded(len(bad), len(cand), reasons, fix_for(top))


def summarise(rows: list[dict]) -> list[Summary]:
    out = []
    for c in sorted({r["concurrency"] for r in rows if not r["warmup"]}):
        req = [r for r in rows if r["concurrency"] == c and r["window_kind"] == "request" and not r["warmup"]]
        ok = [r for r in req if r["status"] == "ok"]
        failed = len(req) - len(ok)
        basis = ok if c == 1 else [r for r in rows if r["concurrency"] == c and r["window_kind"] == "batch" and r["status"] == "ok"]
        basis = [r for r in basis if trusted(r)]
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
        n_trusted = len([r for r in ok if trusted(r)]) if c == 1 else len(basis)
        out.append(Summary(c, len(ok), failed, tok_s, gpu_jpt, tot_jpt, ",".join(sorted(methods)), n_trusted))
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

    notes: list[str] = []

    async def go():
        records: list[RequestRecord] = []
        aborted = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            server = await detect_server(s, url, api)
            rid = bid = 0
            for k, c in enumerate(concurrencies):
                note = saturation_note(server, c)
                if note:
                    notes.append(note)
                probe = asyncio.get_running_loop().create_task(_max_waiting(s, server)) if c > 1 and server.kind == "vllm" else None
                try:
                    recs = await run_load_async(
                        server, prompts, n_requests, c, params, hook, warmup if k == 0 else 0, policy, s, rid, bid
                    )
                except LoadAborted as e:
                    records += e.records
                    aborted = str(e)
                    break
                finally:
                    waiting = await _stop(probe)
                if waiting:
                    notes.append(
                        f"concurrency {c}: vLLM queued up to {waiting:g} requests (more streams than it runs at once): "
                        "queued time is excluded from the windows, but this is not the server's steady state at this concurrency"
                    )
                records += recs
                rid = max(r.request_id for r in records) + 1
                bid = max(r.batch_id for r in records) + 1
        return server, records, aborted

    server, records, aborted = asyncio.run(go())
    rows = []
    for r in records:
        rows.append(request_row(r, request_energy(profiler, r), run_id, server))
    for b in batch_windows(records):
        recs = [r for r in records if r.batch_id == b.batch_id]
        rows.append(batch_row(b, recs, profiler, run_id, server))
    notes += [f"request {r.request_id} ({r.prompt_id}): {r.truncated}" for r in records if r.ok and r.truncated and not r.warmup][:5]
    return MeasureResult(server, records, rows, summarise(rows), notes=notes, aborted=aborted, excluded=excluded_windows(rows))


def saturation_note(server: ServerInfo, concurrency: int) -> str | None:
    """More streams than llama.cpp has slots: the rest wait in its queue (a warning, said once)."""
    if server.total_slots and concurrency > server.total_slots:
        return (
            f"concurrency {concurrency} exceeds the server's {server.total_slots} slots: requests queue; only intervals where "
            "every active request decodes are measured, and they show the server saturated"
        )
    return None


async def _max_waiting(session, server: ServerInfo) -> float:
    """Polls vLLM's `num_requests_waiting` until cancelled; returns the most seen (in CancelledError's place)."""
    from .client import fetch_metrics

    most = 0.0
    try:
        while True:
            m = await fetch_metrics(session, server.base_url)
            most = max(most, (m or {}).get("waiting", 0.0))
            await asyncio.sleep(0.25)
    except asyncio.CancelledError:
        return most


async def _stop(task) -> float:
    if task is None:
        return 0.0
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return 0.0


def run_measure(
    *,
    url: str | None,
    simulate: str | None,
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
    """Everything `powerprof measure` does: server (simulated, launched or given), Profiler, load,
    windows.parquet and run.json in `out_dir`. Reads counters only; changes no setting."""
    from contextlib import ExitStack

    from powerprof import __version__
    from powerprof.collectors.sources import open_sources
    from powerprof.profiler import Profiler
    from powerprof.storage.runs import RunWriter, table_from_rows

    from .launcher import ServerLauncher

    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty; choose another --out")
    notes: list[str] = []
    with ExitStack() as stack:
        busy = [False]
        cpu_busy_w = 0.0
        if simulate:
            from powerprof.sim.profiles import get_profile

            cpu_busy_w = get_profile(simulate).workload.cpu_busy_w
        # Simulated CPU package power follows the simulated server's busy flag.
        src = open_sources(
            simulate=simulate, host=False, sim_cpu_power_w_fn=(lambda: SIM_CPU_IDLE_W + (cpu_busy_w if busy[0] else 0.0))
        )
        stack.callback(src.close)
        if simulate:
            from powerprof.sim.server import SimServer

            srv = stack.enter_context(SimServer(src.sim_nvml, decode_tok_s=sim_decode_tok_s))
            srv.on_busy(lambda b: busy.__setitem__(0, b))
            url = srv.url
            notes.append(f"simulated GPU ({simulate}) and simulated server: figures demonstrate the method only")
        elif launch:
            stack.enter_context(ServerLauncher(launch, url, timeout_s=launch_timeout_s))
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
        "simulated": bool(simulate) or s.simulated,
        "server": {
            "url": s.base_url,
            "kind": s.kind,
            "api": s.api,
            "model": s.model,
            "build_info": s.build_info,
            "model_path": s.model_path,
            "total_slots": s.total_slots,
        },
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
        "notes": notes + result.notes,
        "aborted": result.aborted,
    }
    writer = RunWriter(out_dir, meta)
    writer.write("windows", table_from_rows("windows", result.rows))
    result.notes = notes + result.notes
    result.out_path = out_dir
    return result
