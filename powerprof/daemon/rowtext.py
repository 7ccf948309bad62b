"""The words of the ledger's rows: each note, flag and reason a request, interval or tag row carries, from a request's account.

`ledger.Ledger` decides what a row says (its figures, and which of these apply); here is how each is said, stated once
so a request's, an interval's and a tag's rows say the same cause in the same words, and the fixes with them. A few
predicates on a request (`LiveRequest`) live here too: those its notes' and flags' words are written by, so the flag a row is
counted under (`_request_flags`, COUNTED_FLAGS) and the words it carries never disagree.
"""

from __future__ import annotations

import numpy as np

from powerprof.arrival import at_limit
from powerprof.collectors.cputime import BUSY_HOST_FIX, BUSY_HOST_FLAG, BUSY_HOST_PCT, busy_host_text
from powerprof.energy import COUNTER_STEP_S
from powerprof.profiler import (BEFORE_FIRST_READ_FLAG, NO_COUNTER_SHORT_BUSY_SHARE, NO_COUNTER_SHORT_FIX,
                                NO_COUNTER_SHORT_FLAG)
from powerprof.storage.schema import (BEST_OF_FIX, BEST_OF_FLAG, BYPASS_LOW_FLAG, CACHE_LATE_FIX, CACHE_LATE_FLAG,
                                      NOT_FORWARDED_NOTE, PAST_REACH_FIX, CACHE_UNSAID_FIX, CACHE_UNSAID_FLAG, COUNT_OPEN_FIX, COUNT_OPEN_FLAG,
                                      GONE_PREFILL_FIX, GONE_PREFILL_FLAG, HELD_TAIL_FIX, HELD_TAIL_FLAG, PROMPT_BODY_FIX,
                                      PROMPT_NO_ASK_FIX, PROMPT_RUNNING_USAGE_FIX, PROMPT_STATEFUL_FIX, PROMPT_USAGE_FIX,
                                      PROMPT_UNREAD_FLAG, SERVER_COUNT_COMPLETE, SERVING_ASSERTED_FIX,
                                      SERVING_ASSERTED_FLAG, SERVER_COUNT_USAGE_ABOVE,
                                      SERVER_COUNT_USAGE_BELOW, UNSURE_FLAG, bypass_count_fix, bypass_count_may_be,
                                      outside_text)

from . import attribution as attr
from .liverequest import (CROSSING_CLOSE_MAX_S, PROMPT_HOLD_S, RUN_ON_MAY_END_PACE_MARGIN, RUN_ON_TO_END_MAX_S,
                          body_left, closed_unanswered, crashed, finished_unsaid, gone_unsaid, is_passive, resend_crossed,
                          resend_queued, told_prompt_tokens, LiveRequest, is_unseen, not_forwarded, server_end_ns)
from .proxy import RESEND_LOADING, RESEND_REFUSED
from .promptlen import STATEFUL_REASONS
from .scrape import RUNS_ON_AFTER_LEAVE
from .workmodel import CTX_BAND_SE, IDLE_MIN_S, LOCK_WAIT_S, MIN_BUSY, MIN_BUSY_GPU, MIN_IDLE, MIN_R2

# What an interval row's `server_count` says where the server's count is whole (storage/schema.py states them).
COUNT_COMPLETE = SERVER_COUNT_COMPLETE
# What a row whose server count contradicts its stream says to do about it.
COUNT_FIX = ("fix: point proxy.upstream at the server itself, not at a proxy that rewrites streams, and check the "
             "server build's usage/timings reporting against its logs")
# A request or an interval is flagged CACHE_UNSAID_FLAG (prefix-cache hits the server counted beyond what its
# answers said) from this many unsaid tokens on.
CACHE_UNSAID_MIN = 1.0
# How long past a request's end, gone before its first token, the server may still run its prefill: vLLM and SGLang drop
# an aborted request between engine steps, so the step in flight (a chunk of a chunked prefill: 2048-16384 tokens by
# their defaults, up to ~1 s at 20 000 tokens/s) runs on after the connection closed. The requests live then say their
# share may be off too (GONE_PREFILL_FLAG): on the simulator with that abort, 60-token chats queued behind two such
# prompts took that last step's energy, +29%, in intervals after the proxy had seen them end.
GONE_ABORT_SLACK_S = 1.0
# A request's energy from intervals other requests (or bypass traffic) did work in while the fixed ratio split them
# (the work model's fit not mature) is said on its row from this part of its GPU energy on, and so is what the range
# the ratio stands for could add to it there: below it the ratio moves its figure by a fraction of a percent. That range
# is over the prompt token's cost and the prefill rate alone, and its words say so: read as the row's uncertainty, short
# answers beside long streams decoding lay outside it, all high (+37% where it said -1% to +0%), by the context cost
# the ratio leaves out, which nothing here bounds.
# A request live beside a crash-costed close that may never have run (`resend_queued`: queued unrun;
# `crash_unsure_costed`: a queuing router's refusal) is flagged where its figure would be higher by this share of it or
# more had that close never run (`LiveRequest.queued_short_j`, the split re-run without it): flagged on any overlap,
# 4 streams beside a close 0.10 s after its arrival were left out of J/token for 0.9% each. The other "high by up to"
# flags start at the same share: beside an unplaced or capped run-on, and idle time split before any idle power was
# measured (`_idle_unmeasured`).
QUEUED_BESIDE_MIN_SHARE = 0.01
FIXED_RATIO_MIN_SHARE = 0.05
# A row whose late tokens (placed before an interval already closed: LiveRequest.late) are more than this share of all
# its tokens, and more than one, is flagged (`_late_material`): its energy counts every interval it was live in, its
# attributed tokens not those, and neither divisor is right where requests beside it took part of their work
# (docs/daemon.md, Records, not token events: the figures).
LATE_MATERIAL_SHARE = 0.05
# A row split by the fit says how far its figure moves over the fitted context cost's band (`workmodel.ctx_band`) from
# this share of it on: long-context turns beside short chats, a loaded host, moved -7.4% to +15.4% in sum run to run.
# 15%, past the rows' own spread: at 5% half the rows of tests/test_daemon_prefix_cache.py's llama.cpp scene said it
# (111 of 250), their median row error no larger than the others' (chats 3.6% vs 5.9%, turns 8.4% vs 11.1%), noise.
CTX_BAND_MIN_SHARE = 0.15
CTX_BAND_NOTE = ("its share of the intervals it shared rests on the work model's context cost (a decoded token of a long "
                 "context costs more), which the fit tells only to ±{se:g} standard errors: across them (the decode cost "
                 "moving the other way) its figure moves by {lo:+.0f}% to {hi:+.0f}%, the intervals' sums measured (not a "
                 "bound on its error: its other uncertainties add to it); fix: none for this row, the band narrows on a "
                 "quieter host (the proxy reading tokens on time) and with more traffic")
FIXED_RATIO_LEAD = "{pct}% of its GPU energy is from intervals other requests did work in too (or bypass traffic did)"
# Given none there (not a joule: a share under 0.5% reads "under 1%"): only the range's slow rate places its prompt
# beside the others' work.
FIXED_RATIO_LEAD_NONE = ("none of its GPU energy is from intervals other requests did work in (or bypass traffic did), "
                         "where its prompt may have been prefilled")
FIXED_RATIO_NOTE = ("{lead}, split among them by the fixed ratio (a prompt token costs "
                    f"{attr.DEFAULT_PREFILL_PER_DECODE} of a decoded token and is prefilled at {attr.DEFAULT_PREFILL_TOK_S:.0f} "
                    "tokens/s, no step or context cost) while the work "
                    "model's fit was not mature ({why}): at a prompt token of "
                    f"{attr.PREFILL_PER_DECODE_RANGE[0]}-{attr.PREFILL_PER_DECODE_RANGE[1]} of a decoded token, "
                    f"prefilled at {attr.PREFILL_TOK_S_SLOW:.0f}-{attr.DEFAULT_PREFILL_TOK_S:.0f} tokens/s, its figure "
                    "would be {lo:+.0f}% to {hi:+.0f}% over those two alone, no bound on its error: the step and "
                    "context costs the ratio leaves out move it further, by nothing bounded here (a token of a long "
                    "context costs more: a request of shorter context than those beside it reads high, of longer low), "
                    "the "
                    "intervals' sums are measured; fix: none for these rows, later ones are split by the learned costs "
                    f"once {MIN_BUSY} busy intervals fit with R² ≥ {MIN_R2} (docs/daemon.md, work model): too little "
                    "traffic or a busy host delays that")
# What a row whose stream reached the proxy in one burst says to do about it (`_spread_burst`).
BURST_FIX = ("fix: point proxy.upstream at the server itself, or turn off the buffering of what stands between them "
             "(nginx: proxy_buffering off, or the answer header X-Accel-Buffering: no)")
# What a burst note says to do where the proxy's own event loop was measured late enough to explain the burst
# (`_burst_fix`; the ledger's OWN_LATE_SHARE says when).
OWN_LATE_FIX = "give the daemon's host CPU to spare (fewer other processes, or more proxy.workers)"
# Request flags counted by the rows that say them (Totals.flagged_requests): each a /metrics counter (metrics.py
# FLAG_COUNTERS), counted from the decision its row's energy_note is written by (_request_flags), never from the note's
# text, which quotes what clients send (a path).
COUNTED_FLAGS = (NO_COUNTER_SHORT_FLAG, CACHE_UNSAID_FLAG, CACHE_LATE_FLAG, BEST_OF_FLAG, COUNT_OPEN_FLAG,
                 HELD_TAIL_FLAG, GONE_PREFILL_FLAG, PROMPT_UNREAD_FLAG, SERVING_ASSERTED_FLAG, UNSURE_FLAG)


def tag_server_count(counts: set) -> str | None:
    """A tag's `server_count` from its intervals': one value they all share (complete, off, unread), else every
    reason any of them gives, comma-separated (`complete` dropped: a part of it may be low). None: no interval."""
    if len(counts) <= 1:
        return next(iter(counts), None)
    return ",".join(sorted({w for c in counts for w in c.split(",")} - {COUNT_COMPLETE}))


# An interval whose every GPU's counter read alike at both ends (two reads within one refresh, 10-100 ms: a request's
# edge just after a tick). Its 0.0 J is kept: the staleness at a request's start and end balances out in its own
# figure, and the intervals' sum stays the counter's; left out (the edge dropped), a request arriving just after a
# tick read ~idle x (arrival - tick) low (identical lone requests' J/token spread 6% against 1%,
# bench/attribution_accuracy.py). Said instead.
COUNTER_FLAT_WHY = ("(read twice within one of its refreshes, 10-100 ms), so its energy is in the next interval's "
                    "figure; fix: read the two together (their sum is the counter's)")
COUNTER_FLAT_NOTE = f"gpu_energy_j 0: the energy counter did not move between this interval's reads {COUNTER_FLAT_WHY}"


def _counter_flat_note(per_gpu_j: np.ndarray) -> str | None:
    """COUNTER_FLAT_NOTE where every GPU's counter read alike over the interval; where only some did (GPU 0 at the
    tick's value, GPU 1 refreshed since), which: the sum then holds none of theirs, a plausible figure, low. Whatever
    the interval's method (its weakest GPU's: one whose counter broke there is integrated from power): a GPU's 0 J
    over a positive length is a counter that did not move, as power readings of 0 W are none (collectors.md)."""
    flat = np.flatnonzero(np.asarray(per_gpu_j) == 0)
    if not flat.size:
        return None
    if flat.size == np.size(per_gpu_j):
        return COUNTER_FLAT_NOTE
    return (f"gpu_energy_j holds nothing of GPU {', '.join(str(int(g)) for g in flat)}: its energy counter did not move "
            f"between this interval's reads {COUNTER_FLAT_WHY}")


