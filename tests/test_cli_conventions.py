"""What a new user meets first (issue 15, items 1 and 2): advice that names flags the command accepts,
labels that match the code, -h everywhere, --json where scripts need it, help on every option, one
default per shared option, exit status that says "nothing to measure", every config error at once."""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

import click
import pyarrow as pa
import pynvml
import pytest
from click.testing import CliRunner

from powerprof.analysis.checks import level_findings
from powerprof.cli import DEFAULT_MAX_TOKENS, EXIT_NO_DEVICE, PROMPT_SET_NAMES, main
from powerprof.daemon.config import ConfigError, load_config
from powerprof.storage.schema import LEVELS


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


def _commands(group: click.Group = main, prefix: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def _levels(**row) -> pa.Table:
    base = {"level_kind": "power_limit", "level_value": 200.0, "n_requests": 20, "ci_reached_pct": 4.0,
            "flags": "wide-ci", "stop_rule": "max-time"}
    base.update(row)
    return pa.Table.from_pylist([base], schema=LEVELS)


# --- item 1: wrong advice and labels -----------------------------------------------------------


def test_few_prompts_advice_names_prompt_sets_that_sweep_accepts(tmp_path):
    (f,) = [f for f in level_findings(_levels(n_prompts=4), target_ci_pct=2.0, max_time_s=60.0)
            if f.kind == "few-prompts"]
    for value in re.findall(r"--prompt-set (\w+)", f.message):
        r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "200", "--dry-run", "--prompt-set", value,
                                      "--out", str(tmp_path / "x")])
        assert r.exit_code == 0, (value, r.output)


def test_prompt_set_choices_are_the_built_in_sets():
    from powerprof.workload.load import PROMPT_SETS

    assert PROMPT_SET_NAMES == tuple(PROMPT_SETS)


def test_weighted_policy_is_described_as_the_code_computes_it():
    from powerprof.analysis.sweetspot import DESCRIPTIONS, PolicyParams, policy_index
    import numpy as np

    # P_max/T (time per token priced at P_max) picks level 0 here; P_max·T would pick level 1.
    t, e = np.array([10.0, 1.0]), np.array([2.0, 1.5])
    assert int(policy_index("weighted", t, e, 0, PolicyParams(eta=0.5, p_max_w=10.0))) == 0
    assert "P_max/T" in DESCRIPTIONS["weighted"] and "P_max·T" not in DESCRIPTIONS["weighted"]
    assert "Pmax/T" in run("analyze", "-h").output


def test_max_requests_help_says_a_level_ends_on_a_whole_round():
    # `sweep --max-requests 2` on the 4 built-in prompts measures 4 (stop_rule max-requests): the help said
    # "at most", the sweep rounds up to a round so every level measures the same prompts.
    from powerprof.sweep import Sweep, SweepSettings

    sweep = Sweep.__new__(Sweep)
    sweep.s, sweep.prompts = SweepSettings("power_limit", (300.0,), max_requests=2, min_requests=2), [1, 2, 3, 4]
    assert sweep.round_size() == 4
    assert "rounded up to whole rounds" in " ".join(run("sweep", "-h").output.split())


def test_cap_not_engaged_does_not_claim_the_levels_measure_the_same_thing():
    rows = [{"level_kind": "power_limit", "level_value": v, "n_requests": 5, "flags": "cap-not-engaged",
             "cap_not_engaged": True, "avg_gpu_power_w": p} for v, p in ((300.0, 250.0), (280.0, 262.0))]
    (f,) = [f for f in level_findings(pa.Table.from_pylist(rows, schema=LEVELS)) if f.kind == "cap-not-engaged"]
    assert "measure the same thing" not in f.message
    assert "not the limit's effect" in f.message and "--clocks" in f.message


def test_cap_not_engaged_at_a_lone_level_speaks_of_no_other_levels():
    # `sweep --limits 300` read "what differs between these levels ... is not the limit's effect".
    rows = [{"level_kind": "power_limit", "level_value": 300.0, "n_requests": 5, "flags": "cap-not-engaged",
             "cap_not_engaged": True, "avg_gpu_power_w": 274.0}]
    (f,) = [f for f in level_findings(pa.Table.from_pylist(rows, schema=LEVELS)) if f.kind == "cap-not-engaged"]
    assert "these levels" not in f.message and "not this limit's" in f.message and "--clocks" in f.message


def test_a_fit_short_of_levels_counts_them_in_english():
    from powerprof.analysis.fits import fit_series
    import numpy as np

    fits = fit_series("power_limit", np.array([300.0]), np.array([85.0]), np.array([274.0]))
    assert fits["decode_tok_s"].message.startswith("1 level: the ") and "1 levels" not in fits["decode_tok_s"].message


