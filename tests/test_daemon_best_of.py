"""vLLM V0's `best_of > n`: the server runs best_of sequences and returns n (answered whole, even where a stream was
asked: V0's serving_completion streams only where best_of is n). The others' tokens never reach the proxy, so their
work lands in the requests beside and in unproxied: the request's own figure is low. Its row says so, with the fix
(storage/schema.py BEST_OF_FLAG), against the simulator's truth per request."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pandas as pd
import pytest

from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.storage.schema import BEST_OF_FLAG

from daemon_helpers import DaemonProc, note_of, read_dataset, sim_env

pytestmark = pytest.mark.slow
N_TOKENS = 48


def _complete(url: str, cid: str, **extra) -> dict | bytes:
    body = {"prompt": "Power limits decide the energy per token.", "max_tokens": N_TOKENS, "ignore_eos": True,
            "temperature": 0.8, **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Sim-Request-Id": cid})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read()
    return json.loads(raw) if r.headers.get("Content-Type", "").startswith("application/json") else raw


def _metric(d, name: str) -> float | None:
    """`name`'s value on the daemon's /metrics, once the rows read are counted there (the snapshot follows within a
    loop turn): up to 10 s for it to be above 0."""
    deadline, v = time.monotonic() + 10, None
    while time.monotonic() < deadline:
        page = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        v = next((float(line.split()[-1]) for line in page.splitlines() if line.startswith(name + " ")), None)
        if v:
            return v
        time.sleep(0.2)
    return v


def _one_row_through(sim, tmp_path, send) -> tuple[int, str, dict]:
    """(the daemon's exit status, its output, the one request row) of `send(proxy_url)` through a daemon before `sim`,
    sent once the daemon has read the server's page (its kind, vLLM's V1, known: a fixed second was no promise on a
    loaded host)."""
    data = tmp_path / "data"
    d = DaemonProc(data, "--simulate", "--upstream", sim.url, "--interval", "0.25", "--flush-interval", "0.25",
                   env=sim_env(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            page = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
            if "powerprof_server_tokens_generated_total " in page:
                break
            time.sleep(0.2)
        send(d.info["proxy"])
        while time.monotonic() < deadline + 60:
            rows = read_dataset(data, "requests")
            if rows is not None and len(rows) >= 1:
                break
            time.sleep(0.2)
    finally:
        rc = d.stop()
    (row,) = read_dataset(data, "requests").to_dict("records")
    return rc, d.output(), row


def test_the_simulated_vllm_v0_runs_best_of_and_returns_n():
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", batching="continuous",
                   vllm_v0_best_of=True) as sim:
        doc = _complete(sim.url, "bo", best_of=3, n=1, stream=True)
        truth = sim.request_truth()["bo"]
        with pytest.raises(urllib.error.HTTPError) as e:
            _complete(sim.url, "low", best_of=1, n=2)
    assert isinstance(doc, dict) and len(doc["choices"]) == 1, doc  # whole, though a stream was asked
    assert doc["usage"]["completion_tokens"] == N_TOKENS
    assert truth["generated"] == 3 * N_TOKENS and truth["sequences"] == 3, truth
    assert e.value.code == 400


def test_a_best_of_request_through_the_proxy_is_flagged_with_the_fix(tmp_path):
    # Before: its row said nothing, its energy that of 1 of its 3 sequences' work (the others' in unproxied).
    data = tmp_path / "data"
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", batching="continuous", decode_tok_s=200,
                   vllm_v0_best_of=True, vllm_metrics="legacy") as sim:  # V0: the v0 names on its page
        d = DaemonProc(data, "--simulate", "--upstream", sim.url, "--interval", "0.25", "--flush-interval", "0.25",
                       env=sim_env(tmp_path))
        try:
            _complete(d.info["proxy"], "plain", stream=True, stream_options={"include_usage": True})
            _complete(d.info["proxy"], "bo", best_of=3, n=1, stream=True)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rows = read_dataset(data, "requests")
                if rows is not None and len(rows) >= 2:
                    break
                time.sleep(0.2)
            counted = _metric(d, "powerprof_requests_best_of_unseen_total")
        finally:
            rc = d.stop()
        truth = sim.request_truth()
    assert rc == 0, d.output()
    rows = read_dataset(data, "requests").to_dict("records")
    assert len(rows) == 2, rows
    plain, bo = sorted(rows, key=lambda r: r["t_arrival_utc"])
    assert BEST_OF_FLAG not in note_of(plain), note_of(plain)
    note = note_of(bo)
    assert bo["generated_tokens"] == N_TOKENS
    assert f"{BEST_OF_FLAG}: it asked best_of 3 for n 1: the server ran 2 more sequence(s)" in note, note
    assert "its figure is low" in note and "fix: ask n equal to best_of" in note, note
    assert counted == 1.0  # on /metrics as in its row (before: no count of such rows there)
    # The server ran 3 sequences of 48 tokens for it, the proxy saw 1: two thirds of its decode unseen.
    assert (truth["bo"]["generated"], truth["bo"]["sequences"]) == (3 * N_TOKENS, 3), truth["bo"]


@pytest.mark.parametrize("flavour", ["sglang", "vllm"])
def test_a_server_that_takes_no_best_of_gets_no_flag(tmp_path, flavour):
    # SGLang's protocol has the field and ignores it (llama-server ignores it too), and so does vLLM from 0.12 on (the
    # field removed; the simulator's default): its answer hides no sequence, so a best_of there says nothing (the
    # daemon knows the server from its scrape: vLLM's V1 by its prefix-cache counters). Before, vLLM's row said
    # "the server ran 2 more sequence(s) than it returned", which it never ran.
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, batching="continuous") as sim:
        rc, said, row = _one_row_through(sim, tmp_path, lambda url: _complete(url, "bo", best_of=3, n=1))
        truth = sim.request_truth()["bo"]
    assert rc == 0, said
    assert truth["sequences"] == 1 and row["generated_tokens"] == N_TOKENS
    assert BEST_OF_FLAG not in note_of(row), note_of(row)


def _refusal(url: str, path: str, cid: str, **extra) -> dict:
    """A 400's JSON body (the request must be refused)."""
    with pytest.raises(urllib.error.HTTPError) as e:
        if path == "/v1/completions":
            _complete(url, cid, **extra)
        else:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": N_TOKENS, **extra}
            req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json", "X-Sim-Request-Id": cid})
            urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    return json.loads(e.value.read())


