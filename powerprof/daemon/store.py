"""Crash-safe hive-partitioned Parquet datasets: buffered rows, atomic small files, compaction, retention.

Layout: `<root>/<dataset>/date=YYYY-MM-DD/part-<utc>-<pid>-<seq>.parquet`. Every file is written
under a dot-prefixed temporary name (ignored by pyarrow, DuckDB's `*.parquet` globs and Spark),
fsynced, renamed into place, and the directory fsynced: a reader or a crash sees a whole file or
none. `kill -9` loses only rows buffered since the last flush.

Flushes write Parquet with `storage/flatparquet.py` (standard library, GZIP pages), so the daemon
never loads pyarrow (about 45 MiB resident). Compaction, which reads, sorts and rewrites with ZSTD,
needs pyarrow: the daemon's Flusher runs it hourly in a short-lived child process
(`powerprof.daemon.store` in an isolated interpreter, `daemon/spawn.py`), which the kernel stops if the daemon dies (PR_SET_PDEATHSIG, SIGTERM: after finishing a deletion under way).
Flushes go on while it runs: it only merges and deletes the files it listed when it began.

Compaction merges a partition's small files into one. It writes a journal naming the sources
and the target before renaming the target into place; a restart that finds a journal either
finishes deleting the sources (target present) or drops the unfinished target (absent), so rows
are never lost nor left doubled. Compaction and recovery hold `<root>/.compaction.lock` (flock):
a daemon restarted at once after `kill -9` waits for its old compaction child, which the kernel is
stopping, instead of judging a journal whose target that child may still rename into place.

A failed flush (full disk, read-only mount) keeps the rows in memory, up to a bound per dataset
beyond which the oldest are dropped and counted, and is retried at the next flush. Rows of requests the
proxy answered without forwarding them (no energy: schema.NOT_FORWARDED_NOTE) have their own share of that
bound and go first: a flood of clients that leave mid-request never pushes a row with energy out. A row that
cannot become a Parquet row (a value its column cannot hold) is not retried forever: it is moved
to `<root>/_quarantine/<dataset>-*.jsonl`, counted, and the rest of the batch is written. The
flush thread survives any exception (counted, logged once with its cause) and beats a heartbeat
that /metrics and the systemd watchdog read, so a dead or stuck writer is visible.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from powerprof.daemon.spawn import isolated_argv
from powerprof.errtext import error_text
from powerprof.storage import flatparquet
from powerprof.storage.atomic import atomic_path, fsync_dir
from powerprof.storage.schema import NOT_FORWARDED_NOTE, arrow_schema, columns_of

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("powerprof.daemon.store")

JOURNAL = ".compact-journal.json"
COMPACTION_LOCK = ".compaction.lock"
# How long recovery waits for a compaction child of a killed daemon (it stops within milliseconds of its
# parent's death, or after a merge's write that is under way: seconds for an hour of 8 GPUs' rows).
COMPACTION_LOCK_WAIT_S = 30.0
QUARANTINE_DIR = "_quarantine"  # "_" prefix: pyarrow and DuckDB dataset globs skip it
# Memory one buffered row costs (a dict of ~25 columns), measured with tracemalloc: see buffer_cap_rows.
ROW_BYTES_EST = 2048
MAX_BUFFERED_ROWS = 500_000
# The share of a dataset's bound that rows of requests never forwarded (no energy) may hold: one client sending a POST
# head and leaving makes one, so a flood of them (1000 between two flushes) fills any bound; before they had no share of
# their own, and with a bound of 200 they pushed out all 10 rows with energy (740 J) written before them.
NOT_FORWARDED_SHARE = 0.25
PART_PREFIX = "part-"
COMPACT_PREFIX = "compact-"
# A wall clock further than this ahead of the time since start has been stepped (NTP slews far less).
CLOCK_STEP_S = 3600.0


def buffer_cap_rows(memory_max_bytes: int | None, n_datasets: int, share: float = 0.5) -> int:
    """Rows to keep per dataset while writes fail, so that all datasets together stay within `share` of
    the process's memory limit (the unit's MemoryMax); MAX_BUFFERED_ROWS without a limit."""
    if not memory_max_bytes:
        return MAX_BUFFERED_ROWS
    return max(100, min(MAX_BUFFERED_ROWS, int(memory_max_bytes * share / (ROW_BYTES_EST * max(1, n_datasets)))))


def not_forwarded_row(row: dict) -> bool:
    """A request row the proxy answered before forwarding it: no energy, nothing a figure needs."""
    return row.get("gpu_energy_j") is None and str(row.get("energy_note") or "").startswith(NOT_FORWARDED_NOTE)


def write_file_atomic(path: Path, table: flatparquet.FlatTable | pa.Table) -> None:
    """A flush's FlatTable (no pyarrow) or a compaction's pa.Table (ZSTD), written atomically."""
    # Recovery removes `.<target>.tmp` of an unfinished compaction by that exact name.
    with atomic_path(path, tmp_name=f".{path.name}.tmp") as tmp, open(tmp, "wb") as f:
        if isinstance(table, flatparquet.FlatTable):
            f.write(flatparquet.to_bytes(table))
        else:
            import pyarrow.parquet as pq

            pq.write_table(table, f, compression="zstd")


def date_of(ns: int | datetime | None) -> str:
    """The UTC date a row's time falls on, from whole microseconds as they are stored (a float of
    seconds would round the last half microsecond before midnight into the next day)."""
    if isinstance(ns, datetime):
        aware = ns if ns.tzinfo is not None else ns.replace(tzinfo=timezone.utc)
        return aware.astimezone(timezone.utc).strftime("%Y-%m-%d")
    ts = time.time_ns() if ns is None else int(ns)
    return (_EPOCH + timedelta(microseconds=ts // 1000)).strftime("%Y-%m-%d")


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class PartialWrite(OSError):
    """Some of a batch's daily files were written before one failed: those rows must not be written again."""

    def __init__(self, cause: OSError, written: list[dict]):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.cause, self.written = cause, written