def test_daemon_check_names_the_flags_as_typed(tmp_path):
    r = run("daemon", "--check", "--data-dir", str(tmp_path), "--flush-interval", "5")
    assert r.exit_code == 0, r.output
    assert "--data-dir" in r.output and "--flush-interval" in r.output
    assert "--data_dir" not in r.output and "--flush_interval" not in r.output


def test_daemon_check_refuses_a_data_dir_it_could_not_make_or_write(tmp_path, monkeypatch):
    # Before: each of these said "config OK" (exit 0); the daemon then stopped at start (a missing parent) or at its
    # first write. Now exit 2 at --check, naming why and the fix, and nothing made.
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes through any mode bits: this user is denied that folder as another would be
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(ro) else real(p, mode, **kw))
    cases = [(tmp_path / "no" / "such" / "x", f"its parent folder {tmp_path / 'no' / 'such'} does not exist"),
             (tmp_path / ("n" * 300), "File name too long; give a shorter name"),
             (ro / "x", f"{ro}, where the data dir would be made, is not writable by"),
             (ro, "the data dir is not writable by")]
    for data_dir, said in cases:
        r = run("daemon", "--check", "--data-dir", str(data_dir))
        flat = " ".join(r.output.split())
        assert r.exit_code == 2 and said in flat and "config OK" not in flat, (data_dir, r.output)
    assert not (tmp_path / "no").exists() and not list(ro.iterdir())


@pytest.mark.parametrize("euid", [0, 1000])
def test_daemon_check_as_root_says_its_writability_is_roots(tmp_path, monkeypatch, euid):
    # As root, --check judged the data dir writable by root's os.access, who writes through any mode: "config OK" and
    # nothing else, while the unit runs the daemon as User=powerprof, who may not write there (it failed at start).
    # Now a note says whose writability it was and how to check as the daemon's user; none for another user.
    from powerprof.daemon import config as dconfig

    monkeypatch.setattr(dconfig.os, "geteuid", lambda: euid)
    monkeypatch.setattr(dconfig.os, "access", lambda *a, **k: True)  # the writability judged: not what is tested
    r = run("daemon", "--check", "--data-dir", str(tmp_path / "dd"))
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and "config OK" in flat, flat
    note = "judged for root, who may write in any folder; where the daemon runs as another user (the systemd unit's"
    assert (note in flat and "sudo -u powerprof powerprof daemon --check" in flat) == (euid == 0), flat
    # With the options given, not "(with the same --config)" where --data-dir was given and no --config.
    assert "--config" not in flat and (f"daemon --check --data-dir {tmp_path / 'dd'}" in flat) == (euid == 0), flat


def test_daemon_check_as_root_repeats_simulate_and_sim_gpus_as_given(tmp_path, monkeypatch):
    # The root note's command said a bare `--simulate` (its profile dropped) and no --sim-gpus: run as told, it checked
    # another rig than this one (the default profile, one GPU, where daemon.gpus may name more).
    from powerprof.daemon import config as dconfig

    monkeypatch.setattr(dconfig.os, "geteuid", lambda: 0)
    monkeypatch.setattr(dconfig.os, "access", lambda *a, **k: True)
    r = run("daemon", "--check", "--simulate", "l4-24g", "--sim-gpus", "2", "--data-dir", str(tmp_path / "dd"))
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and "config OK" in flat, flat
    assert f"daemon --check --simulate l4-24g --sim-gpus 2 --data-dir {tmp_path / 'dd'}" in flat, flat


def test_devices_json_uses_run_json_key_names():
    info = json.loads(run("devices", "--simulate", "--json").output)
    (g,) = info["gpus"]
    assert {"default_limit_w", "min_limit_w", "max_limit_w"} <= set(g)
    assert not [k for k in g if k.startswith("limit_")]


