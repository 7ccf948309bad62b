"""The simulator's SGLang flavour against powerprof's SGLang paths: detection, its OpenAI streams counted token for
token against the simulator's truth, and its /metrics as SGLang's multiprocess collector shows it (docs/simulator.md)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams, detect_server, new_session
from powerprof.workload.load import Prompt
from powerprof.workload.servercount import counter_total, histogram_sum_count, unset_means_zero


def _metrics(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()


def test_detected_as_sglang():
    async def go(url):
        async with new_session() as s:
            return await detect_server(s, url)

    with SimServer(flavour="sglang") as srv:
        info = asyncio.run(go(srv.url))
    assert (info.kind, info.api, info.model, info.simulated) == ("sglang", "openai-completions", "sim-model.gguf", True)


def test_metrics_appear_as_sglangs_do():
    """--skip-server-warmup: no family of its engine until the first prefill log and request end, only its HTTP
    middleware's (the scrape itself counted, and active, before it is answered); with its warm-up (default): the
    warm-up's 2 tokens counted before it is ready. Its gauges keep their last log's values (not the engine's)."""
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=200.0, draft_n_max=0) as srv:
        fresh = _metrics(srv.url)
        names = {ln.split("{")[0] for ln in fresh.splitlines() if ln and not ln.startswith("#")}
        assert names == {"sglang:http_requests_total", "sglang:http_requests_active"}, fresh
        assert unset_means_zero(fresh, "sglang")  # nothing finished: the absent token counter reads 0
        body = b'{"text": "x", "sampling_params": {"max_new_tokens": 30, "ignore_eos": true}}'
        t = time.monotonic()
        urllib.request.urlopen(urllib.request.Request(srv.url + "/generate", body, {"Content-Type": "application/json"}),
                               timeout=30).read()
        took = time.monotonic() - t
        text = _metrics(srv.url)
        assert counter_total(text, "sglang:generation_tokens_total") == 30.0
        # Its end-to-end latency, observed with its tokens (observe_one_finished_request): 30 tokens at 200/s and more.
        count, sum_s = histogram_sum_count(text, "sglang:e2e_request_latency_seconds")
        assert count == 1.0 and 0.15 <= sum_s <= took, (sum_s, took)
        assert 'sglang:num_running_reqs{engine_type="unified",model_name="sim-model.gguf",pp_rank="0",tp_rank="0"} 0.0' in text
        assert "process_start_time_seconds" not in text and "_created" not in text
    with SimServer(flavour="sglang") as srv:
        assert counter_total(_metrics(srv.url), "sglang:generation_tokens_total") == 2.0


def test_measure_counts_sglangs_streams_against_the_truth(tmp_path):
    """SGLang's chat and completions streams (usage null mid-stream, the last token on the finish chunk of
    /v1/completions, a finish chunk of its own on chat) counted as the server generated them, and its /metrics
    counter read as the server's books: no foreign-traffic flag on a quiet server."""
    from powerprof.workload.measure import run_measure

    sim = SimNVML("seed-16g", state_path=None)
    for api in ("openai-completions", "openai-chat"):
        out = tmp_path / api
        with SimServer(sim, flavour="sglang", decode_tok_s=120.0) as srv, Rig("seed-16g", nvml=sim) as rig:
            run_measure(rig, url=srv.url, out_dir=out, prompts=[Prompt("p0", "hello there")], n_requests=3,
                        concurrencies=[1], params=RequestParams(max_tokens=40), warmup=1, interval_s=0.2, api=api)
            truth = sum(t["generated"] for t in srv.truth)  # the warm-up request too: it has its window
        w = pq.read_table(out / "windows.parquet").to_pandas()
        w = w[w.window_kind == "request"]
        assert w.foreign_traffic.isna().all(), w.foreign_traffic.tolist()
        assert int(w.generated_tokens.sum()) == truth, (api, w.generated_tokens.tolist(), truth)


