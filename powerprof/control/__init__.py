"""Power-limit and clock control with the restore guarantee."""

from .controller import LimitController, LimitReadback
from .errors import (
    ControlError,
    ControlPermissionError,
    GpuBusyError,
    LimitNotAppliedError,
    PendingRestoreError,
    RestoreError,
    StateFolderError,
)
from .levels import DeviceRange, LevelError, parse_clock_levels, parse_gpu_indexes, parse_power_levels
from .plan import Plan, make_plan
from .restore import pending_restore_note, restore_from_file
from .setter import GpuReadback

__all__ = [
    "ControlError",
    "ControlPermissionError",
    "DeviceRange",
    "GpuBusyError",
    "GpuReadback",
    "LevelError",
    "LimitController",
    "LimitNotAppliedError",
    "LimitReadback",
    "PendingRestoreError",
    "Plan",
    "RestoreError",
    "StateFolderError",
    "make_plan",
    "parse_clock_levels",
    "parse_gpu_indexes",
    "parse_power_levels",
    "pending_restore_note",
    "restore_from_file",
]
