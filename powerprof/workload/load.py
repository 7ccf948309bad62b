"""Deterministic load: prompt sets, batches of N concurrent streams, bounded retries, abort on failures.

`run_load` is the synchronous entry point the sweep calls once per level; it returns every
attempt (failed ones included, flagged) so that nothing is lost and nothing failed is counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import aiohttp
import numpy as np

from powerprof import termination
from powerprof.termination import raise_if_terminated

from .client import (
    CONTEXT_FIX,
    EdgeHook,
    RequestParams,
    RequestRecord,
    ServerInfo,
    detect_server,
    fetch_metrics,
    names_context,
    new_session,
    send_request,
    server_away,
    vllm_decode_delta,
)


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    max_tokens: int | None = None  # overrides RequestParams.max_tokens for this prompt


class LoadAborted(Exception):
    """Too many failures: the run stopped. `records` holds every attempt made so far."""

    def __init__(self, msg: str, records: list[RequestRecord]):
        super().__init__(msg)
        self.records = records


class PromptFileError(ValueError):
    """A --prompts file that cannot be used; the message names the file and line."""


# --- prompt sets ---------------------------------------------------------------------------------

_SHORT = (
    "Explain in one paragraph why the sky is blue.",
    "Write a haiku about a graphics card that runs too hot.",
    "List five uses of a hash table.",
    "What is the capital of Australia, and why is it not Sydney?",
)

_TOPICS = ("power limits on GPUs", "memory bandwidth in transformer decoding", "speculative decoding", "dynamic voltage and frequency scaling")

_PARAGRAPH = (
    "A data centre operator wants to know how much energy each generated token costs and whether a "
    "lower power limit would save energy without hurting latency too much. The machine serves a "
    "language model to many users, and most of the time is spent generating tokens one after another. "
    "Each step reads the weights of the model from memory, multiplies them with a small activation "
    "vector, and samples the next token. "
)


def _medium(i: int) -> str:
    return f"Read the following notes and summarise them with attention to {_TOPICS[i]}.\n\n" + _PARAGRAPH * 2


def _long(i: int) -> str:
    return f"Here is a long report. Answer: what does it imply for {_TOPICS[i]}?\n\n" + _PARAGRAPH * 8


PROMPT_SETS: dict[str, tuple[Prompt, ...]] = {
    "short": tuple(Prompt(f"short-{i}", t) for i, t in enumerate(_SHORT)),
    "medium": tuple(Prompt(f"medium-{i}", _medium(i)) for i in range(4)),
    "long": tuple(Prompt(f"long-{i}", _long(i)) for i in range(4)),
}
PROMPT_SETS["mixed"] = PROMPT_SETS["short"][:2] + PROMPT_SETS["medium"][:1] + PROMPT_SETS["long"][:1]


def prompt_set_identity(prompts) -> str:
    """The sha256 (hex) naming a prompt set in run.json's `prompt_set`: every prompt's id, text as sent and own
    max_tokens, in order (request j of each level sends prompt j). Nothing a tokenizer decides goes in, so one
    file gives one hash on any server; JSON keeps the texts apart (no two sets join into one string)."""
    import hashlib  # noqa: PLC0415

    doc = [[p.id, p.text, p.max_tokens] for p in prompts]
    return hashlib.sha256(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")).hexdigest()


def prompt_set_record(prompts) -> dict:
    """run.json's `prompt_set`: {"sha256": prompt_set_identity, "prompts": how many}."""
    prompts = list(prompts)
    return {"sha256": prompt_set_identity(prompts), "prompts": len(prompts)}


