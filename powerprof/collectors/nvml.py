"""NVML collector: probes once what each GPU supports, then reads every supported value per tick."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, fields
from typing import Callable

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
    mig_mode: bool | None = None  # split into MIG instances (their figures are this whole GPU's); None: cannot say


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one instant. None means the GPU cannot report it, never zero."""

    index: int
    power_w: float | None  # instant power (field 186); falls back to nothing, not to the average
    power_avg_w: float | None  # nvmlDeviceGetPowerUsage: 1 s trailing average on Ampere (except GA100) and newer
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
    # Bumped whenever a counter difference is not energy (a reset, an implausible jump): energy across
    # a change is unknown (energy.epoch_broken), as RAPL's epoch.
    energy_epoch: int = 0
    note: str | None = None  # why readings are missing or were dropped this tick (stored in `error`)
    # When energy_j was read (monotonic ns, the collector's clock): the middle of that one driver call.
    # A sample is dated at the middle of the whole read of every GPU and reading, which on a real H200
    # (~3 ms a counter read, 15 ms at p99) is milliseconds off this GPU's counter; None: no energy_j.
    energy_t_mono_ns: int | None = None
    # The GPU was found lost at this read (its note says when and the fix). Kept with the reading, not read off the
    # collector later: a consumer draining readings a tick behind saw the state of its own moment, and a GPU lost
    # and back in between went unsaid.
    lost: bool = False


# Readings NVML cannot give are None without a note; these codes mean the card could not answer.
LOST_FIX = ("the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST; `dmesg | grep -i xid`, Xid 79): its readings stop "
            "here; fix: reset it (`nvidia-smi -r -i {i}`) or reboot, then check power and cooling")
# A reading above this many times the card's highest settable limit is not power (0xFFFF W sentinels,
# a corrupt read): instant draw overshoots a limit by tens of percent for milliseconds, not 3x.
IMPLAUSIBLE_POWER_FACTOR = 3.0
ASSUMED_MAX_LIMIT_W = 1000.0  # a card that publishes no limit range: the largest boards' limit
# The counter refreshes every 10-100 ms (field notes); a powered GPU draws tens of watts at idle, so a
# counter that has not moved for this long is stuck, not idle.
COUNTER_STALL_S = 1.0
COUNTER_STEP_S = 0.1
# A GPU that stopped answering is looked up again by UUID at most this often: a reset takes seconds, and
# a GPU still off the bus answers each try with an error at once, so this bounds the tries, not a wait.
REOPEN_INTERVAL_S = 5.0
STALE_FIX = ("GPU {i}'s NVML handle stopped answering ({code}: a GPU reset, `nvidia-smi -r`, or a driver recovery "
             "makes old handles stale): its readings stop here; powerprof looks it up again by UUID every {every:g} s "
             "and resumes with a new energy epoch when the same GPU answers")
REOPENED_NOTE = ("GPU {i} answers again (reopened by its UUID {uuid} after a reset or driver recovery): its energy "
                 "counter restarted, so a new energy epoch begins and no energy is differenced across the gap")


class CounterRead(tuple):
    """The energy counters (J) of one `read_energy_j`, with each GPU's energy epoch and the instant each was read
    (monotonic ns, the collector's clock: the middle of that GPU's own driver call, as `energy_t_mono_ns`), and half
    that call's length (ns: the driver took its value within that of the instant; a loaded host's stall inside the
    call makes it ms)."""

    epochs: tuple = ()
    t_mono_ns: tuple = ()
    t_half_ns: tuple = ()


READING_FIELDS = tuple(f.name for f in fields(GpuReading))

@dataclass(frozen=True)
class MigMapping:
    """A MIG instance named where a GPU was expected, and the physical GPU it is part of."""

    mig_uuid: str
    parent_index: int
    parent_uuid: str


MIG_SHARED_NOTE = ("power, energy, clocks and limits exist only for the whole physical GPU: its figures are every MIG "
                   "instance's work together, so J/token of one instance is not attributable to it (the other "
                   "instances' work is in it), and a power limit or clock lock applies to the whole GPU, every instance")


