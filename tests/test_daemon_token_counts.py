"""The daemon against a server whose own token counts contradict the streams it sends (arrival.count_problem)."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import urllib.request

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon_helpers import DaemonProc, read_dataset, sim_env
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.daemon.reconcile import CREDIT_S, LAG_S
from powerprof.storage.schema import SERVER_COUNT_PROXY_LAG, SERVER_COUNT_USAGE_ABOVE, SERVER_COUNT_USAGE_BELOW

pytestmark = pytest.mark.slow

NATIVE = ("/completion", {"prompt": "p" * 40, "n_predict": 40, "ignore_eos": True, "stream": True})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "r" * 30}], "max_tokens": 40,
                                 "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
# (count_factor, request, flagged): the server's final counts (timings, tokens_predicted, usage) are the truth
# times count_factor; its stream stays true (40 tokens). A chat stream counted one token a chunk may show fewer
# tokens than the server counted (a chunk can hold several), so 50 of 40 there is no contradiction; llama.cpp's
# native chunks carry its running count, which reached 40: a final 50 contradicts it.
PLAN = [(1.0, NATIVE, None), (1.0, CHAT, None), (0.8, NATIVE, "stream_above_count"), (0.8, CHAT, "stream_above_count"),
        (1.25, NATIVE, "running_count_short"), (1.25, CHAT, None)]


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: the flag crosses from the proxy workers to the daemon
def test_requests_whose_server_count_contradicts_the_stream_are_flagged_and_counted_honest_ones_are_not(tmp_path, workers):
    data = tmp_path / "data"
    # No speculative decoding: one token a chunk, so the chat stream shows all 40.
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=80.0, draft_n_max=0) as srv:
        d = DaemonProc(data, "--simulate", "--upstream", srv.url, "--interval", "0.25", "--flush-interval", "0.5",
                       env={**sim_env(tmp_path), "POWERPROF_PROXY_WORKERS": workers})
        try:
            for factor, (path, body), _ in PLAN:
                srv.count_factor = factor
                req = urllib.request.Request(d.info["proxy"] + path, data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    assert r.status == 200 and b"data:" in r.read()
            # A request's row (and its TPOT sample) is made once the intervals over it closed, which waits for readings
            # past its end (GPU, RAPL, CPU time): on a loaded host that took longer than the 0.6 s this slept.
            deadline = time.monotonic() + 20
            while True:
                metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
                done = sum(x.value for f in text_string_to_metric_families(metrics) for x in f.samples
                           if x.name == "powerprof_request_tpot_seconds_count")
                if done >= len(PLAN) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    reqs = read_dataset(data, "requests").sort_values("request_id").to_dict("records")
    assert len(reqs) == len(PLAN)
    for (factor, (path, _), flagged), row in zip(PLAN, reqs):
        what = (factor, path, row["error"])
        assert row["outcome"] == "ok" and row["endpoint"] == path, what  # the row is kept, served as it was
        # What the proxy saw, never a contradicted count; a chat stream's per-chunk count set to the server's otherwise.
        seen = 40 if flagged or path == NATIVE[0] else round(40 * factor)
        assert row["attributed_tokens"] == pytest.approx(seen), what
        if flagged is None:
            assert pd.isna(row["error"]), what
            assert row["generated_tokens"] == round(40 * factor) and row["gpu_j_per_token"] is not None, what
        else:
            told = round(40 * factor)
            assert isinstance(row["error"], str) and f"the server counted {told} generated tokens" in row["error"] and "proxy.upstream" in row["error"], what
            assert pd.isna(row["generated_tokens"]) and pd.isna(row["decode_tokens"]), what
            assert pd.isna(row["gpu_j_per_token"]), what
            assert row["gpu_energy_j"] > 0, what  # its energy share still counts in the books
    fams = {f.name: f for f in text_string_to_metric_families(metrics)}
    got = {s.labels["reason"]: s.value for s in fams["powerprof_requests_token_count_contradicted"].samples
           if s.name.endswith("_total")}
    assert got == {"stream_above_count": 2, "running_count_short": 1, "first_choice_only": 0}, got
    # Their timing is real: each adds a TPOT and output-length sample from the proxy's own count (40, what
    # attribution uses), so the tuner's latency guard still sees them; the honest 1.25 chat one adds 50.
    # Before, the contradicted three added none: 3 TPOT samples of 6.
    hist = {s.name: s.value for f in fams.values() for s in f.samples}
    # A stream that reached the proxy in one burst (a proxy worker starved on a loaded host reads it whole) has no TPOT:
    # its tokens' times are the burst's (Ledger.tokens_at_first); its row says so. One in several bursts has one, from
    # its first piece on.
    burst = sum("reached the proxy in one burst" in str(r["energy_note"]) for r in reqs)
    assert hist["powerprof_request_tpot_seconds_count"] == len(PLAN) - burst, (hist, burst)
    assert hist["powerprof_request_output_tokens_count"] == len(PLAN)
    assert hist["powerprof_request_output_tokens_sum"] == 5 * 40 + 50
    assert "cannot be believed" in d.output()  # logged, naming both counts


def _abandoned_stream(url: str, chunks: int = 25) -> None:
    """A chat stream of 200 tokens sent to `url`, its client gone after `chunks` data lines (vLLM aborts it)."""
    host, port = url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", CHAT[0], body=json.dumps({**CHAT[1], "max_tokens": 200}),
              headers={"Content-Type": "application/json"})
    r, n = c.getresponse(), 0
    while n < chunks:
        n += r.fp.readline().startswith(b"data:")
    c.sock.close()
    c.close()


def _usage_scene(tmp_path, factor: float, tokens_per_event: int, bypass: bool | str = False,
                 flavour: str = "llamacpp"):
    """Three chat streams (include_usage) and three whole chat answers of 40 tokens, one after another, no bypass
    traffic, through the daemon (0.25 s intervals) in front of a simulated server (llama-server's OpenAI routes, or
    `flavour`'s) whose final usage is the truth times `factor` and whose stream sends `tokens_per_event` tokens a chunk;
    its /metrics counter counts the truth. `bypass`: each whole answer is followed by the same one sent to the server
    directly, not through the proxy; "aborted": by a stream sent to the server directly whose client leaves after 25
    tokens (the server aborts it). Returns (request rows, interval rows)."""
    data = tmp_path / "data"
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=80.0, draft_n_max=0,
                   tokens_per_event=tokens_per_event) as srv:
        d = DaemonProc(data, "--simulate", "--upstream", srv.url, "--interval", "0.25", "--flush-interval", "0.5",
                       env=sim_env(tmp_path))
        try:
            time.sleep(1.0)
            srv.count_factor = factor
            for stream in (True, False, True, False, True, False):
                body = {**CHAT[1], "stream": stream}
                if not stream:
                    body.pop("stream_options")
                req = urllib.request.Request(d.info["proxy"] + CHAT[0], data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    assert r.status == 200
                    r.read()
                if bypass == "aborted" and not stream:
                    _abandoned_stream(srv.url)
                elif bypass and not stream:
                    req = urllib.request.Request(srv.url + CHAT[0], data=json.dumps(body).encode(), method="POST",
                                                 headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=60) as r:
                        assert r.status == 200
                        r.read()
            time.sleep(3.0)  # the intervals over the last one close (scrapes past its end)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    return (read_dataset(data, "requests").sort_values("request_id").to_dict("records"),
            read_dataset(data, "intervals").sort_values("t_start_mono_s").to_dict("records"))


def _said(row) -> str:
    return f"{row['error'] or ''} {row['energy_note'] or ''}"


# The reason the windows (and the intervals, tags and requests over them) say where the server's own counter contradicts
# the usage the proxy believed.
USAGE_ABOVE_COUNTER = SERVER_COUNT_USAGE_ABOVE


def test_a_usage_above_the_servers_own_counter_is_said_on_the_rows_naming_both_counts(tmp_path):
    """A server whose final usage says 1.25x what it generated (50 for 40), its stream and its /metrics counter true:
    the proxy's count runs 10 a request above the counter, which no bypass traffic can explain (bypass only raises the
    counter). Each such request's row should say so, naming the reason and both counts (its usage's 50, the counter's
    40), and every interval over them should carry the reason in `server_count`."""
    reqs, intervals = _usage_scene(tmp_path, 1.25, 1)
    assert len(reqs) == 6
    for row in reqs:
        text = _said(row)
        assert USAGE_ABOVE_COUNTER in text and "usage said 50" in text and "about 40" in text, row
        assert pd.isna(row["gpu_j_per_token"]) and row["gpu_energy_j"] > 0, row
    busy = [iv for iv in intervals if iv["proxy_tokens"] and iv["proxy_tokens"] > 1]
    assert busy and all(USAGE_ABOVE_COUNTER in iv["server_count"] for iv in busy), \
        [(iv["proxy_tokens"], iv["server_count"]) for iv in busy]


def test_a_usage_above_the_servers_own_counter_is_said_under_several_tokens_a_chunk_too(tmp_path):
    """The same lie behind a stream of 4 tokens a chunk (usage 50 over 10 chunks counted one a chunk): the ledger spreads
    such a stream's chunks step by step (`Ledger._chunks_to_server_count`), and the tokens it placed there on the usage's
    word alone went unrecorded for the counter's check: every row believed, nothing said."""
    reqs, intervals = _usage_scene(tmp_path, 1.25, 4)
    assert len(reqs) == 6
    for row in reqs:
        assert USAGE_ABOVE_COUNTER in _said(row) and "50" in _said(row), row
        assert row["gpu_j_per_token"] is None or pd.isna(row["gpu_j_per_token"]), row


