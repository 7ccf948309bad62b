"""Many nodes' daemon datasets as one: per-host energy, tokens and J/token, as DuckDB queries.

Sources are daemon data folders (each with `requests/`, `intervals/`, ... hive-partitioned by
date), globs of them, or object-store URIs (s3://, gs://, az://, https:// through DuckDB's httpfs
extension). Every daemon row carries its `host`, so the folders need no particular layout. The
SQL here is the one docs/fleet.md shows; the same query runs on Spark or Trino over the same files.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import pyarrow as pa

from powerprof.paths import holds_sweep_run, resolve_problem
from powerprof.profiler import BEFORE_FIRST_READ_FLAG, NO_COUNTER_SHORT_FIX, NO_COUNTER_SHORT_FLAG
from powerprof.storage import datafiles
from powerprof.storage.schema import (BYPASS_LOW_FLAG, SERVER_COUNT_COMPLETE, SERVER_COUNT_TRUSTED, SERVER_COUNT_UNREAD,
                                      NOT_FORWARDED_NOTE, SERVER_GPU_UNSAMPLED_FLAG, TAG_LATE_FLAG, TAG_UNHELD_FLAG,
                                      UNSURE_FLAG, bypass_count_fix)

from .engine import connect, to_arrow
from .rowkeys import KEYS, WHY, folder_sql, keyless_sql

URI_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfss://", "http://", "https://", "hf://")


class FleetError(ValueError):
    """Bad fleet input: the message says what and how to fix it."""


def is_uri(s: str) -> bool:
    return str(s).startswith(URI_SCHEMES)


def _local_of(s: str) -> str:
    """A source as analyze reads it: a file:// URI as its local path (export reads file:// too); any other URI as
    given, refused where DuckDB cannot read it (hdfs://, abfs://) or it names no bucket (a bare s3://). Path() made
    `file:///x` "file:/x", then "no such run directory", the URI mangled."""
    from urllib.parse import unquote, urlsplit  # noqa: PLC0415

    if "://" not in s:
        return s
    parts = urlsplit(s)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise FleetError(f"{s}: a file:// URI of another host ({parts.netloc}); give the folder as this machine "
                             "sees it (file:///path or /path)")
        return unquote(parts.path)
    if not is_uri(s):
        raise FleetError(f"{s}: analyze reads local folders and {', '.join(URI_SCHEMES)} URIs (DuckDB), not "
                         f"{parts.scheme}://; copy the dataset to a local folder, or read its rows with `powerprof "
                         "export`, which reads hdfs://, abfs:// and file:// through pyarrow")
    if not parts.netloc:
        raise FleetError(f"{s}: names no bucket or host; give the daemon dataset's folder, e.g. "
                         f"{parts.scheme}://BUCKET/powerprof/gpu-node-01")
    return s


def expand_sources(sources) -> list[str]:
    """Local globs expanded (sorted), URIs kept as given (DuckDB globs them remotely), file:// read as local."""
    out: list[str] = []
    for s in sources:
        s = _local_of(str(s))
        if is_uri(s):
            out.append(s.rstrip("/"))
        elif glob.has_magic(s):
            hits = sorted(glob.glob(s))
            if not hits:
                raise FleetError(f"{s}: the pattern matches nothing")
            out.extend(hits)
        else:
            from powerprof.paths import path_problem  # noqa: PLC0415

            if (why := path_problem(s)) is not None:  # an OSError traceback from is_dir() ("File name too long")
                raise FleetError(f"{s}: {why}")
            if not os.path.lexists(s):  # beside a dataset, the dataset's refusal was said and this path never named
                raise FleetError(f"{s}: no such run directory or daemon data folder")
            out.append(s)
    for s in out:
        if not is_uri(s) and (why := resolve_problem(s)) is not None:
            raise FleetError(f"{s}: {why}")
        if (why := run_and_dataset(s)) is not None:
            raise FleetError(why)
    # A source named twice (a glob and a path, a trailing slash) would count its rows twice.
    unique: dict[str, str] = {}
    for s in out:
        unique.setdefault(s if is_uri(s) else str(Path(s).resolve()), s)
    return list(unique.values())


def is_daemon_dataset(path: str) -> bool:
    """A daemon data folder: it has a requests/ or intervals/ dataset (URIs are taken as such)."""
    if is_uri(path):
        return True
    p = Path(path)
    return p.is_dir() and any((p / d).is_dir() for d in ("requests", "intervals"))


def dataset_above(path) -> Path | None:
    """The daemon dataset `path` lies inside (paths.daemon_dataset_above, the rule the sweep's --out is held to)."""
    from powerprof.paths import daemon_dataset_above  # noqa: PLC0415

    return daemon_dataset_above(path)


def fleet_folder_refusal(path, command: str) -> str | None:
    """The refusal of a local folder that is no daemon dataset but holds some (a fleet's folder, one dataset per node,
    as docs/fleet.md lays them out), naming them and the glob to give `command` (analyze, or export with its options).
    `export` of it read each node as one table, every table's columns mixed, exit 0. None for any other folder."""
    p = Path(path)
    try:
        nodes = sorted(d.name for d in p.iterdir() if d.is_dir() and is_daemon_dataset(str(d))) \
            if p.is_dir() and not is_daemon_dataset(str(p)) else []
    except OSError:  # a folder it may not read: the message it would have given stands
        nodes = []
    if not nodes:
        return None
    return (f"{path} holds daemon datasets ({', '.join(nodes[:3])}{', ...' if len(nodes) > 3 else ''}), not a "
            f"sweep's run: give them, or all as a glob: powerprof {command} '{path}/*' (docs/fleet.md)")


def dataset_beside_run(dataset: str, others: list[str], command: str, table: str | None = None) -> str:
    """The one refusal of a daemon dataset (or `table`, one of its tables' folders) given with sweep runs or a run's
    tables (`others`), for `analyze` and `export` alike (`command`): each reads them apart. `export` wrote their
    tables of one name (samples) as one, the daemon's rows and the run's mixed, exit 0."""
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    what = f"a daemon dataset's {table}/ table" if table else "a daemon dataset"
    whole = str(Path(dataset).parent) if table and not is_uri(dataset) else dataset
    how = ": the per-host summary" if command == "analyze" else " ..."
    return (f"{dataset} is {what}, not a sweep's run, given with the sweep run{'s' if len(others) > 1 else ''} "
            f"{shown}: {command} it on its own (powerprof {command} {whole}{how}), and the sweep runs apart; "
            "together, their tables of one name (samples) would be read as one, the daemon's rows and the runs' mixed")


def run_and_dataset(path: str) -> str | None:
    """The refusal of a local folder that holds both a sweep's run and a daemon's datasets (a daemon once given a run
    directory as its data dir): `analyze` read it as the daemon's and `export` as the run's, each leaving the other
    out unsaid. None for any other source."""
    if is_uri(path) or not is_daemon_dataset(path) or not holds_sweep_run(path):
        return None
    return (f"{path} holds both a sweep's run (run.json or windows.parquet) and a daemon's datasets (requests/, "
            "intervals/): read as either, the other's rows would be left out; move one of them to a folder of its own "
            "and give each apart")


# Columns that make a file of these names one of `analyze`'s own fleet summaries (any version's): replaced by the next.
OUT_FILES = {"fleet.parquet": {"host", "requests", "gpu_energy_j", "gpu_j_per_token"},
             "fleet_tags.parquet": {"host", "name", "windows", "counted_windows"}}


def out_taken(out: Path) -> str | None:
    """Why `--out` cannot take this summary: it holds a file of OUT_FILES' names that no fleet analysis wrote (a
    person's notes, which was replaced unsaid). An earlier summary is no reason: replaced whole, as a sweep's
    re-analysis replaces its own files (docs/fleet.md). None: the folder may take it."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    foreign = []
    for name, cols in OUT_FILES.items():
        f = out / name
        if not (f.exists() or f.is_symlink()):
            continue
        try:
            ours = f.is_file() and not f.is_symlink() and cols <= set(pq.read_schema(f).names)
        except (OSError, pa.ArrowException):  # not Parquet at all
            ours = False
        if not ours:
            foreign.append(name)
    if not foreign:
        return None
    return (f"{out} holds {' and '.join(foreign)}, which {'is' if len(foreign) == 1 else 'are'} no powerprof fleet "
            "summary and this analysis would replace; give another folder with --out, or remove it first")


def write_out(out: Path, table: pa.Table, tags: pa.Table) -> None:
    """fleet.parquet and, where a tag window was recorded, fleet_tags.parquet in `out`: an earlier call's
    fleet_tags.parquet goes first, so the two in the folder are never from two calls (a node without tags analysed
    over one with them left the other's tags beside the new summary)."""
    from powerprof.storage.runs import atomic_write_table  # noqa: PLC0415

    out.mkdir(exist_ok=True)  # its parent checked by the caller (storage.runs.missing_parent): never made here
    (out / "fleet_tags.parquet").unlink(missing_ok=True)
    atomic_write_table(out / "fleet.parquet", table)
    if tags.num_rows:
        atomic_write_table(out / "fleet_tags.parquet", tags)


def table_files(sources: list[str], table: str) -> list[str]:
    """One daemon table's files under each source: a local folder's by the rule export reads too
    (storage/datafiles.py), a URI's as a glob (DuckDB lists it remotely)."""
    out = []
    for s in sources:
        if is_uri(s):
            out.append(f"{s}/{table}/**/*.parquet")
        else:
            out.extend(str(f) for f in datafiles.table_files(Path(s) / table)[0])
    return out


def stray_note(sources: list[str]) -> str | None:
    """Files in the local sources' tables that are not read and may hold rows (`part-x.parquet.tmp`), said."""
    strays = [f for s in sources if not is_uri(s) for t in ("requests", "intervals", "tags")
              for f in datafiles.table_files(Path(s) / t)[1]]
    return datafiles.strays_note(strays)


def empty_sources(sources: list[str]) -> list[str]:
    """The local sources with no request or interval file (a daemon that has not flushed yet): in no row of the
    summary, which must say so (beside nodes with rows they vanished from it unsaid); URIs are not listed here."""
    return [s for s in sources if not is_uri(s) and not any(table_files([s], t) for t in ("requests", "intervals"))]


def empty_note(sources: list[str]) -> str | None:
    empty = empty_sources(sources)
    if not empty:
        return None
    return (f"{', '.join(empty)}: no request or interval rows yet (the daemon writes them at each flush, "
            "daemon.flush_interval_s, 30 s by default): not in the table; analyse again once it has flushed, or check "
            "that the folder is the daemon's data folder (daemon.data_dir)")


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


# The columns each table's query reads, with the type a file that lacks one (older writers) reads as NULL.
COLUMNS = {
    "requests": {"host": "VARCHAR", "simulated": "BOOLEAN", "daemon_id": "VARCHAR", "request_id": "BIGINT", "outcome": "VARCHAR",
                 "generated_tokens": "BIGINT", "gpu_energy_j": "DOUBLE", "attributed_tokens": "DOUBLE",
                 "ttft_s": "DOUBLE", "energy_note": "VARCHAR", "t_arrival_utc": "TIMESTAMPTZ",
                 "t_end_utc": "TIMESTAMPTZ", "gpu_uuids": "VARCHAR"},
    "intervals": {"host": "VARCHAR", "daemon_id": "VARCHAR", "t_start_mono_s": "DOUBLE", "gpu_energy_j": "DOUBLE",
                  "kind": "VARCHAR", "duration_s": "DOUBLE", "t_start_utc": "TIMESTAMPTZ",
                  "t_end_utc": "TIMESTAMPTZ", "server_count": "VARCHAR", "simulated": "BOOLEAN", "gpu_uuids": "VARCHAR"},
    "tags": {"host": "VARCHAR", "simulated": "BOOLEAN", "daemon_id": "VARCHAR", "name": "VARCHAR", "t_start_utc": "TIMESTAMPTZ",
             "t_end_utc": "TIMESTAMPTZ", "duration_s": "DOUBLE", "gpu_energy_j": "DOUBLE", "proxy_tokens": "DOUBLE",
             "server_count": "VARCHAR", "unproxied_energy_j": "DOUBLE", "gpu_uuids": "VARCHAR",
             "energy_note": "VARCHAR"},
}


def read_sql(files: list[str]) -> str:
    """DuckDB table expression over several datasets' files of one table: columns matched by name, each
    row with its file's name. No hive partitioning: DuckDB would read any `host=` folder in the path (one
    above the datasets too) as every row's host, over the `host` the daemon wrote into the row."""
    return (f"read_parquet([{', '.join(_quote(f) for f in files)}], hive_partitioning = false, "
            "union_by_name = true, filename = true)")


def _table_sql(con, table: str, files: list[str]) -> str:
    """One row per event of `table` (copies counted once, in `copies`), each with the host it belongs to.

    The host is the row's own; for rows written before the column existed, a `host=NAME` folder's NAME
    (the layout docs/fleet.md gives for Trino), else `(unknown) <dataset folder>`: two older nodes
    must not merge into one row whose J/token blends both.

    Finding copies takes one slot per key (a hash aggregate: past the engine's memory limit it spills, and
    with every column read as its payload a fleet's 18 M rows took ~20x a plain GROUP BY). So the keys
    alone are grouped first: where no key is found twice (the usual case) the rows are each their own and
    stream into the per-host sums; only where some key is found twice are the rows grouped whole."""
    cols = COLUMNS[table]
    raw = _raw_sql(con, table, files)
    label = _host_label_sql(table)
    key = KEYS[table]
    keyless = keyless_sql(key)  # every such row is its own, never a copy
    other = [c for c in cols if c not in ("host", *key)] + (["gpu_set_unwritten"] if "gpu_uuids" in cols else [])
    k = ", ".join(key)
    copied = files and con.execute(f"SELECT EXISTS (SELECT 1 FROM ({raw}) WHERE NOT {keyless} "
                                   f"GROUP BY {k} HAVING count(*) > 1)").fetchall()[0][0]
    if not copied:
        return f"(SELECT {label} AS host, {k}, {', '.join(other)}, 1 AS copies, 0 AS conflicts FROM ({raw}))"
    rows = (f"SELECT {label} AS host, host AS _written_host, {k}, {', '.join(other)}, hash({k}, {', '.join(other)}) AS _h, "
            f"{keyless} AS _keyless FROM ({raw})")
    aggs = ", ".join(f"any_value({c}) AS {c}" for c in other)
    # Copies are equal in every column read; one key whose rows differ (lowest and highest hash of a row
    # apart) is one event with two values, and any_value would pick one blindly: counted, then refused. So is
    # one key written by two hosts (a daemon runs on one): which host's sums it belongs to nothing says (export
    # refuses it too). Hosts named by their folder (rows from before the column) are not compared: a synced
    # copy of such a node sits in another folder.
    return (f"(WITH rows AS ({rows}) "
            f"SELECT min(host) AS host, {k}, {aggs}, count(*) AS copies, "
            f"CAST(min(_h) <> max(_h) OR count(DISTINCT _written_host) > 1 AS BIGINT) AS conflicts "
            f"FROM rows WHERE NOT _keyless GROUP BY {k} "
            f"UNION ALL SELECT host, {k}, {', '.join(other)}, 1, 0 FROM rows WHERE _keyless)")


def _host_label_sql(table: str) -> str:
    """SQL: the host a row of `table` belongs to (its own `host`, else its `host=` folder's, else its dataset folder),
    ` (sim)` after it where a daemon on the simulated GPU wrote the row: a host that ran `daemon --simulate` and then
    the real daemon on one data dir is two rows, never one blend of both (9 J/token and 1 read 5, all marked sim).
    Then its GPU set (GPU_SET_SQL): a daemon on GPU 1 and one on GPUs 0 and 1 are two rows, not one blend (1.56 and
    3.13 J/token read 2.344); rows written before gpu_uuids carry none (their set unknown, said by `notes`)."""
    folder = folder_sql(table)
    return (f"(coalesce(host, nullif(regexp_extract({folder}, '/host=([^/]+)$', 1), ''), "
            f"'(unknown) ' || {folder}) || CASE WHEN simulated THEN ' (sim)' ELSE '' END"
            f" || coalesce(' [' || {GPU_SET_SQL} || ']', ''))")


# SQL: a row's GPU set as a host's label shows it: each UUID to its first 8 hex digits (GPU-1a2b3c4d), space-separated.
GPU_SET_SQL = ("replace(regexp_replace(gpu_uuids, '([A-Za-z]+-[0-9a-fA-F]{8})[0-9a-fA-F-]*', '\\1', 'g'), ',', ' ')")


def _raw_sql(con, table: str, files: list[str]) -> str:
    """SQL: the rows of `table`'s files, every column of COLUMNS (null where a file lacks it) and the file's name."""
    cols = COLUMNS[table]
    if files:
        src = read_sql(files)
        types = {r[0]: r[1] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
        names = set(types)
        _check_foreign(table, files)
        _check_types(table, files, {c: types[c] for c in cols if c in types})
        sel = ", ".join(c if c in names else f"CAST(NULL AS {t}) AS {c}" for c, t in cols.items())
        # Whether the row itself said its GPU set (a tag written before gpu_uuids is every sampled GPU's energy).
        unwritten = ", gpu_uuids IS NULL AS gpu_set_unwritten" if "gpu_uuids" in cols else ""
        raw = f"SELECT {sel}{unwritten}, filename FROM {src}"
        if "gpu_uuids" in cols and _has_table(con, GPU_SETS):
            # Rows written before gpu_uuids: their daemon's GPU set as its samples say it (_recover_gpu_sets).
            raw = (f"SELECT r.* REPLACE (coalesce(r.gpu_uuids, g.gpu_uuids) AS gpu_uuids) FROM ({raw}) r "
                   f"LEFT JOIN {GPU_SETS} g ON r.daemon_id = g.daemon_id")
        return raw
    sel = ", ".join(f"CAST(NULL AS {t}) AS {c}" for c, t in cols.items())
    unwritten = ", NULL::BOOLEAN AS gpu_set_unwritten" if "gpu_uuids" in cols else ""
    return f"SELECT {sel}{unwritten}, NULL::VARCHAR AS filename WHERE false"


GPU_SETS = "fleet_gpu_sets"


def _has_table(con, name: str) -> bool:
    return con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [name]).fetchall()[0][0] > 0


def _recover_gpu_sets(con, srcs: list[str], tables: tuple[str, ...]) -> str | None:
    """Where rows of `tables` were written before gpu_uuids, put each such daemon's GPU set, as the samples dataset
    among the sources says it (an nvml row per sampled GPU, with its UUID, sorted and comma-joined as gpu_uuids is), in
    the temporary table GPU_SETS, which _raw_sql reads them by. Only those daemons' rows and the three columns needed
    are read (the samples are the largest dataset). A daemon whose samples are not among the sources keeps its set
    unknown (said by `notes`); so does every one where the samples cannot be read (a junk file among them): returned,
    the note that names them (SAMPLES_UNREAD, put on the summary's schema), never a failure of the whole summary."""
    import duckdb  # noqa: PLC0415

    lacking: set[str] = set()
    for table in tables:
        files = table_files(srcs, table)
        if files:
            lacking |= {r[0] for r in con.execute(f"SELECT DISTINCT daemon_id FROM ({_raw_sql(con, table, files)}) "
                                                  "WHERE gpu_uuids IS NULL AND daemon_id IS NOT NULL").fetchall()}
    samples = table_files(srcs, "samples") if lacking else []
    if not samples:
        return None
    try:
        src = read_sql(samples)
        names = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
        if not {"daemon_id", "gpu_uuid", "source"} <= names:
            return None
        con.execute(f"CREATE OR REPLACE TEMP TABLE {GPU_SETS} AS SELECT daemon_id, "
                    "array_to_string(list_sort(list(DISTINCT gpu_uuid)), ',') AS gpu_uuids "
                    f"FROM (SELECT daemon_id, gpu_uuid, source FROM {src}) WHERE source = 'nvml' AND gpu_uuid IS NOT "
                    f"NULL AND gpu_uuid <> '' AND daemon_id IN ({', '.join(_quote(d) for d in sorted(lacking))}) "
                    "GROUP BY daemon_id")
    except duckdb.Error as e:  # a junk file among the samples, a URI's glob matching nothing: those sets stay unknown
        why = str(e).split("\n\nLINE ")[0].strip()
        return (f"the samples ({', '.join(sorted({s for s in srcs}))}) could not be read ({why}), so the GPU sets of "
                f"the rows written before gpu_uuids stay unknown; the fix: move "
                "the unreadable file out of the samples folder and run again")
    return None


# Schema metadata key of a summary table: the note of _recover_gpu_sets (samples unreadable), said by notes/tag_notes.
SAMPLES_UNREAD = b"powerprof.samples_unread"


def _with_samples_note(t: pa.Table, note: str | None) -> pa.Table:
    return t.replace_schema_metadata({**(t.schema.metadata or {}), SAMPLES_UNREAD: note.encode()}) if note else t


def _samples_note(t: pa.Table) -> list[str]:
    got = (t.schema.metadata or {}).get(SAMPLES_UNREAD)
    return [got.decode()] if got else []


# DuckDB's names of the types a column read as (the files' types unified) that the queries here take as COLUMNS' type.
_DUCK_NUMBER = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
                "UHUGEINT", "FLOAT", "DOUBLE", "DECIMAL")
_DUCK_FITS = {"DOUBLE": _DUCK_NUMBER, "BIGINT": _DUCK_NUMBER, "VARCHAR": ("VARCHAR",), "TIMESTAMPTZ": ("TIMESTAMP",),
              "BOOLEAN": ("BOOLEAN",)}


def _check_foreign(table: str, files: list[str]) -> None:
    """Refuse, naming it, a local file of none of `table`'s columns (datafiles.foreign_file_refusal): read by name, its
    rows were the table's with every column empty, 2 such rows counted as 2 requests of a host "(unknown)". Footers
    only; files behind a URI are not fetched twice for it."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    for f in files:
        if not is_uri(f) and (why := datafiles.foreign_file_refusal(table, f, pq.read_schema(f).names)):
            raise FleetError(why)


def _check_types(table: str, files: list[str], read_as: dict[str, str]) -> None:
    """Refuse, naming the file, a column stored as another kind of value than the daemon writes (gpu_energy_j as
    text in one file: DuckDB read the column as VARCHAR and failed on "isfinite(VARCHAR)"). Only where DuckDB's
    unified type does not fit are the files' footers read, to name the one that is wrong (the rule export
    applies: storage/datafiles.type_refusal)."""
    wrong = {c: t for c, t in read_as.items() if not t.startswith(_DUCK_FITS[COLUMNS[table][c]])}
    if not wrong:
        return
    local = [f for f in files if not is_uri(f)]
    if local:
        import pyarrow.parquet as pq  # noqa: PLC0415

        why = datafiles.type_refusal(table, ((f, pq.read_schema(f)) for f in local), columns=set(wrong))
        if why:
            raise FleetError(why)
        if len(local) == len(files):
            return  # no file holds a value of another kind (a column empty in all of them reads as INTEGER)
    c, t = next(iter(wrong.items()))
    raise FleetError(f"column {c} of {table} reads as {t} in one of the files of {', '.join(files)}, where the daemon "
                     f"writes {COLUMNS[table][c]}: a file edited or written by another tool; write that column back "
                     f"as {COLUMNS[table][c]} in it, or move it out of the dataset folder, and run again")


_Overlap = dict[str, tuple[int, float, list[str]]]


def _overlaps(con, intervals: str) -> tuple[_Overlap, _Overlap]:
    """{host row (its label): (intervals of it that overlap in time another daemon's on the same machine and a GPU both
    sampled, their GPU energy, the daemon_ids involved)}: each daemon's intervals hold every sampled GPU's energy, so
    summed such a GPU's energy and hours count twice (two daemons at once on one host: 58.8 s of hours over a 29.4 s
    span). Then the same for overlaps where either daemon's GPU set is unknown (rows written before gpu_uuids, no
    samples to read it from): they may share a GPU or not, so these are apart (one daemon per GPU was a valid setup).
    Each daemon's span is taken first (one GROUP BY); only the pairs whose spans overlap are matched interval by
    interval."""
    machine = "regexp_replace(host, ' \\[[^]]*\\]$', '')"
    spans = con.execute(f"SELECT {machine} AS machine, host, daemon_id, min(gpu_uuids), min(t_start_utc), "
                        f"max(t_end_utc) FROM {intervals} WHERE daemon_id IS NOT NULL AND t_start_utc IS NOT NULL "
                        "AND t_end_utc IS NOT NULL GROUP BY ALL").fetchall()
    pairs = []
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            if a[0] != b[0] or a[2] == b[2] or not (a[4] < b[5] and b[4] < a[5]):
                continue
            if a[3] is not None and b[3] is not None and not set(a[3].split(",")) & set(b[3].split(",")):
                continue  # disjoint GPU sets: each its own row, nothing counted twice
            pairs.extend([(a, b), (b, a)])
    out: dict[str, tuple[int, float, list[str]]] = {}
    maybe: dict[str, tuple[int, float, list[str]]] = {}
    for a, b in pairs:
        # x overlaps some y (y.start < x.end and x.start < y.end) where, of the y starting before x ends, the latest
        # end is after x starts: the latest of them by start (ASOF: a merge, linear) carries the running max of the
        # ends up to its start. The EXISTS it replaces matched every pair (quadratic: 80k intervals a daemon, 27 s).
        n, e = con.execute(
            f"WITH y AS (SELECT t_start_utc AS s, max(t_end_utc) OVER (ORDER BY t_start_utc) AS e FROM {intervals} "
            "WHERE host = ? AND daemon_id = ? AND t_start_utc IS NOT NULL AND t_end_utc IS NOT NULL), "
            f"x AS (SELECT t_start_utc, t_end_utc, gpu_energy_j FROM {intervals} WHERE host = ? AND daemon_id = ?) "
            "SELECT count(*), coalesce(sum(x.gpu_energy_j) FILTER (WHERE isfinite(x.gpu_energy_j)), 0) "
            "FROM x ASOF JOIN y ON x.t_end_utc > y.s WHERE y.e > x.t_start_utc",
            [b[1], b[2], a[1], a[2]]).fetchall()[0]
        if n:
            into = out if a[3] is not None and b[3] is not None else maybe
            n0, e0, ids = into.get(a[1], (0, 0.0, []))
            into[a[1]] = (n0 + n, e0 + e, sorted({*ids, a[2], b[2]}))
    return out, maybe


def _with_overlaps(t: pa.Table, got: tuple[dict, dict]) -> pa.Table:
    got, maybe = got
    hosts = t.column("host").to_pylist()
    t = t.append_column("double_counted_intervals", pa.array([got.get(h, (0,))[0] for h in hosts], pa.int64()))
    t = t.append_column("double_counted_gpu_energy_j", pa.array([got[h][1] if h in got else None for h in hosts],
                                                                pa.float64()))
    t = t.append_column("double_counted_daemons", pa.array([",".join(got[h][2]) if h in got else None
                                                            for h in hosts], pa.string()))
    t = t.append_column("maybe_double_counted_intervals", pa.array([maybe.get(h, (0,))[0] for h in hosts], pa.int64()))
    return t.append_column("maybe_double_counted_gpu_energy_j",
                           pa.array([maybe[h][1] if h in maybe else None for h in hosts], pa.float64()))


def _host_clashes(con, table: str, files: list[str]) -> tuple[int, list[list[str]]]:
    """Keys of `table` whose rows name two hosts in their `host` column: how many, and each set of hosts so named.
    Asked only once some key is refused, to say which hosts (the summary itself keeps one row per host)."""
    if not files:
        return 0, []
    k = ", ".join(KEYS[table])
    got = con.execute(f"SELECT list_sort(list(DISTINCT host)) AS hosts, count(*) FROM ({_raw_sql(con, table, files)}) "
                      f"WHERE NOT {keyless_sql(KEYS[table])} GROUP BY {k} HAVING count(DISTINCT host) > 1").fetchall()
    sets = sorted({tuple(h) for h, _ in got})
    return len(got), [list(h) for h in sets]


# The most a host's GPUs can draw together: 16 boards at the highest power limit any accepts (1.2 kW), with a margin of
# half again for the transients NVML's readings average. A daemon dataset does not record its GPUs' count or limits,
# so this is the bound an interval's energy is held to: more than this over its duration (1e15 J over 1 s, a counter
# read across a driver reload or an edited file) is no draw, and summed it printed 277777777 kWh for the host.
MAX_HOST_GPU_POWER_W = 30_000.0


def _drawable(energy: str, duration: str) -> str:
    """SQL: an interval's energy is one its host's GPUs could draw over its duration (MAX_HOST_GPU_POWER_W)."""
    return (f"({energy} IS NULL OR {duration} IS NULL OR {energy} <= {MAX_HOST_GPU_POWER_W!r} * {duration})")


def _sane(*cols: str) -> str:
    """SQL: every column is missing (null: no share, not scraped) or a finite, non-negative amount."""
    return " AND ".join(f"({c} IS NULL OR (isfinite({c}) AND {c} >= 0))" for c in cols)


# An interval left out of the figures (I_OK false: NaN, negative, or more than MAX_HOST_GPU_POWER_W over its duration)
# was split among the requests live in it and summed into the tag windows over it: a share of 1e15 J is finite and
# positive, so such a request passed every check of its own and fed J/token (a host read 1.5e12 J/token). A request or
# window is matched to its host's intervals by wall-clock time (the daemon stamps both from one clock; the split
# itself ran on the monotonic one, microseconds apart): any overlap, edges included, leaves it out and counts it.
# An edge a row lacks (a foreign or edited file) is open: nothing says the row missed the interval.
I_OK = _sane("gpu_energy_j", "duration_s") + " AND " + _drawable("gpu_energy_j", "duration_s")
BAD_INTERVALS = "fleet_bad_intervals"


def _bad_intervals(con, files: list[str]) -> int:
    """Put the intervals left out of the figures, per host, in the temporary table BAD_INTERVALS; how many there are.
    Copies of one are not merged: a second copy overlaps what the first does."""
    con.execute(f"CREATE OR REPLACE TEMP TABLE {BAD_INTERVALS} AS "
                f"SELECT {_host_label_sql('intervals')} AS host, "
                "coalesce(t_start_utc, '-infinity'::TIMESTAMPTZ) AS b_start, "
                "coalesce(t_end_utc, 'infinity'::TIMESTAMPTZ) AS b_end "
                f"FROM ({_raw_sql(con, 'intervals', files)}) WHERE NOT ({I_OK})")
    return con.execute(f"SELECT count(*) FROM {BAD_INTERVALS}").fetchall()[0][0]


def _spans_sql(rows: str, start: str, end: str, any_bad: bool) -> str:
    """SQL: `rows` (a table expression with `host`) with `spans_bad`: it overlaps an interval of its host in
    BAD_INTERVALS. The latest bad interval starting by the row's end (an ASOF join: sorted, never rows × intervals)
    carries the furthest end of every bad interval starting by then; the row overlaps one where that reaches its start."""
    if not any_bad:
        return f"(SELECT *, false AS spans_bad FROM {rows})"
    return (f"(WITH bad AS (SELECT host, b_start, max(b_end) OVER (PARTITION BY host ORDER BY b_start) AS b_reach "
            f"FROM {BAD_INTERVALS}) "
            f"SELECT q.*, coalesce(b.b_reach >= coalesce(q.{start}, '-infinity'::TIMESTAMPTZ), false) AS spans_bad "
            f"FROM {rows} q ASOF LEFT JOIN bad b "
            f"ON q.host = b.host AND coalesce(q.{end}, 'infinity'::TIMESTAMPTZ) >= b.b_start)")


# schema.bypass_count_low and bypass_count_unknown in SQL, for the intervals' and the tags' server_count alike:
# trusted where every comma-joined value in it is (a tag's joins its intervals'); unknown where empty or `unread`.
# tests/test_daemon_bypass_partial.py holds this and the Python rule equal over one dataset.
def _count_trusted_sql(col: str = "server_count") -> str:
    return (f"({col} IS NOT NULL AND list_has_all([{', '.join(repr(c) for c in SERVER_COUNT_TRUSTED)}], "
            f"string_split({col}, ',')))")


def _count_unknown_sql(col: str = "server_count") -> str:
    return f"(coalesce({col}, '') IN ('', '{SERVER_COUNT_UNREAD}'))"


def _count_unmeasured_sql(col: str = "server_count") -> str:
    """Trusted, but bypass traffic not measured (`off`) or in part (`slots_only`): kept in J/token, said apart."""
    return f"({_count_trusted_sql(col)} AND {col} <> '{SERVER_COUNT_COMPLETE}')"


# One row per host: what its proxy served, what its GPUs spent, and what the two give per token.
# A row whose energy or tokens cannot be (NaN, infinite, negative: a foreign or damaged file) is
# left out of the sums and counted, rather than turning a host's total into NaN or lowering it.
# A request whose energy the daemon marked as resting on idle power taken out of a counterless GPU's
# mostly idle intervals (NO_COUNTER_SHORT_FLAG) is left out of J/token, as the daemon's own headline does; so is one live
# before the daemon's first GPU read (BEFORE_FIRST_READ_FLAG: the energy before it is in no interval); so is one given
# energy while the server also ran on a GPU the daemon did not sample (SERVER_GPU_UNSAMPLED_FLAG: that GPU's is in none); so is one
# whose figure may be read either way, nothing measured saying which (UNSURE_FLAG: a run-on a found-down scrape may have
# cut, or one placed to SGLang's abort whose answer may have ended by itself sooner; not a prompt's tools a server may
# or may not render: that row's error is mirrored in the rows sharing its
# intervals, so it stays in and the host's sum is unbiased); so is one
# given energy of intervals whose server token count may be low (BYPASS_LOW_FLAG: bypass traffic's energy may be in
# it). A request whose GPU energy is empty (the daemon writes no figure where a GPU gave no reading over it, never 0) or
# whose token count is (an older writer's) is left out of both sums of J/token, and counted: its tokens under the others'
# energy read J/token low (half the truth, where half the requests had a GPU unread). The intervals are counted by the same rule (schema.bypass_count_low, the one the daemon flags the requests by):
# those it leaves out, with their energy and reasons, as low, or as unknown (`unread`, or written before the column:
# null), never read as complete; those it keeps whose bypass traffic was not measured (`off`) or in part
# (`slots_only`), apart: their requests' J/token holds any bypass energy there.
# The same statement, with the tables over the same files, is the Spark SQL / Trino query of docs/fleet.md.
FLEET_SQL = """
WITH r AS (
    SELECT host,
           count(*) AS requests,
           count(*) FILTER (WHERE outcome <> 'ok') AS failed_requests,
           CAST(sum(generated_tokens) FILTER (WHERE {r_ok}) AS BIGINT) AS generated_tokens,
           sum(gpu_energy_j) FILTER (WHERE {r_ok} AND {r_sure} AND {r_paired}) AS attributed_gpu_energy_j,
           sum(attributed_tokens) FILTER (WHERE {r_ok} AND {r_sure} AND {r_paired}) AS attributed_tokens,
           count(*) FILTER (WHERE {r_ok} AND {r_sure} AND NOT {r_paired}
                            AND (coalesce(attributed_tokens, 0) > 0 OR coalesce(gpu_energy_j, 0) > 0))
               AS unknown_energy_requests,
           count(*) FILTER (WHERE coalesce(energy_note, '') LIKE '{NOT_FORWARDED_NOTE}%') AS not_forwarded_requests,
           count(*) FILTER (WHERE {r_ok} AND NOT {r_sure} AND NOT {r_bypass_low} AND NOT spans_bad) AS uncertain_requests,
           count(*) FILTER (WHERE {r_ok} AND {r_bypass_low} AND NOT spans_bad) AS bypass_uncertain_requests,
           count(*) FILTER (WHERE {r_ok} AND spans_bad) AS invalid_interval_requests,
           approx_quantile(ttft_s, 0.5) AS ttft_p50_s,
           CAST(sum(copies - 1) AS BIGINT) AS duplicate_requests,
           CAST(sum(conflicts) AS BIGINT) AS conflicting_requests,
           count(*) FILTER (WHERE NOT ({r_ok})) AS invalid_requests,
           count(*) FILTER (WHERE simulated) AS simulated_requests
    FROM {requests} GROUP BY 1
), i AS (
    SELECT host,
           sum(gpu_energy_j) FILTER (WHERE {i_ok}) AS gpu_energy_j,
           sum(gpu_energy_j) FILTER (WHERE kind = 'idle' AND {i_ok}) AS idle_gpu_energy_j,
           sum(duration_s) FILTER (WHERE {i_ok}) / 3600 AS hours,
           min(t_start_utc) AS t_first_utc,
           max(t_end_utc) AS t_last_utc,
           CAST(sum(copies - 1) AS BIGINT) AS duplicate_intervals,
           CAST(sum(conflicts) AS BIGINT) AS conflicting_intervals,
           count(*) FILTER (WHERE NOT ({i_ok})) AS invalid_intervals,
           count(*) FILTER (WHERE {i_ok} AND {i_low}) AS bypass_uncertain_intervals,
           sum(gpu_energy_j) FILTER (WHERE {i_ok} AND {i_low}) AS bypass_uncertain_gpu_energy_j,
           string_agg(DISTINCT server_count, ',') FILTER (WHERE {i_ok} AND {i_low}) AS bypass_uncertain_reasons,
           count(*) FILTER (WHERE {i_ok} AND {i_unknown}) AS bypass_unknown_intervals,
           count(*) FILTER (WHERE {i_ok} AND {i_unmeasured}) AS bypass_unmeasured_intervals,
           sum(gpu_energy_j) FILTER (WHERE {i_ok} AND {i_unmeasured}) AS bypass_unmeasured_gpu_energy_j,
           string_agg(DISTINCT server_count, ',') FILTER (WHERE {i_ok} AND {i_unmeasured}) AS bypass_unmeasured_reasons,
           count(*) FILTER (WHERE simulated) AS simulated_intervals,
           count(*) FILTER (WHERE gpu_uuids IS NULL) AS gpu_set_unknown_intervals
    FROM {intervals} GROUP BY 1
)
SELECT host, requests, failed_requests, generated_tokens, gpu_energy_j, idle_gpu_energy_j,
       attributed_gpu_energy_j, attributed_tokens,
       attributed_gpu_energy_j / nullif(attributed_tokens, 0) AS gpu_j_per_token,
       ttft_p50_s, hours, t_first_utc, t_last_utc,
       coalesce(duplicate_requests, 0) AS duplicate_requests, coalesce(duplicate_intervals, 0) AS duplicate_intervals,
       coalesce(invalid_requests, 0) AS invalid_requests, coalesce(invalid_intervals, 0) AS invalid_intervals,
       coalesce(conflicting_requests, 0) AS conflicting_requests,
       coalesce(conflicting_intervals, 0) AS conflicting_intervals,
       coalesce(uncertain_requests, 0) AS uncertain_requests,
       coalesce(unknown_energy_requests, 0) AS unknown_energy_requests,
       coalesce(not_forwarded_requests, 0) AS not_forwarded_requests,
       coalesce(invalid_interval_requests, 0) AS invalid_interval_requests,
       coalesce(bypass_uncertain_requests, 0) AS bypass_uncertain_requests,
       coalesce(bypass_uncertain_intervals, 0) AS bypass_uncertain_intervals,
       bypass_uncertain_gpu_energy_j, bypass_uncertain_reasons,
       coalesce(bypass_unknown_intervals, 0) AS bypass_unknown_intervals,
       coalesce(bypass_unmeasured_intervals, 0) AS bypass_unmeasured_intervals,
       bypass_unmeasured_gpu_energy_j, bypass_unmeasured_reasons,
       coalesce(simulated_intervals, 0) AS simulated_intervals,
       coalesce(simulated_requests, 0) AS simulated_requests,
       coalesce(gpu_set_unknown_intervals, 0) AS gpu_set_unknown_intervals