def test_the_simulated_vllm_v1_of_0_7_to_0_11_refuses_best_of_above_1():
    # Its processor's ValueError ("vLLM V1 does not yet support best_of."), answered 400 in vLLM's error shape, on
    # both OpenAI routes (both protocols carried the field); best_of 1 (or none) is served. Before: served, best_of
    # ignored, as vLLM >= 0.12 (the field removed) does, still the default.
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", batching="continuous",
                   vllm_v1_refuses_best_of=True) as sim:
        comp = _refusal(sim.url, "/v1/completions", "c", best_of=3, n=1)
        chat = _refusal(sim.url, "/v1/chat/completions", "h", best_of=2, n=2, stream=True)
        low = _refusal(sim.url, "/v1/completions", "l", best_of=1, n=2)  # SamplingParams' check comes first
        one = _complete(sim.url, "one", best_of=1)
        truth = sim.request_truth()
    for doc in (comp, chat):
        assert doc == {"error": {"message": "vLLM V1 does not yet support best_of.", "type": "BadRequestError",
                                 "param": None, "code": 400}}, doc
    assert "best_of must be greater than or equal to n" in low["error"]["message"], low
    assert one["usage"]["completion_tokens"] == N_TOKENS
    assert set(truth) == {"one"}, truth  # nothing ran for the refused ones
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm") as sim:  # >= 0.12: ignored
        assert _complete(sim.url, "bo", best_of=3)["usage"]["completion_tokens"] == N_TOKENS


def test_a_best_of_refused_by_vllm_v1_is_a_failed_row_not_a_flagged_zero(tmp_path):
    # Through the proxy the refusal is the client's own 400: its row says the status, no tokens and no energy
    # (energy_note: an error answer), and no best-of-unseen flag (nothing ran, nothing unseen).
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", batching="continuous",
                   vllm_v1_refuses_best_of=True) as sim:
        rc, said, row = _one_row_through(
            sim, tmp_path, lambda url: _refusal(url, "/v1/completions", "bo", best_of=3, n=1))
    assert rc == 0, said
    assert row["status"] == 400, row
    assert row["token_source"] == "none" and row["attributed_tokens"] == 0, row
    assert pd.isna(row["generated_tokens"]) and pd.isna(row["gpu_energy_j"]), row  # null, not a 0 in J/token
    assert "an error answer (HTTP 400)" in note_of(row), note_of(row)
    assert BEST_OF_FLAG not in note_of(row), note_of(row)
