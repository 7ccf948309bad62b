"""`powerprof analyze`: files, self-contained HTML, plots marking the computed sweet spot, merging, warnings, CLI."""

from __future__ import annotations

import io
from datetime import datetime, timezone
import errno
import itertools
import json
import os
import re
import stat

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from pathlib import Path
from click.testing import CliRunner
from PIL import Image

from powerprof.analysis import plots
from powerprof.analysis.loading import AnalysisError, read_run_info
from powerprof.analysis.report import _same_name_note, _timeline_keys, analyze_run, console_summary
from synthetic_runs import Truth, bowl_truth, make_run, seed_truth
from support import stopped_before_first_level
from powerprof.cli import main
from powerprof.storage.schema import ANALYSIS

SEED_LEVELS = (180, 220, 260, 300)


@pytest.fixture(scope="module")
def seed_result(tmp_path_factory):
    base = tmp_path_factory.mktemp("seed")
    run = make_run(base / "run", seed_truth(), levels=SEED_LEVELS, n_requests=40, thermal_levels=(180,))
    return run, analyze_run([run], n_boot=300)


def _said(output: str, start: str) -> str:
    """The console's sentence or finding that starts with `start`, its wrapped lines (indented) joined back."""
    lines = output.splitlines()
    i = next(k for k, x in enumerate(lines) if x.startswith(start))
    return " ".join(" ".join(lines[i:i + 1] + list(itertools.takewhile(lambda x: x.startswith("  "), lines[i + 1:]))).split())


def test_analyze_writes_every_output(seed_result):
    run, res = seed_result
    out = run / "analysis"
    for name in ("analysis.parquet", "analysis.json", "report.md", "report.html", "j_per_token.png", "tok_s.png",
                 "saving_vs_loss.png", "power_clock.png"):
        assert (out / name).stat().st_size > 0, name
    assert res.recommendation.level_value == 220
    md = (out / "report.md").read_text()
    assert "Recommended limit: 220 W" in md and "(simulated)" in md
    for png in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / png).exists()  # relative links resolve next to the report
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["recommendation"]["level_value"] == 220
    assert set(doc["series"][0]["choices"]) == {"min_energy", "budget", "edp", "ed2p", "knee", "weighted"}


def test_html_report_is_self_contained(seed_result):
    run, _ = seed_result
    html = (run / "analysis" / "report.html").read_text()
    srcs = re.findall(r'src="([^"]+)"', html)
    assert len(srcs) == 4 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "href=" not in html and "Recommended limit: 220 W" in html


def test_plots_mark_the_computed_sweet_spot(seed_result, tmp_path):
    _, res = seed_result
    sr = res.main
    fig = plots.plot_j_per_token(sr, tmp_path / "j.png")
    marks = {a.get_gid(): a for ax in fig.axes for a in ax.get_children() if a.get_gid()}
    for policy, c in sr.choices.items():
        assert marks[f"choice-{policy}"].get_xdata()[0] == c.level_value
    assert marks["recommended"].get_xdata()[0] == 220
    fig = plots.plot_tradeoff(sr, tmp_path / "t.png")
    rec = next(a for ax in fig.axes for a in ax.get_children() if a.get_gid() == "recommended")
    row = next(r for r in sr.table.to_pylist() if r["level_value"] == 220)
    assert rec.get_xdata()[0] == pytest.approx(row["speed_loss_pct"])
    assert rec.get_ydata()[0] == pytest.approx(row["energy_saving_pct"])
    assert Image.open(tmp_path / "j.png").text["Description"] == "recommended budget 220"


def test_analysis_parquet_opens_in_pandas_and_duckdb(seed_result):
    run, _ = seed_result
    path = run / "analysis" / "analysis.parquet"
    assert pq.read_schema(path).remove_metadata().equals(ANALYSIS)
    df = pd.read_parquet(path)
    assert df.loc[df.recommended, "level_value"].tolist() == [220.0]
    assert "budget" in df.loc[df.recommended, "chosen_by"].iloc[0]
    assert df["fit_decode_tok_s"].notna().all()
    n = duckdb.sql(f"select count(*) from '{path}' where thermal_throttle").fetchall()[0][0]
    assert n == 1


def test_warnings_name_the_problem_and_the_fix(seed_result):
    _, res = seed_result
    kinds = {w.kind: w for w in res.warnings}
    assert "180 W" in kinds["thermal"].message
    # The thermal 180 W is left out of the interpolation too: no optimum is placed on its figures.
    assert all(v >= 220 for w in res.warnings if w.kind == "between-levels" for v in w.levels)
    text = console_summary(res)
    assert "Recommended limit: 220 W" in text and "thermal" in text


def test_cap_not_engaged_and_wide_ci_warnings(tmp_path):
    # 320 W: the card draws ~275 W and never reports the power cap; 5 noisy requests per level.
    run = make_run(tmp_path / "run", seed_truth(), levels=(200, 240, 280, 320), n_requests=5, noise=0.08)
    res = analyze_run([run], tmp_path / "out", n_boot=300, plots=False)
    kinds = {w.kind: w for w in res.warnings}
    # The highest level alone, above levels that bound: the unlimited baseline, nothing to fix (not "--clocks").
    assert kinds["cap-not-engaged"].levels == (320.0,) and "as if unlimited" in kinds["cap-not-engaged"].message
    assert "requests" in kinds["wide-ci"].message
    row = next(r for r in res.table.to_pylist() if r["level_value"] == 320)
    assert row["cap_not_engaged"] and "cap-not-engaged" in row["flags"]


def test_runs_of_the_same_gpu_pool_their_requests(tmp_path):
    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=10, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=SEED_LEVELS, n_requests=12, seed=2)
    res = analyze_run([a, b], tmp_path / "out", n_boot=200, plots=False)
    rows = res.table.to_pylist()
    assert all(r["n_requests"] == 22 and r["n_runs"] == 2 for r in rows)
    assert rows[0]["run_id"] == "synthetic-1+synthetic-2"
    between = [w for w in res.warnings if w.kind == "between-levels" and w.message.startswith("budget")]
    assert between and 180 < between[0].levels[0] < 220  # the budget's optimum lies between 180 and 220 W


def test_cli_analyze_takes_a_glob_of_runs_and_pools_them(tmp_path):
    make_run(tmp_path / "run-a", seed_truth(), levels=SEED_LEVELS, n_requests=10, seed=1)
    make_run(tmp_path / "run-b", seed_truth(), levels=SEED_LEVELS, n_requests=12, seed=2)
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "run-*"), "--out", str(tmp_path / "o"), "--format", "md",
                                  "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    rows = pq.read_table(tmp_path / "o" / "analysis.parquet").to_pylist()
    assert all(row["n_requests"] == 22 and row["n_runs"] == 2 for row in rows)
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "nothing-*")])
    assert r.exit_code != 0 and "matches nothing" in r.output


def test_runs_of_different_gpus_are_refused_unless_forced(tmp_path):
    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=5)
    b = make_run(tmp_path / "b", bowl_truth(), levels=SEED_LEVELS, n_requests=5)
    with pytest.raises(AnalysisError, match="GPU model"):
        analyze_run([a, b], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    res = analyze_run([a, b], tmp_path / "out", force=True, n_boot=200, plots=False)
    assert len(res.runs) == 2


def test_forced_pool_of_different_gpus_warns_naming_them(tmp_path):
    # `analyze --force` across GPU models pooled them without a word anywhere.
    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=5)
    b = make_run(tmp_path / "b", bowl_truth(), levels=SEED_LEVELS, n_requests=5)
    names = [read_run_info(d).gpu_name for d in (a, b)]
    assert names[0] != names[1]
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--force", "--out", str(out), "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    line = _said(r.output, "! forced-pool:")
    assert "GPU model" in line and all(n in line for n in names) and "--force" in line
    ana = json.loads((out / "analysis.json").read_text())
    assert ana["warnings"][0]["kind"] == "forced-pool" and all(n in ana["warnings"][0]["message"] for n in names)
    assert "forced-pool" in (out / "report.md").read_text() and "forced-pool" in (out / "report.html").read_text()
    # Both runs' id is synthetic-0: one power_clock plot was drawn twice, b's timeline missing. Now one each, in order.
    assert sorted(f.name for f in out.glob("power_clock*")) == ["power_clock_synthetic-0_1.png",
                                                                "power_clock_synthetic-0_2.png"]
    # --json: the JSON keeps it, and stderr says it to the person.
    r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--force", "--json", "--out",
                                  str(out), "--bootstrap", "200"])
    assert r.exit_code == 0, r.stderr
    assert "forced-pool" in json.loads(r.stdout)["warnings"][0]["kind"]
    assert "GPU model" in r.stderr and all(n in r.stderr for n in names)
    # Without --force: refused, naming them, and nothing written.
    r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--out", str(tmp_path / "o2")])
    assert r.exit_code != 0 and "GPU model" in r.output and "--force" in r.output
    assert not (tmp_path / "o2").exists()


