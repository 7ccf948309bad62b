"""Scrape the inference server's own token counters: a cross-check and a view of unproxied traffic.

- vLLM: `vllm:generation_tokens_total` on /metrics, updated every engine step; with it its finished requests
  (`vllm:request_success_total`) and those running and queued (`vllm:num_requests_running` + `_waiting`):
  `Scraper.served`, which tells a quiet stretch that no bypass request ran (reconcile.py).
- SGLang: `sglang:generation_tokens_total` on /metrics (moves when a request finishes). Its /metrics is
  prometheus_client's multiprocess collector, which shows a labelled family only once set: until its first
  request finishes (its warm-up's, none with --skip-server-warmup) the counter is absent, and the page may be
  empty. A server known to be SGLang (configured, or `/v1/models` says `owned_by: sglang`) whose /metrics
  answers without the counter has counted nothing yet: that reads 0, a baseline like any other, but only on
  SGLang's own page (nothing but `sglang:` families, none a finished request sets: servercount.unset_means_zero).
  A gateway's /metrics in front of it, or a page whose requests finished without the counter, fails the scrape:
  unknown, never a zero that hides the tokens served. Its `sglang:e2e_request_latency_seconds` histogram, observed
  with the counter, says how many requests finished since the previous scrape and their summed durations
  (`Scraper.finished`): the ledger spreads bypass tokens back over those durations (docs/daemon.md, Bypass traffic).
- llama.cpp: `llamacpp:tokens_predicted_total` on /metrics (llama-server --metrics) counts
  finished requests only, and `/slots` shows each running request's `n_decoded` but resets it
  to 0 when the request ends. Neither alone sees every token, so the count is the two added:
  finished (counter) + decoding now (/slots). Without --metrics, /slots alone misses each
  request's tokens after the last scrape before it ends (said in the log).

The first reading is the baseline: tokens are counted from it. The daemon takes it before it says it is
ready (`baseline`), so a request sent at its ready is counted whole; read later (a server not up yet), a
server that has already counted something may have counted tokens since the daemon's ready that the
baseline takes in. Both that and /slots alone leave the count possibly low: `partial` says why
(PARTIAL_REASONS), the daemon shows it on /metrics and logs it, never a silently low count.

Parsing is pure (text/JSON in, numbers out); `Scraper` does the HTTP and keeps the state needed
to turn snapshots into token deltas; `Cadence` says when to scrape (fast while anything moves,
slow once the server and the proxy are both still). Bodies are read up to MAX_METRICS_BYTES; a counter that is not
finite and non-negative, a slot's n_decoded that is not a count, or a /slots page of more than MAX_SLOTS slots (not
decoded: servercount.slots_json) fails that scrape with the reason.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
from powerprof.errtext import error_text
from powerprof.storage.schema import SERVER_COUNT_BELOW, SERVER_COUNT_SLOTS_ONLY
from powerprof.workload.auth import API_KEY_ENV, api_key_given, auth_headers
from powerprof.workload.limits import IDLE_REUSE_S, MAX_METRICS_BYTES, read_capped
from .ticks import IDLE_PERIOD_S
# The parsers are the workload layer's (the sweep's foreign-traffic check reads the same counters).
from powerprof.workload.servercount import (  # noqa: F401
    COUNTERS, FINISHED_LATENCY, LLAMACPP_COUNTER, YOUNG_COUNTER_TOKENS, YOUNG_DIP_TOKENS, connection_refused,
    counter_restarted, counter_total, histogram_sum_count, llamacpp_generated, prefix_cache_reading, requests_and_in_flight,
    series_values, slot_progress, slots_json, unset_means_zero)

log = logging.getLogger("powerprof.daemon.scrape")

SERVERS = ("auto", "vllm", "sglang", "llamacpp", "none")
# Servers whose token counter moves when a request finishes, by its tokens (not as they are generated): the ledger
# compares theirs with the proxied requests' tokens at their ends (reconcile.CountReconciler.resolve_spans, docs/daemon.md).
AT_FINISH = ("sglang",)
# Servers that prefill an n > 1 request's prompt in a request of their own before its n sequences, which all find it
# cached (SGLang's parallel sampling, tokenizer_manager._handle_batch_request): the ledger costs that prompt whole.
PREFILLS_CHOICES_APART = ("sglang",)
# Servers whose OpenAI routes take no `best_of` (SGLang's protocol has the field and ignores it, llama-server ignores
# it): their answers hide no sequences. vLLM V0 runs them, V1 none (Scraper.vllm_v1), and an unknown server may.
IGNORES_BEST_OF = ("sglang", "llamacpp")
# Servers that run a request on for nobody after its client left, until they abort it: (a stream's seconds after its
# client left, a whole answer's wait period from its start, at whose next end it is aborted). SGLang aborts a stream's
# request 2 s after its client left (tokenizer_manager's `create_abort_task`: `await asyncio.sleep(2)` before
# `abort_request`; 1 s in releases before 0.4) and a whole answer's at its state's next 4 s wait (`_wait_one_response`:
# `asyncio.wait_for(state.event.wait(), timeout=SGLANG_REQUEST_STATE_WAIT_TIMEOUT)`, 4, then `is_disconnected()`),
# counting it in sglang:num_aborted_requests_total, not in its token counters. vLLM aborts at once
# (rowtext.GONE_ABORT_SLACK_S covers its step in flight). Recent llama-server builds look at a request's connection
# only when its 1 s wait for a result times out, a wait every result sent to any request (a stream's token, a /metrics
# answer: the daemon's own scrapes) starts again (server-queue.cpp, `server_response::recv_with_timeout`;
# docs/simulator.md, "A client that leaves"); older ones (before the fix of ggml-org/llama.cpp#9273, the #24496
# regression) never look at a whole answer's; and a stream after each result of its own: a stream stops within a
# token (None: no run-on), a whole answer runs on to its end (None: until its max_tokens are decoded). The ledger
# keeps such a request in the split until then (`Ledger._run_on`): that work is its, not the requests' beside it.
RUNS_ON_AFTER_LEAVE: dict[str, tuple[float | None, float | None]] = {"sglang": (2.0, 4.0), "llamacpp": (None, None)}
START_TIME = "process_start_time_seconds"  # prometheus_client's process collector (vLLM's page; not SGLang's, llama.cpp's)
LLAMACPP_STEPS = "llamacpp:n_decode_total"  # llama-server's decode calls: every step, a restart's tell (_scrape_llamacpp)
SCRAPE_TIMEOUT_S = 2.0  # one GET, whole: a server slower than this to say its counters is skipped for a scrape
# More tokens a second than any one server's page counts (one H200 at high batch makes tens of thousands; a node of
# eight, a few hundred thousand): a counter back at or past its reading after the server was found down, higher than
# this times the seconds since the last believed page's GET began, cannot be a new process's count from zero, so it is
# the same process back (after a refused scrape, or a gateway's 503 before any rate was seen), its window whole
# (Scraper._down_back).
FASTEST_SERVER_TOKENS_PER_S = 1_000_000.0
# After a gateway's 502/503 (no scrape found the server down), a counter back at or past its reading is the same process,
# whole, only where a new process could not have reached it: beyond this many times the server's own highest token rate
# over a whole window (`Scraper._peak_tok_s`) times the seconds since the last believed page's GET began, and no count
# on the page below the last believed page's (BLIP_MARKS, per label set and bucket). Else said as after a down
# (`Scraper._blip_back`). A restart behind a gateway's readiness lag (3 s) passed the old reading and every finished
# count: whole, it hid 37% of the bypass tokens, J/token ~18% high, unflagged (docs/daemon.md, "A server restart").
BLIP_RATE_MARGIN = 4.0
# And the window's own rise (the counter less its reading before) at most this many times that highest rate times those
# seconds: the server's history still describes it. A new process faster than 4 times the old one's peak (a retry herd
# on a lightly loaded server) passed the reach bound: vLLM 600, three 503s, 3500 counted 2900 of 3500 unsaid. The slack
# covers a live server's pace over the outage above its whole windows' (a vLLM blip rose at 760 tokens/s, peak 869).
BLIP_RISE_MARGIN = 1.25
# The counts compared page to page after such a 502/503, each per label set (and bucket): the token counter, and what
# a server raises as a request finishes (SGLang's observe_one_finished_request; vLLM's request stats). Summed, a new
# process serving another mix passed (tenant A 10 -> 0, tenant B 0 -> 12).
BLIP_MARKS = {"sglang": ("sglang:generation_tokens_total", "sglang:prompt_tokens_total", "sglang:num_requests_total",
                         "sglang:e2e_request_latency_seconds"),
              "vllm": ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:request_success_total",
                       "vllm:e2e_request_latency_seconds")}


def slots_delta(prev: dict[int, tuple[object, int]], now: dict[int, tuple[object, int]]) -> int:
    """Tokens decoded between two /slots snapshots. A slot whose task changed restarted from 0;
    tokens of a task that started and ended between two scrapes are not seen (documented)."""
    d = 0
    for sid, (task, n) in now.items():
        old = prev.get(sid)
        if old is None or old[0] != task or n < old[1]:
            d += n
        else:
            d += n - old[1]
    return d


def slot_tasks(slots) -> dict[int, tuple[object, bool]]:
    """{slot id: (task id, busy)} from llama.cpp's /slots JSON; a slot that does not say whether it is busy is
    read as busy, as `slot_progress` reads it. A task id other than an int or a str is None: the ledger keeps
    (slot, task) pairs in sets, and an unhashable one (a list) ended the scrape loop with a TypeError."""
    out = {}
    for s in slots if isinstance(slots, list) else ():
        if isinstance(s, dict) and isinstance(s.get("id"), int):
            task = s.get("id_task", s.get("task_id"))
            task = task if isinstance(task, (int, str)) and not isinstance(task, bool) else None
            out[s["id"]] = (task, bool(s.get("is_processing", s.get("state", 1) != 0)))
    return out


def slot_ended(prev: dict[int, tuple[object, int]], now: dict[int, tuple[object, int]]) -> bool:
    """Whether a request may have ended on a slot between two /slots snapshots: any slot other than idle in both or the
    same task decoding on (a task changed, a count fell or reset to 0 at its end). A task started on an idle slot counts
    too (its slot's last one may have ended since): a needless look costs a GET, a missed one a whole answer's count."""
    for sid in prev.keys() | now.keys():
        old, new = prev.get(sid, (None, 0)), now.get(sid, (None, 0))
        if new != old and not (new[0] == old[0] and new[1] >= old[1]):
            return True
    return False


# A counter below its highest reading at two pages or more, above half of it, the server never found down: two dips in a
# row or a restart, not told apart (Scraper._dip_or_restart); counted from the highest reading, the windows marked. Also
# a young counter's dip back at its reading (_young_back) and a counter at or past it after the server was found down
# (_down_back): a restart whose new process reached the old reading may hide there.
COUNTER_BELOW = SERVER_COUNT_BELOW
# The windows after a restart told by the counter's fall alone (no scrape found the server down, no start time moved),
# until the counter passes the reading before the fall: that fall may have been a dip that lasted, whose recovery is
# then counted again, or a restart, whose new process's tokens are right (Scraper._fall_unconfirmed). Not a restart:
# the ledger reads server_restart as one (levels, owed tokens, a restart cut) and only the restart's own window says it.
FALL_UNCONFIRMED = "fall_unconfirmed"
# A multi-process page's dip lasts a scrape or two, not minutes: a fall still below the reading before it this long
# after AND after this many pages was a restart, and the windows after it are the new process's, unmarked again. Both:
# the seconds alone end it after 2 pages at a 5 s scrape interval, the pages alone after 2.5 s at 0.25 s (a 3-page dip
# at 5 s and an 11-page one at 0.25 s had their recovery counted again unmarked).
FALL_UNCONFIRMED_S = 10.0
FALL_UNCONFIRMED_PAGES = 10
# Why a scraped count may be low (keys of Scraper.partial; /metrics label `reason`).
PARTIAL_REASONS = {
    "late_baseline": "the server's counters were first read after the daemon said it was ready, and it had counted tokens "
                     "by then: tokens of requests sent since the daemon's ready and before that read are not in the count, "
                     "so bypass traffic before it is not in `unproxied` (its energy is with the proxied requests' or "
                     "idle) (fix: start the server before the daemon, or restart the daemon once the server is up)",
    SERVER_COUNT_SLOTS_ONLY: "llama-server without /metrics: /slots alone misses each request's tokens after the last scrape before "
                  "it ends, so bypass traffic's missed tokens are not in `unproxied` (their energy is with the proxied "
                  "requests' or idle) (fix: start llama-server with --metrics)",
    "server_restart": "the server restarted (its token counter went back, or its process start time moved): the old "
                      "process's tokens after the last scrape before it went down are not in the count, so bypass traffic "
                      "then is not in `unproxied` (its energy is with the proxied requests' or idle); the intervals across "
                      "the restart say so in server_count, where the count may be high as well (the new process's "
                      "first reads may owe the proxy's tokens in a way nothing tells from that loss) (fix: none "
                      "for the figures kept, they are left out of J/token; told by the fall alone, the windows after "
                      "it say fall_unconfirmed; a restart whose new counter "
                      "has passed the old reading by the first scrape after it, on a server without "
                      "process_start_time_seconds, cannot be told from traffic: said as counter_below where a scrape "
                      "(or the daemon's proxy, forwarding to the same address) found the server down, not said where "
                      "none did)",
    COUNTER_BELOW: "the server's token counter stayed below its highest reading at consecutive scrapes, above half of it "
                   f"(or that reading {YOUNG_COUNTER_TOKENS} tokens or fewer and the fall {YOUNG_DIP_TOKENS} or fewer), "
                   "or, that reading "
                   f"{YOUNG_COUNTER_TOKENS} tokens or fewer, fell by more than {YOUNG_DIP_TOKENS} and was back at it by "
                   "the next scrape, and no scrape found the server down, or the counter was at or past that reading "
                   "at the first page after a scrape found the server down, or answered 502/503 (a gateway's) and a "
                   "count on the page went back or the counter was within what a new process could have counted at "
                   f"{BLIP_RATE_MARGIN:g} times the server's highest rate or had risen faster than {BLIP_RISE_MARGIN:g} "
                   "times that rate since (no process start time on the page; not "
                   "where, after a 502/503, it and the finished-request histogram, or llama.cpp's decode calls, had not moved, nor where "
                   "it was higher than a new process could have counted since the page before the outage and, the "
                   f"server's rate known, had risen no faster than {BLIP_RISE_MARGIN:g} times it, unknown, than "
                   f"{FASTEST_SERVER_TOKENS_PER_S:g} tokens a second): dips "
                   "on consecutive pages of a multi-process /metrics (SGLang's, a vLLM with several API servers), where "
                   "the count is exact, a server back from a 503 with its counter whole, or a restart whose new process "
                   "had counted more than half the old one's tokens by its first page (or whose old one had counted "
                   "that few, or that had passed the old reading), whose tokens until its counter "
                   "passes the old reading are not in the count. Counted from the highest reading either way (no token "
                   "made up), so bypass traffic then may not be in `unproxied` (its energy is with the proxied requests' "
                   "or idle); those intervals say so in server_count (fix: none needed once the counter passes its "
                   "highest reading again; a page with process_start_time_seconds, vLLM with one API server, tells a "
                   "restart by it)",
    FALL_UNCONFIRMED: "after a restart told by the server's token counter's fall alone (no scrape found the server down, "
                      "no process start time moved), the windows until the counter is back at the reading before the "
                      f"fall, for at most {FALL_UNCONFIRMED_S:g} s and {FALL_UNCONFIRMED_PAGES} scrapes, whichever ends later, and after that "
                      "the window that passes that reading in a jump (over twice the largest rise since): if the fall was "
                      "a dip of a multi-process page that lasted, its recovery is counted again as bypass tokens (the "
                      "count may be high), if a restart, the new process's tokens are right; the count may be low or "
                      "high, so those intervals say so in server_count and are left out of J/token (fix: none for the "
                      "figures kept, they are left out of J/token; if it goes on, restart the daemon once the server "
                      "is up, and check whether the server restarts)",
}

STILL_S = 5.0  # the counter and the proxy this long without movement: scrape at the idle period


class Cadence:
    """When the next scrape is due: every `fast_s` while something moves (the caller's `busy`: proxied
    requests held by the ledger, tags; or the server's counter rose within STILL_S), every `idle_s`
    once all are still.

    An idle server's counter does not move, so the fast period there only costs CPU. A counter rise
    seen by a slow scrape, or a proxied request, switches back to `fast_s` at once; what that costs is
    the first idle window of a bypass burst that starts from stillness: it is up to `idle_s` long, not
    `fast_s` (the daemon places its tokens back with `burst_start_ns`; docs/daemon.md, Scrape cadence).
    `idle_s <= fast_s` keeps it fast."""

    def __init__(self, fast_s: float, idle_s: float, still_s: float | None = None):
        self.fast_s = fast_s  # both may be changed between calls (a live config reload)
        self.idle_s = idle_s
        self.still_s = STILL_S if still_s is None else still_s
        self._moved: float | None = None  # when something last moved (None: not yet: start fast)
        self._last: float | None = None  # when the last scrape ran

    def period_s(self, now: float) -> float:
        """The scrape period in force at `now`."""
        if self._moved is None or now - self._moved < self.still_s:
            return self.fast_s
        return max(self.fast_s, self.idle_s)

    def due(self, now: float, busy: bool) -> bool:
        """Whether to scrape at `now` (polled every `fast_s`); `busy`: proxied requests are live."""
        if busy:
            self._moved = now
        if self._last is None:
            return True
        # Half a fast period of slack: the poll that lands just short of a period still scrapes.
        since, period = now - self._last, self.period_s(now)
        if since >= period - self.fast_s / 2:
            return True
        # Still, the loop polls every poll_s (1 s), on the loop clock's grid, and the last fast scrape fell anywhere on
        # the fast one: waiting for the next poll would make this window longer than the period and its slack (2.75 s
        # of a 2 s idle period after a scrape at x.25 s). Scraped now, the window is shorter, and the next ones fall on
        # the poll's grid.
        return since + self.poll_s(now, busy) > period + self.fast_s / 2

    def poll_s(self, now: float, busy: bool) -> float:
        """How long the scrape loop sleeps at `now`: `fast_s` while that period is in force (or `busy`); once still,
        the longest multiple of it up to ticks.IDLE_PERIOD_S that divides the idle period, so a poll falls on each idle
        scrape's instant (0.25 s and 2 s: 1 s)."""
        if busy or self.period_s(now) <= self.fast_s:
            return self.fast_s
        n = max(1, round(self.idle_s / self.fast_s))
        k = max(j for j in range(1, int(IDLE_PERIOD_S / self.fast_s + 1e-9) + 1) if n % j == 0) \
            if self.fast_s <= IDLE_PERIOD_S else 1
        return k * self.fast_s

    def scraped(self, now: float, delta: float | None) -> None:
        """A scrape ran at `now` and the counter rose by `delta` (None: the scrape failed)."""
        self._last = now
        if self._moved is None or (delta is not None and delta > 0):
            self._moved = now


def burst_start_ns(since_ns: int, t_ns: int, delta: float, next_rate_per_ns: float) -> int:
    """Where the tokens of a slow window that ends a stillness began: a burst running at the rate the
    next (fast) window shows took delta / rate before `t_ns`; never before the window's start.
    Spread over the whole window instead, a burst's tokens (and the window's idle time with them)
    would count as busy from the window's start (docs/daemon.md, Scrape cadence)."""
    if delta <= 0 or next_rate_per_ns <= 0:
        return since_ns
    return max(since_ns, t_ns - int(delta / next_rate_per_ns))


def _server_down(e: BaseException) -> bool:
    """Whether a failed scrape may say the server is down (where a restart's window begins, `window_down_ns`): nothing
    listening on its port (a refused connection: servercount.connection_refused), or a gateway's or a loading server's
    502/503. A timeout (busy), a bad page, or a connection that failed otherwise (a host name that did not resolve, a
    connect that timed out) does not: that scrape could not read the server, and says so (last_error)."""
    return connection_refused(e) or (isinstance(e, MetricsStatus) and e.status in (502, 503))


def _found_down(e: BaseException) -> bool:
    """Whether a failed scrape proves the server down for the counter's logic (`Scraper._unreachable`): a refused
    connection or llama-server's own 503 "Loading model". Any other 502/503 (`_server_down` only) is a gateway's answer
    in front of it (`Scraper._blipped`): a failed scrape, the server behind it live or restarting, nothing told."""
    return connection_refused(e) or (isinstance(e, MetricsStatus) and e.loading)


class MetricsStatus(ValueError):
    """/metrics answered other than 200 (`url`: that page). `loading`: llama-server's own 503 "Loading model"
    (LLAMACPP_LOADING), a new process loading its model: the one 503 that opens a death's window at once
    (`Scraper.down_open`). Public, its name in plain words: it heads the scrape's last_error users read (status, log),
    where the private name read "_MetricsStatus: /metrics answered 503"."""

    def __init__(self, status: int, url: str, loading: bool = False, note: str = ""):
        super().__init__(f"GET {url} answered {status}" + (
            ' "Loading model": llama-server is loading its model (a restart, most likely); scrapes go on until it '
            "answers" if loading else note))
        self.status = status
        self.loading = loading


# The body llama-server answers every route with while it loads its model (tools/server/server.cpp, its port bound at
# once): {"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}. A 503 without it is a router's,
# a rate limit's or an auth proxy's blip in front of a live server.
LLAMACPP_LOADING = '"Loading model"'


def new_session(via: str | None = None) -> aiohttp.ClientSession:
    """The daemon's scrape session: idle connections are not reused after IDLE_REUSE_S, so a server's idle close (5 s)
    never crosses a scrape when `scrape.idle_interval_s` is near it (aiohttp's default keeps them 15 s). `via`: the
    daemon's proxy's Via name, so that a scrape whose URL reaches that proxy is answered 508 there, not recorded."""
    headers = {**auth_headers(), **({"Via": f"1.1 {via}"} if via else {})}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_REUSE_S), headers=headers)


