"""Shared by bench/attribution_accuracy.py and its test: replay a trace through the daemon in front of
the simulated continuous-batching server, and score the daemon's per-request energy against the
simulator's truth (docs/simulator.md), next to time-share and token-share splits of the same intervals.

Every request carries `X-Sim-Request-Id: i` (the simulator's truth key) and the tag `NAME#i`
(the daemon's rows key; NAME is the trace's tag), so rows and truth match one to one.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as pads

from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams, detect_server, new_session
from powerprof.workload.replay import replay_async
from powerprof.workload.trace import TraceRequest

MIN_TOKENS_SCORED = 32  # per-request errors are scored on requests with at least this many tokens
MIN_TAG_TOKENS = 2000


@dataclass
class Outcome:
    requests: pd.DataFrame  # one row per proxied request: truth and the three estimates
    intervals: pd.DataFrame
    costs: pd.DataFrame
    measured_j: float  # GPU counters' total over the daemon's life
    bypass_truth_j: float
    unproxied_j: float
    client_tokens: int  # tokens the proxied clients received
    wall_s: float
    late_p95_s: float
    notes: list = field(default_factory=list)
    truth: dict = field(default_factory=dict)  # the simulator's record per truth key (prefill span, emissions)
    edge_reads: int = 0  # energy-counter reads at short requests' edges
    edge_cpu_s: float = 0.0  # the CPU those reads cost in all, as the daemon measured it
    tags: pd.DataFrame | None = None  # the daemon's tag rows (`tag`: one window over the trace)
    tag_answer: dict | None = None  # what `powerprof tag stop` was answered
    data_dir: Path | None = None  # the daemon's datasets
    bypass_tokens: np.ndarray | None = None  # run_mixed's bypass traffic: each token's UTC instant (ns), the server's
    # run_mixed's scrape windows of the server's token counter as the ledger was given them, (W, 2) UTC ns (start, end):
    # the daemon spreads each window's bypass tokens evenly over it, so these bound where it can place them.
    scrape_windows_ns: np.ndarray | None = None


def _record_windows(ledger, out: list) -> None:
    """Every scrape window the daemon gives `ledger` from now on, appended to `out` as (start, end) monotonic ns (the
    ledger's own rule for a window with no start: its last nanosecond)."""
    add = ledger.add_server_tokens

    def recorded(t_ns, delta, since_ns=None, *args, **kwargs):
        out.append((int(since_ns) if since_ns is not None and since_ns < t_ns else int(t_ns) - 1, int(t_ns)))
        return add(t_ns, delta, since_ns, *args, **kwargs)

    ledger.add_server_tokens = recorded


async def _started(daemon, interval_s: float) -> asyncio.Task:
    """The daemon running, its proxy listening, and 8 idle intervals behind it (the idle power measured)."""
    task = asyncio.create_task(daemon.run())
    for _ in range(400):
        if "proxy" in daemon.urls:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(8 * interval_s)
    return task

async def _settled(daemon, interval_s: float, end_ns: int) -> None:
    """Until the ledger has closed every interval up to `end_ns` (the traffic's end, monotonic) by its own close and
    made every row (`Ledger.settled`), at most 3 intervals and 1 s: the stop's close after that is over idle intervals
    alone. A fixed wait of that bound took ~4 s where ~1.8 s was needed (a request's row out on a quiet server)."""
    deadline = time.monotonic() + 3 * interval_s + 1.0
    while time.monotonic() < deadline and not daemon.ledger.settled(end_ns):
        await asyncio.sleep(0.05)


def _read(data: Path, name: str) -> pd.DataFrame:
    p = data / name
    if not p.exists():
        return pd.DataFrame()
    return pads.dataset(p, partitioning="hive").to_table().to_pandas()


def run(trace: list[TraceRequest], bypass: set[int] = frozenset(), profile="h200-141g", interval_s: float = 1.0,
        n_slots: int = 64, tail: list[TraceRequest] = (), tail_gap_s: float = 1.5, data_dir: Path | None = None,
        config: dict | None = None, flavour: str = "vllm", tag: str | None = None) -> Outcome:
    """Replay `trace` (indexes in `bypass` straight to the server, the rest through the proxy), then
    `tail` one at a time with `tail_gap_s` between (identical requests, measured alone). `config`:
    more daemon settings ("section.key": value). profile: a key or a GpuProfile (a variant, e.g. without
    an energy counter). flavour: the simulated server's (vLLM's counter moves every step, SGLang's at request end).
    tag: a tag window of that name opened (as `powerprof tag start` does) just before the trace and stopped once every
    request of it (proxied and bypass) has ended, before the tail."""
    tmp = Path(data_dir or tempfile.mkdtemp(prefix="pp-attr-"))
    tmp.mkdir(parents=True, exist_ok=True)  # a --keep folder to be: the daemon makes only its data dir, not above it
    nvml = SimNVML(profile, state_path=None)
    srv = SimServer(nvml, flavour=flavour, n_slots=n_slots, batching="continuous").start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp / "data"), "daemon.interval_s": interval_s, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp / "pp.sock"), **(config or {}),
    })
    daemon = Daemon(cfg, Rig(profile if isinstance(profile, str) else profile.key, nvml=nvml, host=False))
    full = list(trace)
    n_main = len(full)
    params = RequestParams(max_tokens=16, ignore_eos=True)
    answer: dict = {}

    async def main():
        task = await _started(daemon, interval_s)
        if tag is not None:
            await daemon.tag_start(tag)
        async with new_session() as s:
            via_proxy = await detect_server(s, daemon.urls["proxy"])
            direct = await detect_server(s, srv.url)
            # Two replays from the same start, keeping the trace's offsets: proxied and bypass.
            p_idx = [i for i in range(n_main) if i not in bypass]
            b_idx = sorted(bypass)
            t0 = time.monotonic()
            recs = await asyncio.gather(
                _replay_subset(s, via_proxy, [full[i] for i in p_idx], p_idx, params),
                _replay_subset(s, direct, [full[i] for i in b_idx], b_idx, params),
            )
            wall = time.monotonic() - t0
            if tag is not None:
                answer.update(await daemon.tag_stop(tag))
            tail_recs = []
            for k, r in enumerate(tail):
                await asyncio.sleep(tail_gap_s)
                tail_recs += await _replay_subset(s, via_proxy, [TraceRequest(0.0, r.prompt_tokens, r.output_tokens, r.tag)],
                                                  [n_main + k], params)
        await _settled(daemon, interval_s, time.monotonic_ns())
        daemon.stop_event.set()
        await task
        return recs[0] + tail_recs, recs[1], wall

    try:
        proxied_recs, bypass_recs, wall = asyncio.run(main())
    finally:
        srv.stop()
    data = tmp / "data"
    reqs, intervals, costs, samples, tags = (_read(data, n) for n in ("requests", "intervals", "costs", "samples",
                                                                       "tags"))
    gpu = samples[samples["source"] == "nvml"]
    measured = float(sum(g["energy_j"].max() - g["energy_j"].min() for _, g in gpu.groupby("gpu_index")))
    truth = {t["client_id"]: t for t in srv.truth if t.get("client_id") is not None}
    reqs = reqs[reqs["tag"].notna() & reqs["tag"].str.contains("#")].copy()
    reqs["index"] = reqs["tag"].str.rsplit("#", n=1).str[1].astype(int)
    reqs["tag_name"] = reqs["tag"].str.rsplit("#", n=1).str[0]
    reqs["true_j"] = [truth[str(i)]["energy_j"] if str(i) in truth else np.nan for i in reqs["index"]]
    reqs["true_tokens"] = [truth[str(i)]["generated"] if str(i) in truth else np.nan for i in reqs["index"]]
    reqs["tail"] = reqs["index"] >= n_main
    _baselines(reqs, intervals)
    bypass_truth = float(sum(truth[str(i)]["energy_j"] for i in bypass if str(i) in truth))
    late = [r.late_s for r in proxied_recs + bypass_recs]
    return Outcome(
        requests=reqs, intervals=intervals, costs=costs, measured_j=measured, bypass_truth_j=bypass_truth,
        unproxied_j=float(intervals["unproxied_energy_j"].sum()),
        client_tokens=int(sum(r.record.generated_tokens for r in proxied_recs if r.record.ok)),
        wall_s=wall, late_p95_s=float(np.percentile(late, 95)) if late else 0.0, truth=truth,
        edge_reads=daemon.edge_reads, edge_cpu_s=daemon.edge_cpu_total_s, tags=tags,
        tag_answer=answer if tag is not None else None, data_dir=data,
    )


