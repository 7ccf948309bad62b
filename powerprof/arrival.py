"""How one request's tokens arrived, and the rule that says how its decode window is timed.

Pure functions over token-bearing events (arrival ns, tokens, grouped into socket reads by
their shared arrival time). A read is one chunk the client took off the socket: the events in it
arrived together, whatever the server meant. The window's rate is tokens that arrived after its
first read ÷ (last read − first read), so what matters is that both edge reads are fresh: a read
that holds several events (a buffering proxy, a client starved of CPU) can be late by any amount,
and so can one that follows an unusually long silence. Mid-window bursts do not matter: their
tokens are inside the window either way. So the window's edges are its outermost fresh reads,
and an event-loop stall at an edge (measured by the client) bounds what is left.

Classification (docs/workload.md, "The timing rule"):
- `stream`: every token counted by the stream, at least MIN_WINDOW_READS reads and
  MIN_WINDOW_SHARE of the decode tokens between fresh edges, no read holding more than
  MAX_READ_SHARE of them, and client lag at the edges ≤ STREAM_ERROR_BOUND of the window.
  What is left after the beat rules is about one production interval per edge (a fresh read's
  newest event is at most that old), i.e. ≈ 1/window_reads of the window.
- `server`: not stream-timed, but the server gave its own decode time for this request.
- `untrusted`: neither, or the server's own count of generated tokens contradicts its stream
  (`count_problem`): then neither the stream's tokens nor the server's figures can be believed,
  and the window counts in no figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

LIMIT_FIX = ("stop whatever else sets GPU power limits meanwhile (nvidia-smi -pl in a script, DCGM power policies, "
             "a cluster power manager, `powerprof tune` on this GPU) and rerun")

CLOCK_FIX = ("stop whatever else sets or resets GPU clocks meanwhile (nvidia-smi -lgc/-rgc or -ac/-rac in a "
             "script, DCGM, a cluster manager, a GPU reset) and rerun")
# Windows no reading vouched for by the level's end: the sampler lagged behind (sweep._leave_out_unvouched).
UNVOUCHED_FIX = ("run the sweep where the sampler keeps up: stop other CPU-heavy jobs on the host, or sample less "
                 "often (--interval)")

MIN_WINDOW_READS = 4  # reads after the first: fewer and the window is a handful of instants
MAX_READ_SHARE = 0.25  # of the window's tokens in one read: more is a burst, not a stream
# A stall of the client's loop delays the reads after it; one longer than two beats leaves a
# long silence or a pile, which the beat rules already see (a catch-up read is a pile, the read
# after a stall follows a long gap), so an on-beat edge read can only have waited up to two
# beats. Lag beyond that at a fresh edge is a contradiction the rule does not vouch for.
STREAM_ERROR_BOUND = 0.01  # edge lag beyond two beats (and the 2 ms floor), as a share of the window
# Lateness of the client's loop below this is timer granularity (epoll waits in whole
# milliseconds), seen on an idle machine too; a read, woken by the socket, is not late by it.
LAG_FLOOR_S = 0.002
SERVER_DISAGREE_BOUND = 0.05  # stream and server rates further apart than this: said, server's used
# Tokens a server may count without ever streaming them, where its chunks carry its running count:
# llama-server drops the bytes of an unfinished UTF-8 character at the end (a 4-byte character is
# up to 3 byte tokens), and an end-of-generation token has no text. Measured on llama-server
# b11434: every stream's count equalled `predicted_n` (native, completions; stop words; drafts).
COUNT_SLACK_TOKENS = 3

TIMINGS = ("stream", "server", "untrusted")
# Which rule a server's count broke (count_problem): the daemon's /metrics label, so a name, not text.
STREAM_ABOVE_COUNT = "stream_above_count"  # the stream carried more tokens than the server counted
RUNNING_COUNT_SHORT = "running_count_short"  # the final count is above the running count the chunks carried
# A whole (non-streamed) answer of several choices whose count is its first choice's alone (llama.cpp: one task a
# choice, and the answer carries the first task's usage and timings), where the others' may differ.
FIRST_CHOICE_ONLY = "first_choice_only"
COUNT_PROBLEM_KINDS = (STREAM_ABOVE_COUNT, RUNNING_COUNT_SHORT, FIRST_CHOICE_ONLY)


@dataclass(frozen=True)
class ArrivalQuality:
    """How the tokens of one request arrived (all over token-bearing reads), and its window."""

    n_reads: int  # distinct reads that carried tokens
    n_events: int  # token-bearing server events
    max_read_share: float | None  # largest share of the generated tokens in one read
    max_events_per_read: int
    gap_p50_s: float | None  # median gap between consecutive token-bearing reads
    gap_max_s: float | None
    t_first_ns: int | None  # window start: the first read, or the first fresh one after it
    t_last_ns: int | None  # window end: the last fresh read
    window_tokens: int  # tokens that arrived in (t_first, t_last]
    window_reads: int  # reads in (t_first, t_last]
    window_max_share: float | None  # largest share of window_tokens in one of those reads
    window_share: float  # window_tokens ÷ the tokens after the first read: how much the trimming kept
    trimmed: bool  # an edge moved inwards past a read that was not fresh
    uncounted: int  # tokens the server counted that no event showed (their arrival is unknown)
    counted: int = 0  # tokens the events showed
    first_fresh: bool = True  # the very first read came on time (no pile, no catch-up after it)
    last_fresh: bool = True  # the very last read came on time: the end of the stream is known
    t_end_read_ns: int | None = None  # the very last read, fresh or not: no token can have left the server after it


FRESH_GAP = (0.5, 2.0)
SAME_DELIVERY_NS = 1_000_000  # chunks closer than this are one delivery (one server write, split)  # a fresh read follows its predecessor by this many median gaps


def reads(arrival_ns, tokens, events=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(read time ns, tokens, events) per read, token-less events dropped; chunks under
    SAME_DELIVERY_NS apart count as one read."""
    t = np.asarray(arrival_ns, dtype=np.int64)
    k = np.asarray(tokens, dtype=np.int64)
    e = np.ones_like(k) if events is None else np.asarray(events, dtype=np.int64)
    keep = k > 0
    t, k, e = t[keep], k[keep], e[keep]
    if t.size == 0:
        return t, k, e
    order = np.argsort(t, kind="stable")
    t, k, e = t[order], k[order], e[order]
    # One server write can reach the client as two chunks a fraction of a millisecond apart
    # (llama-server's speculative steps: the first token, then the accepted drafts): such chunks
    # are one delivery, timed when its last part came.
    new = np.concatenate([[True], np.diff(t) > SAME_DELIVERY_NS])
    starts = np.flatnonzero(new)
    ends = np.concatenate([starts[1:], [t.size]]) - 1
    return t[ends], np.add.reduceat(k, starts).astype(np.int64), np.add.reduceat(e, starts).astype(np.int64)


