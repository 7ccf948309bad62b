"""Opens the collectors it is given (NVML-like object, powercap root) together and reports what is missing, with the fix.

`open_sources()` gives NVML, RAPL and host collectors where they work, and a `Problem`
(message + fix) where they don't, so a machine without a GPU or without RAPL permission still
gets the rest. It never decides what is real: the door (`powerprof.rig`) hands it the NVML-like
object, the powercap root and opener, and how to tell whether limits may be changed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from powerprof.errtext import error_text
from powerprof.privilege import has_admin_privilege

from .gateway import gateway
from .host import HostCollector
from .nvml import LOST_FIX, MIG_SHARED_NOTE, NvmlCollector, resolve_gpu_ids
from .rapl import DEFAULT_ROOT, PERMISSION_FIX, UNAVAILABLE_FIX, RaplCollector, RaplPermissionError, RaplUnavailableError

NO_GPU_FIX = "install the NVIDIA driver (nvidia-smi must work), or run with --simulate for a simulated GPU"
ROOT_FIX = (
    "changing power limits and clocks (sweep, restore) needs root or CAP_SYS_ADMIN: run those with sudo, or "
    "give the service AmbientCapabilities=CAP_SYS_ADMIN; devices, monitor and measure need neither"
)


@dataclass(frozen=True)
class Problem:
    source: str  # nvml | rapl | host
    message: str
    fix: str | None = None


@dataclass
class Sources:
    """The open collectors; `close()` releases them."""

    nvml: NvmlCollector | None = None
    rapl: RaplCollector | None = None
    host: HostCollector | None = None
    problems: list[Problem] = field(default_factory=list)
    can_set_limits: bool | None = None  # None: no GPU
    migs: list = field(default_factory=list)  # MigMapping of each MIG instance named (--gpus, CUDA_VISIBLE_DEVICES)

    @property
    def collectors(self) -> list:
        return [c for c in (self.nvml, self.rapl, self.host) if c is not None]

    @property
    def gpu_uuids(self) -> dict[int, str]:
        return {i.index: i.uuid for i in self.nvml.infos} if self.nvml else {}

    def close(self) -> None:
        if self.rapl is not None:
            self.rapl.close()
        if self.nvml is not None:
            self.nvml.close()

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nvml_error(e: Exception) -> str:
    return error_text(e)


def open_sources(
    nvml=None,
    gpus: list[int] | None = None,
    *,
    rapl_root: str | os.PathLike = DEFAULT_ROOT,
    rapl_opener: Callable = open,
    rapl_backend: str = "sysfs",
    host: bool = True,
    ps=None,
    privileged: Callable[[], bool] = has_admin_privilege,
) -> Sources:
    """Collectors for the GPUs `gpus` (NVML indexes, or GPU/MIG UUIDs as strings; default: those
    CUDA_VISIBLE_DEVICES allows), RAPL, host. A MIG instance stands for its parent GPU, said in a Problem.

    `nvml` is the NVML-like object to read (default: the real `pynvml` module); `privileged()`
    says whether this process may change limits. Raises ValueError for a GPU index that does not
    exist (bad input); everything the machine lacks becomes a Problem instead.
    """
    src = Sources()
    try:
        _open_gpus(src, gpus, nvml, privileged)
        _open_rapl(src, rapl_root, rapl_opener, rapl_backend)
        if host:
            src.host = HostCollector(ps)
    except BaseException:
        src.close()
        raise
    return src


def _open_gpus(src: Sources, gpus, nvml, privileged: Callable[[], bool]) -> None:
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:  # the dependency is declared; a broken install is still possible
            src.problems.append(Problem("nvml", f"NVML bindings missing: {e}", "pip install nvidia-ml-py"))
            return
    gw = gateway(nvml)
    try:
        gw.init()
    except Exception as e:
        src.problems.append(Problem("nvml", f"no NVIDIA GPU reachable through NVML ({_nvml_error(e)})", NO_GPU_FIX))
        return
    try:
        count = gw.call("nvmlDeviceGetCount")
        migs = []
        if gpus is not None:
            bad = [g for g in gpus if isinstance(g, int) and not 0 <= g < count]
            if bad:
                raise ValueError(f"GPU index {bad[0]} does not exist: this machine has {count} GPU(s) (0-{count - 1})")
            indexes, migs, unknown = resolve_gpu_ids(nvml, gpus)
            if unknown is not None:
                raise ValueError(f"{unknown!r} names no GPU or MIG instance on this machine (nvidia-smi -L lists them)")
        else:
            spec = os.environ.get("CUDA_VISIBLE_DEVICES")
            if spec is None or spec.strip() == "":
                indexes = list(range(count)) if spec is None else []
            else:
                indexes, migs, unknown = resolve_gpu_ids(nvml, spec.split(","))
                if unknown is not None:
                    src.problems.append(_unknown_visible_problem(unknown))
            src.problems.extend(_visible_devices_problems(gw, count))
        # A GPU that fell off the bus answers nothing, not even its name: leave it out, said, and open the rest.
        unusable = []
        for i in indexes:
            try:
                h = gw.call("nvmlDeviceGetHandleByIndex", i)
                gw.call("nvmlDeviceGetUUID", h)
                gw.call("nvmlDeviceGetName", h)
            except gw.NVMLError as e:
                unusable.append((i, e))
    finally:
        gw.shutdown()
    for i, e in unusable:
        lost = gw.error_code(e) == getattr(gw, "NVML_ERROR_GPU_IS_LOST", 15)
        what = "NVML_ERROR_GPU_IS_LOST" if lost else _nvml_error(e)
        src.problems.append(Problem("nvml", f"gpu{i}: NVML cannot open it ({what}): left out, nothing of it is measured",
                                    LOST_FIX.format(i=i) if lost else "check the driver: nvidia-smi -q -i " + str(i)))
    indexes = [i for i in indexes if i not in {j for j, _ in unusable}]
    if unusable and not indexes:
        return
    if not indexes:
        if any(p.source == "nvml" and "MIG" in p.message for p in src.problems):
            return  # said above, with its fix
        why = "CUDA_VISIBLE_DEVICES hides every GPU" if count else "NVML sees no GPU"
        src.problems.append(Problem("nvml", why, NO_GPU_FIX if not count else "unset or fix CUDA_VISIBLE_DEVICES"))
        return
    src.nvml = NvmlCollector(nvml, indexes)
    src.migs = [m for m in migs if m.parent_index in indexes]
    src.problems.extend(_mig_problems(src.nvml.infos, migs))
    src.can_set_limits = bool(privileged())
    if not src.can_set_limits:
        src.problems.append(Problem("nvml", "no permission to change power limits or clocks", ROOT_FIX))
    for info in src.nvml.infos:
        missing = [k for k, ok in info.supports.items() if not ok]
        if "energy_counter" in missing and "power_average" in missing and "power_instant" in missing:
            src.problems.append(
                Problem(
                    "nvml",
                    f"gpu{info.index} ({info.name}) has no energy counter and no power reading (only its limit): "
                    "its energy cannot be measured, every window's GPU energy is empty (energy_method none)",
                    "measure this card at the wall (a metered PDU), or profile a card with an energy counter (Volta or newer)",
                )
            )
        elif "energy_counter" in missing:
            src.problems.append(
                Problem(
                    "nvml",
                    f"gpu{info.index} ({info.name}) has no energy counter (pre-Volta): energy is integrated from power "
                    "readings, which a short request or window can fall between: the daemon marks such a request "
                    "no-counter-short and leaves it out of its J/token, sweep and measure say low confidence for short "
                    "decode windows",
                    "a GPU with an energy counter (Volta and newer), or longer requests and J/token read over many "
                    "of them (a tag's window, the intervals)",
                )
            )


def _visible_devices_problems(gw, count: int, env=None) -> list[Problem]:
    """Where CUDA_VISIBLE_DEVICES may not name the GPUs we measure: the server could run on another."""
    env = os.environ if env is None else env
    items = [s.strip() for s in (env.get("CUDA_VISIBLE_DEVICES") or "").split(",") if s.strip()]
    out = []
    if count > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and any(s.lstrip("-").isdigit() for s in items):
        names = set()
        for i in range(count):
            h = gw.query("nvmlDeviceGetHandleByIndex", i)
            names.add(gw.query("nvmlDeviceGetName", h) if h is not None else None)
        if len(names) > 1:
            out.append(Problem(
                "nvml", f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} is read as nvidia-smi (PCI bus) indexes, but "
                "CUDA numbers these different GPUs fastest-first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: the server may run "
                "on another GPU than the one measured",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID for the server and powerprof, or name GPUs by UUID (nvidia-smi -L)"))
    return out


def _unknown_visible_problem(item: str) -> Problem:
    mig = item.startswith("MIG-")
    return Problem(
        "nvml", f"CUDA_VISIBLE_DEVICES names {item}, which is no {'MIG instance' if mig else 'GPU'} of this machine: "
        "the list is read up to it, as CUDA does",
        "name GPUs and MIG instances as nvidia-smi -L lists them, or the GPU with --gpus N"
        + (" (a MIG instance's power and energy are its whole GPU's)" if mig else ""))


def _mig_problems(infos, migs) -> list[Problem]:
    """What a user measuring a GPU in MIG mode must know: the figures are the whole GPU's."""
    out = []
    for info in infos:
        named = [m.mig_uuid for m in migs if m.parent_index == info.index]
        if not named and not info.mig_mode:
            continue
        how = (f"{', '.join(named)} {'is a MIG instance' if len(named) == 1 else 'are MIG instances'} of gpu{info.index} "
               f"({info.uuid}), measured as that whole GPU" if named else f"gpu{info.index} ({info.name}) is in MIG mode")
        out.append(Problem(
            "nvml", f"{how}: {MIG_SHARED_NOTE}",
            "read its power, energy and J/token as the whole GPU's (every instance's work included); compare "
            "settings on a GPU with MIG off, or with the other instances idle"))
    return out


