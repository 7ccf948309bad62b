"""The daemon's live accounts: requests, sample edges, tag windows → interval, request and tag rows.

Runs in the event loop's thread only (the proxy calls it there; samples arrive through a queue).
GPU samples are the interval edges. Once an edge is older than `grace_s` (so every token event
before it has been seen), the intervals up to it are closed: their energy is split by
`attribution.attribute` with the costs `workmodel.CostLearner` has learned for the GPUs' setting,
and requests whose response ended before the edge are emitted with their energy. Intervals are
held (at most `prompt_hold_s`) while a request live in them has not yet told its prompt length,
until the server's token counter has been scraped past them, and (at most `rapl_hold_s`) until a
RAPL read covers their end (and a CPU-time read, where whose CPU time it was is judged), and from a stream's leave until
the proxy has seen past the abort of a server that runs it on (`Ledger._run_on`). Memory stays bounded: closed
intervals, emitted requests and used token events are dropped.

A request's account is `liverequest.LiveRequest`; the words its rows carry (each note, flag, reason and fix) are
`rowtext`'s: the ledger decides which apply. The server's own token count is weighed against the proxy's (bypass
tokens, each interval's `server_count`) by `reconcile.CountReconciler`: the ledger lists its token events there and
spends the resolved scrape windows over the intervals it closes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from powerprof.collectors.cputime import (BUSY_HOST_FIX, BUSY_HOST_FLAG, BUSY_HOST_PCT, busy_host_text,
                                          interval_cpu_s, unknown_server_text)
from powerprof.collectors.limitwatch import ClockLockSigns
from powerprof.collectors.rapl import cpu_energy_j
from powerprof.energy import COUNTER_STEP_S, epoch_broken, interp_at, trailing_average_interval_energy_j, unwrap_resets
from powerprof.profiler import (METHOD_AVG_POWER, METHOD_COUNTER, METHOD_NONE, METHOD_POWER, NO_COUNTER_SHORT_BUSY_SHARE,
                                NO_COUNTER_SHORT_BUSY_SHARE_INSTANT, NO_COUNTER_SHORT_FIX, NO_COUNTER_SHORT_FLAG,
                                weakest_method)
from powerprof.storage.schema import (BYPASS_LOW_FLAG, GONE_PREFILL_FLAG, SERVER_COUNT_OFF, SERVING_ASSERTED_FIX,
                                      SERVING_ASSERTED_FLAG,
                                      UNSURE_FLAG, bypass_count_low, bypass_count_may_be, outside_text)

from powerprof.arrival import COUNT_SLACK_TOKENS, SAME_DELIVERY_NS

from . import attribution as attr
from .liverequest import (PROMPT_HOLD_S, RUN_ON_MAY_END_PACE_MARGIN, RUN_ON_TO_END_MAX_S, closed_unanswered,
                          crash_unsure_costed, finished_unsaid, gone_unsaid, is_passive, told_prompt_tokens, LiveRequest,
                          is_unseen, not_forwarded, resend_queued, server_end_ns)
from .promptlen import STATEFUL_REASONS, PromptLengths
from .proxy import BODY_LEFT_NOTE, CRASHED_NOTE, RESEND_LOADING, RESEND_REFUSED, RequestTrace, bounded_text, valid_text
from .reconcile import LAG_S, LAG_SHARE, LAG_TOKENS, SCRAPE_HOLD_S, CountReconciler
from .scrape import RUNS_ON_AFTER_LEAVE
from .rowtext import (CACHE_UNSAID_MIN, COUNT_FIX, COUNTED_FLAGS, CPU_MISSING_NOTE, GONE_ABORT_SLACK_S, GPU_MISSING_NOTE,
                      HELD_WHOLE_FIX, NO_COUNTER_READ, QUEUED_BESIDE_MIN_SHARE, UNPLACED_FIX, prompt_unread,
                      NO_RAPL_NOTE, UNSAID_FIX, UNSAID_NOTES, _approximate_note, _before_first_note, _burst_fix,
                      _busy_host_note, _bypass_low_note, _count_low_note, _counter_flat_note, _cpu_missing_note,
                      _gpu_missing_note, _idle_gpu_missing_note, _idle_unknown_note, _idle_unmeasured_interval_note,
                      _idle_unmeasured_note, _gpus_undecided_interval_note, _gpus_undecided_note,
                      _serving_asserted_interval_note, _serving_asserted_words, UNDECIDED_CAUSE,
                      UNDECIDED_ASSERTED_DISAGREE, UNDECIDED_ASSERTED_DOUBTED, UNDECIDED_DISAGREE, UNDECIDED_FIX,
                      UNDECIDED_PROVISIONAL,
                      _interval_cache_note, _joined,
                      _no_counter_short_note, _counter_short_note, _no_energy_reason, _parser_held, _request_flags,
                      _secs, _unsaid_reason, _usage_above_note, _usage_below_note, _with_late, _counted_low_interval_note, client_held,
                      counted_low, tag_server_count, tokens_unknown)
from . import tagedge
from .streams import uncounted_kind
from .tagedge import TAG_UNHELD_FIX, TAG_UNHELD_FLAG
from .workmodel import FEATURES, GPUS_UNDECIDED_REASON, LOCK_WAIT_S, CostLearner, setting_of

log = logging.getLogger("powerprof.daemon.ledger")

# A request that arrived this little before the daemon's first GPU read counts as arriving at it (`_before_first_note`):
# where the start's read failed, the first edge may be the on-demand read its own arrival started (service's
# `_request_edge`, dated at its counter calls' middles: a few µs later on the simulator), and in that time the proxy is
# still passing it on, so the server has hardly begun on it: at most this long of its run is in no interval (0.2% of a
# 0.5 s request). Flagged for it, it was said low and left out of J/token for nothing. A read spanning longer (one
# H200 counter call ~3 ms, docs/hardware.md) still flags it: said, never silently low.
FIRST_READ_SLACK_NS = SAME_DELIVERY_NS
# How long an interval waits past its grace for a RAPL read at or past its end (the daemon passes a few sampling
# periods): RAPL's thread may tick just before NVML's, and the covering read is then a period later.
RAPL_HOLD_S = 2.0
# s: while busy intervals are split before which of several GPUs serve is known, the log says so again this often (the
# first at once): once would scroll away under a load too even ever to judge.
UNDECIDED_SAY_S = 600.0

# A request that never ends (a stuck stream) is dropped from the accounts after this long.
MAX_OPEN_S = 6 * 3600
MAX_OPEN_TAGS = 256
# Responses answers whose conversation length is kept for a later turn naming them (Ledger.response_context): ~100 bytes
# each; a chat client continues its latest turns.
RESPONSE_CONTEXT_KEEP = 4096
# A non-streamed response's tokens (and a held-back stream's burst) are spread over its decode as events at most
# SPREAD_PITCH_S apart, at least SPREAD_EVENTS of them and at most SPREAD_EVENTS_MAX (`spread_events`): each interval
# and scrape window it spans then gets its rate times their overlap within one event. As 64 events alone, a 100 s answer
# had one every 1.6 s: of the 0.5 s intervals it spanned one in three got a lump, the others none, and the work model
# split each one's energy by that lumpy work (its row -23%, the stream beside it +52%, unflagged; docs/daemon.md).
# 50 ms: 5 to a default scrape window (0.25 s), every row within 0.6% there, as at 20 ms; at 20 ms, 1000 answers of
# 110 s ending at once peaked at 1.2 GB and their closes took 3.5 s of CPU on the daemon's loop (now 0.55 GB, 1.6 s).
SPREAD_EVENTS = 64
SPREAD_PITCH_S = 0.05
SPREAD_EVENTS_MAX = 2400  # 120 s (the default hold on a whole answer, max_hold_s) at the pitch; longer: farther apart
BYPASS_FIT_SHARE = 0.25  # intervals whose bypass tokens exceed this share of the proxied ones stay out of the fit
# A stream's piece holding more tokens than its sequences, this long or more after its previous piece, is a burst held
# back since then (a buffering hop that flushes when its buffer fills or on a timer: `_held_burst`) ...
HELD_GAP_NS = 100_000_000
# ... unless its tokens came faster than this many times the stream's pace since its first token: then they were
# generated long before, and this piece is the rest of one held body, refilled late (a loaded host), not a later flush.
HELD_PACE_X = 4.0
# A stream's first piece holding more than this many tokens a sequence came held back (no step gives a sequence that
# many): its windows wait from its arrival until its end (the prompt hold at most), where that burst is placed.
FIRST_BURST_TOKENS = 8
# A stream's piece of several steps is placed as at most this many events over the time since its previous piece.
PIECE_STEPS = 8
# A stream counted one token a chunk whose usage says this many times as many or more holds several tokens a chunk
# (speculative decoding, a server's stream interval), each chunk's placed over the time since the one before
# (`_chunks_to_server_count`); below, a few tokens beyond the chunks (a closing token the stream showed none of), each
# chunk's share at its stamp as before.
CHUNK_TOKENS_SEVERAL = 1.5
# Prefix-cache hits the server counted beyond what its answers said (CACHE_UNSAID_FLAG): kept this long to meet the
# requests that end after them (a request or an interval is flagged from rowtext.CACHE_UNSAID_MIN of them on).
CACHE_KEEP_S = 300.0
# A request the server runs on after its client left (scrape.RUNS_ON_AFTER_LEAVE) decodes on at its batch's pace over
# that run, read from the streams shown beside it then (`_batch_pace`: at least RUN_ON_PACE_TOKENS of their tokens), or
# with none, at its stream's own pace, or at the median pace of this many recent streams of at least RUN_ON_PACE_TOKENS
# tokens (fewer give too few gaps for a pace).
RUN_ON_PACES = 32
# How long after the first scrape that found the server down (or the new process's first) a close with no answer may
# still be that death's (`Ledger._crash_seen`): the proxy's close and the scrape are seen apart, about a scrape late.
CRASH_CLOSE_SLACK_S = 1.0
# How long a close with no answer's row waits, at most, for a page to confirm the restart that a llama-server's 503
# "Loading model" alone suggests (`Ledger._down_hold`), from the later of its close and the first found-down scrape: a
# model's load, a minute or two at most; past it, costed as the crash it most likely was, flagged, saying both readings.
DOWN_HOLD_MAX_S = 120.0
# The starts of an upstream_error's `error` where the server answered (a 5xx, an error inside its answer): no broken
# connection, so no sign of a death (`Ledger._death_proven`).
ANSWERED_ERROR_NOTES = ("the upstream answered HTTP", "the upstream reported an error")
RUN_ON_PACE_TOKENS = 8
# A sure run-on (its answer cannot end by itself) is listed as SGLang's length finish only where its max_tokens end it
# at no more than this share of what its pace runs to the abort: its pace may read high (within 4% on the simulator,
# `_place_run_ons`), and one aborted instead is counted nowhere, its listing then hiding bypass traffic.
RUN_ON_CAPPED_SURE_SHARE = 0.8
# How long the server's token count must stand still before a llama.cpp whole answer run on with no end known is taken
# as ended (`Ledger._counted_spans`): a run-on decodes every step, and llama-server's own quiet for a connection is 1 s.
COUNT_STILL_S = 1.0
# The most tokens a batch SGLang's scheduler aborts one prompt of may ask: that abort takes a prompt in the context's last
# 6 tokens, and its tokenizer manager refuses a batch whole, unrun, where any prompt + max_new_tokens passes the context
# (docs/simulator.md). A larger known limit leaves no batch running for nobody behind its 400 (`_batch_run_on`).
SGLANG_BAND_TOKENS = 6
# The start of that abort's message (managers/utils.py `validate_input_length`): a streamed /v1/completions batch is
# answered 200, the message in its one error event (`_batch_run_on`). Matched at the start, whole: its words anywhere
# matched SGLang's validation 400, whose message echoes the client's input (a "temperature" of those words, unrun).
SGLANG_BAND_ABORT_RE = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")
# The server's aggregate decode rate (tokens a second, all its sequences together) taken where no stream has shown its
# pace yet (`_batch_end_ns`): each sequence then decodes at this shared by the sequences live.
BATCH_PACE_FLOOR_TOK_S = 5.0
# The rate a batch's prompts are taken to prefill at (tokens a second) where no stream has shown the server's yet:
# SGLang prefills every prompt of the batch before it decodes them (the simulated H200 prefilled 24 prompts of 1,500
# tokens in 2.25 s, 16,000 tokens/s); a GPU serving an LLM prefills slower than this rarely.
BATCH_PREFILL_FLOOR_TOK_S = 500.0
# The fewest uncached prompt tokens a stream's time to first token teaches that rate from: a shorter prompt's time is
# mostly the server's step and queueing, not its prefill.
BATCH_PREFILL_LEARN_MIN = 64
# How much a prefill's cost a token grows by, a share of its cost at no context, for each token of context it attends
# over (`_batch_end_ns`): a rate learned on a stream of L0 tokens is taken at L0's context for a batch whose prompts may
# be L long, as rate * (1 + k L0) / (1 + k L), never raised. Attention's FLOPs a token over its weights' are about
# (attention width * layers) / parameters a context token for a causal prompt (its mean context L / 2, two matmuls):
# 1.9e-5 for Llama-3-8B, 3.3e-5 for Llama-3.2-1B, 1.3e-4 for Qwen3-0.6B, 1.6e-4 for SmolLM2-135M (parameters without
# the embeddings), and attention runs below the weights' matmul efficiency: at half of it, up to 3.3e-4 a token. An
# estimate that errs long down to such models, not a proof (a smaller one, or attention slower still, runs past it).
# Without it a rate learned on short prompts was used whole for a batch of 30,000-token ones; at 1.5e-4, 16 such prompts
# were marked 143.5 s where Qwen3-0.6B's prefill at half efficiency runs 186.9 s.
BATCH_PREFILL_CTX_SHARE = 4e-4
# The longest a batch's span marks (`_batch_end_ns`): a span runs to bounds that err long (a null's context, floor
# rates), and one band abort must not blank J/token for hours; its row says where its span was cut so.
BATCH_SPAN_MAX_S = 600.0
# How much later than the proxy's arrival stamp a server's end-to-end latency may start (its own receipt, its clock):
# a finished request's latency under its age less this is no end of that batch (`batch_count_may_end`).
BATCH_HOLD_SLACK_S = 1.0
# Intervals a request keeps to judge once the requests whose end may say their hits have ended (`LiveRequest.cache_unsure`);
# beyond, judged at their close as before (a stream live for hours over 1 s intervals).
CACHE_UNSURE_MAX = 256
# An API whose latest this many ended answers (prompts over one token) all said no cached count while the server
# counted hits says none (`_never_says_cached`): its live requests' ends cannot say theirs, so nothing waits for them.
SAYS_CACHED_RECENT = 8
# A burst's other cause: the proxy's own event loop, measured late while the stream ran (a busy host), read the
# server's pieces late and together. Said where the loop ran at least this share of the burst's hold late
# (`_own_late_s`): a buffering hop's fix alone sent the user of a direct server looking for a hop that was not there.
OWN_LATE_SHARE = 0.5


@dataclass
class _Edge:
    t_ns: int
    wall_ns: int
    counter_j: np.ndarray  # (G,) NaN where missing
    power_w: np.ndarray  # (G,) instant power (or a reading with no averaging window); NaN where missing
    setting: tuple = ()  # the GPUs' power limits (and clock locks: workmodel.setting_of): costs are learned per setting
    epoch: np.ndarray | None = None  # (G,) the counters' epochs (a jump or reset bumps one); None: as the edge before
    avg_power_w: np.ndarray | None = None  # (G,) trailing-average power (GPUs with an averaging window); None: not read


def _edge_instant(t_ns: int, wall_ns: int, read_ns: np.ndarray, read_j: np.ndarray, weight_w: np.ndarray) -> tuple[int, int]:
    """The instant a read of every GPU's counter stands for: the mean of the counters' own read instants, weighted by
    each GPU's power (equal weights where any is unknown). The GPUs are read one after another (~3 ms a counter call
    on an H200, 15 ms one call in 50: eight span ~24 ms), so no instant is every counter's; at this one the GPUs'
    summed counters are their true sum wherever each GPU's power is steady across the read (Σ P_g (τ_g - t) = 0).
    Dated at the read's middle, a slow call moved the sum by the later GPUs' offset times their power. Not the
    earliest instant with each counter interpolated back from its previous read (as `Profiler.mark` does): that
    spreads the previous interval's average power over the offset, worse wherever the load changed since
    (bench/daemon_edge_instants.py: p95 12% against 3.3% per short interval)."""
    ok = ~np.isnan(read_j)
    if not ok.any():
        return t_ns, wall_ns
    w = weight_w[ok] if weight_w is not None and weight_w.shape == read_j.shape else None
    if w is None or np.isnan(w).any() or (w <= 0).any():
        w = np.ones(int(ok.sum()))
    off = read_ns[ok] - read_ns[ok].min()  # in ns from the first: exact in float
    t = int(read_ns[ok].min()) + int(round(float(np.dot(w, off) / w.sum())))
    return t, wall_ns - (t_ns - t)


def _sample_reads(t_ns: int, readings) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G,) each GPU's counter (J), the instant it was read (ns; the sample's where unsaid) and its power (W)."""
    counter = np.array([np.nan if r.energy_j is None else r.energy_j for r in readings], dtype=float)
    read_ns = np.array([t_ns if getattr(r, "energy_t_mono_ns", None) is None else r.energy_t_mono_ns
                        for r in readings], dtype=np.int64)
    power = np.array([np.nan if (r.power_w if r.power_w is not None else r.power_avg_w) is None
                      else (r.power_w if r.power_w is not None else r.power_avg_w) for r in readings], dtype=float)
    return counter, read_ns, power


@dataclass
class _Tag:
    name: str
    t0_ns: int
    wall0_ns: int
    t1_ns: int | None = None
    wall1_ns: int | None = None
    gpu_j: float = 0.0
    unproxied_j: float = 0.0  # of gpu_j, its intervals' unproxied energy (bypass traffic's: tag_row's J/token)
    cpu_j: float | None = None
    cpu_missing: bool = False  # an interval inside had no CPU energy: the sum would be too small
    gpu_missing: bool = False  # the same for a GPU's energy
    work_j: float = 0.0  # of gpu_j, the serving GPUs' (workmodel.CostLearner.serving): its J/token's energy
    work_missing: bool = False  # an interval inside had no energy from a serving GPU: its J/token is unknown
    excluded: set = field(default_factory=set)  # sampled GPUs (by position) judged to serve none of the proxied work
    excluded_j: float = 0.0  # their energy inside it, in gpu_j and not in its J/token
    # Of work_j, its intervals' closed while a whole answer was in flight past its hold, no counter read (`_close`'s
    # held_iv, `LiveRequest.held_whole_beside_j`): that answer's tokens there came late, in none of its tokens
    # (`_tag_note`).
    held_whole_j: float = 0.0
    unread: set = field(default_factory=set)  # sampled GPUs (by position) that gave no energy over part of it
    all_gpus_intervals: int = 0  # intervals inside it split with every sampled GPU's energy (none judged idle there)
    # Of its busy intervals, those split by daemon.serving_gpus alone, unconfirmed by the power (SERVING_ASSERTED_FLAG),
    # and whether the assertion is what left its `excluded` GPUs out (not their power): its note says so.
    asserted_intervals: int = 0
    excluded_asserted: bool = False
    tokens: float = 0.0
    methods: set = field(default_factory=set)
    counted_low: int = 0  # requests inside it counted one token a chunk that the server counted more (_request_fields)
    # Requests inside it whose client left before their response ended, and of those, ended before their first token
    # with their prompt's length unsaid (Ledger.on_end): the server's work for them after they left is unseen.
    cut: int = 0
    gone_first: int = 0
    # Of those, whole answers cut under scrape.server = none (`Ledger._unplaced`): their run-on unplaced, maybe in no
    # figure's unproxied_energy_j (the tag's cut note said nothing of them before).
    cut_unplaced: int = 0
    closed_by: str = "stop"
    host_cpu_s: float = 0.0  # the host's busy CPU time over its intervals whose share is known
    server_counts: set = field(default_factory=set)  # its intervals' server_count values (tag_server_count)
    other_cpu_s: float = 0.0  # of it, other processes' (neither the server's nor powerprof's)
    work: bool = False  # an interval inside had work (prefill or decode): its other_cpu_pct is then worth judging
    intervals: int = 0  # intervals inside it: none (its edges' on-demand reads failed, shorter than half of one) is no
    # measured zero: its energy is unknown
    # Its edges held until the GPUs' counters refreshed past them (daemon/tagedge.py): False where a counter did not
    # move in time (its edges then read up to a refresh stale), None where not said (edges given by hand).
    held: bool | None = None
    stop_trim_j: tuple = ()  # per GPU: the energy drawn between its stop call and its held stop edge, not its own
    start_trim_j: tuple = ()  # per GPU: what its held start edge's counter values hold of before the edge
    held_s: float = 0.0  # how long its stop edge was held after the stop call
    # Per GPU, J: how far its held edges' energy may be off where their refreshes were dated between reads a loaded
    # host spaced out (tagedge.start_misdated_j, stop_misdated_j), and the largest such date error (ms).
    misdated_j: tuple = ()
    off_ms: float = 0.0


@dataclass
class Totals:
    """Running totals for the metrics endpoint (read by another thread: replaced, not mutated)."""

    gpu_energy_j: tuple = ()  # per GPU: the energy of the intervals it gave a reading over, since start
    gpu_unknown_s: tuple = ()  # per GPU: seconds of intervals it gave no energy reading over (not in gpu_energy_j)
    gpu_unread_now: tuple = ()  # per GPU: True when the latest closed interval is such (its gpu_energy_j stalls)
    intervals: int = 0  # intervals closed since start: what the *_unknown_intervals below are counted out of
    cpu_energy_j: float | None = None
    energy_by_kind_j: tuple = (0.0, 0.0, 0.0, 0.0)
    tokens: float = 0.0
    j_per_token: float | None = None
    energy_by_dest_j: tuple = (0.0, 0.0, 0.0)  # requests, idle, unproxied
    tokens_attributed: float = 0.0
    costs: dict = field(default_factory=dict)  # the costs in use and the latest fit's quality
    other_cpu_pct: float | None = None  # other processes' share of the host's busy CPU time, latest judged busy interval
    busy_host_requests_cpu_j: float = 0.0  # CPU energy given to requests in intervals where it was above BUSY_HOST_PCT
    cpu_unknown_requests: int = 0  # request rows without cpu_energy_j though RAPL is read (CPU_MISSING_NOTE) since start
    flagged_requests: dict = field(default_factory=dict)  # {flag: request rows saying it since start} (COUNTED_FLAGS)
    # Intervals with tokens left out of j_per_token since start, and their tokens: {flag: (intervals, tokens)}
    # (NO_COUNTER_SHORT_FLAG, BYPASS_LOW_FLAG).
    jpt_left_out: dict = field(default_factory=dict)
    # Intervals since start where a GPU serving none of the work gave no reading: in energy_by_dest_j and
    # energy_by_kind_j with every read GPU's energy, the unread GPU's alone out (their rows' idle_energy_j empty).
    idle_unknown_intervals: int = 0
    # Intervals in no kind of energy_by_kind_j since start: a GPU serving the work (or, before which serve is judged,
    # any GPU) gave no reading there, their total unknown.
    gpu_unknown_intervals: int = 0
    # Of energy_by_dest_j's idle, the energy of the GPUs serving none of the work since start (the read ones'): what
    # the others' figures are without it does not hang on whether such a GPU reads (the tuner's energy).
    idle_not_serving_j: float = 0.0
    # Times since start the GPUs whose energy is the work's (and not idle_not_serving_j) changed: the first judgement
    # of which serve (until then every GPU's is), and each later one that differs. Each moves a GPU's idle energy into
    # or out of the serving GPUs' figure, whose windows on the two sides are then on different bases (the tuner's).
    serving_changes: int = 0
    # Per sampled GPU (by position), whether its energy is the work's in the latest intervals accounted: None while
    # every GPU's is (which serve not judged yet, or all of them serve). Named on /metrics, so a change is told by GPU.
    serving_mask: tuple | None = None
    # The latest intervals accounted were split before the daemon knew which of several sampled GPUs serve (every GPU's
    # energy the work's): serving_mask's None then says nothing of which serve (/metrics leaves powerprof_gpu_serving out).
    serving_undecided: bool = False
    # The latest intervals accounted were split by daemon.serving_gpus's assertion alone, the GPUs' power not agreeing
    # yet (their rows say SERVING_ASSERTED_FLAG): /metrics says serving_mask is the operator's word, unconfirmed.
    serving_asserted: bool = False



def _tools_none_words(tools_chars: int, rendered: bool | None, other: float | None = None,
                      tally: tuple[int, int] = (0, 0)) -> str:
    """What an estimate's basis says of tools sent with tool_choice "none" (Ledger._body_estimate); `other`: the
    estimate under the other reading (without them where counted, with them where left out), said whatever the verdict:
    a verdict comes from a tally of single prompts' judgments, which prompts of unusual density can tip (session 59's
    review: +362% and -87% on verdicts of 3 to 0). Undecided, the words say both readings but carry no UNSURE_FLAG: the
    row stays in J/token, since its split error is mirrored in the rows sharing its intervals and cancels in the host's
    sum (leaving it out alone biased the host's figure: 2.1-3.7 points on the simulator's SGLang)."""
    if not tools_chars:
        return ""
    yes, no = tally
    alt = "?" if other is None else round(other)
    fix = "fix: send no `tools` with tool_choice \"none\""
    if rendered is None:
        return (f"; its `tools` ({tools_chars} characters) sent with tool_choice \"none\" counted, though "
                f"this server may or may not render them (SGLang does not, nor vLLM with "
                f"--exclude-tools-when-tool-choice-none) and its "
                f"counted prompts have not shown which (judged only against prompts without such tools, where clear): "
                f"{alt} without them; {fix}")
    if rendered:
        return (f"; its `tools` ({tools_chars} characters) sent with tool_choice \"none\" counted: this server rendered "
                f"them in {yes} of {yes + no} clear judgments of its counted prompts; {alt} without them; {fix}")
    return (f"; its `tools` ({tools_chars} characters) left out: this server rendered none for tool_choice \"none\" in "
            f"{no} of {yes + no} clear judgments of its counted prompts; {alt} with them; {fix}")



def batch_context_bound(extra: dict) -> int | None:
    """The most tokens an explicit-null batch SGLang answered 400 may run a prompt to: its context's end, and the context
    is at most the aborted prompt's length + SGLANG_BAND_TOKENS (that abort takes a prompt in its last 6 tokens), so at
    most its prompts' size summed: their token ids, a token a character of their text (and a BOS each), + 6. None:
    their size unread."""
    chars, ids = extra.get("prompt_chars"), extra.get("prompt_ids")
    if chars is None and ids is None:
        return None
    return int(chars or 0) + int(ids or 0) + int(extra.get("prompt_count", 1)) + SGLANG_BAND_TOKENS


def batch_context(extra: dict, message: str | None) -> int | None:
    """The most tokens a prompt of a batch SGLang answered 400 may have and an explicit null may run it to: the context,
    its abort's `message` saying it less SGLANG_BAND_TOKENS ("the maximum allowed length (C - 6 tokens)",
    managers/utils.py `validate_input_length`), at most `batch_context_bound`. Before, that sum alone: a token a
    character, a null batch of a 16,000-character band prompt and two of 400 in a 4,096 context was bounded 16,809
    tokens, marked to its cap (600 s), its rows past that unflagged; now 4,096, 341 s."""
    size = batch_context_bound(extra)
    m = SGLANG_BAND_ABORT_RE.match(message or "")
    return size if size is None or m is None else min(size, int(m.group(2)) + SGLANG_BAND_TOKENS)


def batches_added(batches: list[tuple[int, int]], a0: int, a1: int) -> list[tuple[int, int]]:
    """The (arrival, end) of the batches a merged span holds (`merged_span`) with one arrived at `a0`, ending at `a1`,
    added, those it arrived no sooner than and ends no sooner than dropped: a restart's cut never ends it sooner than
    them (`cut_batches`). Kept, each batch keeps its own end at a cut: one end for the span, a batch sent to the new
    process inside a restart's window lost its run to an older batch's cut (42.1 s to 12.0 s, its rows unflagged)."""
    return [b for b in batches if not (b[0] <= a0 and b[1] <= a1)] + [(a0, a1)]


def batch_count_may_end(a0_ns: np.ndarray, prefill_end_ns: np.ndarray, pace_tok_s: np.ndarray, t0_ns: np.ndarray,
                        t1_ns: np.ndarray, tokens: np.ndarray, latency_s: np.ndarray) -> np.ndarray:
    """Whether each batch 400 (its other prompts arrived at `a0_ns`, prefilled by `prefill_end_ns` at the latest,
    decoding at `pace_tok_s` a sequence) may have ended in one of the resolved windows (start `t0_ns`, end `t1_ns`)
    whose bypass `tokens` are over LAG_TOKENS (`Ledger._hold_uncounted_batches`): SGLang counts a request's tokens at its
    end. Where the window's finished requests' summed end-to-end seconds are told (`latency_s`, NaN where not), they
    must reach the batch's age at the window's start less BATCH_HOLD_SLACK_S: no request of the batch could have
    finished in it otherwise (a 3-token bypass request's 0.1 s at 22 s is no end of a batch that arrived at 0.2 s).
    Where not told, its tokens must reach what one sequence decodes from that prefill's end to the window's start at
    that pace (the batch's span's own estimate: a pace joined by more sequences later falls below it; a hold kept too
    long over-flags, never hides). The told windows by their ends' order, the latest arrival each lets go as a running
    minimum from the last: (batches + windows) log windows (a matrix of both cost 234 ms at 5,000 by 600); the untold,
    the histogram not read, a matrix."""
    a0_ns = np.asarray(a0_ns, dtype=np.int64)
    told = ~np.isnan(latency_s)
    order = np.argsort(t1_ns[told], kind="stable")
    t1_told = t1_ns[told][order]
    # A told window lets go every batch arrived by its start less its latency and the slack, and before its end.
    reach = (t0_ns[told] - (latency_s[told] + BATCH_HOLD_SLACK_S) * 1e9)[order]
    least = np.minimum.accumulate(reach[::-1])[::-1] if reach.size else reach
    at = np.searchsorted(t1_told, a0_ns, side="right")
    done = np.zeros(a0_ns.shape, dtype=bool)
    ok = at < t1_told.size
    done[ok] = least[at[ok]] <= a0_ns[ok]
    if (~told).any():
        a0, pre, pace = a0_ns[:, None], np.asarray(prefill_end_ns)[:, None], np.asarray(pace_tok_s)[:, None]
        t0u, t1u = t0_ns[~told], t1_ns[~told]
        by_tokens = tokens[~told] >= np.maximum(0.0, (t0u - pre) / 1e9) * pace
        done |= ((t1u > a0) & by_tokens).any(axis=1)
    return done


def listed_latency_s(end_ns: np.ndarray, latency_s: np.ndarray, t0_ns: np.ndarray, t1_ns: np.ndarray) -> np.ndarray:
    """The summed `latency_s` of the proxied requests ended at `end_ns` (sorted) in each window (`t0_ns`, `t1_ns`]."""
    cum = np.concatenate([[0.0], np.cumsum(latency_s)])
    return cum[np.searchsorted(end_ns, t1_ns, side="right")] - cum[np.searchsorted(end_ns, t0_ns, side="right")]