def fresh_reads(t_ns: np.ndarray, events: np.ndarray) -> np.ndarray:
    """Reads whose arrival time can be trusted as an edge: on the stream's beat, holding no pile.

    A read that follows an unusually long silence (over FRESH_GAP[1] median gaps) may have been
    held back — by a proxy, or by a client that was not reading — and its newest event may be
    stale by any amount (the generation can end while it is held). After an unusually short one,
    its predecessor was late. A read holding more than twice the usual number of events is a
    pile that gathered somewhere. Several events per read on every read is the server's own
    grouping (speculative decoding sends each step's tokens at once): those stay fresh. The
    first read (prefill output) has no gap before it: it is fresh when it holds no pile and the
    next read is no catch-up."""
    n = t_ns.size
    usual = max(2.0, 2.0 * float(np.median(events))) if n else 2.0
    fresh = events <= usual
    if n < 2:
        return fresh
    gaps = np.diff(t_ns).astype(float)
    g = float(np.median(gaps))
    lo, hi = FRESH_GAP
    on_beat = (gaps >= lo * g) & (gaps <= hi * g)
    fresh[1:] &= on_beat
    fresh[0] &= bool(gaps[0] >= lo * g)
    return fresh


def arrival_quality(arrival_ns, tokens, generated: int | None = None, events=None) -> ArrivalQuality:
    """Arrival statistics of one request's token events and its decode window.

    The window runs between the outermost fresh reads (`fresh_reads`); its tokens are those that
    arrived after its first read. On a smooth stream that is first read → last read and
    generated − 1 tokens. `generated` is the server's own total."""
    rt, rk, re_ = reads(arrival_ns, tokens, events)
    counted = int(rk.sum())
    total = counted if generated is None else max(int(generated), counted)
    if rt.size == 0:
        return ArrivalQuality(0, 0, None, 0, None, None, None, None, 0, 0, None, 0.0, False, total - counted, counted)
    gaps = np.diff(rt) / 1e9
    fresh = fresh_reads(rt, re_)
    idx = np.flatnonzero(fresh)
    a, b = (int(idx[0]), int(idx[-1])) if idx.size else (0, 0)
    # Tokens the server counted that no event showed are taken to lie inside the window (the
    # rule then does not trust the stream's timing: where they arrived is unknown).
    win = rk[a + 1 : b + 1]
    window = int(win.sum()) + (total - counted)
    after_first = int(rk[1:].sum()) + (total - counted)
    return ArrivalQuality(
        n_reads=int(rt.size),
        n_events=int(re_.sum()),
        max_read_share=float(rk.max() / total) if total > 0 else None,
        max_events_per_read=int(re_.max()),
        gap_p50_s=float(np.median(gaps)) if gaps.size else None,
        gap_max_s=float(gaps.max()) if gaps.size else None,
        t_first_ns=int(rt[a]),
        t_last_ns=int(rt[b]),
        window_tokens=window,
        window_reads=int(b - a),
        # One read and tokens the server counted beyond it: an empty window that still holds tokens.
        window_max_share=float(win.max() / window) if window > 0 and win.size else None,
        window_share=window / after_first if after_first > 0 else 0.0,
        trimmed=bool(a != 0 or b != rt.size - 1),
        uncounted=total - counted,
        counted=counted,
        first_fresh=bool(fresh[0]),
        last_fresh=bool(fresh[-1]),
        t_end_read_ns=int(rt[-1]),
    )


