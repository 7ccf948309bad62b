"""The simulated server's own promises: metrics semantics, busy flag, speculative drafts, GPU phases."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time

import aiohttp
import pytest

from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams
from powerprof.workload.load import Prompt, builtin_prompts, run_load


async def _get(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return await r.text()


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


async def _metric_during_stream(url: str, path: str, body: dict, name: str):
    """Value of a metric after the third token event of a running stream, and after the stream."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            seen = 0
            mid = None
            async for line in r.content:
                if line.startswith(b"data:"):
                    seen += 1
                    if seen == 3:
                        mid = _metric(await _get(url + "/metrics"), name)
        end = _metric(await _get(url + "/metrics"), name)
    return mid, end


def test_llamacpp_counter_grows_only_at_request_end_vllm_every_step():
    # A 0.6 s stream: long enough that a /metrics read on a loaded machine still lands mid-stream.
    body = {"prompt": "hi", "n_predict": 120, "max_tokens": 120, "stream": True, "ignore_eos": True}
    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=200) as s:
        mid, end = asyncio.run(_metric_during_stream(s.url, "/completion", body, "llamacpp:tokens_predicted_total"))
        assert (mid, end) == (0.0, 120.0)
    with SimServer(SimNVML("a100-40g", state_path=None), flavour="vllm", decode_tok_s=200) as s:
        mid, end = asyncio.run(_metric_during_stream(s.url, "/v1/completions", body, "vllm:generation_tokens_total"))
        assert 0 < mid < 120 and end == 120.0


def test_busy_flag_follows_work_and_gpu_goes_idle():
    nvml = SimNVML("a100-40g", state_path=None)
    with SimServer(nvml, decode_tok_s=300) as s:
        changes = []
        s.on_busy(changes.append)
        run_load(s.url, [Prompt("p", "hello")], 1, 1, RequestParams(max_tokens=10), warmup=0)
        for _ in range(100):
            if not s.busy:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert changes[:1] == [True] and changes[-1] is False
        assert nvml.gpus[0].read()["phase"].kind == "idle"


def test_speculative_profile_reports_drafts_and_multi_token_events():
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=300) as s:
        (r,) = run_load(s.url, builtin_prompts("short")[:1], 1, 1, RequestParams(max_tokens=40), warmup=0)
    assert r.ok and r.generated_tokens == 40
    assert r.draft_n and 0 < r.draft_n_accepted < r.draft_n
    assert max(r.event_tokens) > 1 and len(r.event_tokens) < 40


async def _read_then_hang_up(url: str, body: dict, events: int) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/completion", json=body) as r:
            seen = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    seen += 1
                    if seen == events:
                        break  # leaving the block unread closes the connection, as an interrupted sweep does


def test_client_hanging_up_mid_stream_is_no_error_and_frees_the_slot(caplog):
    nvml = SimNVML("a100-40g", state_path=None)
    body = {"prompt": "hi", "n_predict": 5000, "stream": True, "ignore_eos": True}
    with caplog.at_level(logging.DEBUG, logger="aiohttp"):
        with SimServer(nvml, decode_tok_s=500) as s:
            asyncio.run(_read_then_hang_up(s.url, body, 3))
            for _ in range(200):  # the server notices at its next write, within a few token events
                if not s.busy:
                    break
                time.sleep(0.01)
            assert not s.busy  # the request was dropped, not decoded to the end for nobody
            assert nvml.gpus[0].read()["phase"].kind == "idle"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_continuous_batching_truth_gives_every_busy_joule_to_the_requests_in_its_steps():
    # Truth (docs/simulator.md): each step's energy over its window on the engine's schedule, split
    # among its sequences. The windows tile the busy time, so the requests' truths add up to the
    # GPU's energy while busy, and a prompt's part is inside its request's.
    nvml = SimNVML("h200-141g", state_path=None)
    g = nvml.gpus[0]
    with SimServer(nvml, flavour="vllm", n_slots=8, batching="continuous") as s:
        e0 = g.true_energy_j()
        t0 = time.monotonic_ns()
        run_load(s.url, [Prompt("p", "word " * 300)], 8, 4, RequestParams(max_tokens=40, ignore_eos=True), warmup=0)
        for _ in range(200):
            if not s.busy:
                break
            time.sleep(0.01)
        t1 = time.monotonic_ns()
        e1 = g.true_energy_j()
        truth = list(s.truth)
    busy0 = min(t["t_prefill_start_ns"] for t in truth)
    busy1 = max(t["emissions"][-1][0] for t in truth)
    idle_j = g.profile.idle_power_w * ((busy0 - t0) + (t1 - busy1)) / 1e9
    assert len(truth) == 8
    assert sum(t["energy_j"] for t in truth) == pytest.approx(e1 - e0 - idle_j, rel=0.05)
    assert all(0 < t["prefill_energy_j"] < t["energy_j"] for t in truth)


