"""Request traces: read Azure LLM-inference CSVs and plain JSONL, write JSONL, and make synthetic ones.

A trace is a list of `TraceRequest` (arrival offset in seconds from the first request, prompt
tokens, output tokens, optional tag). Formats:

- Azure (the 2023 and 2024 public traces): CSV whose header names `TIMESTAMP`, `ContextTokens`,
  `GeneratedTokens` (other columns ignored), TIMESTAMP a date-time (`2023-11-16 18:15:46.6805900`,
  `2024-05-10 00:00:00.009930+00:00`: any number of fractional digits, an offset or `Z`; without
  one it is UTC) or seconds;
- JSONL: one object a line with `t_s` (or `timestamp`, seconds), `prompt_tokens`,
  `output_tokens` and optionally `tag`.

`synthetic` makes traces for tests and benches: Poisson or bursty (Poisson bursts of
back-to-back arrivals) with lognormal prompt and output lengths. `diurnal` makes a day of
traffic: Poisson arrivals whose rate follows a cosine over the period, with an optional shift
of the length mix at a given time (the tuner's bench, docs/tuner.md).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from powerprof.errtext import error_text


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceRequest:
    t_s: float  # arrival, seconds after the trace's first request
    prompt_tokens: int
    output_tokens: int
    tag: str | None = None


# A longer span is no trace in seconds (milliseconds or a typo), and its nanoseconds overflow the scheduler.
MAX_SPAN_S = 1e9
# More tokens in one request is no model's context (a typo or a unit slip): 1e12 output tokens kept a
# replay generating for ever, and as many prompt tokens would build the prompt text in memory first.
MAX_TOKENS = 10_000_000
# A context length many servers are started with (llama.cpp -c 4096): `powerprof trace` says what would not fit it.
COMMON_CONTEXT_TOKENS = 4096


def _finite(t: float) -> float:
    if not math.isfinite(t):
        raise ValueError(f"arrival time {t!r} is not a finite number of seconds")
    return t


_FRACTION = re.compile(r"\.(\d+)")


def _when(text: str) -> float:
    text = text.strip()
    try:
        return _finite(float(text))
    except ValueError as e:
        if "finite" in str(e):
            raise
    # The fraction is cut out and added back: fromisoformat keeps 6 digits (Azure 2023 has 7), and the
    # offset after it (Azure 2024: `.009930+00:00`) then parses with the rest.
    m = _FRACTION.search(text)
    frac = float("0." + m.group(1)) if m else 0.0
    if m:
        text = text[:m.start()] + text[m.end():]
    if text[-1:] in ("Z", "z"):  # fromisoformat takes Z only from Python 3.11
        text = text[:-1] + "+00:00"
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        # Not the machine's zone: a trace read across a daylight-saving change there gained or lost an hour.
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp() + frac


def _positive_int(v, what: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    try:
        n = int(v)
    except OverflowError:  # Infinity
        raise ValueError(f"{what} must be a non-negative integer, got {v!r}") from None
    if n < 0 or n != float(v):
        raise ValueError(f"{what} must be a non-negative integer, got {v!r}")
    if n > MAX_TOKENS:
        raise ValueError(f"{what} {n} is more than {MAX_TOKENS:,} tokens in one request")
    return n


def read_trace(path: str | Path) -> list[TraceRequest]:
    """A trace file (Azure CSV or JSONL, told by its first line), sorted by arrival, offsets from 0."""
    p = Path(path)
    data = trace_bytes(p)
    try:
        # utf-8-sig: a spreadsheet's byte-order mark otherwise hid the header ("got \ufeffTIMESTAMP").
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise TraceError(f"{p}: not a text trace (byte {e.start} is not UTF-8); want an Azure CSV or JSONL") from None
    return _parse_trace(p, text)


def trace_bytes(p: Path) -> bytes:
    """The trace file's bytes, decompressed where it is gzip (the bytes a run's trace sha256 is of: a trace and its
    gzip are the same traffic)."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror or e}") from None
    if data[:2] == b"\x1f\x8b":
        # gzip, whatever the name (an Azure trace downloaded as .csv.gz, or renamed .jsonl): it said only that byte 1
        # was not UTF-8. Read as its text.
        import gzip
        import zlib

        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(f"{p}: gzip-compressed, but it cannot be decompressed ({e}); the file is cut short or "
                             "damaged: download it again (or `gunzip -t` it to see)") from None
    return data


