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


@pytest.mark.parametrize("name, data, where", [
    ("nan.jsonl", b'{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n{"t_s": NaN, "prompt_tokens": 4, "output_tokens": 5}\n',
     "nan.jsonl:2"),
    ("inf.jsonl", b'{"t_s": Infinity, "prompt_tokens": 4, "output_tokens": 5}\n', "inf.jsonl:1"),
    ("nan.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,5\nnan,4,5\n", "nan.csv:3"),
    ("far.jsonl", b'{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n{"t_s": 1e300, "prompt_tokens": 4, "output_tokens": 5}\n',
     "far.jsonl"),
    ("binary.csv", b"\xff\xfe\x00\x01garbage\n", "binary.csv"),
])
def test_a_trace_the_replay_cannot_schedule_is_refused_with_its_line(tmp_path, name, data, where):
    # A NaN or infinite arrival once reached the replay's scheduler (an OverflowError traceback, or
    # "cannot convert float NaN to integer" after the server had started); a binary file a
    # UnicodeDecodeError traceback. Each is a TraceError naming the file (and line), before anything starts.
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(TraceError, match=where.replace(".", r"\.")):
        read_trace(p)


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


@pytest.mark.parametrize("sig, code, said", [(2, 130, "interrupted"), (15, 143, "stopped by SIGTERM")])
def test_replay_stopped_by_a_signal_says_so_with_the_signals_exit_code(tmp_path, sig, code, said):
    # Ctrl-C printed click's bare "Aborted!" and exited 1; SIGTERM killed it without a word, its figures lost.
    import time

    import psutil

    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(400, 2.0, prompt_median=20, output_median=40, seed=1), good)
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "replay", str(good), "--simulate", "a100-40g"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # Replaying once requests flow: an established connection to its own simulated server.
        while time.monotonic() < deadline and not any(c.status == "ESTABLISHED" for c in psutil.Process(p.pid).net_connections()):
            time.sleep(0.1)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, err
    assert said in err and "Aborted" not in err and "Traceback" not in err and "never retrieved" not in err, err
    # What finished is reported (or that nothing had): the figures are not lost with the signal.
    assert "requests that had finished" in err or "before any request finished" in err, err


