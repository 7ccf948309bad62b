"""`powerprof measure`: J/token and decode tok/s at the current settings, one windows row per request.

Changes nothing on the GPU and needs no root: it only reads energy counters (through the
Profiler) at the edges of each decode window while the load runs. Concurrent batches get a
row of their own whose energy and tokens are taken over exactly the measured intervals.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
from powerprof import termination
from powerprof.energy import (
    ROUNDED_WINDOW_S,
    counter_rounding_bound,
    max_tokens_for_windows,
    median_off_by_rounding,
    within_prompt_offset,
)
from powerprof.collectors.cputime import BUSY_HOST_FIX, BUSY_HOST_PCT, busy_host_text, cpu_shares_pct, unknown_server_text
from powerprof.collectors.limitwatch import CLOCK_FIX, LIMIT_CHANGERS, LIMIT_FIX, ClockLockWatch, ClockMove, LimitWatch, limits_read
from powerprof.profiler import (COUNTER_REFRESH_MAX_NS, EDGE_BIAS_WINDOW_S, LOW_CONFIDENCE_S, METHOD_COUNTER, METHOD_POWER,
                                POWER_EDGE_BIAS_SHARE, POWER_EDGE_BIAS_WINDOW_S)
from powerprof.trust import out_dir_refusal

from .client import RequestParams, RequestRecord, ServerInfo, context_problem, detect_server, new_session, server_away
from .load import LoadAborted, LoadPolicy, Prompt, run_load_async, warmup_streams
from .others import FOREIGN_FIX, FOREIGN_FLAG, OthersWatch, leave_out_foreign
from .rows import BY_GPU, FIGURES, NO_DECODE_INTERVAL, window_rows

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
    n_trusted: int = 0  # windows the figures come from (request rows at 1, batch rows above)
    measured_s: float = 0.0  # decode seconds the energy figure pools
    n_planned: int | None = None  # requests this concurrency was to send; more than n_ok + n_failed when stopped early
    # J/token: the median of the used windows' own figures, beside gpu_j_per_token (pooled). On short
    # windows a coarse counter biases the median, not the pooled figure (rounding_notes).
    gpu_j_per_token_median: float | None = None
    median_window_s: float | None = None  # s: median decode window of the used windows with a GPU energy
    prompt_offset: float | None = None  # energy.within_prompt_offset of those windows (None: not computable)
    # %: of the host's busy CPU time over the used windows, other processes' (above BUSY_HOST_PCT the GPU+CPU
    # figure is flagged: busy_host) and powerprof's own; None: not known (no cputime reading, server not found)
    other_cpu_pct: float | None = None
    powerprof_cpu_pct: float | None = None
    n_foreign: int = 0  # windows left out: others' work ran beside them (foreign_traffic); their prompts sent again
    # What gpu_j_per_token sums, GPU by GPU (measure_gpus): [{index, name, gpu_energy_j, gpu_j_per_token,
    # avg_power_w}] over the same windows; None where there is no GPU figure.
    gpus: list[dict] | None = None
    # Of the used windows' decode tokens, the share integrated from instant power (edge_bias_notes); None: not known
    power_token_share: float | None = None

    @property
    def busy_host(self) -> bool:
        """Its GPU+CPU figure counts other processes' CPU energy (cputime.BUSY_HOST_PCT)."""
        return self.total_j_per_token is not None and self.other_cpu_pct is not None and self.other_cpu_pct > BUSY_HOST_PCT


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
    stopped: BaseException | None = None  # the signal's exit (KeyboardInterrupt, Terminated), raised after writing
    interrupted: dict | None = None  # run.json's record of what a stopped run kept
    server_away: dict | None = None  # run.json's record of a server that stopped answering (away_record)
    foreign_traffic: dict | None = None  # run.json's record of others' work beside the windows (foreign_record)
    write_error: str | None = None  # the run could not be stored (a full disk): nothing was, the figures are only printed
    # GPU index → (power limit W, enforced limit W) as the measurement began: the settings its figures are of
    limits_w: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """`powerprof measure --json`: stable keys; per-request rows stay in windows.parquet."""
        s = self.server
        return {
            "server": {**s.meta(), "simulated": s.simulated},
            "concurrencies": [{**asdict(m), "busy_host": m.busy_host} for m in self.summaries],
            "notes": list(self.notes),
            "windows_path": None if self.out_path is None else str(self.out_path / "windows.parquet"),
            "aborted": self.aborted,
            "interrupted": self.interrupted,
            "server_away": self.server_away,
            "foreign_traffic": self.foreign_traffic,
            "write_error": self.write_error,
            "excluded": None if self.excluded is None else {"n": self.excluded.n, "n_windows": self.excluded.n_windows,
                                                            "reasons": self.excluded.reasons, "fix": self.excluded.fix},
        }

    def lines(self) -> list[str]:
        """`powerprof measure`'s text on stdout before where the windows went: the server, the notes, a row per
        concurrency (a stopped one says how many of its requests it kept) and what a summed figure is made of."""
        s = self.server
        out = [f"server: {s.kind} ({s.api}) model={s.model} build={s.build_info}" + (" [simulated]" if s.simulated else "")]
        out += [f"note: {note}" for note in self.notes]
        out.append(MEASURE_HEADER)
        short = {x["concurrency"]: f"  stopped early: {x['requests_kept']} of {x['requests_planned']} requests"
                 for x in (self.interrupted or {}).get("concurrencies", []) if x["requests_kept"] < x["requests_planned"]}
        out += [measure_row(m) + short.get(m.concurrency, "") for m in self.summaries]
        if batched := [m for m in self.summaries if m.concurrency > 1]:
            # "8 ok, 2 used" read as 6 of 8 requests thrown away: above concurrency 1 a window is a whole batch. The
            # example is this run's own row: a fixed "8 requests at concurrency 4 are 2 windows" sat under "4 ok, 1 used".
            m = batched[0]
            out.append("used windows: what each figure rests on, one per request at concurrency 1 and one per batch (its "
                       f"streams decoding at once) above it: here {m.n_ok} ok requests at concurrency {m.concurrency} "
                       f"rest on {m.n_trusted} window{'' if m.n_trusted == 1 else 's'}")
        # A figure summed over several GPUs says what it sums (run.json per_gpu).
        out += [line for m in self.summaries if (line := per_gpu_line(m)) is not None]
        return out

    def stop_line(self) -> str:
        """What a measurement stopped by a signal kept (its exit status follows)."""
        how = termination.stopped_how(self.stopped)
        if self.interrupted is None:
            return f"{how} after the measurement was complete: all of it is in {self.out_path}; nothing was changed"
        return (f"{how}: {self.interrupted['message']}; written to {self.out_path} (run.json \"interrupted\"); nothing "
                "was changed")

    def all_foreign(self) -> str:
        """Every window ran beside others' work: no figure stands (exit 1)."""
        from .others import FOREIGN_FIX

        return (f"no window ran without others' work beside it "
                f"({self.foreign_traffic['concurrencies'][0]['first_reason']}), so there is no figure; fix: {FOREIGN_FIX}")


