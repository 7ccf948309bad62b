"""Transparent streaming reverse proxy that records per-request token timing, never text.

Every request (any method, any path) is forwarded to the upstream and every response byte is
written to the client as it arrives, unchanged and unbuffered: from the upstream socket's own
callback (`forward.py`), with no task woken per chunk. On the side, the bytes of
generation endpoints go through the stream parser to timestamp token-bearing chunks. Recording
is fail-open: an exception in parsing or in the recorder marks the request's record broken and
the bytes keep flowing. A client that disconnects ends the proxy's side of the upstream connection,
which is how llama.cpp, vLLM and SGLang learn to stop generating; what the server still sends until it
closes (at most DRAIN_S) is counted for the request, not forwarded.

Only origin-form targets (`/path?query`) are forwarded: an absolute-form target
(`GET http://host/x`), CONNECT or `*` gets a 400, so the proxy is never an open forward proxy.
A request body that goes silent for `body_timeout_s`, or arrives slower on average than
`body_min_bytes_per_s` once that grace has passed, gets a 408 (its upstream connection closed).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import secrets
import time
import zlib
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from powerprof.arrival import SAME_DELIVERY_NS, HeldCall
from powerprof.errtext import error_text
from powerprof.workload.limits import MAX_COUNT
from powerprof.workload.stream import json_from_bytes

from . import streams
from .forward import Exchange, StaleConnection, UpstreamClosed, UpstreamError, UpstreamPool
from .scrape import LLAMACPP_LOADING
from .promptlen import empty_prompts, prompt_count, prompt_shape, stateful_turn, tools_if_none, uncarried_chars

log = logging.getLogger("powerprof.daemon.proxy")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Trailers", "Transfer-Encoding", "Upgrade", "Proxy-Connection",
    )
)
# Request bodies up to this size are read whole, to learn `model` and `stream`; bigger ones are streamed.
INSPECT_MAX_BYTES = 1 << 20
# …and at most this much of them at once, all requests together: 400 connections each holding back the last bytes of
# a 1 MiB body took the daemon from 66 to 642 MB resident, past the unit's MemoryMax (512M). Past it a body is
# streamed on like a bigger one (its row's model and stream unknown, its error saying why).
INSPECT_BUDGET_BYTES = 32 << 20
# Past the inspect deadline a chunked body is read on while each next piece comes within this: requests (urllib3) sends
# its last chunk and the end marker apart, and a body whole 1-20 ms after the deadline streamed on unread.
BODY_GRACE_S = 0.05
# …for at most this long after the first piece past the deadline: a client sending a piece every 20 ms kept the read
# (and the bytes it holds of the budget) going past the deadline until 1 MiB, the server not seeing the request.
BODY_GRACE_LIMIT_S = 0.5
# Non-streamed responses are copied (for their usage block) up to this size; only counts are kept.
BODY_COPY_MAX_BYTES = 4 << 20
# A gzip/deflate response is inflated on the side for its counts (the client gets the bytes as sent), at
# most this much in all: a longer one is counted up to there, and its row says so.
INFLATE_MAX_BYTES = 64 << 20
# A 400's body is kept up to this size for its message (`error_message`): the ledger tells SGLang's band abort, which
# may leave a batch running for nobody, from a refusal that ran nothing by it (Ledger._batch_run_on); a longer body's
# message is not read.
ERROR_BODY_MAX_BYTES = 16 << 10
ERROR_MESSAGE_MAX_CHARS = 300
TAG_MAX_CHARS = 128
# A request's or response's `model` (and a response's stop reason) kept in its row: a client picks the request's, up to the
# 1 MiB body, and a row of that size, buffered per request, could exhaust the daemon's memory within one flush interval.
MODEL_MAX_CHARS = 256
# A client gone mid-stream: what the upstream still sends before it notices (our side of its connection ended) is
# read and counted for the request, for at most this long; then the connection is closed.
DRAIN_S = 2.0
# aiohttp's server options for the proxy's listener: request bodies pass as the client encoded them
# (aiohttp would otherwise decompress a `Content-Encoding: gzip` body and the upstream would get
# plain bytes still labelled gzip).
SERVER_OPTIONS = {"auto_decompress": False}


# The fix a row whose request body the proxy failed on (outcome proxy_error) gives: the fault is the proxy's, not the
# client's nor the server's.
PROXY_FAULT_FIX = ("fix: a powerprof bug; the client may resend the request; report it with the daemon log's first "
                   "\"the proxy failed reading a request body\" line and its traceback")

# The key in a RequestTrace's `extra` of a request the proxy answered before forwarding it (a 408 for its body, its
# client gone mid-body, the proxy's own fault reading it): on_start never came for it, and the ledger writes its row at
# its end with no energy (the server never saw it). Set at arrival, taken off just before on_start.
NOT_FORWARDED = "not_forwarded"
NOT_FORWARDED_NOTE = "not forwarded: the server never saw this request, so it has no energy figure"

# The `error` of a request whose client left while sending its body: the server never had the whole request, so never
# ran it (the ledger costs it no prefill and flags no request beside it: `liverequest.gone_unsaid`).
BODY_LEFT_NOTE = "the client left while sending its request body"
# The start of the error of a request whose upstream closed its connection with no answer after it went out, its
# outcome upstream_error: a crash (the server ran it until then) or a router in front of it refusing it (never run); the
# ledger costs it only where it saw the server die then (liverequest.crashed, Ledger._crash_seen).
# In such an error: the request was sent again (a kept-alive close within forward.STALE_CLOSE_MAX_S) on a new
# connection, which was refused: nothing listened, so the close was the server dying with it, not a close that crossed
# it (a refused connect, a proof of the death for the ledger: `Ledger._death_shown`).
RESEND_REFUSED = "sending it again was refused"
# Or the resend was answered by llama-server's loading page (503 "Loading model", scrape.LLAMACPP_LOADING): a new
# process bound the port, so the close was the old one's end; read as the server down, as the scraper reads that page
# (no proof of a death alone: the ledger's restart rules decide its cost). Relayed, it was the request's answer: 0 J.
RESEND_LOADING = "sending it again met llama-server's loading page"
# The largest 503 body read for that page on a resend (llama-server's is 77 bytes); a larger one is relayed unread.
LOADING_BODY_MAX = 4096
CRASHED_NOTE = "the upstream closed its connection with no answer after the request went out (a crash, or a refusal?)"
# Refused connects kept between two scrapes (a retry herd against a dead server refuses thousands): the first half and
# the latest half are kept (`Proxy.take_refusals`). The scraper finds the server down at the first it counts (the
# window's refused down the ledger records as a death), which need not be the very first (`Scraper._proxy_refused`
# leaves out those before the last believed page's GET).
REFUSALS_KEPT = 64


def bound_refusals(times: list[int]) -> None:
    """Refused connects' times (oldest first) cut in place to REFUSALS_KEPT: the first half and the latest half."""
    if len(times) > REFUSALS_KEPT:
        del times[REFUSALS_KEPT // 2:-(REFUSALS_KEPT // 2)]


@dataclass
class RequestTrace:
    """What the proxy learns about one request. Monotonic ns for arithmetic, wall ns for storage: the
    wall clock is read once, at arrival; later wall times are that plus the monotonic time since, so
    arrival ≤ first ≤ last ≤ end holds in both clocks (no wall clock read per token chunk)."""

    request_id: int
    method: str
    endpoint: str
    tag: str | None
    arrival_ns: int
    arrival_wall_ns: int
    api: str | None = None
    model: str | None = None
    stream: bool | None = None
    status: int | None = None
    first_ns: int | None = None
    first_wall_ns: int | None = None
    last_ns: int | None = None
    last_wall_ns: int | None = None  # set at the end, from last_ns
    end_ns: int | None = None
    end_wall_ns: int | None = None
    tokens_seen: int = 0
    counts: streams.Counts | None = None
    outcome: str = "ok"
    error: str | None = None
    response_bytes: int = 0
    recorder_error: str | None = None
    extra: dict = field(default_factory=dict)


class Recorder(Protocol):
    def on_start(self, trace: RequestTrace) -> None: ...
    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None: ...
    def on_end(self, trace: RequestTrace) -> None: ...


class NullRecorder:
    def on_start(self, trace: RequestTrace) -> None:
        pass

    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None:
        pass

    def on_end(self, trace: RequestTrace) -> None:
        pass


def valid_text(s: str) -> str:
    """`s` as valid Unicode: aiohttp hands header bytes that are not UTF-8 over as lone surrogates (and JSON's
    `\\udc80` escapes make them too), which no UTF-8 writer takes: a tag of them broke `/metrics` for the
    daemon's life and sent the request's row to quarantine. Each such character becomes U+FFFD (visibly
    replaced, never dropped)."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in s)


def bounded_text(s: str | None, limit: int = MODEL_MAX_CHARS) -> str | None:
    """`s`, or its first `limit` characters visibly cut: "…" and the length it had (never silently shortened)."""
    if s is None or len(s) <= limit:
        return s
    return f"{s[:limit]}… ({len(s)} characters)"


def forward_headers(headers, drop=frozenset()) -> list[tuple[str, str]]:
    """Headers minus hop-by-hop ones (and those the Connection header names), as (name, value) pairs;
    `drop`: more names, lower case."""
    skip = HOP_BY_HOP | drop if drop else HOP_BY_HOP
    if "Connection" in headers:
        skip = skip | {h.strip().lower() for v in headers.getall("Connection") for h in v.split(",")}
    return [(k, v) for k, v in headers.items() if k.lower() not in skip]


_REQUEST_SKIP = frozenset(h.encode() for h in HOP_BY_HOP | {"host", "content-length"})
_CONTENT_LENGTH = frozenset(("content-length",))


@web.middleware
async def origin_form_only(request: web.Request, handler):
    """400 for absolute-form, authority-form (CONNECT) and `*` targets, before routing: we forward to one
    upstream only, never to a host a client names."""
    if request.method == "CONNECT" or not request.raw_path.startswith("/"):
        body = json.dumps({"error": {"message": "powerprof proxy: only origin-form request targets (/path) are "
                                      "accepted", "type": "bad_request", "code": 400}}).encode()
        return web.Response(status=400, body=body, content_type="application/json")
    return await handler(request)


class BodyTooSlow(Exception):
    """A streamed request body arrived slower on average than the proxy's minimum rate."""


class _BodyReader:
    """A streamed request body, a chunk at a time; a silence of `timeout_s` ends it with a TimeoutError, and not
    having `min_bytes_per_s` × (elapsed − `timeout_s`) bytes by then with BodyTooSlow (0: no rate).

    The silence rule alone let a body trickled a byte every timeout_s − 1 hold its upstream connection for
    ever. A rate, not a total deadline: a large body on a slow link still arrives, however long it takes,
    while holding a connection costs a client bytes in proportion to the time (mod_reqtimeout's MinRate)."""

    def __init__(self, content, timeout_s: float, min_bytes_per_s: float = 0.0):
        self.content, self.timeout_s, self.min_bytes_per_s = content, timeout_s, min_bytes_per_s
        self.start = time.monotonic()
        self.got = 0
        self._silent_since: float | None = None  # a wait cut short by `until` goes on from here, not afresh

    async def read(self, until: float | None = None, limit: int = -1) -> bytes | None:
        """The next chunk (at most `limit` bytes where > 0), b"" at the body's end; None if the monotonic time `until`
        comes first (the body read on later with a later read, its silence counted from before). A deadline checked
        only as chunks came let a client send one just before it, then nothing, and hold what it was read under for
        ~2 x timeout_s."""
        now = time.monotonic()
        if self._silent_since is None:
            self._silent_since = now
        wait, rule = self._silent_since + self.timeout_s - now, "silent"
        if self.min_bytes_per_s > 0:
            left = self.start + self.timeout_s + self.got / self.min_bytes_per_s - now
            if left <= 0:
                raise BodyTooSlow()
            if left < wait:
                wait, rule = left, "slow"
        if until is not None and until - now < wait:
            if until <= now:
                return None
            wait, rule = until - now, "until"
        if wait <= 0:
            # The silence ran out while nobody read (the proxy waiting on an upstream connection after the deadline):
            # what the client sent meanwhile is read, only none at all is a silence.
            chunk = self.content.read_nowait(limit)
            if not chunk and not self.content.at_eof():
                raise asyncio.TimeoutError()
            self._silent_since = None
            self.got += len(chunk)
            return chunk
        try:
            chunk = await asyncio.wait_for(self.content.read(limit) if limit > 0 else self.content.readany(), wait)
        except asyncio.TimeoutError:
            if rule == "until":
                return None
            if rule == "slow":
                raise BodyTooSlow() from None
            raise
        self._silent_since = None
        self.got += len(chunk)
        return chunk


def _taken_bytes(content) -> int | None:
    """Bytes a request's stream has handed out so far (those fed less those still buffered), or None where aiohttp no
    longer keeps its buffered count under that name: whether a failed read took any."""
    size = getattr(content, "_size", None)
    return content.total_bytes - size if isinstance(size, int) else None


class _PlainReader:
    """A streamed body read on after _BodyReader raised what it should not (a bug): a chunk at a time, a silence of
    `timeout_s` a TimeoutError, no rate rule (the less code here, the less to fail again)."""

    def __init__(self, content, timeout_s: float):
        self.content, self.timeout_s = content, timeout_s

    async def read(self, until: float | None = None, limit: int = -1) -> bytes:
        return await asyncio.wait_for(self.content.readany(), self.timeout_s)


def request_head(method: str, target: str, host: str, raw_headers, framing: bytes = b"", connection=()) -> bytes:
    """An HTTP/1.1 request head: the client's header lines as it sent them (aiohttp's `raw_headers`, bytes,
    names in the client's case) minus hop-by-hop ones, Host and Content-Length (and those the Connection
    header names: `connection`, its values), then `framing` (the body's framing header line, CRLF-ended)."""
    skip = _REQUEST_SKIP
    if connection:
        skip = skip | {h.strip().lower().encode("utf-8", "surrogateescape") for v in connection for h in v.split(",")}
    parts = [f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n".encode("utf-8", "surrogateescape")]
    for name, value in raw_headers:
        if name.lower() not in skip:
            parts += (name, b": ", value, b"\r\n")
    parts += (framing, b"\r\n")
    return b"".join(parts)


# pydantic's str -> int (lax): Rust's whitespace trimmed (not Python's: \x1c-\x1f are not), a sign, ASCII digits with
# single underscores between them, and a fraction of zeros alone ("1.0", "1_000.00"); 20 characters at most read here.
_COUNT_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_COUNT_TEXT = re.compile(r"([+-]?[0-9]+(?:_[0-9]+)*)(?:\.0+)?")
COUNT_TEXT_MAX_CHARS = 20


def whole_count(v) -> int | None:
    """A JSON count as vLLM's and SGLang's OpenAI endpoints read it (pydantic, lax): an int, a bool (0 or 1), a float
    with no fraction (1.0), or a string of digits as pydantic takes it (" 1", "+1", "1_000", "1.0"; at most
    COUNT_TEXT_MAX_CHARS); None for anything else (1.5, "x", "1e3"), which the proxy leaves unread as before
    (llama-server takes 1.0, and ignores "1" for its default: a limit read where it set none only matters at that
    count). Taking an int alone, a max_tokens of 1.0 or "1" went unread (its answer's one token in no count: -99%);
    taking ASCII digits alone, " 1", "+1", "1_000", "1.0" and true still did."""
    if type(v) is int:
        return v
    if type(v) is bool:
        return int(v)
    if type(v) is float and v.is_integer() and abs(v) <= MAX_COUNT:
        return int(v)
    if type(v) is str and len(v) <= COUNT_TEXT_MAX_CHARS:
        m = _COUNT_TEXT.fullmatch(v.strip(_COUNT_WS))
        return int(m.group(1)) if m else None
    return None


# pydantic's lax booleans (vLLM's `stream`: "false" is false; bool("false") took it for a stream).
_TRUE_TEXT = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE_TEXT = frozenset(("0", "off", "f", "false", "n", "no"))


def lax_bool(v) -> bool | None:
    """A JSON flag as the server reads it (pydantic, lax): a bool, 0 or 1, 0.0 or 1.0, or one of pydantic's words (any
    case, no spaces); None otherwise."""
    if type(v) is bool:
        return v
    if type(v) in (int, float) and v in (0, 1):
        return bool(v)
    if type(v) is str and len(v) <= 5:
        w = v.lower()
        return True if w in _TRUE_TEXT else False if w in _FALSE_TEXT else None
    return None


# More sequences than any server batches (vLLM's max_num_seqs is 256-1024, llama.cpp's tasks are its slots): an `n`
# beyond is no count (a 400-digit one overflowed the ledger's float arrays and failed every accounting step after).
MAX_SEQUENCES = 4096


def _llamacpp_int(v) -> int | None:
    """A JSON int as llama-server's json_value reads one (nlohmann's get<int>): a number (a float truncated) or a bool;
    None where absent or of another type (a string: the server logs it and takes its default)."""
    if type(v) in (int, bool):
        return int(v)
    if type(v) is float and abs(v) <= MAX_COUNT:
        return int(v)
    return None


def request_choices(doc: dict, api: str | None) -> int:
    """The `n` choices a request asks for each of its prompts (chat, completions, llama.cpp's native `n_cmpl`; 1 where `n` is not a positive
    whole number, `whole_count`, or is over MAX_SEQUENCES: the server refuses such a request). The ledger needs it apart from the
    sequences: vLLM says a prompt once for its n choices, llama.cpp once per choice."""
    n = whole_count(doc.get("n")) if api in ("openai-chat", "openai-completions") else None
    if api == "llamacpp":
        # llama-server's native /completion runs a task per choice too (server-task.cpp params_from_json_cmpl:
        # `n_cmpl`, else `n`; handle_completions_impl: n_cmpl - 1 child tasks per prompt). Unread, n = 2 counted
        # half the work, unflagged (real b11434: 24 generated of 48, J/token doubled).
        n = _llamacpp_int(doc.get("n_cmpl"))
        n = n if n is not None else _llamacpp_int(doc.get("n"))
    if api == "sglang-generate":
        # SGLang's sampling_params: one dict, or one per prompt, each with the same `n` (its parallel_sample_num).
        sp = doc.get("sampling_params")
        sp = sp[0] if isinstance(sp, list) and sp else sp
        # A plain dict to SGLang, not pydantic: an int alone (a "2" or 2.0 fails its comparisons, the request refused).
        n = sp.get("n") if isinstance(sp, dict) and type(sp.get("n")) is int else None
    return n if n is not None and 1 < n <= MAX_SEQUENCES else 1


def llamacpp_choices(doc: dict, api: str | None) -> int | None:
    """The choices llama-server runs for each prompt of an OpenAI-route request whose `n_cmpl` says other than the `n`
    vLLM and SGLang run (they ignore `n_cmpl`; llama-server reads it over `n` on every completion route: server-task.cpp
    params_from_json_cmpl, measured on b11434); None where both run the same, or llama-server refuses it (not a number:
    400). Which server ran which is settled by the answer (`settle_n_cmpl`): the proxy does not know its upstream.
    /v1/responses too (llama-server converts it to a chat): `n_cmpl`, else `n`, each task its own Response (the others
    have no `n` there: one); /v1/messages reads neither (measured)."""
    key = "n_cmpl" if doc.get("n_cmpl") is not None or api != "openai-responses" else "n"
    if api not in ("openai-chat", "openai-completions", "openai-responses") or doc.get(key) is None:
        return None
    v = _llamacpp_int(doc[key])
    return v if v is not None and 1 <= v <= MAX_SEQUENCES and v != request_choices(doc, api) else None


def settle_n_cmpl(extra: dict, choice_stops: dict, whole: bool) -> bool | None:
    """Which of a request's two readings of its choices the server ran (`llamacpp_choices`' `n_cmpl`, in `extra`, beside
    the `n` in its `choices`), by the choices its answer showed (`choice_stops`: each finished one's index; `whole`: the
    answer ended as its server ends one, a whole body or a stream's `[DONE]`). True: more than `n` a prompt shown, or a
    whole answer of `n_cmpl` a prompt: llama-server's, and `extra`'s sequences, choices and empty tasks are made its.
    False: the other way round (vLLM, SGLang): `extra` kept. None: an answer cut before it showed either (kept as `n`,
    the caller says so). `n_cmpl` is taken out of `extra` whatever the answer."""
    v = extra.pop("n_cmpl", None)
    if v is None:
        return False
    n = max(extra.get("choices", 1), 1)
    live, empty = max(extra.get("sequences", 1), 1) // n, extra.get("empty_tasks", 0) // n  # prompts run, and empty
    shown = max((i for i in choice_stops if type(i) is int), default=-1) + 1
    if shown > (live + empty) * n or (whole and shown == (live + empty) * v):
        # Set even where 1: a worker's end record updates the daemon's copy, which holds its start's (n's) figures.
        extra["sequences"], extra["choices"] = live * v, v if live * v > 1 else 1
        if empty:
            extra["empty_tasks"] = empty * v
        return True
    if shown > (live + empty) * v or (whole and shown == (live + empty) * n):
        return False
    return None


def n_cmpl_unsettled(trace: RequestTrace, v: int, n: int) -> None:
    """An answer that ended before it showed whether its server ran `n_cmpl` (`settle_n_cmpl`: None, or never settled:
    a whole answer its client left, an upstream failure): kept as `n`, `n_cmpl` kept beside it as unsettled for its row
    (rowtext: a whole answer's tokens are unseen, its figure rests on its sequences: UNSURE_FLAG with both readings)."""
    trace.extra["n_cmpl_unsettled"] = v
    if trace.stream is True:
        # Its tokens are counted as shown, whichever ran: a stream cut 120 chunks in beside a long one read 397.7 J at
        # n 1 where the same at a known n 2 read 392.7 J (simulator). Not flagged; claiming "off by that ratio" was false.
        said = ("its stream ended before it showed which: its tokens are those its stream showed, whichever ran, and "
                f"only its place in the batch (the split of each step's energy with the requests beside it) is taken "
                f"at {n} sequence(s) a prompt")
    else:
        said = (f"its answer, a whole one, ended before it showed which: taken as {n} sequence(s) a prompt (its "
                "energy_note says both readings)")
    _add_error(trace, f"it asked n_cmpl {v} beside n {n}: llama-server runs {v} choices a prompt, vLLM and SGLang {n}, "
                      f"and {said}; fix: send llama-server's choices as `n` alone")


def request_sequences(doc: dict, api: str | None, prompts: int | None = None) -> int:
    """How many sequences a request runs side by side in the server's batch, each getting a token a step: its `n`
    choices (chat, completions), each of its prompts (a completions prompt list: vLLM, SGLang and llama.cpp run each
    prompt as a request of its own). A list holding a token id at its top is one prompt (ids, or llama.cpp's ids
    and text mixed); a list of strings or of id lists is that many. Anything that is not a positive integer `n` is
    one choice (as is one over MAX_SEQUENCES): the server refuses such a request, and no guess multiplies its steps.
    `best_of` is not counted: its extra sequences' tokens never reach the client (vLLM V0 returns `n` of them), so
    they are not in the tokens the ledger divides (`request_best_of` marks such a request)."""
    seqs = request_choices(doc, api)
    k = prompt_count(doc, api) if prompts is None else prompts  # `prompts`: the caller's count of the same body
    # SGLang's batch over MAX_SEQUENCES is refused: no guess multiplies its steps.
    if k > 1 and (api != "sglang-generate" or k * seqs <= MAX_SEQUENCES):
        seqs *= k
    return seqs


# SGLang's grammar keys (its OpenAI routes' body and /generate's sampling_params): a grammar ends an answer when it is
# met, whatever ignore_eos (Req.check_finished checks grammar.is_terminated() first; min_new_tokens' penalizer blocks
# only EOS and stop token ids).
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def _grammar_set(sp: dict, api: str | None) -> bool:
    """Whether SGLang runs this body's answer under a grammar: a grammar key, a response_format other than text
    (json_schema, json_object, structural_tag), or tools its tool_choice requires (required, or a named function:
    SGLang constrains the call to their schema)."""
    if any(sp.get(k) not in (None, "", [], {}) for k in GRAMMAR_KEYS):
        return True
    if api == "sglang-generate":
        return False
    rf = sp.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        return True
    choice = sp.get("tool_choice")
    return bool(sp.get("tools")) and (choice == "required" or isinstance(choice, dict))


def _own_end_terms_one(sp: dict, api: str | None) -> tuple[bool, int | None]:
    """own_end_terms for one set of sampling terms (an OpenAI body, or one of /generate's sampling_params)."""
    stops = any(sp.get(k) not in (None, "", [], {}) for k in ("stop", "stop_regex"))
    grammar = _grammar_set(sp, api)
    least = whole_count(sp.get("min_new_tokens" if api == "sglang-generate" else "min_tokens"))
    # pydantic's lax boolean on its OpenAI endpoints; a plain dict's value on /generate (True alone taken: never guessed).
    ignored = sp.get("ignore_eos") is True if api == "sglang-generate" else lax_bool(sp.get("ignore_eos")) is True
    # stop_token_ids SGLang ignores under ignore_eos, but taken as an end anyway (an over-flag at most); min_tokens
    # blocks EOS and stop token ids alone: a stop string, a stop regex or a grammar still ends it inside them.
    sure = ignored and not (stops or grammar or sp.get("stop_token_ids") not in (None, "", [], {}))
    least = least if least is not None and least > 0 and not (stops or grammar) else None
    return sure, least


def own_end_terms(doc: dict, api: str | None) -> tuple[bool, int | None]:
    """(whether its answer cannot end by itself before its length limit, its minimum tokens) as SGLang reads its body:
    `ignore_eos` true with no stop string, stop token, stop regex or grammar (those still end it), and `min_tokens` (its
    native /generate's sampling_params `min_new_tokens`) where no stop string, stop regex or grammar can end it inside
    them. /generate's list of sampling_params (one a prompt): sure only where every one is, its least min_tokens. Its
    Responses and Anthropic routes take neither field (SGLang's ResponsesRequest has none): never sure. A run-on past its
    client's leaving ends at the abort only where its answer cannot end by itself first (`Ledger._place_run_on`)."""
    if api in ("openai-responses", "anthropic-messages"):
        return False, None
    sp = doc.get("sampling_params") if api == "sglang-generate" else doc
    sps = sp if isinstance(sp, list) and api == "sglang-generate" else [sp]
    if not sps or not all(isinstance(x, dict) for x in sps):
        return False, None
    terms = [_own_end_terms_one(x, api) for x in sps]
    leasts = [t[1] for t in terms]
    return all(t[0] for t in terms), min(leasts) if None not in leasts else None


def request_best_of(doc: dict, api: str | None) -> int | None:
    """The sequences a request asks the server to run for each prompt where more than the `n` it returns (vLLM V0's
    `best_of`; V1 refuses it, llama.cpp and SGLang take none): their extra tokens never reach the proxy; None
    otherwise (an invalid one the server refuses)."""
    if api not in ("openai-chat", "openai-completions"):
        return None
    b = whole_count(doc.get("best_of"))
    return b if b is not None and request_choices(doc, api) < b <= MAX_SEQUENCES else None


def _held_call(trace, end_ns: int) -> HeldCall | None:
    """What arrival.held_call_at_limit needs of a request that carried tools (None: it carried none, so no parser
    held any of its tokens); `end_ns`: when the upstream's last piece of it came."""
    if not trace.extra.get("tools"):
        return None
    seqs = max(trace.extra.get("sequences", 1), 1)
    steps = trace.tokens_seen / seqs
    first, last = trace.first_ns, trace.last_ns
    if last is None or steps <= 0:
        return HeldCall(trace.extra.get("max_tokens"), seqs, None, 0)  # no chunk counted: no pace to check
    step = (last - first) / (steps - 1) if last > first and steps > 1 else 0.0
    if trace.extra.get("deliveries", 1) <= 1 or step < SAME_DELIVERY_NS:
        # Its chunks came as one delivery, or under SAME_DELIVERY_NS a step apart: one burst (a loaded host reads a few
        # at once, or one write split over reads µs apart), whose span is the reads' and not the server's pace: a µs
        # "pace" let a 5 ms pause explain hundreds of tokens. From its arrival instead, its prefill in, a pace no
        # faster than its own.
        step = (last - trace.arrival_ns) / steps
    return HeldCall(trace.extra.get("max_tokens"), seqs, step, end_ns - last)


def _held_end(trace, sink) -> None:
    """What a stream's end tells the ledger beyond its counts. Its end, for the placing of the tokens its count has past
    its chunks (Ledger._placed_at_end: a held call's, a self-closing call's trailing tokens, SGLang's end-of-text
    token): the upstream's last piece, where the server finished it; trace.end_ns waits on the client's last write,
    so a slow reader put those tokens (and the server counter's match of them) after the server's finish."""
    if trace.counts is not None:
        trace.extra["held_end_ns"] = sink.upstream_end_ns
    if sink.parser is not None and sink.parser.tool_call_jumps:
        # Its bursts at such chunks are the server's parser's hold, not a hop's (the ledger's burst note).
        trace.extra["tool_call_jumps"] = sink.parser.tool_call_jumps


def chat_echo_chars(doc: dict) -> int:
    """The characters vLLM's chat `echo` sends back in a chunk of its own: the last message's content, where that
    message's role is the answer's (the assistant's, or with `add_generation_prompt: false` the last message's own:
    serving_chat's get_chat_request_role); 0 where it sends none (a list of content parts is joined as its template
    input is: their text)."""
    msgs = doc.get("messages")
    last = msgs[-1] if isinstance(msgs, list) and msgs else None
    if not isinstance(last, dict):
        return 0
    if doc.get("add_generation_prompt", True) is not False and last.get("role") != "assistant":
        return 0
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return len(content) if isinstance(content, str) else 0


def inspect_request_body(body: bytes, encoding: str = "", api: str | None = None,
                         extra: dict | None = None) -> tuple[str | None, bool | None]:
    """(model, stream) from a JSON request body; of the prompt only its size is taken (into `extra`:
    prompt_chars or prompt_ids, for a prompt the server never counts, `promptlen`; or prompt_unsized, the part of the
    body that gives none), and the sequences it runs
    side by side where more than one (`sequences`: `request_sequences`), and `echo` where a completion echoes its
    prompt. A gzip or
    deflate body (`encoding`: its Content-Encoding) is inflated on the side, at most INSPECT_MAX_BYTES: the
    upstream still gets the client's bytes, and a body that inflates beyond (a bomb) is not inspected."""
    encoding = encoding.strip().lower()
    if encoding in ("gzip", "x-gzip", "deflate"):
        d = zlib.decompressobj(47)  # 32 + 15: a zlib or gzip header, detected
        try:
            body = d.decompress(body, INSPECT_MAX_BYTES)
        except zlib.error:
            return None, None
        if d.unconsumed_tail or not d.eof:
            return None, None
    elif encoding not in ("", "identity"):
        return None, None
    try:
        doc = json_from_bytes(body)
    except (ValueError, UnicodeDecodeError):
        return None, None
    if not isinstance(doc, dict):
        return None, None
    model = doc.get("model")
    stream = doc.get("stream")
    if extra is not None and api is not None:
        chars, ids, unsized, prompts = prompt_shape(doc, api)  # one pass: a 1 MiB batch body's 262k prompts
        if chars is not None:
            extra["prompt_chars"] = chars
        if ids is not None:
            extra["prompt_ids"] = ids
        if unsized is not None:
            extra["prompt_unsized"] = unsized  # read, but no size in it: said on its row if the server never says one
        if unsized is None and prompts > 1:
            extra["prompt_count"] = prompts  # a batch's: each its template's tokens (`promptlen`)
        prev = stateful_turn(doc, api)
        if prev is not None:  # its stored conversation's length, where this proxy saw it: Ledger.response_context
            extra["prev_response_id"], new_chars = prev
            if new_chars is not None:
                extra["prompt_new_chars"] = new_chars
        maybe = tools_if_none(doc, api)
        # Rendered or not as the server's (Ledger.tools_when_none); a stateful turn's are in its prompt_new_chars.
        if maybe is not None and ("prompt_chars" in extra or "prompt_new_chars" in extra):
            extra["prompt_tools_none_chars"] = maybe
        gone = uncarried_chars(doc, api)
        if gone is not None:  # not in what a later turn naming this one prefills: Ledger._keep_context leaves it out
            extra["prompt_uncarried_chars"] = gone
        seqs = request_sequences(doc, api, prompts)
        empty = empty_prompts(doc, api)
        if empty:
            # Answered as tasks (their results and indexes: the parser's `sequences` counts them) but not run: never in
            # `sequences`, the ledger's sequences in the batch (before: [[], [1, 2]] was two, unsized).
            extra["empty_tasks"] = empty * request_choices(doc, api)
        if seqs > 1:
            extra["sequences"] = seqs
            n = request_choices(doc, api)
            if n > 1:
                extra["choices"] = n
        pinned = doc.get("id_slot")
        if type(pinned) is int and 0 <= pinned <= MAX_SEQUENCES:
            extra["id_slot"] = pinned  # llama-server defers it while that slot is busy (Ledger._slots_needed)
        if api == "llamacpp":
            # llama-server's rule for its native /completion (`n_predict`, else `max_tokens`): -1, its default, is none.
            # Unread, a whole answer whose client left there was not run on to its end (Ledger._run_on).
            limit = whole_count(doc.get("n_predict") if doc.get("n_predict") is not None else doc.get("max_tokens"))
            if limit is not None and 0 < limit <= MAX_COUNT:
                extra["max_tokens"] = limit  # a count at the limit is whole (arrival.at_limit)
        if api == "sglang-generate":
            # SGLang's sampling_params max_new_tokens, one for all or one a prompt: their most, where each says one
            # (none: SGLang's default, 128, or to the context's end where null; not guessed as a count). Unread, a batch it answered 400 while
            # running the rest on was marked to no end (Ledger._batch_run_on).
            sp = doc.get("sampling_params")
            sps = sp if isinstance(sp, list) else [sp]
            limits = [whole_count(x.get("max_new_tokens")) if isinstance(x, dict) else None for x in sps]
            if limits and None not in limits and 0 < max(limits) <= MAX_COUNT:
                extra["max_tokens"] = max(limits)  # a count at the limit is whole (arrival.at_limit)
            # An explicit null runs to the context's end; a key left out is SGLang's default (SamplingParams, 128).
            if any(isinstance(x, dict) and "max_new_tokens" in x and x["max_new_tokens"] is None for x in sps):
                extra["max_tokens_null"] = True
        if api in ("openai-chat", "openai-completions"):
            # vLLM's rule (`max_completion_tokens or max_tokens`): a null or 0 max_completion_tokens leaves max_tokens.
            limit = whole_count(doc.get("max_completion_tokens"))
            if not limit:
                limit = whole_count(doc.get("max_tokens"))
            if limit is not None and 0 < limit <= MAX_COUNT:
                extra["max_tokens"] = limit  # a count at the limit is whole (arrival.at_limit)
            tools = doc.get("tools")
            # Chat alone: no server runs a tool-call parser on completions (vLLM and SGLang ignore `tools` there), so
            # nothing there is held, and a count past the running counts must not be believed as a held call.
            if api == "openai-chat" and isinstance(tools, list) and tools and doc.get("tool_choice") != "none":
                extra["tools"] = True  # its tool-call parser may hold tokens in no chunk (arrival.held_call_at_limit)
        eos_ignored, least = own_end_terms(doc, api)
        if eos_ignored:
            extra["eos_ignored"] = True  # its run-on after its client left cannot end by itself (Ledger._place_run_on)
        if least is not None:
            extra["min_tokens"] = least
        ncmpl = llamacpp_choices(doc, api)
        if ncmpl is not None:
            extra["n_cmpl"] = ncmpl  # which the server ran, this or `choices`, its answer shows (settle_n_cmpl)
        best_of = request_best_of(doc, api)
        if best_of is not None:
            extra["best_of"] = best_of  # its row says its energy leaves out the sequences not returned
        if api == "openai-completions" and doc.get("echo") is True:
            extra["echo"] = True  # its stream's first chunks carry the prompt (StreamParser's echo)
        elif api == "openai-chat" and doc.get("echo") is True:
            n = chat_echo_chars(doc)
            if n:
                extra["echo_chars"] = n
    return (model if isinstance(model, str) else None), lax_bool(stream)


def via_name(loop_id: str) -> str:
    """The name a daemon's proxy says in its Via line (and its scraper in its own): `powerprof-<loop_id>`."""
    return f"powerprof-{loop_id}"


# The comment the daemon's scrapes add to their Via line (`1.1 powerprof-<id> (scrape)`): a scrape that comes round is
# scrape.url's doing (or proxy.upstream's, where scrape.url is unset), and the 508's log says so.
SCRAPE_VIA_COMMENT = "(scrape)"


def scrape_via_name(loop_id: str) -> str:
    """What the daemon's scrape session says after `1.1` in its Via line."""
    return f"{via_name(loop_id)} {SCRAPE_VIA_COMMENT}"


class Proxy:
    """The aiohttp application. `Proxy(upstream_url, recorder).app()`; the upstream pool opens on startup."""

    def __init__(
        self,
        upstream: str,
        recorder: Recorder | None = None,
        tag_header: str = "X-Powerprof-Tag",
        read_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 1024,
        body_timeout_s: float = 60.0,
        body_min_bytes_per_s: float = 1024.0,  # as proxy.body_min_bytes_per_s
        loop_id: str | None = None,  # the daemon's, shared by its proxy workers; default: this proxy's own
    ):
        self.upstream = upstream.rstrip("/")
        # Said in a Via line on every request sent upstream; a request that comes back with it went round (an upstream
        # that reaches the proxy itself: its own name, a port forward) and is answered 508, never sent again.
        self.via_name = via_name(loop_id or secrets.token_hex(8))
        self.loops_refused = 0
        self.recorder = recorder or NullRecorder()
        self.tag_header = tag_header
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections  # 0: unlimited
        self.body_timeout_s = body_timeout_s
        self.body_min_bytes_per_s = body_min_bytes_per_s
        self.body_timeouts = {"silent": 0, "slow": 0}  # request bodies answered 408, by which rule
        self.pool: UpstreamPool | None = None
        self._next_id = 0
        self.recorder_failures = 0
        self.upstream_failures = 0
        # When (time.monotonic_ns()) connects to the upstream were refused since the last `take_refusals`: nothing
        # listening, the server down; the scraper of the same server takes them as its own refused scrape's proof.
        self._refused_ns: list[int] = []
        self.upstream_retries = 0  # requests sent again: their kept-alive connection had been closed (StaleConnection)
        self.upstream_excess = 0  # responses that sent bytes past their Content-Length (dropped, logged)
        self.active = 0
        self._inspecting = 0  # bytes of request bodies being read whole (INSPECT_BUDGET_BYTES)
        self.uninspected_bodies = 0  # bodies up to INSPECT_MAX_BYTES streamed on uninspected, over that budget
        self.proxy_failures = 0  # the proxy's own faults reading a request body (a bug): streamed on, or a 500 row
        self.unforwarded = 0  # requests in progress not yet forwarded (NOT_FORWARDED): a worker's heartbeat says them
        self.closing = False

    def _note_refused(self, t_ns: int) -> None:
        """A connect to the upstream was refused at `t_ns`; kept until taken (past REFUSALS_KEPT, those between the
        first half and the latest half are let go: keeping only the very first, one the scraper left out took the
        herd's first with it)."""
        self._refused_ns.append(t_ns)
        bound_refusals(self._refused_ns)

    def take_refusals(self) -> list[int]:
        """The times of the refused connects since the last call (time.monotonic_ns(), oldest first), then forgotten:
        the daemon hands them to the scraper of the same server (`Scraper.refusals`)."""
        out, self._refused_ns = self._refused_ns, []
        return out

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 40, middlewares=[origin_form_only])
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open)
        app.on_shutdown.append(self._closing)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        # Bytes pass unchanged (no decompression, no added headers but Via); compressed bodies are simply not parsed.
        self.pool = UpstreamPool(self.upstream, self.connect_timeout_s, self.read_timeout_s, self.max_connections)

    async def _closing(self, _app) -> None:
        self.closing = True  # requests cut from here on were interrupted by us, not by the client

    async def _close(self, _app) -> None:
        if self.pool is not None:
            self.pool.close()

    # --- fail-open recording -----------------------------------------------------------------

    def _safe(self, trace: RequestTrace | None, fn, *args) -> None:
        if trace is None or trace.recorder_error is not None:
            return
        try:
            fn(trace, *args)
        except Exception as e:  # recording must never touch the traffic
            self._recording_failed(trace, e)

    def _recording_failed(self, trace: RequestTrace, e: Exception) -> None:
        trace.recorder_error = error_text(e)[:300]
        self.recorder_failures += 1
        if self.recorder_failures <= 5 or self.recorder_failures % 1000 == 0:
            log.warning("recording failed (traffic unaffected, %d so far): %s", self.recorder_failures, trace.recorder_error)

    # --- the handler -------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._came_round(request):
            return self._loop_refused(self._a_scrape(request))
        self._next_id += 1
        trace = None
        try:
            tag = request.headers.get(self.tag_header)
            trace = RequestTrace(
                request_id=self._next_id,
                method=request.method,
                endpoint=valid_text(request.path[:200]),
                tag=valid_text(tag[:TAG_MAX_CHARS]) if tag else None,
                arrival_ns=time.monotonic_ns(),
                arrival_wall_ns=time.time_ns(),
                api=streams.api_for_path(request.path),
            )
        except Exception as e:
            self.recorder_failures += 1
            log.warning("cannot trace request: %s", error_text(e))
        self.active += 1
        length = request.content_length
        # A chunked body (no Content-Length: what httpx, requests and aiohttp send for a generator) reserves the whole
        # bound, trimmed to its size once read (`_forward`): left unread, a 7501-token prompt's prefill was costed at 0.
        held = (0 if not request.body_exists else INSPECT_MAX_BYTES if length is None
                else length if length <= INSPECT_MAX_BYTES else 0)
        if held and self._inspecting + held > INSPECT_BUDGET_BYTES:
            self._over_budget(trace)
            held = 0
        self._inspecting += held
        budget = [held]  # given back by _forward once the answer's head is in (its body is never sent again)
        if trace is not None:
            trace.extra[NOT_FORWARDED] = True  # until on_start (`_forward`)
            self.unforwarded += 1
        try:
            return await self._forward(request, trace, budget)
        finally:
            self._inspecting -= budget[0]
            self.active -= 1
            if trace is not None and trace.extra.get(NOT_FORWARDED):
                self.unforwarded -= 1
                if trace.outcome == "ok":  # left by a cancellation (every other way out says its outcome)
                    trace.outcome = "interrupted" if self.closing else "client_disconnected"
                _add_error(trace, NOT_FORWARDED_NOTE)
            if trace is not None and "n_cmpl" in trace.extra and not trace.extra.get(NOT_FORWARDED) and (
                    trace.outcome in ("client_disconnected", "interrupted", "upstream_error")
                    or (trace.outcome == "ok" and (trace.status or 0) < 400)):
                # Forwarded, and its answer never settled it (a whole answer its client left, an upstream failure):
                # before, silent, costed as `n` (a whole /v1/completions of n_cmpl 2 its client left: 300 of 600 tokens).
                n_cmpl_unsettled(trace, trace.extra.pop("n_cmpl"), trace.extra.get("choices", 1))
            if trace is not None:
                if trace.end_ns is None:  # set already where its run ended before the proxy's answer (a resend's close)
                    trace.end_ns = time.monotonic_ns()
                wall_offset = trace.arrival_wall_ns - trace.arrival_ns
                trace.end_wall_ns = trace.end_ns + wall_offset
                if trace.last_ns is not None and trace.last_wall_ns is None:
                    trace.last_wall_ns = trace.last_ns + wall_offset
                if trace.counts is not None and trace.counts.invalid and trace.outcome == "ok":
                    # The server's own figures are out of range: the request is recorded as failed, with why.
                    trace.outcome, trace.error = "invalid_response", trace.counts.invalid[:300]
                if trace.counts is not None and trace.counts.unreadable:
                    _add_error(trace, unreadable_note(trace.counts))
                self._safe(trace, self.recorder.on_end)

    def _came_round(self, request: web.Request) -> bool:
        return any(self.via_name in v.replace(",", " ").split() for v in request.headers.getall("Via", ()))

    def _a_scrape(self, request: web.Request) -> bool:
        """Whether the Via entry of this daemon's that came back is its scraper's (SCRAPE_VIA_COMMENT)."""
        return any(entry.split()[1:3] == [self.via_name, SCRAPE_VIA_COMMENT]
                   for v in request.headers.getall("Via", ()) for entry in v.split(","))

    def _loop_refused(self, scrape: bool = False) -> web.Response:
        """508 for a request this proxy sent itself: no row (the request it came from has one, with this answer).
        `scrape`: the daemon's own scrape came round; its URL is the one to fix, not proxy.upstream."""
        self.loops_refused += 1
        key, fix = (("scrape.url", "the daemon's scrape URL (scrape.url, proxy.upstream's where unset)") if scrape
                    else ("proxy.upstream", f"proxy.upstream {self.upstream}"))
        if self.loops_refused <= 5 or self.loops_refused % 1000 == 0:
            log.error("a %s came back round to the proxy (%d so far): %s reaches the proxy itself; set %s to the "
                      "inference server's URL", "scrape" if scrape else "request", self.loops_refused, fix, key)
        body = json.dumps({"error": {"message": f"powerprof proxy: loop detected: {fix} reaches this proxy; set "
                                                f"{key} to the inference server's URL",
                                     "type": "loop_detected", "code": 508}}).encode()
        return web.Response(status=508, body=body, content_type="application/json")

    async def _forward(self, request: web.Request, trace: RequestTrace | None, budget: list[int]) -> web.StreamResponse:
        """`budget[0]`: the bytes of INSPECT_BUDGET_BYTES the caller reserved for reading the body whole (0: streamed
        on); given back here as soon as the answer's head is in, so a long answer holds none of it (70 streams of
        512 KiB prompts held the budget for their whole generation, and inspection stopped for everyone)."""
        assert self.pool is not None
        length = request.content_length
        body: bytes | None = None
        streamed = False
        chunks = None  # a chunked body's pieces still to stream on, past what was read of it (`prefix`)
        prefix = b""
        if budget[0] and length is None:
            # Chunked: read up to INSPECT_MAX_BYTES under the streamed body's own timers; one that ends by then is
            # inspected and sent on as one chunk (the server gets the same bytes, chunked as before), one longer streams
            # on from what was read.
            chunks = _BodyReader(request.content, self.body_timeout_s, self.body_min_bytes_per_s)
            parts, got = [], 0
            # As a Content-Length body's read (one body_timeout_s in all): a body trickled at the minimum rate held
            # its 1 MiB of the budget for ~18 min; past this it streams on from what was read, uninspected.
            until: float | None = time.monotonic() + self.body_timeout_s
            late = False  # past the deadline
            grace_end = 0.0  # the grace's end, once the first piece past the deadline is in
            try:
                while True:
                    # Each read capped by the bound (one byte past it tells a longer body) and by the budget left: a
                    # chunk read whole past the deadline took 32 clients to 36.88 MiB of 32. Neither left: streams on.
                    # That probe byte is allowed past the budget (1 byte a body at most): without it a 1 MiB body whose
                    # reservation filled the budget exactly could never see its end, and streamed on unread.
                    room = min(INSPECT_MAX_BYTES + 1 - got, max(INSPECT_BUDGET_BYTES - self._inspecting + budget[0] - got,
                                                                int(got == INSPECT_MAX_BYTES)))
                    if room <= 0:
                        self._over_budget(trace)
                        break
                    chunk = await chunks.read(until, room)
                    if chunk is None:
                        if late:
                            break  # a gap past the grace: streamed on from what was read
                        # Still arriving at the deadline: the reservation given back (the bytes read stay counted),
                        # and the next chunk awaited under the body's own timers before an upstream connection is
                        # taken. Streamed on at the deadline, a client silent from there held an upstream connection
                        # until its 408 (six such clients took six).
                        late = True
                        self._inspecting -= budget[0] - got
                        budget[0] = got
                        until = None
                        continue
                    if not chunk:
                        chunks = None  # its end came: whole
                        break
                    parts.append(chunk)
                    got += len(chunk)
                    if got > budget[0]:  # past the deadline: what is read, counted (room kept it within the budget)
                        self._inspecting += got - budget[0]
                        budget[0] = got
                    if got > INSPECT_MAX_BYTES:
                        break
                    if late:
                        if request.content.at_eof():
                            chunks = None  # its end came with it: whole
                            break
                        now = time.monotonic()
                        grace_end = grace_end or now + BODY_GRACE_LIMIT_S
                        until = min(now + BODY_GRACE_S, grace_end)  # its next piece (the end marker, apart) awaited
            except asyncio.TimeoutError:
                return self._body_timeout(trace, f"request body silent for {self.body_timeout_s:g} s", "silent")
            except BodyTooSlow:
                return self._body_timeout(trace, f"request body slower than {self.body_min_bytes_per_s:g} bytes/s "
                                                 f"on average after its first {self.body_timeout_s:g} s")
            except OSError:
                return self._client_left(trace)
            except HttpProcessingError as e:
                return self._client_left(trace, _broken_body_note(e))
            except Exception as e:
                # A bug in the reader: a 500 where the server never saw the request and no row. Fail open: the
                # bytes read go on as they came, the rest read plainly, the row saying its body was not read.
                self._proxy_failed(e)
                if getattr(chunks, "got", got) != got:
                    # It had taken bytes from the stream that were not kept: failing open sent the server 2000 of a
                    # 3000-byte body and the client a 200, its row ok. A body with bytes lost is never forwarded.
                    self._inspecting -= budget[0]
                    budget[0] = 0
                    return self._body_failed(trace, f"the request body could not be forwarded whole (its reader failed "
                                                    f"after taking {chunks.got - got} bytes not kept: "
                                                    f"{error_text(e)[:150]}); not sent upstream")
                if trace is not None:
                    _add_error(trace, f"request body not read (the proxy's body reader failed: {error_text(e)[:150]}):"
                                      " streamed on, its model and stream not known")
                chunks = _PlainReader(request.content, self.body_timeout_s)
            # Trimmed to the bytes read: a body's until its answer begins, a prefix's until written upstream (given
            # back at once, a prefix just over 1 MiB waited on a free connection outside the budget: +0.33 MiB a client).
            self._inspecting -= budget[0] - got
            budget[0] = got
            if chunks is None:
                body = b"".join(parts)
            else:
                prefix = b"".join(parts)
        if body is not None or chunks is not None:
            streamed = chunks is not None
            framing = b"Transfer-Encoding: chunked\r\n"
            if body is not None:
                self._inspect(request, trace, body)
                body = (b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
        elif budget[0]:
            taken0 = _taken_bytes(request.content)
            try:
                if request.content.is_eof():  # all here already (the usual small POST): no timer, no await
                    body = request.content.read_nowait()
                else:
                    # The stream's own read, not request.read(): that one keeps the bytes on the request for its life.
                    body = await asyncio.wait_for(request.content.read(), self.body_timeout_s)
            except asyncio.TimeoutError:
                return self._body_timeout(trace, f"request body of {length} bytes not received within "
                                                 f"{self.body_timeout_s:g} s")
            except OSError:  # the client left mid-body (aiohttp: ConnectionResetError)
                return self._client_left(trace)
            except HttpProcessingError as e:
                return self._client_left(trace, _broken_body_note(e))
            except Exception as e:
                # A fault reading it (a bug: the client's doings are the cases above): it left the handler by the
                # exception, aiohttp answered its own 500, the row said ok and the ledger had none.
                self._proxy_failed(e)
                taken1 = _taken_bytes(request.content)
                if taken0 is None or taken1 is None or taken1 != taken0:
                    # Bytes taken from the stream and not kept (or none can tell): never forwarded, as the chunked
                    # reader's fault after taking bytes.
                    return self._body_failed(trace, f"the request body of {length} bytes could not be read "
                                                    f"({error_text(e)[:150]}); not sent upstream")
                # Nothing taken: every byte is still in the stream, so it streams on uninspected, as a chunked body's
                # reader fault does. Before, this body got a 500 and was lost all the same (failopen.py).
                if trace is not None:
                    _add_error(trace, f"request body not read (the proxy's body reader failed: {error_text(e)[:150]}):"
                                      " streamed on, its model and stream not known")
                chunks = _PlainReader(request.content, self.body_timeout_s)
                streamed = True
                framing = b"Transfer-Encoding: chunked\r\n"
            if not streamed:
                framing = b"Content-Length: %d\r\n" % len(body)
                self._inspect(request, trace, body)
        elif request.body_exists:
            streamed = True
            framing = b"Transfer-Encoding: chunked\r\n"
        elif length is not None:
            framing = b"Content-Length: %d\r\n" % length
        else:
            framing = b""
        if trace is not None and trace.extra.pop(NOT_FORWARDED, None):
            self.unforwarded -= 1
        self._safe(trace, self.recorder.on_start)
        req_headers = request.headers
        head = request_head(request.method, self.pool.prefix + request.raw_path, self.pool.host_header,
                            request.raw_headers, b"Via: 1.1 %s\r\n" % self.via_name.encode() + framing,
                            req_headers.getall("Connection") if "Connection" in req_headers else ())
        ex = None
        try:
            ex = await self.pool.acquire()
            if body:
                head += body  # one write for head and a small body
            ex.start(request.method, head)
            if streamed:
                sent = len(prefix)
                try:
                    if prefix:
                        await ex.write_body(b"%x\r\n%b\r\n" % (len(prefix), prefix))
                    prefix = b""
                    self._inspecting -= budget[0]
                    budget[0] = 0
                    if chunks is None:
                        chunks = _BodyReader(request.content, self.body_timeout_s, self.body_min_bytes_per_s)
                    while chunk := await chunks.read():
                        sent += len(chunk)
                        await ex.write_body(b"%x\r\n%b\r\n" % (len(chunk), chunk))
                except asyncio.TimeoutError:
                    self._drop(ex)
                    return self._body_timeout(trace, f"request body silent for {self.body_timeout_s:g} s", "silent")
                except BodyTooSlow:
                    self._drop(ex)
                    return self._body_timeout(trace, f"request body slower than {self.body_min_bytes_per_s:g} bytes/s "
                                                     f"on average after its first {self.body_timeout_s:g} s")
                except OSError:  # from the client's side: write_body raises UpstreamError only
                    self._drop(ex)
                    return self._client_left(trace)
                except HttpProcessingError as e:
                    self._drop(ex)
                    return self._client_left(trace, _broken_body_note(e))
                except (UpstreamError, _ClientLeft):
                    raise  # said below
                except Exception as e:  # a bug reading the body on: the server has part of it, so it cannot go on
                    self._drop(ex)
                    self._proxy_failed(e)
                    return self._body_failed(trace, f"reading the request body failed ({error_text(e)[:150]}): "
                                                    "upstream closed")
                await ex.write_body(b"0\r\n\r\n")
                if trace is not None and trace.api is not None and request.headers.get(
                        "Content-Encoding", "").strip().lower() in ("", "identity"):
                    # Not read: its prompt's size unknown, its bytes bound its characters (Ledger._prompt_work).
                    trace.extra["body_bytes"] = sent
            # Until the head comes (a server sends a non-streamed answer's head only when done), the upstream's
            # timer also checks the client: one that left closes the upstream, which stops generating. (While
            # a body is streamed, a client gone shows in reading it.)
            ex.on_tick = lambda: _check_waiting_client(request, ex)
            try:
                status, reason, up_headers = await ex.response_head
            except StaleConnection as stale:
                if streamed:
                    raise  # a body streamed through is gone: it cannot be sent again
                # The server never began this request (no byte of an answer on a connection it had closed):
                # sent once more, on a new connection, as browsers do (Chromium resends on a reused socket).
                closed_ns = time.monotonic_ns()
                self._drop(ex)
                ex = None
                self.upstream_retries += 1
                try:
                    ex = await self.pool.acquire(fresh=True)
                except OSError as e:
                    if not _refused(e):
                        raise
                    # Nothing listens: the close was the server dying with the request (a crash 1 s into a whole
                    # answer reads as a crossing close), which it had. Taken for unreachable, its row got 0 J and its
                    # work went to the requests beside it (305-310 J for 145, 1 run in 3 in the simulator's scene).
                    # Its figure runs to the close: a close that did cross it costs the few ms it took.
                    raise ResendRefused(
                        f"upstream closed the kept-alive connection {stale.waited_s:.2f} s after the request without "
                        f"answering, and sending it again was refused ({error_text(e)}): the server died with it (a "
                        "crash?), or stopped as the request crossed its idle connection's close (then never run)",
                        closed_ns=closed_ns) from e
                ex.start(request.method, head)
                ex.on_tick = lambda: _check_waiting_client(request, ex)
                status, reason, up_headers = await ex.response_head
                page = await ex.peek_body(LOADING_BODY_MAX, 1.0) if status == 503 else None
                if page is not None and LLAMACPP_LOADING.encode() in page:
                    # A new llama-server loading its model: the close was the old process's end, with the request
                    # in flight or before it read it. Accounted as its answer, the 503 was no share (0 J), the work
                    # the old process did for it the neighbours'. The client still gets the page itself.
                    raise ResendLoading(
                        f"upstream closed the kept-alive connection {stale.waited_s:.2f} s after the request without "
                        f"answering, and {RESEND_LOADING} (HTTP 503 {LLAMACPP_LOADING}): the server restarted, with it "
                        "in flight (a crash?) or as the request crossed its idle connection's close (then never run)",
                        closed_ns=closed_ns, page=(status, reason, up_headers, page))
        except _ClientLeft as e:
            self._drop(ex)
            return self._client_left(trace, str(e))
        except (UpstreamError, asyncio.TimeoutError, OSError) as e:
            if ex is not None:
                self._drop(ex)
            self.upstream_failures += 1
            if (isinstance(e, ResendRefused) and not isinstance(e, ResendLoading)) or (
                    isinstance(e, OSError) and _refused(e)):
                self._note_refused(time.monotonic_ns())
            # Reached but answering no HTTP (a bad status line, a head over 64 KiB) is not "unreachable": said apart.
            what = "broke the HTTP exchange" if isinstance(e, UpstreamError) and not isinstance(e, StaleConnection) \
                else "unreachable"
            msg = f"powerprof proxy: upstream {self.upstream} {what}: {error_text(e)}"
            if self.upstream_failures <= 5 or self.upstream_failures % 100 == 0:
                log.error("%s (%d failures so far)", msg, self.upstream_failures)
            if trace is not None and isinstance(e, UpstreamClosed):
                # The server had it, and ran it until then: not unreachable. A whole answer's head comes only when it
                # is done, so every whole answer in flight at a crash ended here: upstream_unreachable, no energy (two
                # on the simulator, 130 tokens and 148 J each), that work idle, their rows silent on it.
                said = (f"{RESEND_LOADING}: " if isinstance(e, ResendLoading)  # first: the cut keeps it
                        else f"{RESEND_REFUSED}: " if isinstance(e, ResendRefused) else "")
                trace.status, trace.outcome, trace.error = 502, "upstream_error", f"{CRASHED_NOTE}: {said}{msg}"[:300]
                if isinstance(e, ResendRefused):  # ResendLoading too
                    # Its run at the server ended at the close: costed to there, not to the resend's answer (a
                    # loading page 0.2 s later put the new process's load in its figure, 473 J for 221).
                    trace.end_ns = e.closed_ns
            elif trace is not None:
                trace.status, trace.outcome, trace.error = 502, "upstream_unreachable", msg[:300]
            if isinstance(e, ResendLoading):
                # The server's own answer, read whole already: the client gets its bytes (status, Retry-After, its
                # CORS headers, body), not the proxy's 502 (a client that retries on a 503's Retry-After does so).
                status, reason, up_headers, page = e.page
                if trace is not None:
                    trace.status = status
                return web.Response(status=status, reason=reason, body=page,
                                    headers=forward_headers(up_headers, _CONTENT_LENGTH))
            body = json.dumps({"error": {"message": msg, "type": "bad_gateway", "code": 502}}).encode()
            return web.Response(status=502, body=body, content_type="application/json")
        except BaseException:
            if ex is not None:
                self._drop(ex)
            raise
        # The answer has begun: the body will not be sent again (StaleConnection's retry is over).
        body = head = None
        self._inspecting -= budget[0]
        budget[0] = 0
        try:
            return await self._relay(request, ex, status, reason, up_headers, trace)
        finally:
            self.pool.release(ex)

    def _over_budget(self, trace: RequestTrace | None) -> None:
        """A body up to INSPECT_MAX_BYTES streamed on, not read whole, for the budget: counted, its row saying so."""
        self.uninspected_bodies += 1
        if trace is not None:
            _add_error(trace, f"request body not read whole ({self._inspecting / 2**20:.1f} MiB of other requests' "
                              "bodies were held, waiting for their answers to begin): streamed on, its model and "
                              "stream not known")

    def _proxy_failed(self, e: Exception) -> None:
        self.proxy_failures += 1
        if self.proxy_failures <= 5 or self.proxy_failures % 1000 == 0:
            log.error("the proxy failed reading a request body (%d so far): %s", self.proxy_failures, error_text(e),
                      exc_info=self.proxy_failures == 1)

    def _body_failed(self, trace: RequestTrace | None, what: str) -> web.Response:
        """500 for a request body the proxy's own fault left unforwardable (a bug, logged by `_proxy_failed`): the
        JSON error and the row (outcome proxy_error) say `what` and the fix; the connection is closed, its body's rest
        unread."""
        msg = f"powerprof proxy: {what}"
        if trace is not None:
            trace.status, trace.outcome = 500, "proxy_error"
            _add_error(trace, f"{msg[:300]}; {PROXY_FAULT_FIX}")
        resp = web.Response(status=500, content_type="application/json", body=json.dumps(
            {"error": {"message": msg, "type": "proxy_error", "code": 500}}).encode())
        resp.force_close()  # the rest of its body is not read: the connection cannot carry another
        return resp

    def _inspect(self, request: web.Request, trace: RequestTrace | None, body: bytes) -> None:
        """A body read whole: its model, stream flag and prompt size onto the trace (fail-open)."""
        if trace is not None and trace.api is not None:
            try:
                encoding = request.headers.get("Content-Encoding", "")
                model, trace.stream = inspect_request_body(body, encoding, trace.api, trace.extra)
                trace.model = bounded_text(model)
            except Exception:
                pass

    def _drop(self, ex: Exchange) -> None:
        ex.abort()
        self.pool.release(ex)

    def _body_timeout(self, trace: RequestTrace | None, why: str, rule: str = "slow") -> web.Response:
        """408; `rule`: "silent" (a pause of body_timeout_s) or "slow" (too few bytes for the time taken)."""
        self.body_timeouts[rule] += 1
        if trace is not None:
            trace.status, trace.outcome = 408, "client_timeout"
            _add_error(trace, f"{why}; fix: the client sends its body with no pause of proxy.body_timeout_s "
                              f"({self.body_timeout_s:g} s) and at least proxy.body_min_bytes_per_s "
                              f"({self.body_min_bytes_per_s:g}) on average after that, or raise those")
        return web.Response(status=408, text=f"powerprof proxy: {why}\n")

    def _client_left(self, trace: RequestTrace | None, why: str = BODY_LEFT_NOTE) -> web.Response:
        """The client left before its response began: not the upstream's failure."""
        if trace is not None:
            trace.outcome = "client_disconnected"
            if why.startswith(BODY_LEFT_NOTE):
                # The server never had it whole, so never ran it: no tail of it to miss (`_note_unseen_tail`). First in
                # `error`, before what was said of it already (the ledger reads a body left by its opening words).
                prior, trace.error = trace.error, (f"{why}; fix: none here: the client closed its connection mid-body "
                                                   "(its own timeout or a cancel)")
                if prior:
                    _add_error(trace, prior)
            else:
                _add_error(trace, why)
                _note_unseen_tail(trace)
        return web.Response(status=400)  # nobody reads it

    async def _relay(self, request: web.Request, ex: Exchange, status: int, reason: str, up_headers,
                     trace: RequestTrace | None) -> web.StreamResponse:
        resp = _RelayResponse(status=status, reason=reason)
        # RFC 9112 §6.3: Transfer-Encoding overrides Content-Length (the body is decoded as chunked), and an
        # intermediary removes the Content-Length before forwarding: passed on, it would frame the client's
        # body with a length the body does not have, and a keep-alive client would read the next response
        # out of step.
        by_te = "Transfer-Encoding" in up_headers
        resp.headers.extend(forward_headers(up_headers, _CONTENT_LENGTH if by_te else frozenset()))
        if not by_te and up_headers.get("Content-Length") is not None and request.method != "HEAD":
            resp.content_length = int(up_headers["Content-Length"])
        if (request.version < aiohttp.HttpVersion11 and resp.content_length is None and request.method != "HEAD"
                and status >= 200 and status not in (204, 304)):
            # HTTP/1.0 has no chunks: such a body ends where the connection does. aiohttp drops its keep-alive header
            # then but keeps the connection open (3.14): a client that asked keep-alive waited 75 s for the close.
            resp.force_close()
        ctype = up_headers.get("Content-Type", "")
        sink = _ClientSink(self, trace)
        if trace is not None:
            trace.status = status
            encoding = up_headers.get("Content-Encoding", "").strip().lower()
            if (trace.api is None and status < 400 and encoding in ("", "identity")
                    and streams.uncounted_kind(trace.method, trace.endpoint) == "embeddings"):
                # Its input's length (usage.prompt_tokens) is the whole of its GPU work: a prefill, no decode.
                sink.usage_scan = streams.PromptTokensScan()
            if trace.api is not None and status < 400 and encoding in ("gzip", "x-gzip", "deflate"):
                sink.inflate = zlib.decompressobj(47)  # 32 + 15: a zlib or gzip header, detected
            elif trace.api is not None and status < 400 and encoding not in ("", "identity"):
                # Its tokens cannot be read: said on the row, not left as a silent null.
                _add_error(trace, f"response Content-Encoding {encoding[:40]!r} is not inspected: "
                                  "its tokens were not counted")
            else:
                encoding = ""
            if trace.api is not None and status < 400 and (not encoding or sink.inflate is not None):
                is_sse = "text/event-stream" in ctype or (trace.stream and "json" not in ctype)
                try:
                    if is_sse:
                        sink.parser = streams.new_parser(trace.api, echo=trace.extra.get("echo", False),
                                                         choices=trace.extra.get("choices", 1),
                                                         sequences=trace.extra.get("sequences", 1)
                                                         + trace.extra.get("empty_tasks", 0),
                                                         echo_chars=trace.extra.get("echo_chars", 0),
                                                         max_tokens=trace.extra.get("max_tokens"))
                        trace.stream = True
                    else:
                        # Answered whole, whatever its body asked (llama-server reads a "stream" that is no JSON bool as
                        # false; before, such a row said stream true for a whole answer).
                        sink.body_copy = bytearray()
                        trace.stream = False
                except Exception as e:
                    trace.recorder_error = f"parser: {e}"
                    self.recorder_failures += 1
            elif trace.api is not None and status >= 400:
                trace.stream = "text/event-stream" in ctype  # what the error answer was, not what was asked
                if (status == 400 and not trace.stream
                        and up_headers.get("Content-Encoding", "").strip().lower() in ("", "identity")):
                    sink.error_copy = bytearray()
        try:
            writer = await resp.prepare(request)
            early = ex.take_early()
            if early:
                # What came with the upstream's head goes out with ours: one write, not two.
                now = time.monotonic_ns()
                await resp.write(early)
                sink.account(early, now)
                sink._free_ns = time.monotonic_ns()
            else:
                writer.send_headers()
            sink.transport = request.transport
            sink.writer = writer
            sink.chunked = writer.chunked
            sink.ex = ex
            if sink.transport is None or sink.transport.is_closing():
                raise ConnectionResetError("client gone")
            ex.on_tick = sink.check_client
            ex.attach(sink.on_body)
            try:
                await ex.done
            except (UpstreamError, asyncio.TimeoutError, OSError):
                if not sink.gone:
                    raise
                # The client had left and the upstream closed its side while the tail was read: as it should.
            if sink.gone:
                raise ConnectionResetError("client gone")
            await resp.write_eof()
            if ex.excess:
                self._excess(trace, ex.excess)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError) as e:
            if trace is not None:
                trace.outcome = "interrupted" if self.closing else "client_disconnected"
                self._counts_so_far(trace, sink, ex)
                if trace.outcome == "client_disconnected":
                    _note_unseen_tail(trace, ex)
            ex.abort()  # the server sees the disconnect and stops generating
            if isinstance(e, asyncio.CancelledError):
                raise
            return resp
        except (UpstreamError, asyncio.TimeoutError, OSError) as e:
            # The upstream broke mid-response: the client gets what came; the connection is cut.
            if trace is not None:
                trace.outcome, trace.error = "upstream_error", error_text(e)[:300]
            if request.transport is not None:
                request.transport.close()
            return resp
        if trace is not None and trace.recorder_error is None:
            try:
                if sink.parser is not None:
                    trace.counts = _stream_counts(trace, sink)
                    _held_end(trace, sink)
                    if self.closing and not trace.counts.complete:
                        trace.outcome = "interrupted"  # our shutdown closed the upstream mid-stream
                    elif (not trace.counts.complete and trace.counts.invalid is None
                          and trace.counts.server_error is None):
                        # The upstream ended the response as framed, but its stream never said it was done: the
                        # tokens counted are those it sent, and what it generated and never sent is not here.
                        _add_error(trace, CUT_BY_UPSTREAM_NOTE)
                elif sink.body_copy is None and sink.copy_overflow:
                    _add_error(trace, f"response body over {BODY_COPY_MAX_BYTES >> 20} MiB: not inspected, its tokens "
                                      "were not counted")
                elif sink.body_copy is not None:
                    self._body_done(trace, bytes(sink.body_copy))
                elif sink.usage_scan is not None and sink.usage_scan.prompt_tokens is not None:
                    trace.extra["prompt_tokens"] = sink.usage_scan.prompt_tokens
                elif sink.error_copy is not None:
                    msg = error_message(bytes(sink.error_copy))
                    if msg is not None:
                        trace.extra["error_message"] = msg
            except Exception as e:
                trace.recorder_error = f"summary: {error_text(e)}"[:300]
                self.recorder_failures += 1
        if trace is not None and status >= 500 and trace.outcome == "ok":
            # Relayed whole, but the server failed it: not an `ok` in the requests' counts.
            trace.outcome = "upstream_error"
            trace.error = trace.error or f"the upstream answered HTTP {status} {reason}".rstrip()[:300]
        elif (trace is not None and trace.outcome == "ok" and trace.counts is not None
              and trace.counts.server_error is not None):
            # An HTTP 200 whose stream (or body) then carried the server's error (vLLM, SGLang and llama.cpp
            # send `data: {"error": ...}` when a generation fails mid-stream): it failed, whatever came before.
            # Its tokens were generated and keep their energy; before, the row said `ok` with no error.
            trace.outcome = "upstream_error"
            note = f"the upstream reported an error inside its HTTP {status} response: {trace.counts.server_error}"
            trace.error = (note if trace.error is None else f"{trace.error}; {note}")[:600]
        return resp

    def _excess(self, trace: RequestTrace | None, n: int) -> None:
        """The upstream sent bytes past its response's Content-Length: the client got the declared body (a
        proxy cannot pass the rest: it is not part of this response, nor a next one); logged and on the row."""
        self.upstream_excess += 1
        note = f"the upstream sent {n} byte(s) past its Content-Length: not forwarded (its connection is not reused)"
        if self.upstream_excess <= 5 or self.upstream_excess % 100 == 0:
            log.warning("%s (%d such responses so far)", note, self.upstream_excess)
        if trace is not None:
            trace.error = note if trace.error is None else f"{trace.error}; {note}"[:600]

    def _counts_so_far(self, trace: RequestTrace, sink: "_ClientSink", ex: Exchange) -> None:
        """A client gone: what its stream said still counts (usage with the prompt length, sent before
        `[DONE]`). One that left only after the whole response (the upstream finished, the stream
        said it ended) was served: outcome ok."""
        if sink.parser is None or trace.recorder_error is not None:
            return
        try:
            trace.counts = _stream_counts(trace, sink)
            _held_end(trace, sink)
        except Exception as e:
            trace.recorder_error = f"summary: {error_text(e)}"[:300]
            self.recorder_failures += 1
            return
        done = ex.done  # also set when the proxy aborts the upstream for a client gone (sink.gone)
        if not self.closing and not sink.gone and trace.counts.complete and done is not None and done.done() \
                and not done.cancelled() and done.exception() is None:
            trace.outcome = "ok"

    def _body_done(self, trace: RequestTrace, body: bytes) -> None:
        """A non-streamed generation: its tokens are spread over its decode time (see docs)."""
        counts = _body_counts(trace, body)
        if "n_cmpl" in trace.extra:
            n = trace.extra.get("choices", 1)
            v = trace.extra["n_cmpl"]
            ran = settle_n_cmpl(trace.extra, counts.choice_stops, True)
            if ran:  # read again as the tasks llama-server ran (a whole answer's usage is its first task's)
                counts = _body_counts(trace, body)
            elif ran is None:
                n_cmpl_unsettled(trace, v, n)
        trace.counts = counts
        n = counts.generated_tokens or 0
        if counts.listed_tokens is not None:
            n = counts.listed_tokens  # its count contradicts the tokens it listed: what it listed, never the count
        if n <= 0:
            return
        now = time.monotonic_ns()
        wall = now + trace.arrival_wall_ns - trace.arrival_ns
        span_ns = now - trace.arrival_ns
        if counts.predicted_ms is not None and counts.predicted_ms >= 0:
            span_ns = min(span_ns, int(counts.predicted_ms * 1e6))
        trace.first_ns, trace.first_wall_ns = now - span_ns, wall - span_ns
        trace.last_ns, trace.last_wall_ns = now, wall
        trace.tokens_seen = n
        trace.extra["spread"] = True  # the recorder spreads the n tokens over [first, last]


