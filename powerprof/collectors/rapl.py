"""RAPL collector: CPU package/DRAM/psys energy from Linux powercap, wraparound-corrected, cumulative.

Zones are found under an injected sysfs root (default /sys/class/powercap): `intel-rapl:N`
(`package-N` or `package-N-die-M`, or `psys`) and their subzones `intel-rapl:N:M` (`core`,
`uncore`, `dram`). `intel-rapl-mmio:*` zones re-expose package counters and are skipped so
nothing is counted twice. Each `energy_uj` is a counter that wraps at `max_energy_range_uj`;
one wrap between two reads is corrected, several cannot be detected, so the collector must be
read at least once per wrap period (`min_wrap_period_s`, checked by `check_interval`). A delta
above IMPLAUSIBLE_POWER_FACTOR x the zone's maximum power (a reset read as a wrap, a counter that
jumped) is dropped with a note and a new epoch, never stored as a figure.

Two backends read the counters: "sysfs" (ours, reopens each file per read) and "pyrapl"
(pyRAPL 0.2.3.1's `PkgAPI` reader, which keeps the files open). pyRAPL's own discovery is not
used: it hard-codes /sys paths, takes one zone per socket from the CPU topology (so
`package-N-die-M` parts fail to initialise) and raises without a DRAM zone; it also has no
wraparound handling. Discovery, naming and wraparound stay ours for both backends.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

DEFAULT_ROOT = "/sys/class/powercap"
BACKENDS = ("sysfs", "pyrapl")

# The zones whose sum is "CPU energy": core/uncore lie inside their package, psys holds everything.
CPU_ENERGY_KINDS = ("package", "dram")

# Interval power is reported only over at least this long: RAPL counters step about every 1 ms on
# hardware (10 ms in the simulated tree), so shorter intervals give noise or a false 0 W.
MIN_POWER_INTERVAL_S = 0.05

# A zone's maximum power where it publishes no *_max_power_uw (for the wrap period and the
# implausible-jump bound); generous on purpose, since a too-high figure merely asks for more
# frequent reads and lets a bigger jump pass, where a too-low one drops real energy.
ASSUMED_MAX_POWER_W = {"package": 500.0, "psys": 1000.0, "dram": 150.0, "core": 500.0, "uncore": 200.0}

# A delta worth more than this many times the zone's maximum power over its interval is not energy
# but a counter jump: a reset read as a wrap (a whole max_energy_range_uj), or a counter that was
# held back and caught up. Generous, so that a true burst past the published limits is never lost.
IMPLAUSIBLE_POWER_FACTOR = 3.0

# A live package, DRAM or psys counter steps about every 1 ms by at least one energy unit (15-61 uJ),
# and these zones never draw 0 W: one unmoved this long is a stub (a VM exposing RAPL that does not
# count) or a stuck counter, whose 0 W would pass for a measurement. core/uncore (the iGPU) can be
# truly power-gated to 0 W, so they are not judged.
COUNTER_STALL_S = 0.25
STALL_KINDS = ("package", "dram", "psys")

# The boot-time line is systemd/powerprof.service's own (a test keeps them equal): a glob with no match
# (no subzones) is skipped, so the unit still starts; `$$` is systemd's escape for `$`.
RAPL_EXEC_START_PRE = (
    "ExecStartPre=+/bin/sh -c 'for f in /sys/class/powercap/intel-rapl:*/energy_uj "
    "/sys/class/powercap/intel-rapl:*:*/energy_uj; do [ -e \"$$f\" ] && chgrp powerprof \"$$f\" && "
    "chmod g+r \"$$f\"; done; exit 0'"
)

PERMISSION_FIX = (
    "energy_uj is readable by root only (since CVE-2020-8694). Either run powerprof as root (sudo powerprof "
    "measure/sweep), or give a group read access at every boot: the daemon's unit does it for its own group "
    "(powerprof; no person joins it, docs/daemon.md#trust-boundaries) with\n"
    f"  {RAPL_EXEC_START_PRE}\n"
    "or a udev rule (/etc/udev/rules.d/90-powercap.rules):\n"
    '  SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chgrp powerprof /sys%p/energy_uj", '
    'RUN+="/bin/chmod g+r /sys%p/energy_uj"\n'
    "or sysfsutils (/etc/sysfs.conf): `mode class/powercap/intel-rapl:0/energy_uj = 0440` and "
    "`owner class/powercap/intel-rapl:0/energy_uj = root:powerprof` for each zone. To read RAPL as yourself, "
    "use a group of your own for RAPL in place of powerprof in these rules (it reads a power side channel)."
)

UNAVAILABLE_FIX = (
    "load the RAPL driver (modprobe intel_rapl_msr; AMD Zen needs kernel 5.11+), or in a container "
    "bind-mount /sys/class/powercap read-only (containers usually mask it)."
)

_ZONE_RE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")
_PKG_RE = re.compile(r"^package-(\d+)(?:-die-(\d+))?$")


class RaplError(RuntimeError):
    """RAPL cannot be read here."""


class RaplUnavailableError(RaplError):
    """No RAPL zones under the sysfs root."""


class RaplPermissionError(RaplError, PermissionError):
    """energy_uj exists but this user may not read it. The message names the fix."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(f"permission denied reading {path}: {PERMISSION_FIX}")


