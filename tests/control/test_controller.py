"""LimitController in-process on the simulator: restore on exit/error, read-back, fallback, permission, locks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pynvml
import pytest

from powerprof.control import (
    ControlError,
    ControlPermissionError,
    GpuBusyError,
    LevelError,
    LimitController,
    LimitNotAppliedError,
    PendingRestoreError,
    make_plan,
    pending_restore_note,
    restore_from_file,
)
from powerprof.sim.nvml import SimNVML

from conftest import HERE, ORIGINAL_W, Wrap, assert_untouched, door_controller, door_restore, restore_files, sim_state

sys.path.insert(0, str(HERE))
import control_child  # noqa: E402


def sim(**kw):
    return SimNVML("seed-16g", count=2, **kw)


def test_levels_are_applied_read_back_and_everything_put_back(originals):
    with door_controller(sim(), [0, 1]) as ctl:
        assert ctl.original_limits_w == ORIGINAL_W
        for w in ctl.parse_power_levels("180,220W,80%"):
            rb = ctl.set_power_limit_w(w)
            assert rb.level_w == w
            assert [(g.limit_w, g.enforced_w, g.method) for g in rb.gpus] == [(w, w, "nvml")] * 2
            assert sim_state() == [(w, None)] * 2
        ctl.lock_sm_clock_mhz(1500)
        assert [c for _, c in sim_state()] == [(1500, 1500)] * 2
        assert len(restore_files()) == 1
    assert_untouched()
    assert restore_files() == []


def test_restore_file_holds_the_originals_before_the_first_change(originals):
    seen = []

    class Checking(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            files = restore_files()
            seen.append((mw, files))
            if mw != int(ORIGINAL_W[h.index] * 1000):  # a real change, not the permission probe
                assert len(files) == 1, "changed a limit before the restore file existed"
                rec = json.loads(files[0].read_text())
                assert sorted(g["original_limit_mw"] for g in rec["gpus"].values()) == [280000, 300000]
                assert rec["pid"] == os.getpid() and rec["simulated"] == {
                    "profile": "seed-16g", "count": 2, "state_file": os.path.realpath(os.environ["POWERPROF_SIM_STATE"])}
            return self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)

    with door_controller(Checking(sim()), [0, 1]) as ctl:
        ctl.set_power_limit_w(200)
    assert any(mw == 200000 for mw, _ in seen)
    assert_untouched()


def test_exception_mid_level_restores_and_propagates(originals):
    with pytest.raises(RuntimeError, match="server died"):
        with door_controller(sim(), [0, 1]) as ctl:
            ctl.set_power_limit_w(180)
            ctl.lock_sm_clock_mhz(1200, 1500)
            raise RuntimeError("server died")
    assert_untouched()
    assert restore_files() == []


def test_a_set_that_does_not_take_effect_is_an_error_and_restores(originals):
    class Ignoring(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            if h.index == 1:
                return None  # the driver says success but nothing changes
            return self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)

    with door_controller(Ignoring(sim()), [0, 1]) as ctl:
        with pytest.raises(LimitNotAppliedError, match="GPU 1: asked for 200 W, the limit reads 300 W"):
            ctl.set_power_limit_w(200)
        assert_untouched()  # GPU 0 had taken 200 W: already put back
        assert restore_files() == []
    assert_untouched()


def test_an_enforced_limit_off_the_requested_one_is_an_error(originals):
    class Overridden(Wrap):
        def nvmlDeviceGetEnforcedPowerLimit(self, h):
            return min(self.inner.nvmlDeviceGetEnforcedPowerLimit(h), 240000)  # some other limiter at 240 W

    with door_controller(Overridden(sim()), [0, 1]) as ctl:
        ctl.set_power_limit_w(200)  # under the other limiter: fine
        with pytest.raises(LimitNotAppliedError, match="enforced limit is 240 W"):
            ctl.set_power_limit_w(260)
        assert_untouched()


def test_nvidia_smi_fallback_where_nvml_cannot_set(originals):
    calls = []

    class NoSetter(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    inner = sim()

    def fake_smi(args):
        calls.append(list(args))
        assert args[0] == "-i" and args[2] == "-pl"
        inner.nvmlDeviceSetPowerManagementLimit(inner.nvmlDeviceGetHandleByUUID(args[1]), int(float(args[3]) * 1000))

    u0, u1 = (g.uuid for g in inner.gpus)
    with door_controller(NoSetter(inner), [0, 1], nvidia_smi=fake_smi) as ctl:
        rb = ctl.set_power_limit_w(220)
        assert [g.method for g in rb.gpus] == ["nvidia-smi"] * 2
        assert [g.limit_w for g in rb.gpus] == [220.0, 220.0]
    assert calls[:2] == [["-i", u0, "-pl", "220"], ["-i", u1, "-pl", "220"]]
    assert calls[2:] == [["-i", u0, "-pl", "280"], ["-i", u1, "-pl", "300"]]  # restore goes the same way
    assert_untouched()


def test_a_failing_nvidia_smi_is_an_error_and_restores(originals):
    class NoSetter(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    inner = sim()

    def smi(args):
        i, w = inner.nvmlDeviceGetHandleByUUID(args[1]).index, float(args[3])
        if i == 1 and w != ORIGINAL_W[1]:
            raise ControlError("`nvidia-smi -i 1 -pl 200` failed: Unknown Error")
        inner.nvmlDeviceSetPowerManagementLimit(inner.nvmlDeviceGetHandleByIndex(i), int(w * 1000))

    with door_controller(NoSetter(inner), [0, 1], nvidia_smi=smi) as ctl:
        with pytest.raises(ControlError, match="Unknown Error"):
            ctl.set_power_limit_w(200)
        assert_untouched()


def test_no_permission_is_a_clear_error_before_anything_changes(originals):
    with pytest.raises(ControlPermissionError) as ei:
        door_controller(sim(privileged=False), [0, 1]).open()
    msg = str(ei.value)
    assert "root or CAP_SYS_ADMIN" in msg and "sudo" in msg and "powerprof measure" in msg and "Nothing was changed" in msg
    assert_untouched()
    assert restore_files() == []
    with door_controller(sim(), [0, 1]):  # the failed attempt left no lock behind
        pass


def test_second_controller_on_a_gpu_fails_naming_the_holder_and_first_is_unaffected(originals):
    with door_controller(sim(), [0, 1]) as first:
        first.set_power_limit_w(200)
        with pytest.raises(GpuBusyError) as ei:
            door_controller(sim(), [1]).open()
        assert f"controlled by powerprof process {os.getpid()}" in str(ei.value)
        assert ei.value.holder_pid == os.getpid()
        assert sim_state() == [(200.0, None)] * 2  # the failed second one changed nothing
        assert len(restore_files()) == 1
        first.set_power_limit_w(240)
        assert sim_state() == [(240.0, None)] * 2
    assert_untouched()
    with door_controller(sim(), [1]):
        pass


def test_controllers_on_disjoint_gpus_coexist(originals):
    with door_controller(sim(), [0]) as a, door_controller(sim(), [1]) as b:
        a.set_power_limit_w(200)
        b.set_power_limit_w(250)
        assert len(restore_files()) == 2
        assert sim_state() == [(200.0, None), (250.0, None)]
    assert_untouched()


def test_bad_values_passed_to_the_controller_change_nothing(originals):
    with door_controller(sim(), [0, 1]) as ctl:
        with pytest.raises(LevelError, match="400 W is outside the allowed range"):
            ctl.set_power_limit_w(400)
        with pytest.raises(LevelError, match="outside the allowed range 510-2790 MHz"):
            ctl.lock_sm_clock_mhz(100, 1500)
        with pytest.raises(LevelError, match="reversed"):
            ctl.lock_sm_clock_mhz(1500, 1200)
        assert restore_files() == []
    assert_untouched()


@pytest.mark.parametrize(
    "levels, fragment",
    [
        ("", "no power levels given"),
        ("180,abc", "'abc' is not a number"),
        ("-200", "'-200' is negative"),
        ("180,220,180W", "duplicates '180'"),
        ("100,220", "'100' is outside the allowed range 150-320 W"),
    ],
)
def test_each_bad_input_exits_non_zero_with_a_message_and_the_gpu_unchanged(originals, capsys, levels, fragment):
    assert control_child.main(["--levels", levels]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "150-320 W" in err and "default 300 W" in err
    assert_untouched()
    assert restore_files() == []


def test_bad_gpu_list_and_clock_list_exit_non_zero(originals, capsys):
    assert control_child.main(["--gpus", "0,5"]) == 2
    assert "GPU 5 does not exist" in capsys.readouterr().err
    assert control_child.main(["--clocks", "5000"]) == 2
    assert "510-2790 MHz" in capsys.readouterr().err
    assert_untouched()


def test_clock_lock_and_release(originals):
    with door_controller(sim(), [0, 1]) as ctl:
        ctl.lock_sm_clock_mhz(1200, 1500)
        assert [c for _, c in sim_state()] == [(1200, 1500)] * 2
        rec = json.loads(restore_files()[0].read_text())
        assert all(g["clocks_locked"] for g in rec["gpus"].values())
        ctl.release_clocks()
        assert [c for _, c in sim_state()] == [None, None]
        ctl.lock_sm_clock_mhz(1395)
    assert_untouched()


def test_plan_validates_and_touches_nothing(originals):
    class ReadOnly(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, *a):
            raise AssertionError("dry run called a setter")

        nvmlDeviceSetGpuLockedClocks = nvmlDeviceResetGpuLockedClocks = nvmlDeviceSetPowerManagementLimit

    plan = make_plan(ReadOnly(sim()), [0, 1], "180,220W,80%", "1500", permitted=True)
    assert plan.power_levels_w == (180.0, 220.0, 240.0) and plan.clock_levels_mhz == (1500,)
    text = "\n".join(plan.lines())
    assert "nothing will be changed" in text and "GPU 0 to 280 W, GPU 1 to 300 W" in text and "180 W, 220 W, 240 W" in text
    with pytest.raises(LevelError):
        make_plan(ReadOnly(sim()), [0, 1], "999", permitted=True)
    assert "sudo" in "\n".join(make_plan(sim(), [0], "200", permitted=False).lines())
    # Through the door, the simulator's own privilege decides, and the plan says what the GPUs are.
    from powerprof.rig import Rig

    door = Rig("seed-16g", nvml=sim(privileged=False)).plan([0], "200")
    assert "sudo" in "\n".join(door.lines()) and "(simulated seed-16g)" in door.lines()[0]
    assert_untouched()
    assert restore_files() == []


def _leave_pending_record():
    """What a kill -9 leaves: the limit changed and the restore file in place."""
    with door_controller(sim(), [0, 1]) as ctl:
        ctl.set_power_limit_w(190)
        ctl.lock_sm_clock_mhz(1500)
        saved = restore_files()[0].read_bytes()
        path = ctl.restore_path
        # Re-apply what a crash would leave, after the controller's own restore below.
    n = sim()
    n.nvmlInit()
    for i in range(2):
        n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(i), 190000)
        n.nvmlDeviceSetGpuLockedClocks(n.nvmlDeviceGetHandleByIndex(i), 1500, 1500)
    path.write_bytes(saved)
    return path


def test_a_pending_record_blocks_new_runs_and_restore_puts_everything_back(originals):
    path = _leave_pending_record()
    note = pending_restore_note()
    assert note and "GPU 0" in note and "original power limit 280 W" in note and "SM clocks locked" in note
    assert f"powerprof restore --restore-file {path}" in note
    with pytest.raises(PendingRestoreError, match="powerprof restore"):
        door_controller(sim(), [1]).open()
    assert sim_state() == [(190.0, (1500, 1500))] * 2
    report = door_restore()
    assert report.ok, report.lines()
    assert "Restored from" in report.lines()[0]
    assert_untouched()
    assert restore_files() == [] and pending_restore_note() is None


def test_restore_leaves_a_running_controller_alone(originals):
    with door_controller(sim(), [0, 1]) as ctl:
        ctl.set_power_limit_w(200)
        report = door_restore()
        assert not report.ok and report.outcomes[0].status == "in_use"
        assert sim_state() == [(200.0, None)] * 2 and len(restore_files()) == 1
        assert "still running" in pending_restore_note()
    assert_untouched()


def test_restore_without_permission_keeps_the_file(originals):
    path = _leave_pending_record()
    report = restore_from_file(nvml_factory=lambda rec: sim(privileged=False))
    assert not report.ok and "CAP_SYS_ADMIN" in report.lines()[0] and "kept" in report.lines()[0]
    assert path.exists()
    assert door_restore(path).ok
    assert_untouched()


def test_restore_simulate_refuses_a_real_gpu_record(originals):
    path = _leave_pending_record()
    rec = json.loads(path.read_text())
    rec["simulated"] = None
    path.write_text(json.dumps(rec))
    report = door_restore(sim_profile="seed-16g")
    assert report.outcomes[0].status == "refused" and path.exists()
    assert sim_state() == [(190.0, (1500, 1500))] * 2


def test_signal_inside_a_with_block_restores_and_exits_128_plus_signum(originals):
    prev = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as ei:
        with door_controller(sim(), [0, 1]) as ctl:
            ctl.set_power_limit_w(200)
            signal.raise_signal(signal.SIGTERM)
            pytest.fail("the signal did not stop the run")
    assert ei.value.code == 128 + signal.SIGTERM
    assert_untouched()
    assert restore_files() == []
    assert signal.getsignal(signal.SIGTERM) is prev


def test_signal_during_a_set_waits_until_the_set_is_complete(originals):
    calls = []

    class SignalMidSet(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)
            calls.append((h.index, mw))
            if (h.index, mw) == (0, 200000):
                signal.raise_signal(signal.SIGHUP)  # between GPU 0 and GPU 1

    with pytest.raises(SystemExit) as ei:
        with door_controller(SignalMidSet(sim()), [0, 1]) as ctl:
            ctl.set_power_limit_w(200)
            pytest.fail("the deferred signal was lost")
    assert ei.value.code == 128 + signal.SIGHUP
    # Both GPUs took the level (the set was not cut in half), then both were put back.
    assert calls[2:] == [(0, 200000), (1, 200000), (0, 280000), (1, 300000)]
    assert_untouched()
    assert restore_files() == []


def test_a_second_ctrl_c_during_the_handlers_restore_does_not_restore_inside_it(originals):
    # Two Ctrl-Cs within ~10 ms: the second arrived while the first's handler was putting the GPUs back.
    # It restored again inside that restore (NVML re-entered from a signal handler: a sweep hung on the
    # simulator's lock, and real GPUs gave a traceback). Now it waits, and the first's exit is the one raised.
    depth, calls, fired = [0], [], []

    class SecondCtrlCMidRestore(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            depth[0] += 1
            try:
                calls.append((h.index, mw, depth[0]))
                if mw == int(ORIGINAL_W[h.index] * 1000) and len(calls) > 3 and not fired:
                    fired.append(True)
                    signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, in the middle of the restore
                self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)
            finally:
                depth[0] -= 1

    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with door_controller(SecondCtrlCMidRestore(sim()), [0, 1]) as ctl:
                ctl.set_power_limit_w(200)
                signal.raise_signal(signal.SIGINT)
                pytest.fail("the first Ctrl-C did not stop the run")
    finally:
        signal.signal(signal.SIGINT, prev)
    assert fired
    assert max(d for _, _, d in calls) == 1, calls  # never a set inside a set
    assert calls[-2:] == [(0, 280000, 1), (1, 300000, 1)]
    assert_untouched()
    assert restore_files() == []


def test_a_repeat_signal_while_the_exit_unwinds_does_not_cut_the_cleanup_short(originals):
    # The sweep writes its finished levels while the first Ctrl-C's exit unwinds; a second Ctrl-C there
    # raised another KeyboardInterrupt in the middle of that write (and past it, a traceback).
    cleaned = []
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with door_controller(sim(), [0, 1]) as ctl:
                ctl.set_power_limit_w(200)
                try:
                    signal.raise_signal(signal.SIGINT)
                finally:
                    assert_untouched()  # the first one already put the GPUs back
                    signal.raise_signal(signal.SIGINT)  # the second, during the cleanup
                    signal.raise_signal(signal.SIGTERM)  # and a kill meant to hurry it along
                    cleaned.append(True)
    finally:
        signal.signal(signal.SIGINT, prev)
    assert cleaned == [True]
    assert_untouched()
    assert restore_files() == []
    # The next run of a controller in this process acts on its signals again.
    with pytest.raises(SystemExit) as ei:
        with door_controller(sim(), [0]) as ctl:
            ctl.set_power_limit_w(200)
            signal.raise_signal(signal.SIGTERM)
    assert ei.value.code == 128 + signal.SIGTERM
    assert_untouched()


def test_an_ignored_signal_stays_ignored(originals):
    prev = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with door_controller(sim(), [0]) as ctl:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == ctl._on_signal
    finally:
        signal.signal(signal.SIGHUP, prev)


def test_clocks_are_released_even_when_the_limit_cannot_be_put_back(originals):
    class StuckLimit(Wrap):
        block = False

        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            if self.block:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)

    nvml = StuckLimit(sim())
    ctl = door_controller(nvml, [0, 1])
    ctl.open()
    ctl.set_power_limit_w(200)
    ctl.lock_sm_clock_mhz(1500)
    nvml.block = True
    with pytest.raises(ControlError, match="Could not put every GPU back") as ei:
        ctl.close()
    assert "powerprof restore --restore-file" in str(ei.value)
    assert sim_state() == [(200.0, None)] * 2  # clocks released although the limits are stuck
    assert len(restore_files()) == 1  # kept for `powerprof restore`
    assert door_restore().ok
    assert_untouched()


def test_restore_command_exit_codes(originals):
    from click.testing import CliRunner

    from powerprof.cli import main as cli

    r = CliRunner().invoke(cli, ["restore"])
    assert r.exit_code == 0 and "Nothing to restore" in r.output
    with door_controller(sim(), [0, 1]) as ctl:
        ctl.set_power_limit_w(200)
        r = CliRunner().invoke(cli, ["restore", "--simulate"])
        assert r.exit_code == 1 and f"controlled by powerprof process {os.getpid()}" in r.output
    r = CliRunner().invoke(cli, ["restore", "--restore-file", "/nonexistent/restore-x.json"])
    assert r.exit_code == 1 and "/nonexistent/restore-x.json does not exist" in r.output
    path = _leave_pending_record()
    r = CliRunner().invoke(cli, ["restore", "--restore-file", str(path)])
    assert r.exit_code == 0 and "GPU 0" in r.output and "was 190 W, set to 280 W" in r.output and "clock lock released" in r.output
    assert_untouched()


def test_restore_of_a_named_file_that_does_not_exist_fails(tmp_path):
    # A mistyped --restore-file must not report "nothing to restore" and exit 0: the GPU may still be changed.
    missing = tmp_path / "restore-typo.json"
    r = subprocess.run(
        [sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "--restore-file", str(missing)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{missing} does not exist" in r.stderr
    assert "Nothing to restore" not in r.stdout + r.stderr


def _edit_record(path, edit):
    rec = json.loads(path.read_text())
    edit(rec, rec["gpus"][min(rec["gpus"], key=lambda u: rec["gpus"][u]["index"])])  # GPU 0's entry
    path.write_text(json.dumps(rec))  # NaN and Infinity as Python's json writes them
    return path


@pytest.mark.parametrize("key, value, said", [
    ("original_limit_mw", True, '"original_limit_mw" is true'),  # bool is an int to Python: it read as a 1 mW limit
    ("original_limit_mw", False, '"original_limit_mw" is false'),
    ("original_limit_mw", -280000, '"original_limit_mw" is -280000'),
    ("original_limit_mw", 0, '"original_limit_mw" is 0'),
    ("original_limit_mw", float("nan"), '"original_limit_mw" is NaN'),
    ("original_limit_mw", float("inf"), '"original_limit_mw" is Infinity'),
    ("original_limit_mw", 280000.0, '"original_limit_mw" is 280000.0'),
    ("original_limit_mw", "280000", '"original_limit_mw" is "280000"'),
    ("original_limit_mw", 2**32 + 280000, f'"original_limit_mw" is {2**32 + 280000}'),  # pynvml's uint would wrap it
    ("default_limit_mw", True, '"default_limit_mw" is true'),
    ("index", True, '"index" is true'),
    ("index", -1, '"index" is -1'),
    ("clocks_locked", "no", '"clocks_locked" is "no"'),
])
def test_restore_refuses_a_record_with_a_bool_nan_negative_or_absurd_field_and_changes_nothing(originals, key, value, said):
    # `"original_limit_mw": true` passed `isinstance(x, int)`: restore asked for a 1 mW limit on GPU 0, released its
    # clock lock, and put GPU 1 back, all from a record it should not have believed.
    path = _edit_record(_leave_pending_record(), lambda rec, g: g.__setitem__(key, value))
    left = sim_state()
    from click.testing import CliRunner

    from powerprof.cli import main as cli

    r = CliRunner().invoke(cli, ["restore", "--restore-file", str(path)])
    assert r.exit_code == 1, r.output
    assert said in r.output and "force-default" in r.output and "correct the file" in r.output, r.output
    assert sim_state() == left == [(190.0, (1500, 1500))] * 2  # no GPU touched, not even the one whose entry is fine
    assert path.exists()
    with pytest.raises(PendingRestoreError, match="force-default"):  # and it blocks new runs as a damaged file does
        door_controller(sim(), [1]).open()


@pytest.mark.parametrize("key, value", [("format", True), ("format", 1.0), ("pid", True), ("pid", 0)])
def test_restore_refuses_a_record_whose_format_or_pid_is_not_a_whole_number(originals, key, value):
    path = _leave_pending_record()
    rec = json.loads(path.read_text())
    rec[key] = value
    path.write_text(json.dumps(rec))
    report = door_restore(path)
    assert [o.status for o in report.outcomes] == ["damaged"], report.lines()
    assert sim_state() == [(190.0, (1500, 1500))] * 2 and path.exists()


def test_restore_checks_every_gpus_range_before_setting_any(originals):
    # 50 W is a whole number of milliwatts but below what the GPU accepts: NVML refused GPU 0's set after the
    # record had already been applied to GPU 1 (and GPU 0's clock released), leaving the pair half restored.
    path = _edit_record(_leave_pending_record(), lambda rec, g: g.__setitem__("original_limit_mw", 50_000))
    report = door_restore(path)
    assert [o.status for o in report.outcomes] == ["damaged"], report.lines()
    text = "\n".join(report.lines())
    assert "nothing was changed" in text and "50 W" in text and "force-default" in text, text
    assert sim_state() == [(190.0, (1500, 1500))] * 2 and path.exists()
    # The operator's way out still works on it: every GPU it names to its default, the file gone.
    from powerprof.rig import Rig

    with Rig("seed-16g", sim_gpu_count=2) as rig:
        out = rig.force_default(door_restore(path))
    assert out.ok, out.lines()
    assert not path.exists() and all(c is None for _, c in sim_state())


@pytest.mark.parametrize("origin", [{"profile": "seed-16g", "count": True}, {"profile": "seed-16g", "count": 10**9},
                                    {"profile": "seed-16g", "count": -1}, {"profile": 7, "count": 2}])
def test_restore_refuses_a_simulator_origin_it_cannot_reopen_as_written(originals, origin):
    # count true read as 1 GPU (GPU 1's record then "not present"); 10**9 made a billion simulated GPUs.
    path = _leave_pending_record()
    rec = json.loads(path.read_text())
    rec["simulated"] = origin
    path.write_text(json.dumps(rec))
    report = door_restore(path)
    assert [o.status for o in report.outcomes] == ["refused"], report.lines()
    assert '"simulated"' in report.lines()[0]
    assert sim_state() == [(190.0, (1500, 1500))] * 2 and path.exists()


@pytest.mark.parametrize("text", ["0", "\u00b2", "-5", "1e3", "99999999999"])
def test_a_lock_files_pid_is_a_positive_ascii_number_or_unknown(tmp_path, text):
    # "²".isdigit() is true and int() raised on it; "0" made the busy message say `kill 0` (the reader's whole group).
    from powerprof.control.gpulock import read_holder_pid

    p = tmp_path / "x.lock"
    p.write_text(text + "\n")
    assert read_holder_pid(p) is None
    p.write_text("4242\n")
    assert read_holder_pid(p) == 4242


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is root's: as another user the folder is that user's own")
def test_root_refuses_a_state_folder_others_can_write_and_never_follows_a_planted_lock_symlink(tmp_path, originals):
    # POWERPROF_STATE_DIR in a folder anyone can write: another user could plant the restore file (limits root
    # would set) or a symlink named as a lock file (truncated and written by root): refused before any change.
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = shared / "state"
    with pytest.raises(ControlError, match="refusing to keep GPU locks.*writable|POWERPROF_STATE_DIR"):
        door_controller(sim(), [0, 1], state_dir_path=state).open()
    assert not state.exists() and victim.read_text() == "precious\n"
    assert_untouched()

    # A lock file replaced by a symlink in root's own folder (say, by an earlier bug): not followed.
    from powerprof.control.gpulock import GpuLock, lock_path

    own = tmp_path / "own"
    lock = lock_path(own, "GPU-x")
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    with pytest.raises(ControlError) as ei:
        GpuLock(own, "GPU-x").acquire()
    assert victim.read_text() == "precious\n"
    # Said, with the fix: it was a bare `[Errno 40] Too many levels of symbolic links: …lock` (session 47's review).
    assert f"cannot write the lock of GPU GPU-x {lock}: it is a symlink" in str(ei.value), str(ei.value)
    assert f"remove it (`rm {lock}`)" in str(ei.value) and "Nothing was changed on any GPU" in str(ei.value)


def test_a_full_state_folder_is_said_with_the_fix_and_changes_nothing(originals, monkeypatch):
    # Session 47's review: `tune` died with a traceback from gpulock's os.pwrite (ENOSPC); `sweep` said a bare
    # `Error: [Errno 28] No space left on device`. Both for the lock and for the restore file.
    import errno

    import powerprof.control.controller as controller_mod
    import powerprof.control.gpulock as gpulock_mod

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(gpulock_mod.os, "pwrite", full)
        with pytest.raises(ControlError) as ei:
            door_controller(sim(), [0, 1]).open()
    msg = str(ei.value)
    assert "cannot write the lock of GPU 0" in msg and "No space left on device: free space in" in msg, msg
    assert "POWERPROF_STATE_DIR" in msg and "Nothing was changed on any GPU" in msg, msg
    monkeypatch.setattr(controller_mod, "write_json_atomic", full)
    with door_controller(sim(), [0, 1]) as ctl, pytest.raises(ControlError) as ei:
        ctl.set_power_limit_w(200)
    msg = str(ei.value)
    assert msg.startswith("cannot write the restore file ") and "No space left on device: free space in" in msg, msg
    assert_untouched()
    assert restore_files() == []
    with door_controller(sim(), [0, 1]):  # and no lock is left held
        pass


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is root's: as another user the folder is that user's own")
def test_root_refuses_a_restore_path_restore_would_not_trust_before_any_change(tmp_path, originals):
    # Before: the state folder was checked, a restore_path given to the controller was not. Root wrote its record in
    # another user's folder and capped the GPU; after a kill -9 `powerprof restore` (rightly) refused that file as
    # untrusted, so the GPU stayed capped, and that user could have replaced the record with limits of their own.
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ControlError, match=f"restore file {theirs}/r.json.*owned by uid 65534"):
        with door_controller(sim(), [0, 1], restore_path=theirs / "r.json") as ctl:
            ctl.set_power_limit_w(190)
            assert door_restore(theirs / "r.json").outcomes[0].status == "restored"  # never reached after the fix
    assert not (theirs / "r.json").exists()
    assert_untouched()


def test_nvidia_smi_fallback_names_the_gpu_by_uuid_not_by_an_index_that_may_have_moved(originals):
    # After a driver reload or a reset the indexes may come back in another order: nvidia-smi's
    # index 0 is then the GPU NVML knew as 1. The fallback must name the GPU it means by UUID.
    class NoSetter(Wrap):
        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    inner = sim()
    swapped = {"0": 1, "1": 0}  # nvidia-smi's indexes since the reload

    def fake_smi(args):
        assert args[0] == "-i" and args[2] == "-pl"
        target = args[1]
        h = (inner.nvmlDeviceGetHandleByUUID(target) if target.startswith("GPU-")
             else inner.nvmlDeviceGetHandleByIndex(swapped[target]))
        inner.nvmlDeviceSetPowerManagementLimit(h, int(float(args[3]) * 1000))

    with door_controller(NoSetter(inner), [0], nvidia_smi=fake_smi) as ctl:
        rb = ctl.set_power_limit_w(220)
        assert rb.gpus[0].limit_w == 220.0
        assert sim_state() == [(220.0, None), (ORIGINAL_W[1], None)]  # GPU 1 was not touched
    assert_untouched()


def test_restore_says_each_gpus_limit_before_and_what_it_was_set_to(originals, capsys):
    # A killed run left both GPUs at 190 W; the operator must see 190 W → 280/300 W per GPU, not only the end state.
    _leave_pending_record()
    report = door_restore()
    assert report.ok, report.lines()
    lines = report.lines()
    for i, orig in enumerate(ORIGINAL_W):
        (line,) = [x for x in lines if x.strip().startswith(f"GPU {i} ")]
        assert "was 190 W" in line and f"set to {orig:g} W" in line, line
    d = report.to_dict()["files"][0]["gpus"]
    assert [g["before_limit_w"] for g in d] == [190.0, 190.0]
    assert [g["limit_w"] for g in d] == list(ORIGINAL_W)
    assert_untouched()


def test_a_mixed_hosts_record_reopens_the_same_cards_and_restore_puts_the_l4_back(originals, capsys):
    from powerprof.cli import main as cli
    from powerprof.rig import Rig

    mixed = "h200-141g,l4-24g"
    with Rig(mixed).controller([1]) as ctl:
        ctl.set_power_limit_w(50)
        path, saved = ctl.restore_path, ctl.restore_path.read_bytes()
    assert json.loads(saved)["simulated"] == {"profile": mixed, "count": 2,
                                              "state_file": os.path.realpath(os.environ["POWERPROF_SIM_STATE"])}
    n = SimNVML(mixed)
    n.nvmlInit()
    n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(1), 50_000)  # what a kill -9 leaves
    path.write_bytes(saved)
    report = door_restore()
    assert report.ok, report.lines()
    assert any("GPU 1 " in x and "was 50 W, set to 72 W" in x for x in report.lines()), report.lines()
    fresh = SimNVML(mixed)
    fresh.nvmlInit()
    assert fresh.nvmlDeviceGetPowerManagementLimit(fresh.nvmlDeviceGetHandleByIndex(1)) == 72_000
    # A level no card of the pair shares is refused before anything changes, naming the way on.
    from click.testing import CliRunner

    r = CliRunner().invoke(cli, ["sweep", "--simulate", mixed, "--limits", "180", "--dry-run"])
    assert r.exit_code == 2 and "--gpus 0 (Simulated NVIDIA H200) or --gpus 1 (Simulated NVIDIA L4)" in r.output
    r = CliRunner().invoke(cli, ["devices", "--simulate", "h200-141g,l5"])
    assert r.exit_code == 2 and "'l5': not a simulated GPU profile" in r.output


def test_clock_levels_are_checked_against_the_supported_clocks_nvml_lists(originals):
    """`--clocks 1500,1505` on the simulated card (15 MHz steps): the simulated driver runs both locks at 1500 MHz, so
    they are one setting. The controller reads the supported clocks through the NVML gateway and refuses the pair,
    naming both and the clock; nothing is locked. A range whose ends share a clock is still a range."""
    from powerprof.sim.gpu import Phase

    truth = SimNVML("seed-16g", state_path=None)
    truth.nvmlInit()
    gpu = truth.gpus[0]
    gpu.set_phase(Phase("decode", 0.5))
    ran = {}
    for mhz in (1500, 1505, 1514, 1515):
        gpu.set_locked_clocks((mhz, mhz))
        ran[mhz] = truth.nvmlDeviceGetClockInfo(truth.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_CLOCK_SM)
    assert ran == {1500: 1500, 1505: 1500, 1514: 1500, 1515: 1515}, ran  # what the refusal below relies on
    with door_controller(sim(), [0, 1]) as ctl:
        assert ctl.devices[0].clock_supported_mhz[:2] == (510, 525) and len(ctl.devices[0].clock_supported_mhz) == 153
        with pytest.raises(LevelError) as ei:
            ctl.parse_clock_levels("1500,1505")
        assert ("'1505' (1505 MHz) and '1500' (1500 MHz) both run at 1500 MHz on GPU 0 (" in str(ei.value)
                and "Nothing was changed" in str(ei.value)), str(ei.value)
        assert [c for _, c in sim_state()] == [None, None]
        assert ctl.parse_clock_levels("1500,1515") == [1500, 1515]
        ctl.lock_sm_clock_mhz(1500, 1505)
        assert [c for _, c in sim_state()] == [(1500, 1505)] * 2
    assert_untouched()


def test_a_restore_file_that_cannot_be_removed_says_the_gpus_are_back_and_what_to_do(originals, monkeypatch):
    # Session 47's review (chattr +i): the GPUs were back, but the sweep ended `Error: [Errno 1] Operation not
    # permitted: '…/restore-….json'`, and the file left blocked later runs unexplained.
    import powerprof.control.controller as controller_mod

    def immutable(path):
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(controller_mod, "remove_file", immutable)
    ctl = door_controller(sim(), [0, 1])
    ctl.open()
    ctl.set_power_limit_w(200)
    path = ctl.restore_path
    with pytest.raises(ControlError) as ei:
        ctl.close()
    msg = str(ei.value)
    assert msg.startswith("every GPU is back at its original limit; the restore file ") and str(path) in msg, msg
    assert "could not be removed (Operation not permitted)" in msg and "powerprof restore" in msg, msg
    assert "\n" not in msg
    assert_untouched()


def test_an_unexpected_error_restoring_one_gpu_still_restores_the_others_and_keeps_the_file(originals):
    # An OSError from the simulator's state write while restoring GPU 0 ended the restore there: GPU 1 stayed capped
    # and the message was the errno alone (only ControlError was caught).
    class FullDisk(Wrap):
        block = False

        def nvmlDeviceSetPowerManagementLimit(self, h, mw):
            if self.block and h.index == 0:
                raise OSError(28, "No space left on device")
            return self.inner.nvmlDeviceSetPowerManagementLimit(h, mw)

    nvml = FullDisk(sim())
    ctl = door_controller(nvml, [0, 1])
    ctl.open()
    ctl.set_power_limit_w(200)
    nvml.block = True
    with pytest.raises(ControlError, match="Could not put every GPU back") as ei:
        ctl.close()
    msg = str(ei.value)
    assert "GPU 0" in msg and "No space left on device" in msg, msg
    assert f"Restore file kept: run `powerprof restore --restore-file {ctl.restore_path}`" in msg, msg
    assert sim_state()[1] == (ORIGINAL_W[1], None)  # the other GPU is back
    assert len(restore_files()) == 1
    assert door_restore().ok
    assert_untouched()


def test_restore_simulate_under_another_sim_state_refuses_and_keeps_the_record(originals, tmp_path, monkeypatch):
    # Session 47's review: `powerprof restore --simulate` with another POWERPROF_SIM_STATE (or under sudo, which drops
    # it) "restored" a fresh simulator's GPUs (simulated UUIDs are the same in every state file), said "Restored",
    # deleted the record, and the capped simulated GPU kept 190 W with nothing left to restore it.
    path = _leave_pending_record()
    recorded = os.path.realpath(os.environ["POWERPROF_SIM_STATE"])
    other = tmp_path / "other-sim.json"
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(other))
    for report in (door_restore(sim_profile="seed-16g"), door_restore()):  # --simulate, and the daemon's plain restore
        assert [o.status for o in report.outcomes] == ["refused"], report.lines()
        line = " ".join(report.lines())
        assert f"state file {recorded}" in line and f"POWERPROF_SIM_STATE={recorded} powerprof restore --simulate" in line
        assert not report.ok and path.exists()
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, POWERPROF_SIM_STATE=str(other)))
    assert r.returncode != 0 and recorded in r.stdout + r.stderr and path.exists(), r.stdout + r.stderr
    monkeypatch.setenv("POWERPROF_SIM_STATE", recorded)
    assert sim_state() == [(190.0, (1500, 1500))] * 2  # still capped: nothing was "restored" elsewhere
    assert json.loads(path.read_text())["simulated"]["state_file"] == recorded
    # A record whose state file is gone: refused the same, saying so.
    rec = json.loads(path.read_text())
    rec["simulated"]["state_file"] = str(tmp_path / "gone.json")
    path.write_text(json.dumps(rec))
    report = door_restore(sim_profile="seed-16g")
    assert [o.status for o in report.outcomes] == ["refused"] and "no longer exists" in report.lines()[0]
    rec["simulated"]["state_file"] = recorded
    path.write_text(json.dumps(rec))
    assert door_restore(sim_profile="seed-16g").ok  # pointed at its own state file, it is restored
    assert_untouched()
    assert not path.exists()


def test_restore_that_puts_every_gpu_back_but_cannot_remove_the_file_says_both(originals, monkeypatch):
    # It said "Not restored; … is kept: PermissionError: …" with every GPU back (an immutable file, a read-only mount).
    import powerprof.control.restore as restore_mod

    path = _leave_pending_record()

    def immutable(p):
        raise PermissionError(1, "Operation not permitted", str(p))

    monkeypatch.setattr(restore_mod, "remove_file", immutable)
    report = door_restore(path)
    assert not report.ok and [o.status for o in report.outcomes] == ["failed"]
    line = report.lines()[0]
    assert "every GPU is back at its original limit" in line and "could not be removed (Operation not permitted)" in line
    assert "Not restored" not in line, line
    assert_untouched()


def test_root_keeps_a_socket_whose_holder_only_its_peer_credentials_named():
    # Where /proc is partial, the holder comes from the peer credentials, with no thread (tid None): keeping its
    # socket raised TypeError (pidfd_open(None)) instead of keeping it or leaving it to the next change.
    import socket  # noqa: PLC0415

    from powerprof.control.gpulock import _bound_sockets, _take_socket  # noqa: PLC0415

    name = b"\0powerprof-test-keep-" + os.urandom(8).hex().encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(name)
        kept = _take_socket(name, [(os.getpid(), os.getuid(), None)], _bound_sockets(name))
        assert kept is not None and os.fstat(kept.fileno()).st_ino == os.fstat(s.fileno()).st_ino
    with kept, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(name)  # still bound, and listening now, through the kept descriptor alone


def test_keeping_a_socket_the_squatter_swapped_for_another_file_never_raises(tmp_path, monkeypatch):
    # A squatter may swap the descriptor found holding its socket for another file between root's scan and its
    # pidfd_getfd: root's copy is then no socket. socket.socket(fileno=) raised outside the try (OSError ENOTSOCK) and
    # leaked the copy: root's `restore` failed and left the GPU capped (200 W) in 5 runs of 20 (h-rev7 r7). Now None
    # (not kept, as documented), and the copy closed.
    import socket  # noqa: PLC0415

    from powerprof.control import gpulock  # noqa: PLC0415

    name = b"\0powerprof-test-swap-" + os.urandom(8).hex().encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, open(tmp_path / "other", "w") as other:
        s.bind(name)
        bound = gpulock._bound_sockets(name)
        want = next(iter(bound))
        swapped = str(other.fileno())
        monkeypatch.setattr(gpulock, "_readlink", lambda p: want if p.endswith(f"/fd/{swapped}") else None)
        before = sorted(os.listdir("/proc/self/fd"))
        assert gpulock._take_socket(name, [(os.getpid(), os.getuid(), None)], bound) is None
        monkeypatch.undo()
        assert sorted(os.listdir("/proc/self/fd")) == before, "the copied descriptor was leaked"


def test_keeping_a_listening_squatters_socket_leaves_its_peer_credentials_its_own():
    # listen() on a socket already listening sets its peer credentials to the caller's: root keeping a listening
    # squatter's socket made every later connect name root's own process (finished by then) instead of the squatter
    # (h-rev7 r2 "listening"). Now only a socket not listening is made to listen.
    import socket  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from powerprof.control.gpulock import _bound_sockets, _holder, _take_socket  # noqa: PLC0415

    name = b"\0powerprof-test-peercred-" + os.urandom(8).hex().encode()
    code = ("import socket,sys,time\ns=socket.socket(socket.AF_UNIX)\ns.bind(bytes.fromhex(sys.argv[1]))\ns.listen(8)\n"
            "print('UP',flush=True)\ntime.sleep(30)\n")
    child = subprocess.Popen([sys.executable, "-c", code, name.hex()], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "UP"
        kept = _take_socket(name, [(child.pid, os.getuid(), None)], _bound_sockets(name))
        if kept is None:
            pytest.skip("pidfd_getfd of a child is not allowed here")
        with kept:
            assert _holder(name)[0] == child.pid
    finally:
        child.kill()
        child.wait()