def test_generate_events_and_a_finished_request_on_metrics_as_sglangs_source_has_them():
    """tokenizer_manager.py (_handle_batch_output): meta_info's keys, `e2e_latency` only in a request's last event
    (before, the simulator put it in every event); collector.py (observe_one_finished_request): a finished request
    sets sglang:num_retractions and, when its prompt was cached, sglang:cached_tokens_total with its tokens."""
    import json

    def post(body):
        req = urllib.request.Request(srv.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=30).read()

    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=300.0, draft_n_max=0) as srv:
        raw = post({"text": "the watt", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}, "stream": True})
        # Two choices of one prompt: SGLang prefills it first in a request of its own (max_new_tokens 0), which finds
        # it cached from the request before; both choices then find it there too (each says all of it but one token).
        answers = json.loads(post({"text": "the watt", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "n": 2}}))
        text = _metrics(srv.url)
        truth = srv.truth
    events = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    keys = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
            "completion_tokens", "cached_tokens"]
    assert all(list(e["meta_info"]) == keys for e in events[:-1]), events[0]
    assert list(events[-1]["meta_info"]) == keys + ["e2e_latency"], events[-1]
    assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, 7))
    cached = [a["meta_info"]["cached_tokens"] for a in answers]
    p = answers[0]["meta_info"]["prompt_tokens"]
    assert cached == [p - 1, p - 1], cached
    (hidden,) = [t for t in truth if t["kind"] == "hidden_prefill"]  # said on /metrics alone, its hit too
    assert hidden["cached_tokens"] == p - 1 and hidden["generated"] == 0
    assert counter_total(text, "sglang:cached_tokens_total") == sum(cached) + hidden["cached_tokens"]
    assert histogram_sum_count(text, "sglang:num_retractions") == (4.0, 0.0)
    assert not unset_means_zero(text.replace("sglang:generation_tokens", "sglang:renamed"), "sglang")


def test_generate_takes_input_ids_as_those_tokens_one_prompt_or_a_batch():
    # SGLang's /generate takes `input_ids` in place of `text` (managers/io_struct.py GenerateReqInput: a list of ids is
    # one prompt, a list of lists a batch), run as given, no BOS added. Before: the simulator read `text` alone, so an
    # id prompt ran as the empty text (1 token) where the proxy counted its ids.
    import json

    with SimServer(flavour="sglang", decode_tok_s=2000.0, draft_n_max=0) as srv:
        for key, ids, want in (("one", list(range(1000, 1100)), [100]), ("batch", [[5, 6, 7], [8, 9]], [3, 2])):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            req = urllib.request.Request(srv.url + "/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json", "X-Sim-Request-Id": key})
            with urllib.request.urlopen(req, timeout=30) as r:
                doc = json.loads(r.read())
            docs = doc if isinstance(doc, list) else [doc]
            assert [d["meta_info"]["prompt_tokens"] for d in docs] == want, doc
            assert srv.request_truth()[key]["prompt_tokens"] == sum(want)


def _send(url: str, method: str, path: str, data: bytes, content_type: str | None = "application/json") -> tuple:
    """(HTTP status, the answer's JSON) of one request, its body and content type as given (None: no such header;
    http.client, as urllib would add a form type of its own)."""
    import http.client
    import json
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, data, {"Content-Type": content_type} if content_type else {})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_generate_takes_put_as_sglangs_route_does():
    # http_server.py routes /generate with methods ["POST", "PUT"] (@app.api_route): a PUT runs as a POST does.
    # Before: the simulator routed POST alone and answered a PUT 405 {"detail": "Method Not Allowed"}, so a client
    # using PUT passed nowhere here and ran on the real server. The other flavours have no /generate: 404 for any method.
    import json

    body = json.dumps({"text": "the watt", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}).encode()
    with SimServer(flavour="sglang", decode_tok_s=2000.0, draft_n_max=0) as srv:
        code, doc = _send(srv.url, "PUT", "/generate", body)
        truth = srv.truth
        page = _metrics(srv.url)
    assert code == 200 and doc["meta_info"]["completion_tokens"] == 3, (code, doc)
    assert [t["generated"] for t in truth if t["kind"] != "hidden_prefill"] == [3]
    assert 'sglang:http_responses_total{endpoint="/generate",method="PUT",status_code="200"} 1.0' in page
    for flavour, want in (("llamacpp", {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}),
                          ("vllm", {"detail": "Not Found"})):
        with SimServer(flavour=flavour, decode_tok_s=2000.0) as srv:
            assert _send(srv.url, "PUT", "/generate", body) == (404, want), flavour


