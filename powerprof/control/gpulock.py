"""One exclusive OS lock per GPU, so two powerprof processes never step the same GPU: a file lock in the state folder,
and a machine-wide one (an abstract socket) that two state folders share."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import socket
import stat
import struct
import sys
import time
from pathlib import Path

from powerprof.paths import ROOT_STATE_DIR
from powerprof.privilege import CAP_SYS_ADMIN
from powerprof.trust import untrusted_out_dir, untrusted_place

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
            lock.acquire(probe=True)
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


# Root's own machine-wide locks: a folder only root may write, the same whatever the state folder (root's controllers of
# two state folders exclude each other here): in root's default state folder, the tuner unit's StateDirectory, the one
# place its sandbox (ProtectSystem=strict) lets it and its restore write. Mode 0600 files: a file lock needs only a
# descriptor, so a lock file any user could open read-only, any user could hold.
ROOT_LOCK_DIR = ROOT_STATE_DIR / "machine-locks"


def root_lock_dir(scope: str) -> Path:
    """Where root's machine-wide locks of `scope`'s GPUs live: ROOT_LOCK_DIR; a simulator's beside its state file
    (`<state file>.machine-locks`), the simulated GPU's one home. In ROOT_LOCK_DIR, every test's state file was a GPU of
    its own, and each root controller a test killed (no release) left a file there on the test host, run after run."""
    return Path(scope[len("sim:"):] + ".machine-locks") if scope.startswith("sim:") else ROOT_LOCK_DIR


def scope_identity(scope: str) -> str:
    """The second name of `scope`'s GPUs for the machine-wide lock, beside its path (`MachineLock._name`): the scope
    itself, and a simulator's by its state folder's (st_dev, st_ino) and the file's name, so every path to that folder
    (a bind mount, a symlinked folder) names one GPU.
    By path, a second root controller reaching the folder through a bind mount got another name and stepped the GPU
    the first held. A folder that cannot be read is named by its path."""
    if not scope.startswith("sim:"):
        return scope
    path = scope[len("sim:"):]
    try:
        st = os.stat(os.path.dirname(path) or "/")
    except OSError:
        return scope
    return f"sim-folder:{st.st_dev}:{st.st_ino}/{os.path.basename(path)}"


class MachineLock:
    """The GPU's lock across state folders: a listening socket in the abstract namespace (no file: no folder another
    user could plant in, none to share), named by the hardware's scope and the GPU's UUID. The kernel drops it when
    the process dies. Two controllers keeping their state in different folders (root's sweep beside a CAP_SYS_ADMIN
    user's, or another POWERPROF_STATE_DIR) each took the other's level for the original: both said "every GPU is back"
    and the GPU stayed capped. The second is refused now, its holder named by the socket's peer credentials.

    An abstract name has no permissions: any local user can bind it first (the scope and the GPU's UUID are public).
    As root, therefore, the lock is a file lock in ROOT_LOCK_DIR (`root_lock_dir`; root's controllers exclude each other
    there), and the name is taken beside it where it is free; a holder of the name that could not change the GPU's limit
    (`could_control`: on NVIDIA, neither root nor CAP_SYS_ADMIN) is no controller: it is said (stderr, `warning`) and
    passed over. Before, such a squatter kept root's `restore` from putting a capped GPU back, and every sweep off it.
    Another user's process stays refused where it could control the GPU (a CAP_SYS_ADMIN user's sweep). Not root: the
    name alone, as before (no folder such a user shares with root).

    `scope`: whose hardware ("nvml" for this machine's GPUs; a simulator's state file for simulated ones). Limit: the
    abstract namespace is per network namespace (a container with a network of its own does not see it)."""

    def __init__(self, scope: str, uuid: str, index: int | None = None):
        self.scope = scope
        self.uuid = uuid
        self.index = index
        self.root_dir = root_lock_dir(scope)
        self._name()
        self.warning: str | None = None  # a holder of a name passed over (root only), as said on stderr
        self._socks: dict[bytes, socket.socket] = {}  # each of `names` held
        self._fd: int | None = None

    def _name(self) -> None:
        """The abstract names and root's lock file. Two names, each taken and either held busy: by the scope's path
        (`name`, the state file's realpath) and by its identity (`scope_identity`, the state folder's inode). By the
        inode alone (f7e660d5), a folder removed and made again while A held the GPU had a new inode, B another name,
        and B took the GPU beside A; by the path alone, a bind mount of the folder was another GPU. Root's lock file is
        named by the identity: a bind mount reaches the same file (a folder made again has lost it: the path's name
        holds then)."""
        digests = [hashlib.sha256(f"{key}\0{self.uuid}".encode()).hexdigest()[:40]
                   for key in dict.fromkeys((self.scope, scope_identity(self.scope)))]
        self.names = tuple(b"\0powerprof-gpu-" + d.encode() for d in digests)
        self.name = self.names[0]
        self.root_path = self.root_dir / f"gpu-{digests[-1]}.lock"

    @property
    def _sock(self) -> socket.socket | None:
        """The socket holding `name`, the path's (None: not held)."""
        return self._socks.get(self.name)

    def _gpu(self) -> str:
        return f"GPU {self.index} ({self.uuid})" if self.index is not None else f"GPU {self.uuid}"

    def _busy(self, pid: int | None, uid: int | None) -> GpuBusyError:
        if pid == os.getpid():  # two controllers of one process, each with a state folder of its own
            return GpuBusyError(f"GPU {self.index if self.index is not None else self.uuid} is already being "
                                "controlled by another controller of this process: close that one first", None)
        who = f"powerprof process {pid} (uid {uid})" if pid else "another powerprof process"
        return GpuBusyError(
            f"{self._gpu()} is already being controlled by {who}, which keeps its restore file and locks in another state "
            "folder (another user's, or another POWERPROF_STATE_DIR). Two controllers on one GPU would fight over "
            "its power limit, and the second would take the first one's level for the original and leave it "
            f"there: wait for it to finish or stop it (kill {pid or 'PID'}); it puts the GPU back when it exits",
            pid,
        )

    def acquire(self, probe: bool = False) -> None:
        """Take the lock (GpuBusyError where a controller holds it). `probe`: as root, create no folder or file (a dry
        run's question: `holder_now` lets it go at once). A controller then calls `refuse_stray_locks`; `restore`
        never does."""
        if self._socks or self._fd is not None:
            return
        if self.scope.startswith("sim:") and not probe:
            # The name is the state folder's identity: made first, so every controller names it by the same folder
            # (one finding it missing was named by its path, one after by its inode). A probe makes nothing: a holder
            # made it.
            with contextlib.suppress(OSError):  # one that cannot be made cannot be written either
                make_dirs(Path(os.path.dirname(self.scope[len("sim:"):]) or "/"))
            self._name()
        root = os.geteuid() == 0
        if root:
            self._root_flock(probe)
        try:
            for name in self.names:
                self._bind(root, name)
        except BaseException:
            self._close_socks()
            self._drop_root_flock()
            raise

    def _root_flock(self, probe: bool) -> None:
        """Root's lock of the GPU: an flock on ROOT_LOCK_DIR/gpu-<digest>.lock holding the holder's PID. The file is
        removed on release (a simulated GPU's name is its state file's: the folder would fill up with tests' names), so
        a lock is kept only on the file that is still at that name (checked after the flock)."""
        if probe:
            try:
                fd = os.open(self.root_path, os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:
                return  # no such file: no root controller holds this GPU
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise self._busy(read_holder_pid(self.root_path), 0) from None
            finally:
                os.close(fd)
            return
        what = f"the machine-wide lock of {self._gpu()}"
        try:
            make_dirs(self.root_dir, 0o700)
            # A simulator's, beside its state file: trusted as the simulator trusts that file's folder (root's, or the
            # sudo user's: `sudo powerprof sweep --simulate` with the state in their home); whoever may write there may
            # change the simulated limits anyway.
            why = (untrusted_out_dir if self.scope.startswith("sim:") else untrusted_place)(self.root_dir)
            if why:
                raise StateFolderError(f"{what}: {self.root_dir} is not root's alone ({why}): remove it (root makes it "
                                       "again, mode 700)")
            for attempt in range(8):
                fd = os.open(self.root_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        raise
                    if attempt >= 3:  # a few short retries: a probe takes it in shared mode for a moment
                        raise self._busy(read_holder_pid(self.root_path), 0) from None
                    time.sleep(0.05)
                    continue
                try:
                    now = os.stat(self.root_path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                st = os.fstat(fd)
                if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                    break
                os.close(fd)  # its holder removed it as we locked it: lock the one at the name now
            else:
                raise StateFolderError(f"{what}: {self.root_path} kept being replaced; try again")
            try:
                os.ftruncate(fd, 0)  # a killed holder's PID may still be there, longer than ours
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                os.close(fd)
                raise
        except OSError as e:
            raise StateFolderError(state_folder_message(what, self.root_path, e)) from None
        self._fd = fd

    def _drop_root_flock(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.unlink(self.root_path)  # still locked: whoever opened it meanwhile sees it gone and opens anew
            except OSError:
                pass
            finally:
                os.close(fd)

    def _bind(self, root: bool, name: bytes | None = None) -> None:
        """Take `name` (default `name`, the path's) into `_socks`, or pass over a holder that is no controller (root,
        `warning`); GpuBusyError where a controller holds it."""
        name = self.name if name is None else name
        unanswered = 0
        large: dict[str, int] = {}  # threads with a table past _LARGE_TABLE_FDS (its size), judged before listed later
        read_whole: set[str] = set()  # those of them whose table a try has read whole since (`_holders_among`)
        counted: frozenset[str] | None = None  # the socket a counted full or answered connect reached
        for attempt in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inheritable: a launched server never holds it
            try:
                s.bind(name)
                # Its peer credentials answer a connect, accepted or not. Never accepted, each connect that asked stays
                # queued until the holder exits, and a full queue answers none: with a queue of 1 the holder went
                # unnamed from the third question on ("another powerprof process", `kill PID`). SOMAXCONN (4096 here,
                # capped by net.core.somaxconn) questions last a long `tune`.
                s.listen(socket.SOMAXCONN)
            except OSError as e:
                s.close()
                if e.errno != errno.EADDRINUSE:
                    raise
            else:
                self._socks[name] = s
                return
            if not root:
                raise self._busy(*_holder(name)) from None
            # Root: the processes that hold the socket now, read through /proc. The peer credentials name the one that
            # called listen(), which may have exited leaving a child of its own holding the socket (that PID gone, or
            # another process's by now); they are the answer only where /proc is partial (a sandbox's ProtectProc).
            # Where /proc was read whole and shows every process, a socket no thread holds is no controller's however
            # a connect goes: a parked one answered (queued by the kernel) named its dead listener, and root refused.
            # Tries 1-5 leave out the large tables of threads that could not control this GPU (their holding is passed
            # over whatever it is). Where a try's scan names no holder, the tables it left out are read whole on that
            # same try, each once a bind, smallest first, until one holds the name: a squatter over 256 descriptors
            # (listening, parked, its listener exited or its queue full) is named and its socket kept on the first try,
            # not after 5 tries and the last look (h-rev4: a root open of 2 GPUs beside 200 processes of 256
            # descriptors 0.9-1.5 s -> 6.9-7.1 s). Not through the peer credentials: they are the squatter's to choose
            # (a forked child holding, a full queue), and root's connects queue on a real controller's socket. The
            # last look reads every table whole, so the name's holders are named and a squatter's socket kept.
            holders, whole, bound = _holders_from_proc(name, scope=self.scope, large=large)
            left_out = sorted(set(large) - read_whole, key=large.__getitem__)
            if not holders and left_out:
                holders = _holders_among(name, left_out, bound)
                read_whole.update(left_out)
            seen_all = whole and _sees_every_process()
            if not holders and not seen_all:
                pid, uid = _holder(name)
                holders = [(pid, uid, None)] if pid else []
            if not holders:
                # No process shows it in its descriptors: gone in between, or held by no controller: a name parked in
                # an SCM_RIGHTS message, or bound and closed in a loop. A few tries, 20 ms apart; refused every time
                # (each controller listens right after its bind), it is passed over. A full queue (EAGAIN) or an
                # answered connect is no proof alone: any user may fill a controller's queue (it never accepts), and a
                # controller answers. They count only where /proc was read whole and shows this process every other (a
                # controller holds its socket open), and only for the one socket the scan found at the name, the same
                # in every try and still there after the connect: a squatter that let go between the scan and the
                # connect left it to a real controller, whose queue, filled, answered the same, and root passed it over.
                answer = _unanswered(name)
                same = len(bound) == 1 and _bound_sockets(name) == bound and counted in (None, bound)
                if answer == "refused":
                    unanswered += 1
                elif answer in ("full", "answered") and seen_all and same:
                    unanswered += 1
                    counted = bound
                if attempt < 4:
                    time.sleep(0.02)
                    continue
                # Once more, after the last connect: a controller that bound the name meanwhile holds it open. And a
                # full or answered queue counted, the socket it reached is still the one at the name, read last (a few
                # ms after the scan's start, not the scan's 0.1 s): without, 1 try in 16 passed over a controller that
                # bound during this scan (h-rev2 f2b).
                holders, _whole, bound = _holders_from_proc(name, scope=None)
                stable = counted is None or bound == counted == _bound_sockets(name)
                if unanswered == 5 and not holders and stable:
                    said = (
                        f"{self._gpu()}: its machine-wide lock name is held, but by no process that holds it open "
                        "(every powerprof controller holds its own and listens), so it is no powerprof controller: "
                        "passed over "
                        f"(root's controllers exclude each other through {self.root_dir})")
                    self._pass_over(said)
                    return
            controlling = [(p, u) for p, u, t in holders if could_control(self.scope, p, u, tid=t)]
            if not holders or controlling:
                raise self._busy(*(controlling[0] if controlling else (None, None)))
            named = ", ".join(dict.fromkeys(f"process {p} (uid {u})" for p, u, _t in holders))
            # Kept from now on: a descriptor of the squatter's own socket, so the name stays bound while root holds the
            # GPU. Passed over and not kept, the name came free when the squatter left, and a controller not run as
            # root (a CAP_SYS_ADMIN user's: the name is all it has) took the GPU beside root's before root's next
            # change could bind it (`reclaim`).
            kept = _take_socket(name, holders, bound)
            if kept is not None:
                self._socks[name] = kept
            said = (
                f"{self._gpu()}: its machine-wide lock name is held by {named}, which could not change this GPU's "
                "power limit (neither root nor CAP_SYS_ADMIN" + (", nor allowed to write the simulator's state" if
                                                                  self.scope.startswith("sim:") else "")
                + "), so it is no powerprof controller: passed over (root's controllers exclude each other through "
                f"{self.root_dir}). Held by another user, the name keeps every controller not run as root (a CAP_SYS_ADMIN "
                f"user's) off this GPU: see `ps -o user,pid,args -p {holders[0][0]}`")
            if kept is None:
                said += ("; its socket could not be kept (pidfd_getfd), so root binds the name at its next limit "
                         "change once it is free")
            self._pass_over(said)
            return

    def _pass_over(self, said: str) -> None:
        """Keep `said` as `warning` and say it on stderr, once: the same holder of both names is one warning."""
        if said != self.warning:
            self.warning = said
            print(f"powerprof: warning: {said}", file=sys.stderr, flush=True)

    def reclaim(self) -> bool:
        """Root, having passed over a holder of a name (`warning`) whose socket it could not keep (`_take_socket`): bind
        each name it lacks now if free, and keep it. Called at each limit change. Whether the name is held now.
        GpuBusyError where a process that could control the GPU holds it now: a controller not run as root (a
        CAP_SYS_ADMIN user's, which has only the name) took it between the squatter leaving and this change. Before,
        False was ignored and root's change went ahead beside it."""
        missing = [n for n in self.names if n not in self._socks]
        if not missing:
            return True
        if self._fd is None:
            return False  # not held at all (released, or never taken)
        for name in missing:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # out of descriptors (EMFILE): False, no raise
            except OSError:
                return False
            try:
                s.bind(name)
                s.listen(socket.SOMAXCONN)
            except OSError as e:
                s.close()
                if e.errno == errno.EADDRINUSE:
                    self._refuse_a_controller(name)
                return False
            self._socks[name] = s
        return True

    def _refuse_a_controller(self, name: bytes) -> None:
        """GpuBusyError where a process that could control the GPU holds `name` now (judged as `_bind` judges)."""
        holders, whole, _bound = _holders_from_proc(name)
        if not holders and not (whole and _sees_every_process()):
            pid, uid = _holder(name)
            holders = [(pid, uid, None)] if pid else []
        controlling = [(p, u) for p, u, t in holders if could_control(self.scope, p, u, tid=t)]
        if not controlling:
            return  # the squatter still, or no one: bound at a later change
        pid, uid = controlling[0]
        raise GpuBusyError(
            f"{self._gpu()}: process {pid} (uid {uid}), which could change its power limit, took its machine-wide lock "
            "name after the squatter root passed over let go: two controllers on one GPU. Stopped before changing it "
            "again (this GPU goes back to its original limit now); that controller may have read this run's level as "
            f"the original and put that back when it ends: once it has (or `kill {pid}`), check the GPU's limit "
            "(nvidia-smi -q -d POWER) and set it back (nvidia-smi -pl) if it is left capped", pid)

    def _close_socks(self) -> None:
        socks, self._socks = self._socks, {}
        for s in socks.values():
            s.close()

    def release(self) -> None:
        self._close_socks()
        self._drop_root_flock()


# How much of this thread's CPU time the stray-lock check may take, all of it (time.thread_time: CPU load alone, 30
# busy loops of another user, skipped a wall-time budget 5 of 5 times); past it the check is skipped, said on stderr.
STRAY_CHECK_BUDGET_S = 0.2
# The most wall time (monotonic) it may take whatever its CPU time: it runs holding every lock (`restore` refused).
# Under 30 busy loops the check of a `su` over 3,000 descriptors took 0.02 s of CPU time and 1.0-1.7 s of wall time.
STRAY_CHECK_WALL_CAP_S = 3.0
# Descriptors read between two looks at the clocks (every 512 overshot the budget 2-3x under load).
_DESCRIPTORS_PER_CLOCK_CHECK = 64
# A controller holds one descriptor of its root lock file (two for a moment, retrying its open): a root process
# holding more of one name is none of ours (only root makes root processes; a setuid program another user exec'd
# over descriptors it opened is root's too), and reading each of them was the cost another user chose.
_MAX_DESCRIPTORS_PER_NAME = 2


class _OverBudget(Exception):
    """The stray-lock check ran past its deadline; the message says where."""


class _Deadline:
    """The stray-lock check's budget: STRAY_CHECK_BUDGET_S of this thread's CPU time and STRAY_CHECK_WALL_CAP_S of wall
    time (monotonic), from now."""

    def __init__(self):
        self.cpu_s = time.thread_time() + STRAY_CHECK_BUDGET_S
        self.wall_s = time.monotonic() + STRAY_CHECK_WALL_CAP_S


def _check_deadline(deadline: _Deadline, where: str) -> None:
    if time.thread_time() > deadline.cpu_s or time.monotonic() > deadline.wall_s:
        raise _OverBudget(where)


_EXCLUSIVE_FLOCK = re.compile(rb"^[0-9]+: FLOCK +[A-Z]+ +WRITE +([0-9]+) +([0-9a-f]+:[0-9a-f]+):([0-9]+) ", re.M)


def _exclusive_flocks(deadline: _Deadline, proc: str = "/proc") -> list[tuple[int, str, int]] | None:
    """(pid, device as /proc/locks writes it, inode) of every exclusive flock held (a waiter's line, "N: -> FLOCK", left
    out), from /proc/locks; None where it cannot be read; _OverBudget past `deadline`. Read in chunks, the deadline
    checked before each: the kernel walks its list of locks from the start at every read of ~4 KB, so reading it all
    costs the square of the host's locks, any user's (2-core test host: 0.19 s at 20k, 0.72 s at 40k, 7.4 s at 100k
    POSIX locks of one unprivileged user). Only exclusive FLOCK lines are kept."""
    try:
        fd = os.open(f"{proc}/locks", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    found: list[tuple[bytes, bytes, bytes]] = []
    rest = b""
    try:
        while True:
            _check_deadline(deadline, f"{proc}/locks")
            chunk = os.read(fd, 1 << 16)
            text, _, rest = (rest + chunk).rpartition(b"\n") if chunk else (rest, b"", b"")
            if b"FLOCK" in text:
                found += _EXCLUSIVE_FLOCK.findall(text)
            if not chunk:
                break
    except OSError:
        return None
    finally:
        os.close(fd)
    return [(int(pid), dev.decode(), int(ino)) for pid, dev, ino in found]


def _fd_fields(where: str) -> dict[str, str]:
    """A descriptor's fdinfo (/proc/<pid>/fdinfo/<n>) as {key: value} ("mnt_id", "ino"); {} where unreadable."""
    out = {}
    try:
        with open(where) as f:
            for line in f:
                k, _, v = line.partition(":")
                out[k] = v.strip()
    except OSError:
        pass
    return out


def _mount_devices(pid: int | str, proc: str = "/proc") -> dict[str, str]:
    """{mount id: device "major:minor"} as process `pid` sees its mounts (its own mount namespace: the tuner unit's
    sandbox has one), read once per process; {} where unreadable."""
    out = {}
    try:
        with open(f"{proc}/{pid}/mountinfo") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2:
                    out[parts[0]] = parts[2]
    except OSError:
        pass
    return out


def refuse_stray_locks(locks: list[MachineLock], proc: str = "/proc") -> str | None:
    """GpuBusyError where another root process holds an exclusive flock on one of these GPUs' root lock files that is no
    longer the one at its path: the lock folder removed or moved aside (or the file removed) while a root controller
    ran. That flock then excluded no one: with both names held by a parked squatter (passed over, and no process holds
    it for root to keep), a second root controller stepped the GPU beside the first (250 W over its 220 W, in the test).
    A controller calls it once, after taking every GPU's locks (one pass for all its GPUs); `restore` never does:
    putting a GPU back is never refused by it. Only a file no less privileged user can make or hold counts
    (`_stray_lock_holders`); a holder seen is looked at twice more, 50 ms apart, and counts only if seen each time (a
    root controller retrying its open as another let go holds the removed file for a moment).
    Its cost is another user's to choose (their locks, their descriptors in a setuid program), and it runs holding
    every lock (`restore` refused meanwhile): past STRAY_CHECK_BUDGET_S of this thread's CPU time, or
    STRAY_CHECK_WALL_CAP_S of wall time (the 50 ms waits not counted), it is skipped, fail-open, said on stderr.
    Returns None (checked, none found) or "skipped: budget (where)"."""
    ours = {lock.root_path.name: (lock, lock._fd) for lock in locks if lock._fd is not None}
    if not ours:
        return None
    fds = {name: fd for name, (_lock, fd) in ours.items()}
    deadline = _Deadline()
    try:
        found = _stray_lock_holders(fds, deadline, proc)
        for _ in range(2):
            if not found:
                return None
            time.sleep(0.05)
            deadline.wall_s += 0.05  # the wait is the check's rule, not its cost (and no CPU time)
            # Only the holders seen can count again: reading every candidate each time tripled another user's cost.
            again = _stray_lock_holders(fds, deadline, proc, only={pid for pid, _where in found.values()})
            found = {name: held for name, held in again.items() if name in found and held[0] == found[name][0]}
    except _OverBudget as e:
        folder = next(iter(ours.values()))[0].root_dir
        print(f"powerprof: warning: the check for a controller whose lock file was taken out of {folder} was skipped: "
              f"over its budget ({STRAY_CHECK_BUDGET_S} s of CPU time, {STRAY_CHECK_WALL_CAP_S} s in all) reading {e} "
              "(another process's many locks or descriptors, or a loaded CPU, make it slow). A second root controller "
              "is not refused by it this time: don't remove or move "
              f"{folder} while a controller runs", file=sys.stderr, flush=True)
        return f"skipped: budget ({e})"
    if not found:
        return None
    name, (pid, where) = sorted(found.items())[0]
    lock = ours[name][0]
    if pid == os.getpid():
        raise lock._busy(pid, 0)
    raise GpuBusyError(
        f"{lock._gpu()} is already being controlled by powerprof process {pid} (uid 0), whose machine-wide lock file "
        f"was removed or moved out of {lock.root_dir} while it ran (it holds {where}), so that folder's lock no longer "
        "excludes it. Two controllers on one GPU would fight over its power limit: wait for it to finish or stop it "
        f"(kill {pid}); it puts the GPU back when it exits. Don't remove or move {lock.root_dir} while a controller "
        "runs", pid)


def _stray_lock_holders(ours: dict[str, int], deadline: _Deadline, proc: str = "/proc",
                        only: set[int] | None = None) -> dict[str, tuple[int, str]]:
    """{lock name: (pid, path it holds)} for each of root's lock names in `ours` (gpu-<digest of the GPU>.lock: the
    descriptor of our file, the one at the lock's path now) that another root process holds an exclusive flock on, on
    the lock folder's file system, in a file that is not ours: removed ("... (deleted)") or moved aside with its folder.
    In one pass, and only where it counts: /proc/locks names the processes holding an exclusive flock on that file
    system (its size is the host's locks, not its descriptors); only a process of root's (its /proc entry root's) is
    read, its descriptors listed once, and one holding more than _MAX_DESCRIPTORS_PER_NAME of a name is none of ours.
    A descriptor whose link ends in one of the names counts where, in this order (cheapest first): its inode (fdinfo
    `ino:`) is one that process flocked and not ours; its mount's device (fdinfo mnt_id in that process's mountinfo,
    read once per process) is our file's: never a stat before that, as a stat of another user's FUSE file can hang;
    then it is a regular file, root's, mode 0600. No less privileged user can make such a file, nor get root to hold
    one for it: a file of that public name held by any user made root's controllers and `restore` refuse before
    (6253a2d4). Where /proc cannot be read, nothing is found (the gap stays open there, as before). _OverBudget past
    `deadline`. `only`: the processes looked at (None: every candidate)."""
    mine = {}
    for name, fd in ours.items():
        try:
            mine[name] = os.fstat(fd)
        except OSError:
            continue
    flocks = _exclusive_flocks(deadline, proc) if mine else None
    if not flocks:
        return {}
    me, our_inodes = os.getpid(), {st.st_ino for st in mine.values()}
    devs = {dev for pid, dev, ino in flocks if pid == me and ino in our_inodes}
    candidates: dict[int, set[int]] = {}
    for pid, dev, ino in flocks:
        if pid > 0 and ino not in our_inodes and (not devs or dev in devs) and (only is None or pid in only):
            candidates.setdefault(pid, set()).add(ino)
    if not candidates:
        return {}
    self_mounts = _mount_devices("self", proc)
    our_mounts = {name: self_mounts.get(_fd_fields(f"{proc}/self/fdinfo/{ours[name]}").get("mnt_id", ""))
                  for name in mine}
    found: dict[str, tuple[int, str]] = {}
    for pid, inodes in sorted(candidates.items()):
        _check_deadline(deadline, f"{proc}/{pid}")
        matches: list[tuple[str, str, str]] = []
        counts: dict[str, int] = {}
        try:
            if os.stat(f"{proc}/{pid}").st_uid != 0:
                continue  # another user's process: whatever it holds, root gave it nothing of its lock folder's
            with os.scandir(f"{proc}/{pid}/fd") as entries:
                for i, e in enumerate(entries):
                    if i % _DESCRIPTORS_PER_CLOCK_CHECK == _DESCRIPTORS_PER_CLOCK_CHECK - 1:
                        _check_deadline(deadline, f"{proc}/{pid}/fd")
                    link = _readlink(e.path)
                    name = os.path.basename(link.removesuffix(" (deleted)")) if link else None
                    if name in mine:
                        matches.append((e.name, link, name))
                        counts[name] = counts.get(name, 0) + 1
                        if counts[name] > _MAX_DESCRIPTORS_PER_NAME:
                            break  # none of ours: the rest of its descriptors are not read
        except OSError:
            continue  # gone: it holds nothing now
        if any(n > _MAX_DESCRIPTORS_PER_NAME for n in counts.values()):
            continue  # none of ours (_MAX_DESCRIPTORS_PER_NAME)
        mounts = None
        for num, link, name in matches:
            own = mine[name]
            if name in found or our_mounts[name] is None:
                continue
            info = _fd_fields(f"{proc}/{pid}/fdinfo/{num}")
            ino = info.get("ino", "")
            if ino.isdigit() and (int(ino) not in inodes or int(ino) == own.st_ino):
                continue  # not the file it flocked (no `ino:` before Linux 5.14: the stat below says)
            if mounts is None:
                mounts = _mount_devices(pid, proc)
            if mounts.get(info.get("mnt_id", "")) != our_mounts[name]:
                continue
            try:
                st = os.stat(f"{proc}/{pid}/fd/{num}")
            except OSError:
                continue
            if (stat.S_ISREG(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
                    and st.st_dev == own.st_dev and st.st_ino in inodes and st.st_ino != own.st_ino):
                found[name] = (pid, link)
    return found


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


def _unanswered(name: bytes) -> str | None:
    """How a connect to `name` goes: "refused" (bound and not listening, or no longer bound: no controller's), "full"
    (its listen queue full: EAGAIN, never accepted; a controller's may be too), "answered" (queued by the kernel,
    whoever holds the socket; a controller's is too), None otherwise."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.settimeout(1.0)
            c.connect(name)
    except TimeoutError:
        return "full"
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return "refused"
        return "full" if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) else None
    return "answered"


_PID_NS_INIT_INO = 0xEFFFFFFC  # the first PID namespace's inode number (the kernel's PROC_PID_INIT_INO)
CAP_SYS_PTRACE = 19


def _sees_every_process(proc: str = "/proc", pid_ns_ino: int | None = None) -> bool:
    """Whether this process's /proc shows it every process's descriptors: in the first PID namespace (a process of an
    enclosing one, sharing this network namespace, shows in no /proc here), with CAP_SYS_PTRACE (hidepid and the ptrace
    check hide nothing then), its /proc mounted without hidepid (ProtectProc= in a unit). False where unknown."""
    try:
        if pid_ns_ino is None:
            pid_ns_ino = os.stat(f"{proc}/self/ns/pid").st_ino
        cap = int(_status("self", proc)["CapEff"][0], 16)
        with open(f"{proc}/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except (OSError, KeyError, IndexError, ValueError):
        return False
    if pid_ns_ino != _PID_NS_INIT_INO or not cap >> CAP_SYS_PTRACE & 1:
        return False
    for m in mounts:
        if len(m) > 4 and m[4] == "/proc" and "-" in m:
            options = m[m.index("-") + 3:][:1]
            if any(o.startswith("hidepid=") and o not in ("hidepid=0", "hidepid=off") or o == "subset=pid"
                   for o in ",".join(options).split(",")):
                return False
    return True


def _task(pid: int | str, tid: int | None) -> str:
    """The /proc entry of `pid`'s thread `tid` (None: the process's own entry, its thread-group leader's)."""
    return f"{pid}" if tid is None else f"{pid}/task/{tid}"


def _same_userns(pid: int | str, proc: str = "/proc") -> bool:
    """Whether `pid` (or "pid/task/tid") is in this process's user namespace (its capabilities count here); True where
    unknown."""
    try:
        a, b = os.stat(f"{proc}/{pid}/ns/user"), os.stat("/proc/self/ns/user")
    except OSError:
        return True
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _name_sockets(name: bytes, proc: str = "/proc") -> tuple[set[str], frozenset[str]] | None:
    """(every socket with the abstract `name` as its address, "socket:[inode]": the one bound to it and those accepted
    from it; those of them not connected: the bound one, listening or not), from /proc/net/unix; None where unreadable.
    A connect still queued has inode 0 (no file yet): left out, as anyone may add one."""
    want = "@" + name[1:].decode(errors="replace")
    every, unconnected = set(), set()
    try:
        with open(f"{proc}/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8 and parts[7] == want and parts[6] != "0":
                    every.add(f"socket:[{parts[6]}]")
                    if parts[5] == "01":  # SS_UNCONNECTED
                        unconnected.add(f"socket:[{parts[6]}]")
    except OSError:
        return None
    return every, frozenset(unconnected)


def _bound_sockets(name: bytes, proc: str = "/proc") -> frozenset[str] | None:
    """The socket bound to the abstract `name` now (`_name_sockets`), to tell it from one bound after a scan."""
    found = _name_sockets(name, proc)
    return None if found is None else found[1]


_LARGE_TABLE_FDS = 256  # a descriptor table past this many entries is read only where its thread could control


def _holders_from_proc(name: bytes, proc: str = "/proc", scope: str | None = None, large: dict[str, int] | None = None,
                       ) -> tuple[list[tuple[int, int | None, int]], bool, frozenset[str]]:
    """((pid, uid, tid) of every thread holding a socket bound to the abstract `name`, whether every process's and
    thread's descriptors were read (False: /proc/net/unix or a table unreadable, not just gone), the bound socket(s)
    this scan looked for (`_bound_sockets`)), through /proc (root reads
    every process's descriptors): a holder that never listens, or whose queue is full, answers no connect. Every thread's
    descriptors (/proc/<pid>/task/<tid>/fd), judged by that thread's status: a thread whose thread-group leader has
    exited (a zombie: /proc/<pid>/fd lists nothing) or that unshared its descriptor table holds what the leader's list
    lacks. Read from the leader's alone, such a holder went unseen, and with its queue full no connect named it either:
    root's `restore` refused, "another powerprof process", and the GPU stayed capped. A thread sharing its leader's
    table (kcmp says so) is not read again: on a loaded 2-core test host, reading every thread's took 0.4-0.9 s, this
    0.08-0.13 s, the leaders' alone 0.03-0.08 s.
    `scope` given: a table of more than _LARGE_TABLE_FDS entries is read only where its thread could control `scope`'s
    GPUs (`could_control`, its status read then, unknown counting as could); another's is left out, counted as read (it
    decides no refusal: `_bind` reads it on a try that names no holder, and its last look). Its size is another user's
    to choose: a setuid `su` over 19,000 descriptors was read 6 times per name. Small tables are read whole without a
    status read, as before: reading every thread's status made 1,000-3,000 idle `sleep`s cost 3.4-7.4 s an acquire
    (de5ebf73, reverted). `large`: the threads ("pid/task/tid") whose such table a scan left out, each with its table's
    size, added to here; judged before their table is listed (listing 19,000 entries took 30-75 ms), whoever has that
    entry now."""
    sockets = _name_sockets(name, proc)
    if sockets is None:
        return [], False, frozenset()
    inodes, bound = sockets
    found = []
    whole = True
    for entry in os.scandir(proc) if inodes else ():
        if not entry.name.isdigit():
            continue
        try:
            tids = [t for t in os.listdir(f"{proc}/{entry.name}/task") if t.isdigit()]
        except OSError as e:
            whole &= e.errno in (errno.ENOENT, errno.ESRCH)  # gone; anything else hides it
            continue
        for tid in sorted(tids, key=lambda t: t != entry.name):  # the leader first: the others mostly share its table
            if tid != entry.name and _shares_files(int(entry.name), int(tid)):
                continue
            where = f"{entry.name}/task/{tid}"
            if scope is not None and large is not None and where in large and not _may_control(scope, where, proc):
                continue
            try:
                fds = os.listdir(f"{proc}/{where}/fd")
            except OSError as e:
                whole &= e.errno in (errno.ENOENT, errno.ESRCH)
                continue
            if scope is not None and len(fds) > _LARGE_TABLE_FDS and not _may_control(scope, where, proc):
                if large is not None:
                    large[where] = len(fds)
                continue
            if any(_readlink(f"{proc}/{where}/fd/{fd}") in inodes for fd in fds):
                found.append((int(entry.name), _status(where, proc).get("Uid", [None, None])[1], int(tid)))
    return [(p, int(u) if u is not None and u.isdigit() else None, t) for p, u, t in found], whole, bound


def _holders_among(name: bytes, threads: list[str], bound: frozenset[str],
                    proc: str = "/proc") -> list[tuple[int, int | None, int]]:
    """[(pid, uid, tid)] of the first of `threads` ("pid/task/tid", in order) whose table, read whole, holds a socket of
    the abstract `name`, or []; [] too where the name's bound socket is no longer `bound` (the scan's). Each of
    `threads` could not control the GPU (a large table `_holders_from_proc` left out), so one such holder is enough to
    pass the name over and keep its socket; the tables after it are not read (another user's size to choose)."""
    sockets = _name_sockets(name, proc)
    if sockets is None or sockets[1] != bound:
        return []
    inodes = sockets[0]
    for where in threads:
        try:
            fds = os.listdir(f"{proc}/{where}/fd")
        except OSError:
            continue  # gone or unreadable: the last look reads it again
        if any(_readlink(f"{proc}/{where}/fd/{fd}") in inodes for fd in fds):
            uid = _status(where, proc).get("Uid", [None, None])[1]
            pid, _task, tid = where.split("/")
            return [(int(pid), int(uid) if uid is not None and uid.isdigit() else None, int(tid))]
    return []


def _may_control(scope: str, where: str, proc: str = "/proc") -> bool:
    """Whether thread `where` ("pid/task/tid") could control `scope`'s GPUs (`could_control` by its own status); True
    where unknown (gone, unreadable)."""
    uid = _status(where, proc).get("Uid", [None, None])[1]
    if uid is None or not uid.isdigit():
        return True
    pid, _, tid = where.partition("/task/")
    return could_control(scope, int(pid), int(uid), proc, tid=int(tid))


_SYS_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}.get(os.uname().machine)
_PIDFD_THREAD = os.O_EXCL  # pidfd_open's flag for a thread that is not its group's leader (Linux 6.9)


def _take_socket(name: bytes, holders: list[tuple[int, int | None, int]], bound: frozenset[str],
                 proc: str = "/proc") -> socket.socket | None:
    """A descriptor of our own for the one socket bound to the abstract `name` (`bound`, as the scan found it), copied
    out of a holder's descriptor table (pidfd_getfd: root, CAP_SYS_PTRACE), listening; None where it cannot be (no
    pidfd_getfd here, the holder gone, the socket no longer in its table). Held, the name stays bound whoever else lets
    go of it."""
    if _SYS_PIDFD_GETFD is None or len(bound) != 1:
        return None
    want = next(iter(bound))
    for pid, _uid, tid in holders:
        where = _task(pid, tid)
        try:
            fds = os.listdir(f"{proc}/{where}/fd")
        except OSError:
            continue
        for fd in fds:
            if _readlink(f"{proc}/{where}/fd/{fd}") != want:
                continue
            try:
                # The thread found holding it (its leader may be a zombie, with no table); the process where only the
                # peer credentials named it (tid None).
                pidfd = os.pidfd_open(pid, 0) if tid in (None, pid) else os.pidfd_open(tid, _PIDFD_THREAD)
            except OSError:
                continue
            try:
                got = _libc_call().syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)  # close-on-exec, as the kernel gives it
            finally:
                os.close(pidfd)
            if got < 0:
                continue
            # The holder may have swapped that descriptor for another file since the scan: the copy is checked to be
            # the socket before it is made one. socket.socket(fileno=) of a regular file raised (ENOTSOCK) and leaked
            # the copy, and root's `restore` failed with the GPU capped. Never raises: None, the copy closed.
            s = None
            try:
                st = os.fstat(got)
                if stat.S_ISSOCK(st.st_mode) and f"socket:[{st.st_ino}]" == want:
                    s, got = socket.socket(fileno=got), -1  # s owns the copy now
                    if s.getsockname() == name:
                        # Bound only: ours listens now, and a connect names root. Never one already listening:
                        # listen() sets the peer credentials to the caller's, and every later refusal named root's
                        # process (finished by then), not the squatter.
                        with contextlib.suppress(OSError):
                            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                                s.listen(socket.SOMAXCONN)
                        s, kept = None, s
                        return kept
            except (OSError, ValueError):
                pass
            finally:
                if s is not None:
                    s.close()
                elif got >= 0:
                    os.close(got)
    return None


def _libc_call():
    global _libc
    if _libc is None:
        import ctypes  # noqa: PLC0415

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(os.uname().machine)
_KCMP_FILES = 2
_libc = None


def _shares_files(pid: int, tid: int) -> bool:
    """Whether thread `tid` shares its leader `pid`'s descriptor table (kcmp KCMP_FILES); False where unknown (no kcmp
    here, or it failed): then the thread's own table is read. A zombie leader has none, so no thread shares it."""
    if _SYS_KCMP is None:
        return False
    return _libc_call().syscall(_SYS_KCMP, pid, tid, _KCMP_FILES, 0, 0) == 0


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _status(pid: int | str, proc: str = "/proc") -> dict[str, list[str]]:
    """/proc/<pid>/status (or a thread's, "pid/task/tid") as {key: fields}; {} where it cannot be read (the process
    gone)."""
    out: dict[str, list[str]] = {}
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                out[key] = rest.split()
    except OSError:
        return {}
    return out


CAP_DAC_OVERRIDE = 1


def could_control(scope: str, pid: int | None, uid: int | None, proc: str = "/proc", tid: int | None = None) -> bool:
    """Whether the process `pid` (uid `uid`) could change the limits of `scope`'s GPUs, and so may be a controller whose
    lock root must respect. Changing a power limit on NVIDIA needs root or CAP_SYS_ADMIN (privilege.CAP_SYS_ADMIN in
    its effective set); a simulator's limits, a write in its state file's folder or the file itself (or
    CAP_DAC_OVERRIDE). Anything unknown (the process gone, its status unreadable, a scope not known here) counts as
    could: a refusal, never a second controller. A process whose real uid is not its effective one is none: a setuid
    program (passwd at its prompt, root in its effective uid) that a squatter exec'd holding the socket; no controller
    runs so (sudo and systemd set both, a script cannot be setuid). `tid`: the thread found holding the socket, judged by
    its own status (a thread's credentials may differ from its leader's, and a zombie leader's are no one's)."""
    if uid is None or pid is None:
        return True
    where = _task(pid, tid)
    st = _status(where, proc)
    try:
        cap = int(st["CapEff"][0], 16)
        ruid, euid = int(st["Uid"][0]), int(st["Uid"][1])
        gids = {int(g) for g in st.get("Groups", [])} | {int(st["Gid"][1])}
    except (KeyError, IndexError, ValueError):
        return True
    if euid != uid:
        return True  # not the process the caller found: unknown
    if ruid != euid:
        return False
    if not _same_userns(where, proc):
        cap = 0  # root of a user namespace of its own (unshare -U -r): every capability there, no privilege over the GPU
    if euid == 0 or cap >> CAP_SYS_ADMIN & 1:
        return True
    if scope == "nvml":
        return False
    if scope.startswith("sim:"):
        if cap >> CAP_DAC_OVERRIDE & 1:
            return True
        state = scope[len("sim:"):]
        return any(_may_write(p, euid, gids) for p in (state, os.path.dirname(state) or "/"))
    return True


def _may_write(path: str, uid: int, gids: set[int]) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    mode = st.st_mode
    if st.st_uid == uid:
        return bool(mode & 0o200)
    if st.st_gid in gids:
        return bool(mode & 0o020)
    return bool(mode & 0o002)