def test_the_step_schedule_a_stalled_loop_catches_up_or_restarts_is_in_the_truth():
    # The virtual-vs-live cross-check (tests/test_sim_virtual_vs_realtime.py) compares the engines on the GPU's
    # timeline, the step schedule: a request's first step's start on it, and every stall past STEP_CATCH_UP_NS
    # (the schedule restarted: the GPU lost that time) as a (schedule, wake-up) pair.
    from powerprof.sim.server import STEP_CATCH_UP_NS

    with SimServer(SimNVML("a100-40g", state_path=None), flavour="vllm", n_slots=4, batching="continuous",
                   decode_tok_s=50) as s:
        stall_s = STEP_CATCH_UP_NS / 1e9 + 0.3

        async def go():
            async with aiohttp.ClientSession() as http:
                body = {"model": "m", "prompt": "word " * 20, "max_tokens": 60, "ignore_eos": True}
                async with http.post(s.url + "/v1/completions", json=body) as r:
                    await r.read()

        def stall_later():
            time.sleep(0.3)  # mid-answer: 60 tokens at 50 tok/s take ~1.2 s
            s._loop.call_soon_threadsafe(time.sleep, stall_s)  # blocks the server's own loop

        th = threading.Thread(target=stall_later)
        th.start()
        asyncio.run(go())
        th.join()
        truth = list(s.truth)
        restarts = list(s.schedule_restarts)
    assert len(truth) == 1
    assert 0 < truth[0]["t_prefill_start_sched_ns"] <= truth[0]["t_prefill_start_ns"]
    assert truth[0]["t_arrive_ns"] <= truth[0]["t_prefill_start_sched_ns"]  # idle when it came: the schedule starts then
    assert len(restarts) == 1
    was, woke = restarts[0]
    assert stall_s - 0.1 <= (woke - was) / 1e9 <= stall_s + 1.0


def test_connections_are_handled_as_llama_server_and_uvicorn_handle_them():
    # Before: both flavours kept every connection open after a stream, for an hour when idle, so no test met the
    # kept-alive connection llama-server closes under its client (tests/test_real_llama_server.py checks the real one
    # says and does the same as the llama.cpp flavour).
    from support import connection_behaviour

    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=400) as s:
        llama = connection_behaviour(s.port)
    said = {"status": "200", "keep-alive": "timeout=5, max=100"}
    assert llama == {"stream_headers": said, "kept_after_stream": False,  # closed, without `Connection: close`
                     "json_headers": said, "kept_after_json": True,
                     "404_headers": {"status": "404", "connection": "close"}, "kept_after_404": False}
    with SimServer(SimNVML("a100-40g", state_path=None), flavour="vllm", decode_tok_s=400) as s:
        vllm = connection_behaviour(s.port, "/v1/completions")
    assert vllm == {"stream_headers": {"status": "200"}, "kept_after_stream": True, "json_headers": {"status": "200"},
                    "kept_after_json": True, "404_headers": {"status": "404"}, "kept_after_404": True}
    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=400, close_after_stream=False) as s:
        assert connection_behaviour(s.port)["kept_after_stream"] is True


@pytest.mark.parametrize("flavour", ["llamacpp", "vllm"])
def test_an_idle_connection_is_closed_after_idle_close_s(flavour):
    from support import idle_close_s

    nvml = SimNVML("a100-40g", state_path=None)
    assert SimServer(nvml, flavour=flavour).idle_close_s == 5.0  # uvicorn's and cpp-httplib's default
    with SimServer(nvml, flavour=flavour, idle_close_s=0.4) as s:
        assert 0.35 < idle_close_s(s.port, limit_s=10) < 5.0
    with SimServer(nvml, flavour=flavour, idle_close_s=None) as s:
        assert idle_close_s(s.port, limit_s=1.0) is None  # never, as before (a connection open 1 s past the rest)


def test_llamacpp_closes_a_connection_after_its_100th_answer_saying_so():
    import http.client

    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=400) as s:
        c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        said = []
        for _ in range(100):
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            said.append(r.getheader("Connection"))
        c.close()
    assert said == [None] * 99 + ["close"]  # cpp-httplib's CPPHTTPLIB_KEEPALIVE_MAX_COUNT, as `max=100` says


async def _reads(url: str, body: dict) -> list[tuple[float, int]]:
    """(monotonic s, bytes) of each read of a streamed answer, as the client got them."""
    out = []
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        async for chunk in r.content.iter_any():
            out.append((time.monotonic(), len(chunk)))
    return out


def _groups(reads: list[tuple[float, int]], gap_s: float = 0.05) -> list[tuple[float, int]]:
    """Reads closer than gap_s merged: (time of the group's last read, its bytes)."""
    groups: list[list] = []
    for t, n in reads:
        if groups and t - groups[-1][0] < gap_s:
            groups[-1] = [t, groups[-1][1] + n]
        else:
            groups.append([t, n])
    return [tuple(g) for g in groups]


@pytest.mark.parametrize("knobs", [{"burst_bytes": 4096}, {"burst_bytes": None, "burst_every_s": 0.3}],
                         ids=["full", "timer"])