def test_openai_routes_refuse_a_body_not_sent_as_json_as_sglangs_dependency_does():
    # http_server.py: /v1/completions, /v1/chat/completions, /v1/embeddings, /v1/responses and /tokenize depend on
    # validate_json_request, which refuses any media type but application/json (none included) with a
    # RequestValidationError, answered 400 (flat; nested under "error" on /v1/responses). /generate has no such check:
    # FastAPI leaves a body of a non-JSON type as bytes, which its GenerateReqInput refuses (400), and reads one with no
    # type as JSON. Before: the simulator read every body as JSON whatever its type, and ran them all.
    import json

    unsupported = "Unsupported Media Type: Only 'application/json' is allowed"
    chat = {"messages": [{"role": "user", "content": "the watt"}], "max_tokens": 2}
    cases = [("/v1/completions", {"prompt": "the watt", "max_tokens": 2}, "text/plain"),
             ("/v1/completions", {"prompt": "the watt", "max_tokens": 2}, None),
             ("/v1/chat/completions", chat, "application/x-www-form-urlencoded"),
             ("/tokenize", {"prompt": "the watt"}, "text/plain")]
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=2000.0, draft_n_max=0) as srv:
        for path, body, ctype in cases:
            code, doc = _send(srv.url, "POST", path, json.dumps(body).encode(), ctype)
            assert code == 400 and doc["object"] == "error" and unsupported in doc["message"], (path, ctype, doc)
            assert (doc["type"], doc["param"], doc["code"]) == ("Bad Request", None, 400), doc
        code, doc = _send(srv.url, "POST", "/v1/responses", json.dumps({"input": "hi"}).encode(), "text/plain")
        assert code == 400 and unsupported in doc["error"]["message"] and doc["error"]["code"] == 400, doc
        # Not JSON at all, and typed so: the type is refused first (the body is never parsed).
        code, doc = _send(srv.url, "POST", "/v1/completions", b"prompt=the+watt", "text/plain")
        assert code == 400 and unsupported in doc["message"], doc
        gen = json.dumps({"text": "the watt", "sampling_params": {"max_new_tokens": 2}}).encode()
        code, doc = _send(srv.url, "POST", "/generate", gen, "text/plain")
        assert code == 400 and doc["object"] == "error" and "GenerateReqInput" in doc["message"], doc
        assert not srv.truth  # none of them ran
        for path, body, ctype in (("/v1/completions", {"prompt": "the watt", "max_tokens": 2},
                                   "Application/JSON; charset=utf-8"), ("/generate", json.loads(gen), None),
                                  ("/generate", json.loads(gen), "application/vnd.api+json")):
            code, doc = _send(srv.url, "POST", path, json.dumps(body).encode(), ctype)
            assert code == 200, (path, ctype, doc)


