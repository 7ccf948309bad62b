"""A sweep's run directory: Parquet tables and run.json, each replaced atomically as levels finish."""

from __future__ import annotations

import errno
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from powerprof.errtext import error_text

from .atomic import atomic_path, atomic_write_bytes
from .schema import TABLES, rows_to_table

from powerprof.paths import (OUTPUT_DEPTH_BYTES, RUN_JSON, cwd_gone, cwd_joined, file_in_the_way, path_max_problem,
                             path_problem, what_is)


def atomic_write_table(path: Path, table: pa.Table, metadata: dict | None = None) -> None:
    """Write a Parquet file so that a reader (or a crash) sees the old file or the new, never half."""
    with atomic_path(path) as tmp:
        write_table(tmp, table, metadata)


def write_table(path: Path, table: pa.Table, metadata: dict | None = None) -> None:
    """A Parquet file with `metadata` added to the table's key-value metadata (not atomic: a temporary's writer)."""
    if metadata:
        meta = dict(table.schema.metadata or {})
        meta.update({k.encode(): (v if isinstance(v, str) else json.dumps(v)).encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(meta)
    pq.write_table(table, path, compression="zstd")


def table_from_rows(name: str, rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by column name; missing keys are null) → a table of the named schema."""
    return rows_to_table(TABLES[name], rows)


def split_storable(name: str, rows: list[dict]) -> tuple[list[dict], list[dict], str | None]:
    """(rows that fit the named schema, rows that do not, the first error): one bad value must not take the
    whole table, and every finished level in it, down with it."""
    try:
        table_from_rows(name, rows)
        return rows, [], None
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        err = error_text(e)[:300]
    good, bad = [], []
    for r in rows:
        try:
            table_from_rows(name, [r])
            good.append(r)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            bad.append(r)
    return good, bad, err


def no_finished_level(path, what: str | None = "analyse") -> str | None:
    """What to say of a sweep's run directory where no level finished (killed, or Ctrl-C, before its
    first level ended): it is a run, only an empty one, so "not a run directory" would mislead.
    `what` the command could not do ("analyse", "export"), with the fix; None: the fact alone. None when it is not a sweep's run.json,
    or a level did finish."""
    p = Path(path)
    try:
        meta = json.loads((p / RUN_JSON).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return None
    if not isinstance(meta, dict) or meta.get("kind") != "sweep":
        return None
    done = meta.get("levels_done")
    if done or (done is None and (p / "windows.parquet").exists()):
        return None  # a level finished, or a run written before levels_done whose windows are there
    if meta.get("configs") and (p / "levels.parquet").exists():
        return None  # a configuration sweep whose servers never got to a level: its configs' outcomes are the report
    if meta.get("started_utc"):
        when = f"started {meta['started_utc']}"
    else:  # older runs: no start time kept; run.json is rewritten until the sweep stops
        mtime = datetime.fromtimestamp((p / RUN_JSON).stat().st_mtime, timezone.utc)
        when = "run.json last written " + mtime.strftime("%Y-%m-%d %H:%M:%S UTC")
    fact = f"{p}: a powerprof run with no finished level (stopped before its first level ended; {when})"
    if what is None:
        return fact
    was = meta.get("command_line")
    return (f"{fact}: nothing to {what}. Rerun the sweep with another --out (or after removing this directory)"
            + (f"; it was: {was}" if was else ""))


def write_failure(e: OSError) -> str:
    """Why a run's file could not be written, in the system's words (`No space left on device`): pyarrow's own
    message wraps them in its buffer's details."""
    return os.strerror(e.errno) if e.errno else error_text(e)


WRITE_FIX = "free space on that disk (or give another --out) and rerun"
OTHER_WRITE_FIX = "remove that cause (or give another --out) and rerun"


def write_fix(e: OSError) -> str:
    """The fix for a run's failed write: free space where the disk is full or over quota, else the cause itself
    (told as a full disk, a folder made read-only or a bad mount sent the user to `df` for nothing)."""
    return WRITE_FIX if e.errno in (errno.ENOSPC, errno.EDQUOT) else OTHER_WRITE_FIX
GONE_FIX = "leave the run folder in place while a sweep runs, and rerun"


def run_folder_gone(path) -> str | None:
    """Why a run's folder holds nothing any more, where it was removed (or replaced by a file) while the run went on;
    None while it is a folder. A failed write there is no full disk, and no level of it is kept."""
    if os.path.isdir(path):
        return None
    if not os.path.lexists(path):
        return f"the run folder {path} is gone (removed while the sweep ran)"
    return f"the run folder {path} is no longer a folder (removed or replaced while the sweep ran)"


def given_out_problem(out: Path, flag: str = "--out", default: bool = False) -> str | None:
    """Why a folder the user named is not made: inside a daemon dataset or a powerprof run, or its parent is missing (a
    typo made a tree of folders from /, root's `sweep --out /nonexistent/dir/out` among them). None where it may be
    made. `default`: the default run folder (`runs/<stamp>`), whose parent is made as needed: only the first two."""
    from powerprof.paths import daemon_dataset_above, run_folder_above  # noqa: PLC0415

    said = f"the default run folder {out}" if default else f"{flag} {out}"
    if (why := cwd_gone(out, "the default run folder" if default else flag)) is not None:  # before abspath's getcwd()
        return why.replace("an absolute path", f"an absolute {flag}") if default else why
    if default and (why := path_max_problem(out, OUTPUT_DEPTH_BYTES)) is not None:  # `runs/<stamp>` in a deep folder
        return f"{said}: {why}; or give --out"
    if (above := daemon_dataset_above(out)) is not None:
        # `sweep --out NODE/requests/r1`: the run's tables were read by `analyze NODE` as request rows, unsaid.
        return (f"{said} is inside the daemon dataset {above}: the run's tables there would be read as its rows, "
                f"or as one more table of it; give a folder outside it with {flag}")
    if (above := run_folder_above(out)) is not None:
        # `sweep --out RUN/levels`, `--out RUN/analysis/x` were taken: a run inside another's folder, copied, moved and
        # removed with it, and in RUN/analysis among the report `analyze RUN` writes there. `cd RUN && powerprof
        # sweep` the same, in RUN/runs/<stamp>.
        return (f"{said} is inside the powerprof run {above}: a run there is copied, moved and removed with that "
                f"run, and taken for part of it; give a folder outside it with {flag} (beside it: {above.parent})")
    return None if default else missing_parent(out, flag)


def missing_parent(out, flag: str = "--out", below: int = OUTPUT_DEPTH_BYTES) -> str | None:
    """Why the output `out` the user named (a folder or a file) is not made: its parent folder does not exist, or its path
    with the `below` bytes written beyond it (a folder's files, a file's temporary name: paths.TEMP_NAME_BYTES) is past
    PATH_MAX (`path_max_problem`). Every
    command's --out makes the folder (or file) it names, never the folders above it (`mkdir -p` of a mistyped path
    made a tree of folders, from / as root). None where `out` or its parent folder exists. A parent, or the folder
    above it, that exists as no folder (a file, a link to nothing) is refused naming it: a fleet analyze's write ended
    in a NotADirectoryError or FileNotFoundError traceback, analyze's error said "No such file or directory"."""
    if (why := cwd_gone(out, flag)) is not None:
        return why
    if (why := path_problem(out) or path_max_problem(out, below)) is not None:  # else the write's failure
        return f"{flag} {out}: {why}"
    parent = cwd_joined(out).parent
    if os.path.lexists(out):
        return None
    if (q := file_in_the_way(parent)) is not None:
        return (f"{flag} {out}: {str(q)!r} is {what_is(q)}, not a folder, so nothing can be made under it. Fix: give "
                "a path under a folder, or move it aside")
    if os.path.lexists(parent):
        return None
    return (f"{flag} {out}: its parent folder {parent} does not exist; not making a tree of folders from a path that may "
            f"be mistyped. Fix: correct the path, or make that folder first (mkdir -p {parent})")


def default_run_dir(base: Path, gpu_label: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in gpu_label).strip("-") or "gpu"
    return base / f"{stamp}-{safe}"


MAX_CLAIMS = 1000  # -2 … -1000: more runs of one name in one second is no clash but a loop gone wrong


def claim_run_dir(path: Path) -> Path:
    """Make a default run folder (`default_run_dir`, never a name the user gave): `path`, or `path-2`, `path-3` …
    where it is taken. Each name is claimed by os.mkdir, which fails on a name that exists, so two runs started in
    the same second (the names' resolution) never share a folder, nor does the second fail "already exists" (it did,
    the check and the mkdir a moment apart). Its parent (runs/) is made as needed. Returns the folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, MAX_CLAIMS + 1):
        p = path if k == 1 else path.with_name(f"{path.name}-{k}")
        try:
            os.mkdir(p)
        except FileExistsError:
            continue
        return p
    raise FileExistsError(f"run directories {path} to {path.name}-{MAX_CLAIMS} all exist; give --out")


class RunWriter:
    """Owns one run directory. Every write replaces a whole file atomically."""

    def __init__(self, path: Path, metadata: dict):
        self.path = Path(path)
        if self.path.exists() and any(self.path.iterdir()):
            raise FileExistsError(f"run directory {self.path} already exists and is not empty; choose another --out")
        self.path.mkdir(parents=True, exist_ok=True)
        self.metadata = dict(metadata)
        self.write_json()

    def write_json(self, **extra) -> None:
        meta = {**self.metadata, **extra}
        atomic_write_bytes(self.path / RUN_JSON, json.dumps(meta, indent=2, default=str).encode())
        self.metadata = meta  # only once written: what a stopped sweep says it kept (levels_done) is what the file holds

    def write(self, name: str, table: pa.Table, coming: dict | None = None) -> Path:
        """The table, its footer carrying run.json as it is, with `coming`: what the caller writes into run.json once
        its tables are written (levels_done), so a footer never says less than its own rows (killed between the two,
        a footer one flush behind read as a level interrupted that had finished, when run.json was lost)."""
        path = self.path / f"{name}.parquet"
        atomic_write_table(path, table, {"powerprof": {**self.metadata, **(coming or {})}})
        return path
