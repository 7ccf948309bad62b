"""A disk that fills while `sweep` or `measure` writes its run: the error names the folder, the cause and the fix,
the GPU is back, what was stored is whole and said, and `measure` still prints what it measured. (The daemon's own
full disk: tests/test_daemon_fulldisk.py.)"""

from __future__ import annotations

import errno
import json

import pytest
from click.testing import CliRunner

import powerprof.storage.runs as runs
from powerprof.cli import main
from powerprof.sim.nvml import SimNVML

ENOSPC = OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")  # pyarrow's words


def _fill_disk_at(monkeypatch, table: str, nth: int) -> list:
    """The `nth` write of `table`'s Parquet file (1 = its first) and every write after it fail as a full disk does."""
    real = runs.atomic_write_table
    seen = []

    def write(path, tbl, metadata=None):
        if path.name == f"{table}.parquet":
            seen.append(path)
        if len(seen) >= nth:
            raise ENOSPC
        return real(path, tbl, metadata)

    monkeypatch.setattr(runs, "atomic_write_table", write)
    return seen


def test_a_disk_that_fills_mid_sweep_names_the_run_the_cause_and_the_fix_and_the_gpu_is_back(tmp_path, monkeypatch):
    # Before: `Error: [Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device` alone: no
    # folder, no fix, and not the "every GPU is back" line every other failed sweep ends with.
    _fill_disk_at(monkeypatch, "windows", 2)  # level 300's tables are written, level 200's are not
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["sweep", "--limits", "300,200", "--simulate", "--out", str(out), "--idle-s", "0",
                                  "--max-tokens", "32", "--min-requests", "2", "--max-requests", "2", "--warmup", "0"])
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert f"cannot write the run's tables to {out}: No space left on device" in flat, r.output
    assert "fix: free space" in flat and "Traceback" not in r.output, r.output
    assert flat.rstrip().endswith("every GPU is back at its original limit"), r.output
    assert f"stopped: 1 finished level kept in {out}" in flat, r.output
    assert json.loads((out / "run.json").read_text())["levels_done"] == [[300.0, 0]]
    assert SimNVML("seed-16g").gpus[0].limit_w == 300.0


def test_a_run_folder_removed_mid_sweep_is_said_as_gone_not_as_a_full_disk_with_levels_kept(tmp_path, monkeypatch):
    # `rm -rf` of the --out folder at the second level, a file put in its place: it said "stopped: 1 finished level
    # kept in …" and "the levels in run.json's levels_done were stored before it; fix: free space on that disk",
    # though nothing was kept and the cause was "Not a directory".
    import shutil

    out = tmp_path / "run"
    real = runs.atomic_write_table
    seen = []

    def write(path, tbl, metadata=None):
        if path.name == "windows.parquet":
            seen.append(path)
            if len(seen) == 2:
                shutil.rmtree(out)
                out.write_text("")
        return real(path, tbl, metadata)

    monkeypatch.setattr(runs, "atomic_write_table", write)
    r = CliRunner().invoke(main, ["sweep", "--limits", "300,200", "--simulate", "--out", str(out), "--idle-s", "0",
                                  "--max-tokens", "32", "--min-requests", "2", "--max-requests", "2", "--warmup", "0"])
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert "kept in" not in flat and "free space" not in flat and "levels_done were stored" not in flat, r.output
    assert f"the run folder {out} is no longer a folder (removed or replaced while the sweep ran)" in flat, r.output
    assert "nothing of this run was kept" in flat and "rerun" in flat, r.output
    assert flat.rstrip().endswith("every GPU is back at its original limit"), r.output
    assert SimNVML("seed-16g").gpus[0].limit_w == 300.0


def test_a_disk_that_fills_as_measure_writes_prints_the_figures_and_leaves_no_half_run(tmp_path, monkeypatch):
    # Before: a traceback, the figures measured never printed, and run.json left without its windows.parquet
    # ("run.json and its table, or neither").
    _fill_disk_at(monkeypatch, "windows", 1)
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "--requests", "3", "--max-tokens", "32", "--out", str(out)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output, r.output
    flat = " ".join(r.output.split())
    assert "concurrency" in r.output and "counter" in r.output, r.output  # the measured row is printed
    assert f"cannot write the measurement to {out}: No space left on device" in flat, r.output
    assert "nothing was stored" in flat and "fix: free space" in flat, r.output
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_a_measure_write_failing_for_another_cause_is_not_told_to_free_space(tmp_path, monkeypatch):
    # A read-only file system (or a folder made read-only) was said as a full disk: "fix: free space on that disk".
    real = runs.atomic_write_table

    def write(path, tbl, metadata=None):
        if path.name == "windows.parquet":
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, tbl, metadata)

    monkeypatch.setattr(runs, "atomic_write_table", write)
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "--requests", "3", "--max-tokens", "32", "--out", str(out)])
    assert r.exit_code == 1, r.output
    flat = " ".join(r.output.split())
    assert f"cannot write the measurement to {out}: Read-only file system" in flat, r.output
    assert "free space" not in flat and "fix: remove that cause (or give another --out) and rerun" in flat, r.output


def test_a_failed_run_json_write_leaves_the_writers_record_as_the_file_is(tmp_path, monkeypatch):
    # What the writer says it holds (levels_done, which the sweep's stop line counts) is what is on disk.
    w = runs.RunWriter(tmp_path / "r", {"kind": "sweep", "levels_done": []})

    def full(*a, **k):
        raise ENOSPC

    monkeypatch.setattr(runs, "atomic_write_bytes", full)
    with pytest.raises(OSError):
        w.write_json(levels_done=[[300.0, 0]])
    assert w.metadata["levels_done"] == [] == json.loads((tmp_path / "r" / "run.json").read_text())["levels_done"]


def test_measures_notes_on_a_full_disk_point_at_no_file_that_was_never_written(tmp_path, monkeypatch):
    # Before: "note: concurrency 1: the windows' own J/token (windows.parquet) read whole steps of the GPU energy
    # counter ..." above "cannot write the measurement ...; nothing was stored": the note sent the user to a file
    # that was never written. (The rounding rule is forced on: whether 32-token windows trip it depends on timing.)
    import powerprof.workload.measure as measure

    monkeypatch.setattr(measure, "median_off_by_rounding", lambda *a, **k: True)
    _fill_disk_at(monkeypatch, "windows", 1)
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "--requests", "3", "--max-tokens", "32", "--out", str(out)])
    assert r.exit_code == 1, r.output
    notes = [line for line in r.output.splitlines() if line.startswith("note: ")]
    rounding = [n for n in notes if "whole steps of the GPU energy counter" in n]
    assert rounding, r.output  # the note is still said, with its figures
    assert "median" in rounding[0] and "fix: longer requests" in rounding[0], rounding[0]
    assert not any("windows.parquet" in n or "run.json" in n for n in notes), notes
    assert "nothing was stored" in " ".join(r.output.split()), r.output
    rj = CliRunner().invoke(main, ["measure", "--simulate", "--requests", "3", "--max-tokens", "32", "--out",
                                   str(tmp_path / "j"), "--json"])
    assert rj.exit_code == 1, rj.output
    body = json.loads(rj.output[:rj.output.rindex("}") + 1])
    assert body["write_error"] and body["windows_path"] is None, body
    assert not any("windows.parquet" in n for n in body["notes"]), body["notes"]