@dataclass(frozen=True)
class Timing:
    """The timing a window's figures use, and why."""

    kind: str  # stream | server | untrusted
    reason: str | None  # why not stream-timed (None when it is)
    stream_error_bound: float | None  # estimated error of the stream rate (fraction)
    decode_s: float | None
    decode_tokens: int
    t0_ns: int | None  # energy window edges, consistent with the timing used
    t1_ns: int | None
    disagreement: float | None = None  # stream rate ÷ server rate − 1, when both exist


MIN_WINDOW_SHARE = 0.5  # the fresh-edged window must hold at least half the decode tokens


def stream_problem(q: ArrivalQuality, client_lag_s: float | None = None) -> tuple[str | None, float | None]:
    """(why the stream cannot time this window or None, its estimated error bound)."""
    if q.n_reads == 0 or q.t_first_ns is None:
        return "no token arrived", None
    if q.uncounted > 0:
        return f"{q.uncounted} tokens the server counted arrived in chunks that did not say how many they held", None
    if q.window_reads < MIN_WINDOW_READS or q.window_share < MIN_WINDOW_SHARE:
        return (
            f"tokens arrived in {q.n_reads} read{'s' if q.n_reads != 1 else ''} "
            f"(largest {100 * (q.max_read_share or 0):.0f}% of them, up to {q.max_events_per_read} events held together): "
            "delivered in bursts, not streamed",
            None,
        )
    dur_s = (q.t_last_ns - q.t_first_ns) / 1e9
    lag = max((client_lag_s or 0.0) - max(LAG_FLOOR_S, 2.0 * (q.gap_p50_s or 0.0)), 0.0)
    bound = lag / dur_s if dur_s > 0 else float("inf")
    if q.window_max_share is not None and q.window_max_share > MAX_READ_SHARE:
        return f"one read carried {100 * q.window_max_share:.0f}% of the decode tokens: delivered in bursts", bound
    if bound > STREAM_ERROR_BOUND:
        return f"window edges may be off by {100 * bound:.1f}% (the client was late reading: its loop stalled {1e3 * (client_lag_s or 0):.0f} ms)", bound
    return None, bound


