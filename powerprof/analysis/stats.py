"""Per-level statistics of decode windows: medians, bootstrap CIs, loss and saving vs a reference.

Only measured windows count: never warm-up, never failed; request rows at concurrency 1, batch
rows (wall-clock aggregates over the measured intervals) at concurrency > 1. A level is one
(level_kind, level_value, concurrency); runs and repeats of the same level pool their windows.

Each level's own CI resamples its requests. Comparisons between levels (loss, saving, the
policies' choices) resample by prompt when every level ran the same prompt set: a prompt's
J/token and tok/s differ from another's by far more than the ratio between levels does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from powerprof.collectors.cputime import BUSY_HOST_FLAG, BUSY_HOST_PCT, cpu_shares_pct
from powerprof.energy import median_off_by_rounding, short_counter_window_s, within_prompt_offset
from powerprof.profiler import METHOD_POWER, POWER_EDGE_BIAS_SHARE, POWER_EDGE_BIAS_WINDOW_S
from powerprof.storage.schema import LEVELS
from powerprof.workload.servercount import FOREIGN_FLAG

# Each bootstrap chunk holds at most this many resampled values, so 100k windows stay in tens of MB.
_BOOT_CHUNK_ELEMS = 1 << 22
WIDE_CI_PCT = 5.0  # J/token CI half-width above this share of the median: warn, suggest more requests
# Fewer distinct prompts make a cluster bootstrap degenerate (3 prompts: 10 distinct resamples).
MIN_PAIRED_PROMPTS = 4
PAIRED, INDEPENDENT = "paired-by-prompt", "independent"


def bootstrap_replicates(
    values: np.ndarray, stat: Callable = np.median, n_boot: int = 2000, seed=0, rng: np.random.Generator | None = None
) -> np.ndarray:
    """The statistic of `n_boot` resamples (with replacement) of `values`, shape (n_boot,).

    `stat` must take an `axis` argument (numpy reductions do); resamples are drawn as index
    matrices, in chunks so memory stays bounded however many values there are.
    """
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError("bootstrap needs a non-empty 1-D array of values")
    rng = rng if rng is not None else np.random.default_rng(seed)
    idx = _resample_indices(rng, v.size, n_boot)
    return np.concatenate([stat(v[i], axis=1) for i in idx])


def _resample_indices(rng: np.random.Generator, n: int, n_boot: int):
    chunk = max(1, min(n_boot, _BOOT_CHUNK_ELEMS // max(n, 1)))
    for start in range(0, n_boot, chunk):
        yield rng.integers(0, n, size=(min(chunk, n_boot - start), n))


def percentile_interval(replicates: np.ndarray, ci: float = 0.95) -> tuple[float, float]:
    r = np.asarray(replicates, dtype=float)
    r = r[np.isfinite(r)]
    if r.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(r, [(1 - ci) / 2, 1 - (1 - ci) / 2])
    return float(lo), float(hi)


def small_cluster_factor(n_clusters: int | None, ci: float = 0.95) -> float:
    """How much wider a cluster-bootstrap interval over `n_clusters` prompts must be to hold its level.

    Resampling G clusters underestimates the spread (by (G−1)/G in variance) and treats it as known,
    where a t with G−1 degrees of freedom applies: the paired loss and saving CIs covered 80–90%
    at nominal 95% with 4–6 prompts (bench/analysis_coverage.py). The usual small-sample cluster
    correction, t_{G−1}/z · √(G/(G−1)): 1.87 at 4 prompts, 1.21 at 10, 1.07 at 30, → 1."""
    if n_clusters is None or n_clusters < 2:
        return 1.0
    from scipy.stats import norm, t  # noqa: PLC0415  (scipy is imported by the analysis only)

    q = 1 - (1 - ci) / 2
    return float(t.ppf(q, n_clusters - 1) / norm.ppf(q) * np.sqrt(n_clusters / (n_clusters - 1)))


def widened_interval(replicates: np.ndarray, estimate: float, factor: float, ci: float = 0.95) -> tuple[float, float]:
    """The percentile interval with each side's distance from the estimate multiplied by `factor`."""
    lo, hi = percentile_interval(replicates, ci)
    if factor == 1.0 or not np.isfinite(estimate):
        return lo, hi
    return float(estimate - factor * (estimate - lo)), float(estimate + factor * (hi - estimate))


