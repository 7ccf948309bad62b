"""The simulated server's n > 1 choices, /v1/messages, /v1/responses and /v1/embeddings: wire formats as the real
servers send them (llama.cpp's captured from llama-server b11434, vLLM's read from its source), and GPU work that is
real (n choices are n sequences in the batch; an embedding is a prefill of its input and no decode) with its truth."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.stream import StreamParser, parse_response

CHAT = {"messages": [{"role": "user", "content": "the power of the clock"}], "max_tokens": 6}


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _summary(api: str, body: dict, raw: bytes):
    if body.get("stream"):
        p = StreamParser(api, count_only=True)
        p.count(raw)
        return p.finish()
    return parse_response(api, raw)[1]


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in raw.split(b"\n") if line.startswith(b"data:") and line[5:].strip()
            not in (b"[DONE]", b"null")]


@pytest.fixture(scope="module", params=["llamacpp", "vllm"])
def server(request):
    with SimServer(SimNVML("h200-141g", state_path=None), flavour=request.param, decode_tok_s=400,
                   batching="continuous", embeddings=True) as srv:
        yield srv


CASES = [
    ("openai-chat", "/v1/chat/completions", dict(CHAT, n=2, stream=True, stream_options={"include_usage": True})),
    ("openai-chat", "/v1/chat/completions", dict(CHAT, n=3, stream=True,
                                                stream_options={"include_usage": True, "continuous_usage_stats": True})),
    ("openai-completions", "/v1/completions", {"prompt": "watt token speed", "max_tokens": 5, "n": 2, "stream": True,
                                               "stream_options": {"include_usage": True}}),
    ("anthropic-messages", "/v1/messages", dict(CHAT, stream=True)),
    ("anthropic-messages", "/v1/messages", CHAT),
    ("openai-responses", "/v1/responses", {"input": "the power of the clock", "max_output_tokens": 6, "stream": True}),
    ("openai-responses", "/v1/responses", {"input": [{"role": "user", "content": "the power"}], "max_output_tokens": 6}),
]


@pytest.mark.parametrize("api,path,body", CASES, ids=[f"{c[0]}-{'stream' if c[2].get('stream') else 'whole'}-n{c[2].get('n', 1)}"
                                                      for c in CASES])
def test_the_server_says_the_counts_its_engine_generated(server, api, path, body):
    key = f"{api}-{len(server.truth)}"
    status, raw = _post(server.url + path, body, {"X-Sim-Request-Id": key})
    assert status == 200, raw[:300]
    s = _summary(api, body, raw)
    truth = server.request_truth()[key]
    n = body.get("n", 1)
    assert truth["sequences"] == n
    assert s.generated_tokens == truth["generated"] and s.server_error is None and s.invalid is None
    # llama.cpp prefills the prompt in each choice's slot and says so n times; vLLM computes it once.
    assert s.prompt_tokens == (truth["prompt_tokens"] if server.flavour == "llamacpp" else truth["prompt_tokens"] // n)
    assert truth["energy_j"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_turn_after_a_stored_one_runs_the_whole_conversation(server, stream):
    # vLLM (its serving_responses, store on) prepends a previous_response_id's stored turn, its input and output, to
    # the new input: the prompt it prefills and says in usage.input_tokens is the whole conversation; an id it never
    # stored is 404 "Response with id '…' not found.". llama.cpp's converter refuses the field (400). Before: the
    # simulator ignored it, its prompt the new input alone, so no test could judge a stateful turn's estimate.
    from powerprof.sim.server import count_prompt_tokens

    first = {"input": "the power of the clock", "instructions": "be brief", "max_output_tokens": 6, "stream": stream}
    status, raw = _post(server.url + "/v1/responses", first)
    assert status == 200, raw[:300]
    done = _events(raw)[-1]["response"] if stream else json.loads(raw)
    said = done["output"][0]["content"][0]["text"]
    second = {"input": "and the fan", "previous_response_id": done["id"], "max_output_tokens": 6, "stream": stream}
    key = f"turn2-{stream}-{len(server.truth)}"
    status, raw = _post(server.url + "/v1/responses", second, {"X-Sim-Request-Id": key})
    if server.flavour == "llamacpp":
        assert status == 400 and b"llama.cpp does not support 'previous_response_id'." in raw, raw[:300]
        return
    assert status == 200, raw[:300]
    # The stored turn's instructions are not: vLLM's construct_input_messages drops a stored turn's system messages
    # since vllm-project/vllm#37727 (before it, it prefilled them again: `responses_carry_instructions`).
    whole = count_prompt_tokens("\n".join(["the power of the clock", said, "and the fan"]))
    assert server.request_truth()[key]["prompt_tokens"] == whole
    assert _summary("openai-responses", second, raw).prompt_tokens == whole
    status, raw = _post(server.url + "/v1/responses", dict(second, previous_response_id="resp_nowhere"))
    assert status == 404 and json.loads(raw)["error"]["message"] == "Response with id 'resp_nowhere' not found."


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_vllm_responses_answer_cut_at_its_length_is_incomplete_as_vllms_serving_says(stream):
    # vLLM's responses/serving.py @ 4d89a999 responses_full_generator: "incomplete" where the output's finish_reason
    # is "length" (max_output_tokens, or the context's end), with ResponsesResponse.from_request's incomplete_details
    # {"reason": "max_output_tokens"}; "completed" and null otherwise. A stream's response.completed event carries the
    # same object (the event's type stays response.completed). Before: "completed" always, no incomplete_details.
    def final(srv, body):
        status, raw = _post(srv.url + "/v1/responses", dict(body, stream=stream))
        assert status == 200, raw
        if not stream:
            return json.loads(raw)
        done = [e for e in _events(raw) if e["type"] == "response.completed"]
        assert len(done) == 1, raw
        return done[0]["response"]

    with SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", n_ctx=64, decode_tok_s=4000) as srv:
        for body in ({"input": "the power of the clock", "max_output_tokens": 6},  # cut at its max_output_tokens
                     {"input": "the power", "ignore_eos": True}):  # cut where the context ends
            doc = final(srv, body)
            assert (doc["status"], doc["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"}), doc
        doc = final(srv, {"input": "the power of the clock", "max_output_tokens": 60})  # its end of sequence first
        assert doc["usage"]["output_tokens"] < 60, doc
        assert (doc["status"], doc["incomplete_details"]) == ("completed", None), doc


def test_a_responses_turn_renders_its_own_tools_not_the_stored_turns():
    # vLLM's Responses path renders each request's `tools` (construct_tool_dicts) into its prompt; a stored turn keeps
    # its messages, not its tools. Before: the simulator rendered none, so no test saw a stateful turn's tools counted.
    from powerprof.sim.server import SimServer, count_prompt_tokens

    tools = [{"type": "function", "name": "search", "parameters": {"type": "object"}}]
    js = "\n" + json.dumps(tools, separators=(",", ":"))
    srv = SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm").start()
    try:
        first = {"input": "the clock", "tools": tools, "max_output_tokens": 4}
        status, raw = _post(srv.url + "/v1/responses", first, {"X-Sim-Request-Id": "first"})
        done = json.loads(raw)
        assert srv.request_truth()["first"]["prompt_tokens"] == count_prompt_tokens("the clock" + js)
        second = {"input": "and the fan", "previous_response_id": done["id"], "max_output_tokens": 4}
        status, raw = _post(srv.url + "/v1/responses", second, {"X-Sim-Request-Id": "second"})
        said = done["output"][0]["content"][0]["text"]
        assert srv.request_truth()["second"]["prompt_tokens"] == count_prompt_tokens(
            "\n".join(["the clock", said, "and the fan"]))
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("think,forced", [(0, True), (5, False), (5, True)], ids=["call", "thinking", "both"])
def test_a_responses_answers_thinking_and_function_call_are_items_a_later_turn_does_not_prefill(stream, think, forced):
    # vLLM's Responses answer from a thinking model (a reasoning parser) holds a `reasoning` item before its message,
    # its tokens in usage.output_tokens_details.reasoning_tokens; a forced call (tool_choice "required" or named) is a
    # `function_call` item. A later turn naming it prefills only the stored output's messages (vLLM's
    # responses/utils.py construct_input_messages: "We skip the reasoning output", and a ResponseFunctionToolCall is
    # no ResponseOutputMessage). Before: the simulator said reasoning_tokens 0, had no call on /v1/responses, and
    # stored the whole generated text as the next turn's history.
    from powerprof.sim.server import count_prompt_tokens

    tools = [{"type": "function", "name": "search", "parameters": {"type": "object"}}]
    js = "\n" + json.dumps(tools, separators=(",", ":"))
    srv = SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", decode_tok_s=400,
                    reasoning_tokens=think).start()
    try:
        first = {"input": "the clock", "tools": tools, "max_output_tokens": 12, "ignore_eos": True, "stream": stream,
                 **({"tool_choice": {"type": "function", "name": "search"}} if forced else {})}
        status, raw = _post(srv.url + "/v1/responses", first)
        assert status == 200, raw[:300]
        done = _events(raw)[-1]["response"] if stream else json.loads(raw)
        kinds = [item["type"] for item in done["output"]]
        assert kinds == ["reasoning"] * bool(think) + ["function_call" if forced else "message"], kinds
        assert done["usage"]["output_tokens"] == 12
        assert done["usage"]["output_tokens_details"]["reasoning_tokens"] == think
        s = _summary("openai-responses", first, raw)
        assert s.reasoning_tokens == think and s.generated_tokens == 12
        last = done["output"][-1]
        if forced:
            assert last["name"] == "search" and len(last["arguments"].split()) == 12 - think - bool(think)
        if stream:  # each step's thinking and arguments in their own delta events
            deltas = [e["type"] for e in _events(raw) if e["type"].endswith(".delta")]
            assert deltas.count("response.reasoning_text.delta") == think, deltas
        said = "" if forced else last["content"][0]["text"]
        second = {"input": "and the fan", "previous_response_id": done["id"], "max_output_tokens": 4}
        status, raw = _post(srv.url + "/v1/responses", second, {"X-Sim-Request-Id": "second"})
        assert status == 200, raw[:300]
        assert srv.request_truth()["second"]["prompt_tokens"] == count_prompt_tokens(
            "\n".join(p for p in ["the clock", said, "and the fan"] if p))
    finally:
        srv.stop()


def test_a_responses_turns_function_call_and_its_output_in_its_input_are_prefilled():
    # An agent's next turn sends the call and the tool's result as input items: vLLM's
    # construct_chat_messages_with_tool_call makes a `function_call` an assistant message's tool_calls (its name and
    # arguments rendered) and a `function_call_output` a tool message (its `output`). Before: the simulator read
    # only an item's `content`, so both were prefilled as nothing (the proxy sizes them: its estimate above truth).
    from powerprof.sim.server import count_prompt_tokens

    srv = SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", decode_tok_s=400).start()
    try:
        items = [{"type": "function_call", "call_id": "c1", "name": "search", "arguments": '{"q": "the fan"}'},
                 {"type": "function_call_output", "call_id": "c1", "output": "the fan spins at the clock"}]
        status, raw = _post(srv.url + "/v1/responses", {"input": items, "max_output_tokens": 4},
                            {"X-Sim-Request-Id": "tools"})
        assert status == 200, raw[:300]
        assert srv.request_truth()["tools"]["prompt_tokens"] == count_prompt_tokens(
            "\n".join(["search" + '{"q": "the fan"}', "the fan spins at the clock"]))
    finally:
        srv.stop()


def test_the_responses_store_is_the_process_memory_and_can_be_off():
    # vLLM's store is in its process's memory: a restart empties it (before: the simulator's outlived restart()); and
    # off (VLLM_ENABLE_RESPONSES_API_STORE unset, vLLM's default) every previous_response_id is 404 (before: no way to
    # turn it off). This turn's instructions come first; the stored turn's own not at all (vLLM since #37727), or
    # after them with responses_carry_instructions (vLLM before it).
    from powerprof.sim.server import SimServer, count_prompt_tokens

    for store, carry in ((True, False), (True, True), (False, False)):
        srv = SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", responses_store=store,
                        responses_carry_instructions=carry).start()
        try:
            first = {"input": "the clock", "instructions": "be brief", "max_output_tokens": 4}
            status, raw = _post(srv.url + "/v1/responses", first)
            done = json.loads(raw)
            second = {"input": "and the fan", "instructions": "be kind", "previous_response_id": done["id"],
                      "max_output_tokens": 4}
            status, raw = _post(srv.url + "/v1/responses", second, {"X-Sim-Request-Id": f"second-{store}"})
            if not store:
                assert status == 404, raw[:300]
                continue
            assert status == 200, raw[:300]
            said = done["output"][0]["content"][0]["text"]
            assert srv.request_truth()[f"second-{store}"]["prompt_tokens"] == count_prompt_tokens(
                "\n".join(["be kind", *(["be brief"] if carry else []), "the clock", said, "and the fan"]))
            srv.restart(0.05).result(10)
            for _ in range(100):
                status, raw = _post(srv.url + "/v1/responses", second)
                if status != 503:
                    break
                time.sleep(0.05)
            assert status == 404, raw[:300]
        finally:
            srv.stop()


def test_a_completions_prompt_of_ids_text_and_objects_is_counted_as_the_flavours_server_counts_it():
    # llama-server's tokenize_input_prompts: an id (a float or bool converted) one token, a text its words with BOS
    # where a prompt opens with it, a prompt_string object its prompt, a batch each prompt; a negative id 400. vLLM
    # refuses a mix or an object (400). Before: " ".join(map(str, prompt)) for both, so {"prompt_string": T} was its
    # Python repr, a float id 3 tokens, a negative id 2, and vLLM ran what it refuses; the proxy's learned ratio
    # from such counts read a 401-token prompt as 6816.
    from powerprof.sim.server import count_prompt_tokens

    t = "the power of the clock and the fan"
    words = count_prompt_tokens(t) - 1
    shapes = {"object": ({"prompt_string": t}, 1 + words), "object mixed": ({"prompt_string": [5, 6, t]}, 2 + words),
              "objects": ([{"prompt_string": t}, {"prompt_string": t}], 2 + 2 * words),
              "float id": ([5, t, 2.5, True], 3 + words), "text first": ([t, 5], 1 + words + 1),
              "ids": ([5, 6, 7], 3), "batch": ([t, [5, 6, 7]], 1 + words + 3), "negative id": ([-5, 6, t], None),
              "media": ({"prompt_string": t, "multimodal_data": ["x"]}, None), "float alone": ([5, 2.5], None)}
    for flavour in ("llamacpp", "vllm"):
        with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=2000.0) as srv:
            for name, (prompt, want) in shapes.items():
                key = f"{flavour}-{name}"
                status, raw = _post(srv.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2},
                                    {"X-Sim-Request-Id": key})
                if flavour == "vllm":
                    if name in ("ids", "batch"):
                        continue  # vLLM takes ids, and a list of prompts (here run as one sequence)
                    assert status == 400, (name, raw[:200])
                elif want is None:
                    assert status == 400, (name, raw[:200])
                else:
                    assert status == 200, (name, raw[:200])
                    assert srv.request_truth()[key]["prompt_tokens"] == want, (name, srv.request_truth()[key])


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_a_prompt_of_token_ids_is_those_tokens_and_no_bos(flavour):
    # vLLM takes a list of ids as the prompt's tokens as they are (renderers/inputs/preprocess.py: prompt_to_seq, then
    # parse_dec_only_prompt's TokensPrompt(prompt_token_ids=prompt): no tokenizer, no BOS), SGLang likewise
    # (serving_completions.py: `input_ids`). Before: the simulator ran " ".join(ids) as text, its tokenizer adding a
    # BOS: usage said 101 for 100 ids, one above the proxy's count of the ids.
    ids = list(range(1000, 1100))
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=2000.0) as srv:
        for key, prompt in (("ids", ids), ("one id", [7])):
            status, raw = _post(srv.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2},
                                {"X-Sim-Request-Id": key})
            assert status == 200, raw[:300]
            assert json.loads(raw)["usage"]["prompt_tokens"] == len(prompt), raw[:300]
            assert srv.request_truth()[key]["prompt_tokens"] == len(prompt)
        # Two id prompts that differ are not one prompt to the prefix cache (their stand-in texts differ too).
        _post(srv.url + "/v1/completions", {"model": "m", "prompt": [9] * 100, "max_tokens": 2, "cache_prompt": True},
              {"X-Sim-Request-Id": "other"})
        assert srv.request_truth()["other"]["cached_tokens"] == 0


def test_sglang_refuses_a_completions_prompt_mixing_ids_and_text_as_its_request_validation_does():
    # SGLang's CompletionRequest.prompt is Union[List[int], List[List[int]], str, List[str]] (entrypoints/openai/
    # protocol.py): a list mixing text and ids, or an object, fits none, and its RequestValidationError handler answers
    # 400 (http_server.py, validation_exception_handler). Before: the simulator joined the items as text and ran it.
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", decode_tok_s=2000.0) as srv:
        for prompt in (["the power", 5], [5, "the power"], [[5, 6], "the power"], [[5, 6], 7], {"prompt_string": "x"}):
            status, raw = _post(srv.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
            assert status == 400, (prompt, raw[:300])
            assert json.loads(raw)["object"] == "error", raw[:300]
        for prompt in ("the power", [5, 6], ["the power", "the clock"], [[5, 6], [7]]):
            status, raw = _post(srv.url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
            assert status == 200, (prompt, raw[:300])
        assert not srv.truth_cancelled


def test_llamacpp_runs_an_empty_id_list_in_a_batch_as_an_empty_task_as_llama_server_does():
    # llama-server tokenizes each item of a list of prompts apart (tokenize_input_prompts): an empty id list is a task
    # of no tokens, ended at once with nothing generated (tokens_evaluated 0, stop_type "none", finish_reason "length"),
    # its final result first in a stream, the `data: null` then coming just before the first token (measured on the
    # bundled llama-server). Before: the simulator answered such a batch 400, where the real one answers 200.
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=2000.0, n_slots=2) as srv:
        for prompt, want in (([[], []], [0, 0]), ([[], [5, 6]], [0, 4]), ([[]], [0]), ([[], "the power"], [0, 4])):
            status, raw = _post(srv.url + "/completion", {"prompt": prompt, "n_predict": 4, "ignore_eos": True})
            assert status == 200, (prompt, raw[:300])
            answer = json.loads(raw)
            tasks = answer if isinstance(answer, list) else [answer]
            assert isinstance(answer, list) == (len(prompt) > 1), raw[:300]
            assert [t["tokens_predicted"] for t in sorted(tasks, key=lambda t: t["index"])] == want, raw[:600]
            empty = [t for t in tasks if t["index"] == 0][0]
            assert empty["tokens_evaluated"] == 0 and empty["stop_type"] == "none" and empty["content"] == "", empty
            status, raw = _post(srv.url + "/v1/completions", {"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            assert status == 200, (prompt, raw[:300])
            assert [c["finish_reason"] for c in json.loads(raw)["choices"]] == ["length"] * len(prompt), raw[:300]
        status, raw = _post(srv.url + "/completion", {"prompt": [[], [5, 6]], "n_predict": 4, "stream": True})
        assert status == 200, raw[:300]
        lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
        assert json.loads(lines[0])["index"] == 0 and json.loads(lines[0])["stop"] is True, lines[:3]
        assert lines[1] == b"null" and json.loads(lines[2])["index"] == 1, lines[:3]
        status, raw = _post(srv.url + "/completion", {"prompt": [[], []], "n_predict": 4, "stream": True})
        assert status == 200 and b"null" not in raw and len(_events(raw)) == 2, raw[:300]
        assert not srv.truth_cancelled


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_vllm_and_sglang_have_no_llamacpp_native_completion_route(flavour):
    # vLLM's api_server and SGLang's http_server route /v1/completions only: llama-server's /completion (and its
    # /completions alias) is FastAPI's 404 there. Before: both flavours ran it as llama.cpp does (200, its native answer),
    # so a client or test that used it passed against the simulator and failed against the real server.
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=2000.0) as srv:
        for path in ("/completion", "/completions"):
            status, raw = _post(srv.url + path, {"prompt": "the power", "n_predict": 2})
            assert (status, json.loads(raw)) == (404, {"detail": "Not Found"}), (path, raw[:300])
        status, raw = _post(srv.url + "/v1/completions", {"model": "m", "prompt": "the power", "max_tokens": 2})
        assert status == 200, raw[:300]
        assert not srv.truth_cancelled and len(srv.truth) == 1


def _send(url: str, method: str, data: bytes | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


LLAMA_404 = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


@pytest.mark.parametrize("flavour", ["llamacpp", "vllm", "sglang"])
def test_a_route_method_or_body_the_server_refuses_is_answered_in_its_servers_json(flavour):
    # llama-server (measured on the bundled build): a route it lacks, or a method its route lacks, is 404 with its JSON
    # error (`File Not Found`), a body that is not JSON or not an object a 400 invalid_request_error saying nlohmann's
    # error. vLLM and SGLang are FastAPI apps: {"detail": "Not Found"} (404), {"detail": "Method Not Allowed"} (405),
    # and a body their request model cannot read is a 400 in their validation error's shape. Before: aiohttp's plain
    # text "404: Not Found" / "405: Method Not Allowed", and {"error": {"message": "invalid JSON body"}} with no code
    # or type on every flavour.
    foreign = {"llamacpp": "/generate", "vllm": "/props", "sglang": "/version"}[flavour]
    with SimServer(SimNVML("seed-16g", state_path=None), flavour=flavour, decode_tok_s=2000.0) as srv:
        for method, path in (("POST", "/no/such/route"), ("GET", "/no/such/route"),
                             ("POST" if flavour == "llamacpp" else "GET", foreign)):
            status, ctype, raw = _send(srv.url + path, method, b"{}" if method == "POST" else None)
            want = LLAMA_404 if flavour == "llamacpp" else {"detail": "Not Found"}
            assert (status, json.loads(raw)) == (404, want), (method, path, raw[:200])
            assert ctype.startswith("application/json"), ctype
        status, ctype, raw = _send(srv.url + "/v1/completions", "GET")
        if flavour == "llamacpp":
            assert (status, json.loads(raw)) == (404, LLAMA_404), raw[:200]
        else:
            assert (status, json.loads(raw)) == (405, {"detail": "Method Not Allowed"}), raw[:200]
        for body in (b"not json", b"[1]"):
            status, ctype, raw = _send(srv.url + "/v1/completions", "POST", body)
            err = json.loads(raw)
            assert status == 400, raw[:200]
            if flavour == "llamacpp":
                assert err["error"]["code"] == 400 and err["error"]["type"] == "invalid_request_error", err
                assert err["error"]["message"].startswith("[json.exception."), err
            elif flavour == "vllm":
                assert err["error"]["code"] == 400 and err["error"]["type"] == "BadRequestError", err
            else:
                assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError", err
        assert not srv.truth


def test_vllm_refuses_a_body_not_sent_as_json_as_its_validate_json_request_does():
    # vLLM's routers (chat_completion, completion, responses, anthropic, pooling, tokenize) depend on
    # validate_json_request, which refuses any media type but application/json, none included, with a
    # RequestValidationError(errors=[text]); api_server's handler answers 400, nested under "error", its message
    # f"{str(exc)} {exc.errors()}" (a keyword-built error's str is empty). Before: the simulator read every body as
    # JSON whatever its type and ran it.
    import http.client
    import urllib.parse

    def send(path: str, body: bytes, ctype: str | None) -> tuple[int, dict]:
        u = urllib.parse.urlsplit(srv.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        try:
            conn.request("POST", path, body, {"Content-Type": ctype} if ctype else {})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    # The message's prefix is str(exc): empty (the leading space) where FastAPI's ValidationException has no __str__,
    # the errors rendered where it has one; its end, the error list, is the same in both.
    tail = '["Unsupported Media Type: Only \'application/json\' is allowed"]'
    cases = [("/v1/chat/completions", CHAT, None), ("/v1/chat/completions", CHAT, "text/plain"),
             ("/v1/completions", {"prompt": "the watt", "max_tokens": 2}, "application/x-www-form-urlencoded"),
             ("/v1/responses", {"input": "the watt", "max_output_tokens": 2}, "text/plain"),
             ("/v1/messages", dict(CHAT), "text/plain"), ("/tokenize", {"prompt": "the watt"}, None)]
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000.0) as srv:
        for path, body, ctype in cases:
            code, doc = send(path, json.dumps(body).encode(), ctype)
            err = doc["error"]
            assert code == 400 and err["message"].endswith(tail), (path, ctype, doc)
            assert (err["type"], err["param"], err["code"]) == ("Bad Request", None, 400), (path, ctype, doc)
        assert not srv.truth  # none ran
        for ctype in ("application/json", "Application/JSON; charset=utf-8"):
            code, doc = send("/v1/chat/completions", json.dumps(CHAT).encode(), ctype)
            assert code == 200 and doc["usage"]["completion_tokens"] == 6, (ctype, doc)


# What the bundled llama-server answers a request missing a field it requires, or giving it a shape it refuses (measured).
LLAMA_REFUSALS = [
    ("/completion", {"n_predict": 2}, 400, "[json.exception.out_of_range.403] key 'prompt' not found", "invalid_request_error"),
    ("/v1/completions", {"max_tokens": 2}, 400, "[json.exception.out_of_range.403] key 'prompt' not found",
     "invalid_request_error"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "'messages' is required", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": 5}, 400, "Expected 'messages' to be an array", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "All non-assistant messages must contain 'content'",
     "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, 400,
     "Assistant message must contain either 'content' or 'tool_calls'!", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 500,
     'Failed to parse messages: Missing \'role\' in message: {"content":"hi"}', "server_error"),
    ("/v1/messages", {"max_tokens": 2}, 500, "'messages' is required", "server_error"),
    ("/v1/responses", {"max_output_tokens": 2}, 400, "'input' is required", "invalid_request_error"),
    ("/v1/responses", {"input": 5}, 400, "'input' must be a string or array of objects", "invalid_request_error"),
    # A field of the wrong JSON type, or out of its range (before: the simulator's int() raised, aiohttp's 500 text; or
    # it ran the request).
    ("/completion", {"prompt": "a", "n_predict": "x"}, 400,
     "Field 'n_predict': [json.exception.type_error.302] type must be number, but is string", "invalid_request_error"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -5}, 400,
     "Field 'max_tokens': Value must be between -1 <= value <= 2147483647, but got -5", "invalid_request_error"),
    ("/v1/completions", {"prompt": "a", "n": "x"}, 400,
     "Field 'n': [json.exception.type_error.302] type must be number, but is string", "invalid_request_error"),
    ("/v1/completions", {"prompt": "a", "stream": 1}, 400,
     "Field 'stream': [json.exception.type_error.302] type must be boolean, but is number", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": "x"}, 400,
     "Field 'max_completion_tokens': [json.exception.type_error.302] type must be number, but is string",
     "invalid_request_error"),
    # Responses' max_output_tokens, read as chat's max_tokens after its conversion (before: aiohttp's 500 text).
    ("/v1/responses", {"input": "a", "max_output_tokens": "x"}, 400,
     "Field 'max_tokens': [json.exception.type_error.302] type must be number, but is string", "invalid_request_error"),
    # A chat message's content neither text nor a list (before: run as its Python text, 200 and a truth row).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}], "max_tokens": 2}, 400,
     "Expected 'content' to be a string or an array", "invalid_request_error"),
    # /tokenize's content neither text nor a list (before: its Python text tokenized, 200).
    ("/tokenize", {"content": 5}, 400, "[json.exception.type_error.302] type must be string, but is number",
     "invalid_request_error"),
    ("/tokenize", {"content": None}, 400, "[json.exception.type_error.302] type must be string, but is null",
     "invalid_request_error"),
    # n below 1: the range its slots allow (2 here and in test_real_llama_server's server; before: a message of the
    # simulator's own).
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "Field 'n': Value must be between 1 <= value <= 2, but got 0",
     "invalid_request_error"),
]


def test_llamacpp_refuses_a_request_missing_what_llama_server_requires_as_it_does():
    # Before: the simulator ran each of these (a prompt of "", a chat of no messages, 200) or answered 500 in aiohttp's
    # text (`messages` not a list), and refused an Anthropic request without max_tokens that llama-server runs.
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=2000.0, n_slots=2) as srv:
        for path, body, status, message, kind in LLAMA_REFUSALS:
            got_status, raw = _post(srv.url + path, body)
            assert (got_status, json.loads(raw)) == (status, {"error": {"code": status, "message": message,
                                                                        "type": kind}}), (path, body, raw[:300])
        assert not srv.truth
        status, raw = _post(srv.url + "/v1/messages", {"messages": [{"role": "user", "content": "the power"}]})
        assert status == 200, raw[:300]


def _batch_rows(srv, key: str) -> list[dict]:
    """A request's generated sequences in index order (not SGLang's prefills apart of its n > 1 prompts)."""
    return sorted((t for t in srv.truth if t["client_id"] == key and t["kind"] == "generation"), key=lambda t: t["choice"])


@pytest.mark.parametrize("batching", ["serial", "continuous"])
def test_a_llamacpp_batch_of_prompts_is_a_task_per_prompt_decoded_together_and_answered_as_llama_server_does(batching):
    # llama-server (tools/server/server-context.cpp, handle_completions_impl) makes a task per tokenized prompt, each
    # in a slot of its own (the slots decode together: 3 prompts of 300 tokens took 3.7 s where one took 2.3 s on
    # b11434 with -np 2 on one thread); native /completion answers the list of each task's final result, or streams
    # each task's events with its `index` after a `data: null`; /v1/completions merges the choices, its usage and
    # timings the first task's. Before: the simulator ran the prompts as one sequence of their tokens summed (one
    # prefill, one decode of max_tokens: half the tokens and none of the answer's shapes).
    prompts = ["the power", "watt clock and the energy and the power of the GPU"]
    with SimServer(SimNVML("h200-141g", state_path=None), decode_tok_s=200, batching=batching, n_slots=2) as srv:
        status, raw = _post(srv.url + "/completion", {"prompt": prompts, "n_predict": 30, "ignore_eos": True},
                            {"X-Sim-Request-Id": "native"})
        assert status == 200, raw[:300]
        doc = json.loads(raw)
        rows = _batch_rows(srv, "native")
        assert isinstance(doc, list) and [d["index"] for d in doc] == [0, 1], raw[:300]
        assert [d["tokens_evaluated"] for d in doc] == [t["prompt_tokens"] for t in rows] == [3, 12]
        assert [d["tokens_predicted"] for d in doc] == [t["generated"] for t in rows] == [30, 30]
        assert all(d["timings"]["predicted_n"] == 30 for d in doc)
        # Each prompt prefilled as its own sequence, and the two decoded in the same steps (their token times
        # interleave): the batch takes about one answer's time, not two.
        assert all(t["t_prefill_end_ns"] > t["t_prefill_start_ns"] for t in rows)
        a, b = ([e[0] for e in t["emissions"]] for t in rows)
        assert a[0] < b[-1] and b[0] < a[-1]

        status, raw = _post(srv.url + "/completion", {"prompt": prompts, "n_predict": 5, "stream": True},
                            {"X-Sim-Request-Id": "native-stream"})
        events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
        assert events[0] == "null" and b"[DONE]" not in raw, raw[:200]
        finals = [json.loads(e) for e in events[1:] if json.loads(e)["stop"]]
        assert sorted(f["index"] for f in finals) == [0, 1] and all("timings" in f for f in finals)
        assert len(_batch_rows(srv, "native-stream")) == 2

        status, raw = _post(srv.url + "/v1/completions", {"prompt": prompts, "max_tokens": 5, "ignore_eos": True},
                            {"X-Sim-Request-Id": "oai"})
        doc = json.loads(raw)
        rows = _batch_rows(srv, "oai")
        assert [c["index"] for c in doc["choices"]] == [0, 1]
        assert doc["usage"]["prompt_tokens"] == rows[0]["prompt_tokens"] and doc["usage"]["completion_tokens"] == 5
        # A single-prompt list is one task, answered as one object (b11434).
        status, raw = _post(srv.url + "/completion", {"prompt": ["the power"], "n_predict": 2})
        assert isinstance(json.loads(raw), dict)


def test_a_llamacpp_native_completion_runs_a_task_per_n_cmpl_choice_as_llama_server_does():
    # llama-server's /completion runs n_cmpl (else n) tasks per prompt (server-task.cpp params_from_json_cmpl,
    # handle_completions_impl), index prompt × n_cmpl + choice (captured on b11434). Before: the simulator ran one
    # task for n = 2, its truth one sequence, so the daemon's half count of a real server could not show here.
    with SimServer(SimNVML("h200-141g", state_path=None), decode_tok_s=400, n_slots=4) as srv:
        for key, body in (("n", {"prompt": "the power", "n_predict": 6, "n": 2, "ignore_eos": True}),
                          ("ncmpl", {"prompt": ["the power", "a b"], "n_predict": 6, "n_cmpl": 2, "ignore_eos": True})):
            status, raw = _post(srv.url + "/completion", body, {"X-Sim-Request-Id": key})
            doc = json.loads(raw)
            tasks = 2 if key == "n" else 4
            assert status == 200 and isinstance(doc, list) and [d["index"] for d in doc] == list(range(tasks)), raw[:300]
            assert sum(d["tokens_predicted"] for d in doc) == sum(t["generated"] for t in _batch_rows(srv, key)) == 6 * tasks
            status, raw = _post(srv.url + "/completion", dict(body, stream=True), {"X-Sim-Request-Id": key + "-s"})
            finals = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
            assert sorted(f["index"] for f in finals if f["stop"]) == list(range(tasks)), raw[:300]
            assert len(_batch_rows(srv, key + "-s")) == tasks


def test_a_llamacpp_empty_prompt_list_is_refused_as_llama_server_refuses_it():
    # b11434: `"prompt": []` is 400 '"prompt" must not be empty'. Before: 500 (an IndexError in _serve).
    with SimServer(SimNVML("h200-141g", state_path=None), decode_tok_s=400) as srv:
        status, raw = _post(srv.url + "/completion", {"prompt": [], "n_predict": 2})
        assert status == 400 and b'"prompt\\" must not be empty' in raw, (status, raw[:300])


def test_a_llamacpp_prompt_id_out_of_the_vocabulary_is_refused_as_llama_server_refuses_it():
    # b11434: an id past the model's vocabulary (999999, 10**12) is 400 "Prompt contains invalid tokens", on
    # /completion and /v1/completions alike. Before: the simulator ran it (200).
    from powerprof.sim.server import N_VOCAB

    with SimServer(SimNVML("h200-141g", state_path=None), decode_tok_s=400) as srv:
        for path in ("/completion", "/v1/completions"):
            for ids in ([1, 2, 999999], [1, 10**12], [[1], [N_VOCAB]]):
                status, raw = _post(srv.url + path, {"prompt": ids, "n_predict": 2, "max_tokens": 2})
                assert status == 400 and b"Prompt contains invalid tokens" in raw, (path, ids, status, raw[:300])
            status, raw = _post(srv.url + path, {"prompt": [1, N_VOCAB - 1], "n_predict": 2, "max_tokens": 2})
            assert status == 200, (path, raw[:300])


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_a_vllm_or_sglang_batch_of_prompts_is_an_engine_request_per_prompt_and_its_usage_sums_them(flavour):
    # vLLM (entrypoints/openai/completion/serving.py, _create_completion: a generator per engine input, choice index
    # output.index + prompt_idx * n; usage: each prompt's tokens once, the choices' tokens summed); SGLang's batch
    # likewise (one request per prompt, `index`, usage_processor: a prompt once per prompt). Before: one sequence of
    # the prompts joined as text, so usage said one prompt (one BOS) and one choice.
    temp = {"temperature": 1.0}
    with SimServer(SimNVML("h200-141g", state_path=None), flavour=flavour, decode_tok_s=400,
                   batching="continuous") as srv:
        for key, prompt, want in (("texts", ["the power", "watt clock and"], [3, 4]), ("ids", [[5, 6, 7], [8, 9]], [3, 2])):
            for stream in (False, True):
                cid = f"{key}-{stream}"
                body = dict(temp, prompt=prompt, max_tokens=4, n=2, ignore_eos=True, stream=stream,
                            stream_options={"include_usage": True})
                status, raw = _post(srv.url + "/v1/completions", body, {"X-Sim-Request-Id": cid})
                assert status == 200, raw[:300]
                rows = _batch_rows(srv, cid)
                assert [t["prompt_tokens"] for t in rows] == [want[0], want[0], want[1], want[1]]
                usage = (_events(raw)[-1] if stream else json.loads(raw))["usage"]
                assert usage["prompt_tokens"] == sum(want) and usage["completion_tokens"] == 16, usage
                idx = {c["index"] for ev in (_events(raw) if stream else [json.loads(raw)]) for c in ev["choices"]}
                assert idx == {0, 1, 2, 3}


def test_n_choices_are_sequences_decoded_together(server):
    key = f"together-{len(server.truth)}"
    # A prompt of several of vLLM's KV blocks (the cache holds whole ones: a shorter prompt is computed by each choice).
    body = dict(CHAT, messages=[{"role": "user", "content": "the power of the clock " * 20}], n=2, max_tokens=40,
                ignore_eos=True, stream=True)
    status, raw = _post(server.url + "/v1/chat/completions", body, {"X-Sim-Request-Id": key})
    assert status == 200
    rows = sorted((t for t in server.truth if t["client_id"] == key), key=lambda t: t["choice"])
    assert [t["generated"] for t in rows] == [40, 40]
    # Both decode in the same steps: their token times interleave, not one after the other.
    a, b = ([e[0] for e in t["emissions"]] for t in rows)
    assert a[0] < b[-1] and b[0] < a[-1]
    idx = [c["index"] for ev in _events(raw) for c in ev.get("choices", [])]
    assert set(idx) == {0, 1} and idx.index(1) < len(idx) - 1 - idx[::-1].index(0)
    # vLLM computes a shared prompt once: its other choices find its whole blocks cached.
    assert [t["cached_tokens"] > 0 for t in rows] == [False, server.flavour == "vllm"]


def test_an_embedding_is_a_prefill_of_its_input_and_no_decode(server):
    key = f"emb-{len(server.truth)}"
    texts = ["the power of the clock " * 20, "watt token"]
    status, raw = _post(server.url + "/v1/embeddings", {"input": texts, "model": "m"}, {"X-Sim-Request-Id": key})
    assert status == 200
    doc = json.loads(raw)
    rows = [t for t in server.truth if t["client_id"] == key]
    assert [t["kind"] for t in rows] == ["embeddings", "embeddings"] and all(t["generated"] == 0 for t in rows)
    assert doc["usage"]["prompt_tokens"] == sum(t["prompt_tokens"] for t in rows) == 101 + 3  # words and punctuation, plus a BOS each
    assert [d["index"] for d in doc["data"]] == [0, 1]
    assert all(t["energy_j"] > 0 and t["energy_j"] == pytest.approx(t["prefill_energy_j"]) for t in rows)
    assert rows[0]["energy_j"] > rows[1]["energy_j"]  # the longer input's forward pass cost more
    status, raw = _post(server.url + "/v1/embeddings", {"input": []})
    assert status == 400


@pytest.mark.parametrize("flavour,status", [("llamacpp", 501), ("vllm", 404)])
def test_embeddings_off_answer_as_the_real_servers_do(flavour, status):
    with SimServer(SimNVML("h200-141g", state_path=None), flavour=flavour) as srv:
        code, raw = _post(srv.url + "/v1/embeddings", {"input": "hi"})
        assert code == status
        assert b"--embeddings" in raw if flavour == "llamacpp" else raw == b'{"detail": "Not Found"}' 


def test_llamacpp_refuses_more_choices_than_slots():
    with SimServer(SimNVML("h200-141g", state_path=None), n_slots=2) as srv:
        code, raw = _post(srv.url + "/v1/chat/completions", dict(CHAT, n=3))
        assert code == 400 and b"Value must be between 1 <= value <= 2, but got 3" in raw
        assert not srv.truth


ECHO = {"prompt": "watt token speed", "max_tokens": 4, "echo": True, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("body", [ECHO, dict(ECHO, logprobs=1), dict(ECHO, n=2, logprobs=0), dict(ECHO, max_tokens=0)],
                         ids=["text", "logprobs", "n2-logprobs", "prompt-only"])
def test_vllm_echoes_the_prompt_in_each_choices_first_chunk_as_its_source_does(server, body):
    # vLLM's completion_stream_generator: each choice's first chunk is the prompt's text then its first token's
    # (the prompt alone for max_tokens 0, whose one generated token is not sent but counted), `logprobs` one entry
    # per token sent, the echoed prompt's included (its first logprob null); usage counts generated tokens only.
    # llama-server refuses echo ("Only no echo is supported").
    key = f"echo-{len(server.truth)}"
    status, raw = _post(server.url + "/v1/completions", body, {"X-Sim-Request-Id": key})
    if server.flavour == "llamacpp":
        assert status == 400 and b"Only no echo is supported" in raw
        return
    assert status == 200, raw[:300]
    chunks = [e for e in _events(raw) if e["choices"]]
    n = body.get("n", 1)
    firsts = {c["choices"][0]["index"]: c["choices"][0] for c in reversed(chunks)}
    assert sorted(firsts) == list(range(n))
    truth = server.request_truth()[key]
    usage = _events(raw)[-1]["usage"]
    assert usage["completion_tokens"] == truth["generated"] == n * max(body["max_tokens"], 1)
    for c in firsts.values():
        if body["max_tokens"] == 0:
            assert c["text"] == "watt token speed"
        else:
            assert c["text"].startswith("watt token speed ") and len(c["text"]) > len("watt token speed ")
        if "logprobs" in body:
            lp = c["logprobs"]
            assert lp["tokens"][:4] == ["<s>", "watt", "token", "speed"] and lp["token_logprobs"][0] is None
            assert len(lp["tokens"]) == 4 + 1  # the prompt's 4 (BOS included) and the first generated token
    later = [c["choices"][0] for c in chunks if c["choices"][0] not in firsts.values() and c["choices"][0]["text"]]
    assert all(not x["text"].startswith("watt token speed") for x in later)
    if "logprobs" in body:
        assert all(len(x["logprobs"]["tokens"]) >= 1 for x in later)
