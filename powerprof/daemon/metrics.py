"""Prometheus exposition: a custom collector over the daemon's latest immutable snapshot.

Names follow Prometheus conventions (base units, `_total` counters, no label names inside metric
names). Labels are bounded: GPU identity, and a tag label passed through `TagLimiter` (allow-list
or first-N, the rest "other"); untagged traffic has an empty tag, which Prometheus treats as no
label, as Parquet stores NULL. Never request ids or PIDs. `powerprof_build_info` (value 1) names
the version, Python and host, for dashboards to select by host. The daemon's own CPU and memory come from prometheus_client's
process collector (`process_cpu_seconds_total`, `process_resident_memory_bytes`).
"""

from __future__ import annotations

import platform
import socket
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from powerprof import __version__
from powerprof.arrival import COUNT_PROBLEM_KINDS
from powerprof.profiler import NO_COUNTER_SHORT_FIX, NO_COUNTER_SHORT_FLAG
from powerprof.storage.schema import (BEST_OF_FIX, BEST_OF_FLAG, BYPASS_LOW_FLAG, CACHE_LATE_FIX, CACHE_LATE_FLAG,
                                      CACHE_UNSAID_FIX, CACHE_UNSAID_FLAG,
                                      COUNT_OPEN_FIX, COUNT_OPEN_FLAG, GONE_PREFILL_FIX, GONE_PREFILL_FLAG,
                                      HELD_TAIL_FIX, HELD_TAIL_FLAG, PROMPT_UNREAD_FIX, PROMPT_UNREAD_FLAG,
                                      SERVER_COUNT_SLOTS_ONLY, SERVING_ASSERTED_FIX, SERVING_ASSERTED_FLAG,
                                      UNSURE_FLAG)

from .attribution import DEST_NAMES, KIND_NAMES
from .inflight import InFlightState
from .scrape import PARTIAL_REASONS
from .streams import UNCOUNTED_KINDS
from .workmodel import GPUS_UNDECIDED_REASON

