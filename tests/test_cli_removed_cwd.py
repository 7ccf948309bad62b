"""Every command from a removed current folder: absolute paths work, a relative one is a usage error naming the fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from support import free_port

# The command in a fresh interpreter whose current folder is removed before powerprof starts (a test process cannot
# stand in a removed folder without taking the others' along).
_GONE = ("import os, runpy, sys\nos.chdir(sys.argv[1])\nos.rmdir(sys.argv[1])\n"
         "sys.argv = ['powerprof', *sys.argv[2:]]\nrunpy.run_module('powerprof', run_name='__main__', alter_sys=True)")


def _argv(tmp_path, *args) -> list[str]:
    return [sys.executable, "-c", _GONE, tempfile.mkdtemp(dir=tmp_path, prefix="cwd"), *map(str, args)]


def from_removed_cwd(tmp_path, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(_argv(tmp_path, *args), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from synthetic_runs import make_run, seed_truth

    return make_run(tmp_path_factory.mktemp("r") / "run", seed_truth(), levels=(180, 300), n_requests=6)


TUNE = ["tune", "--simulate", "--dry-run", "--duration", "1", "--daemon-metrics", "http://127.0.0.1:1/metrics",
        "--tpot-p95-ms", "100", "--levels", "200,300W"]

# (command, what it writes at OUT, an absolute path) — before, monitor --output, trace and the daemon ended in a
# FileNotFoundError traceback from os.getcwd() (exit 1, nothing written).
ABSOLUTE = {
    "analyze": (lambda run, out: ["analyze", run, "--bootstrap", "100", "--format", "md", "--out", out], "analysis.json"),
    "export": (lambda run, out: ["export", run, "--format", "csv", "--out", out], "windows.csv"),
    "sweep": (lambda run, out: ["sweep", "--simulate", "--limits", "300", "--idle-s", "0", "--min-requests", "2",
                                "--max-requests", "2", "--out", out], "run.json"),
    "measure": (lambda run, out: ["measure", "--simulate", "--requests", "2", "--out", out], "windows.parquet"),
    "trace": (lambda run, out: ["trace", f"{out}.jsonl", "--requests", "3"], None),
    "monitor": (lambda run, out: ["monitor", "--simulate", "--duration", "0.5", "--plain", "--output",
                                  f"{out}.parquet"], None),
    "tune": (lambda run, out: [*TUNE, "--out", out], None),
}


@pytest.mark.parametrize("cmd", sorted(ABSOLUTE))
def test_a_command_writes_an_absolute_path_from_a_removed_current_folder(cmd, run_dir, tmp_path):
    args, inside = ABSOLUTE[cmd]
    out = tmp_path / "out"
    r = from_removed_cwd(tmp_path, *args(run_dir, out))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    made = {"trace": out.with_name("out.jsonl"), "monitor": out.with_name("out.parquet")}.get(cmd, out)
    assert made.exists() and (inside is None or (out / inside).is_file()), sorted(os.listdir(tmp_path))


# A relative path names no place there: refused before anything starts (exit 2), the fix named; before, a traceback
# (measure, trace, the daemon's --check), "[Errno 2] No such file or directory" (sweep, exit 1), "folder '.' is not
# writable" (monitor), "no daemon socket at rel.sock" (tag, exit 1), exit 1 (analyze, export).
RELATIVE = {
    "analyze": lambda run: ["analyze", run, "--bootstrap", "100", "--out", "rel"],
    "export": lambda run: ["export", run, "--format", "csv", "--out", "rel"],
    "export, default --out": lambda run: ["export", run, "--format", "csv"],
    "sweep": lambda run: ["sweep", "--simulate", "--limits", "300", "--out", "rel"],
    "sweep, default folder": lambda run: ["sweep", "--simulate", "--limits", "300", "--dry-run"],
    "measure": lambda run: ["measure", "--simulate", "--requests", "2", "--out", "rel"],
    "measure, default folder": lambda run: ["measure", "--simulate", "--requests", "2"],
    "trace": lambda run: ["trace", "rel.jsonl", "--requests", "3"],
    "monitor --output": lambda run: ["monitor", "--simulate", "--duration", "0.5", "--output", "rel.parquet"],
    "monitor --recover": lambda run: ["monitor", "--recover", "rel.parquet"],
    "tune": lambda run: [*TUNE, "--out", "rel"],
    "daemon --data-dir": lambda run: ["daemon", "--simulate", "--check", "--data-dir", "rel"],
    "daemon --config": lambda run: ["daemon", "--simulate", "--check", "--config", "rel.toml"],
    "tag --socket": lambda run: ["tag", "list", "--socket", "rel.sock"],
    "tag --config": lambda run: ["tag", "list", "--config", "rel.toml"],
    # Inputs too (each click.Path and source, cli._check_relative_paths): said as a path that does not exist.
    "analyze, a relative run": lambda run: ["analyze", "run", "--out", run.parent / "a"],  # "no such run directory"
    "export, a relative source": lambda run: ["export", "run", "--format", "csv", "--out", run.parent / "e"],
    "replay": lambda run: ["replay", "t.jsonl", "--simulate"],  # "cannot read trace t.jsonl: No such file"
    "sweep --prompts": lambda run: ["sweep", "--simulate", "--limits", "300", "--prompts", "p.txt", "--dry-run"],
}


@pytest.mark.parametrize("case", sorted(RELATIVE))
def test_a_relative_path_from_a_removed_current_folder_is_a_usage_error_naming_the_fix(case, run_dir, tmp_path):
    before = sorted(os.listdir(tmp_path))
    r = from_removed_cwd(tmp_path, *RELATIVE[case](run_dir))
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert "the current folder no longer exists" in said and "cd to one that does, or give an absolute" in said, said
    assert [n for n in os.listdir(tmp_path) if not n.startswith("cwd")] == [n for n in before if not n.startswith("cwd")]


def test_the_daemon_and_tag_run_from_a_removed_current_folder(tmp_path):
    # The daemon joined os.getcwd() to its data dir, absolute or not: "cannot use data dir ...: [Errno 2] No such file
    # or directory", exit 1, no proxy. Now it starts, `tag` from a removed folder reaches it, and it stops cleanly.
    sock = tmp_path / "t.sock"
    p = subprocess.Popen(_argv(tmp_path, "daemon", "--simulate", "--data-dir", tmp_path / "dd", "--listen",
                               f"127.0.0.1:{free_port()}", "--metrics-listen", f"127.0.0.1:{free_port()}",
                               "--upstream", f"http://127.0.0.1:{free_port()}", "--tag-socket", sock),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sock.exists(), p.communicate(timeout=30)[0] if p.poll() is not None else "no socket in 60 s"
        for action in ("start", "stop"):
            r = from_removed_cwd(tmp_path, "tag", action, "w", "--socket", sock)
            assert r.returncode == 0 and f"tag w" in r.stdout, r.stdout + r.stderr
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        log = p.communicate(timeout=60)[0]
    assert p.returncode == 0 and "Traceback" not in log, log[-3000:]
    assert (tmp_path / "dd" / ".daemon.lock").exists()
