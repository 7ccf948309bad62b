"""The sample engine: per-level sensor figures and the binned power/clock timeline as DuckDB queries.

One implementation for the sweep (an in-memory Arrow table, rewritten per level) and the analysis
(samples.parquet files, globs or object-store URIs). DuckDB scans the columns it needs in parallel
and out of core: a memory limit and a spill folder keep 100 M rows within a fixed budget.

Per-level figures are means over the nvml samples inside the measured decode spans, grouped by
the (level_kind, level_value) tags the sweep put on each sample. Means rather than medians: sums
and counts merge across files, runs and spill partitions, so memory stays flat whatever the size.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from powerprof.collectors.clock_reasons import REASON_SW_POWER_CAP, cap_not_engaged, thermal

MEMORY_LIMIT = "256MB"  # DuckDB's own buffers; beyond this it spills to the temp folder
THREADS = min(4, os.cpu_count() or 1)  # more threads each hold buffers: 4 keeps 256 MB enough

# Columns the queries read; a file that lacks one (older writers) reads it as NULL.
_SAMPLE_COLUMNS = {
    "time_utc": "TIMESTAMPTZ", "t_mono_s": "DOUBLE", "source": "VARCHAR", "device": "VARCHAR",
    "power_w": "DOUBLE", "power_avg_w": "DOUBLE", "sm_clock_mhz": "DOUBLE", "mem_clock_mhz": "DOUBLE",
    "clock_event_reasons": "BIGINT", "power_limit_w": "DOUBLE", "enforced_limit_w": "DOUBLE", "level_kind": "VARCHAR",
    "level_value": "DOUBLE", "gpu_util_pct": "DOUBLE",
}

# A GPU's board power is held to its enforced limit by its firmware, and no limit exceeds the card's highest; the
# transients above it last milliseconds and NVML's readings average them. A reading over twice the highest limit
# (the run's max_limit_w, else the sample's own limit columns) is no draw a board sustains but a glitch or an edited
# file, as is a power that is zero (a powered GPU draws its idle watts), negative or not a number. An SM or memory
# clock that is negative or not a number likewise. Such a reading is left out of every sensor figure and counted.
PLAUSIBLE_POWER_FACTOR = 2.0


def plausible_power_sql(power: str, max_power_w: float | None) -> str:
    """SQL: `power` where it is plausible (PLAUSIBLE_POWER_FACTOR), else NULL."""
    limit = (f"{float(max_power_w)!r}" if max_power_w is not None and np.isfinite(max_power_w) and max_power_w > 0
             else "greatest(power_limit_w, enforced_limit_w)")
    return (f"CASE WHEN isfinite({power}) AND {power} > 0 AND ({limit} IS NULL OR NOT isfinite({limit}) OR {limit} <= 0 "
            f"OR {power} <= {PLAUSIBLE_POWER_FACTOR!r} * {limit}) THEN {power} END")


def plausible_clock_sql(clock: str) -> str:
    """SQL: `clock` where it is a clock (finite, not negative), else NULL."""
    return f"CASE WHEN isfinite({clock}) AND {clock} >= 0 THEN {clock} END"


# An idle reading (GpuIdle, 0x1, or 0% utilisation) shows the clock's idle floor whatever the level set: one that falls
# inside a measured window (a server stalled, a client starved of CPU reading its last token late) read 345 MHz inside
# a 1400 MHz lock's window and pulled the level's mean SM clock to 1220 MHz. The level's clock figures are the busy
# readings'; a GPU that reports neither counts as busy.
BUSY_SQL = "NOT (coalesce(clock_event_reasons, 0) & 1 <> 0 OR coalesce(gpu_util_pct, 1) = 0)"


@contextmanager
def connect(memory_limit: str = MEMORY_LIMIT, threads: int = THREADS):
    """A DuckDB connection with a memory limit and its own spill folder (removed afterwards)."""
    import duckdb  # noqa: PLC0415  (only analysis and the sweep's flush need it; keeps the daemon small)

    spill = tempfile.mkdtemp(prefix="powerprof-duckdb-")
    con = duckdb.connect(config={"memory_limit": memory_limit, "threads": threads, "temp_directory": spill,
                                 "preserve_insertion_order": False})
    con.execute("SET enable_progress_bar = false")  # past 2 s DuckDB draws one on stdout, among `export`'s file names
    try:
        yield con
    finally:
        con.close()
        shutil.rmtree(spill, ignore_errors=True)


# Seconds a download of DuckDB's httpfs extension may take. DuckDB's own download, which no interrupt stops, waited 2 min
# on a network that takes connections and never answers (a proxy, a firewall dropping them), saying nothing; the
# extension is a few MB, well within this on any network that works.
HTTPFS_INSTALL_LIMIT_S = 25

# Run in a child process, which can be killed at the limit; the parent's connection settings say where to install from
# and to (argv: the folder this process imported duckdb from, extension folder, repository, each '' for DuckDB's
# default). The child is isolated (`-I`, cwd "/"): `python -c` puts the working directory first on sys.path, and a
# duckdb.py another user planted in the folder root ran `analyze https://…` from ran as root.
_INSTALL_HTTPFS = ("import sys\n"
                   "sys.argv[1] in sys.path or sys.path.append(sys.argv[1]); del sys.argv[1]\n"
                   "import duckdb\n"
                   "con = duckdb.connect(config={'extension_directory': sys.argv[1]} if sys.argv[1] else {})\n"
                   "con.execute(\"INSTALL httpfs\" + (\" FROM '\" + sys.argv[2].replace(\"'\", \"''\") + \"'\" "
                   "if sys.argv[2] else ''))\n")


# Seconds a remote may send nothing (connect, each read) before DuckDB's httpfs gives up on a request, and the times it
# asks again after that: a remote that takes the connection and stops sending ends `analyze` in at most about
# (1 + HTTP_RETRIES) x HTTP_TIMEOUT_S with http_stall_refusal's error. Left to DuckDB's own (30 s, 3 retries, backoff),
# it waited over 2 min, then said "Failed to read connection": neither what timed out nor what to do.
HTTP_TIMEOUT_S = 30
HTTP_RETRIES = 2


def _bound_http(con) -> None:
    """httpfs's timeout and retries as HTTP_TIMEOUT_S and HTTP_RETRIES say (they exist once httpfs is loaded)."""
    import duckdb  # noqa: PLC0415

    try:
        con.execute(f"SET http_timeout = {int(HTTP_TIMEOUT_S)}")
        con.execute(f"SET http_retries = {int(HTTP_RETRIES)}")
    except duckdb.Error:
        pass  # a DuckDB that renamed them: its own bound (30 s, 3 retries in 1.x) still ends a stall, later