FROM i FULL OUTER JOIN r USING (host)
ORDER BY host
""".replace("{NOT_FORWARDED_NOTE}", NOT_FORWARDED_NOTE).replace("{r_paired}", "(gpu_energy_j IS NOT NULL AND attributed_tokens IS NOT NULL)").replace("{r_sure}", f"(coalesce(energy_note, '') NOT LIKE '%{NO_COUNTER_SHORT_FLAG}%' AND coalesce(energy_note, '') "
                         f"NOT LIKE '%{BEFORE_FIRST_READ_FLAG}%' AND coalesce(energy_note, '') NOT LIKE '%{SERVER_GPU_UNSAMPLED_FLAG}%' "
                         f"AND coalesce(energy_note, '') NOT LIKE '%{UNSURE_FLAG}%' "
                         "AND NOT {r_bypass_low} AND NOT spans_bad)").replace(
    "{r_bypass_low}", f"(coalesce(energy_note, '') LIKE '%{BYPASS_LOW_FLAG}%')").replace(
    "{i_low}", f"(NOT {_count_trusted_sql()} AND NOT {_count_unknown_sql()})").replace(
    "{i_unknown}", _count_unknown_sql()).replace("{i_unmeasured}", _count_unmeasured_sql()).replace(
    "{r_ok}", _sane("gpu_energy_j", "attributed_tokens", "CAST(generated_tokens AS DOUBLE)")).replace(
    "{i_ok}", I_OK)


def _load_httpfs(con, srcs: list[str]) -> None:
    """Where a source is a URI: DuckDB's httpfs loaded before any query, else FleetError naming the URIs and why."""
    from .engine import httpfs_refusal  # noqa: PLC0415

    uris = [s for s in srcs if is_uri(s)]
    if uris and (why := httpfs_refusal(con)) is not None:
        raise FleetError(f"{', '.join(uris)}: cannot read: {why}")


