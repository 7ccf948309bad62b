"""Reads what each GPU allows and is set to (read-only NVML calls): the input to validation and restore."""

from __future__ import annotations

from typing import Sequence

from powerprof.collectors.gateway import gateway

from .errors import ControlError
from .levels import DeviceRange


def nvml_error_code(nvml, exc: BaseException) -> int | None:
    return gateway(nvml).error_code(exc)


def _supported_clocks(gw, h) -> tuple[int, ...] | None:
    """The SM clocks the GPU supports at its top memory clock, ascending (None: not reported)."""
    mem_mhz = gw.query("nvmlDeviceGetMaxClockInfo", h, gw.NVML_CLOCK_MEM)
    clocks = gw.query("nvmlDeviceGetSupportedGraphicsClocks", h, mem_mhz) if mem_mhz is not None else None
    if not clocks:
        return None
    return tuple(sorted({int(c) for c in clocks}))


def read_device(nvml, index: int, handle=None) -> DeviceRange:
    """One GPU's limit range, default, current and enforced limit, and SM clock range."""
    gw = gateway(nvml)
    h = gw.call("nvmlDeviceGetHandleByIndex", index) if handle is None else handle
    name = gw.call("nvmlDeviceGetName", h)
    try:
        lo_mw, hi_mw = gw.call("nvmlDeviceGetPowerManagementLimitConstraints", h)
        default_mw = gw.call("nvmlDeviceGetPowerManagementDefaultLimit", h)
        limit_mw = gw.call("nvmlDeviceGetPowerManagementLimit", h)
    except gw.NVMLError as e:
        raise ControlError(
            f"GPU {index} ({name}) does not report its power-limit range, default and current limit "
            f"(NVML: {e}); powerprof will not change a limit it cannot put back."
        ) from e
    enforced_mw = gw.query("nvmlDeviceGetEnforcedPowerLimit", h)
    clocks = _supported_clocks(gw, h)
    return DeviceRange(
        index=index,
        uuid=gw.call("nvmlDeviceGetUUID", h),
        name=name,
        min_w=lo_mw / 1000,
        max_w=hi_mw / 1000,
        default_w=default_mw / 1000,
        limit_w=limit_mw / 1000,
        enforced_w=enforced_mw / 1000 if enforced_mw is not None else None,
        clock_min_mhz=clocks[0] if clocks else None,
        clock_max_mhz=clocks[-1] if clocks else None,
        clock_supported_mhz=clocks,
    )


def read_devices(nvml, indexes: Sequence[int]) -> tuple[DeviceRange, ...]:
    count = gateway(nvml).call("nvmlDeviceGetCount")
    bad = [i for i in indexes if not 0 <= i < count]
    if bad:
        raise ControlError(f"GPU {', '.join(map(str, bad))} does not exist; NVML sees {count} GPU(s).")
    return tuple(read_device(nvml, i) for i in indexes)