# --- item 2: conventions -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [p for p, _ in _commands()], ids=" ".join)
def test_dash_h_shows_help_for_every_command(path):
    r = CliRunner().invoke(main, [*path, "-h"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Usage:")


def test_every_option_has_help_text():
    missing = [f"{' '.join(path)} {o.opts[0]}" for path, cmd in _commands() for o in cmd.params
               if isinstance(o, click.Option) and not (o.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize("path", [("measure",), ("analyze",), ("tag", "start"), ("tag", "stop"), ("tag", "list"),
                                  ("restore",), ("devices",), ("monitor",)], ids=" ".join)
def test_json_option_where_scripts_need_it(path):
    assert "--json" in run(*path, "-h").output


def test_measure_json_prints_one_object_with_stable_keys(tmp_path):
    r = run("measure", "--simulate", "--requests", "2", "--max-tokens", "16", "--warmup", "0", "--out",
            str(tmp_path / "m"), "--json")
    assert r.exit_code == 0, r.output
    # Strict JSON: `"prompt_offset": NaN` was printed, which jq and strict parsers refuse (session 46's walkthrough).
    d = json.loads(r.output, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert set(d) == {"server", "concurrencies", "notes", "windows_path", "aborted", "interrupted", "excluded",
                      "server_away", "foreign_traffic", "write_error"}
    (c,) = d["concurrencies"]
    assert c["concurrency"] == 1 and c["n_ok"] == 2 and c["gpu_j_per_token"] > 0
    assert c["n_planned"] == 2 and d["interrupted"] is None


@pytest.mark.parametrize("args,code", [
    (["analyze", "{tmp}/nowhere", "--json"], 1),  # printed nothing on stdout: a script's json.loads failed
    (["analyze", "{tmp}/nowhere", "--json", "--bootstrap", "5"], 2),  # an option error, while parsing
    (["measure", "--json"], 2),  # neither --server nor --simulate
    (["measure", "--simulate", "--json", "--concurrency", "1,1"], 2),
    (["replay", "{tmp}/none.jsonl", "--simulate", "--json"], None),
    (["devices", "--simulate", "--gpus", "x", "--json"], 2),
    (["devices", "--simulate", "--gpus", "64", "--json"], 2),  # checked after parsing: said as JSON too
    (["monitor", "--simulate", "--json", "--plain"], 2),
    (["tag", "start", "", "--socket", "{tmp}/no.sock", "--json"], None),
])
def test_every_json_command_says_its_error_as_json_on_stdout(tmp_path, args, code):
    # restore --json printed {"ok": false, ...}; analyze --json and measure --json printed nothing on stdout.
    r = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert r.exit_code != 0 and (code is None or r.exit_code == code), r.output
    d = json.loads(r.stdout)
    assert d["ok"] is False and d["exit_code"] == r.exit_code and d["error"], d
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith("Error: ") and d["error"] in said, (said, d)
    assert "Traceback" not in r.output


def test_a_json_error_is_not_a_second_object_after_the_result(tmp_path):
    # A command that printed its object and then fails (measure --json's write error) prints no second one.
    from powerprof import cli

    @cli.main.command("jsontwice", hidden=True)
    @click.option("--json", "as_json", is_flag=True)
    def jsontwice(as_json):
        cli._echo_json({"ok": True})
        raise click.ClickException("then it failed")

    try:
        r = CliRunner().invoke(main, ["jsontwice", "--json"])
        assert r.exit_code == 1 and json.loads(r.stdout) == {"ok": True}, r.output
        assert "then it failed" in r.stderr
    finally:
        del cli.main.commands["jsontwice"]


def _raises(e):
    def f(*a, **k):
        raise e
    return f


@pytest.mark.parametrize("args, target, stop, code, said", [
    (["analyze", "{run}", "--json"], "powerprof.analysis.report.analyze_run", KeyboardInterrupt(), 130,
     "interrupted: the analysis did not finish"),
    (["devices", "--simulate", "--json"], "powerprof.rig.Rig.describe", KeyboardInterrupt(), 130, "interrupted"),
    (["measure", "--simulate", "--json", "--out", "{tmp}/m"], "powerprof.workload.measure.run_measure",
     "SIGTERM", 143, "stopped by SIGTERM: nothing was written"),
])
def test_a_json_command_stopped_prints_one_json_object(tmp_path, monkeypatch, args, target, stop, code, said):
    # `analyze --json` stopped by Ctrl-C printed no object on stdout (its words on stderr, exit 130): a script's
    # json.loads failed on the empty text. A command without a stop path of its own said click's "Aborted!", exit 1.
    import signal

    from synthetic_runs import make_run, seed_truth

    from powerprof import termination

    run_dir = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=3) if "{run}" in args[1] else None
    monkeypatch.setattr(target, _raises(termination.Terminated(signal.SIGTERM) if stop == "SIGTERM" else stop))
    r = CliRunner().invoke(main, [a.format(tmp=tmp_path, run=run_dir) for a in args])
    assert r.exit_code == code, r.output
    d = json.loads(r.stdout)
    assert d == {"ok": False, "error": d["error"], "exit_code": code} and d["error"].startswith(said), d
    assert d["error"] in r.stderr and "Aborted" not in r.output, r.output


def test_ctrl_c_in_a_command_without_a_stop_path_exits_130_with_or_without_json(monkeypatch):
    # `devices` Ctrl-C'd said click's "Aborted!" and exited 1 without --json, 130 with it: one code for one stop.
    monkeypatch.setattr("powerprof.rig.Rig.describe", _raises(KeyboardInterrupt()))
    r = CliRunner().invoke(main, ["devices", "--simulate"])
    assert r.exit_code == 130 and "interrupted" in r.stderr and "Aborted" not in r.output, r.output
    assert r.stdout == ""


def test_a_stop_after_the_result_prints_no_second_object(tmp_path):
    # measure --json stopped after some requests prints its figures, then exits 130: that object is the one.
    from powerprof import cli

    @cli.main.command("jsonstop", hidden=True)
    @click.option("--json", "as_json", is_flag=True)
    def jsonstop(as_json):
        cli._echo_json({"ok": True})
        sys.exit(130)

    try:
        r = CliRunner().invoke(main, ["jsonstop", "--json"])
        assert r.exit_code == 130 and json.loads(r.stdout) == {"ok": True}, r.output
    finally:
        del cli.main.commands["jsonstop"]


def _one_second(monkeypatch):
    """Every default run folder name made in one second (names have one-second resolution)."""
    from datetime import datetime, timezone

    from powerprof.storage import runs

    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2026, 12, 5, 2, 7, 40, tzinfo=timezone.utc)

    monkeypatch.setattr(runs, "datetime", Frozen)


def test_two_measures_started_in_one_second_get_two_folders(tmp_path, monkeypatch):
    # The second failed "output directory runs/20261205T020740Z-measure already exists".
    _one_second(monkeypatch)
    monkeypatch.chdir(tmp_path)
    args = ("measure", "--simulate", "--requests", "1", "--max-tokens", "8", "--warmup", "0", "--json")
    for _ in range(3):
        r = run(*args)
        assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert names == ["20261205T020740Z-measure", "20261205T020740Z-measure-2", "20261205T020740Z-measure-3"]
    assert all((tmp_path / "runs" / n / "windows.parquet").exists() for n in names)
    # A name the user gives is never changed: a folder that holds a run is refused, as before.
    r = run(*args[:-1], "--out", str(tmp_path / "runs" / names[0]))
    assert r.exit_code == 1 and "already exists" in r.output, r.output


def test_a_sweep_whose_default_folder_is_taken_gets_the_next_name(tmp_path, monkeypatch):
    from powerprof.rig import Rig
    from powerprof.sweep import run_sweep
    from powerprof.workload.client import RequestParams

    _one_second(monkeypatch)
    from powerprof.storage.runs import default_run_dir

    with Rig("seed-16g") as rig:
        taken = default_run_dir(tmp_path / "runs", rig.run_label(rig.sources.nvml.infos[0].name))
    assert taken.name.startswith("20261205T020740Z-")
    taken.mkdir(parents=True)
    (taken / "run.json").write_text("{}")  # another run's, started in the same second
    with Rig("seed-16g") as rig:
        outcome = run_sweep(rig, levels_spec="300", runs_base=str(tmp_path / "runs"), params=RequestParams(max_tokens=16),
                            idle_s=0, interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=0)
    assert (taken / "run.json").read_text() == "{}"
    mine = taken.with_name(taken.name + "-2")
    assert (mine / "run.json").exists() and str(mine) in str(outcome.run_dir), outcome


def test_restore_json_with_nothing_to_restore(tmp_path):
    r = run("restore", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["ok"] is True and d["files"] == [] and "searched" in d


def test_restore_whose_state_folder_cannot_be_listed_says_so_and_fails(tmp_path, monkeypatch):
    # A state folder that is a file (or one this user may not read): "Nothing to restore", exit 0 and "ok": true, the
    # only word a warning on stderr; a GPU left capped by a run recorded there would have gone unsaid.
    (tmp_path / "statefile").write_text("x")
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "statefile"))
    r = run("restore", "--json")
    assert r.exit_code == 1, r.output
    d = json.loads(r.output)
    assert d["ok"] is False and d["files"][0]["status"] == "failed" and "could not be listed" in d["files"][0]["message"]
    r = run("restore")
    assert r.exit_code == 1 and "Nothing to restore" not in r.output and "could not be listed" in r.output, r.output


def test_analyze_json_is_analysis_json(tmp_path):
    from synthetic_runs import make_run, seed_truth

    run_dir = make_run(tmp_path / "run", seed_truth())
    r = run("analyze", str(run_dir), "--bootstrap", "200", "--format", "md", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d == json.loads((run_dir / "analysis" / "analysis.json").read_text())
    assert d["recommendation"]["policy"] == "budget"


def test_tag_json_output(monkeypatch):
    import powerprof.daemon.tagapi as tagapi

    answers = {"start": {"ok": True}, "stop": {"ok": True, "duration_s": 2.0, "gpu_energy_j": 50.0,
                                                "proxy_tokens": 100, "gpu_j_per_token": 0.5},
               "list": {"ok": True, "open": ["a"]}}
    monkeypatch.setattr(tagapi, "send_tag", lambda socket, action, name: answers[action])
    stop = json.loads(run("tag", "stop", "x", "--socket", "/nonexistent", "--json").output)
    assert stop["name"] == "x" and stop["gpu_j_per_token"] == 0.5 and stop["gpu_energy_j"] == 50.0
    assert json.loads(run("tag", "list", "--socket", "/nonexistent", "--json").output) == {"open": ["a"]}
    assert json.loads(run("tag", "start", "x", "--socket", "/nonexistent", "--json").output) == {"name": "x",
                                                                                                "started": True}


def test_devices_exits_1_when_there_is_nothing_to_measure(monkeypatch):
    import powerprof.collectors.sources as sources

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=fail))
    monkeypatch.setattr(sources, "_open_rapl", lambda *a, **kw: None)  # and no RAPL either
    r = CliRunner().invoke(main, ["devices"])
    assert r.exit_code == EXIT_NO_DEVICE == 1, r.output
    assert "nothing to measure" in r.output
    r = CliRunner().invoke(main, ["devices", "--json"])
    assert r.exit_code == 1
    # The simulator has a GPU and RAPL: success.
    monkeypatch.undo()
    assert run("devices", "--simulate").exit_code == 0


def test_max_tokens_default_is_the_same_in_sweep_and_measure():
    def default(cmd):
        (o,) = [p for p in main.commands[cmd].params if p.name == "max_tokens"]
        return o.default

    assert default("sweep") == default("measure") == DEFAULT_MAX_TOKENS


def test_sweep_has_measures_request_options():
    def opts(cmd):
        return {o for p in main.commands[cmd].params for o in p.opts}

    for flag in ("--seed", "--keep-text", "--prompt-cache", "--launch-timeout", "--api", "--prompts", "--prompt-set"):
        assert flag in opts("sweep") and flag in opts("measure"), flag


def test_sweep_passes_seed_and_keep_text_to_the_requests(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["sweep", "--simulate", "--limits", "300", "--idle-s", "0", "--min-requests", "2",
                                  "--max-requests", "2", "--warmup", "0", "--max-tokens", "16", "--seed", "7",
                                  "--keep-text", "--out", str(out)])
    assert r.exit_code == 0, r.output
    params = json.loads((out / "run.json").read_text())["params"]
    assert params["seed"] == 7 and params["keep_text"] is True and params["max_tokens"] == 16


def test_config_with_several_errors_reports_all_of_them(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[daemon]\ninterval_s = 0\nflush_interval_s = 'soon'\n[proxy]\nupstrem = 'http://x'\n[bogus]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, env={"POWERPROF_DAEMON_NOPE": "1"})
    msg = str(e.value)
    for key in ("daemon.interval_s", "daemon.flush_interval_s", "proxy.upstrem", "[bogus]", "daemon.nope"):
        assert key in msg, key
    assert len(e.value.errors) == 5 and msg.startswith("5 config errors")
    r = run("daemon", "--check", "--config", str(p))
    assert r.exit_code == 2 and "daemon.interval_s" in r.output and "proxy.upstrem" in r.output


def test_tag_stop_text_prints_a_missing_figure_as_unknown_not_zero(monkeypatch):
    # The text output did `value or 0`: a window whose energy the daemon could not give read "GPU 0.0 J".
    import powerprof.daemon.tagapi as tagapi

    monkeypatch.setattr(tagapi, "send_tag", lambda socket, action, name: {
        "ok": True, "duration_s": 2.0, "gpu_energy_j": None, "proxy_tokens": 0.0, "gpu_j_per_token": None})
    r = CliRunner().invoke(main, ["tag", "stop", "x", "--socket", "/nonexistent"])
    assert r.exit_code == 0, r.output
    assert "0.0 J" not in r.output and "GPU unknown J" in r.output and "2.00 s" in r.output
    assert "no J/token" in r.output


# Every command that writes a file at a path the user typed, with that path.
_WRITES_A_NAMED_FILE = {
    ("monitor",): ["monitor", "--simulate", "--duration", "0.1", "--interval", "0.1", "--output", "{f}.parquet"],
    ("trace",): ["trace", "{f}.jsonl", "--requests", "3"],
    ("export",): ["export", "{run}", "--format", "xlsx", "--out", "{f}.xlsx"],
}
# A folder the user names, into which the command writes files of its own naming, and why none is lost.
_WRITES_INTO_A_NAMED_FOLDER = {
    ("sweep",): "a folder that is not empty is refused",
    ("measure",): "a folder that is not empty is refused",
    ("tune",): "adds part files named by the time, never replaces one",
    ("analyze",): "its report, tables and plots, replaced together by a re-analysis of the same runs; a folder "
                  "holding another analysis or a person's files of those names is refused (docs/analysis.md)",
}


def test_every_command_writing_a_named_file_refuses_an_existing_one_unless_forced():
    outputs = {p: o for p, cmd in _commands() for o in cmd.params if o.name in ("out", "output", "out_path", "out_dir")}
    files = {p for p, o in outputs.items() if o.type.file_okay}
    assert files == set(_WRITES_A_NAMED_FILE), "a new command writes a file: give it --force and a row above"
    assert set(outputs) - files == set(_WRITES_INTO_A_NAMED_FOLDER)
    for p in files:
        (force,) = [o for _, c in _commands() if _ == p for o in c.params if o.name == "force"]
        assert "replace" in force.help.lower(), p


@pytest.mark.parametrize("path", sorted(_WRITES_A_NAMED_FILE))
def test_an_existing_output_file_is_kept_unless_forced(tmp_path, path):
    # Said one way by all: exit 2, the file named, --force offered, the file as it was.
    from synthetic_runs import make_run, seed_truth

    run_dir = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4) if path == ("export",) else ""
    args = [a.format(f=tmp_path / "mine", run=run_dir) for a in _WRITES_A_NAMED_FILE[path]]
    (mine,) = [tmp_path / a.rsplit("/", 1)[-1] for a in args if a.startswith(str(tmp_path / "mine"))]
    mine.write_bytes(b"the user's own")
    r = run(*args)
    assert r.exit_code == 2, r.output
    said = r.output.strip().splitlines()[-1]
    assert mine.name in said and "--force" in said and ("exists" in said or "holds" in said), said
    assert mine.read_bytes() == b"the user's own"
    r = run(*args, "--force")
    assert r.exit_code == 0, r.output
    assert mine.read_bytes() != b"the user's own"


