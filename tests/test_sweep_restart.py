"""A sweep whose inference server restarts mid-level (systemd after an OOM, a vLLM engine restarted): the
level is measured again from scratch once the same server is back, flagged, and its figures match the
simulator's ground truth as the other levels' do; a server back with other slots, or never back, stops
the sweep with the finished levels kept and the limit restored."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sweep import UI, SweepError, run_sweep
from powerprof.workload.client import RequestParams
from support import true_window_energy_j


class _Hook(UI):
    """A sweep UI that runs `act(visit)` after each batch and keeps what the sweep said."""

    def __init__(self, act):
        self.act = act
        self.notes: list[str] = []

    def level_progress(self, visit, live):
        self.act(visit)

    def note(self, text):
        self.notes.append(text)


def _once_at_level_200(sim_server, fault):
    """`fault(server)` once, when level 200 has measured two requests."""
    done = []

    def act(visit):
        if visit.level_value == 200 and visit.n_measured == 2 and not done:
            done.append(fault(sim_server[0]))

    return act


def _sweep(rig, out, ui, **kw):
    # ~3 s windows (256 tokens), as tests/test_sweep_e2e.py: arrival jitter on a loaded machine stays small.
    kw = dict(levels_spec="300,200", out_dir=out, params=RequestParams(max_tokens=256), idle_s=0, interval_s=0.2,
              min_requests=4, max_requests=4, warmup_requests=1, ui=ui) | kw
    return run_sweep(rig, **kw)


def test_a_server_that_restarts_mid_level_is_waited_for_and_the_level_measured_again_to_ground_truth(tmp_path, sim_server):
    # Before: the requests failed 3 times and the hour-long sweep stopped at the first restart of its server.
    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    out = tmp_path / "run"
    # Down 1.5 s (connections refused), then 0.5 s loading its model (503), as llama-server under systemd.
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(1.5, loading_s=0.5)))
    with Rig("seed-16g", nvml=sim) as rig:
        outcome = _sweep(rig, out, ui)
    assert sim.gpus[0].limit_w == 300.0
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert "server-restarted" in levels.loc[200.0, "flags"].split(","), levels.loc[200.0, "flags"]
    assert "server-restarted" not in (levels.loc[300.0, "flags"] or "")
    assert "interrupted" not in (levels.loc[200.0, "flags"] or "")

    meta = json.loads((out / "run.json").read_text())
    (restart,) = meta["server_restarts"]
    assert restart["level_value"] == 200.0 and restart["down_s"] >= 1.5, restart
    assert [200.0, 0] in meta["levels_done"]
    said = [n for n in outcome.notes if n.startswith("the server restarted at level 200 W")]
    assert len(said) == 1 and "measured again from scratch" in said[0], outcome.notes
    assert any("waiting up to 120 s" in n for n in ui.notes), ui.notes

    w = pq.read_table(out / "windows.parquet").to_pandas()
    at200 = w[(w.level_value == 200.0) & (w.window_kind == "request") & ~w.warmup]
    before = at200[at200.timing == "untrusted"]
    assert len(before) == 2, at200[["request_id", "status", "timing", "timing_reason"]]
    # The whole round of prompts again, not the 2 before plus 2 after.
    assert ((at200.status == "ok") & (at200.timing != "untrusted")).sum() == 4
    assert before.timing_reason.str.contains("measured before the server restarted mid-level").all()
    assert before.gpu_j_per_token.isna().all()
    assert not w[w.window_kind == "request"].duplicated(["request_id", "attempt"]).any()  # attempts after it numbered on
    # Every counted window of the restarted level lies after the server was healthy again.
    t_restart_ns, _ = sim_server[0].restarts[0]
    counted = {r["request_id"] for r in outcome.sweep.rows if outcome.sweep._counts(r)}
    recs = {rec.request_id: (v, rec) for v, rec in outcome.sweep.records if rec.request_id in counted}
    assert all(rec.t_first_ns > t_restart_ns + 1.5e9 for v, rec in recs.values() if v == 200.0)

    # The figures against the simulator's true energy over each window, as for an undisturbed sweep.
    g = sim.gpus[0]
    rows = {r["request_id"]: r for r in outcome.sweep.rows if r["request_id"] in counted and r["window_kind"] == "request"}
    for value in (300.0, 200.0):
        pairs = [(rows[i]["gpu_j_per_token"], true_window_energy_j(g, rec) / rows[i]["decode_tokens"])
                 for i, (v, rec) in recs.items() if v == value]
        assert len(pairs) == 4, value
        measured, truth = np.median([m for m, _ in pairs]), np.median([t for _, t in pairs])
        assert measured == pytest.approx(truth, rel=0.01), value
        assert levels.loc[value, "gpu_j_per_token"] == pytest.approx(measured, rel=1e-9)


def test_a_server_restart_ridden_out_is_looked_at_under_load_again(tmp_path, sim_server, monkeypatch):
    from powerprof.workload import placement

    # The look under load ran once per sweep: a server restarted mid-sweep (placed otherwise, perhaps: a small model
    # on another GPU) was never looked at under load. Every batch is looked at now; the restart makes the next look a
    # full one (rearm: no cheap path on the restarted server's first batch).
    events: list = []
    real, real_rearm = placement.LookUnderLoad.__call__, placement.LookUnderLoad.rearm

    def spy(self, *a, **k):
        events.append(("look", self._settled is None))
        return real(self, *a, **k)

    def rearm(self):
        events.append("rearm")
        real_rearm(self)

    monkeypatch.setattr(placement.LookUnderLoad, "__call__", spy)
    monkeypatch.setattr(placement.LookUnderLoad, "rearm", rearm)
    sim = SimNVML("seed-16g", state_path=None)
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(0.5, loading_s=0.2)))
    with Rig("seed-16g", nvml=sim) as rig:
        _sweep(rig, tmp_path / "run", ui, params=RequestParams(max_tokens=32))
    assert sim.gpus[0].limit_w == 300.0
    # Looked at from the first batch on, and in full at the first batch after the restart.
    assert events[0] == ("look", True) and events.count("rearm") == 1, events
    k = events.index("rearm")
    assert events[k + 1] == ("look", True) and len(events) > 3, events


def test_a_server_that_comes_back_with_other_slots_stops_the_sweep_with_the_finished_levels_kept(tmp_path, sim_server):
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(0.5, n_slots=1)))
    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError) as e:
        _sweep(rig, out, ui, params=RequestParams(max_tokens=32))
    msg = str(e.value)
    assert msg.startswith("level 200: the server came back after"), msg
    # The same -c over one slot instead of four: each slot's context grew too, as llama-server's would.
    assert "not as the same server (total_slots 4 → 1; n_ctx 4096 → 16384)" in msg and "would not be comparable" in msg, msg
    assert sim.gpus[0].limit_w == 300.0
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert not levels.loc[300.0, "flags"] or "interrupted" not in levels.loc[300.0, "flags"]
    assert np.isfinite(levels.loc[300.0, "gpu_j_per_token"])
    assert json.loads((out / "run.json").read_text())["levels_done"] == [[300.0, 0]]


def test_a_server_that_never_comes_back_stops_the_sweep_within_the_wait_with_the_limit_restored(tmp_path, sim_server):
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(3600)))
    t0 = time.monotonic()
    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError) as e:
        _sweep(rig, out, ui, params=RequestParams(max_tokens=32), server_restart_wait_s=2)
    waited_s = time.monotonic() - t0
    msg = str(e.value)
    # The stream or kept-alive connection the restart cut, or the connection refused after it, whichever came first.
    assert re.match(r"level 200: the server stopped answering \((connection refused|server closed the stream|connection lost)",
                    msg), msg
    assert "not healthy again within 2 s" in msg and "--server-restart-wait" in msg, msg
    assert waited_s < 60  # the level before it, then a 2 s wait: not the default 120 s
    assert sim.gpus[0].limit_w == 300.0
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert "interrupted" in levels.loc[200.0, "flags"].split(",")
    assert np.isfinite(levels.loc[300.0, "gpu_j_per_token"])


def test_a_wait_of_0_stops_at_once_as_before(tmp_path, sim_server):
    sim = SimNVML("seed-16g", state_path=None)
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(1.0)))
    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError, match="level 200: .*failed 3 times"):
        _sweep(rig, tmp_path / "run", ui, params=RequestParams(max_tokens=32), server_restart_wait_s=0)
    assert sim.gpus[0].limit_w == 300.0
    assert not any("waiting up to" in n for n in ui.notes)


@pytest.mark.parametrize("extra, said", [
    (["--server", "http://127.0.0.1:9", "--launch", "llama-server -m m.gguf"], "not used with --launch"),
    (["--trace", "t.jsonl"], "not used with --trace"),
    (["--server-restart-wait", "-1"], "--server-restart-wait"),
])
def test_server_restart_wait_where_it_cannot_apply_is_a_usage_error(extra, said):
    from click.testing import CliRunner

    from powerprof.cli import main

    args = ["sweep", "--simulate", "--limits", "300", "--server-restart-wait", "5", *extra]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 2 and said in r.output, r.output


def test_a_restart_quicker_than_the_retries_still_has_the_level_measured_again(tmp_path, sim_server):
    # Down 50 ms: the batch's streams were cut and their retries answered by the restarted server, cold. Without
    # the ride-out those retries were counted beside the windows measured before, as one undisturbed level.
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    done = []

    def act(visit):
        if visit.level_value == 200 and visit.n_measured == 1 and not done:
            done.append(sim_server[0].restart(0.05))

    with Rig("seed-16g", nvml=sim) as rig:
        outcome = _sweep(rig, out, _Hook(act), params=RequestParams(max_tokens=48), concurrency=2, min_requests=8,
                         max_requests=8)
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert "server-restarted" in levels.loc[200.0, "flags"].split(",")
    (restart,) = json.loads((out / "run.json").read_text())["server_restarts"]
    assert restart["down_s"] < 5, restart
    w = pq.read_table(out / "windows.parquet").to_pandas()
    b = w[(w.level_value == 200.0) & (w.window_kind == "batch")]
    kept = [r for r in outcome.sweep.rows if r["level_value"] == 200.0 and outcome.sweep._counts(r)]
    assert (b.timing == "untrusted").sum() >= 1  # what came before the cut left out
    failed = w[(w.level_value == 200.0) & (w.status == "failed")]
    # Each a sign of the server away (client.server_away): a connect that met the closing listener reads "could not
    # connect: [Errno 104]" (2 runs in 11 on a loaded host), one that found none "connection refused".
    away = r"connection lost|server closed the stream|connection refused|could not connect"
    assert len(failed) >= 1 and failed.error.str.match(away).all(), failed.error.tolist()
    assert min(r["batch_id"] for r in kept) > failed.batch_id.max()  # every counted batch was sent after the cut
    # A whole round measured after it (4 batches of 2). On a loaded host one of them may be left out for its own timing
    # (a starved client read its stream in bursts: 4 runs in 16 beside other tests), said so: never for the restart.
    after = b[(b.batch_id > failed.batch_id.max()) & ~b.warmup & (b.status == "ok")]
    assert len(after) == 4 and len(kept) >= 3, after[["batch_id", "timing", "timing_reason"]]
    assert not after.timing_reason.fillna("").str.contains("restarted").any(), after.timing_reason.tolist()


def _restart_begun(srv, down_s, loading_s):
    """srv.restart(...), returning once the old process is gone: the restart runs on the server's own thread, and on
    a loaded machine it could otherwise begin after the baseline window it is meant to fall in."""
    srv.restart(down_s, loading_s=loading_s)
    deadline = time.monotonic() + 10
    while not srv._dead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv._dead, "the simulated server did not begin its restart"


class _AtIdle(UI):
    """A sweep UI that runs `act()` as the (first) idle baseline begins and keeps what the sweep said."""

    def __init__(self, act):
        self.act = act
        self.notes: list[str] = []
        self.idles = 0

    def idle(self, seconds):
        self.idles += 1
        if self.idles == 1:
            self.act()

    def note(self, text):
        self.notes.append(text)


def test_a_restart_during_the_idle_baseline_is_seen_and_the_baseline_taken_again(tmp_path, sim_server):
    # Before: nothing watched the server while the GPU idled, and the model's reload (1.5 s working the GPU) went
    # into idle_gpu_power_w, which every above-idle J/token subtracts and the report draws.
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _AtIdle(lambda: _restart_begun(sim_server[0], 0.5, loading_s=1.5))
    with Rig("seed-16g", nvml=sim) as rig:
        outcome = _sweep(rig, out, ui, levels_spec="300", idle_s=4, params=RequestParams(max_tokens=32))
    idle_w = sim.gpus[0].profile.idle_power_w
    meta = json.loads((out / "run.json").read_text())
    assert meta["idle_gpu_power_w"] == pytest.approx(idle_w, rel=0.03), meta["idle_gpu_power_w"]
    assert ui.idles == 2  # taken again
    (away,) = meta["server_restarts"]
    assert away["stage"] == "idle-baseline" and away["level_value"] is None and away["down_s"] >= 0.5, away
    said = [n for n in outcome.notes if "during the idle baseline" in n]
    assert len(said) == 1 and "taken again" in said[0], outcome.notes
    assert any(n.startswith("the idle baseline: the server stopped answering") for n in ui.notes), ui.notes
    levels = pq.read_table(out / "levels.parquet").to_pandas()
    assert not any(f for f in levels["flags"].fillna("") if "server-" in f)  # no level was touched


def test_a_restart_during_the_idle_baseline_not_waited_for_leaves_no_baseline_and_says_why(tmp_path, sim_server):
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _AtIdle(lambda: _restart_begun(sim_server[0], 0.5, loading_s=1.5))
    with Rig("seed-16g", nvml=sim) as rig:
        outcome = _sweep(rig, out, ui, levels_spec="300", idle_s=4, params=RequestParams(max_tokens=32),
                         server_restart_wait_s=0)
    meta = json.loads((out / "run.json").read_text())
    assert meta["idle_gpu_power_w"] is None
    assert meta["idle_baseline_note"].startswith("no idle baseline: the server stopped answering during it")
    assert "--server-restart-wait" in meta["idle_baseline_note"]
    assert meta["idle_baseline_note"] in outcome.notes
    w = pq.read_table(out / "windows.parquet").to_pandas()
    assert w.above_idle_gpu_j_per_token.isna().all() and w.idle_gpu_power_w.isna().all()
    assert w[(w.window_kind == "request") & ~w.warmup].gpu_j_per_token.notna().all()  # the level itself is fine


def test_a_connection_reset_without_a_restart_is_not_called_a_restart(tmp_path, sim_server):
    # Before: a stream cut by a dropped connection (a proxy, a NAT) read "the server restarted at level 200 W" and
    # the level was flagged server-restarted, though the server ran on throughout (its counters kept counting).
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.reset_connections(after_s=0.3)))
    with Rig("seed-16g", nvml=sim) as rig:
        # ~0.8 s streams (no energy is checked here, so not the ~3 s windows): the cut 0.3 s on lands mid-stream.
        outcome = _sweep(rig, out, ui, params=RequestParams(max_tokens=64))
    assert not sim_server[0].restarts
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    flags = levels.loc[200.0, "flags"].split(",")
    assert "server-away" in flags and "server-restarted" not in flags, flags
    (away,) = json.loads((out / "run.json").read_text())["server_restarts"]
    assert away["restarted"] is None and away["level_value"] == 200.0, away
    said = [n for n in outcome.notes if "level 200 W" in n and "measured again" in n]
    assert len(said) == 1 and said[0].startswith("the server stopped answering at level 200 W (whether it restarted is unknown"), outcome.notes
    assert not any("server restarted" in n for n in outcome.notes + ui.notes), outcome.notes + ui.notes
    assert any("answers again after" in n for n in ui.notes), ui.notes
    w = pq.read_table(out / "windows.parquet").to_pandas()
    left = w[(w.level_value == 200.0) & (w.timing == "untrusted")]
    assert len(left) >= 1 and left.timing_reason.str.contains("before the server stopped answering mid-level").all()


def test_a_restart_is_told_by_the_servers_counters(tmp_path, sim_server):
    # llama.cpp shows no start time; its /metrics counters start again from zero in a new process.
    sim = SimNVML("seed-16g", state_path=None)
    out = tmp_path / "run"
    ui = _Hook(_once_at_level_200(sim_server, lambda srv: srv.restart(0.5)))
    with Rig("seed-16g", nvml=sim) as rig:
        outcome = _sweep(rig, out, ui, params=RequestParams(max_tokens=32))
    (r,) = json.loads((out / "run.json").read_text())["server_restarts"]
    assert r["restarted"] is True and "llamacpp:tokens_predicted" in r["evidence"] and "fell" in r["evidence"], r
    said = [n for n in outcome.notes if n.startswith("the server restarted at level 200 W (its counter")]
    assert len(said) == 1, outcome.notes


def test_a_trace_sweep_says_the_server_went_away_during_a_levels_replay(tmp_path, sim_server, monkeypatch):
    # Before: "... fix: ... timeouts or HTTP 429/503 only here: the server cannot serve this traffic at this
    # setting": a server that had restarted read as one the setting was too low for.
    import asyncio

    import powerprof.workload.replay as rp
    from powerprof.workload.trace import TraceRequest

    real_send, done = rp.send_request, []

    async def send(*a, **k):
        if k["request_id"] == 3 and not done:
            done.append(sim_server[0].restart(0.4))
            await asyncio.sleep(0.1)
        return await real_send(*a, **k)

    monkeypatch.setattr(rp, "send_request", send)
    sim = SimNVML("seed-16g", state_path=None)
    trace = [TraceRequest(0.25 * i, 16, 8) for i in range(8)]
    with Rig("seed-16g", nvml=sim) as rig:
        outcome = run_sweep(rig, levels_spec="300", out_dir=tmp_path / "run", idle_s=0, interval_s=0.2, trace=trace,
                            ui=UI())
    said = [n for n in outcome.notes if "the server stopped answering during the replay" in n]
    assert len(said) == 1 and said[0].startswith("level 300") and "does not ride out" in said[0], outcome.notes
    assert "cannot serve this traffic" not in said[0]
    assert sim.gpus[0].limit_w == 300.0


def test_a_restarted_server_on_an_unmeasured_gpu_stops_the_sweep_at_that_level_with_the_finished_levels_kept(
        tmp_path, sim_server):
    import os

    from powerprof.sweep import PlacementStop

    # The server measured on GPU 1 restarts at level 200 and comes back working GPU 0 too (8 GiB, busy): the re-armed
    # look stops the sweep. Its words were fixed when the look was made: "the sweep stopped at its first level, none of
    # it kept", though level 250 had finished and was kept.
    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")

    def restart(srv):
        sim.add_process(0, os.getpid(), 8 << 30, lambda: 1.0)
        return srv.restart(0.5, loading_s=0.2)

    ui = _Hook(_once_at_level_200(sim_server, restart))
    out = tmp_path / "run"
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig, pytest.raises(PlacementStop) as e:
        _sweep(rig, out, ui, levels_spec="250,200", params=RequestParams(max_tokens=32))
    said = str(e.value)
    assert e.value.exit_code == 2
    assert f"the server also runs on GPU 0 ({sim.gpus[0].uuid}), which is not measured" in said, said
    assert ("the sweep stopped at level 200 W, after its server restarted: none of that level kept, the finished "
            "level (250 W) kept") in said, said
    assert "its first level" not in said, said
    # Every limit back, as the simulator's persisted state says.
    assert [g.limit_w for g in SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json").gpus] == [300.0, 300.0]
    assert json.loads((out / "run.json").read_text())["levels_done"] == [[250.0, 0]]
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert np.isfinite(levels.loc[250.0, "gpu_j_per_token"])