MEASURE_HEADER = (f"{'concurrency':>11} {'ok':>4} {'failed':>6} {'used windows':>12} {'decode tok/s':>12} {'GPU J/tok':>10} "
                  f"{'GPU+CPU J/tok':>13}   method")


def measure_row(m) -> str:
    """One concurrency's row under MEASURE_HEADER; a missing figure is a '-' in its own column."""

    def fmt(v, width, spec):
        # A bare "-" shifted the next figures left, under the wrong heading ("364.6 - -  none").
        return f"{'-':>{width}}" if v is None else format(v, f"{width}{spec}")

    return (f"{m.concurrency:>11} {m.n_ok:>4} {m.n_failed:>6} {m.n_trusted:>12} {fmt(m.decode_tok_s, 12, '.1f')} "
            # '!': other processes used the host's CPU meanwhile, and RAPL counts their energy (the notes say how much).
            f"{fmt(m.gpu_j_per_token, 10, '.3f')} {fmt(m.total_j_per_token, 13, '.3f')}"
            f"{'!' if getattr(m, 'busy_host', False) else ' '}  {m.energy_method}")


def trusted(row: dict) -> bool:
    """A window whose figures can be used: not untrusted by the timing rule (old rows have no timing)."""
    return row.get("timing") != "untrusted"


def used(row: dict) -> bool:
    """A window the figures come from: trusted, and no one else's work beside it (foreign_traffic)."""
    return trusted(row) and not row.get("foreign_traffic")


def under_refresh(row: dict) -> bool:
    """A window without a GPU energy figure that is shorter than the counter's refresh (profiler.
    COUNTER_REFRESH_MAX_NS): no reading resolves it, so it is left out of the energy figures by its length."""
    return row["gpu_energy_j"] is None and (row["decode_s"] or 0) < COUNTER_REFRESH_MAX_NS / 1e9


def short_window_notes(rows: Sequence[dict], summary: list) -> list[str]:
    """Say so where a level's energy figures leave out windows shorter than the counter's refresh (`summarise`)."""
    out = []
    for x in summary:
        if x.gpu_j_per_token is None:
            continue  # missing_figure_notes says why
        kind = "request" if x.concurrency == 1 else "batch"
        wins = [r for r in rows if r["concurrency"] == x.concurrency and r["window_kind"] == kind
                and not r["warmup"] and r["status"] == "ok" and used(r)]
        short = [r for r in wins if under_refresh(r)]
        if not short:
            continue
        need = max_tokens_for_windows((x.decode_tok_s or 0) / x.concurrency)
        need = int(np.ceil(need * EDGE_BIAS_WINDOW_S / ROUNDED_WINDOW_S / 64) * 64) if need else 0
        out.append(f"concurrency {x.concurrency}: {len(short)} of {len(wins)} {kind} windows (under "
                   f"{COUNTER_REFRESH_MAX_NS / 1e6:g} ms: requests that stopped early?) are shorter than the GPU energy "
                   "counter's refresh, which no reading resolves: they carry no energy figure and the J/token figures "
                   "rest on the others (tokens and energy alike; tok/s counts them); fix: longer requests"
                   + (f" (--max-tokens {need} or more" if need > 0 else "") + (", with ignore-EOS)" if need > 0 else ""))
    return out


@dataclass(frozen=True)
class Excluded:
    """Windows left out of every figure because their timing cannot be trusted."""

    n: int
    n_windows: int  # windows that would otherwise have counted
    reasons: dict  # reason → count
    fix: str

    def message(self) -> str:
        from powerprof.arrival import left_out_text

        return left_out_text(self.reasons, self.n_windows)


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


def short_figure_notes(summary: list[Summary]) -> list[str]:
    """Say so where a level's energy figure pools less decode time than its method resolves well."""
    out = []
    for x in summary:
        if x.gpu_j_per_token is None:
            continue
        methods = x.energy_method.split(",")
        # Windows on instant power holding too few of the tokens to move the figure (edge_bias_notes' rule) are not
        # what it rests on: a counter card's window its counter broke over takes instant power (one of 40 said
        # "fix: a GPU with an energy counter" of an H200's counter figure).
        if METHOD_POWER in methods and len(methods) > 1 and x.power_token_share is not None \
                and x.power_token_share <= POWER_EDGE_BIAS_SHARE:
            methods = [m for m in methods if m != METHOD_POWER]
        need = max((LOW_CONFIDENCE_S.get(m, float("inf")) for m in methods), default=float("inf"))
        if need == float("inf"):
            # Beside counter windows the GPU has a counter: its windows on power are those it broke over (windows
            # shorter than its refresh carry no figure: profiler.COUNTER_REFRESH_MAX_NS), and a rerun gives them one.
            fix = ("a rerun: its windows on instant power are those the energy counter broke over (a driver reload, a "
                   "counter jump)" if METHOD_COUNTER in methods
                   else "a GPU with an energy counter (Volta and newer)")
            out.append(
                f"concurrency {x.concurrency}: the energy figure integrates instant power sampled between the edges "
                f"({x.energy_method}), which misses what happens between samples: a few % off however long it runs; "
                f"fix: {fix}"
            )
        elif x.measured_s < need:
            why = ("a GPU's energy counter refreshes every 10-100 ms" if need == LOW_CONFIDENCE_S["counter"]
                   else "the 1 s average power smears each edge over a second")
            out.append(
                f"concurrency {x.concurrency}: the energy figure rests on {x.measured_s:.1f} s of decode, under the "
                f"{need:g} s its method ({x.energy_method}) resolves to ~1% ({why}); fix: more requests "
                "(--requests) or longer ones (--max-tokens)"
            )
    return out


def missing_figure_notes(rows: Sequence[dict], summary: list[Summary]) -> list[str]:
    """Say why a concurrency has no J/token figure: a row of dashes must never stand unexplained."""
    out = []
    for x in summary:
        if x.gpu_j_per_token is not None:
            continue
        kind = "request" if x.concurrency == 1 else "batch"
        wins = [r for r in rows if r["concurrency"] == x.concurrency and r["window_kind"] == kind and not r["warmup"]]
        ok = [r for r in wins if r["status"] == "ok"]
        errors: dict = {}
        for r in wins:
            if r["status"] != "ok":
                errors[r["error"] or r["status"]] = errors.get(r["error"] or r["status"], 0) + 1
        if not wins:
            why, fix = f"no {kind} window was measured", "more requests (--requests)"
        elif not ok:
            top = max(errors, key=errors.get)
            why = f"none of its {len(wins)} {kind} windows could be measured ({top})"
            fix = ("a concurrency at or under the server's parallel slots (llama.cpp -np, vLLM --max-num-seqs), so the "
                   "streams decode together" if top == NO_DECODE_INTERVAL else "see the windows' error column")
        elif not any(trusted(r) for r in ok):
            why, fix = f"all {len(ok)} {kind} windows are left out as untrusted (above)", "as said above"
        elif not any(used(r) for r in ok):
            why, fix = f"every {kind} window ran beside others' work ({FOREIGN_FLAG}, above)", FOREIGN_FIX
        elif short := [r for r in ok if used(r) and r["gpu_energy_j"] is None
                       and (r["decode_s"] or 0) < COUNTER_REFRESH_MAX_NS / 1e9]:
            need = max_tokens_for_windows((x.decode_tok_s or 0) / x.concurrency)
            need = int(np.ceil(need * EDGE_BIAS_WINDOW_S / ROUNDED_WINDOW_S / 64) * 64) if need else 0
            why = (f"{len(short)} of {len(ok)} {kind} windows (under {COUNTER_REFRESH_MAX_NS / 1e6:g} ms) are shorter "
                   "than the GPU energy counter's refresh, and no reading resolves them (the counter holds one or two "
                   "refreshes' values; instant power, refreshed as seldom, shows the power before the window: +16% "
                   "measured at 50 ms), so they carry no energy figure and the level none")
            fix = "longer requests" + (f" (--max-tokens {need} or more)" if need > 0 else "")
        else:
            why, fix = "no energy reading covers its windows", "`powerprof devices` says what the GPU can report"
        out.append(f"concurrency {x.concurrency}: no J/token figure: {why}; fix: {fix}")
    return out


