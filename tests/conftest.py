"""Shared fixtures: every test gets its own simulator state and powerprof state folders."""

from __future__ import annotations

import pytest


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
