"""Parquet schemas of every table powerprof writes: one place, units in every column name.

docs/data.md documents each column; tests/test_schema_docs.py keeps the two in step.
Tables only grow by appending nullable columns, so old files stay readable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

# Column types by name: declaring them needs no pyarrow, so the daemon writes these tables without
# loading it (storage/flatparquet.py); `arrow_schema` turns a column list into a pa.Schema.
TS, F64, I64, I32, STR, BOOL = "timestamp[us, tz=UTC]", "float64", "int64", "int32", "string", "bool"

# One row per device per sample (GPU, CPU package/DRAM zone, or host).
SAMPLES_COLUMNS = [
    ("time_utc", TS),
    ("t_mono_s", F64),  # monotonic seconds since the run's start: use for arithmetic
    ("seq", I64),  # tick number; -1 for on-demand samples at window edges
    ("label", STR),  # on-demand samples: the window edge that asked for it
    ("source", STR),  # nvml | rapl | host
    ("device", STR),  # gpu0, package-0, dram-0, psys, host
    ("gpu_index", I32),
    ("gpu_uuid", STR),
    ("power_w", F64),  # GPU instant power / RAPL power over the last interval
    ("power_avg_w", F64),  # GPU 1 s trailing average (nvmlDeviceGetPowerUsage)
    ("energy_j", F64),  # cumulative: GPU driver counter; RAPL wrap-corrected since start
    ("sm_clock_mhz", F64),
    ("mem_clock_mhz", F64),
    ("gpu_util_pct", F64),
    ("mem_util_pct", F64),
    ("mem_used_bytes", I64),
    ("temperature_c", F64),
    ("power_limit_w", F64),
    ("enforced_limit_w", F64),
    ("clock_event_reasons", I64),
    ("cpu_util_pct", F64),
    ("cpu_freq_mhz", F64),
    ("host_mem_used_bytes", I64),
    ("level_kind", STR),  # power_limit | sm_clock | idle | null outside a sweep level
    ("level_value", F64),  # W for power_limit, MHz for sm_clock
    ("error", STR),  # why a reading is missing
    ("energy_t_mono_s", F64),  # GPU rows: when energy_j itself was read (its own driver call), same clock as t_mono_s
    # cputime rows (collectors/cputime.py): cumulative CPU seconds, all cores
    ("host_cpu_busy_s", F64),  # the whole host: user + nice + system, since boot
    ("server_cpu_s", F64),  # the inference server's processes; null: not found (error says why)
    ("powerprof_cpu_s", F64),  # powerprof's own process; null when the server runs inside it
]

# One row per request: its decode window and the energy measured over it.
WINDOWS_COLUMNS = [
    ("run_id", STR),
    ("level_kind", STR),  # power_limit | sm_clock | none (measure)
    ("level_value", F64),
    ("repeat", I32),
    ("window_kind", STR),  # request: one request's decode; batch: a concurrent batch's measured intervals; trace: a replayed trace
    ("request_id", I64),  # null for batch rows
    ("batch_id", I64),  # requests sent together at one concurrency  # requests sent together at one concurrency
    ("concurrency", I32),
    ("warmup", BOOL),
    ("status", STR),  # ok | failed
    ("error", STR),
    ("api", STR),  # llamacpp | openai-completions | openai-chat
    ("model", STR),
    ("prompt_id", STR),
    ("t_send_utc", TS),
    ("t_first_utc", TS),  # first generated token arrived
    ("t_last_utc", TS),  # last generated token arrived
    ("ttft_s", F64),
    ("decode_s", F64),  # t_last - t_first, monotonic clock
    ("prompt_tokens", I32),
    ("generated_tokens", I32),
    ("decode_tokens", I32),  # generated - 1: the first token comes out of prefill
    ("decode_tok_s", F64),  # decode_tokens / decode_s
    ("gpu_energy_j", F64),  # over the decode window, all GPUs of the run
    ("cpu_energy_j", F64),  # RAPL package (+DRAM) over the same window
    ("energy_method", STR),  # counter | power_integration | none
    ("avg_gpu_power_w", F64),
    ("gpu_j_per_token", F64),
    ("total_j_per_token", F64),  # GPU + CPU
    ("idle_gpu_power_w", F64),  # baseline before the sweep, for above-idle figures
    ("above_idle_gpu_j_per_token", F64),
    ("server_prompt_n", I32),
    ("server_predicted_n", I32),
    ("server_prompt_ms", F64),
    ("server_predicted_ms", F64),
    ("server_predicted_per_second", F64),
    ("draft_n", I32),
    ("draft_n_accepted", I32),
    ("stop_reason", STR),
    ("low_confidence", BOOL),  # window shorter than the sensor can resolve well
    ("attempt", I32),  # 1 for a first try; retries of the same request count up
    ("http_status", I32),
    ("token_source", STR),  # usage | timings | counted: where generated_tokens came from
    ("server_kind", STR),  # llamacpp | vllm | sglang | tgi | openai
    ("prompt_text", STR),  # only with --keep-text
    ("completion_text", STR),  # only with --keep-text
    # Appended by issue 10: how the tokens arrived and how the window is timed.
    ("timing", STR),  # how the window's figures are timed: stream, server, untrusted
    ("timing_reason", STR),  # why the window is not stream-timed
    ("stream_decode_s", F64),  # s: last read − first read as the stream saw it
    ("stream_decode_tok_s", F64),  # tokens/s: tokens after the first read ÷ stream_decode_s, whatever the timing use
    ("stream_error_bound_pct", F64),  # %: estimated error of the stream rate from stale edge reads and client la
    ("n_reads", I32),  # reads: distinct socket reads that carried tokens
    ("n_token_events", I32),  # events: server events that carried tokens
    ("max_read_share", F64),  # fraction: largest share of the generated tokens that arrived in one read
    ("max_events_per_read", I32),  # events: most server events that arrived in one read
    ("read_gap_p50_s", F64),  # s: median gap between consecutive token-bearing reads
    ("read_gap_max_s", F64),  # s: largest gap between consecutive token-bearing reads
    ("client_lag_edge_s", F64),  # s: worst lateness of the client's event loop at the window edges
    ("client_lag_max_s", F64),  # s: worst lateness of the client's event loop during the window
    ("server_decode_s", F64),  # s: the server's own decode time of this request
    ("server_decode_tokens", I32),  # tokens: decode tokens the server's decode time covers
    ("server_decode_tok_s", F64),  # tokens/s: server_decode_tokens / server_decode_s
    ("server_timing_source", STR),  # llamacpp-timings or vllm-metrics
    ("stream_vs_server_pct", F64),  # %: stream rate ÷ server rate − 1, when both exist
    ("truncated", STR),  # the generation stopped short of max_tokens at the context length: how 
    # Appended by configuration sweeps (--vary, --context-tokens); each knob also gets a
    # knob_<name> column (see KNOB_PREFIX).
    ("config_id", STR),  # the server configuration: "draft=3,np=2"
    ("context_tokens", I32),  # the context length the prompt was built to (--context-tokens)
    # Whose CPU time the host spent during the window (collectors/cputime.py), CPU seconds over all cores:
    # RAPL's CPU energy is the whole package's, every process's.
    ("host_cpu_s", F64),  # the whole host's busy CPU time
    ("other_cpu_s", F64),  # of it, processes other than the server's and powerprof's; null: server not found
    ("powerprof_cpu_s", F64),  # of it, powerprof's own (the measuring tool); null when the server runs inside it
    # Others' work beside the window (sweep): what showed it (the server's counters, another process on the GPU);
    # such a window has no figures and counts in none (levels flag foreign-traffic). Null: none seen.
    ("foreign_traffic", STR),
    # The concurrency a batch achieved: its streams decoding at once, time-weighted over its measured intervals
    # (workload/rows.py: under 95% of its streams, the batch has no figure). Null for request and trace rows.
    ("mean_streams", F64),
    # Request rows: another request's window overlaps this one's (concurrency > 1, a replayed trace), so its
    # gpu_energy_j is the GPU's over work shared with them (never summed) and its J/token is null.
    ("shared_window", BOOL),
]

# One row per level (and repeat pooled): what the user reads.
LEVELS_COLUMNS = [
    ("run_id", STR),
    ("level_kind", STR),
    ("level_value", F64),
    ("requested_limit_w", F64),
    ("enforced_limit_w", F64),
    ("locked_sm_clock_mhz", F64),
    ("n_requests", I32),
    ("n_failed", I32),
    ("decode_tok_s", F64),  # median over requests (concurrency 1) or wall-clock aggregate
    ("decode_tok_s_ci_low", F64),
    ("decode_tok_s_ci_high", F64),
    ("gpu_j_per_token", F64),
    ("gpu_j_per_token_ci_low", F64),
    ("gpu_j_per_token_ci_high", F64),
    ("total_j_per_token", F64),
    ("above_idle_gpu_j_per_token", F64),
    ("ci_reached_pct", F64),  # half-width of the J/token 95% CI, % of the median
    ("speed_loss_pct", F64),  # vs the reference level
    ("energy_saving_pct", F64),
    ("avg_gpu_power_w", F64),
    ("avg_cpu_power_w", F64),
    ("sm_clock_mhz", F64),
    ("mem_clock_mhz", F64),
    ("reference", BOOL),
    ("cap_not_engaged", BOOL),
    ("thermal_throttle", BOOL),
    # comma-separated: cap-not-engaged, cap-partly-engaged, thermal, failed-requests, wide-ci, one-window, few-windows, no-measured-windows, energy-resolution, short-windows, server-restarted, server-away, interrupted, busy-host, foreign-traffic, no-busy-reading
    ("flags", STR),
    ("energy_method", STR),
    # Appended by the analysis (issue 6): levels at different concurrencies are different levels,
    # and loss/saving vs the reference carry their own bootstrap CIs.
    ("concurrency", I32),
    ("speed_loss_pct_ci_low", F64),
    ("speed_loss_pct_ci_high", F64),
    ("energy_saving_pct_ci_low", F64),
    ("energy_saving_pct_ci_high", F64),
    # Appended by the sweep: why measuring the level stopped (ci-reached | max-time |
    # max-requests | no-energy | paired-ci-reached), so advice can name the knob that would have helped.
    ("stop_rule", STR),
    # Distinct prompts among the measured requests: with fewer prompts than requests, rounds
    # repeat them, and more rounds say more about these prompts only (the wide-ci advice).
    ("n_prompts", I32),
    # Appended by configuration sweeps (--vary, --context-tokens), with a knob_<name> column per knob.
    ("config_id", STR),
    ("config_status", STR),  # ok | out-of-memory | failed-to-start | failed
    ("config_error", STR),  # why a configuration was not measured: the message and the server log's tail
    ("context_tokens", I32),
    ("draft_n", I64),  # draft tokens proposed over the level's measured requests
    ("draft_n_accepted", I64),
    ("draft_acceptance", F64),  # draft_n_accepted / draft_n
    ("draft_source", STR),  # timings (llama.cpp, per request) | metrics (vLLM counters, whole config)
    # J/token: GPU energy summed ÷ decode tokens summed over the windows of gpu_j_per_token (the
    # median); the median of short windows on a coarse counter is biased, this is not (energy-resolution).
    ("gpu_j_per_token_pooled", F64),
    # %: share of the host's busy CPU time over the level's measured windows used by processes other than
    # the server's and powerprof's (flag busy-host above cputime.BUSY_HOST_PCT), and by powerprof itself.
    ("other_cpu_pct", F64),
    ("powerprof_cpu_pct", F64),
    # Several GPUs: those the cap did not bind on, each with its own power and limit ("gpu1 (183 W of 250 W)",
    # comma-separated); null on one GPU or where it bound on every GPU (flag cap-partly-engaged where it bound on some).
    ("cap_not_engaged_gpus", STR),
    # The windows the J/token and its CI rest on (requests at concurrency 1, batches above; a trace run's replays):
    # n_requests counts every successful request, those left out too (others' work beside them, untrusted timing).
    ("n_windows", I32),
    # Measured windows with no J/token (energy_method none: no GPU reading over them), in decode_tok_s alone: counted
    # in n_windows, a J/token resting on 1 window of 4 read as resting on 4.
    ("n_windows_tok_s_only", I32),
    # s: median decode window of the level's counter-read windows (null: none read on a counter). Under 10 refreshes
    # of the counter (energy.short_counter_window_s) the level is flagged short-windows.
    ("counter_window_s", F64),
    # s: the energy counter's refresh period the sweep estimated from its reads (the slowest GPU's); null: not known
    # (too few reads, no counter), 100 ms assumed.
    ("counter_refresh_s", F64),
]

# `powerprof analyze`: the merged levels of one or more runs, the fitted curves at each level and
# which sweet-spot policies chose it. Policy choices and fit parameters are in analysis.json too.
ANALYSIS_COLUMNS = LEVELS_COLUMNS + [
    ("n_runs", I32),  # runs pooled into this level
    ("fit_decode_tok_s", F64),  # parametric model at this level
    ("fit_avg_gpu_power_w", F64),
    ("fit_gpu_j_per_token", F64),
    ("chosen_by", STR),  # comma-separated policies whose sweet spot is this level
    ("recommended", BOOL),  # the recommended level of its series
    # Why no policy may choose this level (analyze.left_out_reason: "interrupted" is no flag, so the
    # row's figures alone would not say it); null when it may be chosen.
    ("left_out", STR),
]


# --- daemon datasets (hive-partitioned by date=YYYY-MM-DD; the partition column is not in the files)
# Every daemon row carries the machine that recorded it, so many nodes' datasets read as one.
HOST = ("host", STR)  # daemon.host, default the machine's host name
# The daemon's GPU was powerprof's simulated one (`daemon --simulate`): its figures are no hardware's. Null: written
# before the column.
SIMULATED = ("simulated", BOOL)
# The GPUs the daemon sampled (daemon.gpus): their NVML UUIDs, sorted and comma-joined. Rows of different GPU sets are
# no one machine's figures (`analyze` and `fleet` split them); two daemons' intervals over one time on a shared GPU count
# its energy twice (said). Null: written before the column, the GPU set unknown.
GPU_UUIDS = ("gpu_uuids", STR)


def gpu_uuids_value(uuids) -> str | None:
    """A row's gpu_uuids: the UUIDs sorted and comma-joined (one set, whatever order daemon.gpus named them in)."""
    got = sorted({str(u) for u in uuids if u})
    return ",".join(got) or None

