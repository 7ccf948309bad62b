"""The shipped systemd unit: hardened as promised, and `systemd-analyze verify` clean where available."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from powerprof.cli import main
from support import systemd_exposure

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "systemd" / "powerprof.service"
TUNE_UNIT = ROOT / "systemd" / "powerprof-tune.service"


def _unit(path: Path = UNIT) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault(f"{section}.{k}", []).append(v)
    return out


def test_unit_is_hardened_and_does_not_crash_loop():
    u = _unit()
    for key, want in {
        "Service.ProtectSystem": "strict", "Service.NoNewPrivileges": "yes", "Service.StateDirectory": "powerprof",
        "Service.DevicePolicy": "closed", "Service.Restart": "on-failure", "Service.RestartPreventExitStatus": "2",
    }.items():
        assert u[key] == [want], key
    assert all("nvidia" in d for d in u["Service.DeviceAllow"])
    assert u["Service.MemoryMax"] and int(u["Unit.StartLimitBurst"][0]) <= 10
    assert any(v.startswith("+") and "energy_uj" in v for v in u["Service.ExecStartPre"])
    assert "daemon --config /etc/powerprof/powerprof.toml" in u["Service.ExecStart"][0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_is_clean(tmp_path):
    # verify checks that ExecStart's binary exists: point it at this checkout's entry point.
    exe = shutil.which("powerprof", path=str(Path(sys.executable).parent)) or sys.executable
    unit = tmp_path / "powerprof.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/powerprof", exe))
    p = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "powerprof.service" not in p.stderr, p.stderr


def test_the_tuner_unit_never_restarts_tuning_after_a_kill_switch_it_could_not_catch():
    """A SIGUSR1 in the interpreter's start-up (before powerprof.entry catches it) ends the tuner by the signal's default
    action: systemd must not restart it tuning, the kill lost. Bad input (exit 2) is not retried either."""
    u = _unit(TUNE_UNIT)
    assert set(u["Service.RestartPreventExitStatus"][0].split()) == {"2", "SIGUSR1"}
    assert u["Service.Restart"] == ["on-failure"] and "143" in u["Service.SuccessExitStatus"][0].split()
    assert u["Service.ExecStart"][0].startswith("/usr/local/bin/powerprof tune ")  # the console command: entry first


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_is_clean_for_the_tuner_unit(tmp_path):
    exe = shutil.which("powerprof", path=str(Path(sys.executable).parent)) or sys.executable
    for unit in (UNIT, TUNE_UNIT):
        (tmp_path / unit.name).write_text(unit.read_text().replace("/usr/local/bin/powerprof", exe))
    p = subprocess.run(["systemd-analyze", "verify", str(tmp_path / TUNE_UNIT.name)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 0 and "powerprof-tune.service" not in p.stderr, p.stderr


def test_grafana_dashboard_uses_only_exported_metrics():
    import json

    dash = json.loads((ROOT / "systemd" / "grafana-powerprof.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs
    names = {"powerprof_gpu_power_watts", "powerprof_gpu_energy_joules_total", "powerprof_cpu_energy_joules_total",
             "powerprof_gpu_sm_clock_hertz", "powerprof_gpu_mem_clock_hertz", "powerprof_gpu_power_limit_watts",
             "powerprof_tokens_generated_total", "powerprof_joules_per_token", "powerprof_requests_total",
             "powerprof_gpu_interval_energy_joules_total", "powerprof_build_info", "process_resident_memory_bytes",
             "process_cpu_seconds_total", "powerprof_dropped_rows_total", "powerprof_flush_errors_total",
             "powerprof_proxy_recorder_failures_total", "powerprof_proxy_upstream_failures_total",
             "powerprof_requests_no_counter_short_total", "powerprof_gpu_energy_unknown_seconds_total",
             # the work model's (docs/daemon.md, Attribution)
             "powerprof_gpu_energy_attributed_joules_total", "powerprof_requests_energy_ratio",
             "powerprof_attributed_tokens_ratio", "powerprof_work_model_fitted", "powerprof_work_cost_joules",
             "powerprof_work_prefill_per_decode_ratio", "powerprof_idle_power_watts", "powerprof_work_model_r_squared"}
    import re

    used = {m for e in exprs for m in re.findall(r"(?:powerprof|process)_[a-z_]+", e)}
    assert used <= names, used - names


def test_tag_cli_without_a_daemon_says_so(tmp_path):
    r = CliRunner().invoke(main, ["tag", "start", "x", "--socket", str(tmp_path / "none.sock")])
    assert r.exit_code == 1 and "is `powerprof daemon` running" in r.output
    r = CliRunner().invoke(main, ["tag", "start", "bad name!", "--socket", str(tmp_path / "none.sock")])
    assert r.exit_code == 1 and "tag name" in r.output


def _syscall_groups() -> dict[str, set[str]]:
    """systemd's own syscall groups (`systemd-analyze syscall-filter`), nested groups expanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True, text=True, timeout=60).stdout
    raw: dict[str, list[str]] = {}
    group = None
    for line in out.splitlines():
        if line.startswith("@"):
            group = line.split()[0]
            raw[group] = []
        elif group and line.strip() and not line.strip().startswith("#"):
            raw[group].append(line.split()[0])

    def expand(name: str) -> set[str]:
        return set().union(*(expand(x) if x.startswith("@") else {x} for x in raw.get(name, [])))

    return {g: expand(g) for g in raw}