class CountProblem(NamedTuple):
    """Which rule a server's count broke (one of COUNT_PROBLEM_KINDS) and why, both counts named."""

    kind: str
    message: str


def count_problem(stream_tokens: int, server_tokens: int | None, running: bool = False,
                  held: bool = False) -> CountProblem | None:
    """Why the server's own count of generated tokens cannot be believed beside its stream (None: it can).

    The server's count (usage, llama.cpp `tokens_predicted`/`predicted_n`) is the authority on how
    many tokens were generated; the stream can only show fewer: a server counts tokens it does not
    send (llama-server holds back an unfinished UTF-8 character's bytes, its chat endpoint skips
    tokens that add no text: 34 of 40 seen), and a chunk without counts may hold several. It can
    never show more: tokens streamed beyond the server's count mean the count is wrong (or something
    between rewrote the stream), and J/token would be off by their ratio. Where every chunk carried
    the server's running count (`running`), the stream's count *is* the server's, and a final count
    more than COUNT_SLACK_TOKENS above it contradicts the server's own figures, unless `held` (held_call_at_limit:
    a tool call cut by max_tokens that the server's parser held in no chunk) accounts for the rest."""
    if server_tokens is None:
        return None
    if stream_tokens > server_tokens:
        return CountProblem(STREAM_ABOVE_COUNT, f"the server counted {server_tokens} generated tokens but its stream "
                            f"carried {stream_tokens}: the server's token count cannot be believed")
    if running and server_tokens - stream_tokens > COUNT_SLACK_TOKENS and not held:
        return CountProblem(RUNNING_COUNT_SHORT, f"the server counted {server_tokens} generated tokens but its own "
                            f"running count in the stream reached {stream_tokens}: the server's token count cannot be believed")
    return None


# A held call's tokens were decoded after its last counted chunk, at about the stream's own pace: a final count whose
# surplus would need that gap to run more than this many times faster than the stream did is no held call (a liar's 994
# tokens in 0.36 ms after chunks 10 ms apart: 27,000 times). Not 4: a request's first steps share theirs with other
# requests' prefills, its tail's often not: 60 simulated SGLang requests (30 held calls, bursty arrivals, a loaded
# host) needed up to 6.7 times their first steps' pace; 4 flagged 3 honest held calls of 30.
HELD_PACE_DIVISOR = 16


def at_limit(choice_stops: dict, generated: int | None, max_tokens: int | None, sequences: int) -> bool:
    """Every one of the request's `sequences` finished at `length` (`choice_stops`: each choice's finish reason by its
    index; one choice's length beside another's early stop is not the limit) and the server's count is exactly
    max_tokens for each: whole, whatever its chunks said. False where the request set no max_tokens (the server's
    default, or a limit it clamped to the context, is not known here)."""
    return (max_tokens is not None and generated == max_tokens * sequences and len(choice_stops) == sequences
            and all(r == "length" for r in choice_stops.values()))


