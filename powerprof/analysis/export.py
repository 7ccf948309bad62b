"""`powerprof export`: spreadsheet-ready CSV, xlsx or Parquet from run directories or daemon datasets.

Streams record batches from `pyarrow.dataset` (hive partitions for the daemon's
`samples/date=YYYY-MM-DD/*.parquet`), so a dataset larger than memory exports in bounded memory.
Every timestamp column gets a local-time twin; headers carry units (`power_w (W)`); CSV times are
ISO 8601 (`2026-01-15 12:00:00.000`) that spreadsheets read as dates. An xlsx opens ready to read:
a `summary` sheet first (the recommendation and run details), then one sheet per table with a
frozen header row, an autofilter, column widths from the headers and millisecond time cells.
Files are written under a temporary name and renamed, so a failed export leaves nothing half-written; a
file already there (an earlier export) is kept, the export refused, unless `force` says to replace it.

A row read twice is written once, by the key `analyze` counts it once by (rowkeys.py): a daemon table's, sweep windows', levels' or samples'
(or a tuner's decisions') copies are found in its keys sorted alone before anything is written (DuckDB's sort spills
to disk past its memory limit: memory stays flat however many rows). Only a table that has some is read a second
time, narrow (key, a hash of the row, its place in the scan), to mark each copy's place in a bit per row; the
write is then the same plain scan as a table without copies, in the same order, less the marked rows; a sweep
run given twice (the same run_id) adds none of its identical files, and its tables that differ are written each
row once. One key with rows that differ is refused.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from powerprof.storage import datafiles
from powerprof.storage.atomic import atomic_path
from powerprof.trust import out_dir_refusal
from powerprof.paths import OUTPUT_DEPTH_BYTES, RUN_JSON, TEMP_NAME_BYTES
from powerprof.storage.runs import cwd_gone, missing_parent, no_finished_level

from .rowkeys import TUNER_KEY, WHY, folder_sql, ident, is_tuner_decisions, key_of, keyless_sql, why_of

FORMATS = ("csv", "xlsx", "parquet")
XLSX_MAX_ROWS = 1_048_575  # one row of the sheet's 1,048,576 holds the header
BATCH_ROWS = 65_536

# Column-name suffix → unit shown in headers; the longest matching suffix wins.
UNITS = {
    "_j_per_token": "J/token", "_tok_s": "tokens/s", "_mhz": "MHz", "_bytes": "bytes", "_pct": "%",
    "_utc": "UTC", "_ms": "ms", "_uj": "uJ", "_w": "W", "_j": "J", "_s": "s", "_c": "degC", "_tokens": "tokens",
}
# Names whose suffix says no unit, or the wrong one (a fit's coefficient per token named _j): docs/data.md's unit.
NAMED_UNITS = {
    "decode_j": "J/token", "prefill_j": "J/token", "ctx_j_per_ktoken": "J/token/ktoken",
    "level_value": "W or MHz", "from_level": "W or MHz", "to_level": "W or MHz",
    "concurrency": "streams", "mean_streams": "streams", "server_predicted_per_second": "tokens/s",
    "draft_n": "tokens", "draft_n_accepted": "tokens", "server_predicted_n": "tokens", "server_prompt_n": "tokens",
    "prompt_tokens_estimate": "tokens", "n_token_events": "events", "max_events_per_read": "events", "n_reads": "reads",
    "max_read_share": "fraction", "clock_event_reasons": "bitmask",
    "hours": "h",  # fleet.parquet's (`analyze` of daemon datasets): tests/test_schema_docs.py holds every data.md row
}
# A confidence bound, or the pooled figure beside a median, has its quantity's unit: gpu_j_per_token_ci_low
# and gpu_j_per_token_pooled are in J/token.
BOUND_SUFFIXES = ("_ci_low", "_ci_high", "_pooled")
XLSX_TIME_FORMAT = "yyyy-mm-dd hh:mm:ss.000"  # Excel's default date-time format hides the milliseconds
XLSX_MAX_COL_W = 40
XLSX_MAX_CELL_CHARS = 32_767  # Excel's limit for one cell: past it the workbook opens as damaged, its content dropped


class ExportError(ValueError):
    """Bad input to an export: the message says what and how to fix it."""


class ExportUsageError(ExportError):
    """An option value that cannot be used (time zone, time, columns, format): a usage error, exit 2.

    An --out that names no place (its parent folder missing, a relative one from a removed current folder) is one too,
    as every command's (storage.runs.missing_parent); another --out it cannot use stays an ExportError (exit 1)."""