def resolve_gpu_ids(nvml, items) -> tuple[list[int], list[MigMapping], str | None]:
    """NVML indexes of `items` (indexes, GPU UUIDs, MIG instance UUIDs; UUID prefixes allowed), in order,
    without repeats: a MIG instance maps to its parent GPU, found through NVML's own MIG handles
    (nvmlDeviceGetMigDeviceHandleByIndex) and never guessed from an index. Stops at the first entry that
    names no GPU and returns it as the third value (None when all resolved); NVML must be initialised."""
    gw = gateway(nvml)
    count = gw.call("nvmlDeviceGetCount")
    uuids = None
    out: list[int] = []
    migs: list[MigMapping] = []
    for item in (str(s).strip() for s in items):
        if not item:
            continue
        if item.lstrip("-").isdigit():
            i = int(item)
            if i < 0 or i >= count:
                return list(dict.fromkeys(out)), migs, item
            out.append(i)
            continue
        if uuids is None:
            uuids = [gw.call("nvmlDeviceGetUUID", gw.call("nvmlDeviceGetHandleByIndex", i)) for i in range(count)]
        if item.startswith("MIG-"):
            found = _mig_parent(gw, uuids, item)
            if found is None:
                return list(dict.fromkeys(out)), migs, item
            migs.append(found)
            out.append(found.parent_index)
            continue
        want = item if item.startswith("GPU-") else "GPU-" + item
        match = [i for i, u in enumerate(uuids) if u.startswith(want)]
        if len(match) != 1:
            return list(dict.fromkeys(out)), migs, item
        out.append(match[0])
    return list(dict.fromkeys(out)), migs, None


def _mig_parent(gw, uuids: list[str], want: str) -> MigMapping | None:
    """The one GPU holding the MIG instance `want` (a UUID or prefix), or None."""
    if want.startswith("MIG-GPU-"):  # the pre-R470 form names its parent: MIG-GPU-<uuid>/<gi>/<ci>
        parent = want.removeprefix("MIG-").split("/")[0]
        match = [i for i, u in enumerate(uuids) if u.startswith(parent)]
        return MigMapping(want, match[0], uuids[match[0]]) if len(match) == 1 else None
    found = []
    for i, parent_uuid in enumerate(uuids):
        h = gw.call("nvmlDeviceGetHandleByIndex", i)
        mode = gw.query("nvmlDeviceGetMigMode", h)
        if not mode or not mode[0]:
            continue
        for j in range(int(gw.query("nvmlDeviceGetMaxMigDeviceCount", h, default=0) or 0)):
            mh = gw.query("nvmlDeviceGetMigDeviceHandleByIndex", h, j)
            u = gw.query("nvmlDeviceGetUUID", mh) if mh is not None else None
            if u and u.startswith(want):
                found.append(MigMapping(u, i, parent_uuid))
    return found[0] if len(found) == 1 else None


def visible_indexes(nvml, env: dict | None = None) -> list[int]:
    """NVML indexes of the GPUs this process may use, honouring CUDA_VISIBLE_DEVICES.

    CUDA enumerates fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, and NVML always by PCI
    bus; we follow the entries as NVML indexes or UUIDs (prefixes allowed), which is what
    people mean when they set the variable next to nvidia-smi's numbering. A MIG instance's
    UUID stands for its parent GPU (resolve_gpu_ids); CUDA stops at the first invalid entry, so do we.
    """
    env = os.environ if env is None else env
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None or spec.strip() == "":
        return list(range(gateway(nvml).call("nvmlDeviceGetCount"))) if spec is None else []
    return resolve_gpu_ids(nvml, spec.split(","))[0]


