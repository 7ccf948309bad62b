"""SGLang's native /generate through the proxy: counted as its streams and bodies say (meta_info's running
completion_tokens, prompt_tokens, a batch's `index`), against the simulator's truth; bytes unchanged; a lying count,
an in-band error and a batch handled as the other APIs' are."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from powerprof.daemon import streams
from proxy_helpers import serve_here
from powerprof.daemon.proxy import Proxy, inspect_request_body
from powerprof.sim.server import SimServer
from powerprof.workload.stream import StreamParser, parse_response


class Rec:
    def __init__(self):
        self.ended = []
        self.tokens = {}

    def on_start(self, trace):
        pass

    def on_tokens(self, trace, t, n):
        self.tokens[trace.request_id] = self.tokens.get(trace.request_id, 0) + n

    def on_end(self, trace):
        self.ended.append(trace)


def _through_proxy(upstream: str, bodies: list[dict], direct: bool = True, method: str = "POST"):
    """Each body sent (POST, or `method`) to /generate through a proxy in front of `upstream` (and, `direct`, straight
    to it too): (recorder, [(proxied bytes, direct bytes)]); a connection the server closed mid-answer, (status, None)."""
    async def main():
        rec = Rec()
        runner, px = await serve_here(Proxy(upstream, recorder=rec).app())
        got = []
        async with aiohttp.ClientSession() as s:
            for i, body in enumerate(bodies):
                pair = []
                for base in ((px, upstream) if direct else (px,)):
                    async with s.request(method, base + "/generate", json=body,
                                         headers={"X-Sim-Request-Id": f"{i}"}) as r:
                        try:
                            pair.append((r.status, await r.read()))
                        except aiohttp.ClientPayloadError:
                            pair.append((r.status, None))
                got.append(pair)
        await runner.cleanup()
        return rec, got

    return asyncio.run(asyncio.wait_for(main(), 120))


def _strip_volatile(body: bytes) -> bytes:
    """The simulator's answers differ between two runs only in their ids and latencies."""
    out = []
    for line in body.split(b"\n"):
        if line.startswith(b"data: {") or line.startswith(b"{"):
            doc = json.loads(line[6:] if line.startswith(b"data: ") else line)
            for d in doc if isinstance(doc, list) else [doc]:
                d.get("meta_info", {}).pop("id", None)
                d.get("meta_info", {}).pop("e2e_latency", None)
            line = json.dumps(doc).encode()
        out.append(line)
    return b"\n".join(out)


def test_generate_streamed_and_whole_is_counted_as_the_server_generated_it():
    # Before: /generate was uncounted work (api None, no tokens, its energy on the requests beside it).
    body = {"text": "tell me about power limits", "sampling_params": {"max_new_tokens": 37, "ignore_eos": True}}
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=400.0, tokens_per_event=3, draft_n_max=0) as srv:
        rec, got = _through_proxy(srv.url, [dict(body, stream=True), body])
        truth = [t for t in srv.truth if t.get("client_id") is not None]
    proxied = [t for t in rec.ended]
    assert len(proxied) == 2
    for (px, direct) in got:  # byte for byte what the server sent (but for its ids and latencies: two runs)
        assert px[0] == direct[0] == 200
        assert _strip_volatile(px[1]) == _strip_volatile(direct[1])
    s, w = proxied
    assert got[0][0][1].endswith(b"data: [DONE]\n\n")
    # The proxied requests' truth: the first of each pair of runs (ids 0 and 1, each sent twice).
    t_s = next(t for t in truth if t["client_id"] == "0")
    t_w = next(t for t in truth if t["client_id"] == "1")
    assert (s.api, s.stream, s.outcome) == ("sglang-generate", True, "ok")
    assert s.tokens_seen == rec.tokens[s.request_id] == t_s["generated"] == 37
    assert s.counts.generated_tokens == 37 and s.counts.prompt_tokens == t_s["prompt_tokens"]
    assert s.counts.count_problem is None and not s.counts.tokens_estimated and s.counts.stop_reason == "length"
    # Several tokens an event (3): counted from meta_info's running count, not one an event.
    assert s.counts.complete
    assert (w.api, w.stream, w.outcome) == ("sglang-generate", False, "ok")
    assert w.tokens_seen == t_w["generated"] == 37 and w.extra.get("spread")
    assert w.counts.generated_tokens == 37 and w.counts.prompt_tokens == t_w["prompt_tokens"]


