"""NVML collector: probes once what each GPU supports, then reads every supported value per tick."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .clock_reasons import CLOCK_EVENT_REASONS, clock_event_reason_names  # noqa: F401  (re-exported: monitor, tests)
from .gateway import gateway

SUPPORT_KEYS = (
    "power_instant",
    "power_average",
    "energy_counter",
    "clocks",
    "utilization",
    "memory",
    "temperature",
    "power_limit",
    "clock_event_reasons",
)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Static facts about one GPU, read once."""

    index: int  # NVML index
    uuid: str
    name: str
    driver_version: str
    memory_total_bytes: int | None
    limit_min_w: float | None
    limit_max_w: float | None
    limit_default_w: float | None
    supports: dict  # SUPPORT_KEYS -> bool
    power_avg_window_s: float  # how far back nvmlDeviceGetPowerUsage averages (0: instant)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one instant. None means the GPU cannot report it, never zero."""

    index: int
    power_w: float | None  # instant power (field 186); falls back to nothing, not to the average
    power_avg_w: float | None  # nvmlDeviceGetPowerUsage: 1 s trailing average on Ampere and newer
    energy_j: float | None  # driver's cumulative counter since driver load
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    gpu_util_pct: float | None
    mem_util_pct: float | None
    mem_used_bytes: int | None
    temperature_c: float | None
    power_limit_w: float | None
    enforced_limit_w: float | None
    clock_event_reasons: int | None


READING_FIELDS = tuple(f.name for f in fields(GpuReading))

def visible_indexes(nvml, env: dict | None = None) -> list[int]:
    """NVML indexes of the GPUs this process may use, honouring CUDA_VISIBLE_DEVICES.

    CUDA enumerates fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and NVML always by PCI
    bus; we follow the entries as NVML indexes or UUIDs (prefixes allowed), which is what
    people mean when they set the variable next to nvidia-smi's numbering.
    """
    env = os.environ if env is None else env
    gw = gateway(nvml)
    count = gw.call("nvmlDeviceGetCount")
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None or spec.strip() == "":
        return list(range(count)) if spec is None else []
    uuids = None
    out: list[int] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            i = int(item)
            if i < 0 or i >= count:
                break  # CUDA stops at the first invalid entry
            out.append(i)
            continue
        if uuids is None:
            uuids = [gw.call("nvmlDeviceGetUUID", gw.call("nvmlDeviceGetHandleByIndex", i)) for i in range(count)]
        want = item if item.startswith(("GPU-", "MIG-")) else "GPU-" + item
        match = [i for i, u in enumerate(uuids) if u.startswith(want)]
        if len(match) != 1:
            break
        out.append(match[0])
    return list(dict.fromkeys(out))


