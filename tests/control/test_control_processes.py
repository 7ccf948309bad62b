"""The restore guarantee across processes: signals, exceptions and SIGKILL, checked through the simulator's state file."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import shutil
import signal
import socket
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


_OPENING = ("import sys,time;from powerprof.control.gpulock import GpuLock;from powerprof.paths import state_dir;"
            "lock=GpuLock(state_dir(),sys.argv[1]);lock.acquire();print('HELD',flush=True);time.sleep(float(sys.argv[2]));"
            "lock.release()")


def _killed_at_200_w() -> str:
    """A sweep child killed mid-run: both GPUs left at 200 W, root's restore file recording the originals (asserted).
    GPU 0's uuid."""
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    _wait_for_line(p, "STEPPED")
    p.kill()
    p.wait(timeout=WAIT_S)
    assert sim_state() == [(200.0, None)] * 2 and len(restore_files()) == 1
    return SimNVML("seed-16g", count=2).gpus[0].uuid


def test_restore_waits_for_a_lock_held_while_the_restore_files_writer_is_gone(originals):
    # A controller opening beside a crashed run's restore file holds the GPU's locks for a while (its squatted names'
    # /proc scans: 1.4-7.6 s), then refuses on that file. `restore` started meanwhile refused ("already being
    # controlled"), and the GPU stayed capped. The file's writer gone, no holder can be a controller running on it:
    # `restore` waits for the lock (RESTORE_BUSY_WAIT_S) and puts the GPU back. Its writer alive, it still refuses at once.
    uuid = _killed_at_200_w()
    opening = subprocess.Popen([sys.executable, "-c", _OPENING, uuid, "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert _wait_for_line(opening, "HELD")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                           capture_output=True, text=True, timeout=WAIT_S)
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 0, said
        assert time.monotonic() - t0 < WAIT_S / 2, said
    finally:
        opening.kill()
        opening.wait(timeout=WAIT_S)
    assert_untouched()
    assert restore_files() == []
    with _holding_both_gpus_at_200():  # its writer alive: refused at once, as before
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                           capture_output=True, text=True, timeout=WAIT_S)
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode != 0 and "already being controlled" in said, said
        assert time.monotonic() - t0 < 5, said


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


# A process of another uid binding a GPU's machine-wide lock name first: an abstract socket has no permissions, and the
# name is public (the scope, "nvml" on real hardware, and the GPU's UUID in the daemon's /metrics). It kept root's
# `restore` from putting a capped GPU back ("controlled by powerprof process N (uid 1001)", exit 1) and refused every sweep.
@contextlib.contextmanager
def _squatter(uuid: str, how: str = "listening", every_name: bool = False, extra_fds: int = 0):
    """A process of uid 65534 (nobody: neither root nor CAP_SYS_ADMIN, no write in the simulator's folder) holding GPU
    `uuid`'s machine-wide lock name of this test's simulator, its PID yielded. `how`: "listening"; "bound-only" (no
    connect names it); "orphaned" (the process that listened has exited, a child of it holds the socket: the peer
    credentials name a PID that is gone); "userns" (listening from a user namespace of its own, as `unshare -U -r`:
    every capability in its CapEff, none outside it); "in-flight" (bound, its only descriptor parked in an SCM_RIGHTS
    message: no /proc/*/fd shows it, no connect answers); "flapping" (bound and closed in a loop); "zombie-leader"
    (listening from a thread whose thread-group leader has exited: /proc/<pid>/fd of the leader lists nothing, and the
    thread is in no /proc/<pid>; its queue full, as below, so no connect names it); "full-queue" (listening with a backlog of 0, its queue filled, its only descriptor
    parked in an SCM_RIGHTS message: a connect finds the queue full, EAGAIN, neither answered nor refused);
    "parked-listening" (listening, its queue not full, its only descriptor parked in an SCM_RIGHTS message a child
    keeps, the process that listened exited: a connect is answered and its peer credentials name a PID that is gone);
    "listening-full" (listening with a backlog of 0, its queue filled, holding its socket: no connect names it).
    `every_name`: the simulated GPU's second name (its folder's identity) held too, listening where "listening", parked
    with the first where that is, bound otherwise (a real GPU has one name: "nvml"). `extra_fds`: that many more
    descriptors (a pipe's end, dup'd) in the squatter's own table."""
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415
    from powerprof.rig import Rig  # noqa: PLC0415

    with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2)) as rig:
        name, *others = MachineLock(rig.machine_scope, uuid).names
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drops to nobody, holds the name, never returns into pytest
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            if how == "userns":
                import ctypes  # noqa: PLC0415

                if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
                    os._exit(3)
            if extra_fds:
                _pr, pw = os.pipe()
                padding = [os.dup(pw) for _ in range(extra_fds)]  # noqa: F841 (held open until the child exits)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(name)
            extra = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in (others if every_name else ())]
            for e, n in zip(extra, others):
                e.bind(n)
                if how == "listening":
                    e.listen(1)
            if how == "flapping":
                os.write(w, f"BOUND {os.getpid()}\n".encode())
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    s.close()
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    with contextlib.suppress(OSError):
                        s.bind(name)
                    time.sleep(0.0005)
            def listen_full():  # backlog 0, filled: every later connect finds the queue full (EAGAIN)
                s.listen(0)
                waiting = []
                with contextlib.suppress(BlockingIOError):
                    for _ in range(8):
                        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        waiting.append(c)
                        c.setblocking(False)
                        c.connect(name)
                for c in waiting:
                    c.close()  # their connections stay queued, never accepted

            if how == "zombie-leader":
                import ctypes  # noqa: PLC0415

                def hold():
                    listen_full()
                    os.write(w, f"BOUND {os.getpid()}\n".encode())
                    time.sleep(60)
                    os._exit(0)

                threading.Thread(target=hold, daemon=True).start()
                ctypes.CDLL(None).syscall(60, 0)  # SYS_exit (x86_64): the leader thread alone exits, a zombie
            if how in ("full-queue", "listening-full"):
                listen_full()
            if how == "parked-listening":
                s.listen(16)
            if how in ("in-flight", "full-queue", "parked-listening"):
                a, b = socket.socketpair()
                socket.send_fds(a, [b"x"], [s.fileno()] + [e.fileno() for e in extra])
                for e in [s] + extra:
                    e.close()
            elif how not in ("bound-only", "zombie-leader", "listening-full"):
                s.listen(1)
            if how in ("orphaned", "parked-listening") and os.fork() != 0:
                os._exit(0)
            os.write(w, f"BOUND {os.getpid()}\n".encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    holder = None
    try:
        with os.fdopen(r, "rb") as f:
            said = f.readline().split()
        assert said[:1] == [b"BOUND"], "the squatter could not bind the name"
        holder = int(said[1])
        if holder != pid:
            os.waitpid(pid, 0)  # reaped: no zombie left whose /proc entry still says who it was
        yield holder
    finally:
        for victim in {pid, holder} - {None}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a holder of another uid needs root to start it (setuid)")


@needs_root
@pytest.mark.parametrize("how", ["listening", "bound-only", "orphaned", "userns", "zombie-leader"])
def test_root_restores_a_gpu_whose_machine_wide_name_another_user_squats(originals, how):
    uuid = _killed_at_200_w()
    with _squatter(uuid, how) as squat:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                           capture_output=True, text=True, timeout=WAIT_S)
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 0, said
        assert_untouched()
        assert restore_files() == []
        assert f"process {squat} (uid 65534)" in said and "passed over" in said, said  # said out loud
        # A sweep's controller takes the GPU too (and puts it back).
        with LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope()) as ctl:
            ctl.set_power_limit_w(220)
        assert_untouched()


