"""Hostile inputs from session 47's fuzzing review: what a user sees for each (one line, exit 2, nothing changed)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from powerprof.cli import main


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


# --- 1. simulated GPU counts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", ["64", "0,1000000", "99999999999999999999"])
def test_a_simulated_gpu_index_past_the_simulators_cap_is_a_usage_error(gpus):
    # `devices --simulate --gpus 1000000` built a million simulated GPUs (4.4 GB); 20 digits was an OverflowError.
    from powerprof.sim.profiles import MAX_SIM_GPUS

    r = run("devices", "--simulate", "--gpus", gpus, "--json")
    assert r.exit_code == 2, r.output
    assert f"at most {MAX_SIM_GPUS} GPUs" in r.output and "--gpus" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_highest_simulated_gpu_index_still_opens():
    r = run("devices", "--simulate", "--gpus", "63", "--json")
    assert r.exit_code == 0, r.output
    assert [g["index"] for g in json.loads(r.output)["gpus"]] == [63]


def test_the_daemons_sim_gpus_cap_is_the_same_constant():
    from powerprof.sim.profiles import MAX_SIM_GPUS

    r = run("daemon", "--simulate", "--sim-gpus", str(MAX_SIM_GPUS + 1), "--check")
    assert r.exit_code == 2 and f"1<=x<={MAX_SIM_GPUS}" in r.output, r.output


def test_the_simulator_itself_refuses_a_runaway_count():
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.profiles import MAX_SIM_GPUS

    with pytest.raises(ValueError, match=f"at most {MAX_SIM_GPUS}"):
        SimNVML(count=10**20, state_path=None)


def test_a_gpu_index_of_other_digits_is_refused_not_a_traceback():
    r = run("devices", "--simulate", "--gpus", "²")
    assert r.exit_code == 2 and "expected NVML indexes" in r.output, r.output


def test_a_daemon_configs_simulated_gpu_index_past_the_cap_is_a_config_error(tmp_path):
    from powerprof.daemon import service

    cfg = tmp_path / "d.toml"
    cfg.write_text("[daemon]\ngpus = [0, 100000000]\n")
    r = CliRunner().invoke(main, ["daemon", "--config", str(cfg), "--simulate", "--check"])
    assert r.exit_code == service.EXIT_CONFIG, (r.output, r.stderr)
    assert "daemon.gpus: GPU index 100000000 does not exist: the simulator has at most" in r.stderr



@pytest.mark.parametrize("check", [True, False])
def test_a_daemon_configs_gpu_index_past_its_given_sim_gpus_is_an_error(tmp_path, check):
    # Before: `--simulate --sim-gpus 2` with daemon.gpus = [7] built 8 simulated GPUs and measured gpu7 (the Rig took
    # max(gpus) + 1 ahead of the count given), exit 0 for --check and a daemon running on a host that is not the one
    # declared.
    from powerprof.daemon import service

    cfg = tmp_path / "d.toml"
    cfg.write_text(f"[daemon]\ngpus = [7]\ndata_dir = '{tmp_path / 'data'}'\n")
    args = ["daemon", "--config", str(cfg), "--simulate", "--sim-gpus", "2", "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--tag-socket", str(tmp_path / "t.sock")]
    r = CliRunner().invoke(main, args + (["--check"] if check else []))
    assert r.exit_code == service.EXIT_CONFIG, (r.output, r.stderr, r.exception)
    assert "daemon.gpus: GPU index 7 does not exist: this machine has 2 GPU(s) (0-1)" in r.stderr, r.stderr
    assert "Traceback" not in r.output

# --- 2a. trace --seed ------------------------------------------------------------------------------------------------


def test_a_negative_trace_seed_is_a_usage_error_and_writes_nothing(tmp_path):
    # numpy's "expected non-negative integer" ValueError came out as a traceback.
    out = tmp_path / "t.jsonl"
    r = run("trace", str(out), "--requests", "3", "--seed", "-1")
    assert r.exit_code == 2, r.output
    assert "--seed" in r.output and "-1" in r.output and ">=0" in r.output, r.output
    assert not out.exists()
    assert run("trace", str(out), "--requests", "3", "--seed", str(2**80)).exit_code == 0


# --- 2b. run.json of the wrong kinds ---------------------------------------------------------------------------------


def _sweep_run(tmp_path):
    from synthetic_runs import make_run, seed_truth

    run = make_run(tmp_path / "run", seed_truth(), levels=(180, 300), n_requests=6)
    meta = json.loads((run / "run.json").read_text())
    meta.setdefault("settings", {"level_kind": "power_limit", "levels": [300.0, 180.0], "repeats": 1})
    meta.setdefault("levels_done", [[300.0, 0], [180.0, 0]])
    meta.setdefault("idle_gpu_power_w", 21.5)
    (run / "run.json").write_text(json.dumps(meta))
    return run


def _edit(run, path, value):
    meta = json.loads((run / "run.json").read_text())
    cur = meta
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    (run / "run.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("path, value, said", [
    (["settings"], "x", "settings is a string, not an object"),
    (["settings"], [1], "settings is a list, not an object"),
    (["settings"], -1, "settings is a number"),
    (["idle_gpu_power_w"], "zz", "idle_gpu_power_w is a string, not a number"),
    (["idle_gpu_power_w"], [1], "idle_gpu_power_w is a list, not a number"),
    (["levels_done", 0, 0], [1], "levels_done[0][0] (the level) is a list, not a number"),
    (["levels_done", 0, 0], "zz", "levels_done[0][0] (the level) is a string, not a number"),
    (["levels_done", 0], 7, "levels_done[0] is a number"),
    (["settings", "levels"], [10**400, 300], "settings.levels[0] is a number too large for a float, not a number"),
    (["settings", "levels"], "300", "settings.levels is a string, not a list"),
    (["idle_gpu_power_w_by_gpu"], {"gpu0": "x"}, "idle_gpu_power_w_by_gpu.gpu0 is a string, not a number"),
    (["gpus"], [3], "gpus[0] is a number"),
])
def test_a_run_json_field_of_the_wrong_kind_is_named_and_leaves_nothing(tmp_path, path, value, said):
    # Each was a traceback (AttributeError in the report, TypeError in the timeline plot or in levels_done's
    # reading, OverflowError from settings.levels), or "could not convert string to float: 'zz'" naming no field;
    # the report's failure left an empty analysis/ folder behind.
    run = _sweep_run(tmp_path)
    assert CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md",
                                     "--out", str(tmp_path / "ok")]).exit_code == 0
    _edit(run, path, value)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{run / 'run.json'}: {said}" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (run / "analysis").exists()


def test_a_report_that_fails_removes_the_analysis_folder_it_made(tmp_path, monkeypatch):
    import powerprof.analysis.report as report

    run = _sweep_run(tmp_path)

    def boom(*a, **k):
        raise ValueError("drawing failed")

    monkeypatch.setattr(report, "_write_outputs", boom)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md"])
    assert r.exit_code != 0
    assert not (run / "analysis").exists()


@pytest.mark.parametrize("where", ["analysis", "rename"])
def test_a_failed_analysis_into_a_new_out_leaves_no_folder(tmp_path, monkeypatch, where):
    # Behaviour kept when write_outputs' own made/rmdir went (dead: _out_locked had made the folder already, and takes
    # it back): a failure in the analysis, or at a rename, leaves no empty --out behind.
    import powerprof.analysis.report as report
    from support import eio_on_replace_to

    run = _sweep_run(tmp_path)
    if where == "analysis":
        monkeypatch.setattr(report, "analyze", lambda *a, **k: (_ for _ in ()).throw(ValueError("no fit")))
    else:
        eio_on_replace_to(monkeypatch, "report.md")
    out = tmp_path / "new"
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md", "--out", str(out)])
    assert r.exit_code == 1 and ("no fit" if where == "analysis" else "cannot write") in r.output, r.output
    assert not out.exists()


def _analyzed_md_html(tmp_path):
    """A sweep run analysed once into an md+html --out folder: the folder, the arguments, and its files' bytes."""
    run = _sweep_run(tmp_path)
    out = tmp_path / "an"
    args = ["analyze", str(run), "--bootstrap", "100", "--format", "md,html", "--out", str(out)]
    assert CliRunner().invoke(main, args + ["--max-slowdown", "0"]).exit_code == 0
    return out, args, {p.name: p.read_bytes() for p in out.iterdir()}