def test_cli_analyze_prints_the_recommendation(tmp_path):
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=20)
    r = CliRunner().invoke(main, ["analyze", str(run), "--out", str(tmp_path / "o"), "--max-slowdown", "5%",
                                  "--format", "md", "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    assert "Recommended limit: 260 W" in r.output
    assert (tmp_path / "o" / "report.md").exists() and not (tmp_path / "o" / "report.html").exists()


def test_a_slowdown_budget_is_printed_with_the_digits_it_was_given(tmp_path):
    # --max-slowdown 0.999 printed "≤ 100% slower" (":.0%"), a budget that reads as no budget at all.
    from powerprof.analysis.sweetspot import slowdown_text

    assert [slowdown_text(x) for x in (0.1, 0.05, 0.125, 0.999, 0.0)] == ["10%", "5%", "12.5%", "99.9%", "0%"]
    # Six digits rounded 99.99999% up to "100%" and wrote 1e-9 as "1e-07%" (the review).
    assert [slowdown_text(x) for x in (0.9999999, 1e-9, 1.0)] == ["99.99999%", "0.0000001%", "100%"]
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=20)
    r = CliRunner().invoke(main, ["analyze", str(run), "--out", str(tmp_path / "o"), "--max-slowdown", "0.999",
                                  "--format", "md", "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "≤ 99.9% slower" in said and "100%" not in said, said
    md = (tmp_path / "o" / "report.md").read_text()
    assert "≤ 99.9% slower" in md and "(≤ 99.9%)" in md and "≤ 100%" not in md


def test_a_speed_loss_just_over_the_budget_never_prints_as_within_it(tmp_path):
    # 220 W 10.0396% slower printed "10.0%" beside "Recommended limit: 260 W (…, ≤ 10% slower)": a level that read as
    # within the budget, left out with no reason. The loss gets the digits that put it on its side of the budget.
    from rich.console import Console

    from powerprof.analysis.sweetspot import loss_text
    from powerprof.progress import end_screen

    assert [loss_text(x, 0.10) for x in (10.0396, 9.96, 10.0, 5.0, -1.04, 10.0000004)] == [
        "10.04", "10.0", "10.0", "5.0", "-1.0", "10.0000004"]
    assert loss_text(9.985, 0.0999) == "9.98" and loss_text(10.0396, None) == "10.0"
    tok = {180: 80.0, 220: 89.96, 260: 95.0, 300: 100.0}

    def at(d):
        return lambda L: np.array([d[float(x)] for x in np.atleast_1d(L)])

    truth = Truth(tok_s=at(tok), power_w=at({L: float(L) for L in tok}), sm_clock_mhz=lambda L: np.atleast_1d(L) * 8.0)
    run = make_run(tmp_path / "run", truth, noise=0.00001, n_requests=12, decode_tokens=2000)
    r = CliRunner().invoke(main, ["analyze", str(run), "--out", str(tmp_path / "o"), "--format", "md",
                                  "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    assert "Recommended limit: 260 W" in r.output
    row = next(ln for ln in r.output.splitlines() if ln.lstrip().startswith("220 W"))
    assert "10.04%" in row and "10.0%" not in row, row
    md = (tmp_path / "o" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| 220 |"))
    assert "| 10.04 [" in row, row
    res = analyze_run([run], out_dir=tmp_path / "o2", n_boot=200, plots=False)
    con = Console(width=160, record=True, color_system=None, file=io.StringIO())
    con.print(end_screen(pq.read_table(run / "levels.parquet"), res, "W"))
    row = next(ln for ln in con.export_text().splitlines() if ln.lstrip().startswith("220 W"))
    assert "10.04%" in row, row


@pytest.mark.parametrize("args,msg", [
    (["analyze", "/nonexistent/run"], "no such run directory"),
    # A file (the run's windows.parquet, a daemon part file) read "no such run directory", which it exists as.
    (["analyze", "{run}/windows.parquet"], "is a file, not a run directory"),
    (["analyze", "{run}", "--max-slowdown", "fast"], "not a fraction"),
    (["analyze", "{run}", "--eta", "3"], "eta"),
    (["analyze", "{run}", "--format", "pdf"], "unknown report format"),
    # A traceback (FileNotFoundError from mkdir) where no folder can be made.
    (["analyze", "{run}", "--out", "/proc/powerprof-cannot-create"], "cannot write the analysis to /proc/powerprof-cannot-create"),
])
def test_cli_analyze_bad_input_fails_cleanly(tmp_path, args, msg):
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)
    r = CliRunner().invoke(main, [a.format(run=run) for a in args])
    assert r.exit_code != 0 and msg in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert not (run / "analysis").exists()


@pytest.mark.parametrize("fmt", [",", "", " , "])
def test_cli_analyze_refuses_an_empty_format_list(tmp_path, fmt):
    # `--format ,` wrote no report and said nothing, exit 0.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)
    r = CliRunner().invoke(main, ["analyze", str(run), "--format", fmt, "--bootstrap", "200"])
    assert r.exit_code == 2, r.output
    assert "names no report format; choose one or more of md, html" in r.output
    assert not (run / "analysis").exists()


def test_sweep_and_analyze_judge_max_slowdown_by_one_rule(tmp_path):
    # analyze took 0 and sweep refused it ("must be between 0 and 100%", the --target-ci rule); a
    # negative budget reached analyze's policy code and failed with exit 1 instead of a usage error.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)
    sweep = ["sweep", "--simulate", "--limits", "220", "--dry-run", "--out", str(tmp_path / "sw")]
    for bad in ("100%", "-5%", "1.0"):
        ra = CliRunner().invoke(main, ["analyze", str(run), "--max-slowdown", bad, "--bootstrap", "200"])
        rs = CliRunner().invoke(main, sweep + ["--max-slowdown", bad])
        assert ra.exit_code == rs.exit_code == 2, (ra.output, rs.output)
        said = [next(x for x in r.output.splitlines() if "max-slowdown" in x) for r in (ra, rs)]
        assert said[0] == said[1] and "from 0 up to, not including, 100%" in said[0], said
    assert not (run / "analysis").exists()
    r = CliRunner().invoke(main, ["analyze", str(run), "--max-slowdown", "0", "--format", "md", "--bootstrap", "200",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert CliRunner().invoke(main, sweep + ["--max-slowdown", "0"]).exit_code == 0


def test_cli_analyze_of_damaged_samples_says_which_file_and_what_to_do(tmp_path):
    # samples.parquet whose footer opens over a damaged page: DuckDB's error escaped as a traceback.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)
    p = run / "samples.parquet"
    assert p.exists()
    b = bytearray(p.read_bytes())
    b[4:40] = b"\xab" * 36  # the first page header: the footer still opens
    p.write_bytes(bytes(b))
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "samples.parquet: cannot be read as Parquet" in r.output and "move it aside" in r.output


def test_a_level_the_sweep_was_still_measuring_when_it_stopped_is_said(tmp_path):
    # Ctrl-C (or SIGTERM, or too many failures) during a level keeps its windows in the run directory;
    # `analyze` presented that part-round level like a finished one, recommendation and all.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=6)
    meta_path = run / "run.json"
    meta = json.loads(meta_path.read_text())
    finished = [[float(v), 0] for v in SEED_LEVELS if v != 180]
    meta_path.write_text(json.dumps({**meta, "levels_done": finished}))
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    said = _said(r.output, "! interrupted")
    assert "stopped while measuring 180 W (6 windows)" in said and "220 W" not in said, r.output
    warnings = json.loads((tmp_path / "a" / "analysis.json").read_text())["warnings"]
    assert [w["levels"] for w in warnings if w["kind"] == "interrupted"] == [[180.0]]
    # Every visit finished: nothing to say.
    meta_path.write_text(json.dumps({**meta, "levels_done": finished + [[180.0, 0]]}))
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0 and "interrupted" not in r.output, r.output


def test_analyze_of_a_measure_run_says_what_it_is(tmp_path):
    # It said "no measured windows at any level (all warm-up, failed, or missing)" of a run whose every
    # window was measured and ok: measure's windows are at the settings as they were, not at levels.
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "--requests", "2", "--max-tokens", "16", "--warmup", "0",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["analyze", str(out)])
    assert r.exit_code == 1 and "measured at the settings as they were (powerprof measure)" in r.output, r.output
    assert "all warm-up, failed, or missing" not in r.output


def test_the_reference_recommended_is_not_compared_with_itself(tmp_path):
    # A budget no lower level meets read "Recommended limit: 300 W (...): 0.0% slower, 0.0% less energy
    # per token than 300 W": the figures of the reference against itself.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=20)
    r = CliRunner().invoke(main, ["analyze", str(run), "--max-slowdown", "1%", "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    line = _said(r.output, "Recommended limit")
    assert line.startswith("Recommended limit: 300 W, the reference (") and "0.0% slower" not in line
    assert "every lower level is slower than the budget allows (260 W: " in line
    edge = _said(r.output, "! edge:")
    assert "160 W" in edge  # least J/token at the lowest level: measure below it


def test_ctrl_c_in_analyze_says_it_was_interrupted(tmp_path, monkeypatch):
    # It printed click's bare "Aborted!" and exited 1, like a failed analysis.
    import powerprof.analysis.report as report

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "analyze_run", interrupted)
    r = CliRunner().invoke(main, ["analyze", str(run)])
    assert r.exit_code == 130 and "interrupted: the analysis did not finish" in r.stderr, r.output
    assert "Aborted" not in r.output


def test_one_level_is_not_recommended_against_itself(tmp_path):
    # `sweep --limits 300` ended "Recommended limit: 300 W ...: 0.0% slower, 0.0% less energy per token than 300 W".
    run = make_run(tmp_path / "run", seed_truth(), levels=(300,), n_requests=5)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    assert "One level measured (300 W): nothing to compare it with" in r.output
    assert "Recommended limit" not in r.output and "0.0% less energy" not in r.output


def test_one_level_is_not_starred_or_chosen_in_any_output(tmp_path):
    # The line was fixed, but report.md's policy table still starred it ("300 ★", "★ the recommended
    # policy"), analysis.json and analysis.parquet called it recommended, and the plots marked it.
    run = make_run(tmp_path / "run", seed_truth(), levels=(300,), n_requests=5)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    out = run / "analysis"
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    for text in (md, page, r.output):
        assert "★" not in text and "recommended policy" not in text and "Other policies" not in text
    assert "no sweet spot to choose" in md and "no sweet spot to choose" in page
    ana = json.loads((out / "analysis.json").read_text())
    assert ana["recommendation"] is None and "one level measured" in ana["recommendation_note"]
    assert ana["series"][0]["choices"] == {} and ana["series"][0]["primary_policy"] is None
    t = pq.read_table(out / "analysis.parquet").to_pylist()
    assert [row["recommended"] for row in t] == [False] and [row["chosen_by"] for row in t] == [None]
    for png in ("j_per_token.png", "tok_s.png", "saving_vs_loss.png"):
        assert Image.open(out / png).info["Description"] == "one level measured: none recommended"
    # The xlsx summary sheet says none was recommended and keeps the warnings.
    from powerprof.analysis.export import summary_rows
    rows = dict(summary_rows(run, "UTC", None, None))
    assert rows["recommended"].startswith("none: one level measured") and "warning" in rows


def test_one_level_plot_has_no_recommended_marker(tmp_path):
    run = make_run(tmp_path / "run", seed_truth(), levels=(300,), n_requests=5)
    result = analyze_run([run], n_boot=200, plots=False, formats=())
    for draw in (plots.plot_j_per_token, plots.plot_tok_s, plots.plot_tradeoff):
        fig = draw(result.main, tmp_path / "p.png")
        gids = {a.get_gid() for ax in fig.axes for a in ax.get_children()}
        assert "recommended" not in gids and not any(str(g).startswith("choice-") for g in gids)


def test_a_run_given_twice_counts_once_and_a_copy_is_refused(tmp_path):
    # `analyze run run/` (or a glob that also matches a path given) pooled the run with itself: every
    # window twice, the J/token CI narrowed by about √2 (±3.7% shown as ±2.7% on the demo run).
    import shutil

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=6)
    once = analyze_run([run], tmp_path / "a", n_boot=300, plots=False, formats=())
    twice = analyze_run([run, Path(str(run) + "/"), tmp_path / "." / "run"], tmp_path / "b", n_boot=300,
                        plots=False, formats=())
    assert len(twice.runs) == 1
    assert twice.table.column("ci_reached_pct").to_pylist() == once.table.column("ci_reached_pct").to_pylist()
    shutil.copytree(run, tmp_path / "copy")
    with pytest.raises(AnalysisError, match="hold the same run"):
        analyze_run([run, tmp_path / "copy"], tmp_path / "c", n_boot=300, plots=False, formats=())


@pytest.mark.parametrize("when,killed", [("idle", False), ("idle", True), ("first-level", False)],
                         ids=["ctrl-c-in-idle", "kill-9-before-first-flush", "ctrl-c-in-first-level"])
def test_a_run_stopped_before_its_first_level_says_so(tmp_path, when, killed):
    # It read "not a powerprof run directory: windows.parquet is missing" (after kill -9), or
    # "no measured windows at any level (all warm-up, failed, or missing)" (after Ctrl-C), or, with
    # part of the first level measured, a report of that one cut level "compared with the finished levels".
    run = stopped_before_first_level(tmp_path / "run", when)
    if when == "first-level":
        win = pq.read_table(run / "windows.parquet").to_pylist()
        assert any(not w["warmup"] and w["status"] == "ok" for w in win)  # measured windows are there
    if killed:  # kill -9 leaves run.json alone: the tables are first written when a level ends
        for f in run.glob("*.parquet"):
            f.unlink()
    started = json.loads((run / "run.json").read_text())["started_utc"]
    r = CliRunner().invoke(main, ["analyze", str(run)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert f"{run}: a powerprof run with no finished level (stopped before its first level ended; started {started})" \
        in r.output
    assert "Rerun the sweep" in r.output and "powerprof sweep --limits 180,300 --simulate" in r.output
    assert "not a powerprof run directory" not in r.output and not (run / "analysis").exists()


def test_a_directory_without_windows_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalysisError, match="windows.parquet is missing"):
        analyze_run([tmp_path / "empty"])


def test_levels_at_another_concurrency_get_their_own_series(tmp_path):
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=8, concurrency=4)
    res = analyze_run([run], tmp_path / "out", n_boot=200)
    assert [(s.series.concurrency) for s in res.series] == [1, 4]
    assert res.main.series.concurrency == 1
    assert (tmp_path / "out" / "j_per_token_power_limit_c4.png").exists()
    c4 = res.series[1].table.to_pylist()
    assert np.all([r["decode_tok_s"] > 150 for r in c4])  # the batch aggregate, not one request's rate


def test_windows_without_energy_are_refused_with_the_reason(tmp_path):
    import pyarrow as pa

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=4)
    w = pq.read_table(run / "windows.parquet")
    for col in ("gpu_j_per_token", "gpu_energy_j"):
        w = w.set_column(w.column_names.index(col), col, pa.nulls(w.num_rows, pa.float64()))
    pq.write_table(w, run / "windows.parquet")
    with pytest.raises(AnalysisError, match="J/token cannot be computed"):
        analyze_run([run], tmp_path / "out")


# --- issue 15, item 5: plots a person can read -------------------------------------------------


def _marker_centres_px(fig, gid_prefix="choice-"):
    """Where each policy marker is drawn, in display pixels (after any offset transform)."""
    fig.canvas.draw()
    out = {}
    for ax in fig.axes:
        for a in ax.get_children():
            gid = a.get_gid() or ""
            if gid.startswith(gid_prefix):
                out[gid] = a.get_transform().transform((a.get_xdata()[0], a.get_ydata()[0]))
    return out


@pytest.mark.parametrize("plot", ["plot_j_per_token", "plot_tok_s", "plot_tradeoff"])
def test_policy_markers_do_not_hide_each_other(seed_result, tmp_path, plot):
    _, res = seed_result
    sr = res.main
    assert len({c.level_value for c in sr.choices.values()}) < len(sr.choices)  # some policies share a level
    fig = getattr(plots, plot)(sr, tmp_path / "p.png")
    centres = _marker_centres_px(fig)
    assert len(centres) == 6
    px_per_pt = fig.dpi / 72
    min_gap_px = plots.MARKER_PT * px_per_pt  # centres at least a marker apart: outlines do not overlap
    pts = list(centres.values())
    for i in range(len(pts)):
        for j in range(i + 1, len(pts)):
            assert np.hypot(*(pts[i] - pts[j])) >= min_gap_px * 0.99


def test_titles_say_each_thing_once(seed_result, tmp_path):
    _, res = seed_result
    sr = res.main
    for plot in (plots.plot_j_per_token, plots.plot_tok_s, plots.plot_tradeoff):
        title = plot(sr, tmp_path / "p.png").axes[0].get_title()
        assert title.count("power limit") <= 1 and title.count("concurrency") == 1, title


def test_power_clock_plot_labels_levels_with_units_and_the_idle_baseline(tmp_path):
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6)
    res = analyze_run([run], n_boot=200, formats=())
    fig = plots.plot_timeline(res.timelines[0], tmp_path / "pc.png", level_unit="W", idle_power_w=25.0)
    ax_p = fig.axes[0]
    texts = [t.get_text() for t in ax_p.texts]
    assert "220 W" in texts and "300 W" in texts
    assert all(t.get_fontsize() >= 9 for t in ax_p.texts)
    idle = [a for a in ax_p.get_children() if a.get_gid() == "idle-baseline"]
    assert idle and "idle baseline 25 W" in [t.get_text() for t in ax_p.get_legend().get_texts()]


def test_report_power_clock_gets_the_runs_idle_power(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6)
    meta = json.loads((run / "run.json").read_text())
    meta["idle_gpu_power_w"] = 31.0
    meta["idle_gpu_power_w_by_gpu"] = {"gpu0": 31.0}
    (run / "run.json").write_text(json.dumps(meta))
    seen = {}
    real = plots.plot_timeline

    def spy(tl, path, **kw):
        seen.update(kw)
        return real(tl, path, **kw)

    monkeypatch.setattr(plots, "plot_timeline", spy)
    analyze_run([run], n_boot=200, formats=("md",))
    assert seen == {"level_unit": "W", "idle_power_w": 31.0, "idle_by_device_w": {"gpu0": 31.0}}


def test_forced_runs_of_one_id_each_get_their_own_idle_power_on_their_plot(tmp_path, monkeypatch):
    # Two runs of one id pooled with --force: each timeline's run.json was found by run id, so the second run's
    # plot drew the first run's idle baseline (31 W twice). Now each its own (31 W, then 47 W).
    runs = []
    for i, idle_w in enumerate((31.0, 47.0)):
        run = make_run(tmp_path / f"r{i}", seed_truth(), levels=(220, 300), n_requests=5, seed=20 + i, run_id="a")
        meta = json.loads((run / "run.json").read_text())
        meta["idle_gpu_power_w"] = idle_w
        meta["idle_gpu_power_w_by_gpu"] = {"gpu0": idle_w}
        (run / "run.json").write_text(json.dumps(meta))
        runs.append(run)
    seen = []
    real = plots.plot_timeline

    def spy(tl, path, **kw):
        seen.append((kw["idle_power_w"], kw["idle_by_device_w"]))
        return real(tl, path, **kw)

    monkeypatch.setattr(plots, "plot_timeline", spy)
    analyze_run(runs, tmp_path / "out", force=True, n_boot=100, formats=("md",))
    assert seen == [(31.0, {"gpu0": 31.0}), (47.0, {"gpu0": 47.0})]  # in the runs' order, as their plots' _1, _2


def test_html_report_shows_plots_full_width_and_the_footnotes(seed_result):
    run, res = seed_result
    html = (run / "analysis" / "report.html").read_text()
    md = (run / "analysis" / "report.md").read_text()
    assert "figure img{width:100%" in html
    footnote = next(line for line in md.splitlines() if line.startswith("★"))
    import html as h

    assert h.escape(footnote) in html
    assert "statistics and policies: docs/analysis.md" in html
    assert Image.open(run / "analysis" / "j_per_token.png").size[0] >= 900  # drawn for the width it is shown at


def test_a_thermally_throttled_level_is_never_chosen_and_every_output_names_it(seed_result):
    # 180 W throttled for heat: its low J/token is the heat's doing, not the limit's, yet min_energy,
    # edp and weighted chose it (warned about in a line below, but chosen).
    run, res = seed_result
    sr = res.main
    assert all(c.level_value != 180 for c in sr.choices.values()), {p: c.level_value for p, c in sr.choices.items()}
    assert sr.recommendation.left_out == {180.0: "thermal throttling"}
    said = "Never chosen, whatever their figures: 180 W (thermal throttling)."
    out = run / "analysis"
    assert said in console_summary(res) and said in (out / "report.md").read_text()
    assert said in (out / "report.html").read_text()
    rec = json.loads((out / "analysis.json").read_text())["recommendation"]
    assert rec["left_out"] == [{"level_value": 180.0, "why": "thermal throttling"}]
    df = pd.read_parquet(out / "analysis.parquet").set_index("level_value")
    assert pd.isna(df.loc[180.0, "chosen_by"]) and "thermal" in df.loc[180.0, "flags"]


def test_an_interrupted_level_is_never_recommended(tmp_path):
    # The sweep stopped while measuring 220 W, the level the budget picks on this card: its part-round
    # figures were recommended with an 'interrupted' warning below them.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=12)
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "levels_done": [[float(v), 0] for v in SEED_LEVELS if v != 220]}))
    res = analyze_run([run], tmp_path / "a", n_boot=200, plots=False)
    assert res.recommendation.level_value == 260 and all(c.level_value != 220 for c in res.main.choices.values())
    assert "220 W (interrupted)" in console_summary(res)
    # Its row in the tables carried no mark (interrupted is no level flag): its part-round figures read as if they stood.
    # (The table's row: a finding wrapped on a long tmp path can also begin a line with "220 W".)
    (row,) = [x for x in console_summary(res, width=120).splitlines() if re.match(r"\s*220 W\s+[\d.*-]", x)]
    assert "[never chosen: interrupted]" in row, row
    (md_row,) = [x for x in (tmp_path / "a" / "report.md").read_text().splitlines() if x.startswith("| 220 |")]
    assert md_row.rstrip(" |").endswith("never chosen: interrupted"), md_row


def test_a_level_interrupted_at_one_concurrency_is_left_out_of_that_series_only(tmp_path):
    # A sweep at concurrency 4 stopped while measuring 220 W, pooled with a finished concurrency-1 sweep:
    # the cut levels were one set for every series, so 220 W at concurrency 1, fully measured, was
    # never chosen either and the recommendation moved off the budget's choice.
    import pyarrow.compute as pc

    one = make_run(tmp_path / "c1", seed_truth(), levels=SEED_LEVELS, n_requests=12, run_id="c1")
    four = make_run(tmp_path / "c4", seed_truth(), levels=SEED_LEVELS, n_requests=12, run_id="c4", concurrency=4)
    w = pq.read_table(four / "windows.parquet")
    pq.write_table(w.filter(pc.equal(w.column("concurrency"), 4)), four / "windows.parquet")  # a real run's: batches only
    for run, done in ((one, SEED_LEVELS), (four, [v for v in SEED_LEVELS if v != 220])):
        meta = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**meta, "levels_done": [[float(v), 0] for v in done]}))
    res = analyze_run([one, four], tmp_path / "a", n_boot=200, plots=False, formats=())
    by_c = {s.series.concurrency: s for s in res.series}
    assert by_c[4].recommendation.left_out == {220.0: "interrupted"}
    assert by_c[1].recommendation.left_out == {} and res.recommendation.level_value == 220
    rows = {(r["concurrency"], r["level_value"]): r["left_out"] for r in res.table.to_pylist()}
    assert rows[(4, 220.0)] == "interrupted" and rows[(1, 220.0)] is None
    (warn,) = [w for w in res.warnings if w.kind == "interrupted"]
    assert "c4" in warn.message and "220 W (" in warn.message


