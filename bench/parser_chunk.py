"""The stream parser's count-only cost per token chunk, this tree's beside a baseline tree's, in one run.

    PYTHONPATH=TREE .venv/bin/python bench/parser_chunk.py --baseline OTHER_TREE

The proxy calls `StreamParser.count` once per upstream chunk (`_ClientSink.account`): its cost is paid per
token. Each shape below is counted 20 000 times by both parsers, alternating, best of 5 (this machine's
load moves both alike): plain chunks of vLLM, llama.cpp (OpenAI-compatible and native) and completions,
which take the byte path (`_quick_count`), vLLM's continuous usage, which takes the full parse, and an Anthropic
Messages `content_block_delta` (an `event:` line and its data, read from its bytes its own way: `_anthropic_quick`).
SGLang's /generate (`sglang N`): whole responses of N tokens, each event its text and output_ids so far (SGLang's compact
orjson shape, as bench/proxy_latency.py --api sglang serves them), per event on average over the response, its
first and last events and [DONE] included.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

OPENER = (b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
          b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n')
SHAPES = {
    "vllm chat": ("openai-chat", b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
                  b'"choices":[{"index":0,"delta":{"content":" the"},"logprobs":null,"finish_reason":null}]}\n\n'),
    "llama.cpp chat": ("openai-chat", b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" the"}}],'
                       b'"created":1,"id":"chatcmpl-1","model":"m","system_fingerprint":"b1",'
                       b'"object":"chat.completion.chunk"}\n\n'),
    "vllm continuous usage": ("openai-chat", None),
    "llama.cpp native": ("llamacpp", b'data: {"index":0,"content":" the","tokens":[264],"stop":false,"id_slot":0,'
                         b'"tokens_predicted":1,"tokens_evaluated":5}\n\n'),
    "completions": ("openai-completions", b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
                    b'"choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}\n\n'),
    "anthropic messages": ("anthropic-messages", b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                           b'"index":0,"delta":{"type":"text_delta","text":" the"}}\n\n'),
}
# The first event each stream's parser reads whole (its opener), by dialect: llama.cpp's is its first token chunk.
OPENERS = {"anthropic-messages": b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
                                 b'"type":"message","role":"assistant","content":[],"model":"m","usage":'
                                 b'{"input_tokens":5,"output_tokens":0}}}\n\n'}


def usage_chunk(i: int) -> bytes:
    return (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
            b'"delta":{"content":" the"},"logprobs":null,"finish_reason":null}],"usage":{"prompt_tokens":10,'
            b'"total_tokens":%d,"completion_tokens":%d}}\n\n' % (10 + i, i))


def load_baseline(tree: Path):
    spec = importlib.util.spec_from_file_location("powerprof.workload._baseline_stream",
                                                  tree / "powerprof" / "workload" / "stream.py")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "powerprof.workload"  # its relative imports resolve in this tree (limits.py)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_chunk_us(mod, api: str, chunk: bytes | None, n: int = 20_000) -> float:
    p = mod.StreamParser(api, count_only=True)
    p.count(chunk if api == "llamacpp" else OPENERS.get(api, OPENER))  # the first event is parsed whole
    chunks = [usage_chunk(i + 1) for i in range(n)] if chunk is None else [chunk] * n
    t0 = time.perf_counter()
    for c in chunks:
        p.count(c)
    return (time.perf_counter() - t0) / n * 1e6


def sglang_events(tokens: int) -> list[bytes]:
    out = []
    for i in range(1, tokens + 1):
        fr = b'{"type":"length","length":%d}' % tokens if i == tokens else b"null"
        out.append(b'data: {"text":"%b","output_ids":[%b],"meta_info":{"id":"4f1c2b7a9e8d4c3b","finish_reason":%b,'
                   b'"prompt_tokens":5,"weight_version":"default","completion_tokens":%d,"cached_tokens":0,'
                   b'"e2e_latency":0.0123}}\n\n' % (b" tok" * i, b",".join(b"%d" % (100_000 + 7919 * j % 50_000)
                                                                     for j in range(1, i + 1)), fr, i))
    return out + [b"data: [DONE]\n\n"]


def per_event_us_sglang(mod, events: list[bytes], n: int = 20_000) -> float:
    responses = max(1, n // len(events))
    t0 = time.perf_counter()
    for _ in range(responses):
        p = mod.StreamParser("sglang-generate", count_only=True)
        for e in events:
            p.count(e)
        p.finish()
    return (time.perf_counter() - t0) / (responses * len(events)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, required=True, help="another source tree (a git worktree of main)")
    a = ap.parse_args()
    import powerprof.workload.stream as this

    base = load_baseline(a.baseline)
    print(f"{'shape':24s} {'baseline':>10s} {'this tree':>10s}  (us per chunk, best of 5)")
    for name, (api, chunk) in SHAPES.items():
        best = {"b": float("inf"), "t": float("inf")}
        for _ in range(5):
            best["b"] = min(best["b"], per_chunk_us(base, api, chunk))
            best["t"] = min(best["t"], per_chunk_us(this, api, chunk))
        print(f"{name:24s} {best['b']:10.2f} {best['t']:10.2f}  ({best['t'] / best['b'] - 1:+.0%})")
    for tokens in (32, 256):
        events = sglang_events(tokens)
        best = {"b": float("inf"), "t": float("inf")}
        for _ in range(5):
            best["b"] = min(best["b"], per_event_us_sglang(base, events))
            best["t"] = min(best["t"], per_event_us_sglang(this, events))
        name = f"sglang {tokens}"
        print(f"{name:24s} {best['b']:10.2f} {best['t']:10.2f}  ({best['t'] / best['b'] - 1:+.0%})")


if __name__ == "__main__":
    main()