def missing_cpu_notes(rows: Sequence[dict], summary: list[Summary], profiler) -> list[str]:
    """Say why a concurrency with a GPU J/token has no GPU+CPU figure while RAPL was open (without RAPL the
    opening problem says it): a window whose CPU energy is missing (a zone unreadable or stalled, a dropped
    counter delta) leaves the pooled figure empty, and the '-' must not stand unexplained."""
    if profiler is None or getattr(profiler, "rapl", None) is None:
        return []
    problems = getattr(profiler.timeline, "cpu_problems", {})
    why = "; ".join(f"{p}" + (f" ({n} reads)" if n > 1 else "") for p, n in list(problems.items())[:3])
    out = []
    for x in summary:
        if x.gpu_j_per_token is None or x.total_j_per_token is not None:
            continue
        kind = "request" if x.concurrency == 1 else "batch"
        basis = [r for r in rows if r["concurrency"] == x.concurrency and r["window_kind"] == kind
                 and not r["warmup"] and r["status"] == "ok" and used(r)]
        lacking = sum(r["cpu_energy_j"] is None for r in basis)
        out.append(f"concurrency {x.concurrency}: no GPU+CPU figure: {lacking} of {len(basis)} windows have no CPU "
                   f"energy ({why or 'no RAPL reading covers them'}); fix: `powerprof monitor` shows the RAPL zones "
                   "and why each is missing")
    return out


def busy_host_notes(summary: list[Summary], profiler) -> list[str]:
    """Say so where a GPU+CPU figure counts other processes' CPU energy (RAPL is the whole package), with the
    fix; or, once, that it could, where the server's processes were not found (so no share is known)."""
    out = [f"concurrency {x.concurrency}: {busy_host_text(x.other_cpu_pct, 'its windows')} (marked ! in the table); "
           f"fix: {BUSY_HOST_FIX}"
           for x in summary if x.busy_host]
    own = [x for x in summary if x.total_j_per_token is not None and (x.powerprof_cpu_pct or 0) > BUSY_HOST_PCT]
    if own:
        out.append(f"powerprof itself (its load generator and sensor reads) used {max(x.powerprof_cpu_pct for x in own):.0f}% "
                   "of the host's busy CPU time: that is in the GPU+CPU J/token too (the measuring tool's overhead, "
                   "not the server's); fix: fewer streams per powerprof, or read the GPU J/token")
    timeline = getattr(profiler, "timeline", None)
    if getattr(profiler, "cputime", None) is not None and timeline is not None:
        with_total = [x for x in summary if x.total_j_per_token is not None]
        if with_total and all(x.other_cpu_pct is None for x in with_total):
            why = timeline.server_note or "no CPU-time reading covers the windows"
            out.append(f"{unknown_server_text(why)}; fix: {BUSY_HOST_FIX}")
    return out


def edge_bias_notes(summary: list[Summary]) -> list[str]:
    """Say so where the counter windows are too short for their pooled J/token to be within ~1%: each edge
    reads a few ms after its power step (EDGE_BIAS_WINDOW_S), a bias pooling does not average out; and where an
    instant-power figure rests on windows under POWER_EDGE_BIAS_WINDOW_S (the reading lags the power)."""
    out = []
    for x in summary:
        if x.gpu_j_per_token is None or x.median_window_s is None:
            continue
        on_power = METHOD_POWER in x.energy_method.split(",") and (x.power_token_share is None
                                                                   or x.power_token_share > POWER_EDGE_BIAS_SHARE)
        if on_power and x.median_window_s < POWER_EDGE_BIAS_WINDOW_S:
            need = max_tokens_for_windows((x.decode_tok_s or 0) / x.concurrency)
            need = int(np.ceil(need * POWER_EDGE_BIAS_WINDOW_S / ROUNDED_WINDOW_S / 64) * 64) if need else 0
            out.append(
                f"concurrency {x.concurrency}: low confidence: this GPU has no energy counter (or it broke over those "
                f"windows), and the J/token figure is integrated from power readings (1 Hz and each window's edges) "
                f"over {x.median_window_s:.2f} s "
                f"decode windows, under the {POWER_EDGE_BIAS_WINDOW_S:g} s below which a reading's lag behind the "
                "power (a card refreshes it every ~100 ms) biases it by over 0.5% (measured -4% at 1 s, -10% at "
                "0.3 s); fix: longer requests" + (f" (--max-tokens {need} or more)" if need > 0 else "")
            )
            continue
        if "counter" not in x.energy_method.split(","):
            continue
        if x.median_window_s >= EDGE_BIAS_WINDOW_S:
            continue
        need = max_tokens_for_windows((x.decode_tok_s or 0) / x.concurrency)
        need = int(np.ceil(need * EDGE_BIAS_WINDOW_S / ROUNDED_WINDOW_S / 64) * 64) if need else 0
        out.append(
            f"concurrency {x.concurrency}: low confidence: the J/token figure rests on {x.median_window_s:.2f} s decode "
            f"windows, under the {EDGE_BIAS_WINDOW_S:g} s below which the energy read a few ms after each window's "
            "power steps (prefill to decode, decode to idle) biases it by over 1% (measured -2% at 0.3 s on a "
            "100 ms counter), however many windows are pooled; fix: longer requests"
            + (f" (--max-tokens {need} or more)" if need > 0 else "")
        )
    return out


# "(windows.parquet)", "(windows.parquet foreign_traffic)", "(run.json per_gpu)": where a note sends the reader.
_STORED_REF = re.compile(r"\s*\((?:windows\.parquet|run\.json)\b[^()]*\)")


def unstored(note: str) -> str:
    """`note` without its pointers into windows.parquet or run.json: what a run that could not be stored says, so
    that no note sends the reader to a file that was never written (the figures it gives stay)."""
    return _STORED_REF.sub("", note)


