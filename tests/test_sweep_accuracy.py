"""`powerprof sweep` end to end on the simulator: accuracy against ground truth and the seed's figures,
from one sweep over the seed card's levels, and the files users open from it.

Its own file (split from test_sweep_e2e.py) so the README's `--dist loadfile` run puts this ~70 s
sweep and that file's ~100 s of crash-safety sweeps on different workers. The two buffering-hop sweeps (~35 s each)
run side by side in processes of their own after it: the file ~145 s on 2 cores at load ~10-16, not ~160 s."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sweep import run_sweep as _run_sweep
from powerprof.workload.client import RequestParams
from support import side_by_side, true_window_energy_j


@pytest.fixture(scope="module")
def seed_sweep(tmp_path_factory):
    """One sweep over the seed card's levels, shared by the accuracy tests (it takes ~60 s)."""
    state = tmp_path_factory.mktemp("state")
    import powerprof.sim.server as sim_server

    servers = []

    class RecordingSimServer(sim_server.SimServer):
        """The sweep's own simulated server, kept so tests can read its true emission times."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            servers.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POWERPROF_SIM_STATE", str(state / "sim.json"))
        mp.setenv("POWERPROF_STATE_DIR", str(state / "pp"))
        mp.setenv("XDG_STATE_HOME", str(state))
        mp.setattr(sim_server, "SimServer", RecordingSimServer)
        sim, outcome = _run_seed_sweep(tmp_path_factory, state)
    (server,) = servers
    return sim, outcome, server


def run_sweep(*, sim, **kw):
    """A sweep through the door on the simulated GPU `sim` (a SimNVML the test can inspect)."""
    with Rig(sim.profile.key, nvml=sim) as rig:
        return _run_sweep(rig, **kw)


def _run_seed_sweep(tmp_path_factory, state):
    sim = SimNVML("seed-16g", record_history=True, state_path=state / "sim.json")
    out = tmp_path_factory.mktemp("run") / "run"
    outcome = run_sweep(
        levels_spec="180,220,260,300",
        sim=sim,
        out_dir=out,
        params=RequestParams(max_tokens=256),  # ~3 s windows: arrival jitter on a loaded machine stays small
        idle_s=1.0,
        interval_s=0.5,
        min_requests=4,  # one round of the 4 built-in prompts: every level sends the same ones
        max_requests=4,
        warmup_requests=1,
    )
    return sim, outcome


def _measured(windows):
    return windows[(windows.window_kind == "request") & (~windows.warmup) & (windows.status == "ok")]


def test_j_per_token_within_1pct_of_ground_truth(seed_sweep):
    sim, outcome, server = seed_sweep
    g = sim.gpus[0]
    w = outcome.sweep.rows
    recs = [r for r in w if r["window_kind"] == "request" and not r["warmup"] and r["status"] == "ok"]
    assert len(recs) == 16
    # Ground truth: the simulator's true energy over each window, from its monotonic timestamps.
    rows = {r["request_id"]: r for r in recs}
    by_level: dict[float, list[tuple[float, float]]] = {}
    for value, rec in outcome.sweep.records:
        if rec.request_id not in rows:
            continue
        row = rows[rec.request_id]
        by_level.setdefault(value, []).append((row["gpu_j_per_token"], true_window_energy_j(g, rec) / row["decode_tokens"]))
    levels = pq.read_table(outcome.run_dir / "levels.parquet").to_pandas().set_index("level_value")
    for value, pairs in by_level.items():
        measured = np.median([m for m, _ in pairs])
        truth = np.median([t for _, t in pairs])
        assert measured == pytest.approx(truth, rel=0.01), value
        assert levels.loc[value, "gpu_j_per_token"] == pytest.approx(measured, rel=1e-9)


def _true_decode_rates(server, outcome) -> dict[float, list[float]]:
    """Per measured request, decode tok/s from the simulated server's own emission times.

    Requests run one at a time, so each client record belongs to the last request whose first
    token the server emitted before the client received it."""
    starts = sorted((t["emissions"][0][0], t) for t in server.truth if len(t["emissions"]) > 1)
    t0s = np.array([s for s, _ in starts])
    measured = {r["request_id"] for r in outcome.sweep.rows if r["window_kind"] == "request" and not r["warmup"] and r["status"] == "ok"}
    rates: dict[float, list[float]] = {}
    for value, rec in outcome.sweep.records:
        if rec.request_id not in measured:
            continue
        em = starts[int(np.searchsorted(t0s, rec.t_first_ns, side="right")) - 1][1]["emissions"]
        rates.setdefault(value, []).append(sum(n for _, n in em[1:]) / ((em[-1][0] - em[0][0]) / 1e9))
    return rates


def test_speed_loss_within_1pp_of_truth_and_the_seed_figures(seed_sweep):
    sim, outcome, server = seed_sweep
    levels = pq.read_table(outcome.run_dir / "levels.parquet").to_pandas().set_index("level_value")
    assert bool(levels.loc[300.0, "reference"])  # the default limit was measured: it is the reference
    # Truth is what the simulated GPU did: the server's emission times, with the same estimator
    # (median decode tok/s per level). Comparing against the steady-state model instead would
    # also charge the measurement for the CI machine's stalls of the simulator itself.
    rates = _true_decode_rates(server, outcome)
    assert {v: len(r) for v, r in rates.items()} == {180.0: 4, 220.0: 4, 260.0: 4, 300.0: 4}
    truth_ref = np.median(rates[300.0])
    for value in (180.0, 220.0, 260.0):
        truth_loss_pct = 100 * (1 - np.median(rates[value]) / truth_ref)
        assert abs(levels.loc[value, "speed_loss_pct"] - truth_loss_pct) < 1.0, value
    # The simulator itself follows its DVFS model (a looser bound: host stalls over 1 s restart
    # its step schedule).
    g = sim.gpus[0]
    c = g.profile.workload.decode_compute_share
    model_sf = {}
    for value in (180.0, 220.0, 260.0, 300.0):
        g.set_limit_w(value)
        model_sf[value] = g.speed_factor(c)
    g.set_limit_w(300)
    for value in (180.0, 220.0, 260.0):
        model_loss_pct = 100 * (1 - model_sf[value] / model_sf[300.0])
        assert abs(100 * (1 - np.median(rates[value]) / truth_ref) - model_loss_pct) < 1.5, value
    # Seed 000: 220 W about 7% slower and about 14% less energy per token than 300 W.
    assert 5.0 < levels.loc[220.0, "speed_loss_pct"] < 9.0
    assert 12.0 < levels.loc[220.0, "energy_saving_pct"] < 17.0
    assert levels.loc[180.0, "speed_loss_pct"] > 10.0
    # At 300 W the card draws ~275 W and the driver never caps it: the level is flagged.
    assert bool(levels.loc[300.0, "cap_not_engaged"])
    assert not bool(levels.loc[220.0, "cap_not_engaged"])


def test_sweet_spot_under_a_10pct_budget_is_220w(seed_sweep):
    from powerprof.analysis.report import analyze_run

    _, outcome, _ = seed_sweep
    result = analyze_run([outcome.run_dir], out_dir=outcome.run_dir / "analysis-test", max_slowdown=0.10, n_boot=500)
    budget = result.main.choices["budget"]
    assert budget.level_value == 220.0
    assert (outcome.run_dir / "analysis-test" / "report.html").exists()


def test_run_directory_opens_as_is_in_pyarrow_pandas_and_duckdb(seed_sweep):
    import duckdb
    import pandas as pd

    _, outcome, _ = seed_sweep
    run = outcome.run_dir
    meta = json.loads((run / "run.json").read_text())
    assert meta["simulated"] is True and meta["gpus"][0]["default_limit_w"] == 300.0
    # Every visit finished is listed: `analyze` says which levels a stopped run was still measuring.
    assert sorted(map(tuple, meta["levels_done"])) == [(180.0, 0), (220.0, 0), (260.0, 0), (300.0, 0)]
    for name in ("samples", "windows", "levels"):
        t = pq.read_table(run / f"{name}.parquet")
        assert t.num_rows > 0
        assert b"powerprof" in t.schema.metadata
        assert len(pd.read_parquet(run / f"{name}.parquet")) == t.num_rows
        n = duckdb.sql(f"select count(*) from read_parquet('{run / f'{name}.parquet'}')").fetchall()[0][0]
        assert n == t.num_rows
    samples = pq.read_table(run / "samples.parquet").to_pandas()
    # Samples carry the level in force, so a spreadsheet can pivot power and clocks by level.
    gpu = samples[samples.source == "nvml"]
    assert set(gpu.level_value.dropna()) == {180.0, 220.0, 260.0, 300.0}
    assert gpu[gpu.level_value == 180.0].power_w.max() <= 180.0 + 1e-6
    # After the sweep the card is back at its original limit.
    assert gpu.sort_values("t_mono_s").power_limit_w.iloc[-1] == 300.0


# The hops' bursts: nginx's 4 kB proxy buffer, a gateway flushing on a timer.
BURSTS = {"every-4kB": {"burst_bytes": 4096}, "every-0.7s": {"burst_bytes": None, "burst_every_s": 0.7}}


def _buffered_sweep(burst: dict, out_dir) -> dict:
    """One sweep of the seed card behind a hop delivering in `burst`s, in a process of its own (side_by_side); what
    the test checks, as plain data: each measured window's row, its request's truth, the run's notes, the levels."""
    import os

    import powerprof.rig as rigmod

    # A state of its own, as tests/conftest.py's _isolated_state gives each test (a module's fixture starts this
    # process before any test's is set): the two sweeps' restore files and locks on GPU 0 must not meet.
    state = out_dir.parent / "state"
    state.mkdir()
    os.environ.update(XDG_STATE_HOME=str(state), POWERPROF_SIM_STATE=str(state / "sim-state.json"),
                      POWERPROF_STATE_DIR=str(state / "powerprof"))
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    servers = []
    real = rigmod.Rig.sim_server

    def buffered(self, **kw):
        srv = real(self, **kw)
        srv.delivery = "bursts"
        srv.burst_bytes, srv.burst_every_s = burst.get("burst_bytes"), burst.get("burst_every_s")
        servers.append(srv)
        return srv

    rigmod.Rig.sim_server = buffered  # this process is the sweep's own: nothing else runs in it
    sim = SimNVML("seed-16g", record_history=True, state_path=None)
    outcome = run_sweep(levels_spec="300,200", sim=sim, out_dir=out_dir, params=RequestParams(max_tokens=256),
                        idle_s=0.5, interval_s=0.5, min_requests=4, max_requests=4, warmup_requests=1)
    (server,) = servers
    g = sim.gpus[0]
    windows = pq.read_table(outcome.run_dir / "windows.parquet").to_pandas()
    rows = {r["request_id"]: r for r in _measured(windows).to_dict("records")}
    starts = sorted((t["emissions"][0][0], t) for t in server.truth if len(t["emissions"]) > 1)
    t0s = np.array([s for s, _ in starts])
    measured = []  # (level, the window's row, its request's true J/token)
    for value, rec in outcome.sweep.records:
        if rec.request_id not in rows:
            continue
        # Its own request's truth: the server emitted the first token before the client read it, whatever the hop.
        em = starts[int(np.searchsorted(t0s, rec.t_first_ns, side="right")) - 1][1]["emissions"]
        measured.append((value, rows[rec.request_id], (g.true_energy_at_j(em[-1][0]) - g.true_energy_at_j(em[0][0]))
                         / sum(n for _, n in em[1:])))
    levels = pq.read_table(outcome.run_dir / "levels.parquet").to_pandas().set_index("level_value")
    return {"measured": measured, "notes": json.loads((outcome.run_dir / "run.json").read_text())["notes"],
            "levels": {v: (int(levels.loc[v, "n_windows"]), float(levels.loc[v, "gpu_j_per_token"])) for v in levels.index}}


