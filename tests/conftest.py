"""Shared fixtures and the run's shape: every test gets its own simulator state and powerprof state
folders; `-n auto` runs two workers per core."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's command): two workers per core, at most --maxprocesses.

    Most of the suite's wall time waits on things that run in real time: simulated GPUs, servers
    and daemons, real timeouts: on 2 cores, two workers kept 0.6 of a core busy over the full run
    (9 min 22 s). Four run two files' waits on each core; the tests' bounds already allow for a
    loaded machine (each must pass beside a CPU-bound job)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own setting wins
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 2 * cores


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    # The simulator persists limits between processes and the controller writes restore files:
    # neither may leak between tests or touch the user's real state folders.
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.setenv("POWERPROF_SIM_STATE", str(state / "sim-state.json"))
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(state / "powerprof"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield state
