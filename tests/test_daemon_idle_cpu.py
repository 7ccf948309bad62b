"""The idle daemon's accounting loop does no work a reader cannot see: the /metrics snapshot is built once per new
sample and at each scrape, not at every one of the loop's four passes a sampling interval (issue 13's CPU target)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

import powerprof.daemon.service as service
from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML


def _daemon(tmp_path, interval_s: float) -> Daemon:
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": interval_s, "daemon.flush_interval_s": 30.0,
        "proxy.listen": "", "metrics.listen": "127.0.0.1:0", "daemon.restore_on_start": False,
    })
    return Daemon(cfg, Rig("a100-40g", gpus=[0, 1], nvml=SimNVML("a100-40g", count=2, state_path=None)))


async def _wait(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_idle_passes_do_not_rebuild_the_snapshot_and_a_scrape_reads_the_state_of_its_moment(tmp_path, monkeypatch):
    d = _daemon(tmp_path, interval_s=1.0)
    builds, passes, gpu_samples = [0], [0], [0]
    real_snapshot, real_advance = service.Snapshot, None  # the loop's own, counted

    def counted_snapshot(*a, **k):
        builds[0] += 1
        return real_snapshot(*a, **k)

    monkeypatch.setattr(service, "Snapshot", counted_snapshot)
    real_on_sample = d._on_sample

    def on_sample(s):
        if s.source == "nvml":
            gpu_samples[0] += 1
        real_on_sample(s)

    d._on_sample = on_sample  # subscribed by run(): counts the sampler's NVML ticks

    async def main():
        nonlocal real_advance
        task = asyncio.create_task(d.run())
        await _wait(lambda: "metrics" in d.urls and d.ledger is not None)
        real_advance = d.ledger.advance

        def advance(*a, **k):
            passes[0] += 1
            return real_advance(*a, **k)

        d.ledger.advance = advance
        await _wait(lambda: passes[0] >= 1)
        b0, s0, p0 = builds[0], gpu_samples[0], passes[0]
        await _wait(lambda: passes[0] >= p0 + 12)  # three seconds of passes at 4 Hz
        b1, s1, p1 = builds[0], gpu_samples[0], passes[0]
        # A scrape reads the daemon's state at that moment, not a snapshot up to a pass old.
        d.requests_by_tag[("probe-tag", "ok")] += 7
        async with aiohttp.ClientSession() as http:
            async with http.get(d.urls["metrics"] + "/metrics") as resp:
                text = await resp.text()
        d.stop_event.set()
        return (b1 - b0, s1 - s0, p1 - p0), text, await task

    (built, sampled, passed), text, rc = asyncio.run(asyncio.wait_for(main(), 90))
    assert rc == 0
    # At most two builds a sampling interval (the pass that drains its sample, the pass that closes its interval),
    # plus one at the edge of the count; never one per pass (12 passes, about 3 samples).
    assert passed >= 12 and built <= 2 * sampled + 1, (built, sampled, passed)
    probe = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.labels.get("tag") == "probe-tag" and s.name.startswith("powerprof_requests")]
    assert probe == [7.0], probe