def _raise_if_stalled(srcs: list[str], why: str) -> None:
    """FleetError naming the URIs and the bound where DuckDB's error `why` is a remote that stopped sending."""
    from .engine import http_stall_refusal  # noqa: PLC0415

    uris = [s for s in srcs if is_uri(s)]
    if uris and (said := http_stall_refusal(why)) is not None:
        raise FleetError(f"{', '.join(uris)}: cannot read: {said}")


def fleet_summary(sources) -> pa.Table:
    """Per-host summary over several daemon datasets (folders, globs, URIs): one query, out of core."""
    srcs = expand_sources(sources)
    if not srcs:
        raise FleetError("give at least one daemon dataset folder, glob or URI")
    bad = [s for s in srcs if not is_daemon_dataset(s)]
    if bad:
        raise FleetError(f"{', '.join(bad)}: not a daemon dataset (no requests/ or intervals/ folder)")
    with connect() as con:
        _load_httpfs(con, srcs)
        try:
            unread = _recover_gpu_sets(con, srcs, ("requests", "intervals"))
            files = {table: table_files(srcs, table) for table in ("requests", "intervals")}
            parts = {table: _table_sql(con, table, files[table]) for table in ("requests", "intervals")}
            parts["requests"] = _spans_sql(parts["requests"], "t_arrival_utc", "t_end_utc",
                                           _bad_intervals(con, files["intervals"]) > 0)
            out = to_arrow(con, FLEET_SQL.format(**parts))
            out = _with_overlaps(out, _overlaps(con, parts["intervals"]))
            conflicts = {t: sum(out.column(f"conflicting_{t}").to_pylist() or [0]) for t in ("requests", "intervals")}
            clashes = {t: _host_clashes(con, t, files[t]) if conflicts[t] else (0, []) for t in conflicts}
        except FleetError:
            raise
        except Exception as e:  # duckdb.Error and IO errors: say which sources, keep the reason
            from powerprof import termination  # noqa: PLC0415

            if (stop := termination.exit_inside(e)) is not None:
                raise stop from None
            why = str(e).split("\n\nLINE ")[0].strip()  # DuckDB's echo of our query says nothing to the user
            _raise_if_stalled(srcs, why)
            raise FleetError(f"cannot read the datasets {', '.join(srcs)}: {why}") from None
    bad = [r for r in out.select(["host", "conflicting_requests", "conflicting_intervals"]).to_pylist()
           if r["conflicting_requests"] or r["conflicting_intervals"]]
    if bad:
        keys = (f"{{}} request key(s) ({', '.join(KEYS['requests'])}) and {{}} interval key(s) "
                f"({', '.join(KEYS['intervals'])})")
        said = []
        # One key under two hosts' names: the host differs, whatever the values; said apart, with both hosts.
        h_r, h_i = clashes["requests"][0], clashes["intervals"][0]
        if h_r or h_i:
            sets = sorted({tuple(h) for t in clashes.values() for h in t[1]})
            said.append(keys.format(h_r, h_i) + f" were written by {'two' if all(len(h) == 2 for h in sets) else 'several'} "
                        f"hosts ({'; '.join(' and '.join(h) for h in sets)}): a daemon runs on one host, so one copy names "
                        "the wrong host (a backup restored under another name, a host renamed by hand), and which "
                        "host's sums the rows belong to nothing says")
        n_r, n_i = conflicts["requests"] - h_r, conflicts["intervals"] - h_i
        if n_r or n_i:
            said.append(keys.format(n_r, n_i) + f" hold rows that differ (hosts: {', '.join(r['host'] for r in bad)}): "
                        "one event recorded twice with different values, of which at most one is true and nothing "
                        "says which")
        raise FleetError("; ".join(said) + ". Remove the file that is wrong (`powerprof export` of the same sources "
                         "names the files), or analyse the folders separately")
    out = out.drop_columns(["conflicting_requests", "conflicting_intervals"])
    out = _utc_times(_reasons_sorted(out, ("bypass_uncertain_reasons", "bypass_unmeasured_reasons")))
    if not out.num_rows:
        raise FleetError(f"{', '.join(srcs)}: no request or interval rows yet (the daemon writes them at each flush, "
                         "daemon.flush_interval_s, 30 s by default): nothing to summarise")
    return _with_samples_note(out, unread)


