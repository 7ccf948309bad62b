"""Analysis across server configurations: J/token and tok/s per configuration, the fastest, the most efficient within a slowdown budget, the Pareto set, warnings.

Input is a configuration sweep's levels table (one row per configuration, context length and
level; `knob_<name>` columns). Configurations are compared at their reference level (the default
power limit, else the highest measured; or the settings as they were when no levels were
stepped), so a power limit never masquerades as a better configuration; the sweet-spot power
limit of the chosen configuration comes from the ordinary analysis of its own levels. A
configuration whose compared figures are not its own effect (analyze.left_out_reason: thermal
throttling, interrupted, energy counter rounding, ...) stays in the tables but is never chosen,
named, or fastest: the choice falls to the best of the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from powerprof.storage.schema import KNOB_PREFIX

from .analyze import left_out_reason
from .checks import Finding
from .stats import WIDE_CI_PCT
from .sweetspot import slowdown_text


@dataclass(frozen=True)
class ConfigPoint:
    """One configuration at one context length, at its reference level."""

    config_id: str
    knobs: dict
    context_tokens: int | None
    status: str
    level_value: float | None
    tok_s: float | None = None
    tok_s_ci: tuple[float | None, float | None] = (None, None)
    j_per_token: float | None = None
    j_ci: tuple[float | None, float | None] = (None, None)
    ci_pct: float | None = None
    acceptance: float | None = None
    error: str | None = None
    left_out: str | None = None  # why its figures may not be chosen on (analyze.left_out_reason)
    level_kind: str | None = None

    @property
    def measured(self) -> bool:
        return self.status == "ok" and self.tok_s is not None and self.j_per_token is not None

    @property
    def eligible(self) -> bool:
        """Measured, and its figures are the configuration's effect: it may be chosen."""
        return self.measured and self.left_out is None

    def cell(self) -> str:
        """`draft=3,np=1 @ 8192 tokens at 300 W`: the configuration × level the figures are from."""
        unit = "MHz" if self.level_kind == "sm_clock" else "W"
        return self.label() + (" as is" if self.level_value is None else f" at {self.level_value:g} {unit}")

    def label(self) -> str:
        return self.config_id + (f" @ {self.context_tokens} tokens" if self.context_tokens is not None else "")

    def to_dict(self) -> dict:
        return {"config_id": self.config_id, "knobs": self.knobs, "context_tokens": self.context_tokens,
                "status": self.status, "level_value": self.level_value, "decode_tok_s": self.tok_s,
                "gpu_j_per_token": self.j_per_token, "ci_reached_pct": self.ci_pct,
                "draft_acceptance": self.acceptance, "left_out": self.left_out}


@dataclass
class KnobResult:
    points: list[ConfigPoint]
    knob_names: list[str]
    max_slowdown: float
    by_context: dict = field(default_factory=dict)  # context → {"fastest", "efficient", "min_j", "pareto"}
    warnings: list[Finding] = field(default_factory=list)
    not_chosen: dict = field(default_factory=dict)  # context → why no configuration was chosen there

    @property
    def left_out(self) -> list[ConfigPoint]:
        return [p for p in self.points if p.measured and p.left_out]

    @property
    def chosen(self) -> ConfigPoint | None:
        """The J/token-optimal measured configuration (at the shortest context when several were swept)."""
        if not self.by_context:
            return None
        first = sorted(self.by_context, key=lambda c: -1 if c is None else c)[0]
        return self.by_context[first]["min_j"]

    def to_dict(self) -> dict:
        return {
            "knobs": self.knob_names,
            "max_slowdown": self.max_slowdown,
            "points": [p.to_dict() for p in self.points],
            "choices": [
                {"context_tokens": c, **{k: (v.config_id if isinstance(v, ConfigPoint) else [p.config_id for p in v])
                                         for k, v in d.items()}}
                for c, d in self.by_context.items()
            ],
            "chosen": self.chosen.config_id if self.chosen else None,
            "left_out": [{"config_id": p.config_id, "context_tokens": p.context_tokens, "level_value": p.level_value,
                          "level_kind": p.level_kind, "why": p.left_out} for p in self.left_out],
            "not_chosen": [{"context_tokens": c, "why": why} for c, why in self.not_chosen.items()],
            "warnings": [w.to_dict() for w in self.warnings],
        }


