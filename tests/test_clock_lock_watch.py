"""The SM-clock watch of a sweep (sweep.ClockLockWatch): a lock another tool released or raised trips it, and
so does a clock another tool set below the level (no limiter named, power well under the cap); a clock below
the lock for a power cap, heat or idling, and a single odd read, never do."""

from __future__ import annotations

import pytest

from powerprof.collectors.clock_reasons import (REASON_APP_CLOCKS, REASON_GPU_IDLE, REASON_HW_THERMAL,
                                                REASON_SW_POWER_CAP, REASON_SW_THERMAL, REASON_SYNC_BOOST)
from powerprof.collectors.nvml import GpuReading
from powerprof.sweep import ClockLockWatch


def _r(mhz, reasons=0, index=0, power_w=250.0, limit_w=700.0, util=100.0):
    return GpuReading(index=index, power_w=power_w, power_avg_w=power_w, energy_j=1.0, sm_clock_mhz=mhz,
                      mem_clock_mhz=4800.0, gpu_util_pct=util, mem_util_pct=50.0, mem_used_bytes=1, temperature_c=60.0,
                      power_limit_w=limit_w, enforced_limit_w=limit_w, clock_event_reasons=reasons)


def _feed(watch, readings):
    return [watch.feed(r) for r in readings]


def test_two_busy_readings_above_the_lock_in_a_row_trip_it_naming_gpu_lock_and_reading():
    w = ClockLockWatch(1200)
    got = _feed(w, [_r(1200), _r(1980), _r(1980)])
    assert got[:2] == [None, None]
    assert got[2].startswith("GPU 0's SM clock read 1980 MHz (2 readings in a row) during the level, above the 1200 MHz it was locked to")


def test_one_odd_reading_above_the_lock_does_not():
    w = ClockLockWatch(1200)
    assert _feed(w, [_r(1980), _r(1200), _r(1980), _r(1195), _r(1980)]) == [None] * 5
    assert w.open  # the last one may be the start of a lost lock: the rows since are held as suspect


def test_readings_below_the_lock_for_a_cap_heat_or_idling_never_trip_it():
    w = ClockLockWatch(1500)
    readings = [_r(1400, REASON_SW_POWER_CAP), _r(1100, REASON_HW_THERMAL), _r(345, REASON_GPU_IDLE), _r(1500)] * 5
    assert _feed(w, readings) == [None] * len(readings)
    assert not w.open


@pytest.mark.parametrize("reasons", [0, REASON_APP_CLOCKS], ids=["no-reason", "AppClocks"])
def test_a_lock_another_tool_moved_below_the_level_trips_it_after_three_busy_readings(reasons):
    # nvidia-smi -lgc 900,900 during the 1400 MHz level: the GPU sits at 900 MHz, busy, at 180 W of 700 W,
    # and no limiter bit is set (drivers report a lock as AppClocks/UserDefinedClocks, or nothing).
    w = ClockLockWatch(1400)
    got = _feed(w, [_r(1400), _r(900, reasons, power_w=180.0), _r(900, reasons, power_w=180.0),
                    _r(900, reasons, power_w=180.0)])
    assert got[:3] == [None, None, None] and w.open
    assert got[3].startswith("GPU 0's SM clock read 900 MHz (3 busy readings in a row) during the level, well below "
                             "the 1400 MHz it was locked to, at 180 W of its 700 W limit with no power or thermal"), got[3]
    assert "another tool locked the clock lower (nvidia-smi -lgc)" in got[3]


@pytest.mark.parametrize("reasons,power_w", [
    (REASON_SW_POWER_CAP, 690.0),   # the cap binds: said by the driver, power at the limit
    (REASON_SW_POWER_CAP, 400.0),   # said by the driver, power averaged low
    (0, 665.0),                     # at 95% of the limit the cap binds whatever bit a driver forgets
    (REASON_HW_THERMAL, 300.0),     # heat names itself
    (REASON_SW_THERMAL | REASON_APP_CLOCKS, 300.0),
    (REASON_SYNC_BOOST, 300.0),     # held to the slowest GPU of its sync-boost group
    (None, 180.0),                  # a GPU that cannot say why: heat cannot be ruled out
], ids=["cap", "cap-low-avg", "at-limit-no-bit", "hw-thermal", "sw-thermal", "sync-boost", "no-reasons"])
def test_a_clock_below_the_lock_that_a_limiter_explains_never_trips_it(reasons, power_w):
    w = ClockLockWatch(1400)
    assert _feed(w, [_r(900, reasons, power_w=power_w)] * 8) == [None] * 8


def test_a_gpu_reading_no_power_says_nothing_below_the_lock():
    w = ClockLockWatch(1400)
    assert _feed(w, [_r(900, power_w=None)] * 5) == [None] * 5