# One row per host and tag name (`powerprof tag start|stop NAME`, every window of that name): the proxied traffic's GPU
# energy over its proxied tokens. A window's gpu_energy_j is every GPU joule over it; its unproxied_energy_j the part
# the ledger gave to bypass traffic (requests straight to the server), whose tokens are not in proxy_tokens: J/token is
# (gpu - unproxied) / tokens, summed over the windows. Where the server's count may be low (schema.bypass_count_low,
# the rule the requests follow) unproxied may be too, and the J/token high: such a window is left out of the tag's
# figures and counted apart (its reasons), as is one whose bypass traffic is unknown (`unread`, or written before
# server_count or unproxied_energy_j: null, never taken as 0), one with no GPU energy (a GPU unread inside it), and
# one whose figures cannot be (NaN, infinite, negative). A counted window whose bypass traffic was not measured, or
# measured in part (`off`, `slots_only`: trusted, schema.SERVER_COUNT_TRUSTED), stays in, counted apart to be said.
# A window otherwise counted whose energy_note says its edges may move its energy past the tolerance (edges-late) or
# could not be held (edges-unheld) is left out too and counted apart (edges_uncertain_windows, their energy): each
# note starts with its flag; the last, closed at shutdown's, names the tag as given (any text), so it is not read.
TAGS_SQL = """
SELECT host, name,
       count(*) AS windows,
       count(*) FILTER (WHERE {counted}) AS counted_windows,
       sum(gpu_energy_j) FILTER (WHERE {counted}) AS gpu_energy_j,
       sum(unproxied_energy_j) FILTER (WHERE {counted}) AS unproxied_energy_j,
       sum(proxy_tokens) FILTER (WHERE {counted}) AS proxy_tokens,
       (sum(gpu_energy_j) FILTER (WHERE {counted}) - sum(unproxied_energy_j) FILTER (WHERE {counted}))
           / nullif(sum(proxy_tokens) FILTER (WHERE {counted}), 0) AS gpu_j_per_token,
       sum(duration_s) FILTER (WHERE {counted}) AS duration_s,
       min(t_start_utc) AS t_first_utc,
       max(t_end_utc) AS t_last_utc,
       count(*) FILTER (WHERE {ok} AND {energy} AND NOT {trusted} AND NOT {unknown}) AS bypass_uncertain_windows,
       sum(gpu_energy_j) FILTER (WHERE {ok} AND {energy} AND NOT {trusted} AND NOT {unknown})
           AS bypass_uncertain_gpu_energy_j,
       string_agg(DISTINCT server_count, ',') FILTER (WHERE {ok} AND {energy} AND NOT {trusted} AND NOT {unknown})
           AS bypass_uncertain_reasons,
       count(*) FILTER (WHERE {ok} AND {energy} AND {trusted} AND NOT {edges_sure}) AS edges_uncertain_windows,
       sum(gpu_energy_j) FILTER (WHERE {ok} AND {energy} AND {trusted} AND NOT {edges_sure})
           AS edges_uncertain_gpu_energy_j,
       count(*) FILTER (WHERE {ok} AND {energy} AND {unknown}) AS bypass_unknown_windows,
       count(*) FILTER (WHERE {counted} AND {unmeasured}) AS bypass_unmeasured_windows,
       sum(gpu_energy_j) FILTER (WHERE {counted} AND {unmeasured}) AS bypass_unmeasured_gpu_energy_j,
       string_agg(DISTINCT server_count, ',') FILTER (WHERE {counted} AND {unmeasured}) AS bypass_unmeasured_reasons,
       count(*) FILTER (WHERE {ok} AND NOT {energy}) AS no_energy_windows,
       count(*) FILTER (WHERE {counted} AND gpu_set_unwritten AND gpu_uuids LIKE '%,%') AS all_gpus_windows,
       count(*) FILTER (WHERE {counted} AND gpu_set_unwritten AND gpu_uuids IS NULL) AS maybe_all_gpus_windows,
       count(*) FILTER (WHERE NOT ({ok})) AS invalid_windows,
       count(*) FILTER (WHERE {ok} AND spans_bad) AS invalid_interval_windows,
       CAST(sum(copies - 1) AS BIGINT) AS duplicate_windows,
       CAST(sum(conflicts) AS BIGINT) AS conflicting_windows
FROM {tags} GROUP BY host, name ORDER BY host, name
""".replace("NOT ({ok})", "NOT ({sane})").replace("{ok} AND spans_bad", "{sane} AND spans_bad").replace(
    "{counted}", "{ok} AND {energy} AND {trusted} AND {edges_sure}").replace(
    "{edges_sure}", "NOT regexp_matches(split_part(coalesce(energy_note, ''), 'closed at shutdown: ', 1), "
                    f"'(^|; )({TAG_LATE_FLAG}|{TAG_UNHELD_FLAG}): ')").replace(
    "{unmeasured}", f"(server_count <> '{SERVER_COUNT_COMPLETE}')").replace(
    "{trusted}", f"({_count_trusted_sql()} AND unproxied_energy_j IS NOT NULL)").replace(
    "{unknown}", f"({_count_unknown_sql()} OR unproxied_energy_j IS NULL)").replace(
    "{energy}", "(gpu_energy_j IS NOT NULL)").replace(
    "{ok}", "{sane} AND NOT spans_bad").replace("{sane}", _sane("gpu_energy_j", "proxy_tokens", "unproxied_energy_j",
                                                                  "duration_s"))