def test_an_analysis_whose_write_fails_leaves_the_old_outputs_whole_and_no_temporary(tmp_path, monkeypatch):
    # A rename failing part-way (EIO on report.html) left the new report.md and analysis.parquet beside the old
    # analysis.json, and the temporaries: one folder gave two recommendations. Now the old outputs stay, all of them.
    from support import eio_on_replace_to

    out, args, before = _analyzed_md_html(tmp_path)
    assert {"analysis.json", "analysis.parquet", "report.md", "report.html"} <= set(before)
    eio_on_replace_to(monkeypatch, "report.html")
    r = CliRunner().invoke(main, args + ["--max-slowdown", "99%"])
    assert r.exit_code == 1 and "cannot write the analysis" in r.output, r.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before



def test_an_analysis_whose_write_and_put_back_both_fail_says_the_folder_is_mixed(tmp_path, monkeypatch):
    # report.html's rename failed and putting the old report.md back failed too: "cannot write the analysis to OUT:
    # Input/output error (OUT/report.html)", and the new report.md stayed beside the old analysis.json unsaid.
    import errno
    import os

    import powerprof.storage.atomic as atomic

    out, args, before = _analyzed_md_html(tmp_path)
    real, into = os.replace, []

    def replace(src, dst):
        into.append(os.path.basename(dst))
        if into[-1] == "report.html" or into[-1] == "report.md" and into.count("report.md") == 2:
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    r = CliRunner().invoke(main, args + ["--max-slowdown", "99%"])
    assert r.exit_code == 1 and "cannot write the analysis" in r.output, r.output
    said = " ".join(r.output.split())
    assert f"{out} is now MIXED" in said and f"new: {out / 'report.md'}" in said and "Fix:" in said, r.output
    after = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith(".")}
    assert set(after) == set(before) and after["report.md"] != before["report.md"]  # nothing else deleted
    assert all(after[n] == before[n] for n in after if n != "report.md")



