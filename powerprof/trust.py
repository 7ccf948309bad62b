"""Whether root may act on a path: every folder and symlink on its way root's (or the sudo user's) and writable by no one else."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from pathlib import Path
from typing import Callable, Iterable


class PlaceRefused(PermissionError):
    """A file powerprof refuses to use where it is (as root, in a folder another user controls; a symlink at a name it
    writes): the message names it, why and the fix, and nothing was written. A stop, said once as the command's error,
    not a failure of the step that met it (the simulator's `SimStateRefused` is one)."""


def _file_reason(path, st, owners, euid, root_too) -> str | None:
    who = "root" if euid == 0 else f"uid {euid}" + (" or root" if root_too else "")
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a symlink?)"
    if st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, not {who}"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class PrivateGroups:
    """The user-private groups of `uids`, root's never, as a set asked with `in`: a user's primary group (its passwd
    entry) named as the user, whose member list names no one else and which no other passwd entry has as its primary
    group, the test pam_umask's `usergroups` makes before it sets umask 002 (Ubuntu's and Fedora's default: a user's
    folders are 0775 with that group, and group write lets no one but the user write there). A user whose primary group
    it is is in it without being listed (nogroup: nobody's, and sync's and _apt's on Debian), hence the whole passwd
    database (`all_users`, default pwd.getpwall): read at the first `in` and once, so a path with no group-writable
    folder never reads it; one that cannot be read makes no group private (fail closed). For the user who ran sudo with
    no passwd entry (LDAP down): SUDO_GID, if its group has no entry, or is named as SUDO_USER with no
    other member (a shared group such as `users` lists no one whose primary group it is). Root's group is left out: RHEL's
    `operator` has gid 0 as its primary group, and root's own umask is 022."""

    def __init__(self, uids, env: dict | None = None, all_users: Callable[[], Iterable] | None = None):
        self.uids = tuple(u for u in uids if u != 0)
        self.env = os.environ if env is None else env
        self.all_users = all_users
        self._gids: frozenset[int] | None = None
        self.refused: dict[int, str] = {}  # a gid that would be private but for another user's entry: why not

    def _candidates(self) -> set[int]:
        """The groups private by their own entries alone (primary, named as the user, no other member)."""
        out = set()
        for uid in self.uids:
            try:
                pw = pwd.getpwuid(uid)
                name, gid = pw.pw_name, pw.pw_gid
            except KeyError:
                if str(uid) != self.env.get("SUDO_UID") or not self.env.get("SUDO_GID", "").isdigit():
                    continue
                # sudo's own record of the name: a group named otherwise is shared (`users`, gid 100, lists no
                # one whose primary group it is), not this user's.
                name, gid, entry = self.env.get("SUDO_USER") or "", int(self.env["SUDO_GID"]), False
            else:
                entry = True
            try:
                g = grp.getgrgid(gid)
            except KeyError:
                if not entry:
                    out.add(gid)
                continue
            if name and g.gr_name == name and set(g.gr_mem) <= {name}:
                out.add(gid)
        return out

    def _work_out(self) -> frozenset[int]:
        gids = self._candidates()
        if gids:
            try:
                users = list((self.all_users or pwd.getpwall)())
            except Exception as e:  # whatever NSS raises: no group is private, never all of them
                self.refused = {g: f"the passwd database could not be read ({type(e).__name__}: {e}), so whose "
                                   f"primary group {g} is is unknown" for g in gids}
                return frozenset()
            for pw in users:
                # The same uid by another name is the same user; root may write anywhere anyway.
                if pw.pw_gid in gids and pw.pw_uid not in (0, *self.uids):
                    self.refused[pw.pw_gid] = (f"group {pw.pw_gid} is also the primary group of uid {pw.pw_uid} "
                                               f"({pw.pw_name}), who can write there without being listed")
            return frozenset(g for g in gids if g not in self.refused)
        return frozenset()

    def __contains__(self, gid: object) -> bool:
        if self._gids is None:
            self._gids = self._work_out()
        return gid in self._gids


def private_gids(uids, env: dict | None = None, all_users: Callable[[], Iterable] | None = None) -> PrivateGroups:
    """The user-private groups of `uids` (`PrivateGroups`), worked out when first asked."""
    return PrivateGroups(uids, env, all_users)


