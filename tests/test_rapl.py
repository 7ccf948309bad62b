"""RAPL through powercap: zone discovery, wraparound, permissions, the pyRAPL backend, the simulated tree."""

from __future__ import annotations

import os

import numpy as np
import pytest

from powerprof.collectors.rapl import (
    ASSUMED_MAX_POWER_W,
    RaplCollector,
    RaplPermissionError,
    RaplUnavailableError,
    cpu_energy_j,
    discover_zones,
    wrap_delta_uj,
)
from powerprof.collectors.sampler import Sampler
from powerprof.energy import counter_energy_j
from powerprof.sim.powercap import SimPowercap


class FakeClock:
    def __init__(self):
        self.t = 5_000_000_000

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += int(round(s * 1e9))


def _tree(tmp_path, clock, **kw):
    return SimPowercap(tmp_path / "powercap", clock_ns=clock, **kw)


def _collector(pc, clock, **kw):
    return RaplCollector(pc.root, clock_ns=clock, opener=pc.opener, **kw)


def _by_zone(readings):
    return {r.zone: r for r in readings}


def _cpu_j(a, b, **kw):
    return cpu_energy_j(b, **kw)[0] - cpu_energy_j(a, **kw)[0]


def test_several_wraps_on_two_sockets_are_all_corrected(tmp_path):
    clock = FakeClock()
    watts = iter([80.0, 120.0, 40.0, 100.0] * 20)  # total over both packages, changes every step
    # 20 J range at 40-60 W per package: a package counter wraps every 2-3 reads.
    pc = _tree(tmp_path, clock, sockets=2, dram=True, power_w_fn=lambda: next(watts), max_power_w=70.0,
               max_energy_range_uj=20_000_000, dram_w=4.0)
    rc = _collector(pc, clock)
    assert [z.device for z in rc.zones] == ["package-0", "dram-0", "package-1", "dram-1"]
    assert rc.zones[2].socket == 1 and rc.zones[3].socket == 1
    e0 = pc.true_energy_j()
    first = rc.read()
    wraps = 0
    prev_raw = {z.sysfs_id: pc.counter_uj(z) for z in pc.zones}
    for _ in range(40):
        clock.advance(0.25)
        pc.update()
        raw = {z.sysfs_id: pc.counter_uj(z) for z in pc.zones}
        wraps += sum(raw[k] < prev_raw[k] for k in raw)
        prev_raw = raw
        last = rc.read()
    assert wraps >= 15, "the test must actually exercise several wraps"
    truth = pc.true_energy_j()
    got = _by_zone(last)
    for z in rc.zones:
        assert got[z.device].energy_j == pytest.approx(truth[z.sysfs_id] - e0[z.sysfs_id], abs=1e-5)
        assert got[z.device].power_w is not None and got[z.device].power_w > 0
    cpu = _cpu_j(first, last)
    expected = sum(truth[k] - e0[k] for k in truth)  # both packages + both DRAM zones
    assert cpu == pytest.approx(expected, abs=1e-4)
    assert all(r.epoch == 0 for r in last)


def test_package_die_names_and_no_dram_zone(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, sockets=1, dies_per_socket=2, dram=False, core=True, power_w_fn=lambda: 90.0)
    rc = _collector(pc, clock)
    kinds = {z.device: (z.kind, z.socket, z.die) for z in rc.zones}
    assert kinds == {
        "package-0-die-0": ("package", 0, 0),
        "core-0-die-0": ("core", 0, 0),
        "package-0-die-1": ("package", 0, 1),
        "core-0-die-1": ("core", 0, 1),
    }
    a = rc.read()
    clock.advance(2.0)
    pc.update()
    b = rc.read()
    # Both dies' packages, not their core subzones (inside the package) and no DRAM.
    assert _cpu_j(a, b) == pytest.approx(90.0 * 2.0, rel=1e-6)
    assert cpu_energy_j(b, kinds=("dram",)) == (None, 0)