def test_a_length_below_one_refused_as_sglangs_request_models_and_sampling_params_do():
    # /v1/completions: CompletionRequest's `max_tokens: int = 16` (not Optional: null is int_type) with its
    # validate_max_tokens_positive, a validation error (400, pydantic's list as the message). Chat reads
    # `max_completion_tokens or max_tokens` (a 0 falls back) and its SamplingParams.verify refuses a negative, 400
    # BadRequestError. Before: completions ran 0 as absent (16 tokens), -1 and chat's -1 one token, null 16.
    import json

    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=2000.0, draft_n_max=0) as srv:
        for given, kind, msg in ((0, "value_error", "Value error, max_tokens must be positive"),
                                 (-1, "value_error", "Value error, max_tokens must be positive"),
                                 ("0", "value_error", "Value error, max_tokens must be positive"),
                                 (None, "int_type", "Input should be a valid integer")):
            for extra in ({}, {"echo": True}, {"stream": True}):
                body = dict({"prompt": "the watt", "max_tokens": given}, **extra)
                code, doc = _send(srv.url, "POST", "/v1/completions", json.dumps(body).encode())
                err = {"type": kind, "loc": ("body", "max_tokens"), "msg": msg, "input": given}
                if kind == "value_error":
                    err["ctx"] = {"error": ValueError("max_tokens must be positive")}
                assert (code, doc) == (400, {"object": "error", "message": str([err]), "type": "Bad Request",
                                             "param": None, "code": 400}), (body, code, doc)
        chat = {"messages": [{"role": "user", "content": "the watt"}]}
        for extra, n in (({"max_tokens": -1}, -1), ({"max_completion_tokens": -2, "max_tokens": 3}, -2),
                         ({"max_completion_tokens": 0, "max_tokens": -1, "stream": True}, -1)):
            code, doc = _send(srv.url, "POST", "/v1/chat/completions", json.dumps(dict(chat, **extra)).encode())
            assert (code, doc) == (400, {"object": "error", "message": f"max_new_tokens must be at least 0, got {n}.",
                                         "type": "BadRequestError", "param": None, "code": 400}), (extra, doc)
        assert not srv.truth
        body = dict(chat, max_completion_tokens=0, max_tokens=3, ignore_eos=True)
        code, doc = _send(srv.url, "POST", "/v1/chat/completions", json.dumps(body).encode())
        assert code == 200 and doc["usage"]["completion_tokens"] == 3, doc


def test_generate_reads_max_new_tokens_as_sglangs_unvalidated_sampling_params_do():
    # /generate's sampling_params is a plain dict: null runs to the context (its scheduler's `1 << 30`, capped there),
    # a float until the count reaches it, a negative is SamplingParams.verify's ValueError (400 whole, an error event in
    # a 200 stream), and a text raises a TypeError nothing catches: Starlette's plain 500, or a stream's 200 head and
    # then a closed connection. Before: null ran 128 tokens, "5" 5, 5.5 5, and -1 one token.
    import http.client
    import json

    def gen(srv, sp, stream=False):
        body = {"text": "the watt", "sampling_params": dict(sp, ignore_eos=True), "stream": stream}
        u = srv.url.split("//")[1]
        conn = http.client.HTTPConnection(u.split(":")[0], int(u.split(":")[1]), timeout=30)
        try:
            conn.request("POST", "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
            r = conn.getresponse()
            try:
                return r.status, r.read().decode()
            except http.client.IncompleteRead as e:
                return r.status, ("cut", e.partial.decode())
        finally:
            conn.close()

    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=64, decode_tok_s=5000.0, draft_n_max=0) as srv:
        code, text = gen(srv, {"max_new_tokens": None})
        meta = json.loads(text)["meta_info"]
        # Its scheduler caps a run at max_req_len - prompt - 1, max_req_len the context less 1 (before: 64).
        assert code == 200 and meta["prompt_tokens"] + meta["completion_tokens"] == 62, meta
        assert meta["finish_reason"]["type"] == "length", meta
        code, text = gen(srv, {"max_new_tokens": 61})  # within the context, so not refused: capped alike
        assert code == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 59, text
        for given, want in ((5.5, 6), (True, 1), (3, 3)):
            code, text = gen(srv, {"max_new_tokens": given})
            assert code == 200 and json.loads(text)["meta_info"]["completion_tokens"] == want, (given, text)
        n_ran = len(srv.truth)
        assert gen(srv, {"max_new_tokens": -1}) == (400, json.dumps(
            {"error": {"message": "max_new_tokens must be at least 0, got -1."}}))
        code, text = gen(srv, {"max_new_tokens": -1}, stream=True)
        assert code == 200 and text == ('data: {"error": {"message": "max_new_tokens must be at least 0, got -1."}}'
                                        '\n\ndata: [DONE]\n\n'), text
        assert gen(srv, {"max_new_tokens": "5"}) == (500, "Internal Server Error")
        code, text = gen(srv, {"max_new_tokens": "5"}, stream=True)
        assert code == 200 and text in (("cut", ""), ""), text  # the head, then the connection closed: no event
        assert len(srv.truth) == n_ran  # none of the refused ran
        # Infinity fails its context check; NaN passes every comparison and runs (before: both aiohttp's 500, the
        # simulator's math.ceil raising).
        code, text = gen(srv, {"max_new_tokens": float("inf")})
        assert code == 400 and "You requested a total of inf tokens" in text, text
        code, text = gen(srv, {"max_new_tokens": float("nan")})
        meta = json.loads(text)["meta_info"]
        assert code == 200 and meta["prompt_tokens"] + meta["completion_tokens"] == 62, meta


