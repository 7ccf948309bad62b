"""Reading run directories for analysis: metadata, pooled windows, and what the samples say per level.

Several runs (or repeats) of the same GPU model and server model pool their windows; runs of
different GPUs or models are refused unless forced, because their levels are not comparable.
samples.parquet is streamed in record batches, so ten million rows never sit in memory at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from powerprof.storage.runs import RUN_JSON
from powerprof.storage.schema import LEVELS
from powerprof.sweep import REASON_SW_POWER_CAP, REASON_THERMAL, cap_not_engaged

REASON_HW_SLOWDOWN = 0x8
TIMELINE_BINS = 1500  # points per device in the power/clock plot: enough for a page-wide figure
BATCH_ROWS = 1 << 20


class AnalysisError(ValueError):
    """Bad input to the analysis: the message says what and how to fix it."""


@dataclass(frozen=True)
class RunInfo:
    path: Path
    run_id: str
    gpu_name: str | None
    gpu_uuid: str | None
    model: str | None
    min_limit_w: float | None
    max_limit_w: float | None
    default_limit_w: float | None
    simulated: bool
    meta: dict = field(default_factory=dict, repr=False)


def _get(meta: dict, *paths, default=None):
    """First present value among dotted paths (`gpu.name`, `gpus.0.name`): writers nest differently."""
    for p in paths:
        cur = meta
        for part in p.split("."):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                cur = None
                break
        if cur is not None:
            return cur
    return default


def _float(x) -> float | None:
    try:
        return None if x is None else float(x)
    except (TypeError, ValueError):
        return None


def read_run_info(run_dir) -> RunInfo:
    path = Path(run_dir)
    if not path.is_dir():
        raise AnalysisError(f"{path}: no such run directory")
    meta_path = path / RUN_JSON
    meta: dict = {}
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise AnalysisError(f"{meta_path}: not valid JSON ({e})") from None
    if not (path / "windows.parquet").exists():
        raise AnalysisError(f"{path} is not a powerprof run directory: windows.parquet is missing")
    model = _get(meta, "model", "server.model", "server.model_path", "workload.model")
    if model is None:
        model = _windows_model(path / "windows.parquet")
    return RunInfo(
        path=path,
        run_id=str(_get(meta, "run_id", default=path.name)),
        gpu_name=_get(meta, "gpu_name", "gpu.name", "gpus.0.name"),
        gpu_uuid=_get(meta, "gpu_uuid", "gpu.uuid", "gpus.0.uuid"),
        model=None if model is None else Path(str(model)).name,
        min_limit_w=_float(_get(meta, "min_limit_w", "limits.min_w", "gpu.min_limit_w", "gpus.0.min_limit_w")),
        max_limit_w=_float(_get(meta, "max_limit_w", "limits.max_w", "gpu.max_limit_w", "gpus.0.max_limit_w")),
        default_limit_w=_float(
            _get(meta, "default_limit_w", "limits.default_w", "gpu.default_limit_w", "gpus.0.default_limit_w")
        ),
        simulated=bool(_get(meta, "simulated", default=False)),
        meta=meta,
    )


def _windows_model(path: Path) -> str | None:
    try:
        t = pq.read_table(path, columns=["model"])
    except (pa.ArrowInvalid, KeyError, OSError):
        return None
    vals = [v for v in pc.unique(t.column("model")).to_pylist() if v]
    return vals[0] if len(vals) == 1 else None


def check_compatible(runs: list[RunInfo], force: bool = False) -> None:
    """Refuse to pool runs of different GPU models or server models (unless forced)."""
    if force or len(runs) < 2:
        return
    for what, attr in (("GPU model", "gpu_name"), ("server model", "model")):
        seen = {getattr(r, attr) for r in runs if getattr(r, attr) is not None}
        if len(seen) > 1:
            detail = "; ".join(f"{r.path}: {getattr(r, attr)}" for r in runs)
            raise AnalysisError(
                f"runs differ in {what} ({detail}): their levels are not comparable. "
                "Analyse them separately, or pass --force to pool them anyway."
            )


def read_windows(runs: list[RunInfo]) -> pa.Table:
    """Windows of every run, one table (columns of the WINDOWS schema that each file has)."""
    tables = []
    for r in runs:
        try:
            t = pq.read_table(r.path / "windows.parquet")
        except (pa.ArrowInvalid, OSError) as e:
            raise AnalysisError(f"{r.path / 'windows.parquet'}: cannot be read as Parquet ({e})") from None
        if "run_id" not in t.column_names or t.column("run_id").null_count == t.num_rows:
            t = _set_column(t, "run_id", pa.array([r.run_id] * t.num_rows, pa.string()))
        tables.append(t.replace_schema_metadata(None))
    out = pa.concat_tables(tables, promote_options="permissive")
    missing = {"level_value", "decode_tok_s"} - set(out.column_names)
    if missing:
        raise AnalysisError(f"windows.parquet lacks the columns {sorted(missing)}: not a powerprof sweep run")
    return out


def _set_column(t: pa.Table, name: str, arr: pa.Array) -> pa.Table:
    if name in t.column_names:
        return t.set_column(t.column_names.index(name), name, arr)
    return t.append_column(name, arr)


# --- what the samples say ---------------------------------------------------------------------

SAMPLE_LEVEL_COLUMNS = ("enforced_limit_w", "avg_cpu_power_w", "sm_clock_mhz", "mem_clock_mhz", "cap_not_engaged",
                        "thermal_throttle")
# What only the sweep knows about a level, carried from levels.parquet into the analysis.
SWEEP_LEVEL_COLUMNS = SAMPLE_LEVEL_COLUMNS + ("stop_rule",)


@dataclass
class Timeline:
    """Power and SM clock binned over a run's time, per GPU device, for the plot."""

    run_id: str
    t_s: np.ndarray  # (bins,) bin centres, seconds since the first sample
    devices: tuple[str, ...]
    power_w: np.ndarray  # (devices, bins), NaN where a bin has no sample
    sm_clock_mhz: np.ndarray
    level_value: np.ndarray  # (bins,) the level the bin belongs to (last seen), NaN outside levels


