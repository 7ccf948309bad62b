"""Hostile inputs on surfaces the other batteries leave (hostile4): what a user sees for each."""

from __future__ import annotations

import pytest

from powerprof.daemon.tagapi import check_name


@pytest.mark.parametrize("name, said", [
    ("b" * 5000, "'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb…' (5000 characters)"),
    ("=cmd|' /C calc'!A0", "\"=cmd|' /C calc'!A0\""),
    ("日本", "'日本'"),
    ("a\nb", "'a\\nb'"),
    ("ab\n", "'ab\\n'"),  # a trailing newline passed `$`; the daemon opened "ab" where the CLI said "ab\n"
    ("é", "'é'"),
])
def test_a_refused_tag_name_is_quoted_short(name, said):
    # `powerprof tag start <5000 characters>` printed all 5000 back (and the daemon answered them in its 400).
    with pytest.raises(ValueError) as e:
        check_name(name)
    assert said in str(e.value) and len(str(e.value)) < 200, str(e.value)
    assert "must be 1-128 characters of ASCII letters, digits and _ . : @ / -" in str(e.value)


@pytest.mark.parametrize("name", ["..", ".", "a/..", "job/./1", "a//b", "/a", "a/"])
def test_a_tag_name_a_url_would_rewrite_is_refused(name):
    # A URL path's `.`, `..` and empty parts are collapsed on the way: `tag start ..` answered "404: Not Found", and a
    # window opened over raw HTTP as `a/../../b` could not be stopped from the CLI (session 46's hostile review).
    with pytest.raises(ValueError, match="must not be empty, `.` or `..`"):
        check_name(name)
    assert check_name("job/1.5/a..b") == "job/1.5/a..b"  # dots inside a part are a part's own


def test_the_tag_client_prints_a_daemons_words_as_plain_text(tmp_path, monkeypatch):
    # Root's `tag stop --socket PATH` talks to whoever listens there: an escape sequence in the answer reached the
    # terminal as it was (session 46's hostile review).
    from click.testing import CliRunner

    import powerprof.daemon.tagapi as tagapi
    from powerprof.cli import main

    answer = {"duration_s": 1.0, "gpu_energy_j": 2.0, "unproxied_energy_j": 0.0, "proxy_tokens": 10.0,
              "gpu_j_per_token": 0.2, "server_count": "complete", "energy_note": "x\x1b]0;owned\x07\nforged line",
              "open": ["a\x1b[2Jb"]}
    monkeypatch.setattr(tagapi, "send_tag", lambda sock, action, name=None: answer)
    for args in (["tag", "stop", "nightly"], ["tag", "list"]):
        r = CliRunner().invoke(main, [*args, "--socket", str(tmp_path / "s.sock")])
        assert r.exit_code == 0, r.output
        assert "\x1b" not in r.output and "\x07" not in r.output, r.output
    assert "x\\x1b]0;owned\\x07\\nforged line" in CliRunner().invoke(
        main, ["tag", "stop", "nightly", "--socket", str(tmp_path / "s.sock")]).output


def test_a_tag_client_without_socket_or_config_finds_the_shipped_units_socket(tmp_path, monkeypatch):
    # A shell has no RUNTIME_DIRECTORY: `powerprof tag list` looked in a folder of the caller's own and said no daemon
    # ran beside one that did under the shipped unit (/run/powerprof/powerprof.sock).
    from click.testing import CliRunner

    import powerprof.daemon.config as dconfig
    import powerprof.daemon.tagapi as tagapi
    from powerprof.cli import main

    unit_sock = tmp_path / "run" / "powerprof.sock"
    unit_sock.parent.mkdir()
    unit_sock.touch()
    monkeypatch.setattr(dconfig, "SYSTEMD_TAG_SOCKET", unit_sock)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    asked = []
    monkeypatch.setattr(tagapi, "send_tag", lambda sock, action, name=None: asked.append(sock) or {"open": []})
    r = CliRunner().invoke(main, ["tag", "list"])
    assert r.exit_code == 0 and r.stdout == "" and "no tag window is open" in r.stderr  # said, not on a script's stdout
    assert asked == [unit_sock]
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[daemon]\ndata_dir = "{tmp_path / "d"}"\n')
    CliRunner().invoke(main, ["tag", "list", "--config", str(cfg)])  # a config given says where: it is taken
    assert asked[-1] == tmp_path / "d" / "powerprof.sock"


