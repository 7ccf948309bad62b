"""Crash-safe datasets: atomic small files, compaction that survives a crash, retention, full disk."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from datetime import datetime, timezone

import duckdb
import pyarrow as pa
import pyarrow.dataset as pads
import pytest

from powerprof.daemon.store import JOURNAL, Dataset, DatasetStore, Flusher, write_file_atomic

SCHEMA = pa.schema([("t_utc", pa.timestamp("us", tz="UTC")), ("value", pa.float64()), ("name", pa.string())])
DAY1 = int(datetime(2026, 1, 1, 12, tzinfo=timezone.utc).timestamp() * 1e9)
DAY2 = int(datetime(2026, 1, 2, 12, tzinfo=timezone.utc).timestamp() * 1e9)


def _store(root, **kw):
    return DatasetStore(root, [Dataset("things", SCHEMA, "t_utc")], **kw)


def _rows(n, t0=DAY1, start=0):
    return [{"t_utc": t0 + i * 1_000_000, "value": float(start + i), "name": f"r{start + i}"} for i in range(n)]


def _three_flushes(root):
    """A store whose one partition holds three flush files of two rows each (values 0-5)."""
    s = _store(root)
    for k in range(3):
        s.append("things", _rows(2, start=2 * k))
        s.flush()
    return s, s.partitions("things")[0]


def _read(root):
    d = pads.dataset(root / "things", format="parquet", partitioning="hive")
    return d.to_table()


def test_flush_writes_hive_partitions_that_duckdb_reads(tmp_path):
    s = _store(tmp_path)
    s.append("things", _rows(5) + _rows(3, DAY2, 5))
    assert s.flush()
    assert sorted(p.name for p in s.partitions("things")) == ["date=2026-01-01", "date=2026-01-02"]
    got = duckdb.sql(
        f"select date, count(*) from read_parquet('{tmp_path}/things/**/*.parquet', hive_partitioning=true) group by date order by date"
    ).fetchall()
    assert [(str(d), n) for d, n in got] == [("2026-01-01", 5), ("2026-01-02", 3)]
    assert s.buffered() == 0


def test_a_crash_mid_write_leaves_only_a_hidden_temp_file_that_restart_removes(tmp_path):
    _store(tmp_path)  # the first run made the folders
    part = tmp_path / "things" / "date=2026-01-01"
    part.mkdir(parents=True)
    (part / ".part-x.parquet.tmp").write_bytes(b"PAR1 half a file")
    assert _read(tmp_path).num_rows == 0  # readers ignore dot files
    _store(tmp_path)
    assert not list(part.glob(".*"))


def test_compaction_merges_files_and_keeps_every_row(tmp_path):
    s = _store(tmp_path)
    for k in range(5):
        s.append("things", _rows(4, start=4 * k))
        s.flush()
    part = s.partitions("things")[0]
    assert len(list(part.glob("*.parquet"))) == 5
    assert s.compact() == 1
    files = list(part.glob("*.parquet"))
    assert len(files) == 1 and files[0].name.startswith("compact-")
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(20)]


@pytest.mark.parametrize("target_written", [True, False])
def test_a_crash_during_compaction_neither_loses_nor_doubles_rows(tmp_path, target_written):
    s, part = _three_flushes(tmp_path)
    sources = sorted(p.name for p in part.glob("*.parquet"))
    target = "compact-crash.parquet"
    (part / JOURNAL).write_text(json.dumps({"target": target, "sources": sources}))
    if target_written:
        # The crash came after the merged file was renamed in, before the sources were deleted.
        write_file_atomic(part / target, _read(tmp_path).drop(["date"]).cast(SCHEMA))
        os.unlink(part / sources[0])
    else:
        (part / f".{target}.tmp").write_bytes(b"partial")
    _store(tmp_path)  # restart: recovery
    assert not (part / JOURNAL).exists()
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(6)]


def test_retention_by_age_and_by_size(tmp_path):
    s = _store(tmp_path, retention_days=30)
    s.append("things", _rows(3) + _rows(3, DAY2, 3))
    s.flush()
    s.enforce_retention(now_utc=datetime(2026, 2, 1, 6, tzinfo=timezone.utc))  # day 1 is 31 days old
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [3.0, 4.0, 5.0]
    s.retention_days = None
    for k in range(4):
        s.append("things", _rows(50, DAY2, 100 * (k + 1)))
        s.flush()
    size = lambda: sum(f.stat().st_size for f in (tmp_path / "things").rglob("*.parquet"))  # noqa: E731
    one = max(f.stat().st_size for f in (tmp_path / "things").rglob("*.parquet"))
    s.retention_max_bytes = size() - 1
    s.enforce_retention()
    assert size() <= s.retention_max_bytes and size() >= s.retention_max_bytes - 2 * one
    vals = _read(tmp_path).column("value").to_pylist()
    assert 449.0 in vals and 3.0 not in vals  # the oldest file went first


def test_full_disk_keeps_rows_in_memory_up_to_a_bound_and_writes_them_later(tmp_path):
    fail = {"on": True}

    def writer(path, table):
        if fail["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_file_atomic(path, table)

    s = _store(tmp_path, max_buffered_rows=100, write_file=writer)
    s.append("things", _rows(60))
    assert s.flush() is False
    s.append("things", _rows(60, start=60))
    assert s.flush() is False
    assert s.buffered() == 100 and s.dropped_rows["things"] == 20 and s.flush_errors == 2
    assert "No space" in s.last_error
    fail["on"] = False
    assert s.flush() is True
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(20, 120)]


def test_unwritable_data_dir_at_start_is_not_fatal(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = _store(blocker / "sub")  # cannot be created: a file is in the way
    s.append("things", _rows(2))
    assert s.flush() is False and s.buffered() == 2


def test_compaction_merges_files_written_before_a_column_was_appended(tmp_path):
    old = pa.schema(list(SCHEMA)[:2])  # a file from an older version, without `name`
    part = tmp_path / "things" / "date=2026-01-01"
    part.mkdir(parents=True)
    write_file_atomic(part / "part-old.parquet", pa.table({"t_utc": pa.array([DAY1 // 1000], pa.int64()).cast(SCHEMA[0].type),
                                                           "value": [7.0]}, schema=old))
    s = _store(tmp_path)
    s.append("things", _rows(2))
    s.flush()
    assert s.compact() == 1
    t = _read(tmp_path).sort_by("value")
    assert t.column("value").to_pylist() == [0.0, 1.0, 7.0] and t.column("name").to_pylist() == ["r0", "r1", None]


def test_the_flusher_compacts_in_a_child_process_while_flushes_go_on(tmp_path):
    # The daemon's way (pyarrow stays out of its process): the child merges the files it listed; rows
    # flushed meanwhile land in new files; nothing is lost or doubled.
    now = time.time_ns()
    s = _store(tmp_path)
    for k in range(3):
        s.append("things", _rows(4, now, start=4 * k))
        s.flush()
    fl = Flusher(s, interval_s=0.05, compact_interval_s=0.3, compact_in_child=True).start()
    part = s.partitions("things")[0]
    deadline = time.monotonic() + 120  # a child starts Python and imports pyarrow: seconds on a loaded machine
    k = 3
    try:
        while not any(p.name.startswith("compact-") for p in part.glob("*.parquet")):
            assert time.monotonic() < deadline, "no compaction within 120 s"
            s.append("things", _rows(4, now, start=4 * k))
            k += 1
            time.sleep(0.1)
    finally:
        fl.stop()
    assert fl.errors == 0, fl.last_error
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(4 * k)]



def test_a_compaction_that_died_half_way_is_finished_before_its_sources_count_twice(tmp_path):
    # The child killed between renaming its file into place and deleting the sources left every row
    # twice for readers, and the next hourly run made that permanent.
    import pyarrow.parquet as pq

    store = _store(tmp_path)
    for k in range(3):
        store.append("things", _rows(10, start=10 * k))
        assert store.flush()
    part = next((tmp_path / "things").glob("date=*"))
    sources = sorted(p.name for p in part.glob("part-*.parquet"))
    # What the dead child left: its file in place, the journal naming the sources, the sources still there.
    pq.write_table(pa.concat_tables([pq.read_table(part / f) for f in sources]), part / "compact-dead.parquet")
    (part / JOURNAL).write_text(json.dumps({"target": "compact-dead.parquet", "sources": sources}))
    assert _read(tmp_path).num_rows == 60  # doubled, as a reader sees it now
    store.append("things", _rows(5, start=30))
    assert store.flush()
    store.compact()
    t = _read(tmp_path)
    assert t.num_rows == 35 and len(set(t.column("name").to_pylist())) == 35 and not (part / JOURNAL).exists()


def test_compaction_merges_the_flush_files_and_leaves_compacted_ones_alone(tmp_path):
    # Rewriting the whole day every hour held it all in memory (~800 MiB for a day of 8 GPUs' samples).
    store = _store(tmp_path)
    for k in range(2):
        store.append("things", _rows(10, start=10 * k))
        assert store.flush()
    store.compact()
    part = next((tmp_path / "things").glob("date=*"))
    first = sorted(p.name for p in part.glob("compact-*.parquet"))
    for k in range(2, 4):
        store.append("things", _rows(10, start=10 * k))
        assert store.flush()
    store.compact()
    after = sorted(p.name for p in part.glob("compact-*.parquet"))
    assert len(first) == 1 and first[0] in after and len(after) == 2 and not list(part.glob("part-*"))
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(40)]


def test_a_flush_that_fails_after_writing_some_days_does_not_write_them_again(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.append("things", _rows(5, t0=DAY1) + _rows(5, t0=DAY2, start=5))
    real, calls = store._write_file, []

    def second_fails(path, table):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, table)

    monkeypatch.setattr(store, "_write_file", second_fails)
    assert not store.flush()
    assert store.flush()
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(10)]
    assert store.written_rows["things"] == 10


def test_a_row_half_a_microsecond_before_midnight_lands_on_its_own_date():
    from powerprof.daemon.store import date_of

    midnight = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()) * 1_000_000_000
    assert date_of(midnight - 1) == "2025-12-31" and date_of(midnight) == "2026-01-01"
    assert date_of(datetime(2025, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)) == "2025-12-31"


def _plant(where, marker):
    """A `powerprof/` package in `where` that leaves `marker` behind if anything imports it."""
    (where / "powerprof" / "daemon").mkdir(parents=True)
    (where / "powerprof" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (where / "powerprof" / "daemon" / "__init__.py").write_text("")
    return where


@pytest.mark.parametrize("pythonpath", [True, False], ids=["dev-PYTHONPATH", "no-PYTHONPATH"])
def test_the_compaction_child_runs_no_code_from_the_daemons_working_directory(tmp_path, monkeypatch, pythonpath):
    # `python -m` puts the working directory first on sys.path: root starting the daemon from /tmp would run a
    # planted package. The child must import the parent's own powerprof, with or without PYTHONPATH.
    marker = tmp_path / "PWNED"
    evil = _plant(tmp_path / "cwd", marker)
    s = _store(tmp_path / "data")
    for k in range(3):
        s.append("things", _rows(4, start=4 * k))
        s.flush()
    if not pythonpath:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(evil)
    fl = Flusher(s, interval_s=60, compact_interval_s=60, compact_in_child=True)
    fl._start_child()
    fl._reap_child(120)  # raises when the child failed
    assert not marker.exists(), "code from the daemon's working directory ran in the compaction child"
    part = s.partitions("things")[0]
    assert [p.name.startswith("compact-") for p in part.glob("*.parquet")] == [True]


_TERM_SCRIPT = """
import pathlib, sys, time
import pyarrow as pa
from powerprof.daemon import store as st
phase, root, ready = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
s = st.DatasetStore(root, [st.Dataset("things", pa.schema([("t_utc", pa.timestamp("us", tz="UTC")), ("value", pa.float64()),
                                                           ("name", pa.string())]), "t_utc")], recover=False)