def test_a_hop_that_flushes_its_buffer_delivers_a_stream_in_several_bursts(knobs):
    # delivery="bursts": a buffering hop passing on what it holds when it reaches burst_bytes, or burst_every_s after
    # its first byte, and the rest at the end; the bytes are the streamed answer's, unchanged.
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150, "stream": True, "ignore_eos": True}
    with SimServer(flavour="vllm", decode_tok_s=150.0, delivery="bursts", **knobs) as srv:
        bursts = _groups(asyncio.run(_reads(srv.url, body)))
        srv.delivery = "stream"
        streamed = asyncio.run(_reads(srv.url, body))
    assert sum(n for _, n in bursts) == sum(n for _, n in streamed)
    assert len(bursts) >= 3, bursts  # 150 tokens at 150/s: over 20 kB in 1 s
    if knobs.get("burst_bytes"):
        assert all(n >= 4096 for _, n in bursts[:-1]), bursts
    else:
        gaps = [b[0] - a[0] for a, b in zip(bursts, bursts[1:-1])]
        assert all(0.2 <= g <= 0.6 for g in gaps), gaps  # the timer's 0.3 s, with margin for a loaded host


# Each flavour's server aborts a request whose client left as it does (docs/simulator.md, "A client that leaves"):
# the longest it takes to notice, after the close, and (SGLang's streams) the least. vLLM: at once. llama-server:
# its next 1 s poll (nothing else runs here to wake its wait), a stream's next write during decode. SGLang: a whole
# answer at its tokenizer's next 4 s wait, a stream 2 s after (its background abort task). (Upper bounds with 0.5 s
# for a loaded machine's late event loop.)
_ABORT_WITHIN_S = {("vllm", False): (0.0, 0.5), ("vllm", True): (0.0, 0.5),
                   ("llamacpp", False): (0.0, 1.5), ("llamacpp", True): (0.0, 1.5),
                   ("sglang", False): (0.0, 4.5), ("sglang", True): (1.9, 2.5)}
_PATHS = {"llamacpp": "/completion", "vllm": "/v1/completions", "sglang": "/v1/completions"}


async def _leave_then_follow(url: str, path: str, first: dict, leave_after_s: float, second: dict) -> tuple[int, float]:
    """`first` sent and its connection closed after `leave_after_s` (a client gone); `second` sent at that moment.
    Returns (monotonic ns of the close, seconds the second took)."""
    async with aiohttp.ClientSession() as s1:
        task = asyncio.create_task(s1.post(url + path, json=first))
        await asyncio.sleep(leave_after_s)
        task.cancel()  # (aiohttp closes the request's connection when its task is cancelled)
        try:
            r = await task
            r.close()
        except asyncio.CancelledError:
            pass
    t_close = time.monotonic_ns()
    async with aiohttp.ClientSession() as s2:
        async with s2.post(url + path, json=second) as r:
            assert r.status == 200
            await r.read()
    return t_close, (time.monotonic_ns() - t_close) / 1e9


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("flavour", ["vllm", "llamacpp", "sglang"])
def test_a_client_leaving_is_aborted_as_its_engine_aborts_it_and_frees_the_batch(flavour, phase, stream):
    # One slot, serial batching: a request left running for nobody would hold the slot (and the GPU) for seconds;
    # aborted, the next request waits only for the server to notice, then for the prefill chunk in flight.
    prefill_tok_s = 8192.0
    n_prompt = 16 * 8192 if phase == "prefill" else 16  # a 16 s prefill, or a short one then a long decode
    first = {"prompt": "w " * (n_prompt - 1), "n_predict": 4000, "max_tokens": 4000, "ignore_eos": True,
             "stream": stream}
    second = {"prompt": "hi", "n_predict": 2, "max_tokens": 2, "ignore_eos": True}
    nvml = SimNVML("a100-40g", state_path=None)
    lo_s, hi_s = _ABORT_WITHIN_S[(flavour, stream)]
    with SimServer(nvml, flavour=flavour, n_slots=1, decode_tok_s=100, prefill_tok_s=prefill_tok_s,
                   n_ctx=1 << 20) as s:
        t_close, second_s = asyncio.run(_leave_then_follow(s.url, _PATHS[flavour], first, 0.6, second))
        for _ in range(300):
            if not s.busy:
                break
            time.sleep(0.02)
        assert not s.busy and nvml.gpus[0].read()["phase"].kind == "idle"  # nothing runs on for nobody
        page = asyncio.run(_get(s.url + "/metrics"))
        gone = [t for t in s.truth_cancelled if t["abort"] == "client_gone"]
        finished = list(s.truth)
    assert len(gone) == 1, s.truth_cancelled
    row = gone[0]
    # The ground truth says when the server noticed and when the engine dropped it, and what it had done.
    assert lo_s <= (row["t_abort_ns"] - t_close) / 1e9 <= hi_s, row
    assert row["t_client_gone_ns"] <= row["t_abort_ns"]
    if phase == "prefill":
        assert row["t_prefill_end_ns"] == 0 and row["generated"] == 0 and 0 < row["prefilled"] < n_prompt
    else:
        assert row["t_prefill_end_ns"] > 0 and row["generated"] > 0
    # The slot was freed: the next request waited for the abort and the chunk in flight (1 s at most), not for the
    # rest of a 16 s prefill or a 40 s decode.
    assert second_s <= hi_s + 1.0 + 0.5, second_s
    assert [t["generated"] for t in finished if t.get("kind") == "generation"][-1] == 2
    # Counted as the real server counts it.
    if flavour == "vllm":  # no success (its front end drops an aborted request's state); its tokens stay counted
        assert _metric(page, "vllm:request_success_total") == 1.0
        assert _metric(page, "vllm:generation_tokens_total") == row["generated"] + 2
    elif flavour == "llamacpp":  # a cancelled slot is released without metrics.on_prediction: its tokens never counted
        assert _metric(page, "llamacpp:tokens_predicted_total") == 2.0
    else:  # the tokenizer manager's abort_request counts it (observe_one_aborted_request); finished ones as before
        assert _metric(page, 'sglang:num_aborted_requests_total{model_name="sim-model.gguf"}') == 1.0
        assert _metric(page, 'sglang:num_requests_total{model_name="sim-model.gguf"}') == 2.0  # the warm-up and the second