@contextlib.contextmanager
def _host_lateness(step_s: float = 0.02):
    """Yields a list that fills, while the block runs, with (UTC seconds, s) how late a timer of this process woke:
    the host's load as the daemon measures its proxy's (a timer's lateness on its event loop, `note_proxy_delay`)."""
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            t = time.monotonic()
            time.sleep(step_s)
            seen.append((time.time(), time.monotonic() - t - step_s))

    th = threading.Thread(target=probe, daemon=True)
    th.start()
    try:
        yield seen
    finally:
        done.set()
        th.join(5)


def test_a_usage_above_its_chunks_that_the_servers_counter_agrees_with_stays_believed(tmp_path):
    """Speculative decoding's shape (4 tokens a chunk, usage 40 over 10 chunks counted one a chunk) with an honest
    counter (40): the usage is believed (generated_tokens 40, J/token kept, no error) and nothing says the server's
    counter contradicted it. The guard for the test above: a fix must read the counter, not the usage's distance from
    the chunks."""
    with _host_lateness() as late:
        reqs, intervals = _usage_scene(tmp_path, 1.0, 4)
    assert len(reqs) == 6
    for row in reqs:
        assert row["generated_tokens"] == 40 and pd.isna(row["error"]), row
        assert row["gpu_j_per_token"] is not None and not pd.isna(row["gpu_j_per_token"]), row
        assert USAGE_ABOVE_COUNTER not in _said(row), row
    assert not any(USAGE_ABOVE_COUNTER in (iv["server_count"] or "") for iv in intervals)
    # No bypass traffic ran and the counter is honest: no interval says its count is low or off, no row blames bypass
    # traffic, and at most 2 of its 240 tokens go to bypass traffic in all (windows' residues under a token each,
    # reconcile.LAG_TOKENS: what a record's own delay moves whatever the placing; after the fix 0-1.05 over 4 runs,
    # before 1.9-4.9). Before, its 4-token chunks were placed at their stamps, up to 3 tokens behind the counter, its
    # first chunk 2.6 ahead: 5-15 of 30 busy intervals said counter_below or proxy_lag, 2 runs in 3.
    # Only `proxy_lag` may stand, and only within a level's reach (LAG_S + CREDIT_S) of a moment this process's timer
    # woke more than a token's time late (80 tokens/s): a loaded host, where the daemon measures its proxy late too and
    # rightly says how far that may move the count (`proxy_lag`: a burst the loop held, the lag of its measured delay,
    # a long GET, a proxy silent; seen beside two CPU hogs). Asserted as `not said` before, it failed 2 of 6 loaded
    # runs (3 and over 6 such intervals, no bypass traffic); after, 10 of 12 passed, 5 saying it on 6-19 (the other 2,
    # at load 11-12, said counter_below: not explained yet). Where the host is never seen late the bound is what it
    # was (nothing said), and counter_below or any other reason fails anywhere.
    said = [iv for iv in intervals if iv["server_count"] != "complete" and iv["proxy_tokens"]]
    reach_s = LAG_S + CREDIT_S  # a level looks LAG_S ahead and is held CREDIT_S
    late_at = [t for t, x in late if x > 1 / 80]
    unexplained = [(iv["t_start_mono_s"], iv["server_count"]) for iv in said
                   if iv["server_count"] != SERVER_COUNT_PROXY_LAG
                   or not any(iv["t_start_utc"].timestamp() - reach_s <= t <= iv["t_end_utc"].timestamp() + reach_s
                              for t in late_at)]
    assert not unexplained, (unexplained, [(round(t, 2), round(x, 3)) for t, x in late if x > 1 / 80])
    # A row over such intervals says so (bypass-uncounted, naming proxy_lag alone), and none says it elsewhere.
    blamed = [_said(row) for row in reqs if "bypass-uncounted" in _said(row)]
    assert not blamed or said and all("(proxy_lag: their server_count)" in x for x in blamed), blamed
    assert sum(iv["server_tokens"] or 0.0 for iv in intervals) <= 2.0