def _not_a_file(path, kind):
    """Make `path` a name no writer may replace: a FIFO, a character device (a null device of our own, never
    /dev/null), a socket, a folder, or a symlink (dangling, looping, or to a device)."""
    import os
    import stat

    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "chardev":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "dangling":
        os.symlink(path.parent / "nowhere", path)
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "link-to-fifo":
        os.mkfifo(path.parent / "pipe")
        os.symlink(path.parent / "pipe", path)


def _node(path):
    import os

    st = os.lstat(path)
    return st.st_mode, st.st_rdev, st.st_ino, os.readlink(path) if os.path.islink(path) else None


_NOT_FILES = ("fifo", "chardev", "socket", "folder", "dangling", "loop", "link-to-fifo")
# The same writers, and the rest: a table of a csv export into a folder, and monitor --recover's FILE.
_WRITERS = {**{" ".join(k): v for k, v in _WRITES_A_NAMED_FILE.items()},
            "export csv": ["export", "{run}/levels.parquet", "--format", "csv", "--out", "{f}.csv"],
            "export parquet": ["export", "{run}/levels.parquet", "--format", "parquet", "--out", "{f}.parquet"],
            "export folder": ["export", "{run}", "--format", "csv", "--out", "{d}"],
            "monitor --recover": ["monitor", "--recover", "{f}.parquet"]}