class NvmlCollector:
    """Reads a set of GPUs through the NVML gateway around an injected library (`pynvml` or the simulator)."""

    source = "nvml"

    def __init__(self, nvml, indexes: list[int] | None = None, clock_ns: Callable[[], int] = time.monotonic_ns):
        self.gw = gateway(nvml)
        self._clock_ns = clock_ns
        self.nvml = self.gw.lib
        self.gw.init()
        self.indexes = visible_indexes(self.nvml) if indexes is None else list(indexes)
        self.handles = [self.gw.call("nvmlDeviceGetHandleByIndex", i) for i in self.indexes]
        self.infos = [self._probe(i, h) for i, h in zip(self.indexes, self.handles)]
        n = len(self.indexes)
        # Per GPU: last counter value (mJ), when it last moved, its epoch.
        self._last_mj: list[int | None] = [None] * n
        self._moved_ns: list[int] = [0] * n
        self._epoch = [0] * n
        self.lost: dict[int, str] = {}  # NVML index -> when it was found lost (a note)
        self._reopen_ns: list[int | None] = [None] * n  # last lookup by UUID of a lost GPU
        self.reopened = [0] * n  # times each GPU was reopened after a reset
        # A jumped counter value not yet believed: (mJ, when read); the next read says whether the counter moved.
        self._jump: list[tuple[int, int] | None] = [None] * n
        # Why an edge read between ticks dropped a GPU's counter (the last reason, how many reads): said by the next tick.
        self._edge_why: list[tuple[str, int] | None] = [None] * n

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
        mig = q("nvmlDeviceGetMigMode", h)
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
            mig_mode=bool(mig[0]) if mig else None,
        )

    def read(self) -> tuple[GpuReading, ...]:
        return tuple(self.read_one(k) for k in range(len(self.handles)))

    def read_energy_j(self) -> tuple[float, ...] | None:
        """The energy counters alone (one driver query per GPU: nvmlDeviceGetTotalEnergyConsumption),
        for edges taken between the ticks; None unless every GPU has one and answered."""
        if not all(i.supports["energy_counter"] for i in self.infos):
            return None
        out, at, half = [], [], []
        for k, h in enumerate(self.handles):
            e0_ns = self._clock_ns()
            mj, code = self.gw.attempt("nvmlDeviceGetTotalEnergyConsumption", h)
            half.append((self._clock_ns() - e0_ns) // 2)
            at.append(e0_ns + half[-1])
            if code is not None and code in self._gone_codes():
                self.lost.setdefault(self.indexes[k], self._gone_note(k, code))
            e_j, why = self._counter(k, mj) if mj is not None else (None, None)
            if why:  # kept for the next tick's note, which would otherwise say nothing or a wrong cause
                prev = self._edge_why[k]
                self._edge_why[k] = (why, (prev[1] if prev else 0) + 1)
            if e_j is None:
                return None
            out.append(e_j)
        got = CounterRead(out)
        got.epochs = tuple(self._epoch)
        got.t_mono_ns = tuple(at)
        got.t_half_ns = tuple(half)
        return got

    def _counter(self, k: int, mj) -> tuple[float | None, str | None]:
        """A counter value checked against the previous one: (J or None, why it was dropped)."""
        mj = int(mj)
        now = self._clock_ns()
        last = self._last_mj[k]
        if last is None:
            self._last_mj[k], self._moved_ns[k] = mj, now
            return mj / 1000, None
        if mj < last:
            self._epoch[k] += 1
            self._last_mj[k], self._moved_ns[k], self._jump[k] = mj, now, None
            return mj / 1000, f"energy counter went back {(last - mj) / 1000:.4g} J (driver reload): energy across it unknown"
        if mj == last:
            still_s = (now - self._moved_ns[k]) / 1e9
            if still_s > COUNTER_STALL_S:
                return None, (f"energy counter stuck at {mj / 1000:.6g} J for {still_s:.3g} s (a powered GPU moves it "
                              "every 10-100 ms): reading dropped, energy is interpolated across the stall")
            return mj / 1000, None
        bound_w = IMPLAUSIBLE_POWER_FACTOR * (self.infos[k].limit_max_w or ASSUMED_MAX_LIMIT_W)
        span_s = max((now - self._moved_ns[k]) / 1e9, COUNTER_STEP_S)
        d_j = (mj - last) / 1000
        if d_j <= bound_w * span_s:
            self._last_mj[k], self._moved_ns[k], self._jump[k] = mj, now, None
            return mj / 1000, None
        jump = self._jump[k]
        if jump is not None and mj >= jump[0] and (mj - jump[0]) / 1000 <= bound_w * max((now - jump[1]) / 1e9,
                                                                                         COUNTER_STEP_S):
            # The read after a jump goes on from it: the counter itself moved. Its epoch broke at the jump.
            self._last_mj[k], self._moved_ns[k], self._jump[k] = mj, now, None
            return mj / 1000, None
        # Not adopted as the baseline: one corrupt read must not make the next good one look like a reload.
        self._epoch[k] += 1
        self._jump[k] = (mj, now)
        return None, (f"energy counter jumped {d_j:.4g} J in {span_s:.3g} s ({d_j / span_s:.4g} W, above "
                      f"{bound_w:.4g} W): not energy, reading dropped; energy across it unknown")

    def _power(self, k: int, mw, what: str) -> tuple[float | None, str | None]:
        if mw is None:
            return None, None
        w = mw / 1000
        bound_w = IMPLAUSIBLE_POWER_FACTOR * (self.infos[k].limit_max_w or ASSUMED_MAX_LIMIT_W)
        if not 0 < w <= bound_w:
            return None, f"{what} read {w:.6g} W (a powered GPU draws above 0 and below {bound_w:.4g} W): reading dropped"
        return w, None

    def _gone_codes(self) -> tuple:
        """Codes that mean the handle no longer reaches the GPU: lost, or stale after a reset or driver
        reload. A call that answered when probed and now says INVALID_ARGUMENT has a stale handle."""
        n = self.nvml
        return tuple(getattr(n, c) for c in ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_INVALID_ARGUMENT",
                                             "NVML_ERROR_UNINITIALIZED") if hasattr(n, c))

    def _gone_note(self, k: int, code: int) -> str:
        i = self.indexes[k]
        if code == getattr(self.nvml, "NVML_ERROR_GPU_IS_LOST", None):
            return LOST_FIX.format(i=i)
        return STALE_FIX.format(i=i, code=nvml_error_name(self.nvml, code), every=REOPEN_INTERVAL_S)

    def _reopen(self, k: int) -> str | None:
        """Look a lost GPU up again by its UUID (never by index: a reset may renumber GPUs), at most every
        REOPEN_INTERVAL_S; a note when the same GPU answers a reading again, else None."""
        now = self._clock_ns()
        last = self._reopen_ns[k]
        if last is not None and now - last < REOPEN_INTERVAL_S * 1e9:
            return None
        self._reopen_ns[k] = now
        uuid = self.infos[k].uuid
        uninit = getattr(self.nvml, "NVML_ERROR_UNINITIALIZED", None)
        h, code = self.gw.attempt("nvmlDeviceGetHandleByUUID", uuid)
        if code is not None and code == uninit:
            self.gw.reinit()  # a driver reload ends NVML's session: start it again, then look once more
            h, code = self.gw.attempt("nvmlDeviceGetHandleByUUID", uuid)
        if h is None:
            return None
        got, _ = self.gw.attempt("nvmlDeviceGetUUID", h)
        if got != uuid:
            return None
        # The same GPU must also answer a reading: a GPU still off the bus can keep answering its UUID.
        probe = ("nvmlDeviceGetTotalEnergyConsumption" if self.infos[k].supports["energy_counter"]
                 else "nvmlDeviceGetPowerUsage" if self.infos[k].supports["power_average"] else "nvmlDeviceGetName")
        _, code = self.gw.attempt(probe, h)
        if code is not None and code in self._gone_codes():
            return None
        self.handles[k] = h
        # The counter restarted at the reset: never difference across it.
        self._epoch[k] += 1
        self._last_mj[k] = None
        self.reopened[k] += 1
        self.lost.pop(self.indexes[k], None)
        return REOPENED_NOTE.format(i=self.indexes[k], uuid=uuid)

    def read_one(self, k: int) -> GpuReading:
        reopened = self._reopen(k) if self.indexes[k] in self.lost else None
        n, h, s = self.nvml, self.handles[k], self.infos[k].supports
        failed: list[str] = []
        lost: list = [None]  # the code that says the handle no longer reaches the GPU
        quiet = (n.NVML_ERROR_NOT_SUPPORTED, n.NVML_ERROR_NO_PERMISSION)
        gone = self._gone_codes()

        def t(key: str, fn: str, *args):
            if not s[key] or lost[0]:
                return None
            v, code = self.gw.attempt(fn, *args)
            if code is not None and code in gone:
                lost[0] = code  # every later call fails the same way: stop asking this tick
            elif code is not None and code not in quiet:
                failed.append(f"{fn.removeprefix('nvmlDevice')}: {nvml_error_name(n, code)}")
            return v

        def instant():
            if not s["power_instant"] or lost[0]:
                return None
            vals, code = self.gw.attempt("nvmlDeviceGetFieldValues", h, [n.NVML_FI_DEV_POWER_INSTANT])
            if code is not None and code in gone:
                lost[0] = code
            if not vals or vals[0].nvmlReturn != n.NVML_SUCCESS:
                return None
            return _field_value(n, vals[0])

        power_mw = instant()
        avg_mw = t("power_average", "nvmlDeviceGetPowerUsage", h)
        e0_ns = self._clock_ns()
        energy_mj = t("energy_counter", "nvmlDeviceGetTotalEnergyConsumption", h)
        energy_t_ns = e0_ns + (self._clock_ns() - e0_ns) // 2
        sm = t("clocks", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM)
        memclk = t("clocks", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_MEM)
        util = t("utilization", "nvmlDeviceGetUtilizationRates", h)
        mem = t("memory", "nvmlDeviceGetMemoryInfo", h)
        temp = t("temperature", "nvmlDeviceGetTemperature", h, n.NVML_TEMPERATURE_GPU)
        limit = t("power_limit", "nvmlDeviceGetPowerManagementLimit", h)
        enforced = t("power_limit", "nvmlDeviceGetEnforcedPowerLimit", h)
        reasons = t("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons", h)
        power_w, why_p = self._power(k, power_mw, "instant power")
        avg_w, why_a = self._power(k, avg_mw, "average power")
        energy_j, why_e = self._counter(k, energy_mj) if energy_mj is not None else (None, None)
        notes = [x for x in (why_p, why_a, why_e) if x]
        edge, self._edge_why[k] = self._edge_why[k], None
        if edge:
            many = f" (the last of {edge[1]})" if edge[1] > 1 else ""
            notes.insert(0, f"an edge read between ticks dropped its counter reading{many}: {edge[0]}")
        if failed:
            notes.append("failed this tick: " + ", ".join(failed))
        if lost[0]:
            note = self._gone_note(k, lost[0])
            self.lost.setdefault(self.indexes[k], note)
            notes.insert(0, note)
        elif self.indexes[k] in self.lost:
            del self.lost[self.indexes[k]]  # it answered again on the same handle
        if reopened and not lost[0]:
            notes.insert(0, reopened)
        return GpuReading(
            index=self.indexes[k],
            power_w=power_w,
            power_avg_w=avg_w,
            energy_j=energy_j,
            sm_clock_mhz=float(sm) if sm is not None else None,
            mem_clock_mhz=float(memclk) if memclk is not None else None,
            gpu_util_pct=float(util.gpu) if util is not None else None,
            mem_util_pct=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_limit_w=limit / 1000 if limit is not None else None,
            enforced_limit_w=enforced / 1000 if enforced is not None else None,
            clock_event_reasons=int(reasons) if reasons is not None else None,
            energy_epoch=self._epoch[k],
            note="; ".join(notes) or None,
            energy_t_mono_ns=energy_t_ns if energy_j is not None else None,
            lost=bool(lost[0]),
        )


