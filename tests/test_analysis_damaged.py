"""Damaged, foreign or odd run directories: `analyze` gives a clear error or a visible flag, never a quiet figure."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.analysis.loading import AnalysisError
from powerprof.analysis.report import analyze_run, console_summary
from powerprof.cli import main
from synthetic_runs import make_run, seed_truth

LEVELS = (180, 220, 300)


def _run(tmp_path, name="run", **kw) -> Path:
    kw.setdefault("levels", LEVELS)
    return make_run(tmp_path / name, seed_truth(), n_requests=8, **kw)


def _edit_rows(run, fn):
    w = pq.read_table(run / "windows.parquet")
    rows = [fn(dict(r)) for r in w.to_pylist()]
    pq.write_table(pa.Table.from_pylist(rows, schema=w.schema), run / "windows.parquet")


@pytest.mark.parametrize("name", ["windows.parquet", "samples.parquet", "levels.parquet"])
def test_a_table_cut_short_by_a_crash_is_named_not_analysed(tmp_path, name):
    # Guard: a file cut mid-write (a crash, a full disk, a partial copy) stops the analysis naming it.
    run = _run(tmp_path)
    data = (run / name).read_bytes()
    (run / name).write_bytes(data[: len(data) // 2])
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and f"{run / name}: cannot be read as Parquet" in r.output, r.output
    assert not (run / "analysis").exists()


@pytest.mark.parametrize("text", ["[1, 2]", '"a run"', "null"])
def test_run_json_that_is_not_an_object_is_said_not_a_traceback(tmp_path, text):
    # A run.json holding a list (a tool that rewrote it, a hand edit) died with AttributeError: 'list' object has no attribute 'get'.
    run = _run(tmp_path)
    (run / "run.json").write_text(text)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{run / 'run.json'}: not a JSON object" in r.output, r.output


def test_windows_from_an_older_schema_give_the_same_figures(tmp_path):
    # Guard: a windows.parquet written before the appended columns (timing, configs, CPU time) is read as it is.
    run = _run(tmp_path)
    new = analyze_run([run], tmp_path / "new", n_boot=200, plots=False, formats=())
    w = pq.read_table(run / "windows.parquet")
    pq.write_table(w.select(w.column_names[: w.column_names.index("timing")]), run / "windows.parquet")
    old = analyze_run([run], tmp_path / "old", n_boot=200, plots=False, formats=())
    for c in ("gpu_j_per_token", "decode_tok_s", "energy_saving_pct"):
        assert old.table.column(c).to_pylist() == new.table.column(c).to_pylist(), c


def test_windows_stored_twice_in_one_file_count_once_and_are_said(tmp_path):
    # A windows.parquet holding every row twice (two files concatenated with pandas, a writer run twice) counted
    # each window twice: n_requests 16 for 8 and every CI √2 too narrow (180 W: ±0.97% shown for ±1.59%).
    run = _run(tmp_path)
    once = analyze_run([run], tmp_path / "once", n_boot=300, plots=False, formats=())
    w = pq.read_table(run / "windows.parquet")
    pq.write_table(pa.concat_tables([w, w]), run / "windows.parquet")
    twice = analyze_run([run], tmp_path / "twice", n_boot=300, plots=False, formats=())
    for c in ("n_requests", "n_failed", "ci_reached_pct", "gpu_j_per_token"):
        assert twice.table.column(c).to_pylist() == once.table.column(c).to_pylist(), c
    (warn,) = [x for x in twice.warnings if x.kind == "duplicate-windows"]
    assert str(run / "windows.parquet") in warn.message and f"{w.num_rows} " in warn.message


def test_a_level_without_figures_is_never_said_slower_or_costlier(tmp_path):
    # Every request at 220 W failed: the recommendation read "every lower level is slower than the budget allows
    # (220 W: –% slower, energy per token unknown)". Its energy missing instead: "no lower level within the budget
    # uses less energy per token (220 W: 6.3% slower, energy per token unknown)". Neither is known.
    failed = _run(tmp_path, "failed")
    _edit_rows(failed, lambda r: dict(r, status="failed") if r["level_value"] == 220 else r)
    no_energy = _run(tmp_path, "no-energy")
    _edit_rows(no_energy, lambda r: dict(r, gpu_energy_j=None, gpu_j_per_token=None, energy_method="none")
               if r["level_value"] == 220 else r)
    for run in (failed, no_energy):
        res = analyze_run([run], tmp_path / f"o-{run.name}", n_boot=200, plots=False, formats=())
        assert res.recommendation.level_value == 300
        said = " ".join(console_summary(res).split())
        rec = said[said.index("Recommended limit"):said.index("Other policies")]
        assert "(220 W:" not in rec and "220 W has no figures to compare" in rec, rec


def test_a_flagged_reference_is_said_beside_every_comparison_with_it(tmp_path):
    # 300 W, the reference, was thermally throttled: "220 W: 6.3% slower, 15.3% less energy per token than 300 W"
    # was compared with a level whose figures are not the limit's effect, and only the thermal line said 300 W.
    run = _run(tmp_path, thermal_levels=(300,))
    res = analyze_run([run], tmp_path / "o", n_boot=200, plots=False, formats=())
    (warn,) = [w for w in res.warnings if w.kind == "reference"]
    assert warn.levels == (300.0,) and "thermal" in warn.message and "against" in warn.message
    assert res.warnings[0].kind == "reference"  # said first: every figure after it is relative to it


def test_a_copy_of_a_run_whose_windows_differ_in_bytes_is_refused(tmp_path):
    # `analyze run copy`, the copy's windows.parquet joined to itself: its bytes differ, so it was pooled as another
    # run, every window and sample counted twice (n_requests doubled, every CI about √2 too narrow).
    run = _run(tmp_path)
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(run, copy)
    w = pq.read_table(copy / "windows.parquet")
    pq.write_table(pa.concat_tables([w, w]), copy / "windows.parquet")
    with pytest.raises(AnalysisError, match="hold the same run") as e:
        analyze_run([run, copy], tmp_path / "o", n_boot=200, plots=False, formats=())
    assert "run_id" in str(e.value) and "give it once" in str(e.value)
    r = CliRunner().invoke(main, ["analyze", str(run), str(copy), "--out", str(tmp_path / "o2")])
    assert r.exit_code != 0 and "hold the same run" in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -220.0])
def test_windows_whose_level_is_nan_are_refused_by_name_not_dropped(tmp_path, bad):
    # A power-limit window with level_value NaN is at no level: the series kept only finite levels, so those windows
    # left every figure with no word (2 of 12 windows gone, their energy in no level's J/token). Zero and negative
    # levels are none either: a negated column was analysed, "Recommended limit: -180 W", exit 0.
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6)
    t = pq.read_table(run / "windows.parquet")
    lv = t.column("level_value").to_pylist()
    lv[0] = lv[1] = bad
    pq.write_table(t.set_column(t.schema.get_field_index("level_value"), "level_value", pa.array(lv, pa.float64())),
                   run / "windows.parquet")
    r = CliRunner().invoke(main, ["analyze", str(run)])
    assert r.exit_code != 0, r.output
    said = " ".join(r.output.split())
    assert "2 windows" in said and f"level_value {'NaN' if bad != bad else f'{bad:g}'}" in said, said
    assert "power_limit" in said, said
    assert str(run / "windows.parquet") in said and "Traceback" not in r.output, said


@pytest.mark.parametrize("kind", [None, "none"])
def test_negated_levels_of_no_set_kind_are_refused_too(tmp_path, kind):
    # The review's case: level_value negated and level_kind null or "none" (as the settings as they are): the rule
    # skipped those kinds, and "Recommended limit: -220 W", exit 0.
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6)
    t = pq.read_table(run / "windows.parquet")
    lv = [None if v is None else -v for v in t.column("level_value").to_pylist()]
    t = t.set_column(t.schema.get_field_index("level_value"), "level_value", pa.array(lv, pa.float64()))
    t = t.set_column(t.schema.get_field_index("level_kind"), "level_kind", pa.array([kind] * t.num_rows, pa.string()))
    pq.write_table(t, run / "windows.parquet")
    r = CliRunner().invoke(main, ["analyze", str(run)])
    assert r.exit_code != 0 and "-220 W" not in r.output and "level_value -220" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("damage", ["binary", "folder"])
def test_a_run_json_that_cannot_be_read_as_text_is_said_not_a_traceback(tmp_path, damage):
    # A run.json of bytes that are no UTF-8 (a disk error, another tool's file) died with UnicodeDecodeError, and a
    # folder by that name with IsADirectoryError: Python tracebacks. (`export` copies the tables as they are and
    # reads run.json only for an xlsx summary sheet, which leaves out one it cannot read.)
    run = _run(tmp_path)
    (run / "run.json").unlink()
    if damage == "binary":
        (run / "run.json").write_bytes(b"\xff\xfe\x00garbage")
    else:
        (run / "run.json").mkdir()
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{run / 'run.json'}: cannot be read" in r.output and "move it aside" in r.output, r.output
    assert not (run / "analysis").exists()


def test_a_token_count_beyond_what_a_float_holds_exactly_is_left_out_not_a_traceback(tmp_path):
    # decode_tokens of -2**60 in an int64 column (another tool's file, a damaged one; powerprof writes int32) stopped the
    # analysis with ArrowInvalid ("Integer value ... not in range"): a traceback. The window's figures cannot be: it
    # is left out and said, as a negative count that fits is.
    run = _run(tmp_path)
    w = pq.read_table(run / "windows.parquet")
    rows = w.to_pylist()
    i = next(k for k, r in enumerate(rows) if r["level_value"] == 220 and not r["warmup"] and r["status"] == "ok")
    rows[i]["decode_tokens"] = -2**60
    schema = w.schema.set(w.schema.get_field_index("decode_tokens"), pa.field("decode_tokens", pa.int64()))
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), run / "windows.parquet")
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 0 and r.exception is None, (r.output, r.exception)
    assert "impossible-figures: 1 of" in r.output and "220 W: 1" in r.output, r.output


def test_a_run_whose_every_request_failed_says_so_not_that_energy_is_missing(tmp_path):
    # Every request failed (a server answering errors): analyze said "no window has a GPU energy (energy_method none
    # everywhere)", sending the user to their energy counter instead of their server.
    run = _run(tmp_path)
    _edit_rows(run, lambda r: {**r, "status": "error", "error": "HTTP 500"})
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "energy_method none" not in r.output and "failed" in r.output and "error column" in r.output, r.output
    assert not (run / "analysis").exists()


def test_a_run_whose_every_window_was_left_out_says_why_not_that_requests_failed(tmp_path):
    # Every stream came through a buffering proxy (all in one burst: untrusted timing), none failed: analyze said
    # "0 requests failed (status not ok) ... fix the server and measure again", the wrong cause and the wrong fix.
    run = _run(tmp_path, n_failed=0)
    _edit_rows(run, lambda r: {**r, "timing": "untrusted", "timing_reason": "all tokens arrived in one read",
                               "decode_tok_s": None, "gpu_j_per_token": None, "gpu_energy_j": None})
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    said = " ".join(r.output.split())
    assert "failed" not in said and "fix the server" not in said, said
    assert "token timing cannot be trusted" in said and "fix:" in said, said
    assert not (run / "analysis").exists()


def test_a_run_whose_every_window_ran_beside_others_work_says_so(tmp_path):
    # Another client throughout: every window flagged foreign_traffic, none failed; the error blamed the server.
    run = _run(tmp_path, n_failed=0)
    _edit_rows(run, lambda r: {**r, "foreign_traffic": "3 request(s) not powerprof's in flight"})
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    said = " ".join(r.output.split())
    assert "fix the server" not in said and "others' work" in said and "stop the other clients" in said, said


@pytest.mark.parametrize("table, column", [("windows", "warmup"), ("windows", "gpu_energy_j"),
                                           ("samples", "power_w")])
def test_a_column_stored_as_another_kind_is_refused_as_export_refuses_it(tmp_path, table, column):
    # export refuses a run's table whose column holds another kind of value than powerprof writes (storage/datafiles);
    # analyze died on warmup as text with "ArrowTypeError: Expected bytes, got a 'bool' object" (a traceback, nothing
    # on the screen), read gpu_energy_j as text by parsing it, and blamed power_w as text on a damaged Parquet file.
    run = _run(tmp_path)
    path = run / f"{table}.parquet"
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    t = t.set_column(i, column, pa.array([None if v is None else str(v) for v in t.column(i).to_pylist()], pa.string()))
    pq.write_table(t, path)
    _refused_alike(tmp_path, run, path, column)
    assert not (run / "analysis").exists()


@pytest.mark.parametrize("arrow_type", [pa.decimal128(20, 0), pa.float64()])
def test_clock_event_reasons_stored_as_a_number_with_a_fraction_is_refused_as_other_kinds_are(tmp_path, arrow_type):
    # clock_event_reasons is a bitmask (its bits are read: GpuIdle, SwPowerCap, ...). Stored as decimals (or doubles: a
    # file rewritten by another tool) it passed the type rule as "a number", then DuckDB found no `&` for it and
    # analyze called the file damaged. Refused by the rule, in the sentence of every other type refusal.
    run = _run(tmp_path)
    path = run / "samples.parquet"
    t = pq.read_table(path)
    i = t.schema.get_field_index("clock_event_reasons")
    t = t.set_column(i, "clock_event_reasons", t.column(i).cast(arrow_type))
    pq.write_table(t, path)
    text = _refused_alike(tmp_path, run, path, "clock_event_reasons")
    assert "damaged" not in text and "cannot be read as Parquet" not in text, text


def _refused_alike(tmp_path, run, path, column) -> str:
    """analyze and export both refuse `path` for `column` (exit 1), naming them and the fix, in one sentence."""
    said = []
    for args in (["analyze", str(run), "--bootstrap", "100"],
                 ["export", str(path), "--format", "csv", "--out", str(tmp_path / "e.csv")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
        text = " ".join(r.output.split())
        assert str(path) in text and f"column {column}" in text and "move the file out" in text, text
        said.append(text)
    assert said[0] == said[1]
    return said[0]


def test_a_trace_runs_windows_left_out_are_counted_as_replays_not_with_their_requests():
    # sweep --trace's figures are its replay rows (one a level); the replay's request rows are there beside them, left
    # out with them. A trace run whose every replay ran beside others' work was told "18 windows ran beside others'
    # work" of 2 replays of 8 requests each, and one whose replays a lagging sampler left out at their level's end
    # "16 of 18 windows left out": the request rows counted as windows the figures would have used.
    from powerprof.analysis.checks import nothing_measured_text, timing_findings

    def rows(**marks):
        out = []
        for value in (300.0, 200.0):
            for kind in ["request"] * 8 + ["trace"]:
                out.append({"run_id": "r1", "window_kind": kind, "concurrency": 1, "warmup": False, "status": "ok",
                            "level_kind": "power_limit", "level_value": value, "timing": "stream",
                            "timing_reason": None, "foreign_traffic": None, **marks})
        return pa.Table.from_pylist(out)

    said = nothing_measured_text(rows(foreign_traffic="3 request(s) not powerprof's in flight"), 0)
    assert "2 windows ran beside others' work" in said, said
    unvouched = rows(timing="untrusted", timing_reason="no GPU reading taken after this window ended arrived within "
                                                       "2.4 s of the level's end")
    said = nothing_measured_text(unvouched, 0)
    assert "2 of 2 windows left out" in said, said
    [f] = timing_findings(unvouched)
    assert f.message.startswith("2 of 2 windows left out"), f.message


@pytest.mark.parametrize("column, value", [("cap_not_engaged", "false"), ("sm_clock_mhz", "1400.0")])
def test_a_levels_column_stored_as_another_kind_is_refused_as_export_refuses_it(tmp_path, column, value):
    # The type rule reached windows.parquet and samples.parquet, not levels.parquet, whose sensor columns analyze carries
    # into its figures: cap_not_engaged as text was "Error: RUN: Could not convert 'false' with type str: tried to
    # convert to boolean" (no file, no column, no fix), where export named them.
    run = _run(tmp_path)
    path = run / "levels.parquet"
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    t = t.set_column(i, column, pa.array([value] * t.num_rows, pa.string()))
    pq.write_table(t, path)
    _refused_alike(tmp_path, run, path, column)
    assert not (run / "analysis").exists()