@pytest.mark.parametrize("kind", _NOT_FILES)
@pytest.mark.parametrize("writer", sorted(_WRITERS))
@pytest.mark.parametrize("force", [False, True])
def test_no_writer_replaces_what_is_not_a_regular_file_even_forced(tmp_path, writer, kind, force):
    # `powerprof trace /dev/null --requests 5 --force` exit 0 made /dev/null a 302-byte file; a looping symlink was
    # replaced without --force (exists() follows it and said no).
    from synthetic_runs import make_run, seed_truth

    run_dir = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4) if "export" in writer else ""
    args = [a.format(f=tmp_path / "mine", run=run_dir, d=tmp_path / "o") for a in _WRITERS[writer]]
    if writer == "export folder":
        (tmp_path / "o").mkdir()
        target = tmp_path / "o" / "levels.csv"
    else:
        (target,) = [tmp_path / a.rsplit("/", 1)[-1] for a in args if a.startswith(str(tmp_path / "mine"))]
    if writer == "monitor --recover":
        r = run("monitor", "--simulate", "--duration", "0.1", "--interval", "0.1", "--output", str(tmp_path / "m.parquet"))
        assert r.exit_code == 0, r.output
        (tmp_path / "mine.parquet.parts").mkdir()
        (tmp_path / "mine.parquet.parts" / "part-000001.parquet").write_bytes((tmp_path / "m.parquet").read_bytes())
    _not_a_file(target, kind)
    before = _node(target)
    r = run(*args, *(["--force"] if force else []))
    assert r.exit_code == 2, r.output
    said = r.output.strip().splitlines()[-1]
    # A folder where a file goes: click's own "is a directory" for a file argument says it as well.
    assert target.name in said and ("not a regular file" in said or "is a directory" in said), said
    assert "Traceback" not in r.output
    assert _node(target) == before
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