@pytest.mark.parametrize("cmd", [["sweep", "--limits", "200,300", "--dry-run"], ["measure", "--requests", "2"]])
def test_max_tokens_past_any_context_is_refused_before_anything_starts(cmd):
    # --max-tokens 1000000000 (a typo) was taken: on a server that does not cut at its context (the simulator,
    # llama.cpp with context shift) the first request never ended, and the level with it (--max-time waits for the
    # round in progress), "settling" for as long as one let it. The bound is the trace's (workload/trace.py).
    from click.testing import CliRunner

    from powerprof.cli import main
    from powerprof.workload.trace import MAX_TOKENS

    r = CliRunner().invoke(main, [*cmd, "--simulate", "--max-tokens", "1000000000"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "--max-tokens" in r.output and f"{MAX_TOKENS}" in r.output, r.output


@pytest.mark.parametrize("args, said", [
    # A MemoryError traceback ("Unable to allocate 7.28 TiB"); 1e9 ran the machine out of memory first.
    (["--requests", "1000000000000"], "--requests"),
    (["--requests", "1000000000"], "--requests"),
    # Arrivals spread past any replay (1e300 s apart at 1e-300): written, then refused by replay and sweep --trace.
    (["--rate", "1e-300", "--requests", "3"], "--rate"),
    (["--rate", "1e-9", "--requests", "3"], "--rate"),
])
def test_trace_refuses_a_trace_no_replay_could_use(tmp_path, args, said):
    from click.testing import CliRunner

    from powerprof.cli import main

    out = tmp_path / "t.jsonl"
    r = CliRunner().invoke(main, ["trace", str(out), *args])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert said in r.output and "Traceback" not in r.output, r.output
    assert not out.exists()


@pytest.mark.parametrize("cmd", [["export", "SRC", "--format", "csv", "--out", "LONG"],
                                 ["export", "SRC", "--format", "xlsx", "--out", "LONG.xlsx"],
                                 ["trace", "LONG.jsonl"]])
def test_a_path_whose_name_is_too_long_is_said_not_a_traceback(tmp_path, cmd):
    # An OSError traceback ("File name too long") from Path.exists(), which raises for it.
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from powerprof.cli import main

    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"power_w": [1.0]}), src)
    long = str(tmp_path / ("x" * 300))
    args = [a.replace("LONG", long).replace("SRC", str(src)) for a in cmd]
    r = CliRunner().invoke(main, args)
    # A usage error, exit 2 (export's --out was 1, a run error).
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "File name too long" in r.output and "give a shorter name" in r.output, r.output


@pytest.mark.parametrize("cmd", [["export", "SRC", "--format", "csv", "--out", "LONG.csv"],
                                 ["export", "SRC", "--format", "xlsx", "--out", "LONG.xlsx"],
                                 ["trace", "LONG.jsonl"],
                                 ["monitor", "--simulate", "--duration", "1", "--output", "LONG.csv"]])
def test_a_file_whose_temporary_name_would_be_too_long_is_refused_before_the_work(tmp_path, cmd, monkeypatch):
    # A 240-byte name fits (255), its temporary `.NAME.PID.RANDOM.tmp` does not: export said "export to … failed,
    # nothing written: File name too long", exit 1, after reading every table; now exit 2 before, with the longest name.
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from powerprof.cli import main

    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"power_w": [1.0]}), src)
    (out := tmp_path / "out").mkdir()
    args = [a.replace("LONG", str(out / ("x" * 236))).replace("SRC", str(src)) for a in cmd]
    r = CliRunner().invoke(main, args)
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "File name too long: it is written first under a temporary name 22 bytes longer" in flat, flat
    assert "give a name of at most 233 bytes" in flat and not list(out.iterdir()), flat