def bootstrap_ci(values, stat: Callable = np.median, n_boot: int = 2000, ci: float = 0.95, seed=0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of `stat(values)`: (lo, hi). NaNs are dropped;
    a single value gives (v, v); no values gives (nan, nan)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float(v[0])
    return percentile_interval(bootstrap_replicates(v, stat, n_boot, seed), ci)


# --- which windows count -------------------------------------------------------------------


def _col(t: pa.Table, name: str, dtype=float, fill=np.nan) -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, fill, dtype=dtype if dtype is not object else object)
    arr = t.column(name)
    if dtype is object:
        return np.asarray(arr.to_pylist(), dtype=object)
    if dtype is bool:
        return np.asarray(arr.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
    # Unchecked: an integer beyond 2**53 (a damaged file's token count) becomes its nearest float, which the
    # plausibility rules then judge, where the checked cast raised ArrowInvalid out of the analysis.
    return np.asarray(pc.cast(arr, pa.float64(), safe=False).fill_null(fill).to_numpy(zero_copy_only=False), dtype=float)


def window_masks(windows: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(measured, counted_request, failed_request) boolean masks over the rows of a windows table.

    measured: the rows a level's statistics come from (untrusted timing and impossible figures
    excluded): requests at
    concurrency 1, batches above, and in a run that replayed a trace (`sweep --trace`) its
    `trace` rows only (one per level: the whole replay).
    counted_request / failed_request: request rows (not warm-up) that succeeded / failed, for
    n_requests and n_failed."""
    eligible, counted, failed = _masks(windows)
    return eligible & ~impossible_windows(windows), counted, failed


def _masks(windows: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """window_masks before the impossible figures are left out."""
    n = windows.num_rows
    warm = _col(windows, "warmup", bool)
    status = _col(windows, "status", object)
    ok = np.array([s in (None, "ok") for s in status], dtype=bool) if n else np.zeros(0, bool)
    kind = _col(windows, "window_kind", object)
    is_req = np.array([k in (None, "request") for k in kind], dtype=bool) if n else np.zeros(0, bool)
    # Windows the timing rule could not trust (powerprof/arrival.py) count in no figure.
    timing = _col(windows, "timing", object)
    trusted = np.array([t != "untrusted" for t in timing], dtype=bool) if n else np.zeros(0, bool)
    # Windows the sweep saw others' work beside (another client, another process on the GPU) neither.
    trusted &= ~foreign_windows(windows)
    eligible = ~warm & ok & trusted & figure_kind(windows)
    return eligible, ~warm & ok & is_req, ~warm & ~ok & is_req


def figure_kind(windows: pa.Table) -> np.ndarray:
    """Rows of the kind the figures take: requests at concurrency 1, batches above, and in a run that replayed a trace
    (`sweep --trace`) its `trace` rows only (the request rows beside them are parts of a replay, not windows of it)."""
    n = windows.num_rows
    kind = _col(windows, "window_kind", object)
    conc = _concurrency(windows)
    is_req = np.array([k in (None, "request") for k in kind], dtype=bool) if n else np.zeros(0, bool)
    is_batch = np.array([k == "batch" for k in kind], dtype=bool) if n else np.zeros(0, bool)
    is_trace = np.array([k == "trace" for k in kind], dtype=bool) if n else np.zeros(0, bool)
    run = _col(windows, "run_id", object)
    traced = set(run[is_trace])
    in_trace_run = np.array([r in traced for r in run], dtype=bool) if n else np.zeros(0, bool)
    return np.where(in_trace_run, is_trace, np.where(conc > 1, is_batch, is_req))


def eligible_windows(windows: pa.Table) -> np.ndarray:
    """The rows window_masks' `measured` takes if their figures can be (impossible_windows leaves the rest out of
    every figure; checks.impossible_findings counts those among these)."""
    return _masks(windows)[0]


def foreign_windows(windows: pa.Table) -> np.ndarray:
    """Rows the sweep measured beside others' work (foreign_traffic set): flag foreign-traffic, in no figure."""
    if "foreign_traffic" not in windows.column_names:
        return np.zeros(windows.num_rows, bool)
    return np.array([bool(x) for x in windows.column("foreign_traffic").to_pylist()], dtype=bool)


# A figure agrees with its parts within this share (plus half a token: a batch row stores its tokens rounded to a whole
# number while its figures use the fractional count, workload/rows.py). Stored floats agree far closer than this.
CONSISTENT_REL = 0.01


def impossible_reasons(windows: pa.Table) -> dict[str, np.ndarray]:
    """{why: rows} of figures that cannot be, or that contradict the quantities they are made of. No measurement
    writes them (a file edited or damaged does), and each moved a level's figure unsaid:
    - a speed that is not positive or is infinite, a negative or infinite energy, J/token or token count (counted in
      a median, seven negative windows of twelve made a level's J/token negative and "chosen");
    - gpu_j_per_token that is not gpu_energy_j ÷ decode_tokens (0 tokens, 0 J or 1e12 J beside a normal J/token was
      taken at its word);
    - decode_tok_s that is not decode_tokens ÷ decode_s, or is missing where both are stored (a NaN speed dropped the
      window from its level's tok/s alone: 81.1 → 81.6 tok/s at 220 W). A trace row's speed is its median request's,
      not its tokens over the replay: not compared.
    A missing value (null, NaN) is otherwise not impossible: the figures skip it, or compute it from its parts."""
    tok, n, e, j, d = (_col(windows, c) for c in ("decode_tok_s", "decode_tokens", "gpu_energy_j", "gpu_j_per_token",
                                                  "decode_s"))
    trace = np.array([k == "trace" for k in _col(windows, "window_kind", object)], dtype=bool)
    out = {"a speed that is not positive": np.isinf(tok) | (tok <= 0)}
    neg = np.zeros(windows.num_rows, bool)
    for v in (j, e, n):
        neg |= np.isinf(v) | (v < 0)
    out["a negative or infinite energy, J/token or token count"] = neg
    with np.errstate(invalid="ignore", over="ignore"):
        out["gpu_j_per_token that is not gpu_energy_j ÷ decode_tokens"] = (
            np.isfinite(j) & np.isfinite(e) & np.isfinite(n) & ~neg
            & (np.abs(j * n - e) > CONSISTENT_REL * np.abs(e) + 0.5 * np.abs(j)))
        parts = np.isfinite(n) & np.isfinite(d) & ~trace
        out["decode_tok_s that is not decode_tokens ÷ decode_s"] = (
            parts & np.isfinite(tok) & (tok > 0) & ~neg & (np.abs(tok * d - n) > CONSISTENT_REL * np.abs(n) + 0.5))
        out["decode_tok_s missing where decode_tokens and decode_s are stored"] = parts & np.isnan(tok) & (n > 0) & (d > 0)
    return out


