"""Which files of a table's folder are its data, and whether their columns have the table's types: one rule for every reader.

`analyze` (DuckDB) and `export` (pyarrow) each chose their files their own way: DuckDB's `**/*.parquet` read `.x.parquet`
and `_x.parquet`, pyarrow's folder scan skipped those but read any other name, so a stray `part-x.parquet.tmp` (a copy
cut short, a file renamed by hand) made `export` fail on it while `analyze` left it out unsaid. Both now take the files
this module lists, and say the strays.
"""

from __future__ import annotations

import os
from pathlib import Path

from .schema import COLUMNS, DAEMON_DATASETS, F64, I32, I64, STR, TS, BOOL

SUFFIX = ".parquet"
# A name starting with one of these is not data and never was: the writers' temporaries (`.part-….parquet.tmp`,
# storage/atomic.py), a sync tool's partial copies (rsync's `.name.XXXXXX`), Spark's and Hive's markers (`_SUCCESS`,
# `_common_metadata`). pyarrow and Spark skip them as well. Left out without a word, in any folder below the table's.
HIDDEN = (".", "_")


def is_data_name(rel: str) -> bool:
    """A path below a table's folder ("date=…/part-….parquet") is one of its data files."""
    parts = rel.replace("\\", "/").split("/")
    return parts[-1].endswith(SUFFIX) and not any(p.startswith(HIDDEN) for p in parts)


def is_stray_name(rel: str) -> bool:
    """Neither data nor hidden (`part-x.parquet.tmp`, `requests.csv`): left out, and said, as it may hold rows."""
    parts = rel.replace("\\", "/").split("/")
    return not parts[-1].endswith(SUFFIX) and not any(p.startswith(HIDDEN) for p in parts)


def split_names(rels) -> tuple[list[str], list[str]]:
    """Relative paths below a table's folder → (data files, strays), each sorted."""
    rels = sorted(rels)
    return [r for r in rels if is_data_name(r)], [r for r in rels if is_stray_name(r)]


def table_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """A local table folder's data files and strays, sorted (none where the folder is not there)."""
    rels = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(HIDDEN)]
        rels.extend(os.path.relpath(os.path.join(root, f), folder) for f in files)
    data, strays = split_names(rels)
    return [folder / r for r in data], [folder / r for r in strays]


def strays_note(strays) -> str | None:
    """What the reader must know of files left out that may hold rows."""
    strays = [str(s) for s in strays]
    if not strays:
        return None
    shown = ", ".join(strays[:4]) + (f" and {len(strays) - 4} more" if len(strays) > 4 else "")
    return (f"{len(strays)} file(s) in the dataset whose name does not end in {SUFFIX} were not read: {shown}; if one "
            f"holds rows (a copy cut short, a file renamed by hand), they are in no figure: give it its {SUFFIX} name "
            "once it is whole, or remove it")


# What a file's column may be stored as for a reader to take it as the schema's type: any width of a number for a
# number (older writers, other tools), any timestamp for a timestamp, null where a file holds no value at all.
_FAMILY = {F64: "number", I64: "number", I32: "number", STR: "string", TS: "timestamp", BOOL: "boolean"}
_DUCK = {F64: "DOUBLE", I64: "BIGINT", I32: "INTEGER", STR: "VARCHAR", TS: "TIMESTAMPTZ", BOOL: "BOOLEAN"}  # the fix's SQL
# Columns whose bits are read (a bitmask): only a whole number's type carries them. Stored as decimals or doubles the
# column passed as "a number", and DuckDB then found no `&` for it: analyze called the file damaged.
WHOLE_NUMBER_COLUMNS = frozenset({"clock_event_reasons"})


def _values_type(arrow_type):
    """The type of a column's values: a categorical column's (pandas' category dtype) are its dictionary's."""
    import pyarrow as pa

    return arrow_type.value_type if pa.types.is_dictionary(arrow_type) else arrow_type


def _family_of(arrow_type) -> str | None:
    import pyarrow as pa

    t = _values_type(arrow_type)
    if pa.types.is_null(t):
        return None  # no value in the file: fits any column
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_timestamp(t):
        return "timestamp"
    if pa.types.is_boolean(t):
        return "boolean"
    return str(t)


def expected_types(table: str) -> dict[str, str] | None:
    """Column → the type powerprof writes it as, for a table it writes (a daemon dataset's folder name or a run's table)."""
    cols = COLUMNS.get(DAEMON_DATASETS.get(table, table))
    return None if cols is None else dict(cols)


def foreign_file_refusal(table: str, f, names) -> str | None:
    """Why file `f` (its column `names`) is no file of `table`, a table powerprof writes: none of its columns is one of
    the table's (another tool's file, or one misplaced). Its rows read as the table's, every column empty: `analyze`
    counted a foreign file's rows in requests/ as requests of a host "(unknown)". None: it has one of them, as every
    version powerprof wrote has (an older file lacks only the newer columns)."""
    expected = expected_types(table)
    if expected is None or not names or any(n in expected for n in names):
        return None
    shown = ", ".join(list(names)[:5]) + (", ..." if len(names) > 5 else "")
    return (f"{f}: none of its columns ({shown}) is a column of {table}: not a powerprof {table} file (another tool's, "
            "or one misplaced), whose rows would be read as the table's with every column empty; move it out of the "
            "dataset folder, and run again")


def type_refusal(table: str, schemas, columns=None) -> str | None:
    """Why a table's files cannot be read together, or None: the first file whose column is stored as another kind of
    value than powerprof writes (gpu_energy_j as text: an edited or foreign file), named with its type, the type
    expected and the fix. For a table powerprof does not write, files that disagree with one another on a column.

    schemas: (file, pa.Schema) pairs; columns: only these (a reader's), default every column of the table."""
    import pyarrow as pa

    expected = expected_types(table)
    seen: dict[str, tuple[str, str, object]] = {}  # column → (family, first file, its type), for a foreign table
    for f, schema in schemas:
        for field in schema:
            if columns is not None and field.name not in columns:
                continue
            fam = _family_of(field.type)
            if fam is None:
                continue
            if expected is not None:
                want = expected.get(field.name)
                kind = None if want is None else _FAMILY[want]
                if field.name in WHOLE_NUMBER_COLUMNS and fam == "number":
                    kind = "a whole number: a bitmask"
                    fam = kind if pa.types.is_integer(_values_type(field.type)) else fam
                if want is not None and fam != kind:
                    return (f"{f}: column {field.name} of {table} is stored as {field.type}, where powerprof writes "
                            f"{want} ({kind}): a file edited or written by another tool, which no figure can "
                            f"be read from; write that column back as {want} in the file (e.g. DuckDB: COPY (SELECT * "
                            f"REPLACE (CAST({field.name} AS {_DUCK[want]}) "
                            f"AS {field.name}) FROM 'FILE') TO 'NEW.parquet'), or move the file out of the dataset "
                            "folder, and run again")
                continue
            first = seen.setdefault(field.name, (fam, str(f), field.type))
            if first[0] != fam:
                return (f"{f}: column {field.name} of {table} is stored as {field.type}, where {first[1]} has it as "
                        f"{first[2]}: one column cannot hold both; write the column as one type in every file, or move "
                        "the file that is wrong out of the folder, and run again")
    return None