def _deep_folder(base, size: int):
    """An existing folder below `base` whose absolute path is `size` bytes, made a step at a time (no path given to
    the kernel is longer than one name)."""
    import os

    parts, total = [], len(os.fsencode(str(base)))
    while size - total > 1:
        parts.append("d" * min(200, size - total - 1))
        total += 1 + len(parts[-1])
    fd = os.open(base, os.O_RDONLY)
    for name in parts:
        os.mkdir(name, dir_fd=fd)
        fd, old = os.open(name, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    os.close(fd)
    return os.path.join(str(base), *parts)


@pytest.mark.parametrize("cmd", [["export", "SRC", "--format", "xlsx", "--out", "DEEP.xlsx"],
                                 ["export", "SRC", "--format", "csv", "--out", "DEEP"],
                                 ["trace", "DEEP.jsonl"],
                                 ["monitor", "--simulate", "--duration", "1", "--output", "DEEP.csv"],
                                 ["daemon", "--check", "--data-dir", "DEEP"],
                                 ["sweep", "--simulate", "--limits", "200,300", "--idle-s", "0", "--out", "DEEP"],
                                 ["analyze", "RUN", "--out", "DEEP"],
                                 ["export", "SRC", "--format", "xlsx", "--out", "PAST.xlsx"]])
def test_an_output_path_past_path_max_is_refused_before_the_work(tmp_path, monkeypatch, cmd):
    # Each name fits (40 bytes), the whole path does not: in a folder 4040 bytes deep, what is written there (the
    # file's temporary name, a folder's files) passes Linux's PATH_MAX (4096 with the NUL). export xlsx said "export
    # to … failed, nothing written: File name too long", exit 1, after reading every table; a path already past it
    # said "give a shorter name" of no name too long. Now each is a usage error before anything is made.
    import os

    from click.testing import CliRunner
    import pyarrow as pa
    import pyarrow.parquet as pq

    from powerprof.cli import main
    from synthetic_runs import make_run, seed_truth

    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"power_w": [1.0]}), src)
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6) if "RUN" in cmd else None
    deep = _deep_folder(tmp_path / "deep", 4040) if (tmp_path / "deep").mkdir() is None else None
    args = [a.replace("DEEP", os.path.join(deep, "x" * 40)).replace("PAST", os.path.join(deep, "x" * 80))
            .replace("SRC", str(src)).replace("RUN", str(run)) for a in cmd]
    r = CliRunner().invoke(main, args)
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, flat[-600:])
    assert "path too long" in flat and "the kernel takes 4095 bytes in a path (PATH_MAX)" in flat, flat[-600:]
    assert "give a shorter name" not in flat and not os.listdir(deep), flat[-600:]


def _cli_in(tmp_path, monkeypatch, cmd, cwd):
    """`cmd` run in `cwd` (SRC: a one-column Parquet file), its exit code and flattened output."""
    from click.testing import CliRunner
    import pyarrow as pa
    import pyarrow.parquet as pq

    from powerprof.cli import main

    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    src = tmp_path / "t.parquet"
    pq.write_table(pa.table({"power_w": [1.0]}), src)
    monkeypatch.chdir(cwd)
    r = CliRunner().invoke(main, [a.replace("SRC", str(src)) for a in cmd])
    return r.exit_code, " ".join(r.output.split())


@pytest.mark.parametrize("cmd,made", [(["export", "SRC", "--format", "xlsx", "--out", "x.xlsx"], "x.xlsx"),
                                      (["export", "SRC", "--format", "csv", "--out", "c"], "c"),
                                      (["trace", "t.jsonl"], "t.jsonl"),
                                      (["monitor", "--simulate", "--duration", "1", "--output", "m.csv"], "m.csv"),
                                      (["daemon", "--check", "--data-dir", "dd"], None)])
def test_a_relative_output_in_a_deep_current_folder_is_judged_as_written(tmp_path, monkeypatch, cmd, made):
    # path_max_problem judged the absolute path (os.getcwd() + the path), but these commands write through the relative
    # one, which the kernel takes from the current folder however deep: in a folder 4000 bytes deep, export (xlsx,
    # csv), trace and monitor wrote `x.xlsx` fine before cli9, then were refused (exit 2, "path too long: 4007 bytes
    # from /"). The daemon, which writes through its data dir's absolute path, is still judged from /.
    import os

    deep = _deep_folder(tmp_path / "deep", 4000) if (tmp_path / "deep").mkdir() is None else None
    code, flat = _cli_in(tmp_path, monkeypatch, cmd, deep)
    if made is None:
        assert code == 2 and "path too long: 4003 bytes from /, and what is written there may add 128" in flat, flat
    else:
        assert code == 0 and os.path.exists(os.path.join(deep, made)), flat[-600:]


@pytest.mark.parametrize("cmd,room", [(["export", "SRC", "--format", "xlsx", "--out", "F.xlsx"], 22),
                                      (["trace", "F.jsonl"], 22),
                                      (["monitor", "--simulate", "--duration", "1", "--output", "F.csv"], 49)])