def impossible_windows(windows: pa.Table) -> np.ndarray:
    """Rows whose figures cannot be or contradict their parts (impossible_reasons): in no figure."""
    bad = np.zeros(windows.num_rows, bool)
    for rows in impossible_reasons(windows).values():
        bad |= rows
    return bad


def _concurrency(windows: pa.Table) -> np.ndarray:
    c = _col(windows, "concurrency", float, 1.0)
    return np.where(np.isfinite(c) & (c >= 1), c, 1.0).astype(int)


# --- levels --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LevelSeries:
    """All levels of one kind at one concurrency, ascending, with bootstrap replicates.

    The replicate arrays have shape (n_boot, n_levels); row b of tok_s and j_per_token come from
    the same resampled requests, so a policy applied row by row sees consistent data.
    boot_*: the replicates that compare levels (loss, saving, policies). With `bootstrap` ==
    'paired-by-prompt' row b of every level uses the same resampled prompts; 'independent':
    each level's requests are resampled on their own.
    level_boot_*: each level resampled on its own requests, for that level's own CI (the same
    arrays as boot_* when independent; None means boot_*).
    """

    level_kind: str
    concurrency: int
    level_values: np.ndarray  # (L,)
    tok_s: np.ndarray  # (L,) median decode tok/s
    j_per_token: np.ndarray  # (L,) median GPU J/token
    boot_tok_s: np.ndarray  # (B, L)
    boot_j_per_token: np.ndarray  # (B, L)
    power_w: np.ndarray  # (L,) median average GPU power over the decode windows
    total_j_per_token: np.ndarray  # (L,)
    above_idle_j_per_token: np.ndarray  # (L,)
    n_windows: np.ndarray  # (L,) measured windows
    n_requests: np.ndarray  # (L,)
    n_failed: np.ndarray  # (L,)
    energy_methods: tuple[str, ...]
    ref_index: int
    bootstrap: str = INDEPENDENT
    level_boot_tok_s: np.ndarray | None = None  # (B, L)
    level_boot_j_per_token: np.ndarray | None = None  # (B, L)
    n_prompts: np.ndarray | None = None  # (L,) distinct prompt ids among the measured windows
    # (L,) J/token: energy summed ÷ decode tokens summed over the windows the median uses. Not
    # biased by a coarse counter's rounding, which the median of short windows is (energy.py).
    j_per_token_pooled: np.ndarray | None = None
    counter_window_s: np.ndarray | None = None  # (L,) median decode window read on a counter; NaN: none
    # (L,) median decode window integrated from instant power; NaN: none, or too few to move the figure
    power_window_s: np.ndarray | None = None
    counter_prompt_offset: np.ndarray | None = None  # (L,) energy.within_prompt_offset of those windows
    n_clusters: int | None = None  # the prompts a paired bootstrap resamples; None when independent
    # (L,) %: of the host's busy CPU time over the measured windows, other processes' and powerprof's; NaN: unknown
    other_cpu_pct: np.ndarray | None = None
    powerprof_cpu_pct: np.ndarray | None = None
    n_foreign: np.ndarray | None = None  # (L,) windows left out for others' work beside them (flag foreign-traffic)
    # (L,) measured windows with a GPU J/token: fewer than n_windows where some carry no energy figure (energy_method
    # none), and the level's J/token and its CI rest on these alone. None: n_windows (tables built without it).
    n_j_windows: np.ndarray | None = None

    @property
    def comparison_factor(self) -> float:
        """How much the loss and saving intervals are widened (small_cluster_factor; 1 when independent)."""
        return small_cluster_factor(self.n_clusters) if self.bootstrap == PAIRED else 1.0

    @property
    def reference_value(self) -> float:
        return float(self.level_values[self.ref_index])

    def speed_loss(self, tok_s: np.ndarray | None = None) -> np.ndarray:
        """1 − tok/s ÷ reference tok/s (fraction), for the point estimates or replicates given."""
        t = self.tok_s if tok_s is None else tok_s
        return 1.0 - t / t[..., self.ref_index : self.ref_index + 1]

    def energy_saving(self, j: np.ndarray | None = None) -> np.ndarray:
        j = self.j_per_token if j is None else j
        return 1.0 - j / j[..., self.ref_index : self.ref_index + 1]