# One row per proxied request. Never prompt or completion text.
DAEMON_REQUESTS_COLUMNS = [
    ("daemon_id", STR),  # one daemon process: request_id is unique within it
    ("request_id", I64),
    ("t_arrival_utc", TS),
    ("t_first_utc", TS),  # first generated token passed through the proxy
    ("t_last_utc", TS),  # last generated token
    ("t_end_utc", TS),  # response finished (or failed)
    ("ttft_s", F64),
    ("decode_s", F64),  # t_last - t_first, monotonic clock
    ("method", STR),
    ("endpoint", STR),  # URL path, no query string
    ("api", STR),  # llamacpp | openai-completions | openai-chat | null (not parsed)
    ("model", STR),
    ("stream", BOOL),
    ("tag", STR),  # client tag header, truncated to 128 characters
    ("status", I32),  # HTTP status sent to the client
    ("outcome", STR),  # ok | client_disconnected | upstream_error | upstream_unreachable | invalid_response | ... (data.md)
    ("error", STR),
    ("prompt_tokens", I32),
    # where the server never counted the prompt (a client gone before the usage): the estimate its prefill was costed at
    ("prompt_tokens_estimate", F64),
    # of prompt_tokens, those the server said it found in its prefix cache (not prefilled); null: it did not say
    ("cached_prompt_tokens", I32),
    ("generated_tokens", I32),
    ("decode_tokens", I32),  # generated - 1
    ("token_source", STR),  # usage | timings | counted | none
    ("tokens_estimated", BOOL),  # counted one per chunk (the stream gave no counts), unconfirmed by the server
    ("stop_reason", STR),
    ("response_bytes", I64),
    ("gpu_energy_j", F64),  # its share of every interval it was live in, by its work there; null: no share (energy_note)
    ("energy_note", STR),  # why gpu_energy_j is empty (no work seen), or approximate (a prompt length estimated)
    ("cpu_energy_j", F64),  # same split of RAPL package+DRAM energy
    # %: other processes' share of the host's busy CPU time in its intervals, weighted by its CPU joules there (above
    # cputime.BUSY_HOST_PCT energy_note says busy-host: cpu_energy_j includes their energy); null: not judged
    ("other_cpu_pct", F64),
    ("attributed_tokens", F64),  # its tokens inside closed intervals (all of them)
    ("gpu_j_per_token", F64),  # gpu_energy_j / attributed_tokens
    ("recorder_error", STR),  # recording failed (traffic still flowed)
    HOST,
    SIMULATED,
    GPU_UUIDS,
]

