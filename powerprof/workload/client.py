"""Inference-server client (aiohttp): detects the server kind and streams one request into a record.

Every token-bearing event is stamped with the monotonic clock the moment its bytes arrive;
the record keeps those arrival times and token counts, the server's own timings, draft
counts and why it stopped. Prompt and completion text are kept only when asked (`keep_text`).
A failure (refused, HTTP error, timeout, truncated stream, malformed JSON) yields a record
with status "failed" and the reason, never an exception and never counted tokens.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import numpy as np

from powerprof.arrival import ArrivalQuality, Timing, arrival_quality, classify, count_problem
from powerprof.errtext import error_text

from .auth import API_KEY_ENV, api_key_given, auth_headers
from .limits import (IDLE_REUSE_S, MAX_ERROR_BYTES, MAX_INFO_BYTES, MAX_METRICS_BYTES, MAX_RESPONSE_BYTES,
                     BodyTooLarge, bad_count, read_capped)
from .servercount import connection_refused
from .stream import APIS, StreamParser, parse_response

# Server kinds and what each accepts beyond the OpenAI basics.
KINDS = ("llamacpp", "vllm", "sglang", "tgi", "openai")
IGNORE_EOS_KINDS = {"llamacpp", "vllm", "sglang"}
_CONTINUOUS_USAGE = {"vllm", "sglang"}

EdgeHook = Callable[[str], None]


class ServerUnreachable(Exception):
    """Nothing usable answered at the server URL."""


@dataclass(frozen=True)
class ServerInfo:
    """What the server is: filled once per run by `detect_server`."""

    base_url: str
    kind: str  # llamacpp | vllm | sglang | tgi | openai
    api: str  # the protocol requests use: llamacpp | openai-completions | openai-chat
    model: str | None = None
    build_info: str | None = None
    model_path: str | None = None
    total_slots: int | None = None
    simulated: bool = False
    # The tokens one request may fill, prompt included: llama.cpp's slot context (/props
    # default_generation_settings.n_ctx), vLLM's and SGLang's max_model_len (/v1/models); None where not said.
    context_tokens: int | None = None

    @property
    def endpoint(self) -> str:
        path = {"llamacpp": "/completion", "openai-completions": "/v1/completions", "openai-chat": "/v1/chat/completions"}
        return self.base_url.rstrip("/") + path[self.api]

    def meta(self) -> dict:
        """The run.json "server" entry."""
        return {
            "url": self.base_url,
            "kind": self.kind,
            "api": self.api,
            "model": self.model,
            "build_info": self.build_info,
            "model_path": self.model_path,
            "total_slots": self.total_slots,
        }


@dataclass(frozen=True)
class RequestParams:
    """What every request of a run asks for: deterministic, greedy, fixed length."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int = 42
    ignore_eos: bool = True
    prompt_cache: bool = False  # False: the server must redo prefill (llama.cpp cache_prompt)
    connect_timeout_s: float = 10.0
    first_token_timeout_s: float = 300.0  # prefill of a long prompt on a slow card
    stall_timeout_s: float = 60.0  # silence between two events
    keep_text: bool = False