def test_mmio_duplicate_and_psys_are_not_added_to_cpu_energy(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, mmio=True, psys=True, power_w_fn=lambda: 50.0, dram_w=5.0)
    assert (pc.root / "intel-rapl-mmio:0" / "energy_uj").exists()
    rc = _collector(pc, clock)
    assert sorted(z.device for z in rc.zones) == ["dram-0", "package-0", "psys"]
    a = rc.read()
    clock.advance(10.0)
    pc.update()
    b = rc.read()
    assert _cpu_j(a, b) == pytest.approx(550.0, rel=1e-6)  # not 1050 (mmio) nor 1180 (psys)
    assert _by_zone(b)["psys"].power_w == pytest.approx(50 + 5 + 8, rel=1e-6)


def test_subzone_only_nested_inside_its_parent_is_found(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dram=True)
    os.unlink(pc.root / "intel-rapl:0:0")  # some kernels expose subzones only under the parent
    assert [z.device for z in discover_zones(pc.root)] == ["package-0", "dram-0"]


def test_unreadable_energy_uj_gives_a_clear_error_naming_the_fix(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, unreadable=True)
    assert oct(os.stat(pc.root / "intel-rapl:0" / "energy_uj").st_mode & 0o777) == "0o400"
    for backend in ("sysfs", "pyrapl"):
        with pytest.raises(RaplPermissionError) as ei:
            _collector(pc, clock, backend=backend)
        msg = str(ei.value)
        assert "energy_uj" in msg and "root" in msg
        assert "ExecStartPre=+" in msg and "udev" in msg and "chmod g+r" in msg
        assert isinstance(ei.value, PermissionError)


def test_no_zones_is_unavailable_not_zero(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RaplUnavailableError, match="no RAPL zones"):
        RaplCollector(tmp_path / "empty")
    with pytest.raises(RaplUnavailableError):
        RaplCollector(tmp_path / "missing")


def test_unknown_range_drops_a_backwards_delta_instead_of_going_negative(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: 40.0, max_energy_range_uj=50_000_000,
               start_energy_uj=0)
    os.unlink(pc.root / "intel-rapl:0" / "max_energy_range_uj")
    rc = _collector(pc, clock)
    assert rc.zones[0].max_energy_range_uj is None
    readings = [rc.read()[0]]
    for _ in range(5):  # 20 J per step on a 50 J counter: 0, 20, 40, 10 (wrap), 30, 0 (wrap)
        clock.advance(0.5)
        pc.update()
        readings.append(rc.read()[0])
    energies = [r.energy_j for r in readings]
    assert energies == sorted(energies), "cumulative energy must never go down"
    dropped = [k for k, r in enumerate(readings) if r.note]
    assert dropped == [3, 5] and all(readings[k].power_w is None for k in dropped)
    assert all(r.power_w is None or r.power_w > 0 for r in readings)
    # Energies from different epochs must not be subtracted.
    t = np.arange(len(readings)) * 500_000_000
    e, epoch = zip(*(cpu_energy_j([r]) for r in readings))
    assert np.isnan(counter_energy_j(t, e, t[0], t[-1], epoch))
    assert counter_energy_j(t, e, t[3], t[4], epoch) == pytest.approx(20.0, rel=1e-6)


def test_read_gap_longer_than_the_wrap_period_drops_the_delta(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: 10.0, max_power_w=20.0,
               max_energy_range_uj=10_000_000)
    rc = _collector(pc, clock)
    assert rc.min_wrap_period_s == pytest.approx(0.5)
    a = rc.read()[0]
    clock.advance(0.8)  # more than one wrap period: the number of wraps is unknowable
    pc.update()
    b = rc.read()[0]
    assert b.power_w is None and b.epoch == a.epoch + 1 and "wrap period" in b.note
    clock.advance(0.2)
    pc.update()
    c = rc.read()[0]
    assert c.power_w == pytest.approx(10.0, rel=1e-6) and c.epoch == b.epoch