@dataclass(frozen=True, slots=True)
class RaplZone:
    """One counter: where it is and what it measures."""

    sysfs_id: str  # intel-rapl:0:1
    path: str  # its directory
    name: str  # the sysfs `name`: package-0, package-0-die-1, dram, core, psys
    device: str  # unique across the machine: package-0-die-1, dram-0, core-0-die-1, psys
    kind: str  # package | dram | psys | core | uncore | (other sysfs names as they are)
    socket: int | None
    die: int | None
    max_energy_range_uj: int | None  # None: unknown, so a counter that goes backwards is dropped
    max_power_w: float | None  # highest *_max_power_uw the zone publishes: what the part can draw
    power_limit_w: float | None = None  # highest *_power_limit_uw at discovery: an operator's setting

    @property
    def top_power_w(self) -> float:
        """The most this zone can draw: its published maximum, else a generous guess; a power limit
        above that raises it (PL2 bursts past a TDP-valued maximum), never lowers it: an operator
        may set PL1 = PL2 = 35 W, or change the limits after discovery, and a bound of 3 x 35 W
        would drop real energy as a "jump"."""
        base = self.max_power_w or ASSUMED_MAX_POWER_W.get(self.kind, 500.0)
        return max(base, self.power_limit_w or 0.0)

    @property
    def wrap_period_s(self) -> float:
        """Shortest time the counter can take to wrap (inf when the range is unknown)."""
        if not self.max_energy_range_uj:
            return math.inf
        return self.max_energy_range_uj / 1e6 / self.top_power_w


@dataclass(frozen=True, slots=True)
class RaplReading:
    """One zone at one read. None means it could not be read, never zero."""

    zone: str  # RaplZone.device
    kind: str
    socket: int | None
    energy_j: float | None  # cumulative, wrap-corrected, since the collector started
    power_w: float | None  # over the interval since this collector's previous read
    die: int | None = None
    epoch: int = 0  # bumped whenever a delta had to be dropped: never subtract energies across epochs
    note: str | None = None  # why a value is missing or a delta was dropped


# --- discovery ---------------------------------------------------------------------------------


def _read_text(opener, path) -> str | None:
    try:
        with opener(path, "r") as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def _read_int(opener, path) -> int | None:
    s = _read_text(opener, path)
    try:
        return int(s) if s is not None else None
    except ValueError:
        return None


def _highest_w(opener, d: Path, suffix: str) -> float | None:
    """The highest positive constraint_*<suffix> of a zone, in W (None: none published, or all 0)."""
    best = 0
    for p in d.glob(f"constraint_*{suffix}"):
        v = _read_int(opener, p)
        if v and v > best:
            best = v
    return best / 1e6 if best > 0 else None


