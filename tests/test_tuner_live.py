"""`powerprof tune` on the simulated GPU behind a stand-in daemon: it moves the limit, records why, and every fault ends at
the reference level or the original limit."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.tuner.observe import ObserveError, fetch_metrics, parse_counters, window_between
from powerprof.tuner.policy import TunerConfig
from powerprof.tuner.runner import TuneRunner
from tuner_helpers import FakeDaemon

LEVELS = (150, 200, 250, 300)


def _cfg(**kw):
    base = dict(levels=LEVELS, reference=300, tpot_p95_ms=100.0, tick_s=10, window_s=20, dwell_s=20, min_requests=10,
                guard_s=30, guard_min_requests=5, stale_s=30, max_explore_share=1.0, backoff_s=20)
    base.update(kw)
    return TunerConfig(**base)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _limit_w(nvml) -> float:
    return nvml.gpus[0].limit_w


def _drive(runner, clock, ticks):
    for _ in range(ticks):
        clock.t += runner.cfg.tick_s
        runner.tick()


def _below_reference(runner, clock, nvml):
    _drive(runner, clock, 12)
    assert _limit_w(nvml) < 300, [d.reason for d in runner.tuner.decisions]


def test_the_daemon_exposition_reads_back_as_the_window_it_describes():
    with FakeDaemon(per_scrape=20, tpot_s=0.05) as fd:
        a = parse_counters(fetch_metrics(fd.url), 0.0)
        b = parse_counters(fetch_metrics(fd.url), 10.0)
    w = window_between(a, b, 300.0)
    assert w.requests == 20 and w.tokens == 1600 and w.energy_j == pytest.approx(1600.0)
    assert w.prompt_tokens == 8000 and w.output_tokens == 1600
    assert sum(w.tpot_counts) == 20 and sum(w.ttft_counts) == 20
    with pytest.raises(ObserveError, match="backwards"):
        window_between(b, a, 300.0)
    with pytest.raises(ObserveError, match="lack"):
        parse_counters("# nothing here\n", 0.0)
    with pytest.raises(ObserveError, match="cannot read"):
        fetch_metrics("http://127.0.0.1:1/metrics", timeout_s=1)


@pytest.mark.parametrize("fault", ["down", "frozen", "upstream"])
def test_lost_figures_send_the_gpu_back_to_the_reference_level(tmp_path, fault):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon() as fd, Rig("seed-16g", nvml=nvml) as rig, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            out_dir=tmp_path / "decisions", clock=clock)
        runner.start()
        _below_reference(runner, clock, nvml)
        fd.mode = fault
        _drive(runner, clock, 2)
        assert _limit_w(nvml) < 300  # within stale_s nothing is decided on a hiccup
        _drive(runner, clock, 3)
        assert _limit_w(nvml) == 300
        assert runner.tuner.decisions[-1].action == "stale"
        text = generate_latest(runner.metrics.registry).decode()
        assert "powerprof_tuner_stale 1.0" in text and 'powerprof_tuner_level{knob="power"} 300.0' in text
        fd.mode = "ok"
        _drive(runner, clock, 3)
        assert any(d.action == "resume" for d in runner.tuner.decisions)
    rows = pq.read_table(tmp_path / "decisions").to_pylist()
    stale = [r for r in rows if r["action"] == "stale"]
    assert len(stale) == 1 and stale[0]["to_level"] == 300 and stale[0]["applied"] and stale[0]["reason"]
    assert _limit_w(nvml) == 300  # the controller put back the original limit on leaving


def test_the_kill_switch_pins_the_reference_and_the_original_limit_comes_back(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(280)  # the operator's own limit before the tuner
    clock = Clock()
    with FakeDaemon() as fd, Rig("seed-16g", nvml=nvml) as rig, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock)
        runner.start()
        _below_reference(runner, clock, nvml)
        runner.on_sigusr1()
        runner.check_kill()
        assert _limit_w(nvml) == 300
        _drive(runner, clock, 20)
        assert _limit_w(nvml) == 300
    assert _limit_w(nvml) == 280


def test_dry_run_only_recommends(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon() as fd:
        runner = TuneRunner(_cfg(dry_run=True), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=None,
                            gpus=[0], out_dir=tmp_path / "d", clock=clock)
        runner.start()
        _drive(runner, clock, 12)
    assert runner.tuner.level < 300  # what it would do…
    assert _limit_w(nvml) == 300  # …done to nothing
    rows = pq.read_table(tmp_path / "d").to_pylist()
    assert any(r["action"] == "explore" for r in rows) and not any(r["applied"] for r in rows)


# --- the command, as a process -------------------------------------------------------------------

def _start_tune(tmp_path, fd):
    cfg = tmp_path / "tune.toml"
    cfg.write_text('[tuner]\nlevels = "150,200,250,300"\ntpot_p95_ms = 100\ntick_s = 0.2\nwindow_s = 0.3\n'
                   "dwell_s = 0.4\nmin_requests = 5\nguard_s = 1\nguard_min_requests = 5\nstale_s = 5\n"
                   "max_explore_share = 1.0\nexplore_horizon_s = 60\nregime_s = 30\n")
    cfg.chmod(0o644)
    out = tmp_path / "decisions"
    proc = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", fd.url,
                             "--config", str(cfg), "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tune exited early: {proc.stderr.read()}")
        if out.exists() and any(r["action"] == "explore" for f in out.rglob("*.parquet") for r in pq.read_table(f).to_pylist()):
            return proc, out
        time.sleep(0.1)
    proc.kill()
    pytest.fail("the tuner never explored")


def _sim_limit_w():
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    return sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0)) / 1000


@pytest.fixture
def operator_limit():
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    sim.nvmlDeviceSetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0), 280_000)
    assert _sim_limit_w() == 280
    return 280.0


def test_sigterm_ends_at_the_original_limit(tmp_path, operator_limit):
    with FakeDaemon() as fd:
        proc, _ = _start_tune(tmp_path, fd)
        try:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert _sim_limit_w() == operator_limit


def test_sigkill_then_restore_puts_the_original_limit_back(tmp_path, operator_limit):
    with FakeDaemon() as fd:
        proc, _ = _start_tune(tmp_path, fd)
        deadline = time.monotonic() + 30
        while _sim_limit_w() in (operator_limit, 300.0) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the exploration's level is on the GPU
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert _sim_limit_w() not in (operator_limit, 300.0)  # killed while it held a trial level
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _sim_limit_w() == operator_limit


def test_sigusr1_goes_to_the_reference_and_holds_while_running(tmp_path, operator_limit):
    with FakeDaemon() as fd:
        proc, out = _start_tune(tmp_path, fd)
        try:
            proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                    r["action"] == "kill" for f in out.rglob("*.parquet") for r in pq.read_table(f).to_pylist()):
                time.sleep(0.05)
            assert _sim_limit_w() == 300.0
            time.sleep(1.5)  # ticks go on; the reference stays
            assert _sim_limit_w() == 300.0 and proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert _sim_limit_w() == operator_limit


def test_dry_run_needs_no_privilege_and_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_UNPRIVILEGED", "1")  # the simulator refuses every set, as for a normal user
    with FakeDaemon() as fd:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", fd.url,
                            "--levels", "150,200,250,300", "--tpot-p95-ms", "100", "--dry-run", "--duration", "1.5",
                            "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "dry run" in r.stderr
    rows = pq.read_table(tmp_path / "d").to_pylist()
    assert rows[0]["action"] == "start" and rows[0]["applied"] is False
    assert _sim_limit_w() == 300.0


@pytest.mark.parametrize("args,msg", [
    (["--levels", "150,999", "--tpot-p95-ms", "100"], "999"),
    (["--levels", "150,300"], "set an SLO"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--reference", "200"], "not one of the levels"),
])
def test_bad_tuner_settings_exit_2_and_change_nothing(tmp_path, args, msg):
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics",
                        "http://127.0.0.1:1/metrics", "--out", str(tmp_path / "d"), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert _sim_limit_w() == 300.0 and not (tmp_path / "d").exists()


def test_a_config_file_others_can_write_is_refused_as_root(tmp_path):
    from powerprof.tuner.policy import TunerConfigError
    from powerprof.tuner.setup import load_table

    f = tmp_path / "tuner.toml"
    f.write_text("[tuner]\ntpot_p95_ms = 100\n")
    f.chmod(0o666)
    with pytest.raises(TunerConfigError, match="owned by uid|writable by group or others"):
        load_table(f, euid=0)
    f.chmod(0o644)
    if f.stat().st_uid == 0:
        assert load_table(f, euid=0) == {"tpot_p95_ms": 100}
    with pytest.raises(TunerConfigError, match="only \\[tuner\\]"):
        f.write_text("[daemon]\nx = 1\n")
        load_table(f, euid=f.stat().st_uid)