def error_message(body: bytes) -> str | None:
    """An error answer's message, at most ERROR_MESSAGE_MAX_CHARS: its top-level `error` (a string, or an object's
    `message`), or a flat `{"object": "error", "message"}` (SGLang's and older vLLM's OpenAI routes); None where the
    body is no such JSON (or was cut at ERROR_BODY_MAX_BYTES)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # nested deeper than the parser's stack: a 400 of 16,000 bytes held 8,000
        return None
    if not isinstance(doc, dict):
        return None
    err = doc.get("error")
    if isinstance(err, dict):
        err = err.get("message")
    elif err is None and doc.get("object") == "error":
        err = doc.get("message")
    return err[:ERROR_MESSAGE_MAX_CHARS] if isinstance(err, str) else None


def _body_counts(trace: RequestTrace, body: bytes) -> streams.Counts:
    seqs = trace.extra.get("sequences", 1)
    return streams.body_counts(trace.api, body, trace.extra.get("choices", 1),
                               seqs + trace.extra.get("empty_tasks", 0), tasks_run=seqs)


def _stream_counts(trace: RequestTrace, sink) -> streams.Counts:
    """A stream's counts at its end, its `n_cmpl` settled first (its sequences are what the counts are judged by)."""
    summary = sink.parser.finish()
    if "n_cmpl" in trace.extra:
        n, v = trace.extra.get("choices", 1), trace.extra["n_cmpl"]
        # A Responses stream has no [DONE]: whole where every Response it opened completed (`StreamParser._typed`).
        whole = summary.done or (trace.api == "openai-responses" and summary.complete)
        ran = settle_n_cmpl(trace.extra, summary.choice_stops, whole)
        if ran:  # read again as the tasks llama-server ran: finish() waited for n's (n 2, n_cmpl 1: its prompt unsaid)
            summary = sink.parser.retask(trace.extra.get("choices", 1),
                                         trace.extra.get("sequences", 1) + trace.extra.get("empty_tasks", 0))
        elif ran is None:
            n_cmpl_unsettled(trace, v, n)
    return streams.summary_counts(summary, held=_held_call(trace, sink.upstream_end_ns))


