"""Samples to rows of the SAMPLES schema (one row per device per sample), a buffering Timeline, file writers.

Collector readings are turned into rows by their type, so this module needs no knowledge of
which collectors ran: GpuReading -> `gpuN`, RaplReading -> its zone (`package-0`, `dram-0`),
HostReading -> `host`, CpuTimeReading -> `cputime`. A missing sample (source failed or too slow) becomes one row with a null
device and the reason in `error`.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from powerprof.collectors.cputime import CpuTimeReading
from powerprof.collectors.host import HostReading
from powerprof.collectors.nvml import GpuReading
from powerprof.collectors.rapl import RaplReading
from powerprof.collectors.sampler import Sample

from powerprof.paths import TEMP_NAME_BYTES

from .atomic import atomic_path, fsync_dir

if TYPE_CHECKING:
    import pyarrow as pa

FORMATS = (".parquet", ".csv")
TAG_COLUMNS = ("level_kind", "level_value")  # set by whoever runs levels (sweep), copied onto the rows read meanwhile

_GPU_COLS = (
    "power_w",
    "power_avg_w",
    "energy_j",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "gpu_util_pct",
    "mem_util_pct",
    "mem_used_bytes",
    "temperature_c",
    "power_limit_w",
    "enforced_limit_w",
    "clock_event_reasons",
)


def sample_rows(
    sample: Sample,
    t0_mono_ns: int,
    gpu_uuids: Mapping[int, str] | None = None,
    tags: Mapping[str, object] | None = None,
) -> list[dict]:
    """Rows (dicts keyed by SAMPLES column names; absent keys are null) for one Sample."""
    base = {
        "time_utc": sample.t_wall_ns,
        "t_mono_s": (sample.t_mono_ns - t0_mono_ns) / 1e9,
        "seq": sample.seq,
        "label": sample.label,
        "source": sample.source,
        "device": None,
        "error": sample.error,
    }
    if tags:
        base.update({k: v for k, v in tags.items() if k in TAG_COLUMNS})
    data = sample.data
    if data is None:
        return [base]
    items = data if isinstance(data, (tuple, list)) else (data,)
    rows = []
    for r in items:
        row = dict(base)
        if isinstance(r, GpuReading):
            row["device"] = f"gpu{r.index}"
            row["gpu_index"] = r.index
            row["gpu_uuid"] = (gpu_uuids or {}).get(r.index)
            for c in _GPU_COLS:
                row[c] = getattr(r, c)
            if r.energy_t_mono_ns is not None:
                row["energy_t_mono_s"] = (r.energy_t_mono_ns - t0_mono_ns) / 1e9
            if r.note:
                row["error"] = r.note if row["error"] is None else f"{row['error']}; {r.note}"
        elif isinstance(r, RaplReading):
            row["device"] = r.zone
            row["power_w"] = r.power_w
            row["energy_j"] = r.energy_j
            if r.note:
                row["error"] = r.note if row["error"] is None else f"{row['error']}; {r.note}"
        elif isinstance(r, HostReading):
            row["device"] = "host"
            row["cpu_util_pct"] = r.cpu_util_pct
            row["cpu_freq_mhz"] = r.cpu_freq_mhz
            row["host_mem_used_bytes"] = r.mem_used_bytes
        elif isinstance(r, CpuTimeReading):
            row["device"] = "cputime"
            row["host_cpu_busy_s"] = r.host_busy_s
            row["server_cpu_s"] = r.server_cpu_s
            row["powerprof_cpu_s"] = r.powerprof_cpu_s
            if r.server_note:
                row["error"] = r.server_note if row["error"] is None else f"{row['error']}; {r.server_note}"
        else:
            raise TypeError(f"no SAMPLES row mapping for {type(r).__name__} from source {sample.source!r}")
        rows.append(row)
    return rows


def samples_to_table(
    samples: Iterable[Sample],
    t0_mono_ns: int | None = None,
    gpu_uuids: Mapping[int, str] | None = None,
) -> pa.Table:
    samples = list(samples)
    if t0_mono_ns is None:
        t0_mono_ns = min((s.t_mono_ns for s in samples), default=0)
    rows = [row for s in samples for row in sample_rows(s, t0_mono_ns, gpu_uuids)]
    from .schema import SAMPLES, rows_to_table

    return rows_to_table(SAMPLES, rows)


class Timeline:
    """A sampler subscriber that keeps every Sample in memory (thread-safe), tagged with the tags current
    when it was read. `sampler.subscribe(timeline)`; `timeline.set_tags(level_kind="power_limit",
    level_value=220)`; `timeline.to_table()`. `drain()` hands over and forgets what is buffered
    (for periodic flushes).

    By the time read, not of arrival: a sampler thread starved on a loaded host delivers a reading seconds
    after it was taken, and a reading of the last level's final windows that arrived after the next
    level's `set_tags` was stored under the next level, inside the last level's measured spans, and its
    figures (levels.parquet's `sm_clock_mhz`, the cap rule, analyze) took it: 1729-1741 MHz for a level
    locked at 1400 MHz (truth 1395 MHz), five seconds behind."""

    def __init__(self, t0_mono_ns: int | None = None, gpu_uuids: Mapping[int, str] | None = None):
        self.t0_mono_ns = t0_mono_ns
        self.gpu_uuids = dict(gpu_uuids or {})
        self._lock = threading.Lock()
        self._items: list[tuple[Sample, Mapping | None]] = []
        # (monotonic ns each set of tags began, the tags), in order: a few per level, so kept whole (a reading may
        # arrive any time later).
        self._tag_times: list[int] = []
        self._tag_sets: list[Mapping | None] = []

    def __call__(self, sample: Sample) -> None:
        with self._lock:
            if self.t0_mono_ns is None:
                self.t0_mono_ns = sample.t_mono_ns
            k = bisect.bisect_right(self._tag_times, sample.t_mono_ns)
            self._items.append((sample, self._tag_sets[k - 1] if k else None))

    def set_tags(self, at_ns: int | None = None, **tags) -> None:
        """Tag every sample read from `at_ns` on (monotonic ns, the sampler's clock; now when None), whenever it
        arrives, until the next set_tags; none given: untagged from then."""
        unknown = set(tags) - set(TAG_COLUMNS)
        if unknown:
            raise ValueError(f"unknown tag columns {sorted(unknown)}; known: {TAG_COLUMNS}")
        t = time.monotonic_ns() if at_ns is None else int(at_ns)
        with self._lock:
            if self._tag_times and t < self._tag_times[-1]:
                raise ValueError(f"tags set at {t} ns, before the last set ({self._tag_times[-1]} ns): in order only")
            self._tag_times.append(t)
            self._tag_sets.append(dict(tags) if tags else None)

    def samples(self, source: str | None = None) -> list[Sample]:
        with self._lock:
            return [s for s, _ in self._items if source is None or s.source == source]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def drain(self) -> list[tuple[Sample, Mapping | None]]:
        with self._lock:
            items, self._items = self._items, []
            return items

    def put_back(self, items: list[tuple[Sample, Mapping | None]]) -> None:
        """Undo a drain whose samples could not be written: they go back before any taken since."""
        with self._lock:
            self._items[:0] = items

    def to_table(self, items: list[tuple[Sample, Mapping | None]] | None = None) -> pa.Table:
        with self._lock:
            items = list(self._items) if items is None else items
            t0 = self.t0_mono_ns if self.t0_mono_ns is not None else 0
        rows = [row for s, tags in items for row in sample_rows(s, t0, self.gpu_uuids, tags)]
        from .schema import SAMPLES, rows_to_table

        return rows_to_table(SAMPLES, rows)


def check_output_path(path: str | os.PathLike) -> Path:
    """Validate an output file name before any work starts; raises ValueError with the reason."""
    from powerprof.paths import missing_folder, path_problem  # noqa: PLC0415

    p = Path(path)
    if (why := path_problem(p)) is not None:  # an OSError traceback from is_dir() ("File name too long")
        raise ValueError(f"output {str(p)!r}: {why}")
    if p.suffix.lower() not in FORMATS:
        raise ValueError(f"output {str(p)!r}: the file name must end in {' or '.join(FORMATS)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"output {str(p)!r}: {missing_folder(parent)}")
    if not os.access(parent, os.W_OK) or not _can_create_in(parent):
        raise ValueError(f"output {str(p)!r}: folder {str(parent)!r} is not writable")
    if p.is_dir():
        raise ValueError(f"output {str(p)!r} is a folder")
    return p


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made there: os.access says yes to root on a read-only mount or /proc, and the
    samples of a whole `monitor` run were lost at its end."""
    import tempfile  # noqa: PLC0415

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".powerprof-probe-"):
            return True
    except OSError:
        return False


def write_table(table: pa.Table, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                replace: bool = True) -> Path:
    """Write Parquet or CSV (by suffix) atomically: a temporary file, fsynced, then renamed over `path`.

    Parquet keeps `metadata` in the file's key-value metadata; CSV cannot hold it.
    replace=False: a `path` that exists by the end is kept, and FileExistsError raised (atomic_path).
    """
    p = check_output_path(path)
    if metadata:
        md = dict(table.schema.metadata or {})
        md.update({str(k).encode(): str(v).encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(md)
    with atomic_path(p, replace=replace) as tmp, open(tmp, "wb") as f:
        if p.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, f)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, f)
    return p


def write_table_beside(table: pa.Table, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """write_table without replacing a file at `path` made since it was checked (another `monitor --output`
    of the same name started meanwhile): the rows go to `<stem>-<UTC time><suffix>` beside it instead, never
    lost and never over it. Returns where they went."""
    p = Path(path)
    try:
        return write_table(table, p, metadata, replace=False)
    except FileExistsError:
        return write_table(table, beside_name(p), metadata, replace=False)


def beside_name(path: Path) -> Path:
    """`<stem>-<UTC time><suffix>`: where samples go when `path` was made by someone else while they were taken."""
    from datetime import datetime, timezone  # noqa: PLC0415

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return path.with_name(f"{path.stem}-{stamp}{path.suffix}")


FLUSH_EVERY_S = 2.0  # at most this much (plus one write) of a killed monitor's samples is lost
PART_MAX_ROWS = 50_000  # a part is rewritten whole at each flush: this bounds that write and the memory held
PARTS_SUFFIX = ".parts"
# What a spool writes beyond its FILE's path, the deepest: `FILE.parts/.part-NNNNNNN.parquet.<pid>.<hex>.tmp` (a part's
# temporary name; the room a monitor --output keeps for PATH_MAX, storage.runs.missing_parent).
SPOOL_DEPTH_BYTES = len(PARTS_SUFFIX) + len("/part-0000000.parquet") + TEMP_NAME_BYTES


def parts_dir_for(path: str | os.PathLike) -> Path:
    """The folder where a SampleSpool for `path` keeps its parts until the end: `FILE.parquet.parts/`."""
    p = Path(path)
    return p.with_name(p.name + PARTS_SUFFIX)


class SampleSpool:
    """Writes a Timeline's samples to disk as they come, so that a process killed without warning (kill -9, an
    OOM kill, a power cut) keeps all but the last flush interval of them; `close()` combines them into one file.

    Parquet cannot be appended to (a file without its footer is unreadable), so the samples go to numbered
    whole Parquet files in `FILE.parts/`: every flush drains the timeline and rewrites the current part
    atomically (storage.atomic: a kill leaves the previous version, never half), and a part that reaches
    `part_max_rows` is left as it is and a new one begun. Memory holds one part's rows at most. What a killed
    process leaves is the folder, readable as one table (pyarrow.parquet.read_table, DuckDB
    `read_parquet('FILE.parts/*.parquet')`); the parts are Parquet whatever FILE's suffix.
    `start()` flushes every `flush_every_s` on a thread of its own, so a slow terminal or pipe delays nothing.
    """

    def __init__(self, timeline: Timeline, path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                 flush_every_s: float = FLUSH_EVERY_S, part_max_rows: int = PART_MAX_ROWS):
        self.path = Path(path)
        self.parts_dir = parts_dir_for(path)
        self.timeline = timeline
        self.metadata = dict(metadata or {})
        self.flush_every_s = flush_every_s
        self.part_max_rows = part_max_rows
        self.reads = 0  # samples handed over (one RAPL read is a row per zone)
        self.rows = 0
        os.mkdir(self.parts_dir)  # FileExistsError: another spool's, or a killed one's, kept for its owner
        fsync_dir(self.parts_dir.parent)
        # Held while this process writes the parts (the kernel drops it when the process dies, kill -9 too):
        # `recover_parts` combines and removes only parts no live monitor is writing.
        self._lock_fd = _lock(self.parts_dir)
        self._part = 1
        self._current: list[pa.Table] = []  # the current part's rows, rewritten whole at each flush
        self._current_rows = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None  # the last flush's failure (the next one tries again)
        self.left = 0  # files in parts_dir that close() did not write and so left there (the folder kept)

    def start(self) -> "SampleSpool":
        self._thread = threading.Thread(target=self._run, name="powerprof-sample-spool", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            try:
                self.flush()
                self.error = None
            except OSError as e:  # a full disk now may have room at the next flush; close() raises it
                self.error = f"{e.strerror or e}"

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def flush(self) -> None:
        """Hand the timeline's samples over to disk: the current part rewritten with them, atomically."""
        import pyarrow as pa  # noqa: PLC0415

        with self._lock:
            items = self.timeline.drain()
            if not items:
                return
            table = self.timeline.to_table(items)
            self._current.append(table)
            self._current_rows += table.num_rows
            try:
                write_table(pa.concat_tables(self._current), self._part_path(self._part), self.metadata)
            except BaseException:
                # Not on disk: kept in memory for the next flush (a second's rows, not the run's).
                self._current.pop()
                self._current_rows -= table.num_rows
                self.timeline.put_back(items)
                raise
            self.reads += len(items)
            self.rows += table.num_rows
            if self._current_rows >= self.part_max_rows:
                self._part += 1
                self._current, self._current_rows = [], 0

    def _part_path(self, k: int) -> Path:
        return self.parts_dir / f"part-{k:06d}.parquet"

    def close(self, replace: bool = True) -> tuple[Path, int]:
        """Flush, combine the parts into `path` (one part at a time: memory stays bounded), remove the parts.
        replace=False: a `path` made meanwhile is kept and the samples go to `beside_name(path)`.
        Returns (where they went, rows). On a failure the parts stay, and the error is raised."""
        self._stop_thread()
        self.flush()
        parts = part_files(self.parts_dir)
        try:
            out = self._combine(self.path, replace, parts)
        except FileExistsError:
            out = self._combine(beside_name(self.path), False, parts)
        self.left = remove_parts(self.parts_dir, parts)
        self._unlock()
        return out, self.rows

    def abandon(self) -> bool:
        """Stop flushing after a last try, leaving the parts where they are (the run failed; they are its samples).
        A folder with nothing in it is removed. Returns whether samples were left there."""
        self._stop_thread()
        try:
            self.flush()
        except OSError:
            pass
        self._unlock()
        if self.rows == 0:
            self.left = remove_parts(self.parts_dir, part_files(self.parts_dir))
            return False
        return True

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _combine(self, path: Path, replace: bool, parts: list[Path]) -> Path:
        combine_parts(self.parts_dir, path, replace, self.metadata, parts=parts)
        return path


LOCK_NAME = ".lock"


def _lock(parts_dir: Path) -> int | None:
    """An exclusive flock on `parts_dir/.lock`; None where it is held by another process (a live monitor).
    RecoverError where `.lock` is a symlink: O_CREAT would follow it, and make (or open for writing) the file it
    names, anywhere root can write, for whoever could write in `parts_dir`."""
    import errno  # noqa: PLC0415
    import fcntl  # noqa: PLC0415

    lock = parts_dir / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise RecoverError(f"{lock} is a symlink (a monitor makes a plain file there: someone planted it?); "
                           f"nothing changed; remove it (rm {lock}) if you trust the parts, then recover again") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class RecoverError(ValueError):
    """The parts cannot be combined (none there, a live monitor writing them, a damaged part): nothing changed."""


def part_files(parts_dir: Path) -> list[Path]:
    """The parts a monitor wrote in `parts_dir` (`part-NNNNNN.parquet`), in order: what is combined, and removed."""
    return sorted(parts_dir.glob("part-*.parquet"))


def remove_parts(parts_dir: Path, parts: list[Path]) -> int:
    """Remove `parts` (those just combined), the monitor's own `.lock` and the temporaries of its flushes
    (`.part-*.tmp`, left by a kill during one), then `parts_dir` if nothing else is in it. Anything else (a user's
    notes, a folder of theirs) is left, and the folder with it: `monitor --recover` removed the whole folder.
    Returns how many other files were left (counted in sub-folders too)."""
    ours = set(parts) | {parts_dir / LOCK_NAME} | set(parts_dir.glob(".part-*.tmp"))
    for p in ours:
        try:
            if not p.is_dir() or p.is_symlink():
                p.unlink()
        except OSError:  # gone, or cannot be removed: then it is counted among those left, the folder kept
            pass
    left = 0
    try:
        os.rmdir(parts_dir)
    except OSError:
        left = sum(1 for p in parts_dir.rglob("*") if not p.is_dir() or p.is_symlink())
    fsync_dir(parts_dir.parent)
    return left


def combine_parts(parts_dir: Path, path: Path, replace: bool, metadata: Mapping[str, str] | None = None,
                  parts: list[Path] | None = None) -> int:
    """The parts of `parts_dir` as one file `path` (Parquet or CSV by its suffix), written atomically, one part
    at a time (memory stays bounded); `metadata` over the first part's own. Returns the rows written. A part
    that cannot be read raises RecoverError naming it, nothing written; FileExistsError as atomic_path."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from .schema import SAMPLES, rows_to_table  # noqa: PLC0415

    parts = part_files(parts_dir) if parts is None else parts
    schema = rows_to_table(SAMPLES, []).schema
    md = dict(schema.metadata or {})
    if parts and metadata is None:
        try:
            md.update(pq.read_schema(parts[0]).metadata or {})  # what the monitor wrote: command, simulated, gpus
        except (pa.ArrowInvalid, OSError) as e:
            raise RecoverError(f"{parts[0]}: cannot be read as Parquet ({e}); nothing written") from None
    md.update({str(k).encode(): str(v).encode() for k, v in (metadata or {}).items()})
    schema = schema.with_metadata(md)
    rows = 0
    with atomic_path(path, replace=replace) as tmp:
        if path.suffix.lower() == ".parquet":
            writer = pq.ParquetWriter(tmp, schema)
        else:
            import pyarrow.csv as pcsv  # noqa: PLC0415

            writer = pcsv.CSVWriter(tmp, schema)
        with writer:
            if not parts and path.suffix.lower() != ".parquet":
                writer.write_table(rows_to_table(SAMPLES, []))  # the header, as write_csv gives it
            for part in parts:
                try:
                    # Columns by name into the SAMPLES schema: a part missing one reads it as null.
                    t = pq.read_table(part)
                    t = pa.table({f.name: t.column(f.name).cast(f.type) if f.name in t.column_names
                                  else pa.nulls(t.num_rows, f.type) for f in schema}, schema=schema)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
                    raise RecoverError(f"{part}: cannot be read as Parquet ({e}); nothing written, the parts "
                                       "kept: move that file away to recover the others") from None
                writer.write_table(t)
                rows += t.num_rows
    return rows


def recover_parts(path: str | os.PathLike, replace: bool = False) -> tuple[Path, int, int]:
    """`monitor --recover FILE`: the parts a killed `monitor --output FILE` left in FILE.parts/ combined into
    FILE (as its suffix says), atomically, then the parts removed (`remove_parts`: only those, and the folder if
    nothing else is in it). Returns (FILE, rows, other files left in the folder). RecoverError where there are
    none or a live monitor holds them; FileExistsError where FILE exists and not `replace`."""
    path = Path(path)
    parts_dir = parts_dir_for(path)
    if not parts_dir.is_dir():
        raise RecoverError(f"{parts_dir} does not exist: nothing to recover (it holds the samples of a monitor "
                           f"--output {path} that was killed)")
    fd = _lock(parts_dir)
    if fd is None:
        raise RecoverError(f"{parts_dir} is being written by a monitor --output {path} that is still running: "
                           "stop it, and it combines them itself")
    try:
        parts = part_files(parts_dir)
        rows = combine_parts(parts_dir, path, replace, parts=parts)
        left = remove_parts(parts_dir, parts)  # only now that the file is whole on disk
    finally:
        os.close(fd)
    return path, rows, left