def test_a_file_output_keeps_only_the_room_its_own_writes_take(tmp_path, monkeypatch, cmd, room):
    # missing_parent kept a folder's 128 bytes below every output: a file 4007 bytes from / (its temporary name 22 bytes
    # more, 4029, within the 4095 of PATH_MAX) was refused, exit 2, "what is written there may add 128". Now a file
    # keeps its temporary name's 22 (paths.TEMP_NAME_BYTES), monitor its parts' 49 (FILE.parts/.part-….parquet.….tmp).
    import os

    deep = _deep_folder(tmp_path / "deep", 4000) if (tmp_path / "deep").mkdir() is None else None
    fits = [a.replace("F.", os.path.join(deep, "f.")) for a in cmd]
    code, flat = _cli_in(tmp_path, monkeypatch, fits, tmp_path)
    assert code == 0 and os.path.exists(fits[-1]), flat[-600:]
    ext = "." + cmd[-1].rsplit(".", 1)[1]
    past = os.path.join(deep, "p" * (4096 - room - len(deep) - 1 - len(ext)) + ext)  # with its room, 4096: one past
    assert len(os.fsencode(past)) + room == 4096
    code, flat = _cli_in(tmp_path, monkeypatch, [*cmd[:-1], past], tmp_path)
    assert code == 2 and f"what is written there may add {room};" in flat and not os.path.exists(past), flat[-600:]


def test_the_room_kept_below_an_output_holds_the_daemons_deepest_file(tmp_path):
    # paths.OUTPUT_DEPTH_BYTES is what a folder output keeps below it for PATH_MAX: the daemon's files are the deepest
    # (`intervals/date=…/part-<utc>-<pid>-<seq>.parquet`, written under a temporary name ~22 bytes longer).
    import os

    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import DatasetStore
    from powerprof.paths import OUTPUT_DEPTH_BYTES, temp_sibling

    store = DatasetStore(tmp_path / "dd", datasets(), host="node-1")
    for name in ("requests", "intervals"):
        store.append(name, [{"daemon_id": "d1", "t_start_utc": 1_768_478_400 * 10**9, "t_arrival_utc": 1_768_478_400
                             * 10**9, "t_end_utc": 1_768_478_401 * 10**9, "outcome": "ok", "generated_tokens": 10}])
    assert store.flush()
    deepest = max((os.path.relpath(os.path.join(d, f), tmp_path / "dd") for d, _, fs in os.walk(tmp_path / "dd")
                   for f in fs), key=len)
    assert deepest.startswith("intervals/date="), deepest
    pid_room = 2 * (7 - len(str(os.getpid())))  # the longest a pid may be (pid_max 4194304), in both names
    written = os.path.join(os.path.dirname(deepest), temp_sibling(deepest).name)
    assert len(os.fsencode(written)) + pid_room <= OUTPUT_DEPTH_BYTES - 20, written  # and room for a longer name


def test_the_room_a_monitor_output_keeps_holds_its_spools_deepest_file(tmp_path):
    # storage.samples.SPOOL_DEPTH_BYTES is what `monitor --output FILE` keeps beyond FILE for PATH_MAX: its parts
    # (`FILE.parts/part-NNNNNN.parquet`) written under their temporary names (paths.temp_sibling).
    import os

    from powerprof.paths import temp_sibling
    from powerprof.storage.samples import SPOOL_DEPTH_BYTES, SampleSpool, Timeline

    out = tmp_path / "m.csv"
    spool = SampleSpool(Timeline(), out)
    part = spool._part_path(0)
    spool.close()
    pid_room = 7 - len(str(os.getpid()))  # the longest a pid may be (pid_max 4194304)
    beyond = len(os.fsencode(str(temp_sibling(part)))) - len(os.fsencode(str(out)))
    assert beyond + pid_room + 1 <= SPOOL_DEPTH_BYTES, (beyond, temp_sibling(part))  # and a 7th digit of the part's


def test_tag_with_a_socket_path_too_long_for_a_socket_is_a_usage_error(tmp_path):
    # It said "cannot reach the daemon at …: OSError: AF_UNIX path too long", exit 1, as if no daemon ran.
    from click.testing import CliRunner

    from powerprof.cli import main

    r = CliRunner().invoke(main, ["tag", "start", "x", "--socket", str(tmp_path / ("s" * 120))])
    flat = " ".join(r.output.split())
    assert r.exit_code == 2 and "more than the 107 a unix socket's path may have" in flat, flat
    assert "OSError" not in flat, flat


def test_a_sweep_out_whose_name_is_too_long_says_the_fix_and_changes_nothing(tmp_path, monkeypatch):
    # It said "Error: [Errno 36] File name too long: '...'", and not that the GPU was left alone.
    import subprocess
    import sys

    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "sweep", "--simulate", "--limits", "200,300",
                        "--idle-s", "0", "--out", str(tmp_path / ("x" * 300))], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # a usage error (it was 1)
    assert "File name too long; give a shorter name" in r.stderr and "no GPU setting was changed" in r.stderr, r.stderr
    assert "[Errno" not in r.stderr