@needs_root
@pytest.mark.parametrize("how", ["in-flight", "flapping", "full-queue", "parked-listening"])
def test_root_restores_a_gpu_whose_machine_wide_name_is_held_by_no_listening_process(originals, how):
    # A name no process shows in /proc/*/fd and no connect answers (parked in an SCM_RIGHTS message, or bound and
    # closed in a loop) was taken for a controller's: restore refused, saying "kill PID" of no one; a flapping squatter
    # won every time. Every controller listens right after its bind, so a name refused a few times over is none's. A
    # parked one whose queue is full (EAGAIN: neither answered nor refused) still kept restore off the GPU; every
    # controller holds its socket open, so one no thread in /proc holds, /proc showing root every process, is none's.
    # Parked listening, its queue not full, its listener exited: the connect was answered, the peer credentials named
    # the dead listener, and root refused ("kill N", N gone; exit 1), the GPU left capped.
    uuid = _killed_at_200_w()
    with _squatter(uuid, how):
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                           capture_output=True, text=True, timeout=WAIT_S)
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 0, said
        if how != "flapping":  # a flapping squatter's name may be caught free (taken) or its descriptor in /proc/*/fd
            assert "no process that holds it open" in said and "passed over" in said, said
        assert_untouched()
        assert restore_files() == []
        for _ in range(5):  # a sweep's controller takes the GPU every time (and puts it back)
            with LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope()) as ctl:
                ctl.set_power_limit_w(220)
            assert_untouched()


