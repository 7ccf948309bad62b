"""Traces: Azure CSV and JSONL readers, synthetic generator, replay against the simulated server, `powerprof replay`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from powerprof.sim.server import SimServer, count_prompt_tokens
from powerprof.workload.replay import prompt_text, replay, summarize
from powerprof.workload.trace import TraceError, read_trace, shape, synthetic, write_jsonl

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:46.9000000,879,4
"""


def test_azure_csv_is_read_sorted_with_offsets_from_the_first_request(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    tr = read_trace(p)
    assert [(r.prompt_tokens, r.output_tokens) for r in tr] == [(374, 44), (879, 4), (396, 109)]
    assert [r.t_s for r in tr] == pytest.approx([0.0, 0.21941, 4.314578], abs=1e-5)


def test_jsonl_round_trips_and_bad_lines_name_the_line(tmp_path):
    tr = synthetic(50, 5.0, tags=("a", "b"), seed=2)
    p = tmp_path / "t.jsonl"
    write_jsonl(tr, p)
    back = read_trace(p)
    assert [(r.prompt_tokens, r.output_tokens, r.tag) for r in back] == [(r.prompt_tokens, r.output_tokens, r.tag) for r in tr]
    p.write_text(p.read_text() + '{"t_s": 99, "prompt_tokens": -3, "output_tokens": 5}\n')
    with pytest.raises(TraceError, match=r"t.jsonl:51"):
        read_trace(p)
    (tmp_path / "bad.csv").write_text("time,prompt\n1,2\n")
    with pytest.raises(TraceError, match="TIMESTAMP, ContextTokens, GeneratedTokens"):
        read_trace(tmp_path / "bad.csv")


def test_synthetic_arrivals_and_lengths():
    p = synthetic(4000, 5.0, "poisson", seed=1)
    gaps = np.diff([r.t_s for r in p])
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential gaps
    b = synthetic(4000, 5.0, "bursty", seed=1)
    bg = np.diff([r.t_s for r in b])
    assert np.std(bg) / np.mean(bg) > 2  # burstier than Poisson
    lens = np.array([r.output_tokens for r in p])
    assert 8 <= lens.min() and lens.max() <= 600 and np.median(lens) == pytest.approx(80, rel=0.1)
    s = shape(p, time_scale=2.0, duration_s=100.0)
    assert max(r.t_s for r in s) < 100.0 and len(s) == pytest.approx(1000, rel=0.1)


def test_prompts_have_the_asked_length_on_the_simulator():
    assert [count_prompt_tokens(prompt_text(n, 7)) for n in (2, 10, 500)] == [2, 10, 500]


def test_replay_sends_each_request_at_its_time_with_its_lengths():
    tr = synthetic(12, 20.0, prompt_median=50, output_median=12, output_range=(4, 30), seed=3)
    with SimServer(flavour="vllm", n_slots=16, batching="continuous", decode_tok_s=400.0) as srv:
        server, recs = replay(srv.url, tr)
        truth = sorted(srv.truth, key=lambda t: t["t_arrive_ns"])
    assert server.kind == "vllm"
    sm = summarize(recs)
    assert sm.ok == 12 and sm.failed == 0
    assert [r.record.generated_tokens for r in recs] == [r.output_tokens for r in tr]  # ignore-EOS / min_tokens
    assert sorted(t["prompt_tokens"] for t in truth) == sorted(r.prompt_tokens for r in tr)
    sent = np.array([r.record.t_send_ns for r in recs]) / 1e9
    assert sent - sent[0] == pytest.approx([r.t_s for r in tr], abs=0.25)


def test_replay_cli_rejects_a_bad_trace_and_reports_a_good_one(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("nope\n")
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(bad), "--simulate", "a100-40g"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not an Azure trace" in p.stderr
    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(6, 10.0, prompt_median=20, output_median=10, seed=1), good)
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(good), "--simulate", "a100-40g", "--json",
                        "--time-scale", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["ok"] == 6 and out["generated_tokens"] > 0 and out["latency_p50_s"] > 0


def test_sweep_trace_reports_j_per_token_and_latency_per_level_and_restores(tmp_path):
    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(8, 10.0, prompt_median=30, output_median=20, seed=4), good)
    env = {**__import__("os").environ, "POWERPROF_SIM_STATE": str(tmp_path / "sim-state.json")}
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "a100-40g", "--limits", "400,200",
                        "--trace", str(good), "--time-scale", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip().startswith(("400W", "200W"))]
    assert [r[0] for r in rows] == ["400W", "200W"]
    jpt = {r[0]: float(r[4]) for r in rows}
    assert all(r[1] == "8" and r[2] == "0" for r in rows)
    assert jpt["200W"] < jpt["400W"]  # the simulated card is more efficient capped
    state = json.loads((tmp_path / "sim-state.json").read_text())
    assert all(v == {} for v in state.values())  # every GPU back at its default: nothing left set
