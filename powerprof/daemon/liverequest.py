"""One proxied request's live account, as the ledger keeps it: what its rows are made from, and what it has told.

`LiveRequest` is filled by `ledger.Ledger` as the request's tokens, prompt and energy shares come; the few readings of it
that the ledger's accounting and its rows' words (`rowtext`) both take are here: its prompt length once the server
told it (`told_prompt_tokens`), whether it is GPU work the proxy sees (`is_unseen`, `is_passive`), whether it ended
before its first token with its prompt unsaid after the server had it (`gone_unsaid`), and when the server stopped
working on it (`server_end_ns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .proxy import BODY_LEFT_NOTE, CRASHED_NOTE, NOT_FORWARDED, RESEND_LOADING, RESEND_REFUSED, RequestTrace

PROMPT_HOLD_S = 30.0  # hold intervals this long at most for a live request's prompt length
# The longest a kept-alive connection's close crossing a request on the wire takes from its arrival (milliseconds; the
# proxy resends within forward.STALE_CLOSE_MAX_S, 1 s). A close later than this whose resend found the server dead
# (`resend_queued`) may be a request the server had read but queued behind full slots, never run.
CROSSING_CLOSE_MAX_S = 0.05
# A run-on's min_tokens rule out an end by itself before SGLang's abort only where they leave more than this much over
# what its pace (an estimate, `Ledger._place_run_ons`) decodes to that abort: a real pace a few % above the estimate
# decodes them in time, the answer then free to end, unseen (`LiveRequest.run_on_may_end`).
RUN_ON_MAY_END_PACE_MARGIN = 0.25
# A whole answer a server runs on to its end (llama.cpp: `Ledger._run_on`) is held open no longer than this past its
# client's leaving (its intervals wait for that run, bounded by the prompt hold too); past it, its rest is placed nowhere
# and the requests beside it say so (`capped_beside_j`).
RUN_ON_TO_END_MAX_S = 30.0


@dataclass
class LiveRequest:
    trace: RequestTrace
    # Its n > 1 choices' prompt prefilled apart by the server, in a request of its own whose cache hit it never says
    # (SGLang's parallel sampling): its choices' cached counts are no part of its prefill work (`_prefill_cached`).
    prefilled_apart: bool = False
    ev_t: list = field(default_factory=list)
    ev_n: list = field(default_factory=list)
    gpu_j: float = 0.0
    cpu_j: float = 0.0
    cpu_known: bool = False
    cpu_missing: bool = False  # given a share of an interval whose CPU energy is unknown
    gpu_missing: bool = False  # given a share of an interval some GPU gave no energy for (lost, failing reads)
    tokens: float = 0.0
    spent: float = 0.0  # tokens of events already closed (the context of later ones)
    late: float = 0.0  # tokens that came after their interval had closed: not attributed, flagged on the row
    to_server: bool = False  # its chunk counts were scaled to the server's final count (usage)
    low_told: bool = False  # its tag windows were told its count-less surplus (`Ledger._tags_counted_low`)
    server_ahead: float = 0.0  # tokens the server counted beyond the proxy's in intervals it was live in
    prompt_est: tuple | None = None  # (tokens, how) its prompt was costed at where the server never counted it
    # Ended before its first token: (the body's estimate, its seconds in flight, the prefill rate, the rate's source, the
    # prompt tokens of other requests placed in that time) where the estimate was more than its time in flight had room
    # for beside them (Ledger._cost_gone), and `prompt_est` was cut to that room.
    prompt_cap: tuple | None = None
    # Its GPU joules from intervals a request that ended before its first token, its prompt unsaid, was live in
    # (GONE_PREFILL_FLAG): that prompt's prefill, costed at an estimate or not at all, may have run longer or shorter.
    gone_beside_j: float = 0.0
    # Its client left a server of unknown kind (scrape.server = none) that may have run it on for nobody, unplaced
    # (`Ledger._unplaced`): its figure may be low; and its GPU joules from intervals after such a leave, where that
    # run-on's work may be in its share (UNSURE_FLAG both).
    run_on_unplaced: bool = False
    unplaced_beside_j: float = 0.0
    # Its GPU joules from intervals past the RUN_ON_TO_END_MAX_S a llama.cpp whole answer's run-on was placed to, before
    # that run's estimated end (`Ledger._run_on`): its rest, placed nowhere, may be in this share (UNSURE_FLAG).
    capped_beside_j: float = 0.0
    # Its GPU joules from intervals over a batch answered 400 that SGLang may have run on for nobody with no server
    # scraped (`Ledger._batch_run_on`, scrape.server = none): that work, counted nowhere, may be in this share (UNSURE_FLAG).
    batch_beside_j: float = 0.0
    # Its GPU joules from intervals over a llama.cpp whole answer's run-on after its client left, whose tokens the server
    # counts and no proxied request lists (`Ledger._counted_spans`): read as bypass, their energy in unproxied, out of
    # this share, more or less than that run used (UNSURE_FLAG).
    counted_beside_j: float = 0.0
    # Its GPU joules from intervals closed while a whole answer live in them was still in flight, no server counter read
    # (`Ledger._close`: held past max_hold_s, or at the daemon's stop): that answer's decode there, its tokens come too
    # late for them, is in this share (UNSURE_FLAG).
    held_whole_beside_j: float = 0.0
    # Its GPU joules from intervals over the prefill of a request whose body the proxy streamed on unread, its prompt's
    # length unsaid (PROMPT_UNREAD_FLAG): that prefill is not costed, so its energy is in this request's share.
    unread_beside_j: float = 0.0
    # What was wrong with those requests' bodies (`unread`: streamed on unread; `sizeless`: read, no size in it): the
    # fix its row gives is theirs.
    unread_beside_kinds: set = field(default_factory=set)
    # Intervals over its own prefill closed with it uncosted (prompt_unread then: a sizeless or unread body, no length
    # said yet); a length the server says later (past the 30 s hold) does not reopen them, so its row says so too.
    prefill_uncosted: bool = False
    # Its client left and the server ran it on for nobody until it aborted it (`Ledger._run_on`: SGLang; llama.cpp,
    # to its end): that run's estimated end, the tokens placed over it (no client received them) and whose pace they
    # were placed at.
    run_on_end_ns: int | None = None
    run_on_from_ns: int | None = None  # a stream's run-on, from here, waits to be placed (`Ledger._place_run_ons`)
    run_on_tokens: float = 0.0
    run_on_late: float = 0.0  # of those, placed before an interval already closed: late, not in its attributed tokens
    run_on_pace: str | None = None
    run_on_capped: bool = False  # its max_tokens ended that run before the abort
    # Its run-on's (t_ns, tokens, duration_ns) listed for the scrape windows where SGLang counted it (a length finish,
    # `Ledger._place_run_on`); taken back where a restart cut it first (`Ledger._cut_run_on`).
    run_on_listed: tuple | None = None
    # Its answer may have ended by itself (its end of text) before that run's placed end, unseen: the fewest tokens it
    # then ran on (its min_tokens' rest, else 0); None where its body rules that out (`Ledger._place_run_on`).
    run_on_may_end: float | None = None
    run_on_to_end: bool = False  # a server that runs a whole answer on to its end (llama.cpp), not to an abort
    run_on_unknown: bool = False  # a whole answer llama.cpp ran on to an end nothing placed (no max_tokens or pace)
    run_on_prefill: bool = False  # a stream gone mid-prefill that llama.cpp prefills whole: its run ends at its first token
    run_on_restart: bool = False  # a server restart ended its run-on (`Ledger._end_run_ons_at_restart`)
    # That death was proved by a refused connection alone, no page after saying a restart (`Ledger.add_server_tokens`)
    run_on_unrestarted: bool = False
    run_on_crash: bool = False  # a whole answer whose connection the server closed with no answer: run to there
    # A batch answered 400 whose other prompts SGLang may run for nobody: its windows say batch_run_on
    # (`Ledger._batch_run_on`)
    batch_run_on: bool = False
    # Such a batch with no server scraped: no window marked, the requests beside it flagged (`batch_beside_j`)
    batch_unplaced: bool = False
    # Such a batch's run its row names (it is the cause): (sequences that may run on, tokens each at most, seconds from
    # its arrival at most, None: no end known)
    batch_bound: tuple[int, int | None, float | None] | None = None
    # That span was cut at ledger.BATCH_SPAN_MAX_S: its run may go on past it, the rows there unflagged
    batch_capped: bool = False
    # ... but held open past it while its at-finish server has counted nothing since its arrival that its prompts' end
    # may be (`Ledger._hold_uncounted_batches`): the rows there flagged (batch_run_on) until such a count comes
    batch_uncounted: bool = False
    # Its close with no answer came as its server died (`Ledger._crash_seen`): a crash, not a router refusing it
    crash_seen: bool = False
    # Seen only as sent before the old process's last good scrape, a scrape then finding it down by a 503 and a page
    # after saying a restart, with no death shown (`Ledger._crash_seen`): a queuing router's refusal (llama-swap holding
    # it while it swaps models) reads the same, so its row says both readings, flagged UNSURE_FLAG.
    crash_unsure: bool = False
    # That unsure crash seen by its resend's meeting llama-server's loading page alone (proxy.RESEND_LOADING), not by
    # its sending before the old process's last good scrape (`Ledger._crash_seen`): its row says which.
    crash_by_page: bool = False
    # That crash explained only by a death whose page back was past a new process's reach (`Ledger._crash_reach`): the
    # same process back ran it on to its next wait, or a restarted one's counter persisted. (Its last scrape before it,
    # the refused scrape), monotonic ns; its row says both readings, flagged UNSURE_FLAG.
    crash_reach: tuple[int, int | None] | None = None
    # That crash unsure because it was a /generate to a server whose kind is not known (`Ledger._crash_seen`): SGLang
    # runs it, llama-server and vLLM refuse it unrun (404).
    crash_route_unsure: bool = False
    # Its close with no answer's row held for a page confirming the restart a 503 "Loading model" alone suggested, let go
    # at DOWN_HOLD_MAX_S with none come (`Ledger._down_hold`): (that window's first found-down scrape, monotonic ns; the
    # cap, s). Its row, costed as not run, says so.
    down_hold_over: tuple[int, float] | None = None
    # Its GPU joules from intervals over a crash-costed close that may never have run (`resend_queued`,
    # `crash_unsure_costed`): that request's figure may hold energy that is this one's (its note says this share;
    # UNSURE_FLAG by queued_short_j).
    queued_beside_j: float = 0.0
    # What its GPU joules would gain were that request never run (the same split re-run without it: `Ledger`'s close):
    # how low this request's figure is in that reading.
    queued_short_j: float = 0.0
    # That gain is a lower bound: such a request was live beside it in intervals closed in an earlier step, while it was
    # still in flight past the ledger's holds (max_hold_s), which the re-run does not cover (its note says "at least").
    queued_short_lower: bool = False
    # The first interval edge of the step whose re-run left it out (a queued close's; monotonic ns): the intervals before
    # were split with it live, as run.
    queued_rerun_from_ns: int | None = None
    # The daemon scraped the server when it closed (`Ledger.scraping`): a close with no answer its scrapes saw no restart
    # cover is no crash they missed, and "scrape the server" is no fix for it (rowtext's notes).
    closed_scraped: bool = False
    # That restart's window (the old process's last scrape, the new one's first), its first scrape that found the
    # server down (None: none did) and the latest instant the old process is known alive at (its last scrape, this
    # request's arrival or its client's leaving after it), monotonic ns: the span its run-on's end is known within
    # (`Ledger._run_on_cut_ns`).
    run_on_death: tuple[int, int, int | None, int] | None = None
    # A restart's (old process's last scrape, first found-down scrape) that may have ended its run-on, not cut there
    # for lack of proof that was a death, not a router's 503 (`Ledger._death_proven`): its row says both readings.
    run_on_unsure: tuple[int, int] | None = None
    # That scrape found nothing listening, and the page after it was past a new process's reach: the same process back,
    # or a restarted one whose counter persisted (`Ledger._death_unsure`), not a router's 503.
    run_on_reach: bool = False
    # Not a generation API the proxy counts, yet GPU work (streams.uncounted_kind: embeddings, audio, other…).
    uncounted: str | None = None
    beside_uncounted: set = field(default_factory=set)  # such requests' kinds live in intervals it shared
    # Its CPU joules from intervals whose other processes' share is known, and those joules × that share (%): the
    # share of its CPU figure that other processes' CPU time stood beside (collectors/cputime.py, busy-host).
    cpu_judged_j: float = 0.0
    cpu_other_pct_j: float = 0.0
    # Its GPU joules from intervals without a counter that were mostly idle (NO_COUNTER_SHORT_FLAG).
    no_counter_short_j: float = 0.0
    counter_j: float = 0.0  # of gpu_j, from intervals measured by the energy counter (rowtext.COUNTER_SHORT_FLAG)
    # Its GPU joules from intervals whose bypass count may be low, or high too (server_count; proxy_lag and
    # server_restart: schema.BYPASS_COUNT_TWO_WAY), and their reasons (BYPASS_LOW_FLAG).
    bypass_low_j: float = 0.0
    bypass_low_why: set = field(default_factory=set)
    # Where its tokens were placed from, when not where the proxy saw its first: a stream that reached the proxy in
    # one burst, spread back over its run (`_spread_burst`); its prompt is placed before this instead.
    placed_from_ns: int | None = None
    burst_s: float | None = None  # that burst came this long after its arrival
    # A stream that came in several bursts (`_held_burst`): how many after its first, the longest time one was held, and
    # where its first burst ended (its tokens are placed from its decode's start to there at its end).
    bursts: int = 0
    held_s: float = 0.0
    own_late_s: float = 0.0  # the most the proxy's own loop was measured late while it ran, where it explains its bursts
    first_burst_end_ns: int | None = None
    prev_ns: int | None = None  # its latest piece's stamp
    # Prefix-cache hits the server counted over its hit span that no answer said, where its own said no cached count
    # (CACHE_UNSAID_FLAG; set as its row is made).
    cache_unsaid: float = 0.0
    # Its GPU joules from intervals with prefill over which the server reused cached prompt tokens no answer said, and
    # the most such tokens of one of them (CACHE_UNSAID_FLAG: its share beside a reused prompt costed whole).
    cache_beside_j: float = 0.0
    cache_beside: float = 0.0
    # The cached count its prefill was first placed with (a prompt said early, before its end's count: `_cached_tokens`)
    # and, as its row is made, how many more its end said (CACHE_LATE_FLAG: placed as computed, not found cached).
    prefill_cached: float | None = None
    cache_late: float = 0.0
    # The requests whose prefill was placed, at a prompt said early with no cached count yet, in intervals it was given
    # energy of (`_cache_pending`), and its GPU joules from such intervals: their end may say part of that prompt was
    # cached (CACHE_LATE_FLAG), and then its share there is low. Each leaves `late_wait` as it settles (its end's
    # close), its late count, if any, kept in `cache_beside_late` (the most one said); at its row, whether one had still
    # not ended when that row could wait no longer (`late_unresolved`).
    late_wait: set = field(default_factory=set)
    late_wait_j: float = 0.0
    cache_beside_late: float = 0.0
    late_unresolved: bool = False
    # Tokens its end placed after its last chunk as a held call's tail (`_placed_at_end`): their count is the server's,
    # their timing inferred (HELD_TAIL_FLAG).
    held_tail_n: float = 0.0
    # (its final count, the server counter's share of it, the shortfall and requests of the stretch it ran in) where the
    # server's counter counted fewer tokens than its usage said (reconcile.CountReconciler._judge_usage): its
    # generated_tokens is the usage's, its J/token left empty; None: not found so.
    usage_above: tuple[float, float, float, int] | None = None
    # (its final count, the server counter's share of it, the surplus and the requests ended in the stretch) where the
    # server's counter counted more tokens than its usage said and its books show no bypass request
    # (reconcile.CountReconciler._judge_usage_below): its generated_tokens is the usage's, its J/token left empty.
    usage_below: tuple[float, float, float, int] | None = None
    # Its GPU joules from intervals other requests (or bypass traffic) did work in that the fixed ratio split (the work
    # model's fit not mature: `fixed_why`, why when they closed): its share there rests on that ratio, not learned costs.
    fixed_j: float = 0.0
    fixed_why: str = ""
    # What it would take of those intervals at the ends of the range the ratio stands for (attr.PREFILL_PER_DECODE_RANGE,
    # either prefill rate): the least and the most, in GPU joules. A request given little there (a prompt queued beside
    # another's decode) may be due much more: its own figure says nothing of that, this does.
    fixed_lo_j: float = 0.0
    fixed_hi_j: float = 0.0
    # How much more its GPU joules would be (negative: less) split at the fitted context cost's band's ends (context
    # cost up, down: workmodel.ctx_band, the decode cost moving the other way), summed over the closes split by the fit.
    ctx_up_j: float = 0.0
    ctx_down_j: float = 0.0
    # [t0, t1, its GPU joules there] of intervals with prefill over hits no answer had said when they closed while
    # requests whose hit may be among them were still live (`_cache_waiting`): their end may say it. Judged as its row
    # is made, once those (`cache_wait`) have ended (CACHE_UNSAID_FLAG only where the hits are still unsaid then).
    cache_unsure: list = field(default_factory=list)
    cache_wait: set = field(default_factory=set)  # the waits' numbers (`Ledger._waits`), not the requests' ids
    # The waits it is one of the live requests of, as [first, last] ranges of their numbers (`Ledger._await`): its
    # end takes it out of their counts.
    awaited: list = field(default_factory=list)
    cache_unsaid_early: float = 0.0  # its hit span's unsaid hits, judged before those windows were pruned
    prev_held: bool = False  # that piece held more tokens than its sequences
    first_held: bool = False  # its first piece held more than FIRST_BURST_TOKENS a sequence
    first_piece_n: float = 0.0  # the tokens its first piece held, and how many pieces came (`tokens_at_first`)
    pieces: int = 0
    closed_s: float = 0.0  # seconds of its run in intervals closed before its tokens came (not its energy)
    before_first_s: float = 0.0  # seconds it was live before the ledger's first GPU read: their energy is in no interval
    # Of its GPU joules, its share of the time no request was live in intervals split before any idle power was measured
    # (at their mean power: a bound on the idle energy it holds, rowtext._idle_unmeasured).
    idle_unmeasured_j: float = 0.0
    idle_unmeasured_cpu_j: float = 0.0  # and of its CPU joules, the same intervals' same fraction (a bound as well)
    idle_lock_held: bool = False  # some of them split while idle runs were held for the SM clock locks (`lock_untold`)
    # Of its GPU joules, its share of the energy of every sampled GPU but the one drawing least, in intervals split before
    # the daemon judged which of several GPUs serve the work (a bound on another GPU's idle draw it holds,
    # rowtext._gpus_undecided).
    gpus_undecided_j: float = 0.0
    # Of its GPU joules, those from busy intervals split by daemon.serving_gpus's assertion alone, the GPUs' power not
    # agreeing yet (rowtext._serving_asserted_note: SERVING_ASSERTED_FLAG).
    serving_asserted_j: float = 0.0


def told_prompt_tokens(r: LiveRequest) -> float | None:
    """The request's prompt length once the server has told it (usage or timings), else None."""
    c = r.trace.counts
    if c is not None and c.prompt_tokens is not None:
        return float(c.prompt_tokens)
    if c is not None and c.invalid:
        return None  # none of an invalid response's counts are kept, the early one included
    p = r.trace.extra.get("prompt_tokens")  # said early in the stream (continuous usage)
    return float(p) if p is not None else None


