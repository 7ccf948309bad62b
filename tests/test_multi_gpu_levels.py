"""A level on several GPUs: whether the cap bound is judged per GPU, and a GPU on which it did nothing is named."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from powerprof.analysis import engine
from powerprof.analysis.checks import level_findings
from powerprof.collectors.clock_reasons import REASON_SW_POWER_CAP
from powerprof.control.errors import LimitNotAppliedError
from powerprof.rig import Rig
from powerprof.sim.faults import FaultyNVML
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile
from powerprof.sweep import run_sweep
from powerprof.workload.client import RequestParams


def _figures(per_gpu):
    """Level figures of one 150 W level from samples: per_gpu = [(power W, reasons or None)], 10 samples each."""
    rows = []
    for k, (power_w, reasons) in enumerate(per_gpu):
        for i in range(10):
            rows.append({"t_mono_s": float(i), "source": "nvml", "device": f"gpu{k}", "power_w": power_w,
                         "clock_event_reasons": reasons, "enforced_limit_w": 150.0, "level_kind": "power_limit",
                         "level_value": 150.0})
    t = pa.Table.from_pylist(rows)
    with engine.connect() as con:
        sums = engine.level_sums(con, engine.samples_relation(con, t), time_expr="t_mono_s")
    return engine.level_figures(sums)[("power_limit", 150.0)]


def test_a_gpu_at_its_cap_is_not_averaged_away_by_one_under_it_without_reason_bits():
    """No reason bits: GPU 0 draws its whole 150 W, GPU 1 60 W. The cap binds on GPU 0; pooled, the mean of 105 W
    under 90% of 150 W called the whole level not engaged."""
    f = _figures([(150.0, None), (60.0, None)])
    assert f["cap_not_engaged"] is False
    assert f["cap_not_engaged_gpus"] == "gpu1 (60 W of 150 W)"


def test_a_gpu_the_cap_did_not_bind_is_named_beside_one_it_did():
    f = _figures([(149.0, REASON_SW_POWER_CAP), (100.0, 0)])
    assert f["cap_not_engaged"] is False
    assert f["cap_not_engaged_gpus"] == "gpu1 (100 W of 150 W)"


def test_one_gpu_is_judged_as_before():
    assert _figures([(100.0, 0)])["cap_not_engaged"] is True
    assert _figures([(100.0, 0)])["cap_not_engaged_gpus"] is None
    assert _figures([(149.0, REASON_SW_POWER_CAP)])["cap_not_engaged"] is False


def _low_draw_a100():
    """An A100 of the same name that draws less at every clock (another stage's smaller share of the work)."""
    return dataclasses.replace(get_profile("a100-40g"), key="a100-40g-lowdraw", dyn_power_w=90.0, mem_power_w=40.0)


@pytest.fixture
def sim_env(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "pp"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def test_a_sweep_on_two_gpus_names_the_gpu_its_cap_did_not_bind(sim_env):
    """At 250 W the cap holds GPU 0 (it would draw ~290 W) and not GPU 1 (~170 W): the level says so per GPU; at
    400 W it binds on neither, and the advice gives each GPU's power against its limit, not their sum."""
    sim = SimNVML([get_profile("a100-40g"), _low_draw_a100()], state_path=sim_env / "sim.json")
    with Rig("a100-40g", nvml=sim, gpus=[0, 1]) as rig:
        out = run_sweep(rig, levels_spec="250,400", out_dir=sim_env / "run", params=RequestParams(max_tokens=96),
                        idle_s=0.5, interval_s=0.5, min_requests=4, max_requests=4, warmup_requests=1)
    levels = {r["level_value"]: r for r in pq.read_table(out.run_dir / "levels.parquet").to_pylist()}
    low, top = levels[250.0], levels[400.0]
    assert low["cap_not_engaged"] is False
    assert low["cap_not_engaged_gpus"] is not None and low["cap_not_engaged_gpus"].startswith("gpu1 (")
    assert "gpu0" not in low["cap_not_engaged_gpus"]
    assert "cap-partly-engaged" in low["flags"].split(",")
    assert top["cap_not_engaged"] is True
    assert "gpu0 (" in top["cap_not_engaged_gpus"] and "gpu1 (" in top["cap_not_engaged_gpus"]
    # Each GPU's own draw under its own limit: the sum of both (over 400 W) is no GPU's.
    for part in top["cap_not_engaged_gpus"].split(","):
        watts = float(part.split("(")[1].split(" W")[0])
        assert 100 < watts < 400, part
    # The idle baseline is both GPUs' together (idle_gpu_power_w, what above-idle J/token subtracts) and each one's.
    meta = json.loads((out.run_dir / "run.json").read_text())
    by_gpu = meta["idle_gpu_power_w_by_gpu"]
    assert set(by_gpu) == {"gpu0", "gpu1"}
    for g in sim.gpus:
        assert by_gpu[f"gpu{g.index}"] == pytest.approx(g.profile.idle_power_w, rel=0.05)
    assert meta["idle_gpu_power_w"] == pytest.approx(sum(by_gpu.values()), rel=1e-9)
    text = " ".join(f.message for f in level_findings(pq.read_table(out.run_dir / "levels.parquet")))
    assert "gpu1 (" in text and f"{top['avg_gpu_power_w']:.0f} W)" not in text


def test_a_gpu_whose_enforced_limit_another_limiter_holds_lower_stops_the_sweep_naming_it(sim_env):
    """The level table's enforced_limit_w is one figure for all GPUs: a GPU held 60 W under the level must not
    be averaged into it (it would read 30 W low, matching no GPU). The set refuses and restores instead."""
    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=sim_env / "sim.json"))
    nv.lie(1, "nvmlDeviceGetEnforcedPowerLimit", lambda mw: mw - 60_000, times=None)
    with Rig("a100-40g", nvml=nv, gpus=[0, 1]) as rig:
        with pytest.raises(LimitNotAppliedError, match=r"GPU 1: asked for 250 W, the enforced limit is 190 W"):
            run_sweep(rig, levels_spec="250", out_dir=sim_env / "run", params=RequestParams(max_tokens=64),
                      idle_s=0.5, interval_s=0.5, min_requests=2, max_requests=2, warmup_requests=0)
    assert [g.limit_w for g in nv.gpus] == [400.0, 400.0]  # put back


def test_the_power_timeline_of_two_gpus_draws_each_gpus_idle_not_their_sum(tmp_path):
    """Each line is one GPU's power; the baseline of both together (110 W for two 55 W GPUs) is no GPU's."""
    import numpy as np

    from powerprof.analysis import plots
    from powerprof.analysis.loading import Timeline

    t = np.arange(10.0)
    tl = Timeline("r", t, ("gpu0", "gpu1"), np.full((2, 10), 60.0), np.full((2, 10), 1400.0), np.full(10, 250.0))

    def lines(**kw):
        ax = plots.plot_timeline(tl, tmp_path / "pc.png", **kw).axes[0]
        return sorted(round(a.get_ydata()[0]) for a in ax.get_children() if a.get_gid() == "idle-baseline")

    assert lines(idle_power_w=110.0, idle_by_device_w={"gpu0": 55.0, "gpu1": 16.0}) == [16, 55]
    assert lines(idle_power_w=110.0) == []  # a run without each GPU's baseline: none drawn rather than the sum
