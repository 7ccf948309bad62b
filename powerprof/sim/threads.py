"""OS-visible names for the simulator's threads, so a soak bench can account for their CPU apart.

Python names threads only for itself; Linux shows every thread as the process name unless the
thread sets its own (prctl PR_SET_NAME, 15 bytes). The simulator's threads start with `sim-`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

PREFIX = "sim-"
_PR_SET_NAME = 15


def name_this_thread(name: str) -> None:
    """Give the calling OS thread `name` (cut to 15 bytes); silently nothing off Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except OSError:
        pass  # a name is a convenience for profilers, never a reason to fail