# A daemon interval row's `server_count`: the server's counter covered it with no known loss (complete); it was not
# read over it, the scraper having no answer yet (unread: its bypass traffic unknown); the daemon scrapes no server
# (off: bypass not measured); else why the count may be low, comma-separated (late_baseline, counter_below,
# slots_only, unscraped, misplaced, proxy_unread, usage_beyond_chunks, usage_above_counter, usage_below_counter), or may be low or high (proxy_lag, server_restart, fall_unconfirmed, run_on_may_end, batch_run_on: BYPASS_COUNT_TWO_WAY). Null (files written before the column): unknown, never complete. A request given energy of
# an interval whose count may be low (or unread) says BYPASS_LOW_FLAG in its energy_note; `analyze` leaves it out of
# J/token (docs/data.md, daemon_intervals).
SERVER_COUNT_COMPLETE, SERVER_COUNT_UNREAD, SERVER_COUNT_OFF = "complete", "unread", "off"
SERVER_COUNT_SLOTS_ONLY = "slots_only"  # a llama-server without --metrics: its /slots alone read
SERVER_COUNT_MISPLACED = "misplaced"  # the daemon's placing of proxied tokens came out below none there: its bypass taken as 0
# A window where the proxy's token rate rose or fell by more than its measured delay can hide: the proxy's own delay
# behind the server (a loaded host) may read as bypass tokens where its streams begin, or hide some where they end: the
# one reason whose count may be high as well as low.
SERVER_COUNT_PROXY_LAG = "proxy_lag"
# A window where the tokens placed as proxied on a stream's final usage beyond its chunks (up to COUNT_SLACK_TOKENS a
# stream: SGLang's end-of-text token, a self-closing call's trailing tokens) are more than a token plus 5% of its server
# count: believed, but if the server's counter did not count
# them, as many bypass tokens hide behind them.
SERVER_COUNT_USAGE_BEYOND = "usage_beyond_chunks"
# A window holding tokens the proxy believed from a server's final count alone (a stream's usage beyond its chunks
# counted one a chunk, a whole answer's usage) in a stretch of traffic over which the server's own counter counted
# fewer tokens than the proxy placed, beyond what honest lag explains (reconcile.CountReconciler._judge_usage): the
# usage runs above the counter (a server fault), so its requests' counts are high and bypass traffic beside them hides.
SERVER_COUNT_USAGE_ABOVE = "usage_above_counter"
# A window holding such tokens in a stretch over which the server's counter counted more than the proxy placed while its
# books (vLLM's finished requests and requests running) show that no request but the proxy's ran
# (reconcile.CountReconciler._judge_usage_below): the usage runs below the counter, the surplus is its requests' own
# tokens, not bypass traffic's (booked to none), and their counts are low.
SERVER_COUNT_USAGE_BELOW = "usage_below_counter"
# A scrape window still below the counter's highest reading (scrape.COUNTER_BELOW), or one whose count fell short of the
# proxy's tokens for good beyond what its reads and the proxy's lag explain (reconcile.CountReconciler._lost_beyond).
SERVER_COUNT_BELOW = "counter_below"
# An interval overlapping a time a proxy worker served whose records the daemon could not read (powerprof upgraded under it:
# daemon/workers.py) where the server's count is not complete: that worker's traffic is in no row, and without the
# server's counter (off, unread) or with /slots alone its tokens are not (all) in unproxied, so its energy reads as idle.
SERVER_COUNT_PROXY_UNREAD = "proxy_unread"
# A scrape window from the leave of an SGLang run-on's client to its placed end whose answer may have ended by itself
# before its abort (`LiveRequest.run_on_may_end`): SGLang then counted its tokens at that end, unseen by the proxy, and
# they read as bypass tokens there; aborted, it counted none. Which, nothing tells: its bypass count may be high (one of
# BYPASS_COUNT_TWO_WAY), and the requests given energy there low. Also from the death not cut at of a run-on whose
# process may have died on it (a refused scrape, then a page past a new process's reach: `Ledger._run_on_cut_ns`), and
# from a close with no answer costed as a crash at such a death to SGLang's next wait, where the same process back ran
# it on (`Ledger._crash_reach`: the requests given energy there high).
SERVER_COUNT_RUN_ON_MAY_END = "run_on_may_end"
# A scrape window from the arrival of a batch (two or more prompts) an SGLang (or a server of kind unknown yet) answered
# 400 with its band abort's message to an end its other prompts' run is taken to stay within (`Ledger._batch_end_ns`,
# `Ledger._batch_run_on`): SGLang answers 400 for one prompt
# its scheduler aborts and runs the others to their cap for nobody, counting them at their end; the daemon spreads
# those tokens back only over the intervals still open then, so the energy of the batch's run before them went to the
# requests beside it (high) and later windows' bypass count may be high: one of BYPASS_COUNT_TWO_WAY.
SERVER_COUNT_BATCH_RUN_ON = "batch_run_on"
BYPASS_LOW_FLAG = "bypass-uncounted"
# A daemon tag row's energy_note where its held edges may move its energy past the tolerance (daemon/tagedge.py:
# edges-late, their refreshes dated between reads a loaded host spaced out) or could not be held past a refresh
# (edges-unheld): `analyze` leaves such a window out of its tag's figures and counts it apart (analysis/fleet.py).
TAG_LATE_FLAG = "edges-late"
TAG_UNHELD_FLAG = "edges-unheld"
# A daemon request row's energy_note where its figure may be read either way and nothing measured says which: its
# client gone, a run-on a found-down scrape not proven a death may have cut (nearly all of it too much if so), or a
# close with no answer costed as a crash with no death shown (a queuing router refusing it unrun reads the same), or
# one whose resend found the server dead long after its arrival (queued unrun behind full slots reads the same) and the
# requests live beside it (their share low by its figure if so). Not a
# prompt whose `tools` sent with tool_choice "none" this server may or may not render: its split error is mirrored in the
# rows sharing its intervals, so it stays in J/token and only its words say so. Its gpu_energy_j stays (its best reading, marked); `analyze` leaves it out of J/token (docs/data.md, daemon_requests).
UNSURE_FLAG = "uncertain-uncounted"
# What of a text from outside (a client's body, a path, a method) an energy_note may quote: analyze finds flags in notes
# by LIKE '%flag%', so a client's content part typed "uncertain-uncounted", quoted whole, left its row out of J/token with
# a false reason. Every flag has a character outside these (tests/test_daemon_proxy.py checks each flag constant).
OUTSIDE_TEXT_KEPT = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_ ./:")
OUTSIDE_TEXT_MAX_CHARS = 40