def test_sampler_refuses_an_interval_that_could_miss_a_wrap(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, max_power_w=100.0, max_energy_range_uj=100_000_000)  # wraps every 1 s at 100 W
    rc = _collector(pc, clock)
    with pytest.raises(ValueError, match="wrap"):
        Sampler([rc], interval_s=1.0)
    Sampler([rc], interval_s=0.5)


def test_pyrapl_backend_reads_the_same_energy_through_the_same_interface(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dies_per_socket=2, dram=False, power_w_fn=lambda: 60.0,
               max_energy_range_uj=25_000_000, max_power_w=80.0)
    ours = _collector(pc, clock, backend="sysfs")
    theirs = _collector(pc, clock, backend="pyrapl")
    assert [z.device for z in theirs.zones] == ["package-0-die-0", "package-0-die-1"]
    for _ in range(12):  # 7.5 J per die per step on a 25 J counter: wraps every ~3 reads
        clock.advance(0.25)
        pc.update()
        a, b = ours.read(), theirs.read()
    assert [r.energy_j for r in b] == pytest.approx([r.energy_j for r in a], abs=1e-9)
    assert [r.energy_j for r in b] == pytest.approx([90.0, 90.0], abs=1e-5)
    theirs.close()


def test_unknown_backend_is_rejected(tmp_path):
    pc = _tree(tmp_path, FakeClock())
    with pytest.raises(ValueError, match="backend"):
        RaplCollector(pc.root, backend="msr")


def test_wrap_delta_arithmetic():
    assert wrap_delta_uj(100, 250, 1000) == 150
    assert wrap_delta_uj(900, 100, 1000) == 200
    assert wrap_delta_uj(900, 100, None) is None


def test_simulated_tree_energy_is_the_integral_of_its_power(tmp_path):
    clock = FakeClock()
    plan = [30.0, 75.0, 10.0, 120.0, 45.0]
    it = iter(plan + [0.0])
    pc = _tree(tmp_path, clock, power_w_fn=lambda: next(it), dram_w=2.0)
    steps = [1.5, 0.3, 4.0, 0.7, 2.2]
    for dt in steps:
        clock.advance(dt)
        pc.update()
    truth = pc.true_energy_j()
    assert truth["intel-rapl:0"] == pytest.approx(sum(p * d for p, d in zip(plan, steps)), rel=1e-12)
    assert truth["intel-rapl:0:0"] == pytest.approx(2.0 * sum(steps), rel=1e-12)
    pc.close()


def test_background_updates_advance_the_counters_and_stop_cleanly(tmp_path):
    import time

    t_start = time.monotonic()
    pc = SimPowercap(tmp_path / "pc", power_w_fn=lambda: 100.0, update_interval_s=0.005)
    rc = RaplCollector(pc.root)
    pc.start()
    rc.read()
    t0 = time.monotonic()
    time.sleep(0.3)
    r = _by_zone(rc.read())["package-0"]
    t1 = time.monotonic()  # a loaded machine sleeps longer than asked: bound by what elapsed
    pc.stop()
    # The counter moves only when the updater runs, so the delta between the reads can lag the
    # wall clock by an update or two, but never exceeds the energy since the simulator was made.
    assert 100.0 * (t1 - t0 - 0.15) < r.energy_j <= 100.0 * (t1 - t_start) + 1e-6
    frozen = pc.true_energy_j()
    time.sleep(0.05)
    assert pc.true_energy_j() == frozen, "no updates after stop()"
    pc.close()


