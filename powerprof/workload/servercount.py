"""What the inference server says it served (its /metrics counters and gauges, llama.cpp's /slots), against what powerprof sent.

A sweep's energy over a decode window is the whole GPU's: requests of other clients on the same
server (a production server "quiet at night", a colleague's script) add their work to ours and
the J/token and tok/s come out wrong without any sign. The server's own books show them:

- tokens: `vllm:generation_tokens_total` (every engine step), `sglang:generation_tokens_total` and
  `llamacpp:tokens_predicted_total` (when a request finishes);
- requests: `vllm:request_success_total` (finished requests);
- in flight: `vllm:num_requests_running`/`_waiting`, `llamacpp:requests_processing`/`_deferred`, or the
  busy slots of llama.cpp's `/slots` (not SGLang's gauges: they lag to its next log, IN_FLIGHT_GAUGES).

`read_tally` takes one snapshot; `ForeignWatch` compares consecutive snapshots taken between
powerprof's batches (when none of its requests is in flight) with what those batches generated.
The daemon's scraper (daemon/scrape.py) parses with the same functions.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from powerprof.errtext import error_text

from .limits import MAX_COUNTER, MAX_METRICS_BYTES, bad_amount, bad_count, read_capped

COUNTERS = {"vllm": "vllm:generation_tokens_total", "sglang": "sglang:generation_tokens_total"}
LLAMACPP_COUNTER = "llamacpp:tokens_predicted_total"
TOKEN_COUNTERS = (*COUNTERS.values(), LLAMACPP_COUNTER)
# Server kinds whose token counter is absent from a /metrics that answers until their first request finishes:
# SGLang serves prometheus_client's multiprocess collector, which shows a labelled family only once set (with
# --skip-server-warmup nothing is set before the first request). Absent there means 0, not "not shown", but only
# on such a page with nothing finished yet (unset_means_zero).
UNSET_IS_ZERO = ("sglang",)
# SGLang's families set in the same step as its token counter, when a request finishes (collector.py,
# observe_one_finished_request): on a page that holds one, requests have finished, so an absent token counter is
# one this page does not show under powerprof's name (another version's), not a counter still unset.
SGLANG_FINISHED = ("sglang:num_requests", "sglang:prompt_tokens", "sglang:cached_tokens", "sglang:e2e_request_latency_seconds",
                   "sglang:num_retractions", "sglang:num_so_requests", "sglang:prompt_tokens_histogram",
                   "sglang:generation_tokens_histogram")
REQUEST_COUNTERS = ("vllm:request_success_total",)
# Requests the server holds now (running and queued), per server family. Not SGLang's num_running_reqs /
# num_queue_reqs: it sets them only when it logs (at a prefill batch, every decode_log_interval = 40 decode steps,
# and once idle only 30 s after its last log), so between powerprof's batches they still count its own last requests.
IN_FLIGHT_GAUGES = (("vllm:num_requests_running", "vllm:num_requests_waiting"),
                    ("llamacpp:requests_processing", "llamacpp:requests_deferred"))
SGLANG_STALE_GAUGES = ("the server's requests in flight are not read: SGLang's sglang:num_running_reqs is set only when "
                       "it logs (every 40 decode steps, 30 s once idle), so between powerprof's batches it still counts "
                       "powerprof's own last requests")
# Token counters a server moves at every engine step (not at a request's end): while they stand still, no request
# runs. vLLM refreshes its in-flight gauges at a step too; before the fix of vllm-project/vllm#29928 (#22545), when
# every request it held was aborted (a client hung up) no step came and the gauges kept the last step's counts until
# its next request: read as they are, they made another client of every batch and idle baseline after such an abort.
# (vLLM 0.32 takes one more step and reads 0 within 0.2 s: tests/test_real_vllm.py.)
STEP_COUNTERS = ("vllm:generation_tokens_total",)
STALE_GAUGES = ("left from aborted requests: a vLLM older than the fix of vllm-project/vllm#29928 refreshes them only "
                "at an engine step, and when every request it holds is aborted none comes until the next one; not read "
                "as another "
                "client's. Another client's request in a prefill longer than the 0.25 s between the two reads is "
                "seen by its tokens in the next batch instead; fix: a vLLM with that fix (0.32 has it: its gauges "
                "read 0 within 0.2 s of an abort)")
TALLY_TIMEOUT_S = 5.0
# A server's token count and the one powerprof takes from the stream can differ by one per request
# (vLLM's closing chunk, a count taken at a step vs at the stream's end): more than one token per
# request of ours is someone else's work. A request of another client generates at least one token and
# usually tens; one or two stray tokens per request of ~100 are under 2% of a window's work, which the
# in-flight gauges catch anyway when the other request spans one of the snapshots.
TOKENS_PER_REQUEST_TOLERANCE = 1
# vLLM updates its gauges after the step that finished our last request, which the client may see
# first: a request still counted as running is read again this much later before it is believed.
IN_FLIGHT_RECHECK_S = 0.25
FOREIGN_FLAG = "foreign-traffic"
FOREIGN_FIX = "stop the other clients (or processes on the GPU) for the sweep, or sweep a server and GPU of your own"


# Lines naming one metric that a page may hold before it is not parsed: a real server's counter has a series a model
# (a histogram ~30 lines a series), where a page of 300 000 series (16 MiB, the read bound) took 2.5 s of CPU to parse,
# in the daemon's event loop, which the proxy shares, at every scrape (4 a second while traffic moves).
MAX_METRIC_LINES = 4096
# Slots on llama.cpp's /slots page before it is not decoded: a llama-server runs -np of them, tens in practice. The page
# may carry each running request's prompt text, so its size says little (a byte cap would cut real pages); its slot
# count is what makes decoding it dear: a 16 MiB page of 29 000 slots took 0.15-0.39 s of CPU, in that event loop.
MAX_SLOTS = 1024


# A highest reading this small (tokens) is of a dip's own size: a dip of one request's tokens (SGLang adds a request's
# tokens at its finish, so a process's lagging share on its multi-process page is whole requests') takes it to half or
# less, so there a fall to half or less is no restart's sign by itself (counter_restarted): a young counter's fall is
# held and judged at the next page by what the judge's own side knows (the sweep: ForeignWatch; the daemon:
# Scraper._dip_or_restart). Read as a restart at once, the simulated SGLang's warm-up 2 read as 0 counted its 2 tokens
# again, and a real dip of 10 (20, 10, 20, 40) counted 10 tokens twice as bypass, or blamed a sweep batch for them.
YOUNG_COUNTER_TOKENS = 64
# A young counter's fall of this many tokens or fewer that comes back at the next page is the dip seen every run (the
# simulator dips 4; SGLang's warm-up 2 read as 0): the daemon counts on from the highest reading unsaid. A larger young
# fall that comes back is counted so too, but its window is said (counter_below): the daemon's scraper does not know
# the proxy's tokens, so it cannot tell it from a restart whose new process passed the old reading by that page.
YOUNG_DIP_TOKENS = 4
# A request counter's fall to half or less is held this many pages at most (the fall's and the next), while the token
# counter on those pages finds no restart (a restart resets both): a multi-process page's dip lasts a page or two
# (ForeignWatch._requests_and_why). Past it, a reading still below the reading before the fall plus ours since is a
# restart's.
REQ_DIP_PAGES = 2


def counter_restarted(before: float, now: float, young: float = YOUNG_COUNTER_TOKENS) -> bool:
    """Whether a counter read `now` after `before` (the daemon: its highest believed reading; the sweep: the page before)
    says by itself that the server restarted: it fell to half or less (a new process counts from 0) while `before` is
    above `young`. The one rule the daemon's scraper and the sweep's foreign-traffic check judge a fall by at once; a
    smaller fall is a dip (or a restart nothing else says), and a young counter's fall (`before` at or below `young`)
    is held and judged at the next page: a dip adds nothing, so a dip's next reading is at least the reading before the
    fall plus the tokens the judge's own requests made since; one below that is a restart's."""
    return now < before and now <= before / 2 and before > young


def connection_refused(e: BaseException) -> bool:
    """Whether a failed request says nothing listens at the server's address (a connection refused: a server down or
    restarting), the only connection failure that is a restart's sign. Any other (a name that did not resolve, a
    connect that timed out, a host unreachable) says the server could not be read, not that it went down."""
    return isinstance(e, aiohttp.ClientConnectorError) and isinstance(e.os_error, ConnectionRefusedError)


def _lines_naming(text: str, name: str) -> str:
    """The lines of `text` that name `name`, each ended by a newline (the lines `text.splitlines()` gives that name it);
    a page that names it more than MAX_METRIC_LINES times is refused before anything is parsed. Only the stretch from
    the first line naming it to the last is split into lines: a metric's lines are one block of a page (its HELP,
    TYPE and samples), and splitting a whole vLLM page (~500 lines), with a count of the name over it before, was
    most of a scrape's parse (daemon/scrape.py, 4 a second; bench/scrape_parse.py)."""
    first = text.find(name)
    if first < 0:
        return ""
    last = text.rfind(name)
    # Cut at LFs, which end a line for splitlines too (alone or after a CR): the stretch splits as the page would.
    start = text.rfind("\n", 0, first) + 1
    end = text.find("\n", last)
    stretch = text[start:] if end < 0 else text[start:end]
    n = stretch.count(name)  # every time the page names it: none is outside the stretch
    if n > MAX_METRIC_LINES:
        raise ValueError(f"{name} is named on {n} lines of the page, more than the {MAX_METRIC_LINES} read: not parsed "
                         "(a server lists one series a model)")
    return "".join(ln + "\n" for ln in stretch.splitlines() if name in ln)


