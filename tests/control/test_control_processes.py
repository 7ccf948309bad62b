"""The restore guarantee across processes: signals, exceptions and SIGKILL, checked through the simulator's state file."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerprof.cli import main as cli_main
from powerprof.control import GpuBusyError, LimitController
from powerprof.sim.nvml import SimNVML

from conftest import ORIGINAL_W, assert_untouched, child_cmd, preset_originals, restore_files, sim_state

WAIT_S = 20  # bound on any wait for a child; children normally answer within a second


def _start(args, env=None):
    return subprocess.Popen(child_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_line(p, prefix):
    """Read the child's stdout until a line starting with prefix. Bounded by WAIT_S via a timer kill."""
    timer = threading.Timer(WAIT_S, p.kill)
    timer.start()
    try:
        for line in p.stdout:
            if line.startswith(prefix):
                return line
    finally:
        timer.cancel()
    raise AssertionError(f"child never printed {prefix!r}; stderr: {p.stderr.read()}")


def _finish(p):
    out, err = p.communicate(timeout=WAIT_S)
    return p.returncode, out, err


def test_normal_exit_puts_limits_back(originals):
    r = subprocess.run(child_cmd("--clocks", "1500,1200", "--dwell", "0.01"), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert "STEPPED 260" in r.stdout
    assert_untouched()
    assert restore_files() == []


def test_exception_mid_level_puts_limits_back_and_fails(originals):
    r = subprocess.run(child_cmd("--fail-after", "2", "--clocks", "1500"), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 1
    assert "workload failed at level 220 W" in r.stderr
    assert_untouched()
    assert restore_files() == []


# SIGQUIT (Ctrl-backslash), SIGUSR2, SIGALRM, SIGXCPU, SIGVTALRM: their default action killed the child with the GPUs capped.
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGQUIT,
                                 signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU, signal.SIGVTALRM], ids=lambda s: s.name)
def test_signal_puts_limits_back_and_exits_non_zero(originals, sig):
    p = _start(["--repeat", "0", "--dwell", "0.05", "--clocks", "1500,1200"])
    _wait_for_line(p, "STEPPED")
    assert sim_state() != [(w, None) for w in ORIGINAL_W]  # the child really changed something
    p.send_signal(sig)
    code, out, err = _finish(p)
    assert code != 0, out
    if sig != signal.SIGINT:
        assert code == 128 + sig
    assert "DONE" not in out
    assert_untouched()
    assert restore_files() == []


def test_second_process_on_a_gpu_fails_clearly_and_first_is_unaffected(originals):
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    try:
        _wait_for_line(p, "STEPPED")
        with pytest.raises(GpuBusyError) as ei:
            LimitController(SimNVML("seed-16g", count=2), [1]).open()
        assert f"powerprof process {p.pid}" in str(ei.value) and ei.value.holder_pid == p.pid
        second = subprocess.run(child_cmd("--gpus", "0"), capture_output=True, text=True, timeout=WAIT_S)
        assert second.returncode == 2 and f"powerprof process {p.pid}" in second.stderr
        assert sim_state() == [(200.0, None)] * 2
        assert p.poll() is None, "the first controller must keep running"
    finally:
        p.terminate()
    code, _, _ = _finish(p)
    assert code == 128 + signal.SIGTERM
    assert_untouched()


@contextlib.contextmanager
def _holding_both_gpus_at_200():
    """A child controller stepping both simulated GPUs to 200 W and holding them, ended by SIGTERM (and checked) at the
    block's end."""
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    try:
        _wait_for_line(p, "STEPPED")
        yield p
        assert sim_state() == [(200.0, None)] * 2 and p.poll() is None
    finally:
        p.terminate()
    assert _finish(p)[0] == 128 + signal.SIGTERM
    assert_untouched()


def test_a_second_process_keeping_its_state_elsewhere_is_refused_too(originals, tmp_path):
    # Two state folders (root's sweep beside a CAP_SYS_ADMIN user's, another POWERPROF_STATE_DIR) had a lock each: the
    # second took the first one's 200 W for the original, both said "every GPU is back", and the GPU stayed capped
    # (session 46's hostile review). The GPU's machine-wide lock refuses it, naming the holder.
    from powerprof.rig import Rig  # noqa: PLC0415

    with _holding_both_gpus_at_200() as p:
        elsewhere = dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state"))
        second = subprocess.run(child_cmd("--gpus", "0", "--levels", "250"), capture_output=True, text=True,
                                timeout=WAIT_S, env=elsewhere)
        assert second.returncode == 2, second.stderr
        assert f"powerprof process {p.pid} (uid {os.getuid()})" in second.stderr, second.stderr
        assert "another state folder" in second.stderr
        with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2)) as rig, pytest.raises(GpuBusyError) as ei:
            rig.controller([1], state_dir_path=tmp_path / "third-state").open()
        assert ei.value.holder_pid == p.pid


def test_restore_and_force_default_leave_a_gpu_another_state_folders_controller_holds(originals, tmp_path):
    # They took the state folder's lock alone: `restore --force-default` set a GPU a sweep of another state folder held at
    # 200 W to its default under it (session 46's review). And a symlink in a restore file's place named no UUID, so
    # "every GPU" went to its default (before, the GPUs its target named).
    with _holding_both_gpus_at_200():
        elsewhere = dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state"))
        (tmp_path / "other-state").mkdir()
        damaged = tmp_path / "other-state" / "restore-aaaaaaaaaaaa.json"
        uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
        damaged.write_text('{"gpus": {"' + uuid + '": {')
        os.chmod(damaged, 0o600)
        link = tmp_path / "other-state" / "restore-bbbbbbbbbbbb.json"
        link.symlink_to(damaged)
        for target in (damaged, link):
            r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g",
                                "--force-default", "--restore-file", str(target)],
                               capture_output=True, text=True, timeout=WAIT_S, env=elsewhere)
            said = " ".join((r.stdout + r.stderr).split())
            assert r.returncode != 0, said
            assert ("in another state folder" if target == damaged else "Not changed") in said, said
            assert sim_state() == [(200.0, None)] * 2, (target, said)  # both still at the held level
        assert damaged.exists()


