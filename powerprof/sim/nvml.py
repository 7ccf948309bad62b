"""An object that answers the pynvml calls powerprof makes, backed by simulated GPUs.

Constants and error classes are pynvml's own (the package is a dependency even without a GPU),
so code written against the real module runs unchanged. Settings a process changes (power
limits, locked clocks) are kept in a state file shared between processes, so a later
`powerprof restore --simulate` sees what a killed sweep left behind. A simulated server running
as its own process (`python -m powerprof.sim.serve`) publishes what its GPUs run (the phase) in
a load file beside it, and every other SimNVML on that state file follows it: the sweeping
process then reads the power and energy of the work the launched server does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pynvml

from powerprof.paths import temp_sibling, user_state_home
from powerprof.trust import PlaceRefused, untrusted_out_file

from .gpu import SimGpu
from .profiles import DEFAULT_PROFILE, MAX_SIM_GPUS, GpuProfile, get_profiles

STATE_ENV = "POWERPROF_SIM_STATE"
UNPRIVILEGED_ENV = "POWERPROF_SIM_UNPRIVILEGED"
# How long a stopped process's utilisation samples stay readable (the driver's sample buffer).
GONE_SAMPLES_S = 60.0


def default_state_path() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    return user_state_home() / "powerprof" / "sim-state.json"


def sim_uuid(profile_key: str, index: int) -> str:
    h = hashlib.sha1(f"{profile_key}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_BURN = bytes(64 * 1024)  # ~50 µs of hashing, with the GIL released (hashlib does for > 2 KiB)


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        hashlib.blake2b(_BURN)


@dataclass(frozen=True)
class SimHandle:
    index: int


@dataclass(frozen=True)
class Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class ProcessInfo:
    """nvmlDeviceGetComputeRunningProcesses' entries (the fields powerprof reads)."""

    pid: int
    usedGpuMemory: int | None


@dataclass(frozen=True)
class ProcessUtilizationSample:
    pid: int
    timeStamp: int  # µs, wall clock, as the driver stamps it
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0


@dataclass(frozen=True)
class ProcessUtilizationInfo:
    """nvmlDeviceGetProcessesUtilizationInfo's entries (nvmlProcessUtilizationInfo_v1_t): v1's and two engines more."""

    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int = 0
    decUtil: int = 0
    jpgUtil: int = 0
    ofaUtil: int = 0


@dataclass
class _GpuProcess:
    pid: int
    used_bytes: int
    share: Callable[[], float]  # the share of the GPU's time its kernels take now (0: idle)
    start_us: int
    stop_us: int | None = None
    # (sm, mem, enc, dec) shares it uses now; None: its kernels' share, with half that of the memory's bandwidth
    util: Callable[[], tuple[float, float, float, float]] | None = None
    last_util: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # as it stopped: its last samples outlive it
    name: str | None = None  # what nvmlSystemGetProcessName says of its pid (None: NOT_FOUND, as for a pid unknown)
    mps: bool = False  # an NVIDIA MPS client: listed by nvmlDeviceGetMPSComputeRunningProcesses, not the compute list

    def now_util(self) -> tuple[float, float, float, float]:
        if self.util is not None:
            return self.util()
        share = self.share()
        return share, 0.5 * share, 0.0, 0.0


@dataclass(frozen=True)
class MemoryInfo:
    total: int
    free: int
    used: int


_log = logging.getLogger(__name__)
# What a state file that cannot be used becomes, said after why (one line each, docs/simulator.md).
RESET_SAID = "taken as the default until set again"
_SAID: set[str] = set()  # the state file's warnings said so far in this process (`_StateFile.warn`)


class SimStateRefused(PlaceRefused):
    """The simulator's state file is where it must not be used: as root, in a folder another user controls, or with a
    symlink at its lock's name. The message names the file, why and the fix (nothing was written)."""