def counter_total(text: str, name: str) -> float | None:
    """Sum of a counter (or gauge) over all its label sets; None when the metric is absent."""
    base = name[: -len("_total")] if name.endswith("_total") else name
    # Only the lines naming the metric are parsed: a vLLM /metrics page is ~100 kB of histograms
    # (~15 ms to parse whole on a busy core, too much at several scrapes a second).
    text = _lines_naming(text, base)
    total, seen = 0.0, False
    series: set = set()
    for fam in text_string_to_metric_families(text):
        if fam.name not in (base, name):
            continue
        for s in fam.samples:
            if s.name == name or (s.name == base and fam.type != "counter"):
                # One series said twice is a broken page (Prometheus refuses it): summed, every token counted twice.
                key = (s.name, tuple(sorted(s.labels.items())))
                if key in series:
                    raise ValueError(f"{name} lists the series {dict(s.labels)} twice: the page is not believed")
                series.add(key)
                total += s.value
                seen = True
    if seen and (why := bad_amount(total, MAX_COUNTER)) is not None:
        raise ValueError(f"{name} {why}")
    return total if seen else None


# SGLang's end-to-end latency histogram, observed in the same call as its token counter (observe_one_finished_request):
# its _sum and _count rise by the finished requests' durations (arrival to end) and number. The daemon spreads an
# at-finish counter's bypass tokens back over their requests' durations with it (daemon/ledger.py).
FINISHED_LATENCY = {"sglang": "sglang:e2e_request_latency_seconds"}


