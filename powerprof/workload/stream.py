"""Incremental parsers for inference-server responses: bytes in, token events and a summary out.

Pure: no I/O, no clock. The client and the daemon's proxy feed the bytes as they arrive and
stamp the returned events with their own arrival time. A parser never raises on garbage; it
records an error and keeps going, so a proxy forwarding the same bytes is never disturbed.
Every count and timing a server sends is checked here (type, sign, range: `limits`); a bad one is
not used, and the summary's `invalid` says which, so the request is reported failed.

APIs:
- "llamacpp": llama.cpp's native `/completion` (one `data:` event per token or group of
  tokens, `tokens` array, `tokens_predicted`; final event `stop: true` with `timings`, no
  `[DONE]`).
- "openai-completions" / "openai-chat": `/v1/completions` and `/v1/chat/completions`
  (`choices[].text` / `choices[].delta`, role-only first chunk, optional `usage` chunk,
  llama.cpp's `timings` on the last chunk, `[DONE]`; several choices, each with its `index`).
- "openai-responses": the Responses API, `/v1/responses` (vLLM): typed events (`event:` lines are
  framing only; the `type` in the data says what it is), `response.*.delta` events carry text,
  `response.completed` / `response.incomplete` the `usage` (`output_tokens`, `input_tokens`); no `[DONE]`.
- "anthropic-messages": Anthropic's Messages API, `/v1/messages` (llama.cpp, vLLM): `message_start`
  (the prompt's `input_tokens`), `content_block_delta` events carry text, `message_delta` the
  cumulative `output_tokens` and the stop reason, `message_stop` the end; no `[DONE]`.
- "sglang-generate": SGLang's native `/generate` (read from its source, http_server.py and
  tokenizer_manager.py): each `data:` event holds the sequence's text and `output_ids` so far (only the
  new ones under `--incremental-streaming-output`) and `meta_info` with the running `completion_tokens`,
  `prompt_tokens` and `finish_reason` (null until its last event), then `data: [DONE]`; a batch (a list
  of prompts, `n` > 1) interleaves its sequences' events, each with its `index`. Unstreamed: one object,
  or a list of them in the sequences' order for a batch. An error: `data: {"error": {"message": ...}}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from powerprof.errtext import error_text

from .limits import MAX_COUNT, MAX_MS, bad_amount, bad_count

APIS = ("llamacpp", "openai-completions", "openai-chat", "openai-responses", "anthropic-messages", "sglang-generate")

# A proxy feeds arbitrary traffic through this: keep what we hold bounded.
_MAX_ERRORS = 8
_MAX_PENDING_BYTES = 4 * 1024 * 1024

# What sends a chunk to the full JSON parse in count-only mode (StreamParser._quick_count): spaced
# (non-compact) JSON, and every key whose value the counting rules read beyond "one more token".
# `"index":` of another choice than the first (n > 1): its count is kept apart (_choice_count). In the one regex
# (one scan of the chunk, +50 ns) rather than a find of its own (+200 ns a token chunk).
_NEEDS_PARSE = re.compile(rb'": |"(?:error|timings|role|tool_calls|prompt_progress)"|"usage":\{|"logprobs":[{\[]|"index":(?!0[,}])')
_PREDICTED = re.compile(rb'"tokens_predicted":([^,}\]]*)')

# SGLang /generate's byte path (StreamParser._sglang_quick): the pieces of an event in its usual shape, compact (as
# SGLang's orjson writes it) or spaced as json.dumps writes it (the simulator). JSON whitespace only (not \f, \v).
_W = rb"[ \t\r\n]*"
_SG_INT = rb"(0|[1-9][0-9]{0,9})"  # a JSON integer of at most 10 digits (checked against MAX_COUNT after)
# Where a string's closing quote is followed by another member: the text ended before the separator found.
_SG_MEMBER_GAP = re.compile(rb'"' + _W + rb"," + _W + rb'"')
# After output_ids' `]`: an optional index, the meta_info object with no object, list or bracket in it (not even
# inside a string), an optional index, the end.
_SG_TAIL = re.compile(_W + rb"(?:," + _W + rb'"index"' + _W + rb":" + _W + _SG_INT + _W + rb")?," + _W
                      + rb'"meta_info"' + _W + rb":" + _W + rb"\{([^{}\[\]]*)\}" + _W + rb"(?:," + _W + rb'"index"'
                      + _W + rb":" + _W + _SG_INT + _W + rb")?\}" + _W)
# What follows a key of that flat meta_info: its integer value, or null, and the member's end.
_SG_INT_VALUE = re.compile(_W + rb":" + _W + _SG_INT + _W + rb"[,}]")
_SG_NULL_VALUE = re.compile(_W + rb":" + _W + rb"null" + _W + rb"[,}]")

# Anthropic /v1/messages' byte path (StreamParser._anthropic_quick): a text, thinking or tool-argument delta in the
# shape vLLM (compact) and the simulator (json.dumps) write, the delta's two members in either order: each is one
# token by the full parse's rule (`_typed`). Its string is a non-empty JSON string by JSON's grammar (raw bytes over
# 0x7f checked as UTF-8 apart): anything else (a bad escape, a raw control byte, an index with a leading zero) does
# not match and goes to the full parse, which drops it as unreadable.
_AN_STR = rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})+"'
_AN_DELTA = re.compile(
    rb'\{"type": ?"content_block_delta", ?"index": ?(?:0|[1-9][0-9]{0,9}), ?"delta": ?\{(?:'
    rb'"type": ?"[a-z_]{1,40}", ?"(?:text|thinking|partial_json)": ?' + _AN_STR + rb'|'
    rb'"(?:text|thinking|partial_json)": ?' + _AN_STR + rb', ?"type": ?"[a-z_]{1,40}")\}\}')
_AN_EVENT = b"event: content_block_delta\ndata: "
_AN_EVENT_LEN = len(_AN_EVENT)

# llama.cpp `timings` fields kept: counts, and durations (ms) or rates checked as amounts.
_TIMING_COUNTS = ("prompt_n", "predicted_n", "cache_n", "draft_n", "draft_n_accepted")
_TIMING_AMOUNTS = ("prompt_ms", "predicted_ms", "prompt_per_token_ms", "predicted_per_token_ms",
                   "prompt_per_second", "predicted_per_second")

# llama.cpp's stop_type words mapped onto OpenAI's finish_reason vocabulary.
_LLAMACPP_STOP = {"limit": "length", "eos": "stop", "word": "stop", "none": None}
# Anthropic's stop_reason and the Responses API's incomplete reason, in the same vocabulary.
_ANTHROPIC_STOP = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
_RESPONSES_INCOMPLETE = {"max_output_tokens": "length"}
# SGLang's finish_reason types that end a sequence in failure rather than at its stop or length.
_SGLANG_FAILED = ("abort",)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One event that carried generated tokens (several under batching or speculative decode)."""

    n_tokens: int
    text: str = ""
    # Cumulative count the server reported with this event (llama.cpp tokens_predicted, vLLM
    # continuous usage), when it did: lets a consumer check its own count.
    server_total: int | None = None
    # An OpenAI closing chunk (finish_reason, empty delta) that carried no counted token: its
    # arrival is kept because vLLM's closing chunk can hold the last token, which only the final
    # `usage` reveals (the client then places the missing token here).
    closing: bool = False


@dataclass(frozen=True)
class StreamSummary:
    """What one response said about itself once it ended (or was cut off)."""

    api: str
    counted_tokens: int  # sum of TokenEvent.n_tokens
    generated_tokens: int  # the server's own count where it gave one, else counted_tokens
    prompt_tokens: int | None
    token_source: str  # usage | timings | counted
    timings: dict  # llama.cpp `timings` as sent (prompt_n, predicted_ms, draft_n, ...)
    draft_n: int | None
    draft_n_accepted: int | None
    stop_reason: str | None  # length | stop | other server words; None when the stream never ended
    model: str | None
    complete: bool  # the server said the generation ended (stop / finish_reason)
    done: bool  # OpenAI `[DONE]` seen
    error: str | None  # first problems seen, joined; None when clean
    n_events: int  # token-bearing events
    n_comments: int  # SSE comment (keep-alive) lines
    invalid: str | None = None  # the first count or timing out of type/sign/range: the request failed
    # Lines and events that could not be read (malformed JSON, a line that is no SSE field, an event of a wrong shape,
    # one over the 4 MiB bound): any tokens they carried are not in counted_tokens. `error` names the first few.
    unreadable: int = 0
    # Of counted_tokens, those counted from what a chunk showed (one a chunk, or its logprobs' entries), not from a
    # count the server gave: a lower bound, confirmed only where the server's final count says the same.
    guessed_tokens: int = 0
    # Of counted_tokens, those in chunks that carried the server's own running count (llama.cpp
    # `tokens_predicted`, continuous usage): all of them, and the stream's count is the server's.
    totalled_tokens: int = 0
    # The first error the server itself sent in the response (an in-band `{"error": ...}` event, after
    # an HTTP 200): the generation failed, whatever its counts say.
    server_error: str | None = None
    # A whole answer of this many choices whose usage and timings are its first choice's alone (llama.cpp: one task
    # a choice), where the others' counts cannot be known (not every choice stopped at the length limit).
    first_choice_of: int | None = None
    # prompt_tokens sums each task's prompt (llama.cpp: a task per choice, each prefilling the prompt in its own slot);
    # False: each prompt said once for its choices (vLLM and SGLang compute it once, the other choices hitting the
    # prefix cache), or no prompt said. The two agree for one choice.
    prompt_each_task: bool = False
    # Of prompt_tokens, those the server said it found in its prefix cache (not computed again): llama.cpp's
    # timings.cache_n, OpenAI-style usage.prompt_tokens_details.cached_tokens (vLLM with
    # --enable-prompt-tokens-details, SGLang with --enable-cache-report), the Responses API's
    # input_tokens_details.cached_tokens, Anthropic's cache_read_input_tokens, SGLang /generate's
    # meta_info.cached_tokens (each prompt's first sequence's: the others of its n find it all cached). None: not said.
    cached_tokens: int | None = None
    # The count is running usage as of a choice's last chunk that carried one, its end said none, nor a final usage
    # after: SGLang's chat stream (continuous_usage_stats without include_usage) sends usage only on chunks with text,
    # so a last step whose text is empty (its end-of-text token, which it counts) is in no count: it may be low.
    count_open: bool = False
    # OpenAI: each choice's finish_reason by its index (n > 1, a list of prompts: stop_reason is only the last one's).
    choice_stops: dict = field(default_factory=dict)
    # The Responses API's answer's `id` (what a later turn names as its previous_response_id); None: not said.
    response_id: str | None = None
    # Of the Responses API's output tokens, its thinking's (usage.output_tokens_details.reasoning_tokens): vLLM does
    # not prefill them again for a later turn naming it. None: not said.
    reasoning_tokens: int | None = None
    # Of a Responses answer whose output holds an item other than messages and reasoning (a function call), the
    # characters of its messages' text: all of it a later turn naming it prefills again (vLLM's construct_input_messages
    # adds only the stored output's messages). None: its output is messages and reasoning alone, or not said.
    carried_chars: int | None = None

    @property
    def running_counts(self) -> bool:
        """Every chunk carried the server's running count: the stream's count is the server's own."""
        return 0 < self.counted_tokens == self.totalled_tokens