def gpu_processes(nvml, handle) -> dict[int, int | None] | None:
    """{pid: GPU memory it holds in bytes (None: not said)} of every process using the GPU, compute, graphics and
    MPS clients (nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses); None where NVML cannot list them. In a
    container the pids may be the host's, not this pid namespace's (nvidia-container-toolkit without --pid=host)."""
    gw = gateway(nvml)
    out: dict[int, int | None] = {}
    listed = False
    # Under NVIDIA MPS a client's context is the MPS server's: the compute list names nvidia-cuda-mps-server, the
    # clients (the inference server's processes) only the MPS list. Bindings or drivers without it answer None.
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
               "nvmlDeviceGetMPSComputeRunningProcesses"):
        procs = gw.query(fn, handle)
        if procs is None:
            continue
        listed = True
        for p in procs:
            pid = getattr(p, "pid", None)
            if isinstance(pid, int):
                mem = getattr(p, "usedGpuMemory", None)
                out[pid] = int(mem) if isinstance(mem, int) else out.get(pid)
    return out if listed else None


def process_name(nvml, pid: int) -> str | None:
    """The name NVML gives a pid (nvmlSystemGetProcessName: the executable's path or command line's first word; in a
    container without --pid=host, of the host's process with that number), or None where it cannot say."""
    name = gateway(nvml).query("nvmlSystemGetProcessName", int(pid))
    return str(name).strip() or None if name else None


