"""What makes a daemon, tuner or sweep row one event: the key by which `analyze` counts and `export` writes a row read twice once.

A daemon process numbers its requests and samples, and its intervals, tags and cost fits start at distinct
monotonic or wall-clock times; every row carries its process's `daemon_id`. The same key twice is the same
row read twice: a copy of a node's folder among the sources, or flush files beside the file compaction
merged them into, as `aws s3 sync` without --delete leaves them. A tuner process numbers its decisions
(`seq`) and every row carries its `tuner_id`. A sweep's (or measure's) window is one attempt of one request, or
one batch or trace replay, at one level and repeat of one run, at its times (workload/rows.py); a levels row is
one level of one series (concurrency) of one configuration of one run (analysis/stats.py levels_table). A sweep's
sample is one reading of one device (`source`, `device`) at one tick (`seq`; -1 for every on-demand sample at a
window edge, told apart by `t_mono_s`); samples.parquet has no run_id and `t_mono_s` restarts at each run, so
`time_utc` keeps two runs' readings apart.
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

# windows.parquet, known by its columns (a copy may be named anything): a row equal to another on all of these
# is the same window stored twice. Older files lack some (attempt, times): the key is the columns a file has,
# provided one names the window (request_id or t_first_utc); else no two rows can be told to be one.
WINDOW_COLUMNS = ("run_id", "level_kind", "window_kind")
WINDOW_KEY = ("run_id", "level_kind", "level_value", "repeat", "window_kind", "request_id", "batch_id", "attempt",
              "t_send_utc", "t_first_utc", "t_last_utc")
WINDOW_NAMES = ("request_id", "t_first_utc")
# levels.parquet, known by its name (analysis.parquet has the same columns and more, one row per pooled level):
# the key is the columns a file has of LEVEL_KEY, provided the first three are there.
LEVEL_KEY = ("run_id", "level_kind", "level_value", "concurrency", "config_id", "context_tokens")
LEVEL_REQUIRED = LEVEL_KEY[:3]
# A sweep run's samples.parquet (no daemon_id), known by its name; older files without one of these have no key.
SWEEP_SAMPLES_KEY = ("time_utc", "source", "device", "seq", "t_mono_s")

# Why a key can be found twice, for the notes that say rows were counted or written once.
WHY = ("a copy of a node's folder among the sources, or a synced copy that kept the flush files compaction "
       "merged")
TUNER_WHY = "a copy of the tuner's folder among the sources, or a copied file in it"
SWEEP_WHY = ("a file concatenated with a copy of itself, written twice, or a copy of the run whose files differ "
             "among the sources")


def is_tuner_decisions(columns) -> bool:
    return set(TUNER_COLUMNS) <= set(columns)


def is_windows(columns) -> bool:
    return set(WINDOW_COLUMNS) <= set(columns)


def window_key(columns) -> tuple[str, ...] | None:
    """The columns of WINDOW_KEY a windows table has; None where none of them names a window."""
    key = tuple(c for c in WINDOW_KEY if c in set(columns))
    return key if set(WINDOW_NAMES) & set(key) else None


def key_of(table: str, columns) -> tuple[str, ...] | None:
    """The columns that identify a row of `table` (a daemon dataset, levels or samples by its name, a tuner's decisions
    or sweep windows by their columns); None for any other table, or files written before the key's columns were."""
    if table not in KEYS and is_windows(columns):
        return window_key(columns)
    if table == "levels" and set(LEVEL_REQUIRED) <= set(columns):
        return tuple(c for c in LEVEL_KEY if c in set(columns))
    if table == "samples" and "daemon_id" not in set(columns):
        return SWEEP_SAMPLES_KEY if set(SWEEP_SAMPLES_KEY) <= set(columns) else None
    key = KEYS.get(table) or (TUNER_KEY if is_tuner_decisions(columns) else None)
    return key if key and set(key) <= set(columns) else None


def why_of(key: tuple[str, ...]) -> str:
    """How rows of this key come to be found twice, for the note that says they were written once."""
    if key == TUNER_KEY:
        return TUNER_WHY
    return WHY if key in KEYS.values() else SWEEP_WHY


def ident(c: str) -> str:
    return '"' + c.replace('"', '""') + '"'


def keyless_sql(key: tuple[str, ...]) -> str:
    """SQL: the row has no key (no daemon, or no place within it): every such row is its own, never a copy."""
    return (f"({ident(key[0])} IS NULL OR (" + " AND ".join(f"{ident(c)} IS NULL" for c in key[1:]) + "))")


def folder_sql(table: str, filename: str = "filename") -> str:
    """SQL: the dataset folder of a file of `table`: minus the file, a date= folder, and the table's own folder."""
    return (f"regexp_replace(regexp_replace({filename}, '/(date=[^/]*/)?[^/]*$', ''), "
            f"'^(.*)/{table}(/.*)?$', '\\1\\2')")
