"""Atomic file replacement: write a temporary in the same folder, fsync, rename over the target, fsync the folder.

A reader, or the file system after a crash, sees the old file or the new one, whole, never half.
Temporaries are dot-prefixed and end in `.tmp`, so `*.parquet`/`restore-*.json` globs and
hive-partition readers (pyarrow, DuckDB, Spark) skip them.
"""

from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or unlink in `path` durable. A folder that cannot be opened is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        # The rename has already happened; failing now would tell the caller its write was lost.
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, tmp_name: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `path` for the caller to write by any means.

    On a clean exit the temporary is fsynced, renamed over `path` and the folder fsynced; on an
    exception it is removed and `path` is left as it was. `tmp_name` fixes the temporary's name
    (a caller whose recovery looks for it); by default it is `.<name>.<pid>.<random>.tmp`.
    """
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