def test_cap_not_engaged_at_the_highest_level_alone_does_not_void_the_comparison():
    # The README's seed sweep: 300 W drew 275 W, 180-260 W all bound. The finding read "what differs between these
    # levels ... is not the limit's effect. Lower the limits", though every lower level's difference was the limit's.
    rows = [{"level_kind": "power_limit", "level_value": v, "n_requests": 5, "flags": "cap-not-engaged" if ne else None,
             "cap_not_engaged": ne, "avg_gpu_power_w": p}
            for v, p, ne in ((180.0, 179.5, False), (220.0, 218.0, False), (260.0, 258.2, False), (300.0, 274.9, True))]
    (f,) = [f for f in level_findings(pa.Table.from_pylist(rows, schema=LEVELS)) if f.kind == "cap-not-engaged"]
    assert "these levels" not in f.message and "not the limit's effect" not in f.message, f.message
    assert "as if unlimited" in f.message and "Nothing to fix" in f.message and f.levels == (300.0,), f.message
    # A middle level that never bound stays a problem with its fix.
    rows[2] = dict(rows[2], flags="cap-not-engaged", cap_not_engaged=True)
    rows[3] = dict(rows[3], flags=None, cap_not_engaged=False, avg_gpu_power_w=299.0)
    (f,) = [f for f in level_findings(pa.Table.from_pylist(rows, schema=LEVELS)) if f.kind == "cap-not-engaged"]
    assert "not this limit's" in f.message and "--clocks" in f.message and "Nothing to fix" not in f.message, f.message


