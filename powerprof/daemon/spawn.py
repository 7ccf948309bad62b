"""The command line that starts one of the daemon's Python children isolated from its working directory and environment."""

from __future__ import annotations

import sys
from pathlib import Path

# `python -m pkg.mod` puts the working directory first on sys.path (a `powerprof/` planted in /tmp would run
# as the daemon's user), and honours PYTHONPATH and the user's site-packages. `-I` drops all three; the
# child then imports powerprof from the one directory this process imported it from (derived from this
# module's own file, never from the cwd or the environment), put first only when the interpreter's own
# path does not already hold it (an installed package: nothing changes).
_BOOT = ("import sys, runpy; root, mod = sys.argv[1], sys.argv[2]; del sys.argv[1:3]; "
         "root in sys.path or sys.path.insert(0, root); runpy.run_module(mod, run_name='__main__', alter_sys=True)")


def package_root() -> str:
    """The directory holding the `powerprof` package this process runs."""
    return str(Path(__file__).resolve().parent.parent.parent)


def isolated_argv(module: str) -> list[str]:
    """argv running `module` as __main__ in an isolated interpreter (`-I`) that imports this process's powerprof.
    Start it with cwd="/" as well: nothing of the caller's directory then matters."""
    return [sys.executable, "-I", "-c", _BOOT, package_root(), module]