def _open_rapl(src: Sources, rapl_root, opener, backend) -> None:
    try:
        src.rapl = RaplCollector(rapl_root, backend=backend, opener=opener)
    except RaplPermissionError as e:
        src.problems.append(Problem("rapl", f"cannot read CPU energy: permission denied on {e.path}", PERMISSION_FIX))
        return
    except RaplUnavailableError:
        amd = _amd_energy_hwmon(rapl_root)
        if amd:
            src.problems.append(Problem(
                "rapl", f"no RAPL zones under {rapl_root}; this AMD host counts CPU energy in the amd_energy hwmon "
                f"driver ({amd}), which powerprof does not read (powercap RAPL only): no CPU energy is measured",
                "a kernel 5.11 or newer puts AMD Zen's package energy under powercap (modprobe intel_rapl_msr), "
                "which powerprof reads"))
        else:
            src.problems.append(Problem("rapl", f"no RAPL zones under {rapl_root}", UNAVAILABLE_FIX))
        return
    no_dram = _sockets_without_dram(src.rapl.zones)
    if no_dram:
        which = ", ".join(f"socket {s}" for s in no_dram)
        src.problems.append(Problem(
            "rapl", f"RAPL shows no DRAM zone for {which}: the CPU energy there is its package's alone, the memory's "
            "energy is in no CPU figure (AMD Zen and client Intel parts have no DRAM zone)", None))


