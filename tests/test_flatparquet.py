"""The daemon's stdlib Parquet writer: what pyarrow and DuckDB read back is what rows_to_table would have stored."""

from __future__ import annotations

import io
import math
import random
import subprocess
import sys
from datetime import datetime, timezone

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from powerprof.storage import flatparquet as fp
from powerprof.storage.schema import BOOL, COLUMNS, F64, I32, I64, STR, TS, arrow_schema, rows_to_table


def _value(rng: random.Random, typ: str):
    if rng.random() < 0.25:
        return None
    if typ == TS:
        return rng.choice([rng.randrange(0, 2**62), 1_764_547_200_123_456_789, 0])
    if typ == F64:
        return rng.choice([rng.uniform(-1e12, 1e12), 0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1e308])
    if typ == I64:
        return rng.choice([rng.randrange(-(2**63), 2**63), 2**63 - 1, -(2**63), 0])
    if typ == I32:
        return rng.choice([rng.randrange(-(2**31), 2**31), 2**31 - 1, -(2**31)])
    if typ == STR:
        return rng.choice(["", "gpu0", "ü€😀 \n\"'", "x" * 1000, "GPU-1f2e3d4c"])
    return rng.random() < 0.5


def _same(a, b) -> bool:
    """Equal row lists, NaN equal to NaN."""
    norm = lambda rows: [{k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]  # noqa: E731
    return norm(a) == norm(b)


@pytest.mark.parametrize("table", sorted(COLUMNS))
@pytest.mark.parametrize("n_rows", [1, 9, 300])
def test_every_table_reads_back_as_rows_to_table_builds_it(tmp_path, table, n_rows):
    rng = random.Random(f"{table}-{n_rows}")
    cols = COLUMNS[table]
    # Some keys absent (null or the fill), some rows with runs of nulls, as the daemon's rows are.
    rows = [{c: _value(rng, t) for c, t in cols if rng.random() < 0.85} for _ in range(n_rows)]
    fill = {"host": "node-7"}
    want = rows_to_table(arrow_schema(cols), rows, fill)
    data = fp.to_bytes(fp.encode(cols, rows, fill))
    got = pq.read_table(io.BytesIO(data))
    assert got.schema == want.schema
    assert _same(got.to_pylist(), want.to_pylist())
    # DuckDB reads the same values as from pyarrow's own file of the same table.
    ours, theirs = tmp_path / "ours.parquet", tmp_path / "theirs.parquet"
    ours.write_bytes(data)
    pq.write_table(want, theirs)
    q = "select * from '{}'"
    assert str(duckdb.sql(q.format(ours)).fetchall()) == str(duckdb.sql(q.format(theirs)).fetchall())
    assert duckdb.sql(f"describe {q.format(ours)}").fetchall() == duckdb.sql(f"describe {q.format(theirs)}").fetchall()


def test_statistics_let_readers_prune_by_time_without_losing_rows(tmp_path):
    cols = [("time_utc", TS), ("seq", I64), ("gpu_index", I32), ("power_w", F64)]
    t0 = 1_764_547_200_000_000_000
    rows = [{"time_utc": t0 + i * 10**9, "seq": i - 5, "gpu_index": i % 3 if i % 4 else None, "power_w": float(i)}
            for i in range(40)]
    path = tmp_path / "s.parquet"
    path.write_bytes(fp.to_bytes(fp.encode(cols, rows)))
    st = pq.ParquetFile(path).metadata.row_group(0)
    t = st.column(0).statistics
    assert t.has_min_max and t.min.timestamp() == t0 / 1e9 and t.max.timestamp() == (t0 + 39 * 10**9) / 1e9
    assert (st.column(1).statistics.min, st.column(1).statistics.max) == (-5, 34)
    assert st.column(2).statistics.null_count == 10 and st.column(2).statistics.max == 2
    cut = datetime.fromtimestamp((t0 + 20 * 10**9) / 1e9, tz=timezone.utc)
    n = duckdb.sql(f"select count(*) from '{path}' where time_utc >= '{cut.isoformat()}'").fetchall()[0][0]
    assert n == 20
    assert duckdb.sql(f"select count(*) from '{path}' where seq < -5").fetchall()[0][0] == 0
    assert duckdb.sql(f"select count(*) from '{path}' where seq = 34").fetchall()[0][0] == 1


@pytest.mark.parametrize("typ, value", [
    (I32, 2**31), (I64, 2**63), (I32, 1.5), (I64, math.nan), (I32, "3"), (I32, True),
    (F64, "1.0"), (STR, 5), (STR, b"\xff"), (BOOL, 1), (TS, 1.6e18),
])
def test_a_value_its_column_cannot_hold_raises_before_anything_is_written(typ, value):
    # pyarrow would store 1.5 in an integer column as 1; this writer refuses (the store quarantines the row).
    with pytest.raises((TypeError, ValueError, OverflowError)):
        fp.encode([("c", typ)], [{"c": 1 if typ != STR else "ok"}, {"c": value}])


@pytest.mark.parametrize("typ, value, stored", [
    (I32, np.int32(7), 7), (I64, 3.0, 3), (F64, 3, 3.0), (F64, np.float32(1.5), 1.5), (BOOL, np.bool_(True), True),
    (STR, b"abc", "abc"), (TS, datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=timezone.utc), 1_767_225_600_123_456),
])
def test_values_pyarrow_accepts_are_stored_as_pyarrow_stores_them(typ, value, stored):
    got = pq.read_table(io.BytesIO(fp.to_bytes(fp.encode([("c", typ)], [{"c": value}]))))
    want = rows_to_table(arrow_schema([("c", typ)]), [{"c": value}])
    assert got.equals(want)
    if typ == TS:
        assert got.column(0).cast("int64").to_pylist() == [stored]
    else:
        assert got.column(0).to_pylist() == [stored]


def test_the_daemon_imports_no_pyarrow():
    # pyarrow is ~45 MiB resident (docs/daemon.md, Footprint): only the compaction child may load it.
    code = ("import sys, powerprof.cli, powerprof.daemon.service, powerprof.daemon.store, powerprof.rig;"
            "from powerprof.daemon.service import datasets; datasets();"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('pyarrow', 'pandas', 'scipy', 'duckdb'));"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