def test_the_tables_say_why_a_level_was_left_out(tmp_path):
    # "interrupted" is no level flag: analysis.parquet and its CSV showed the cut-short 220 W with the best
    # figures, an empty chosen_by and no reason at all (the reason was only in analysis.json and report.md).
    from powerprof.analysis import export as ex

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=12, thermal_levels=(180,))
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "levels_done": [[float(v), 0] for v in SEED_LEVELS if v != 220]}))
    analyze_run([run], n_boot=200, plots=False, formats=())
    df = pd.read_parquet(run / "analysis" / "analysis.parquet").set_index("level_value")
    assert df.loc[220.0, "left_out"] == "interrupted" and pd.isna(df.loc[220.0, "chosen_by"])
    assert not (df.loc[220.0, "flags"] or "").count("interrupt")  # the column is the only place the table says it
    assert df.loc[180.0, "left_out"] == "thermal throttling"
    assert df.loc[[260.0, 300.0], "left_out"].isna().all() and df.loc[260.0, "recommended"]
    ex.export(run, "csv", tmp_path / "csv", tz="UTC")
    rows = pd.read_csv(tmp_path / "csv" / "analysis.csv").set_index("level_value (W or MHz)")
    assert rows.loc[220.0, "left_out"] == "interrupted" and pd.isna(rows.loc[300.0, "left_out"])