def tag_summary(sources) -> pa.Table:
    """Per host and tag name over daemon datasets (as fleet_summary takes them): energy, proxied tokens, J/token of
    the windows whose count is whole, the rest counted apart. No rows where no tag was ever stopped."""
    srcs = expand_sources(sources)
    with connect() as con:
        _load_httpfs(con, srcs)
        try:
            unread = _recover_gpu_sets(con, srcs, ("tags",))
            files = table_files(srcs, "tags")
            tags = _table_sql(con, "tags", files)
            if files:  # the intervals are read only where there are windows to match against them
                tags = _spans_sql(tags, "t_start_utc", "t_end_utc", _bad_intervals(con, table_files(srcs, "intervals")) > 0)
            else:
                tags = _spans_sql(tags, "t_start_utc", "t_end_utc", False)
            out = to_arrow(con, TAGS_SQL.format(tags=tags))
        except FleetError:
            raise
        except Exception as e:  # duckdb.Error and IO errors: say which sources, keep the reason
            from powerprof import termination  # noqa: PLC0415

            if (stop := termination.exit_inside(e)) is not None:
                raise stop from None
            why = str(e).split("\n\nLINE ")[0].strip()
            _raise_if_stalled(srcs, why)
            raise FleetError(f"cannot read the tag rows of {', '.join(srcs)}: {why}") from None
    bad = [r["host"] for r in out.select(["host", "conflicting_windows"]).to_pylist() if r["conflicting_windows"]]
    if bad:
        raise FleetError(f"{sum(out.column('conflicting_windows').to_pylist())} tag key(s) ({', '.join(KEYS['tags'])}) "
                         f"hold rows that differ (hosts: {', '.join(sorted(set(bad)))}): one window recorded twice with "
                         "different values, of which at most one is true. Remove the file that is wrong (`powerprof "
                         "export` of the same sources names the files), or analyse the folders separately")
    out = out.drop_columns(["conflicting_windows"])
    return _with_samples_note(_utc_times(_reasons_sorted(out, ("bypass_uncertain_reasons",
                                                               "bypass_unmeasured_reasons"))), unread)


