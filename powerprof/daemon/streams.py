"""Adapter between the proxy and the one stream parser (powerprof.workload.stream): token counts only.

The proxy must use the workload issue's `StreamParser(api)` on the bytes it forwards
(`feed(chunk) -> [TokenEvent]`, `finish() -> StreamSummary`). Until that module lands on main,
`_InterimParser` below honours the same contract so the proxy can be built and tested.
TODO(lead, at merge): once `powerprof.workload.stream` exists, delete `_InterimParser` and
`_InterimSummary`; the import below then picks the real parser and nothing else changes.

Nothing here keeps prompt or completion text: only counts, model, stop reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

try:  # the real parser (workload issue)
    from powerprof.workload.stream import StreamParser as _Parser  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - exercised until the merge
    _Parser = None

APIS = ("llamacpp", "openai-completions", "openai-chat")


def api_for_path(path: str) -> str | None:
    """Which stream dialect a request path speaks; None for paths without generated tokens."""
    p = path.rstrip("/")
    if p.endswith("/chat/completions"):
        return "openai-chat"
    if p.endswith("/v1/completions"):
        return "openai-completions"
    if p in ("/completion", "/completions") or p.endswith("/completion"):
        return "llamacpp"
    return None


def event_tokens(ev) -> int:
    """Token count carried by one TokenEvent, whatever the field is called."""
    for name in ("tokens", "n_tokens", "count", "n"):
        v = getattr(ev, name, None)
        if isinstance(v, int):
            return v
        if isinstance(v, (list, tuple)):
            return len(v)
    return 1


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


def summary_counts(summary, counted: int) -> Counts:
    g = getattr
    gen = g(summary, "generated_tokens", None)
    source = g(summary, "token_source", None) or g(summary, "tokens_source", None)
    if gen is None:
        gen, source = (counted, "counted") if counted else (None, "none")
    return Counts(
        generated_tokens=gen,
        prompt_tokens=g(summary, "prompt_tokens", None),
        model=g(summary, "model", None),
        stop_reason=g(summary, "stop_reason", None),
        token_source=source or "usage",
        predicted_ms=g(summary, "predicted_ms", None),
        complete=g(summary, "complete", None),
        error=g(summary, "error", None),
    )


def new_parser(api: str):
    return (_Parser or _InterimParser)(api)


def body_counts(api: str, body: bytes) -> Counts:
    """Counts from a non-streamed JSON response (usage or llama.cpp timings)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return Counts(None, None, None, None, "none", error="response is not JSON")
    if not isinstance(doc, dict):
        return Counts(None, None, None, None, "none")
    usage = doc.get("usage") or {}
    timings = doc.get("timings") or {}
    model = doc.get("model")
    stop = None
    if api == "llamacpp":
        gen = doc.get("tokens_predicted", timings.get("predicted_n"))
        prompt = doc.get("tokens_evaluated", timings.get("prompt_n"))
        stop = doc.get("stop_type") or ("eos" if doc.get("stopped_eos") else None)
        source = "timings" if gen is not None else "none"
    else:
        gen = usage.get("completion_tokens", timings.get("predicted_n"))
        prompt = usage.get("prompt_tokens", timings.get("prompt_n"))
        choices = doc.get("choices") or [{}]
        stop = choices[0].get("finish_reason") if isinstance(choices[0], dict) else None
        source = "usage" if "completion_tokens" in usage else ("timings" if gen is not None else "none")
    return Counts(
        generated_tokens=int(gen) if gen is not None else None,
        prompt_tokens=int(prompt) if prompt is not None else None,
        model=model if isinstance(model, str) else None,
        stop_reason=stop,
        token_source=source,
        predicted_ms=timings.get("predicted_ms"),
        complete=True,
    )


# --- interim parser: the contract of powerprof.workload.stream, until it lands ---------------------


@dataclass(frozen=True)
class _Event:
    tokens: int


@dataclass(frozen=True)
class _InterimSummary:
    generated_tokens: int | None
    prompt_tokens: int | None
    model: str | None
    stop_reason: str | None
    complete: bool
    error: str | None
    token_source: str
    predicted_ms: float | None


class _InterimParser:
    """Incremental SSE parser: token-bearing events and their token counts (pings, role-only and
    usage chunks and [DONE] are not tokens)."""

    def __init__(self, api: str):
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}")
        self.api = api
        self._buf = b""
        self._counted = 0
        self._usage_gen = self._usage_prompt = None
        self._timings: dict = {}
        self._model = self._stop = self._error = None
        self._complete = False

    def feed(self, chunk: bytes) -> list:
        self._buf += chunk
        out = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                break
            line, self._buf = self._buf[:i].rstrip(b"\r"), self._buf[i + 1 :]
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self._complete = True
                continue
            try:
                doc = json.loads(data)
            except ValueError:
                continue
            if isinstance(doc, dict):
                n = self._event(doc)
                if n:
                    self._counted += n
                    out.append(_Event(n))
        return out

    def _event(self, doc: dict) -> int:
        if "error" in doc:
            self._error = str(doc["error"])[:200]
        self._model = doc.get("model", self._model)
        timings = doc.get("timings")
        if isinstance(timings, dict):
            self._timings = timings
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self._usage_gen = usage.get("completion_tokens", self._usage_gen)
            self._usage_prompt = usage.get("prompt_tokens", self._usage_prompt)
        if self.api == "llamacpp":
            if doc.get("stop"):
                self._complete = True
                self._stop = doc.get("stop_type") or self._stop
                self._usage_gen = doc.get("tokens_predicted", self._usage_gen)
                return 0
            toks = doc.get("tokens")
            if isinstance(toks, list) and toks:
                return len(toks)
            return 1 if doc.get("content") else 0
        n = 0
        for ch in doc.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            if ch.get("finish_reason"):
                self._stop = ch["finish_reason"]
            delta = ch.get("delta") if self.api == "openai-chat" else ch
            if isinstance(delta, dict) and (delta.get("content") or delta.get("text") or delta.get("reasoning_content")):
                n += 1
        return n

    def finish(self) -> _InterimSummary:
        gen, source = self._usage_gen, "usage"
        if gen is None and self._timings.get("predicted_n") is not None:
            gen, source = self._timings["predicted_n"], "timings"
        if gen is None:
            gen, source = (self._counted, "counted") if self._counted else (None, "none")
        prompt = self._usage_prompt if self._usage_prompt is not None else self._timings.get("prompt_n")
        return _InterimSummary(
            generated_tokens=gen,
            prompt_tokens=prompt,
            model=self._model,
            stop_reason=self._stop,
            complete=self._complete,
            error=self._error,
            token_source=source,
            predicted_ms=self._timings.get("predicted_ms"),
        )
