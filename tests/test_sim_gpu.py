"""The simulated GPU's physics: what every accuracy test downstream relies on."""

from __future__ import annotations

import pytest

from powerprof.sim.gpu import Phase, step_time_factor
from powerprof.sim.nvml import SimNVML


class FakeClock:
    def __init__(self):
        self.t = 1_000_000_000

    def __call__(self):
        return self.t

    def advance(self, s):
        self.t += int(s * 1e9)


def _decode_at(limit_w, profile="seed-16g", c=0.45):
    n = SimNVML(profile, state_path=None)
    g = n.gpus[0]
    g.set_limit_w(limit_w)
    g.set_phase(Phase("decode", c))
    f, p, reasons = g._state
    return f, p, reasons, step_time_factor(c, f, g.profile.sm_clock_max_mhz)


def test_power_never_exceeds_an_engaged_cap_and_clock_falls_with_it():
    prev_f = None
    for limit in (300, 260, 220, 180, 150):
        f, p, reasons, _ = _decode_at(limit)
        assert p <= limit + 1e-9
        if prev_f is not None:
            assert f <= prev_f
        prev_f = f
    f, p, reasons, _ = _decode_at(180)
    assert reasons & 0x4, "SwPowerCap must be reported while the cap binds"


def test_seed_profile_reproduces_the_manual_study():
    # Seed 000: 220 W about 7% slower and about 14% less J/token than 300 W; 180 W costs >10%.
    _, p300, _, s300 = _decode_at(300)
    _, p220, _, s220 = _decode_at(220)
    _, p180, _, s180 = _decode_at(180)
    loss220 = 1 - s300 / s220
    saving220 = 1 - (p220 * s220) / (p300 * s300)
    assert 0.05 < loss220 < 0.09
    assert 0.12 < saving220 < 0.17
    assert 1 - s300 / s180 > 0.10


def test_energy_counter_is_the_integral_of_power():
    clock = FakeClock()
    n = SimNVML("a100-40g", clock_ns=clock, state_path=None)
    g = n.gpus[0]
    expected = 0.0
    plan = [(Phase("idle"), 2.0, None), (Phase("decode", 0.2), 3.5, None), (Phase("prefill", 0.9), 0.7, 250),
            (Phase("decode", 0.2), 1.3, 150), (Phase("idle"), 4.0, 400)]
    e0 = g.true_energy_j()
    for phase, secs, limit in plan:
        if limit is not None:
            g.set_limit_w(limit)
        g.set_phase(phase)
        expected += g.true_power_w() * secs
        clock.advance(secs)
    assert g.true_energy_j() - e0 == pytest.approx(expected, rel=1e-12)


def test_limits_persist_across_processes_through_the_state_file(tmp_path):
    path = tmp_path / "sim.json"
    a = SimNVML("seed-16g", state_path=path)
    a.nvmlInit()
    a.nvmlDeviceSetPowerManagementLimit(a.nvmlDeviceGetHandleByIndex(0), 180_000)
    b = SimNVML("seed-16g", state_path=path)
    b.nvmlInit()
    assert b.nvmlDeviceGetPowerManagementLimit(b.nvmlDeviceGetHandleByIndex(0)) == 180_000
    b.nvmlDeviceSetPowerManagementLimit(b.nvmlDeviceGetHandleByIndex(0), 300_000)
    assert a.nvmlDeviceGetPowerManagementLimit(a.nvmlDeviceGetHandleByIndex(0)) == 300_000


SEED0 = "GPU-120f3146-ea43-d621-928b-197932ac1b31"  # seed-16g's GPU 0 (sim_uuid)


