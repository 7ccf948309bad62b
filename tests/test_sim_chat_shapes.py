"""Chat streams whose tokens are not all content, as vLLM and SGLang send them: a thinking model's reasoning deltas, a
forced tool call's argument deltas, vLLM's chat `echo` chunk. The simulator sends each (sim/chatshape.py, read from
both servers' serving_chat.py: docs/simulator.md), usage counting the reasoning and tool-call tokens and not the echo;
powerprof's parser and its measure path count them as the server does, against the simulator's truth, and flag
nothing falsely. The daemon's proxy: tests/test_daemon_chat_shapes.py."""

from __future__ import annotations

import json
import urllib.request

import pytest

from powerprof.daemon.proxy import chat_echo_chars
from powerprof.arrival import HeldCall
from powerprof.daemon.streams import summary_counts
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.stream import StreamParser

N_TOKENS = 24
THINK = 6  # the thinking's tokens, before the end-of-thinking token
TOOLS = [{"type": "function", "function": {"name": "get_power", "parameters": {"type": "object"}}}]
ECHOED = "Once upon a time"
SHAPES = {
    "reasoning": {},
    "tool_named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_power"}}},
    "tool_required": {"tools": TOOLS, "tool_choice": "required"},
    "echo": {"echo": True, "messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": ECHOED}]},
}


def _body(shape: str, opts: dict | None) -> dict:
    body = {"messages": [{"role": "user", "content": "how much power"}], "max_tokens": N_TOKENS, "ignore_eos": True,
            "stream": True, **SHAPES[shape]}
    if opts is not None:
        body["stream_options"] = opts
    return body


def _post(url: str, body: dict) -> bytes:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def _chunks(data: bytes) -> list[dict]:
    return [json.loads(x[6:]) for x in data.decode().splitlines() if x.startswith("data: {")]


def _deltas(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0].get("delta") or {} for c in chunks if c.get("choices")]


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def server(request):
    # The seed card decodes speculatively: a step's chunk carries up to 4 tokens, so thinking, its end and the
    # answer share chunks as they do on a real server behind a draft model.
    srv = SimServer(SimNVML("seed-16g", state_path=None), flavour=request.param, reasoning_tokens=THINK,
                    tool_call_parser=True).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("opts", [{"include_usage": True, "continuous_usage_stats": True}, {"include_usage": True}],
                         ids=["continuous", "final"])
def test_each_shape_as_the_server_sends_it_counted_as_the_server_counts_it(server, shape, opts):
    body = _body(shape, opts)
    before = len(server.truth)
    data = _post(server.url, body)
    truth = server.truth[before:]
    assert len(truth) == 1 and truth[0]["generated"] == N_TOKENS
    chunks = _chunks(data)
    deltas = _deltas(chunks)
    usage = chunks[-1]["usage"]
    # Reasoning and tool-call tokens are generated tokens; the echo is none.
    assert usage["completion_tokens"] == N_TOKENS, usage
    if shape == "reasoning":
        # SGLang's field, and the newest vLLM's (the simulated default; a test below holds vLLM's older name).
        field = "reasoning" if server.flavour == "vllm" else "reasoning_content"
        think = "".join(d.get(field) or "" for d in deltas)
        answer = "".join(d.get("content") or "" for d in deltas)
        # The answer: the rest but the end of thinking (and vLLM's last token, sent with empty text as vLLM does).
        shown = N_TOKENS - THINK - 1 - (server.flavour == "vllm")
        assert len(think.split()) == THINK and len(answer.split()) == shown, (think, answer)
        assert "</think>" not in think + answer  # neither server streams the end of thinking
    elif shape.startswith("tool"):
        calls = [tc for d in deltas for tc in (d.get("tool_calls") or [])]
        assert calls and calls[0]["function"]["name"] == "get_power" and calls[0]["id"]
        assert all(not c.get("id") and not c["function"].get("name") for c in calls[1:])
        assert not "".join(d.get("content") or "" for d in deltas)  # the answer is the call's arguments alone
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
        # vLLM says tool_calls once a call was streamed, whatever stopped it; SGLang only for a natural stop.
        assert finish == (["tool_calls"] if server.flavour == "vllm" else ["length"]), finish
    elif server.flavour == "vllm":
        # vLLM's echo: after the role chunk, the last message's content in a chunk of its own (continuous usage: 0).
        assert deltas[1] == {"content": ECHOED}, deltas[:3]
        if opts.get("continuous_usage_stats"):
            assert chunks[1]["usage"]["completion_tokens"] == 0
    else:
        assert ECHOED not in "".join(d.get("content") or "" for d in deltas)  # SGLang's chat has no echo
    # As the servers write it too (compact JSON: the proxy's byte path counts a plain chunk without parsing it).
    compact = b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)
    for count_only, data in ((False, data), (True, data), (True, compact + b"data: [DONE]\n\n")):
        p = StreamParser("openai-chat", count_only=count_only, echo_chars=chat_echo_chars(body))
        # Event by event, as the proxy reads a stream token by token.
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e]
        n = sum(p.count(e) for e in events) if count_only else sum(e.n_tokens for e in p.feed(data))
        s = p.finish()
        c = summary_counts(s)
        assert (s.generated_tokens, s.token_source, c.count_problem) == (N_TOKENS, "usage", None), (count_only, s, c)
        if opts.get("continuous_usage_stats"):
            assert n == N_TOKENS, (count_only, n)  # every token placed on the chunk that carried it
        else:
            assert n <= N_TOKENS, (count_only, n)  # one a chunk: never more than the server's count


