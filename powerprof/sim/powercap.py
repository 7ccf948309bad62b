"""A simulated Linux powercap (RAPL) tree in a folder, its energy counters driven by a CPU power model.

Layout as the kernel makes it: zone directories under `intel-rapl/` with top-level symlinks
`intel-rapl:N` and `intel-rapl:N:M`, an `intel-rapl-mmio:0` duplicate of package 0, optional
`psys`. Counters are written in place (same inode, like sysfs), zero-padded to a fixed width so
a reader holding the file open (pyRAPL does) always sees a whole number, and wrap at
`max_energy_range_uj`. The true cumulative energy of every zone is kept for tests.

A hardware counter never falls behind, so a read through `opener` first integrates the energy up
to the monotonic clock at that instant: a process stalled for seconds (the background updater
included) still reads what a real counter would, never a jump that lands in one interval.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

import psutil

from powerprof.paths import configured_state_dir, state_folder_is_file

DEFAULT_MAX_ENERGY_RANGE_UJ = 262_143_328_850  # what Intel client and server parts report
DEFAULT_PACKAGE_W = 30.0  # per package zone, idle-ish desktop/server part
_WIDTH = 20  # digits: 2**64 fits

_log = logging.getLogger(__name__)


@dataclass
class _Zone:
    sysfs_id: str  # intel-rapl:0:1
    path: Path
    name: str  # sysfs `name`: package-0, package-0-die-1, dram, core, psys
    kind: str
    parent: "_Zone | None"
    fd: int = -1
    energy_j: float = 0.0  # true energy since the simulator started
    start_uj: int = 0
    power_w: float = 0.0
    mirror_fds: tuple[int, ...] = ()  # mmio duplicates carry the same counter


class SimPowercap:
    """`SimPowercap(root, sockets=2, dies_per_socket=1, dram=True, power_w_fn=lambda: 60.0)`.

    power_w_fn() returns the total CPU package power (W, all packages) at this instant; it is
    split evenly over the package zones. core = 60% of its package, dram = `dram_w` per package
    zone (`dram`: True, False, or the sockets that have a DRAM subzone), psys = all packages + all dram +
    `platform_w`. Power is held constant between updates,
    so the true energy is exact. The model is re-read on `update()` or from a background thread
    (`start()`/`stop()`) every `update_interval_s`; the energy is also brought up to now (at the
    power held since) whenever a file opened through `opener` is read, as hardware's always is.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        sockets: int = 1,
        dies_per_socket: int = 1,
        dram: bool | Collection[int] = True,
        core: bool = False,
        psys: bool = False,
        mmio: bool = True,
        power_w_fn: Callable[[], float] | None = None,
        dram_w: float = 3.0,
        platform_w: float = 8.0,
        max_power_w: float = 250.0,
        max_energy_range_uj: int = DEFAULT_MAX_ENERGY_RANGE_UJ,
        start_energy_uj: int | None = None,
        unreadable: bool = False,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        update_interval_s: float = 0.01,
    ):
        if sockets < 1 or dies_per_socket < 1:
            raise ValueError("sockets and dies_per_socket must be >= 1")
        if max_energy_range_uj <= 0:
            raise ValueError("max_energy_range_uj must be > 0")
        self.root = Path(root)
        self.sockets = sockets
        self.dies_per_socket = dies_per_socket
        n_pkg = sockets * dies_per_socket
        self.power_w_fn = power_w_fn or (lambda: DEFAULT_PACKAGE_W * n_pkg)
        self.dram_w = dram_w
        self.platform_w = platform_w
        self.max_power_w = max_power_w
        self.max_energy_range_uj = int(max_energy_range_uj)
        self.unreadable = unreadable
        self._clock_ns = clock_ns
        self.update_interval_s = max(0.001, float(update_interval_s))  # bounded rate
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.write_errors = 0  # the updater's failed writes (its files lagged the true energy meanwhile)
        self.last_write_error = ""
        self.zones: list[_Zone] = []
        self._build(dram, core, psys, mmio, start_energy_uj)
        self._t_last_ns = clock_ns()
        self._set_powers()
        self._write_all()

    # --- the tree ----------------------------------------------------------------------------

    def _mkzone(self, base: Path, sysfs_id: str, name: str, kind: str, parent, link_to: Path | None) -> _Zone:
        d = base / sysfs_id
        d.mkdir(parents=True)
        (d / "name").write_text(name + "\n")
        (d / "enabled").write_text("1\n")
        (d / "max_energy_range_uj").write_text(f"{self.max_energy_range_uj}\n")
        if kind in ("package", "psys"):
            limit_w = self.max_power_w * (0.5 if kind == "package" else 1.0)
            (d / "constraint_0_name").write_text("long_term\n")
            (d / "constraint_0_power_limit_uw").write_text(f"{int(limit_w * 1e6)}\n")
            (d / "constraint_0_max_power_uw").write_text(f"{int(self.max_power_w * 1e6)}\n")
            (d / "constraint_1_name").write_text("short_term\n")
            (d / "constraint_1_power_limit_uw").write_text(f"{int(self.max_power_w * 1e6)}\n")
        elif kind == "dram":
            (d / "constraint_0_name").write_text("long_term\n")
            (d / "constraint_0_power_limit_uw").write_text("0\n")
            (d / "constraint_0_max_power_uw").write_text(f"{int(max(self.dram_w * 4, 20.0) * 1e6)}\n")
        (d / "energy_uj").write_text("0\n")
        if link_to is not None:
            os.symlink(os.path.relpath(d, link_to.parent), link_to)
        z = _Zone(sysfs_id, d, name, kind, parent)
        self.zones.append(z)
        return z

    def _build(self, dram: bool | Collection[int], core: bool, psys: bool, mmio: bool, start_energy_uj: int | None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        ctl = self.root / "intel-rapl"
        ctl.mkdir()
        (ctl / "enabled").write_text("1\n")
        n = 0
        for s in range(self.sockets):
            for die in range(self.dies_per_socket):
                name = f"package-{s}" if self.dies_per_socket == 1 else f"package-{s}-die-{die}"
                top = self._mkzone(ctl, f"intel-rapl:{n}", name, "package", None, self.root / f"intel-rapl:{n}")
                m = 0
                # dram: every package has its subzone, none does, or only those of the sockets named (a
                # machine where intel-rapl:0 shows no DRAM zone and intel-rapl:1 does).
                has_dram = dram if isinstance(dram, bool) else s in set(dram)
                for sub, on in (("core", core), ("dram", has_dram)):
                    if on:
                        zid = f"intel-rapl:{n}:{m}"
                        self._mkzone(top.path, zid, sub, sub, top, self.root / zid)
                        m += 1
                n += 1
        if psys:
            self._mkzone(ctl, f"intel-rapl:{n}", "psys", "psys", None, self.root / f"intel-rapl:{n}")
        if mmio:
            mctl = self.root / "intel-rapl-mmio"
            mctl.mkdir()
            d = mctl / "intel-rapl-mmio:0"
            d.mkdir()
            (d / "name").write_text(self.zones[0].name + "\n")
            (d / "max_energy_range_uj").write_text(f"{self.max_energy_range_uj}\n")
            (d / "energy_uj").write_text("0\n")
            os.symlink(os.path.relpath(d, self.root), self.root / "intel-rapl-mmio:0")
            self._mmio_path = d / "energy_uj"
        else:
            self._mmio_path = None
        for k, z in enumerate(self.zones):
            # Real counters start wherever they were at boot; spread them so wraps differ per zone.
            z.start_uj = (
                int(start_energy_uj) if start_energy_uj is not None else (k * 7_919_000_003) % self.max_energy_range_uj
            ) % self.max_energy_range_uj
            z.fd = os.open(z.path / "energy_uj", os.O_WRONLY)
        if self._mmio_path is not None:
            self.zones[0].mirror_fds = (os.open(self._mmio_path, os.O_WRONLY),)
        self._by_counter_path = {os.path.realpath(z.path / "energy_uj"): z for z in self.zones}
        self._zone_of_path: dict[str, _Zone | None] = {}
        if self._mmio_path is not None:
            self._by_counter_path[os.path.realpath(self._mmio_path)] = self.zones[0]
        if self.unreadable:
            # Files are opened for writing first: the simulator keeps updating them, as the kernel does.
            for p in self.energy_paths():
                os.chmod(p, 0o400)

    def energy_paths(self) -> list[Path]:
        out = [z.path / "energy_uj" for z in self.zones]
        return out + ([self._mmio_path] if self._mmio_path is not None else [])

    # --- the model ---------------------------------------------------------------------------

    def _set_powers(self) -> None:
        pkgs = [z for z in self.zones if z.kind == "package"]
        per_pkg = max(0.0, float(self.power_w_fn())) / len(pkgs)
        for z in self.zones:
            if z.kind == "package":
                z.power_w = per_pkg
            elif z.kind == "core":
                z.power_w = 0.6 * per_pkg
            elif z.kind == "dram":
                z.power_w = self.dram_w
        total = sum(z.power_w for z in self.zones if z.kind in ("package", "dram"))
        for z in self.zones:
            if z.kind == "psys":
                z.power_w = total + self.platform_w

    def counter_uj(self, z: _Zone) -> int:
        return (z.start_uj + int(z.energy_j * 1e6)) % self.max_energy_range_uj

    def _write(self, z: _Zone) -> None:
        data = f"{self.counter_uj(z):0{_WIDTH}d}\n".encode()
        os.pwrite(z.fd, data, 0)
        for fd in z.mirror_fds:
            os.pwrite(fd, data, 0)

    def _write_all(self) -> None:
        for z in self.zones:
            self._write(z)

    def _integrate_to(self, now_ns: int) -> None:
        dt = (now_ns - self._t_last_ns) / 1e9
        if dt > 0:
            for z in self.zones:
                z.energy_j += z.power_w * dt
            self._t_last_ns = now_ns

    def update(self, now_ns: int | None = None) -> None:
        """Advance the counters to now with the power set at the last update, then re-read the model."""
        with self._lock:
            self._integrate_to(self._clock_ns() if now_ns is None else now_ns)
            self._set_powers()
            self._write_all()

    def refresh(self, zone: _Zone | None = None) -> None:
        """Advance the counters to now at the power held since the last update (what a read sees);
        rewrite that zone's file (a read needs only its own), or every file."""
        with self._lock:
            self._integrate_to(self._clock_ns())
            if zone is None:
                self._write_all()
            else:
                self._write(zone)

    def true_energy_j(self) -> dict[str, float]:
        """Energy per zone (by sysfs id) since the simulator started, as of the last update or read."""
        with self._lock:
            return {z.sysfs_id: z.energy_j for z in self.zones}

    def power_w(self) -> dict[str, float]:
        with self._lock:
            return {z.sysfs_id: z.power_w for z in self.zones}

    # --- a non-root reader -------------------------------------------------------------------

    def opener(self, path, mode="r", *args, **kwargs):
        """`open` as an unprivileged user sees it (tests run as root, where mode 0400 stops nobody),
        and an energy_uj file whose every read sees the counter as of that instant."""
        if self.unreadable and "r" in mode:
            st = os.stat(path)
            if not st.st_mode & stat.S_IROTH:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        f = open(path, mode, *args, **kwargs)
        zone = self._counter_zone(path) if "r" in mode else None
        if zone is not None:
            return _LiveCounterFile(f, lambda: self.refresh(zone))
        return f

    def _counter_zone(self, path) -> _Zone | None:
        key = os.fspath(path)
        if key not in self._zone_of_path:  # realpath costs a few syscalls: once per name a reader uses
            self._zone_of_path[key] = self._by_counter_path.get(os.path.realpath(key))
        return self._zone_of_path[key]

    # --- background updates ------------------------------------------------------------------

    def start(self) -> "SimPowercap":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="powerprof-sim-powercap", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        from .threads import name_this_thread

        name_this_thread("sim-powercap")
        failing = False
        while not self._stop.wait(self.update_interval_s):
            try:
                self.update()
            except OSError as e:
                # A kernel counter never stops: the true energy was integrated, and the next update rewrites the
                # files. Counted and said once a spell, never a dead thread (an unhandled traceback in whichever
                # test or command runs beside it, and counters frozen from then on).
                self.write_errors += 1
                self.last_write_error = f"{type(e).__name__}: {e}"
                if not failing:
                    _log.warning("simulated powercap %s: writing its counters failed (%s); they lag the true "
                                 "energy until a write succeeds", self.root, self.last_write_error)
                failing = True
            else:
                failing = False

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def close(self) -> None:
        self.stop()
        for z in self.zones:
            for fd in (z.fd, *z.mirror_fds):
                try:
                    os.close(fd)
                except OSError:
                    pass
            z.fd, z.mirror_fds = -1, ()

    def __enter__(self) -> "SimPowercap":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _LiveCounterFile:
    """An open energy_uj whose reads first bring the counter up to now: the sysfs backend reads it
    once after opening, pyRAPL keeps it open and re-reads after seek(0)."""

    def __init__(self, f, refresh: Callable[[], None]):
        self._f = f
        self._refresh = refresh

    def read(self, *args):
        self._refresh()
        return self._f.read(*args)

    def readline(self, *args):
        self._refresh()
        return self._f.readline(*args)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self) -> "_LiveCounterFile":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


# --- folders for simulated trees: one per process, cleaned up after processes that died ---------

SIM_POWERCAP_PREFIX = "powerprof-powercap-"
_SIM_POWERCAP_RE = re.compile(re.escape(SIM_POWERCAP_PREFIX) + r"(\d+)-")


def sim_powercap_parent(env=None) -> str:
    """Where simulated powercap trees go: the state folder when one is set (so a test's tree goes
    with its tmp_path), else the system temp folder."""
    named = configured_state_dir(env)
    return str(named) if named is not None else tempfile.gettempdir()


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
    problem = state_folder_is_file(parent)
    if problem:
        raise NotADirectoryError(problem)
    os.makedirs(parent, exist_ok=True)
    remove_stale_sim_powercap_dirs(parent)
    return tempfile.mkdtemp(prefix=f"{SIM_POWERCAP_PREFIX}{os.getpid()}-", dir=parent)