st._install_termination()
if phase == "deleting":
    real = pathlib.Path.unlink
    def slow_unlink(self, *a, **k):
        if self.name.startswith("part-"):
            ready.touch()
            time.sleep(0.3)
        return real(self, *a, **k)
    pathlib.Path.unlink = slow_unlink
elif phase == "renamed":
    # The merged file was renamed into place; the stop lands in the folder's fsync that follows.
    from powerprof.storage import atomic
    real_fsync = atomic.fsync_dir
    def slow_fsync(path):
        if any(p.name.startswith("compact-") for p in pathlib.Path(path).glob("*.parquet")):
            ready.touch()
            time.sleep(30)
        return real_fsync(path)
    atomic.fsync_dir = slow_fsync
else:
    def slow_write(*a, **k):
        ready.touch()
        time.sleep(30)
    s._write_file = slow_write
s.compact()
"""


@pytest.mark.parametrize("phase", ["deleting", "renamed", "merging"])
def test_a_compaction_child_told_to_stop_never_leaves_rows_twice(tmp_path, phase):
    # The child gets SIGTERM when the daemon dies (PR_SET_PDEATHSIG) or overstays a stop. Mid-merge
    # it stops at once (the sources stay, no target); after the merged file is in place it first
    # deletes the sources: killed there, every row would be twice in the dataset for any reader
    # until the daemon's next start.
    import signal
    import subprocess
    import sys

    s, part = _three_flushes(tmp_path)
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", _TERM_SCRIPT, phase, str(tmp_path), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), "the child never reached the phase"
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 128 + signal.SIGTERM
    names = sorted(f.name for f in part.glob("*.parquet"))
    if phase in ("deleting", "renamed"):
        assert len(names) == 1 and names[0].startswith("compact-") and not (part / JOURNAL).exists()
    else:
        assert len(names) == 3 and all(n.startswith("part-") for n in names)
    # Either way every row is there exactly once, for a reader who looks before any restart.
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(6)]


_LOCK_HOLDER = """
import fcntl, os, pathlib, sys, time
root, target, ready = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
fd = os.open(root / ".compaction.lock", os.O_RDWR | os.O_CREAT, 0o640)
fcntl.flock(fd, fcntl.LOCK_EX)
ready.touch()
time.sleep(1.0)
os.replace(str(target) + ".staged", target)  # a killed daemon's compaction child renames its merge into place late
"""


def test_a_daemon_restarted_while_the_old_compaction_child_finishes_never_doubles_rows(tmp_path):
    # kill -9 of the daemon: the kernel sends its compaction child SIGTERM, but the child may still be
    # renaming its merged file when the next daemon starts and recovers. Judged then, the journal's target
    # is absent, the journal is dropped, and the child's rename leaves every row twice.
    import subprocess
    import sys

    s, part = _three_flushes(tmp_path)
    sources = sorted(p.name for p in part.glob("*.parquet"))
    target = part / "compact-late.parquet"
    (part / JOURNAL).write_text(json.dumps({"target": target.name, "sources": sources}))
    write_file_atomic(part / ".staged.tmp", _read(tmp_path).drop(["date"]).cast(SCHEMA))
    os.replace(part / ".staged.tmp", str(target) + ".staged")
    ready = tmp_path / "ready"
    p = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(tmp_path), str(target), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), "the lock holder never started"
    _store(tmp_path)  # the restarted daemon's recovery
    assert p.wait(30) == 0
    assert not (part / JOURNAL).exists()
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [float(i) for i in range(6)]


def test_daemon_samples_carry_their_daemon_id_so_two_runs_t_mono_s_never_mix(tmp_path):
    # t_mono_s counts from each daemon's start. Before, samples had no daemon_id: two runs on one data
    # dir (a restart) gave rows with the same t_mono_s and nothing to tell them apart, and a window's
    # energy (subtract two rows of one device, ordered by t_mono_s) mixed the runs' counters.
    from powerprof.daemon.service import datasets

    for did, energy in (("run-a", 1000.0), ("run-b", 5.0)):
        s = DatasetStore(tmp_path, datasets(), host="node1", daemon_id=did)
        t0 = DAY1 + (0 if did == "run-a" else 100 * 10**9)
        s.append("samples", [{"time_utc": t0 + k * 10**9, "t_mono_s": float(k), "source": "nvml", "device": "gpu0",
                              "energy_j": energy + 10.0 * k} for k in range(3)])
        s.append("requests", [{"daemon_id": did, "request_id": 1, "t_arrival_utc": DAY1}])
        assert s.flush()
    got = duckdb.sql("select daemon_id, host, max(energy_j) - min(energy_j) "
                     f"from read_parquet('{tmp_path}/samples/**/*.parquet') group by all order by 1").fetchall()
    assert got == [("run-a", "node1", 20.0), ("run-b", "node1", 20.0)]
    req = duckdb.sql(f"select daemon_id from read_parquet('{tmp_path}/requests/**/*.parquet') order by 1").fetchall()
    assert req == [("run-a",), ("run-b",)]  # a row's own daemon_id stands


def test_a_wall_clock_stepped_years_ahead_deletes_no_partition_by_age(tmp_path, monkeypatch):
    # A bad RTC or NTP server stepped the clock to 2036 while the daemon ran: the next hourly retention took every
    # partition for ten years old and deleted all of them, months of rows, though no time had passed.
    s = _store(tmp_path, retention_days=30)
    today = time.time_ns()
    s.append("things", _rows(3, today - 10 * 86400 * 10**9) + _rows(3, today, 3))
    s.flush()
    import powerprof.daemon.store as store_mod

    class WallClock(datetime):  # datetime.now reads the wall clock that time.time gives
        @classmethod
        def now(cls, tz=None):
            return datetime.fromtimestamp(time.time(), tz)

    monkeypatch.setattr(store_mod, "datetime", WallClock)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 10 * 365 * 86400)
    assert s.enforce_retention() == 0
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    monkeypatch.setattr(time, "time", real)
    # The clock as it was: a partition past the age limit still goes, as ever.
    s.append("things", _rows(2, today - 40 * 86400 * 10**9, 6))
    s.flush()
    assert s.enforce_retention() == 1
    assert sorted(_read(tmp_path).column("value").to_pylist()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_rows_of_a_clock_stepped_back_over_midnight_land_on_their_own_dates_once(tmp_path):
    # Guard: NTP stepped the clock from 00:00:05 back to 23:59:58: the later rows carry the earlier date and go to
    # its partition; flushed and compacted across the step, every row is there once.
    midnight = int(datetime(2026, 1, 2, tzinfo=timezone.utc).timestamp() * 1e9)
    s = _store(tmp_path, retention_days=None)
    s.append("things", _rows(5, midnight + 5 * 10**9))
    s.flush()
    s.append("things", _rows(5, midnight - 2 * 10**9, 5))  # after the step: 23:59:58 of the day before
    s.flush()
    s.append("things", _rows(5, midnight + 1 * 10**9, 10))
    s.flush()
    s.compact(min_files=2)
    t = _read(tmp_path)
    assert sorted(t.column("value").to_pylist()) == [float(i) for i in range(15)]
    by_date = {}
    for d, v in zip(t.column("date").to_pylist(), t.column("value").to_pylist()):
        by_date.setdefault(str(d), []).append(v)
    assert sorted(by_date["2026-01-01"]) == [5.0, 6.0, 7.0, 8.0, 9.0]


def test_a_data_dir_removed_or_replaced_while_running_is_never_made_again_nor_written(tmp_path):
    # A root daemon's data dir removed (rm -rf) while it ran was made again at the next flush, mode 0755, with none of
    # the start's checks: in /tmp, another user could have put a symlink there first and had root write through it.
    import shutil

    root = tmp_path / "pp"
    s = _store(root)
    s.append("things", _rows(2))
    assert s.flush()
    shutil.rmtree(root)
    s.append("things", _rows(3, start=2))
    assert s.flush() is False and not root.exists()
    assert "removed" in s.last_error and "restart the daemon" in s.last_error, s.last_error
    assert s.buffered() == 3  # kept in memory, as for a full disk
    root.mkdir()  # another folder under the same name: never checked, never written
    (root / "things").symlink_to(tmp_path / "elsewhere")
    assert s.flush() is False and s.buffered() == 3
    assert not (tmp_path / "elsewhere").exists() and list(root.iterdir()) == [root / "things"]
    assert "replaced" in s.last_error, s.last_error
    assert s.compact() == 0 and s.enforce_retention() == 0


def test_rows_dropped_for_the_memory_bound_during_one_datasets_write_never_stop_the_next_datasets(tmp_path):
    # flush() kept "is the data dir gone" in `gone`, then reused the name for how many rows the memory bound dropped
    # while a dataset was written: the next dataset then read that count as the data dir gone, was not written, and
    # the flush failed with the count as its message.
    other = pa.schema([("t_utc", pa.timestamp("us", tz="UTC")), ("value", pa.float64())])
    s = None

    def write_and_meanwhile_overflow(path, table):
        write_file_atomic(path, table)
        if path.parent.parent.name == "things":
            s.append("things", _rows(5, start=100))  # rows arriving mid-write push the oldest out (bound 4)

    s = DatasetStore(tmp_path, [Dataset("things", SCHEMA, "t_utc"), Dataset("others", other, "t_utc")],
                     max_buffered_rows=4, write_file=write_and_meanwhile_overflow)
    s.append("things", _rows(2))
    s.append("others", [{"t_utc": DAY1, "value": 1.0}])
    assert s.flush(), s.last_error
    assert s.written_rows["others"] == 1 and s.last_error is None


def test_rows_a_flush_wrote_while_the_bound_pushed_them_out_are_not_counted_or_logged_as_dropped(tmp_path, caplog):
    # Rows appended while a flush wrote the buffer pushed its oldest rows out past the bound, and those were counted
    # dropped (and logged as lost since the not-forwarded rows' change) though the flush wrote every one of them:
    # cap 4, 4 rows written and 2 appended meanwhile read 6 written, 2 "dropped".
    s = None

    def write_and_meanwhile_overflow(path, table):
        write_file_atomic(path, table)
        s.append("things", _rows(2, start=100))

    s = DatasetStore(tmp_path, [Dataset("things", SCHEMA, "t_utc")], max_buffered_rows=4,
                     write_file=write_and_meanwhile_overflow)
    s.append("things", _rows(4))
    with caplog.at_level(logging.WARNING, logger="powerprof"):
        assert s.flush(), s.last_error
    assert s.written_rows["things"] == 4 and s.buffered() == 2
    assert s.dropped_rows["things"] == 0, s.dropped_rows
    assert not [r for r in caplog.records if "dropped" in r.getMessage()], caplog.text


def test_the_compaction_child_never_makes_nor_compacts_a_data_dir_removed_or_replaced_after_the_daemons_check(tmp_path):
    # The daemon checks its data dir before starting the child, but the child's own store made the folder again
    # (mkdir -p, mode 0755, root's) when it was gone by then, and compacted whatever folder had the name.
    import shutil

    from powerprof.daemon.store import _compact_as_told

    root = tmp_path / "pp"
    s, _ = _three_flushes(root)
    spec = s.child_spec()
    shutil.rmtree(root)
    assert _compact_as_told(spec) == 0
    assert not root.exists()
    other, part = _three_flushes(root)  # another folder under the name, with files to compact
    assert _compact_as_told(spec) == 0
    assert not any(p.name.startswith("compact-") for p in part.glob("*.parquet"))
    assert _compact_as_told(other.child_spec()) == 1  # the held folder itself is compacted as before


def _first_hold_fails(monkeypatch) -> None:
    """The store's first hold of its folder fails as at the daemon's open-files limit (EMFILE); later ones work."""
    from powerprof.daemon import store as store_mod

    real, calls = store_mod._hold_folder, []

    def fail_first(owner, path):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(owner, path)

    monkeypatch.setattr(store_mod, "_hold_folder", fail_first)


def test_a_data_dir_the_start_made_but_could_not_hold_is_never_made_again_once_removed(tmp_path, monkeypatch):
    # The start made (or found) the folder, but holding it failed (EMFILE: the daemon's open-files limit): every flush
    # then ran `mkdir -p` on the data dir, so one removed since was made again, root's, mode 0755, never checked.
    import shutil

    _first_hold_fails(monkeypatch)
    root = tmp_path / "pp"
    s = _store(root)
    shutil.rmtree(root)
    s.append("things", _rows(2))
    assert s.flush() is False and not root.exists(), s.last_error
    assert "removed" in s.last_error, s.last_error
    root.mkdir()  # another folder under the name: not the one the start made
    assert s.flush() is False and list(root.iterdir()) == []


def test_a_data_dir_the_start_could_not_hold_is_held_at_the_next_flush_while_it_is_the_same(tmp_path, monkeypatch):
    _first_hold_fails(monkeypatch)
    s = _store(tmp_path / "pp")
    s.append("things", _rows(2))
    assert s.flush(), s.last_error
    assert s._root_fd is not None


def test_a_failed_compaction_childs_journal_is_never_finished_in_a_data_dir_replaced_since(tmp_path):
    # A compaction child that exits non-zero (as one does when its data dir is removed under it) makes the daemon
    # finish its journal: that ran in whatever folder had the name, unchecked, and unlinked each "source" the journal
    # named (joined to the partition: "../../../victim" too), as root.
    import shutil

    root = tmp_path / "pp"
    s, part = _three_flushes(root)
    shutil.rmtree(root)
    fake = root / "things" / part.name
    fake.mkdir(parents=True)
    (fake / "target.parquet").write_text("x")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (fake / JOURNAL).write_text(json.dumps({"target": "target.parquet", "sources": ["../../../victim"]}))
    s.finish_compactions()
    assert victim.exists() and (fake / JOURNAL).exists()
    assert not (root / ".compaction.lock").exists()


def test_a_journal_naming_a_source_outside_its_partition_deletes_nothing_there(tmp_path):
    s, part = _three_flushes(tmp_path / "pp")
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (part / "target.parquet").write_text("x")
    (part / JOURNAL).write_text(json.dumps({"target": "target.parquet", "sources": ["../../../victim", "/etc/hostname"]}))
    s.finish_compactions()
    assert victim.exists()


REQ_SCHEMA = pa.schema([("t_utc", pa.timestamp("us", tz="UTC")), ("gpu_energy_j", pa.float64()),
                        ("energy_note", pa.string()), ("tag", pa.string())])


def test_not_forwarded_rows_never_evict_rows_with_energy(tmp_path, caplog):
    """A flood of clients that send a POST head and leave makes one not-forwarded row each (no energy). Before, they
    went into the same buffer and the cap dropped the oldest rows whatever their kind: with a cap of 200 and 1000 such
    clients, 0 of 10 real rows were written (740 J gone), counted as rows dropped because writes kept failing."""
    from powerprof.storage.schema import NOT_FORWARDED_NOTE

    s = DatasetStore(tmp_path, [Dataset("requests", REQ_SCHEMA, "t_utc")], max_buffered_rows=200)
    for i in range(10):
        s.append("requests", [{"t_utc": DAY1 + i, "gpu_energy_j": 74.0, "tag": f"real#{i}"}])
    for i in range(1000):
        s.append("requests", [{"t_utc": DAY1 + 100 + i, "energy_note": f"{NOT_FORWARDED_NOTE} (gone)", "tag": "junk"}])
    share = s.not_forwarded_cap_rows
    assert 0 < share < 200
    assert s.buffered() == 10 + share
    assert s.dropped_rows["requests"] == 0 and s.dropped_not_forwarded_rows["requests"] == 1000 - share
    with caplog.at_level("WARNING", logger="powerprof.daemon.store"):
        assert s.flush() is True
        assert s.flush() is True  # nothing more dropped: nothing more logged
    said = [r.getMessage() for r in caplog.records if "not forwarded" in r.getMessage()]
    assert len(said) == 1 and str(1000 - share) in said[0]
    t = pads.dataset(tmp_path / "requests", format="parquet", partitioning="hive").to_table()
    tags = t.column("tag").to_pylist()
    assert sorted(x for x in tags if x != "junk") == sorted(f"real#{i}" for i in range(10))
    assert sum(x or 0 for x in t.column("gpu_energy_j").to_pylist()) == 740.0
    assert tags.count("junk") == share and s.buffered() == 0
    # Real rows past the cap still push out not-forwarded ones first, then the oldest real ones.
    s.append("requests", [{"t_utc": DAY1, "energy_note": NOT_FORWARDED_NOTE, "tag": "junk"}] * 5)
    s.append("requests", [{"t_utc": DAY1 + i, "gpu_energy_j": 1.0, "tag": "r"} for i in range(198)])
    assert s.buffered() == 200 and s.dropped_not_forwarded_rows["requests"] == 1000 - share + 3
    s.append("requests", [{"t_utc": DAY1 + i, "gpu_energy_j": 1.0, "tag": "r"} for i in range(5)])
    assert s.buffered() == 200 and s.dropped_rows["requests"] == 3