def test_a_length_of_0_is_a_prefill_only_request_as_sglang_runs_it():
    # max_new_tokens 0 (chat's `None or 0`, `0 or 0`; /generate's own) is SGLang's prefill-only request
    # (Req.is_prefill_only): its prompt prefilled, no token. Before: chat ran it to the context (32765 tokens at the
    # default context), /generate ran 1 token.
    import json

    chat = {"messages": [{"role": "user", "content": "the watt"}], "ignore_eos": True}
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=200000.0, draft_n_max=0) as srv:
        for extra in ({"max_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 0}):
            code, doc = _send(srv.url, "POST", "/v1/chat/completions", json.dumps(dict(chat, **extra)).encode())
            assert code == 200 and doc["usage"]["completion_tokens"] == 0, (extra, doc)
            assert doc["choices"][0]["message"]["content"] == "" and doc["choices"][0]["finish_reason"] == "length"
        gen = {"text": "the watt", "sampling_params": {"max_new_tokens": 0}}
        code, doc = _send(srv.url, "POST", "/generate", json.dumps(gen).encode())
        assert code == 200 and doc["meta_info"]["completion_tokens"] == 0 and doc["output_ids"] == [], doc
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/generate", json.dumps(dict(gen, stream=True))
                                    .encode(), {"Content-Type": "application/json"}), timeout=30) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert len(events) == 2 and events[1] == "data: [DONE]", events  # its one output, finished, then [DONE]
        assert json.loads(events[0][6:])["meta_info"]["finish_reason"] == {"type": "length", "length": 0}, events
        rows = list(srv.truth)
        assert [t["generated"] for t in rows] == [0] * 4 and all(t["prompt_tokens"] > 0 for t in rows), rows


@pytest.mark.parametrize("batch", [{"text": ["the watt", "a joule"]}, {"text": "the watt", "n": 2}], ids=["list", "n2"])
def test_a_streamed_batch_of_length_0_sends_each_index_finished_as_sglang_does(batch):
    # SGLang streams each index's finished output (no token, prompt_tokens said), then [DONE]. Before: the batch loop
    # wrote only on token payloads, and the stream was `data: [DONE]` alone.
    import json

    sp = {"max_new_tokens": 0, **({"n": batch["n"]} if "n" in batch else {})}
    body = {"text": batch["text"], "sampling_params": sp, "stream": True}
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=200000.0, draft_n_max=0) as srv:
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/generate", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"}), timeout=30) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
    assert len(events) == 3 and events[-1] == "data: [DONE]", events
    docs = sorted((json.loads(e[6:]) for e in events[:2]), key=lambda d: d["index"])
    assert [d["index"] for d in docs] == [0, 1], docs
    for d in docs:
        assert d["output_ids"] == [] and d["meta_info"]["finish_reason"] == {"type": "length", "length": 0}, d
        assert d["meta_info"]["prompt_tokens"] > 0 and d["meta_info"]["completion_tokens"] == 0, d