@pytest.mark.parametrize("command", [["analyze"], ["export", "--format", "csv"]])
@pytest.mark.parametrize("links", [1, 2])
def test_a_source_that_is_a_loop_of_symlinks_is_said_not_a_traceback(tmp_path, monkeypatch, command, links):
    # "RuntimeError: Symlink loop from ..." out of Path.resolve() (fleet.expand_sources, export.expand), exit 1.
    monkeypatch.chdir(tmp_path)
    names = [f"loop{i}" for i in range(links)]
    for i, name in enumerate(names):
        (tmp_path / name).symlink_to(names[(i + 1) % links])
    r = CliRunner().invoke(main, [*command, "loop0"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "loop0: a loop of symlinks" in r.output and "Traceback" not in r.output, r.output


# --- 4. the tag header -------------------------------------------------------------------------------------------------


BAD_TAG_HEADERS = ["", "Bad Header", "X-Tag\nX-Evil: 1", "X:Tag", "Tägg", "x" * 129,
                   "Authorization", "host", "Content-Length", "Transfer-Encoding", "Connection", "Proxy-Authorization",
                   "Cookie", "content-type"]


@pytest.mark.parametrize("name", BAD_TAG_HEADERS)
def test_replay_refuses_a_tag_header_no_server_should_get(tmp_path, name):
    # '' and 'Bad Header' were aiohttp tracebacks, a newline "Potential header injection attack"; Authorization and
    # Host were taken (the tag then replaced the API key, or made a second Host).
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t_s": 0, "prompt_tokens": 8, "output_tokens": 2, "tag": "a"}\n')
    r = run("replay", str(trace), "--simulate", "--tag-header", name)
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert "--tag-header" in line and "X-Powerprof-Tag" in line, r.output
    assert "Traceback" not in r.output and "\nX-Evil" not in r.output


@pytest.mark.parametrize("name", BAD_TAG_HEADERS)
def test_the_daemons_tag_header_is_checked_by_the_same_rule(tmp_path, name):
    from powerprof.daemon.config import ConfigError, load_config
    from powerprof.workload.auth import check_tag_header

    with pytest.raises(ValueError) as same:
        check_tag_header(name)
    p = tmp_path / "d.toml"
    p.write_text(f"[proxy]\ntag_header = {json.dumps(name)}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, env={})
    assert "proxy.tag_header" in str(e.value) and str(same.value) in str(e.value)


@pytest.mark.parametrize("name", ["X-Powerprof-Tag", "x-team", "X_Job.1", "Tag~!#$%&'*+^`|"])
def test_a_header_token_of_its_own_is_a_tag_header(name):
    from powerprof.workload.auth import check_tag_header

    assert check_tag_header(name) == name


# --- 5. a prompt that is no Unicode text -------------------------------------------------------------------------------


@pytest.mark.parametrize("line", ['{"prompt": "a\\u0000b\\ud800"}', '{"prompt": "ok", "id": "\\udc00x"}'])
def test_a_prompt_with_a_lone_surrogate_is_refused_at_load_naming_the_line(tmp_path, line):
    # It passed validation and failed later with an unnamed UnicodeEncodeError (and simulated-server tracebacks).
    from powerprof.workload.load import PromptFileError, load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptFileError, match=f"{f}:2: .*lone surrogate"):
        load_prompts(f)
    r = run("measure", "--simulate", "--prompts", str(f), "--requests", "2")
    assert r.exit_code == 2 and f"{f}:2:" in r.output and "Traceback" not in r.output, r.output


def test_a_trace_tag_with_a_lone_surrogate_is_refused_at_load(tmp_path):
    from powerprof.workload.trace import TraceError, read_trace

    f = tmp_path / "t.jsonl"
    f.write_text('{"t_s": 0, "prompt_tokens": 8, "output_tokens": 2, "tag": "a\\ud800"}\n')
    with pytest.raises(TraceError, match="lone surrogate"):
        read_trace(f)


# --- 6. concurrency -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["100000", "1,100000", "1025"])
def test_measure_caps_concurrency_as_sweep_does(value):
    # `measure --concurrency 100000` was accepted and hung; sweep caps at 1024.
    from powerprof.cli import MAX_CONCURRENCY

    r = run("measure", "--simulate", "--concurrency", value, "--requests", "1")
    assert r.exit_code == 2, r.output
    assert f"at most {MAX_CONCURRENCY}" in r.output and "--concurrency" in r.output, r.output
    r = run("sweep", "--simulate", "--limits", "300", "--concurrency", str(MAX_CONCURRENCY + 1), "--dry-run")
    assert r.exit_code == 2 and f"1<=x<={MAX_CONCURRENCY}" in r.output, r.output


# --- 7. the API key -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key, said", [
    ("ab\ncd", "a line break"), ("ab\rcd", "a line break"), ("ab\x1bcd", "a control character"),
    ("ab\x7fcd", "a control character"), ("klé", "a character that is not ASCII"), ("k" * 100_000, "100000 characters"),
])
def test_an_api_key_no_header_can_carry_is_named_before_any_request(monkeypatch, key, said):
    # `\n` or `\r` was aiohttp's "Potential header injection attack" naming no variable; 100,000 characters the server's
    # refusal, read as "neither llama.cpp nor OpenAI-compatible".
    from powerprof.workload.auth import ApiKeyError, auth_headers

    monkeypatch.setenv("POWERPROF_API_KEY", key)
    with pytest.raises(ApiKeyError) as e:
        auth_headers()
    assert "POWERPROF_API_KEY" in str(e.value) and said in str(e.value), str(e.value)
    assert "abcd" not in str(e.value).replace("\n", "").replace("\r", "") and "kkkkkkkk" not in str(e.value)  # a secret
    for args in (["measure", "--simulate", "--requests", "1"], ["sweep", "--simulate", "--limits", "300"]):
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines()[-1].startswith("Error: POWERPROF_API_KEY"), r.output