def _write_new(path: Path, text: str) -> None:
    """Write `text` to `path`, a name that must not exist yet: never through a symlink planted there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _replace_with(path: Path, text: str) -> None:
    """Replace `path` with `text` through a temporary of an unpredictable name (`paths.temp_sibling`)."""
    tmp = temp_sibling(path)
    try:
        _write_new(tmp, text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class _StateFile:
    """Power limits and locked clocks per UUID, JSON, replaced atomically under an flock."""

    def __init__(self, path: Path | None):
        self.given = path  # as the user named it: what messages say
        self._mtime_ns = -1
        # As root, the state file as given must be root's to choose: its folder (and the load file's, its lock's and
        # temporaries', the same folder) root's, or the user's who ran sudo, writable by no one else, and any symlink at
        # its name or on its way theirs too (`untrusted_out_file`): another user could plant a symlink there to have
        # root write any file. Only then resolved, once, and written through: a root link stays a link, and a second
        # controller given the link or its target has the same file, scope and lock. Resolved before this check, only
        # the target's folder was judged, and another user's link chose the file root wrote (f7e660d5).
        why = path is not None and untrusted_out_file(path)
        if why:
            raise SimStateRefused(
                f"simulator state file {path}: refusing to use it as root: {why}; another user could plant symlinks "
                f"there to have root write any file. Fix: point {STATE_ENV} at a file in a folder of root's own (or of "
                "the user who ran sudo), writable by no one else, or unset it. Nothing was written")
        self.path = Path(os.path.realpath(path)) if path is not None else None

    def warn(self, why: str) -> None:
        """One warning line naming the file, once a process: a file that is not what the simulator writes was read
        as the defaults without a word (truncated JSON), or stopped every command (a list: a traceback)."""
        named = f"{self.given}" + (f" (the file {self.path})" if self.path != self.given else "")
        line = f"simulator state file {named}: {why}"
        if line not in _SAID:  # per process: `restore --simulate` opens a simulator per record beside the rig's
            _SAID.add(line)
            _log.warning("%s", line)

    @contextlib.contextmanager
    def _locked(self):
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = str(self.path) + ".lock"
        try:  # never through a symlink planted at the lock's name: "a+" made the file it named, as root anywhere
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise SimStateRefused(f"simulator state file lock {lock} is a symlink, which powerprof never writes "
                                  f"through (another user may have planted it): look at where it points, then remove "
                                  f"it (`rm {lock}`). Nothing was written") from None
        with os.fdopen(fd, "r+") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)

    def load(self) -> dict:
        """{uuid: {setting: value}} as written by `update`; {} where the file is missing, and (said by `warn`) where it
        is no JSON object. An entry that is no object is left out, said too; the values are checked by the reader,
        which knows each card's ranges (`SimNVML._saved`)."""
        if self.path is None or not self.path.exists():
            return {}
        try:
            state = json.loads(self.path.read_text())
        except (OSError, ValueError, RecursionError) as e:  # truncated or no text (UnicodeDecodeError is a ValueError)
            why = ("not valid JSON (nested deeper than Python's parser goes)" if isinstance(e, RecursionError)
                   else "not valid JSON" if isinstance(e, ValueError) else f"cannot be read ({e.strerror or e})")
            self.warn(f"{why}: every GPU's power limit and clock lock: {RESET_SAID}")
            return {}
        if not isinstance(state, dict):
            self.warn(f"holds a JSON {type(state).__name__}, not an object: every GPU's power limit and clock lock: "
                      f"{RESET_SAID}")
            return {}
        bad = [k for k, v in state.items() if not isinstance(v, dict)]
        if bad:
            self.warn(f"the entry of {', '.join(bad)} is no JSON object: its power limit and clock lock: {RESET_SAID}")
        return {k: v for k, v in state.items() if isinstance(v, dict)}

    def changed(self) -> bool:
        if self.path is None:
            return False
        try:
            m = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            m = 0
        if m != self._mtime_ns:
            self._mtime_ns = m
            return True
        return False

    def update(self, uuid: str, **values) -> None:
        if self.path is None:
            return
        with self._locked():
            state = self.load()
            entry = state.setdefault(uuid, {})
            for k, v in values.items():
                if v is None:
                    entry.pop(k, None)
                else:
                    entry[k] = v
            _replace_with(self.path, json.dumps(state, indent=1, sort_keys=True))