_JSONL_WANT = '{"t_s" (or "timestamp"), "prompt_tokens", "output_tokens"[, "tag"]}'
_JSON_KINDS = ((bool, "a JSON boolean"), (dict, "a JSON object"), (list, "a JSON array"), (str, "a JSON string"),
               ((int, float), "a JSON number"), (type(None), "JSON null"))


def _record_problem(d) -> str | None:
    """Why a JSONL line's value is no trace record in the documented format's terms, or None: a KeyError said
    "KeyError: 'timestamp'", a field the message's own list of wanted fields did not name."""
    if not isinstance(d, dict):
        kind = next((k for t, k in _JSON_KINDS if isinstance(d, t)), "no JSON object")
        return f"{kind}, not an object"
    missing = [shown for keys, shown in ((("t_s", "timestamp"), '"t_s" (or "timestamp")'),
                                         (("prompt_tokens",), '"prompt_tokens"'), (("output_tokens",), '"output_tokens"'))
               if not any(k in d for k in keys)]
    if not missing:
        return None
    have = [json.dumps(k) for k in d]
    fields = ", ".join(have[:8]) + (f" and {len(have) - 8} more" if len(have) > 8 else "")
    return f"it has no {', '.join(missing)}" + (f" (its fields: {fields})" if have else " (it is empty)")


def _parse_trace(p: Path, text: str) -> list[TraceRequest]:
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if not first:
        raise TraceError(f"{p}: the trace is empty; want an Azure CSV or JSONL "
                         "(`powerprof trace OUT.jsonl` writes a synthetic one)")
    out: list[tuple[float, int, int, str | None]] = []
    if first.lstrip().startswith("{"):
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if (why := _record_problem(d)) is not None:
                    raise TraceError(f"{p}:{i}: not a trace record: {why}; want {_JSONL_WANT}")
                t = d["t_s"] if "t_s" in d else d["timestamp"]
                if isinstance(t, bool):
                    raise ValueError(f"arrival time {t!r} is not a number of seconds")
                t = _when(str(t)) if isinstance(t, str) else _finite(float(t))
                tag = d.get("tag")
                if tag is not None and (isinstance(tag, bool) or not isinstance(tag, (str, int, float))):
                    raise ValueError(f"tag must be a string, got {tag!r}")  # a dict became the tag "{'a': 1}"
                if tag is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(tag)):
                    # It travels as a header: aiohttp refused it mid-replay, the requests before it already sent.
                    raise ValueError(f"tag {tag!r} holds a control character: it cannot be sent as an HTTP header")
                if tag is not None and any(0xD800 <= ord(c) <= 0xDFFF for c in str(tag)):
                    raise ValueError(f"tag {tag!r} holds a lone surrogate (half a \\u escape pair): not Unicode text, "
                                     "it cannot be sent as an HTTP header")
                out.append((t, _positive_int(d["prompt_tokens"], "prompt_tokens"),
                            _positive_int(d["output_tokens"], "output_tokens"), None if tag is None else str(tag)))
            except TraceError:
                raise
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{p}:{i}: not a trace record ({error_text(e)}); want {_JSONL_WANT}") from None
    else:
        rows = csv.reader(lines)
        try:
            header = [h.strip() for h in next(rows, [])]
            want = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
            if not all(w in header for w in want):
                raise TraceError(f"{p}: not an Azure trace: the header must name {', '.join(want)} "
                                 f"(got {', '.join(header)})")
            ix = [header.index(w) for w in want]
            for i, row in enumerate(rows, 2):
                if not row or not "".join(row).strip():
                    continue
                if len(row) <= max(ix):
                    raise TraceError(f"{p}:{i}: bad row ({len(row)} fields, the header names {len(header)}: "
                                     f"{', '.join(header)}); every row needs {', '.join(want)}")
                try:
                    out.append((_when(row[ix[0]]), _positive_int(row[ix[1]], "ContextTokens"),
                                _positive_int(row[ix[2]], "GeneratedTokens"), None))
                except ValueError as e:
                    raise TraceError(f"{p}:{i}: bad row ({e})") from None
        except csv.Error as e:  # a field over csv's 131,072-character limit: it ended `replay` in a traceback
            raise TraceError(f"{p}:{rows.line_num}: not CSV the trace reader can read ({e}); want an Azure CSV "
                             "(TIMESTAMP, ContextTokens, GeneratedTokens) or JSONL") from None
    if not out:
        raise TraceError(f"{p}: the trace has no requests")
    out.sort(key=lambda r: r[0])
    t0 = out[0][0]
    if out[-1][0] - t0 > MAX_SPAN_S:
        raise TraceError(f"{p}: the arrivals span {out[-1][0] - t0:g} s, more than {MAX_SPAN_S:g} s: "
                         "times must be seconds (or Azure date-times)")
    return [TraceRequest(t - t0, pt, ot, tag) for t, pt, ot, tag in out]