def test_a_simulator_of_its_own_is_another_gpu_for_the_machine_wide_lock(originals, tmp_path):
    # Each simulator state file is a GPU of its own (tests run many side by side, their UUIDs alike): its lock is not
    # another state file's, and a simulator held in one process only takes none.
    from powerprof.rig import Rig  # noqa: PLC0415

    with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2)) as rig, rig.controller([0], state_dir_path=tmp_path / "a"):
        with pytest.raises(GpuBusyError, match="another controller of this process"):  # never "kill <its own PID>"
            rig.controller([0], state_dir_path=tmp_path / "b").open()
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    try:
        _wait_for_line(p, "STEPPED")
        with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2, state_path=tmp_path / "own.json")) as rig, \
                rig.controller([0], state_dir_path=tmp_path / "s1") as ctl:
            assert ctl.devices[0].uuid == SimNVML("seed-16g", count=2, state_path=None).gpus[0].uuid
        with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2, state_path=None)) as rig:
            assert rig.machine_scope is None
    finally:
        p.terminate()
    _finish(p)
    assert Rig(None).machine_scope == "nvml"


def _kill_case(case_dir: Path, delay_s: float, results: list, k: int):
    env = dict(os.environ)
    env["POWERPROF_STATE_DIR"] = str(case_dir / "powerprof")
    env["POWERPROF_SIM_STATE"] = str(case_dir / "sim.json")
    p = _start(["--levels", "180,220,260,200", "--clocks", "1500,1200", "--dwell", "0.02", "--repeat", "2"], env)
    try:
        _wait_for_line(p, "READY")
        time.sleep(delay_s)
        p.kill()
    finally:
        p.wait(timeout=WAIT_S)
    results[k] = p.returncode


@pytest.mark.slow
def test_sigkill_at_random_points_then_powerprof_restore_puts_every_gpu_back(tmp_path, monkeypatch):
    seed = int(os.environ.get("POWERPROF_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    n = 20
    # The run after READY lasts ~0.2-0.3 s here: delays cover it and a bit beyond (a kill after a normal exit).
    delays = [rng.uniform(0.0, 0.35) for _ in range(n)]
    cases = [tmp_path / f"case{k}" for k in range(n)]
    for c in cases:
        c.mkdir()
        preset_originals(c / "sim.json")
    codes: list = [None] * n
    for start in range(0, n, 4):  # four at a time: the machine has two cores shared with others
        threads = [threading.Thread(target=_kill_case, args=(cases[k], delays[k], codes, k)) for k in range(start, min(n, start + 4))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 2)

    runner = CliRunner()
    changed = 0
    for k, c in enumerate(cases):
        ctx = f"case {k} (seed {seed}, kill after {delays[k]:.3f} s, child exit {codes[k]})"
        env = {"POWERPROF_STATE_DIR": str(c / "powerprof"), "POWERPROF_SIM_STATE": str(c / "sim.json")}
        if restore_files(c / "powerprof"):
            changed += 1
        if k == 0:  # the installed entry point once, the rest in-process for speed
            r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate"], env={**os.environ, **env},
                               capture_output=True, text=True, timeout=WAIT_S)
            code, output = r.returncode, r.stdout + r.stderr
        else:
            res = runner.invoke(cli_main, ["restore", "--simulate"], env=env)
            code, output = res.exit_code, res.output
        assert code == 0, f"{ctx}: {output}"
        assert sim_state(c / "sim.json") == [(w, None) for w in ORIGINAL_W], ctx
        assert restore_files(c / "powerprof") == [], ctx
        # No stale lock: a new controller takes both GPUs at once.
        with LimitController(SimNVML("seed-16g", count=2, state_path=c / "sim.json"), [0, 1], state_dir_path=c / "powerprof",
                             handle_signals=False):
            pass
    # Guard against a vacuous pass: most kills must land while the GPUs were changed.
    print(f"{changed} of {n} kills left a GPU changed (seed {seed})")
    assert changed >= 5, f"only {changed} of {n} kills hit a changed GPU (seed {seed})"
    assert all(c is not None for c in codes)


@pytest.mark.parametrize("where", ["same state folder", "another state folder"])
def test_a_dry_run_beside_a_live_controller_says_the_gpu_is_in_use_not_a_leftover(originals, tmp_path, where):
    # `sweep --dry-run` while another sweep held the GPU said it "still has settings changed by an earlier powerprof run
    # (pid N) that were never put back ... Run `powerprof restore` first" and "Afterwards ... GPU 0 to 200 W" (the
    # live run's level, as the original), exit 0 (session 47's hostile review). `restore` itself said it is in use.
    with _holding_both_gpus_at_200() as p:
        env = dict(os.environ)
        if where == "another state folder":
            env["POWERPROF_STATE_DIR"] = str(tmp_path / "other-state")
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "seed-16g", "--gpus", "0",
                            "--limits", "180,300", "--dry-run", "--out", str(tmp_path / "x")],
                           capture_output=True, text=True, timeout=WAIT_S, env=env)
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 1, said
        assert f"GPU 0 is in use by powerprof process {p.pid}" in said, said
        assert "until it ends" in said and "never put back" not in said and "powerprof restore" not in said, said
        assert "to 200 W" not in said, said
        assert not (tmp_path / "x").exists()
