"""PNG plots of an analysis (matplotlib, Agg canvas, no pyplot state): curves, trade-off, timeline.

Every marker of a policy's choice has the gid `choice-<policy>` and the recommended level the gid
`recommended`, so tests (and anyone) can check that the plot marks what was computed. The PNG
carries the recommendation in its text metadata too. Policies that choose the same level get
their markers side by side above the point (a fixed offset in points), so none hides another.
Where the recommended level's saving is within noise (SeriesResult.starred false: the report says to
keep the reference), no level is marked and the title says why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import offset_copy

from .analyze import SeriesResult
from .fits import pchip_grid
from .loading import Timeline
from .sweetspot import slowdown_text

MARKERS = {"min_energy": "v", "budget": "*", "edp": "s", "ed2p": "D", "knee": "^", "weighted": "P"}
COLORS = {"min_energy": "tab:green", "budget": "tab:red", "edp": "tab:purple", "ed2p": "tab:brown",
          "knee": "tab:orange", "weighted": "tab:cyan"}


MARKER_PT = 11  # marker size; neighbours sit this far apart (+3 pt) so their outlines do not touch
STACK_DY_PT = 16  # the row of policy markers sits this far above the measured point


def _figure(w=9.0, h=5.0) -> Figure:
    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: Path, sr: SeriesResult | None = None) -> Path:
    meta = {"Software": "powerprof"}
    if sr is not None and sr.starred:
        rec = sr.recommendation
        meta["Description"] = f"recommended {rec.policy} {rec.level_value:g}"
    elif sr is not None and sr.comparable:
        meta["Description"] = _no_saving(sr)
    elif sr is not None:
        meta["Description"] = "one level measured: none recommended"
    fig.savefig(path, format="png", metadata=meta)
    return path


def _xlabel(sr: SeriesResult) -> str:
    return "SM clock lock (MHz)" if sr.series.level_kind == "sm_clock" else "power limit (W)"


def _title(what: str, sr: SeriesResult) -> str:
    """`J/token vs power limit (concurrency 1)`: the level kind once, in the x label's words."""
    return _unmarked(sr, f"{what} vs {_xlabel(sr).split(' (')[0]} (concurrency {sr.series.concurrency})")


def _no_saving(sr: SeriesResult) -> str:
    what = "SM clock lock" if sr.series.level_kind == "sm_clock" else "limit"
    ref = f"{sr.series.reference_value:g} {_unit(sr)}"
    return f"no {what} is shown to save energy: keep {ref} ({sr.recommendation.level_value:g} {_unit(sr)}'s saving is within noise)"


def _unmarked(sr: SeriesResult, title: str) -> str:
    """The title, and where no level is marked (a saving within noise) a second line saying so."""
    return title if sr.starred or not sr.comparable else f"{title}\n{_no_saving(sr)}"


def _policy_markers(ax, sr: SeriesResult, xs, ys, unit: str = "") -> None:
    """One marker per policy at its chosen level; those sharing a level sit side by side above it."""
    lv = sr.series.level_values
    by_level: dict[int, list[str]] = {}
    for p, c in sr.choices.items():
        by_level.setdefault(int(np.flatnonzero(lv == c.level_value)[0]), []).append(p)
    fig = ax.figure
    for i, ps in by_level.items():
        if not (np.isfinite(xs[i]) and np.isfinite(ys[i])):
            continue
        for k, p in enumerate(ps):
            dx = (k - (len(ps) - 1) / 2) * (MARKER_PT + 3)
            tr = offset_copy(ax.transData, fig=fig, x=dx, y=STACK_DY_PT, units="points")
            c = sr.choices[p]
            ax.plot([xs[i]], [ys[i]], MARKERS[p], color=COLORS[p], ms=MARKER_PT, mfc="none", mew=2,
                    gid=f"choice-{p}", label=f"{p}: {c.level_value:g}{(' ' + unit) if unit else ''}", zorder=4,
                    transform=tr, clip_on=False)