@pytest.mark.parametrize("cmd", [["measure", "--simulate", "--requests", "2", "--out", "LONG"],
                                 ["monitor", "--simulate", "--duration", "1", "--output", "LONG.parquet"],
                                 ["analyze", "RUN", "--out", "LONG"],
                                 ["analyze", "DATASET", "--out", "LONG"]])
def test_other_outputs_whose_name_is_too_long_say_the_fix(tmp_path, monkeypatch, cmd):
    # Each was an OSError traceback ("File name too long") from Path.exists() or is_dir().
    import subprocess
    import sys

    from synthetic_runs import make_run, seed_truth

    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(tmp_path / "sim.json"))
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6) if "RUN" in cmd else None
    if "DATASET" in cmd:  # a daemon's data folder: analyze's fleet summary, its own --out check (missing_parent)
        from powerprof.daemon.service import datasets
        from powerprof.daemon.store import DatasetStore

        store = DatasetStore(tmp_path / "dd", datasets(), host="node-1")
        store.append("requests", [{"daemon_id": "d1", "request_id": 1, "t_arrival_utc": 1_768_478_400 * 10**9,
                                   "t_end_utc": 1_768_478_401 * 10**9, "outcome": "ok", "generated_tokens": 10}])
        assert store.flush()
    long = str(tmp_path / ("x" * 300))
    args = [a.replace("LONG", long).replace("RUN", str(run)).replace("DATASET", str(tmp_path / "dd")) for a in cmd]
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # a usage error (measure's, analyze's were 1)
    assert "File name too long; give a shorter name" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["export", "LONG", "--format", "csv"], ["analyze", "LONG"]])
def test_a_source_whose_name_is_too_long_says_the_fix(tmp_path, cmd):
    # An OSError traceback ("File name too long") from Path.exists() / is_dir().
    from click.testing import CliRunner

    from powerprof.cli import main

    long = str(tmp_path / ("x" * 300))
    r = CliRunner().invoke(main, [a.replace("LONG", long) for a in cmd])
    assert r.exit_code in (1, 2) and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "File name too long; give a shorter name" in r.output, r.output


def test_trace_takes_a_rate_whose_span_fits_a_replay(tmp_path):
    # 1000 requests at 1.5e-6/s span about 6.7e8 s, under the 1e9 s a replay takes: refused, the message saying
    # "about 6.67e+08 s, more than a replay takes (1e+09 s)" (a check against half the bound said as the bound).
    from click.testing import CliRunner

    from powerprof.cli import main

    out = tmp_path / "t.jsonl"
    r = CliRunner().invoke(main, ["trace", str(out), "--rate", "1.5e-6", "--requests", "1000"])
    assert r.exit_code == 0, r.output
    assert out.exists()


DEEP = "[" * 200_000  # nested past Python's stack: json's and tomllib's parsers raise RecursionError, no ValueError


def _deep_restore_file(tmp_path):
    from powerprof.control.restore import RestoreError, load_record

    (tmp_path / "restore-000000000000.json").write_text(DEEP)
    with pytest.raises(RestoreError, match="not valid JSON"):
        load_record(tmp_path / "restore-000000000000.json")


def _deep_run_json(tmp_path):
    from powerprof.analysis.loading import AnalysisError, read_run_info

    (tmp_path / "run.json").write_text(DEEP)
    with pytest.raises(AnalysisError, match="run.json: not valid JSON"):
        read_run_info(tmp_path)


def _deep_run_json_no_level(tmp_path):
    from powerprof.storage.runs import no_finished_level

    (tmp_path / "run.json").write_text(DEEP)
    assert no_finished_level(tmp_path) is None  # no sweep's run.json: as one not valid JSON


def _deep_daemon_config(tmp_path):
    from powerprof.daemon.config import ConfigError, load_config

    (tmp_path / "c.toml").write_text("a = " + DEEP)
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(tmp_path / "c.toml", env={})


def _deep_tuner_table(tmp_path):
    from powerprof.tuner.setup import TunerConfigError, load_table

    (tmp_path / "t.toml").write_text("[tuner]\na = " + DEEP)
    with pytest.raises(TunerConfigError, match="not valid TOML"):
        load_table(tmp_path / "t.toml")


def _deep_run_json_above_out(tmp_path):
    from powerprof.paths import is_powerprof_run

    (tmp_path / "run.json").write_text(DEEP)
    assert not is_powerprof_run(tmp_path)  # no run of ours above `--out`, as a run.json not valid JSON