async def _replay_subset(session, server, items: list[TraceRequest], ids: list[int], params):
    """Replay `items`; request k carries truth key and tag index ids[k]."""
    if not items:
        return []
    sub = [TraceRequest(r.t_s, r.prompt_tokens, r.output_tokens, f"{r.tag or 'untagged'}#{i}") for r, i in zip(items, ids)]
    return await replay_async(session, server, sub, params, extra_headers=lambda k: {"X-Sim-Request-Id": str(ids[k])})


def _baselines(reqs: pd.DataFrame, intervals: pd.DataFrame) -> None:
    """Time-share and token-share estimates from the same intervals' request energy.

    time share: each interval's request energy split by the time each request was live in it;
    token share: by its tokens there (tokens taken as even over first → last token), by live time
    where no request has a token. Both split exactly what the work model gave to requests, so the
    comparison isolates the split rule."""
    a = reqs["t_arrival_utc"].astype("int64").to_numpy()
    f = reqs["t_first_utc"].astype("int64").to_numpy()
    last = reqs["t_last_utc"].astype("int64").to_numpy()
    e = reqs["t_end_utc"].astype("int64").to_numpy()
    n = reqs["attributed_tokens"].fillna(0).to_numpy()
    s0 = intervals["t_start_utc"].astype("int64").to_numpy()
    s1 = intervals["t_end_utc"].astype("int64").to_numpy()
    ej = intervals["requests_energy_j"].to_numpy()
    live = np.clip(np.minimum(e[:, None], s1[None, :]) - np.maximum(a[:, None], s0[None, :]), 0, None).astype(float)
    span = np.maximum(last - f, 1).astype(float)
    over = np.clip(np.minimum(last[:, None], s1[None, :]) - np.maximum(f[:, None], s0[None, :]), 0, None).astype(float)
    tok = over / span[:, None] * n[:, None]
    single = (last - f) <= 0
    if single.any():  # one event: all its tokens at t_first
        inside = (f[single, None] >= s0[None, :]) & (f[single, None] < s1[None, :])
        tok[single] = inside * n[single, None]

    def split(w):
        tot = w.sum(axis=0)
        return (np.divide(w, tot[None, :], out=np.zeros_like(w), where=tot[None, :] > 0) * ej[None, :]).sum(axis=1)

    reqs["time_share_j"] = split(live)
    tok_w = np.where(tok.sum(axis=0)[None, :] > 0, tok, live)
    reqs["token_share_j"] = split(tok_w)


