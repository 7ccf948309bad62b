"""Opens this machine's collectors (or the simulator's) together and reports what is missing, with the fix.

`open_sources()` is what `devices`, `monitor` and later `sweep`/`daemon` call: NVML, RAPL and
host collectors where they work, and a `Problem` (message + fix) where they don't, so a machine
without a GPU or without RAPL permission still gets the rest. With `simulate=PROFILE` the GPUs
are SimNVML and RAPL is a SimPowercap tree, updated in the background, in a pid-named folder under
the state folder (POWERPROF_STATE_DIR, else $XDG_STATE_HOME/powerprof) or else the temp folder;
trees of processes that died without closing are removed when the next one is made.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable

import psutil

from powerprof.privilege import has_admin_privilege

from .host import HostCollector
from .nvml import NvmlCollector, visible_indexes
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
    """The open collectors; `close()` releases them (and stops a simulated powercap tree)."""

    nvml: NvmlCollector | None = None
    rapl: RaplCollector | None = None
    host: HostCollector | None = None
    problems: list[Problem] = field(default_factory=list)
    simulated: bool = False
    can_set_limits: bool | None = None  # None: no GPU
    sim_nvml: object | None = None  # SimNVML when simulated
    sim_powercap: object | None = None  # SimPowercap when simulated
    _tmpdir: str | None = None

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
        if self.sim_powercap is not None:
            self.sim_powercap.close()
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> "Sources":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nvml_error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def open_sources(
    simulate: str | None = None,
    gpus: list[int] | None = None,
    *,
    rapl_root: str | os.PathLike = DEFAULT_ROOT,
    rapl_backend: str = "sysfs",
    nvml=None,
    host: bool = True,
    ps=None,
    sim_cpu_power_w_fn: Callable[[], float] | None = None,
) -> Sources:
    """Collectors for the GPUs `gpus` (NVML indexes; default: those CUDA_VISIBLE_DEVICES allows), RAPL, host.

    Raises ValueError for a GPU index that does not exist (bad input); everything the machine
    lacks becomes a Problem instead. `nvml` injects an NVML-like object (tests).
    """
    src = Sources(simulated=bool(simulate))
    try:
        _open_gpus(src, simulate, gpus, nvml)
        _open_rapl(src, simulate, rapl_root, rapl_backend, sim_cpu_power_w_fn)
        if host:
            src.host = HostCollector(ps)
    except BaseException:
        src.close()
        raise
    return src


def _open_gpus(src: Sources, simulate, gpus, nvml) -> None:
    if nvml is None:
        if simulate:
            from powerprof.sim.nvml import SimNVML

            count = max(gpus) + 1 if gpus else 1
            nvml = src.sim_nvml = SimNVML(profile=simulate, count=count)
        else:
            try:
                import pynvml as nvml
            except ImportError as e:  # the dependency is declared; a broken install is still possible
                src.problems.append(Problem("nvml", f"NVML bindings missing: {e}", "pip install nvidia-ml-py"))
                return
    try:
        nvml.nvmlInit()
    except Exception as e:
        src.problems.append(Problem("nvml", f"no NVIDIA GPU reachable through NVML ({_nvml_error(e)})", NO_GPU_FIX))
        return
    try:
        count = nvml.nvmlDeviceGetCount()
        if gpus is not None:
            bad = [g for g in gpus if not 0 <= g < count]
            if bad:
                raise ValueError(f"GPU index {bad[0]} does not exist: this machine has {count} GPU(s) (0-{count - 1})")
            indexes = list(gpus)
        else:
            indexes = visible_indexes(nvml)
    finally:
        nvml.nvmlShutdown()
    if not indexes:
        why = "CUDA_VISIBLE_DEVICES hides every GPU" if count else "NVML sees no GPU"
        src.problems.append(Problem("nvml", why, NO_GPU_FIX if not count else "unset or fix CUDA_VISIBLE_DEVICES"))
        return
    src.nvml = NvmlCollector(nvml, indexes)
    priv = getattr(nvml, "privileged", None)
    src.can_set_limits = bool(priv) if priv is not None else has_admin_privilege()
    if not src.can_set_limits:
        src.problems.append(Problem("nvml", "no permission to change power limits or clocks", ROOT_FIX))
    for info in src.nvml.infos:
        missing = [k for k, ok in info.supports.items() if not ok]
        if "energy_counter" in missing:
            src.problems.append(
                Problem(
                    "nvml",
                    f"gpu{info.index} ({info.name}) has no energy counter (pre-Volta): energy is integrated from power",
                    None,
                )
            )


SIM_POWERCAP_PREFIX = "powerprof-powercap-"
_SIM_POWERCAP_RE = re.compile(re.escape(SIM_POWERCAP_PREFIX) + r"(\d+)-")


def sim_powercap_parent(env=None) -> str:
    """Where simulated powercap trees go: the state folder when one is set (so a test's tree goes
    with its tmp_path), else the system temp folder."""
    env = os.environ if env is None else env
    if env.get("POWERPROF_STATE_DIR"):
        return env["POWERPROF_STATE_DIR"]
    if env.get("XDG_STATE_HOME"):
        return os.path.join(env["XDG_STATE_HOME"], "powerprof")
    return tempfile.gettempdir()


def remove_stale_sim_powercap_dirs(parent: str) -> list[str]:
    """Remove our simulated powercap trees whose process is gone (a SIGKILL skips close())."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        m = _SIM_POWERCAP_RE.match(e.name)
        if not m or int(m.group(1)) == os.getpid() or psutil.pid_exists(int(m.group(1))):
            continue
        try:
            if not e.is_dir(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue  # another user's tree (shared /tmp) is not ours to remove
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.path)
    return removed


def make_sim_powercap_dir(env=None) -> str:
    """A fresh folder for a simulated powercap tree, named with our pid; clears dead processes' trees."""
    parent = sim_powercap_parent(env)
    os.makedirs(parent, exist_ok=True)
    remove_stale_sim_powercap_dirs(parent)
    return tempfile.mkdtemp(prefix=f"{SIM_POWERCAP_PREFIX}{os.getpid()}-", dir=parent)


def _open_rapl(src: Sources, simulate, rapl_root, backend, power_w_fn) -> None:
    opener = open
    if simulate:
        from powerprof.sim.nvml import UNPRIVILEGED_ENV
        from powerprof.sim.powercap import SimPowercap

        src._tmpdir = make_sim_powercap_dir()
        unpriv = os.environ.get(UNPRIVILEGED_ENV) == "1"
        pc = SimPowercap(src._tmpdir, power_w_fn=power_w_fn, unreadable=unpriv).start()
        src.sim_powercap = pc
        rapl_root, opener = src._tmpdir, pc.opener
    try:
        src.rapl = RaplCollector(rapl_root, backend=backend, opener=opener)
    except RaplPermissionError as e:
        src.problems.append(Problem("rapl", f"cannot read CPU energy: permission denied on {e.path}", PERMISSION_FIX))
    except RaplUnavailableError:
        src.problems.append(Problem("rapl", f"no RAPL zones under {rapl_root}", UNAVAILABLE_FIX))


def pending_restore_note() -> str | None:
    """The control layer's warning that a restore file is pending (a crashed sweep left a GPU capped)."""
    try:
        from powerprof.control.restore import pending_restore_note as note
    except ImportError:
        return None
    return note()


def describe(src: Sources) -> dict:
    """Everything `powerprof devices` shows, JSON-ready."""
    out: dict = {"simulated": src.simulated, "gpus": [], "rapl": None, "host": None}
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
    out["restore_note"] = pending_restore_note()
    return out