@dataclass
class _LevelAcc:
    n: int = 0
    power_sum: float = 0.0
    power_n: int = 0
    clock_sum: float = 0.0
    clock_n: int = 0
    mem_sum: float = 0.0
    mem_n: int = 0
    reasons: int = 0
    reasons_seen: bool = False  # False: the GPU never reported clock-event reasons (rule on power alone)
    thermal: bool = False
    enforced: float | None = None


def scan_samples(run: RunInfo, windows: pa.Table | None = None, bins: int = TIMELINE_BINS,
                 batch_rows: int = BATCH_ROWS) -> tuple[dict, Timeline | None]:
    """Per-level sensor figures inside the run's measured decode windows, and a binned timeline.

    Returns ({(level_kind, level_value): {column: value}}, Timeline or None without samples).
    Two streaming passes over samples.parquet: the time range, then the sums; memory stays flat.
    """
    path = run.path / "samples.parquet"
    if not path.exists():
        return {}, None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise AnalysisError(f"{path}: cannot be read as Parquet ({e})") from None
    names = set(pf.schema_arrow.names)
    want = [c for c in ("time_utc", "t_mono_s", "source", "device", "power_w", "power_avg_w", "sm_clock_mhz",
                        "mem_clock_mhz", "clock_event_reasons", "level_kind", "level_value", "enforced_limit_w",
                        "power_limit_w") if c in names]
    if "t_mono_s" not in names:
        return {}, None
    t_min, t_max = np.inf, -np.inf
    for b in pf.iter_batches(batch_size=batch_rows, columns=["t_mono_s"]):
        t = b.column(0).to_numpy(zero_copy_only=False)
        if t.size:
            t_min, t_max = min(t_min, np.nanmin(t)), max(t_max, np.nanmax(t))
    if not np.isfinite(t_min):
        return {}, None
    # No more bins than about one sample each (per device and source), so bins are rarely empty.
    bins = int(np.clip(pf.metadata.num_rows // 4, 1, bins))
    starts, ends = _measured_intervals_us(windows, run.run_id)
    width = max((t_max - t_min) / bins, 1e-9)
    dev_index: dict[str, int] = {}
    sums = {k: np.zeros((0, bins)) for k in ("p", "pn", "f", "fn")}
    bin_level = np.full(bins, np.nan)
    acc: dict[tuple, _LevelAcc] = {}
    for b in pf.iter_batches(batch_size=batch_rows, columns=want):
        tb = pa.Table.from_batches([b])
        src = tb.column("source") if "source" in tb.column_names else None
        if src is not None:
            tb = tb.filter(pc.equal(src, "nvml"))
        if tb.num_rows == 0:
            continue
        t = _np(tb, "t_mono_s")
        power = _np(tb, "power_w")
        if "power_avg_w" in tb.column_names:
            power = np.where(np.isfinite(power), power, _np(tb, "power_avg_w"))
        clock = _np(tb, "sm_clock_mhz")
        dev_codes, dev_names = _codes(tb, "device", "gpu")
        for d in dev_names:
            if d not in dev_index:
                dev_index[d] = len(dev_index)
                for k in sums:
                    sums[k] = np.vstack([sums[k], np.zeros(bins)])
        di = np.array([dev_index[d] for d in dev_names], dtype=np.int64)[dev_codes]
        bi = np.clip(((t - t_min) / width).astype(np.int64), 0, bins - 1)
        flat = di * bins + bi
        size = len(dev_index) * bins
        okp, okf = np.isfinite(power), np.isfinite(clock)
        sums["p"] += np.bincount(flat[okp], power[okp], size).reshape(-1, bins)
        sums["pn"] += np.bincount(flat[okp], minlength=size).reshape(-1, bins)
        sums["f"] += np.bincount(flat[okf], clock[okf], size).reshape(-1, bins)
        sums["fn"] += np.bincount(flat[okf], minlength=size).reshape(-1, bins)
        lvl = _np(tb, "level_value")
        has = np.isfinite(lvl)
        bin_level[bi[has]] = lvl[has]  # later samples overwrite: the level a bin ends in
        _accumulate_levels(acc, tb, power, clock, starts, ends)
    # A bin without samples continues the level before it; bins whose samples had no level stay NaN.
    empty = sums["pn"].sum(axis=0) + sums["fn"].sum(axis=0) == 0 if dev_index else np.ones(bins, bool)
    for i in np.flatnonzero(empty):
        if i > 0:
            bin_level[i] = bin_level[i - 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        tl = Timeline(
            run_id=run.run_id,
            t_s=(np.arange(bins) + 0.5) * width,
            devices=tuple(dev_index),
            power_w=sums["p"] / sums["pn"],
            sm_clock_mhz=sums["f"] / sums["fn"],
            level_value=bin_level,
        )
    return _level_figures(acc), tl


def _np(t: pa.Table, name: str) -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, np.nan)
    return np.asarray(pc.cast(t.column(name), pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False))


def _measured_intervals_us(windows: pa.Table | None, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Merged [t_first, t_last] spans of the run's measured windows, in µs since the epoch, sorted."""
    from .stats import window_masks  # noqa: PLC0415  (stats imports nothing from here; keep the graph one-way)

    if windows is None or "t_first_utc" not in windows.column_names:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    measured = window_masks(windows)[0]
    if "run_id" in windows.column_names:
        measured &= np.asarray([r == run_id for r in windows.column("run_id").to_pylist()], dtype=bool)
    sub = windows.filter(pa.array(measured))
    s = pc.cast(sub.column("t_first_utc"), pa.int64()).to_numpy(zero_copy_only=False)
    e = pc.cast(sub.column("t_last_utc"), pa.int64()).to_numpy(zero_copy_only=False)
    ok = (s > 0) & (e >= s) if s.size else np.zeros(0, bool)
    s, e = s[ok], e[ok]
    if s.size == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    # Merge overlaps (concurrent requests): a span starts where its start exceeds every end so far.
    new = np.concatenate([[True], s[1:] > np.maximum.accumulate(e)[:-1]])
    first = np.flatnonzero(new)
    return s[first], np.maximum.reduceat(e, first)


def _codes(t: pa.Table, name: str, fill: str) -> tuple[np.ndarray, list]:
    """Integer codes and their labels for a string column (dictionary encoding, no Python per row)."""
    if name not in t.column_names:
        return np.zeros(t.num_rows, np.int64), [fill]
    enc = pc.dictionary_encode(t.column(name).fill_null(fill)).combine_chunks()
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary.to_pylist()


def _accumulate_levels(acc, tb, power, clock, starts, ends) -> None:
    kind_codes, kind_names = _codes(tb, "level_kind", "none")
    lvl = _np(tb, "level_value")
    inside = np.isfinite(lvl)
    if starts.size and "time_utc" in tb.column_names:
        tu = pc.cast(tb.column("time_utc"), pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
        k = np.searchsorted(starts, tu, side="right") - 1
        inside &= (k >= 0) & (tu <= ends[np.maximum(k, 0)])
    if not inside.any():
        return
    mem = _np(tb, "mem_clock_mhz")
    has_reasons = (tb.column("clock_event_reasons").is_valid().to_numpy(zero_copy_only=False)
                   if "clock_event_reasons" in tb.column_names else np.zeros(tb.num_rows, bool))
    reasons = (pc.cast(tb.column("clock_event_reasons"), pa.int64()).fill_null(0).to_numpy(zero_copy_only=False)
               if "clock_event_reasons" in tb.column_names else np.zeros(tb.num_rows, np.int64))
    enforced = _np(tb, "enforced_limit_w")
    idx = np.flatnonzero(inside)
    groups = []
    for code in np.unique(kind_codes[idx]):
        of_kind = idx[kind_codes[idx] == code]
        values, inverse = np.unique(lvl[of_kind], return_inverse=True)
        groups += [(kind_names[int(code)], float(v), of_kind[np.ravel(inverse) == j]) for j, v in enumerate(values)]
    for kind, value, sel in groups:
        a = acc.setdefault((kind, value), _LevelAcc())
        a.n += sel.size
        p, f, m = power[sel], clock[sel], mem[sel]
        a.power_sum += float(np.nansum(p))
        a.power_n += int(np.isfinite(p).sum())
        a.clock_sum += float(np.nansum(f))
        a.clock_n += int(np.isfinite(f).sum())
        a.mem_sum += float(np.nansum(m))
        a.mem_n += int(np.isfinite(m).sum())
        a.reasons |= int(np.bitwise_or.reduce(reasons[sel]))
        a.reasons_seen |= bool(has_reasons[sel].any())
        a.thermal |= bool(np.any(reasons[sel] & (REASON_THERMAL | REASON_HW_SLOWDOWN)))
        e = enforced[sel]
        if np.isfinite(e).any():
            a.enforced = float(np.nanmedian(e))


def _level_figures(acc: dict) -> dict:
    out = {}
    for (kind, val), a in acc.items():
        per_gpu_power = a.power_sum / a.power_n if a.power_n else None
        limit = a.enforced if a.enforced is not None else (val if kind == "power_limit" else None)
        out[(kind, val)] = {
            "sample_power_w": per_gpu_power,
            "enforced_limit_w": a.enforced,
            "sm_clock_mhz": a.clock_sum / a.clock_n if a.clock_n else None,
            "mem_clock_mhz": a.mem_sum / a.mem_n if a.mem_n else None,
            # Per GPU power against the per GPU limit (the powers are averaged over devices already).
            "cap_not_engaged": (cap_not_engaged(per_gpu_power, limit, a.reasons if a.reasons_seen else None)
                                if kind == "power_limit" else None),
            "thermal_throttle": a.thermal,
            "power_cap_seen": bool(a.reasons & REASON_SW_POWER_CAP),
        }
    return out


def _pool(v: list):
    if isinstance(v[0], bool):
        return any(v)
    if isinstance(v[0], str):
        return ",".join(dict.fromkeys(x for s in v for x in s.split(",") if x))
    return float(np.mean(v))


def sweep_level_figures(runs: list[RunInfo], where: dict | None = None) -> dict:
    """The sensor columns the sweep already wrote to levels.parquet, pooled over runs:
    numbers averaged, flags OR-ed, strings (stop_rule) joined once each.
    {(level_kind, level_value): {column: value}}. where: only rows with these values (one
    configuration of a configuration sweep: {"config_id": ..., "context_tokens": ...})."""
    pooled: dict[tuple, dict[str, list]] = {}
    for r in runs:
        p = r.path / "levels.parquet"
        if not p.exists():
            continue
        try:
            t = pq.read_table(p)
        except (pa.ArrowInvalid, OSError) as e:
            raise AnalysisError(f"{p}: cannot be read as Parquet ({e})") from None
        cols = [c for c in SWEEP_LEVEL_COLUMNS if c in t.column_names and c in LEVELS.names]
        keys = tuple(where or ())
        for row in t.select([c for c in ("level_kind", "level_value", *keys, *cols) if c in t.column_names]).to_pylist():
            if any(row.get(k) != v for k, v in (where or {}).items()):
                continue
            d = pooled.setdefault((row.get("level_kind"), row.get("level_value")), {})
            for c in cols:
                if row.get(c) is not None:
                    d.setdefault(c, []).append(row[c])
    out = {}
    for key, d in pooled.items():
        out[key] = {c: _pool(v) for c, v in d.items()}
    return out