def builtin_prompts(name: str) -> list[Prompt]:
    try:
        return list(PROMPT_SETS[name])
    except KeyError:
        raise PromptFileError(f"unknown prompt set {name!r}; choose one of: {', '.join(PROMPT_SETS)}") from None


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSONL file: one object per line with "prompt" (or "text"), optional "id", "max_tokens"."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{p}: cannot read: {e}") from None
    out: list[Prompt] = []
    seen: set[str] = set()
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise PromptFileError(f"{p}:{no}: not valid JSON ({e.msg})") from None
        except RecursionError:  # nested past Python's stack: no ValueError, and it was a traceback
            raise PromptFileError(f"{p}:{no}: not valid JSON (nested deeper than Python's parser goes)") from None
        if not isinstance(obj, dict):
            raise PromptFileError(f"{p}:{no}: expected a JSON object like {{\"prompt\": \"...\"}}")
        text = obj.get("prompt", obj.get("text"))
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{p}:{no}: needs a non-empty string field \"prompt\"")
        pid = obj.get("id", f"line-{no}")
        if not isinstance(pid, (str, int)):
            raise PromptFileError(f"{p}:{no}: \"id\" must be a string or number")
        for field, value in (("prompt" if "prompt" in obj else "text", text), ("id", pid)):
            # A lone surrogate (JSON's "\ud800") is no Unicode text: no UTF-8 encodes it, so it passed here and
            # failed at the first request with an unnamed UnicodeEncodeError.
            if isinstance(value, str) and (bad := next((i for i, c in enumerate(value) if 0xD800 <= ord(c) <= 0xDFFF), None)) is not None:
                raise PromptFileError(f"{p}:{no}: \"{field}\" holds a lone surrogate (\\u{ord(value[bad]):04x} at "
                                      f"character {bad + 1}): not Unicode text, no server can be sent it; fix the "
                                      "file's \\u escapes (a pair \\ud83d\\ude00 is one character, half of one is none)")
        pid = str(pid)
        if pid in seen:
            raise PromptFileError(f"{p}:{no}: duplicate id {pid!r}")
        seen.add(pid)
        mt = obj.get("max_tokens")
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 2):
            # As --max-tokens: the first token comes out of prefill, so one token leaves no decode to time.
            raise PromptFileError(f"{p}:{no}: \"max_tokens\" must be at least 2 (an integer): the first token "
                                  "comes out of prefill, and decode is timed from it to the last")
        out.append(Prompt(pid, text, mt))
    if not out:
        raise PromptFileError(f"{p}: no prompts in file")
    return out


# --- running the load ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadPolicy:
    """How hard to try before giving up."""

    max_attempts: int = 3  # per request, the first try included
    max_failed_attempts: int | None = None  # over the run; default: max(3, n_requests // 2)
    retry_backoff_s: float = 0.2  # doubled per retry of the same request
    # Stop at the first attempt that says the server itself went away (client.server_away), unretried: a retry
    # answered by a restarted server would be measured beside the windows before it as one run (measure).
    stop_when_server_away: bool = False


class LagMonitor:
    """Measures how late the client's event loop runs: a tick every `period_s`, its lateness kept.

    A token read can be no fresher than the loop that takes it: a starved client (a busy host, a
    stopped process) shows here as lateness, and a window edge read right after such a stall is
    late by as much (arrival.py uses it in the timing rule)."""

    def __init__(self, period_s: float = 0.005, keep_s: float = 600.0):
        self.period_ns = int(period_s * 1e9)
        # The last keep_s of ticks (records are annotated after every batch; a request longer than
        # this has its first edge's lag unknown: lag_at says None, and the stream is not vouched for).
        n = int(keep_s / period_s)
        self.due: deque[int] = deque(maxlen=n)
        self.ran: deque[int] = deque(maxlen=n)
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        due = time.monotonic_ns()
        while True:
            due += self.period_ns
            await asyncio.sleep(max(0.0, (due - time.monotonic_ns()) / 1e9))
            now = time.monotonic_ns()
            self.due.append(due)
            self.ran.append(now)
            if now - due > self.period_ns:
                due = now  # restart the schedule: one stall is one lateness, not a train of them

    def start(self) -> None:
        now = time.monotonic_ns()  # watched from now: a read before the first tick is not "unknown"
        self.due.append(now)
        self.ran.append(now)
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def lag_at(self, t_ns: int) -> float:
        """How long the loop had been unavailable when the read at t_ns ran (s): data that came
        in meanwhile waited that long. A stall that starts with the read (its own processing, an
        edge hook reading sensors) does not count: the read was on time."""
        if not self.due or t_ns < self.due[0]:
            return None  # before the first tick kept: unknown
        d = np.asarray(self.due, dtype=np.int64)
        r = np.asarray(self.ran, dtype=np.int64)
        hit = (d <= t_ns) & (t_ns <= r)
        return float((t_ns - d[hit]).max() / 1e9) if hit.any() else 0.0

    def lag_over(self, t0_ns: int, t1_ns: int) -> float:
        d = np.asarray(self.due, dtype=np.int64)
        r = np.asarray(self.ran, dtype=np.int64)
        hit = (r >= t0_ns) & (d <= t1_ns)
        return float((r[hit] - d[hit]).max() / 1e9) if hit.any() else 0.0

    def annotate(self, rec: RequestRecord) -> RequestRecord:
        if not rec.ok or rec.t_first_ns is None:
            return rec
        q = rec.quality  # the lag that matters is at the edges the window uses
        if q.t_first_ns is None:  # events, but none with a token: no edges for a lag to move
            return rec
        lags = [self.lag_at(q.t_first_ns), self.lag_at(q.t_last_ns)]
        # Unknown (a request longer than the ticks kept): not a stream the rule can vouch for.
        edge = max(x if x is not None else float("inf") for x in lags)
        return replace(rec, client_lag_s=edge, client_lag_max_s=self.lag_over(q.t_first_ns, q.t_last_ns))


