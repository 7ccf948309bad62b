"""--launch: the server starts, is waited for, and is always stopped — children included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from powerprof.sim.nvml import SimNVML
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
    with pytest.raises(ValueError, match="No closing quotation: quotes must pair"):  # was the bare shlex message
        ServerLauncher("llama-server -a 'my model", "http://127.0.0.1:1")



def test_a_launch_that_never_started_leaves_no_empty_log_and_a_failed_one_keeps_its_log(tmp_path):
    # A --launch of a program that is not there left an empty /tmp/powerprof-server-*.log behind, each time.
    la = ServerLauncher("/nonexistent/llama-server -m x", f"http://127.0.0.1:{free_port()}")
    assert la.log_path.exists() and la.log_path.name.startswith("powerprof-server-")
    with pytest.raises(LaunchError, match="no such program"):
        la.start()
    assert not la.log_path.exists()
    # Refused before launching (the port is taken): nothing ran, nothing to read.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        la = ServerLauncher([sys.executable, "-c", "pass"], f"http://127.0.0.1:{taken.getsockname()[1]}",
                            port_free_wait_s=0.2)
        with pytest.raises(LaunchError, match="already listens"):
            la.start()
        assert la.proc is None and not la.log_path.exists()
    # A log the caller named is theirs: kept, as it was.
    mine = tmp_path / "server.log"
    mine.write_bytes(b"")
    with pytest.raises(LaunchError, match="no such program"):
        ServerLauncher("/nonexistent/llama-server", f"http://127.0.0.1:{free_port()}", log_path=mine).start()
    assert mine.exists()
    # A launch that ran and said why it failed keeps its log: the error points at it.
    la = ServerLauncher([sys.executable, "-c", "import sys; print('model file not found: x.gguf'); sys.exit(3)"],
                        f"http://127.0.0.1:{free_port()}", timeout_s=20, poll_s=0.05)
    try:
        with pytest.raises(LaunchError, match=r"(?s)exited with code 3.*model file not found"):
            la.start()
        assert "model file not found" in la.log_path.read_text()
    finally:
        la.log_path.unlink(missing_ok=True)


# A tiny server: /health answers 200; with --ignore-term it shrugs off SIGTERM like a slow-to-exit server.
TINY_SERVER = textwrap.dedent("""
    import http.server, signal, sys
    if "--ignore-term" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *a):
            pass
    print("listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def group_gone(pgid: int, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class Interrupt(Exception):
    """Stands in for KeyboardInterrupt, which would stop pytest itself."""


def test_interrupt_during_stop_still_kills_a_server_that_ignores_sigterm(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SERVER)
    port = free_port()
    la = ServerLauncher([sys.executable, str(script), str(port), "--ignore-term"], f"http://127.0.0.1:{port}",
                        timeout_s=20, poll_s=0.05, stop_grace_s=1.5)
    la.start()
    pgid = la.proc.pid

    def interrupt(signum, frame):
        raise Interrupt

    old = signal.signal(signal.SIGINT, interrupt)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # Ctrl-C while stop waits the grace period
    try:
        timer.start()
        with pytest.raises(Interrupt):  # the interrupt is not lost: it arrives once the server is gone
            la.stop()
        assert group_gone(pgid, wait_s=2)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, old)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        la.proc.wait(5)
    assert signal.getsignal(signal.SIGTERM) is not None and signal.getsignal(signal.SIGINT) is old