# The prompt tokens a server found in its prefix cache, in tokens since its start: vLLM V1's counters (move as a request
# is scheduled, before its first token; a KV connector's cache, offloaded or remote, counted apart in
# VLLM_EXTERNAL_HITS while usage's cached_tokens says both: their sum), SGLang's (moves as a request finishes, set only once a hit has happened: absent
# on its own page means none yet). vLLM v0 had only a hit-rate gauge (cumulative hit share of the prompt tokens queried):
# read with its prompt-token counter, it gives an estimate. The daemon checks the hits against the cached counts its
# requests' answers said (docs/daemon.md, "Prefix-cache hits are no prefill").
PREFIX_CACHE_HITS = {"vllm": "vllm:prefix_cache_hits_total", "sglang": "sglang:cached_tokens_total"}
VLLM_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
VLLM_HIT_RATE, VLLM_PROMPT_TOKENS = "vllm:gpu_prefix_cache_hit_rate", "vllm:prompt_tokens_total"
# vLLM V1's first name for its hits (PR #12592), the only one 0.8.0 to 0.9.1 show (0.9.2 added PREFIX_CACHE_HITS beside
# it, PR #18354; 0.11 hides it, 0.12 drops it). Its unit changed under the same name: blocks until PR #18003 (May 2025,
# in 0.9.0: "in terms of number of cached blocks"), tokens since ("... cached tokens"). Its HELP says which; blocks are
# whole blocks of `block_size` tokens (VLLM_CACHE_CONFIG's label), so their product is the tokens.
VLLM_OLD_HITS, VLLM_CACHE_CONFIG = "vllm:gpu_prefix_cache_hits_total", "vllm:cache_config_info"


def prefix_cache_reading(text: str, kind: str | None) -> tuple[str, float, float] | None:
    """What the page says of the server's prefix-cache hits: ("hits", tokens hit since start, 0), vLLM 0.8's
    ("blocks", blocks hit since start, 0) where their size is not said (`_vllm_old_hits`), or vLLM v0's ("rate", hit
    share, prompt tokens since start); None where it says nothing (another server, not shown)."""
    name = PREFIX_CACHE_HITS.get(kind or "")
    if name is None:
        return None
    hits = counter_total(text, name)
    if hits is not None:
        if kind == "vllm":
            hits += counter_total(text, VLLM_EXTERNAL_HITS) or 0.0  # absent (an older vLLM): none counted apart
        return "hits", hits, 0.0
    if kind == "sglang":
        return "hits", 0.0, 0.0  # set at the first hit: its page (its token counter read) without it has none yet
    old = _vllm_old_hits(text)
    if old is not None:
        return old
    rate, prompt = counter_total(text, VLLM_HIT_RATE), counter_total(text, VLLM_PROMPT_TOKENS)
    if rate is None or prompt is None or not 0.0 <= rate <= 1.0:
        return None
    return "rate", rate, prompt