def _folder_reason(folder: Path, dst, euid: int, sticky_ok: bool = False, also: tuple[int, ...] = (),
                   groups: PrivateGroups | None = None) -> str | None:
    """Why a folder is not trusted: owned by someone else than root, `euid` or `also`; writable by others (a root-owned
    sticky folder excepted where `sticky_ok`); or writable by its group, unless that group is one of those users'
    own private group (`groups`, default `private_gids` of them)."""
    who = "root" if euid == 0 else f"uid {euid}"
    if dst.st_uid not in (0, euid, *also):
        return f"its folder {folder} is owned by uid {dst.st_uid}, not {who}" + "".join(f" or uid {u}" for u in also)
    if sticky_ok and dst.st_mode & stat.S_ISVTX and dst.st_uid == 0:
        return None
    if dst.st_mode & 0o020 and not dst.st_mode & 0o002:
        groups = private_gids((0, euid, *also)) if groups is None else groups
        if dst.st_gid in groups:
            return None
        why = groups.refused.get(dst.st_gid) or "not their primary group, not named as them, or with other members"
        return (f"its folder {folder} is writable by group or others (mode {stat.S_IMODE(dst.st_mode):o}; its group "
                f"{dst.st_gid} is not the private group of a user trusted here: {why})")
    if dst.st_mode & 0o022:
        return f"its folder {folder} is writable by group or others (mode {stat.S_IMODE(dst.st_mode):o})"
    return None


