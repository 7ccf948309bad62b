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


def test_paired_saving_ci_is_known_long_before_a_levels_own_ci():
    """Prompts differ a lot in J/token, the setting shifts them all alike: the paired saving is
    tight after one round while the level's own CI is still wide (issue 10, item 6)."""
    from powerprof.analysis.stats import paired_saving_halfwidth

    rng = np.random.default_rng(0)
    prompts = [f"p{i}" for i in range(4)] * 2  # two rounds of four prompts
    base = np.array([1.0, 2.0, 3.0, 4.0] * 2)
    ref = base * (1 + 0.002 * rng.standard_normal(8))
    level = 0.9 * base * (1 + 0.002 * rng.standard_normal(8))
    assert median_ci_halfwidth_frac(level) > 0.1
    hw = paired_saving_halfwidth(ref, prompts, level, prompts)
    assert hw < 0.005
    # Different prompt sets cannot be paired: the rule never fires on them.
    assert paired_saving_halfwidth(ref, prompts, level, [f"q{i}" for i in range(8)]) == float("inf")


def test_sweep_stops_a_level_on_the_paired_ci(tmp_path):
    import pyarrow.parquet as pq

    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sweep import run_sweep
    from powerprof.workload.client import RequestParams

    out = tmp_path / "paired"
    # An own-CI target no level can meet; the paired one is met after the first round quiet. Four rounds of budget: a
    # full suite beside two CPU hogs once left too few trusted pairs in both of two rounds (a starved client's piles
    # are untrusted windows) and the level ran to max-requests.
    with Rig("a100-40g", nvml=SimNVML("a100-40g")) as rig:
        # 128 tokens: ~1.3 s windows. At 48 (0.5 s, under 10 refreshes of a 100 ms counter) the level is flagged
        # short-windows, which no CI target may end.
        run_sweep(rig, levels_spec="400,250", out_dir=out, params=RequestParams(max_tokens=128), idle_s=0,
                  interval_s=0.5, min_requests=4, max_requests=16, warmup_requests=0, target_ci=0.0001,
                  target_paired_ci=0.10)  # ±10 points: after one round of 4 prompts the widened CI is ±2.6-2.9 quiet
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert levels.loc[250.0, "stop_rule"] == "paired-ci-reached"
    assert levels.loc[400.0, "stop_rule"] == "max-requests"  # the reference has nothing to pair with
    assert levels.loc[250.0, "n_requests"] < levels.loc[400.0, "n_requests"]


def test_the_stopped_note_counts_distinct_levels_not_visits(tmp_path, monkeypatch):
    from powerprof.sweep import _kept_note

    monkeypatch.chdir(tmp_path)
    (tmp_path / "RUN").mkdir()  # the note says the folder is gone where it is (tests/test_full_disk.py)

    # --repeats 2 over 300,250,200: both passes of 300 and 250 finished, then 200 of the first pass.
    done = [(300.0, 0), (250.0, 0), (200.0, 0), (300.0, 1), (250.0, 1)]
    assert _kept_note("RUN", done) == "stopped: 3 finished levels (5 visits) kept in RUN (powerprof analyze RUN)"
    assert _kept_note("RUN", [[300.0, 0], [300.0, 1]]) == \
        "stopped: 1 finished level (2 visits) kept in RUN (powerprof analyze RUN)"  # as run.json reads them back
    assert _kept_note("RUN", [(300.0, 0), (250.0, 0)]) == "stopped: 2 finished levels kept in RUN (powerprof analyze RUN)"
    # A grid's visits carry their config and context: the same watts in two configs are two levels.
    grid = [(300.0, 0, "c0", None), (300.0, 0, "c1", None), (300.0, 1, "c0", None)]
    assert _kept_note("RUN", grid) == "stopped: 2 finished levels (3 visits) kept in RUN (powerprof analyze RUN)"
    assert _kept_note("RUN", []) == "stopped before any level finished: RUN holds nothing to analyse"


def test_a_level_of_windows_under_ten_counter_refreshes_never_stops_on_its_ci():
    # Short counter windows share one bias the CI cannot see: a tight CI there is no reason to stop.
    s = SweepSettings("power_limit", (700,), min_requests=5, target_ci=0.02, max_time_s=60)
    j = np.full(20, 1.742)
    assert stop_reason(j, 5.0, s, counter_window_s=2.0) == "ci-reached"
    assert stop_reason(j, 5.0, s, counter_window_s=0.31) is None
    assert stop_reason(j, 61.0, s, counter_window_s=0.31) == "max-time"


def test_max_time_counts_from_the_end_of_the_warm_up(tmp_path):
    # --help says "(after warm-up)", but the clock started before the warm-up batch: a level whose warm-up took its
    # whole --max-time got one round. 8 warm-ups of ~0.4 s (3.2 s) against --max-time 3: one round of 4 then, two now.
    import pyarrow.parquet as pq

    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sweep import run_sweep
    from powerprof.workload.client import RequestParams

    out = tmp_path / "warm"
    with Rig("seed-16g", nvml=SimNVML("seed-16g")) as rig:
        run_sweep(rig, levels_spec="300", out_dir=out, params=RequestParams(max_tokens=32), idle_s=0,
                  interval_s=0.5, min_requests=2, max_requests=40, warmup_requests=8, target_ci=0.0001,
                  max_time_s=3.0)
    (row,) = pq.read_table(out / "levels.parquet").to_pylist()
    assert row["stop_rule"] == "max-time"
    assert row["n_requests"] >= 8, row["n_requests"]
