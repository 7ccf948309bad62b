"""Samples to rows of the SAMPLES schema (one row per device per sample), a buffering Timeline, file writers.

Collector readings are turned into rows by their type, so this module needs no knowledge of
which collectors ran: GpuReading -> `gpuN`, RaplReading -> its zone (`package-0`, `dram-0`),
HostReading -> `host`, CpuTimeReading -> `cputime`. A missing sample (source failed or too slow) becomes one row with a null
device and the reason in `error`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from powerprof.collectors.cputime import CpuTimeReading
from powerprof.collectors.host import HostReading
from powerprof.collectors.nvml import GpuReading
from powerprof.collectors.rapl import RaplReading
from powerprof.collectors.sampler import Sample

from .atomic import atomic_path

if TYPE_CHECKING:
    import pyarrow as pa

FORMATS = (".parquet", ".csv")
TAG_COLUMNS = ("level_kind", "level_value")  # set by whoever runs levels (sweep), copied onto rows

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
    """A sampler subscriber that keeps every Sample in memory (thread-safe), with the tags current
    when it arrived. `sampler.subscribe(timeline)`; `timeline.set_tags(level_kind="power_limit",
    level_value=220)`; `timeline.to_table()`. `drain()` hands over and forgets what is buffered
    (for periodic flushes)."""

    def __init__(self, t0_mono_ns: int | None = None, gpu_uuids: Mapping[int, str] | None = None):
        self.t0_mono_ns = t0_mono_ns
        self.gpu_uuids = dict(gpu_uuids or {})
        self._lock = threading.Lock()
        self._items: list[tuple[Sample, Mapping | None]] = []
        self._tags: Mapping | None = None

    def __call__(self, sample: Sample) -> None:
        with self._lock:
            if self.t0_mono_ns is None:
                self.t0_mono_ns = sample.t_mono_ns
            self._items.append((sample, self._tags))

    def set_tags(self, **tags) -> None:
        unknown = set(tags) - set(TAG_COLUMNS)
        if unknown:
            raise ValueError(f"unknown tag columns {sorted(unknown)}; known: {TAG_COLUMNS}")
        with self._lock:
            self._tags = dict(tags) if tags else None

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

    def to_table(self, items: list[tuple[Sample, Mapping | None]] | None = None) -> pa.Table:
        with self._lock:
            items = list(self._items) if items is None else items
            t0 = self.t0_mono_ns if self.t0_mono_ns is not None else 0
        rows = [row for s, tags in items for row in sample_rows(s, t0, self.gpu_uuids, tags)]
        from .schema import SAMPLES, rows_to_table

        return rows_to_table(SAMPLES, rows)


def check_output_path(path: str | os.PathLike) -> Path:
    """Validate an output file name before any work starts; raises ValueError with the reason."""
    p = Path(path)
    if p.suffix.lower() not in FORMATS:
        raise ValueError(f"output {str(p)!r}: the file name must end in {' or '.join(FORMATS)}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"output {str(p)!r}: folder {str(parent)!r} does not exist")
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
    from datetime import datetime, timezone  # noqa: PLC0415

    p = Path(path)
    try:
        return write_table(table, p, metadata, replace=False)
    except FileExistsError:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
        return write_table(table, p.with_name(f"{p.stem}-{stamp}{p.suffix}"), metadata, replace=False)