def outside_text(text: str, max_chars: int = OUTSIDE_TEXT_MAX_CHARS) -> str:
    """`text` from outside as a note may quote it: each character not in OUTSIDE_TEXT_KEPT shown as `?`, so no flag
    (each holds a `-`: tests/test_daemon_proxy.py tries every one) can be in it, at most `max_chars` of them. Dropped
    instead, `/v1/my-model` read `/v1/mymodel`, and `/v1/x-y` and `/v1/xy` were one name in a neighbour's note."""
    return "".join(c if c in OUTSIDE_TEXT_KEPT else "?" for c in text[:max_chars])
# How a daemon request row's energy_note opens where the proxy answered the request before forwarding it (a 408 for its
# body, its client gone mid-body, a proxy_error reading it): the server never saw it, so no energy (fleet summary:
# not_forwarded_requests).
NOT_FORWARDED_NOTE = "no share: not forwarded"
# A daemon interval's or request's energy_note while the server also ran on a GPU the daemon does not sample (found by
# its processes on NVML's process lists, checked at the start, within PLACEMENT_LIST_S of a GPU's list changing, and
# every PLACEMENT_CHECK_S): that GPU's energy is in no
# gpu_energy_j, every figure low by it (docs/daemon.md, "The server's GPUs").
SERVER_GPU_UNSAMPLED_FLAG = "server-gpu-unsampled"
# A daemon request's or interval's energy_note (inside its `approximate:` part) where the server's prefix-cache counter
# showed cached prompt tokens that no answer said (vLLM without --enable-prompt-tokens-details, SGLang's OpenAI usage
# without --enable-cache-report): a reused prompt's prefill was costed whole. Kept in J/token (docs/daemon.md).
CACHE_UNSAID_FLAG = "prefix-cache-unsaid"
CACHE_UNSAID_FIX = ("start vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report (each answer's "
                    "usage then says its prompt_tokens_details.cached_tokens)")
# A daemon request's energy_note (inside its `approximate:` part) where it asked vLLM V0 for `best_of` sequences beyond
# the `n` it returns: the others' tokens never reach the proxy, so their work went to the requests beside it and to
# unproxied (read as bypass traffic), and its own figure is low. Kept in J/token (docs/daemon.md, "Several
# sequences, fewer returned").
BEST_OF_FLAG = "best-of-unseen"
BEST_OF_FIX = ("ask n equal to best_of and choose among the answers on the client, or leave best_of out (vLLM V1 "
               "refuses it)")
