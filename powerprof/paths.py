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


def legacy_state_dirs(env: dict | None = None, euid: int | None = None) -> list[Path]:
    """Older state folders still to be searched for pending restore files (root's default only)."""
    env = os.environ if env is None else env
    if env.get(STATE_DIR_ENV) or (os.geteuid() if euid is None else euid) != 0:
        return []
    return [LEGACY_ROOT_STATE_DIR]


def path_problem(path) -> str | None:
    """Why `path` cannot name a file at all (a name longer than the file system takes, a loop of symlinks), with the
    fix; None where it can (whether or not it exists). Path.exists() raises for these: an OSError traceback."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        import errno  # noqa: PLC0415

        fix = "give a shorter name" if e.errno == errno.ENAMETOOLONG else "give another path"
        return f"{e.strerror or e}; {fix}"
    return None
