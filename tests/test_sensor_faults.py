"""Sensors that misbehave as real cards do (powerprof/sim/faults.py) through the daemon: said, never a smaller figure."""

from __future__ import annotations

import asyncio
import logging

import pyarrow.dataset as pads
import pynvml
import pytest

from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.faults import FaultyNVML
from powerprof.sim.nvml import SimNVML


def _daemon(tmp_path, nv) -> Daemon:
    """An in-process daemon on two simulated A100s behind `nv`, sampling at 10 Hz."""
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.1, "daemon.flush_interval_s": 0.2,
        "proxy.listen": "127.0.0.1:0", "metrics.listen": "", "daemon.restore_on_start": False,
    })
    return Daemon(cfg, Rig("a100-40g", gpus=[0, 1], nvml=nv))


async def _started(d: Daemon) -> asyncio.Task:
    """d.run() as a task, once its proxy listens and a few samples are in."""
    task = asyncio.create_task(d.run())
    for _ in range(200):
        if "proxy" in d.urls:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.6)
    return task


def test_the_daemon_keeps_running_when_a_gpu_falls_off_the_bus_and_says_so(tmp_path, caplog):
    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=None))
    d = _daemon(tmp_path, nv)

    async def main():
        task = await _started(d)
        nv.lose(1)
        await asyncio.sleep(1.5)
        snap = d.snapshot
        d.stop_event.set()
        return snap, await task

    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.service"):
        snap, rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert rc == 0
    assert [g.up for g in snap.gpus] == [1.0, 0.0] and snap.gpus[1].power_w is None
    assert sum("gpu1" in r.getMessage() and "GPU_IS_LOST" in r.getMessage() for r in caplog.records) == 1
    iv = pads.dataset(tmp_path / "data" / "intervals", format="parquet").to_table().to_pylist()
    late = [r for r in iv if r["energy_method"] == "none"]
    assert late and all(r["gpu_energy_j"] is None for r in late)  # not GPU 0's energy alone
    assert any(r["gpu_energy_j"] and r["gpu_energy_j"] > 0 for r in iv)  # before the loss: both GPUs
    samples = pads.dataset(tmp_path / "data" / "samples", format="parquet").to_table().to_pylist()
    assert any(r["device"] == "gpu1" and "GPU_IS_LOST" in (r["error"] or "") for r in samples)


def _gpu_series(d: Daemon) -> dict:
    """{(metric, gpu): value} of the per-GPU energy series on the daemon's /metrics, as Prometheus reads them."""
    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.metrics import make_registry, render

    want = ("powerprof_gpu_energy_joules_total", "powerprof_gpu_energy_unknown_seconds_total")
    return {(s.name, s.labels["gpu"]): s.value for f in text_string_to_metric_families(render(make_registry(d)).decode())
            for s in f.samples if s.name in want}


def test_a_lost_gpus_energy_series_goes_and_the_time_it_misses_is_counted_never_a_counter_reading_0_w(tmp_path):
    # Before: powerprof_gpu_energy_joules_total{gpu="1"} stood still while GPU 1 was lost, its rate() 0 W, nothing on
    # /metrics per GPU saying its energy was unread.
    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=None))
    d = _daemon(tmp_path, nv)

    async def main():
        task = await _started(d)
        for _ in range(50):  # both GPUs' energy counted
            before = _gpu_series(d)
            if before.get(("powerprof_gpu_energy_joules_total", "1"), 0) > 0:
                break
            await asyncio.sleep(0.1)
        nv.lose(1)
        for _ in range(50):  # until the accounts (closed intervals) reach the loss (the grace, 0.3 s): 5 s at most
            await asyncio.sleep(0.1)
            if ("powerprof_gpu_energy_joules_total", "1") not in _gpu_series(d):
                break
        first = _gpu_series(d)
        await asyncio.sleep(1.0)
        later = _gpu_series(d)
        d.stop_event.set()
        return before, first, later, await task

    before, first, later, rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert rc == 0
    e, u = "powerprof_gpu_energy_joules_total", "powerprof_gpu_energy_unknown_seconds_total"
    assert before[(e, "1")] > 0
    assert (e, "1") not in first and (e, "1") not in later  # no value rather than a still one
    assert before[(u, "0")] == 0.0 and before[(u, "1")] == 0.0
    assert later[(e, "0")] > first[(e, "0")] > before[(e, "0")]  # the GPU that reads on counts on
    assert later[(u, "0")] == 0.0
    assert later[(u, "1")] > first[(u, "1")] > 0  # grows with the time it stays unread
    assert later[(u, "1")] - first[(u, "1")] == pytest.approx(1.0, abs=0.6)