def is_grid(levels: pa.Table) -> bool:
    return "config_id" in levels.column_names and any(v is not None for v in levels.column("config_id").to_pylist())


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and not np.isfinite(x)) else float(x)


def config_points(levels: pa.Table, interrupted=frozenset()) -> list[ConfigPoint]:
    """One point per (configuration, context), at the reference row (else the highest level).

    interrupted: {(config_id, context_tokens, level)} the sweep stopped while measuring
    (analyze.interrupted_cells); such a point, like a throttled one, is left out of the choice."""
    rows = levels.to_pylist()
    knob_cols = [c for c in levels.column_names if c.startswith(KNOB_PREFIX)]
    groups: dict = {}
    for r in rows:
        if r.get("config_id") is None:
            continue
        groups.setdefault((r["config_id"], r.get("context_tokens")), []).append(r)
    out = []
    for (cid, ctx), rs in groups.items():
        knobs = {c[len(KNOB_PREFIX):]: rs[0].get(c) for c in knob_cols}
        measured = [r for r in rs if r.get("gpu_j_per_token") is not None and r.get("decode_tok_s") is not None]
        status = next((r.get("config_status") for r in rs if r.get("config_status") not in (None, "ok")), "ok")
        error = next((r.get("config_error") for r in rs if r.get("config_error")), None)
        if not measured:
            out.append(ConfigPoint(cid, knobs, ctx, status if status != "ok" else "failed", None, error=error))
            continue
        ref = next((r for r in measured if r.get("reference")), None) or max(
            measured, key=lambda r: -1.0 if r.get("level_value") is None else r["level_value"])
        out.append(ConfigPoint(
            cid, knobs, ctx, status, _num(ref.get("level_value")), _num(ref["decode_tok_s"]),
            (_num(ref.get("decode_tok_s_ci_low")), _num(ref.get("decode_tok_s_ci_high"))), _num(ref["gpu_j_per_token"]),
            (_num(ref.get("gpu_j_per_token_ci_low")), _num(ref.get("gpu_j_per_token_ci_high"))),
            _num(ref.get("ci_reached_pct")), _num(ref.get("draft_acceptance")), error,
            left_out_reason(ref, (cid, ctx, _num(ref.get("level_value"))) in interrupted), ref.get("level_kind")))
    return out


def pareto(points: list[ConfigPoint]) -> list[ConfigPoint]:
    """Eligible points no other beats on both speed (higher) and J/token (lower), fastest first."""
    m = [p for p in points if p.eligible]
    keep = [p for p in m if not any(q.tok_s >= p.tok_s and q.j_per_token <= p.j_per_token
                                    and (q.tok_s > p.tok_s or q.j_per_token < p.j_per_token) for q in m)]
    return sorted(keep, key=lambda p: -p.tok_s)


def choose(points: list[ConfigPoint], max_slowdown: float) -> dict | None:
    """fastest, efficient (least J/token within max_slowdown of the fastest), min_j and pareto among
    the eligible points; None when none is."""
    m = [p for p in points if p.eligible]
    if not m:
        return None
    fastest = max(m, key=lambda p: p.tok_s)
    within = [p for p in m if p.tok_s >= (1 - max_slowdown) * fastest.tok_s]
    return {"fastest": fastest, "efficient": min(within, key=lambda p: p.j_per_token),
            "min_j": min(m, key=lambda p: p.j_per_token), "pareto": pareto(m)}


def _overlap(a: tuple, b: tuple) -> bool:
    if None in a or None in b:
        return False
    return a[0] <= b[1] and b[0] <= a[1]


def ineffective_knobs(points: list[ConfigPoint], names: list[str]) -> list[str]:
    """Knobs whose values measured alike: among eligible points differing only in that knob (same
    context, other knobs equal), every pair's J/token and tok/s CIs overlap. A server that ignores a
    flag (misspelled, unsupported by this build) looks like this, as does a knob that does not
    matter at this load; either way the choice among its values is noise."""
    out = []
    for name in names:
        groups: dict = {}
        for p in points:
            if p.eligible:
                rest = tuple(sorted((k, str(v)) for k, v in p.knobs.items() if k != name))
                groups.setdefault((p.context_tokens, rest), []).append(p)
        compared = [g for g in groups.values() if len({str(p.knobs.get(name)) for p in g}) >= 2]
        if compared and all(_overlap(a.j_ci, b.j_ci) and _overlap(a.tok_s_ci, b.tok_s_ci)
                            for g in compared for i, a in enumerate(g) for b in g[i + 1:]):
            out.append(name)
    return out


