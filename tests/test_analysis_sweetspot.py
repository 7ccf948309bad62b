"""Sweet-spot policies recover known optima; the seed's study is a regression case."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from scipy.optimize import minimize_scalar

from powerprof.analysis.stats import level_series
from powerprof.analysis.sweetspot import PolicyParams, accepted_value, choose, choose_all
from synthetic_runs import Truth, bowl_truth, make_run, seed_truth

BOWL_LEVELS = tuple(range(150, 351, 20))


def _series(tmp_path, truth, levels, **kw):
    run = make_run(tmp_path / "run", truth, levels=levels, **kw)
    return level_series(pq.read_table(run / "windows.parquet"), truth.default_limit_w, n_boot=400)[0]


def _expected_level(levels, objective, feasible=None):
    """The measured level minimising the noise-free objective (an independent re-statement of each policy)."""
    lv = np.asarray(levels, float)
    val = np.array([objective(x) for x in lv])
    if feasible is not None:
        val = np.where([feasible(x) for x in lv], val, np.inf)
    return float(lv[np.argmin(val)])


@pytest.fixture(scope="module")
def bowl(tmp_path_factory):
    truth = bowl_truth(l_opt_w=230.0)
    return truth, _series(tmp_path_factory.mktemp("bowl"), truth, BOWL_LEVELS, n_requests=30, noise=0.01)


def test_every_policy_recovers_the_known_optimum_of_a_bowl(bowl):
    truth, s = bowl
    T = lambda x: float(truth.tok_s(np.array([x]))[0])  # noqa: E731
    J = lambda x: float(truth.j_per_token(np.array([x]))[0])  # noqa: E731
    ref = truth.default_limit_w if truth.default_limit_w in BOWL_LEVELS else max(BOWL_LEVELS)
    p_max = truth.max_limit_w
    params = PolicyParams(max_slowdown=0.10, eta=0.3, p_max_w=p_max)
    expect = {
        "min_energy": _expected_level(BOWL_LEVELS, J),
        "budget": _expected_level(BOWL_LEVELS, J, feasible=lambda x: T(x) >= 0.9 * T(ref)),
        "edp": _expected_level(BOWL_LEVELS, lambda x: J(x) / T(x)),
        "ed2p": _expected_level(BOWL_LEVELS, lambda x: J(x) / T(x) ** 2),
        "weighted": _expected_level(BOWL_LEVELS, lambda x: 0.3 * J(x) + 0.7 * p_max / T(x)),
    }
    assert expect["min_energy"] == 230.0  # the bowl is built with its minimum there
    assert len(set(expect.values())) >= 3  # the policies really disagree on this card
    got = choose_all(s, params, (truth.min_limit_w, truth.max_limit_w))
    for policy, level in expect.items():
        c = got[policy]
        assert c.level_value == level, policy
        assert c.ci_low <= level <= c.ci_high
        assert c.stability > 0.5, policy


def test_interpolated_choice_lands_near_the_continuous_optimum(bowl):
    truth, s = bowl
    J = lambda x: float(truth.j_per_token(np.array([x]))[0])  # noqa: E731
    T = lambda x: float(truth.tok_s(np.array([x]))[0])  # noqa: E731
    c = choose(s, "min_energy")
    assert c.interpolated_value == pytest.approx(230, abs=6)
    edp_opt = minimize_scalar(lambda x: J(x) / T(x), bounds=(150, 350), method="bounded").x
    assert choose(s, "edp").interpolated_value == pytest.approx(edp_opt, abs=8)


def test_knee_of_saving_vs_loss_is_found(tmp_path):
    # Saving climbs 10 points per point of loss down to 250 W, then almost nothing: the knee is 250 W.
    levels = (200, 225, 250, 275, 300)
    loss = np.array([20.0, 10.0, 2.0, 1.0, 0.0])
    saving = np.array([24.0, 22.0, 20.0, 10.0, 0.0])
    tok = 100 * (1 - loss / 100)
    j = 3.0 * (1 - saving / 100)
    truth = Truth(tok_s=lambda L: np.interp(L, levels, tok), power_w=lambda L: np.interp(L, levels, j * tok),
                  sm_clock_mhz=lambda L: np.full(np.shape(L), 2000.0), default_limit_w=300)
    s = _series(tmp_path, truth, levels, noise=0.003)
    c = choose(s, "knee")
    assert c.level_value == 250.0 and c.stability > 0.9


def test_no_knee_where_saving_never_outruns_loss_keeps_the_reference(tmp_path):
    # Two levels (180 and 300 W of a sweep): normalised saving minus normalised loss is 0 at both, and the tie went to
    # the lowest level, "knee 180 W", and on the straight line between them to 299 W. Savings in proportion to losses
    # (five levels on one line) have no knee either. A real knee (above) is unchanged.
    from powerprof.analysis.sweetspot import PolicyParams, policy_index

    tok, j = np.array([66.9, 77.3]), np.array([2.70, 3.525])
    assert int(policy_index("knee", tok, j, 1, PolicyParams())) == 1
    levels = (200, 225, 250, 275, 300)
    loss = np.array([20.0, 15.0, 10.0, 5.0, 0.0])
    tok = 100 * (1 - loss / 100)
    j = 3.0 * (1 - 1.2 * loss / 100)
    assert int(policy_index("knee", tok, j, 4, PolicyParams())) == 4
    truth = Truth(tok_s=lambda L: np.interp(L, (180, 300), (66.9, 77.3)),
                  power_w=lambda L: np.interp(L, (180, 300), (66.9 * 2.70, 77.3 * 3.525)),
                  sm_clock_mhz=lambda L: np.full(np.shape(L), 2000.0), default_limit_w=300)
    c = choose(_series(tmp_path, truth, (180, 300), noise=0.0), "knee")
    assert c.level_value == 300.0 and c.interpolated_value in (None, 300.0), (c.level_value, c.interpolated_value)


def test_seed_regression_220_w_is_the_sweet_spot_within_a_10_percent_budget(tmp_path):
    truth = seed_truth("seed-16g")
    s = _series(tmp_path, truth, (180, 220, 260, 300), n_requests=40)
    loss = dict(zip(s.level_values, s.speed_loss() * 100))
    saving = dict(zip(s.level_values, s.energy_saving() * 100))
    assert loss[220] == pytest.approx(7, abs=1.0)  # the seed: 7% slower ...
    assert saving[220] == pytest.approx(14, abs=2.0)  # ... and 14% less energy per token (simulator: 14.8%)
    assert loss[180] > 10
    c = choose(s, "budget", PolicyParams(max_slowdown=0.10), card_range=(150, 320))
    assert c.level_value == 220 and c.recommended_value == 220
    assert (c.ci_low, c.ci_high) == (220, 220)
    assert choose(s, "budget", PolicyParams(max_slowdown=0.05)).level_value == 260
    assert choose(s, "min_energy").at_low_edge


def test_weighted_cost_spans_energy_only_to_speed_only(bowl):
    truth, s = bowl
    energy_only = choose(s, "weighted", PolicyParams(eta=1.0, p_max_w=400))
    assert energy_only.level_value == choose(s, "min_energy").level_value
    time_only = choose(s, "weighted", PolicyParams(eta=0.0, p_max_w=400))
    assert time_only.level_value >= 290  # T saturates at 290 W: any level there is fastest


def test_recommended_value_is_a_setting_the_card_accepts():
    assert accepted_value(219.6, 150, 320) == 220
    assert accepted_value(149.2, 150.5, 320) == 151
    assert accepted_value(400, 150, 320) == 320


@pytest.mark.parametrize("kw", [dict(max_slowdown=1.5), dict(max_slowdown=-0.1), dict(eta=2)])
def test_bad_policy_parameters_are_refused(kw):
    with pytest.raises(ValueError):
        PolicyParams(**kw)


@pytest.mark.parametrize("levels", [(220.0, 300.0), (180.0, 260.0, 300.0), (180.0, 220.0, 260.0, 300.0),
                                    (150.0, 170.0, 230.0, 300.0)])
def test_a_noiseless_sweep_gives_every_policys_true_choice_and_exact_figures(levels):
    from powerprof.analysis.stats import levels_table
    from powerprof.analysis.sweetspot import POLICIES, policy_index
    from synthetic_runs import replicate_windows

    truth = seed_truth("seed-16g")
    lv = np.array(levels)
    tok, j = truth.tok_s(lv), truth.j_per_token(lv)
    w = replicate_windows(np.random.default_rng(0), tok, j, lv, n_prompts=5, rounds=2, noise=0.0, spread=0.2)
    s = level_series(w, 300.0, n_boot=200)[0]
    params = PolicyParams(p_max_w=300.0)
    for policy in POLICIES:
        c = choose(s, policy, params)
        assert c.level_value == lv[int(policy_index(policy, tok, j, lv.size - 1, params))], policy
        assert c.stability == 1.0 and c.ci_low == c.ci_high == c.level_value
    for i, r in enumerate(levels_table([s]).to_pylist()):
        assert r["speed_loss_pct"] == pytest.approx((1 - tok[i] / tok[-1]) * 100, abs=1e-9)
        assert r["energy_saving_pct_ci_low"] == pytest.approx((1 - j[i] / j[-1]) * 100, abs=1e-9)
        assert r["energy_saving_pct_ci_high"] == pytest.approx((1 - j[i] / j[-1]) * 100, abs=1e-9)