def test_a_put_is_counted_as_a_post_and_a_refused_length_is_no_token():
    # SGLang routes /generate for PUT too (the simulator before answered 405): counted as a POST is. Its refusals of a
    # length (docs/simulator.md): -1 a 400 whole, an error event in a 200 stream; a text a 500 whole, and a stream's 200
    # head then its connection closed. None ran: each is read with no token, an error where the answer says one.
    body = {"text": "tell me about power limits", "sampling_params": {"max_new_tokens": 9, "ignore_eos": True}}
    bad = [{"text": "x", "sampling_params": {"max_new_tokens": v}, "stream": st} for v in (-1, "5") for st in (False, True)]
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=400.0, draft_n_max=0) as srv:
        put, got = _through_proxy(srv.url, [dict(body, stream=True), body], direct=False, method="PUT")
        refused, answers = _through_proxy(srv.url, bad, direct=False)
        truth = [t for t in srv.truth if t.get("client_id") is not None]
    assert [g[0][0] for g in got] == [200, 200]
    assert [(t.method, t.api, t.outcome, t.tokens_seen, t.counts.generated_tokens) for t in put.ended] == \
        [("PUT", "sglang-generate", "ok", 9, 9)] * 2
    assert [t["generated"] for t in truth] == [9, 9]  # the refused ran nothing
    assert [a[0][0] for a in answers] == [400, 200, 500, 200] and answers[3][0][1] is None
    assert [t.status for t in refused.ended] == [400, 200, 500, 200]
    assert all(t.tokens_seen == 0 for t in refused.ended)
    assert [t.outcome for t in refused.ended[1:]] == ["upstream_error"] * 3
    assert "max_new_tokens must be at least 0, got -1." in refused.ended[1].error


@pytest.mark.parametrize("factor,kind", [(0.8, "stream_above_count"), (1.25, "running_count_short")])
@pytest.mark.parametrize("stream", [True, False])
def test_a_server_whose_final_count_contradicts_its_tokens_is_flagged(factor, kind, stream):
    # The simulator's lie is in its final count (meta_info.completion_tokens of the last event, or of a whole answer);
    # the tokens it listed (output_ids) and its running counts stay true.
    body = {"text": "x", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}, "stream": stream}
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=400.0, draft_n_max=0,
                   count_factor=factor) as srv:
        rec, _ = _through_proxy(srv.url, [body], direct=False)
    t = rec.ended[0]
    assert t.counts.count_problem_kind == kind, (t.counts, t.error)
    assert f"the server counted {round(40 * factor)} generated tokens" in t.counts.count_problem
    assert t.tokens_seen == 40  # what it listed: never the contradicted count


def test_an_error_inside_a_200_stream_is_an_upstream_error():
    # SGLang's /generate, a ValueError mid-stream: `data: {"error": {"message": ...}}` then `data: [DONE]`.
    async def gen(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ev = {"text": "a b", "output_ids": [5, 6], "meta_info": {"prompt_tokens": 4, "completion_tokens": 2,
                                                                 "finish_reason": None}}
        await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b'data: {"error":{"message":"the batch was aborted"}}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/generate", gen)
        r1, up = await serve_here(app)
        try:
            return await asyncio.to_thread(_through_proxy, up, [{"text": "x", "stream": True}], False)
        finally:
            await r1.cleanup()

    rec, _ = asyncio.run(main())
    t = rec.ended[0]
    assert t.outcome == "upstream_error" and "the batch was aborted" in t.error
    assert t.tokens_seen == 2 and t.counts.prompt_tokens == 4


def _events(*evs) -> bytes:
    return b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in evs) + b"data: [DONE]\n\n"


def _ev(idx, ids, prompt, finish=None, incremental_from=None):
    out = ids if incremental_from is None else ids[incremental_from:]
    return {"text": "w" * len(ids), "output_ids": out, "index": idx,
            "meta_info": {"id": f"r{idx}", "prompt_tokens": prompt, "completion_tokens": len(ids),
                          "cached_tokens": 0, "finish_reason": finish}}


def test_a_batch_stream_counts_every_sequence_and_each_prompt_once():
    # text: [a, b] with n = 2: sequences 0,1 of prompt a (10 tokens), 2,3 of prompt b (7 tokens), interleaved as
    # SGLang's _handle_batch_request yields them (each its own `index`), several tokens an event.
    L = {"type": "length", "length": 4}
    body = _events(_ev(0, [1, 2], 10), _ev(2, [1], 7), _ev(1, [1, 2, 3], 10), _ev(3, [1, 2], 7),
                   _ev(0, [1, 2, 3, 4], 10, L), _ev(2, [1, 2, 3, 4], 7, L), _ev(1, [1, 2, 3, 4], 10, L),
                   _ev(3, [1, 2, 3, 4], 7, L))
    for piece in (len(body), 7):  # whole, and cut into small pieces
        p = streams.new_parser("sglang-generate", choices=2, sequences=4)
        n = sum(p.count(body[i:i + piece]) for i in range(0, len(body), piece))
        c = streams.summary_counts(p.finish())
        assert n == 16 and c.generated_tokens == 16 and c.prompt_tokens == 17 and c.complete, c
        assert c.count_problem is None and not c.prompt_each_task
    # The same batch with SGLang's incremental_streaming_output: output_ids only the new ones.
    inc = _events(_ev(0, [1, 2], 10), _ev(0, [1, 2, 3, 4], 10, L, incremental_from=2))
    p = streams.new_parser("sglang-generate")
    assert p.count(inc) == 4 and streams.summary_counts(p.finish()).count_problem is None