def knob_findings(points: list[ConfigPoint], by_context: dict, knob_values: dict, wide_ci_pct: float = WIDE_CI_PCT) -> list[Finding]:
    out = []
    same = ineffective_knobs(points, list(knob_values))
    for name in same:
        out.append(Finding("knob-no-effect", f"{name} made no difference the measurement could see: configurations "
                           f"differing only in {name} have J/token and tok/s within each other's 95% CI, so which "
                           f"{name} value is chosen is noise. Either it does not matter at this load (slots at "
                           "--concurrency 1), or the server ignores it (a misspelled or unsupported flag in --launch: "
                           "check its log in server-logs/ for the value)."))
    bad = [p for p in points if not p.measured]
    for status in sorted({p.status for p in bad}):
        ids = sorted({p.config_id for p in bad if p.status == status})
        what = {"out-of-memory": "ran out of memory at start (did not fit)", "failed-to-start": "failed to start",
                "failed": "failed while being measured"}.get(status, status)
        out.append(Finding("config-not-measured", f"{len(ids)} configuration(s) {what}: {'; '.join(ids)}. "
                           "Their log tails are in levels.parquet (config_error) and run.json."))
    wide = [p for p in points if p.measured and p.ci_pct is not None and p.ci_pct > wide_ci_pct]
    if wide:
        out.append(Finding("wide-ci", f"J/token CI wider than ±{wide_ci_pct:g}% for {', '.join(p.label() for p in wide)}: "
                           "their ranking is uncertain; measure more requests (--max-requests, --target-ci)."))
    for ctx, d in by_context.items():
        best = d["min_j"]
        for name, val in best.knobs.items():
            vals = knob_values.get(name) or []
            nums = [v for v in vals if isinstance(v, (int, float))]
            if len(nums) >= 2 and val in (min(nums), max(nums)) and name not in same:
                out.append(Finding("edge", f"the most efficient configuration ({best.label()}) sits at the edge of "
                                   f"{name} ({'/'.join(map(str, vals))}): a value beyond it might be better; extend --vary {name}."))
        rivals = [p for p in by_context[ctx]["pareto"] if p is not best and p.eligible and _overlap(p.j_ci, best.j_ci)]
        rivals += [p for p in points if p.eligible and p.context_tokens == ctx and p is not best
                   and p not in rivals and _overlap(p.j_ci, best.j_ci)]
        if rivals:
            out.append(Finding("not-distinguishable", f"J/token of {best.label()} is within the 95% CI of "
                               f"{', '.join(p.config_id for p in rivals[:4])}: the data cannot tell them apart."))
    return out


def analyze_knobs(levels: pa.Table, max_slowdown: float = 0.10, wide_ci_pct: float = WIDE_CI_PCT,
                  interrupted=frozenset()) -> KnobResult:
    points = config_points(levels, interrupted)
    names = [c[len(KNOB_PREFIX):] for c in levels.column_names if c.startswith(KNOB_PREFIX)]
    values = {n: list(dict.fromkeys(v for v in levels.column(KNOB_PREFIX + n).to_pylist() if v is not None)) for n in names}
    by_context, not_chosen = {}, {}
    for ctx in sorted({p.context_tokens for p in points}, key=lambda c: -1 if c is None else c):
        at = [p for p in points if p.context_tokens == ctx]
        d = choose(at, max_slowdown)
        if d is not None:
            by_context[ctx] = d
        elif any(p.measured for p in at):
            not_chosen[ctx] = "every measured configuration is left out (" + "; ".join(
                f"{p.cell()}: {p.left_out}" for p in at if p.measured) + ")"
        else:
            not_chosen[ctx] = "no configuration was measured"
    res = KnobResult(points, names, max_slowdown, by_context, not_chosen=not_chosen)
    res.warnings = knob_findings(points, by_context, values, wide_ci_pct)
    return res


