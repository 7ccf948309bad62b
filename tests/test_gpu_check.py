"""bench/gpu_check.py, the one-shot hardware check, end to end on the simulator with every NVML setter trapped."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from powerprof.sim.profiles import get_profile

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "bench" / "gpu_check.py"
SERVER = ROOT / "bench" / "gpu_check_server.py"
PROFILE = "h200-141g"
SECTIONS = ("devices_monitor", "nvml_cost", "energy_idle", "sensor_coverage", "energy_load", "decode", "cli_measure", "daemon", "sweep_dry_run")

# Installed before anything else in every process of the run (the check, its CLI subprocesses): each
# simulator and pynvml setter records the call to a file and raises. It is the test's own trap, made
# independently of the check's guard, so a setter the guard failed to recognise is still caught.
TRAP = textwrap.dedent(
    """
    import json, os
    import pynvml
    from powerprof.sim.nvml import SimNVML

    def _trap(name):
        def setter(*a, **k):
            with open(os.environ["GPU_CHECK_TEST_TRAP"], "a") as f:
                f.write(json.dumps({"call": name, "pid": os.getpid()}) + "\\n")
            raise RuntimeError("setter called: " + name)
        return setter

    for _target in (SimNVML, pynvml):
        for _name in dir(_target):
            if _name.startswith(("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear")):
                setattr(_target, _name, _trap(_name))
    """
)


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def trap_env(tmp_path, _isolated_state):
    d = tmp_path / "trap"
    d.mkdir()
    (d / "sitecustomize.py").write_text(TRAP)
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(d), str(ROOT), env.get("PYTHONPATH", "")])
    env["GPU_CHECK_TEST_TRAP"] = str(tmp_path / "trap.jsonl")
    return env


def test_trap_catches_a_setter_in_a_subprocess(trap_env, tmp_path):
    # Without this the end-to-end test below could pass with a trap that never loaded.
    code = "from powerprof.sim.nvml import SimNVML; n = SimNVML(); n.nvmlInit(); " \
           "n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), 300000)"
    p = subprocess.run([sys.executable, "-c", code], env=trap_env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "setter called" in p.stderr
    calls = [json.loads(x) for x in (tmp_path / "trap.jsonl").read_text().splitlines()]
    assert [c["call"] for c in calls] == ["nvmlDeviceSetPowerManagementLimit"]


def test_setter_names_are_recognised():
    gc = load_check()
    import pynvml

    from powerprof.sim.nvml import SimNVML

    for name in ("nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetGpuLockedClocks", "nvmlDeviceResetGpuLockedClocks",
                 "nvmlDeviceClearEccErrorCounts", "nvmlDeviceSetPersistenceMode", "nvmlDeviceSetMigMode",
                 "nvmlDeviceSetApplicationsClocks", "nvmlDeviceResetApplicationsClocks", "nvmlGpuInstanceCreateComputeInstance"):
        assert gc.is_setter(name), name
    for name in ("nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetResetStatus", "nvmlInit", "nvmlShutdown",
                 "nvmlDeviceGetFieldValues", "NVML_FI_DEV_POWER_INSTANT", "nvmlDeviceGetCurrentClocksEventReasons"):
        assert not gc.is_setter(name), name
    # Every entry point of the bindings and the simulator that sets or resets something is covered.
    for target in (pynvml, SimNVML):
        for name in dir(target):
            if name.startswith(("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear")):
                assert gc.is_setter(name), name
            if name.startswith("nvmlDeviceGet"):
                assert not gc.is_setter(name), name


def test_energy_comparison_against_an_exact_series():
    # Power 100 + 50 sin(2πt/3) W sampled at 50 Hz for 10 s: the counter is its exact integral and the
    # "average" reading its exact 1 s trailing mean, so every method must agree with the counter.
    import numpy as np

    gc = load_check()
    t = np.arange(0, 10.0001, 0.02)
    w = 2 * np.pi / 3
    power = 100 + 50 * np.sin(w * t)
    def integral(x):
        return 100 * x + 50 / w * (1 - np.cos(w * x))

    energy = integral(t)
    avg = integral(t) - integral(t - 1)  # joules over the last second = its mean power
    series = {"t": (t * 1e9).astype(np.int64) + 10**12, "e": energy + 5000.0, "p": power, "a": avg}
    at50 = gc.compare_energy(series, 1, 1.0)
    assert at50["samples"] == 501 and at50["interval_s"] == pytest.approx(9.5, abs=0.021)
    assert at50["instant_vs_counter"] == pytest.approx(1, abs=1e-3)
    assert at50["average_vs_counter"] == pytest.approx(1, abs=0.01)
    assert at50["counter_avg_power_w"] == pytest.approx(100, abs=3)
    at1 = gc.compare_energy(series, 50, 1.0)
    assert at1["samples"] == 11 and at1["interval_s"] == pytest.approx(9.5, abs=0.021)
    # 1 Hz samples of a 3 s sine: the trapezoid misses some of the curve, and the check shows by how much.
    assert at1["instant_vs_counter"] == pytest.approx(1, abs=0.05) and at1["instant_vs_counter"] != at50["instant_vs_counter"]


@pytest.mark.slow
def test_check_runs_on_the_simulator_read_only(trap_env, tmp_path, _isolated_state):
    out = tmp_path / "out"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(CHECK), "--out", str(out), "--simulate", PROFILE, "--quick"],
                       env=trap_env, capture_output=True, text=True, timeout=240)
    elapsed = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # Its duration is a figure to report (docs/hardware.md: 26-39 s here), not a pass/fail bound on a
    # shared machine: the check keeps its own time budget and skips, saying so, what would overrun it.
    print(f"gpu_check --simulate --quick: {elapsed:.0f} s end to end")

    # 6. No setter ran: not in the check's own log, not in the test's trap, and no simulated limit moved.
    assert not (tmp_path / "trap.jsonl").exists(), (tmp_path / "trap.jsonl").read_text()
    assert not (_isolated_state / "sim-state.json").exists()
    r = json.loads((out / "gpu_check.json").read_text())
    s = r["safety"]
    assert s["ok"] and s["setter_calls"] == [] and s["settings_unchanged"] and s["setters_guarded"] >= 3
    assert s["settings_before"][0]["power_limit_w"] == get_profile(PROFILE).default_limit_w

    assert r["meta"]["complete"] and r["meta"]["simulated"]
    for name in SECTIONS:
        assert name in r, name
        assert "error" not in r[name] and "skipped" not in r[name], (name, r[name])
    md = (out / "gpu_check.md").read_text()
    for head in ("## 1.", "## 2.", "## 3.", "## 4.", "## 4b.", "## 5.", "## 6.", "**Simulated**"):
        assert head in md, head
    assert "VIOLATION" not in md and "Failed" not in md

    truth = get_profile(PROFILE)
    # 1. devices --json and monitor, as printed.
    dm = r["devices_monitor"]
    assert dm["devices"]["rc"] == 0 and dm["devices"]["json"]["gpus"][0]["name"] == truth.name
    assert dm["monitor"]["rc"] == 0 and dm["monitor"]["stdout"].count("gpu0 power=") >= 2

    # 2. Every call the collector makes per tick is timed, with sane figures.
    c = r["nvml_cost"]
    timed = {x["call"].split("(")[0] for x in c["calls"] if "tick" in x["phases"]}
    assert timed == {"nvmlDeviceGetFieldValues", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption",
                     "nvmlDeviceGetClockInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
                     "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerManagementLimit", "nvmlDeviceGetEnforcedPowerLimit",
                     "nvmlDeviceGetCurrentClocksEventReasons"}
    assert c["tick_calls_per_gpu"] == 11  # two clock reads
    for x in c["calls"]:
        assert x["error"] is None and 0 < x["median_us"] <= x["p99_us"], x
    assert c["read_one_gpu"]["wall_median_us"] > 0 and c["sampler_50hz"]["cpu_per_tick_us"] > 0

    # 3. Counter against power, against the simulator's true energy.
    idle, load = r["energy_idle"], r["energy_load"]
    for e in (idle, load):
        for rate in ("at_50hz", "at_1hz"):
            x = e[rate]
            # The counter refreshes every energy_counter_update_s: a read at either end of the interval may
            # be up to one refresh old, so the counter's energy over it is exact only within that share of it
            # (3.5 s of a 100 ms counter: 2.9%; a loaded run read 0.971 where the bound was a fixed 2%).
            # A read preempted on a loaded host holds energy past its stamp: its delay at the edges too (a full suite
            # beside other jobs read 1.040 over 4.35 s where the bound was 3.3%).
            stale = truth.energy_counter_update_s / x["interval_s"]
            late = x["edge_read_delay_s"] / x["interval_s"]
            assert x["counter_vs_true"] == pytest.approx(1, abs=max(0.02, 0.01 + stale + late)), (e["state"], rate, x)
            assert x["instant_vs_counter"] == pytest.approx(1, abs=max(0.03, 0.02 + stale)), (e["state"], rate, x)
            assert x["average_vs_counter"] == pytest.approx(1, abs=0.05), (e["state"], rate, x)
        # Polled tightly, a change is seen up to the longest gap between polls late: a starved poller (a full suite
        # on 2 cores: 334 ms once, the median of 3 changes 202 ms against 100) reads intervals that much off.
        upd = e["update_intervals"]["counter"]["interval_ms_median"]
        gap = e["update_intervals"]["poll_gap_ms_max"]
        refresh_ms = truth.energy_counter_update_s * 1e3
        assert 0.5 * refresh_ms - gap <= upd <= 1.5 * refresh_ms + gap, e["update_intervals"]
    assert idle["at_50hz"]["counter_avg_power_w"] == pytest.approx(truth.idle_power_w, rel=0.03)
    assert load["at_50hz"]["counter_avg_power_w"] > truth.idle_power_w + 100
    assert load["load_errors"] == []

    # The simulated counter integrates everything: every phase of the bursts counts in full.
    sc = r["sensor_coverage"]
    assert len(sc["runs"]) >= 3 and sc["continuous_busy_excess_w"] > 100
    for x in sc["runs"]:
        # The ratio takes the idle power out over the counter's refresh instants as a poller saw them: starved on a
        # loaded host, each is late by its wait (a 30 ms wait at 78 W idle is ~10% of a quick run's 24 J excess;
        # a full suite beside helpers read 0.77, one beside two CPU hogs 0.66). A sensor seeing ~25 ms of each 100 ms
        # (Yang et al.) reads ~0.25 in every run, so each run above 0.5 and their median within 0.3 of 1 still tell
        # them apart; counter_vs_true pins the integration itself at 3%.
        assert x["seen_vs_expected"] > 0.5, sc
        # Each end's refresh came somewhere in its poll gap (up to one idle power's worth of the gaps off, at most the
        # gaps' share of the run): a suite on 2 cores read 1.042 where the bound was a fixed 3%.
        assert x["counter_vs_true"] == pytest.approx(1, abs=max(0.03, 0.01 + x["edge_poll_gaps_s"] / x["interval_s"])), sc
    assert sc["seen_vs_expected_median"] == pytest.approx(1, abs=0.3), sc

    # 4. Decode load and measure at concurrency 1 and 8.
    d = {x["concurrency"]: x for x in r["decode"]["concurrency"]}
    assert set(d) == {1, 8}
    for x in d.values():
        assert x["n_ok"] == 8 and x["n_failed"] == 0
        if x["energy_method"] == "none":
            # Beside two CPU hogs every batch at 8 was timed apart by a starved client and left out: no figure, and
            # the reasons said; never a figure from them.
            assert x["left_out_windows"] and x["gpu_j_per_token"] is None, x
            continue
        assert x["energy_method"] == "counter", x
        assert x["measured_vs_generator"] == pytest.approx(1, abs=0.1), x
        # At 8 streams the figure reads -4.7 to -6.8% off the simulator's truth on an idle host (6 runs), -10.1% once in
        # a full suite on 2 cores; 1 stream -0.05 to -3.2%. Every window of --quick's 64 tokens is low_confidence (a
        # few of the H200 counter's 100 ms refreshes), and the error is the short window's edges, not the batch's:
        # the decode part alone read +7.6 to +9.7% at 64 tokens, +0.7 to +1.3% at 256, -0.6 and 0.0% at 1024
        # (docs/hardware.md, section 4).
        assert x["gpu_j_per_token"] == pytest.approx(x["true_j_per_token"], rel=0.1 if x["concurrency"] == 1 else 0.15), x
        dd = x["during_decode"]
        # The simulated H200 decodes far below its 700 W limit: the cap does not bind.
        assert dd["samples"] > 0 and dd["enforced_limit_w"] == truth.default_limit_w
        assert 0 < dd["power_over_limit_median"] < 0.8 and dd["cap_binds"] is False
        assert "SwPowerCap" not in (dd["clock_event_reasons_share"] or {})
    assert d[8]["batch_size"] == 8
    if d[8]["decode_tok_s"] is not None and d[1]["decode_tok_s"] is not None:
        # (None: the batch left out, its reasons said, above: a fresh-clone CI beside two CPU hogs read that once.)
        assert d[8]["decode_tok_s"] > 2 * d[1]["decode_tok_s"], d
    if d[8]["gpu_j_per_token"] is not None and d[1]["gpu_j_per_token"] is not None:
        assert d[8]["gpu_j_per_token"] < d[1]["gpu_j_per_token"], d
    cli = r["cli_measure"]
    assert cli["rc"] == 0, cli
    rows = [ln.split() for ln in cli["stdout"].splitlines() if ln.strip().startswith(("1 ", "8 "))]
    assert [(x[0], x[1]) for x in rows] == [("1", "8"), ("8", "8")], cli["stdout"]
    # On the counter; where a loaded host read a window's edges late enough that the counter's reads did not bracket
    # it, that window fell back to the power read at its edges, which the method column and a note say (a fresh-clone
    # suite beside helpers, load ~10: "counter,power_integration" with "6 windows' edge reads came over 100 ms after").
    assert rows[0][-1] == "counter" or (rows[0][-1] == "counter,power_integration"
                                        and "edge reads came over" in cli["stdout"]), cli["stdout"]
    # At concurrency 8 the CLI's own load generator shares the machine with the simulated server: on
    # a very busy one (load average 65 seen) its streams arrive in bursts and the batch window is
    # not trusted. Then there is no figure, and the output must say why; never a silent gap.
    # Under load its 8 streams may also never decode together on the 4 slots: the note says that instead.
    assert rows[1][-1] == "counter" or "concurrency 8: no J/token figure" in cli["stdout"], cli["stdout"]

    # 4b. The daemon in front of the same server: a row for each request with its energy, every joule in one place,
    # the total on the simulated GPU's truth.
    dmn = r["daemon"]
    assert dmn["exit"] == 0 and dmn["client_errors"] == [] and dmn["requests_open_at_stop"] == 0, dmn
    assert dmn["rows"] == dmn["requests_sent"] == {"c1": 4, "c8": 8} and dmn["outcomes"] == {"ok": 12}, dmn
    assert dmn["rows_without_energy"] == 0, dmn
    for t in ("c1", "c8"):
        client, rows = dmn["tokens_client_vs_rows"][t]
        assert client == rows == dmn["phases"][t]["attributed_tokens"] > 0, dmn
    iv = dmn["intervals"]
    assert iv["energy_method"] == ["counter"] and iv["server_count"] == ["off"] and iv["without_gpu_energy"] == 0, iv
    assert iv["split_vs_total"] == pytest.approx(1, abs=1e-6), iv
    # The counter's value at either end may be one refresh old (as in part 3).
    assert iv["total_vs_true"] == pytest.approx(1, abs=0.01 + 2 * truth.energy_counter_update_s / iv["duration_s_total"]), iv
    # One request at a time: its energy is the GPU's over its arrival to its end. 1.016-1.017 in 3 runs here (the
    # edges' reads of a counter 100 ms stale on requests of ~0.4 s); a starved host may skip edge reads (their CPU
    # cap), leaving the 1 s intervals' split.
    assert dmn["phases"]["c1"]["energy_vs_true"] == pytest.approx(1, abs=0.2), dmn["phases"]
    # What a real GPU is judged by (no truth there): the requests' energy against the check's own fresh counter reads
    # around each phase, less the idle power over the moments none was live. On the simulator it reads what the truth
    # reads (1.0486 and 1.0481 in one run).
    for t in ("c1", "c8"):
        assert dmn["phases"][t]["energy_vs_counter"] == pytest.approx(1, abs=0.2), dmn["phases"]
    assert dmn["phases"]["c1"]["energy_vs_counter"] == pytest.approx(dmn["phases"]["c1"]["energy_vs_true"], abs=0.05)

    # 5. sweep --dry-run: the plan, the permission check and the restore-file path, and nothing changed.
    sw = r["sweep_dry_run"]
    assert sw["rc"] == 0 and "Dry run: nothing will be changed" in sw["stdout"] and "Restore file" in sw["stdout"]


def _nvml_works() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_nvml_works(), reason="this machine has a GPU: the check would run for real")
def test_without_a_gpu_it_says_why_and_exits_non_zero(tmp_path):
    p = subprocess.run([sys.executable, str(CHECK), "--out", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 3 and "not reachable through NVML" in p.stdout
    r = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert "not reachable through NVML" in r["meta"]["error"]
    assert "Failed to start" in (tmp_path / "out" / "gpu_check.md").read_text()


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None


@pytest.mark.slow
@pytest.mark.parametrize("size", [
    # fake: the same server, batching, streaming and timing code with a fixed time per step and no torch, so
    # the check's real-GPU path (its own server, the generator's batch log) runs in CI too.
    "fake",
    pytest.param("tiny", marks=pytest.mark.skipif(
        not _has_torch(), reason="torch and transformers are not installed (the GPU machine has them)")),
])
def test_server_streams_batches_and_times_a_model(tmp_path, size):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, str(SERVER), "--size", size, "--device", "cpu", "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t_end = time.monotonic() + 180
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < t_end, f"{size} model server not ready in 180 s"
            time.sleep(0.2)
        url = json.loads(ready.read_text())["url"]
        from powerprof.workload.client import RequestParams
        from powerprof.workload.load import builtin_prompts
        from powerprof.workload.measure import measure

        n = 64 if size == "fake" else 16  # fake steps are fast: a span long enough to time under load
        res = measure(url, prompts=builtin_prompts("short"), n_requests=4, concurrencies=(1, 4),
                      params=RequestParams(max_tokens=n), warmup=0)
        assert res.server.kind == "openai" and res.server.model == f"random-llama-{size}"
        ok = [x for x in res.records if x.ok]
        assert len(ok) == 8 and all(x.generated_tokens == n and x.token_source == "usage" for x in ok)
        assert all(x.server_timings["predicted_n"] == n for x in ok)
        with urllib.request.urlopen(url + "/gpu_check/batches", timeout=10) as f:
            batches = json.load(f)["batches"]
        sizes = [b["batch_size"] for b in batches]
        assert sizes == [1, 1, 1, 1, 4]  # concurrency 4 decoded as one batch
        if size == "fake":  # the rate seen in the streams against the generator's own step log
            for summ in res.summaries:
                gen = [b for b in batches if b["batch_size"] == summ.concurrency]
                gen_tok_s = statistics.median(b["decode_tok_s"] for b in gen)
                assert summ.decode_tok_s == pytest.approx(gen_tok_s, rel=0.15), (summ.concurrency, summ, gen)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_observer_alternates_sampler_settings_and_reads_the_servers_step_log(tmp_path):
    """bench/gpu_observer.py on the fake server: every batch measured, its step time from the server's own log."""
    out = tmp_path / "obs"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_observer.py"), "--out", str(out), "--simulate",
                        "--model", "fake", "--rounds", "1", "--max-tokens", "16"],
                       capture_output=True, text=True, timeout=180, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = json.loads((out / "observer.json").read_text())
    assert r["setter_calls"] == 0
    assert [(x["label"], x["sampler"], x["concurrency"]) for x in r["runs"]] == [
        ("cold", "none", 8), ("warm-1", "none", 1), ("round 1", "10hz", 8), ("round 1", "1hz", 8), ("round 1", "none", 8)]
    for x in r["runs"]:
        assert x["n_ok"] == x["concurrency"] and x["batches"] == 1 and x["step_ms"] > 0, x
        # The stream's rate is the generator's (a starved client would read it lower: the bound is loose); on a loaded
        # host a lone batch's window may be left untrusted, and then it has no figure, never a wrong one.
        assert x["decode_tok_s"] is None or x["decode_tok_s"] == pytest.approx(x["generator_tok_s"], rel=0.25), x
        # Without a Profiler there is no J/token, never a 0; with one, a figure above 0, or none where the batch's window
        # was left untrusted (a starved client on a loaded host: a fresh-clone CI beside two CPU hogs read that once).
        if x["sampler"] == "none":
            assert x["gpu_j_per_token"] is None, x
        else:
            assert x["gpu_j_per_token"] is None or x["gpu_j_per_token"] > 0, x
    assert set(r["step_ms_median_by_sampler"]) == {"10hz", "1hz", "none"}


def test_nvml_probe_runs_read_only_and_sees_the_counters_real_cost(tmp_path):
    # bench/gpu_nvml_probe.py is the second script for a lent GPU: its NVML part must run as it
    # will there. The simulated H200 reproduces what the real one showed: every way of reading the
    # energy counter costs ~3 ms of CPU, average power about a microsecond (docs/hardware.md).
    out = tmp_path / "probe"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_nvml_probe.py"), "--out", str(out), "--simulate",
                        "--no-decode", "--calls", "20"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads((out / "nvml_probe.json").read_text())
    assert rep["complete"] and rep["simulated"] and rep["setters_guarded"] > 10
    c = rep["cost"]
    for name in ("total_energy", "field83", "field191"):
        # Wall time: the simulated driver spins to a wall-clock deadline, so on a loaded machine its CPU time can be less.
        assert c[name]["error"] is None and c[name]["wall_us_median"] > 2000, (name, c[name])
    assert c["power_usage"]["wall_us_median"] < 1000 and c["field186"]["error"] is None
    for name in ("total_energy", "field83", "field191"):
        assert rep["refresh"][name]["interval_ms_median"] == pytest.approx(100, rel=0.3), rep["refresh"]
