"""The simulator's vLLM says its prefix cache as vLLM 0.32 does: usage's prompt_tokens_details with and without
--enable-prompt-tokens-details, streamed and whole, and its /metrics counters (read from a real vLLM 0.32 on CPU;
tests/test_real_vllm.py holds the simulator to it where vLLM is installed)."""

from __future__ import annotations

import pytest

from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from daemon_helpers import OPENING
from support import json_shape, openai_usages

COUNTS = {"prompt_tokens": "int", "total_tokens": "int", "completion_tokens": "int"}
# vLLM 0.32's usage shapes, captured from its answers (a pydantic dump: a whole answer has every field, null
# included; a stream's usage chunk none that is null). Chat's details say the tokens written to the cache too.
REAL = {
    (True, "openai-chat", False): {**COUNTS, "prompt_tokens_details": {
        "cached_tokens": "int", "created_cache_tokens": "int", "multimodal_tokens": None},
        "completion_tokens_details": None},
    (True, "openai-chat", True): {**COUNTS, "prompt_tokens_details": {"cached_tokens": "int", "created_cache_tokens": "int"}},
    (True, "openai-completions", False): {**COUNTS, "prompt_tokens_details": {
        "cached_tokens": "int", "created_cache_tokens": None, "multimodal_tokens": None},
        "completion_tokens_details": None},
    (True, "openai-completions", True): {**COUNTS, "prompt_tokens_details": {"cached_tokens": "int"}},
    (False, "openai-chat", False): {**COUNTS, "prompt_tokens_details": None, "completion_tokens_details": None},
    (False, "openai-chat", True): COUNTS,
    (False, "openai-completions", False): {**COUNTS, "prompt_tokens_details": None, "completion_tokens_details": None},
    (False, "openai-completions", True): COUNTS,
}



@pytest.mark.parametrize("details", [True, False], ids=["details", "no-details"])
@pytest.mark.parametrize("api", ["openai-chat", "openai-completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_usage_says_the_cache_in_vllms_shape(details, api, stream):
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000, model="tiny",
                   prefix_cache=True, prompt_details=details) as sim:
        first = openai_usages(sim.url, api, stream, OPENING)
        again = openai_usages(sim.url, api, stream, OPENING + "Power limits decide.")
    assert json_shape(first) == json_shape(again) == REAL[(details, api, stream)], (first, again)
    if details:
        # Nothing cached says 0, not an absent key; a later turn the part found in the cache.
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]
        if api == "openai-chat":
            for u in (first, again):
                d = u["prompt_tokens_details"]
                assert 0 <= d["created_cache_tokens"] <= u["prompt_tokens"] - d["cached_tokens"], u


def test_metrics_name_the_prefix_cache_counters_as_vllm_does():
    # vLLM 0.32's page shows, from its start, the device cache's counters and the KV connector's (an offloaded or
    # remote cache: counted apart), each in tokens, beside the prompt-token counter that counts cached ones too.
    from powerprof.daemon.scrape import counter_total

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000, model="tiny",
                   prefix_cache=True) as sim:
        import urllib.request

        page = lambda: urllib.request.urlopen(sim.url + "/metrics").read().decode()  # noqa: E731
        names = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
                 "vllm:prompt_tokens_total")
        assert [counter_total(page(), n) for n in names] == [0.0] * 5
        a = openai_usages(sim.url, "openai-completions", False, OPENING)
        b = openai_usages(sim.url, "openai-completions", False, OPENING + "Power limits decide.")
        text = page()
    prompts = a["prompt_tokens"] + b["prompt_tokens"]
    assert counter_total(text, "vllm:prefix_cache_queries_total") == counter_total(text, "vllm:prompt_tokens_total") == prompts
    assert 0 < counter_total(text, "vllm:prefix_cache_hits_total") < b["prompt_tokens"]
    assert counter_total(text, "vllm:external_prefix_cache_hits_total") == 0


def test_the_cache_holds_whole_blocks_as_vllms():
    # vLLM caches whole KV blocks (16 tokens by default on GPU, 128 on CPU): a new conversation whose prompt shares only
    # the chat template's first words with an earlier one finds nothing cached (vLLM 0.32 said 0 where the simulator,
    # its cache by word, said 3: tests/test_real_vllm.py), and a later turn's cached count is whole blocks (379 before).
    from powerprof.sim.server import VLLM_BLOCK_TOKENS

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000, model="tiny",
                   prefix_cache=True, prompt_details=True) as sim:
        openai_usages(sim.url, "openai-chat", False, "One conversation: " + OPENING)
        other = openai_usages(sim.url, "openai-chat", False, "Another conversation: " + OPENING)
        again = openai_usages(sim.url, "openai-chat", False, "Another conversation: " + OPENING + "Power limits.")
    assert other["prompt_tokens_details"]["cached_tokens"] == 0, other
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % VLLM_BLOCK_TOKENS == 0 and again["prompt_tokens"] - cached <= 3 + VLLM_BLOCK_TOKENS, again


@pytest.mark.parametrize("version,unit", [("v0.8", 16), ("v0.9", 1)])
def test_early_v1_pages_name_the_counters_as_vllm_0_8_and_0_9_did(version, unit):
    # vLLM 0.8.0-0.9.1 (V1's first names): vllm:gpu_prefix_cache_queries / _hits, in blocks before 0.9.0 (PR #18003)
    # and tokens since, the unit in their HELP; the block size in cache_config_info's labels. No current name yet.
    import urllib.request

    from powerprof.daemon.scrape import counter_total
    from powerprof.workload.servercount import prefix_cache_reading

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=2000, model="tiny",
                   prefix_cache=True, vllm_metrics=version) as sim:
        openai_usages(sim.url, "openai-completions", False, OPENING)
        b = openai_usages(sim.url, "openai-completions", False, OPENING + "Power limits decide.")
        text = urllib.request.urlopen(sim.url + "/metrics").read().decode()
    assert counter_total(text, "vllm:prefix_cache_hits_total") is None
    hits = counter_total(text, "vllm:gpu_prefix_cache_hits_total")
    assert 0 < hits * unit < b["prompt_tokens"]
    assert ("cached blocks" if unit > 1 else "cached tokens") in text
    assert prefix_cache_reading(text, "vllm") == ("hits", hits * unit, 0.0)