def _joined(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def _busy_host_note(other_pct: float | None, during: str = "its intervals") -> str | None:
    """A row's CPU figure beside other processes' work (a request's over `during` its intervals, an interval's, a
    tag's): kept, and said (as the sweep flags a level busy-host)."""
    if other_pct is None or other_pct <= BUSY_HOST_PCT:
        return None
    return (f"{BUSY_HOST_FLAG}: {busy_host_text(other_pct, during, 'its cpu_energy_j')}; "
            f"fix: {BUSY_HOST_FIX}")


def _count_low_note(server_count: str | None, where: str, so: str) -> str:
    """Why a row's bypass figures may be off: the server's count over it (`server_count`) may be low (or high, for the
    reasons schema.BYPASS_COUNT_TWO_WAY names), with the fix."""
    why = ", ".join(sorted({w for w in (server_count or "").split(",") if w} - {COUNT_COMPLETE})) or "unknown"
    return (f"{BYPASS_LOW_FLAG}: the server's token count {bypass_count_may_be(server_count)} {where} ({why}: its "
            f"server_count), so {so}; "
            f"fix: {bypass_count_fix(server_count)}")


def _no_counter_short(r: LiveRequest) -> bool:
    """Most of its GPU energy came from intervals without a counter that were mostly idle (NO_COUNTER_SHORT_FLAG)."""
    return r.gpu_j > 0 and not r.gpu_missing and r.no_counter_short_j > 0.5 * r.gpu_j


def _no_counter_short_note(r: LiveRequest) -> str | None:
    """A short request's energy on a GPU without a counter: kept, and said (docs/daemon.md)."""
    if not _no_counter_short(r):
        return None
    return (f"{NO_COUNTER_SHORT_FLAG}: {100 * r.no_counter_short_j / r.gpu_j:.0f}% of its GPU energy is from intervals "
            f"read without an energy counter (power readings) that requests were live in for under "
            f"{100 * NO_COUNTER_SHORT_BUSY_SHARE:.0f}% of their time (read from instant power: for less than all of "
            f"it, as a request between two reads is unseen): the idle power taken out of the rest and the "
            f"readings' timing decide it, not the GPU's own count (it is left out of the daemon's J/token); "
            f"fix: {NO_COUNTER_SHORT_FIX}")


COUNTER_SHORT_FLAG = "counter-short"
COUNTER_SHORT_FIX = ("read J/token summed over many such requests (a tag window around them, the intervals over a "
                     "minute, `powerprof analyze`), where each edge's staleness is a small part; a GPU whose energy "
                     "counter refreshes faster (an A100's every 20 ms, an H200's every 100 ms); or longer requests")


# A request live for less than this has a counter figure good to joules, not to a percentage: each of its edges may
# read the counter up to a refresh stale (docs/daemon.md, "Short sampling intervals": a 64-token request of ~0.45 s
# 2-4% off on a simulated H200, a 25-token one of ~0.17 s 3-12%, 1-3 token ones alone -96% to +147%). By length, as
# `measure` judges its windows, never by what a reading said; the refresh of a card is not known: the coarsest's.
COUNTER_SHORT_SPAN_S = 5 * COUNTER_STEP_S


def _counter_short(r: LiveRequest) -> bool:
    """Live (arrival to the server's end of it) for under COUNTER_SHORT_SPAN_S with most of its GPU energy counted by the
    counter. To the server's end: one SGLang ran on 2 s after its client left 0.15 s in has a figure over 2.15 s, and
    was said "live 0.15 s … not to a percentage"."""
    tr = r.trace
    return (r.gpu_j > 0 and not r.gpu_missing and r.counter_j > 0.5 * r.gpu_j and tr.end_ns is not None
            and (server_end_ns(r) - tr.arrival_ns) / 1e9 < COUNTER_SHORT_SPAN_S)


def _counter_short_note(r: LiveRequest) -> str | None:
    """A short request's counter figure: kept, and said, with how far it may be off and the fix."""
    if not _counter_short(r):
        return None
    span_s = (server_end_ns(r) - r.trace.arrival_ns) / 1e9
    return (f"{COUNTER_SHORT_FLAG}: live {span_s:.2f} s, under {COUNTER_SHORT_SPAN_S:g} s, its GPU energy from the "
            "energy counter, whose reads at the edges of its intervals may each be up to a refresh stale (up to "
            "100 ms: an H200's): this figure is good to about a refresh of the GPU's power at each of its edges (~8 J "
            "idle on an H200), not to a percentage (1-3 token requests alone on a simulated H200 read -96% to +147%), "
            f"whatever its other notes say; fix: {COUNTER_SHORT_FIX}")


def _bypass_low_note(r: LiveRequest) -> str | None:
    """A request given energy of intervals whose bypass count may be low: bypass traffic's energy there may be in its
    share. Kept, and said; `analyze` leaves it out of J/token (docs/daemon.md, The baseline)."""
    if not (r.gpu_j > 0 and not r.gpu_missing and r.bypass_low_j > 0):
        return None
    why = sorted(r.bypass_low_why) or ["unknown"]
    if bypass_count_may_be(",".join(why)) != "may be low":  # proxy_lag, server_restart: a count that may be high too
        return (f"{BYPASS_LOW_FLAG}: {100 * r.bypass_low_j / r.gpu_j:.0f}% of its GPU energy is from intervals whose "
                f"server token count may be low or high ({', '.join(why)}: their server_count): bypass traffic there "
                f"may be missing from unproxied (a batch run on for nobody, counted late), or tokens not its taken "
                f"for it (the proxy's own lag, a restarted "
                f"counter's, a run-on's that may have ended by itself or at a death not told from the same process "
                f"back, unseen), so "
                f"this request's energy may hold bypass traffic's or have lost its own; "
                f"fix: {bypass_count_fix(','.join(why))}")
    return (f"{BYPASS_LOW_FLAG}: {100 * r.bypass_low_j / r.gpu_j:.0f}% of its GPU energy is from intervals whose "
            f"server token count may be low ({', '.join(why)}: their server_count): bypass traffic there is not in "
            f"unproxied, and its energy may be in this request's; fix: {bypass_count_fix(','.join(why))}")


def _before_first_note(r: LiveRequest) -> str | None:
    """A request live before the daemon's first GPU read (the start's read failed, or a ledger fed late): the energy of
    that part of its run is in no interval. Said, and left out of J/token: its figures are low."""
    if not (r.before_first_s > 0 and r.gpu_j > 0):
        return None
    gap = f"{r.before_first_s * 1e3:.1f} ms" if r.before_first_s < 0.1 else f"{r.before_first_s:.2f} s"  # never "0.00 s"
    return (f"{BEFORE_FIRST_READ_FLAG}: it arrived {gap} before the daemon's first GPU read, and "
            "its energy before that read was not counted: its gpu_energy_j, cpu_energy_j and J/token are low; fix: "
            "none for this row (later requests are measured whole); the log says why the start's NVML read failed")


def _usage_above_note(r: LiveRequest) -> str:
    """Why a request's count is not believed whole (LiveRequest.usage_above): the server's counter counted fewer tokens
    than its usage (and its neighbours') said over the stretch it ran in; both counts named, with the fix."""
    final_n, counter_n, short_n, n_req = r.usage_above
    chunks = r.trace.tokens_seen if r.trace.stream is True and r.trace.tokens_seen else None
    return (f"{SERVER_COUNT_USAGE_ABOVE}: its usage said {final_n:.0f} generated tokens"
            f"{f' (its chunks carried {chunks:.0f})' if chunks is not None else ''}, the server's own token counter "
            f"(/metrics) about {counter_n:.0f}: over the stretch of {n_req} request(s) it ran in the counter counted "
            f"{short_n:.0f} fewer than their usage said, which no bypass traffic explains (it only raises the counter); "
            "generated_tokens is the usage's, gpu_j_per_token left empty, and its energy is a share taken by the "
            f"usage's count; fix: {bypass_count_fix(SERVER_COUNT_USAGE_ABOVE)}")


def _usage_below_note(r: LiveRequest) -> str:
    """Why a request's count is not believed whole (LiveRequest.usage_below): the server's counter counted more tokens
    than its usage (and its neighbours') said over the stretch it ran in, no bypass request beside them; both counts
    named, with the fix."""
    final_n, counter_n, surplus_n, n_req = r.usage_below
    return (f"{SERVER_COUNT_USAGE_BELOW}: its usage said {final_n:.0f} generated tokens, the server's own token counter "
            f"(/metrics) about {counter_n:.0f}: over the stretch it ran in the counter counted {surplus_n:.0f} more than "
            f"the proxy placed, and the server finished the proxy's {n_req} request(s) there and no other, none running "
            "at the stretch's ends, so no bypass traffic explains them; generated_tokens is the usage's (low), "
            "gpu_j_per_token left empty, and its energy holds those tokens' work; "
            f"fix: {bypass_count_fix(SERVER_COUNT_USAGE_BELOW)}")


def _with_late(error: str | None, late: float) -> str | None:
    if not late:
        return error
    note = f"{late:g} token(s) arrived after their interval had closed and were not attributed"
    return note if error is None else f"{error}; {note}"


def _cpu_missing_note(where: str) -> str:
    """Why a cpu_energy_j is empty beside RAPL: no read covered `where` (a request's intervals, an interval's edges)."""
    return (f"CPU energy unknown: no RAPL read covered {where} (a dropped delta, "
            "reads failing, or reads periods late on a loaded host: the log, the rapl samples' error "
            "column and powerprof_sample_missed_total{source=\"rapl\"} say which): a sum of the rest would be "
            "too small, so cpu_energy_j is empty; fix: powerprof devices (RAPL zones and permissions), fewer "
            "busy processes beside the daemon")


def _idle_gpu_missing_note(gpus: str, where: str, whole: str) -> str:
    """Why a gpu_energy_j (all sampled GPUs) is empty while the serving GPUs' figures are whole: `gpus` (named as the log
    names them, Ledger._named), judged to serve none of the proxied work, gave no energy reading over `where`."""
    return (f"GPU energy unknown: GPU(s) {gpus} gave no energy reading over {where} (lost or failing reads; "
            f"the samples' error column says which and why), so gpu_energy_j, every sampled GPU's, is empty; they "
            f"serve none of the proxied work, so the requests' energy and {whole}; fix: powerprof devices, "
            "nvidia-smi -q; restarting the daemon (daemon.gpus without a GPU that is gone) measures the others' total")


def _idle_unknown_note(gpus: str) -> str:
    """Why an interval's idle_energy_j is empty: `gpus`, serving none of the proxied work, gave no reading there."""
    return (f"idle_energy_j empty: it holds the energy of GPU(s) {gpus}, which serve none of the proxied work "
            "and gave no energy reading here; counting them 0 J would understate it; the daemon's totals keep every "
            "read GPU's energy of this interval, theirs alone out (powerprof_gpu_idle_energy_unknown_intervals counts "
            "such intervals)")


def _gpu_missing_note(where: str) -> str:
    """Why a gpu_energy_j is empty: a GPU gave no energy reading over `where`."""
    return (f"GPU energy unknown: a GPU gave no energy reading over {where} (lost or failing "
            "reads; the samples' error column says which and why): a sum of the others would be too small; "
            "fix: powerprof devices, nvidia-smi -q")


CPU_MISSING_NOTE = _cpu_missing_note("part of this request's intervals")
GPU_MISSING_NOTE = _gpu_missing_note("part of this request")
# An interval row's energy_note, for what only an interval has: a host without RAPL (a request's row says nothing of
# it: every request there alike), and a busy interval whose other processes' CPU share was not judged.
# An interval or tag read from power readings (no counter, or one that jumped) says it in these words.
NO_COUNTER_READ = "read without an energy counter (power readings)"
NO_RAPL_NOTE = ("CPU energy not read: no RAPL on this host, or not readable by the daemon (the start's log says "
                "which), so cpu_energy_j is empty; fix: powerprof devices (RAPL zones and permissions)")


def _uncounted_note(r: LiveRequest) -> str:
    tr = r.trace
    return (f"not counted: {outside_text(tr.method, 16)} {outside_text(tr.endpoint, 80)} is not a generation API whose tokens the proxy reads "
            f"({r.uncounted} work): it takes energy only by its live time where no counted request worked, so its "
            "figure is low, and the requests beside it carry the rest (their energy_note says so)")


def _own_late_said(r: LiveRequest) -> str:
    """A burst note's other cause, where the proxy's own loop was measured late enough to explain it (`_burst_said`)."""
    return (f"; or read late by the proxy itself: the proxy's own event loop ran up to {_secs(r.own_late_s)} late "
            "while it streamed, a busy host" if r.own_late_s else "; or a busy host that ran the server or the proxy late")


def _secs(x: float) -> str:
    """A lateness in words: under a second in ms (a loop 40 ms late read "0.0 s late")."""
    return f"{x * 1e3:.0f} ms" if x < 1.0 else f"{x:.1f} s"


def _parser_held(r: LiveRequest) -> bool:
    """Every later burst of `r` can be a chunk in which the server's tool-call parser sent several tokens at once (the
    proxy's count of such chunks: _State.tool_call_jumps), not a hop's buffer."""
    return 0 < r.bursts <= r.trace.extra.get("tool_call_jumps", 0)


# The share of a held-back stream's hold its own client's backpressure must explain to be named its cause (`client_held`).
CLIENT_HELD_SHARE = 0.5
# A stream held back by its own client, which read it slower than the server sent it: what its row says (`client_held`).
CLIENT_HELD_NOTE = ("its tokens reached the proxy in {what}, held back by its own client: it read its stream slower than "
                    "the server sent it (its receive buffer full), so the proxy's writes to it waited {held} in all, and "
                    "the proxy stopped reading the server meanwhile rather than buffer without bound; {spread}; its TTFT "
                    "and decode_s are its client's reading pace, not the server's (nothing to fix for its energy: no "
                    "proxy or gateway between the server and the proxy held them; a client that reads as it goes gets "
                    "the server's pace)")


# What to do where a client held its stream back so long that intervals closed before its tokens came.
CLIENT_HELD_FIX = "fix: its client reads its stream as it comes (the proxy holds intervals only so long)"


def client_held(r: LiveRequest) -> bool:
    """Its bursts are its own client's doing: the proxy's upstream stood paused for the client to read
    (`proxy._ClientSink._note_client_held`) for at least CLIENT_HELD_SHARE of the time its tokens were held back. Blamed
    on a buffering hop, a client that read nothing for 20 s sent its operator to turn off nginx's proxy_buffering."""
    paused_s = r.trace.extra.get("client_held_s", 0.0)
    hold_s = r.held_s if r.bursts else (r.burst_s or 0.0)
    return paused_s > 0 and paused_s >= CLIENT_HELD_SHARE * hold_s


def _client_held_note(r: LiveRequest) -> str:
    """A held-back stream's note where its client held it (`client_held`)."""
    if r.bursts:
        what = f"{r.bursts + 1} bursts, up to {r.held_s:.1f} s apart"
        spread = "each burst's were spread over the time before it at the server's pace"
    else:
        what = f"one burst, {r.burst_s:.1f} s after its arrival"
        spread = "they were spread over its run at the server's pace"
    return CLIENT_HELD_NOTE.format(what=what, held=_secs(r.trace.extra.get("client_held_s", 0.0)), spread=spread)


def _burst_fix(r: LiveRequest) -> str:
    """The fix of a burst note: the hop's first where nothing measured says the host, the host's first where it did."""
    return f"fix: {OWN_LATE_FIX}; or {BURST_FIX[5:]}" if r.own_late_s else f"{BURST_FIX}; on a busy host, {OWN_LATE_FIX}"


# A whole answer (not streamed) cut before it came: its row's words, with no share or with one by live time alone.
WHOLE_GONE_NOTE = ("a whole answer (not streamed) whose client left, or whose connection broke, before it came: the proxy "
                   "saw none of its tokens, so the server's work for it (its prefill at its start, then what it decoded "
                   "until it stopped) is unseen and its energy is in the shares of the requests beside it, which say "
                   f"{GONE_PREFILL_FLAG}")


# The same, where the server aborted it at once and its prompt is costed (`_whole_gone_costed`): its row's words.
WHOLE_GONE_COSTED = (" (a whole answer, not streamed: the server, which aborts a request whose client left at once, "
                     "prefilled it from its arrival or its queue exit until then; what it decoded after its prefill, if "
                     "it got that far, is unseen, in the shares of the requests beside it)")

# The same on llama.cpp, which runs it on to its end (`Ledger._run_on`), where nothing placed that end (no max_tokens, or
# no stream's pace yet): its row's words. Before, it said the aborting server's words above (vLLM's), wrong there.
WHOLE_GONE_RUN_ON = (" (a whole answer, not streamed: llama-server ran it on to an end not known, its request's "
                     "max_tokens unsaid or no stream's pace seen yet, and its prompt is costed from its arrival or its "
                     "queue exit; what it decoded after is unseen and not costed here: the server counts those tokens, "
                     "so they and their energy read as bypass traffic, in unproxied)")


def _run_on_unsure(r: LiveRequest) -> bool:
    """UNSURE_FLAG's run-on: placed, and a found-down scrape not proven a death may have ended it (`_run_on_note`); or
    a close with no answer costed as a crash with no death shown (`LiveRequest.crash_unsure`): a queuing router's
    refusal of a request it held (0 J, its energy the neighbours') reads the same; or placed to SGLang's abort where its
    answer may have ended by itself sooner, unseen (`_may_have_ended`)."""
    if r.run_on_crash:
        return r.crash_unsure or r.crash_reach is not None
    return r.run_on_end_ns is not None and (r.run_on_unsure is not None and (not r.run_on_restart or r.run_on_reach)
                                            or _may_have_ended(r))


def _may_have_ended(r: LiveRequest) -> bool:
    """Its run-on, placed to SGLang's abort (or its max_tokens), may have ended sooner by its answer's own end, unseen
    (`LiveRequest.run_on_may_end`): its body did not rule that out (ignore_eos, min_tokens), by the margin on its pace
    `Ledger._place_run_on` takes (a restart's cut may leave too few tokens since)."""
    return (r.run_on_may_end is not None and r.run_on_tokens * (1.0 + RUN_ON_MAY_END_PACE_MARGIN) > r.run_on_may_end
            and not (r.run_on_restart and r.run_on_end_ns <= r.trace.end_ns))


def _run_on_counted(r: LiveRequest) -> str:
    """Whether its attributed tokens count its run-on's decode: not those placed before an interval already closed
    (`LiveRequest.run_on_late`), whose energy its figure holds all the same, so its J/token reads high by them."""
    if r.run_on_late < 0.5:
        return "its attributed tokens count them"
    return (f"{r.run_on_late:.0f} of them fell in intervals closed before its end came, held no longer, and are not in "
            "its attributed tokens, though its energy there is in its figure: its J/token reads high by them")


def _run_on_note(r: LiveRequest) -> str:
    """`_run_on_said`, and where a found-down scrape not proven a death may have ended its run-on (`Ledger._death_proven`)
    both readings, marked UNSURE_FLAG (`analyze` leaves it out of J/token): its energy there is never silently kept nor
    silently dropped, nor summed as if sure."""
    said = _run_on_said(r)
    if not _run_on_unsure(r):
        return said
    if _may_have_ended(r):
        least = (f"{r.run_on_may_end:.0f} (its min_tokens' rest)" if r.run_on_may_end > 0 else "0")
        ran = f"it ran on from {least} to {r.run_on_tokens:.0f} tokens after its client left, placed at the most"
        if r.run_on_may_end >= r.run_on_tokens:  # within the margin on its pace: a faster one reaches them
            ran = (f"it ran on {r.run_on_tokens:.0f} tokens after its client left at its estimated pace, placed to the "
                   f"abort, and its min_tokens' rest ({r.run_on_may_end:.0f}) is within "
                   f"{RUN_ON_MAY_END_PACE_MARGIN:.0%} above that: a real pace that much faster decodes them in time")
        said = (f"{said}; {UNSURE_FLAG}: its answer may have ended by itself (its end of text or a stop) before that, "
                f"unseen by the proxy (its body set no ignore_eos, or a stop, and its min_tokens do not reach so far): "
                f"{ran}, so "
                "its figure may be high (SGLang then counts its tokens at its end, read as bypass tokens) and the "
                "shares of the requests beside it then low; fix: none for J/token, which leaves it out; a client that "
                "stays to its answer's end is costed as any")
        if r.run_on_unsure is None or r.run_on_restart and not r.run_on_reach:
            return said
    tr = r.trace
    if r.run_on_crash and r.crash_reach is not None and not r.crash_unsure:
        a, down = r.crash_reach
        wait_s = RUNS_ON_AFTER_LEAVE["sglang"][1]
        return (f"{said}; {UNSURE_FLAG}: a scrape {(down - tr.arrival_ns) / 1e9:.2f} s after its arrival found nothing "
                "listening (its connection refused), and the server's next page was back past anything a new process "
                "could have counted since, with no start time to say which process it was: a restarted one whose "
                "counter persisted (a PROMETHEUS_MULTIPROC_DIR kept over the restart), the old one dead with it in "
                "flight, as costed here; or the same process back (nothing listened for a moment, its connection "
                f"closed by that hiccup), which ran it on as a client's leave, to its next {wait_s:g} s wait: then the "
                "figure here is low, the requests beside it high (theirs say run_on_may_end); "
                f"fix: {PAST_REACH_FIX}")
    if r.run_on_crash and r.crash_route_unsure:
        return (f"{said}; {UNSURE_FLAG}: a /generate to a server whose kind the daemon does not know: SGLang runs it "
                "(the figure here is right), llama-server and vLLM refuse it unrun (404: 0 J, its energy the requests' "
                "beside it); fix: let the daemon know the server (scrape.server, or a /metrics page it can read)")
    if r.run_on_crash and r.down_hold_over is not None:
        (down, cap_s), tr = r.down_hold_over, r.trace
        return (f"{said}; {UNSURE_FLAG}: sent before the server's last good scrape, then a scrape "
                f"{(down - tr.arrival_ns) / 1e9:.2f} s after its arrival found the server down by llama-server's 503 "
                "\"Loading model\" alone (nothing refused, no proxied connection broken then): a restart with it in "
                "flight (a crash: the figure here is right) or a page that is no restart (a router's: it may never "
                f"have run, 0 J, its energy the requests' beside it); its row waited {cap_s:g} s for a scrape to "
                "confirm the restart and none did, so it is costed as the crash it most likely was; fix: let the "
                "daemon scrape the server's own port (scrape.url) so a death reads as a refused connection, or read "
                "the server's log for a restart")
    if r.run_on_crash and r.crash_by_page:
        return (f"{said}; {UNSURE_FLAG}: {RESEND_LOADING} (a new process where the one that had it was), with no "
                "refused connection and no proxied request failing then: if it was in flight at that process's death, "
                "the figure here is right; if a router in front of the server (llama-swap swapping models, its page "
                "quoting those words) held it and refused it unrun, it is 0 J and its energy belongs to the requests "
                "beside it; fix: scrape the server's own port (scrape.url), not through a router, so a death reads as "
                "a refused connection")
    if r.run_on_crash:
        return (f"{said}; {UNSURE_FLAG}: sent before the server's last good scrape, then a scrape found it down by an "
                "HTTP 503 and a page after said a restart, with no refused connection and no proxied request failing "
                "then: if it was in flight at that crash, the figure here is right; if a router in front of the server "
                "(llama-swap swapping models) held it and refused it unrun, it is 0 J and its energy belongs to the "
                "requests beside it; fix: scrape the server's own port (scrape.url), not through a router, so a death "
                "reads as a refused connection")
    a, down = r.run_on_unsure
    if r.run_on_reach:
        return (f"{said}; {UNSURE_FLAG}: a scrape {(down - tr.arrival_ns) / 1e9:.2f} s after its arrival found nothing "
                "listening (its connection refused), and the server's next page was back past anything a new process "
                "could have counted since, with no start time to say which process it was: the same process back "
                "(nothing listened for a moment), which ran it on as costed here, or a restarted one whose counter "
                "persisted (a PROMETHEUS_MULTIPROC_DIR kept over the restart), the old one dead there: then the server "
                f"ran it at most {(max(down, tr.end_ns or down) - tr.arrival_ns) / 1e9:.2f} s from its arrival and "
                f"the figure here is high, the requests beside it low (theirs say run_on_may_end); fix: {PAST_REACH_FIX}")
    return (f"{said}; {UNSURE_FLAG}: a scrape {(down - tr.arrival_ns) / 1e9:.2f} s after its arrival (after the server's "
            f"last good scrape) found the server down (an HTTP 502/503, then a restart by its counters), with no "
            f"refused connection and no proxied request failing then: if that was its process's death, the server ran "
            f"it at most {(max(down, tr.end_ns or down) - tr.arrival_ns) / 1e9:.2f} s from its arrival and the figure "
            f"here is high (nearly all of it too much); if not (a router's or a loading page's 503), it ran on as "
            f"costed here; fix: scrape the server's own port (scrape.url), not through a router, so a death reads as a "
            f"refused connection")


def _run_on_said(r: LiveRequest) -> str:
    """What its figure holds of the work the server did for it after its client left, until it aborted it or (a whole
    answer on llama.cpp) until its end (`Ledger._run_on`: scrape.RUNS_ON_AFTER_LEAVE)."""
    tr = r.trace
    s = (r.run_on_end_ns - tr.end_ns) / 1e9
    if r.run_on_crash:  # `Ledger._run_on`: a whole answer the server had, its connection closed with no answer
        s = (r.run_on_end_ns - tr.arrival_ns) / 1e9
        how = ("a crash: its process died, its head would have come only when it was done" if not r.crash_unsure else
               "a crash in flight, its head to come only when it was done, or a router in front of the server holding "
               "it and refusing it unrun")
        resend = next((w for w in (RESEND_REFUSED, RESEND_LOADING) if w in (tr.error or "")), None)
        if resend is not None and not r.crash_unsure:
            # proxy.ResendRefused (ResendLoading): a kept-alive connection closed as it went out, and its resend was
            # refused (met a new llama-server's loading page). The server died, but the close may have come before
            # it read the request: the proxy's error says both.
            how = (f"a kept-alive connection's close, and {resend}: the server died, with it in flight or "
                   "before it read it, so it ran until then or may never have run; the figure here is the first "
                   "reading, at most its time from arrival to the close")
        got = ("the new server's loading page (503)" if resend == RESEND_LOADING else "the proxy's 502")
        lead = (f"the server closed its connection with no answer {s:.2f} s after its arrival ({how}), and the client "
                f"got {got}; it is costed as run until then, its prefill and then its decode")
        if r.run_on_tokens > 0:
            return (f"{lead}: {r.run_on_tokens:.0f} tokens decoded at {r.run_on_pace} pace (an estimate; "
                    f"{_run_on_counted(r)}), which no client received")
        return f"{lead}: its decode there unseen (no pace to decode it at)"
    if r.run_on_prefill:  # llama.cpp: a stream gone before its first token
        return (f"llama-server prefilled its prompt whole after its client left, about {s:.1f} s to its estimated first "
                "token (it looks at a stream's connection only at a result of its own): its energy includes that "
                "prefill, which no client received, costed its whole prompt")
    stream_s, wait_s = RUNS_ON_AFTER_LEAVE["sglang"]
    how = (f"a stream's request {stream_s:g} s after its client left" if tr.stream is True else
           f"a whole answer's request at its next {wait_s:g} s wait from its start")
    said = ("sglang:num_aborted_requests_total and in none of its token counters")
    if r.run_on_restart and r.run_on_end_ns <= tr.end_ns:  # `Ledger._cut_run_on`: its death placed at the leaving
        return (f"the server did not run it on after its client left: the process that had it died as its client left "
                f"or after, and it is costed to its client's leaving ({_death_words(r)})")
    elif r.run_on_restart and r.run_on_unrestarted and r.run_on_death[2] is not None:
        # `Ledger.add_server_tokens`: a refused connect proved the death, and no page after said a restart (the proxy's
        # refusals, then counter_below): "until it restarted" told of a restart nothing saw.
        a, _, down, _ = r.run_on_death
        lead = (f"the server ran on after its client left, about {s:.1f} s, until its process died (a connection to "
                f"the server refused {(down - a) / 1e9:.2f} s after its last scrape, and no page after it said a "
                f"restart: {_death_words(r)})")
    elif r.run_on_restart:  # `Ledger._end_run_ons_at_restart`: the process running it died
        lead = f"the server ran on after its client left, about {s:.1f} s, until it restarted ({_death_words(r)})"
    elif r.run_on_to_end:  # llama.cpp (scrape.RUNS_ON_AFTER_LEAVE): no abort to wait for, its end
        why = ("llama-server looks at a whole answer's connection only after a second in which it sent no result to "
               "any request: beside other requests, or scraped more often, not before its end")
        lead = (f"the server ran on after its client left until its max_tokens ({tr.extra.get('max_tokens')}) were "
                f"decoded, about {s:.1f} s ({why})" if r.run_on_capped else
                f"the server ran on after its client left, about {s:.1f} s at least ({why}; its end placed at twice as "
                f"long as the server's latest streams' pace decodes its max_tokens in)")
    elif r.run_on_capped:
        lead = (f"the server ran on after its client left until its max_tokens ({tr.extra.get('max_tokens')}) were "
                f"decoded, about {s:.1f} s (SGLang aborts {how}: it finished first)")
    else:
        lead = f"the server ran on about {s:.1f} s after its client left (SGLang aborts {how}, counting it in {said})"
    if r.run_on_tokens > 0:
        return (f"{lead}: its energy includes that work, which no client received, {r.run_on_tokens:.0f} tokens decoded "
                f"at {r.run_on_pace} pace (an estimate; {_run_on_counted(r)})")
    return f"{lead}: it is live in that time, its work there unseen (no pace to decode it at)"


def _death_words(r: LiveRequest) -> str:
    """When the process that ran `r` on died in a restart, as its run-on's end was placed (`Ledger._run_on_cut_ns`),
    and how well that end is known: its energy there is never silently dropped nor silently kept."""
    a, b, down, lo = r.run_on_death or (None, None, None, None)
    if a is None:
        return "the process that had it gone"
    since = ("its last scrape" if lo == a else
             f"its client's leaving, {(lo - a) / 1e9:.2f} s after its last scrape (the proxy saw the connection to it "
             "open then: a death closes it)" if lo == r.trace.end_ns else
             f"this request's arrival, {(lo - a) / 1e9:.2f} s after its last scrape (it took the request)")
    if down is not None and down <= lo:
        return (f"the process that had it was alive at {since} and a scrape begun then found the server down: its end "
                "placed there")
    if down is not None:
        span = (down - lo) / 1e9
        return (f"the process that had it died between {since} and the first that found the server down, "
                f"{span:.2f} s later: its end placed midway, good to {span / 2:.2f} s either way")
    return (f"the process that had it died after {since}, where its end is placed, a lower bound: no scrape "
            f"found the server down before the new process's first, {(b - lo) / 1e9:.2f} s later, and it may have "
            "gone on up to that long")


def _whole_gone(r: LiveRequest) -> bool:
    """A whole answer cut before it came (`gone_unsaid`, not streamed) whose body gave no estimate, or on a server that
    runs it on (SGLang, llama.cpp) to no end the daemon knows (its connection to the server broke, its client still
    there): its work unseen, none of it costed. (Else `Ledger._cost_gone` costs its prompt, and `_run_on_gone` a known run-on.)"""
    return gone_unsaid(r) and r.trace.stream is not True and r.run_on_end_ns is None and r.prompt_est is None


def _whole_gone_costed(r: LiveRequest) -> bool:
    """A whole answer cut before it came whose prompt `Ledger._cost_gone` costed, the server having aborted it at once:
    what it decoded after its prefill, if it got that far, is unseen."""
    return gone_unsaid(r) and r.trace.stream is not True and r.run_on_end_ns is None and r.prompt_est is not None


def _n_cmpl_unsure(r: LiveRequest) -> bool:
    """UNSURE_FLAG's whole answer whose `n_cmpl` never settled (`proxy.n_cmpl_unsettled`: its client left, or its upstream
    failed, before its body came): its tokens unseen, its run costed at `n`'s sequences, llama-server's `n_cmpl` the
    other reading. A stream's tokens are those it showed: not flagged (its error says what is `n`'s)."""
    return r.trace.extra.get("n_cmpl_unsettled") is not None and r.trace.stream is not True


def _n_cmpl_note(r: LiveRequest) -> str:
    """`_n_cmpl_unsure`'s words: both readings of its sequences, and of its run-on's tokens where one was costed."""
    extra = r.trace.extra
    v, n = extra["n_cmpl_unsettled"], max(extra.get("choices", 1), 1)
    seqs = max(extra.get("sequences", 1), 1)
    other = seqs // n * v
    run_on = (f", its run-on after its client left {r.run_on_tokens:.0f} tokens (under n_cmpl, "
              f"{r.run_on_tokens * other / seqs:.0f})" if r.run_on_tokens > 0 else "")
    return (f"{UNSURE_FLAG}: it asked n_cmpl {v} beside n {n}, and its answer (a whole one) ended ({r.trace.outcome}) "
            f"before it showed which its server ran: llama-server runs {v} choices a prompt, vLLM and SGLang {n}; it is "
            f"costed at n's reading, {seqs} sequence(s){run_on}; if llama-server ran it, {other} sequence(s) ran and "
            f"its figure is {'low' if other > seqs else 'high'} by about {other / seqs:.3g}x in what it decoded (the "
            f"requests beside it the other way); fix: send llama-server's choices as `n` alone")


# The fix for a batch SGLang answers 400 while running its other prompts for nobody (`Ledger._batch_run_on`): a limit
# its tokenizer manager checks (prompt + max_new_tokens past the context refuses the batch whole, unrun), or no prompt
# in the context's last 6 tokens.
BATCH_400_FIX = ("send batches a max_new_tokens (max_tokens) above 6, so that SGLang refuses one holding a prompt near the "
                 "context's end whole, unrun, or prompts that leave more than 6 tokens of the context")


def _batch_cause(r: LiveRequest) -> str:
    """What a batch answered 400 set off, as its row says it (`LiveRequest.batch_bound`), and why it is not charged
    there: its client caused that work, but the 400 alone does not show it ran."""
    n, tokens, span_s = r.batch_bound or (1, None, None)
    up_to = f"up to {tokens} tokens each" if tokens is not None else "tokens to the context's end"
    until = f", for at most {span_s:.1f} s from its arrival" if span_s is not None else ""
    if r.batch_capped:
        # ledger.BATCH_SPAN_MAX_S (imports point down: said, not imported)
        until = (f", marked {span_s:.0f} s from its arrival at most: its bound ran longer, and the rows beside its "
                 "run past that are not flagged" + (" once the server's counter, which counts a request's tokens at "
                                                    "its end, has counted since its arrival what its other prompts' "
                                                    "end may be (tokens no proxied request lists, the finished "
                                                    "requests' latency reaching its age; or other traffic's passing "
                                                    "for it)"
                                                    if r.batch_uncounted else ""))
    return (f"this request is that work's cause ({n} other sequence(s), {up_to}{until}), yet it is charged none of it: "
            "its abort's message shows they were let through, not how far they ran (their end unseen, a restart may "
            "have cut them), so a charge could bill work never done; its empty figure "
            "means that, not no work")


def _no_energy_reason(r: LiveRequest) -> str:
    """Why a request got no energy: what the work model could not see."""
    if not_forwarded(r):
        return f"{NOT_FORWARDED_NOTE} (the server never saw it; its error says why), so no GPU work of it"
    if is_unseen(r) and not is_passive(r):
        return "no share: " + _uncounted_note(r)
    if is_passive(r) and body_left(r):
        return ("no share: its client left while sending its request body, so the server never had it whole and ran "
                "none of it; its time counts as idle")
    if crashed(r):
        # Costed as a crash, yet no share came of it: the generic "no tokens and no prompt length" said nothing of that.
        s = (r.trace.end_ns - r.trace.arrival_ns) / 1e9
        return (f"no share: {_run_on_note(r)}; the split placed none of its work in those {s:.2f} s (a close that "
                "crossed it costs nothing, as it should; if it ran, that time's energy is in the shares of the "
                "requests beside it)")
    if r.trace.end_ns is not None and is_passive(r) and closed_unanswered(r):
        return ("not costed: its upstream closed the connection with no answer, and it may have run (crash?) or been "
                "refused unrun (a router in front of the server): no restart its scrapes confirmed by its row's time "
                "covered its close with proof of a death (sent before the server's last good scrape, a refused "
                "scrape, or a proxied connection broken then; a 502/503 on the metrics page may be the router's or a "
                "loading page's), so it is costed "
                f"as not run and its time counts as idle; fix: {_unproven_close_fix(r)}")
    if r.trace.end_ns is not None and is_passive(r):
        c = r.trace.counts
        what = (f"an error answer (HTTP {r.trace.status})" if r.trace.status is not None and r.trace.status >= 400
                else f"an error answer (the server's error inside its HTTP {r.trace.status} response)"
                if c is not None and c.server_error is not None
                else f"a {outside_text(r.trace.method, 16)} request to no generation endpoint")
        seqs = r.trace.extra.get("sequences", 1)
        if r.batch_unplaced:
            return (f"no share: {what} to a batch of {seqs} sequences, with no token and no prompt length: SGLang "
                    "answers a batch 400 for one prompt in the context's last 6 tokens and runs its other prompts to "
                    "their cap for nobody; the daemon scrapes no server (scrape.server = none), so that work, if it ran, "
                    "is in no row nor counter here but in the shares of the requests beside it, which are flagged "
                    f"(this row is not: it has no figure to leave out); {_batch_cause(r)}; fix: {UNPLACED_FIX}; or "
                    f"{BATCH_400_FIX}")
        if r.batch_run_on:
            # SGLang answers a batch 400 for one prompt its scheduler aborts and runs the others to their cap
            # (tokenizer_manager.py @ 001067ff _collect_batch_responses): "no GPU work" would be untrue there. Said
            # from the ledger's record (before: from the status and sequences alone, on vLLM or llama.cpp too, where
            # no window was marked).
            return (f"no share: {what} to a batch of {seqs} sequences, with no token and no prompt length: no GPU "
                    "work of it was seen here, yet SGLang runs a batch's other prompts to their cap for nobody after "
                    "one prompt's 400: that work, where the server's token counter saw it, is in the intervals' "
                    "unproxied_energy_j, not in this row, placed late: the intervals over its run say batch_run_on "
                    f"(SGLang or a server of kind unknown), and the requests beside it are flagged; {_batch_cause(r)}; "
                    f"fix: {BATCH_400_FIX}")
        return (f"no share: {what} with no token and no prompt length: no GPU work of it was seen, and its time "
                "counts as idle")
    if r.prompt_cap is not None and r.prompt_est is not None and r.prompt_est[0] <= 0:
        est, in_flight_s, rate, _, beside = r.prompt_cap
        return (f"no share: it ended before its first token, and in its {in_flight_s:.2f} s in flight the GPU had no room "
                f"for its prefill at {rate:.0f} tokens/s beside the {beside:.0f} prompt tokens of other requests placed "
                f"then (queued: vLLM and SGLang drop a request whose client left unrun), so its prompt (an estimate of "
                f"{est:.0f} tokens) is costed at none; the requests beside it say {GONE_PREFILL_FLAG}")
    if _whole_gone(r):
        return f"no share: {WHOLE_GONE_NOTE}"
    if r.tokens > 0 or told_prompt_tokens(r):
        return ("no share: its tokens and prompt were work of no cost at the costs in use (costs/), or in no interval "
                "with energy (the energy counter did not move over its intervals: shorter than its refresh, up to 100 "
                "ms, their energy counted in the next interval's, and that interval's rows say so); fix: "
                f"{COUNTER_SHORT_FIX}")
    if told_prompt_tokens(r) is None:
        fix = f"; {NO_TOKENS_FIX}" if _usage_askable(r.trace) and r.trace.outcome == "ok" else ""
        return f"no share: no tokens and no prompt length (the response did not say it){fix}"
    return "no share: no tokens and an empty prompt"


NO_TOKENS_FIX = ("fix: ask for the count, \"stream_options\": {\"include_usage\": true} (or start vLLM with "
                 "--enable-force-include-usage)")


def _usage_askable(tr) -> bool:
    """An OpenAI-style stream: one whose client can ask the server to say its counts (include_usage)."""
    return tr.stream is True and tr.api in ("openai-chat", "openai-completions")


def tokens_unknown(r: LiveRequest) -> bool:
    """Its row's generated_tokens is null for want of any count: a counted API's answer that showed no token and said
    none (not a count contradicted or invalid, which `error` says, nor an error answer or uncounted work, said apart).
    A whole answer that said its prompt's length said its count too (usage, timings): a null there is a count of 0."""
    tr, c = r.trace, r.trace.counts
    if tr.api is None or tr.tokens_seen or r.ev_n or r.spent or is_passive(r) or is_unseen(r):
        return False
    if c is not None and c.prompt_tokens is not None and tr.outcome == "ok":
        return False
    return c is None or (c.generated_tokens is None and c.count_problem is None and c.invalid is None)


def _no_tokens_note(r: LiveRequest) -> str | None:
    """Why a request with a share has no token count (tokens_unknown), with the fix; None where it has one. Its share
    rests on its prompt's work and time alone: the tokens the server generated for it went to unproxied."""
    if not tokens_unknown(r):
        return None
    tr = r.trace
    ahead = (f" (the server's counter ran {r.server_ahead:.0f} token(s) ahead of the proxy's while it was live)"
             if r.server_ahead >= 0.5 else "")
    if tr.outcome != "ok" and r.run_on_tokens > 0:  # its decode placed at a pace to its server's abort (`_run_on_note`)
        return (f"no tokens: its response was cut ({tr.outcome}) before it showed a token or said a count, so "
                "generated_tokens is unknown")
    if tr.outcome != "ok":
        return (f"no tokens: its response was cut ({tr.outcome}) before it showed a token or said a count, so "
                f"generated_tokens is unknown: tokens the server generated for it{ahead}, and their energy, are in "
                "unproxied, not here")
    askable = _usage_askable(tr)
    fix = NO_TOKENS_FIX if askable else "fix: a server that says its count (usage or timings)"
    return (f"no tokens: its response showed no token and said no count{' (no usage)' if askable else ''}, so "
            "generated_tokens is unknown and its share rests on its prompt's work and time alone: tokens the server "
            f"generated for it{ahead}, and their energy, are in unproxied as if bypass traffic ran; {fix}")


def counted_low(r: LiveRequest) -> bool:
    """Its tokens were counted from its chunks alone, or not at all (tokens_unknown), on an OpenAI-style stream: the
    server's counter running ahead while it was live is likely its own tokens, not bypass traffic."""
    c = r.trace.counts
    if not (r.trace.stream is True and (r.trace.api or "").startswith("openai")):
        return False
    return tokens_unknown(r) or (c is not None and c.tokens_estimated and not r.to_server)


def _counted_low_interval_note(n: int, surplus: float) -> str:
    """An interval's: `n` requests live in it that carried no token counts while the server counted `surplus` more."""
    return (f"{n} request(s) live in it carried no token counts, and the server counted {surplus:.3g} token(s) more "
            "than the proxy did in it (tokens no chunk showed: vLLM's last token in its closing chunk, several a chunk "
            "under speculative decoding): unproxied_energy_j may hold their work as if bypass traffic ran, and "
            "server_count says complete because the server's count is whole, not the proxy's; fix: clients send "
            "\"stream_options\": {\"include_usage\": true}, or start vLLM with --enable-force-include-usage")


UNSAID_NOTES = {
    "client_left": "the client left before the server said the prompt's length (in the usage at the stream's end)",
    "no_usage": "the server never said the prompt's length (the stream carried no usage)",
    "not_yet": "the server had not said the prompt's length 30 s after arrival (its intervals could be held no longer)",
    "before_first_token": ("it ended before its first token (its client left, or its answer stopped, while its prompt was "
                           "queued or prefilling) and the server never said the prompt's length: its prefill may have "
                           "been cut short, or never run (queued: vLLM and SGLang drop a request whose client left at "
                           "their next step), or run whole"),
}
UNSAID_FIX = {"no_usage": "; fix: ask for it, \"stream_options\": {\"include_usage\": true}",
              "before_first_token": (f"; its figure may be high and the requests beside it low, or the other way "
                                     f"(theirs say {GONE_PREFILL_FLAG}); fix: {GONE_PREFILL_FIX}")}


def _unsaid_reason(r: LiveRequest) -> str:
    # Ended with no token: no usage was ever coming, whoever ended it (`Ledger._prompt_work` costs such a prompt only
    # once it has ended, bounded by its time in flight).
    if r.trace.first_ns is None and r.trace.end_ns is not None and not finished_unsaid(r):
        return "before_first_token"
    # Whether the request has ended, not whether it ended inside the intervals being closed: once a client has left,
    # the prompt hold is over and earlier intervals close with the request still "live" in them.
    if r.trace.end_ns is None:
        return "not_yet"
    return "client_left" if r.trace.outcome == "client_disconnected" else "no_usage"


def _best_of_note(extra: dict) -> str:
    """BEST_OF_FLAG's words: the sequences run beyond those returned (best_of - n per prompt), unseen by the proxy."""
    b, n = extra["best_of"], max(extra.get("choices", 1), 1)
    unseen = (b - n) * max(extra.get("sequences", 1) // n, 1)
    return (f"{BEST_OF_FLAG}: it asked best_of {b} for n {n}: the server ran {unseen} more sequence(s) than it returned, "
            "whose tokens never reached the proxy: their work is in the shares of the requests beside it and in "
            f"unproxied (read as bypass traffic), not here, so its figure is low; fix: {BEST_OF_FIX}")


def _request_flags(r: LiveRequest, best_of_ignored: bool) -> list[str]:
    """The COUNTED_FLAGS a request's row says: each by the predicate its energy_note's words are written by. The notes
    that _approximate_note and the cache notes write are in a row with GPU energy only (without, it says why none)."""
    energy = r.gpu_j > 0 and not r.gpu_missing
    said = {NO_COUNTER_SHORT_FLAG: _no_counter_short(r),
            CACHE_UNSAID_FLAG: energy and _cache_flagged(r),
            CACHE_LATE_FLAG: energy and _late_flagged(r),
            BEST_OF_FLAG: energy and _best_of_flagged(r, best_of_ignored),
            COUNT_OPEN_FLAG: energy and _count_open_flagged(r),
            HELD_TAIL_FLAG: energy and r.held_tail_n > 0,
            GONE_PREFILL_FLAG: energy and _gone_flagged(r),
            PROMPT_UNREAD_FLAG: energy and (prompt_unread(r) or r.prefill_uncosted or r.unread_beside_j > 0),
            SERVING_ASSERTED_FLAG: energy and r.serving_asserted_j > 0,
            UNSURE_FLAG: energy and (_run_on_unsure(r) or resend_queued(r) or resend_crossed(r) or _queued_beside(r)
                                      or _n_cmpl_unsure(r) or _closed_partial(r) or r.run_on_unplaced
                                      or _unplaced_beside(r) or _capped_beside(r) or _batch_beside(r)
                                      or _counted_beside(r) or _held_whole_beside(r) or _idle_unmeasured(r)
                                      or _gpus_undecided(r) or _late_material(r))}
    return [f for f in COUNTED_FLAGS if said[f]]


def _unproven_close_fix(r: LiveRequest) -> str:
    """The fix for a close with no answer no death was shown at: with the daemon scraping the server already
    (`closed_scraped`), its scrapes saw no restart cover it (the same process came back, or the server was still down
    at the daemon's stop), so "let the daemon scrape" was no fix; only the server's or router's log says."""
    if r.closed_scraped:
        return ("none at the proxy: the daemon scrapes the server and saw no restart cover that close (the same "
                "process came back, or it was still down when the daemon stopped); the server's or router's log says "
                "whether it ran")
    return "let the daemon scrape the server (scrape.url) so a crash is seen, or read the router's log for it"


def _late_material(r: LiveRequest) -> bool:
    """UNSURE_FLAG: its late tokens (LiveRequest.late) are more than one and more than LATE_MATERIAL_SHARE of all its
    tokens: its gpu_energy_j counts the intervals they ran in, its attributed tokens do not count them."""
    return r.gpu_j > 0 and not r.gpu_missing and r.late > 1 and r.late > LATE_MATERIAL_SHARE * (r.tokens + r.late)


def _late_note(r: LiveRequest) -> str:
    """Why `_late_material` leaves its row out of J/token: both readings of its J/token, with the fix."""
    n = r.tokens + r.late
    hi = f"{r.gpu_j / r.tokens:.3g} J/token over its attributed tokens (high by the late ones)" if r.tokens > 0 else \
        "no J/token over its attributed tokens (none)"
    return (f"{UNSURE_FLAG}: {r.late:.0f} of its {n:.0f} tokens ({100 * r.late / n:.0f}%) arrived after the intervals "
            "they ran in had closed (a whole answer's tokens, or a stream's usage surplus over its chunks, come with its "
            "end, and a live request's intervals are held at most 120 s, max_hold_s, or 30 s while a prompt's length is "
            "unsaid, prompt_hold_s; or a proxy worker's records were read late): those intervals were split without them, "
            f"their work given to the requests live there (to it alone where none was beside it); its "
            f"{r.gpu_j:.1f} J counts every interval it was live in: {hi}, {r.gpu_j / n:.3g} over all its tokens (low "
            "by the share of their work the requests beside it took); left out of J/token; fix: stream answers that "
            "may run longer than that hold (a stream's tokens come as they are made), fewer busy processes beside the "
            "daemon")


def _idle_unmeasured(r: LiveRequest) -> bool:
    """UNSURE_FLAG: at least QUEUED_BESIDE_MIN_SHARE of its figure may be idle energy (`idle_unmeasured_j`, a bound at
    those intervals' mean power): it was live in busy intervals split before the GPUs' idle power at their power limit
    was measured (no run of idle intervals workmodel.IDLE_MIN_S long had closed: the first moments after the daemon's
    start, or after a change to a limit at or below the idle draw last measured), where the time no request was live
    went to the requests, not to idle. Unflagged, a request 0.05-0.5 s after the ledger's first read read +36% to +66%
    (100 W idle, 300 W live); the third of three streams 0.1 s apart sent at the daemon's start, +16% (the simulated
    vLLM, H200)."""
    return r.gpu_j > 0 and not r.gpu_missing and r.idle_unmeasured_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


def _idle_unmeasured_note(r: LiveRequest, cpu_j: float | None = None) -> str | None:
    """Its own part of energy_note (after the others, which keep their place) where `_idle_unmeasured`; `cpu_j`, its
    cpu_energy_j where it has one: high over the same intervals (before, unsaid: 75 J for 38 J, +97%, RAPL flat 50 W)."""
    if not _idle_unmeasured(r):
        return None
    cpu = (f"; its cpu_energy_j, split by the same shares, high by up to {r.idle_unmeasured_cpu_j:.1f} J "
           f"({100 * min(r.idle_unmeasured_cpu_j / cpu_j, 1.0):.0f}%) the same way"
           if cpu_j is not None and cpu_j > 0 and r.idle_unmeasured_cpu_j > 0 else "")
    return (f"{UNSURE_FLAG}: up to {r.idle_unmeasured_j:.1f} J ({100 * min(r.idle_unmeasured_j / r.gpu_j, 1.0):.0f}%) "
            "of its figure may be idle energy: it was live in intervals split before the daemon had measured the GPUs' "
            f"idle power at their power limit ({_idle_unmeasured_why(r.idle_lock_held)}), so the time no request was "
            "live there went to the requests live in them, not to idle; high by "
            f"up to that (those intervals' mean power over that time){cpu}; left out of J/token; fix: none for this "
            "row; "
            + (f"requests once those runs are filed (at a busy reading, or {LOCK_WAIT_S:g} s on)" if r.idle_lock_held
               else f"requests once the GPUs have been idle {IDLE_MIN_S:g} s at that limit")
            + f", or once the work model's fit there has matured ({MIN_BUSY} busy intervals), are split with it")


def _idle_unmeasured_why(lock_held: bool) -> str:
    """Why no idle power stood: runs held for the SM clock locks (`lock_held`: workmodel.CostLearner.lock_untold), or
    none closed. Before, the held runs' rows said none had closed, with no fix (rev-fix2 F1, F2)."""
    if lock_held:
        return ("runs of idle intervals had closed, but are held till a busy reading tells the GPUs' SM clock locks, "
                "which an idle card does not show: requests shorter than the sampling period are never read busy, or "
                "a GPU's lock change was seen half; each is filed to the locks as last told after at most "
                f"{LOCK_WAIT_S:g} s")
    return (f"no run of idle intervals {IDLE_MIN_S:g} s long had closed yet: the first moments after the daemon's "
            "start, or after a change to a limit at or below the idle draw last measured")


def _gpus_undecided(r: LiveRequest) -> bool:
    """UNSURE_FLAG: at least QUEUED_BESIDE_MIN_SHARE of its figure may be the draw of a GPU serving none of the proxied
    work (`gpus_undecided_j`, its share of every GPU's energy but the one drawing least): it was live in busy intervals
    split before the daemon judged which of several sampled GPUs serve the work, where every GPU's energy went to the
    work. Unflagged, two GPUs, one drawing 60 W serving nothing beside one at 100-300 W (a Ledger scene, the idle
    power measured first): +20% median (+14% to +24%) until it was judged."""
    return r.gpu_j > 0 and not r.gpu_missing and r.gpus_undecided_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


_UNDECIDED_WHY = ("split before the daemon knew which of the sampled GPUs serve the proxied work (told by the "
                  "placement check where its evidence is whole, judged from the GPUs' power once "
                  f"{MIN_IDLE} idle and {MIN_BUSY_GPU} busy intervals are in, or from {MIN_BUSY} busy intervals alone "
                  "where the work explains their power, and the two agreeing where both are in), so every sampled GPU's "
                  "energy went to the work, a GPU serving none of it included")
# Why it may never be known, for the log (ledger._say_undecided), and the fix: the placement check tells the ledger at
# once where its evidence is whole (service._check_placement); a load too even never lets the power judge.
UNDECIDED_CAUSE = ("the placement check tells nothing (the server's processes on no sampled GPU's process list the daemon "
                   "can read: a remote upstream, another pid namespace, a server not started yet; or its evidence not "
                   "whole: a sampled GPU's process list or per-process samples unread), "
                   f"and the GPUs' power has not yet told ({MIN_IDLE} idle and {MIN_BUSY_GPU} busy intervals, or "
                   f"{MIN_BUSY} busy ones whose work explains the power: never under a load too even)")
UNDECIDED_DISAGREE = ("the GPUs the placement check finds the server's processes on and those the GPUs' power judges "
                      "serving disagree (the warning before names both)")
UNDECIDED_PROVISIONAL = ("the placement check finds the server's processes on some sampled GPUs but another process's "
                         "context above a helper's on one it is not on, whose load may follow the traffic: its mask waits "
                         "for the GPUs' power to judge the same")
UNDECIDED_FIX = ("fix: run the daemon on the server's host where it can see the server's processes (its pid namespace) "
                 "and NVML's per-process samples, or sample only the one GPU a one-GPU server runs on (daemon.gpus); "
                 "where another process's context is on a sampled GPU, leave that GPU out of daemon.gpus; or, where "
                 "you know which sampled GPUs the server runs on, name them in daemon.serving_gpus; restart the daemon")
# The causes where the told mask is daemon.serving_gpus's (ledger.SERVING_ASSERTED_SOURCE).
UNDECIDED_ASSERTED_DISAGREE = ("the GPUs daemon.serving_gpus asserts serving and those the GPUs' power judges serving "
                               "disagree (the warning before names both; fix: correct daemon.serving_gpus, or empty it)")
UNDECIDED_ASSERTED_DOUBTED = ("the server's processes on NVML's process lists are on other sampled GPUs than "
                              "daemon.serving_gpus asserts (the warning before names both): the assertion waits for the "
                              "GPUs' power to judge the same")
_UNDECIDED_FIX = "fix: none for this row; for later ones, " + UNDECIDED_FIX.removeprefix("fix: ")


def _gpus_undecided_note(r: LiveRequest) -> str | None:
    """Its own part of energy_note where `_gpus_undecided`."""
    if not _gpus_undecided(r):
        return None
    return (f"{UNSURE_FLAG}: up to {r.gpus_undecided_j:.1f} J ({100 * min(r.gpus_undecided_j / r.gpu_j, 1.0):.0f}%) "
            f"of its figure may be the draw of a GPU serving none of its work: it was {_UNDECIDED_WHY} (the bound: its "
            f"share of every GPU's energy but the one drawing least); left out of J/token; {_UNDECIDED_FIX}")


def _serving_asserted_words(what: str, holds: str) -> str:
    """SERVING_ASSERTED_FLAG's words: `what` was split by daemon.serving_gpus's assertion alone, which the GPUs' power
    has not confirmed (kept in J/token: the operator's word, said here)."""
    return (f"{SERVING_ASSERTED_FLAG}: {what} split by daemon.serving_gpus (the operator's word; the GPUs' power has "
            f"not confirmed it): where it is wrong, {holds} the draw of a GPU serving none of the work, or lacks one "
            "that serves (by a whole GPU's share: -67% to +20% in a ledger scene); kept in J/token as the operator's "
            f"assumption; fix: {SERVING_ASSERTED_FIX}")


def _serving_asserted_interval_note(asserted: bool) -> str | None:
    """An interval row's SERVING_ASSERTED_FLAG part (inside `approximate:`): its split rested on the assertion alone."""
    return "approximate: " + _serving_asserted_words("its energy was", "requests_energy_j holds") if asserted else None


def _gpus_undecided_interval_note(bound_j: float, gpu_j: float) -> str | None:
    """An interval row's part where its energy went to the work before the daemon judged which GPUs serve (`bound_j`:
    every GPU's energy but the one drawing least, given where 1% or more of its GPU energy)."""
    if not bound_j > 0:
        return None
    share = f" ({100 * min(bound_j / gpu_j, 1.0):.0f}%)" if gpu_j > 0 else ""
    return (f"{UNSURE_FLAG}: requests_energy_j may be high and idle_energy_j low by up to {bound_j:.1f} J{share}: "
            f"{_UNDECIDED_WHY} (the bound: every GPU's energy but the one drawing least); its requests' rows say so "
            f"and are left out of J/token; {_UNDECIDED_FIX}")


def _idle_unmeasured_interval_note(bound_j: float, gpu_j: float, lock_held: bool = False) -> str | None:
    """An interval row's part where its busy time no request was live in went to its requests, no idle power measured
    yet (`_idle_unmeasured`'s cause; `bound_j`: that time at its mean power, given where 1% or more of its GPU energy).
    Before, silent: requests_energy_j held it, idle_energy_j 0 J (a request 0.5 s after the first read, 100 W idle: 50 J
    and 200 J to requests, 0 J idle, for 1 J + 150 J and 49 J + 50 J)."""
    if not bound_j > 0:
        return None
    share = f" ({100 * min(bound_j / gpu_j, 1.0):.0f}%)" if gpu_j > 0 else ""
    return (f"{UNSURE_FLAG}: requests_energy_j may be high and idle_energy_j low by up to {bound_j:.1f} J{share}: split "
            "before the daemon had measured the GPUs' idle power at their power limit "
            f"({_idle_unmeasured_why(lock_held)}), so the time no request was live in it went to the "
            "requests live in it, not to idle (the bound: that time at its mean power); its requests' rows say so "
            "and are left out of J/token; fix: none for this row")


def _closed_partial(r: LiveRequest) -> bool:
    """UNSURE_FLAG: a close with no answer written as not run (`is_passive`: no death shown at it, costed from then as
    idle) that kept a share by live time of the intervals closed while it was in flight, past the ledger's holds
    (max_hold_s, prompt_hold_s, from its arrival): its figure is part of a run, or of none. Unflagged, a whole answer
    closed 149.5 s in read 2940 J for 0 tokens (crash-costed, 14950 J) with no note, in J/token."""
    return r.gpu_j > 0 and r.trace.end_ns is not None and closed_unanswered(r) and is_passive(r)


def _queued_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG beside a close that may have queued unrun, or been a router's refusal (`resend_queued`,
    `crash_unsure_costed`): its figure is low by QUEUED_BESIDE_MIN_SHARE or more if that close never ran, or by an
    unknown amount (`queued_short_lower`: live beside it in intervals closed in an earlier step, which the re-run does
    not cover)."""
    return r.queued_short_lower or (r.queued_short_j > 0 and r.queued_short_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j)


def _unplaced_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG after a client's leave from a server whose kind the daemon does not know (`Ledger._unplaced`): at
    least QUEUED_BESIDE_MIN_SHARE of its figure is from intervals where a run-on for nobody may have been, in its share
    (its figure high by at most that)."""
    return r.unplaced_beside_j > 0 and r.unplaced_beside_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


def _batch_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG over a batch answered 400 that SGLang may have run on for nobody, no server scraped
    (`Ledger._batch_run_on`): at least QUEUED_BESIDE_MIN_SHARE of its figure is from intervals where that work may be."""
    return r.batch_beside_j > 0 and r.batch_beside_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


def _capped_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG past the RUN_ON_TO_END_MAX_S a llama.cpp whole answer's run-on was placed to, before its estimated
    end (`Ledger._run_on`): at least QUEUED_BESIDE_MIN_SHARE of its figure is from intervals where that run's rest, placed
    nowhere, may be in its share."""
    return r.capped_beside_j > 0 and r.capped_beside_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


def _counted_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG over a llama.cpp whole answer's run whose client left (`Ledger._counted_spans`): at least
    QUEUED_BESIDE_MIN_SHARE of its figure is from intervals where the server counted that run's tokens, read as bypass."""
    return r.counted_beside_j > 0 and r.counted_beside_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


def _held_whole_beside(r: LiveRequest) -> bool:
    """UNSURE_FLAG over intervals closed while a whole answer live in them was still in flight, no server counter read
    (`Ledger._close`): at least QUEUED_BESIDE_MIN_SHARE of its figure is from intervals where that answer's decode may be."""
    return r.held_whole_beside_j > 0 and r.held_whole_beside_j >= QUEUED_BESIDE_MIN_SHARE * r.gpu_j


# The fix for the rows beside a whole answer in flight past its hold, no counter read (`_held_whole_beside`).
HELD_WHOLE_FIX = ("stream long answers, or set scrape.server (auto, or the server's kind) so the daemon reads the "
                  "server's token counter, which counts a whole answer's tokens as they are decoded (vLLM; llama.cpp "
                  "with /slots)")


# The fix for a whole answer llama.cpp ran on past the span its run-on is placed in (`Ledger._run_on`): a max_tokens
# small enough that its run ends within it (twice as long as the server's pace decodes it), or no whole answer to leave.
CAPPED_RUN_ON_FIX = (f"send whole answers a max_tokens the server decodes within {RUN_ON_TO_END_MAX_S / 2:g} s (their "
                     "run after a client left is then placed whole), stream long answers (llama-server stops a stream "
                     "within a token of its client's leaving), or give clients a timeout longer than their answers take")
# The fix for the rows beside any whole answer llama.cpp ran on (`_counted_beside`): no whole answer left mid-way.
COUNTED_RUN_ON_FIX = ("stream long answers (llama-server stops a stream within a token of its client's leaving), or give "
                      "clients a timeout longer than their answers take")


# The fix for a run-on the daemon could not place, its server's kind unknown (`Ledger._unplaced`).
UNPLACED_FIX = ("set scrape.server (auto, or the server's kind) so the daemon scrapes the server and knows whether it "
                "runs a request on after its client left (SGLang, llama.cpp), and places that run")


def prompt_unread(r: LiveRequest) -> bool:
    """PROMPT_UNREAD_FLAG: its body streamed on unread (`body_bytes`, the proxy's) or read with no size in it
    (`prompt_unsized`: an image part, a shape not known), and no prompt length from the server, so its prefill was
    costed at none (a silent 0 before)."""
    extra = r.trace.extra
    return ((extra.get("body_bytes") is not None or extra.get("prompt_unsized") is not None)
            and told_prompt_tokens(r) is None and r.prompt_est is None)


def _prompt_length_fix(r: LiveRequest) -> str:
    """How its client could have had the server say its prompt's length: the same test as the `no_usage` estimate's
    (include_usage is an OpenAI chat or completions stream's option), and for one its client left, the usage in every
    chunk (its final usage would have come after the client had gone). A stateful Responses turn: its conversation sent
    in its body instead (promptlen's unsized reason names the field)."""
    if r.trace.extra.get("prompt_unsized") in STATEFUL_REASONS:
        return PROMPT_STATEFUL_FIX
    if not (r.trace.stream is True and r.trace.api in ("openai-chat", "openai-completions")):
        return PROMPT_NO_ASK_FIX
    return PROMPT_RUNNING_USAGE_FIX if r.trace.outcome == "client_disconnected" else PROMPT_USAGE_FIX


def _best_of_flagged(r: LiveRequest, best_of_ignored: bool) -> bool:
    """It asked for best_of sequences beyond those returned, on a server that runs them (BEST_OF_FLAG)."""
    return bool(r.trace.extra.get("best_of")) and not best_of_ignored


def _count_open_flagged(r: LiveRequest) -> bool:
    """Its count is a running count with no final one after (COUNT_OPEN_FLAG), and not whole by its length stop."""
    c, extra = r.trace.counts, r.trace.extra
    return (c is not None and c.count_open and c.count_problem is None
            and not at_limit(c.choice_stops, c.generated_tokens, extra.get("max_tokens"),
                             max(extra.get("sequences", 1), 1)))


def _approximate_note(r: LiveRequest, best_of_ignored: bool = False) -> str | None:
    """Why a request's energy rests on an estimate rather than the server's counts (None: it does not);
    `best_of_ignored`: the server is one that takes no best_of (its answer is the n asked, nothing unseen)."""
    notes = []
    no_tokens = _no_tokens_note(r)
    if no_tokens is not None:
        notes.append(no_tokens)
    if r.prompt_est is not None and told_prompt_tokens(r) is None:
        why = _unsaid_reason(r)
        said, fix = UNSAID_NOTES[why], UNSAID_FIX.get(why, "")
        if why == "no_usage" and not (r.trace.stream is True and r.trace.api in ("openai-chat", "openai-completions")):
            # include_usage is an OpenAI chat or completions stream's option: a whole answer, a native stream, or a
            # Responses stream (its usage unasked, in response.completed) has none to ask for.
            said, fix = "the server's answer did not say the prompt's length", ""
        if _whole_gone_costed(r):
            said += WHOLE_GONE_RUN_ON if r.run_on_unknown else WHOLE_GONE_COSTED
        if r.prompt_cap is not None:
            est, in_flight_s, rate, source, beside = r.prompt_cap
            rate_said = ("the work model's fitted prefill rate" if source == "fitted" else
                         "the slowest taken, the work model's fitted rate being below it" if source == "floor" else
                         "the default prefill rate, the work model's fit not mature")
            notes.append(f"{said}; its prefill was costed at {r.prompt_est[0]:.0f} prompt tokens, what its "
                         f"{in_flight_s:.2f} s in flight could prefill at {rate:.0f} tokens/s ({rate_said}) beside the "
                         f"{beside:.0f} prompt tokens of other requests placed then, of an estimate of {est:.0f} "
                         f"({r.prompt_est[1]}){fix}")
        else:
            notes.append(f"{said}; its prefill was costed at an estimate of {r.prompt_est[0]:.0f} "
                         f"prompt tokens ({r.prompt_est[1]}){fix}")
    late = r.prefill_uncosted and not prompt_unread(r)  # its length said after its prefill's intervals closed
    if (prompt_unread(r) or late) and r.gpu_j > 0 and not r.gpu_missing:
        unsized = r.trace.extra.get("prompt_unsized")
        body = (f"its request body was read but its prompt's size could not be ({unsized}: no characters or token ids "
                "that count its tokens)" if unsized is not None else
                f"its request body ({r.trace.extra['body_bytes']} bytes) was not read (over the proxy's inspection "
                "bound, or past its memory budget for reading bodies)")
        fix = _prompt_length_fix(r)
        if late:  # it asked, and the usage came at its end: only a length said in every chunk comes in time
            fix = PROMPT_RUNNING_USAGE_FIX if fix not in (PROMPT_NO_ASK_FIX, PROMPT_STATEFUL_FIX) else fix
        if unsized is None:
            fix = PROMPT_BODY_FIX if fix == PROMPT_NO_ASK_FIX else f"{PROMPT_BODY_FIX}; or {fix}"
        said = ("the server had not said the prompt's length when the intervals over its prefill closed (held at most "
                f"{PROMPT_HOLD_S:g} s after its arrival; it said it later)" if late else
                "the server never said the prompt's length")
        notes.append(f"{PROMPT_UNREAD_FLAG}: {body} and {said}: its prefill is not costed, so its figure is low and the "
                     f"requests beside it high; fix: {fix}")
    elif r.unread_beside_j > 0 and r.gpu_j > 0:
        kinds = r.unread_beside_kinds
        why = "; ".join(w for k, w in (("unread", "unread: over its inspection bound, or past its memory budget for "
                                                  "reading bodies"),
                                       ("sizeless", "read, with no prompt size in it: an image or audio part, a shape "
                                                    "not known"),
                                       ("stateful", "a stateful Responses turn, its stored conversation not in its body "
                                                    "nor its length kept by the proxy")) if k in kinds)
        fixes = "; ".join(f for k, f in (("unread", PROMPT_BODY_FIX),
                                         ("sizeless", "that request's server saying its prompt's length (an OpenAI "
                                                      "stream: include_usage, with continuous_usage_stats where its "
                                                      "client may leave)"),
                                         ("stateful", f"that turn's client: {PROMPT_STATEFUL_FIX}")) if k in kinds)
        notes.append(f"{PROMPT_UNREAD_FLAG}: {100 * min(r.unread_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     f"intervals over the prefill of a request whose body gave the proxy no prompt size ({why}), its "
                     "prompt's length unsaid when those intervals closed: that prefill is not costed, its energy in the "
                     f"shares of the requests live then, so this figure may be high; fix: {fixes}")
    if is_unseen(r) and not is_passive(r):
        notes.append(_uncounted_note(r))
    if r.run_on_end_ns is not None:
        notes.append(_run_on_note(r))
    if resend_queued(r) and r.gpu_j > 0:
        tr = r.trace
        notes.append(f"{UNSURE_FLAG}: its close came {(tr.end_ns - tr.arrival_ns) / 1e9:.2f} s after its arrival, longer "
                     f"than a close crossing a request on the wire takes (up to {CROSSING_CLOSE_MAX_S * 1e3:.0f} ms), "
                     "and its resend was refused or met a new process's loading page: the server may have read it and held it queued behind full "
                     "slots, never running it (then 0 J and no tokens, this figure the requests' beside it, theirs low "
                     "by it), or run it until its close as costed here; nothing measured says which, so it and the "
                     "requests beside it are left out of J/token; fix: none at the proxy (the server's log says whether "
                     "it had started it)")
    if resend_crossed(r) and r.gpu_j > 0:
        tr = r.trace
        notes.append(f"{UNSURE_FLAG}: its close came {(tr.end_ns - tr.arrival_ns) * 1e-6:.0f} ms after its arrival, "
                     "within the time a close crossing a request on the wire takes "
                     f"({CROSSING_CLOSE_MAX_S * 1e3:.0f} ms), "
                     "and its resend was refused or met a new process's loading page: the server never began it, or "
                     "read it and held it queued behind full slots (0 J and no tokens either way, this figure the "
                     "requests' beside it), or ran it those milliseconds as costed here; the daemon does not read "
                     "whether the server's slots were full at its arrival, so it is left out of J/token; fix: none at "
                     "the proxy (the server's log says whether it had started it)")
    if _closed_partial(r):
        s = (r.trace.end_ns - r.trace.arrival_ns) / 1e9
        notes.append(f"{UNSURE_FLAG}: its upstream closed the connection with no answer {s:.2f} s after its arrival, "
                     "and no restart its scrapes confirmed covered that close with proof of a death, so it is costed as "
                     "not run from there (it may have run, a crash, or been refused unrun by a router in front of the "
                     "server); this figure is partial: its share by live time of the intervals that closed while it was "
                     "still in flight, past the ledger's holds on a live request's intervals (max_hold_s, a prompt's "
                     "prompt_hold_s, from its arrival), none of the rest: low if it ran to its close, high if it never "
                     f"ran (the requests beside it then low by it); left out of J/token; fix: {_unproven_close_fix(r)}")
    if _queued_beside(r) and r.gpu_j > 0:
        notes.append(f"{UNSURE_FLAG}: it was live beside a request closed by a crash that may have waited queued "
                     "unrun, or been refused unrun by a queuing router in front of the server (its row says which), "
                     "costed as run: had it never run, this figure would be "
                     f"{'at least ' if r.queued_short_lower else ''}"
                     f"{r.queued_short_j:.1f} J ({100 * r.queued_short_j / r.gpu_j:.1f}%) higher, the same split re-run "
                     f"without it ({100 * min(r.queued_beside_j / r.gpu_j, 1.0):.0f}% of this figure is from the "
                     "intervals over that request"
                     + ("; a lower bound: the re-run covers only the intervals closed with its close, not those closed "
                        "earlier while it was still in flight past the ledger's holds on a live request's intervals "
                        "(max_hold_s, prompt_hold_s), split with it live as run" if r.queued_short_lower else "")
                     + "); fix: none at the proxy (the server's or router's log says whether that request had "
                       "started)")
    if r.run_on_unplaced and r.gpu_j > 0:
        notes.append(f"{UNSURE_FLAG}: its client left, and the daemon scrapes no server (scrape.server = none), so it "
                     "does not know whether the server ran it on for nobody (SGLang until its abort, up to "
                     f"{RUNS_ON_AFTER_LEAVE['sglang'][1]:g} s; llama.cpp a whole answer to its end) or aborted it "
                     "(vLLM): no run-on is placed, its figure may be low and those of the requests beside it high; "
                     f"left out of J/token; fix: {UNPLACED_FIX}")
    if _unplaced_beside(r):
        notes.append(f"{UNSURE_FLAG}: {100 * min(r.unplaced_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     "intervals after a client left a request the server may have run on for nobody, unplaced (the "
                     "daemon scrapes no server, scrape.server = none, so it knows no server kind): that work may be in "
                     f"its share, its figure high by up to that; left out of J/token; fix: {UNPLACED_FIX}")
    if _batch_beside(r):
        notes.append(f"{UNSURE_FLAG}: {100 * min(r.batch_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     "intervals after a batch of prompts was answered 400, which SGLang does for one prompt in the "
                     "context's last 6 tokens while running the others to their cap for nobody; the daemon scrapes no "
                     "server (scrape.server = none), so it neither knows the server's kind nor sees that work in a "
                     "token counter: it may be in this row's share, its figure high by up to that; left out of "
                     f"J/token; fix: {UNPLACED_FIX}")
    if _capped_beside(r):
        notes.append(f"{UNSURE_FLAG}: {100 * min(r.capped_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     "intervals where a whole answer llama.cpp runs on to its end after its client left may still have "
                     f"run: its run-on is placed only to {RUN_ON_TO_END_MAX_S:g} s after that leave (its intervals held "
                     "no longer), and its rest, to its max_tokens, may be in this row's share, its figure high by up to "
                     f"that; left out of J/token; fix: {CAPPED_RUN_ON_FIX}")
    if _counted_beside(r):
        notes.append(f"{UNSURE_FLAG}: {100 * min(r.counted_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     "intervals where llama.cpp ran a whole answer whose client left (from its arrival where its "
                     "tokens before the leave were placed on its row or are counted only at its end, else from the "
                     "leave; placed on that answer's row to its max_tokens at the latest streams' pace, or with no "
                     "max_tokens or pace placed nowhere, to when the server's count next stood still for a second): "
                     "the server counts that run's tokens, which no proxied request lists, so where its count is read "
                     "they read as bypass traffic and unproxied takes their energy out of these shares, more or less "
                     "than that run used, and where not, unplaced, that run's work is in these shares: its figure may "
                     f"be low or high; left out of J/token; fix: {COUNTED_RUN_ON_FIX}")
    if _held_whole_beside(r):
        notes.append(f"{UNSURE_FLAG}: {100 * min(r.held_whole_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     "intervals closed while a whole answer beside it was still in flight (its intervals are held for "
                     "it 120 s at most, or the daemon stopped): that answer's tokens come only with its end, too late "
                     "for them, and no server token counter is read (scrape.server = none), so its decode there, "
                     "whether its client stayed or left, may be in this row's share, its figure "
                     # Its own tokens late too (a whole answer itself past its hold): its own decode there went to the
                     # answers beside it, so low as well (the review's batch scene: -13..-22% with 63-100% said "high").
                     + ("low or high (its own tokens came late too)" if r.late > 0 else "high by up to that")
                     + f"; left out of J/token; fix: {HELD_WHOLE_FIX}")
    if _whole_gone(r):  # its share is of intervals it was live in only, not of its work
        notes.append(f"{WHOLE_GONE_NOTE}; its own figure is a share of intervals it was live in, none of its work")
    if _best_of_flagged(r, best_of_ignored):
        notes.append(_best_of_note(r.trace.extra))
    if _n_cmpl_unsure(r):
        notes.append(_n_cmpl_note(r))
    if _late_material(r):
        notes.append(_late_note(r))
    c = r.trace.counts
    if _count_open_flagged(r):
        notes.append(f"{COUNT_OPEN_FLAG}: its count ({c.generated_tokens} tokens) is the server's running count as of "
                     "its last chunk that carried one, its closing chunk and no final usage saying any after (SGLang's "
                     "chat stream sends usage only on chunks with text): the tokens of a last step without text (its "
                     "end-of-text token, one on a stop) are in no count, so generated_tokens may be low by them and "
                     f"their energy is in unproxied; fix: {COUNT_OPEN_FIX}")
    if r.held_tail_n > 0:
        notes.append(f"{HELD_TAIL_FLAG}: {r.held_tail_n:.0f} of its {c.generated_tokens} generated tokens (the server's "
                     "count, summed over its sequences where it asked n > 1) came in no chunk: a tool call the server's parser held until it closed, "
                     "cut by max_tokens; their count is the server's, but when they ran is inferred, spread evenly from "
                     "its last chunk to the server's end of its answer, and its share of the intervals there with it; "
                     f"fix: {HELD_TAIL_FIX}")
    if r.beside_uncounted:
        kinds = sorted(r.beside_uncounted)
        notes.append(f"requests the proxy does not count ran beside it ({', '.join(kinds[:3])}"
                     f"{f' and {len(kinds) - 3} more' if len(kinds) > 3 else ''}): their GPU work is unseen, so part "
                     "of their energy is in this request's share")
    by_client = (r.burst_s is not None or (r.bursts and not _parser_held(r))) and client_held(r)
    if by_client:
        notes.append(_client_held_note(r))
    elif r.burst_s is not None:
        notes.append(f"its tokens reached the proxy in one burst, {r.burst_s:.1f} s after its arrival (held back between "
                     f"the server and the proxy: a buffering proxy or gateway{_own_late_said(r)}), and were spread over "
                     f"{'the server' + chr(39) + 's decode time' if _server_timed(r) else 'its run'} at the server's "
                     f"pace as a non-streamed answer's; its decode_s is the burst's, not the server's ({_burst_fix(r)})")
    if r.bursts and _parser_held(r):
        # Each burst came in a chunk that carried a tool call and several tokens by the server's own running count: the
        # server held them (SGLang's deepseekv3 parser sends a call whole once it closes), no hop between. Blaming a
        # buffering proxy sent its operator hunting one that is not there.
        notes.append(f"its tokens reached the proxy in {r.bursts + 1} bursts, up to {r.held_s:.1f} s apart (the "
                     "server's tool-call parser held a call's tokens and sent them in one chunk once it closed: the "
                     "server's running count jumped there, so no proxy between held them), each burst's spread over the "
                     "time before it at the server's pace; its TTFT and decode_s are the bursts', not the server's "
                     "(nothing to fix: a parser that streams calls as they go, such as SGLang's JSON detectors, "
                     "sends them step by step)")
    elif r.bursts and not by_client:
        notes.append(f"its tokens reached the proxy in {r.bursts + 1} bursts, up to {r.held_s:.1f} s apart (held back "
                     "between the server and the proxy: a buffering proxy or gateway that passes its buffer on when "
                     f"full or on a timer{_own_late_said(r)}), each burst's spread over the time before it at the "
                     f"server's pace; its TTFT and decode_s are the bursts', not the server's ({_burst_fix(r)})")
    if r.closed_s > 0 and (r.burst_s is not None or r.bursts):
        notes.append(f"{r.closed_s:.1f} s of its run ran in intervals closed before its tokens came (held longer than "
                     "they can wait): that energy went to the requests beside it or to idle, and its own figure is low "
                     f"({CLIENT_HELD_FIX if by_client else BURST_FIX})")
    if r.cache_late >= CACHE_UNSAID_MIN:
        notes.append(f"{CACHE_LATE_FLAG}: its answer said {r.cache_late:.0f} of its prompt tokens were found in the "
                     "prefix cache only at its end, after intervals over its prefill had closed with them costed as "
                     "computed (its prompt's length was said early, its cached count not): its GPU energy may be high, "
                     f"the requests beside it low; fix: {CACHE_LATE_FIX}")
    if (r.cache_beside_late >= CACHE_UNSAID_MIN or r.late_unresolved) and r.gpu_j > 0:
        said = (f"a request beside it said only at its end that {r.cache_beside_late:.0f} of its prompt tokens were found "
                "in the prefix cache" if r.cache_beside_late >= CACHE_UNSAID_MIN else
                f"a request beside it had not said its cached count {PROMPT_HOLD_S:.0f} s after this one ended")
        notes.append(f"{CACHE_LATE_FLAG}: up to {100 * min(r.late_wait_j / r.gpu_j, 1.0):.0f}% of its GPU energy is "
                     f"from intervals over that request's prefill, closed with its whole prompt costed as computed "
                     f"({said}): its own share there may be low; fix: {CACHE_LATE_FIX}")
    if r.cache_unsaid >= CACHE_UNSAID_MIN:
        apart = (" (its n choices' prompt, prefilled apart by the server in a request of its own whose cache hit it "
                 "does not say, costed whole)") if r.prefilled_apart else ""
        notes.append(_cache_unsaid_note(r.cache_unsaid, "its prefill" + apart))
    elif r.cache_beside_j > 0:
        notes.append(f"{CACHE_UNSAID_FLAG}: {100 * r.cache_beside_j / r.gpu_j:.0f}% of its GPU energy is from intervals "
                     f"over which the server reused up to {r.cache_beside:.0f} cached prompt token(s) that it did not "
                     "attribute to requests (its prefix-cache counter on /metrics rose by more than the cached counts "
                     "the answers said): a reused prompt beside it was costed as computed whole, so its own share may "
                     f"be low; fix: {CACHE_UNSAID_FIX}")
    if _gone_flagged(r):
        notes.append(f"{GONE_PREFILL_FLAG}: {100 * min(r.gone_beside_j / r.gpu_j, 1.0):.0f}% of its GPU energy is from "
                     f"intervals over (or within {GONE_ABORT_SLACK_S:g} s after) a request that ended before its first "
                     "token with its prompt's length unsaid (its client left, or its answer stopped, while it was queued or "
                     "prefilling): that prefill, costed at an estimate from its body (bounded by its time in flight; not "
                     "at all where the body gave none; a whole answer's decode after it, if any, unseen, but on SGLang, "
                     "which runs it on to its abort), may have been cut short, never run or run whole, or run on to the "
                     f"server's next step (on SGLang to its abort of it, up to {RUNS_ON_AFTER_LEAVE['sglang'][1]:g} s), "
                     "so this request's "
                     "share there may be high or low; fix: "
                     f"{GONE_PREFILL_FIX}")
    if r.serving_asserted_j > 0:
        notes.append(_serving_asserted_words(f"{100 * min(r.serving_asserted_j / r.gpu_j, 1.0):.0f}% of its GPU "
                                             "energy is from intervals", "its figure holds"))
    # Given much there, or little where the range's other end gives it much (a queued prompt beside another's decode).
    if r.gpu_j > 0 and max(r.fixed_j, r.fixed_hi_j - r.fixed_j) >= FIXED_RATIO_MIN_SHARE * r.gpu_j:
        pct = 100 * min(r.fixed_j / r.gpu_j, 1.0)
        lead = (FIXED_RATIO_LEAD_NONE if r.fixed_j <= 0 else
                FIXED_RATIO_LEAD.format(pct=f"{pct:.0f}" if pct >= 0.5 else "under 1"))
        # Rounded first: an end a hair below its figure reads +0%, not -0%.
        notes.append(FIXED_RATIO_NOTE.format(lead=lead, why=r.fixed_why,
                                             lo=round(100 * (r.fixed_lo_j - r.fixed_j) / r.gpu_j) + 0.0,
                                             hi=round(100 * (r.fixed_hi_j - r.fixed_j) / r.gpu_j) + 0.0))
    if r.gpu_j > 0 and max(abs(r.ctx_up_j), abs(r.ctx_down_j)) >= CTX_BAND_MIN_SHARE * r.gpu_j:
        lo, hi = sorted((r.ctx_up_j, r.ctx_down_j))
        notes.append(CTX_BAND_NOTE.format(se=CTX_BAND_SE, lo=round(100 * min(lo, 0.0) / r.gpu_j) + 0.0,
                                          hi=round(100 * max(hi, 0.0) / r.gpu_j) + 0.0))
    c = r.trace.counts
    if r.server_ahead >= 0.5 and not r.to_server and no_tokens is None and (c is None or c.tokens_estimated):
        notes.append(f"its tokens were counted from its chunks (one each, or their logprobs) and the server's counter ran {r.server_ahead:.0f} token(s) "
                     "ahead of the proxy's while it was live: their energy is in unproxied, not here (fix: "
                     "\"stream_options\": {\"include_usage\": true}, or vLLM's --enable-force-include-usage)")
    return "approximate: " + "; ".join(notes) if notes else None


def _server_timed(r: LiveRequest) -> bool:
    c = r.trace.counts
    return c is not None and c.predicted_ms is not None and r.placed_from_ns is not None \
        and r.placed_from_ns > r.trace.arrival_ns


def _cache_flagged(r: LiveRequest) -> bool:
    """Its energy_note says CACHE_UNSAID_FLAG (its prompt costed whole, or its share beside one that was)."""
    return r.cache_unsaid >= CACHE_UNSAID_MIN or r.cache_beside_j > 0


def _gone_flagged(r: LiveRequest) -> bool:
    """Its energy_note says GONE_PREFILL_FLAG: part of its energy is from intervals beside a request gone before its
    first token (`LiveRequest.gone_beside_j`)."""
    return r.gone_beside_j > 0 and r.gpu_j > 0


def _late_flagged(r: LiveRequest) -> bool:
    """Its energy_note says CACHE_LATE_FLAG (its own count said late, or a share beside one that was)."""
    return r.cache_late >= CACHE_UNSAID_MIN or ((r.cache_beside_late >= CACHE_UNSAID_MIN or r.late_unresolved)
                                                and r.gpu_j > 0)


def _interval_cache_note(unsaid: float) -> str | None:
    """An interval row's CACHE_UNSAID_FLAG note (None below CACHE_UNSAID_MIN). Its energy is whole; its prefill_tokens
    and its requests' split are not (their rows say so too)."""
    if unsaid < CACHE_UNSAID_MIN:
        return None
    return "approximate: " + _cache_unsaid_note(unsaid, "this interval") + "; prefill_tokens here may be high by them"


def _cache_unsaid_note(tokens: float, what: str) -> str:
    """Why a prefill figure may be high (a request's, an interval's): prefix-cache hits the server counted and no
    answer said (CACHE_UNSAID_FLAG)."""
    return (f"{CACHE_UNSAID_FLAG}: the server reused {tokens:.0f} cached prompt token(s) in the scrape window(s) over "
            f"{what} that it did not attribute to requests (its prefix-cache counter on /metrics rose by more than the "
            "cached counts the answers said), and a prompt whose answer says no cached count is costed as computed "
            f"whole: a reused prompt's prefill is charged too high, the requests beside it too low; fix: "
            f"{CACHE_UNSAID_FIX}")