def test_thinking_turned_off_by_the_request_and_the_older_vllm_field():
    # Qwen3's template closes the thinking in the prompt when a request says enable_thinking false: all content.
    # vLLM before November 2025 named the delta `reasoning_content` (since: `reasoning`); powerprof reads both.
    with SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", reasoning_tokens=THINK,
                   reasoning_field="reasoning_content") as srv:
        opts = {"include_usage": True}
        off = _deltas(_chunks(_post(srv.url, dict(_body("reasoning", opts), chat_template_kwargs={"enable_thinking": False}))))
        data = _post(srv.url, _body("reasoning", opts))
    # All content (but vLLM's last token, sent with empty text).
    assert not any("reasoning_content" in d for d in off) and len("".join(d.get("content") or "" for d in off).split()) == N_TOKENS - 1
    on = _deltas(_chunks(data))
    assert len("".join(d.get("reasoning_content") or "" for d in on).split()) == THINK
    p = StreamParser("openai-chat")
    n = sum(e.n_tokens for e in p.feed(data))
    s = p.finish()
    # One token a chunk until the usage: the end of thinking had no chunk, nor (shown) vLLM's empty closing token.
    assert (n, s.generated_tokens, summary_counts(s).count_problem) == (N_TOKENS - 2, N_TOKENS, None)


def test_the_plain_servers_send_no_shape_unasked():
    # No reasoning parser: no thinking. Tools on SGLang without a tool-call parser, or on llama.cpp (whose tool-call,
    # thinking and chat-echo streams are not simulated): content alone, as before. (vLLM streams a required or named
    # call as it is: structured output needs no flag.)
    for flavour, shapes in (("vllm", ["reasoning"]), ("sglang", ["reasoning", "tool_required"]),
                            ("llamacpp", ["reasoning", "tool_required", "echo"])):
        with SimServer(SimNVML("h200-141g", state_path=None), flavour=flavour) as srv:
            for shape in shapes:
                deltas = _deltas(_chunks(_post(srv.url, _body(shape, {"include_usage": True}))))
                assert not any(d.get("tool_calls") or d.get("reasoning_content") or d.get("reasoning") for d in deltas), (
                    flavour, shape)
                shown = N_TOKENS - (flavour == "vllm")  # vLLM's last token has empty text
                assert len("".join(d.get("content") or "" for d in deltas).split()) == shown, (flavour, shape)


@pytest.mark.slow
@pytest.mark.parametrize("flavour,field", [("vllm", "reasoning_content"), ("vllm", "reasoning"),
                                           ("sglang", "reasoning_content")])