@pytest.mark.parametrize("n", [1, 2])
def test_a_chat_stream_of_length_0_sends_each_index_its_role_chunk_as_sglang_does(n):
    # serving_chat's _generate_chat_stream sends each index's {"role": "assistant", "content": ""} (is_firsts) with its
    # first output, a length 0's finished one too, then its finish chunk. Before: the finish chunk alone (n 1: role
    # null; n 2: delta {}).
    import json

    body = {"messages": [{"role": "user", "content": "the watt"}], "max_tokens": 0, "n": n, "stream": True}
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=200000.0, draft_n_max=0) as srv:
        with urllib.request.urlopen(urllib.request.Request(srv.url + "/v1/chat/completions", json.dumps(body).encode(),
                                    {"Content-Type": "application/json"}), timeout=30) as r:
            events = [e[6:] for e in r.read().decode().split("\n\n") if e.startswith("data: {")]
    choices = [c for e in events for c in json.loads(e)["choices"]]
    for i in range(n):
        mine = [c for c in choices if c["index"] == i]
        assert [c["delta"].get("role") for c in mine] == ["assistant", None], choices
        assert mine[0]["delta"]["content"] == "" and mine[-1]["finish_reason"] == "length", choices


def test_a_chat_without_a_length_runs_to_the_context_as_sglangs_scheduler_runs_it():
    # serving_chat passes `max_completion_tokens or max_tokens` as max_new_tokens: neither given (a 0
    # max_completion_tokens falls back) is None, which the tokenizer manager does not check against the context and the
    # scheduler runs to it (`1 << 30`, capped at max_req_len - prompt - 1, max_req_len the context less 1). Before: 128
    # tokens, and at a 64-token context refused 400 (prompt + 128 too long); then the whole context (64, not 62).
    import json

    chat = {"messages": [{"role": "user", "content": "the watt"}], "ignore_eos": True}
    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=64, decode_tok_s=5000.0, draft_n_max=0) as srv:
        for extra in ({}, {"max_completion_tokens": 0, "max_tokens": None}, {"max_completion_tokens": 0}):
            code, doc = _send(srv.url, "POST", "/v1/chat/completions", json.dumps(dict(chat, **extra)).encode())
            assert code == 200, (extra, doc)
            u = doc["usage"]
            assert u["prompt_tokens"] + u["completion_tokens"] == 62 and doc["choices"][0]["finish_reason"] == "length"
        code, doc = _send(srv.url, "POST", "/v1/chat/completions", json.dumps(dict(chat, max_tokens=5)).encode())
        assert code == 200 and doc["usage"]["completion_tokens"] == 5, doc


