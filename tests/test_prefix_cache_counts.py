"""The prompt tokens a server found in its prefix cache, read from each dialect's counts: the daemon costs only the
computed part of a prompt as prefill (docs/daemon.md, "Prompts are known"); a server that does not say leaves it None."""

from __future__ import annotations

import json

import pytest

from powerprof.daemon.streams import body_counts, new_parser, summary_counts


def _sse(*objs, done=True) -> bytes:
    out = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _stream(api: str, body: bytes):
    p = new_parser(api)
    p.count(body)
    return summary_counts(p.finish())


def _chunk(text, fr=None):
    return {"choices": [{"index": 0, "delta": {"content": text} if text else {}, "finish_reason": fr}]}


def test_openai_usage_prompt_tokens_details_cached_tokens():
    # vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report.
    c = _stream("openai-chat", _sse(_chunk("a"), _chunk("b", "length"),
                                    {"choices": [], "usage": {"prompt_tokens": 2000, "completion_tokens": 2,
                                                              "prompt_tokens_details": {"cached_tokens": 1900}}}))
    assert (c.prompt_tokens, c.cached_tokens, c.generated_tokens) == (2000, 1900, 2)


def test_openai_usage_without_details_says_nothing_cached():
    # vLLM without the flag sends prompt_tokens_details: null: not "0 cached", unknown.
    for usage in ({"prompt_tokens": 2000, "completion_tokens": 2, "prompt_tokens_details": None},
                  {"prompt_tokens": 2000, "completion_tokens": 2}):
        c = _stream("openai-chat", _sse(_chunk("a"), _chunk("b", "length"), {"choices": [], "usage": usage}))
        assert c.prompt_tokens == 2000 and c.cached_tokens is None


@pytest.mark.parametrize("api", ["llamacpp", "openai-chat"])
def test_llamacpp_timings_cache_n(api):
    # prompt_n is only the part computed; the prompt figure is prompt_n + cache_n, cache_n of it cached.
    t = {"prompt_n": 100, "cache_n": 1900, "predicted_n": 2, "prompt_ms": 10.0, "predicted_ms": 20.0}
    if api == "llamacpp":
        body = _sse({"content": "a", "stop": False}, {"content": "b", "stop": False},
                    {"content": "", "stop": True, "stop_type": "limit", "timings": t}, done=False)
    else:  # llama-server's chat: usage (no details) and timings on its last chunk
        body = _sse(_chunk("a"), _chunk("b", "length"),
                    {"choices": [], "usage": {"prompt_tokens": 2000, "completion_tokens": 2}, "timings": t})
    c = _stream(api, body)
    assert (c.prompt_tokens, c.cached_tokens) == (2000, 1900)


def test_anthropic_cache_read_input_tokens():
    # llama-server's Messages: input_tokens is the uncached part; the cache's read part was not computed.
    body = (b"event: message_start\ndata: " + json.dumps({"type": "message_start", "message": {
        "model": "m", "usage": {"input_tokens": 100, "cache_read_input_tokens": 1900, "output_tokens": 0}}}).encode()
        + b"\n\nevent: content_block_delta\ndata: " + json.dumps({"type": "content_block_delta", "index": 0, "delta": {
            "type": "text_delta", "text": "a"}}).encode()
        + b"\n\nevent: message_delta\ndata: " + json.dumps({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                                            "usage": {"output_tokens": 1}}).encode()
        + b"\n\nevent: message_stop\ndata: {\"type\": \"message_stop\"}\n\n")
    c = _stream("anthropic-messages", body)
    assert (c.prompt_tokens, c.cached_tokens) == (2000, 1900)


def test_responses_input_tokens_details():
    body = json.dumps({"object": "response", "status": "completed", "output": [
        {"type": "message", "content": [{"type": "output_text", "text": "a"}]}],
        "usage": {"input_tokens": 2000, "input_tokens_details": {"cached_tokens": 1900}, "output_tokens": 1}}).encode()
    c = body_counts("openai-responses", body)
    assert (c.prompt_tokens, c.cached_tokens) == (2000, 1900)


