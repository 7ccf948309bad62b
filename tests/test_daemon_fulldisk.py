"""A full disk: writes fail, the daemon logs it, keeps rows in memory, and the proxy keeps passing traffic."""

from __future__ import annotations

import asyncio
import errno
import logging

import aiohttp

from powerprof.daemon.config import load_config
from powerprof.daemon.service import Daemon
from powerprof.daemon.store import write_file_atomic
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML


def test_enospc_is_logged_rows_wait_in_memory_and_traffic_flows(tmp_path, caplog):
    disk_full = {"on": True}

    def writer(path, table):
        if disk_full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_file_atomic(path, table)

    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.1, "daemon.flush_interval_s": 0.1,
        "proxy.listen": "127.0.0.1:0", "metrics.listen": "", "daemon.restore_on_start": False,
    })
    d = Daemon(cfg, Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=None)), store_write=writer)

    async def main():
        task = asyncio.create_task(d.run())
        for _ in range(200):
            if "proxy" in d.urls:
                break
            await asyncio.sleep(0.05)
        statuses = []
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                # /v1/completions: the rig's simulated server is vLLM's, which has no /completion.
                async with s.post(d.urls["proxy"] + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": i % 2 == 0}) as r:
                    statuses.append(r.status)
                    await r.read()
        await asyncio.sleep(0.5)
        failing = (d.store.flush_errors, d.store.buffered())
        disk_full["on"] = False
        await asyncio.sleep(0.6)
        d.stop_event.set()
        rc = await task
        return statuses, failing, rc

    with caplog.at_level(logging.ERROR, logger="powerprof.daemon.store"):
        statuses, (errors, buffered), rc = asyncio.run(asyncio.wait_for(main(), 60))
    assert statuses == [200] * 6 and rc == 0
    assert errors > 0 and buffered > 0
    assert any("disk full" in r.getMessage() for r in caplog.records)
    # One log line per failing spell, not one per flush.
    assert sum("disk full" in r.getMessage() for r in caplog.records) < errors
    assert d.store.buffered() == 0 and d.store.written_rows["requests"] == 6


def test_a_full_disk_at_start_keeps_the_lock_and_starts(tmp_path, monkeypatch, caplog):
    # The lock's PID could not be written on a full disk: the start stopped (exit 1) and the proxy in the clients'
    # path with it (session 46's hostile review). The flock needs no space: it is held, the PID said missing.
    import fcntl
    import os

    import powerprof.daemon.service as service

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(service.os, "pwrite", full)
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon"):
        fd = service.lock_data_dir(tmp_path / "data")
    try:
        other = os.open(tmp_path / "data" / ".daemon.lock", os.O_RDONLY)
        try:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock was not held")
            except BlockingIOError:
                pass
        finally:
            os.close(other)
    finally:
        os.close(fd)
    assert any("the disk is full" in r.getMessage() for r in caplog.records)
