"""Where powerprof keeps state on this machine: the one state-folder lookup every layer uses."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_ENV = "POWERPROF_STATE_DIR"
# Root's restore files and GPU locks: a root-owned folder (0755) of its own. Not the daemon's
# StateDirectory (/var/lib/powerprof, owned by the unprivileged daemon user), whose owner could
# otherwise forge the limits root applies at every start.
ROOT_STATE_DIR = Path("/var/lib/powerprof-control")
# Root's state folder before 0.2: also the daemon's StateDirectory, so files there are never trusted,
# but a restore file left there by a crashed sweep must still be found and reported after an upgrade.
LEGACY_ROOT_STATE_DIR = Path("/var/lib/powerprof")


def temp_sibling(path) -> Path:
    """A temporary name next to `path` for an atomic replace, `.<name>.<pid>.<random>.tmp`: unpredictable, so no one can
    plant a symlink there in advance (a fixed `.<name>.<pid>.tmp` was sprayed over the next pids and followed as root).
    Dot-prefixed and ending in `.tmp`, so `*.parquet`/`restore-*.json` globs and hive-partition readers skip it."""
    import secrets  # noqa: PLC0415

    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def cwd_gone(path, flag: str = "--out") -> str | None:
    """Why a relative `path` names no place: the current folder was removed (os.getcwd() fails), with the fix; None
    for an absolute path or where the current folder is there. Asked first by every command that takes a path: the
    os.getcwd() of a join, abspath or resolve() ended in a FileNotFoundError traceback."""
    if os.path.isabs(path):
        return None
    try:
        os.getcwd()
    except FileNotFoundError:
        return (f"{flag} {path}: the current folder no longer exists (removed), so a relative path names no place. "
                "Fix: cd to one that does, or give an absolute path")
    return None


def cwd_joined(path) -> Path:
    """`path` joined to the current folder, not normalised (`link/../f` goes through `link`, as the kernel writes it),
    with no os.getcwd() for an absolute path: one is written from a removed current folder too. A relative one there
    raises FileNotFoundError: `cwd_gone` says it first."""
    return Path(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))


def user_state_home(env: dict | None = None) -> Path:
    """$XDG_STATE_HOME, else ~/.local/state (the XDG base-directory default)."""
    env = os.environ if env is None else env
    return Path(env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"))


def state_dir(env: dict | None = None, euid: int | None = None) -> Path:
    """POWERPROF_STATE_DIR if set, else /var/lib/powerprof-control as root, else $XDG_STATE_HOME/powerprof."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV])
    if (os.geteuid() if euid is None else euid) == 0:
        return ROOT_STATE_DIR
    return user_state_home(env) / "powerprof"


def configured_state_dir(env: dict | None = None) -> Path | None:
    """The state folder only where the user named one (POWERPROF_STATE_DIR or XDG_STATE_HOME), else None:
    for scratch files that should follow a named folder but otherwise belong in the temp folder."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV])
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "powerprof"
    return None


def file_in_the_way(folder) -> Path | None:
    """`folder` or the folder above it that is no folder, where the first of them that exists is none (a file, a FIFO,
    a link to nothing); else None (a folder, or a link to one). A FIFO or a dangling link there read a bare "[Errno 17]
    File exists", or "does not exist" of a name that does."""
    p = Path(folder)
    for q in (p, *p.parents):
        if os.path.lexists(q):
            return None if q.is_dir() else q
    return None


def what_is(path) -> str:
    """What an existing thing that is no folder is, as a message names it: "a file", "a FIFO", "a link to nothing"."""
    p = Path(path)
    if p.is_file():
        return "a file"
    if p.is_fifo():
        return "a FIFO (a named pipe)"
    if p.is_symlink():
        return "a link to nothing (dangling, or a loop)"
    return "no folder (a socket or a device)"


def missing_folder(folder) -> str:
    """Why `folder`, not a folder, cannot hold an output: `'x.txt' is a file, not a folder` (a file where a folder was
    meant: "does not exist" said of a file that does), else `folder 'x' does not exist`."""
    q = file_in_the_way(folder)
    return f"folder {str(folder)!r} does not exist" if q is None else f"{str(q)!r} is {what_is(q)}, not a folder"