async def _leave_while_scraped(url: str, body: dict, leave_after_s: float, scrape_s: float, scrape_until_s: float
                               ) -> tuple[int, int]:
    """`body` sent to /completion and its connection closed after `leave_after_s`, while /metrics is read every
    `scrape_s` (as powerprof's daemon reads it) until `scrape_until_s` from the send. Returns (monotonic ns of the
    close, of the last scrape's answer)."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s1:
        task = asyncio.create_task(s1.post(url + "/completion", json=body))
        await asyncio.sleep(leave_after_s)
        task.cancel()  # (aiohttp closes the request's connection when its task is cancelled)
        try:
            r = await task
            r.close()
        except asyncio.CancelledError:
            pass
    t_close = time.monotonic_ns()
    while time.monotonic() - t0 < scrape_until_s:
        await _get(url + "/metrics")
        await asyncio.sleep(scrape_s)
    return t_close, time.monotonic_ns()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_llamacpp_looks_at_a_gone_client_only_after_a_second_without_any_result(stream):
    # llama-server's HTTP thread waits for its task's result on one condition variable shared by every waiting
    # request (server_response::recv_with_timeout: wait_for 1 s, again after each wakeup), and every result sent to
    # any of them wakes it (send: notify_all), a /metrics answer too. It looks at its connection only when a wait
    # times out: after 1 s in which the server sent no result at all, or (a stream) after a result of its own. Read
    # every 0.25 s, a whole answer whose client left runs on until the reads stop; a stream cut mid-prefill prefills
    # whole and is dropped at its first token.
    n_prompt = 3 * 8192  # a 3 s prefill
    body = {"prompt": "w " * (n_prompt - 1), "n_predict": 4000, "ignore_eos": True, "stream": stream}
    with SimServer(SimNVML("a100-40g", state_path=None), flavour="llamacpp", n_slots=1, decode_tok_s=100,
                   prefill_tok_s=8192.0, n_ctx=1 << 20) as s:
        t_close, t_last_read = asyncio.run(_leave_while_scraped(s.url, body, 0.6, 0.25, 2.5))
        for _ in range(300):
            if not s.busy:
                break
            time.sleep(0.02)
        assert not s.busy
        gone = [t for t in s.truth_cancelled if t["abort"] == "client_gone"]
    assert len(gone) == 1, s.truth_cancelled
    row = gone[0]
    assert row["t_prefill_end_ns"] > 0 and row["generated"] >= 1, row  # its prefill ran whole, for nobody
    if stream:  # noticed at its first token's result, not at a poll 1 s from its start (mid-prefill)
        assert (row["t_abort_ns"] - row["t_prefill_end_ns"]) / 1e9 <= 0.5, row
    else:  # noticed only once a second went by without a result: after the last read
        assert row["t_abort_ns"] >= t_last_read - 0.3e9, (row, t_last_read)
        assert (row["t_abort_ns"] - t_last_read) / 1e9 <= 1.6, (row, t_last_read)


def test_a_look_at_the_clients_costs_what_the_clients_are_not_what_they_times_the_queue_are():
    # The watch looks at every running request's connection every CLIENT_WATCH_TICK_S (20 ms). It asked of each
    # client whether its sequences were still in the engine by `r in self._active or r in self._waiting`, and _Req's
    # dataclass equality built two ~35-field tuples a comparison: a look cost clients x queue comparisons. Behind a
    # backlog (test_attribution_mixed's 800-request vLLM scene on a loaded host: 665 clients, 719 waiting) one look
    # took seconds of the server's loop, its steps fell from ~20 a second to one in 5-10 s, the backlog grew on, and
    # requests of 26 tokens were unanswered after 120-300 s (aiohttp's TimeoutError). 1500 clients queued here.
    import types

    import numpy as np

    from powerprof.sim.server import _Client, _Req

    s = SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", n_slots=64)
    open_conn = types.SimpleNamespace(transport=types.SimpleNamespace(is_closing=lambda: False))
    for i in range(1564):
        r = _Req(rid=i, prompt_tokens=300, n_predict=60, eos_at=None, cached=0, text_seed=i,
                 rng=np.random.default_rng(i), queue=None, t_arrive_ns=i)
        c = _Client(request=open_conn, task=None, t_start_ns=i, reqs=[r], streamed=True)
        (s._active if i < 64 else s._waiting).append(r)
        s._clients.add(c)
    t0 = time.thread_time()
    s._watch_tick(time.monotonic_ns())
    cpu_s = time.thread_time() - t0
    assert not any(c.t_gone_ns for c in s._clients)  # every connection open: nobody given up
    assert cpu_s < 0.2, f"one look at 1564 clients took {cpu_s:.2f} s of CPU"


def test_llamacpp_loading_answers_every_route_but_its_models_list_503():
    # llama-server binds its port at once when it (re)starts and, while it loads its model, its server-state middleware
    # answers every route 503 {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}} but the
    # models list (tools/server/server.cpp). The simulator's /metrics answered 200 with the new process's page while
    # loading: a daemon found a reloading llama-server up at once, never down by a 503 as the real one is.
    srv = SimServer(SimNVML("h200-141g", state_path=None), flavour="llamacpp").start()
    try:
        srv.restart(0.05, loading_s=5.0)  # done once loaded: not waited for

        async def statuses():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
                for _ in range(40):  # until it listens again, loading (a connect while it is down may hang)
                    try:
                        async with s.get(srv.url + "/v1/models") as r:
                            break
                    except (aiohttp.ClientConnectionError, asyncio.TimeoutError):
                        await asyncio.sleep(0.05)
                got = {}
                for path in ("/metrics", "/props", "/slots", "/health", "/v1/models"):
                    async with s.get(srv.url + path) as r:
                        got[path] = (r.status, await r.text())
                async with s.post(srv.url + "/tokenize", json={"content": "the clock"}) as r:
                    got["/tokenize"] = (r.status, await r.text())
                return got

        got = asyncio.run(statuses())
        for path, (status, text) in got.items():
            if path == "/v1/models":
                assert status == 200, (path, status, text)
            else:
                assert status == 503 and "Loading model" in text, (path, status, text)
    finally:
        srv.stop()


# llama-server's length when n_predict / max_tokens is absent, null or -1 (every route: params_from_json_cmpl's default
# is the server's --n-predict, -1) is "until end-of-sequence or the slot's context is full"; 0 runs one token. Measured
# on the bundled build at a 512-token slot: 15 prompt + 497 generated, truncated, stop_type "limit", on /completion,
# /v1/completions, chat, /v1/messages and /v1/responses alike. Before: the simulator ran 1 token for -1 and 128 (16 on
# /v1/completions) when absent.
LENGTH_CASES = [("/completion", {}), ("/completion", {"n_predict": -1}), ("/completion", {"n_predict": None}),
                ("/v1/completions", {}), ("/v1/completions", {"max_tokens": -1}),
                ("/v1/chat/completions", {}), ("/v1/chat/completions", {"max_tokens": -1}),
                ("/v1/chat/completions", {"max_completion_tokens": -1}), ("/v1/messages", {"max_tokens": -1}),
                ("/v1/messages", {}), ("/v1/responses", {"max_output_tokens": -1}), ("/v1/responses", {})]


def _length_answer(url: str, path: str, extra: dict) -> tuple:
    """(prompt tokens, generated tokens, stopped at the limit) of one whole llama.cpp answer."""
    import json as _json
    import urllib.request

    body = {"prompt": "the power"} if path in ("/completion", "/v1/completions") else \
        {"input": "the power"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "the power"}]}
    req = urllib.request.Request(url + path, _json.dumps(dict(body, ignore_eos=True, **extra)).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        d = _json.loads(r.read())
    if path == "/completion":
        return d["tokens_evaluated"], d["tokens_predicted"], d["stop_type"] == "limit" and d["truncated"]
    u = d["usage"]
    if path == "/v1/messages":
        return u["input_tokens"] + u.get("cache_read_input_tokens", 0), u["output_tokens"], d["stop_reason"] == "max_tokens"
    if path == "/v1/responses":
        return u["input_tokens"], u["output_tokens"], d["status"] == "completed"
    return u["prompt_tokens"], u["completion_tokens"], d["choices"][0]["finish_reason"] == "length"


def test_llamacpp_runs_an_absent_or_minus_one_length_until_the_slots_context_is_full():
    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, n_ctx=512, decode_tok_s=20000) as s:
        for path, extra in LENGTH_CASES:
            n_prompt, n_gen, at_limit = _length_answer(s.url, path, extra)
            assert n_prompt + n_gen == 256 and at_limit, (path, extra, n_prompt, n_gen)
        assert _length_answer(s.url, "/completion", {"n_predict": 0})[1:] == (1, False)  # one token, not cut
        # Without ignore_eos it ends at its EOS, well inside the context.
        import json as _json
        import urllib.request
        req = urllib.request.Request(s.url + "/completion", _json.dumps({"prompt": "the power"}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            d = _json.loads(r.read())
        assert d["stop_type"] == "eos" and 1 < d["tokens_predicted"] < 100, d


def _post_json(url: str, path: str, body: dict) -> tuple[int, dict | str]:
    """POST `body` as JSON: the status, and the answer parsed (200) or its text (an error)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_vllm_refuses_a_length_below_one_as_its_sampling_params_do():
    # vLLM's SamplingParams._verify_args: max_tokens below 1 is a VLLMValidationError, 400 BadRequestError naming the
    # parameter (the shape of its measured context refusals). Before: -1 ran 1 token, 0 ran as absent (16 or 128).
    # Completions' echo with 0 still runs (one token, not sent).
    import json as _json

    def post(url, path, body):
        code, doc = _post_json(url, path, body)
        return code, doc if code == 200 else _json.loads(doc)

    chat = {"messages": [{"role": "user", "content": "the power"}]}
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=20000) as s:
        for path, body, name, value in [("/v1/completions", {"prompt": "the power"}, "max_tokens", -1),
                                        ("/v1/completions", {"prompt": "the power"}, "max_tokens", 0),
                                        ("/v1/chat/completions", chat, "max_tokens", -1),
                                        ("/v1/chat/completions", chat, "max_tokens", 0),
                                        ("/v1/responses", {"input": "the power"}, "max_output_tokens", -1)]:
            code, doc = post(s.url, path, dict(body, **{name: value}))
            assert (code, doc) == (400, {"error": {
                "message": f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})",
                "type": "BadRequestError", "param": "max_tokens", "code": 400}}), (path, name, value)
        assert not s.truth
        code, doc = post(s.url, "/v1/completions", {"prompt": "the power", "max_tokens": 0, "echo": True})
        assert code == 200, doc
        # Chat takes max_completion_tokens where it is not None: a 0 is refused, not passed over for max_tokens (before:
        # the simulator's `or` ran max_tokens' 3 tokens).
        both = dict(chat, max_tokens=3, ignore_eos=True)
        code, doc = post(s.url, "/v1/chat/completions", dict(both, max_completion_tokens=0))
        assert code == 400 and doc["error"]["message"].startswith("max_tokens must be at least 1, got 0."), doc
        code, doc = post(s.url, "/v1/chat/completions", dict(both, max_completion_tokens=2))
        assert code == 200 and doc["usage"]["completion_tokens"] == 2, doc
        code, doc = post(s.url, "/v1/chat/completions", dict(both, max_completion_tokens=None))
        assert code == 200 and doc["usage"]["completion_tokens"] == 3, doc