class Scraper:
    """Polls one server. `await scrape()` → tokens generated since the previous call, or None."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, server: str = "auto"):
        if server not in SERVERS:
            raise ValueError(f"scrape.server must be one of {', '.join(SERVERS)}, not {server!r}")
        self.session = session
        self.base = base_url.rstrip("/")
        self.server = server
        self.kind: str | None = None if server == "auto" else server
        self._last_total: float | None = None
        self._slots: dict | None = None
        # llama.cpp's /slots at the previous scrape, read beside its counter: an end between tells (`slot_ended`)
        self._seen_slots: dict | None = None
        # Tokens this scrape's count may lack: llama.cpp answers that ended between its counter's read and /slots'
        # (`_scrape_llamacpp`); 0 elsewhere.
        self.window_read_missed = 0.0
        self._finished: float | None = None  # llama.cpp's counter at the previous scrape
        self._high: float | None = None  # the highest llama.cpp total reported so far
        self._steps: float | None = None  # llama.cpp's decode calls (LLAMACPP_STEPS) at the previous scrape
        self._latency: tuple[float, float] | None = None  # SGLang's e2e latency (_count, _sum) at the previous scrape
        # (requests finished, their summed end-to-end seconds) since the previous scrape: SGLang's e2e latency
        # histogram's rise (FINISHED_LATENCY); None where not known (another server, absent, unreadable, first read).
        self.finished: tuple[float, float] | None = None
        # Prompt tokens the server found in its prefix cache since the previous scrape (its hit counter's rise, or
        # vLLM v0's hit rate times its prompt tokens' rise: an estimate); None where not known (_cache_hits_since).
        self.cache_hits: float | None = None
        # (requests the server finished since its start, requests running and queued now, the tokens its finished requests
        # generated) as of the latest scrape's page (vLLM's vllm:request_success_total and vllm:num_requests_running +
        # _waiting: servercount.requests_and_in_flight; vllm:request_generation_tokens_sum); None where the page does not
        # show all three (llama.cpp, SGLang, an older vLLM) or the scrape failed. The reconciler's
        # proof that no bypass request ran over a quiet stretch (reconcile.CountReconciler._judge_usage_below).
        self.served: tuple[float, float, float] | None = None
        self._cache: tuple[str, float, float] | None = None  # prefix_cache_reading at the previous scrape
        self._blocks_said = False  # the log said once that the hits come in blocks of no known size
        # vLLM's page has V1's prefix-cache counters (tokens or blocks, not v0's hit-rate gauge): its engine is V1,
        # which runs no best_of sequences beyond n (0.7-0.11 refuse best_of, 0.12 on ignore it: the field removed).
        self.vllm_v1 = False
        self.total = 0.0  # tokens the server reported since the daemon started
        self.errors = 0
        self.last_error: str | None = None
        self.ready = False  # the daemon has said it is ready: a baseline read from now on is late
        self.partial: dict[str, str] = {}  # reason → what it means (PARTIAL_REASONS): the count may be low
        # Why the latest scrape's window (since the previous one) may be low: PARTIAL_REASONS keys, () when it is whole.
        # The ledger marks the intervals it covers (their `server_count`), never only the process-wide gauge.
        self.window_partial: tuple[str, ...] = ()
        # The latest scrape's count moves every decode step (llama-server's /slots progress read in it): a still count
        # then says nothing decoded (`Ledger.count_each_step`); its counter alone moves only as a request ends.
        self.window_each_step = False
        # The latest scrape's /slots as {slot id: (task id, busy)} (`slot_tasks`); None where it was not read. The
        # ledger ends a run-on with no known end when the slots busy after its leave have all moved on
        # (`Ledger.window_slots`).
        self.window_slots: dict[int, tuple[object, bool]] | None = None
        self.restarts = 0  # server restarts seen (a counter gone back, or a new process start time)
        # The latest scrape's window says server_restart told by the counter's fall alone: no scrape found the server
        # down, no start time moved (a multi-process page's dip may pass for one): the ledger ends no run-on there.
        self.restart_by_fall = False
        self._start_s: float | None = None  # the server's process_start_time_seconds at the previous scrape
        self.dips = 0  # pages whose counter went back with no other sign of a restart, not believed (_dip_or_restart)
        self.below = 0  # pages still below the highest reading after a dip, counted as 0 and marked (COUNTER_BELOW)
        self._dipped: float | None = None  # the dipped reading of the page before, not believed: the next one tells
        self._young_fall = False  # that dip was a young counter's, of more than YOUNG_DIP_TOKENS (_dip_or_restart)
        self._unreachable = False  # a scrape since the last believed page found the server down (_found_down)
        # One answered 502/503 not llama-server's "Loading model" (a router's, nginx's, a rate limit's): a failed scrape,
        # no down. A fall after it is a restart unless no count on the page went back (`_dip_or_restart`); a counter at
        # or past its reading after it is the same process, whole, only beyond what a new process could have counted
        # (`_blip_back`). Read as down, every such window was marked counter_below.
        self._blipped = False
        self._believed_page: str | None = None  # the last believed page, whose counts a page after a 502/503 is held to
        # The highest tokens a second the counter rose by over a whole window between believed pages (BLIP_RATE_MARGIN);
        # 0: none known yet.
        self._peak_tok_s = 0.0
        # llama.cpp's: its decode calls' highest rate a second over a whole window, beside its tokens' (_llama_blip_back).
        self._peak_steps_s = 0.0
        # When the first such scrape began (time.monotonic_ns()), and, on the believed page after it, the latest window's
        # (None: no scrape of the window found the server down): a process gone in a restart died before it, so the
        # ledger places its run-ons' end between the window's start and it (`Ledger._run_on_cut_ns`).
        self._down_at_ns: int | None = None
        self.window_down_ns: int | None = None
        # Whether that first scrape's connection was refused (nothing listening: a death), not a 502/503 a router or a
        # loading page answers: only the first proves a death (`Ledger._death_proven`).
        self._down_refused = False
        self.window_down_refused = False
        # Whether the page after it was back past a new process's reach (`_down_back`, not llama.cpp's): the same
        # process back, or a restarted one whose counter persisted, nothing tells which; the ledger then cuts no run-on
        # at that death and says both readings (`Ledger._run_on_cut_ns`).
        self._past_reach = False
        self.window_past_reach = False
        # When the first scrape since the last believed page whose connection was refused began (None: none was): a
        # death seen before the new process answers (`down_open`).
        self._refused_at_ns: int | None = None
        # And the first that llama-server answered 503 "Loading model" (`MetricsStatus.loading`): a new process, none
        # refused. Any other 502/503 opens no window: a router's blip, no restart after, then cost a request it held
        # and closed unanswered (never run) 119 J, and the live request beside it 1099 J for 1177 of truth.
        self._loading_at_ns: int | None = None
        self._believed_at: float | None = None  # time.monotonic() as the last believed page's scrape began
        # The times the daemon's proxy's connects to this same server were refused since the last call
        # (`Proxy.take_refusals`; None: no proxy, or it forwards elsewhere): proof of a death as this scraper's own
        # refused scrape is (`_proxy_refused`).
        self.refusals: Callable[[], list[int]] | None = None
        # Proxy workers ship theirs in a flush after them (workers.FLUSH_S): waited for until their records have all
        # come up to the scrape's start (`ProxyWorkers.wait_refusals`; None: the proxy is this process's, its refusals
        # here at once), after the page, up to `refusals_late_s` past that start (`_take_refusals`).
        self.refusals_wait: Callable[[int, float], Awaitable[None]] | None = None
        self.refusals_late_s = 0.0
        self._refusals_taken = False  # this scrape's are taken (once a scrape)
        self._refusals_later: list[int] = []  # taken, but from this scrape's start on: the next window's
        self._scrape_at = 0.0  # and as this scrape began
        # The span (monotonic_ns) of the GET(s) that read this scrape's counter (/metrics; llama.cpp's /metrics and
        # /slots), None until they came: the window's stamp and `read_ns` (Daemon._scrape_loop). Not the scrape's own:
        # it holds the wait for the proxy workers' refusals after them (`_take_refusals`, up to 40 ms), and a window
        # stamped in it ended up to that late, its proxied tokens read as more than the server counted (over-flagged).
        self.read_ns: tuple[int, int] | None = None
        # The highest reading before a restart judged from a fall alone (no scrape found the server down, no start time
        # moved): until a window starts at or above it, the fall may have been a dip (one process's share of a
        # multi-process page lagging for more than a page), whose recovery the windows after it count again as new
        # tokens; they say fall_unconfirmed (may be low or high), never a silently high count (_fall_unconfirmed).
        self._fall_high: float | None = None
        self._fall_at = 0.0  # when that fall was read (time.monotonic()), and the windows marked since (the bound)
        self._fall_pages = 0
        # That reading once the bound has ended (`_fall_high` then taken for a restart), and the largest rise of a window
        # since: a dip that lasted longer still comes back in one jump, which `_past_fall` marks (`None`: none kept).
        self._fall_past: float | None = None
        self._past_rise = 0.0

    def _baseline(self, counted: float) -> None:
        """The first reading: `counted` tokens the server says it has generated. Read after the daemon's ready, a
        server that had counted nothing has lost nothing; one that had may have counted tokens of requests sent
        since the ready, which the baseline takes in for good."""
        if self.ready and counted > 0:
            self.window_partial = (*self.window_partial, "late_baseline")
            if "late_baseline" not in self.partial:
                self.partial["late_baseline"] = PARTIAL_REASONS["late_baseline"]
                log.warning("scraped server count may be low: %s", PARTIAL_REASONS["late_baseline"])

    def _restarted(self, why: str) -> None:
        """The server restarted between the previous scrape and this one: its window lost the old process's tail."""
        self.restarts += 1
        self.window_partial = (*self.window_partial, "server_restart")
        if "server_restart" not in self.partial:
            self.partial["server_restart"] = PARTIAL_REASONS["server_restart"]
        if self.restarts <= 3 or self.restarts % 100 == 0:
            log.warning("the server at %s restarted (%s; %d so far): scraped server count may be low or high: %s",
                        self.base, why, self.restarts, PARTIAL_REASONS["server_restart"])

    def _new_process(self, text: str) -> str | None:
        """Why this /metrics page is of another process than the previous scrape's, from its start time (vLLM's
        prometheus_client gives process_start_time_seconds; SGLang's multiprocess collector and llama.cpp do not):
        None where it is the same, or nothing says."""
        try:
            now = counter_total(text, START_TIME) if START_TIME in text else None
        except ValueError:
            now = None
        prev, self._start_s = self._start_s, now
        if prev is not None and now is not None and abs(now - prev) > 1e-3:
            return f"its process start time moved {now - prev:.1f} s (process_start_time_seconds)"
        return None

    def _dip_or_restart(self, prev: float, total: float, text: str = "") -> str | None:
        """The counter went back from `prev` (the highest believed reading) to `total` on a page that has no start time:
        why it is a restart, or None for a dip not believed (this scrape is skipped, or counted as 0 and marked: below).

        A multi-process page (prometheus_client's multiprocess collector sums each worker's file as it reads it) can
        show less than the page before for one read, the process the same: taken for a restart, the whole counter was
        counted as one window's tokens and that window marked server_restart (docs/daemon.md, A counter that dips). A
        restart is told by what a dip does not do: the counter fell to half or less (a new process counts from 0; not
        while the highest reading is YOUNG_COUNTER_TOKENS or fewer, which a dip of a request's tokens takes there), a
        scrape since the last believed page found the server down (`_found_down`), or answered 502/503 and a count on
        the page `text` went back or none is there to compare (`_went_back`; told so, the windows after say
        fall_unconfirmed as after a restart by the fall alone,
        `_fall_high`; none went back: a dip, held as any), or a young
        counter's fall of more than YOUNG_DIP_TOKENS still below `prev` at the next page (a dip is back by then: the
        new process's count, counted from 0). A fall still there at the next page, none of those, may be either: that
        page's window counts nothing and is marked (COUNTER_BELOW, `_below`), and tokens count again from `prev` once
        the counter passes it; a young one of more than YOUNG_DIP_TOKENS back at the next page is counted from `prev`
        and its window marked too (`_young_back`)."""
        if counter_restarted(prev, total):
            return f"{COUNTERS[self.kind]} went back from {prev:g} to {total:g}"
        if self._unreachable:
            return (f"{COUNTERS[self.kind]} went back from {prev:g} to {total:g} after a scrape found the server down")
        if self._blipped and (went := self._went_back(text, tokens=False)) is not None:
            # A gateway's 502/503 is no proof of a death, but a fall behind it with a finished count gone back is how a
            # restart behind a router reads: a restart at once, told by the fall (a multi-process page's lag reads so
            # too), so the windows after it say fall_unconfirmed. With every count at or past the last believed page's
            # it is a dip: taken for a proven restart, 100000, 503, 99990, 100050 counted 99990 phantom tokens, and
            # the dip's 10 again unsaid in the window after.
            return (f"{COUNTERS[self.kind]} went back from {prev:g} to {total:g} after a scrape answered 502/503 (a "
                    f"gateway in front of the server, which may have restarted behind it), and {went}")
        if self._dipped is not None and self._young_fall:
            # A young counter's fall of more than a few tokens, still below the reading before it at the next page:
            # a dip adds nothing, so its next page reads at least that reading (plus any tokens since); below it, the
            # new process's counter: counted from 0 (20 → 10 → 5 is 5 tokens of a new process, not none).
            return (f"{COUNTERS[self.kind]} went back from {prev:g} to {self._dipped:g} and was still below {prev:g} at "
                    f"the next scrape ({total:g}), where a dip is back")
        if self._dipped is not None:
            # Still below at the next page: a restart or a second dip, which nothing here tells apart. Taken for a
            # restart, two dips in a row (100000, 99990, 99995) counted 99995 tokens that never ran in one window,
            # marked server_restart ("may be low"). Counted from the highest reading instead, and the window marked.
            self._below(prev, total)
            return None
        self._dipped = total
        # Held like any dip, never a restart at once (a dip of one request's tokens takes a young counter to half or
        # less: 20, 10, 20, 40 counted 10 tokens twice as bypass); larger than a few tokens, its next page tells
        # (above, and `_young_back`).
        self._young_fall = prev <= YOUNG_COUNTER_TOKENS and prev - total > YOUNG_DIP_TOKENS
        self.dips += 1
        if self.dips <= 3 or self.dips % 100 == 0:
            log.info("%s at %s went back from %g to %g with no other sign of a restart (%d so far): a multi-process "
                     "page read while a worker's share lagged; not believed, and told from a restart by the next "
                     "scrape", COUNTERS[self.kind], self.base, prev, total, self.dips)
        return None

    def _fall_unconfirmed(self, start: float | None) -> None:
        """A window after a restart judged from a fall alone (`_fall_high`), starting at `start`: below the reading
        before the fall, it is marked FALL_UNCONFIRMED. That fall may have been a dip of one process's share of a
        multi-process page that lasted past the next page, or fell to half or less (a request's tokens on a counter of
        a few hundred): its recovery is then counted again as new tokens (200, 400, 200, 400, 440: 640 counted where
        240 ran, the fourth window's 200 unmarked and booked as bypass in a `complete` row); a restart's is right.
        Nothing here tells which, so the count is kept and said may be low or high. The first window starting at or
        above that reading holds no recovery: whole again.

        They say FALL_UNCONFIRMED, not server_restart: the ledger reads server_restart as a restart in that window
        (levels restart, owed tokens replaced, the tokens moved to the restart's cut), which distorted every later
        window's figures (bypass 922 where 69 ran, a request's energy -47%). Bounded: a dip lasts a scrape or two, so a
        fall still below after FALL_UNCONFIRMED_S and FALL_UNCONFIRMED_PAGES was a restart, whole from then on (an
        idle or slow new process never passes the old reading)."""
        if start is not None and start >= self._fall_high:
            self._fall_high = None
            return
        self._fall_pages += 1
        if (self._fall_pages > FALL_UNCONFIRMED_PAGES
                and time.monotonic() - self._fall_at > FALL_UNCONFIRMED_S):
            log.warning("%s at %s still below %g, the reading before its fall, %d scrapes and %.0f s after it: a "
                        "restart, not a dip that lasted; the windows from now on are the new process's, counted whole "
                        "(the %d before said %s)", COUNTERS[self.kind], self.base, self._fall_high,
                        self._fall_pages - 1, time.monotonic() - self._fall_at, self._fall_pages - 1,
                        FALL_UNCONFIRMED)
            self._fall_past, self._past_rise = self._fall_high, 0.0
            self._fall_high = None
            return
        if FALL_UNCONFIRMED not in self.window_partial:
            self.window_partial = (*self.window_partial, FALL_UNCONFIRMED)
        if FALL_UNCONFIRMED not in self.partial:
            self.partial[FALL_UNCONFIRMED] = PARTIAL_REASONS[FALL_UNCONFIRMED]
            log.warning("scraped server count may be low or high: %s", PARTIAL_REASONS[FALL_UNCONFIRMED])

    def _past_fall(self, prev: float, total: float) -> None:
        """A window after the bound of `_fall_unconfirmed` ended, the counter still below the reading before the fall
        (`_fall_past`): one that passes it in a jump (a rise over twice the largest since the bound ended, and over
        YOUNG_DIP_TOKENS) may be a dip that lasted longer coming back, counted again (200, 400, 200 for 75 s, 400: 200
        phantom tokens in an unmarked window, booked as bypass in a `complete` row): marked FALL_UNCONFIRMED, the count
        kept. A restarted process passing the old reading at its own pace is not a jump, and stays whole."""
        rise, high = total - prev, self._fall_past
        if total < high:
            self._past_rise = max(self._past_rise, rise)
            return
        self._fall_past = None
        if rise > max(2 * self._past_rise, YOUNG_DIP_TOKENS):
            self.window_partial = (*self.window_partial, FALL_UNCONFIRMED)
            if FALL_UNCONFIRMED not in self.partial:
                self.partial[FALL_UNCONFIRMED] = PARTIAL_REASONS[FALL_UNCONFIRMED]
            log.warning("%s at %s jumped from %g to %g, past %g, the reading before a fall taken for a restart: a dip "
                        "that lasted may be back, its tokens counted again; this window says %s",
                        COUNTERS[self.kind], self.base, prev, total, high, FALL_UNCONFIRMED)

    def _young_back(self, prev: float, dipped: float, total: float) -> None:
        """A young counter fell from `prev` to `dipped` by more than a few tokens and is back at `total` (at least
        `prev`): a dip of a request's share, counted exact from `prev`, or a restart whose new process counted `total`
        by now, of which only `total - prev` is counted. A dip's next reading is at least `prev` plus the proxy's
        tokens since and a restart's need not be, but the proxy's tokens are not known here: the window is said
        (COUNTER_BELOW), not believed whole. Read as a restart at once instead, a real dip's tokens were counted
        twice as bypass (64 → 0 → 64: 64 tokens that never ran, the window after it marked nothing)."""
        self._said_below(f"went back from {prev:g} to {dipped:g} and is at {total:g} again: a dip, or a restart whose "
                         "new process passed the old reading")

    def _down_back(self, prev: float, total: float) -> None:
        """A scrape since the last believed page found the server down, and this page's counter is at `total`, at or
        past that page's `prev`, with no start time to say whether the process is the same: a server back from a
        gateway's or a loading server's 503 with its counter whole, or a restart whose new process reached the old
        reading by its first page (a young counter, a fast server), of whose `total` only `total - prev` is counted.
        Counted so (no token made up) and said (COUNTER_BELOW), as `_young_back`. Before, a restart of 40 tokens back at
        50 counted 10 in a window that said nothing; one back at exactly its reading (34: warm-up 2 and one 32-token
        request, in the old process and the new alike) counted none of the new one's 32. Not said where `total` is more
        than a new process could have counted from 0 since the last believed page's scrape began (at
        FASTEST_SERVER_TOKENS_PER_S): the same process, a long-running server behind a gateway's 503 blip, whole. A
        refusal in its window is kept (`window_down_refused`): a restarted process whose counter starts past the old
        reading (a never-wiped PROMETHEUS_MULTIPROC_DIR) reads so too; cleared, its death was lost (a whole answer's
        run-on costed 159.6 tokens and 410 J for about 105 J, unflagged). `Ledger._batch_death` cuts no batch span at
        such a death (the same process may be back), nor a run-on: its window says so (`window_past_reach`), and the
        ledger gives the run-on's row both readings, flagged (cut there, a whole SGLang answer's run-on read 40.6 tokens
        and 54 J for 159.6 and 271 where the same process lived on, unflagged). Not on llama.cpp: its counters live in
        the process and cannot outlast a restart, so the page past reach is the same process and the refusal is cleared
        (no death: kept, a whole answer's run-on was cut at it, 40.8 tokens and 103 J for 400 and 1001, unflagged).
        Where the server's pace is known (`_peak_tok_s`), past reach only with a rise that pace allows (`_beyond_reach`,
        as `_blip_back`): else another process on that port (another deployment's persisted counter), said. Unchecked,
        50,000,000 then a refusal then 80,000,000 two seconds on (pace 10,000 a second) counted 30,000,000 tokens in a
        window that said nothing, where a gateway's 503 said it."""
        since_s = None if self._believed_at is None else time.monotonic() - self._believed_at
        if since_s is not None and total > FASTEST_SERVER_TOKENS_PER_S * since_s:
            if self.kind == "llamacpp":
                self._down_refused = False
                return
            # With no pace known (right after the first page; a server idle since the start), the rise no server makes:
            # unbounded, 50,000,000 then a refusal (or a 503) then 80,000,000 two seconds on was read whole, the window
            # complete with 30,000,000 tokens no one process counted.
            paced = (self._beyond_fastest(COUNTERS[self.kind], prev, total, since_s) if self._peak_tok_s <= 0 else
                     self._beyond_reach(COUNTERS[self.kind], prev, total, self._peak_tok_s, since_s))
            if paced is None:
                self._past_reach = True
                return
            self._said_below(f"is at {total:g} after a scrape found the server down, at or past {prev:g}, its reading "
                             f"before, but {paced}: another process on its port, or the same one back")
            return
        self._said_below(f"is at {total:g} after a scrape found the server down, at or past {prev:g}, its reading "
                         "before: the same process back, or a restart whose new process reached the old reading")

    def _went_back(self, text: str, tokens: bool) -> str | None:
        """Which count on this page reads below the last believed page's (BLIP_MARKS, each per label set and bucket,
        the token counter's only with `tokens`; one absent now reads 0): a new process counts each from 0, where one
        process's only rise. None where none did; a reason too where the pages cannot be read or the page before has
        none of them (nothing to tell by)."""
        if self._believed_page is None:
            return "no page before it to compare"
        try:
            names = [n for n in BLIP_MARKS.get(self.kind or "", ()) if tokens or n != COUNTERS.get(self.kind or "")]
            before, now = series_values(self._believed_page, names), series_values(text, names)
        except ValueError as e:
            return f"its counts could not be read ({e})"
        if not before:
            return "no count on the page before it to compare"
        for key, was in before.items():
            if not now.get(key, 0.0) >= was:  # NaN on either page: not comparable, read as gone back
                return f"{key[0]}{dict(key[1])} went back from {was:g} to {now.get(key, 0.0):g}"
        return None

    @staticmethod
    def _beyond_fastest(name: str, prev: float, total: float, since_s: float) -> str | None:
        """None where a count `name` risen from `prev` to `total` over `since_s` is within what any one server counts
        (FASTEST_SERVER_TOKENS_PER_S): the bound where the server's own pace is not known yet. Else why not."""
        rise = FASTEST_SERVER_TOKENS_PER_S * since_s
        if total - prev <= rise:
            return None
        return (f"{name} risen {total - prev:g}, over the {rise:.0f} any one server counts since "
                f"({FASTEST_SERVER_TOKENS_PER_S:g} a second, its pace not known yet, x {since_s:.2f} s)")

    @staticmethod
    def _beyond_reach(name: str, prev: float, total: float, peak_s: float, since_s: float) -> str | None:
        """None where a count `name` at `total` after a gateway's 502/503, `prev` before it, is the same process's by
        the server's own pace (`peak_s` a second at its highest over a whole window, `since_s` since the last believed
        page's GET began): beyond what a new process could have counted from 0 at BLIP_RATE_MARGIN times that pace, and
        risen by at most BLIP_RISE_MARGIN times it. Else why not. Still missed (docs/daemon.md, "A server restart"): a
        new process whose count lands past the reach and within the rise of the old reading."""
        reach, rise = BLIP_RATE_MARGIN * peak_s * since_s, BLIP_RISE_MARGIN * peak_s * since_s
        if total <= reach:
            return (f"{name} within the {reach:.0f} a new process could have counted since ({BLIP_RATE_MARGIN:g} x "
                    f"{peak_s:.0f} a second, its highest, x {since_s:.2f} s)")
        if total - prev > rise:
            return (f"{name} risen {total - prev:g}, over the {rise:.0f} the server's pace allows since "
                    f"({BLIP_RISE_MARGIN:g} x {peak_s:.0f} a second, its highest, x {since_s:.2f} s): its history no "
                    "longer describes it")
        return None

    def _blip_back(self, prev: float, total: float, text: str) -> None:
        """After a gateway's 502/503 (no scrape found the server down), the counter at `total`, at or past its reading
        `prev`: the same process back, whole, only where no count on the page went below the last believed page's
        (`_went_back`) and the server's own pace (`_peak_tok_s`) says so (`_beyond_reach`: `total` beyond a new
        process's reach, its rise within the pace). Else said (COUNTER_BELOW), the count kept: SGLang raises its token
        counter and finished counts in one call, so a new process with the same mix passes both together, and only the
        time bounds tell it. With no rate known, judged as after a down (`_down_back`)."""
        if self._peak_tok_s <= 0 or self._believed_at is None:
            self._down_back(prev, total)
            return
        since_s = time.monotonic() - self._believed_at
        went = self._went_back(text, tokens=True)
        paced = None if went is not None else self._beyond_reach(COUNTERS[self.kind], prev, total, self._peak_tok_s,
                                                                 since_s)
        if went is None and paced is None:
            return
        self._said_below(f"is at {total:g} after a scrape answered 502/503, at or past {prev:g}, its reading before, "
                         + (f"but {went}" if went is not None else paced)
                         + ": a restart behind a gateway whose new process reached the old reading, or the same "
                         "process back")

    def _same_finished(self, text: str) -> bool:
        """Whether this page's finished-request histogram (FINISHED_LATENCY: count and summed seconds) reads as the last
        believed page's did: the same process, idle since (a restart's new process has its own requests' seconds). False
        where either is not known."""
        name = FINISHED_LATENCY.get(self.kind or "")
        if name is None or self._latency is None:
            return False
        try:
            return histogram_sum_count(text, name) == self._latency
        except ValueError:
            return False

    def _below(self, prev: float, total: float) -> None:
        """This page's counter is still below the highest reading `prev` (COUNTER_BELOW): its window closes with no
        tokens counted (counted again once the counter passes `prev`) and says why its count may be low."""
        self._said_below(f"still below its highest reading {prev:g} at the next scrape ({total:g})")

    def _said_below(self, what: str) -> None:
        """This scrape's window says COUNTER_BELOW (its count may be low); the log says `what` the counter did (the first
        three, then every hundredth)."""
        self.window_partial = (*self.window_partial, COUNTER_BELOW)
        if COUNTER_BELOW not in self.partial:
            self.partial[COUNTER_BELOW] = PARTIAL_REASONS[COUNTER_BELOW]
        self.below += 1
        if self.below <= 3 or self.below % 100 == 0:
            log.warning("%s at %s %s (%d so far): scraped server count may be low: %s",
                        COUNTERS.get(self.kind or "", LLAMACPP_COUNTER), self.base, what, self.below,
                        PARTIAL_REASONS[COUNTER_BELOW])

    def has_baseline(self) -> bool:
        return self._last_total is not None or self._high is not None or self._slots is not None

    async def _get(self, path: str) -> tuple[int, str]:
        url = self.base + path
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as r:
                if r.status == 401:
                    # llama-server started with --api-key guards /metrics and /slots too: "start it with --metrics"
                    # was said of a server started with it.
                    raise ValueError(
                        f"GET {url} answered 401 Unauthorized: the server was started with an API key (--api-key) and "
                        + ("refuses the one in $" + API_KEY_ENV if api_key_given() else "none was given")
                        + f"; set {API_KEY_ENV} in the daemon's environment (systemd: `systemctl edit powerprof`, "
                        "Environment= or EnvironmentFile=); until then bypass traffic is not counted")
                if r.status in (502, 503):  # its body tells a loading llama-server's from a gateway's (LLAMACPP_LOADING)
                    return r.status, (await read_capped(r, 4096)).decode("utf-8", "replace")
                if r.status != 200:
                    return r.status, ""
                return r.status, (await read_capped(r, MAX_METRICS_BYTES)).decode("utf-8", "replace")
        except TimeoutError as e:
            # aiohttp's total timeout has no message: the log said `TimeoutError: ` and nothing else.
            raise TimeoutError(
                f"GET {url} gave no whole answer within {SCRAPE_TIMEOUT_S:g} s: the server is busy or hung. This "
                "scrape is skipped and retried (a counter catches up at the next); the proxy's own figures are unaffected"
            ) from e

    async def _detect(self) -> str | None:
        try:
            status, text = await self._get("/metrics")
            if status == 200:
                for kind, name in (*COUNTERS.items(), ("llamacpp", LLAMACPP_COUNTER)):
                    if name.split(":")[0] + ":" in text:
                        return kind
            metrics_ok = status == 200
            status, text = await self._get("/slots")
            if status == 200 and text.lstrip().startswith("["):
                # llama-server's list of slots; not decoded here: a page too big to read (slots_json) still says what
                # the server is, and its scrapes then fail with the reason rather than leave the server undetected.
                return "llamacpp"
            if metrics_ok:  # an idle SGLang's /metrics may hold none of its families yet: ask what it is
                status, text = await self._get("/v1/models")
                models = json.loads(text) if status == 200 else None
                data = models.get("data") if isinstance(models, dict) else None
                if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("owned_by") == "sglang":
                    return "sglang"
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
            self.last_error = error_text(e)  # why it is not known yet: the start's warning says it
            return None
        return None

    async def scrape(self) -> float | None:
        if self.server == "none":
            return None
        self.window_partial = ()
        self.window_each_step = False
        self.window_slots = None
        self.window_read_missed = 0.0
        self.restart_by_fall = False
        self.window_down_ns, self.window_down_refused, self.window_past_reach = None, False, False
        self.cache_hits = None
        self.served = None
        self._scrape_at = time.monotonic()
        scrape_at_ns = int(self._scrape_at * 1e9)  # the daemon's monotonic_ns clock, as its windows' stamps
        self._refusals_taken = False
        self.read_ns = None
        try:
            if self.kind is None:
                self.kind = await self._detect()
                if self.kind is None:
                    await self._take_refusals(scrape_at_ns, wait=False)
                    return None
                log.info("scraping %s token counters at %s", self.kind, self.base)
            if self.kind == "llamacpp":
                delta = await self._scrape_llamacpp()
                self._unreachable = self._blipped = False  # a believed page: the next fall is judged afresh
                self._believed_at = self._scrape_at
                self.window_down_ns, self._down_at_ns = self._down_at_ns, None
                self.window_down_refused, self._down_refused = self._down_refused, False
                self._refused_at_ns = self._loading_at_ns = None
            else:
                read_at_ns = int(time.monotonic() * 1e9)
                status, text = await self._get("/metrics")
                self.read_ns = (read_at_ns, int(time.monotonic() * 1e9))
                await self._take_refusals(scrape_at_ns)
                if status != 200:
                    raise MetricsStatus(status, self.base + "/metrics")
                total = counter_total(text, COUNTERS[self.kind])
                if total is None and unset_means_zero(text, self.kind):
                    total = 0.0  # not yet set: no request has finished (module docstring)
                if total is None:
                    raise ValueError(f"{COUNTERS[self.kind]} missing from /metrics" + (
                        " (the page is not SGLang's own with nothing finished yet: a gateway's, or another name for "
                        "the counter; its tokens cannot be counted)" if self.kind == "sglang" else ""))
                had_start = self._start_s is not None
                new_process = self._new_process(text)
                prev = self._last_total
                same_start = had_start and self._start_s is not None
                by_fall = False  # a restart judged from the fall alone (below)
                if prev is not None and total < prev and new_process is None and not same_start:
                    # No start time to tell (SGLang's page, a vLLM with several API servers): a dip or a restart.
                    unreachable = self._unreachable  # a fall after it: not by the fall alone (a 502/503: by the fall)
                    new_process = self._dip_or_restart(prev, total, text)
                    by_fall = new_process is not None and not unreachable
                    if new_process is None and COUNTER_BELOW in self.window_partial:
                        # Its window closes, with nothing counted and marked; the latency and cache-hit counters of a
                        # page that may be a dip are not taken as the base either, and the base before it is let go:
                        # kept, the first window after the run said the closed windows' hits and finished requests as
                        # its own, unmarked (the next believed page sets a base and says none: unknown, not theirs).
                        self.finished = None
                        self._latency = self._cache = None
                        return 0.0
                    if new_process is None:
                        self.finished = None
                        return None  # the dip's window goes on to the next page (never 0 tokens, never a restart)
                if prev is not None and total < prev and new_process is None and same_start:
                    # Back on the same process (its start time unchanged): the page is wrong, not the server restarted.
                    # Taken for a restart, the whole counter was counted as this window's tokens (bypass traffic that
                    # never ran). The highest reading stays the base: tokens count again once the counter passes it.
                    self.finished = None
                    raise ValueError(f"{COUNTERS[self.kind]} went back from {prev:g} to {total:g} on the same process "
                                     f"({START_TIME} unchanged): this scrape is not believed, and tokens are counted "
                                     f"again from {prev:g}")
                if self._young_fall and self._dipped is not None and prev is not None and total >= prev:
                    self._young_back(prev, self._dipped, total)
                elif ((self._unreachable or self._blipped) and prev is not None and total >= prev and new_process is None
                      and not same_start and not (self._blipped and not self._unreachable and total == prev
                                                  and self._same_finished(text))):
                    # Nothing moved is the same process idle only behind a gateway's 502/503: found down (nothing
                    # listening, or loading), a new process of the old one's counts (its warm-up's 2, nothing finished
                    # yet) read so, the old one's tokens since the last page lost unseen (the simulator's restart
                    # between 2 s scrapes: 2687 of 3072 bypass tokens, every row complete). An idle server restarted is
                    # said too: an over-flag of a window with nothing to count.
                    if self._unreachable:
                        self._down_back(prev, total)
                    else:
                        self._blip_back(prev, total, text)
                was_believed_at, was_out = self._believed_at, self._unreachable or self._blipped
                self._last_total, self._dipped, self._unreachable, self._blipped = total, None, False, False
                self._believed_page = text
                self._young_fall = False
                self._believed_at = self._scrape_at
                self.window_down_ns, self._down_at_ns = self._down_at_ns, None
                self.window_down_refused, self._down_refused = self._down_refused, False
                self.window_past_reach, self._past_reach = self._past_reach, False
                self._refused_at_ns = self._loading_at_ns = None
                if prev is None:
                    self._baseline(total)
                # A restart of the server zeroes its counter: count from zero again. A new process whose counter has
                # passed the old reading already is told by its start time where the page has one (vLLM), else not.
                restart = prev is not None and (total < prev or new_process is not None)
                if restart:
                    self._restarted(new_process or f"{COUNTERS[self.kind]} went back from {prev:g} to {total:g}")
                    # Told by the fall alone, it may have been a dip that lasted: the windows until the counter is back
                    # at the reading before it are marked fall_unconfirmed (FALL_UNCONFIRMED_S / _PAGES at most). Told
                    # by real evidence, the new process counts whole.
                    # A second fall while the first is unconfirmed keeps the higher reading: windows below it may
                    # hold the first dip's recovery (200, 400, 200, 300, 150: the 300 → 400 window went unmarked).
                    self._fall_high = (max(prev, self._fall_high or 0.0, self._fall_past or 0.0) if by_fall else None)
                    # After a gateway's 502/503 the windows after say fall_unconfirmed, but the ledger is told of a
                    # restart whose window a scrape found down (window_down_ns), as before: it cuts a run-on there only
                    # with a death's proof (`Ledger._death_proven`; docs/daemon.md, a lone 502/503 then a dip).
                    self.restart_by_fall = by_fall and not was_out
                    self._fall_at, self._fall_pages, self._fall_past = time.monotonic(), 0, None
                elif self._fall_high is not None:
                    self._fall_unconfirmed(prev)
                elif self._fall_past is not None and prev is not None:
                    self._past_fall(prev, total)
                delta = 0.0 if prev is None else (total if restart else total - prev)
                if not restart and not was_out and not self.window_partial and was_believed_at is not None and delta > 0:
                    # A whole window of one process: its rate (a window across a failed scrape or a restart is not).
                    self._peak_tok_s = max(self._peak_tok_s, delta / max(self._scrape_at - was_believed_at, 0.05))
                self.finished = self._finished_since(text, prev is None or restart)
                self.cache_hits = self._cache_hits_since(text, prev is None or restart)
                done, _, in_flight, _ = requests_and_in_flight(text)
                # With the tokens of the requests it finished (vllm:request_generation_tokens_sum): tokens the counter
                # counted beyond them were generated by a request it never finished (an aborted one: bypass, maybe).
                gen = histogram_sum_count(text, "vllm:request_generation_tokens")
                self.served = ((done, in_flight, gen[1]) if done is not None and in_flight is not None and gen is not None
                               else None)
        except Exception as e:  # a server's answer never ends the scrape loop: counted and logged
            await self._take_refusals(scrape_at_ns, wait=False)  # a GET that failed: its window goes on, none judged
            down = _server_down(e)
            self._unreachable |= _found_down(e)
            self._blipped |= down and not _found_down(e)
            if down and self._down_at_ns is None:
                self._down_at_ns, self._down_refused = scrape_at_ns, connection_refused(e)
            if self._refused_at_ns is None and connection_refused(e):
                self._refused_at_ns = scrape_at_ns
            if self._loading_at_ns is None and isinstance(e, MetricsStatus) and e.loading:
                self._loading_at_ns = scrape_at_ns
            self.errors += 1
            self.last_error = error_text(e)
            if self.errors <= 3 or self.errors % 100 == 0:
                log.warning("scraping %s failed (%d so far): %s", self.base, self.errors, self.last_error)
            return None
        self.total += delta
        return float(delta)

    async def _take_refusals(self, scrape_at_ns: int, wait: bool = True) -> None:
        """The proxy's refusals since the last take, judged against this scrape's window (`_proxy_refused`): once a
        scrape, after its page came and before it is judged. Proxy workers ship theirs in a flush up to FLUSH_S after
        them: `wait`ed for until every worker's records have come up to the scrape's start (`refusals_wait`), at most
        `refusals_late_s` past it. Taken as the scrape began, one within a flush of it came to the next scrape, older than
        its window: dropped, and a restart whose new process answered the page passed unsaid (100, 150, a restart, 400
        read 250 whole). Those from the scrape's start on are the next window's, as one during its GET ever was."""
        if self._refusals_taken or self.refusals is None:
            return
        self._refusals_taken = True
        if wait and self.refusals_wait is not None:
            left_s = scrape_at_ns / 1e9 + self.refusals_late_s - time.monotonic()
            if left_s > 0:
                await self.refusals_wait(scrape_at_ns, left_s)
        times = self._refusals_later + self.refusals()
        self._refusals_later = [t for t in times if t >= scrape_at_ns]
        self._proxy_refused([t for t in times if t < scrape_at_ns], scrape_at_ns)

    def _proxy_refused(self, times: list[int], scrape_at_ns: int) -> None:
        """The proxy's connects to this server refused at `times` (ns): those from the last believed page's GET on
        and before this scrape began found the server down, as a refused scrape does (`_found_down`): its next page is
        judged after a death (a fall a restart, a page at or past the old reading said: `_down_back`), and the first is
        the window's refused down (`window_down_ns`, `window_down_refused`): the ledger records the death at that page
        whatever it says (`Ledger.add_server_tokens`), or sooner where a scrape before it fails (`down_open`). A scrape that missed a short outage left a restart whose new process passed
        the old reading unsaid, where the proxy's own requests had been refused. One while that GET was in flight may
        have come after the server answered it (uvicorn's graceful shutdown closes its listener first, then finishes
        what it holds): counted, the death in the next window; dropped, 100, 150, restart, 400 read 250 whole, unsaid.
        Where it came before (the page the new process's), the next page is said though whole: an over-flag."""
        start_ns = None if self._believed_at is None else int(self._believed_at * 1e9)
        after = [t for t in times if start_ns is not None and start_ns <= t < scrape_at_ns]
        if not after:
            return
        first = min(after)
        self._unreachable = True
        if self._down_at_ns is None or first < self._down_at_ns:
            self._down_at_ns, self._down_refused = first, True
        if self._refused_at_ns is None or first < self._refused_at_ns:
            self._refused_at_ns = first
        log.info("the proxy's connects to %s were refused %d time(s) since its last page: the server was down "
                 "(its next page is judged so)", self.base, len(after))

    def down_open(self) -> tuple[int, int | None] | None:
        """(the first scrape that found the server down, the first refused) since the last believed page, as they
        began (time.monotonic_ns()): a death known before the new process answers (`Ledger.note_down`). The second is
        None where none was refused but llama-server answered 503 "Loading model" (it binds its port at once as it
        reloads): a restart likely, not yet confirmed (the ledger costs nothing on it until a page says one). None: no
        scrape since was refused or answered so (a 502/503 of any other kind or body, a router's, a rate limit's, an
        auth proxy's, is no sign of a death)."""
        if self._down_at_ns is None or (self._refused_at_ns is None and self._loading_at_ns is None):
            return None
        return self._down_at_ns, self._refused_at_ns

    def _finished_since(self, text: str, restart: bool) -> tuple[float, float] | None:
        """The requests finished since the previous scrape and their summed durations, from the server's e2e latency
        histogram (FINISHED_LATENCY); None where it is not known. Never fails the token scrape: without it the
        ledger places bypass tokens in the window they were counted in, as before."""
        name = FINISHED_LATENCY.get(self.kind or "")
        if name is None:
            return None
        try:
            now = histogram_sum_count(text, name)
        except ValueError as e:
            log.debug("%s unreadable: %s", name, error_text(e))
            now = None
        prev, self._latency = self._latency, now
        if now is None:
            return None
        if restart or prev is None:
            # After a restart both count from zero; at the first read (the baseline) nothing is counted yet.
            return (now[0], now[1]) if restart and prev is not None else None
        if now[0] < prev[0] or now[1] < prev[1]:
            return None  # went back without the token counter doing so: not comparable
        return now[0] - prev[0], now[1] - prev[1]

    def _cache_hits_since(self, text: str, restart: bool) -> float | None:
        """The prompt tokens the server found in its prefix cache since the previous scrape (PREFIX_CACHE_HITS); vLLM
        v0's hit-rate gauge gives its prompt tokens' rise times the rate (a cumulative share: an estimate, enough to
        tell that hits happened). None where not known; never fails the token scrape."""
        try:
            now = prefix_cache_reading(text, self.kind)
        except ValueError as e:
            log.debug("prefix-cache counters unreadable: %s", error_text(e))
            now = None
        prev, self._cache = self._cache, now
        if now is not None:
            self.vllm_v1 = self.kind == "vllm" and now[0] in ("hits", "blocks")
        if now is not None and now[0] == "blocks" and not self._blocks_said:
            self._blocks_said = True
            log.warning("the server counts its prefix-cache hits in blocks (vllm:gpu_prefix_cache_hits_total, vLLM "
                        "before 0.9) and its page says no block size (vllm:cache_config_info): each block is taken for "
                        "one token, a lower bound, so hits its answers did not say are still flagged "
                        "(prefix-cache-unsaid) but their count is low; fix: vLLM 0.9 or later (hits in tokens)")
        if now is None or prev is None or prev[0] != now[0]:
            return None
        if now[0] in ("hits", "blocks"):
            rise = now[1] if restart else now[1] - prev[1]
        else:
            rise = now[1] * (now[2] if restart else now[2] - prev[2])
        return rise if rise >= 0 else None

    async def _scrape_llamacpp(self) -> float:
        # The counter first: a request that ends between the two reads is then missing from
        # both for one scrape (caught up at the next) rather than counted twice.
        read_at_ns = int(time.monotonic() * 1e9)
        metrics_status, page = await self._get("/metrics")
        finished = counter_total(page, LLAMACPP_COUNTER) if metrics_status == 200 else None
        status, text = await self._get("/slots")
        self.read_ns = (read_at_ns, int(time.monotonic() * 1e9))
        try:
            slots_page = slots_json(text) if status == 200 else None
            slots = slot_progress(slots_page) if status == 200 else None
        except Exception:  # noqa: BLE001  (re-raised: any parse failure, a RecursionError or a null next_token too)
            # The scrape fails, but the proxy workers' refusals up to its start are still waited for: taken at once (the
            # failed scrape's take), one a worker flushed 10-38 ms in was missing from `down_open` until a scrape later.
            await self._take_refusals(int(self._scrape_at * 1e9))
            raise
        self.window_each_step = slots is not None
        self.window_slots = slot_tasks(slots_page) if slots is not None else None
        if finished is not None:
            prev_slots, self._seen_slots = self._seen_slots, slots
            if slots is not None and prev_slots is not None and slot_ended(prev_slots, slots):
                # An answer that ended after the counter's read and before /slots' is in neither: its tokens, all
                # made before, counted a scrape late (the whole answer across a window's edge). Nothing on the pages
                # tells which ended when, so the counter is read again: its rise since is the most this count lacks,
                # and the ledger marks an interval that may have moved further than its bound (docs/daemon.md, "A
                # counter read before its stamp"). Unread, beside two CPU hogs and another test a mid-run interval said
                # `complete` with 219 bypass tokens where 189 ran. Only where /slots changed otherwise than by decoding
                # on: a still server's scrape stays two GETs. Unreadable, its ended slots' last counts are the least it
                # may lack. The count's reads ended at `read_ns` (set above, before this GET): its stamp with them.
                try:
                    status2, page2 = await self._get("/metrics")
                    again = counter_total(page2, LLAMACPP_COUNTER) if status2 == 200 else None
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    again = None
                self.window_read_missed = max(0.0, again - finished) if again is not None else float(sum(
                    n for sid, (task, n) in prev_slots.items() if slots.get(sid, (None, 0))[0] != task or
                    slots.get(sid, (None, 0))[1] < n))
        # The proxy workers' refusals after the counter's reads, its second one's too: waited for before it (up to
        # 40 ms past the scrape's start), that read's rise held the answers that ended in the wait, which the count does
        # not lack (/slots had them), and intervals said proxy_lag for them needlessly.
        await self._take_refusals(int(self._scrape_at * 1e9))
        # A 502/503 on /metrics fails the scrape even where /slots answered (a gateway's blip on one route): read as a
        # llama-server without --metrics, its window said slots_only and counted the slots' progress, which the page
        # back counted again from the highest reading (20 phantom tokens of 80). Without --metrics it answers 501, not 5xx.
        if finished is None and (slots is None or metrics_status in (502, 503)):
            if metrics_status == 503 and LLAMACPP_LOADING in page:
                # A reloading llama-server binds its port at once and answers every route 503 "Loading model": down.
                # Read as a server without --metrics, a reload's scrapes found it up, and the whole answers its death
                # closed were not costed (0 J for about 146 J).
                raise MetricsStatus(metrics_status, self.base + "/metrics", loading=True)
            if metrics_status in (502, 503):
                # Not llama-server's loading page: a router's, a rate limit's or an auth proxy's blip in front of a
                # live server, or of one restarting behind it. Read as down, a blip's window was marked counter_below
                # with a restart warning; read as a plain failed scrape, a restart behind a gateway's readiness lag
                # passed unsaid (bypass 1153 of 1728 counted, proxied J/token +52%). A blip (`_blipped`): the page back
                # is held to the server's pace (`_llama_blip_back`).
                raise MetricsStatus(metrics_status, self.base + "/metrics", note=(
                    " (not llama-server's own \"Loading model\": a proxy or router in front of it, most likely); this "
                    "scrape is skipped and retried"))
            raise ValueError("llama-server answers neither /metrics (start it with --metrics) nor /slots")
        if finished is None:
            self.window_partial = (SERVER_COUNT_SLOTS_ONLY,)
            if SERVER_COUNT_SLOTS_ONLY not in self.partial:
                self.partial[SERVER_COUNT_SLOTS_ONLY] = PARTIAL_REASONS[SERVER_COUNT_SLOTS_ONLY]
                log.warning("scraped server count may be low: %s", PARTIAL_REASONS[SERVER_COUNT_SLOTS_ONLY])
            if self._slots is None:
                self._baseline(sum(n for _, n in slots.values()))
            delta = slots_delta(self._slots, slots) if self._slots is not None else 0
            self._slots = slots
            return float(delta)
        total = llamacpp_generated(finished, slots or {})
        # Its decode calls (llama-server's page since 2024): they move every step, where the token counter moves only as a
        # request ends, so a restart while the first requests decode (the token counter still 0, the old slots' tokens in
        # _high) is told by them; by the token counter alone it was not, and the new process's tokens were not counted
        # until they passed the old slots' (against the real llama-server: 0 of 50, nothing said).
        try:
            steps = counter_total(page, LLAMACPP_STEPS) if LLAMACPP_STEPS in page else None
        except ValueError:
            steps = None
        prev_steps, self._steps = self._steps, steps
        if (self._finished is not None and finished < self._finished and prev_steps is not None and steps is not None
                and steps > prev_steps):
            # The finished-token counter went back while the decode calls went on: the same process, the page wrong.
            # Taken for a restart, the whole counter was counted again as new tokens. The highest reading stays.
            raise ValueError(f"{LLAMACPP_COUNTER} went back from {self._finished:g} to {finished:g} while "
                             f"{LLAMACPP_STEPS} went on ({prev_steps:g} to {steps:g}): the same process, so this scrape "
                             "is not believed")
        if self._finished is not None and finished < self._finished:
            self._high = 0.0  # the server restarted: its counter began again from zero
            self._restarted(f"{LLAMACPP_COUNTER} went back from {self._finished:g} to {finished:g}")
        elif prev_steps is not None and steps is not None and steps < prev_steps:
            self._high = 0.0
            self._restarted(f"{LLAMACPP_STEPS} went back from {prev_steps:g} to {steps:g}")
        elif self._unreachable and self._finished is not None:
            # Found down, and back with neither counter fallen: a restart whose new process passed both by its first
            # page (a young server; two bypass requests at once take fewer decode calls than tokens), or the same
            # process back; its page has no start time to tell (`_down_back`). Not moved at all is no proof of the
            # same process either (a death: nothing listened, or it was loading), as on the other servers' pages.
            self._down_back(self._finished, finished)
        elif self._blipped and self._finished is not None and self._high is not None and not (
                finished == self._finished and steps is not None and steps == prev_steps):
            self._llama_blip_back(total, prev_steps, steps)
        was_out = self._unreachable or self._blipped
        self._finished = finished
        if self._high is None:
            self._high = total  # the first scrape is the baseline
            self._baseline(total)
            return 0.0
        # A request ending between the two reads dips the total for one scrape; never report
        # fewer tokens than already reported (a Prometheus counter does not go down).
        delta = max(0.0, total - self._high)
        self._high = max(self._high, total)
        if not was_out and not self.window_partial and self._believed_at is not None:
            # A whole window of one process: its paces (`_llama_blip_back`), as `_peak_tok_s` on the other servers.
            dt = max(self._scrape_at - self._believed_at, 0.05)
            self._peak_tok_s = max(self._peak_tok_s, delta / dt)
            if steps is not None and prev_steps is not None:
                self._peak_steps_s = max(self._peak_steps_s, (steps - prev_steps) / dt)
        return delta

    def _llama_blip_back(self, total: float, prev_steps: float | None, steps: float | None) -> None:
        """After a gateway's 502/503 (`_blipped`) llama-server's page is back with neither counter fallen and something
        moved: the same process, whole, only where its tokens (finished plus decoding now, `total`, against the highest
        reading) and its decode calls (where the page has them) are each beyond a new process's reach and risen within
        the server's own pace (`_beyond_reach`, `_peak_tok_s` and `_peak_steps_s`). Else said (COUNTER_BELOW), the count
        kept. With no pace known yet, judged as after a down (`_down_back`)."""
        has_steps = steps is not None and prev_steps is not None
        if self._peak_tok_s <= 0 or self._believed_at is None or (has_steps and self._peak_steps_s <= 0):
            self._down_back(self._high, total)
            return
        since_s = time.monotonic() - self._believed_at
        why = self._beyond_reach("tokens", self._high, total, self._peak_tok_s, since_s)
        if why is None and has_steps:
            why = self._beyond_reach(LLAMACPP_STEPS, prev_steps, steps, self._peak_steps_s, since_s)
        if why is not None:
            self._said_below(f"is back after a scrape answered 502/503 at {total:g} tokens (finished and decoding), at "
                             f"or past {self._high:g}, but {why}: a restart behind a gateway whose new process passed "
                             "the old reading, or the same process back")