class ExportOutExists(ExportUsageError):
    """--out (or the default name in this folder) already holds a file the export would replace: exit 2, as
    `monitor --output` and `trace` refuse theirs; --force replaces it."""

    def __init__(self, paths: list[Path], folder: Path | None = None, default: bool = False):
        """default: the place is the default name (no --out was given), which the message says, with the option
        that chooses another (it said "Invalid value for --out" and "choose another folder" to a user who gave none)."""
        self.paths = paths
        self.default = default
        where = "the default output, as no --out was given" if default else ""
        if folder is None:
            msg = (f"{paths[0]} exists (an earlier export?{'; ' + where if where else ''}); choose another name"
                   + (" with --out FILE" if default else "") + ", or --force to replace it")
        else:
            names = ", ".join(p.name for p in paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
            msg = (f"{folder} already holds {names} (an earlier export?{'; ' + where if where else ''}); choose another "
                   f"folder{' with --out FOLDER' if default else ''}, or --force to replace "
                   f"{'it' if len(paths) == 1 else 'them'}")
        super().__init__(msg)


@dataclass(frozen=True)
class Source:
    name: str  # table name: samples, windows, levels, requests...
    dataset: ds.Dataset
    partition_fields: tuple[str, ...] = ()
    strays: tuple[str, ...] = ()  # files in its folder not read as data, that may hold rows (storage/datafiles.py)


def local_tz_name() -> str:
    """The machine's IANA time zone: $TZ, else /etc/localtime's link target, else UTC."""
    tz = os.environ.get("TZ", "").lstrip(":")
    if tz:
        return tz
    try:
        target = os.path.realpath("/etc/localtime")
        if "zoneinfo/" in target:
            return target.split("zoneinfo/", 1)[1]
    except OSError:
        pass
    return "UTC"


def _check_tz(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ExportUsageError(f"unknown time zone {name!r}: give an IANA name such as Europe/Berlin or UTC") from None


def parse_time(text: str | None, tz: str) -> datetime | None:
    """ISO 8601 date or date-time; without an offset it is read in `tz`. Returns an aware UTC datetime."""
    if text is None:
        return None
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ExportUsageError(f"cannot read {text!r} as an ISO 8601 time (e.g. 2026-01-15 or 2026-01-15T12:00:00Z)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=_check_tz(tz))
    return t.astimezone(timezone.utc)


def is_uri(src) -> bool:
    """An object-store (or file://) URI, read through pyarrow's filesystems."""
    return "://" in str(src)


def expand(srcs) -> list[str]:
    """Sources as given: one or several paths, local globs (expanded, sorted) and URIs."""
    import glob

    from powerprof.paths import resolve_problem  # noqa: PLC0415

    out: list[str] = []
    for s in [srcs] if isinstance(srcs, (str, os.PathLike)) else list(srcs):
        s = str(s)
        if not is_uri(s) and glob.has_magic(s):
            hits = sorted(glob.glob(s))
            if not hits:
                raise ExportError(f"{s}: the pattern matches nothing")
            out.extend(hits)
        else:
            out.append(s)
    if not out:
        raise ExportError("give at least one source: a run directory, a daemon dataset folder, a .parquet file")
    # A source named twice (a glob and a path) would export its rows twice.
    unique: dict[str, str] = {}
    for s in out:
        if not is_uri(s) and (why := resolve_problem(s)) is not None:
            raise ExportError(f"{s}: {why}")
        unique.setdefault(s if is_uri(s) else str(Path(s).resolve()), s)
    return list(unique.values())


def union_sources(groups: list[list[Source]]) -> list[Source]:
    """Tables of the same name from several sources (nodes, runs) as one dataset each: columns
    matched by name, a column missing from some files reads as null."""
    by_name: dict[str, list[Source]] = {}
    for g in groups:
        for s in g:
            by_name.setdefault(s.name, []).append(s)
    out = []
    for name, same in by_name.items():
        if len(same) == 1:
            out.append(same[0])
            continue
        try:
            meta = _sources_metadata(same)
            try:  # as they are: a column categorical in every source stays so, as each source's own export keeps it
                schema = pa.unify_schemas([s.dataset.schema for s in same], promote_options="permissive")
                union = ds.dataset([s.dataset for s in same], schema=schema.with_metadata(meta))
            except (pa.ArrowInvalid, pa.ArrowTypeError):  # categorical in some: read as its values
                schema = pa.unify_schemas([_dense(s.dataset.schema) for s in same], promote_options="permissive")
                union = ds.dataset([_with_schema(s.dataset, schema) for s in same], schema=schema.with_metadata(meta))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ExportError(f"table {name}: the sources' columns do not agree ({e})") from None
        out.append(Source(name, union, same[0].partition_fields, tuple(f for x in same for f in x.strays)))
    return out


def _sources_metadata(same: list[Source]) -> dict:
    """The union's key-value metadata: the sources' where they agree; where their `powerprof` (a run's run.json)
    differs, none of them as the table's, but every one, in order, under `powerprof_sources` (unify_schemas kept the
    first's: a simulated run exported after a real one read as real, and the other way round)."""
    metas = [dict(s.dataset.schema.metadata or {}) for s in same]
    runs = [m.get(b"powerprof") for m in metas]
    if len(set(runs)) <= 1:
        return metas[0]
    out = {k: v for k, v in metas[0].items() if k != b"powerprof" and all(m.get(k) == v for m in metas)}
    out[b"powerprof_sources"] = json.dumps([json.loads(r) if r else None for r in runs]).encode()
    return out


def _with_schema(d: ds.Dataset, schema: pa.Schema) -> ds.Dataset:
    """`d` read as `schema`: its files again, each with its partition values, for a categorical column to be read as its
    values (replace_schema, which the union does, casts no dictionary to text: two nodes whose tag was categorical in
    one were refused as 'the sources' columns do not agree', and in both too once every schema was made plain)."""
    if d.schema.equals(schema) or not isinstance(d, ds.FileSystemDataset):
        return d
    return ds.FileSystemDataset([d.format.make_fragment(f.path, d.filesystem, partition_expression=f.partition_expression)
                                 for f in d.get_fragments()], schema, d.format, d.filesystem)


# How long pyarrow's GCS client retries one call before it gives up: its default is 15 minutes, and `export gs://…`
# with no network printed nothing for 9 min 50 s. A `retry_limit_seconds` the URI gives is kept.
GCS_RETRY_LIMIT_S = 20


def _open_uri(uri: str):
    """(filesystem, path) of a URI, by pyarrow.fs; a GCS one bounded by GCS_RETRY_LIMIT_S."""
    import pyarrow.fs as pafs
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit  # noqa: PLC0415

    parts = urlsplit(uri)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.scheme in ("gs", "gcs") and not any(k == "retry_limit_seconds" for k, _ in query):
        uri = urlunsplit(parts._replace(query=urlencode([*query, ("retry_limit_seconds", GCS_RETRY_LIMIT_S)])))
    return pafs.FileSystem.from_uri(uri)


def _uri_join(uri: str, name: str) -> str:
    """The URI of `name` in the folder `uri` names (its query kept after it): a table's stray files are named by it."""
    from urllib.parse import urlsplit, urlunsplit  # noqa: PLC0415

    parts = urlsplit(uri)
    return urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + name))


def _uri_sources(uri: str, opened=None) -> list[Source]:
    """A daemon dataset folder, one of its tables, or one Parquet file behind a URI (s3://, gs://,
    abfs://, hdfs://, file://), through pyarrow.fs.

    Any failure to reach the store, from opening to listing the tables' files, is an ExportError naming the URI:
    an unreachable store raises OSError (S3), or pyarrow's plain ArrowException (Azure's credential chain), either
    of which was a traceback. `opened`: the (filesystem, path) `_open_uri` gave already (opened once: a dead store's
    wait, about 20 s on GCS, came twice)."""
    import pyarrow.fs as pafs

    try:
        fs, path = opened or _open_uri(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise ExportError(f"{uri}: no such file or folder")
        name = path.rstrip("/").rsplit("/", 1)[-1]

        if info.type == pafs.FileType.File:
            return [Source(name.removesuffix(".parquet"), open_dataset(path, filesystem=fs, label=uri))]
        subs = [i for i in fs.get_file_info(pafs.FileSelector(path)) if i.type == pafs.FileType.Directory
                and not i.base_name.startswith((".", "_"))]
        if subs and all(i.base_name.startswith("date=") for i in subs):
            subs = []  # the URI names one table (requests/), not the data folder above it
        return [table_source(sub.base_name, sub.path, filesystem=fs, label=_uri_join(uri, sub.base_name)) for sub in subs] \
            or [table_source(name, info.path, filesystem=fs, label=uri)]
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid and ArrowTypeError are ArrowExceptions too
        raise ExportError(f"{uri}: cannot open ({e})") from None


def analysis_folders(p: Path) -> list[Path]:
    """The folders of an analysis' outputs whose analysis.parquet an export of `p` reads: a run's analysis/, an
    `analyze --out` folder given itself, the folder of an analysis.parquet given alone, or through a symlink of another
    name (its target's folder: matched by the link's name alone, it went out mixed). Their ids are checked
    (report.outputs_disagree, unread_outputs_disagree) wherever they are: only RUN/analysis was."""
    if p.is_file():
        return list(dict.fromkeys(q.parent for q in (p, p.resolve()) if q.name == "analysis.parquet"))
    return [d for d in (p, p / "analysis") if (d / "analysis.parquet").is_file()] if p.is_dir() else []


def local_path(src) -> Path | None:
    """The local path a source names: itself, or a file:// URI's path; None for a remote URI (s3://, gs://, …)."""
    if not is_uri(src):
        return Path(src)
    from urllib.parse import unquote, urlsplit  # noqa: PLC0415

    parts = urlsplit(str(src))
    return Path(unquote(parts.path)) if parts.scheme == "file" and parts.netloc in ("", "localhost") else None


def analysis_folders_of(src) -> list[Path]:
    """`analysis_folders` of a local source or a file:// URI (never checked before: a mixed analysis went out, exit
    0); none for a remote URI (`_remote_analysis_folders`, through its filesystem), nor for a path that cannot be
    inspected (its read says why)."""
    p = local_path(src)
    try:
        return analysis_folders(p) if p is not None else []
    except OSError:
        return []


def _run_read_as_dataset(src) -> str | None:
    """The note for a file:// URI of a run folder: read as a dataset folder, only its sub-folders' tables
    (analysis/) go out, the run's own tables (windows, samples, levels) left out without a word."""
    p = local_path(src)
    if not is_uri(src) or p is None or not os.path.isfile(p / RUN_JSON):
        return None
    return (f"{src} is read as a dataset folder: only the tables in its sub-folders (its analysis) are exported, not "
            f"the run's windows, samples and levels; give its path {p} (no file://) for those")


def _refuse_mixed(folder: Path | str, fs=None, shown: str | None = None, notes: list[str] | None = None) -> None:
    from .report import outputs_disagree  # noqa: PLC0415

    if (why := outputs_disagree(folder, fs, shown, notes)) is not None:
        raise ExportError(why)


def _remote_analysis_folders(fs, path: str) -> list[str]:
    """`analysis_folders` behind a remote URI (s3://, gs://, …), its filesystem's paths: the folder of an
    analysis.parquet given alone, or the folder given and its analysis/ where each holds one. A symlink's target is
    not asked for there (object stores have none)."""
    import pyarrow.fs as pafs  # noqa: PLC0415

    path = path.rstrip("/")
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [path.rsplit("/", 1)[0]] if info.base_name == "analysis.parquet" and "/" in path else []
    if info.type != pafs.FileType.Directory:
        return []
    return [d for d in (path, f"{path}/analysis") if fs.get_file_info(f"{d}/analysis.parquet").is_file]


def _refuse_mixed_remote(uri: str, fs, path: str, notes: list[str] | None = None) -> None:
    """ExportError where an analysis behind a remote URI (`_open_uri`'s fs and path) is mixed (`outputs_disagree`
    through its filesystem): it went out unchecked, said only as a limit. A store that cannot be reached is said by the
    read after."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    from .report import unread_outputs_disagree  # noqa: PLC0415

    try:
        folders = _remote_analysis_folders(fs, path)
    except (pa.ArrowException, OSError, ValueError):
        return
    for folder in folders:
        _refuse_mixed(folder, fs, f"{urlsplit(uri).scheme}://{folder}", notes)
        if notes is not None:  # its reports and plots, as a local folder's (export() asks those): they got no note
            notes.extend(unread_outputs_disagree(folder, fs, f"{urlsplit(uri).scheme}://{folder}"))


def find_sources(src, notes: list[str] | None = None, opened: dict | None = None) -> list[Source]:
    """Tables of a run directory (top-level *.parquet, plus analysis/analysis.parquet), of a daemon
    dataset (one hive-partitioned dataset per sub-folder), of a single Parquet file, or of a URI. `notes` receives
    an analysis table whose id could not be read (its mix unchecked); `opened` (where given), a remote URI's
    (filesystem, path) by the URI, for the summary sheet's reads (`summary_rows`): a store opened once."""
    if is_uri(src):
        for folder in analysis_folders_of(src):  # a file:// URI's
            _refuse_mixed(folder, notes=notes)
        if local_path(src) is not None:
            return _uri_sources(str(src))
        try:
            store = _open_uri(str(src))
        except (pa.ArrowException, OSError) as e:  # as _uri_sources says it
            raise ExportError(f"{src}: cannot open ({e})") from None
        if opened is not None:
            opened[str(src)] = store
        _refuse_mixed_remote(str(src), *store, notes)
        return _uri_sources(str(src), store)
    p = Path(src)
    from powerprof.paths import path_problem  # noqa: PLC0415

    if (why := path_problem(p)) is not None:  # an OSError traceback from exists() ("File name too long")
        raise ExportError(f"{p}: {why}")
    if not p.exists():
        raise ExportError(f"{p}: no such file or directory")
    for folder in analysis_folders(p):
        _refuse_mixed(folder, notes=notes)
    if p.is_file():
        if p.suffix != ".parquet":
            raise ExportError(f"{p}: not a Parquet file; give a run directory, a dataset folder or a .parquet file")
        return [Source(p.stem, open_dataset(p))]
    from .fleet import run_and_dataset  # noqa: PLC0415

    if (why := run_and_dataset(str(p))) is not None:
        raise ExportError(why)
    out = [Source(f.stem, open_dataset(f)) for f in sorted(p.glob("*.parquet")) if datafiles.is_data_name(f.name)]
    if (p / "analysis" / "analysis.parquet").exists():
        out.append(Source("analysis", open_dataset(p / "analysis" / "analysis.parquet")))
    subs = sorted(d for d in p.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))
    if not out and subs and all(d.name.startswith("date=") for d in subs):
        # One table's folder (requests/, a tuner's decisions): one table named by it, as for a URI, not
        # one per day named "date=..." (which no key of rowkeys.py would find).
        out.append(table_source(p.name, p))
    if not out:
        runs = [d.name for d in subs if (d / "run.json").is_file()]
        if runs:
            # A folder of runs read as a daemon dataset took each run for one table ("table s1": its levels and its
            # analysis as one, "3 keys hold rows that differ").
            shown = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
            from .fleet import is_daemon_dataset  # noqa: PLC0415

            if is_daemon_dataset(str(p)):
                # Else read as one more table of the dataset's, the run's files mixed in it; the daemon takes a data
                # dir with runs below it, which nothing else reads as one.
                raise ExportError(f"{p} holds a daemon's datasets and the sweep run{'s' if len(runs) > 1 else ''} "
                                  f"{shown}: the run's files would be read as one more table of the daemon's; move the "
                                  f"run out of it (e.g. mv {p / runs[0]} {p.parent}/), then export each on its own")
            raise ExportError(f"{p}: a folder of runs ({shown}), not a run or a daemon dataset: give the runs "
                              f"themselves, e.g. '{p}/*'")
        from .fleet import fleet_folder_refusal  # noqa: PLC0415

        if (why := fleet_folder_refusal(p, "export")) is not None:  # else each node read as one table, all mixed
            raise ExportError(why)
        for sub in subs:
            if datafiles.table_files(sub)[0]:
                out.append(table_source(sub.name, sub))
    if not out:
        raise ExportError(no_finished_level(p, "export")
                          or f"{p}: no Parquet tables found (expected a run directory or a daemon dataset folder)")
    return out


def table_source(name: str, path, filesystem=None, label=None) -> Source:
    """A table's hive-partitioned folder (a daemon dataset's requests/, a tuner's decisions), local or behind a URI: its
    files by the rule analyze reads them by (storage/datafiles.py: `*.parquet`, nothing hidden), the rest named."""
    if filesystem is None:
        data, strays = datafiles.table_files(Path(path))
        files, stray_names = [str(f) for f in data], tuple(str(f) for f in strays)
    else:
        import pyarrow.fs as pafs

        base = str(path).rstrip("/")
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
        rels = [i.path[len(base) + 1:] for i in infos if i.type == pafs.FileType.File]
        data, strays = datafiles.split_names(rels)
        files, stray_names = [f"{base}/{r}" for r in data], tuple(f"{label or base}/{r}" for r in strays)
    # Hive keys only where a folder below the table's says one (date=...): with none, pyarrow's discovery names every
    # column of the first file a partition key, and export wrote none of them (nothing, exit 0, unsaid).
    base = str(Path(path)) if filesystem is None else str(path).rstrip("/")  # as `files` were made from it
    hive = any("=" in part for f in files for part in f[len(base) + 1:].replace("\\", "/").split("/")[:-1])
    d = open_dataset(files, hive=hive, filesystem=filesystem, label=label or path, base=str(path), table=name)
    parts = tuple(d.partitioning.schema.names) if hive and d.partitioning is not None else ()
    return Source(name, d, parts, stray_names)


def open_dataset(path, hive: bool = False, filesystem=None, label=None, base=None, table=None) -> ds.Dataset:
    """The one place export opens a table's files: a dataset whose schema is every file's columns, matched by name.

    path: one file, or a list of them (table_source's) below `base`, whose folders are the hive partitions. A file whose
    column holds another kind of value than powerprof writes it as (table: which table), or than another file's, is
    refused naming it (storage/datafiles.type_refusal, the rule analyze refuses it by).

    pyarrow takes a folder's schema from its first file: a daemon folder whose first file was written before a column
    (server_count, other_cpu_pct, prompt_tokens_estimate) read without it, and the newer files' values were silently
    dropped. So every file's footer is read and the schemas unified; a file without a column reads it as null
    (`older_columns` says how many rows). The files with the most columns come first, so the columns keep the newest
    writer's order."""
    label = label or path
    table = table or (Path(str(path)).stem if isinstance(path, (str, os.PathLike)) else None)
    extra = {"partition_base_dir": base} if hive and base is not None else {}
    try:
        d = ds.dataset(path, filesystem=filesystem, format="parquet", partitioning="hive" if hive else None, **extra)
        frags = list(d.get_fragments())
        if why := datafiles.type_refusal(table, ((f.path, f.physical_schema) for f in frags)):
            raise ExportError(why)
        # In a table's folder, a file of none of its columns would lend it rows with every column empty (a file
        # given alone is exported as it is: nothing to mix it into).
        for f in frags if isinstance(path, list) else ():  # a list: table_source's files of a table's folder
            if why := datafiles.foreign_file_refusal(table, f.path, f.physical_schema.names):
                raise ExportError(why)
        files = sorted((f.physical_schema for f in frags), key=lambda s: -len(s.names))
        if len(files) < 2 or all(s.equals(files[0]) for s in files[1:]):
            return d
        parts = d.partitioning.schema if d.partitioning is not None else pa.schema([])
        # A categorical column is read as its values (datafiles judges it by them): one file's dictionary and
        # another's plain text would not unify ("Unable to merge"), refused as a damaged file.
        schema = pa.unify_schemas([*(_dense(s.remove_metadata()) for s in files), _dense(parts)], promote_options="permissive")
        return ds.dataset(path, schema=schema, filesystem=filesystem, format="parquet",
                          partitioning=ds.HivePartitioning(parts) if hive else None, **extra)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise ExportError(_unreadable(label, e, filesystem is None)) from None


def _unreadable(label, e: Exception, local: bool) -> str:
    """The refusal of a table with a file pyarrow cannot open (cut short, empty, not Parquet): that file, named once,
    the reason and the fix. pyarrow's own text named the file twice within "Error creating dataset. Could not read
    schema from …" and said nothing of what to do. Behind a URI the text names the file without its scheme: kept whole
    under the URI given."""
    m = re.search(r"Could not open Parquet input source '(.+?)': (.*)", str(e), re.S) if local else None
    if m is None:
        return f"{label}: cannot be read as Parquet ({e})"
    return (f"{m[1]}: cannot be read as Parquet ({' '.join(m[2].split())}): restore it, or move it out of the folder, "
            "and run again")


def _dense(schema: pa.Schema) -> pa.Schema:
    """The schema with each dictionary (categorical) field as its value type."""
    return pa.schema([f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f for f in schema],
                     metadata=schema.metadata)


def older_columns(dataset: ds.Dataset, partition_fields=()) -> dict[str, int]:
    """Column → rows of files that lack it (written before the column existed): null in the export, unknown."""
    names = [n for n in dataset.schema.names if n not in partition_fields]
    out: dict[str, int] = {}
    children = dataset.children if isinstance(dataset, ds.UnionDataset) else [dataset]
    for child in children:
        for frag in child.get_fragments():
            have = set(frag.physical_schema.names)
            rows = frag.metadata.num_rows if hasattr(frag, "metadata") else frag.count_rows()
            for n in names:
                if n not in have and rows:
                    out[n] = out.get(n, 0) + rows
    return out


def time_column(schema: pa.Schema) -> str | None:
    """The column that places a row in time: time_utc, else the first timestamp column."""
    if "time_utc" in schema.names and pa.types.is_timestamp(schema.field("time_utc").type):
        return "time_utc"
    for f in schema:
        if pa.types.is_timestamp(f.type):
            return f.name
    return None


def _to_digits(t: datetime, digits: int) -> str:
    """`2026-12-04 20:31:25` with `digits` of the fraction of a second (cut, not rounded, as the seconds are)."""
    return t.strftime("%Y-%m-%d %H:%M:%S") + (f".{t.microsecond:06d}"[:digits + 1] if digits else "")


def _time_span(src: Source, t_from: datetime | None = None, t_to: datetime | None = None) -> str:
    """` (its rows span A to B UTC)`, streamed over the time column alone, and which bound (UTC datetimes, as
    parse_time gives) lies past the rows; " (it has no rows)" for an empty table."""
    col = time_column(src.dataset.schema)
    lo = hi = None
    for b in src.dataset.scanner(columns=[col], batch_readahead=1, fragment_readahead=1).to_batches():
        mm = pc.min_max(b.column(0))
        if mm["min"].is_valid:
            lo = mm["min"].as_py() if lo is None else min(lo, mm["min"].as_py())
            hi = mm["max"].as_py() if hi is None else max(hi, mm["max"].as_py())
    if lo is None:
        return " (it has no rows)"
    # A naive column is compared as UTC wall clock (_filter): so are the bounds here.
    t_from, t_to = ((t if t is None or lo.tzinfo else t.replace(tzinfo=None)) for t in (t_from, t_to))
    utc = " UTC" if lo.tzinfo else ""
    # Whole seconds, milliseconds or microseconds: the fewest that show different times differently. Rows from
    # 20:31:25.7 printed as "span 20:31:25 to 20:31:25" beside `--to 20:31:25Z`, which selected none of them, for no
    # reason to be seen.
    times = [t for t in (lo, hi, t_from, t_to) if t is not None]
    digits = next((d for d in (0, 3) if all((a == b) == (_to_digits(a, d) == _to_digits(b, d))
                                            for a in times for b in times)), 6)

    def shown(t: datetime) -> str:
        return _to_digits(t, digits)

    why = ""
    if t_to is not None and t_to <= lo:
        why = f": --to {shown(t_to)}{utc} is at or before its first row (--to takes the rows before it)"
    elif t_from is not None and t_from > hi:
        why = f": --from {shown(t_from)}{utc} is after its last row"
    return f" (its rows span {shown(lo)} to {shown(hi)}{utc}){why}"


def _filter(src: Source, t_from: datetime | None, t_to: datetime | None):
    col = time_column(src.dataset.schema)
    if col is None or (t_from is None and t_to is None):
        return None
    typ = src.dataset.schema.field(col).type
    expr = None
    for t, op in ((t_from, "ge"), (t_to, "lt")):
        if t is None:
            continue
        val = pa.scalar(t if typ.tz else t.replace(tzinfo=None), type=typ)
        e = ds.field(col) >= val if op == "ge" else ds.field(col) < val
        expr = e if expr is None else expr & e
    # Partition pruning: whole days outside the range are never opened.
    if "date" in src.partition_fields:
        ptype = src.dataset.schema.field("date").type
        for t, op in ((t_from, "ge"), (t_to, "le")):
            if t is None:
                continue
            d: date = t.date()
            val = d.isoformat() if pa.types.is_string(ptype) else (pa.scalar(d, ptype) if pa.types.is_date(ptype) else None)
            if val is not None:
                expr &= (ds.field("date") >= val) if op == "ge" else (ds.field("date") <= val)
    return expr


def local_name(col: str) -> str:
    return (col[:-4] if col.endswith("_utc") else col) + "_local"


def header(col: str, tz: str) -> str:
    if col.endswith("_local"):
        return f"{col} ({tz})"
    base = next((col[: -len(b)] for b in BOUND_SUFFIXES if col.endswith(b)), col)
    if base in NAMED_UNITS:
        return f"{col} ({NAMED_UNITS[base]})"
    for suffix in sorted(UNITS, key=len, reverse=True):
        if base.endswith(suffix) or base == suffix[1:]:  # a name that is the unit's word alone: j_per_token
            return f"{col} ({UNITS[suffix]})"
    return col


def _with_local_times(batch: pa.RecordBatch, tz: str) -> pa.Table:
    """Each timestamp column (UTC) followed by its wall-clock twin in `tz` (naive timestamps)."""
    names, arrays = [], []
    for name, arr in zip(batch.schema.names, batch.columns):
        names.append(name)
        arrays.append(arr)
        if pa.types.is_timestamp(arr.type):
            utc = arr if arr.type.tz else pc.assume_timezone(arr, "UTC")
            names.append(local_name(name))
            arrays.append(pc.local_timestamp(utc.cast(pa.timestamp(arr.type.unit, tz=tz))))
    return pa.Table.from_arrays(arrays, names=names)


def _plan(sources: list[Source], columns: list[str] | None) -> dict[str, list[str]]:
    """Columns to read per table (partition keys only when asked for). ExportUsageError for a list naming none
    (`--columns ''` exported every column) or a column twice (a Parquet file with a duplicate field, which
    pandas cannot read; a csv header with the name twice)."""
    if columns is not None and not columns:
        raise ExportUsageError("--columns names no column; give one or more, comma-separated (e.g. "
                               "--columns time_utc,power_w), or leave it out for every column")
    if columns and (twice := [c for c, n in Counter(columns).items() if n > 1]):
        raise ExportUsageError(f"--columns names {', '.join(twice)} twice; name each column once")
    plan = {}
    for s in sources:
        names = [n for n in s.dataset.schema.names if n not in s.partition_fields]
        plan[s.name] = [c for c in (columns or names) if c in s.dataset.schema.names]
    if columns:
        unknown = [c for c in columns if not any(c in cols for cols in plan.values())]
        if unknown:
            avail = sorted({n for s in sources for n in s.dataset.schema.names})
            raise ExportUsageError(f"unknown column(s) {', '.join(unknown)}; available: {', '.join(avail)}")
    return {k: v for k, v in plan.items() if v}


def export(src, fmt: str, out=None, time_from: str | None = None, time_to: str | None = None,
           columns: list[str] | None = None, tz: str | None = None, batch_rows: int = BATCH_ROWS,
           notes: list[str] | None = None, force: bool = False) -> list[Path]:
    """Export every table of `src` in `fmt`; returns the files written. Raises ExportError on bad input,
    ExportOutExists where a file it would write exists (force: replace it, atomically).

    src: one source or several (paths, globs, URIs); tables of the same name are exported as one
    (daemon datasets of several nodes: their rows carry `host`). `notes` (when given) receives what
    the reader must know, e.g. tables that --from/--to cannot filter."""
    if fmt not in FORMATS:
        raise ExportUsageError(f"unknown format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    tz = tz or local_tz_name()
    _check_tz(tz)
    t_from, t_to = parse_time(time_from, tz), parse_time(time_to, tz)
    if t_from and t_to and t_from >= t_to:
        raise ExportUsageError(f"--from ({time_from}) must be before --to ({time_to})")
    srcs = expand(src)
    opened: dict = {}  # a remote URI's store, opened once: its summary sheet is read through it
    groups = [find_sources(s, notes, opened) for s in srcs]
    if (why := _dataset_beside_run(srcs, groups)) is not None:
        raise ExportError(why)
    sources = union_sources(_without_copied_runs(srcs, groups, notes))
    if notes is not None:
        from .report import unread_outputs_disagree  # noqa: PLC0415

        notes.extend(n for s in srcs for d in analysis_folders_of(s) for n in unread_outputs_disagree(d))
        notes.extend(n for n in map(_run_read_as_dataset, srcs) if n)
        # Its tables are there (Ctrl-C in the first level flushes them) but hold no finished level.
        notes.extend(f"{m}: its tables hold only what was measured before it stopped"
                     for m in (no_finished_level(s, None) for s in srcs if not is_uri(s) and Path(s).is_dir()) if m)
    if notes is not None and (said := datafiles.strays_note([f for s in sources for f in s.strays])):
        notes.append(said)
    plan = _plan(sources, columns)
    sources = [s for s in sources if s.name in plan]
    whole = sorted(s.name for s in sources if (t_from or t_to) and time_column(s.dataset.schema) is None)
    note = (f"--from/--to cannot filter {', '.join(whole)}: they have no time column and hold whole-run "
            "figures (every level), not figures of the selected time") if whole else None
    if note and notes is not None:
        notes.append(note)
    if notes is not None:
        # A column newer than some files (server_count beside rows written before it) is empty in their rows: said, as
        # such an empty cell is unknown, never zero or complete.
        for s in sources:
            by_rows: dict[int, list[str]] = {}
            for c, n in older_columns(s.dataset, s.partition_fields).items():
                if c in plan[s.name]:
                    by_rows.setdefault(n, []).append(c)
            notes.extend(f"{s.name}: {', '.join(cols)} empty in the {n} rows of its files written before "
                         f"{'that column' if len(cols) == 1 else 'those columns'} existed (unknown there, not zero)"
                         for n, cols in sorted(by_rows.items()))
    if (t_from or t_to) and notes is not None:
        # An empty selection (a mistyped date, another day's run) wrote header-only files without a word.
        for s in sources:
            if time_column(s.dataset.schema) is not None and not s.dataset.count_rows(filter=_filter(s, t_from, t_to)):
                notes.append(f"--from/--to select no row of {s.name}" + _time_span(s, t_from, t_to))
    if len(srcs) == 1 and not is_uri(srcs[0]):
        src_path = Path(srcs[0])
        default_stem = src_path.stem if src_path.is_file() else src_path.resolve().name
    else:
        src_path = srcs[0]  # several sources: the summary's run details come from the first (a URI kept whole)
        default_stem = "export"
    out_given = out
    if out is None and cwd_gone(".") is not None:  # Path.cwd() below: a FileNotFoundError traceback
        raise ExportUsageError("no --out given, and its default is in the current folder: the current folder no longer "
                               "exists (removed). Fix: cd to one that does, or give an absolute --out")
    out = Path(out) if out is not None else Path.cwd() / (default_stem + (".xlsx" if fmt == "xlsx" else f"-{fmt}"))
    from powerprof.paths import not_a_regular_file, path_problem, temp_name_problem  # noqa: PLC0415

    if (why := path_problem(out)) is not None:  # "File name too long" was an OSError traceback from out.exists()
        raise ExportUsageError(f"--out {out}: {why}")  # a usage error, exit 2 (it was 1)
    if (why := cwd_gone(out)) is not None:  # before out.resolve() below: a FileNotFoundError traceback
        raise ExportUsageError(why)
    single = fmt != "xlsx" and len(sources) == 1 and out.suffix == f".{fmt}"
    # Whatever --force says: a FIFO, a device, a socket, a folder or a symlink (a looping one too) where a file goes
    # would be replaced by the file (`--out x.csv --force` made a device a regular file).
    targets = [out] if fmt == "xlsx" or single else [out / f"{s.name}.{fmt}" for s in sources]
    if (fmt == "xlsx" or single) and (why := temp_name_problem(out)) is not None:  # it failed at the write, exit 1
        raise ExportUsageError(f"--out {out}: {why}")
    # In a folder export, the folder's own name too: a looping symlink there was a RuntimeError traceback.
    for t in targets + ([out] if not (fmt == "xlsx" or single) and not os.path.isdir(out) else []):
        if (what := not_a_regular_file(t)) is not None:
            raise ExportUsageError(f"--out: {t} exists and is {what}, not a regular file: nothing written (--force "
                                   f"replaces only a regular file); choose another {'name' if fmt == 'xlsx' or single else 'folder'}"
                                   + ("; an xlsx export is one workbook: give a file name ending in .xlsx"
                                      if fmt == "xlsx" and what == "a folder" else ""))
    if any(not is_uri(s) and out.resolve() == Path(s).resolve() for s in srcs):
        raise ExportError("--out must not be the source itself")
    if fmt == "parquet" and (why := _parquet_out_taken(out.parent if single else out)) is not None:
        raise ExportUsageError(why)
    if fmt == "xlsx" and (out.is_dir() or out.suffix.lower() != ".xlsx"):
        # A workbook named x.csv (or written into a folder's place) opens as garbage, or not at all.
        raise ExportError(f"--out {out}: an xlsx export is one workbook; give a file name ending in .xlsx")
    if fmt != "xlsx" and not single and out.suffix == f".{fmt}":
        # A folder named x.csv holding several files is not the file the user asked for.
        raise ExportError(f"--out {out} names one .{fmt} file, but the selection has {len(sources)} tables "
                          f"({', '.join(s.name for s in sources)}): give a folder, or give one table as the source "
                          f"(a run's {sources[0].name}.parquet, a daemon dataset's {sources[0].name}/ folder): --columns "
                          "picks columns, and any table that has one of them is written")
    # A file's folder, or a folder's parent, that does not exist is never made (storage.runs.missing_parent, every
    # command's rule): a file's failed at the end naming a temporary ("Failed to open local file '.w.parquet.1.tmp'").
    if (why := missing_parent(out, below=TEMP_NAME_BYTES if fmt == "xlsx" or single else OUTPUT_DEPTH_BYTES)) is not None:
        raise ExportUsageError(why)  # a file's temporary name, or a folder's files
    if (fmt == "xlsx" or single) and not out.parent.is_dir():
        from powerprof.paths import what_is  # noqa: PLC0415

        raise ExportError(f"--out {out}: {out.parent} is {what_is(out.parent)}, not a folder; give a file in a folder "
                          "that exists")
    # As root, the folder written in root's or the sudo user's (trust.py): not another user's, nor reached through
    # their symlink, which would have root write the tables wherever it points.
    if (why := out_dir_refusal(out.parent if fmt == "xlsx" or single else out, "export folder")) is not None:
        raise ExportError(why)
    if not force:
        # Before anything is read: an earlier export (a spreadsheet someone annotated) was replaced without a word.
        there = [t for t in targets if os.path.lexists(t)]
        if there:
            raise ExportOutExists(there, None if fmt == "xlsx" or single else out, default=out_given is None)
    # Before anything is written: a key with two different rows refuses the export, whatever the format.
    copies = {s.name: c for s in sources if (c := _copies_of(s, _filter(s, t_from, t_to))) is not None}
    if notes is not None:
        notes.extend(c.note() for c in copies.values() if c.dropped)
        for s in sources:
            if n := unkeyed_decisions(s, _filter(s, t_from, t_to)):
                notes.append(f"{s.name}: {n} decision rows have no tuner_id and seq (written before the tuner numbered "
                             "its decisions): each is written as it is, so a copy among them (a copied folder or "
                             "file) is written twice")
    # Little read-ahead: memory stays near one row group per table however large the dataset.
    scans = {s.name: _Once(s, plan[s.name], _filter(s, t_from, t_to), copies[s.name], batch_rows)
             if s.name in copies and copies[s.name].dropped else
             s.dataset.scanner(columns=plan[s.name], filter=_filter(s, t_from, t_to), batch_size=batch_rows,
                               batch_readahead=1, fragment_readahead=1)
             for s in sources}
    if fmt == "xlsx":
        for s in sources:
            n = s.dataset.count_rows(filter=_filter(s, t_from, t_to))
            n -= copies[s.name].dropped if s.name in copies else 0  # what the sheet will hold
            if n > XLSX_MAX_ROWS:
                raise ExportError(f"table {s.name} has {n} rows in the selection; a sheet holds {XLSX_MAX_ROWS}. "
                                  "Narrow it with --from/--to or --columns, or export csv or parquet.")
        summary = summary_rows(src_path, tz, time_from, time_to, opened.get(str(src_path))) \
            + ([("not filtered by --from/--to", note)] if note else [])
        try:
            cut: dict[str, dict[str, int]] = {}
            written = [_write_xlsx(scans, out, tz, summary, replace=force, cut=cut)]
            if notes is not None:
                notes.extend(f"{out}: {name}: {sum(c.values())} text cells "
                             f"({', '.join(f'{k}: {n}' for k, n in sorted(c.items()))}) longer than a cell holds "
                             f"({XLSX_MAX_CELL_CHARS:,} characters) are cut there, each ending in \"[cut: ...]\"; a "
                             "csv or parquet export keeps the whole text" for name, c in cut.items() if c)
            return written
        except FileExistsError:  # made while the export ran
            raise ExportOutExists([out]) from None
        except (pa.ArrowInvalid, OSError) as e:
            raise ExportError(f"export to {out} failed, nothing written: {_why(e)}") from None
    if not single:
        if out.exists() and not out.is_dir():
            raise ExportError(f"--out {out} is a file: give a folder (one .{fmt} file per table), "
                              f"or a name ending in .{fmt} for a single table")
        try:
            out.mkdir(exist_ok=True)  # its parent checked above (missing_parent)
        except OSError as e:
            raise ExportError(f"cannot create the folder {out}: {_why(e)}") from None
    written = []
    for name, scan in scans.items():
        path = out if single else out / f"{name}.{fmt}"
        neutralised: dict[str, int] = {}
        try:
            with atomic_path(path, replace=force) as tmp:
                if fmt == "csv":
                    _write_csv(scan, tmp, tz, neutralised)
                else:
                    _write_parquet(scan, tmp, tz)
        except FileExistsError:  # made while the export ran
            if written:
                raise ExportError(f"table {name}: {path} appeared while the export ran and is kept; "
                                  f"written before it (whole): {', '.join(map(str, written))}") from None
            raise ExportOutExists([path], None if single else out) from None
        except (pa.ArrowInvalid, OSError) as e:
            done = f"; written before it (whole): {', '.join(map(str, written))}" if written else "; nothing written"
            raise ExportError(f"table {name}: export to {path} failed: {_why(e)}{done}") from None
        written.append(path)
        if neutralised and notes is not None:
            notes.append(neutralised_note(name, path, neutralised))
    return written


# --- a row read twice, written once -------------------------------------------------------------

@dataclass
class Copies:
    """The rows of one daemon table found more than once (by its key): what the export leaves out."""

    table: str
    key: tuple[str, ...]
    dropped: int  # rows beyond the first of their key
    places: list[tuple[str, int, list[str]]]  # (host, or dataset folder, rows dropped, folders holding the copies)
    why: str = WHY  # how a key comes to be found twice
    rows: int = 0  # rows the scan yields (filtered), copies and keyless rows included
    marks: object = None  # numpy uint8: bit i (little-endian within a byte) set = the scan's row i is a copy
    stamps: tuple = ()  # each file's (path, size, mtime ns) when the copies were found: the write's scan must see the same

    def note(self) -> str:
        def where(folders: list[str]) -> str:
            more = f" and {len(folders) - 3} more" if len(folders) > 3 else ""
            return ", ".join(folders[:3]) + more

        return (f"{self.table}: {self.dropped} rows found more than once were written once (the same "
                f"{', '.join(self.key)}: {self.why}): "
                + "; ".join(f"{p}: {n} (in {where(f)})" for p, n, f in self.places))


def row_key(src: Source) -> tuple[str, ...] | None:
    """The columns that identify a row of a daemon table, a tuner's decisions, sweep windows or levels
    (rowkeys.py); None for any other table."""
    return key_of(src.name, src.dataset.schema.names)


def unkeyed_decisions(src: Source, filt) -> int:
    """Rows of a tuner's decisions without a key (written before tuner_id and seq): each is written as it is."""
    names = src.dataset.schema.names
    if not is_tuner_decisions(names):
        return 0
    if not set(TUNER_KEY) <= set(names):
        return src.dataset.count_rows(filter=filt)
    nokey = ds.field(TUNER_KEY[0]).is_null() | ds.field(TUNER_KEY[1]).is_null()
    return src.dataset.count_rows(filter=nokey if filt is None else filt & nokey)


def _files(d: ds.Dataset) -> list[str]:
    """The files of a dataset, or of a union of datasets, as the scan's __filename names them."""
    return [f for c in d.children for f in _files(c)] if isinstance(d, ds.UnionDataset) else list(d.files)


def _stamps(d: ds.Dataset) -> tuple:
    """(path, size, mtime ns) of every file of a dataset, or of a union of datasets: a file rewritten under its
    name with as many rows in another order would move the rows find_copies marked (the row count cannot tell)."""
    if isinstance(d, ds.UnionDataset):
        return tuple(x for c in d.children for x in _stamps(c))
    return tuple((i.path, i.size, i.mtime_ns) for i in d.filesystem.get_file_info(list(d.files)))


def _reader(src: Source, columns: list[str], filt, batch_rows: int = BATCH_ROWS) -> pa.RecordBatchReader:
    return src.dataset.scanner(columns=columns, filter=filt, batch_size=batch_rows, batch_readahead=1,
                               fragment_readahead=1).to_reader()


ROW = "__row"  # the scan's row number, beside the columns read (pyarrow's own such columns are __filename, ...)


def _numbered(reader: pa.RecordBatchReader, seen: list[int]) -> pa.RecordBatchReader:
    """The reader's batches with each row's number in the scan (ROW); seen[0] ends as the number of rows.
    A scan of a dataset yields its files' batches in order, so the same filter numbers the same rows alike."""
    import numpy as np  # noqa: PLC0415

    schema = reader.schema.append(pa.field(ROW, pa.int64()))

    def batches():
        for b in reader:
            yield pa.RecordBatch.from_arrays([*b.columns, pa.array(np.arange(seen[0], seen[0] + b.num_rows))],
                                             schema=schema)
            seen[0] += b.num_rows

    return pa.RecordBatchReader.from_batches(schema, batches())


def _sorted(con, src: Source, columns: list[str], filt, sql: str, batch_rows: int = BATCH_ROWS,
            seen: list[int] | None = None):
    """Record batches of `sql` over the table's rows (as `raw`; with `seen`, numbered: see _numbered). An ORDER BY
    is DuckDB's external sort, which spills to disk within the memory limit; a DISTINCT or GROUP BY keeps a slot
    per key in memory (10 M keys failed at 256 MB)."""
    reader = _reader(src, columns, filt, batch_rows)
    con.register("raw", reader if seen is None else _numbered(reader, seen))
    rel = con.sql(sql)
    return rel.to_arrow_reader(batch_rows) if hasattr(rel, "to_arrow_reader") else rel.fetch_record_batch(batch_rows)


class _Adjacent:
    """Streams sorted batches and marks each row whose key equals the row before it (across batches too).
    Null equals null, as in DuckDB's grouping: a key may have null parts (a sample without a device). NaN equals
    NaN (and is not null), as DuckDB's sort and grouping and Arrow's group_by (analyze's count of a window) take it:
    a row with a NaN key read twice is one row written once, said in the copies note, and written as NaN."""

    def __init__(self, key: tuple[str, ...]):
        self.key, self.prev = key, None

    def same(self, b: pa.RecordBatch):
        import numpy as np  # noqa: PLC0415

        n = b.num_rows
        out = np.ones(n, bool)
        if not n:
            return out
        for c in self.key:
            a = b.column(c)
            if n > 1:
                x, y = a.slice(1), a.slice(0, n - 1)
                eq = pc.or_kleene(pc.equal(x, y), pc.and_(pc.is_null(x), pc.is_null(y)))
                if pa.types.is_floating(a.type):
                    eq = pc.or_kleene(eq, pc.and_(pc.is_nan(x), pc.is_nan(y)))
                out[1:] &= eq.fill_null(False).to_numpy(zero_copy_only=False)
        first = tuple(b.column(c)[0].as_py() for c in self.key)
        out[0] = self.prev is not None and len(first) == len(self.prev) and all(
            u == v or (u != u and v != v) for u, v in zip(first, self.prev))  # NaN != NaN in Python: u != u
        self.prev = tuple(b.column(c)[n - 1].as_py() for c in self.key)
        return out


def _copies_of(src: Source, filt) -> Copies | None:
    """find_copies, with a table that cannot be read (damaged pages behind an intact footer) an ExportError that
    names it, as the write would have (DuckDB's scan of it raised its own error, a traceback)."""
    import duckdb  # noqa: PLC0415

    try:
        return find_copies(src, filt)
    except (pa.ArrowInvalid, OSError, duckdb.Error) as e:
        raise ExportError(f"table {src.name}: cannot be read: {_why(e, writing=False)}; nothing written") from None


def find_copies(src: Source, filt) -> Copies | None:
    """How many rows of a daemon table are copies, per host and folder, and which rows of the scan they are,
    from the rows sorted by their key and their place in the scan (DuckDB, out of core): a row whose key equals
    the one before it is a copy, so the first in the scan of each key is the one kept. Copies are compared
    whole, by a hash of every column: a key whose rows differ is one event with two versions, at most one of
    them true, and the export is refused (ExportError). None for a table without a key.

    Only the sorted rows are narrow (key, hash, file, place, row number: every column is read to hash it,
    none carried through the sort); the copies' places are kept as one bit per row of the scan (18 M rows:
    2.2 MB), for _Once to leave them out of the plain scan."""
    key = row_key(src)
    if key is None:
        return None
    import numpy as np  # noqa: PLC0415

    stamps = _stamps(src.dataset)

    from .engine import connect  # noqa: PLC0415  (DuckDB: only daemon tables need it)

    names = src.dataset.schema.names  # partition fields too: one row in two date= folders is two versions
    k = ", ".join(ident(c) for c in key)
    keyed = f"WHERE NOT {keyless_sql(key)} ORDER BY {k}"
    with connect() as con:
        # First the key alone (its few columns read, the scan stopped at the first copy): most tables have
        # none, and that is all they cost.
        adj = _Adjacent(key)
        if not any(adj.same(b).any() for b in _sorted(con, src, list(key), filt, f"SELECT {k} FROM raw {keyed}")):
            return Copies(src.name, key, 0, [])
        con.register("files_in", pa.table({"name": pa.array(_files(src.dataset), pa.string())}))
        files = {h: (name, folder) for h, name, folder in con.execute(
            f"SELECT hash(name), name, {folder_sql(src.name, 'name')} FROM files_in").fetchall()}
        # Rows without a host (written before the column) are counted under their dataset folder.
        host = (f"CASE WHEN host IS NULL THEN {folder_sql(src.name, '__filename')} ELSE host END"
                if "host" in names else folder_sql(src.name, "__filename"))
        sql = (f"SELECT {k}, hash({', '.join(ident(c) for c in names)}) AS _h, hash(__filename) AS _f, "
               f"{host} AS _place, {ROW} FROM raw WHERE NOT {keyless_sql(key)} ORDER BY {k}, {ROW}")
        seen = [0]
        marks = np.zeros(1 << 16, np.uint8)  # grown as rows come: bit i of the scan's row i
        adj = _Adjacent(key)
        prev_h = prev_f = None
        group = 0
        places: dict[str, list] = {}
        conflicting: set[int] = set()
        example = None
        for b in _sorted(con, src, names + ["__filename"], filt, sql, seen=seen):
            same = adj.same(b)
            h = b.column("_h").to_numpy(zero_copy_only=False)
            f = b.column("_f").to_numpy(zero_copy_only=False)
            ph = np.concatenate([[h[0] if prev_h is None else prev_h], h[:-1]])
            pf = np.concatenate([[f[0] if prev_f is None else prev_f], f[:-1]])
            prev_h, prev_f = h[-1], f[-1]
            gid = group + np.cumsum(~same)  # one id per key, carried across batches
            group = int(gid[-1])
            differ = same & (h != ph)
            if differ.any():
                conflicting.update(gid[differ].tolist())
                if example is None:
                    i = int(np.flatnonzero(differ)[0])
                    example = ([b.column(c)[i].as_py() for c in key], int(pf[i]), int(f[i]))
            if same.any():
                idx = np.flatnonzero(same)
                row = b.column(ROW).to_numpy()[idx]
                if int(row.max()) >> 3 >= len(marks):
                    marks = np.concatenate([marks, np.zeros(max(len(marks), (int(row.max()) >> 3) + 1), np.uint8)])
                np.bitwise_or.at(marks, row >> 3, np.left_shift(1, row & 7).astype(np.uint8))
                # Counted per place and pair of files by Arrow, not row by row in Python (a synced fleet: every row).
                per = pa.table({"p": b.column("_place").take(pa.array(idx)), "a": pf[idx], "c": f[idx]}).group_by(
                    ["p", "a", "c"]).aggregate([("p", "count", pc.CountOptions(mode="all"))])
                for p_, a, c, n in zip(*(per.column(x).to_pylist() for x in ("p", "a", "c", "p_count"))):
                    e = places.setdefault(p_, [0, set()])
                    e[0] += n
                    e[1].update((a, c))
    if conflicting:
        which = ", ".join(f"{c}={v}" for c, v in zip(key, example[0]))
        raise ExportError(
            f"table {src.name}: {len(conflicting)} key(s) ({', '.join(key)}) hold rows that differ (e.g. {which}, "
            f"in {files.get(example[1], ('?',))[0]} and {files.get(example[2], ('?',))[0]}): one event recorded "
            "twice with different values, of which at most one is true and nothing says which; nothing written. "
            "Remove the file that is wrong, or export the folders separately")
    return Copies(src.name, key, sum(n for n, _ in places.values()),
                  [(p_, n, sorted({files[x][1] for x in fs if x in files})) for p_, (n, fs) in sorted(places.items())],
                  why_of(key), seen[0], marks, stamps)


class _Once:
    """The plain scan of a table (the same columns, filter and order as a table without copies), less the rows
    find_copies marked as copies: each row once, the first of its key in the scan kept, every keyless row kept
    (each its own). find_copies has made sure that the rows of one key are equal in every column, so which one
    is kept changes nothing written. It numbered the rows of the same scan; a scan that yields another number
    of rows (a file replaced between the two reads) is refused rather than have the wrong rows left out."""

    def __init__(self, src: Source, columns: list[str], filt, copies: Copies, batch_rows: int):
        self.copies, self.dataset = copies, src.dataset
        self.scan = src.dataset.scanner(columns=columns, filter=filt, batch_size=batch_rows, batch_readahead=1,
                                        fragment_readahead=1)
        self.projected_schema = self.scan.projected_schema

    def to_batches(self):
        import numpy as np  # noqa: PLC0415

        marks, rows, at = self.copies.marks, self.copies.rows, 0
        for b in self.scan.to_batches():
            n = b.num_rows
            if at + n > rows:
                break
            lo = at >> 3
            bits = np.unpackbits(marks[lo:(at + n + 7) >> 3], bitorder="little")
            copy = np.zeros(n, bool)
            got = bits[at - 8 * lo:at - 8 * lo + n].astype(bool)
            copy[:len(got)] = got  # marks end at the last copy's byte: rows past it are no copies
            at += n
            yield b.filter(pa.array(~copy)) if copy.any() else b
        else:
            if at == rows and _stamps(self.dataset) == self.copies.stamps:
                return
        raise ExportError(f"table {self.copies.table}: its files changed while the export read them (a compaction "
                          "or a sync running?); nothing of it written. Export again once they are still")


def _parquet_out_taken(folder: Path) -> str | None:
    """Why a Parquet export may not write into `folder`: a sweep's run (its tables are the *.parquet at its top, so
    `export NODE --format parquet --out RUN --force` replaced the run's samples.parquet with the daemon's rows and
    added requests.parquet as a table of the run), or a daemon's dataset folder (a .parquet at its top made `export`
    of it read that file in the datasets' stead). CSV and xlsx are read by neither. None: the folder may take them."""
    from powerprof.paths import holds_dataset_tables, holds_sweep_run  # noqa: PLC0415

    from .fleet import dataset_above  # noqa: PLC0415

    if holds_sweep_run(folder) and not _an_export(folder):
        return (f"--out {folder} is a sweep's run folder: the .parquet files written there would be read as the run's "
                "own tables by `analyze` and `export` (and replace its own of those names); nothing written: give "
                "another folder with --out")
    if holds_dataset_tables(folder):
        return (f"--out {folder} holds a daemon's datasets: .parquet files at its top would make `export` of it read "
                "them in the datasets' stead; nothing written: give another folder with --out")
    if (above := dataset_above(folder)) is not None:
        return (f"--out {folder} is inside the daemon dataset {above}: the .parquet files written there would be "
                "read as its rows, or as one more table of it; nothing written: give another folder with --out")
    return None


def _an_export(folder: Path) -> bool:
    """`folder` is an earlier Parquet export of a run (no run.json; its windows.parquet carries the footer key
    `powerprof_export` every exported file has), which an export may write to again (--force), not a sweep's run."""
    if (folder / "run.json").exists():
        return False
    try:
        return b"powerprof_export" in (pq.read_schema(folder / "windows.parquet").metadata or {})
    except (OSError, pa.ArrowException):  # unreadable: taken for the run's own, refused rather than replaced
        return False


def _dataset_beside_run(srcs: list[str], groups: list[list[Source]]) -> str | None:
    """The refusal of daemon datasets given with sweep runs, as `analyze` refuses them (fleet.dataset_beside_run):
    their tables of one name (samples) were one file, the daemon's rows and the run's mixed, the run's said to lack
    `host` as "written before the column existed", exit 0. A local folder is a dataset, a dataset's table (its
    samples/ given alone) or a run by what it holds; a .parquet file is a run's table by the run.json a sweep writes
    into every file's footer, or by the run folder it lies in (`export NODE runs/r2/samples.parquet` mixed them as
    the folder did); a URI is a dataset where its tables are a daemon's (requests/, intervals/). None: no such mix."""
    from powerprof.paths import holds_sweep_run  # noqa: PLC0415
    from powerprof.storage.schema import DAEMON_DATASETS  # noqa: PLC0415

    from .fleet import dataset_beside_run, is_daemon_dataset  # noqa: PLC0415

    datasets, runs = [], []
    for s, group in zip(srcs, groups):
        p = Path(s)
        if is_uri(s):
            if {"requests", "intervals"} & {g.name for g in group}:
                datasets.append((s, None))
        elif p.is_dir() and is_daemon_dataset(s):
            datasets.append((s, None))
        elif p.is_dir() and p.name in DAEMON_DATASETS and is_daemon_dataset(str(p.resolve().parent)):
            datasets.append((s, p.name))
        elif p.is_dir() and holds_sweep_run(s):
            runs.append(s)
        elif p.is_file() and (_sweep_footer(group) or any(holds_sweep_run(d) for d in list(p.resolve().parents)[:2])):
            runs.append(s)
    if not (datasets and runs):
        return None
    return dataset_beside_run(datasets[0][0], runs, "export", table=datasets[0][1])


def _sweep_footer(group: list[Source]) -> bool:
    """A single file's table carries the run.json a sweep writes into every Parquet footer (storage.runs)."""
    return any(b"powerprof" in (g.dataset.schema.metadata or {}) for g in group)


def _without_copied_runs(srcs: list[str], groups: list[list[Source]], notes: list[str] | None) -> list[list[Source]]:
    """Each sweep run once: a run directory that holds the same run as one before it (loading.same_run: its run_id,
    whatever its files' bytes) adds none of its tables that are the same files (said in a note); a table that differs
    from the first's (a windows.parquet joined to itself) stays, when it has a key (rowkeys.py), for find_copies to
    write each row once or refuse a key whose rows differ; a keyless table that differs (a re-analysis) is refused,
    as two versions of the same rows."""
    from .loading import AnalysisError, file_digest, read_run_info, same_run  # noqa: PLC0415

    runs = [i for i, s in enumerate(srcs) if not is_uri(s) and (Path(s) / "windows.parquet").is_file()]
    if len(runs) < 2:
        return groups
    seen: dict[tuple, tuple[str, dict[str, str | None]]] = {}
    out = list(groups)
    for i in runs:
        try:
            key = same_run(read_run_info(srcs[i]))
        except AnalysisError:
            continue
        digests = {s.name: file_digest(Path(s.dataset.files[0])) for s in groups[i]}
        if key not in seen:
            seen[key] = (srcs[i], digests)
            continue
        first, first_digests = seen[key]
        rid = key[1] if key[0] == "run_id" else key[0]
        same = sorted(n for n, d in digests.items() if n in first_digests and d == first_digests[n])
        kept = {s.name: s for s in groups[i] if s.name not in same}
        differ = sorted(n for n in kept if n in first_digests)
        keyless = [n for n in differ if row_key(kept[n]) is None]
        if keyless:
            raise ExportError(f"{first} and {srcs[i]} hold the same run (run_id {rid}) but their "
                              f"{_tables(keyless)} differ: two versions of the same rows; nothing written. Export "
                              "them separately, or give the one you trust")
        out[i] = list(kept.values())
        if notes is not None:
            files = ", ".join(f"{n}.parquet" if n != "analysis" else "analysis/analysis.parquet" for n in same)
            notes.append(f"{srcs[i]} holds the same run as {first} (run_id {rid}): "
                         + (f"its {files}, the same files, were written once" if same else "none of its files is the same")
                         + (f"; its {_tables(differ)} differ and are written row by row, each row once" if differ
                            else ""))
    return out


def _tables(names: list[str]) -> str:
    """Tables named as the plural the sentence's verb takes: "their analysis differ" read as a slip."""
    return ", ".join("analyses" if n == "analysis" else n for n in names)


def _why(e: Exception, writing: bool = True) -> str:
    """The reason of an error; writing: it came of writing --out (a refusal for permission then says the fix; a read
    of the sources refused is no matter of --out)."""
    why = (e.strerror if isinstance(e, OSError) and e.strerror else str(e)).strip()
    if writing and isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        why += " (fix: give --out in a folder you can write)"  # a read-only folder or file system said no more
    return why


# A spreadsheet evaluates a CSV cell that starts with one of these as a formula (`=cmd|' /C calc'!A0`, `@SUM(...)`,
# `=HYPERLINK(...)`): text from the traffic (a tag, a model name, a server's error) must not become one.
FORMULA_START = r"^[=+\-@\t\r]"
# A plain number ("-5", "+1.5e3") stored as text: a spreadsheet reads it as that number, never as a formula, and a
# leading ' would show it as the text '-5 (a CSV's ' is imported as it is).
PLAIN_NUMBER = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"


def _undictionary(arr):
    """A categorical (dictionary) column as its values (pandas' category dtype; storage/datafiles takes it): the text
    rules below test the value type, and a categorical text column passed them by: a formula reached the CSV live, a
    control character failed the xlsx export, a long text was not cut."""
    return arr.cast(arr.type.value_type) if pa.types.is_dictionary(arr.type) else arr


def _csv_ready(t: pa.Table, neutralised: dict[str, int] | None = None) -> pa.Table:
    """Timestamps as `YYYY-MM-DD HH:MM:SS.mmm`: ISO 8601 with a space, which spreadsheets parse as dates. Text that a
    spreadsheet would read as a formula gets a leading `'` (OWASP's CSV-injection rule); `neutralised` counts them
    per column."""
    cols = []
    for name, arr in zip(t.column_names, t.columns):
        arr = _undictionary(arr)
        if pa.types.is_timestamp(arr.type):
            # A cast of naive milliseconds to string is that exact format, and far faster than strftime.
            ms = pc.floor_temporal(arr, unit="millisecond").cast(pa.timestamp("ms", tz=arr.type.tz))
            arr = ms.cast(pa.timestamp("ms")).cast(pa.string())
        elif pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            hit = pc.fill_null(pc.and_(pc.match_substring_regex(arr, FORMULA_START),
                                       pc.invert(pc.match_substring_regex(arr, PLAIN_NUMBER))), False)
            n = pc.sum(hit).as_py() or 0
            if n:
                arr = pc.if_else(hit, pc.binary_join_element_wise(pa.scalar("'", arr.type), arr, pa.scalar("", arr.type)), arr)
                if neutralised is not None:
                    neutralised[name] = neutralised.get(name, 0) + n
        cols.append(arr)
    return pa.Table.from_arrays(cols, names=t.column_names)


def neutralised_note(table: str, path: Path, neutralised: dict[str, int]) -> str:
    n = sum(neutralised.values())
    return (f"{path}: {n} text cells of {table} ({', '.join(f'{c}: {k}' for c, k in sorted(neutralised.items()))}) "
            "began with =, +, -, @, a tab or a carriage return (and were no plain number) and are written with a "
            "leading ' so that a spreadsheet shows them as text, not as a formula it would run; strip that ' when "
            "reading the CSV as data (xlsx and parquet exports keep the text as it is)")


def _write_csv(scan: ds.Scanner, path: Path, tz: str, neutralised: dict[str, int] | None = None) -> None:
    opts = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    with open(path, "wb") as f:
        writer = None
        for batch in scan.to_batches():
            t = _csv_ready(_with_local_times(batch, tz), neutralised)
            if writer is None:
                f.write((",".join(_csv_quote(_csv_header(c, tz)) for c in t.column_names) + "\n").encode())
                writer = pacsv.CSVWriter(f, t.schema, write_options=opts)
            writer.write_table(t)
        if writer is None:  # nothing selected: still a header, so the file opens and says what it holds
            t = _csv_ready(_with_local_times(_empty_batch(scan), tz))
            f.write((",".join(_csv_quote(_csv_header(c, tz)) for c in t.column_names) + "\n").encode())
        else:
            writer.close()


def _csv_header(col: str, tz: str) -> str:
    """A column's header as a CSV cell: a foreign Parquet file's column named `=cmd|...` is a formula like any text."""
    h = header(col, tz)
    return "'" + h if re.match(FORMULA_START, h) and not re.match(PLAIN_NUMBER, h) else h


def _csv_quote(s: str) -> str:
    return '"' + s.replace('"', '""') + '"' if any(ch in s for ch in ',"\n') else s


def _empty_batch(scan: ds.Scanner) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=scan.projected_schema)


def _parquet_ready(t: pa.Table, scan: ds.Scanner, tz: str) -> pa.Table:
    """The source's key-value metadata kept (a run's `powerprof`: its run.json, `simulated` among it), and the zone
    of the naive `*_local` columns said, in the file and on each such column: a reader cannot guess it."""
    meta = dict(scan.projected_schema.metadata or {})
    local = [n for n in t.column_names if n.endswith("_local")]
    meta[b"powerprof_export"] = json.dumps({"local_time_zone": tz, "local_columns": local}).encode()
    fields = [f.with_metadata({b"time_zone": tz.encode()}) if f.name in local else f for f in t.schema]
    return t.cast(pa.schema(fields, metadata=meta))


def _write_parquet(scan: ds.Scanner, path: Path, tz: str) -> None:
    writer = None
    try:
        for batch in scan.to_batches():
            t = _parquet_ready(_with_local_times(batch, tz), scan, tz)
            if writer is None:
                writer = pq.ParquetWriter(path, t.schema, compression="zstd")
            writer.write_table(t)
        if writer is None:
            pq.write_table(_parquet_ready(_with_local_times(_empty_batch(scan), tz), scan, tz), path)
    finally:
        if writer is not None:
            writer.close()


def summary_rows(src: Path | str, tz: str, time_from: str | None, time_to: str | None,
                 opened=None) -> list[tuple[str, object]]:
    """(item, value) rows for the xlsx summary sheet: the recommendation (from analysis/analysis.json)
    and the run's details (run.json), when the source is a run directory (a file:// URI's too); always what was
    exported. A remote URI's (s3://, gs://) are read through its filesystem, as its tables are (they were not read: the
    sheet said "exported from" a local path made of the URI, `<cwd>/s3:/run`, and no recommendation); `opened`: the
    (filesystem, path) `find_sources` opened it to (each open of S3 asks for the bucket's region: a dead store's wait
    came twice). One that is there but cannot be read, or is not of the form analyze and sweep write, is said in a row
    ("not read: …"), its figures left out: a string where a dict was ended the export in a traceback, exit 1."""
    from powerprof import __version__  # noqa: PLC0415

    local = local_path(str(src))
    rows: list[tuple[str, object]] = [
        ("exported from", str(src) if local is None else str(local.resolve())),
        ("exported at (UTC)", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")),
        ("local time zone", tz),
        ("rows from", time_from or "(all)"),
        ("rows to", time_to or "(all)"),
        ("powerprof", __version__),
    ]
    unread: list[tuple[str, object]] = []
    if local is None:
        read = _remote_json_reader(str(src), unread, opened)
    else:
        def read(*names: str) -> dict | None:
            f = local.joinpath(*names)
            if not (local.is_dir() and f.is_file()):
                return None
            return _json_object(lambda n: _read_head(f, n), str(f), names[-1], unread)
    analysis = read("analysis", "analysis.json")
    try:
        head = _analysis_rows(analysis) if analysis else []
    except (AttributeError, TypeError, ValueError, KeyError, RecursionError, OverflowError) as e:
        head = []
        unread.append(("analysis.json", f"not read: its recommendation is not of the form analyze writes ({e!r}); "
                                        "run `powerprof analyze` again to write it anew"))
    run = read("run.json")
    flat: list[tuple[str, object]] = []
    if run:
        try:
            flat = [(k, v) for k, v in _flatten(run) if k not in ("levels_done",)]
        except RecursionError:
            unread.append(("run.json", "not read: nested deeper than Python's stack goes"))
    return unread + head + rows + flat


def _analysis_rows(analysis: dict) -> list[tuple[str, object]]:
    """The summary sheet's rows of an analysis.json: its recommendation, configurations and warnings. A field not of
    the form analyze writes raises (AttributeError, TypeError, ValueError; OverflowError: an integer too
    large for a float, formatted), said by `summary_rows` in a row."""
    rec = analysis.get("recommendation")
    head: list[tuple[str, object]] = []
    pooled = [str(r.get("run_id")) for r in analysis.get("runs") or [] if isinstance(r, dict)]
    if len(pooled) > 1:
        # `analyze a b` writes to a/analysis by default: its recommendation is the pool's, not this run's alone.
        head.append(("recommendation of the pooled runs", ", ".join(pooled)))
    if rec:
        kind = next((x.get("level_kind") for x in analysis.get("series", [])), None)
        unit = {"power_limit": "power limit (W)", "sm_clock": "SM clock lock (MHz)"}.get(kind, "level")
        head += [
            (f"recommended {unit}", rec.get("recommended_value")),
            ("policy", f"{rec.get('policy')}: {rec.get('description')}"),
            ("speed loss (%)", rec.get("speed_loss_pct")),
            ("energy saving per token (%)", rec.get("energy_saving_pct")),
            ("95% of resamples choose", f"{rec.get('ci_low'):g} to {rec.get('ci_high'):g}"
             if rec.get("ci_low") is not None and rec.get("ci_high") is not None else None),
        ]
        left = [x for x in rec.get("left_out") or [] if isinstance(x, dict)]
        if left:
            head.append(("never chosen", ", ".join(f"{x.get('level_value'):g} ({x.get('why')})" for x in left)))
    elif analysis.get("recommendation_note"):
        head += [("recommended", f"none: {analysis['recommendation_note']}")]
    conf = analysis.get("configurations")
    if isinstance(conf, dict):
        why = "; ".join(f"{x.get('why')}" for x in conf.get("not_chosen") or [] if isinstance(x, dict))
        head.append(("chosen configuration", conf.get("chosen") or f"none: {why}"))
        left = [x for x in conf.get("left_out") or [] if isinstance(x, dict)]
        if left:
            head.append(("configurations never chosen", ", ".join(
                f"{x.get('config_id')}" + (f" @ {x['context_tokens']} tokens" if x.get("context_tokens") is not None else "")
                + (f" at {x['level_value']:g} {'MHz' if x.get('level_kind') == 'sm_clock' else 'W'}"
                   if isinstance(x.get("level_value"), (int, float)) else "")
                + f" ({x.get('why')})" for x in left)))
    head += [("warning", f"{w.get('kind')}: {w.get('message')}") for w in analysis.get("warnings", [])]
    return head


# The most of an analysis.json or run.json the summary sheet reads (analyze's and sweep's are kilobytes): a larger one
# is said "not read", never loaded whole into memory.
SUMMARY_JSON_MAX_BYTES = 8 << 20


def _read_head(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _json_object(read_head, where: str, name: str, unread: list[tuple[str, object]]) -> dict | None:
    """The JSON object `read_head(n)` (the file's first n bytes) holds, or None with a "not read: …" row for `unread`
    naming `where` and why: it cannot be read, is larger than SUMMARY_JSON_MAX_BYTES, is no JSON, or no JSON object
    (`[1]` reached summary_rows as if a dict: a traceback)."""
    try:
        data = read_head(SUMMARY_JSON_MAX_BYTES + 1)
        if len(data) > SUMMARY_JSON_MAX_BYTES:
            unread.append((name, f"not read: {where} is too large (over {SUMMARY_JSON_MAX_BYTES >> 20} MiB; analyze "
                                 "and sweep write a few kilobytes)"))
            return None
        doc = json.loads(data)
    except RecursionError:
        unread.append((name, f"not read: {where} is not valid JSON (nested deeper than Python's parser goes)"))
        return None
    except (pa.ArrowException, OSError, ValueError) as e:
        unread.append((name, f"not read: {where} could not be read ({e})"))
        return None
    if not isinstance(doc, dict):
        unread.append((name, f"not read: {where} is not a JSON object (a {type(doc).__name__})"))
        return None
    return doc


def _remote_json_reader(uri: str, unread: list[tuple[str, object]], opened=None):
    """A reader of a run's JSON files behind a remote URI (`read("run.json")`), through the filesystem its tables are
    read with (`opened`, else opened here): None where the URI names no folder or the file is not there (no run, as
    for a local folder); one there that cannot be read (access denied, the store gone) or is no JSON object is None
    too, and a row for `unread` says so (`_json_object`)."""
    import pyarrow.fs as pafs  # noqa: PLC0415

    try:
        fs, path = opened or _open_uri(uri)
        folder = fs.get_file_info(path).type == pafs.FileType.Directory
    except (pa.ArrowException, OSError) as e:
        unread.append(("recommendation and run details", f"not read: {uri} could not be opened ({e})"))
        folder = False

    def read(*names: str) -> dict | None:
        if not folder:
            return None
        where = "/".join([path.rstrip("/"), *names])
        try:
            if fs.get_file_info(where).type != pafs.FileType.File:
                return None
        except (pa.ArrowException, OSError) as e:
            unread.append((names[-1], f"not read: {_uri_join(uri, '/'.join(names))} could not be read ({e})"))
            return None

        def head(n: int) -> bytes:
            with fs.open_input_stream(where) as f:
                return f.read(n)
        return _json_object(head, _uri_join(uri, "/".join(names)), names[-1], unread)
    return read


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """run.json as dotted keys with scalar values (lists of scalars joined), for one sheet column."""
    out: list[tuple[str, object]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out += _flatten(x, f"{key}.{i}.")
        elif isinstance(v, list):
            out.append((key, ", ".join(str(x) for x in v)))
        else:
            out.append((key, v))
    return out


def _col_letter(i: int) -> str:
    from openpyxl.utils import get_column_letter  # noqa: PLC0415

    return get_column_letter(i + 1)


def _write_xlsx(scans: dict[str, ds.Scanner], path: Path, tz: str,
                summary: list[tuple[str, object]] | None = None, replace: bool = True,
                cut: dict[str, dict[str, int]] | None = None) -> Path:
    """`cut` (when given) receives, per sheet, per column, how many text cells were cut to XLSX_MAX_CELL_CHARS."""
    from openpyxl import Workbook  # noqa: PLC0415  (only this format needs it)
    from openpyxl.cell import WriteOnlyCell  # noqa: PLC0415

    wb = Workbook(write_only=True)
    wb.security = None  # else an empty <workbookProtection/>, which gnumeric warns about
    if summary:
        ws = wb.create_sheet(title="summary")
        ws.column_dimensions["A"].width = 30
        ws.column_dimensions["B"].width = 80
        ws.freeze_panes = "A2"
        ws.append(["item", "value"])
        for k, v in summary:
            ws.append([_text_cell(ws, x, WriteOnlyCell) if isinstance(x, str) else _summary_number(ws, k, x, WriteOnlyCell)
                       for x in (k, v if v is None or isinstance(v, (int, float, str)) else str(v))])
    try:
        for name, scan in scans.items():
            ws = wb.create_sheet(title=name[:31])
            head = None
            n_rows = 0
            for batch in scan.to_batches():
                t = _with_local_times(batch, tz)
                if head is None:
                    head = _xlsx_header(ws, t, tz)
                times = [pa.types.is_timestamp(c.type) for c in t.columns]
                sheet_cut = cut.setdefault(name[:31], {}) if cut is not None else None
                for row in zip(*(_xlsx_values(c, sheet_cut, col) for c, col in zip(t.columns, t.column_names))):
                    ws.append([_time_cell(ws, v, WriteOnlyCell) if is_t and v is not None else
                               _text_cell(ws, v, WriteOnlyCell) if isinstance(v, str) and v[:1] in "=#" else v
                               for v, is_t in zip(row, times)])
                n_rows += t.num_rows
            if head is None:
                head = _xlsx_header(ws, _with_local_times(_empty_batch(scan), tz), tz)
            ws.auto_filter.ref = f"A1:{_col_letter(len(head) - 1)}{n_rows + 1}"
        with atomic_path(path, replace=replace) as tmp:
            wb.save(tmp)
    except BaseException:
        for ws in wb.worksheets:  # else each sheet's row writer dies noisily when it is collected
            try:
                ws.close()
            except Exception:  # noqa: BLE001  (already failing: the first error is the one to report)
                pass
        raise
    return path


def _summary_number(ws, item: str, v, cell_type):
    """A summary figure as a cell: a percentage shown to a tenth (its whole value kept beneath, for formulas)."""
    if not isinstance(v, float) or "(%)" not in item:
        return v
    cell = cell_type(ws, value=v)
    cell.number_format = "0.0"
    return cell


def _xlsx_header(ws, t: pa.Table, tz: str) -> list[str]:
    """Write the header row, frozen, with each column as wide as its header (times: their format).

    A write-only sheet writes its views and column widths with the first row, so they go first. A column's name is
    text from outside (a foreign Parquet file's) like any cell's: cleaned and cut as a text cell is (`_xlsx_values`),
    else a control character in it failed the whole export and a name past a cell's limit damaged the workbook."""
    head = _xlsx_values(pa.chunked_array([[header(c, tz) for c in t.column_names]], pa.string()))
    for i, (h, typ) in enumerate(zip(head, t.schema.types)):
        w = len(XLSX_TIME_FORMAT) + 2 if pa.types.is_timestamp(typ) else len(h) + 2
        ws.column_dimensions[_col_letter(i)].width = max(10, min(XLSX_MAX_COL_W, max(w, len(h) + 2)))
    ws.freeze_panes = "A2"
    from openpyxl.cell import WriteOnlyCell  # noqa: PLC0415  (only this format needs it)

    ws.append([_text_cell(ws, h, WriteOnlyCell) for h in head])  # a foreign file's column named `=cmd|...`: text
    return head


def _text_cell(ws, value: str, cell_cls):
    """A text cell whatever its text: openpyxl makes a cell whose text starts with "=" a formula, so a tag or an error
    text from the traffic (`=cmd|' /C calc'!A0`) would run when the workbook is opened, and one whose text is an error
    code (#N/A, #DIV/0!) that error, not text. Typed as text it is shown as it is (no leading ' added: the cell holds
    the exact text)."""
    c = cell_cls(ws, value=value)
    if c.data_type in ("f", "e"):
        c.data_type = "s"
    return c


def _time_cell(ws, value, cell_cls):
    c = cell_cls(ws, value=value)
    c.number_format = XLSX_TIME_FORMAT
    return c


def _excel_len(v: str) -> int:
    """A text's length as Excel counts it: UTF-16 code units, so a character beyond the BMP (an emoji) counts 2."""
    return len(v) + sum(1 for c in v if ord(c) > 0xFFFF) if not v.isascii() else len(v)


def _cut_cell(v: str) -> str:
    tail = f" [cut: {len(v)} characters, a cell holds {XLSX_MAX_CELL_CHARS}; the whole text is in a csv or parquet export]"
    room, k = XLSX_MAX_CELL_CHARS - len(tail), 0
    for k, c in enumerate(v):  # whole characters only: an emoji is never split into half a surrogate pair
        room -= 2 if ord(c) > 0xFFFF else 1
        if room < 0:
            break
    return v[:k] + tail


def _xlsx_values(arr: pa.ChunkedArray, cut: dict[str, int] | None = None, name: str = "") -> list:
    """Cell values: Excel has no time zones, so timestamps become naive (UTC or local, per the header).

    NaN and ±inf become the text NaN, inf, -inf (a sheet has no such numbers; openpyxl left the cell empty).
    A sheet cannot hold control characters (a server's error text may carry an ANSI colour or a NUL):
    each becomes U+FFFD, rather than the whole export failing on one cell."""
    arr = _undictionary(arr)
    if pa.types.is_timestamp(arr.type) and arr.type.tz:
        arr = pc.local_timestamp(arr.cast(pa.timestamp(arr.type.unit, tz="UTC")))
    if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE  # noqa: PLC0415

        out = [v if v is None else ILLEGAL_CHARACTERS_RE.sub("\ufffd", v) for v in arr.to_pylist()]
        over = [v is not None and len(v) > XLSX_MAX_CELL_CHARS // 2 and _excel_len(v) > XLSX_MAX_CELL_CHARS for v in out]
        if any(over):
            # Past a cell's limit Excel calls the workbook damaged and drops the sheet's content: cut, marked, said.
            n = sum(over)
            out = [_cut_cell(v) if o else v for v, o in zip(out, over)]
            if cut is not None:
                cut[name] = cut.get(name, 0) + n
        return out
    if pa.types.is_floating(arr.type):
        # openpyxl writes NaN and ±inf as empty cells, which read as a missing reading: as text they stay
        # visible, as CSV's nan/inf do.
        return [v if v is None or math.isfinite(v) else _NONFINITE[str(v)] for v in arr.to_pylist()]
    return arr.to_pylist()


_NONFINITE = {"nan": "NaN", "inf": "inf", "-inf": "-inf"}