def heatmap_axes(result: KnobResult) -> tuple[str, str] | None:
    """The two knobs with the most values (in sweep order), or None with fewer than two."""
    counts = {n: len({p.knobs.get(n) for p in result.points}) for n in result.knob_names}
    two = [n for n in result.knob_names if counts[n] > 1][:2]
    return (two[0], two[1]) if len(two) == 2 else None


def heatmap_grid(result: KnobResult, x: str, y: str, metric: str, context=None):
    """(x values, y values, matrix of the metric, matrix of status) for one context; other knobs at the best point's value."""
    pts = [p for p in result.points if p.context_tokens == context]
    # Nothing chosen there (all left out): hold the other knobs at the first measured point's values.
    chosen = result.by_context.get(context, {}).get("min_j") or next((p for p in pts if p.measured), None)
    fixed = {k: v for k, v in (chosen.knobs if chosen else {}).items() if k not in (x, y)}
    pts = [p for p in pts if all(p.knobs.get(k) == v for k, v in fixed.items())]
    xs = sorted({p.knobs.get(x) for p in pts}, key=_sort_key)
    ys = sorted({p.knobs.get(y) for p in pts}, key=_sort_key)
    val = np.full((len(ys), len(xs)), np.nan)
    status = np.full((len(ys), len(xs)), "", dtype=object)
    for p in pts:
        i, j = ys.index(p.knobs.get(y)), xs.index(p.knobs.get(x))
        status[i, j] = p.status if not p.measured else "ok" if p.eligible else "left-out"
        if p.measured:
            val[i, j] = p.j_per_token if metric == "j" else p.tok_s
    return xs, ys, val, status, fixed


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


def markdown_lines(result: KnobResult) -> list[str]:
    """The configuration section of report.md."""
    head = ["configuration", "context", "status", "level", "tok/s", "J/token", "±CI%", "acceptance", "chosen",
            "never chosen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result.points:
        tags = [k for k, d in result.by_context.get(p.context_tokens, {}).items()
                if k != "pareto" and d is p] + (["pareto"] if p in result.by_context.get(p.context_tokens, {}).get("pareto", []) else [])
        cells = [p.config_id, "–" if p.context_tokens is None else str(p.context_tokens), p.status,
                 "as is" if p.level_value is None else f"{p.level_value:g}",
                 _f(p.tok_s, ".1f"), _f(p.j_per_token, ".3f"), _f(p.ci_pct, ".1f"),
                 "–" if p.acceptance is None else f"{100 * p.acceptance:.0f}%", ", ".join(tags),
                 (p.left_out or "") if p.measured else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary_lines(result: KnobResult) -> list[str]:
    out = []
    for ctx, d in result.by_context.items():
        at = "" if ctx is None else f" at {ctx} context tokens"
        out.append(f"Fastest configuration{at}: {d['fastest'].config_id} ({d['fastest'].tok_s:.1f} tok/s, "
                   f"{d['fastest'].j_per_token:.3f} J/token).")
        out.append(f"Most efficient{at}: {d['min_j'].config_id} ({d['min_j'].j_per_token:.3f} J/token, "
                   f"{d['min_j'].tok_s:.1f} tok/s); within a {slowdown_text(result.max_slowdown)} slowdown of the fastest: "
                   f"{d['efficient'].config_id}.")
        out.append("Pareto set (fastest first): " + ", ".join(p.config_id for p in d["pareto"]) + ".")
    for ctx, why in result.not_chosen.items():
        out.append(f"No configuration chosen{'' if ctx is None else f' at {ctx} context tokens'}: {why}.")
    return out


def left_out_text(left_out: dict[str, str], advice: str = "") -> str:
    """The sentence naming what no choice may fall on ({name: why}: power levels or configurations), with
    `advice` after; '' when none."""
    if not left_out:
        return ""
    return ("Never chosen, whatever their figures: " + ", ".join(f"{name} ({why})" for name, why in left_out.items())
            + (f"; {advice}" if advice else "") + ".")


def _f(x, fmt) -> str:
    return "–" if x is None else format(x, fmt)