def test_sglang_generate_meta_info_cached_tokens():
    mi = {"prompt_tokens": 2000, "completion_tokens": 1, "cached_tokens": 1900,
          "finish_reason": {"type": "length", "length": 1}}
    c = body_counts("sglang-generate", json.dumps({"text": "a", "output_ids": [5], "meta_info": mi}).encode())
    assert (c.prompt_tokens, c.cached_tokens) == (2000, 1900)


def test_server_prefix_cache_counters_read_from_metrics():
    # What the daemon checks the answers' cached counts against (docs/daemon.md, "Prefix-cache hits are no prefill").
    from powerprof.workload.servercount import prefix_cache_reading

    v1 = ('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 5000.0\n'
          'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3800.0\n')
    assert prefix_cache_reading(v1, "vllm") == ("hits", 3800.0, 0.0)
    v0 = "vllm:gpu_prefix_cache_hit_rate 0.25\nvllm:prompt_tokens_total 4000.0\n"
    assert prefix_cache_reading(v0, "vllm") == ("rate", 0.25, 4000.0)
    # SGLang sets its counter at the first hit: its own page without it has none yet; vLLM's without either: unknown.
    assert prefix_cache_reading('sglang:generation_tokens_total{model_name="m"} 9.0\n', "sglang") == ("hits", 0.0, 0.0)
    assert prefix_cache_reading("vllm:generation_tokens_total 9.0\n", "vllm") is None
    assert prefix_cache_reading("", "llamacpp") is None


def test_vllm_hits_from_a_kv_connector_count_with_the_device_caches():
    # vLLM 0.32 counts an offloaded or remote cache's hits (its KV connector: --kv-offloading-size, LMCache) apart, in
    # vllm:external_prefix_cache_hits_total, while usage's cached_tokens says both: a turn found in host memory was
    # read as computed whole and never flagged (3800 hits seen of 4800).
    from powerprof.workload.servercount import prefix_cache_reading

    page = ('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3800.0\n'
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1000.0\n')
    assert prefix_cache_reading(page, "vllm") == ("hits", 4800.0, 0.0)


def _early_v1_page(unit: str, hits: float, block_size: int | None = 16, help_line: bool = True) -> str:
    # vLLM 0.8.0-0.9.1's page (V1's first names, PR #12592): the unit in the HELP alone, blocks until PR #18003 (0.9.0).
    page = ""
    if help_line:
        page += f"# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached {unit}.\n"
    page += ("# TYPE vllm:gpu_prefix_cache_hits_total counter\n"
             f'vllm:gpu_prefix_cache_hits_total{{model_name="m"}} {hits}\n')
    if block_size is not None:
        page += ("# TYPE vllm:cache_config_info gauge\n"
                 f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True"}} 1.0\n')
    return page


def test_early_vllm_v1_hits_are_read_in_tokens_whatever_their_unit():
    # Before: vllm:gpu_prefix_cache_hits_total was not read at all (None: hits no answer said went unflagged on vLLM
    # 0.8.0-0.9.1). Tokens are read as they are; blocks (0.8) times the block size cache_config_info says (vLLM's hits
    # are whole blocks); blocks of no known size, or no unit said, as "blocks": at least a token each.
    from powerprof.workload.servercount import prefix_cache_reading

    assert prefix_cache_reading(_early_v1_page("tokens", 384.0), "vllm") == ("hits", 384.0, 0.0)
    assert prefix_cache_reading(_early_v1_page("blocks", 24.0), "vllm") == ("hits", 384.0, 0.0)
    assert prefix_cache_reading(_early_v1_page("blocks", 24.0, block_size=None), "vllm") == ("blocks", 24.0, 0.0)
    assert prefix_cache_reading(_early_v1_page("tokens", 24.0, help_line=False), "vllm") == ("blocks", 24.0, 0.0)
    # vLLM 0.9.2-0.10 shows both names: the current one is read, not their sum.
    both = _early_v1_page("tokens", 384.0) + 'vllm:prefix_cache_hits_total{model_name="m"} 384.0\n'
    assert prefix_cache_reading(both, "vllm") == ("hits", 384.0, 0.0)
