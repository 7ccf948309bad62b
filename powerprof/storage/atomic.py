"""Atomic file replacement: write a temporary in the same folder, fsync, rename over the target, fsync the folder.

A reader, or the file system after a crash, sees the old file or the new one, whole, never half.
`atomic_group` replaces several files that belong together (an analysis' report, tables and plots) so
that an interruption while they are made leaves every one of the old ones.
Temporaries are dot-prefixed and end in `.tmp`, so `*.parquet`/`restore-*.json` globs and
hive-partition readers (pyarrow, DuckDB, Spark) skip them. The link a group keeps of a file's old content while it
renames is dot-prefixed too and ends in `.old` (KEPT_SUFFIX): one left behind (a put-back that failed, GroupMixed; a
kill between the renames) can be the only copy of that old content, which no cleanup of temporaries may take.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from powerprof import termination
from powerprof.paths import temp_sibling


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
def atomic_path(path: str | os.PathLike, tmp_name: str | None = None, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path` for the caller to write by any means.

    On a clean exit the temporary is fsynced, renamed over `path` and the folder fsynced; on an
    exception it is removed and `path` is left as it was. `tmp_name` fixes the temporary's name
    (a caller whose recovery looks for it); by default it is `.<name>.<pid>.<random>.tmp`.
    replace=False: a `path` that exists by the end (made while the caller wrote) is kept and
    FileExistsError raised, the temporary removed.
    """
    path = Path(path)
    tmp = path.with_name(tmp_name) if tmp_name else temp_sibling(path)
    try:
        yield tmp
        _fsync_file(tmp)
        if replace:
            _refuse_special(path)
            os.replace(tmp, path)
        else:
            _rename_no_replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def _refuse_special(path: Path) -> None:
    """FileExistsError where `path` is a FIFO, a device or a socket: never replaced by a file (a caller that checked
    at its start names it; one made there meanwhile is kept as any file made meanwhile is, replace=False)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a regular file (a FIFO, device or socket)", str(path))


def _rename_no_replace(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path` unless `path` exists: a hard link fails on an existing name, where a
    rename replaces it. A file system without hard links gets the check and the rename, a moment apart."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


class _Group:
    """What `atomic_group` yields: `stage(path) -> temporary path`, and `remove(path)`, done with the renames."""

    def __init__(self) -> None:
        self.staged: list[tuple[Path | None, Path]] = []  # (temporary, file); no temporary: the file is removed

    def __call__(self, path: str | os.PathLike) -> Path:
        path = self._once(path)
        self.staged.append((temp_sibling(path), path))
        return self.staged[-1][0]

    def remove(self, path: str | os.PathLike) -> None:
        self.staged.append((None, self._once(path)))

    def _once(self, path: str | os.PathLike) -> Path:
        """ValueError for a file the group already holds: a caller's bug (two plots of one name). Taken, the second
        version won unsaid and a failed rename put back the first, not the old file, its link left behind."""
        path = Path(path)
        if any(p == path for _, p in self.staged):
            raise ValueError(f"{path} staged twice in one atomic_group (a bug: two outputs of one name)")
        return path

    def paths(self) -> set[Path]:
        return {path for tmp, path in self.staged if tmp is not None}


@contextmanager
def atomic_group() -> Iterator[_Group]:
    """Yield `stage(path) -> temporary path` for several files that must change together; `stage.remove(path)` takes
    a file out of the group's folder with them (an old output this one does not replace).

    Every file is written to its temporary first; only when all are written (and fsynced) are they
    renamed into place, one quick pass with SIGINT/SIGTERM/SIGHUP held (the exit is raised after it).
    On an exception before that, or a rename that fails (`_replace_all` puts back those done), every temporary is
    removed and every file is left as it was."""
    group = _Group()
    try:
        yield group
        for tmp, _ in group.staged:
            if tmp is not None:
                _fsync_file(tmp)
    except BaseException:
        for tmp, _ in group.staged:
            _unlink_quietly(tmp)
        raise
    with termination.exits_held() as got:
        _replace_all(group.staged)
        for folder in dict.fromkeys(path.parent for _, path in group.staged):
            fsync_dir(folder)
    if got:
        raise termination.exit_for(got[0])


class GroupMixed(OSError):
    """A group's rename failed part-way and a file could not be put back as well: its folder holds files of two writes.
    `new`, `old`, `missing`: the group's files as they are now (missing: removed, not put back); the message names each,
    and the fix. An old content that could not be put back stays in its link (named), not deleted."""

    def __init__(self, cause: OSError, new: list[Path], old: list[Path], missing: list[Path],
                 kept: dict[Path, Path]):
        self.new, self.old, self.missing, self.kept = new, old, missing, kept
        said = "; ".join(f"{what}: {', '.join(map(str, paths))}" for what, paths in
                         (("new", new), ("old", old), ("missing", missing)) if paths)
        where = ", ".join(str(p) for p in dict.fromkeys(p.parent for p in new + old + missing))
        text = (f"{cause.filename}: {cause.strerror or cause}, and putting the files already replaced back failed too, "
                f"so {where} is now MIXED, the files of two writes side by side ({said})"
                + "".join(f"; the old {path.name} is kept as {link}" for path, link in kept.items())
                + ". Fix: remove the cause of the failure, then write them all again (run the command again); until "
                  "then do not read these files as one")
        super().__init__(cause.errno, text)  # the failed file is in the text: a caller appending .filename said it twice

    def __str__(self) -> str:
        return self.strerror


def _replace_all(staged: list[tuple[Path | None, Path]]) -> None:
    """Rename every temporary over its file, or none: a rename that fails part-way (a folder or FIFO where a file
    goes, EIO, EPERM) puts back the files already replaced, from hard links kept of the old ones, so the group never
    leaves new files beside old ones (a report saying one limit beside an analysis.json saying another).
    Removals come after every rename, put back the same way. The error names the file, not its temporary
    (gone by then). The temporaries and links are removed either way, save the link of an old file that could not be
    put back: then (or where a replaced file had no link: no hard links there) GroupMixed names every file's state,
    whatever the failure was (an exception other than OSError is its cause)."""
    kept: dict[Path, tuple[bool, Path | None]] = {}  # a file renamed → (it existed before, a link to its old content)
    at: Path | None = None  # the file being renamed or removed
    try:
        for _, path in staged:  # what no rename can replace is refused before any is done
            _refuse_special(path)
            if os.path.isdir(path) and not os.path.islink(path):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        for tmp, path in sorted(staged, key=lambda s: s[0] is None):
            at = path
            existed = os.path.lexists(path)
            if tmp is None and not existed:
                continue
            old = _old_link(path) if existed else None
            try:
                if tmp is None:
                    os.unlink(path)
                else:
                    os.replace(tmp, path)
            except OSError as e:
                _unlink_quietly(old)
                raise OSError(e.errno, e.strerror, str(path)) from None
            except BaseException:
                _unlink_quietly(old)
                raise
            kept[path] = (existed, old)
    except BaseException as e:
        stuck = _put_back(kept)
        for tmp, _ in staged:
            _unlink_quietly(tmp)
        if stuck and isinstance(e, OSError):
            raise _mixed(e, staged, kept, stuck) from None
        if stuck and isinstance(e, Exception):  # any other failure leaves the folder as mixed: said the same way (it
            # was raised alone, the files put back and those not unsaid)
            raise _mixed(OSError(None, f"{type(e).__name__}: {e}", str(at)), staged, kept, stuck) from e
        raise
    for _, old in kept.values():
        _unlink_quietly(old)


def _put_back(kept: dict[Path, tuple[bool, Path | None]]) -> list[Path]:
    """Undo the renames and removals in `kept`, last first; returns the files that could not be put back (a failed
    replace or unlink, or a file replaced that had no link of its old content), whose links are left in place."""
    stuck = []
    for path, (existed, old) in reversed(kept.items()):
        try:
            if old is not None:
                os.replace(old, path)
            elif not existed:
                path.unlink()
            else:
                stuck.append(path)  # replaced with no link kept (no hard links here): its old content is gone
        except OSError:
            stuck.append(path)
    return stuck


def _mixed(cause: OSError, staged, kept: dict[Path, tuple[bool, Path | None]], stuck: list[Path]) -> GroupMixed:
    removed = {path for tmp, path in staged if tmp is None}
    new = sorted(p for p in stuck if p not in removed)
    missing = sorted(p for p in stuck if p in removed)
    old = sorted({path for _, path in staged if path not in stuck and os.path.lexists(path)})
    links = {p: kept[p][1] for p in sorted(stuck) if kept[p][1] is not None}
    return GroupMixed(cause, new, old, missing, links)


KEPT_SUFFIX = ".old"


def _old_link(path: Path) -> Path | None:
    """A hard link to `path`'s present content, `.NAME.PID.HEX.old` (not a `.tmp`: a temporaries' cleanup removed the
    one a GroupMixed kept, the user's only old copy); None on a file system without hard links (that one file cannot
    be put back: the checks before the renames are all it has)."""
    link = temp_sibling(path).with_suffix(KEPT_SUFFIX)
    try:
        os.link(path, link, follow_symlinks=False)
    except OSError:
        return None
    return link


def _unlink_quietly(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass
