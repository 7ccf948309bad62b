"""Prompts of a given token length (`--context-tokens 512,8k,32k`), counted with the server's own tokenizer.

llama.cpp and vLLM both answer `POST /tokenize` (llama.cpp: `{"content"}` → `{"tokens"}`; vLLM:
`{"prompt"}` → `{"count", "tokens"}`). A server without it gets prompts sized by an estimate, and
the prompt says so (`counted_by`): the windows' `prompt_tokens` then carry the server's own count.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass

from .auth import auth_headers
from .client import ServerInfo
from .load import Prompt
from .trace import MAX_TOKENS

CHARS_PER_TOKEN_ESTIMATE = 4.0  # only where the server cannot count: English text, BPE tokenizers
_FILLER = (
    "The power limit of a graphics card caps the energy it may draw each second, and the clock "
    "falls until the draw fits under it. Decoding a token reads every weight once from memory, "
    "so memory bandwidth sets the pace while the arithmetic waits. Section {i} of the notes "
    "records a measurement taken at a steady temperature with the fans at a constant speed. "
)
_QUESTION = "\n\nIn three sentences, summarise the notes above."


class TokenizeError(RuntimeError):
    """The server's tokenizer endpoint answered, but not with a token count."""


def parse_context_tokens(spec: str) -> list[int]:
    """"512,8k,32k,128k" → [512, 8192, 32768, 131072] (k = 1024 tokens, at most trace.MAX_TOKENS each).
    ValueError on bad input."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\d+)\s*([kK]?)", part)
        if not m:
            raise ValueError(f"--context-tokens: {part!r} is not a token count (e.g. 512, 8k, 128k)")
        digits = m.group(1).lstrip("0") or "0"
        if len(digits) > len(str(MAX_TOKENS)):  # past the cap however read; int() of 5000 digits is Python's own error
            raise ValueError(f"--context-tokens: {part[:20]!r}... has {len(digits)} digits, more than "
                             f"{MAX_TOKENS:,} tokens in one request")
        n = int(digits) * (1024 if m.group(2) else 1)
        if n < 16:
            raise ValueError(f"--context-tokens: {part!r} is under 16 tokens")
        if n > MAX_TOKENS:
            # The prompt text is built in memory first (4 characters a token): 10000000k ran out of memory
            # building it, and a typo such as 128000k (131M tokens) is no model's context.
            raise ValueError(f"--context-tokens: {part!r} is {n:,} tokens, more than {MAX_TOKENS:,} tokens in one request")
        out.append(n)
    if not out or len(set(out)) != len(out):
        raise ValueError("--context-tokens needs distinct token counts, e.g. 512,8k,32k")
    return out


def tokenize_count(server: ServerInfo, text: str, timeout_s: float = 120.0) -> int | None:
    """Tokens the server counts in `text` (special tokens included, as a prompt is sent), or None
    when it has no tokenizer endpoint."""
    url = server.base_url.rstrip("/") + "/tokenize"
    body = {"content": text, "add_special": True} if server.kind == "llamacpp" else {"prompt": text}
    if server.kind not in ("llamacpp", "vllm", "sglang"):
        return None
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **auth_headers()})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            status, data = r.status, r.read()
    except urllib.error.HTTPError as e:
        if e.code in (404, 405, 501):
            return None
        raise TokenizeError(f"{url} answered HTTP {e.code}") from None
    except (urllib.error.URLError, OSError):
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        raise TokenizeError(f"{url} answered HTTP {status} without JSON") from None
    if isinstance(obj, dict) and isinstance(obj.get("count"), int):
        return obj["count"]
    if isinstance(obj, dict) and isinstance(obj.get("tokens"), list):
        return len(obj["tokens"])
    raise TokenizeError(f"{url} answered HTTP {status} without a token count: {str(obj)[:200]}")


@dataclass(frozen=True)
class ContextPrompt:
    prompt: Prompt
    target_tokens: int
    tokens: int | None  # as the server counted them; None where it cannot
    counted_by: str  # tokenize | estimate


def _text(n_chars: int) -> str:
    out, i = [], 0
    total = 0
    while total < n_chars:
        chunk = _FILLER.format(i=i)
        out.append(chunk)
        total += len(chunk)
        i += 1
    body = "".join(out)[: max(0, n_chars)]
    return body + _QUESTION


def context_prompt(server: ServerInfo, target_tokens: int, tolerance: float = 0.02, max_rounds: int = 6) -> ContextPrompt:
    """A prompt of `target_tokens` tokens (within `tolerance`, by the server's count where it can count)."""
    chars = int(target_tokens * CHARS_PER_TOKEN_ESTIMATE)
    text = _text(chars)
    n = tokenize_count(server, text)
    if n is None:
        return ContextPrompt(Prompt(f"ctx-{target_tokens}", text), target_tokens, None, "estimate")
    for _ in range(max_rounds):
        if abs(n - target_tokens) <= max(1, tolerance * target_tokens):
            break
        chars = max(1, int(chars * target_tokens / max(n, 1)))  # tokens ~ characters for one filler
        text = _text(chars)
        n = tokenize_count(server, text)
        if n is None:
            raise TokenizeError(f"{server.base_url}/tokenize stopped answering")
    return ContextPrompt(Prompt(f"ctx-{target_tokens}", text), target_tokens, n, "tokenize")
