"""What a user reads when a command refuses or prints a figure: every message true, every figure as a person writes it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from powerprof.cli import main


def test_a_tag_name_with_a_non_ascii_letter_is_refused_in_true_words():
    # "must be ... letters, digits" refused 'é', a letter: the rule is ASCII letters.
    from powerprof.daemon.tagapi import check_name

    with pytest.raises(ValueError, match="ASCII letters") as e:
        check_name("café")
    assert "'café'" in str(e.value)


def test_trace_to_an_empty_path_is_refused_in_words(tmp_path, monkeypatch):
    # `powerprof trace ''` was a traceback: ValueError: PosixPath('.') has an empty name.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    r = CliRunner().invoke(main, ["trace", ""])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "'' names no file" in r.output, r.output
    assert list(here.iterdir()) == []


def test_an_output_inside_a_file_says_it_is_a_file_not_a_missing_folder(tmp_path):
    # "folder '.../file.txt' does not exist" was said of a file that exists.
    f = tmp_path / "file.txt"
    f.write_text("x")
    for args, flag in ((["trace", str(f / "x.jsonl")], "OUT.jsonl"), (["trace", str(f / "a" / "x.jsonl")], "OUT.jsonl"),
                       (["monitor", "--simulate", "--duration", "0.1", "--output", str(f / "x.parquet")], "--output")):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2, r.output
        said = " ".join(r.output.split())
        assert flag in said and f"'{f}' is a file, not a folder" in said and "does not exist" not in said, said
    assert f.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "state"]  # conftest's
    r = CliRunner().invoke(main, ["trace", str(tmp_path / "nope" / "x.jsonl")])
    said = " ".join(r.output.split())  # in every command's words (storage.runs.missing_parent)
    assert r.exit_code == 2 and f"its parent folder {tmp_path / 'nope'} does not exist" in said, r.output


def test_a_state_folder_that_is_a_file_is_said_with_the_fix(tmp_path, monkeypatch):
    # A bare "Error: [Errno 17] File exists: '...'", naming neither the state folder nor the fix.
    from powerprof.control.errors import StateFolderError
    from powerprof.control.gpulock import GpuLock

    f = tmp_path / "file.txt"
    f.write_text("x")
    for state in (f, f / "sub"):
        monkeypatch.setenv("POWERPROF_STATE_DIR", str(state))
        r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "200,300", "--max-time", "3",
                                      "--out", str(tmp_path / "run")])
        assert r.exit_code == 1, r.output
        said = " ".join(r.output.split())
        assert f"state folder {state}" in said and "is a file" in said and "Fix: move the file aside, or point " \
            "POWERPROF_STATE_DIR at a folder" in said and "Errno" not in said, said
        assert not (tmp_path / "run").exists() and f.read_text() == "x"
    # A real GPU's lock, the controller's first write there (the simulator's folder is made before it): said so too.
    with pytest.raises(StateFolderError) as e:
        GpuLock(f, "GPU-x").acquire()
    said = str(e.value)
    assert f"{f} is a file, not a folder: move it aside, or point POWERPROF_STATE_DIR at another folder" in said, said
    assert "Nothing was changed on any GPU" in said and "Errno" not in said, said


@pytest.mark.parametrize("kind", ["fifo", "dangling"])
def test_a_state_folder_or_output_folder_that_is_a_fifo_or_a_link_to_nothing_is_said(tmp_path, monkeypatch, kind):
    # The review's cases: a FIFO or a dangling link as the state folder read a bare "[Errno 17] File exists" in sweep,
    # and an output inside one "folder ... does not exist" of a name that exists.
    import os

    p = tmp_path / kind
    os.mkfifo(p) if kind == "fifo" else p.symlink_to(tmp_path / "nothere")
    what = "a FIFO" if kind == "fifo" else "a link to nothing"
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(p))
    r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "200,300", "--max-time", "3",
                                  "--out", str(tmp_path / "run")])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and f"state folder {p} is {what}" in said and "Errno" not in said, said
    monkeypatch.delenv("POWERPROF_STATE_DIR")
    r = CliRunner().invoke(main, ["trace", str(p / "x.jsonl")])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and f"'{p}' is {what}" in said and "does not exist" not in said, said


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_tag_list_given_a_path_that_is_not_a_socket_says_so(tmp_path, kind):
    # A regular file given as --socket was told "no daemon listens on it (a socket left by a daemon that was killed?)".
    p = tmp_path / "notasocket"
    p.write_text("x") if kind == "file" else p.mkdir()
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(p)])
    assert r.exit_code == 1, r.output
    what = "a regular file" if kind == "file" else "a folder"
    assert f"{p} is {what}, not a socket" in r.output and "killed" not in r.output, r.output
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(p), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["ok"] is False, r.output


def test_tag_on_a_socket_nothing_listens_on_says_a_killed_daemon_may_have_left_it(tmp_path):
    # The socket file a daemon killed with -9 leaves: connect() is refused. The client's own words for it, whichever
    # HTTP client sends the request (aiohttp's wrapped the refusal in its own error; the standard library's does not).
    import socket

    p = tmp_path / "left.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(p))
    s.close()
    r = CliRunner().invoke(main, ["tag", "start", "x", "--socket", str(p)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and f"no daemon listens on {p}" in said and "Errno" not in said, said


def test_tag_stop_json_prints_figures_rounded_not_a_float_repr(monkeypatch):
    import powerprof.daemon.tagapi as tagapi

    answer = {"ok": True, "duration_s": 0.1 + 0.2, "gpu_energy_j": 12.000000000000002, "cpu_energy_j": 1.1 + 2.2,
              "unproxied_energy_j": 0.0, "proxy_tokens": 7, "gpu_j_per_token": 12.000000000000002 / 7,
              "server_count": "complete", "energy_note": None}
    monkeypatch.setattr(tagapi, "send_tag", lambda socket, action, name: answer)
    r = CliRunner().invoke(main, ["tag", "stop", "job", "--socket", "/nonexistent", "--json"])
    assert r.exit_code == 0, r.output
    assert "0000000" not in r.stdout, r.stdout
    d = json.loads(r.stdout)
    assert d["duration_s"] == 0.3 and d["gpu_energy_j"] == 12.0 and d["cpu_energy_j"] == 3.3, d
    assert d["gpu_j_per_token"] == pytest.approx(12 / 7, rel=1e-5) and d["proxy_tokens"] == 7, d


def test_export_of_two_versions_of_a_runs_analysis_says_analyses(tmp_path):
    # "... but their analysis differ": the table's name as the plural its verb takes.
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    from synthetic_runs import make_run, seed_truth

    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    copy = shutil.copytree(run, tmp_path / "copy")
    for d, v in ((run, 1.0), (copy, 2.0)):
        (d / "analysis").mkdir()
        pq.write_table(pa.table({"gpu_j_per_token": [v]}), d / "analysis" / "analysis.parquet")
    r = CliRunner().invoke(main, ["export", str(run), str(copy), "--format", "csv", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1, r.output
    said = " ".join(r.output.split())
    assert "their analyses differ" in said and "analysis differ" not in said, said


@pytest.mark.parametrize("value, what", [("trace.jsonl", "is a file"), ("later.csv", "looks like a file's name")])
def test_replay_simulate_given_the_trace_says_what_was_meant(tmp_path, monkeypatch, value, what):
    # `replay --simulate trace.jsonl` took the trace for a GPU profile's name: "not a simulated GPU profile; choose from".
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.jsonl").write_text("{}\n")
    r = CliRunner().invoke(main, ["replay", "--simulate", value])
    assert r.exit_code == 2, r.output
    said = " ".join(r.output.split())
    assert f"'{value}' {what}, not a simulated GPU profile" in said, said
    assert f"replay {value} --simulate" in said and f"--simulate seed-16g {value}" in said, said
    r = CliRunner().invoke(main, ["replay", "--simulate", "h100", "x"])
    assert "not a simulated GPU profile; choose from" in r.output, r.output


def test_a_knob_name_starting_with_a_non_ascii_letter_is_refused_in_true_words():
    # "NAME a word (letters, digits, _)" refused `é=1,2`, a letter: the first must be an ASCII letter or _.
    from powerprof.grid import parse_vary

    with pytest.raises(ValueError, match=r"an ASCII letter or _ first"):
        parse_vary(["é=1,2"])
    assert [k.name for k in parse_vary(["draft_n=1,2"])] == ["draft_n"]


def test_tag_on_a_daemon_that_accepts_but_never_answers_says_so_with_the_fix(tmp_path, monkeypatch):
    # A peer that accepted and trickled was said as "cannot reach the daemon at P: TimeoutError: timed out": not what
    # happened, nor what to do.
    import powerprof.daemon.tagapi as tagapi
    from test_hostile_inputs import _trickling_daemon

    monkeypatch.setattr(tagapi, "TAG_TIMEOUT_S", 1.0)
    p = tmp_path / "hung.sock"
    _trickling_daemon(p, "head", every_s=0.2, for_s=4)
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(p)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1, said
    assert f"the daemon at {p} accepted but did not answer within 1 s (hung, or not a powerprof daemon?)" in said, said
    assert "Fix:" in said and "TimeoutError" not in said, said


def test_tag_on_a_peer_that_trickles_a_closing_answer_says_it_accepted(tmp_path, monkeypatch):
    # An answer with `Connection: close` has http.client drop the connection's socket once its head is read (the
    # answer keeps it), so a body that never came whole was said as "did not accept the connection": the wrong fault.
    import time

    import powerprof.daemon.tagapi as tagapi
    from test_hostile_inputs import _one_request_peer

    def trickle(c):
        c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1000\r\n\r\n{")
        for _ in range(20):
            time.sleep(0.2)
            try:
                c.sendall(b" ")
            except OSError:
                return

    monkeypatch.setattr(tagapi, "TAG_TIMEOUT_S", 1.0)
    p = tmp_path / "slow.sock"
    _one_request_peer(p, trickle)
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(p)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1, said
    assert f"the daemon at {p} accepted but did not answer within 1 s" in said, said


def test_tag_on_a_socket_whose_backlog_is_full_says_the_daemon_did_not_accept(tmp_path, monkeypatch):
    # A listener that never accepts (a daemon whose loop is stuck): connect() itself waits, on a full backlog.
    import socket

    import powerprof.daemon.tagapi as tagapi

    monkeypatch.setattr(tagapi, "TAG_TIMEOUT_S", 1.0)
    p = tmp_path / "stuck.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(p))
    srv.listen(0)
    fill = []
    for _ in range(8):  # fill the backlog (Linux: backlog + 1 connections wait)
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(str(p))
        except BlockingIOError:
            c.close()
            break
        fill.append(c)
    try:
        r = CliRunner().invoke(main, ["tag", "list", "--socket", str(p)])
    finally:
        for c in (*fill, srv):
            c.close()
    said = " ".join(r.output.split())
    assert r.exit_code == 1, said
    assert f"the daemon at {p} did not accept the connection within 1 s" in said and "TimeoutError" not in said, said
