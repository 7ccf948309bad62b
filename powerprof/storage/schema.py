"""Parquet schemas of every table powerprof writes: one place, units in every column name.

docs/data.md documents each column; tests/test_schema_docs.py keeps the two in step.
Tables only grow by appending nullable columns, so old files stay readable.
"""

from __future__ import annotations

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")

# One row per device per sample (GPU, CPU package/DRAM zone, or host).
SAMPLES = pa.schema(
    [
        ("time_utc", TS),
        ("t_mono_s", pa.float64()),  # monotonic seconds since the run's start: use for arithmetic
        ("seq", pa.int64()),  # tick number; -1 for on-demand samples at window edges
        ("label", pa.string()),  # on-demand samples: the window edge that asked for it
        ("source", pa.string()),  # nvml | rapl | host
        ("device", pa.string()),  # gpu0, package-0, dram-0, psys, host
        ("gpu_index", pa.int32()),
        ("gpu_uuid", pa.string()),
        ("power_w", pa.float64()),  # GPU instant power / RAPL power over the last interval
        ("power_avg_w", pa.float64()),  # GPU 1 s trailing average (nvmlDeviceGetPowerUsage)
        ("energy_j", pa.float64()),  # cumulative: GPU driver counter; RAPL wrap-corrected since start
        ("sm_clock_mhz", pa.float64()),
        ("mem_clock_mhz", pa.float64()),
        ("gpu_util_pct", pa.float64()),
        ("mem_util_pct", pa.float64()),
        ("mem_used_bytes", pa.int64()),
        ("temperature_c", pa.float64()),
        ("power_limit_w", pa.float64()),
        ("enforced_limit_w", pa.float64()),
        ("clock_event_reasons", pa.int64()),
        ("cpu_util_pct", pa.float64()),
        ("cpu_freq_mhz", pa.float64()),
        ("host_mem_used_bytes", pa.int64()),
        ("level_kind", pa.string()),  # power_limit | sm_clock | idle | null outside a sweep level
        ("level_value", pa.float64()),  # W for power_limit, MHz for sm_clock
        ("error", pa.string()),  # why a reading is missing
    ]
)

