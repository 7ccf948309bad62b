"""Replays a request trace against a server: each request at its arrival time, with its prompt and output lengths.

Prompts are built to the trace's length (`prompt_text`: one word per token after the BOS on
common tokenizers; exact on the simulator) and start with the request's index, so no two share
a cached prefix; `max_tokens` is the trace's output length, with ignore-EOS (llama.cpp, vLLM,
SGLang) and `min_tokens` (vLLM) so the server generates all of it. Arrivals follow the trace's
times divided by a time scale, on the monotonic clock; a request sent late (the event loop was
busy) records its lateness, measured when it is sent. Every request gives one `ReplayRecord`; failures are records too.
`TraceReplay` is `powerprof replay`'s run on the server the door gives; `ReplayReport` what it says at the end.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

import aiohttp
import numpy as np
from powerprof import termination

from .client import RequestParams, RequestRecord, ServerInfo, detect_server, new_session, send_request, server_away
from .trace import TraceRequest


# Sent this much later than due (p95), a replay is said not to have kept the trace's pace.
LATE_NOTE_S = 0.05
# Under this many requests a p95 is an interpolation between the slowest two, not a 95th percentile.
MIN_P95_REQUESTS = 20


def few_for_p95(n: int) -> str | None:
    """Why a p95 over `n` requests is no 95th percentile, with the fix; None when there are enough."""
    if n >= MIN_P95_REQUESTS:
        return None
    return (f"the p95 figures rest on {n} request{'s' if n != 1 else ''}, fewer than {MIN_P95_REQUESTS}: they are about "
            "the slowest one, not a 95th percentile; fix: replay more requests (a longer trace or --duration)")


def cut_short(records: list[ReplayRecord]) -> str | None:
    """Requests the server ended before the trace's output length (its context full), said with the tokens lost."""
    cut = [r for r in records if r.record.ok and r.record.truncated]
    if not cut:
        return None
    got = sum(r.record.generated_tokens for r in cut)
    asked = sum(max(1, r.trace.output_tokens) for r in cut)
    return (f"{len(cut)} request{'s were' if len(cut) != 1 else ' was'} cut short by the server ({cut[0].record.truncated}): "
            f"{got} of the {asked} tokens they ask for were generated, so the traffic served was lighter than the "
            "trace's; fix: a server with a longer context, or drop those requests from the trace")


def away_record(records: list[ReplayRecord]) -> dict | None:
    """The requests a server that stopped answering (refused, reset, cut, 503: client.server_away) cost the replay,
    with what that means and the fix; None where it answered throughout. A replay sends each request once, at its
    time, and never waits for a server to come back: the requests due while it was away fail."""
    from .measure import id_ranges

    gone = sorted((r for r in records if server_away(r.record)), key=lambda r: r.index)
    if not gone:
        return None
    ok = sum(r.record.ok for r in records)
    t0, t1 = gone[0].trace.t_s, gone[-1].trace.t_s
    message = (
        f"the server stopped answering during the replay ({gone[0].record.error}): requests {id_ranges([r.index for r in gone])} "
        f"of the trace (due {t0:.1f}-{t1:.1f} s in) were lost; the figures are over the {ok} that succeeded, so the "
        "traffic served was not the trace's (and the requests after it came back met a restarted, cold server); "
        "replay does not wait for a server to come back; fix: rerun once it stays up (see why it went away in its "
        "log); a sweep of prompts rides out a restart (`powerprof sweep --server-restart-wait SECONDS`)")
    return {"lost_request_indexes": [r.index for r in gone], "error": gone[0].record.error, "message": message}


def trace_notes(trace: list[TraceRequest]) -> list[str]:
    """What the replay sends other than the trace says."""
    notes = []
    zero = sum(r.output_tokens == 0 for r in trace)
    if zero:
        notes.append(f"{zero} of {len(trace)} requests ask for 0 output tokens: each is sent asking for 1 (no server "
                     "can be asked for none), so one token each is generated and counted")
    short = sum(r.prompt_tokens < 2 for r in trace)
    if short:
        # prompt_text's floor: the BOS and the request's own marker, which keeps it from sharing a cached prefix.
        notes.append(f"{short} of {len(trace)} requests have a prompt of 0 or 1 tokens: each is sent as about 2 (the "
                     "BOS and a marker unique to the request, so that no two share a cached prefix), and the prompt "
                     "tokens counted are the server's, of what was sent")
    return notes


def prompt_text(n_tokens: int, index: int) -> str:
    """About `n_tokens` tokens: the BOS, a marker unique to the request, then repeated words."""
    return " ".join([f"r{index}"] + ["hello"] * max(n_tokens - 2, 0))


@dataclass(frozen=True)
class ReplayRecord:
    index: int  # position in the trace
    trace: TraceRequest
    late_s: float  # sent this long after its scheduled time
    record: RequestRecord

    @property
    def latency_s(self) -> float:
        return (self.record.t_end_ns - self.record.t_send_ns) / 1e9


