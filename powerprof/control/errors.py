"""Errors raised by power-limit and clock control, and the permission message users act on."""

from __future__ import annotations


class ControlError(RuntimeError):
    """A change to a GPU could not be made or verified. The message says what to do."""


class ControlPermissionError(ControlError):
    """NVML refused a setter: not root and no CAP_SYS_ADMIN."""


class GpuBusyError(ControlError):
    """Another powerprof controller holds the GPU's lock."""

    def __init__(self, message: str, holder_pid: int | None):
        super().__init__(message)
        self.holder_pid = holder_pid


class LimitNotAppliedError(ControlError):
    """A set returned success but the read-back limit is not what was asked for."""


class PendingRestoreError(ControlError):
    """A previous run left a restore record for this GPU: its 'current' limit is not the original."""


class StateFolderError(ControlError):
    """The state folder cannot hold a GPU's lock or the restore file (full, a planted symlink, read-only): nothing was
    changed. The message names the file, the cause and the fix."""


def state_folder_message(what: str, path, e: OSError) -> str:
    """One line for an OSError on a lock or restore file in the state folder, before any change: the cause in words and
    the fix (a bare `[Errno 28] No space left on device` or `[Errno 40] Too many levels of symbolic links: …lock`
    said neither)."""
    import errno as _errno
    from pathlib import Path as _Path

    from powerprof.paths import file_in_the_way, what_is

    path = _Path(path)
    folder = path.parent
    elsewhere = "or point POWERPROF_STATE_DIR at another folder"
    if e.errno == _errno.ELOOP:
        why = ("it is a symlink, which powerprof never writes through (another user may have planted it to have root "
               f"write elsewhere); look at where it points, then remove it (`rm {path}`)")
    elif e.errno in (_errno.ENOSPC, _errno.EDQUOT):
        why = f"{e.strerror}: free space in {folder} (`df -h {folder}`), {elsewhere}"
    elif e.errno == _errno.EROFS:
        why = f"{e.strerror}: {elsewhere} on a writable file system"
    elif e.errno in (_errno.ENOTDIR, _errno.EEXIST) and (q := file_in_the_way(folder)) is not None:
        why = f"{q} is {what_is(q)}, not a folder: move it aside, {elsewhere}"
    elif e.errno in (_errno.EACCES, _errno.EPERM):
        why = f"{e.strerror}: run as the user the folder belongs to, fix its permissions, {elsewhere}"
    else:
        why = f"{e.strerror or e}: fix the folder, {elsewhere}"
    return f"cannot write {what} {path}: {why}. Nothing was changed on any GPU."


class RestoreError(ControlError):
    """Putting the original settings back failed; the restore file is kept for `powerprof restore`."""


def permission_message(action: str, nothing_changed: bool = True) -> str:
    tail = " Nothing was changed." if nothing_changed else ""
    return (
        f"Permission denied: to {action}, powerprof needs root or CAP_SYS_ADMIN (NVML: Insufficient Permissions). "
        "Run it with sudo, e.g. `sudo $(command -v powerprof) ...`, or from a systemd unit with "
        "AmbientCapabilities=CAP_SYS_ADMIN."
        f"{tail} `powerprof measure` needs no root: it measures at the current settings without changing them."
    )