# One row per request: its decode window and the energy measured over it.
WINDOWS = pa.schema(
    [
        ("run_id", pa.string()),
        ("level_kind", pa.string()),  # power_limit | sm_clock | none (measure)
        ("level_value", pa.float64()),
        ("repeat", pa.int32()),
        ("window_kind", pa.string()),  # request: one request's decode; batch: a concurrent batch's measured intervals; trace: a replayed trace
        ("request_id", pa.int64()),  # null for batch rows
        ("batch_id", pa.int64()),  # requests sent together at one concurrency  # requests sent together at one concurrency
        ("concurrency", pa.int32()),
        ("warmup", pa.bool_()),
        ("status", pa.string()),  # ok | failed
        ("error", pa.string()),
        ("api", pa.string()),  # llamacpp | openai-completions | openai-chat
        ("model", pa.string()),
        ("prompt_id", pa.string()),
        ("t_send_utc", TS),
        ("t_first_utc", TS),  # first generated token arrived
        ("t_last_utc", TS),  # last generated token arrived
        ("ttft_s", pa.float64()),
        ("decode_s", pa.float64()),  # t_last - t_first, monotonic clock
        ("prompt_tokens", pa.int32()),
        ("generated_tokens", pa.int32()),
        ("decode_tokens", pa.int32()),  # generated - 1: the first token comes out of prefill
        ("decode_tok_s", pa.float64()),  # decode_tokens / decode_s
        ("gpu_energy_j", pa.float64()),  # over the decode window, all GPUs of the run
        ("cpu_energy_j", pa.float64()),  # RAPL package (+DRAM) over the same window
        ("energy_method", pa.string()),  # counter | power_integration | none
        ("avg_gpu_power_w", pa.float64()),
        ("gpu_j_per_token", pa.float64()),
        ("total_j_per_token", pa.float64()),  # GPU + CPU
        ("idle_gpu_power_w", pa.float64()),  # baseline before the sweep, for above-idle figures
        ("above_idle_gpu_j_per_token", pa.float64()),
        ("server_prompt_n", pa.int32()),
        ("server_predicted_n", pa.int32()),
        ("server_prompt_ms", pa.float64()),
        ("server_predicted_ms", pa.float64()),
        ("server_predicted_per_second", pa.float64()),
        ("draft_n", pa.int32()),
        ("draft_n_accepted", pa.int32()),
        ("stop_reason", pa.string()),
        ("low_confidence", pa.bool_()),  # window shorter than the sensor can resolve well
        ("attempt", pa.int32()),  # 1 for a first try; retries of the same request count up
        ("http_status", pa.int32()),
        ("token_source", pa.string()),  # usage | timings | counted: where generated_tokens came from
        ("server_kind", pa.string()),  # llamacpp | vllm | sglang | tgi | openai
        ("prompt_text", pa.string()),  # only with --keep-text
        ("completion_text", pa.string()),  # only with --keep-text
        # Appended by issue 10: how the tokens arrived and how the window is timed.
        ("timing", pa.string()),  # how the window's figures are timed: stream, server, untrusted
        ("timing_reason", pa.string()),  # why the window is not stream-timed
        ("stream_decode_s", pa.float64()),  # s: last read − first read as the stream saw it
        ("stream_decode_tok_s", pa.float64()),  # tokens/s: tokens after the first read ÷ stream_decode_s, whatever the timing use
        ("stream_error_bound_pct", pa.float64()),  # %: estimated error of the stream rate from stale edge reads and client la
        ("n_reads", pa.int32()),  # reads: distinct socket reads that carried tokens
        ("n_token_events", pa.int32()),  # events: server events that carried tokens
        ("max_read_share", pa.float64()),  # fraction: largest share of the generated tokens that arrived in one read
        ("max_events_per_read", pa.int32()),  # events: most server events that arrived in one read
        ("read_gap_p50_s", pa.float64()),  # s: median gap between consecutive token-bearing reads
        ("read_gap_max_s", pa.float64()),  # s: largest gap between consecutive token-bearing reads
        ("client_lag_edge_s", pa.float64()),  # s: worst lateness of the client's event loop at the window edges
        ("client_lag_max_s", pa.float64()),  # s: worst lateness of the client's event loop during the window
        ("server_decode_s", pa.float64()),  # s: the server's own decode time of this request
        ("server_decode_tokens", pa.int32()),  # tokens: decode tokens the server's decode time covers
        ("server_decode_tok_s", pa.float64()),  # tokens/s: server_decode_tokens / server_decode_s
        ("server_timing_source", pa.string()),  # llamacpp-timings or vllm-metrics
        ("stream_vs_server_pct", pa.float64()),  # %: stream rate ÷ server rate − 1, when both exist
        ("truncated", pa.string()),  # the generation stopped short of max_tokens at the context length: how 
        # Appended by configuration sweeps (--vary, --context-tokens); each knob also gets a
        # knob_<name> column (see KNOB_PREFIX).
        ("config_id", pa.string()),  # the server configuration: "draft=3,np=2"
        ("context_tokens", pa.int32()),  # the context length the prompt was built to (--context-tokens)
    ]
)