def test_a_failing_counter_write_is_counted_and_the_updater_goes_on(tmp_path, monkeypatch):
    # Before: an OSError from os.pwrite (another test's patched full disk) killed the updater thread with an unhandled
    # traceback (CI: PytestUnhandledThreadExceptionWarning), and the counters froze for the rest of the run.
    import errno
    import threading
    import time

    import powerprof.sim.powercap as powercap_mod

    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    real = os.pwrite
    full = {"on": False}

    def pwrite(fd, data, offset):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(powercap_mod.os, "pwrite", pwrite)
    pc = SimPowercap(tmp_path / "pc", power_w_fn=lambda: 100.0, update_interval_s=0.002).start()
    try:
        full["on"] = True
        for _ in range(500):
            if getattr(pc, "write_errors", 0) >= 3 or not pc._thread.is_alive():
                break
            time.sleep(0.01)
        full["on"] = False
        assert pc._thread.is_alive(), f"the updater died: {unhandled}"
        assert pc.write_errors >= 3 and "No space left on device" in pc.last_write_error
        rc = RaplCollector(pc.root)
        rc.read()
        time.sleep(0.1)
        assert _by_zone(rc.read())["package-0"].energy_j > 0, "the counters move again once writes succeed"
    finally:
        pc.close()
    assert not unhandled


def test_permission_lost_after_start_is_a_counted_sampler_error(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock)
    rc = _collector(pc, clock)
    sampler = Sampler([rc], interval_s=1.0)
    assert sampler.sample_now("before")["rapl"].ok
    pc.unreadable = True
    for p in pc.energy_paths():
        os.chmod(p, 0o400)
    s = sampler.sample_now("after")["rapl"]
    assert not s.ok and "RaplPermissionError" in s.error and "ExecStartPre=+" in s.error
    assert sampler.errors["rapl"] == 1


def test_back_to_back_reads_have_no_power_figure_never_a_false_zero(tmp_path):
    # An on-demand edge sample a few ms after a tick spans less than the counter's update step: the
    # counter may not have moved, and 0 W (or a spike) over that interval is not a measurement.
    clock = FakeClock()
    pc = _tree(tmp_path, clock, power_w_fn=lambda: 40.0)
    # Plain open: the tree's opener brings the counter up to the read instant, hardware's steps.
    rc = RaplCollector(pc.root, clock_ns=clock)
    rc.read()
    clock.advance(1.0)
    pc.update()
    full = _by_zone(rc.read())["package-0"]
    clock.advance(0.002)  # no counter update in between: the delta is 0
    quick = _by_zone(rc.read())["package-0"]
    assert full.power_w == pytest.approx(40.0, rel=1e-6)
    assert quick.power_w is None and quick.energy_j == full.energy_j


def test_a_stalled_updater_reads_what_hardware_would_never_a_jump(tmp_path):
    # The daemon stalled ~19 s on a loaded machine; the simulated counter's updater thread stalled
    # with it and caught up in one step, so one samples/ row showed 3118 W of CPU package power.
    clock = FakeClock()
    pc = _tree(tmp_path, clock, sockets=1, power_w_fn=lambda: 40.0, dram_w=3.0)
    rc = _collector(pc, clock)
    rc.read()
    clock.advance(19.0)  # nothing updates the tree: its background thread is stalled too
    after_stall = _by_zone(rc.read())
    clock.advance(0.25)
    pc.update()  # the updater wakes up
    next_tick = _by_zone(rc.read())
    for got in (after_stall, next_tick):
        assert got["package-0"].power_w == pytest.approx(40.0, rel=1e-6)
        assert got["dram-0"].power_w == pytest.approx(3.0, rel=1e-6)
        assert all(r.note is None and r.epoch == 0 for r in got.values())
    assert next_tick["package-0"].energy_j == pytest.approx(40.0 * 19.25, rel=1e-9)
    assert pc.true_energy_j()["intel-rapl:0"] == pytest.approx(40.0 * 19.25, rel=1e-9)


def test_pyrapl_backend_also_reads_the_counter_as_of_the_read(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: 60.0)
    rc = _collector(pc, clock, backend="pyrapl")
    rc.read()
    clock.advance(5.0)  # no update(): only the read can move the counter
    assert rc.read()[0].power_w == pytest.approx(60.0, rel=1e-6)
    rc.close()