UTC_TIMESTAMP = pa.timestamp("us", tz="UTC")


def _utc_times(t: pa.Table) -> pa.Table:
    """Each timestamp column as every powerprof file has it, `timestamp[us, tz=UTC]` (docs/data.md). DuckDB gives a
    TIMESTAMPTZ in its session's zone, the host's own: fleet.parquet's t_first_utc read `tz=Etc/UTC` on a host set
    to UTC and `tz=Asia/Tokyo` under TZ=Asia/Tokyo, the instant the same. Only the zone changes (an Arrow timestamp
    holds UTC); a file's finer unit (an edited file's ns) is cut to the microsecond."""
    for i, f in enumerate(t.schema):
        if pa.types.is_timestamp(f.type) and f.type != UTC_TIMESTAMP:
            t = t.set_column(i, pa.field(f.name, UTC_TIMESTAMP, f.nullable),
                             t.column(i).cast(UTC_TIMESTAMP, safe=False))
    return t


def _reasons_sorted(t: pa.Table, names) -> pa.Table:
    """Each row's reasons once, sorted (string_agg joined the distinct values, some of which list several)."""
    for name in names:
        col = t.schema.get_field_index(name)
        t = t.set_column(col, name, pa.array(
            [",".join(sorted(set(v.split(",")))) if v else None for v in t.column(col).to_pylist()], pa.string()))
    return t


def tag_notes(t: pa.Table) -> list[str]:
    """What the reader of the tag table must know: windows left out of a tag's J/token and why, rows counted once."""
    rows = t.to_pylist()
    out = _samples_note(t)
    low = [r for r in rows if r["bypass_uncertain_windows"]]
    if low:
        out.append("tag windows whose server token count may be low (their server_count: bypass traffic's energy, "
                   "unproxied_energy_j, may be low and their J/token high) were left out of their tag's energy, tokens "
                   "and J/token: " + "; ".join(
                       f"{r['host']} {r['name']}: {r['bypass_uncertain_windows']} of {r['windows']}, "
                       f"{r['bypass_uncertain_gpu_energy_j'] or 0.0:.1f} J ({r['bypass_uncertain_reasons']})"
                       for r in low) + "; no part of such a window can be kept: its J/token is one figure over it, and "
                   "how much bypass traffic the count missed nothing says (none, where every request went through the "
                   "proxy); the fix: " + bypass_count_fix(",".join(r["bypass_uncertain_reasons"] or "" for r in low))
                   + " (docs/daemon.md, Which rows may be low)")
    late = [r for r in rows if r["edges_uncertain_windows"]]
    if late:
        out.append(f"tag windows whose edges may move their energy past the tolerance ({TAG_LATE_FLAG}: the daemon's "
                   "counter reads at an edge came far apart on a loaded host) or could not be held past a counter "
                   f"refresh ({TAG_UNHELD_FLAG}: each edge up to a refresh stale) were left out of their tag's energy, "
                   "tokens and J/token: " + "; ".join(
                       f"{r['host']} {r['name']}: {r['edges_uncertain_windows']} of {r['windows']}, "
                       f"{r['edges_uncertain_gpu_energy_j'] or 0.0:.1f} J" for r in late)
                   + "; each window's energy_note says which, by how much and the fix (CPU to spare for the daemon, a "
                   "longer window; docs/daemon.md, Tag windows and the counter's refresh)")
    unknown = [r for r in rows if r["bypass_unknown_windows"]]
    if unknown:
        out.append("tag windows whose bypass traffic is unknown (server_count unread: the server's count not read yet; "
                   "server_count or unproxied_energy_j empty: written before the column, whose J/token held bypass "
                   "traffic's energy over the proxied tokens alone) were left out of their tag's J/token: " + "; ".join(
                       f"{r['host']} {r['name']}: {r['bypass_unknown_windows']} of {r['windows']}" for r in unknown))
    blind = [r for r in rows if r["bypass_unmeasured_windows"]]
    if blind:
        out.append("tag windows whose bypass traffic was not measured, or in part (server_count off: the daemon scrapes "
                   "no server; slots_only: a llama-server without /metrics, whose /slots miss each request's last "
                   "tokens) are in their tag's J/token with none or part of bypass traffic's energy taken out: any "
                   "requests sent straight to the server put their energy over the proxied tokens, and the J/token "
                   "reads high: " + "; ".join(
                       f"{r['host']} {r['name']}: {r['bypass_unmeasured_windows']} of {r['windows']}, "
                       f"{r['bypass_unmeasured_gpu_energy_j'] or 0.0:.1f} J, "
                       f"{100.0 * (r['bypass_unmeasured_gpu_energy_j'] or 0.0) / r['gpu_energy_j']:.0f}% of its GPU "
                       f"energy ({r['bypass_unmeasured_reasons']})" for r in blind)
                   + "; the fix: " + bypass_count_fix(",".join(r["bypass_unmeasured_reasons"] or "" for r in blind))
                   + " (docs/daemon.md, Bypass traffic)")
    none = [r for r in rows if r["no_energy_windows"]]
    if none:
        out.append("tag windows with no GPU energy (a GPU unread in one of their intervals, or a daemon that died with "
                   "the window open: closed_by lost, its energy_note says which) were left out of their tag's figures: "
                   + "; ".join(
                       f"{r['host']} {r['name']}: {r['no_energy_windows']} of {r['windows']}" for r in none))
    # A window written before gpu_uuids holds every sampled GPU's energy: high only where its daemon sampled more
    # than one (its set as the samples say it); on one GPU, that GPU's is the serving GPU's, honest, unsaid.
    every = [r for r in rows if r["all_gpus_windows"]]
    if every:
        out.append("tag windows written before gpu_uuids whose daemon sampled several GPUs hold every sampled GPU's "
                   "energy, a GPU serving none of the proxied work included (a newer daemon's hold the serving GPUs' "
                   "alone, its energy_note says where not yet judged): counted in their tag's energy and J/token, which "
                   "read high by any such GPU's: "
                   + "; ".join(f"{r['host']} {r['name']}: {r['all_gpus_windows']} of {r['counted_windows']} counted"
                               for r in every) + "; the fix: daemon.gpus of the server's GPUs alone, or compare windows "
                   "of one daemon version")
    maybe = [r for r in rows if r["maybe_all_gpus_windows"]]
    if maybe:
        out.append("tag windows written before gpu_uuids whose daemon's GPU set is unknown (no samples of it among the "
                   "sources, or unreadable) hold every GPU it sampled's energy: had it sampled a GPU serving none of the "
                   "proxied work, their tag's energy and J/token may read high by that GPU's; on one GPU, nothing is: "
                   + "; ".join(f"{r['host']} {r['name']}: {r['maybe_all_gpus_windows']} of {r['counted_windows']} "
                               "counted" for r in maybe)
                   + "; the fix: give the daemon's samples too (its data folder whole)")
    spans = [r for r in rows if r["invalid_interval_windows"]]
    if spans:
        out.append("tag windows over an interval left out of the host's figures (its GPU energy NaN, negative, or more "
                   f"than {MAX_HOST_GPU_POWER_W / 1000:g} kW over its duration: a window's energy sums its intervals') "
                   "were left out of their tag's figures: " + "; ".join(
                       f"{r['host']} {r['name']}: {r['invalid_interval_windows']} of {r['windows']}" for r in spans)
                   + "; the fix is the interval's (the host's note says how many)")
    bad = [r for r in rows if r["invalid_windows"]]
    if bad:
        out.append("tag windows whose energy or tokens are NaN, infinite or negative were left out: " + "; ".join(
            f"{r['host']} {r['name']}: {r['invalid_windows']}" for r in bad))
    dup = [r for r in rows if r["duplicate_windows"]]
    if dup:
        out.append(f"tag rows found more than once were counted once ({WHY}): " + "; ".join(
            f"{r['host']} {r['name']}: {r['duplicate_windows']}" for r in dup))
    return out