METHODS = (("time share", "time_share_j"), ("token share", "token_share_j"), ("work model", "gpu_energy_j"))


def score(o: Outcome) -> dict:
    """Every acceptance figure, per method where it applies."""
    r = o.requests
    main = r[~r["tail"] & r["true_j"].notna()]
    # Scored: requests arriving once the fit was mature (a long-running daemon's steady state);
    # the warm-up's requests, split with the fixed ratio, are reported apart ("all requests").
    mature = o.costs[o.costs["mature"]] if len(o.costs) else o.costs
    t_mature = mature["time_utc"].min() if len(mature) else None
    warm = main if t_mature is None else main[main["t_arrival_utc"] >= t_mature]
    scored = warm[warm["true_tokens"] >= MIN_TOKENS_SCORED]
    every = main[main["true_tokens"] >= MIN_TOKENS_SCORED]
    out: dict = {"n_requests": int(len(main)), "n_scored": int(len(scored)), "n_warmup": int(len(main) - len(warm)),
                 "methods": {}}
    tag_tokens = main.groupby("tag_name")["attributed_tokens"].sum()
    big_tags = tag_tokens[tag_tokens >= MIN_TAG_TOKENS].index
    for name, col in METHODS:
        err = (scored[col] - scored["true_j"]) / scored["true_j"]
        err_all = (every[col] - every["true_j"]) / every["true_j"]
        tags = {}
        for t in big_tags:
            g = main[main["tag_name"] == t]
            est = g[col].sum() / g["attributed_tokens"].sum()
            tru = g["true_j"].sum() / g["true_tokens"].sum()
            tags[t] = est / tru - 1
        tail = r[r["tail"]]
        jpt = tail[col] / tail["attributed_tokens"]
        tail_err = ((tail[col] - tail["true_j"]) / tail["true_j"]).dropna()
        out["methods"][name] = {
            "median_abs_err": float(np.median(np.abs(err))) if len(err) else None,
            # Requests alone (the tail): where energy read late by half a window lands outside them.
            "alone_median_abs_err": float(np.median(np.abs(tail_err))) if len(tail_err) else None,
            "p95_abs_err": float(np.percentile(np.abs(err), 95)) if len(err) else None,
            "median_abs_err_all": float(np.median(np.abs(err_all))) if len(err_all) else None,
            "p95_abs_err_all": float(np.percentile(np.abs(err_all), 95)) if len(err_all) else None,
            "tag_err": tags,
            "identical_spread": float((jpt.max() - jpt.min()) / jpt.median()) if len(jpt) > 1 else None,
        }
    tail = r[r["tail"]]
    tj = tail["true_j"] / tail["true_tokens"]
    out["identical_truth_spread"] = float((tj.max() - tj.min()) / tj.median()) if len(tj) > 1 else None
    out["tokens_attributed_share"] = float(r["attributed_tokens"].sum() / o.client_tokens) if o.client_tokens else None
    parts = r["gpu_energy_j"].sum() + o.intervals["idle_energy_j"].sum() + o.unproxied_j
    # Requests without the bench's tag (none expected) would be missing from r: use all intervals.
    parts_all = o.intervals[["requests_energy_j", "idle_energy_j", "unproxied_energy_j"]].to_numpy().sum()
    out["conservation_err"] = float(parts_all / o.measured_j - 1)
    out["requests_vs_intervals_err"] = float(parts / parts_all - 1)
    out["bypass_share_in_unproxied"] = o.unproxied_j / o.bypass_truth_j if o.bypass_truth_j > 0 else None
    a = main["t_arrival_utc"].astype("int64").to_numpy()
    e = main["t_end_utc"].astype("int64").to_numpy()
    ev = np.concatenate([np.stack([a, np.ones_like(a)], 1), np.stack([e, -np.ones_like(e)], 1)])
    ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]
    inflight = np.cumsum(ev[:, 1])
    out["max_in_flight"] = int(inflight.max()) if inflight.size else 0
    out["ttft_p95_s"] = float(main["ttft_s"].quantile(0.95))
    out["fitted_share"] = float((o.intervals["work_costs"] == "fitted").mean()) if len(o.intervals) else 0.0
    out["wall_s"] = o.wall_s
    out["late_p95_s"] = o.late_p95_s
    return out