class _LoadFile:
    """The phase each simulated GPU runs, published by the process whose server drives it.

    {uuid: {"kind", "share", "t_ns", "pid"}}, replaced atomically; t_ns is CLOCK_MONOTONIC, which
    every process on the machine shares, so a follower applies the change at the moment it happened."""

    def __init__(self, state_path: Path):
        self.path = state_path.with_name(state_path.name + ".load")
        self._seen: tuple[int, int] | None = self._stamp()  # what was there before us is history

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def changes(self) -> dict | None:
        """The published phases if the file changed since the last look, else None."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return None
        self._seen = stamp
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def publish(self, phases: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _replace_with(self.path, json.dumps(phases))


def _is_number(x) -> bool:
    """A finite JSON number (a bool is none, though Python counts it as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _limit_ok(p: GpuProfile, limit_mw) -> bool:
    """A power limit (mW) the card takes: nvmlDeviceSetPowerManagementLimit's rule, and the state file's."""
    return p.min_limit_w * 1000 <= limit_mw <= p.max_limit_w * 1000


def _clocks_ok(p: GpuProfile, min_mhz, max_mhz) -> bool:
    """A clock lock the card takes: nvmlDeviceSetGpuLockedClocks' rule, and the state file's."""
    return not (min_mhz > max_mhz or max_mhz < p.sm_clock_min_mhz or min_mhz > p.sm_clock_max_mhz)


class SimNVML:
    """Drop-in for the `pynvml` module. `SimNVML(profile="seed-16g", count=2)`; a host of mixed cards takes a
    profile per GPU: `SimNVML(profile="h200-141g,l4-24g")` or a list of keys or profiles (count is then their
    number). `profile` is GPU 0's (the driver's and the simulated server's), `profiles` each GPU's."""

    def __init__(
        self,
        profile: str | GpuProfile | list = DEFAULT_PROFILE,
        count: int = 1,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        state_path: Path | str | None | bool = True,
        privileged: bool | None = None,
        record_history: bool = False,
    ):
        if not 1 <= count <= MAX_SIM_GPUS:
            raise ValueError(f"{count} simulated GPUs: the simulator has at most {MAX_SIM_GPUS} GPUs "
                             f"(indexes 0-{MAX_SIM_GPUS - 1})")
        profiles = get_profiles(profile)
        if len(profiles) > 1:
            if count not in (1, len(profiles)):
                raise ValueError(f"{len(profiles)} simulated GPU profiles given for {count} GPUs: give one per GPU")
            count = len(profiles)
        self.profiles: list[GpuProfile] = (profiles * count)[:count]
        self.profile = self.profiles[0]
        if state_path is True:
            state_path = default_state_path()
        self._state = _StateFile(Path(state_path) if state_path else None)
        self.privileged = (os.environ.get(UNPRIVILEGED_ENV) != "1") if privileged is None else privileged
        self._lock = threading.Lock()
        self._cost_rng = random.Random(0x5EED)
        saved = self._state.load()
        self._state.changed()
        self.gpus: list[SimGpu] = []
        for i, prof in enumerate(self.profiles):
            uuid = sim_uuid(prof.key, i)
            limit_w, locked = self._saved(saved, uuid, prof)
            self.gpus.append(
                SimGpu(
                    prof,
                    i,
                    uuid,
                    clock_ns=clock_ns,
                    limit_w=limit_w,
                    locked_clocks_mhz=locked,
                    record_history=record_history,
                )
            )
        self._initialised = 0
        self.simulated = True
        self._load = _LoadFile(self._state.path) if self._state.path is not None else None
        self._follow = self._load is not None
        self._published: dict = {}
        self._procs: dict[int, dict[int, _GpuProcess]] = {}  # GPU index → pid → a process using it
        self._gone: dict[int, list[_GpuProcess]] = {}  # GPU index → processes that stopped, their samples kept a while
        self._followed_pids: dict[str, int] = {}  # GPU uuid → the pid of the other process whose server drives it
        # nvmlDeviceGetProcessesUtilizationInfo's answer where the board or driver lacks it (an NVML return code:
        # NOT_SUPPORTED, FUNCTION_NOT_FOUND on drivers before 550); None: it answers.
        self.v2_process_util: int | None = None

    @property
    def state_path(self) -> Path | None:
        """The file these simulated GPUs' limits and clocks live in, shared by every process that opens it (None:
        this process's own GPUs)."""
        return self._state.path

    # --- sharing the GPUs' load between processes ---------------------------------------------

    def publish_load(self) -> None:
        """This process runs the server: publish every phase change of its GPUs (and follow none)."""
        if self._load is None:
            raise ValueError("publishing the simulated GPU load needs a state file")
        self._follow = False
        pub_lock = threading.Lock()

        def publish(gpu: SimGpu, phase, t_ns: int) -> None:
            with pub_lock:
                self._published[gpu.uuid] = {"kind": phase.kind, "share": phase.compute_share, "t_ns": t_ns, "pid": os.getpid()}
                self._load.publish(dict(self._published))

        for g in self.gpus:
            g.on_phase(publish)
        # The model is loaded: this process is on the GPUs' process lists from now, as llama-server is, not only
        # from its first request (an idle baseline beside another process could not tell whose process was whose).
        for g in self.gpus:
            now = g.read()
            publish(g, now["phase"], now["t_ns"])

    def sync_settings(self) -> None:
        """Pick up limits and locked clocks another process set (a server process polls this)."""
        self._sync_settings()

    def _follow_load(self) -> None:
        from .gpu import Phase

        phases = self._load.changes()
        if not phases:
            return
        for g in self.gpus:
            e = phases.get(g.uuid)
            if isinstance(e, dict) and isinstance(e.get("pid"), int):
                self._followed_pids[g.uuid] = e["pid"]
            if isinstance(e, dict) and e.get("kind") in ("idle", "prefill", "decode"):
                g.set_phase(Phase(e["kind"], float(e.get("share") or 0.0)), t_ns=int(e.get("t_ns") or 0))

    def __getattr__(self, name):
        # Constants (NVML_*, nvmlClocksEventReason*) and error classes come from the real module, kept on the instance
        # once read: the real module's are plain attributes, where each read through here (160 a tick for 8 GPUs in
        # the daemon's collector) cost the sampler thread ~0.1 ms a tick that a real driver's process never pays.
        if name.startswith(("NVML", "nvmlClocks")):
            v = self.__dict__[name] = getattr(pynvml, name)
            return v
        raise AttributeError(name)

    # --- plumbing ---------------------------------------------------------------------------

    def _sync_settings(self) -> None:
        """Pick up limits another process changed since we last looked."""
        if not self._state.changed():
            return
        saved = self._state.load()
        for g in self.gpus:
            limit_w, locked = self._saved(saved, g.uuid, g.profile)
            want = limit_w if limit_w is not None else g.profile.default_limit_w
            if want != g.limit_w:
                g.set_limit_w(want)
            if locked != g.locked_clocks_mhz:
                g.set_locked_clocks(locked)

    def _saved(self, saved: dict, uuid: str, p: GpuProfile) -> tuple[float | None, tuple[int, int] | None]:
        """(power limit W, clock lock) the state file keeps for GPU `uuid`; None: the default, also for a value its
        setter would refuse on this card (`power_limit_mw` 99999999 showed a 150-320 W card at 100000 W), said."""
        entry = saved.get(uuid, {})
        limit_mw, locked = entry.get("power_limit_mw"), entry.get("locked_clocks_mhz")
        if limit_mw is not None and not (_is_number(limit_mw) and _limit_ok(p, limit_mw)):
            self._state.warn(f"{uuid}: power_limit_mw {limit_mw!r} is no limit of this card ({p.min_limit_w:g}-"
                             f"{p.max_limit_w:g} W): its power limit: {RESET_SAID}")
            limit_mw = None
        if locked is not None and not (isinstance(locked, list) and len(locked) == 2
                                       and all(_is_number(x) and x == int(x) for x in locked)
                                       and _clocks_ok(p, *locked)):
            self._state.warn(f"{uuid}: locked_clocks_mhz {locked!r} is no [min, max] lock of this card ("
                             f"{p.sm_clock_min_mhz}-{p.sm_clock_max_mhz} MHz): its clock lock: {RESET_SAID}")
            locked = None
        return (limit_mw / 1000 if limit_mw else None), (tuple(int(x) for x in locked) if locked else None)

    def _gpu(self, handle: SimHandle) -> SimGpu:
        if self._initialised <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if not isinstance(handle, SimHandle) or not 0 <= handle.index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self._follow:
            self._follow_load()
        return self.gpus[handle.index]

    def _need_root(self) -> None:
        if not self.privileged:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    # --- init / enumeration ------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        self._initialised = max(0, self._initialised - 1)

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.profile.driver_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return SimHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid) -> SimHandle:
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        for g in self.gpus:
            if g.uuid == uuid:
                return SimHandle(g.index)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle) -> int:
        return self._gpu(handle).index

    def nvmlDeviceGetName(self, handle) -> str:
        return self._gpu(handle).profile.name

    def nvmlDeviceGetUUID(self, handle) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetArchitecture(self, handle) -> int:
        arch = self._gpu(handle).profile.architecture.upper()
        return getattr(pynvml, f"NVML_DEVICE_ARCH_{arch}", pynvml.NVML_DEVICE_ARCH_UNKNOWN)

    def nvmlDeviceGetMigMode(self, handle):
        if not self._gpu(handle).profile.mig_capable:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [0, 0]  # (current, pending): MIG off, as shipped

    def nvmlDeviceGetPersistenceMode(self, handle) -> int:
        self._gpu(handle)
        return 1

    # --- readings ----------------------------------------------------------------------------

    def nvmlDeviceGetPowerUsage(self, handle) -> int:
        g = self._gpu(handle)
        # GA100 and older: instant power, as the instant field reads it.
        w = g.average_power_w() if g.profile.power_avg_window_s > 0 else g.instant_power_w()
        return int(round(w * 1000))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle) -> int:
        g = self._gpu(handle)
        if not g.profile.has_energy_counter:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return int(self._spend_around(g.profile.energy_counter_call_s, g.counter_energy_j) * 1000)

    def _spend_around(self, cost: tuple[float, float], value: Callable[[], float]) -> float:
        """Burn the CPU a real read costs inside the driver (the median; the p99 one call in 50) and
        take the value halfway through: a real driver's instant within its ~3 ms call is unknown,
        and the sampler dates a reading at the middle of its read.

        Hashing a large buffer releases the GIL, as a real ctypes call into the driver does: the
        caller's other threads run on meanwhile while this one keeps a core busy.
        """
        median_s, p99_s = cost
        if median_s <= 0:
            return value()
        with self._lock:
            slow = self._cost_rng.random() < 0.02
        half = (p99_s if slow else median_s) / 2
        _burn(half)
        v = value()
        _burn(half)
        return v

    def nvmlDeviceGetFieldValues(self, handle, field_ids):
        g = self._gpu(handle)
        out = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        now_us = time.time_ns() // 1000
        counter_j = None
        for k, fid in enumerate(field_ids):
            v = out[k]
            v.fieldId = fid
            v.timestamp = now_us
            v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            if fid == pynvml.NVML_FI_DEV_POWER_INSTANT and g.profile.has_instant_power:
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.value.uiVal = int(round(g.instant_power_w() * 1000))
            elif (fid == pynvml.NVML_FI_DEV_POWER_AVERAGE and g.profile.has_instant_power
                  and g.profile.power_avg_window_s > 0):  # nvml.h: Ampere except GA100 and newer only
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.value.uiVal = int(round(g.average_power_w() * 1000))
            elif fid in (pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, pynvml.NVML_FI_DEV_ENERGY) and g.profile.has_energy_counter:
                # The same counter, at the same cost, as on a real H200 (docs/hardware.md).
                if counter_j is None:  # one driver query serves every energy field of the call
                    counter_j = self._spend_around(g.profile.energy_counter_call_s, g.counter_energy_j)
                v.nvmlReturn = pynvml.NVML_SUCCESS
                v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                v.value.ullVal = int(counter_j * 1000)
            else:
                v.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return out

    def nvmlDeviceGetClockInfo(self, handle, clock_type: int) -> int:
        r = self._gpu(handle).read()
        if clock_type == pynvml.NVML_CLOCK_SM or clock_type == pynvml.NVML_CLOCK_GRAPHICS:
            return int(r["sm_clock_mhz"])
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return int(r["mem_clock_mhz"])
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetMaxClockInfo(self, handle, clock_type: int) -> int:
        p = self._gpu(handle).profile
        if clock_type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return p.sm_clock_max_mhz
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return p.mem_clock_mhz
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetSupportedMemoryClocks(self, handle) -> list[int]:
        return [self._gpu(handle).profile.mem_clock_mhz]

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle, mem_clock_mhz: int) -> list[int]:
        return list(self._gpu(handle).profile.sm_clocks_mhz[::-1])  # highest first, as NVML lists them

    def nvmlDeviceGetUtilizationRates(self, handle) -> Utilization:
        gpu, mem = self._gpu(handle).utilization()
        return Utilization(gpu=gpu, memory=mem)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None) -> MemoryInfo:
        g = self._gpu(handle)
        total = g.profile.memory_total_bytes
        used = int(total * 0.92) if g.read()["phase"].kind != "idle" else int(total * 0.9)
        return MemoryInfo(total=total, free=total - used, used=used)

    # --- the processes using a GPU -----------------------------------------------------------------

    def add_process(self, index: int, pid: int, used_bytes: int, share: Callable[[], float],
                    util: Callable[[], tuple[float, float, float, float]] | None = None, name: str | None = None,
                    mps: bool = False) -> None:
        """A process uses GPU `index` from now (a server that loaded its model, a bystander: sim/bystander.py);
        `util`: the (SM, memory, encoder, decoder) shares its samples say, where they are not `share`'s; `name`: what
        nvmlSystemGetProcessName says of the pid (another pid namespace's process with this one's number, in tests);
        `mps`: an MPS client, on NVML's MPS list only (nvmlDeviceGetMPSComputeRunningProcesses)."""
        with self._lock:
            self._procs.setdefault(index, {})[pid] = _GpuProcess(pid, int(used_bytes), share, time.time_ns() // 1000,
                                                                 util=util, name=name, mps=mps)

    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        """The name a process added with one says (NVML's: the executable's path), else NOT_FOUND."""
        with self._lock:
            for procs in self._procs.values():
                p = procs.get(int(pid))
                if p is not None and p.name:
                    return p.name.encode()
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def remove_process(self, index: int, pid: int) -> None:
        """The process stops using GPU `index` (it exited): gone from the process lists at once, while the driver's
        utilisation samples of the time it ran stay readable for GONE_SAMPLES_S (NVML keeps a buffer of samples,
        read since a timestamp)."""
        with self._lock:
            p = self._procs.get(index, {}).pop(pid, None)
            if p is None:
                return
            p.stop_us, p.last_util = time.time_ns() // 1000, p.now_util()
            keep_us = p.stop_us - int(GONE_SAMPLES_S * 1e6)
            self._gone[index] = [q for q in self._gone.get(index, []) if q.stop_us > keep_us] + [p]

    def _processes(self, handle) -> list[_GpuProcess]:
        g = self._gpu(handle)
        with self._lock:
            procs = list(self._procs.get(handle.index, {}).values())
        pid = self._followed_pids.get(g.uuid)
        if pid is not None and all(p.pid != pid for p in procs):
            # A launched server's process drives this GPU (its published load says which pid).
            procs.append(_GpuProcess(pid, int(g.profile.memory_total_bytes * 0.85),
                                     lambda: 0.0 if g.read()["phase"].kind == "idle" else 1.0, 0))
        return procs

    def nvmlDeviceGetComputeRunningProcesses(self, handle) -> list[ProcessInfo]:
        return [ProcessInfo(p.pid, p.used_bytes) for p in self._processes(handle) if not p.mps]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle) -> list[ProcessInfo]:
        """The MPS clients on the GPU (none where no MPS client was added: an empty list, as NVML's without MPS)."""
        return [ProcessInfo(p.pid, p.used_bytes) for p in self._processes(handle) if p.mps]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle) -> list[ProcessInfo]:
        self._gpu(handle)
        return []

    def _process_samples(self, handle, time_stamp_us: int) -> list[tuple[int, int, tuple[int, int, int, int]]]:
        """(pid, stamp µs, (sm, mem, enc, dec) %) of every process that used an engine since `time_stamp_us`."""
        now_us = time.time_ns() // 1000
        pct = lambda u: tuple(int(round(100 * x)) for x in u)  # noqa: E731
        out = []
        for p in self._processes(handle):
            u = p.now_util()
            if any(x > 0 for x in u) and (p.stop_us is None or p.stop_us > time_stamp_us):
                out.append((p.pid, now_us, pct(u)))
        with self._lock:
            gone = list(self._gone.get(handle.index, []))
        for p in gone:  # stopped since `time_stamp_us`, after working until then
            if any(x > 0 for x in p.last_util) and p.stop_us > time_stamp_us:
                out.append((p.pid, p.stop_us, pct(p.last_util)))
        return out

    def nvmlDeviceGetProcessUtilization(self, handle, time_stamp_us: int) -> list[ProcessUtilizationSample]:
        """One sample per process that used an engine since `time_stamp_us` (NVML_ERROR_NOT_FOUND: none did)."""
        out = [ProcessUtilizationSample(pid, ts, *u) for pid, ts, u in self._process_samples(handle, time_stamp_us)]
        if not out:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return out

    def nvmlDeviceGetProcessesUtilizationInfo(self, handle, time_stamp_us: int) -> list[ProcessUtilizationInfo]:
        """The newer call (drivers ≥ 550): the same samples with the JPEG and optical-flow engines. With none,
        pynvml's wrapper raises NVMLError(NVML_SUCCESS): its first call found nothing to size an array for."""
        if self.v2_process_util is not None:
            raise pynvml.NVMLError(self.v2_process_util)
        out = [ProcessUtilizationInfo(pid, ts, *u) for pid, ts, u in self._process_samples(handle, time_stamp_us)]
        if not out:
            raise pynvml.NVMLError(pynvml.NVML_SUCCESS)
        return out

    def nvmlDeviceGetTemperature(self, handle, sensor: int) -> int:
        return int(round(self._gpu(handle).read()["temperature_c"]))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle) -> int:
        return int(self._gpu(handle).read()["reasons"])

    nvmlDeviceGetCurrentClocksThrottleReasons = nvmlDeviceGetCurrentClocksEventReasons

    # --- limits and clocks -------------------------------------------------------------------

    def nvmlDeviceGetPowerManagementLimit(self, handle) -> int:
        self._sync_settings()
        return int(round(self._gpu(handle).limit_w * 1000))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle) -> int:
        return self.nvmlDeviceGetPowerManagementLimit(handle)

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle) -> list[int]:
        p = self._gpu(handle).profile
        return [int(p.min_limit_w * 1000), int(p.max_limit_w * 1000)]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle) -> int:
        return int(self._gpu(handle).profile.default_limit_w * 1000)

    def nvmlDeviceSetPowerManagementLimit(self, handle, limit_mw: int) -> None:
        g = self._gpu(handle)
        self._need_root()
        p = g.profile
        if not _limit_ok(p, limit_mw):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            g.set_limit_w(limit_mw / 1000)
            default = limit_mw == int(p.default_limit_w * 1000)
            self._state.update(g.uuid, power_limit_mw=None if default else int(limit_mw))
            self._state.changed()

    def nvmlDeviceSetGpuLockedClocks(self, handle, min_mhz: int, max_mhz: int) -> None:
        g = self._gpu(handle)
        self._need_root()
        if not _clocks_ok(g.profile, min_mhz, max_mhz):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            g.set_locked_clocks((min_mhz, max_mhz))
            self._state.update(g.uuid, locked_clocks_mhz=[int(min_mhz), int(max_mhz)])
            self._state.changed()

    def nvmlDeviceResetGpuLockedClocks(self, handle) -> None:
        g = self._gpu(handle)
        self._need_root()
        with self._lock:
            g.set_locked_clocks(None)
            self._state.update(g.uuid, locked_clocks_mhz=None)
            self._state.changed()

    # --- for tests and the simulated server (not NVML) ----------------------------------------

    def external_clock_change(self, index: int, locked_mhz: tuple[int, int] | None = None) -> None:
        """GPU `index`'s clock lock changed behind the controller's back: None is `nvidia-smi -rgc` by
        another tool, a GPU reset or a driver reload (the lock is gone, the clock boosts again); (lo, hi)
        is another tool's `nvidia-smi -lgc lo,hi`. No permission check: a reset needs none from us. The
        state file changes too, so every process on it sees what every process on a real machine would."""
        g = self.gpus[index]
        lock = None if locked_mhz is None else (int(locked_mhz[0]), int(locked_mhz[1]))
        with self._lock:
            g.set_locked_clocks(lock)
            self._state.update(g.uuid, locked_clocks_mhz=None if lock is None else list(lock))
            self._state.changed()

    def external_reset(self, index: int) -> None:
        """GPU `index` was reset (nvidia-smi -r, a driver recovery, a reboot): as on a real card its power
        limit is its default again and its clock lock is gone. The handles and the energy counter are the
        NVML plug's part (sim/faults.py FaultyNVML.reset); no permission check, as `external_clock_change`."""
        g = self.gpus[index]
        with self._lock:
            g.set_limit_w(g.profile.default_limit_w)
            g.set_locked_clocks(None)
            self._state.update(g.uuid, power_limit_mw=None, locked_clocks_mhz=None)
            self._state.changed()

    def locked_clocks_mhz(self, index: int) -> tuple[int, int] | None:
        self._sync_settings()
        return self.gpus[index].locked_clocks_mhz
