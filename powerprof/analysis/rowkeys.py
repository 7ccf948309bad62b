"""What makes a daemon row one event: the key by which `analyze` counts and `export` writes a row read twice once.

A daemon process numbers its requests and samples, and its intervals, tags and cost fits start at distinct
monotonic or wall-clock times; every row carries its process's `daemon_id`. The same key twice is the same
row read twice: a copy of a node's folder among the sources, or flush files beside the file compaction
merged them into, as `aws s3 sync` without --delete leaves them.
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

# Why a key can be found twice, for the notes that say rows were counted or written once.
WHY = ("a copy of a node's folder among the sources, or a synced copy that kept the flush files compaction "
       "merged")


def ident(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def keyless_sql(key: tuple[str, ...]) -> str:
    """SQL: the row has no key (no daemon, or no place within it): every such row is its own, never a copy."""
    return (f"({ident(key[0])} IS NULL OR (" + " AND ".join(f"{ident(c)} IS NULL" for c in key[1:]) + "))")


def folder_sql(table: str, filename: str = "filename") -> str:
    """SQL: the dataset folder of a file of `table`: minus the file, a date= folder, and the table's own folder."""
    return (f"regexp_replace(regexp_replace({filename}, '/(date=[^/]*/)?[^/]*$', ''), "
            f"'^(.*)/{table}(/.*)?$', '\\1\\2')")