def test_a_limit_that_never_bound_below_the_reference_is_not_recommended_as_a_saving(tmp_path):
    # An H200-like card draws ~284 W whatever the limit from 400 W up: 400-600 W differ from 700 W by
    # noise only, and the budget policy recommended whichever had the lowest noise ("1% less energy").
    flat = Truth(tok_s=lambda L: np.full(np.shape(L), 150.0), power_w=lambda L: np.full(np.shape(L), 284.0),
                 sm_clock_mhz=lambda L: np.full(np.shape(L), 1980.0), gpu_name="Flat GPU", min_limit_w=200.0,
                 max_limit_w=700.0, default_limit_w=700.0)
    run = make_run(tmp_path / "run", flat, levels=(400, 500, 600, 700), n_requests=20, noise=0.02, seed=3)
    res = analyze_run([run], tmp_path / "a", n_boot=200, plots=False)
    assert all(r["cap_not_engaged"] for r in res.table.to_pylist())
    assert res.recommendation.level_value == 700
    line = console_summary(res)
    assert "Recommended limit: 700 W, the reference" in line and "every other level is left out" in line
    assert "400 W (cap not engaged)" in line


def test_a_median_on_one_rounding_of_a_coarse_counter_is_said_and_never_chosen(tmp_path):
    # The seed card with an H200's 100 ms counter refresh: 220 W measured with 0.32 s windows reads 3
    # of the counter's steps in most windows, so its median J/token is 4% low, its "saving" 4 points
    # high, and the budget policy's choice rested on that, with nothing said.
    from synthetic_runs import counter_windows
    import pyarrow as pa
    from powerprof.storage.schema import WINDOWS

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=4)

    def analyse(short_level):
        rows = []
        for k, level in enumerate(SEED_LEVELS):
            rows += counter_windows("seed-16g", level, 0.32 if level == short_level else 3.0, n=40, seed=k,
                                    counter_step_s=0.1, run_id="synthetic-0")[0]
        pq.write_table(pa.Table.from_pylist(rows, schema=WINDOWS), run / "windows.parquet")
        return analyze_run([run], tmp_path / f"a{short_level}", n_boot=300, plots=False)

    assert analyse(None).recommendation.level_value == 220  # long windows everywhere: the budget's choice
    res = analyse(220)
    rows = {r["level_value"]: r for r in res.table.to_pylist()}
    assert "energy-resolution" in rows[220.0]["flags"]
    assert not any("energy-resolution" in (rows[v]["flags"] or "") for v in (180.0, 260.0, 300.0))
    assert rows[220.0]["gpu_j_per_token"] < 0.97 * rows[220.0]["gpu_j_per_token_pooled"]
    assert all(c.level_value != 220 for c in res.main.choices.values())
    # 0.32 s windows are also under 10 refreshes of the 100 ms counter: both reasons are said.
    assert res.recommendation.left_out == {220.0: "energy counter rounding, counter windows too short"}
    said = console_summary(res)
    assert "Never chosen, whatever their figures: 220 W (energy counter rounding, counter windows too short)." in said
    (warn,) = [w for w in res.warnings if w.kind == "energy-resolution"]
    assert warn.levels == (220.0,) and "! energy-resolution: " + warn.message in said
    assert "220 W: 2.6" in warn.message and "refresh" in warn.message and "--max-tokens 448 or more" in warn.message
    df = pd.read_parquet(tmp_path / "a220" / "analysis.parquet").set_index("level_value")
    assert df.loc[220.0, "gpu_j_per_token_pooled"] == pytest.approx(rows[220.0]["gpu_j_per_token_pooled"])


def test_an_analysis_stopped_while_writing_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    # Each file was replaced atomically, but one after another: Ctrl-C while report.html was rendered left
    # the new analysis.parquet, report.md and plots beside the old report.html and analysis.json (whose
    # recommendation the xlsx export's summary sheet shows): two analyses mixed, each file whole.
    from powerprof.analysis import report

    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=8)
    analyze_run([run], n_boot=100, max_slowdown=0.10)
    out = run / "analysis"
    before = {f.name: f.read_bytes() for f in out.iterdir()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "render_html", interrupted)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--max-slowdown", "1%"])
    assert r.exit_code == 130, r.output
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no temporary left either


def test_windows_with_impossible_figures_count_in_no_figure_and_are_said(tmp_path):
    # Negative energy at 260 W (7 of 12 windows: a windows.parquet edited or damaged) gave a median of
    # -2.98 J/token, "193.8% less energy per token" and the recommendation; a window of zero tok/s pulled
    # a level's speed down. Such windows are left out as untrusted timing is, and a warning says so.
    import pyarrow as pa

    run = make_run(tmp_path / "run", seed_truth(), levels=(180, 220, 260, 300), n_requests=12)
    t = pq.read_table(run / "windows.parquet")
    rows, hit = t.to_pylist(), {260.0: 0, 300.0: 0}
    for r in rows:
        if r["warmup"] or r["status"] != "ok" or r["level_value"] not in hit:
            continue
        if r["level_value"] == 260 and hit[260.0] < 7:
            r["gpu_j_per_token"], r["gpu_energy_j"] = -abs(r["gpu_j_per_token"]), -abs(r["gpu_energy_j"])
            hit[260.0] += 1
        elif r["level_value"] == 300 and hit[300.0] < 6:
            r["decode_tok_s"] = 0.0
            hit[300.0] += 1
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema).replace_schema_metadata(t.schema.metadata),
                   run / "windows.parquet")
    res = analyze_run([run], n_boot=200)
    lv = {r["level_value"]: r for s in res.series for r in s.table.to_pylist()}
    assert lv[260.0]["gpu_j_per_token"] > 0 and lv[260.0]["n_requests"] == 12
    assert lv[300.0]["decode_tok_s"] > 80
    [w] = [w for w in res.warnings if w.kind == "impossible-figures"]
    assert "13 of" in w.message and "260 W" in w.message and "300 W" in w.message