def untrusted_folder(folder: Path, euid: int | None = None, also: tuple[int, ...] = (), link_ok: bool = False,
                     groups: PrivateGroups | None = None) -> str | None:
    """Why root must not write in `folder`; None when only root could have written it (or this process is not
    root). In a folder another user can write, that user could point any name root writes, replaces or deletes
    (a symlink) at any file on the machine. The folder and every folder above it must be root's and writable by no
    one else (root's sticky /tmp excepted above it: others cannot rename in it; group write by a trusted user's own
    private group allowed, `private_gids`); the folder itself not a symlink unless `link_ok` (then a symlink of a
    trusted user's, as any on the way), and every symlink on the way root's (`_trusted_target`: a path's real folders
    are not enough, whoever owns a symlink on the way can point it elsewhere after the check). `also`: uids trusted
    beside root (`untrusted_out_dir`); `groups`: their private groups when the caller knows them better."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None
    try:
        if os.path.islink(folder):
            owner = os.lstat(folder).st_uid
            if not link_ok or owner not in (0, euid, *also):
                return f"{folder} is a symlink" + (f" owned by uid {owner}" if link_ok else "")
        real = _trusted_target(Path(folder), euid, also, groups)
        why = _folder_reason(Path(real), os.stat(real), euid, also=also, groups=groups)
    except PermissionError as e:
        why = str(e)
    except OSError as e:
        return f"cannot inspect {folder}: {e.strerror or e}"
    return why and why.replace("its folder ", "", 1)


def untrusted_contents(folder: Path, euid: int | None = None, depth: int = 2) -> str | None:
    """Why root must not act inside `folder` (itself trusted: `untrusted_folder`): a folder in it, down to `depth`
    levels, that `untrusted_folder` refuses (another user's, writable by others, or reached through a symlink not
    root's). In such a folder that user could link a name root writes or deletes to any file. None when this process
    is not root."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None
    todo = [(Path(folder), depth)]
    while todo:
        here, left = todo.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
            dirs = [e for e in entries if e.is_dir()]  # follows a symlink: one to a folder is judged as one on the way
        except OSError as e:  # unreadable, or a symlink loop
            return f"cannot inspect {here}: {e.strerror or e}"
        for e in dirs:
            why = untrusted_folder(Path(e.path), euid, link_ok=True)
            if why:
                return why
            if left > 1 and not e.is_symlink():  # a root link's folder: its own names were judged on the way
                todo.append((Path(e.path), left - 1))
    return None


def untrusted_place(path: Path, euid: int | None = None, also: tuple[int, ...] = (),
                    groups: PrivateGroups | None = None) -> str | None:
    """`untrusted_folder` of `path`, or of the nearest folder above it that exists: what root would create
    there is checked before it is created. A symlink there is judged by its owner as one on the way (`link` and
    `link/new` alike). `path` is joined to the working folder, never normalised: `a/link/../b` goes through `link`
    (the kernel's `..` is the link target's parent; abspath's would be `a`'s)."""
    try:  # no os.getcwd() for an absolute path: one is written from a removed current folder too (a traceback)
        there = Path(path if os.path.isabs(path) else os.path.join(os.getcwd(), path))
    except FileNotFoundError:
        return (f"cannot inspect {path}: the current folder no longer exists (removed); cd to one that does, or give "
                "an absolute path")
    while not os.path.lexists(there) and there != there.parent:
        if there.name == "..":  # `x/..` missing: x is no folder, and `x/..`'s parent as text is not its parent
            return f"cannot inspect {path}: {there} does not exist"
        there = there.parent
    return untrusted_folder(there, euid, also, link_ok=True, groups=groups)


def sudo_uid(env: dict | None = None) -> int | None:
    """The uid of the user who ran `sudo` (SUDO_UID, which sudo itself sets), or None."""
    env = os.environ if env is None else env
    v = env.get("SUDO_UID", "")
    return int(v) if v.isascii() and v.isdigit() and 0 < int(v) < 2**32 else None


def untrusted_out_dir(path: Path, euid: int | None = None, env: dict | None = None) -> str | None:
    """Why root must not write a run's results at `path` (`sweep --out`, `measure --out`): `untrusted_place`, with the
    user who ran sudo trusted beside root (`sudo powerprof sweep` from their home, ./runs: they chose the folder, and
    whoever may run powerprof as root may run any command as root, `--launch`); no one else's folder."""
    uid = sudo_uid(env)
    also = () if uid is None else (uid,)
    groups = private_gids((0, os.geteuid() if euid is None else euid, *also), env)
    return untrusted_place(path, euid, also=also, groups=groups)


MAX_SYMLINKS = 40  # as the kernel's own limit on one lookup


def untrusted_out_file(path: Path, euid: int | None = None, env: dict | None = None) -> str | None:
    """Why root must not write the file `path` names, as given: `untrusted_out_dir` of its folder, and, where it is a
    symlink, the link's own owner (root's, or the user's who ran sudo) and the folder it points into, link after link.
    A caller that writes through the links resolves `path` only after this passes: resolved first, only the target's
    folder was judged, and another user's link on the way (their folder `d` -> a root-only folder) chose the file root
    wrote."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return None
    uid = sudo_uid(env)
    trusted = (0, euid) + (() if uid is None else (uid,))
    here = Path(path)
    for _hop in range(MAX_SYMLINKS + 1):
        why = untrusted_out_dir(here.parent, euid, env)
        if why:
            return why
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"cannot inspect {here}: {e.strerror or e}"
        if not stat.S_ISLNK(st.st_mode):
            return None
        if st.st_uid not in trusted:
            return f"{here} is a symlink owned by uid {st.st_uid}"
        here = Path(os.path.join(here.parent, os.readlink(here)))  # joined, not normalised: `..` as the kernel
    return f"too many levels of symbolic links resolving {path}"


def _trusted_target(path: Path, euid: int, also: tuple[int, ...] = (), groups: PrivateGroups | None = None) -> str:
    """The file `path` names, found component by component: every folder on the way (from /) owned by root or `euid`
    and writable by no one else (a root-owned sticky folder excepted: /tmp, /nix/store), and every symlink on the way,
    the file's own included, owned by root or `euid` (a symlink's mode means nothing; who may replace it is its
    folder's, checked like the others). So a symlink into a read-only root-owned store (NixOS's /etc) is followed,
    and nothing another user could have written or replaced is. PermissionError with the reason otherwise."""
    who = "root" if euid == 0 else f"uid {euid}"
    joined = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)  # no getcwd() for an absolute path
    todo = list(reversed(Path(joined).parts[1:]))  # joined, not normalised: `..` as the kernel
    cur, hops = "/", 0
    why = _folder_reason(Path("/"), os.stat("/"), euid, sticky_ok=True, also=also, groups=groups)
    if why:
        raise PermissionError(why)
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            cur = os.path.dirname(cur)  # a folder already checked on the way down
            continue
        nxt = os.path.join(cur, name)
        st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, euid, *also):
                raise PermissionError(f"{path}: the symlink {nxt} on its way is owned by uid {st.st_uid}, not {who}")
            hops += 1
            if hops > MAX_SYMLINKS:
                raise OSError(errno.ELOOP, f"too many levels of symbolic links resolving {path}")
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            todo.extend(reversed(Path(target).parts[1:] if target.startswith("/") else Path(target).parts))
            continue
        if todo:  # a folder on the way
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"{nxt} is not a folder", str(path))
            why = _folder_reason(Path(nxt), st, euid, sticky_ok=True, also=also, groups=groups)
            if why:
                raise PermissionError(why)
        cur = nxt
    return cur


def read_trusted(path: Path, euid: int | None = None) -> bytes:
    """The bytes of `path`, read only if no one but `euid` (or root) could have written them: every folder up to /
    owned by root or `euid` and writable by no one else (a root-owned sticky folder excepted: others cannot rename in
    it), every symlink on the way owned by root or `euid` (`_trusted_target`), the file itself opened without following
    a further symlink and checked on the open descriptor (no swap between check and read). OSError with the reason
    otherwise (a config file that decides what root does to the GPUs)."""
    euid = os.geteuid() if euid is None else euid
    path = Path(path)
    target = _trusted_target(path, euid)
    fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        why = _file_reason(path, os.fstat(f.fileno()), {euid}, euid, False)
        if why:
            raise PermissionError(why)
        return f.read()


def out_dir_refusal(path: Path, what: str = "run directory", option: str = "--out", env: dict | None = None) -> str | None:
    """The error for a command that would write its results at `path` as root where `untrusted_out_dir` refuses
    (`sweep --out`, `measure --out`, `monitor --output` and `--recover`); None where root may write there."""
    why = untrusted_out_dir(path, env=env)
    if not why:
        return None
    return (f"{what} {path}: refusing to write there as root: {why}; another user could make root write any file "
            f"through a symlink there. Fix: {option} in a folder of root's own or of the user who ran sudo, "
            "writable by no one else")