# Numbers llama-server takes as nlohmann converts them (a boolean or a float read as an integer, a float cut toward
# zero): (route, body, choices answered, tokens each choice generates; None: not asserted).
LLAMA_LAX_NUMBERS = [("/completion", {"prompt": "a", "n_predict": True}, 1, 1),
                     ("/v1/completions", {"prompt": "a", "max_tokens": 2.7}, 1, 2),
                     ("/v1/completions", {"prompt": "a", "n": 2.0, "max_tokens": 2}, 2, None),
                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": True,
                                               "max_tokens": 2}, 1, 2)]


def _lax_answer(url: str, path: str, body: dict) -> tuple:
    """(HTTP status, choices answered, tokens the first generated) of one whole llama.cpp answer, ignore_eos."""
    import json as _json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, _json.dumps(dict(body, ignore_eos=True)).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            d = _json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), None
    if path == "/completion":
        return 200, 1, d["tokens_predicted"]
    return 200, len(d["choices"]), d["usage"]["completion_tokens"] if len(d["choices"]) == 1 else None


def test_llamacpp_runs_a_boolean_or_float_length_or_n_as_llama_server_converts_it():
    # Before: refused 400 ("type must be number, but is boolean"; "Field 'n': must be an integer of at least 1"), where
    # the bundled llama-server runs them (test_real_llama_server holds the same cases to it).
    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, decode_tok_s=20000) as s:
        for path, body, n_choices, n_tokens in LLAMA_LAX_NUMBERS:
            assert _lax_answer(s.url, path, body) == (200, n_choices, n_tokens), (path, body)


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_vllm_and_sglang_refuse_a_length_that_is_no_integer_as_their_request_validation_does(flavour):
    # Their request models read max_tokens / max_completion_tokens as Optional[int] (pydantic's lax mode: "5", 5.0 and
    # true are integers) and FastAPI's RequestValidationError is their handler's 400: {"error": {...}} on vLLM, flat
    # {"object": "error", ...} on SGLang, type "Bad Request", the message pydantic's error list. Before: int() raised in
    # the simulator, aiohttp's plain-text 500; 5.5 ran as 5.
    import json as _json

    post = _post_json

    chat = {"messages": [{"role": "user", "content": "the power"}]}
    bad = [("/v1/completions", {"prompt": "the power"}, "max_tokens", "abc", "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer"),
           ("/v1/completions", {"prompt": "the power"}, "max_tokens", 5.5, "int_from_float",
            "Input should be a valid integer, got a number with a fractional part"),
           ("/v1/chat/completions", chat, "max_tokens", [3], "int_type", "Input should be a valid integer"),
           # NaN and Infinity (Python's JSON writes and reads them): pydantic-core's finite_number, as pydantic 2.13
           # says for an Optional[int] (before: int_from_float, "a fractional part").
           ("/v1/chat/completions", chat, "max_tokens", float("nan"), "finite_number", "Input should be a finite number"),
           ("/v1/completions", {"prompt": "the power"}, "max_tokens", float("inf"), "finite_number",
            "Input should be a finite number"),
           ("/v1/chat/completions", chat, "max_completion_tokens", float("-inf"), "finite_number",
            "Input should be a finite number"),
           ("/v1/chat/completions", chat, "max_completion_tokens", "x", "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer"),
           # Responses' max_output_tokens, Optional[int] in both servers' ResponsesRequest (before: aiohttp's 500).
           ("/v1/responses", {"input": "the power"}, "max_output_tokens", "x", "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer")]
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=20000) as s:
        for path, body, name, value, kind, msg in bad:
            code, doc = post(s.url, path, dict(body, **{name: value}))
            if flavour == "sglang" and path == "/v1/responses":
                # SGLang's route takes a dict and builds its ResponsesRequest inside the handler (http_server.py): the
                # pydantic error is no RequestValidationError, and nothing catches it: Starlette's plain 500. Before:
                # the simulator answered it 400 as the other routes' validation errors.
                assert (code, doc) == (500, "Internal Server Error"), doc
                continue
            assert code == 400, (path, name, value, code, doc)
            doc = _json.loads(doc)
            err = doc["error"] if flavour == "vllm" else doc
            want = str([{"type": kind, "loc": ("body", name), "msg": msg, "input": value}])
            assert (err["message"], err["type"], err["param"], err["code"]) == (want, "Bad Request", None, 400), doc
            if flavour == "sglang":
                assert err["object"] == "error", doc
        for value in ("5", 5.0, " 5 "):  # pydantic's lax integers: run as 5
            code, doc = post(s.url, "/v1/completions", {"prompt": "the power", "max_tokens": value, "ignore_eos": True})
            assert code == 200 and doc["usage"]["completion_tokens"] == 5, (value, code, doc)


