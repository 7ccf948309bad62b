"""Small things many tests need: a free loopback port, a real-server package that CI may not skip, the
simulated GPU's power limit as another process left it, and a sweep stopped before its first level."""

from __future__ import annotations

import importlib
import os
import socket

import pytest

from powerprof.sweep import UI


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


class _CtrlC(UI):
    """A sweep UI that presses Ctrl-C in the idle baseline, or once the first level has measured a request."""

    def __init__(self, when: str):
        self.when = when

    def idle(self, seconds):
        if self.when == "idle":
            raise KeyboardInterrupt

    def level_progress(self, visit, live):
        if self.when == "first-level" and visit.n_measured >= 1:
            raise KeyboardInterrupt

    def level_start(self, i, n, visit, unit): ...
    def level_done(self, visit, live): ...
    def note(self, text): ...


def stopped_before_first_level(out, when: str = "idle"):
    """A simulated sweep's run directory, Ctrl-C'd before its first level ended (`when`: "idle", in the
    idle baseline, tables with nothing measured; "first-level", with part of its first level measured)."""
    from powerprof.rig import Rig
    from powerprof.sweep import run_sweep

    with Rig("seed-16g") as rig:
        with pytest.raises(KeyboardInterrupt):
            run_sweep(rig, levels_spec="180,300", out_dir=out, idle_s=1, ui=_CtrlC(when), warmup_requests=1,
                      command_line="powerprof sweep --limits 180,300 --simulate")
    return out


def ctrl_c_once_the_gpus_are_back(monkeypatch) -> None:
    """Ctrl-C at the sampler's "restored" read: after the last level, as the GPUs are put back."""
    from powerprof.collectors import sampler

    real = sampler.Sampler.sample_now

    def ctrl_c_once_restored(self, label=None, sources=None):
        if label == "restored":
            raise KeyboardInterrupt
        return real(self, label, sources)

    monkeypatch.setattr(sampler.Sampler, "sample_now", ctrl_c_once_restored)