@dataclass(frozen=True)
class RequestRecord:
    """One attempt at one request. Times are monotonic ns; wall clock only in t_send_wall_ns."""

    request_id: int
    prompt_id: str
    api: str
    attempt: int  # 1 for the first try
    status: str  # ok | failed
    error: str | None
    http_status: int | None
    t_send_ns: int
    t_end_ns: int  # the stream closed (or the attempt gave up)
    t_send_wall_ns: int  # time.time_ns() at t_send_ns, to convert for storage
    event_t_ns: tuple[int, ...]  # arrival of every token-bearing event
    event_tokens: tuple[int, ...]  # tokens each of those events carried
    t_first_ns: int | None  # first read that carried tokens (the decode window may start later: arrival.py)
    t_last_ns: int | None  # last read that carried tokens
    prompt_tokens: int | None
    generated_tokens: int  # the server's count when given, else counted; 0 for failures
    decode_tokens: int  # tokens that arrived after the first read (generated − 1 on a smooth stream)
    decode_s: float | None  # last read − first read, as the stream saw it
    decode_tok_s: float | None  # decode_tokens / decode_s, as the stream saw it
    token_source: str | None  # usage | timings | counted
    server_timings: dict = field(default_factory=dict)
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    stop_reason: str | None = None
    model: str | None = None
    warmup: bool = False
    batch_id: int | None = None
    concurrency: int = 1
    prompt_text: str | None = None
    completion_text: str | None = None
    # Worst lateness of the client's event loop around the window edges (load.py measures it):
    # a read can be no fresher than the loop that takes it.
    client_lag_s: float | None = None
    client_lag_max_s: float | None = None  # over the whole window
    # The server's own timing of this request's decode, where it gave one.
    server_decode_s: float | None = None
    server_decode_tokens: int | None = None
    server_timing_source: str | None = None  # llamacpp-timings | vllm-metrics
    truncated: str | None = None  # why fewer tokens came than were asked for (context length)
    # Tokens the stream's chunks showed, before any the server's count placed (the vLLM closing
    # chunk); None: the events' sum. running_counts: every chunk carried the server's running count.
    # Checked against generated_tokens by the timing rule (arrival.count_problem).
    stream_tokens: int | None = None
    running_counts: bool = False
    # Times it was sent again at once because a kept-alive connection the server had closed took it unanswered
    # (send_request): the server never began those sends, so they are no failed attempt and not in its times.
    resent: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def quality(self) -> ArrivalQuality:
        return arrival_quality(self.event_t_ns, self.event_tokens, self.generated_tokens if self.ok else None)

    @property
    def timing(self) -> Timing | None:
        """How this attempt's window is timed (the rule in powerprof/arrival.py); None for failures."""
        if not self.ok:
            return None
        return classify(self.quality, self.generated_tokens, self.server_decode_s, self.server_decode_tokens, self.client_lag_s,
                        self.shown_tokens, self.running_counts)

    @property
    def shown_tokens(self) -> int:
        """Tokens the stream showed, the one figure both the timing rule and count_problem check the server's count against."""
        return int(sum(self.event_tokens)) if self.stream_tokens is None else self.stream_tokens

    @property
    def count_problem(self) -> str | None:
        """Why the server's own token count cannot be believed beside its stream (arrival.count_problem); None for failures."""
        if not self.ok:
            return None
        lie = count_problem(self.shown_tokens, self.generated_tokens, self.running_counts)
        return lie.message if lie else None

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_ns is None else (self.t_first_ns - self.t_send_ns) / 1e9

    def arrivals(self) -> tuple[np.ndarray, np.ndarray]:
        """(arrival_ns int64, tokens int64) arrays for the windows functions."""
        return np.asarray(self.event_t_ns, dtype=np.int64), np.asarray(self.event_tokens, dtype=np.int64)

    def to_wall_ns(self, t_mono_ns: int | None) -> int | None:
        return None if t_mono_ns is None else self.t_send_wall_ns + (t_mono_ns - self.t_send_ns)


# How many times one request is sent again after meeting a connection the server had closed (send_request): each
# such connection taken from the pool is dropped, so this only bounds a pool that keeps handing out closed ones.
MAX_RESENDS = 8


async def _on_reused(_session, trace_ctx, _params) -> None:
    """aiohttp took a kept-alive connection from its pool for the request: say so to send_request."""
    ctx = trace_ctx.trace_request_ctx
    if isinstance(ctx, dict):
        ctx["reused"] = True


# After a stream's own end (`[DONE]`, a stop event) its body's end may come a little later (a loaded server writes the
# terminating chunk after the last event): read for this long, and this much, so that aiohttp keeps the connection
# (a body not read to its end closes it). The record's end is the stream's, before this wait.
STREAM_TAIL_S = 0.1
STREAM_TAIL_BYTES = 64 << 10


async def _read_tail(resp: aiohttp.ClientResponse) -> None:
    """Read the body past its stream's end to the body's end, within STREAM_TAIL_S and STREAM_TAIL_BYTES. Never
    raises: a tail not read (late, long, broken) leaves the connection to be closed, as before."""
    if resp.content.at_eof():
        return

    async def drain() -> None:
        n = 0
        while not resp.content.at_eof() and n <= STREAM_TAIL_BYTES:
            chunk = await resp.content.readany()
            if not chunk:
                return
            n += len(chunk)

    try:
        await asyncio.wait_for(drain(), STREAM_TAIL_S)
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        pass