def test_sweep_trace_writes_a_run_directory_that_analyze_and_export_read(tmp_path):
    import hashlib

    import pyarrow.parquet as pq

    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(8, 10.0, prompt_median=30, output_median=20, seed=4), good)
    env = {**__import__("os").environ, "POWERPROF_SIM_STATE": str(tmp_path / "sim-state.json")}
    run = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "a100-40g", "--limits", "400,200",
                        "--trace", str(good), "--time-scale", "2", "--idle-s", "1", "--out", str(run)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip().startswith(("400W", "200W"))]
    assert [r[0] for r in rows] == ["400W", "200W"]
    jpt = {r[0]: float(r[4]) for r in rows}
    assert all(r[1] == "8" and r[2] == "0" for r in rows)
    assert jpt["200W"] < jpt["400W"]  # the simulated card is more efficient capped
    state = json.loads((tmp_path / "sim-state.json").read_text())
    assert all(v == {} for v in state.values())  # every GPU back at its default: nothing left set

    # The run directory: the trace's identity in run.json, one trace window per level (the figure
    # printed) beside a row per replayed request, samples and levels like any sweep.
    meta = json.loads((run / "run.json").read_text())
    assert meta["trace"]["sha256"] == hashlib.sha256(good.read_bytes()).hexdigest()
    assert meta["trace"]["requests"] == 8 and meta["trace"]["time_scale"] == 2.0
    assert meta["trace"]["path"] == str(good.resolve())
    w = pq.read_table(run / "windows.parquet").to_pylist()
    traces = {r["level_value"]: r for r in w if r["window_kind"] == "trace"}
    assert sorted(traces) == [200.0, 400.0]
    # Two rates, each named: the replay's throughput, and the median request's own rate, the trace row's decode_tok_s
    # that `analyze` compares levels by (the one "tok/s" printed was the throughput: 13.0% slower where analyze said 13.7%).
    head = next(ln for ln in p.stdout.splitlines() if ln.split()[:1] == ["level"]).split()
    assert head[6:10] == ["all", "tok/s", "req", "tok/s"], head
    printed = {r[0]: r for r in rows}
    for lv, r in traces.items():
        assert r["gpu_j_per_token"] == pytest.approx(jpt[f"{lv:g}W"], abs=1e-3)
        assert float(printed[f"{lv:g}W"][6]) == pytest.approx(r["decode_tok_s"], abs=0.051)
        assert float(printed[f"{lv:g}W"][5]) == pytest.approx(r["generated_tokens"] / r["decode_s"], rel=0.02)
        assert r["generated_tokens"] == sum(x["generated_tokens"] for x in w
                                            if x["window_kind"] == "request" and x["level_value"] == lv)
    assert sum(r["window_kind"] == "request" for r in w) == 16
    assert len({r["request_id"] for r in w if r["window_kind"] == "request"}) == 16
    assert pq.read_table(run / "samples.parquet").num_rows > 0
    levels = pq.read_table(run / "levels.parquet").to_pylist()
    assert {r["level_value"]: r["n_requests"] for r in levels} == {200.0: 8, 400.0: 8}
    for r in levels:
        # One window per level: the J/token is the trace's; no CI rather than a zero-width one.
        assert r["gpu_j_per_token"] == pytest.approx(traces[r["level_value"]]["gpu_j_per_token"])
        assert r["gpu_j_per_token_ci_low"] is None or r["gpu_j_per_token_ci_low"] != r["gpu_j_per_token_ci_low"]
        assert "one-window" in r["flags"]

    a = subprocess.run([sys.executable, "-m", "powerprof.cli", "analyze", str(run)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert a.returncode == 0, a.stderr
    assert "one window per level" in a.stdout and (run / "analysis" / "report.html").exists()
    e = subprocess.run([sys.executable, "-m", "powerprof.cli", "export", str(run), "--format", "csv", "--out",
                        str(tmp_path / "csv")], capture_output=True, text=True, timeout=300, env=env)
    assert e.returncode == 0, e.stderr
    assert "trace" in (tmp_path / "csv" / "windows.csv").read_text()
    # Another trace's run is other traffic: not pooled with this one.
    import shutil

    other = tmp_path / "other"
    shutil.copytree(run, other, ignore=shutil.ignore_patterns("analysis"))
    meta["trace"]["sha256"] = "0" * 64
    (other / "run.json").write_text(json.dumps(meta))
    a = subprocess.run([sys.executable, "-m", "powerprof.cli", "analyze", str(run), str(other)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert a.returncode != 0 and "differ in traffic" in a.stderr


@pytest.mark.parametrize("name, data, where", [
    # Infinity tokens: an OverflowError traceback from int().
    ("inftok.jsonl", b'{"t_s": 0, "prompt_tokens": Infinity, "output_tokens": 5}\n', "inftok.jsonl:1"),
    # 1e12 output tokens: the replay generated for ever; as many prompt tokens built the text in memory.
    ("hugeout.jsonl", b'{"t_s": 0, "prompt_tokens": 4, "output_tokens": 1e12}\n', "hugeout.jsonl:1"),
    ("hugein.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,1000000000000,5\n", "hugein.csv:2"),
    ("bool.jsonl", b'{"t_s": true, "prompt_tokens": true, "output_tokens": 5}\n', "bool.jsonl:1"),
    # An empty file read as "not an Azure trace: the header must name ... (got )".
    ("empty.jsonl", b"", "empty.jsonl: the trace is empty"),
    ("blank.csv", b"\n  \n", "blank.csv: the trace is empty"),
])
def test_a_trace_with_impossible_numbers_or_nothing_in_it_is_refused_clearly(tmp_path, name, data, where):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(TraceError, match=where.replace(".", r"\.")):
        read_trace(p)


def test_replay_cli_refuses_infinite_tokens_without_a_traceback(tmp_path):
    bad = tmp_path / "inf.jsonl"
    bad.write_bytes(b'{"t_s": 0, "prompt_tokens": Infinity, "output_tokens": 5}\n')
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(bad), "--simulate"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "inf.jsonl:1" in p.stderr


def test_trace_cli_keeps_an_existing_file_and_says_why_it_cannot_write(tmp_path):
    # It used to overwrite any file named (a user's real trace, `trace` taken for "show the trace"),
    # and a missing folder was a FileNotFoundError traceback.
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n')
    cmd = [sys.executable, "-m", "powerprof.cli", "trace", "--requests", "3"]
    p = subprocess.run(cmd + [str(mine)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "exists" in p.stderr and "--force" in p.stderr
    assert mine.read_text() == '{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n'
    p = subprocess.run(cmd + [str(mine), "--force"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and len(read_trace(mine)) == 3
    p = subprocess.run(cmd + [str(tmp_path / "no" / "t.jsonl")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "does not exist" in p.stderr


def test_write_jsonl_interrupted_leaves_the_old_file_whole(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("old\n")

    class Boom:
        def __iter__(self):
            yield synthetic(1, 1.0)[0]
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_jsonl(Boom(), p)
    assert p.read_text() == "old\n" and not list(tmp_path.glob(".t.jsonl*"))


def test_replay_launch_without_server_is_a_usage_error(tmp_path):
    # It was exit 1 (a run failure) after opening the simulated rig; it is a usage error, found first.
    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(2, 10.0, seed=1), good)
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(good), "--simulate", "--launch", "sleep 100"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--launch needs --server URL" in p.stderr


AZURE_2024 = """TIMESTAMP,ContextTokens,GeneratedTokens
2024-05-10 00:00:00.009930+00:00,4808,10
2024-05-10 00:00:01+00:00,3180,8
2024-05-10 00:00:00.5Z,110,27
"""


@pytest.mark.parametrize("name, data", [
    # The 2024 week-long traces (offset after 6 digits, some rows without a fraction): every row
    # was "bad row (could not convert string to float: '0.009930+00:00')".
    ("azure2024.csv", AZURE_2024.encode()),
    # A spreadsheet's save: byte-order mark and CRLF; "not an Azure trace ... (got \ufeffTIMESTAMP, ...)".
    ("bom.csv", b"\xef\xbb\xbf" + AZURE_2024.replace("\n", "\r\n").encode()),
    # Columns beside the three, in another order.
    ("extra.csv", b"Region,GeneratedTokens,TIMESTAMP,ContextTokens\nwest,10,2024-05-10 01:00:00.009930+01:00,4808\n"
                  b"\nwest,8,2024-05-10 00:00:01Z,3180\neast,27,2024-05-10T00:00:00.5,110\n"),
])
def test_azure_csv_as_published_and_as_saved_again(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    tr = read_trace(p)
    assert [(r.prompt_tokens, r.output_tokens) for r in tr] == [(4808, 10), (110, 27), (3180, 8)]
    assert [r.t_s for r in tr] == pytest.approx([0.0, 0.49007, 0.99007], abs=1e-6)


def test_a_jsonl_trace_with_a_byte_order_mark_or_a_tag_that_is_no_string(tmp_path):
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n')
    assert read_trace(p)[0].prompt_tokens == 4  # was "not an Azure trace"
    p.write_text('{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5, "tag": {"team": "a"}}\n')
    with pytest.raises(TraceError, match=r"bom.jsonl:1.*tag must be a string"):  # was the tag "{'team': 'a'}"
        read_trace(p)
    # A newline in a tag (its header) stopped the replay mid-way with aiohttp's "header injection" error.
    p.write_text('{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n{"t_s": 1, "prompt_tokens": 4, "output_tokens": 5, '
                 '"tag": "a\\nb"}\n')
    with pytest.raises(TraceError, match=r"bom.jsonl:2.*control character"):
        read_trace(p)


def test_a_naive_timestamp_is_utc_whatever_the_machines_zone(tmp_path, monkeypatch):
    # Read in the machine's zone, this hour across New York's spring-forward change was 2 s long.
    import time

    p = tmp_path / "dst.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-03-12 01:59:59,1,1\n2023-03-12 03:00:01,1,1\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert read_trace(p)[1].t_s == pytest.approx(3602.0)
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("scale", ["1e-300", "1e-12"])
def test_a_time_scale_that_spreads_the_trace_beyond_any_replay_is_refused(tmp_path, scale):
    # 1e-300: an OverflowError traceback once the server had started; 1e-12: a replay silently waiting 1e12 s.
    good = tmp_path / "t.jsonl"
    write_jsonl(synthetic(3, 1.0, seed=1), good)
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(good), "--simulate", "--time-scale", scale],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--time-scale" in p.stderr, p.stderr


def _trace_sweep_with_a_fault(tmp_path, fault: dict, trace, **kw):
    """An in-process `sweep --trace` over 400 W then 250 W on a simulated A100 whose server takes `fault` once."""
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sweep import run_sweep

    out = tmp_path / "run"
    with Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=tmp_path / "sim.json")) as rig, rig.sim_server() as srv:
        if fault:
            srv.inject(**fault)
        outcome = run_sweep(rig, levels_spec="400,250", url=srv.url, trace=trace, trace_meta={}, out_dir=out,
                            idle_s=0, interval_s=0.5, **kw)
    return out, outcome


def test_a_trace_level_where_a_request_failed_gives_no_j_per_token_and_says_why(tmp_path):
    # The cut request's prefill and first tokens were in the level's energy, its tokens not in the
    # count: the level's J/token was too high, over other traffic than the other level's, and
    # nothing said so (status ok, the figure in levels.parquet and in the recommendation).
    import pyarrow.parquet as pq

    tr = synthetic(6, 10.0, prompt_median=20, output_median=24, output_range=(20, 30), seed=5)
    out, outcome = _trace_sweep_with_a_fault(tmp_path, dict(kind="drop", count=1, after_tokens=4), tr)
    w = pq.read_table(out / "windows.parquet").to_pylist()
    traces = {r["level_value"]: r for r in w if r["window_kind"] == "trace"}
    assert traces[400.0]["status"] == "failed" and traces[400.0]["gpu_j_per_token"] is None
    assert traces[400.0]["error"].startswith("1 of 6 requests failed (first: server closed the stream")
    assert traces[250.0]["status"] == "ok" and traces[250.0]["gpu_j_per_token"] > 0
    levels = {r["level_value"]: r for r in pq.read_table(out / "levels.parquet").to_pylist()}
    j400 = levels.get(400.0, {}).get("gpu_j_per_token")
    assert j400 is None or j400 != j400  # no figure (NaN or no row), not the biased one
    assert levels[250.0]["gpu_j_per_token"] == pytest.approx(traces[250.0]["gpu_j_per_token"])
    said = [n for n in outcome.notes if n.startswith("level 400: 1 of 6 requests failed")]
    assert said and "no J/token" in said[0] and "fix:" in said[0]


def test_replay_lateness_is_measured_when_each_request_is_sent(monkeypatch):
    # Requests due together were stamped "on time" as their tasks were made, before any was sent:
    # a client busy building them (long prompts) sent the last ones late and said 0.
    import time

    from powerprof.workload import replay as rp
    from powerprof.workload.trace import TraceRequest

    build = rp.prompt_text

    def busy(n, i):
        time.sleep(0.03)
        return build(n, i)

    monkeypatch.setattr(rp, "prompt_text", busy)
    tr = [TraceRequest(0.0, 8, 4) for _ in range(10)]
    with SimServer(flavour="vllm", n_slots=16, batching="continuous", decode_tok_s=400.0) as srv:
        _, recs = replay(srv.url, tr)
    assert max(r.late_s for r in recs) >= 0.2  # the last sent after nine others' 30 ms each
    assert summarize(recs).late_p95_s >= 0.2


def test_ctrl_c_in_a_trace_sweep_says_where_the_finished_levels_are(tmp_path, monkeypatch):
    # It said only "interrupted: every GPU is back at its original limit": not that the levels were kept, nor where.
    from click.testing import CliRunner

    from support import ctrl_c_once_the_gpus_are_back

    from powerprof.cli import main

    ctrl_c_once_the_gpus_are_back(monkeypatch)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t_s": {0.05 * i}, "prompt_tokens": 8, "output_tokens": 8}}\n' for i in range(3)))
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["sweep", "--limits", "220,300", "--simulate", "--trace", str(trace), "--out", str(out),
                                  "--idle-s", "0", "--interval", "0.5"])
    assert r.exit_code == 130, r.output
    flat = "".join(r.stderr.split())
    assert "".join(f"stopped: 2 finished levels kept in {out} (powerprof analyze {out})".split()) in flat, r.stderr
    assert "interrupted: every GPU is back at its original limit" in r.stderr


def test_ctrl_c_mid_replay_reports_the_finished_requests(tmp_path):
    # It was click's "Aborted!", exit 1, every finished request's figures lost.
    import signal
    import time

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t_s": {0.25 * i}, "prompt_tokens": 8, "output_tokens": 8}}\n' for i in range(200)))
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "replay", str(trace), "--simulate", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "replaying 200 request(s)" in p.stderr.readline()
        time.sleep(4)  # a few requests finish
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    got = json.loads(out)
    assert 1 <= got["n"] < 200 and got["ok"] == got["n"] and got["interrupted"] == {"requests_planned": 200}
    assert f"the figures are over the {got['n']} of 200 requests that had finished" in " ".join(err.split())


def test_a_trace_sweep_where_every_level_had_failures_exits_1_saying_why(tmp_path):
    from click.testing import CliRunner

    from powerprof.cli import main
    from powerprof.sim.nvml import SimNVML

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t_s": {0.05 * i}, "prompt_tokens": 8, "output_tokens": 12}}\n' for i in range(3)))
    with SimServer(SimNVML("a100-40g", state_path=None)) as srv:
        srv.inject("http_error", status=500, count=100)
        r = CliRunner().invoke(main, ["sweep", "--limits", "220,300", "--simulate", "--server", srv.url, "--trace",
                                      str(trace), "--out", str(tmp_path / "run"), "--idle-s", "0", "--interval", "0.5"])
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert "note: level 300: 3 of 3 requests failed (first: HTTP 500" in flat and "no J/token" in flat
    assert "no level gave a J/token figure" in flat


def test_a_trace_level_whose_requests_were_sent_late_says_its_traffic_was_not_the_traces(tmp_path, monkeypatch):
    # The sweep computed the lateness and printed nothing of it: a level replayed behind the trace's
    # pace (a busy client) stood beside the others as if it had served the same traffic.
    import time

    from powerprof.workload import replay as rp
    from powerprof.workload.trace import TraceRequest

    build = rp.prompt_text

    def busy(n, i):
        time.sleep(0.03)
        return build(n, i)

    monkeypatch.setattr(rp, "prompt_text", busy)
    _, outcome = _trace_sweep_with_a_fault(tmp_path, {}, [TraceRequest(0.0, 8, 8) for _ in range(10)])
    late = [n for n in outcome.notes if "requests were sent late" in n]
    assert [n.split(":")[0] for n in late] == ["level 400", "level 250"]
    assert "not comparable" in late[0] and "fix:" in late[0]
    # Ten requests a level: their p95 is no 95th percentile, said once for the levels it concerns.
    few = [n for n in outcome.notes if "p95 figures rest on 10 requests" in n]
    assert len(few) == 1 and few[0].startswith("level 400, level 250: ")


def test_replay_says_what_its_p95_rests_on_and_what_it_sent_for_zero_output_tokens(tmp_path):
    # Three requests printed a "p95" (the slowest one, interpolated) like any other; a request for 0
    # output tokens was silently sent asking for 1.
    from click.testing import CliRunner

    from powerprof.cli import main

    t = tmp_path / "t.jsonl"
    t.write_text('{"t_s": 0, "prompt_tokens": 8, "output_tokens": 0}\n{"t_s": 0.05, "prompt_tokens": 8, "output_tokens": 6}\n'
                 '{"t_s": 0.1, "prompt_tokens": 8, "output_tokens": 6}\n')
    r = CliRunner().invoke(main, ["replay", str(t), "--simulate", "--json"])
    assert r.exit_code == 0, r.output
    notes = json.loads(r.stdout)["notes"]
    assert any(n.startswith("1 of 3 requests ask for 0 output tokens: each is sent asking for 1") for n in notes), notes
    assert any(n.startswith("the p95 figures rest on 3 requests, fewer than 20") for n in notes), notes


def test_replay_says_when_the_server_cut_requests_short_of_the_traces_lengths(tmp_path):
    # llama.cpp stops a generation at its context: the request is ok with fewer tokens than the trace
    # asks for, and the replay reported the lighter traffic as the trace's.
    from powerprof.sim.nvml import SimNVML
    from powerprof.workload.replay import cut_short
    from powerprof.workload.trace import TraceRequest

    with SimServer(SimNVML("a100-40g", state_path=None), n_ctx=64, n_slots=1) as srv:
        _, recs = replay(srv.url, [TraceRequest(0.0, 8, 5), TraceRequest(0.1, 40, 50)])
    assert summarize(recs).ok == 2
    note = cut_short(recs)
    assert note.startswith("1 request was cut short by the server")
    assert "of the 50 tokens they ask for were generated" in note and "fix:" in note


def test_replay_says_prompts_of_0_or_1_tokens_were_sent_longer(tmp_path):
    # A prompt of 0 or 1 tokens was sent as about 2 (the BOS and the request's marker) without a word: the
    # prompt work served was more than the trace's, and the summary's prompt tokens disagreed with it silently.
    from click.testing import CliRunner

    from powerprof.cli import main
    from powerprof.workload.replay import trace_notes
    from powerprof.workload.trace import TraceRequest

    t = tmp_path / "t.jsonl"
    t.write_text('{"t_s": 0, "prompt_tokens": 0, "output_tokens": 4}\n{"t_s": 0.05, "prompt_tokens": 1, "output_tokens": 4}\n'
                 '{"t_s": 0.1, "prompt_tokens": 8, "output_tokens": 4}\n')
    r = CliRunner().invoke(main, ["replay", str(t), "--simulate", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    said = [n for n in doc["notes"] if "prompt of 0 or 1 tokens" in n]
    assert len(said) == 1 and said[0].startswith("2 of 3 requests have a prompt of 0 or 1 tokens: each is sent as about 2")
    assert doc["prompt_tokens"] > 0 + 1 + 8  # the server counted what was sent, as the note says
    r = CliRunner().invoke(main, ["replay", str(t), "--simulate"])
    assert "note: 2 of 3 requests have a prompt of 0 or 1 tokens" in r.output, r.output
    assert not [n for n in trace_notes([TraceRequest(0.0, 2, 4)]) if "prompt" in n]  # 2 tokens: sent as asked


def test_a_trace_sweep_says_prompts_of_0_or_1_tokens_were_sent_longer(tmp_path):
    from powerprof.workload.trace import TraceRequest

    _, outcome = _trace_sweep_with_a_fault(tmp_path, {}, [TraceRequest(0.0, 1, 4), TraceRequest(0.05, 8, 4)])
    said = [n for n in outcome.notes if "prompt of 0 or 1 tokens" in n]
    assert len(said) == 1 and said[0].startswith("1 of 2 requests have a prompt of 0 or 1 tokens"), outcome.notes


def test_a_gzip_trace_is_read_whatever_its_name(tmp_path):
    # A gzip file named .jsonl (or an Azure .csv.gz as downloaded) was "not a text trace (byte 1 is not UTF-8)":
    # true, but not what to do. It is read as its text.
    import gzip

    text = b'{"t_s": 3, "prompt_tokens": 5, "output_tokens": 3}\n{"t_s": 1, "prompt_tokens": 7, "output_tokens": 2}\n'
    (tmp_path / "t.jsonl").write_bytes(gzip.compress(text))
    assert read_trace(tmp_path / "t.jsonl") == read_trace(_plain(tmp_path, text))
    csv_text = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,10,20\n"
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(csv_text))
    assert [(r.prompt_tokens, r.output_tokens) for r in read_trace(tmp_path / "a.csv.gz")] == [(10, 20)]
    # Cut short (a download stopped): said, with the fix.
    (tmp_path / "cut.jsonl").write_bytes(gzip.compress(text)[:20])
    with pytest.raises(TraceError, match=r"cut\.jsonl: gzip-compressed, but .*download it again"):
        read_trace(tmp_path / "cut.jsonl")


def _plain(tmp_path, text: bytes):
    p = tmp_path / "plain.jsonl"
    p.write_bytes(text)
    return p


def test_an_azure_row_with_fields_missing_says_how_many(tmp_path):
    # It said "bad row (list index out of range)".
    p = tmp_path / "short.csv"
    p.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,5\n1,2\n")
    with pytest.raises(TraceError, match=r"short\.csv:3: bad row \(2 fields, the header names 3: .*GeneratedTokens"):
        read_trace(p)


def test_an_azure_csv_its_reader_cannot_parse_names_the_line_without_a_traceback(tmp_path):
    # csv's own error (a field over its 131,072-character limit) ended `replay` in a `_csv.Error` traceback.
    p = tmp_path / "odd.csv"
    p.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,5\n1,2," + b"9" * 140_000 + b"\n")
    with pytest.raises(TraceError, match=r"odd\.csv:3: not CSV the trace reader can read \(field larger than"):
        read_trace(p)


@pytest.mark.parametrize("line, missing", [
    # It said "not a trace record (KeyError: 'timestamp')": a field the message's own list did not name.
    ('{"foo": 1}', '"t_s" (or "timestamp"), "prompt_tokens", "output_tokens"'),
    ('{"t_s": 0, "prompt_tokens": 4}', '"output_tokens"'),
    ('{"timestamp": 0, "output_tokens": 4}', '"prompt_tokens"'),
    ('{"prompt_tokens": 4, "output_tokens": 5}', '"t_s" (or "timestamp")'),
])
def test_a_jsonl_record_without_a_field_names_the_fields_it_lacks(tmp_path, line, missing):
    p = tmp_path / "junk.jsonl"
    p.write_text('{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n' + line + "\n")
    with pytest.raises(TraceError) as e:
        read_trace(p)
    said = str(e.value)
    assert f"junk.jsonl:2: not a trace record: it has no {missing} (its fields: " in said, said
    assert "KeyError" not in said, said
    assert 'want {"t_s" (or "timestamp"), "prompt_tokens", "output_tokens"[, "tag"]}' in said, said


@pytest.mark.parametrize("line, said", [
    ("[1, 2, 3]", "a JSON array, not an object"),
    ("7", "a JSON number, not an object"),
    ('"x"', "a JSON string, not an object"),
])
def test_a_jsonl_line_that_is_no_object_says_what_it_is(tmp_path, line, said):
    # A list said "TypeError: list indices must be integers or slices, not str".
    p = tmp_path / "junk.jsonl"
    p.write_text('{"t_s": 0, "prompt_tokens": 4, "output_tokens": 5}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"junk\.jsonl:2: not a trace record: {said}"):
        read_trace(p)


def test_replay_to_a_server_that_does_not_answer_does_not_say_it_started(tmp_path):
    # It said "replaying 20 request(s) over 6.6 s" and then "no server answers": the server is found first.
    from support import free_port

    trace = tmp_path / "t.jsonl"
    write_jsonl(synthetic(6, 10.0, prompt_median=20, output_median=10, seed=1), trace)
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(trace), "--server",
                        f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "no server answers" in p.stderr, p.stderr
    assert "replaying" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "powerprof.cli", "replay", str(trace), "--simulate", "--time-scale", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stderr.startswith("replaying 6 request(s) over "), p.stderr


def test_a_synthetic_trace_says_what_a_4096_context_would_refuse_and_cuts_it_to_fit_when_asked(tmp_path):
    # The lengths' tails reach 4096 + 600 tokens: a replay against llama.cpp's -c 4096 ended "2 of 200 requests
    # failed: HTTP 400 ... exceeds the available context size", nothing said when the trace was made.
    from click.testing import CliRunner

    from powerprof.cli import main

    r = CliRunner().invoke(main, ["trace", str(tmp_path / "a.jsonl"), "--requests", "200", "--rate", "2", "--seed", "3"])
    assert r.exit_code == 0 and "2 request(s) need more than 4096 tokens of context" in r.output, r.output
    assert "--max-context" in r.output
    r = CliRunner().invoke(main, ["trace", str(tmp_path / "b.jsonl"), "--requests", "200", "--rate", "2", "--seed", "3",
                                  "--max-context", "4096"])
    assert r.exit_code == 0 and "need more" not in r.output, r.output
    cut, whole = read_trace(tmp_path / "b.jsonl"), read_trace(tmp_path / "a.jsonl")
    assert max(x.prompt_tokens + x.output_tokens for x in cut) <= 4096
    # Only the prompts of those that did not fit are cut: the arrivals and outputs are the same trace's.
    assert [(x.t_s, x.output_tokens) for x in cut] == [(x.t_s, x.output_tokens) for x in whole]
    assert sum(a.prompt_tokens != b.prompt_tokens for a, b in zip(cut, whole)) == 2