def state_folder_is_file(path) -> str | None:
    """Where the state folder `path`, or a folder above it, is a file: one line saying so, with the fix; None otherwise.
    Making the folder then failed with a bare `[Errno 17] File exists` naming no folder and no fix."""
    p = Path(path)
    q = file_in_the_way(p)
    if q is None:
        return None
    where = f"is {what_is(q)}" if q == p else f"is inside {q}, which is {what_is(q)}"
    return (f"state folder {p} {where}, not a folder. Fix: move the file aside, or point {STATE_DIR_ENV} at a folder "
            "(made where missing)")


def legacy_state_dirs(env: dict | None = None, euid: int | None = None) -> list[Path]:
    """Older state folders still to be searched for pending restore files (root's default only)."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV) or (os.geteuid() if euid is None else euid) != 0:
        return []
    return [LEGACY_ROOT_STATE_DIR]


def path_problem(path) -> str | None:
    """Why `path` cannot name a file at all (a name longer than the file system takes, a path longer than the kernel
    takes, a loop of symlinks), with the fix; None where it can (whether or not it exists). Path.exists() raises for
    these: an OSError traceback."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        import errno  # noqa: PLC0415

        if e.errno == errno.ENAMETOOLONG and (why := path_max_problem(path, 0)) is not None:
            return why  # every name in it fits: "give a shorter name" named no name too long
        fix = "give a shorter name" if e.errno == errno.ENAMETOOLONG else "give another path"
        return f"{e.strerror or e}; {fix}"
    return None


# Linux's PATH_MAX: the most bytes the kernel takes in one path, its last the NUL (ENAMETOOLONG beyond).
PATH_MAX_BYTES = 4096
# Room kept after a folder output's path for what is written in it: the deepest any command writes below the folder it
# is given is a daemon's `intervals/date=YYYY-MM-DD/part-<utc>-<pid>-<seq>.parquet` under its temporary name (~100 bytes).
OUTPUT_DEPTH_BYTES = 128
# What `temp_sibling` adds to a file's path: `.` before its name, `.<pid>.<8 hex>.tmp` after (a pid of up to 7 digits).
# A file output keeps this alone: 128 refused files whose write fit (an xlsx 4007 bytes from /, its temporary 4029).
TEMP_NAME_BYTES = 22


def path_max_problem(path, below: int) -> str | None:
    """Why an output cannot be written at `path`: the path, with the `below` bytes written beyond it (a file's
    temporary name, a folder's files), is past what the kernel takes in one path (PATH_MAX, 4096 bytes with the NUL),
    with the fix; None where it fits. Such a path inside a deep existing folder passed every check and failed at the
    write, after the work ("File name too long"). Judged as given, the string each command writes through: a relative
    one from the current folder however deep that is (judged from /, relative outputs in a folder 4000 bytes deep
    were refused that the commands wrote fine); a caller that writes through the absolute path passes that."""
    if cwd_gone(path) is not None:
        return None
    full = cwd_joined(path)
    there = next((q for q in (full, *full.parents) if os.path.isdir(q)), None)
    try:
        most = os.pathconf(there, "PC_PATH_MAX") if there is not None else PATH_MAX_BYTES
    except (OSError, ValueError):
        most = PATH_MAX_BYTES
    size = len(os.fsencode(str(path)))
    if size + below < most:
        return None
    added = f", and what is written there may add {below}" if below else ""
    frm, to = ("from /", "a folder nearer /") if os.path.isabs(path) else ("", "fewer folders")
    return (f"path too long: {size} bytes{' ' + frm if frm else ''}{added}; the kernel takes {most - 1} bytes in a path "
            f"(PATH_MAX). Fix: give a path of at most {max(0, most - 1 - below)} bytes{' ' + frm if frm else ''} ({to}, "
            "or shorter names)")