def not_forwarded(r: LiveRequest) -> bool:
    """The proxy answered it before forwarding it (proxy.NOT_FORWARDED): the server never saw it, and its row, written at
    its end, has no energy."""
    return bool(r.trace.extra.get(NOT_FORWARDED))


def is_passive(r: LiveRequest) -> bool:
    """An error answer (HTTP 4xx/5xx, the proxy's own 502 included; known from its head, before it ends), or a
    request that is neither a POST nor to a generation endpoint (GET /v1/models, /metrics, /health; known from its
    start: SGLang's /generate takes PUT too, and is one), with no token and no prompt length: no GPU work of it was
    seen, so it takes no share by live time (its time is idle). So is one whose server sent its error inside an HTTP 200
    stream before any token (SGLang answers a streamed chat's too-long prompt so), known at its end: it never ran; and
    one whose client left mid-body (`body_left`), known at its end."""
    tr = r.trace
    return ((tr.status is not None and tr.status >= 400 or (tr.method != "POST" and tr.api is None)
             or (tr.counts is not None and tr.counts.server_error is not None) or body_left(r))
            and tr.tokens_seen == 0 and not r.ev_n and r.spent == 0 and told_prompt_tokens(r) is None
            and not crashed(r))


def crashed(r: LiveRequest) -> bool:
    """The server had it whole and then closed its connection with no answer as its process died (`closed_unanswered`,
    and the ledger saw that death: `Ledger._crash_seen`): it ran it until then, though the client got the proxy's 502
    (a resend's loading page: proxy.RESEND_LOADING)."""
    return r.crash_seen and closed_unanswered(r)