class _CompactionLock:
    """An exclusive flock on `<root>/.compaction.lock` (the kernel drops it when its holder dies): one
    compaction or recovery at a time across the daemon, its compaction child, and a daemon restarted
    while a killed one's child still runs. `acquired` is False when `wait_s` ran out."""

    def __init__(self, root: Path, wait_s: float):
        self.root, self.wait_s = root, wait_s
        self.fd: int | None = None
        self.acquired = False

    def __enter__(self) -> "_CompactionLock":
        import fcntl

        # Never through a symlink; the folder is the daemon's own (service.lock_data_dir refuses others').
        self.fd = os.open(self.root / COMPACTION_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o640)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.acquired = True
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return self
                time.sleep(0.02)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the flock


@dataclass(frozen=True)
class Dataset:
    name: str
    schema: list | pa.Schema  # (name, type) columns from storage/schema.py, or a pa.Schema of those types
    time_column: str  # which wall-clock column picks the date partition

    @property
    def columns(self) -> list[tuple[str, str]]:
        return columns_of(self.schema)


def _hold_folder(owner, path: Path) -> int:
    """An open descriptor of the folder, closed with `owner`: while it is held its inode number cannot go to a folder
    made in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    weakref.finalize(owner, os.close, fd)
    return fd


def _journal_names_only_its_own(j) -> bool:
    """Whether a compaction journal's target and sources are all plain names of files in its own partition."""
    def plain(name) -> bool:
        return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name

    return isinstance(j, dict) and plain(j.get("target")) and isinstance(j.get("sources"), list) \
        and all(plain(x) for x in j["sources"])


