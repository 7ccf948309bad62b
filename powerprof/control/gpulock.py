"""One exclusive OS lock per GPU, so two powerprof processes never step the same GPU: a file lock in the state folder,
and a machine-wide one (an abstract socket) that two state folders share."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import socket
import struct
import time
from pathlib import Path

from .errors import GpuBusyError, StateFolderError, state_folder_message


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
        try:
            self._acquire()
        except OSError as e:
            # A full state folder (the PID's pwrite: ENOSPC), a planted symlink (O_NOFOLLOW: ELOOP), a read-only one:
            # a traceback or a bare errno before. Nothing has been changed yet: the lock is taken before anything.
            raise StateFolderError(state_folder_message(f"the lock of {self._gpu()}", self.path, e)) from None

    def _gpu(self) -> str:
        return f"GPU {self.index} ({self.uuid})" if self.index is not None else f"GPU {self.uuid}"

    def _acquire(self) -> None:
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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # drops the flock: a lock whose holder cannot be named is not kept
            raise
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


def holder_now(state_dir: Path, uuid: str, machine_scope: str | None = None) -> tuple[bool, int | None]:
    """(whether a controller holds this GPU now, its PID where known), as `restore` finds it in use: the state folder's
    lock (a shared-mode probe) and, where the door gives a scope, the machine-wide one (bound and let go at once), so a
    controller keeping its state in another folder counts too. Writes no file: a dry run's question."""
    if is_held(state_dir, uuid):
        return True, read_holder_pid(lock_path(state_dir, uuid))
    if machine_scope:
        lock = MachineLock(machine_scope, uuid)
        try:
            lock.acquire()
        except GpuBusyError as e:
            return True, e.holder_pid
        except OSError:
            return False, None
        lock.release()
    return False, None


def read_holder_pid(path: Path) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    # ASCII digits only ("²".isdigit() is true and int() raises on it), and never 0: the busy message says
    # `kill PID`, and `kill 0` signals the reader's whole process group.
    pid = int(text) if re.fullmatch(r"[0-9]{1,10}", text) else 0
    return pid if 0 < pid < 2**31 else None


class MachineLock:
    """The GPU's lock across state folders: a listening socket in the abstract namespace (no file: no folder another
    user could plant in, none to share), named by the hardware's scope and the GPU's UUID. The kernel drops it when
    the process dies. Two controllers keeping their state in different folders (root's sweep beside a CAP_SYS_ADMIN
    user's, or another POWERPROF_STATE_DIR) each took the other's level for the original: both said "every GPU is back"
    and the GPU stayed capped. The second is refused now, its holder named by the socket's peer credentials.

    `scope`: whose hardware ("nvml" for this machine's GPUs; a simulator's state file for simulated ones). Limit: the
    abstract namespace is per network namespace (a container with a network of its own does not see it)."""

    def __init__(self, scope: str, uuid: str, index: int | None = None):
        digest = hashlib.sha256(f"{scope}\0{uuid}".encode()).hexdigest()[:40]
        self.name = b"\0powerprof-gpu-" + digest.encode()
        self.uuid = uuid
        self.index = index
        self._sock: socket.socket | None = None

    def acquire(self) -> None:
        if self._sock is not None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inheritable: a launched server never holds it
        try:
            s.bind(self.name)
            s.listen(1)  # its peer credentials answer a connect, accepted or not
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE:
                raise
            pid, uid = _holder(self.name)
            if pid == os.getpid():  # two controllers of one process, each with a state folder of its own
                raise GpuBusyError(f"GPU {self.index if self.index is not None else self.uuid} is already being "
                                   "controlled by another controller of this process: close that one first", None)
            who = f"powerprof process {pid} (uid {uid})" if pid else "another powerprof process"
            gpu = f"GPU {self.index} ({self.uuid})" if self.index is not None else f"GPU {self.uuid}"
            raise GpuBusyError(
                f"{gpu} is already being controlled by {who}, which keeps its restore file and locks in another state "
                "folder (another user's, or another POWERPROF_STATE_DIR). Two controllers on one GPU would fight over "
                "its power limit, and the second would take the first one's level for the original and leave it "
                f"there: wait for it to finish or stop it (kill {pid or 'PID'}); it puts the GPU back when it exits",
                pid,
            ) from None
        self._sock = s

    def release(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            s.close()


def _holder(name: bytes) -> tuple[int | None, int | None]:
    """(pid, uid) of the process listening on `name`, from SO_PEERCRED; (None, None) where it cannot be read."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(1.0)
            c.connect(name)
            pid, uid, _gid = struct.unpack("3i", c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            return (pid or None), uid
    except OSError:
        return None, None
