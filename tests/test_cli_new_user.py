"""What a new user meets running the README's commands and their likely mistakes: each error says what
went wrong and the fix, exits non-zero, and claims nothing that did not happen."""

from __future__ import annotations

from click.testing import CliRunner

from powerprof.cli import main
from support import free_port, sim_limit_w


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_a_sweep_stopped_before_any_level_does_not_say_a_gpu_was_put_back(tmp_path):
    # A server that is not running: the sweep stops before it sets a limit, and said "every GPU is back at its
    # original limit", as if one had been changed.
    out = tmp_path / "run"
    r = run("sweep", "--limits", "180,220", "--simulate", "--server", f"http://127.0.0.1:{free_port()}",
            "--idle-s", "0", "--out", str(out))
    assert r.exit_code == 1, r.output
    assert "no server answers" in r.output and "is the server running" in r.output, r.output
    assert "every GPU is back" not in r.output, r.output
    assert "no GPU setting was changed" in r.output, r.output
    assert sim_limit_w() == 300.0
    assert not out.exists()


def test_a_sweep_into_a_run_directory_that_holds_a_run_changes_nothing_and_says_so(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "windows.parquet").write_bytes(b"an earlier run")
    r = run("sweep", "--limits", "180,220", "--simulate", "--idle-s", "0", "--out", str(out))
    assert r.exit_code != 0, r.output
    assert "already exists" in r.output and "--out" in r.output, r.output
    assert "every GPU is back" not in r.output and "no GPU setting was changed" in r.output, r.output
    assert (out / "windows.parquet").read_bytes() == b"an earlier run"
    assert sim_limit_w() == 300.0


def test_a_dry_run_refuses_the_run_directory_the_sweep_would_refuse(tmp_path):
    # `--dry-run` ("validate and print the plan") passed an --out holding a finished run, which the sweep itself
    # then refused: the plan said all was well.
    out = tmp_path / "run"
    out.mkdir()
    (out / "windows.parquet").write_bytes(b"an earlier run")
    r = run("sweep", "--limits", "180,220", "--simulate", "--dry-run", "--out", str(out))
    assert r.exit_code == 1, r.output
    assert "already exists and is not empty; choose another --out" in r.output, r.output
    assert "Dry run" not in r.output, r.output
    assert (out / "windows.parquet").read_bytes() == b"an earlier run"
    fresh = tmp_path / "fresh"
    r = run("sweep", "--limits", "180,220", "--simulate", "--dry-run", "--out", str(fresh))
    assert r.exit_code == 0 and "Dry run: nothing will be changed" in r.output, r.output
    assert not fresh.exists()


def test_python_dash_m_powerprof_is_the_command():
    # `python -m powerprof sweep ...` (a venv's bin/ not on PATH) said "No module named powerprof.__main__".
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "powerprof", "sweep", "--limits", "180,220", "--simulate", "--dry-run"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Dry run: nothing will be changed" in r.stdout and "180 W, 220 W" in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "powerprof", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "python -m powerprof" in r.stdout and "sweep" in r.stdout, r.stdout + r.stderr


def test_a_number_given_with_its_unit_is_refused_in_words(tmp_path):
    # click said "'30s' is not a valid float range." (and "'2x' is not a valid integer range.").
    out = tmp_path / "run"
    for opt, bad, said in (("--max-time", "30s", "'30s' is not a number: give the number alone, without its unit"),
                           ("--max-time", "abc", "'abc' is not a number (e.g. 30 or 0.5)"),
                           ("--warmup", "2.5", "'2.5' is not a whole number"),
                           ("--max-requests", "20req", "'20req' is not a whole number: give the number alone")):
        r = run("sweep", "--limits", "180,220", "--simulate", "--out", str(out), opt, bad)
        assert r.exit_code == 2, r.output
        assert said in r.output and "valid float range" not in r.output and "valid integer range" not in r.output, r.output
        assert not out.exists()
    assert sim_limit_w() == 300.0
    for args, said in ((("daemon", "--simulate", "--interval", "1s", "--check"), "'1s' is not a number: give the number alone"),
                       (("measure", "--simulate", "--seed", "x"), "'x' is not a whole number")):
        r = run(*args)
        assert r.exit_code == 2 and said in r.output and "valid float" not in r.output, r.output
    # An option without bounds keeps its plain metavar in --help ("[x<=None]" would be click's range of nothing).
    helptext = run("daemon", "--help").output
    assert "--interval FLOAT " in helptext and "None" not in helptext, helptext