def _flat_truth():
    """J/token the same at every level (3.0), tok/s falling below the reference: no sweet spot exists."""
    lv, tok = (200, 240, 280, 320), [85.0, 91.0, 97.0, 100.0]
    return lv, Truth(tok_s=lambda L: np.interp(L, lv, tok), power_w=lambda L: 3.0 * np.interp(L, lv, tok),
                     sm_clock_mhz=lambda L: np.full(np.shape(L), 2000.0), default_limit_w=320)


def test_a_flat_energy_curve_recommends_no_slower_limit(tmp_path):
    # J/token is flat: the budget's least J/token is whichever level the noise favoured. It read
    # "Recommended limit: 240 W (...): 8.5% slower, 1.9% less energy per token than 320 W" though its
    # saving CI was [-3.8, 5.4]%: a user gave up 8.5% speed for nothing.
    lv, truth = _flat_truth()
    run = make_run(tmp_path / "run", truth, levels=lv, n_requests=12, noise=0.02, seed=1)
    res = analyze_run([run], n_boot=500, plots=False, formats=())
    assert res.recommendation.level_value == 240  # the noise's favourite, as the policy defines it
    line = console_summary(res)
    assert "Recommended limit: 240 W" not in line
    assert "No measured limit is shown to save energy against 320 W" in line and "keep 320 W" in line
    assert "a saving within noise" in line
    found = [w for w in res.warnings if w.kind == "no-clear-saving"]
    assert found and found[0].levels == (240.0,)
    assert "keep the reference (320)" in res.to_dict()["recommendation_note"]
    # The sweep's end screen and curves put no star on 240 W beneath words that say to keep 320 W.
    from rich.console import Console

    from powerprof.progress import end_screen
    from powerprof.terminal_plot import CHOSEN

    levels = pq.read_table(run / "levels.parquet")
    con = Console(width=120, record=True, color_system=None, file=io.StringIO())
    con.print(end_screen(levels, res, "W"))
    screen = con.export_text()
    assert CHOSEN not in screen and "recommended 240" not in screen, screen


def test_a_saving_within_noise_is_marked_nowhere_in_the_report_or_its_plots(tmp_path):
    # s29 took the star off the sweep's end screen, but the PNGs still drew the budget's star marker, the
    # "recommended" line and the label "recommended 240 W", and report.md starred "240 ★" in its policy table,
    # all beneath the line saying no limit is shown to save energy and to keep 320 W.
    lv, truth = _flat_truth()
    run = make_run(tmp_path / "run", truth, levels=lv, n_requests=12, noise=0.02, seed=1)
    res = analyze_run([run], n_boot=500, formats=("md", "html"))
    assert not res.starred and res.recommendation.level_value == 240
    for draw in (plots.plot_j_per_token, plots.plot_tok_s, plots.plot_tradeoff):
        fig = draw(res.main, tmp_path / "p.png")
        arts = [a for ax in fig.axes for a in ax.get_children()]
        gids = {a.get_gid() for a in arts}
        assert "recommended" not in gids and not any(str(g).startswith("choice-") for g in gids), draw
        labels = [a.get_label() for a in arts] + [t.get_text() for ax in fig.axes for t in ax.texts]
        assert not any("recommended" in str(x) or str(x).startswith(tuple(res.main.choices)) for x in labels), labels
        title = fig.axes[0].get_title()
        assert "no limit is shown to save energy: keep 320 W (240 W's saving is within noise)" in title, title
        assert "keep 320 W" in Image.open(tmp_path / "p.png").text["Description"]
    out = run / "analysis"
    import html as h

    md, page = (out / "report.md").read_text(), h.unescape((out / "report.html").read_text())
    for text in (md, page):
        assert not re.search(r"\d ★", text) and "★ the recommended policy" not in text
        assert "No ★: the recommended policy's level, 240 W, is not shown to save energy against 320 W" in text
    summary = console_summary(res)
    assert not re.search(r"240 W\s*\*", summary), summary
    assert pq.read_table(out / "analysis.parquet").to_pylist()[1]["recommended"]  # the policy's choice, as ever


def test_the_reference_chosen_over_a_level_within_budget_says_why(tmp_path):
    # 240 W was 9.5% slower, within the 10% budget, and cost more energy: the line said "every lower level
    # is slower than the budget allows (240 W: 9.5% slower, -1.0% less energy per token)", false twice.
    lv, truth = _flat_truth()
    run = make_run(tmp_path / "run", truth, levels=lv, n_requests=12, noise=0.02, seed=2)
    res = analyze_run([run], n_boot=500, plots=False, formats=())
    assert res.recommendation.level_value == 320
    line = console_summary(res)
    assert "slower than the budget allows" not in line and "-1.0% less" not in line
    assert "no lower level within the budget uses less energy per token (240 W: 9.5% slower, 1.0% more energy" in line


@pytest.mark.parametrize("columns", ["60", "80", "200", None])
def test_analyze_summary_is_wrapped_to_the_terminal_between_words(tmp_path, monkeypatch, columns):
    # analyze printed its summary unwrapped (rows of 94 columns, findings of 370): the terminal wrapped them itself,
    # cutting "2.568" into "2.5" / "68" and a flag in two. A pipe gets 120 columns, as sweep's results do.
    run = make_run(tmp_path / "run", seed_truth(), levels=(200, 240, 280, 320), n_requests=5, noise=0.08,
                   thermal_levels=(200,))
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    r = CliRunner().invoke(main, ["analyze", str(run), "--out", str(tmp_path / "o"), "--format", "md",
                                  "--bootstrap", "200"])
    assert r.exit_code == 0, r.output
    width = int(columns or 120)
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= width, "\n".join(line for line in lines if len(line) > width)
    assert "…" not in r.output
    res = analyze_run([run], tmp_path / "o2", n_boot=200, plots=False, formats=())
    tokens = {t for line in lines for t in line.replace(",", " ").split()}
    for row in res.table.to_pylist():
        for figure in (f"{row['gpu_j_per_token']:.3f}", f"{row['decode_tok_s']:.1f}"):
            assert figure in tokens, (figure, r.output)  # whole, on one line
        for flag in (row["flags"] or "").split(","):
            assert not flag or any(flag in line for line in lines), (flag, r.output)
    for w in res.warnings:  # every finding's words, in order, however it was broken
        assert " ".join(w.message.split()) in " ".join(r.output.split()), w.message
    if width == 200:
        assert any("chosen by" in line and "tok/s" in line for line in lines)  # the table, with room for it


def test_a_level_measured_again_after_the_server_went_away_is_noted_in_every_output(tmp_path):
    # Before: run.json's server_restarts was read by nothing: the report gave no hint that 220 W had been measured
    # again after a restart, or that the server had only stopped answering at 260 W.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=6)
    plain = analyze_run([run], tmp_path / "a0", n_boot=200)
    meta_path = run / "run.json"
    meta = json.loads(meta_path.read_text())
    meta["server_restarts"] = [
        {"stage": "idle-baseline", "level_value": None, "repeat": None, "down_s": 3.2, "error": "x", "restarted": None,
         "evidence": "its /metrics shows no start time, and no counter fell"},
        {"stage": "level", "level_value": 220.0, "repeat": 0, "down_s": 14.25, "error": "connection refused: y",
         "restarted": True, "evidence": "its counter llamacpp:tokens_predicted fell from 9000 to 0"},
        {"level_value": 260.0, "repeat": 0, "down_s": 0.1, "error": "connection lost: z"},  # as the first release wrote
    ]
    meta_path.write_text(json.dumps(meta))
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "a" / "analysis.json").read_text())
    notes = doc["notes"]
    assert any("220 W was measured again from scratch after the server restarted" in n and "down 14.2 s" in n
               and "fell from 9000 to 0" in n for n in notes), notes
    assert any("260 W was measured again from scratch after the server stopped answering" in n and "down 0.1 s" in n
               for n in notes), notes
    assert any("idle baseline was taken again" in n and "down 3.2 s" in n for n in notes), notes
    # Nothing could tell whether it restarted (no start time, no counter fell): said so. Before: "no restart seen",
    # read as "it did not restart" beside a llama.cpp without --metrics that had.
    assert any("whether it restarted is unknown: its /metrics shows no start time" in n for n in notes), notes
    assert not any("no restart seen" in n for n in notes), notes
    assert [x["level_value"] for x in doc["server_restarts"]] == [None, 220.0, 260.0]
    md = (tmp_path / "a" / "report.md").read_text()
    assert "## Notes" in md and "220 W was measured again from scratch" in md
    assert "220 W was measured again" in (tmp_path / "a" / "report.html").read_text()
    assert "note: 220 W was measured again" in " ".join(r.output.split()), r.output
    # The figures are the run's as they were: a note, never a warning or a level left out.
    assert not [w for w in doc["warnings"] if "restart" in w["message"]]
    assert doc["recommendation"]["level_value"] == plain.recommendation.level_value
    assert not plain.notes and "## Notes" not in (tmp_path / "a0" / "report.md").read_text()


