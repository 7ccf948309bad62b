"""Bounds on what an inference server may send: body sizes and value ranges, checked where responses are read.

A server is outside our trust: a value that breaks these bounds marks that one request (or
scrape) failed with the reason, and never reaches a writer, a metric or a sweep's control flow.
Counts land in int32 Parquet columns and in sums, so the range is the column's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp

# Token counts (per response, per event, prompt sizes): the int32 columns they are stored in.
MAX_COUNT = 2**31 - 1
# Server-reported durations (llama.cpp timings, ms) and rates: finite, non-negative, below a year.
MAX_MS = 365 * 86400 * 1e3
# A server's cumulative token counter (/metrics): finite, non-negative, exact in a float64.
MAX_COUNTER = 2.0**53

# Whole bodies read into memory. /props carries a chat template (tens of KiB); /metrics of a busy
# vLLM a few hundred KiB; a non-streamed completion is text plus counts.
MAX_INFO_BYTES = 4 << 20  # /props, /v1/models, /version, /info, /health
MAX_METRICS_BYTES = 16 << 20  # /metrics, /slots
MAX_RESPONSE_BYTES = 64 << 20  # a non-streamed generation
MAX_ERROR_BYTES = 300  # the start of an error answer, for the message

# An idle kept-alive connection is not reused after this long: servers close idle ones after a few seconds (uvicorn,
# which serves vLLM and SGLang, and cpp-httplib, llama.cpp's, after 5 s), and a close that crosses a request on the
# wire fails it (aiohttp's own default keeps them 15 s). A new loopback connection costs far less than that failure.
IDLE_REUSE_S = 2.0


class BodyTooLarge(ValueError):
    """A response body over its cap: read no further."""


async def read_capped(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes `limit` bytes (never more than that in memory)."""
    declared = resp.content_length
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"{resp.url.path} body of {declared} bytes is over the {limit}-byte limit")
    buf = bytearray()
    while True:
        chunk = await resp.content.read(min(1 << 16, limit + 1 - len(buf)))
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            raise BodyTooLarge(f"{resp.url.path} body is over the {limit}-byte limit")


def bad_count(v) -> str | None:
    """Why `v` is not a token count (an integer, or an integral float, in 0..MAX_COUNT); None when it is."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{_show(v)} is not a number"
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        return f"{_show(v)} is not a whole number"
    if v < 0:
        return f"{_show(v)} is negative"
    if v > MAX_COUNT:
        return f"{_show(v)} is over {MAX_COUNT}"
    return None


def bad_amount(v, hi: float) -> str | None:
    """Why `v` is not a finite number in [0, hi]; None when it is."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{_show(v)} is not a number"
    if not math.isfinite(v):
        return f"{_show(v)} is not finite"
    if v < 0:
        return f"{_show(v)} is negative"
    if v > hi:
        return f"{_show(v)} is over {hi:g}"
    return None


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."