def _deep_sim_state_file(tmp_path, caplog):
    from powerprof.sim.nvml import _StateFile

    (tmp_path / "sim.json").write_text(DEEP)
    assert _StateFile(tmp_path / "sim.json").load() == {}
    assert "not valid JSON (nested deeper than Python's parser goes)" in caplog.text, caplog.text


def _deep_prompts_file(tmp_path):
    from powerprof.workload.load import PromptFileError, load_prompts

    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n' + DEEP + "\n")
    with pytest.raises(PromptFileError, match=r"p.jsonl:2: not valid JSON \(nested deeper than Python's parser goes\)"):
        load_prompts(tmp_path / "p.jsonl")


def _deep_analysis_json(tmp_path):
    from powerprof.analysis.report import outputs_disagree, unread_outputs_disagree

    (tmp_path / "analysis.json").write_text(DEEP)
    notes: list[str] = []
    assert outputs_disagree(tmp_path, notes=notes) is None and unread_outputs_disagree(tmp_path) == []
    assert notes == [f"{tmp_path}/analysis.json could not be read (not valid JSON (nested deeper than Python's parser "
                     "goes)), so whether it and the other analysis table there are of one analysis was not checked"]


def _deep_analysis_json_in_out(tmp_path):
    from types import SimpleNamespace

    from powerprof.analysis.report import AnalysisOutTaken, _earlier_outputs, check_out

    out = tmp_path / "out"
    out.mkdir()
    (out / "analysis.json").write_text(DEEP)
    with pytest.raises(AnalysisOutTaken, match="files that are no powerprof analysis"):  # as one not valid JSON
        check_out(out, [SimpleNamespace(run_id="r1", path=tmp_path / "r1")])
    assert _earlier_outputs(out) == []  # none proven an earlier analysis': nothing removed


def _deep_run_json_as_out(tmp_path):
    from types import SimpleNamespace

    from powerprof.analysis.report import AnalysisOutTaken, check_out

    (tmp_path / "run.json").write_text(DEEP)
    with pytest.raises(AnalysisOutTaken, match=r"the run directory of another run \(unknown\)"):
        check_out(tmp_path, [SimpleNamespace(run_id="r1", path=tmp_path / "r1")])


@pytest.mark.parametrize("reader", [_deep_restore_file, _deep_run_json, _deep_run_json_no_level, _deep_daemon_config,
                                    _deep_tuner_table, _deep_run_json_above_out, _deep_sim_state_file,
                                    _deep_prompts_file, _deep_analysis_json, _deep_analysis_json_in_out,
                                    _deep_run_json_as_out])
def test_a_file_nested_past_pythons_stack_is_said_damaged_not_a_traceback(tmp_path, reader, caplog):
    # The readers caught ValueError only: 200,000 `[` was a RecursionError traceback (`restore`, `devices`, `sweep` on
    # such a restore file; `analyze` on such a run.json; the daemon exited 1, not its config error's 2; `sweep` and
    # `measure` on such a run.json in a folder above --out, on such a simulator state file or --prompts file; `export`
    # of a run, local or remote, on such an analysis.json: report._ids, its mix check; `analyze --out` a folder
    # holding such an analysis.json or run.json: check_out, _earlier_outputs, its run_id).
    import inspect

    reader(tmp_path, caplog) if "caplog" in inspect.signature(reader).parameters else reader(tmp_path)


def test_the_daemon_says_a_config_nested_past_pythons_stack_as_a_config_error(tmp_path):
    from click.testing import CliRunner

    from powerprof.cli import main

    (tmp_path / "c.toml").write_text("a = " + DEEP)
    r = CliRunner().invoke(main, ["daemon", "--config", str(tmp_path / "c.toml"), "--simulate"])
    assert r.exit_code == 2 and "is not valid TOML" in r.output and "Traceback" not in r.output, (r.output, r.exception)


