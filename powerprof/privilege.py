"""Whether this process may change GPU limits: root, or CAP_SYS_ADMIN in its effective capabilities."""

from __future__ import annotations

import os

CAP_SYS_ADMIN = 21  # bit number in the CapEff mask of /proc/<pid>/status


def has_admin_privilege(status_path: str = "/proc/self/status") -> bool:
    """root, or CAP_SYS_ADMIN in the effective capability set; False where the status file can't be read."""
    if os.geteuid() == 0:
        return True
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_ADMIN & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