def cut_batches(batches: list[tuple[int, int]], deaths: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each batch (arrival, end) ended at the first of `deaths` (a restart window's (start, end): the old process's last
    scrape, the new one's first) that began at or after its arrival: its process died there. One that arrived later
    went to the new process, its end its own."""
    return [(a0, min([a1, *(e for d, e in deaths if d >= a0)])) for a0, a1 in batches]


def spread_events(start_ns: int, t1_ns: int) -> int:
    """How many events tokens spread evenly (or at the server's pace) over `start_ns`..`t1_ns` are placed as: one per
    SPREAD_PITCH_S of it, SPREAD_EVENTS at least, SPREAD_EVENTS_MAX at most (a 10-minute span's: 0.25 s apart)."""
    k = math.ceil(max(t1_ns - start_ns, 0) / (SPREAD_PITCH_S * 1e9))
    return int(min(max(k, SPREAD_EVENTS), SPREAD_EVENTS_MAX))


def merged_span(spans: list[tuple[int, int]], a0: int, a1: int) -> list[tuple[int, int]]:
    """`spans` (disjoint) with [a0, a1] added, those it overlaps merged into one: many such marks cost one span each
    only where apart."""
    keep = [s for s in spans if s[1] < a0 or s[0] > a1]
    over = [s for s in spans if not (s[1] < a0 or s[0] > a1)]
    return sorted(keep + [(min([a0, *(s[0] for s in over)]), max([a1, *(s[1] for s in over)]))])

# The told mask's source where the operator asserts which sampled GPUs serve (config daemon.serving_gpus): the log's and
# the undecided causes' words name the key.
SERVING_ASSERTED_SOURCE = "daemon.serving_gpus"


class Ledger:
    def __init__(
        self,
        daemon_id: str,
        t0_ns: int,
        n_gpus: int,
        emit: Callable[[str, list[dict]], None],
        grace_s: float = 0.3,
        jpt_window_s: float = 60.0,
        max_hold_s: float = 120.0,
        prompt_hold_s: float = PROMPT_HOLD_S,
        learner: CostLearner | None = None,
        avg_windows_s: tuple[float, ...] | None = None,
        rapl: bool = False,
        rapl_hold_s: float = RAPL_HOLD_S,
        gpu_names: list[str] | None = None,
    ):
        """gpu_names: how the log names each sampled GPU, in order ('gpu5 (GPU-…)': NVML index and UUID; default its
        position). avg_windows_s: per GPU, the window nvmlDeviceGetPowerUsage averages over (collectors.nvml.GpuInfo's
        power_avg_window_s; 0: the reading is instant power). Where a GPU's counter gives no energy, its
        trailing average is integrated shifted back by half that window, as the profiler does.
        rapl: the host's CPU energy is read (also learnt from the first RAPL sample): an interval is then held until
        a RAPL read at or past its end (at most rapl_hold_s), and a request left without CPU energy says why."""
        self.daemon_id = daemon_id
        self.t0_ns = t0_ns
        self.n_gpus = n_gpus
        self.gpu_names = list(gpu_names) if gpu_names is not None else [f"gpu{g}" for g in range(n_gpus)]
        # Set by the daemon while the server also runs on a GPU it does not sample (SERVER_GPU_UNSAMPLED_FLAG, with
        # which and the fix): every interval and request row closed meanwhile says it in its energy_note.
        self.unsampled_note: str | None = None
        # Which sampled GPUs serve, as the daemon was told (`tell_serving`; None: a telling withdrawn), and whence,
        # waiting for the next close: set from the placement check's thread, taken up on the ledger's, each under the
        # lock (before, a tell landing between the close's read and its reset was lost).
        self._told_serving: tuple[np.ndarray | None, str] | None = None
        self._told_lock = threading.Lock()
        self._disagree_said: tuple | None = None  # the (told, judged) masks the last disagreement warning named
        self._serving_source = "told"  # the latest told mask's source, in words (the log names it)
        self._serving_said: np.ndarray | None = None  # the serving mask the log last named (None: none named)
        self._undecided_said_ns: int | None = None  # when the log last said which GPUs serve is not known (t's clock)
        self._undecided_intervals = 0  # busy intervals split so since start
        self._asserted_intervals = 0  # busy intervals split by daemon.serving_gpus alone since start (SERVING_ASSERTED_FLAG)
        self._split_asserted = False  # the latest close split by it alone (Totals.serving_asserted)
        # The mask the last run's power judged, as the daemon read it back at start (servingstate.load: (mask, saved
        # wall s)), or None: provisional, never taken (nothing shows the server still on those GPUs), only said against
        # this run's first judgement taken (`_say_judged`); and the daemon's keeping of each judgement taken.
        self.saved_serving: tuple[list[bool], float] | None = None
        self.on_judged: Callable[[list[bool]], None] | None = None
        self._judged_kept: tuple | None = None  # the judged mask last handed to on_judged
        self.emit = emit
        self.grace_ns = int(grace_s * 1e9)
        self.max_hold_ns = int(max_hold_s * 1e9)
        self.prompt_hold_ns = int(prompt_hold_s * 1e9)
        self.learner = learner or CostLearner()
        self.avg_windows_s = tuple(avg_windows_s) if avg_windows_s is not None else (0.0,) * n_gpus
        # Per GPU: the latest full sample's time and whether its counter was missing (the average is then needed,
        # and an interval can close only once the shifted readings reach past its end).
        self._avg_last_ns = np.full(n_gpus, -1, dtype=np.int64)
        self._avg_needed = np.zeros(n_gpus, dtype=bool)
        self.jpt_window_ns = int(jpt_window_s * 1e9)
        self.edges: list[_Edge] = []
        self.first_edge_ns: int | None = None  # the first GPU read's instant: no energy before it is known
        self.requests: dict[int, LiveRequest] = {}
        self.tags: dict[str, _Tag] = {}
        self.closed_tags: list[_Tag] = []
        self.cpu_t: deque = deque(maxlen=4096)
        self.cpu_e: deque = deque(maxlen=4096)
        self.cpu_epoch: deque = deque(maxlen=4096)
        self.rapl = rapl
        self.rapl_hold_ns = int(rapl_hold_s * 1e9)
        self.cpu_unknown_requests = 0  # request rows emitted without cpu_energy_j though RAPL is read (CPU_MISSING_NOTE)
        # Cumulative CPU seconds (collectors/cputime.py): the host's busy time and other processes' part of it.
        self.ct_t: deque = deque(maxlen=4096)
        self.ct_host: deque = deque(maxlen=4096)
        self.ct_other: deque = deque(maxlen=4096)
        self._server_unknown_said = False
        self._busy_spell = False  # inside a run of busy-host intervals (logged once when it starts)
        self._other_pct: float | None = None
        self._busy_cpu_j = 0.0
        # The server's prefix-cache hits against what its answers said (`add_cache_hits`, CACHE_UNSAID_FLAG):
        # [t0, t1, hits, known] of each scrape window in which it hit, `known` the cached tokens of the requests that
        # met it (said in their answers, or a shared prompt's other choices), each such token in one window only;
        # [h0, h1, tokens] of each ended request known to have hit, over the span the server counts its hit in
        # (`_hit_span`), less what pruned windows took. `known` is matched afresh when either changes (`_cache_match`).
        self._cache_spans: deque = deque()
        self._cache_known: deque = deque()
        self._cache_dirty = False
        self._cache_frozen = 0  # the leading windows whose `known` is final (`_cache_freeze`)
        self.flagged_requests = dict.fromkeys(COUNTED_FLAGS, 0)  # request rows emitted with each of COUNTED_FLAGS
        # {request id: the requests beside its prefill (`LiveRequest.late_wait`)} of those whose end may still say a count
        # late: told as it settles (`_settle_late`). Before, the late counts were kept in a table of the latest 4096,
        # read at the rows: a stream longer than that many late counts read none of the one beside its start (or a
        # smaller one's figure) and its `late_wait` kept every id it was ever beside. And the ended requests whose
        # rows wait for such a request to end (at most prompt_hold_s past their own end): [request, its end].
        self._late_waiters: dict[int, list] = {}
        self._late_parked: list[list] = []
        # Interval rows in order, [row, t0, t1, the wait on the requests whose end may say its unsaid hits (a `_waits`
        # number, 0: none), its close], each waiting (at most prompt_hold_s past its close) for those to end before its
        # CACHE_UNSAID_FLAG is judged.
        self._iv_parked: deque = deque()
        # What those rows and the rows of `LiveRequest.cache_wait` wait for, kept as counts, not ids: {wait number: [its
        # requests still live, its close]}; a wait leaves once its last request ends or prompt_hold_s past its close
        # (no row waits on it longer). One set of ids per waiting request and parked row held ~1000 x 1000 ids with
        # 1000 live streams (48.7 MB more than with no hits, tests/test_prefix_cache_ledger.py).
        self._waits: dict[int, list] = {}
        self._wait_next = 1  # the next wait's number (0 is none)
        self._wait_floor = 1  # waits below this number left at their hold
        # Per API, whether its latest ended answers said a cached count (`_never_says_cached`).
        self._says_cached: dict[str, deque] = {}
        # The server's own token count against the proxy's (`reconcile.CountReconciler`): its scrape windows,
        # the proxy's token events listed for them, and what resolving them learnt. It reads the live requests and
        # the GPU edges (both updated in place, never rebound) and the holds they are bounded by.
        self.recon = CountReconciler(t0_ns, self.requests, self.edges, self.max_hold_ns, self.prompt_hold_ns)
        self.choices_prefilled_apart = False  # the server prefills an n > 1 prompt apart (scrape.PREFILLS_CHOICES_APART)
        # Whether the server runs /generate (SGLang's native route): False for one known not to (llama-server and vLLM
        # answer it 404, never run), None while its kind is not known (set by the daemon from scrape.Scraper.kind).
        self.serves_generate: bool | None = None
        self.best_of_ignored = False  # the server takes no best_of (scrape.IGNORES_BEST_OF): no BEST_OF_FLAG
        # (a stream's seconds, a whole answer's wait period) the server runs a request on after its client left, until it
        # aborts it (scrape.RUNS_ON_AFTER_LEAVE; set by the daemon once the server is known), None: it aborts at once.
        self.runs_on_after_leave: tuple[float | None, float | None] | None = None
        # The daemon scrapes no server (scrape.server = none, set by the daemon): its kind unknown, whether it ran a
        # request on after its client left (SGLang to its abort, llama.cpp a whole answer to its end) is not known, so
        # no run-on is placed; the cut row and the requests beside it until such a run-on must have ended say
        # UNSURE_FLAG (`_unplaced`), where before they said nothing: the cut rows low, those beside them high.
        self.run_ons_unknown = False
        # (leave, latest end of a run-on there) of such requests: the intervals whose requests say so.
        self._unplaced_spans: list[tuple[int, int]] = []
        # (arrival, latest end) of batches answered 400 that SGLang may have run on (`_batch_run_on`) where no scrape
        # window is there to mark: the intervals whose requests say so (`batch_beside_j`); disjoint, merged.
        self._batch_spans: list[tuple[int, int]] = []
        # A scraped batch 400 whose span was cut at BATCH_SPAN_MAX_S, by request id: (its arrival, its bound uncut, its
        # prompts' prefill's end as bounded, their decode pace a sequence taken), its span held open past the cap while
        # its at-finish server has counted nothing its prompts' end may be (`_hold_uncounted_batches`,
        # `batch_count_may_end`).
        self._batch_uncounted: dict[int, tuple[int, int, int, float]] = {}
        # The batches (arrival, end) each such span holds, by its start (`batches_added`), and each of
        # recon.batch_run_ons's, by its key: a restart cuts each batch apart (`_end_run_ons_at_restart`).
        self._batch_span_batches: dict[int, list[tuple[int, int]]] = {}
        self._batch_run_on_batches: dict[int, list[tuple[int, int]]] = {}
        # (end of its placing, latest end) of llama.cpp whole answers run on past RUN_ON_TO_END_MAX_S (`_run_on`): the
        # rest of that run is placed nowhere, so the intervals there say so on their requests' rows (`capped_beside_j`).
        # By request id: a restart that ends such a run sooner (`_cut_run_on`) takes its span out.
        self._capped_spans: dict[int, tuple[int, int]] = {}
        # (its leave, latest end) of llama.cpp whole answers run on after their client left (`_run_on`): llama-server
        # counts that run's tokens, which no proxied request lists, so the scrape windows read them as bypass and move
        # their energy into unproxied, out of the shares of the requests beside it, so the intervals there say so on
        # their rows (`counted_beside_j`). By request id; with no end known (no max_tokens or no pace: nothing placed)
        # its end is the first scrape window after it that counted nothing (`add_server_tokens`), not before
        # `_counted_from` (its leave, or its prompt's estimated prefill end: a prefill counts no token), or the first
        # /slots read where its slots have moved on (`_end_counted_by_slots`).
        self._counted_spans: dict[int, tuple[int, int]] = {}
        self._counted_from: dict[int, int] = {}
        self._count_still_from: int | None = None  # the start of the scrape windows since that counted no token
        # The latest scrape window's count moves every decode step (llama-server's /slots progress read in it: set by the
        # daemon's scrape loop, scrape.Scraper.window_each_step): only then does a still count say nothing decoded. The
        # counter alone (`--metrics --no-slots`) moves only as a request ends: the simulated llama.cpp's run-on went on
        # 15.3 s after its leave while the count stood still between finishes, the rows there +133%, unflagged.
        self.count_each_step = False
        # The latest scrape's llama.cpp /slots, (read start, read end, {slot id: (task id, busy)}), set by the daemon's
        # scrape loop (scrape.Scraper.window_slots); None where /slots was not read. A run-on's span with no known end
        # closes once every slot busy at the first such read after its leave has moved on (`_end_counted_by_slots`): a
        # busy server's count moves in every window, so a still count alone never closed it.
        self.window_slots: tuple[int, int, dict[int, tuple[object, bool]]] | None = None
        # By counted span: (its latest leave, to note from at the first /slots read begun after it, or None once noted;
        # the (slot id, task id) pairs busy there), and the slots seen idle at the latest read handled.
        self._counted_watch: dict[int, tuple[int | None, frozenset]] = {}
        # By counted span not yet noted: the slots idle at both reads its runs need before one notes it, (how many, which
        # ids): llama-server defers a task of `n` choices until `n` slots are free, one pinned by `id_slot` while that
        # slot is busy (`_slots_needed`), so such a run may sit queued while fewer slots idle.
        self._counted_need: dict[int, tuple[int, frozenset]] = {}
        self._slots_handled: tuple[int, frozenset] | None = None
        # By placed counted span (a run-on placed to its max_tokens): where /slots showed its run had ended (that
        # read's end plus GONE_ABORT_SLACK_S), and where its placed tokens end; the span ends at the later of the two,
        # if sooner than the end it was held to (`_cut_placed_span`).
        self._placed_slots_end: dict[int, int] = {}
        self._placed_end: dict[int, int] = {}
        # The latest restarts' scrape windows, (start, end, first found down): the old process's last scrape, the new
        # one's first, and the first scrape between that found the server down (None: none did); its run-ons end
        # between the first and the third (`_run_on_cut_ns`); as many as `recon.restarts` keeps.
        # A fourth: whether that first found-down scrape's connection was refused (nothing listening: a death), not a
        # 502/503 a router or a loading page answers.
        self._gone_at: deque = deque(maxlen=64)
        # Of those, the (start, end, first found down) of deaths no page said a restart of (`add_server_tokens`: a
        # refused connect, then a page that says none): a run-on's row says its process died, not that it restarted.
        self._died_unrestarted: deque = deque(maxlen=64)
        # Of those, the deaths whose page back was past a new process's reach (scrape.Scraper.window_past_reach): the
        # same process back, or a restarted one whose counter persisted; a run-on is not cut there (`_run_on_cut_ns`).
        self._death_unsure: deque = deque(maxlen=64)
        # A death seen before its restart is: (the old process's last scrape, the first scrape since that found the
        # server down, whether a scrape since found nothing listening) (`note_down`); None: none open. Ended by the
        # next scrape window, which lists it in `_gone_at` where it says a restart.
        self._down_open: tuple[int, int, bool] | None = None
        # When proxied requests' connections to the server broke (refused, closed with no answer, cut mid-answer):
        # what a death does to the requests in flight, the proof a lone found-down scrape lacks (`_death_proven`).
        self._conn_fail_ns: deque = deque(maxlen=64)
        # Recent streams' decode paces (tokens a second a sequence, first token to last): a stream gone before its first
        # token that the server runs on decodes at about theirs (`_run_on_gone`).
        self._paces: deque = deque(maxlen=RUN_ON_PACES)
        # Finished single-sequence streams' uncached prompt tokens over their time to first token, where a cached count
        # was said, and their whole prompt (the context its prefill attended over) (`prefill_rate_shown`), for a batch's
        # prefill (`_batch_end_ns`, the lowest taken, each at the batch prompts' length).
        self._prefill_rates: deque = deque(maxlen=RUN_ON_PACES)
        # Sequences of the requests started and not ended, by request id: those a batch's pace is shared by.
        self._live_seqs: dict[int, int] = {}
        self._setting: tuple = ()  # the GPUs' power limits (and SM clock locks) at the latest full sample
        self._locks = ClockLockSigns(expire_s=LOCK_WAIT_S)  # each GPU's SM clock lock, as its readings show it
        self._power_w: np.ndarray | None = None  # the GPUs' power at the latest full sample
        self.scraping = False  # the daemon scrapes the server's counters (set by it): no count yet is `unread`, not `off`
        # Since when a proxy worker serves whose records are unread (set by the daemon: workers.ProxyWorkers), None: none.
        self.proxy_unread_since_ns: int | None = None
        # The ended spans of that state, (since, until) (set by the daemon: workers.ProxyWorkers.unread_spans, bounded
        # there): an interval closed after the state ended (a new worker life spoke the daemon's shape first) still
        # held its traffic, which the start alone lost (`off`, its energy idle, unsaid).
        self.proxy_unread_spans: tuple[tuple[int, int], ...] = ()
        self.late_tokens = 0.0  # token events stamped before an interval already closed (not attributed)
        self.burst_requests = 0  # streams that reached the proxy in one burst (`_spread_burst`)
        self.chunk_counted_low = 0  # count-less streams the server's counter showed low (`_request_fields`)
        # [arrival, end + GONE_ABORT_SLACK_S] of requests gone before their first token, their prompt unsaid: the
        # intervals whose requests say GONE_PREFILL_FLAG, kept past their request's row for the intervals after its end.
        self._gone_spans: list[tuple[int, int]] = []
        # [arrival, first token or end] of requests whose prefill is costed at none, their body unread or sizeless, their prompt
        # unsaid (rowtext.prompt_unread): the intervals whose other requests say PROMPT_UNREAD_FLAG.
        self._unread_spans: list[tuple[int, int, str]] = []
        # [arrival, close] of crash-costed closes that may have queued unrun (liverequest.resend_queued): the intervals
        # whose other requests say UNSURE_FLAG (their share there may be low by that request's figure).
        self._queued_spans: list[tuple[int, int]] = []
        # Ends of recently ended streams that said no count (rowtext.counted_low): intervals up to LAG_S after them say
        # their unproxied may hold those streams' tokens (the scrape window that counted them spreads them past the end).
        self._counted_low_ends: deque = deque(maxlen=256)
        self._gpu_total = np.zeros(n_gpus)
        self._cpu_total: float | None = None
        self._by_kind = np.zeros(4)
        self._by_dest = np.zeros(3)
        self._idle_unknown_intervals = 0
        self._not_serving_total = 0.0  # Totals.idle_not_serving_j
        self._serving_changes = 0  # Totals.serving_changes
        self._accounted_serving: np.ndarray | None = None  # the serving mask the last intervals were accounted by (None: all)
        self._gpu_unknown_intervals = 0
        self._gpu_unknown_s = np.zeros(n_gpus)  # Totals.gpu_unknown_s
        self._gpu_unread_now = np.zeros(n_gpus, bool)  # Totals.gpu_unread_now
        self._intervals_total = 0  # Totals.intervals
        self._tokens_total = 0.0
        self._tokens_attributed = 0.0
        self._recent: deque = deque()  # (t_end_ns, requests' J, their tokens)
        self._jpt_left_out: dict[str, tuple[int, float]] = {}  # Totals.jpt_left_out
        self.prompt_lengths = PromptLengths()
        # A Responses answer's id → its conversation's tokens as the server counted them (its prompt and its output,
        # less the part a later turn does not prefill again: promptlen.uncarried_chars):
        # what a later turn naming it as previous_response_id prefills before its own input. Only answers proxied
        # here, the latest RESPONSE_CONTEXT_KEEP (an LRU: a turn naming one evicted, or one from before a restart, is
        # prompt-unread as before).
        self.response_context: OrderedDict[str, int] = OrderedDict()
        # Per API, whether this server renders a request's `tools` where its tool_choice is "none" (SGLang's chat does
        # not, nor vLLM's with --exclude-tools-when-tool-choice-none), as the last such prompt it counted showed
        # (`_tools_rendered`); absent: none seen yet, its tools counted (vLLM's default).
        self.tools_when_none: dict[str, bool] = {}
        # Per API, the clear judgments so far ([rendered, not]); a verdict once one side has three times the other's.
        # Judged against the ratio of prompts with no such tools alone (`plain_lengths`): one learned from the prompts
        # judged confirms whatever it first read (vLLM, every chat with the same tools: "not rendered", -85%).
        self.tools_none_tally: dict[str, list[int]] = {}
        self.plain_lengths = PromptLengths()
        # Of `response_context`, the turns whose tools sent with tool_choice "none" were taken out of their counted
        # prompt while undecided whether the server rendered them: their tokens, said on a later turn's estimate.
        self.context_tools_unsure: dict[str, int] = {}
        self.prompts_estimated: dict[str, int] = {}  # {why the server never counted it: requests}
        self.totals = Totals(gpu_energy_j=(0.0,) * n_gpus, gpu_unknown_s=(0.0,) * n_gpus,
                             gpu_unread_now=(False,) * n_gpus)

    def _say_undecided(self, t: np.ndarray, undecided_iv: np.ndarray) -> None:
        """The log's word that which GPUs serve is not known, where busy intervals were split so (`undecided_iv`):
        at the first, then every UNDECIDED_SAY_S (on the intervals' clock) while they go on. Before, nothing outside
        the rows said it: under a load too even to judge, J/token blank for good and the log silent."""
        n = int(np.count_nonzero(undecided_iv))
        if not n:
            return
        self._undecided_intervals += n
        if self._undecided_said_ns is not None and int(t[-1]) - self._undecided_said_ns < UNDECIDED_SAY_S * 1e9:
            return
        self._undecided_said_ns = int(t[-1])
        log.warning("which of the %d sampled GPUs serve the proxied work is not known: %s; %d busy interval(s) since "
                    "start were split with every sampled GPU's energy the work's, their requests' rows say %s and are "
                    "left out of J/token (powerprof_joules_per_token_left_out_intervals_total{reason=\"%s\"}); %s",
                    self.n_gpus, ({"disagree": UNDECIDED_ASSERTED_DISAGREE, "provisional": UNDECIDED_ASSERTED_DOUBTED}
                                  if self._serving_source == SERVING_ASSERTED_SOURCE else
                                  {"disagree": UNDECIDED_DISAGREE, "provisional": UNDECIDED_PROVISIONAL})
                    .get(self.learner.serving_from, UNDECIDED_CAUSE),
                    self._undecided_intervals, UNSURE_FLAG, GPUS_UNDECIDED_REASON,
                    UNDECIDED_FIX)

    def _say_disagreement(self) -> None:
        """A WARNING where the told serving GPUs and those the power judges differ (at each new pair): neither is
        picked, which serve is undecided and the rows split meanwhile are flagged (workmodel.CostLearner._decide)."""
        lr = self.learner
        if lr.serving_from != "disagree":
            self._disagree_said = None
            return
        pair = (tuple(bool(x) for x in lr.told), tuple(bool(x) for x in lr.judged))
        if pair == self._disagree_said:
            return
        self._disagree_said, self._serving_said = pair, None  # the agreeing mask, when it comes, is said anew

        def named(mask):
            return ", ".join(self.gpu_names[g] for g, on in enumerate(mask) if on) or "none"
        asserted = self._serving_source == SERVING_ASSERTED_SOURCE
        log.warning("which sampled GPUs serve the proxied work is undecided: %s tells %s, the GPUs' power judges %s "
                    "(%s); rows split meanwhile have every sampled GPU's energy the work's, say %s and are left out of "
                    "J/token (reason %s) until the two agree%s%s", self._serving_source, named(pair[0]),
                    named(pair[1]),
                    "the config's assertion wrong, or another server's load following the traffic"
                    if asserted else
                    "a worker of the server's not seen, or another server's load following the traffic",
                    UNSURE_FLAG, GPUS_UNDECIDED_REASON,
                    f"; before this, {self._asserted_intervals} busy interval(s) were split by the assertion alone: "
                    f"{self.flagged_requests.get(SERVING_ASSERTED_FLAG, 0)} request row(s) already written, and the "
                    f"requests live now, say {SERVING_ASSERTED_FLAG} and stay in J/token as written (off by a GPU's "
                    f"share where the assertion is wrong; powerprof_requests_serving_asserted_total counts them)"
                    if asserted and self._asserted_intervals else "",
                    "; fix: correct daemon.serving_gpus (or empty it, to let the daemon judge) and restart the daemon"
                    if self._serving_source == SERVING_ASSERTED_SOURCE else "")

    def _say_judged(self) -> None:
        """At each new mask the GPUs' power judged and the work model took (alone or agreeing with a told one): kept for
        the next start (`on_judged`), and said against the last run's (`saved_serving`), once: the same, or not (the
        host's GPUs re-assigned since: this run's judgement stands, as with nothing saved)."""
        lr = self.learner
        if lr.serving_from not in ("judged", "both") or lr.serving is None:
            return
        mask = tuple(bool(x) for x in lr.serving)
        if mask == self._judged_kept:
            return
        self._judged_kept = mask
        if self.on_judged is not None:
            try:  # its keeping is a log line's source only: never stops the accounting
                self.on_judged(list(mask))
            except Exception:
                log.exception("keeping which GPUs serve failed: the next start will not say whether its judgement is "
                              "this one's")
        if self.saved_serving is None:
            return
        (saved, saved_s), self.saved_serving = self.saved_serving, None

        def named(m):
            return ", ".join(self.gpu_names[g] for g, on in enumerate(m) if on) or "none"
        try:  # servingstate.load checks it is a plausible time; a log line never stops the accounting
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(saved_s))
        except (ValueError, OverflowError, OSError):
            when = "at an unreadable time"
        if list(mask) == saved:
            log.info("the GPUs' power judges %s serving the proxied work, as the last run's judgement (saved %s) did",
                     named(mask), when)
        else:
            # What became of the rows before it, as it happened: flagged only where split undecided (a told or asserted
            # mask split them unflagged; before, the line said "flagged" whatever, 0 of 53 rows being so).
            before = [f"{self._undecided_intervals} busy interval(s) split undecided, their rows flagged "
                      f"{GPUS_UNDECIDED_REASON}" if self._undecided_intervals else "",
                      f"{self._asserted_intervals} busy interval(s) split by daemon.serving_gpus alone, their rows saying "
                      f"{SERVING_ASSERTED_FLAG}" if self._asserted_intervals else ""]
            log.warning("the GPUs' power judges %s serving the proxied work, the last run's judgement (saved %s) %s "
                        "(the server moved to other GPUs since, or another process's load changed): this run's stands; "
                        "the saved one was never taken (before this judgement: %s)",
                        named(mask), when, named(saved),
                        "; ".join(b for b in before if b) or "no busy interval split without a mask")

    def tell_serving(self, serving, source: str, provisional: bool = False) -> None:
        """The sampled GPUs (by position) the server runs on, as the daemon found them (`source`, in words: its
        processes on NVML's process lists), or None: nothing can be told now (an earlier telling withdrawn): taken by
        the work model at the next close (workmodel.CostLearner.tell_serving: checked against the GPUs' power once
        judged, a disagreement leaving which serve undecided; provisional: undecided until the power judges the same).
        Any thread."""
        mask = None if serving is None else np.asarray(serving, dtype=bool)
        if mask is not None and mask.size == self.n_gpus and not mask.any():
            # No sampled GPU serves (the server on unsampled ones alone): nothing to take, so an earlier telling is
            # withdrawn. Before, it was ignored and an earlier mask stood, stale, unflagged by this rule.
            mask = None
        if mask is None or mask.size == self.n_gpus:
            with self._told_lock:
                self._told_serving = (mask, source, provisional)

    # --- recorder interface (called by the proxy) ------------------------------------------

    def on_start(self, trace: RequestTrace) -> None:
        self.requests[trace.request_id] = LiveRequest(
            trace, uncounted=uncounted_kind(trace.method, trace.endpoint) if trace.api is None else None)
        seqs = trace.extra.get("sequences", 1)
        self._live_seqs[trace.request_id] = max(seqs, 1) if isinstance(seqs, int) else 1

    def on_tokens(self, trace: RequestTrace, t_ns: int, n: int) -> None:
        r = self.requests.get(trace.request_id)
        if r is not None:
            r.pieces += 1
            if r.pieces == 1:  # whatever becomes of it (late, at a restart's cut): the first piece is this one
                r.first_piece_n = float(n)
        if r is not None and self.edges and t_ns < self.edges[0].t_ns:
            # Stamped before an interval that has closed (a proxy worker's record read late): it cannot
            # be placed any more. Counted and flagged, never silently lost.
            r.late += n
            self.late_tokens += n
            return
        if r is not None:
            seqs = max(trace.extra.get("sequences", 1), 1)
            if self._held_burst(r, t_ns, n, seqs):
                return
            cut = self._restart_cut_ns(r)
            if cut is not None and t_ns > cut:
                # Read after the first scrape after a restart, of a request that arrived before it (a stalled proxy
                # worker): the old process generated and counted them before it died, never the new one. Placed at
                # that scrape, not here: in the new process's windows they hid its bypass tokens, and the windows
                # where the old one counted them read their rise as bypass tokens that never ran.
                self._place(r, [cut], [float(n)])
                r.prev_ns, r.prev_held = t_ns, n > seqs
                return
            if r.prev_ns is None and not r.spent:
                r.first_held = n > FIRST_BURST_TOKENS * seqs
            a = r.prev_ns
            if trace.stream is True and a is not None and n > seqs and t_ns > a:
                # A piece of several steps since the previous one (a proxy worker's 20 ms record) holds tokens the
                # server counted over that time, not at its stamp: placed at it, a scrape just before the stamp saw the
                # server ahead by them at every window of a steady stream (its records in a fixed phase with the
                # scrapes), the lag never drained within LAG_S and read as bypass tokens that never ran, rows
                # `complete` (300 tokens/s, 20 ms records: up to 5 a stream). Spread step by step over the time since
                # the previous piece, never before it (a long gap is `_held_burst`'s, above).
                k = int(round(n / seqs))
                k = PIECE_STEPS if k > PIECE_STEPS else k if k > 1 else 1
                d = t_ns - a
                ts = [a + d * j // k for j in range(1, k + 1)]
                ns = [n / k] * k
                if (not self.edges or ts[0] >= self.edges[0].t_ns) and (not r.ev_t or ts[0] >= r.ev_t[-1]):
                    # `_place`'s common case in one extend (ts ascending, all in open intervals, none before an event
                    # already placed): its per-event loop was most of a piece's cost (bench/ledger_on_tokens.py).
                    r.ev_t.extend(ts)
                    r.ev_n.extend(ns)
                    if self.recon.server_seen:
                        self.recon.proxied.extend(zip(ts, ns))
                else:
                    self._place(r, ts, ns)
            else:
                r.ev_t.append(t_ns)
                r.ev_n.append(n)
                if self.recon.server_seen:
                    self.recon.proxied.append((t_ns, n))
            r.prev_ns, r.prev_held = t_ns, n > seqs

    def _held_burst(self, r: LiveRequest, t_ns: int, n: float, seqs: int) -> bool:
        """A piece of a stream that came in several bursts, each held back on its way since the one before (a buffering
        hop that passes its buffer on when full, nginx's 4 kB, or on a timer): its tokens were generated since the
        previous piece, not at once; they are placed over that time at the server's pace, now, so that the scrape
        windows see them where the server counted them. Left at the burst, they moved up to a flush's time late, the
        server's count ran ahead of the proxy's and its catching up passed for bypass traffic, rows silent
        (docs/daemon.md, A stream held back on its way). True when placed so."""
        tr = r.trace
        a = r.prev_ns
        if tr.stream is not True or tr.api is None or a is None or n <= seqs or t_ns - a < HELD_GAP_NS:
            return False
        # Its pace so far from its first token (from its arrival, its queue and prefill made a hop's timer flush of a
        # few tokens, then one of 22, read as far faster than the stream went).
        done = r.spent + float(sum(r.ev_n)) + r.late
        since = a - (tr.first_ns if tr.first_ns is not None else a)
        if since >= HELD_GAP_NS and n / (t_ns - a) > HELD_PACE_X * done / since:
            return False  # far faster than the stream ever went: the rest of one held body
        if self.edges and self.edges[0].t_ns > a:
            # Held past the intervals' holds: those from its previous piece on closed without its tokens, which are
            # placed in the ones still open; the seconds cut so are said on its row (`closed_s`), as a first burst's.
            r.closed_s += (self.edges[0].t_ns - a) / 1e9
            a = self.edges[0].t_ns
        k = int(min(SPREAD_EVENTS, max(2, n)))
        ts = self._at_server_pace(r, a, t_ns, k + 1, n)[1:]
        if r.bursts == 0:
            r.first_burst_end_ns = r.prev_ns
        r.bursts += 1
        r.held_s = max(r.held_s, (t_ns - r.prev_ns) / 1e9)
        self._place(r, ts, [n / k] * k)
        r.prev_ns, r.prev_held = t_ns, True
        return True

    def _restart_cut_ns(self, r: LiveRequest) -> int | None:
        """The first scrape after the first restart known since `r` arrived (the end of that restart's window): the
        process that served `r` died before it, so none of `r`'s tokens was generated, or counted, later."""
        if not self.recon.restarts:
            return None  # the common case, asked on every piece: no generator to build
        return min((b for a, b in self.recon.restarts if a >= r.trace.arrival_ns), default=None)

    def _place(self, r: LiveRequest, ts: list[int], ns: list[float]) -> None:
        """`r`'s token events `ns` at `ts`, listed for the scrape windows. Any before the first open interval (placed
        back to a restart's cut after those closed) are late: counted on its row, in no interval's energy."""
        floor = self.edges[0].t_ns if self.edges else None
        for t, x in zip(ts, ns):
            if floor is not None and t < floor:
                r.late += x
                self.late_tokens += x
            elif not r.ev_t or t >= r.ev_t[-1]:
                r.ev_t.append(t)
                r.ev_n.append(x)
            else:  # before an event placed before the restart was known: kept in order (the intervals' cut needs it)
                i = int(np.searchsorted(r.ev_t, t, side="right"))
                r.ev_t.insert(i, t)
                r.ev_n.insert(i, x)
        if self.recon.server_seen:
            self.recon.proxied.extend(zip(ts, ns))

    def on_end(self, trace: RequestTrace) -> float:
        """The request ended. Returns the tokens its end added to (or took from) what on_tokens had
        placed: a stream counted one token per chunk whose final `usage` says otherwise."""
        self._live_seqs.pop(trace.request_id, None)
        r = self.requests.get(trace.request_id)
        if r is None:
            r = LiveRequest(trace)
            if not_forwarded(r):
                # Answered by the proxy before it forwarded it (no on_start): live at no server, in no interval's split;
                # its row now. Before, none was written (it was on /metrics alone).
                self.emit("requests", [self._request_row(r)])
            return 0.0
        added = self._placed_at_end(r)
        r.closed_scraped = self.scraping
        error = trace.error or ""
        if trace.end_ns is not None and (trace.outcome == "upstream_unreachable" or trace.outcome == "upstream_error"
                                         and not error.startswith(ANSWERED_ERROR_NOTES)
                                         and (not closed_unanswered(r)
                                              or error.startswith(f"{CRASHED_NOTE}: {RESEND_REFUSED}"))):
            # Its connection to the server broke: a death's mark (`_death_proven`); one may now prove a restart known.
            # Not a close with no answer: a router refusing closes so, and beside a router's 503 on the metrics page
            # such a close cut a live run-on to 0.6 tokens / 2.5 J of 160 / 400, its row sure (session 59's review).
            # Unless its resend was refused (proxy.RESEND_REFUSED): nothing listened, as a refused connect says.
            self._conn_fail_ns.append(trace.end_ns)
            if self._gone_at:
                self._end_run_ons_at_restart()
            if self._down_open is not None:  # a 503's window open: that death shown, its held closes are crashes
                self._crashes_known()
        if trace.outcome == "client_disconnected" and trace.api is not None \
                and not (trace.error or "").startswith(BODY_LEFT_NOTE):
            # Counted at its end, not at its row: a row held back (`_late_parked`) is made after its tag's row went out.
            gone = gone_unsaid(r) and trace.stream is True
            unplaced = self.run_ons_unknown and trace.stream is not True
            for tg in self._tags_over(trace):
                tg.cut += 1
                tg.gone_first += gone
                tg.cut_unplaced += unplaced
        r.prefilled_apart = r.prefilled_apart or self._prefilled_apart(r)  # an end before any close placed it
        self._cache_met(r)
        self._release(r)  # its end may have said its count: no wait counts it any more
        self._learn_says_cached(r)
        if self.recon.server_seen:
            # All its tokens, as the proxy counted them in the end (late ones too: the server counted them), at its
            # last token: where a counter that moves at request end counted them (`recon.resolve_spans`). A stream the
            # client cut is in: counted by a server that does not count it, it lowers the gap for CREDIT_S (bypass
            # tokens then hidden that long); left out of one that does, its tokens would pass for bypass traffic.
            n = r.spent + float(sum(r.ev_n)) + r.late
            t = trace.last_ns if trace.last_ns is not None else trace.end_ns
            if t is not None and r.ev_t and r.ev_t[-1] > t:
                # Tokens its end placed after its last chunk (a tool call SGLang's parser held: `_placed_at_end`):
                # the server finished it, and such a counter counted them, there. At the last chunk, about 1 run in 3 read
                # them as bypass tokens in the window of its real finish (its energy -49%).
                t = r.ev_t[-1]
            cut = self._restart_cut_ns(r)
            if t is not None and cut is not None:
                t = min(int(t), cut)  # served by a process that died in a restart: never counted after it
            if n > 0 and t is not None:
                # Its duration too: an at-finish window's bypass requests' durations are the server's latency sum
                # less the proxied ones' (`recon._spread_back`).
                self.recon.finished.append((int(t), n, max(0, int(t) - trace.arrival_ns)))
            self.recon.note_end(r)
        self._learn_pace(r)
        # After the count listed for the scrape windows above: SGLang counts none of an aborted run-on. llama.cpp counts all
        # of a whole answer's run to its end, and it is not listed (docs/daemon.md: read as bypass tokens, a known gap).
        self._run_on(r)
        self._batch_run_on(r)
        # A restart known already ended it: no later one will (`_end_run_ons_at_restart`). Held to its estimate, a whole
        # answer whose process died at 0.6 s, its client gone at 1.0 s, was costed 400 tokens and 1010 J for 4 and 10.
        self._cut_run_on(r)
        return added

    def _crash_seen(self, r: LiveRequest) -> bool | None:
        """Whether `r`'s close with no answer (liverequest.closed_unanswered) came as its server died: a whole answer to
        a generation API (a stream's or a GET's close is not one `_run_on` places), closed within a restart's window,
        from the old process's last scrape to the first that found the server down (or the new one's first, none did),
        give or take CRASH_CLOSE_SLACK_S. True: a death shown; False: matched only by its arrival before the old
        process's last scrape (a queuing router's refusal reads the same: `LiveRequest.crash_unsure`); None: not seen.
        The close alone is no proof: a router in front of the server refusing a request closes so too, and taken for a
        crash such requests (never run) were costed 78 J over 4 on an idle simulated server, their rows saying their
        process died."""
        tr = r.trace
        if (self._never_run(tr) or tr.api is None
                or tr.stream is True or tr.first_ns is not None or tr.end_ns is None or r.ev_n or r.spent):
            return None
        # /generate to a server whose kind is not known: only SGLang runs it, so a death shown is no proof it ran (another
        # server refused it unrun, 0 J): costed, unsure, its row saying why (`LiveRequest.crash_route_unsure`).
        r.crash_route_unsure = tr.api == "sglang-generate" and self.serves_generate is None
        slack = int(CRASH_CLOSE_SLACK_S * 1e9)  # before the last scrape the process was alive after: not its death
        # A scrape found the server down (`note_down`), before the new process answered: nothing listening proves the
        # death. A reloading llama-server's 503 "Loading model" alone proves none until a page confirms the restart
        # (the `_gone_at` rule below; its rows are held for it meanwhile: `_down_hold`): costed at once, a router's
        # 503 blip with no restart after cost a request it held and closed unanswered (never run) 119 J.
        # So does a proxied connection broken in that window (`_death_shown`: streams cut by the crash beside it), 503
        # or not: held for a page that came after DOWN_HOLD_MAX_S, the row was 0 J and the cut streams +10% unmarked.
        o = self._down_open
        if o is not None and o[0] <= tr.end_ns <= o[1] + slack and (o[2] or self._death_shown((o[0], o[1], o[1], False))):
            return not r.crash_route_unsure
        # Found down, a death must be shown (`_death_shown`): a router answering the metrics page 503, a counter's dip
        # then, and its own refusal closing the request, was costed as a crash, 84-104 J for a request never run. None
        # found down, the restart was told by the new process itself (its start time, a lone process's counter).
        within = [g for g in self._gone_at if g[0] <= tr.end_ns <= (g[1] if g[2] is None else g[2]) + slack]
        if any(g[2] is None or self._death_shown(g) for g in within):
            return not r.crash_route_unsure
        # Without it, a request sent before the old process's last scrape was most likely in flight at a live server
        # and closed by its death (needing the proof, llama-server's reload, 503 "Loading model" and nothing refused,
        # left such a request 0 J for about 100 J). But a queuing router (llama-swap, holding it while it swaps
        # models) refuses one it held as unrun (truth 0 J; a sure crash read 55 J): costed, unsure (`crash_unsure`).
        if any(tr.arrival_ns < g[0] for g in within):
            r.crash_by_page = False
            return False
        # Its resend met llama-server's loading page (proxy.RESEND_LOADING): the proxy itself saw a new process where
        # the one that had it was, as a scrape's 503 would say (no proof alone: a router's page may quote the words).
        # Sent after the last good scrape, it was not costed, unmarked: 0 J for 25 J of truth on the simulator.
        r.crash_by_page = f"{CRASHED_NOTE}: {RESEND_LOADING}" in (tr.error or "")
        return False if r.crash_by_page else None

    def _crash_reach(self, r: LiveRequest) -> None:
        """Whether `r`'s crash-costed close with no answer is explained only by deaths whose page back was past a new
        process's reach (`_death_unsure`), on a server that runs a whole answer on after its connection closes (SGLang,
        to its next wait: RUNS_ON_AFTER_LEAVE): the same process back (a port-forward's hiccup closing the connection)
        ran it on as a client's leave, or a restarted one whose counter persisted, the old one dead. Costed as the crash,
        its row says both readings (`LiveRequest.crash_reach`), and the windows from its close to that wait say
        run_on_may_end for the requests beside it. Costed as a sure crash, a whole answer closed at 1.52 s (refused
        1.55 s, the page past reach at 1.6 s) read 40.8 tokens and 52 J, the stream beside it 221 J, both unflagged,
        where the same process ran it to 4.5 s (159.6 tokens, 271 J; the stream 142 J). Any other death shown there
        (a restart the page said) keeps it a sure crash; vLLM aborts it at once, the crash's costing right either way."""
        tr, key = r.trace, (r.trace.request_id, "death")
        waits = self.runs_on_after_leave
        slack = int(CRASH_CLOSE_SLACK_S * 1e9)
        within = [g for g in self._gone_at if g[0] <= tr.end_ns <= (g[1] if g[2] is None else g[2]) + slack]
        reach = next((g for g in within if g[:3] in self._death_unsure), None)
        if (reach is None or waits is None or waits[1] is None
                or any(g[:3] not in self._death_unsure and (g[2] is None or self._death_shown(g)) for g in within)):
            r.crash_reach = None
            self.recon.run_ons_may_end.pop(key, None)
            return
        wait_ns = int(waits[1] * 1e9)
        r.crash_reach = (reach[0], reach[2])
        self.recon.run_ons_may_end[key] = (
            int(tr.end_ns), tr.arrival_ns + max(1, -(-(tr.end_ns - tr.arrival_ns) // wait_ns)) * wait_ns)

    def _never_run(self, tr) -> bool:
        """Whether the server refuses `tr`'s method and route unrun, so a close with no answer at its death cost nothing.
        PUT: SGLang's /generate alone takes it, as a POST; every other route refuses it (llama-server 404, the vLLM and
        SGLang flavours 405): taken on any generation API, a PUT to a chat path was costed 110 J (truth 0). /generate on
        a server known not to run it (`serves_generate` False): costed by its path alone, a PUT or POST /generate to
        llama-server was 110 J (truth 0: it answers 404)."""
        if tr.api == "sglang-generate" and self.serves_generate is False:
            return True
        return not (tr.method == "POST" or (tr.method == "PUT" and tr.api == "sglang-generate"))

    def _learn_pace(self, r: LiveRequest) -> None:
        """Keep a finished stream's decode pace (tokens a second a sequence, first token to last) for `_run_on_gone`."""
        tr = r.trace
        seqs = max(tr.extra.get("sequences", 1), 1)
        n = (r.spent + float(sum(r.ev_n)) + r.late) / seqs
        if (tr.outcome == "ok" and tr.stream is True and tr.first_ns is not None and tr.last_ns is not None
                and n >= RUN_ON_PACE_TOKENS and tr.last_ns > tr.first_ns):
            self._paces.append((n - 1) / ((tr.last_ns - tr.first_ns) / 1e9))
        shown = prefill_rate_shown(tr)
        if shown is not None:
            self._prefill_rates.append(shown)

    @staticmethod
    def _cost_as_crash(r: LiveRequest, sure: bool) -> None:
        """A whole answer the server had, then closed its connection with no answer as it died (its head comes only
        when it is done): it ran until then, decoding after its prefill, placed as a run-on's is (`_run_on_gone`);
        `sure` False: its row says both readings (`crash_unsure`). Before, upstream_unreachable: two on the simulator,
        130 tokens and 148 J each, none."""
        r.crash_seen, r.run_on_end_ns, r.run_on_crash, r.crash_unsure = True, r.trace.end_ns, True, not sure

    def _run_on(self, r: LiveRequest) -> None:
        """A request whose client left that the server runs on for nobody until it aborts it (SGLang: 2 s after a
        stream's client left, a whole answer at its next 4 s wait; llama.cpp: a whole answer to its end, taken as its
        max_tokens: scrape.RUNS_ON_AFTER_LEAVE): it stays in the split
        until then (`run_on_end_ns`, `server_end_ns`), and a stream's decode goes on there at its batch's pace
        (`_place_run_ons`, once the streams beside it have shown that run), placed as token events no scrape window lists
        (SGLang counts an aborted request's tokens nowhere; llama.cpp counts a run to its end, unlisted: a known
        gap, docs/daemon.md). Without it that work went to the requests beside it:
        on the simulator's SGLang, streams cut after 41 tokens decoded 100-170 more for nobody, and the requests beside
        them were +54% to +251%, the cut ones 29-61% low."""
        tr = r.trace
        if closed_unanswered(r):
            seen = self._crash_seen(r) if not r.crash_seen or r.crash_unsure else None
            if seen is not None and not r.crash_seen:
                self._cost_as_crash(r, seen)
            elif seen is not None:
                r.crash_unsure = not seen  # a proof come later makes it sure
            if r.run_on_crash:
                self._crash_reach(r)
            return
        if (tr.outcome != "client_disconnected" or tr.end_ns is None
                or tr.api is None or is_passive(r) or is_unseen(r) or (tr.error or "").startswith(BODY_LEFT_NOTE)):
            return
        limit = tr.extra.get("max_tokens")
        if (tr.stream is True and isinstance(limit, int) and limit > 0
                and r.spent + float(sum(r.ev_n)) + r.late >= limit * max(tr.extra.get("sequences", 1), 1)):
            return  # it had shown all its max_tokens allow: the server had finished it, nothing ran on (its row said so)
        if self.runs_on_after_leave is None:
            if self.run_ons_unknown:
                self._unplaced(r, limit)
            return
        stream_s, wait_s = self.runs_on_after_leave
        if tr.stream is True:
            if stream_s is None:
                # llama-server looks at a stream's connection after each result of its own: it stops within a token of
                # its client's leaving, but one gone before its first token prefills its prompt whole first. Its run
                # ends at its estimated first token (its prompt at the rate in use), costed its whole prompt
                # (`_cost_gone`); bounded by its time in flight, a 12000-token prompt cut 0.1 s in was costed 1000.
                first = self._prefill_end_est_ns(r) if tr.first_ns is None and gone_unsaid(r) else None
                if first is not None and first > tr.end_ns:
                    r.run_on_end_ns, r.run_on_prefill = first, True
                return
            r.run_on_end_ns = tr.end_ns + int(stream_s * 1e9)
        elif wait_s is None:
            # llama-server runs it on to its end: its wait for the result, woken by every result the server sends (the
            # streams beside it, this daemon's own scrapes), never times out to look at its connection. Its end is
            # placed at its max_tokens (`_place_run_on` stops it there at its batch's pace); the run is held open for
            # twice as long as the server's latest streams' pace decodes them. Without a max_tokens or a pace its end is
            # unknown: costed as one aborted at once (its prompt), its row saying what it decoded is unseen.
            if not (isinstance(limit, int) and limit > 0) or not self._paces:
                r.run_on_unknown = True  # its row says so (rowtext.WHOLE_GONE_RUN_ON), not an aborting server's words
                # Nothing placed, it runs on unseen: the requests beside it are marked until the server's count stands
                # still (`add_server_tokens`). Before, unmarked, as if it had been aborted at its leave.
                guard = max(int(tr.end_ns), self._prefill_end_est_ns(r) or 0)
                rid = next((k for k, (_, a1) in self._counted_spans.items() if a1 >= int(attr.NEVER)), tr.request_id)
                # From its leave where the count moves each step (its tokens before read as bypass as they came, the
                # shares beside them fair); with the counter alone, from its arrival (`_counted_start_ns`).
                start = int(tr.end_ns) if self.count_each_step else self._counted_start_ns(r)
                a0 = self._counted_spans.get(rid, (start,))[0]  # one unbounded span, not one a leave
                self._counted_spans[rid] = (min(a0, start), int(attr.NEVER))
                self._counted_from[rid] = max(self._counted_from.get(rid, 0), guard)
                # Its slots are noted afresh after this leave, beside those of the runs already in the span.
                after, watched = self._counted_watch.get(rid, (None, frozenset()))
                n0, ids0 = self._counted_need.get(rid, (1, frozenset())) if after is not None else (1, frozenset())
                n1, ids1 = self._slots_needed(tr)
                self._counted_need[rid] = (max(n0, n1), ids0 | ids1)
                self._counted_watch[rid] = (int(tr.end_ns), watched)
                return
            span_s = 2.0 * limit / float(np.median(self._paces))
            r.run_on_end_ns, r.run_on_to_end = tr.end_ns + int(min(span_s, RUN_ON_TO_END_MAX_S) * 1e9), True
            # Placed on its row, but the tokens the server counts of it are listed for no scrape window: read as bypass,
            # their energy in unproxied (docs/daemon.md, a known gap). The simulated llama.cpp (a 2000-token answer at
            # 34 tok/s) had 3410 J of 8760 unproxied in its first 30 s, the rows there -40%..+4%, unflagged.
            if self.scraping:
                self._counted_spans[tr.request_id] = (self._counted_start_ns(r), int(r.run_on_end_ns))
                # Watched by its slots as a run with no known end is (`_end_counted_by_slots`): a run llama-server
                # cancelled early (at its first quiet second) or ended sooner than held ends its span sooner.
                self._counted_watch[tr.request_id] = (int(tr.end_ns), frozenset())
                self._counted_need[tr.request_id] = self._slots_needed(tr)
                self._placed_slots_end[tr.request_id] = int(attr.NEVER)
            if span_s > RUN_ON_TO_END_MAX_S:
                # Its rest, past the held 30 s, is placed nowhere: its work is in the shares of the requests beside it
                # to its estimated end, plus GONE_ABORT_SLACK_S (the span only marks, holding nothing). Unmarked, the
                # simulated llama.cpp's 2000-token answer at 40 tok/s left the rows 32-56 s after the leave -5..+29%.
                latest = min(int(tr.end_ns) + int((span_s + GONE_ABORT_SLACK_S) * 1e9), int(attr.NEVER))
                self._capped_spans[tr.request_id] = (int(r.run_on_end_ns), latest)
        else:
            wait_ns = int(wait_s * 1e9)
            r.run_on_end_ns = tr.arrival_ns + max(1, -(-(tr.end_ns - tr.arrival_ns) // wait_ns)) * wait_ns
        if not r.run_on_to_end and not tr.extra.get("eos_ignored"):
            # SGLang's: it may end by itself before the abort, counted then (read as bypass tokens), unseen. Its windows
            # say so from now (intervals before its placing may close with them), till placed sure (`_place_run_on`).
            self.recon.run_ons_may_end[tr.request_id] = (int(tr.end_ns), int(r.run_on_end_ns))
        if tr.stream is not True or tr.first_ns is None or tr.last_ns is None:
            return  # gone before its first token (or a whole answer, its tokens unseen): `_run_on_gone` at its close
        # Placed once the streams beside it have shown that run (`_place_run_ons`; the intervals from here held till then).
        r.run_on_from_ns = max([tr.last_ns, *r.ev_t[-1:], *(e.t_ns for e in self.edges[:1])])  # none in a closed interval

    @staticmethod
    def _slots_needed(tr: RequestTrace) -> tuple[int, frozenset]:
        """The slots that must sit idle at two /slots reads before one notes a llama.cpp run-on's slots
        (`_end_counted_by_slots`): (how many, which ids). llama-server defers a task of `n` choices (a parent and n-1
        child tasks) until it finds a free slot for each, and one pinned by `id_slot` while that slot is busy
        (server-context.cpp: "try getting free slots for all child tasks", "requested slot is unavailable, we defer"):
        with fewer idle, or its own slot busy, it may sit queued, on no slot. Before, one idle slot noted it: an n=2
        run queued to 10 s and run to 30 s, beside 3 slots one idle, had its span end at 13 s, the rows to 30 s
        unflagged."""
        pinned = tr.extra.get("id_slot")
        return max(tr.extra.get("choices", 1), 1), frozenset(() if pinned is None else (pinned,))

    def _counted_start_ns(self, r: LiveRequest) -> int:
        """Where a llama.cpp whole answer's counted span (`_counted_spans`) starts: its arrival. Its tokens before the
        leave are counted by the server and listed by no proxied request too: placed on its row from its prefill's end
        (`_run_on_gone`), they read as bypass beside that placing where the count moves each step (a stream beside its
        run before the leave -24% to -27%, unflagged); with the counter alone (`--metrics --no-slots`) they are counted
        at the run's end, and unplaced their work was in the shares beside them (+100% to +111%, unflagged)."""
        return int(r.trace.arrival_ns)

    def _batch_run_on(self, r: LiveRequest) -> None:
        """A batch (two or more prompts) answered 400 by SGLang, or by a server of kind unknown yet: SGLang
        answers a whole /generate or /v1/completions batch 400 for one prompt its scheduler aborts (in the context's
        last 6 tokens) and runs the others to their cap for nobody (tokenizer_manager.py @ 001067ff
        `_collect_batch_responses`), counting them at their end. Its windows, from its arrival to the end those
        prompts are taken to run within (`_batch_end_ns`, at most BATCH_SPAN_MAX_S, its row saying so), say so
        (SERVER_COUNT_BATCH_RUN_ON): the requests given energy there are flagged. Unsaid, the count's tokens spread
        back only over the intervals still open at its end (`recon._spread_back`), and three streams beside such a
        batch read +19% to +24%, unflagged; capped at RUN_ON_TO_END_MAX_S, the windows of a batch run on past it were
        not marked. With no server scraped (scrape.server = none) the requests beside it say so instead, to a bounded
        end (`_batch_end_ns`)."""
        tr = r.trace
        seqs, copies = tr.extra.get("sequences", 1), max(tr.extra.get("choices", 1), 1)
        limit = tr.extra.get("max_tokens")
        # Only what that abort can be: an exact 400 (a 5xx, 429 or the proxy's own 502 is no band abort), to 2+ prompts
        # (n copies of one prompt are aborted together), from a server whose page is read or none scraped (below; a
        # server scraped whose page is not read yet leaves no window to mark: an entry a 400 never pruned), and
        # not where its known limit rules the abort out (SGLANG_BAND_TOKENS). Before: any error to n 2, or a batch
        # refused unrun, marked up to 31 s (a flood of them every window).
        unplaced = self.run_ons_unknown and not self.recon.server_seen
        # Streamed, a /v1/completions batch is a 200 whose one event is that abort's error, then [DONE]
        # (serving_completions.py @ 004c82e0 `_generate_completion_stream`); its response's background task aborts
        # every prompt SGLang's stream wait (RUNS_ON_AFTER_LEAVE) after its end. Before: not marked, its run unflagged.
        c = tr.counts
        streamed = (tr.status == 200 and tr.stream is True and tr.api == "openai-completions" and c is not None
                    and c.server_error is not None and SGLANG_BAND_ABORT_RE.match(c.server_error) is not None)
        # Whole, only a 400 whose message is that abort's (the proxy reads it, `proxy.error_message`): a validation
        # 400 (a prompt past the context, a bad parameter, vLLM's or llama.cpp's) ran nothing. Before: any 400, a
        # batch SGLang refused unrun marked 233 s, a vLLM bad-parameter 400 under none 3 s each.
        band = tr.status == 400 and SGLANG_BAND_ABORT_RE.match(tr.extra.get("error_message") or "") is not None
        if (self.serves_generate is False or not (self.recon.server_seen or unplaced)
                or not (band or streamed)
                or tr.api is None or not isinstance(seqs, int) or seqs // copies < 2 or tr.end_ns is None
                or (isinstance(limit, int) and limit > SGLANG_BAND_TOKENS)):
            return
        if not isinstance(limit, int) and not tr.extra.get("max_tokens_null"):
            # No limit sent: SGLang's default passes the band (/v1/completions' max_tokens 16, protocol.py @ 004c82e0
            # CompletionRequest; /generate's max_new_tokens 128, SamplingParams), so the batch was refused whole,
            # unrun; a null /v1/completions max_tokens is a validation 400, unrun. Only /generate's explicit null runs on.
            return
        # Its row names what it set off (`rowtext._batch_cause`): not charged to it, the run unproven.
        end_ns = self._batch_end_ns(tr, seqs)
        if streamed:
            # Its abort task ends every prompt then, whatever their prefill and pace: that end outright (before: the
            # sooner of it and the decode bound, 0.14 s, while the others' prefill ran to 2.03 s).
            end_ns = int(tr.end_ns) + int(RUNS_ON_AFTER_LEAVE["sglang"][0] * 1e9)
        cap_ns = int(tr.arrival_ns) + int(BATCH_SPAN_MAX_S * 1e9)
        r.batch_capped, bound_ns = end_ns > cap_ns, end_ns
        end_ns = min(end_ns, cap_ns)
        tokens = limit if isinstance(limit, int) else batch_context(tr.extra, c.server_error if streamed else
                                                                     tr.extra.get("error_message"))
        r.batch_bound = (seqs - copies, tokens, (end_ns - int(tr.arrival_ns)) / 1e9)
        if unplaced:
            # scrape.server = none: no scrape window to mark, no counter to see the work; its share goes to the
            # requests live beside it, which say so (`batch_beside_j`, UNSURE_FLAG naming scrape.server) from its
            # arrival to its bounded end (`_batch_end_ns`) and a GONE_ABORT_SLACK_S. Unsaid, the simulated SGLang's
            # null batch (248 tokens for nobody) left three streams beside it +39%, unflagged.
            r.batch_unplaced = True  # its row says so (`rowtext._no_energy_reason`)
            b0, b1 = int(tr.arrival_ns), min(end_ns + int(GONE_ABORT_SLACK_S * 1e9), int(attr.NEVER))
            over = [sp for sp in self._batch_spans if not (sp[1] < b0 or sp[0] > b1)]
            held = [b for sp in over for b in self._batch_span_batches.pop(sp[0], [sp])]
            self._batch_spans = merged_span(self._batch_spans, b0, b1)
            self._batch_span_batches[min([b0, *(sp[0] for sp in over)])] = batches_added(held, b0, b1)
            return
        # Bounded as under none (before: an explicit null or no pace marked every window until a restart).
        latest = end_ns
        r.batch_run_on = True  # its row says so (`rowtext._no_energy_reason`)
        if r.batch_capped and self.recon.server_at_finish:
            r.batch_uncounted = True
            prefill_s, pace = self._batch_timing(tr, seqs) or (0.0, BATCH_PACE_FLOOR_TOK_S)
            self._batch_uncounted[tr.request_id] = (int(tr.arrival_ns), bound_ns,
                                                    int(tr.arrival_ns) + int(prefill_s * 1e9), pace)
        latest, spans = max(int(tr.end_ns), latest), self.recon.batch_run_ons
        # Overlapping spans merged into one, as under none: before, an entry each, and the windows' check over them
        # went quadratic (5,000 400s a block: 3.6, 10.4, 22, 29.6 s of ledger CPU).
        over = [k for k, (a0, a1) in spans.items() if not (a1 < tr.arrival_ns or a0 > latest)]
        a0 = min([int(tr.arrival_ns), *(spans[k][0] for k in over)])
        a1 = max([latest, *(spans[k][1] for k in over)])
        held = [b for k in over for b in self._batch_run_on_batches.pop(k, [spans[k]])]
        for k in over:
            del spans[k]
        spans[tr.request_id] = (a0, a1)
        self._batch_run_on_batches[tr.request_id] = batches_added(held, int(tr.arrival_ns), latest)

    def _hold_uncounted_batches(self, upto_ns: int) -> None:
        """Hold a capped batch 400's span (`_batch_uncounted`) open to the latest scrape (`upto_ns`, at most its bound
        uncut) while its server, counting a request's tokens at its end (SGLang), has counted no unlisted count its
        prompts' end could be since its arrival (`batch_count_may_end`): their run goes on past BATCH_SPAN_MAX_S. Let go
        at the first resolved window from its arrival whose bypass tokens may be its prompts' end (or other bypass
        traffic's that passes for it: then as before, its rows past the cap unflagged), at a death shown since its
        arrival, at its bound, or once its span is gone (pruned).
        Before, the rows there were unflagged: a stream beside such a run 100 s past the cap read +100%; and any
        unlisted count over a token let go: a 3-token bypass request at 22 s beside a run to 35 s (cap 20 s) left the
        stream at 25-28 s +100%, unflagged. The windows and deaths are read once a call (before, per held 400: 446 ms a
        step at 5,000 held 400s over 600 windows)."""
        if not self._batch_uncounted:
            return
        spans, rc = self.recon.batch_run_ons, self.recon
        wins = [sp for sp in rc.server_spans if sp.bypass_tokens is not None and sp.bypass_tokens > LAG_TOKENS]
        t0 = np.array([sp.t0_ns for sp in wins], dtype=np.int64)
        t1 = np.array([sp.t1_ns for sp in wins], dtype=np.int64)
        tokens = np.array([sp.bypass_tokens for sp in wins], dtype=float)
        latency_s = np.array([sp.finished_latency[1] if sp.finished_latency is not None else np.nan for sp in wins],
                             dtype=float)
        # Less the proxied requests' own latencies that ended in each (`recon.finished`): a long stream's end beside a
        # 3-token bypass request is no batch's end either.
        fin = sorted((f[0], f[2] / 1e9) for f in rc.finished)
        latency_s = np.maximum(0.0, latency_s - listed_latency_s(np.array([f[0] for f in fin], dtype=np.int64),
                                                                 np.array([f[1] for f in fin], dtype=float), t0, t1))
        held_now = list(self._batch_uncounted.items())
        a0s = np.array([v[0] for _, v in held_now], dtype=np.int64)
        counted = (batch_count_may_end(a0s, np.array([v[2] for _, v in held_now], dtype=np.int64),
                                       np.array([v[3] for _, v in held_now], dtype=float), t0, t1, tokens, latency_s)
                   if wins else np.zeros(len(held_now), dtype=bool))
        # A death shown since its arrival ended its run there (`_end_run_ons_at_restart`): never held past it.
        died = max((g[0] for g in self._gone_at if self._batch_death(g)), default=None)
        if died is not None:
            counted |= a0s <= died
        keys = sorted((b0, b1, k) for k, (b0, b1) in spans.items())
        starts = [b0 for b0, _, _ in keys]
        for (rid, (a0, bound, _, _)), gone in zip(held_now, counted.tolist()):
            at = bisect.bisect_right(starts, a0) - 1  # spans are disjoint: the one starting last at or before it
            key = keys[at][2] if at >= 0 and a0 <= keys[at][1] else None
            if key is None or gone or upto_ns >= bound:
                del self._batch_uncounted[rid]
            if key is None or gone:
                continue
            end = min(upto_ns, bound)
            if end > spans[key][1]:
                spans[key] = (spans[key][0], end)
                held = self._batch_run_on_batches.get(key, [(a0, end)])
                self._batch_run_on_batches[key] = [(b0, max(b1, end) if b0 == a0 else b1) for b0, b1 in held]

    def _batch_timing(self, tr: RequestTrace, seqs: int) -> tuple[float, float] | None:
        """(its prompts' prefill's seconds, each sequence's decode pace) a batch SGLang answered 400 is taken to run at
        (`_batch_end_ns`); None where its prompts' size is unread."""
        size, context = batch_context_bound(tr.extra), batch_context(tr.extra, tr.extra.get("error_message"))
        if size is None:
            return None
        live = sum(self._live_seqs.values())  # this batch ended: not among them
        pace = (float(np.median(self._paces)) if self._paces else BATCH_PACE_FLOOR_TOK_S) / max(seqs + live, 1)
        # A prompt of the batch is at most its size and the context (`batch_context`): each rate learned taken at that
        # length (BATCH_PREFILL_CTX_SHARE), the lowest a bound.
        rate = min((r * min(1.0, (1 + BATCH_PREFILL_CTX_SHARE * ctx) / (1 + BATCH_PREFILL_CTX_SHARE * context))
                    for r, ctx in self._prefill_rates), default=BATCH_PREFILL_FLOOR_TOK_S)
        return size / rate, pace

    def _batch_end_ns(self, tr: RequestTrace, seqs: int) -> int:
        """The end a batch SGLang answered 400 is taken to run its other prompts within (`_batch_run_on`; not a proof),
        from its arrival: its
        prompts' prefill (their size, `batch_context_bound`, at the lowest rate the latest streams' time to first token
        showed, `prefill_rate_shown`, each taken at the length its prompts may have, BATCH_PREFILL_CTX_SHARE, else
        BATCH_PREFILL_FLOOR_TOK_S), then its max_tokens (an
        explicit null: to the context's end, its scheduler's min(1 << 30, max_req_len - prompt - 1), scheduler.py
        `init_req_max_new_tokens`; at most `batch_context`) at a pace taken as a bound under load: the server's
        latest streams' pace (else BATCH_PACE_FLOOR_TOK_S) shared by the batch's sequences and every sequence live now.
        A stream's pace, learned with m sequences live, is at most the server's aggregate rate then, and that rate does
        not fall as sequences join, so each of n decodes at least at pace / n. Before: twice the limit at the learned
        pace alone, no prefill: a null batch beside 30 streams was marked to 9.8 s and ran to 13.4 s, 24 prompts of
        1,500 tokens prefilled to 2.25 s behind a span of 0.14 s. attr.NEVER where its prompts' size is unread."""
        limit = tr.extra.get("max_tokens")
        if not isinstance(limit, int):
            limit = batch_context(tr.extra, tr.extra.get("error_message"))
        timing = self._batch_timing(tr, seqs)
        if timing is None or limit is None:
            return int(attr.NEVER)
        span_s = timing[0] + limit / timing[1]
        return min(int(tr.arrival_ns) + int(span_s * 1e9), int(attr.NEVER))

    def _unplaced(self, r: LiveRequest, limit) -> None:
        """A request whose client left a server of unknown kind (`run_ons_unknown`): it may have run on for nobody, its
        work then in the shares of the requests beside it. The intervals from its leave to the latest end any server
        that runs on gives it, plus GONE_ABORT_SLACK_S, mark their requests (`LiveRequest.unplaced_beside_j`): SGLang a
        stream 2 s after, a whole answer at its next 4 s wait; a whole answer may run on to its end (llama-server
        before the fix of ggml-org/llama.cpp#9273 and in the #24496 regression, ik_llama.cpp before its #1134, other
        servers), bounded by its max_tokens at half the latest streams' pace (uncapped: this holds nothing, it only
        marks), and with no max_tokens or no pace unbounded. Recent llama-server builds cancel it at the first quiet
        second (server-queue.cpp `recv_with_timeout`), but with the kind and build unknown that end is not taken:
        taken, the old llama.cpp scene (tests/test_daemon_cut_streams.py) left the rows 5-11 s after the leave
        +29..+70%, unflagged. Before, the span was capped at RUN_ON_TO_END_MAX_S: a whole answer run on 50 s beside a
        stream a second left the rows 34-56 s after its leave +64..+144%, unflagged."""
        if r.run_on_unplaced:
            return
        tr = r.trace
        stream_s, wait_s = RUNS_ON_AFTER_LEAVE["sglang"]
        r.run_on_unplaced = True
        slack_ns, end_ns = int(GONE_ABORT_SLACK_S * 1e9), int(tr.end_ns)
        if tr.stream is True:
            latest = end_ns + int(stream_s * 1e9) + slack_ns
        else:
            latest = int(attr.NEVER)  # no max_tokens (to the context's end, unknown here) or no pace: no end known
            if isinstance(limit, int) and limit > 0 and self._paces:
                span_s = max(2.0 * limit / float(np.median(self._paces)), wait_s)
                latest = min(end_ns + int(span_s * 1e9) + slack_ns, int(attr.NEVER))
        if not any(a0 <= end_ns and latest <= a1 for a0, a1 in self._unplaced_spans):  # one unbounded span, not many
            self._unplaced_spans.append((end_ns, latest))

    def _keep_context(self, response_id: str, tokens: int) -> None:
        """A Responses answer's conversation length (`response_context`), the least recently used dropped past the cap."""
        ctx = self.response_context
        ctx[response_id] = tokens
        ctx.move_to_end(response_id)
        while len(ctx) > RESPONSE_CONTEXT_KEEP:
            self.context_tools_unsure.pop(ctx.popitem(last=False)[0], None)

    def _tools_rendered(self, api: str, chars: int, tools_chars: int, tokens: float) -> bool | None:
        """Whether this server renders tools sent with tool_choice "none", from its tally of clear judgments
        (`tools_when_none`), this counted prompt's (`tokens`, its body `chars` with `tools_chars` such) added: clear
        where its count lies near one reading and not the other, at the ratio learned from prompts without such tools
        (without: within its spread; with: from half the tools' tokens to twice them, and the spread), the tools'
        tokens over twice that spread (a dense prompt with tiny tools, 6001 tokens for
        338 characters of tools, flipped the latest-wins verdict). None: undecided."""
        spread = self.plain_lengths.spread(api)
        if spread is not None:
            with_ = self.plain_lengths.estimate(api, chars, None)[0]
            without = self.plain_lengths.estimate(api, max(chars - tools_chars, 0), None)[0]
            tools = with_ - without  # at the prose ratio: a schema's JSON takes more (the simulator's vLLM 0.32 for 0.2)
            near_with = without + 0.5 * tools <= tokens <= with_ + tools + spread * with_
            near_without = abs(tokens - without) <= spread * without
            if tools > 2.0 * spread * with_ and near_with != near_without:
                self.tools_none_tally.setdefault(api, [0, 0])[0 if near_with else 1] += 1
        yes, no = self.tools_none_tally.get(api, (0, 0))
        rendered = True if yes >= 3 * no and yes else False if no >= 3 * yes and no else None
        if rendered is None:
            self.tools_when_none.pop(api, None)
        else:
            self.tools_when_none[api] = rendered
        return rendered

    def _body_estimate(self, tr: RequestTrace) -> tuple[float, str] | None:
        """(tokens, how) of a prompt from its body (PromptLengths.estimate); for a Responses turn naming a previous
        one whose answer passed through here, that conversation's counted tokens plus its own input's estimate: the
        server prefills both. None: no size. Tools sent with tool_choice "none" are left out where this server's
        counted prompts showed it renders none (`tools_when_none`), counted and said where none showed yet."""
        x = tr.extra
        maybe = x.get("prompt_tools_none_chars") or 0
        rendered = self.tools_when_none.get(tr.api) if maybe else True
        less = 0 if rendered is not False else maybe
        tally = tuple(self.tools_none_tally.get(tr.api, (0, 0)))
        chars, new_chars = x.get("prompt_chars"), x.get("prompt_new_chars")
        est = self.prompt_lengths.estimate(tr.api, None if chars is None else chars - less, x.get("prompt_ids"),
                                           x.get("prompt_count", 1))
        if est is not None:
            alt = self.prompt_lengths.estimate(tr.api, chars - (maybe - less), x.get("prompt_ids"),
                                               x.get("prompt_count", 1)) if maybe and chars is not None else None
            est = (est[0], est[1] + _tools_none_words(maybe, rendered, None if alt is None else alt[0], tally))
        prev = x.get("prev_response_id")
        if est is not None or prev is None or prev not in self.response_context:
            return est
        self.response_context.move_to_end(prev)
        ctx = self.response_context[prev]
        new = self.prompt_lengths.estimate(tr.api, None if new_chars is None else new_chars - less, None)
        if new is None:
            return None
        alt = self.prompt_lengths.estimate(tr.api, new_chars - (maybe - less), None) if maybe else None
        new = (new[0], new[1] + _tools_none_words(maybe, rendered, None if alt is None else ctx + alt[0], tally))
        unsure = self.context_tools_unsure.get(prev)
        if unsure is not None:
            new = (new[0], new[1] + (f"; its previous turn's `tools` sent with tool_choice \"none\" "
                                     f"(about {unsure} tokens) were taken out of that conversation, though this server "
                                     f"may or may not have "
                                     f"rendered them (its counted prompts have not shown which): {ctx + unsure + new[0]:.0f}"
                                     f" if not; fix: send no `tools` with tool_choice \"none\""))
        return ctx + new[0], (f"the {ctx} tokens of its previous response's conversation (its prompt less its tools and instructions, and its "
                              f"output less its thinking and function calls, as the server counted them through this proxy) "
                              f"and {new[1]}")

    def _prefill_end_est_ns(self, r: LiveRequest) -> int | None:
        """When its prompt's prefill ends if it ran from its arrival at the rate in use: its prompt the server's count,
        else its body's estimate (None: neither)."""
        tr = r.trace
        prompt = told_prompt_tokens(r)
        if prompt is None:
            est = self._body_estimate(tr)
            if est is None:
                return None
            prompt = est[0]
        costs = self.learner.costs(self.edges[-1].setting) if self.edges else attr.WorkCosts()
        return tr.arrival_ns + int(prompt / max(costs.prefill_tok_s, attr.PREFILL_TOK_S_SLOW) * 1e9)

    def _place_run_ons(self, known_ns: int | None, force_ns: int | None = None) -> None:
        """Place the run-on of each stream whose client left (`_run_on`) once the proxy has seen the streams beside it
        up to its abort (`known_ns`; None: all there is, at shutdown), or held since before `force_ns` (a bound), at its
        batch's pace over that run (`_batch_pace`); with no stream beside it then, at its own pace, or where it showed one
        token, the median of the server's latest streams'. Its own pace, read over the tokens it showed, ran ahead of the
        batch it decoded in once other prompts' prefills joined it: on the simulator's SGLang (`cut_accuracy`) streams
        cut after 41 tokens read +38% to +76%, their run-on's tokens now within 4% of the truth's."""
        for r in list(self.requests.values()):
            start, tr = r.run_on_from_ns, r.trace
            if start is None or not (known_ns is None or r.run_on_end_ns <= known_ns
                                     or force_ns is not None and start <= force_ns):
                continue
            r.run_on_from_ns = None
            seqs = max(tr.extra.get("sequences", 1), 1)
            n = (r.spent + float(sum(r.ev_n)) + r.late) / seqs
            batch = self._batch_pace(r, start, r.run_on_end_ns if known_ns is None else min(r.run_on_end_ns, known_ns))
            if batch is not None:
                self._place_run_on(r, start, batch[0] * seqs, f"its batch's (the {batch[1]} streams shown beside it then)")
            elif n >= 2 and tr.last_ns > tr.first_ns:
                self._place_run_on(r, start, (n - 1) / ((tr.last_ns - tr.first_ns) / 1e9) * seqs,
                                   "its own (no stream shown beside it then)")
            elif self._paces:  # one token: no gap to read its own pace from
                self._place_run_on(r, start, float(np.median(self._paces)) * seqs,
                                   f"the median of the server's latest {len(self._paces)} streams'")

    def _batch_pace(self, r: LiveRequest, t0_ns: int, t1_ns: int) -> tuple[float, int] | None:
        """The pace (tokens a second a sequence) of the batch r decoded in over [t0_ns, t1_ns], and how many streams it
        was read from: the tokens the other streams showed in it over the seconds each was shown there, each one's from
        its first chunk there to its last (a continuous batch's step gives each of its sequences one token), a stream with
        fewer than two chunks there left out; None where they showed fewer than RUN_ON_PACE_TOKENS. Counted over the
        window's bounds, a stream's one chunk there (a mass cut: every stream's client gone at once; streams finishing
        at the cut's step) read as a step's token over the microseconds between two streams' chunks of that step, at
        thousands a second: 16 streams cut together mid-step, 8 rows "until its max_tokens (2000) were decoded" (41 + 80
        the truth; now 121 each, +2.9%), a stream cut as the 12 beside it ended -62.5% (now +1.5%)."""
        first_open = self.edges[0].t_ns if self.edges else t0_ns  # events before it are spent (closed)
        tokens = seconds = 0.0
        k = 0
        for q in self.requests.values():
            tq = q.trace
            if (q is r or tq.stream is not True or tq.api is None or tq.first_ns is None or tq.last_ns is None
                    or is_passive(q)):
                continue
            a = max(t0_ns, first_open, q.placed_from_ns if q.placed_from_ns is not None else tq.first_ns)
            b = min(t1_ns, tq.last_ns)  # shown tokens only: not a run-on placed past them
            if b <= a:
                continue
            i, j = bisect.bisect_right(q.ev_t, a), bisect.bisect_right(q.ev_t, b)
            if j - i < 2:  # one chunk: no gap there to read a pace from
                continue
            tokens += float(sum(q.ev_n[i + 1:j])) / max(tq.extra.get("sequences", 1), 1)
            seconds += (q.ev_t[j - 1] - q.ev_t[i]) / 1e9
            k += 1
        return (tokens / seconds, k) if tokens >= RUN_ON_PACE_TOKENS and seconds > 0 else None

    def _place_run_on(self, r: LiveRequest, start_ns: int, tok_s: float, whose: str) -> None:
        """Token events at `tok_s` from `start_ns` to its run-on's end, no more than its max_tokens leave, straight into
        its events (not `_place`: no scrape window lists them, but SGLang's sure run to its max_tokens, a length finish
        it counts; SGLang counts none of an aborted one, llama.cpp those of a whole answer's run to its end, read as
        bypass tokens: docs/daemon.md, a known gap)."""
        seqs = max(r.trace.extra.get("sequences", 1), 1)
        span_ns = r.run_on_end_ns - start_ns
        abort_ns = r.run_on_end_ns  # the latest it ran to, whatever its real pace (a cap below is at the estimated one)
        n = to_abort = tok_s * span_ns / 1e9
        limit = r.trace.extra.get("max_tokens")
        # Capped where its max_tokens leave fewer than its pace decodes to the abort: not where the span, rounded back
        # from the tokens to the nanosecond, comes 1 ns short (half such runs said "until its max_tokens were decoded").
        capped, left = False, np.inf
        shown = r.spent + float(sum(r.ev_n)) + r.late
        if isinstance(limit, (int, float)) and limit > 0:
            left = max(float(limit) * seqs - shown, 0.0)
            capped, n = left < n, min(n, left)
        if span_ns <= 0 or n <= 0:
            return
        if not r.run_on_to_end and not r.run_on_crash:
            # SGLang's abort (or its max_tokens) is the most it ran on: an answer that can end by itself (its end of
            # text, a stop) may have ended sooner, unseen (SGLang then counts it whole at its end; the proxy sees none
            # of it). Placed to the abort, 4 streams cut after 5 tokens beside 24 that ended by themselves after 16-63
            # were placed 62-65 run-on tokens for the simulator's 36-50, unflagged; placed at the latest streams' mean,
            # a stream that could not end (ignore_eos, min_tokens) was -33% to -49%. Its own body says which: still
            # placed at the most, its row says both readings, flagged uncertain (rowtext), where its body lets it end.
            # Its min_tokens rule that out only past what a pace RUN_ON_MAY_END_PACE_MARGIN above the estimate decodes
            # to the abort, or at its max_tokens (then a length finish, not its own end): a margin on the pace alone.
            least = max(float(r.trace.extra.get("min_tokens", 0)) * seqs - shown, 0.0)
            reach = min(to_abort * (1.0 + RUN_ON_MAY_END_PACE_MARGIN), left)
            if not r.trace.extra.get("eos_ignored") and least < reach:
                r.run_on_may_end = least
        k = max(1, min(SPREAD_EVENTS, int(np.ceil(n))))
        if capped:  # at its pace: a max_tokens reached stops it before the abort
            span_ns = min(span_ns, int(n / tok_s * 1e9))
        # Each event 1 ns before the end of its share of the run: the last one at the run's end fell in the interval
        # after it, where the close holding its end (on that close's last edge: a crash's close, the stop's last sample)
        # has none, lost unsaid: a crash's decode placed to 20.0 s counted 768 of its 780 tokens (attributed and late).
        ts = [max(int(start_ns + span_ns * (j + 1) / k) - 1, start_ns) for j in range(k)]
        floor = self.edges[0].t_ns if self.edges else None
        if floor is not None and ts[0] < floor:
            # Before an interval already closed (a whole answer crashed 19.5 s in, its first intervals closed under
            # the holds' caps): not placeable, counted late as on_tokens counts them. Dropped before, its row said 780
            # tokens "counted" in its attributed 390.
            lost = n / k * sum(t < floor for t in ts)
            r.late += lost
            self.late_tokens += lost
            r.run_on_late += lost
            ts = [t for t in ts if t >= floor]
        r.ev_t.extend(ts)
        r.ev_n.extend([n / k] * len(ts))
        if r.run_on_crash and self.recon.server_seen and not self.recon.server_at_finish:
            # A whole answer its server died with: a server counting tokens as they come (llama.cpp's /slots, vLLM's
            # counter) had counted its decode up to its last scrape (the rest lost with the old process, as any
            # proxied token's there): listed, not read as bypass tokens. Unlisted, two such answers on the simulated
            # llama.cpp were 96-103 J each for 146-148 J of truth, 235 of their tokens read as bypass (158 J unproxied).
            # SGLang counts a request at its end, which never came: listed, its tokens would hide bypass traffic.
            self.recon.proxied.extend(zip(ts, [n / k] * k))
        sure = r.run_on_may_end is None and (r.trace.extra.get("eos_ignored") or r.trace.extra.get("min_tokens"))
        if ts and capped and sure and n <= RUN_ON_CAPPED_SURE_SHARE * to_abort and not r.run_on_to_end \
                and not r.run_on_crash and self.recon.server_seen and self.recon.server_at_finish:
            # Its max_tokens reached well before the abort: SGLang finished it (a length finish) and counted it whole
            # there. Unlisted, its run-on read as bypass tokens besides being placed here (review's scene, 4 streams
            # cut after 5 chunks with ignore_eos and max_tokens 40 beside 16: 142 bypass tokens read where none ran,
            # 315-319 J unproxied, the 16 -11%). Not one that may have ended by itself, nor one near its abort: aborted,
            # SGLang counts it nowhere, and listed it would hide bypass traffic (16f65a29, reverted). Not one placed
            # wholly before an interval already closed (counted late above): nothing left to list it at (IndexError).
            r.run_on_listed = (ts[-1], n, max(0, ts[-1] - r.trace.arrival_ns))
            self.recon.finished.append(r.run_on_listed)
        r.run_on_tokens, r.run_on_pace = n, whose
        if capped:  # its max_tokens, reached at its pace, ended it before the abort: live no longer
            r.run_on_end_ns, r.run_on_capped = max(start_ns + span_ns, r.trace.end_ns), True
        rid = r.trace.request_id
        if rid in self._placed_slots_end:  # its placed tokens' end (the last event 1 ns before it)
            self._placed_end[rid] = int(r.run_on_end_ns) if capped else int(abort_ns)
            self._cut_placed_span(rid)
        if r.run_on_may_end is None:
            self.recon.run_ons_may_end.pop(rid, None)  # its body rules an end by itself out (`_run_on`)
        elif rid in self.recon.run_ons_may_end:
            # To the abort, not to its max_tokens' end at the estimated pace: a slower real pace ends it there later (a
            # length finish, counted then, unlisted: it may have ended sooner), up to the abort. Marked to the capped
            # end, a finish 1.45 s after it read as 30 bypass tokens in windows saying complete.
            self.recon.run_ons_may_end[rid] = (self.recon.run_ons_may_end[rid][0], int(abort_ns))

    def tokens_at_first(self, request_id: int, generated: float) -> float | None:
        """The tokens (in `generated`'s count) its stream had shown at its first piece, for a time per output token over
        the rest: 1 for a stream that came as it went (the usual TPOT). For one that came in several bursts
        (`_held_burst`), its first piece's, where the pieces after it were small (at most FIRST_BURST_TOKENS a sequence
        on average) and the first was no held burst itself: a slow server whose reads merge two tokens every 300 ms
        (each such piece's tokens generated since the piece before, so that pace is the server's; with no TPOT the
        latency guard went blind exactly where TPOT was bad: 30 of 640 rows had one, at 15 ms, where the client saw 312).
        None where the pieces cannot tell the server's pace: one burst (its times are the burst's microseconds), a first
        piece held itself, or large pieces (one held body read in parts 150 ms apart gave 0.75 ms for 20). A stream
        counted one token a chunk and set to the server's count at its end has its first piece scaled to that count (8
        tokens a chunk read 4.2 ms for 18.75)."""
        r = self.requests.get(request_id)
        if r is None or (r.burst_s is None and r.bursts == 0):
            return 1.0
        seqs = max(r.trace.extra.get("sequences", 1), 1)
        seen = float(r.trace.tokens_seen)
        after = seen - r.first_piece_n
        if (r.burst_s is not None or r.first_held or r.first_piece_n <= 0 or r.pieces < 2 or after <= 0
                or after / (r.pieces - 1) > FIRST_BURST_TOKENS * seqs):
            return None
        return r.first_piece_n * (generated / seen if generated and seen > 0 else 1.0)

    def _placed_at_end(self, r: LiveRequest) -> float:
        """on_end's placing of the tokens only the end tells (usage, a non-streamed body); returns on_end's figure."""
        trace = r.trace
        c = trace.counts
        self._spread_burst(r)
        if c is not None and c.prompt_tokens is not None and c.invalid is None and c.count_problem is None:
            # The body's prompt once: llama.cpp's figure of n choices is n copies of it (n = 2 taught twice the tokens a character).
            copies = max(trace.extra.get("choices", 1), 1) if c.prompt_each_task else 1
            chars, maybe = trace.extra.get("prompt_chars"), trace.extra.get("prompt_tools_none_chars") or 0
            # Tools sent with tool_choice "none": learned from as the server rendered them, or not (before, always
            # as characters of its prompt: SGLang's ratio fell, 0.144 tokens a character for 0.2).
            rendered = True if not maybe else self.tools_when_none.get(trace.api) if chars is None else \
                self._tools_rendered(trace.api, chars, maybe, c.prompt_tokens / copies)  # a stateful turn: not judged
            less = maybe if rendered is False else 0
            if not maybe:
                self.plain_lengths.learn(trace.api, chars, c.prompt_tokens / copies,
                                         trace.extra.get("prompt_count", 1), trace.extra.get("prompt_ids"))
            if rendered is not None:  # undecided: its size is not known, nor learned from
                self.prompt_lengths.learn(trace.api, None if chars is None else chars - less, c.prompt_tokens / copies,
                                          trace.extra.get("prompt_count", 1), trace.extra.get("prompt_ids"))
            if c.response_id is not None and trace.api == "openai-responses" and (trace.status or 200) < 400:
                # Less the part a later turn does not prefill again (promptlen.uncarried_chars: its tools, rendered
                # anew from that turn's own body, and its instructions), at the learned tokens a character; and its
                # thinking's tokens and its function calls (vLLM's construct_input_messages adds only the stored
                # output's messages): where its output held a call, its messages' text at the learned ratio.
                per_char = self.prompt_lengths.per_char(trace.api)
                gone = max(trace.extra.get("prompt_uncarried_chars", 0) - less, 0) * per_char
                out = max(c.generated_tokens or 0, 0)
                said = out - min(max(c.reasoning_tokens or 0, 0), out)
                if c.carried_chars is not None:
                    said = min(said, round(c.carried_chars * per_char))
                self._keep_context(c.response_id, max(round(c.prompt_tokens - gone), 0) + said)
                if rendered is None:  # taken out, though they may never have been in its count
                    self.context_tools_unsure[c.response_id] = round(maybe * per_char)
                else:
                    self.context_tools_unsure.pop(c.response_id, None)
        # Not to a count that contradicts the stream (count_problem): it cannot be believed.
        # A stream with no counted chunk at all is not "estimated", but its usage's tokens need placing too.
        none_seen = not trace.tokens_seen and not r.ev_n and not r.spent and trace.stream is True
        if (c is not None and (c.tokens_estimated or none_seen) and c.token_source in ("usage", "timings") and c.invalid is None
                and c.count_problem is None and c.generated_tokens and not trace.extra.get("spread")):
            return self._to_server_count(r, float(c.generated_tokens))
        if (c is not None and trace.stream is True and c.token_source == "usage" and not c.tokens_estimated
                and c.invalid is None and c.count_problem is None and c.generated_tokens
                and trace.last_ns is not None and trace.end_ns is not None):
            # Its believed final count is above the tokens its chunks carried: tokens the server generated after its
            # last chunk and sent in none. A tool call its parser held, cut by max_tokens (held_tail:
            # arrival.held_call_at_limit); within COUNT_SLACK_TOKENS, a self-closing call's trailing tokens or
            # SGLang's end-of-text token, which has no text. Spread from that chunk to the end, over which they were
            # decoded; left out, the server's counter gave them and their energy to `unproxied` (a natural stop's
            # 3 trailing tokens of 25: 6-9 J of ~51 J, with no bypass traffic).
            surplus = float(c.generated_tokens) - float(trace.tokens_seen)
            if 0 < surplus and (c.held_tail or surplus <= COUNT_SLACK_TOKENS):
                # To the upstream's end (proxy._held_end), not the client's: a slow reader's end is past the server's.
                # An end no later than the last chunk (the usage read with it): there.
                end = max(min(trace.extra.get("held_end_ns", trace.end_ns), trace.end_ns), trace.last_ns)
                step = (end - trace.last_ns) / SPREAD_EVENTS
                ts = [int(trace.last_ns + step * (k + 1)) for k in range(SPREAD_EVENTS)]
                self._place(r, ts, [surplus / SPREAD_EVENTS] * SPREAD_EVENTS)
                if not c.held_tail and self.recon.server_seen:
                    # Believed on the usage's word alone: right where the server's counter counted them too (SGLang's
                    # end-of-text token), but a usage that says more than the counter counted hid as many bypass
                    # tokens behind them, rows `complete` (1-token streams whose usage said 4, every 0.1 s: 30
                    # bypass tokens/s read as 0). Kept apart so the windows where they weigh say so. An at-finish
                    # counter's windows hold them where on_end puts the request (its last event).
                    self.recon.slack.extend([(ts[-1], surplus)] if self.recon.server_at_finish
                                       else zip(ts, [surplus / SPREAD_EVENTS] * SPREAD_EVENTS))
                # Only a held tail's timing is inference worth its note: a few trailing tokens end the stream.
                r.held_tail_n = surplus if c.held_tail else 0.0
                return surplus
        if trace.extra.get("spread") and trace.first_ns is not None and trace.last_ns is not None:
            # A non-streamed body arrives at once: assume its tokens came evenly over its decode time.
            n = float(trace.tokens_seen)
            cut = self._restart_cut_ns(r)
            if cut is not None and trace.last_ns > cut:
                # Read after the first scrape after a restart (a stalled proxy worker): the old process decoded it and
                # died before that scrape, its decode time ending there at the latest. Spread up to its read, it took
                # the new process's windows (hiding their bypass tokens) and left the old one's rise as bypass tokens
                # that never ran (225 with llama.cpp's timings, rows `complete`). Its decode moved back to end there,
                # at the old process's pace (`_at_server_pace`, which cuts there too).
                start = max(trace.arrival_ns, trace.first_ns - (trace.last_ns - cut))
                ts = self._at_server_pace(r, start, cut, spread_events(start, cut), n)
            else:
                self.recon.note_unsure(r, trace.last_ns)
                first = self._whole_answer_first_ns(r)
                if first != trace.first_ns:
                    r.placed_from_ns = first  # its prompt ends, and its decode starts, there (not its row's TTFT)
                # Each event at the middle of its equal share of the decode: one at its last instant, its end, fell in
                # no interval (the request is live to its end, not at it), its tokens lost (2 of 780 at 50 ms apart).
                k = spread_events(first, trace.last_ns)
                ts = (first + (np.arange(k) + 0.5) * ((trace.last_ns - first) / k)).astype(np.int64).tolist()
            r.ev_t, r.ev_n = [], []
            ns = [n / len(ts)] * len(ts)
            self._place(r, ts, ns)
            if c is not None and c.token_source in ("usage", "timings") and c.invalid is None \
                    and c.count_problem is None:
                # A whole answer's count is the server's word alone: only its counter checks it.
                self.recon.note_usage_only(r, ts, ns, n, 0.0)
        return 0.0

    def _whole_answer_first_ns(self, r: LiveRequest) -> int:
        """Where a non-streamed answer's first token most likely came, which its prompt's prefill ends at and its decode
        starts from: the server's decode time back from its end where its timings say it (llama.cpp: the proxy's
        `first_ns` past its arrival), else (vLLM, SGLang: no timings, `first_ns` is its arrival) its arrival plus its
        computed prompt at the prefill rate, and its end for an answer of one token a sequence (that token is the
        prefill's output), never past its last token. A prompt cannot be computed before its request arrives: placed
        ending at the arrival, it fell in the interval the daemon's arrival edge (read just after it) closes, the run
        of the request before, whose energy it took (the simulated vLLM, 1-3-token answers each alone: 20 of 50 rows
        off 10-74%, silent; docs/daemon.md)."""
        tr = r.trace
        if tr.first_ns is None or tr.last_ns is None or tr.first_ns > tr.arrival_ns:
            return tr.first_ns if tr.first_ns is not None else tr.arrival_ns
        last = max(int(tr.last_ns), tr.arrival_ns)
        if float(tr.tokens_seen) <= max(tr.extra.get("sequences", 1), 1):
            return last
        computed = max(self._prompt_work(r, True) - _prefill_cached(r), 0.0)
        rate = self.learner.costs(self.edges[-1].setting if self.edges else self._setting).prefill_tok_s
        return min(tr.arrival_ns + int(computed / max(rate, 1e-9) * 1e9), last)

    def _spread_burst(self, r: LiveRequest) -> None:
        """A stream whose tokens all reached the proxy in one delivery (chunks under SAME_DELIVERY_NS apart) was held
        back on its way (a buffering proxy or gateway between the server and this one): the server generated them
        over its run, not at the instant they passed. They are spread evenly over it, as a non-streamed answer's
        (from the server's decode time where its timings say it, else from its arrival), and its prompt is placed
        before that. Left at the burst, they took no energy of the intervals the request ran in, and the server's
        counter, ahead of the proxy's all that while, gave them to `unproxied` as bypass traffic (docs/daemon.md).
        More tokens than sequences only: each sequence's first token comes out of the prefill, together."""
        tr = r.trace
        if r.bursts:
            self._first_burst(r)
            return
        if tr.stream is not True or tr.api is None or r.spent or r.late or not r.ev_t:
            return
        n = float(sum(r.ev_n))
        # One delivery as the proxy saw it (each piece came while the previous one was being handled), else, where it
        # does not say, as the stamps say (chunks under SAME_DELIVERY_NS apart).
        deliveries = tr.extra.get("deliveries")
        apart = deliveries > 1 if isinstance(deliveries, int) else max(np.diff(r.ev_t), default=0) > SAME_DELIVERY_NS
        if apart and r.first_held and not r.spent and not r.late:
            # Its first piece was a burst (`FIRST_BURST_TOKENS`), the rest came in pieces too close to it to be taken
            # for later bursts (a hop's timer flush, then the end): its first burst is placed back, and said.
            r.first_burst_end_ns, r.bursts = int(r.ev_t[0]), 1
            r.held_s = max(r.held_s, (int(r.ev_t[-1]) - int(r.ev_t[0])) / 1e9)
            self._first_burst(r)
            return
        if n <= max(tr.extra.get("sequences", 1), 1) or apart:
            return
        t1 = int(r.ev_t[-1])
        start = self._decode_start(r, t1)
        if t1 - start <= SAME_DELIVERY_NS:
            return  # nothing to move
        k = int(min(spread_events(start, t1), max(2, n)))  # no more events than tokens, as `_first_burst`'s
        ts = self._at_server_pace(r, start, t1, k, n)
        if self.recon.server_seen:  # the scrape windows' proxied tokens move with them
            self.recon.proxied.extend((t, -x) for t, x in zip(r.ev_t, r.ev_n))
            self.recon.proxied.extend((t, n / k) for t in ts)
        r.ev_t, r.ev_n = self._open_only(r, ts, [n / k] * k)
        r.placed_from_ns = start
        r.burst_s = (t1 - tr.arrival_ns) / 1e9
        self._burst_said(r, n)

    def _open_only(self, r: LiveRequest, ts: list[int], ns: list[float]) -> tuple[list[int], list[float]]:
        """Of an end's re-placing of `r`'s tokens (`_spread_burst`, `_first_burst`), the events in open intervals; those
        before the first (put back to a restart's cut, `_at_server_pace`, after the intervals there closed) are late, as
        `_place` makes them: counted on its row, in no interval's energy. Kept in its events, they were spent with the
        next close outside every interval: in no energy, not late, its row silent (40 of 40 tokens, the ledger's test)."""
        floor = self.edges[0].t_ns if self.edges else None
        if floor is None or not ts or ts[0] >= floor:
            return ts, ns
        j = int(np.searchsorted(ts, floor))
        gone = float(sum(ns[:j]))
        r.late += gone
        self.late_tokens += gone
        return ts[j:], ns[j:]

    def _decode_start(self, r: LiveRequest, t1: int) -> int:
        """Where a held-back stream's decode began: from the server's decode time where its timings say it (they end
        at its last token, `t1`), else its arrival; never in intervals already closed (their accounts are done: the
        seconds cut so are said on its row, `closed_s`)."""
        tr, c = r.trace, r.trace.counts
        start = tr.arrival_ns
        if c is not None and c.predicted_ms is not None and c.predicted_ms >= 0 and c.count_problem is None:
            start = max(start, t1 - int(c.predicted_ms * 1e6))
        if self.edges and self.edges[0].t_ns > start:
            r.closed_s += (self.edges[0].t_ns - start) / 1e9
            start = self.edges[0].t_ns
        return start

    def _first_burst(self, r: LiveRequest) -> None:
        """A stream that came in several bursts, at its end: its later bursts were placed as they came
        (`_held_burst`); its first burst's tokens, held since its decode began, are placed from there."""
        tr = r.trace
        seqs = max(tr.extra.get("sequences", 1), 1)
        cut = r.first_burst_end_ns
        m = sum(1 for t in r.ev_t if t <= cut) if cut is not None else 0
        n1 = float(sum(r.ev_n[:m]))
        if m and n1 > seqs and not r.spent and not r.late:
            # The server's decode time ends at the stream's last token, not the first burst's: anchored there, the
            # start fell that much early, was clipped to the arrival, and the burst was spread over queue and prefill.
            last = tr.last_ns if tr.last_ns is not None else int(r.ev_t[-1])
            start = self._decode_start(r, int(last))
            if r.ev_t[m - 1] - start > SAME_DELIVERY_NS:
                k = int(min(spread_events(start, int(r.ev_t[m - 1])), max(2, n1)))
                ts = self._at_server_pace(r, start, int(r.ev_t[m - 1]), k, n1)
                if self.recon.server_seen:
                    self.recon.proxied.extend((t, -x) for t, x in zip(r.ev_t[:m], r.ev_n[:m]))
                    self.recon.proxied.extend((t, n1 / k) for t in ts)
                r.ev_t[:m], r.ev_n[:m] = self._open_only(r, ts, [n1 / k] * k)
                r.placed_from_ns = start
                # Held from there to its last piece: its hold too, which the busy-host cause is judged against
                # (`_burst_said`). Left at the gaps between its later pieces (50 ms after a 2.5 s first burst), a proxy
                # loop 30 ms late was said to explain it, the host's fix first, and the row said "up to 0.1 s apart".
                r.held_s = max(r.held_s, (cut - start) / 1e9)
        self._burst_said(r, r.spent + float(sum(r.ev_n)))

    def _burst_said(self, r: LiveRequest, n: float) -> None:
        """Counted, and logged the first time and every 1000th: a stream held back on its way."""
        tr = r.trace
        self.burst_requests += 1
        late = self._own_late_s(r)
        r.own_late_s = late if late >= OWN_LATE_SHARE * (r.held_s if r.bursts else (r.burst_s or 0.0)) else 0.0
        why = ("something between the server and the proxy buffers its streams, or the proxy read them late itself (its "
               f"event loop ran up to {_secs(r.own_late_s)} late meanwhile: a busy host)" if r.own_late_s else
               "something between the server and the proxy buffers its streams, a busy host ran the server or the "
               "proxy late, or a busy server sent several steps' tokens at once")
        fix = _burst_fix(r)
        if client_held(r):
            why = (f"its own client read it slower than the server sent it (the proxy's writes to it waited "
                   f"{_secs(tr.extra.get('client_held_s', 0.0))}, and the proxy stopped reading the server meanwhile)")
            fix = "nothing to fix for its energy: its TTFT and decode_s are its client's reading pace"
        if r.bursts and _parser_held(r):
            pass  # the server's parser's hold (its row says so): no hop to warn of
        elif r.bursts and (self.burst_requests == 1 or self.burst_requests % 1000 == 0):
            log.warning("request %d: its %.0f tokens reached the proxy in %d bursts, up to %.1f s apart: %s; each "
                        "burst's are spread over the time before it and its row says so in energy_note (%d such "
                        "requests so far; %s)", tr.request_id, n, r.bursts + 1, r.held_s, why, self.burst_requests, fix)
        elif self.burst_requests == 1 or self.burst_requests % 1000 == 0:
            log.warning("request %d: its %.0f tokens reached the proxy in one burst %.1f s after its arrival: %s; they "
                        "are spread over its run and its row says so in energy_note (%d such requests so far; %s)",
                        tr.request_id, n, r.burst_s, why, self.burst_requests, fix)

    def _own_late_s(self, r: LiveRequest) -> float:
        """The most the proxy's own event loop was measured late (`note_proxy_delay`) while `r` streamed: a measure at t
        of d says the loop stood still over [t - d, t], so those that overlap its arrival to its last piece count."""
        tr = r.trace
        last = tr.last_ns if tr.last_ns is not None else (int(r.ev_t[-1]) if r.ev_t else tr.arrival_ns)
        most = 0.0
        for t, d in reversed(self.recon.delays):
            if t < tr.arrival_ns:
                break
            if t - d * 1e9 <= last:
                most = max(most, d)
        return most

    def _at_server_pace(self, r: LiveRequest, start: int, t1: int, k: int, n: float | None = None) -> list[int]:
        """`k` instants from `start` to `t1`, each standing for an equal share of `r`'s `n` tokens, as dense as the server
        gave each sequence tokens: a continuous-batching server gives every running sequence one token a step, so in
        each scrape window a sequence got (the server's count) / (the sequences running) tokens. The running ones are
        the proxy's: streams between their first and last token, bursts over their spread, live requests that have
        shown no token from their arrival; the server's count less the bypass tokens, below. Evenly spread,
        an answer decoded alone, then beside 30 others, then alone got too few tokens where it ran alone: the server's
        counter rose beyond the proxy's there and that rise passed for bypass traffic (docs/daemon.md). Evenly where
        the server counts at request end (SGLang) or no scrape window covers the span.

        After the latest scrape the pace is not measured: the last window's is assumed, but that part takes no more of
        the `n` tokens than the scraped windows leave. The server may have stopped there (restarted, or its stream
        ended before a hop passed it on): a proxy stalled across a restart read the old process's last tokens with
        the server down, and the unmeasured seconds at the last pace took most of them, the stall's windows, where
        the server had counted them, too few (their rise read as bypass tokens that never ran, rows `complete`)."""
        # A restart after the request arrived: the process that served it died in the restart's window, where the pace
        # is the new process's. Its tokens go before the first scrape after that restart, the restart's window taken as
        # unmeasured (above), and into no window after it: read late (a proxy stalled across the restart that read its
        # old stream's last tokens once the new process ran bypass traffic), they were placed at that traffic's pace,
        # hiding it, and the windows where the old process had counted them read their lag as bypass tokens.
        # A placing that starts after that scrape (a stalled worker's second piece, read once the new process ran) is
        # put at it: started from its previous piece, it fell in the new process's windows, at its pace.
        self.recon.note_unsure(r, t1)
        cut = min((w for w in self.recon.restarts if w[0] >= r.trace.arrival_ns), key=lambda w: w[0], default=None)
        if cut is not None:
            t1 = min(t1, cut[1])
            if start >= t1:
                return [int(t1)] * k
        even = np.linspace(start, t1, k).astype(np.int64).tolist()
        spans = [sp for sp in self.recon.server_spans if sp.t1_ns > start and sp.t0_ns < t1 and sp.t1_ns > sp.t0_ns
                 and (cut is None or sp.t1_ns <= cut[0])]
        if not self.recon.server_seen or self.recon.server_at_finish or not spans:
            return even
        s0 = np.array([sp.t0_ns for sp in spans], dtype=np.int64)
        s1 = np.array([sp.t1_ns for sp in spans], dtype=np.int64)
        a0, a1, full = np.maximum(s0, start), np.minimum(s1, t1), (s1 - s0).astype(float)
        # The proxied requests' share of the server's count: less each window's bypass tokens, resolved, else at the
        # bypass pace just before the span (`recon.bypass_pace`). Taken whole, bypass traffic beside the span made its
        # scraped windows' pace too fast, and the part after the latest scrape got only what they left (below): a proxy's
        # loop stalled 150-300 ms beside 100 bypass tokens/s crowded its burst before the latest scrape: windows there
        # read 0-6 bypass tokens of 10, others up to 24, rows `complete` (tests/test_daemon_bypass_lag.py).
        rate_b = self.recon.bypass_pace(start, self._held_from())
        delta = np.array([max(sp.server_tokens - (sp.bypass_tokens if sp.bypass_tokens is not None
                                                  else rate_b * (sp.t1_ns - sp.t0_ns)), 0.0)
                          for sp in spans], dtype=float)
        lives = []  # (from, to, sequences) of every other request the server was running, as the proxy saw them
        for q in self.requests.values():
            tq = q.trace
            if q is r or tq.api is None or q.uncounted is not None:
                continue
            b = tq.last_ns if tq.end_ns is not None else t1
            a = q.placed_from_ns if q.placed_from_ns is not None else tq.first_ns
            if a is None and tq.end_ns is None:
                a = tq.arrival_ns  # nothing shown yet: maybe held back on its way, decoding all along
            elif q.placed_from_ns is None and q.first_held:
                # Its first piece was a burst, held since its decode began (placed back there at its end,
                # `_first_burst`): running from its arrival, not from that piece. From the piece, streams in 4 kB
                # bursts went uncounted until their first burst came, and a window of 90 tokens beside them was
                # taken for one stream's alone: a burst's span said 124 tokens for its 32, its windows `proxy_lag`.
                a = tq.arrival_ns
            if a is not None and b is not None and b > a:
                lives.append((a, b, max(tq.extra.get("sequences", 1), 1)))
        running = np.full(len(spans), float(max(r.trace.extra.get("sequences", 1), 1)))
        if lives:  # one array pass (a burst per stream every fraction of a second on a busy, buffered server)
            lv = np.array(lives, dtype=np.int64)
            over = np.clip(np.minimum(lv[:, 1:2], s1[None, :]) - np.maximum(lv[:, 0:1], s0[None, :]), 0, None)
            running += (over / full[None, :] * lv[:, 2:3]).sum(axis=0)
        pace = delta / full / running  # tokens a sequence got per ns, window by window
        if not np.isfinite(pace).all() or pace.max() <= 0:
            # The server's count less the bypass pace leaves the burst no room in any window: that contradicts the
            # burst's own count as much as too little room does (below), and the even spread rests on nothing the
            # count says. Returned unmarked, a burst arriving as a clump of bypass requests wound down (the clump's
            # 480 tokens/s taken out of windows that held 115) was spread over its queue and its decode alike, and
            # the windows there read 8-15 bypass tokens of none, rows `complete` (tests/test_daemon_bypass_lag.py).
            # With no bypass pace taken out, no room is the count saying fewer tokens than the burst holds, which
            # bypass traffic cannot make (below): unmarked.
            if n is not None and n > LAG_TOKENS + LAG_SHARE * float(max(sp.server_tokens for sp in spans)) \
                    and any(sp.bypass_tokens is None for sp in spans) and rate_b > 0.0:
                self.recon.pace_unsure.append((int(start), int(t1)))
            return even
        # The span's pieces in order: the windows (clipped to it) and what they leave uncovered at the pace of the
        # window before (the first's before it). Mostly that is the span's last moments, after the latest scrape: at
        # their mean pace instead, an answer that ended alone after a crowded stretch got too few tokens there.
        order = np.argsort(a0, kind="stable")
        edges, rates, t, prev = [start], [], start, float(pace[order[0]])
        for i in order:
            if a0[i] > t:
                edges.append(int(a0[i]))
                rates.append(prev)
            if a1[i] > max(t, a0[i]):
                edges.append(int(a1[i]))
                rates.append(float(pace[i]))
            t, prev = max(t, int(a1[i])), float(pace[i])
        seqs = max(r.trace.extra.get("sequences", 1), 1)
        measured = float(np.dot(rates, np.diff(np.array(edges, dtype=float)))) * seqs
        if n is not None and any(sp.bypass_tokens is None for sp in spans):
            # The server's pace, less the bypass tokens assumed in windows not yet resolved, says how many tokens the
            # span held (its part after the latest scrape at the last window's pace): off the burst's own count by more
            # than a window's bound, the bypass traffic's pace changed there (began or stopped with the stall), and
            # nothing tells where the burst's tokens belong: the windows it spans say `proxy_lag` (`recon.resolve_spans`).
            # Before, unmarked: bypass stopping with a 150 ms stall read 30 of 0 beside 0 of 23; starting within 2 s
            # before it (the windows of the last LAG_S unresolved), 0-5 and 17-20 of 10 (tests/test_daemon_bypass_lag.py).
            # The bound is one window's (its largest: the fewest marks), not the span's whole count: a one-burst stream
            # spans many windows, and bypass traffic that wound down inside it left 3-4 intervals a run `complete` and
            # off (a window 34 of 17 bypass tokens, one 8 of 0; tests/test_daemon_buffered_bypass.py).
            # With no bypass pace taken out (none ran just before the span), bypass traffic in the span could only
            # have made the count say more than the burst holds: fewer is the pace's own error (requests queued or in
            # their prefill counted as running: a window of 26 tokens beside 28 live streams), not bypass traffic, and
            # the windows stay unmarked. Marked, one long stream so (360 tokens over 4.3 s, said 332) marked every
            # window of its span, and with them every row of tests/test_daemon_buffered_bypass.py's run with none.
            said = measured + (prev * (t1 - t) * seqs if t < t1 else 0.0)
            off = said - n if rate_b <= 0.0 else abs(said - n)
            if off > LAG_TOKENS + LAG_SHARE * float(max(sp.server_tokens for sp in spans)):
                self.recon.pace_unsure.append((int(start), int(t1)))
        if t < t1:
            if n is not None:
                prev = min(prev, max(0.0, n - measured) / seqs / (t1 - t))
            edges.append(t1)
            rates.append(prev)
        x = np.array(edges, dtype=float)
        cum = np.concatenate([[0.0], np.cumsum(np.array(rates) * np.diff(x))])
        if cum[-1] <= 0:
            return even
        return np.interp(np.linspace(0.0, cum[-1], k), cum, x).astype(np.int64).tolist()

    def _held_from(self) -> int | None:
        """The earliest instant from which a live request may hold tokens the server has counted and the proxy has not
        listed yet: one that has shown nothing (held back on its way, or not streamed: its tokens come at its end) from
        its arrival; one whose first piece was a burst (placed back at its end) from its arrival; one whose latest
        piece was a burst (the next is being held) from that piece. None: no such request."""
        out = None
        for q in self.requests.values():
            tq = q.trace
            if tq.end_ns is not None or tq.api is None or q.uncounted is not None:
                continue
            if tq.stream is not True or tq.first_ns is None or q.first_held:
                t = tq.arrival_ns
            elif q.prev_held and q.prev_ns is not None:
                t = q.prev_ns
            else:
                continue
            out = t if out is None else min(out, t)
        return out

    def _to_server_count(self, r: LiveRequest, total: float) -> float:
        """A stream whose chunks carried no counts was counted one token per chunk; its final `usage`
        gives the server's own count (more under speculative decoding or batched chunks). Its
        chunks still open are scaled so the request's tokens add up to that count: each chunk
        stands for its share of them, and the scraped server counter sees no surplus to give to
        `unproxied`. Chunks in intervals already closed keep what they had. Where none is open and its last chunk is
        before the first open interval (its end came after the intervals it ran in closed), the count's surplus is late,
        as `_place` makes such tokens: counted on its row, in no interval's energy. Before, it was dropped unsaid (20 of
        30 tokens, the ledger's test: not late, its row's error null)."""
        open_n = float(sum(r.ev_n))
        target = total - r.spent - r.late
        if target <= 0 or target == open_n:
            return 0.0
        if open_n <= 0:
            # No open chunk to scale: the count's tokens came in chunks that carry none the proxy
            # counts (vLLM's closing chunk, empty content and a finish_reason: the only token of a
            # max_tokens=1 answer). Placed at the last chunk, else the end, where the server sent them;
            # left out they went to `unproxied` as bypass traffic, with their energy.
            tr = r.trace
            t = tr.last_ns if tr.last_ns is not None else tr.end_ns
            if t is None:
                return 0.0
            if self.edges and t < self.edges[0].t_ns:
                r.late += target
                self.late_tokens += target
                return target  # the proxy's count takes them (tokens_by_tag), as a late chunk's
            r.ev_t, r.ev_n = [int(t)], [target]
            if self.recon.server_seen:
                self.recon.proxied.append((int(t), target))
                self.recon.note_usage_only(r, [int(t)], [target], total, float(r.trace.tokens_seen or 0))
            r.to_server = True
            return target
        if target >= CHUNK_TOKENS_SEVERAL * open_n and len(r.ev_n) > 1:
            self._chunks_to_server_count(r, target, total)
            return target - open_n
        f = target / open_n
        scaled = [n * f for n in r.ev_n]
        scaled[-1] = target - sum(scaled[:-1])  # the request's tokens add up to the count exactly
        if self.recon.server_seen:
            self.recon.proxied.extend((t, new - n) for t, n, new in zip(r.ev_t, r.ev_n, scaled))
            # Beyond its chunks, on the usage's word alone: only the server's counter checks them.
            self.recon.note_usage_only(r, r.ev_t, [new - n for n, new in zip(r.ev_n, scaled)], total,
                                       float(r.trace.tokens_seen or 0))
        r.ev_n = scaled
        r.to_server = True
        return target - open_n

    def _chunks_to_server_count(self, r: LiveRequest, target: float, total: float) -> None:
        """`_to_server_count` where the usage says several tokens a chunk (CHUNK_TOKENS_SEVERAL times the open chunks or
        more): each chunk's share is placed step by step over the time since the chunk before it, as on_tokens places a
        counted piece of several steps (the first open chunk at its stamp: nothing before it is open), and the chunks in
        scrape windows already resolved keep their count (their windows took the server's count as it stood: a surplus
        placed there is in no window's count, its tokens read as bypass tokens that never ran). Scaled at the chunks'
        stamps, a stream batching 4 tokens a chunk (a server's stream interval) ran up to 3 tokens behind the counter
        between its chunks, and its first chunk (the prefill's token alone) 2.6 ahead: honest windows said counter_below
        or proxy_lag (the simulator's 4-a-chunk scene: up to 15 of 30 busy intervals, docs/daemon.md "Where in a chunk's
        time")."""
        ev_t, ev_n = list(r.ev_t), list(r.ev_n)
        done = self.recon.resolved_to_ns if self.recon.server_seen else None
        kept = 0 if done is None else int(np.searchsorted(np.asarray(ev_t, dtype=np.int64), done, side="right"))
        if kept >= len(ev_t) or float(sum(ev_n[kept:])) <= 0:
            kept = 0  # every chunk in resolved windows: scaled all the same (where else could the count go)
        fixed = float(sum(ev_n[:kept]))
        f = (target - fixed) / (float(sum(ev_n)) - fixed)
        steps = int(round(f))
        steps = PIECE_STEPS if steps > PIECE_STEPS else steps if steps > 1 else 1
        ts: list[int] = [int(t) for t in ev_t[:kept + 1]]
        ns: list[float] = [float(n) for n in ev_n[:kept]] + [ev_n[kept] * f]
        if self.recon.server_seen and not r.spent and not r.late and kept == 0:
            # Its first chunk's share beyond its own count: maybe its token alone (out of the prefill), the rest the
            # later chunks' (`recon.note_chunk_spread`).
            self.recon.note_chunk_spread(int(ev_t[0]), int(ev_t[-1]), ev_n[0] * (f - 1.0), at_start=True)
        if kept:
            # The first chunk after the resolved windows: spread from their end, never into them.
            a = max(int(ev_t[kept - 1]), int(done))
            d, k = int(ev_t[kept]) - a, steps
            if d > 0 and k > 1:
                ts[-1:] = [a + d * i // k for i in range(1, k + 1)]
                ns[-1:] = [ev_n[kept] * f / k] * k
                if self.recon.server_seen:
                    self.recon.note_chunk_spread(a, int(ev_t[kept]), ev_n[kept] * f)
        for a, t, n in zip(ev_t[kept:], ev_t[kept + 1:], ev_n[kept + 1:]):
            d = int(t) - int(a)
            k = steps if d > 0 else 1
            ts.extend(int(a) + d * i // k for i in range(1, k + 1))
            ns.extend([n * f / k] * k)
            if k > 1 and self.recon.server_seen:
                self.recon.note_chunk_spread(int(a), int(t), n * f)
        ns[-1] = target - float(sum(ns[:-1]))  # the request's tokens add up to the count exactly
        if self.recon.server_seen:
            self.recon.proxied.extend((t, -n) for t, n in zip(ev_t, ev_n))
            self.recon.proxied.extend(zip(ts, ns))
            # Beyond its chunks, on the usage's word alone: only the server's counter checks them (`_judge_usage`; left
            # unrecorded, a usage lying above its counter behind several tokens a chunk went unsaid). Each placed
            # token after the resolved windows is (f - 1) / f beyond its chunk's own count.
            beyond = (f - 1.0) / f if f > 0 else 0.0
            self.recon.note_usage_only(r, ts[kept:], [n * beyond for n in ns[kept:]], total,
                                       float(r.trace.tokens_seen or 0))
        r.ev_t, r.ev_n = ts, ns
        r.to_server = True

    # --- inputs from the sampler and the scraper ----------------------------------------------

    @staticmethod
    def sample_instant(t_ns: int, wall_ns: int, readings) -> tuple[int, int]:
        """(monotonic ns, wall ns) a full GPU sample's edge is dated at (`_edge_instant`): a tag's edge is that."""
        counter, read_ns, power = _sample_reads(t_ns, readings)
        return _edge_instant(t_ns, wall_ns, read_ns, counter, power)

    def add_gpu_sample(self, t_ns: int, wall_ns: int, readings) -> None:
        counter, read_ns, weight_w = _sample_reads(t_ns, readings)
        windows = self.avg_windows_s if len(self.avg_windows_s) == len(readings) else (0.0,) * len(readings)
        # A GPU's reading of nvmlDeviceGetPowerUsage with no averaging window is instant power too.
        power = np.array([r.power_w if r.power_w is not None
                          else (r.power_avg_w if r.power_avg_w is not None and w <= 0 else np.nan)
                          for r, w in zip(readings, windows)], dtype=float)
        avg = np.array([r.power_avg_w if r.power_avg_w is not None and w > 0 else np.nan
                        for r, w in zip(readings, windows)], dtype=float)
        # A clock lock its readings show (or its release) is another setting, as a limit's change: it can move the
        # idle draw (workmodel.LockedSetting).
        serving = self.learner.serving  # the GPUs the idle power is of: another's lock state holds no run back
        matters = (None if serving is None or serving.size != len(readings)
                   else {getattr(r, "index", None) for r, s in zip(readings, serving) if s})
        setting = setting_of(tuple(getattr(r, "power_limit_w", None) for r in readings),
                             self._locks.feed(readings, t_ns, matters))
        self._setting = setting
        epoch = np.array([getattr(r, "energy_epoch", 0) for r in readings], dtype=np.int64)
        if len(readings) == self.n_gpus:
            has_avg = ~np.isnan(avg)
            self._avg_last_ns[has_avg] = t_ns
            self._avg_needed = np.isnan(counter) & has_avg
        # The edge instant is weighted by each GPU's power, instant or averaged: only the weights need it.
        self._power_w = weight_w
        t, wall = _edge_instant(t_ns, wall_ns, read_ns, counter, weight_w)
        # An idle run teaches its setting only once a busy reading tells the locks held up to it (workmodel.lock_told).
        told = self._locks.told
        if told is not None:
            self.learner.lock_told(None if told == "blind" else t, changed=told == "changed")
        else:
            self.learner.lock_untold(t)  # held no longer than workmodel.LOCK_WAIT_S
        self._insert_edge(_Edge(t, wall, counter, power, setting, epoch, avg))

    def add_gpu_edge(self, t_ns: int, wall_ns: int, energy_j) -> tuple[int, int] | None:
        """An edge from the energy counters alone (a short request's arrival, first token or end, a tag window's held
        edge): no power reading, so its intervals need the counter at both ends; the GPUs' setting is the last full
        sample's. Returns the instant it is dated at (monotonic ns, wall ns); None where it was not taken."""
        counter = np.array(energy_j, dtype=float)
        if counter.shape != (self.n_gpus,) or np.isnan(counter).any():
            return None
        epochs = getattr(energy_j, "epochs", None)  # collectors.nvml.CounterRead
        epoch = np.array(epochs, dtype=np.int64) if epochs else None
        at = getattr(energy_j, "t_mono_ns", None)
        read_ns = np.array(at, dtype=np.int64) if at and len(at) == self.n_gpus else np.full(self.n_gpus, t_ns, np.int64)
        t, wall = _edge_instant(t_ns, wall_ns, read_ns, counter, self._power_w)  # weighted by the last full sample's power
        if not self._insert_edge(_Edge(t, wall, counter, np.full(self.n_gpus, np.nan), self._setting, epoch)):
            return None
        return t, wall

    def _insert_edge(self, edge: _Edge) -> bool:
        """Whether the edge was taken (one at its instant already, or before everything closed, is not)."""
        t_ns = edge.t_ns
        if self.first_edge_ns is None:
            self.first_edge_ns = t_ns
        if self.edges and t_ns <= self.edges[-1].t_ns:
            # An on-demand sample read in another thread may be published late: keep edges ordered.
            ts = [e.t_ns for e in self.edges]
            i = int(np.searchsorted(ts, t_ns))
            if i < len(ts) and ts[i] == t_ns:
                return False
            if i == 0:
                return False  # before everything already closed: nothing to attribute it to
            self.edges.insert(i, edge)
        else:
            self.edges.append(edge)
        return True

    def add_rapl_sample(self, t_ns: int, readings) -> None:
        self.rapl = True
        energy_j, epoch = cpu_energy_j(readings)
        if energy_j is None:
            return
        if self.cpu_epoch and epoch != self.cpu_epoch[-1]:
            notes = "; ".join(sorted({r.note for r in readings if r.note}))
            log.warning("RAPL dropped a delta (%s): CPU energy of the intervals across it is unknown", notes or "epoch changed")
        self.cpu_t.append(t_ns)
        self.cpu_e.append(energy_j)
        self.cpu_epoch.append(epoch)

    def add_cputime_sample(self, t_ns: int, reading) -> None:
        """Whose CPU time the host spent (a `CpuTimeReading`): RAPL's CPU energy is the whole package's, so
        intervals where other processes used more than BUSY_HOST_PCT of it are marked. A server whose
        processes are not found leaves every interval unjudged, said once."""
        if reading.host_busy_s is None:
            return
        if reading.server_cpu_s is None:
            if not self._server_unknown_said:
                self._server_unknown_said = True
                log.warning("%s; fix: %s", unknown_server_text(reading.server_note or "not found",
                                                               "the CPU energy split among the requests is"),
                            BUSY_HOST_FIX)
            return
        self.ct_t.append(t_ns)
        self.ct_host.append(reading.host_busy_s)
        self.ct_other.append(reading.host_busy_s - reading.server_cpu_s - (reading.powerprof_cpu_s or 0.0))

    def _cpu_time(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(K,) the host's busy CPU seconds and other processes' over each interval; NaN where unknown."""
        return interval_cpu_s(np.fromiter(self.ct_t, dtype=np.int64, count=len(self.ct_t)),
                              np.fromiter(self.ct_host, dtype=float), np.fromiter(self.ct_other, dtype=float), t)

    def add_cache_hits(self, since_ns: int | None, t_ns: int, hits: float | None) -> None:
        """The prompt tokens the server found in its prefix cache between the previous scrape (`since_ns`) and this one
        (scrape.Scraper.cache_hits; None: not known). Checked against the cached counts the requests that met it said:
        the rest the server reused without saying it to any request, and the rows of those that said nothing, and
        the intervals over it, say so (CACHE_UNSAID_FLAG)."""
        horizon = int(t_ns) - int(CACHE_KEEP_S * 1e9)
        if self._cache_spans and self._cache_spans[0][1] < horizon:
            self._judge_unsure_before(horizon)
            # What the pruned windows took of the requests' known hits stays taken: else a long span's hits, met
            # there, would hide a later window's unsaid ones once those windows are gone.
            left = self._cache_match(upto_ns=horizon)
            for k, n in zip(self._cache_known, left):
                k[2] = n
            self._cache_dirty = True
        # Pruned at every scrape, whatever it read: a server with no counter (llama.cpp: None) still has its
        # requests' known hits kept (3000 over 600 s at 5 requests/s, growing for ever, before).
        while self._cache_spans and self._cache_spans[0][1] < horizon:
            self._cache_spans.popleft()
            self._cache_frozen = max(self._cache_frozen - 1, 0)
        self._prune_known(horizon)
        if hits is None or hits <= 0 or since_ns is None or since_ns >= t_ns:
            return
        self._cache_spans.append([int(since_ns), int(t_ns), float(hits), 0.0])
        self._cache_dirty = True

    def _judge_unsure_before(self, t_ns: int) -> None:
        """Judge now what live requests keep to judge at their end over scrape windows that end before `t_ns`, about to
        be pruned (CACHE_KEEP_S): the intervals beside unsaid hits (`cache_unsure`) and their own hit span. A stream
        longer than that, judged at its end, found those windows gone and lost its prefix-cache-unsaid flag (review
        s37: a 320 s stream beside 900 unsaid hits, 31.5 kJ unflagged). What is judged early counts the hits still
        unsaid now: the requests whose end could say them have ended or waited past the hold long before. Ended ones
        too, whose row is still to come (their end's interval not closed yet, or their row parked: `_late_parked`):
        passed over, a stream ending just before the prune found its hit span's window gone at its row and lost its
        flag (tests/test_prefix_cache_ledger.py)."""
        for r in itertools.chain(self.requests.values(), (item[0] for item in self._late_parked)):
            if r.cache_unsure and r.cache_unsure[0][0] < t_ns:
                keep = []
                for e in r.cache_unsure:
                    if e[0] < t_ns:
                        self._judge_unsure(r, *e)
                    else:
                        keep.append(e)
                r.cache_unsure = keep
            h0, h1 = self._hit_span(r)
            if h0 < t_ns:
                r.cache_unsaid_early = max(r.cache_unsaid_early, self._cache_unsaid(h0, h1))

    def _judge_unsure(self, r: LiveRequest, t0: int, t1: int, j: float) -> None:
        """One interval r took energy of beside hits no answer had said when it closed: CACHE_UNSAID_FLAG's share."""
        u = self._cache_unsaid(t0, t1)
        if u >= CACHE_UNSAID_MIN:
            r.cache_beside_j += j
            r.cache_beside = max(r.cache_beside, u)

    def _hit_span(self, r: LiveRequest) -> tuple[int, int]:
        """Where the server counts the request's prefix-cache hit: vLLM as it schedules it (arrival to first token),
        SGLang as it finishes it (its last token to its end: scrape.AT_FINISH)."""
        tr = r.trace
        end = tr.end_ns if tr.end_ns is not None else tr.arrival_ns
        if self.recon.server_at_finish and r.prefilled_apart:  # its prefill's own request finished before its first token
            return int(tr.arrival_ns), int(end)
        if self.recon.server_at_finish:
            return int(tr.last_ns if tr.last_ns is not None else tr.first_ns or end), int(end)
        first = _first_token_seen(tr)
        return int(tr.arrival_ns), int(first if first is not None else end)

    def _cache_met(self, r: LiveRequest) -> None:
        """At a request's end: the cached tokens its answer said (or its shared prompt's other choices found) go to
        the scrape windows of its hit span, those read already and those to come."""
        n = _known_cached(r)
        if n <= 0:
            return
        h0, h1 = self._hit_span(r)
        self._cache_known.append([h0, h1, float(n)])
        self._cache_dirty = True
        self._prune_known(h1 - int(CACHE_KEEP_S * 1e9))  # bounded even where no scrape comes

    def _prune_known(self, horizon_ns: int) -> None:
        """Drop the known hits whose span ended before `horizon_ns` and before every window kept (none can meet them)."""
        cut = min(horizon_ns, self._cache_spans[0][0]) if self._cache_spans else horizon_ns
        while self._cache_known and self._cache_known[0][1] < cut:
            self._cache_known.popleft()

    def _cache_match(self, upto_ns: int | None = None) -> list[float]:
        """Match the requests' known hits (`_cache_known`) to the scrape windows their span meets, each token once, as
        the server's counter counts it, and set each window's `known`; returns each request's tokens left over. Only
        the windows ending before `upto_ns` where given (those about to be pruned).

        A maximum matching, whatever order the requests ended in: the windows in time order, each given to the
        requests whose span has begun by its end, the one whose span ends first first (a span is a run of windows:
        this greedy leaves as few hits unmatched as any). Given at each request's end to the earliest window of its
        span with room, a request queued past a scrape took the hits of one that ended later and whose span met only
        that window; that one's count found no room, and the next window read unsaid hits, every answer having said
        its count (a loaded host: 135 of 250 rows of a simulated vLLM flagged). Given to every window its span
        touched, a request queued 2.8 s hid another's 800 unsaid hits (before that)."""
        known = self._cache_known
        left = [k[2] for k in known]
        order = sorted(range(len(known)), key=lambda i: known[i][0])
        begun: list = []  # (span end, index) of the requests whose span has begun
        j = 0
        for sp in itertools.islice(self._cache_spans, self._cache_frozen, None):  # the frozen ones took theirs already
            if upto_ns is not None and sp[1] >= upto_ns:
                break
            while j < len(order) and known[order[j]][0] <= sp[1]:
                heapq.heappush(begun, (known[order[j]][1], order[j]))
                j += 1
            room = sp[2]
            while begun and room > 0:
                h1, i = begun[0]
                if h1 < sp[0] or left[i] <= 0:  # its span ended before this window, or it is all matched
                    heapq.heappop(begun)
                    continue
                take = min(left[i], room)
                left[i] -= take
                room -= take
            sp[3] = sp[2] - room
        return left

    def _cache_settle(self) -> None:
        """Each window's `known` as the latest requests and windows match it (`_cache_match`), before it is read."""
        if self._cache_dirty:
            self._cache_match()
            self._cache_dirty = False
            self._cache_freeze()

    def _cache_freeze(self) -> None:
        """Make final the matching of the windows no request still to end can meet (they end before every live
        request's arrival, and prompt_hold_s before the latest window: a record that reaches the ledger late), and
        drop the known hits used up there: matched afresh, 300 s of them at 50 requests/s took 130 ms a time."""
        spans, known = self._cache_spans, self._cache_known
        if not spans:
            return
        until = spans[-1][1] - int(PROMPT_HOLD_S * 1e9)
        until = min([until] + [r.trace.arrival_ns for r in self.requests.values() if r.trace.end_ns is None])
        n = sum(1 for sp in itertools.islice(spans, self._cache_frozen, None) if sp[1] < until)
        if n < 16:  # a few at a time
            return
        for k, left in zip(known, self._cache_match(upto_ns=until)):
            k[2] = left
        self._cache_frozen += n
        first = spans[self._cache_frozen][0] if self._cache_frozen < len(spans) else until
        self._cache_known = deque(k for k in known if k[2] > 0 and k[1] >= first)

    def _cache_unsaid(self, t0: int, t1: int) -> float:
        """Prefix-cache hits of the scrape windows over [t0, t1] that no request's answer said (CACHE_UNSAID_FLAG)."""
        self._cache_settle()
        return float(sum(max(sp[2] - sp[3], 0.0) for sp in self._cache_spans if sp[0] <= t1 and sp[1] >= t0))

    def _cache_waiting(self, t0: int, t1: int, close_ns: int) -> int:
        """A wait (its number; 0: none) on the live requests whose prefix-cache hit may be among the unsaid hits of
        the scrape windows over [t0, t1]: their hit span meets one and their end has not come (`_cache_met` counts what
        it says). The server counts a hit as it schedules a request, a stream's answer says it at its end: a window
        read before then holds hits not yet said, and judged at once (an interval's close) they passed for unsaid, the
        details flag on (35 of 96 requests flagged, docs/daemon.md "Prefix-cache hits are no prefill"). Requests of an
        API that says no cached count (`_never_says_cached`) are not waited for: their end cannot say it."""
        self._cache_settle()
        wins = [(sp[0], sp[1]) for sp in self._cache_spans if sp[0] <= t1 and sp[1] >= t0 and sp[2] > sp[3]]
        if not wins:
            return 0
        out = []
        for r in self.requests.values():
            tr = r.trace
            if tr.end_ns is not None or tr.api is None or self._cannot_say_cached(r):
                continue
            if self.recon.server_at_finish:  # counted as it finishes: from its latest token on, its end still to come
                h0, h1 = tr.last_ns or tr.first_ns or tr.arrival_ns, None
            else:
                h0, h1 = tr.arrival_ns, _first_token_seen(tr)
            if any(h0 <= w1 and (h1 is None or h1 >= w0) for w0, w1 in wins):
                out.append(r)
        if not out:
            return 0
        n = self._wait_next
        self._wait_next += 1
        self._waits[n] = [len(out), int(close_ns)]
        for r in out:
            a = r.awaited
            while a and a[0][1] < self._wait_floor:  # waits left at their hold: bounded by the hold, not its life
                a.pop(0)
            if a and a[-1][1] == n - 1:
                a[-1][1] = n
            else:
                a.append([n, n])
        return n

    def _release(self, r: LiveRequest) -> None:
        """The request ended (or can say no cached count): the waits it was one of count it no more."""
        for n0, n1 in r.awaited:
            for n in range(max(n0, self._wait_floor), n1 + 1):
                w = self._waits.get(n)
                if w is not None:
                    w[0] -= 1
                    if w[0] <= 0:
                        del self._waits[n]
        r.awaited = []

    def _drop_waits(self, now_ns: int) -> None:
        """Waits prompt_hold_s past their close: no row waits on them any longer (the interval row's hold; a request
        row over it is judged with every count said by its own time)."""
        while self._waits:
            n = next(iter(self._waits))
            if now_ns - self._waits[n][1] < self.prompt_hold_ns:
                break
            del self._waits[n]
            self._wait_floor = n + 1

    def _cache_still_waiting(self, waits) -> bool:
        """Whether one of these waits has a request that has still not ended (its answer may yet say its count)."""
        return any(n in self._waits for n in waits)

    def _learn_says_cached(self, r: LiveRequest) -> None:
        """At a request's end: whether its answer said a cached count (0 or more) or, while the server counted hits,
        said none (vLLM without --enable-prompt-tokens-details). A None while no hit was counted is left out: a server
        may leave out a count of 0. Once an API says none, its live requests leave every wait."""
        tr, c = r.trace, r.trace.counts
        if tr.api is None or c is None or c.invalid is not None or c.prompt_tokens is None or c.prompt_tokens <= 1:
            return
        said = c.cached_tokens is not None
        if not said and not self._cache_spans:
            return
        seen = self._says_cached.setdefault(tr.api, deque(maxlen=SAYS_CACHED_RECENT))
        seen.append(said)
        if not said and self._never_says_cached(tr.api):
            for q in self.requests.values():
                if q.awaited and self._cannot_say_cached(q):
                    self._release(q)

    def _prefilled_apart(self, r: LiveRequest) -> bool:
        """Whether the server prefilled the request's n > 1 choices' prompt in a request of its own (SGLang: its
        /generate, or its OpenAI endpoints once the scrape knows it is SGLang)."""
        return r.trace.extra.get("choices", 1) > 1 and (r.trace.api == "sglang-generate" or self.choices_prefilled_apart)

    def _cannot_say_cached(self, r: LiveRequest) -> bool:
        """Its end cannot tell a hit: its API says no cached count and its prompt is not shared by n choices (whose other
        choices' hits its end tells all the same: `_known_cached`)."""
        return self._never_says_cached(r.trace.api) and r.trace.extra.get("choices", 1) <= 1

    def _never_says_cached(self, api: str) -> bool:
        """The API's latest ended answers (SAYS_CACHED_RECENT) all said no cached count while the server counted hits:
        its requests' ends cannot say one (answers of one upstream and API share its settings)."""
        seen = self._says_cached.get(api)
        return bool(seen) and not any(seen)

    # --- the server's own count (kept by `reconcile.CountReconciler`) ------------------------------

    def add_server_tokens(self, t_ns: int, delta: float, since_ns: int | None = None, at_finish: bool = False,
                          finished: tuple[float, float] | None = None, partial: tuple[str, ...] = (),
                          read_ns: tuple[int, int] | None = None, served: tuple[float, ...] | None = None,
                          restart_by_fall: bool = False, down_ns: int | None = None,
                          down_refused: bool = False, read_missed: float = 0.0, past_reach: bool = False,
                          dead_from_ns: int | None = None) -> None:
        """Tokens the server counted between the previous scrape (`since_ns`) and this one: a scrape window, its
        arguments as `CountReconciler.add_server_tokens` takes them (the daemon's scrape loop calls the ledger).
        `restart_by_fall`: its server_restart was told by the counter's fall alone (scrape.Scraper.restart_by_fall): a
        multi-process page's dip may pass for one, so no run-on ends there (an SGLang stream run on to 3.0 s, cut at
        such a window at 1.5 s, was costed 35.6 tokens and 90 J for the truth's 100 and 250); the window says it as any
        restart's. `down_ns`: when the first scrape of the window that found the server down began
        (scrape.Scraper.window_down_ns; None: none did): the old process died before it. `down_refused`: that scrape's
        connection was refused (scrape.Scraper.window_down_refused): nothing listened, unlike a router's 502/503.
        Refused in a window the page does not say restarted (COUNTER_BELOW: `Scraper._down_back`, the proxy's refused
        connects among them, `Scraper._proxy_refused`), it is a death all the same: a restart from the window's start
        to its end. Before, only server_restart recorded one: a whole answer the proxy's refusals saw die was written
        not costed (0 J for about 100 J), its energy with the requests beside it, their rows unflagged. `past_reach`:
        its page was back past a new process's reach (scrape.Scraper.window_past_reach): a death no run-on is cut at,
        as nothing tells it from the same process back (`_run_on_cut_ns`). `dead_from_ns`: where a death by a refusal
        alone may have come from, before `since_ns` (a held slow window's burst part: `service.held_death_part`)."""
        self.recon.add_server_tokens(t_ns, delta, since_ns, at_finish, finished, partial, read_ns, served, read_missed)
        self._down_open = None  # a believed page: the window it held is this one's
        restart = "server_restart" in partial and not restart_by_fall
        dead_from = since_ns if dead_from_ns is None or since_ns is None else min(dead_from_ns, since_ns)
        died = (not restart and down_refused and since_ns is not None and down_ns is not None
                and dead_from < down_ns <= t_ns)
        if restart or died:
            a, b = self.recon.restarts[-1] if restart else (dead_from, t_ns)
            down = down_ns if down_ns is not None and a < down_ns <= b else None
            self._gone_at.append((a, b, down, down is not None and down_refused))
            if died:
                self._died_unrestarted.append((a, b, down))
                if past_reach:
                    self._death_unsure.append((a, b, down))
            for r in self.requests.values():  # closes with no answer this death explains: crashes (`_crash_seen`)
                if r.trace.end_ns is not None and closed_unanswered(r):
                    self._run_on(r)
            self._end_run_ons_at_restart()
            for rid, (a0, a1) in self._counted_spans.items():  # an unplaced run's process died in this window
                if a1 >= int(attr.NEVER):
                    self._counted_spans[rid] = (a0, max(a0, int(t_ns)))
        if delta > 0 or since_ns is None or restart or died or not self.count_each_step:
            self._count_still_from = None  # a count that moves only as requests end says nothing of a run-on's steps
        else:
            # The count stood still from `_count_still_from`: nothing decoded, so a run-on with no end known had ended by
            # then (its last step within GONE_ABORT_SLACK_S), unless it was still prefilling its prompt. Still over
            # COUNT_STILL_S at least: one short window's zero may be a long step's (a prompt's prefill chunk beside it).
            # Timed from its prefill's estimated end where the stillness began before it: a run that stopped before
            # then (llama-server cancels at its first quiet second) left its span open through an 18 s silence.
            still = self._count_still_from = since_ns if self._count_still_from is None else self._count_still_from
            for rid, (a0, a1) in self._counted_spans.items():
                f = max(int(still), self._counted_from.get(rid, a0))
                if a1 >= int(attr.NEVER) and t_ns - f >= COUNT_STILL_S * 1e9:
                    self._counted_spans[rid] = (a0, f + int(GONE_ABORT_SLACK_S * 1e9))
        self._end_counted_by_slots()

    def _end_counted_by_slots(self) -> None:
        """End the counted spans with no known end whose runs' slots have moved on, by the latest /slots read
        (`window_slots`); a placed one's at the later of that and its placed tokens' end (`_cut_placed_span`). Noted at
        the first read begun after the latest leave where slots sat idle at that read and the one before, as many as its
        runs need and the one each pinned (`_slots_needed`): a run queued there would have taken them (llama-server
        moves a deferred task back to its queue as a slot is released, `pop_deferred_task`, and a task asks for one
        free slot unless it has `n` choices or an `id_slot`), so the (slot, task) pairs busy there hold every run still
        decoding, but for one whose move another deferred task took (docs/daemon.md, a known limit). Ended at the first
        read where each of them changed task or went idle, its last step before the read's end, plus GONE_ABORT_SLACK_S.
        Before, only a still count closed it: under steady traffic, never."""
        if self.window_slots is None:
            return
        r0, r1, slots = self.window_slots
        if self._slots_handled is not None and self._slots_handled[0] == r1:
            return  # one read, handed with two windows (a held one's)
        idle = frozenset(sid for sid, (_, busy) in slots.items() if not busy)
        idle_before = self._slots_handled[1] if self._slots_handled is not None else frozenset()
        self._slots_handled = (r1, frozenset((sid, slots[sid][0]) for sid in idle))
        kept = frozenset(sid for sid in idle if (sid, slots[sid][0]) in idle_before)  # idle at both reads
        for rid, (after, watched) in list(self._counted_watch.items()):
            a0, a1 = self._counted_spans.get(rid, (0, 0))
            placed = self._placed_slots_end.get(rid)
            if (a1 < int(attr.NEVER)) if placed is None else placed < int(attr.NEVER):
                continue
            if after is not None:
                n, ids = self._counted_need.get(rid, (1, frozenset()))
                if r0 < after or len(kept) < n or not ids <= kept:
                    continue  # its runs may sit queued, on no slot (`_slots_needed`)
                self._counted_need.pop(rid, None)
                after, watched = None, watched | {(sid, task) for sid, (task, busy) in slots.items() if busy}
                self._counted_watch[rid] = (after, watched)
            if all(not slots.get(sid, (None, False))[1] or slots[sid][0] != task for sid, task in watched):
                if placed is not None:
                    self._placed_slots_end[rid] = r1 + int(GONE_ABORT_SLACK_S * 1e9)
                    self._cut_placed_span(rid)
                else:
                    self._counted_spans[rid] = (a0, max(a0, r1 + int(GONE_ABORT_SLACK_S * 1e9)))

    def _cut_placed_span(self, rid: int) -> None:
        """End a placed run-on's counted span (`_run_on`) at the later of where /slots showed its run had ended and
        where its placed tokens end, once both are known, where sooner than the end it was held to: past both, no
        token of it is placed or counted, the shares there whole. Not before its placed tokens' end: they take their
        share of the intervals up to there, the rows beside low by them where the run ended sooner (cancelled at
        llama-server's first quiet second), so those stay marked. Before, marked to its held end, twice its estimate:
        a run cancelled 3 s in, placed to 10.5 s, marked its neighbours to 20.6 s."""
        a0, a1 = self._counted_spans.get(rid, (0, 0))
        end = max(self._placed_slots_end.get(rid, int(attr.NEVER)), self._placed_end.get(rid, int(attr.NEVER)))
        if rid in self._counted_spans and end < a1:
            self._counted_spans[rid] = (a0, max(a0, end))
        c0, c1 = self._capped_spans.get(rid, (0, 0))
        if end <= c0:
            self._capped_spans.pop(rid, None)  # ended before its rest past the held 30 s: nothing ran there
        elif end < c1:
            self._capped_spans[rid] = (c0, end)

    def note_down(self, since_ns: int, down_ns: int, refused_ns: int | None) -> None:
        """A scrape since the server's last good one (`since_ns`) found it down (the first began at `down_ns`), one
        found nothing listening (refused at `refused_ns`): its process died, known now. The closes with no answer it
        explains are crashes at once (`_crash_seen`): known only at the new process's first scrape, a model load later
        (10 s or more), SCRAPE_HOLD_S had written their rows: two whole answers in flight at a crash, 0 J each against
        about 146 J of truth. None refused (`refused_ns` None: llama-server's 503 "Loading model" alone,
        scrape.Scraper.down_open) costs nothing yet: the rows of the closes it may explain are held until a page
        confirms the restart or the same process comes back (the window dropped), at most DOWN_HOLD_MAX_S
        (`_down_hold`)."""
        opened = (since_ns, down_ns, refused_ns is not None)
        if self._down_open == opened or not since_ns < down_ns <= (down_ns if refused_ns is None else refused_ns):
            return
        self._down_open = opened
        if refused_ns is None and not self._death_shown((since_ns, down_ns, down_ns, False)):
            return  # costs nothing until a page confirms the restart; its closes' rows wait for it (`_down_hold`)
        self._crashes_known()

    def _crashes_known(self) -> None:
        """A death shown now: the closes with no answer it explains are crashes (`_crash_seen`), costed at once."""
        for r in self.requests.values():
            if r.trace.end_ns is not None and closed_unanswered(r):
                self._run_on(r)

    def _down_hold(self, horizon: int, now_ns: int) -> int:
        """`horizon`, held at the arrival of each close with no answer that a window opened by a 503 "Loading model"
        alone (`note_down`, none refused) may explain, sent before the old process's last good scrape: costed only if a
        page confirms the restart (`_crash_seen`), a model load later (10 s or more, past SCRAPE_HOLD_S), its row waits
        for that page, at most DOWN_HOLD_MAX_S from the later of its close and that window's first found-down scrape;
        then written as the crash it most likely was, flagged, saying so. Counted from its arrival, a whole answer
        closed 19.45 s in was let go at once (the cap cut to 15 s), its row flagged and saying it had waited, though
        the page 13 s after the close confirmed the restart."""
        o = self._down_open
        if o is None or o[2]:
            return horizon
        slack = int(CRASH_CLOSE_SLACK_S * 1e9)
        cap = now_ns - int(DOWN_HOLD_MAX_S * 1e9)
        waiting = [r for r in self.requests.values()
                   if r.trace.end_ns is not None and not r.crash_seen and closed_unanswered(r)
                   and not self._never_run(r.trace) and r.trace.arrival_ns < o[0] <= r.trace.end_ns <= o[1] + slack]
        for r in waiting:
            if max(o[1], r.trace.end_ns) <= cap:
                # Let go with no page come: costed as the crash it most likely was (in flight before the old process's
                # last good scrape), marked uncertain-uncounted, its row saying it waited. Written at 0 J, the energy
                # of its run was the requests' beside it, unmarked (streams cut beside it +10%).
                r.down_hold_over = (o[1], DOWN_HOLD_MAX_S)
                self._cost_as_crash(r, False)
        waiting = [r for r in waiting if not r.crash_seen]
        if not waiting:
            return horizon
        return min(horizon, min(r.trace.arrival_ns for r in waiting))  # bounded: each waits at most the cap

    def _run_on_cut_ns(self, r: LiveRequest) -> tuple[int, tuple[int, int, int | None]] | None:
        """Where the process that ran `r` on died, as best known, in the first restart known since `r` arrived: after
        its last scrape (that restart window's start), before the first scrape that found the server down, where one
        did: placed midway (good to half a scrape interval either way; at its last scrape, it was up to a whole interval
        early, the run-on's energy after silently dropped); where none found it down (a restart between two scrapes), at
        its last scrape, a lower bound (the new process's first scrape, `_restart_cut_ns`, can come a model load later).
        A request that arrived after that last scrape but before the first that found the server down was the old
        process's too (it took it; the scrape after found nothing listening): its death is placed between its arrival and
        that scrape. Matched only by a restart whose window began after its arrival, a whole answer that arrived at
        1.52 s (last scrape 1.5 s, found down 1.6 s, the new process up at 11.5 s) was held to its max_tokens, 400 tokens
        and 1001 J for the truth's 2 and 7 J.
        A death closes the proxy's connection to the process, which ends its requests there as upstream_error: a run-on's
        request (its client left, client_disconnected) had its connection open at its client's leaving, so its process
        was alive then. A restart whose process was gone by then (found down, or the new one up, before the leaving) was
        not its process's death (a false one: a 503 or refused scrape, then a multi-process page's dip): taken for it, a
        whole answer served 0.5 s to its client's leaving at 3.0 s and run on by SGLang was costed to that restart's
        found-down scrape at 1.55 s, 40.6 tokens and 110 J for the truth's 100 and 250 at least. Its death is placed after
        the leaving, never before.
        A death whose page back was past a new process's reach (`_death_unsure`) cuts none: the same process may have
        lived on, its run-on with it (cut there, a whole SGLang answer's run-on read 40.6 tokens and 54 J for 159.6
        and 271, unflagged). Its row says both readings (`run_on_unsure`), and the windows over the rest of its run-on
        say run_on_may_end (their rows flagged, as a run-on's that may have ended by itself), to the cut of the first
        sure death after it, which still cuts: taking the earliest death alone, an unsure one hid a later sure restart
        (159.6 tokens and 301 J for 80.6 and 114 at most, the new process's energy on a dead request).
        With that restart's (window start, end, first found down, the death's lower bound), which its row says
        (`r.run_on_death`)."""
        if not self._gone_at:
            return None
        tr = r.trace
        arrival, left = tr.arrival_ns, tr.end_ns
        gones = sorted((g for g in self._gone_at
                       if (left is None or left <= (g[1] if g[2] is None else g[2]))
                        and (g[0] >= arrival or g[2] is not None and arrival < g[2] and self._death_proven(r, g))),
                       key=lambda g: g[:2])
        sure = next((g for g in gones if g[:3] not in self._death_unsure), None)
        cut = None
        if sure is not None:
            a, b, down, _ = sure
            lo = max(a, arrival, left or a)  # alive at its last scrape, when it took the request, and at its leaving
            cut = (lo if down is None else (lo + down) // 2), (a, b, down, lo)
        unsure = gones[0] if gones and gones[0][:3] in self._death_unsure else None
        if unsure is not None and r.run_on_end_ns is not None:
            a, _, down, _ = unsure
            lo = max(a, arrival, left or a)
            end = int(r.run_on_end_ns) if cut is None else min(int(r.run_on_end_ns), cut[0])
            if end > lo:  # ended before it, nothing of it is in doubt
                r.run_on_unsure, r.run_on_reach = (a, down), True
                self.recon.run_ons_may_end[(tr.request_id, "death")] = (lo, end)
                return cut
        if r.run_on_reach:  # a sure death come since cut it at or before the unsure one: nothing left in doubt
            r.run_on_unsure, r.run_on_reach = None, False
            self.recon.run_ons_may_end.pop((tr.request_id, "death"), None)
        return cut

    def _death_proven(self, r: LiveRequest, g: tuple) -> bool:
        """Whether restart `g`'s first found-down scrape, which came after `r` arrived past the old process's last
        scrape, was a death: its connection refused (nothing listening), or a proxied request's connection to the
        server broke from that last scrape to CRASH_CLOSE_SLACK_S after it. A lone 503 (a router, a loading page),
        then a counter's dip, passes for a restart too: taken for a death, a whole answer whose client left before it
        and that the live server ran on was costed 0.6 tokens and 2.5 J for the truth's 160 and 400 (SGLang), 400 and
        1001 (llama.cpp). Not proven, its run-on is not cut there and its row says both readings (`run_on_unsure`)."""
        if self._death_shown(g):
            r.run_on_unsure = None
            return True
        r.run_on_unsure = (g[0], g[2])
        return False

    def _death_shown(self, g: tuple) -> bool:
        """Whether restart `g`'s first found-down scrape was a death: its connection refused (nothing listening), or a
        proxied request's connection to the server broke from the old process's last scrape to CRASH_CLOSE_SLACK_S
        after that scrape (a close with no answer is none: `on_end`)."""
        a, _, down, refused = g
        return refused or any(a <= t <= down + int(CRASH_CLOSE_SLACK_S * 1e9) for t in self._conn_fail_ns)

    def _batch_death(self, g: tuple) -> bool:
        """Whether death `g` (`_gone_at`) is proven enough to end a batch 400's span there (`_end_run_ons_at_restart`):
        a restart the page said (its start time, or a fall the scraper calls one) where no scrape found the server down
        (the start time said it), or where its first found-down scrape was refused. Not a proxied connection cut
        mid-answer after a 503 and a counter's dip: a gateway's blip cuts established streams too (taken for proof, a
        span of 31.6 s was cut 5.5 s after its arrival while the batch ran on, the rows between unflagged). Never a
        death no page said a restart of (`_died_unrestarted`: a refusal, then a page that says none): the same process
        may have lived on (a Kubernetes Service's pod out of its readiness, a port-forward's hiccup; a young counter
        reads as a new process's, `scrape.Scraper._down_back`), and a refused connect or resend proves nothing more (one
        in the window cut a span from 31.6 s to 0.8 s after its arrival while the batch ran on, the rows between
        unflagged). Nor a 503 then a counter's dip (32.1 s to 6.0 s). Left to its bound there: an over-flag at worst (a
        start-time restart behind a gateway's 503 too: the ledger is not told the start time said it)."""
        _, _, down, refused = g
        if g[:3] in self._died_unrestarted:
            return False
        if down is None:
            return True
        return refused

    def _end_run_ons_at_restart(self) -> None:
        """A restart ends every run-on of the process that died: nothing ran it on past that process's death, placed
        from its last scrape and the first that found the server down (`_run_on_cut_ns`). Held to its estimate
        (llama.cpp's whole answer to its max_tokens, up to RUN_ON_TO_END_MAX_S), a run-on went on in the new process's
        intervals: a whole answer cut 0.6 s in and the server restarted at 1.5 s was placed 370 tokens and 940 J, 750 J
        of them the new process's, its row saying it ran on to its end (tests/test_daemon_ledger.py); cut at the new
        process's first scrape, a 10 s model load's down time was its own (400 tokens, 1010 J for the truth's 40 and
        100). Placed already (a stream's, `_place_run_ons`), its events past the cut go (`_cut_run_on`)."""
        for r in self.requests.values():
            self._cut_run_on(r)
        # A batch SGLang answered 400 ran its other prompts in the process that died: none past its death's window
        # (`_gone_at`; before: marked on to its bound, the new process's rows flagged for nothing), where that death is
        # shown (`_batch_death`). Not a restart told by a counter's fall alone (a multi-process page's dip, in
        # recon.restarts): read from recon.restarts, a dip's false restart cut a span the batch ran past, its rows
        # unflagged.
        # Each batch a merged span holds cut apart (`cut_batches`): one sent to the new process keeps its end.
        deaths = [(g[0], g[1]) for g in self._gone_at if self._batch_death(g)]
        spans = self.recon.batch_run_ons
        for k, (a0, a1) in list(spans.items()):
            held = self._batch_run_on_batches[k] = cut_batches(self._batch_run_on_batches.get(k, [(a0, a1)]), deaths)
            spans[k] = (a0, max(b for _, b in held))
        for i, (a0, a1) in enumerate(self._batch_spans):
            held = self._batch_span_batches[a0] = cut_batches(self._batch_span_batches.get(a0, [(a0, a1)]), deaths)
            self._batch_spans[i] = (a0, max(b for _, b in held))

    def _cut_run_on(self, r: LiveRequest) -> None:
        """End `r`'s run-on where the process running it died, as best known (`_run_on_cut_ns`: not before its client
        left), and take out what was placed of it after."""
        gone = self._run_on_cut_ns(r) if r.run_on_end_ns is not None else None
        if gone is None or r.run_on_end_ns <= gone[0]:
            return
        cut, r.run_on_death = gone
        r.run_on_end_ns, r.run_on_restart = cut, True
        self._capped_spans.pop(r.trace.request_id, None)  # its process died before the capped span: nothing ran there
        if r.trace.request_id in self._counted_spans:
            self._counted_spans[r.trace.request_id] = (self._counted_spans[r.trace.request_id][0], cut)
        r.run_on_unrestarted = r.run_on_death[:3] in self._died_unrestarted
        if r.run_on_tokens > 0 and r.run_on_from_ns is None and r.ev_t and r.ev_t[-1] > r.run_on_end_ns:
            # Placed already (a stream's, `_place_run_ons`, before the restart's window came: a long GET): its events
            # past the cut go, and its run-on's tokens with them. Kept, a stream cut at 2.0 s whose window came 0.9 s
            # late kept 41 tokens too many (100.6 for 60), its row saying nothing decoded it after the cut and 81
            # tokens decoded. Those in intervals closed already are spent: counted, past mending.
            i = bisect.bisect_right(r.ev_t, max(r.run_on_end_ns, r.trace.last_ns or r.run_on_end_ns))
            gone = float(sum(r.ev_n[i:]))
            del r.ev_t[i:], r.ev_n[i:]
            r.run_on_tokens = max(r.run_on_tokens - gone, 0.0)
        if r.run_on_listed is not None and r.run_on_listed[0] > cut:
            # Listed as its length finish, which its death came before: SGLang never counted it. Taken back where no
            # window has taken it yet (those resolved already are past mending).
            try:
                self.recon.finished.remove(r.run_on_listed)
            except ValueError:
                pass
            r.run_on_listed = None

    def note_proxy_delay(self, t_ns: int, delay_s: float) -> None:
        """How late the proxy's event loop ran at `t_ns` (`CountReconciler.note_proxy_delay`)."""
        self.recon.note_proxy_delay(t_ns, delay_s)

    # --- tags --------------------------------------------------------------------------------

    def open_tag(self, name: str, t_ns: int, wall_ns: int, held: bool | None = None, start_edge=None) -> None:
        """A tag window from its start edge; `held`: whether that edge was held past a counter refresh (tagedge.py),
        `start_edge` (a tagedge.StopEdge): what its counter values hold of before it, taken out of its figures."""
        if name in self.tags:
            raise ValueError(f"tag {name!r} is already open")
        if len(self.tags) >= MAX_OPEN_TAGS:
            raise ValueError(f"too many open tags ({MAX_OPEN_TAGS}); stop some first")
        self.tags[name] = _Tag(name, t_ns, wall_ns, held=held)
        if start_edge is not None and len(start_edge.trim_j) == self.n_gpus:
            self.tags[name].start_trim_j = tuple(start_edge.trim_j)
            _add_misdated(self.tags[name], start_edge)

    def close_tag(self, name: str, t_ns: int, wall_ns: int, closed_by: str = "stop", stop_edge=None,
                  held: bool | None = None) -> None:
        """A tag window closed at its stop edge; `stop_edge` (a tagedge.StopEdge): the energy drawn after the stop call
        up to that edge, taken out of its figures."""
        tag = self.tags.pop(name, None)
        if tag is None:
            raise ValueError(f"tag {name!r} is not open")
        tag.t1_ns, tag.wall1_ns, tag.closed_by = t_ns, wall_ns, closed_by
        if held is not None:
            tag.held = held if tag.held is None else tag.held and held
        if stop_edge is not None and len(stop_edge.trim_j) == self.n_gpus:
            tag.stop_trim_j, tag.held_s = tuple(stop_edge.trim_j), stop_edge.held_s
            _add_misdated(tag, stop_edge)
        self.closed_tags.append(tag)

    def open_tag_names(self) -> list[str]:
        return sorted(self.tags)

    # --- closing intervals -------------------------------------------------------------------

    def advance(self, now_ns: int, records_upto_ns: int | None = None) -> None:
        """Close every interval whose end edge is older than the grace period, and (records_upto_ns:
        proxy workers' records) whose tokens have all been read, held at most max_hold_s."""
        horizon = now_ns - self.grace_ns
        if records_upto_ns is not None:
            horizon = min(horizon, max(records_upto_ns, now_ns - self.max_hold_ns))
        # Each hold bounds the horizon on its own, with its own cap: the tightest wins (a shorter
        # cap must not release intervals another hold still needs).
        # A non-streamed response reveals its tokens only at its end: hold the intervals it
        # overlaps until then (bounded), or its decode would be taken for prefill.
        waiting = [r.trace.arrival_ns for r in self.requests.values()
                   if r.trace.end_ns is None and r.trace.api is not None and r.trace.stream is not True]
        if waiting:
            horizon = min(horizon, max(min(waiting), now_ns - self.max_hold_ns))
        # A prompt's length comes with usage/timings, mostly at the end: hold the intervals of its
        # prefill until then (bounded), so they are split by work, not by guess.
        # An embeddings request's length (its whole work, a prefill) comes with its answer: held likewise.
        unknown = [r.trace.arrival_ns for r in self.requests.values()
                   if r.trace.end_ns is None and (r.trace.api is not None or r.uncounted == "embeddings")
                   and told_prompt_tokens(r) is None]
        if unknown:
            horizon = min(horizon, max(min(unknown), now_ns - self.prompt_hold_ns))
        rc = self.recon
        if rc.server_upto_ns is not None:
            # Bypass tokens are known once the server's counter has been scraped past the interval
            # and LAG_S beyond (the proxy's late view of the same tokens).
            rc.resolve_spans(rc.server_upto_ns)
            self._hold_uncounted_batches(rc.server_upto_ns)
            known = min((sp.t0_ns for sp in rc.server_spans if sp.bypass_tokens is None), default=rc.server_upto_ns)
            if rc.durations:
                # A bypass request running now is seen only at its end (an at-finish server): its intervals are held
                # as far back as the recent requests lasted, plus the window it may end in, so its tokens can be
                # spread back over them (`recon._spread_back`).
                window_ns = rc.server_spans[-1].t1_ns - rc.server_spans[-1].t0_ns if rc.server_spans else 0
                known = min(known, rc.server_upto_ns - window_ns - int(max(d for _, d in rc.durations) * 1e9))
            usage_ns = rc.usage_hold_ns()  # windows whose usage-only tokens wait for their stretch's quiet scrape
            if usage_ns is not None:
                known = min(known, usage_ns)
            horizon = min(horizon, max(known, now_ns - int(SCRAPE_HOLD_S * 1e9)))
        if self._avg_needed.any():
            # A GPU read by its trailing average alone: the reading that covers an interval's end is taken half a
            # window later, so an interval closes once a reading is that far past its end (bounded, as every hold).
            reach = min(int(self._avg_last_ns[g]) - int(self.avg_windows_s[g] * 1e9 / 2)
                        for g in np.flatnonzero(self._avg_needed))
            horizon = min(horizon, max(reach, now_ns - self.max_hold_ns))
        if self.rapl:
            # RAPL is read by its own sampler thread: on a loaded host its tick can land just before NVML's, and the
            # read past an edge then comes a whole period later. Closed before it, the interval's CPU energy was NaN
            # and its requests' cpu_energy_j empty (the first of 4 requests, 1 run in 3). Held for it, bounded: reads
            # that stopped leave the intervals without CPU energy, said on their requests' rows.
            covered = self.cpu_t[-1] if self.cpu_t else now_ns - self.rapl_hold_ns
            horizon = min(horizon, max(covered, now_ns - self.rapl_hold_ns))
        if self.ct_t:
            # Whose CPU time it was, likewise (its own sampler thread, and a busy host is what starves it): closed
            # before a read past its end, an interval took the latest span's rate, the quiet one before other
            # processes began (1.8% where they used 47.6%, unmarked). Held for it, bounded as RAPL's.
            horizon = min(horizon, max(self.ct_t[-1], now_ns - self.rapl_hold_ns))
        # A request gone before its first token (`gone_unsaid`) is costed, and the requests beside it flagged, in the close
        # that holds its end: its prefill is placed over the end of its time in flight. Its end known, the prompt hold is
        # over, and a close up to the horizon, before that end, took its intervals with it still live there, its prompt
        # uncosted and no gone span kept; the next close placed its prefill partly in intervals already closed, lost to
        # the requests beside it, unflagged: the figures hung on how often the daemon closed (every tick: 40 J, its
        # neighbour 60 J unflagged; at once: 93 J, 7 J flagged). Held at its arrival until an edge past its end can
        # close, bounded as the prompt hold.
        if any(r.trace.end_ns is not None and r.trace.first_ns is None for r in self.requests.values()):
            horizon = self._gone_hold(horizon, now_ns)
        # A stream the server runs on after its client left (`_run_on`) decodes at its batch's pace over that run, read
        # from the streams beside it there: its intervals are held from its leave until the proxy has seen that run's
        # end (bounded, as the prompt hold), then its run-on is placed.
        pending = [r.run_on_from_ns for r in self.requests.values() if r.run_on_from_ns is not None]
        if pending:
            known = now_ns - self.grace_ns if records_upto_ns is None else min(now_ns - self.grace_ns, records_upto_ns)
            self._place_run_ons(known, now_ns - self.prompt_hold_ns)
            pending = [r.run_on_from_ns for r in self.requests.values() if r.run_on_from_ns is not None]
            if pending:
                horizon = min(horizon, min(pending))
        horizon = self._down_hold(horizon, now_ns)
        n = 0
        while n + 1 < len(self.edges) and self.edges[n + 1].t_ns <= horizon:
            n += 1
        if n >= 1:
            self._close(self.edges[: n + 1])
            del self.edges[:n]
        self._emit_tags()
        self._expire(now_ns)

    def settled(self, upto_ns: int) -> bool:
        """Whether every interval up to the monotonic instant `upto_ns` has been closed by `advance` (no hold left on
        it) and every row it holds is out: no request live or parked, no interval row parked, no tag open or closing.
        What a caller that ends the traffic at `upto_ns` waits for before stopping, so that no row is left to
        `close_all`, the stop's close, whose figures lack the holds' answers."""
        return (bool(self.edges) and self.edges[0].t_ns >= upto_ns and not self.requests and not self._late_parked
                and not self._iv_parked and not self.tags and not self.closed_tags)

    def close_all(self, now_ns: int, now_wall_ns: int | None = None) -> None:
        """At shutdown: close every interval; open requests and tags are emitted as interrupted. A tag open when no
        sample was ever taken ends at `now_wall_ns` (the caller's wall clock), not at 1970."""
        self._place_run_ons(None)  # what the streams beside them showed is all there will be
        if self.edges:
            for r in self.requests.values():
                if r.run_on_to_end and r.run_on_end_ns is not None and r.run_on_end_ns > self.edges[-1].t_ns:
                    # Its end placed past the last sample (llama.cpp's run to its max_tokens): costed to there, what the
                    # daemon measured; left at its estimate it was never done, its work in the streams beside it (the
                    # last of cut_accuracy's whole answers -97%, those streams up to +122%).
                    r.run_on_end_ns = max(self.edges[-1].t_ns, r.trace.end_ns)
        if len(self.edges) >= 2:
            self._close(self.edges)
            del self.edges[:-1]
        end = self.edges[-1] if self.edges else None
        for name in list(self.tags):
            wall = end.wall_ns if end else now_wall_ns
            self.close_tag(name, end.t_ns if end else now_ns, wall, closed_by="shutdown")
        self._emit_tags(force=True)
        rows = []
        for rid, r in list(self.requests.items()):
            if r.trace.end_ns is None:
                r.trace.outcome = "interrupted"
            rows.append(self._request_row(r))
            del self.requests[rid]
        self.emit("intervals", self._unpark_intervals(None))
        self.emit("requests", rows + self._unpark(None))

    def _energy(self, edges: list[_Edge]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        t = np.array([e.t_ns for e in edges], dtype=np.int64)
        counters = np.stack([e.counter_j for e in edges]) if self.n_gpus else np.zeros((len(edges), 0))
        powers = np.stack([e.power_w for e in edges]) if self.n_gpus else np.zeros((len(edges), 0))
        per_gpu = np.zeros((len(edges) - 1, self.n_gpus))
        exact = np.ones((len(edges) - 1, self.n_gpus), bool)
        epochs, prev = [], np.zeros(self.n_gpus, dtype=np.int64)
        for e in edges:
            prev = e.epoch if e.epoch is not None else prev
            epochs.append(prev)
        # A counter difference across an epoch change (a jump or reset the collector caught) is no energy.
        same = (np.diff(np.stack(epochs), axis=0) == 0) if self.n_gpus else exact
        how = np.full((len(edges) - 1, self.n_gpus), METHOD_COUNTER, dtype=object)
        dc = np.diff(counters, axis=0)
        if (~np.isnan(dc) & (dc >= 0) & same).all():
            # Every counter difference is exact (the usual close): `interval_energy_j`'s own answer for each GPU, taken
            # for all GPUs at once. Its call per GPU (8 GPUs: ~70 numpy calls) was 0.4 ms of an idle close's ~3 ms.
            return t, dc, [METHOD_NONE if np.isnan(dc[k]).any() else weakest_method(how[k]) for k in range(len(edges) - 1)]
        for g in range(self.n_gpus):
            per_gpu[:, g], exact[:, g] = attr.interval_energy_j(counters[:, g], t, powers[:, g], same[:, g])
            how[~exact[:, g], g] = METHOD_POWER
            if self.avg_windows_s[g] > 0 and not exact[:, g].all():
                # The profiler's fallback order (profiler.ENERGY_METHODS): the shifted trailing average before
                # instant power, over every held reading (those past the run's end cover its last interval).
                held = [e for e in self.edges if e.avg_power_w is not None]
                at = np.array([e.t_ns for e in held], dtype=np.int64)
                ap = np.array([e.avg_power_w[g] for e in held], dtype=float)
                for k in np.flatnonzero(~exact[:, g]):
                    # The reading at the interval's end covers the window before it: at 1 Hz, the interval itself.
                    e = trailing_average_interval_energy_j(at, ap, self.avg_windows_s[g], int(t[k]), int(t[k + 1]))
                    if not np.isnan(e):
                        per_gpu[k, g], how[k, g] = e, METHOD_AVG_POWER
        methods = [METHOD_NONE if np.isnan(per_gpu[k]).any() else weakest_method(how[k])
                   for k in range(len(edges) - 1)]
        return t, per_gpu, methods

    def _cpu_energy(self, t: np.ndarray) -> np.ndarray:
        if len(self.cpu_t) < 2:
            return np.full(t.size - 1, np.nan)
        # The reads from the last one at or before the first edge on: those the interpolation and the epoch check
        # read, not the whole history (4096 reads, 68 minutes at 1 Hz, converted at every close: a cost that grew with
        # the daemon's uptime). A reset before them moves every cumulative value alike, so the differences are the same.
        n, k = len(self.cpu_t), 0
        for x in reversed(self.cpu_t):
            k += 1
            if x <= t[0]:
                break
        ct = np.fromiter(itertools.islice(self.cpu_t, n - k, None), dtype=np.int64, count=k)
        ce = unwrap_resets(np.fromiter(itertools.islice(self.cpu_e, n - k, None), dtype=float, count=k))
        cum = np.array([interp_at(ct, ce, int(x)) for x in t])
        out = np.diff(cum)
        ep = np.fromiter(itertools.islice(self.cpu_epoch, n - k, None), dtype=np.int64, count=k)
        out[epoch_broken(ct, ep, t[:-1], t[1:])] = np.nan
        return out

    def _close(self, edges: list[_Edge]) -> None:
        # Each run of intervals of one setting (the GPUs' power limits at its end) is split with that
        # setting's costs and feeds that setting's fit: a limit changed while intervals were held (a request's
        # prompt hold, up to 30 s) had them all split with, and learned as, the last one's.
        a = 0
        for b in range(len(edges) - 1):
            if b == len(edges) - 2 or edges[b + 2].setting != edges[b + 1].setting:
                self._close_run(edges[a:b + 2])
                a = b + 1

    def _close_run(self, edges: list[_Edge]) -> None:
        t, per_gpu, methods = self._energy(edges)
        # One GPU without energy (lost, failing reads) leaves the interval's total unknown, not the others'
        # sum: `gpu` is NaN there for rows and tags; attribution sees 0 there and a flag column.
        gpu_missing = np.isnan(per_gpu).any(axis=1) if self.n_gpus else np.zeros(t.size - 1, bool)
        gpu = np.where(gpu_missing, np.nan, np.nansum(per_gpu, axis=1)) if self.n_gpus else np.zeros(t.size - 1)
        gpu0 = np.nan_to_num(gpu)
        # GPUs that do none of the proxied work (no server on them): their energy is idle, whole; the
        # requests, bypass traffic and the idle part of busy time split the others' (the work model's).
        with self._told_lock:
            told, self._told_serving = self._told_serving, None
        if told is not None:
            self.learner.tell_serving(told[0], provisional=told[2])
            self._serving_source = told[1]
        serving = self.learner.serving
        # Split by daemon.serving_gpus alone, the GPUs' power not agreeing yet (an even load may never let it judge):
        # its rows say so (SERVING_ASSERTED_FLAG), kept in J/token as the operator's word. Before, silent: a wrong
        # assertion split 597 of 597 rows -33%/-67%/+20% under an even load with no mark (a review's ledger scenes).
        asserted = (self.n_gpus > 1 and self.learner.serving_from == "told"
                    and self._serving_source == SERVING_ASSERTED_SOURCE)
        self._split_asserted = asserted
        unjudged = serving is None  # which GPUs serve not judged yet: every sampled GPU's energy is the work's
        if serving is not None and serving.size == self.n_gpus and not serving.all():
            work_j = np.nan_to_num(per_gpu[:, serving]).sum(axis=1)
            aside = np.nan_to_num(per_gpu[:, ~serving]).sum(axis=1)
            # One of them unread leaves the interval's idle energy unknown (its row's empty; the totals keep every read GPU's: _account).
            aside_missing = np.isnan(per_gpu[:, ~serving]).any(axis=1)
            # The requests' energy is the serving GPUs': one of the others lost leaves the node total unknown, not theirs.
            work_missing = np.isnan(per_gpu[:, serving]).any(axis=1)
        else:
            work_j, aside, work_missing, serving = gpu0, None, gpu_missing, None
            aside_missing = np.zeros(t.size - 1, bool)
        # Counted where the intervals accounted change basis, not where the learner re-judges (its new mask applies
        # from the next intervals on): the window holding this count is the one straddling the change.
        was = self._accounted_serving
        if (was is None) != (serving is None) or (was is not None and not np.array_equal(was, serving)):
            self._serving_changes += 1
        self._accounted_serving = None if serving is None else serving.copy()
        cpu = self._cpu_energy(t)
        host_s, other_s = self._cpu_time(t)
        with np.errstate(divide="ignore", invalid="ignore"):
            other_pct = np.where(host_s > 0, 100.0 * other_s / host_s, np.nan)
        judged = ~np.isnan(other_pct) & ~np.isnan(cpu)
        t_end = int(t[-1])
        reqs = [r for r in self.requests.values() if r.trace.arrival_ns < t_end]
        never = attr.NEVER

        def ns(v, done):
            return v if (v is not None and done) else never

        arrival = np.array([r.trace.arrival_ns for r in reqs], dtype=np.int64)
        first = np.array([r.placed_from_ns if r.placed_from_ns is not None else r.trace.first_ns
                          if r.trace.first_ns is not None else never for r in reqs], dtype=np.int64)
        # Ended where the server stopped it: a request it runs on after its client left, at that run's end (`_run_on`).
        done = [r.trace.end_ns is not None and server_end_ns(r) <= t_end for r in reqs]
        last = np.array([ns(r.trace.last_ns if r.run_on_end_ns is None else r.run_on_end_ns, d)
                         for r, d in zip(reqs, done)], dtype=np.int64)
        end = np.array([ns(server_end_ns(r), d) for r, d in zip(reqs, done)], dtype=np.int64)
        # A prompt counts once its first token is known: it is spread over arrival → first token; or, a request the
        # server had that ended without one, its prompt unsaid, over arrival → end (`_cost_gone`): a stream; a whole
        # answer cut before it came on a server that aborts it at once (vLLM; llama.cpp with no max_tokens or pace:
        # `_run_on`), whose
        # prefill ran from its arrival (or its queue exit) until then, what it decoded after, if any, unseen (before, it
        # was not costed: no figure, and its prefill in the streams beside it, +183% on the simulated vLLM); or one the
        # server runs on after its client left (`_run_on`: SGLang, llama.cpp), costed so too: it ran to that run's end.
        # (On llama.cpp a whole answer whose end `_run_on` could not place, with no max_tokens or pace, is costed as one
        # aborted at once, as before its run-on was known: left out, it had no figure at all.)
        to_abort = self.runs_on_after_leave is None or self.runs_on_after_leave[1] is None
        gone_first = [d and gone_unsaid(r) and (r.trace.stream is True or r.run_on_end_ns is not None or to_abort)
                      for r, d in zip(reqs, done)]
        prompt = np.array([self._prompt_work(r, d) if r.trace.first_ns is not None or (d and told_prompt_tokens(r))
                           or (d and finished_unsaid(r)) else 0.0 for r, d in zip(reqs, done)], dtype=float)
        # Its prefill is the part the server computed: a prefix-cache hit is in its context, not its prefill work.
        for r in reqs:
            r.prefilled_apart = r.prefilled_apart or self._prefilled_apart(r)
        cached = np.array([_prefill_cached(r) for r in reqs], dtype=float)
        computed = np.maximum(prompt - cached, 0.0)
        self._cost_gone(reqs, gone_first, arrival, first, end, prompt, cached, computed,
                        self.learner.costs(edges[-1].setting))  # `costs` below: nothing is learned between
        self._run_on_gone(reqs, gone_first, arrival, first, computed, self.learner.costs(edges[-1].setting))
        for i in np.flatnonzero(gone_first):
            if reqs[i].run_on_capped:
                # Its max_tokens, reached at its pace (`_place_run_on`), ended its run before the end it was held to:
                # its span ends there. Left at the end built above, the whole hold was its own (llama.cpp's whole answer
                # run on to 400 tokens, held to 20.6 s, ended at 10.5 s: 2010 J for the truth's 1000).
                last[i], end[i] = reqs[i].run_on_end_ns, server_end_ns(reqs[i])
        rate = max(self.learner.costs(edges[-1].setting).prefill_tok_s, attr.PREFILL_TOK_S_SLOW)
        for i in np.flatnonzero(gone_first):
            if reqs[i].trace.stream is not True and reqs[i].run_on_end_ns is None:
                # A whole answer the server aborted at once: its prefill ran from its arrival (it may have decoded after,
                # unseen), not just before its end, where a stream's (none of its tokens shown) ends.
                first[i] = min(int(arrival[i]) + int(computed[i] / rate * 1e9), int(end[i]))
        for i, r in enumerate(reqs):
            if prompt[i] > 0 and r.prefill_cached is None:
                r.prefill_cached = float(cached[i])  # its prefill placed in the intervals closing now
        ev_t, ev_r, ev_n, ev_c, ev_w = [], [], [], [], []
        for i, r in enumerate(reqs):
            ev_t.extend(r.ev_t)
            ev_r.extend([i] * len(r.ev_t))
            ev_n.extend(r.ev_n)
            ev_w.extend(r.ev_n)
            seqs = max(r.trace.extra.get("sequences", 1), 1)
            if r.ev_n and r.spent == 0 and computed[i] > 0:
                # Its first token came out of its prompt's prefill step, whose work the prompt carries:
                # decoded again it was charged twice (1-token requests +22% on the simulator). One per sequence
                # (n choices, prompts), in its first events (each choice's first token may come in a chunk of its own).
                left, j0 = float(seqs), len(ev_w) - len(r.ev_n)
                for j, n in enumerate(r.ev_n):
                    if left <= 0:
                        break
                    ev_w[j0 + j] = max(n - left, 0.0)
                    left -= n
            before = r.spent + np.cumsum(r.ev_n) - np.asarray(r.ev_n, dtype=float) if r.ev_n else []
            # A token's context is its own sequence's: of a request of several (n choices, prompts), its prompt over
            # the sequences that prompt figure covers (_prompt_sequences) and its tokens so far over all of them.
            ev_c.extend(prompt[i] / _prompt_sequences(r) + np.asarray(before, dtype=float) / seqs)
        excess = bypass_spans = None
        why_low: list[set] = [set() for _ in range(t.size - 1)]
        ev_t_a, ev_r_a, ev_n_a = np.array(ev_t, dtype=np.int64), np.array(ev_r, dtype=np.int64), np.array(ev_n, dtype=float)
        if self.recon.server_seen:
            excess, bypass_spans, why_low = self.recon.bypass_over(t)
        # Dropped once the server is known not SGLang, and by time whether or not a window was read: an entry past the
        # scrape hold reaches no interval still open (`bypass_over` prunes only by the windows it reads).
        gone_ns = int(t[-1]) - int((SCRAPE_HOLD_S + LAG_S) * 1e9)
        for rid in [rid for rid, (_, b) in self.recon.batch_run_ons.items()
                    if b <= gone_ns or self.serves_generate is False]:
            del self.recon.batch_run_ons[rid]
        self._batch_run_on_batches = {k: v for k, v in self._batch_run_on_batches.items()
                                      if k in self.recon.batch_run_ons}
        server_count = self.recon.server_count(t, why_low, self.scraping, self.proxy_unread_since_ns,
                                               self.proxy_unread_spans)
        # Intervals whose bypass count may be low (or high: schema.BYPASS_COUNT_TWO_WAY): their requests may carry bypass
        # traffic's energy, or have lost some of theirs (said on their rows),
        # and the live J/token leaves them out, by the one rule `analyze` follows (schema.bypass_count_low).
        low_iv = np.array([bypass_count_low(c) for c in server_count], dtype=bool)
        setting = edges[-1].setting
        costs = self.learner.costs(setting)
        # Why the fixed ratio splits this close, read with its costs: the fit added below may be the first mature one.
        unfit = self.learner.fits.get(setting)
        fixed_why = unfit.reason if unfit is not None and unfit.reason else "no fit yet"
        # The third column marks intervals without CPU energy: a request given a share of one
        # has no CPU figure (rather than a partial, smaller one).
        # The last two: its CPU joules from intervals whose other processes' share is known, and those × the share.
        cpu0 = np.nan_to_num(cpu)
        energy = np.column_stack([work_j, cpu0, np.isnan(cpu), work_missing, np.where(judged, cpu0, 0.0),
                                  np.where(judged, cpu0 * np.nan_to_num(other_pct), 0.0)])
        passive = np.array([is_passive(r) for r in reqs], dtype=bool)  # its error status is known from its head
        # Intervals without a counter that no request (or bypass traffic) was live in for half their time: their
        # requests' energy is the interval's less the idle power over the rest, an estimate a counter would not need.
        dur = np.diff(t) / 1e9
        busy = attr.busy_seconds(t, arrival, end, ~passive, bypass_spans)
        # Instant power reads see an interval at its two ends only: short unless live throughout.
        share = np.array([NO_COUNTER_SHORT_BUSY_SHARE_INSTANT if m == METHOD_POWER else NO_COUNTER_SHORT_BUSY_SHARE
                          for m in methods])
        short_iv = (np.array([m != METHOD_COUNTER for m in methods], dtype=bool) & (busy > 0)
                    & (busy < share * dur))
        # Busy intervals split before any idle power was measured (no run of idle intervals workmodel.IDLE_MIN_S long
        # closed yet at this power limit: the first moments after the daemon's start, or after a change to a limit at
        # or below the idle draw last measured): the time no request was live there went to the requests, not to idle.
        # At the interval's mean power (idle draws no more), a bound on what their figures hold too much
        # (rowtext._idle_unmeasured); the live J/token leaves out the intervals where it reaches
        # QUEUED_BESIDE_MIN_SHARE of their energy, as their rows are left out.
        gap_s = np.clip(dur - busy, 0.0, None) if costs.idle_w is None else np.zeros(dur.size)
        unmeasured_j = np.where((busy > 0) & (gap_s > 0), np.nan_to_num(work_j) * gap_s / np.where(dur > 0, dur, 1.0),
                                0.0)
        unmeasured_iv = (unmeasured_j > 0) & (unmeasured_j >= QUEUED_BESIDE_MIN_SHARE * np.nan_to_num(work_j))
        # Busy intervals split before the work model judged which of several sampled GPUs serve the proxied work
        # (`unjudged`): every GPU's energy went to the work, a GPU serving none of it included (its idle draw the
        # requests'). At least one serves, which one is not known: the most their figures hold too much is every GPU's
        # energy but the one drawing least (`_undecided_gpus_j`), flagged (UNSURE_FLAG) where 1% or more of it. Before,
        # unflagged: +20% median (+14% to +24%) on a Ledger scene (60 W beside a 100-300 W GPU) until it was judged.
        undecided_j = (np.where(busy > 0, _undecided_gpus_j(per_gpu), 0.0) if unjudged and self.n_gpus > 1
                       else np.zeros(dur.size))
        undecided_iv = (undecided_j > 0) & (undecided_j >= QUEUED_BESIDE_MIN_SHARE * np.nan_to_num(work_j))
        # Intervals with prefill in them (a prompt is placed over arrival → first token, or → end for one gone before its
        # first token, as attribution places it) over which the server reused cached prompt tokens no answer said: their
        # requests' split is approximate (CACHE_UNSAID_FLAG).
        prefill_end = np.where(first != never, first, end)
        prefilling = np.array([bool(((arrival < t[k + 1]) & (prefill_end > t[k]) & (computed > 0)).any())
                               for k in range(t.size - 1)], dtype=bool)
        cache_iv = np.array([self._cache_unsaid(int(t[k]), int(t[k + 1])) if prefilling[k] else 0.0
                             for k in range(t.size - 1)])
        # Those whose hits a live request's end may still say (`_cache_waiting`) are judged later (`cache_unsure`, the
        # parked interval rows); the rest now.
        self._drop_waits(int(t[-1]))
        unsure = {k: w for k in np.flatnonzero(cache_iv >= CACHE_UNSAID_MIN)
                  if (w := self._cache_waiting(int(t[k]), int(t[k + 1]), int(t[-1])))}
        uk = sorted(unsure)
        sure_iv = np.where(np.isin(np.arange(t.size - 1), uk), 0.0, cache_iv)
        # Intervals with prefill of a request whose prompt was said early and its cached count not yet: costed as computed
        # whole, a count its end says late leaves the requests beside it under-charged there (CACHE_LATE_FLAG).
        pending = np.array([computed[i] > 0 and _cache_pending(r) for i, r in enumerate(reqs)], dtype=bool)
        pend_iv = [np.flatnonzero(pending & (arrival < t[k + 1]) & (prefill_end > t[k])) for k in range(t.size - 1)]
        energy = np.column_stack([energy, np.where(short_iv, work_j, 0.0), np.where(low_iv, work_j, 0.0),
                                  np.where(sure_iv >= CACHE_UNSAID_MIN, work_j, 0.0),
                                  np.where([len(p) > 0 for p in pend_iv], work_j, 0.0)]
                                 + [np.where(np.arange(t.size - 1) == k, work_j, 0.0) for k in uk])
        # Requests that ended before their first token with their prompt's length unsaid: their prefill is costed at an
        # estimate (or nothing; a whole answer's, and its decode, not at all) that may be off either way, and the
        # requests live beside them say so (GONE_PREFILL_FLAG).
        gone = np.array([d and gone_unsaid(r) for r, d in zip(reqs, done)], dtype=bool)
        self._gone_spans = [s for s in self._gone_spans if s[1] > t[0]]
        slack_ns = int(GONE_ABORT_SLACK_S * 1e9)
        self._gone_spans.extend((int(arrival[i]), int(end[i]) + slack_ns) for i in np.flatnonzero(gone))
        gone_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._gone_spans:
            gone_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(gone_iv, work_j, 0.0)])
        gone_col = energy.shape[1] - 1
        # After a client's leave from a server of unknown kind (`_unplaced`): a run-on may hold part of that work.
        self._unplaced_spans = [s for s in self._unplaced_spans if s[1] > t[0]]
        unplaced_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._unplaced_spans:
            unplaced_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(unplaced_iv, work_j, 0.0)])
        unplaced_col = energy.shape[1] - 1
        # Over a batch answered 400 whose other prompts SGLang may run for nobody, no server scraped (`_batch_run_on`).
        self._batch_spans = [s for s in self._batch_spans if s[1] > t[0]]
        starts = {sp[0] for sp in self._batch_spans}
        self._batch_span_batches = {k: v for k, v in self._batch_span_batches.items() if k in starts}
        batch_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._batch_spans:
            batch_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(batch_iv, work_j, 0.0)])
        batch_col = energy.shape[1] - 1
        # After a llama.cpp whole answer's run-on placed only to RUN_ON_TO_END_MAX_S (`_run_on`): its rest may be there.
        self._capped_spans = {k: s for k, s in self._capped_spans.items() if s[1] > t[0]}
        capped_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._capped_spans.values():
            capped_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(capped_iv, work_j, 0.0)])
        capped_col = energy.shape[1] - 1
        # Over a llama.cpp whole answer's run-on, whose tokens the server counts (`_run_on`): read as bypass there.
        self._counted_spans = {k: s for k, s in self._counted_spans.items() if s[1] > t[0]}
        self._counted_from = {k: v for k, v in self._counted_from.items() if k in self._counted_spans}
        self._counted_watch = {k: v for k, v in self._counted_watch.items() if k in self._counted_spans}
        self._counted_need = {k: v for k, v in self._counted_need.items() if k in self._counted_spans}
        self._placed_slots_end = {k: v for k, v in self._placed_slots_end.items() if k in self._counted_spans}
        self._placed_end = {k: v for k, v in self._placed_end.items() if k in self._counted_spans}
        counted_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._counted_spans.values():
            counted_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(counted_iv, work_j, 0.0)])
        counted_col = energy.shape[1] - 1
        # Closed with a whole answer live in them still in flight (held past max_hold_s, or at the daemon's stop), where
        # no server counter is read (COUNT_OFF): its tokens come only with its end, too late for them, so its decode there
        # is in the shares of the requests beside it, whether its client stays or leaves (`held_whole_beside_j`). A
        # counter read each step (vLLM's, llama.cpp's /slots) reads them as bypass as they come: shares fair there.
        inflight = np.array([r.trace.end_ns is None and r.trace.api is not None and r.trace.stream is not True
                             for r in reqs], dtype=bool)
        off_iv = np.array([c == SERVER_COUNT_OFF for c in server_count], dtype=bool)
        held_iv = off_iv & (min((int(reqs[i].trace.arrival_ns) for i in np.flatnonzero(inflight)),
                                default=int(attr.NEVER)) < t[1:])
        energy = np.column_stack([energy, np.where(held_iv, work_j, 0.0)])
        held_col = energy.shape[1] - 1
        # A crash-costed close that may have queued unrun behind full slots (`resend_queued`): costed as run, its figure
        # may be the requests' beside it (a queued whole answer on the simulator's llama.cpp: 73-78 J for 0, its
        # neighbours -18..-24%), so they say UNSURE_FLAG too, as it does, where that may be a material share of their
        # figure (rowtext.QUEUED_BESIDE_MIN_SHARE). So may a crash-costed close no death was shown at (`crash_unsure`),
        # a queuing router's refusal of a request it held, never run, reading the same: a stream beside such a close,
        # ended before it, read 50.6 J for 100 J of truth (-49%), its note silent on it (out of J/token only as
        # bypass-uncounted, its intervals reaching the restart).
        queued = np.array([d and (resend_queued(r) or crash_unsure_costed(r)) for r, d in zip(reqs, done)], dtype=bool)
        self._queued_spans = [s for s in self._queued_spans if s[1] > t[0]]
        self._queued_spans.extend((int(arrival[i]), int(end[i])) for i in np.flatnonzero(queued))
        queued_iv = np.zeros(t.size - 1, bool)
        for a0, a1 in self._queued_spans:
            queued_iv |= (a0 < t[1:]) & (a1 > t[:-1])
        energy = np.column_stack([energy, np.where(queued_iv, work_j, 0.0)])
        queued_col = energy.shape[1] - 1
        # Requests whose prefill went uncosted, their body unread or sizeless and their prompt unsaid: the requests live over that
        # prefill hold its energy, and say so (PROMPT_UNREAD_FLAG; c11 on the simulator: +25%, silent before).
        unread = np.array([prompt[i] == 0 and (r.trace.first_ns is not None or d) and not passive[i]
                           and prompt_unread(r) for i, (r, d) in enumerate(zip(reqs, done))], dtype=bool)
        self._unread_spans = [s for s in self._unread_spans if s[1] > t[0]]
        self._unread_spans.extend((int(arrival[i]), int(prefill_end[i]), _unread_kind(reqs[i].trace.extra))
                                  for i in np.flatnonzero(unread))
        for i in np.flatnonzero(unread):
            reqs[i].prefill_uncosted = True
        unread_iv = np.zeros(t.size - 1, bool)
        unread_kind_iv: dict[str, np.ndarray] = {}  # by what was wrong with the body: the fix the rows beside give
        for a0, a1, kind in self._unread_spans:
            over = (a0 < t[1:]) & (a1 > t[:-1])
            unread_iv |= over
            unread_kind_iv[kind] = unread_kind_iv.get(kind, False) | over
        energy = np.column_stack([energy, np.where(unread_iv, work_j, 0.0)])
        unread_col = energy.shape[1] - 1
        energy = np.column_stack([energy, np.where(_counter_measured(methods), work_j, 0.0)])
        counter_col = energy.shape[1] - 1
        # Its CPU side: each request's CPU joules follow its share of the interval's GPU joules, so the same fraction of
        # the interval's CPU energy bounds what its cpu_energy_j holds too much.
        energy = np.column_stack([energy, unmeasured_j, cpu0 * unmeasured_j / np.where(work_j > 0, work_j, np.inf)])
        unmeasured_col = energy.shape[1] - 2
        energy = np.column_stack([energy, np.where(undecided_iv, undecided_j, 0.0)])
        undecided_col = energy.shape[1] - 1
        asserted_iv = (busy > 0) & asserted
        self._asserted_intervals += int(np.count_nonzero(asserted_iv))
        energy = np.column_stack([energy, np.where(asserted_iv, np.nan_to_num(work_j), 0.0)])
        asserted_col = energy.shape[1] - 1
        ev_c_a, ev_w_a = np.array(ev_c, dtype=float), np.array(ev_w, dtype=float)
        seqs_a = np.array([r.trace.extra.get("sequences", 1) for r in reqs], dtype=float)
        a = attr.attribute(t, energy, arrival, first, last, end, ev_t_a, ev_r_a, ev_n_a, excess,
                           prompt_tokens=computed, tok_ctx=ev_c_a, costs=costs, bypass_spans=bypass_spans,
                           passive=passive, aside_j=aside, tok_work=ev_w_a, sequences=seqs_a)
        # Bypass tokens' prompts are unseen: an interval mostly of bypass work would bias the fit.
        usable = np.array([m == METHOD_COUNTER for m in methods])
        # A GPU without a counter still measures its idle power: an idle interval's trailing average saw nothing but
        # idle (trailing_average_interval_energy_j). Without it no part of a busy interval was idle, and a short
        # request alone took its intervals' idle seconds too (+96%, docs/daemon.md). Busy ones stay out of the fit.
        usable |= np.array([m == METHOD_AVG_POWER for m in methods]) & (a.kind == attr.IDLE)
        # The limit changed inside the first interval (its start read the one before): its energy is of both.
        usable[0] &= edges[0].setting == setting
        if excess is not None:
            usable &= excess <= BYPASS_FIT_SHARE * a.tokens

        # Each request's GPU joules from intervals whose split among the requests (and bypass traffic) rested on the fixed
        # ratio, the fit not mature (FIXED_RATIO_NOTE): a request alone in its work there takes it whatever the ratio.
        fixed_j = fixed_lo_j = fixed_hi_j = np.zeros(len(reqs))
        if costs.source == "fixed" and a.ratio_split.any():
            fixed_j, fixed_lo_j, fixed_hi_j = (m[:, a.ratio_split] @ work_j[a.ratio_split]
                                               for m in (a.share, a.share_lo, a.share_hi))
        # Each other request's shortfall were the queued closes never run: the same split re-run without them (their
        # rows and token events), what each other request's GPU joules gain (`queued_short_j`: flagged from a share of
        # its figure on). Rare (a crash with such a close in flight), one split more. A bound from their shares given
        # out among the rest in proportion was no bound: where a queued close's placed decode was the only work in an
        # interval, a slow stream beside it had no share there to give, and read 24 J (0.9%) for a gain of 144 J (5.7%).
        queued_short_j = np.zeros(len(reqs))
        if queued.any() and (~queued).any():
            keep = ~queued
            ev_keep = keep[ev_r_a]
            b = attr.attribute(t, work_j, arrival[keep], first[keep], last[keep], end[keep], ev_t_a[ev_keep],
                               (np.cumsum(keep) - 1)[ev_r_a[ev_keep]], ev_n_a[ev_keep], excess,
                               prompt_tokens=computed[keep], tok_ctx=ev_c_a[ev_keep], costs=costs,
                               bypass_spans=bypass_spans, passive=passive[keep], aside_j=aside,
                               tok_work=ev_w_a[ev_keep], sequences=seqs_a[keep])
            queued_short_j[keep] = np.maximum(b.request_energy[:, 0] - a.request_energy[keep, 0], 0.0)
        # Intervals closed in an earlier step while a queued close was still in flight (past max_hold_s) were split with
        # it live, as run, and this re-run leaves them be: a request live beside it there gains more than it says (a
        # slow stream's note said 235.5 J for 1175.5 J of truth, holds cut to 3 s), so its gain is said as a lower bound.
        queued_lower = np.zeros(len(reqs), bool)
        for q in np.flatnonzero(queued):
            rq = reqs[q]
            if rq.queued_rerun_from_ns is None:
                rq.queued_rerun_from_ns = int(t[0])
            queued_lower |= np.maximum(arrival, arrival[q]) < np.minimum(end, rq.queued_rerun_from_ns)
        fit = self.learner.add(setting, a.features, per_gpu, usable, ends_ns=t[1:])
        if fit is not None:
            self.emit("costs", [self._costs_row(edges[-1], setting, fit)])
        for i, r in enumerate(reqs):
            if self.first_edge_ns is not None and r.trace.arrival_ns < self.first_edge_ns - FIRST_READ_SLACK_NS:
                r.before_first_s = (self.first_edge_ns - r.trace.arrival_ns) / 1e9
            r.gpu_j += a.request_energy[i, 0]
            r.cpu_j += a.request_energy[i, 1]
            r.cpu_known = r.cpu_known or not np.isnan(cpu).all()
            r.cpu_missing = r.cpu_missing or a.request_energy[i, 2] > 0
            r.gpu_missing = r.gpu_missing or a.request_energy[i, 3] > 0
            r.cpu_judged_j += a.request_energy[i, 4]
            r.cpu_other_pct_j += a.request_energy[i, 5]
            r.no_counter_short_j += a.request_energy[i, 6]
            r.bypass_low_j += a.request_energy[i, 7]
            if a.band_j is not None:
                r.ctx_up_j += a.band_j[i, 0] - a.request_energy[i, 0]
                r.ctx_down_j += a.band_j[i, 1] - a.request_energy[i, 0]
            if fixed_hi_j[i] > 0:
                r.fixed_j += fixed_j[i]
                r.fixed_lo_j += fixed_lo_j[i]
                r.fixed_hi_j += fixed_hi_j[i]
                r.fixed_why = fixed_why
            if a.request_energy[i, 8] > 0:
                r.cache_beside_j += a.request_energy[i, 8]
                live = (arrival[i] < t[1:]) & (end[i] > t[:-1])
                r.cache_beside = max(r.cache_beside, float(sure_iv[live].max(initial=0.0)))
            for u, k in enumerate(uk):
                if a.request_energy[i, 10 + u] > 0:
                    if len(r.cache_unsure) < CACHE_UNSURE_MAX:
                        r.cache_unsure.append([int(t[k]), int(t[k + 1]), float(a.request_energy[i, 10 + u])])
                        r.cache_wait.add(unsure[k])  # its own end, before its row, takes it out of that count
                    else:  # bounded: judged now, as before (flagged where unsaid so far: never silent)
                        r.cache_beside_j += a.request_energy[i, 10 + u]
                        r.cache_beside = max(r.cache_beside, float(cache_iv[k]))
            if not gone[i]:
                r.gone_beside_j += a.request_energy[i, gone_col]
            r.unplaced_beside_j += a.request_energy[i, unplaced_col]
            r.capped_beside_j += a.request_energy[i, capped_col]
            r.batch_beside_j += a.request_energy[i, batch_col]
            if not r.run_on_to_end and not r.run_on_unknown:  # the run-on's own row says its own reading
                r.counted_beside_j += a.request_energy[i, counted_col]
            if not inflight[i]:  # its own row says its tokens that came after their intervals closed
                r.held_whole_beside_j += a.request_energy[i, held_col]
            if not queued[i]:
                r.queued_beside_j += a.request_energy[i, queued_col]
                r.queued_short_j += float(queued_short_j[i])
                r.queued_short_lower = r.queued_short_lower or bool(queued_lower[i])
            if not unread[i] and a.request_energy[i, unread_col] > 0:
                r.unread_beside_j += a.request_energy[i, unread_col]
                live = (arrival[i] < t[1:]) & (end[i] > t[:-1])
                r.unread_beside_kinds.update(k for k, iv in unread_kind_iv.items() if (iv & live).any())
            r.counter_j += a.request_energy[i, counter_col]
            r.idle_unmeasured_j += a.request_energy[i, unmeasured_col]
            r.idle_unmeasured_cpu_j += a.request_energy[i, unmeasured_col + 1]
            r.idle_lock_held = r.idle_lock_held or (a.request_energy[i, unmeasured_col] > 0
                                                    and self.learner.held_since_ns is not None)
            r.gpus_undecided_j += a.request_energy[i, undecided_col]
            r.serving_asserted_j += a.request_energy[i, asserted_col]
            if a.request_energy[i, 9] > 0:
                live = (arrival[i] < t[1:]) & (end[i] > t[:-1])
                others = {reqs[j].trace.request_id for k in np.flatnonzero(live) for j in pend_iv[k] if j != i}
                if others:
                    for q in others - r.late_wait:
                        self._late_waiters.setdefault(q, []).append(r)
                    r.late_wait |= others
                    r.late_wait_j += a.request_energy[i, 9]
            if a.request_energy[i, 7] > 0:
                live = (arrival[i] < t[1:]) & (end[i] > t[:-1]) & low_iv
                r.bypass_low_why.update(w for k in np.flatnonzero(live) for w in server_count[k].split(","))
            r.tokens += a.request_tokens[i]
            # Token events before the closed edge are spent.
            if r.ev_t and r.ev_t[0] < t_end:
                j = int(np.searchsorted(r.ev_t, t_end))
                r.spent += float(sum(r.ev_n[:j]))
                del r.ev_t[:j], r.ev_n[:j]
        # Said after the rows' energy is added: nothing that can raise (a log line's formatting, the keeping's
        # callback) sits between the fit and the rows' energy (before, a saved time of NaN raised in `_say_judged`
        # there: one interval's energy lost from live rows, a row -16.7% unflagged; a review's scene).
        # Said where the mask changes from the one last said (compared with the local `serving`, which the all-serving
        # branch sets to None, the all-serving line came at every close: 15 times in 20 s).
        now_serving = self.learner.serving
        self._say_undecided(t, undecided_iv)  # first: `_say_judged` counts this close's undecided intervals too
        self._say_disagreement()
        self._say_judged()
        if now_serving is not None and (self._serving_said is None or not np.array_equal(now_serving, self._serving_said)):
            self._serving_said = now_serving.copy()
            by_power = self.learner.serving_from != "told"
            idle_gpus = ", ".join(self.gpu_names[g] for g, on in enumerate(now_serving) if not on)
            log.info("the proxied work runs on sampled GPU(s) %s; %s (%s)",
                     ", ".join(self.gpu_names[g] for g, on in enumerate(now_serving) if on) or "none",
                     (f"GPU(s) {idle_gpus} " + ("draw no more when it runs than when idle" if by_power else
                                                "are not in daemon.serving_gpus"
                                                if self._serving_source == SERVING_ASSERTED_SOURCE else
                                                "hold none of the server's processes")
                      + ": their energy counts as idle, not the requests' (daemon.gpus can leave them out)")
                     if idle_gpus else "every sampled GPU takes part",
                     {"told": self._serving_source, "both": f"{self._serving_source}, and judged from their power alike"}
                     .get(self.learner.serving_from, "judged from their power"))
        unc = [i for i, r in enumerate(reqs) if is_unseen(r) and not passive[i]]
        if unc:
            # Requests whose work the proxy cannot see (embeddings, audio, an endpoint it does not parse) take no
            # share where counted work ran: that energy went to the requests beside them, whose rows say so.
            live = (arrival[:, None] < t[None, 1:]) & (end[:, None] > t[None, :-1])
            # By label, in two matrix products: request by request against each unseen one cost live x unseen
            # Python steps an interval (800 live beside embeddings: a third of the daemon's main thread under load).
            labels = [f"{reqs[j].uncounted} ({outside_text(reqs[j].trace.method, 16)} "
                      f"{outside_text(reqs[j].trace.endpoint, 80)})" for j in unc]
            names, which = np.unique(np.array(labels, dtype=object), return_inverse=True)
            by_label = np.zeros((len(names), len(unc)))
            by_label[which, np.arange(len(unc))] = 1.0
            live_f = live.astype(float)
            beside = (live_f @ ((by_label @ live_f[unc]) > 0).T) > 0  # request x label: live in one interval
            for i, r in enumerate(reqs):
                if not is_unseen(r) and len(r.beside_uncounted) < 8:  # bounded: the note names 3
                    r.beside_uncounted.update(names[beside[i]].tolist())
        low_counted = None
        if excess is not None:
            # A stream counted one token a chunk is low where the server sends several a chunk (speculative
            # decoding): the server's counter then runs ahead of the proxy's while it is live. Noted for its row.
            low_counted = np.zeros(t.size - 1, dtype=np.int64)
            lag_ns = int(LAG_S * 1e9)
            for i, r in enumerate(reqs):
                if r.trace.stream is True and r.trace.api is not None and r.trace.api.startswith("openai"):
                    live = (arrival[i] < t[1:]) & (end[i] > t[:-1])
                    r.server_ahead += float(excess[live].sum())
                    if done[i] and counted_low(r):
                        # Its intervals' unproxied may hold its tokens: they say so, and those up to LAG_S before it
                        # (the scrape window that counted them spreads them over its whole span: f1, 3-7 J there).
                        low_counted += (arrival[i] - lag_ns < t[1:]) & (end[i] > t[:-1]) & (excess > 0)
                        self._counted_low_ends.append(int(end[i]))
            for e in self._counted_low_ends:  # and those up to LAG_S after its end (f1: 38 J there, the rest said)
                low_counted += (t[:-1] >= e) & (t[:-1] < e + lag_ns) & (excess > 0)
            while self._counted_low_ends and self._counted_low_ends[0] + lag_ns <= t[-1]:
                self._counted_low_ends.popleft()
        self._judge_host(t, a, other_pct, judged)
        self._account(t, per_gpu, gpu, cpu, a, methods, costs, host_s, other_s, judged, short_iv, low_iv, server_count,
                      work_j=np.where(work_missing, np.nan, work_j), serving=serving, idle_missing=aside_missing, unjudged=unjudged,
                      aside_j=aside, unplaced_iv=unplaced_iv | capped_iv | batch_iv | counted_iv | held_iv | unmeasured_iv,
                      undecided_iv=undecided_iv, held_iv=held_iv, asserted_iv=asserted_iv)
        self._interval_rows(edges, t, gpu, cpu, methods, a, excess, costs, other_pct, server_count, short_iv, sure_iv,
                            unsure, per_gpu, serving, idle_missing=aside_missing, low_counted=low_counted,
                            unmeasured_j=np.where(unmeasured_iv, unmeasured_j, 0.0),
                            undecided_j=np.where(undecided_iv, undecided_j, 0.0), asserted_iv=asserted_iv)
        ended = [r for r, d in zip(reqs, done) if d]
        for r in ended:
            del self.requests[r.trace.request_id]
            # Its sequences leave the live count a batch's pace is shared by (`_batch_end_ns`) here too: a request whose
            # recording broke gets no on_end (`proxy.Proxy._safe`, the workers' replay alike), yet ends here by its
            # trace's end. Before, its sequences stayed for good (its expiry never saw it): 50 such 8-sequence requests
            # and a 2-prompt max_tokens-6 batch was marked 61.4 s instead of 1.4 s.
            self._live_seqs.pop(r.trace.request_id, None)
            self._release(r)
            self._settle_late(r)  # before any row: a request beside it ending in this close reads its late count
            self._tags_counted_low(r)  # its server_ahead is whole now; its row may be parked past its tag's
            if _cache_unsaid_candidate(r):  # its own check, over its hit span, waits likewise
                if w := self._cache_waiting(*self._hit_span(r), t_end):
                    r.cache_wait.add(w)
        self._late_parked.extend([r, int(r.trace.end_ns)] for r in ended)
        self.emit("requests", self._unpark(t_end))
        # The rows' counts, on /metrics with the rows themselves (the totals above were taken before them).
        self.totals = replace(self.totals, cpu_unknown_requests=self.cpu_unknown_requests,
                              flagged_requests=dict(self.flagged_requests))

    def _unpark(self, now_ns: int | None) -> list[dict]:
        """The rows of ended requests (in `_late_parked`) that need wait no longer for a request beside them to say its
        cached count (`LiveRequest.late_wait`): none of those is still live, or they waited prompt_hold_s past their own end
        (then its row says it could not wait: `late_unresolved`), or `now_ns` None (shutdown: every one)."""
        rows, keep = [], []
        for item in self._late_parked:
            r, end_ns = item
            live = [q for q in r.late_wait if q in self.requests]
            if ((live or self._cache_still_waiting(r.cache_wait)) and now_ns is not None
                    and now_ns - end_ns < self.prompt_hold_ns):
                keep.append(item)
                continue
            r.late_unresolved = bool(live)
            rows.append(self._request_row(r))
        self._late_parked = keep
        return rows

    def _settle_late(self, r: LiveRequest) -> None:
        """How many of its prompt tokens its end said were cached beyond those its prefill was placed with
        (CACHE_LATE_FLAG), told to the requests beside that prefill (`_late_waiters`), which wait for it no more."""
        if r.prefill_cached is not None:
            r.cache_late = max(_prefill_cached(r) - r.prefill_cached, 0.0)
        rid = r.trace.request_id
        for w in self._late_waiters.pop(rid, ()):
            w.late_wait.discard(rid)
            if r.cache_late >= CACHE_UNSAID_MIN:
                w.cache_beside_late = max(w.cache_beside_late, r.cache_late)

    def _gone_hold(self, horizon: int, now_ns: int) -> int:
        """The horizon held at the arrival of each request gone before its first token (`gone_unsaid`) that a close up
        to it would cut (no edge at or past its server's end of it below it: `server_end_ns`), taken again from each
        edge a hold moves the close back to, until no such span is cut: one held moves the close's last edge before the
        end of another, not held at the first edge, whose prefill the next close then placed partly in intervals already
        closed, to its neighbours unflagged (a 10 000-token prompt gone at 0.9 s beside one from 0.8 s to 1.5 s, closed every 0.1 s: their
        neighbour 60 J, against 6.6 J closed at once). Bounded as the prompt hold."""
        while True:
            edge = max((e.t_ns for e in self.edges if e.t_ns <= horizon), default=None)
            gone = [r.trace.arrival_ns for r in self.requests.values()
                    if (edge is None or r.trace.end_ns is not None and server_end_ns(r) > edge) and gone_unsaid(r)]
            held = min(horizon, max(min(gone), now_ns - self.prompt_hold_ns)) if gone else horizon
            if held >= horizon:
                return horizon
            horizon = held

    def _cost_gone(self, reqs: list, gone_first: list, arrival: np.ndarray, first: np.ndarray, end: np.ndarray,
                   prompt: np.ndarray, cached: np.ndarray, computed: np.ndarray, costs: attr.WorkCosts) -> None:
        """Cost the prompts of requests that ended before their first token, their length unsaid, in `prompt` and
        `computed` (in place): each at its body's estimate, no more than its time in flight could prefill at the rate in
        use beside the prompts placed over that time (the GPU's prefill is shared: three 12000-token prompts cut after
        1 s could not all have run whole at 16 000 tokens/s), taken in arrival order, as a server admits them."""
        idx = sorted(np.flatnonzero(gone_first), key=lambda i: arrival[i])
        if not idx:
            return
        prefill_end = np.where(first != attr.NEVER, first, end)
        if costs.prefill_tok_s < attr.PREFILL_TOK_S_SLOW:
            # A fit of few or odd intervals can give a rate far below any server's: the bound would cost such prompts at
            # next to nothing, their energy in the requests beside them. Bounded at the slow end of the rates taken.
            costs = replace(costs, prefill_tok_s=attr.PREFILL_TOK_S_SLOW, source="floor")
        # Summed over the others once, sorted, each prompt costed here a change to that sum: the loop over every request
        # for each one gone was quadratic (10 000 gone beside 2 500 streams: 5.8 s a close, now 0.5 s).
        placed = attr.PlacedPrefill(arrival, prefill_end, computed, costs.prefill_tok_s,
                                    np.concatenate([arrival[idx], end[idx]]))
        for i in idx:
            a_ns, e_ns = int(arrival[i]), int(end[i])
            beside = placed.beside(i, a_ns, e_ns)
            # One llama.cpp prefilled whole after its client left (`_run_on`) is costed its whole prompt: no bound.
            room = (float("inf") if reqs[i].run_on_prefill else
                    max((e_ns - a_ns) / 1e9 * costs.prefill_tok_s - beside, 0.0))
            prompt[i] = self._prompt_work(reqs[i], True, (room, (e_ns - a_ns) / 1e9, beside, costs))
            computed[i] = max(prompt[i] - cached[i], 0.0)
            placed.replace(i, computed[i])

    def _run_on_gone(self, reqs: list, gone_first: list, arrival: np.ndarray, first: np.ndarray, computed: np.ndarray,
                     costs: attr.WorkCosts) -> None:
        """A request gone before its first token that the server runs on (`_run_on`): its prefill ends at its prompt's
        length at the rate in use from its arrival (a stream's not before its client left: no token had come), its first
        token in `first` (in place), and from there it decodes until the abort at its batch's pace over that run
        (`_batch_pace`), with no stream shown beside it then at the median of the server's latest streams' paces.
        Before, a stream's prefill was placed over the end of its run, and its decode (a whole answer's work, all of it)
        went to the requests beside it (on the simulator's SGLang a 12000-token prompt cut after 0.25 s decoded 100 tokens
        for nobody, -60%; two whole answers 173 and 272, 1350 J, their rows empty)."""
        for i in np.flatnonzero(gone_first):
            r = reqs[i]
            if r.run_on_end_ns is None:
                continue
            if r.run_on_prefill:  # llama.cpp's stream: its prefill to its estimated first token, nothing decoded after
                first[i] = r.run_on_end_ns
                continue
            rate = max(costs.prefill_tok_s, attr.PREFILL_TOK_S_SLOW)
            first[i] = int(arrival[i]) + int(computed[i] / rate * 1e9)
            if r.trace.stream is True:
                first[i] = max(first[i], int(r.trace.end_ns))
            first[i] = min(first[i], r.run_on_end_ns)
            if r.run_on_pace is None and first[i] < r.run_on_end_ns:
                seqs = max(r.trace.extra.get("sequences", 1), 1)
                batch = self._batch_pace(r, int(first[i]), r.run_on_end_ns)
                if batch is not None:
                    self._place_run_on(r, int(first[i]), batch[0] * seqs,
                                       f"its batch's (the {batch[1]} streams shown beside it then)")
                elif self._paces:
                    self._place_run_on(r, int(first[i]), float(np.median(self._paces)) * seqs,
                                       f"the median of the server's latest {len(self._paces)} streams'")
                r.run_on_pace = r.run_on_pace or "none"  # placed once, whichever close costs it
            if r.run_on_crash:  # its scrape windows wait for this pass (`recon.resolve_spans`), even one closed in prefill
                r.run_on_pace = r.run_on_pace or "none"

    def _prompt_work(self, r: LiveRequest, done: bool, room: tuple | None = None) -> float:
        """The prompt tokens a request's prefill is costed at: the server's count, else (it ended without
        one, or its intervals could be held no longer) an estimate from its body, kept for its row. One that ended
        before its first token (`_cost_gone`) is estimated too, no more than `room`: (the prompt tokens its time in
        flight had room for, those seconds, the prompt tokens placed beside it then, the costs whose rate it is at)."""
        p = told_prompt_tokens(r)
        if p is not None:
            return p
        tr = r.trace
        # Gone before its first token (a client that gave up while its prompt queued or prefilled): its prefill may have
        # run whole, in part or not at all, and no server says which. Left out, every such prompt's energy went to the
        # requests beside it with nothing said (the simulator: 60-token chats beside 12000-token prompts cut after
        # 0.12 s, +61% to +252%); costed at its body's estimate, no more than its arrival → end had room for (`_cost_gone`).
        gone = tr.first_ns is None and done and tr.end_ns is not None and room is not None
        if r.prompt_est is None and (tr.first_ns is not None or gone or (done and finished_unsaid(r))) \
                and (tr.status is None or tr.status < 400):
            est = self._body_estimate(tr)
            if est is not None and gone and est[0] > room[0]:
                most, in_flight_s, beside, costs = room
                r.prompt_cap = (est[0], in_flight_s, costs.prefill_tok_s, costs.source, beside)
                est = (most, est[1])
            if est is not None:
                r.prompt_est = est
            if est is not None and (est[0] > 0 or not gone):  # one costed none (no room) says so on its row alone
                why = _unsaid_reason(r)
                n = self.prompts_estimated[why] = self.prompts_estimated.get(why, 0) + 1
                if n == 1 or n % 1000 == 0:
                    log.warning("request %d: %s; its prefill is costed at an estimate of %.0f prompt tokens (%s), and "
                                "its row says so in energy_note (%d such requests so far)%s", tr.request_id,
                                UNSAID_NOTES[why], est[0], est[1], n, UNSAID_FIX.get(why, ""))
        return r.prompt_est[0] if r.prompt_est is not None else 0.0

    def _judge_host(self, t, a: attr.Attribution, other_pct, judged) -> None:
        """Count the requests' CPU energy in busy-host intervals and say when a spell of them begins (once) and ends.

        Only intervals with work are judged: an idle one's CPU energy goes to no request, and with the server idle
        a quiet host's own background is most of the little busy time there is."""
        judged = judged & (a.kind != attr.IDLE)
        if not judged.any():
            return
        busy = judged & (np.nan_to_num(other_pct) > BUSY_HOST_PCT)
        self._busy_cpu_j += float(a.dest[busy, attr.TO_REQUESTS, 1].sum())
        self._other_pct = float(other_pct[np.flatnonzero(judged)[-1]])
        if busy.any() and not self._busy_spell:
            k = int(np.flatnonzero(busy)[0])
            log.warning("%s: %s (intervals and requests from %.1f s on say so: other_cpu_pct, energy_note); fix: %s",
                        BUSY_HOST_FLAG, busy_host_text(float(other_pct[k]), "an interval",
                                                       "the CPU energy split among the requests"),
                        (int(t[k]) - self.t0_ns) / 1e9, BUSY_HOST_FIX)
        elif self._busy_spell and not busy[np.flatnonzero(judged)[-1]]:
            log.info("%s over: other processes used %.0f%% of the host's busy CPU time in the latest interval",
                     BUSY_HOST_FLAG, self._other_pct)
        self._busy_spell = bool(busy[np.flatnonzero(judged)[-1]])

    def _account(self, t, per_gpu, gpu, cpu, a: attr.Attribution, methods: list[str], costs: attr.WorkCosts,
                 host_s=None, other_s=None, judged=None, short_iv=None, low_iv=None, server_count=None,
                 work_j=None, serving=None, idle_missing=None, unjudged=False, aside_j=None, unplaced_iv=None,
                 undecided_iv=None, held_iv=None, asserted_iv=None) -> None:
        # aside_j: the energy of the GPUs serving none of the work per interval (their read ones', all of it idle);
        # work_j: the serving GPUs' energy per interval (NaN: one of them unread), `serving` their mask (None: all);
        # idle_missing: intervals where a GPU serving none of the work gave no reading: the requests' energy and every
        # read GPU's stay in the totals (by kind and by destination), the unread GPU's energy alone is out (0 J in the
        # attribution), and they are counted in Totals.idle_unknown_intervals, not gpu_unknown_intervals (the tuner
        # refuses a window on that one: a lost GPU that serves nothing would stop it for good). Their rows'
        # idle_energy_j stays empty: its value is unknown.
        work_j = gpu if work_j is None else work_j
        self._gpu_total = self._gpu_total + np.nan_to_num(per_gpu).sum(axis=0)
        # What _gpu_total leaves out, per GPU: the time its energy is unknown (an interval it gave no reading over adds
        # 0 J there), and whether the latest interval is such: a stalled counter would read as 0 W to a rate().
        unread = np.isnan(per_gpu)
        if unread.size:
            self._gpu_unknown_s = self._gpu_unknown_s + (unread * (np.diff(t) / 1e9)[:, None]).sum(axis=0)
            self._gpu_unread_now = unread[-1].copy()
        self._intervals_total += t.size - 1
        if not np.isnan(cpu).all():
            self._cpu_total = (self._cpu_total or 0.0) + float(np.nansum(cpu))
        by_kind = a.by_kind[:, 0].copy()
        # Unknown total where a serving GPU is unread (work_j NaN); unsplit, where any GPU is.
        gone = np.isnan(work_j) if serving is not None else np.isnan(gpu)
        if serving is not None and gone.any():
            # An interval whose total is unknown (a GPU unread) is in no kind's energy: split by serving GPUs, the
            # attribution's by_kind holds the others' sum there (the unread one as 0 J); unsplit, it holds 0 already.
            by_kind -= np.bincount(a.kind[gone], weights=np.nansum(per_gpu[gone], axis=1), minlength=by_kind.size)
        self._gpu_unknown_intervals += int(gone.sum())
        self._by_kind = self._by_kind + by_kind
        by_dest = a.by_dest[:, 0].copy()
        if idle_missing is not None and idle_missing.any():
            self._idle_unknown_intervals += int(idle_missing.sum())
        if aside_j is not None:
            self._not_serving_total += float(np.sum(aside_j))
        self._by_dest = self._by_dest + by_dest
        self._tokens_total += float(a.tokens.sum())
        self._tokens_attributed += float(a.request_tokens.sum())
        for k in range(t.size - 1):
            # J/token over intervals whose energy is known, is not mostly idle power taken out (NO_COUNTER_SHORT_FLAG)
            # and whose bypass count is not low (BYPASS_LOW_FLAG: bypass traffic's energy may be in the requests'; the
            # rule `analyze` leaves such requests out by), nor after a client's leave from a server of unknown kind
            # (`_unplaced`: a run-on for nobody may be in the requests' share, UNSURE_FLAG on their rows; before, kept:
            # +19% on the simulator's SGLang), nor past the 30 s a llama.cpp whole answer's run-on is placed to (`_run_on`:
            # its rest there too), nor over a batch answered 400 SGLang may run on, no server scraped (`_batch_run_on`),
            # nor closed with a whole answer in flight, no counter read (`held_whole_beside_j`), nor split before the
            # idle power was measured with idle time in them (`unmeasured_iv`). What is left out is counted by reason,
            # never silently.
            if a.tokens[k] <= 0 or np.isnan(work_j[k]):
                continue
            why = (NO_COUNTER_SHORT_FLAG if short_iv is not None and short_iv[k]
                   else BYPASS_LOW_FLAG if low_iv is not None and low_iv[k]
                   else UNSURE_FLAG if unplaced_iv is not None and unplaced_iv[k]
                   else GPUS_UNDECIDED_REASON if undecided_iv is not None and undecided_iv[k] else None)
            if why is None:
                self._recent.append((int(t[k + 1]), float(a.dest[k, attr.TO_REQUESTS, 0]), float(a.tokens[k])))
            else:
                n_iv, n_tok = self._jpt_left_out.get(why, (0, 0.0))
                self._jpt_left_out[why] = (n_iv + 1, n_tok + float(a.tokens[k]))
        while self._recent and self._recent[0][0] < int(t[-1]) - self.jpt_window_ns:
            self._recent.popleft()
        e = sum(x[1] for x in self._recent)
        n = sum(x[2] for x in self._recent)
        for tag in list(self.tags.values()) + self.closed_tags:
            self._tag_add(tag, t, gpu, cpu, a, methods, host_s, other_s, judged, server_count, work_j, per_gpu, serving,
                          unjudged, held_iv, self._split_asserted, asserted_iv)
        self.totals = Totals(
            gpu_energy_j=tuple(float(x) for x in self._gpu_total),
            gpu_unknown_s=tuple(float(x) for x in self._gpu_unknown_s),
            gpu_unread_now=tuple(bool(x) for x in self._gpu_unread_now),
            intervals=self._intervals_total,
            cpu_energy_j=self._cpu_total,
            energy_by_kind_j=tuple(float(x) for x in self._by_kind),
            tokens=self._tokens_total,
            j_per_token=e / n if n > 0 else None,
            energy_by_dest_j=tuple(float(x) for x in self._by_dest),
            tokens_attributed=self._tokens_attributed,
            costs=self._costs_state(costs),
            other_cpu_pct=self._other_pct,
            busy_host_requests_cpu_j=self._busy_cpu_j,
            cpu_unknown_requests=self.cpu_unknown_requests,
            flagged_requests=dict(self.flagged_requests),
            jpt_left_out=dict(self._jpt_left_out),
            idle_unknown_intervals=self._idle_unknown_intervals,
            gpu_unknown_intervals=self._gpu_unknown_intervals,
            idle_not_serving_j=self._not_serving_total,
            serving_changes=self._serving_changes,
            serving_mask=None if self._accounted_serving is None else tuple(bool(x) for x in self._accounted_serving),
            serving_undecided=bool(unjudged and self.n_gpus > 1),
            serving_asserted=self._split_asserted,
        )

    def _costs_state(self, costs: attr.WorkCosts) -> dict:
        fit = next(reversed(self.learner.fits.values()), None) if self.learner.fits else None
        return {
            "source": costs.source,
            "idle_w": costs.idle_w,
            "step_j": costs.step_j if costs.source == "fitted" else None,
            "decode_j": costs.decode_j if costs.source == "fitted" else None,
            "prefill_per_decode": costs.prefill_j / costs.decode_j if costs.decode_j > 0 else None,
            "r2": fit.r2 if fit is not None else None,
            "rel_rmse": fit.rel_rmse if fit is not None else None,
        }

    def _costs_row(self, edge: _Edge, setting: tuple, fit) -> dict:
        row = {
            "daemon_id": self.daemon_id,
            "time_utc": edge.wall_ns,
            "power_limits_w": ",".join("" if x is None else f"{x:g}" for x in setting),
            # A locked fit's idle power is not the unlocked one's at the same limits (workmodel.LockedSetting); null
            # where no reading carried the signs (a lock could not be seen), not "" (none seen).
            "sm_clock_locks_mhz": (",".join("" if x is None else f"{x:g}"
                                            for x in getattr(setting, "clocks", (None,) * len(setting)))
                                   if self._locks.seeing else None),
            "n_intervals": fit.n,
            "n_busy": fit.n_busy,
            "r2": fit.r2,
            "rel_rmse": fit.rel_rmse,
            "mature": fit.mature,
            "not_mature_reason": fit.reason or None,
        }
        names = ("idle_w", "step_j", "decode_j", "prefill_j", "ctx_j_per_ktoken")
        assert len(names) == len(FEATURES)
        row.update(dict(zip(names, fit.coef)))
        return row

    def _tag_add(self, tag: _Tag, t, gpu, cpu, a, methods, host_s=None, other_s=None, judged=None,
                 server_count=None, work_j=None, per_gpu=None, serving=None, unjudged=False, held_iv=None,
                 asserted=False, asserted_iv=None) -> None:
        # asserted: `serving` is daemon.serving_gpus's word alone (unconfirmed), asserted_iv its busy intervals there.
        mid = (t[:-1] + t[1:]) // 2
        end = tag.t1_ns if tag.t1_ns is not None else attr.NEVER
        inside = (mid >= tag.t0_ns) & (mid < end)
        if not inside.any():
            return
        tag.intervals += int(inside.sum())
        tag.gpu_j += float(np.nansum(gpu[inside]))
        # Its J/token is the serving GPUs' energy's, the split the requests get: GPUs that do none of the proxied work
        # are idle whole (+17.5% with one idle at 70 W beside a server at 400 W), said in its note.
        work = gpu if work_j is None else work_j
        tag.work_j += float(np.nansum(work[inside]))
        tag.work_missing = tag.work_missing or bool(np.isnan(work[inside]).any())
        if held_iv is not None:
            tag.held_whole_j += float(np.nansum(work[inside & held_iv]))
        if per_gpu is not None and serving is not None:
            tag.excluded.update(int(g) for g in np.flatnonzero(~serving))
            tag.excluded_j += float(np.nansum(per_gpu[np.ix_(inside, ~serving)]))
            tag.excluded_asserted = tag.excluded_asserted or (asserted and bool((~serving).any()))
        elif per_gpu is not None and per_gpu.shape[1] > 1 and unjudged:
            # Which GPUs serve not judged yet: every sampled GPU's energy in it there (once judged all serving, the
            # same figure is the serving GPUs', nothing to say).
            tag.all_gpus_intervals += int(inside.sum())
        if asserted_iv is not None:
            tag.asserted_intervals += int(np.count_nonzero(asserted_iv & inside))
        if per_gpu is not None:
            tag.unread.update(int(g) for g in np.flatnonzero(np.isnan(per_gpu[inside]).any(axis=0)))
        # The interval rows' own unproxied_energy_j (the scrape windows' bypass tokens already spread over the
        # intervals by the attribution): the tag's equals the sum of the rows inside it.
        tag.unproxied_j += float(a.dest[inside, attr.TO_UNPROXIED, 0].sum())
        tag.gpu_missing = tag.gpu_missing or bool(np.isnan(gpu[inside]).any())
        if not np.isnan(cpu[inside]).all():
            tag.cpu_j = (tag.cpu_j or 0.0) + float(np.nansum(cpu[inside]))
        tag.cpu_missing = tag.cpu_missing or bool(np.isnan(cpu[inside]).any())
        tag.tokens += float(a.tokens[inside].sum())
        tag.work = tag.work or bool((a.kind[inside] != attr.IDLE).any())
        tag.methods.update(m for m, i in zip(methods, inside) if i)
        if server_count is not None:
            tag.server_counts.update(c for c, i in zip(server_count, inside) if i)
        if judged is not None:
            tag.host_cpu_s += float(host_s[inside & judged].sum())
            tag.other_cpu_s += float(other_s[inside & judged].sum())

    def _emit_tags(self, force: bool = False) -> None:
        last_closed = self.edges[0].t_ns if self.edges else None
        ready = [tg for tg in self.closed_tags if force or (last_closed is not None and last_closed >= tg.t1_ns)]
        if not ready:
            return
        self.closed_tags = [tg for tg in self.closed_tags if tg not in ready]
        self.emit("tags", [self.tag_row(tg) for tg in ready])

    def _expire(self, now_ns: int) -> None:
        old = [rid for rid, r in self.requests.items() if now_ns - r.trace.arrival_ns > MAX_OPEN_S * 1e9]
        for rid in old:
            r = self.requests.pop(rid)
            self._live_seqs.pop(rid, None)  # its on_end never came: left, every later batch's span took its sequences
            self._release(r)
            r.trace.outcome = "expired"
            self.emit("requests", [self._request_row(r)])

    # --- rows --------------------------------------------------------------------------------

    def _interval_note(self, gpu: float, cpu: float, other_pct: float | None, work: bool, short: bool,
                       server_count: str | None, cache_unsaid: float = 0.0,
                       idle_unread: tuple[list[int], bool] | None = None) -> str | None:
        """An interval row's energy_note: for each figure of it that is empty or may be partial, why and the fix (the
        request rows' wording where the cause is the same); None where every figure is whole. `idle_unread`: the
        GPUs serving none of the proxied work without energy here, and whether a serving one is unread too (`_idle_unread`)."""
        aside, work_unread = idle_unread if idle_unread is not None else ([], False)
        notes = [None if not np.isnan(gpu) else _gpu_missing_note("this interval") if work_unread or not aside
                 else _idle_gpu_missing_note(self._named(aside), "this interval", "requests_energy_j are whole")]
        if aside:
            notes.append(_idle_unknown_note(self._named(aside)))
        if np.isnan(cpu):
            notes.append(_cpu_missing_note("this interval's start or end") if self.rapl else NO_RAPL_NOTE)
        elif work and other_pct is not None and other_pct > BUSY_HOST_PCT:
            notes.append(_busy_host_note(other_pct, "this interval"))
        elif work and other_pct is None:
            notes.append(self._unjudged_note())
        if short and not np.isnan(gpu):
            notes.append(f"{NO_COUNTER_SHORT_FLAG}: {NO_COUNTER_READ} and live for under "
                         "half of it: its requests' split rests on the idle power taken out of the rest and the "
                         f"readings' timing (left out of the daemon's J/token); fix: {NO_COUNTER_SHORT_FIX}")
        if server_count is not None and bypass_count_low(server_count):
            off = bypass_count_may_be(server_count)
            notes.append(_count_low_note(server_count, "here", f"server_tokens and unproxied_energy_j {off} and bypass "
                                                               "traffic's energy may be in requests_energy_j, or theirs "
                                                               "in it"))
        notes.append(_interval_cache_note(cache_unsaid))
        return _joined(*notes)

    def _unjudged_note(self) -> str:
        """Why a CPU figure beside work has no other_cpu_pct (an interval's, a tag's), and the fix."""
        why = ("the server's processes were not found on this host (the log says why)" if self._server_unknown_said
               else "whose CPU time the host spent is not read here: simulated RAPL (it follows the server alone), "
                    "no proxy.upstream, or its reads failed")
        return (f"other_cpu_pct empty: not judged ({why}); cpu_energy_j is the whole package's and could "
                f"include other processes' energy; fix: {BUSY_HOST_FIX}")

    def _named(self, gpus) -> str:
        """Sampled GPUs (by position) as the log names them: NVML index and UUID (`gpu_names`), never a position."""
        return ", ".join(self.gpu_names[g] if g < len(self.gpu_names) else f"gpu{g}" for g in gpus)

    def _tag_note(self, tg: _Tag, row: dict) -> str | None:
        """A tag row's energy_note: for each figure of it that is empty or may be partial, why and the fix, in the
        interval and request rows' words where the cause is the same (their builders); None where every figure is
        whole (`server_count` off or slots_only is said by that column alone, as an interval's is)."""
        notes = [_gpu_missing_note("part of this window") if tg.work_missing else None]
        if tg.all_gpus_intervals and not tg.excluded:
            notes.append(f"which GPUs serve not yet judged over {tg.all_gpus_intervals} of its {tg.intervals} "
                         "intervals: gpu_energy_j and gpu_j_per_token there hold every sampled GPU's energy, a GPU "
                         "serving none of the proxied work included (once judged, a window holds the serving GPUs' "
                         "alone); fix: a window after the daemon's log says which GPUs serve, or daemon.gpus of the "
                         "server's GPUs alone")
        if tg.excluded and tg.intervals:
            total = (f"all sampled GPUs {tg.gpu_j - sum(_tag_trim_j(tg)):.4g} J" if not tg.gpu_missing else
                     f"the node total unknown: GPU(s) {self._named(sorted(tg.unread))} gave no energy reading over part of "
                     "it (lost or failing reads; the samples' error column says which; restarting the daemon, "
                     "daemon.gpus without a GPU that is gone, measures the others' total)")
            # Left out by daemon.serving_gpus, the power has not said they idled (SERVING_ASSERTED_FLAG's note beside).
            why = (f"daemon.serving_gpus leaves out GPU(s) {self._named(sorted(tg.excluded))}, so their "
                   f"{tg.excluded_j:.4g} J over this window is counted idle, not its work" if tg.excluded_asserted else
                   f"GPU(s) {self._named(sorted(tg.excluded))} drew no more when it ran than when idle, so their "
                   f"{tg.excluded_j:.4g} J over this window is idle, not its work")
            notes.append(f"gpu_energy_j and gpu_j_per_token are of the GPUs serving the proxied work alone, as its "
                         f"requests' split: {why} ({total})"
                         + (f"; {tg.all_gpus_intervals} of its {tg.intervals} intervals, before the daemon judged so, "
                            "hold every sampled GPU's energy" if tg.all_gpus_intervals else "")
                         + ("" if tg.excluded_asserted and tg.asserted_intervals  # its SERVING_ASSERTED_FLAG part's fix
                            else f"; fix: {SERVING_ASSERTED_FIX}" if tg.excluded_asserted
                            else "; fix: daemon.gpus can leave them out"))
        if tg.asserted_intervals:
            notes.append(_serving_asserted_words(f"{tg.asserted_intervals} busy interval(s) of its {tg.intervals} were",
                                                 "gpu_energy_j (and gpu_j_per_token) holds"))
        if _unresolved_tag(tg):
            notes.append(f"{TAG_UNHELD_FLAG}: shorter than the energy counter's refresh (up to "
                         f"{COUNTER_STEP_S * 1e3:.0f} ms), and a GPU's counter did not move within "
                         f"{tagedge.HOLD_MAX_S:.1f} s of its start or stop to hold its edges past a refresh: its edges "
                         "read one refresh's value or two (0 J or about a whole refresh's energy), so gpu_energy_j, "
                         f"unproxied_energy_j and gpu_j_per_token are empty (not zero); fix: {TAG_UNHELD_FIX}")
        elif tg.held is False and tg.t1_ns is not None and METHOD_COUNTER in tg.methods:
            notes.append(f"{TAG_UNHELD_FLAG}: a GPU's energy counter did not move within {tagedge.HOLD_MAX_S:.1f} s of "
                         "this window's start or stop, so its edges were read at the calls, each up to one refresh "
                         "stale (100 ms on an H200): gpu_energy_j is good to about a refresh of the GPUs' power at each "
                         f"edge, not to a percentage; fix: {TAG_UNHELD_FIX}")
        misdated_j = sum(j for g, j in enumerate(tg.misdated_j) if g not in tg.excluded)
        # against the least the window may truly hold: an over-read figure would widen its own allowance
        if (row["gpu_energy_j"] is not None and tg.t1_ns is not None
                and misdated_j > max(tagedge.MISDATED_MAX_SHARE * max(row["gpu_energy_j"] - misdated_j, 0.0),
                                     tagedge.MISDATED_MAX_J)):
            by = (f"may be off by up to {misdated_j:.3g} J (the GPUs' power there times that)" if math.isfinite(misdated_j)
                  else "may be off by any amount (those errors could span a whole refresh: the power there is unbounded)")
            notes.append(f"{tagedge.TAG_LATE_FLAG}: the daemon's counter reads at this window's edges came far apart "
                         "(a loaded host kept its polls waiting), so the counter refreshes its edges hold are dated "
                         f"only to within {tg.off_ms:.0f} ms: gpu_energy_j and gpu_j_per_token {by}, over "
                         f"{100 * tagedge.MISDATED_MAX_SHARE:.0f}% of it and {tagedge.MISDATED_MAX_J:g} J; "
                         f"fix: {tagedge.TAG_LATE_FIX}")
        if tg.intervals == 0 and tg.t1_ns is not None:
            notes.append("no interval inside: the GPU reads at this window's start and stop failed and it is shorter "
                         "than half a sampling interval, so no energy was measured over it: gpu_energy_j, "
                         "cpu_energy_j and gpu_j_per_token are empty (not zero); fix: a window of several sampling "
                         "intervals (daemon.interval_s), and the log's NVML errors")
        if tg.held_whole_j > 0 and tg.held_whole_j >= QUEUED_BESIDE_MIN_SHARE * tg.work_j:
            # As its requests' rows there say (`rowtext._held_whole_beside`, out of the live J/token): before, its
            # J/token unflagged, a window over whole answers held past their hold beside streams +42% (0.797 J/token
            # for 0.561: 10,036 tokens of 14,250).
            notes.append(f"{UNSURE_FLAG}: {100 * min(tg.held_whole_j / tg.work_j, 1.0):.0f}% of its serving GPUs' "
                         "energy is from intervals closed while a whole answer was still in flight (past the daemon's "
                         "hold for its intervals, or at its stop), no server token counter read (scrape.server = "
                         "none): that answer's tokens there came after them, in none of this window's tokens, so "
                         "gpu_j_per_token may be high by them (its requests' rows there say so, left out of "
                         f"powerprof_joules_per_token); fix: {HELD_WHOLE_FIX}")
        if tg.counted_low and tg.unproxied_j > 0:
            notes.append(f"{tg.counted_low} request(s) in this window carried no token counts, and the server counted "
                         "more tokens than their chunks (several a chunk: speculative decoding, a busy server): that "
                         "surplus's energy is in unproxied_energy_j as if bypass traffic ran, and gpu_j_per_token is "
                         "high by it; fix: clients send \"stream_options\": {\"include_usage\": true}, or start vLLM "
                         "with --enable-force-include-usage")
        if tg.cut and (tg.unproxied_j > 0 or tg.gone_first or tg.cut_unplaced):
            gone = (f", {tg.gone_first} before their first token (each prefill costed at an estimate from its body, "
                    "bounded by its time in flight, that may be high or low: the requests beside say "
                    f"{GONE_PREFILL_FLAG})") if tg.gone_first else ""
            gone += (f", {tg.cut_unplaced} of them whole answers a server may run on to their end for nobody, unplaced "
                     f"(scrape.server = none: no server kind known; their rows and those beside say {UNSURE_FLAG}; "
                     f"fix: {UNPLACED_FIX})") if tg.cut_unplaced else ""
            notes.append(f"{tg.cut} request(s) in this window were cut by their clients{gone}: what the server still ran "
                         "for them after they left (a prefill it finished, tokens it counted and never sent) is in "
                         "unproxied_energy_j as if bypass traffic ran, or in the shares of the requests beside them; "
                         "fix: none from the server (it says nothing per request of what it ran for a client gone); "
                         "clients that give up under load: a longer timeout, or fewer requests at once")
        if tg.cpu_missing or (row["cpu_energy_j"] is None and tg.methods):
            notes.append(_cpu_missing_note("part of this window's intervals") if self.rapl else NO_RAPL_NOTE)
        elif tg.work and row["other_cpu_pct"] is not None and row["other_cpu_pct"] > BUSY_HOST_PCT:
            notes.append(_busy_host_note(row["other_cpu_pct"], "this window"))
        elif tg.work and row["other_cpu_pct"] is None and row["cpu_energy_j"] is not None:
            notes.append(self._unjudged_note())
        method = row["energy_method"]
        if not tg.work_missing and tg.intervals and method in (METHOD_POWER, METHOD_AVG_POWER):
            notes.append(f"no energy counter: part of this window was {NO_COUNTER_READ}, energy_method {method}: "
                         "its gpu_energy_j is integrated from them, not counted by the GPU, and a short burst of work "
                         "can fall between two reads; fix: a GPU with an energy counter (Volta and newer), or longer "
                         "windows")
        if not tg.work_missing and tg.intervals and tg.tokens <= 0:
            notes.append("no J/token: no tokens were seen through the proxy over this window (idle, or its requests "
                         "went straight to the server: unproxied_energy_j holds theirs), so gpu_j_per_token is empty; "
                         "fix: send the window's requests through the proxy (proxy.listen)")
        if tg.methods and bypass_count_low(row["server_count"]):
            # The consequence follows the count's way (low, or low or high: schema.BYPASS_COUNT_TWO_WAY), as
            # `_count_low_note`'s own words do: a one-way "may be low" beside "may be low or high" contradicted it.
            two_way = bypass_count_may_be(row["server_count"]) != "may be low"
            notes.append(_count_low_note(row["server_count"], "over this window",
                                         ("unproxied_energy_j may be low or high and gpu_j_per_token high or low "
                                          "(bypass traffic's energy may be in it, or the proxied traffic's in "
                                          "unproxied_energy_j" if two_way else
                                          "unproxied_energy_j may be low and gpu_j_per_token high (bypass traffic's "
                                          "energy may be in it")
                                         + ": `powerprof analyze` leaves this window out of its tag's figures)"))
        notes.append(self.unsampled_note if tg.intervals else None)  # the server on a GPU not sampled, as it closed
        if tg.closed_by == "shutdown":
            notes.append("closed at shutdown: the daemon stopped with this window open, so it ends at the daemon's "
                         "last sample, not at a stop (its figures cover it up to then); fix: powerprof tag stop "
                         f"{tg.name} before stopping the daemon")
        return _joined(*notes)

    def _interval_rows(self, edges, t, gpu, cpu, methods, a: attr.Attribution, server, costs, other_pct=None,
                       server_count=None, short_iv=None, cache_iv=None, unsure=None, per_gpu=None,
                       serving=None, idle_missing=None, low_counted=None, unmeasured_j=None,
                       undecided_j=None, asserted_iv=None) -> None:
        rows = []
        unsaid = cache_iv if cache_iv is not None else np.zeros(t.size - 1)
        for k in range(t.size - 1):
            dur = (t[k + 1] - t[k]) / 1e9
            pct = (None if other_pct is None or np.isnan(other_pct[k]) or np.isnan(cpu[k]) else float(other_pct[k]))
            count = server_count[k] if server_count is not None else None
            rows.append(
                {
                    "daemon_id": self.daemon_id,
                    "t_start_utc": edges[k].wall_ns,
                    "t_end_utc": edges[k + 1].wall_ns,
                    "t_start_mono_s": (int(t[k]) - self.t0_ns) / 1e9,
                    "duration_s": dur,
                    "kind": attr.KIND_NAMES[a.kind[k]],
                    "gpu_energy_j": None if np.isnan(gpu[k]) else float(gpu[k]),
                    "cpu_energy_j": None if np.isnan(cpu[k]) else float(cpu[k]),
                    "other_cpu_pct": pct,
                    "energy_method": methods[k],
                    "avg_gpu_power_w": float(gpu[k]) / dur if dur > 0 and not np.isnan(gpu[k]) else None,
                    "proxy_tokens": float(a.tokens[k]),
                    "server_tokens": (None if server is None or (self.recon.server_from_ns is not None
                                                                  and t[k + 1] <= self.recon.server_from_ns)
                                      else float(server[k])),
                    "server_count": count,
                    "n_prefill": int(a.n_prefill[k]),
                    "n_decoding": int(a.n_decoding[k]),
                    "requests_energy_j": float(a.dest[k, attr.TO_REQUESTS, 0]),
                    "idle_energy_j": (None if idle_missing is not None and idle_missing[k]
                                      else float(a.dest[k, attr.TO_IDLE, 0])),
                    "unproxied_energy_j": float(a.dest[k, attr.TO_UNPROXIED, 0]),
                    "prefill_tokens": float(a.features[k, 3]),
                    "work_costs": costs.source,
                    "energy_note": _joined(self._interval_note(gpu[k], cpu[k], pct, a.kind[k] != attr.IDLE,
                                                               bool(short_iv[k]) if short_iv is not None else False,
                                                               count, unsaid[k], _idle_unread(per_gpu, serving, k)),
                                           _counter_flat_note(gpu[k:k + 1] if per_gpu is None else per_gpu[k])
                                           if methods[k] != METHOD_NONE and dur > 0 else None, self.unsampled_note,
                                           _counted_low_interval_note(int(low_counted[k]), float(server[k]))
                                           if low_counted is not None and low_counted[k] else None,
                                           _idle_unmeasured_interval_note(float(unmeasured_j[k]), float(gpu[k]),
                                                                          self.learner.held_since_ns is not None)
                                           if unmeasured_j is not None else None,
                                           _gpus_undecided_interval_note(float(undecided_j[k]), float(gpu[k]))
                                           if undecided_j is not None else None,
                                           _serving_asserted_interval_note(asserted_iv is not None
                                                                           and bool(asserted_iv[k]))),
                }
            )
        unsure = unsure or {}
        if unsure or self._iv_parked:  # in order: behind one that waits (`_unpark_intervals`)
            self._iv_parked.extend([row, int(t[k]), int(t[k + 1]), unsure.get(k, 0), int(t[-1])]
                                   for k, row in enumerate(rows))
            rows = self._unpark_intervals(int(t[-1]))
        self.emit("intervals", rows)

    def _unpark_intervals(self, now_ns: int | None) -> list[dict]:
        """The parked interval rows, in order, up to the first whose requests that may say its unsaid hits have not
        all ended (held at most prompt_hold_s past its close; `now_ns` None: shutdown, every one). Each says
        CACHE_UNSAID_FLAG where its hits are unsaid still (those of a request still live then included: never
        silent)."""
        out = []
        while self._iv_parked:
            row, t0, t1, wait, closed = self._iv_parked[0]
            if (wait and now_ns is not None and now_ns - closed < self.prompt_hold_ns
                    and self._cache_still_waiting((wait,))):
                break
            self._iv_parked.popleft()
            if wait:
                row["energy_note"] = _joined(row["energy_note"], _interval_cache_note(self._cache_unsaid(t0, t1)))
            out.append(row)
        return out

    def _request_row(self, r: LiveRequest) -> dict:
        for t0, t1, j in r.cache_unsure:  # judged now that the requests whose end may say those hits have ended
            self._judge_unsure(r, t0, t1, j)
        r.cache_unsure = []
        if _cache_unsaid_candidate(r):
            r.cache_unsaid = max(self._cache_unsaid(*self._hit_span(r)), r.cache_unsaid_early)
        self._settle_late(r)
        row = self._request_fields(r)
        for flag in _request_flags(r, self.best_of_ignored):
            self.flagged_requests[flag] += 1
        if row["cpu_energy_j"] is None and row["energy_note"] and CPU_MISSING_NOTE in row["energy_note"]:
            self.cpu_unknown_requests += 1
        # Strings from clients and the upstream (model, stop reason, errors) as valid Unicode: a lone
        # surrogate (a JSON `\\ud800`) would send the whole row to quarantine.
        return {k: valid_text(v) if isinstance(v, str) else v for k, v in row.items()}

    def _tags_over(self, tr) -> list:
        """The tag windows, open or closed, that the request's run (arrival → end) overlaps."""
        end = tr.end_ns if tr.end_ns is not None else attr.NEVER
        return [tg for tg in [*self.tags.values(), *self.closed_tags]
                if tg.t0_ns < end and (tg.t1_ns is None or tr.arrival_ns < tg.t1_ns)]

    def _tags_counted_low(self, r: LiveRequest) -> None:
        """Tell the tag windows its count-less stream ran in that its surplus's energy went to their unproxied
        (`_Tag.counted_low`), once: at the close its end fell in, before its row may be parked (`_late_parked`) past
        its tag's row, and at its row for one made otherwise (expired, at shutdown). Counted at its row alone, a row
        parked for a prompt's cached count beside it came after its tag's row went out, whose note then said nothing
        of the 10.4 J its unproxied held (the ledger's scene). A cut one's surplus is what the server ran after it
        left: its window counts it as cut (`on_end`)."""
        tr = r.trace
        if (r.low_told or tr.outcome == "client_disconnected" or r.server_ahead < 0.5
                or not (_count_estimated(r) or (tokens_unknown(r) and counted_low(r)))):
            return
        r.low_told = True
        for tg in self._tags_over(tr):
            tg.counted_low += 1

    def _chunk_counted_low_said(self, r: LiveRequest) -> None:
        """Counted, and logged the first time and every 1000th: most OpenAI clients stream without asking for usage,
        and under speculative decoding (or a busy vLLM) every such request is counted low, its rest in unproxied;
        rows alone said it, where nobody running the daemon looks first."""
        self.chunk_counted_low += 1
        n = self.chunk_counted_low
        if n == 1 or n % 1000 == 0:
            log.warning("request %d: its stream carried no token counts and the server counted %.0f token(s) more than "
                        "the proxy's chunks while it ran: several tokens a chunk (speculative decoding, a busy server), "
                        "or requests sent to the server past the proxy beside it; its count and energy are likely low, "
                        "the rest in unproxied, and its row says so (%d such requests so far); fix, unless traffic "
                        "bypasses the proxy: clients send \"stream_options\": {\"include_usage\": true}, or start vLLM "
                        "with --enable-force-include-usage", r.trace.request_id, r.server_ahead, n)

    def _request_fields(self, r: LiveRequest) -> dict:
        tr = r.trace
        c = tr.counts
        gen = c.generated_tokens if c is not None and c.generated_tokens is not None else (tr.tokens_seen or None)
        lie = c.count_problem if c is not None else None
        if lie is not None:
            # The server's count contradicts its stream: neither is believed (the timing rule's), so no
            # token count of it is stored as one, and it gives no J/token; both counts are in `error`.
            gen = None
        decode_s = (tr.last_ns - tr.first_ns) / 1e9 if tr.first_ns is not None and tr.last_ns is not None else None
        estimated = _count_estimated(r)
        error = _with_late(tr.error, r.late)
        cpu_j = r.cpu_j if r.cpu_known and not r.cpu_missing and r.gpu_j > 0 else None
        cpu_unknown = self.rapl and cpu_j is None and r.gpu_j > 0
        # Weighted by its CPU joules from each interval: how much of its CPU figure stood beside others' work.
        other_pct = r.cpu_other_pct_j / r.cpu_judged_j if cpu_j is not None and r.cpu_judged_j > 0 else None
        # No count at all (its energy_note says why: rowtext._no_tokens_note) is as low: logged, its windows told.
        if (estimated or (tokens_unknown(r) and counted_low(r))) and r.server_ahead >= 0.5:
            if estimated:
                note = (f"tokens counted one a chunk (the stream carried no counts: ask for usage, stream_options "
                        f"include_usage); the server's counter ran {r.server_ahead:.0f} token(s) ahead of the proxy's "
                        "in the intervals it was live in (several tokens a chunk under speculative decoding, or bypass "
                        "traffic): its count is likely low, and those tokens' energy is in unproxied")
                error = note if error is None else f"{error}; {note}"
            self._chunk_counted_low_said(r)
            self._tags_counted_low(r)
        if lie is not None:
            note = f"{lie}: generated_tokens and J/token left empty ({COUNT_FIX})"
            error = note if error is None else f"{error}; {note}"
        if r.usage_above is not None and lie is None:
            note = _usage_above_note(r)
            error = note if error is None else f"{error}; {note}"
        if r.usage_below is not None and lie is None:
            note = _usage_below_note(r)
            error = note if error is None else f"{error}; {note}"
        return {
            "daemon_id": self.daemon_id,
            "request_id": tr.request_id,
            "t_arrival_utc": tr.arrival_wall_ns,
            "t_first_utc": tr.first_wall_ns,
            "t_last_utc": tr.last_wall_ns,
            "t_end_utc": tr.end_wall_ns,
            "ttft_s": (tr.first_ns - tr.arrival_ns) / 1e9 if tr.first_ns is not None else None,
            "decode_s": decode_s,
            "method": tr.method,
            "endpoint": tr.endpoint,
            "api": tr.api,
            "model": (bounded_text(c.model) if c is not None and c.model else None) or tr.model,  # tr's: cut by the proxy
            "stream": tr.stream,
            "tag": tr.tag,
            "status": tr.status,
            "outcome": tr.outcome,
            "error": error,
            # An embeddings request's is its input's length (usage.prompt_tokens, read by the proxy).
            "prompt_tokens": c.prompt_tokens if c is not None else (told_prompt_tokens(r) if r.uncounted else None),
            "generated_tokens": gen,
            "decode_tokens": max(gen - 1, 0) if gen else None,
            "token_source": c.token_source if c is not None else ("counted" if tr.tokens_seen else "none"),
            # Without a summary, an OpenAI-style stream's tokens were counted one per chunk.
            "tokens_estimated": estimated,
            "stop_reason": bounded_text(c.stop_reason) if c is not None else None,
            "response_bytes": tr.response_bytes,
            # No share at all is not a measured zero: left empty, with the reason.
            "gpu_energy_j": r.gpu_j if r.gpu_j > 0 and not r.gpu_missing else None,
            "cpu_energy_j": cpu_j,
            "other_cpu_pct": other_pct,
            "energy_note": _joined(GPU_MISSING_NOTE if r.gpu_missing else _approximate_note(r, self.best_of_ignored) if r.gpu_j > 0
                                   else _no_energy_reason(r), CPU_MISSING_NOTE if cpu_unknown else None,
                                   _no_counter_short_note(r), _counter_short_note(r), _bypass_low_note(r),
                                   _busy_host_note(other_pct),
                                   _before_first_note(r), self.unsampled_note if r.gpu_j > 0 else None,
                                   _idle_unmeasured_note(r, cpu_j), _gpus_undecided_note(r)),
            "prompt_tokens_estimate": r.prompt_est[0] if r.prompt_est is not None and told_prompt_tokens(r) is None else None,
            "cached_prompt_tokens": c.cached_tokens if c is not None and c.invalid is None else None,
            "attributed_tokens": r.tokens,
            "gpu_j_per_token": (float(attr.per_token(r.gpu_j, r.tokens))
                                if r.tokens > 0 and r.gpu_j > 0 and lie is None and r.usage_above is None
                                and r.usage_below is None
                                and not r.gpu_missing else None),
            "recorder_error": tr.recorder_error,
        }

    def tag_row(self, tg: _Tag) -> dict:
        dur = (tg.t1_ns - tg.t0_ns) / 1e9 if tg.t1_ns is not None else None
        # J/token of the proxied traffic: the window's energy less bypass traffic's, over the proxied tokens. Bypass
        # energy in it otherwise sat over tokens the proxy never saw (a third of the tokens bypass: +56%, unmarked).
        # Where the server's count may be low, unproxied may be too: `server_count` says so (schema.bypass_count_low).
        # Its stop edge held past a counter refresh: what the serving GPUs drew after the stop call is not its own.
        work_j = tg.work_j - sum(j for g, j in enumerate(_tag_trim_j(tg)) if g not in tg.excluded)
        proxied_j = work_j - tg.unproxied_j
        unknown = (tg.work_missing or tg.intervals == 0  # the serving GPUs' energy (its J/token's)
                   or _unresolved_tag(tg))
        dur = None if dur is None else dur - tg.held_s  # the window the client asked for: to its stop call
        row = {
            "daemon_id": self.daemon_id,
            "name": tg.name,
            "t_start_utc": tg.wall0_ns,
            "t_end_utc": None if tg.wall1_ns is None else tg.wall1_ns - int(tg.held_s * 1e9),
            "duration_s": dur,
            # The serving GPUs' (its J/token's, as the requests' split): the others' joules are named in energy_note.
            "gpu_energy_j": None if unknown else work_j,
            "cpu_energy_j": None if tg.cpu_missing else tg.cpu_j,
            "other_cpu_pct": (100.0 * tg.other_cpu_s / tg.host_cpu_s
                              if tg.host_cpu_s > 0 and tg.cpu_j is not None and not tg.cpu_missing else None),
            "energy_method": (METHOD_NONE if _unresolved_tag(tg) else weakest_method(tg.methods) if tg.methods
                              else None),
            "unproxied_energy_j": None if unknown else tg.unproxied_j,
            "proxy_tokens": tg.tokens,
            "gpu_j_per_token": proxied_j / tg.tokens if tg.tokens > 0 and not unknown else None,
            "closed_by": tg.closed_by,
            "server_count": tag_server_count(tg.server_counts),
        }
        row["energy_note"] = self._tag_note(tg, row)
        return row


def _counter_measured(methods) -> np.ndarray:
    """(K,) intervals whose energy is a counter difference: each end may read the counter up to a refresh stale, which
    a request's figure feels as a refresh's joules at each of its edges (rowtext.COUNTER_SHORT_FLAG)."""
    return np.array([m == METHOD_COUNTER for m in methods], dtype=bool)


def _tag_trim_j(tg: _Tag) -> list[float]:
    """Per GPU, J: what a tag window's held edges' counter values hold from outside it (tagedge.py), out of its figures."""
    n = max(len(tg.start_trim_j), len(tg.stop_trim_j))
    return [(tg.start_trim_j[g] if g < len(tg.start_trim_j) else 0.0)
            + (tg.stop_trim_j[g] if g < len(tg.stop_trim_j) else 0.0) for g in range(n)]


def _add_misdated(tg: _Tag, edge) -> None:
    """A held edge's misdating bound (tagedge.StopEdge.misdated_j) added to its window's."""
    if len(edge.misdated_j) == len(edge.trim_j):
        had = tg.misdated_j or (0.0,) * len(edge.misdated_j)
        tg.misdated_j = tuple(a + b for a, b in zip(had, edge.misdated_j))
        tg.off_ms = max(tg.off_ms, edge.off_ms)


def _unresolved_tag(tg: _Tag) -> bool:
    """A counter-measured tag window shorter than the counter's coarsest refresh whose edges could not be held past a
    refresh (tagedge.py: a counter that did not move in time): its edges read one refresh's value or two, 0 J or about
    a whole refresh's energy, so it has no GPU figure (docs/collectors.md, "A window shorter than the counter's
    refresh")."""
    return (tg.held is False and tg.t1_ns is not None and METHOD_COUNTER in tg.methods
            and (tg.t1_ns - tg.t0_ns) / 1e9 < COUNTER_STEP_S)


def _undecided_gpus_j(per_gpu: np.ndarray) -> np.ndarray:
    """Per interval (K, G per GPU), the energy of every GPU but the one drawing least: what the work's figure holds too
    much at most where which GPUs serve is not judged (at least one does); 0 J where no GPU read."""
    read = np.where(np.isnan(per_gpu), np.inf, per_gpu)
    least = read.min(axis=1)
    return np.where(np.isfinite(least), np.clip(np.nansum(per_gpu, axis=1) - least, 0.0, None), 0.0)


def _idle_unread(per_gpu, serving, k: int) -> tuple[list[int], bool] | None:
    """The sampled GPUs (by position) serving none of the proxied work without energy over interval k, and whether a
    serving one is unread too; None where none of the former is."""
    if per_gpu is None or serving is None:
        return None
    unread = np.isnan(per_gpu[k])
    if not (unread & ~serving).any():
        return None
    return [int(g) for g in np.flatnonzero(unread & ~serving)], bool((unread & serving).any())


def _prompt_sequences(r: LiveRequest) -> int:
    """The sequences among which the request's prompt figure (`told_prompt_tokens`, or its estimate) is divided for each
    one's context: all of them (n choices × prompts) where the figure sums each task's (llama.cpp: a task per choice,
    each prefilling the prompt in its own slot); its prompts alone where each prompt is said once for its n choices
    (vLLM and SGLang compute it once: the other choices find it in the prefix cache, still in their context), as
    continuous usage and an estimate from the body say it too. Its prefill work is the figure as said either way:
    what the server computed (the cache hits are no prefill work). Before, vLLM's once-said prompt was divided by
    the n choices as well: n = 2 chat -4.6% under its truth (bench/attribution_mixed.py --flavour vllm)."""
    seqs = max(r.trace.extra.get("sequences", 1), 1)
    c = r.trace.counts
    if c is not None and c.prompt_tokens is not None and c.prompt_each_task:
        return seqs
    return max(seqs // max(r.trace.extra.get("choices", 1), 1), 1)


def prefill_rate_shown(tr: RequestTrace) -> tuple[float, float] | None:
    """The prefill rate (tokens a second) a finished stream's time to first token shows, a bound that errs low, and its
    whole prompt (the context that prefill attended over), for a batch 400's span (`Ledger._batch_end_ns`); None where
    it shows none. Only a single sequence's (a batch's or n > 1's
    first token comes after its first prompt's prefill, not all of them: 8 prompts at 0.07 s read 114,286 tok/s, truth
    16,000) whose server said a cached count, early or at its end, the larger taken off its prompt: a cache hit's tiny
    time read over its whole prompt taught 10x and more (200,000 tok/s beside 16,000), and a server that says no cached
    count (SGLang's default) may have hit its cache all the same. Its time holds its queueing too: it errs low."""
    c = tr.counts
    if (tr.outcome != "ok" or tr.stream is not True or tr.first_ns is None or tr.first_ns <= tr.arrival_ns
            or tr.extra.get("sequences", 1) != 1 or (c is not None and c.invalid)):
        return None
    p = c.prompt_tokens if c is not None and c.prompt_tokens is not None else tr.extra.get("prompt_tokens")
    said = [k for k in (tr.extra.get("cached_tokens"), c.cached_tokens if c is not None else None)
            if isinstance(k, (int, float))]
    if not isinstance(p, (int, float)) or not said or p - max(said) < BATCH_PREFILL_LEARN_MIN:
        return None
    return (p - max(said)) / ((tr.first_ns - tr.arrival_ns) / 1e9), float(p)


def _cached_tokens(r: LiveRequest) -> float:
    """Of the request's prompt figure, the tokens the server said it found in its prefix cache (no prefill work); 0
    where it did not say (then its whole prompt is costed as computed: `_cache_unsaid_note`). Before its end, the
    count said early with the prompt's length (`told_prompt_tokens`: SGLang's meta_info, continuous usage's details)."""
    c = r.trace.counts
    if c is not None and c.prompt_tokens is not None:
        return float(c.cached_tokens) if c.cached_tokens is not None and c.invalid is None else 0.0
    if c is not None and c.invalid:
        return 0.0
    k, p = r.trace.extra.get("cached_tokens"), told_prompt_tokens(r)
    return float(min(k, p)) if k is not None and p is not None else 0.0


def _prefill_cached(r: LiveRequest) -> float:
    """Of the request's prompt figure, the cached tokens that were no prefill work of it: its said cached count
    (`_cached_tokens`), or none where its prompt was prefilled apart (`prefilled_apart`): SGLang's n > 1 choices each
    say the prompt but one cached, found there by the request SGLang prefilled it in, for this one, first. That
    request's own hit is said nowhere: the prompt is costed whole, and a hit on /metrics beyond the said counts flags
    it (CACHE_UNSAID_FLAG). Before: 1 token of a 4000-token prompt costed, its energy on the requests beside it."""
    return 0.0 if r.prefilled_apart else _cached_tokens(r)


def _first_token_seen(tr) -> int | None:
    """Its first token's time as the proxy saw it come; None for a non-streamed answer (`spread`), whose first_ns is
    where its tokens were spread from (its arrival, or the server's decode time back from its end), not seen. vLLM
    counts a prefix-cache hit on /metrics as its prefill step's output comes (with the first token): a whole answer's
    hit rises anywhere up to its end. Looked for at its arrival alone, vLLM 0.32's rise a scrape later went unmatched
    or took the next turn's said count, whose own hit then read unsaid: said counts flagged, unsaid ones missed."""
    return None if tr.extra.get("spread") else tr.first_ns


def _known_cached(r: LiveRequest) -> float:
    """The prefix-cache hits the daemon knows the request met: the cached count its answer said, and where its prompt
    figure is said once for its n choices (vLLM, SGLang: `_prompt_sequences`) the other choices', which find the
    prompt cached (all of it but its last token each: at most what a block-wise cache finds)."""
    c = r.trace.counts
    if c is None or c.prompt_tokens is None or c.invalid is not None:
        return 0.0
    choices = max(r.trace.extra.get("choices", 1), 1)
    prompts = _prompt_sequences(r)
    if r.prefilled_apart:  # every choice found its prompt cached, said or not (SGLang's chat says it only when asked)
        return float(choices * max(c.prompt_tokens - prompts, 0))
    shared = (choices - 1) * max(c.prompt_tokens - prompts, 0) if choices > 1 and not c.prompt_each_task else 0
    return _cached_tokens(r) + float(shared)


def _count_estimated(r: LiveRequest) -> bool:
    """Its tokens were counted one a chunk, its stream carrying no counts (nor scaled to the server's final one)."""
    tr, c = r.trace, r.trace.counts
    return (c.tokens_estimated and not r.to_server if c is not None
            else bool(tr.tokens_seen and tr.api is not None and tr.api.startswith("openai")))


def _cache_pending(r: LiveRequest) -> bool:
    """Its prompt was said early (continuous usage) and its cached count not yet: its end may still say one."""
    tr = r.trace
    return tr.counts is None and tr.extra.get("prompt_tokens") is not None and tr.extra.get("cached_tokens") is None


def _cache_unsaid_candidate(r: LiveRequest) -> bool:
    """A request whose prefill was costed at a prompt the server never said how much of it was cached."""
    c = r.trace.counts
    p = told_prompt_tokens(r)
    if r.prefilled_apart:
        return True
    return (c is None or c.cached_tokens is None) and ((p is not None and p > 1) or r.prompt_est is not None)


def _unread_kind(extra: dict) -> str:
    """What was wrong with an unread prefill's body, for the rows beside it (rowtext's why and fix): unread, a
    stateful Responses turn's, or read with no size in it."""
    if extra.get("body_bytes") is not None:
        return "unread"
    return "stateful" if extra.get("prompt_unsized") in STATEFUL_REASONS else "sizeless"
