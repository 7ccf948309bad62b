"""Small things many tests need: a free loopback port, a real-server package that CI may not skip, and the
simulated GPU's power limit as another process left it."""

from __future__ import annotations

import importlib
import os
import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_package(module: str, what: str):
    """Import `module` for a real-server test: a skip saying why where it is missing, a failure under CI.

    CI installs the test extra, so a missing package there means a failed build, which must fail
    the run rather than skip the only tests against real servers (tests/test_real_server_gate.py)."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{what} is not installed (it is in the test extra); "
                                              "with CI=true this is a failure, not a skip")


def sim_limit_w(profile: str = "seed-16g", index: int = 0) -> float:
    """The simulated GPU's power limit (W) as the shared simulator state holds it now: what a
    command in another process set, or put back."""
    from powerprof.sim.nvml import SimNVML

    sim = SimNVML(profile)
    sim.nvmlInit()
    return sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(index)) / 1000
