"""NVML clock-event reason bits and the rules read from them: did the power cap bind, was it heat, was it a setting.

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
# Newer drivers (nvml.h R555+) add these; the bindings installed may predate them.
REASON_BOARD_LIMIT = getattr(pynvml, "nvmlClocksEventReasonBoardLimit", 0x200)
REASON_RELIABILITY = getattr(pynvml, "nvmlClocksEventReasonReliability", 0x400)

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
    (REASON_BOARD_LIMIT, "BoardLimit"),
    (REASON_RELIABILITY, "Reliability"),
)

REASON_THERMAL = REASON_SW_THERMAL | REASON_HW_THERMAL
CAP_AT_LIMIT_FRACTION = 0.98  # drawing this close to the limit, the cap binds whatever the reason bits say
CAP_ENGAGED_FRACTION = 0.9  # without reason bits: average power below 90% of the limit means the cap did nothing
# Bits that name no limiter of the GPU's own: idle, and a clock setting (AppClocks is also
# UserDefinedClocks, which drivers report for a clock lock). Every other bit, known or not, is a
# limiter (power, heat, a brake, a sync-boost group, the board, voltage reliability).
REASON_SETTING_ONLY = REASON_GPU_IDLE | REASON_APP_CLOCKS


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


def held_by_a_setting(reasons: int | None, power_w: float | None, limit_w: float | None) -> bool:
    """A busy GPU's low clock is no limiter's doing: no bit but GpuIdle/AppClocks set, and power clearly
    under the cap (below 90%: the cap is not what binds, whatever bit a driver forgets to set).

    Only a clock setting is left (another tool's lock or application clocks). Unknown reasons or
    power say nothing: heat or the cap could not be ruled out."""
    if reasons is None or power_w is None:
        return False
    if reasons & ~REASON_SETTING_ONLY:
        return False
    return limit_w is None or power_w < CAP_ENGAGED_FRACTION * limit_w
