"""The sweep's decision rules: visiting order, stopping rule, cap-not-engaged detection."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.collectors.clock_reasons import cap_not_engaged
from powerprof.sweep import SweepSettings, median_ci_halfwidth_frac, stop_reason, visit_order


def test_repeats_interleave_levels():
    order = visit_order([180, 300, 220], repeats=2, order="desc")
    assert order == [(300, 0), (220, 0), (180, 0), (300, 1), (220, 1), (180, 1)]
    rnd = visit_order([180, 220, 260, 300], repeats=3, order="random", seed=1)
    for r in range(3):
        assert sorted(v for v, rep in rnd if rep == r) == [180, 220, 260, 300]


def test_stopping_rule_waits_for_min_requests_then_the_ci():
    s = SweepSettings("power_limit", (300,), min_requests=5, target_ci=0.02, max_time_s=60)
    tight = np.full(4, 1.0) + np.linspace(-0.001, 0.001, 4)
    assert stop_reason(tight, 1.0, s) is None  # CI fine but only 4 requests
    assert stop_reason(np.append(tight, 1.0), 1.0, s) == "ci-reached"
    noisy = np.random.default_rng(0).normal(1.0, 0.2, 6)
    assert median_ci_halfwidth_frac(noisy) > 0.02
    assert stop_reason(noisy, 1.0, s) is None
    assert stop_reason(noisy, 61.0, s) == "max-time"


@pytest.mark.parametrize("kw", [dict(order="sideways"), dict(repeats=0), dict(target_ci=2.0), dict(min_requests=1)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        SweepSettings("power_limit", (300,), **kw)


def test_cap_not_engaged_needs_low_power_and_no_powercap_reason():
    assert cap_not_engaged(275.0, 300.0, 0)  # the seed card at 300 W: never capped
    assert not cap_not_engaged(299.0, 300.0, 0)  # at the limit the cap binds, whatever the bits say
    assert not cap_not_engaged(200.0, 320.0, 0x4)  # the driver says the cap held the clock
    assert cap_not_engaged(2 * 275.0, 300.0, 0, n_gpus=2)
    # A GPU that cannot report reasons: only a clear gap counts.
    assert not cap_not_engaged(275.0, 300.0, None)
    assert cap_not_engaged(200.0, 300.0, None)