# --- a mixed trace: the API surface beside plain chat ------------------------------------------------

MIXED_KINDS = ("chat", "chat_n2", "messages", "responses", "embeddings")
MIXED_WEIGHTS = (0.4, 0.15, 0.15, 0.15, 0.15)


# SGLang's native /generate beside its chat: streamed, whole, and a batch (two prompts, n = 2: four sequences).
SGLANG_KINDS = ("chat", "generate", "generate_whole", "generate_batch")
SGLANG_WEIGHTS = (0.4, 0.3, 0.15, 0.15)


def mixed_trace(n: int, rate: float, seed: int = 5, kinds: tuple = MIXED_KINDS,
                weights: tuple = MIXED_WEIGHTS) -> list[TraceRequest]:
    """The bench's synthetic trace (bursty arrivals, lognormal lengths), each request given a kind (its `tag`):
    chat, chat with n = 2, Anthropic messages, OpenAI responses, or an embedding of its prompt (or `kinds`, drawn
    with `weights`: SGLANG_KINDS)."""
    from powerprof.workload.trace import synthetic

    base = synthetic(n, rate, "bursty", prompt_median=300, output_median=60, seed=seed)
    drawn = np.random.default_rng(seed).choice(len(kinds), size=n, p=weights)
    return [TraceRequest(r.t_s, r.prompt_tokens, r.output_tokens, kinds[k]) for r, k in zip(base, drawn)]