# A daemon request's energy_note (inside its `approximate:` part) where its stream's count is running usage as of its
# last chunk that carried one, its end carrying none and no final usage after (SGLang's chat stream asked
# continuous_usage_stats without include_usage: its end-of-text token, counted, has no text and so no chunk): its
# generated_tokens may be low, those tokens' energy in unproxied (docs/daemon.md, "A count that stops short").
COUNT_OPEN_FLAG = "count-open"
COUNT_OPEN_FIX = ("ask for the final count too, \"stream_options\": {\"include_usage\": true} beside "
                  "continuous_usage_stats (SGLang then ends the stream with the whole count)")
# A daemon request's energy_note (inside its `approximate:` part) where its count, believed past its running counts as
# a tool call the server's parser held and max_tokens cut (arrival.held_call_at_limit), put tokens in no chunk: the
# count is the server's, but when they ran is inferred (spread from its last chunk to the upstream's end), and its share
# of the intervals over that span with it. Kept in J/token (docs/daemon.md, "Tokens its tool-call parser still holds").
HELD_TAIL_FLAG = "held-tail"
HELD_TAIL_FIX = ("none for the count; for the timing, a max_tokens tool calls do not reach (a call that closes is sent "
                 "with its running count), or a tool-call parser that streams arguments as they come (SGLang's JSON "
                 "ones: qwen25, llama3, mistral)")
# A daemon request's energy_note (inside its `approximate:` part) where the proxy streamed its request body on unread
# (over its 1 MiB inspection bound, or past its memory budget for reading bodies), or read it and found no size in it
# (an image or audio part, a shape not known), and the server never said the prompt's length: its prefill is not
# costed, so its figure is low; the requests live over that prefill say it too, their figures high (docs/daemon.md,
# "Prompts are known"). Its byte count bounds nothing useful: a field or base64 images beside the prompt.
PROMPT_UNREAD_FLAG = "prompt-unread"
# The fix its own row gives, by what the server could have been asked (rowtext._prompt_length_fix): an OpenAI chat or
# completions stream that ran to its end, its usage; one its client left, the usage in every chunk (the final usage
# comes after the client has gone); any other (a whole answer, a native stream, Responses): none to ask for.
PROMPT_USAGE_FIX = "ask for the prompt's length, \"stream_options\": {\"include_usage\": true}"
PROMPT_RUNNING_USAGE_FIX = ("ask for the prompt's length in every chunk, \"stream_options\": {\"include_usage\": true, "
                            "\"continuous_usage_stats\": true} (vLLM, SGLang): the final usage comes after a client "
                            "that leaves has gone")
PROMPT_NO_ASK_FIX = ("none the client can ask for (no option of this API's has the server say the prompt's "
                     "length sooner)")
# A stateful Responses turn (`previous_response_id`, `conversation`): its history is not in its body, but could be.
PROMPT_STATEFUL_FIX = ("send the conversation in the body's `input` rather than by `previous_response_id` or "
                       "`conversation`: the proxy then sizes it")
PROMPT_BODY_FIX = "keep request bodies under 1 MiB (the proxy's inspection bound)"
PROMPT_UNREAD_FIX = (f"{PROMPT_BODY_FIX}; for a body read but sizeless, the server saying its prompt's length (an OpenAI "
                     "stream: include_usage, with continuous_usage_stats where its client may leave)")
# A request whose prompt's length was said early in its stream and its cached count only at its end, after intervals
# over its prefill had closed with the whole prompt costed as computed (docs/daemon.md, "Prefix-cache hits are no
# prefill").
CACHE_LATE_FLAG = "prefix-cache-late"
CACHE_LATE_FIX = ("ask without continuous usage (stream_options continuous_usage_stats off: vLLM's running usage "
                  "says no prompt_tokens_details, only its final one does), so its prompt waits for the end's count, "
                  "or use a stream that says its cached count with its prompt's length (SGLang /generate on every "
                  "event)")
# A daemon request's energy_note (inside its `approximate:` part) where part of its energy is from intervals a request
# that ended before its first token, its prompt's length unsaid, was live in: that prompt's prefill was costed at an
# estimate from its body (or not at all where the body gave none), and may have been cut short, never run (queued) or
# run whole, so the share of the requests beside it may be high or low. Kept in J/token (docs/daemon.md, "Prompts are
# known").
GONE_PREFILL_FLAG = "gone-prefill-beside"
GONE_PREFILL_FIX = ("none from the server (vLLM and SGLang say nothing per request of a prefill they dropped when its "
                    "client left); clients that give up on long prompts under load: a longer timeout, or fewer "
                    "requests at once")
# A daemon request's or interval's energy_note (inside its `approximate:` part) where part of its energy is from
# intervals split by the operator's daemon.serving_gpus alone, the GPUs' power not (yet) agreeing: a wrong assertion
# puts a GPU's draw that serves none of the work in it, or leaves one that does out. Kept in J/token: the operator's
# stated assumption, said on every such row and counted, since flagging them made the key useless where it is needed
# (an unseen server under a load too even for the power ever to judge: every row flagged, as without it). docs/daemon.md,
# Attribution, Assumptions, "One engine".
SERVING_ASSERTED_FLAG = "serving-asserted"
SERVING_ASSERTED_FIX = ("none where daemon.serving_gpus names the GPUs the server runs on (nvidia-smi on its host "
                        "shows them); where it does not, correct it, or empty it to let the daemon judge, and restart "
                        "the daemon")
# The `server_count` values whose energy is trusted in J/token. `slots_only` alone is every interval of a llama-server
# started without --metrics (its default): leaving it out would leave every figure out for a loss only bypass traffic
# causes; like `off` (bypass not measured at all), the rows, /metrics, the log and `analyze`'s notes say it instead.
SERVER_COUNT_TRUSTED = (SERVER_COUNT_COMPLETE, SERVER_COUNT_OFF, SERVER_COUNT_SLOTS_ONLY)


def bypass_count_low(server_count: str | None) -> bool:
    """The one rule for energy left out of J/token for its server count: an interval (or a tag, over its intervals)
    whose count may be low or was not read, and null (written before the column): unknown, never complete. A
    comma-joined value (a tag's: its intervals' values, `complete` dropped) is trusted only where each value in it is:
    a tag over `off` and `slots_only` intervals is as sound as each of them. The daemon's requests (BYPASS_LOW_FLAG,
    which `analyze` leaves out), its live J/token gauge, its tag rows, `analyze`'s per-host interval counts and its tag
    table use it (analysis/fleet.py states it in SQL, tests/test_daemon_bypass_partial.py holds the two equal).
    Of what it leaves out, `bypass_count_unknown` is the part with no count at all; of what it keeps, all but
    `complete` holds bypass traffic's energy unmeasured, or measured in part, and is said apart."""
    return not server_count or not set(server_count.split(",")) <= set(SERVER_COUNT_TRUSTED)