def test_responses_generates_two_fewer_than_asked_as_sglangs_responses_request_does():
    # serving_responses.py create_responses: default_max_tokens = max(context - prompt, 512); protocol.py
    # ResponsesRequest.to_sampling_params: max_output_tokens (`is not None`) lowered to it, then 2 less ("avoid exceed
    # the context length"). Before: max_output_tokens as given (5 generated 5), and 0 or none ran 128.
    import json

    def ask(srv, **extra):
        return _send(srv.url, "POST", "/v1/responses", json.dumps(dict({"input": "the watt"}, **extra)).encode())

    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=4096, decode_tok_s=20000.0, draft_n_max=0) as srv:
        for asked, generated in ((5, 3), (3, 1)):  # below the simulated model's first end-of-sequence (16 or more)
            code, doc = ask(srv, max_output_tokens=asked)
            assert code == 200 and doc["usage"]["output_tokens"] == generated, (asked, doc)
        # None: the context's room less 2, which the model's end of sequence (16-63 tokens in) always ends first, as
        # SGLang's Responses take no ignore_eos: seen through the server as an answer run to its end, as one asked far
        # more (its floor of 512 is seen below, refused at a 64-token context).
        code, doc = ask(srv)
        code_far, doc_far = ask(srv, max_output_tokens=3000)
        assert (code, doc["status"]) == (code_far, doc_far["status"]) == (200, "completed"), (doc, doc_far)
        assert 16 <= doc["usage"]["output_tokens"] == doc_far["usage"]["output_tokens"] < 64, (doc, doc_far)
        for asked in (0, 1):  # -2 and -1: SamplingParams.verify's ValueError, 400
            code, doc = ask(srv, max_output_tokens=asked)
            assert (code, doc["message"]) == (400, f"max_new_tokens must be at least 0, got {asked - 2}."), doc
        assert len(srv.truth) == 4  # the four that ran; the refused ran nothing
    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=64, decode_tok_s=20000.0, draft_n_max=0) as srv:
        code, doc = ask(srv)  # the default's floor of 512 (510 asked) does not fit a 64-token context
    assert code == 400 and "You requested a total of 513 tokens" in doc["message"], doc


def test_responses_ignore_eos_is_dropped_as_sglangs_responses_request_has_no_such_field():
    # protocol.py @ 004c82e0: ResponsesRequest has no ignore_eos (pydantic drops an unknown field) and its
    # to_sampling_params sets none, so the answer ends at the model's end of sequence. vLLM's ResponsesRequest has the
    # field and passes it to its SamplingParams. Before: SGLang's flavour honoured it (98 tokens where 100 were asked).
    import json

    def ask(srv, **extra):
        body = dict({"input": "the watt", "max_output_tokens": 100}, **extra)
        return _send(srv.url, "POST", "/v1/responses", json.dumps(body).encode())

    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=4096, decode_tok_s=20000.0, draft_n_max=0) as srv:
        code, plain = ask(srv)
        code2, asked = ask(srv, ignore_eos=True)
    assert code == code2 == 200, (plain, asked)
    assert asked["usage"]["output_tokens"] == plain["usage"]["output_tokens"] < 98, (plain, asked)
    with SimServer(flavour="vllm", n_ctx=4096, decode_tok_s=20000.0, draft_n_max=0) as srv:
        code, doc = ask(srv, ignore_eos=True)
    assert code == 200 and doc["usage"]["output_tokens"] == 100, doc


def test_a_streamed_responses_request_sglang_refuses_is_a_200_stream_that_breaks():
    # serving_responses.py responses_stream_generator sends response.created and response.in_progress before it reads
    # the generation, whose ValueError (max_new_tokens -2 or -1: max_output_tokens 0 or 1) nothing there catches:
    # a 200 event stream that breaks with no end. Before: the unstreamed 400.
    import http.client
    import json
    import urllib.parse

    with SimServer(flavour="sglang", sglang_warmup=False, n_ctx=4096, decode_tok_s=20000.0, draft_n_max=0) as srv:
        u = urllib.parse.urlsplit(srv.url)
        for asked in (0, 1):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            try:
                conn.request("POST", "/v1/responses", json.dumps({"input": "the watt", "max_output_tokens": asked,
                                                                  "stream": True}).encode(),
                             {"Content-Type": "application/json"})
                r = conn.getresponse()
                assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream"), asked
                with pytest.raises(http.client.IncompleteRead) as e:  # chunked, and no last chunk comes
                    r.read()
            finally:
                conn.close()
            events = [json.loads(line[6:])["type"] for line in e.value.partial.decode().splitlines()
                      if line.startswith("data: ")]
            assert events == ["response.created", "response.in_progress"], (asked, e.value.partial)
        assert not srv.truth  # nothing ran