CUT_BY_UPSTREAM_NOTE = ("the upstream ended the response before its stream said it was done (no stop event, "
                        "finish_reason or [DONE]): tokens it generated and never sent are not counted here, and any "
                        "final counts (usage, the prompt's length) it would have sent are missing")


def unreadable_note(counts: streams.Counts) -> str:
    """What a response with lines or events the parser could not read leaves out of its row's token count."""
    first = (counts.error or "")[:160]
    return (f"{counts.unreadable} line(s) or event(s) of the response could not be read ({first}): tokens they carried "
            "are not in the proxy's count")


class ResendRefused(UpstreamClosed):
    """A request sent again after a kept-alive close (forward.StaleConnection) whose new connection was refused.
    `closed_ns`: when that close was seen (monotonic), where the request's run at the server ended."""

    def __init__(self, message: str, closed_ns: int):
        super().__init__(message)
        self.closed_ns = closed_ns


class ResendLoading(ResendRefused):
    """A request sent again after a kept-alive close whose resend met llama-server's loading page (RESEND_LOADING).
    `page`: that answer, read whole (status, reason, headers, body), relayed to the client as it came."""

    def __init__(self, message: str, closed_ns: int, page: tuple):
        super().__init__(message, closed_ns)
        self.page = page


def _refused(e: OSError) -> bool:
    """Whether a connect failed because nothing listens at any of the upstream's addresses (asyncio says two or more
    in one OSError: "Multiple exceptions: [Errno 111] …, [Errno 111] …")."""
    if isinstance(e, ConnectionRefusedError):
        return True
    text = str(e)
    return text.startswith("Multiple exceptions: ") and text.count("[Errno ") == text.count(
        f"[Errno {errno.ECONNREFUSED}]") > 0