def _fill_queue(name: bytes) -> None:
    """As uid 65534, connect to `name` until its listen queue is full (EAGAIN), leaving every connection queued."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            for _ in range(70000):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.setblocking(False)
                try:
                    c.connect(name)
                except BlockingIOError:
                    os._exit(0)
                finally:
                    c.close()
            os._exit(1)
        finally:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0, "the queue never filled"


@needs_root
def test_a_root_controller_whose_queue_another_user_filled_is_never_passed_over(originals, tmp_path):
    # Any user may fill a controller's listen queue (it never accepts): a connect then finds it full, as it finds a
    # parked squatter's. A controller holds its socket open, so /proc names it and it is judged, never passed over.
    from powerprof.control.gpulock import MachineLock, _holder  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    lock = MachineLock(_scope(), uuid)
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200", "--gpus", "0"])
    try:
        _wait_for_line(p, "STEPPED")
        _fill_queue(lock.name)
        assert _holder(lock.name) == (None, None)  # no connect names it now
        with pytest.raises(GpuBusyError) as ei:
            lock._bind(root=True)  # the name alone, past root's own flock
        assert ei.value.holder_pid == p.pid and lock.warning is None
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                           capture_output=True, text=True, timeout=WAIT_S,
                           env=dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state")))
        assert "passed over" not in r.stderr, r.stderr
        assert sim_state()[0] == (200.0, None) and p.poll() is None
    finally:
        p.terminate()
    assert _finish(p)[0] == 128 + signal.SIGTERM
    assert_untouched()


@needs_root
@pytest.mark.parametrize("how", ["full-queue", "parked-listening"])
def test_a_controller_binding_the_name_as_a_parked_squatter_lets_go_is_never_passed_over(originals, how):
    # Root counted a parked squatter's name (its queue full, or answered) on tries 1-4; during the 5th, after its /proc
    # scan and before its connect, the squatter let go and a real controller bound the name (its queue filled by
    # anyone): the connect went as before, and root passed it over: two controllers on one GPU. Forced by wrapping _unanswered.
    from powerprof.control import gpulock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    lock = gpulock.MachineLock(_scope(), uuid)
    real, calls, ctl = gpulock._unanswered, [], []
    code = ("import errno,socket,sys,time\nn=bytes.fromhex(sys.argv[1]);s=socket.socket(socket.AF_UNIX)\n"
            "for _ in range(500):\n try:\n  s.bind(n);break\n except OSError as e:\n  time.sleep(0.01)\n"
            "s.listen(64);print('READY',flush=True);time.sleep(60)")

    def handover(name):
        calls.append(name)
        if len(calls) == 5:
            os.kill(squat, signal.SIGKILL)
            ctl.append(subprocess.Popen([sys.executable, "-c", code, name.hex()], stdout=subprocess.PIPE, text=True))
            _wait_for_line(ctl[0], "READY")
            if how == "full-queue":
                _fill_queue(name)
        return real(name)

    try:
        with _squatter(uuid, how) as squat:
            gpulock._unanswered = handover
            with pytest.raises(GpuBusyError) as ei:
                lock._bind(root=True)  # the name alone, past root's own flock
            assert len(calls) == 5 and lock._sock is None and lock.warning is None
            assert ei.value.holder_pid == ctl[0].pid  # named
    finally:
        gpulock._unanswered = real
        lock.release()
        for p in ctl:
            p.kill()
            p.wait(timeout=WAIT_S)


def test_a_full_queue_no_process_shows_is_passed_over_only_where_proc_shows_every_process(monkeypatch, tmp_path):
    # A listening name whose only descriptor is parked in an SCM_RIGHTS message, its queue full: root passes it over
    # only where its /proc shows every process (a controller in another PID namespace sharing this network, or hidden
    # by hidepid, or an unreadable descriptor table, could be the holder); anywhere else it is refused, as before.
    from powerprof.control import gpulock  # noqa: PLC0415

    lock = gpulock.MachineLock(f"sim:{tmp_path}/sim.json", "GPU-full")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(lock.name)
    s.listen(0)
    with contextlib.suppress(BlockingIOError):
        for _ in range(8):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.setblocking(False)
                c.connect(lock.name)
    a, b = socket.socketpair()
    socket.send_fds(a, [b"x"], [s.fileno()])
    s.close()
    try:
        monkeypatch.setattr(gpulock, "_sees_every_process", lambda: False)
        with pytest.raises(GpuBusyError):
            lock._bind(root=True)
        monkeypatch.setattr(gpulock, "_sees_every_process", lambda: True)
        real = gpulock._holders_from_proc
        monkeypatch.setattr(gpulock, "_holders_from_proc",
                            lambda name, proc="/proc", **k: (real(name, proc, **k)[0], False, real(name, proc, **k)[2]))
        with pytest.raises(GpuBusyError):  # a descriptor table it could not read
            lock._bind(root=True)
        monkeypatch.setattr(gpulock, "_holders_from_proc", real)
        lock._bind(root=True)
        assert lock._sock is None and "no process that holds it open" in lock.warning
    finally:
        a.close()
        b.close()


def test_who_sees_every_process(tmp_path):
    # Root's /proc shows every process only with CAP_SYS_PTRACE, in the first PID namespace, its /proc without hidepid.
    from powerprof.control.gpulock import _sees_every_process  # noqa: PLC0415

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)

    def view(cap, mount="22 27 0:21 / /proc rw,relatime - proc proc rw"):
        (proc / "self" / "status").write_text(f"Uid:\t0\t0\t0\t0\nCapEff:\t{cap:016x}\n")
        (proc / "self" / "mountinfo").write_text(mount + "\n")
        return _sees_every_process(str(proc), pid_ns_ino=0xEFFFFFFC)

    assert view(1 << 19)
    assert not view(1 << 21)  # no CAP_SYS_PTRACE
    assert not view(1 << 19, "22 27 0:21 / /proc rw,relatime - proc proc rw,hidepid=invisible")
    assert view(1 << 19, "22 27 0:21 / /proc rw,relatime - proc proc rw,hidepid=0")
    assert not _sees_every_process(str(proc), pid_ns_ino=0xF0000001)  # a PID namespace below the first


@needs_root
def test_restore_json_carries_the_pass_over_warning_in_its_notes(originals):
    # `restore --json` said the squatter passed over on stderr only: a script reading stdout saw nothing of it.
    import json  # noqa: PLC0415

    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    _wait_for_line(p, "STEPPED")
    p.kill()
    p.wait(timeout=WAIT_S)
    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    with _squatter(uuid) as squat:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g", "--json"],
                           capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    notes = json.loads(r.stdout)["notes"]
    assert any(f"process {squat} (uid 65534)" in n and "passed over" in n for n in notes), notes
    assert_untouched()


@needs_root
def test_root_takes_the_name_once_a_squatter_it_passed_over_lets_go(originals):
    # Root passed over a squatter and never took the name: once the squatter left, a controller not run as root (a
    # CAP_SYS_ADMIN user's, which has only the name) could take the GPU beside root's. Each limit change binds it now.
    # A squatter's socket in no process's table (parked in an SCM_RIGHTS message) cannot be kept (one a process holds
    # is: test_a_squatter_root_passed_over_leaving_lets_no_capsys_admin_controller_in).
    from powerprof.control.gpulock import MachineLock, _holder  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    name = MachineLock(_scope(), uuid).name
    ctl = LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope())
    try:
        with _squatter(uuid, "in-flight"):
            ctl.open()
            ctl.set_power_limit_w(220)
            assert _holder(name) == (None, None)  # bound, no one listening: not root's
        time.sleep(0.2)  # the parked socket goes with the squatter's last descriptor
        ctl.set_power_limit_w(230)
        assert _holder(name) == (os.getpid(), 0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, pytest.raises(OSError):
            s.bind(name)
        ctl.set_power_limit_w(240)  # kept, not bound again
        assert _holder(name) == (os.getpid(), 0)
    finally:
        ctl.close()
    assert_untouched()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(name)  # let go at the close


def _capsys_admin_binder(names) -> subprocess.Popen:
    """A process of uid 65534 with CAP_SYS_ADMIN (capsh: a user who may change power limits, not root) taking `names`
    as a controller not run as root does (`MachineLock.acquire`: bind and listen each name): prints TAKEN or BUSY, then
    holds what it took until killed."""
    code = ("import socket,sys,time\nheld=[]\nfor n in sys.argv[1:]:\n s=socket.socket(socket.AF_UNIX)\n"
            " try:\n  s.bind(bytes.fromhex(n)); s.listen(16); held.append(s)\n"
            " except OSError:\n  print('BUSY',flush=True); time.sleep(60); sys.exit()\n"
            "print('TAKEN',flush=True); time.sleep(60)\n")
    argv = " ".join(n.hex() for n in names)
    return subprocess.Popen([*_CAPSH_ARGV,
                             f"exec /usr/bin/python3 -c \"$0\" {argv}", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


_CAPSH_ARGV = ["capsh", "--caps=cap_sys_admin+eip cap_setuid,cap_setgid,cap_setpcap+ep", "--keep=1", "--user=nobody",
               "--addamb=cap_sys_admin", "--", "-c"]


@functools.lru_cache(maxsize=None)
def _capsh_unusable() -> str | None:
    """Why `_capsys_admin_binder` cannot run here (None: it can), probed once a session with its very capsh command:
    capsh missing, CAP_SYS_ADMIN not in the bounding set (Docker's default), /usr/bin/python3 not runnable by nobody.
    Checking the files alone, those tests failed ("Unable to set capabilities") instead of skipping."""
    if not (Path("/usr/bin/python3").exists() and shutil.which("capsh")):
        return "needs capsh and /usr/bin/python3"
    try:
        p = subprocess.run([*_CAPSH_ARGV, "exec /usr/bin/python3 -c \"print('OK')\""], capture_output=True, text=True,
                           timeout=WAIT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"capsh as nobody with CAP_SYS_ADMIN cannot run here: {e}"
    if p.stdout.strip() != "OK":
        return f"capsh as nobody with CAP_SYS_ADMIN cannot run here: {p.stderr.strip() or p.returncode}"
    return None


def needs_capsh(test):
    """Skip `test` unless capsh can run /usr/bin/python3 as nobody with CAP_SYS_ADMIN (`_capsh_unusable`), probed when
    the test runs (never at collection: only root's tests need it)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        why = _capsh_unusable()
        if why:
            pytest.skip(why)
        return test(*args, **kwargs)
    return run


@needs_root
@needs_capsh
@pytest.mark.parametrize("how", ["listening", "bound-only"])
def test_a_squatter_root_passed_over_leaving_lets_no_capsys_admin_controller_in(originals, how):
    # Root passed over a squatter; the squatter left before root's next limit change. Before, the name was free then:
    # a controller not run as root (uid 65534 with CAP_SYS_ADMIN: may change power limits) took it (TAKEN) and ran
    # beside root, whose next change went ahead. Root now keeps the squatter's socket (pidfd_getfd) from the pass-over
    # on, so the name is never free while root controls the GPU.
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    names = MachineLock(_scope(), uuid).names
    ctl = LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope())
    other = None
    try:
        with _squatter(uuid, how, every_name=True):
            ctl.open()
            ctl.set_power_limit_w(220)
        other = _capsys_admin_binder(names)
        said = _wait_for_line(other, "")
        assert said.strip() == "BUSY", "a CAP_SYS_ADMIN controller took the GPU beside root's"
        ctl.set_power_limit_w(230)
    finally:
        if other is not None:
            other.kill()
            other.communicate(timeout=WAIT_S)
        ctl.close()
    assert_untouched()
    for name in names:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(name)  # let go at the close


@needs_root
@needs_capsh
def test_root_stops_when_a_controller_took_a_parked_squatters_name_before_its_next_change(originals):
    # A squatter's socket parked in an SCM_RIGHTS message cannot be kept: once it went, a CAP_SYS_ADMIN controller not
    # run as root took the name before root's next change, and that change went ahead (reclaim failed silently): two
    # controllers on one GPU. Root now stops before changing anything again (GpuBusyError naming the holder), and its
    # close puts the GPU back.
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    names = MachineLock(_scope(), uuid).names
    ctl = LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope())
    other = None
    try:
        with _squatter(uuid, "in-flight", every_name=True):
            ctl.open()
            ctl.set_power_limit_w(220)
        time.sleep(0.2)  # the parked sockets go with the squatter's last descriptor
        other = _capsys_admin_binder(names)
        assert _wait_for_line(other, "").strip() == "TAKEN"
        with pytest.raises(GpuBusyError) as e:
            ctl.set_power_limit_w(230)
        assert e.value.holder_pid == other.pid and "(uid 65534)" in str(e.value)
        assert sim_state()[0][0] == 220  # not changed again
    finally:
        if other is not None:
            other.kill()
            other.communicate(timeout=WAIT_S)
        ctl.close()
    assert_untouched()


