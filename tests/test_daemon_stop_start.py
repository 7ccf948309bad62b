"""The daemon's edges: a clean stop reads the server's counters once more, so its last interval is not marked for
want of a scrape, and takes back its tag socket and daemon.json; a start that fails to bind leaves nothing behind
(docs/daemon.md, "Which rows may be low", the quick start's note on an address already taken, and Tag API)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from daemon_helpers import DaemonProc, read_dataset, sim_env

from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer


def _last_interval(data_dir):
    iv = read_dataset(data_dir, "intervals")
    assert iv is not None and len(iv), "no interval rows"
    return iv.sort_values("t_start_mono_s").iloc[-1]


def _wait_for_intervals(d: DaemonProc, n: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        iv = read_dataset(d.data_dir, "intervals")
        if iv is not None and len(iv) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {n} interval rows in {limit_s} s:\n{d.output()}")


def test_a_clean_stop_reads_the_server_once_more_so_its_last_interval_is_complete(tmp_path):
    # Before: the last interval at every clean stop said server_count=unscraped (its end past the latest scrape, 2 s
    # apart when idle), and a request given its energy said bypass-uncounted.
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=200.0, draft_n_max=0) as srv:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", srv.url, "--interval", "0.25",
                       "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            _wait_for_intervals(d, 4)
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    last = _last_interval(tmp_path / "data")
    assert last["server_count"] == "complete", (last.to_dict(), d.output())


def test_a_server_gone_at_the_stop_leaves_the_last_interval_unscraped_and_the_stop_bounded(tmp_path):
    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=200.0, draft_n_max=0) as srv:
        d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", srv.url, "--interval", "0.25",
                       "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            _wait_for_intervals(d, 4)
        except BaseException:
            d.stop()
            raise
    # The server is down now: the final read fails, and says so; the last interval stays marked, honestly.
    t0 = time.monotonic()
    rc = d.stop()
    assert rc == 0, d.output()
    assert time.monotonic() - t0 < 25, d.output()  # the final read waits 2 s at most (a loaded host: margin)
    assert "unscraped" in _last_interval(tmp_path / "data")["server_count"]
    assert "could not be read at shutdown" in d.output(), d.output()


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else None


def test_a_daemon_that_cannot_bind_its_port_leaves_no_folder_or_file_behind(tmp_path):
    # Before: a data dir with costs/, intervals/, requests/, samples/, tags/ and two lock files, all empty.
    used = tmp_path / "used"
    (used / "requests").mkdir(parents=True)
    (used / "notes.txt").write_text("kept")
    before = _tree(used)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The default data dir, whose folders above are made too (an explicit one must have its parent: below).
        for data_dir in (None, used):
            for flags in (["--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0"],
                          ["--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"]):
                where = (["--data-dir", str(data_dir)] if data_dir else [])
                env = _env() | sim_env(tmp_path) | ({} if data_dir else {"POWERPROF_STATE_DIR": str(tmp_path / "new" / "state")})
                r = subprocess.run([sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", *where,
                                    "--tag-socket", str(tmp_path / "t.sock"), *flags],
                                   capture_output=True, text=True, timeout=120, env=env)
                assert r.returncode == 1 and "address already in use" in r.stderr, r.stderr
                assert "Traceback" not in r.stderr, r.stderr
                assert not (tmp_path / "new").exists(), _tree(tmp_path / "new")
                assert _tree(used) == before, _tree(used)
                assert not (tmp_path / "t.sock").exists()


def _env():
    import os

    return dict(os.environ)


def test_a_clean_stop_takes_back_its_tag_socket_and_daemon_json(tmp_path):
    # Before: both stayed, daemon.json naming the dead PID, and `powerprof tag list` on the socket printed
    # "UnixClientConnectorError: Cannot connect to unix socket … [Connection refused]".
    from click.testing import CliRunner

    from powerprof.cli import main

    d = DaemonProc(tmp_path / "data", "--simulate", env=sim_env(tmp_path))
    sock = Path(d.info["tags"])
    assert sock.is_socket() and d.info_path.exists()
    rc = d.stop()
    assert rc == 0, d.output()
    assert not os.path.lexists(sock), d.output()
    assert not d.info_path.exists(), d.output()
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(sock)])
    assert r.exit_code == 1 and "is `powerprof daemon` running" in r.output, r.output


def _unix_socket_file(path: Path) -> None:
    """A socket file nothing listens on (what a daemon killed with kill -9 leaves): connecting is refused."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