def _curve(ax, sr: SeriesResult, y, lo, hi, fit_y, ylabel: str, title: str):
    s = sr.series
    lv = s.level_values
    ok = np.isfinite(y)
    ax.errorbar(lv[ok], y[ok], yerr=[np.maximum(y - lo, 0)[ok], np.maximum(hi - y, 0)[ok]], fmt="o", color="k",
                capsize=3, label="median, 95% CI", zorder=3)
    if ok.sum() >= 2:
        grid = np.linspace(lv[ok].min(), lv[ok].max(), 200)
        ax.plot(grid, pchip_grid(lv[ok], y[ok], grid), "-", color="0.4", lw=1, label="monotone interpolation")
    if fit_y is not None:
        span = lv.max() - lv.min() if lv.size > 1 else lv.max() * 0.2
        grid = np.linspace(lv.min() - 0.15 * span, lv.max() + 0.15 * span, 200)
        fy = fit_y(grid)
        if np.isfinite(fy).any():
            ax.plot(grid, fy, "--", color="tab:blue", lw=1, label="model fit")
    if sr.starred:
        _policy_markers(ax, sr, lv, y, _unit(sr))
        rec = sr.recommendation
        ri = int(np.flatnonzero(lv == rec.level_value)[0])
        ax.axvline(rec.level_value, color="tab:red", lw=1, alpha=0.4, gid="recommended",
                   label=f"recommended {rec.recommended_value:g} {_unit(sr)}")
        ax.annotate("recommended", (rec.level_value, y[ri]), textcoords="offset points", xytext=(6, -16),
                    color="tab:red", fontsize=9)
    ax.margins(y=0.18)  # room for the row of policy markers above the highest point
    ax.set_xlabel(_xlabel(sr), fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.set_title(title, fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.figure.tight_layout()


def plot_j_per_token(sr: SeriesResult, path: Path) -> Figure:
    t = sr.table
    fig = _figure()
    ax = fig.add_subplot()
    fits = sr.fits
    fit = _ratio_fit(fits["avg_gpu_power_w"], fits["decode_tok_s"])
    _curve(ax, sr, _arr(t, "gpu_j_per_token"), _arr(t, "gpu_j_per_token_ci_low"), _arr(t, "gpu_j_per_token_ci_high"),
           fit, "GPU energy per decode token (J/token)", _title("J/token", sr))
    _save(fig, path, sr)
    return fig


def plot_tok_s(sr: SeriesResult, path: Path) -> Figure:
    t = sr.table
    fig = _figure()
    ax = fig.add_subplot()
    f = sr.fits["decode_tok_s"]
    _curve(ax, sr, _arr(t, "decode_tok_s"), _arr(t, "decode_tok_s_ci_low"), _arr(t, "decode_tok_s_ci_high"),
           f.predict if f.ok else None, "decode speed (tokens/s)", _title("Decode tok/s", sr))
    _save(fig, path, sr)
    return fig


def plot_tradeoff(sr: SeriesResult, path: Path) -> Figure:
    t = sr.table
    fig = _figure()
    ax = fig.add_subplot()
    x, y = _arr(t, "speed_loss_pct"), _arr(t, "energy_saving_pct")
    xl, xh = _arr(t, "speed_loss_pct_ci_low"), _arr(t, "speed_loss_pct_ci_high")
    yl, yh = _arr(t, "energy_saving_pct_ci_low"), _arr(t, "energy_saving_pct_ci_high")
    ax.errorbar(x, y, xerr=[np.maximum(x - xl, 0), np.maximum(xh - x, 0)], yerr=[np.maximum(y - yl, 0),
                np.maximum(yh - y, 0)], fmt="o-", color="k", capsize=3, lw=1, label="levels, 95% CI", zorder=3)
    unit = _unit(sr)
    for v, xi, yi in zip(sr.series.level_values, x, y):
        ax.annotate(f"{v:g} {unit}", (xi, yi), textcoords="offset points", xytext=(6, -14), fontsize=9)
    lv = sr.series.level_values
    budget = sr.choices.get("budget")
    if budget is not None:
        ax.axvline(budget.params["max_slowdown"] * 100, color="tab:red", ls=":", lw=1,
                   label=f"slowdown budget {slowdown_text(budget.params['max_slowdown'])}")
    if sr.starred:
        _policy_markers(ax, sr, x, y, unit)
        rec = sr.recommendation
        ri = int(np.flatnonzero(lv == rec.level_value)[0])
        ax.plot([x[ri]], [y[ri]], "o", color="tab:red", ms=5, gid="recommended", zorder=5)
    ax.margins(y=0.18)
    ax.set_xlabel("speed loss vs reference (%)", fontsize=10)
    ax.set_ylabel("energy saving per token vs reference (%)", fontsize=10)
    ax.set_title(_unmarked(sr, f"Energy saving vs speed loss (concurrency {sr.series.concurrency}; reference "
                                f"{sr.series.reference_value:g} {unit})"), fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    _save(fig, path, sr)
    return fig


def plot_timeline(tl: Timeline, path: Path, level_unit: str = "W", idle_power_w: float | None = None,
                  idle_by_device_w: dict | None = None) -> Figure:
    """Power and SM clock over the run, each level's stretch shaded and named with its unit; the idle
    baseline (measured before the first level) as a labelled line, one per GPU where there are several
    (idle_by_device_w: {gpuN: W}). The lines are each GPU's power: the baseline of all GPUs together is
    no GPU's, and a run without the per-GPU figures (written before them) draws none there."""
    fig = _figure(10.0, 5.5)
    ax_p, ax_f = fig.subplots(2, 1, sharex=True)
    for d, dev in enumerate(tl.devices):
        for ax, y in ((ax_p, tl.power_w[d]), (ax_f, tl.sm_clock_mhz[d])):
            ok = np.isfinite(y)
            ax.plot(tl.t_s[ok], y[ok], lw=0.8, label=dev)
    lvl = tl.level_value
    # Shade each contiguous stretch of one level and name it, so a reader sees which limit did what.
    change = np.flatnonzero(np.diff(np.nan_to_num(lvl, nan=-1.0)) != 0) + 1
    edges = np.concatenate([[0], change, [lvl.size]])
    width = tl.t_s[1] - tl.t_s[0] if tl.t_s.size > 1 else 1.0
    for k, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        x0, x1 = tl.t_s[a] - width / 2, tl.t_s[b - 1] + width / 2
        if not np.isfinite(lvl[a]):
            if k == 0 and len(edges) > 2:  # before the first level: the idle baseline
                ax_p.text((x0 + x1) / 2, 1.0, "idle", transform=ax_p.get_xaxis_transform(), ha="center",
                          va="bottom", fontsize=9, color="tab:green")
            continue
        for ax in (ax_p, ax_f):
            ax.axvspan(x0, x1, color="0.85" if k % 2 else "0.93", zorder=0)
        ax_p.text((x0 + x1) / 2, 1.0, f"{lvl[a]:g} {level_unit}", transform=ax_p.get_xaxis_transform(),
                  ha="center", va="bottom", fontsize=9)
    if len(tl.devices) > 1:
        baselines = [(f"{d} idle baseline", (idle_by_device_w or {}).get(d)) for d in tl.devices]
    else:
        baselines = [("idle baseline", idle_power_w)]
    for label, w in baselines:
        if w is not None and np.isfinite(w):
            ax_p.axhline(w, color="tab:green", ls="--", lw=1, gid="idle-baseline", label=f"{label} {w:.0f} W")
    ax_p.set_ylabel("GPU power (W)", fontsize=10)
    ax_f.set_ylabel("SM clock (MHz)", fontsize=10)
    ax_f.set_xlabel("time since the run's first sample (s)", fontsize=10)
    ax_p.set_title(f"Power and SM clock over time, per level (run {tl.run_id})", pad=18, fontsize=11)
    for ax in (ax_p, ax_f):
        ax.grid(alpha=0.3)
    if len(tl.devices) > 1 or idle_power_w is not None:
        ax_p.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    _save(fig, path)
    return fig


def _unit(sr: SeriesResult) -> str:
    return "MHz" if sr.series.level_kind == "sm_clock" else "W"


def _arr(t, name) -> np.ndarray:
    return np.asarray(t.column(name).to_numpy(zero_copy_only=False), dtype=float)


def _ratio_fit(num, den):
    """J/token from the power and throughput fits (power ÷ tok/s), or None where either failed."""
    if not (num.ok and den.ok):
        return None
    return lambda x: num.predict(x) / den.predict(x)


def plot_knob_heatmap(result, x: str, y: str, path: Path, context=None) -> Figure:
    """J/token and decode tok/s over two knobs (analysis/knobs.py), side by side; configurations
    that were not measured are marked with their status instead of a colour."""
    from .knobs import heatmap_grid

    fig = _figure(11.0, 4.8)
    fixed = {}
    for k, (metric, title, cmap, fmt) in enumerate((("j", "GPU J/token", "viridis_r", ".3f"),
                                                    ("tok", "decode tok/s", "viridis", ".1f"))):
        xs, ys, val, status, fixed = heatmap_grid(result, x, y, metric, context)
        ax = fig.add_subplot(1, 2, k + 1)
        im = ax.imshow(np.ma.masked_invalid(val), cmap=cmap, origin="lower", aspect="auto")
        fig.colorbar(im, ax=ax, shrink=0.85)
        ax.set_xticks(range(len(xs)), [str(v) for v in xs])
        ax.set_yticks(range(len(ys)), [str(v) for v in ys])
        ax.set_xlabel(x, fontsize=11)
        ax.set_ylabel(y, fontsize=11)
        ax.set_title(title, fontsize=12)
        for i in range(len(ys)):
            for j in range(len(xs)):
                text = format(val[i, j], fmt) if np.isfinite(val[i, j]) else {
                    "out-of-memory": "OOM", "failed-to-start": "no start", "failed": "failed", "": ""}.get(status[i, j], status[i, j])
                if status[i, j] == "left-out":  # figures not its own (knobs.py): shown, never chosen
                    text += "\n(left out)"
                if np.isfinite(val[i, j]):
                    r, g, b, _ = im.cmap(im.norm(val[i, j]))
                    color = "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"  # readable on the cell
                else:
                    color = "tab:red"
                ax.text(j, i, text, ha="center", va="center", fontsize=9, color=color, gid=f"cell-{metric}-{i}-{j}")
    suffix = ", ".join(f"{k}={v}" for k, v in fixed.items())
    ctx = "" if context is None else f" at {context} context tokens"
    fig.suptitle(f"configurations{ctx}" + (f" ({suffix})" if suffix else ""), fontsize=12)
    fig.tight_layout()
    _save(fig, path)
    return fig
