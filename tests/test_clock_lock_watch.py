"""The locked-SM-clock watch of a clock sweep (sweep.ClockLockWatch): a lock another tool released or
raised trips it; a clock below the lock (a power cap, heat, idle) and a single odd read never do."""

from __future__ import annotations

from powerprof.collectors.clock_reasons import REASON_GPU_IDLE, REASON_HW_THERMAL, REASON_SW_POWER_CAP
from powerprof.collectors.nvml import GpuReading
from powerprof.sweep import ClockLockWatch


def _r(mhz, reasons=0, index=0):
    return GpuReading(index=index, power_w=250.0, power_avg_w=250.0, energy_j=1.0, sm_clock_mhz=mhz, mem_clock_mhz=4800.0,
                      gpu_util_pct=100.0, mem_util_pct=50.0, mem_used_bytes=1, temperature_c=60.0, power_limit_w=700.0,
                      enforced_limit_w=700.0, clock_event_reasons=reasons)


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


def test_readings_below_the_lock_never_trip_it_whatever_the_reason():
    w = ClockLockWatch(1500)
    readings = [_r(1400, REASON_SW_POWER_CAP), _r(1100, REASON_HW_THERMAL), _r(345, REASON_GPU_IDLE), _r(1500)] * 5
    assert _feed(w, readings) == [None] * len(readings)
    assert not w.open


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