def rounding_notes(summary: list[Summary]) -> list[str]:
    """Say so where the windows are short enough for the counter's steps to bias their own median
    J/token (windows.parquet) off the pooled figure printed: the same rule as the analysis'
    energy-resolution flag (energy.median_off_by_rounding), without a CI."""
    out = []
    for x in summary:
        if "counter" not in x.energy_method.split(",") or x.gpu_j_per_token is None or x.median_window_s is None:
            continue
        med, pooled, w = x.gpu_j_per_token_median, x.gpu_j_per_token, x.median_window_s
        offset = x.prompt_offset if x.prompt_offset is not None else float("nan")
        if med is None or not median_off_by_rounding(med, pooled, float("nan"), w, offset):
            continue
        window_s = ROUNDED_WINDOW_S
        need = max_tokens_for_windows((x.decode_tok_s or 0) / x.concurrency)
        out.append(
            f"concurrency {x.concurrency}: the windows' own J/token (windows.parquet) read whole steps of the GPU "
            f"energy counter (refreshed every 10-100 ms) over {w:.2f} s windows: their median {med:.4g} is "
            f"{(med / pooled - 1) * 100:+.1f}% off the pooled figure printed ({pooled:.4g}, energy summed ÷ tokens "
            f"summed, which averages the rounding out); a median over these windows can be off by up to "
            f"{counter_rounding_bound(w) * 100:.0f}%. fix: longer requests"
            + (f" (--max-tokens {need} or more: {window_s:g} s windows)" if need > 0 else f" ({window_s:g} s windows)")
        )
    return out


def per_gpu(basis: Sequence[dict], tokens: float, gpus: Sequence[tuple[int, str]] | None) -> list[dict] | None:
    """Each GPU's part of a pooled GPU J/token over the windows `basis` (their BY_GPU energies): the figure is the
    sum of these, GPU by GPU; None where a window has no per-GPU energy. `gpus`: (index, name) in the profiler's
    order (None: unnamed, numbered from 0)."""
    parts = [r.get(BY_GPU) for r in basis]
    if not basis or not tokens or any(p is None for p in parts) or len({len(p) for p in parts}) != 1:
        return None
    energy = np.sum(np.asarray(parts, dtype=float), axis=0)
    decode_s = sum(r["decode_s"] or 0 for r in basis)
    names = list(gpus) if gpus and len(gpus) == len(energy) else [(k, None) for k in range(len(energy))]
    return [{"index": idx, "name": name, "gpu_energy_j": float(e), "gpu_j_per_token": float(e) / tokens,
             "avg_power_w": float(e) / decode_s if decode_s > 0 else None} for (idx, name), e in zip(names, energy)]


def per_gpu_line(x: Summary) -> str | None:
    """'concurrency 1: GPU J/token 2.166 = GPU 0 (NVIDIA H200) 1.901 at 412 W + GPU 1 (NVIDIA L4) 0.265 at 57 W':
    what a figure summed over several GPUs is made of; None for one GPU or no figure."""
    if x.gpu_j_per_token is None or not x.gpus or len(x.gpus) < 2:
        return None
    parts = " + ".join(f"GPU {g['index']}" + (f" ({g['name']})" if g["name"] else "") + f" {g['gpu_j_per_token']:.3f}"
                       + (f" at {g['avg_power_w']:.0f} W" if g["avg_power_w"] is not None else "") for g in x.gpus)
    return f"concurrency {x.concurrency}: GPU J/token {x.gpu_j_per_token:.3f} = {parts}"


def summarise(rows: list[dict], gpus: Sequence[tuple[int, str]] | None = None) -> list[Summary]:
    """One Summary per concurrency; `gpus`: (index, name) of the profiler's GPUs, for the per-GPU account."""
    out = []
    for c in sorted({r["concurrency"] for r in rows if not r["warmup"]}):
        req = [r for r in rows if r["concurrency"] == c and r["window_kind"] == "request" and not r["warmup"]]
        ok = [r for r in req if r["status"] == "ok"]
        failed = len(req) - len(ok)
        basis = ok if c == 1 else [r for r in rows if r["concurrency"] == c and r["window_kind"] == "batch" and r["status"] == "ok"]
        n_foreign = sum(1 for r in basis if trusted(r) and r.get("foreign_traffic"))
        basis = [r for r in basis if used(r)]
        if c == 1:
            rates = [r["decode_tok_s"] for r in basis if r["decode_tok_s"]]
            tok_s = float(np.median(rates)) if rates else None
        else:
            dur = sum(r["decode_s"] or 0 for r in basis)
            tok_s = sum(r["decode_tokens"] or 0 for r in basis) / dur if dur > 0 else None
        n_used = len(basis)
        # Windows shorter than the counter's refresh carry no energy figure (by length): the energy figures rest on
        # the others, tokens and energy alike, where any remain (short_window_notes says so); else none.
        basis = [r for r in basis if not under_refresh(r)] or basis
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
        n_trusted = len([r for r in ok if used(r)]) if c == 1 else n_used
        with_j = [r for r in basis if r.get("gpu_j_per_token") is not None]
        other_pct, own_pct = cpu_shares_pct(*([r.get(k) for r in basis] for k in ("host_cpu_s", "other_cpu_s", "powerprof_cpu_s")))
        out.append(Summary(c, len(ok), failed, tok_s, gpu_jpt, tot_jpt, ",".join(sorted(methods)), n_trusted,
                           sum(r["decode_s"] or 0 for r in basis),
                           gpu_j_per_token_median=float(np.median([r["gpu_j_per_token"] for r in with_j])) if with_j else None,
                           median_window_s=float(np.median([r["decode_s"] or 0 for r in with_j])) if with_j else None,
                           prompt_offset=within_prompt_offset([r["gpu_j_per_token"] for r in with_j],
                                                              [r.get("prompt_id") for r in with_j]) if with_j else None,
                           other_cpu_pct=other_pct, powerprof_cpu_pct=own_pct, n_foreign=n_foreign,
                           gpus=per_gpu(basis, tokens, gpus) if gpu_jpt is not None else None,
                           power_token_share=_power_token_share(basis)))
    return out