def _broken_body_note(e: HttpProcessingError) -> str:
    """aiohttp's error for a body that broke HTTP's framing (it closes that connection): the client's doing, said as
    one that left mid-body, not as the proxy's fault (logged and streamed on as one)."""
    return f"{BODY_LEFT_NOTE}: its body broke HTTP's framing ({error_text(e)[:150]})"


def _add_error(trace: RequestTrace, note: str) -> None:
    trace.error = (note if trace.error is None else f"{trace.error}; {note}")[:600]


UNSEEN_TAIL_NOTE = ("the client left before the response ended; the proxy closed the upstream so the server stops, but "
                    "tokens it generated until it noticed were never seen here: the server's counter places them in "
                    "the intervals' unproxied energy, not in this request's")
DRAINED_TAIL_NOTE = ("the client left before the response ended; the proxy ended its side of the upstream connection so "
                     "the server stops, and counted for this request what the server still sent until it closed; tokens "
                     "it generated and never sent are not in this row (the server's counter places them in unproxied)")
CUT_TAIL_NOTE = ("the client left before the response ended, and the upstream kept sending for {s:g} s after the proxy "
                 "ended its side of the connection, until the proxy closed it: what came until then is counted for this "
                 "request; tokens the server generated after that are not (the server's counter places them in unproxied)")