def test_a_good_api_key_is_sent_as_it_was(monkeypatch):
    from powerprof.workload.auth import auth_headers

    monkeypatch.setenv("POWERPROF_API_KEY", "  sk-abc_DEF.123/+=  ")
    assert auth_headers() == {"Authorization": "Bearer sk-abc_DEF.123/+="}
    monkeypatch.setenv("POWERPROF_API_KEY", "k" * 4096)
    assert len(auth_headers()["Authorization"]) == 4096 + 7


# --- 8. --max-slowdown: a percentage or a fraction, never a guess ---------------------------------------------------------


@pytest.mark.parametrize("text, hint", [("1", "1%"), ("1.5", "1.5%"), ("5", "5%"), ("1e9", "1e9%"), ("50", "50%")])
def test_a_bare_number_of_one_or_more_is_refused_with_the_percent_it_may_mean(text, hint):
    # A bare number above 1 was read as a percent, at or below 1 as a fraction: `1` was refused ("got 1"), `1.5` taken
    # as 1.5%, `0.5` as 50%; `1e9` said "got 1e+07".
    r = run("sweep", "--simulate", "--limits", "300", "--dry-run", "--max-slowdown", text)
    assert r.exit_code == 2, r.output
    line = next(x for x in r.output.splitlines() if "max-slowdown" in x)
    assert f"'{text}'" in line and f"write {hint}" in line and "e+" not in line, line