@pytest.mark.parametrize("text,said", [
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"' + SEED0 + '": {"power_limit_mw": 2', "not valid JSON"),
    ('{"' + SEED0 + '": 5}', "is no JSON object"),
    ('{"' + SEED0 + '": {"power_limit_mw": 99999999}}', "power_limit_mw 99999999 is no limit of this card (150-320 W)"),
    ('{"' + SEED0 + '": {"power_limit_mw": true}}', "power_limit_mw True is no limit of this card"),
    ('{"' + SEED0 + '": {"locked_clocks_mhz": [2000, 900]}}', "locked_clocks_mhz [2000, 900] is no [min, max] lock"),
    ('{"' + SEED0 + '": {"locked_clocks_mhz": "fast"}}', "locked_clocks_mhz 'fast' is no [min, max] lock"),
])
def test_a_state_file_the_simulator_never_wrote_is_said_and_read_as_the_defaults(tmp_path, monkeypatch, caplog, text, said):
    # A JSON list was a traceback (`devices --simulate`: 'list' object has no attribute 'get'), truncated JSON read as
    # the defaults without a word, and power_limit_mw 99999999 showed a 150-320 W card at "power limit 100000 W".
    from click.testing import CliRunner

    from powerprof.cli import main

    path = tmp_path / "sim.json"
    path.write_text(text)
    caplog.set_level("WARNING", logger="powerprof.sim.nvml")
    nv = SimNVML("seed-16g", state_path=path)
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    assert nv.nvmlDeviceGetPowerManagementLimit(h) == 300_000 and nv.gpus[0].locked_clocks_mhz is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and str(path) in lines[0] and said in lines[0] and "default" in lines[0], lines
    assert path.read_text() == text  # read, not rewritten: nothing changed until a setting is
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(path))
    r = CliRunner().invoke(main, ["devices", "--simulate"])
    assert r.exit_code == 0 and r.exception is None and "power limit 300 W" in r.output, r.output
    # A setting made is kept, in place of what could not be used.
    nv.nvmlDeviceSetPowerManagementLimit(h, 200_000)
    other = SimNVML("seed-16g", state_path=path)
    assert other.gpus[0].limit_w == 200.0


def test_a_mixed_host_has_each_cards_own_profile_limits_and_default_after_a_reset(tmp_path):
    import pynvml

    path = tmp_path / "sim.json"
    nv = SimNVML("h200-141g,l4-24g", state_path=path)
    nv.nvmlInit()
    h = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    assert [nv.nvmlDeviceGetName(x) for x in h] == ["Simulated NVIDIA H200", "Simulated NVIDIA L4"]
    assert [nv.nvmlDeviceGetPowerManagementLimitConstraints(x) for x in h] == [[200_000, 700_000], [40_000, 72_000]]
    with pytest.raises(pynvml.NVMLError):
        nv.nvmlDeviceSetPowerManagementLimit(h[1], 180_000)  # 180 W is no L4 limit
    nv.nvmlDeviceSetPowerManagementLimit(h[1], 50_000)
    nv.nvmlDeviceSetPowerManagementLimit(h[0], 300_000)
    # Another process on the same state file sees each card's own limit, and a reset brings each its own default.
    other = SimNVML("h200-141g,l4-24g", state_path=path)
    other.nvmlInit()
    assert [other.nvmlDeviceGetPowerManagementLimit(other.nvmlDeviceGetHandleByIndex(i)) for i in range(2)] == [300_000, 50_000]
    nv.external_reset(1)
    assert nv.nvmlDeviceGetPowerManagementLimit(h[1]) == 72_000 and nv.nvmlDeviceGetPowerManagementLimit(h[0]) == 300_000
    nv.external_reset(0)
    assert [other.nvmlDeviceGetPowerManagementLimit(other.nvmlDeviceGetHandleByIndex(i)) for i in range(2)] == [700_000, 72_000]
    # The single-profile way is unchanged: one key, `count` GPUs of it, the same UUIDs as before.
    one = SimNVML("h200-141g", count=2, state_path=None)
    assert [g.uuid for g in one.gpus][0] == nv.gpus[0].uuid and one.gpus[1].profile.key == "h200-141g"
    with pytest.raises(ValueError, match="one per GPU"):
        SimNVML("h200-141g,l4-24g", count=3, state_path=None)
    with pytest.raises(KeyError, match="choose one of"):
        SimNVML("h200-141g,l5", state_path=None)