def test_the_notes_a_sweep_stored_in_run_json_are_in_every_analysis_output_once(tmp_path):
    # runs/r2's run.json said "1 windows' end-edge reads came over 1% of their length…" (its end screen's note), and
    # report.md, analysis.json and analyze's console said it nowhere: the xlsx summary sheet alone carried it. Those
    # analyze says itself in its own words (the simulator, a restart ridden out, a flag it has a finding of) stay
    # out: said twice, they read as two events.
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=6)
    meta_path = run / "run.json"
    meta = json.loads(meta_path.read_text())
    edge = ("1 windows' end-edge reads came over 1% of their length after their end (a loaded host): their energy may "
            "read low by up to that share (the end's energy counter is interpolated over the delay), and they are "
            "flagged low_confidence; fix: longer windows (more --max-tokens) or a less loaded host (taskset powerprof "
            "onto its own core)")
    sim = "simulated GPU and simulated server (seed-16g): the figures demonstrate the method, not your hardware"
    restart = ("the server restarted at level 220 W (its counter llamacpp:tokens_predicted fell from 9000 to 0), down "
               "14.2 s (connection refused: y): the level was measured again from scratch after a warm-up; the windows "
               "measured before are left out (levels.parquet flag server-restarted)")
    meta["notes"] = [sim, edge, restart, edge]
    meta["server_restarts"] = [{"stage": "level", "level_value": 220.0, "repeat": 0, "down_s": 14.25,
                                "error": "connection refused: y", "restarted": True,
                                "evidence": "its counter llamacpp:tokens_predicted fell from 9000 to 0"}]
    meta_path.write_text(json.dumps(meta))
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "200", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    notes = json.loads((tmp_path / "a" / "analysis.json").read_text())["notes"]
    assert notes.count(edge) == 1, notes
    assert not any("demonstrate the method" in n or "levels.parquet flag server-restarted" in n for n in notes), notes
    assert sum("220 W was measured again from scratch" in n for n in notes) == 1, notes
    md = (tmp_path / "a" / "report.md").read_text()
    assert md.count("end-edge reads came over 1%") == 1 and "demonstrate the method" not in md
    assert "end-edge reads came over 1%" in (tmp_path / "a" / "report.html").read_text()
    said = " ".join(r.output.split())
    assert said.count("note: 1 windows' end-edge reads came over 1%") == 1, r.output
    assert "demonstrate the method" not in said and "(simulated)" in said


def test_an_analysis_of_other_runs_or_a_users_files_are_never_replaced(tmp_path):
    # `analyze a b` wrote the pooled analysis over a/analysis, run a's own, without a word: `export a`'s summary
    # sheet then gave the pool's recommendation as run a's. `--out ~/notes` replaced the user's own report.md.
    a = make_run(tmp_path / "a", seed_truth(), levels=(220, 300), n_requests=6, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=(220, 300), n_requests=6, seed=2)
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100"])
    assert r.exit_code == 0, r.output
    before = {f.name: f.read_bytes() for f in (a / "analysis").iterdir()}
    r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--bootstrap", "100"])
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and str(a / "analysis") in said and "synthetic-1" in said and "--out" in said, r.output
    assert {f.name: f.read_bytes() for f in (a / "analysis").iterdir()} == before
    # Elsewhere it is written; the same runs again replace their own analysis (a re-analysis).
    for _ in range(2):
        r = CliRunner().invoke(main, ["analyze", str(a), str(b), "--bootstrap", "100", "--out", str(tmp_path / "ab")])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["analyze", str(b), str(a), "--bootstrap", "100", "--out", str(tmp_path / "ab"),
                                  "--max-slowdown", "5%"])
    assert r.exit_code == 0, r.output
    # A folder holding a file of the analysis' names that is no analysis: the user's.
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("my own notes")
    r = CliRunner().invoke(main, ["analyze", str(b), "--bootstrap", "100", "--out", str(notes)])
    assert r.exit_code == 2 and "report.md" in r.output, r.output
    assert (notes / "report.md").read_text() == "my own notes" and sorted(notes.iterdir()) == [notes / "report.md"]


def test_an_analysis_is_never_written_into_another_runs_folder(tmp_path):
    # `analyze a --out b` wrote a's report into run b's folder without a word (and `--out b/analysis` made it
    # b's analysis, as `export b` shows it).
    a = make_run(tmp_path / "a", seed_truth(), levels=(220, 300), n_requests=6, seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=(220, 300), n_requests=6, seed=2)
    before = sorted(p.name for p in b.iterdir())
    for out, said in ((b, "run directory"), (b / "analysis", "analysis folder")):
        r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(out)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        line = " ".join(r.output.split())
        assert str(b) in line and said in line and "synthetic-2" in line and "--out" in line, r.output
        assert sorted(p.name for p in b.iterdir()) == before
    # A run folder is one by its windows.parquet alone (analyze reads it so), run.json or not.
    c = tmp_path / "c"
    c.mkdir()
    (c / "windows.parquet").write_bytes((a / "windows.parquet").read_bytes())
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(c)])
    assert r.exit_code == 2 and "run directory" in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in c.iterdir()) == ["windows.parquet"]
    # An input's own run folder is no place for it either: its analysis folder is (the default).
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(a)])
    assert r.exit_code == 2 and str(a / "analysis") in " ".join(r.output.split()), r.output
    # The default, and an input's own analysis folder named: written.
    for args in ([str(a)], [str(a), "--out", str(a / "analysis")], [str(b), "--out", str(b / "analysis")]):
        r = CliRunner().invoke(main, ["analyze", *args, "--bootstrap", "100"])
        assert r.exit_code == 0, r.output
    assert (b / "analysis" / "analysis.json").exists()


def test_the_recommendation_says_the_chosen_levels_j_per_token_and_speed(seed_result):
    # "What power limit, and how much energy per token?": the line gave the limit, its speed loss and saving against
    # the reference, but not the J/token itself (the table's figure, a screen above).
    run, res = seed_result
    row = next(r for r in res.main.table.to_pylist() if r["level_value"] == 220)
    line = " ".join(console_summary(res).split())
    rec = line[line.index("Recommended limit: 220 W"):line.index("Other policies")]
    assert f"{row['gpu_j_per_token']:.3f} J/token on the GPU at {row['decode_tok_s']:.1f} tok/s decode" in rec, rec
    truth = seed_truth()
    assert row["gpu_j_per_token"] == pytest.approx(float(truth.j_per_token([220])[0]), rel=0.03)  # the figure is the card's
    assert f"{row['gpu_j_per_token']:.3f} J/token" in (run / "analysis" / "report.md").read_text()
    # "Other policies: min_energy 180, edp 180, ...": levels without their unit.
    others = line[line.index("Other policies: "):].split(".")[0]
    assert re.fullmatch(r"Other policies: (\w+ \d+ W, )*\w+ \d+ W", others), others


def test_counter_windows_under_ten_refreshes_are_said_and_never_chosen(tmp_path):
    # The reviewer's H200 sweep (--max-tokens 48): 0.3 s windows on a 100 ms counter, every window biased alike, so
    # median and pooled figures agree and nothing was flagged; a policy could choose the level on a figure 8% low.
    from synthetic_runs import counter_windows
    import pyarrow as pa
    from powerprof.storage.schema import WINDOWS

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=4)
    rows = []
    for k, level in enumerate(SEED_LEVELS):
        rows += counter_windows("seed-16g", level, 0.6 if level == 220 else 3.0, n=40, seed=k,
                                counter_step_s=0.02, run_id="synthetic-0")[0]
    pq.write_table(pa.Table.from_pylist(rows, schema=WINDOWS), run / "windows.parquet")
    res = analyze_run([run], tmp_path / "a", n_boot=300, plots=False)
    by = {r["level_value"]: r for r in res.table.to_pylist()}
    assert "short-windows" in by[220.0]["flags"].split(",")
    assert by[220.0]["counter_window_s"] == pytest.approx(0.6, rel=0.05)
    assert not any("short-windows" in (by[v]["flags"] or "") for v in (180.0, 260.0, 300.0))
    assert all(c.level_value != 220 for c in res.main.choices.values())
    assert res.recommendation.left_out == {220.0: "counter windows too short"}
    (warn,) = [w for w in res.warnings if w.kind == "short-windows"]
    assert "220 W: 0.60 s" in warn.message and "10 of its refreshes" in warn.message and "--max-tokens" in warn.message
    assert "! short-windows: " + warn.message in console_summary(res)


def test_levels_of_few_windows_say_their_ci_covers_less_than_95_percent(tmp_path):
    # A level stopped on --max-time at 3 windows printed a "95%" CI that covers ~75% (a median's percentile bootstrap).
    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=3)
    res = analyze_run([run], tmp_path / "a", n_boot=300, plots=False)
    assert all("few-windows" in r["flags"].split(",") for r in res.table.to_pylist())
    (warn,) = [w for w in res.warnings if w.kind == "few-windows"]
    assert "(here 75% at 3)" in warn.message and "not the 95%" in warn.message and "--max-time" in warn.message
    assert warn.message.count("% at ") == 1  # each window count once: "50.0% at 2; 50% at 2, 75% at 3, ..." before
    assert "--min-requests" in warn.message
    assert "! few-windows: " + warn.message in console_summary(res)


def test_runs_at_two_concurrencies_pooled_keep_each_series_own_sweep_and_sample_figures(tmp_path):
    # `analyze runA runB`, A at concurrency 1, B at 4: the sweep's figures were keyed by (kind, value) alone, so both
    # series printed one SM clock (the runs' samples pooled), draft_n 5340 each (truth 2136 and 3204), a mean
    # avg_cpu_power_w, and a cap_not_engaged / thermal OR-ed across the two.
    import pyarrow as pa
    import pyarrow.compute as pc

    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=8, run_id="run-a", seed=1)
    b = make_run(tmp_path / "b", seed_truth(), levels=SEED_LEVELS, n_requests=8, concurrency=4, run_id="run-b",
                 seed=2, start=datetime(2026, 1, 15, 14, 0, tzinfo=timezone.utc), thermal_levels=(220,))
    w = pq.read_table(b / "windows.parquet")
    pq.write_table(w.filter(pc.equal(w.column("concurrency"), 4)), b / "windows.parquet")  # a real run: one concurrency
    s = pq.read_table(b / "samples.parquet")
    s = s.set_column(s.column_names.index("sm_clock_mhz"), "sm_clock_mhz",
                     pc.subtract(s.column("sm_clock_mhz"), 300.0))  # B's clock 300 MHz lower
    pq.write_table(s, b / "samples.parquet")
    for run, conc, drafts, cpu in ((a, 1, 2136, 30.0), (b, 4, 3204, 50.0)):
        lv = pq.read_table(run / "levels.parquet")
        lv = lv.filter(pc.equal(lv.column("concurrency"), conc))
        for col, val, typ in (("draft_n", drafts, pa.int64()), ("avg_cpu_power_w", cpu, pa.float64())):
            lv = lv.set_column(lv.column_names.index(col), col, pa.array([val] * lv.num_rows, typ))
        pq.write_table(lv, run / "levels.parquet")
    res = analyze_run([a, b], tmp_path / "out", n_boot=200, plots=False)
    by = {s.series.concurrency: {r["level_value"]: r for r in s.table.to_pylist()} for s in res.series}
    assert sorted(by) == [1, 4]
    for v in SEED_LEVELS:
        assert by[1][float(v)]["draft_n"] == 2136 and by[4][float(v)]["draft_n"] == 3204
        assert by[1][float(v)]["avg_cpu_power_w"] == pytest.approx(30.0)
        assert by[4][float(v)]["avg_cpu_power_w"] == pytest.approx(50.0)
        assert by[1][float(v)]["sm_clock_mhz"] == pytest.approx(by[4][float(v)]["sm_clock_mhz"] + 300.0, abs=5)
    assert by[4][220.0]["thermal_throttle"] and "thermal" in by[4][220.0]["flags"].split(",")
    assert not by[1][220.0]["thermal_throttle"] and "thermal" not in (by[1][220.0]["flags"] or "")


