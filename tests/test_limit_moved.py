"""A power limit another tool changes while powerprof measures at a limit it did not set itself: `measure` (the
settings as they are), a clock sweep (the limit stays the operator's) and a configuration sweep without levels.
The windows measured since are left out with the reason, the run stops saying so with the fix, and the figure
kept is the setting's, against the simulator's truth. (A power sweep's own level: tests/test_sweep_hostile.py.)"""

from __future__ import annotations

import json
import threading
import time

import pyarrow.parquet as pq
import pytest

from powerprof.collectors.limitwatch import LimitWatch, limit_moved
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sweep import UI, SweepError, run_sweep
from powerprof.workload.client import RequestParams
from powerprof.workload.load import Prompt
from support import true_window_energy_j

# Decode on the seed card draws ~274 W at its default 300 W limit and ~180 W under a 180 W one: a window whose
# true mean power is above this ran at the limit the run began with, whatever the host's load did to its timing.
AT_300W_MIN_W = 250.0


def _true_power_w(sim, t0_ns, t1_ns) -> float:
    g = sim.gpus[0]
    return (g.true_energy_at_j(t1_ns) - g.true_energy_at_j(t0_ns)) / ((t1_ns - t0_ns) / 1e9)


def test_a_power_limit_another_tool_changed_mid_measure_leaves_the_windows_since_out_and_stops(tmp_path, sim_server):
    # `nvidia-smi -pl 180` (or `powerprof tune`) halfway through `measure` at the default 300 W: before, it printed
    # 2.706 J/token and 76.7 tok/s, the 300 W truth being 3.20 and 85.7 (-15.5%, -10.6%), with no note, and run.json
    # did not say which limit the figure was measured at.
    from powerprof.workload.measure import run_measure

    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    t_set: list[int] = []

    def other_tool():
        t_end = time.monotonic() + 120
        # The warm-up and three measured requests taken, the fourth decoding: the limit moves mid-window.
        while time.monotonic() < t_end and not (sim_server and sim_server[0]._next_rid >= 5):
            time.sleep(0.01)
        t_set.append(time.monotonic_ns())
        sim.gpus[0].set_limit_w(180.0)

    out = tmp_path / "m"
    with Rig("seed-16g", nvml=sim) as rig:
        th = threading.Thread(target=other_tool, daemon=True)
        th.start()
        res = run_measure(rig, url=None, out_dir=out, prompts=[Prompt("p0", "hello there"), Prompt("p1", "tell me more")],
                          n_requests=8, concurrencies=[1], params=RequestParams(max_tokens=96), warmup=1, interval_s=0.2)
        th.join(5)
    assert t_set, "the other tool never ran"
    assert res.aborted is not None, res.notes
    assert res.aborted.startswith("GPU 0's power limit read 180 W during the measurement, not the 300 W it read as "
                                  "the measurement began"), res.aborted
    assert "left out" in res.aborted and "fix:" in res.aborted, res.aborted
    recs = {r.request_id: r for r in res.records}
    measured = [row for row in res.rows if row["window_kind"] == "request" and not row["warmup"] and row["status"] == "ok"]
    used = [row for row in measured if row["timing"] != "untrusted"]
    out_rows = [row for row in measured if row["timing"] == "untrusted"]
    assert used and out_rows, [(r["request_id"], r["timing"]) for r in measured]
    assert all("power limit read 180 W" in r["timing_reason"] for r in out_rows)
    # Every window kept ran at the 300 W the measurement began with.
    for row in used:
        tm = recs[row["request_id"]].timing
        assert _true_power_w(sim, tm.t0_ns, tm.t1_ns) > AT_300W_MIN_W, row
    # The printed figure is over those windows alone, within the counter's 1% and the loaded host's timing.
    s = res.summaries[0]
    e = sum(true_window_energy_j(sim.gpus[0], recs[r["request_id"]]) for r in used)
    truth = e / sum(r["decode_tokens"] for r in used)
    assert s.gpu_j_per_token == pytest.approx(truth, rel=0.03)
    assert s.n_trusted == len(used)
    # The setting the figure belongs to is recorded.
    meta = json.loads((out / "run.json").read_text())
    assert meta["gpus"][0]["power_limit_w"] == 300.0 and meta["gpus"][0]["enforced_limit_w"] == 300.0
    assert meta["aborted"] == res.aborted
    w = pq.read_table(out / "windows.parquet").to_pandas()
    assert (w[w.timing == "untrusted"].gpu_j_per_token.isna()).all()


