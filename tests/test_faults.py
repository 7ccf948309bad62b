"""Fault injection (issue 14): each failure the adversarial battery found (F1-F11) and each security item.

Every test here failed on the code before the fix. The hostile server (tests/hostile_server.py)
sends huge, negative, fractional, string and NaN counts, oversized bodies and malformed SSE:
each must be a clean failure of that one request, with the reason, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from click.testing import CliRunner

from hostile_server import HOSTILE_FINALS, HOSTILE_RAW, HostileServer
from daemon_helpers import DaemonProc, read_dataset, sim_env
from support import systemd_exposure
from powerprof.cli import main
from powerprof.control.controller import LimitController
from powerprof.control.errors import PendingRestoreError
from powerprof.control.restore import default_restore_path, restore_from_file
from powerprof.paths import ROOT_STATE_DIR
from powerprof.daemon.config import ConfigError, load_config
from powerprof.daemon.proxy import Proxy
from powerprof.daemon.service import Daemon, datasets
from powerprof.daemon.store import ROW_BYTES_EST, Dataset, DatasetStore, Flusher, buffer_cap_rows
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.storage.schema import DAEMON_REQUESTS
from powerprof.workload.client import RequestParams, ServerInfo, detect_server, send_request

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "powerprof.service"
QUICK = RequestParams(max_tokens=8, stall_timeout_s=5, first_token_timeout_s=10, connect_timeout_s=2)


def _run(coro, timeout_s: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture
def hostile():
    with HostileServer() as h:
        yield h


def _send(url: str, prompt: str):
    async def go():
        async with aiohttp.ClientSession() as s:
            info = ServerInfo(url, "llamacpp", "llamacpp")
            return await send_request(s, info, prompt, QUICK)

    return _run(go())


# --- F3 and the hostile-server acceptance: the client ----------------------------------------------


@pytest.mark.parametrize("case", sorted(HOSTILE_FINALS) + sorted(HOSTILE_RAW))
def test_hostile_value_fails_that_request_with_its_reason(hostile, case):
    r = _send(hostile.url, case)
    assert r.status == "failed" and r.error, r
    assert r.generated_tokens == 0 and r.prompt_tokens is None and r.decode_tok_s is None
    if case in HOSTILE_FINALS:
        assert "server sent an invalid" in r.error
    ok = _send(hostile.url, "a normal prompt")  # the next request is unaffected
    assert ok.status == "ok" and ok.generated_tokens == 3, ok


def test_f3_negative_count_is_not_stored_as_ok_data(hostile):
    r = _send(hostile.url, "negative")
    assert r.status == "failed" and "tokens_predicted: -50 is negative" in r.error


# --- F4: bounded reads ------------------------------------------------------------------------------


def test_f4_oversized_props_is_not_read_past_its_cap():
    with HostileServer(endless_props=True) as h:
        async def go():
            async with aiohttp.ClientSession() as s:
                return await detect_server(s, h.url, api="llamacpp")

        t0 = time.monotonic()
        info = _run(go())
        elapsed = time.monotonic() - t0
        # The 200 MiB body was not read: the server got no further than the cap plus socket buffers.
        assert h.bytes_sent["props"] < 64 << 20, h.bytes_sent
        assert info.build_info is None  # an unreadable /props tells nothing
        assert elapsed < 30


def test_oversized_non_streamed_body_fails_that_request(hostile, monkeypatch):
    import powerprof.workload.client as client

    monkeypatch.setattr(client, "MAX_RESPONSE_BYTES", 1 << 20)
    r = _send(hostile.url, "oversized-json")
    assert r.status == "failed" and "response too large" in r.error, r


def test_the_vllm_timing_and_queue_reads_do_not_read_a_metrics_page_past_its_cap(monkeypatch):
    # measure's queue probe and the per-request vLLM timing read /metrics through client.fetch_metrics, which read the
    # whole page whatever its size (the daemon's scraper and the tuner cap theirs).
    import powerprof.workload.client as client

    monkeypatch.setattr(client, "MAX_METRICS_BYTES", 1 << 16)
    page = "vllm:num_requests_waiting 3\n" + "# filler\n" * 20_000  # ~180 kB
    with HostileServer(metrics_text=page) as h:
        async def go():
            async with aiohttp.ClientSession() as s:
                return await client.fetch_metrics(s, h.url)

        assert _run(go()) is None
    with HostileServer(metrics_text="vllm:num_requests_waiting 3\n") as h:
        async def go_small():
            async with aiohttp.ClientSession() as s:
                return await client.fetch_metrics(s, h.url)

        assert _run(go_small()) == {"waiting": 3.0}


@pytest.mark.parametrize("text", ["vllm:generation_tokens_total NaN\n", "vllm:generation_tokens_total -5\n",
                                  "vllm:generation_tokens_total 1e300\n"])
def test_scraped_counters_that_are_not_counts_fail_the_scrape(text):
    from powerprof.daemon.scrape import Scraper

    with HostileServer(metrics_text=text) as h:
        async def go():
            async with aiohttp.ClientSession() as s:
                sc = Scraper(s, h.url, "vllm")
                return await sc.scrape(), sc

        delta, sc = _run(go())
    assert delta is None and sc.errors == 1 and sc.total == 0
    assert "vllm:generation_tokens_total" in sc.last_error


def test_scraped_slots_with_a_negative_n_decoded_fail_the_scrape():
    from powerprof.daemon.scrape import Scraper

    slots = [{"id": 0, "id_task": 1, "n_decoded": -7, "is_processing": True}]
    with HostileServer(slots=slots) as h:
        async def go():
            async with aiohttp.ClientSession() as s:
                sc = Scraper(s, h.url, "llamacpp")
                return [await sc.scrape() for _ in range(2)], sc

        deltas, sc = _run(go())
    assert deltas == [None, None] and sc.errors == 2 and "n_decoded" in sc.last_error


# --- F1: the writer ---------------------------------------------------------------------------------


def _row(i: int, **kw) -> dict:
    return {"daemon_id": "t", "request_id": i, "t_arrival_utc": time.time_ns(), "generated_tokens": 5, **kw}


def test_f1_a_row_its_column_cannot_hold_is_quarantined_and_the_rest_written(tmp_path):
    store = DatasetStore(tmp_path, [Dataset("requests", DAEMON_REQUESTS, "t_arrival_utc")])
    store.append("requests", [_row(1), _row(2, generated_tokens=1_000_000_000_000_000), _row(3)])
    assert store.flush() is True  # nothing left to retry: written or quarantined
    assert store.buffered() == 0
    got = read_dataset(tmp_path, "requests")
    assert sorted(got["request_id"]) == [1, 3]
    assert store.quarantined_rows["requests"] == 1 and store.flush_errors == 1
    (q,) = (tmp_path / "_quarantine").glob("requests-*.jsonl")
    assert json.loads(q.read_text())["request_id"] == 2
    store.append("requests", [_row(4)])
    assert store.flush() and sorted(read_dataset(tmp_path, "requests")["request_id"]) == [1, 3, 4]


def test_f1_the_flush_thread_survives_any_exception_and_says_so(tmp_path):
    store = DatasetStore(tmp_path, [Dataset("requests", DAEMON_REQUESTS, "t_arrival_utc")])
    real = store.flush
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected bug")
        return real()

    store.flush = flaky
    fl = Flusher(store, interval_s=0.05).start()
    try:
        store.append("requests", [_row(1)])
        deadline = time.monotonic() + 30
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fl.errors == 1 and "injected bug" in fl.last_error
        assert fl.alive(stuck_after_s=30)
        assert read_dataset(tmp_path, "requests") is not None
    finally:
        fl.stop()
    assert not fl.alive(stuck_after_s=30)


def test_f1_daemon_behind_a_hostile_server_keeps_writing(tmp_path):
    """Every hostile case through the proxy: recorded as failed with its reason; normal requests after
    them are written; /metrics shows a live writer and no quarantined rows (nothing bad got that far)."""
    with HostileServer() as h:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", h.url, "--flush-interval", "0.2",
                       env=sim_env(tmp_path))
        try:
            cases = sorted(HOSTILE_FINALS) + ["malformed-sse", "normal-1", "normal-2"]

            async def go():
                async with aiohttp.ClientSession() as s:
                    for c in cases:
                        async with s.post(d.info["proxy"] + "/completion", json={"prompt": c, "stream": True}) as r:
                            await r.read()
                    await asyncio.sleep(1.0)  # a few flushes
                    async with s.get(d.info["metrics"] + "/metrics") as r:
                        return await r.text()

            metrics = _run(go())
            assert re.search(r"^powerprof_writer_up 1\.0$", metrics, re.M), metrics
            assert re.search(r"^powerprof_quarantined_rows_total 0\.0$", metrics, re.M)
            assert d.stop() == 0
        finally:
            if d.proc.poll() is None:
                d.proc.kill()
        out = d.output()
        assert "Traceback" not in out, out
        req = read_dataset(tmp_path / "data", "requests")
        assert len(req) == len(cases)
        by_outcome = req.groupby("outcome").size().to_dict()
        assert by_outcome.get("invalid_response") == len(HOSTILE_FINALS), by_outcome
        bad = req[req["outcome"] == "invalid_response"]
        assert bad["error"].str.contains("server sent an invalid").all()
        assert (req["generated_tokens"].dropna() >= 0).all()
        assert (req[req["outcome"] == "ok"]["generated_tokens"] == 3).sum() >= 2


# --- F2: a sweep and measure keep what they finished ------------------------------------------------


def test_f2_sweep_keeps_finished_levels_when_the_server_sends_an_overflowing_count(tmp_path, monkeypatch):
    import powerprof.sim.server as sim_server
    from powerprof.sweep import run_sweep

    class Overflowing(sim_server.SimServer):
        n = 0

        def _llama_final(self, req, timings):
            obj = super()._llama_final(req, timings)
            Overflowing.n += 1
            if Overflowing.n == 8:  # inside the second level (5 requests per level: 1 warm-up + 4)
                obj["tokens_predicted"] = 1_000_000_000_000_000
            return obj

    monkeypatch.setattr(sim_server, "SimServer", Overflowing)
    out = tmp_path / "run"
    with Rig("seed-16g", nvml=SimNVML("seed-16g", state_path=tmp_path / "sim.json")) as rig:
        outcome = run_sweep(
            rig, levels_spec="200,300", out_dir=out, params=RequestParams(max_tokens=16), idle_s=0, interval_s=0.2,
            min_requests=4, max_requests=4, warmup_requests=1,
        )
    assert Overflowing.n >= 8
    levels = pq.read_table(out / "levels.parquet").to_pylist()
    assert sorted(r["level_value"] for r in levels) == [200.0, 300.0]
    windows = pq.read_table(out / "windows.parquet").to_pylist()
    failed = [w for w in windows if w["status"] == "failed"]
    assert len(failed) == 1 and "server sent an invalid tokens_predicted" in failed[0]["error"]
    assert all(w["generated_tokens"] is None or 0 <= w["generated_tokens"] < 2**31 for w in windows)
    assert outcome.levels.num_rows == 2


def test_f2_measure_records_the_bad_request_as_failed_and_writes_the_rest(tmp_path, hostile):
    from powerprof.workload.load import Prompt
    from powerprof.workload.measure import run_measure

    with Rig(None) as rig:
        res = run_measure(rig, url=hostile.url, out_dir=tmp_path / "m", api="llamacpp",
                          prompts=[Prompt("n", "normal"), Prompt("h", "huge")], n_requests=2, concurrencies=[1],
                          params=QUICK, warmup=0)
    rows = pq.read_table(res.out_path / "windows.parquet").to_pylist()
    st = {r["prompt_id"]: r for r in rows if r["window_kind"] == "request" and r["attempt"] == 1}
    assert st["h"]["status"] == "failed" and "invalid tokens_predicted" in st["h"]["error"]
    assert st["n"]["status"] == "ok" and st["n"]["generated_tokens"] == 3


# --- F5 and the restore-file trust boundary ---------------------------------------------------------


def _sim(tmp_path, privileged=True):
    return SimNVML("seed-16g", count=1, state_path=tmp_path / "sim.json", privileged=privileged)


def _limit_w(tmp_path) -> float:
    n = _sim(tmp_path)
    n.nvmlInit()
    return n.nvmlDeviceGetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0)) / 1000


def _set_limit(tmp_path, w: float) -> None:
    n = _sim(tmp_path)
    n.nvmlInit()
    n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), int(w * 1000))


def test_f5_a_damaged_restore_file_blocks_changes_until_force_default(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    default_w = _limit_w(tmp_path)
    state = Path(os.environ["POWERPROF_STATE_DIR"])
    with LimitController(_sim(tmp_path), [0]) as ctl:
        ctl.set_power_limit_w(default_w - 50)
        path = ctl.restore_path
        text = path.read_text()
        ctl._record = None  # the process "dies" here: the GPU stays capped, the file stays
    assert _limit_w(tmp_path) == default_w - 50
    # Truncated before the original limit: the GPU's UUID is still readable (the simulated rig acts
    # only on files that name its own GPUs), the limit it held is not.
    path.write_text(text[: text.index('"original_limit_mw"')])
    with pytest.raises(PendingRestoreError, match="force-default"):
        LimitController(_sim(tmp_path), [0]).open()
    assert _limit_w(tmp_path) == default_w - 50 and path.exists()
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g"])
    assert r.exit_code == 1 and "force-default" in r.output and path.exists()
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    assert r.exit_code == 0, r.output
    assert _limit_w(tmp_path) == default_w and not path.exists()
    assert list(state.glob("restore-*.json")) == []
    with LimitController(_sim(tmp_path), [0]) as ctl:  # and changes are allowed again
        assert ctl.original_limits_w == (default_w,)


@pytest.mark.parametrize("text", ["[1]", "null", '"restore"', "42"])
def test_a_restore_file_of_valid_json_but_no_object_is_damaged_not_a_crash(tmp_path, monkeypatch, text):
    # JSON that parses but is not an object (an editor's leftover, a file of another tool) is a damaged
    # restore file like a truncated one: it blocks changes with the fix, and no command dies on it.
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    state = Path(os.environ["POWERPROF_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    path = state / "restore-cccccccccccc.json"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(PendingRestoreError, match="force-default"):
        LimitController(_sim(tmp_path), [0]).open()
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--restore-file", str(path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert "force-default" in r.output and path.exists()
    r = CliRunner().invoke(main, ["devices", "--simulate", "seed-16g"])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "restore" in r.output


def test_force_default_on_the_simulator_clears_a_file_its_name_proves_is_the_simulators(tmp_path, monkeypatch):
    # A sweep killed at a capped level, its file then cut to 50 bytes: no UUID is left in it, but its name is
    # the hash of the GPUs it was written for (default_restore_path), and that names this simulator's GPU. It
    # was refused ("names no GPU that can be read"), the GPU stayed capped and every later run refused to start.
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    default_w = _limit_w(tmp_path)
    with LimitController(_sim(tmp_path), [0]) as ctl:
        ctl.set_power_limit_w(default_w - 50)
        path = ctl.restore_path
        text = path.read_text()
        ctl._record = None  # killed here
    path.write_text(text[:50])
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    assert r.exit_code == 0, r.output
    assert _limit_w(tmp_path) == default_w and not path.exists()
    assert "its name is the record of this simulator's GPU" in r.output, r.output
    with LimitController(_sim(tmp_path), [0]) as ctl:  # runs may start again
        assert ctl.original_limits_w == (default_w,)


@pytest.mark.parametrize("damage", ["field", "group-writable"])
def test_force_default_on_the_simulator_leaves_a_file_of_another_state_file_alone(tmp_path, monkeypatch, damage):
    # A sweep on the simulator of state file A left its GPU at 250 W, its record then damaged (a field, or made
    # group-writable: untrusted) but whole, naming A. `restore --simulate --force-default` under another
    # POWERPROF_SIM_STATE (B, or sudo, which drops it) set B's GPU to its default, removed A's record, said
    # "Set to default limits" and exit 0: A's GPU stayed at 250 W, the next run on A took 250 W as its original.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    default_w = _limit_w(a)
    origin = {"profile": "seed-16g", "count": 1, "state_file": os.path.realpath(a / "sim.json")}
    with LimitController(_sim(a), [0], origin=origin) as ctl:
        ctl.set_power_limit_w(default_w - 50)
        path = ctl.restore_path
        rec = json.loads(path.read_text())
        ctl._record = None  # killed here
    assert rec["simulated"]["state_file"] == origin["state_file"]
    if damage == "field":
        for g in rec["gpus"].values():
            g["original_limit_mw"] = True
        path.write_text(json.dumps(rec, indent=1, sort_keys=True))
    else:
        os.chmod(path, 0o660)
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(b / "sim.json"))
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and path.exists(), r.output
    assert _limit_w(a) == default_w - 50 and _limit_w(b) == default_w
    assert f"records the simulated GPUs of the state file {origin['state_file']}" in flat, r.output
    assert f"POWERPROF_SIM_STATE={origin['state_file']} powerprof restore --simulate --force-default`" in flat, r.output
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(a / "sim.json"))
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    assert r.exit_code == 0 and not path.exists() and _limit_w(a) == default_w, r.output


@pytest.mark.skipif(os.geteuid() != 0, reason="a state file in another user's folder is refused only to root")
def test_a_record_of_a_state_file_root_may_not_use_names_the_routes_that_work(tmp_path, monkeypatch):
    # A sudo user's simulated sweep (its state file in their home) was killed -9. Root without sudo was stuck: the
    # refusal said `POWERPROF_SIM_STATE=/home/U/... powerprof restore --simulate`, which root's own check on that
    # folder then refused ("owned by uid N"), and --force-default was refused both ways: no way out was named.
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    default_w = _limit_w(a)
    origin = {"profile": "seed-16g", "count": 1, "state_file": os.path.realpath(a / "sim.json")}
    with LimitController(_sim(a), [0], origin=origin) as ctl:
        ctl.set_power_limit_w(default_w - 50)
        path = ctl.restore_path
        ctl._record = None  # killed here
    for f in (a, a / "sim.json"):
        os.chown(f, 65534, 65534)
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(b / "sim.json"))
    monkeypatch.delenv("SUDO_UID", raising=False)
    for force in ([], ["--force-default"]):
        r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", *force])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and path.exists(), r.output
        assert f"records the simulated GPUs of the state file {origin['state_file']}" in flat, r.output
        assert f"is owned by uid 65534, not root" in flat, r.output
        assert (f"`sudo env POWERPROF_SIM_STATE={origin['state_file']} powerprof restore --simulate --restore-file "
                f"{path}`" in flat), r.output
        assert f"`rm {path}`" in flat and "no real GPU" in flat, r.output
        assert f"`POWERPROF_SIM_STATE={origin['state_file']} powerprof restore --simulate`" not in flat, r.output
    # The sudo route works: run by that user, whose folder sudo's root trusts.
    monkeypatch.setenv("POWERPROF_SIM_STATE", origin["state_file"])
    monkeypatch.setenv("SUDO_UID", "65534")
    r = CliRunner().invoke(main, ["restore", "--simulate", "--restore-file", str(path)])
    assert r.exit_code == 0 and not path.exists(), r.output
    assert _limit_w(a) == default_w


def test_force_default_on_the_simulator_names_the_profile_a_damaged_files_name_proves(tmp_path, monkeypatch):
    # Written for another simulated profile's GPU: refused here (its GPUs are not this simulator's), with
    # the command that acts on them.
    from powerprof.sim.nvml import sim_uuid

    state = Path(os.environ["POWERPROF_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    other = default_restore_path([sim_uuid("a100-40g", 0)], state)
    other.write_text('{\n "argv": [')
    os.chmod(other, 0o600)
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    assert r.exit_code == 1 and other.exists(), r.output
    assert "powerprof restore --simulate a100-40g --force-default" in r.output, r.output


def test_force_default_on_the_simulator_never_touches_a_real_gpus_file(tmp_path, monkeypatch):
    # A damaged file that names no readable GPU, or a GPU that is not the simulator's, may hold a real
    # GPU's original limit: `restore --simulate --force-default` refuses it and keeps it.
    state = Path(os.environ["POWERPROF_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    unreadable = state / "restore-aaaaaaaaaaaa.json"
    unreadable.write_text('{"format": 1, "gpus": {"GPU-aaaa')
    real = state / "restore-bbbbbbbbbbbb.json"
    real.write_text('{"format": 1, "gpus": {"GPU-12345678-1234-1234-1234-123456789abc": {"index": 0')
    for f in (unreadable, real):
        os.chmod(f, 0o600)
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default"])
    assert r.exit_code == 1, r.output
    assert unreadable.exists() and real.exists()
    assert "names no GPU that can be read" in r.output and "not this simulator's" in r.output
    assert "without --simulate" in r.output


def test_a_restore_file_left_in_the_old_root_folder_is_found_after_an_upgrade(tmp_path, monkeypatch):
    # Root's state folder moved; a crashed sweep's file in the old one (also the daemon's writable state
    # directory) must be reported, never "Nothing to restore", and never applied as it is.
    import powerprof.control.restore as restore_mod

    legacy = tmp_path / "old-var-lib-powerprof"
    legacy.mkdir(mode=0o777)
    os.chmod(legacy, 0o777)  # as writable as a folder another user owns
    p = _foreign_restore_file(tmp_path, owner_uid=os.geteuid())
    moved = legacy / p.name
    p.rename(moved)
    monkeypatch.setattr(restore_mod, "legacy_state_dirs", lambda: [legacy])
    report = restore_mod.restore_from_file()
    assert [o.path for o in report.outcomes] == [moved], report.lines()
    assert report.outcomes[0].status == "untrusted" and "force-default" in report.lines()[0]
    assert moved.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")
def test_a_file_another_user_put_in_the_old_root_folder_blocks_nothing(tmp_path, monkeypatch, caplog):
    # The old folder is the daemon's now (/var/lib/powerprof, its user's): a file its user planted there refused every
    # root sweep and tuner start, and the fix printed, --force-default, set the GPUs it named to their defaults
    # (session 46's hostile review). An older powerprof as root wrote its own files as root: only those count.
    import logging

    import powerprof.control.restore as restore_mod

    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    legacy = tmp_path / "old-var-lib-powerprof"
    legacy.mkdir(mode=0o750)
    p = _foreign_restore_file(tmp_path, owner_uid=65534)
    planted = legacy / p.name
    p.rename(planted)
    monkeypatch.setattr(restore_mod, "legacy_state_dirs", lambda: [legacy])
    with caplog.at_level(logging.WARNING, logger="powerprof.control.restore"):
        assert restore_mod.pending_restore_files() == []
        with LimitController(_sim(tmp_path), [0]) as ctl:  # a sweep may start
            assert ctl.original_limits_w
    assert any(str(planted) in r.getMessage() and "uid 65534" in r.getMessage() for r in caplog.records)
    assert planted.exists()


def test_uuids_are_read_from_a_regular_files_first_mib_only(tmp_path):
    # A symlink to an 8 GB file had root's --force-default read all of it (8.4 GB resident, 36 s); a FIFO would hang.
    from powerprof.control.restore import uuids_named_in

    uuid = "GPU-12345678-1234-1234-1234-123456789abc"
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.write(uuid.encode())
        f.truncate(64 << 20)  # sparse: 64 MiB read whole would show in the test's time and memory
        f.seek(2 << 20)
        f.write(b"GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")
    assert uuids_named_in(big) == [uuid]  # the one past the first MiB is not read
    (tmp_path / "link").symlink_to(big)
    os.mkfifo(tmp_path / "fifo")
    assert uuids_named_in(tmp_path / "link") is None and uuids_named_in(tmp_path / "fifo") is None  # nothing to act on
    (tmp_path / "none").write_text("{}")
    assert uuids_named_in(tmp_path / "none") == []  # read, naming no GPU


def test_force_default_on_a_symlink_or_fifo_changes_nothing(tmp_path, monkeypatch):
    # "No UUID readable" sets every GPU to its default: a symlink or a FIFO in a restore file's place did that
    # (session 46's review), where there is nothing in it to act on.
    from powerprof.control.restore import force_default

    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    default_w = _limit_w(tmp_path)
    _set_limit(tmp_path, default_w - 40)
    (tmp_path / "target.json").write_text("{}")
    (tmp_path / "restore-link.json").symlink_to(tmp_path / "target.json")
    os.mkfifo(tmp_path / "restore-fifo.json")
    for name in ("restore-link.json", "restore-fifo.json"):
        out = force_default(tmp_path / name, _sim(tmp_path), directory=tmp_path / "state")
        assert out.status == "failed" and "no regular file" in out.message, out
        assert _limit_w(tmp_path) == default_w - 40 and (tmp_path / name).exists()


def test_force_default_without_nvml_says_so_and_keeps_the_file(tmp_path, monkeypatch):
    # The fix a refused sweep prints, run on a host whose NVML is missing (or whose driver is gone): a traceback
    # (NVMLError_LibraryNotFound) and, with --json, nothing on stdout. Now a failure said as a plain restore says it.
    import pynvml

    from powerprof.control.restore import force_default

    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    nvml = _sim(tmp_path)

    def missing():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(nvml, "nvmlInit", missing)
    path = tmp_path / "restore-dddddddddddd.json"
    path.write_text('{"gpus": {"GPU-0000')
    os.chmod(path, 0o600)
    out = force_default(path, nvml, directory=tmp_path / "state")
    assert out.status == "failed" and "is kept" in out.message and path.exists(), out


def test_a_former_folders_restore_file_is_still_reported_when_the_state_folder_cannot_be_listed(tmp_path, monkeypatch):
    # The review's case: the unlisted state folder's "Not checked" returned at once, and the file found in the former
    # folder (an older powerprof's) was no longer reported.
    import powerprof.control.restore as R

    sd = tmp_path / "statefile"
    sd.write_text("x")
    legacy = tmp_path / "legacy"
    legacy.mkdir(mode=0o755)
    f = legacy / "restore-aaaaaaaaaaaa.json"
    f.write_text('{"gpus": {"GPU-0000')
    os.chmod(f, 0o600)
    monkeypatch.setattr(R, "state_dir", lambda: sd)
    monkeypatch.setattr(R, "legacy_state_dirs", lambda: [legacy])
    rep = R.restore_from_file()
    assert not rep.ok and [o.path for o in rep.outcomes] == [sd, f], [(str(o.path), o.status) for o in rep.outcomes]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another user needs root")
def test_force_default_sets_the_defaults_but_removes_nothing_through_another_users_folder(tmp_path, monkeypatch):
    # A folder another user controls can be swapped for a symlink to root's state folder between the read and the
    # removal: root's own restore file was removed so, its original limit lost (session 46's hostile review).
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    default_w = _limit_w(tmp_path)
    _set_limit(tmp_path, default_w - 40)
    p = _foreign_restore_file(tmp_path, owner_uid=65534)  # in a folder uid 65534 owns
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--force-default", "--restore-file", str(p)])
    assert _limit_w(tmp_path) == default_w, r.output
    assert p.exists() and "not removed through a folder another user controls" in r.output, r.output


def test_a_restore_folder_that_cannot_be_listed_is_said_not_skipped(tmp_path, monkeypatch, caplog):
    # Before: the tuner's sandbox (CAP_SYS_ADMIN alone, no CAP_DAC_OVERRIDE) cannot list /var/lib/powerprof (0750, the
    # daemon's): `restore` skipped the restore files an older powerprof left there without a word (docs/tuner.md).
    import logging

    import powerprof.control.restore as restore_mod

    legacy = tmp_path / "old-var-lib-powerprof"
    legacy.mkdir()
    gone = tmp_path / "never-made"  # no legacy folder at all: the usual case, nothing to say
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path) == legacy:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(restore_mod.os, "scandir", scandir)
    monkeypatch.setattr(restore_mod, "legacy_state_dirs", lambda: [legacy, gone])
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))  # the default folder, legacy ones searched
    with caplog.at_level(logging.WARNING, logger="powerprof.control.restore"):
        assert restore_mod.pending_restore_files(tmp_path / "other") == []  # not root's default: no legacy folder
        assert restore_mod.pending_restore_files() == []
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(legacy) in said[0] and "Permission denied" in said[0], said
    assert "restore files there are not checked" in said[0], said


def _foreign_restore_file(tmp_path, owner_uid: int, mode: int = 0o600) -> Path:
    d = tmp_path / "foreign"
    d.mkdir(mode=0o755)
    sim = _sim(tmp_path)
    sim.nvmlInit()
    uuid = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(0))
    p = default_restore_path([uuid], d)
    rec = {"format": 1, "pid": 1, "created_utc": "x", "host": "h", "argv": [],
           "simulated": {"profile": "seed-16g", "count": 1},
           "gpus": {uuid: {"index": 0, "name": "x", "original_limit_mw": 150_000, "default_limit_mw": 150_000,
                           "clocks_locked": False}}}
    p.write_text(json.dumps(rec))
    os.chmod(p, mode)
    os.chown(p, owner_uid, -1)
    os.chown(d, owner_uid, -1)
    return p


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file owned by another user needs root")
def test_root_never_applies_a_restore_file_another_user_wrote(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    before = _limit_w(tmp_path)
    p = _foreign_restore_file(tmp_path, owner_uid=65534)  # nobody, in a folder nobody owns
    report = restore_from_file(p, directory=p.parent)
    assert not report.ok and report.outcomes[0].status == "untrusted", report.lines()
    assert "owned by uid 65534" in report.lines()[0]
    assert _limit_w(tmp_path) == before and p.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another user needs root")
def test_root_never_applies_a_restore_file_below_a_folder_another_user_owns(tmp_path, monkeypatch):
    # Before: only the file and its own folder were checked (lstat), then the file was read again by name. A user
    # who owns a folder above can rename root's folder away and put their own (with their own limits) in its place
    # between the check and the read: root then set the GPU to the limit they chose (here 150 W).
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    before = _limit_w(tmp_path)
    p = _foreign_restore_file(tmp_path, owner_uid=0)  # root's file, in a folder of root's (0755)...
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    moved = theirs / "foreign"
    p.parent.rename(moved)  # ...below a folder another user owns
    os.chown(theirs, 65534, 65534)
    p = moved / p.name
    with Rig("seed-16g") as rig:  # `sudo powerprof restore --simulate seed-16g --restore-file P`
        report = rig.restore(p, directory=p.parent)
    assert not report.ok and report.outcomes[0].status == "untrusted", report.lines()
    assert f"{theirs} is owned by uid 65534" in report.lines()[0]
    assert _limit_w(tmp_path) == before and p.exists()


def test_restore_refuses_a_file_others_can_write(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    before = _limit_w(tmp_path)
    p = _foreign_restore_file(tmp_path, owner_uid=os.geteuid(), mode=0o666)
    report = restore_from_file(p, directory=p.parent)
    assert report.outcomes[0].status == "untrusted" and "writable by group or others" in report.lines()[0]
    assert _limit_w(tmp_path) == before


def _unit() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_roots_restore_folder_is_not_the_daemons_state_directory():
    u = _unit()
    daemon_state = Path("/var/lib") / u["StateDirectory"][0]
    assert ROOT_STATE_DIR != daemon_state and daemon_state not in ROOT_STATE_DIR.parents
    assert ROOT_STATE_DIR not in daemon_state.parents


# --- F6-F11 and the daemon's hygiene ----------------------------------------------------------------


def test_f6_f11_socket_path_never_replaces_a_file_and_ipv6_urls_are_valid(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    d = DaemonProc(tmp_path / "data", "--simulate", "--listen", "[::1]:0", "--tag-socket", str(victim),
                   env=sim_env(tmp_path))
    try:
        assert victim.read_text() == "keep me"
        url = d.info["proxy"]
        assert re.fullmatch(r"http://\[::1\]:\d+", url), url

        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/v1/models") as r:
                    return r.status

        assert _run(go()) == 200
    finally:
        assert d.stop() == 0
    assert victim.read_text() == "keep me"
    assert "is not a socket; not replacing it" in d.output()


def test_f7_max_connections_zero_means_unlimited():
    cfg = load_config(None, env={}, overrides={"proxy.max_connections": 0})
    assert cfg.get("proxy", "max_connections") == 0

    async def go():
        async def ok(_r):
            return web.Response(text="up")

        up = web.Application()
        up.router.add_get("/x", ok)
        ur = web.AppRunner(up)
        await ur.setup()
        await web.TCPSite(ur, "127.0.0.1", 0).start()
        proxy = Proxy(f"http://127.0.0.1:{ur.addresses[0][1]}", max_connections=0)
        pr = web.AppRunner(proxy.app())
        await pr.setup()
        await web.TCPSite(pr, "127.0.0.1", 0).start()
        try:
            async with aiohttp.ClientSession() as s:
                rs = await asyncio.gather(*(s.get(f"http://127.0.0.1:{pr.addresses[0][1]}/x") for _ in range(20)))
                return [await r.text() for r in rs]
        finally:
            await pr.cleanup()
            await ur.cleanup()

    assert _run(go()) == ["up"] * 20


def _raw_request(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
        return out


def test_f8_absolute_form_and_connect_targets_get_400():
    async def go():
        proxy = Proxy("http://127.0.0.1:9")  # never contacted
        pr = web.AppRunner(proxy.app())
        await pr.setup()
        await web.TCPSite(pr, "127.0.0.1", 0).start()
        port = pr.addresses[0][1]
        loop = asyncio.get_running_loop()
        try:
            a = await loop.run_in_executor(None, _raw_request, port,
                                           b"GET http://example.invalid/x HTTP/1.1\r\nHost: example.invalid\r\n\r\n")
            c = await loop.run_in_executor(None, _raw_request, port,
                                           b"CONNECT example.invalid:443 HTTP/1.1\r\nHost: example.invalid:443\r\n\r\n")
            return a, c, proxy.upstream_failures
        finally:
            await pr.cleanup()

    a, c, upstream_failures = _run(go())
    assert a.startswith(b"HTTP/1.1 400"), a
    assert c.startswith(b"HTTP/1.1 400"), c
    assert upstream_failures == 0  # nothing was forwarded anywhere


def test_f9_a_second_daemon_on_the_same_data_dir_exits_with_a_clear_message(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate", env=sim_env(tmp_path))
    try:
        p = subprocess.run(
            [sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "--data-dir", str(tmp_path / "data"),
             "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--tag-socket", str(tmp_path / "t2.sock")],
            capture_output=True, text=True, timeout=120, env={**os.environ, **sim_env(tmp_path)},
        )
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"another powerprof daemon (pid {d.proc.pid}) already writes to" in p.stdout + p.stderr
    finally:
        assert d.stop() == 0


EARLY_SIGINT = """
import os, signal, sys
import powerprof.daemon.service as service
run = service.Daemon.run
async def interrupted_run(self):
    os.kill(os.getpid(), signal.SIGINT)  # as early as a Ctrl-C can land inside the daemon's loop
    return await run(self)