def _amd_energy_hwmon(rapl_root) -> str | None:
    """The amd_energy hwmon folder beside the powercap root (/sys/class/hwmon next to /sys/class/powercap), if any."""
    try:
        for name in sorted(Path(rapl_root).parent.glob("hwmon/*/name")):
            if name.read_text().strip() == "amd_energy":
                return str(name.parent)
    except OSError:
        return None
    return None


def _sockets_without_dram(zones) -> list[int]:
    """Sockets with a package zone and no DRAM zone: their CPU energy leaves memory out."""
    packages = {z.socket for z in zones if z.kind == "package" and z.socket is not None}
    dram = {z.socket for z in zones if z.kind == "dram"}
    return sorted(packages - dram)


def describe(src: Sources) -> dict:
    """Everything `powerprof devices` shows, JSON-ready (the door adds whether it is simulated)."""
    out: dict = {"gpus": [], "can_set_limits": src.can_set_limits, "rapl": None, "host": None}
    if src.nvml is not None:
        readings = src.nvml.read()
        for info, r in zip(src.nvml.infos, readings):
            out["gpus"].append(
                {
                    "index": info.index,
                    "uuid": info.uuid,
                    "name": info.name,
                    "driver_version": info.driver_version,
                    "memory_total_bytes": info.memory_total_bytes,
                    "power_limit_w": r.power_limit_w,
                    "enforced_limit_w": r.enforced_limit_w,
                    # The same names as run.json's, so one script reads both.
                    "default_limit_w": info.limit_default_w,
                    "min_limit_w": info.limit_min_w,
                    "max_limit_w": info.limit_max_w,
                    "supports": dict(info.supports),
                }
            )
        out["can_set_limits"] = src.can_set_limits
    if src.rapl is not None:
        out["rapl"] = {
            "root": src.rapl.sysfs_root,
            "backend": src.rapl.backend,
            "min_wrap_period_s": src.rapl.min_wrap_period_s,
            "zones": [
                {
                    "zone": z.device,
                    "sysfs_id": z.sysfs_id,
                    "name": z.name,
                    "kind": z.kind,
                    "socket": z.socket,
                    "die": z.die,
                    "max_energy_range_j": z.max_energy_range_uj / 1e6 if z.max_energy_range_uj else None,
                    "wrap_period_s": z.wrap_period_s if z.max_energy_range_uj else None,
                }
                for z in src.rapl.zones
            ],
        }
    if src.host is not None:
        h = src.host.read()
        out["host"] = {"cpu_count": os.cpu_count(), "mem_total_bytes": h.mem_total_bytes, "cpu_freq_mhz": h.cpu_freq_mhz}
    out["problems"] = [asdict(p) for p in src.problems]
    return out