# One row per level (and repeat pooled): what the user reads.
LEVELS = pa.schema(
    [
        ("run_id", pa.string()),
        ("level_kind", pa.string()),
        ("level_value", pa.float64()),
        ("requested_limit_w", pa.float64()),
        ("enforced_limit_w", pa.float64()),
        ("locked_sm_clock_mhz", pa.float64()),
        ("n_requests", pa.int32()),
        ("n_failed", pa.int32()),
        ("decode_tok_s", pa.float64()),  # median over requests (concurrency 1) or wall-clock aggregate
        ("decode_tok_s_ci_low", pa.float64()),
        ("decode_tok_s_ci_high", pa.float64()),
        ("gpu_j_per_token", pa.float64()),
        ("gpu_j_per_token_ci_low", pa.float64()),
        ("gpu_j_per_token_ci_high", pa.float64()),
        ("total_j_per_token", pa.float64()),
        ("above_idle_gpu_j_per_token", pa.float64()),
        ("ci_reached_pct", pa.float64()),  # half-width of the J/token 95% CI, % of the median
        ("speed_loss_pct", pa.float64()),  # vs the reference level
        ("energy_saving_pct", pa.float64()),
        ("avg_gpu_power_w", pa.float64()),
        ("avg_cpu_power_w", pa.float64()),
        ("sm_clock_mhz", pa.float64()),
        ("mem_clock_mhz", pa.float64()),
        ("reference", pa.bool_()),
        ("cap_not_engaged", pa.bool_()),
        ("thermal_throttle", pa.bool_()),
        ("flags", pa.string()),  # comma-separated: cap-not-engaged, thermal, failed-requests, wide-ci, one-window
        ("energy_method", pa.string()),
        # Appended by the analysis (issue 6): levels at different concurrencies are different levels,
        # and loss/saving vs the reference carry their own bootstrap CIs.
        ("concurrency", pa.int32()),
        ("speed_loss_pct_ci_low", pa.float64()),
        ("speed_loss_pct_ci_high", pa.float64()),
        ("energy_saving_pct_ci_low", pa.float64()),
        ("energy_saving_pct_ci_high", pa.float64()),
        # Appended by the sweep: why measuring the level stopped (ci-reached | max-time |
        # max-requests | no-energy | paired-ci-reached), so advice can name the knob that would have helped.
        ("stop_rule", pa.string()),
        # Distinct prompts among the measured requests: with fewer prompts than requests, rounds
        # repeat them, and more rounds say more about these prompts only (the wide-ci advice).
        ("n_prompts", pa.int32()),
        # Appended by configuration sweeps (--vary, --context-tokens), with a knob_<name> column per knob.
        ("config_id", pa.string()),
        ("config_status", pa.string()),  # ok | out-of-memory | failed-to-start | failed
        ("config_error", pa.string()),  # why a configuration was not measured: the message and the server log's tail
        ("context_tokens", pa.int32()),
        ("draft_n", pa.int64()),  # draft tokens proposed over the level's measured requests
        ("draft_n_accepted", pa.int64()),
        ("draft_acceptance", pa.float64()),  # draft_n_accepted / draft_n
        ("draft_source", pa.string()),  # timings (llama.cpp, per request) | metrics (vLLM counters, whole config)
    ]
)

# `powerprof analyze`: the merged levels of one or more runs, the fitted curves at each level and
# which sweet-spot policies chose it. Policy choices and fit parameters are in analysis.json too.
ANALYSIS = pa.schema(
    list(LEVELS)
    + [
        ("n_runs", pa.int32()),  # runs pooled into this level
        ("fit_decode_tok_s", pa.float64()),  # parametric model at this level
        ("fit_avg_gpu_power_w", pa.float64()),
        ("fit_gpu_j_per_token", pa.float64()),
        ("chosen_by", pa.string()),  # comma-separated policies whose sweet spot is this level
        ("recommended", pa.bool_()),  # the recommended level of its series
    ]
)

TABLES = {"samples": SAMPLES, "windows": WINDOWS, "levels": LEVELS, "analysis": ANALYSIS}

# --- daemon datasets (hive-partitioned by date=YYYY-MM-DD; the partition column is not in the files)
# Every daemon row carries the machine that recorded it, so many nodes' datasets read as one.
HOST = pa.field("host", pa.string())  # daemon.host, default the machine's host name