LATENCY_DOCS = {
    "ttft_seconds": "Proxied requests' time to first token (arrival at the proxy to first token)",
    "tpot_seconds": "Proxied requests' time per output token after the first ((last - first) / (tokens - 1))",
    "prompt_tokens": "Proxied requests' prompt tokens (as the server reported them)",
    "output_tokens": "Proxied requests' generated tokens",
}
# Request flags (rowtext.COUNTED_FLAGS) → the counter of the rows that say them, and its help: always shown, 0 included,
# so a dashboard's rate() of one reads 0 rather than no data. One table for every flag counted, counted by the ledger
# from the decision each row's note is written by.
FLAG_COUNTERS = {
    NO_COUNTER_SHORT_FLAG: ("powerprof_requests_no_counter_short", "Requests whose GPU energy came mostly from "
                   "intervals without an energy counter (power readings) that requests were live in for "
                   "under half their time (read from instant power: for less than all of it): it rests on "
                   "the idle power taken out of the rest; their rows' energy_note says no-counter-short, "
                   "and they are left out of powerprof_joules_per_token; fix: " + NO_COUNTER_SHORT_FIX),
    CACHE_UNSAID_FLAG: ("powerprof_requests_cache_unsaid", "Requests whose prefill was costed at their whole "
                   "prompt while the server's prefix-cache counter (vllm:prefix_cache_hits_total, or "
                   "vllm:gpu_prefix_cache_hits_total on vLLM 0.8-0.9.1, sglang:cached_tokens_total) showed cached prompt tokens no answer said: "
                   "their rows' "
                   "energy_note says approximate: prefix-cache-unsaid (a reused prompt over-charged, the "
                   "requests beside it under-charged); fix: " + CACHE_UNSAID_FIX),
    CACHE_LATE_FLAG: ("powerprof_requests_cache_late", "Requests whose rows' energy_note says approximate: "
                   "prefix-cache-late: a stream said its prompt's length early and its cached count only "
                   "at its end, after intervals over its prefill closed with its whole prompt costed as "
                   "computed (that request over-charged), or a request given energy of such intervals "
                   "beside it (under-charged); fix: " + CACHE_LATE_FIX),
    BEST_OF_FLAG: ("powerprof_requests_best_of_unseen", "Requests whose rows' energy_note says approximate: "
                   f"{BEST_OF_FLAG}: they asked vLLM V0 for best_of sequences beyond the n returned, whose tokens never "
                   "reached the proxy: their work is in the requests beside them and in unproxied, the flagged "
                   f"requests' figures low; fix: {BEST_OF_FIX}"),
    COUNT_OPEN_FLAG: ("powerprof_requests_count_open", "Requests whose rows' energy_note says approximate: "
                      f"{COUNT_OPEN_FLAG}: their count is the server's running count as of the last chunk that carried "
                      "one, no final count after (SGLang's chat stream with continuous_usage_stats alone): their "
                      f"generated_tokens may be low, those tokens' energy in unproxied; fix: {COUNT_OPEN_FIX}"),
    HELD_TAIL_FLAG: ("powerprof_requests_held_tail", "Requests whose rows' energy_note says approximate: "
                     f"{HELD_TAIL_FLAG}: a tool call the server's parser held, cut by max_tokens, put tokens in no "
                     "chunk: their count is the server's (kept in powerprof_joules_per_token), when they ran inferred "
                     f"(spread from the last chunk to the server's end); fix: {HELD_TAIL_FIX}"),
    GONE_PREFILL_FLAG: ("powerprof_requests_gone_prefill_beside", "Requests whose rows' energy_note says approximate: "
                        f"{GONE_PREFILL_FLAG}: part of their energy is from intervals over (or just after) a request "
                        "that ended before its first token, its prompt's length unsaid, whose prefill was costed at an estimate "
                        "from its body and may have been cut short, never run (queued) or run whole: their share there "
                        f"may be high or low (kept in powerprof_joules_per_token); fix: {GONE_PREFILL_FIX}"),
    PROMPT_UNREAD_FLAG: ("powerprof_requests_prompt_unread", "Requests whose rows' energy_note says approximate: "
                         f"{PROMPT_UNREAD_FLAG}: the proxy streamed their request body on unread (over its inspection "
                         "bound, or past its memory budget for reading bodies), or read it and found no prompt size in "
                         "it (an image or audio part, a shape not known), and the server never said the prompt's "
                         "length, their prefill not costed and their figures low; or they ran over such a prefill, "
                         f"their figures high; fix: {PROMPT_UNREAD_FIX}"),
    SERVING_ASSERTED_FLAG: ("powerprof_requests_serving_asserted", "Requests whose rows' energy_note says approximate: "
                            f"{SERVING_ASSERTED_FLAG}: part of their energy is from intervals split by the operator's "
                            "daemon.serving_gpus alone, the GPUs' power not agreeing yet: kept in "
                            "powerprof_joules_per_token as the operator's assumption; where it is wrong, each is off by "
                            f"a GPU's share; fix: {SERVING_ASSERTED_FIX}"),
    UNSURE_FLAG: ("powerprof_requests_uncertain_uncounted", "Requests whose rows' energy_note says "
                  f"{UNSURE_FLAG}: their figure may be high or low and nothing measured says which (a run-on after "
                  "their client left that a scrape finding the server down may have cut, nearly all of it too much if "
                  "it did; one placed to SGLang's abort whose answer may have ended by itself sooner; a whole answer of "
                  "n_cmpl beside n that never showed which its server ran): analyze leaves "
                  "them out of J/token; the fix: each row's note names it"),
}
OTHER = "other"
NONE = ""  # untagged: an empty label is no label in Prometheus, and NULL in Parquet


class TagLimiter:
    """Maps free-form client tags onto a bounded label set."""

    def __init__(self, allow: list[str] | None = None, max_tags: int = 20):
        self.allow = frozenset(allow or ())
        self.max_tags = max_tags
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def label(self, tag: str | None) -> str:
        if not tag:
            return NONE
        if self.allow:
            return tag if tag in self.allow else OTHER
        with self._lock:
            if tag in self._seen:
                return tag
            if len(self._seen) < self.max_tags:
                self._seen.add(tag)
                return tag
        return OTHER


@dataclass(frozen=True)
class GpuSnapshot:
    index: int
    uuid: str
    name: str
    power_w: float | None
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    power_limit_w: float | None
    energy_j: float  # accumulated by the daemon since it started
    up: float = 1.0  # 0 once NVML says the GPU is lost: its energy stops counting and its gauges go
    energy_unknown_s: float = 0.0  # seconds of closed intervals it gave no energy reading over (not in energy_j)
    energy_unread: bool = False  # the latest closed interval is one: energy_j stalls, and its series is left out
    serving: bool | None = None  # its energy is the work's (ledger.Totals.serving_mask); None: not said