# The reason where the server's counter counted more than the usage said and its books rule out bypass traffic.
USAGE_BELOW_COUNTER = SERVER_COUNT_USAGE_BELOW


def _energy(intervals) -> tuple[float, float]:
    """(unproxied GPU joules, all GPU joules) over the interval rows."""
    return (sum(iv["unproxied_energy_j"] or 0.0 for iv in intervals),
            sum(iv["gpu_energy_j"] or 0.0 for iv in intervals))


def test_a_whole_answers_usage_below_the_servers_own_counter_is_said_and_not_booked_as_bypass(tmp_path):
    """A vLLM whose final usage says 0.8x what it generated (32 for 40), its stream and its /metrics counter true: its
    streams are caught by their chunks (stream_above_count), its whole answers have none, and the counter's 8 more a
    whole answer read as bypass traffic (unproxied 14.4 J of 227.9, each whole answer 18.6-19.0 J where honest ones
    took 22.7-23.6, its row 32 tokens and a J/token over them, its intervals `complete`). Its books
    (vllm:request_success_total, vllm:num_requests_running) show that no request but the proxy's ran: each whole
    answer's row should say usage_below_counter naming both counts (32, about 40), its J/token empty, and nothing
    should go to unproxied."""
    reqs, intervals = _usage_scene(tmp_path, 0.8, 1, flavour="vllm")
    assert len(reqs) == 6
    for row in reqs:
        if row["stream"]:
            assert "the server counted 32 generated tokens but its stream carried 40" in _said(row), row  # as before
            continue
        text = _said(row)
        assert USAGE_BELOW_COUNTER in text and "usage said 32" in text and "about 40" in text, row
        assert pd.isna(row["gpu_j_per_token"]) and row["gpu_energy_j"] > 0, row
    unproxied, total = _energy(intervals)
    assert unproxied <= 0.01 * total, (unproxied, total)
    assert sum(iv["server_tokens"] or 0.0 for iv in intervals) <= 2.0
    assert any(USAGE_BELOW_COUNTER in (iv["server_count"] or "") for iv in intervals)