# A quote never closed runs to the line's end: DuckDB cuts a long quoted path short ("…/gpu-timeouts/requests/*...").
_QUOTED_OR_URI = re.compile(r"'[^'\n]*(?:'|$)|\"[^\"\n]*(?:\"|$)|\b[a-z][a-z0-9+.-]*://\S*", re.IGNORECASE | re.MULTILINE)


def http_stall_refusal(why: str) -> str | None:
    """DuckDB's error `why` when a remote stopped sending (httpfs's read timed out, or the connection broke) said as
    powerprof says it (what timed out, the bound, the fix; `why` kept at the end); None for any other error."""
    # DuckDB quotes the URI in its errors (and a glob's pattern bare): a bucket or folder named "timeouts" is no stall.
    # Its "LINE 1:" context is the query's SQL, not what went wrong: left out.
    low = _QUOTED_OR_URI.sub(" ", why.split("\nLINE ", 1)[0]).lower()
    if "failed to read connection" not in low and "timed out" not in low and "timeout" not in low:
        return None
    return (f"the remote stopped sending (nothing for {HTTP_TIMEOUT_S:g} s, asked {1 + HTTP_RETRIES} times; or it broke "
            "the connection): check that the endpoint answers from here (a proxy or firewall that holds connections, "
            f"a dead peer behind a load balancer), or copy the dataset to a local folder and analyze that (DuckDB: {why})")