# One row per proxied request. Never prompt or completion text.
DAEMON_REQUESTS = pa.schema(
    [
        ("daemon_id", pa.string()),  # one daemon process: request_id is unique within it
        ("request_id", pa.int64()),
        ("t_arrival_utc", TS),
        ("t_first_utc", TS),  # first generated token passed through the proxy
        ("t_last_utc", TS),  # last generated token
        ("t_end_utc", TS),  # response finished (or failed)
        ("ttft_s", pa.float64()),
        ("decode_s", pa.float64()),  # t_last - t_first, monotonic clock
        ("method", pa.string()),
        ("endpoint", pa.string()),  # URL path, no query string
        ("api", pa.string()),  # llamacpp | openai-completions | openai-chat | null (not parsed)
        ("model", pa.string()),
        ("stream", pa.bool_()),
        ("tag", pa.string()),  # client tag header, truncated to 128 characters
        ("status", pa.int32()),  # HTTP status sent to the client
        ("outcome", pa.string()),  # ok | client_disconnected | upstream_error | upstream_unreachable | interrupted
        ("error", pa.string()),
        ("prompt_tokens", pa.int32()),
        ("generated_tokens", pa.int32()),
        ("decode_tokens", pa.int32()),  # generated - 1
        ("token_source", pa.string()),  # usage | timings | counted | none
        ("stop_reason", pa.string()),
        ("response_bytes", pa.int64()),
        ("gpu_energy_j", pa.float64()),  # its share of every interval it was live in, by its work there
        ("cpu_energy_j", pa.float64()),  # same split of RAPL package+DRAM energy
        ("attributed_tokens", pa.float64()),  # its tokens inside closed intervals (all of them)
        ("gpu_j_per_token", pa.float64()),  # gpu_energy_j / attributed_tokens
        ("recorder_error", pa.string()),  # recording failed (traffic still flowed)
        HOST,
    ]
)

# One row per sample interval: the energy between two consecutive GPU samples and who used it.
DAEMON_INTERVALS = pa.schema(
    [
        ("daemon_id", pa.string()),
        ("t_start_utc", TS),
        ("t_end_utc", TS),
        ("t_start_mono_s", pa.float64()),  # monotonic seconds since the daemon started
        ("duration_s", pa.float64()),
        ("kind", pa.string()),  # idle | decode | prefill (prefill or mixed) | unproxied: a label
        ("gpu_energy_j", pa.float64()),  # all sampled GPUs
        ("cpu_energy_j", pa.float64()),  # RAPL package + DRAM, null without RAPL
        ("energy_method", pa.string()),  # counter | power_integration | none (weakest of the GPUs)
        ("avg_gpu_power_w", pa.float64()),
        ("proxy_tokens", pa.float64()),  # tokens that passed through the proxy in the interval
        ("server_tokens", pa.float64()),  # tokens the server's own metrics counted (null: not scraped)
        ("n_prefill", pa.int32()),  # requests in prefill during the interval
        ("n_decoding", pa.int32()),  # requests decoding during the interval
        ("requests_energy_j", pa.float64()),  # given to the requests live in it, by their work
        ("idle_energy_j", pa.float64()),  # the part no request was live in, at the idle power
        ("unproxied_energy_j", pa.float64()),  # to server-counted tokens beyond the proxy's
        ("prefill_tokens", pa.float64()),  # prompt tokens prefilled in it (spread over arrival → first token)
        ("work_costs", pa.string()),  # fixed (documented ratio) | fitted: the costs that split it
        HOST,
    ]
)

# One row per tuner decision (`powerprof tune`, docs/tuner.md): every change of level and every verdict, with its reason.
TUNER_DECISIONS = pa.schema(
    [
        ("time_utc", TS),
        ("t_mono_s", pa.float64()),  # monotonic seconds since the tuner started
        ("action", pa.string()),  # start | explore | accept | reject | backoff | restore | hold | regime | kill | stale | resume | thin | stop
        ("knob", pa.string()),  # power | clock
        ("from_level", pa.float64()),  # W or MHz
        ("to_level", pa.float64()),
        ("applied", pa.bool_()),  # false in dry-run mode: only recommended
        ("reason", pa.string()),
        ("regime", pa.string()),  # traffic regime the decision was taken in
        ("j_per_token", pa.float64()),  # the judged window's figure behind the verdict, if any
        ("slo_ratio", pa.float64()),  # its worst p95 over its SLO
        ("gpus", pa.string()),  # comma-separated NVML indexes
        HOST,
    ]
)