class _Hook(UI):
    def __init__(self, act):
        self.act = act

    def level_progress(self, visit, live):
        self.act(visit)


@pytest.mark.parametrize("kind, spec", [("none", ""), ("sm_clock", "2400")])
def test_a_power_limit_another_tool_changed_during_a_level_that_does_not_set_it_stops_the_sweep(tmp_path, kind, spec):
    # The settings as they are (a configuration sweep without --limits) and a clock sweep both run at the limit the
    # sweep found. Before, only a power level's own limit was watched: `nvidia-smi -pl 180` mid-level made the settings'
    # level 2.61 J/token and 73.9 tok/s where it gives 3.34 and 81.5 (-22%, -9%), flagged only wide-ci. Under a clock
    # lock a lower cap lowers the clock on a real card (the simulator holds the locked clock): the same stop.
    sim = SimNVML("seed-16g", state_path=None, record_history=True)

    def other_tool(visit):
        if visit.n_measured == 3 and sim.gpus[0].limit_w == 300.0:
            sim.gpus[0].set_limit_w(180.0)

    out = tmp_path / "run"
    with Rig("seed-16g", nvml=sim) as rig, pytest.raises(SweepError) as e:
        run_sweep(rig, levels_spec=spec, level_kind=kind, out_dir=out, params=RequestParams(max_tokens=48), idle_s=0,
                  interval_s=0.2, min_requests=8, max_requests=8, warmup_requests=0, ui=_Hook(other_tool))
    msg = str(e.value)
    name = "the settings as they are" if kind == "none" else "level 2400"
    assert msg.startswith(f"{name}: GPU 0's power limit read 180 W during the level, not the 300 W it read as the "
                          "sweep began"), msg
    assert "fix:" in msg, msg
    if kind == "sm_clock":
        assert sim.gpus[0].limit_w == 300.0 and sim.gpus[0].locked_clocks_mhz is None  # ours put back
    w = pq.read_table(out / "windows.parquet").to_pandas()
    lv = w[(w.window_kind == "request") & ~w.warmup & (w.status == "ok")]
    moved = lv[lv.timing == "untrusted"]
    assert len(moved) >= 1 and moved.gpu_j_per_token.isna().all()
    assert moved.timing_reason.str.contains("power limit read 180 W").all()
    kept = lv[lv.timing != "untrusted"]
    assert len(kept) >= 3
    if kind == "none":  # the kept windows ran at 300 W (~274 W measured; 180 W under the other tool's limit)
        assert (kept.avg_gpu_power_w > AT_300W_MIN_W).all(), kept.avg_gpu_power_w.tolist()
        levels = pq.read_table(out / "levels.parquet").to_pandas()
        assert (levels.avg_gpu_power_w > AT_300W_MIN_W).all()