def write_jsonl(trace: list[TraceRequest], path: str | Path) -> None:
    """Write `trace` as JSONL atomically: an interrupted write leaves `path` as it was, never half a trace."""
    from powerprof.storage.atomic import atomic_path  # noqa: PLC0415

    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for r in trace:
            d = {"t_s": round(r.t_s, 6), "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            if r.tag is not None:
                d["tag"] = r.tag
            f.write(json.dumps(d) + "\n")


def shape(trace: list[TraceRequest], time_scale: float = 1.0, duration_s: float | None = None) -> list[TraceRequest]:
    """Arrivals divided by `time_scale` (2 = twice as fast), then only those before `duration_s`."""
    if time_scale <= 0:
        raise ValueError("time scale must be positive")
    out = [TraceRequest(r.t_s / time_scale, r.prompt_tokens, r.output_tokens, r.tag) for r in trace]
    out = [r for r in out if duration_s is None or r.t_s < duration_s]
    # The span is checked again once scaled: --time-scale 1e-12 made an hour's trace a replay waiting
    # 1e15 s (silent), and 1e-300 an infinite one (an OverflowError traceback after the server had started).
    if out and not out[-1].t_s <= MAX_SPAN_S:
        raise TraceError(f"--time-scale {time_scale:g} spreads the arrivals over {out[-1].t_s:g} s, more than "
                         f"{MAX_SPAN_S:g} s (2 = twice as fast, 0.5 = half as fast)")
    return out


def synthetic(
    n: int,
    rate_per_s: float,
    arrivals: str = "poisson",
    prompt_median: float = 400.0,
    prompt_sigma: float = 1.0,
    output_median: float = 80.0,
    output_sigma: float = 0.8,
    prompt_range: tuple[int, int] = (4, 4096),
    output_range: tuple[int, int] = (8, 600),
    burst_size: float = 8.0,
    tags: tuple[str, ...] = (),
    seed: int = 0,
    max_context: int | None = None,
) -> list[TraceRequest]:
    """`n` requests at `rate_per_s` on average. arrivals: poisson, or bursty (bursts of a geometric
    number of requests, mean `burst_size`, arriving within 50 ms, the bursts Poisson). Lengths are
    lognormal around the medians, clipped to the ranges; tags, if given, are drawn uniformly.
    max_context: prompt + output of each at most this (the prompt cut, to one token at least): what a server started
    with that context holds (llama.cpp's -c 4096 refused the ranges' longest, 4096 + 600, with HTTP 400)."""
    if n < 1 or rate_per_s <= 0:
        raise ValueError("n must be at least 1 and the rate positive")
    if arrivals not in ("poisson", "bursty"):
        raise ValueError("arrivals must be poisson or bursty")
    rng = np.random.default_rng(seed)
    if arrivals == "poisson":
        t = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    else:
        t = []
        now = 0.0
        while len(t) < n:
            now += rng.exponential(burst_size / rate_per_s)
            k = int(rng.geometric(1.0 / burst_size))
            t.extend(now + np.sort(rng.uniform(0, 0.05, k)))
        t = np.array(t[:n])
    t = t - t[0]
    p, o = _lengths(rng, n, LengthMix(prompt_median, prompt_sigma, output_median, output_sigma), prompt_range, output_range)
    if max_context is not None:
        o = np.minimum(o, max_context - 1)
        p = np.maximum(np.minimum(p, max_context - o), 1)
    tg = [tags[i] for i in rng.integers(0, len(tags), n)] if tags else [None] * n
    return [TraceRequest(float(a), int(b), int(c), d) for a, b, c, d in zip(t, p, o, tg)]


@dataclass(frozen=True)
class LengthMix:
    """Lognormal prompt and output lengths (tokens): medians and log-space spreads."""

    prompt_median: float = 400.0
    prompt_sigma: float = 1.0
    output_median: float = 80.0
    output_sigma: float = 0.8


def _lengths(rng, n: int, mix: LengthMix, prompt_range, output_range) -> tuple[np.ndarray, np.ndarray]:
    p = np.clip(np.round(rng.lognormal(math.log(mix.prompt_median), mix.prompt_sigma, n)), *prompt_range).astype(int)
    o = np.clip(np.round(rng.lognormal(math.log(mix.output_median), mix.output_sigma, n)), *output_range).astype(int)
    return p, o


def diurnal_rate(t_s, mean_rate_per_s: float, amplitude: float, period_s: float, trough_s: float = 0.0):
    """Arrival rate at `t_s`: mean·(1 − amplitude·cos(2π(t − trough)/period)), lowest at `trough_s`."""
    return mean_rate_per_s * (1.0 - amplitude * np.cos(2 * np.pi * (np.asarray(t_s, dtype=float) - trough_s) / period_s))


def diurnal(
    duration_s: float,
    mean_rate_per_s: float,
    amplitude: float = 0.5,
    period_s: float = 86400.0,
    trough_s: float = 0.0,
    mix: LengthMix = LengthMix(),
    shift_at_s: float | None = None,
    shift_mix: LengthMix | None = None,
    shift_rate_factor: float = 1.0,
    prompt_range: tuple[int, int] = (4, 4096),
    output_range: tuple[int, int] = (8, 600),
    seed: int = 0,
) -> list[TraceRequest]:
    """Poisson arrivals over `duration_s` at `diurnal_rate` (drawn by thinning), lengths from `mix`;
    from `shift_at_s` on, lengths from `shift_mix` and the rate times `shift_rate_factor` (a shift in
    the traffic's regime: say chat by day, long-document summaries by night)."""
    if duration_s <= 0 or mean_rate_per_s <= 0 or not 0 <= amplitude < 1 or period_s <= 0:
        raise ValueError("want a positive duration, rate and period, and 0 <= amplitude < 1")
    if (shift_at_s is None) != (shift_mix is None) or shift_rate_factor <= 0:
        raise ValueError("a shift needs both shift_at_s and shift_mix, and a positive rate factor")
    rng = np.random.default_rng(seed)
    top = mean_rate_per_s * (1 + amplitude) * max(1.0, shift_rate_factor)
    t = np.cumsum(rng.exponential(1.0 / top, int(duration_s * top * 1.2) + 100))
    t = t[t < duration_s]
    rate = diurnal_rate(t, mean_rate_per_s, amplitude, period_s, trough_s)
    late = t >= shift_at_s if shift_at_s is not None else np.zeros(t.size, bool)
    rate = np.where(late, rate * shift_rate_factor, rate)
    t = t[rng.uniform(0, top, t.size) < rate]
    late = t >= shift_at_s if shift_at_s is not None else np.zeros(t.size, bool)
    p, o = _lengths(rng, t.size, mix, prompt_range, output_range)
    if shift_mix is not None and late.any():
        p2, o2 = _lengths(rng, int(late.sum()), shift_mix, prompt_range, output_range)
        p[late], o[late] = p2, o2
    if t.size == 0:
        raise ValueError("no request arrived: raise the rate or the duration")
    t = t - t[0]
    return [TraceRequest(float(a), int(b), int(c)) for a, b, c in zip(t, p, o)]