# The engines a process's utilisation samples name: the SM (kernels), the memory (the share of time DRAM was read
# or written: copy engines move data without SM time), the video encoder and decoder, and (the newer call only)
# the JPEG and optical-flow engines. The field of each in NVML's sample structures.
PROCESS_ENGINES = {"sm": "smUtil", "mem": "memUtil", "enc": "encUtil", "dec": "decUtil", "jpg": "jpgUtil",
                   "ofa": "ofaUtil"}


def process_util(nvml, handle, since_us: int) -> tuple[dict[int, dict[str, float]] | None, str]:
    """({pid: {engine: highest utilisation % the driver sampled since `since_us` (µs, wall clock)}} of the processes
    that used an engine ({} when none did), the call that answered); None where NVML cannot say (not supported on
    this GPU, MIG, no permission), with why.

    nvmlDeviceGetProcessesUtilizationInfo (drivers ≥ 550) first: it names the JPEG and optical-flow engines too;
    where the driver or board lacks it, nvmlDeviceGetProcessUtilization (every driver since 367)."""
    gw = gateway(nvml)
    ok = {getattr(gw.lib, "NVML_ERROR_NOT_FOUND", 6), getattr(gw.lib, "NVML_SUCCESS", 0)}
    tried = []
    for fn in ("nvmlDeviceGetProcessesUtilizationInfo", "nvmlDeviceGetProcessUtilization"):
        samples, code = gw.attempt(fn, handle, int(since_us))
        if code is not None:
            # None sampled: NOT_FOUND, or (the newer call through pynvml) an NVMLError of NVML_SUCCESS, its first
            # call having found no samples to size an array for.
            if code in ok:
                return {}, fn
            tried.append(f"{fn}: {nvml_error_name(gw.lib, code) if isinstance(code, int) else code}")
            continue
        out: dict[int, dict[str, float]] = {}
        for smp in samples or ():
            pid = getattr(smp, "pid", None)
            if not isinstance(pid, int):
                continue
            mine = out.setdefault(pid, {})
            for engine, field in PROCESS_ENGINES.items():
                u = getattr(smp, field, None)
                if isinstance(u, int) and 0 <= u <= 100:
                    mine[engine] = max(mine.get(engine, 0.0), float(u))
        return out, fn
    return None, "; ".join(tried)