def test_a_clock_a_little_below_the_lock_or_a_broken_run_of_low_readings_does_not_trip_it():
    w = ClockLockWatch(1400)
    assert _feed(w, [_r(1290)] * 5) == [None] * 5  # under 10% below: a lock snapped low, not another setting
    low = _r(900, power_w=180.0)
    assert _feed(w, [low, low, _r(1400), low, low, _r(1400, REASON_SW_POWER_CAP, power_w=690.0), low, low]) == [None] * 8


def test_an_idle_reading_neither_counts_nor_breaks_a_run_of_low_ones():
    w = ClockLockWatch(1400)
    low = _r(900, power_w=180.0)
    assert _feed(w, [low, low, _r(900, power_w=60.0, util=0.0), _r(345, REASON_GPU_IDLE)]) == [None] * 4
    assert w.feed(low) is not None


def test_without_a_lock_a_clock_set_below_the_busy_clock_the_gpu_showed_trips_it():
    # A power sweep: nothing of ours is locked; another tool's nvidia-smi -lgc makes the 300 W level run
    # at 900 MHz and ~200 W, reading like a 200 W level. The busy clock seen earlier (on any level) betrays it.
    boost = {}
    first = ClockLockWatch(None, boost_mhz=boost)
    assert _feed(first, [_r(1980, power_w=280.0, limit_w=300.0), _r(1700, REASON_SW_POWER_CAP, 299.0, limit_w=300.0)]) == [None] * 2
    w = ClockLockWatch(None, boost_mhz=boost)  # the next level shares what the sweep has seen
    low = _r(900, REASON_APP_CLOCKS, power_w=200.0, limit_w=300.0)
    got = _feed(w, [low, low, low])
    assert got[:2] == [None, None]
    assert "well below the 1980 MHz it ran at busy earlier in the sweep, at 200 W of its 300 W limit" in got[2], got[2]


def test_without_a_lock_boost_drift_and_a_binding_cap_never_trip_it():
    w = ClockLockWatch(None)
    readings = ([_r(1980, power_w=250.0, limit_w=300.0)] + [_r(1740, power_w=250.0, limit_w=300.0)] * 4  # 12% drift
                + [_r(1200, REASON_SW_POWER_CAP, power_w=199.0, limit_w=200.0)] * 4)
    assert _feed(w, readings) == [None] * len(readings)
    assert ClockLockWatch(None).feed(_r(900)) is None  # nothing seen yet: nothing to compare with


def test_the_lock_granularity_and_a_few_mhz_of_read_noise_do_not_trip_it():
    # The driver snaps a lock to a supported clock (15 MHz apart on current datacenter GPUs) and NVML's
    # reading can sit a few MHz off the set clock.
    w = ClockLockWatch(1584)
    assert _feed(w, [_r(1590), _r(1605), _r(1614)] * 3) == [None] * 9


def test_an_idle_reading_between_two_high_ones_neither_counts_nor_resets():
    # Between requests the GPU idles and reads low however it is locked: that says nothing of the lock.
    w = ClockLockWatch(1200)
    assert _feed(w, [_r(1980), _r(345, REASON_GPU_IDLE)]) == [None, None]
    assert w.feed(_r(1980)) is not None


def test_each_gpu_is_watched_on_its_own():
    w = ClockLockWatch(1200)
    assert _feed(w, [_r(1980, index=0), _r(1980, index=1)]) == [None, None]
    assert "GPU 1's" in w.feed(_r(1980, index=1))


def test_a_gpu_that_does_not_report_its_clock_says_nothing():
    w = ClockLockWatch(1200)
    assert _feed(w, [_r(None), _r(None), _r(None)]) == [None] * 3


def test_a_lock_found_partway_is_named_as_found_during_the_measurement_not_as_it_began():
    # Without a lock of its own the watch learns one from busy readings the AppClocks bit holds (find_lock), which
    # may come partway through: here the first readings name no reason (a driver that sets the bit late), the lock is
    # learned at the third. The message said the lock "held it at as the measurement began", which no reading showed.
    w = ClockLockWatch(None, find_lock=True, during="the measurement")
    got = _feed(w, [_r(1200), _r(1200), _r(1200, REASON_APP_CLOCKS), _r(1980), _r(1980)])
    assert got[:4] == [None] * 4 and w.found_mhz == {0: 1200.0}
    assert "above the 1200 MHz a clock lock found during the measurement held it at:" in got[4], got[4]
    assert "began" not in got[4], got[4]