def test_only_the_socket_it_bound_is_removed_never_another_nor_through_a_symlink(tmp_path):
    from powerprof.daemon.service import bound_socket, remove_bound_socket

    own = tmp_path / "own.sock"
    _unix_socket_file(own)
    mine = bound_socket(own)
    remove_bound_socket(mine)
    assert not os.path.lexists(own)
    # Replaced after the bind (another daemon started on the path): that one is not ours to remove. (The first is
    # kept, renamed: unlinked, its inode number could go to the new one; the change time tells those apart.)
    _unix_socket_file(own)
    mine = bound_socket(own)
    own.rename(tmp_path / "old.sock")
    _unix_socket_file(own)
    remove_bound_socket(mine)
    assert own.is_socket()
    own.unlink()
    # A symlink put in its place is neither followed nor removed; its target is kept.
    target = tmp_path / "target.sock"
    _unix_socket_file(target)
    mine = bound_socket(target)
    own.symlink_to(target)
    remove_bound_socket(mine._replace(path=own))
    assert own.is_symlink() and target.is_socket()
    remove_bound_socket(mine._replace(path=tmp_path / "gone.sock", fd=None))  # already gone: nothing to do, no error


def test_daemon_json_and_the_sockets_go_only_once_the_last_rows_are_written(tmp_path):
    # Before: both were removed before the final flush, the data dir's lock still held: a script that took
    # daemon.json's going for the daemon's end read datasets short of their last rows, or started a daemon that
    # found the lock held.
    import asyncio

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.daemon.store import write_file_atomic
    from powerprof.rig import Rig

    data, sock = tmp_path / "data", tmp_path / "t.sock"
    stopping, seen = [False], []

    def writer(path, table):
        if stopping[0]:
            seen.append(((data / "daemon.json").exists(), sock.is_socket()))
        write_file_atomic(path, table)

    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(data), "daemon.interval_s": 0.1, "daemon.flush_interval_s": 30,
        "proxy.listen": "127.0.0.1:0", "metrics.listen": "", "daemon.restore_on_start": False,
        "tags.socket": str(sock)})
    d = Daemon(cfg, Rig("a100-40g", nvml=SimNVML("a100-40g", state_path=None)), store_write=writer)

    async def main():
        task = asyncio.create_task(d.run())
        while not (data / "daemon.json").exists():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        stopping[0] = True
        d.stop_event.set()
        return await task

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 0
    assert seen and all(json_there and sock_there for json_there, sock_there in seen), seen
    assert not (data / "daemon.json").exists() and not os.path.lexists(sock)


def test_a_socket_a_live_process_listens_on_is_refused_not_taken_and_a_dead_ones_is_replaced(tmp_path):
    # Before: any socket at the path was unlinked, so a second daemon given the same --tag-socket took it from the
    # first, which went on running with its tag API unreachable.
    import pytest

    from powerprof.daemon.service import StartupError, prepare_socket_path

    live = tmp_path / "live.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(live))
        listener.listen()
        with pytest.raises(StartupError) as e:
            prepare_socket_path(live, "tag API")
        said = str(e.value)
        assert f"another process listens on {live}" in said and "another powerprof daemon?" in said, said
        assert "--tag-socket" in said and "tags.socket" in said, said
        assert live.is_socket()
    dead = tmp_path / "dead.sock"  # a killed daemon's: nothing listens, connecting is refused
    _unix_socket_file(dead)
    prepare_socket_path(dead, "tag API")
    assert not os.path.lexists(dead)


