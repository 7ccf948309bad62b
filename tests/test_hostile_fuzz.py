"""Hostile inputs from session 47's fuzzing review: what a user sees for each (one line, exit 2, nothing changed)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from powerprof.cli import main


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


# --- 1. simulated GPU counts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", ["64", "0,1000000", "99999999999999999999"])
def test_a_simulated_gpu_index_past_the_simulators_cap_is_a_usage_error(gpus):
    # `devices --simulate --gpus 1000000` built a million simulated GPUs (4.4 GB); 20 digits was an OverflowError.
    from powerprof.sim.profiles import MAX_SIM_GPUS

    r = run("devices", "--simulate", "--gpus", gpus, "--json")
    assert r.exit_code == 2, r.output
    assert f"at most {MAX_SIM_GPUS} GPUs" in r.output and "--gpus" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_highest_simulated_gpu_index_still_opens():
    r = run("devices", "--simulate", "--gpus", "63", "--json")
    assert r.exit_code == 0, r.output
    assert [g["index"] for g in json.loads(r.output)["gpus"]] == [63]


def test_the_daemons_sim_gpus_cap_is_the_same_constant():
    from powerprof.sim.profiles import MAX_SIM_GPUS

    r = run("daemon", "--simulate", "--sim-gpus", str(MAX_SIM_GPUS + 1), "--check")
    assert r.exit_code == 2 and f"1<=x<={MAX_SIM_GPUS}" in r.output, r.output


def test_the_simulator_itself_refuses_a_runaway_count():
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.profiles import MAX_SIM_GPUS

    with pytest.raises(ValueError, match=f"at most {MAX_SIM_GPUS}"):
        SimNVML(count=10**20, state_path=None)


def test_a_gpu_index_of_other_digits_is_refused_not_a_traceback():
    r = run("devices", "--simulate", "--gpus", "²")
    assert r.exit_code == 2 and "expected NVML indexes" in r.output, r.output


def test_a_daemon_configs_simulated_gpu_index_past_the_cap_is_a_config_error(tmp_path):
    from powerprof.daemon import service

    cfg = tmp_path / "d.toml"
    cfg.write_text("[daemon]\ngpus = [0, 100000000]\n")
    r = CliRunner().invoke(main, ["daemon", "--config", str(cfg), "--simulate", "--check"])
    assert r.exit_code == service.EXIT_CONFIG, (r.output, r.stderr)
    assert "daemon.gpus: GPU index 100000000 does not exist: the simulator has at most" in r.stderr


# --- 2a. trace --seed ------------------------------------------------------------------------------------------------


def test_a_negative_trace_seed_is_a_usage_error_and_writes_nothing(tmp_path):
    # numpy's "expected non-negative integer" ValueError came out as a traceback.
    out = tmp_path / "t.jsonl"
    r = run("trace", str(out), "--requests", "3", "--seed", "-1")
    assert r.exit_code == 2, r.output
    assert "--seed" in r.output and "-1" in r.output and ">=0" in r.output, r.output
    assert not out.exists()
    assert run("trace", str(out), "--requests", "3", "--seed", str(2**80)).exit_code == 0