def test_a_gpus_energy_series_comes_back_where_it_stopped_never_reset(tmp_path, monkeypatch):
    # GPU 1 lost for about 1 s, then answering again (no reset: its counter runs on): its series comes back at or above
    # its last value before the loss (below, a rate() takes a counter reset and reads its whole value), grown by no more
    # than the GPU spent meanwhile (not the counter's jump across the gap counted twice, nor from zero).
    from powerprof.collectors import nvml as nvmlmod

    monkeypatch.setattr(nvmlmod, "REOPEN_INTERVAL_S", 0.3)
    sim = SimNVML("a100-40g", count=2, state_path=None)
    nv = FaultyNVML(sim)
    d = _daemon(tmp_path, nv)
    e = ("powerprof_gpu_energy_joules_total", "1")

    async def main():
        task = await _started(d)
        for _ in range(50):
            before = _gpu_series(d)
            if before.get(e, 0) > 0:
                break
            await asyncio.sleep(0.1)
        true_before = sim.gpus[1].true_energy_j()
        nv.lose(1)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if e not in _gpu_series(d):
                break
        gone = _gpu_series(d)
        await asyncio.sleep(1.0)
        nv.heal()
        for _ in range(100):
            await asyncio.sleep(0.1)
            back = _gpu_series(d)
            if e in back:
                break
        true_back = sim.gpus[1].true_energy_j()
        for _ in range(50):  # its intervals close a grace period after their edges
            await asyncio.sleep(0.1)
            later = _gpu_series(d)
            if later.get(e, 0) > back[e]:
                break
        d.stop_event.set()
        return before, gone, back, later, true_before, true_back, await task

    before, gone, back, later, true_before, true_back, rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert rc == 0
    assert e not in gone and e in back, (gone, back)
    assert back[e] >= before[e]
    assert back[e] - before[e] <= true_back - true_before
    assert later[e] > back[e]  # counting on
    assert back[("powerprof_gpu_energy_unknown_seconds_total", "1")] > 0

def test_restore_puts_the_other_gpus_back_when_one_is_lost_and_says_how_to_fix_that_one(tmp_path):
    import pytest

    from powerprof.control.controller import LimitController
    from powerprof.control.errors import RestoreError

    sim = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json", privileged=True)
    nv = FaultyNVML(sim)
    restore_file = tmp_path / "restore.json"
    with LimitController(nv, [0, 1], restore_path=restore_file, handle_signals=False) as ctl:
        ctl.set_power_limit_w(200)
        nv.lose(1)
        with pytest.raises(RestoreError) as e:
            ctl.restore()
        assert [g.limit_w for g in sim.gpus] == [400.0, 200.0] and restore_file.exists()
        assert "GPU 1 is lost" in str(e.value) and f"nvidia-smi -r -i {sim.gpus[1].uuid}" in str(e.value)
        nv.heal()  # as after a reset: the kept file finishes the job