def _one_request_peer(path, answer):
    """A peer on a Unix socket that reads one request's head, has `answer(connection)` answer it, then closes (the
    connection and the socket); its thread."""
    import socket
    import threading

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve():
        c, _ = srv.accept()
        with c:
            data = b""
            while b"\r\n\r\n" not in data and (d := c.recv(65536)):
                data += d
            answer(c)
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _trickling_daemon(path, where: str, every_s: float, for_s: float):
    """A peer on a Unix socket that answers a request's head with a status line, then one header line (`where` =
    "head") or one body byte ("body") every `every_s`, for `for_s` in all, then closes: a hung or hostile daemon."""
    import time

    def trickle(c):
        c.sendall(b"HTTP/1.1 200 OK\r\n" if where == "head" else
                  b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{")
        end = time.monotonic() + for_s
        while time.monotonic() < end:
            time.sleep(every_s)
            try:
                c.sendall(b"X-A: b\r\n" if where == "head" else b" ")
            except OSError:
                return  # the client gave up: what it should do

    return _one_request_peer(path, trickle)


@pytest.mark.parametrize("where", ["head", "body"])
def test_a_daemon_that_trickles_its_answer_is_given_up_on_at_the_timeout_in_all(tmp_path, where):
    # The timeout bounded each read only: a peer sending a byte every 4 s kept `powerprof tag` waiting for ever
    # (session 58's hostile review; aiohttp's client had stopped after its 10 s in all). Here 1 s in all, a byte every
    # 0.2 s, and a peer that would go on for 6 s.
    import time

    from powerprof.daemon.tagapi import TagApiError, send_tag

    sock = tmp_path / "trickle.sock"
    _trickling_daemon(sock, where, every_s=0.2, for_s=6)
    t0 = time.monotonic()
    with pytest.raises(TagApiError):
        send_tag(sock, "list", timeout_s=1)
    assert time.monotonic() - t0 < 3, time.monotonic() - t0


def _answering_daemon(path, raw: bytes):
    """A peer on a Unix socket that answers one request with `raw`, then closes."""
    _one_request_peer(path, lambda c: c.sendall(raw))


@pytest.mark.parametrize("status, body", [(200, b'"x"'), (404, b"[1,2]"), (200, b"[]")])
def test_a_json_answer_that_is_not_an_object_is_said_not_a_traceback(tmp_path, status, body):
    # A peer answering JSON that is not an object (a string, a list) gave an AttributeError traceback
    # ('str' object has no attribute 'get'), before and after the http.client change.
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "odd.sock"
    _answering_daemon(sock, b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                      % (status, len(body), body))
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(sock)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    assert "not a JSON object" in said and "not a powerprof daemon?" in said and "Traceback" not in said, said


_STOP_DOC = (b'{"duration_s": 12.5, "gpu_energy_j": 4321.0, "cpu_energy_j": 100.0, "unproxied_energy_j": 0.0, '
             b'"proxy_tokens": 1000, "gpu_j_per_token": 4.321, "server_count": "complete", "energy_note": null, '
             b'"note": null}')
_LIST_DOC = ('{"open": [%s]}' % ", ".join('"nightly-batch-%03d"' % i for i in range(40))).encode()


@pytest.mark.parametrize("command, raw, seen", [
    (["list", "--json"], b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
     b"Connection: close\r\n\r\n%s" % (len(_LIST_DOC), _LIST_DOC[:300]),
     f"its answer ended after 300 bytes, {len(_LIST_DOC) - 300} more said to come"),
    (["stop", "x"], b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
     % (len(_STOP_DOC), _STOP_DOC[:120]), f"its answer ended after 120 bytes, {len(_STOP_DOC) - 120} more said to come"),
    (["stop", "x"], b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"78\r\n%s\r\n" % _STOP_DOC[:120], "its answer ended after 120 bytes, before its last chunk"),
])
def test_a_200_answer_cut_short_is_said_as_cut_never_taken_as_success(tmp_path, command, raw, seen):
    # Since the 1 MiB bound (e78a9141) the answer was read as r.read(ANSWER_MAX_BYTES + 1), and http.client's bounded
    # read of a Content-Length answer returns what came without raising IncompleteRead: a peer that sent 200 with
    # Content-Length 850 and 300 bytes, then closed, made `tag list --json` print {"open": []} and `tag stop` print
    # "unknown s, GPU unknown J", both exit 0 (before e78a9141: exit 1). A chunked one cut off was said as
    # "None more said to come".
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "cut.sock"
    _answering_daemon(sock, raw)
    r = CliRunner().invoke(main, ["tag", *command, "--socket", str(sock)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), (repr(r.exception), said)
    assert f"the peer at {sock}" in said and seen in said and "None" not in said and "Traceback" not in said, said
    assert "unknown s" not in said and '"open": []' not in said, said


@pytest.mark.parametrize("body", [b"", b"<html>ok</html>", b'{"open": ['])
def test_a_200_answer_that_is_not_json_is_an_error_never_success(tmp_path, body):
    # A 200 whose body was not JSON was taken as {"error": body} and returned as the daemon's answer: `tag stop` printed
    # "unknown s, GPU unknown J" and `tag list` an empty list, exit 0.
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "html.sock"
    _answering_daemon(sock, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    r = CliRunner().invoke(main, ["tag", "stop", "x", "--socket", str(sock)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), (repr(r.exception), said)
    assert f"the peer at {sock} answered HTTP 200" in said and "not JSON" in said, said
    assert "not a powerprof daemon?" in said and "unknown s" not in said and "Traceback" not in said, said


def _flooding_daemon(path, length: bool, total_bytes: int):
    """A peer on a Unix socket that answers 200 with `total_bytes` of body (said in Content-Length where `length`,
    else read to its close), sent as fast as the client takes it, until the client leaves."""

    def flood(c):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                  + (b"Content-Length: %d\r\n" % total_bytes if length else b"Connection: close\r\n") + b"\r\n")
        block = b" " * 65536
        try:
            for _ in range(total_bytes // len(block)):
                c.sendall(block)
        except OSError:
            return  # the client gave up: what it should do

    return _one_request_peer(path, flood)


@pytest.mark.parametrize("length", [True, False])
def test_an_answer_over_1_mib_is_refused_at_1_mib_never_read_whole(tmp_path, monkeypatch, length):
    # Before: the client read an answer of any size whole (r.read()): a peer on the socket sending without end held
    # `powerprof tag` until its timeout and took the memory of all it sent (335 MiB in 1 s here, 10 s by default),
    # then said it "did not accept the connection"; one with a 3 MiB Content-Length was read whole and exited 0.
    import time

    from click.testing import CliRunner

    from powerprof.cli import main
    from powerprof.daemon import tagapi

    monkeypatch.setattr(tagapi, "TAG_TIMEOUT_S", 3.0)
    sock = tmp_path / "flood.sock"
    t = _flooding_daemon(sock, length, (3 << 20) if length else (64 << 30))
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(sock)])
    took_s = time.monotonic() - t0
    t.join(10)
    assert not t.is_alive(), "the client kept the socket open after giving up: the peer still sends"
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    assert "an answer over 1 MiB" in said and str(sock) in said and "not a powerprof daemon?" in said, said[:500]
    assert len(said) < 1000 and took_s < 2.5, (len(said), took_s)


@pytest.mark.parametrize("raw, seen", [
    (b"SSH-2.0-OpenSSH_9.6\r\n", "'SSH-2.0-OpenSSH_9.6\\r\\n'"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "not an HTTP status line"),
    (b"HTTP/2.0 200 OK\r\n\r\n", "'HTTP/2.0'"),
    (b"x" * 70000 + b"\r\n", "a status line over 64 KiB"),
])
def test_a_peer_that_does_not_speak_http_is_said_in_plain_words(tmp_path, raw, seen):
    # Before: http.client's own words, "cannot reach the daemon at …: BadStatusLine: SSH-2.0-OpenSSH_9.6" (and
    # UnknownProtocol, LineTooLong): neither that the peer is not a powerprof daemon nor what to give instead.
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "other.sock"
    _answering_daemon(sock, raw)
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(sock)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    assert f"the peer at {sock} did not answer as a powerprof daemon" in said and seen in said, said
    assert "give the daemon's tag socket" in said and "BadStatusLine" not in said and "Traceback" not in said, said
    assert len(said) < 600, said


def test_a_peer_that_closes_without_answering_is_said_in_plain_words(tmp_path):
    # Before: "cannot reach the daemon at …: RemoteDisconnected: Remote end closed connection without response".
    from click.testing import CliRunner

    from powerprof.cli import main

    sock = tmp_path / "mute.sock"
    _answering_daemon(sock, b"")
    r = CliRunner().invoke(main, ["tag", "list", "--socket", str(sock)])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and (r.exception is None or isinstance(r.exception, SystemExit)), repr(r.exception)
    assert f"the peer at {sock} closed the connection without answering" in said, said
    assert "RemoteDisconnected" not in said, said


def test_tag_with_a_short_relative_socket_in_a_deep_folder_is_not_refused_for_its_length(tmp_path, monkeypatch):
    # connect() takes the path as given (the kernel resolves it from the current folder): `--socket t.sock` from a folder
    # whose absolute path is past 107 bytes reaches a daemon listening there. Measured absolute, it was refused (exit 2,
    # "no daemon's socket can be there") beside a daemon that was.
    from click.testing import CliRunner

    from powerprof.cli import main

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    r = CliRunner().invoke(main, ["tag", "start", "x", "--socket", "t.sock"])
    flat = " ".join(r.output.split())
    assert "a unix socket's path may have" not in flat, flat
    assert "t.sock" in flat, flat  # no daemon there: said so, naming the socket
