"""NVML and host collectors: unsupported readings are missing (never zero), GPU selection, sources."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from powerprof.collectors.host import HostCollector
from powerprof.collectors.nvml import NvmlCollector, clock_event_reason_names, visible_indexes
from powerprof.collectors.sources import describe, open_sources
from powerprof.sim.gpu import Phase
from powerprof.sim.nvml import SimNVML
from powerprof.storage.samples import samples_to_table
from powerprof.collectors.sampler import Sample
from powerprof.rig import Rig


def test_pascal_card_reports_missing_energy_and_instant_power_not_zero():
    nvml = SimNVML("pascal-8g", state_path=None)
    c = NvmlCollector(nvml)
    info = c.infos[0]
    assert info.supports["energy_counter"] is False and info.supports["power_instant"] is False
    assert info.supports["power_average"] is True
    nvml.gpus[0].set_phase(Phase("decode", 0.25))
    (r,) = c.read()
    assert r.energy_j is None and r.power_w is None
    assert r.power_avg_w is not None and r.power_avg_w > 0
    # ... and they stay null, not 0, once stored.
    t = samples_to_table([Sample("nvml", 0, 1, 1_700_000_000_000_000_000, (r,))], gpu_uuids={0: info.uuid})
    row = t.to_pylist()[0]
    assert row["energy_j"] is None and row["power_w"] is None
    assert row["power_avg_w"] > 0 and row["gpu_uuid"] == info.uuid


def test_full_card_reports_every_reading_and_the_cap_reason():
    nvml = SimNVML("seed-16g", state_path=None)
    c = NvmlCollector(nvml)
    assert all(c.infos[0].supports.values())
    nvml.gpus[0].set_limit_w(180)
    nvml.gpus[0].set_phase(Phase("decode", 0.45))
    (r,) = c.read()
    assert r.power_w <= 180.0 + 1e-6 and r.enforced_limit_w == 180.0
    assert "SwPowerCap" in clock_event_reason_names(r.clock_event_reasons)
    assert r.energy_j is not None and r.sm_clock_mhz < 2790 and r.mem_clock_mhz == 10251


def test_clock_event_reason_names():
    assert clock_event_reason_names(None) is None
    assert clock_event_reason_names(0) == []
    assert clock_event_reason_names(0x4 | 0x40) == ["SwPowerCap", "HwThermal"]
    assert clock_event_reason_names(0x1000) == ["0x1000"]


def test_cuda_visible_devices_maps_to_nvml_indexes():
    nvml = SimNVML("a100-40g", count=4, state_path=None)
    nvml.nvmlInit()
    uuid2 = nvml.gpus[2].uuid
    assert visible_indexes(nvml, {}) == [0, 1, 2, 3]
    assert visible_indexes(nvml, {"CUDA_VISIBLE_DEVICES": "2,0"}) == [2, 0]
    assert visible_indexes(nvml, {"CUDA_VISIBLE_DEVICES": uuid2[:12]}) == [2]
    assert visible_indexes(nvml, {"CUDA_VISIBLE_DEVICES": "1,7,2"}) == [1]  # CUDA stops at an invalid entry
    assert visible_indexes(nvml, {"CUDA_VISIBLE_DEVICES": ""}) == []


def test_open_sources_honours_cuda_visible_devices(monkeypatch, tmp_path):
    nvml = SimNVML("a100-40g", count=3, state_path=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with open_sources(nvml=nvml, rapl_root=tmp_path) as src:
        assert src.nvml.indexes == [2]
        assert [g["index"] for g in describe(src)["gpus"]] == [2]


def test_a_gpu_index_that_does_not_exist_is_bad_input(tmp_path):
    nvml = SimNVML("seed-16g", count=2, state_path=None)
    with pytest.raises(ValueError, match="GPU index 5 does not exist"):
        open_sources(nvml=nvml, gpus=[0, 5], rapl_root=tmp_path)


def test_machine_without_gpu_or_rapl_still_gets_host_and_says_why(tmp_path):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    no_driver = SimpleNamespace(nvmlInit=fail)
    with open_sources(nvml=no_driver, rapl_root=tmp_path / "none") as src:
        assert src.nvml is None and src.rapl is None and src.host is not None
        info = describe(src)
    assert info["gpus"] == [] and info["rapl"] is None and info["host"]["mem_total_bytes"] > 0
    msgs = {p["source"]: p for p in info["problems"]}
    assert "NVML" in msgs["nvml"]["message"] and "--simulate" in msgs["nvml"]["fix"]
    assert "no RAPL zones" in msgs["rapl"]["message"] and "powercap" in msgs["rapl"]["fix"]


def test_a_rig_whose_sources_fail_to_open_leaves_no_simulated_powercap_running():
    # Before: the simulated powercap tree was made and its updater thread started before open_sources, whose
    # ValueError (a GPU that is not there) left both behind for a caller that never closed the Rig (the daemon's
    # refused start): the thread kept writing in the test process and died later on another test's patched os.pwrite
    # (CI: PytestUnhandledThreadExceptionWarning under an unrelated test).
    import threading

    before = {t for t in threading.enumerate() if t.name.startswith("powerprof-sim-")}
    rig = Rig("seed-16g", gpus=["GPU-00000000"])
    with pytest.raises(ValueError):
        rig.sources
    assert rig.sim_powercap is None
    left = [t.name for t in threading.enumerate() if t.name.startswith("powerprof-sim-") and t not in before]
    assert not left, left
    rig.close()




def test_a_simulated_powercap_tree_that_fails_half_built_is_taken_away(tmp_path, monkeypatch):
    # Rig.sources made the simulated powercap tree outside its try: a tree failing half-way (out of space on its second
    # symlink) left its folder behind, half built.
    import errno
    import threading

    from powerprof.sim.powercap import SIM_POWERCAP_PREFIX

    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))
    real, calls = os.symlink, []

    def symlink(*a, **k):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(os, "symlink", symlink)
    before = {t for t in threading.enumerate() if t.name.startswith("powerprof-sim-")}
    rig = Rig("seed-16g")
    with pytest.raises(OSError, match="No space left"):
        rig.sources
    monkeypatch.setattr(os, "symlink", real)
    assert len(calls) == 2 and rig._powercap_dir is None
    assert not list((tmp_path / "state").glob(SIM_POWERCAP_PREFIX + "*"))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("powerprof-sim-") and t not in before]
    rig.close()

def test_a_given_simulated_gpu_count_is_the_count_and_an_index_past_it_does_not_exist():
    # Before: Rig took max(gpus) + 1 ahead of sim_gpu_count, so `powerprof daemon --simulate --sim-gpus 2` with
    # daemon.gpus = [7] built 8 simulated GPUs and measured gpu7 of a host declared as 2 GPUs, silently.
    rig = Rig("seed-16g", gpus=[7], sim_gpu_count=2)
    with pytest.raises(ValueError, match=re.escape("GPU index 7 does not exist: this machine has 2 GPU(s) (0-1)")):
        rig.sources
    assert len(rig.nvml.gpus) == 2
    rig.close()
    # No count given: the indexes make the host (docs/collectors.md: `--simulate --gpus 0,1` simulates two GPUs).
    with Rig("seed-16g", gpus=[7]) as rig:
        assert len(rig.nvml.gpus) == 8 and rig.sources.nvml.indexes == [7]

def test_simulated_unprivileged_machine_lists_each_permission_problem_with_its_fix(monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_UNPRIVILEGED", "1")
    with Rig("seed-16g") as rig:
        info = rig.describe()
        root = rig.sim_powercap.root
    assert not root.exists(), "the simulated powercap folder is removed on close"
    assert info["can_set_limits"] is False and info["rapl"] is None
    by = {p["source"]: p for p in info["problems"]}
    assert "ExecStartPre=+" in by["rapl"]["fix"]
    assert "CAP_SYS_ADMIN" in by["nvml"]["fix"]


CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait irq softirq steal guest guest_nice")


class FakePsutil:
    def __init__(self, freq_raises=False):
        self.t = 0
        self.freq_raises = freq_raises

    def cpu_times(self):
        # 4 s of CPU time per call, 1 s of it idle and 1 s iowait: 50% busy as psutil counts it.
        self.t += 1
        n = self.t
        return CpuTimes(2.0 * n, 0.0, 0.0, 1.0 * n, 1.0 * n, 0.0, 0.0, 0.0, 0.0, 0.0)

    def cpu_freq(self):
        if self.freq_raises:
            raise FileNotFoundError("no cpufreq in this VM")
        return SimpleNamespace(current=3100.0)

    def virtual_memory(self):
        return SimpleNamespace(total=16 * 2**30, available=10 * 2**30)


def test_host_collector_reads_utilisation_frequency_memory():
    r = HostCollector(FakePsutil()).read()
    assert r.cpu_util_pct == pytest.approx(50.0)
    assert r.cpu_freq_mhz == 3100.0 and r.mem_used_bytes == 6 * 2**30 and r.mem_total_bytes == 16 * 2**30


def test_host_collector_reports_missing_frequency_as_none():
    r = HostCollector(FakePsutil(freq_raises=True)).read()
    assert r.cpu_freq_mhz is None and r.cpu_util_pct is not None


def test_host_collector_on_this_machine():
    h = HostCollector()
    r = h.read()
    assert r.mem_total_bytes > 0 and (r.cpu_util_pct is None or 0.0 <= r.cpu_util_pct <= 100.0)


def test_simulated_powercap_tree_lives_in_the_state_folder_and_dead_processes_trees_are_removed(tmp_path):
    state = Path(os.environ["POWERPROF_STATE_DIR"])
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from powerprof.rig import Rig\n"
         "rig = Rig('seed-16g'); rig.sources\n"
         "print(rig.sim_powercap.root, flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        leaked = Path(child.stdout.readline().strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
    assert leaked.parent == state and leaked.name.startswith(f"powerprof-powercap-{child.pid}-")
    assert leaked.is_dir(), "SIGKILL skips close(): the tree is left behind"
    alive = state / f"powerprof-powercap-{os.getppid()}-keep"  # a live process's tree
    legacy = state / "powerprof-powercap-abc123"  # no pid in the name: cannot tell, keep it
    alive.mkdir()
    legacy.mkdir()
    with Rig("seed-16g") as rig:
        mine = Path(rig.sources and rig.sim_powercap.root)
        assert mine.parent == state and mine.name.startswith(f"powerprof-powercap-{os.getpid()}-")
        assert not leaked.exists()
        assert alive.is_dir() and legacy.is_dir()
    assert not mine.exists()


def test_simulated_powercap_tree_falls_back_to_the_temp_folder(monkeypatch, tmp_path):
    from powerprof.sim.powercap import sim_powercap_parent

    assert sim_powercap_parent({"POWERPROF_STATE_DIR": "/s", "XDG_STATE_HOME": "/x"}) == "/s"
    assert sim_powercap_parent({"XDG_STATE_HOME": "/x"}) == "/x/powerprof"
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert sim_powercap_parent({}) == str(tmp_path)


def test_the_energy_counters_alone_are_read_for_edges_or_none_without_a_counter():
    nvml = SimNVML("h200-141g", count=2, state_path=None)
    c = NvmlCollector(nvml)
    full = c.read()
    alone = c.read_energy_j()
    assert len(alone) == 2 and all(a >= f.energy_j for a, f in zip(alone, full))
    assert NvmlCollector(SimNVML("pascal-8g", state_path=None)).read_energy_j() is None  # no counter: no edge


# --- cards that misbehave (powerprof/sim/faults.py) ---------------------------------------------------

from powerprof.profiler import EnergyTimeline  # noqa: E402
from powerprof.sim.faults import FaultyNVML, stuck  # noqa: E402


def _faulty(count=2, profile="a100-40g"):
    nv = FaultyNVML(SimNVML(profile, count=count, state_path=None))
    now = [0]
    return nv, NvmlCollector(nv, list(range(count)), clock_ns=lambda: now[0]), now


def test_a_gpu_that_falls_off_the_bus_says_so_on_every_tick_and_in_the_stored_row():
    nv, c, _ = _faulty()
    nv.lose(1)
    r0, r1 = c.read()
    assert r0.energy_j is not None and r0.note is None  # the other GPU reads on
    assert all(getattr(r1, f) is None for f in ("power_avg_w", "energy_j", "power_limit_w", "temperature_c"))
    assert "GPU_IS_LOST" in r1.note and "nvidia-smi -r" in r1.note and 1 in c.lost
    row = samples_to_table([Sample("nvml", 0, 1, 1_700_000_000_000_000_000, (r0, r1))]).to_pylist()[1]
    assert row["energy_j"] is None and "GPU_IS_LOST" in row["error"]
    calls = nv.calls.get("nvmlDeviceGetTemperature", 0)
    c.read()
    assert nv.calls.get("nvmlDeviceGetTemperature", 0) == calls + 1  # a lost GPU is not asked ten more times


def test_a_reading_that_fails_once_is_missing_for_that_tick_with_the_error_named():
    nv, c, _ = _faulty(1)
    nv.fail(0, "nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_TIMEOUT)
    (r,) = c.read()
    assert r.power_avg_w is None and "GetPowerUsage: NVML_ERROR_TIMEOUT" in r.note
    (r,) = c.read()
    assert r.power_avg_w > 0 and r.note is None


@pytest.mark.parametrize("fn", ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues"])
@pytest.mark.parametrize("mw", [65_535_000, 0])
def test_an_absurd_power_reading_is_dropped_with_a_reason_never_integrated(fn, mw):
    nv, c, _ = _faulty(1)

    def absurd(got):
        if fn == "nvmlDeviceGetPowerUsage":
            return mw
        got[0].value.uiVal = mw
        return got

    nv.lie(0, fn, absurd)
    (r,) = c.read()
    got = r.power_avg_w if fn == "nvmlDeviceGetPowerUsage" else r.power_w
    assert got is None and "reading dropped" in r.note and f"{mw / 1000:g} W" in r.note


def test_a_stuck_energy_counter_is_dropped_and_a_jump_breaks_the_counter_epoch():
    nv, c, now = _faulty(1)
    nv.gpus[0].set_phase(Phase("decode", 0.25))
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", stuck(), times=None)
    (r,) = c.read()
    now[0] = int(0.5e9)
    assert c.read()[0].energy_j == r.energy_j  # within one refresh: still a reading
    now[0] = int(1.5e9)
    (r,) = c.read()
    assert r.energy_j is None and "stuck" in r.note
    assert c.read_energy_j() is None  # the daemon's edges take no stuck value either
    nv.heal()
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", lambda mj: mj + 50_000_000)  # +50 kJ in one read
    now[0] = int(2.5e9)
    (r,) = c.read()
    assert r.energy_epoch == 1 and "jumped" in r.note


def test_a_jump_seen_on_an_edge_read_is_said_by_the_next_tick_and_not_taken_as_the_baseline():
    nv, c, now = _faulty(1)
    added = iter([0, 5_000_000, 200_000])  # mJ on top of the true count: a good read, one corrupt (+5 kJ), a good one
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", lambda mj: mj + next(added), times=None)
    c.read()
    now[0] = int(1e9)
    assert c.read_energy_j() is None  # the edge takes no jumped value
    now[0] = int(2e9)
    (r,) = c.read()
    assert r.energy_j is not None, "the good read after one corrupt read is a reading"
    assert r.energy_epoch == 1, "energy across the corrupt read stays unknown"
    assert "edge read" in r.note and "jumped 5000 J" in r.note
    assert "went back" not in r.note and "driver reload" not in r.note


def test_a_counter_that_really_jumped_is_taken_from_the_read_after_the_jump():
    nv, c, now = _faulty(1)
    added = iter([0, 5_000_000, 5_200_000])  # mJ on top of the true count: the counter jumps 5 kJ and goes on from there
    nv.lie(0, "nvmlDeviceGetTotalEnergyConsumption", lambda mj: mj + next(added), times=None)
    c.read()
    now[0] = int(1e9)
    (r,) = c.read()
    assert r.energy_j is None and "jumped" in r.note and r.energy_epoch == 1
    now[0] = int(2e9)
    (r,) = c.read()
    assert r.energy_j is not None and r.energy_j > 5000 and r.note is None and r.energy_epoch == 1


def test_a_window_across_a_counter_jump_is_not_the_jump_but_integrated_power():
    tl = EnergyTimeline(1, (1.0,))
    S = 1_000_000_000

    def feed(t_s, e_j, epoch):
        from powerprof.collectors.nvml import GpuReading
        r = GpuReading(0, None, 300.0, e_j, None, None, None, None, None, None, None, None, None, energy_epoch=epoch)
        tl.add(Sample("nvml", 0, int(t_s * S), 0, (r,)))

    for k in range(11):
        feed(k, 300.0 * k + (50_000.0 if k >= 5 else 0.0), 1 if k >= 5 else 0)
    res = tl.energy_between(2 * S, 8 * S)
    assert res.gpu_methods == ("avg_power_integration",) and res.gpu_energy_j[0] == pytest.approx(1800.0)


def test_a_gpu_lost_before_start_is_left_out_with_the_fix_and_the_others_open():
    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=None))
    nv.lose(1)
    src = open_sources(nv, None, rapl_root="/nonexistent", host=False, privileged=lambda: True)
    assert src.nvml.indexes == [0] and [g["index"] for g in describe(src)["gpus"]] == [0]
    (p,) = [p for p in src.problems if p.source == "nvml"]
    assert "gpu1" in p.message and "GPU_IS_LOST" in p.message and "nvidia-smi -r" in p.fix


def test_a_card_with_neither_energy_nor_power_is_not_said_to_integrate_power():
    nv = FaultyNVML(SimNVML("pascal-8g", state_path=None))
    nv.fail(0, "nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED, times=None)
    src = open_sources(nv, [0], rapl_root="/nonexistent", host=False, privileged=lambda: True)
    (p,) = [p for p in src.problems if p.source == "nvml"]
    assert "integrated" not in p.message and "no power reading" in p.message and p.fix


def test_a_card_without_an_energy_counter_says_short_requests_are_marked_and_the_fix():
    # The daemon's startup warning on Pascal said "energy is integrated from power" and nothing of what that costs:
    # a request between two power reads is marked no-counter-short and left out of the daemon's J/token.
    src = open_sources(SimNVML("pascal-8g", state_path=None), [0], rapl_root="/nonexistent", host=False,
                       privileged=lambda: True)
    (p,) = [p for p in src.problems if p.source == "nvml"]
    assert "has no energy counter (pre-Volta): energy is integrated from power" in p.message, p.message
    assert "no-counter-short" in p.message and "leaves it out of its J/token" in p.message, p.message
    assert p.fix and "energy counter (Volta and newer)" in p.fix, p.fix


def test_numeric_cuda_visible_devices_on_mixed_gpus_warns_that_cuda_may_number_them_otherwise(monkeypatch):
    nv = FaultyNVML(SimNVML("a100-40g", count=2, state_path=None))
    nv.lie(1, "nvmlDeviceGetName", lambda _: "Tesla T4", times=None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    src = open_sources(nv, None, rapl_root="/nonexistent", host=False, privileged=lambda: True)
    assert src.nvml.indexes == [1]
    (p,) = [p for p in src.problems if "CUDA_DEVICE_ORDER" in p.message]
    assert "fastest" in p.message and "PCI_BUS_ID" in p.fix
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # both number by PCI bus: nothing to say
    src = open_sources(nv, None, rapl_root="/nonexistent", host=False, privileged=lambda: True)
    assert not [p for p in src.problems if "CUDA_DEVICE_ORDER" in p.message]


def test_a_mig_instance_no_gpu_holds_in_cuda_visible_devices_is_said_not_said_to_hide_every_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-4b0d8f5c-1a2b-5c3d-9e8f-0123456789ab")
    src = open_sources(SimNVML("a100-40g", count=2, state_path=None), None, rapl_root="/nonexistent", host=False,
                       privileged=lambda: True)
    (p,) = [p for p in src.problems if p.source == "nvml"]
    assert "MIG-4b0d8f5c" in p.message and "no MIG instance of this machine" in p.message
    assert "--gpus" in p.fix and "whole GPU" in p.fix


# --- MIG: an instance stands for its parent GPU, whose figures are every instance's (powerprof/sim/mig.py) ----------

from powerprof.sim.mig import MigNVML  # noqa: E402


def _mig(instances={1: 3}):
    nv = MigNVML(SimNVML("a100-40g", count=2, state_path=None), instances)
    nv.nvmlInit()
    return nv, {i: nv.mig_uuids(i) for i in instances}


def _mig_problem(src):
    (p,) = [p for p in src.problems if p.source == "nvml" and "MIG" in p.message]
    return p


def test_a_mig_instance_in_cuda_visible_devices_is_measured_as_its_parent_gpu_and_said_to_be_shared(monkeypatch):
    nv, uuids = _mig()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids[1][2])
    src = open_sources(nv, None, rapl_root="/nonexistent", host=False, privileged=lambda: True)
    assert src.nvml.indexes == [1] and src.nvml.infos[0].mig_mode is True
    p = _mig_problem(src)
    assert p.message.startswith(f"{uuids[1][2]} is a MIG instance of gpu1 ({src.nvml.infos[0].uuid}), measured as that whole GPU")
    assert "J/token of one instance is not attributable" in p.message
    assert "a power limit or clock lock applies to the whole GPU, every instance" in p.message
    r = src.nvml.read()[0]
    assert r.power_avg_w > 0 and r.energy_j is not None  # the whole GPU's readings, which MIG handles do not have
    src.close()


def test_mig_instances_by_uuid_prefix_or_old_form_in_gpus_map_to_their_parent_once():
    nv, uuids = _mig({0: 2, 1: 2})
    gpu1 = nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(1))
    src = open_sources(nv, [uuids[1][0][:12], uuids[1][1], f"MIG-{gpu1}/1/0"], rapl_root="/nonexistent", host=False,
                       privileged=lambda: True)
    assert src.nvml.indexes == [1]
    assert "are MIG instances of gpu1" in _mig_problem(src).message
    src.close()
    with pytest.raises(ValueError, match="names no GPU or MIG instance"):
        open_sources(nv, ["MIG-00000000-0000"], rapl_root="/nonexistent", host=False, privileged=lambda: True)


def test_a_gpu_in_mig_mode_named_by_index_is_said_to_be_shared_and_a_whole_gpu_is_not():
    nv, _ = _mig({1: 2})
    src = open_sources(nv, [0, 1], rapl_root="/nonexistent", host=False, privileged=lambda: True)
    p = _mig_problem(src)
    assert p.message.startswith("gpu1 (") and "is in MIG mode" in p.message and "gpu0" not in p.message
    assert "whole GPU" in p.fix


def test_a_mig_device_handle_has_no_power_of_its_own():
    nv, _ = _mig({0: 1})
    mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(nv.nvmlDeviceGetHandleByIndex(0), 0)
    with pytest.raises(pynvml.NVMLError):
        nv.nvmlDeviceGetPowerUsage(mh)
    assert nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mh) == nv.nvmlDeviceGetHandleByIndex(0)


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_INVALID_ARGUMENT,
                                  pynvml.NVML_ERROR_UNINITIALIZED], ids=["lost", "invalid-argument", "uninitialized"])
def test_a_reset_gpu_is_reopened_by_uuid_at_a_bounded_rate_with_a_new_energy_epoch(code):
    import time

    from powerprof.collectors import nvml as nvmlmod

    nv, c, now = _faulty()
    S = 1_000_000_000
    nv.gpus[1].set_phase(Phase("decode", 0.25))
    time.sleep(0.2)  # the counter runs on real time: some joules before the reset
    before = c.read()[1]
    assert before.energy_j > 0 and before.energy_epoch == 0
    by_index = nv.calls.get("nvmlDeviceGetHandleByIndex", 0)
    nv.lose(1)  # nvidia-smi -r in progress: nothing answers
    now[0] = 1 * S
    r1 = c.read()[1]
    assert r1.energy_j is None and 1 in c.lost
    for k in range(8):  # ticks within REOPEN_INTERVAL_S: one lookup by UUID, not one per tick
        now[0] = int((1.5 + 0.5 * k) * S)
        assert c.read()[1].energy_j is None
    assert nv.calls.get("nvmlDeviceGetHandleByUUID", 0) == 1
    nv.heal()
    nv.reset(1, code)  # back, counter from zero, the old handle stale
    now[0] = int((1.5 + nvmlmod.REOPEN_INTERVAL_S + 0.1) * S)  # the first lookup was at 1.5 s
    r0, r1 = c.read()
    assert 1 not in c.lost and r1.energy_j is not None and r1.power_avg_w > 0
    assert r1.energy_j < before.energy_j  # the counter restarted ...
    assert r1.energy_epoch > before.energy_epoch  # ... so nothing is differenced across it
    assert "reopened by its UUID" in r1.note
    assert nv.calls.get("nvmlDeviceGetHandleByIndex", 0) == by_index  # never by index: a reset may renumber
    assert c.handles[1].generation == 1
    if code == pynvml.NVML_ERROR_UNINITIALIZED:
        # A driver reload stops every GPU's session: GPU 0, read first, failed too and is back a tick later.
        assert 0 in c.lost
        now[0] += S // 100
        r0 = c.read()[0]
        assert 0 not in c.lost and r0.energy_epoch == 1
    else:
        assert r0.power_avg_w > 0 and r0.energy_epoch == 0 and c.reopened == [0, 1]  # the other GPU never stopped


def test_a_stale_handle_is_said_with_what_powerprof_does_about_it():
    nv, c, _ = _faulty()
    c.read()
    nv.reset(1, pynvml.NVML_ERROR_INVALID_ARGUMENT)
    nv.lose(1)  # still down: the first lookup by UUID finds no answer
    r1 = c.read()[1]
    assert "NVML_ERROR_INVALID_ARGUMENT" in r1.note and "by UUID" in r1.note and 1 in c.lost