def test_measure_on_a_thinking_model_counts_its_thinking_and_its_j_per_token_is_the_gpus(tmp_path, flavour, field):
    # `powerprof measure` on chat against a server with a reasoning parser: every answer thinks first (its chunks
    # reasoning deltas, the end of thinking in none), then answers. Its tokens are the server's count (thinking
    # included), nothing is flagged, and its J/token is the simulated GPU's true energy over its windows per token.
    from powerprof.rig import Rig
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import Prompt
    from powerprof.workload.measure import run_measure

    from support import true_window_energy_j

    # The A100's counter refreshes every 20 ms and a 128-token answer decodes for ~1.3 s: windows long enough for measure
    # to vouch for (on the H200's 100 ms counter, 0.6 s windows read up to -7%, with or without thinking, flagged so).
    max_tokens = 128
    sim = SimNVML("a100-40g", state_path=None, record_history=True)
    with Rig("a100-40g", nvml=sim) as rig:
        plain = rig.sim_server
        rig.sim_server = lambda **kw: plain(**kw, flavour=flavour, reasoning_tokens=32, reasoning_field=field)
        res = run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=[Prompt("p0", "hello there"),
                          Prompt("p1", "tell me more")], n_requests=4, concurrencies=[1, 2],
                          params=RequestParams(max_tokens=max_tokens), warmup=1, api="openai-chat", interval_s=0.2)
    assert res.server.api == "openai-chat" and res.server.kind == flavour, res.server
    measured = [r for r in res.records if not r.warmup]
    assert len(measured) == 8 and all(r.ok for r in measured), [r.error for r in measured]
    for r in measured:
        assert (r.generated_tokens, r.token_source, r.count_problem) == (max_tokens, "usage", None), r
    assert not any("contradict" in n or "estimate" in n for n in res.notes), res.notes
    recs = {r.request_id: r for r in res.records}
    used = [w for w in res.rows if w["window_kind"] == "request" and w["concurrency"] == 1 and not w["warmup"]
            and w["status"] == "ok"]
    assert len(used) == 4 and all(w["timing"] != "untrusted" for w in used), [w["timing_reason"] for w in used]
    (x,) = [s for s in res.summaries if s.concurrency == 1]
    tokens = sum(w["decode_tokens"] for w in used)
    truth = sum(true_window_energy_j(sim.gpus[0], recs[w["request_id"]]) for w in used) / tokens
    # 3%: edge reads on a loaded 2-core host (measured within 1%).
    assert x.gpu_j_per_token == pytest.approx(truth, rel=0.03), (x.gpu_j_per_token, truth)


def test_the_server_process_takes_the_thinking_and_tool_parser_knobs():
    # `python -m powerprof.sim.serve` (what `sweep --launch` starts on the simulated rig) as a thinking SGLang server
    # with a tool-call parser: a launch template reaches these streams too.
    import os
    import subprocess
    import sys
    import time

    from support import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-m", "powerprof.sim.serve", "--profile", "h200-141g", "--port", str(port),
                          "--flavour", "sglang", "--reasoning-tokens", str(THINK), "--tool-call-parser"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "sim.serve did not come up"
                time.sleep(0.1)
        deltas = _deltas(_chunks(_post(url, _body("tool_named", {"include_usage": True}))))
    finally:
        p.terminate()
        p.wait(30)
    assert len("".join(d.get("reasoning_content") or "" for d in deltas).split()) == THINK
    assert any(d.get("tool_calls") for d in deltas)