def discover_zones(sysfs_root: str | os.PathLike = DEFAULT_ROOT, opener: Callable = open) -> list[RaplZone]:
    """Every RAPL zone under the root, packages first, each counted once."""
    root = Path(sysfs_root)
    if not root.is_dir():
        return []
    found: dict[str, Path] = {}
    for entry in root.iterdir():
        if _ZONE_RE.match(entry.name):
            found.setdefault(entry.name, entry)
            # Subzones may only exist nested inside their parent (no top-level link).
            if entry.is_dir():
                for sub in entry.iterdir():
                    if _ZONE_RE.match(sub.name) and sub.is_dir():
                        found.setdefault(sub.name, sub)
    # Some trees expose the same directory under two names; keep one per real path.
    by_real: dict[str, tuple[str, Path]] = {}
    for zid, p in found.items():
        by_real.setdefault(os.path.realpath(p), (zid, p))

    def key(zid: str):
        m = _ZONE_RE.match(zid)
        return (int(m.group(1)), -1 if m.group(2) is None else int(m.group(2)))

    tops: dict[int, RaplZone] = {}
    zones: list[RaplZone] = []
    used: set[str] = set()
    for zid, p in sorted(by_real.values(), key=lambda t: key(t[0])):
        name = _read_text(opener, p / "name")
        if not name:
            continue
        n, sub = key(zid)
        if sub < 0:
            m = _PKG_RE.match(name)
            if m:
                kind, socket, die = "package", int(m.group(1)), (int(m.group(2)) if m.group(2) else None)
            else:
                kind, socket, die = name, None, None
            device = name
        else:
            parent = tops.get(n)
            kind = name
            socket, die = (parent.socket, parent.die) if parent else (None, None)
            suffix = parent.name[len("package") :] if parent and parent.kind == "package" else f"-{n}"
            device = name + suffix
        if device in used:
            device = f"{device}-{zid}"
        used.add(device)
        z = RaplZone(
            sysfs_id=zid,
            path=str(p),
            name=name,
            device=device,
            kind=kind,
            socket=socket,
            die=die,
            max_energy_range_uj=_read_int(opener, p / "max_energy_range_uj") or None,
            max_power_w=_highest_w(opener, p, "_max_power_uw"),
            power_limit_w=_highest_w(opener, p, "_power_limit_uw"),
        )
        if sub < 0:
            tops[n] = z
        zones.append(z)
    return zones


# --- arithmetic --------------------------------------------------------------------------------


def wrap_delta_uj(prev_uj: int, now_uj: int, max_range_uj: int | None) -> int | None:
    """Energy between two counter values; None when the counter went backwards with no known range."""
    d = now_uj - prev_uj
    if d >= 0:
        return d
    if not max_range_uj:
        return None
    return d + max_range_uj


def cpu_energy_j(readings: Sequence[RaplReading], kinds: Iterable[str] = CPU_ENERGY_KINDS) -> tuple[float | None, int]:
    """Cumulative CPU energy of one read (package + DRAM by default) and the epoch it belongs to.

    The energy is None when no zone of those kinds exists or any of them is unreadable: a partial
    sum would look like a counter reset. The epoch (the sum of the zones' epochs) goes up whenever
    any zone dropped a delta: reads of different epochs are never subtracted (the rule is
    `energy.epoch_broken`).
    """
    kinds = set(kinds)
    zones = [r for r in readings if r.kind in kinds]
    epoch = sum(r.epoch for r in zones)
    if not zones or any(r.energy_j is None for r in zones):
        return None, epoch
    return float(sum(r.energy_j for r in zones)), epoch


# --- backends ----------------------------------------------------------------------------------


class _SysfsCounters:
    def __init__(self, zones: list[RaplZone], opener: Callable):
        self.paths = [os.path.join(z.path, "energy_uj") for z in zones]
        self.opener = opener

    def read_uj(self) -> list:
        out: list = []
        for p in self.paths:
            try:
                with self.opener(p, "r") as f:
                    out.append(int(f.read()))
            except PermissionError:
                raise RaplPermissionError(p) from None
            except (OSError, ValueError) as e:
                out.append(e)
        return out

    def close(self) -> None:
        pass