@pytest.mark.parametrize("text, want", [("10%", 0.10), ("0.5", 0.5), ("0", 0.0), ("1.5%", 0.015), (" 5 % ", 0.05)])
def test_a_percentage_or_a_fraction_below_one_is_taken(text, want):
    import click

    from powerprof.cli import _max_slowdown_option

    assert _max_slowdown_option(None, None, text) == pytest.approx(want)
    with pytest.raises(click.BadParameter, match="'150%'"):
        _max_slowdown_option(None, None, "150%")
    with pytest.raises(click.BadParameter, match="'nan'"):
        _max_slowdown_option(None, None, "nan")


def test_max_slowdown_help_says_the_rule():
    r = run("sweep", "--help")
    assert "a bare number is a fraction below 1" in " ".join(r.output.split())


# --- 9. a sweep cut short: planned levels never measured, a window without energy ------------------------------------


def _findings(run):
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--format", "md", "--json"])
    assert r.exit_code == 0, r.output
    return {f["kind"]: f["message"] for f in json.loads(r.output)["warnings"]}


def test_planned_levels_a_killed_sweep_never_measured_are_named(tmp_path):
    # A kill -9'd sweep (run.json settings.levels 300,260,220,180,150, windows at 300,220,180) was analysed as if
    # 260 and 150 W had never been asked for.
    from synthetic_runs import make_run, seed_truth

    run = make_run(tmp_path / "run", seed_truth(), levels=(180, 220, 300), n_requests=6)
    meta = json.loads((run / "run.json").read_text())
    meta["settings"] = {"level_kind": "power_limit", "levels": [300.0, 260.0, 220.0, 180.0, 150.0], "repeats": 1}
    meta["levels_done"] = [[300.0, 0], [220.0, 0], [180.0, 0]]
    (run / "run.json").write_text(json.dumps(meta))
    said = _findings(run)
    assert "unmeasured-levels" in said, said
    assert "260 W, 150 W" in said["unmeasured-levels"] and "planned" in said["unmeasured-levels"], said
    meta["settings"]["levels"] = [300.0, 220.0, 180.0]
    (run / "run.json").write_text(json.dumps(meta))
    assert "unmeasured-levels" not in _findings(run)