def test_the_server_process_takes_the_tool_call_parser_by_name():
    # SGLang's --tool-call-parser takes a parser's name, and the simulator streams deepseekv3's and qwen3_coder's calls
    # otherwise than a JSON detector's (tool_call_parser). Before, sim.serve's flag was an on/off switch: a launch
    # template naming the parser (`--tool-call-parser deepseekv3`) was refused, so a sweep could not reach those shapes.
    from powerprof.sim.serve import TOOL_CALL_PARSERS, parse_args

    def knob(*argv):
        return TOOL_CALL_PARSERS.get(parse_args(list(argv)).tool_call_parser, False)

    assert knob("--tool-call-parser", "deepseekv3") == "deepseekv3"
    assert knob("--tool-call-parser", "qwen3_coder") == "qwen3_coder"
    assert knob("--tool-call-parser", "qwen25") is True and knob("--tool-call-parser") is True  # a bare flag as before
    assert knob() is False
    with pytest.raises(SystemExit):  # a name it does not simulate: refused, not streamed as another's
        parse_args(["--tool-call-parser", "no_such_parser"])


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_a_tool_call_that_ends_itself_finishes_tool_calls_and_counts_true(flavour):
    # Without ignore_eos the simulated model stops on its own (16-63 tokens): a real tool call ends so, and both servers
    # then finish "tool_calls" (SGLang only then). Counted as the server counts, to the truth's token.
    with SimServer(SimNVML("h200-141g", state_path=None), flavour=flavour, tool_call_parser=True) as srv:
        body = dict(_body("tool_required", {"include_usage": True, "continuous_usage_stats": True}), max_tokens=200)
        del body["ignore_eos"]
        data = _post(srv.url, body)
        (truth,) = srv.truth
    assert truth["generated"] < 200
    chunks = _chunks(data)
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    assert finish == ["tool_calls"] and chunks[-1]["usage"]["completion_tokens"] == truth["generated"]
    p = StreamParser("openai-chat", count_only=True)
    n = sum(p.count(e + b"\n\n") for e in data.split(b"\n\n") if e)
    s = p.finish()
    # SGLang's end-of-text token adds no text, so no chunk carries it (nor a running count): the events hold one
    # token fewer, the final usage the whole count (tests/test_sim_continuous_usage.py: without it, count-open).
    eot_unsent = 1 if flavour == "sglang" else 0
    assert (n, s.generated_tokens, summary_counts(s).count_problem) == (truth["generated"] - eot_unsent,
                                                                         truth["generated"], None)


@pytest.mark.parametrize("flavour", ["vllm", "sglang"])
def test_a_requests_tools_are_in_its_prompt_as_the_template_renders_them(flavour):
    # Both servers' chat templates render the tools' schemas into the prompt, so its usage says them (the daemon's
    # prompt estimate counts them too: daemon/promptlen.py); SGLang leaves them out when tool_choice is "none".
    from powerprof.sim.server import count_prompt_tokens

    def prompt_tokens(srv, extra):
        body = dict(_body("reasoning", {"include_usage": True}), max_tokens=2, **extra)
        return _chunks(_post(srv.url, body))[-1]["usage"]["prompt_tokens"]

    schema = json.dumps(TOOLS, separators=(",", ":"))
    with SimServer(SimNVML("h200-141g", state_path=None), flavour=flavour) as srv:
        plain = prompt_tokens(srv, {})
        assert prompt_tokens(srv, {"tools": TOOLS}) == plain + count_prompt_tokens(schema) - 1  # (one BOS)
        none = prompt_tokens(srv, {"tools": TOOLS, "tool_choice": "none"})
    assert none == (plain if flavour == "sglang" else plain + count_prompt_tokens(schema) - 1)


def test_vllm_in_its_deprecation_window_says_the_thinking_under_both_names_and_it_is_kept_once():
    # vLLM from #27752 (Nov 2025) to #33402 (Jan 2026): DeltaMessage's validator copied `reasoning` into the deprecated
    # `reasoning_content` and serving_chat dumps with exclude_unset, so a thinking delta carries the text under both
    # keys and every other delta `"reasoning_content": null`. The answer kept (--keep-text) has the thinking once, as
    # under either name alone, and the count is the server's.
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import Prompt, run_load

    texts = {}
    for field in ("both", "reasoning"):
        with SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", reasoning_tokens=THINK,
                       reasoning_field=field) as srv:
            deltas = _deltas(_chunks(_post(srv.url, _body("reasoning", {"include_usage": True}))))
            (r,) = run_load(srv.url, [Prompt("p", "how much power")], 1, 1,
                            RequestParams(max_tokens=N_TOKENS, ignore_eos=True, keep_text=True), warmup=0,
                            api="openai-chat")
        if field == "both":
            thinking = [d for d in deltas if d.get("reasoning") is not None]
            assert thinking and all(d["reasoning_content"] == d["reasoning"] for d in thinking), thinking
            assert all("reasoning_content" in d for d in deltas), deltas  # null where no thinking
        assert (r.ok, r.generated_tokens, r.token_source, r.count_problem) == (True, N_TOKENS, "usage", None), r
        texts[field] = r.completion_text
    # The thinking's words once (vLLM sends the last token with empty text, the end of thinking with none).
    assert texts["both"] == texts["reasoning"] and len(texts["both"].split()) == N_TOKENS - 2, texts