def test_the_analyze_table_marks_the_reference_and_never_prints_minus_zero(tmp_path):
    # The sweep's end table said "300 W (ref)"; analyze's did not, and a level a hair slower printed "-0.0%".
    from powerprof.analysis.report import _no_minus_zero

    run = make_run(tmp_path / "run", seed_truth(), levels=SEED_LEVELS, n_requests=8)
    res = analyze_run([run], tmp_path / "a", n_boot=200, plots=False)
    (line,) = [x for x in console_summary(res).splitlines() if x.lstrip().startswith("300 W")]
    assert "(ref)" in line
    assert f"{_no_minus_zero(-0.04):.1f}" == "0.0" and _no_minus_zero(-0.06) == -0.06 and _no_minus_zero(None) is None


def test_a_run_at_concurrency_above_one_says_so_beside_its_figures(tmp_path):
    # A `--concurrency 4` run's table and recommendation said nothing of it: its J/token and tok/s (the 4 streams
    # together) read as one stream's. A pooled analysis of several concurrencies named only the other series.
    from synthetic_runs import make_concurrent_run

    run = make_concurrent_run(tmp_path / "c4", seed_truth(), 4, levels=SEED_LEVELS, n_requests=8)
    result = analyze_run([run], n_boot=200, plots=False, formats=())
    assert [s.series.concurrency for s in result.series] == [4]
    text = console_summary(result, width=120)
    assert text.splitlines()[0] == "Power limit, concurrency 4 (reference 300 W; tok/s of the streams together):", text
    assert text.splitlines()[1].split() == ["level", "tok/s", "J/token", "±CI%", "slower", "saving", "chosen", "by"]
    assert "tok/s decode at concurrency 4 (the 4 streams together); " in " ".join(text.split()), text
    assert "concurrency 4" in console_summary(result, table=False, width=120)  # the sweep's end screen's part

    both = analyze_run([make_run(tmp_path / "both", seed_truth(), levels=SEED_LEVELS, n_requests=8, concurrency=4)],
                       n_boot=200, plots=False, formats=())
    first = console_summary(both, width=120).splitlines()[0]
    assert first == "Power limit, concurrency 1 (reference 300 W):", first  # which of the series the table is

    one = console_summary(analyze_run([make_run(tmp_path / "c1", seed_truth(), levels=SEED_LEVELS, n_requests=8)],
                                      n_boot=200, plots=False, formats=()), width=120)
    assert one.split()[0] == "level" and "concurrency" not in one, one  # one stream, one series: as before


def test_analyze_into_a_daemons_dataset_folder_is_refused(tmp_path):
    # A daemon's data dir at RUN/analysis (taken before the daemon refused one inside a run): `analyze RUN` wrote its
    # report there, and `export` of the daemon's folder then read analysis.parquet alone, its requests, intervals and
    # samples left out unsaid. `analyze RUN --out NODE` the same.
    from test_fleet import _node  # noqa: PLC0415

    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    _node(run / "analysis", 0)
    _node(tmp_path / "node-1", 1)
    for args, out in (([], run / "analysis"), (["--out", str(tmp_path / "node-1")], tmp_path / "node-1")):
        before = sorted(str(p) for p in out.rglob("*"))
        r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", *args])
        flat = " ".join(r.output.split())
        assert r.exit_code == 2 and f"--out {out} holds a daemon's datasets" in flat, r.output
        assert "give another folder with --out" in flat and "Traceback" not in r.output, r.output
        assert sorted(str(p) for p in out.rglob("*")) == before
        assert ("move the daemon's data out of the run" in flat) == (out == run / "analysis"), r.output


def test_a_reanalysis_removes_the_earlier_outputs_it_does_not_write(tmp_path):
    # `analyze --format html` into a folder of an earlier md+html analysis left its report.md beside the new
    # analysis.json and report.html: "Recommended limit: 300 W" there, 180 W in them, both exits 0.
    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--max-slowdown", "0"])
    assert r.exit_code == 0 and (out / "report.md").exists(), r.output
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--format", "html",
                                  "--max-slowdown", "99%"])
    assert r.exit_code == 0, r.output
    assert not (out / "report.md").exists() and (out / "report.html").exists()
    assert not [f for f in out.iterdir() if f.name.endswith(".tmp")]