def temp_name_problem(path) -> str | None:
    """Why a file cannot be written at `path` by an atomic replace: its temporary's name (`temp_sibling`, ~22 bytes
    longer) is past what the file system takes in one name (NAME_MAX, 255 on most), or its path past PATH_MAX
    (`path_max_problem`), with the fix; None where it fits.
    A name that fits alone passed every check and failed at the write, after the work ("File name too long")."""
    # The pid's digits vary (up to 7, pid_max 4194304): the longest it may be, so the fix holds for every run.
    name = os.fsencode(temp_sibling(path).name) + b"0" * max(0, 7 - len(str(os.getpid())))
    parent = cwd_joined(path).parent if cwd_gone(path) is None else None
    try:
        most = os.pathconf(parent, "PC_NAME_MAX") if parent is not None and os.path.isdir(parent) else 255
    except (OSError, ValueError):
        most = 255
    if len(name) <= most:
        return path_max_problem(path, len(name) - len(os.fsencode(Path(path).name)))
    keep = most - (len(name) - len(os.fsencode(Path(path).name)))
    return (f"File name too long: it is written first under a temporary name {len(name) - len(os.fsencode(Path(path).name))} "
            f"bytes longer, and the file system takes {most} bytes in a name; give a name of at most {keep} bytes")


def resolve_problem(path) -> str | None:
    """Why `path` cannot be resolved to the file it names (a loop of symlinks), with the fix; None where it can.
    Path.resolve() raises RuntimeError for a loop (an OSError from Python 3.13): a traceback in analyze and export,
    whose sources are resolved to count a folder named twice once."""
    try:
        Path(path).resolve()
    except RuntimeError:
        return "a loop of symlinks (it leads back to itself); give the folder it should name"
    except OSError as e:
        return f"{e.strerror or e}; give another path"
    return None


def not_a_regular_file(path) -> str | None:
    """What `path` is where it exists and is not a regular file ("a FIFO", "a character device", "a symlink"...): a
    name no output writer may replace, --force or not (`--force` on /dev/null made it a 302-byte file). Judged by
    lstat, so a symlink is one whatever it points at, a dangling or looping one included (exists() follows it and
    said no). None where nothing is there or it is a regular file; a name that cannot be looked up (too long) is
    `path_problem`'s."""
    import stat  # noqa: PLC0415

    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        try:
            os.stat(path)
            return "a symlink"
        except OSError:
            return "a symlink that leads nowhere (dangling or a loop)"
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def output_file_refusal(path, force: bool, kept: str, option: str = "") -> str | None:
    """The one check of every command that writes a file at a name the user gave (`trace OUT`, `monitor --output`
    and `--recover`, `export --out`), before anything is written: why it must not write there, or None. Refused
    whatever `force` says: a name that exists and is not a regular file (`not_a_regular_file`: a device, FIFO,
    socket, folder or symlink, which the atomic rename would replace by a file); without `force`, any name that
    exists (`kept`: what it may be, e.g. "a trace of yours?"). A symlink counts as existing however it ends."""
    if not str(path).strip():  # Path('') is '.': `trace ''` was a traceback ("PosixPath('.') has an empty name")
        return f"{str(path)!r} names no file: give the name of the file to write"
    if (why := path_problem(path) or temp_name_problem(path)) is not None:
        return f"{path}: {why}"
    if (what := not_a_regular_file(path)) is not None:
        return (f"{path} exists and is {what}, not a regular file: nothing written (--force replaces only a regular "
                f"file); choose another name{' with ' + option if option else ''}")
    if os.path.lexists(path) and not force:
        return (f"{path} exists ({kept}); choose another name{' with ' + option if option else ''}, "
                "or --force to replace it")
    return None


# What marks a folder as a sweep's run: its run.json, or windows.parquet (analyze reads a folder with it as a run even
# without run.json). Here, not in storage.runs: the daemon's config check asks without loading pyarrow (45 MiB).
RUN_JSON = "run.json"
RUN_MARKS = (RUN_JSON, "windows.parquet")