def _int(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


_JSON_DECODE = json.JSONDecoder().decode  # what json.loads runs on text, with no options


def json_from_bytes(b: bytes):
    """`json.loads(b)`, the same result and errors, without its per-call steps for the usual document: one
    that opens with `{` then a byte other than NUL, which json.loads' own detection takes as UTF-8 (the proxy
    parses a few per request)."""
    if b[:1] == b"{" and b[1:2] not in (b"", b"\x00"):
        return _JSON_DECODE(b.decode("utf-8", "surrogatepass"))
    return json.loads(b)


@dataclass
class _State:
    counted: int = 0
    guessed: int = 0  # of them, counted from what a chunk showed (one, or its logprobs): it said no count
    totalled: int = 0  # of them, in chunks that carried the server's running count
    n_events: int = 0
    n_comments: int = 0
    prompt_tokens: int | None = None
    usage_completion: int | None = None
    usage_prompt: int | None = None
    predicted_total: int | None = None  # llama.cpp tokens_predicted (cumulative; a batch's tasks' summed)
    # llama.cpp native /completion of a list of prompts: a task per prompt, its events marked with its `index`.
    task_predicted: dict = field(default_factory=dict)  # each task's tokens_predicted at its final event
    task_evaluated: dict = field(default_factory=dict)  # each task's prompt length (tokens_evaluated)
    timings: dict = field(default_factory=dict)
    stop_reason: str | None = None
    choice_stops: dict = field(default_factory=dict)  # OpenAI: each choice's finish_reason by its index
    model: str | None = None
    complete: bool = False
    finished_any: bool = False  # some choice carried a finish_reason
    unfinished: set = field(default_factory=set)  # choice indexes seen without their finish_reason yet
    other_choices: dict = field(default_factory=dict)  # tokens counted per choice index other than 0 (n > 1)
    echoed: set = field(default_factory=set)  # echo: the choices whose first chunk (the prompt's echo) has come
    # Several choices (n > 1, a list of prompts), where a server reports per choice rather than for the stream:
    # llama.cpp runs a task per choice and each task sends its own `timings` (and `usage`) once, when it ends;
    # vLLM/SGLang continuous usage is each choice's running count. Keyed by choice index (or "#k" for a task's
    # usage chunk without choices); the stream's figures are their sums (_merge_usage, _merged_timings).
    task_usage: dict = field(default_factory=dict)  # llama.cpp: (completion, prompt) per task, sent with its timings
    choice_usage: dict = field(default_factory=dict)  # vLLM/SGLang: (completion, prompt) running, per choice
    final_usage: tuple | None = None  # a usage for the whole stream (a chunk without choices, no timings)
    task_timings: dict = field(default_factory=dict)  # llama.cpp: each task's timings
    n_bare: int = 0  # chunks without choices that carried usage or timings (keys "#1", "#2", ...)
    first_choice_of: int | None = None  # a whole answer's count is its first choice's alone, of this many
    scaled_tasks: bool = False  # a whole llama.cpp answer's first task's usage scaled to its choices (_one_task_answer)
    # Responses: each Response's id in the order first seen (its task index) and those not yet ended. llama-server runs
    # n_cmpl (else n) tasks on /v1/responses, each its own Response: streamed interleaved, whole a JSON array of them.
    resp_index: dict = field(default_factory=dict)
    resp_open: set = field(default_factory=set)
    resp_usage: dict = field(default_factory=dict)  # task index: its usage object, as said at its end
    # Chunks that carried a tool call and a running count past the stream's usual step (more than twice `max_step`,
    # and more than 2): the server's tool-call parser held those tokens' text (SGLang's deepseekv3 sends a call whole
    # once it closes), no hop between.
    tool_call_jumps: int = 0
    # The largest step of the running count over the chunks that made no such jump (a stream's first counted chunk,
    # with none before it, is never one). Any tool-call chunk of 2 or more tokens counted as a jump: a call streamed 2 tokens a chunk (speculative decoding) behind a buffering nginx read
    # "the server's tool-call parser held a call ... nothing to fix", its warning suppressed, where nginx buffered.
    max_step: int = 0
    done: bool = False
    errors: list = field(default_factory=list)
    unreadable: int = 0  # lines and events that could not be read (StreamSummary.unreadable)
    server_error: str | None = None  # the first error the server itself sent in the response
    invalid: str | None = None
    # SGLang /generate, per sequence (its `index`): tokens counted, its last completion_tokens, its prompt_tokens.
    seq_tokens: dict = field(default_factory=dict)
    seq_reported: dict = field(default_factory=dict)
    seq_prompt: dict = field(default_factory=dict)
    seq_cached: dict = field(default_factory=dict)  # its meta_info.cached_tokens (read where parsed whole: its last event)
    usage_cached: dict = field(default_factory=dict)  # OpenAI-style: prompt_tokens_details.cached_tokens per usage key
    typed_cached: int | None = None  # Anthropic's cache_read_input_tokens, the Responses API's cached_tokens
    ids_incremental: bool = False  # its output_ids are each event's new ones (--incremental-streaming-output)
    unclosed: set = field(default_factory=set)  # choices whose running counts ended before a closing chunk without one
    response_id: str | None = None  # the Responses API's answer's `id`
    usage_reasoning: int | None = None  # its usage.output_tokens_details.reasoning_tokens
    carried_chars: int | None = None  # StreamSummary.carried_chars


_BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark, U+FEFF

class StreamParser:
    """Parses one streamed (SSE) response incrementally. `feed(bytes)` → events; `finish()` → summary."""

    def __init__(self, api: str, count_only: bool = False, echo: bool = False, choices: int = 1, sequences: int = 1,
                 echo_chars: int = 0, max_tokens: int | None = None):
        """count_only: the caller needs counts, not text (the daemon's proxy). Plain token chunks
        are then counted from their bytes (`_quick_count`) and not parsed as JSON; their events
        carry no text. The first event and every one with usage, finish_reason, timings, stop,
        logprobs or an error are still parsed whole, so the summary is the same.
        echo: the request asked /v1/completions to echo its prompt (vLLM: each choice's first chunk is
        the prompt's text then its first token's, its logprobs the prompt's tokens then that token's):
        that chunk stands for the one token the prompt's step generated, not for the tokens its logprobs
        list (a chunk without logprobs is one token anyway, so the fast path is unchanged).
        choices, sequences: SGLang /generate's `n` and its sequences in all (prompts × n), whose `index` is
        prompt × n + choice: each prompt's length is said by each of its n sequences and counted once.
        max_tokens: the request's limit for each choice (max_completion_tokens or max_tokens), where it set one: a
        choice that closes at `length` in a chunk showing no token, one short of it, generated its last token there."""
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; choose one of: {', '.join(APIS)}")
        self.api = api
        self._buf = b""
        # The stream's first bytes until they can be told from a UTF-8 BOM (None after): the SSE spec strips one at the
        # stream's start; read as a field name, it lost the first event (its first token) and blamed an unreadable line.
        self._bom: bytes | None = b""
        self._pending: list[bytes] = []  # data lines of an event not yet dispatched
        self._pending_bytes = 0  # their size: bounded by _MAX_PENDING_BYTES, as a line is
        # The previous chunk ended in a CR: a LF opening this one is the same line end (CRLF cut between reads).
        self._after_cr = False
        self._s = _State()
        self._llamacpp_api = api == "llamacpp"
        self._typed_api = api in ("openai-responses", "anthropic-messages")  # events named by their `type`
        self._sglang_api = api == "sglang-generate"
        # Typed events are never read from their bytes. SGLang's are, their own way (_sglang_quick).
        self._quick = self._count_only_quick = count_only and not self._typed_api
        # Anthropic's text deltas are, their own way (_anthropic_quick); the Responses API's are parsed whole.
        self._an_quick = count_only and api == "anthropic-messages"
        self._choices = max(int(choices), 1)
        self._prompts = max(int(sequences), 1) // self._choices  # prompts whose length the request's figure sums
        self._parsed_one = False
        self._echo = echo and api == "openai-completions"
        # vLLM's chat `echo` (the last message's content, where its role is the answer's: `echo_chars` characters)
        # comes as each choice's own chunk after its role chunk, no token (usage does not count it); read whole until
        # every choice has had it. A server that ignores `echo` sends no such chunk: a first chunk of another length is
        # a token.
        self._chat_echo = echo_chars if api == "openai-chat" and echo_chars > 0 else 0
        if self._chat_echo:
            self._quick = False
        self._max_tokens = max_tokens if type(max_tokens) is int and max_tokens > 0 else None

    @property
    def tool_call_jumps(self) -> int:
        """Chunks so far that carried a tool call and several tokens by the running count (_State.tool_call_jumps)."""
        return self._s.tool_call_jumps

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length as soon as the stream has said it (vLLM/SGLang continuous usage
        carries it in every chunk; others only at the end)."""
        s = self._s
        if self._sglang_api and len({i // self._choices for i in s.seq_prompt}) < self._prompts:
            return None  # a batch: not every prompt's length said yet
        if (s.final_usage is None and s.first_choice_of is None and (s.task_usage or s.task_timings)
                and len(s.task_usage.keys() | s.task_timings.keys()) < self._prompts * self._choices):
            return None  # llama.cpp's tasks each say theirs at their own end: a stream cut before the last has no sum
        return s.usage_prompt if s.usage_prompt is not None else s.prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Of `prompt_tokens` as said so far, the part the server said it found in its prefix cache, as early as it
        says it (SGLang /generate repeats meta_info.cached_tokens on every event; continuous usage its
        prompt_tokens_details); None until then, or where it never does."""
        p = self.prompt_tokens
        return self._cached_tokens(p) if p is not None else None

    @property
    def prompt_each_task(self) -> bool:
        """The prompt figure (`prompt_tokens`) sums each task's (llama.cpp's timings or per-task usage, a whole
        answer's first task's scaled to its choices), not each prompt said once for its choices (a usage for the
        whole stream, continuous usage, or a whole llama.cpp answer's first task's alone: `first_choice_of`)."""
        s = self._s
        if s.first_choice_of is not None:
            return False
        if s.usage_prompt is not None:
            return s.scaled_tasks if s.final_usage is not None else bool(s.task_usage)
        return s.prompt_tokens is not None

    @property
    def ended(self) -> bool:
        """Nothing more is expected: llama.cpp's stop event, OpenAI's `[DONE]`, the Responses API's
        `response.completed` (or incomplete, failed), Anthropic's `message_stop`."""
        return self._s.done or (self.api not in ("openai-chat", "openai-completions", "sglang-generate")
                                and self._s.complete)

    # --- framing -------------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> list[TokenEvent]:
        out: list[TokenEvent] = []
        if not chunk:
            return out
        if self._bom is not None:
            chunk = self._bom + chunk
            if len(chunk) < 3 and _BOM.startswith(chunk):
                self._bom = chunk  # a BOM's first bytes, or a stream that short: wait for more
                return out
            self._bom = None
            if chunk[:3] == _BOM:
                chunk = chunk[3:]
                if not chunk:
                    return out
        if self._after_cr or b"\r" in chunk:
            chunk = self._lf_lines(chunk)
            if not chunk:
                return out
        if b"\n" not in chunk:
            self._buf += chunk
            if len(self._buf) > _MAX_PENDING_BYTES:
                self._unreadable("event larger than 4 MiB without a line end; dropped")
                self._buf = b""
            return out
        data = self._buf + chunk if self._buf else chunk
        head, _, self._buf = data.rpartition(b"\n")
        for line in head.split(b"\n"):  # no CR left in it (_lf_lines): each line is whole
            if not line:
                if self._pending:
                    self._dispatch(b"\n".join(self._pending), out)
                    self._pending, self._pending_bytes = [], 0
                continue
            if line[:1] == b":":
                self._s.n_comments += 1
                continue
            name, _, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                if self._pending:
                    self._pend(value)
                    continue
                # Servers put one JSON document on one line: dispatch it at once rather than
                # waiting for the blank line, so a token's arrival is the moment its line
                # arrived. A document split over several data lines waits for the blank line.
                if value == b"[DONE]" or _looks_whole(value):
                    self._dispatch(value, out)
                else:
                    self._pend(value)
            elif name == b"error":
                msg = value[:200].decode("utf-8", "replace")
                self._error(f"server error event: {msg}")
                if self._s.server_error is None:
                    self._s.server_error = msg
            elif name in (b"event", b"id", b"retry"):
                continue
            elif name[:1] in (b"{", b"["):
                # Not SSE at all: a plain JSON body (an error answer to a streaming request).
                self._dispatch(line, out)
            else:
                self._unreadable(f"unexpected line in stream: {line[:80].decode('utf-8', 'replace')!r}")
        return out

    def _lf_lines(self, chunk: bytes) -> bytes:
        """`chunk` with its line ends as LF: SSE ends a line with CRLF, LF or a lone CR, and a stream of lone CRs
        was read as one line, buffered to the 4 MiB bound and dropped (every token of it uncounted). A CR that ends
        the chunk may be the first half of a CRLF: a LF opening the next chunk is then skipped. Raw CRs cannot be in
        a JSON document (strings escape them), so none is taken out of one."""
        if self._after_cr and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._after_cr = chunk[-1:] == b"\r"
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _pend(self, value: bytes) -> None:
        """One more data line of an event spread over several: held to the same 4 MiB bound as a line. Before, a
        server that never ended the event (no blank line) grew this list without bound (400 MB of data lines took
        1.6 GB resident in the proxy)."""
        self._pending_bytes += len(value) + 1
        if self._pending_bytes > _MAX_PENDING_BYTES:
            self._unreadable("event larger than 4 MiB; dropped")
            self._pending, self._pending_bytes = [], 0
            return
        self._pending.append(value)

    def count(self, chunk: bytes) -> int:
        """Tokens in `chunk`, the same as `sum(e.n_tokens for e in feed(chunk))`. In count-only mode a
        chunk that is exactly one compact `data: {...}` event, with nothing buffered before it (how
        servers write a token), is counted without building the event."""
        if self._bom is not None:  # the stream's first bytes: `feed` looks for its BOM
            return sum(e.n_tokens for e in self.feed(chunk))
        if (self._an_quick and chunk[:_AN_EVENT_LEN] == _AN_EVENT and chunk[-2:] == b"\n\n" and not self._buf
                and not self._pending and not self._after_cr):
            n = self._anthropic_quick(chunk[_AN_EVENT_LEN:-2], None)
            if n is not None:
                return n
        if (self._quick and self._parsed_one and not self._buf and not self._pending and not self._after_cr
                and chunk[:7] == b"data: {" and chunk[-3:] == b"}\n\n"):
            if chunk.count(b"\n") != 2:
                return self._count_events(chunk)
            if self._sglang_api:
                n = self._sglang_quick(chunk[6:-2], None)
                if n is not None:
                    return n
            else:
                n = self._quick_count(chunk[6:-2])
                if n is not None:
                    return n if n > 0 and self._counted(n) else 0
        return sum(e.n_tokens for e in self.feed(chunk))

    def _count_events(self, chunk: bytes) -> int:
        """A chunk of several events (a read that caught up with more than one token): each whole plain
        `data: {...}` event counted from its bytes, as `count` counts one; from the first that is not,
        the rest goes through `feed` (nothing is buffered at an event's end, so the sum is feed's)."""
        total, pos, size = 0, 0, len(chunk)
        while pos < size:
            end = chunk.find(b"\n\n", pos)
            event = chunk[pos:end]
            if end < 0 or event[:7] != b"data: {" or event[-1:] != b"}" or b"\n" in event:
                break
            if self._sglang_api:
                n = self._sglang_quick(event[6:], None)
                if n is None:
                    break
                total += n
            else:
                n = self._quick_count(event[6:])
                if n is None:
                    break
                if n > 0 and self._counted(n):
                    total += n
            pos = end + 2
        if pos < size:
            total += sum(e.n_tokens for e in self.feed(chunk[pos:]))
        return total

    def finish(self) -> StreamSummary:
        """End of the byte stream. Flushes what is buffered and summarises."""
        out: list[TokenEvent] = []
        tail = self._buf.strip()
        self._buf = b""
        if tail:
            if tail.startswith(b"data:"):
                self._pending.append(tail[5:].lstrip())
            elif tail[:1] in (b"{", b"["):
                self._pending.append(tail)
        if self._pending:
            self._dispatch(b"\n".join(self._pending), out)
            self._pending, self._pending_bytes = [], 0
        return self._summary()

    def retask(self, choices: int, sequences: int) -> StreamSummary:
        """The finished stream's summary again, read as `choices` a prompt of `sequences` in all (as the constructor's):
        a caller that learnt from the stream which its server ran (the daemon's `n_cmpl`) sums each prompt's length
        over the tasks that ran, not those it first expected (2 for `n: 2` where llama-server ran `n_cmpl: 1`'s one,
        its prompt's length said by it unsummed)."""
        self._choices = max(int(choices), 1)
        self._prompts = max(int(sequences), 1) // self._choices
        return self._summary()

    # --- payloads ------------------------------------------------------------------------------

    def _handle(self, obj: dict, out: list[TokenEvent]) -> None:
        # Chosen per call, not kept as a bound method on the instance: that would make every parser a
        # reference cycle, freed only by the garbage collector (the proxy makes one per request).
        if self._llamacpp_api:
            self._llamacpp(obj, out)
        elif self._sglang_api:
            self._sglang(obj, out)
        elif self._typed_api:
            self._typed(obj, out)
        else:
            self._openai(obj, out)

    def _dispatch(self, payload: bytes, out: list[TokenEvent]) -> None:
        if payload == b"[DONE]":
            self._s.done = True
            return
        if self._an_quick and self._anthropic_quick(payload, out) is not None:
            return
        if self._quick and self._parsed_one:
            if self._sglang_api:
                if self._sglang_quick(payload, out) is not None:
                    return
            else:
                n = self._quick_count(payload)
                if n is not None:
                    if n > 0:
                        self._add(n, out, "", None)
                    return
        self._parsed_one = True
        try:
            obj = json_from_bytes(payload)
        except (ValueError, UnicodeDecodeError):
            self._unreadable(f"malformed JSON in stream: {payload[:80].decode('utf-8', 'replace')!r}")
            return
        if obj is None:
            return  # `data: null`: llama-server opens a stream of several tasks (a list of prompts) with it
        if not isinstance(obj, dict):
            self._unreadable("stream event is not a JSON object")
            return
        try:
            self._handle(obj, out)
        except Exception as e:  # never raise on garbage: a proxy forwards these bytes
            self._unreadable(f"unexpected event shape: {error_text(e)}")

    def _quick_count(self, v: bytes) -> int | None:
        """Tokens in a plain token chunk, read from its bytes; None when the chunk needs the full
        parse. Only compact JSON (as llama.cpp, vLLM and SGLang write it) of the commonest shapes
        qualifies, and only where the full parse's rule is plain: llama.cpp `len(tokens)` of an
        event with `"stop":false`; OpenAI one token for one choice with a non-empty text or content,
        `"finish_reason":null`, no `"index"` but 0 and no usage, logprobs, timings, role or tool calls. The quoted keys
        cannot match inside a string value: quotes there are escaped. tests/test_stream_parser.py
        checks that both paths agree on every shape."""
        if _NEEDS_PARSE.search(v) is not None or (self._s.model is None and b'"model"' in v):
            return None
        if self.api == "llamacpp":
            i = v.find(b'"tokens":[')
            if i < 0 or b'"stop":false' not in v or (self._prompts * self._choices > 1 and b'"index":0' not in v):
                return None  # a batch's event marked with no index is the full parse's to flag
            # The full parse checks tokens_predicted (a count in range): anything but plain digits
            # in range goes there, so an invalid value is recorded the same way.
            m = _PREDICTED.search(v)
            if m is not None and not (m.group(1).isdigit() and len(m.group(1)) <= 10 and int(m.group(1)) <= MAX_COUNT):
                return None
            j = v.find(b"]", i + 10)
            seg = v[i + 10 : j].strip() if j > 0 else None
            if seg is None or b"[" in seg:
                return None
            n = seg.count(b",") + 1 if seg else 0
            if m is None:
                return n
            n = max(n, int(m.group(1)) - self._choice_count(0))  # the full parse's rule (_llamacpp): task 0's
            if n > 0:
                self._s.totalled += n
            return n
        if v.count(b'"finish_reason":null') != 1:
            return None
        key = b'"content":"' if self.api == "openai-chat" else b'"text":"'
        i = v.find(key)
        if i < 0 or v[i + len(key) : i + len(key) + 1] == b'"' or v.find(key, i + 1) >= 0:
            return None
        self._s.guessed += 1  # the full parse's rule: a content chunk without counts is one token
        return 1

    def _sglang_quick(self, v: bytes, out: list[TokenEvent] | None) -> int | None:
        """Tokens of an SGLang /generate event that has not ended, read from its bytes and counted by the full
        parse's own rule (`_sglang_step`); None when the event needs the full parse. Each event repeats its
        sequence's text and output_ids so far: parsed whole, its cost grows with the answer (quadratic over it).
        Only the usual shape qualifies: `{"text":…,"output_ids":[…],"meta_info":{…}}`, an `"index"` before or
        after meta_info and nothing else, compact (SGLang's orjson) or spaced as json.dumps writes it (the
        simulator); a meta_info with no object, list or backslash in it (logprobs: parsed whole), an integer
        `completion_tokens`, `finish_reason` null or absent (a sequence's last event is parsed whole) and
        `prompt_tokens` an integer or absent. The text is not read: it ends at the first `","output_ids":[` (a
        quote inside it is escaped, so no separator lies within it) unless a string closes before that one.
        output_ids' length is its commas plus one (no string in it). The bytes are taken to be JSON, as servers
        write it: an event that is not may be counted here where the full parse drops it (and counts its tokens
        at the next event, whose running count includes them). tests/test_stream_parser.py holds both paths
        equal over generated streams of every shape."""
        if v.startswith(b'{"text":"'):
            start, sep = 9, b'","output_ids":['
        elif v.startswith(b'{"text": "'):
            start, sep = 10, b'", "output_ids": ['
        else:
            return None
        e = v.find(sep, start)
        if e < 0 or (v.find(b'"', start, e) >= 0 and _SG_MEMBER_GAP.search(v, start, e) is not None):
            return None
        i = e + len(sep)
        j = v.find(b"]", i)
        if j < 0 or v.find(b'"', i, j) >= 0:  # (a list or object in it leaves a tail that is not meta_info's)
            return None
        k = v.count(b",", i, j)
        k = k + 1 if k or v[i:j].strip() else 0
        m = _SG_TAIL.fullmatch(v, j + 1)
        if m is None:
            return None
        a, b = m.span(2)
        # Every quote in meta_info is a string's end (no backslash in it: nor a key spelt with an escape,
        # "completion\u005ftokens", the same key to json.loads), so a key's bytes followed by `:` are that key.
        if v.find(b"\\", a, b) >= 0:
            return None
        q = v.find(b'"completion_tokens"', a, b)
        if q < 0 or v.find(b'"completion_tokens"', q + 19, b) >= 0:
            return None
        mc = _SG_INT_VALUE.match(v, q + 19, b + 1)
        q = v.find(b'"finish_reason"', a, b)
        if mc is None or (q >= 0 and (v.find(b'"finish_reason"', q + 15, b) >= 0
                                     or _SG_NULL_VALUE.match(v, q + 15, b + 1) is None)):
            return None
        c = int(mc.group(1))
        p = None
        q = v.find(b'"prompt_tokens"', a, b)
        if q >= 0:
            mp = _SG_INT_VALUE.match(v, q + 15, b + 1) if v.find(b'"prompt_tokens"', q + 15, b) < 0 else None
            if mp is None:
                return None
            p = int(mp.group(1))
            if p > MAX_COUNT:
                return None
        idx = m.group(3) or m.group(1)  # the last said, as json.loads keeps a key said twice
        idx = int(idx) if idx is not None else 0
        if c > MAX_COUNT or idx > MAX_COUNT:
            return None
        cached = None
        # Read as the full parse reads it: the cached count is said early with the prompt (ledger). SGLang repeats
        # the same count on every event once it prefilled: read until seen (+11% a chunk, read on every event).
        q = v.find(b'"cached_tokens"', a, b) if idx not in self._s.seq_cached else -1
        if q >= 0:
            mk = _SG_INT_VALUE.match(v, q + 15, b + 1) if v.find(b'"cached_tokens"', q + 15, b) < 0 else None
            if mk is None:
                return None
            cached = int(mk.group(1))
            if cached > MAX_COUNT:
                return None
        if cached is not None:
            self._s.seq_cached[idx] = cached
        return self._sglang_step(idx, c, p, k, None, True, out)

    def _anthropic_quick(self, v: bytes, out: list[TokenEvent] | None) -> int | None:
        """Tokens of an Anthropic content_block_delta read from its bytes (`_AN_DELTA`: one, by `_typed`'s rule); None
        when the event needs the full parse. Parsed whole, a delta cost the proxy ~2x what a chat chunk read from its
        bytes costs. Strict where the other byte paths take the bytes as JSON: the string matches JSON's grammar and,
        beyond ASCII, decodes as json_from_bytes decodes it, so an event the full parse drops is never counted here.
        tests/test_stream_parser.py holds both paths equal over generated streams."""
        if _AN_DELTA.fullmatch(v) is None:
            return None
        if not v.isascii():
            try:
                v.decode("utf-8", "surrogatepass")
            except UnicodeDecodeError:
                return None
        self._s.guessed += 1  # as _typed: a delta without counts is one token
        if not self._counted(1):
            return 0
        if out is not None:
            out.append(TokenEvent(1, "", None))
        return 1

    def _error(self, msg: str) -> None:
        if len(self._s.errors) < _MAX_ERRORS:
            self._s.errors.append(msg)

    def _unreadable(self, msg: str) -> None:
        """A line or event that could not be read: counted (its tokens, if any, are not), and named."""
        self._s.unreadable += 1
        self._error(msg)

    def _invalid(self, what: str, why: str) -> None:
        msg = f"server sent an invalid {what}: {why}"
        if self._s.invalid is None:
            self._s.invalid = msg
        self._error(msg)

    def _count(self, d: dict, key: str) -> int | None:
        """d[key] as a token count; None when absent (or null), or invalid (recorded)."""
        v = d.get(key)
        if v is None:
            return None
        why = bad_count(v)
        if why is not None:
            self._invalid(key, why)
            return None
        return int(v)

    def _server_error(self, obj: dict) -> bool:
        err = obj.get("error")
        if err is None:
            return False
        if isinstance(err, dict):
            msg = str(err.get("message") or json.dumps(err))[:200]
        else:
            msg = str(err)[:200]
        self._error(f"server error: {msg}")
        if self._s.server_error is None:
            self._s.server_error = msg
        return True

    def _timings(self, t, key=0) -> bool:
        """Keeps a llama.cpp `timings` object (checked) as task `key`'s; False when it is not one."""
        if not isinstance(t, dict):
            return False
        kept: dict = {}
        for k in _TIMING_COUNTS:
            n = self._count(t, k)
            if n is not None:
                kept[k] = n
        for k in _TIMING_AMOUNTS:
            v = t.get(k)
            if v is None:
                continue
            why = bad_amount(v, MAX_MS)
            if why is not None:
                self._invalid(f"timings.{k}", why)
            else:
                kept[k] = float(v)
        s = self._s
        s.task_timings[key] = kept
        s.timings = kept if len(s.task_timings) == 1 else _merged_timings(s.task_timings.values())
        if "prompt_n" in s.timings:
            # The whole prompt, as usage's prompt_tokens says it: prompt_n is only the part not found in the cache.
            s.prompt_tokens = s.timings["prompt_n"] + s.timings.get("cache_n", 0)
        return True

    def _add(self, n: int, out: list[TokenEvent], text: str, total: int | None) -> None:
        if self._counted(n):
            out.append(TokenEvent(n, text, total))

    def _counted(self, n: int) -> bool:
        """Adds one event's n tokens to the stream's count; False (and the stream invalid) past MAX_COUNT."""
        s = self._s
        if s.counted + n > MAX_COUNT:
            self._invalid("token count", f"the stream's total passes {MAX_COUNT}")
            return False
        s.counted += n
        s.n_events += 1
        return True

    def _llamacpp(self, obj: dict, out: list[TokenEvent]) -> None:
        s = self._s
        if self._server_error(obj):
            return
        if isinstance(obj.get("model"), str):
            s.model = obj["model"]
        if "prompt_progress" in obj:
            # `return_progress`: how far the prompt is, no token (`tokens: [0]`, `tokens_predicted: 0`): counted, it was a
            # token each and the first token's time was the prompt's start. Its total is the prompt's length.
            pp = obj["prompt_progress"]
            total = self._count(pp, "total") if isinstance(pp, dict) else None
            if total is not None:
                s.prompt_tokens = total
            return
        content = obj.get("content")
        content = content if isinstance(content, str) else ""
        tokens = obj.get("tokens")
        predicted = self._count(obj, "tokens_predicted")
        # A list of prompts, or n_cmpl (`n`) choices, runs a task per prompt and choice, each event marked with its
        # task's `index`, prompt × n_cmpl + choice (server-context.cpp, handle_completions_impl): counts, prompt
        # lengths and ends are each task's own, the stream's their sums.
        tasks = self._prompts * self._choices
        idx = obj.get("index")
        if idx is None and tasks == 1:
            idx = 0  # older builds mark no index: one task
        elif type(idx) is not int or not 0 <= idx < tasks:
            # Not one of the request's tasks: folded into task 0, a batch's count was a fraction of its work, unflagged
            # (an index 2 sent as 7: 18 generated of 27; no index at all: 9). Its tokens are in no task's count; said once.
            if s.invalid is None:
                self._invalid("event index", f"{idx!r} is not one of the request's {tasks} tasks (prompts × n_cmpl)")
            return
        ev = self._count(obj, "tokens_evaluated")
        if ev is not None and idx not in s.task_evaluated:
            # Every token event carries its prompt's length: a stream cut before its end still says it, once every
            # task of the batch has said its own.
            s.task_evaluated[idx] = ev
            if len(s.task_evaluated) >= tasks:
                s.prompt_tokens = sum(s.task_evaluated.values())
        done_before = self._choice_count(idx)
        if isinstance(tokens, list):
            n = len(tokens)
            if predicted is not None and obj.get("stop") is not True:
                # llama-server holds back the tokens of an unfinished UTF-8 character and sends them
                # with the next event, whose `tokens` lists only the newest one: its running count
                # says how many arrived (seen on b11434: tokens [175], tokens_predicted 5 → 8). Not on
                # the stop event: tokens counted there were never streamed (and a lie would hide).
                n = max(n, predicted - done_before)
        elif predicted is not None:
            # Older builds send no `tokens`: the cumulative count tells how many this event holds.
            n = max(0, predicted - done_before)
        else:
            n = 1 if content else 0
        if obj.get("stop") is True:
            st = obj.get("stop_type")
            s.stop_reason = _LLAMACPP_STOP.get(st, st) if isinstance(st, str) else "stop"
            if obj.get("stopped_limit") is True and s.stop_reason is None:
                s.stop_reason = "length"
            if predicted is not None:
                s.task_predicted[idx] = predicted
            else:
                s.task_predicted.setdefault(idx, None)
            # The server's count of all only while every task ended has said its own (a None summed was a TypeError).
            told = s.task_predicted.values()
            s.predicted_total = None if None in told else sum(told)
            s.complete = len(s.task_predicted) >= tasks
            self._timings(obj.get("timings"), idx)
        if n > 0:
            if predicted is not None and self._counted(n):
                s.totalled += n
                if idx:
                    s.other_choices[idx] = s.other_choices.get(idx, 0) + n
                out.append(TokenEvent(n, content, predicted))
            elif predicted is None:
                if idx and self._counted(n):
                    s.other_choices[idx] = s.other_choices.get(idx, 0) + n
                    out.append(TokenEvent(n, content, None))
                elif not idx:
                    self._add(n, out, content, predicted)

    def _sglang(self, obj: dict, out: list[TokenEvent] | None, index: int | None = None) -> None:
        """One event (or whole answer) of SGLang's /generate: a sequence's tokens are the growth of its running
        `completion_tokens` (several an event under `--stream-interval` or speculative decoding). Its last event's
        count is the server's final claim, as usage is: the tokens that event carries are read from its `output_ids`
        instead, so a final count that contradicts what the sequence listed shows (arrival.count_problem).
        `index`: a whole batch answer's place in its list (its sequences' order), where the object says none."""
        if self._server_error(obj):
            return
        mi = obj.get("meta_info")
        if not isinstance(mi, dict):
            self._error("SGLang event without meta_info")
            return
        idx = index if index is not None else obj.get("index")
        idx = idx if type(idx) is int and 0 <= idx <= MAX_COUNT else 0
        c = self._count(mi, "completion_tokens")
        p = self._count(mi, "prompt_tokens")
        if "cached_tokens" in mi:
            k = self._count(mi, "cached_tokens")
            if k is not None:
                self._s.seq_cached[idx] = k
        ids = obj.get("output_ids")
        fr = mi.get("finish_reason")
        if isinstance(obj.get("model"), str):
            self._s.model = obj["model"]
        self._sglang_step(idx, c, p, len(ids) if isinstance(ids, list) else None,
                          fr if isinstance(fr, (dict, str)) and fr else None, bool(obj.get("text")), out)

    def _sglang_step(self, idx: int, c: int | None, p: int | None, k: int | None, fr, has_text: bool,
                     out: list[TokenEvent] | None) -> int:
        """What one /generate event says, applied (the full parse's and the byte path's one rule): sequence `idx`,
        its running count `c`, prompt `p`, `k` output_ids listed, `fr` its finish_reason (None until it ends),
        `has_text` a non-empty text. Returns the tokens counted; `out` (unless None) gets their event."""
        s = self._s
        if p is not None and s.seq_prompt.get(idx) != p:
            s.seq_prompt[idx] = p
            groups: dict = {}
            for i, v in s.seq_prompt.items():  # each prompt said by its n sequences: counted once
                groups[i // self._choices] = max(groups.get(i // self._choices, 0), v)
            s.usage_prompt = sum(groups.values())
        prev = s.seq_tokens.get(idx, 0)
        totalled = True
        if fr is not None:
            if k is not None and not s.ids_incremental and k != c and (k < prev or (c is not None and k == c - prev)):
                s.ids_incremental = True  # (cumulative ids never shrink: a short list is the event's new ones)
            if k is not None:
                n = k if s.ids_incremental else k - prev
            elif c is not None:
                n = c - prev
            else:
                n, totalled = (1 if has_text else 0), False
        elif c is not None:
            if k is not None and k != c and k == c - prev:
                s.ids_incremental = True  # output_ids only the event's new ones
            n = c - prev
        else:
            n, totalled = (1 if has_text else 0), False  # no count: one token an event, a guess
        if c is not None:
            old = s.seq_reported.get(idx)
            s.seq_reported[idx] = c
            # The sequences' counts summed (kept by difference: a batch's many sequences are not re-summed per event).
            s.usage_completion = s.usage_completion + c - old if old is not None else sum(s.seq_reported.values())
        if fr is not None:
            kind = fr.get("type") if isinstance(fr, dict) else fr
            kind = kind if isinstance(kind, str) else "stop"
            if kind in _SGLANG_FAILED:
                msg = fr.get("message") if isinstance(fr, dict) else None
                self._server_error({"error": f"sequence {idx} {kind}ed" + (f": {msg}" if msg else "")})
            s.stop_reason = kind
            s.unfinished.discard(idx)
            s.finished_any = True
        else:
            s.unfinished.add(idx)
        s.complete = s.finished_any and not s.unfinished
        if n > 0 and self._counted(n):
            s.seq_tokens[idx] = prev + n
            if totalled:
                s.totalled += n
            else:
                s.guessed += n
            if out is not None:
                out.append(TokenEvent(n, "", c))
            return n
        return 0

    def _typed(self, obj: dict, out: list[TokenEvent]) -> None:
        """The Responses API's and Anthropic's Messages API's events, told apart by their `type`. A text,
        reasoning or tool-argument delta stands for one token (as an OpenAI chunk without counts does);
        the final usage gives the server's count, which the summary prefers."""
        s = self._s
        kind = obj.get("type")
        if not isinstance(kind, str):
            self._server_error(obj)
            return
        if self.api == "openai-responses" and kind in ("response.completed", "response.incomplete") \
                and isinstance(obj.get("response"), dict) and isinstance(obj["response"].get("status"), str):
            # vLLM's stream ends every Response with response.completed, whatever its status (responses/serving.py @
            # 4d89a999 responses_stream_generator; its harmony path says cancelled on abort): the status says how it
            # ended, read as a whole Response's is.
            kind = _responses_end_kind(obj["response"]["status"])
        if kind == "error" or kind == "response.failed" or kind == "response.error":
            # Anthropic: {"type":"error","error":{...}}; Responses: {"type":"error","message":...} or
            # response.failed with response.error.
            resp = obj.get("response") if isinstance(obj.get("response"), dict) else {}
            err = obj.get("error") or resp.get("error") or obj.get("message") or kind
            self._server_error({"error": err})
            if kind == "response.failed":
                self._typed_usage(resp.get("usage"), "output_tokens", "input_tokens")
            return
        if self.api == "openai-responses":
            resp = obj.get("response")
            if isinstance(resp, dict) and isinstance(resp.get("model"), str):
                s.model = resp["model"]
            if isinstance(resp, dict) and isinstance(resp.get("id"), str):
                s.response_id = resp["id"][:256]  # bounded: a key the ledger keeps (Ledger.response_context)
                if s.response_id not in s.resp_index and len(s.resp_index) < _MAX_RESPONSES:
                    s.resp_index[s.response_id] = len(s.resp_index)
                    s.resp_open.add(s.response_id)
            if kind.endswith(".delta"):
                # response.output_text.delta, response.reasoning_text.delta, response.refusal.delta,
                # response.function_call_arguments.delta, ...: one token a delta (logprobs, where
                # sent, list each token of it).
                v = obj.get("delta")
                lp = obj.get("logprobs")
                n = len(lp) if isinstance(lp, list) and lp else (1 if isinstance(v, str) and v else 0)
                if n:
                    s.guessed += n  # its logprobs too: the tokens it showed, not the server's count
                    self._add(n, out, v if isinstance(v, str) else "", None)
            elif kind in ("response.completed", "response.incomplete") and isinstance(resp, dict):
                s.complete = True
                if kind == "response.completed":
                    s.stop_reason = "stop"
                else:
                    det = resp.get("incomplete_details")
                    why = det.get("reason") if isinstance(det, dict) else None
                    s.stop_reason = _RESPONSES_INCOMPLETE.get(why, why) if isinstance(why, str) else "incomplete"
                rid = resp["id"][:256] if isinstance(resp.get("id"), str) else None  # as indexed above
                if rid is None and len(s.resp_open) == 1:
                    rid = next(iter(s.resp_open))  # an end that names none: the one Response open
                task = s.resp_index.get(rid, 0)
                s.resp_open.discard(rid)
                s.choice_stops[task] = s.stop_reason
                if isinstance(resp.get("usage"), dict):
                    s.resp_usage[task] = resp["usage"]
                if len(s.resp_index) > 1:
                    self._responses_tasks()
                else:
                    self._typed_usage(resp.get("usage"), "output_tokens", "input_tokens")
                s.complete = not s.resp_open  # several Responses: each its own end
                s.carried_chars = _responses_carried(resp.get("output"))
            return
        # anthropic-messages
        if kind == "message_start":
            msg = obj.get("message") if isinstance(obj.get("message"), dict) else {}
            if isinstance(msg.get("model"), str):
                s.model = msg["model"]
            p = self._anthropic_prompt(msg.get("usage"))
            if p is not None:
                s.usage_prompt = p  # said at the start: the ledger need not wait for the end
        elif kind == "content_block_delta":
            d = obj.get("delta") if isinstance(obj.get("delta"), dict) else {}
            v = next((d[k] for k in ("text", "thinking", "partial_json") if isinstance(d.get(k), str)), None)
            if v:
                s.guessed += 1
                self._add(1, out, v, None)
        elif kind == "message_delta":
            d = obj.get("delta") if isinstance(obj.get("delta"), dict) else {}
            st = d.get("stop_reason")
            if isinstance(st, str):
                s.stop_reason = _ANTHROPIC_STOP.get(st, st)
            # Cumulative (Anthropic's docs): the response's output tokens so far, its count at the end.
            self._typed_usage(obj.get("usage"), "output_tokens", "input_tokens")
        elif kind == "message_stop":
            s.complete = True

    def _responses_tasks(self) -> None:
        """Several Responses in one answer (llama-server's n_cmpl or n tasks on /v1/responses): each task's usage said
        at its end, its counts and prompt summed as llama.cpp's chat tasks' are (each prefills in its own slot)."""
        s = self._s
        for task, usage in s.resp_usage.items():
            s.task_usage[task] = (self._count(usage, "output_tokens"), self._count(usage, "input_tokens"))
            det = usage.get("input_tokens_details")
            c = self._count(det, "cached_tokens") if isinstance(det, dict) else None
            if c is not None:
                s.usage_cached[task] = c
        s.typed_cached = None  # a task's alone: the sum is _cached_tokens' (task_usage)
        self._merge_usage()

    def _typed_usage(self, usage, out_key: str, in_key: str) -> None:
        if not isinstance(usage, dict):
            return
        n = self._count(usage, out_key)
        if n is not None:
            self._s.usage_completion = n
        p = self._anthropic_prompt(usage) if self.api == "anthropic-messages" else self._count(usage, in_key)
        if p is not None:
            self._s.usage_prompt = p
        if self.api != "anthropic-messages" and isinstance(usage.get("input_tokens_details"), dict):
            c = self._count(usage["input_tokens_details"], "cached_tokens")
            if c is not None:
                self._s.typed_cached = c
        if self.api == "openai-responses" and isinstance(usage.get("output_tokens_details"), dict):
            r = self._count(usage["output_tokens_details"], "reasoning_tokens")
            if r is not None:
                self._s.usage_reasoning = r

    def _anthropic_prompt(self, usage) -> int | None:
        """The whole prompt's length from an Anthropic usage: `input_tokens` is only the part not read from (or
        written to) the prompt cache (llama-server: 1 of a 63-token prompt it had cached), the cache's parts are
        apart; None when it gives no input_tokens."""
        if not isinstance(usage, dict):
            return None
        p = self._count(usage, "input_tokens")
        if p is None:
            return None
        for k in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            c = self._count(usage, k)
            p += c or 0
            if k == "cache_read_input_tokens" and c is not None:
                self._s.typed_cached = c  # read from the cache: not computed (the creation part was)
        return p

    def _openai(self, obj: dict, out: list[TokenEvent]) -> None:
        s = self._s
        if self._server_error(obj):
            return
        if isinstance(obj.get("model"), str):
            s.model = obj["model"]
        if "prompt_progress" in obj:
            # llama-server's `return_progress` on /v1/completions: a chunk of empty text and no finish reason, no
            # token (counted, it was one each: 7 for a usage of 5, the first at the prompt's start).
            return
        choices = obj.get("choices")
        usage = obj.get("usage")
        timings = obj.get("timings")
        usage_total = None
        usage_obj = isinstance(usage, dict)  # asked once: this runs for every chunk that is parsed whole
        if usage_obj or timings is not None:
            # Whose figures these are: one choice's (a chunk of one choice), or a task's or the stream's.
            one = isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict)
            if one:
                key = choices[0].get("index")
                key = key if type(key) is int and 0 <= key <= MAX_COUNT else 0
            else:
                s.n_bare += 1
                key = f"#{s.n_bare}"
            task = self._timings(timings, key) if timings is not None else False
            if usage_obj:
                usage_total = self._count(usage, "completion_tokens")
                p = self._count(usage, "prompt_tokens")
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict):  # a null one (vLLM without --enable-prompt-tokens-details) says nothing
                    cached = self._count(details, "cached_tokens")
                    if cached is not None:
                        s.usage_cached["final" if not (task or one) else key] = cached
                if task:
                    s.task_usage[key] = (usage_total, p)  # llama.cpp: this task's, sent once at its end
                elif one:
                    s.choice_usage[key] = (usage_total, p)  # continuous usage: this choice's running count
                else:
                    s.final_usage = (usage_total, p)
                if (one and not task and len(s.choice_usage) == 1 and s.final_usage is None and not s.task_usage
                        and self._prompts <= 1):
                    # One choice's running count alone (every chunk of such a stream): _merge_usage's answer, inline
                    # (a call and its sums cost ~0.15 us a chunk, bench/proxy_calls.py's per-chunk path ~3 us).
                    if usage_total is not None:
                        s.usage_completion = usage_total
                    if p is not None:
                        s.usage_prompt = p
                else:
                    self._merge_usage()
        if usage is not None and not usage_obj:  # the server's count, in a shape that says none
            self._unreadable(f"unexpected event shape: usage is a {type(usage).__name__}, not an object")
        if not isinstance(choices, list):
            if choices is not None:  # a chunk of another shape: whatever it carried is not read (said, not skipped)
                self._unreadable(f"unexpected event shape: choices is a {type(choices).__name__}, not a list")
            return
        texts: list[str] = []
        closing = False  # this chunk carries a finish_reason
        tool = False  # this chunk carries a tool call
        # Per choice with a token: (index, tokens by the no-count rule: its logprobs' count, else one).
        carried: list[tuple[int, int]] = []
        at_limit: list[int] = []  # choices this chunk closes at `length` without showing a token
        n_seen = 0
        idx = 0
        for ch in choices:
            if not isinstance(ch, dict):
                self._unreadable(f"unexpected event shape: a choice is a {type(ch).__name__}, not an object")
                continue
            n_seen += 1
            idx = ch.get("index")
            idx = idx if type(idx) is int and 0 <= idx <= MAX_COUNT else 0
            fr = ch.get("finish_reason")
            finished = isinstance(fr, str) and bool(fr)
            token = False
            n_texts = len(texts)
            if self.api == "openai-chat":
                delta = ch.get("delta") or ch.get("message") or {}
                if isinstance(delta, dict):
                    for k in ("content", "reasoning_content", "reasoning"):
                        v = delta.get(k)
                        if isinstance(v, str):
                            if k == "reasoning" and v == delta.get("reasoning_content"):
                                # vLLM's deprecation copy: one text under both names (vllm-project/vllm#27752's
                                # DeltaMessage and ChatMessage validators set reasoning_content = reasoning, dumped
                                # with exclude_unset; a later sync_reasoning_fields does the same). Kept once: the
                                # text was twice in the event and the answer kept with --keep-text.
                                continue
                            texts.append(v)
                            # An empty content is still a token (a byte of an unfinished UTF-8
                            # character) unless it is the role-only opener or the closing chunk.
                            token |= bool(v) or ("role" not in delta and not finished)
                    if delta.get("tool_calls"):
                        token = tool = True
            else:
                v = ch.get("text")
                if isinstance(v, str):
                    texts.append(v)
                    token |= bool(v) or not finished
            k_lp = 0
            lp = ch.get("logprobs")
            if isinstance(lp, dict):
                toks = lp.get("content") if isinstance(lp.get("content"), list) else lp.get("tokens")
                if isinstance(toks, list):
                    k_lp = len(toks)
            if self._chat_echo and token and idx not in s.echoed:
                s.echoed.add(idx)
                if sum(len(t) for t in texts[n_texts:]) == self._chat_echo:
                    token, k_lp = False, 0
                if len(s.echoed) >= self._choices:
                    self._quick = self._count_only_quick
            if self._echo and (token or k_lp) and idx not in s.echoed:
                # The choice's first chunk: its logprobs list the echoed prompt's tokens too, and it holds the one
                # token the prompt's step generated (vLLM counts that one in usage, even where max_tokens 0 hid it).
                s.echoed.add(idx)
                if k_lp:
                    k_lp, token = 0, True
            if token or k_lp:
                carried.append((idx, k_lp or 1))
            if idx and idx not in s.other_choices:
                s.other_choices[idx] = 0
            if finished:
                closing = True
                if fr == "length" and not (token or k_lp):
                    at_limit.append(idx)
                s.stop_reason = fr
                s.choice_stops[idx] = fr
                s.unfinished.discard(idx)
                s.finished_any = True
            else:
                s.unfinished.add(idx)
        # n > 1: the stream has ended when every choice seen has finished, not at the first one's end.
        s.complete = s.finished_any and not s.unfinished
        if usage_total is not None and (carried or closing):
            # vLLM/SGLang continuous usage stats: the running total says how many this chunk holds,
            # whatever its text: vLLM's closing chunk (empty content, finish_reason) can carry the
            # last token, and a speculative or batched chunk several. Under n > 1 (or a list of
            # prompts) it is the running total of the chunk's one choice (vLLM's previous_num_tokens[i],
            # SGLang's completion_tokens[index]), not the stream's.
            single = n_seen == 1
            n = usage_total - (self._choice_count(idx) if single and s.other_choices else s.counted)
            if n <= 0:
                if closing and not carried:
                    out.append(TokenEvent(0, "", usage_total, closing=True))
                return
            if self._counted(n):
                s.totalled += n
                # A jump against the steps seen before it; the first counted chunk has none to be measured against (a
                # call streamed 3 tokens a chunk from its start counted every chunk a jump, and a buffering proxy in
                # front of it was excused as the server's parser).
                if tool and s.max_step and n > 2 * s.max_step:
                    s.tool_call_jumps += 1
                else:
                    s.max_step = max(s.max_step, n)
                if single and idx:
                    s.other_choices[idx] += n
                out.append(TokenEvent(n, "".join(texts), usage_total))
            return
        if closing and not usage_obj and idx in s.choice_usage and n_seen == 1:
            # Its end carries no count where its chunks did: the tokens of a last step without text are in none.
            s.unclosed.add(idx)
        if carried and s.choice_usage:
            # A choice whose chunks carried running counts has each token in them: one of its chunks without any is a
            # late piece of counted text (SGLang's tool-call arguments held by its parser, sent at the finish after
            # the step's counted chunk: _check_for_unstreamed_tool_args), no token of its own.
            carried = [(i, k) for i, k in carried if i not in s.choice_usage]
        if at_limit and self._max_tokens is not None:
            # vLLM sends a length-limited choice's last token in its closing chunk with empty content where that
            # token's text is empty (max_tokens 1: the only token); only a final usage said so, and without
            # include_usage none does: the row had no tokens, its energy went to unproxied. A choice that showed
            # exactly max_tokens - 1 and stopped at the limit generated the last one here (a `stop`, or any other
            # count, says nothing certain; a server that shows every token never meets it).
            carried += [(i, 1) for i in at_limit
                        if i not in s.choice_usage and self._choice_count(i) + 1 == self._max_tokens]
        if not carried:
            if closing:
                out.append(TokenEvent(0, "", None, closing=True))
            return
        # Without counts a content chunk stands for one token per choice; usage at the end corrects
        # the total, and the summary says which source it used. Its logprobs' entries are no count either, only
        # the tokens it showed: llama-server's chat stream sends no chunk, nor logprobs, for a token that adds
        # no text (16 of 450 on the tiny test model), so they too are unconfirmed until the usage says the same
        # (guessed: the ledger then scales the request's chunks to the usage; before, they were taken for the
        # server's count and the rest went to unproxied, unsaid).
        n = sum(k for _, k in carried)
        if self._counted(n):
            s.guessed += n
            for i, k in carried:
                if i:
                    s.other_choices[i] += k
            out.append(TokenEvent(n, "".join(texts), None))

    def _merge_usage(self) -> None:
        """The stream's usage from what was said: a final usage for the whole stream wins; else llama.cpp's
        tasks' own (each choice a task, prefilling its prompt in its own slot: counts and prompts summed); else
        continuous usage's running counts per choice (summed; the prompt is the request's, repeated in each of its
        choices, or a list's prompts' own, summed once each has said it)."""
        s = self._s
        comp = prompt = None
        if s.final_usage is not None:
            comp, prompt = s.final_usage
        elif s.task_usage:
            comp = _sum_known(c for c, _ in s.task_usage.values())
            prompt = _sum_known(p for _, p in s.task_usage.values())
        elif s.choice_usage:
            comp = _sum_known(c for c, _ in s.choice_usage.values())
            # Each prompt of a list says its own length in its choices' usage (vLLM's num_prompt_tokens[prompt_idx]):
            # their sum once every prompt has said it (before: the first prompt's alone, taken early for the request's).
            groups: dict = {}
            for i, (_, p) in s.choice_usage.items():
                if p is not None and type(i) is int:
                    groups[i // self._choices] = max(groups.get(i // self._choices, p), p)
            if len(groups) >= self._prompts:
                prompt = sum(groups.values())
        if comp is not None:
            s.usage_completion = comp
        if prompt is not None:
            s.usage_prompt = prompt

    def _choice_count(self, idx: int) -> int:
        """Tokens counted so far for choice `idx` (those of choice 0 are the rest: the fast path counts
        only choice 0's chunks, and keeps no count of its own)."""
        s = self._s
        if idx:
            return s.other_choices.get(idx, 0)
        return s.counted - sum(s.other_choices.values())

    def _summary(self) -> StreamSummary:
        s = self._s
        t = s.timings
        generated, source = s.counted, "counted"
        if s.usage_completion is not None:
            generated, source = s.usage_completion, "usage"
        elif s.predicted_total is not None:
            generated, source = s.predicted_total, "timings"
        elif "predicted_n" in t:
            generated, source = t["predicted_n"], "timings"
        prompt = self.prompt_tokens  # guarded: a batch some of whose prompts never spoke has no whole length to say
        return StreamSummary(
            api=self.api,
            counted_tokens=s.counted,
            guessed_tokens=s.guessed,
            totalled_tokens=s.totalled,
            generated_tokens=generated,
            prompt_tokens=prompt,
            token_source=source,
            timings=dict(t),
            draft_n=t.get("draft_n"),
            draft_n_accepted=t.get("draft_n_accepted"),
            stop_reason=s.stop_reason,
            choice_stops=dict(s.choice_stops),
            model=s.model,
            complete=s.complete,
            done=s.done,
            error="; ".join(s.errors) if s.errors else None,
            n_events=s.n_events,
            n_comments=s.n_comments,
            invalid=s.invalid,
            unreadable=s.unreadable,
            server_error=s.server_error,
            first_choice_of=s.first_choice_of,
            prompt_each_task=self.prompt_each_task,
            cached_tokens=self._cached_tokens(prompt),
            count_open=bool(s.unclosed) and s.final_usage is None and not s.task_usage,
            response_id=s.response_id,
            reasoning_tokens=s.usage_reasoning,
            carried_chars=s.carried_chars,
        )

    def _cached_tokens(self, prompt: int | None) -> int | None:
        """Of the prompt figure, the tokens the server said it found cached, from where that figure came; None where
        it did not say (or said it for part of the figure only)."""
        s = self._s
        if prompt is None:
            return None
        if s.usage_prompt is None:  # the prompt from llama.cpp's timings: prompt_n + cache_n
            c = s.timings.get("cache_n")
        elif self._sglang_api:
            if not s.seq_prompt or set(s.seq_cached) != set(s.seq_prompt):
                return None
            groups: dict = {}
            for i, v in s.seq_cached.items():  # a prompt's n sequences: computed once, by the one that missed most
                groups[i // self._choices] = min(groups.get(i // self._choices, v), v)
            c = sum(groups.values())
        elif s.typed_cached is not None:
            c = s.typed_cached
        elif s.scaled_tasks:
            c = None  # a whole llama.cpp answer's first task's usage scaled to its choices: its cached part is not
        elif s.final_usage is not None:
            c = s.usage_cached.get("final")
        elif s.task_usage:
            got = [s.usage_cached.get(k) for k in s.task_usage]
            c = None if None in got else sum(got)
        elif s.choice_usage:
            got = [s.usage_cached[k] for k in s.choice_usage if k in s.usage_cached]
            c = min(got) if got else None
        else:
            c = None
        if c is None and s.usage_prompt is not None and "cache_n" in s.timings and s.usage_prompt == s.prompt_tokens:
            c = s.timings["cache_n"]  # llama.cpp's chat: usage without details, its timings beside it say the same prompt
        return min(c, prompt) if c is not None else None


def _sum_known(values) -> int | None:
    """The sum of the values that are not None; None when all are."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _merged_timings(tasks) -> dict:
    """The timings of a request of several llama.cpp tasks (one per choice): their counts summed; its durations
    the longest task's (the tasks ran side by side); per-token rates, each task's own, left out."""
    out: dict = {}
    for t in tasks:
        for k, v in t.items():
            if k in _TIMING_COUNTS:
                out[k] = out.get(k, 0) + v
            elif k in ("prompt_ms", "predicted_ms"):
                out[k] = max(out.get(k, 0.0), v)
    return out


def _one_task_answer(obj: dict, api: str, s: _State, asked_n: int = 1, tasks_run: int | None = None) -> dict:
    """A whole OpenAI-style answer as llama.cpp writes one of several choices (one task each): its `usage` and
    `timings` are its first task's alone (b11434: completion_tokens 2 for choices of 2 and 3 tokens). Where every
    choice stopped at the length limit, each generated as many as the first: the counts are scaled to all of them
    (the prompt too where the choices share one prompt: chat's, or a completion whose request's `n`, `asked_n`, is
    all of them; a completions answer may be a list of prompts, whose other lengths are unknown: no prompt length
    then). Else the others' counts are unknown: `first_choice_of` says
    so. `tasks_run`: of its choices, those whose task ran, where the request says fewer (llama.cpp's empty id lists in
    a list of prompts: tasks of no tokens, ended at once with finish_reason "length", measured): the counts are
    scaled to those alone, and where the first task is such an empty one (its count 0), the others' are unknown.
    Any other answer is returned as it is."""
    choices = obj.get("choices")
    usage = obj.get("usage")
    if not (isinstance(choices, list) and isinstance(usage, dict) and isinstance(obj.get("timings"), dict)):
        return obj
    k = sum(1 for c in choices if isinstance(c, dict))
    if k <= 1:
        return obj
    if any(c.get("finish_reason") != "length" for c in choices if isinstance(c, dict)):
        s.first_choice_of = k
        return obj
    runs = tasks_run if tasks_run is not None and 0 < tasks_run < k else k
    if runs < k and not _int(usage.get("completion_tokens")):
        # A task that runs generates at least one token (0 asked: one): the first was empty, its usage and timings
        # (all 0) not the answer's, its prompt_tokens 0 where the others prefilled theirs.
        s.first_choice_of = k
        return dict(obj, usage={key: v for key, v in usage.items() if key != "prompt_tokens"}, timings=None)
    if runs == 1:
        return obj  # the one task that ran is the first: its counts are the answer's
    scaled = {key: v * runs if key in ("completion_tokens", "prompt_tokens", "total_tokens") and _int(v) is not None
              and not isinstance(v, bool) else v for key, v in usage.items()}
    if api != "openai-chat" and asked_n != k:
        scaled.pop("prompt_tokens", None)
    s.scaled_tasks = True  # its prompt, scaled, is each task's summed
    return dict(obj, usage=scaled, timings=None)


def _responses_output_parts(output) -> int:
    """Output items of a whole Responses API answer: at least one token each (its usage gives the count)."""
    return sum(1 for item in output if isinstance(item, dict)) if isinstance(output, list) else 0


def _responses_carried(output) -> int | None:
    """Characters of a Responses answer's messages' text where its output holds an item that is neither a message nor
    reasoning (a function call: vLLM's responses/utils.py construct_input_messages re-prefills only the stored output's
    ResponseOutputMessage items); None where it holds none, or no list."""
    if not isinstance(output, list):
        return None
    kinds = [item.get("type") if isinstance(item, dict) else None for item in output]
    if all(k in ("message", "reasoning") for k in kinds):
        return None
    n = 0
    for item, kind in zip(output, kinds):
        parts = item.get("content") if kind == "message" else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                n += len(part["text"])
    return n


def _looks_whole(value: bytes) -> bool:
    v = value.rstrip()
    return (v[:1] == b"{" and v[-1:] == b"}") or (v[:1] == b"[" and v[-1:] == b"]")


def parse_response(api: str, body: bytes, choices: int = 1, sequences: int = 1, tasks_run: int | None = None
                   ) -> tuple[list[TokenEvent], StreamSummary]:
    """A non-streaming JSON response: all its tokens as one event, and the summary. `choices`, `sequences`: as
    StreamParser's (SGLang's /generate); `tasks_run`: as _one_task_answer's."""
    p = StreamParser(api, choices=choices, sequences=sequences)
    try:
        obj = json_from_bytes(body)
    except (ValueError, UnicodeDecodeError):
        p._unreadable(f"malformed JSON response: {body[:80].decode('utf-8', 'replace')!r}")
        return [], p._summary()
    out: list[TokenEvent] = []
    if api == "sglang-generate" and isinstance(obj, (dict, list)):
        # One sequence's whole answer, or a batch's list of them in its sequences' order (index = place).
        for i, o in enumerate(obj if isinstance(obj, list) else [obj]):
            if isinstance(o, dict):
                try:
                    p._sglang(o, out, i if isinstance(obj, list) else None)
                except Exception as e:
                    p._unreadable(f"unexpected response shape: {error_text(e)}")
            else:
                p._unreadable("response item is not a JSON object")
        n = sum(e.n_tokens for e in out)
        return ([TokenEvent(n, "", p._s.usage_completion)] if n else []), p._summary()
    if api == "llamacpp" and isinstance(obj, list) and obj:
        # A list of prompts: the list of each task's final result, in task order (llama-server's handle_completions_impl
        # answers one object for a single task, a list for several); each read as a whole answer of its own below.
        tasks = p._prompts * p._choices
        if len(obj) > tasks:
            # More results than the request's tasks (prompts × n_cmpl): no sum of them is its work, and reading them
            # all held the proxy's event loop (20,001 items, 42 MB: 4.4 s, "27 generated", complete).
            p._invalid("response", f"{len(obj)} results for the request's {tasks} tasks (prompts × n_cmpl)")
            return [], p._summary()
        seen: set = set()
        for i, o in enumerate(obj):
            if not isinstance(o, dict):
                p._unreadable("response item is not a JSON object")
                continue
            o = dict(o, stop=True) if "stop" not in o and "content" in o else o
            # The list is in task order (its results placed by index): a result marked with none is its place's.
            o = o if "index" in o else dict(o, index=i)
            if type(o["index"]) is int:  # any other is _llamacpp's to flag
                if o["index"] in seen:
                    p._invalid("response", f"task {o['index']} answered twice")
                    break
                seen.add(o["index"])
            if isinstance(o.get("tokens"), list) is False and o.get("tokens_predicted") is None:
                pn = _int((o.get("timings") or {}).get("predicted_n")) if isinstance(o.get("timings"), dict) else None
                if pn is not None:
                    o = dict(o, tokens_predicted=pn)
            try:
                p._handle(o, out)
            except Exception as e:
                p._unreadable(f"unexpected response shape: {error_text(e)}")
        n = sum(e.n_tokens for e in out)
        return ([TokenEvent(n, "", p._s.predicted_total)] if n else []), p._summary()
    if isinstance(obj, dict):
        if api == "openai-chat" and isinstance(obj.get("choices"), list):
            # Non-streaming chat puts the text under `message`, not `delta`.
            obj = dict(obj, choices=[{**c, "delta": c.get("message") or {}} for c in obj["choices"] if isinstance(c, dict)])
        if api.startswith("openai"):
            obj = _one_task_answer(obj, api, p._s, choices if sequences == choices else 1, tasks_run)
        if api == "openai-responses" and obj.get("object") == "response":
            obj = _whole_response(p, obj, out)
        elif api == "anthropic-messages" and obj.get("type") == "message":
            content = obj.get("content")
            n = sum(1 for b in content if isinstance(b, dict)) if isinstance(content, list) else 0
            p._s.counted, p._s.n_events, p._s.guessed = n, 1 if n else 0, n
            if n:
                out.append(TokenEvent(n, "", None))
            p._handle({"type": "message_start", "message": obj}, out)
            p._handle({"type": "message_delta", "delta": {"stop_reason": obj.get("stop_reason")}, "usage": obj.get("usage")}, out)
            obj = {"type": "message_stop"}
        if api == "llamacpp" and "stop" not in obj and "content" in obj:
            obj = dict(obj, stop=True)
        if api == "llamacpp" and isinstance(obj.get("tokens"), list) is False and obj.get("tokens_predicted") is None:
            # Non-streaming answers carry the whole text in one `content`: count from timings.
            pn = _int((obj.get("timings") or {}).get("predicted_n")) if isinstance(obj.get("timings"), dict) else None
            if pn is not None:
                obj = dict(obj, tokens_predicted=pn)
        try:
            p._handle(obj, out)
        except Exception as e:
            p._unreadable(f"unexpected response shape: {error_text(e)}")
        # The usage block of a non-streaming OpenAI answer is the authoritative count.
        if out and p._s.usage_completion is not None and out[0].n_tokens != p._s.usage_completion:
            out = [TokenEvent(p._s.usage_completion, out[0].text, p._s.usage_completion)]
            p._s.counted = p._s.usage_completion
    elif api == "openai-responses" and isinstance(obj, list) and obj:
        # llama-server's n_cmpl (else n) tasks on /v1/responses: a JSON array of each task's whole Response (measured
        # on b11434). Before: "response is not a JSON object", no tokens. Each read as its own, their counts summed.
        if len(obj) > _MAX_RESPONSES:
            p._invalid("response", f"{len(obj)} Responses in one answer")
            return [], p._summary()
        for i, o in enumerate(obj):
            if not isinstance(o, dict) or o.get("object") != "response":
                p._unreadable("response item is not a Response object")
                continue
            o = o if isinstance(o.get("id"), str) else dict(o, id=f"#{i}")  # each its own task
            try:
                p._handle(_whole_response(p, o, out), out)
            except Exception as e:
                p._unreadable(f"unexpected response shape: {error_text(e)}")
        n = sum(e.n_tokens for e in out)
        u = p._s.usage_completion
        if u is not None:
            p._s.counted = u  # the usages are the server's count, as a single Response's (below)
        return ([TokenEvent(u if u is not None else n, "", u)] if n or u else []), p._summary()
    else:
        p._unreadable("response is not a JSON object")
    return out, p._summary()


# More Responses than any server answers for one request (llama-server's n_cmpl: at most its slots): read no further.
_MAX_RESPONSES = 4096


def _whole_response(p: StreamParser, obj: dict, out: list[TokenEvent]) -> dict:
    """A whole Response (the body of a streamed `response.completed`, or incomplete, failed): its output parts counted
    (added to those before it: an array of several), and the event its usage and end are read from."""
    status = obj.get("status")
    kind = _responses_end_kind(status if isinstance(status, str) else "")
    n = _responses_output_parts(obj.get("output"))
    p._s.counted += n
    p._s.guessed += n
    p._s.n_events += 1 if n else 0
    if n:
        out.append(TokenEvent(n, "", None))
    return {"type": kind, "response": obj}


def _responses_end_kind(status: str) -> str:
    """The event a Response's status ends it as: completed, incomplete (its reason read from incomplete_details),
    failed (a server error); any other (cancelled, in_progress, queued) not an end, so the answer is not complete."""
    return {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed"}.get(status, "response.in_progress")