def closed_unanswered(r: LiveRequest) -> bool:
    """Its connection closed with no byte of an answer after the request went out (proxy.CRASHED_NOTE): a crash, or a
    router in front of the server refusing it (never run); the close alone cannot tell which."""
    return r.trace.outcome == "upstream_error" and (r.trace.error or "").startswith(CRASHED_NOTE)


def _resend_dead(r: LiveRequest) -> bool:
    """Costed as run until its close by a crash (`run_on_crash`), a close whose resend found the server dead
    (proxy.RESEND_REFUSED, RESEND_LOADING)."""
    tr = r.trace
    return (r.run_on_crash and closed_unanswered(r) and tr.end_ns is not None
            and any(f"{CRASHED_NOTE}: {w}" in (tr.error or "") for w in (RESEND_REFUSED, RESEND_LOADING)))


def resend_queued(r: LiveRequest) -> bool:
    """`_resend_dead`, more than CROSSING_CLOSE_MAX_S after its arrival: the server may have read it and queued it
    behind full slots, never running it (then 0 J, its figure the requests' beside it), or run it as costed; nothing
    measured says which (UNSURE_FLAG, on it and on the requests beside it)."""
    return _resend_dead(r) and r.trace.end_ns - r.trace.arrival_ns > CROSSING_CLOSE_MAX_S * 1e9