def _vllm_old_hits(text: str) -> tuple[str, float, float] | None:
    """vLLM 0.8.0-0.9.1's hits (VLLM_OLD_HITS) in tokens: ("hits", tokens, 0); ("blocks", blocks, 0) where its unit is
    blocks of a size the page does not say, or its HELP says no unit: each is at least one token (a lower bound, which
    still tells hits that no answer said); None where absent."""
    hits = counter_total(text, VLLM_OLD_HITS)
    if hits is None:
        return None
    doc = ""
    for fam in text_string_to_metric_families(_lines_naming(text, VLLM_OLD_HITS[: -len("_total")])):
        doc = fam.documentation.lower()
    if "token" in doc:
        return "hits", hits, 0.0
    if "block" in doc:
        size = _vllm_block_size(text)
        if size is not None:
            return "hits", hits * size, 0.0
    return "blocks", hits, 0.0


def _vllm_block_size(text: str) -> int | None:
    """The KV cache's block size in tokens from vLLM's cache_config_info gauge (its labels are the cache's config)."""
    for fam in text_string_to_metric_families(_lines_naming(text, VLLM_CACHE_CONFIG)):
        for s in fam.samples:
            v = s.labels.get("block_size", "")
            if v.isdigit() and 0 < int(v) <= 1 << 20:
                return int(v)
    return None


def histogram_sum_count(text: str, name: str) -> tuple[float, float] | None:
    """A histogram's (_count, _sum) summed over its label sets; None when it is absent."""
    text = _lines_naming(text, name)
    count = total = 0.0
    seen = set()
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name == name + "_count":
                count += s.value
                seen.add("count")
            elif s.name == name + "_sum":
                total += s.value
                seen.add("sum")
    if seen != {"count", "sum"}:
        return None
    for what, v in (("_count", count), ("_sum", total)):
        if (why := bad_amount(v, MAX_COUNTER)) is not None:
            raise ValueError(f"{name}{what} {why}")
    return count, total


def series_values(text: str, names) -> dict[tuple[str, tuple], float]:
    """Every sample of the counters and histograms `names` on the page, by (sample name, its labels sorted): a counter's
    `_total` per label set, a histogram's `_bucket` (per `le`), `_count` and `_sum` per label set (no `_created`: a
    stamp, not a count). One process's only rise, each apart; a new process counts each from 0 (or has it not at all)."""
    out: dict[tuple[str, tuple], float] = {}
    for name in names:
        base = name[: -len("_total")] if name.endswith("_total") else name
        for fam in text_string_to_metric_families(_lines_naming(text, base)):
            if fam.name not in (base, name):
                continue
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def unset_means_zero(text: str, kind: str | None) -> bool:
    """Whether a /metrics page (answered 200) without `kind`'s token counter says the server has counted nothing yet
    (0), not that it does not show it (unknown). Only SGLang's own page qualifies: its multiprocess collector shows
    SGLang's families and nothing else (no process_ or python_ metrics), and none that a finished request sets
    (SGLANG_FINISHED). Any other page, a gateway's own /metrics in front of an SGLang (its /v1/models passed through)
    or one whose requests finished with no counter of that name, leaves the count unknown: read as 0 it hid every
    token served there."""
    if kind not in UNSET_IS_ZERO:
        return False
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln or ln.startswith("#"):
            continue
        name = ln.split("{", 1)[0].split(None, 1)[0]
        base = next((name[: -len(x)] for x in ("_total", "_bucket", "_sum", "_count", "_created") if name.endswith(x)),
                    name)
        if not name.startswith("sglang:") or base in SGLANG_FINISHED:
            return False
    return True


def slots_json(text: str):
    """llama.cpp's /slots page decoded; ValueError, before any decoding, when it may hold more than MAX_SLOTS slots.
    The count is of `"id"` in the text, a C-speed scan (~1 ms a MiB): every slot that counts has its `id`
    (slot_progress), and an escaped quote inside a string (a prompt's) is `\\"`, so prompt texts cannot raise it; a
    string value ending in "id" or a LoRA adapter's `id` in a slot's params can, which only refuses sooner."""
    n = text.count('"id"')
    if n > MAX_SLOTS:
        raise ValueError(f"/slots holds {n} \"id\" keys, more than the {MAX_SLOTS} slots a llama-server runs "
                         "(servercount.MAX_SLOTS): not decoded, so as not to stall the daemon's proxy (fix: fewer slots, -np; or "
                         "start llama-server with --metrics --no-slots, counting each request as it ends)")
    return json.loads(text)