def httpfs_refusal(con) -> str | None:
    """Load the httpfs extension that DuckDB reads object-store URIs through, installing it where it is not, the download
    bounded by HTTPFS_INSTALL_LIMIT_S, and bound its reads (_bound_http): why it cannot be had (one line, with the fix),
    or None once loaded."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    import duckdb  # noqa: PLC0415

    try:
        con.execute("LOAD httpfs")
    except duckdb.Error:
        pass  # not installed: installed below, bounded, where a query's autoload would wait unbounded
    else:
        _bound_http(con)
        return None
    setting = lambda name: con.execute(f"SELECT current_setting('{name}')").fetchone()[0] or ""  # noqa: E731
    repo = setting("autoinstall_extension_repository") or setting("custom_extension_repository")
    fix = ("install it once where the network reaches DuckDB's extension repository (python -c \"import duckdb; "
           "duckdb.connect().install_extension('httpfs')\"), or copy the dataset to a local folder")
    what = "DuckDB reads object-store URIs through its httpfs extension, not installed here, and its download"
    try:
        from pathlib import Path  # noqa: PLC0415
        home = str(Path(duckdb.__file__).resolve().parent.parent)
        done = subprocess.run([sys.executable, "-I", "-c", _INSTALL_HTTPFS, home, setting("extension_directory"), repo],
                              capture_output=True, text=True, timeout=HTTPFS_INSTALL_LIMIT_S, cwd="/")
    except subprocess.TimeoutExpired:
        return (f"{what} did not finish in {HTTPFS_INSTALL_LIMIT_S} s (no network, or a proxy or firewall that does "
                f"not answer): {fix}")
    if done.returncode != 0:
        lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        # DuckDB's last line: "For more info, visit … (ERROR Could not establish connection)": the reason is in ().
        why = why[why.rindex("(ERROR ") + 7:].rstrip(")") if "(ERROR " in why else why
        return f"{what} failed ({why}): {fix}"
    try:
        con.execute("LOAD httpfs")
    except duckdb.Error as e:
        return f"{what} finished, yet it does not load ({str(e).splitlines()[0]}): {fix}"
    _bound_http(con)
    return None


def to_arrow(con, sql: str) -> pa.Table:
    """A query's result as an Arrow table (DuckDB 2 names it to_arrow_table, 1.x arrow)."""
    rel = con.sql(sql)
    fn = getattr(rel, "to_arrow_table", None) or rel.arrow
    return fn()


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def samples_relation(con, source) -> str:
    """Register `source` as the view `samples` with every column the queries use; returns its name.

    source: a pyarrow Table, or one or more Parquet paths, globs or URIs (DuckDB reads s3://,
    gs://, https:// through its httpfs extension)."""
    if isinstance(source, pa.Table):
        con.register("samples_in", source)
        names = set(source.column_names)
        src = "samples_in"
    else:
        paths = [str(source)] if isinstance(source, (str, bytes)) or not hasattr(source, "__iter__") else [
            str(p) for p in source]
        src = f"read_parquet([{', '.join(_quote(p) for p in paths)}], union_by_name = true)"
        names = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {src}").fetchall()}
    cols = ", ".join(c if c in names else f"CAST(NULL AS {t}) AS {c}" for c, t in _SAMPLE_COLUMNS.items())
    con.execute(f"CREATE OR REPLACE TEMP VIEW samples AS SELECT {cols} FROM {src}")
    return "samples"


