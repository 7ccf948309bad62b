"""Samples to Parquet/CSV rows: one row per device per sample, typed, tagged, written atomically."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
from pathlib import Path

from powerprof.collectors.host import HostReading
from powerprof.collectors.rapl import RaplReading
from powerprof.collectors.sampler import Sample
from powerprof.storage.samples import Timeline, check_output_path, sample_rows, write_table
from powerprof.storage.schema import SAMPLES

T0 = 2_000_000_000
WALL = 1_700_000_000_123_456_789


def _rapl(seq, e):
    data = (RaplReading("package-0", "package", 0, e, 30.0), RaplReading("dram-0", "dram", 0, e / 10, 3.0))
    return Sample("rapl", seq, T0 + seq * 10**9, WALL + seq * 10**9, data)


def test_rows_one_per_device_and_missing_sample_keeps_its_reason():
    rows = sample_rows(_rapl(1, 31.0), T0)
    assert [(r["device"], r["energy_j"], r["t_mono_s"]) for r in rows] == [("package-0", 31.0, 1.0), ("dram-0", 3.1, 1.0)]
    assert rows[0]["time_utc"] == WALL + 10**9  # integer ns until the one converter
    missing = sample_rows(Sample("nvml", 3, T0 + 3 * 10**9, WALL, None, "missed: source too slow"), T0)
    assert len(missing) == 1 and missing[0]["device"] is None and "missed" in missing[0]["error"]
    with pytest.raises(TypeError, match="no SAMPLES row mapping"):
        sample_rows(Sample("x", 0, T0, WALL, object()), T0)


def test_timeline_tags_rows_with_the_level_current_when_read():
    tl = Timeline(t0_mono_ns=T0)
    tl(_rapl(0, 0.0))
    tl.set_tags(at_ns=T0 + 10**9 - 1, level_kind="power_limit", level_value=220.0)
    tl(_rapl(1, 30.0))
    tl.set_tags(at_ns=T0 + 2 * 10**9)
    tl(Sample("host", 2, T0 + 2 * 10**9, WALL, HostReading(12.5, 2400.0, 10, 20)))
    t = tl.to_table()
    assert t.schema.equals(SAMPLES)
    d = t.to_pydict()
    assert d["level_value"] == [None, None, 220.0, 220.0, None]
    assert d["device"][-1] == "host" and d["cpu_util_pct"][-1] == 12.5
    with pytest.raises(ValueError, match="unknown tag"):
        tl.set_tags(request_id=3)
    with pytest.raises(ValueError, match="in order only"):
        tl.set_tags(at_ns=T0, level_kind="power_limit", level_value=200.0)


def test_timeline_is_safe_to_fill_from_many_threads_and_drain():
    tl = Timeline()

    def fill(k):
        for i in range(500):
            tl(_rapl(i, float(i)))

    threads = [threading.Thread(target=fill, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(tl) == 2000
    drained = tl.drain()
    assert len(drained) == 2000 and len(tl) == 0
    assert tl.to_table(drained).num_rows == 4000


def test_parquet_and_csv_are_typed_with_unit_named_columns(tmp_path):
    tl = Timeline(t0_mono_ns=T0)
    for i in range(3):
        tl(_rapl(i, 30.0 * i))
    table = tl.to_table()
    p = write_table(table, tmp_path / "s.parquet", metadata={"simulated": "true"})
    back = pq.read_table(p)
    assert back.schema.field("time_utc").type == pa.timestamp("us", tz="UTC")
    assert back.schema.field("energy_j").type == pa.float64()
    assert back.schema.metadata[b"simulated"] == b"true"
    assert back.column("energy_j").to_pylist() == [0.0, 0.0, 30.0, 3.0, 60.0, 6.0]
    c = write_table(table, tmp_path / "s.csv")
    csv = pcsv.read_csv(c)
    assert csv.column_names == SAMPLES.names
    assert csv.column("power_w").to_pylist()[:2] == [30.0, 3.0]


def test_bad_output_names_are_refused_before_anything_is_written(tmp_path):
    for bad, why in [("x.txt", "must end in"), ("nope/x.parquet", "does not exist")]:
        with pytest.raises(ValueError, match=why):
            check_output_path(tmp_path / bad)
    (tmp_path / "d.parquet").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        check_output_path(tmp_path / "d.parquet")



@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc, a folder where no file can be made")
def test_a_folder_where_no_file_can_be_made_is_refused_up_front(tmp_path):
    # os.access says root may write /proc (or a read-only mount): `monitor --output` sampled for its whole
    # duration, then lost every sample to a FileNotFoundError traceback at the end.
    with pytest.raises(ValueError, match="not writable"):
        check_output_path("/proc/powerprof-samples.csv")
    (tmp_path / "out").mkdir()
    check_output_path(tmp_path / "out" / "ok.csv")
    assert list((tmp_path / "out").iterdir()) == []  # the probe leaves nothing


def test_a_failed_write_leaves_the_previous_file_intact_and_no_temporary(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "s.parquet"
    tl = Timeline(t0_mono_ns=T0)
    tl(_rapl(0, 1.0))
    write_table(tl.to_table(), target)
    before = target.read_bytes()
    tl(_rapl(1, 2.0))

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space"):
        write_table(tl.to_table(), target)
    assert target.read_bytes() == before
    assert [p.name for p in out.iterdir()] == ["s.parquet"]
