"""Helpers for the control tests: reading what the simulated GPUs were left at, fake NVML wrappers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from powerprof.sim.nvml import SimNVML

HERE = Path(__file__).parent
CHILD = HERE / "control_child.py"
ORIGINAL_W = (280.0, 300.0)  # GPU 0 starts at a non-default limit: restore must bring back *that*, not the default


def sim_state(state_path: Path | None = None) -> list[tuple[float, tuple | None]]:
    """(limit W, locked clocks) per GPU as another process would see them now: a fresh simulator each time."""
    n = SimNVML("seed-16g", count=2, state_path=state_path or True)
    n.nvmlInit()
    return [(n.nvmlDeviceGetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(i)) / 1000, n.locked_clocks_mhz(i)) for i in range(2)]


def preset_originals(state_path: Path | None = None) -> None:
    n = SimNVML("seed-16g", count=2, state_path=state_path or True)
    n.nvmlInit()
    for i, w in enumerate(ORIGINAL_W):
        n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(i), int(w * 1000))


def assert_untouched(state_path: Path | None = None) -> None:
    assert sim_state(state_path) == [(w, None) for w in ORIGINAL_W]


def restore_files(state_dir: Path | None = None) -> list[Path]:
    d = Path(state_dir or os.environ["POWERPROF_STATE_DIR"])
    return sorted(d.glob("restore-*.json")) if d.exists() else []


def child_cmd(*args: str) -> list[str]:
    return [sys.executable, str(CHILD), *args]


class Wrap:
    """An NVML-like object that forwards everything to a SimNVML except what a test overrides."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def originals():
    preset_originals()
    assert_untouched()
    return ORIGINAL_W


def door_controller(nvml, indexes, **kw):
    """A LimitController opened through the door (powerprof.rig), as every command opens one: its
    restore file then says how to reopen the simulator after a crash."""
    from powerprof.rig import Rig

    return Rig(nvml.profile.key, nvml=nvml).controller(indexes, **kw)


def door_restore(path=None, sim_profile=None, **kw):
    """`powerprof restore [--simulate PROFILE]` as a function: restore through the door."""
    from powerprof.rig import Rig

    return Rig(sim_profile).restore(path, **kw)