def test_a_daemon_whose_address_is_taken_says_which_setting_to_change(tmp_path):
    # The README's daemon quick start beside another daemon (or anything on 8081/9464) said only
    # "cannot listen on 127.0.0.1:8081 for the proxy: ... address already in use".
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, key, flag in ((["--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0"], "proxy.listen", "--listen"),
                                 (["--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"], "metrics.listen",
                                  "--metrics-listen")):
            r = subprocess.run([sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "--data-dir", str(tmp_path / "d"),
                                "--tag-socket", str(tmp_path / "t.sock"), *flags],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 1, r.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "address already in use" in r.stderr, r.stderr
            assert f"another address: {key} in the config, or {flag} HOST:PORT" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr, r.stderr


def test_export_twice_without_out_says_the_default_was_taken_and_how_to_choose(tmp_path, monkeypatch):
    # The second `export RUN --format parquet` said "Invalid value for --out: ... choose another folder" to a
    # user who gave no --out.
    from synthetic_runs import make_run, seed_truth

    run_dir = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    monkeypatch.chdir(tmp_path)
    first = run("export", str(run_dir), "--format", "parquet")
    assert first.exit_code == 0, first.output
    written = {p: p.read_bytes() for p in (tmp_path / "run-parquet").iterdir()}
    again = run("export", str(run_dir), "--format", "parquet")
    assert again.exit_code == 2, again.output
    assert "Invalid value for --out" not in again.output, again.output
    assert "the default output, as no --out was given" in again.output, again.output
    assert "choose another folder with --out FOLDER, or --force" in again.output, again.output
    assert {p: p.read_bytes() for p in (tmp_path / "run-parquet").iterdir()} == written
    taken = run("export", str(run_dir), "--format", "parquet", "--out", str(tmp_path / "run-parquet"))
    assert taken.exit_code == 2 and "Invalid value for --out" in taken.output, taken.output  # given: said as its own


def test_a_guessed_report_command_points_at_analyze():
    # `powerprof report RUN` (the README speaks of "the report it writes") offered 'export' and 'restore'.
    r = run("report", "runs/x")
    assert r.exit_code == 2, r.output
    assert "powerprof analyze RUN_DIR" in r.output and "report.html" in r.output, r.output
    r = run("analyse", "runs/x")
    assert r.exit_code == 2 and "powerprof analyze" in r.output, r.output


def test_a_list_typed_with_spaces_is_refused_with_the_cause(tmp_path):
    # `--limits 180 220` or `--limits 220 W` said only "Got unexpected extra argument (220)".
    out = tmp_path / "run"
    for args in (("--limits", "180", "220"), ("--limits", "220", "W")):
        r = run("sweep", *args, "--simulate", "--out", str(out))
        assert r.exit_code == 2, r.output
        assert "give a list comma-separated without spaces (--limits 180,220,260)" in r.output, r.output
        assert not out.exists()
    r = run("sweep", "--limits", "220 W", "--simulate", "--dry-run", "--out", str(out))  # quoted, it is one value
    assert r.exit_code == 0 and "levels (every GPU takes each level): 220 W" in r.output, r.output
    assert sim_limit_w() == 300.0


def test_analyze_of_the_runs_folder_names_the_runs_in_it(tmp_path):
    # `powerprof analyze runs` (the folder the sweep's default --out is in) said only "windows.parquet is missing".
    from synthetic_runs import make_run, seed_truth

    make_run(tmp_path / "runs" / "20261202T120000Z-a", seed_truth(), levels=(220, 300), n_requests=4)
    r = run("analyze", str(tmp_path / "runs"))
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert "is not a powerprof run directory" in flat, flat
    assert f"give one of them ({tmp_path / 'runs' / '20261202T120000Z-a'})" in flat, flat
    assert not (tmp_path / "runs" / "analysis").exists()


def test_tune_on_a_machine_without_a_gpu_driver_says_so_with_the_fix(tmp_path):
    # docs/tuner.md's dry-run command where NVML cannot start (no driver, or a laptop trying it out): pynvml's
    # NVMLError_LibraryNotFound came out as a 60-line traceback.
    import subprocess
    import sys

    hook = ("import sys, pynvml\n"
            "def fail():\n"
            "    raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)\n"
            "pynvml.nvmlInit = fail\n"
            "sys.argv[0] = 'powerprof'\n"
            "from powerprof.entry import main\n"
            "sys.exit(main())\n")
    r = subprocess.run([sys.executable, "-c", hook, "tune", "--daemon-metrics", f"http://127.0.0.1:{free_port()}/metrics",
                        "--levels", "180,200,220,240,260,280,300", "--tpot-p95-ms", "100", "--ttft-p95-ms", "5000",
                        "--dry-run", "--out", str(tmp_path / "decisions")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "tune needs a GPU whose power limit it can set: no NVIDIA GPU reachable through NVML" in r.stderr, r.stderr
    assert "fix: install the NVIDIA driver" in r.stderr and "--simulate" in r.stderr, r.stderr
    assert not (tmp_path / "decisions").exists()


def test_an_empty_level_list_is_said_to_be_empty_not_missing(tmp_path):
    # `--limits ""` (a shell variable that was not set) said "give exactly one of --limits or --clocks", to a user
    # who had given --limits; beside --vary it swept the settings as they are, as if no --limits had been given.
    out = tmp_path / "run"
    for opt, said in (("--limits", "--limits is empty: give power limits, e.g. --limits 180,220W,60%"),
                      ("--clocks", "--clocks is empty: give SM clocks in MHz, e.g. --clocks 1500,1200MHz,80%")):
        for value in ("", " ", " , "):
            for extra in ((), ("--vary", "np=1,2", "--launch", "srv -np {np}", "--server", "http://127.0.0.1:8080")):
                r = run("sweep", opt, value, "--simulate", "--dry-run", "--out", str(out), *extra)
                assert r.exit_code == 2, r.output
                flat = " ".join(r.output.split())
                assert said in flat, flat
                assert "exactly one of" not in flat and "levels: none" not in flat, flat
    assert not out.exists()
    assert sim_limit_w() == 300.0


def _daemon_dataset(root):
    """A daemon data folder as the daemon's own store writes it (requests/, intervals/, date= partitions)."""
    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import DatasetStore

    t0 = 1_768_478_400 * 10**9  # 2026-01-15 12:00 UTC
    store = DatasetStore(root, datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": i, "t_arrival_utc": t0 + i * 10**9,
                               "t_end_utc": t0 + i * 10**9 + 5 * 10**8, "outcome": "ok", "generated_tokens": 100,
                               "gpu_energy_j": 50.0, "attributed_tokens": 100.0, "ttft_s": 0.1} for i in range(4)])
    store.append("intervals", [{"daemon_id": "d0", "t_start_utc": t0 + i * 10**9, "t_end_utc": t0 + (i + 1) * 10**9,
                                "duration_s": 1.0, "kind": "decode", "gpu_energy_j": 300.0} for i in range(4)])
    assert store.flush()
    return root


def test_analyze_of_a_daemon_datasets_table_names_the_dataset_and_the_command(tmp_path):
    # `powerprof analyze DIR/requests` said "not a powerprof run directory: windows.parquet is missing".
    from synthetic_runs import make_run, seed_truth

    data = _daemon_dataset(tmp_path / "pp")
    partition = next((data / "requests").iterdir())
    for given in (data / "requests", data / "intervals", partition):
        r = run("analyze", str(given))
        assert r.exit_code == 1, r.output
        flat = " ".join(r.output.split())
        assert f"{given} is inside the daemon dataset {data} (its {given.relative_to(data).parts[0]}/ table)" in flat, flat
        assert f"give the dataset folder: powerprof analyze {data}" in flat, flat
        assert f"powerprof export {data} --format csv" in flat, flat
        assert "windows.parquet is missing" not in flat, flat
    # Beside a sweep's run it was "windows.parquet is missing" too: the two are analysed apart.
    sweep_run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    r = run("analyze", str(sweep_run), str(data))
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert f"{data} is a daemon dataset, not a sweep's run" in flat, flat
    assert f"analyze it on its own (powerprof analyze {data}: the per-host summary)" in flat, flat
    assert run("analyze", str(data)).exit_code == 0
    assert not (sweep_run / "analysis").exists()


def test_a_sweep_or_measure_inside_another_runs_folder_is_refused(tmp_path):
    # `sweep --out RUN/levels` or `--out RUN/analysis/x` was taken: a run inside another's folder, which goes with it
    # when that run is moved or removed, and `analyze RUN`'s report folder held another run's tables. Refused as an
    # --out inside a daemon dataset is, nothing made; beside a run (its parent folder) is fine.
    from synthetic_runs import make_run, seed_truth

    sweep_run = make_run(tmp_path / "runs" / "r1", seed_truth(), levels=(220, 300), n_requests=4)
    for out in (sweep_run / "levels", sweep_run / "analysis" / "x"):
        for cmd in (["sweep", "--limits", "180,220", "--dry-run"], ["measure"]):
            r = run(*cmd, "--simulate", "--out", str(out))
            flat = " ".join(r.output.split())
            assert r.exit_code != 0 and f"--out {out} is inside the powerprof run {sweep_run}" in flat, r.output
            assert "give a folder outside it with --out" in flat and "Traceback" not in r.output, r.output
            assert not out.exists(), r.output
    assert not (sweep_run / "analysis").exists()
    r = run("sweep", "--limits", "180,220", "--dry-run", "--simulate", "--out", str(tmp_path / "runs" / "r2"))
    assert r.exit_code == 0, r.output
    assert sim_limit_w() == 300.0


def test_output_below_a_folder_holding_a_requests_folder_of_no_tables_is_not_refused(tmp_path):
    # The review: a home or project folder holding requests/ (a clone of psf/requests, saved prompts) was taken for a
    # daemon dataset: `analyze RUN` of every run below it exited 2, a finished sweep's default analysis failed (exit
    # 1), and sweep/export --out there were refused, "inside the daemon dataset". Only tables make a dataset.
    from synthetic_runs import make_run, seed_truth

    home = tmp_path / "home"
    (home / "requests" / "requests").mkdir(parents=True)
    (home / "requests" / "requests" / "api.py").write_text("def get(url): ...\n")
    (home / "intervals").mkdir()
    sweep_run = make_run(home / "runs" / "r1", seed_truth(), levels=(220, 300), n_requests=4)
    r = run("analyze", str(sweep_run))
    assert r.exit_code == 0 and (sweep_run / "analysis" / "analysis.parquet").is_file(), r.output
    (home / "exports").mkdir()  # --out's parent: never made by export (storage.runs.missing_parent)
    r = run("export", str(sweep_run), "--format", "parquet", "--out", str(home / "exports" / "r1"))
    assert r.exit_code == 0, r.output
    r = run("sweep", "--limits", "180,220", "--dry-run", "--simulate", "--out", str(home / "runs" / "r2"))
    assert r.exit_code == 0 and "daemon dataset" not in r.output, r.output
    r = run("export", str(sweep_run / "levels.parquet"), "--format", "parquet", "--out", str(home / "levels.parquet"))
    assert r.exit_code == 0 and (home / "levels.parquet").is_file(), r.output
    r = run("analyze", str(sweep_run), "--out", str(home))
    assert r.exit_code == 0 and (home / "analysis.parquet").is_file(), r.output
    assert sim_limit_w() == 300.0


def test_a_sweep_or_measure_into_a_daemon_dataset_is_refused(tmp_path):
    # `sweep --out NODE/requests/r1` was taken: the run's windows.parquet, samples.parquet and levels.parquet lay among
    # the request files, and `analyze NODE` read their rows as requests (windows share request_id, gpu_energy_j, ...),
    # unsaid. Anywhere in a dataset the same (a folder beside its tables is read as one more table by `export`).
    from test_fleet import _node

    _node(tmp_path / "node-0", 0)
    for out in (tmp_path / "node-0" / "requests" / "r1", tmp_path / "node-0" / "r1"):
        for cmd in (["sweep", "--limits", "180,220", "--dry-run"], ["measure"]):
            r = run(*cmd, "--simulate", "--out", str(out))
            flat = " ".join(r.output.split())
            assert r.exit_code != 0 and f"--out {out} is inside the daemon dataset {tmp_path / 'node-0'}" in flat, r.output
            assert "Traceback" not in r.output and not out.exists(), r.output
    assert sim_limit_w() == 300.0


def test_a_fifo_named_run_json_above_the_out_folder_is_no_run_and_no_hang(tmp_path):
    # `sweep`/`measure --out D/x` hung for ever where D held a FIFO named run.json (anyone can make /tmp/run.json):
    # the check for a run above --out opened it blocking, waiting for a writer that never came.
    import os
    import subprocess
    import sys

    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / "run.json")
    for cmd in (["sweep", "--limits", "180,220", "--dry-run"], ["measure", "--requests", "2"]):
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", *cmd, "--simulate", "--out", str(d / cmd[0])],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "inside the powerprof run" not in r.stderr, r.stderr
    assert sim_limit_w() == 300.0


