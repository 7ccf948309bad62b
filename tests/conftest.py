"""Shared fixtures and the run's shape: every test gets its own simulator state and powerprof state
folders; `-n auto` runs two workers per core, the longest files start first, and a failed test gets one fresh
try (docs/testing.md)."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's command): two workers per core up to 8 (never fewer than one per core),
    at most --maxprocesses.

    Most of the suite's wall time waits on things that run in real time: simulated GPUs, servers
    and daemons, real timeouts: on 2 cores, two workers kept 0.6 of a core busy over the full run
    (9 min 22 s); four took 4 min 40 s, each file as long as it took on two. The tests' bounds
    already allow for a loaded machine (each must pass beside a CPU-bound job)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own setting wins
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(2 * cores, max(cores, 8))  # a many-core machine gains nothing from twice its cores


# The longest files in the README's `--dist loadfile` run (seconds each, one full run on 2 cores,
# December 2026; the attribution, delivery-fault, restart and scrape files re-timed alone after their runs went
# side by side or their waits were cut, at load 2-5; the grid file after its seed-card test went to 10
# configurations, beside other test runs, 5 December; the daemon files that were missing, among them the two longest,
# from session 56's durations run and their side-by-side pools' timings, 6 December: docs/testing.md "The longest
# tests"). They start first: xdist's default order (most tests first)
# started the one-test, 30-40 s files last, and the other workers stood idle while they ran. Only the order
# changes; a file not named here runs after these, in collection order.
LONGEST_FILES_S = {
    "test_sweep_restart.py": 128, "test_sweep_foreign.py": 123, "test_grid.py": 180, "test_sweep_hostile.py": 97,
    "test_sweep_e2e.py": 89, "test_attribution_mixed.py": 215, "test_sweep_accuracy.py": 144,
    "test_attribution_accuracy.py": 58, "test_tuner_live.py": 55, "test_trace_foreign.py": 55,
    "test_analysis_report.py": 44, "test_daemon_workers.py": 43, "test_gpu_check.py": 54, "test_real_llama_server.py": 41,
    "test_daemon_scrape.py": 40, "test_sim_virtual_vs_realtime.py": 40, "test_measure_foreign.py": 54,
    "test_daemon_crash.py": 50, "test_delivery_faults.py": 33, "test_busy_host.py": 31, "test_daemon_e2e.py": 28,
    "test_workload_trace.py": 27, "test_launcher.py": 26, "test_daemon_buffered_bypass.py": 140,
    "test_daemon_prefix_cache.py": 150, "test_daemon_chat_shapes.py": 129, "test_daemon_delivery.py": 110,
    "test_prefix_cache_ledger.py": 34, "test_cli_new_user.py": 32, "test_daemon_token_counts.py": 29,
    "test_sweep_rules.py": 28, "test_daemon_textless_tokens.py": 26,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # files go out in the order collection leaves them
    if not hasattr(config, "workerinput"):
        _compile_package()


def _compile_package():
    """Writes the package's bytecode once, before any test starts a process.

    Where PYTHONDONTWRITEBYTECODE is set (as in the shell the suite is timed in), every simulated server, CLI and analysis
    process the tests start compiled the modules it imports afresh (0.07 s of CPU a sim server, 0.2 s an analysis
    run, measured side by side); only the daemon's `python -I` children wrote theirs. py_compile writes regardless
    of that setting, and a tree that cannot be written is left as it is."""
    import compileall
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "powerprof"
    try:
        compileall.compile_dir(str(root), quiet=2, workers=1)
    except OSError:
        pass


# One more try for a failed test (pytest-rerunfailures), with its module's shared fixtures made afresh: most tests run
# simulated GPUs, servers, clients and the daemon in real time, and their figures rest on the host's scheduling. On
# a loaded 2-core host each such bound is crossed now and then by one run (measured: docs/testing.md), a different
# one each full suite; a regression moves every run and fails both tries. Every retry is listed at the end with the
# line its first try failed on (pytest_terminal_summary). POWERPROF_TEST_RERUNS=0 turns retries off (to find what fails once).
RERUNS = int(os.environ.get("POWERPROF_TEST_RERUNS", "1"))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FILES_S.get(item.path.name, 0))  # stable: a file's own order is kept
    if RERUNS > 0 and config.pluginmanager.hasplugin("rerunfailures"):
        for item in items:
            if item.get_closest_marker("flaky") is None:
                item.add_marker(pytest.mark.flaky(reruns=RERUNS))


RETRIED: list[tuple[str, str]] = []  # (test, its first failure's line) of every retry in this run


def pytest_runtest_logreport(report):
    if report.outcome == "rerun":
        crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
        line = crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
        RETRIED.append((report.nodeid, " ".join(line.split())[:300]))


def pytest_terminal_summary(terminalreporter):
    """Every retried test with what its first try failed on: a figure past its bound on a loaded host reads so, and
    the same test listed suite after suite is a finding (docs/testing.md)."""
    if RETRIED:
        terminalreporter.section("retried once (docs/testing.md): the first try's failure")
        for nodeid, line in RETRIED:
            terminalreporter.line(f"{nodeid}: {line}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A retry starts from a fresh run: the module's (or class's) fixtures this test uses are torn down and made
    again, not handed back as they were. Most such fixtures are one real-time run whose figures every test of the
    module reads (tests/support.py side_by_side); reusing it, a retry would only read the same figures twice."""
    if getattr(item, "execution_count", 1) <= 1:
        return
    item.session.powerprof_retry = item  # side_by_side runs only the jobs this test asks for
    info = item._fixtureinfo
    # Finishing a fixture finishes those made from it first (pytest registers them so): the order here is free.
    for name in item.fixturenames:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if fixturedef.scope in ("module", "class", "package") and fixturedef.cached_result is not None:
                fixturedef.finish(item._request)


@pytest.fixture
def sim_server(monkeypatch):
    """The simulated server a sweep starts (powerprof.rig.Rig.sim_server), once it has: [server]; for tests
    that make it misbehave mid-run."""
    import powerprof.rig as rigmod

    got = []
    real = rigmod.Rig.sim_server

    def capture(self, **kw):
        srv = real(self, **kw)
        got.append(srv)
        return srv

    monkeypatch.setattr(rigmod.Rig, "sim_server", capture)
    return got


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