def conversation_trace(conversations: int, turns: int, plain: int, rate: float, seed: int = 7) -> list[TraceRequest]:
    """Multi-turn chats beside plain ones: `conversations` conversations of `turns` turns each (tag `turn.C.K`), each
    turn resending the whole history (a 1500-token opening, then 200 tokens a turn; short answers, median 30 tokens, as
    in Azure's conversation trace), so that on a server with prefix caching all of a turn's prompt but its newest ~200
    tokens is cached; and `plain` single chats of unique prompts
    (tag `chat`, lognormal lengths about 300). Poisson arrivals at `rate` a second, a conversation's turns in order."""
    rng = np.random.default_rng(seed)
    kinds = [f"turn.{c}.{k}" for k in range(turns) for c in range(conversations)] + ["chat"] * plain
    order = rng.permutation(len(kinds))
    slots: dict = {}  # a conversation's turns take its arrival slots in order (turn k never before turn k - 1)
    for pos, j in enumerate(order):
        slots.setdefault(kinds[j].rsplit(".", 1)[0] if kinds[j] != "chat" else f"chat{pos}", []).append(pos)
    tagged = [""] * len(kinds)
    for c in range(conversations):
        for k, pos in enumerate(sorted(slots[f"turn.{c}"])):
            tagged[pos] = f"turn.{c}.{k}"
    t = np.cumsum(rng.exponential(1.0 / rate, size=len(kinds)))
    out = []
    for pos in range(len(kinds)):
        tag = tagged[pos] or "chat"
        turn = tag != "chat"
        p = 1500 + 200 * int(tag.rsplit(".", 1)[1]) if turn else int(np.clip(rng.lognormal(np.log(300), 0.5), 20, 2000))
        out.append(TraceRequest(float(t[pos]), p, int(np.clip(rng.lognormal(np.log(30 if turn else 60), 0.5), 8, 300)),
                                tag))
    return out


def _turn_messages(c: int, k: int) -> list[dict]:
    """Turn k of conversation c: its opening and every earlier turn's question and answer, then this turn's question
    (the simulator joins the messages' text: turn k - 1's prompt is the start of turn k's)."""
    from powerprof.workload.replay import prompt_text

    msgs = [{"role": "user", "content": prompt_text(1500, 100_000 + c)}]
    for j in range(1, k + 1):
        msgs.append({"role": "assistant", "content": " ".join([f"a{c}x{j}"] + ["ok"] * 99)})
        msgs.append({"role": "user", "content": " ".join([f"q{c}x{j}"] + ["why"] * 99)})
    return msgs