class HeldCall(NamedTuple):
    """What the daemon knows of a request that could end in a held tool call: one that carried `tools` with a
    tool_choice other than "none" (without tools no parser holds anything)."""

    max_tokens: int | None  # for each sequence; None: not set
    sequences: int
    step_ns: float | None  # the stream's own time per decode step, first to last counted chunk (None: none counted)
    tail_ns: int  # from its last counted chunk to the upstream's end of the response


def held_call_at_limit(held: HeldCall | None, choice_stops: dict, generated: int | None, seen: int) -> bool:
    """A final count above the running counts that a tool call cut by max_tokens explains: SGLang's chat sends no
    chunk, so no running count, for tokens its tool-call parser holds, and a call cut by max_tokens can hold all of its
    own (the deepseekv3 detector sends a call only once its closing fence is written, the qwen3_coder one a parameter's
    value only once `</parameter>` is). Believed only where the request carried tools, every sequence stopped at its
    max_tokens (at_limit) and the time from the last chunk to the end could have decoded the surplus at the stream's
    own pace (HELD_PACE_DIVISOR); no pace (no chunk counted before the call), no belief."""
    if held is None or held.step_ns is None or generated is None:
        return False
    if not at_limit(choice_stops, generated, held.max_tokens, held.sequences):
        return False
    surplus_steps = max(generated - seen, 0) / held.sequences
    return held.tail_ns * HELD_PACE_DIVISOR >= surplus_steps * held.step_ns


def first_choice_only(n_choices: int, first_tokens: int) -> CountProblem:
    """A whole answer of `n_choices` choices whose count (`first_tokens`) is its first choice's alone."""
    return CountProblem(FIRST_CHOICE_ONLY, f"the server's count ({first_tokens} generated tokens) is that of the first "
                        f"of its {n_choices} choices alone (llama.cpp's non-streamed answer to n > 1 or a list of "
                        "prompts): the others' are unknown; stream the request (stream: true), whose every choice "
                        "sends its own count")


def classify(
    q: ArrivalQuality,
    generated: int | None,
    server_decode_s: float | None = None,
    server_decode_tokens: int | None = None,
    client_lag_s: float | None = None,
    stream_tokens: int | None = None,
    running_counts: bool = False,
) -> Timing:
    """The timing rule: stream when the stream can be trusted, else the server's own figures, else untrusted.

    When both exist and disagree by more than SERVER_DISAGREE_BOUND the server's figure is used
    (a smooth stream can still hide a steady client-side delay; the server timed itself). First,
    `generated` (the server's own count) is checked against the tokens the stream showed
    (`stream_tokens`, default the events in `q`; `running_counts`: every chunk carried the server's
    running count): a contradiction (`count_problem`) makes the window untrusted whatever else is known."""
    stream_s = (q.t_last_ns - q.t_first_ns) / 1e9 if q.t_first_ns is not None else None
    lie = count_problem(q.counted if stream_tokens is None else stream_tokens, generated, running_counts)
    if lie is not None:
        return Timing("untrusted", lie.message, None, stream_s, q.window_tokens, q.t_first_ns, q.t_last_ns)
    problem, bound = stream_problem(q, client_lag_s)
    has_server = server_decode_s is not None and server_decode_s > 0 and (server_decode_tokens or 0) > 0
    disagree = None
    if has_server and problem is None and stream_s and q.window_tokens > 0:
        disagree = (q.window_tokens / stream_s) / (server_decode_tokens / server_decode_s) - 1.0
    if problem is None and (disagree is None or abs(disagree) <= SERVER_DISAGREE_BOUND):
        return Timing("stream", None, bound, stream_s, q.window_tokens, q.t_first_ns, q.t_last_ns, disagree)
    if has_server and q.t_last_ns is not None:
        if problem is None:
            problem = f"stream and server rates differ by {100 * disagree:+.1f}% (bound ±{100 * SERVER_DISAGREE_BOUND:.0f}%)"
        # The server's decode time is hung on an end of the stream that came on time: its last token
        # left when the last read arrived, or its first when the first did. A fresh read mid-stream is
        # neither: a window hung there (a stream held after it) took in prefill and idle time.
        d_ns = int(server_decode_s * 1e9)
        if q.last_fresh:
            t0, t1 = q.t_last_ns - d_ns, q.t_last_ns
        elif q.first_fresh:
            # A first read judged on time can still have been held: behind a hop that passes the stream on in bursts
            # every read is a pile of the same size, so none stands out, and the first came 0.7-0.9 s after its
            # token (tests/test_sweep_accuracy.py). No token reached the client after its last read, so a decode
            # hung there ending later contradicts the stream: it ends at that read instead (the server finished
            # then; its last burst is its end), or its window took in idle time past the response and ended after
            # every counter read when it was costed (no energy at all).
            t1 = q.t_first_ns + d_ns
            if q.t_end_read_ns is not None and t1 > q.t_end_read_ns:
                t1 = q.t_end_read_ns
            t0 = t1 - d_ns
        else:
            return Timing("untrusted", f"{problem}; the server's decode time cannot be placed: neither the first nor "
                          "the last read came on time", bound, stream_s, q.window_tokens, q.t_first_ns, q.t_last_ns, disagree)
        return Timing("server", problem, bound, server_decode_s, int(server_decode_tokens), t0, t1, disagree)
    return Timing("untrusted", problem, bound, stream_s, q.window_tokens, q.t_first_ns, q.t_last_ns, disagree)


