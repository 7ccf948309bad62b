"""windows.parquet rows: the one builder of a request's, a concurrent batch's or a replayed trace's row, for sweep and measure alike."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Sequence

import numpy as np

from powerprof.profiler import COUNTER_REFRESH_MAX_NS, LOW_CONFIDENCE_S, MAX_POWER_GAP_S, METHOD_NONE, POWER_EDGE_BIAS_SHARE, weakest_method
from powerprof.windows import concurrent_throughput

from .client import IGNORE_EOS_KINDS, RequestRecord, ServerInfo

# A batch window's error where its streams never all decoded at once (queued behind the server's slots, staggered).
NO_DECODE_INTERVAL = "no interval where every active request decoded"
# A batch whose streams decoded at once, time-weighted over its measured intervals, fewer than this share of the
# streams it sent (its achieved concurrency) has no figure: its throughput and J/token are those of fewer streams
# than its `concurrency` says, the shortfall's share off (decode is memory-bound: a step serves every stream for
# about the time of one). A batch sent together on the simulator achieves 99.5% of its streams; long prompts with
# 32-token outputs (the first streams' tails) 96.6%; one stream sent 0.1 s late into a 0.6 s decode 87%.
ACHIEVED_CONCURRENCY_SHARE = 0.95
# A batch whose streams started together but ended apart (stopped at different lengths: a server sent no ignore_eos
# stops each at its end-of-text) is measured over the span where all of them decode, when each of its streams
# delivered at least this many tokens there on average: the span ends at one stream's last token, and its
# companions' tokens of that step fall either side of it, up to half a step's tokens off (1/(2·16) = 3%).
MIN_TOGETHER_TOKENS_PER_STREAM = 16
# A window's figures: what a window left out of every figure (untrusted, beside others' work, lost) loses.
FIGURES = ("gpu_energy_j", "cpu_energy_j", "avg_gpu_power_w", "gpu_j_per_token", "total_j_per_token",
           "above_idle_gpu_j_per_token", "decode_tok_s", "gpu_energy_j_by_gpu")
# Row key, not a column: each GPU's part of gpu_energy_j (J, in the profiler's GPU order), for `measure`'s
# per-GPU account of what its J/token sums (run.json `per_gpu`); None where gpu_energy_j is.
BY_GPU = "gpu_energy_j_by_gpu"


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
    max_streams: int = 0  # the most of its streams decoding at once inside the intervals
    mean_streams: float = 0.0  # its streams decoding at once inside the intervals, time-weighted: the achieved concurrency
    # Its streams started together and ended apart: measured over the span where all of them decode when that held
    # enough tokens (then mean_streams is theirs), else left whole, and left out by batch_row for that reason.
    ended_apart: bool = False
    together_tokens: float = 0.0  # decode tokens inside that span (measured or not)
    together_s: float = 0.0  # its measured length


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
        reqs = [(r.t_send_ns, *r.arrivals(), r.generated_tokens) for r in ok]
        # Pieces shorter than the counter's refresh would leave the whole batch without an energy figure (profiler.
        # COUNTER_REFRESH_MAX_NS): left out of its tokens, time and energy alike, by length.
        agg = concurrent_throughput(reqs, blocked, min_interval_ns=COUNTER_REFRESH_MAX_NS)
        n = len(ok)
        ended, together = False, None
        if (agg.tok_s is not None and agg.max_streams == n and agg.mean_streams < ACHIEVED_CONCURRENCY_SHARE * n
                and agg.start_mean_streams >= ACHIEVED_CONCURRENCY_SHARE * n and agg.together_ns is not None
                and len({r.generated_tokens for r in ok}) > 1):
            # Together up to the first stream's end, apart after it, at different lengths: they ended apart (equal
            # lengths ending apart started apart too: apart_reason's), and the span where all of them decode is a
            # figure at this batch's concurrency when it holds enough tokens.
            ended = True
            together = concurrent_throughput(reqs, blocked, within=agg.together_ns, min_interval_ns=COUNTER_REFRESH_MAX_NS)
            if (together.tok_s is not None and together.decode_tokens >= MIN_TOGETHER_TOKENS_PER_STREAM * n
                    and together.mean_streams >= ACHIEVED_CONCURRENCY_SHARE * n):
                agg = together
        out.append(
            BatchWindow(
                bid,
                recs[0].concurrency,
                agg.intervals,
                agg.measured_s,
                agg.decode_tokens,
                agg.tok_s,
                float(sum(r.decode_tok_s for r in ok if r.decode_tok_s)),
                agg.max_streams,
                agg.mean_streams,
                ended,
                together.decode_tokens if together is not None else 0.0,
                together.measured_s if together is not None else 0.0,
            )
        )
    return out


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
    tm, edges = request_timing(r)
    if profiler is None or edges is None or edges[1] <= edges[0]:
        return None
    return profiler.energy_between(*edges, placed=tm.kind == "server")


def request_row(
    r: RequestRecord, energy=None, run_id: str = "", server: ServerInfo | None = None, level: Level = NO_LEVEL
) -> dict:
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
        "decode_s": decode_s,
        "prompt_tokens": r.prompt_tokens,
        "generated_tokens": r.generated_tokens if r.ok else None,
        "decode_tokens": decode_n,
        # An untrusted window has no rate and no J/token: a number there would be a wrong one.
        "decode_tok_s": _div(decode_n, decode_s) if trusted else None,
        "gpu_energy_j": gpu_e,
        BY_GPU: tuple(float(e) for e in energy.gpu_energy_j) if gpu_e is not None else None,
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
        **cpu_time_columns(getattr(energy, "cpu_time", None) if trusted else None),
    }


def cpu_time_columns(cpu_time) -> dict:
    """The windows row's CPU-time columns from an EnergyResult's `cpu_time` (None: all null)."""
    if cpu_time is None:
        return {"host_cpu_s": None, "other_cpu_s": None, "powerprof_cpu_s": None}
    return {"host_cpu_s": cpu_time.host_busy_s, "other_cpu_s": cpu_time.other_cpu_s,
            "powerprof_cpu_s": cpu_time.powerprof_cpu_s}


def _pct(x):
    return None if x is None or not np.isfinite(x) else 100.0 * x


def _energy_over(profiler, intervals: np.ndarray):
    """Sum of the Profiler's energy over several intervals (GPUs together, and each GPU's: a tuple); None when
    nothing is readable.

    Its method is the weakest of those over at least POWER_EDGE_BIAS_SHARE of its time (any `none` counts): a 30 ms
    trailing piece of a 3 s batch on instant power (its counter broke there; pieces shorter than the counter's refresh
    are left out by `batch_windows`) labelled the whole batch power_integration and low_confidence, its tokens "on
    power" in measure's notes; its energy, about 1% of the batch's, cannot move the figure by the 0.5% that share
    stands for."""
    if profiler is None or intervals.size == 0:
        return None, None, "none", 0.0, None, None
    gpu, cpu, methods = 0.0, 0.0, {}
    by_gpu = None
    gpu_ok = cpu_ok = True
    gap_s = 0.0
    cpu_time, time_ok = None, True
    for t0, t1 in intervals:
        e = profiler.energy_between(int(t0), int(t1))
        ct = getattr(e, "cpu_time", None)
        if ct is None:
            time_ok = False
        else:
            cpu_time = ct if cpu_time is None else cpu_time + ct
        methods[e.method] = methods.get(e.method, 0) + int(t1) - int(t0)
        gap_s = max(gap_s, getattr(e, "power_gap_s", 0.0))
        if e.gpu_energy_total_j is None:
            gpu_ok = False
        else:
            gpu += e.gpu_energy_total_j
            by_gpu = tuple(a + b for a, b in zip(by_gpu or (0.0,) * len(e.gpu_energy_j), e.gpu_energy_j))
        if e.cpu_energy_j is None:
            cpu_ok = False
        else:
            cpu += e.cpu_energy_j
    total = sum(methods.values())
    named = {m for m, d in methods.items() if m == METHOD_NONE or d >= POWER_EDGE_BIAS_SHARE * total} or set(methods)
    return ((gpu if gpu_ok else None), (cpu if cpu_ok else None), weakest_method(named), gap_s,
            (cpu_time if time_ok else None), (by_gpu if gpu_ok else None))


def batch_row(
    b: BatchWindow, recs: Sequence[RequestRecord], profiler, run_id: str, server: ServerInfo, level: Level = NO_LEVEL
) -> dict:
    gpu_e, cpu_e, method, gap_s, cpu_time, by_gpu = _energy_over(profiler, b.intervals)
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    t0 = int(b.intervals[0, 0]) if b.intervals.size else None
    t1 = int(b.intervals[-1, 1]) if b.intervals.size else None
    ref = recs[0]
    ok = [r for r in recs if r.ok]
    # The batch's intervals come from arrival times: every member's stream must be trusted.
    bad = [batch_problem(r) for r in ok]
    bad = [b for b in bad if b]
    timing, reason = ("untrusted", f"{len(bad)} of {len(ok)} streams not stream-timed: {bad[0]}") if bad else ("stream", None)
    streams = len({r.request_id for r in ok})
    if not bad and b.tok_s is not None and b.max_streams < streams:
        # Its intervals hold fewer streams than were sent (the server ran them in turn): figures of
        # fewer streams under this batch's concurrency would be wrong ones.
        timing, reason = "untrusted", queued_reason(b.max_streams, streams)
        bad = [reason]
    elif not bad and b.tok_s is not None and b.mean_streams < ACHIEVED_CONCURRENCY_SHARE * streams:
        # All of them decoded together at some instant, but for too little of the time: the rest of its intervals
        # held fewer streams (one sent or started late), so its figures are those of fewer streams too.
        timing, reason = "untrusted", (ended_reason(b, [r.generated_tokens for r in ok], server.kind) if b.ended_apart
                                       else apart_reason(b.mean_streams, streams))
        bad = [reason]
    if bad:
        gpu_e = cpu_e = total = cpu_time = by_gpu = None
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
        "error": None if b.tok_s is not None else NO_DECODE_INTERVAL,
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
        BY_GPU: by_gpu,
        "cpu_energy_j": cpu_e,
        "energy_method": method if not bad else "none",
        "avg_gpu_power_w": _div(gpu_e, b.measured_s) if gpu_e is not None else None,
        "gpu_j_per_token": _div(gpu_e, b.decode_tokens),
        "total_j_per_token": _div(total, b.decode_tokens),
        "draft_n": _sum_or_none(r.draft_n for r in ok),
        "draft_n_accepted": _sum_or_none(r.draft_n_accepted for r in ok),
        "low_confidence": b.measured_s < LOW_CONFIDENCE_S.get(method, float("inf")) or gap_s > MAX_POWER_GAP_S,
        "server_kind": server.kind,
        "timing": timing,
        "timing_reason": reason,
        "mean_streams": b.mean_streams if b.tok_s is not None else None,
        **cpu_time_columns(cpu_time),
    }


QUEUED = "streams decoded at once"
DECODED_APART = "decoded apart"  # arrival.reason_group's key for apart_reason
ENDED_APART = "ended apart"  # and for ended_reason


def queued_reason(max_streams: int, streams: int) -> str:
    """Why a batch whose streams never all decoded together has no figure."""
    return (f"at most {max_streams} of {streams} {QUEUED}: the server queued the rest (more streams than its "
            "parallel slots) or one was retried")


def apart_reason(mean_streams: float, streams: int) -> str:
    """Why a batch whose streams decoded together for too little of its time has no figure."""
    return (f"on average {mean_streams:.1f} of {streams} streams decoded at once over its measured intervals (under "
            f"{100 * ACHIEVED_CONCURRENCY_SHARE:.0f}%): its streams {DECODED_APART}, one sent or started late (a client "
            "starved of CPU, or a server that started them apart), so its figures are those of fewer streams")


def ended_reason(b: BatchWindow, generated: Sequence[int], server_kind: str) -> str:
    """Why a batch whose streams started together but ended apart has no figure: all of them decoded together too briefly."""
    sent = ("" if server_kind in IGNORE_EOS_KINDS else
            f"; a {server_kind} server is sent no ignore_eos, so each stopped at its own end-of-text")
    return (f"its streams {ENDED_APART}: they started together but stopped at different lengths "
            f"({', '.join(str(g) for g in sorted(generated))} tokens{sent}), so on average {b.mean_streams:.1f} of "
            f"{len(generated)} decoded at once, and all of them together delivered {b.together_tokens:.0f} tokens "
            f"over {b.together_s:.2f} s, under the {MIN_TOGETHER_TOKENS_PER_STREAM} a stream a figure needs")


def batch_problem(r: RequestRecord) -> str | None:
    """Why a batch member's stream cannot time its batch (None when it can): its timing is not the stream's."""
    tm = r.timing
    return tm.reason if tm is not None and tm.kind != "stream" else None


def _sum_or_none(vals):
    vals = list(vals)
    return None if not vals or any(v is None for v in vals) else int(sum(vals))


def overlapping(edges: Sequence[tuple[int, int] | None]) -> list[bool]:
    """Whether another window overlaps each one (None: no window, never overlapping): sorted by start, a window that
    starts before the latest end so far overlaps that one."""
    out = [False] * len(edges)
    latest_end, latest = None, None
    for i in sorted((i for i, e in enumerate(edges) if e is not None), key=lambda i: edges[i][0]):
        t0, t1 = edges[i]
        if latest_end is not None and t0 < latest_end:
            out[i] = out[latest] = True
        if latest_end is None or t1 > latest_end:
            latest_end, latest = t1, i
    return out


def window_rows(records: Sequence[RequestRecord], profiler, run_id: str, server: ServerInfo, level: Level = NO_LEVEL):
    """Every row these records make: one per attempt, then one per concurrent batch, and the batches
    themselves (their measured intervals are what a sweep's sensor figures are taken over)."""
    rows = [request_row(r, request_energy(profiler, r), run_id, server, level) for r in records]
    # A request decoding beside others (concurrency > 1, a replayed trace): its window's energy is the whole GPU's,
    # spent on their work too. Its J/token was that energy over its own tokens (4x too high at concurrency 4, and
    # nothing said so); the batch (or trace) row has the figure.
    for row, shared in zip(rows, overlapping([request_timing(r)[1] for r in records])):
        row["shared_window"] = shared
        if shared:
            row["gpu_j_per_token"] = row["total_j_per_token"] = None
    batches = batch_windows(records)
    for b in batches:
        recs = [r for r in records if r.batch_id == b.batch_id]
        rows.append(batch_row(b, recs, profiler, run_id, server, level))
    return rows, batches


def trace_row(records: Sequence[RequestRecord], energy, run_id: str, server: ServerInfo, level: Level = NO_LEVEL) -> dict:
    """A WINDOWS row for a whole trace replayed at one level (`sweep --trace`): `energy` is the
    Profiler's EnergyResult over the replay (from before the first request to after the last), over
    every token generated: the traffic mix's J/token, idle gaps between requests included. Its
    speed, `decode_tok_s`, is the median request's own decode rate: a trace's throughput is set by
    its arrival times, not by the level."""
    ok = [r for r in records if r.ok]
    t0 = energy.t0_ns if energy is not None else min((r.t_send_ns for r in records), default=None)
    t1 = energy.t1_ns if energy is not None else max((r.t_end_ns for r in records), default=None)
    gpu_e = energy.gpu_energy_total_j if energy is not None else None
    cpu_e = energy.cpu_energy_j if energy is not None else None
    total = gpu_e + cpu_e if gpu_e is not None and cpu_e is not None else None
    tokens = int(sum(r.generated_tokens for r in ok))
    rates = [r.decode_tok_s for r in ok if r.decode_tok_s]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    failed = len(records) - len(ok)
    ref = records[0] if records else None
    # The energy is the replay's whatever the server says, but its tokens are the server's counts: one
    # that contradicts its stream leaves the per-token figures unknown.
    lies = [p for p in (r.count_problem for r in ok) if p]
    if lies:
        rates = []
    # A failed request's work (prefill, the tokens before the cut) is in the replay's energy and none of
    # its tokens are counted: the J/token was too high by that work, and another level, where every
    # request succeeded, served other traffic. The row is failed: in no figure, the error says why.
    if failed:
        rates = []
        errs = [r.error for r in records if not r.ok]
        first = next((e for e in errs if e), "no reason given")
    return {
        "run_id": run_id,
        "level_kind": level.kind,
        "level_value": level.value,
        "repeat": level.repeat,
        "window_kind": "trace",
        "concurrency": 1,
        "warmup": False,
        "status": "ok" if ok and not failed else "failed",
        "error": f"{failed} of {len(records)} requests failed (first: {first})" if failed else None,
        "api": ref.api if ref else None,
        "model": (ref.model if ref else None) or (server.model if server else None),
        "t_send_utc": _utc(ref.to_wall_ns(t0)) if ref else None,
        "t_first_utc": _utc(ref.to_wall_ns(t0)) if ref else None,
        "t_last_utc": _utc(ref.to_wall_ns(t1)) if ref else None,
        "ttft_s": float(np.median(ttft)) if ttft else None,
        "decode_s": (t1 - t0) / 1e9 if t0 is not None else None,
        "prompt_tokens": int(sum(r.prompt_tokens or 0 for r in ok)),
        "generated_tokens": tokens,
        "decode_tokens": tokens,
        "decode_tok_s": float(np.median(rates)) if rates else None,
        "gpu_energy_j": gpu_e,
        "cpu_energy_j": cpu_e,
        "energy_method": energy.method if energy is not None else "none",
        "avg_gpu_power_w": energy.avg_gpu_power_w if energy is not None else None,
        "gpu_j_per_token": None if lies or failed else _div(gpu_e, tokens),
        "total_j_per_token": None if lies or failed else _div(total, tokens),
        "low_confidence": energy.low_confidence if energy is not None else True,
        "server_kind": server.kind if server else None,
        "timing": "untrusted" if lies else None,
        "timing_reason": f"{len(lies)} of {len(ok)} requests: {lies[0]}" if lies else None,
        **cpu_time_columns(getattr(energy, "cpu_time", None)),
    }


def spec_columns(rows: list[dict], metrics: tuple[float, float] | None) -> dict:
    """draft_n, draft_n_accepted, draft_acceptance and their source for a level's measured windows."""
    d = [r["draft_n"] for r in rows if r.get("draft_n") is not None]
    a = [r["draft_n_accepted"] for r in rows if r.get("draft_n_accepted") is not None]
    if d and sum(d) > 0:
        return {"draft_n": int(sum(d)), "draft_n_accepted": int(sum(a)), "draft_acceptance": sum(a) / sum(d),
                "draft_source": "timings"}
    if metrics is not None and metrics[0] > 0:
        return {"draft_n": int(metrics[0]), "draft_n_accepted": int(metrics[1]),
                "draft_acceptance": metrics[1] / metrics[0], "draft_source": "metrics"}
    return {}