def _mixed_request(kind: str, index: int, prompt_tokens: int, output_tokens: int,
                   continuous: bool = False) -> tuple[str, dict]:
    """(path, body) of one request of the mixed trace: streamed with usage, ignoring EOS, as replay sends them; a
    conversation's turn (`turn.C.K`, conversation_trace) its whole history as chat. continuous: its chat streams ask
    for the running usage on every chunk too (`continuous_usage_stats`: vLLM says the prompt's length early, its
    cached count only in the final usage)."""
    from powerprof.workload.replay import prompt_text

    usage = {"include_usage": True, **({"continuous_usage_stats": True} if continuous else {})}

    text = prompt_text(prompt_tokens, index)
    n = max(1, output_tokens)
    if kind.startswith("turn."):
        _, c, k = kind.split(".")
        return "/v1/chat/completions", {"messages": _turn_messages(int(c), int(k)), "max_tokens": n, "stream": True,
                                        "ignore_eos": True, "stream_options": usage}
    if kind == "embeddings":
        return "/v1/embeddings", {"input": text, "model": "sim"}
    if kind.startswith("generate"):  # SGLang's native /generate
        sp = {"max_new_tokens": n, "ignore_eos": True}
        if kind == "generate_batch":
            half = prompt_text(max(prompt_tokens // 2, 1), index + 1)
            return "/generate", {"text": [text, half], "sampling_params": dict(sp, n=2), "stream": True}
        if kind.startswith("generate_n2"):  # one prompt, two choices: SGLang prefills it apart first
            # `_again`: one prompt every time, which that prefill finds cached from the time before (said nowhere).
            again = kind == "generate_n2_again"
            return "/generate", {"text": prompt_text(1500, 7) if again else text, "sampling_params": dict(sp, n=2),
                                 "stream": True}
        return "/generate", {"text": text, "sampling_params": sp, "stream": kind == "generate"}
    msgs = [{"role": "user", "content": text}]
    # `K_stop`: chat kind K without ignore_eos: the simulated model stops on its own (16-63 tokens), as real answers do.
    stop = kind.endswith("_stop")
    kind = kind.removesuffix("_stop")
    if kind == "messages":
        return "/v1/messages", {"messages": msgs, "max_tokens": n, "stream": True, "ignore_eos": True}
    if kind == "responses":
        return "/v1/responses", {"input": text, "max_output_tokens": n, "stream": True, "ignore_eos": True}
    body = {"messages": msgs, "max_tokens": n, "stream": True, "ignore_eos": True, "stream_options": usage}
    if kind == "chat_n2":
        body["n"] = 2
    elif kind == "chat_plain":  # as a user's curl sends it: no usage asked (llama-server's count is its timings')
        del body["stream_options"]
    elif kind == "chat_logprobs":  # each chunk lists its tokens (llama-server: none for a token without text)
        body["logprobs"] = True
    elif kind == "chat_echo":  # vLLM streams the last (assistant) message back first, no token (chatshape.chat_echo)
        body.update(echo=True, messages=msgs + [{"role": "assistant", "content": "Once upon a time"}])
    elif kind.startswith("chat_tool"):  # a forced tool call: its answer streamed as the call's argument deltas
        body["tools"] = [{"type": "function", "function": {"name": "get_power", "parameters": {"type": "object"}}}]
        body["tool_choice"] = ({"type": "function", "function": {"name": "get_power"}} if kind == "chat_tool_named"
                               else "required")
        if kind == "chat_tool_plain":  # no usage asked: the prompt (the tools' schemas in it) estimated from its size
            del body["stream_options"]
    if stop:
        del body["ignore_eos"]
    return "/v1/chat/completions", body


BYPASS_ID0 = 100_000  # run_mixed's bypass requests' truth keys, from here


def run_mixed(trace: list[TraceRequest], profile="h200-141g", interval_s: float = 1.0, n_slots: int = 64,
              data_dir: Path | None = None, config: dict | None = None, flavour: str = "llamacpp",
              server: dict | None = None, continuous: bool = False, bypass: list[TraceRequest] = ()) -> Outcome:
    """Replay a mixed trace (`mixed_trace`: each request's tag its kind) through the daemon in front of the simulated
    continuous-batching server (llama.cpp flavour by default: llama-server serves all five kinds at once, with
    `--embeddings`); every request through the proxy. The Outcome's requests carry `kind` and the truth summed over
    each request's sequences (`SimServer.request_truth`). `server`: more SimServer knobs (say `delivery`: "buffered",
    a buffering proxy between the server and the daemon's). continuous: chat streams ask for continuous usage
    (`_mixed_request`). bypass: chat requests sent straight to the server beside the trace (its offsets), truth keys
    BYPASS_ID0 + k: their true energy is the Outcome's bypass_truth_j, each of their tokens' instants its bypass_tokens."""
    tmp = Path(data_dir or tempfile.mkdtemp(prefix="pp-attr-mixed-"))
    tmp.mkdir(parents=True, exist_ok=True)  # a --keep folder to be: the daemon makes only its data dir, not above it
    nvml = SimNVML(profile, state_path=None)
    srv = SimServer(nvml, flavour=flavour, n_slots=n_slots, batching="continuous", embeddings=True,
                    **(server or {})).start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp / "data"), "daemon.interval_s": interval_s, "daemon.flush_interval_s": 5.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp / "pp.sock"), **(config or {}),
    })
    daemon = Daemon(cfg, Rig(profile if isinstance(profile, str) else profile.key, nvml=nvml, host=False))
    statuses: list[int] = []
    windows: list[tuple[int, int]] = []  # (since, at) of each scrape the ledger is given, monotonic ns

    async def one(s, url, i, r, t0):
        await asyncio.sleep(max(0.0, t0 + r.t_s - time.monotonic()))
        path, body = _mixed_request(r.tag, i, r.prompt_tokens, r.output_tokens, continuous)
        headers = {"X-Sim-Request-Id": str(i), "X-Powerprof-Tag": f"{r.tag}#{i}"}
        async with s.post(url + path, json=body, headers=headers) as resp:
            await resp.read()
            statuses.append(resp.status)

    async def direct(s, k, r, t0):
        await asyncio.sleep(max(0.0, t0 + r.t_s - time.monotonic()))
        path, body = _mixed_request("chat", BYPASS_ID0 + k, r.prompt_tokens, r.output_tokens, continuous)
        async with s.post(srv.url + path, json=body, headers={"X-Sim-Request-Id": str(BYPASS_ID0 + k)}) as resp:
            await resp.read()

    async def main():
        import aiohttp

        task = await _started(daemon, interval_s)
        _record_windows(daemon.ledger, windows)
        # The bypass clients' own connections, one a request: the llama.cpp flavour closes a connection after a
        # stream without saying so (as llama-server does), and a client reusing it on a loaded host meets a reset
        # (the race real clients retry): a bypass request lost there would be truth the bench never sent.
        async with new_session() as s, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as sd:
            t0 = time.monotonic()
            await asyncio.gather(*(one(s, daemon.urls["proxy"], i, r, t0) for i, r in enumerate(trace)),
                                 *(direct(sd, k, r, t0) for k, r in enumerate(bypass)))
            wall = time.monotonic() - t0
        await _settled(daemon, interval_s, time.monotonic_ns())
        daemon.stop_event.set()
        await task
        return wall

    try:
        wall = asyncio.run(main())
    finally:
        srv.stop()
    data = tmp / "data"
    reqs, intervals, costs, samples, tags = (_read(data, n) for n in ("requests", "intervals", "costs", "samples",
                                                                       "tags"))
    gpu = samples[samples["source"] == "nvml"]
    measured = float(sum(g["energy_j"].max() - g["energy_j"].min() for _, g in gpu.groupby("gpu_index")))
    truth = srv.request_truth()
    wall_off = time.time_ns() - time.monotonic_ns()  # the simulator stamps emissions on the monotonic clock
    by_ids = {str(BYPASS_ID0 + k) for k in range(len(bypass))}
    bypass_tokens = np.sort(np.concatenate([np.repeat(np.int64(t + wall_off), n) for row in srv.truth
                                            if row.get("client_id") in by_ids for t, n in row["emissions"]]
                                           or [np.zeros(0, dtype=np.int64)]))
    bypass_truth = float(sum(truth[i]["energy_j"] for i in by_ids if i in truth))
    reqs = reqs[reqs["tag"].notna() & reqs["tag"].str.contains("#")].copy()
    reqs["index"] = reqs["tag"].str.rsplit("#", n=1).str[1].astype(int)
    reqs["kind"] = reqs["tag"].str.rsplit("#", n=1).str[0].str.split(".").str[0]  # turn.C.K: a turn
    reqs["true_j"] = [truth[str(i)]["energy_j"] if str(i) in truth else np.nan for i in reqs["index"]]
    reqs["true_tokens"] = [truth[str(i)]["generated"] if str(i) in truth else np.nan for i in reqs["index"]]
    reqs["true_cached"] = [truth[str(i)].get("cached_tokens", np.nan) if str(i) in truth else np.nan
                           for i in reqs["index"]]
    # When the engine worked on each request, UTC ns: its first prefill step's start (on the engine's schedule, as its
    # truth's energy) to its last token. Its row's span (the proxy's arrival to its end) beyond that is time the GPU
    # idled with it live (not yet forwarded, queued, its end read late: a loaded host), the daemon's and not the truth's.
    span: dict = {}
    for row in srv.truth:
        cid, t0 = row.get("client_id"), row.get("t_prefill_start_sched_ns")
        if cid is None or t0 is None:
            continue
        t1 = max([row.get("t_prefill_end_ns") or t0, *(t for t, _n in row.get("emissions") or ())])
        a, b = span.get(cid, (t0, t1))
        span[cid] = (min(a, t0), max(b, t1))
    reqs["true_start_ns"] = [span[str(i)][0] + wall_off if str(i) in span else np.nan for i in reqs["index"]]
    reqs["true_end_ns"] = [span[str(i)][1] + wall_off if str(i) in span else np.nan for i in reqs["index"]]
    scrape_windows = np.array(windows, dtype=np.int64).reshape(-1, 2) + wall_off
    return Outcome(requests=reqs, intervals=intervals, costs=costs, measured_j=measured, bypass_truth_j=bypass_truth,
                   unproxied_j=float(intervals["unproxied_energy_j"].sum()), client_tokens=0, wall_s=wall,
                   late_p95_s=0.0, truth=truth, bypass_tokens=bypass_tokens,
                   scrape_windows_ns=scrape_windows, notes=[f"HTTP {c}: {statuses.count(c)}" for c in sorted(set(statuses))]
                   + [f"uncounted {k}: {v}" for k, v in sorted(daemon.uncounted_requests.items())]
                   + [f"proxy workers: {sum(bool(getattr(w, 'said_hello', False)) for w in getattr(daemon.proxy, 'workers', ()))}"]
                   + [f"{flag} requests: {n}" for flag, n in daemon.ledger.flagged_requests.items()])