# Windows left out because the level's setting did not hold or could not be vouched for in them (sweep.distrust and
# measure's, in `timing` untrusted as the rest): (words of their reason, their group, its fix). Counted as timing
# reasons, they were told "their timing cannot be trusted" with the timing rule's docs for a fix, at the sweep's end
# and by analyze: not their cause, no fix (left_out_words, fix_for).
SETTING_REASONS = (
    ("no GPU reading taken after", "no GPU reading vouched for the level's setting before the level ended (the sampler "
     "lagged behind)", UNVOUCHED_FIX),
    ("last busy readings after this window ended", "the GPU's last busy readings showed its SM clock off the setting, "
     "and the level ended before that could be judged", CLOCK_FIX),
    ("power limit read", "the GPU's power limit did not hold (another tool changed it, or the driver lowered it)",
     LIMIT_FIX),
    ("SM clock read", "the GPU's SM clock setting did not hold (another tool changed or released it)", CLOCK_FIX),
)


def left_out_words(group: str | None, timing: str = "their timing cannot be trusted") -> str:
    """Why windows of this reason group are out of the figures, in words: their timing, or the setting they ran at."""
    if any(group == g for _, g, _ in SETTING_REASONS):
        return "the setting they ran at cannot be vouched for"
    return timing


def left_out_text(groups: dict[str, int], n_windows: int, every: str = "the figures",
                  timing: str = "their timing cannot be trusted") -> str:
    """What windows left out of the figures were left out for, in words: `groups` (reason group -> windows) among
    `n_windows` that would otherwise count. Each reason with its count where there are several, and each distinct fix
    (a sweep's windows before its server's restart and one its starved client timed were all said to be the restart's,
    with its fix)."""
    ordered = sorted(groups.items(), key=lambda kv: -kv[1])
    top = ordered[0][0]
    words = list(dict.fromkeys(left_out_words(g, timing) for g, _ in ordered))
    why = top if len(ordered) == 1 else "; ".join(f"{n}: {g}" for g, n in ordered)
    fixes = list(dict.fromkeys(fix_for(g) for g, _ in ordered))
    fix = fixes[0] + "".join(f"; and {f}" for f in fixes[1:])
    return (f"{sum(groups.values())} of {n_windows} windows left out of {every}: {' or '.join(words)} ({why}); "
            f"fix: {fix}")