@dataclass(frozen=True)
class Snapshot:
    gpus: tuple[GpuSnapshot, ...] = ()
    cpu_energy_j: float | None = None
    energy_by_kind_j: tuple = (0.0, 0.0, 0.0, 0.0)
    energy_by_dest_j: tuple = (0.0, 0.0, 0.0)  # requests, idle, unproxied
    tokens_closed: float = 0.0  # proxied tokens in closed intervals
    tokens_attributed: float = 0.0  # of which attributed to requests
    work_costs: dict = field(default_factory=dict)  # ledger.Ledger._costs_state
    joules_per_token: float | None = None
    tokens_by_tag: dict = field(default_factory=dict)
    requests_by_tag: dict = field(default_factory=dict)  # {(tag, outcome): n}
    count_contradictions: dict = field(default_factory=dict)  # {reason: n} (service.Daemon._count_contradicted)
    prompts_estimated: dict = field(default_factory=dict)  # {reason: n} (ledger.Ledger.prompts_estimated)
    uncounted_requests: dict = field(default_factory=dict)  # {kind: n} (streams.uncounted_kind)
    server_tokens: float | None = None
    server_tokens_partial: tuple = ()  # why that count may be low (scrape.PARTIAL_REASONS keys)
    buffered_rows: int = 0
    dropped_rows: int = 0
    dropped_not_forwarded_rows: int = 0
    flush_errors: int = 0
    quarantined_rows: int = 0
    buffer_cap_rows: int = 0
    writer_up: bool = True
    writer_errors: int = 0
    writer_beat_age_s: float = 0.0
    proxy_recorder_failures: int = 0
    proxy_upstream_failures: int = 0
    proxy_upstream_retries: int = 0  # requests sent again on a new connection: the kept-alive one had been closed
    proxy_active: int = 0
    proxy_records_dropped: int = 0  # proxy workers' records not shipped (the daemon did not read)
    proxy_body_timeouts: dict = field(default_factory=dict)  # rule (silent, slow) → request bodies answered 408
    proxy_uninspected_bodies: int = 0  # bodies up to 1 MiB streamed on uninspected, over the inspection budget
    proxy_body_reader_failures: int = 0  # Proxy.proxy_failures: its own faults reading a request body (a bug)
    proxy_lost_unforwarded: int = 0  # requests not yet forwarded in a proxy worker that died (no row)
    proxy_malformed_requests: int = 0  # rejected by aiohttp's parser (400), this process's and the workers'
    proxy_worker_restarts: dict = field(default_factory=dict)  # reason → count (proxy.workers > 1)
    proxy_workers_unread: int = 0  # workers serving whose records the daemon cannot read (an upgrade under it)
    late_tokens: float = 0.0  # stamped before an interval already closed: not attributed
    latency: dict = field(default_factory=dict)  # name → latency.HistogramState
    inflight: InFlightState | None = None  # recorded requests in flight / awaiting a first token, with integrals
    sources: dict = field(default_factory=dict)  # source → (reads, read CPU s, missed ticks, errors)
    edge_reads: int = 0
    edge_read_cpu_s: float = 0.0
    other_cpu_pct: float | None = None  # ledger.Totals: other processes' share of busy CPU time, latest judged interval
    busy_host_requests_cpu_j: float = 0.0  # CPU energy given to requests in busy-host intervals since start
    cpu_unknown_requests: int = 0  # ledger.Totals: request rows without cpu_energy_j though RAPL is read, since start
    flagged_requests: dict = field(default_factory=dict)  # ledger.Totals: {flag: request rows saying it} (FLAG_COUNTERS)
    accounts_behind_s: float | None = None  # now − the end of the latest closed interval (None: none yet)
    jpt_left_out: dict = field(default_factory=dict)  # ledger.Totals: {flag: (intervals, tokens)} left out of J/token
    gpu_unknown_intervals: int = 0  # ledger.Totals: intervals in no kind of energy_by_kind_j (a GPU unread there)
    idle_unknown_intervals: int = 0  # ledger.Totals: intervals with a GPU serving none of the work unread (its energy alone out)
    intervals: int = 0  # ledger.Totals: intervals closed since start (what the *_unknown_intervals are out of)
    idle_not_serving_j: float = 0.0  # ledger.Totals: of the idle energy, the GPUs' serving none of the work
    serving_changes: int = 0  # ledger.Totals: changes of which GPUs' energy is the work's
    serving_asserted: bool = False  # ledger.Totals: powerprof_gpu_serving is daemon.serving_gpus's word, unconfirmed


