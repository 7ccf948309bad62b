"""storage.samples.SampleSpool: samples written as they come (bounded memory), combined into one file at the end."""

from __future__ import annotations

import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from powerprof.collectors.host import HostReading
from powerprof.collectors.sampler import Sample
from powerprof.storage.samples import SampleSpool, Timeline
from powerprof.storage.schema import SAMPLES


def _feed(timeline: Timeline, start: int, n: int) -> None:
    for k in range(start, start + n):
        timeline(Sample("host", k, 1_000_000_000 + k * 100_000_000, 1_700_000_000_000_000_000 + k * 100_000_000,
                        HostReading(cpu_util_pct=float(k), cpu_freq_mhz=2000.0, mem_used_bytes=1,
                                    mem_total_bytes=2)))


def test_flushes_drain_memory_and_parts_hold_every_sample_once_in_order(tmp_path):
    out = tmp_path / "s.parquet"
    tl = Timeline()
    spool = SampleSpool(tl, out, {"simulated": "true"}, part_max_rows=25)
    for i in range(4):
        _feed(tl, i * 10, 10)
        spool.flush()
        assert len(tl) == 0  # handed over: memory holds at most one part's rows
    # .lock (held while the spool writes; readers of the folder skip hidden names) aside
    parts = sorted(p.name for p in spool.parts_dir.iterdir() if p.name != ".lock")
    assert parts == ["part-000001.parquet", "part-000002.parquet"]  # 30 rows then 10: a new part past 25
    assert pq.read_table(spool.parts_dir).column("seq").to_pylist() == list(range(40))
    _feed(tl, 40, 3)
    path, rows = spool.close()
    assert path == out and rows == 43 and not spool.parts_dir.exists()
    t = pq.read_table(out)
    assert t.schema.names == SAMPLES.names and t.schema.metadata[b"simulated"] == b"true"
    assert t.column("seq").to_pylist() == list(range(43))
    assert t.column("cpu_util_pct").to_pylist() == [float(k) for k in range(43)]


def test_close_with_nothing_sampled_writes_an_empty_file_and_csv_works(tmp_path):
    out = tmp_path / "s.csv"
    tl = Timeline()
    spool = SampleSpool(tl, out, {})
    path, rows = spool.close()
    assert rows == 0 and pcsv.read_csv(path).num_rows == 0 and not spool.parts_dir.exists()
    out2 = tmp_path / "t.csv"
    tl2 = Timeline()
    spool2 = SampleSpool(tl2, out2, {}, part_max_rows=5)
    _feed(tl2, 0, 7)
    spool2.flush()
    _feed(tl2, 7, 7)
    path, rows = spool2.close()
    assert rows == 14 and pcsv.read_csv(path).column("seq").to_pylist() == list(range(14))


def test_a_file_made_meanwhile_is_kept_and_the_samples_go_beside_it(tmp_path):
    out = tmp_path / "s.parquet"
    tl = Timeline()
    spool = SampleSpool(tl, out, {})
    _feed(tl, 0, 3)
    out.write_bytes(b"another run's")
    path, rows = spool.close(replace=False)
    assert out.read_bytes() == b"another run's"
    assert path != out and path.name.startswith("s-") and pq.read_table(path).num_rows == 3
