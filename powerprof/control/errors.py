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
