"""Sweet-spot policies: which level each efficiency criterion picks, with a bootstrap CI of the choice.

Every policy is a pure function over arrays of tok/s `T` and J/token `E` with the levels on the
last axis, so the same code scores the point estimates, each bootstrap replicate (resampled
requests) and a dense PCHIP grid between the measured levels:

- min_energy: argmin E
- budget:     argmin E subject to speed loss 1 − T/T_ref ≤ max_slowdown
- edp:        argmin E·(1/T)      (energy × delay per token)
- ed2p:       argmin E·(1/T)²
- knee:       argmax ŝ − l̂ on the energy-saving vs speed-loss curve, both scaled to [0, 1] (Kneedle)
- weighted:   argmin η·E + (1−η)·P_max/T   (time priced at the card's maximum power)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .fits import pchip_grid
from .stats import LevelSeries

POLICIES = ("min_energy", "budget", "edp", "ed2p", "knee", "weighted")
PRIMARY_POLICY = "budget"

DESCRIPTIONS = {
    "min_energy": "least J/token",
    "budget": "least J/token within the slowdown budget",
    "edp": "least energy-delay product (J/token × s/token)",
    "ed2p": "least energy-delay² product (J/token × (s/token)²)",
    "knee": "knee of energy saving vs speed loss",
    "weighted": "least weighted cost η·E + (1−η)·P_max/T",
}


def check_max_slowdown(v: float) -> float:
    """The one rule for a slowdown budget (the API's PolicyParams, and `sweep` and `analyze`'s --max-slowdown):
    a share of the reference level's speed from 0 (no slowdown at all) up to, not including, 100%."""
    if not 0 <= v < 1:
        raise ValueError(f"max slowdown must be from 0 up to, not including, 100% (e.g. 10% or 0.1), got {v:g}")
    return v


def slowdown_text(share: float) -> str:
    """A slowdown budget as a percentage with the digits it was given: 0.1 → "10%", 0.999 → "99.9%" (":.0%" printed
    0.999 as "100%", a budget no level could break, and 0.125 as "12%")."""
    pct = share * 100
    for digits in range(6, 16):  # more where six round a budget under 100% up to it (0.9999999), or above 0 to it
        text = f"{pct:.{digits}f}".rstrip("0").rstrip(".")  # fixed notation: 1e-9 read "1e-07%"
        if (float(text) == 100) == (pct == 100) and (float(text) == 0) == (pct == 0):  # 100% and 0% only when so
            break
    return f"{text}%"


def loss_text(loss_pct: float, max_slowdown: float | None, digits: int = 1) -> str:
    """A speed loss in % at `digits` decimals, more where those would put it on the other side of the slowdown budget
    than it is (the budget policy's test, choose_budget's: loss ≤ max_slowdown + 1e-12): 10.0396 → "10.04" under
    a 10% budget, where "10.0" read as within it beside a level left out as over it. No budget: `digits` alone."""
    text = f"{loss_pct:.{digits}f}"
    if max_slowdown is None or not np.isfinite(loss_pct):
        return text
    over = loss_pct / 100 > max_slowdown + 1e-12
    for d in range(digits, 16):
        text = f"{loss_pct:.{d}f}"
        if (float(text) / 100 > max_slowdown) == over:
            break
    return text


@dataclass(frozen=True)
class PolicyParams:
    max_slowdown: float = 0.10  # fraction
    eta: float = 0.5
    p_max_w: float | None = None  # prices time in the weighted cost; default: the highest level's power

    def __post_init__(self):
        check_max_slowdown(self.max_slowdown)
        if not 0 <= self.eta <= 1:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")