@contextlib.contextmanager
def _a_held_lock_file(path: Path, mode: int = 0o600, holder: str = "root"):
    """An exclusive flock on a file at `path` (made with `mode`), held as a controller holds root's lock file: by this
    process ("root"), or by a child process of uid 65534 ("nobody-owned": the file chowned to it; "inherited": root's
    file, opened by root, its descriptor kept by a child that drops to uid 65534 and only then takes the flock;
    "orphaned": root's file flocked by a root child that exits, leaving the flock to a child of its own that dropped to
    uid 65534: /proc/locks names the exited one). Yields the holder's PID."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    if holder == "root":
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield os.getpid()
        finally:
            os.close(fd)
        return
    if holder == "nobody-owned":
        os.fchown(fd, 65534, 65534)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            if holder == "orphaned":
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fork() != 0:
                    os._exit(0)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(w, f"HELD {os.getpid()}\n".encode())
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    os.close(fd)
    held = None
    try:
        with os.fdopen(r, "rb") as f:
            said = f.readline().split()
        assert said[:1] == [b"HELD"]
        held = int(said[1])
        yield held
    finally:
        for victim in {pid, held} - {None}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _take_the_lock_folder_away(root_dir: Path, how: str, aside: Path) -> None:
    if how == "moved":  # moved aside, not removed: the holder's file is open under another path
        os.rename(root_dir, aside)
    else:
        shutil.rmtree(root_dir)


@needs_root
@pytest.mark.parametrize("squat,how", [(None, "removed"), ("in-flight", "removed"), ("in-flight", "moved")])
def test_root_lock_folder_taken_away_lets_no_second_root_controller_in(originals, tmp_path, squat, how):
    # Root's machine-wide lock folder removed or moved aside while a root controller held its flock: a second root
    # controller took a fresh file of the same name, the flock no exclusion. The names still were, where root held
    # them; a parked squatter's (no process holds it: root cannot keep it) left the flock alone, and the second stepped
    # the GPU to 250 W beside the first's 220 W (exit 0).
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    ctl = LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope())
    with contextlib.ExitStack() as stack:
        if squat:
            stack.enter_context(_squatter(uuid, squat, every_name=True))
        stack.callback(ctl.close)
        ctl.open()
        ctl.set_power_limit_w(220)
        _take_the_lock_folder_away(MachineLock(_scope(), uuid).root_dir, how, tmp_path / "moved-aside")
        second = subprocess.run(child_cmd("--gpus", "0", "--levels", "250"), capture_output=True, text=True,
                                timeout=WAIT_S, env=dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state")))
        said = " ".join(second.stderr.split())
        assert second.returncode == 2, (second.stdout, said)
        assert f"powerprof process {os.getpid()} (uid 0)" in said, said
        if squat:  # the new check named it (not the names): with the fix to say
            assert "removed or moved out of" in said and f"kill {os.getpid()}" in said, said
        assert sim_state()[0][0] == 220
        ctl.set_power_limit_w(230)
    assert_untouched()


@needs_root
@pytest.mark.parametrize("holder,mode", [("nobody-owned", 0o600), ("inherited", 0o600), ("orphaned", 0o600),
                                         ("root", 0o644), ("root", 0o640)], ids=lambda v: f"{v:o}" if isinstance(v, int) else v)
@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_lock_file_no_root_controller_could_hold_refuses_no_controller(originals, tmp_path, holder, mode, how):
    # The reverted scan (6253a2d4) counted any process holding a file of the public name gpu-<digest>.lock: any user
    # made root's controllers and `restore` refuse, and counted a holder that had exited (uid None) as a controller.
    # Only a file root made mode 0600, flocked by a process of root's, counts now: another user's file, root's file a
    # process of another uid holds (its locker exited or not), or a file of another mode, never.
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    lock = MachineLock(_scope(), uuid)
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    with _a_held_lock_file(folder / lock.root_path.name, mode, holder):
        _take_the_lock_folder_away(folder, how, tmp_path / "moved-aside")
        for _ in range(3):
            with LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope()) as ctl:
                ctl.set_power_limit_w(220)
            assert_untouched()


@needs_root
def test_root_restore_is_never_refused_by_a_lock_file_taken_away(originals, tmp_path):
    # `restore` must always put a GPU back: the reverted scan made it refuse (3 runs of 12 left the GPU at 200 W). Here a
    # root process holds the GPU's real lock file moved aside with its folder (the second controller is refused: the
    # check counts it), a nobody process holds one of its own, and a squatter parks both names: restore puts it back.
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    uuid = _killed_at_200_w()
    lock = MachineLock(_scope(), uuid)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    with contextlib.ExitStack() as stack:
        lock.root_path.unlink(missing_ok=True)  # the killed controller's, no longer locked
        stack.enter_context(_a_held_lock_file(lock.root_path))
        stack.enter_context(_a_held_lock_file(theirs / lock.root_path.name, holder="nobody-owned"))
        os.rename(lock.root_dir, tmp_path / "moved-aside")
        (theirs / lock.root_path.name).unlink()
        stack.enter_context(_squatter(uuid, "in-flight", every_name=True))
        second = subprocess.run(child_cmd("--gpus", "0", "--levels", "250"), capture_output=True, text=True,
                                timeout=WAIT_S, env=dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state")))
        assert second.returncode == 2 and f"kill {os.getpid()}" in second.stderr, second.stderr
        for _ in range(3):
            r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                               capture_output=True, text=True, timeout=WAIT_S)
            said = " ".join((r.stdout + r.stderr).split())
            assert r.returncode == 0, said
            assert_untouched()
            assert restore_files() == []


_SETUID_LIKE = ("import os,resource,sys;h=resource.getrlimit(resource.RLIMIT_NOFILE)[1];"
                "resource.setrlimit(resource.RLIMIT_NOFILE,(h,h));"
                "fds=[os.open(os.devnull,os.O_RDONLY) for _ in range(min(h,19100)-100)];"
                "os.setresuid(65534,0,0);print('HELD',len(os.listdir('/proc/self/fd')),flush=True);sys.stdin.read()")


def _acquire_once(m, uuid: str) -> tuple[str, int]:
    """Root's acquire and release of GPU `uuid`'s lock, then `m` (a monkeypatch context holding the caller's spies)
    undone: the lock's warning ("" where none) and how many of its names it held."""
    from powerprof.control import gpulock  # noqa: PLC0415

    lock = gpulock.MachineLock(_scope(), uuid, 0)
    lock.acquire()
    try:
        held = len(lock._socks)
    finally:
        lock.release()
    m.undo()
    return lock.warning or "", held


@needs_root
@pytest.mark.parametrize("how", ["in-flight", "listening"])
def test_a_squatted_names_large_table_of_a_process_that_could_not_control_is_read_once_per_name(originals, monkeypatch,
                                                                                                how):
    # A setuid program another user exec'd over ~19k descriptors of their own (here its stand-in: root's /proc entry,
    # real uid 65534) is no controller. Root's bind of a squatted name read every descriptor on the host up to 6 times
    # per name (5 tries and a last look): a root controller's open of two GPUs took 2.7-7.6 s, and `restore` waited.
    # Such a table decides no refusal: only the first try that names no holder and the last look read it (to name and
    # keep a squatter it holds); a small squatter's is read on every try, so it is still named and its socket kept.
    from powerprof.control import gpulock  # noqa: PLC0415

    many = subprocess.Popen([sys.executable, "-c", _SETUID_LIKE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = many.stdout.readline().split()
        assert line[:1] == ["HELD"], line
        table = int(line[1])
        uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
        with _squatter(uuid, how, every_name=True) as squat, monkeypatch.context() as m:
            read = []
            real_readlink = os.readlink
            mine = f"/proc/{many.pid}/"
            m.setattr(gpulock.os, "readlink",
                      lambda p, *a, **k: (str(p).startswith(mine) and read.append(1)) or real_readlink(p, *a, **k))
            said, held = _acquire_once(m, uuid)
            assert "passed over" in said, said
            if how == "listening":  # the squatter is still found, named and its socket kept
                assert f"process {squat} (uid 65534)" in said and held == 2, said
        passes = len(read) / table
        # was 12 (6 a name) and 2; a parked name: read twice a name, by the first try that names no holder (so a large
        # squatter is named on it) and by the last look
        assert passes <= (4.1 if how == "in-flight" else 0.1), passes
    finally:
        many.kill()
        many.wait()


def _acquire_beside(m, uuid: str, squat: int) -> list:
    """Root's acquire of GPU `uuid`'s lock, squatter `squat` (uid 65534) on both its names, gpulock's scans counted
    through `m` (a monkeypatch context, undone here with the caller's own spies): named and both names kept, asserted;
    the scans."""
    from powerprof.control import gpulock  # noqa: PLC0415

    scans, real_scan = [], gpulock._holders_from_proc
    m.setattr(gpulock, "_holders_from_proc", lambda *a, **k: scans.append(1) or real_scan(*a, **k))
    said, held = _acquire_once(m, uuid)
    assert f"process {squat} (uid 65534)" in said and held == 2, said
    return scans


@needs_root
def test_a_listening_squatter_with_a_large_table_is_named_on_the_first_try_beside_a_large_bystander(originals,
                                                                                                   monkeypatch):
    # 9d081750 left out, on root's tries, every table past _LARGE_TABLE_FDS of a thread that could not control the GPU:
    # the squatter's own too, so a listening squatter of 300+ descriptors went unnamed until the last look, after all 5
    # tries (h-rev4: a root open of 2 GPUs beside 200 processes of 256 descriptors 0.9-1.5 s before it, 6.9-7.1 s
    # after). The table of the process the name's peer credentials name is read whole on every try: named and kept on
    # the first, one scan a name; a large bystander that could not control is still left out.
    from powerprof.control import gpulock  # noqa: PLC0415

    r, w = os.pipe()
    bystander = os.fork()
    if bystander == 0:  # uid 65534 with 1,000 descriptors: no controller, its table past _LARGE_TABLE_FDS
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            padding = [os.dup(w) for _ in range(1000)]  # noqa: F841
            os.write(w, b"ok")
            time.sleep(60)
        finally:
            os._exit(0)
    try:
        os.close(w)
        assert os.read(r, 2) == b"ok"
        os.close(r)
        uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
        with _squatter(uuid, "listening", every_name=True, extra_fds=300) as squat, monkeypatch.context() as m:
            assert len(os.listdir(f"/proc/{squat}/fd")) > 300
            read, real_readlink = [], gpulock._readlink
            mine = f"/proc/{bystander}/"
            m.setattr(gpulock, "_readlink", lambda p: (p.startswith(mine) and read.append(1)) or real_readlink(p))
            scans = _acquire_beside(m, uuid, squat)
            assert len(scans) == 2, scans  # one a name: named on the first try (was 6 a name, 12)
            assert read == [], len(read)  # the bystander's table still left out
    finally:
        os.kill(bystander, signal.SIGKILL)
        os.waitpid(bystander, 0)


@needs_root
@pytest.mark.parametrize("how", ["orphaned", "listening-full"])
def test_a_squatter_with_a_large_table_the_peer_credentials_do_not_name_is_named_on_the_first_try(originals,
                                                                                                 monkeypatch, how):
    # a001e650 read whole, on root's tries, the large table of the process the name's peer credentials named, through a
    # connect: the squatter's to choose. A listener that forked a child holding the socket and exited ("orphaned": the
    # peer is a dead PID) or a full queue (EAGAIN: no peer) left the squatter's 300+ descriptors out of every try,
    # named only by the last look after 5 tries (h-rev6 d1: 0.07 -> 0.55 s alone, 0.62 -> 4.6-7.8 s beside 200
    # processes of 256 descriptors). A try whose scan names no holder reads the tables it left out whole: named and
    # kept on the first try, one scan a name, no connect made by the scan.
    from powerprof.control import gpulock  # noqa: PLC0415

    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    with _squatter(uuid, how, every_name=True, extra_fds=300) as squat, monkeypatch.context() as m:
        assert len(os.listdir(f"/proc/{squat}/fd")) > 300
        asked, real_holder = [], gpulock._holder
        m.setattr(gpulock, "_holder", lambda *a, **k: asked.append(1) or real_holder(*a, **k))
        scans = _acquire_beside(m, uuid, squat)
        assert len(scans) == 2, scans  # one a name (was 6 a name, 12)
        assert asked == [], asked  # no connect: the peer credentials are the squatter's to choose


@needs_root
def test_a_root_process_holding_many_descriptors_and_no_flock_is_never_read(originals, tmp_path, monkeypatch):
    # The reverted scan read every descriptor of every process at every root start: 0.37 s at 40k host descriptors,
    # 3.8 s at 100k with 8 GPUs. /proc/locks names the few processes holding an exclusive flock; no other's
    # descriptors are listed (here a root process holding 20k, or as many as its hard limit allows).
    from powerprof.control import gpulock  # noqa: PLC0415

    script = ("import os,resource,sys;h=resource.getrlimit(resource.RLIMIT_NOFILE)[1];"
              "resource.setrlimit(resource.RLIMIT_NOFILE,(h,h));"
              "fds=[os.open('/proc/self/stat',os.O_RDONLY) for _ in range(min(h,20100)-100)];print('HELD',flush=True);"
              "sys.stdin.read()")
    many = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert _wait_for_line(many, "HELD")
        listed = []
        real_scandir = os.scandir
        monkeypatch.setattr(gpulock.os, "scandir", lambda p=".": listed.append(str(p)) or real_scandir(p))
        with LimitController(SimNVML("seed-16g", count=2), [0, 1], machine_scope=_scope()) as ctl:
            ctl.set_power_limit_w(220)
        assert not [p for p in listed if p.startswith(f"/proc/{many.pid}/")], listed
    finally:
        many.kill()
        many.communicate(timeout=WAIT_S)
    assert_untouched()


def _fake_proc(tmp_path: Path, case: str):
    """A /proc of two processes for `refuse_stray_locks(proc=)`: this one holding our lock file (a real one, flocked),
    and a root process 4000000 holding a stray file of the same name moved aside (a real file, root's, mode 0600),
    which counts as a controller's unless `case` changes one thing about it. Yields (our lock, fake /proc)."""
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    lock = MachineLock(_scope(), SimNVML("seed-16g", count=2).gpus[0].uuid)
    folder, aside, proc = tmp_path / "locks", tmp_path / "aside", tmp_path / "proc"
    folder.mkdir()
    aside.mkdir()
    ours_fd = os.open(folder / lock.root_path.name, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(ours_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    lock._fd, lock.root_dir, lock.root_path = ours_fd, folder, folder / lock.root_path.name
    stray = aside / lock.root_path.name
    stray.write_text("")
    stray.chmod(0o600)
    if case == "file not root's":  # a setuid program another user exec'd may hold that user's file of the name
        os.chown(stray, 65534, 65534)
    ours_ino, stray_ino = os.fstat(ours_fd).st_ino, stray.stat().st_ino
    flocked = stray_ino + 7919 if case == "not the inode flocked" else stray_ino  # it flocks another file
    pid = 4000000
    (proc / "self" / "fdinfo").mkdir(parents=True)
    (proc / str(pid) / "fdinfo").mkdir(parents=True)
    (proc / str(pid) / "fd").mkdir()
    (proc / "locks").write_text(f"1: FLOCK  ADVISORY  WRITE {os.getpid()} fd:01:{ours_ino} 0 EOF\n"
                                f"2: FLOCK  ADVISORY  WRITE {pid} fd:01:{flocked} 0 EOF\n")
    (proc / "self" / "fdinfo" / str(ours_fd)).write_text(f"pos:\t0\nmnt_id:\t30\nino:\t{ours_ino}\n")
    (proc / "self" / "mountinfo").write_text("30 1 253:1 / / rw - ext4 /dev/vda1 rw\n")
    their_device = "0:99" if case == "on another file system" else "253:1"  # a tmpfs of the same name, say
    (proc / str(pid) / "mountinfo").write_text(f"41 1 {their_device} / / rw - ext4 /dev/vda1 rw\n")
    for n in range(3 if case == "many descriptors of the name" else 1):
        os.symlink(stray, proc / str(pid) / "fd" / str(5 + n))
        (proc / str(pid) / "fdinfo" / str(5 + n)).write_text(f"pos:\t0\nmnt_id:\t41\nino:\t{stray_ino}\n")
    try:
        yield lock, proc, pid
    finally:
        os.close(ours_fd)


@needs_root
@pytest.mark.parametrize("case", ["counts", "file not root's", "on another file system", "not the inode flocked",
                                  "lets go within 100 ms", "many descriptors of the name"])
def test_each_check_of_a_stray_lock_file_matters(originals, tmp_path, monkeypatch, case):
    # Each check of `_stray_lock_holders` alone keeps a file another user chose from counting (the review's mutants
    # dropping the file's uid, the mount's device, the flocked inode or the three sightings passed every test before):
    # a root process holding a 0600 file of the name that uid 65534 owns (a setuid program exec'd over it: 3 of 3
    # false refusals without the uid check), one on another file system, one holding the file unflocked while it
    # flocks another, one letting go between sightings, one holding many descriptors of the name (a setuid program
    # over 20k: 6 s with every lock held before). The fake /proc changes one thing each time; "counts" refuses.
    from powerprof.control import gpulock  # noqa: PLC0415

    with contextlib.contextmanager(_fake_proc)(tmp_path, case) as (lock, proc, pid):
        if case == "lets go within 100 ms":
            real_sleep = time.sleep
            monkeypatch.setattr(gpulock.time, "sleep", lambda s: (proc / "locks").write_text(
                (proc / "locks").read_text().split("\n", 1)[0] + "\n") or real_sleep(s))
        if case == "counts":
            with pytest.raises(GpuBusyError, match=f"kill {pid}"):
                gpulock.refuse_stray_locks([lock], proc=str(proc))
        else:
            assert gpulock.refuse_stray_locks([lock], proc=str(proc)) is None


@needs_root
def test_the_stray_lock_check_is_skipped_past_its_budget(originals, tmp_path, monkeypatch, capfd):
    # Its cost is another user's to choose, and it runs holding every GPU's lock (`restore` refused meanwhile): 20k
    # descriptors of the name in a setuid program held a root controller's open 6-10 s, 100k POSIX locks made the
    # /proc/locks read alone 7.4 s. Past its budget (here none at all) it is skipped, said, fail-open: a stray that
    # counts is not refused then.
    from powerprof.control import gpulock  # noqa: PLC0415

    monkeypatch.setattr(gpulock, "STRAY_CHECK_BUDGET_S", -1.0)
    with contextlib.contextmanager(_fake_proc)(tmp_path, "counts") as (lock, proc, _pid):
        assert gpulock.refuse_stray_locks([lock], proc=str(proc)) == f"skipped: budget ({proc}/locks)"
    assert "was skipped: over its budget (-1.0 s of CPU time, 3.0 s in all)" in " ".join(capfd.readouterr().err.split())
    with LimitController(SimNVML("seed-16g", count=2), [0], machine_scope=_scope()) as ctl:  # a controller goes on
        ctl.set_power_limit_w(220)
    assert "was skipped" in capfd.readouterr().err
    assert_untouched()


@needs_root
@pytest.mark.parametrize("descheduled_s", [0.3, 4.0])
def test_the_stray_lock_check_counts_its_cpu_time_not_the_time_it_waits_for_a_cpu(originals, tmp_path, monkeypatch,
                                                                                  descheduled_s):
    # Its budget was wall time: another user's 30 busy loops beside a setuid `su` over 3,000 descriptors made it skip 5
    # of 5 times (0.42-0.63 s for work of 0.06-0.1 s), and a second root controller then stepped a GPU whose lock
    # folder was removed. Descheduled 0.3 s (the clock jumps, no CPU time spent) it still checks and refuses; only past
    # its wall-time cap (3 s) is it skipped.
    from powerprof.control import gpulock  # noqa: PLC0415

    real_monotonic, calls = time.monotonic, []
    monkeypatch.setattr(gpulock.time, "monotonic",
                        lambda: real_monotonic() + (descheduled_s if calls.append(1) or len(calls) > 1 else 0.0))
    with contextlib.contextmanager(_fake_proc)(tmp_path, "counts") as (lock, proc, pid):
        if descheduled_s < gpulock.STRAY_CHECK_WALL_CAP_S:
            with pytest.raises(GpuBusyError, match=f"kill {pid}"):
                gpulock.refuse_stray_locks([lock], proc=str(proc))
        else:
            assert gpulock.refuse_stray_locks([lock], proc=str(proc)) == f"skipped: budget ({proc}/locks)"


@needs_root
def test_a_sweep_whose_stray_lock_check_was_skipped_says_so_in_its_run_json(originals, tmp_path, monkeypatch):
    # A skip was said on stderr alone, gone with the terminal: the run's data now says its controller's start was not
    # checked for a controller whose lock file was taken out of the lock folder.
    from powerprof.control import gpulock  # noqa: PLC0415
    from powerprof.rig import Rig  # noqa: PLC0415
    from powerprof.sweep import run_sweep  # noqa: PLC0415
    from powerprof.workload.client import RequestParams  # noqa: PLC0415

    def sweep(out_dir):
        with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2)) as rig:
            outcome = run_sweep(rig, levels_spec="300", out_dir=out_dir, params=RequestParams(max_tokens=16),
                                idle_s=0.2, interval_s=0.5, min_requests=2, max_requests=2, warmup_requests=0)
        return json.loads((outcome.run_dir / "run.json").read_text())

    assert sweep(tmp_path / "checked")["stray_lock_check_skipped"] is None
    monkeypatch.setattr(gpulock, "STRAY_CHECK_BUDGET_S", -1.0)
    assert sweep(tmp_path / "skipped")["stray_lock_check_skipped"].startswith("skipped: budget (")
    assert_untouched()


@needs_root
def test_the_stray_lock_check_looks_again_only_at_the_holder_it_saw(originals, tmp_path, monkeypatch):
    # A stray seen is looked at twice more; each look read every candidate again, so a setuid `su` over 19,000 other
    # descriptors beside a real stray (the lock folder removed) cost three times its reading and the check skipped:
    # a second root controller stepped the GPU beside the first. Only the holder seen first can count again.
    from powerprof.control import gpulock  # noqa: PLC0415

    with contextlib.contextmanager(_fake_proc)(tmp_path, "counts") as (lock, proc, pid):
        other_pid = pid + 1
        (proc / str(other_pid) / "fd").mkdir(parents=True)
        (proc / str(other_pid) / "mountinfo").write_text("41 1 253:1 / / rw - ext4 /dev/vda1 rw\n")
        for n in range(100, 2100):
            os.symlink(tmp_path / "other", proc / str(other_pid) / "fd" / str(n))
        lines = (proc / "locks").read_text()
        (proc / "locks").write_text(lines + f"3: FLOCK  ADVISORY  WRITE {other_pid} fd:01:1234567 0 EOF\n")
        read, real_readlink = [], gpulock._readlink
        monkeypatch.setattr(gpulock, "_readlink", lambda path: read.append(path) or real_readlink(path))
        with pytest.raises(GpuBusyError, match=f"kill {pid}"):
            gpulock.refuse_stray_locks([lock], proc=str(proc))
    assert len([p for p in read if p.startswith(f"{proc}/{other_pid}/")]) == 2000


def _clock_past_budget_after(monkeypatch, readlinks: int) -> None:
    """This thread's CPU clock jumps past any budget once `_readlink` has been called `readlinks` times."""
    from powerprof.control import gpulock  # noqa: PLC0415

    real_readlink, real_thread_time, calls = gpulock._readlink, time.thread_time, []
    monkeypatch.setattr(gpulock, "_readlink", lambda path: calls.append(1) or real_readlink(path))
    monkeypatch.setattr(gpulock.time, "thread_time",
                        lambda: real_thread_time() + (100.0 if len(calls) >= readlinks else 0.0))


@needs_root
def test_the_stray_lock_check_looks_at_its_budget_within_one_process_descriptors(originals, tmp_path, monkeypatch):
    # A root process (a setuid program another user exec'd) holding ~2,000 descriptors of other names: the budget is
    # looked at every 64 of them, so running out partway stops there (without that look, a mutant, the whole list was
    # read and every test passed).
    from powerprof.control import gpulock  # noqa: PLC0415

    with contextlib.contextmanager(_fake_proc)(tmp_path, "counts") as (lock, proc, pid):
        other = tmp_path / "other"
        other.write_text("")
        for n in range(100, 2100):
            os.symlink(other, proc / str(pid) / "fd" / str(n))
        _clock_past_budget_after(monkeypatch, 1000)
        assert gpulock.refuse_stray_locks([lock], proc=str(proc)) == f"skipped: budget ({proc}/{pid}/fd)"


@needs_root
def test_the_stray_lock_check_looks_at_its_budget_before_each_process(originals, tmp_path, monkeypatch):
    # Several root processes flocking files of the name: the budget is looked at before each one's descriptors are
    # listed (without that look, a mutant, only the review's dry-run test failed, and for another reason).
    from powerprof.control import gpulock  # noqa: PLC0415

    with contextlib.contextmanager(_fake_proc)(tmp_path, "counts") as (lock, proc, pid):
        lines = (proc / "locks").read_text()
        for other in (pid + 1, pid + 2):
            shutil.copytree(proc / str(pid), proc / str(other), symlinks=True)
            lines += lines.splitlines(keepends=True)[1].replace(f" {pid} ", f" {other} ")
        (proc / "locks").write_text(lines)
        _clock_past_budget_after(monkeypatch, 1)
        assert gpulock.refuse_stray_locks([lock], proc=str(proc)) == f"skipped: budget ({proc}/{pid + 1})"


def _scope() -> str:
    from powerprof.rig import Rig  # noqa: PLC0415

    with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2)) as rig:
        return rig.machine_scope


@needs_root
def test_two_root_controllers_still_exclude_each_other_beside_a_squatter(originals, tmp_path):
    # Root passes over the squatted name; its own lock (a file in a folder only root writes) keeps a second root
    # controller of another state folder off the GPU, naming the first.
    uuid = SimNVML("seed-16g", count=2).gpus[0].uuid
    with _squatter(uuid):
        p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200", "--gpus", "0"])
        try:
            _wait_for_line(p, "STEPPED")
            elsewhere = dict(os.environ, POWERPROF_STATE_DIR=str(tmp_path / "other-state"))
            second = subprocess.run(child_cmd("--gpus", "0", "--levels", "250"), capture_output=True, text=True,
                                    timeout=WAIT_S, env=elsewhere)
            assert second.returncode == 2, second.stderr
            assert f"powerprof process {p.pid} (uid 0)" in second.stderr, second.stderr
            with pytest.raises(GpuBusyError) as ei:
                LimitController(SimNVML("seed-16g", count=2), [0], state_dir_path=tmp_path / "third",
                                machine_scope=_scope()).open()
            assert ei.value.holder_pid == p.pid
            assert sim_state()[0] == (200.0, None) and p.poll() is None
        finally:
            p.terminate()
        assert _finish(p)[0] == 128 + signal.SIGTERM
    assert_untouched()


@needs_root
def test_a_simulated_gpus_root_lock_lives_beside_its_state_file_not_in_roots_folder(originals):
    # Root's machine-wide lock of a simulated GPU was a file in /var/lib/powerprof-control/machine-locks, named by the
    # simulator's state file: each test's state file is a GPU of its own, so every root controller a test killed
    # (SIGKILL: no release) left a file there on the test host, one more each run. It lives beside the state file now.
    from powerprof.control.gpulock import ROOT_LOCK_DIR, MachineLock  # noqa: PLC0415

    lock = MachineLock(_scope(), SimNVML("seed-16g", count=2).gpus[0].uuid)
    state = Path(os.environ["POWERPROF_SIM_STATE"])
    assert lock.root_path.parent == Path(os.path.realpath(state)).parent / f"{state.name}.machine-locks"
    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200", "--gpus", "0"])
    _wait_for_line(p, "STEPPED")
    p.kill()
    p.wait(timeout=WAIT_S)
    assert lock.root_path.exists()  # its killed holder's, where the test's folder takes it away
    assert not (ROOT_LOCK_DIR / lock.root_path.name).exists()
    assert oct(lock.root_path.parent.stat().st_mode & 0o777) == "0o700"
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g"],
                       capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    assert_untouched()


def test_who_could_control_a_gpu(tmp_path):
    # root or CAP_SYS_ADMIN on NVIDIA; for a simulator, whoever may write its state file or folder; unknown: could.
    from powerprof.control.gpulock import could_control  # noqa: PLC0415

    def proc(pid, uid, cap, groups=""):
        d = tmp_path / "proc" / str(pid)
        d.mkdir(parents=True)
        (d / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nGid:\t{uid}\t{uid}\t{uid}\t{uid}\n"
                                  f"Groups:\t{groups}\nCapEff:\t{cap:016x}\n")

    proc(10, 1001, 0)
    proc(11, 1001, 1 << 21)  # CAP_SYS_ADMIN
    proc(12, 1001, 1 << 1)  # CAP_DAC_OVERRIDE
    where = str(tmp_path / "proc")
    assert not could_control("nvml", 10, 1001, where)
    assert could_control("nvml", 11, 1001, where)
    assert could_control("nvml", 10, 0, where) and could_control("nvml", 99, 1001, where)  # root; gone: unknown
    assert could_control("nvml", 10, 1002, where)  # its status names another uid: unknown
    folder = tmp_path / "sim"
    folder.mkdir(mode=0o755)
    state = folder / "sim.json"
    state.write_text("{}")
    state.chmod(0o644)
    scope = f"sim:{state}"
    owner = os.stat(folder).st_uid
    if owner != 1001:
        assert not could_control(scope, 10, 1001, where)
        assert could_control(scope, 12, 1001, where)
        folder.chmod(0o777)
        assert could_control(scope, 10, 1001, where)
    assert could_control("another-scope", 10, 1001, where)
    # A setuid-root program (passwd at its prompt) that a squatter exec'd holding the socket: root in its effective
    # uid, every capability, its real uid the user's. No controller runs so (sudo and systemd set both uids; a script
    # cannot be setuid): holding the name that way kept root off the GPU.
    d = tmp_path / "proc" / "13"
    d.mkdir()
    (d / "status").write_text("Uid:\t1001\t0\t0\t0\nGid:\t1001\t1001\t1001\t1001\nGroups:\t\nCapEff:\t000001ffffffffff\n")
    assert not could_control("nvml", 13, 0, where)
    # A thread is judged by its own status (/proc/<pid>/task/<tid>): its leader's may be a zombie's, or another's creds.
    t = d / "task" / "14"
    t.mkdir(parents=True)
    (t / "status").write_text("Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nGroups:\t\nCapEff:\t000001ffffffffff\n")
    assert could_control("nvml", 13, 0, where, tid=14)


def test_a_held_machine_wide_lock_names_its_holder_however_often_it_is_asked(tmp_path):
    # Never accepted, each connect that asked for the holder's credentials stayed in the listen queue (backlog 1): from
    # the third on, connect failed and the holder went unnamed ("another powerprof process", `kill PID`).
    from powerprof.control.gpulock import MachineLock, _holder  # noqa: PLC0415

    lock = MachineLock(f"sim:{tmp_path}/sim.json", "GPU-x")  # as root, its lock file in tmp_path
    lock.acquire()
    try:
        assert [_holder(lock.name) for _ in range(20)] == [(os.getpid(), os.geteuid())] * 20
    finally:
        lock.release()


@needs_root
def test_roots_machine_wide_lock_file_names_its_holder_over_a_killed_ones_pid(tmp_path):
    # A root controller killed with -9 leaves its lock file, its PID inside; the next one's shorter PID was written over
    # it without cutting it ("1234\n" over "2147483646\n": "1234\n83646\n"), so a refused controller could not name it.
    from powerprof.control.gpulock import MachineLock, make_dirs, read_holder_pid  # noqa: PLC0415

    lock = MachineLock(f"sim:{tmp_path}/sim.json", "GPU-x")  # its lock file in tmp_path
    make_dirs(lock.root_path.parent, 0o700)
    fd = os.open(lock.root_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"2147483646\n")
    os.close(fd)
    lock.acquire()
    try:
        assert read_holder_pid(lock.root_path) == os.getpid()
    finally:
        lock.release()
    assert not lock.root_path.exists()


def test_reclaim_never_raises_where_no_socket_can_be_made(monkeypatch, tmp_path):
    # reclaim runs before every limit or clock change: out of descriptors (EMFILE at socket()), it raised OSError and the
    # limit change failed over a name it only tries to take back. It says False, as for a bind that fails.
    import errno  # noqa: PLC0415

    from powerprof.control import gpulock  # noqa: PLC0415

    lock = gpulock.MachineLock("nvml", "GPU-reclaim-emfile", 0)
    fd = os.open(tmp_path / "held.lock", os.O_RDWR | os.O_CREAT, 0o600)
    lock._fd = fd  # as root after a pass-over: its flock held, the name not

    def no_socket(*_a, **_k):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(gpulock.socket, "socket", no_socket)
    try:
        assert lock.reclaim() is False and lock._sock is None
    finally:
        monkeypatch.undo()
        lock._fd = None
        os.close(fd)


@needs_root
def test_restore_force_default_json_carries_the_pass_over_warning_in_its_notes(originals):
    # `restore --json` put a squatter passed over in its notes, but `--force-default`'s own locking of a damaged file's
    # GPUs did not: said on stderr only, a script reading stdout saw nothing of it.
    import json  # noqa: PLC0415

    p = _start(["--repeat", "0", "--dwell", "0.05", "--levels", "200"])
    _wait_for_line(p, "STEPPED")
    p.kill()
    p.wait(timeout=WAIT_S)
    [record] = restore_files()
    uuids = [g.uuid for g in SimNVML("seed-16g", count=2).gpus]
    record.write_text('{"gpus": {"' + uuids[0] + '": {}, "' + uuids[1] + '": {')  # damaged: cut short
    with _squatter(uuids[0]) as squat:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate", "seed-16g", "--force-default",
                            "--json"], capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"process {squat} (uid 65534)" in r.stderr  # said on stderr as before
    notes = json.loads(r.stdout)["notes"]
    assert any(f"process {squat} (uid 65534)" in n and "passed over" in n for n in notes), notes
    assert all(w > 200 and c is None for w, c in sim_state())  # at their defaults, not the originals: the file is damaged
    assert restore_files() == []
    preset_originals()


