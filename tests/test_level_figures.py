"""Per-level sensor figures: one implementation (analysis/engine.py) for the sweep and the analysis,
and the clock-event rules stated once (collectors/clock_reasons.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from powerprof.analysis import engine
from powerprof.collectors.clock_reasons import (REASON_HW_SLOWDOWN, REASON_HW_THERMAL, REASON_SW_POWER_CAP,
                                                cap_not_engaged, thermal)
from powerprof.storage.schema import SAMPLES

ROOT = Path(__file__).resolve().parents[1]


def _samples(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist([{"source": "nvml", "device": "gpu0", "level_kind": "power_limit", **r} for r in rows],
                                schema=SAMPLES)


def _figures(table: pa.Table, intervals=None, time_expr="t_mono_s"):
    with engine.connect() as con:
        rel = engine.samples_relation(con, table)
        return engine.level_figures(engine.level_sums(con, rel, intervals, time_expr=time_expr))


def test_figures_are_means_inside_the_measured_spans_only():
    t = _samples([
        {"t_mono_s": 0.5, "level_value": 200.0, "power_w": 500.0, "sm_clock_mhz": 100.0},  # settling: outside
        {"t_mono_s": 1.0, "level_value": 200.0, "power_w": 190.0, "sm_clock_mhz": 1400.0, "clock_event_reasons": 4},
        {"t_mono_s": 1.5, "level_value": 200.0, "power_w": 196.0, "sm_clock_mhz": 1500.0, "clock_event_reasons": 0},
        {"t_mono_s": 1.7, "level_value": 200.0, "power_w": None, "power_avg_w": 199.0, "sm_clock_mhz": None},
        {"t_mono_s": 2.5, "level_value": 200.0, "power_w": 50.0, "sm_clock_mhz": 300.0},  # between spans
        {"t_mono_s": 3.0, "level_value": 200.0, "power_w": 194.0, "sm_clock_mhz": 1600.0},
        {"t_mono_s": 3.0, "level_value": 200.0, "source": "rapl", "device": "package-0", "power_w": 80.0},
    ])
    f = _figures(t, engine.merge_intervals(np.array([2.8, 1.0, 1.2]), np.array([3.2, 1.6, 1.8])))
    got = f[("power_limit", 200.0)]
    assert got["n_samples"] == 4
    assert got["sample_power_w"] == pytest.approx((190 + 196 + 199 + 194) / 4)  # falls back on the average power
    assert got["sm_clock_mhz"] == pytest.approx(1500.0)
    assert got["clock_event_reasons"] == REASON_SW_POWER_CAP and got["power_cap_seen"]
    assert got["cap_not_engaged"] is False and got["thermal_throttle"] is False


def test_an_idle_reading_inside_a_window_leaves_the_clock_figures_but_not_the_power():
    # ci (two CPU hogs): a client starved of CPU read its last token late, a tick inside the window found the GPU idle at
    # 345 MHz, and the 1400 MHz lock's level read sm_clock_mhz 1220 (five busy readings at 1395 and that one).
    busy = {"level_value": 1400.0, "power_w": 300.0, "sm_clock_mhz": 1395.0, "mem_clock_mhz": 2619.0,
            "gpu_util_pct": 100.0, "clock_event_reasons": 0}
    t = _samples([{**busy, "t_mono_s": 1.0 + 0.2 * k} for k in range(5)] + [
        {"t_mono_s": 2.1, "level_value": 1400.0, "power_w": 90.0, "sm_clock_mhz": 345.0, "mem_clock_mhz": 405.0,
         "gpu_util_pct": 0.0, "clock_event_reasons": 1},  # GpuIdle
        {"t_mono_s": 2.15, "level_value": 1400.0, "power_w": 95.0, "sm_clock_mhz": 350.0, "gpu_util_pct": 0.0},
        {"t_mono_s": 2.2, "level_value": 1400.0, "power_w": 100.0, "sm_clock_mhz": 360.0, "clock_event_reasons": 1},
    ])
    got = _figures(t, engine.merge_intervals(np.array([0.9]), np.array([2.3])))[("power_limit", 1400.0)]
    assert got["sm_clock_mhz"] == pytest.approx(1395.0) and got["mem_clock_mhz"] == pytest.approx(2619.0)
    assert got["sample_power_w"] == pytest.approx((5 * 300 + 90 + 95 + 100) / 8)  # the energy's mean keeps them
    assert got["n_samples"] == 8
    # A GPU that reports neither its utilisation nor its reasons is taken as busy.
    plain = _samples([{"t_mono_s": 1.0, "level_value": 1400.0, "power_w": 300.0, "sm_clock_mhz": 1395.0}])
    assert _figures(plain)[("power_limit", 1400.0)]["sm_clock_mhz"] == pytest.approx(1395.0)


def test_timestamps_in_utc_microseconds_select_the_same_samples():
    t0 = 1_760_000_000_000_000
    t = _samples([{"time_utc": t0 + k * 100_000, "t_mono_s": k / 10, "level_value": 250.0, "power_w": float(k)}
                  for k in range(10)])
    f = _figures(t, (np.array([t0 + 200_000]), np.array([t0 + 400_000])), time_expr="epoch_us(time_utc)")
    assert f[("power_limit", 250.0)]["sample_power_w"] == pytest.approx(3.0)


def test_reasons_never_reported_fall_back_on_power_alone():
    t = _samples([{"t_mono_s": 1.0, "level_value": 300.0, "power_w": 250.0}])
    got = _figures(t)[("power_limit", 300.0)]
    assert got["clock_event_reasons"] is None
    assert got["cap_not_engaged"] is True  # 250 W < 90% of 300 W with no bits to say otherwise


def test_thermal_rule_counts_heat_not_every_hardware_slowdown():
    assert thermal(REASON_HW_THERMAL | REASON_HW_SLOWDOWN)
    assert not thermal(REASON_HW_SLOWDOWN)  # also set for power brake: not heat by itself
    assert not thermal(None)
    assert not cap_not_engaged(200.0, 300.0, REASON_SW_POWER_CAP)


def test_sweep_and_analysis_read_the_same_file_the_same_way(tmp_path):
    """A samples.parquet file and the in-memory table it was written from give the same figures."""
    rng = np.random.default_rng(1)
    n = 400
    t = _samples([{"t_mono_s": k * 0.05, "level_value": float(200 + 20 * (k // 100)), "power_w": float(rng.normal(200, 5)),
                   "sm_clock_mhz": float(rng.normal(1500, 30)), "clock_event_reasons": int(rng.choice([0, 4, 0x40]))}
                  for k in range(n)])
    pq.write_table(t, tmp_path / "samples.parquet")
    spans = engine.merge_intervals(np.arange(0, 20, 1.0), np.arange(0, 20, 1.0) + 0.5)
    mem = _figures(t, spans)
    with engine.connect() as con:
        rel = engine.samples_relation(con, [tmp_path / "samples.parquet"])
        disk = engine.level_figures(engine.level_sums(con, rel, spans, time_expr="t_mono_s"))
    assert mem.keys() == disk.keys() and len(mem) == 4
    for k in mem:
        assert mem[k] == pytest.approx(disk[k])


def test_analysis_does_not_import_the_sweep():
    for path in (ROOT / "powerprof" / "analysis").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("powerprof.sweep"), f"{path.name} imports {node.module}"


def test_one_scan_gives_the_level_sums_and_the_timeline():
    """The analysis's single pass: the timeline bins every nvml sample (inside the windows or not),
    the level sums only those inside; each bin's level is its last tagged sample's."""
    rows = []
    for k in range(16):
        for dev, base in (("gpu0", 100.0), ("gpu1", 200.0)):
            rows.append({"t_mono_s": float(k), "device": dev, "power_w": base + k, "sm_clock_mhz": 1000.0 + k,
                         "level_value": 300.0 if k < 8 else 250.0})
    t = _samples(rows)
    with engine.connect() as con:
        rel = engine.samples_relation(con, t)
        sums, tl = engine.scan(con, rel, (np.array([2.0]), np.array([5.0])), time_expr="t_mono_s", bins=4)
    assert set(sums) == {("power_limit", 300.0)} and sums[("power_limit", 300.0)].n == 8  # t = 2..5, 2 GPUs
    assert tl["bins"] == 4 and tl["devices"] == ("gpu0", "gpu1")
    width = 15 / 4
    for b in range(4):
        ks = [k for k in range(16) if min(int(k / width), 3) == b]
        assert tl["power_w"][0, b] == pytest.approx(100 + np.mean(ks))
        assert tl["power_w"][1, b] == pytest.approx(200 + np.mean(ks))
        assert tl["level_value"][b] == (300.0 if max(ks) < 8 else 250.0)