def test_a_cut_batch_stream_whose_prompts_have_not_all_spoken_says_no_prompt_length():
    # 4 prompts of 510 tokens each, the client gone after prompts 0 and 1 sent events: their 1020 is not the batch's
    # prompt. Before, the summary said 1020 (truth 2040) as the whole, no problem flagged, and the ledger learned 255
    # tokens a prompt (truth 510). Now no prompt length: the ledger estimates the batch's from its body, learns nothing.
    p = streams.new_parser("sglang-generate", choices=1, sequences=4)
    for step in range(1, 4):
        for idx in (0, 1):
            p.count(_events(_ev(idx, [1] * step, 510))[:-len(b"data: [DONE]\n\n")])
    assert p.prompt_tokens is None
    c = streams.summary_counts(p.finish())
    assert c.prompt_tokens is None and c.cached_tokens is None, c
    # Every prompt said: their sum.
    p = streams.new_parser("sglang-generate", choices=1, sequences=2)
    p.count(_events(_ev(0, [1], 510), _ev(1, [1], 400))[:-len(b"data: [DONE]\n\n")])
    assert streams.summary_counts(p.finish()).prompt_tokens == 910


def test_a_whole_batch_answer_is_a_list_in_the_sequences_order():
    L = {"type": "length", "length": 5}
    doc = [_ev(0, [1] * 5, 9, L), _ev(1, [2] * 3, 9, {"type": "stop", "matched": 2}), _ev(2, [3] * 5, 4, L)]
    for d in doc:
        d.pop("index")  # a whole batch answer: its list's order is the sequences'
    _, summary = parse_response("sglang-generate", json.dumps(doc).encode(), choices=1)
    c = streams.summary_counts(summary, streamed=False)
    assert c.generated_tokens == 13 and c.prompt_tokens == 22 and c.complete and c.count_problem is None


def test_the_sequences_of_a_generate_request_are_read_from_its_body():
    def extra(doc):
        e = {}
        inspect_request_body(json.dumps(doc).encode(), "", "sglang-generate", e)
        return e.get("sequences", 1), e.get("choices", 1), e.get("prompt_chars")

    assert extra({"text": "hello"}) == (1, 1, 5)
    assert extra({"text": ["a", "bb", "ccc"]})[:2] == (3, 1)
    assert extra({"text": "a", "sampling_params": {"n": 3}})[:2] == (3, 3)
    assert extra({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]})[:2] == (4, 2)
    assert extra({"input_ids": [1, 2, 3]})[:2] == (1, 1)
    assert extra({"input_ids": [[1, 2], [3]]})[:2] == (2, 1)
    for bad in ("2", 0, True, 2.5, None, 10 ** 400):
        assert extra({"text": "a", "sampling_params": {"n": bad}})[:2] == (1, 1), bad


def test_the_parser_knows_the_generate_dialect_and_the_path_maps_to_it():
    assert streams.api_for_path("/generate") == "sglang-generate"
    StreamParser("sglang-generate")


@pytest.mark.parametrize("flavour,serves", [("llamacpp", False), ("sglang", True)])
def test_the_daemon_tells_its_ledger_whether_the_server_runs_generate(tmp_path, flavour, serves):
    # Only SGLang runs /generate (llama-server and vLLM answer it 404): the ledger costs a /generate closed at a crash
    # by the scraper's kind (`Ledger.serves_generate`), unknown until it is detected. Before: never told, it costed
    # a PUT or POST /generate on llama-server 110 J (truth 0).
    from test_daemon_cut_streams import _h200_daemon, _run_daemon

    srv, daemon = _h200_daemon(tmp_path, flavour)
    seen = []

    async def scene(url):
        for _ in range(200):
            if daemon.scraper.kind and daemon.ledger.serves_generate is not None:
                break
            await asyncio.sleep(0.05)
        seen.append((daemon.scraper.kind, daemon.ledger.serves_generate))

    _run_daemon(srv, daemon, scene, after_s=0.1)
    assert seen == [(flavour, serves)], seen