def test_a_repeat_a_killed_sweep_never_measured_is_named(tmp_path):
    # `--repeats 2`, killed -9 in the second pass after 300 W: 220 and 180 W rest on one repeat, the plan said two,
    # and nothing said so (each level had some window, so none was "unmeasured").
    import pyarrow as pa
    import pyarrow.parquet as pq
    from synthetic_runs import make_run, seed_truth

    run = make_run(tmp_path / "run", seed_truth(), levels=(180, 220, 300), n_requests=4, repeats=2)
    meta = json.loads((run / "run.json").read_text())
    meta["settings"] = {"level_kind": "power_limit", "levels": [300.0, 220.0, 180.0], "repeats": 2}
    (run / "run.json").write_text(json.dumps(meta))
    assert "unmeasured-levels" not in _findings(run)  # every visit measured
    w = pq.read_table(run / "windows.parquet")
    kept = [r for r in w.to_pylist() if not (r["repeat"] == 1 and r["level_value"] in (220.0, 180.0))]
    pq.write_table(pa.Table.from_pylist(kept, schema=w.schema), run / "windows.parquet")
    said = _findings(run)["unmeasured-levels"]
    assert "2 planned visits of measured levels have no measured window (220 W, repeat 2 of 2; 180 W, repeat 2 of 2)" \
        in said, said
    assert "planned (run.json settings.levels)" not in said  # no level is wholly unmeasured


def test_a_configuration_a_killed_grid_never_measured_is_named(tmp_path):
    # A grid of draft=1,2,3 killed -9 in draft=2's second level: draft=2 at 220 W and all of draft=3 were never
    # measured, and run.json listed only the configurations begun, so nothing said so.
    import pyarrow as pa
    import pyarrow.parquet as pq
    from synthetic_runs import make_grid_run, seed_truth

    run = make_grid_run(tmp_path / "run", {1: seed_truth(), 2: seed_truth()}, levels=(220, 300), n_requests=4)
    meta = json.loads((run / "run.json").read_text())
    meta["settings"] = {"level_kind": "power_limit", "levels": [300.0, 220.0], "repeats": 1}
    meta["configs_planned"] = [["draft=1", None], ["draft=2", None], ["draft=3", None]]
    (run / "run.json").write_text(json.dumps(meta))
    w = pq.read_table(run / "windows.parquet")
    kept = [r for r in w.to_pylist() if not (r["config_id"] == "draft=2" and r["level_value"] == 220.0)]
    pq.write_table(pa.Table.from_pylist(kept, schema=w.schema), run / "windows.parquet")
    said = _findings(run)["unmeasured-levels"]
    assert "(draft=2 at 220 W; draft=3 at 300 W; draft=3 at 220 W)" in said, said
    meta["configs"] = [{"config_id": "draft=3", "context_tokens": None, "status": "out-of-memory"}]
    (run / "run.json").write_text(json.dumps(meta))
    said = _findings(run)["unmeasured-levels"]  # draft=3 did not fit: config-not-measured's, not said twice
    assert "(draft=2 at 220 W)" in said and "draft=3" not in said, said


def test_a_measured_window_without_energy_is_said_not_dropped_silently(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from synthetic_runs import make_run, seed_truth

    run = make_run(tmp_path / "run", seed_truth(), levels=(180, 220, 300), n_requests=6)
    w = pq.read_table(run / "windows.parquet")
    rows = w.to_pylist()
    i = next(i for i, r in enumerate(rows) if not r["warmup"] and r["status"] == "ok" and r["level_value"] == 220)
    rows[i]["gpu_energy_j"] = rows[i]["gpu_j_per_token"] = float("nan")
    pq.write_table(pa.Table.from_pylist(rows, schema=w.schema), run / "windows.parquet")
    said = _findings(run)
    assert "no-energy" in said and "1 of" in said["no-energy"] and "220 W: 1" in said["no-energy"], said