def _allowed_syscalls(unit: dict[str, list[str]]) -> set[str]:
    """The unit's SystemCallFilter= lines, applied in order as systemd does (the first an allow list; a `~` line
    removes from it, a plain one adds to it), plus @default, which systemd always allows."""
    groups = _syscall_groups()
    allowed: set[str] = set(groups["@default"])
    for line in unit["Service.SystemCallFilter"]:
        deny = line.startswith("~")
        names = set().union(*(groups[n] if n.startswith("@") else {n} for n in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed | groups["@default"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze lists systemd's syscall groups")
def test_the_daemon_unit_lets_the_daemon_set_its_open_files_limit():
    """The daemon raises RLIMIT_NOFILE (service.raise_open_files_limit). `~@resources` denied setrlimit (systemd's
    default action: kill by SIGSYS); glibc >= 2.13 sends it as prlimit64 (in @default), a libc that makes the setrlimit
    call itself would have had the daemon killed at start. And the unit now sets the limit itself."""
    from powerprof.daemon.service import OPEN_FILES_WANTED

    assert "setrlimit" in _syscall_groups()["@resources"]  # what made the unit wrong
    u = _unit()
    allowed = _allowed_syscalls(u)
    assert {"setrlimit", "prlimit64", "getrlimit"} <= allowed
    assert not {"sched_setscheduler", "setpriority", "set_mempolicy"} & allowed  # the rest of @resources stays denied
    soft, _, hard = u["Service.LimitNOFILE"][0].partition(":")
    assert int(soft) >= OPEN_FILES_WANTED and int(hard or soft) >= int(soft)


# The daemon's sandbox, option by option, where the tuner needs no more: it runs as root and sets power limits
# (CAP_SYS_ADMIN, the NVIDIA device nodes), keeps its state in /var/lib/powerprof-control and listens on loopback.
TUNER_DIFFERS = {
    "CapabilityBoundingSet": ["CAP_SYS_ADMIN"],  # the one capability setting a limit needs (privilege.py)
    "AmbientCapabilities": None,  # root: nothing to pass on to a non-root user
    "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6"],  # no netlink: it reads no network interface
    "UMask": None,  # root's own folder; the daemon's 0027 is for its group
    "SystemCallFilter": ["@system-service", "~@privileged @resources"],  # setrlimit too: it sets no limit of its own
}


def test_the_tuner_unit_is_sandboxed_as_the_daemons_where_it_needs_no_more():
    daemon, tuner = _unit(), _unit(TUNE_UNIT)
    text = UNIT.read_text()
    sandbox = text[text.index("# Sandbox"):text.index("# Resources")]
    keys = {ln.partition("=")[0] for ln in sandbox.splitlines() if ln and not ln.startswith("#")}
    assert {"ProtectKernelTunables", "SystemCallFilter", "DevicePolicy", "DeviceAllow"} <= keys
    for k in sorted(keys):
        want = TUNER_DIFFERS.get(k, daemon[f"Service.{k}"])
        assert tuner.get(f"Service.{k}") == want, (k, tuner.get(f"Service.{k}"), want)
    assert tuner["Service.StateDirectory"] == ["powerprof-control"]  # restore files, locks, decisions: root's folder


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_the_tuner_units_exposure_is_that_of_a_sandboxed_root_service(tmp_path):
    """8.9 ("EXPOSED") before its sandbox; 2.3 with it, the rest being root, CAP_SYS_ADMIN and loopback sockets."""
    assert systemd_exposure(TUNE_UNIT.read_text(), TUNE_UNIT.name, tmp_path) <= 2.5


def _size(value: str) -> int:
    """A systemd size (512M, 1G, bytes) in bytes."""
    import re

    m = re.fullmatch(r"(\d+)([KMGT]?)", value.strip())
    assert m, value
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


@pytest.mark.parametrize("workers", [1, 8])
def test_the_daemons_buffers_and_processes_fit_its_units_memory_bound(workers):
    """The write-failure buffers (docs/daemon.md, max_buffered_rows = 0) are sized from the cgroup's bound; with the
    proxy workers the docs allow under the shipped unit (8), all of it must fit MemoryMax. Before: the buffers took
    half of MemoryMax whatever the workers, 256 MiB + the daemon's 70 + 8 workers' 360 = 686 MiB in a 512M cgroup:
    a full disk then ended in the kernel's OOM kill, the buffered rows lost."""
    from powerprof.daemon.service import DAEMON_RESIDENT_MIB, WORKER_RESIDENT_MIB, buffered_rows_cap, datasets
    from powerprof.daemon.store import ROW_BYTES_EST

    u = _unit()
    limit = min(_size(v) for v in u["Service.MemoryMax"] + u.get("Service.MemoryHigh", []))
    rows = buffered_rows_cap(limit, workers, len(datasets()))
    workers_mib = WORKER_RESIDENT_MIB * workers if workers > 1 else 0
    used = rows * ROW_BYTES_EST * len(datasets()) + ((DAEMON_RESIDENT_MIB + workers_mib) << 20)
    assert used <= limit, (used >> 20, limit >> 20)
    assert rows >= 1000  # still a flush interval's worth of rows at a few hundred a second
    assert int(u["Service.TasksMax"][0]) >= 13 + 8 * workers  # the daemon's 13 threads, about 8 per worker


def test_both_units_bound_memory_and_tasks_and_the_tuner_is_killed_not_throttled():
    # A root tuner without MemoryMax could grow into the inference server's memory (tests/test_tuner_live.py checks
    # its measured use against these); MemoryHigh would throttle it while it holds a trial limit, its guard slowed,
    # where a kill at MemoryMax is a kill -9: ExecStopPost's restore puts the original limit back.
    for path in (UNIT, TUNE_UNIT):
        u = _unit(path)
        assert 64 << 20 <= _size(u["Service.MemoryMax"][0]) <= 4 << 30, path.name
        assert 8 <= int(u["Service.TasksMax"][0]) <= 4096, path.name
    tuner = _unit(TUNE_UNIT)
    assert "Service.MemoryHigh" not in tuner
    assert tuner.get("Service.OOMPolicy", ["stop"]) == ["stop"]
    assert any("restore" in v for v in tuner["Service.ExecStopPost"])


def test_roots_machine_wide_gpu_locks_are_where_the_tuner_unit_may_write():
    # ProtectSystem=strict leaves the tuner (and its ExecStartPre/ExecStopPost restore, in the same sandbox) only its
    # StateDirectory to write: root's machine-wide locks in /run/powerprof-control could not be made there, and every
    # tune and restore of the unit failed before any GPU was put back.
    from powerprof.control.gpulock import ROOT_LOCK_DIR  # noqa: PLC0415

    tuner = _unit(TUNE_UNIT)
    assert tuner["Service.ProtectSystem"] == ["strict"] and not tuner.get("Service.ReadWritePaths")
    state = [Path("/var/lib") / d for d in tuner["Service.StateDirectory"]]
    assert any(d == ROOT_LOCK_DIR or d in ROOT_LOCK_DIR.parents for d in state), (ROOT_LOCK_DIR, state)


def test_the_tuner_units_restore_steps_run_outside_its_sandbox():
    # Inside it (ProtectProc=invisible, no CAP_SYS_PTRACE) another user's /proc entry is hidden, so `restore` cannot tell
    # a process squatting a GPU's machine-wide lock name from a CAP_SYS_ADMIN controller and leaves the GPU alone: after
    # a killed tuner, any local user could keep the GPU at its trial limit. Run as root outside it ("+"), as the
    # daemon unit's start-up restore, root passes such a holder over (docs/safety.md, different state folders).
    tuner = _unit(TUNE_UNIT)
    steps = [v for k in ("Service.ExecStartPre", "Service.ExecStopPost") for v in tuner[k] if "restore" in v]
    assert len(steps) == 2 and all(v.startswith(("+-", "-+")) and v.endswith("powerprof restore") for v in steps), steps
    assert tuner["Service.ProtectProc"] == ["invisible"]