class _PyraplCounters:
    """pyRAPL's PkgAPI reader pointed at our zones (one pyRAPL 'socket' slot per zone)."""

    def __init__(self, zones: list[RaplZone], opener: Callable):
        import logging

        # On import pyRAPL calls logging.warning() about pymongo (an output we don't use), which
        # would also install a root handler: give root a silent handler for the duration.
        hush = logging.NullHandler()
        was = logging.root.manager.disable
        logging.root.addHandler(hush)
        logging.disable(logging.WARNING)
        try:
            from pyRAPL import PkgAPI
        finally:
            logging.disable(was)
            logging.root.removeHandler(hush)

        class _ZoneAPI(PkgAPI):
            # DeviceAPI.__init__ reads the CPU topology from the real /sys; we already know the zones.
            def __init__(self, dirs):
                self._dirs = dirs
                self._socket_ids = list(range(len(dirs)))
                self._sys_files = self._open_rapl_files()

            def _get_socket_directory_names(self):
                return [(d, i) for i, d in enumerate(self._dirs)]

            def _open_rapl_files(self):
                # PkgAPI's own, with the injected opener in place of the builtin open.
                return [opener(os.path.join(d, "energy_uj"), "r") for d in self._dirs]

        try:
            self.api = _ZoneAPI([z.path for z in zones])
        except PermissionError as e:
            raise RaplPermissionError(e.filename or zones[0].path) from None

    def read_uj(self) -> list:
        try:
            return [int(v) for v in self.api.energy()]
        except PermissionError as e:
            raise RaplPermissionError(e.filename or "energy_uj") from None
        except (OSError, ValueError) as e:
            return [e] * len(self.api._dirs)

    def close(self) -> None:
        for f in self.api._sys_files:
            try:
                f.close()
            except OSError:
                pass


# --- the collector -----------------------------------------------------------------------------