# Every SM clock reading inside the level's measured windows was idle (engine.BUSY_SQL: GpuIdle or 0% utilisation):
# its clock figures, the busy readings' means, are empty. Before, a "-" with no reason.
NO_BUSY_FLAG = "no-busy-reading"
INSTANT_POWER_FLAG = "instant-power"  # J/token integrated from instant power over windows under POWER_EDGE_BIAS_WINDOW_S
# The level's median counter-read window is under energy.SHORT_COUNTER_WINDOW_S (10 refreshes): a bias all its
# windows share, which no CI and no median-vs-pooled check sees. Left out of every policy as energy-resolution is.
SHORT_WINDOWS_FLAG = "short-windows"
# 2 to MIN_CI_WINDOWS - 1 windows: a percentile bootstrap of a median covers ~50% at 2 windows, 75% at 3, 87.5% at 4
# (1 - 2^(1-n): every resample's median lies between the smallest and the largest window), not the 95% stated.
FEW_WINDOWS_FLAG = "few-windows"
MIN_CI_WINDOWS = 5


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a ÷ b where b is positive, NaN elsewhere (0 tokens or 0 s is no figure, and no RuntimeWarning on stderr)."""
    out = np.full(a.shape, np.nan)
    np.divide(a, b, out=out, where=np.isfinite(b) & (b > 0))
    return out


def _j_per_token(t: pa.Table) -> np.ndarray:
    j = _col(t, "gpu_j_per_token")
    return np.where(np.isfinite(j), j, _ratio(_col(t, "gpu_energy_j"), _col(t, "decode_tokens")))


def _power_w(t: pa.Table) -> np.ndarray:
    p = _col(t, "avg_gpu_power_w")
    return np.where(np.isfinite(p), p, _ratio(_col(t, "gpu_energy_j"), _col(t, "decode_s")))


def _median(v: np.ndarray) -> float:
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else float("nan")


def choose_reference(level_values, reference_value: float | None = None, measured=None) -> int:
    """Index of the reference level: `reference_value` (the default limit) when it was measured,
    else the highest level. measured: which levels have figures (tok/s and J/token); a level
    without them cannot be one (every loss and saving against it would be NaN, and the budget
    policy would then "choose" the lowest level), unless no level has them."""
    vals = np.asarray(level_values, dtype=float)
    ok = np.ones(vals.size, bool) if measured is None else np.asarray(measured, bool)
    if not ok.any():
        ok = np.ones(vals.size, bool)
    if reference_value is not None:
        hit = np.flatnonzero(np.isclose(vals, float(reference_value)) & ok)
        if hit.size:
            return int(hit[0])
    return int(np.flatnonzero(ok)[np.argmax(vals[ok])])


def level_series(
    windows: pa.Table, reference_value: float | None = None, n_boot: int = 2000, seed=0
) -> list[LevelSeries]:
    """Group measured windows into series (level_kind, concurrency) of levels with replicates."""
    measured, counted, failed = window_masks(windows)
    kinds = _col(windows, "level_kind", object)
    kinds = np.array([k if k is not None else "none" for k in kinds], dtype=object)
    values = _col(windows, "level_value")
    conc = _concurrency(windows)
    tok = _col(windows, "decode_tok_s")
    jpt = _j_per_token(windows)
    power = _power_w(windows)
    tot = _col(windows, "total_j_per_token")
    above = _col(windows, "above_idle_gpu_j_per_token")
    methods = _col(windows, "energy_method", object)
    on_counter = np.array(["counter" in str(x or "").split(",") for x in methods], dtype=bool)
    on_power = np.array([METHOD_POWER in str(x or "").split(",") for x in methods], dtype=bool)
    energy = _col(windows, "gpu_energy_j")
    n_tok = _col(windows, "decode_tokens")
    energy = np.where(np.isfinite(energy), energy, jpt * n_tok)
    decode_s = _col(windows, "decode_s")
    prompts = _col(windows, "prompt_id", object)
    host_cpu, other_cpu, own_cpu = (_col(windows, c) for c in ("host_cpu_s", "other_cpu_s", "powerprof_cpu_s"))
    foreign = foreign_windows(windows) & ~_col(windows, "warmup", bool)
    rng = np.random.default_rng(seed)
    out = []
    keys = sorted({(k, int(c)) for k, c, m in zip(kinds, conc, measured | counted | failed) if m}, key=lambda kc: (kc[0], kc[1]))
    for kind, c in keys:
        in_series = (kinds == kind) & (conc == c)
        lv = np.unique(values[in_series & np.isfinite(values)])
        if kind == "none" and lv.size == 0:
            lv = np.array([np.nan])
        cols = {k: [] for k in ("tok", "j", "btok", "bj", "bjl", "p", "tot", "above", "nw", "nj", "nr", "nf", "np", "both", "pool", "cw", "pw", "wp", "ocpu", "pcpu", "nfor")}
        meths: set[str] = set()
        for v in lv:
            at = in_series & (np.isnan(values) if np.isnan(v) else values == v)
            m = at & measured
            both = m & np.isfinite(tok) & np.isfinite(jpt)
            cols["tok"].append(_median(tok[m]))
            cols["j"].append(_median(jpt[m]))
            cols["p"].append(_median(power[m]))
            cols["tot"].append(_median(tot[m]))
            cols["above"].append(_median(above[m]))
            cols["nw"].append(int(m.sum()))
            cols["nj"].append(int((m & np.isfinite(jpt)).sum()))
            cols["nr"].append(int((at & counted).sum()))
            cols["nf"].append(int((at & failed).sum()))
            cols["nfor"].append(int((at & foreign).sum()))
            cols["np"].append(len({p for p in prompts[m] if p is not None}))
            used = m & np.isfinite(jpt) & np.isfinite(energy) & (n_tok > 0)
            cols["pool"].append(energy[used].sum() / n_tok[used].sum() if used.any() else float("nan"))
            cols["cw"].append(_median(decode_s[m & np.isfinite(jpt) & on_counter]))
            # NaN unless power-integrated windows hold a share of the figure that their bias could move
            # (POWER_EDGE_BIAS_SHARE): one window whose counter broke is no instant-power figure.
            share = n_tok[used & on_power].sum() / n_tok[used].sum() if used.any() else 0.0
            cols["pw"].append(_median(decode_s[m & np.isfinite(jpt) & on_power]) if share > POWER_EDGE_BIAS_SHARE
                              else float("nan"))
            cols["wp"].append(within_prompt_offset(jpt[used & on_counter], prompts[used & on_counter]))
            meths.update(x for x in methods[m] if x)
            o, p = cpu_shares_pct(host_cpu[m], other_cpu[m], own_cpu[m])
            cols["ocpu"].append(np.nan if o is None else o)
            cols["pcpu"].append(np.nan if p is None else p)
            bt, bj = _joint_replicates(tok[both], jpt[both], tok[m], n_boot, rng)
            cols["btok"].append(bt)
            cols["bj"].append(bj)
            cols["bjl"].append(level_j_replicates(jpt[m], v, n_boot, seed))
            cols["both"].append((tok[both], jpt[both], prompts[both]))
        if not lv.size:
            continue
        joint_bt, joint_bj = np.column_stack(cols["btok"]), np.column_stack(cols["bj"])
        # Each level's own J/token CI: its own resamples, seeded by the level (the sweep's live CI).
        level_bt, level_bj = joint_bt, np.column_stack(cols["bjl"])
        # A child stream: the independent replicates stay what they were before pairing existed.
        paired = _paired_replicates(cols["both"], n_boot, rng.spawn(1)[0])
        bt, bj = paired if paired is not None else (joint_bt, joint_bj)
        out.append(
            LevelSeries(
                level_kind=str(kind),
                concurrency=c,
                level_values=lv,
                tok_s=np.array(cols["tok"]),
                j_per_token=np.array(cols["j"]),
                boot_tok_s=bt,
                boot_j_per_token=bj,
                power_w=np.array(cols["p"]),
                total_j_per_token=np.array(cols["tot"]),
                above_idle_j_per_token=np.array(cols["above"]),
                n_windows=np.array(cols["nw"]),
                n_requests=np.array(cols["nr"]),
                n_failed=np.array(cols["nf"]),
                energy_methods=tuple(sorted(meths)),
                # The default limit is a power limit: a clock series is referenced to its highest clock.
                ref_index=choose_reference(np.nan_to_num(lv, nan=0.0),
                                           reference_value if kind == "power_limit" else None,
                                           np.isfinite(cols["tok"]) & np.isfinite(cols["j"])),
                bootstrap=PAIRED if paired is not None else INDEPENDENT,
                n_clusters=_shared_prompts(cols["both"]) if paired is not None else None,
                level_boot_tok_s=level_bt,
                level_boot_j_per_token=level_bj,
                n_prompts=np.array(cols["np"]),
                j_per_token_pooled=np.array(cols["pool"], dtype=float),
                counter_window_s=np.array(cols["cw"], dtype=float),
                power_window_s=np.array(cols["pw"], dtype=float),
                counter_prompt_offset=np.array(cols["wp"], dtype=float),
                other_cpu_pct=np.array(cols["ocpu"], dtype=float),
                powerprof_cpu_pct=np.array(cols["pcpu"], dtype=float),
                n_foreign=np.array(cols["nfor"], dtype=int),
                n_j_windows=np.array(cols["nj"], dtype=int),
            )
        )
    return out


def level_rng(seed, level_value) -> np.random.Generator:
    """The random stream of one level's own bootstrap, fixed by the seed and the level alone, so the
    sweep's live CI and the table's CI of the same windows are the same numbers."""
    v = 0 if level_value is None or not np.isfinite(level_value) else int(round(float(level_value) * 1000)) & 0xFFFFFFFF
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, v])


def level_j_replicates(j: np.ndarray, level_value=None, n_boot: int = 2000, seed=0) -> np.ndarray:
    """Bootstrap medians of one level's J/token values (finite ones, in window order): what its CI,
    `ci_reached_pct` and the sweep's stopping rule are all computed from."""
    j = np.asarray(j, dtype=float)
    j = j[np.isfinite(j)]
    if j.size == 0:
        return np.full(n_boot, np.nan)
    ranks = _Ranks(j)
    return np.concatenate([ranks.row_medians(i) for i in _resample_indices(level_rng(seed, level_value), j.size, n_boot)])