def _note_unseen_tail(trace: RequestTrace, ex: Exchange | None = None) -> None:
    """A generation cut by its client: what the server still generated for it may not be in its row, and the row says
    so (the stream's own end, `[DONE]` or the stop event, already seen: nothing is missing)."""
    if trace.api is None or (trace.counts is not None and trace.counts.complete):
        return
    if ex is not None and ex.drain_cut:
        note = CUT_TAIL_NOTE.format(s=DRAIN_S)
    elif ex is not None and ex.draining:
        note = DRAINED_TAIL_NOTE
    else:
        note = UNSEEN_TAIL_NOTE
    trace.error = note if trace.error is None else f"{trace.error}; {note}"[:600]


class _ClientLeft(Exception):
    """The client left while its response head was awaited."""


def _check_waiting_client(request: web.Request, ex: Exchange) -> None:
    transport = request.transport
    if transport is None or transport.is_closing():
        ex.abort(_ClientLeft("the client left before the response began"))


class _RelayResponse(web.StreamResponse):
    """aiohttp's StreamResponse with its head held until the first body bytes: the head and the body
    that came with the upstream's head leave in one write (aiohttp sends a StreamResponse's head
    alone, at prepare, unless told otherwise), so the client is woken once for its first byte."""

    _send_headers_immediately = False


