"""windows.parquet rows: the one builder of a request's or a concurrent batch's row, for sweep and measure alike."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Sequence

import numpy as np

from powerprof.profiler import LOW_CONFIDENCE_S, weakest_method
from powerprof.windows import concurrent_throughput

from .client import RequestRecord, ServerInfo


@dataclass(frozen=True)
class Level:
    """Which setting a window was measured at; `none` outside a sweep."""

    kind: str = "none"  # none | power_limit | sm_clock
    value: float | None = None
    repeat: int = 0


NO_LEVEL = Level()


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


def _utc(ns: int | None):
    return None if ns is None else datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)


def _div(a, b):
    return a / b if a is not None and b else None


def request_row(
    r: RequestRecord, energy=None, run_id: str = "", server: ServerInfo | None = None, level: Level = NO_LEVEL
) -> dict:
    """A WINDOWS row for one attempt; `energy` is the Profiler's EnergyResult over its window."""
    gpu_e = energy.gpu_energy_total_j if energy is not None else None
    cpu_e = energy.cpu_energy_j if energy is not None else None
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    t = r.server_timings
    return {
        "run_id": run_id,
        "level_kind": level.kind,
        "level_value": level.value,
        "repeat": level.repeat,
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
        "decode_s": r.decode_s,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.generated_tokens if r.ok else None,
        "decode_tokens": r.decode_tokens if r.ok else None,
        "decode_tok_s": r.decode_tok_s,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_e,
        "energy_method": energy.method if energy is not None else "none",
        "avg_gpu_power_w": energy.avg_gpu_power_w if energy is not None else None,
        "gpu_j_per_token": _div(gpu_e, r.decode_tokens) if r.ok else None,
        "total_j_per_token": _div(total, r.decode_tokens) if r.ok else None,
        "server_prompt_n": t.get("prompt_n"),
        "server_predicted_n": t.get("predicted_n"),
        "server_prompt_ms": t.get("prompt_ms"),
        "server_predicted_ms": t.get("predicted_ms"),
        "server_predicted_per_second": t.get("predicted_per_second"),
        "draft_n": r.draft_n,
        "draft_n_accepted": r.draft_n_accepted,
        "stop_reason": r.stop_reason,
        "low_confidence": energy.low_confidence if energy is not None else True,
        "attempt": r.attempt,
        "http_status": r.http_status,
        "token_source": r.token_source,
        "server_kind": server.kind if server else None,
        # Text only when the user asked for it (--keep-text); the record holds none otherwise.
        "prompt_text": r.prompt_text,
        "completion_text": r.completion_text,
    }


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
    return (gpu if gpu_ok else None), (cpu if cpu_ok else None), weakest_method(methods)


def batch_row(
    b: BatchWindow, recs: Sequence[RequestRecord], profiler, run_id: str, server: ServerInfo, level: Level = NO_LEVEL
) -> dict:
    gpu_e, cpu_e, method = _energy_over(profiler, b.intervals)
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    t0 = int(b.intervals[0, 0]) if b.intervals.size else None
    t1 = int(b.intervals[-1, 1]) if b.intervals.size else None
    ref = recs[0]
    ok = [r for r in recs if r.ok]
    return {
        "run_id": run_id,
        "level_kind": level.kind,
        "level_value": level.value,
        "repeat": level.repeat,
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
        "decode_tok_s": b.tok_s,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_e,
        "energy_method": method,
        "avg_gpu_power_w": _div(gpu_e, b.measured_s),
        "gpu_j_per_token": _div(gpu_e, b.decode_tokens),
        "total_j_per_token": _div(total, b.decode_tokens),
        "draft_n": _sum_or_none(r.draft_n for r in ok),
        "draft_n_accepted": _sum_or_none(r.draft_n_accepted for r in ok),
        "low_confidence": b.measured_s < LOW_CONFIDENCE_S.get(method, float("inf")),
        "server_kind": server.kind,
    }


def _sum_or_none(vals):
    vals = list(vals)
    return None if not vals or any(v is None for v in vals) else int(sum(vals))


def window_rows(records: Sequence[RequestRecord], profiler, run_id: str, server: ServerInfo, level: Level = NO_LEVEL):
    """Every row these records make: one per attempt, then one per concurrent batch, and the batches
    themselves (their measured intervals are what a sweep's sensor figures are taken over)."""
    rows = []
    for r in records:
        e = profiler.energy_between(r.t_first_ns, r.t_last_ns) if profiler is not None and r.ok and r.t_last_ns else None
        rows.append(request_row(r, e, run_id, server, level))
    batches = batch_windows(records)
    for b in batches:
        recs = [r for r in records if r.batch_id == b.batch_id]
        rows.append(batch_row(b, recs, profiler, run_id, server, level))
    return rows, batches
