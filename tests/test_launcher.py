"""--launch: the server starts, is waited for, and is always stopped — children included."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from powerprof.workload.launcher import LaunchError, ServerLauncher
from powerprof.workload.load import detect


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of ours counts as gone once reaped; Popen.wait did that.
    return False


def test_launches_waits_through_loading_and_stops(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "powerprof.sim.server", "--port", str(port), "--loading-s", "0.6", "--profile", "a100-40g"]
    env = dict(os.environ, POWERPROF_SIM_STATE=str(tmp_path / "s.json"))
    with ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=30, poll_s=0.1, env=env) as la:
        pid = la.proc.pid
        assert detect(la.base_url).kind == "llamacpp"  # healthy, not loading, when we get here
    assert la.proc.returncode is not None and gone(pid)


def test_early_exit_shows_the_log_tail():
    cmd = [sys.executable, "-c", "import sys; print('model file not found: x.gguf'); sys.exit(3)"]
    with pytest.raises(LaunchError, match=r"(?s)exited with code 3.*model file not found"):
        ServerLauncher(cmd, f"http://127.0.0.1:{free_port()}", timeout_s=20, poll_s=0.05).start()


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The server forks a child and never answers /health.
    script = f"import subprocess,time; p=subprocess.Popen(['sleep','60']); open({str(pidfile)!r},'w').write(str(p.pid)); print('loading...', flush=True); time.sleep(60)"
    la = ServerLauncher([sys.executable, "-c", script], f"http://127.0.0.1:{free_port()}", timeout_s=1.0, poll_s=0.1, stop_grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)not healthy.*after 1 s.*loading"):
        la.start()
    assert time.monotonic() - t0 < 15
    assert la.proc.returncode is not None
    child = int(pidfile.read_text())
    for _ in range(50):
        if gone(child):
            break
        time.sleep(0.1)
    assert gone(child)


def test_exception_inside_the_block_stops_the_server(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "powerprof.sim.server", "--port", str(port), "--profile", "a100-40g"]
    env = dict(os.environ, POWERPROF_SIM_STATE=str(tmp_path / "s.json"))
    la = ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=30, poll_s=0.1, env=env)
    with pytest.raises(KeyboardInterrupt):
        with la:
            raise KeyboardInterrupt  # what Ctrl-C raises
    assert la.proc.returncode is not None


def test_missing_program_is_a_clear_error():
    with pytest.raises(LaunchError, match="cannot start"):
        ServerLauncher("/nonexistent/llama-server -m x", "http://127.0.0.1:1").start()
