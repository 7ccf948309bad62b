"""Another process's work on the GPU beside the server, judged from NVML's per-process utilisation samples: kernels,
memory bandwidth and the video engines count; the server's own processes never do; a share too small to move a
decode's figures is said, not flagged; where the newer sample call is missing the older one answers, and where
neither does, another process's work cannot be ruled out (flagged, said why)."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest

from powerprof.sim.bystander import GpuBystander
from powerprof.sim.gpu import Phase
from powerprof.sim.nvml import SimNVML
from powerprof.workload.others import GpuNeighbours

SERVER = 4242  # the server's pid, as workload/serverprocs.py would find it


def _watch(sim):
    sim.add_process(0, SERVER, 10 << 30, lambda: 1.0)  # the server decoding: 100% SM, 50% memory in its samples
    gpu = SimpleNamespace(indexes=[0], handles=[sim.nvmlDeviceGetHandleByIndex(0)], nvml=sim)
    return GpuNeighbours(gpu, server_procs=lambda: ({SERVER}, ""))


def test_the_servers_own_traffic_raises_nothing():
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    assert _watch(sim).check() is None


@pytest.mark.parametrize("v2", [None, pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
@pytest.mark.parametrize("kind,kw,said", [
    ("memory", dict(share=0.0, mem_share=0.4), "without kernels on GPU 0 beside the server (up to 40% of the memory bandwidth)"),
    ("decoder", dict(power_w=25.0, share=0.0, dec_share=0.5), "without kernels on GPU 0 beside the server (up to 50% of the video decoder)"),
    ("kernels", dict(power_w=60.0, share=0.3), "ran kernels on GPU 0 beside the server (up to 30% SM utilisation"),
])
def test_a_neighbour_working_without_kernels_is_seen_through_either_call(kind, kw, said, v2):
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    sim.v2_process_util = v2  # the newer call missing (drivers before 550) or unsupported: the older one answers
    watch = _watch(sim)
    by = GpuBystander(sim, 0, pid=777, **kw).start()
    why = watch.check()
    by.stop()
    assert why is not None and said in why, why
    assert watch.seen == {777}


def test_a_sliver_of_memory_traffic_is_said_not_flagged():
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    watch = _watch(sim)
    GpuBystander(sim, 0, pid=777, share=0.0, mem_share=0.01).start()
    assert watch.check() is None
    assert any("1% of the memory bandwidth" in n and "not flagged" in n for n in watch.notes.values()), watch.notes


class _NoProcessUtil(SimNVML):
    def nvmlDeviceGetProcessUtilization(self, handle, time_stamp_us):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_without_either_sample_call_another_process_cannot_be_ruled_out():
    sim = _NoProcessUtil("seed-16g", state_path=None)
    sim.nvmlInit()
    sim.v2_process_util = pynvml.NVML_ERROR_NOT_SUPPORTED
    watch = _watch(sim)
    GpuBystander(sim, 0, pid=777, share=0.0).start()  # idle or not: NVML cannot say
    why = watch.check()
    assert why is not None and "cannot be ruled out" in why and "NVML_ERROR_NOT_SUPPORTED" in why, why


def test_a_memory_neighbour_slows_a_memory_bound_decode_and_adds_watts():
    """The simulator's physics: a neighbour streaming 40% of the bandwidth stretches the decode step's memory part
    by 1/(1 - 0.4) and keeps the memory busy: slower and more watts at the same clock (no cap reached)."""
    sim = SimNVML("seed-16g", state_path=None)
    g = sim.gpus[0]
    g.set_phase(Phase("decode", 0.3))
    speed0, power0, mem0 = g.speed_factor(), g.true_power_w(), g.utilization()[1]
    g.set_bystander(0.0, 0.0, mem_share=0.4)
    speed1, power1 = g.speed_factor(), g.true_power_w()
    assert speed1 == pytest.approx(speed0 * (0.7 + 0.3) / (0.7 / 0.6 + 0.3), rel=0.02)
    assert power1 > power0
    assert g.utilization()[1] >= mem0 + 10  # the memory busier: the server's stretched traffic and the neighbour's
    g.set_bystander(0.0, 0.0, 0.0)
    assert g.speed_factor() == pytest.approx(speed0) and g.true_power_w() == pytest.approx(power0)


def _mps(sim, *, stranger: bool):
    """The server as an MPS client on GPU 0 (NVML's MPS list only), the MPS server on the compute list working (as if
    NVML charged its clients' work to it); with `stranger`, another's idle MPS client beside them."""
    sim.add_process(0, SERVER, 10 << 30, lambda: 1.0, mps=True)
    sim.add_process(0, 555, 300 << 20, lambda: 1.0, name="/usr/bin/nvidia-cuda-mps-server")
    if stranger:
        sim.add_process(0, 777, 2 << 30, lambda: 0.0, mps=True)
    gpu = SimpleNamespace(indexes=[0], handles=[sim.nvmlDeviceGetHandleByIndex(0)], nvml=sim)
    return GpuNeighbours(gpu, server_procs=lambda: ({SERVER}, ""))


def test_the_mps_server_serving_only_the_servers_clients_is_not_anothers_work():
    # With the MPS list read, the server's clients are found on the GPU and the samples judged; the MPS server's pid
    # was taken for another's process, and work NVML charged to it flagged every batch foreign-traffic. (How NVML
    # charges an MPS client's work is not verified on hardware: both ways are covered.)
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    watch = _mps(sim, stranger=False)
    assert watch.check() is None
    assert any("MPS server" in n and "not verified on hardware" in n for n in watch.notes.values()), watch.notes


def test_the_mps_servers_work_beside_anothers_client_is_not_ruled_out():
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    watch = _mps(sim, stranger=True)
    why = watch.check()
    assert why is not None and "MPS server" in why and "cannot be told" in why, why
    assert watch.unsure == {777}


def test_mps_stranger_client_that_exited_before_the_look_is_missed():
    # Another's MPS client listed when the batch began, gone by the look: the MPS server's work was taken as the server's
    # clients' (a note) because nothing but the server's was listed at the look, though the stranger may have done it.
    # Every list read over the batch (its start and the look) counts now: whose work it was cannot be told.
    sim = SimNVML("seed-16g", state_path=None)
    sim.nvmlInit()
    sim.add_process(0, SERVER, 10 << 30, lambda: 0.0, mps=True)
    sim.add_process(0, 555, 300 << 20, lambda: 1.0, name="/usr/bin/nvidia-cuda-mps-server")
    sim.add_process(0, 777, 2 << 30, lambda: 0.0, mps=True)
    gpu = SimpleNamespace(indexes=[0], handles=[sim.nvmlDeviceGetHandleByIndex(0)], nvml=sim)
    watch = GpuNeighbours(gpu, server_procs=lambda: ({SERVER}, ""))
    sim.remove_process(0, 777)
    why = watch.check()
    assert why is not None and "cannot be told" in why, watch.notes
    assert watch.unsure == {777}
    # The next batch starts at that look, where 777 was gone: nothing but the server's listed over it, taken as ours.
    assert watch.check() is None