def score_mixed(o: Outcome) -> dict:
    """Per kind: requests, the sum error (Σ estimated / Σ true − 1) and the per-request |error| median and p95 of
    the daemon's GPU energy against truth (a request given no share counts as 0 J: −100%); over requests arriving
    once the fit was mature, as `score` does."""
    r = o.requests[o.requests["true_j"].notna()]
    mature = o.costs[o.costs["mature"]] if len(o.costs) else o.costs
    t_mature = mature["time_utc"].min() if len(mature) else None
    scored = r if t_mature is None else r[r["t_arrival_utc"] >= t_mature]
    out: dict = {"n_requests": int(len(r)), "n_scored": int(len(scored)), "kinds": {}, "kinds_all": {}}
    for key, frame in (("kinds", scored), ("kinds_all", r)):
        for kind, g in frame.groupby("kind"):
            est = g["gpu_energy_j"].fillna(0.0)
            err = (est - g["true_j"]) / g["true_j"]
            out[key][kind] = {
                "n": int(len(g)), "true_j": float(g["true_j"].sum()), "est_j": float(est.sum()),
                "sum_err": float(est.sum() / g["true_j"].sum() - 1),
                "median_abs_err": float(np.median(np.abs(err))), "p95_abs_err": float(np.percentile(np.abs(err), 95)),
                "no_share": int(g["gpu_energy_j"].isna().sum()),
            }
    parts_all = o.intervals[["requests_energy_j", "idle_energy_j", "unproxied_energy_j"]].to_numpy().sum()
    out["conservation_err"] = float(parts_all / o.measured_j - 1) if o.measured_j else None
    out["unproxied_j"] = o.unproxied_j
    out["requests_true_j"] = float(r["true_j"].sum())
    out["requests_est_j"] = float(r["gpu_energy_j"].fillna(0.0).sum())
    out["notes"] = o.notes
    return out