service.Daemon.run = interrupted_run
from powerprof.cli import main
sys.argv = ["powerprof"] + sys.argv[1:]
main()
"""


@pytest.mark.parametrize("when", ["start-up", "running", "repeated"])
def test_f10_sigint_at_any_moment_exits_quietly(tmp_path, when):
    """SIGINT during start-up, when running, and again and again until the process is gone (every phase of
    shutdown, interpreter exit included): no traceback, no asyncio warnings, exit 0."""
    env = {**os.environ, **sim_env(tmp_path)}
    data = tmp_path / "data"
    args = ["daemon", "--simulate", "--data-dir", str(data), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
    if when == "start-up":
        script = tmp_path / "early.py"
        script.write_text(EARLY_SIGINT)
        cmd = [sys.executable, str(script), *args]
    else:
        cmd = [sys.executable, "-m", "powerprof.cli", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        if when != "start-up":
            deadline = time.monotonic() + 60
            while not (data / "daemon.json").exists() and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.05)
            p.send_signal(signal.SIGINT)
            while when == "repeated" and p.poll() is None:
                time.sleep(0.02)
                try:
                    p.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    break
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    text = out.decode(errors="replace")
    assert "Traceback" not in text and "never retrieved" not in text, text
    # 130: a SIGINT in the instant after the loop closed and before the process exits (still quiet).
    assert p.returncode == 0 or (when == "repeated" and p.returncode == 130), (p.returncode, text)
    assert "stopped" in text


# --- security: listening, timeouts, memory, RAPL, systemd ------------------------------------------


def test_listening_beyond_loopback_needs_the_flag_and_warns():
    with pytest.raises(ConfigError, match="listen_beyond_loopback"):
        load_config(None, env={}, overrides={"proxy.listen": "0.0.0.0:8081"})
    with pytest.raises(ConfigError, match="listen_beyond_loopback"):
        load_config(None, env={}, overrides={"metrics.listen": "[::]:9464"})
    cfg = load_config(None, env={}, overrides={"proxy.listen": "0.0.0.0:8081", "daemon.listen_beyond_loopback": True})
    assert cfg.get("proxy", "listen") == "0.0.0.0:8081"
    assert load_config(None, env={}, overrides={"proxy.listen": "[::1]:0"}).get("proxy", "listen") == "[::1]:0"
    with pytest.raises(ConfigError, match="brackets"):
        load_config(None, env={}, overrides={"proxy.listen": "::1:8081"})


def test_slow_request_heads_are_cut_after_the_header_timeout(tmp_path):
    d = DaemonProc(tmp_path / "data", "--simulate",
                   env={**sim_env(tmp_path), "POWERPROF_PROXY_HEADER_TIMEOUT_S": "1"})
    try:
        port = int(d.info["proxy"].rsplit(":", 1)[1])
        socks = []
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
        t0 = time.monotonic()
        closed = 0
        for s in socks:
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            finally:
                s.close()
        assert closed == len(socks)
        assert time.monotonic() - t0 < 25  # 1 s timeout, not the 30 s socket timeout
        # A normal request still works.
        assert _raw_request(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
    finally:
        assert d.stop() == 0


def test_buffered_rows_fit_within_half_the_units_memory_max():
    import tracemalloc

    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.liverequest import LiveRequest
    from powerprof.daemon.proxy import RequestTrace

    mem_max = 512 << 20
    n_ds = len(datasets())
    cap = buffer_cap_rows(mem_max, n_ds)
    assert 100 <= cap < 500_000 and cap * n_ds * ROW_BYTES_EST <= mem_max / 2
    # ROW_BYTES_EST is not a guess: a request row (the widest) costs less than that.
    rows: list[dict] = []
    led = Ledger("d", time.monotonic_ns(), 1, lambda name, rs: rows.extend(rs))
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(2000):
        tr = RequestTrace(i, "POST", "/v1/completions", f"tag-{i % 7}", time.monotonic_ns(), time.time_ns(),
                          api="openai-completions", model="some-model-name", status=200, first_ns=1, first_wall_ns=1,
                          last_ns=2, last_wall_ns=2, end_ns=3, end_wall_ns=3, tokens_seen=100, response_bytes=12345)
        rows.append(led._request_row(LiveRequest(tr, gpu_j=1.5, cpu_j=0.5, cpu_known=True, tokens=99.0)))
    per_row = (tracemalloc.get_traced_memory()[0] - base) / 2000
    tracemalloc.stop()
    assert per_row < ROW_BYTES_EST, per_row


def test_memory_limit_is_read_from_the_cgroup(tmp_path):
    from powerprof.daemon.service import memory_limit_bytes

    (tmp_path / "proc").write_text("0::/system.slice/powerprof.service\n")
    cg = tmp_path / "cg" / "system.slice" / "powerprof.service"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("536870912\n")
    assert memory_limit_bytes(tmp_path / "proc", tmp_path / "cg") == 512 << 20
    (cg / "memory.max").write_text("max\n")
    assert memory_limit_bytes(tmp_path / "proc", tmp_path / "cg") is None


def test_memory_high_bounds_the_buffers_as_memory_max_does(tmp_path):
    # Before: only memory.max was read. A drop-in `MemoryHigh=256M` under the unit's MemoryMax=512M left the write-
    # failure buffers sized for 512M (half of it, 256 MiB): the cgroup throttled at 256M, and the proxy in the request
    # path with it. The lower of the two bounds decides; either alone does too.
    from powerprof.daemon.service import memory_limit_bytes

    (tmp_path / "proc").write_text("0::/system.slice/powerprof.service\n")
    cg = tmp_path / "cg" / "system.slice" / "powerprof.service"
    cg.mkdir(parents=True)
    read = lambda: memory_limit_bytes(tmp_path / "proc", tmp_path / "cg")  # noqa: E731
    for high, mx, want in (("268435456", "536870912", 256 << 20), ("max", "536870912", 512 << 20),
                           ("268435456", "max", 256 << 20), ("max", "max", None), ("1073741824", "536870912", 512 << 20)):
        (cg / "memory.high").write_text(high + "\n")
        (cg / "memory.max").write_text(mx + "\n")
        assert read() == want, (high, mx)
    (cg / "memory.high").unlink()  # a kernel without the file: memory.max alone, as before
    assert read() == 512 << 20


def test_tag_users_do_not_get_rapl_access():
    u = _unit()
    rapl_steps = [v for v in u["ExecStartPre"] if "energy_uj" in v]
    (rapl_group,) = {m.group(1) for v in rapl_steps for m in re.finditer(r"chgrp (\S+)", v)}
    tag_steps = [v for v in u["ExecStartPre"] if "/run/powerprof" in v]
    (tag_group,) = {m.group(1) for v in tag_steps for m in re.finditer(r"chgrp (\S+)", v)}
    assert rapl_group != tag_group
    doc = (ROOT / "docs" / "daemon.md").read_text()
    assert f"usermod -aG {tag_group} " in doc
    assert not re.search(rf"usermod -aG {re.escape(rapl_group)}\b(?!-)", doc)


def test_unit_has_a_watchdog():
    u = _unit()
    assert int(u["WatchdogSec"][0]) > 0 and u["NotifyAccess"] == ["main"]


def test_watchdog_pings_only_while_the_writer_lives(tmp_path, monkeypatch):
    """sd_notify over a real datagram socket: WATCHDOG=1 while the writer lives; a STATUS line and no ping
    once it is dead, so systemd restarts the daemon."""
    path = tmp_path / "notify.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(str(path))
    srv.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    try:
        d = Daemon(load_config(None, env={}), rig=None)
        assert d._wd_period == pytest.approx(0.1)
        store = DatasetStore(tmp_path / "data", [Dataset("requests", DAEMON_REQUESTS, "t_arrival_utc")])
        d.store, d.flusher = store, Flusher(store, interval_s=0.05).start()
        d._watchdog(time.monotonic())
        assert srv.recv(100) == b"WATCHDOG=1"
        d.flusher.stop()  # the writer is gone
        d._watchdog(time.monotonic() + 1)
        assert srv.recv(200).startswith(b"STATUS=Parquet writer died")
        d._watchdog(time.monotonic() + 2)
        srv.settimeout(0.3)
        with pytest.raises(socket.timeout):
            srv.recv(100)
    finally:
        srv.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_security_exposure_at_most_2(tmp_path):
    assert systemd_exposure(UNIT.read_text(), "powerprof.service", tmp_path) <= 2.0


def test_dry_run_says_what_would_stop_the_real_run(tmp_path):
    # A damaged restore file blocks every change; the dry run, which is how a user checks a plan,
    # must say so rather than print a clean plan that the real run then refuses.
    state = Path(os.environ["POWERPROF_STATE_DIR"])
    state.mkdir(parents=True, exist_ok=True)
    damaged = state / "restore-cccccccccccc.json"
    damaged.write_text('{"format": 1, "gpus": {')
    os.chmod(damaged, 0o600)
    r = CliRunner().invoke(main, ["sweep", "--simulate", "seed-16g", "--limits", "200,250", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "would stop before any change" in r.output and "force-default" in r.output


def test_root_refuses_a_data_dir_another_user_could_write_and_never_follows_a_lock_symlink(tmp_path):
    # Before: a root daemon on a folder others could write opened `.daemon.lock` through a symlink
    # planted there, truncated its target and wrote its PID into it (any file on the machine).
    from powerprof.daemon.service import StartupError, lock_data_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by others (under root's euid, owned by anyone)
    (shared / ".daemon.lock").symlink_to(victim)
    with pytest.raises(StartupError, match="refusing to run as root on data dir .*writable by group or others"):
        lock_data_dir(shared, euid=0)
    assert victim.read_text() == "precious"
    # Whoever runs it, the lock is never opened through a symlink.
    own = tmp_path / "own"
    own.mkdir()
    (own / ".daemon.lock").symlink_to(victim)
    with pytest.raises(OSError):
        lock_data_dir(own, euid=os.geteuid() or 1000)
    assert victim.read_text() == "precious"


@pytest.mark.skipif(not (os.stat("/tmp").st_uid == 0 and os.stat("/tmp").st_mode & 0o1002 == 0o1002),
                    reason="needs a root-owned sticky /tmp that others can write")
def test_root_asked_for_a_data_dir_not_yet_in_tmp_says_to_make_it_not_to_chmod_tmp(tmp_path):
    # docs/daemon.md's first command, `--data-dir /tmp/pp`, run as root: the fix said "chown root: and chmod go-w it
    # and the folders above", i.e. take the write bit off /tmp. The folder is not made; made first, it passes.
    import uuid

    from powerprof.daemon.service import StartupError, lock_data_dir

    name = Path("/tmp") / f"powerprof-test-{uuid.uuid4().hex[:12]}"
    for data_dir, fix in ((name, f"mkdir -m 0700 {name})"), (name / "sub", f"mkdir -m 0700 {name}, then the folders in it")):
        with pytest.raises(StartupError) as e:
            lock_data_dir(data_dir, euid=0)
        said = str(e.value)
        assert f"data dir {data_dir}: it does not exist yet, and root makes no folder in /tmp" in said, said
        assert f"Fix: make it first ({fix}" in said and "chmod" not in said, said
        assert not name.exists()
    if os.geteuid() == 0:  # the fix works: root's own folder in /tmp is a data dir root runs on
        import shutil

        name.mkdir(mode=0o700)
        try:
            os.close(lock_data_dir(name))
        finally:
            shutil.rmtree(name)


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="needs root: chown to another user, and root's own folders as the trusted case")
def test_root_refuses_a_data_dir_owned_by_another_user_and_accepts_its_own(tmp_path):
    from powerprof.daemon.service import StartupError, lock_data_dir

    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(StartupError, match="owned by uid 65534, not root"):
        lock_data_dir(theirs)
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    fd = lock_data_dir(mine)
    os.close(fd)
    assert (mine / ".daemon.lock").read_text() == str(os.getpid())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: folders owned by another user")
def test_root_refuses_a_data_dir_holding_a_folder_another_user_could_write(tmp_path):
    # Before: only the data dir and the folders above it were checked. `chown root: data` (the fix the refusal said)
    # left `data/requests` another user's: in it they could link a day's partition to any folder (root then wrote its
    # rows there, and compaction and retention replaced and deleted `*.parquet` and `.*.tmp` files there) or write
    # the compaction journal root obeys.
    from powerprof.daemon.service import StartupError, lock_data_dir

    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    (data / "requests").mkdir(mode=0o755)
    os.chown(data / "requests", 65534, 65534)
    with pytest.raises(StartupError, match=r"requests is owned by uid 65534, not root.*chown -R root: it"):
        lock_data_dir(data)
    os.chown(data / "requests", 0, 0)  # root's, but a partition in it another user's: the same
    (data / "requests" / "date=2026-12-03").mkdir()
    (data / "requests" / "date=2026-12-03").chmod(0o777)
    with pytest.raises(StartupError, match=r"date=2026-12-03 is writable by group or others"):
        lock_data_dir(data)
    (data / "requests" / "date=2026-12-03").chmod(0o755)
    elsewhere = tmp_path / "disk2"  # root's own link to root's own folder (a dataset moved to another disk): fine
    elsewhere.mkdir(mode=0o755)
    (data / "samples").symlink_to(elsewhere)
    os.close(lock_data_dir(data))


def _root_folder_behind_another_users_link(tmp_path):
    """`roots` (root's, empty) and `theirs` (uid 65534's), in which `link` is their symlink to `roots`."""
    roots = tmp_path / "roots"
    roots.mkdir(mode=0o755)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "link").symlink_to(roots)
    os.lchown(theirs / "link", 65534, 65534)
    os.chown(theirs, 65534, 65534)
    return roots, theirs


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a symlink and a folder owned by another user")
def test_root_refuses_a_data_dir_reached_through_another_users_symlink_and_makes_nothing_first(tmp_path):
    # Before: the rule checked the folder's real path (realpath), so `theirs/link/data`, with `link` another user's
    # symlink to a folder of root's, passed: they could point the link at a folder of their own at any moment after.
    # And the data dir was made (mkdir -p, through that symlink) before the check: a refused start left root's
    # folder with a new `data` in it.
    from powerprof.daemon.service import StartupError, lock_data_dir

    roots, theirs = _root_folder_behind_another_users_link(tmp_path)
    with pytest.raises(StartupError, match="link is a symlink"):
        lock_data_dir(theirs / "link" / "data")
    assert list(roots.iterdir()) == []
    (roots / "data").mkdir(mode=0o755)  # the same once the data dir exists: the symlink on its way is another user's
    with pytest.raises(StartupError, match="owned by uid 65534, not root"):
        lock_data_dir(theirs / "link" / "data")
    assert list((roots / "data").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0,
                    reason="the rule is root's: an unprivileged daemon may use its own shared folders")
def test_root_opens_no_tag_socket_in_a_folder_others_can_write(tmp_path):
    # Before: root unlinked a stale socket there and chmod-ed the new one by name, so a user who could
    # write the folder could swap the name for a symlink between bind and chmod.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    d = DaemonProc(tmp_path / "data", "--simulate", "--tag-socket", str(shared / "t.sock"), env=sim_env(tmp_path))
    try:
        assert "tags" not in d.info
    finally:
        assert d.stop() == 0
    assert not (shared / "t.sock").exists()
    assert "refusing, as root, a socket folder another user could write" in d.output()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a symlink owned by another user")
def test_root_makes_no_tag_socket_folder_through_another_users_symlink(tmp_path):
    # Before: the socket's folder was made (mkdir -p) first and checked after, so a refused socket still left root's
    # new folder wherever another user's symlink pointed.
    roots, theirs = _root_folder_behind_another_users_link(tmp_path)
    d = DaemonProc(tmp_path / "data", "--simulate", "--tag-socket", str(theirs / "link" / "sub" / "t.sock"),
                   env=sim_env(tmp_path))
    try:
        assert "tags" not in d.info
    finally:
        assert d.stop() == 0
    assert list(roots.iterdir()) == []
    assert "tag API disabled" in d.output() and "link is a symlink" in d.output()


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another user needs root")
@pytest.mark.parametrize("force", [False, True])
def test_root_takes_no_gpu_lock_in_a_state_folder_another_user_controls(tmp_path, monkeypatch, force):
    # Before: `restore --restore-file ROOTS_FILE` (and --force-default) took the GPU's lock in POWERPROF_STATE_DIR
    # unchecked: with it in another user's folder, a `locks` symlink planted there had root make the lock file in
    # whatever folder it named. The controller already refused such a state folder; restore now does the same.
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    default_w = _limit_w(tmp_path)
    _set_limit(tmp_path, default_w - 40)
    p = _foreign_restore_file(tmp_path, owner_uid=0)  # root's own file, in a folder of root's
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    target = tmp_path / "roots-only"
    target.mkdir(mode=0o700)
    os.symlink(target, theirs / "locks")
    os.lchown(theirs / "locks", 65534, 65534)
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(theirs))
    r = CliRunner().invoke(main, ["restore", "--simulate", "seed-16g", "--restore-file", str(p),
                                  *(["--force-default"] if force else [])])
    said = " ".join(r.output.split())
    assert r.exit_code == 1, r.output
    assert f"state folder {theirs}: refusing to keep GPU locks" in said and "owned by uid 65534" in said, said
    assert list(target.iterdir()) == [] and p.exists() and _limit_w(tmp_path) == default_w - 40
    if force:  # a damaged file's way out, called on its own: the same refusal before any lock
        from powerprof.control.restore import force_default

        out = force_default(p, _sim(tmp_path), directory=theirs)
        assert out.status == "refused" and f"state folder {theirs}: refusing" in out.message, out
        assert list(target.iterdir()) == [] and p.exists() and _limit_w(tmp_path) == default_w - 40
