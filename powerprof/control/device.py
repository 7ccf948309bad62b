"""Reads what each GPU allows and is set to (read-only NVML calls): the input to validation and restore."""

from __future__ import annotations

from typing import Sequence

from .errors import ControlError
from .levels import DeviceRange


def _str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_error_code(nvml, exc: BaseException) -> int | None:
    return getattr(exc, "value", None) if isinstance(exc, nvml.NVMLError) else None


def _clock_range(nvml, h) -> tuple[int | None, int | None]:
    try:
        mem_mhz = nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_MEM)
        clocks = [int(c) for c in nvml.nvmlDeviceGetSupportedGraphicsClocks(h, mem_mhz)]
    except nvml.NVMLError:
        return None, None
    if not clocks:
        return None, None
    return min(clocks), max(clocks)


def read_device(nvml, index: int, handle=None) -> DeviceRange:
    """One GPU's limit range, default, current and enforced limit, and SM clock range."""
    h = nvml.nvmlDeviceGetHandleByIndex(index) if handle is None else handle
    name = _str(nvml.nvmlDeviceGetName(h))
    try:
        lo_mw, hi_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
        default_mw = nvml.nvmlDeviceGetPowerManagementDefaultLimit(h)
        limit_mw = nvml.nvmlDeviceGetPowerManagementLimit(h)
    except nvml.NVMLError as e:
        raise ControlError(
            f"GPU {index} ({name}) does not report its power-limit range, default and current limit "
            f"(NVML: {e}); powerprof will not change a limit it cannot put back."
        ) from e
    try:
        enforced_mw = nvml.nvmlDeviceGetEnforcedPowerLimit(h)
    except nvml.NVMLError:
        enforced_mw = None
    clock_lo, clock_hi = _clock_range(nvml, h)
    return DeviceRange(
        index=index,
        uuid=_str(nvml.nvmlDeviceGetUUID(h)),
        name=name,
        min_w=lo_mw / 1000,
        max_w=hi_mw / 1000,
        default_w=default_mw / 1000,
        limit_w=limit_mw / 1000,
        enforced_w=enforced_mw / 1000 if enforced_mw is not None else None,
        clock_min_mhz=clock_lo,
        clock_max_mhz=clock_hi,
    )


def read_devices(nvml, indexes: Sequence[int]) -> tuple[DeviceRange, ...]:
    count = nvml.nvmlDeviceGetCount()
    bad = [i for i in indexes if not 0 <= i < count]
    if bad:
        raise ControlError(f"GPU {', '.join(map(str, bad))} does not exist; NVML sees {count} GPU(s).")
    return tuple(read_device(nvml, i) for i in indexes)