def test_only_a_run_json_of_ours_in_a_folder_of_ours_above_the_out_folder_refuses_it(tmp_path):
    # Any windows.parquet in a folder above --out refused it "inside the powerprof run": after `export --format parquet
    # --out . RUN` every sweep below the working folder, and an empty one planted in /tmp every --out below /tmp. A
    # run.json of ours in a folder anyone may write to (sticky, world-writable: /tmp) or another user's is a plant too.
    import os

    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "windows.parquet").write_bytes(b"")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "run.json").write_text('{"run_id": "x", "kind": "sweep"}')
    places = [exported, shared]
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir()
        (other / "run.json").write_text('{"run_id": "x", "kind": "sweep"}')
        os.chown(other, 65534, 65534)
        places.append(other)
    for place in places:
        for cmd in (["sweep", "--limits", "180,220", "--dry-run"], ["measure", "--requests", "2"]):
            (place / "sub").mkdir(exist_ok=True)
            r = run(*cmd, "--simulate", "--out", str(place / "sub" / cmd[0]))
            assert "inside the powerprof run" not in r.output, (place, r.output)
            # As root, below another user's folder is refused for that (safety.md's trust boundaries), not as a run.
            assert r.exit_code == 0 or (place.name == "other" and "refus" in r.output), (place, r.output)
    assert sim_limit_w() == 300.0


def test_the_default_out_folder_inside_a_run_is_refused_as_a_given_one_is(tmp_path, monkeypatch):
    # `cd RUN && powerprof sweep` made RUN/runs/<stamp>: the check for a run above --out skipped the default folder.
    from synthetic_runs import make_run, seed_truth

    sweep_run = make_run(tmp_path / "r1", seed_truth(), levels=(220, 300), n_requests=4)
    monkeypatch.chdir(sweep_run)
    for cmd in (["sweep", "--limits", "180,220", "--dry-run"], ["measure", "--requests", "2"]):
        r = run(*cmd, "--simulate")
        flat = " ".join(r.output.split())
        assert r.exit_code != 0 and "the default run folder runs/" in flat, r.output
        assert f"is inside the powerprof run {sweep_run}" in flat and "give a folder outside it with --out" in flat, flat
        assert not (sweep_run / "runs").exists(), r.output
    assert sim_limit_w() == 300.0