# llama-server's n_cmpl (measured on the bundled build, -np 2): read on /completion, /v1/completions and chat alike,
# over `n` (its alias), null taken as absent, its refusals naming the field: (route, body, status, choices or message).
_TYPE_302 = "[json.exception.type_error.302] type must be number, but is"
LLAMA_N_CMPL = [("/completion", {"n_cmpl": "2"}, 400, f"Field 'n_cmpl': {_TYPE_302} string"),
                ("/completion", {"n_cmpl": [2]}, 400, f"Field 'n_cmpl': {_TYPE_302} array"),
                ("/completion", {"n_cmpl": 0}, 400, "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 0"),
                ("/completion", {"n_cmpl": 3}, 400, "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 3"),
                ("/completion", {"n_cmpl": None}, 200, 1),
                ("/completion", {"n_cmpl": None, "n": 2}, 200, 2),
                ("/v1/completions", {"n_cmpl": 2}, 200, 2),
                ("/v1/completions", {"n_cmpl": "x"}, 400, f"Field 'n_cmpl': {_TYPE_302} string"),
                ("/v1/chat/completions", {"n_cmpl": 2}, 200, 2),
                ("/v1/chat/completions", {"n_cmpl": 3}, 400,
                 "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 3"),
                ("/v1/chat/completions", {"n": 2, "n_cmpl": 1}, 200, 1),
                # n is not read where n_cmpl is (before: refused 400 naming n); read where n_cmpl is null.
                ("/v1/chat/completions", {"n_cmpl": 1, "n": "x"}, 200, 1),
                ("/completion", {"n_cmpl": 2, "n": "x"}, 200, 2),
                ("/completion", {"n_cmpl": None, "n": "x"}, 400, f"Field 'n': {_TYPE_302} string"),
                # Responses, converted to a chat: a task per choice, a whole answer an array of their Responses.
                ("/v1/responses", {"n_cmpl": 2}, 200, 2), ("/v1/responses", {"n": 2}, 200, 2),
                ("/v1/responses", {"n_cmpl": 3}, 400, "Field 'n_cmpl': Value must be between 1 <= value <= 2, but got 3")]


