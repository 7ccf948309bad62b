"""Parsing and validating requested levels (power limits, SM clocks, GPU indexes): pure functions."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from powerprof.collectors.limitwatch import LIMIT_TOLERANCE_W

# Two power levels this close or closer are one setting: a limit is set and read back to within LIMIT_TOLERANCE_W
# (a card may round what it is given; another tool's move is judged against it), so no reading tells them apart,
# and a sweep's J/token cannot resolve a step that small either. Refused, not merged: the user meant something.
MIN_POWER_LEVEL_GAP_W = LIMIT_TOLERANCE_W


class LevelError(ValueError):
    """Requested levels are unusable. The message lists every problem and the allowed range."""

    def __init__(self, problems: Sequence[str], allowed: str):
        self.problems = tuple(problems)
        self.allowed = allowed
        super().__init__("; ".join(self.problems) + f". {allowed} Nothing was changed.")


@dataclass(frozen=True)
class DeviceRange:
    """What one GPU allows, as NVML reports it. Powers in W, clocks in MHz; None = not reported."""

    index: int
    uuid: str
    name: str
    min_w: float
    max_w: float
    default_w: float
    limit_w: float  # the current (requested) limit: what restore puts back
    enforced_w: float | None
    clock_min_mhz: int | None = None
    clock_max_mhz: int | None = None
    # The SM clocks NVML lists as supported (nvmlDeviceGetSupportedGraphicsClocks), ascending: what a lock snaps to.
    clock_supported_mhz: tuple[int, ...] | None = None


_TOKEN = {
    "power": re.compile(r"^\+?(\d+(?:\.\d*)?|\.\d+)\s*(w|%)?$", re.IGNORECASE),
    "clock": re.compile(r"^\+?(\d+(?:\.\d*)?|\.\d+)\s*(mhz|%)?$", re.IGNORECASE),
}
_NEGATIVE = re.compile(r"^-\s*(\d+(?:\.\d*)?|\.\d+)\s*(w|mhz|%)?$", re.IGNORECASE)


def _split(spec: str | Iterable) -> list[str]:
    if isinstance(spec, str):
        items = spec.split(",")
        if all(not s.strip() for s in items):
            return []
        return [s.strip() for s in items]
    return [str(s).strip() for s in spec]


def _fmt(x: float) -> str:
    return f"{x:g}"


def common_power_range(devices: Sequence[DeviceRange]) -> tuple[float, float]:
    """The limits every GPU accepts: all GPUs of a set take the same level."""
    return max(d.min_w for d in devices), min(d.max_w for d in devices)


def describe_power_range(devices: Sequence[DeviceRange]) -> str:
    lo, hi = common_power_range(devices)
    per_gpu = ", ".join(
        f"GPU {d.index} ({d.name}): {_fmt(d.min_w)}-{_fmt(d.max_w)} W, default {_fmt(d.default_w)} W" for d in devices
    )
    if lo > hi:
        return f"These GPUs share no power limit: {per_gpu}."
    head = f"Allowed: {_fmt(lo)}-{_fmt(hi)} W" + (" (common to all GPUs)" if len(devices) > 1 else "")
    return f"{head}; {per_gpu}. Give watts (220 or 220W) or a percentage of the default limit (60%)."


def one_kind_at_a_time(devices: Sequence[DeviceRange]) -> str:
    """The way on for a set of GPUs of different models ("" for one model): one level means other watts,
    or none at all, on each (a 180 W level on an L4 of 40-72 W), so each kind is swept on its own."""
    kinds: dict[str, list[str]] = {}
    for d in devices:
        kinds.setdefault(d.name, []).append(str(d.index))
    if len(kinds) < 2:
        return ""
    return " Sweep one kind of GPU at a time: " + " or ".join(f"--gpus {','.join(i)} ({n})" for n, i in kinds.items()) + "."


def parse_power_levels(spec: str | Iterable, devices: Sequence[DeviceRange]) -> list[float]:
    """'180,220W,60%' → [180.0, 220.0, 180.0]-style watts, validated against every GPU in `devices`.

    Percentages are of the default limit, rounded to whole watts. Raises LevelError listing every
    problem (empty, non-number, negative, duplicate, out of range) with the allowed range and default.
    """
    if not devices:
        raise LevelError(["no GPU selected"], "Select at least one GPU.")
    allowed = describe_power_range(devices) + one_kind_at_a_time(devices)
    lo, hi = common_power_range(devices)
    if lo > hi:
        raise LevelError(["no single power limit fits every selected GPU"], allowed)
    defaults = {d.default_w for d in devices}
    return _parse(spec, "power", "W", lo, hi, allowed, percent_base=(defaults.pop() if len(defaults) == 1 else None),
                  percent_of="the default limit", as_int=False, min_gap=MIN_POWER_LEVEL_GAP_W)


def describe_clock_range(devices: Sequence[DeviceRange]) -> str:
    per_gpu = ", ".join(f"GPU {d.index} ({d.name}): {d.clock_min_mhz}-{d.clock_max_mhz} MHz" for d in devices)
    lo, hi = common_clock_range(devices)
    head = f"Allowed SM clocks: {lo}-{hi} MHz" if lo is not None and lo <= hi else "No common SM clock range"
    return f"{head}; {per_gpu}. Give MHz (1500 or 1500MHz) or a percentage of the maximum SM clock (80%)."


def common_clock_range(devices: Sequence[DeviceRange]) -> tuple[int | None, int | None]:
    if not devices or any(d.clock_min_mhz is None or d.clock_max_mhz is None for d in devices):
        return None, None
    return max(d.clock_min_mhz for d in devices), min(d.clock_max_mhz for d in devices)


def supported_clock_mhz(level_mhz: float, supported: Sequence[int]) -> int:
    """The supported SM clock a lock at `level_mhz` runs at: the highest supported clock at or below it (a lock is a
    ceiling the card does not run above; the simulator's driver does the same), the lowest where none is."""
    below = [c for c in supported if c <= level_mhz]
    return max(below) if below else min(supported)


def _same_clock(devices: Sequence[DeviceRange]):
    """Whether two clock levels land on one supported clock on some selected GPU: None, or why they are one setting."""
    def same(a: float, b: float) -> str | None:
        hits = []
        for d in devices:
            if not d.clock_supported_mhz:
                continue
            ca, cb = supported_clock_mhz(a, d.clock_supported_mhz), supported_clock_mhz(b, d.clock_supported_mhz)
            if ca == cb:
                up = [c for c in d.clock_supported_mhz if c > ca]
                near = f"{ca} and {min(up)} MHz" if up else f"{ca} MHz (its highest)"
                hits.append(f"{ca} MHz on GPU {d.index} ({d.name}, supported clocks there: {near})")
        if not hits:
            return None
        return (f"both run at {'; '.join(hits)}: the driver locks the SM clock to a supported clock, the highest at or "
                "below the level, so the two levels are one setting and the sweep would file it twice; give levels "
                "that land on different supported clocks")
    return same


def parse_clock_levels(spec: str | Iterable, devices: Sequence[DeviceRange]) -> list[int]:
    """'1500,1200MHz,80%' → SM clocks in MHz within every GPU's supported range (percent of the max clock). Two levels
    that a GPU's driver would lock to the same supported clock (1500 and 1505 MHz with 15 MHz steps) are refused."""
    if not devices:
        raise LevelError(["no GPU selected"], "Select at least one GPU.")
    lo, hi = common_clock_range(devices)
    allowed = describe_clock_range(devices) + one_kind_at_a_time(devices)
    if lo is None:
        missing = [str(d.index) for d in devices if d.clock_min_mhz is None or d.clock_max_mhz is None]
        raise LevelError([f"GPU {', '.join(missing)} does not report its supported SM clocks"],
                         "Clock levels cannot be validated on this GPU, so powerprof will not lock its clocks.")
    if lo > hi:
        raise LevelError(["no single SM clock fits every selected GPU"], allowed)
    maxes = {d.clock_max_mhz for d in devices}
    return _parse(spec, "clock", "MHz", lo, hi, allowed, percent_base=(maxes.pop() if len(maxes) == 1 else None),
                  percent_of="the maximum SM clock", as_int=True, same_setting=_same_clock(devices))


def _parse(spec, kind, unit, lo, hi, allowed, percent_base, percent_of, as_int, min_gap=0.0, same_setting=None):
    """Levels as numbers; a value NVML would take as the same (whole mW, whole MHz) is a duplicate, and one `min_gap`
    or less from an earlier level, or that `same_setting(earlier, value)` says is one setting with it (a reason), is
    refused as no different from it."""
    items = _split(spec)
    if not items:
        raise LevelError([f"no {kind} levels given"], allowed)
    # rule -> (what breaks it, as said of one level; of several; the levels that do): `--limits` of 1 W steps past the
    # card's range said one long sentence per level, 29 KB of it.
    broken: dict[str, tuple[list[str], str, list[str]]] = {}

    def refuse(rule: str, one: str, several: str = "", subject: str = "") -> None:
        broken.setdefault(rule, ([], several, []))
        broken[rule][0].append(one)
        broken[rule][2].append(subject)

    seen: dict[float, str] = {}
    out: list = []
    example = "220 or 220W" if kind == "power" else "1500 or 1500MHz"
    for n, item in enumerate(items):
        if not item:
            refuse("empty", f"empty item in the {kind} level list")
            continue
        m = _TOKEN[kind].match(item)
        if not m:
            if _NEGATIVE.match(item):
                refuse("negative", f"'{item}' is negative", "are negative", f"'{item}'")
            else:
                what = f"a number of {unit} (like {example}) or a percentage of {percent_of} (like 60%)"
                refuse("nan", f"'{item}' is not {what}", f"are not {what}", f"'{item}'")
            continue
        number, suffix = float(m.group(1)), (m.group(2) or "").lower()
        if suffix == "%":
            if percent_base is None:
                refuse("percent", f"'{item}': the selected GPUs differ in {percent_of}, so give {unit} instead of a percentage",
                       f"are percentages, but the selected GPUs differ in {percent_of}, so give {unit} instead", f"'{item}'")
                continue
            value = float(round(percent_base * number / 100.0))
        else:
            value = float(round(number)) if as_int else round(number, 3)
        if not lo <= value <= hi:
            shown = item if suffix != "%" else f"{item} = {_fmt(value)} {unit}"
            refuse("range", f"'{shown}' is outside the allowed range {_fmt(lo)}-{_fmt(hi)} {unit}",
                   f"are outside the allowed range {_fmt(lo)}-{_fmt(hi)} {unit}", f"'{shown}'")
            continue
        if value in seen:
            refuse("duplicate", f"'{item}' ({_fmt(value)} {unit}) duplicates '{seen[value]}'", "duplicate an earlier level",
                   f"'{item}' (as '{seen[value]}')")
            continue
        # At the gap too: a reading off by exactly it is not a move (limit_moved flags more than the tolerance).
        near = next((v for v in seen if abs(v - value) <= min_gap), None) if min_gap > 0 else None
        if near is not None:
            why = (f"a limit is set and read back to +-{_fmt(min_gap)} {unit}, so no reading tells the two apart "
                   f"and the figures cannot resolve the step; give levels more than {_fmt(min_gap)} {unit} apart")
            refuse("gap", f"'{item}' ({_fmt(value)} {unit}) is {_fmt(min_gap)} {unit} or less from '{seen[near]}': {why}",
                   f"are each {_fmt(min_gap)} {unit} or less from an earlier level: {why}", f"'{item}' (from '{seen[near]}')")
            continue
        clash = next(((v, why) for v in seen if (why := same_setting(v, value))), None) if same_setting else None
        if clash is not None:
            v, why = clash
            # Each clash says its own clocks: no rule shared in words.
            refuse(f"clash{n}", f"'{item}' ({_fmt(value)} {unit}) and '{seen[v]}' ({_fmt(v)} {unit}) {why}")
            continue
        seen[value] = item
        out.append(int(value) if as_int else value)
    if broken:
        problems = []
        for ones, several, subjects in broken.values():
            if len(ones) <= 2 or not several:
                problems += ones
            else:
                problems.append(f"{len(ones)} levels {several}: {_compact(subjects)}")
        echoed = (repr(",".join(items)) if len(items) <= 12
                  else f"{','.join(items[:3]) + ',…,' + items[-1]!r} ({len(items)} levels)")
        raise LevelError([f"invalid {kind} levels {echoed}: " + problems[0], *problems[1:]], allowed)
    return out


def _compact(subjects: list[str], head: int = 4) -> str:
    """Many levels in a line: the first few, how many more, and the last."""
    if len(subjects) <= head + 2:
        return ", ".join(subjects)
    return f"{', '.join(subjects[:head])}, … ({len(subjects) - head - 1} more) …, {subjects[-1]}"


def parse_gpu_indexes(spec: str | Iterable | None, count: int) -> list[int]:
    """'0,1' → [0, 1]; None or 'all' → every GPU. Errors name the GPUs that exist."""
    have = f"this machine has GPU 0-{count - 1}" if count > 1 else ("this machine has GPU 0" if count else "no GPU found")
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "all"):
        if count == 0:
            raise LevelError(["no GPU to control"], have + ".")
        return list(range(count))
    items = _split(spec)
    if not items:
        raise LevelError(["no GPU given"], have + ".")
    problems, out = [], []
    for item in items:
        if not item.isdigit():
            problems.append(f"'{item}' is not a GPU index" if item else "empty item in the GPU list")
        elif int(item) >= count:
            problems.append(f"GPU {item} does not exist")
        elif int(item) in out:
            problems.append(f"GPU {item} is listed twice")
        else:
            out.append(int(item))
    if problems:
        raise LevelError([f"invalid --gpus {','.join(items)!r}: " + problems[0], *problems[1:]], have + ".")
    return out
