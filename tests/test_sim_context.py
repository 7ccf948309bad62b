"""The simulated server's context window as each real server enforces and reports it, and what powerprof does when a
run asks more than it holds: a clear error with the fix, before anything starts or mid-level, the limit put back."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.sweep import UI, SweepError, run_sweep
from powerprof.workload.client import RequestParams
from powerprof.workload.load import LoadAborted, Prompt, run_load

FAST = {"decode_tok_s": 2000.0, "prefill_tok_s": 1e5}


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _get(url: str):
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


# --- llama.cpp -------------------------------------------------------------------------------------------------------

def test_llamacpp_reports_a_default_context_per_slot_and_refuses_a_longer_prompt_as_b11434_does():
    # Measured on llama-server b11434 (-c 512 -np 2, 256 a slot): /props and /slots say the slot's n_ctx; a prompt of
    # 4204 tokens got 400 {"error": {"code": 400, "message": "request (4204 tokens) exceeds the available context
    # size (256 tokens), try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 4204,
    # "n_ctx": 256}}. The simulator had no context unless told one.
    with SimServer(n_slots=2, **FAST) as srv:
        assert _get(srv.url + "/props")["default_generation_settings"]["n_ctx"] == 4096
        assert {s["n_ctx"] for s in _get(srv.url + "/slots")} == {4096}
        code, raw = _post(srv.url + "/completion", {"prompt": "word " * 5000, "n_predict": 4})
    assert code == 400
    assert json.loads(raw) == {"error": {
        "code": 400, "message": "request (5001 tokens) exceeds the available context size (4096 tokens), try increasing it",
        "type": "exceed_context_size_error", "n_prompt_tokens": 5001, "n_ctx": 4096}}


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_llamacpp_stops_a_generation_where_the_slots_context_fills_and_says_truncated(path):
    # b11434, a 256-token slot, 15 prompt tokens, n_predict 5000: 241 generated (prompt + generated = n_ctx),
    # `truncated: true`, `stop_type: "limit"`; its OpenAI answer says finish_reason "length".
    with SimServer(n_ctx=64, n_slots=1, **FAST) as srv:
        n_key = "n_predict" if path == "/completion" else "max_tokens"
        code, raw = _post(srv.url + path, {"prompt": "the power of a card", n_key: 5000, "ignore_eos": True})
        short_code, short_raw = _post(srv.url + "/completion", {"prompt": "the power", "n_predict": 4})
    assert code == 200
    d = json.loads(raw)
    if path == "/completion":
        assert d["tokens_evaluated"] + d["tokens_predicted"] == 64 and d["truncated"] is True and d["stop_type"] == "limit"
    else:
        u = d["usage"]
        assert u["prompt_tokens"] + u["completion_tokens"] == 64 and d["choices"][0]["finish_reason"] == "length"
    assert short_code == 200 and json.loads(short_raw)["truncated"] is False


# --- vLLM ------------------------------------------------------------------------------------------------------------

def test_vllm_lists_max_model_len_and_refuses_a_max_tokens_beyond_it_by_default():
    # vLLM's /v1/models card carries max_model_len (its ModelCard); max_tokens beyond it is a 400 (measured on 0.32).
    with SimServer(flavour="vllm", **FAST) as srv:
        (card,) = _get(srv.url + "/v1/models")["data"]
        code, raw = _post(srv.url + "/v1/completions", {"prompt": "the power", "max_tokens": 5_000_000})
    assert card["max_model_len"] == 32768
    assert code == 400 and "max_tokens=5000000 cannot be greater than max_model_len=32768" in raw.decode()


def test_vllm_runs_a_chat_without_a_length_to_the_end_of_its_context_as_get_max_tokens_does():
    # vLLM's chat serving passes max_completion_tokens (else max_tokens) to entrypoints/utils.py get_max_tokens, which
    # with neither takes min(max_model_len - prompt, the generation_config's max_tokens where the model has one). Before:
    # 128 tokens, and at a 64-token context a 400 (max_tokens=128 > max_model_len=64).
    chat = {"messages": [{"role": "user", "content": "the watt"}], "ignore_eos": True}
    with SimServer(flavour="vllm", n_ctx=64, **FAST) as srv:
        code, raw = _post(srv.url + "/v1/chat/completions", chat)
        assert code == 200, raw
        doc = json.loads(raw)
        u = doc["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"]) == (3, 61) and doc["choices"][0]["finish_reason"] == "length"
        code, raw = _post(srv.url + "/v1/chat/completions", dict(chat, max_tokens=5))
        assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 5, raw
        # A prompt that fills the context leaves 0, which its SamplingParams refuse.
        code, raw = _post(srv.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * 63}]})
        assert code == 400 and "max_tokens must be at least 1, got 0." in json.loads(raw)["error"]["message"], raw
    with SimServer(flavour="vllm", n_ctx=4096, generation_max_tokens=20, **FAST) as srv:
        code, raw = _post(srv.url + "/v1/chat/completions", chat)  # generation_config's max_new_tokens caps it
    assert code == 200 and json.loads(raw)["usage"]["completion_tokens"] == 20, raw


def test_vllm_sizes_a_responses_request_as_get_max_tokens_does():
    # vLLM's responses/serving.py: get_max_tokens(max_model_len, max_output_tokens, prompt, ...) as a chat's, then
    # to_sampling_params' min(max_output_tokens, it). Before: none given ran the room uncapped (61 here, 4093 at a
    # 4096 context where vLLM runs 20), one over the context was a 400, and a context-filling prompt was the
    # "max_tokens must be at least 1, got 0." refusal, not _validate_generator_input's.
    with SimServer(flavour="vllm", n_ctx=64, **FAST) as srv:
        code, raw = _post(srv.url + "/v1/responses", {"input": "the watt", "ignore_eos": True})
        assert code == 200, raw
        u = json.loads(raw)["usage"]
        assert (u["input_tokens"], u["output_tokens"]) == (3, 61), u
        over = {"input": "the watt", "max_output_tokens": 100, "ignore_eos": True}
        code, raw = _post(srv.url + "/v1/responses", over)
        assert code == 200 and json.loads(raw)["usage"]["output_tokens"] == 61, raw  # lowered to the room
        code, raw = _post(srv.url + "/v1/responses", {"input": "w " * 63})  # 64 tokens: fills the context
    assert code == 400 and json.loads(raw) == {"error": {
        "message": "The engine prompt length 64 exceeds the max_model_len 64. Please reduce prompt.",
        "type": "invalid_request_error", "param": "input", "code": 400}}, raw
    with SimServer(flavour="vllm", n_ctx=4096, generation_max_tokens=20, **FAST) as srv:
        code, raw = _post(srv.url + "/v1/responses", {"input": "the watt", "ignore_eos": True})
        assert code == 200 and json.loads(raw)["usage"]["output_tokens"] == 20, raw  # generation_config's cap
        code, raw = _post(srv.url + "/v1/responses", {"input": "the watt", "max_output_tokens": 30, "ignore_eos": True})
    assert code == 200 and json.loads(raw)["usage"]["output_tokens"] == 30, raw  # a given one is not capped by it


# --- SGLang ----------------------------------------------------------------------------------------------------------

def test_sglang_reports_its_context_length_and_refuses_what_does_not_fit_as_its_tokenizer_manager_does():
    # tokenizer_manager._validate_one_request: input >= context_len, or input + max_new_tokens > context_len, is a
    # ValueError; the OpenAI routes answer it 400 {"object": "error", ..., "type": "BadRequestError", "code": 400}.
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        (card,) = _get(srv.url + "/v1/models")["data"]
        info = _get(srv.url + "/get_server_info")
        long_prompt = _post(srv.url + "/v1/completions", {"prompt": "word " * 70, "max_tokens": 4})
        too_many = _post(srv.url + "/v1/completions", {"prompt": "the power", "max_tokens": 100})
        fits = _post(srv.url + "/v1/completions", {"prompt": "the power", "max_tokens": 61,
                                                             "ignore_eos": True})
    assert card["max_model_len"] == 64 and info["context_length"] == 64
    code, raw = long_prompt
    assert code == 400 and json.loads(raw) == {
        "object": "error", "message": "The input (71 tokens) is longer than the model's context length (64 tokens).",
        "type": "BadRequestError", "param": None, "code": 400}
    code, raw = too_many
    assert code == 400 and json.loads(raw)["message"] == (
        "Requested token count exceeds the model's maximum context length of 64 tokens. You requested a total of 103 "
        "tokens: 3 tokens from the input messages and 100 tokens for the completion. Please reduce the number of "
        "tokens in the input messages or the completion to fit within the limit.")
    # Run, its scheduler caps it at max_req_len - prompt - 1 (max_req_len the context less 1): 59 (before: 61).
    assert fits[0] == 200 and json.loads(fits[1])["usage"]["completion_tokens"] == 59


def test_sglang_generate_refuses_whole_with_a_400_and_streamed_inside_a_200():
    # http_server.generate_request: a whole answer is 400 {"error": {"message": ...}}; a stream is HTTP 200 whose one
    # event is {"error": {"message": ...}}, then [DONE].
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        body = {"text": "the power", "sampling_params": {"max_new_tokens": 100}}
        whole = _post(srv.url + "/generate", body)
        streamed = _post(srv.url + "/generate", dict(body, stream=True))
    msg = "Requested token count exceeds the model's maximum context length of 64 tokens."
    assert whole[0] == 400 and json.loads(whole[1])["error"]["message"].startswith(msg)
    code, raw = streamed
    events = [ln[len(b"data: "):] for ln in raw.splitlines() if ln.startswith(b"data: ")]
    assert code == 200 and events[-1] == b"[DONE]" and len(events) == 2, raw
    assert json.loads(events[0])["error"]["message"].startswith(msg)


def test_sglang_generate_refuses_a_batch_one_of_whose_prompts_does_not_fit():
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        code, raw = _post(srv.url + "/generate", {"text": ["the power", "word " * 70],
                                                  "sampling_params": {"max_new_tokens": 4}})
    assert code == 400 and "The input (71 tokens) is longer" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("max_new_tokens", [None, 60])
@pytest.mark.parametrize("batch", [{"text": ["x x x", "x x x"]}, {"text": "x x x", "n": 2}])
def test_sglang_generate_caps_each_sequence_of_a_batch_as_its_scheduler_caps_every_request(batch, max_new_tokens):
    # SGLang's scheduler caps every request (init_req_max_new_tokens): prompt + completion at most the context less 2,
    # a batch's each sequence as a single one. Before: a list of texts or n 2 skipped the cap: null ran 2^31-1 tokens
    # (no answer in 8 s at 2000 tok/s, a 64-token context), 60 ran 60 each (sum 64, not 62).
    sp = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    if "n" in batch:
        sp["n"] = batch["n"]
    body = {"text": batch["text"], "sampling_params": sp}
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        req = urllib.request.Request(srv.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            docs = json.loads(r.read())
    sums = [d["meta_info"]["prompt_tokens"] + d["meta_info"]["completion_tokens"] for d in docs]
    assert sums == [62, 62], docs


@pytest.mark.parametrize("prompt_tokens,max_new_tokens", [(58, None), (62, None), (63, None), (62, 0), (61, 2)])
def test_sglang_refuses_a_prompt_of_the_context_less_6_or_more_as_its_scheduler_does(prompt_tokens, max_new_tokens):
    # validate_input_length: a prompt of at least max_req_input_len (the context less 6) is aborted, 400 whole. Before:
    # run, and the one-token floor passed the cap (62 or 63 with null ran 1 token: prompt + completion 63 or 64, not 62).
    text = " ".join(["w"] * (prompt_tokens - 1))  # the BOS and one token a word
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        code, raw = _post(srv.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}})
        fits = _post(srv.url + "/generate", {"text": " ".join(["w"] * 56), "sampling_params": {"max_new_tokens": None}})
    assert code == 400, raw
    assert json.loads(raw)["error"]["message"] == (f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed "
                                                   "length (58 tokens). Use a shorter input or enable --allow-auto-truncate.")
    meta = json.loads(fits[1])["meta_info"]  # 57 tokens still run, capped at the context less 2
    assert fits[0] == 200 and meta["prompt_tokens"] + meta["completion_tokens"] == 62, fits
    # powerprof's client reads it as the context refusing (CONTEXT_FIX, not retried): none of the other words is in it.
    from powerprof.workload.client import names_context  # noqa: PLC0415

    assert names_context(json.loads(raw)["error"]["message"])


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_a_streamed_sglang_request_its_scheduler_aborts_is_a_200_stream_as_sglang_streams_it(path):
    # A prompt in [context - 6, context) passes the tokenizer manager; the scheduler aborts it (set_finish_with_abort:
    # FINISH_ABORT 400 BadRequestError). Streamed, the tokenizer manager's _handle_abort_finish_reason returns that
    # finished output instead of raising: /generate streams it (finish_reason abort with the message), then [DONE];
    # serving_chat.py @ 002897c2 (and serving_completions.py) send create_streaming_error_response(message,
    # "BAD_REQUEST", 400) as the one event of a 200 (the kick-start makes only a ValueError a 400), then [DONE].
    # Before: /generate sent a refusal's {"error": {"message"}} event, chat and completions a 400.
    text = " ".join(["w"] * 61)  # 62 tokens with the BOS, of a 64-token context
    msg = "Input length (62 tokens) exceeds the maximum allowed length (58 tokens). Use a shorter input or enable " \
          "--allow-auto-truncate."
    body = {"text": text, "sampling_params": {"max_new_tokens": 1}} if path == "/generate" else \
        {"prompt": text, "max_tokens": 1} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, **FAST) as srv:
        code, raw = _post(srv.url + path, dict(body, stream=True))
        whole = _post(srv.url + path, body)
        ran = list(srv.truth)
    events = [ln[len(b"data: "):] for ln in raw.splitlines() if ln.startswith(b"data: ")]
    assert code == 200 and len(events) == 2 and events[-1] == b"[DONE]", raw
    ev = json.loads(events[0])
    if path == "/generate":
        assert ev["meta_info"]["finish_reason"] == {"type": "abort", "message": msg, "status_code": 400,
                                                    "err_type": "BadRequestError"}, ev
        assert ev["output_ids"] == [] and ev["meta_info"]["completion_tokens"] == 0, ev
    else:
        assert ev == {"error": {"object": "error", "message": msg, "type": "BAD_REQUEST", "param": None,
                                "code": 400}}, ev
    assert whole[0] == 400 and msg in whole[1].decode(), whole  # whole: still raised as a ValueError
    assert not ran


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_whole_sglang_batch_with_a_prompt_its_scheduler_aborts_answers_400_and_runs_the_others_for_nobody(path):
    # tokenizer_manager.py @ 001067ff: every prompt passes _validate_one_request and is sent; _collect_batch_responses
    # gathers the first outputs and the aborted one's raises (_handle_abort_finish_reason, not streamed), so the client
    # has the 400 at once, while nothing aborts the others: they decode to their cap, the GPU working for nobody.
    # Before: the whole batch refused unrun (no truth row), so the energy a real server spends here was never seen.
    band = " ".join(["w"] * 61)  # 62 tokens with the BOS, of a 64-token context
    msg = "Input length (62 tokens) exceeds the maximum allowed length (58 tokens)."
    body = {"text": ["the power of the clock", band], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}} \
        if path == "/generate" else {"prompt": ["the power of the clock", band], "max_tokens": 2, "ignore_eos": True}
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, batching="continuous", **FAST) as srv:
        req = urllib.request.Request(srv.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", "X-Sim-Request-Id": "batch1"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        raw = e.value.read()
        deadline = time.monotonic() + 5
        while not srv.truth and time.monotonic() < deadline:
            time.sleep(0.02)
        rows = list(srv.truth)
    assert e.value.code == 400 and msg in raw.decode(), raw
    assert [(t["prompt_tokens"], t["generated"], t["client_id"]) for t in rows] == [(6, 2, "batch1")], rows
    # The GPU's work for nobody is in the client's truth row (continuous batching keeps a row's energy): a daemon test
    # can hold the daemon's figures against it (tests/test_daemon_cut_streams.py). Before: `is None or >= 0`, serial
    # batching's None passing.
    assert rows[0]["energy_j"] > 0, rows


def test_a_streamed_sglang_completions_batch_with_a_band_prompt_streams_the_error_and_runs_the_others_2_s():
    # serving_completions.py @ 004c82e0 _generate_completion_stream: the aborted prompt's output (returned, streamed)
    # is sent as one error event and the loop breaks, then [DONE]; its StreamingResponse's background task
    # (tokenizer_manager.py create_abort_task) aborts every prompt of the batch 2 s after the response ends: the
    # others decode that long for nobody, aborted (SGLang's counter counts none of them). Before: a 200 with the error
    # event and nothing run.
    band = " ".join(["w"] * 57)  # 58 tokens with the BOS, of a 64-token context: in the band, + 6 fits
    msg = "Input length (58 tokens) exceeds the maximum allowed length (58 tokens)."
    body = {"prompt": ["the power of the clock", band], "max_tokens": 6, "ignore_eos": True, "stream": True}
    with SimServer(flavour="sglang", n_ctx=64, sglang_warmup=False, batching="continuous", decode_tok_s=2.0,
                   draft_n_max=0) as srv:
        t0 = time.monotonic()
        code, raw = _post(srv.url + "/v1/completions", body, {"X-Sim-Request-Id": "batch1"})
        answered_s = time.monotonic() - t0
        deadline = time.monotonic() + 6
        while not srv.truth_cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        ended_s = time.monotonic() - t0
        rows = list(srv.truth_cancelled)
        assert not srv.truth, srv.truth
    events = [ln[len(b"data: "):] for ln in raw.splitlines() if ln.startswith(b"data: ")]
    assert code == 200 and len(events) == 2 and events[-1] == b"[DONE]", raw
    assert msg in json.loads(events[0])["error"]["message"], events
    assert answered_s < 0.5, answered_s
    assert [(t["prompt_tokens"], t["client_id"]) for t in rows] == [(6, "batch1")], rows
    # Aborted at 2 s, short of its 6 tokens at 2 tok/s.
    assert 1.8 < ended_s < 2.9 and 1 <= rows[0]["generated"] < 6 and rows[0]["energy_j"] > 0, (ended_s, rows)


# --- powerprof's client ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", ["llamacpp", "vllm", "sglang"])
def test_a_prompt_the_context_cannot_hold_stops_the_run_at_once_with_the_fix(flavour):
    with SimServer(flavour=flavour, n_ctx=64, n_slots=1, sglang_warmup=False, **FAST) as srv:
        with pytest.raises(LoadAborted) as e:
            run_load(srv.url, [Prompt("too-long", "word " * 80)], 2, 1, RequestParams(max_tokens=8), warmup=0)
    msg = str(e.value)
    assert "too-long" in msg and "not retried" in msg, msg
    assert "fix: use shorter prompts or a lower --max-tokens, or start the server with a longer context" in msg, msg
    assert [r.attempt for r in e.value.records] == [1]


class _Hook(UI):
    def __init__(self, act):
        self.act = act

    def level_start(self, i, n, visit, unit):
        self.act(visit)


def test_a_sweep_asking_more_tokens_than_the_servers_context_stops_before_the_first_level_with_the_fix(tmp_path):
    # `powerprof sweep --simulate --max-tokens 5000000` sat in its settle phase for minutes: the simulated server had
    # no context. llama-server would cut each request at its slot's context (4096 here), vLLM and SGLang refuse it.
    sim = SimNVML("seed-16g", state_path=None)
    before = sim.gpus[0].limit_w
    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError) as e:
        run_sweep(rig, levels_spec="300,200", out_dir=tmp_path / "run", params=RequestParams(max_tokens=5_000_000),
                  idle_s=0, interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=0)
    msg = str(e.value)
    assert "--max-tokens 5000000" in msg and "4096 tokens" in msg and "fix:" in msg and "--max-tokens" in msg, msg
    assert sim.gpus[0].limit_w == before


def test_a_context_refusal_mid_sweep_stops_it_with_the_fix_and_puts_the_limit_back(tmp_path, sim_server):
    # The server came back with a smaller context: its refusals stop the sweep at that level, not retried, saying
    # the fix; the operator's limit is back.
    sim = SimNVML("seed-16g", state_path=None)

    def shrink(visit):
        if visit.level_value == 200:
            sim_server[0].n_ctx = 8 * sim_server[0].n_slots

    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError) as e:
        run_sweep(rig, levels_spec="300,200", out_dir=tmp_path / "run", params=RequestParams(max_tokens=16), idle_s=0,
                  interval_s=0.2, min_requests=2, max_requests=4, warmup_requests=0, ui=_Hook(shrink))
    msg = str(e.value)
    assert "level 200" in msg and "exceeds the available context size" in msg and "not retried" in msg, msg
    assert "start the server with a longer context" in msg, msg
    assert sim.gpus[0].limit_w == 300.0


def test_a_prompt_files_own_max_tokens_past_the_context_is_refused_before_any_request_too():
    # The check read only --max-tokens: a prompt file's "max_tokens" (Prompt.max_tokens, which overrides it) past the
    # context passed, and on llama.cpp each answer was cut at the slot's context mid-run.
    from powerprof.workload.measure import measure

    with SimServer(flavour="llamacpp", n_ctx=64, n_slots=1, **FAST) as srv:
        with pytest.raises(ValueError) as e:
            measure(srv.url, prompts=[Prompt("ok", "hi"), Prompt("long-ask", "hi", max_tokens=500)], n_requests=2,
                    params=RequestParams(max_tokens=8), warmup=0, watch_others=False)
    msg = str(e.value)
    assert "500" in msg and "long-ask" in msg and "64 tokens" in msg and "fix:" in msg, msg


def test_max_tokens_every_prompt_overrides_is_not_asked_so_not_refused():
    from powerprof.workload.client import ServerInfo, context_problem

    srv = ServerInfo("http://127.0.0.1:1", "llamacpp", "llamacpp", context_tokens=64)
    assert context_problem(srv, 5000, [Prompt("a", "hi", max_tokens=16)]) is None
    assert "--max-tokens 5000" in context_problem(srv, 5000, [Prompt("a", "hi", max_tokens=16), Prompt("b", "hi")])
    assert context_problem(ServerInfo("http://127.0.0.1:1", "openai", "openai-completions"), 5000) is None  # says none


def test_a_sweep_whose_answers_the_context_cut_short_says_so(tmp_path, sim_server):
    # A --max-tokens below the slot's context but past what the prompt leaves: llama.cpp cuts each answer where the
    # slot fills (`truncated`). measure and sweep --trace said so; a sweep over prompts kept it in the rows alone,
    # its levels' figures those of shorter answers than asked, unsaid.
    sim = SimNVML("seed-16g", state_path=None)

    class Shrink(UI):
        def level_start(self, i, n, visit, unit):
            sim_server[0].n_ctx = 40 * sim_server[0].n_slots  # the prompts (8+ tokens) leave fewer than 36

    with Rig("seed-16g", nvml=sim) as rig:
        out = run_sweep(rig, levels_spec="300", out_dir=tmp_path / "run", params=RequestParams(max_tokens=36),
                        idle_s=0, interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=0, ui=Shrink())
    cut = [n for n in out.notes if "cut short" in n]
    assert len(cut) == 1 and "of 36 tokens" in cut[0] and "fix:" in cut[0], out.notes