def n_cmpl_answer(url: str, path: str, extra: dict) -> tuple:
    """(HTTP status, the choices answered or the error's message) of one whole llama.cpp answer of 2 tokens."""
    import json as _json

    if path == "/v1/responses":
        base = {"input": "the power", "max_output_tokens": 2}
    else:
        base = ({"messages": [{"role": "user", "content": "the power"}]} if "chat" in path else {"prompt": "the power"})
        base.update(n_predict=2, max_tokens=2)
    code, doc = _post_json(url, path, dict(base, **extra))
    if code != 200:
        return code, _json.loads(doc)["error"]["message"]
    return code, len(doc) if isinstance(doc, list) else len(doc.get("choices", [doc]))


def responses_tasks_stream(url: str, n: int) -> list:
    """A streamed llama.cpp Responses request of n_cmpl n (2 tokens each): each response.completed event's output tokens,
    one per distinct response id (its own response.created before it)."""
    import json as _json
    import urllib.request

    req = urllib.request.Request(url + "/v1/responses", _json.dumps(
        {"input": "the power", "max_output_tokens": 2, "n_cmpl": n, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [_json.loads(e.split("data: ", 1)[1]) for e in r.read().decode().split("\n\n") if "data: " in e]
    created = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    done = {e["response"]["id"]: e["response"]["usage"]["output_tokens"] for e in events
            if e["type"] == "response.completed"}
    assert sorted(created) == sorted(done), (created, done)
    return list(done.values())


def test_llamacpp_reads_n_cmpl_on_every_completion_route_as_llama_server_does():
    # Before: /completion alone read n_cmpl (/v1/completions and chat ran n_cmpl 2 as one choice, refused nothing), a
    # null n_cmpl was refused 400 "Field 'n': must be an integer of at least 1", and every refusal named `n`. Then
    # /v1/responses ran n_cmpl (or n) 2 as one task, answered one Response (llama-server: 2 tasks, an array of 2).
    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, decode_tok_s=20000) as s:
        for path, extra, status, want in LLAMA_N_CMPL:
            assert n_cmpl_answer(s.url, path, extra) == (status, want), (path, extra)
        assert responses_tasks_stream(s.url, 2) == [2, 2]  # each task's own Response, streamed interleaved
        assert sum(t["generated"] for t in s.truth[-2:]) == 4, s.truth[-2:]


# llama-server's /tokenize of a list (its tokenize_mixed, measured): (content, add_special, status, tokens or message;
# None: a text's tokens, asserted apart).
LLAMA_TOKENIZE_LISTS = [([1, 2, 3], False, 200, [1, 2, 3]), ([1.5, 2], False, 200, [1, 2]), ([True], False, 200, [1]),
                        ([-1, 99999], False, 200, [-1, 99999]), ([], True, 200, []),
                        ([None], False, 400, f"{_TYPE_302} null"), ([[1, 2]], False, 400, f"{_TYPE_302} array"),
                        ([{"a": 1}], False, 400, f"{_TYPE_302} object"),
                        ([5, "the"], True, 200, None), (["the", "power"], True, 200, None),
                        # An id outside int32 wrapped, a float there INT32_MIN (before: returned as given).
                        ([4294967297, 2147483648, 1e10, -1e10, -4294967297, -2147483649, 3e9, 2.5], False, 200,
                         [1, -2**31, -2**31, -2**31, -1, 2**31 - 1, -2**31, 2]),
                        # A non-boolean add_special is ignored: no BOS (before: "yes" and 1 taken as true).
                        (["the", "power"], "yes", 200, (False, True, True)),
                        (["the", "power"], 1, 200, (False, True, True))]


def tokenize_list_answer(url: str, content: list, special: bool) -> tuple:
    """(HTTP status, tokens or the error's message) of llama.cpp's /tokenize; for a list holding text, whether its
    tokens open with the BOS (id 1) and with the list's first id (None where it opens with text)."""
    import json as _json

    code, doc = _post_json(url, "/tokenize", {"content": content, "add_special": special})
    if code != 200:
        return code, _json.loads(doc)["error"]["message"]
    if not any(isinstance(x, str) for x in content):
        return code, doc["tokens"]
    first = content[0] if not isinstance(content[0], str) else None
    return code, (doc["tokens"][0] == 1, first is None or doc["tokens"][0] == first, len(doc["tokens"]) > 1)


def test_llamacpp_tokenizes_a_list_as_llama_servers_tokenize_mixed_does():
    # Before: the list's Python text was tokenized ([1, 2, 3] seven tokens with brackets and commas; a null or a nested
    # list taken as text, 200).
    with SimServer(SimNVML("seed-16g", state_path=None), n_slots=2, decode_tok_s=20000) as s:
        for content, special, status, want in LLAMA_TOKENIZE_LISTS:
            got = tokenize_list_answer(s.url, content, special)
            if want is None:  # a BOS only where the list opens with text; an id first is that id
                want = (isinstance(content[0], str), True, True)
            assert got == (status, want), (content, special, got)
