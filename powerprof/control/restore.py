"""The restore file: the original settings, written before the first change, used after a crash to put them back."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import hashlib
import itertools
import json
import logging
import os
import re
import sys
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from powerprof.collectors.gateway import gateway
from powerprof.errtext import error_text
from powerprof.paths import legacy_state_dirs, regular_file_head, state_dir
from powerprof.storage.atomic import atomic_path, fsync_dir
from powerprof.trust import _file_reason, _folder_reason, _trusted_target, untrusted_place

from .device import nvml_error_code
from .errors import ControlError, ControlPermissionError, GpuBusyError, RestoreError, permission_message
from .gpulock import GpuLock, MachineLock, is_held, lock_path, make_dirs, read_holder_pid
from .setter import NvidiaSmi, check_applied, reset_sm_clocks, run_nvidia_smi, set_power_limit

RESTORE_GLOB = "restore-*.json"
_log = logging.getLogger(__name__)
FORMAT = 1
DEFAULT_TOLERANCE_W = 2.0


def default_restore_path(uuids: Sequence[str], directory: Path | None = None) -> Path:
    """One file per set of GPUs, so controllers on disjoint GPUs never overwrite each other's record."""
    h = hashlib.sha1("\n".join(sorted(uuids)).encode()).hexdigest()[:12]
    return (state_dir() if directory is None else Path(directory)) / f"restore-{h}.json"


def write_json_atomic(path: Path, obj) -> None:
    """tmp + fsync + rename + fsync(dir): after a crash the file is either the old or the new one, whole."""
    path = Path(path)
    make_dirs(path.parent)
    # The dot-prefixed temporary never matches restore-*.json, so a kill mid-write leaves nothing to misread.
    with atomic_path(path) as tmp:
        # Owner-only, as it always was: only the controller that wrote it and `restore` read it.
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)