def render_tags(t: pa.Table) -> str:
    """A plain-text table of the per-tag figures: '-' where no window of the tag could be counted. `GPU J` is every GPU
    joule of the counted windows, `bypass J` the part bypass traffic used; J/token is the rest over the tokens."""
    rows = t.to_pylist()
    w = max([20] + [len(r["host"]) for r in rows])
    n = max([12] + [len(r["name"]) for r in rows])
    lines = [f"{'host':{w}s} {'tag':{n}s} {'windows':>8s} {'counted':>8s} {'GPU J':>11s} {'bypass J':>11s} "
             f"{'tokens':>10s} {'J/token':>8s}"]
    for r in rows:
        jpt = r["gpu_j_per_token"]
        counted = r["counted_windows"] > 0
        lines.append(f"{r['host']:{w}s} {r['name']:{n}s} {r['windows']:8d} {r['counted_windows']:8d} "
                     + (f"{r['gpu_energy_j'] or 0.0:11.1f} {r['unproxied_energy_j'] or 0.0:11.1f} "
                        f"{r['proxy_tokens'] or 0.0:10.0f} " if counted else f"{'-':>11s} {'-':>11s} {'-':>10s} ")
                     + f"{'-' if jpt is None else f'{jpt:.3f}':>8s}")
    return "\n".join(lines)


def notes(t: pa.Table) -> list[str]:
    """What the reader of the summary must know: rows read twice and counted once, rows left out, hosts named by folder."""
    out = _samples_note(t)
    # Either table's rows mark a host simulated: one synced without its intervals/ is no real host.
    sim = [r for r in t.to_pylist() if r.get("simulated_intervals") or r.get("simulated_requests")]
    if sim:
        real = t.num_rows > len(sim)
        out.append("figures from powerprof's simulated GPU (`daemon --simulate`), not hardware's (hosts marked (sim)): "
                   + "; ".join(f"{r['host']}: {r['simulated_intervals']} intervals, {r.get('simulated_requests') or 0} "
                               "requests" for r in sim)
                   + ("; the `all` line adds them to real hosts' figures: analyse the real hosts' folders alone"
                      if real else ""))
    # A host with one table's rows and not the other's (a partial sync, a folder copied in part): the other's figures
    # are unknown, printed `-`, never 0.
    no_iv = [r["host"] for r in t.to_pylist() if r["t_first_utc"] is None]
    if no_iv:
        out.append("no interval rows: " + ", ".join(no_iv) + ": GPU energy, idle share and hours unknown (`-`), and "
                   "the `all` line's with them; its requests' own J/token stands. The fix: copy the host's intervals/ "
                   "folder too (a partial sync), or wait for the daemon's flush")
    no_rq = [r["host"] for r in t.to_pylist() if r["requests"] is None]
    if no_rq:
        out.append("no request rows: " + ", ".join(no_rq) + ": requests and tokens unknown (`-`), and the `all` "
                   "line's with them. The fix: copy the host's requests/ folder too (a partial sync), or wait for the "
                   "daemon's flush")
    unsent = [r for r in t.to_pylist() if r.get("not_forwarded_requests")]
    if unsent:
        out.append("requests the proxy answered before forwarding them (a 408 for a body too slow, a client gone "
                   "mid-body, a proxy_error: the server never saw them) are in `requests` and `failed_requests`, in no "
                   "energy figure: " + "; ".join(f"{r['host']}: {r['not_forwarded_requests']}" for r in unsent)
                   + "; each row's error says what happened and the fix")
    dup = [r for r in t.to_pylist() if r["duplicate_requests"] or r["duplicate_intervals"]]
    if dup:
        out.append("rows found more than once were counted once (the same daemon_id and request_id, or interval "
                   f"start: {WHY}): " + "; ".join(f"{r['host']}: {r['duplicate_requests']} requests, "
                                                       f"{r['duplicate_intervals']} intervals" for r in dup))
    bad = [r for r in t.to_pylist() if r["invalid_requests"] or r["invalid_intervals"]]
    if bad:
        out.append("rows whose energy or tokens are NaN, infinite or negative, and intervals whose GPU energy is more "
                   f"than {MAX_HOST_GPU_POWER_W / 1000:g} kW over their duration (no host's GPUs draw it: "
                   "MAX_HOST_GPU_POWER_W), were left out of the sums (no energy or token count can be; a counter read "
                   "across a driver reload or an edited file): " + "; ".join(
                       f"{r['host']}: {r['invalid_requests']} requests, {r['invalid_intervals']} intervals" for r in bad))
    spans = [r for r in t.to_pylist() if r.get("invalid_interval_requests")]
    if spans:
        out.append("requests live in an interval left out (above: their share of its energy is no measurement, "
                   "though finite) were left out of J/token, their tokens with them: " + "; ".join(
                       f"{r['host']}: {r['invalid_interval_requests']}" for r in spans) + "; matched by wall-clock "
                   "time on the same host, edges included; the fix is the interval's: find why its energy is what it "
                   "is (a driver reload, an edited file) and remove the file or the row that is wrong")
    unsure = [r for r in t.to_pylist() if r.get("uncertain_requests")]
    if unsure:
        out.append(f"requests marked {NO_COUNTER_SHORT_FLAG} (short, on a GPU without an energy counter: their energy "
                   f"rests on the idle power taken out) or {BEFORE_FIRST_READ_FLAG} (live before the daemon's first GPU "
                   f"read: their energy before it was not counted) or {SERVER_GPU_UNSAMPLED_FLAG} (given energy while "
                   "the server also ran on a GPU the daemon did not sample: that GPU's energy is in none of theirs) or "
                   f"{UNSURE_FLAG} (their figure may be high or low and nothing measured says which: a run-on a scrape "
                   "that found the server down may have cut, nearly all of it too much if it did; or one placed to "
                   "SGLang's abort whose answer may have ended by itself sooner, its figure then high; or a whole answer of "
                   "n_cmpl beside n that never showed which its server ran, costed at n) were "
                   f"left out of J/token (those also marked {BYPASS_LOW_FLAG} are counted in its line, not here): " + "; ".join(
                       f"{r['host']}: {r['uncertain_requests']}" for r in unsure) + f"; the fix: for {NO_COUNTER_SHORT_FLAG}, {NO_COUNTER_SHORT_FIX}; for {BEFORE_FIRST_READ_FLAG}, "
                       "none for those rows (later requests are measured whole): the daemon's log says why its start's "
                       f"GPU read failed; for {SERVER_GPU_UNSAMPLED_FLAG}, add the GPU the row names to daemon.gpus; "
                       f"for {UNSURE_FLAG}, the fix its energy_note names")
    blind = [r for r in t.to_pylist() if r.get("unknown_energy_requests")]
    if blind:
        out.append("requests whose GPU energy is unknown (gpu_energy_j empty: a GPU gave no energy reading over them, "
                   "their energy_note says which; or attributed_tokens empty) were left out of J/token, their tokens "
                   "with no energy beside them: " + "; ".join(f"{r['host']}: {r['unknown_energy_requests']}" for r in blind)
                   + "; the fix: powerprof devices, nvidia-smi -q on those hosts (the samples' error column says why the "
                   "reads failed)")
    low = [r for r in t.to_pylist() if r.get("bypass_uncertain_intervals")]
    if low:
        out.append("intervals whose server token count may be low (their server_count: bypass traffic there is not in "
                   "unproxied, its energy with the requests or idle) are in the GPU and idle figures as stored, their "
                   f"requests out of J/token ({BYPASS_LOW_FLAG}, below): " + "; ".join(
                       f"{r['host']}: {r['bypass_uncertain_intervals']} intervals, "
                       f"{(r['bypass_uncertain_gpu_energy_j'] or 0.0) / 3.6e6:.6f} kWh ({r['bypass_uncertain_reasons']})"
                       for r in low) + "; the fix: " + bypass_count_fix(",".join(r["bypass_uncertain_reasons"] or ""
                                                                                 for r in low))
                   + " (docs/daemon.md, Which rows may be low)")
    low_r = [r for r in t.to_pylist() if r.get("bypass_uncertain_requests")]
    if low_r:
        out.append(f"requests marked {BYPASS_LOW_FLAG} (given energy of intervals whose server token count may be low: "
                   "bypass traffic's energy may be in theirs) were left out of J/token: " + "; ".join(
                       f"{r['host']}: {r['bypass_uncertain_requests']}" for r in low_r) + "; each row's energy_note says "
                   "why and the fix")
    blind = [r for r in t.to_pylist() if r.get("bypass_unmeasured_intervals")]
    if blind:
        # Trusted by the rule the daemon flags requests by (schema.bypass_count_low): their requests stay in J/token.
        out.append("intervals whose bypass traffic was not measured, or in part (server_count off: the daemon scrapes "
                   "no server; slots_only: a llama-server without /metrics, whose /slots miss each request's last "
                   "tokens) keep their requests in J/token, as the daemon's own J/token does: any requests sent "
                   "straight to the server put their energy there, and the J/token reads high: " + "; ".join(
                       f"{r['host']}: {r['bypass_unmeasured_intervals']} intervals, "
                       f"{(r['bypass_unmeasured_gpu_energy_j'] or 0.0) / 3.6e6:.6f} kWh ({r['bypass_unmeasured_reasons']})"
                       for r in blind) + "; the fix: " + bypass_count_fix(",".join(r["bypass_unmeasured_reasons"] or ""
                                                                                   for r in blind))
                   + " (docs/daemon.md, Bypass traffic)")
    unknown = [r for r in t.to_pylist() if r.get("bypass_unknown_intervals")]
    if unknown:
        out.append("intervals with no server token count (server_count unread: the server not read yet; empty: written "
                   "before the column) have bypass traffic unknown, none of it in unproxied, their requests out of "
                   f"J/token ({BYPASS_LOW_FLAG}, where the daemon wrote the flag): "
                   + "; ".join(f"{r['host']}: {r['bypass_unknown_intervals']}" for r in unknown))
    twice = [r for r in t.to_pylist() if r.get("double_counted_intervals")]
    if twice:
        out.append("double counting: intervals of two daemons on one host over the same time, on a GPU both sampled, "
                   "each hold that GPU's whole energy, so the "
                   "GPU kWh, hours and J/token of these rows count it twice (each daemon's requests were given all of "
                   "it): " + "; ".join(f"{r['host']}: {r['double_counted_intervals']} intervals, "
                                       f"{(r['double_counted_gpu_energy_j'] or 0.0) / 3.6e6:.6f} kWh (daemons "
                                       f"{r['double_counted_daemons']})" for r in twice)
                   + "; the fix: one daemon per GPU (daemon.gpus disjoint), and analyse each daemon's folder alone")
    may = [r for r in t.to_pylist() if r.get("maybe_double_counted_intervals")]
    if may:
        out.append("may count a GPU twice: intervals of two daemons on one host over the same time whose GPU sets are "
                   "unknown (rows written before gpu_uuids, without those daemons' samples among the sources to read "
                   "them from): had both sampled one GPU, each holds its whole energy and these rows count it twice; "
                   "on GPUs of their own, nothing is: " + "; ".join(
                       f"{r['host']}: {r['maybe_double_counted_intervals']} intervals, "
                       f"{(r['maybe_double_counted_gpu_energy_j'] or 0.0) / 3.6e6:.6f} kWh" for r in may)
                   + "; the fix: give the daemons' samples too (their data folders whole), or analyse each daemon's "
                   "folder alone")
    machines: dict[str, list[str]] = {}
    for r in t.to_pylist():
        machines.setdefault(re.sub(r" \[[^]]*\]$", "", r["host"]), []).append(r["host"])
    # A row without a set (rows written before gpu_uuids, none read from samples) is no different set: the
    # unknown-set note says it.
    split = {m: [h for h in hs if h != m] for m, hs in machines.items()}
    split = {m: hs for m, hs in split.items() if len(hs) > 1}
    if split:
        out.append("hosts whose daemons sampled different GPU sets (daemon.gpus, the rows' gpu_uuids) are a row per "
                   "set, never one blend of their J/token: " + "; ".join(", ".join(hs) for hs in split.values())
                   + "; the `all` line adds them")
    unset = [r for r in t.to_pylist() if r.get("gpu_set_unknown_intervals")]
    if unset:
        out.append("rows written before gpu_uuids do not say which GPUs their daemon sampled (their GPU set unknown): "
                   "a host's rows from daemons on different GPUs are summed as one there, and two daemons' at once "
                   "cannot be told apart by GPU: " + "; ".join(f"{r['host']}: {r['gpu_set_unknown_intervals']} "
                                                               "intervals" for r in unset)
                   + "; a newer daemon writes the column")
    unknown = [r["host"] for r in t.to_pylist() if r["host"].startswith("(unknown) ")]
    if unknown:
        out.append(f"{len(unknown)} dataset(s) were written before rows carried their host; each is named by its "
                   "folder")
    return out


