"""What nvmlDeviceGetPowerUsage averages over, per GPU generation: the simulator plays it and the collector
assumes it the way NVIDIA documents it, for every simulated profile.

NVIDIA's NVML reference (nvmlDeviceGetPowerUsage): "On Ampere (except GA100) or newer GPUs, the API returns
power averaged over 1 sec interval. On GA100 and older architectures, instantaneous power is returned."
nvml.h: NVML_FI_DEV_POWER_AVERAGE (185) is "supported on Ampere (except GA100) or newer", NVML_FI_DEV_POWER_INSTANT
(186) "on all architectures" (given a driver that knows the field)."""

from __future__ import annotations

import pynvml
import pytest

from powerprof.collectors.nvml import NvmlCollector, power_average_window_s
from powerprof.sim.gpu import Phase
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import PROFILES

# NVIDIA's rule, written out per profile: a new profile must say which side of it its card is on.
DOCUMENTED_WINDOW_S = {
    "seed-16g": 1.0,  # Ada
    "a100-40g": 0.0,  # GA100: instant
    "h200-141g": 1.0,  # Hopper
    "pascal-8g": 0.0,  # older than Ampere: instant
    "l4-24g": 1.0,  # Ada
}


class _Clock:
    def __init__(self):
        self.t = 10_000_000_000

    def __call__(self):
        return self.t


def test_every_profile_is_listed_here():
    assert set(DOCUMENTED_WINDOW_S) == set(PROFILES)


@pytest.mark.parametrize("key", sorted(DOCUMENTED_WINDOW_S))
def test_the_simulator_averages_power_usage_as_nvidia_documents_for_the_card(key):
    """A step from idle to busy: 0.2 s later an averaging card still reads mostly idle, an instant one the new power."""
    clock = _Clock()
    nv = SimNVML(key, state_path=None, clock_ns=clock)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    g = nv.gpus[0]
    clock.t += 5_000_000_000  # idle for 5 s
    idle_w = g.true_power_w()
    g.set_phase(Phase("prefill", 0.9))
    busy_w = g.true_power_w()
    assert busy_w > idle_w + 20
    clock.t += 200_000_000
    read_w = nv.nvmlDeviceGetPowerUsage(h) / 1000
    if DOCUMENTED_WINDOW_S[key] == 0:
        assert read_w == pytest.approx(busy_w, abs=0.01)
    else:  # 0.2 s of a 1 s window at the new power
        assert read_w == pytest.approx(idle_w + 0.2 * (busy_w - idle_w), abs=1.0)


@pytest.mark.parametrize("key", sorted(DOCUMENTED_WINDOW_S))
def test_the_collector_assumes_the_window_the_card_has(key):
    info = NvmlCollector(SimNVML(key, state_path=None)).infos[0]
    assert info.power_avg_window_s == DOCUMENTED_WINDOW_S[key]


@pytest.mark.parametrize("key", sorted(DOCUMENTED_WINDOW_S))
def test_the_average_power_field_exists_only_where_the_card_averages(key):
    """Field 185 is the 1 s average, which GA100 and older cards do not keep."""
    nv = SimNVML(key, state_path=None)
    nv.nvmlInit()
    (v,) = nv.nvmlDeviceGetFieldValues(nv.nvmlDeviceGetHandleByIndex(0), [pynvml.NVML_FI_DEV_POWER_AVERAGE])
    ok = v.nvmlReturn == pynvml.NVML_SUCCESS
    assert ok == (DOCUMENTED_WINDOW_S[key] > 0 and nv.gpus[0].profile.has_instant_power)


@pytest.mark.parametrize("name, arch, window_s", [
    ("NVIDIA A100-SXM4-40GB", "AMPERE", 0.0),
    ("NVIDIA A100 80GB PCIe", "AMPERE", 0.0),
    ("NVIDIA A100X", "AMPERE", 0.0),
    ("NVIDIA A800-SXM4-80GB", "AMPERE", 0.0),  # GA100 too
    ("NVIDIA A30", "AMPERE", 0.0),  # GA100 too
    ("NVIDIA RTX A3000 Laptop GPU", "AMPERE", 1.0),  # GA104: "A30" inside a longer number is not an A30
    ("NVIDIA A10", "AMPERE", 1.0),  # GA102
    ("NVIDIA A40", "AMPERE", 1.0),
    ("NVIDIA GeForce RTX 3090", "AMPERE", 1.0),
    ("Tesla V100-SXM2-32GB", "VOLTA", 0.0),
    ("Tesla T4", "TURING", 0.0),
    ("NVIDIA L4", "ADA", 1.0),
    ("NVIDIA H100 80GB HBM3", "HOPPER", 1.0),
    ("NVIDIA B200", "BLACKWELL", 1.0),
])
def test_the_window_by_architecture_and_chip(name, arch, window_s):
    code = getattr(pynvml, f"NVML_DEVICE_ARCH_{arch}", None)
    if code is None:
        pytest.skip(f"this pynvml has no NVML_DEVICE_ARCH_{arch}")
    assert power_average_window_s(pynvml, code, name) == window_s