# The reasons whose count may be high as well as low: the proxy's own lag (proxy_lag), and a restart, where the old
# process's last count is lost (low) and the new one's first reads may owe the proxy's tokens in a way nothing tells
# from that loss (high, where a dip's recovery reads as bypass: docs/daemon.md, Which rows may be low); and a run-on that
# may have ended by itself (high only, said with the two-way words: no note says "may be high" alone); and a batch run
# for nobody after its error answer (its tokens placed late: high where they land, the requests before them high).
BYPASS_COUNT_TWO_WAY = (SERVER_COUNT_PROXY_LAG, "server_restart", "fall_unconfirmed", SERVER_COUNT_RUN_ON_MAY_END,
                        SERVER_COUNT_BATCH_RUN_ON)


def bypass_count_may_be(server_count: str | None) -> str:
    """How a `server_count` may err, for a note: "may be low or high" where any of its reasons may err either way
    (BYPASS_COUNT_TWO_WAY), else "may be low"."""
    why = set((server_count or "").split(","))
    return "may be low or high" if why & set(BYPASS_COUNT_TWO_WAY) else "may be low"


def bypass_count_unknown(server_count: str | None) -> bool:
    """No server count at all: not read yet (`unread`), or null (written before the column). Left out, as low."""
    return not server_count or server_count == SERVER_COUNT_UNREAD


# What to do where a refused scrape, then a page past what a new process could have counted, left a death unsure (the
# same process back, or a restarted one whose counter persisted): said by the rows of the requests it may have ended
# and by those beside them (`run_on_may_end`), which nothing in their own traffic can fix.
PAST_REACH_FIX = ("scrape the server's own port (scrape.url) and clear PROMETHEUS_MULTIPROC_DIR at each start of the "
                  "server, so a restart reads as one")
# What to do about each value a `server_count` may hold but `complete`, said beside the figures it leaves out or keeps
# (a request's energy_note, `analyze`'s notes, `powerprof tag stop`). No fix makes rows already written whole.
BYPASS_COUNT_FIX = {
    "late_baseline": "start the server before the daemon, or restart the daemon once the server is up",
    SERVER_COUNT_UNREAD: "start the server before the daemon, and check that scrape.url answers its /metrics",
    "server_restart": "their count may be low or high: none for later requests (the count starts afresh); keep the "
                      "server from restarting",
    "fall_unconfirmed": "their count may be low or high (after a restart told by the counter's fall alone, a dip's "
                        "recovery may be counted again, or the new process's tokens are right): none for the figures "
                        "kept, they are left out of J/token; if it goes on, restart the daemon once the server is up",
    "counter_below": "none once the server's counter passes its highest reading again; where it was a restart, a page "
                     "with process_start_time_seconds (vLLM with one API server) tells it; where the count fell short "
                     "of the proxy's tokens for good, keep the server from restarting",
    SERVER_COUNT_SLOTS_ONLY: "start llama-server with --metrics",
    "unscraped": "keep the server's /metrics answering within scrape's 2 s (the intervals wait for it 10 s at most)",
    SERVER_COUNT_OFF: "let the daemon scrape the server (scrape.server not none)",
    SERVER_COUNT_MISPLACED: "none for these rows (a fault of the daemon's placing of proxied tokens: report it with the "
                            "daemon's log)",
    SERVER_COUNT_PROXY_UNREAD: "restart the daemon (powerprof was upgraded under it: a proxy worker serves whose "
                               "records it cannot read, so its requests' energy is idle or bypass traffic's)",
    SERVER_COUNT_USAGE_BEYOND: "the server's usage said up to 3 tokens a stream more than its chunks carried, believed "
                               "and placed as proxied; if its counter did not count them, bypass traffic hides behind "
                               "them: ask for longer answers, or check that the server's counter and its usage agree "
                               "(SGLang counts its end-of-text token in both)",
    SERVER_COUNT_USAGE_ABOVE: "the server's usage runs above its own token counter (/metrics): check the server's "
                              "version and report it upstream; the rows' generated_tokens are its usage's, their "
                              "J/token is left empty, and bypass traffic beside them is hidden by as many tokens",
    SERVER_COUNT_USAGE_BELOW: "the server's usage runs below its own token counter (/metrics), and its books show that "
                              "no request but the proxy's ran, so the counter's surplus is theirs (not in unproxied): "
                              "check the server's version and report it upstream; the rows' generated_tokens are its "
                              "usage's (low), their J/token is left empty",
    SERVER_COUNT_RUN_ON_MAY_END: "their count may be high: a request whose client left an SGLang stream (or whole "
                                 "answer) ran on until SGLang's abort unless its answer ended by itself first, unseen, "
                                 "SGLang then counting its tokens at that end (read as bypass tokens here, the requests "
                                 "beside it low), or its process died first (a refused scrape, then a page past what a "
                                 "new process could have counted: the requests beside it low), or a close with no "
                                 "answer there was the same process's, which ran it on (the requests beside it high); "
                                 "none for the figures kept, they are left out of J/token; clients that "
                                 "stay to their answers' end, or send ignore_eos (or a min_tokens) where the answer is "
                                 "to run to max_tokens; where a refused scrape came before a page past what a new "
                                 "process could have counted (the server's log), " + PAST_REACH_FIX,
    SERVER_COUNT_BATCH_RUN_ON: "their count may be high or low: a batch (several prompts) answered 400 may have run "
                               "on for nobody (SGLang answers 400 for one prompt in the context's last 6 tokens and "
                               "runs the others to their cap), counted at its end and placed late, the requests beside "
                               "it high; none for the figures kept, they are left out of J/token; send each prompt as "
                               "a request of its own, or keep prompts out of the context's last tokens",
    SERVER_COUNT_PROXY_LAG: "their count may be high or low: the proxy's own delay behind the server (a loaded host) "
                            "may read as bypass tokens where its streams begin, or hide some where they end, and a "
                            "proxy that went silent (its workers stopped) may leave a live stream's tokens read as "
                            "bypass tokens; give the daemon's host CPU to spare",
}
# Whatever the reason, a count short of whole costs something only where requests bypass the proxy. Where none do, a
# count that may be low (a restart) still leaves the rows out, as nothing in them can tell; the daemon told that no
# server is to be scraped writes `off`, trusted, and its bypass count is then exact (none ran). Not its every figure:
# scraping nothing, it knows no server kind, so no run-on after a client's leave (SGLang's, llama.cpp's) is placed, the
# cut rows and those beside them flagged UNSURE_FLAG (docs/daemon.md, "A request the server runs on after its client
# left"); so the fix says so, and is not offered for `run_on_may_end` nor `batch_run_on`, which only SGLang's run-ons
# cause. Nor are the rows beside a whole answer in flight past the ledger's 120 s hold for its intervals
# (Ledger max_hold_s): with no counter read its decode there is in their shares, flagged (docs/daemon.md).
BYPASS_NONE_FIX = ("where every request goes through the proxy and no client leaves mid-answer (SGLang and llama.cpp "
                   "run such a request on, which only a scraped server's kind lets the daemon place), set "
                   "scrape.server = none: there is then no bypass traffic to count, and the rows (server_count off) "
                   "stay in J/token, but for those beside a whole (unstreamed) answer still in flight 120 s after its "
                   "arrival, flagged then")