def level_j_ci_halfwidth_frac(j: np.ndarray, level_value=None, n_boot: int = 2000, seed=0, ci: float = 0.95) -> float:
    """Half-width of a level's J/token 95% CI relative to its median (inf below two values)."""
    j = np.asarray(j, dtype=float)
    j = j[np.isfinite(j)]
    if j.size < 2:
        return float("inf")
    lo, hi = percentile_interval(level_j_replicates(j, level_value, n_boot, seed), ci)
    med = float(np.median(j))
    return float((hi - lo) / 2 / abs(med)) if med else float("inf")


def _joint_replicates(tok_both, j_both, tok_all, n_boot, rng) -> tuple[np.ndarray, np.ndarray]:
    """Median tok/s and J/token of the same resampled requests; tok/s alone where energy is missing."""
    if tok_both.size >= 1:
        bt, bj = [], []
        tok_rank, j_rank = _Ranks(tok_both), _Ranks(j_both)
        for i in _resample_indices(rng, tok_both.size, n_boot):
            bt.append(tok_rank.row_medians(i))
            bj.append(j_rank.row_medians(i))
        return np.concatenate(bt), np.concatenate(bj)
    t = tok_all[np.isfinite(tok_all)]
    nan = np.full(n_boot, np.nan)
    if t.size == 0:
        return nan, nan.copy()
    return bootstrap_replicates(t, np.median, n_boot, rng=rng), nan