def test_a_reanalysis_keeps_the_files_no_analysis_of_it_wrote(tmp_path):
    # It removed by name alone: a copy j_per_token_before.png, a person's tok_s_notes.png, a symlink
    # power_clock_link.png, and a person's own report.md beside an html-only analysis were all unlinked, exit 0.
    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"
    args = ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--format", "html"]
    r = CliRunner().invoke(main, [*args, "--max-slowdown", "0"])
    assert r.exit_code == 0 and not (out / "report.md").exists(), r.output
    mine = {"j_per_token_before.png": (out / "j_per_token.png").read_bytes(), "tok_s_notes.png": b"user notes",
            "report.md": b"# My own write-up: we picked 250 W\n"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    (tmp_path / "target").write_text("kept")
    (out / "power_clock_link.png").symlink_to(tmp_path / "target")
    os.mkfifo(out / "tok_s_pipe.png")  # refused before: "exists and is not a regular file", exit 1
    r = CliRunner().invoke(main, [*args, "--max-slowdown", "99%"])
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO((out / "tok_s_pipe.png").lstat().st_mode)
    assert {name: (out / name).read_bytes() for name in mine} == mine
    assert (out / "power_clock_link.png").is_symlink() and (tmp_path / "target").read_text() == "kept"


def test_two_analyses_into_one_folder_at_once_never_mix_their_files(tmp_path, monkeypatch):
    # Two analyze runs into one --out (no lock): one's report.md and analysis.parquet beside the other's
    # analysis.json and report.html, every exit 0. Now the second is refused while the first writes, nothing mixed.
    import threading

    from powerprof.analysis import report
    from powerprof.analysis.report import AnalysisOutTaken

    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"
    writing, go_on = threading.Event(), threading.Event()
    real = report._write_outputs

    def slow(*args):
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            go_on.wait(30)
        return real(*args)

    monkeypatch.setattr(report, "_write_outputs", slow)
    first: list = []
    t = threading.Thread(target=lambda: first.append(analyze_run([a], out, max_slowdown=0, n_boot=100)))
    t.start()
    assert writing.wait(60)
    with pytest.raises(AnalysisOutTaken, match="another analyze is writing to"):
        analyze_run([a], out, max_slowdown=0.99, n_boot=100)
    go_on.set()
    t.join(60)
    limit = first[0].recommendation.level_value
    assert json.loads((out / "analysis.json").read_text())["recommendation"]["level_value"] == limit
    assert f"Recommended limit: {limit:g} W" in (out / "report.md").read_text()
    # Once it has ended, the next is written.
    assert analyze_run([a], out, max_slowdown=0.99, n_boot=100).files


@pytest.mark.parametrize("code, noted", [(errno.ENOLCK, False), (errno.EIO, True)])
def test_an_out_that_cannot_be_locked_is_written_with_a_note_unless_it_has_no_flock(tmp_path, monkeypatch, code, noted):
    # Every OSError of the flock was swallowed unsaid: written unlocked, where a second analyze could mix its files.
    # A file system with no flock (ENOLCK) is written unlocked as before, without a word each time.
    import fcntl

    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"

    def flock(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", flock)
    r = CliRunner().invoke(main, ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--format", "md"])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and (out / "report.md").exists(), r.output
    assert (f"note: {out} could not be locked ({os.strerror(code)}), so it was written unlocked" in said) == noted, said


def _analyzed_beside_a_dead_pid(tmp_path):
    """An analyze --out folder written once, its arguments, and a process that has exited (its pid free to name)."""
    import subprocess
    import sys

    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"
    args = ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--format", "md"]
    assert CliRunner().invoke(main, args).exit_code == 0
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return out, args, dead


def test_a_reanalysis_says_which_dead_temporaries_it_removed_and_keeps_another_users(tmp_path):
    # The removal was unsaid, and went by name and pid alone: a file of another user in the temporaries' form was
    # removed too. Now only this uid's go, and a note on stderr names them.
    out, args, dead = _analyzed_beside_a_dead_pid(tmp_path)
    ours, theirs = out / f".report.md.{dead.pid}.0123abcd.tmp", out / f".report.html.{dead.pid}.0123abcd.tmp"
    ours.write_text("x")
    if os.geteuid() == 0:  # another user's file can only be made as root
        theirs.write_text("x")
        os.chown(theirs, 54321, 54321)
    r = CliRunner().invoke(main, [*args, "--max-slowdown", "99%"])
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and not ours.exists(), r.output
    assert f"note: removed 1 temporary file that an analyze stopped part-way left in {out} ({ours.name})" in said, said
    assert theirs.exists() == (os.geteuid() == 0) and theirs.name not in said


def test_a_reanalysis_removes_the_temporaries_of_an_analyze_that_died_and_keeps_the_rest(tmp_path):
    # An analyze SIGKILLed between its renames left nine `.NAME.PID.HEX.tmp` (one a hard link to the old
    # analysis.parquet), which no later analyze removed. Now the next one removes those of a dead pid, under its lock.
    out, args, dead = _analyzed_beside_a_dead_pid(tmp_path)
    gone = [out / f".report.md.{dead.pid}.0123abcd.tmp", out / f".j_per_token.png.{dead.pid}.89abcdef.tmp"]
    os.link(out / "analysis.parquet", out / f".analysis.parquet.{dead.pid}.00ff00ff.tmp")
    gone.append(out / f".analysis.parquet.{dead.pid}.00ff00ff.tmp")
    os.link(out / "report.md", out / f".report.md.{dead.pid}.0badf00d.old")  # a kept link whose rename never came
    gone.append(out / f".report.md.{dead.pid}.0badf00d.old")
    kept = [out / f".report.md.{os.getppid()}.0123abcd.tmp", out / f".notes.{dead.pid}.0123abcd.tmp",
            out / f".report.md.{dead.pid}.tmp"]  # a live pid's; no output's name; not a temporary's form
    for f in gone[:2] + kept:
        f.write_text("x")
    r = CliRunner().invoke(main, [*args, "--max-slowdown", "99%"])
    assert r.exit_code == 0, r.output
    assert [f.name for f in gone if f.exists()] == [] and all(f.exists() for f in kept)


_EIO_ON_HTML_AND_ITS_UNDO = (
    "import errno, os, sys\nreal, into = os.replace, []\n"
    "def replace(src, dst):\n"
    "    into.append(os.path.basename(dst))\n"
    "    if into[-1] == 'report.html' or into[-1] == 'report.md' and into.count('report.md') == 2:\n"
    "        raise OSError(errno.EIO, 'Input/output error', str(dst))\n"
    "    return real(src, dst)\n"
    "os.replace = replace\nfrom powerprof.cli import main\nmain(sys.argv[1:])")


def test_a_mixed_writes_kept_old_copy_survives_the_next_analyze_which_names_it(tmp_path):
    # report.html's rename and report.md's put-back both failed (atomic.GroupMixed, in a process that then exited): the
    # old report.md's content stayed in a link, its only copy, which the next analyze removed as a dead analyze's
    # temporary ("removed 1 temporary file"). Now it is kept (`.old`), and the next analyze, which writes every output
    # again (GroupMixed's fix), names it; so does each one after, until the user removes it.
    import re
    import subprocess
    import sys

    a = make_run(tmp_path / "a", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=1)
    out = tmp_path / "o"
    args = ["analyze", str(a), "--bootstrap", "100", "--out", str(out), "--format", "md,html"]
    assert CliRunner().invoke(main, args).exit_code == 0
    old_md = (out / "report.md").read_bytes()
    r = subprocess.run([sys.executable, "-c", _EIO_ON_HTML_AND_ITS_UNDO, *args, "--max-slowdown", "50%"],
                       capture_output=True, text=True, timeout=300)
    said = " ".join(r.stderr.split())
    assert r.returncode == 1 and "MIXED" in said and "Traceback" not in said, said
    kept = Path(re.search(r"the old report\.md is kept as (/\S+\.(?:tmp|old))", said)[1])
    assert kept.read_bytes() == old_md and (out / "report.md").read_bytes() != old_md
    r = CliRunner().invoke(main, args)
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and kept.exists() and kept.read_bytes() == old_md, flat
    assert f"holds an earlier content of report.md, kept as {kept.name}" in flat and "MIXED" not in flat, flat
    assert "removed 1 temporary file" not in flat, flat


def test_a_kept_old_copy_is_named_whatever_its_pid_and_only_this_users(tmp_path, monkeypatch):
    # The kept copies were found as the dead temporaries are, by a pid that answers no kill(pid, 0): one of a write
    # that failed in this very process (the Python API, a notebook), or of a pid reused (1 here), was never named; and
    # another user's file of that form was named as ours, the note saying the folder was left MIXED, which a kill after
    # every rename does not leave it. Under the folder's flock no live analyze owns a `.old` there: each of this euid is
    # named, in words that hold for both causes.
    import errno

    out, args, dead = _analyzed_beside_a_dead_pid(tmp_path)
    args = [*args[:-1], "md,html"]
    assert CliRunner().invoke(main, args).exit_code == 0
    real, into = os.replace, []

    def replace(src, dst):  # report.html's rename and report.md's put-back fail: atomic.GroupMixed
        into.append(os.path.basename(dst))
        if into[-1] == "report.html" or into[-1] == "report.md" and into.count("report.md") == 2:
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    r = CliRunner().invoke(main, [*args, "--max-slowdown", "50%"])
    monkeypatch.setattr(os, "replace", real)
    ours = [f for f in out.iterdir() if f.name.endswith(".old")]
    assert r.exit_code == 1 and "MIXED" in r.output and [f.name.split(".")[3] for f in ours] == [str(os.getpid())]
    reused = out / ".report.html.1.0123abcd.old"  # pid 1: alive, as a pid reused after a reboot
    reused.write_text("an earlier report.html")
    theirs = out / f".analysis.json.{dead.pid}.deadbeef.old"
    if os.geteuid() == 0:  # another user's file can only be made as root
        theirs.write_text("not ours")
        os.chown(theirs, 54321, 54321)
    r = CliRunner().invoke(main, args)
    flat = " ".join(r.output.split())
    assert r.exit_code == 0 and ours[0].exists() and reused.exists(), flat
    assert (f"holds an earlier content of report.html, report.md, kept as {reused.name}, {ours[0].name} by an earlier "
            "write that failed or was killed part-way") in flat and "MIXED" not in flat, flat
    assert theirs.name not in flat and theirs.exists() == (os.geteuid() == 0)


def test_two_runs_whose_ids_make_one_file_name_get_a_timeline_plot_each(tmp_path):
    # Run ids 'r.1' and 'r-1' both made power_clock_r-1.png: one plot, r.1's timeline missing unsaid, and every
    # re-analysis left a hard-linked temporary that the next one called a part-way analyze's. Now each gets its own
    # name (a short hash of its run id), the report links both and says why, and a re-analysis leaves no temporary.
    a = make_run(tmp_path / "ra", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=3, run_id="r.1")
    b = make_run(tmp_path / "rb", seed_truth(), levels=SEED_LEVELS, n_requests=6, seed=4, run_id="r-1")
    out = tmp_path / "out"
    for _ in range(2):
        res = analyze_run([a, b], out, n_boot=100)
        assert res.write_notes == []
        clocks = sorted(f.name for f in out.iterdir() if f.name.startswith("power_clock"))
        assert len(clocks) == 2 and not [f for f in out.iterdir() if f.name.startswith(".")]
        md = (out / "report.md").read_text()
        assert all(f"]({c})" in md for c in clocks)
        assert sum("power_clock" in v for v in res.files.values()) == 2
        note = next(n for n in res.notes if "one file name" in n)
        assert all(c in note for c in clocks) and "r.1" in note and "r-1" in note


R1_HASH = "5cda8694"  # sha256("r.1")[:8], the hash _timeline_keys adds to run r.1's plot name


@pytest.mark.parametrize("ids", [["a", "a", "a_1"], ["r.1", "r-1", f"r-1_{R1_HASH}"], ["a_1", "a", "a"],
                                 ["a", "a", "a_1", "a_1_2"]])
def test_timeline_keys_are_one_name_each_whatever_the_run_ids(ids):
    # ['a', 'a', 'a_1'] gave power_clock_a_1 twice (a's place beside run a_1's own id), and ['r.1', 'r-1',
    # 'r-1_5cda8694'] power_clock_r-1_5cda8694 twice (r.1's hash beside a run of that id): the second plot's
    # staging raised a ValueError, a traceback and nothing written. Now a name taken gets a counter, the same each time.
    keys = _timeline_keys(ids)
    assert len(set(keys)) == len(keys) == len(ids) and keys == _timeline_keys(list(ids))
    assert all(k.startswith("power_clock_") for k in keys)
    note = _same_name_note(ids, keys)
    assert all(f"{k}.png (run {r})" in note for r, k in zip(ids, keys) if k != f"power_clock_{r.replace('.', '-')}")


def test_timeline_keys_keep_the_names_they_gave_without_a_clash():
    assert _timeline_keys(["x"]) == ["power_clock"]
    assert _timeline_keys(["a", "b"]) == ["power_clock_a", "power_clock_b"]
    assert _timeline_keys(["s", "s"]) == ["power_clock_s_1", "power_clock_s_2"]
    assert _timeline_keys(["r.1", "r-1"])[0] == f"power_clock_r-1_{R1_HASH}"
    assert _timeline_keys(["a", "a", "a_1"]) == ["power_clock_a_1", "power_clock_a_2", "power_clock_a_1_2"]
    assert _timeline_keys(["a", "a", "a_1", "a_1_2"])[2:] == ["power_clock_a_1_3", "power_clock_a_1_2"]


def test_analyze_of_runs_whose_ids_clash_with_a_plot_name_writes_a_plot_each(tmp_path):
    # `analyze --force` of runs a, a (two runs, one id) and a_1: a traceback (ValueError from the staging of
    # power_clock_a_1.png twice) and nothing written. Now exit 0, three timelines, each linked and named in the notes.
    runs = [make_run(tmp_path / f"r{i}", seed_truth(), levels=(220, 300), n_requests=5, seed=10 + i, run_id=rid)
            for i, rid in enumerate(["a", "a", "a_1"])]
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["analyze", *map(str, runs), "--force", "--out", str(out), "--bootstrap", "100"])
    assert r.exit_code == 0, r.output
    clocks = sorted(f.name for f in out.glob("power_clock*"))
    assert clocks == ["power_clock_a_1.png", "power_clock_a_1_2.png", "power_clock_a_2.png"]
    md = (out / "report.md").read_text()
    assert all(f"]({c})" in md for c in clocks) and "power_clock_a_1_2.png (run a_1)" in md