def new_session() -> aiohttp.ClientSession:
    """The HTTP session of every run (load, measure, sweep, replay): connections unlimited, idle ones not reused
    after IDLE_REUSE_S, and the trace that tells send_request a request went out on a reused connection. A session
    made otherwise works too, but a request the server's close took unanswered then counts as a failed attempt.
    Every request carries the API key where one is set (auth_headers)."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reused)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_REUSE_S),
                                 trace_configs=[trace], headers=auth_headers())


def build_body(server: ServerInfo, prompt: str, params: RequestParams) -> dict:
    """The JSON body of a streaming request, with only the fields this server kind accepts."""
    body: dict = {"stream": True, "temperature": params.temperature, "seed": params.seed}
    if server.api == "llamacpp":
        body.update(prompt=prompt, n_predict=params.max_tokens, cache_prompt=params.prompt_cache)
        if params.ignore_eos:
            body["ignore_eos"] = True
        return body
    if server.model:
        body["model"] = server.model
    body["max_tokens"] = params.max_tokens
    if server.api == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    opts = {"include_usage": True}
    if server.kind in _CONTINUOUS_USAGE:
        opts["continuous_usage_stats"] = True  # per-chunk counts when chunks carry several tokens
    body["stream_options"] = opts
    if params.ignore_eos and server.kind in IGNORE_EOS_KINDS:
        body["ignore_eos"] = True
    if params.ignore_eos and server.kind == "vllm":
        body["min_tokens"] = params.max_tokens  # the length asked for, even past an end-of-text token
    if server.kind == "llamacpp":
        body["cache_prompt"] = params.prompt_cache
    return body


async def _get_json(session: aiohttp.ClientSession, url: str, errors: list | None = None):
    """(status, parsed JSON or None). A body over MAX_INFO_BYTES is not read further and counts as no answer.
    A connection that fails is (None, None), its exception added to `errors` for the message that follows."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return r.status, None
            try:
                return r.status, json.loads(await read_capped(r, MAX_INFO_BYTES))
            except (ValueError, UnicodeDecodeError):  # BodyTooLarge is a ValueError
                return r.status, None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        if errors is not None:
            errors.append(e)
        return None, None


def url_problem(base: str) -> str | None:
    """Why `base` cannot be a server's base URL, with the fix; None where it can."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    try:
        u = urlsplit(base)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        ok = False
    if ok:
        return None
    if base.startswith(("http://", "https://")):
        return f"{base!r} is not a valid URL (its host or port); e.g. http://127.0.0.1:8080"
    bare = base.split("://", 1)[-1]
    return (f"{base!r} is not an http:// or https:// URL; give the scheme, host and port, "
            f"e.g. http://{bare or '127.0.0.1:8080'}")


def _why_no_answer(base: str, errors: list) -> str:
    """What the failed connections say, in the user's terms, with the fix."""
    ssl_or_timeout = any(isinstance(e, (aiohttp.ClientSSLError, asyncio.TimeoutError)) for e in errors)
    if base.startswith("https://") and ssl_or_timeout:
        return ("no TLS answer: is it a plain http server? Try " + "http://" + base[len("https://"):])
    if any(isinstance(e, aiohttp.ClientConnectorError) and not isinstance(e, aiohttp.ClientSSLError) for e in errors):
        return "connection refused or unreachable: is the server running, and on this host and port?"
    if ssl_or_timeout:
        return "no answer within 10 s"
    return error_text(errors[-1]) if errors else "no answer"


async def detect_server(session: aiohttp.ClientSession, base_url: str, api: str | None = None) -> ServerInfo:
    """Find out what answers at base_url: llama.cpp (`/props`), vLLM/SGLang/TGI (`/v1/models`,
    `/version`, `/info`), or a plain OpenAI-compatible server. `api` overrides the protocol."""
    if api is not None and api not in APIS:
        raise ValueError(f"unknown api {api!r}; choose one of: {', '.join(APIS)}")
    base = base_url.rstrip("/")
    bad = url_problem(base)
    if bad is not None:
        raise ServerUnreachable("--server " + bad)
    errors: list = []
    st_props, props = await _get_json(session, base + "/props", errors)
    if base.startswith("https://") and any(isinstance(e, (aiohttp.ClientSSLError, asyncio.TimeoutError)) for e in errors):
        # A plain-http server may sit out each TLS handshake until the 10 s timeout: say so after the first.
        raise ServerUnreachable(f"no server answers at {base}: " + _why_no_answer(base, errors))
    st_models, models = await _get_json(session, base + "/v1/models", errors)
    model = None
    owner = None
    simulated = False
    ctx = None
    if isinstance(models, dict) and isinstance(models.get("data"), list) and models["data"]:
        m0 = models["data"][0]
        if isinstance(m0, dict):
            model = m0.get("id") if isinstance(m0.get("id"), str) else None
            owner = str(m0.get("owned_by") or "").lower()
            simulated = bool(m0.get("simulated"))
            ctx = _positive_int(m0.get("max_model_len"))
    if isinstance(props, dict) and ("build_info" in props or "total_slots" in props or "default_generation_settings" in props):
        slots = props.get("total_slots")
        return ServerInfo(
            base,
            "llamacpp",
            api or "llamacpp",
            model=model,
            build_info=str(props.get("build_info")) if props.get("build_info") is not None else None,
            model_path=props.get("model_path") if isinstance(props.get("model_path"), str) else None,
            total_slots=int(slots) if slots is not None and bad_count(slots) is None and slots > 0 else None,
            simulated=bool(props.get("simulated")) or simulated,
            context_tokens=_positive_int(dgs.get("n_ctx")) if isinstance(dgs := props.get("default_generation_settings"), dict) else None,
        )
    kind = "openai"
    build = None
    if owner in ("vllm", "sglang"):
        kind = owner
    else:
        st_info, info = await _get_json(session, base + "/info")
        if isinstance(info, dict) and "model_id" in info:
            kind = "tgi"
            build = str(info.get("version")) if info.get("version") else None
            model = model or info.get("model_id")
    if kind == "vllm" or (kind == "openai" and st_models == 200):
        st_v, ver = await _get_json(session, base + "/version")
        if isinstance(ver, dict) and "version" in ver:
            build = str(ver["version"])
            if kind == "openai":
                kind = "vllm"
    st_h = None
    if st_models is None and st_props is None:
        st_h, _ = await _get_json(session, base + "/health", errors)
        if st_h is None:
            raise ServerUnreachable(f"no server answers at {base} (tried /props, /v1/models, /health): "
                                    + _why_no_answer(base, errors))
    if 401 in (st_props, st_models) or (st_models == 403 and st_props != 200):
        # llama-server and vLLM started with --api-key: every endpoint but /health answers 401 without it.
        had = api_key_given()
        raise ServerUnreachable(
            f"{base} answers {st_models if st_models in (401, 403) else st_props} Unauthorized: it was started with an API "
            f"key (--api-key) and " + (f"refuses the one in ${API_KEY_ENV}" if had else "none was given")
            + f": set {API_KEY_ENV}=<the server's key> in powerprof's environment (not a flag: a key on the command "
            "line is in every process listing)")
    if st_models != 200 and api is None:
        if 503 in (st_props, st_models, st_h):
            # llama-server answers 503 to everything while it loads; --api would only move the failure on.
            raise ServerUnreachable(
                f"{base} answers 503 Service Unavailable: is it still loading its model? Wait until "
                f"{base}/health answers 200, or start it with --launch (which waits for that)")
        if base.endswith("/v1"):
            raise ServerUnreachable(
                f"{base} answers but is no server powerprof knows: give the URL without the /v1 "
                f"(powerprof adds /v1/... itself): {base[:-len('/v1')]}")
        raise ServerUnreachable(
            f"{base} answers but is neither llama.cpp (/props) nor OpenAI-compatible (/v1/models): if it is an "
            "inference server, pass --api; a web server that is not one answers like this too"
        )
    return ServerInfo(base, kind, api or "openai-completions", model=model, build_info=build, simulated=simulated,
                      context_tokens=ctx if kind in ("vllm", "sglang") else None)