def slot_progress(slots) -> dict[int, tuple[object, int]]:
    """{slot id: (task id, n_decoded)} from llama.cpp's /slots JSON; an idle slot counts 0."""
    out = {}
    if not isinstance(slots, list):
        return out
    for s in slots:
        if not isinstance(s, dict):
            continue
        sid = s.get("id")
        task = s.get("id_task", s.get("task_id"))
        n = s.get("n_decoded")
        if n is None:
            n = (s.get("next_token") or [{}])[0].get("n_decoded") if isinstance(s.get("next_token"), list) else None
        if n is not None and (why := bad_count(n)) is not None:
            raise ValueError(f"/slots n_decoded {why}")
        if isinstance(sid, int) and isinstance(n, (int, float)):
            # Older servers keep the last request's n_decoded on an idle slot: it is not in flight.
            busy = s.get("is_processing", s.get("state", 1) != 0)
            out[sid] = (task, int(n) if busy else 0)
    return out


def busy_slots(slots) -> int | None:
    """Slots processing a request now, from llama.cpp's /slots JSON; None when it is not that list."""
    if not isinstance(slots, list):
        return None
    return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing", s.get("state", 0) != 0))


def llamacpp_generated(finished: float, slots: dict[int, tuple[object, int]]) -> float:
    """Tokens generated so far: finished requests (the /metrics counter) + those decoding now."""
    return finished + sum(n for _, n in slots.values())