def test_a_state_file_reached_through_a_symlink_is_one_gpu_before_and_after_a_write(tmp_path):
    # POWERPROF_SIM_STATE a symlink, link.json -> real.json: the first controller's scope was real.json, but its first
    # write replaced link.json itself with a regular file, and the next controller, given the same link.json, got
    # another scope, name and .machine-locks folder: it set 250 W beside the first's 200 W, and the GPU ended at 200 W
    # with nothing to restore (its original 300 W).
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415
    from powerprof.rig import Rig  # noqa: PLC0415

    real, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(real)
    uuid = SimNVML("seed-16g", count=2, state_path=link).gpus[0].uuid

    def name():
        with Rig("seed-16g", nvml=SimNVML("seed-16g", count=2, state_path=link)) as rig:
            return MachineLock(rig.machine_scope, uuid).name

    before = name()
    nvml = SimNVML("seed-16g", count=2, state_path=link)
    nvml.nvmlInit()
    nvml.nvmlDeviceSetPowerManagementLimit(nvml.nvmlDeviceGetHandleByIndex(0), 200_000)
    assert link.is_symlink() and uuid in real.read_text()  # written through the link, not over it
    assert name() == before


def test_a_state_file_reached_through_a_bind_mount_is_one_gpu(tmp_path):
    # The same folder reached through a bind mount (another path, the same folder) was another GPU for the machine-wide
    # lock: a second root controller of another state folder stepped the GPU the first held.
    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code = ("import sys; from powerprof.control.gpulock import MachineLock; "
            "print(MachineLock(sys.argv[1], 'GPU-x').names[-1].hex())")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                        'mount --bind "$1" "$2" || exit 97; exec "$3" -c "$4" "sim:$2/sim.json"', "sh",
                        str(tmp_path / "a"), str(tmp_path / "b"), sys.executable, code],
                       capture_output=True, text=True, timeout=WAIT_S)
    if r.returncode == 97 or r.stderr.startswith("unshare:"):
        pytest.skip(f"no private bind mount here: {r.stderr.strip()}")
    assert r.stdout.strip() == MachineLock(f"sim:{tmp_path}/a/sim.json", "GPU-x").names[-1].hex(), r.stderr  # the inode's


def test_a_state_folder_made_again_while_a_controller_holds_it_is_still_one_gpu(tmp_path):
    # f7e660d5 named a simulated GPU by its state folder's inode alone: the folder removed and made again (a cleanup;
    # the holder's next write makes it again) while A held the GPU, B named it by the new inode and took it beside A
    # (before: refused, naming A). Both names now, the path's and the inode's, either held busy.
    import shutil  # noqa: PLC0415

    from powerprof.control.gpulock import MachineLock  # noqa: PLC0415

    folder = tmp_path / "sim-folder"
    folder.mkdir(mode=0o700)
    scope = f"sim:{folder}/sim.json"
    a = MachineLock(scope, "GPU-remade", 0)
    a.acquire()
    try:
        shutil.rmtree(folder)
        folder.mkdir(mode=0o700)
        b = MachineLock(scope, "GPU-remade", 0)
        with pytest.raises(GpuBusyError):
            b.acquire()
        assert b._socks == {} and b._fd is None  # nothing of it kept
    finally:
        a.release()
    b.acquire()  # A gone: both of its names free
    assert set(b._socks) == set(b.names) and len(b.names) == 2
    b.release()
    b.acquire()
    b.release()