def test_the_simulated_h200s_instant_power_is_as_stale_as_a_real_ones():
    """A real H200's field 186 changed value every ~100 ms, like its counter (docs/hardware.md): a read shows the
    power as of the last refresh, so a read just after a power step still shows the power before it. Every figure
    resting on instant power on the simulated H200 (short windows, cards without a counter) must see that."""
    clock = FakeClock()  # 1.000 s: on a refresh
    n = SimNVML("h200-141g", state_path=None, clock_ns=clock)
    g = n.gpus[0]
    idle_w = g.instant_power_w()
    clock.advance(0.01)
    g.set_phase(Phase("decode", g.profile.workload.decode_compute_share))
    decode_w = g.true_power_w()
    assert decode_w > idle_w + 50
    clock.advance(0.05)  # 60 ms after the refresh, 50 ms into decode: still the idle value
    assert g.instant_power_w() == idle_w
    clock.advance(0.05)  # past the next refresh (1.1 s): decode
    assert g.instant_power_w() == decode_w


def test_a_damaged_state_file_is_said_once_a_process(tmp_path, caplog):
    # `restore --simulate` opens a simulator per restore record beside the rig's: the warning was said by each.
    import logging

    p = tmp_path / "sim.json"
    p.write_text("[1, 2]")
    with caplog.at_level(logging.WARNING):
        SimNVML("seed-16g", state_path=p)
        SimNVML("seed-16g", state_path=p)
    assert len([r for r in caplog.records if "simulator state file" in r.getMessage()]) == 1


def test_the_state_file_follows_no_symlink_at_its_lock_or_its_temporary(tmp_path, monkeypatch):
    # The lock was opened "a+", following a symlink planted at `sim.json.lock` (root made an empty file wherever it
    # pointed), and each write went to the predictable `.sim.json.<pid>.tmp`, through a symlink planted there onto a
    # file of root's (replaced by the state's JSON).
    import os

    path = tmp_path / "sim.json"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    for pid in range(os.getpid() - 5, os.getpid() + 5):
        os.symlink(victim, tmp_path / f".sim.json.{pid}.tmp")
        os.symlink(victim, tmp_path / f".sim.json.load.{pid}.tmp")
    n = SimNVML("seed-16g", state_path=path)
    n.nvmlInit()
    n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), 180_000)
    n.publish_load()
    assert victim.read_text() == "keep" and SimNVML("seed-16g", state_path=path).gpus[0].limit_w == 180
    # A symlink at the lock's name: refused, one line, never followed.
    made = tmp_path / "made-by-the-lock"
    os.unlink(str(path) + ".lock")
    os.symlink(made, str(path) + ".lock")
    with pytest.raises(PermissionError) as e:
        n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), 200_000)
    assert "symlink" in str(e.value) and str(path) + ".lock" in str(e.value), str(e.value)
    assert not os.path.lexists(made)


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="root's refusal: only root can chown a folder to uid 65534")
def test_as_root_a_state_file_in_a_folder_another_user_controls_is_refused(tmp_path, monkeypatch):
    # Root followed POWERPROF_SIM_STATE into another user's folder, where they could plant symlinks at the names it writes.
    import os

    from click.testing import CliRunner

    from powerprof.cli import main

    monkeypatch.delenv("SUDO_UID", raising=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(theirs / "sim.json"))
    with pytest.raises(PermissionError) as e:
        SimNVML("seed-16g")
    assert "refusing" in str(e.value) and "owned by uid 65534" in str(e.value), str(e.value)
    for args in (["devices", "--simulate"], ["sweep", "--simulate", "--limits", "200,300", "--max-time", "3",
                                             "--out", str(tmp_path / "run")]):
        r = CliRunner().invoke(main, args)
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
        assert f"simulator state file {theirs / 'sim.json'}" in said and "owned by uid 65534" in said, said
        assert "Traceback" not in r.output
    assert list(theirs.iterdir()) == [] and not (tmp_path / "run").exists()
    # The daemon logged "ERROR … restoring the limits left by a crashed sweep failed: SimStateRefused: …" before its
    # one-line error, though no sweep had crashed: the refusal is said once, as the error.
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "--data-dir",
                        str(tmp_path / "data"), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
                       capture_output=True, text=True, timeout=120)
    said = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 1 and said.count("owned by uid 65534") == 1, said
    assert "crashed sweep" not in said and "Traceback" not in said, said
    monkeypatch.setenv("SUDO_UID", "65534")  # the user who ran sudo: their own folder, as for `sweep --out`
    SimNVML("seed-16g")