def crash_unsure_costed(r: LiveRequest) -> bool:
    """Costed as run until its close with no answer by a crash no death was shown at (`crash_unsure`): a queuing
    router's refusal of a request it held reads the same, never run (then 0 J, its figure the requests' beside it);
    nothing measured says which (UNSURE_FLAG, on it and, as for `resend_queued`, on the requests beside it)."""
    return r.run_on_crash and r.crash_unsure and closed_unanswered(r)


def resend_crossed(r: LiveRequest) -> bool:
    """`_resend_dead`, within CROSSING_CLOSE_MAX_S of its arrival: a close crossing it on the wire (never begun) or one
    queued behind full slots (never run), 0 J either way, or run those milliseconds as costed; whether the slots were
    full at its arrival is not read, so its own row says UNSURE_FLAG where costed any energy (not its neighbours': their
    shares are low by that figure at most, a few tenths of a percent beside long streams; unless its resend met the
    loading page, `crash_unsure_costed`: an unsure crash marks them whatever its time)."""
    return _resend_dead(r) and r.trace.end_ns - r.trace.arrival_ns <= CROSSING_CLOSE_MAX_S * 1e9


def body_left(r: LiveRequest) -> bool:
    """It ended with its client gone mid-body (proxy.BODY_LEFT_NOTE), the body streamed on to the server in part: the
    server never had it whole, so never ran it. Passive (`is_passive`) with no token: before, it was live and shared
    intervals with no measurable work by live time (scene.py, 2 proxy workers: 12 such requests 4.9 J, truth 0)."""
    return r.trace.end_ns is not None and (r.trace.error or "").startswith(BODY_LEFT_NOTE)


