"""Per-level statistics: bootstrap CIs, which windows count, reference, LEVELS rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from powerprof.analysis.stats import bootstrap_ci, level_series, summarize_levels
from powerprof.storage.schema import LEVELS, WINDOWS


def _windows(rows):
    return pa.Table.from_pylist(rows, schema=WINDOWS)


def _req(level, tok, j, **kw):
    row = {"run_id": "r", "level_kind": "power_limit", "level_value": float(level), "window_kind": "request",
           "concurrency": 1, "warmup": False, "status": "ok", "decode_tok_s": tok, "gpu_j_per_token": j,
           "avg_gpu_power_w": tok * j, "energy_method": "counter"}
    row.update(kw)
    return row


def test_bootstrap_ci_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    hits = 0
    for k in range(200):
        x = rng.normal(10.0, 1.0, 40)
        lo, hi = bootstrap_ci(x, n_boot=500, seed=k)
        hits += lo <= 10.0 <= hi
    assert 0.88 <= hits / 200 <= 0.99


def test_bootstrap_ci_is_reproducible_drops_nans_and_handles_degenerate_input():
    x = np.r_[np.linspace(1, 2, 30), np.nan]
    assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
    lo, hi = bootstrap_ci(x, stat=np.mean)
    assert lo < 1.5 < hi
    assert bootstrap_ci([4.0]) == (4.0, 4.0)
    assert all(np.isnan(bootstrap_ci([])))


def test_warmup_failed_and_batch_rows_do_not_count_at_concurrency_1():
    rows = [_req(300, 100 + i * 0.1, 3.0) for i in range(10)]
    rows += [_req(300, 1.0, 99.0, warmup=True), _req(300, 1.0, 99.0, status="failed", error="boom"),
             _req(300, 1.0, 99.0, window_kind="batch", request_id=None)]
    t = summarize_levels(_windows(rows))
    r = t.to_pylist()[0]
    assert r["n_requests"] == 10 and r["n_failed"] == 1
    assert r["decode_tok_s"] == pytest.approx(100.45)
    assert r["gpu_j_per_token"] == pytest.approx(3.0)
    assert "failed-requests" in r["flags"]


def test_concurrency_above_1_uses_batch_rows_and_is_its_own_level():
    rows = [_req(300, 80.0, 3.0) for _ in range(5)]
    rows += [_req(300, 50.0, 5.0, concurrency=4) for _ in range(8)]  # per-request rows: not the aggregate
    rows += [_req(300, 200.0 + i, 1.5, concurrency=4, window_kind="batch", request_id=None) for i in range(3)]
    t = summarize_levels(_windows(rows)).to_pylist()
    by_c = {r["concurrency"]: r for r in t}
    assert by_c[1]["decode_tok_s"] == 80.0
    assert by_c[4]["decode_tok_s"] == pytest.approx(201.0)
    assert by_c[4]["n_requests"] == 8


def test_reference_is_the_default_limit_when_measured_else_the_highest_level():
    rng = np.random.default_rng(0)
    rows = []
    for level, tok, j in ((200, 90.0, 2.5), (250, 98.0, 2.8), (300, 100.0, 3.0)):
        rows += [_req(level, tok * (1 + rng.normal(0, 0.005)), j * (1 + rng.normal(0, 0.005))) for _ in range(20)]
    w = _windows(rows)
    top = {r["level_value"]: r for r in summarize_levels(w).to_pylist()}
    assert top[300]["reference"] and top[300]["speed_loss_pct"] == 0
    assert top[200]["speed_loss_pct"] == pytest.approx(10, abs=1)
    assert top[200]["energy_saving_pct"] == pytest.approx(100 / 6, abs=1)
    assert top[200]["speed_loss_pct_ci_low"] < top[200]["speed_loss_pct"] < top[200]["speed_loss_pct_ci_high"]
    dflt = {r["level_value"]: r for r in summarize_levels(w, reference_value=250).to_pylist()}
    assert dflt[250]["reference"] and not dflt[300]["reference"]
    assert dflt[300]["speed_loss_pct"] < 0  # faster than the reference
    unmeasured = {r["level_value"]: r for r in summarize_levels(w, reference_value=280).to_pylist()}
    assert unmeasured[300]["reference"]


def test_levels_table_conforms_to_schema_and_takes_sensor_figures_from_extra():
    rows = [_req(300, 100.0 + i, 3.0 + 0.3 * (i % 2)) for i in range(6)]
    extra = {("power_limit", 300.0): {"sm_clock_mhz": 2790.0, "cap_not_engaged": True, "thermal_throttle": True}}
    t = summarize_levels(_windows(rows), extra=extra, wide_ci_pct=1.0)
    assert t.schema.equals(LEVELS)
    r = t.to_pylist()[0]
    assert r["sm_clock_mhz"] == 2790.0
    assert set(r["flags"].split(",")) == {"cap-not-engaged", "thermal", "wide-ci"}
    assert r["ci_reached_pct"] > 1.0


def test_bootstrap_replicates_of_tok_s_and_j_come_from_the_same_requests():
    # tok/s and J/token perfectly anti-correlated across requests: shared resamples keep that.
    tok = np.linspace(90, 110, 25)
    rows = [_req(300, t, 300.0 / t) for t in tok]
    s = level_series(_windows(rows), n_boot=300)[0]
    assert np.corrcoef(s.boot_tok_s[:, 0], s.boot_j_per_token[:, 0])[0, 1] < -0.95