def test_an_uncertain_choice_gives_its_levels_with_their_unit():
    # "ed2p: uncertain choice: 260 in 67% of bootstrap resamples, 95% of them between 220 and 260": no unit.
    from powerprof.analysis.checks import choice_findings
    from powerprof.analysis.sweetspot import Choice
    import dataclasses

    fields = {f.name: None for f in dataclasses.fields(Choice)}
    c = Choice(**{**fields, "level_value": 260.0, "stability": 0.67, "ci_low": 220.0, "ci_high": 260.0})
    (w,) = choice_findings({"ed2p": c}, "W")
    assert "uncertain choice: 260 W in 67%" in w.message and "between 220 W and 260 W" in w.message, w.message
    (m,) = choice_findings({"ed2p": dataclasses.replace(c, level_value=1600.0, ci_low=1200.0, ci_high=1600.0)}, "MHz")
    assert "1600 MHz in 67%" in m.message and "between 1200 MHz and 1600 MHz" in m.message, m.message


# Every command that makes the file or folder it is given, with the flag its message names and the name made in OUT's
# place (RUN: a sweep run's folder). One rule: exit 2 (a usage error), the same words, nothing made.
_MAKERS = {
    "analyze": (["analyze", "RUN", "--bootstrap", "100", "--format", "md", "--out", "OUT"], "--out", "OUT"),
    "export, a folder": (["export", "RUN", "--format", "csv", "--out", "OUT"], "--out", "OUT"),
    "export, one file": (["export", "RUN/windows.parquet", "--format", "csv", "--out", "OUT.csv"], "--out", "OUT.csv"),
    "sweep": (["sweep", "--simulate", "--limits", "300", "--out", "OUT"], "--out", "OUT"),
    "sweep --dry-run": (["sweep", "--simulate", "--limits", "300", "--dry-run", "--out", "OUT"], "--out", "OUT"),
    "measure": (["measure", "--simulate", "--requests", "2", "--out", "OUT"], "--out", "OUT"),
    "tune": (["tune", "--simulate", "--dry-run", "--duration", "1", "--daemon-metrics", "http://127.0.0.1:1/metrics",
              "--tpot-p95-ms", "100", "--levels", "200,300W", "--out", "OUT"], "--out", "OUT"),
    "trace": (["trace", "OUT.jsonl", "--requests", "3"], "OUT.jsonl", "OUT.jsonl"),
    "monitor --output": (["monitor", "--simulate", "--duration", "0.5", "--output", "OUT.parquet"], "--output",
                         "OUT.parquet"),
    "monitor --recover": (["monitor", "--recover", "OUT.parquet"], "--recover", "OUT.parquet"),
}


@pytest.mark.parametrize("case", sorted(_MAKERS))
def test_an_output_whose_parent_is_missing_is_one_usage_error_in_every_command(case, tmp_path):
    # `sweep --out /nonexistent/dir/out` (as root) made the whole tree and ran (session 46's walkthrough); then each
    # command refused it its own way: exit 1 (analyze, export, sweep), 2 (measure, tune, trace, monitor), and "folder
    # 'x' does not exist" (trace, monitor) or tune's own words. Now one rule (storage.runs.missing_parent): exit 2,
    # "FLAG PATH: its parent folder P does not exist ... (mkdir -p P)", nothing made (a fleet analyze's: test_fleet).
    from synthetic_runs import make_run, seed_truth

    src = make_run(tmp_path / "run", seed_truth(), levels=(180, 300), n_requests=6)
    args, flag, name = _MAKERS[case]
    out = tmp_path / "typo" / "dir" / name
    given = [str(out) if a == name else a.replace("RUN", str(src)) for a in args]
    r = CliRunner().invoke(main, given)
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (said, r.exception)
    assert f"{flag} {out}: its parent folder {out.parent} does not exist" in said, said
    assert f"mkdir -p {out.parent})" in said and "Traceback" not in said, said
    assert not (tmp_path / "typo").exists()


