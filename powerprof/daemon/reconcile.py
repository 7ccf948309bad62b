"""Reconciles the server's own token counter with the tokens the proxy saw: each scrape window's bypass tokens.

The daemon scrapes the server's counters (scrape.py) and hands each window's rise to the ledger, which passes it
here (`CountReconciler.add_server_tokens`); the proxy's token events are listed here as the ledger places them
(`proxied`, `finished`, `slack`). Resolving a window (`CountReconciler.resolve_spans`) weighs the server's count
against the proxy's: the rise beyond it is unproxied (bypass) traffic, held against the proxy's own lag, the reads'
place in their GETs, a counter's losses and restarts (`_lost_beyond`, `_mark_restart_unsure`), and what an
at-finish counter was seen to count of a usage's tokens (`_usage_doubt`); over a stretch between two quiet scrapes, a
usage above the counter (`_judge_usage`) or, where the server's books show no bypass request, below it
(`_judge_usage_below`). The ledger spends the resolved windows over
the intervals it closes (`CountReconciler.bypass_over`) and writes each interval's `server_count` from the reasons
they carry (`CountReconciler.server_count`).

Runs in the event loop's thread only, as the ledger does; it reads the ledger's live requests and GPU edges (given
at construction) and imports nothing of the ledger's.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from powerprof.storage.schema import (SERVER_COUNT_COMPLETE, SERVER_COUNT_MISPLACED, SERVER_COUNT_OFF,
                                      SERVER_COUNT_USAGE_ABOVE, SERVER_COUNT_USAGE_BELOW, SERVER_COUNT_USAGE_BEYOND,
                                      SERVER_COUNT_PROXY_LAG, SERVER_COUNT_PROXY_UNREAD, SERVER_COUNT_SLOTS_ONLY,
                                      SERVER_COUNT_UNREAD, SERVER_COUNT_BELOW, SERVER_COUNT_RUN_ON_MAY_END,
                                      SERVER_COUNT_BATCH_RUN_ON,
                                      bypass_count_fix)

from . import attribution as attr
from .liverequest import LiveRequest, closed_unanswered, is_passive, told_prompt_tokens

# The ledger's logger: these lines were the ledger's before the reconciliation was its own module, and a log filter
# (or a test's caplog) that names the ledger still sees them.
log = logging.getLogger("powerprof.daemon.ledger")

SCRAPE_HOLD_S = 10.0  # intervals wait this long at most for the server's counter to be scraped past them
LAG_S = 1.0  # the proxy may see a token this long after the server counted it (a loaded host)
# s: an at-finish server's scrape GET shorter than this moves no request across an edge beyond what the levels take
# (`resolve_spans`, the GET's span); a longer one's finishes inside it may fall in either window, and are said.
GET_FINISH_SLACK_S = 0.05
CREDIT_S = 3.0  # a higher server-minus-proxy level is held this long before a lower one replaces it
# An owed count (a counter read before its stamp) repaid within max(CREDIT_S, this many scrape intervals) of its fall
# nets unmarked; older, the window says proxy_lag (`_owe_horizon_ns`). A repayment at the next scrape is never old by
# itself: at a 5 s scrape interval every one was past CREDIT_S, and an exact one said proxy_lag.
OWE_SCRAPES = 1.5
OWE_CADENCE_WINDOWS = 8  # the scrape interval is the median length of this many latest scrape windows
# A scrape window's placed proxied tokens below minus this are a placing fault (`_placed_in`), not float rounding.
PLACED_EPS = 1e-3
# A scrape window whose bypass tokens or level move more than this where the proxy's token rate rose or fell may hold
# the proxy's own lag (`PROXY_LAG`): a token, what a record's own delay moves whatever the placing.
LAG_TOKENS = 1.0
# A held burst is placed back beside the bypass traffic's pace of the windows ending this long before it (the latest
# one at least; `bypass_pace`).
BYPASS_PACE_S = 0.25
# ... and more than this share of the window's server count: a lag's tokens below it move its requests' energy by less
# than half the attribution's own p95 per-request error (10.6%, docs/daemon.md "How close it gets"), and marking them
# left most requests of a loaded host out of J/token (docs/daemon.md, "A server restart": the figures).
LAG_SHARE = 0.05
# An at-finish counter is taken to count the usage's tokens beyond a stream's chunks of a given number a stream once
# this many windows with no bypass request finished rose by exactly the proxied tokens with them, and at most one in
# USAGE_SHORT_RATIO as many short of them; and to count none of them once this many rose short, more than that share
# (`_usage_doubt`). Only the votes of the latest USAGE_VOTE_S count: kept for the daemon's life, an honest counter's
# few windows timed wrong (a stream the proxy saw later than its measured delay) outweighed 90 exact ones, and every
# row of an honest SGLang was marked from its third on (70 of 115 rows over 2 minutes); and a verdict lapses where no
# window tells again.
USAGE_COUNTED_VOTES = 3
USAGE_SHORT_RATIO = 4
USAGE_VOTE_S = 30.0
# What an interval row's `server_count` and a request's energy_note say (storage/schema.py states them).
COUNT_COMPLETE, UNREAD, COUNT_OFF = SERVER_COUNT_COMPLETE, SERVER_COUNT_UNREAD, SERVER_COUNT_OFF
MISPLACED, PROXY_LAG, PROXY_UNREAD = SERVER_COUNT_MISPLACED, SERVER_COUNT_PROXY_LAG, SERVER_COUNT_PROXY_UNREAD
USAGE_BEYOND, USAGE_ABOVE, USAGE_BELOW = SERVER_COUNT_USAGE_BEYOND, SERVER_COUNT_USAGE_ABOVE, SERVER_COUNT_USAGE_BELOW
COUNTER_BELOW = SERVER_COUNT_BELOW
# A stretch of traffic between two quiet scrapes (`_judge_usage`) over which the server's counter counted fewer tokens
# than the proxy placed by more than this many tokens and this share of the tokens the proxy believed from a final
# count alone (usage-only: `note_usage_only`) says its usage runs above the counter. Between quiet points conservation
# holds: bypass traffic only raises the counter, and an honest counter's lag and reads read early have drained
# (tests/test_daemon_token_counts.py's scene: an honest counter fell 0 tokens short of 207 usage-only tokens at 4 tokens
# a chunk, 0 of 120 at one a chunk; a usage saying 1.25x, 60 of 180).
USAGE_ABOVE_TOKENS = 3.0
# A stretch whose counter stands above the proxy's holds its windows for its quiet scrape (`usage_hold_ns`) while it
# is younger than this, or no proxied request is live: busier longer, its quiet scrape is not near (steady traffic).
# The usage-below scene (tests/test_daemon_token_counts.py: six answers of about 1 s back to back) is 7.5 s from its
# quiet scrape to its last end; 5 s let its first whole answer's windows go, booked as bypass.
USAGE_BELOW_BUSY_S = 8.0
USAGE_ABOVE_SHARE = 0.05
# usage-only token events kept unjudged at most (each window's are let go as it is resolved), and proxied requests' ends
# (`note_end`, let go at each quiet scrape)
USAGE_ONLY_MAX = 100_000
USAGE_REQUESTS_KEPT = 256  # past this many, a stretch's requests whose rows are written are let go (`_usage_prune`)
FINISH_HOLD_S = 30.0  # an at-finish server's requests' durations of this long ago set how long intervals are held


@dataclass(slots=True)
class _ScrapeWindow:
    """One scrape window of the server's token counter (`CountReconciler.server_spans`): made by `add_server_tokens`,
    resolved (its bypass tokens, what its reads may have missed) by `resolve_spans`, spent by `bypass_over`."""

    t0_ns: int  # its start (the scrape before; an at-finish window's moves back once resolved: `_spread_back`)
    t1_ns: int  # its end: the scrape that read the counter (the GET's midpoint)
    server_tokens: float  # the tokens the server counted in it
    # (requests finished, their summed end-to-end seconds) of an at-finish server, where both are positive; else None
    finished_latency: tuple[float, float] | None
    partial: tuple[str, ...]  # why its count may be low (scrape.PARTIAL_REASONS keys), added to as it is resolved
    # The scraper said the server restarted in it. Not read from `partial`, which the windows whose lookahead crosses a
    # restart take on too (`resolve_spans`): one left waiting was taken for the restart at the next pass, its levels
    # started afresh a window early.
    restarted: bool
    read_span_ns: tuple[int, int] | None  # (start, end) of the GET that read the counter at `t1_ns`; None: not told
    finished_requests: int | None  # the requests the server finished in it (None: not told; `_usage_doubt`)
    bypass_tokens: float | None = None  # of `server_tokens`, the bypass tokens: None until resolved
    # What the reads at its edges may have missed or taken early, (early, late) at its start then at its end (set when
    # resolved: `_read_unsure`).
    read_unsure: tuple[float, float, float, float] | None = None
    # The ns of the GETs at its edges before and after their stamps, (early, late) at its start then at its end: the
    # bypass traffic in them may be in either window (set when resolved: `_read_unsure`).
    read_halves_ns: tuple[int, int, int, int] | None = None
    # The server's (requests finished since its start, requests running and queued, finished requests' generated tokens)
    # on the page read at its end
    # (scrape.Scraper.served: vLLM's); None where not told (`_judge_usage_below`).
    served: tuple[float, ...] | None = None
    # Tokens the count read at its end may lack: answers that ended between the reads making it (llama.cpp's counter and
    # /slots: scrape.Scraper.window_read_missed), counted in the window after; `_read_unsure` weighs them at that edge.
    read_missed: float = 0.0


@dataclass(slots=True)
class _UsageStretch:
    """The traffic since the latest quiet scrape (no proxied token within LAG_S of it, no proxied request live across
    it), for `CountReconciler._judge_usage`: what the server counted and the proxy placed over its resolved windows,
    the usage-only tokens among the latter, and the windows holding those, not yet judged."""

    server_n: float = 0.0  # the server's count over its resolved windows
    placed_n: float = 0.0  # the proxy's tokens placed in them
    slack_n: float = 0.0  # of those, a usage's few beyond a stream's chunks (`slack`: usage_beyond_chunks's own)
    usage_n: float = 0.0  # of those, the tokens believed from a final count alone (`note_usage_only`)
    # the ids of the requests those came from, still live (`CountReconciler._usage_prune`), and the number and summed
    # final counts of all of them
    requests: set = field(default_factory=set)
    n_requests: int = 0
    final_n: float = 0.0
    # the resolved windows holding them, not yet judged (their intervals wait: `usage_hold_ns`)
    windows: list = field(default_factory=list)
    end_ns: int = 0  # its latest resolved window's end
    allow: float = 0.0  # the proxy's tokens of the LAG_S before it, as of its resolving pass (`_judge_usage_forced`)
    unjudged: bool = False  # a window of it says its count is lost or unread (a restart, counter_below told, ...)
    above: bool = False  # judged: the usage runs above the counter (its later windows say so as they are resolved)
    # For `_judge_usage_below`: its start (the quiet scrape before it; None: the daemon's first stretch) and the server's
    # (requests finished, in flight) read there; its resolved windows not yet spent, and those holding usage-only tokens;
    start_ns: int | None = None
    start_served: tuple[float, ...] | None = None
    spans: list = field(default_factory=list)
    usage_spans: list = field(default_factory=list)
    # its windows wait for its quiet scrape (its counter over a token above the proxy's as of its latest resolved
    # window, usage-only tokens in it);
    # a page in it did not say the server's requests (untold), or said more finished or in flight than the proxy's
    # (bypass_seen: a request not the proxy's ran); judged below its counter.
    below_hold: bool = False
    untold: bool = False
    bypass_seen: bool = False
    below: bool = False


class CountReconciler:
    """The server's token count against the proxy's, window by window: the scrape windows (`server_spans`), the
    proxy's token events listed for them, and the state resolving them carries from one window to the next (levels,
    owed counts, lost runs, usage votes, the proxy's measured delays)."""

    def __init__(self, t0_ns: int, requests: dict[int, LiveRequest], edges: list, max_hold_ns: int,
                 prompt_hold_ns: int):
        """requests: the ledger's live requests ({request id: LiveRequest}), edges: its GPU sample edges, oldest
        first: both the ledger's own objects, read here (a restart's or a held stream's windows wait on live
        requests; an at-finish window is spread back no earlier than the first open edge). max_hold_ns,
        prompt_hold_ns: the ledger's holds, which bound how long a window waits on a live request. t0_ns: the
        daemon's start, for the log."""
        self.t0_ns = t0_ns
        self.requests = requests
        self.edges = edges
        self.max_hold_ns = max_hold_ns
        self.prompt_hold_ns = prompt_hold_ns
        # The scrape windows not yet spent, in order (`_ScrapeWindow`).
        self.server_spans: list[_ScrapeWindow] = []
        self.proxied: deque = deque()  # (t_ns, tokens) of every proxied token event, for the scrape windows
        # (t_ns, tokens) of those placed for a stream's usage beyond its chunks within COUNT_SLACK_TOKENS (in proxied
        # too): believed, not seen; a window where they weigh says USAGE_BEYOND (`resolve_spans`).
        self.slack: deque = deque()
        # What the at-finish counter was seen to do with those tokens lately (`_usage_doubt`): {tokens a stream:
        # (window end, rose by exactly the proxied tokens with them) of the latest USAGE_VOTE_S}, and the GET span that
        # read the counter at the latest resolved window's end.
        self._usage_votes: dict[int, deque] = {}
        self._usage_read: tuple[int, int] | None = None
        # (start, end) of the latest restarts' scrape windows: kept past their windows' pruning, as a request that
        # arrived before one may show tokens long after its intervals closed (`Ledger._restart_cut_ns`).
        self.restarts: deque = deque(maxlen=64)
        self._unsure: dict[int, tuple] = {}  # requests that arrived inside a restart's window (`_mark_restart_unsure`)
        # (t_ns, tokens, duration_ns) of every proxied request at its last token: what a server counting at request end
        # (SGLang) counted of it, and when (the proxy sees the last token just after the server counted the request).
        self.finished: deque = deque()
        # {request id: (its client's leave, its run-on's placed end)} of SGLang run-ons that may have ended by themselves
        # (`Ledger._run_on`, dropped where placed sure: `Ledger._place_run_on`): the windows over them say
        # SERVER_COUNT_RUN_ON_MAY_END (`bypass_over`); keyed (request id, "death") too, a run-on whose process may have
        # died on it (`Ledger._run_on_cut_ns`), its placing none of that key's business.
        self.run_ons_may_end: dict[int | tuple[int, str], tuple[int, int]] = {}
        # {request id: (its arrival, the end its prompts' run is taken to stay within)} of batches SGLang may have answered 400
        # while running their other prompts for nobody (`Ledger._batch_run_on`): the windows over them say
        # SERVER_COUNT_BATCH_RUN_ON (`bypass_over`).
        self.batch_run_ons: dict[int, tuple[int, int]] = {}
        self.server_at_finish = False  # the server's counter moves when a request finishes, not as tokens come
        # (scrape end, mean end-to-end seconds) of the at-finish windows in which requests finished, FINISH_HOLD_S back:
        # a request ending later is likely as long, and its windows' bypass tokens go back that far (`_spread_back`).
        self.durations: deque = deque()
        self.server_seen = False
        self.server_upto_ns: int | None = None
        # Where the server's count begins (the first scrape window's start): an interval wholly before it has no
        # server count (null, not 0: bypass traffic there was never read).
        self.server_from_ns: int | None = None
        self.server_before = UNREAD  # what the intervals wholly before it say in server_count (add_server_tokens)
        self._gap = 0.0  # server minus proxied tokens, cumulative, to the end of the last resolved window
        # (window end, bypass level, the most and the least lag a delay of the proxy's own can hold there) of recent windows
        self._levels: deque = deque()
        # (start, end, bypass tokens) of the windows resolved in the last LAG_S: the bypass traffic's pace lately, taken
        # out of the server's pace where a held burst is placed back over windows not yet resolved
        # (`Ledger._at_server_pace`)
        self._bypassed: deque = deque()
        # (from, to) of held bursts placed back at a pace resting on an assumed bypass pace that the server's count
        # there contradicts: the windows they span say `proxy_lag` (`Ledger._at_server_pace`)
        self.pace_unsure: deque = deque()
        # {(start, end): server count less the proxy's tokens} of the windows open at the latest resolving pass, and how
        # many tokens `proxied` listed then (those after it came since): `bypass_pace`
        self._open_bypass: dict = {}
        self._pass_len = 0
        self._level = 0.0  # the latest window's level
        # Tokens the server's count owes the proxy's since its latest (re)start: read before its scrape's stamp, counted
        # in a later window (`resolve_spans`); and the latest window's reference level.
        # Each owed amount is [when the reference fell (ns), tokens, doubtful]: doubtful where a known loss of the
        # count (a window with a reason other than proxy_lag) came within CREDIT_S + LAG_S of the fall, so the fall may
        # be that loss rather than a read made early (`resolve_spans`).
        self._owed: deque = deque()
        self._ref_last = 0.0
        # Owed tokens netted beyond what the fall of the proxy's rate could recover, [when (ns), tokens], oldest first
        # (`resolve_spans`).
        self._overpaid: deque = deque()
        self._window_ns: deque = deque(maxlen=OWE_CADENCE_WINDOWS)  # the latest resolved scrape windows' lengths (ns)
        self._lost_ns: int | None = None  # the end of the latest window whose count a known loss lowered
        # [end (ns), tokens, bypass pace (tokens/ns)] of the runs of resolved windows whose loss was added back
        # (`_lost_beyond`), kept CREDIT_S: a rise above that pace after one may be the count coming back, not bypass
        self._lost_runs: deque = deque()
        # The start of the window after each lost run judged (the scraper's passing page, if any), and the bypass pace
        # before that run: `_lost_beyond` judges it when it is resolved, maybe a pass after the run's.
        self._passing: dict[int, float] = {}
        # The start of each window a dip came back in, and the tokens taken back there (`_lost_beyond`): likewise.
        self._dip_back: dict[int, float] = {}
        # The end of each run added back as a loss, and the part of its shortfall left in the gap (what its reads and
        # the proxy's lag may explain, `_lost_beyond`): the windows after it whose figure that part lowers are marked.
        self._left_runs: dict[int, float] = {}
        # The end of each window of a run short of the proxy's tokens (`_lost_beyond`), kept LAG_S past the windows
        # still to resolve: those after it within LAG_S may hold its return, no bypass pace for a later run.
        self._seed_ends: set[int] = set()
        # The proxy's tokens in the latest resolved window, and that window's length (ns): its rate is compared.
        self._placed_last, self._placed_last_ns = 0.0, 1
        self._ahead = (0.0, 0.0)  # and the most and least lag it may hold
        self._edge_most: float | None = 0.0  # the most lag the latest window may hold at its own end (None: unmeasured)
        # The proxy's tokens between the latest resolved window's end (its GET's midpoint) and its GET's start, and its
        # end: those the count may lack, and those it may hold already (the counter read anywhere in the GET).
        self._edge_read = (0.0, 0.0)
        self._edge_halves_ns = (0, 0)  # and the ns of its GET before and after that midpoint
        # (t_ns, s) how late the proxy's event loop ran, as the daemon measures it (`note_proxy_delay`): the most a
        # delay of the proxy's own can move its tokens (`PROXY_LAG`). None measured: up to LAG_S, as nothing says less.
        self.delays: deque = deque(maxlen=4096)
        self.misplaced_windows = 0  # scrape windows whose placed proxied tokens came out below none (`_placed_in`)
        # (from, to, tokens, at its start) of each chunk a stream's usage said held several tokens, spread over the time
        # since the chunk before it (`note_chunk_spread`): where the server counted them in that time is unknown.
        self.chunk_spreads: deque = deque()
        self._spent_quiet: dict[int, bool] = {}  # the latest spent window's end: it booked no bypass (`_quiet_edges`)
        # and its (bypass tokens, length in ns): the pace beside the next intervals' first edge (`_bypass_beside`)
        self._spent_bypass: dict[int, tuple[float, int]] = {}
        self._spent_missed: dict[int, float] = {}  # and what its count's read may have missed (`read_missed`)
        # The end of the latest resolved scrape window: tokens placed at or before it are in no window's count any more
        # (`Ledger._chunks_to_server_count` keeps its chunks there as they were counted).
        self.resolved_to_ns: int | None = None
        self._resolved_last: int | None = None  # the last scrape's end at the latest resolving pass
        # (t_ns, tokens, request id) of the tokens placed as proxied on a server's final count alone (a stream's usage
        # beyond its chunks counted one a chunk, a whole answer's count: `note_usage_only`), let go as their window is
        # resolved; {request id: (its final count, its chunks' count)} of those; the stretch they are judged over.
        self._usage_only: deque = deque(maxlen=USAGE_ONLY_MAX)
        self._usage_counts: dict[int, tuple[float, float]] = {}
        self._stretch = _UsageStretch()
        self.usage_above_stretches = 0  # stretches judged usage_above_counter (the log says the first and every 100th)
        # (end, counted) of every proxied request that ended since the stretch began: counted where the server counts it
        # among its finished requests (`note_end`); and the stretches judged usage_below_counter (logged likewise).
        self._ends: deque = deque(maxlen=USAGE_ONLY_MAX)
        self.usage_below_stretches = 0

    def add_server_tokens(self, t_ns: int, delta: float, since_ns: int | None = None, at_finish: bool = False,
                          finished: tuple[float, float] | None = None, partial: tuple[str, ...] = (),
                          read_ns: tuple[int, int] | None = None, served: tuple[float, ...] | None = None,
                          read_missed: float = 0.0) -> None:
        """Tokens the server counted between the previous scrape (`since_ns`) and this one: spread
        evenly over that time, so bypass tokens land in the intervals where they were generated.
        `at_finish`: the server counts a request's tokens when it finishes (SGLang; scrape.AT_FINISH).
        `finished`: (requests finished, their summed end-to-end seconds) over the same time (SGLang's latency
        histogram; scrape.Scraper.finished): an at-finish window's bypass tokens are spread back over their requests'
        mean duration (`_spread_back`).
        `partial`: why this window's count may be low (scrape.PARTIAL_REASONS keys: the scraper's `window_partial`);
        the intervals it covers say so in `server_count`, and the requests given their energy in `energy_note`.
        `read_ns`: the (start, end) of the GET that read the counter (`t_ns` is its midpoint): the server read it
        somewhere in there, so the proxy's tokens inside it may or may not be in this count (`resolve_spans`).
        `served`: the server's (requests finished since its start, requests running and queued, finished requests'
        generated tokens) on the page read at `t_ns` (scrape.Scraper.served); None where not told (`_judge_usage_below`).
        `read_missed`: the most this count may lack for answers that ended between its reads (scrape.Scraper.
        window_read_missed): counted in the next window (`_read_unsure`)."""
        if not self.server_seen:
            # The proxy's token events are listed for the scrape windows (`proxied`, `finished`) only once a server
            # is read. Its first window starts at the baseline read, before the daemon's ready, and its first pass can
            # come after a stream's first pieces (a loaded host): those were in no list, the server had counted them
            # (bypass tokens that never ran), and a stream's end that placed them again (`_first_burst`) took them
            # out of a list they were never in: a window below none, its rise read as bypass (the ledger's test: 179
            # counted for 100; docs/daemon.md, A server restart). Every event placed so far is listed now, once.
            self._list_placed()
        self.server_seen = True
        self.server_at_finish = at_finish
        self.server_upto_ns = t_ns
        t0 = since_ns if since_ns is not None and since_ns < t_ns else t_ns - 1
        if self.server_from_ns is None:
            self.server_from_ns = int(t0)
            # A late first read took the tokens counted before it in: the intervals before it have no count, and
            # bypass traffic may have run there (the server had counted tokens by then).
            self.server_before = "late_baseline" if "late_baseline" in partial else UNREAD
        fin = finished if at_finish and finished is not None and finished[0] > 0 and finished[1] > 0 else None
        if fin is not None:
            self.durations.append((int(t_ns), fin[1] / fin[0]))
        while self.durations and self.durations[0][0] < t_ns - int(FINISH_HOLD_S * 1e9):
            self.durations.popleft()
        read = (min(int(read_ns[0]), int(t_ns)), max(int(read_ns[1]), int(t_ns))) if read_ns is not None else None
        self.server_spans.append(_ScrapeWindow(
            t0_ns=int(t0), t1_ns=int(t_ns), server_tokens=float(delta), finished_latency=fin, partial=tuple(partial),
            restarted="server_restart" in partial, read_span_ns=read,
            finished_requests=int(finished[0]) if at_finish and finished is not None else None,
            served=tuple(float(v) for v in served) if served is not None else None,
            read_missed=max(0.0, float(read_missed))))
        if "server_restart" in partial:
            self.restarts.append((int(t0), int(t_ns)))

    def note_usage_only(self, r: LiveRequest, ts: list, ns: list, final_n: float, chunks_n: float) -> None:
        """Tokens the ledger placed as proxied (`ts`, `ns`, in `proxied` too) on `r`'s final count alone (`final_n`: a
        usage, a whole answer's count; `chunks_n`: the tokens its chunks carried, 0 for a whole answer): only the
        server's counter can check them (`_judge_usage`)."""
        if not self.server_seen or self.server_at_finish:
            return
        rid = r.trace.request_id
        self._usage_only.extend((int(t), float(n), rid) for t, n in zip(ts, ns) if n > 0)
        self._usage_counts[rid] = (float(final_n), float(chunks_n))

    def note_end(self, r: LiveRequest) -> None:
        """Proxied request `r` ended: listed with whether the server counts it among its finished requests
        (vllm:request_success_total: a generation request run to its end, one sequence, answered 200 with its own
        count). Not one a client left or the server failed (vLLM counts no aborted request), n > 1 (a count a
        sequence), nor a count the proxy took from its chunks unconfirmed: those say the stretch cannot be judged below
        its counter (`_judge_usage_below`). An error answer or a GET that did no work (`is_passive`) is not listed."""
        if not self.server_seen or self.server_at_finish or is_passive(r):
            return
        tr, c = r.trace, r.trace.counts
        counted = (tr.api is not None and tr.outcome == "ok" and tr.status == 200 and tr.error is None
                   and c is not None and c.invalid is None and c.server_error is None and not c.count_open
                   and not c.unreadable and (not c.tokens_estimated or c.count_problem is not None)
                   and max(tr.extra.get("sequences", 1), 1) == 1)
        t = tr.end_ns if tr.end_ns is not None else tr.last_ns
        if t is not None:
            self._ends.append((int(t), counted))

    def usage_hold_ns(self) -> int | None:
        """The start of the earliest resolved window whose usage-only tokens are not judged yet (`_judge_usage`): its
        intervals wait for the stretch's quiet scrape, SCRAPE_HOLD_S at most (the ledger's hold on the server's count;
        closed before, `bypass_over` judges on what is known). Only while the stretch's counter stands over a token
        below the proxy's tokens (`_usage_account`). Held 5 s instead of 10, two clients of a 1.25x usage back to back
        for 14 s (no quiet scrape) left the first 3 s of intervals and 4 of 22 rows unsaid (10 s: none). None: none
        waits. Also, where the server tells its requests (`_judge_usage_below`), while the stretch's counter stands over a
        token above the proxy's tokens with usage-only tokens in it and its server's books show no request not the
        proxy's so far: all its windows not yet spent wait, SCRAPE_HOLD_S at most, and only while the stretch is younger
        than USAGE_BELOW_BUSY_S or no proxied request is live (closed before its quiet scrape, their surplus is booked
        as bypass tokens, as where the server does not tell)."""
        st = self._stretch
        held = [sp.t0_ns for sp in st.windows] if not st.above else []
        if (st.below_hold and not (st.below or st.untold or st.bypass_seen or st.unjudged)
                and (st.end_ns - st.start_ns < USAGE_BELOW_BUSY_S * 1e9 or not self._live_now())):
            # A counter standing above the proxy's where usage-only tokens were placed: bypass traffic or a usage
            # lying low, told apart only at the stretch's quiet scrape (`_judge_usage_below`); its windows' bypass
            # tokens are not booked until then. Only while that scrape may be near: a stretch busy for over
            # USAGE_BELOW_BUSY_S with a proxied request live now (steady traffic) lets them go, booked as bypass.
            # Held to the 10 s of SCRAPE_HOLD_S whatever, under steady traffic every row came 10 s late.
            held += [sp.t0_ns for sp in st.spans]
        return min(held, default=None)

    def note_chunk_spread(self, from_ns: int, to_ns: int, tokens: float, at_start: bool = False) -> None:
        """Chunk tokens a stream's usage told (a stream counted one a chunk: `Ledger._chunks_to_server_count`) whose
        count's place in time is unknown. Spread evenly over (`from_ns`, `to_ns`], the time since the chunk before: a
        server that generated them step by step there (a stream interval) counted them so, one that made them in one
        step (speculative decoding) all at `to_ns`. `at_start`: the first chunk's share beyond its own count, placed at
        `from_ns`, its token out of the prefill alone or several, counted there or by the stream's last chunk at
        `to_ns`. Either way placed no later than counted: those before a scrape may be counted after it
        (`_chunk_early`)."""
        self.chunk_spreads.append((int(from_ns), int(to_ns), float(tokens), bool(at_start)))

    def _chunk_early(self, edges: np.ndarray) -> np.ndarray:
        """Per edge, the chunk tokens placed before it that the server may count after it (`note_chunk_spread`): a dip of
        the gap that the windows after it win back while the proxy's pace holds, lawful, no loss of the count."""
        sp = np.array(self.chunk_spreads, dtype=float).reshape(-1, 4)
        a, b, x, point = (sp[:, i][None, :] for i in range(4))
        e = edges.astype(float)[:, None]
        inside = (e > a) & (e < b)
        share = np.where(point > 0, 1.0, (e - a) / np.where(inside, b - a, 1.0))
        return np.where(inside, x * share, 0.0).sum(axis=1)

    def note_proxy_delay(self, t_ns: int, delay_s: float) -> None:
        """How late the proxy's event loop ran at `t_ns` (a timer's lateness there): it reads the server's tokens no
        later than that. The daemon measures it on the loop that runs the proxy (service's tick loop, a worker's beat)."""
        self.delays.append((int(t_ns), max(0.0, float(delay_s))))

    def _list_placed(self) -> None:
        """At the first read of the server: every request's token events placed so far into `proxied`, and each
        ended one's tokens at its last into `finished`, as on_tokens and on_end list them from then on."""
        for r in self.requests.values():
            self.proxied.extend(zip(r.ev_t, r.ev_n))
            tr = r.trace
            t = tr.last_ns if tr.last_ns is not None else tr.end_ns
            n = r.spent + float(sum(r.ev_n)) + r.late
            if tr.end_ns is not None and t is not None and n > 0:
                self.finished.append((int(t), n, max(0, int(t) - tr.arrival_ns)))

    def edge_delays_s(self, edges: np.ndarray, reach_ns: int) -> tuple[list, list]:
        """The proxy's own delay at each edge (a window's end), the most and the least the measures say it held there:
        a lag is the tokens the server counted before the edge and the proxy read after it, so it is the delay at the
        edge's own instant that counts, not the least of the next second (taken so, a delay that fell within it hid
        the lag its level held: docs/daemon.md, "A server restart"). Between two measures (the daemon takes one every
        0.25 s) the delay is anywhere between them (a loop growing late, a spike): the most is the larger of the last
        measure before the edge and the first after it, the least the smaller; and a measure at t of d says the loop
        stood still over [t - d, t], so an edge inside that stall was read no sooner than t: both at least t - edge.
        None (both) where nothing was measured within `reach_ns` after the edge (no measure at all, or a loop too
        late to measure: a stall): up to LAG_S, as nothing says less."""
        # Only measures from `reach_ns` before the earliest edge on are ever read below (the one before an edge counts
        # only within the reach): the tail from there, not the whole history (4096 measures, 17 minutes at 4 a second,
        # converted twice every 2 s while idle: its cost grew with the daemon's uptime).
        lo, k = int(edges.min()) - reach_ns if edges.size else 0, 0
        for t, _ in reversed(self.delays):
            if t < lo:
                break
            k += 1
        tail = list(itertools.islice(self.delays, len(self.delays) - k, None))
        dt = np.fromiter((t for t, _ in tail), dtype=np.int64, count=k)
        dx = np.fromiter((x for _, x in tail), dtype=float, count=k)
        stood = dt - np.rint(dx * 1e9).astype(np.int64)  # where each measure's stall began
        a = np.searchsorted(dt, edges, side="left")
        b = np.searchsorted(dt, edges + reach_ns, side="right")
        most: list = []
        least: list = []
        for s, i, j in zip(edges.tolist(), a.tolist(), b.tolist()):
            if j <= i:
                most.append(None)
                least.append(None)
                continue
            near = [float(dx[i])]  # the first measure after the edge, and the last before it (within the reach)
            if i > 0 and dt[i - 1] >= s - reach_ns:
                near.append(float(dx[i - 1]))
            inside = stood[i:j] <= s
            still = float((dt[i:j][inside] - s).max()) / 1e9 if inside.any() else 0.0
            most.append(min(max(max(near), still), LAG_S))
            least.append(min(max(min(near), still), LAG_S))
        return most, least

    def _silent_at(self, edge_ns: int, reach_ns: int) -> bool:
        """Whether the proxy went silent across `edge_ns`: measured before it (`note_proxy_delay`: every 0.25 s from a
        live proxy), then nothing for over `reach_ns` about it, or a measure after it saying its loop stood still from
        before the edge to over `reach_ns` past it. A proxy never measured (a caller that measures none) is not judged
        silent: nothing says it stopped."""
        after: tuple[int, float] | None = None
        before: int | None = None
        for t, d in reversed(self.delays):  # the newest first: an edge is recent, a few dozen measures back at most
            if t < edge_ns:
                before = t
                break
            after = (t, d)
        if before is None:
            return False
        if after is None:
            return True
        t, d = after
        return t - before > reach_ns or (t - int(d * 1e9) <= edge_ns and t - edge_ns > reach_ns)

    def _live_now(self) -> bool:
        """Whether a proxied request is live now (not ended): no quiet scrape comes before it ends."""
        return any(q.trace.api is not None and q.trace.end_ns is None for q in self.requests.values())

    def _live_at(self, t_ns: int) -> bool:
        """Whether a proxied request was live at `t_ns` (arrived before it, not ended by it): one whose tokens the proxy
        may not have read yet."""
        return any(q.trace.api is not None and q.trace.arrival_ns <= t_ns
                   and (q.trace.end_ns is None or q.trace.end_ns > t_ns) for q in self.requests.values())

    def _delay_most_s(self, a_ns: int, b_ns: int) -> float | None:
        """The most delay of the proxy's own loop measured from `a_ns` to `b_ns` (`note_proxy_delay`); None: none."""
        most = None
        for t, d in reversed(self.delays):
            if t < a_ns:
                break
            if t <= b_ns:
                most = d if most is None else max(most, d)
        return most

    def note_unsure(self, r: LiveRequest, t1: int) -> None:
        """`r`'s tokens read at `t1` are being placed back over the time before it (a non-streamed body, a stream's
        burst). If `r` arrived inside a restart's scrape window and `t1` is past it, nothing tells which process served
        them: its windows are marked from then on (`_mark_restart_unsure`)."""
        a = r.trace.arrival_ns
        w = next((w for w in self.restarts if w[0] < a < w[1]), None) if self.restarts else None
        if w is not None and t1 > w[1]:
            self._unsure.setdefault(r.trace.request_id, (w[1], None))

    def bypass_pace(self, start: int, held: int | None) -> float:
        """The bypass traffic's pace (tokens/ns) just before `start`, where a held burst is placed back from: the windows
        ending in the BYPASS_PACE_S before it (the latest at least), each its resolved bypass count, else (its lookahead still open) the server's count
        less the proxy's tokens placed there, the proxy's own tokens complete before the burst's start. Taken from the
        windows resolved in the last LAG_S (ending over LAG_S before the scrape that resolved them: 1-2 s before the
        burst), bypass traffic that began in those 2 s was taken for none: a 150 ms stall's windows read 0-5 and 17-20
        bypass tokens of 10, rows `complete` (tests/test_daemon_bypass_lag.py). A token over that second is what a
        record's own delay moves whatever the placing (LAG_TOKENS: a stream's first token, counted before the proxy saw
        it), not bypass traffic's pace. No such window (none scraped since the latest resolving pass): those resolved in
        the last LAG_S.
        A window not yet resolved: its count less the proxy's tokens in it at the latest resolving pass, less those
        listed since (a burst's, the records read since): no pass over every listed token (10 ms a burst at 100k).
        `held`: the earliest instant from which a live request may hold tokens the server counted and the proxy has not
        listed yet (the ledger's `_held_from`); None: none."""
        back_ns = int(BYPASS_PACE_S * 1e9)
        # A window not yet resolved that a live stream may hold tokens of, counted by the server but not yet seen by
        # the proxy (held back on its way), is no measure of the bypass pace: its count less the proxy's tokens holds
        # them too. Taken so, streams held back to their end beside one another, with no bypass traffic at all, gave
        # each burst a bypass pace of the others' held tokens (28-34 tokens/s where none ran; 75-204 in
        # tests/test_daemon_buffered_bypass.py's run), its span said to hold fewer tokens than it did, and its windows
        # said `proxy_lag`: 40 of 40 rows, their figures left out of J/token. Those windows are left out here: the
        # pace is the latest others' (resolved, or from before the held streams), else as where none was scraped.
        before = [sp for sp in self.server_spans if sp.t1_ns <= start and sp.t1_ns > sp.t0_ns and not sp.restarted
                  and (sp.bypass_tokens is not None
                       or ((sp.t0_ns, sp.t1_ns) in self._open_bypass and (held is None or sp.t1_ns <= held)))]
        last = max((sp.t1_ns for sp in before), default=None)
        near = [sp for sp in before if sp.t1_ns > min(start - back_ns, last - 1)] if last is not None else []
        if not near:
            dur_b, sum_b = sum(b - a for a, b, _ in self._bypassed), sum(x for _, _, x in self._bypassed)
            return sum_b / dur_b if dur_b > 0 and sum_b > LAG_TOKENS else 0.0
        since = list(itertools.islice(reversed(self.proxied), max(len(self.proxied) - self._pass_len, 0)))
        sum_b = 0.0
        for sp in near:
            if sp.bypass_tokens is not None:
                sum_b += sp.bypass_tokens
            else:
                sum_b += self._open_bypass[(sp.t0_ns, sp.t1_ns)] - sum(x for t, x in since if sp.t0_ns < t <= sp.t1_ns)
        dur_b = sum(sp.t1_ns - sp.t0_ns for sp in near)
        return sum_b / dur_b if sum_b > LAG_TOKENS else 0.0

    def bypass_over(self, t: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray], list[set]]:
        """(K,) tokens the server counted beyond the proxy's in each interval (bypass traffic), the
        (start, end) of the scrape windows they came from (the time bypass traffic ran in), and per
        interval why its count may be low or off (the reasons of the windows over it; `unscraped` where no
        window reaches its end: its intervals could be held no longer, or the daemon stopped).

        Each scrape window's bypass tokens (`resolve_spans`) are spread evenly over the time it
        covers. Windows overlapping these intervals are resolved now with what is known (their
        lag margin is cut short only when the intervals could not be held longer)."""
        self.resolve_spans(int(t[-1]), force=True)
        self._judge_usage_forced(int(t[-1]))
        out = np.zeros(t.size - 1)
        why: list[set] = [set() for _ in range(t.size - 1)]
        for x in self.server_spans:
            if x.partial and x.t1_ns > t[0] and x.t0_ns < t[-1]:
                for k in np.flatnonzero((x.t1_ns > t[:-1]) & (x.t0_ns < t[1:])):
                    why[k].update(x.partial)
        for k in np.flatnonzero(t[1:] > self.server_upto_ns):
            why[k].add("unscraped")
        # A run-on that may have ended by itself: SGLang counted it at that end if so (none if it aborted it), unseen,
        # and its tokens read as bypass tokens in the windows from its client's leave to its abort (LAG_S either side:
        # the proxy's lag behind that end, a count near the abort seen by the next window's level). Not listed (listed,
        # one SGLang aborted hid real bypass traffic: 16f65a29, reverted): its windows say so, and the requests given
        # their energy are flagged. Unsaid, the 24 streams beside 4 such were -12% to -17%, saying `complete`.
        lag_ns = int(LAG_S * 1e9)
        _mark_windows_over(t, why, self.server_spans, self.run_ons_may_end.values(), lag_ns, lag_ns,
                           SERVER_COUNT_RUN_ON_MAY_END)
        # A batch answered with an error whose other prompts SGLang ran for nobody: its counter counts them at their
        # end, and those counted past the intervals closed by then are spread back only to the first open one
        # (`_spread_back`), their energy before it the requests' beside them (`Ledger._batch_run_on`). From its arrival
        # on, the proxy's own time: the server ran none of it before.
        _mark_windows_over(t, why, self.server_spans, self.batch_run_ons.values(), 0, lag_ns, SERVER_COUNT_BATCH_RUN_ON)
        for k, (unsure, tol) in enumerate(self._read_unsure(t)):
            # Not over llama-server's /slots alone: answered from its task queue between decode steps (a GET a step
            # long or more), a count already said approximate (`slots_only`) and kept in J/token by design
            # (schema.SERVER_COUNT_TRUSTED); marked, every interval of a loaded host left J/token (a real llama-server,
            # tests/test_real_llama_server.py).
            if unsure > tol and not {"server_restart", SERVER_COUNT_SLOTS_ONLY} & why[k]:
                why[k].add(PROXY_LAG)
        spans = [x for x in self.server_spans if x.bypass_tokens is not None and x.bypass_tokens > 0 and x.t1_ns > t[0]
                 and x.t0_ns < t[-1]]
        sp = np.array([(x.t0_ns, x.t1_ns) for x in spans], dtype=np.int64).reshape(-1, 2)
        if spans:
            ex = np.array([x.bypass_tokens for x in spans])
            over = attr.span_overlap_s(t, sp[:, 0], sp[:, 1])
            out = (over * (ex / ((sp[:, 1] - sp[:, 0]) / 1e9))[:, None]).sum(axis=0)
        # Spans ending inside the closed intervals are spent; later ones (and their events) wait. The latest spent one's
        # end keeps whether it booked bypass tokens: the next intervals' first edge may be there (`_quiet_edges`).
        spent = [x for x in self.server_spans if x.t1_ns <= t[-1]]
        if spent:
            self._spent_quiet = {int(spent[-1].t1_ns): _quiet(spent[-1])}
            b = spent[-1].bypass_tokens
            self._spent_bypass = {int(spent[-1].t1_ns): (max(0.0, b or 0.0), int(spent[-1].t1_ns - spent[-1].t0_ns))}
            self._spent_missed = {int(spent[-1].t1_ns): spent[-1].read_missed}
        self.server_spans = [x for x in self.server_spans if x.t1_ns > t[-1]]
        st = self._stretch
        if st.spans:  # spent: booked as they stand, out of `_judge_usage_below`'s reach
            st.spans = [x for x in st.spans if x.t1_ns > t[-1]]
            st.usage_spans = [x for x in st.usage_spans if x.t1_ns > t[-1]]
        keep_from = min([x.t0_ns for x in self.server_spans], default=int(t[-1]))
        reach_ns = min(keep_from, self.server_upto_ns)  # the next window starts at the latest scrape
        for rid in [rid for rid, (_, b) in self.run_ons_may_end.items() if b + lag_ns <= reach_ns]:
            del self.run_ons_may_end[rid]  # no window left to reach it
        for rid in [rid for rid, (_, b) in self.batch_run_ons.items() if b + lag_ns <= reach_ns]:
            del self.batch_run_ons[rid]
        while self.chunk_spreads and self.chunk_spreads[0][1] <= keep_from - int(SCRAPE_HOLD_S * 1e9):
            self.chunk_spreads.popleft()
        for q in (self.proxied, self.finished, self.slack):
            while q and q[0][0] <= keep_from - int(SCRAPE_HOLD_S * 1e9):
                q.popleft()
                if q is self.proxied:
                    self._pass_len = max(self._pass_len - 1, 0)
        return out, (sp[:, 0], sp[:, 1]), why

    def _read_unsure(self, t: np.ndarray) -> list[tuple[float, float]]:
        """Per interval, how far its count may be off for where in their GETs the server read its counter, and its
        tolerance (a token plus LAG_SHARE of its windows' server tokens, their shares of it).

        Each window's bypass count is the server's rise less the proxy's tokens placed between its edges' stamps (the
        GETs' midpoints); the counter was read anywhere in each GET, so at an edge the count may lack the proxy's tokens
        from the GET's start to the stamp, or hold those from the stamp to its end already (`resolve_spans`: the
        window's `read_unsure`).
        Such an edge moves tokens from one window to the next: within an interval they cancel, and only the edges where
        its share of the windows changes (its own ends) move its count, by that change of share times those tokens.
        The bypass traffic's tokens inside the GET move the same way: taken at the pace of the two windows beside the
        edge together (`_bypass_beside`: a read's place moves tokens between them, not out of both), over each half of
        the GET, at most what they booked. An answer that ended between the reads making a count (`read_missed`) is
        missing at its edge as a read early's tokens are. Not weighed, a server stepping in bursts beside GETs of a
        loaded host (223 bypass tokens in 0.19 s then none; GETs up to 1 s, median 51 ms) had bursts counted a window
        early or late: intervals off by up to 84 tokens said `complete` (166 for 97 beside a 0.34 s GET;
        tests/test_daemon_ledger.py, every interval off by 100 beside 200 ms GETs read at their start)."""
        out = [(0.0, 0.0)] * (t.size - 1)
        spans = [x for x in self.server_spans if x.read_unsure is not None and x.t1_ns > t[0] and x.t0_ns < t[-1]
                 and x.t1_ns > x.t0_ns]
        if not spans:
            return out
        sp = np.array([(x.t0_ns, x.t1_ns) for x in spans], dtype=np.int64)
        share = attr.span_overlap_s(t, sp[:, 0], sp[:, 1]) / ((sp[:, 1] - sp[:, 0]) / 1e9)[:, None]  # (windows, K)
        quiet = self._quiet_edges()
        missed = {e: n for e, n in [*self._spent_missed.items(), *((x.t1_ns, x.read_missed) for x in self.server_spans)]
                  if n > 0}
        paces: dict[int, tuple[float, int]] = {}
        for k in range(t.size - 1):
            coef: dict[int, float] = {}
            reads: dict[int, tuple[float, float]] = {}
            halves: dict[int, tuple[int, int]] = {}
            counted = 0.0
            for i, x in enumerate(spans):
                f = float(share[i, k])
                if f <= 0:
                    continue
                counted += f * x.server_tokens
                coef[x.t1_ns] = coef.get(x.t1_ns, 0.0) + f  # its end's read: the count may lack (early) or hold (late)
                coef[x.t0_ns] = coef.get(x.t0_ns, 0.0) - f  # its start's, the other way round
                reads[x.t0_ns], reads[x.t1_ns] = x.read_unsure[:2], x.read_unsure[2:]
                if x.read_halves_ns is not None:
                    halves[x.t0_ns], halves[x.t1_ns] = x.read_halves_ns[:2], x.read_halves_ns[2:]
            for e, (early_ns, late_ns) in halves.items():
                if e not in paces:
                    paces[e] = self._bypass_beside(e)
                n, ns = paces[e]
                if n > 0 and ns > 0:
                    reads[e] = (reads[e][0] + min(n, n * early_ns / ns), reads[e][1] + min(n, n * late_ns / ns))
            for e in reads.keys() & missed.keys():
                # Answers that ended between the reads making its count (`read_missed`): missing there, counted in
                # the window after, as a read early misses its tokens.
                reads[e] = (reads[e][0] + missed[e], reads[e][1])
            for e in quiet & reads.keys():
                reads[e] = (0.0, 0.0)  # it moved no bypass token (`_quiet_edges`)
            # A read early at an edge lowers the window before it and raises the one after, by the tokens it missed.
            high = sum(c * reads[e][0] if c > 0 else -c * reads[e][1] for e, c in coef.items())
            low = sum(c * reads[e][1] if c > 0 else -c * reads[e][0] for e, c in coef.items())
            out[k] = (max(high, low), LAG_TOKENS + LAG_SHARE * counted)
        return out

    def _bypass_beside(self, e: int) -> tuple[float, int]:
        """The bypass tokens of the scrape windows either side of the edge `e` together, and their length in ns: each
        resolved one's count, one still open its count less the proxy's tokens at the latest pass (`_open_bypass`: a
        read early at its start moved the tokens it missed into it), the latest spent one's as it was booked."""
        n, ns = self._spent_bypass.get(e, (0.0, 0))
        for x in self.server_spans:
            if (x.t0_ns == e or x.t1_ns == e) and x.t1_ns > x.t0_ns:
                b = x.bypass_tokens if x.bypass_tokens is not None else self._open_bypass.get((x.t0_ns, x.t1_ns))
                if b is not None:
                    n, ns = n + max(0.0, float(b)), ns + int(x.t1_ns - x.t0_ns)
        return n, ns

    def _quiet_edges(self) -> set[int]:
        """The scrape edges where the counter's read, wherever in its GET, moved no bypass token: both windows beside it
        resolved with at most a token of bypass traffic (LAG_TOKENS), or the later still open and its count at most a
        token above the proxy's, and nothing said of their count. A read there moves the proxy's tokens of its GET from
        one window to the other, and a window's level is the lowest gap of its lookahead: a read late raised one gap the
        level passed over, a read early hid bypass tokens the next window books. Both booking none, there were none. Marked, lockstep streams (a batch's step puts a token of each
        in a 3 ms GET) said proxy_lag on honest rows: 4 streams, 13 of 34 busy intervals, every window's bypass 0."""
        by_edge: dict[int, list] = {e: [q] for e, q in self._spent_quiet.items()}  # a spent window's end, its word
        for x in self.server_spans:
            # One not resolved yet (the window after the intervals closing): its count less the proxy's tokens at the
            # latest pass (`_open_bypass`). A read early at its start moved the tokens it missed into it: they show there.
            open_n = self._open_bypass.get((x.t0_ns, x.t1_ns)) if x.bypass_tokens is None else None
            quiet = _quiet(x) or (open_n is not None and open_n <= LAG_TOKENS and not x.partial)
            by_edge.setdefault(int(x.t0_ns), []).append(quiet)
            by_edge.setdefault(int(x.t1_ns), []).append(quiet)
        return {e for e, q in by_edge.items() if len(q) >= 2 and all(q)}

    def server_count(self, t: np.ndarray, why_low: list[set], scraping: bool, unread_since_ns: int | None,
                     unread_spans: tuple[tuple[int, int], ...]) -> list[str]:
        """Per interval, how far the server's count covers it (its row's `server_count`): COUNT_COMPLETE, the reasons it
        may be low (scrape.PARTIAL_REASONS keys and `unscraped`, comma-separated), or UNREAD (no count at all).
        scraping: the daemon scrapes the server (no count yet is UNREAD, not COUNT_OFF); unread_since_ns, unread_spans:
        since when a proxy worker whose records are unread serves (None: none), and the ended spans of that state."""
        out = []
        for k in range(t.size - 1):
            if not self.server_seen:
                out.append(UNREAD if scraping else COUNT_OFF)
            elif self.server_from_ns is not None and t[k + 1] <= self.server_from_ns:
                out.append(self.server_before)
            else:
                why = set(why_low[k])
                if self.server_from_ns is not None and t[k] < self.server_from_ns and self.server_before != UNREAD:
                    why.add(self.server_before)  # counted from the first read on: the part before it is not
                out.append(",".join(sorted(why)) or COUNT_COMPLETE)
        since = unread_since_ns
        spans = [(a, b) for a, b in unread_spans if b > t[0]]  # those that reach these intervals
        if since is not None or spans:
            # An unread proxy worker's traffic is in no row: with the server's count complete it is in unproxied;
            # otherwise (off, unread, slots_only, a count that may be low) its energy read as idle, unsaid. An interval
            # overlapping the state (still on since `since`, or an ended span) says so.
            def unread(k: int) -> bool:
                return ((since is not None and t[k + 1] > since)
                        or any(a < t[k + 1] and b > t[k] for a, b in spans))
            out = [v if v == COUNT_COMPLETE or not unread(k) else ",".join(sorted({*v.split(","), PROXY_UNREAD}))
                   for k, v in enumerate(out)]
        return out

    def resolve_spans(self, upto_ns: int, force: bool = False) -> None:
        """Bypass tokens of each scrape window: how far the server's count rose beyond the proxy's.

        The gap G (server minus proxied tokens, cumulative) is bypass tokens B (never falling) plus
        a lag L >= 0: the server counts a token when its step ends, the proxy sees it a little later
        (later still on a loaded host), maybe in the next window. So a window's level is the lowest
        gap over the LAG_S after its end (the lag gone, B still there), and its bypass tokens are
        how far that level rises above the highest level of the last CREDIT_S (a lag longer than
        LAG_S then only moves tokens between windows). Not longer: a server that under-counts
        (llama.cpp's /slots without --metrics) lowers the gap for good and must not hide bypass
        traffic for ever. A window is resolved once a scrape LAG_S after it exists, or, with
        `force`, when it starts before `upto_ns` (its intervals are closing).

        A server that counts a request's tokens when it finishes (`server_at_finish`: SGLang) is compared
        with the proxied requests' tokens at their last token (`finished`), not as they came: against
        those, its count lags each request by its whole length, and the jumps where a busy stretch's
        requests finished rose above the last CREDIT_S's levels as bypass tokens (a 300-request SGLang
        run with no bypass: 11% of the requests' energy in unproxied). A live request is then in neither
        count: its windows need not wait for its end."""
        lag_ns, credit_ns = int(LAG_S * 1e9), int(CREDIT_S * 1e9)
        self._mark_restart_unsure(credit_ns)
        todo = [sp for sp in self.server_spans if sp.bypass_tokens is None]
        if not todo:
            return
        # A live request whose tokens are only placed at its end (a non-streamed body, spread back) or
        # may still be corrected there (an OpenAI stream counted one token per chunk, until its final
        # `usage`) would leave the server's count ahead of the proxy's in its windows: they wait for
        # its end (bounded like the intervals' own holds), or those tokens would be taken for bypass
        # traffic and attributed to the request as well.
        # A non-streamed answer's windows always wait (all its tokens come at its end); a count-less
        # stream's only where they would give tokens to bypass (below): where the proxy's count kept
        # up there is nothing to correct, and holding every window while some such stream is live
        # (nearly always, on a busy server) kept the work model's fit from maturing (a 240-request
        # trace: 200 requests in its warm-up instead of 160).
        # A whole answer its server died with is live here until its decode is placed at its interval's close
        # (`Ledger._run_on_gone`, listed there): resolved at its end, its windows kept the server's count of it (llama.cpp's
        # /slots) as bypass tokens, 235 of two such answers' 296.
        # So too one closed with no answer since the latest good scrape: a crash seen only at the next scrape (a
        # reloading llama-server's 503, `Ledger.note_down`) would find its windows resolved (0-69 J of two such answers'
        # decode in `unproxied`); a good scrape after its close says the server lived (a router's refusal): none waits.
        last_ns = self.server_spans[-1].t1_ns if self.server_spans else None
        live = [r for r in self.requests.values()
                if (r.trace.end_ns is None or r.run_on_crash and r.run_on_pace is None
                    or (r.trace.stream is not True and not r.crash_seen and last_ns is not None
                        and r.trace.end_ns >= last_ns and closed_unanswered(r)))
                and r.trace.api is not None and not self.server_at_finish]
        # A stream none of whose tokens has come yet may be held back on its way (a buffering proxy) and come in one
        # burst at its end, spread back over its run then (`_spread_burst`): its windows wait as a non-streamed
        # answer's do, bounded by the prompt hold. Normally that is only until its first token, after its prefill.
        # Waiting only where a window would give bypass tokens (as for counting streams, below) was not enough: a
        # window resolved meanwhile keeps the server's count of the burst's tokens, and their spread, placed there
        # later, never took it back (every later level that much higher: bypass tokens that were not).
        pending_ns = min((r.trace.arrival_ns for r in live
                          if (r.trace.stream is not True and r.trace.arrival_ns >= upto_ns - self.max_hold_ns)
                          or (r.trace.stream is True and r.trace.first_ns is None
                              and r.trace.arrival_ns >= upto_ns - self.prompt_hold_ns)), default=None)
        # A live stream whose latest piece was a burst (more tokens than its sequences) may be held back by a hop that
        # flushes when its buffer fills: its next burst's tokens, being generated now, are placed back to that piece
        # (`_held_burst`). Its windows since wait likewise, or the server's count of them passed for bypass traffic.
        # One whose first piece was such a burst is placed back at its end (`_first_burst`: to the server's decode
        # start where it gives timings, else to its arrival), so its windows wait from its arrival whatever its latest
        # piece (a small one once released the hold, and the windows resolved with the server's count of that burst
        # as bypass tokens, rows saying `complete`).
        held_ns = min(((r.trace.arrival_ns if r.first_held else r.prev_ns) for r in live
                       if r.trace.stream is True and (r.prev_held or r.first_held) and r.prev_ns is not None
                       and (r.trace.arrival_ns if r.first_held else r.prev_ns) >= upto_ns - self.prompt_hold_ns),
                      default=None)
        if held_ns is not None:
            pending_ns = held_ns if pending_ns is None else min(pending_ns, held_ns)
        # A sure run-on (SGLang's, whose answer cannot end by itself: ignore_eos, min_tokens) that its max_tokens may end
        # before the abort is listed in `finished` as SGLang's length finish once placed (`Ledger._place_run_on`), after
        # its run: its windows wait from its client's leave, or its count read there as bypass tokens first (34 of its 34
        # in a window resolved 1.4 s after its finish, before its placing), and the listing then lowered a later one.
        if self.server_at_finish:
            capped_ns = min((r.run_on_from_ns for r in self.requests.values() if r.run_on_from_ns is not None
                             and r.trace.extra.get("max_tokens")
                             and (r.trace.extra.get("eos_ignored") or r.trace.extra.get("min_tokens"))), default=None)
            if capped_ns is not None:
                pending_ns = capped_ns if pending_ns is None else min(pending_ns, capped_ns)
        counting_ns = min((r.trace.arrival_ns for r in live
                           if r.trace.stream is True and r.trace.api.startswith("openai") and told_prompt_tokens(r) is None
                           and r.trace.arrival_ns >= upto_ns - self.prompt_hold_ns), default=None)
        last = self.server_spans[-1].t1_ns
        if last == self._resolved_last and not force:
            return  # no scrape since the last pass: no window has become resolvable (4 passes a second)
        self._resolved_last = last
        # The proxy's tokens per window are counted now, not at the scrape: a token event may be
        # recorded after a scrape that its timestamp precedes (a non-streamed body's, spread back).
        src = self.finished if self.server_at_finish else self.proxied
        pt = np.fromiter((x[0] for x in src), dtype=np.int64, count=len(src))
        pn = np.fromiter((x[1] for x in src), dtype=float, count=len(src))
        order = np.argsort(pt, kind="stable")
        pt, cum = pt[order], np.concatenate([[0.0], np.cumsum(pn[order])])
        dur = None
        if self.server_at_finish:  # the proxied requests' durations, in the same order (`_spread_back`)
            dur = np.concatenate([[0], np.cumsum(np.fromiter((x[2] for x in src), dtype=np.int64, count=len(src))[order])])
        t0 = np.searchsorted(pt, [sp.t0_ns for sp in todo], side="right")
        t1 = np.searchsorted(pt, [sp.t1_ns for sp in todo], side="right")
        placed = self._placed_in(todo, cum[t1] - cum[t0])
        if self.slack:  # the usage's tokens beyond the chunks in each window (`_placed_at_end`)
            st = np.fromiter((x[0] for x in self.slack), dtype=np.int64, count=len(self.slack))
            sn = np.fromiter((x[1] for x in self.slack), dtype=float, count=len(self.slack))
            so = np.argsort(st, kind="stable")
            st, sn = st[so], sn[so]
            scum = np.concatenate([[0.0], np.cumsum(sn)])
            slack = (scum[np.searchsorted(st, [sp.t1_ns for sp in todo], side="right")]
                     - scum[np.searchsorted(st, [sp.t0_ns for sp in todo], side="right")])
        else:
            slack = np.zeros(len(todo))
            st, sn = np.zeros(0, dtype=np.int64), np.zeros(0)
        if not self.server_at_finish:  # the open windows' bypass tokens as they stand (`bypass_pace`)
            self._open_bypass = {(sp.t0_ns, sp.t1_ns): sp.server_tokens - x for sp, x in zip(todo, placed.tolist())}
            self._pass_len = len(self.proxied)
        ends = np.array([sp.t1_ns for sp in todo], dtype=np.int64)
        chunk_early = self._chunk_early(np.array([sp.t0_ns for sp in todo], dtype=np.int64)) if self.chunk_spreads \
            else np.zeros(len(todo))
        chunk_low = self._chunk_early(ends) if self.chunk_spreads else np.zeros(len(todo))
        # A restarted server lost the old process's tail, the proxied tokens in it too: the gap falls there for good.
        # No window before the restart looks past it for its level (its LAG_S lookahead read the fall as lag), and
        # the restart's window starts the levels afresh: held against the levels before it, the fall hid as many
        # bypass tokens for CREDIT_S after it (35 of 50 counted, tests/test_daemon_bypass_partial.py).
        restart = np.array([sp.restarted for sp in todo], dtype=bool)
        # The server read its counter somewhere in the GET whose midpoint stamps the window's end (`read_ns`): the
        # proxy's tokens from the GET's start to that stamp may be missing from the count (read early), those from the
        # stamp to its end may be in it already (read late). Unknown (a caller that gives no GET): none, as before.
        # At-finish (SGLang), a request's finish is taken at the proxy's last token, already some ms off the server's
        # count, and the levels take a finish on either side of an edge within that: a GET under GET_FINISH_SLACK_S
        # adds nothing (told, 4 ms GETs marked 13-20% of exact rows at 10 requests/s; a 200 ms GET still marks).
        slack_ns = int(GET_FINISH_SLACK_S * 1e9) if self.server_at_finish else 0

        def told(sp) -> bool:
            return sp.read_span_ns is not None and sp.read_span_ns[1] - sp.read_span_ns[0] >= slack_ns

        read_a = np.array([sp.read_span_ns[0] if told(sp) else sp.t1_ns for sp in todo], dtype=np.int64)
        read_b = np.array([sp.read_span_ns[1] if told(sp) else sp.t1_ns for sp in todo], dtype=np.int64)
        at_end = cum[np.searchsorted(pt, ends, side="right")]
        early_n = at_end - cum[np.searchsorted(pt, read_a, side="right")]
        late_n = cum[np.searchsorted(pt, read_b, side="right")] - at_end
        # The most and the least lag a delay of the proxy's own can hold at each window's end (`PROXY_LAG`, below): the
        # proxy's tokens over that delay after it, the delay measured on its loop at that edge (LAG_S where none was).
        if self.server_at_finish:
            ahead_n, measured = np.zeros(len(todo)), np.ones(len(todo), dtype=bool)
            ahead_lo = ahead_n
        else:
            most, least = self.edge_delays_s(ends, lag_ns)
            measured = np.array([d is not None for d in most])
            at = np.searchsorted(pt, ends, side="right")

            def tokens_over(ds: list) -> np.ndarray:
                held = np.array([LAG_S if d is None else d for d in ds])
                return cum[np.searchsorted(pt, ends + np.rint(held * 1e9).astype(np.int64), side="right")] - cum[at]
            ahead_n, ahead_lo = tokens_over(most), tokens_over(least)
        # The count lost beyond what its reads and the proxy's lag explain (`_lost_beyond`): added back to the gap, so
        # no level before or after it holds that loss (the windows it falls in say counter_below).
        lost, run_pace = self._lost_beyond(todo, placed, slack, restart, ahead_n, measured, early_n, late_n, lag_ns,
                                           pt, cum)
        # The first window that may have lost tokens, not judged yet (`_lost_beyond`): the scrape after its run tells.
        unjudged = int(np.argmax(np.isnan(lost))) if np.isnan(lost).any() else None
        lost = np.nan_to_num(lost, nan=0.0)
        gaps = self._gap + np.cumsum(np.array([sp.server_tokens for sp in todo], dtype=float) - placed + lost)
        next_restart, nxt = np.empty(len(todo), dtype=np.int64), len(todo)  # the first restart after each window
        for k in range(len(todo) - 1, -1, -1):
            next_restart[k] = nxt
            nxt = k if restart[k] else nxt
        for k, sp in enumerate(todo):
            told = set(sp.partial)  # what the scraper said of it (and a restart's marks), before this pass adds any
            # `force` is for the windows of the intervals being closed only: later ones, old enough but
            # live with a stream still to be corrected, keep waiting (forced too, 4 tokens a chunk with
            # usage gave ~13% of the requests' energy to unproxied with no bypass traffic at all).
            forced = force and sp.t0_ns < upto_ns
            if not (sp.t1_ns + lag_ns <= last or forced):
                break
            if not forced and pending_ns is not None and sp.t1_ns > pending_ns:
                break
            ahead = slice(k, next_restart[k])
            if unjudged is not None and not forced and unjudged < next_restart[k] \
                    and ends[unjudged] <= sp.t1_ns + lag_ns:
                break  # its lookahead takes in a fall not judged yet (`_lost_beyond`): the next scrape tells
            low = k + int(np.argmin(gaps[ahead][ends[ahead] <= sp.t1_ns + lag_ns]))  # the window its level is taken at
            level = float(gaps[low])
            nr = int(next_restart[k])
            if nr < len(todo):
                # A restart after it is known. The proxy's tokens after the last scrape before it are its lag
                # (counted by the old process at that scrape, seen by the proxy since) or the old process's lost tail
                # (never counted), and nothing tells which: held against the old count, the lag drains and the tail
                # lowers the level. Not looked at, a proxy behind at that scrape (a loaded host) left its lag in the
                # gap as bypass tokens that never ran, in rows that said `complete` (the real llama-server: 134 counted
                # for 100 sent, 34 of them a cut stream's lag). Taken as lag, the count may be low here, and is said.
                # Every window still open when the restart is known, up to the first scrape after it: not only those
                # whose LAG_S lookahead crosses it. A proxy stalled across the restart (its workers stopped on a loaded
                # host) reads the old process's last tokens while the server is down, in one burst placed back over
                # the stall at the pace of the last scrape window, the server's death unknown (`_held_burst`): part
                # of them fell in the restart's window past the LAG_S reach, and the stall's windows, some over LAG_S
                # before it and held open for that burst, kept the rest of the lag as bypass tokens that never ran
                # (230 counted for 100 sent, rows `complete`; tests/test_daemon_bypass_partial.py: 48, 71, 119 for 0).
                cut = todo[nr].t0_ns
                reach = int(ends[nr])
                seen = cum[np.searchsorted(pt, reach, side="right")] - cum[np.searchsorted(pt, cut, side="right")]
                crossed = float(gaps[nr - 1]) - float(seen)
                # A request the old process served still live (a stalled proxy worker yet to read its last tokens):
                # they will be placed at the restart's cut (`_restart_cut_ns`), how many nothing tells. The old process
                # counted them here, so no bypass tokens are booked here (low if any ran: said). Resolved before its
                # second piece came (its intervals closed), a window read that piece as bypass tokens that never ran.
                if any(q.trace.arrival_ns <= cut for q in live):
                    crossed = min(crossed, max([x[1] for x in self._levels if x[0] >= sp.t1_ns - credit_ns],
                                               default=self._level))
                if crossed < level:
                    level = crossed
                    if "server_restart" not in sp.partial:
                        sp.partial = (*sp.partial, "server_restart")
            elif forced and sp.t1_ns + lag_ns > last:
                # Forced (its intervals held the 10 s cap) before any scrape past its LAG_S reach: the server unread
                # since the latest scrape (down, or too slow), a restart not told yet. The proxy's tokens since that
                # scrape are its lag (counted there) or tokens the server counts later (or lost, restarted), and
                # nothing tells which: taken as lag, as at a restart, the count is never high, and where that lowers it
                # the window says `unscraped`. Not looked at, the lag stayed in the level as bypass tokens that never
                # ran: against the real llama-server, its old process 10 s in exiting, 110.5 counted for the 100 sent.
                after = cum[-1] - cum[np.searchsorted(pt, last, side="right")]
                unread = float(gaps[-1]) - float(after)
                if unread < level:
                    level = unread
                    if "unscraped" not in sp.partial:
                        sp.partial = (*sp.partial, "unscraped")
            ref = max([x[1] for x in self._levels if x[0] >= sp.t1_ns - credit_ns], default=self._level)
            if not forced and counting_ns is not None and sp.t1_ns > counting_ns and level > ref:
                break
            recent = [x for x in self._levels if x[0] >= sp.t1_ns - credit_ns]
            ref_least = max([x[3] for x in recent], default=self._ahead[1])
            ref_most = max([x[2] for x in recent], default=self._ahead[0])
            while self._levels and self._levels[0][0] < sp.t1_ns - credit_ns:
                self._levels.popleft()
            sp.bypass_tokens = max(0.0, level - ref)
            if lost[k] > 0 and COUNTER_BELOW not in sp.partial:
                # its count lost tokens nothing here explains (`_lost_beyond`)
                sp.partial = (*sp.partial, COUNTER_BELOW)
            if COUNTER_BELOW not in sp.partial and (lost[k + 1:low + 1] > 0).any() \
                    and float(gaps[k]) - level - float(ahead_n[k]) > LAG_TOKENS + LAG_SHARE * float(sp.server_tokens):
                # Its level is taken past a lost run, lower by what that run's reads may explain (a read early: left in
                # the gap, not added back) beyond the proxy's lag at its end: as many bypass tokens may hide here (200
                # lost at 5.1 s beside an alternating pace, no GET told: row 4 read 20 or 27 for 40, `complete`).
                sp.partial = (*sp.partial, COUNTER_BELOW)
            left = [(e, x) for e, x in self._left_runs.items() if e <= sp.t0_ns and sp.t1_ns <= e + credit_ns and x > 0]
            if COUNTER_BELOW not in sp.partial and left:
                # After a lost run, the part of its shortfall its reads may explain (a read early) was left in the gap:
                # the reference, held from before the run, stands above this window's level by as much, and bypass
                # tokens as many hide here (200 lost at 5.1 s among jittered streams, no GET told: 103 added back, row
                # 6 read 15.8 for 41, `complete`, review s52). What nothing tells is read early or lost: where adding
                # it back would raise the figure past its tolerance, the window says counter_below.
                up = sum(x for _, x in left)
                ref_up = max([x[1] + sum(v for e, v in left if e < x[0]) for x in self._levels
                              if x[0] >= sp.t1_ns - credit_ns], default=self._level)
                if max(0.0, level + up - ref_up) - sp.bypass_tokens > LAG_TOKENS + LAG_SHARE * float(sp.server_tokens):
                    sp.partial = (*sp.partial, COUNTER_BELOW)
            if lost[k] < 0 and PROXY_LAG not in sp.partial:
                # its rise may be a loss added back coming back, or bypass (`_lost_beyond`)
                sp.partial = (*sp.partial, PROXY_LAG)
            while self._lost_runs and self._lost_runs[0][0] < sp.t0_ns - credit_ns:
                self._lost_runs.popleft()
            if lost[k] > 0:
                if self._lost_runs and self._lost_runs[-1][0] == int(sp.t0_ns):
                    self._lost_runs[-1][0] = int(sp.t1_ns)
                    self._lost_runs[-1][1] += float(lost[k])
                else:
                    self._lost_runs.append([int(sp.t1_ns), float(lost[k]), float(run_pace[k])])
            elif lost[k] < 0:
                _take_oldest(self._lost_runs, -float(lost[k]))
            lossy = set(sp.partial) - {PROXY_LAG}
            if lossy and not restart[k]:
                # A known loss of the count (counter_below: the scraper counts on from the highest reading, the tokens
                # below it lost for good; late_baseline, slots_only, unscraped, misplaced, server_restart): it lowers
                # the gap for good, and the reference falls by it once the levels before it age out (CREDIT_S on).
                # Owed, it was repaid out of real bypass traffic where the proxy's pace next fell, in rows saying
                # `complete` (20 bypass tokens read as 0, 35 s after the fall: tests/test_daemon_bypass_partial.py).
                # What is owed already, or falls owed within CREDIT_S + LAG_S of it, may be that loss: doubtful.
                self._lost_ns = int(sp.t1_ns)
                for o in self._owed:
                    o[2] = True
            if not restart[k] and not self.server_at_finish and not {SERVER_COUNT_SLOTS_ONLY, "server_restart",
                                                                     "unscraped"} & lossy:
                # Tokens are conserved: a counter read before its scrape's stamp (the daemon stamps the GET's midpoint;
                # llama-server's /metrics is read before /slots) leaves the proxy's tokens of that stretch placed in the
                # window and counted in the next, a dip of the gap that lasts while the proxy's pace does. Held past
                # CREDIT_S (a stream running on), the dip became the reference, and its recovery (the stream's end) read
                # as bypass tokens that never ran, in rows saying `complete` (16 where 1 ran, the counter read 0.1 s
                # early: tests/test_daemon_bypass_partial.py). So what the reference fell by is owed, and a rise nets
                # against it first, as far as the fall of the proxy's RATE from the window before can repay (the
                # stretch read early holds fewer of its tokens): while the proxy's pace holds, a rise is bypass traffic.
                # Rates, not counts: windows differ in length (a scrape missed, one 0.5 s then one 0.25 s), and the
                # count's fall read as a pace's hid a 12-token bypass request as repayment, then the owe spent, the
                # stream's end showed 12 that never ran (both rows `complete`). The fall of the rate times this
                # window's length bounds how far the tokens read early can fall (that stretch is within the window).
                # At most the proxy's tokens of the LAG_S either side of a scrape are owed (what a read that early can
                # owe, its level looking LAG_S ahead): at the window's start before it nets, at its end after. A server
                # that loses tokens by design (`slots_only`, an at-finish counter a cut stream never reaches) and a
                # window whose level a restart's lost tail or an unread server lowered (said above) owe nothing: those
                # losses would hide bypass traffic.
                fell = max(0.0, self._ref_last - ref)
                if fell > 0:
                    doubtful = self._lost_ns is not None and sp.t1_ns - self._lost_ns <= credit_ns + lag_ns
                    self._owed.append([int(sp.t1_ns), fell, doubtful])
                # Bounded at the window's start (the owe stood there, read early at the scrape before), before it nets,
                # and at its end after (below). Bounded at its end first, a stream that ended inside the window took
                # its own owe away before the window could net its recovery: at a 5 s scrape interval (a window holding
                # the whole end, none of its tokens within LAG_S of the window's end), a read 0.1 s early's recovery of
                # 16 read as bypass tokens that never ran, rows `complete`.
                self._cap_owed_and_overpaid(cum, pt, int(sp.t0_ns), lag_ns)
                n_prev, d_prev = (float(placed[k - 1]), int(todo[k - 1].t1_ns - todo[k - 1].t0_ns)) if k \
                    else (self._placed_last, self._placed_last_ns)
                d_k = int(sp.t1_ns - sp.t0_ns)
                # A chunk spread before the window's start and counted in it (`_chunk_early`) repays too, whatever the
                # pace: spread over its 100 ms, 4-token chunks counted at once (speculative decoding) left 2 tokens of
                # an owe that a stream's last window repaid at an unchanged pace, read as bypass tokens (proxy_lag).
                due = min(sp.bypass_tokens, max(0.0, n_prev * d_k / max(d_prev, 1) - float(placed[k]))
                          + float(chunk_early[k]))
                # What a read e s early owes is the proxy's rate times e, and a fall of the rate by f recovers f x e
                # (e: the owe over the rate before the fall, at most LAG_S), less than the bound above where e is
                # under the window's length: a 0.1 s early read's whole owe (16 at 160 tokens/s) netted at a fall to
                # 80 tokens/s whose recovery was 8, the owe spent, and the stream's end's real recovery of 8 read as
                # bypass tokens that never ran (rows 21 = 2 and 22 = 6, `complete`). Netted by that bound alone, the
                # existing scenes' owes (made over several windows, at a pace that alternates) were left partly
                # unpaid, so the bound stays; what it nets beyond f x e is kept as `_overpaid`, and the windows whose
                # count rises while any is left say proxy_lag: their rise may be a recovery the owe no longer holds.
                # Bounded as the owe is (`_cap_owed_and_overpaid`): the dip it stands for goes with the proxy's tokens.
                rate_prev = n_prev / max(d_prev, 1)
                owed_now = sum(o[1] for o in self._owed)
                early_ns = min(float(d_k), float(lag_ns), owed_now / rate_prev) if rate_prev > 0 else float(d_k)
                sure = max(0.0, (rate_prev - float(placed[k]) / max(d_k, 1)) * early_ns)
                due_was = due
                # Repaid oldest first. An owe older than CREDIT_S (or OWE_SCRAPES scrape intervals where longer:
                # `_owe_horizon_ns`) nets still (a stream read early runs on for minutes), but nothing then tells it
                # from a count lost for good that went unsaid: the window says proxy_lag
                # (count may be high or low). A doubtful owe (a known loss near its fall) does not net, and where it
                # would have, the window says proxy_lag too: its rise may be that recovery, or bypass traffic.
                unsure = 0.0
                horizon_ns = self._owe_horizon_ns(d_k, credit_ns)
                while due > 0 and self._owed:
                    o = self._owed[0]
                    take = min(o[1], due)
                    due -= take
                    o[1] -= take
                    if o[2]:
                        unsure += take
                    else:
                        sp.bypass_tokens -= take
                        if sp.t1_ns - o[0] > horizon_ns:
                            unsure += take
                    if o[1] <= 0:
                        self._owed.popleft()
                if unsure > LAG_TOKENS and PROXY_LAG not in sp.partial:
                    sp.partial = (*sp.partial, PROXY_LAG)
                netted = due_was - due
                if sp.bypass_tokens > LAG_TOKENS and sum(x[1] for x in self._overpaid) > LAG_TOKENS \
                        and PROXY_LAG not in sp.partial:
                    sp.partial = (*sp.partial, PROXY_LAG)  # its rise may be a recovery repaid early (`_overpaid`)
                _take_oldest(self._overpaid, float(sp.bypass_tokens))
                if netted - sure > 0:
                    self._overpaid.append([int(sp.t1_ns), netted - sure])
                self._cap_owed_and_overpaid(cum, pt, int(sp.t1_ns), lag_ns)
            self._ref_last = ref
            if restart[k] and any(q.trace.arrival_ns <= sp.t0_ns for q in live):
                # Its level holds the old process's count of tokens still to come (placed at its end, here, once
                # read): no bypass tokens are booked (low if any ran; the window says server_restart), and the levels
                # after it start from it, where those tokens will stay.
                sp.bypass_tokens = 0.0
            # How far the lag its level may hold (at the window it is taken at) rose, or fell, from what the levels of
            # the last CREDIT_S held, a delay held so making a lag of its share of the proxy's rate; and the lag at its
            # end that its lookahead took out. Not measured, that share is not the lag (LAG_S's is the next second's
            # tokens, in the levels before a stream began too): taken from none, and fallen to none.
            # Each the most it may have: risen from the least the levels held to the most the window's may hold, fallen
            # from the most they held to the least it may hold.
            rose, fell = float(ahead_n[low]) - ref_least, ref_most - float(ahead_lo[low])
            # Less what the level's own edge may lack of chunk tokens placed before it (`_chunk_early`): a stream's dip
            # there, no lag drained (taken for one, it marked honest windows of speculative chunks placed early).
            drained = max(0.0, float(gaps[k]) - level - float(chunk_low[low]))
            if not measured[low]:
                rose, fell = (float(ahead_n[low]), -float(ahead_n[low])) if sp.bypass_tokens > LAG_TOKENS \
                    else (-ref_most, ref_most)
            # the bypass tokens that lag may have made (the count high) or hidden (low)
            made, hidden = min(sp.bypass_tokens, rose), min(drained, fell)
            # And the bypass tokens a lag that fell since the window before may have hidden here: those that ran are the
            # rise of the gap less the lag's, at most (its gap less the least lag at its end) less (the window before's
            # less the most there), and the count took `sp.bypass_tokens` of them. The levels held the lag (a level is
            # the lowest gap of the lookahead; its reference, the highest level of CREDIT_S), so where it fell the
            # windows after counted short, and only a window whose own lookahead took the lag out said so: a loop
            # catching up from 150 ms late over a second beside 100 bypass tokens/s, its windows 4-5 of 10, the window
            # after a 90 ms stall 4 of 10, rows `complete` (tests/test_daemon_bypass_lag.py). Only where bypass traffic
            # ran lately (over a token in the last LAG_S's windows, or this one's): the lag's bounds are wide around a
            # measured stall, and with no bypass traffic there, nothing to hide, they marked its windows (5 a 90 ms
            # stall).
            gap_prev, most_prev = (float(gaps[k - 1]), float(ahead_n[k - 1]) if measured[k - 1] else None) if k \
                else (self._gap, self._edge_most)
            lately = sp.bypass_tokens > LAG_TOKENS or sum(x for _, _, x in self._bypassed) > LAG_TOKENS
            if lately and measured[k] and most_prev is not None and not restart[k] and not self.server_at_finish:
                ran = min(float(gaps[k]) - float(ahead_lo[k]), level - float(ahead_lo[low])) - (gap_prev - most_prev)
                hidden = max(hidden, ran - sp.bypass_tokens)
            while self.pace_unsure and self.pace_unsure[0][1] < sp.t0_ns - lag_ns:
                self.pace_unsure.popleft()
            if self.pace_unsure and any(a < w.t1_ns and b > w.t0_ns
                                         for a, b in self.pace_unsure for w in (sp, todo[low])):
                # Where a held burst's tokens belong, nothing tells (`_at_server_pace`): its windows' counts may be off,
                # and a window whose level is taken at one of them (its lookahead's lowest gap: 16 and 0 of 30 before
                # a burst crowded in the window after them).
                made = np.inf
            if not self.server_at_finish and sp.bypass_tokens > LAG_TOKENS and self._silent_at(int(ends[low]), lag_ns) \
                    and self._live_at(int(ends[low])):  # the measures after the edge first: a few, not every request
                # The proxy, measured before, measured nothing for LAG_S past the edge its level is taken at while a
                # request was live there: stopped (its workers on a loaded host), it read none of the tokens the server
                # counted meanwhile, and how far behind it fell nothing bounds (LAG_S's bound is the tokens it read over
                # that second: none). Its count may be all that lag: against the real llama-server, two workers stopped
                # for 11 s and killed by the watchdog, 314 of a cut stream's tokens read as bypass, rows `complete`.
                made = max(made, float(sp.bypass_tokens))
            # A `slots_only` window says already that its count may be low, and is kept in J/token by design (as
            # `_read_unsure` leaves it): only what the lag may have made counts there. Its /slots misses each request's
            # last tokens, a fall of the gap that reads as a lag drained: hidden counted, a real llama-server without
            # --metrics beside two CPU hogs had its request's intervals say proxy_lag (hidden 17-26 tokens, no bypass
            # traffic) and its row bypass-uncounted, 2 runs in 6.
            moved = made if SERVER_COUNT_SLOTS_ONLY in sp.partial else max(made, hidden)
            if moved > max(LAG_TOKENS, LAG_SHARE * float(sp.server_tokens)) \
                    and "server_restart" not in sp.partial and PROXY_LAG not in sp.partial:
                # Its bypass count may be off by the proxy's own lag. The proxy sees a token a delay after the server
                # counted it: a record's 20 ms are placed back over their span (on_tokens), but a delay of the proxy's
                # own (a loaded host's event loop) is not, and holds the server that delay's tokens ahead as long as
                # its streams run, past LAG_S. Where the proxy's rate rises beyond what it was at the levels of the last
                # CREDIT_S (a stream begins), the level rises by that lag: bypass tokens that never ran (300 tokens/s
                # 50 ms late: 15 a stream, rows `complete`; tests/test_daemon_bypass_lag.py). Where it falls (a stream
                # ends), the lag drains within the lookahead of the windows of its last LAG_S: their levels, the gap
                # after it, stay flat while bypass traffic runs, and as many bypass tokens are hidden (13 of 15 in the
                # 0.75 s before the stream's end, rows `complete`). Bypass traffic that begins or ends there reads
                # the same, and nothing tells them apart: the count is kept (right, if no lag) and the window says
                # `proxy_lag`, where the delay the daemon measured on the proxy's loop at the level's edge
                # (`edge_delays_s`; LAG_S where none was) times the change of the proxy's rate can make more than a token: a record's own
                # delay (3 ms) moves that much whatever the placing (a token generated within it before a scrape),
                # and more than LAG_SHARE of the window's server count: below it the lag moves the window's requests'
                # energy by less than half the attribution's own p95 error. A 1-token bound alone marked a loaded
                # host's every busy rise (two CPU hogs: 2-4 tokens of windows of 179-302 marked 1 run in 3 of
                # tests/test_daemon_tag_bypass.py and left its tag out). Bounded by the measured delay, bursty traffic
                # beside a proxy on time is not marked at every rise (LAG_S's bound marked 7 of 25 busy intervals of
                # that run, and left its tag out). Not where a
                # restart lowered the count (server_restart): the server down, not the proxy, moved the rate there.
                sp.partial = (*sp.partial, PROXY_LAG)
            s_k = float(slack[k])
            tol = LAG_TOKENS + LAG_SHARE * float(sp.server_tokens)
            # Tokens placed on the usage's word beyond the stream's chunks (`_placed_at_end`): if the server's counter
            # did not count them, as many bypass tokens hide behind them, and per window an honest server (its counter
            # counting them: SGLang's end-of-text token) and one whose usage over-says read alike while bypass traffic
            # is steady. Past the window's tolerance (a token plus LAG_SHARE of its server count, PROXY_LAG's) it says
            # so, but for those an at-finish counter was seen to count (`_usage_doubt`): there the tolerance alone
            # marked honest SGLang's short answers, a 25-token call's 3 trailing tokens every window (1 in 20 is past
            # LAG_SHARE), for nothing. Any of a number a stream the counter was seen short of marks the window: below
            # the tolerance a window hid up to a token plus 5% unsaid, and a row's 4 such windows more than the row's own
            # (40-token answers beside bypass traffic: rows 15 for 30 `complete`). A second test, "the counter rose less
            # than the placed tokens by more than the tolerance", reduced to placed − count > tol whatever the surplus
            # (it cancels out): ordinary placing jitter, which marked every window of honest 50-token SGLang answers
            # every 40 ms; a usage over-saying with no bypass beside it is a negative gap, which the owed-count rules
            # above see.
            short_n, unknown_n = self._usage_doubt(sp, float(placed[k]), pt, st, sn, (int(read_a[k]), int(read_b[k])),
                                                   lag_ns) if self.server_at_finish else (0.0, s_k)
            if (short_n > PLACED_EPS or short_n + unknown_n > tol) and USAGE_BEYOND not in sp.partial:
                sp.partial = (*sp.partial, USAGE_BEYOND)
            # What the reads at its edges may have missed or taken early (`_read_unsure`).
            sp.read_unsure = (*((float(early_n[k - 1]), float(late_n[k - 1])) if k else self._edge_read),
                     float(early_n[k]), float(late_n[k]))
            sp.read_halves_ns = (*((int(ends[k - 1] - read_a[k - 1]), int(read_b[k - 1] - ends[k - 1])) if k
                                   else self._edge_halves_ns), int(ends[k] - read_a[k]), int(read_b[k] - ends[k]))
            if restart[k]:
                self._levels.clear()
                # The new process owes what its restart window's level fell below its gap (less the most lag the proxy
                # may hold at its end): that LAG_S lookahead takes in the new process's first dips (tokens placed before
                # the new counter read them), and their recovery read as bypass tokens that never ran (16 where 1 ran).
                # And the tokens placed in the window for requests that arrived inside it beyond all the new counter
                # counted there: the old process, cut, never counts them, so the new one, read before it counted them,
                # owes them (placed, they lowered the gap as a lost tail does: 8 of those 16).
                fresh = sum(n for q in self.requests.values() if q.trace.arrival_ns > sp.t0_ns
                            for t, n in zip(q.ev_t, q.ev_n) if sp.t0_ns < t <= sp.t1_ns)
                # The old process's owes go with it (its counter will never count them: its lost tail).
                self._owed = deque([[int(sp.t1_ns), max(0.0, float(gaps[k]) - float(ahead_n[k]) - level)
                                     + max(0.0, fresh - float(sp.server_tokens)), False]])
                self._ref_last = level
            if sp.bypass_tokens > 0 and sp.finished_latency is not None:
                self._spread_back(sp, pt, dur)
            self._levels.append((sp.t1_ns, level, float(ahead_n[low]), float(ahead_lo[low])))
            self._bypassed.append((sp.t0_ns, sp.t1_ns, sp.bypass_tokens))
            while self._bypassed and self._bypassed[0][1] < sp.t1_ns - lag_ns:
                self._bypassed.popleft()
            self._level, self._ahead = level, (float(ahead_n[low]), float(ahead_lo[low]))
            self._gap = float(gaps[k])
            self._placed_last, self._placed_last_ns = float(placed[k]), int(sp.t1_ns - sp.t0_ns)
            self._window_ns.append(int(sp.t1_ns - sp.t0_ns))
            self._edge_most = float(ahead_n[k]) if measured[k] else None
            self._edge_read = (float(early_n[k]), float(late_n[k]))
            self._edge_halves_ns = (int(ends[k] - read_a[k]), int(read_b[k] - ends[k]))
            self.resolved_to_ns = int(sp.t1_ns)
            if not self.server_at_finish:
                quiet = (np.searchsorted(pt, int(sp.t1_ns) - lag_ns, side="right")
                         == np.searchsorted(pt, int(sp.t1_ns) + lag_ns, side="right")) and not self._live_at(int(sp.t1_ns))
                self._usage_account(sp, float(placed[k]), float(slack[k]), told, quiet)
                self._stretch.allow = float(cum[np.searchsorted(pt, int(sp.t1_ns), side="right")]
                                            - cum[np.searchsorted(pt, int(sp.t1_ns) - lag_ns, side="right")])

    def _usage_account(self, sp: _ScrapeWindow, placed_n: float, slack_n: float, told: set, quiet: bool) -> None:
        """Adds resolved window `sp` (the proxy's `placed_n` tokens in it, `slack_n` of them a usage's few beyond a
        stream's chunks; `told`: its reasons before this pass) to the stretch of traffic since the latest quiet scrape,
        with the usage-only tokens placed in it (`note_usage_only`), and judges the stretch where `sp` ends quiet (no
        proxied token within LAG_S of its end, no proxied request live across it): `_judge_usage`."""
        st = self._stretch
        n, rids, keep = 0.0, set(), []
        for t, x, rid in self._usage_only:
            if t > sp.t1_ns:
                keep.append((t, x, rid))
            elif t > sp.t0_ns:  # those at or before its start came after their window was resolved: in no placed count
                n += x
                rids.add(rid)
        if len(keep) != len(self._usage_only):
            self._usage_only = deque(keep, maxlen=USAGE_ONLY_MAX)
        st.server_n += float(sp.server_tokens)
        st.placed_n += placed_n
        st.slack_n += slack_n
        st.end_ns = int(sp.t1_ns)
        # A count lost or unread in the stretch (a restart, the scraper's counter_below, a late baseline, slots_only,
        # unscraped, misplaced) leaves it short of the proxy's tokens for reasons of its own: not judged. The
        # reconciler's own counter_below (`_lost_beyond`: a run short for good) is no such word: it is what a usage
        # above the counter reads as (6 of the test scene's 30 busy intervals), and is judged.
        if (sp.restarted or told - {PROXY_LAG, USAGE_BEYOND, USAGE_ABOVE, USAGE_BELOW}
                or {"server_restart", "unscraped", MISPLACED} & set(sp.partial)):
            st.unjudged = True
        if n > 0:
            st.usage_n += n
            for rid in rids - st.requests:
                st.n_requests += 1
                st.final_n += self._usage_counts.get(rid, (0.0, 0.0))[0]
            st.requests |= rids
            st.windows.append(sp)
            st.usage_spans.append(sp)
            if st.above:
                self._usage_said(st)
        if not st.above and st.placed_n - st.server_n - st.slack_n <= LAG_TOKENS:
            # The counter has kept up with the proxy so far (a token: what a record's own delay moves): nothing to hold
            # its windows for. Held to the quiet scrape whatever, every whole answer's windows (all its tokens
            # usage-only) held the intervals after them: a third turn's prefill intervals closed after its end had
            # said its cached count, and its row no longer said prefix-cache-late
            # (tests/test_daemon_prefix_cache.py); under steady traffic, every row came 10 s late.
            st.windows = []
        st.spans.append(sp)
        self._below_books(st, sp)
        # Held only while the counter stands above: an honest counter's lead (up to 3 tokens ahead of streams) drains
        # within the second, and latched, every stretch mixing streams with whole answers held its rows to its end.
        st.below_hold = (st.usage_n > 0 and st.server_n - st.placed_n > LAG_TOKENS and st.start_served is not None
                         and st.start_served[1] == 0)
        if quiet:
            if not self._judge_usage_below(st, sp):
                self._judge_usage(st, 0.0)
            for rid in st.requests:
                self._usage_counts.pop(rid, None)
            self._stretch = _UsageStretch(start_ns=int(sp.t1_ns), start_served=sp.served)
            if self._ends:  # listed as ends were told (a proxy worker's may come late): not in time order
                self._ends = deque((e for e in self._ends if e[0] > sp.t1_ns), maxlen=USAGE_ONLY_MAX)
        self._usage_prune()

    def _below_books(self, st: _UsageStretch, sp: _ScrapeWindow) -> None:
        """What the server's books say at resolved window `sp`'s end of stretch `st` (`_judge_usage_below`): untold where
        the page did not say them (or its finished count went back: a restart), bypass_seen where the server finished
        more requests since the stretch began than the proxy saw end and holds live near it, or holds more running and
        queued than the proxy's requests live within LAG_S of it: a request not the proxy's ran. A stale gauge (a vLLM
        before vllm-project/vllm#29928 keeps its last step's count once every request was aborted) only reads too many:
        a stretch left unjudged, never one judged wrong."""
        if st.untold or st.bypass_seen or st.start_served is None or st.start_ns is None:
            return
        if sp.served is None or sp.served[0] < st.start_served[0]:
            st.untold = True
            return
        lag_ns = int(LAG_S * 1e9)
        t1 = int(sp.t1_ns)
        # The proxy's ends since the stretch began (listed after it, pruned at its start): those after `sp` too, so an
        # upper bound, which only lets a stretch be held on to its quiet scrape and judged there.
        ended = len(self._ends)
        near = sum(1 for q in self.requests.values() if (q.trace.api is not None or q.uncounted is not None)
                   and q.trace.arrival_ns <= t1 + lag_ns and (q.trace.end_ns is None or q.trace.end_ns >= t1 - lag_ns))
        if sp.served[0] - st.start_served[0] > ended + near or sp.served[1] > near:
            st.bypass_seen = True

    def _judge_usage_below(self, st: _UsageStretch, sp: _ScrapeWindow) -> bool:
        """Whether the server's usage ran below its own counter over stretch `st`, ended by the quiet resolved window `sp`:
        the counter counted more tokens than the proxy placed, by more than USAGE_ABOVE_TOKENS and USAGE_ABOVE_SHARE of
        its usage-only tokens, and the server's books prove that no bypass request ran: none running or queued at the
        stretch's two quiet scrapes (vllm:num_requests_running + _waiting 0 on both pages), and it finished exactly as
        many requests in between (vllm:request_success_total) as the proxy saw end, each one the server counts
        (`note_end`). Then the surplus is its requests' own tokens that their usage did not say: its windows' bypass
        tokens not yet spent are 0, those holding usage-only tokens say USAGE_BELOW, and its requests' rows name their
        usage's count and the counter's share (LiveRequest.usage_below).

        Bypass traffic raises the counter just as such a usage does, and nothing else tells them apart: before, every
        such surplus was booked as bypass (unproxied), the rows kept J/token over the low count, all `complete`. The
        finished count alone would miss a bypass request running across the stretch's end, the gauges alone one that
        began and ended inside it; neither counts a request the server aborted unfinished, whose tokens the counter
        holds: the counter may rise no more than USAGE_ABOVE_TOKENS over its finished requests' tokens
        (vllm:request_generation_tokens_sum). Where the page shows none (llama.cpp, SGLang, an older vLLM), nothing
        changes."""
        surplus = st.server_n - st.placed_n
        if (st.below or st.untold or st.bypass_seen or st.unjudged or st.usage_n <= 0 or st.start_served is None
                or st.start_ns is None or sp.served is None
                or surplus <= max(USAGE_ABOVE_TOKENS, USAGE_ABOVE_SHARE * st.usage_n)):
            return False
        ends = [counted for t, counted in self._ends if st.start_ns < t <= sp.t1_ns]
        if (st.start_served[1] != 0 or sp.served[1] != 0 or not all(ends)
                or sp.served[0] - st.start_served[0] != len(ends)):
            return False
        # Tokens the counter counted that no finished request's histogram holds: a request aborted unfinished (vLLM
        # counts none in request_success_total) generated them, a bypass one maybe (the proxy's cut ones say so above).
        if (len(sp.served) < 3 or len(st.start_served) < 3
                or st.server_n - (sp.served[2] - st.start_served[2]) > USAGE_ABOVE_TOKENS):
            return False
        st.below = True
        for x in st.spans:
            if x.bypass_tokens is not None:
                x.bypass_tokens = 0.0
        for x in st.usage_spans:
            if USAGE_BELOW not in x.partial:
                x.partial = (*x.partial, USAGE_BELOW)
        share = 1.0 + surplus / st.final_n if st.final_n > 0 else 1.0
        for rid in st.requests:
            q, counts = self.requests.get(rid), self._usage_counts.get(rid)
            if q is not None and counts is not None:
                q.usage_below = (counts[0], counts[0] * share, surplus, len(ends))
        self.usage_below_stretches += 1
        n = self.usage_below_stretches
        if n <= 3 or n % 100 == 0:
            log.warning("the server's own token counter counted %.0f token(s) more than the proxy placed over a stretch "
                        "of %d request(s) (%d whose usage alone said %.0f tokens), and its books show no request but the "
                        "proxy's (%d finished, none running at either end): its usage runs below its counter, not bypass "
                        "traffic (%d such stretches so far); their rows and intervals say %s; fix: %s",
                        surplus, len(ends), st.n_requests, st.usage_n, len(ends), n, USAGE_BELOW,
                        bypass_count_fix(USAGE_BELOW))
        return True

    def _usage_prune(self) -> None:
        """Bounds what steady traffic (no quiet scrape for hours) keeps for `_judge_usage`: past USAGE_REQUESTS_KEPT, the
        requests no longer live (their rows written: nothing left to tell them) are let go, from the stretch and from
        the final counts kept (`note_usage_only`); the stretch keeps their number and summed counts."""
        st = self._stretch
        if len(st.requests) > USAGE_REQUESTS_KEPT:
            st.requests = {rid for rid in st.requests if rid in self.requests}
        if len(self._usage_counts) > USAGE_REQUESTS_KEPT:
            self._usage_counts = {rid: x for rid, x in self._usage_counts.items()
                                  if rid in self.requests or rid in st.requests}

    def _judge_usage(self, st: _UsageStretch, allow: float) -> bool:
        """Whether the server's usage ran above its own counter over stretch `st`: the counter counted fewer tokens
        than the proxy placed (less a usage's few beyond its chunks, `slack`, which usage_beyond_chunks says on its own,
        and `allow`, what an honest counter may still owe: 0 at a quiet scrape) by more than USAGE_ABOVE_TOKENS and
        USAGE_ABOVE_SHARE of its usage-only tokens. Where so, its windows holding them say USAGE_ABOVE, and its
        requests' rows too (`_usage_said`).

        Between two quiet scrapes every token the proxy placed was generated, and counted, between them: bypass traffic
        only raises the counter, and a lag or a read made early has drained. So a counter short of the proxy there is
        short of tokens believed on the server's word alone (the chunks were seen), or lost some (a restart: not
        judged). Per window nothing tells: the reconciler took each window's shortfall for a read made early (owed) and
        let it go unsaid once traffic ended (`_cap_owed_and_overpaid`), or for a loss (counter_below)."""
        short = st.placed_n - st.server_n - st.slack_n - allow
        if st.above or st.unjudged or st.usage_n <= 0 \
                or short <= max(USAGE_ABOVE_TOKENS, USAGE_ABOVE_SHARE * st.usage_n):
            return st.above
        st.above = True
        self.usage_above_stretches += 1
        n = self.usage_above_stretches
        if n <= 3 or n % 100 == 0:
            log.warning("the server's own token counter counted %.0f token(s) fewer than the proxy placed over a stretch "
                        "of %d request(s) whose usage alone said %.0f of them (%d such stretches so far): its usage runs "
                        "above its counter, which no bypass traffic explains; their rows and intervals say %s; fix: %s",
                        short, st.n_requests, st.usage_n, n, USAGE_ABOVE, bypass_count_fix(USAGE_ABOVE))
        self._usage_said(st)
        return True

    def _usage_said(self, st: _UsageStretch) -> None:
        """Marks stretch `st`'s windows holding usage-only tokens USAGE_ABOVE and tells its requests (LiveRequest.
        usage_above: their final count, the counter's share of it, the stretch's shortfall and requests). The counter's
        share is the final count less the stretch's shortfall over its requests' final counts, that share of it (a
        usage over-saying by one factor), never below the tokens its chunks carried (seen, so generated)."""
        for sp in st.windows:
            if USAGE_ABOVE not in sp.partial:
                sp.partial = (*sp.partial, USAGE_ABOVE)
        st.windows = []
        short = max(0.0, st.placed_n - st.server_n - st.slack_n)
        kept = max(0.0, 1.0 - short / st.final_n) if st.final_n > 0 else 1.0
        for rid in st.requests:
            q, counts = self.requests.get(rid), self._usage_counts.get(rid)
            if q is not None and counts is not None:
                final_n, chunks_n = counts
                q.usage_above = (final_n, max(chunks_n, final_n * kept), short, st.n_requests)

    def _judge_usage_forced(self, upto_ns: int) -> None:
        """The intervals up to `upto_ns` close (`bypass_over`) over windows whose stretch is not judged yet (its quiet
        scrape not come: steady traffic, or intervals held SCRAPE_HOLD_S): judged on what is known, an honest counter
        allowed to owe still the proxy's tokens of the LAG_S before the stretch's latest resolved window (a lag, a read
        made early) and a token. Those windows not found above close as they are; the stretch goes on, judged again at
        its quiet scrape or next close."""
        st = self._stretch
        if st.above or not st.windows or min(sp.t0_ns for sp in st.windows) >= upto_ns:
            return
        # As of the pass that resolved its latest window: summed afresh over `proxied` at every close, steady traffic's
        # 10 s of token events were walked 4 times a second.
        if not self._judge_usage(st, LAG_TOKENS + st.allow):
            st.windows = [sp for sp in st.windows if sp.t1_ns > upto_ns]

    def _usage_doubt(self, sp: _ScrapeWindow, placed_n: float, fin_t: np.ndarray, slack_t: np.ndarray,
                     slack_n: np.ndarray, read: tuple[int, int], lag_ns: int) -> tuple[float, float]:
        """Of the usage's tokens beyond the chunks (`_placed_at_end`) of the streams that finished in window `sp`, those
        of a number a stream the at-finish counter was seen short of lately, and those of a number it was not seen to
        count either way (judged by the window's tolerance, as before); those it was seen to count are neither. Per
        number a stream (1: SGLang's end-of-text token; 3: a self-closing call's trailing tokens with it), from the
        votes of the latest USAGE_VOTE_S: seen to count it where USAGE_COUNTED_VOTES windows holding such streams rose
        by exactly the proxied tokens and at most one in USAGE_SHORT_RATIO as many rose short, seen short of it where
        as many rose short and more than that share. `read` is the GET span that read the counter at its end; each
        window is passed once, in order, as it is resolved.

        What tells: a window in which the server finished exactly as many requests as the proxy placed finishes there
        (its latency histogram's count: scrape.Scraper.finished) finished no bypass request, so at finish its counter
        rose by the proxied streams' tokens alone, with those tokens (counted) or without them (short). Only where each
        finish sits past the proxy's measured delay and GET_FINISH_SLACK_S inside the GETs at its edges (the proxy sees
        a finish later than the server counted it), and the window says nothing else; a rise above the placed tokens
        (a stream the proxy saw less of) tells nothing. A window holding streams of several numbers votes for each: a
        counter that counted one of them and not the other two is not taken as counting 3 on 1's word, and one short of
        3 does not mark the windows of 1 it was seen to count. Votes are let go at a restart, told or said by the
        scraper's marks (counter_below, fall_unconfirmed: a new process unseen may be another build)."""
        if sp.restarted or {COUNTER_BELOW, "fall_unconfirmed"} & set(sp.partial):
            self._usage_votes = {}
        a, b = np.searchsorted(slack_t, [sp.t0_ns, sp.t1_ns], side="right")
        per = [(int(round(x)), x) for x in slack_n[a:b].tolist()]  # at-finish: one entry a stream, its whole surplus
        sizes = {n for n, _ in per}
        fa, fb = (int(x) for x in np.searchsorted(fin_t, [sp.t0_ns, sp.t1_ns], side="right"))
        prev, self._usage_read = self._usage_read, read
        if sizes and fb > fa and sp.finished_requests == fb - fa and not sp.partial and prev is not None:
            most_s = self._delay_most_s(sp.t0_ns - lag_ns, sp.t1_ns + lag_ns)
            margin_ns = None if most_s is None else int((GET_FINISH_SLACK_S + most_s) * 1e9)
            if (margin_ns is not None and int(fin_t[fa]) - max(sp.t0_ns, prev[1]) >= margin_ns
                    and min(sp.t1_ns, read[0]) - int(fin_t[fb - 1]) >= margin_ns):
                # every such token in it was counted, of each number there
                exact = abs(float(sp.server_tokens) - placed_n) <= 0.5
                if exact or float(sp.server_tokens) < placed_n:
                    for n in sizes:
                        self._usage_votes.setdefault(n, deque()).append((int(sp.t1_ns), exact))
        horizon_ns = int(sp.t1_ns) - int(USAGE_VOTE_S * 1e9)
        short_n = unknown_n = 0.0
        for n, x in per:
            votes = self._usage_votes.get(n, ())
            while votes and votes[0][0] < horizon_ns:
                votes.popleft()
            exact_votes = sum(1 for _, e in votes if e)
            short_votes = len(votes) - exact_votes
            if short_votes >= USAGE_COUNTED_VOTES and short_votes * USAGE_SHORT_RATIO > exact_votes:
                short_n += x
            elif not (exact_votes >= USAGE_COUNTED_VOTES and short_votes * USAGE_SHORT_RATIO <= exact_votes):
                unknown_n += x
        return short_n, unknown_n

    def _lost_beyond(self, todo: list[_ScrapeWindow], placed: np.ndarray, slack: np.ndarray, restart: np.ndarray,
                     ahead_n: np.ndarray, measured: np.ndarray, early_n: np.ndarray, late_n: np.ndarray,
                     lag_ns: int, pt: np.ndarray, cum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per window, the tokens its count lost that nothing but a loss explains (judged by whole runs of windows: how
        far their count rose less than the proxy's tokens placed in them, beyond what may lawfully lie between them at
        the run's outer edges, where that exceeds the run's tolerance, a token plus LAG_SHARE of the proxy's tokens
        there), negative where a window after such a run takes a recovery back out of it; else 0. And per window of a
        lost run, the bypass pace (tokens/ns) before it.

        Lawfully, the count may lack (a) the proxy's lag at the window's start (tokens counted before that edge and seen
        after it: `ahead_n`, the most a measured delay there may hold), (b) the proxy's tokens between its start's stamp
        and the end of the GET that read the counter there (read late: already in the count before) and between the
        start of the GET at its end and that stamp (read early: in the next count), and (c) a usage's tokens beyond the
        chunks (`slack`, said `usage_beyond_chunks` on its own). A caller that gives no GET span is read at the stamp,
        as elsewhere, but for a read early by up to LAG_S (the most of the proxy's own tokens that leaves short:
        `_read_early_most`). Unmeasured delays, restarts (their own rules), counters that lose by
        design (`slots_only`), unread servers and at-finish counters are not judged.

        A counter that lost tokens for good (a restart not told, the scraper counting on from its highest reading:
        `counter_below` where it says so, nothing said where the next page was back at that reading) lowers the gap for
        good. Held in the gap, the lookahead of the windows before it took the loss into their levels, and the
        reference held from before it for CREDIT_S hid as many bypass tokens after it, in rows saying `complete` (a
        counter losing 200 tokens at 5 s beside bypass traffic at 40 tokens/s: row 6 read 0 for 40; losing 100, back at
        its reading one page on and so unsaid, rows 4-6 read 0, 0, 20 for 40: tests/test_daemon_bypass_partial.py).
        Added back, the loss moves no level; the windows it fell in say counter_below (their bypass tokens are lost)."""
        lost = np.zeros(len(todo))
        run_pace = np.zeros(len(todo))
        credit_ns = int(CREDIT_S * 1e9)
        if self.server_at_finish:
            return lost, run_pace
        n_w = len(todo)
        dur = np.array([max(int(sp.t1_ns - sp.t0_ns), 1) for sp in todo], dtype=float)
        short = np.zeros(n_w)  # how far the count rose less than the proxy's tokens placed in it, less the slack
        start_allow = np.zeros(n_w)  # the lag and the late read at its start
        ok = np.zeros(n_w, dtype=bool)
        for k, sp in enumerate(todo):
            if restart[k] or {SERVER_COUNT_SLOTS_ONLY, "server_restart", "unscraped"} & set(sp.partial):
                continue
            lag0 = (float(ahead_n[k - 1]) if measured[k - 1] else None) if k else self._edge_most
            if lag0 is None:
                continue
            late0 = float(late_n[k - 1]) if k else self._edge_read[1]
            ok[k] = True
            short[k] = float(placed[k]) - float(sp.server_tokens) - float(slack[k])
            start_allow[k] = lag0 + late0
        # Whole runs. Each window's allowance taken off that window alone missed that inside a run the inner edges
        # cancel (what one lacks by an early read, the next holds): a 300-token loss read through 50 ms GETs beside a
        # pace alternating 160/80 tokens/s left 62 of its 240 proxied tokens in the gap (row 7 read 20 for 40,
        # `complete`), and the no-GET allowance (the rate's rise over LAG_S) broke a run into pieces, each won back by
        # steady bypass traffic after it. So a run is the windows in a row whose count fell short of the proxy's tokens
        # by over the tolerance, or that the scraper marked counter_below, and its loss is their shortfall less the
        # allowances at its outer edges only: the lag and the late read at its start, the early read at its end (no
        # GET: the most a read up to LAG_S early leaves short, below).
        # A loss is for good; a dip comes back. A run is judged by the LAG_S after it: the proxy's placing moves tokens
        # between neighbouring windows, and a multi-process page's dip (the scraper counting from its highest reading,
        # the windows below it 0) is back at the page that passes that reading. What the windows there do not win back
        # (the most the count rose above the proxy's tokens beyond the bypass pace before the run, summed from its end)
        # is lost, and the run's loss is added back; what they win back is a dip, added back and taken back out of them.
        # A run whose LAG_S after it has not been scraped yet is not judged
        # (NaN: the windows whose lookahead takes it in wait, `resolve_spans`).
        # What the proxy placed of chunks a usage told before each window's end and the server may count after it
        # (`_chunk_early`): the run's count lacks it lawfully, as a read early (a stream's first chunk given 3.6 of its
        # 4-a-chunk usage, its token the prefill's alone: 2.6 ahead of the counter till the stream's end, 4-10 of 30
        # honest intervals counter_below in the simulator's scene).
        chunk_end = self._chunk_early(np.array([sp.t1_ns for sp in todo], dtype=np.int64)) if self.chunk_spreads \
            else np.zeros(n_w)
        seed = ok & ((short > LAG_TOKENS + LAG_SHARE * placed)
                     | np.array([COUNTER_BELOW in sp.partial for sp in todo], dtype=bool))
        self._seed_ends = {e for e in self._seed_ends if e > int(todo[0].t0_ns) - lag_ns}
        self._seed_ends.update(int(todo[i].t1_ns) for i in np.flatnonzero(seed))
        seed_ends = np.array(sorted(self._seed_ends), dtype=np.int64)
        # A run ending among the windows still to resolve is judged afresh below (more of the proxy's tokens placed).
        self._left_runs = {e: x for e, x in self._left_runs.items() if e <= int(todo[0].t0_ns)}
        k = 0
        while k < n_w:
            if not seed[k]:
                k += 1
                continue
            m = k
            while m < n_w and seed[m]:
                m += 1
            if m == n_w or int(todo[-1].t1_ns) < int(todo[m - 1].t1_ns) + lag_ns:
                lost[k:] = np.nan
                break
            loss = float(short[k:m].sum()) - float(start_allow[k]) - float(early_n[m - 1]) - float(chunk_end[m - 1])
            sp_end = todo[m - 1]
            if sp_end.read_span_ns is None:
                # Read early by up to LAG_S, the run's count lacks the proxy's tokens of that stretch before its end and
                # holds those before its start: the most that leaves short, from the proxy's own tokens. The rise of its
                # rate from the window before the run to its last one, over LAG_S, stood for it: beside a pace
                # alternating 160/80 tokens/s each 0.25 s that is 80 tokens where a read early leaves at most 20, and
                # a 100-token loss at 5.1 s went unjudged (rows 4 and 6 read 10 for 40, `complete`).
                loss -= _read_early_most(pt, cum, int(todo[k].t0_ns), int(sp_end.t1_ns), lag_ns)
            tol = LAG_TOKENS + LAG_SHARE * float(placed[k:m].sum())
            if loss <= tol:
                k = m
                continue
            # The bypass traffic's pace before the run (the server's count less the proxy's tokens per ns, over the LAG_S
            # before it): a rise at that pace after it is that traffic, not the count winning back what it lacked.
            # Not a window within LAG_S after an earlier run, nor one a dip was taken back out of: what it rose above
            # the proxy's tokens may be that run's return, not bypass traffic. Taken as the pace, a 100-token dip's
            # return (80 counted for 20 proxied) made a second dip 0.25 s on, no bypass traffic at all, a loss added
            # back, and its passing page's return 60 bypass tokens (row 6 60 for 0, `complete`).
            pre = [i for i in range(k) if ok[i] and not seed[i] and int(todo[i].t1_ns) > int(todo[k].t0_ns) - lag_ns
                   and int(todo[i].t0_ns) not in self._dip_back
                   and not ((seed_ends <= int(todo[i].t0_ns)) & (seed_ends > int(todo[i].t0_ns) - lag_ns)).any()]
            if pre:
                pace = max(0.0, sum(float(todo[i].server_tokens) - float(placed[i]) for i in pre)
                           / sum(dur[i] for i in pre))
            else:
                dur_b = sum(b - a for a, b, _ in self._bypassed)
                pace = max(0.0, sum(x for _, _, x in self._bypassed) / dur_b) if dur_b > 0 else 0.0
            after = [i for i in range(m, n_w) if int(todo[i].t1_ns) <= int(todo[m - 1].t1_ns) + lag_ns
                     and not restart[i]] or [m]
            # No proxied tokens in the second after it (traffic ended): the fall may be the proxy's last lag draining
            # (unmeasured, its loop on time), and nothing wins back what a lag took: not judged, held as before.
            if sum(float(placed[i]) for i in after) <= LAG_TOKENS:
                k = m
                continue
            rise = [float(todo[i].server_tokens) - float(placed[i]) - pace * dur[i] for i in after]
            back = max(0.0, float(np.cumsum(rise).max()))
            pos = np.clip(short[k:m], 0.0, None)
            if loss - back > tol:
                # The scraper's window that passes its highest reading counts only the tokens beyond it: in a loss, short
                # of its own by whatever of the loss was left, up to its whole count, within the run's tolerance of the
                # proxy's tokens where bypass traffic fills it (200 lost beside an alternating pace, no GET: row 6 read
                # 30 for 40, `complete`). Short of them and the bypass pace before the run by over its own tolerance, it
                # is of the run: its shortfall there is added back, and it says counter_below.
                lost[k:m] = pos * (loss / pos.sum()) if pos.sum() > 0 else 0.0
                run_pace[k:m] = pace
                self._passing[int(todo[m].t0_ns)] = pace
                self._left_runs[int(sp_end.t1_ns)] = max(0.0, float(short[k:m].sum()) - loss)
            elif pos.sum() > 0 and pace * lag_ns > LAG_TOKENS + LAG_SHARE * float(placed[k:m].sum()):
                # A dip won back within the second: left in the gap, the LAG_S lookahead of the windows before it took
                # the dip into their levels as the proxy's lag, and the window it came back in read it as bypass tokens
                # (a 100-token one-page dip back within 0.5 s: row 4 read 0 for 40, `complete`; row 5 80, `proxy_lag`).
                # Only beside bypass traffic (its pace before the run, over LAG_S, past the run's tolerance): with none,
                # no level before it hides any, its return stays under the reference, and marking it cost exact rows
                # wherever the proxy's placing jitter reads as a dip (13 more of 72 scenes of random proxy lags).
                # Its whole shortfall, as far as it came back, is added back over the run and taken back out of the
                # windows it came back in (their rise beyond the bypass pace, in turn): it moves no level (the part the
                # reads may explain too: a read early does not come back while the proxy's pace holds), the run says
                # counter_below (its tokens are booked where they came back), the windows it came back in proxy_lag.
                dipped = min(float(pos.sum()), back)
                lost[k:m] = pos * (dipped / pos.sum())
                run_pace[k:m] = pace
                for i, x in zip(after, rise):
                    take = min(max(x, 0.0), dipped)
                    if take > 0:
                        self._dip_back[int(todo[i].t0_ns)] = take
                        dipped -= take
            k = m
        for i in range(n_w):
            if np.isnan(lost[i]):
                continue
            take = self._dip_back.get(int(todo[i].t0_ns))
            if take is not None and lost[i] == 0:
                lost[i] = -take
            pace = self._passing.get(int(todo[i].t0_ns))
            if pace is not None and lost[i] == 0 and ok[i] and not seed[i]:
                short_n = float(placed[i]) + pace * dur[i] - float(todo[i].server_tokens)
                if short_n > LAG_TOKENS + LAG_SHARE * float(placed[i]):
                    lost[i], run_pace[i] = short_n, pace
        self._passing = {a: p for a, p in self._passing.items() if a >= int(todo[0].t0_ns)}
        self._left_runs = {e: x for e, x in self._left_runs.items() if e >= int(todo[0].t0_ns) - credit_ns}
        self._dip_back = {a: p for a, p in self._dip_back.items() if a >= int(todo[0].t0_ns)}
        # A dip back past the LAG_S after its run (a multi-process page's, back 1.5-2 s on) was counted twice: added back
        # as a loss, and its recovery read as bypass traffic (480 bypass tokens over 2-12 s where 400 ran, the recovery
        # row 140 for 40, `complete`). Within CREDIT_S after a run added back, a window whose count rises above the
        # proxy's tokens by more than the bypass pace before the run (and what its reads and a fall of the proxy's rate
        # explain) takes that excess back out of the loss (negative here), and says proxy_lag: a recovery, or bypass.
        runs = [list(r) for r in self._lost_runs]
        for i in range(n_w):
            if np.isnan(lost[i]):
                break
            if lost[i] < 0:  # a dip's return, taken back above
                owed_n = -float(lost[i])
                for r in runs:
                    t = min(r[1], owed_n)
                    r[1] -= t
                    owed_n -= t
                continue
            if lost[i] > 0:
                if runs and runs[-1][0] == int(todo[i].t0_ns):
                    runs[-1][0] = int(todo[i].t1_ns)
                    runs[-1][1] += float(lost[i])
                else:
                    runs.append([int(todo[i].t1_ns), float(lost[i]), float(run_pace[i])])
                continue
            if not ok[i] or seed[i]:
                continue
            live = [r for r in runs
                    if r[0] <= int(todo[i].t0_ns) and int(todo[i].t1_ns) <= r[0] + credit_ns and r[1] > 0]
            if not live:
                continue
            sp = todo[i]
            explained = float(late_n[i]) + (float(early_n[i - 1]) if i else self._edge_read[0])
            if sp.read_span_ns is None:
                # The most a read up to LAG_S early holds beyond the window's own tokens (`_read_early_most`); the fall
                # of the proxy's rate over LAG_S that stood for it is 80 beside a pace alternating 160/80 tokens/s where
                # a read early holds 20, and a 50-token dip back 1.25 s on with no bypass traffic read as 49 bypass
                # tokens, row 6 `complete`.
                explained += _read_early_most(pt, cum, int(sp.t0_ns), int(sp.t1_ns), lag_ns, held=True)
            excess = (float(sp.server_tokens) - float(placed[i]) - max(r[2] for r in live) * dur[i] - explained
                      - LAG_TOKENS - LAG_SHARE * float(placed[i]))
            if excess <= 0:
                continue
            take = 0.0
            for r in live:
                t = min(r[1], excess - take)
                r[1] -= t
                take += t
            lost[i] = -take
        return lost, run_pace

    def _cap_owed_and_overpaid(self, cum: np.ndarray, pt: np.ndarray, at_ns: int, lag_ns: int) -> None:
        """At most the proxy's tokens of the LAG_S either side of `at_ns` (a scrape) are owed (`resolve_spans`): what a
        read that early can owe, its level looking LAG_S ahead. The oldest go first. So too what was netted beyond the
        recovery (`_overpaid`): the recovery it stands for is of the dip a read made early holds, no larger than what
        it owes, and gone once the proxy's tokens are (never recovered later). Kept past them, an overpay marked the
        next bypass rise proxy_lag however long after: 8 tokens at a 5 s scrape interval, a 20-token bypass burst two
        minutes after the streams' end, the server idle between."""
        cap = float(cum[np.searchsorted(pt, at_ns + lag_ns, side="right")]
                    - cum[np.searchsorted(pt, at_ns - lag_ns, side="right")])
        for q in (self._owed, self._overpaid):
            _take_oldest(q, sum(o[1] for o in q) - cap)  # the oldest first

    def _owe_horizon_ns(self, d_k: int, credit_ns: int) -> int:
        """How old an owed count may be when repaid and still net unmarked (`resolve_spans`): CREDIT_S, or
        OWE_SCRAPES scrape intervals where those are longer (the median length of the latest windows, this one's `d_k`
        among them: one long window, a scrape missed, does not stretch it). An owe falls at a window's end and is repaid
        at a scrape after it: at a 5 s scrape interval even the next one is 5 s on, past CREDIT_S, and an exact
        repayment there said proxy_lag on age alone. Several scrapes on it still does."""
        lens = sorted([*self._window_ns, int(d_k)])
        return max(credit_ns, int(OWE_SCRAPES * lens[len(lens) // 2]))

    def _mark_restart_unsure(self, credit_ns: int) -> None:
        """Mark `server_restart` on the windows after a restart's that may hide bypass tokens behind a request that
        arrived inside the restart's scrape window (after the last scrape before it, before the first after it), read
        after that window and placed back over the time before (`note_unsure`). The old process served it, or the new
        one, and nothing tells which. The old one's tokens were never counted (its count after its last scrape is lost)
        and belong at the restart's cut; the new one's were counted where the proxy saw them, and moved to the cut they
        would read as bypass tokens that never ran. So they stay where placed, and the windows from the restart's first
        scrape to CREDIT_S past the request's last token (a fall of the gap holds the levels that long) say their count
        may be low: never high, never `complete` and wrong (a stream of the old process read late by a stalled worker,
        spread over the new process's windows, hid 25 of its 100 bypass tokens, rows `complete`). A stream seen as it
        came is left alone (after the cut, the new process's). Kept past its row while its windows may still close."""
        if not self._unsure:
            return
        for i, (b, u) in list(self._unsure.items()):
            q = self.requests.get(i)
            if q is not None and q.trace.end_ns is not None:
                t = q.trace.last_ns if q.trace.last_ns is not None else q.trace.end_ns
                self._unsure[i] = (b, int(t) + credit_ns)
        oldest = self.server_spans[0].t0_ns if self.server_spans else None
        self._unsure = {i: (b, u) for i, (b, u) in self._unsure.items()
                        if (i in self.requests or u is not None) and (u is None or oldest is None or u > oldest)}
        for sp in self.server_spans:
            if not sp.restarted and "server_restart" not in sp.partial and any(
                    b <= sp.t0_ns and (u is None or sp.t0_ns < u) for b, u in self._unsure.values()):
                sp.partial = (*sp.partial, "server_restart")

    def _placed_in(self, todo: list[_ScrapeWindow], placed: np.ndarray) -> np.ndarray:
        """The proxy's tokens placed in each window, checked: a stream's placings move its tokens, never make or take
        any, so a window can hold no fewer than none. One that does (a placing that took out what was never listed)
        would count its server's tokens and that shortfall as bypass tokens that never ran, in rows saying `complete`:
        it is held at its server's count instead (no bypass tokens booked there: low, if any ran) and says MISPLACED
        in `server_count`, with a log line (the first three, then every hundredth)."""
        wrong = placed < -PLACED_EPS
        if not wrong.any():
            return placed
        for k in np.flatnonzero(wrong):
            sp = todo[k]
            if MISPLACED in sp.partial:
                continue
            sp.partial = (*sp.partial, MISPLACED)
            self.misplaced_windows += 1
            if self.misplaced_windows <= 3 or self.misplaced_windows % 100 == 0:
                log.warning("the proxy's tokens placed in the scrape window %.3f-%.3f s came to %.1f, below none (a "
                            "fault of the daemon's; %d such windows so far): its bypass count is taken as 0, and its "
                            "intervals say %s in server_count; fix: %s", (sp.t0_ns - self.t0_ns) / 1e9,
                            (sp.t1_ns - self.t0_ns) / 1e9, float(placed[k]), self.misplaced_windows, MISPLACED,
                            bypass_count_fix(MISPLACED))
        return np.where(wrong, np.array([max(sp.server_tokens, 0.0) for sp in todo], dtype=float), placed)

    def _spread_back(self, sp: _ScrapeWindow, pt: np.ndarray, dur: np.ndarray | None) -> None:
        """Move a resolved at-finish window's start back to where its bypass requests began: their tokens were
        generated over their run, not in the window their end was counted in (docs/daemon.md, Bypass traffic).

        Their mean duration is the server's latency sum over the window less the proxied requests' that ended in it
        (arrival to last token), over their number; where that is not positive (a proxied request counted by the
        server in the next window), the mean of all that ended in it. Never before the first open interval: those
        closed have been accounted."""
        n_fin, sum_s = sp.finished_latency
        if dur is None:
            return
        a, b = np.searchsorted(pt, [sp.t0_ns, sp.t1_ns], side="right")
        n_bypass = n_fin - (b - a)
        s_bypass = sum_s - (dur[b] - dur[a]) / 1e9
        mean_s = s_bypass / n_bypass if n_bypass >= 1 and s_bypass > 0 else sum_s / n_fin
        # From `mean_s` before the window's end (they ended somewhere in it) to its end; never shorter than the window
        # itself (where it was placed before). Spread from its middle instead (their mean end), the 160-request SGLang
        # run read 113-115% of the bypass requests' true energy against 107%.
        floor = self.edges[0].t_ns if self.edges else sp.t0_ns
        sp.t0_ns = min(sp.t0_ns, max(floor, sp.t1_ns - int(mean_s * 1e9)))


def _read_early_most(pt: np.ndarray, cum: np.ndarray, s_ns: int, t_ns: int, lag_ns: int, held: bool = False) -> float:
    """The most of the proxy's tokens (times `pt`, running sums `cum`) that a count of (s, t] read e early, 0 < e <=
    lag, lacks: P(t - e, t] - P(s - e, s]; with `held`, the most it holds beyond them: P(s - e, s] - P(t - e, t]. Each
    is largest just as a token of the stretch before t (before s, held) enters it: those are the e tried."""
    lo, hi = np.searchsorted(pt, [t_ns - lag_ns, t_ns], side="right")
    e = np.append(t_ns - pt[lo:hi] + 1, lag_ns)
    if held:
        lo_s, hi_s = np.searchsorted(pt, [s_ns - lag_ns, s_ns], side="right")
        e = np.append(s_ns - pt[lo_s:hi_s] + 1, lag_ns)
    a = cum[hi] - cum[np.searchsorted(pt, t_ns - e, side="right")]
    b = cum[np.searchsorted(pt, s_ns, side="right")] - cum[np.searchsorted(pt, s_ns - e, side="right")]
    return max(0.0, float((b - a).max() if held else (a - b).max()))


def _mark_windows_over(t: np.ndarray, why: list[set], windows, spans, before_ns: int, after_ns: int,
                       reason: str) -> None:
    """Adds `reason` to `why` of each interval (edges `t`) that a scrape window of `windows` overlapping one of `spans`
    ((start, end) ns; widened by `before_ns` and `after_ns`) covers."""
    ends = [(a - before_ns, b + after_ns) for a, b in spans]
    for x in windows if ends else ():
        if x.t1_ns > t[0] and x.t0_ns < t[-1] and any(a < x.t1_ns and b > x.t0_ns for a, b in ends):
            for k in np.flatnonzero((x.t1_ns > t[:-1]) & (x.t0_ns < t[1:])):
                why[k].add(reason)


def _quiet(x: _ScrapeWindow) -> bool:
    """Window `x` is resolved, booked at most a token of bypass traffic (LAG_TOKENS), and says nothing of its count."""
    return x.bypass_tokens is not None and x.bypass_tokens <= LAG_TOKENS and not x.partial


def _take_oldest(q: deque, n: float) -> None:
    """Takes `n` tokens out of the [when, tokens] entries of `q`, the oldest first."""
    while n > 0 and q:
        take = min(q[0][1], n)
        n -= take
        q[0][1] -= take
        if q[0][1] <= 0:
            q.popleft()
