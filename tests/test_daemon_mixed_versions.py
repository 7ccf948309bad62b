"""A daemon folder holding files of two writer versions: the newer columns survive `export` and `analyze`.

pyarrow takes a folder's schema from its first file: where the first part file was written before a column
(`server_count` on intervals and tags, `other_cpu_pct`, `prompt_tokens_estimate`), `export` wrote every row without
it, the newer files' values dropped with nothing said. Now every file's columns are read (export.open_dataset), a
file without one reads it as null (unknown: the notes say how many rows), in either order of the files."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import duckdb

from powerprof.analysis import export as ex
from powerprof.analysis.fleet import fleet_summary, tag_summary
from powerprof.cli import main
from powerprof.daemon.service import datasets
from powerprof.daemon.store import DatasetStore

S = 1_000_000_000
T0_NS = 1_768_478_400 * 10**9  # 2026-01-15 12:00 UTC
# The columns added to each table in recent versions: an "old" file is a new one without them.
NEWER = {"intervals": ("server_count", "other_cpu_pct", "energy_note"),
         "tags": ("server_count", "other_cpu_pct", "unproxied_energy_j", "energy_note"),
         "requests": ("other_cpu_pct", "prompt_tokens_estimate")}


def _rows(first: int, n: int) -> dict[str, list[dict]]:
    """n seconds of intervals, requests and 1 s tags from second `first` on: the newer columns filled."""
    iv = [{"daemon_id": "d0", "t_start_utc": T0_NS + i * S, "t_end_utc": T0_NS + (i + 1) * S, "t_start_mono_s": float(i),
           "duration_s": 1.0, "kind": "decode", "gpu_energy_j": 300.0, "other_cpu_pct": 5.0,
           "server_count": "complete", "energy_note": "CPU energy not read: no RAPL on this host"}
          for i in range(first, first + n)]
    rq = [{"daemon_id": "d0", "request_id": i, "t_arrival_utc": T0_NS + i * S, "outcome": "ok", "generated_tokens": 100,
           "gpu_energy_j": 100.0, "attributed_tokens": 100.0, "ttft_s": 0.1, "other_cpu_pct": 5.0,
           "prompt_tokens_estimate": 50.0} for i in range(first, first + n)]
    tg = [{"daemon_id": "d0", "name": "job", "t_start_utc": T0_NS + i * S, "t_end_utc": T0_NS + (i + 1) * S,
           "duration_s": 1.0, "gpu_energy_j": 300.0, "unproxied_energy_j": 100.0, "proxy_tokens": 100.0,
           "gpu_j_per_token": 2.0, "closed_by": "stop", "other_cpu_pct": 5.0, "server_count": "complete",
           "energy_note": "CPU energy not read: no RAPL on this host"} for i in range(first, first + n)]
    return {"intervals": iv, "requests": rq, "tags": tg}


def _mixed(root, old_first: bool):
    """A daemon folder whose one day holds an old writer's file (the newer columns absent) and a new one's, the old
    file sorting first (old_first) or last."""
    for version, first in (("old", 0), ("new", 10)):
        store = DatasetStore(root / version, datasets(), host="node-0")
        for table, rows in _rows(first, 10).items():
            store.append(table, rows)
        assert store.flush()
    for table, cols in NEWER.items():
        for version in ("old", "new"):
            (src,) = (root / version / table).glob("date=*/*.parquet")
            dst = root / "data" / table / src.parent.name
            dst.mkdir(parents=True, exist_ok=True)
            name = "part-0.parquet" if (version == "old") == old_first else "part-1.parquet"
            t = pq.read_table(src)
            if version == "old":
                assert set(cols) <= set(t.column_names)
                t = t.drop_columns(list(cols))
            pq.write_table(t, dst / name)
    for version in ("old", "new"):
        shutil.rmtree(root / version)
    return root / "data"


@pytest.mark.parametrize("old_first", [True, False], ids=["old-file-first", "new-file-first"])
def test_export_keeps_newer_columns_beside_older_files_and_says_where_they_are_unknown(tmp_path, old_first):
    data = _mixed(tmp_path, old_first)
    notes: list[str] = []
    paths = ex.export(data, "parquet", tmp_path / "out", notes=notes)
    got = {p.stem: pq.read_table(p) for p in paths}
    for table, cols in NEWER.items():
        t = got[table]
        assert t.num_rows == 20, table
        for c in cols:
            assert c in t.column_names, (table, c, t.column_names)
            vals = t.column(c).to_pylist()
            # the new writer's 10 rows keep their values; the old one's are empty (unknown), never made up
            assert sum(v is not None for v in vals) == 10 and vals.count(None) == 10, (table, c, vals)
        said = [n for n in notes if n.startswith(f"{table}: ")]
        assert said and all(c in said[0] for c in cols) and "10 rows" in said[0] and "unknown" in said[0], notes


@pytest.mark.parametrize("old_first", [True, False], ids=["old-file-first", "new-file-first"])
def test_export_csv_of_one_table_keeps_the_newer_column(tmp_path, old_first):
    data = _mixed(tmp_path, old_first)
    (path,) = ex.export(data / "tags", "csv", tmp_path / "tags.csv")
    header, *lines = path.read_text().splitlines()
    assert "server_count" in header and len(lines) == 20
    assert sum(line.count("complete") for line in lines) == 10


@pytest.mark.parametrize("old_first", [True, False], ids=["old-file-first", "new-file-first"])
def test_analyze_reads_both_versions_old_rows_unknown(tmp_path, old_first):
    data = _mixed(tmp_path, old_first)
    [h] = fleet_summary([str(data)]).to_pylist()
    assert h["requests"] == 20 and h["bypass_unknown_intervals"] == 10 and h["bypass_uncertain_intervals"] == 0
    [t] = tag_summary([str(data)]).to_pylist()
    # the old writer's 10 windows have no server count: unknown, left out of the tag's J/token and counted
    assert t["windows"] == 20 and t["counted_windows"] == 10 and t["bypass_unknown_windows"] == 10
    assert t["gpu_j_per_token"] == pytest.approx(2.0)  # (300 J - 100 J of bypass traffic) / 100 tokens
    res = CliRunner().invoke(main, ["analyze", str(data)])
    assert res.exit_code == 0, res.output
    assert "job" in res.stdout and "2.000" in res.stdout, res.stdout
    assert "node-0 job: 10 of 20" in res.stderr, res.stderr


def _old_only(root):
    """A daemon folder every file of which was written before the newer columns (NEWER), interval energy_note too."""
    for table, rows in _rows(0, 10).items():
        store = DatasetStore(root / "new", datasets(), host="node-0")
        store.append(table, rows)
        assert store.flush()
        (src,) = (root / "new" / table).glob("date=*/*.parquet")
        dst = root / "data" / table / src.parent.name
        dst.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(src).drop_columns(list(NEWER[table])), dst / "part-0.parquet")
        shutil.rmtree(root / "new")
    return root / "data"


@pytest.mark.parametrize("layout", ["mixed", "old-only"])
def test_interval_rows_without_energy_note_are_read_by_analyze_export_and_the_fleet_sql(tmp_path, layout):
    # The interval rows' energy_note is newer than these files: a folder of them alone, or beside newer ones, must
    # still be read whole by every reader (nothing refused, no row lost, the column null where it was not written).
    data = _mixed(tmp_path, True) if layout == "mixed" else _old_only(tmp_path)
    n = 20 if layout == "mixed" else 10
    [h] = fleet_summary([str(data)]).to_pylist()
    assert h["requests"] == n and h["gpu_energy_j"] == pytest.approx(300.0 * n), h
    res = CliRunner().invoke(main, ["analyze", str(data)])
    assert res.exit_code == 0, res.output
    paths = ex.export(data, "parquet", tmp_path / "out")
    iv = {p.stem: pq.read_table(p) for p in paths}["intervals"]
    assert iv.num_rows == n
    notes = iv.column("energy_note").to_pylist() if "energy_note" in iv.column_names else [None] * n
    assert notes.count(None) == 10 and sum(v is not None for v in notes) == n - 10, notes
    # docs/fleet.md's query, as written, over this node's folder
    fleet = tmp_path / "fleet"
    shutil.copytree(data, fleet / "node-0")
    sql = re.search(r"```sql duckdb\n(.*?)```", (Path(__file__).resolve().parents[1] / "docs" / "fleet.md").read_text(),
                    re.S).group(1)
    con = duckdb.connect()
    rows = con.execute(sql.replace("/var/lib/powerprof-fleet", str(fleet))).fetchall()
    got = [dict(zip([d[0] for d in con.description], r)) for r in rows]
    assert [r["host"] for r in got] == ["node-0"] and got[0]["gpu_energy_j"] == pytest.approx(300.0 * n), got


@pytest.mark.parametrize("layout", ["mixed", "old-only"])
def test_tag_rows_without_energy_note_are_read_by_analyze_export_and_the_fleet_sql(tmp_path, layout):
    # The tag rows' energy_note is newer than these files: a folder of them alone, or beside newer ones, must still be
    # read whole by `analyze`'s tag table (the fleet SQL, analysis/fleet.py) and `export` (the column null where it was
    # not written, nothing refused, no window lost).
    data = _mixed(tmp_path, True) if layout == "mixed" else _old_only(tmp_path)
    n = 20 if layout == "mixed" else 10
    [t] = tag_summary([str(data)]).to_pylist()
    # every window read; the old ones (no server_count either) unknown, left out of the figures and counted
    assert t["windows"] == n and t["counted_windows"] == n - 10 and t["bypass_unknown_windows"] == 10, t
    assert (t["gpu_energy_j"] or 0.0) == pytest.approx(300.0 * (n - 10)), t
    res = CliRunner().invoke(main, ["analyze", str(data)])
    assert res.exit_code == 0, res.output
    assert "job" in res.stdout, res.stdout
    notes: list[str] = []
    paths = ex.export(data, "parquet", tmp_path / "out", notes=notes)
    tg = {p.stem: pq.read_table(p) for p in paths}["tags"]
    assert tg.num_rows == n
    got = tg.column("energy_note").to_pylist() if "energy_note" in tg.column_names else [None] * n
    assert got.count(None) == 10 and sum(v is not None for v in got) == n - 10, got
    (csv,) = ex.export(data / "tags", "csv", tmp_path / "tags.csv")
    assert len(csv.read_text().splitlines()) == n + 1