def test_bypass_whole_answers_beside_a_usage_below_the_counter_stay_bypass_traffic(tmp_path):
    """The same scene with a whole answer sent to the server directly after each proxied one: the server finished more
    requests than the proxy saw, so the counter's surplus may be (and here mostly is) bypass traffic: booked to
    unproxied as before, and no row or interval says usage_below_counter."""
    reqs, intervals = _usage_scene(tmp_path, 0.8, 1, bypass=True, flavour="vllm")
    assert len(reqs) == 6
    assert not any(USAGE_BELOW_COUNTER in _said(row) for row in reqs), [_said(row) for row in reqs]
    assert not any(USAGE_BELOW_COUNTER in (iv["server_count"] or "") for iv in intervals)
    unproxied, total = _energy(intervals)
    # 3 bypass answers of 40 tokens (and the proxied answers' 24 unsaid): at least the bypass answers' 120 tokens.
    assert sum(iv["server_tokens"] or 0.0 for iv in intervals) >= 110, intervals
    assert unproxied > 0.15 * total, (unproxied, total)


def test_aborted_bypass_streams_beside_honest_whole_answers_stay_bypass_traffic(tmp_path):
    """An honest vLLM (usage true) and, after each proxied whole answer, a stream sent to the server directly whose
    client leaves after 25 tokens: the server aborts it, so it is never in vllm:request_success_total, but its 24-25
    tokens are in vllm:generation_tokens_total. The finished count matched the proxy's ends, so the 72 bypass tokens
    were read as the whole answers' usage lying low: 0 booked as bypass, unproxied 0 J of 271 (truth about 49 J), the
    three honest rows said usage_below_counter, their J/token emptied. vllm:request_generation_tokens_sum (finished
    requests' tokens) falls short of the counter's rise by the aborted ones': bypass, as before."""
    reqs, intervals = _usage_scene(tmp_path, 1.0, 1, bypass="aborted", flavour="vllm")
    assert len(reqs) == 6
    assert not any(USAGE_BELOW_COUNTER in _said(row) for row in reqs), [_said(row) for row in reqs]
    assert not any(USAGE_BELOW_COUNTER in (iv["server_count"] or "") for iv in intervals)
    assert all(not pd.isna(row["gpu_j_per_token"]) for row in reqs), [_said(row) for row in reqs]
    assert sum(iv["server_tokens"] or 0.0 for iv in intervals) >= 60, intervals  # 3 aborted streams: about 72
    unproxied, total = _energy(intervals)
    assert unproxied > 0.1 * total, (unproxied, total)


def test_a_whole_answers_usage_below_the_counter_of_a_server_without_request_books_stays_bypass(tmp_path):
    """The same lie on llama-server's OpenAI routes: its /metrics counts no finished requests, so nothing rules bypass
    traffic out and the counter's surplus is booked as bypass, as before (docs/daemon.md says so); nothing says
    usage_below_counter."""
    reqs, intervals = _usage_scene(tmp_path, 0.8, 1)
    assert not any(USAGE_BELOW_COUNTER in _said(row) for row in reqs), [_said(row) for row in reqs]
    assert sum(iv["server_tokens"] or 0.0 for iv in intervals) == pytest.approx(24.0, abs=3.0)