def test_a_socket_the_operator_chmods_after_the_start_is_still_removed_at_the_stop(tmp_path, caplog):
    # Before: the socket was known by its inode and change time, and a chmod, chgrp or setfacl after the start changed
    # the latter: the socket was silently left at the stop. The daemon now holds the socket's inode open (O_PATH) for
    # its life, so no socket made since can take its inode number, and the inode alone tells it.
    from powerprof.daemon.service import bound_socket, remove_bound_socket

    own = tmp_path / "own.sock"
    _unix_socket_file(own)
    mine = bound_socket(own)
    os.chmod(own, 0o600)
    remove_bound_socket(mine)
    assert not os.path.lexists(own)
    # Where no descriptor could be held (none to spare), the change time still tells a reused inode number: the
    # socket is left, and the log says so, why, and what to do.
    _unix_socket_file(own)
    mine = bound_socket(own)
    os.close(mine.fd)
    os.chmod(own, 0o600)
    with caplog.at_level("WARNING", logger="powerprof.daemon"):
        remove_bound_socket(mine._replace(fd=None))
    assert own.is_socket()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"left the socket {own}" in said and "changed since" in said and "rm " in said, said


def test_the_tag_client_on_a_socket_nothing_listens_on_says_what_a_missing_socket_says(tmp_path):
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "left.sock"
    _unix_socket_file(sock)
    for args in (["list"], ["start", "x"], ["stop", "x"]):
        r = CliRunner().invoke(main, ["tag", *args, "--socket", str(sock)])
        assert r.exit_code == 1 and "is `powerprof daemon` running" in r.output, r.output
        assert "ClientConnectorError" not in r.output and "kill -9" in r.output, r.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_upstream_not_answering_at_start_is_named_with_why_and_the_fix_and_the_daemon_runs(tmp_path):
    # Before: it started with one warning, "the server's token counters could not be read before ready (no answer in
    # time, or no counters)", naming neither the URL nor that nothing listened there.
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens: connection refused
    d = DaemonProc(tmp_path / "data", "--simulate", "--upstream", url, env=sim_env(tmp_path))
    try:
        out = d.output()
        line = next((x for x in out.splitlines() if "does not answer" in x), "")
        assert url in line and "connection refused" in line.lower(), out
        assert "502" in line and "--upstream" in line and "proxy.upstream" in line, out
        counters = next((x for x in out.splitlines() if "token counters" in x and "before ready" in x), "")
        assert "no answer in time, or no counters" not in counters, out
    finally:
        rc = d.stop()
    assert rc == 0, d.output()  # fail-open: it ran, and stopped cleanly


def test_the_upstream_check_says_why_for_a_refused_connection_a_name_that_does_not_resolve_and_a_silent_host(
        monkeypatch):
    import asyncio

    from powerprof.daemon.service import upstream_problem

    async def judge(url, timeout_s=2.0):
        return await upstream_problem(url, timeout_s)

    port = _free_port()
    assert "connection refused" in asyncio.run(judge(f"http://127.0.0.1:{port}")).lower()
    with monkeypatch.context() as m:  # the resolver's answer, not the network's: no wait on DNS, nor its 2 s limit
        _resolves_to(m, {})
        said = asyncio.run(judge("http://nonexistent-host.invalid:8080"))
    assert said == "the name nonexistent-host.invalid cannot be resolved (Name or service not known)", said
    with socket.socket() as up:  # a server that listens: no problem (an HTTPS one is judged by its TCP port too)
        up.bind(("127.0.0.1", 0))
        up.listen()
        assert asyncio.run(judge(f"http://127.0.0.1:{up.getsockname()[1]}/v1")) is None
        assert asyncio.run(judge(f"https://127.0.0.1:{up.getsockname()[1]}")) is None
    # A host that never answers the connect (a firewall that drops): said as such, within the time.
    async def hangs(*_a, **_k):
        await asyncio.sleep(60)

    monkeypatch.setattr(asyncio, "open_connection", hangs)
    assert asyncio.run(judge("http://10.0.0.1:80", timeout_s=0.2)) == "no answer within 0.2 s"


def _resolves_to(monkeypatch, names: dict) -> None:
    """socket.getaddrinfo (what asyncio's loop.getaddrinfo calls) answering `names` {host: [ip, ...]} itself, or
    refusing any other name as a resolver does: no test waits on DNS."""
    def fake(host, port, family=0, type=0, proto=0, flags=0):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, port, 0, 0) if ":" in ip else (ip, port)) for ip in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", fake)