def _reset_counter(pc, z):
    """The counter restarts at 0 (a driver reload, a resume): the reader sees it go backwards."""
    z.start_uj = -int(z.energy_j * 1e6)


@pytest.mark.parametrize("gap_s", [1.0, 0.002])
def test_a_counter_jump_above_the_zones_maximum_is_dropped_with_a_reason(tmp_path, gap_s):
    # A reset read as one wrap adds a whole max_energy_range_uj (262 kJ): stored, that is 262 kW.
    clock = FakeClock()
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: 40.0, max_power_w=100.0, start_energy_uj=10**9)
    rc = _collector(pc, clock)
    rc.read()
    clock.advance(1.0)
    before = rc.read()[0]
    _reset_counter(pc, pc.zones[0])
    clock.advance(gap_s)
    pc.update()
    jumped = rc.read()[0]
    assert jumped.power_w is None and jumped.energy_j == before.energy_j
    assert "counter jumped" in jumped.note and "above 300 W" in jumped.note
    assert jumped.epoch == before.epoch + 1, "windows across the jump must not be subtracted"
    clock.advance(1.0)
    ok = rc.read()[0]
    assert ok.power_w == pytest.approx(40.0, rel=1e-6) and ok.note is None and ok.epoch == jumped.epoch


def test_an_operators_low_limit_is_no_bound_on_the_energy_kept(tmp_path):
    # A zone that publishes no max_power_uw, its limits set to PL1 = PL2 = 35 W: the jump bound was
    # 3 x 35 W, so 150 W drawn (the limits raised after the collector started, or not enforced) was
    # dropped as a "counter jump", energy lost. The assumed maximum bounds it; a reset still trips it.
    clock = FakeClock()
    watts = iter([30.0, 150.0, 150.0, 150.0, 150.0])
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: next(watts), start_energy_uj=10**9)
    (pkg,) = [z for z in pc.zones if z.kind == "package"]
    for f in pkg.path.glob("constraint_*_max_power_uw"):
        f.unlink()
    for f in pkg.path.glob("constraint_*_power_limit_uw"):
        f.write_text("35000000\n")
    rc = _collector(pc, clock)
    rc.read()
    clock.advance(1.0)
    pc.update()
    assert rc.read()[0].power_w == pytest.approx(30.0, rel=1e-6)
    clock.advance(1.0)
    pc.update()
    r = rc.read()[0]
    assert r.power_w == pytest.approx(150.0, rel=1e-6) and r.note is None and r.energy_j == pytest.approx(180.0)
    _reset_counter(pc, pc.zones[0])
    clock.advance(1.0)
    pc.update()
    jumped = rc.read()[0]
    assert jumped.power_w is None and "counter jumped" in jumped.note and "1500 W" in jumped.note
    assert "assumed: it publishes none" in jumped.note
    (zone,) = rc.zones
    assert zone.max_power_w is None and zone.power_limit_w == 35.0
    assert zone.top_power_w == ASSUMED_MAX_POWER_W["package"]


def test_a_burst_up_to_the_zones_maximum_is_kept(tmp_path):
    clock = FakeClock()
    watts = iter([20.0, 100.0, 100.0, 100.0])  # at the published 100 W maximum: a real figure, not a jump
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: next(watts), max_power_w=100.0)
    rc = _collector(pc, clock)
    rc.read()
    clock.advance(0.06)
    pc.update()
    assert rc.read()[0].power_w == pytest.approx(20.0, rel=1e-6)
    clock.advance(0.06)
    pc.update()
    r = rc.read()[0]
    assert r.power_w == pytest.approx(100.0, rel=1e-6) and r.note is None