def test_the_simulator_refuses_a_reasoning_field_no_server_sends():
    with pytest.raises(ValueError, match="reasoning_field"):
        SimServer(SimNVML("h200-141g", state_path=None), flavour="vllm", reasoning_field="thinking")


def _held_call(srv, body: dict):
    before = len(srv.truth)
    data = _post(srv.url, body)
    (truth,) = srv.truth[before:]
    chunks = _chunks(data)
    p = StreamParser("openai-chat", count_only=True)
    n = sum(p.count(e + b"\n\n") for e in data.split(b"\n\n") if e)
    return truth, chunks, n, p.finish()


def test_sglang_tool_call_cut_by_max_tokens_before_its_parser_sent_it_is_counted_whole():
    # SGLang's deepseekv3 detector matches a call only once its closing fence is written: a call cut by max_tokens is
    # never sent, and its tokens (here 17, after 6 of thinking, each in a chunk with its running count) are in no
    # running count, only in the final usage. That count is the limit the request set, not a contradiction: before,
    # the running count short by more than 3 (COUNT_SLACK_TOKENS) disbelieved it (running_count_short: no
    # generated_tokens, no J/token). A call that closes goes out whole then, and finishes tool_calls.
    with SimServer(SimNVML("h200-141g", state_path=None), flavour="sglang", reasoning_tokens=THINK,
                   tool_call_parser="deepseekv3") as srv:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        truth, chunks, n, s = _held_call(srv, _body("tool_named", opts))
        assert truth["generated"] == N_TOKENS and chunks[-1]["usage"]["completion_tokens"] == N_TOKENS
        deltas = _deltas(chunks)
        assert not any(d.get("tool_calls") for d in deltas), deltas  # the call never went out
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
        assert finish == ["length"] and n == THINK and s.running_counts, (finish, n, s)
        # The request carried tools; its 17 held tokens had 10 steps' time after its last chunk (the pace: 1 a step).
        held = HeldCall(N_TOKENS, 1, 1.0, 10)
        c = summary_counts(s, held=held)
        assert (c.generated_tokens, c.token_source, c.count_problem, c.held_tail) == (N_TOKENS, "usage", None, True), c
        # Without tools the rule stands: more than 3 tokens past the last running count contradict.
        assert summary_counts(s).count_problem_kind == "running_count_short"
        # Asked for more than it generated (a stop at the limit of another, or none), the short count stays said.
        assert summary_counts(s, held=held._replace(max_tokens=N_TOKENS + 1)).count_problem_kind == "running_count_short"

        body = dict(_body("tool_named", opts), max_tokens=200)
        del body["ignore_eos"]
        truth, chunks, n, s = _held_call(srv, body)
    assert truth["generated"] < 200
    calls = [tc for d in _deltas(chunks) for tc in (d.get("tool_calls") or [])]
    assert calls and calls[0]["function"]["name"] == "get_power", calls
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    c = summary_counts(s, held=HeldCall(200, 1, 1.0, 10))
    assert finish == ["tool_calls"] and (c.generated_tokens, c.count_problem) == (truth["generated"], None), (finish, c)


