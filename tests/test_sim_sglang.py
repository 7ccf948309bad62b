"""The simulator's SGLang flavour against powerprof's SGLang paths: detection, its OpenAI streams counted token for
token against the simulator's truth, and its /metrics as SGLang's multiprocess collector shows it (docs/simulator.md)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pyarrow.parquet as pq

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams, detect_server, new_session
from powerprof.workload.load import Prompt
from powerprof.workload.servercount import counter_total, histogram_sum_count


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
    """--skip-server-warmup: an empty page until the first prefill log and request end; with its warm-up (default):
    the warm-up's 2 tokens counted before it is ready. Its gauges keep their last log's values (not the engine's)."""
    with SimServer(flavour="sglang", sglang_warmup=False, decode_tok_s=200.0, draft_n_max=0) as srv:
        assert _metrics(srv.url) == ""
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