class NvmlCollector:
    """Reads a set of GPUs through the NVML gateway around an injected library (`pynvml` or the simulator)."""

    source = "nvml"

    def __init__(self, nvml, indexes: list[int] | None = None):
        self.gw = gateway(nvml)
        self.nvml = self.gw.lib
        self.gw.init()
        self.indexes = visible_indexes(self.nvml) if indexes is None else list(indexes)
        self.handles = [self.gw.call("nvmlDeviceGetHandleByIndex", i) for i in self.indexes]
        self.infos = [self._probe(i, h) for i, h in zip(self.indexes, self.handles)]

    def close(self) -> None:
        self.gw.shutdown()

    def _instant_field(self, h, field_id):
        vals = self.gw.query("nvmlDeviceGetFieldValues", h, [field_id])
        if not vals:
            return None
        v = vals[0]
        if v.nvmlReturn != self.nvml.NVML_SUCCESS:
            return None
        return _field_value(self.nvml, v)

    def _probe(self, index: int, h) -> GpuInfo:
        n, q = self.nvml, self.gw.query
        limits = q("nvmlDeviceGetPowerManagementLimitConstraints", h)
        default = q("nvmlDeviceGetPowerManagementDefaultLimit", h)
        mem = q("nvmlDeviceGetMemoryInfo", h)
        supports = {
            "power_instant": self._instant_field(h, n.NVML_FI_DEV_POWER_INSTANT) is not None,
            "power_average": q("nvmlDeviceGetPowerUsage", h) is not None,
            "energy_counter": q("nvmlDeviceGetTotalEnergyConsumption", h) is not None,
            "clocks": q("nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM) is not None,
            "utilization": q("nvmlDeviceGetUtilizationRates", h) is not None,
            "memory": mem is not None,
            "temperature": q("nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU) is not None,
            "power_limit": q("nvmlDeviceGetPowerManagementLimit", h) is not None,
            "clock_event_reasons": q("nvmlDeviceGetCurrentClocksEventReasons", h) is not None,
        }
        arch = q("nvmlDeviceGetArchitecture", h)
        name = self.gw.call("nvmlDeviceGetName", h)
        return GpuInfo(
            index=index,
            uuid=self.gw.call("nvmlDeviceGetUUID", h),
            name=name,
            driver_version=q("nvmlSystemGetDriverVersion", default=""),
            memory_total_bytes=int(mem.total) if mem is not None else None,
            limit_min_w=limits[0] / 1000 if limits else None,
            limit_max_w=limits[1] / 1000 if limits else None,
            limit_default_w=default / 1000 if default is not None else None,
            supports=supports,
            power_avg_window_s=power_average_window_s(n, arch, name),
        )

    def read(self) -> tuple[GpuReading, ...]:
        return tuple(self.read_one(k) for k in range(len(self.handles)))

    def read_energy_j(self) -> tuple[float, ...] | None:
        """The energy counters alone (one driver query per GPU: nvmlDeviceGetTotalEnergyConsumption),
        for edges taken between the ticks; None unless every GPU has one and answered."""
        if not all(i.supports["energy_counter"] for i in self.infos):
            return None
        out = []
        for h in self.handles:
            mj = self.gw.query("nvmlDeviceGetTotalEnergyConsumption", h)
            if mj is None:
                return None
            out.append(mj / 1000)
        return tuple(out)

    def read_one(self, k: int) -> GpuReading:
        n, h, s = self.nvml, self.handles[k], self.infos[k].supports
        t = self.gw.query
        power_mw = self._instant_field(h, n.NVML_FI_DEV_POWER_INSTANT) if s["power_instant"] else None
        avg_mw = t("nvmlDeviceGetPowerUsage", h) if s["power_average"] else None
        energy_mj = t("nvmlDeviceGetTotalEnergyConsumption", h) if s["energy_counter"] else None
        sm = t("nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM) if s["clocks"] else None
        memclk = t("nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_MEM) if s["clocks"] else None
        util = t("nvmlDeviceGetUtilizationRates", h) if s["utilization"] else None
        mem = t("nvmlDeviceGetMemoryInfo", h) if s["memory"] else None
        temp = t("nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU) if s["temperature"] else None
        limit = t("nvmlDeviceGetPowerManagementLimit", h) if s["power_limit"] else None
        enforced = t("nvmlDeviceGetEnforcedPowerLimit", h) if s["power_limit"] else None
        reasons = t("nvmlDeviceGetCurrentClocksEventReasons", h) if s["clock_event_reasons"] else None
        return GpuReading(
            index=self.indexes[k],
            power_w=power_mw / 1000 if power_mw is not None else None,
            power_avg_w=avg_mw / 1000 if avg_mw is not None else None,
            energy_j=energy_mj / 1000 if energy_mj is not None else None,
            sm_clock_mhz=float(sm) if sm is not None else None,
            mem_clock_mhz=float(memclk) if memclk is not None else None,
            gpu_util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_limit_w=limit / 1000 if limit is not None else None,
            enforced_limit_w=enforced / 1000 if enforced is not None else None,
            clock_event_reasons=int(reasons) if reasons is not None else None,
        )


def power_average_window_s(nvml, arch: int | None, name: str) -> float:
    """nvmlDeviceGetPowerUsage is a 1 s trailing average on Ampere and newer except GA100."""
    ampere = getattr(nvml, "NVML_DEVICE_ARCH_AMPERE", 7)
    if arch is None or arch == getattr(nvml, "NVML_DEVICE_ARCH_UNKNOWN", 0xFFFFFFFF):
        return 1.0  # unknown: assume the newer behaviour, the safer shift for integration
    if arch < ampere or (arch == ampere and "A100" in name):
        return 0.0
    return 1.0


def _field_value(nvml, v):
    vt = v.valueType
    member = {
        nvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        nvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal",
        getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(vt)
    return getattr(v.value, member) if member else None