class _ClientSink:
    """The client's side of one response: each upstream read is written out, then counted (fail-open)."""

    WRITE_BUFFER_MAX_BYTES = 1 << 16

    def __init__(self, proxy: Proxy, trace: RequestTrace | None):
        self.proxy = proxy
        self.trace = trace
        self.parser = None
        self.body_copy: bytearray | None = None
        self.usage_scan: streams.PromptTokensScan | None = None  # an embeddings answer's prompt length
        self.copy_overflow = False  # a whole body past BODY_COPY_MAX_BYTES: its copy dropped, not inspected
        self.error_copy: bytearray | None = None  # a 400's body, up to ERROR_BODY_MAX_BYTES (`error_message`)
        self.transport = None
        self.writer = None
        self.chunked = False
        self.ex: Exchange | None = None
        self.gone = False
        self._prompt_known = False
        self.inflate = None  # zlib decompressobj of a gzip/deflate response: its counts are read inflated
        self._inflated = 0
        self._not_inspected = False
        self._draining = False
        self._drain_task: asyncio.Task | None = None
        self._paused_ns = 0  # when its upstream was paused for a client slow to read (`_drain`)
        # When this sink last finished with a piece (monotonic ns): a piece that comes within SAME_DELIVERY_NS of it
        # was waiting while the previous one was handled, part of the same delivery (`account`, trace.extra["deliveries"]).
        self._free_ns: int | None = None
        self._piece_tokens = 0  # tokens in the last piece that carried any
        # When the upstream's last piece came (tokens or not): the server's end of the response, not the client's
        # (trace.end_ns waits on the client's last write).
        self.upstream_end_ns = time.monotonic_ns()

    def on_body(self, piece: bytes, framed: bytes | None) -> None:
        # In the upstream socket's callback: no task wake-up per read. The piece goes out first; it is
        # parsed after, stamped with its arrival time.
        now = time.monotonic_ns()
        transport = self.transport
        try:
            if self.gone or transport.is_closing():
                # The client left: this piece is not delivered, but the server generated it for this request, so
                # it is counted (before, it was dropped uncounted and the server's counter gave it to unproxied).
                self._client_gone()
                self.account(piece, now)
                self._free_ns = time.monotonic_ns()
                return
            if self.chunked:
                transport.write(framed if framed is not None else b"%x\r\n%b\r\n" % (len(piece), piece))
            else:
                transport.write(piece)
            if not self._draining and transport.get_write_buffer_size() > self.WRITE_BUFFER_MAX_BYTES:
                self._draining = True
                self._paused_ns = now
                self.ex.pause()  # a slow client: stop reading the upstream until its buffer drains
                self._drain_task = asyncio.get_running_loop().create_task(self._drain())  # held: not collected
        except Exception:  # the client's socket failed: as if it left (the piece still counts, as above)
            self._client_gone()
        self.account(piece, now)
        self._free_ns = time.monotonic_ns()

    def account(self, piece: bytes, now: int) -> None:
        """Counts one piece's tokens (fail-open)."""
        trace = self.trace
        self.upstream_end_ns = now
        if trace is None:
            return
        try:
            trace.response_bytes += len(piece)
            if self.inflate is not None:
                piece = self._inflate(piece)
            elif self._not_inspected:
                return
            parser = self.parser
            if parser is None:
                if self.body_copy is not None:
                    if len(self.body_copy) + len(piece) <= BODY_COPY_MAX_BYTES:
                        self.body_copy += piece
                    else:  # past the bound: not a cut copy parsed as if whole (the row says so, _relay)
                        self.body_copy, self.copy_overflow = None, True
                elif self.usage_scan is not None:
                    self.usage_scan.feed(piece)
                elif self.error_copy is not None:
                    if len(self.error_copy) + len(piece) <= ERROR_BODY_MAX_BYTES:
                        self.error_copy += piece
                    else:  # past the bound: its message unread, not a cut body read as whole
                        self.error_copy = None
                return
            if trace.recorder_error is not None:
                return
            try:
                n = parser.count(piece)
            except Exception as e:
                trace.recorder_error = f"parser: {error_text(e)}"[:300]
                self.proxy.recorder_failures += 1
                return
            if not self._prompt_known:
                p = parser.prompt_tokens  # early, from continuous usage: the ledger need not wait for the end
                # Not one llama.cpp task's of several (each says its own as it ends): the request's is their sum, at its end.
                # Nor where the tasks are not known yet (`n_cmpl`: 2 tasks read as one said its 4 tokens of 8 early).
                if p is not None and (not parser.prompt_each_task
                                      or (trace.extra.get("sequences", 1) == 1 and "n_cmpl" not in trace.extra)):
                    trace.extra.setdefault("prompt_tokens", p)
                    k = parser.cached_tokens  # said with it (SGLang, details in continuous usage): its prefill's part
                    if k is not None:
                        trace.extra.setdefault("cached_tokens", k)
                    self._prompt_known = True
            if n <= 0:
                return
            # Deliveries of tokens: a piece that came more than SAME_DELIVERY_NS after this sink was done with the previous
            # one starts a new one. Its arrival stamp alone cannot say so: a body held back and sent whole (a buffering
            # hop) is read in pieces, each stamped after the previous one was parsed: an 800 kB llama.cpp stream with n_probs,
            # its stamps 7-18 ms apart in all, was not taken for one burst (docs/daemon.md, A stream held back on its way).
            # A gap after a piece that held more tokens than one step gives (its sequences') is the sender's, not the
            # server's: a held body's next piece, the hop (or this host) slow to refill the socket. On a loaded host
            # (a full suite beside it) such gaps passed 1 ms and the 800 kB stream read as several deliveries.
            free = self._free_ns
            held = self._piece_tokens > max(trace.extra.get("sequences", 1), 1)
            if trace.first_ns is None or free is None or (now - free > SAME_DELIVERY_NS and not held):
                trace.extra["deliveries"] = trace.extra.get("deliveries", 0) + 1
            self._piece_tokens = n
            if trace.first_ns is None:
                trace.first_ns, trace.first_wall_ns = now, now + trace.arrival_wall_ns - trace.arrival_ns
            trace.last_ns = now
            trace.tokens_seen += n
            try:
                self.proxy.recorder.on_tokens(trace, now, n)
            except Exception as e:  # recording must never touch the traffic
                self.proxy._recording_failed(trace, e)
        except Exception as e:  # accounting never stops the bytes
            trace.recorder_error = f"proxy: {error_text(e)}"[:300]
            self.proxy.recorder_failures += 1

    def _inflate(self, piece: bytes) -> bytes:
        """A compressed response's piece, inflated for counting only (bounded: INFLATE_MAX_BYTES in all)."""
        trace = self.trace
        why = None
        limit = INFLATE_MAX_BYTES - self._inflated + 1
        copy = self.body_copy
        if copy is not None:
            # A whole answer is read no further than its copy's bound: one 65 KB piece of a gzip body inflated to
            # 64 MiB in one call, holding the event loop 0.59 s, for a copy that kept none of it.
            limit = min(limit, BODY_COPY_MAX_BYTES - len(copy) + 1)
        try:
            out = self.inflate.decompress(piece, limit)
        except zlib.error as e:
            out, why = b"", f"cannot be inflated ({e})"
        if why is None and copy is not None and (self.inflate.unconsumed_tail or len(copy) + len(out) > BODY_COPY_MAX_BYTES):
            # Past the copy's bound: its row says so as an uncompressed one's (_relay); nothing more is inflated.
            self._inflated += len(out)
            self.inflate, self._not_inspected = None, True
            self.body_copy, self.copy_overflow = None, True
            return b""
        budget = INFLATE_MAX_BYTES - self._inflated
        self._inflated += len(out)
        if why is None and (self.inflate.unconsumed_tail or self._inflated > INFLATE_MAX_BYTES):
            out, why = out[:max(budget, 0)], f"inflates beyond {INFLATE_MAX_BYTES >> 20} MiB"
        if why is not None:
            # Counted up to here (what `out` still holds); the rest is not inspected, and the row says so.
            self.inflate, self._not_inspected = None, True
            if trace.error is None:
                trace.error = f"compressed response {why}: tokens after that were not counted"
        return out

    async def _drain(self) -> None:
        try:
            await self.writer.drain()
        except Exception:
            self._client_gone()
            return
        finally:
            self._draining = False
            self._note_client_held()
        if self.ex is not None:
            self.ex.resume()

    def _note_client_held(self) -> None:
        """The seconds its upstream stood paused for its client to read (its own backpressure: a receive buffer full),
        summed on the trace (`client_held_s`): the tokens the server sent meanwhile reach the proxy in a burst once the
        client reads, which the ledger would otherwise blame on a buffering hop between the server and the proxy."""
        trace = self.trace
        if trace is not None and self._paused_ns:
            held_s = (time.monotonic_ns() - self._paused_ns) / 1e9
            trace.extra["client_held_s"] = trace.extra.get("client_held_s", 0.0) + held_s
        self._paused_ns = 0

    def check_client(self) -> None:
        """On the upstream's timer: a client that left while the upstream is silent ends the request too."""
        if self.transport is None or self.transport.is_closing():
            self._client_gone()

    def _client_gone(self) -> None:
        if not self.gone:
            self.gone = True
            if self.ex is not None and not self.ex.half_close(DRAIN_S):
                self.ex.abort()