@dataclass
class LevelSums:
    """Sums and counts of one level's samples: they add across runs, then divide once."""

    n: int = 0
    power_sum: float = 0.0
    power_n: int = 0
    clock_sum: float = 0.0
    clock_n: int = 0
    mem_sum: float = 0.0
    mem_n: int = 0
    reasons: int = 0
    reasons_n: int = 0  # samples that reported reasons; 0: the GPU cannot tell, the rule falls back on power
    enforced_sum: float = 0.0
    enforced_n: int = 0
    power_bad_n: int = 0  # readings left out as implausible (PLAUSIBLE_POWER_FACTOR): power, SM clock
    clock_bad_n: int = 0
    clock_idle_n: int = 0  # SM clock readings left out of the clock figures as idle (BUSY_SQL)
    # The same sums per GPU (the samples' device label: gpu0, gpu1, ...): whether a cap bound is each GPU's own
    # question, which the pooled sums cannot answer (one GPU at its cap and one far under it average to neither).
    devices: dict = field(default_factory=dict)

    def add(self, o: "LevelSums") -> None:
        for f in ("n", "power_sum", "power_n", "clock_sum", "clock_n", "mem_sum", "mem_n", "reasons_n",
                  "enforced_sum", "enforced_n", "power_bad_n", "clock_bad_n", "clock_idle_n"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.reasons |= o.reasons
        for d, s in o.devices.items():
            self.devices.setdefault(d, LevelSums()).add(s)


def merge_intervals(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint [start, end] spans covering the given ones (concurrent requests overlap)."""
    s, e = np.asarray(starts), np.asarray(ends)
    if s.size == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    # A merged span starts where a start exceeds every end so far.
    first = np.flatnonzero(np.concatenate([[True], s[1:] > np.maximum.accumulate(e)[:-1]]))
    return s[first], np.maximum.reduceat(e, first)


def _bucketed(starts, ends) -> tuple[pa.Table, float]:
    """Each disjoint interval once per time bucket it touches: (b, t_start, t_end) rows, and the
    bucket width (the median interval length, so an interval spans about two buckets)."""
    s, e = np.asarray(starts), np.asarray(ends)
    if s.size == 0:
        return pa.table({"b": pa.array([], pa.int64()), "t_start": s, "t_end": e}), 1.0
    width = float(max(np.median(e - s), 1e-9 if s.dtype.kind == "f" else 1))
    b0, b1 = np.floor(s / width).astype(np.int64), np.floor(e / width).astype(np.int64)
    n = b1 - b0 + 1
    idx = np.repeat(np.arange(s.size), n)
    b = b0[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(n) - n, n))
    return pa.table({"b": b, "t_start": s[idx], "t_end": e[idx]}), width


_LEVEL_SUMS = ("count(*)", "sum(p)", "count(p)", "sum(f)", "count(f)", "sum(m)",
               "count(m)", "bit_or(clock_event_reasons)", "count(clock_event_reasons)",
               "sum(enforced_limit_w)", "count(enforced_limit_w)", "count(p_read) - count(p)",
               "count(sm_clock_mhz) - count(f_ok)", "count(f_ok) - count(f)")


def _level_sums_row(r) -> LevelSums:
    return LevelSums(int(r[0]), r[1] or 0.0, int(r[2]), r[3] or 0.0, int(r[4]), r[5] or 0.0, int(r[6]),
                     int(r[7] or 0), int(r[8]), r[9] or 0.0, int(r[10]), int(r[11]), int(r[12]), int(r[13]))


def scan(con, relation: str, intervals: tuple[np.ndarray, np.ndarray] | None = None,
         time_expr: str = "epoch_us(time_utc)", bins: int | None = None,
         max_power_w: float | None = None) -> tuple[dict[tuple, LevelSums], dict | None]:
    """Per-level sums of the nvml samples of `relation` and, when `bins` is given, their binned
    timeline (see timeline_bins). Returns ({(level_kind, level_value): LevelSums}, timeline or None).

    The level sums take the samples tagged with a level whose time (`time_expr`, same unit as
    `intervals`) falls inside one of the sorted, disjoint [start, end] intervals, every tagged
    sample when `intervals` is None. The timeline takes every nvml sample. Two grouped scans: one
    query with both as grouping sets computes every aggregate for both and is slower.
    max_power_w: the card's highest limit (run.json max_limit_w) for the plausibility bound; None: each sample's own
    limit columns. Implausible readings are left out of the figures and counted (power_bad_n, clock_bad_n)."""
    read = "coalesce(power_w, power_avg_w)"
    body = (f"SELECT {time_expr} AS t, *, {read} AS p_read, {plausible_power_sql(read, max_power_w)} AS p, "
            f"{plausible_clock_sql('sm_clock_mhz')} AS f_ok, CASE WHEN {BUSY_SQL} THEN {plausible_clock_sql('sm_clock_mhz')} END AS f, "
            f"CASE WHEN {BUSY_SQL} THEN {plausible_clock_sql('mem_clock_mhz')} END AS m FROM {relation} "
            "WHERE source = 'nvml' AND device IS NOT NULL AND level_value IS NOT NULL AND NOT isnan(level_value)")
    if intervals is not None:
        buckets, width = _bucketed(*intervals)
        # An equi-join on a time bucket, then the exact bounds: a hash join that streams the samples
        # (an ASOF or range join would sort all of them first, several times slower).
        con.register("intervals_in", buckets)
        body = (f"SELECT s.* FROM ({body}) s JOIN intervals_in i ON i.b = CAST(floor(s.t / {width!r}) AS BIGINT) "
                f"AND s.t >= i.t_start AND s.t <= i.t_end")
    rows = con.execute(f"""SELECT coalesce(level_kind, 'none'), level_value, device, {', '.join(_LEVEL_SUMS)}
                           FROM ({body}) GROUP BY 1, 2, 3""").fetchall()
    sums: dict[tuple, LevelSums] = {}
    for r in rows:
        one = _level_sums_row(r[3:])
        level = sums.setdefault((r[0], float(r[1])), LevelSums())
        level.add(dataclasses.replace(one, devices={r[2]: dataclasses.replace(one)}))
    return sums, (None if bins is None else timeline_bins(con, relation, bins, max_power_w))


def level_sums(con, relation: str, intervals: tuple[np.ndarray, np.ndarray] | None = None,
               time_expr: str = "epoch_us(time_utc)") -> dict[tuple, LevelSums]:
    """{(level_kind, level_value): LevelSums}: the level part of `scan` (what the sweep needs)."""
    return scan(con, relation, intervals, time_expr)[0]


def cap_figures(kind: str, value, a: LevelSums) -> tuple[float | None, float | None, int | None]:
    """(mean power W, the limit judged against W, the OR of the reasons or None) of one GPU's or a pool's sums."""
    power = a.power_sum / a.power_n if a.power_n else None
    enforced = a.enforced_sum / a.enforced_n if a.enforced_n else None
    reasons = a.reasons if a.reasons_n else None
    return power, enforced if enforced is not None else (value if kind == "power_limit" else None), reasons


def cap_by_gpu(per_gpu: dict[str, tuple]) -> tuple[bool, str | None]:
    """Whether a cap bound, judged on each GPU ({label: (power W, limit W, reasons)}), for a level's row:
    (True only where it bound on none of them, the GPUs it did not bind on with their power and limit:
    "gpu1 (183 W of 250 W)", None on one GPU or where it bound on all). One GPU at its cap beside one
    far under it is neither "not engaged" (the pooled mean under the limit) nor "engaged" everywhere."""
    judged = {d: cap_not_engaged(p, lim, r) for d, (p, lim, r) in per_gpu.items()}
    if not judged:
        return False, None
    if len(judged) == 1:
        return next(iter(judged.values())), None
    loose = [d for d in sorted(judged, key=_device_order) if judged[d]]
    text = ",".join(f"{d} ({per_gpu[d][0]:.0f} W of {per_gpu[d][1]:.0f} W)" for d in loose) or None
    return len(loose) == len(judged), text


def _device_order(label: str):
    digits = label.lstrip("gpu")
    return (0, int(digits), label) if digits.isdigit() else (1, 0, label)


def level_figures(sums: dict[tuple, LevelSums]) -> dict[tuple, dict]:
    """The per-level figures from pooled sums: means, the OR of the reasons and the two rules
    (collectors/clock_reasons.py), the cap rule judged per GPU (`cap_by_gpu`). Powers are per GPU: every
    sample is one GPU's reading."""
    out = {}
    for key, a in sums.items():  # (kind, value), or (kind, value, concurrency) pooled by the analysis
        kind, value = key[0], key[1]
        power, limit, reasons = cap_figures(kind, value, a)
        enforced = a.enforced_sum / a.enforced_n if a.enforced_n else None
        if kind == "power_limit" and a.devices:
            not_engaged, loose = cap_by_gpu({d: cap_figures(kind, value, s) for d, s in a.devices.items()})
        elif kind == "power_limit":
            not_engaged, loose = cap_not_engaged(power, limit, reasons), None
        else:
            not_engaged, loose = None, None
        out[key] = {
            "sample_power_w": power,
            "enforced_limit_w": enforced,
            "sm_clock_mhz": a.clock_sum / a.clock_n if a.clock_n else None,
            "mem_clock_mhz": a.mem_sum / a.mem_n if a.mem_n else None,
            "clock_event_reasons": reasons,
            "cap_not_engaged": not_engaged,
            "cap_not_engaged_gpus": loose,
            "thermal_throttle": thermal(reasons),
            "power_cap_seen": bool((reasons or 0) & REASON_SW_POWER_CAP),
            "n_samples": a.n,
            # Readings left out of these figures as implausible (PLAUSIBLE_POWER_FACTOR): checks.sample_findings says them.
            "implausible_power_samples": a.power_bad_n,
            "implausible_clock_samples": a.clock_bad_n,
            # Clock readings there, every one idle: the clock figures are empty for that reason (stats.NO_BUSY_FLAG).
            "no_busy_clock": a.clock_n == 0 and a.clock_idle_n > 0,
        }
    return out


def timeline_bins(con, relation: str, bins: int, max_power_w: float | None = None) -> dict | None:
    """Power and SM clock averaged per (device, time bin) over the nvml samples, and the level each
    bin ends in. None without timed samples. Returns {t_min, width, bins, devices, power_w,
    sm_clock_mhz (devices x bins, NaN where empty), level_value (bins,)}."""
    n, t_min, t_max = con.execute(f"SELECT count(*), min(t_mono_s), max(t_mono_s) FROM {relation}").fetchall()[0]
    if t_min is None or not np.isfinite(t_min):
        return None
    # No more bins than about one sample each (per device and source), so bins are rarely empty.
    bins = int(np.clip(n // 4, 1, bins))
    width = max((t_max - t_min) / bins, 1e-9)
    binexpr = f"least(greatest(CAST(floor((t_mono_s - {t_min!r}) / {width!r}) AS BIGINT), 0), {bins - 1})"
    cells = con.execute(f"""
        SELECT coalesce(device, 'gpu') AS d, {binexpr} AS b,
               avg({plausible_power_sql("coalesce(power_w, power_avg_w)", max_power_w)}),
               avg({plausible_clock_sql("sm_clock_mhz")}),
               max(t_mono_s) FILTER (WHERE level_value IS NOT NULL),
               arg_max(level_value, t_mono_s) FILTER (WHERE level_value IS NOT NULL)
        FROM {relation} WHERE source = 'nvml' AND t_mono_s IS NOT NULL
        GROUP BY 1, 2 ORDER BY 1, 2""").fetchall()
    return _timeline(cells, t_min, width, bins)


def _timeline(cells, t_min: float, width: float, bins: int) -> dict:
    """The timeline arrays from (device, bin, power, clock, last tagged time, its level) cells."""
    devices = list(dict.fromkeys(c[0] for c in cells))
    di = {d: i for i, d in enumerate(devices)}
    power = np.full((len(devices), bins), np.nan)
    clock = np.full((len(devices), bins), np.nan)
    filled = np.zeros(bins, bool)
    level = np.full(bins, np.nan)
    level_t = np.full(bins, -np.inf)
    for d, b, p, f, lt, lv in cells:
        power[di[d], b] = np.nan if p is None else p
        clock[di[d], b] = np.nan if f is None else f
        filled[b] |= p is not None or f is not None
        if lt is not None and lt >= level_t[b]:  # the level of the bin's last tagged sample, any device
            level[b], level_t[b] = lv, lt
    # A bin without samples continues the level before it; bins whose samples had no level stay NaN.
    for i in np.flatnonzero(~filled):
        if i > 0:
            level[i] = level[i - 1]
    return {"t_min": t_min, "width": width, "bins": bins, "devices": tuple(devices), "power_w": power,
            "sm_clock_mhz": clock, "level_value": level}