# `idle %` is idle_gpu_energy_j / gpu_energy_j: the intervals of kind idle, whole (docs/fleet.md, "The idle share").
IDLE_LEGEND = ("idle %: the GPU energy of intervals with nothing live (kind idle), whole; the",
               "intervals' idle_energy_j summed adds the idle time in busy ones (docs/fleet.md)")


def render_summary(t: pa.Table) -> str:
    """A plain-text table of the per-host summary, then the fleet's totals. `idle %`: IDLE_LEGEND, printed below it.
    `J/tok on`: the share of the tokens whose requests the J/token rests on (649 requests and 55216 tokens beside a
    J/token of 60 of them read as theirs)."""
    rows = t.to_pylist()
    w = max([20] + [len(r["host"]) for r in rows])  # a host cut short could read as another

    def on(att, tok):
        pct = 100 * att / tok if tok else None
        # Never "100%" for a share with requests left out, nor "0%" for one with some in (rounded, 99.6% read 100%).
        return "-" if pct is None else "100%" if att >= tok else ">99%" if pct > 99 else "<1%" if pct < 1 \
            else f"{pct:.0f}%"

    lines = [f"{'host':{w}s} {'requests':>9s} {'tokens':>11s} {'GPU kWh':>9s} {'idle %':>7s} {'J/tok on':>8s} "
             f"{'J/token':>8s}"]
    tot_e = tot_idle = tot_att = tot_att_tok = 0.0
    tot_tok = tot_req = 0
    # A figure a host has no rows for (its intervals/ or requests/ not synced: null) is unknown: `-`, here and in the
    # `all` line, where the others' sum alone would pass for the fleet's (notes() says which host and the fix).
    no_e = no_tok = no_req = False
    short = False

    def num(v, fmt: str, width: int) -> str:
        return f"{'-':>{width}s}" if v is None else f"{v:{width}{fmt}}"

    for r in rows:
        e, idle = r["gpu_energy_j"], r["idle_gpu_energy_j"] or 0.0
        jpt = r["gpu_j_per_token"]
        att_tok, tok = r["attributed_tokens"] or 0.0, r["generated_tokens"]
        short = short or (jpt is not None and att_tok < (tok or 0))
        idle_pct = 100 * idle / e if e else None
        lines.append(f"{r['host']:{w}s} {num(r['requests'], 'd', 9)} {num(tok, 'd', 11)} "
                     f"{num(None if e is None else e / 3.6e6, '.3f', 9)} {num(idle_pct, '.1f', 7)} "
                     f"{on(att_tok, tok or 0) if jpt is not None else '-':>8s} "
                     f"{'-' if jpt is None else f'{jpt:.3f}':>8s}")
        no_e, no_tok, no_req = no_e or e is None, no_tok or tok is None, no_req or r["requests"] is None
        tot_e, tot_idle = tot_e + (e or 0.0), tot_idle + idle
        tot_tok, tot_req = tot_tok + (tok or 0), tot_req + (r["requests"] or 0)
        tot_att += r["attributed_gpu_energy_j"] or 0.0
        tot_att_tok += att_tok
    jpt = f"{tot_att / tot_att_tok:.3f}" if tot_att_tok else "-"
    # A host's rows of several GPU sets are a row each ("vm [GPU-…]"): the machines are the labels without the set.
    hosts = {re.sub(r" \[[^\]]*\]$", "", r["host"]) for r in rows}
    # A row without a set (written before gpu_uuids, none read from samples) is no set of its own: said apart.
    unset = sum(1 for r in rows if re.sub(r" \[[^\]]*\]$", "", r["host"]) == r["host"])
    n_sets = len(rows) - unset
    every = f"all {len(hosts)} host" + ("s" if len(hosts) != 1 else "") + (
        (f" ({n_sets} GPU set" + ("s" if n_sets != 1 else "") + (f", {unset} unknown" if unset else "") + ")")
        if len(rows) > len(hosts) else "")
    lines.append(f"{every:{w}s} {num(None if no_req else tot_req, 'd', 9)} {num(None if no_tok else tot_tok, 'd', 11)} "
                 f"{num(None if no_e else tot_e / 3.6e6, '.3f', 9)} "
                 f"{num(None if no_e or not tot_e else 100 * tot_idle / tot_e, '.1f', 7)} "
                 f"{on(tot_att_tok, tot_tok) if tot_att_tok and not no_tok else '-':>8s} {jpt:>8s}")
    # Which idle figure `idle %` is, where it is read: beside the intervals' idle_energy_j summed (3.45% against 3.3%)
    # nothing said which it was. IDLE_LEGEND keeps to 80 columns, as the table does.
    lines.extend(IDLE_LEGEND)
    if short:
        lines.append("J/tok on: the share of the tokens whose requests the J/token rests on; the others' requests are "
                     "left out of it, the notes below say why")
    return "\n".join(lines)