# The outcomes of a request the server had and may have run for a while after the proxy saw it end: its client left, or
# its connection to the server broke. Not `ok` (a whole answer, its tokens unread: a Content-Encoding not inspected),
# nor `interrupted` (ended by the proxy's own machinery: a worker's dropped end record, a shutdown), nor `expired`.
GONE_OUTCOMES = ("client_disconnected", "upstream_error")


def server_end_ns(r: LiveRequest) -> int | None:
    """When the server stopped working on a request: its end (None: not ended), or where it runs on after its client
    left, that run's end (`Ledger._run_on`; cut where its process died, `Ledger._cut_run_on`, never before the leaving:
    the proxy saw the connection to it open then)."""
    return r.trace.end_ns if r.trace.end_ns is None or r.run_on_end_ns is None else max(r.trace.end_ns, r.run_on_end_ns)


def gone_unsaid(r: LiveRequest) -> bool:
    """It ended with no token seen and its prompt's length unsaid, after the server had it: its client left (or the
    connection broke) while its prompt was queued or prefilling, or, a whole answer (not streamed), while it ran. Not one
    whose client left mid-body (never sent whole), nor an error answer (`is_passive`). Streams of these are costed at
    their body's estimate (`Ledger._cost_gone`); the requests beside any of them say GONE_PREFILL_FLAG."""
    tr = r.trace
    return (tr.end_ns is not None and tr.first_ns is None and tr.api is not None and tr.outcome in GONE_OUTCOMES
            and told_prompt_tokens(r) is None and not is_passive(r)
            and not (tr.error or "").startswith(BODY_LEFT_NOTE))


def finished_unsaid(r: LiveRequest) -> bool:
    """The server finished it (outcome ok, no error answer) and its response, read whole, showed no token and did not say
    its prompt's length (a stream without usage whose one token came in a chunk the proxy took for none): its prefill ran
    whole all the same, and is costed at its body's estimate (`Ledger._prompt_work`); before, at 0 (the simulator's
    4000-word prompts -99%). Not one whose response went unread (counts None: a Content-Encoding not inspected)."""
    tr = r.trace
    return (tr.end_ns is not None and tr.first_ns is None and tr.api is not None and tr.outcome == "ok"
            and tr.counts is not None and told_prompt_tokens(r) is None and not is_passive(r))


def is_unseen(r: LiveRequest) -> bool:
    """GPU work the proxy does not see: an endpoint it does not count (streams.uncounted_kind), except an embeddings
    request whose answer gave its input's length (usage.prompt_tokens): that is its whole work, a prefill costed as
    any prompt is."""
    return r.uncounted is not None and not (r.uncounted == "embeddings" and told_prompt_tokens(r) is not None)