@dataclass(frozen=True)
class Choice:
    """One policy's sweet spot in one series of levels."""

    policy: str
    level_value: float  # the measured level chosen on the point estimates
    ci_low: float  # 2.5% / 97.5% quantiles of the level chosen across bootstrap replicates
    ci_high: float
    stability: float  # share of replicates that chose level_value
    recommended_value: float  # a setting the card accepts: whole W (or MHz) inside its range
    interpolated_value: float | None  # the same policy on the PCHIP curve between levels
    decode_tok_s: float
    gpu_j_per_token: float
    speed_loss_pct: float
    energy_saving_pct: float
    at_low_edge: bool  # the lowest measured level: the optimum may lie below
    at_high_edge: bool
    level_kind: str = "power_limit"
    concurrency: int = 1
    params: dict = field(default_factory=dict)
    # Levels no policy may choose, with why ({level: "thermal throttling"}): their figures are not
    # the setting's effect (heat, a limit that never bound, a level cut short); shown, never chosen.
    left_out: dict = field(default_factory=dict)

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.policy]

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["left_out"] = [{"level_value": v, "why": why} for v, why in self.left_out.items()]
        d["description"] = self.description
        return d


# --- the policies as array functions -------------------------------------------------------


def _safe_argmin(x: np.ndarray) -> np.ndarray:
    return np.argmin(np.where(np.isfinite(x), x, np.inf), axis=-1)


def policy_index(policy: str, tok_s: np.ndarray, j: np.ndarray, ref: int, params: PolicyParams) -> np.ndarray:
    """Index of the chosen level along the last axis, for every leading index."""
    t = np.asarray(tok_s, dtype=float)
    e = np.asarray(j, dtype=float)
    if policy == "min_energy":
        return _safe_argmin(e)
    if policy == "budget":
        loss = 1.0 - t / t[..., ref : ref + 1]
        # A tiny tolerance keeps a level whose loss equals the budget to the printed digit.
        return _safe_argmin(np.where(loss <= params.max_slowdown + 1e-12, e, np.inf))
    if policy == "edp":
        return _safe_argmin(e / t)
    if policy == "ed2p":
        return _safe_argmin(e / t**2)
    if policy == "knee":
        loss = 1.0 - t / t[..., ref : ref + 1]
        saving = 1.0 - e / e[..., ref : ref + 1]
        lmax = np.nanmax(np.where(np.isfinite(loss), loss, np.nan), axis=-1, keepdims=True)
        smax = np.nanmax(np.where(np.isfinite(saving), saving, np.nan), axis=-1, keepdims=True)
        ln = np.divide(loss, lmax, out=np.zeros_like(loss), where=lmax > 0)
        sn = np.divide(saving, smax, out=np.zeros_like(saving), where=smax > 0)
        score = np.where(np.isfinite(sn - ln), sn - ln, -np.inf)
        idx = np.argmax(score, axis=-1)
        # No saving anywhere, or none that outruns its loss (two levels, or savings and losses in proportion: every
        # score 0, and the tie went to the lowest level, a "knee" that was only the first index): the reference.
        knee = (np.squeeze(smax, -1) > 0) & (np.max(score, axis=-1) > 1e-9)
        return np.where(knee, idx, ref)
    if policy == "weighted":
        p_max = params.p_max_w
        if p_max is None:
            raise ValueError("the weighted policy needs p_max_w")
        return _safe_argmin(params.eta * e + (1 - params.eta) * p_max / t)
    raise ValueError(f"unknown policy {policy!r}; choose one of: {', '.join(POLICIES)}")


# --- choices ---------------------------------------------------------------------------------


def accepted_value(value: float, min_value: float | None = None, max_value: float | None = None) -> float:
    """A setting the card takes: whole W (or MHz), clipped into its allowed range."""
    v = float(np.round(value))
    if min_value is not None:
        v = max(v, float(np.ceil(min_value)))
    if max_value is not None:
        v = min(v, float(np.floor(max_value)))
    return v