class RaplCollector:
    """Cumulative wrap-corrected energy and interval power per RAPL zone; `source = "rapl"`.

    `RaplCollector(sysfs_root="/sys/class/powercap", backend="sysfs"|"pyrapl")`. Raises
    RaplUnavailableError when there are no zones and RaplPermissionError (message names the
    fix) when the counters cannot be read. Thread-safe.
    """

    source = "rapl"

    def __init__(
        self,
        sysfs_root: str | os.PathLike = DEFAULT_ROOT,
        backend: str = "sysfs",
        kinds: Iterable[str] | None = None,
        opener: Callable = open,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"unknown RAPL backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
        self.sysfs_root = str(sysfs_root)
        self.backend = backend
        zones = discover_zones(sysfs_root, opener)
        if kinds is not None:
            want = set(kinds)
            zones = [z for z in zones if z.kind in want]
        if not zones:
            raise RaplUnavailableError(f"no RAPL zones under {self.sysfs_root}: {UNAVAILABLE_FIX}")
        self.zones = zones
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        # Probe with our reader first: a permission problem gets the same clear error on both backends.
        sysfs = _SysfsCounters(zones, opener)
        probe = sysfs.read_uj()
        self._counters = sysfs if backend == "sysfs" else _PyraplCounters(zones, opener)
        n = len(zones)
        now = clock_ns()
        self._prev_uj: list[int | None] = [v if isinstance(v, int) else None for v in probe]
        self._prev_t: list[int] = [now] * n
        self._energy_j = [0.0] * n
        self._epoch = [0] * n
        self._moved_t: list[int] = [now] * n  # when each counter was last seen to change
        self._stalled = [False] * n

    @property
    def min_wrap_period_s(self) -> float:
        """The fastest any zone's counter can wrap: read at least this often."""
        return min(z.wrap_period_s for z in self.zones)

    def check_interval(self, interval_s: float) -> None:
        """Refuse a sampling interval that could let a counter wrap twice between reads (half-period margin)."""
        w = self.min_wrap_period_s
        if interval_s > w / 2:
            raise ValueError(
                f"sampling interval {interval_s} s is too long for RAPL: a counter can wrap every {w:.3g} s "
                f"at its maximum power; sample at least every {w / 2:.3g} s"
            )

    def read(self) -> tuple[RaplReading, ...]:
        with self._lock:
            raw = self._counters.read_uj()
            now = self._clock_ns()
            return tuple(self._update(k, z, raw[k], now) for k, z in enumerate(self.zones))

    def _update(self, k: int, z: RaplZone, v, now: int) -> RaplReading:
        if not isinstance(v, int):
            return RaplReading(z.device, z.kind, z.socket, None, None, z.die, self._epoch[k], f"unreadable: {v}")
        prev, t_prev = self._prev_uj[k], self._prev_t[k]
        self._prev_uj[k], self._prev_t[k] = v, now
        if prev is None:
            # First good value (or after a failure without a baseline): start counting here.
            self._moved_t[k] = now
            return RaplReading(z.device, z.kind, z.socket, self._energy_j[k], None, z.die, self._epoch[k])
        elapsed_s = (now - t_prev) / 1e9
        if z.kind in STALL_KINDS:
            still_s = (now - self._moved_t[k]) / 1e9
            if v == prev and still_s >= COUNTER_STALL_S:
                if not self._stalled[k]:
                    # Windows reaching back to before the stall showed 0 W of it: they must not subtract across.
                    self._stalled[k] = True
                    self._epoch[k] += 1
                note = (f"counter unmoved for {still_s:.3g} s (a live {z.kind} counter steps every ~1 ms): a stub "
                        "(a VM's RAPL that does not count) or a stuck counter, not 0 W; no figure")
                return RaplReading(z.device, z.kind, z.socket, None, None, z.die, self._epoch[k], note)
            if v != prev:
                self._moved_t[k] = now
                if self._stalled[k]:
                    self._stalled[k] = False
                    self._epoch[k] += 1
                    return RaplReading(
                        z.device, z.kind, z.socket, self._energy_j[k], None, z.die, self._epoch[k],
                        f"counter moved again after {still_s:.3g} s unmoved: the energy over that span is unknown; delta dropped",
                    )
        d = wrap_delta_uj(prev, v, z.max_energy_range_uj)
        note = None
        if d is None:
            note = "counter went backwards and its range is unknown: delta dropped"
        elif elapsed_s > z.wrap_period_s:
            note = f"{elapsed_s:.3g} s since the last read, longer than the wrap period: delta dropped"
            d = None
        else:
            # Judged over at least the shortest interval that has a power figure, so back-to-back
            # reads are held to the same bound without dividing by a few microseconds.
            span_s = max(elapsed_s, MIN_POWER_INTERVAL_S)
            limit_w = IMPLAUSIBLE_POWER_FACTOR * z.top_power_w
            if d / 1e6 > limit_w * span_s:
                note = (
                    f"counter jumped {d / 1e6:.4g} J in {elapsed_s:.3g} s ({d / 1e6 / span_s:.4g} W), above "
                    f"{limit_w:.4g} W ({IMPLAUSIBLE_POWER_FACTOR:g}x the zone's {z.top_power_w:.4g} W maximum"
                    f"{'' if z.max_power_w else ', assumed: it publishes none'}): "
                    "a counter reset or a stalled read, not energy; delta dropped"
                )
                d = None
        if d is None:
            self._epoch[k] += 1
            return RaplReading(z.device, z.kind, z.socket, self._energy_j[k], None, z.die, self._epoch[k], note)
        self._energy_j[k] += d / 1e6
        # Back-to-back reads (an on-demand edge sample right after a tick) span less than the counter's
        # update step: their quotient is noise or a false 0 W, so such an interval has no power figure.
        power = d / 1e6 / elapsed_s if elapsed_s >= MIN_POWER_INTERVAL_S else None
        return RaplReading(z.device, z.kind, z.socket, self._energy_j[k], power, z.die, self._epoch[k])

    def close(self) -> None:
        self._counters.close()
