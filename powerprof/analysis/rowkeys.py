"""What makes a daemon or tuner row one event: the key by which `analyze` counts and `export` writes a row read twice once.

A daemon process numbers its requests and samples, and its intervals, tags and cost fits start at distinct
monotonic or wall-clock times; every row carries its process's `daemon_id`. The same key twice is the same
row read twice: a copy of a node's folder among the sources, or flush files beside the file compaction
merged them into, as `aws s3 sync` without --delete leaves them. A tuner process numbers its decisions
(`seq`) and every row carries its `tuner_id`.
"""

from __future__ import annotations

# Daemon dataset (folder) name → the columns that identify one of its rows.
KEYS = {
    "requests": ("daemon_id", "request_id"),
    "intervals": ("daemon_id", "t_start_mono_s", "t_start_utc"),
    "tags": ("daemon_id", "name", "t_start_utc"),
    "costs": ("daemon_id", "time_utc", "power_limits_w"),
    "samples": ("daemon_id", "source", "device", "seq", "t_mono_s"),
}

# A tuner's decisions (`powerprof tune --out`) sit in a folder the user names: known by the columns every
# version of the tuner wrote, not by a name. Files written before tuner_id and seq have no key.
TUNER_COLUMNS = ("action", "knob", "from_level", "to_level", "applied", "gpus")
TUNER_KEY = ("tuner_id", "seq")

# Why a key can be found twice, for the notes that say rows were counted or written once.
WHY = ("a copy of a node's folder among the sources, or a synced copy that kept the flush files compaction "
       "merged")
TUNER_WHY = "a copy of the tuner's folder among the sources, or a copied file in it"


def is_tuner_decisions(columns) -> bool:
    return set(TUNER_COLUMNS) <= set(columns)


def key_of(table: str, columns) -> tuple[str, ...] | None:
    """The columns that identify a row of `table` (a daemon dataset by its name, a tuner's decisions by their
    columns); None for any other table, or files written before the key's columns were."""
    key = KEYS.get(table) or (TUNER_KEY if is_tuner_decisions(columns) else None)
    return key if key and set(key) <= set(columns) else None


def ident(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def keyless_sql(key: tuple[str, ...]) -> str:
    """SQL: the row has no key (no daemon, or no place within it): every such row is its own, never a copy."""
    return (f"({ident(key[0])} IS NULL OR (" + " AND ".join(f"{ident(c)} IS NULL" for c in key[1:]) + "))")


def folder_sql(table: str, filename: str = "filename") -> str:
    """SQL: the dataset folder of a file of `table`: minus the file, a date= folder, and the table's own folder."""
    return (f"regexp_replace(regexp_replace({filename}, '/(date=[^/]*/)?[^/]*$', ''), "
            f"'^(.*)/{table}(/.*)?$', '\\1\\2')")