@pytest.fixture(scope="module")
def buffered_runs(request, tmp_path_factory):
    """Both hops' sweeps at once, each in its own process (tests/support.py side_by_side): each waits on ~30 s of
    simulated decode at a small share of a core; one after the other they took 72 s (34 + 38 s, 6 December 2026)."""
    return side_by_side(request, {name: (_buffered_sweep, (burst, tmp_path_factory.mktemp(name) / "run"), {})
                                  for name, burst in BURSTS.items()})


@pytest.mark.parametrize("burst", list(BURSTS))
def test_a_server_behind_a_buffering_hop_gets_every_windows_j_per_token_within_2pct_of_truth(buffered_runs, burst):
    # A hop that passes the stream on in bursts (nginx's 4 kB proxy buffer, a gateway flushing on a timer) holds the
    # first tokens back with the rest: the first read came 0.7-0.9 s late yet looked on time (every read a pile of
    # the same size). The server's decode time hung on it ended that long after the response did, no counter read
    # existed past that end when the window was costed, and 3 of 4 windows a level carried no energy and no reason;
    # the level's J/token rested on one window (+6.5-7% against the truth of the level's requests), flagged only
    # few-windows. The stream's last read came when the server finished: the window ends there at the latest.
    run = buffered_runs[burst].result()
    truth: dict[float, list[float]] = {}
    for value, row, true_j_per_token in run["measured"]:
        assert row["timing"] == "server" and "bursts" in row["timing_reason"], row["timing_reason"]
        assert row["energy_method"] == "counter" and row["gpu_j_per_token"] > 0, row
        truth.setdefault(value, []).append(true_j_per_token)
    # Each window's start is placed by the server's decode time, where no reading was taken: said as that, not as
    # "a loaded host" (run.json's note blamed one, for every window).
    notes = run["notes"]
    assert any("server-timed windows" in n and "placed by the server's own decode time" in n for n in notes), notes
    assert not any("a loaded host" in n for n in notes), notes
    levels = run["levels"]
    for value in (300.0, 200.0):
        n_windows, j_per_token = levels[value]
        assert len(truth[value]) == 4 and n_windows == 4
        assert j_per_token == pytest.approx(np.median(truth[value]), rel=0.02), value
