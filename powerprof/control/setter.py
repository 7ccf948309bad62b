"""Changes one GPU's power limit or SM clock lock (NVML v1 setter, nvidia-smi fallback) and reads it back."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Callable, Sequence

from powerprof.collectors.gateway import gateway

from .device import nvml_error_code
from .errors import ControlError, ControlPermissionError, LimitNotAppliedError, permission_message

NvidiaSmi = Callable[[Sequence[str]], None]


def run_nvidia_smi(args: Sequence[str], timeout_s: float = 30.0) -> None:
    """Runs `nvidia-smi ARGS`; any failure is a ControlError carrying nvidia-smi's own words."""
    cmd = ["nvidia-smi", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise ControlError("NVML cannot set this limit and nvidia-smi is not installed (not on PATH).") from None
    except subprocess.TimeoutExpired:
        raise ControlError(f"`{' '.join(cmd)}` did not finish within {timeout_s:g} s.") from None
    if r.returncode != 0:
        said = (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}").splitlines()[-1]
        if "permission" in said.lower():
            raise ControlPermissionError(f"`{' '.join(cmd)}` failed: {said}. " + permission_message("change GPU power limits", False))
        raise ControlError(f"`{' '.join(cmd)}` failed: {said}")


@dataclass(frozen=True)
class GpuReadback:
    """What one GPU reports right after a set. Powers in W; None = the GPU cannot report it."""

    index: int
    uuid: str
    requested_w: float  # what powerprof asked for
    limit_w: float | None  # nvmlDeviceGetPowerManagementLimit after the set
    enforced_w: float | None  # nvmlDeviceGetEnforcedPowerLimit: after every limiter
    method: str  # "nvml" | "nvidia-smi"

    def problem(self, tolerance_w: float, enforced: bool = True) -> str | None:
        """Why this set did not take effect, or None if it did."""
        if self.limit_w is None:
            return f"GPU {self.index}: the limit cannot be read back, so the set cannot be verified"
        if abs(self.limit_w - self.requested_w) > tolerance_w:
            return f"GPU {self.index}: asked for {self.requested_w:g} W, the limit reads {self.limit_w:g} W"
        if enforced and self.enforced_w is not None and abs(self.enforced_w - self.requested_w) > tolerance_w:
            return (
                f"GPU {self.index}: asked for {self.requested_w:g} W, the enforced limit is {self.enforced_w:g} W "
                "(another limiter or tool overrides it)"
            )
        return None


def _fmt_w(w: float) -> str:
    return f"{w:.3f}".rstrip("0").rstrip(".")


def set_power_limit(nvml, handle, index: int, uuid: str, watts: float, nvidia_smi: NvidiaSmi) -> GpuReadback:
    """v1 setter (the v2 Python wrapper ignores errors), nvidia-smi only where NVML says NotSupported."""
    method = "nvml"
    try:
        gateway(nvml).call("nvmlDeviceSetPowerManagementLimit", handle, int(round(watts * 1000)))
    except nvml.NVMLError as e:
        code = nvml_error_code(nvml, e)
        if code == nvml.NVML_ERROR_NO_PERMISSION:
            raise ControlPermissionError(permission_message("change GPU power limits")) from e
        if code == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15):
            # Nothing more can be done to it now; a reset or reboot brings its default limit back anyway.
            raise ControlError(
                f"GPU {index} is lost (fell off the bus, NVML_ERROR_GPU_IS_LOST): its power limit cannot be set to "
                f"{watts:g} W now; fix: `nvidia-smi -r -i {uuid or index}` or a reboot (either puts its default limit back)."
            ) from e
        if code != nvml.NVML_ERROR_NOT_SUPPORTED:
            raise ControlError(f"GPU {index}: setting the power limit to {watts:g} W failed (NVML: {e}).") from e
        # By UUID where known: after a driver reload or a reset nvidia-smi's index may name another GPU.
        nvidia_smi(["-i", uuid or str(index), "-pl", _fmt_w(watts)])
        method = "nvidia-smi"
    return read_back(nvml, handle, index, uuid, watts, method)


def read_back(nvml, handle, index: int, uuid: str, requested_w: float, method: str) -> GpuReadback:
    gw = gateway(nvml)

    def get(fn):
        mw = gw.query(fn, handle)
        return mw / 1000 if mw is not None else None

    return GpuReadback(
        index=index,
        uuid=uuid,
        requested_w=float(requested_w),
        limit_w=get("nvmlDeviceGetPowerManagementLimit"),
        enforced_w=get("nvmlDeviceGetEnforcedPowerLimit"),
        method=method,
    )


def check_applied(readbacks: Sequence[GpuReadback], tolerance_w: float, enforced: bool = True) -> None:
    problems = [p for p in (rb.problem(tolerance_w, enforced) for rb in readbacks) if p]
    if problems:
        raise LimitNotAppliedError(
            "The power limit did not take effect: " + "; ".join(problems) + f" (tolerance {tolerance_w:g} W)."
        )


def lock_sm_clocks(nvml, handle, index: int, lo_mhz: int, hi_mhz: int) -> None:
    try:
        gateway(nvml).call("nvmlDeviceSetGpuLockedClocks", handle, int(lo_mhz), int(hi_mhz))
    except nvml.NVMLError as e:
        code = nvml_error_code(nvml, e)
        if code == nvml.NVML_ERROR_NO_PERMISSION:
            raise ControlPermissionError(permission_message("lock GPU clocks")) from e
        if code == nvml.NVML_ERROR_NOT_SUPPORTED:
            raise ControlError(f"GPU {index} cannot lock its SM clock (NVML: {e}; needs Volta or newer).") from e
        raise ControlError(f"GPU {index}: locking the SM clock to {lo_mhz}-{hi_mhz} MHz failed (NVML: {e}).") from e


def reset_sm_clocks(nvml, handle, index: int) -> None:
    try:
        gateway(nvml).call("nvmlDeviceResetGpuLockedClocks", handle)
    except nvml.NVMLError as e:
        if nvml_error_code(nvml, e) == nvml.NVML_ERROR_NO_PERMISSION:
            raise ControlPermissionError(permission_message("release locked GPU clocks", False)) from e
        raise ControlError(f"GPU {index}: releasing the locked SM clock failed (NVML: {e}).") from e