class DatasetStore:
    """Buffers rows per dataset and writes them as small atomic files. Thread-safe."""

    def __init__(
        self,
        root: Path,
        datasets: list[Dataset],
        max_buffered_rows: int = MAX_BUFFERED_ROWS,
        retention_days: float | None = 30.0,
        retention_max_bytes: int | None = None,
        recover: bool = True,
        write_file: Callable[[Path, flatparquet.FlatTable | pa.Table], None] = write_file_atomic,
        host: str | None = None,
        daemon_id: str | None = None,
        simulated: bool | None = None,
        gpu_uuids: str | None = None,
    ):
        self.root = Path(root)
        # Values every row of this process shares, where a row does not give its own.
        self.fill = {k: v for k, v in (("host", host), ("daemon_id", daemon_id), ("gpu_uuids", gpu_uuids)) if v}
        if simulated is not None:
            self.fill["simulated"] = simulated
        self.datasets = {d.name: d for d in datasets}
        self.max_buffered_rows = max_buffered_rows
        self.retention_days = retention_days
        self.retention_max_bytes = retention_max_bytes
        self._write_file = write_file
        self._lock = threading.Lock()
        self._io_lock = threading.Lock()  # one writer of files at a time (flush, compaction, retention)
        self._buf: dict[str, deque] = {d.name: deque() for d in datasets}
        self._unsent: dict[str, deque] = {d.name: deque() for d in datasets}  # not-forwarded rows (not_forwarded_row)
        self._seq = 0
        self.dropped_rows = {d.name: 0 for d in datasets}
        self.dropped_not_forwarded_rows = {d.name: 0 for d in datasets}
        self._dropped_logged = (0, 0)  # both counts as the last flush's log said them
        self.written_rows = {d.name: 0 for d in datasets}
        self.quarantined_rows = {d.name: 0 for d in datasets}
        self.flush_errors = 0
        self.last_error: str | None = None
        self._failing = False
        self._data_errors_logged: set[tuple[str, str]] = set()
        # The wall clock and the monotonic clock at start: how far the wall clock may have moved since (retention).
        self._wall0_s, self._mono0_s = time.time(), time.monotonic()
        self._clock_step_logged = False
        self._root_fd: int | None = None  # the folder the start made or found, held for the store's life
        self._root_id: tuple[int, int] | None = None  # its device and inode, should holding it fail (EMFILE)
        self._root_lost = False  # that unheld folder was seen gone: whatever has the name since is not it
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            st = os.stat(self.root)
            self._root_id = (st.st_dev, st.st_ino)
            self._root_fd = _hold_folder(self, self.root)
            for d in datasets:
                (self.root / d.name).mkdir(exist_ok=True)
            if recover:  # not in the compaction child: the daemon's own flushes are under way
                self.recover()
        except OSError as e:
            # Keep running (and proxying): rows wait in memory and every flush tries again.
            self.last_error = str(e)
            log.error("dataset folder %s is not usable: %s; keeping rows in memory and retrying", self.root, e)

    # --- rows in ----------------------------------------------------------------------------

    def append(self, name: str, rows: list[dict]) -> None:
        if not rows:
            return
        with self._lock:
            buf, unsent = self._buf[name], self._unsent[name]
            for r in rows:
                (unsent if not_forwarded_row(r) else buf).append(r)
            # Not-forwarded rows beyond their share, then beyond the bound, go before any row with energy.
            over = max(len(unsent) - self.not_forwarded_cap_rows, len(buf) + len(unsent) - self.max_buffered_rows)
            k = min(max(0, over), len(unsent))
            for _ in range(k):
                unsent.popleft()
            self.dropped_not_forwarded_rows[name] += k
            over = len(buf) + len(unsent) - self.max_buffered_rows
            if over > 0:
                for _ in range(over):
                    buf.popleft()
                self.dropped_rows[name] += over

    @property
    def not_forwarded_cap_rows(self) -> int:
        return max(1, int(self.max_buffered_rows * NOT_FORWARDED_SHARE))

    def buffered(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._buf.values()) + sum(len(b) for b in self._unsent.values())

    # --- flush ------------------------------------------------------------------------------

    def _root_gone(self) -> str | None:
        """Why the data dir is no longer the folder this store began with, or None. A folder made again or put in its
        place since was never checked (the daemon checks its data dir at start: who owns it, who may write it), so
        nothing is made or written there: in /tmp another user could have put a symlink first."""
        if self._root_fd is None and self._root_id is not None:
            # The start had the folder but could not hold it (EMFILE): held now if it is still that one. `mkdir -p`
            # here made one removed since again, never checked. Unheld, its inode number may go to a folder made in
            # its place (tmpfs gives it at once): once seen gone, it stays gone.
            try:
                st = os.stat(self.root)
            except FileNotFoundError:
                st = None
            except OSError:
                return None
            if st is None:
                self._root_lost = True
            if not self._root_lost and st is not None and (st.st_dev, st.st_ino) == self._root_id:
                try:
                    self._root_fd = _hold_folder(self, self.root)
                except OSError:
                    return None  # still no descriptor to spare: the write says why
                return self._root_gone()  # the name may have moved on between the stat and the open
            return self._gone_text(st is None)
        if self._root_fd is None:
            try:  # the start could not make it (a file in the way, no permission): made now, checked from now on
                self.root.mkdir(parents=True, exist_ok=True)
                st = os.stat(self.root)
                self._root_id = (st.st_dev, st.st_ino)
                self._root_fd = _hold_folder(self, self.root)
            except OSError:
                pass
            return None
        held = os.fstat(self._root_fd)
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            st = None
        except OSError:
            return None  # unreadable for now (EIO, EACCES): the write says why
        if st is not None and held.st_nlink > 0 and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return None
        return self._gone_text(st is None)

    def _gone_text(self, removed: bool) -> str:
        return (f"the data dir {self.root} was {'removed' if removed else 'replaced by another folder'} while the "
                "daemon ran; nothing is made or written there, since a folder put there since start was never checked; "
                "rows are kept in memory; fix: restart the daemon (it checks the folder before writing)")

    def flush(self) -> bool:
        """Write every buffered row; True when all were written. Never raises for I/O errors."""
        ok = True
        with self._io_lock:
            root_gone = self._root_gone()  # its own name: `gone` below counts rows the memory bound dropped
            for name, ds in self.datasets.items():
                with self._lock:
                    real = list(self._buf[name])
                    unsent = list(self._unsent[name])
                    dropped_before = self.dropped_rows[name]
                    unsent_dropped_before = self.dropped_not_forwarded_rows[name]
                rows = real + unsent
                if not rows:
                    continue
                if root_gone:
                    ok = False
                    self._flush_failed(name, OSError(errno.ENOENT, root_gone))
                    continue
                written = len(rows)
                try:
                    self._write_rows(ds, rows)
                except PartialWrite as e:
                    ok = False
                    done = {id(r) for r in e.written}
                    with self._lock:
                        self._buf[name] = deque(r for r in self._buf[name] if id(r) not in done)
                        self._unsent[name] = deque(r for r in self._unsent[name] if id(r) not in done)
                        self.written_rows[name] += len(e.written)
                    self._flush_failed(name, e.cause)
                    continue
                except OSError as e:
                    ok = False
                    self._flush_failed(name, e)
                    continue
                except Exception as e:  # not the disk: a row its schema cannot hold (ArrowInvalid, TypeError, ...)
                    try:
                        written = self._write_around_bad_rows(ds, rows, e)
                    except OSError as e2:
                        ok = False
                        self._flush_failed(name, e2)
                        continue
                with self._lock:
                    # Drop exactly what was written; rows appended meanwhile stay.
                    # Rows dropped for the memory bound meanwhile were taken from the front already: the front is
                    # what this write held, so up to `taken` of them were written, not lost, and are not counted so.
                    gone_real = self.dropped_rows[name] - dropped_before
                    gone_unsent = self.dropped_not_forwarded_rows[name] - unsent_dropped_before
                    for buf, taken, gone in ((self._buf[name], len(real), gone_real),
                                             (self._unsent[name], len(unsent), gone_unsent)):
                        for _ in range(max(0, min(taken - gone, len(buf)))):
                            buf.popleft()
                    self.dropped_rows[name] -= min(gone_real, len(real))
                    self.dropped_not_forwarded_rows[name] -= min(gone_unsent, len(unsent))
                    self.written_rows[name] += written
        self._log_dropped()
        if ok and self._failing:
            self._failing = False
            log.warning("writing Parquet works again; buffered rows were written")
        return ok

    def _log_dropped(self) -> None:
        """Once a flush, rows the bound dropped since the last one said so: before, they were only counted."""
        now = (sum(self.dropped_rows.values()), sum(self.dropped_not_forwarded_rows.values()))
        real, unsent = (a - b for a, b in zip(now, self._dropped_logged))
        self._dropped_logged = now
        if real > 0 and not self._failing:  # while writes fail, _flush_failed's log says rows past the bound go
            log.warning("%d row(s) (samples, intervals, requests with energy) dropped since the last flush: more were waiting than "
                        "daemon.max_buffered_rows (%d a dataset) holds (writes failing, or rows made faster than "
                        "flushed); counted in powerprof_dropped_rows_total; fix: free the disk, or raise "
                        "max_buffered_rows or lower flush_interval_s", real, self.max_buffered_rows)
        if unsent > 0:
            log.warning("%d row(s) of requests not forwarded (the proxy answered them before the server saw them: "
                        "clients that left or stalled mid-request, no energy) dropped since the last flush, over "
                        "their share of the buffer (%d rows); no row with energy was dropped for them; counted in "
                        "powerprof_dropped_not_forwarded_rows_total", unsent, self.not_forwarded_cap_rows)

    def _write_around_bad_rows(self, ds: Dataset, rows: list[dict], cause: Exception) -> int:
        """Write the rows that convert; quarantine (JSON lines, counted, logged once per cause) those that do not."""
        bad = []
        for r in rows:
            try:
                flatparquet.encode(ds.columns, [r], self.fill)
            except Exception:
                bad.append(r)
        ids = {id(r) for r in bad}
        good = [r for r in rows if id(r) not in ids] if bad else []
        bad = bad or rows  # the batch failed yet no single row does: keep all of it aside rather than loop
        self.flush_errors += 1
        why = f"{type(cause).__name__}: {cause}"[:300]
        self.last_error = f"{ds.name}: {why}"
        if good:
            self._write_rows(ds, good)
        path = self._quarantine(ds, bad)
        self.quarantined_rows[ds.name] += len(bad)
        key = (ds.name, type(cause).__name__)
        if key not in self._data_errors_logged:
            self._data_errors_logged.add(key)
            log.error("dataset %s: %d row(s) cannot be stored (%s); moved to %s, the other %d written. "
                      "Further rows failing the same way are counted in powerprof_quarantined_rows_total.",
                      ds.name, len(bad), why, path or "nowhere (the quarantine file could not be written)", len(good))
        return len(good)

    def _quarantine(self, ds: Dataset, rows: list[dict]) -> Path | None:
        d = self.root / QUARANTINE_DIR
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        path = d / f"{ds.name}-{stamp}-{os.getpid()}.jsonl"
        try:
            d.mkdir(exist_ok=True)
            with atomic_path(path) as tmp, open(tmp, "w") as f:
                for r in rows:
                    f.write(json.dumps(r, default=repr) + "\n")
        except OSError as e:
            log.error("cannot write quarantined rows of %s to %s: %s", ds.name, path, e)
            return None
        return path

    def _flush_failed(self, name: str, e: OSError) -> None:
        self.flush_errors += 1
        self.last_error = f"{name}: {e}"
        hint = " (disk full)" if e.errno == errno.ENOSPC else ""
        if not self._failing or self.flush_errors % 100 == 0:
            log.error(
                "cannot write dataset %s under %s%s: %s; keeping up to %d rows in memory and retrying",
                name, self.root, hint, e, self.max_buffered_rows,
            )
        self._failing = True

    def _write_rows(self, ds: Dataset, rows: list[dict]) -> None:
        by_date: dict[str, list[dict]] = {}
        for r in rows:
            by_date.setdefault(date_of(r.get(ds.time_column)), []).append(r)
        # Every table is built before any file is written: a row that cannot convert fails the batch
        # before part of it is on disk (its retry would write that part twice).
        columns = ds.columns
        tables = [(day, flatparquet.encode(columns, part, self.fill)) for day, part in sorted(by_date.items())]
        written: list[dict] = []
        for day, table in tables:
            try:
                d = self.root / ds.name / f"date={day}"
                if not d.exists():
                    # Never the data dir itself (parents=False): one removed since start is not made again (_root_gone).
                    d.parent.mkdir(exist_ok=True)
                    d.mkdir(exist_ok=True)
                    fsync_dir(d.parent)
                self._seq += 1
                stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
                self._write_file(d / f"{PART_PREFIX}{stamp}-{os.getpid()}-{self._seq:06d}.parquet", table)
            except OSError as e:
                if written:  # a flush across midnight, or after a long outage: keep only what is not on disk
                    raise PartialWrite(e, written) from e
                raise
            written += by_date[day]

    # --- recovery, compaction, retention -----------------------------------------------------

    def partitions(self, name: str) -> list[Path]:
        base = self.root / name
        return sorted(p for p in base.glob("date=*") if p.is_dir())

    def finish_compactions(self) -> None:
        """Finish what a compaction child that died left (its journal), under the writers' lock."""
        with self._io_lock:
            if self._root_gone():
                # The child dies so when its data dir is removed under it: the folder now under the name was never
                # checked, and its journal names files root would delete (said by the flushes that fail beside it).
                return
            self._finish_journals(remove_tmp=False)

    def recover(self) -> None:
        """Undo what a crash left: temporary files and half-done compactions."""
        self._finish_journals(remove_tmp=True)

    def _finish_journals(self, remove_tmp: bool) -> None:
        """Every partition's compaction journal finished (and, at start, its temporaries removed), under the
        compaction lock: it waits for a compaction child of a daemon killed just before (it is being stopped).
        Judged while that child runs, a journal whose target is not yet in place would be dropped, and the
        child's rename then leave every row twice."""
        with _CompactionLock(self.root, COMPACTION_LOCK_WAIT_S) as lock:
            if not lock.acquired:
                log.warning("a compaction still holds %s after %.0f s; its journal%s left to the next compaction",
                            COMPACTION_LOCK, COMPACTION_LOCK_WAIT_S, " and temporary files are" if remove_tmp else " is")
                return
            for name in self.datasets:
                for part in self.partitions(name):
                    journal = part / JOURNAL
                    if journal.exists():
                        self._finish_compaction(part, journal)
                    if remove_tmp:
                        for tmp in part.glob(".*.tmp"):
                            tmp.unlink(missing_ok=True)

    def _finish_compaction(self, part: Path, journal: Path) -> None:
        try:
            j = json.loads(journal.read_text())
        except (OSError, ValueError):
            j = None
        if j and not _journal_names_only_its_own(j):
            # A compaction writes the names of files in its partition: "../x" or "/x" it never wrote, and joined to
            # the partition they would delete files anywhere, as root. Left in place, said.
            log.error("compaction journal %s names files outside its partition; left as it is (remove it by hand "
                      "once the partition's files are checked)", journal)
            return
        if j and (part / j["target"]).exists():
            for src in j["sources"]:
                (part / src).unlink(missing_ok=True)
            log.warning("finished an interrupted compaction in %s", part)
        elif j:
            (part / f".{j['target']}.tmp").unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        fsync_dir(part)

    def compact(self, min_files: int = 2) -> int:
        """Merge each partition's flush files into one; returns how many partitions were compacted."""
        done = 0
        if self._root_gone():
            return 0  # said by the flushes that fail beside it
        with self._io_lock, _CompactionLock(self.root, 0.0) as lock:
            if not lock.acquired:  # another process compacts or recovers this folder: its turn, not ours
                log.warning("compaction skipped: another process holds %s", COMPACTION_LOCK)
                return 0
            for name, ds in self.datasets.items():
                for part in self.partitions(name):
                    journal = part / JOURNAL
                    if journal.exists():  # a compaction that died half-way: finish it before its sources count again
                        self._finish_compaction(part, journal)
                    # Only the flushes' small files: earlier compacted files stay as they are, so one run
                    # holds about an hour of rows in memory, not the whole day (a day of 8 GPUs' samples
                    # peaked at ~800 MiB when it was all rewritten each hour).
                    files = sorted(p for p in part.glob(f"{PART_PREFIX}*.parquet"))
                    if len(files) < min_files:
                        continue
                    try:
                        self._compact_partition(ds, part, files)
                        done += 1
                    except OSError as e:
                        log.error("compaction of %s failed, files left as they were: %s", part, e)
        return done

    def child_spec(self, min_files: int = 2) -> dict:
        """What `python -m powerprof.daemon.store` needs to run `compact` in a child process."""
        held = os.fstat(self._root_fd) if self._root_fd is not None else None
        return {"root": os.path.abspath(self.root), "min_files": min_files, "parent_pid": os.getpid(),
                # The folder this store holds: the child compacts that one or none (_compact_as_told).
                "root_id": [held.st_dev, held.st_ino] if held is not None else None,
                "datasets": [{"name": d.name, "columns": d.columns, "time_column": d.time_column}
                             for d in self.datasets.values()]}

    def _compact_partition(self, ds: Dataset, part: Path, files: list[Path]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = arrow_schema(ds.columns)
        tables = []
        for f in files:
            try:
                tables.append(pq.read_table(f, schema=schema))
            except (pa.ArrowInvalid, OSError) as e:
                log.error("skipping unreadable file %s in compaction: %s", f, e)
                files = [x for x in files if x != f]
        if len(files) < 2:
            return
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        target = f"{COMPACT_PREFIX}{stamp}-{os.getpid()}.parquet"
        journal = part / JOURNAL
        with atomic_path(journal, tmp_name=f"{JOURNAL}.tmp") as jtmp:
            jtmp.write_text(json.dumps({"target": target, "sources": [f.name for f in files]}))
        table = pa.concat_tables(tables)
        sort_col = ds.time_column
        if sort_col in table.column_names:
            table = table.sort_by(sort_col)
        try:
            self._write_file(part / target, table)
        except BaseException:
            if not (part / target).exists():
                journal.unlink(missing_ok=True)
                raise
            # Stopped (SIGTERM) after the rename, in the folder's fsync: the merged file is in place, so
            # the sources go now, or every row would be twice for readers until the next start.
            with _finishing():
                self._drop_sources(part, files, journal)
            raise
        with _finishing():  # the target is in place: a stop now would leave every row twice for readers
            self._drop_sources(part, files, journal)

    @staticmethod
    def _drop_sources(part: Path, files: list[Path], journal: Path) -> None:
        for f in files:
            f.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        fsync_dir(part)

    def _retention_now(self) -> datetime:
        """The wall clock, but never later than the time since start says it can be: a clock stepped years ahead
        (a bad RTC or NTP server) made every partition look old and age retention deleted them all. A clock
        that was behind at start and stepped forward keeps every partition until restart (the size limit still
        holds): keeping rows too long is the side to err on. Said once in the log."""
        wall = datetime.now(timezone.utc)
        bound = self._wall0_s + (time.monotonic() - self._mono0_s)
        if wall.timestamp() <= bound + CLOCK_STEP_S:
            return wall
        if not self._clock_step_logged:
            self._clock_step_logged = True
            log.warning("the wall clock is %.0f s ahead of the time since the daemon started: age retention uses the "
                        "latter, deleting nothing the step would have made old (restart the daemon once the clock is right)",
                        wall.timestamp() - bound)
        return datetime.fromtimestamp(bound, timezone.utc)

    def enforce_retention(self, now_utc: datetime | None = None) -> int:
        """Delete whole partitions older than the age limit (by a wall clock no later than the time since start
        allows: _retention_now), then oldest files over the size limit."""
        removed = 0
        if self._root_gone():
            return 0
        now_utc = now_utc or self._retention_now()
        with self._io_lock:
            if self.retention_days is not None:
                cutoff = (now_utc - timedelta(days=self.retention_days)).strftime("%Y-%m-%d")
                for name in self.datasets:
                    for part in self.partitions(name):
                        if part.name[len("date="):] < cutoff:
                            shutil.rmtree(part, ignore_errors=True)
                            removed += 1
            if self.retention_max_bytes is not None:
                files = []
                for name in self.datasets:
                    for part in self.partitions(name):
                        for f in part.glob("*.parquet"):
                            if not f.name.startswith("."):
                                st = f.stat()
                                files.append((part.name, st.st_mtime_ns, st.st_size, f))
                total = sum(x[2] for x in files)
                for _, _, size, f in sorted(files, key=lambda x: (x[0], x[1])):
                    if total <= self.retention_max_bytes:
                        break
                    f.unlink(missing_ok=True)
                    total -= size
                    removed += 1
                for name in self.datasets:
                    for part in self.partitions(name):
                        if not any(part.iterdir()):
                            part.rmdir()
        return removed


def _malloc_trim():
    """glibc's malloc_trim, or None (another libc). A flush frees its rows and encoded pages; glibc keeps
    the freed pages of its heap resident until trimmed (about 2 MiB of RSS, docs/benchmarks-history.md, Soak, third pass)."""
    try:
        import ctypes

        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


class Flusher:
    """A thread that flushes every `interval_s` and compacts/retains every `compact_interval_s`.

    With `compact_in_child`, compaction runs in a child process (pyarrow stays out of this one) while
    the flushes go on; at most one child at a time, retention between children."""

    BEAT_S = 5.0  # the loop turns at least this often, so a heartbeat older than a few of these means stuck
    CHILD_STOP_S = 10.0  # at stop, a running compaction child gets this long, then is killed (the journal recovers)

    def __init__(self, store: DatasetStore, interval_s: float = 30.0, compact_interval_s: float = 3600.0,
                 compact_in_child: bool = False):
        self.store = store
        self.interval_s = interval_s
        self.compact_interval_s = compact_interval_s
        self.compact_in_child = compact_in_child
        self._child: subprocess.Popen | None = None
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0  # exceptions the loop caught (the store counts its own write failures)
        self.last_error: str | None = None
        self.beat = time.monotonic()  # the loop's last turn; a stuck flush stops it moving

    def start(self) -> "Flusher":
        self._thread = threading.Thread(target=self._run, name="powerprof-flush", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        next_flush = time.monotonic() + self.interval_s
        next_compact = time.monotonic() + self.compact_interval_s
        # Wake at least every BEAT_S so the heartbeat moves while idle.
        while not self._stop.wait(max(0.0, min(next_flush, next_compact, time.monotonic() + self.BEAT_S) - time.monotonic())):
            now = time.monotonic()
            self.beat = now
            if now >= next_flush:
                self._step("flush", self.store.flush)
                if self._trim is not None:
                    self._trim(0)
                next_flush = max(next_flush + self.interval_s, now + self.interval_s / 2)
            if self._child is not None:
                self._step("compaction", self._reap_child)
            if now >= next_compact:
                if not self.compact_in_child:
                    self._step("compaction", self.store.compact)
                    self._step("retention", self.store.enforce_retention)
                elif self._child is None:
                    self._step("retention", self.store.enforce_retention)
                    self._step("compaction", self._start_child)
                next_compact = now + self.compact_interval_s
            self.beat = time.monotonic()
        if self._child is not None:  # here, not in stop(): the child is killed when this thread ends
            self._step("compaction", lambda: self._reap_child(self.CHILD_STOP_S))

    def _start_child(self) -> None:
        if self.store._root_gone():
            return  # the child would compact whatever folder now has the name; the failing flushes say why
        # Started from this thread: PR_SET_PDEATHSIG in the child fires when this thread ends.
        # Its own session: a Ctrl-C at the daemon's terminal stops the daemon, which lets the child finish.
        # Isolated, from "/": never code from the daemon's working directory or PYTHONPATH (daemon/spawn.py).
        self._child = subprocess.Popen(isolated_argv("powerprof.daemon.store"), stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, text=True, start_new_session=True, cwd="/")
        self._child.stdin.write(json.dumps(self.store.child_spec()))
        self._child.stdin.close()

    def _reap_child(self, wait_s: float | None = None) -> None:
        child = self._child
        try:
            rc = child.wait(wait_s) if wait_s is not None else child.poll()
        except subprocess.TimeoutExpired:
            child.terminate()  # it stops at once, or after deleting a finished compaction's sources
            try:
                rc = child.wait(2.0)
            except subprocess.TimeoutExpired:
                child.kill()
                rc = child.wait()
        if rc is None:
            return
        self._child = None
        if rc != 0:  # its own log lines (stderr, shared with this process) say why
            # Killed between renaming its file into place and deleting the sources, it would leave
            # rows twice over for every reader until a restart: finish its journal now.
            self.store.finish_compactions()
            raise RuntimeError(f"the compaction child exited with status {rc}; its journal, if any, was finished")

    def _step(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # the thread must outlive any bug: counted, logged once per kind, retried next turn
            self.errors += 1
            first = self.last_error is None or not self.last_error.startswith(f"{what}: {type(e).__name__}")
            self.last_error = f"{what}: {error_text(e)}"[:300]
            if first:
                log.exception("%s failed; retrying at the next turn (powerprof_writer_errors_total)", what)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def alive(self, stuck_after_s: float) -> bool:
        """The thread runs and its loop turned within `stuck_after_s`: what the watchdog and /metrics report."""
        return self.running and time.monotonic() - self.beat < stuck_after_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.store.flush()


class _Termination:
    """SIGTERM in the compaction child: stop at once, except while a finished compaction deletes
    its sources (milliseconds), which it completes first. Killed there, the merged file and its
    sources would both stay visible, every row twice to any reader, until the daemon's next start."""

    def __init__(self):
        self.finishing = False
        self.pending = False

    def handle(self, signum, frame) -> None:
        if self.finishing:
            self.pending = True
            return
        raise SystemExit(128 + signum)  # mid-merge: the journal drops the unfinished target


_TERMINATION: _Termination | None = None  # set only in the child process


class _finishing:
    def __enter__(self):
        if _TERMINATION is not None:
            _TERMINATION.finishing = True

    def __exit__(self, *exc):
        if _TERMINATION is not None:
            _TERMINATION.finishing = False
            if _TERMINATION.pending:
                raise SystemExit(128 + signal.SIGTERM)


def _install_termination() -> None:
    global _TERMINATION
    _TERMINATION = _Termination()
    signal.signal(signal.SIGTERM, _TERMINATION.handle)


def _compaction_child() -> int:
    """`python -m powerprof.daemon.store`: compact the datasets the spec on stdin names (Flusher._start_child)."""
    spec = json.load(sys.stdin)
    _install_termination()
    try:
        import ctypes

        # PR_SET_PDEATHSIG, SIGTERM: never outlive the daemon (by more than a source deletion's few ms).
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != spec["parent_pid"]:
        return 1  # the daemon died before the line above
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _compact_as_told(spec)
    return 0


def _same_folder(path: Path, root_id) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return root_id is not None and [st.st_dev, st.st_ino] == list(root_id)


def _compact_as_told(spec: dict) -> int:
    """The child's work: compact the data dir the daemon holds, never a folder put under its name since (made again
    by the child's own store, or another's put there between the daemon's check and this start: neither checked)."""
    root = Path(spec["root"])
    if not _same_folder(root, spec.get("root_id")):
        log.warning("compaction skipped: %s is no longer the daemon's data dir (removed or replaced)", root)
        return 0
    datasets = [Dataset(d["name"], [tuple(c) for c in d["columns"]], d["time_column"]) for d in spec["datasets"]]
    store = DatasetStore(root, datasets, retention_days=None, recover=False)
    if store._root_fd is None or not _same_folder(root, spec["root_id"]) \
            or (os.fstat(store._root_fd).st_dev, os.fstat(store._root_fd).st_ino) != tuple(spec["root_id"]):
        log.warning("compaction skipped: %s was replaced as the child started", root)
        return 0
    return store.compact(spec["min_files"])


if __name__ == "__main__":
    sys.exit(_compaction_child())
