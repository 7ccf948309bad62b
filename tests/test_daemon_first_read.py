"""A request sent the moment the daemon accepts is measured from its arrival, however late NVML's first read comes."""

from __future__ import annotations

import asyncio
import time

import pytest

from daemon_helpers import read_dataset
from powerprof.rig import Rig

DELAY_S = 0.5  # NVML's first read this late (a loaded host, a driver slow to answer its first call)


def _first_request_at_once(tmp_path, monkeypatch, delay_s: float):
    """The daemon in this process (simulated GPU, RAPL and server), NVML's first read made `delay_s` late, one
    streamed completion sent the moment the proxy listens: (its row, the simulator's truth for it)."""
    import aiohttp

    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.sim.nvml import SimNVML

    read = NvmlCollector.read

    def late_first_read(self):
        if not getattr(self, "_read_once", False):
            self._read_once = True
            time.sleep(delay_s)
        return read(self)

    monkeypatch.setattr(NvmlCollector, "read", late_first_read)
    truth: dict = {}

    async def main():
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.25, "daemon.flush_interval_s": 0.2,
            "proxy.listen": "127.0.0.1:0", "metrics.listen": "", "daemon.restore_on_start": False})
        rig = Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=None), host_cpu_time=None)
        d = Daemon(cfg, rig)
        task = asyncio.create_task(d.run())
        while not task.done() and "proxy" not in d.urls:  # as a client waiting on the port would
            await asyncio.sleep(0.002)
        body = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as s:
            async with s.post(d.urls["proxy"] + "/v1/completions", json=body,
                              headers={"X-Sim-Request-Id": "first"}) as r:
                assert r.status == 200
                await r.read()
        deadline = time.monotonic() + 60  # until its intervals have closed (bounded: a loaded machine is slow)
        while time.monotonic() < deadline and d.ledger.requests:
            await asyncio.sleep(0.05)
        truth.update(rig._sim_servers[0].request_truth()["first"])
        d.stop_event.set()
        assert await task == 0

    asyncio.run(asyncio.wait_for(main(), 120))
    (row,) = read_dataset(tmp_path / "data", "requests").to_dict("records")
    return row, truth


def test_a_request_at_once_gets_its_gpu_energy_from_arrival_though_nvmls_first_read_is_late(tmp_path, monkeypatch):
    # Before, the proxy listened before the sampler's first NVML read, and the first interval began at that read: a
    # request that came first lost the GPU energy of its run before it, with nothing said.
    row, truth = _first_request_at_once(tmp_path, monkeypatch, DELAY_S)
    assert truth["energy_j"] > 0 and row["gpu_energy_j"] is not None, (row, truth)
    err = row["gpu_energy_j"] / truth["energy_j"] - 1
    # Alone on the simulator a request is measured within a few % (docs/daemon.md, Short sampling intervals); 12%
    # leaves a loaded machine room and still fails the DELAY_S of its run lost.
    assert abs(err) < 0.12, (row["gpu_energy_j"], truth["energy_j"], err, row["energy_note"])