_ERROR_NAMES = ("UNKNOWN", "TIMEOUT", "GPU_IS_LOST", "UNINITIALIZED", "INVALID_ARGUMENT", "IRQ_ISSUE", "NOT_FOUND",
                "DRIVER_NOT_LOADED", "CORRUPTED_INFOROM", "RESET_REQUIRED", "OPERATING_SYSTEM", "LIB_RM_VERSION_MISMATCH",
                "MEMORY", "INSUFFICIENT_POWER", "IN_USE", "NO_DATA", "INSUFFICIENT_SIZE", "NOT_SUPPORTED",
                "NO_PERMISSION", "FUNCTION_NOT_FOUND")


def nvml_error_name(nvml, code: int) -> str:
    # The library may be an NVML-like object that lists no constants: ask for each by name.
    for name in _ERROR_NAMES:
        if getattr(nvml, "NVML_ERROR_" + name, None) == code:
            return "NVML_ERROR_" + name
    return f"NVML error {code}"


# The GA100 boards by name (NVML says the architecture, not the chip): A100 (A100X), A800, A30 (A30X), and the
# CMP 170HX; "A30" inside a longer model number (RTX A3000, GA104) is not one.
GA100_NAME = re.compile(r"\bA(?:100|800|30)(?![0-9])|\bCMP 170HX\b")


def power_average_window_s(nvml, arch: int | None, name: str) -> float:
    """What nvmlDeviceGetPowerUsage averages over, as NVIDIA's NVML reference says: a 1 s trailing average on
    Ampere (except GA100) and newer (Ada, Hopper, Blackwell), instant power (0) on GA100 and older architectures
    (Volta, Turing, Pascal and before)."""
    ampere = getattr(nvml, "NVML_DEVICE_ARCH_AMPERE", 7)
    if arch is None or arch == getattr(nvml, "NVML_DEVICE_ARCH_UNKNOWN", 0xFFFFFFFF):
        return 1.0  # unknown: assume the newer behaviour, the safer shift for integration
    if arch < ampere or (arch == ampere and GA100_NAME.search(name)):
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
