"""Curve fits: PCHIP stays monotone; the saturating models recover their parameters and extrapolate flat."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.analysis.fits import _power_limit_tok, fit_curve, pchip_grid


def test_pchip_is_monotone_between_levels_and_held_outside():
    x = np.array([180.0, 220, 260, 300])
    y = np.array([75.0, 80.8, 85.3, 86.7])
    grid = np.linspace(150, 330, 400)
    g = pchip_grid(x, y, grid)
    assert np.all(np.diff(g) >= -1e-12)
    assert g.min() == pytest.approx(75.0) and g.max() == pytest.approx(86.7)


def test_throughput_model_recovers_parameters_and_saturates_above_the_natural_draw():
    L = np.array([150.0, 180, 210, 240, 270, 300, 330])
    y = _power_limit_tok(L, 90.0, 275.0, 0.33, softness=1.8)
    f = fit_curve("decode_tok_s", "power_limit", L, y)
    assert f.ok and f.r2 > 0.999
    assert f.params["t_max_tok_s"] == pytest.approx(90, rel=0.01)
    assert f.params["l_sat_w"] == pytest.approx(275, rel=0.02)
    assert f.params["alpha"] == pytest.approx(0.33, rel=0.05)
    assert all(np.isfinite(list(f.stderr.values())))
    far = f.predict(np.array([400.0, 600.0]))
    assert far == pytest.approx([90, 90], rel=0.01)  # more limit than the card draws changes nothing


def test_power_model_follows_the_limit_then_the_natural_draw():
    L = np.array([150.0, 200, 250, 300, 350])
    y = np.minimum(0.99 * L, 275.0) + np.array([0.5, -0.4, 0.3, -0.2, 0.1])
    f = fit_curve("avg_gpu_power_w", "power_limit", L, y)
    assert f.ok and f.r2 > 0.99
    assert f.params["p_nat_w"] == pytest.approx(275, abs=3)
    assert len(f.residuals) == 5 and f.rmse < 2


def test_too_few_levels_say_so_instead_of_fitting():
    f = fit_curve("decode_tok_s", "power_limit", [200.0, 300.0], [80.0, 90.0])
    assert not f.ok and "needs at least 4" in f.message
    assert np.isnan(f.predict(np.array([250.0]))).all()


def test_clock_models_fit_a_step_time_curve():
    f_mhz = np.array([1200.0, 1500, 1800, 2100, 2400, 2790])
    tok = 87.0 / ((1 - 0.45) + 0.45 * 2790 / f_mhz)
    f = fit_curve("decode_tok_s", "sm_clock", f_mhz, tok)
    assert f.ok and f.params["compute_share"] == pytest.approx(0.45, rel=0.01)