@dataclass(frozen=True)
class Tally:
    """One snapshot of what the server says it has served. None: it does not say."""

    t_ns: int
    tokens: float | None = None  # generated tokens so far (llama.cpp, SGLang: of finished requests)
    tokens_name: str | None = None
    requests: float | None = None  # finished requests so far
    requests_name: str | None = None
    in_flight: float | None = None  # requests running or queued now
    in_flight_source: str | None = None  # the gauges, or /slots
    stale_in_flight: float | None = None  # what the gauges said while the engine took no step (not in in_flight)
    unread: str | None = None  # why /metrics could not be read (_get): then blind is no fact about the server

    @property
    def blind(self) -> bool:
        """Nothing here could show another client's request."""
        return self.tokens is None and self.in_flight is None

    def limits(self) -> str | None:
        """What this server cannot show of other clients' requests, in words; None when it shows both kinds."""
        if self.blind and self.unread:
            return (f"the server's /metrics {self.unread}, so other clients' requests cannot be ruled out (fix: "
                    "check that the server runs and answers at the address given)")
        if self.blind:
            return ("the server shows no request or token counters (llama.cpp: start it with --metrics, or keep /slots "
                    "enabled; vLLM and SGLang: /metrics, SGLang with --enable-metrics), so other clients' requests "
                    "cannot be ruled out")
        if self.tokens is None and self.unread:  # /slots answered: "no token counter (--metrics)" was the wrong fix
            return (f"the server's /metrics {self.unread}, so its token counter was not read and only the requests in "
                    f"flight ({self.in_flight_source}) are seen: another client's request that starts and ends within "
                    "one of powerprof's cannot be seen (fix: check that the server's /metrics answers at the address "
                    "given)")
        if self.tokens is None:
            return (f"the server shows only the requests in flight ({self.in_flight_source}), no token counter "
                    "(llama.cpp: --metrics): another client's request that starts and ends within one of powerprof's "
                    "requests cannot be seen")
        if self.in_flight is None:
            why = (SGLANG_STALE_GAUGES if (self.tokens_name or "").startswith("sglang:")
                   else "the server shows no requests in flight")
            return (f"the server shows its token counter ({self.tokens_name}), but {why}: another client's request "
                    "that spans two of powerprof's is seen in the window where it finishes only")
        return None


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int | None, str, str | None]:
    """(status, body, None), or (None, "", why it could not be read): a refused connection says the server is down
    (connection_refused); any other failure (a name that did not resolve, a connect timed out) only that it was not
    read."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=TALLY_TIMEOUT_S)) as r:
            if r.status != 200:
                return r.status, "", None
            return r.status, (await read_capped(r, MAX_METRICS_BYTES)).decode("utf-8", "replace"), None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        if connection_refused(e):
            return None, "", "was not read: connection refused (nothing listens there: the server is down)"
        return None, "", f"could not be read ({error_text(e)}; not taken as the server down)"


def _first_counter(text: str, names) -> tuple[float | None, str | None]:
    """(value, name) of the first of `names` the page shows as a count; (None, None) where none."""
    for name in names:
        try:
            v = counter_total(text, name)
        except ValueError:
            v = None
        if v is not None:
            return v, name
    return None, None


def tally_from_metrics(text: str, t_ns: int) -> Tally:
    """The counters and gauges of one /metrics page (any server family); a value that is not a count is left out."""
    tokens, tokens_name = _first_counter(text, TOKEN_COUNTERS)
    requests, requests_name, in_flight, source = requests_and_in_flight(text)
    return Tally(t_ns, tokens, tokens_name, requests, requests_name, in_flight, source)


def requests_and_in_flight(text: str) -> tuple[float | None, str | None, float | None, str | None]:
    """(finished requests so far, the counter's name, requests running and queued now, the gauges' names) of one
    /metrics page (REQUEST_COUNTERS, IN_FLIGHT_GAUGES); None where the page does not say, or says a value that is not a
    count. The sweep's foreign-traffic check (`tally_from_metrics`) and the daemon's scraper (its quiet stretches'
    proof that no bypass request ran: daemon/reconcile.py) read them so."""
    requests, requests_name = _first_counter(text, REQUEST_COUNTERS)
    in_flight = source = None
    for names in IN_FLIGHT_GAUGES:
        vals = [v for v, _ in (_first_counter(text, (n,)) for n in names) if v is not None]
        if vals:
            in_flight, source = sum(vals), " + ".join(n for n in names if n in text)
            break
    return requests, requests_name, in_flight, source


async def read_tally(session: aiohttp.ClientSession, base_url: str, kind: str | None = None) -> Tally:
    """What the server says it has served, now: /metrics, and llama.cpp's /slots where /metrics has no gauge.
    A GET the server answers from memory: no GPU work, no tokens counted. kind: the server's (client.detect_server);
    an SGLang whose own /metrics page answers without its token counter, nothing finished, has counted nothing yet
    (unset_means_zero); any other page without it leaves the count unknown."""
    base = base_url.rstrip("/")
    t_ns = time.monotonic_ns()
    status, text, unread = await _get(session, base + "/metrics")
    tally = tally_from_metrics(text, t_ns) if status == 200 and text else Tally(t_ns, unread=unread)
    if status == 200 and tally.tokens is None and unset_means_zero(text, kind):
        tally = Tally(t_ns, 0.0, COUNTERS[kind], tally.requests, tally.requests_name, tally.in_flight,
                      tally.in_flight_source)
    if tally.in_flight is None:
        status, text, _ = await _get(session, base + "/slots")
        try:
            busy = busy_slots(slots_json(text)) if status == 200 else None
        except ValueError:
            busy = None
        if busy is not None:
            tally = replace(tally, in_flight=float(busy), in_flight_source="/slots")  # keeps why /metrics was unread
    return tally


async def settled_tally(session: aiohttp.ClientSession, base_url: str, kind: str | None = None) -> Tally:
    """`read_tally`, read again IN_FLIGHT_RECHECK_S later when it shows requests in flight (none of powerprof's
    are): a gauge not yet updated after our last request finished reads 0 the second time, another client's
    request still runs (the smaller count of the two is kept)."""
    t = await read_tally(session, base_url, kind)
    if not t.in_flight:
        return t
    await asyncio.sleep(IN_FLIGHT_RECHECK_S)
    t2 = await read_tally(session, base_url, kind)
    if t2.in_flight is None:
        return t
    if stale_gauge(t, t2):
        return Tally(t2.t_ns, t2.tokens, t2.tokens_name, t2.requests, t2.requests_name, 0.0, t2.in_flight_source,
                     stale_in_flight=t2.in_flight)
    return t2 if t2.in_flight <= t.in_flight else Tally(t2.t_ns, t2.tokens, t2.tokens_name, t2.requests,
                                                         t2.requests_name, t.in_flight, t.in_flight_source)


def stale_gauge(t: Tally, t2: Tally) -> bool:
    """Whether the requests in flight two reads `IN_FLIGHT_RECHECK_S` apart say (the same count on both) are a
    server's gauges left over while its engine took no step: its per-step token counter (STEP_COUNTERS) and its
    finished requests stood still between them. A running request moves the counter at its every step."""
    return (bool(t.in_flight) and t2.in_flight == t.in_flight and t.tokens_name in STEP_COUNTERS
            and t2.tokens_name == t.tokens_name and t.tokens is not None and t2.tokens == t.tokens
            and t2.requests == t.requests)


class ForeignWatch:
    """Compares the server's books with powerprof's requests, batch by batch, over one stretch of a level.

    Snapshots are taken between batches, when none of powerprof's requests is in flight: requests in
    flight then, and tokens or finished requests beyond the batch's own (beyond the tolerance), are
    another client's. Counts compare cumulatively from the first snapshot with a high-water mark, so a
    counter that lags the stream by a step, or dips below the page before for one read, shifts nothing
    between batches. A token counter fallen to half its last reading or less is a restart (counted from
    there again: counter_restarted); a fall from YOUNG_COUNTER_TOKENS or fewer is held to the next page, a dip if that
    reads at least the reading before the fall plus powerprof's tokens since (a dip adds nothing), else a restart,
    counted from 0 (`_held`); the request counter's fall to half or less is held and judged so too (`_req_held`),
    a second page where the token counter finds no restart on them (REQ_DIP_PAGES);
    a restart the sweep sees as the server going away is ridden out by sweep.py."""

    def __init__(self, first: Tally):
        self.first = self.prev = first
        self.ours_tokens = 0
        self.ours_requests = 0
        self._tok_high = 0.0
        self._req_high = 0.0
        # The token count compared from (the first snapshot's, or a restart's): its own, not `first`'s, which the
        # request counter's restart moves while powerprof's tokens so far stay counted.
        self._tok_first = first.tokens
        # A young counter's fall held to the next page: (the reading before it, powerprof's tokens then, requests since).
        self._held: tuple[float, int, int] | None = None
        # The request count compared from (the first snapshot's, or a restart's), and a fall of it to half or less held
        # to the next page: (the reading before it, powerprof's requests then). As the tokens', judged there.
        self._req_first = first.requests
        self._req_held: tuple[float, int, int] | None = None  # ... and the pages it has been held (REQ_DIP_PAGES)
        self._tok_restarted = False  # the token side took this page for a restart (its compare, `judge`)
        self._tok_restarts_held = False  # ... or the page where the request counter's held fall began
        self.seen_tokens = 0.0  # tokens not ours the server generated, over the flagged batches
        self.seen_requests = 0.0
        self.stale: str | None = None  # once: the gauges read while the engine took no step (STALE_GAUGES)
        self._note_stale(first)

    def _note_stale(self, t: Tally) -> None:
        if t.stale_in_flight and self.stale is None:
            self.stale = (f"the server's gauges ({t.in_flight_source}) said {t.stale_in_flight:.0f} request(s) in "
                          f"flight while its token counter ({t.tokens_name}) stood still: " + STALE_GAUGES)

    def judge(self, now: Tally, recs) -> str | None:
        """Why the batch `recs` (between the previous snapshot and `now`) ran beside another client's requests, or None."""
        why = []
        self._note_stale(now)
        for edge, at in ((self.prev, "as it began"), (now, "as it ended")):
            if edge.in_flight:
                why.append(f"{edge.in_flight:.0f} request(s) not powerprof's in flight on the server {at} "
                           f"({edge.in_flight_source})")
        failed = any(not r.ok for r in recs)  # its tokens so far are in the server's count, not in ours
        # What came over the wire: where the server's own count for a request contradicts its stream (a server
        # lying in usage), the stream's, or that lie read as another client's tokens and hid its own reason.
        batch_tokens = sum(int((r.shown_tokens if r.count_problem else r.generated_tokens) or 0) for r in recs)
        self.ours_tokens += batch_tokens
        self.ours_requests += sum(1 for r in recs if r.ok)
        self._tok_restarted = False
        if now.tokens is not None and self._tok_first is not None and self.prev.tokens is not None:
            tol = TOKENS_PER_REQUEST_TOLERANCE * max(len(recs), 1)
            held, self._held = self._held, None
            if held is not None:
                # A young counter fell at the page before: a dip adds nothing, so this page reads at least the reading
                # before the fall plus our tokens since (less the tolerance a request: a server may count one fewer).
                # Below that no dip gives: the server restarted, its new counter holds only its own tokens, so it is
                # compared from 0 with our tokens since the fall's high (a restart unseen at 60, 20 (ours 20), 80 (ours
                # 20, another client's 40): 40 tokens more than ours). At or above it, compared on from the first
                # snapshot as any dip (20, 10, 40 with ours 20, 10, 10: nothing more than ours).
                high, ours_then, n_then = held
                since = self.ours_tokens - ours_then
                tol = TOKENS_PER_REQUEST_TOLERANCE * max(n_then + len(recs), 1)
                if now.tokens < high + since - tol:
                    self._tok_first, self.ours_tokens, self._tok_high = 0.0, since, 0.0
                    self._tok_restarted = True
            elif now.tokens < self.prev.tokens and self.prev.tokens <= YOUNG_COUNTER_TOKENS:
                # A young counter's fall: a dip of one request's share or a restart, not told apart by its size (a
                # dip of one request's tokens takes a young counter to half or less: SGLang's warm-up 2 read as 0).
                # Judged at the next page; this batch's compare waits for it (a dipped reading cannot show more than
                # ours anyway).
                self._held = (self.prev.tokens, self.ours_tokens - batch_tokens, len(recs))
                return self._requests_and_why(now, recs, failed, why)
            # The server restarted: its counter began again (counter_restarted, the daemon's rule too). A fall, never a
            # counter standing still at 0 (a fresh server's counter lagging our first batch: reset there, that batch
            # came back as another client's).
            if held is None and counter_restarted(self.prev.tokens, now.tokens):
                self._tok_first, self.ours_tokens, self._tok_high = now.tokens, 0, 0.0
                self._tok_restarted = True
            else:
                # A fall above half the page before is no restart: a multi-process page (SGLang's, a vLLM with
                # several API servers) read while a worker's share lagged (docs/daemon.md, "A counter that dips").
                # Reset there, the dip came back at the next page as the next batch's "tokens more" (4 of 12
                # windows of an SGLang level left out and sent again, tests/test_sweep_foreign.py). Compared from the
                # first snapshot, a dipped reading cannot raise the high-water mark, and others' tokens beyond the
                # dip are still seen in their batch; those it hides are seen at the next page, in the next batch.
                excess = now.tokens - self._tok_first - self.ours_tokens
                if not failed and excess > self._tok_high + tol:
                    self.seen_tokens += excess - self._tok_high
                    why.append(f"the server generated {excess - self._tok_high:.0f} tokens more than powerprof's "
                               f"requests received ({now.tokens_name})")
                self._tok_high = max(self._tok_high, excess)
        return self._requests_and_why(now, recs, failed, why)

    def _requests_and_why(self, now: Tally, recs, failed: bool, why: list) -> str | None:
        """The request counter's compare for the batch `recs` (after its tokens'), and the batch's reasons joined."""
        if now.requests is not None and self._req_first is not None and self.prev.requests is not None:
            held, self._req_held = self._req_held, None
            if held is not None:
                # Its fall at the page before: a dip adds nothing, so this page reads at least the reading before the
                # fall plus our requests since; below that, a restart, its new counter compared from 0 with our
                # requests since the fall's high (as the tokens', `judge`).
                high, ours_then, pages = held
                since = self.ours_requests - ours_then
                if now.requests < high + since:
                    if (pages < REQ_DIP_PAGES and now.tokens is not None and self._tok_first is not None
                            and not self._tok_restarted and not self._tok_restarts_held):
                        # Still below, but the token counter on the same pages found no restart (a restart resets
                        # both): a dip lasting a second page (one process's share still lagging). Held once more, and
                        # judged at the next page by the same rule; this batch's compare waits too. Judged here, it
                        # read as a restart, and the next page's recovery was blamed on its batch (2 / 1, 1, 1, then
                        # 5 with ours 1 a batch: "2 request(s) more", nothing foreign running).
                        self._req_held = (high, ours_then, pages + 1)
                        self.prev = now
                        return "; ".join(why) or None
                    self._req_first, self.ours_requests, self._req_high = 0.0, since, 0.0
            elif counter_restarted(self.prev.requests, now.requests, young=0):
                # A fall to half or less: a restart, or both counters of a multi-process page (a vLLM with several API
                # servers) dipping together while one process's share lags; a few requests' share takes a request
                # counter to half or less. Read as a restart at once, the next page's recovery was blamed on its batch
                # (20/2, 10/1, 40/4 with ours 10/1 a batch: "2 request(s) more", nothing foreign running, the token
                # side silent). Held to the next page, as a young token counter's fall is; this batch's compare waits
                # (a dipped reading cannot show more than ours anyway).
                self._req_held = (self.prev.requests, self.ours_requests - sum(1 for r in recs if r.ok), 1)
                self._tok_restarts_held = self._tok_restarted
                self.prev = now
                return "; ".join(why) or None
            excess = now.requests - self._req_first - self.ours_requests
            if not failed and excess > self._req_high:
                self.seen_requests += excess - self._req_high
                why.append(f"the server finished {excess - self._req_high:.0f} request(s) more than powerprof "
                           f"sent ({now.requests_name})")
            self._req_high = max(self._req_high, excess)
        self.prev = now
        return "; ".join(why) or None