def _not_retryable(rec: RequestRecord) -> bool:
    """A 4xx answer (context length exceeded, bad parameter) says the request itself is wrong:
    asking again gets the same answer. 408 and 429 are about timing and are retried. So is a context refusal
    inside an HTTP 200 (SGLang's streamed /generate sends its ValueError as the stream's one event)."""
    if rec.http_status is not None and 400 <= rec.http_status < 500 and rec.http_status not in (408, 429):
        return True
    return not rec.event_t_ns and names_context(rec.error)


class _Run:
    def __init__(self, session, server, params, policy, n_requests, edge_hook):
        self.session = session
        self.server = server
        self.params = params
        self.policy = policy
        self.edge_hook = edge_hook
        self.records: list[RequestRecord] = []
        self.failed = 0
        self.limit = policy.max_failed_attempts if policy.max_failed_attempts is not None else max(3, n_requests // 2)
        self.abort: str | None = None
        self.lag = LagMonitor()

    async def annotate(self) -> None:
        """Client lag for the records made so far (after a yield, so the tick that follows a stall has run)."""
        await asyncio.sleep(0)
        self.records[:] = [self.lag.annotate(r) if r.client_lag_s is None else r for r in self.records]

    async def one(self, rid: int, prompt: Prompt, batch_id: int, concurrency: int, warmup: bool) -> None:
        params = self.params if prompt.max_tokens is None else replace(self.params, max_tokens=prompt.max_tokens)
        for attempt in range(1, self.policy.max_attempts + 1):
            raise_if_terminated()
            if self.abort:
                return
            # vLLM times each request itself, visible as /metrics deltas; they belong to this request
            # only when it runs alone (concurrency 1).
            probe = self.server.kind == "vllm" and concurrency == 1
            before = await fetch_metrics(self.session, self.server.base_url) if probe else None
            rec = await send_request(
                self.session,
                self.server,
                prompt.text,
                params,
                request_id=rid,
                prompt_id=prompt.id,
                attempt=attempt,
                warmup=warmup,
                batch_id=batch_id,
                concurrency=concurrency,
                edge_hook=self.edge_hook,
            )
            if before is not None and rec.ok:
                after = await fetch_metrics(self.session, self.server.base_url)
                sd_s, sd_n, src = vllm_decode_delta(before, after or {})
                if sd_s is not None:
                    rec = replace(rec, server_decode_s=sd_s, server_decode_tokens=sd_n, server_timing_source=src)
            self.records.append(rec)
            if rec.ok:
                return
            self.failed += 1
            if self.policy.stop_when_server_away and server_away(rec):
                self.abort = self.abort or f"the server stopped answering at request {rid} ({rec.error})"
                return
            if _not_retryable(rec):
                self.abort = f"request {rid} (prompt {prompt.id}) was refused by the server, not retried: {rec.error}"
                if names_context(rec.error):
                    self.abort += f"; {CONTEXT_FIX}"
                return
            if self.failed > self.limit:
                self.abort = f"too many failed requests ({self.failed}); last error: {rec.error}"
                return
            if attempt < self.policy.max_attempts:
                await asyncio.sleep(self.policy.retry_backoff_s * 2 ** (attempt - 1))
        self.abort = f"request {rid} ({prompt.id}) failed {self.policy.max_attempts} times; last error: {self.records[-1].error}"


async def run_load_async(
    server: ServerInfo,
    prompts: Sequence[Prompt],
    n_requests: int,
    concurrency: int,
    params: RequestParams,
    edge_hook: EdgeHook | None = None,
    warmup: int = 1,
    policy: LoadPolicy = LoadPolicy(),
    session: aiohttp.ClientSession | None = None,
    first_request_id: int = 0,
    first_batch_id: int = 0,
    finished: list[RequestRecord] | None = None,
    between=None,
) -> list[RequestRecord]:
    """Warm-up requests (flagged), then `n_requests` in batches of `concurrency` sent at once; each batch finishes
    before the next starts. Prompts cycle in order. The warm-up runs as the measured batches do, `concurrency`
    streams at once, its count rounded up to whole batches (`warmup_streams`): a server's first batch of a size it
    had not run decoded 2.4-3.4x slower than the next on a real H200 (docs/hardware.md, runs 3 and 4), so single
    warm-ups left the first measured batch at any concurrency above 1 cold.
    `finished`: each batch's records are appended to it once the whole batch is done and annotated,
    so a run stopped by a signal knows what it can keep (never a part of a batch).
    `between(records)`: awaited after each batch, warm-up ones included, while none of ours is in flight (the
    moment to read the server's books: workload/others.py); True for a measured batch sends its prompts again
    as a new batch (it ran beside others' work), and it does not count towards `n_requests`: the caller bounds
    how often it answers True."""
    if n_requests < 1 or concurrency < 1 or warmup < 0:
        raise ValueError("n_requests and concurrency must be at least 1, warmup at least 0")
    if not prompts:
        raise ValueError("no prompts")
    own = session is None
    if own:
        session = new_session()
    n_warm = warmup_streams(warmup, concurrency)
    run = _Run(session, server, params, policy, n_requests + n_warm, edge_hook)
    run.lag.start()
    kept = 0

    async def batch_done() -> bool:
        nonlocal kept
        recs = run.records[kept:]
        if finished is not None:
            finished.extend(recs)
        kept = len(run.records)
        return bool(await between(recs)) if between is not None else False

    try:
        rid = first_request_id
        batch = first_batch_id
        for first in range(0, n_warm, concurrency):
            await asyncio.gather(*(run.one(rid + j, prompts[(first + j) % len(prompts)], batch, concurrency, True)
                                   for j in range(concurrency)))
            rid += concurrency
            batch += 1
            await run.annotate()
            if run.abort:
                raise LoadAborted(run.abort, run.records)
            await batch_done()  # a warm-up is never sent again: its figures count nowhere
        done = 0
        while done < n_requests:
            n = min(concurrency, n_requests - done)
            await asyncio.gather(
                *(run.one(rid + j, prompts[(done + j) % len(prompts)], batch, concurrency, False) for j in range(n))
            )
            rid += n
            batch += 1
            await run.annotate()
            if run.abort:
                raise LoadAborted(run.abort, run.records)
            if not await batch_done():
                done += n
    finally:
        await run.lag.stop()
        if own:
            await session.close()
    return run.records


def warmup_streams(warmup: int, concurrency: int) -> int:
    """Warm-up requests a run at `concurrency` sends for `warmup` asked: whole batches of its size (0 for 0)."""
    return -(-warmup // concurrency) * concurrency


def run_load(
    target: ServerInfo | str,
    prompts: Sequence[Prompt],
    n_requests: int,
    concurrency: int,
    params: RequestParams = RequestParams(),
    edge_hook: EdgeHook | None = None,
    warmup: int = 1,
    policy: LoadPolicy = LoadPolicy(),
    api: str | None = None,
) -> list[RequestRecord]:
    """Synchronous `run_load_async`; `target` may be a URL (the server kind is detected)."""

    async def go():
        async with new_session() as s:
            server = target if isinstance(target, ServerInfo) else await detect_server(s, target, api)
            return await run_load_async(server, prompts, n_requests, concurrency, params, edge_hook, warmup, policy, s)

    return termination.run(go())


def detect(url: str, api: str | None = None) -> ServerInfo:
    """Synchronous `detect_server`."""

    async def go():
        async with new_session() as s:
            return await detect_server(s, url, api)

    return termination.run(go())
