"""Against a real OpenAI-compatible server: llama-cpp-python serving a tiny random-weight GGUF model.

The model is written here with the `gguf` package (four layers, 512 wide, byte-level vocabulary;
a few ms a token on one core, so tokens arrive one by one even on a loaded machine),
so nothing is downloaded. The output rows for EOS and the byte tokens are zeroed so greedy
decoding never stops early and streams whole words. The server itself tells us what it did: its log prints llama.cpp's perf lines after
every request ("eval time = X ms / N runs"), and a non-streaming request returns `usage`.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys

import aiohttp
import pytest

from support import require_package

llama_cpp = require_package("llama_cpp", "llama-cpp-python")

from powerprof.arrival import reads  # noqa: E402
from powerprof.workload.client import RequestParams  # noqa: E402
from powerprof.workload.launcher import ServerLauncher  # noqa: E402
from powerprof.workload.load import Prompt, detect, run_load  # noqa: E402
from tiny_gguf import write_tiny_llama  # noqa: E402

pytestmark = [pytest.mark.realserver, pytest.mark.slow]

EVAL_RE = re.compile(r"^llama_perf_context_print:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs", re.M)


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("realserver")
    model = d / "tiny.gguf"
    write_tiny_llama(model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", "1", "--n_ctx", "512",
           # By default a new request cuts the running stream off (our client then reports a
           # truncated stream); queue them instead, like a one-slot llama-server.
           "--interrupt_requests", "False"]
    with ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=120, poll_s=0.2, log_path=d / "server.log") as la:
        # The first request after loading is slow and its stream comes out in one burst: warm up.
        asyncio.run(_non_streaming(la.base_url, "openai-completions", "warm up", 8))
        yield la


def eval_lines(log_text: str) -> list[tuple[float, int]]:
    return [(float(ms), int(n)) for ms, n in EVAL_RE.findall(log_text)]


async def _non_streaming(url: str, api: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "stream": False}
    if api == "openai-chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body) as r:
            return json.loads(await r.read())


@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_token_counts_and_windows_agree_with_the_server(real_server, api):
    info = detect(real_server.base_url, api)
    assert info.kind == "openai" and info.model
    n_tok = 48
    before = len(eval_lines(real_server.log_path.read_text(errors="replace")))
    # Distinct prompts: llama-cpp-python reuses a cached prefix, which changes its perf counts.
    prompts = [Prompt("a", f"{api} the power of energy"), Prompt("b", f"clock speed and watt {api}")]
    recs = run_load(info, prompts, 2, 1, RequestParams(max_tokens=n_tok), warmup=0)
    log = real_server.log_path.read_text(errors="replace")
    evals = eval_lines(log)[before:]
    assert [r.status for r in recs] == ["ok", "ok"], [r.error for r in recs]
    assert len(evals) == 2
    for r, p, (eval_ms, runs) in zip(recs, prompts, evals):
        # The server's own count of what it generated (greedy: the same answer without streaming).
        usage = asyncio.run(_non_streaming(real_server.base_url, api, p.text, n_tok))["usage"]
        assert r.generated_tokens == usage["completion_tokens"] >= n_tok
        assert r.stop_reason == "length"
        # It ran n − 1 decode steps after the one that came out of prompt processing.
        assert runs == r.generated_tokens - 1
        # The stream's window holds them all unless its edge reads were stale and trimmed (arrival.py).
        first_read = int(reads(r.event_t_ns, r.event_tokens)[1][0])  # a busy host can deliver a decode token with it
        assert r.decode_tokens == r.generated_tokens - first_read if not r.quality.trimmed else 0 < r.decode_tokens <= runs
        # The window lies inside the request, and the request lasted at least the server's decode
        # compute. (llama-cpp-python hands tokens to its HTTP side in bursts when the machine is
        # busy, so the window itself may be shorter than its eval time: a property of that server,
        # which is why the server's own timings are kept beside ours when it sends them.)
        assert r.t_send_ns < r.t_first_ns < r.t_last_ns <= r.t_end_ns
        assert (r.t_end_ns - r.t_send_ns) / 1e6 >= eval_ms * 0.95


def test_concurrent_batch_against_the_real_server(real_server):
    # llama-cpp-python serves one request at a time: the wall-clock aggregate must stay near the
    # single-stream rate while the sum of per-request rates counts it several times over.
    from powerprof.workload.rows import batch_windows

    info = detect(real_server.base_url)
    # Enough tokens that each stream spans many reads even though the tiny model is fast.
    recs = run_load(info, [Prompt("a", "to the GPU watt")], 3, 3, RequestParams(max_tokens=48), warmup=0)
    assert all(r.ok for r in recs), [r.error for r in recs]
    (b,) = batch_windows(recs)
    assert b.tok_s is not None, b
    # A stream the server flushed in one burst has no decode window of its own (rate None).
    rates = [r.decode_tok_s for r in recs if r.decode_tok_s is not None]
    assert rates, [(r.t_first_ns, r.t_last_ns) for r in recs]
    single = max(rates)
    assert b.tok_s <= single * 1.1
    assert b.sum_of_request_rates > 2 * b.tok_s