def test_sigterm_under_limit_controller_restores_gpu_stops_server_and_exits_143(tmp_path):
    # LimitController passes SIGTERM on to the launcher's handler: the process must still exit 128 + 15,
    # without a traceback, with the GPU put back and the launched server's process group gone.
    server = tmp_path / "tiny.py"
    server.write_text(TINY_SERVER)
    state = tmp_path / "sim.json"
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from powerprof.control import LimitController
        from powerprof.sim.nvml import SimNVML
        from powerprof.workload.launcher import ServerLauncher
        port = {free_port()}
        nvml = SimNVML("seed-16g", count=1, state_path={str(state)!r})
        with ServerLauncher([sys.executable, {str(server)!r}, str(port)], f"http://127.0.0.1:{{port}}",
                            timeout_s=20, poll_s=0.05, stop_grace_s=5) as la:
            with LimitController(nvml, [0]) as ctl:
                ctl.set_power_limit_w(150)
                print("SERVER", la.proc.pid, flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(20)
        print("NOT REACHED", flush=True)
    """))
    original = SimNVML("seed-16g", count=1, state_path=state)
    original.nvmlInit()
    h = original.nvmlDeviceGetHandleByIndex(0)
    original_mw = original.nvmlDeviceGetPowerManagementLimit(h)
    r = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 128 + signal.SIGTERM, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "NOT REACHED" not in r.stdout
    server_pid = int(r.stdout.split("SERVER", 1)[1].split()[0])
    assert group_gone(server_pid)
    after = SimNVML("seed-16g", count=1, state_path=state)
    after.nvmlInit()
    assert after.nvmlDeviceGetPowerManagementLimit(after.nvmlDeviceGetHandleByIndex(0)) == original_mw != 150_000


def test_a_swallowed_sigterm_still_ends_the_load_before_its_next_request():
    # Library code that catches broadly can swallow the exit the signal handler raises; the run
    # must not go on sending requests while the user waits for it to stop.
    from powerprof.termination import Terminated
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import Prompt, run_load

    port = free_port()
    cmd = [sys.executable, "-m", "powerprof.sim.server", "--port", str(port), "--profile", "a100-40g", "--decode-tok-s", "400"]
    url = f"http://127.0.0.1:{port}"
    with ServerLauncher(cmd, url, timeout_s=60, poll_s=0.05):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here
        except SystemExit:
            pass  # swallowed, as a too-broad `except` in a library would
        with pytest.raises(Terminated) as ei:
            run_load(url, [Prompt("p", "hi")], 5, 1, RequestParams(max_tokens=4), warmup=0)
        assert ei.value.code == 128 + signal.SIGTERM
    # The launcher's run is over: the latch is cleared and a new run works.
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=400) as s:
        recs = run_load(s.url, [Prompt("p", "hi")], 1, 1, RequestParams(max_tokens=4), warmup=0)
    assert [r.status for r in recs] == ["ok"]


# --- the server measured is the one launched -----------------------------------------------------


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    """Exited (a zombie counts: an orphan's reaper may be slow or absent in a container)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_port_already_taken_is_refused_rather_than_the_other_server_measured(tmp_path):
    # Before: the launched server failed to bind and died a moment later, but the one already
    # listening answered /health first, so its figures were reported as the launched command's.
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SERVER)
    port = free_port()
    squatter = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not _listening(port):
            assert time.monotonic() < deadline and squatter.poll() is None
            time.sleep(0.05)
        la = ServerLauncher([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}",
                            timeout_s=20, poll_s=0.05, port_free_wait_s=0.5)
        with pytest.raises(LaunchError, match=rf"(?s)already listens on 127.0.0.1:{port}.*pid {squatter.pid}.*free port"):
            la.start()
        assert la.proc is None  # nothing was launched
        assert squatter.poll() is None  # and the other process is not ours to stop
    finally:
        squatter.kill()
        squatter.wait(5)


DAEMONISING = textwrap.dedent("""
    # Starts the tiny server in its own session, as `setsid CMD &` or a double fork would, then the
    # leader either waits (`stay`) or exits 0 (`leave`, the classic daemon).
    import os, sys, time
    tiny, port, pidfile, mode = sys.argv[1:5]
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if gp := os.fork():
            # Written before the leader can exit: a launcher that kills the grandchild at once (as it
            # should) must not leave the test without its pid (a loaded host once lost that race).
            open(pidfile, "w").write(str(gp))
            os._exit(0)
        os.execv(sys.executable, [sys.executable, tiny, port])
    os.waitpid(pid, 0)
    if mode == "stay":
        time.sleep(600)
""")


@pytest.mark.parametrize("mode", ["stay", "leave"])
def test_a_server_that_leaves_the_process_group_is_stopped_too(tmp_path, mode):
    # Before: SIGTERM/SIGKILL went to the process group only; a server in its own session kept
    # running, holding the port, and the next launch on that port measured it.
    (tmp_path / "tiny.py").write_text(TINY_SERVER)
    (tmp_path / "daemon.py").write_text(DAEMONISING)
    port, pidfile = free_port(), tmp_path / "daemon.pid"
    la = ServerLauncher([sys.executable, str(tmp_path / "daemon.py"), str(tmp_path / "tiny.py"), str(port), str(pidfile), mode],
                        f"http://127.0.0.1:{port}", timeout_s=20, poll_s=0.05, stop_grace_s=2)
    try:
        if mode == "stay":
            with la:
                assert _listening(port)
        else:
            with pytest.raises(LaunchError, match=r"(?s)exited with code 0.*foreground"):
                la.start()
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon = int(pidfile.read_text())
        assert _gone(daemon), "the daemonised server outlived the launcher"
        assert not _listening(port)
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_server_that_spews_output_keeps_a_bounded_log_with_its_start_and_its_end(tmp_path):
    # Before: the log grew as long as the server wrote; a server stuck printing filled the disk.
    script = tmp_path / "spew.py"
    script.write_text(TINY_SERVER.replace('print("listening", flush=True)', textwrap.dedent("""
        import time
        print("BANNER model=x.gguf", flush=True)
        for i in range(60000):
            print(f"token {i} " + "x" * 200)
        sys.stdout.flush()
        # What lands between a cut's last read and its truncation is lost (docs/workload.md, the server's log): a cut in
        # flight as the last line came took it, once in a full suite on a loaded host. Written once the cuts are
        # done, it must be kept, after the cut.
        time.sleep(0.5)
        print("LAST LINE before serving", flush=True)
    """)))
    port, log = free_port(), tmp_path / "server.log"
    la = ServerLauncher([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}", timeout_s=60, poll_s=0.05,
                        log_path=log, max_log_bytes=1 << 20, log_check_s=0.05)
    with la:
        pass
    text = log.read_text()
    assert len(text) < 1.1 * (1 << 20)  # 12 MB written
    assert text.startswith("BANNER model=x.gguf") and "bytes of this log" in text
    assert text.rstrip().endswith("LAST LINE before serving")


# Healthy, then dies at the first request (a crash in the first batch, an abort on a bad flag value).
CRASH_AT_FIRST_REQUEST = textwrap.dedent("""
    import http.server, os, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            b = b'{"status": "ok"}' if self.path == "/health" else b'{"data": [{"id": "m"}]}'
            self.send_response(200); self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
        def do_POST(self):
            print("GGML_ASSERT failed: crash at the first request", flush=True)
            os._exit(134)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


@pytest.mark.parametrize("command", ["sweep", "measure"])
def test_a_launched_server_that_dies_mid_run_is_said_to_have_died_with_its_log(tmp_path, command):
    # Before: only "request 0 failed 3 times; last error: connection refused"; nothing said the
    # launched server had died, nor where its output was.
    script = tmp_path / "crash.py"
    script.write_text(CRASH_AT_FIRST_REQUEST)
    port = free_port()
    args = ["--server", f"http://127.0.0.1:{port}", "--launch", f"{sys.executable} {script} {port}",
            "--out", str(tmp_path / "run")]
    args += ["--simulate", "seed-16g", "--limits", "220,300", "--idle-s", "0.2"] if command == "sweep" else ["--requests", "3"]
    env = dict(os.environ, POWERPROF_SIM_STATE=str(tmp_path / "sim.json"))
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", command, *args], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode != 0
    assert "the launched server exited with code 134 during the run" in r.stderr, r.stderr
    assert "GGML_ASSERT failed: crash at the first request" in r.stderr


def _listener_pid(port: int, wait_s: float = 60.0, proc=None) -> int:
    import psutil

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
        time.sleep(0.1)
    pytest.fail(f"nothing listened on {port}")


def _dead(pid: int, wait_s: float = 15.0) -> bool:
    """Gone, or a zombie nobody reaped yet (its sockets are closed either way)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _sweep_launching(tmp_path, port: int, launch: str) -> subprocess.Popen:
    """A powerprof sweep that launched `launch` and sits in its idle baseline."""
    cmd = [sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "seed-16g", "--limits", "300",
           "--server", f"http://127.0.0.1:{port}", "--launch", launch, "--idle-s", "600", "--out", str(tmp_path / "run")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_a_sigkilled_powerprof_takes_the_server_it_launched_with_it(tmp_path):
    # Before: kill -9 of a sweep left its --launch'ed server running; the next run refused the port, naming the pid.
    port = free_port()
    proc = _sweep_launching(tmp_path, port, f"{sys.executable} -m powerprof.sim.server --port {port}")
    try:
        server = _listener_pid(port, proc=proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _dead(server), "the launched server outlived the powerprof that launched it"
        assert not _listening(port)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_server_left_by_a_killed_powerprof_is_stopped_by_the_next_launch_with_a_note(tmp_path):
    # The server itself is a child of what was launched (a shell line): the death signal reaches the shell only,
    # and the server lives on, orphaned, on the port. The next launch finds the earlier powerprof's marker on it.
    port = free_port()
    launch = f"sh -c '{sys.executable} -m powerprof.sim.server --port {port} & wait'"
    proc = _sweep_launching(tmp_path, port, launch)
    try:
        orphan = _listener_pid(port, proc=proc)
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(0.5)
        assert _listening(port) and not _dead(orphan, wait_s=0.1)  # what the fix below is for
        cmd = [sys.executable, "-m", "powerprof.sim.server", "--port", str(port)]
        with ServerLauncher(cmd, f"http://127.0.0.1:{port}", timeout_s=30, poll_s=0.1, stop_grace_s=5) as la:
            assert la.proc.pid != orphan
            (note,) = la.notes
            assert f"stopped the server an earlier powerprof launched and left listening on port {port} (pid {orphan}:" in note
            assert f"that powerprof (pid {proc.pid}) is gone" in note
        assert _dead(orphan, wait_s=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(orphan, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_a_server_whose_powerprof_still_runs_is_refused_not_stopped(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(TINY_SERVER)
    port = free_port()
    first = ServerLauncher([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}", timeout_s=20, poll_s=0.05)
    with first:
        second = ServerLauncher([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}", timeout_s=20,
                                poll_s=0.05, port_free_wait_s=0.5)
        with pytest.raises(LaunchError, match=rf"pid {first.proc.pid}: .*launched by the powerprof still running as pid {os.getpid()}"):
            second.start()
        assert first.running and not second.notes


def test_a_server_still_exiting_when_its_request_failed_is_said_to_have_died(tmp_path):
    # The client sees the connection drop as the server crashes; on a loaded host the process has not yet
    # exited when the run asks why (the full suite once said only "the server stopped answering").
    from powerprof.workload.launcher import ServerLauncher

    la = ServerLauncher([sys.executable, "-c", "pass"], "http://127.0.0.1:1", log_path=tmp_path / "server.log")
    (tmp_path / "server.log").write_text("GGML_ASSERT failed\n")
    la.proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(0.4); sys.exit(134)"])
    note = la.death_note()
    assert "exited with code 134 during the run" in note and "GGML_ASSERT failed" in note, note
    la.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert la.death_note() == ""  # still running after the grace: nothing said
    finally:
        la.proc.kill()
        la.proc.wait()


def test_readiness_is_probed_often_at_first_and_no_more_than_every_poll_s_later(monkeypatch):
    # Before: /health was probed every 0.5 s from the start, so a server ready in 1.5 s (a simulated one; a small model)
    # was found up to 0.5 s late, each launch: a grid of 10 configurations waited ~2.5 s for nothing. The wait between
    # probes now grows with the time waited (a tenth of it, 50 ms at least, poll_s at most): a server ready after t
    # is found by t + max(50 ms, t/10), and a model loading for minutes is still probed no more often than before.
    import powerprof.workload.launcher as launcher

    now = [0.0]
    probes: list[float] = []
    ready_at = [1.5]

    async def probe(base_url):
        probes.append(now[0])
        return 200 if now[0] >= ready_at[0] else 503

    monkeypatch.setattr(launcher.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(launcher.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    monkeypatch.setattr(launcher, "_probe", probe)
    la = ServerLauncher(["true"], "http://127.0.0.1:1", timeout_s=600)
    la.proc = type("Running", (), {"poll": staticmethod(lambda: None)})()
    for ready in (1.5, 0.3, 120.0):
        now[0], ready_at[0] = 0.0, ready
        probes.clear()
        la._wait_healthy()
        assert now[0] <= ready + max(0.05, ready / 10) + 1e-9, (ready, now[0])
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert all(g >= 0.05 - 1e-9 for g in gaps) and max(gaps) <= la.poll_s + 1e-9, gaps
    assert len(probes) <= 120 / la.poll_s + 60  # minutes of loading: probed every poll_s (0.5 s), as before