def holds_sweep_run(path) -> bool:
    """`path` holds a sweep's run (its run.json or windows.parquet): no place for other output (`analyze --out`,
    the daemon's datasets), which `analyze` and `export` would read as the run's, or read in its stead."""
    return any(os.path.isfile(os.path.join(path, m)) for m in RUN_MARKS)


def regular_file_head(path, limit: int) -> bytes | None:
    """The first `limit` bytes of the regular file at `path`; None where it is no regular file that can be read (gone,
    a symlink, a FIFO, a folder). Opened without following a link or blocking, and read no further than `limit`: a
    FIFO named run.json above --out hung `sweep` for ever waiting for a writer, and a symlink to an 8 GB file had root's
    `restore --force-default` read it whole (8.4 GB resident, 36 s)."""
    import stat  # noqa: PLC0415

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = b""
        while len(raw) < limit and (chunk := os.read(fd, limit - len(raw))):
            raw += chunk
        return raw
    except OSError:
        return None
    finally:
        os.close(fd)


def is_powerprof_run(path) -> bool:
    """`path` is a run powerprof wrote: a run.json naming a run_id and a kind (every sweep and measure writes it first).
    A run.json of another tool's (sacred writes one a run, many CI jobs do) is none: in a folder above a daemon's data
    dir it refused the daemon's default data dir as "inside a sweep's run folder". A windows.parquet alone is none
    either: `export --format parquet --out .` writes one, and every --out below that folder was refused."""
    import json  # noqa: PLC0415

    raw = regular_file_head(os.path.join(path, RUN_JSON), 1 << 20)  # a FIFO planted as /tmp/run.json: not waited on
    if raw is None:
        return False
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return False
    return isinstance(meta, dict) and "run_id" in meta and "kind" in meta


def run_folder_above(path) -> Path | None:
    """The nearest folder above `path` that is a powerprof run (`is_powerprof_run`), else None. A folder anyone may
    write to (sticky and world-writable: /tmp) or another user's (not ours, not root's) is passed over: a run.json
    planted there refused every --out below it, root's too."""
    import stat  # noqa: PLC0415

    euid = os.geteuid()
    for q in Path(os.path.abspath(path)).parents:
        try:
            st = os.stat(q)
        except OSError:
            continue
        if st.st_uid not in (euid, 0) or (st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH):
            continue
        if is_powerprof_run(q):
            return q
    return None


# What marks a folder as a daemon's dataset: one of these tables' folders in it (analysis.fleet.is_daemon_dataset, for
# a local path). Here, beside RUN_MARKS: the sweep's --out check asks without loading the analysis.
DATASET_MARKS = ("requests", "intervals")
# Entries looked at below a table's folder for a .parquet file before it is taken for no table (a clone of psf/requests
# in a home folder has hundreds; a daemon's table has its first file within a few partition folders).
TABLE_SCAN_MAX_ENTRIES = 2000


def _holds_parquet(folder: str) -> bool:
    """A .parquet file somewhere below `folder`, looked for among TABLE_SCAN_MAX_ENTRIES entries at most."""
    seen = 0
    for _root, dirs, files in os.walk(folder):
        if any(f.endswith(".parquet") for f in files):
            return True
        seen += len(dirs) + len(files)
        if seen > TABLE_SCAN_MAX_ENTRIES:
            return False
    return False


def holds_dataset_tables(path) -> bool:
    """`path` holds a daemon dataset's tables: a requests/ or intervals/ folder with Parquet files below it. A folder
    of that name alone is not one (a clone of psf/requests, a folder of saved prompts): taken for a dataset, every
    output below a home folder holding one was refused, a finished sweep's default analysis among them."""
    return any(os.path.isdir(t := os.path.join(path, m)) and _holds_parquet(t) for m in DATASET_MARKS)


def daemon_dataset_above(path):
    """The daemon dataset folder `path` lies inside (below it, made yet or not), or None: output there is read as the
    dataset's (its requests/ reads every .parquet below it as request rows, another folder is one more table)."""
    for above in Path(os.path.abspath(path)).parents:
        if holds_dataset_tables(above):
            return above
    return None

