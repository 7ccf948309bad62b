"""Curves through the levels: a monotone interpolant (PCHIP) and saturating parametric models (curve_fit).

The parametric models have few parameters because a sweep has few levels, and saturate because
a limit above what the card draws changes nothing:

    power_limit:  P(L) = smin(k·L, P_nat)                       (2 parameters)
                  T(L) = T_max · (smin(L, L_sat) / L_sat)^α      (3 parameters)
    sm_clock:     P(f) = P_0 + P_1·(f/f_ref)³                    (dynamic power ~ V²f, V ~ f)
                  T(f) = T_max / ((1 − c) + c·f_ref/f)           (memory part fixed, compute part ~ 1/f)

smin is a smooth minimum (softness 1% of the level range), so the fits have gradients everywhere.
J/token follows as P/T. Goodness of fit: R², RMSE and the residual at each level; parameter
uncertainty: the square root of the covariance diagonal from curve_fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.interpolate import PchipInterpolator
from scipy.optimize import curve_fit


def pchip_grid(x, y, grid) -> np.ndarray:
    """Monotone piecewise-cubic interpolation of y(x) on `grid`, no overshoot between levels.

    Outside the measured range the curve is held at its end values: PCHIP extrapolates badly."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    order = np.argsort(x)
    x, y = x[order], y[order]
    g = np.clip(np.asarray(grid, dtype=float), x[0], x[-1])
    if x.size == 1:
        return np.full(g.shape, y[0])
    return PchipInterpolator(x, y, extrapolate=False)(g)


def smooth_min(a, b, softness):
    """min(a, b), rounded over a width of `softness`: log-sum-exp of the negatives."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    return -softness * np.logaddexp(-a / softness, -b / softness)


@dataclass(frozen=True)
class ModelFit:
    """A fitted curve with its uncertainty and goodness of fit; `ok` False says why not in `message`."""

    quantity: str  # decode_tok_s | avg_gpu_power_w
    model: str
    ok: bool
    message: str = ""
    params: dict = field(default_factory=dict)
    stderr: dict = field(default_factory=dict)
    r2: float | None = None
    rmse: float | None = None
    residuals: tuple[float, ...] = ()
    x: tuple[float, ...] = ()
    softness: float = 1.0

    def predict(self, x) -> np.ndarray:
        if not self.ok:
            return np.full(np.shape(x), np.nan)
        return MODELS[self.model][0](np.asarray(x, dtype=float), *self.params.values(), softness=self.softness)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _power_limit_power(L, k, p_nat, softness=1.0):
    return smooth_min(k * L, p_nat, softness)


def _power_limit_tok(L, t_max, l_sat, alpha, softness=1.0):
    return t_max * (np.maximum(smooth_min(L, l_sat, softness), 1e-9) / l_sat) ** alpha


def _clock_power(f, p0, p1, f_ref=1.0, softness=1.0):
    return p0 + p1 * (f / f_ref) ** 3


def _clock_tok(f, t_max, c, f_ref=1.0, softness=1.0):
    return t_max / ((1 - c) + c * f_ref / f)


# name → (function, parameter names)
MODELS = {
    "saturating_power": (_power_limit_power, ("k", "p_nat_w")),
    "saturating_power_law": (_power_limit_tok, ("t_max_tok_s", "l_sat_w", "alpha")),
    "cubic_clock_power": (_clock_power, ("p0_w", "p1_w", "f_ref_mhz")),
    "step_time": (_clock_tok, ("t_max_tok_s", "compute_share", "f_ref_mhz")),
}


def fit_curve(quantity: str, level_kind: str, x, y, sigma=None) -> ModelFit:
    """Fit the model of `quantity` (decode_tok_s or avg_gpu_power_w) for a level kind."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    s = None if sigma is None else np.asarray(sigma, dtype=float)
    if s is not None:
        ok &= np.isfinite(s) & (s > 0)
    x, y = x[ok], y[ok]
    s = None if s is None else s[ok]
    if level_kind == "sm_clock":
        model = "step_time" if quantity == "decode_tok_s" else "cubic_clock_power"
    else:
        model = "saturating_power_law" if quantity == "decode_tok_s" else "saturating_power"
    fn, names = MODELS[model]
    n_free = 3 if model == "saturating_power_law" else 2
    if np.unique(x).size < n_free + 1:
        n = np.unique(x).size
        return ModelFit(quantity, model, False,
                        f"{n} level{'s' if n != 1 else ''}: the {model} model needs at least {n_free + 1}")
    span = float(x.max() - x.min())
    softness = max(span * 0.01, 1e-6)
    f_ref = float(x.max())
    if model == "saturating_power":
        p0, bounds = [1.0, float(y.max())], ([0.3, 0.0], [1.5, 10 * float(y.max())])
    elif model == "saturating_power_law":
        p0 = [float(y.max()), float(x.max()), 0.3]
        bounds = ([0.0, float(x.min()) * 0.5, 0.0], [10 * float(y.max()), float(x.max()) * 3, 3.0])
    elif model == "cubic_clock_power":
        p0, bounds = [float(y.min()) * 0.5, float(y.max()) * 0.5], ([0.0, 0.0], [np.inf, np.inf])
    else:
        p0, bounds = [float(y.max()), 0.3], ([0.0, 0.0], [10 * float(y.max()), 1.0])

    if model in ("cubic_clock_power", "step_time"):
        def f(xx, *p):
            return fn(xx, *p, f_ref=f_ref)
    else:
        def f(xx, *p):
            return fn(xx, *p, softness=softness)

    try:
        popt, pcov = curve_fit(f, x, y, p0=p0, sigma=s, bounds=bounds, maxfev=20000)
    except (RuntimeError, ValueError) as e:
        return ModelFit(quantity, model, False, f"fit failed: {e}")
    pred = f(x, *popt)
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid**2)) / ss_tot if ss_tot > 0 else (1.0 if np.allclose(resid, 0) else 0.0)
    with np.errstate(invalid="ignore"):
        err = np.sqrt(np.diag(pcov)) if pcov is not None else np.full(len(popt), np.nan)
    params = dict(zip(names, (float(p) for p in popt)))
    stderr = dict(zip(names, (float(e) for e in err)))
    if model in ("cubic_clock_power", "step_time"):
        params["f_ref_mhz"] = f_ref
        stderr["f_ref_mhz"] = 0.0
    msg = ""
    if x.size <= len(popt):
        msg = "as many levels as parameters: the curve passes through every point, uncertainty unknown"
    return ModelFit(
        quantity, model, True, msg, params, stderr, r2, float(np.sqrt(np.mean(resid**2))),
        tuple(float(r) for r in resid), tuple(float(v) for v in x), softness,
    )


def fit_series(level_kind: str, level_values, tok_s, power_w, tok_sigma=None, power_sigma=None) -> dict[str, ModelFit]:
    return {
        "decode_tok_s": fit_curve("decode_tok_s", level_kind, level_values, tok_s, tok_sigma),
        "avg_gpu_power_w": fit_curve("avg_gpu_power_w", level_kind, level_values, power_w, power_sigma),
    }