def test_a_counter_that_never_moves_is_no_figure_never_0_w(tmp_path):
    # A VM exposing a stub RAPL: the files are there, the counters stand still. 0 J of CPU energy
    # went into every GPU+CPU J/token as if the CPU had drawn nothing.
    clock = FakeClock()
    pc = _tree(tmp_path, clock, power_w_fn=lambda: 0.0, dram_w=0.0)
    rc = RaplCollector(pc.root, clock_ns=clock)  # plain open: the counters move only when the tree updates
    readings, t = [rc.read()], [clock()]
    for _ in range(20):
        clock.advance(0.1)
        pc.update()
        readings.append(rc.read())
        t.append(clock())
    last = _by_zone(readings[-1])
    for zone in ("package-0", "dram-0"):
        assert last[zone].energy_j is None and last[zone].power_w is None
        assert "unmoved" in last[zone].note and "stub" in last[zone].note
    assert cpu_energy_j(readings[-1])[0] is None
    # Through the timeline rule: no window over the run has a CPU figure, not 0 J.
    e, epoch = zip(*(cpu_energy_j(r) for r in readings))
    kept = [k for k, v in enumerate(e) if v is not None]
    tk = np.array([t[k] for k in kept])
    ek = np.array([e[k] for k in kept])
    pk = np.array([epoch[k] for k in kept])
    assert np.isnan(counter_energy_j(tk, ek, t[0], t[-1], pk))


def test_a_live_low_power_counter_is_not_taken_for_a_stub(tmp_path):
    clock = FakeClock()
    pc = _tree(tmp_path, clock, power_w_fn=lambda: 1.0, dram_w=0.5)
    rc = RaplCollector(pc.root, clock_ns=clock)
    rc.read()
    for _ in range(30):
        clock.advance(0.1)
        pc.update()
        r = _by_zone(rc.read())
    assert r["package-0"].power_w == pytest.approx(1.0, rel=1e-6) and r["package-0"].note is None
    assert r["dram-0"].energy_j == pytest.approx(1.5, rel=1e-6) and r["dram-0"].epoch == 0


def test_a_counter_that_stalls_then_moves_again_drops_the_stalled_span(tmp_path):
    clock = FakeClock()
    watts = [40.0]
    pc = _tree(tmp_path, clock, dram=False, power_w_fn=lambda: watts[0])
    rc = RaplCollector(pc.root, clock_ns=clock)
    rc.read()
    clock.advance(0.5)
    pc.update()
    before = rc.read()[0]
    assert before.power_w == pytest.approx(40.0, rel=1e-6)
    watts[0] = 0.0  # the counter stands still (held by firmware, a hypervisor that stopped forwarding it)
    for _ in range(5):
        clock.advance(0.1)
        pc.update()
        stalled = rc.read()[0]
    assert stalled.energy_j is None and stalled.epoch == before.epoch + 1
    watts[0] = 40.0
    pc.update()  # the tree holds each power until its next update
    clock.advance(0.1)
    pc.update()
    resumed = rc.read()[0]
    assert resumed.power_w is None and "moved again" in resumed.note and resumed.epoch == stalled.epoch + 1
    clock.advance(0.5)
    pc.update()
    ok = rc.read()[0]
    assert ok.power_w == pytest.approx(40.0, rel=1e-6) and ok.note is None


def test_measure_says_why_gpu_plus_cpu_is_empty_when_rapl_gives_no_figure(tmp_path):
    # RAPL opened fine, then gave no CPU figure (here a stub whose counters stand still): the GPU+CPU
    # column was a bare '-' beside a GPU figure, with no word on why.
    from powerprof.rig import Rig
    from powerprof.workload.client import RequestParams
    from powerprof.workload.measure import run_measure
    from powerprof.workload.load import Prompt

    with Rig("seed-16g") as rig:
        assert rig.sources.rapl is not None
        rig.sim_powercap.power_w_fn = lambda: 0.0
        rig.sim_powercap.dram_w = 0.0
        res = run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=[Prompt("p", "hello")], n_requests=3,
                          concurrencies=[1], params=RequestParams(max_tokens=48), warmup=1, interval_s=0.1)
    (m,) = res.summaries
    assert m.gpu_j_per_token is not None and m.total_j_per_token is None
    (note,) = [n for n in res.notes if "no GPU+CPU figure" in n]
    assert "3 of 3 windows have no CPU energy" in note and "counter unmoved" in note and "fix:" in note