def test_tag_stop_json_keeps_a_tiny_energy_to_significant_digits(monkeypatch):
    # Before: round(v, 3) printed a tag's 0.0004 J as 0.0, a 0 posing as a measurement.
    import powerprof.daemon.tagapi as tagapi

    answers = {"stop": {"ok": True, "duration_s": 0.30000000000000004, "gpu_energy_j": 0.00041234567,
                        "unproxied_energy_j": 0.0, "proxy_tokens": 1, "gpu_j_per_token": 0.00041234567}}
    monkeypatch.setattr(tagapi, "send_tag", lambda socket, action, name: answers[action])
    stop = json.loads(run("tag", "stop", "x", "--socket", "/nonexistent", "--json").output)
    assert stop["gpu_energy_j"] == pytest.approx(0.000412346, rel=1e-6) and stop["gpu_energy_j"] != 0.0
    assert stop["unproxied_energy_j"] == 0.0 and stop["duration_s"] == 0.3


def _third_party_loaded(code: str) -> list[str]:
    """The third-party top-level packages a fresh interpreter holds after `code` (in a subprocess: this one has them all)."""
    import subprocess

    tail = ("\nimport sys\nprint(sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
            " - {'powerprof', 'click', '_distutils_hack'} - {m for m in sys.modules if m.startswith('_')}))")
    r = subprocess.run([sys.executable, "-c", code + tail], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.splitlines()[-1].replace("'", '"'))


def test_importing_the_cli_loads_no_library_but_click():
    # Every `powerprof` process imports the CLI module first: `--help`, `tag start` (the tests run it as a process),
    # the daemon. Its commands import what they use; at import the simulator's profile names pulled in
    # powerprof.sim's SimNVML and with it numpy and pynvml (~0.1 s of CPU a start, docs/benchmarks.md "Start-up").
    assert _third_party_loaded("import powerprof.cli") == []


def test_a_command_exit_loads_no_rich():
    # A command that leaves by sys.exit (the daemon's every stop: `sys.exit(service.main(...))`) went through
    # _json_exit, which imported powerprof.pipes, which imported rich.console for the sweep's console class: ~40
    # modules of rich loaded in a stopping daemon, ~40 ms of CPU in each stop.
    code = ("import powerprof.cli\ntry:\n    powerprof.cli.main(['daemon', '--config', '/nonexistent/p.toml'])\n"
            "except SystemExit as e:\n    assert e.code == 2, e.code")
    assert "rich" not in _third_party_loaded(code)


def test_a_tag_command_loads_no_aiohttp(tmp_path):
    # `powerprof tag start|stop` is one request on a Unix socket, run as a process by scripts and by the daemon tests.
    # Its client was aiohttp's: importing aiohttp (which loads the system's CA bundle twice at import) was ~0.4 s of
    # the command's ~0.55 s of CPU here (bench/startup.py, `tag`).
    code = ("import powerprof.cli\ntry:\n    powerprof.cli.main(['tag', 'start', 'x', '--socket', "
            f"{str(tmp_path / 'missing')!r}])\nexcept SystemExit as e:\n    assert e.code == 1, e.code")
    assert "aiohttp" not in _third_party_loaded(code)


def test_a_commands_permission_error_loads_no_simulator():
    # _Command.invoke asks whether a PermissionError is the simulator's state file refusing: it imported
    # powerprof.sim.nvml to ask, which since SimNVML is lazy loads numpy and pynvml in every PermissionError's path.
    code = ("import sys, powerprof.cli, powerprof.daemon.tagapi as t\n"
            "def refuse(*a, **k):\n    raise PermissionError(13, 'Permission denied', '/x')\n"
            "t.send_tag = refuse\ntry:\n    powerprof.cli.main(['tag', 'list', '--socket', '/x'])\n"
            "except PermissionError:\n    pass\nelse:\n    raise AssertionError('not raised')\n"
            "assert 'powerprof.sim.nvml' not in sys.modules, 'powerprof.sim.nvml loaded'")
    loaded = _third_party_loaded(code)
    assert "numpy" not in loaded and "pynvml" not in loaded, loaded


@pytest.mark.parametrize("cmd", [["analyze", "--bootstrap", "100", "--format", "md"], ["export", "--format", "csv"]])
def test_analyze_and_export_write_an_absolute_out_from_a_removed_current_folder(cmd, tmp_path, monkeypatch):
    # missing_parent asked os.getcwd() for every --out: with the current folder removed, an absolute --out (which needs
    # none) ended in a FileNotFoundError traceback (exit 1, nothing written). Now it is written; a relative one,
    # which names no folder any more, is refused saying why.
    from synthetic_runs import make_run, seed_truth

    src = make_run(tmp_path / "run", seed_truth(), levels=(180, 300), n_requests=6)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    r = CliRunner().invoke(main, [cmd[0], str(src), *cmd[1:], "--out", str(tmp_path / "out")])
    assert r.exit_code == 0 and (tmp_path / "out").is_dir(), r.output + repr(r.exception)
    r = CliRunner().invoke(main, [cmd[0], str(src), *cmd[1:], "--out", "rel"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "the current folder no longer exists" in said and "Traceback" not in said, said
