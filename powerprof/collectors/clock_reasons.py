"""NVML clock-event reason bits and the two rules read from them: did the power cap bind, was it heat.

Stated once here: the bits are NVIDIA's (pynvml's constants, which the simulator sets too); the
NVML collector names them, the sweep and the analysis apply the rules.

Thermal means SwThermal | HwThermal. HwSlowdown (0x8) alone is not counted: NVML sets it for heat,
for an external power-brake assertion (HwPowerBrake, 0x80) and for fast-trigger power protection,
and every driver that sets it for heat also sets HwThermal (0x40), which is the bit that says
"the clock fell for heat".
"""

from __future__ import annotations

import pynvml

# nvmlDeviceGetCurrentClocksEventReasons bits, from NVIDIA's own bindings (nvml.h
# nvmlClocksEventReason*); the simulator sets the same constants.
REASON_GPU_IDLE = pynvml.nvmlClocksEventReasonGpuIdle  # 0x1
REASON_APP_CLOCKS = pynvml.nvmlClocksEventReasonApplicationsClocksSetting  # 0x2
REASON_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap  # 0x4
REASON_HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown  # 0x8
REASON_SYNC_BOOST = pynvml.nvmlClocksEventReasonSyncBoost  # 0x10
REASON_SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown  # 0x20
REASON_HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown  # 0x40
REASON_HW_POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown  # 0x80
REASON_DISPLAY_CLOCK = pynvml.nvmlClocksEventReasonDisplayClockSetting  # 0x100

CLOCK_EVENT_REASONS = (
    (REASON_GPU_IDLE, "GpuIdle"),
    (REASON_APP_CLOCKS, "AppClocks"),
    (REASON_SW_POWER_CAP, "SwPowerCap"),
    (REASON_HW_SLOWDOWN, "HwSlowdown"),
    (REASON_SYNC_BOOST, "SyncBoost"),
    (REASON_SW_THERMAL, "SwThermal"),
    (REASON_HW_THERMAL, "HwThermal"),
    (REASON_HW_POWER_BRAKE, "HwPowerBrake"),
    (REASON_DISPLAY_CLOCK, "DisplayClock"),
)

REASON_THERMAL = REASON_SW_THERMAL | REASON_HW_THERMAL
CAP_AT_LIMIT_FRACTION = 0.98  # drawing this close to the limit, the cap binds whatever the reason bits say
CAP_ENGAGED_FRACTION = 0.9  # without reason bits: average power below 90% of the limit means the cap did nothing


def clock_event_reason_names(bits: int | None) -> list[str] | None:
    """Names of the set bits, unknown bits as hex; None stays None (not supported)."""
    if bits is None:
        return None
    names = [name for bit, name in CLOCK_EVENT_REASONS if bits & bit]
    rest = bits & ~sum(bit for bit, _ in CLOCK_EVENT_REASONS)
    if rest:
        names.append(hex(rest))
    return names


def thermal(reasons: int | None) -> bool:
    """The clock fell for heat at some point: the OR of a level's reasons has SwThermal or HwThermal."""
    return bool((reasons or 0) & REASON_THERMAL)


def cap_not_engaged(avg_power_w: float | None, limit_w: float | None, reasons: int | None, n_gpus: int = 1) -> bool:
    """A cap that never bound: the driver never reported SwPowerCap while power stayed under it.

    avg_power_w: the level's power over all `n_gpus` GPUs; limit_w: the per-GPU limit.
    reasons: the OR of the clock-event reasons seen during the level, None where the GPU cannot
    report them; then only power can tell, and only a clear gap (under 90%) counts.
    """
    if avg_power_w is None or limit_w is None:
        return False
    per_gpu = avg_power_w / max(n_gpus, 1)
    if reasons is None:
        return per_gpu < CAP_ENGAGED_FRACTION * limit_w
    return not (reasons & REASON_SW_POWER_CAP) and per_gpu < CAP_AT_LIMIT_FRACTION * limit_w
