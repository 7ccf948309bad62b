"""Implausible or self-contradicting stored figures: left out of the figures and said with a count, never used as is."""

from __future__ import annotations

import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.analysis.report import analyze_run
from powerprof.cli import main
from synthetic_runs import make_run, seed_truth

LEVELS = (180, 220, 300)


def _run(tmp_path, name="run") -> Path:
    return make_run(tmp_path / name, seed_truth(), levels=LEVELS, n_requests=8)


def _analyze(run, out):
    return analyze_run([run], out, n_boot=200, plots=False, formats=())


def _by_level(res, col):
    return {r["level_value"]: r[col] for r in res.table.to_pylist()}


def _edit(path, fn):
    t = pq.read_table(path)
    rows = [fn(i, dict(r)) for i, r in enumerate(t.to_pylist())]
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), path)


def _first_measured(run, level=220):
    rows = pq.read_table(run / "windows.parquet").to_pylist()
    return next(k for k, r in enumerate(rows) if r["level_value"] == level and not r["warmup"] and r["status"] == "ok")


def _warning(res, kind):
    found = [w for w in res.warnings if w.kind == kind]
    assert len(found) == 1, [(w.kind, w.message) for w in res.warnings]
    return " ".join(found[0].message.split())


@pytest.mark.parametrize("glitch_w", [10000.0, 0.0, -50.0, float("nan")])
def test_glitchy_power_samples_are_left_out_of_the_sensor_figures_and_counted(tmp_path, glitch_w):
    # power_w=10000 on every fifth sample (a sensor glitch, an edited file) lifted 300 W's mean sample power past its
    # limit, so the cap rule read "bound" and cap-not-engaged vanished with no word; 0 W or negative power likewise
    # moved the mean. Truth (the simulator's physics): at 300 W the card draws 274 W, under its limit.
    clean = _analyze(_run(tmp_path, "clean"), tmp_path / "o-clean")
    run = _run(tmp_path)
    _edit(run / "samples.parquet", lambda i, r: dict(r, power_w=glitch_w) if i % 5 == 0 else r)
    res = _analyze(run, tmp_path / "o")
    assert _by_level(res, "cap_not_engaged") == _by_level(clean, "cap_not_engaged")
    assert _by_level(res, "cap_not_engaged")[300.0] is True
    said = _warning(res, "implausible-samples")
    top = seed_truth().max_limit_w  # the card's highest limit (run.json max_limit_w): the bound is twice it
    assert str(run / "samples.parquet") in said and "power" in said and f"{2 * top:g} W" in said, said
    assert "300 W:" in said and "fix" in said.lower(), said


def test_the_power_bound_is_the_highest_limit_of_any_of_the_runs_gpus(tmp_path):
    # A sweep's run.json lists its GPUs (gpus[].max_limit_w); the bound took GPU 0's alone. On a mixed host whose GPU 0
    # is the smaller card (an L4, 72 W), the other card's every reading over 144 W was "implausible": left out of its
    # sensor figures (the cap rule judged on its low readings alone) and blamed on a sensor glitch.
    import json

    clean = _analyze(_run(tmp_path, "clean"), tmp_path / "o-clean")
    run = _run(tmp_path)
    meta = json.loads((run / "run.json").read_text())
    for k in ("min_limit_w", "max_limit_w", "default_limit_w"):
        meta.pop(k)
    truth = seed_truth()
    meta["gpus"] = [{"index": 0, "name": "NVIDIA L4", "min_limit_w": 40.0, "max_limit_w": 72.0, "default_limit_w": 72.0},
                    {"index": 1, "name": truth.gpu_name, "min_limit_w": truth.min_limit_w,
                     "max_limit_w": truth.max_limit_w, "default_limit_w": truth.default_limit_w}]
    (run / "run.json").write_text(json.dumps(meta))
    _edit(run / "samples.parquet", lambda i, r: dict(r, device="gpu1", gpu_index=1) if r["device"] == "gpu0" else r)
    res = _analyze(run, tmp_path / "o")
    assert not [w for w in res.warnings if w.kind == "implausible-samples"], [w.message for w in res.warnings]
    assert _by_level(res, "cap_not_engaged") == _by_level(clean, "cap_not_engaged")