def test_the_daemons_lock_signs_see_a_lock_and_its_release_at_the_second_busy_reading_and_nothing_else():
    # collectors/limitwatch.ClockLockSigns: the daemon's witness (a lock starts a new idle setting, docs/daemon.md).
    from powerprof.collectors.limitwatch import ClockLockSigns

    signs = ClockLockSigns()
    states = [signs.feed([r])[0] for r in (
        _r(1980), _r(1980),  # busy at the top clock, no bit: no lock
        _r(1400, REASON_SW_POWER_CAP), _r(1400, REASON_SW_POWER_CAP),  # a cap holds it: a limiter, no lock
        _r(1395, REASON_APP_CLOCKS), _r(345, REASON_GPU_IDLE), _r(1395, REASON_APP_CLOCKS),  # idle between: still a run
        _r(1980), _r(1395, REASON_APP_CLOCKS), _r(1980),  # one odd read above: no release
        _r(1980), _r(1980))]  # two in a row above, no bit: released
    assert states == [None] * 6 + [1395.0] * 4 + [None] * 2
    moved = ClockLockSigns()
    for mhz in (1395, 1395, 900, 900):  # another tool locks it lower
        got = moved.feed([_r(mhz, REASON_APP_CLOCKS)])
    assert got == (900.0,)
    capped = ClockLockSigns()
    for _ in range(3):
        got = capped.feed([_r(1395, REASON_APP_CLOCKS, power_w=690.0)])
    assert got == (None,)  # at the cap (98% of it or more: clock_reasons.CAP_AT_LIMIT_FRACTION): no lock
    for _ in range(3):
        got = capped.feed([_r(1395, REASON_APP_CLOCKS | REASON_SW_POWER_CAP, power_w=600.0)])
    assert got == (None,)  # the cap named: no lock


@pytest.mark.parametrize("after", [
    (1785, REASON_SW_POWER_CAP, 299.0),  # released, then power-capped below the boost clock
    (1980, 0, 284.0),  # released, busy at the top clock at 95% of the cap, no bit
    (1700, REASON_SW_THERMAL, 250.0)])  # released, then thermally throttled
def test_the_daemons_lock_signs_see_a_release_under_a_power_cap_or_heat(after):
    # A limiter only lowers the clock: one read above the lock's ceiling proves the lock gone, whatever bit it names.
    # Before, the release needed no limiter and power under 90% of the cap: the lock stayed for ever (rev-clocklock F2).
    from powerprof.collectors.limitwatch import ClockLockSigns

    mhz, reasons, power_w = after
    signs = ClockLockSigns()
    states = [signs.feed([r])[0] for r in [_r(1395, REASON_APP_CLOCKS, limit_w=300.0)] * 2
              + [_r(mhz, reasons, power_w=power_w, limit_w=300.0)] * 2]
    assert states == [None, 1395.0, 1395.0, None]


def test_the_daemons_lock_signs_tell_when_a_busy_reading_showed_the_locks_held_or_changed():
    # ClockLockSigns.told: what the daemon's idle runs wait for (workmodel.CostLearner.lock_told).
    from powerprof.collectors.limitwatch import ClockLockSigns

    signs = ClockLockSigns()
    told = []
    for r in (_r(1980, None), _r(345, REASON_GPU_IDLE), _r(1980), _r(1395, REASON_APP_CLOCKS), _r(345, REASON_GPU_IDLE),
              _r(1395, REASON_APP_CLOCKS), _r(1395, REASON_APP_CLOCKS), _r(1980), _r(1395, REASON_APP_CLOCKS)):
        signs.feed([r])
        told.append(signs.told)
    assert told == ["blind", None, "same", None, None, "changed", "same", None, "same"]


def test_the_daemons_lock_signs_tell_same_past_another_gpus_open_run_or_an_expired_one():
    # GPU 1 read busy once under another tenant's lock (a run opened), then idle for good; GPU 0 busy at its top clock.
    # Before, GPU 1's open run kept `told` None at every sample for ever: no idle run was ever filed (rev-fix2 F1).
    from powerprof.collectors.limitwatch import ClockLockSigns

    idle1 = _r(345, REASON_GPU_IDLE, index=1)
    for matters, expire_s, want in [({0}, None, ["same"] * 3), (None, 60.0, [None, None, "same"]),
                                    (None, None, [None] * 3)]:
        signs = ClockLockSigns(expire_s=expire_s)
        signs.feed([_r(1980), _r(1395, REASON_APP_CLOCKS, index=1)], 0, matters)
        told = []
        for t_s in (1, 59, 61):
            signs.feed([_r(1980), idle1], int(t_s * 1e9), matters)
            told.append(signs.told)
        assert told == want, (matters, expire_s, told)


def test_the_daemons_lock_signs_see_a_lock_whose_busy_draw_is_90_to_98_percent_of_the_cap():
    # An H200 locked at 1400 MHz under a 250 W limit decodes at 233 W (93%), AppClocks only. Before, the 90% guard of
    # held_by_a_setting rejected it: the lock was never seen (rev-clocklock F3).
    from powerprof.collectors.limitwatch import ClockLockSigns

    signs = ClockLockSigns()
    states = [signs.feed([_r(1395, REASON_APP_CLOCKS, power_w=233.0, limit_w=250.0)])[0] for _ in range(3)]
    assert states == [None, 1395.0, 1395.0]
