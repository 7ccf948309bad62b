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