@pytest.mark.skipif(__import__("os").geteuid() != 0, reason="root's refusal: only root can chown a path to uid 65534")
def test_as_root_a_state_path_through_another_users_symlink_is_refused_before_it_is_resolved(tmp_path):
    # f7e660d5 resolved POWERPROF_SIM_STATE (realpath) before the trust check, which saw only the target's folder: a
    # user's symlink on the way (their folder `d` -> a root-only folder) made root replace a 0600 root file there with
    # JSON, mode 0644. Checked as given first (each folder, each symlink's owner), resolved only after.
    import os

    from powerprof.sim.nvml import SimStateRefused

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir(mode=0o700)
    theirs.mkdir()
    secret = mine / "secret"
    secret.write_text("root:secret\n")
    os.chmod(secret, 0o600)
    os.chown(theirs, 65534, 65534)
    (theirs / "d").symlink_to(mine)  # their folder's link into root's
    (theirs / "link").symlink_to(secret)
    os.lchown(theirs / "d", 65534, 65534)
    os.lchown(theirs / "link", 65534, 65534)
    (mine / "their.json").symlink_to(secret)  # their symlink in root's folder (chowned to them)
    os.lchown(mine / "their.json", 65534, 65534)
    (mine / "via.json").symlink_to(theirs / "link")  # root's symlink to their symlink
    for given in (theirs / "d" / "secret", mine / "their.json", mine / "via.json"):
        with pytest.raises(SimStateRefused) as e:
            SimNVML("seed-16g", count=1, state_path=given)
        said = str(e.value)
        assert said.startswith(f"simulator state file {given}:") and "uid 65534" in said, said
    assert secret.read_text() == "root:secret\n" and secret.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in mine.iterdir()) == ["secret", "their.json", "via.json"]
    # Root's own symlink in root's folder is written through, and named as given.
    (mine / "root.json").symlink_to(mine / "real.json")
    nvml = SimNVML("seed-16g", count=1, state_path=mine / "root.json")
    nvml.nvmlInit()
    nvml.nvmlDeviceSetPowerManagementLimit(nvml.nvmlDeviceGetHandleByIndex(0), 200_000)
    assert (mine / "root.json").is_symlink() and "power_limit_mw" in (mine / "real.json").read_text()