def _positive_int(v) -> int | None:
    return v if type(v) is int and v > 0 else None


# What a request the server's context cannot hold needs, said with every such refusal (and before a run asks for one).
CONTEXT_FIX = ("fix: use shorter prompts or a lower --max-tokens, or start the server with a longer context "
               "(llama-server -c, vLLM --max-model-len, SGLang --context-length)")
# The words each server's refusal uses: llama.cpp "exceeds the available context size", vLLM "maximum context length"
# and "max_model_len", SGLang "context length" and its scheduler's "exceeds the maximum allowed length" (a prompt of
# the context less 6 or more: docs/simulator.md, "Context window").
_CONTEXT_WORDS = re.compile(r"context size|context length|max_model_len|maximum allowed length")


def names_context(error: str | None) -> bool:
    """Whether an error is the server refusing a request its context cannot hold."""
    return bool(error) and _CONTEXT_WORDS.search(error) is not None


def context_problem(server: ServerInfo, max_tokens: int, prompts=()) -> str | None:
    """Why no request of `max_tokens` can fit the server's context (the prompt takes at least one token of it),
    with the fix; None when it may, or the server does not say its context. llama.cpp would cut each such
    generation at its slot's context, vLLM and SGLang refuse it: either way nothing measured is what was asked.
    With `prompts`, what each asks: a prompt file's own "max_tokens" overrides --max-tokens (load.Prompt), so one
    past the context was cut or refused mid-run, and --max-tokens alone is not asked where every prompt has its own."""
    ctx = server.context_tokens
    if ctx is None:
        return None
    asks = [(p.max_tokens, p.id) if getattr(p, "max_tokens", None) is not None else (max_tokens, None) for p in prompts]
    n, pid = max(asks or [(max_tokens, None)], key=lambda a: a[0])
    if n < ctx:
        return None
    where = "a slot's n_ctx in /props" if server.kind == "llamacpp" else "max_model_len in /v1/models"
    what = f"prompt {pid}'s own max_tokens {n} (its prompt file)" if pid is not None else f"--max-tokens {n}"
    fix = CONTEXT_FIX if pid is None else CONTEXT_FIX.replace("a lower --max-tokens", "a lower max_tokens in the prompt file")
    return f"{what} asks for more than the server's context holds: {ctx} tokens a request, prompt included ({where}); {fix}"