def test_the_permission_fix_printed_is_the_units_line_and_works_on_a_tree_without_subzones(tmp_path):
    # The printed ExecStartPre (`chgrp powerprof .../intel-rapl:*/energy_uj .../intel-rapl:*:*/energy_uj`)
    # failed where a package has no subzone (the second glob stays literal: chgrp exits 1, the unit does not
    # start), and it told people to join `powerprof`, the daemon's group that no person joins.
    import grp
    import re
    import subprocess
    from pathlib import Path

    from powerprof.collectors.rapl import PERMISSION_FIX

    (line,) = [x.strip() for x in PERMISSION_FIX.splitlines() if x.strip().startswith("ExecStartPre=")]
    unit = (Path(__file__).parents[1] / "systemd" / "powerprof.service").read_text()
    assert line in unit.splitlines()
    assert "usermod -aG powerprof" not in PERMISSION_FIX
    pc = SimPowercap(tmp_path / "powercap", dram=False, mmio=False, unreadable=True)
    assert not list(pc.root.glob("intel-rapl:*:*"))
    body = re.match(r"ExecStartPre=\+/bin/sh -c '(.*)'$", line).group(1).replace("$$", "$")
    body = body.replace("/sys/class/powercap", str(pc.root)).replace("powerprof", grp.getgrgid(os.getgid()).gr_name)
    assert subprocess.run(["/bin/sh", "-c", body]).returncode == 0
    assert os.stat(pc.root / "intel-rapl:0" / "energy_uj").st_mode & 0o040


def test_a_socket_without_a_dram_zone_is_said_never_a_silently_smaller_cpu_figure(tmp_path):
    # intel-rapl:0 has no DRAM subzone, intel-rapl:1 has one: "CPU energy (package + DRAM)" was socket 0's
    # package alone plus socket 1's package and memory, with nothing saying so.
    from powerprof.collectors.sources import open_sources

    clock = FakeClock()
    pc = _tree(tmp_path, clock, sockets=2, dram={1}, power_w_fn=lambda: 100.0)
    assert [z.device for z in _collector(pc, clock).zones if z.kind == "dram"] == ["dram-1"]
    with open_sources(nvml=_no_gpu(), rapl_root=pc.root, rapl_opener=pc.opener, host=False) as src:
        said = [p.message for p in src.problems if p.source == "rapl"]
    assert len(said) == 1 and "socket 0" in said[0] and "DRAM" in said[0] and "package" in said[0], said
    pc_all = _tree(tmp_path / "all", clock, sockets=2, dram=True)
    with open_sources(nvml=_no_gpu(), rapl_root=pc_all.root, rapl_opener=pc_all.opener, host=False) as src:
        assert [p for p in src.problems if p.source == "rapl"] == []


def test_an_amd_host_whose_energy_is_only_in_the_amd_energy_hwmon_is_told_powerprof_does_not_read_it(tmp_path):
    from powerprof.collectors.sources import open_sources

    sysclass = tmp_path / "class"
    (sysclass / "powercap").mkdir(parents=True)  # present, no zone (a kernel before 5.11 on AMD Zen)
    hw = sysclass / "hwmon" / "hwmon3"
    hw.mkdir(parents=True)
    (hw / "name").write_text("amd_energy\n")
    with open_sources(nvml=_no_gpu(), rapl_root=sysclass / "powercap", host=False) as src:
        p = [p for p in src.problems if p.source == "rapl"]
    assert len(p) == 1 and "amd_energy" in p[0].message and str(hw) in p[0].message, p
    assert "does not read" in p[0].message and "5.11" in p[0].fix, p


def _no_gpu():
    import pynvml
    from types import SimpleNamespace

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    return SimpleNamespace(nvmlInit=fail)