def test_the_daemon_reopens_a_reset_gpu_by_uuid_and_counts_its_energy_again_never_across_the_reset(tmp_path, caplog,
                                                                                                    monkeypatch):
    from powerprof.collectors import nvml as nvmlmod

    monkeypatch.setattr(nvmlmod, "REOPEN_INTERVAL_S", 0.3)
    sim = SimNVML("a100-40g", count=2, state_path=None)
    nv = FaultyNVML(sim)
    d = _daemon(tmp_path, nv)

    async def main():
        task = await _started(d)
        nv.lose(1)  # nvidia-smi -r -i 1: gone for a while
        await asyncio.sleep(1.0)
        down = d.snapshot
        nv.heal()
        nv.reset(1, pynvml.NVML_ERROR_INVALID_ARGUMENT)  # back: old handle stale, counter from zero
        for _ in range(100):
            await asyncio.sleep(0.1)
            if d.snapshot.gpus[1].up == 1.0 and d.snapshot.gpus[1].power_w is not None:
                break
        back = d.snapshot
        for _ in range(100):  # intervals close a grace period after their edges
            await asyncio.sleep(0.1)
            if d.snapshot.gpus[1].energy_j > back.gpus[1].energy_j + 10:
                break
        up = d.snapshot
        d.stop_event.set()
        return down, back, up, await task

    with caplog.at_level(logging.INFO, logger="powerprof.daemon.service"):
        down, back, up, rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert rc == 0
    assert [g.up for g in down.gpus] == [1.0, 0.0]
    assert [g.up for g in up.gpus] == [1.0, 1.0] and up.gpus[1].power_w > 0
    assert sum("gpu1" in r.getMessage() and "reopened by its UUID" in r.getMessage() for r in caplog.records) == 1
    # Energy resumed, and never the counter's drop (or its whole value) across the reset.
    assert up.gpus[1].energy_j > back.gpus[1].energy_j + 10
    assert up.gpus[1].energy_j <= sim.gpus[1].true_energy_j() * 1.05
    iv = pads.dataset(tmp_path / "data" / "intervals", format="parquet").to_table().to_pylist()
    assert all(r["gpu_energy_j"] is None or r["gpu_energy_j"] >= 0 for r in iv)
    samples = pads.dataset(tmp_path / "data" / "samples", format="parquet").to_table().to_pylist()
    e = [r["energy_j"] for r in sorted(samples, key=lambda r: r["t_mono_s"]) if r["device"] == "gpu1" and r["energy_j"] is not None]
    assert any(b < a for a, b in zip(e, e[1:]))  # the counter did restart: the total above never took that drop


# --- a GPU reset under the limit controller ---------------------------------------------------------------------


def _operator_limit(sim: SimNVML, index: int, watts: float) -> None:
    """An operator's own limit, set before powerprof runs: the original a restore must bring back, not the default."""
    sim.nvmlInit()
    sim.nvmlDeviceSetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(index), int(watts * 1000))
    sim.nvmlShutdown()


_RESET_CODES = [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_INVALID_ARGUMENT, pynvml.NVML_ERROR_UNINITIALIZED]


def test_a_reset_puts_the_default_limit_back_and_releases_the_clock_lock_as_on_a_real_card(tmp_path):
    sim = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json", privileged=True)
    nv = FaultyNVML(sim)
    _operator_limit(sim, 1, 350)
    nv.lock_clocks(1, 900, 900)
    nv.reset(1)
    assert sim.gpus[1].limit_w == 400.0 and sim.locked_clocks_mhz(1) is None
    fresh = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json")  # another process sees it too
    assert fresh.gpus[1].limit_w == 400.0 and fresh.gpus[1].locked_clocks_mhz is None


@pytest.mark.parametrize("code", _RESET_CODES)
def test_the_controller_reopens_a_reset_gpu_by_uuid_so_the_next_level_and_the_restore_reach_it(tmp_path, code):
    # A reset mid-sweep left the controller's handle stale: the next level failed on it ("setting the power limit
    # failed (NVML: ...)") and so did the restore, keeping the restore file; the GPU stayed at its default 400 W
    # instead of the operator's 350 W, and the next run refused to start until `powerprof restore`.
    from powerprof.control.controller import LimitController

    sim = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json", privileged=True)
    nv = FaultyNVML(sim)
    _operator_limit(sim, 1, 350)
    restore_file = tmp_path / "restore.json"
    with LimitController(nv, [0, 1], restore_path=restore_file, handle_signals=False) as ctl:
        ctl.set_power_limit_w(200)
        nv.reset(1, code)
        assert sim.gpus[1].limit_w == 400.0  # the reset put the default back
        rb = ctl.set_power_limit_w(250)
        assert [g.limit_w for g in sim.gpus] == [250.0, 250.0] and [g.limit_w for g in rb.gpus] == [250.0, 250.0]
        said = " ".join(ctl.notes)
        assert "GPU 1" in said and sim.gpus[1].uuid in said and "reset" in said and "reopened by its UUID" in said, said
    assert [g.limit_w for g in sim.gpus] == [400.0, 350.0]  # each GPU's original
    assert not restore_file.exists()


@pytest.mark.parametrize("code", _RESET_CODES)
def test_a_gpu_reset_after_the_last_level_is_still_put_back_and_its_clock_lock_released(tmp_path, code):
    from powerprof.control.controller import LimitController

    sim = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json", privileged=True)
    nv = FaultyNVML(sim)
    _operator_limit(sim, 0, 300)
    restore_file = tmp_path / "restore.json"
    with LimitController(nv, [0, 1], restore_path=restore_file, handle_signals=False) as ctl:
        ctl.set_power_limit_w(200)
        ctl.lock_sm_clock_mhz(1200)
        nv.reset(0, code)
        nv.lock_clocks(0, 1000, 1000)  # and another tool locked it after the reset: ours to release, the record says
    assert [g.limit_w for g in sim.gpus] == [300.0, 400.0]
    assert [sim.locked_clocks_mhz(i) for i in (0, 1)] == [None, None]
    assert not restore_file.exists()
    assert any("GPU 0" in n and "reset" in n for n in ctl.notes), ctl.notes