def _power_token_share(rows: list[dict]) -> float | None:
    """Of the rows' decode tokens, the share in windows integrated from instant power; None without tokens."""
    tokens = sum(r["decode_tokens"] or 0 for r in rows)
    on_power = sum(r["decode_tokens"] or 0 for r in rows if r["energy_method"] == METHOD_POWER)
    return on_power / tokens if tokens else None


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
    keep_on_stop: bool = False,
    server_procs=None,
    watch_others: bool = True,
    placement_look=None,
) -> MeasureResult:
    """Run the load at each concurrency with `profiler` (a started Profiler, or None) marking
    every window edge; returns the rows for windows.parquet and a summary per concurrency.

    watch_others: between batches, the server's books and the GPUs' processes are compared with ours
    (workload/others.py); a batch beside others' work is left out (foreign_traffic) and its prompts sent
    again, up to as many requests again as the concurrency's. server_procs: a callable answering (the
    server's pids, None) or (None, why) (serverprocs.ServerProcesses), to tell the server's GPU processes
    from others'. placement_look: the server's GPUs looked at again after every batch (placement.LookUnderLoad):
    a server GPU found then raises its GpuPlacementError, nothing kept; its notes (allowed) go into the result's.

    keep_on_stop: a run-ending signal (Ctrl-C, SIGTERM, SIGHUP) returns what was finished, whole
    batches only, with `stopped` (the exit, for the caller to raise once it has written them) and
    `interrupted` set; when nothing measured had finished, the look under load had not answered, or without it, the
    exit is raised."""
    run_id = run_id or uuid.uuid4().hex[:12]
    hook = profiler.edge if profiler is not None else None

    notes: list[str] = []
    by_level: list[tuple[int, str]] = []  # notes about one concurrency: dropped if a stop keeps none of it
    planned = {c: -(-n_requests // c) * c for c in concurrencies}
    kept: list[RequestRecord] = []  # whole batches, as each one finishes
    found: dict = {}
    # measure does not wait for a server that went away: see away_record.
    policy = replace(policy, stop_when_server_away=True)
    away: dict = {}
    foreign: dict[int, tuple[int, str]] = {}  # batch id → (concurrency, why others' work ran beside it)
    resent: dict[int, int] = {}  # concurrency → requests sent again for it
    watch: list[OthersWatch] = []
    # The settings as they are, as the measurement begins: every GPU reading since must show the same power limits.
    # Another tool's `nvidia-smi -pl` (or `powerprof tune`) mid-run made the later windows another setting's, pooled
    # with the earlier ones unsaid (300 -> 180 W halfway: -15.5% J/token on the seed card). The same for an SM clock
    # lock set (nvidia-smi -lgc) or released (-rgc) mid-run: the clock itself is the witness (ClockLockWatch).
    gpu = getattr(profiler, "gpu", None)
    clocks = ClockLockWatch(None, find_lock=True, during="the measurement", earlier="earlier in the measurement")
    limits = LimitWatch(limits_read(gpu.read()), clocks=clocks) if gpu is not None else None
    if limits is not None:
        profiler.sampler.subscribe(limits)
    cut: dict = {}  # the concurrency the limit moved in and those never begun
    # Whether the look under load has answered (or there is none): until then no batch is kept on a stop. The first
    # batch finishes (and is in `kept`) before the look runs; a Ctrl-C during the look kept that batch, never checked,
    # its notes still calling the GPU the look was for a helper.
    looked = [placement_look is None]

    async def go():
        records: list[RequestRecord] = []
        aborted = None
        async with new_session() as s:
            server = found["server"] = await detect_server(s, url, api)
            too_long = context_problem(server, params.max_tokens, prompts)
            if too_long:
                raise ValueError(too_long)  # before any request: each would be refused, or cut short of what was asked
            others = (OthersWatch(s, server.base_url, getattr(profiler, "gpu", None), server_procs, kind=server.kind)
                      if watch_others else None)
            watch.extend([others] if others else [])
            rid = bid = 0
            for k, c in enumerate(concurrencies):
                note = saturation_note(server, c)
                if note:
                    by_level.append((c, note))
                probe = QueueProbe(s, server) if c > 1 and server.kind == "vllm" else None
                if probe is not None:
                    await probe.start()
                # Whole batches only: a last batch of fewer streams (or --requests below the concurrency) would
                # be measured at fewer streams and reported as this concurrency.
                n = planned[c]
                if others is not None:
                    await others.begin()  # none of ours in flight: the books as they stand, the GPUs' processes from now

                async def between(recs, c=c, n=n):
                    if placement_look is not None:
                        # After every batch (warm-up or measured), over its samples: a small model idle before the
                        # load was taken for a helper and its GPU left unmeasured; a refusal keeps nothing.
                        notes.extend(placement_look(min((r.t_send_wall_ns for r in recs), default=None)))
                        looked[0] = True
                    if limits is not None and limits.moved is not None:
                        raise _LimitMoved()  # the rest would measure another setting: stop, keep what ran before
                    if others is not None:
                        why = await others.judge(recs)
                        if not why or all(r.warmup for r in recs):
                            return False  # a warm-up beside others' work counts nowhere anyway
                        foreign[recs[0].batch_id] = (c, why)
                        sent = len({r.request_id for r in recs})  # requests, not attempts: a retry is no request more
                        if resent.get(c, 0) + sent > n:
                            return False  # its budget spent: others at work throughout; the batch stays left out
                        resent[c] = resent.get(c, 0) + sent
                        return True
                    return False
                if n != n_requests:
                    by_level.append((c, f"concurrency {c}: {n} requests (--requests {n_requests} rounded up to whole "
                                        f"batches of {c} streams)"))
                kept_before = len(kept)
                try:
                    recs = await run_load_async(
                        server, prompts, n, c, params, hook, warmup, policy, s, rid, bid, finished=kept,
                        between=between,
                    )
                except _LimitMoved:
                    records += kept[kept_before:]  # this concurrency's finished batches: nothing was in flight
                    cut.update(concurrency=c, later=list(concurrencies[k + 1:]))
                    break
                except LoadAborted as e:
                    records += e.records
                    aborted = str(e)
                    if any(server_away(r) for r in e.records):
                        # the next concurrency's first request id (the batches sent again took ids of their own)
                        first = rid + warmup_streams(warmup, c) + n + resent.get(c, 0)
                        away.update(away_record(e.records, kept, first - 1, list(concurrencies[k + 1:])))
                        aborted = away["message"]
                    break
                finally:
                    if probe is not None:
                        probe.cancel()  # cut short (a limit moved, the server away, a stop): no note, nothing read
                queued = await probe.stop(len(kept) - kept_before) if probe is not None else None
                if queued:
                    by_level.append((c,
                        f"concurrency {c}: vLLM queued requests, more streams than it runs at once ({queued}): "
                        "queued time is excluded from the windows, but this is not the server's steady state at this concurrency"
                    ))
                records += recs
                rid = max(r.request_id for r in records) + 1
                bid = max(r.batch_id for r in records) + 1
        return server, records, aborted

    stopped = None
    try:
        server, records, aborted = termination.run(go())
    except (KeyboardInterrupt, termination.Terminated) as e:
        if not keep_on_stop or "server" not in found or not looked[0] or all(r.warmup for r in kept):
            # Which of them held, for the stop line (cli.measure): it said "no measured request had finished, or
            # the look ... had not answered", though only one had happened.
            if "server" not in found:
                e.nothing_kept_why = "the server had not answered yet: no request had been sent"
            elif all(r.warmup for r in kept):
                e.nothing_kept_why = "no measured request had finished"
            elif not looked[0]:
                e.nothing_kept_why = ("the look at the server's GPUs after the first batch had not answered: the "
                                      "finished batch was never checked, so none of it is kept")
            raise
        # Whole batches that finished and were annotated: each row is what a full run would have stored for it.
        server, records, aborted, stopped = found["server"], list(kept), None, e
    measured = {r.concurrency for r in records if not r.warmup}
    notes[:0] = [n for c, n in by_level if stopped is None or c in measured]
    rows, _ = window_rows(records, profiler, run_id, server)
    if limits is not None:
        # A move in the last batch may reach the watch only with that batch's end-edge read: look once more.
        profiler.sampler.sample_now("limits", sources=(gpu.source,))
        moved = limit_moved_note(limits, records, rows, cut)
        if moved and aborted is None:
            aborted = moved
    for row in rows:
        hit = foreign.get(row.get("batch_id"))
        if hit is not None and row["status"] == "ok" and not row["warmup"]:
            leave_out_foreign(row, hit[1])
    if away:
        for row in rows:  # a stream that ended before the cut, in the batch the cut lost: part of no whole batch
            if row.get("batch_id") in away["lost_batch_ids"] and row["status"] == "ok" and not row["warmup"]:
                _distrust(row, "in the batch the server stopped answering during: the batch was lost")
    notes += [f"request {r.request_id} ({r.prompt_id}): {r.truncated}" for r in records if r.ok and r.truncated and not r.warmup][:5]
    note = server_timed_note(rows)
    if note:
        notes.append(note)
    summary = summarise(rows, [(i.index, i.name) for i in profiler.gpu_infos] if profiler is not None and profiler.gpu else None)
    for x in summary:
        x.n_planned = planned.get(x.concurrency)
    interrupted = None
    if stopped is not None:
        interrupted = interrupted_record(stopped, [r for r in records if r.batch_id not in foreign], planned)
        notes.insert(0, f"stopped early by {interrupted['signal']}: {interrupted['message']}")
    foreign_rec = foreign_record(foreign, summary, resent, watch[0]) if watch and foreign else None
    if foreign_rec:
        notes.append(foreign_rec["message"])
    if watch:
        notes += watch[0].cannot
    notes += short_figure_notes(summary) + missing_figure_notes(rows, summary) + short_window_notes(rows, summary) + missing_cpu_notes(rows, summary, profiler) + busy_host_notes(summary, profiler) + edge_bias_notes(summary) + rounding_notes(summary)
    if profiler is not None:
        notes += profiler.edge_notes()
    return MeasureResult(server, records, rows, summary, notes=notes, aborted=aborted, excluded=excluded_windows(rows),
                         stopped=stopped, interrupted=interrupted,
                         server_away={k: v for k, v in away.items() if k != "lost_batch_ids"} or None,
                         foreign_traffic=foreign_rec, limits_w=dict(limits.expected) if limits is not None else {})


class _LimitMoved(Exception):
    """A GPU's power limit moved during `measure`: its load stops between two batches."""


def limit_moved_note(watch: LimitWatch, records: Sequence[RequestRecord], rows: list[dict], cut: dict) -> str | None:
    """Where a GPU's power limit or SM clock setting moved during the measurement (`watch`): the windows of every batch
    not vouched for by a reading at its end (a request that ended after the last reading still at the first setting)
    are left out, with the reason; what to say (the run's `aborted`), or None when the settings held."""
    m = watch.moved
    if m is None:
        return None
    if isinstance(m, ClockMove):
        why, fix = m.why.split("; the windows measured since")[0], CLOCK_FIX
    else:
        why = (f"GPU {m.index}'s {m.what} read {m.read_w:g} W during the measurement, not the {m.expected_w:g} W it read "
               f"as the measurement began: another tool changed it ({LIMIT_CHANGERS}) or the driver lowered it")
        fix = LIMIT_FIX
    after = {r.batch_id for r in records if not r.warmup and not watch.held_through(r.t_last_ns or r.t_end_ns)}
    if not after and not cut:
        return None  # it moved after the last window had ended: nothing was measured at another setting
    measured = [row for row in rows if row["window_kind"] == "request" and row["status"] == "ok" and not row["warmup"]]
    for row in rows:
        if row.get("batch_id") in after and row["status"] == "ok" and not row["warmup"]:
            _distrust(row, f"{why}: this window ran at another setting")
    n_out = sum(1 for row in measured if row.get("batch_id") in after)
    later = cut.get("later") or []
    never = f"; concurrency {', '.join(map(str, later))} never begun" if later else ""
    return (f"{why}, so the windows since measured another setting: {n_out} left out of every figure, the "
            f"{len(measured) - n_out} before it kept{never}; measure stopped there; fix: {fix}")


def foreign_record(foreign: dict[int, tuple[int, str]], summary: list[Summary], resent: dict[int, int],
                   others: OthersWatch) -> dict:
    """run.json's `foreign_traffic`: per concurrency the batches and windows left out because others' work ran beside
    them, the first reason, whether the budget for sending them again ran out; what was seen; the message."""
    by_c: dict[int, list[str]] = {}
    for c, why in foreign.values():
        by_c.setdefault(c, []).append(why)
    n_windows = {x.concurrency: x.n_foreign for x in summary}
    levels = [{"concurrency": c, "batches": len(whys), "windows": n_windows.get(c, 0), "first_reason": whys[0],
               "requests_sent_again": resent.get(c, 0), "budget_spent": len(whys) * c > resent.get(c, 0)}
              for c, whys in sorted(by_c.items())]
    saw = others.saw()
    where = "; ".join(
        f"concurrency {x['concurrency']}: {x['batches']} batch(es) ({x['windows']} windows), first because "
        f"{x['first_reason']}" + (" - others were still at work when the requests for sending them again ran out "
                                  "(as many again as asked for): its figures rest on fewer requests"
                                  if x["budget_spent"] else "")
        for x in levels)
    message = (f"others' work ran beside the measurement ({FOREIGN_FLAG}): powerprof saw {saw or 'it'} not its own. "
               f"{where}. Those windows are left out of every figure (windows.parquet foreign_traffic) and their "
               f"prompts measured again; fix: {FOREIGN_FIX}")
    return {"concurrencies": levels, **others.record(), "message": message}


def id_ranges(ids) -> str:
    """'3-6', '3', or '3, 5, 8': request ids as a person reads them."""
    ids = sorted(ids)
    if len(ids) > 1 and ids[-1] - ids[0] == len(ids) - 1:
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(map(str, ids))


def away_record(records: Sequence[RequestRecord], kept: Sequence[RequestRecord], last_id: int, later: list[int]) -> dict:
    """What a server that stopped answering cost a measurement: run.json's `server_away` (its `message` is the
    run's `aborted`). `records`: the concurrency's attempts; `kept`: the whole batches finished before; `last_id`:
    the concurrency's last request id; `later`: concurrencies never begun.

    measure stops there rather than wait: every window it keeps ran before the server went away, none spans the
    outage, and none comes from a restarted (cold) server beside them."""
    gone = [r for r in records if server_away(r)]
    first = min(gone, key=lambda r: (r.t_send_ns, r.request_id))
    done = {r.request_id for r in kept}
    lost_batches = sorted({r.batch_id for r in records if r.request_id not in done and r.batch_id is not None})
    in_flight = sorted({r.request_id for r in records if r.request_id not in done})
    failed = sorted({r.request_id for r in records if r.request_id not in done and not r.ok})
    unsent = list(range(max(in_flight) + 1, last_id + 1)) if in_flight else []
    lost = in_flight + unsent
    n_kept = len({r.request_id for r in kept if r.ok and not r.warmup})
    parts = [f"{id_ranges(failed)} failed"]
    if len(in_flight) > len(failed):
        parts.append(f"{id_ranges(sorted(set(in_flight) - set(failed)))} finished in a batch that did not")
    if unsent:
        parts.append(f"{id_ranges(unsent)} never sent")
    never = f"; concurrency {', '.join(map(str, later))} never begun" if later else ""
    message = (
        f"the server stopped answering at request {first.request_id} ({first.error}): requests {id_ranges(lost)} were lost "
        f"({', '.join(parts)}){never}; the {n_kept} measured before it are kept (they ran before it went away, so "
        "no window spans the outage); measure does not wait for a server to come back, as a window after it would "
        "be a restarted, cold server's beside the ones before; fix: rerun once the server stays up (see why it went "
        "away in its log), or `powerprof sweep --server-restart-wait SECONDS`, which waits for it and measures the "
        "level again from scratch")
    return {"request_id": first.request_id, "error": first.error, "lost_request_ids": lost,
            "concurrencies_not_begun": later, "kept": n_kept, "message": message, "lost_batch_ids": lost_batches}


def _distrust(row: dict, why: str) -> None:
    """A window kept with its record and left out of every figure, with the reason."""
    row["timing"], row["timing_reason"], row["energy_method"] = "untrusted", why, "none"
    for k in FIGURES:
        if k in row:
            row[k] = None


def interrupted_record(stopped: BaseException, records: Sequence[RequestRecord], planned: dict[int, int]) -> dict:
    """run.json's `interrupted`: the signal, the exit status, and per concurrency the requests kept of those planned
    (a concurrency the stop came before, or whose first batch it cut, keeps 0)."""
    import signal

    signum = signal.SIGINT if isinstance(stopped, KeyboardInterrupt) else stopped.signum
    name = signal.Signals(signum).name
    levels = [{"concurrency": c, "requests_planned": n,
               "requests_kept": len({r.request_id for r in records if r.concurrency == c and not r.warmup})}
              for c, n in planned.items()]
    total = sum(x["requests_kept"] for x in levels)
    short = [f"concurrency {x['concurrency']}: {x['requests_kept']} of {x['requests_planned']} requests"
             for x in levels if x["requests_kept"] < x["requests_planned"]]
    message = f"the requests in flight were dropped and the {total} that had finished (whole batches) are kept; " + (
        f"{', '.join(short)}: the figures rest on fewer requests than asked for (none where 0)" if short
        else "every request had finished")
    return {"signal": name, "exit_code": 130 if signum == signal.SIGINT else 128 + signum,
            "concurrencies": levels, "message": message}


def server_timed_note(rows: Sequence[dict]) -> str | None:
    """How many request windows took the server's own timing instead of the stream's, and why."""
    from collections import Counter

    from powerprof.arrival import fix_for, reason_group

    req = [r for r in rows if r["window_kind"] == "request" and not r["warmup"] and r["status"] == "ok"]
    srv = [r for r in req if r.get("timing") == "server"]
    if not srv:
        return None
    top, _ = Counter(reason_group(r.get("timing_reason")) for r in srv).most_common(1)[0]
    return (f"{len(srv)} of {len(req)} request windows are timed by the server's own figures, not the stream ({top}); "
            f"fix: {fix_for(top)}")


def saturation_note(server: ServerInfo, concurrency: int) -> str | None:
    """More streams than llama.cpp has slots: the rest wait in its queue (a warning, said once)."""
    if server.total_slots and concurrency > server.total_slots:
        return (
            f"concurrency {concurrency} exceeds the server's {server.total_slots} slots: requests queue; a batch whose "
            "streams never all decoded at once is left out (its figures would be those of fewer streams)"
        )
    return None


QUEUE_POLL_S = 0.25  # how often the queue probe reads vLLM's num_requests_waiting
# After a level: how long the queue times of its last requests may take to reach /metrics (vLLM records a finished
# request's stats as it hands out its last output, so the client may read its end first).
QUEUE_SETTLE_S = 1.0


class QueueProbe:
    """What vLLM says of its queue over one concurrency level: the most requests seen waiting at once
    (`num_requests_waiting`, read every QUEUE_POLL_S: a wait between two reads goes unseen) and, from
    `request_queue_time_seconds` (every finished request's wait, however short), how many waited over its first
    bucket (0.3 s: a scheduler step's wait is under it) and for how long in all."""

    def __init__(self, session, server: ServerInfo):
        self.session, self.server = session, server
        self.most = 0.0
        self.first: dict | None = None
        self.task = None

    async def start(self) -> None:
        from .client import fetch_metrics

        self.first = await fetch_metrics(self.session, self.server.base_url)  # before the level's first request
        self.task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        from .client import fetch_metrics

        while True:
            m = await fetch_metrics(self.session, self.server.base_url)
            self.most = max(self.most, (m or {}).get("waiting", 0.0))
            await asyncio.sleep(QUEUE_POLL_S)

    def cancel(self) -> None:
        """Ends the polls alone (a level cut short: its note is not given, nothing more is read)."""
        if self.task is not None:
            self.task.cancel()

    async def stop(self, finished: int) -> str | None:
        """Ends the polls; what the level's queue was, for the note (None: none seen). `finished`: the level's requests
        that ended, whose waits the histogram is read for (up to QUEUE_SETTLE_S, its reads too: fetch_metrics' own
        limit is 5 s, and a /metrics that stopped answering held the level's end that long)."""
        from .client import VLLM_QUEUE_BUCKET_S, fetch_metrics

        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        first = self.first or {}
        long_n = total_s = 0.0
        went_back = False
        if "queue_count" in first:
            deadline = time.monotonic() + QUEUE_SETTLE_S
            while True:
                try:
                    last = await asyncio.wait_for(fetch_metrics(self.session, self.server.base_url),
                                                  max(0.05, deadline - time.monotonic())) or {}
                except asyncio.TimeoutError:
                    last = {}
                n = last.get("queue_count", 0.0) - first["queue_count"]
                if n >= finished or time.monotonic() >= deadline or "queue_count" not in last:
                    break
                await asyncio.sleep(0.05)
            if "queue_count" in last:
                went_back = _queue_went_back(first, last)
                if not went_back:
                    long_n = n - (last.get("queue_short", 0.0) - first.get("queue_short", 0.0))
                    total_s = last.get("queue_sum", 0.0) - first.get("queue_sum", 0.0)
        parts = []
        if self.most > 0:
            parts.append(f"up to {self.most:g} seen waiting at once")
            if went_back:
                parts.append("its request_queue_time_seconds went back during the level (a server restart): how many "
                             "waited, and how long, is not known")
        if long_n > 0:
            parts.append(f"{long_n:g} waited over {VLLM_QUEUE_BUCKET_S:g} s for their first step, {total_s:.1f} s in "
                         "all, by its request_queue_time_seconds")
        return "; ".join(parts) or None


def _queue_went_back(first: dict, last: dict) -> bool:
    """Whether vLLM's queue histogram went back between two reads (any label set's count, short count or sum lower, or
    gone; a value not finite): a restart between them, whose deltas are not the waits of the requests in between."""
    import math

    before, after = first.get("queue_series", {}), last.get("queue_series", {})
    for key, parts in before.items():
        now = after.get(key)
        if now is None:
            return True
        for part, v in parts.items():
            w = now.get(part)
            if w is None or not (math.isfinite(v) and math.isfinite(w)) or w < v:
                return True
    return not all(math.isfinite(x) for p in after.values() for x in p.values())


def run_measure(rig, **kw) -> MeasureResult:
    """Everything `powerprof measure` does on the `rig` (`_run_measure`). A signal's exit is raised once: a repeat
    while a stopped run writes what it finished is only noted."""
    with termination.exits_latched():
        return _run_measure(rig, **kw)


def _run_measure(
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
    default_out: bool = False,
    allow_unmeasured_server_gpus: bool = False,
) -> MeasureResult:
    """Everything `powerprof measure` does on the `rig` (powerprof.rig.Rig: its GPUs, RAPL and
    server, whatever they are): Profiler, load, windows.parquet and run.json in `out_dir`. Reads
    counters only; changes no setting. default_out: `out_dir` is the default name (no --out), made as
    `claim_run_dir` makes it (the next free name where it is taken), never a name the user gave."""
    from contextlib import ExitStack

    from powerprof import __version__
    from powerprof.profiler import Profiler
    from powerprof.storage.runs import RunWriter, split_storable, table_from_rows
    from powerprof.workload.load import prompt_set_record

    from .placement import LookUnderLoad, cost_words, find_placement, judge_placement
    from .serverprocs import ServerProcesses

    from powerprof.paths import path_problem

    if (why := path_problem(out_dir)) is not None:  # an OSError traceback from exists() ("File name too long")
        raise ValueError(f"--out {out_dir}: {why}")
    if not default_out and out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"output directory {out_dir} already exists and is not empty; choose another --out")
    why = out_dir_refusal(out_dir, "output directory")
    if why:  # as root (sudo for RAPL): checked before the folder is made or a --launch server started
        raise ValueError(why)
    # Made before any request, so an unusable --out costs nothing (not a finished measurement).
    try:
        if default_out:  # runs/<time>-measure taken (another run started in the same second): the next free name
            from powerprof.storage.runs import claim_run_dir

            out_dir = claim_run_dir(out_dir)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the output directory {out_dir}: {e.strerror or e}") from None
    notes: list[str] = []
    with ExitStack() as stack:
        # A measurement that fails before writing leaves nothing behind.
        stack.push(lambda exc_type, *_: _remove_if_empty(out_dir) if exc_type is not None else None)
        src = rig.sources
        launched: list = []
        url = stack.enter_context(rig.server(url, launch, launch_timeout_s=launch_timeout_s, sim_decode_tok_s=sim_decode_tok_s,
                                             launched=launched))
        notes.extend(rig.notes)
        server_procs = ServerProcesses(url, launched)
        look = None
        if src.nvml is not None:
            # Every GPU NVML reports: a server GPU left unmeasured is refused (its energy would be in no figure); a
            # measured GPU the server does not use is said (its idle power is in every figure).
            placement = find_placement(src.nvml.nvml, src.gpu_uuids, server_procs)
            cost = cost_words("none")  # measure steps nothing: no limit "not stepped"
            judge_placement(placement, notes, allow=allow_unmeasured_server_gpus, stopped="nothing was measured",
                            cost=cost)
            # Looked at again after every batch: a small model idle during this look was taken for a helper.
            look = LookUnderLoad(src.nvml.nvml, src.gpu_uuids, server_procs, placement,
                                 allow=allow_unmeasured_server_gpus, stopped="measure stopped, nothing kept",
                                 cost=cost, notes=notes)
        for p in src.problems:
            if p.source == "nvml" and src.nvml is None:
                cpu = "and CPU energy" if src.rapl is not None else "only"
                notes.append(NO_GPU_NOTE.format(cpu=cpu) + f" ({p.message})")
            elif p.source == "rapl":
                notes.append(f"{p.message}" + (f"; fix: {p.fix}" if p.fix else ""))
        profiler = None
        if src.nvml is not None or src.rapl is not None:
            nv = src.nvml
            # Whose CPU time the host spent, beside RAPL's whole-package energy (a busy host is flagged).
            cputime = rig.cpu_time_collector(url, launched) if src.rapl is not None else None
            profiler = Profiler(nv.nvml if nv else None, nv.indexes if nv else None, src.rapl, interval_s=interval_s,
                                cputime=cputime)
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
            keep_on_stop=True,
            server_procs=server_procs,
            placement_look=look,
        )
        died = launched[0].death_note() if launched and result.aborted else ""
        if died:
            result.aborted = f"{result.aborted}; {died}"
        # The settings the figures are of (measure changes none): each GPU's limits as the measurement began.
        gpus = [{"index": i.index, "uuid": i.uuid, "name": i.name, "driver": i.driver_version,
                 "power_limit_w": result.limits_w.get(i.index, (None, None))[0],
                 "enforced_limit_w": result.limits_w.get(i.index, (None, None))[1]}
                for i in (profiler.gpu_infos if profiler else [])]
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
        "prompt_set": prompt_set_record(prompts),  # what analyze's pooling check compares
        "notes": notes + result.notes,
        "aborted": result.aborted,
        "server_away": result.server_away,  # null: it answered throughout
        "foreign_traffic": result.foreign_traffic,  # null: no one else's work was seen beside the windows
        # What each concurrency's GPU J/token sums, GPU by GPU (the figure is their sum).
        "per_gpu": [{"concurrency": x.concurrency, "gpu_j_per_token": x.gpu_j_per_token, "gpus": x.gpus}
                    for x in result.summaries if x.gpus],
        "interrupted": result.interrupted,  # null: every request was sent and answered
    }
    meta["simulated"] = meta["simulated"] or s.simulated
    result.rows, bad, err = split_storable("windows", result.rows)
    if bad:
        notes.append(f"{len(bad)} window row(s) could not be stored and are left out of every figure ({err})")
    result.notes = notes + result.notes
    try:
        with termination.exits_held() as late:  # run.json and its table, or neither
            writer = RunWriter(out_dir, meta)
            writer.write("windows", table_from_rows("windows", result.rows))
    except OSError as e:
        # A full disk: run.json alone would be a run without its windows, so neither is kept; the figures, already
        # measured, are still printed (the command's exit says they were not stored).
        from powerprof.storage.runs import RUN_JSON, write_failure, write_fix

        for name in (RUN_JSON, "windows.parquet"):  # the folder was empty (or made) before: these are ours
            (out_dir / name).unlink(missing_ok=True)
        _remove_if_empty(out_dir)
        result.notes = [unstored(n) for n in result.notes]
        if result.foreign_traffic:
            result.foreign_traffic["message"] = unstored(result.foreign_traffic["message"])
        result.write_error = (f"cannot write the measurement to {out_dir}: {write_failure(e)}; nothing was stored "
                              f"(run.json and windows.parquet go together), the figures above are the only record; "
                              f"fix: {write_fix(e)}")
        return result
    result.out_path = out_dir
    if late and result.stopped is None:
        # The measurement was complete and is written; the stop asked for is still its exit status.
        result.stopped = termination.exit_for(late[0])
    return result


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()  # only succeeds when empty
    except OSError:
        pass
