"""`powerprof measure` on a server or GPU that is not its own alone: another client's requests on the server, or
another process's kernels on the GPU, for part of the run. Their windows are flagged foreign_traffic, left out of
every figure and their prompts measured again, so the printed J/token matches the simulator's truth over windows
that nothing else shared; a quiet server raises no flag; others at work throughout leave no figure and exit 1."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.rig import Rig
from support import busy_sim_server, true_window_energy_j
from powerprof.sim.nvml import SimNVML
from powerprof.workload.client import RequestParams
from powerprof.workload.load import Prompt


# The figure against the GPU's truth over the used windows (over the edges and tokens each was measured on:
# support.true_window_energy_j): what is checked is that no used window holds others' work (+7% and +14% when one
# did); the windows' own timing on a loaded host moves it by up to 1.3% (one full-suite run at load 10: 3.154
# against 3.194), which docs/benchmarks.md's loaded energy-window figures cover.
TRUTH_REL = 0.03


def _measure(rig, out, **kw):
    from powerprof.workload.measure import run_measure

    kw = dict(url=None, out_dir=out, prompts=[Prompt("p0", "hello there"), Prompt("p1", "tell me more")],
              n_requests=8, concurrencies=[1], params=RequestParams(max_tokens=96), warmup=1, interval_s=0.2) | kw
    return run_measure(rig, **kw)


def _during(sim_server, begin, until, after_requests=3, timeout_s=120.0):
    """A thread that calls begin() once the simulated server has taken `after_requests` requests (the warm-up and
    some measured ones), then it.stop() once until(it) or time_s ran out: others at work for part of the run."""
    state: dict = {}

    def run():
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end and not (sim_server and sim_server[0]._next_rid >= after_requests):
            time.sleep(0.01)
        it = state["it"] = begin()
        while time.monotonic() < t_end and not until(it):
            time.sleep(0.02)
        it.stop()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, state


def _overlaps(a0, a1, spans):
    return any(a0 < b1 and b0 < a1 for b0, b1 in spans)


def _used(res):
    """(row, record) of the windows the concurrency-1 figure comes from."""
    recs = {r.request_id: r for r in res.records}
    return [(row, recs[row["request_id"]]) for row in res.rows
            if row["window_kind"] == "request" and not row["warmup"] and row["status"] == "ok"
            and row["timing"] != "untrusted" and not row.get("foreign_traffic")]


def _truth_jpt(sim, pairs):
    """The GPU's true J/token over the windows the figure was measured on (their timing's edges and tokens)."""
    e = sum(true_window_energy_j(sim.gpus[0], rec) for _, rec in pairs)
    return e / sum(row["decode_tokens"] for row, _ in pairs)


def test_another_client_for_part_of_a_measure_is_flagged_left_out_and_measured_again(tmp_path, sim_server):
    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    with Rig("seed-16g", nvml=sim) as rig:
        th, state = _during(sim_server, lambda: rig.sim_bystander_client(sim_server[0].url, max_tokens=48),
                            lambda cl: cl.requests >= 2)
        res = _measure(rig, tmp_path / "m")
        th.join(60)
    cl = state["it"]
    assert cl.requests >= 1, cl.errors
    (s,) = res.summaries
    assert s.n_foreign >= 1 and s.n_trusted == 8, (s.n_foreign, s.n_trusted)  # measured again: 8 used, as asked
    w = pq.read_table(tmp_path / "m" / "windows.parquet").to_pandas()
    left = w[w.foreign_traffic.notna()]
    assert len(left) == s.n_foreign and left.gpu_j_per_token.isna().all() and (~left.warmup).all()
    assert left.foreign_traffic.str.contains("not powerprof's|more than powerprof").all(), left.foreign_traffic.tolist()
    # No used window shared the server with the other client, and the figure is the GPU's truth over them.
    used = _used(res)
    assert len(used) == 8
    for row, rec in used:
        assert not _overlaps(rec.t_send_ns, rec.t_end_ns, cl.intervals_ns), row["request_id"]
    assert s.gpu_j_per_token == pytest.approx(_truth_jpt(sim, used), rel=TRUTH_REL)
    said = [n for n in res.notes if n.startswith("others' work ran beside the measurement")]
    assert len(said) == 1 and "concurrency 1" in said[0] and "not its own" in said[0], said
    meta = json.loads((tmp_path / "m" / "run.json").read_text())
    ft = meta["foreign_traffic"]
    assert ft["concurrencies"][0]["concurrency"] == 1 and ft["concurrencies"][0]["windows"] == s.n_foreign
    assert ft["server_tokens"] > 0 and ft["concurrencies"][0]["budget_spent"] is False
    assert res.to_dict()["foreign_traffic"] == ft


@pytest.mark.parametrize("delivery", ["stream", "buffered"])
def test_another_process_working_on_the_gpu_during_a_measure_is_flagged_and_left_out(tmp_path, monkeypatch, sim_server,
                                                                                      delivery):
    # buffered: every window is timed by the server's own decode time (no stream to time it), as some are on a loaded
    # host (a client that read late): their edges are not the stream's first and last reads.
    import powerprof.rig as rigmod

    captured = rigmod.Rig.sim_server
    monkeypatch.setattr(rigmod.Rig, "sim_server", lambda self, **kw: captured(self, **kw | {"delivery": delivery}))
    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    with Rig("seed-16g", nvml=sim) as rig:
        t0 = []
        th, state = _during(sim_server, lambda: (t0.append(time.monotonic()), rig.sim_bystander_gpu(0, power_w=60.0, share=0.3))[1],
                            lambda by: time.monotonic() - t0[0] > 2.5)
        res = _measure(rig, tmp_path / "m", concurrencies=[1, 2], n_requests=6)
        th.join(60)
    by = state["it"]
    s1 = res.summaries[0]
    assert s1.concurrency == 1 and s1.n_foreign >= 1 and s1.n_trusted == 6, (s1.n_foreign, s1.n_trusted)
    left = [r for r in res.rows if r.get("foreign_traffic")]
    assert left and all("ran kernels on GPU 0" in r["foreign_traffic"] for r in left), [r["foreign_traffic"] for r in left]
    spans = [tuple(x) for x in by.active_ns]
    for row, rec in _used(res):
        if rec.concurrency == 1:
            assert not _overlaps(rec.timing.t0_ns, rec.timing.t1_ns, spans), row["request_id"]
    assert s1.gpu_j_per_token == pytest.approx(_truth_jpt(sim, [p for p in _used(res) if p[1].concurrency == 1]), rel=TRUTH_REL)
    assert any(n.startswith("others' work ran beside the measurement") and f"process(es) {by.pid}" in n for n in res.notes), res.notes


@pytest.mark.parametrize("hide", ["nothing", "metrics+slots"])
def test_a_quiet_server_raises_no_flag(tmp_path, monkeypatch, hide):
    import powerprof.rig as rigmod

    real = rigmod.Rig.sim_server

    def server(self, **kw):  # llama.cpp without --metrics and with --no-slots: nothing shows other clients
        srv = real(self, **kw)
        srv.serve_metrics = srv.serve_slots = hide == "nothing"
        return srv

    monkeypatch.setattr(rigmod.Rig, "sim_server", server)
    with Rig("seed-16g", nvml=SimNVML("seed-16g", state_path=None)) as rig:
        res = _measure(rig, tmp_path / "m", concurrencies=[1, 2], n_requests=4, params=RequestParams(max_tokens=32))
    assert all(s.n_foreign == 0 for s in res.summaries), res.summaries
    # No foreign flag is the point. A figure may still go for another reason, said: on a host loaded past its cores
    # (load 8-11 on 2 cores: 13 of 40 runs) a concurrency-2 batch whose client read one stream late is untrusted
    # timing, both its windows left out (workload/rows.batch_row), never a foreign flag.
    s1 = next(s for s in res.summaries if s.concurrency == 1)
    assert s1.gpu_j_per_token is not None, res.summaries
    for s in res.summaries:
        if s.gpu_j_per_token is None:
            assert any(n.startswith(f"concurrency {s.concurrency}: no J/token figure: all") and "untrusted" in n
                       for n in res.notes), res.notes
    assert not any(r.get("foreign_traffic") for r in res.rows)
    assert res.foreign_traffic is None and json.loads((tmp_path / "m" / "run.json").read_text())["foreign_traffic"] is None
    said = [n for n in res.notes if n.startswith("other clients of the server")]
    if hide == "nothing":
        assert said == [], said
    else:
        assert len(said) == 1 and "cannot be ruled out" in said[0], res.notes


def test_others_at_work_throughout_leave_no_figure_and_measure_exits_1(tmp_path, monkeypatch):
    from powerprof.cli import main

    busy_sim_server(monkeypatch)  # another client on the server from its start to the end of the run
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "2", "--max-tokens", "48",
                                  "--warmup", "0", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "no window ran without others' work beside it" in r.output and "fix:" in r.output, r.output
    ft = json.loads((out / "run.json").read_text())["foreign_traffic"]
    # Sent again up to as many requests as asked for, then left out: no figure rests on a shared window.
    assert ft["concurrencies"][0]["budget_spent"] is True and ft["concurrencies"][0]["requests_sent_again"] == 2
    w = pq.read_table(out / "windows.parquet").to_pandas()
    assert w.foreign_traffic.notna().all() and w.gpu_j_per_token.isna().all()


def test_a_request_retried_inside_a_batch_sent_again_counts_once_towards_the_budget(tmp_path, monkeypatch):
    # The budget for sending batches again is in requests (as many again as asked for), not attempts: a request that
    # failed once and then answered, in a batch others' work ran beside, is one request sent again, not two. Counted
    # as two, the budget ran out a batch early and run.json said 2 sent again where 1 was.
    from dataclasses import replace

    import powerprof.workload.load as loadmod
    from powerprof.cli import main

    busy_sim_server(monkeypatch)
    real, failed = loadmod.send_request, []

    async def once_failing(*a, **kw):
        rec = await real(*a, **kw)
        if not kw.get("warmup") and not failed:
            failed.append(rec.request_id)
            return replace(rec, status="error", error="HTTP 500: injected", http_status=500)
        return rec

    monkeypatch.setattr(loadmod, "send_request", once_failing)
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "2", "--max-tokens", "48",
                                  "--warmup", "0", "--out", str(out)])
    assert r.exit_code == 1, r.output
    ft = json.loads((out / "run.json").read_text())["foreign_traffic"]["concurrencies"][0]
    w = pq.read_table(out / "windows.parquet").to_pandas()
    measured = w[~w.warmup]
    assert failed and (measured.request_id == failed[0]).sum() == 2, measured[["request_id", "attempt"]]  # retried once
    # 2 asked for, 2 sent again: 4 requests, 5 attempts; the budget spent only once the 4th was others' too.
    assert measured.request_id.nunique() == 4 and ft["requests_sent_again"] == 2 and ft["budget_spent"] is True, (
        measured[["request_id", "attempt", "batch_id"]], ft)