@dataclass(frozen=True)
class ReplaySummary:
    n: int
    ok: int
    failed: int
    generated_tokens: int
    prompt_tokens: int
    duration_s: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    tpot_p50_s: float | None  # time per output token after the first
    late_p95_s: float
    # Requests whose server's own token count contradicts its stream (arrival.count_problem): the
    # token figures above rest on those counts.
    count_problems: int = 0
    count_problem: str | None = None  # the first one's reason

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _pct(v, q):
    return float(np.percentile(v, q)) if len(v) else None


def summarize(records: list[ReplayRecord]) -> ReplaySummary:
    ok = [r for r in records if r.record.ok]
    ttft = [r.record.ttft_s for r in ok if r.record.ttft_s is not None]
    lat = [r.latency_s for r in ok]
    tpot = [r.record.decode_s / r.record.decode_tokens for r in ok if r.record.decode_s and r.record.decode_tokens]
    t0 = min((r.record.t_send_ns for r in records), default=0)
    t1 = max((r.record.t_end_ns for r in records), default=0)
    lies = [p for p in (r.record.count_problem for r in ok) if p]
    return ReplaySummary(
        n=len(records), ok=len(ok), failed=len(records) - len(ok),
        generated_tokens=int(sum(r.record.generated_tokens for r in ok)),
        prompt_tokens=int(sum(r.record.prompt_tokens or 0 for r in ok)),
        duration_s=(t1 - t0) / 1e9,
        ttft_p50_s=_pct(ttft, 50), ttft_p95_s=_pct(ttft, 95),
        latency_p50_s=_pct(lat, 50), latency_p95_s=_pct(lat, 95), tpot_p50_s=_pct(tpot, 50),
        late_p95_s=_pct([r.late_s for r in records], 95) or 0.0,
        count_problems=len(lies),
        count_problem=lies[0] if lies else None,
    )


async def replay_async(
    session: aiohttp.ClientSession,
    server: ServerInfo,
    trace: list[TraceRequest],
    params: RequestParams = RequestParams(),
    tag_header: str = "X-Powerprof-Tag",
    extra_headers=None,
    clock_ns=time.monotonic_ns,
    done: list | None = None,
) -> list[ReplayRecord]:
    """Send every request of `trace` at its time (offsets from now). extra_headers(index) → dict.
    done: each finished ReplayRecord is appended there as it finishes (what a cancelled replay kept)."""
    start = clock_ns() + 50_000_000
    out: list[ReplayRecord | None] = [None] * len(trace)

    async def one(i: int, r: TraceRequest, due: int) -> None:
        headers = dict(extra_headers(i)) if extra_headers else {}
        if r.tag is not None:
            headers[tag_header] = r.tag
        rec = await send_request(session, server, prompt_text(r.prompt_tokens, i),
                                 replace(params, max_tokens=max(1, r.output_tokens)), request_id=i,
                                 prompt_id=f"trace-{i}", headers=headers or None, clock_ns=clock_ns)
        # Late as sent, not as scheduled: a task made on time runs after what the loop had queued (other
        # requests' prompts, their streams), and requests due together were all "on time" by the old stamp.
        out[i] = ReplayRecord(i, r, max(0.0, (rec.t_send_ns - due) / 1e9), rec)
        if done is not None:
            done.append(out[i])

    tasks = []
    try:
        for i, r in enumerate(trace):
            due = start + int(r.t_s * 1e9)
            wait = (due - clock_ns()) / 1e9
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, r, due)))
        await asyncio.gather(*tasks)
    finally:
        # Stopped (Ctrl-C cancels this task while it sleeps or gathers): the requests in flight are cut here and
        # awaited, or each would fail later as the session closes and print "Task exception was never retrieved".
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [r for r in out if r is not None]


def replay(url: str, trace: list[TraceRequest], params: RequestParams = RequestParams(), api: str | None = None,
           tag_header: str = "X-Powerprof-Tag") -> tuple[ServerInfo, list[ReplayRecord]]:
    """Synchronous replay against a URL (the server kind is detected)."""

    async def go():
        async with new_session() as s:
            server = await detect_server(s, url, api)
            return server, await replay_async(s, server, trace, params, tag_header)

    return termination.run(go())


# --- `powerprof replay`: one trace against the server the door gives, and what it says at the end ------------------