def choose(
    series: LevelSeries,
    policy: str,
    params: PolicyParams | None = None,
    card_range: tuple[float | None, float | None] = (None, None),
    ci: float = 0.95,
    left_out: dict | None = None,
) -> Choice:
    """One policy's choice among the measured levels of a series, with its bootstrap CI.

    left_out: {level value: why} for levels that may not be chosen (the reference always may): they
    are taken out of the point estimates, every replicate and the interpolation alike."""
    params = _with_p_max(params or PolicyParams(), series)
    lv = series.level_values
    left_out = {float(v): why for v, why in (left_out or {}).items() if float(v) != series.reference_value}
    series = _without(series, left_out)
    i = int(policy_index(policy, series.tok_s, series.j_per_token, series.ref_index, params))
    boot = policy_index(policy, series.boot_tok_s, series.boot_j_per_token, series.ref_index, params)
    # Replicates are judged over the levels with figures: a level with none (every request failed,
    # no energy) has NaN in every replicate, and requiring all levels finite left no replicate at
    # all, so the CI collapsed onto the point choice at 100% stability (a fake certainty).
    usable = np.isfinite(series.tok_s) & np.isfinite(series.j_per_token)
    valid = (np.isfinite(series.boot_tok_s[:, usable]).all(axis=1)
             & np.isfinite(series.boot_j_per_token[:, usable]).all(axis=1))
    picked = lv[boot[valid]] if valid.any() else np.array([lv[i]])
    q = (1 - ci) / 2
    lo, hi = np.quantile(picked, [q, 1 - q], method="inverted_cdf")
    interp = _interpolated(series, policy, params)
    return Choice(
        policy=policy,
        level_value=float(lv[i]),
        ci_low=float(lo),
        ci_high=float(hi),
        stability=float(np.mean(picked == lv[i])),
        recommended_value=accepted_value(lv[i], *card_range),
        interpolated_value=None if interp is None else accepted_value(interp, *card_range),
        decode_tok_s=float(series.tok_s[i]),
        gpu_j_per_token=float(series.j_per_token[i]),
        speed_loss_pct=float(series.speed_loss()[i] * 100),
        energy_saving_pct=float(series.energy_saving()[i] * 100),
        at_low_edge=bool(i == int(np.argmin(lv))) and lv.size > 1,
        at_high_edge=bool(i == int(np.argmax(lv))) and lv.size > 1,
        level_kind=series.level_kind,
        concurrency=series.concurrency,
        params={"max_slowdown": params.max_slowdown, "eta": params.eta, "p_max_w": params.p_max_w},
        left_out={v: left_out[v] for v in sorted(left_out) if np.isin(v, lv)},
    )


def _without(series: LevelSeries, left_out: dict) -> LevelSeries:
    """The series with the left-out levels' figures NaN, so no policy, replicate or curve can pick them."""
    drop = np.isin(series.level_values, list(left_out))
    if not drop.any():
        return series
    nan = lambda a: np.where(drop, np.nan, a)  # noqa: E731  (broadcasts over the replicates' rows)
    return replace(series, tok_s=nan(series.tok_s), j_per_token=nan(series.j_per_token),
                   boot_tok_s=nan(series.boot_tok_s), boot_j_per_token=nan(series.boot_j_per_token))


def _with_p_max(params: PolicyParams, series: LevelSeries) -> PolicyParams:
    if params.p_max_w is not None:
        return params
    p = series.power_w[np.isfinite(series.power_w)]
    p_max = float(p.max()) if p.size else float(np.nanmax(series.j_per_token * series.tok_s))
    return PolicyParams(params.max_slowdown, params.eta, p_max)


def _interpolated(series: LevelSeries, policy: str, params: PolicyParams) -> float | None:
    """The policy on the monotone interpolant between levels (1 unit steps): where to measure next."""
    lv = series.level_values
    ok = np.isfinite(series.tok_s) & np.isfinite(series.j_per_token)
    if ok.sum() < 2:
        return None
    grid = np.union1d(np.arange(np.ceil(lv[ok].min()), np.floor(lv[ok].max()) + 1), lv[ok])
    t = pchip_grid(lv[ok], series.tok_s[ok], grid)
    e = pchip_grid(lv[ok], series.j_per_token[ok], grid)
    ref = int(np.flatnonzero(grid == series.reference_value)[0]) if ok[series.ref_index] else int(np.argmax(grid))
    return float(grid[int(policy_index(policy, t, e, ref, params))])


def choose_all(
    series: LevelSeries,
    params: PolicyParams | None = None,
    card_range: tuple[float | None, float | None] = (None, None),
    policies=POLICIES,
    left_out: dict | None = None,
) -> dict[str, Choice]:
    return {p: choose(series, p, params, card_range, left_out=left_out) for p in policies}