def remove_file(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_dir(Path(path).parent)


def new_record(gpus: dict, origin: dict | None) -> dict:
    """gpus: UUID → {index, name, original_limit_mw, default_limit_mw, clocks_locked}.

    origin: how to reopen these GPUs (the door's words; None = real GPUs), kept under the key
    "simulated" that older restore files already use."""
    return {
        "format": FORMAT,
        "pid": os.getpid(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": os.uname().nodename,
        "argv": list(sys.argv),
        "simulated": origin,
        "gpus": gpus,
    }


# What a recorded power limit may be: a whole number of milliwatts no GPU limit lies outside (H200: 200-700 W,
# GB200: up to 1.2 kW). It also keeps the value far below 2^32, which pynvml's unsigned int would wrap into a
# plausible small limit; each GPU's own [min, max] is checked before anything is set (`_out_of_range`).
LIMIT_MW_RANGE = (1_000, 10_000_000)
MAX_GPU_INDEX = 4095


def _is_whole(v, lo: int, hi: int) -> bool:
    """An int in [lo, hi]; not a bool (true is 1 to Python), a float, NaN or a string."""
    return type(v) is int and lo <= v <= hi


def record_problems(rec) -> list[str]:
    """What makes a parsed restore record unusable: each field root would act on, or quote, named with its value."""
    if not isinstance(rec, dict) or not isinstance(rec.get("gpus"), dict) or not _is_whole(rec.get("format"), FORMAT, FORMAT):
        return [f"it is not a powerprof restore file (format {FORMAT})"]
    lo, hi = LIMIT_MW_RANGE
    out = []

    def bad(where: str, key: str, v, want: str) -> None:
        out.append(f"{where}\"{key}\" is {json.dumps(v)}, not {want}")

    if "pid" in rec and not _is_whole(rec["pid"], 1, 2**31 - 1):
        bad("", "pid", rec["pid"], "a process id")
    if rec.get("simulated") is not None and not isinstance(rec["simulated"], dict):
        bad("", "simulated", rec["simulated"], "null or an object")
    for uuid, g in rec["gpus"].items():
        where = f"GPU {uuid}: "
        if not isinstance(g, dict) or "original_limit_mw" not in g:
            out.append(f"GPU {uuid} has no original limit recorded")
            continue
        if not _is_whole(g["original_limit_mw"], lo, hi):
            bad(where, "original_limit_mw", g["original_limit_mw"], f"a whole number of milliwatts in {lo}..{hi}")
        if "default_limit_mw" in g and not _is_whole(g["default_limit_mw"], lo, hi):
            bad(where, "default_limit_mw", g["default_limit_mw"], f"a whole number of milliwatts in {lo}..{hi}")
        if "index" in g and not _is_whole(g["index"], 0, MAX_GPU_INDEX):
            bad(where, "index", g["index"], f"a GPU index in 0..{MAX_GPU_INDEX}")
        if "clocks_locked" in g and type(g["clocks_locked"]) is not bool:
            bad(where, "clocks_locked", g["clocks_locked"], "true or false")
    return out


def load_record(path: Path) -> dict:
    """The parsed restore file; RestoreError naming every unusable field (a bool, NaN, a negative or absurd
    limit) when root must not act on it."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise RestoreError(f"cannot read restore file {path}: {e}") from e
    except RecursionError:  # nested past Python's stack: no ValueError, and it was a traceback
        raise RestoreError(f"cannot read restore file {path}: not valid JSON (nested deeper than Python's parser goes)") from None
    problems = record_problems(rec)
    if problems and problems[0].startswith("it is not"):
        raise RestoreError(f"{path} is not a powerprof restore file (format {FORMAT}) or is damaged")
    if problems:
        raise RestoreError(f"{path} is damaged: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    return rec


def untrusted_reason(path: Path, euid: int | None = None, root_too: bool = False) -> str | None:
    """Why this process must not act on the restore file `path`; None when only it (or root) could have written it.

    Root acts only on a file owned by root; an unprivileged user (the simulator, a capability
    holder) only on its own, or also on root's with `root_too` (to *believe* a pending record,
    never to apply it). Neither the file nor its folder may be writable by group or others, and
    the file must not be a symlink; every folder above (and symlink on the way) is root's or this
    user's, writable by no one else (a root-owned sticky folder such as /tmp excepted: `_trusted_target`).
    """
    euid = os.geteuid() if euid is None else euid
    owners = {euid, 0} if root_too else {euid}
    try:
        st = os.lstat(path)
        dst = os.stat(Path(path).parent)
    except OSError as e:
        return f"cannot inspect {path}: {e.strerror or e}"
    why = _file_reason(path, st, owners, euid, root_too) or _folder_reason(Path(path).parent, dst, euid)
    if why:
        return why
    try:
        # Every folder above too (and every symlink on the way): whoever owns one could rename the file's folder away
        # and put their own in its place between this check and the read (the file is read again by name).
        _trusted_target(Path(path).parent, euid)
    except PermissionError as e:
        return str(e)
    except OSError as e:
        return f"cannot inspect {path}: {e.strerror or e}"
    return None


_UUID_RE = re.compile(rb"GPU-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}")


UUID_SCAN_BYTES = 1 << 20  # a restore file is a few hundred bytes: a damaged one's UUIDs are in its first MiB


def uuids_named_in(path: Path) -> list[str] | None:
    """GPU UUIDs found in a (possibly damaged) restore file's first MiB: [] when it names none; None when it is no
    regular file that can be read (a symlink, a FIFO, gone): nothing to act on. Never through a symlink, and never
    more than that MiB: a symlink there to an 8 GB file had root's `restore --force-default` read it whole first
    (8.4 GB resident, 36 s), and a FIFO would have held it."""
    raw = regular_file_head(path, UUID_SCAN_BYTES)
    if raw is None:
        return None
    return sorted({m.decode() for m in _UUID_RE.findall(raw)})


def gpus_its_name_proves(path: Path, uuids: Sequence[str]) -> list[str] | None:
    """The set of `uuids` whose record `default_restore_path` names as `path` (its name is a hash of the UUIDs it
    was written for, so a file cut before any UUID still says whose it is); None: no set of them (at most 8 UUIDs:
    255 sets to hash)."""
    uuids = sorted(set(uuids))[:8]
    for k in range(1, len(uuids) + 1):
        for subset in itertools.combinations(uuids, k):
            if default_restore_path(subset, Path(path).parent).name == Path(path).name:
                return list(subset)
    return None


def force_default_help(path: Path) -> str:
    return (f"`powerprof restore --force-default --restore-file {path}` sets every GPU it names (every GPU when "
            f"none can be read) to its default power limit, releases clock locks, and removes the file")


def pending_restore_files(directory: Path | None = None, unlisted: list | None = None) -> list[Path]:
    """Restore files in `directory`; in root's default state folder, also those an older powerprof left
    in its former folder (`paths.legacy_state_dirs`), which then fail the trust check and are reported. A folder that
    exists but cannot be listed is logged, and `directory` so added to `unlisted` as (folder, why) where one is given."""
    d = state_dir() if directory is None else Path(directory)
    legacy = [p for p in legacy_state_dirs() if p != d] if d == state_dir() else []
    out: list[Path] = []
    for f in [d] + legacy:
        try:
            # os.scandir, not Path.glob: glob skips a folder it may not list without a word (the tuner's sandbox,
            # CAP_SYS_ADMIN alone, cannot list the daemon's 0750 /var/lib/powerprof: docs/tuner.md).
            with os.scandir(f) as it:
                names = [e.name for e in it if fnmatch.fnmatchcase(e.name, RESTORE_GLOB)]
        except FileNotFoundError:
            continue  # no such folder (no older powerprof here): nothing pending there
        except OSError as e:
            _log.warning("cannot list %s (%s): restore files there are not checked; run `powerprof restore` where "
                         "that folder can be read (as root, outside the tuner's sandbox)", f, e.strerror or e)
            if unlisted is not None and f == d:  # a former folder unread is the warning alone, as before
                unlisted.append((f, e.strerror or error_text(e)))
            continue
        found = sorted(p for p in (f / n for n in names) if p.is_file())
        if f in legacy:
            found = [p for p in found if _written_by_us(p)]
        out.extend(found)
    return out


def _written_by_us(path: Path) -> bool:
    """A restore file in a former state folder counts only where this user (root) owns it: an older powerprof as root
    wrote its files as root, and that folder is the daemon's now (/var/lib/powerprof, its user's): a file its user
    planted there held every root sweep and tuner start, and the fix it printed, `--force-default`, set the GPUs it
    named (every GPU when none) to their defaults."""
    try:
        uid = os.lstat(path).st_uid
    except OSError:
        return False
    if uid == os.geteuid():
        return True
    _log.warning("ignoring %s: a restore file in a former state folder owned by uid %d, not by this user (an older "
                 "powerprof wrote its own); remove it if it is not yours to keep", path, uid)
    return False


def pending_restore_note(directory: Path | None = None) -> str | None:
    """A warning for `powerprof devices` while a restore file exists, with the command that fixes it; else None."""
    directory = state_dir() if directory is None else Path(directory)
    files = pending_restore_files(directory)
    if not files:
        return None
    lines = []
    for path in files:
        reason = untrusted_reason(path, root_too=True)
        try:
            if reason is not None:
                raise RestoreError(f"restore file refused: {reason}")
            rec = load_record(path)
        except RestoreError as e:
            lines.append(f"Warning: {e}. No GPU change is allowed until an operator decides: {force_default_help(path)}.")
            continue
        sim = rec.get("simulated")
        what = "simulated GPU" if sim else "GPU"
        lines.append(
            f"Warning: powerprof (pid {rec.get('pid')}, started {rec.get('created_utc')}) changed {what} settings "
            f"that are not put back yet (restore file {path}):"
        )
        for uuid, g in sorted(rec["gpus"].items(), key=lambda kv: kv[1].get("index", 0)):
            clocks = "; SM clocks locked by powerprof" if g.get("clocks_locked") else ""
            lines.append(
                f"  GPU {g.get('index')} ({uuid}): original power limit {g['original_limit_mw'] / 1000:g} W{clocks}"
            )
        held = [u for u in rec["gpus"] if is_held(directory, u)]
        if held:
            pid = read_holder_pid(lock_path(directory, held[0])) or rec.get("pid")
            lines.append(f"  powerprof pid {pid} is still running on them; it puts them back when it ends.")
        else:
            sudo = "" if sim or os.geteuid() == 0 else "sudo "
            lines.append(f"  Put them back with: {sudo}powerprof restore --restore-file {path}")
    return "\n".join(lines)


# --- putting settings back -------------------------------------------------------------------


@dataclass(frozen=True)
class GpuRestored:
    index: int
    uuid: str
    limit_w: float | None  # read back after the restore
    original_w: float  # what it was set to: the recorded original (or the default, for force_default)
    clocks_released: bool
    before_w: float | None = None  # the limit it had when the restore began (None: it could not be read)


def restore_gpu(nvml, handle, index: int, uuid: str, entry: dict, nvidia_smi: NvidiaSmi, tolerance_w: float) -> GpuRestored:
    """Sets the recorded original limit, verifies it, and releases a clock lock powerprof made.

    The clock lock is released even when the limit could not be put back, and vice versa.
    """
    original_w = entry["original_limit_mw"] / 1000
    # What the crashed run left: the operator is told what changed, not only the end state.
    before_mw = gateway(nvml).query("nvmlDeviceGetPowerManagementLimit", handle)
    failure: ControlError | None = None
    rb = None
    try:
        rb = set_power_limit(nvml, handle, index, uuid, original_w, nvidia_smi)
        # Only the requested limit: another limiter may hold the enforced one lower, and that is not ours to undo.
        check_applied([rb], tolerance_w, enforced=False)
    except ControlError as e:
        failure = e
    released = False
    if entry.get("clocks_locked"):
        try:
            reset_sm_clocks(nvml, handle, index)
            released = True
        except ControlError as e:
            failure = failure or e
    if failure is not None:
        raise failure
    return GpuRestored(index, uuid, rb.limit_w, original_w, released, None if before_mw is None else before_mw / 1000)


@dataclass(frozen=True)
class FileOutcome:
    path: Path
    status: str  # "restored" | "defaulted" | "in_use" | "failed" | "refused" | "untrusted" | "damaged" | "missing"
    message: str
    gpus: tuple[GpuRestored, ...] = ()


@dataclass(frozen=True)
class RestoreReport:
    outcomes: tuple[FileOutcome, ...]
    searched: Path | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Said on stderr as they were found (a squatter of a GPU's machine-wide lock name passed over): in --json's notes
    # too, not in `lines()` (said already).
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(o.status in ("restored", "defaulted") for o in self.outcomes)

    def lines(self) -> list[str]:
        if not self.outcomes:
            return list(self.notes) or [f"Nothing to restore (no restore file in {self.searched})."]
        out = list(self.notes)
        for o in self.outcomes:
            out.append(o.message)
            for g in o.gpus:
                clocks = "; SM clock lock released" if g.clocks_released else ""
                before = "could not be read" if g.before_w is None else f"was {g.before_w:g} W"
                after = "cannot be read back" if g.limit_w is None else f"reads back {g.limit_w:g} W"
                out.append(f"  GPU {g.index} ({g.uuid}): power limit {before}, set to {g.original_w:g} W ({after}){clocks}")
        return out

    def to_dict(self) -> dict:
        """`powerprof restore --json`: stable keys, one entry per restore file."""
        return {
            "ok": self.ok,
            "searched": None if self.searched is None else str(self.searched),
            "notes": list(self.notes) + [f"warning: {w}" for w in self.warnings],
            "files": [
                {"path": str(o.path), "status": o.status, "message": o.message,
                 "gpus": [{"index": g.index, "uuid": g.uuid, "before_limit_w": g.before_w, "limit_w": g.limit_w,
                           "original_limit_w": g.original_w,
                           "clocks_released": g.clocks_released} for g in o.gpus]}
                for o in self.outcomes
            ],
        }


def _real_nvml(record: dict):
    import pynvml

    return pynvml


def restore_from_file(
    path: Path | str | None = None,
    *,
    nvml_factory: Callable[[dict], object] = _real_nvml,
    refuse: Callable[[dict, Path], str | None] = lambda record, path: None,
    nvidia_smi: NvidiaSmi = run_nvidia_smi,
    directory: Path | None = None,
    tolerance_w: float = DEFAULT_TOLERANCE_W,
    machine_scope: str | None = None,
) -> RestoreReport:
    """Puts back everything recorded in `path` (default: every restore file in the state folder). `machine_scope`: the
    door's (rig.Rig.machine_scope): each GPU's machine-wide lock is taken too, so a controller keeping its state in
    another folder is left alone, not put back under it.

    Each GPU's lock is taken first, so a controller that is still running is left alone. A file is
    removed only when every GPU in it is back; otherwise it stays for the next attempt.
    `nvml_factory(record)` opens the NVML the record was made with (the door decides: pynvml or a
    simulator); `refuse(record, file)` returns why the record of restore file `file` must be left alone, or None. A
    named `path` that does not exist is a failure, not "nothing to restore".
    """
    unlisted: list = []
    if path is not None:
        path = Path(path)
        if not path.exists():
            # A file the user named is expected to exist: a typo must not read as "all is well".
            return RestoreReport(
                (FileOutcome(path, "missing", f"Not restored: the restore file {path} does not exist."),),
                searched=path,
            )
        files = [path]
        lock_dir = Path(directory) if directory is not None else state_dir()
        searched = path
    else:
        lock_dir = Path(directory) if directory is not None else state_dir()
        files = pending_restore_files(lock_dir, unlisted)
        searched = lock_dir
    # A folder that could not be listed is no "Nothing to restore" (exit 0: a state folder that is a file, one this user
    # may not read, and a GPU left capped went unsaid); the files found elsewhere (a former folder) are still acted on.
    not_checked = tuple(FileOutcome(f, "failed", f"Not checked: {f} could not be listed ({why}), so any restore file in "
                                                 "it is not seen; run `powerprof restore` where it can be read (as root, "
                                                 "outside the tuner's sandbox), or set POWERPROF_STATE_DIR to the state "
                                                 "folder") for f, why in unlisted)
    warnings: list[str] = []
    outcomes = (*not_checked, *(_restore_one_file(f, refuse, nvml_factory, nvidia_smi, lock_dir, tolerance_w,
                                                  machine_scope, warnings) for f in files))
    return RestoreReport(outcomes, searched=searched, warnings=tuple(warnings))


def state_folder_refusal(folder: Path) -> str | None:
    """As root, why GPU locks and restore files must not be kept in `folder` (`untrusted_place`: another user's, or
    writable by others, or reached through another user's symlink), in the words every taker of a GPU lock says it
    (the controller, `restore`, `--force-default`); None where they may. A `locks` symlink planted there had root make
    its lock file in whatever folder it named."""
    why = untrusted_place(folder)
    if not why:
        return None
    return (f"state folder {folder}: refusing to keep GPU locks and the restore file there as root: {why}; another "
            "user could plant files or symlinks in it. Fix: point POWERPROF_STATE_DIR at a folder of root's own (chown "
            "root: and chmod go-w it and every folder above it), or unset it")


def _lock_gpu(locks: list, lock_dir: Path, uuid: str, index, machine_scope: str | None,
              warnings: list[str] | None = None) -> None:
    """The state folder's lock of the GPU, and its machine-wide one where the door gives a scope: a controller of
    another state folder is refused too (GpuBusyError), not acted under. `warnings`: each holder passed over is added."""
    for lock in (GpuLock(lock_dir, uuid, index),) + ((MachineLock(machine_scope, uuid, index),) if machine_scope else ()):
        lock.acquire()
        locks.append(lock)
        if warnings is not None and getattr(lock, "warning", None):
            warnings.append(lock.warning)


# How long `restore` waits for a GPU's lock while the restore file's writer is gone (`_writer_gone`): no holder can then
# be a controller running on that GPU (one opening reads the file under the lock and refuses), so the holder lets go.
# A controller opening beside squatted lock names held the lock 1.4-7.6 s, and `restore` refused meanwhile.
RESTORE_BUSY_WAIT_S = 10.0
_RESTORE_BUSY_RETRY_S = 0.05


def _writer_gone(rec: dict) -> bool:
    """Whether the process that wrote the record has exited: its PID, on this host, is no process now. False where
    unknown (another host, no PID, a PID in use again: then a busy lock is refused at once, as before)."""
    pid = rec.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or rec.get("host") != os.uname().nodename:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _lock_gpus(locks: list, rec: dict, lock_dir: Path, machine_scope: str | None, warnings: list[str] | None) -> None:
    """Every GPU of the record locked (`_lock_gpu`) into `locks`. A lock held (GpuBusyError) while the record's writer
    is gone is waited for, every lock let go meanwhile, up to RESTORE_BUSY_WAIT_S (monotonic); then, or where the writer
    may be alive, GpuBusyError."""
    deadline = None
    while True:
        said: list[str] = []
        try:
            for uuid, g in rec["gpus"].items():
                _lock_gpu(locks, lock_dir, uuid, g.get("index"), machine_scope, said)
        except GpuBusyError:
            for lock in locks:
                lock.release()
            locks.clear()
            deadline = time.monotonic() + RESTORE_BUSY_WAIT_S if deadline is None else deadline
            if time.monotonic() >= deadline or not _writer_gone(rec):
                raise
            time.sleep(_RESTORE_BUSY_RETRY_S)
            continue
        if warnings is not None:
            warnings.extend(said)
        return


def _restore_one_file(path, refuse, nvml_factory, nvidia_smi, lock_dir, tolerance_w, machine_scope=None,
                      warnings=None) -> FileOutcome:
    early = check_restore_file(path)
    if early is not None:
        return early
    rec = load_record(path)
    why = refuse(rec, path)
    if why:
        return FileOutcome(path, "refused", f"Not restored: {path} {why}")
    if (why := state_folder_refusal(lock_dir)) is not None:  # before any lock is taken there
        return FileOutcome(path, "refused", f"Not restored: {path}: {why}")
    locks: list = []
    nvml = None
    try:
        _lock_gpus(locks, rec, lock_dir, machine_scope, warnings)
        nvml = nvml_factory(rec)
        gateway(nvml).init()
        done, problems, found = [], [], []
        for uuid, g in sorted(rec["gpus"].items(), key=lambda kv: kv[1].get("index", 0)):
            try:
                h = gateway(nvml).call("nvmlDeviceGetHandleByUUID", uuid)
                found.append((uuid, g, h, int(gateway(nvml).call("nvmlDeviceGetIndex", h))))
            except nvml.NVMLError as e:
                if nvml_error_code(nvml, e) == nvml.NVML_ERROR_NOT_FOUND:
                    problems.append(f"GPU {uuid} is not present (NVML: {e}); if it was removed, delete {path} by hand")
                else:
                    problems.append(f"GPU {uuid}: NVML: {e}")
        # Every GPU's recorded limit against its own range before any is set: a file that is wrong for one
        # GPU changes none (NVML would refuse that one set, after the others were already changed).
        wrong = [w for uuid, g, h, index in found if (w := _out_of_range(nvml, h, index, uuid, g))]
        if wrong:
            return FileOutcome(path, "damaged", f"Not restored; nothing was changed and {path} is kept: "
                                                + " ".join(wrong) + f" If you know the original, correct the file "
                                                f"(limits in whole milliwatts); or {force_default_help(path)}.")
        for uuid, g, h, index in found:
            try:
                done.append(restore_gpu(nvml, h, index, uuid, g, nvidia_smi, tolerance_w))
            except ControlPermissionError:
                problems.append(permission_message("put GPU settings back", False).replace("powerprof ...", "powerprof restore"))
                break
            except ControlError as e:
                problems.append(str(e))
        if problems:
            return FileOutcome(
                path, "failed", f"Not fully restored; {path} is kept: " + " ".join(problems), tuple(done)
            )
        try:
            remove_file(path)
        except OSError as e:
            # Every GPU is back: "Not restored; … kept: PermissionError" said the opposite (a read-only file system,
            # an immutable file). Failed all the same (exit 1): the file blocks new runs on these GPUs until removed.
            return FileOutcome(path, "failed", f"Restored from {path} (left by pid {rec.get('pid')}), every GPU is back "
                                               f"at its original limit, but the file could not be removed "
                                               f"({e.strerror or error_text(e)}): remove it by hand (it blocks new runs "
                                               "on these GPUs):", tuple(done))
        return FileOutcome(path, "restored", f"Restored from {path} (left by pid {rec.get('pid')}):", tuple(done))
    except GpuBusyError as e:
        return FileOutcome(path, "in_use", f"Not restored: {e}")
    except Exception as e:  # NVML missing, driver gone: report and keep the file
        return FileOutcome(path, "failed", f"Not restored; {path} is kept: {error_text(e)}")
    finally:
        if nvml is not None:
            try:
                gateway(nvml).shutdown()
            except Exception:
                pass
        for lock in locks:
            lock.release()


def _out_of_range(nvml, handle, index: int, uuid: str, entry: dict) -> str | None:
    """Why this GPU must not be set to the recorded original limit (outside the range it accepts); None when
    it may be, or when the GPU cannot say its range (the set is then checked by NVML and read back)."""
    rng = gateway(nvml).query("nvmlDeviceGetPowerManagementLimitConstraints", handle)
    if not rng:
        return None
    lo_mw, hi_mw = rng
    mw = entry["original_limit_mw"]
    if lo_mw <= mw <= hi_mw:
        return None
    return (f"GPU {index} ({uuid}): the recorded original limit {mw / 1000:g} W (\"original_limit_mw\": {mw}) is outside "
            f"the {lo_mw / 1000:g}-{hi_mw / 1000:g} W this GPU accepts.")


# --- files that cannot be trusted or read ----------------------------------------------------


def pending_blocker(uuids, directory: Path, extra: Sequence[Path] = ()) -> str | None:
    """Why no limit of these GPUs may be changed now, or None. A damaged or foreign restore file may hold
    one's original (reading the current, maybe capped, limit as the original would lose it for good), and
    a readable record naming one means it was never put back. Used by the controller before any change
    and by the dry-run plan, so the plan shows what would stop the real run."""
    devices = set(uuids)
    for path in [*pending_restore_files(directory), *extra]:
        bad = check_restore_file(path, root_too=True)
        if bad is not None:
            return f"{bad.message.removeprefix('Not restored: ')} Nothing was changed."
        rec = load_record(path)
        hit = sorted(((g.get("index"), u) for u, g in rec["gpus"].items() if u in devices), key=lambda x: (x[0] is None, x[0]))
        if hit:
            gpus = ", ".join(f"GPU {i}" for i, _ in hit)
            return (f"{gpus} still has settings changed by an earlier powerprof run (pid {rec.get('pid')}, "
                    f"{rec.get('created_utc')}) that were never put back, so its current limit is not its original. "
                    f"Run `powerprof restore --restore-file {path}` first. Nothing was changed.")
    return None


def check_restore_file(path: Path, root_too: bool = False) -> FileOutcome | None:
    """The outcome for a file `restore` must not apply (untrusted: someone else could write it; damaged: it
    cannot be parsed, so the original limit is unknown); None when it may be applied. `root_too`: a
    root-owned file is believed too (a controller checking for pending records, not applying them)."""
    reason = untrusted_reason(path, root_too=root_too)
    if reason is not None:
        return FileOutcome(path, "untrusted", f"Not restored: {reason}; powerprof applies only restore files that "
                                            f"no one else could have written. Inspect it; {force_default_help(path)}.")
    try:
        load_record(path)
    except RestoreError as e:
        return FileOutcome(path, "damaged", f"Not restored: {e}. The original limit it held is unknown, so no GPU "
                                            f"change is allowed until you decide: if you know it, correct the file "
                                            f"(limits in whole milliwatts) and run `powerprof restore` again; or "
                                            f"{force_default_help(path)}.")
    return None


def force_default(
    path: Path,
    nvml,
    *,
    nvidia_smi: NvidiaSmi = run_nvidia_smi,
    directory: Path | None = None,
    tolerance_w: float = DEFAULT_TOLERANCE_W,
    machine_scope: str | None = None,
    uuids: Sequence[str] | None = None,
    warnings: list[str] | None = None,
) -> FileOutcome:
    """The operator's way out of a damaged or refused restore file: every GPU it names (all GPUs when no UUID
    can be read from it) goes to its default power limit with clock locks released, then the file is removed.
    Nothing in the file is trusted beyond the UUIDs it names. `uuids`: the GPUs to act on where the file's text
    names none but its name proves whose it is (gpus_its_name_proves). `warnings`: each machine-wide lock holder
    passed over is added (RestoreReport.warnings: --json's notes)."""
    path = Path(path)
    lock_dir = Path(directory) if directory is not None else state_dir()
    named = uuids_named_in(path)
    if named is not None and not named and uuids:
        named = sorted(uuids)
    if named is None:
        # "No UUID readable" sets every GPU to its default: a symlink or a FIFO planted there would have done that
        # (and before, through the symlink, set the GPUs its target named).
        return FileOutcome(path, "failed", f"Not changed: {path} is no regular file that can be read (a symlink, a "
                                           "FIFO, or gone): there is nothing in it to act on; remove it yourself")
    if (why := state_folder_refusal(lock_dir)) is not None:  # before any lock is taken there
        return FileOutcome(path, "refused", f"Not changed: {path}: {why}")
    gw = gateway(nvml)
    locks: list = []
    done: list[GpuRestored] = []
    started = False
    try:
        # Inside the try: NVML missing or the driver gone is this command's failure to say (the file kept), as a plain
        # restore says it; it was a traceback, from the very command a refused sweep prints as its fix.
        gw.init()
        started = True
        handles = []
        if named:
            for uuid in named:
                try:
                    handles.append((uuid, gw.call("nvmlDeviceGetHandleByUUID", uuid)))
                except nvml.NVMLError:
                    continue  # a GPU that is gone, or a stray match: nothing to put back
            if not handles:
                return FileOutcome(path, "failed", f"Not changed; {path} is kept: none of the GPUs it names "
                                                   f"({', '.join(named)}) is present. Delete it by hand if they were removed.")
        else:
            for i in range(int(gw.call("nvmlDeviceGetCount"))):
                h = gw.call("nvmlDeviceGetHandleByIndex", i)
                handles.append((gw.call("nvmlDeviceGetUUID", h), h))
        for uuid, h in handles:
            _lock_gpu(locks, lock_dir, uuid, int(gw.call("nvmlDeviceGetIndex", h)), machine_scope, warnings)
        problems = []
        for uuid, h in handles:
            index = int(gw.call("nvmlDeviceGetIndex", h))
            entry = {"original_limit_mw": int(gw.call("nvmlDeviceGetPowerManagementDefaultLimit", h)),
                     "clocks_locked": False}
            try:
                r = restore_gpu(nvml, h, index, uuid, entry, nvidia_smi, tolerance_w)
            except ControlError as e:
                problems.append(str(e))
                continue
            try:
                reset_sm_clocks(nvml, h, index)  # whether or not a lock was made: the file cannot say
                r = dataclasses.replace(r, clocks_released=True)
            except ControlPermissionError as e:
                problems.append(str(e))
            except ControlError:
                pass  # no clock locking on this GPU: nothing to release
            done.append(r)
        if problems:
            return FileOutcome(path, "failed", f"Not fully set to defaults; {path} is kept: " + " ".join(problems), tuple(done))
        if (why := untrusted_place(path.parent)) is not None:
            # Removed by name through a folder another user controls, the name could lead anywhere by then (a
            # folder swapped for a symlink to root's state folder removed root's own restore file, its originals lost).
            return FileOutcome(path, "defaulted", f"Set to default limits; {path} is kept, not removed through a folder "
                                                  f"another user controls ({why}): remove it yourself:", tuple(done))
        try:
            remove_file(path)
        except OSError as e:
            return FileOutcome(path, "failed", f"Set to default limits, but {path} could not be removed "
                                               f"({e.strerror or error_text(e)}): remove it by hand:", tuple(done))
        return FileOutcome(path, "defaulted", f"Set to default limits and removed {path}:", tuple(done))
    except GpuBusyError as e:
        return FileOutcome(path, "in_use", f"Not changed: {e}")
    except Exception as e:  # NVML missing, driver gone: report and keep the file
        return FileOutcome(path, "failed", f"Not changed; {path} is kept: {error_text(e)}")
    finally:
        if started:
            gw.shutdown()
        for lock in locks:
            lock.release()