def reason_group(reason: str | None) -> str:
    """A window's reason without its own figures, so that reasons can be counted together."""
    r = reason or "unknown"
    for words, group, _ in SETTING_REASONS:  # first: their reasons tell readings, not tokens
        if words in r or r == group:
            return group
    if "bursts" in r:
        return "tokens were delivered in bursts, not streamed"
    if "edges may be off" in r:
        return "the client was late reading (starved of CPU)"
    if "did not say" in r:
        return "chunks held several tokens without saying how many"
    if "token count cannot be believed" in r:
        return "the server's token count disagrees with its stream"
    if "not stream-timed" in r:
        return reason_group(r.split(": ", 1)[-1])
    if "ended apart" in r:  # before the queued and apart tests: its reason says how many "decoded at once" too
        return "the batch's streams ended apart (stopped at different lengths): together too briefly for a figure"
    if "decoded apart" in r:  # before the queued test: its reason says how many "streams decoded at once" too
        return "the batch's streams decoded apart (one sent or started late): fewer at once than its concurrency"
    if "streams decoded at once" in r:
        return "the server never ran the batch's streams together: it queued them"
    if "before the server restarted" in r:
        return "measured before the server restarted mid-level (the level was measured again)"
    if "before the server stopped answering" in r:
        return "measured before the server stopped answering mid-level (the level was measured again)"
    return r


def fix_for(reason: str | None) -> str:
    """The advice that goes with a reason for leaving windows out."""
    r = reason or ""
    for words, group, fix in SETTING_REASONS:
        if words in r or r == group:
            return fix
    if "bursts" in r or "did not say" in r or "without saying" in r or "no token" in r:
        return (
            "a buffering proxy sits between powerprof and the server, or the server sends tokens in large groups: "
            "point --server at the server itself, or turn buffering off (nginx: proxy_buffering off); with "
            "speculative decoding (several tokens per event) short requests come in a few groups: generate more "
            "tokens per request (--max-tokens)"
        )
    if "ended apart" in r:  # first: its reason names the lengths, and a server sent no ignore_eos
        return ("the batch's streams stopped at their end-of-text at different lengths, so they decoded together for "
                "only part of the batch (more --max-tokens does not help, and nobody was late): measure on a server "
                "that honours ignore_eos (llama.cpp, SGLang) or min_tokens (vLLM), which powerprof sends so that "
                "each stream generates --max-tokens (TGI and other OpenAI-compatible servers are sent neither); or "
                "read such a batch at the concurrency it achieved (its mean_streams), not at --concurrency")
    if "decoded apart" in r:
        return ("a batch's streams must be sent and served together: powerprof's client was likely starved of CPU "
                "and sent one late, so run it on a less busy host or core (e.g. taskset, nice -n -5); a server that "
                "starts them apart (long prompts prefilled over several steps) needs more tokens per request "
                "(--max-tokens), so that the start is a smaller share of the batch")
    if "client was late" in r or "starved" in r:
        return "powerprof was starved of CPU: run it on a less busy host or core (e.g. taskset, nice -n -5)"
    if "token count" in r:
        return (
            "the server's own count of generated tokens (usage, llama.cpp timings) does not match the tokens it "
            "streamed, so no J/token from it can be right: point --server at the server itself (not a proxy that "
            "rewrites streams), check the server build's usage reporting, and compare with its logs"
        )
    if "server restarted" in r or "server stopped answering" in r:
        return ("none needed for the figures (the level was measured again from scratch once the same server was back); "
                "to keep it from going away, see why in its log (out of memory, a crash) or in what lies between "
                "(a proxy or load balancer that drops connections)")
    if "differ" in r:
        return "check for a proxy or a busy client between powerprof and the server"
    if "queued" in r:
        return ("--concurrency at or under the server's parallel slots (llama.cpp -np, vLLM --max-num-seqs), so the "
                "streams decode together; a server restarted mid-sweep with fewer slots: restart it as it was and rerun")
    return "see docs/workload.md, 'The timing rule'"