def test_an_inf_sm_clock_reading_is_left_out_and_said_not_a_dash(tmp_path):
    # An inf SM clock in one sample made the level's mean clock inf, printed "–" with no reason.
    clean = _analyze(_run(tmp_path, "clean"), tmp_path / "o-clean")
    run = _run(tmp_path)
    _edit(run / "samples.parquet", lambda i, r: dict(r, sm_clock_mhz=float("inf")) if i % 7 == 0 else r)
    res = _analyze(run, tmp_path / "o")
    for lv, f in _by_level(res, "sm_clock_mhz").items():
        assert f == pytest.approx(_by_level(clean, "sm_clock_mhz")[lv]), lv
    said = _warning(res, "implausible-samples")
    assert "SM clock" in said, said


def _damage_window(tmp_path, **values):
    run = _run(tmp_path)
    i = _first_measured(run)
    _edit(run / "windows.parquet", lambda k, r: dict(r, **values) if k == i else r)
    return run


@pytest.mark.parametrize("values", [
    {"decode_tokens": 0}, {"gpu_energy_j": 0.0}, {"gpu_energy_j": 1e12}, {"gpu_j_per_token": 9.0},
    {"decode_tok_s": 500.0}, {"decode_s": 0.01}, {"decode_tok_s": float("nan")}, {"decode_tok_s": None},
])
def test_a_window_whose_figures_contradict_their_parts_is_left_out_and_counted(tmp_path, values):
    # A window with decode_tokens=0 (or gpu_energy_j 0 or 1e12) and a normal gpu_j_per_token was used as is, and 0 tokens
    # printed "RuntimeWarning: divide by zero" (stats.py). A window with NaN decode_tok_s but its tokens and time stored
    # left 220 W's tok/s with no word (81.1 -> 81.6 tok/s on 7 of 8 windows). Each is now left out of every figure of
    # its level (the same windows for tok/s and J/token) and counted under impossible-figures.
    clean = _analyze(_run(tmp_path, "clean"), tmp_path / "o-clean")
    run = _damage_window(tmp_path, **values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning on stderr
        res = _analyze(run, tmp_path / "o")
    said = _warning(res, "impossible-figures")
    assert "1 of" in said and "220 W: 1" in said, said
    (s,) = res.series
    assert list(s.series.n_windows) == [8, 7, 8]  # the window is in no figure of 220 W, tok/s and J/token alike
    for lv in (180.0, 300.0):  # the other levels are untouched
        assert _by_level(res, "gpu_j_per_token")[lv] == _by_level(clean, "gpu_j_per_token")[lv]
    # 220 W's figures are those of its 7 consistent windows, both of them (the same windows).
    for col in ("gpu_j_per_token", "decode_tok_s"):
        assert _by_level(res, col)[220.0] == pytest.approx(_by_level(clean, col)[220.0], rel=0.02), col


def test_a_consistent_batch_row_with_rounded_tokens_is_not_called_a_contradiction(tmp_path):
    # Guard: a batch row stores decode_tokens rounded to a whole number while its figures use the fractional count
    # (workload/rows.py): within half a token, which is no contradiction.
    run = make_run(tmp_path / "run", seed_truth(), levels=LEVELS, n_requests=8, concurrency=4)

    def fractional(i, r):
        if r["window_kind"] == "batch":
            tokens = r["decode_tokens"] + 0.4
            return dict(r, decode_tok_s=tokens / r["decode_s"], gpu_j_per_token=r["gpu_energy_j"] / tokens)
        return r
    _edit(run / "windows.parquet", fractional)
    res = _analyze(run, tmp_path / "o")
    assert not [w for w in res.warnings if w.kind == "impossible-figures"], [w.message for w in res.warnings]


def test_the_cli_says_the_contradiction_and_keeps_stderr_clean(tmp_path):
    run = _damage_window(tmp_path, decode_tokens=0)
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    assert r.exit_code == 0, (r.output, r.stderr)
    assert "RuntimeWarning" not in r.stderr and "divide" not in r.stderr, r.stderr
    assert "impossible-figures: 1 of" in r.output and "decode_tokens" in " ".join(r.output.split()), r.output


def test_without_the_cards_highest_limit_the_bound_is_the_samples_own_limit(tmp_path):
    # A run.json without max_limit_w (another writer, an older run): the bound falls back on each sample's own limit
    # columns (power_limit_w, enforced_limit_w), so a 10 kW reading is still no draw.
    import json

    run = _run(tmp_path)
    meta = json.loads((run / "run.json").read_text())
    del meta["max_limit_w"]
    (run / "run.json").write_text(json.dumps(meta))
    _edit(run / "samples.parquet", lambda i, r: dict(r, power_w=10000.0) if i % 5 == 0 else r)
    res = _analyze(run, tmp_path / "o")
    assert _by_level(res, "cap_not_engaged")[300.0] is True
    assert "own power limit" in _warning(res, "implausible-samples")


@pytest.mark.parametrize("column", ["warmup", "status"])
def test_a_windows_file_without_warmup_or_status_says_the_column_is_missing(tmp_path, column):
    # Without `warmup` every window read as warm-up (a missing value filled as True), without `status` as failed,
    # and the error blamed that ("all warm-up, failed, or missing") instead of the file.
    run = _run(tmp_path)
    w = pq.read_table(run / "windows.parquet")
    pq.write_table(w.drop_columns([column]), run / "windows.parquet")
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{run / 'windows.parquet'}" in said and f"no {column} column" in said, said
    assert not (run / "analysis").exists()


def _refused(run, *said):
    r = CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100"])
    text = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert f"{run / 'windows.parquet'}" in text and all(s in text for s in said), text
    assert "Traceback" not in r.output and not (run / "analysis").exists()


def test_a_windows_file_without_energy_method_is_refused_not_a_traceback(tmp_path):
    # The level's method was a NaN: "TypeError: sequence item 0: expected str instance, float found" (stats.py).
    run = _run(tmp_path)
    pq.write_table(pq.read_table(run / "windows.parquet").drop_columns(["energy_method"]), run / "windows.parquet")
    _refused(run, "no energy_method column")


@pytest.mark.parametrize("column,said", [("warmup", "are warm-up"), ("status", "are failed")])
def test_a_null_warmup_or_status_is_refused_as_a_missing_column_is(tmp_path, column, said):
    # A null warmup read as false, a null status as ok: the warm-up windows were counted, unflagged (a level's
    # n 8 -> 10 and its J/token moved).
    run = _run(tmp_path)
    _edit(run / "windows.parquet", lambda i, r: dict(r, **{column: None}) if i % 3 == 0 else r)
    _refused(run, f"have no {column} value (null)", said)


def test_windows_of_a_second_run_id_in_a_runs_file_are_refused(tmp_path):
    # Every window stored again under another run_id in the one file passed the stored-twice check (its key holds
    # run_id): n doubled at every level and each CI was too narrow, unflagged.
    run = _run(tmp_path)
    t = pq.read_table(run / "windows.parquet")
    copy = t.set_column(t.column_names.index("run_id"), "run_id", pa.array(["other"] * t.num_rows, pa.string()))
    pq.write_table(pa.concat_tables([t, copy]), run / "windows.parquet")
    _refused(run, f"{t.num_rows} of {2 * t.num_rows} windows have run_id 'other'", "a run folder holds one run")


def test_a_level_whose_every_reading_is_idle_has_no_clock_figure_and_says_why(tmp_path):
    # The level's clock figures are its busy readings' (engine.BUSY_SQL: an idle reading shows the clock's floor). Where
    # every reading inside 220 W's windows was idle (GpuIdle: a stalled server, a GPU another tool held), its SM and
    # memory clock were empty, a "-" in the table with no flag and no word.
    clean = _analyze(_run(tmp_path, "clean"), tmp_path / "o-clean")
    run = _run(tmp_path)
    _edit(run / "samples.parquet", lambda i, r: dict(r, clock_event_reasons=(r["clock_event_reasons"] or 0) | 1)
          if r["level_value"] == 220.0 and r["source"] == "nvml" else r)
    res = _analyze(run, tmp_path / "o")
    clocks = _by_level(res, "sm_clock_mhz")
    assert clocks[220.0] is None and _by_level(res, "mem_clock_mhz")[220.0] is None
    assert clocks[180.0] == pytest.approx(_by_level(clean, "sm_clock_mhz")[180.0])
    flags = _by_level(res, "flags")
    assert "no-busy-reading" in (flags[220.0] or "") and "no-busy-reading" not in (flags[180.0] or ""), flags
    said = _warning(res, "no-busy-reading")
    assert "220 W" in said and "idle" in said and "fix" in said.lower(), said
