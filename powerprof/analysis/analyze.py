"""The analysis of pooled windows: level statistics, curve fits, every policy's sweet spot and warnings.

Pure computation over tables already read; report.py reads run directories and writes the files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from powerprof.storage.schema import ANALYSIS, KNOB_PREFIX, with_knob_columns
from powerprof.workload.client import restart_said

from .checks import (Finding, choice_findings, edge_findings, fit_findings, impossible_findings, level_findings,
                     no_energy_findings, nothing_measured_text, saving_findings, timing_findings,
                     unmeasured_level_findings)
from .fits import ModelFit, fit_series
from .loading import SWEEP_LEVEL_COLUMNS, RunInfo, Timeline
from .stats import WIDE_CI_PCT, LevelSeries, level_series, levels_table
from .sweetspot import POLICIES, PRIMARY_POLICY, Choice, PolicyParams, choose_all


@dataclass
class SeriesResult:
    """One series of levels (a level kind at one concurrency) and everything derived from it."""

    series: LevelSeries
    table: pa.Table  # ANALYSIS rows, ascending level
    fits: dict[str, ModelFit]
    choices: dict[str, Choice]
    primary: str

    @property
    def recommendation(self) -> Choice:
        return self.choices[self.primary]

    @property
    def comparable(self) -> bool:
        """Whether there is more than one level: a lone level is every policy's "choice" against
        itself, so nothing is recommended, starred or said to be chosen for it."""
        return self.series.level_values.size > 1

    @property
    def starred(self) -> bool:
        """Whether a mark may single out the recommended level: several levels, and a saving against the reference
        that its CI tells from none (else the words say to keep the reference: checks.saving_findings)."""
        from .checks import saving_within_noise  # noqa: PLC0415

        return self.comparable and saving_within_noise(self.recommendation, self.table,
                                                       self.series.reference_value) is None

    @property
    def label(self) -> str:
        kind = "power limit" if self.series.level_kind == "power_limit" else self.series.level_kind.replace("_", " ")
        return f"{kind}, concurrency {self.series.concurrency}"

    @property
    def suffix(self) -> str:
        """File-name suffix: empty for the main series, so its plots have the plain names."""
        return "" if self.series.concurrency == 1 and self.series.level_kind == "power_limit" else (
            f"_{self.series.level_kind}_c{self.series.concurrency}")


@dataclass
class AnalysisResult:
    runs: list[RunInfo]
    series: list[SeriesResult]
    warnings: list[Finding]
    params: PolicyParams
    timelines: list[Timeline] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    # One id for every output of one write (report.write_outputs): export refuses a folder whose outputs disagree.
    analysis_id: str | None = None
    knobs: object | None = None  # knobs.KnobResult of a configuration sweep
    # What happened during the runs that changes no figure (server_notes): said beside them, never a warning.
    notes: list[str] = field(default_factory=list)
    server_restarts: list[dict] = field(default_factory=list)  # run.json server_restarts, each with its run_id
    # What writing the outputs met that is no fact of the runs (an --out that could not be locked): printed, not stored.
    write_notes: list[str] = field(default_factory=list)

    @property
    def has_levels(self) -> bool:
        """Whether there is a level series to recommend from (a configuration sweep may step none)."""
        return bool(self.series)

    @property
    def main(self) -> SeriesResult:
        """The series the recommendation comes from: power limits at the lowest concurrency."""
        by_pref = sorted(self.series, key=lambda s: (s.series.level_kind != "power_limit", s.series.concurrency))
        return by_pref[0]

    @property
    def recommendation(self) -> Choice:
        return self.main.recommendation

    @property
    def table(self) -> pa.Table:
        return pa.concat_tables([s.table for s in self.series]) if self.series else ANALYSIS.empty_table()

    @property
    def simulated(self) -> bool:
        return any(r.simulated for r in self.runs)

    @property
    def simulated_note(self) -> str:
        """What the reports say of simulated figures: the simulator's GPU and server, or its GPU beside a real server
        (real token timing, the simulator's every energy and power figure); "" for hardware."""
        if not self.simulated:
            return ""
        if any(r.meta.get("sim_beside_real_server") is True for r in self.runs):
            return ("a simulated GPU beside a real server: token timing is the server's, every energy and power figure "
                    "is the simulator's, whose GPU does not see that server's work")
        return "these figures come from the simulated GPU, not from hardware"

    @property
    def starred(self) -> bool:
        """Whether a ★ may mark the recommended level: not where the words say to keep the reference (a saving
        not told from none) or that nothing can be compared; the star then contradicted the line beneath it."""
        return bool(self.series) and self.main.starred

    def _recommendation_note(self) -> str | None:
        if not self.series:
            return None
        if not self.main.comparable:
            return "one level measured: nothing to compare it with, so none is recommended"
        from .checks import saving_within_noise  # noqa: PLC0415

        ci = saving_within_noise(self.recommendation, self.main.table, self.main.series.reference_value)
        if ci is not None:
            return (f"the recommended level's energy saving, 95% CI [{ci[0]:.1f}, {ci[1]:.1f}]%, is not told from no "
                    f"saving: keep the reference ({self.main.series.reference_value:g}) or measure more")
        return None

    def to_dict(self) -> dict:
        return {
            "runs": [{"path": str(r.path), "run_id": r.run_id, "gpu_name": r.gpu_name, "model": r.model,
                      "simulated": r.simulated} for r in self.runs],
            "params": {"max_slowdown": self.params.max_slowdown, "eta": self.params.eta,
                       "p_max_w": self.params.p_max_w},
            "recommendation": self.recommendation.to_dict() if self.series and self.main.comparable else None,
            "recommendation_note": self._recommendation_note(),
            "series": [
                {
                    "level_kind": s.series.level_kind,
                    "concurrency": s.series.concurrency,
                    "reference_value": s.series.reference_value,
                    "primary_policy": s.primary if s.comparable else None,
                    "choices": {p: c.to_dict() for p, c in s.choices.items()} if s.comparable else {},
                    "fits": {q: f.to_dict() for q, f in s.fits.items()},
                }
                for s in self.series
            ],
            "warnings": [w.to_dict() for w in self.warnings],
            "notes": list(self.notes),
            "server_restarts": list(self.server_restarts),
            "files": self.files,
            "analysis_id": self.analysis_id,
            "configurations": self.knobs.to_dict() if self.knobs is not None else None,
        }


def _run_gpu_ranges(run: RunInfo) -> list[tuple[str | None, float | None, float | None]]:
    """(label, min W, max W) of each GPU run.json lists (gpus[]), else the run's one range (min_limit_w, max_limit_w)."""
    gpus = run.meta.get("gpus") if isinstance(run.meta, dict) else None
    out = []
    for g in gpus if isinstance(gpus, list) else []:
        if isinstance(g, dict) and (g.get("min_limit_w") is not None or g.get("max_limit_w") is not None):
            name = f" ({g['name']})" if g.get("name") else ""
            out.append((f"GPU {g.get('index', '?')}{name}", _num(g.get("min_limit_w")), _num(g.get("max_limit_w"))))
    return out or [(None, run.min_limit_w, run.max_limit_w)]


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def card_range(runs: list[RunInfo], level_kind: str, levels) -> tuple[tuple[float | None, float | None], int,
                                                                        list[Finding]]:
    """The power limits the advice may name (the levels to add, the values to measure, the recommended setting): those
    every GPU of the runs accepts, as a sweep sets one level on all of them (control/levels.common_power_range). It
    took GPU 0's range alone: on a host whose GPU 0 is an L4 (40-72 W) every policy recommended 72 W for the other
    card's levels. A GPU whose range does not hold every measured level cannot have run them (run.json lists a GPU
    the levels were not set on): its range is left out, and a finding says so. Returns ((low, high), how many GPUs
    the range is of, findings)."""
    if level_kind != "power_limit" or not runs:
        return (None, None), 1, []
    lv = [float(v) for v in np.asarray(levels, float) if np.isfinite(v)]
    tol = 0.5  # a level is whole W; a range edge read back as 71.99 W still holds 72
    lows, highs, kept, dropped = [], [], 0, []
    for r in runs:
        n = 0
        for label, lo, hi in _run_gpu_ranges(r):
            if lv and ((lo is not None and lo > min(lv) + tol) or (hi is not None and hi < max(lv) - tol)):
                dropped.append((r, label, lo, hi))
                continue
            n += 1
            lows += [lo] if lo is not None else []
            highs += [hi] if hi is not None else []
        kept = max(kept, n)
    rng = ((max(lows) if lows else None), (min(highs) if highs else None))
    findings = []
    if dropped:
        w = lambda x: "?" if x is None else f"{x:g}"  # noqa: E731
        gpus = "; ".join(f"{r.path}: {label or 'the GPU'}, {w(lo)}-{w(hi)} W" for r, label, lo, hi in dropped)
        keep = (f"the range of the GPUs that could ({w(rng[0])}-{w(rng[1])} W)" if kept else
                "the levels measured (no GPU listed holds them all)")
        findings.append(Finding("card-range", (
            f"run.json lists GPUs whose power limits do not hold every level measured ({min(lv):g}-{max(lv):g} W): "
            f"{gpus}. Such a GPU cannot have run those levels, so the advice (levels to add, values to measure, the "
            f"recommended settings) keeps to {keep}. If it was measured, its levels are not what it ran: check "
            "run.json's gpus against the sweep's --gpus, and sweep one kind of GPU at a time.")))
    return rng, kept, findings


def _half_width(lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    h = (np.asarray(hi, float) - np.asarray(lo, float)) / 2
    return h if np.isfinite(h).all() and (h > 0).all() else None


def analyze(
    windows: pa.Table,
    runs: list[RunInfo],
    level_figures: dict | None = None,
    timelines: list[Timeline] | None = None,
    params: PolicyParams | None = None,
    n_boot: int = 2000,
    seed=0,
    primary: str = PRIMARY_POLICY,
    wide_ci_pct: float = WIDE_CI_PCT,
    judge_interrupted: bool = True,
    interrupted_levels=(),
    config: dict | None = None,
) -> AnalysisResult:
    """Everything `powerprof analyze` computes, from pooled windows and the runs' metadata.

    level_figures: {(level_kind, level_value, concurrency): {column: value}} of sensor figures per level (stats.level_extra)
    (from the sweep's levels.parquet or the samples); see loading.py.
    judge_interrupted: False where the caller judges unfinished and unmeasured visits over more windows than these
    (a configuration sweep's analysis gets only its chosen configuration's), which then gives
    interrupted_levels: (level_kind, concurrency, level_value) of the levels of these windows it found
    unfinished (never chosen in that series only: another concurrency's 220 W is another level).
    config: a configuration sweep's configuration these windows are ({config_id, context_tokens, config_status,
    knob_<NAME>: value}): written on every row, which alone would not say whose levels they are."""
    if primary not in POLICIES:
        raise ValueError(f"unknown policy {primary!r}; choose one of: {', '.join(POLICIES)}")
    params = params or PolicyParams()
    partial_cpu = cpu_energy_findings(runs, windows)
    if partial_cpu:
        windows = windows.set_column(windows.column_names.index("total_j_per_token"), "total_j_per_token",
                                     pa.nulls(windows.num_rows, pa.float64()))
    defaults = {r.default_limit_w for r in runs if r.default_limit_w is not None}
    reference = defaults.pop() if len(defaults) == 1 else None
    settings = [r.meta.get("settings") if isinstance(r.meta.get("settings"), dict) else {} for r in runs]
    planned = {float(v) for st in settings if st.get("level_kind") == "power_limit"
               for v in (st.get("levels") if isinstance(st.get("levels"), list) else [])
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    all_series = level_series(windows, reference, n_boot=n_boot, seed=seed)
    unlevelled = [s for s in all_series if not np.isfinite(s.level_values).all()]
    all_series = [s for s in all_series if np.isfinite(s.level_values).all()]
    if not all_series and unlevelled:
        # `measure` (or a configuration sweep without levels): windows at the settings as they were.
        raise ValueError("these windows were measured at the settings as they were (powerprof measure), not at "
                         "levels: there is no curve or sweet spot to fit; `powerprof export` gives the windows, "
                         "`powerprof sweep` measures levels")
    if not all_series:
        raise ValueError("no measured windows at any level (all warm-up, failed, or missing): nothing to analyse")
    if not any(int(np.sum(s.n_windows)) for s in all_series):
        # Levels with requests, none measured: every one failed or was left out (each reason said with its fix);
        # not an energy question.
        raise ValueError(nothing_measured_text(windows, sum(int(np.sum(s.n_failed)) for s in all_series)))
    if not any(np.isfinite(s.j_per_token).any() for s in all_series):
        raise ValueError("no window has a GPU energy (energy_method none everywhere): J/token cannot be computed")
    all_series = [s for s in all_series if np.isfinite(s.j_per_token).any()]
    extra = {k: {c: v for c, v in d.items() if c in SWEEP_LEVEL_COLUMNS} for k, d in (level_figures or {}).items()}
    run_ids = "+".join(dict.fromkeys(r.run_id for r in runs)) or None
    n_runs = _runs_per_level(windows)
    sweep = sweep_settings(runs)
    blind_gpu = any(r.meta.get("sim_beside_real_server") is True for r in runs)
    results, findings, first = [], [], []
    stopped = interrupted_findings(runs, windows) if judge_interrupted else []
    cut = (interrupted_series_levels(runs, windows) if judge_interrupted else set()) | {
        (k, int(c), float(v)) for k, c, v in interrupted_levels if v is not None}
    for s in all_series:
        card, n_gpus, range_findings = card_range(runs, s.level_kind, s.level_values)
        p_max = params.p_max_w if params.p_max_w is not None else card[1]
        sp = PolicyParams(params.max_slowdown, params.eta, p_max)
        base = levels_table([s], run_id=run_ids, extra=extra, wide_ci_pct=wide_ci_pct)
        fits = fit_series(
            s.level_kind, s.level_values, s.tok_s, s.power_w,
            tok_sigma=_half_width(base.column("decode_tok_s_ci_low").to_numpy(zero_copy_only=False),
                                  base.column("decode_tok_s_ci_high").to_numpy(zero_copy_only=False)),
        )
        in_series = {v for k, c, v in cut if (k, c) == (s.level_kind, s.concurrency)}
        choices = choose_all(s, sp, card, left_out=left_out_levels(base, in_series))
        table = _with_config(_analysis_table(base, s, fits, choices, primary, n_runs), config)
        results.append(SeriesResult(s, table, fits, choices, primary))
        not_engaged = {r["level_value"] for r in table.to_pylist() if r.get("cap_not_engaged")}
        prefix = "" if len(all_series) == 1 else f"[{results[-1].label}] "
        # First of all: every loss and saving after it is relative to that level.
        first.extend(Finding(f.kind, prefix + f.message, f.levels)
                     for f in flagged_reference_findings(s, table, in_series) if s.level_values.size > 1)
        for f in (reference_findings(s, reference, planned) + level_findings(table, **sweep, blind_gpu=blind_gpu)
                  + range_findings + edge_findings(s, choices, card, not_engaged, several_gpus=n_gpus > 1)
                  + choice_findings(choices, "MHz" if s.level_kind == "sm_clock" else "W")
                  + (saving_findings(choices, table, s.reference_value, "MHz" if s.level_kind == "sm_clock" else "W",
                                     primary) if s.level_values.size > 1 else [])
                  + fit_findings(fits)):
            findings.append(Finding(f.kind, prefix + f.message, f.levels))
    findings += uneven_pool_findings(runs, windows, all_series)
    findings += timing_findings(windows) + impossible_findings(windows) + no_energy_findings(windows)
    findings += unmeasured_level_findings(runs, windows) if judge_interrupted else []
    findings.extend(no_run_json_findings(runs))
    findings.extend(unstored_findings(runs))
    findings.extend(partial_cpu)
    findings.extend(stopped)
    return AnalysisResult(runs, results, first + findings, params, list(timelines or []))


def left_out_levels(levels: pa.Table, interrupted=frozenset()) -> dict[float, str]:
    """{level: why} for the levels of a series that no policy may choose (left_out_reason); the
    reference is never left out (choose keeps it: the others are compared with it). They stay in
    the tables with their flags."""
    out = {}
    for r in levels.to_pylist():
        why = left_out_reason(r, r["level_value"] in interrupted)
        if why and not r.get("reference"):
            out[float(r["level_value"])] = why
    return out


def left_out_reason(row: dict, interrupted: bool = False) -> str | None:
    """Why a levels row's figures are not the setting's effect, so nothing may be chosen on them
    (a level by the policies, a configuration by the configuration sweep's choice); None when they are.
    Thermal throttling (the clock fell for heat), a limit that never bound (below the reference: its
    figures are the reference's plus noise, so a "saving" there is noise), a level the sweep was
    still measuring when it stopped (interrupted: part of a round of the prompt set), a median
    J/token on one rounding of a coarse energy counter (energy-resolution: off by more than its CI,
    which resampling cannot see), windows read on the counter under 10 of its refreshes (short-windows: a bias all
    of them share, which neither the CI nor the pooled figure sees)."""
    flags = set((row.get("flags") or "").split(","))
    why = [w for w, bad in (("thermal throttling", row.get("thermal_throttle")),
                            ("cap not engaged", row.get("cap_not_engaged") and not row.get("reference")),
                            ("interrupted", interrupted),
                            # Others' work beside it for the level's whole budget: an incomplete round of the prompts.
                            ("others' work beside it", "foreign-traffic" in (row.get("stop_rule") or "").split(",")),
                            ("energy counter rounding", "energy-resolution" in flags),
                            # Counter windows under 10 refreshes: a bias every window shares (analysis.stats).
                            ("counter windows too short", "short-windows" in flags)) if bad]
    return ", ".join(why) or None


def reference_findings(s: LevelSeries, default_value: float | None, planned=()) -> list[Finding]:
    """The default limit was not swept (or not reached: `planned`, the levels the runs were to measure), or swept but
    has no figures (every request failed, or none was measured): the comparisons are against another level, which the
    report must say. A level within the limits' own tolerance of the default is the default (299 W, or "100%" of a
    212.5 W default rounded to 213 W): a sweep cannot set both."""
    from powerprof.control.levels import MIN_POWER_LEVEL_GAP_W

    if s.level_kind != "power_limit" or default_value is None:
        return []
    hit = np.flatnonzero(np.isclose(s.level_values, float(default_value)))
    near = np.abs(s.level_values - float(default_value)) < MIN_POWER_LEVEL_GAP_W
    if not hit.size and not near.any() and s.level_values.size:
        # "≤ 10% slower" read as against the card as it runs unless told: it was against the highest level swept
        # (220 W where the default is 300 W: a 180 W pick 6.8% slower than 220 W was ~17% slower than the default).
        against = (f"speed loss and energy saving are against {s.reference_value:g} W, the highest level with figures, "
                   "not against the card as it runs by default")
        if any(abs(float(p) - float(default_value)) < MIN_POWER_LEVEL_GAP_W for p in planned):
            return [Finding("reference", (
                f"{default_value:g} W, the default limit, was planned but never measured (the run stopped before it): "
                f"{against}. Measure {default_value:g} W to compare with the default."), (float(default_value),))]
        return [Finding("reference", (
            f"{default_value:g} W, the default limit, was not swept: {against}. "
            f"Add {default_value:g} to --limits to compare with the default."), (float(default_value),))]
    if not hit.size or int(hit[0]) == s.ref_index:
        return []
    i = int(hit[0])
    return [Finding("reference", (
        f"{default_value:g} W, the default limit, has no measured figures ({s.n_windows[i]} measured windows, "
        f"{s.n_failed[i]} failed requests): speed loss and energy saving are against {s.reference_value:g} W, the "
        f"highest level with figures, not against the default. Measure {default_value:g} W again to compare with it."),
        (float(default_value),))]


def uneven_pool_findings(runs: list[RunInfo], windows: pa.Table, series: list[LevelSeries]) -> list[Finding]:
    """Pooled runs that did not all measure the same levels: a loss or saving between two levels that different
    runs measured compares the runs as well (card to card, temperature, server state), which no CI covers
    (on the simulator, a card drawing 5% more made 180 W's saving 20.8% where the limit's is 24.7%)."""
    from .stats import _col, _concurrency, window_masks  # noqa: PLC0415

    if len(runs) < 2 or "run_id" not in windows.column_names:
        return []
    measured = window_masks(windows)[0]
    run_id, value = _col(windows, "run_id", object), _col(windows, "level_value")
    kind = np.array([k if k is not None else "none" for k in _col(windows, "level_kind", object)], dtype=object)
    conc = _concurrency(windows)
    where = {r.run_id: str(r.path) for r in runs}
    out = []
    for s in series:
        unit = "MHz" if s.level_kind == "sm_clock" else "W"
        in_series = measured & (kind == s.level_kind) & (conc == s.concurrency)
        by_level = {float(v): set(run_id[in_series & (value == v)]) for v in s.level_values if np.isfinite(v)}
        every = set().union(*by_level.values()) if by_level else set()
        if len(every) < 2:
            continue
        partial = {v: ids for v, ids in by_level.items() if ids and ids != every}
        if not partial:
            continue
        what = "; ".join(f"{v:g} {unit} only in {', '.join(sorted(where.get(i, str(i)) for i in ids))}"
                         for v, ids in sorted(partial.items()))
        prefix = "" if len(series) == 1 else f"[{s.level_kind.replace('_', ' ')}, concurrency {s.concurrency}] "
        out.append(Finding("uneven-pool", (
            f"{prefix}levels not measured by every pooled run: {what}. A speed loss or energy saving between levels of "
            "different runs carries the runs' own differences (card to card, temperature, server state) as if they "
            "were the setting's, which no CI covers. Measure every level in every run, or analyse the runs separately."),
            tuple(sorted(partial))))
    return out


def cpu_energy_findings(runs: list[RunInfo], windows: pa.Table) -> list[Finding]:
    """Pooled runs of which some measured CPU energy (RAPL) and some did not: a level's GPU + CPU J/token
    would be the median of some runs' windows beside a GPU J/token of all, and missing where only the others
    measured. The caller leaves total_j_per_token out of every level; this says so."""
    from .stats import _col, window_masks  # noqa: PLC0415

    if len(runs) < 2 or "total_j_per_token" not in windows.column_names or "run_id" not in windows.column_names:
        return []
    measured = window_masks(windows)[0]
    run_id, total = _col(windows, "run_id", object)[measured], _col(windows, "total_j_per_token")[measured]
    with_cpu = {r for r, t in zip(run_id, total) if np.isfinite(t)}
    without = [r for r in runs if r.run_id in set(run_id) and r.run_id not in with_cpu]
    if not with_cpu or not without:
        return []
    return [Finding("cpu-energy-partial", (
        f"GPU + CPU J/token (total_j_per_token) is left out of every level: {', '.join(str(r.path) for r in without)} "
        f"measured no CPU energy (RAPL) and {', '.join(str(r.path) for r in runs if r.run_id in with_cpu)} did, so a "
        "pooled level's figure would be the GPU + CPU of some runs beside the GPU of all. The GPU figures are "
        "pooled as usual; analyse the runs with CPU energy on their own for theirs."))]


def flagged_reference_findings(s: LevelSeries, table: pa.Table, interrupted=frozenset()) -> list[Finding]:
    """The reference itself carries a flag that leaves any other level out (left_out_reason): it stays the
    reference (the others are compared with it), but every loss and saving is then against figures that are
    not the setting's effect, which the recommendation must not state as if they were."""
    ref = next((r for r in table.to_pylist() if r.get("reference")), None)
    why = left_out_reason(ref, ref["level_value"] in interrupted) if ref is not None else None
    if not why:
        return []
    unit = "MHz" if s.level_kind == "sm_clock" else "W"
    return [Finding("reference", (
        f"{ref['level_value']:g} {unit}, the reference every speed loss and energy saving is measured against, is "
        f"flagged ({why}): its figures are not the setting's effect alone, so every comparison against it is off by "
        f"as much, the recommendation's too. Measure {ref['level_value']:g} {unit} again before trusting them."),
        (float(ref["level_value"]),))]


def no_run_json_findings(runs: list[RunInfo]) -> list[Finding]:
    """A run analysed without its run.json: where its GPU, limits and settings came from instead, or that nothing
    said them (no "simulated" banner, advice not kept within the card's limits)."""
    out = []
    for r in runs:
        if r.meta_from == "run.json":
            continue
        if r.meta_from:
            why = (f"its GPU, limits and settings (simulated or not) are read from {r.meta_from}'s footer metadata, "
                   "run.json as that file was written")
        else:
            why = ("windows.parquet has no usable footer metadata either, so its GPU, the card's limit range and "
                   "whether it was simulated are unknown: the advice is not kept within the card's limits")
        out.append(Finding("no-run-json", f"{r.path}: run.json is missing; {why}. Restore run.json to analyse it as measured."))
    return out


def unstored_findings(runs: list[RunInfo]) -> list[Finding]:
    """Windows a sweep measured but could not store (a server value its column cannot hold): the
    figures are computed without them, and the report says so."""
    out = []
    for r in runs:
        n = r.meta.get("unstored_window_rows")
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            why = r.meta.get("unstored_error") or "a value its column cannot hold"
            out.append(Finding("unstored", f"{r.path}: {n} measured window row(s) could not be stored ({why}); "
                                           "every figure here is computed without them."))
    return out


def server_notes(runs: list[RunInfo]) -> tuple[list[str], list[dict]]:
    """(notes, entries) from run.json: each time a sweep's server went away and was ridden out (`server_restarts`:
    the level measured again from scratch, the idle baseline taken again) and an idle baseline left out
    (`idle_baseline_note`). The windows measured before are already out of every figure (timing untrusted):
    these say what happened, they change nothing. Entries without `restarted` (the first release) are not
    called restarts: that release called every server that stopped answering one."""
    notes, entries = [], []
    for r in runs:
        prefix = f"{r.path}: " if len(runs) > 1 else ""
        kind = (r.meta.get("settings") or {}).get("level_kind") if isinstance(r.meta.get("settings"), dict) else None
        unit = "MHz" if kind == "sm_clock" else "W"
        repeats = (r.meta.get("settings") or {}).get("repeats", 1) if isinstance(r.meta.get("settings"), dict) else 1
        got = r.meta.get("server_restarts")
        for e in got if isinstance(got, list) else []:
            if not isinstance(e, dict):
                continue
            entries.append({"run_id": r.run_id, **e})
            down = e.get("down_s")
            down = f"down {down:.1f} s" if isinstance(down, (int, float)) and not isinstance(down, bool) else "down a while"
            err = f", {e['error']}" if e.get("error") else ""
            if "restarted" in e:
                what = "{} ({})".format(*restart_said(e.get("restarted"), e.get("evidence")))
            else:
                what = "the server stopped answering (the run does not say whether it restarted)"
            if e.get("stage") == "idle-baseline":
                notes.append(f"{prefix}the idle baseline was taken again after {what} during it ({down}{err}): "
                             "idle_gpu_power_w is from the baseline after it")
                continue
            v = e.get("level_value")
            where = "the settings as they were" if not isinstance(v, (int, float)) else f"{v:g} {unit}"
            rep = e.get("repeat")
            rep = f" (repeat {rep + 1})" if isinstance(rep, int) and isinstance(repeats, int) and repeats > 1 else ""
            notes.append(f"{prefix}{where}{rep} was measured again from scratch after {what} mid-level ({down}{err}); "
                         "its windows from before are left out of every figure, the figures shown are the new measurement's")
        if isinstance(r.meta.get("idle_baseline_note"), str):
            notes.append(prefix + r.meta["idle_baseline_note"])
    return notes, entries


# A stored note names the levels' flag it explains ("flag busy-host on 220 W", "levels.parquet flag server-restarted").
_FLAG_NAMED = re.compile(r"\bflag ([a-z][a-z-]*[a-z])")
_RESTART_FLAGS = ("server-restarted", "server-away")  # sweep.RESTARTED_FLAG, AWAY_FLAG (analysis does not import sweep)


def run_notes(runs: list[RunInfo], findings: list[Finding], said: list[str]) -> list[str]:
    """The notes each sweep stored in run.json `notes` (its end screen's: late window-edge reads, others' work, the
    server's context cutting answers short, ...), each once, `said` (analyze's own notes) and the findings aside.
    Left out where analyze says the same itself: a note whose words are in one of its findings or notes; the
    simulator's note (rig.notes: analyze marks the figures `(simulated)` and says so in the reports); a restart ridden
    out, or the idle baseline retaken over one (server_notes says each from run.json `server_restarts`); a note that
    names a level flag analyze has a finding of (busy-host, foreign-traffic); windows left out for their timing where
    analyze's `untrusted-timing` counts them. Before, they were in run.json alone: report.md, analysis.json and the
    console said none, the xlsx summary sheet alone carried them."""
    def norm(text: str) -> str:
        return " ".join(str(text).split())

    own = [t for t in (norm(f.message) for f in findings) if t] + [t for t in (norm(n) for n in said) if t]
    kinds = {f.kind for f in findings}
    out: list[str] = []
    for r in runs:
        got = r.meta.get("notes")
        if not isinstance(got, list):
            continue
        prefix = f"{r.path}: " if len(runs) > 1 else ""
        restarts = [e for e in r.meta.get("server_restarts") or [] if isinstance(e, dict)] \
            if isinstance(r.meta.get("server_restarts"), list) else []
        for note in got:
            if not isinstance(note, str) or not note.strip():
                continue
            text = norm(note)
            flags = set(_FLAG_NAMED.findall(text))
            if (any(text in o or o in text for o in own)
                    or (r.simulated and re.match(r"(?i)simulated GPU\b", text))
                    or (restarts and (flags & set(_RESTART_FLAGS)
                                      or "the baseline was taken again once it was back" in text))
                    or flags & kinds
                    or ("untrusted-timing" in kinds and re.match(r"\d+ of \d+ windows left out of ", text))):
                continue
            out.append(prefix + note)
    return list(dict.fromkeys(out))


def interrupted_findings(runs: list[RunInfo], windows: pa.Table) -> list[Finding]:
    """Levels a sweep was still measuring when it stopped (Ctrl-C, a signal, too many failures): their
    windows are stored and counted like the others', but they cover part of a round of the prompt set,
    so they compare another prompt mix, over fewer requests, with the finished levels. run.json
    `levels_done` lists the visits that finished: [level, repeat] for a sweep, [level, repeat,
    config_id, context_tokens] for a configuration sweep (powerprof/grid.py), level null where the
    settings were as they are. Runs without it are not judged."""
    out = []
    for r, cells, unit in _unfinished(runs, windows):
        cut: dict[tuple, int] = {}
        for (c, n, v, _, _), k in cells.items():
            cut[(c, n, v)] = cut.get((c, n, v), 0) + k
        what = ", ".join(f"{_visit_name(c, n, v, unit)} ({k} window{'s' if k > 1 else ''})"
                         for (c, n, v), k in sorted(cut.items(), key=lambda x: tuple(map(str, x[0]))))
        out.append(Finding("interrupted", (
            f"{r.path}: the run stopped while measuring {what}: those figures rest on the windows measured "
            "before it stopped, part of a round of the prompt set, so they compare another prompt mix over "
            "fewer requests with the finished levels. Measure those levels again before trusting them."),
            tuple(sorted({v for _, _, v in cut if v is not None}))))
    return out


def interrupted_cells(runs: list[RunInfo], windows: pa.Table) -> set[tuple]:
    """{(config_id, context_tokens, level)} of the visits interrupted_findings names (None where a
    plain sweep has no configuration or context, or no level was stepped)."""
    return {cell[:3] for _, cut, _ in _unfinished(runs, windows) for cell in cut}


def interrupted_series_levels(runs: list[RunInfo], windows: pa.Table, config_id=None,
                              context_tokens=None) -> set[tuple]:
    """{(level_kind, concurrency, level)} of the unfinished visits, as stats.level_series names its series
    (of one configuration and context when given): a level cut short at concurrency 8 is another level
    than the same limit at concurrency 1, or a clock of the same number, and only it is left out."""
    return {(kind, conc, v) for _, cut, _ in _unfinished(runs, windows) for c, n, v, kind, conc in cut
            if v is not None and (config_id is None or (c, n) == (config_id, context_tokens))}


def _unfinished(runs: list[RunInfo], windows: pa.Table) -> list[tuple[RunInfo, dict, str]]:
    """(run, {(config_id, context_tokens, level, level_kind, concurrency): measured windows}, unit) per run
    with unfinished visits (level_kind "none" where it is null, as in stats.level_series)."""
    from .stats import _col, _concurrency, window_masks  # noqa: PLC0415

    measured = window_masks(windows)[0]
    run_id, value, repeat = _col(windows, "run_id", object), _col(windows, "level_value"), _col(windows, "repeat")
    kind = _col(windows, "level_kind", object)
    conc = _concurrency(windows)
    config, context = _col(windows, "config_id", object, None), _col(windows, "context_tokens")
    out = []
    for r in runs:
        done = r.meta.get("levels_done")
        if not isinstance(done, list):
            continue
        finished = {_visit_key(*d, *([None] * (4 - len(d)))) for d in done
                    if isinstance(d, (list, tuple)) and len(d) in (2, 4) and d[1] is not None}
        cut: dict[tuple, int] = {}
        unit = "W"
        for i in np.flatnonzero(measured):
            if run_id[i] not in (r.run_id, None):
                continue
            rep = int(repeat[i]) if np.isfinite(repeat[i]) else 0
            key = _visit_key(value[i], rep, config[i], context[i])
            if key not in finished:
                where = (key[2], key[3], key[0], kind[i] if kind[i] is not None else "none", int(conc[i]))
                cut[where] = cut.get(where, 0) + 1
                unit = "MHz" if kind[i] == "sm_clock" else "W"
        if cut:
            out.append((r, cut, unit))
    return out


def _visit_key(level, repeat, config_id=None, context_tokens=None) -> tuple:
    """(level, repeat, config_id, context_tokens) with None for "none" (NaN, null), as run.json and the windows agree."""
    def num(x):
        return None if x is None or not np.isfinite(float(x)) else float(x)
    ctx = num(context_tokens)
    return num(level), int(repeat), config_id, None if ctx is None else int(ctx)


def _visit_name(config_id, context_tokens, level, unit: str) -> str:
    """`300 W`, or `draft=2,np=1 (8192 context tokens) at 300 W` in a configuration sweep."""
    at = f"{level:g} {unit}" if level is not None else "the settings as they were"
    if config_id is None and context_tokens is None:
        return at
    ctx = f" ({context_tokens} context tokens)" if context_tokens is not None else ""
    return f"{config_id or 'the server as launched'}{ctx} at {at}"


def sweep_settings(runs: list[RunInfo]) -> dict:
    """The sweep settings (run.json `settings`) the wide-CI advice needs, and whether a run replayed a trace (the
    one-window advice), as level_findings keywords.

    Pooled runs: the strictest target, and the longest time and request limits (advice must ask
    for more than any run had). Absent settings (old or synthetic runs) stay None."""
    def vals(key):
        out = []
        for r in runs:
            v = (r.meta.get("settings") or {}).get(key) if isinstance(r.meta.get("settings"), dict) else None
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                out.append(float(v))
        return out
    target, max_time, max_req, repeats = vals("target_ci"), vals("max_time_s"), vals("max_requests"), vals("repeats")
    return {
        "target_ci_pct": min(target) * 100 if target else None,
        "max_time_s": max(max_time) if max_time else None,
        "max_requests": int(max(max_req)) if max_req else None,
        "repeats": int(max(repeats)) if repeats else 1,
        # A trace run's one window per level is the replay itself (one-window's cause and fix).
        "trace": any(isinstance(r.meta.get("trace"), dict) for r in runs),
    }


def _runs_per_level(windows: pa.Table) -> dict:
    if "run_id" not in windows.column_names:
        return {}
    out: dict = {}
    for k, v, r in zip(windows.column("level_kind").to_pylist(), windows.column("level_value").to_pylist(),
                       windows.column("run_id").to_pylist()):
        out.setdefault((k, v), set()).add(r)
    return {k: len(v) for k, v in out.items()}


def _analysis_table(base: pa.Table, s: LevelSeries, fits: dict[str, ModelFit], choices: dict[str, Choice],
                    primary: str, n_runs: dict) -> pa.Table:
    lv = s.level_values
    alone = lv.size < 2  # a lone level is chosen by nothing: there is nothing to choose it over
    tok_fit = fits["decode_tok_s"].predict(lv)
    p_fit = fits["avg_gpu_power_w"].predict(lv)
    chosen = [None if alone else ",".join(p for p, c in choices.items() if c.level_value == v) or None for v in lv]
    extra = {
        "n_runs": pa.array([n_runs.get((s.level_kind, float(v)), 1) for v in lv], pa.int32()),
        "fit_decode_tok_s": pa.array(_nan_none(tok_fit), pa.float64()),
        "fit_avg_gpu_power_w": pa.array(_nan_none(p_fit), pa.float64()),
        "fit_gpu_j_per_token": pa.array(_nan_none(p_fit / tok_fit), pa.float64()),
        "chosen_by": pa.array(chosen, pa.string()),
        "recommended": pa.array([not alone and bool(v == choices[primary].level_value) for v in lv], pa.bool_()),
        "left_out": pa.array([choices[primary].left_out.get(float(v)) for v in lv], pa.string()),
    }
    cols = [base.column(n) if n in base.column_names else extra[n] for n in ANALYSIS.names]
    return pa.Table.from_arrays(cols, schema=ANALYSIS)


def _with_config(table: pa.Table, config: dict | None) -> pa.Table:
    """The rows labelled with the configuration they are (report._configurations' choice), as levels.parquet's are."""
    if not config:
        return table
    for name in ("config_id", "context_tokens", "config_status"):
        i = table.column_names.index(name)
        table = table.set_column(i, table.schema.field(i), pa.array([config.get(name)] * table.num_rows,
                                                                     table.schema.field(i).type))
    return with_knob_columns(table, [{k: v for k, v in config.items() if k.startswith(KNOB_PREFIX)}] * table.num_rows)


def _nan_none(a) -> list:
    return [None if not np.isfinite(x) else float(x) for x in np.asarray(a, dtype=float)]