def test_the_packages_lazy_simnvml_is_cached_listed_and_safe_to_ask_for_without_pynvml():
    # powerprof.sim's SimNVML is imported on first use (module __getattr__): it was imported again on every access,
    # missing from dir(), and where pynvml cannot be imported hasattr(powerprof.sim, "SimNVML") raised
    # ModuleNotFoundError instead of answering False (introspection, mock's autospec, doctest collection).
    import subprocess
    import sys

    import powerprof.sim as sim

    assert sim.SimNVML is SimNVML and vars(sim)["SimNVML"] is SimNVML and "SimNVML" in dir(sim)
    code = ("import sys\nsys.modules['pynvml'] = None\nimport powerprof.sim as s\n"
            "assert 'SimNVML' in dir(s) and hasattr(s, 'SimNVML') is False\n"
            "try:\n    s.SimNVML\nexcept AttributeError as e:\n"
            "    assert isinstance(e.__cause__, ImportError), repr(e.__cause__)\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "needs pynvml" in r.stdout and "pip install" in r.stdout, r.stdout


@pytest.mark.parametrize("profile, lock, idle_w, locked_mhz, locked_w", [
    # The real H200's idle with a model loaded, 120.6 W at 1980 MHz (docs/hardware.md): a lock there is its idle
    # clock; before, the whole idle draw scaled by V² gave 173.8 W (and 135.1 W at 1400 MHz).
    ("h200-141g", (1980, 1980), 78.0, 1980, 120.6),
    ("h200-141g", (1400, 1400), 78.0, 1395, 99.7),
    ("a100-40g", (1400, 1400), 55.0, 1395, 92.0),  # before 142.2 W
    ("h200-141g", (345, 1980), 78.0, 345, 78.0),  # a lock whose floor is the idle clock holds nothing up
    ("seed-16g", (510, 2790), 22.0, 210, 22.0),  # nor one whose floor is the lowest clock
])
def test_a_clock_lock_holds_the_idle_clock_up_and_moves_the_idle_draw_as_nvml_shows(profile, lock, idle_w, locked_mhz,
                                                                                     locked_w):
    # sim/gpu.py `_idle_held`: idle under a lock, the SM clock held at the lock's clock, only the clock-dependent part
    # of the idle power moved (a real card's idle draw moves under a lock: docs/simulator.md). Through NVML: the clock,
    # GpuIdle, and the counter over a second; busy, AppClocks where the lock holds it below the top clock.
    clock = FakeClock()
    n = SimNVML(profile, state_path=None, clock_ns=clock)
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)

    def idle_over_a_second():
        e0 = n.nvmlDeviceGetTotalEnergyConsumption(h)
        clock.advance(1.0)
        return (n.nvmlDeviceGetTotalEnergyConsumption(h) - e0) / 1000

    assert idle_over_a_second() == pytest.approx(idle_w, abs=0.1)
    n.external_clock_change(0, lock)
    assert idle_over_a_second() == pytest.approx(locked_w, abs=0.1)
    assert n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM) == locked_mhz
    assert n.nvmlDeviceGetCurrentClocksEventReasons(h) == n.nvmlClocksEventReasonGpuIdle
    n.gpus[0].set_phase(Phase("decode", 0.12))
    want = n.nvmlClocksEventReasonApplicationsClocksSetting if lock[1] < n.gpus[0].profile.sm_clock_max_mhz else 0
    assert n.nvmlDeviceGetCurrentClocksEventReasons(h) == want


def test_a_lock_below_the_clock_an_idle_card_holds_lowers_its_idle_draw_to_the_same_figure_as_from_below():
    # A serving card's context holds its idle clock high (the real H200: 120.6 W at 1980 MHz with a model loaded,
    # docs/hardware.md): a lock lowers it there. Only the clock-dependent part moves, so the H200 locked at 1400 MHz
    # idles at the same 99.7 W from either idle clock; before, a lock below the idle clock changed nothing.
    import dataclasses

    from powerprof.sim.gpu import SimGpu
    from powerprof.sim.profiles import PROFILES

    serving = dataclasses.replace(PROFILES["h200-141g"], sm_clock_idle_mhz=1980, idle_power_w=120.6)
    for profile in (serving, PROFILES["h200-141g"]):
        g = SimGpu(profile, 0, "u")
        g.set_locked_clocks((1400, 1400))
        assert g._idle_held() == pytest.approx((1395.0, 99.7), abs=0.1)
    g = SimGpu(serving, 0, "u")
    assert g._idle_held() == (1980.0, 120.6)