# One row per fit of the work model's costs (daemon/workmodel.py), per GPU setting.
DAEMON_COSTS = pa.schema(
    [
        ("daemon_id", pa.string()),
        ("time_utc", TS),  # end of the last interval in the window
        ("power_limits_w", pa.string()),  # the setting: each sampled GPU's limit, comma separated
        ("n_intervals", pa.int32()),  # intervals in the rolling window
        ("n_busy", pa.int32()),  # of which with work
        ("idle_w", pa.float64()),  # intercept: power with nothing running
        ("step_j", pa.float64()),  # per engine step (shared by the sequences in it)
        ("decode_j", pa.float64()),  # per generated token
        ("prefill_j", pa.float64()),  # per prompt token
        ("ctx_j_per_ktoken", pa.float64()),  # per generated token per 1000 tokens of context
        ("r2", pa.float64()),  # over the window's busy intervals
        ("rel_rmse", pa.float64()),  # RMS residual / mean busy-interval energy
        ("mature", pa.bool_()),  # used to split intervals (else the fixed ratio is)
        ("not_mature_reason", pa.string()),
        HOST,
    ]
)

# One row per application-defined tag window (powerprof tag start|stop NAME).
DAEMON_TAGS = pa.schema(
    [
        ("daemon_id", pa.string()),
        ("name", pa.string()),
        ("t_start_utc", TS),
        ("t_end_utc", TS),
        ("duration_s", pa.float64()),
        ("gpu_energy_j", pa.float64()),  # counter read on demand at both edges
        ("cpu_energy_j", pa.float64()),
        ("energy_method", pa.string()),
        ("proxy_tokens", pa.float64()),  # tokens through the proxy inside the window
        ("gpu_j_per_token", pa.float64()),
        ("closed_by", pa.string()),  # stop | shutdown
        HOST,
    ]
)

# The daemon's samples: the sweep's SAMPLES columns, then the host.
DAEMON_SAMPLES = pa.schema(list(SAMPLES) + [HOST])

DAEMON_TABLES = {
    "samples": DAEMON_SAMPLES,
    "requests": DAEMON_REQUESTS,
    "intervals": DAEMON_INTERVALS,
    "tags": DAEMON_TAGS,
    "costs": DAEMON_COSTS,
}
TABLES.update({"daemon_requests": DAEMON_REQUESTS, "daemon_intervals": DAEMON_INTERVALS, "daemon_tags": DAEMON_TAGS,
               "daemon_costs": DAEMON_COSTS})


KNOB_PREFIX = "knob_"  # a configuration sweep's knobs: one column each, named by the user (--vary draft=... → knob_draft)


def with_knob_columns(table: pa.Table, rows) -> pa.Table:
    """Append a column for every knob_* key the rows carry: int64 when every value is an integer,
    float64 when every value is a number, string otherwise."""
    rows = list(rows)
    names = sorted({k for r in rows for k in r if k.startswith(KNOB_PREFIX)})
    for name in names:
        vals = [r.get(name) for r in rows]
        present = [v for v in vals if v is not None]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            typ = pa.int64()
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
            typ = pa.float64()
        else:
            typ = pa.string()
            vals = [None if v is None else str(v) for v in vals]
        table = table.append_column(pa.field(name, typ), pa.array(vals, typ))
    return table


def rows_to_table(schema: pa.Schema, rows, fill: dict | None = None) -> pa.Table:
    """Rows (dicts keyed by column name; missing keys are null, or their value in `fill`: columns
    every row shares, such as the daemon's host) → a table of `schema`: the one converter.

    Timestamps travel as integer nanoseconds since the epoch (UTC), as the sampler and the clocks
    give them, and are truncated to the schema's microseconds only here; datetime objects are
    accepted too."""
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