class TraceReplay:
    """`powerprof replay`: the trace against a server, the server's books judged against the replay's own over the
    whole of it (workload/others.py). A stop (Ctrl-C, a signal) leaves the finished requests here: the caller catches
    it where it closes the rig and the server, sets `stopped`, and `report()` is over what had finished."""

    def __init__(self, trace: list[TraceRequest], api: str | None, tag_header: str, say):
        self.trace, self.api, self.tag_header, self.say = trace, api, tag_header, say
        self.done: list[ReplayRecord] = []  # finished requests, kept when a signal stops the replay
        self.found: list[ServerInfo] = []  # the server, once detected
        self.watch: list = []  # (OthersWatch, why): the server's books against the replay's own
        self.records: list[ReplayRecord] | None = None  # every request, once the replay has ended
        self.stopped: BaseException | None = None  # the Ctrl-C or signal that ended it early

    def finished_any(self) -> bool:
        """Whether a stop now leaves anything to report: the server answered and a request finished."""
        return bool(self.done and self.found)

    async def _go(self, base: str) -> None:
        from .others import OthersWatch

        async with new_session() as s:
            self.found.append(await detect_server(s, base, self.api))
            # Said once the server answers: said before, it read as started to a user whose server was not there.
            self.say(f"replaying {len(self.trace)} request(s) over {self.trace[-1].t_s:.1f} s (Ctrl-C stops it and "
                     "reports those finished)")
            # A replay's requests overlap: the server's books are compared over the whole replay, as one batch.
            others = OthersWatch(s, self.found[0].base_url, kind=self.found[0].kind)
            await others.begin()
            recs = await replay_async(s, self.found[0], self.trace, RequestParams(), self.tag_header, done=self.done)
            self.watch.append((others, await others.judge([r.record for r in recs])))
            self.records = recs

    def run(self, base: str) -> None:
        """Replay the trace against the server at `base` (ServerUnreachable, LaunchError, a stop: raised)."""
        termination.run(self._go(base))

    def report(self) -> "ReplayReport":
        """The figures and notes over the requests that finished (all of them, unless `stopped`)."""
        from .others import FOREIGN_FIX, FOREIGN_FLAG

        records = self.records if self.stopped is None else sorted(self.done, key=lambda r: r.index)
        sm = summarize(records)
        notes = trace_notes(self.trace)
        away = away_record(records)
        if sm.count_problems:
            from powerprof.arrival import fix_for

            notes.append(f"the token figures are the server's own counts, and for {sm.count_problems} of {sm.ok} "
                         f"requests they contradict its stream ({sm.count_problem}); fix: {fix_for(sm.count_problem)}")
        if sm.late_p95_s > LATE_NOTE_S:
            notes.append(f"requests were sent late (p95 {sm.late_p95_s:.2f} s): this machine could not keep the "
                         "trace's pace")
        if cut_short(records):
            notes.append(cut_short(records))
        if sm.ok and few_for_p95(sm.ok):
            notes.append(few_for_p95(sm.ok))
        foreign = None
        if self.watch:
            others, why = self.watch[0]
            if why:
                foreign = {"reason": why, **others.record(),
                           "message": f"others' work ran beside the replay ({FOREIGN_FLAG}): {why}; its latencies and "
                                      "throughput hold their queueing and their tokens' steps, not the trace's traffic "
                                      f"alone; fix: {FOREIGN_FIX}"}
                notes.insert(0, foreign["message"])
            notes.extend(others.cannot)
        return ReplayReport(self.found[0], records, sm, notes, away, foreign, len(self.trace), self.stopped)


@dataclass
class ReplayReport:
    """What `powerprof replay` says at the end: its figures (`to_dict` for --json, `lines` for text) and the error it
    exits 1 with, if any (`error`)."""

    server: ServerInfo
    records: list[ReplayRecord]
    summary: ReplaySummary
    notes: list[str]
    away: dict | None  # away_record
    foreign: dict | None  # others' work beside the replay: reason, the server's books, message
    n_planned: int  # requests in the trace
    stopped: BaseException | None

    def to_dict(self) -> dict:
        return {"server": self.server.meta(), **self.summary.to_dict(), "notes": self.notes, "server_away": self.away,
                "foreign_traffic": self.foreign,
                "interrupted": None if self.stopped is None else {"requests_planned": self.n_planned}}

    def lines(self) -> list[str]:
        sm, server = self.summary, self.server

        def f(v):
            return "-" if v is None else f"{v:.3f}"

        return [f"server: {server.kind} ({server.api})" + (" [simulated]" if server.simulated else ""),
                f"requests: {sm.ok} ok, {sm.failed} failed, in {sm.duration_s:.1f} s; "
                f"{sm.generated_tokens} token{'' if sm.generated_tokens == 1 else 's'} generated "
                f"({sm.generated_tokens / sm.duration_s if sm.duration_s else 0:.1f}/s), "
                f"{sm.prompt_tokens} prompt tokens",
                f"TTFT p50 {f(sm.ttft_p50_s)} s, p95 {f(sm.ttft_p95_s)} s; latency p50 {f(sm.latency_p50_s)} s, "
                f"p95 {f(sm.latency_p95_s)} s; time per output token p50 {f(sm.tpot_p50_s)} s",
                *(f"note: {n}" for n in self.notes)]

    def stopped_line(self, how: str) -> str:
        """What a replay stopped early kept, after `how` it was stopped ("interrupted", "stopped by SIGTERM")."""
        return (f"{how}: the figures are over the {self.summary.n} of {self.n_planned} requests that had finished "
                "(those in flight were cut and left out, the rest never sent)")

    def error(self) -> str | None:
        """Why the replay fails (exit 1): the server went away, else requests failed, else others' work beside it."""
        if self.away is not None:
            return self.away["message"]
        if self.summary.failed:
            errs = sorted({r.record.error for r in self.records if not r.record.ok})[:3]
            return f"{self.summary.failed} of {self.summary.n} requests failed: " + "; ".join(e or "?" for e in errs)
        if self.foreign is not None:
            return f"the figures above are not the trace's alone: {self.foreign['message']}"
        return None
