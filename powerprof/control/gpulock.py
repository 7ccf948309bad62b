"""One exclusive OS lock per GPU, so two powerprof processes never step the same GPU."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from pathlib import Path

from .errors import GpuBusyError


def make_dirs(path: Path, mode: int = 0o755) -> None:
    """mkdir -p where every folder created gets exactly `mode` (whatever the umask): the state folder and its
    locks must never come out writable by group or others."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)


def lock_path(state_dir: Path, uuid: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", uuid)
    return Path(state_dir) / "locks" / f"{safe}.lock"


class GpuLock:
    """flock on a per-UUID file. The kernel drops it when the process dies, so a crash leaves no stale lock.

    The holder's PID is written inside, for the error the next process shows. The file is not
    deleted on release: unlinking a lock file races with a process that has it open.
    """

    def __init__(self, state_dir: Path, uuid: str, index: int | None = None):
        self.path = lock_path(state_dir, uuid)
        self.uuid = uuid
        self.index = index
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        make_dirs(self.path.parent)
        # O_CLOEXEC (Python's default) keeps a launched inference server from inheriting the lock; O_NOFOLLOW: the
        # file is truncated and written, so a symlink planted in its place must not lead root's write elsewhere.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            # A few short retries: `is_held` probes take the lock in shared mode for a moment.
            for attempt in range(4):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or attempt == 3:
                        raise
                    time.sleep(0.05)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            pid = read_holder_pid(self.path)
            who = f"powerprof process {pid}" if pid else "another powerprof process (PID not yet written)"
            gpu = f"GPU {self.index} ({self.uuid})" if self.index is not None else f"GPU {self.uuid}"
            raise GpuBusyError(
                f"{gpu} is already being controlled by {who}. Two controllers on one GPU would fight over its "
                f"power limit: wait for it to finish or stop it (kill {pid or 'PID'}); it puts the GPU back "
                f"when it exits. Lock file: {self.path}",
                pid,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock

    def __enter__(self) -> "GpuLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def is_held(state_dir: Path, uuid: str) -> bool:
    """Whether a controller holds this GPU now (a shared-mode probe, released at once)."""
    path = lock_path(state_dir, uuid)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def read_holder_pid(path: Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    # ASCII digits only ("²".isdigit() is true and int() raises on it), and never 0: the busy message says
    # `kill PID`, and `kill 0` signals the reader's whole process group.
    pid = int(text) if re.fullmatch(r"[0-9]{1,10}", text) else 0
    return pid if 0 < pid < 2**31 else None