def test_an_upstream_name_with_several_addresses_is_said_address_by_address(monkeypatch):
    # Before: `localhost` (::1 and 127.0.0.1) with nothing listening printed asyncio's own text, "Multiple
    # exceptions: [Errno 111] Connect call failed ('::1', 8080, 0, 0), [Errno 111] Connect call failed (...)".
    import asyncio

    from powerprof.daemon.service import upstream_problem

    port = _free_port()
    _resolves_to(monkeypatch, {"dual": ["::1", "127.0.0.1"]})
    said = asyncio.run(upstream_problem(f"http://dual:{port}", 2.0))
    assert said == "connection refused on ::1 and 127.0.0.1", said
    with socket.socket() as up:  # one of them takes it: no problem
        up.bind(("127.0.0.1", 0))
        up.listen()
        _resolves_to(monkeypatch, {"dual": ["::1", "127.0.0.1"]})
        assert asyncio.run(upstream_problem(f"http://dual:{up.getsockname()[1]}", 2.0)) is None


def test_an_explicit_data_dir_whose_parent_is_missing_is_refused_and_nothing_is_made(tmp_path):
    # Before: `--data-dir /nonexistent/dir/x` made the whole tree (mode 0755) and ran: a typo in the path silently
    # became a new tree of folders, while docs/daemon.md says to make the data dir with mode 0700.
    missing = tmp_path / "typo"
    for how in (["--data-dir", str(missing / "dir" / "x")], []):
        env = _env() | sim_env(tmp_path) | ({} if how else {"POWERPROF_DAEMON_DATA_DIR": str(missing / "dir" / "x")})
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", *how,
                            "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2, r.stderr  # a usage error, refused by the config's check as --check refuses it (was 1)
        assert f"{missing / 'dir'} does not exist" in r.stderr and f"mkdir -p {missing / 'dir'}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not missing.exists(), r.stderr


def test_the_data_dir_the_daemon_makes_is_its_own_0700_and_the_default_path_gets_its_folders_above(tmp_path):
    from powerprof.daemon.service import StartupError, lock_data_dir

    os.close(lock_data_dir(tmp_path / "data"))  # its parent is there: made, readable by its owner only
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
    (tmp_path / "kept").mkdir()  # one made by the operator keeps its mode (set, not left to the umask: 077 made it 0700)
    (tmp_path / "kept").chmod(0o755)
    os.close(lock_data_dir(tmp_path / "kept"))
    assert (tmp_path / "kept").stat().st_mode & 0o777 == 0o755
    try:
        lock_data_dir(tmp_path / "a" / "b")
        raise AssertionError("a data dir whose parent is missing was made")
    except StartupError as e:
        assert f"{tmp_path / 'a'} does not exist" in str(e)
    assert not (tmp_path / "a").exists()
    # The default one (no daemon.data_dir: ~/.local/state/powerprof/daemon of a new user) is made with its folders.
    os.close(lock_data_dir(tmp_path / "s" / "powerprof" / "daemon", parents=True))
    assert (tmp_path / "s" / "powerprof" / "daemon").stat().st_mode & 0o777 == 0o700


def test_a_data_dir_inside_another_daemons_is_refused_before_anything_is_made(tmp_path):
    # `--data-dir dd1/requests` was taken (session 46's hostile review): `analyze dd1` then read its requests, samples
    # and intervals as dd1's own (684 requests where dd1 held 550), unsaid.
    from powerprof.daemon.service import StartupError, lock_data_dir

    outer = tmp_path / "dd1"
    os.close(lock_data_dir(outer))  # a daemon's data dir: its lock file is there
    (outer / "requests").mkdir()
    for inner in (outer / "requests", outer / "requests" / "x"):
        try:
            lock_data_dir(inner)
            raise AssertionError(f"{inner}: a data dir inside another daemon's was taken")
        except StartupError as e:
            assert f"inside another daemon's data dir {outer}" in str(e), str(e)
    assert sorted(p.name for p in (outer / "requests").iterdir()) == []  # nothing made there
    os.close(lock_data_dir(tmp_path / "dd2"))  # beside it: fine