@pytest.mark.parametrize("trailing", [3, 4])
def test_a_self_closing_held_call_is_believed_at_exactly_the_trailing_allowance_and_flagged_past_it(trailing):
    # Real SGLang's deepseekv3 detector sends a call at the step that writes its closing fence, then the model writes
    # `<｜tool▁call▁end｜>`, `<｜tool▁calls▁end｜>` and its end of sentence: 3 counted tokens in no chunk, no running
    # count, only in the final usage (docs/daemon.md: the most any SGLang parser leaves). The running-count rule allows
    # exactly 3 (COUNT_SLACK_TOKENS), no margin: a natural stop (not held_call_at_limit's case) 3 past its last running
    # count is believed, 4 past it contradicts the server's own running counts. Before, the simulator sent the call at
    # the finish, 1 token short (its end of sentence alone), so the allowance's edge was never met.
    from powerprof.arrival import COUNT_SLACK_TOKENS

    with SimServer(SimNVML("h200-141g", state_path=None), flavour="sglang", reasoning_tokens=THINK,
                   tool_call_parser="deepseekv3", tool_call_trailing_tokens=trailing) as srv:
        body = dict(_body("tool_named", {"include_usage": True, "continuous_usage_stats": True}), max_tokens=200)
        del body["ignore_eos"]
        truth, chunks, n, s = _held_call(srv, body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices") and c.get("usage")]
    calls = [c for c in chunks if c.get("choices") and (c["choices"][0].get("delta") or {}).get("tool_calls")]
    assert truth["generated"] < 200 and chunks[-1]["usage"]["completion_tokens"] == truth["generated"]
    # The call went out, name and arguments, with the running count of the step that closed it, `trailing` before the end.
    assert calls and calls[0]["usage"]["completion_tokens"] == counts[-1] == truth["generated"] - trailing, counts
    c = summary_counts(s, held=HeldCall(200, 1, 1.0, 10))
    if trailing <= COUNT_SLACK_TOKENS:
        assert (c.generated_tokens, c.count_problem, c.held_tail) == (truth["generated"], None, False), c
    else:
        assert c.count_problem_kind == "running_count_short" and not c.held_tail, c


def test_sglang_qwen3_coder_sends_each_parameter_once_closed_and_a_cut_one_never():
    # SGLang's qwen3_coder detector: the name once `<function=name>` is parsed, each parameter's value only once its
    # `</parameter>` is written (QWEN3_CODER_PARAM_TOKENS), nothing more of a parameter max_tokens cut: 50 tokens (6 of
    # thinking, its end, 4 of head, 2 parameters closed, 7 of the third) leave 7 past the last running count, more than
    # the 3 the running-count rule allows; believed as a held call (tools, at the limit, time enough), flagged without.
    from powerprof.sim.chatshape import QWEN3_CODER_PARAM_TOKENS, TOOL_HEAD_TOKENS

    with SimServer(SimNVML("h200-141g", state_path=None), flavour="sglang", reasoning_tokens=THINK,
                   tool_call_parser="qwen3_coder") as srv:
        opts = {"include_usage": True, "continuous_usage_stats": True}
        truth, chunks, n, s = _held_call(srv, dict(_body("tool_named", opts), max_tokens=50))
        calls = [(c["usage"]["completion_tokens"], c["choices"][0]["delta"]["tool_calls"][0]["function"]) for c in chunks
                 if c.get("choices") and (c["choices"][0].get("delta") or {}).get("tool_calls")]
        head = THINK + 1 + TOOL_HEAD_TOKENS
        assert calls[0][1]["name"] == "get_power" and [u for u, _ in calls[1:]] == [
            head + QWEN3_CODER_PARAM_TOKENS, head + 2 * QWEN3_CODER_PARAM_TOKENS], calls
        assert truth["generated"] == 50 and chunks[-1]["usage"]["completion_tokens"] == 50
        c = summary_counts(s, held=HeldCall(50, 1, 1.0, 10))
        assert (c.generated_tokens, c.count_problem, c.held_tail) == (50, None, True), c
        assert summary_counts(s).count_problem_kind == "running_count_short"
        # A call that closes: its last parameter and the call's end at its closing step, 3 tokens before the end.
        body = dict(_body("tool_named", opts), max_tokens=200)
        del body["ignore_eos"]
        truth, chunks, n, s = _held_call(srv, body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices") and c.get("usage")]
    assert counts[-1] == truth["generated"] - 3 and chunks[-1]["usage"]["completion_tokens"] == truth["generated"]
    c = summary_counts(s, held=HeldCall(200, 1, 1.0, 10))
    assert (c.generated_tokens, c.count_problem) == (truth["generated"], None), c


def test_the_simulator_refuses_a_tool_call_parser_it_does_not_model():
    with pytest.raises(ValueError, match="tool_call_parser"):
        SimServer(SimNVML("h200-141g", state_path=None), flavour="sglang", tool_call_parser="qwen25")
    with pytest.raises(ValueError, match="tool_call_trailing_tokens"):  # its end of sentence is always one
        SimServer(SimNVML("h200-141g", state_path=None), flavour="sglang", tool_call_trailing_tokens=0)