def server_away(rec: "RequestRecord") -> bool:
    """Whether a failed attempt says the server itself was gone or not yet serving (refused, reset, its stream
    cut, 503 while it loads), as when it restarts, rather than that this one request went wrong."""
    if rec.ok:
        return False
    e = rec.error or ""
    return rec.http_status == 503 or e.startswith(("connection refused", "could not connect", "server closed the stream",
                                                    "connection lost"))


async def health_status(session: aiohttp.ClientSession, base_url: str) -> int | None:
    """HTTP status of /health, or of /v1/models where there is no /health; None when nothing answers."""
    base = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with session.get(base + "/health", timeout=timeout) as r:
            if r.status != 404:
                return r.status
        async with session.get(base + "/v1/models", timeout=timeout) as r:
            return r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


async def server_identity(session: aiohttp.ClientSession, server: ServerInfo) -> dict:
    """What a server must still be after a restart for the levels measured before and after to compare:
    kind, model, build, slots (ServerInfo), and llama.cpp's context and default parameters (/props) or
    vLLM's context length (/v1/models). ServerUnreachable when it does not answer."""
    now = await detect_server(session, server.base_url, server.api)
    out = {k: getattr(now, k) for k in ("kind", "api", "model", "build_info", "model_path", "total_slots")}
    _, props = await _get_json(session, server.base_url + "/props")
    dgs = props.get("default_generation_settings") if isinstance(props, dict) else None
    if isinstance(dgs, dict):
        out.update({"n_ctx": dgs.get("n_ctx"), "speculative": dgs.get("speculative"), "params": dgs.get("params")})
    _, models = await _get_json(session, server.base_url + "/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        out["max_model_len"] = data[0].get("max_model_len")
    return out


async def server_epoch(session: aiohttp.ClientSession, server: ServerInfo) -> dict:
    """What tells one run of the server's process from the next, from its /metrics: the process start time
    (`process_start_time_seconds`, which prometheus_client gives vLLM and SGLang) and the sum of every
    counter family (llama.cpp's with --metrics, vLLM's, SGLang's). {} where /metrics does not answer: llama.cpp
    exposes no start time or uptime anywhere (/props, /health, /slots), so without --metrics nothing tells."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(server.base_url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return {}
            text = (await read_capped(r, MAX_RESPONSE_BYTES)).decode("utf-8", "replace")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return {}
    out: dict = {}
    counters: dict = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name == "process_start_time_seconds":
                vals = [smp.value for smp in fam.samples if math.isfinite(smp.value)]
                if vals:
                    out["start_time_s"] = min(vals)
            elif fam.type == "counter":
                vals = [smp.value for smp in fam.samples if smp.name.endswith("_total") and math.isfinite(smp.value)]
                if vals:
                    counters[fam.name] = sum(vals)
    except Exception:  # noqa: BLE001 - not Prometheus text: nothing tells
        return {}
    if counters:
        out["counters"] = counters
    return out


def restart_evidence(before: dict, after: dict) -> tuple[bool | None, str]:
    """Whether the server's process restarted between two `server_epoch` readings, and what says so:
    (True, 'its process start time moved ...' or 'its counter X fell from 1234 to 0'), (False, 'its process
    start time is unchanged'), or (None, why nothing tells). A counter that did not fall proves nothing (the
    new process may have counted more since), so only a start time can say "no restart"."""
    t0, t1 = before.get("start_time_s"), after.get("start_time_s")
    if t0 is not None and t1 is not None:
        if abs(t1 - t0) > 1e-3:
            return True, f"its process start time moved {t1 - t0:.1f} s later (/metrics process_start_time_seconds)"
        return False, "its process start time is unchanged (/metrics process_start_time_seconds)"
    c0, c1 = before.get("counters") or {}, after.get("counters") or {}
    fell = [(k, c0[k], c1[k]) for k in c0 if k in c1 and c1[k] < c0[k]]
    if fell:
        k, a, b = max(fell, key=lambda x: x[1] - x[2])
        return True, f"its counter {k} fell from {a:g} to {b:g} (/metrics: a new process counts from zero)"
    if not before and not after:
        return None, "it serves no /metrics to tell (llama.cpp: --metrics)"
    return None, "its /metrics shows no start time, and no counter fell"


def restart_said(restarted: bool | None, evidence: str | None) -> tuple[str, str]:
    """What a server that went away did, only as far as `restart_evidence` showed it, and what shows it: ('the
    server restarted', evidence), or ('the server stopped answering', whether it restarted or that nothing tells).
    Not "no restart seen" where nothing could have seen one (a restarted llama.cpp without --metrics read so)."""
    evidence = evidence or "nothing tells"
    if restarted:
        return "the server restarted", evidence
    if restarted is False:
        return "the server stopped answering", f"it did not restart: {evidence}"
    return "the server stopped answering", f"whether it restarted is unknown: {evidence}"


def identity_changes(before: dict, after: dict) -> list[str]:
    """How a restarted server differs from the one measured before: 'total_slots 4 → 1', ..."""
    return [f"{k} {before.get(k)!r} → {after.get(k)!r}" for k in dict.fromkeys([*before, *after])
            if before.get(k) != after.get(k)]


def server_decode(timings: dict) -> tuple[float | None, int | None, str | None]:
    """llama.cpp's own decode timing of one request: (seconds, decode tokens, source).

    `predicted_ms` runs from the first sampled token to the last, so it spans predicted_n − 1
    decode steps (its `predicted_per_second` divides by n, which is why ours is computed)."""
    ms, n = timings.get("predicted_ms"), timings.get("predicted_n")
    # Python's JSON reader takes NaN and Infinity: an infinite decode time passed `ms > 0` and ended
    # the sweep with an OverflowError when the window's edges were placed from it.
    if (isinstance(ms, (int, float)) and math.isfinite(ms) and isinstance(n, int) and not isinstance(n, bool)
            and ms > 0 and n > 1):
        return ms / 1e3, n - 1, "llamacpp-timings"
    return None, None, None


# vLLM's /metrics: the decode-phase histogram (every version since v0), and the per-token
# latency histogram under its current name or the v0 one (0.32 has only the first).
VLLM_DECODE = "vllm:request_decode_time_seconds"
VLLM_ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
# vLLM's time from a request's arrival in its engine to its first scheduling, observed as it finishes; its first bucket
# (0.3 s) bounds the waits it tells apart from a scheduler step's.
VLLM_QUEUE = "vllm:request_queue_time_seconds"
VLLM_QUEUE_BUCKET_S = 0.3


def vllm_timing_totals(text: str) -> dict:
    """Sums and counts of vLLM's decode and inter-token histograms (over all label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    try:
        fams = list(text_string_to_metric_families(text))
    except Exception:  # not Prometheus text: no server timing, never an error
        return out
    for fam in fams:
        if fam.name == "vllm:num_requests_waiting":
            out["waiting"] = sum(smp.value for smp in fam.samples)
            continue
        if fam.name == VLLM_QUEUE:
            # Each label set's too (several engines or models): a server restarted mid-level (its counts back to 0)
            # is told by a series that went back, which the sums hide where another one rose more.
            series = out.setdefault("queue_series", {})
            for smp in fam.samples:
                part = ("queue_sum" if smp.name.endswith("_sum") else "queue_count" if smp.name.endswith("_count")
                        else "queue_short" if smp.name.endswith("_bucket") and _le(smp.labels) == VLLM_QUEUE_BUCKET_S
                        else None)
                if part is not None:
                    out[part] = out.get(part, 0.0) + smp.value
                    key = tuple(sorted((k, v) for k, v in smp.labels.items() if k != "le"))
                    series.setdefault(key, {})[part] = series.get(key, {}).get(part, 0.0) + smp.value
            continue
        key = "decode" if fam.name == VLLM_DECODE else "itl" if fam.name in VLLM_ITL else None
        if key is None:
            continue
        out[key + "_name"] = fam.name
        for smp in fam.samples:
            if smp.name.endswith("_sum"):
                out[key + "_sum"] = out.get(key + "_sum", 0.0) + smp.value
            elif smp.name.endswith("_count"):
                out[key + "_count"] = out.get(key + "_count", 0.0) + smp.value
    return out


def _le(labels: dict) -> float | None:
    try:
        return float(labels.get("le", ""))
    except ValueError:
        return None


def vllm_decode_delta(before: dict, after: dict) -> tuple[float | None, int | None, str | None]:
    """The server's decode timing of the one request that ran between two /metrics snapshots.

    `request_decode_time_seconds` (first to last token) when exactly one request finished in
    between: it spans (its tokens − 1) steps, counted by the inter-token histogram. Without it,
    the inter-token histogram alone: its sum over its count."""
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    if not all(math.isfinite(d(k)) for k in ("itl_count", "itl_sum", "decode_count", "decode_sum")):
        return None, None, None  # a NaN or +Inf sample (Prometheus text allows both) times nothing
    n_itl = int(round(d("itl_count")))
    if "decode_sum" in after and round(d("decode_count")) == 1 and n_itl > 0 and d("decode_sum") > 0:
        return d("decode_sum"), n_itl, "vllm-metrics"
    if n_itl > 0 and d("itl_sum") > 0:
        return d("itl_sum"), n_itl, "vllm-metrics"
    return None, None, None


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str) -> dict | None:
    """vLLM timing totals from /metrics, or None when it does not answer."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            if r.status != 200:
                return None
            return vllm_timing_totals((await read_capped(r, MAX_METRICS_BYTES)).decode())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError, BodyTooLarge):
        return None


def _closed_under_it(e: BaseException, answered: bool, reuse: dict, resent: int) -> bool:
    """Whether a request's failure is a kept-alive connection the server had closed taking it unanswered (resend it):
    on a reused connection, before the answer's head, the connection cut (EOF, reset, broken pipe), MAX_RESENDS not
    spent. A new connection's failure is the server's: a refused one is no reuse (ClientConnectorError), and a timeout
    is silence, not a close."""
    if answered or not reuse.get("reused") or resent >= MAX_RESENDS:
        return False
    if isinstance(e, (aiohttp.ClientConnectorError, aiohttp.ClientPayloadError)):
        return False
    return isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionError))


def _failed(base: dict, error: str, http_status: int | None, t_end_ns: int) -> RequestRecord:
    return RequestRecord(
        **base,
        status="failed",
        error=error,
        http_status=http_status,
        t_end_ns=t_end_ns,
        event_t_ns=(),
        event_tokens=(),
        t_first_ns=None,
        t_last_ns=None,
        prompt_tokens=None,
        generated_tokens=0,
        decode_tokens=0,
        decode_s=None,
        decode_tok_s=None,
        token_source=None,
    )


async def send_request(
    session: aiohttp.ClientSession,
    server: ServerInfo,
    prompt: str,
    params: RequestParams,
    *,
    request_id: int = 0,
    prompt_id: str = "",
    attempt: int = 1,
    warmup: bool = False,
    batch_id: int | None = None,
    concurrency: int = 1,
    edge_hook: EdgeHook | None = None,
    clock_ns: Callable[[], int] = time.monotonic_ns,
    headers: dict | None = None,
) -> RequestRecord:
    """Send one streaming request and record it. Never raises for server or network trouble.

    `edge_hook("first:<id>")` runs the moment the first token arrives and `edge_hook("end:<id>")`
    when the stream ends, synchronously, so a profiler can read its counters at the window edges.
    """
    body = build_body(server, prompt, params)
    parser = StreamParser(server.api)
    times: list[int] = []
    counts: list[int] = []
    texts: list[str] = []
    http_status = None
    error = None
    first_called = False
    closing_t = None  # arrival of an OpenAI closing chunk that carried no counted token
    t_end = None  # the stream's end where it had one (its tail read after)
    end_called = False
    timeout = aiohttp.ClientTimeout(
        total=None, connect=params.connect_timeout_s, sock_read=max(params.first_token_timeout_s, params.stall_timeout_s)
    )
    resent = 0
    while True:
        # A request on a kept-alive connection that ends before any byte of its answer was never begun by the
        # server: the connection had been closed under it (llama-server closes after every streamed answer without
        # saying so; servers close idle ones). It is sent again at once, stamped anew, as browsers do: no failed
        # attempt, nothing the server did lost, and its time to first token runs from the send the server answered.
        # aiohttp drops the closed connection, so the resend goes on a new one (or a live kept one).
        t_send_wall = time.time_ns()
        t_send = clock_ns()
        base = dict(
            request_id=request_id,
            prompt_id=prompt_id,
            api=server.api,
            attempt=attempt,
            t_send_ns=t_send,
            t_send_wall_ns=t_send_wall,
            warmup=warmup,
            batch_id=batch_id,
            concurrency=concurrency,
            prompt_text=prompt if params.keep_text else None,
            resent=resent,
        )
        reuse = {"reused": False}  # set by new_session's trace when aiohttp takes a kept-alive connection for it
        answered = False  # the answer's head came
        try:
            async with session.post(server.endpoint, json=body, timeout=timeout, headers=headers,
                                    trace_request_ctx=reuse) as resp:
                answered = True
                http_status = resp.status
                if resp.status != 200:
                    text = (await resp.content.read(MAX_ERROR_BYTES)).decode("utf-8", "replace")
                    return _failed(base, f"HTTP {resp.status}: {text.strip()}", resp.status, clock_ns())
                ctype = resp.headers.get("Content-Type", "")
                if "text/event-stream" not in ctype and "json" in ctype:
                    try:
                        raw = await read_capped(resp, MAX_RESPONSE_BYTES)
                    except BodyTooLarge as e:
                        return _failed(base, f"response too large: {e}", resp.status, clock_ns())
                    t = clock_ns()
                    evs, summary = parse_response(server.api, raw)
                    for e in evs:
                        times.append(t)
                        counts.append(e.n_tokens)
                        texts.append(e.text)
                else:
                    it = resp.content.iter_any().__aiter__()
                    while True:
                        # Prefill may be long; after the first token only the stall limit applies.
                        limit = params.stall_timeout_s if first_called else params.first_token_timeout_s
                        try:
                            chunk = await asyncio.wait_for(it.__anext__(), limit)
                        except StopAsyncIteration:
                            break
                        except asyncio.TimeoutError:
                            what = "the first token" if not first_called else "the next token"
                            error = f"timeout: no data for {limit:g} s while waiting for {what}"
                            break
                        t = clock_ns()
                        for e in parser.feed(chunk):
                            if e.closing:
                                closing_t = t
                                continue
                            times.append(t)
                            counts.append(e.n_tokens)
                            if params.keep_text:
                                texts.append(e.text)
                            if not first_called:
                                first_called = True
                                if edge_hook is not None:
                                    edge_hook(f"first:{request_id}")
                        if parser.ended:
                            break
                    summary = parser.finish()
                    if parser.ended and error is None:
                        # The record ends, and its `end:` edge is read, at the stream's end, not after its tail.
                        t_end = clock_ns()
                        if first_called and edge_hook is not None:
                            edge_hook(f"end:{request_id}")
                            end_called = True
                        await _read_tail(resp)
        except aiohttp.ClientConnectorError as e:
            # Only a refusal is said as one (nothing listens: the server down); a name that did not resolve or a
            # connect that timed out is said as it is (servercount.connection_refused). Either is ridden out
            # (server_away): whether the server restarted is read from its /metrics then, never from these words.
            said = "connection refused" if connection_refused(e) else "could not connect"
            return _failed(base, f"{said}: {e.os_error or e}", None, clock_ns())
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as e:
            if _closed_under_it(e, answered, reuse, resent):
                resent += 1
                continue
            error = f"server closed the stream: {type(e).__name__}"
            summary = parser.finish()
        except asyncio.TimeoutError:
            return _failed(base, "timeout while connecting or sending", http_status, clock_ns())
        except (aiohttp.ClientOSError, ConnectionError) as e:
            if _closed_under_it(e, answered, reuse, resent):
                resent += 1
                continue
            # The connection itself broke (reset, a kept-alive socket the server closed as it died): server_away.
            error = f"connection lost: {error_text(e)}"
            summary = parser.finish()
        except (aiohttp.ClientError, OSError) as e:
            error = error_text(e)
            summary = parser.finish()
        break
    if t_end is None:
        t_end = clock_ns()
    if first_called and edge_hook is not None and not end_called:
        edge_hook(f"end:{request_id}")
    if error is None and summary.error:
        error = summary.error
    if error is None and not summary.complete:
        error = f"truncated stream: ended after {summary.counted_tokens} tokens without a stop event"
    if error is None and not times:
        error = "the response carried no tokens"
    if error is not None:
        # Partial streams are kept out of every count: what the server did is not known.
        return _failed(base, error, http_status, t_end)
    deficit = summary.generated_tokens - summary.counted_tokens
    if deficit == 1 and closing_t is not None:
        # vLLM's closing chat chunk (empty content, finish_reason) carries the last token: `usage`
        # says so at the end; it arrived with that chunk. One token, no more: a larger shortfall
        # placed there would pass for a stream whose last read held them all.
        times.append(closing_t)
        counts.append(deficit)
    if not any(counts) and not summary.generated_tokens:
        # A whole (unstreamed) answer is one event whatever it holds: one with no text and a count of 0 passed the
        # check above as a response with tokens, and its window had no edges to time (a sweep died on them). Tokens
        # the server counted but no event showed go on as before: the timing rule leaves such a window untrusted.
        return _failed(base, "the response carried no tokens", http_status, t_end)
    q = arrival_quality(np.asarray(times, dtype=np.int64), np.asarray(counts, dtype=np.int64), summary.generated_tokens)
    dur_s = (q.t_last_ns - q.t_first_ns) / 1e9 if q.t_first_ns is not None else None
    sd_s, sd_n, sd_src = server_decode(summary.timings)
    truncated = None
    if summary.stop_reason == "length" and summary.generated_tokens < params.max_tokens:
        truncated = f"{summary.generated_tokens} of {params.max_tokens} tokens: cut by the context length"
    return RequestRecord(
        **base,
        status="ok",
        error=None,
        http_status=http_status,
        t_end_ns=t_end,
        event_t_ns=tuple(times),
        event_tokens=tuple(counts),
        t_first_ns=min(times) if times else None,
        t_last_ns=max(times) if times else None,
        prompt_tokens=summary.prompt_tokens,
        generated_tokens=summary.generated_tokens,
        decode_tokens=q.window_tokens,
        decode_s=dur_s,
        decode_tok_s=q.window_tokens / dur_s if dur_s and q.window_tokens > 0 else None,
        token_source=summary.token_source,
        server_timings=summary.timings,
        draft_n=summary.draft_n,
        draft_n_accepted=summary.draft_n_accepted,
        stop_reason=summary.stop_reason,
        model=summary.model or server.model,
        completion_text="".join(texts) if params.keep_text else None,
        server_decode_s=sd_s,
        server_decode_tokens=sd_n,
        server_timing_source=sd_src,
        truncated=truncated,
        stream_tokens=summary.counted_tokens,
        running_counts=summary.running_counts,
    )