def test_a_lost_gpu_is_not_taken_for_a_reset_one_it_still_fails_and_keeps_the_file(tmp_path):
    from powerprof.control.controller import LimitController
    from powerprof.control.errors import RestoreError

    sim = SimNVML("a100-40g", count=2, state_path=tmp_path / "st.json", privileged=True)
    nv = FaultyNVML(sim)
    restore_file = tmp_path / "restore.json"
    ctl = LimitController(nv, [0, 1], restore_path=restore_file, handle_signals=False)
    ctl.open()
    ctl.set_power_limit_w(200)
    nv.lose(1)  # off the bus: its UUID may still answer, nothing else does
    with pytest.raises(RestoreError) as e:
        ctl.close()
    assert "GPU 1 is lost" in str(e.value) and restore_file.exists()
    assert sim.gpus[0].limit_w == 400.0
    assert not any("reopened" in n for n in ctl.notes)


@pytest.mark.parametrize("lag_s", [0.0, 2.0])
def test_the_daemon_says_how_far_its_energy_accounts_are_behind_a_late_sampler(tmp_path, monkeypatch, lag_s):
    # Its energy counters come from closed intervals, which a sampler starved on a loaded host keeps back: the tuner
    # reads this gauge to leave out of its energy verdicts a window whose joules reach back before its level.
    from support import lagging_daemon

    lagging_daemon(monkeypatch, lag_s)
    d = _daemon(tmp_path, SimNVML("a100-40g", count=2, state_path=None))

    async def main():
        task = await _started(d)
        behind = []
        for _ in range(10):
            await asyncio.sleep(0.3)
            d._update_snapshot()
            behind.append(d.snapshot.accounts_behind_s)
        d.stop_event.set()
        return behind, await task

    behind, rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert rc == 0 and None not in behind[-5:], behind
    # At least the lag or the 0.3 s grace (an edge delivered late is past it already); a loaded host adds its own
    # lateness on top, never takes from it.
    assert min(behind[-5:]) >= max(lag_s, 0.3), behind
    assert max(behind[-5:]) < lag_s + 5.0, behind


def test_a_gpu_lost_and_back_before_the_daemon_drains_its_readings_is_said_both_ways(caplog, monkeypatch):
    # The daemon drains its readings after they were read (a tick or more later on a loaded host), and said a GPU's
    # loss and its return by the collector's state at the drain. Reset, then looked up again by its UUID before the
    # drain, the GPU's return went unsaid: at the drain it was no longer lost, so its lost reading was taken for a
    # GPU answering, and the reading that said "answers again" for no change. Each reading carries its own state now.
    import collections
    import types

    import powerprof.collectors.nvml as nvml_mod
    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.collectors.sampler import Sample

    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=None))
    col = NvmlCollector(nv, [0, 1])
    nv.reset(1)
    lost_read = col.read()  # its handle is stale: lost
    monkeypatch.setattr(nvml_mod, "REOPEN_INTERVAL_S", 0.0)
    back = col.read()  # looked up again by UUID: it answers
    assert [r.lost for r in lost_read] == [False, True] and [r.lost for r in back] == [False, False]
    assert lost_read[1].note and back[1].note and 1 not in col.lost

    seen = []
    me = types.SimpleNamespace(
        samples=collections.deque([Sample("nvml", 1, 1, 1, lost_read), Sample("nvml", 2, 2, 2, back)]), t0_ns=0,
        gpu_uuids=[i.uuid for i in col.infos], collector=col, _gpu_notes={}, _gpu_lost={}, latest_gpu=None,
        ledger=types.SimpleNamespace(add_gpu_sample=lambda *a: seen.append(a)),
        store=types.SimpleNamespace(append=lambda name, rows: None))
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon"):
        assert Daemon._drain(me) == 2
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpu1: ")]
    assert said == [f"gpu1: {lost_read[1].note}", f"gpu1: {back[1].note}"], caplog.text
    assert len(seen) == 2