BYPASS_PROXY_FIX = "or send every request through the proxy"


def bypass_count_fix(server_count: str | None) -> str:
    """The fixes for the reasons of one `server_count` (or several, comma-joined), joined; null: written before the
    column, which a newer daemon writes."""
    why = sorted({w for w in (server_count or "").split(",") if w} - {SERVER_COUNT_COMPLETE})
    fixes = [BYPASS_COUNT_FIX[w] for w in why if w in BYPASS_COUNT_FIX]
    if not server_count:
        fixes = ["none for these rows (written before server_count); a newer daemon writes it"]
    if {SERVER_COUNT_RUN_ON_MAY_END, SERVER_COUNT_BATCH_RUN_ON} & set(why):
        return "; ".join(fixes)  # set scrape.server = none would hide those runs' work in the rows, not fix the count
    return "; ".join(fixes + [BYPASS_NONE_FIX if bypass_count_low(server_count) else BYPASS_PROXY_FIX])


# One row per sample interval: the energy between two consecutive GPU samples and who used it.
DAEMON_INTERVALS_COLUMNS = [
    ("daemon_id", STR),
    ("t_start_utc", TS),
    ("t_end_utc", TS),
    ("t_start_mono_s", F64),  # monotonic seconds since the daemon started
    ("duration_s", F64),
    ("kind", STR),  # idle | decode | prefill (prefill or mixed) | unproxied: a label
    ("gpu_energy_j", F64),  # all sampled GPUs
    ("cpu_energy_j", F64),  # RAPL package + DRAM, null without RAPL
    ("other_cpu_pct", F64),  # %: other processes' share of the host's busy CPU time (busy-host above 10); null: not judged
    ("energy_method", STR),  # counter | power_integration | none (weakest of the GPUs)
    ("avg_gpu_power_w", F64),
    ("proxy_tokens", F64),  # tokens that passed through the proxy in the interval
    ("server_tokens", F64),  # tokens the server's own metrics counted (null: not scraped)
    ("server_count", STR),  # how far the server's count covers it (SERVER_COUNT_* above); null: unknown
    ("n_prefill", I32),  # requests in prefill during the interval
    ("n_decoding", I32),  # requests decoding during the interval
    ("requests_energy_j", F64),  # given to the requests live in it, by their work
    ("idle_energy_j", F64),  # the part no request was live in, at the idle power
    ("unproxied_energy_j", F64),  # to server-counted tokens beyond the proxy's
    ("prefill_tokens", F64),  # prompt tokens prefilled in it (spread over arrival → first token)
    ("work_costs", STR),  # fixed (documented ratio) | fitted: the costs that split it
    # for each of its figures that is empty or may be partial, why and the fix ("; "-joined); null: every one whole, or
    # written before the column (unknown)
    ("energy_note", STR),
    HOST,
    SIMULATED,
    GPU_UUIDS,
]

# One row per tuner decision (`powerprof tune`, docs/tuner.md): every change of level and every verdict, with its reason.
TUNER_DECISIONS_COLUMNS = [
    ("time_utc", TS),
    ("t_mono_s", F64),  # monotonic seconds since the tuner started
    ("action", STR),  # start | explore | accept | reject | backoff | restore | hold | regime | kill | stale | resume | thin | stop
    ("knob", STR),  # power | clock
    ("from_level", F64),  # W or MHz
    ("to_level", F64),
    ("applied", BOOL),  # false in dry-run mode: only recommended
    ("reason", STR),
    ("regime", STR),  # traffic regime the decision was taken in
    ("j_per_token", F64),  # the judged window's figure behind the verdict, if any
    ("slo_ratio", F64),  # its worst p95 over its SLO
    ("gpus", STR),  # comma-separated NVML indexes
    ("gpu_uuids", STR),  # the same GPUs' UUIDs, sorted, comma-joined (null in files written before the column)
    HOST,
    ("tuner_id", STR),  # the tuner process (null in files written before the column)
    ("seq", I64),  # its decisions numbered from 0 in the order taken: with tuner_id, the row's key
]

# One row per fit of the work model's costs (daemon/workmodel.py), per GPU setting.
DAEMON_COSTS_COLUMNS = [
    ("daemon_id", STR),
    ("time_utc", TS),  # end of the last interval in the window
    ("power_limits_w", STR),  # the setting: each sampled GPU's limit, comma separated
    # and each sampled GPU's SM clock lock (MHz, empty: none seen), comma separated; null in files written before it
    ("sm_clock_locks_mhz", STR),
    ("n_intervals", I32),  # intervals in the rolling window
    ("n_busy", I32),  # of which with work
    ("idle_w", F64),  # intercept: power with nothing running
    ("step_j", F64),  # per engine step (shared by the sequences in it)
    ("decode_j", F64),  # per generated token
    ("prefill_j", F64),  # per prompt token
    ("ctx_j_per_ktoken", F64),  # per generated token per 1000 tokens of context
    ("r2", F64),  # over the window's busy intervals
    ("rel_rmse", F64),  # RMS residual / mean busy-interval energy
    ("mature", BOOL),  # used to split intervals (else the fixed ratio is)
    ("not_mature_reason", STR),
    HOST,
    SIMULATED,
    GPU_UUIDS,  # sorted: not paired by position with power_limits_w
]