def test_the_watch_judges_each_gpus_limits_against_its_own():
    from types import SimpleNamespace as R

    def rd(i, pl, en):
        return R(index=i, power_limit_w=pl, enforced_limit_w=en)

    want = {0: (300.0, 300.0), 1: (250.0, 190.0)}  # GPU 1: another limiter holds its enforced limit lower
    assert limit_moved([rd(0, 300.4, 300.0), rd(1, 250.0, 190.0)], want) is None  # milliwatt rounding
    assert limit_moved([rd(0, None, None), rd(1, 250.0, None)], want) is None  # nothing read: not judged
    m = limit_moved([rd(0, 300.0, 300.0), rd(1, 250.0, 150.0)], want)
    assert (m.index, m.what, m.read_w, m.expected_w) == (1, "enforced power limit", 150.0, 190.0)
    watch = LimitWatch(want)
    for t, r in ((1, [rd(0, 300, 300)]), (2, [rd(0, 300, 300)]), (3, [rd(0, 180, 180)]), (4, [rd(0, 300, 300)])):
        watch(R(source="nvml", data=r, t_mono_ns=t))
    watch(R(source="rapl", data=[], t_mono_ns=5))
    # The first move is kept; a reading back at the limit later does not vouch for the windows across it.
    assert (watch.moved.read_w, watch.t_moved_ns, watch.t_held_ns) == (180.0, 3, 2)
    assert watch.held_through(2) and not watch.held_through(3) and not watch.held_through(None)


# Decode on the seed card at 300 W runs at its 2790 MHz boost (~274 W); locked at 1200 MHz it draws well under this.
LOCKED_1200_MAX_W = 200.0


@pytest.mark.parametrize("start, then", [(None, (1200, 1200)), ((1200, 1200), None)])
def test_an_sm_clock_lock_another_tool_changed_mid_measure_leaves_the_windows_since_out_and_stops(tmp_path, sim_server, start, then):
    # `nvidia-smi -lgc 1200` (or `-rgc` releasing an operator's lock) halfway through `measure`: the limit watch saw
    # nothing (the limit held), so the figure pooled two clocks unsaid. Before: no note, no abort, the J/token over
    # every window (a mix of ~274 W and ~150 W windows) printed as the setting's.
    from powerprof.workload.measure import run_measure

    sim = SimNVML("seed-16g", state_path=None, record_history=True)
    if start is not None:
        sim.external_clock_change(0, start)  # the operator's lock, there before the measurement began
    t_set: list[int] = []

    def other_tool():
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end and not (sim_server and sim_server[0]._next_rid >= 5):
            time.sleep(0.01)
        t_set.append(time.monotonic_ns())
        sim.external_clock_change(0, then)

    with Rig("seed-16g", nvml=sim) as rig:
        th = threading.Thread(target=other_tool, daemon=True)
        th.start()
        res = run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=[Prompt("p0", "hello there"), Prompt("p1", "tell me more")],
                          n_requests=10, concurrencies=[1], params=RequestParams(max_tokens=96), warmup=1, interval_s=0.1)
        th.join(5)
    assert t_set, "the other tool never ran"
    assert res.aborted is not None, res.notes
    assert res.aborted.startswith("GPU 0's SM clock read"), res.aborted
    assert "fix:" in res.aborted and "left out" in res.aborted and "nvidia-smi -lgc" in res.aborted, res.aborted
    recs = {r.request_id: r for r in res.records}
    measured = [row for row in res.rows if row["window_kind"] == "request" and not row["warmup"] and row["status"] == "ok"]
    used = [row for row in measured if row["timing"] != "untrusted"]
    out_rows = [row for row in measured if row["timing"] == "untrusted"]
    assert used and out_rows, [(r["request_id"], r["timing"]) for r in measured]
    assert all("SM clock read" in r["timing_reason"] for r in out_rows)
    # Every window kept ran at the clock setting the measurement began with, against the simulator's truth.
    for row in used:
        tm = recs[row["request_id"]].timing
        p_w = _true_power_w(sim, tm.t0_ns, tm.t1_ns)
        assert (p_w > AT_300W_MIN_W) if start is None else (p_w < LOCKED_1200_MAX_W), (row, p_w)
    s = res.summaries[0]
    e = sum(true_window_energy_j(sim.gpus[0], recs[r["request_id"]]) for r in used)
    truth = e / sum(r["decode_tokens"] for r in used)
    assert s.gpu_j_per_token == pytest.approx(truth, rel=0.03)
    assert s.n_trusted == len(used)
