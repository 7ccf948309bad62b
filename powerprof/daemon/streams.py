"""Adapter between the proxy and the one stream parser (powerprof.workload.stream): counts only.

The proxy runs `StreamParser(api).count` on the bytes it forwards (tokens, not events: several
under batching or speculative decode) and `parse_response` on non-streamed bodies; this module
keeps what the daemon stores of their results. Nothing here keeps prompt or completion text: only
counts, model, stop reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from powerprof.arrival import HeldCall, count_problem, first_choice_only, held_call_at_limit
from powerprof.workload.stream import StreamParser, parse_response


def api_for_path(path: str) -> str | None:
    """Which stream dialect a request path speaks; None for paths whose tokens the proxy does not count
    (`uncounted_kind` says which of those do GPU work)."""
    p = path.rstrip("/")
    if p.endswith("/chat/completions"):
        return "openai-chat"
    if p.endswith("/v1/completions"):
        return "openai-completions"
    if p in ("/completion", "/completions", "/infill") or p.endswith("/completion"):
        return "llamacpp"  # llama.cpp's /infill (code completion) streams as /completion does
    if p.endswith("/v1/responses"):
        return "openai-responses"
    if p.endswith("/v1/messages"):
        return "anthropic-messages"
    if p == "/generate":
        return "sglang-generate"  # SGLang's native endpoint (its frontend language, many deployments)
    return None


# Paths of the servers' endpoints that do no GPU work (reads of state, tokenizer calls): their requests are
# not "uncounted work". Matched on the path's last segments, as api_for_path matches.
_NO_WORK = ("/health", "/healthz", "/ping", "/metrics", "/props", "/slots", "/models", "/version", "/tokenize",
            "/detokenize", "/apply-template", "/load", "/server_info", "/get_server_info", "/get_model_info",
            "/count_tokens", "/lora-adapters", "/is_sleeping")
# The kinds of work whose tokens the proxy cannot count, by path: a bounded label set for /metrics.
UNCOUNTED_KINDS = ("embeddings", "rerank", "audio", "images", "other")


def uncounted_kind(method: str, path: str) -> str | None:
    """For a request the proxy does not count (api_for_path None): which kind of GPU work it may be (a
    bounded name, UNCOUNTED_KINDS), or None for one that does no GPU work (a GET, /health, /tokenize…).
    Its energy is not the counted requests': the row and /metrics say it was not counted."""
    if method in ("GET", "HEAD", "OPTIONS", "DELETE"):
        return None
    p = path.rstrip("/").lower()
    if p.endswith(_NO_WORK) or p.endswith("/cancel"):
        return None
    if p.endswith(("/embeddings", "/embedding", "/pooling", "/classify")):
        return "embeddings"
    if p.endswith(("/rerank", "/reranking", "/score")):
        return "rerank"
    if "/audio/" in p:
        return "audio"
    if "/images/" in p:
        return "images"
    return "other"


# `"prompt_tokens": N` followed by what ends the number (a piece may end inside it: then it is not taken yet).
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,9})[^\d]')


class PromptTokensScan:
    """`usage.prompt_tokens` of an embeddings answer, read as its bytes pass: its input's length, the whole of its
    GPU work (a forward pass over those tokens, no decode). A regular-expression search per piece over the piece and
    the previous one's last bytes, no copy of the body (the vectors run to megabytes) and no JSON parse; llama.cpp
    puts its usage before the vectors, vLLM after. `"prompt_tokens_details"` does not match (the quote)."""

    KEEP = 64

    def __init__(self):
        self.prompt_tokens: int | None = None
        self._tail = b""

    def feed(self, piece: bytes) -> None:
        if self.prompt_tokens is not None:
            return
        buf = self._tail + piece
        m = _PROMPT_TOKENS.search(buf)
        if m is not None:
            self.prompt_tokens = int(m.group(1))
        else:
            self._tail = buf[-self.KEEP:]


@dataclass(frozen=True)
class Counts:
    """What the recorder keeps of a finished response."""

    generated_tokens: int | None
    prompt_tokens: int | None
    model: str | None
    stop_reason: str | None
    token_source: str
    predicted_ms: float | None = None
    complete: bool | None = None
    error: str | None = None
    invalid: str | None = None  # a count or timing out of range: none of its counts are kept
    tokens_estimated: bool = False  # the proxy's count rests on what its chunks showed (one each, or their logprobs), unconfirmed by the server
    # Why the server's own count contradicts the stream it sent (arrival.count_problem, both counts
    # named); None when it does not. Then neither count is believed: see ledger.py.
    count_problem: str | None = None
    count_problem_kind: str | None = None  # which rule it broke (arrival.COUNT_PROBLEM_KINDS): the metric's label
    server_error: str | None = None  # an error the server sent inside its response (after an HTTP 200)
    # prompt_tokens sums each task's prompt (llama.cpp: a task per choice, each prefilling the prompt in its slot);
    # False: the server said each prompt once for all its choices (vLLM, SGLang: computed once, the other choices hit
    # the prefix cache). Alike for one choice.
    prompt_each_task: bool = False
    # A whole answer's tokens as it listed them (SGLang's output_ids), where its count contradicts them: what the
    # proxy saw, the tokens its row keeps instead of the count (count_problem); None otherwise.
    listed_tokens: int | None = None
    # Lines and events of the response that could not be read (StreamSummary.unreadable): tokens they carried are
    # not in the proxy's count. The request's row says so (proxy.unreadable_note).
    unreadable: int = 0
    # Of prompt_tokens, those the server said it found in its prefix cache (StreamSummary.cached_tokens): no prefill
    # work. None: it did not say.
    cached_tokens: int | None = None
    # Its count is the server's running count as of its last chunk that carried one, its end carrying none
    # (StreamSummary.count_open: SGLang's chat without include_usage): it may be low, the row says so.
    count_open: bool = False
    # Each choice's finish reason by its index (StreamSummary.choice_stops): arrival.at_limit's.
    choice_stops: dict = field(default_factory=dict)
    # Its count passed its running counts by a tool call the server's parser held, cut by max_tokens
    # (arrival.held_call_at_limit): tokens decoded after its last chunk, which the ledger places from there to the end.
    held_tail: bool = False
    # The Responses API's answer's `id` (StreamSummary.response_id): a later turn's previous_response_id names it.
    response_id: str | None = None
    # Of generated_tokens, its thinking's (StreamSummary.reasoning_tokens): not prefilled again by a later turn.
    reasoning_tokens: int | None = None
    # Of a Responses answer with a function call in its output, its messages' characters (StreamSummary.carried_chars):
    # all of its output a later turn prefills again.
    carried_chars: int | None = None