# One row per application-defined tag window (powerprof tag start|stop NAME).
DAEMON_TAGS_COLUMNS = [
    ("daemon_id", STR),
    ("name", STR),
    ("t_start_utc", TS),
    ("t_end_utc", TS),
    ("duration_s", F64),
    # counter read on demand at both edges; of the GPUs serving the proxied work (every sampled one until the daemon
    # judges which), as its requests' split: energy_note names those left out and their joules
    ("gpu_energy_j", F64),
    ("cpu_energy_j", F64),
    ("other_cpu_pct", F64),  # %: other processes' CPU time summed ÷ the host's busy time, over its intervals
    ("energy_method", STR),
    ("proxy_tokens", F64),  # tokens through the proxy inside the window
    # of gpu_energy_j, bypass traffic's: its intervals' unproxied_energy_j (null: written before the column, unknown)
    ("unproxied_energy_j", F64),
    ("gpu_j_per_token", F64),  # (gpu_energy_j - unproxied_energy_j) / proxy_tokens
    ("closed_by", STR),  # stop | shutdown
    # how far the server's count covers its intervals (SERVER_COUNT_* above, their reasons joined); null: unknown
    ("server_count", STR),
    # for each of its figures that is empty or may be partial, why and the fix ("; "-joined, the interval rows' words);
    # null: every one whole, or written before the column (unknown)
    ("energy_note", STR),
    HOST,
    SIMULATED,
    GPU_UUIDS,
]

# The daemon's samples: the sweep's SAMPLES columns, then the host, then the daemon process (t_mono_s
# restarts at each daemon start: it orders and subtracts only within one daemon_id).
DAEMON_SAMPLES_COLUMNS = SAMPLES_COLUMNS + [HOST, ("daemon_id", STR), SIMULATED]

# Column lists by table name. TABLES / DAEMON_TABLES and the upper-case names (SAMPLES, ...) are
# the same tables as pa.Schema objects, built on first use (module __getattr__ below).
COLUMNS = {
    "samples": SAMPLES_COLUMNS,
    "windows": WINDOWS_COLUMNS,
    "levels": LEVELS_COLUMNS,
    "analysis": ANALYSIS_COLUMNS,
    "daemon_requests": DAEMON_REQUESTS_COLUMNS,
    "daemon_intervals": DAEMON_INTERVALS_COLUMNS,
    "daemon_tags": DAEMON_TAGS_COLUMNS,
    "daemon_costs": DAEMON_COSTS_COLUMNS,
    "daemon_samples": DAEMON_SAMPLES_COLUMNS,
    "tuner_decisions": TUNER_DECISIONS_COLUMNS,
}
_DOCUMENTED = ("samples", "windows", "levels", "analysis", "daemon_requests", "daemon_intervals", "daemon_tags",
               "daemon_costs")  # TABLES: what docs/data.md documents
DAEMON_DATASETS = {"samples": "daemon_samples", "requests": "daemon_requests", "intervals": "daemon_intervals",
                   "tags": "daemon_tags", "costs": "daemon_costs"}  # the daemon's dataset name → its table


def arrow_type(typ: str):
    import pyarrow as pa

    return {TS: pa.timestamp("us", tz="UTC"), F64: pa.float64(), I64: pa.int64(), I32: pa.int32(), STR: pa.string(),
            BOOL: pa.bool_()}[typ]


def arrow_schema(columns) -> pa.Schema:
    """A column list ((name, type) pairs) → pa.Schema."""
    import pyarrow as pa

    return pa.schema([(name, arrow_type(typ)) for name, typ in columns])


def columns_of(schema) -> list[tuple[str, str]]:
    """A pa.Schema (of the types above) or a column list → a column list."""
    if not hasattr(schema, "names"):
        return list(schema)
    by_arrow = {str(arrow_type(t)): t for t in (TS, F64, I64, I32, STR, BOOL)}
    return [(f.name, by_arrow[str(f.type)]) for f in schema]


def __getattr__(name: str):
    """SAMPLES, DAEMON_REQUESTS, ... as pa.Schema; TABLES, DAEMON_TABLES as dicts of them (PEP 562): only
    whoever asks for one imports pyarrow."""
    if name == "TABLES":
        value = {t: arrow_schema(COLUMNS[t]) for t in _DOCUMENTED}
    elif name == "DAEMON_TABLES":
        value = {d: arrow_schema(COLUMNS[t]) for d, t in DAEMON_DATASETS.items()}
    elif name.lower() in COLUMNS:
        value = arrow_schema(COLUMNS[name.lower()])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


KNOB_PREFIX = "knob_"  # a configuration sweep's knobs: one column each, named by the user (--vary draft=... → knob_draft)


def with_knob_columns(table: pa.Table, rows) -> pa.Table:
    """Append a column for every knob_* key the rows carry: int64 when every value is an integer,
    float64 when every value is a number, string otherwise."""
    import pyarrow as pa

    rows = list(rows)
    names = sorted({k for r in rows for k in r if k.startswith(KNOB_PREFIX)})
    for name in names:
        vals = [r.get(name) for r in rows]
        present = [v for v in vals if v is not None]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            typ = I64
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            typ = F64
        else:
            typ = STR
            vals = [None if v is None else str(v) for v in vals]
        table = table.append_column(pa.field(name, typ), pa.array(vals, typ))
    return table


def rows_to_table(schema: pa.Schema, rows, fill: dict | None = None) -> pa.Table:
    """Rows (dicts keyed by column name; missing keys are null, or their value in `fill`: columns
    every row shares, such as the daemon's host) → a table of `schema`: the one converter.

    Timestamps travel as integer nanoseconds since the epoch (UTC), as the sampler and the clocks
    give them, and are truncated to the schema's microseconds only here; datetime objects are
    accepted too."""
    import pyarrow as pa

    rows = list(rows)
    cols = {}
    fill = fill or {}
    for f in schema:
        vals = [r.get(f.name, fill.get(f.name)) for r in rows]
        if pa.types.is_timestamp(f.type) and any(isinstance(v, int) for v in vals):
            # Integer µs straight into the timestamp type (every schema here is µs, TS): a cast
            # would load pyarrow.compute (~10 MiB) into the daemon.
            cols[f.name] = pa.array([None if v is None else _ns(v) // 1000 for v in vals], f.type)
        else:
            cols[f.name] = pa.array(vals, f.type)
    return pa.Table.from_pydict(cols, schema=schema)


def _ns(v) -> int:
    if isinstance(v, int):
        return v
    return int(v.timestamp() * 1_000_000) * 1000  # a datetime among integer nanoseconds