_WINDOW_MIN = 5000  # below this many windows, partitioning is as fast as counting


class _Ranks:
    """Finite values by rank, for exact resample medians partitioned as small integers (4x less
    memory traffic than float64: the bootstrap of 10^5 windows is dominated by partitioning)."""

    def __init__(self, values: np.ndarray):
        order = np.argsort(values, kind="stable")
        self.sorted = values[order]
        self.rank = np.empty(values.size, np.int16 if values.size <= np.iinfo(np.int16).max else np.int32)
        self.rank[order] = np.arange(values.size)

    def row_medians(self, idx: np.ndarray) -> np.ndarray:
        """np.median(values[idx], axis=1), the same numbers: the middle ranks pick the middle values."""
        r = self.rank[idx]
        if self.sorted.size >= _WINDOW_MIN and r.shape[1] == self.sorted.size:
            return self._window_medians(idx, r)
        return self._partition_medians(r)

    def _partition_medians(self, r: np.ndarray) -> np.ndarray:
        m = r.shape[1]
        if m % 2:
            return self.sorted[np.partition(r, m // 2, axis=1)[:, m // 2]]
        p = np.partition(r, [m // 2 - 1, m // 2], axis=1)
        return (self.sorted[p[:, m // 2 - 1]] + self.sorted[p[:, m // 2]]) / 2

    def _window_medians(self, idx: np.ndarray, r: np.ndarray) -> np.ndarray:
        """The same medians by counting: a resample's median rank lies within a few sqrt(n) of n/2
        (its sd is about sqrt(n)/2), so count the ranks below a window of 8 sd around n/2 and
        histogram only those inside it. Rows whose middle falls outside (practically none) are
        partitioned. About twice as fast as partitioning for 10^4 windows per level."""
        c, n = r.shape
        ks = [n // 2] if n % 2 else [n // 2 - 1, n // 2]
        half = int(4 * np.sqrt(n)) + 2
        lo, hi = max(0, n // 2 - half), min(n, n // 2 + half)
        w = hi - lo
        below = np.count_nonzero(r < lo, axis=1)
        rows, cols = np.nonzero((r >= lo) & (r < hi))
        counts = np.bincount(rows * w + (r[rows, cols].astype(np.int64) - lo), minlength=c * w).reshape(c, w)
        cum = np.cumsum(counts, axis=1)
        vals, outside = [], np.zeros(c, bool)
        for k in ks:
            kk = k - below  # the k-th smallest is the kk-th of the window's ranks
            pos = np.count_nonzero(cum <= kk[:, None], axis=1)
            outside |= (kk < 0) | (pos >= w)
            vals.append(self.sorted[lo + np.minimum(pos, w - 1)])
        out = vals[0] if len(vals) == 1 else (vals[0] + vals[1]) / 2
        if outside.any():
            out[outside] = self._partition_medians(r[outside])
        return out


def _paired_replicates(levels, n_boot, rng) -> tuple[np.ndarray, np.ndarray] | None:
    """Cluster bootstrap by prompt: (tok/s, J/token) replicates of shape (n_boot, L), or None when
    the levels do not share one prompt set of at least MIN_PAIRED_PROMPTS ids.

    levels: per level (tok/s, J/token, prompt_id) of the windows with both figures. Replicate b
    draws the prompt ids with replacement once; every level takes the median over all its windows
    of the drawn prompts (a prompt drawn twice counts twice), so the level ratio stays paired."""
    ids = []
    for _, _, p in levels:
        if p.size == 0 or any(not isinstance(x, str) or not x for x in p):
            return None
        ids.append(set(p))
    common = ids[0]
    if len(common) < MIN_PAIRED_PROMPTS or any(i != common for i in ids[1:]):
        return None
    names = np.array(sorted(common), dtype=object)
    n = names.size
    # How often each prompt is drawn in each resample: the same law as n draws with replacement.
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)
    bt, bj = [], []
    for tok, j, p in levels:
        code = np.searchsorted(names, p)  # window -> its prompt's column of counts
        bt.append(_weighted_median(tok, counts, code))
        bj.append(_weighted_median(j, counts, code))
    return np.column_stack(bt), np.column_stack(bj)


def _shared_prompts(levels) -> int:
    return len(set(levels[0][2]))


def paired_saving_halfwidth(ref_j, ref_prompts, level_j, level_prompts, n_boot: int = 2000, seed=0) -> float:
    """Half-width of the 95% CI of a level's energy saving against the reference (a fraction: 0.01
    is ±1 percentage point), bootstrapped by prompt as the analysis does; inf when the two do not
    share one prompt set of at least MIN_PAIRED_PROMPTS ids."""
    levels = []
    for j, p in ((ref_j, ref_prompts), (level_j, level_prompts)):
        j = np.asarray(j, dtype=float)
        p = np.asarray(p, dtype=object)
        keep = np.isfinite(j)
        levels.append((j[keep], j[keep], p[keep]))
    rep = _paired_replicates(levels, n_boot, np.random.default_rng(seed))
    if rep is None:
        return float("inf")
    _, bj = rep
    saving = 1.0 - bj[:, 1] / bj[:, 0]
    # Widened as the analysis widens it, so the sweep stops where the analysis's CI is the target.
    est = 1.0 - np.median(levels[1][1]) / np.median(levels[0][1])
    lo, hi = widened_interval(saving, est, small_cluster_factor(_shared_prompts(levels)))
    return float((hi - lo) / 2)


def _weighted_median(values: np.ndarray, counts: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Row-wise np.median of `values` with window i repeated counts[b, code[i]] times; shape (B,).

    Every row must keep at least one window. Rows go in chunks so memory stays bounded."""
    order = np.argsort(values, kind="stable")
    v, code = values[order], code[order]
    out = []
    chunk = max(1, _BOOT_CHUNK_ELEMS // max(v.size, 1))
    for start in range(0, counts.shape[0], chunk):
        cw = np.cumsum(counts[start : start + chunk][:, code], axis=1)
        total = cw[:, -1:]
        # The k-th (0-based) of the expanded sorted values is v[number of cumulative weights <= k].
        lo = (cw <= (total - 1) // 2).sum(axis=1)
        hi = (cw <= total // 2).sum(axis=1)
        out.append((v[lo] + v[hi]) / 2)
    return np.concatenate(out) if out else np.zeros(0)


def summarize_levels(
    windows: pa.Table,
    reference_value: float | None = None,
    run_id: str | None = None,
    extra: dict | None = None,
    n_boot: int = 2000,
    ci: float = 0.95,
    seed=0,
    wide_ci_pct: float = WIDE_CI_PCT,
) -> pa.Table:
    """One LEVELS row per (level_kind, level_value, concurrency) of the measured windows.

    reference_value: the default limit; it is the reference when measured, else the highest level.
    extra: {(level_kind, level_value, concurrency): {column: value}} (stats.level_extra) for what the samples say (avg_gpu_power_w,
    sm_clock_mhz, enforced_limit_w, cap_not_engaged, thermal_throttle, ...); it overrides the
    window-derived figure of the same column, and its boolean flags join `flags`.
    """
    series = level_series(windows, reference_value, n_boot, seed)
    return levels_table(series, run_id=run_id, extra=extra, ci=ci, wide_ci_pct=wide_ci_pct)


def levels_table(
    series: list[LevelSeries], run_id: str | None = None, extra: dict | None = None, ci: float = 0.95,
    wide_ci_pct: float = WIDE_CI_PCT,
) -> pa.Table:
    rows = []
    for s in series:
        loss_b = s.speed_loss(s.boot_tok_s) * 100
        save_b = s.energy_saving(s.boot_j_per_token) * 100
        loss, save = s.speed_loss() * 100, s.energy_saving() * 100
        widen = s.comparison_factor
        level_tok = s.boot_tok_s if s.level_boot_tok_s is None else s.level_boot_tok_s
        level_j = s.boot_j_per_token if s.level_boot_j_per_token is None else s.level_boot_j_per_token
        for i, v in enumerate(s.level_values):
            tok_lo, tok_hi = percentile_interval(level_tok[:, i], ci)
            j_lo, j_hi = percentile_interval(level_j[:, i], ci)
            flags = []
            n_j = s.n_windows[i] if s.n_j_windows is None else s.n_j_windows[i]
            if s.n_windows[i] == 1:
                # One window (a trace replayed once): resampling it says nothing; no CI, not a zero-width one.
                tok_lo = tok_hi = j_lo = j_hi = float("nan")
                flags.append("one-window")
            elif n_j == 1:
                # Several windows timed, one with energy (the rest energy_method none): the J/token is that one
                # window's, and its CI was printed as ±0.0% under few-windows alone.
                j_lo = j_hi = float("nan")
                flags.append("one-window")
            elif 2 <= min(s.n_windows[i], n_j) < MIN_CI_WINDOWS:
                flags.append(FEW_WINDOWS_FLAG)  # a CI from 2-4 windows covers 50-87.5%, not 95%
            j = s.j_per_token[i]
            half_pct = (j_hi - j_lo) / 2 / j * 100 if np.isfinite(j) and j else float("nan")
            if s.n_failed[i]:
                flags.append("failed-requests")
            if np.isfinite(half_pct) and half_pct > wide_ci_pct:
                flags.append("wide-ci")
            if s.n_windows[i] == 0:
                flags.append("no-measured-windows")
            # Widening can pass 100%, which no loss or saving can reach (tok/s and J/token stay > 0).
            loss_ci = np.minimum(widened_interval(loss_b[:, i], loss[i], widen, ci), 100.0)
            save_ci = np.minimum(widened_interval(save_b[:, i], save[i], widen, ci), 100.0)
            pooled = s.j_per_token_pooled[i] if s.j_per_token_pooled is not None else float("nan")
            offset = s.counter_prompt_offset[i] if s.counter_prompt_offset is not None else float("nan")
            if s.counter_window_s is not None and median_off_by_rounding(j, pooled, (j_hi - j_lo) / 2,
                                                                          s.counter_window_s[i], offset):
                flags.append("energy-resolution")
            counter_s = s.counter_window_s[i] if s.counter_window_s is not None else float("nan")
            power_s = s.power_window_s[i] if s.power_window_s is not None else float("nan")
            if power_s < POWER_EDGE_BIAS_WINDOW_S:
                flags.append(INSTANT_POWER_FLAG)  # no counter: short windows' edges biased by the reading's lag
            other_pct = s.other_cpu_pct[i] if s.other_cpu_pct is not None else float("nan")
            if other_pct > BUSY_HOST_PCT and np.isfinite(s.total_j_per_token[i]):
                flags.append(BUSY_HOST_FLAG)  # the GPU+CPU figure counts other processes' CPU energy
            if s.n_foreign is not None and s.n_foreign[i]:
                flags.append(FOREIGN_FLAG)  # windows beside others' work were left out (and measured again)
            row = {
                "run_id": run_id,
                "level_kind": s.level_kind,
                "level_value": None if np.isnan(v) else float(v),
                "requested_limit_w": float(v) if s.level_kind == "power_limit" else None,
                "locked_sm_clock_mhz": float(v) if s.level_kind == "sm_clock" else None,
                "n_requests": int(s.n_requests[i]),
                "n_failed": int(s.n_failed[i]),
                "n_prompts": int(s.n_prompts[i]) if s.n_prompts is not None else None,
                "n_windows": int(n_j),
                "n_windows_tok_s_only": int(s.n_windows[i] - n_j),
                "decode_tok_s": s.tok_s[i],
                "decode_tok_s_ci_low": tok_lo,
                "decode_tok_s_ci_high": tok_hi,
                "gpu_j_per_token": j,
                "gpu_j_per_token_ci_low": j_lo,
                "gpu_j_per_token_ci_high": j_hi,
                "gpu_j_per_token_pooled": pooled,
                "total_j_per_token": s.total_j_per_token[i],
                "above_idle_gpu_j_per_token": s.above_idle_j_per_token[i],
                "ci_reached_pct": half_pct,
                "speed_loss_pct": loss[i],
                "energy_saving_pct": save[i],
                "avg_gpu_power_w": s.power_w[i],
                "reference": i == s.ref_index,
                "energy_method": "+".join(s.energy_methods) or None,
                "concurrency": s.concurrency,
                "speed_loss_pct_ci_low": loss_ci[0],
                "speed_loss_pct_ci_high": loss_ci[1],
                "energy_saving_pct_ci_low": save_ci[0],
                "energy_saving_pct_ci_high": save_ci[1],
                "other_cpu_pct": other_pct,
                "powerprof_cpu_pct": s.powerprof_cpu_pct[i] if s.powerprof_cpu_pct is not None else float("nan"),
                "counter_window_s": counter_s,
            }
            own = level_extra(extra, s.level_kind, row["level_value"], s.concurrency)
            for k, val in own.items():
                if val is not None and k in LEVELS.names:
                    row[k] = val
            for flag, col in (("cap-not-engaged", "cap_not_engaged"), ("thermal", "thermal_throttle")):
                if row.get(col):
                    flags.append(flag)
            if row.get("cap_not_engaged_gpus") and not row.get("cap_not_engaged"):
                flags.append("cap-partly-engaged")
            # Under 10 refreshes of the counter (the sweep's estimate of it, else 100 ms); NaN (no counter window)
            # compares False.
            if counter_s < short_counter_window_s(row.get("counter_refresh_s")):
                flags.append(SHORT_WINDOWS_FLAG)
            if own.get("no_busy_clock") and \
                    row.get("sm_clock_mhz") is None:
                flags.append(NO_BUSY_FLAG)
            row["flags"] = ",".join(flags) or None
            rows.append({k: _clean(x) for k, x in row.items()})
    return pa.Table.from_pylist(rows, schema=LEVELS) if rows else LEVELS.empty_table()


def level_extra(extra: dict | None, kind: str, value: float | None, concurrency: int) -> dict:
    """The sensor figures of one level of one series: keyed (level_kind, level_value, concurrency), as a level at
    another concurrency is another level; (kind, value, None) where a run's samples spanned several concurrencies
    (loading.run_concurrency), and (kind, value) where one run's sweep wrote them (one concurrency); the most
    specific figure given wins, the others fill what it lacks."""
    extra, out = extra or {}, {}
    for key in ((kind, value), (kind, value, None), (kind, value, concurrency)):  # the most specific wins
        out.update({k: v for k, v in extra.get(key, {}).items() if v is not None})
    return out


def _clean(x):
    if isinstance(x, (np.floating, float)):
        return float(x) if np.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x