def summary_counts(summary, streamed: bool = True, held: HeldCall | None = None) -> Counts:
    """What the daemon keeps of a StreamSummary; nothing of one that sent an invalid value. A stream's
    server count is checked against the tokens it carried by the timing rule's own test
    (arrival.count_problem); `streamed` False: a whole body, whose count is the only one; `held`: a request that
    carried tools, whose count a tool call cut by max_tokens may put above its running counts
    (arrival.held_call_at_limit)."""
    if summary.invalid is not None:
        return Counts(None, None, summary.model, summary.stop_reason, "none", complete=summary.complete,
                      error=summary.error, invalid=summary.invalid, server_error=summary.server_error,
                      unreadable=summary.unreadable)
    timings = summary.timings or {}
    gen = summary.generated_tokens
    problem = None
    held_tail = False
    if streamed:
        held_tail = (summary.running_counts and gen is not None and gen > summary.counted_tokens
                     and held_call_at_limit(held, summary.choice_stops, gen, summary.counted_tokens))
        problem = count_problem(summary.counted_tokens, gen, summary.running_counts, held_tail)
        held_tail = held_tail and problem is None
    elif summary.first_choice_of is not None and gen is not None:  # 0: its first task an empty one
        problem = first_choice_only(summary.first_choice_of, gen)
    elif summary.api == "sglang-generate" and summary.running_counts:
        # A whole SGLang answer lists its tokens (output_ids): its count is checked against them as a stream's is.
        problem = count_problem(summary.counted_tokens, gen, True)
    return Counts(
        generated_tokens=gen if gen or summary.counted_tokens else None,
        prompt_tokens=summary.prompt_tokens,
        model=summary.model,
        stop_reason=summary.stop_reason,
        token_source=summary.token_source if gen else "none",
        predicted_ms=timings.get("predicted_ms") if isinstance(timings.get("predicted_ms"), (int, float)) else None,
        complete=summary.complete,
        error=summary.error,
        # Confirmed where the server's own count (usage, timings) equals what the proxy counted.
        tokens_estimated=summary.guessed_tokens > 0
        and (summary.token_source == "counted" or gen != summary.counted_tokens),
        count_problem=problem.message if problem else None,
        count_problem_kind=problem.kind if problem else None,
        server_error=summary.server_error,
        prompt_each_task=summary.prompt_each_task,
        listed_tokens=summary.counted_tokens if problem is not None and not streamed else None,
        unreadable=summary.unreadable,
        cached_tokens=summary.cached_tokens,
        count_open=summary.count_open,
        choice_stops=summary.choice_stops,
        held_tail=held_tail,
        response_id=summary.response_id,
        reasoning_tokens=summary.reasoning_tokens,
        carried_chars=summary.carried_chars,
    )


def new_parser(api: str, echo: bool = False, choices: int = 1, sequences: int = 1, echo_chars: int = 0,
               max_tokens: int | None = None) -> StreamParser:
    """A counting parser: plain token chunks are counted from their bytes, not parsed (see StreamParser); `echo`:
    the request asked for its prompt echoed (its first chunks carry it); `choices`, `sequences`: the request's n
    and its sequences in all (SGLang's /generate says each prompt in each of its n sequences); `echo_chars`: a chat
    asking `echo` of a last message of that many characters (vLLM sends it as a chunk of its own); `max_tokens`:
    its limit per choice, where it set one (vLLM's last token in an empty closing chunk at that limit is counted)."""
    return StreamParser(api, count_only=True, echo=echo, choices=choices, sequences=sequences, echo_chars=echo_chars,
                        max_tokens=max_tokens)


def body_counts(api: str, body: bytes, choices: int = 1, sequences: int = 1, tasks_run: int | None = None) -> Counts:
    """Counts from a non-streamed JSON response (usage, llama.cpp timings, SGLang's meta_info); `sequences`: the
    request's tasks, `tasks_run`: of them those that run, where fewer (llama.cpp's empty id lists in a list of prompts:
    stream._one_task_answer)."""
    _events, summary = parse_response(api, body, choices, sequences, tasks_run)
    return summary_counts(summary, streamed=False)