class SnapshotCollector:
    """Reads `holder.snapshot` (replaced whole by the daemon, never mutated) at scrape time."""

    def __init__(self, holder):
        self.holder = holder

    def collect(self):
        s: Snapshot = self.holder.snapshot
        labels = ["gpu", "gpu_uuid", "gpu_name"]

        def gauge(name, doc, unit_scale, attr):
            g = GaugeMetricFamily(name, doc, labels=labels)
            for x in s.gpus:
                v = getattr(x, attr)
                if v is not None:
                    g.add_metric([str(x.index), x.uuid, x.name], v * unit_scale)
            return g

        yield gauge("powerprof_gpu_power_watts", "GPU board power (instant where supported)", 1.0, "power_w")
        yield gauge("powerprof_gpu_sm_clock_hertz", "GPU SM clock", 1e6, "sm_clock_mhz")
        yield gauge("powerprof_gpu_mem_clock_hertz", "GPU memory clock", 1e6, "mem_clock_mhz")
        yield gauge("powerprof_gpu_power_limit_watts", "GPU power management limit", 1.0, "power_limit_w")
        yield gauge("powerprof_gpu_up", "1 while the GPU answers NVML, 0 once it is lost (fell off the bus): its "
                    "energy stops counting and intervals lose their GPU energy", 1.0, "up")
        # A GPU unread over the latest closed interval has no series: its counter would stand still, and a rate() read
        # 0 W for a GPU drawing hundreds (a value never measured, as an exporter leaves out a sensor it cannot read).
        # It comes back with its count where it stopped (no reset); the time it missed is counted beside it. Absence
        # does not make a rate() right: Prometheus extrapolates the increase between a range's first and last samples
        # over the whole range, so any range overlapping the gap reads low (a 60 s gap of a 300 W GPU: rate[5m] reads
        # 237 W for 5 minutes, the series absent or not); the help says so and how to leave such a range out.
        c = CounterMetricFamily("powerprof_gpu_energy_joules", "GPU energy since the daemon started, over the closed "
                                "intervals it gave a reading over; absent while it gives none (lost, reads failing), "
                                "and its energy then is in no sample: a rate() over any range overlapping that time "
                                "reads low by the share unread (the series there or not), so leave out the GPUs whose "
                                "powerprof_gpu_energy_unknown_seconds_total rose over the same range", labels=labels)
        for x in s.gpus:
            if not x.energy_unread:
                c.add_metric([str(x.index), x.uuid, x.name], x.energy_j)
        yield c
        u = CounterMetricFamily("powerprof_gpu_energy_unknown_seconds", "Seconds of closed intervals this GPU gave no "
                                "energy reading over (lost, reads failing), since the daemon started: their energy is "
                                "in no powerprof_gpu_energy_joules_total, so its rate() over a range holding them reads "
                                "low; its own rate() is the share of the time unread, and can exceed 1 over a range "
                                "shorter than the accounts' batches (intervals close several at a time); the samples' "
                                "error column and the daemon's log say why", labels=labels)
        for x in s.gpus:
            u.add_metric([str(x.index), x.uuid, x.name], x.energy_unknown_s)
        yield u
        sv = GaugeMetricFamily("powerprof_gpu_serving", "1 while this GPU's energy is the serving GPUs' (the proxied "
                               "work's, the tuner's), 0 while it serves none of the work (its energy all idle, in "
                               "powerprof_gpu_idle_energy_not_serving_joules_total): which GPUs each "
                               "powerprof_gpu_serving_changes_total moved; absent while the daemon does not know "
                               f"which of several GPUs serve (every GPU's energy the work's, reason {GPUS_UNDECIDED_REASON} "
                               "below)", labels=labels)
        for x in s.gpus:
            if x.serving is not None:
                sv.add_metric([str(x.index), x.uuid, x.name], 1.0 if x.serving else 0.0)
        yield sv
        yield GaugeMetricFamily("powerprof_gpu_serving_asserted", "1 while powerprof_gpu_serving is the operator's "
                                "daemon.serving_gpus alone, the GPUs' power not agreeing yet (an even load may never let "
                                "it judge): the requests split meanwhile say "
                                f"{SERVING_ASSERTED_FLAG} (powerprof_requests_serving_asserted_total) and stay in "
                                "powerprof_joules_per_token; 0 otherwise", value=1.0 if s.serving_asserted else 0.0)
        if s.cpu_energy_j is not None:
            yield CounterMetricFamily("powerprof_cpu_energy_joules", "CPU package+DRAM energy (RAPL) of the whole host, every process, since start",
                                      value=s.cpu_energy_j)
        if s.other_cpu_pct is not None:
            yield GaugeMetricFamily("powerprof_other_processes_cpu_ratio",
                                    "Share of the host's busy CPU time used by processes other than the inference "
                                    "server's and powerprof's, latest closed interval with work (RAPL's CPU energy "
                                    "includes theirs; above 0.1 the interval is busy-host)", value=s.other_cpu_pct / 100.0)
        if s.cpu_energy_j is not None:
            yield CounterMetricFamily("powerprof_requests_cpu_energy_busy_host_joules",
                                      "CPU energy given to requests in intervals where other processes used over 10% of "
                                      "the host's busy CPU time (busy-host: it includes theirs)",
                                      value=s.busy_host_requests_cpu_j)
            yield CounterMetricFamily("powerprof_requests_cpu_energy_unknown",
                                      "Requests with GPU energy but no cpu_energy_j: no RAPL read covered part of their "
                                      "intervals (a dropped delta, reads failing or periods late); their rows' "
                                      "energy_note says why, with the fix", value=s.cpu_unknown_requests)
        k = CounterMetricFamily("powerprof_gpu_interval_energy_joules",
                                "GPU energy by interval kind (idle, decode, prefill, unproxied)", labels=["kind"])
        for name, v in zip(KIND_NAMES, s.energy_by_kind_j):
            k.add_metric([name], v)
        yield k
        yield CounterMetricFamily("powerprof_gpu_energy_unknown_intervals",
                                  "Intervals left out of the energy by interval kind: a GPU serving the proxied work "
                                  "(any, before which serve is judged) gave no energy reading there, their total unknown "
                                  "(their rows' gpu_energy_j is empty, the note says why)",
                                  value=s.gpu_unknown_intervals)
        yield CounterMetricFamily("powerprof_intervals", "Intervals the daemon closed (accounted) since it started: "
                                  "what the *_unknown_intervals_total counters are counted out of", value=s.intervals)
        d = CounterMetricFamily("powerprof_gpu_energy_attributed_joules",
                                "GPU energy by where it went: requests (by their work), idle, unproxied", labels=["to"])
        for name, v in zip(DEST_NAMES, s.energy_by_dest_j):
            d.add_metric([name], v)
        yield d
        yield CounterMetricFamily("powerprof_gpu_idle_energy_unknown_intervals",
                                  "Intervals where a GPU serving none of the proxied work gave no energy reading: in "
                                  "the totals with every read GPU's energy, the unread GPU's alone out (their rows' "
                                  "idle_energy_j is empty, the note names it)",
                                  value=s.idle_unknown_intervals)
        yield CounterMetricFamily("powerprof_gpu_idle_energy_not_serving_joules",
                                  "Of powerprof_gpu_energy_attributed_joules_total{to=\"idle\"}, the energy of the GPUs "
                                  "serving none of the proxied work (all of theirs is idle; an unread one's is in "
                                  "neither): the idle energy less it is the serving GPUs', whether or not those others "
                                  "read (the tuner's energy)", value=s.idle_not_serving_j)
        yield CounterMetricFamily("powerprof_gpu_serving_changes",
                                  "Times the daemon changed which GPUs serve the proxied work (the first judgement of "
                                  "which serve, and each later change): each moves a GPU's idle energy into or out of "
                                  "the serving GPUs' energy, so figures on its two sides are on different bases (the "
                                  "tuner leaves the window holding one out)", value=s.serving_changes)
        total = sum(s.energy_by_dest_j)
        if total > 0:
            yield GaugeMetricFamily("powerprof_requests_energy_ratio",
                                    "Share of GPU energy since start given to proxied requests", value=s.energy_by_dest_j[0] / total)
        if s.tokens_closed > 0:
            yield GaugeMetricFamily("powerprof_attributed_tokens_ratio",
                                    "Share of proxied tokens (closed intervals) attributed to requests",
                                    value=s.tokens_attributed / s.tokens_closed)
        wc = s.work_costs or {}
        if wc:
            yield GaugeMetricFamily("powerprof_work_model_fitted",
                                    "1 when the learned costs split intervals, 0 while the fixed ratio does",
                                    value=1.0 if wc.get("source") == "fitted" else 0.0)
            g = GaugeMetricFamily("powerprof_work_cost_joules", "Learned GPU energy per unit of work", labels=["work"])
            for key, name in (("step_j", "step"), ("decode_j", "decode_token")):
                if wc.get(key) is not None:
                    g.add_metric([name], wc[key])
            yield g
            for key, name, doc in (
                ("prefill_per_decode", "powerprof_work_prefill_per_decode_ratio", "Cost of a prompt token over a decoded token (in use)"),
                ("idle_w", "powerprof_idle_power_watts", "Idle GPU power the work model uses"),
                ("r2", "powerprof_work_model_r_squared", "R² of the latest cost fit over busy intervals"),
            ):
                if wc.get(key) is not None:
                    yield GaugeMetricFamily(name, doc, value=wc[key])
        t = CounterMetricFamily("powerprof_tokens_generated", "Tokens generated through the proxy", labels=["tag"])
        for tag, v in sorted(s.tokens_by_tag.items()):
            t.add_metric([tag], v)
        yield t
        r = CounterMetricFamily("powerprof_requests", "Requests through the proxy", labels=["tag", "outcome"])
        for (tag, outcome), v in sorted(s.requests_by_tag.items()):
            r.add_metric([tag, outcome], v)
        yield r
        cc = CounterMetricFamily("powerprof_requests_token_count_contradicted", "Requests whose server's own token "
                                 "count contradicts the stream it sent (stream_above_count: the stream carried more; "
                                 "running_count_short: the final count is above the running count its chunks carried; "
                                 "first_choice_only: a whole answer of several choices counted its first alone): "
                                 "their rows have no generated_tokens or J/token", labels=["reason"])
        for reason in COUNT_PROBLEM_KINDS:
            cc.add_metric([reason], s.count_contradictions.get(reason, 0))
        yield cc
        pe = CounterMetricFamily("powerprof_requests_prompt_estimated", "Requests whose prompt length the server never "
                                 "said, costed at an estimate from the request body (client_left: the client left before "
                                 "the usage; no_usage: the stream carried none; not_yet: unsaid 30 s after arrival; "
                                 "before_first_token: it ended before its first token, its prefill bounded by its time in "
                                 "flight): their rows' energy_note says so", labels=["reason"])
        for reason in ("client_left", "no_usage", "not_yet", "before_first_token"):
            pe.add_metric([reason], s.prompts_estimated.get(reason, 0))
        yield pe
        uc = CounterMetricFamily("powerprof_requests_uncounted", "Requests of GPU work whose tokens the proxy does not "
                                 "read (embeddings whose answer gave no usage.prompt_tokens, rerank, audio, images, other: "
                                 "an endpoint that is not a generation API it parses): their energy is in the shares of "
                                 "the counted requests beside them, whose rows' energy_note says so", labels=["kind"])
        for kind in UNCOUNTED_KINDS:
            uc.add_metric([kind], s.uncounted_requests.get(kind, 0))
        yield uc
        for flag, (name, doc) in FLAG_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=(s.flagged_requests or {}).get(flag, 0))
        if s.joules_per_token is not None:
            yield GaugeMetricFamily("powerprof_joules_per_token",
                                    "Requests' GPU J per generated token over the intervals with tokens of the last "
                                    "metrics.jpt_window_s, leaving out intervals without an energy counter that "
                                    "requests were live in for under half their time (no-counter-short) and intervals "
                                    "whose server token count may be low (or high: proxy_lag, server_restart) or was not "
                                    "read (bypass-uncounted: bypass traffic's energy may be in the requests', or theirs "
                                    "in unproxied; the rule analyze leaves such requests out "
                                    "by) and intervals after a client's leave from a server whose kind the daemon does "
                                    "not know, beside a whole answer still in flight past the daemon's hold, or beside "
                                    f"a batch answered 400, scraping none ({UNSURE_FLAG}: a run-on for nobody or that "
                                    "answer's decode may be in the requests' share; fix: set scrape.server); "
                                    "powerprof_joules_per_token_left_out_* "
                                    "count them; absent when none is left",
                                    value=s.joules_per_token)
        lo_iv = CounterMetricFamily("powerprof_joules_per_token_left_out_intervals", "Intervals with tokens left out of "
                                    "powerprof_joules_per_token since start, by reason: no-counter-short (no energy "
                                    "counter, mostly idle: fix: " + NO_COUNTER_SHORT_FIX + "), bypass-uncounted (their "
                                    "server_count says the bypass count may be low (or high: proxy_lag, server_restart) or "
                                    "unread: "
                                    f"the interval rows say why), {UNSURE_FLAG} (work that is no live request's own "
                                    "may be in their shares: after a client's leave, the server's kind unknown; beside "
                                    "a whole answer still in flight past the daemon's hold for its intervals, or a batch "
                                    "answered 400 that may run on, no server counter read (scrape.server = none); a "
                                    "run-on for nobody not placed whole; idle power not measured yet; the request rows say "
                                    "which), "
                                    f"{GPUS_UNDECIDED_REASON} (split before the daemon knew which of several GPUs serve: "
                                    "every GPU's energy the work's; the log says why and the fix)", labels=["reason"])
        lo_tok = CounterMetricFamily("powerprof_joules_per_token_left_out_tokens", "Proxied tokens of the intervals "
                                     "left out of powerprof_joules_per_token since start, by reason (as "
                                     "powerprof_joules_per_token_left_out_intervals_total)", labels=["reason"])
        for flag in (NO_COUNTER_SHORT_FLAG, BYPASS_LOW_FLAG, UNSURE_FLAG, GPUS_UNDECIDED_REASON):
            n_iv, n_tok = s.jpt_left_out.get(flag, (0, 0.0))
            lo_iv.add_metric([flag], n_iv)
            lo_tok.add_metric([flag], n_tok)
        yield lo_iv
        yield lo_tok
        if s.server_tokens is not None:
            yield CounterMetricFamily("powerprof_server_tokens_generated",
                                      "Tokens the server's own metrics counted (cross-check)", value=s.server_tokens)
            part = GaugeMetricFamily("powerprof_server_tokens_partial", "1: powerprof_server_tokens_generated_total may be "
                                     "low (bypass traffic it misses is not in unproxied energy), for this reason (late_baseline: first read after the daemon's ready, with "
                                     f"tokens already counted; {SERVER_COUNT_SLOTS_ONLY}: llama-server without --metrics; server_restart: "
                                     "the server restarted, its last tokens before it lost; counter_below: the counter stayed below its highest "
                                     "reading, two dips in a row or a restart not told, or a young counter fell and was back at it by the next "
                                     "read, a dip or a restart not told; fall_unconfirmed: after a restart told by the counter's fall alone, "
                                     "a dip's recovery may be counted again, may be low or high); the log says what was missed "
                                     "and the fix, and the interval rows concerned say so in server_count", labels=["reason"])
            for why in PARTIAL_REASONS:
                part.add_metric([why], 1 if why in s.server_tokens_partial else 0)
            yield part
        yield GaugeMetricFamily("powerprof_buffered_rows", "Rows waiting to be written to Parquet", value=s.buffered_rows)
        yield CounterMetricFamily("powerprof_dropped_rows", "Rows dropped from the write buffer past "
                                  "powerprof_buffer_cap_rows: writes kept failing, or rows came faster than flushed",
                                  value=s.dropped_rows)
        yield CounterMetricFamily("powerprof_dropped_not_forwarded_rows", "Rows of requests the proxy answered "
                                  "without forwarding (no energy) dropped from the write buffer: past their quarter of "
                                  "it, or first where the buffer is full; they never push out a row with energy", value=s.dropped_not_forwarded_rows)
        yield CounterMetricFamily("powerprof_flush_errors", "Failed Parquet writes (disk errors and rows a column "
                                  "cannot hold)", value=s.flush_errors)
        yield CounterMetricFamily("powerprof_quarantined_rows", "Rows that could not be stored, kept as JSON lines in "
                                  "<data_dir>/_quarantine", value=s.quarantined_rows)
        yield GaugeMetricFamily("powerprof_buffer_cap_rows", "Rows kept per dataset while writes fail; older ones are "
                                "dropped (powerprof_dropped_rows_total)", value=s.buffer_cap_rows)
        yield GaugeMetricFamily("powerprof_writer_up", "1 while the Parquet writer thread runs and is not stuck",
                                value=1 if s.writer_up else 0)
        yield CounterMetricFamily("powerprof_writer_errors", "Exceptions the writer thread caught and survived",
                                  value=s.writer_errors)
        yield GaugeMetricFamily("powerprof_writer_heartbeat_age_seconds", "Seconds since the writer thread's loop "
                                "last turned", value=s.writer_beat_age_s)
        yield CounterMetricFamily("powerprof_proxy_recorder_failures",
                                  "Requests whose recording failed (traffic unaffected)", value=s.proxy_recorder_failures)
        yield CounterMetricFamily("powerprof_proxy_upstream_failures", "Upstream unreachable (502 sent)",
                                  value=s.proxy_upstream_failures)
        yield CounterMetricFamily("powerprof_proxy_upstream_retries", "Requests sent again on a new connection: "
                                  "the server had closed the kept-alive one before answering (never began them)",
                                  value=s.proxy_upstream_retries)
        yield GaugeMetricFamily("powerprof_proxy_active_requests", "Requests in flight", value=s.proxy_active)
        bt = CounterMetricFamily("powerprof_proxy_body_timeouts", "Request bodies answered 408: silent for "
                                 "proxy.body_timeout_s, or slower than proxy.body_min_bytes_per_s", labels=["rule"])
        for rule in ("silent", "slow"):
            bt.add_metric([rule], (s.proxy_body_timeouts or {}).get(rule, 0))
        yield bt
        yield CounterMetricFamily("powerprof_proxy_uninspected_bodies", "Request bodies up to 1 MiB streamed on "
                                  "uninspected: the inspection budget (32 MiB of bodies read whole at once) was full; "
                                  "their rows' model and stream unknown, their prompt unread", value=s.proxy_uninspected_bodies)
        yield CounterMetricFamily("powerprof_proxy_body_reader_failures", "Request bodies the proxy's own reader "
                                  "failed on (a bug: report the daemon log's traceback): streamed on unread, or "
                                  "answered 500 where bytes were lost; their rows say so", value=s.proxy_body_reader_failures)
        yield CounterMetricFamily("powerprof_proxy_lost_unforwarded_requests", "Requests a proxy worker had not "
                                  "forwarded yet (their bodies still coming) when it died: no row, as of its last "
                                  "heartbeat", value=s.proxy_lost_unforwarded)
        yield CounterMetricFamily("powerprof_proxy_malformed_requests", "Requests the HTTP parser rejected with 400 "
                                  "(Content-Length with Transfer-Encoding, obs-fold, control characters...), never "
                                  "forwarded: the proxy's, its workers' and /metrics'", value=s.proxy_malformed_requests)
        if s.inflight is not None:
            q = s.inflight
            yield GaugeMetricFamily("powerprof_requests_in_flight", "Proxied generation requests started and "
                                    "not ended (as recorded)", value=q.in_flight)
            yield GaugeMetricFamily("powerprof_requests_awaiting_first_token", "Proxied requests in flight with no "
                                    "token seen yet (queued, in prefill, or a non-streamed answer)", value=q.awaiting_first)
            yield CounterMetricFamily("powerprof_requests_in_flight_seconds", "Time integral of "
                                      "powerprof_requests_in_flight (request-seconds)", value=q.in_flight_s)
            yield CounterMetricFamily("powerprof_requests_awaiting_first_token_seconds", "Time integral of "
                                      "powerprof_requests_awaiting_first_token (request-seconds)", value=q.awaiting_first_s)
            yield CounterMetricFamily("powerprof_requests_queue_clock_seconds", "The time those two integrals span: "
                                      "their differences over this one's are exact means", value=q.clock_s)
            yield GaugeMetricFamily("powerprof_requests_oldest_awaiting_first_token_seconds", "Age of the oldest "
                                    "streamed request still awaiting its first token (0: none)", value=q.oldest_awaiting_s)
            yield GaugeMetricFamily("powerprof_requests_longest_stream_silence_seconds", "Longest time since the last "
                                    "token of a streamed request past its first (0: none)", value=q.longest_silence_s)
        if s.accounts_behind_s is not None:
            yield GaugeMetricFamily("powerprof_accounts_behind_seconds", "How far the energy accounts (closed "
                                    "intervals: every energy counter, powerprof_gpu_energy_joules included) are behind now: "
                                    "the grace, the holds (prompt lengths, the server's counter, RAPL) and a late "
                                    "sampler; the token and request counters are not behind", value=s.accounts_behind_s)
        yield CounterMetricFamily("powerprof_proxy_records_dropped", "Proxy workers' records not shipped because "
                                  "the daemon did not read (their requests' rows say so)", value=s.proxy_records_dropped)
        yield CounterMetricFamily("powerprof_tokens_late", "Proxied tokens read after their interval had closed, "
                                  "not attributed (their requests' rows say so)", value=s.late_tokens)
        restarts = CounterMetricFamily("powerprof_proxy_worker_restarts", "Proxy workers restarted: exited, or "
                                       "killed after sending nothing for 10 s (silent)", labels=["reason"])
        for reason, n in sorted(s.proxy_worker_restarts.items()):
            restarts.add_metric([reason], n)
        yield restarts
        yield GaugeMetricFamily("powerprof_proxy_workers_unread", "Proxy workers serving the port whose records the "
                                "daemon cannot read (powerprof upgraded under it): their requests are forwarded but not "
                                "attributed, their energy bypass traffic's where the server's token count is complete, else idle "
                                "(the intervals' server_count says proxy_unread); a live tuner refuses the figures "
                                "while above 0 (fix: restart the daemon)",
                                value=s.proxy_workers_unread)
        for name, idx, doc in (
            ("powerprof_sample_reads", 0, "Full reads of each sensor source (ticks and tag-API edges; "
             "request edges are powerprof_edge_reads)"),
            ("powerprof_sample_read_cpu_seconds", 1, "CPU this process spent reading each source (a real H200's "
             "energy counter costs ~3 ms a read)"),
            ("powerprof_sample_missed", 2, "Ticks lost because a source's read overran its period"),
            ("powerprof_sample_errors", 3, "Reads of a source that failed (the sample is missing)"),
        ):
            c = CounterMetricFamily(name, doc, labels=["source"])
            for source, v in sorted(s.sources.items()):
                c.add_metric([source], v[idx])
            yield c
        yield CounterMetricFamily("powerprof_edge_reads", "Energy-counter reads done at short requests' own edges",
                                  value=s.edge_reads)
        yield CounterMetricFamily("powerprof_edge_read_cpu_seconds", "CPU those edge reads cost "
                                  "(attribution.edge_cpu_share bounds it)", value=s.edge_read_cpu_s)
        for name, h in sorted((s.latency or {}).items()):
            cum, buckets = 0, []
            for edge, n in zip(h.edges, h.counts):
                cum += n
                buckets.append((repr(float(edge)), cum))
            buckets.append(("+Inf", h.n))
            yield HistogramMetricFamily(f"powerprof_request_{name}", LATENCY_DOCS[name], buckets=buckets, sum_value=h.total)
        yield build_info(getattr(self.holder, "host", None), getattr(self.holder, "simulated", False))


def build_info(host: str | None = None, simulated: bool = False) -> GaugeMetricFamily:
    """host: the name the daemon's Parquet rows carry (daemon.host); default the host name. simulated: the GPUs are
    powerprof's simulator (`daemon --simulate`): a dashboard beside real hosts' must be able to tell."""
    b = GaugeMetricFamily("powerprof_build_info", "powerprof version, Python, host and whether its GPUs are simulated "
                          "(always 1)", labels=["version", "python", "host", "simulated"])
    b.add_metric([__version__, platform.python_version(), host or socket.gethostname(), "true" if simulated else "false"], 1)
    return b


def make_registry(holder) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(holder))
    ProcessCollector(registry=reg)
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
