"""The dry-run plan: what a run would change and put back, computed from read-only NVML calls."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from powerprof.collectors.gateway import gateway
from powerprof.paths import state_dir

from .device import read_devices
from .gpulock import holder_now
from .levels import MIN_POWER_LEVEL_GAP_W, DeviceRange, parse_clock_levels, parse_power_levels
from .restore import default_restore_path, pending_blocker


@dataclass(frozen=True)
class Plan:
    devices: tuple[DeviceRange, ...]
    power_levels_w: tuple[float, ...]
    clock_levels_mhz: tuple[int, ...]
    restore_path: Path
    permitted: bool  # whether this process looks allowed to change limits (root / CAP_SYS_ADMIN)
    label: str = ""  # what the door says these GPUs are, e.g. "simulated"
    blocker: str | None = None  # what would stop the real run before any change (a pending restore file)
    in_use: bool = False  # another controller holds a GPU now: its limit is that run's level, not the original

    def lines(self) -> list[str]:
        what = f" ({self.label})" if self.label else ""
        out = [f"Dry run: nothing will be changed{what}."]
        for d in self.devices:
            out.append(
                f"GPU {d.index} {d.name} ({d.uuid}): limit now {d.limit_w:g} W"
                + (f" (enforced {d.enforced_w:g} W)" if d.enforced_w is not None else "")
                + f", allowed {d.min_w:g}-{d.max_w:g} W, default {d.default_w:g} W"
                + (f", SM clock {d.clock_min_mhz}-{d.clock_max_mhz} MHz" if d.clock_min_mhz is not None else "")
            )
        if self.power_levels_w:
            out.append("Power limit levels (every GPU takes each level): " + ", ".join(f"{w:g} W" for w in self.power_levels_w))
            # As analysis judges it: a level within the limits' tolerance of a default is that default (a sweep
            # cannot set both 299 and 300 W, so "add 300" would be refused).
            unswept = sorted({d.default_w for d in self.devices
                              if all(abs(float(w) - d.default_w) >= MIN_POWER_LEVEL_GAP_W for w in self.power_levels_w)})
            if unswept:
                out.append(f"The default limit ({', '.join(f'{w:g} W' for w in unswept)}) is not among them: speed loss and "
                           f"energy saving will be against the highest level, {max(self.power_levels_w):g} W, not against "
                           f"the card as it runs by default; add {unswept[-1]:g} to --limits to compare with it.")
        if self.clock_levels_mhz:
            out.append("SM clock locks: " + ", ".join(f"{c} MHz" for c in self.clock_levels_mhz))
        if self.in_use:
            # The limit now is the live run's level: said as what would be put back, it read as the original.
            out.append("Afterwards: each GPU's original limit is not known while the run that holds it goes on (its "
                       "limit now is that run's level); that run puts it back when it ends.")
        else:
            back = ", ".join(f"GPU {d.index} to {d.limit_w:g} W" for d in self.devices)
            out.append(f"Afterwards (also on error, Ctrl-C, SIGTERM, SIGHUP): {back}" + (", clock locks released" if self.clock_levels_mhz else "") + ".")
        out.append(f"Restore file (written before the first change): {self.restore_path}")
        if self.blocker:
            out.append(f"{'Nothing can run' if self.in_use else 'The real run would stop before any change'}: {self.blocker}")
        if not self.permitted:
            out.append("This process is not root and lacks CAP_SYS_ADMIN: the real run would stop with a permission error; run it with sudo.")
        return out


def make_plan(
    nvml,
    indexes: Sequence[int],
    power_levels: str | Iterable | None = None,
    clock_levels: str | Iterable | None = None,
    restore_path: Path | str | None = None,
    *,
    permitted: bool,
    label: str = "",
    machine_scope: str | None = None,
) -> Plan:
    """Validates the levels (LevelError on bad input) and describes the run. Calls only NVML getters.

    `permitted`: whether this process may change limits (the door knows: root, or the simulator's
    privilege); `label` names what kind of GPUs these are in the plan's first line."""
    with gateway(nvml).session():
        devices = read_devices(nvml, indexes)
    watts = tuple(parse_power_levels(power_levels, devices)) if power_levels is not None else ()
    clocks = tuple(parse_clock_levels(clock_levels, devices)) if clock_levels is not None else ()
    path = Path(restore_path) if restore_path is not None else default_restore_path([d.uuid for d in devices], state_dir())
    # A GPU another controller holds now (this state folder's or another's, as `restore` finds it): its restore file
    # is that live run's, not a leftover to restore, and its limit now that run's level.
    busy = [(d, pid) for d in devices for held, pid in [holder_now(state_dir(), d.uuid, machine_scope)] if held]
    if busy:
        d, pid = busy[0]
        who = f"powerprof process {pid}" if pid else "another powerprof process"
        blocker = (f"GPU {d.index} is in use by {who}, which controls its power limit: nothing can run on it until "
                   f"it ends (it puts the GPU back then); wait for it, or stop it (kill {pid or 'PID'}).")
        return Plan(devices, watts, clocks, path, permitted, label, blocker, in_use=True)
    blocker = pending_blocker([d.uuid for d in devices], state_dir())
    return Plan(devices, watts, clocks, path, permitted, label, blocker)
