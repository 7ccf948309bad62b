"""`powerprof devices` and `powerprof monitor` as a user runs them (simulated GPU and powercap)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pynvml
import pytest
from click.testing import CliRunner

from powerprof.cli import main
from powerprof.storage.schema import SAMPLES


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


def test_devices_json_on_the_simulator():
    r = run("devices", "--simulate", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["simulated"] is True
    (g,) = info["gpus"]
    assert g["name"].startswith("Simulated") and g["uuid"].startswith("GPU-")
    assert (g["min_limit_w"], g["max_limit_w"], g["default_limit_w"], g["power_limit_w"]) == (150, 320, 300, 300)
    assert g["supports"]["energy_counter"] is True
    kinds = {z["zone"]: z["kind"] for z in info["rapl"]["zones"]}
    assert kinds == {"package-0": "package", "dram-0": "dram"}
    assert info["rapl"]["min_wrap_period_s"] > 60
    assert info["problems"] == []


def test_devices_text_lists_limits_unsupported_readings_and_fixes(monkeypatch):
    monkeypatch.setenv("POWERPROF_SIM_UNPRIVILEGED", "1")
    r = run("devices", "--simulate", "pascal-8g", "--gpus", "0,1")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "gpu0" in out and "gpu1" in out and "range 90 W - 217 W" in out
    assert "not supported: power_instant, energy_counter" in out
    assert "permission denied" in out and "ExecStartPre=+" in out
    assert "CAP_SYS_ADMIN" in out


def test_devices_without_a_gpu_says_so_instead_of_a_traceback(monkeypatch):
    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    import powerprof.collectors.sources as sources

    monkeypatch.setitem(sys.modules, "pynvml", SimpleNamespace(nvmlInit=fail))
    monkeypatch.setattr(sources, "_open_rapl", lambda *a, **kw: None)  # the same answer on a machine with RAPL
    r = CliRunner().invoke(main, ["devices"])
    assert r.exit_code == 1, r.output  # nothing to measure
    assert "GPUs: none" in r.output and "no NVIDIA GPU reachable through NVML" in r.output
    assert "host:" in r.output


def test_devices_unknown_gpu_is_a_usage_error():
    r = CliRunner().invoke(main, ["devices", "--simulate", "--json", "--gpus", "-1"])
    assert r.exit_code == 2 and "expected NVML indexes" in r.output


def test_gpus_takes_a_gpu_or_mig_uuid_and_one_that_names_nothing_is_a_usage_error():
    from powerprof.sim.nvml import SimNVML, sim_uuid

    uuid = sim_uuid(SimNVML("a100-40g", state_path=None).profile.key, 0)
    r = CliRunner().invoke(main, ["devices", "--simulate", "a100-40g", "--json", "--gpus", uuid])
    assert r.exit_code == 0, r.output
    assert [g["uuid"] for g in json.loads(r.output)["gpus"]] == [uuid]
    r = CliRunner().invoke(main, ["devices", "--simulate", "--json", "--gpus", "MIG-4b0d8f5c-1a2b"])
    assert r.exit_code == 2 and "'MIG-4b0d8f5c-1a2b' names no GPU or MIG instance" in r.output, r.output


def test_monitor_writes_typed_parquet(tmp_path):
    out = tmp_path / "x.parquet"
    r = run("monitor", "--simulate", "--duration", "0.6", "--interval", "0.2", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert "gpu0 power=" in r.output and "package-0" in r.output and "reasons=GpuIdle" in r.output
    t = pq.read_table(out)
    # The count it prints is the file's rows (it printed reads: 12 for 16 rows, RAPL giving a row per zone).
    assert f"wrote {t.num_rows} rows" in r.output
    assert t.schema.field("time_utc").type == pa.timestamp("us", tz="UTC")
    for name in ("power_w", "energy_j", "sm_clock_mhz", "temperature_c", "power_limit_w", "cpu_util_pct"):
        assert t.schema.field(name).type == pa.float64()
    assert t.schema.names == SAMPLES.names
    d = t.to_pydict()
    devices = set(d["device"])
    assert {"gpu0", "package-0", "dram-0", "host"} <= devices
    gpu_seqs = [s for s, dev in zip(d["seq"], d["device"]) if dev == "gpu0"]
    assert gpu_seqs == [0, 1, 2, 3]  # ticks at 0, 0.2, 0.4, 0.6 s
    pkg_e = [e for e, dev in zip(d["energy_j"], d["device"]) if dev == "package-0"]
    assert pkg_e == sorted(pkg_e) and pkg_e[-1] > pkg_e[0]
    assert t.schema.metadata[b"simulated"] == b"true"


def test_monitor_says_why_cpu_power_is_missing_at_a_fast_interval(tmp_path):
    # At --interval 0.02 (allowed) every RAPL power was '-' on screen and null in --output, without a word.
    out = tmp_path / "fast.parquet"
    r = run("monitor", "--simulate", "--duration", "0.2", "--interval", "0.02", "--plain", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert "CPU power needs at least 0.05 s between RAPL reads" in r.output
    d = pq.read_table(out).to_pydict()
    assert all(p is None for p, src in zip(d["power_w"], d["source"]) if src == "rapl")  # what the note explains
    r = run("monitor", "--simulate", "--duration", "0.2", "--interval", "0.1", "--plain")
    assert r.exit_code == 0 and "CPU power needs" not in r.output


def test_monitor_writes_csv_with_the_samples_columns(tmp_path):
    out = tmp_path / "x.csv"
    r = run("monitor", "--simulate", "a100-40g", "--duration", "0.2", "--interval", "0.1", "--output", str(out))
    assert r.exit_code == 0, r.output
    t = pcsv.read_csv(out)
    assert t.column_names == SAMPLES.names
    gpu_power = [p for p, dev in zip(t.column("power_w").to_pylist(), t.column("device").to_pylist()) if dev == "gpu0"]
    assert len(gpu_power) == 3 and all(p == pytest.approx(55.0) for p in gpu_power)


@pytest.mark.parametrize(
    "args, why",
    [
        (["--interval", "0"], "--interval"),
        (["--interval", "11"], "--interval"),
        (["--duration", "-1"], "--duration"),
        (["--output", "x.txt"], "must end in"),
        (["--output", "no/such/dir/x.parquet"], "does not exist"),
        (["--gpus", "a"], "expected NVML indexes"),
    ],
)
def test_monitor_bad_arguments_fail_clearly_and_write_nothing(tmp_path, monkeypatch, args, why):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["monitor", "--simulate", "--duration", "0.1", *args])
    assert r.exit_code == 2, r.output
    assert why in r.output and "Traceback" not in r.output
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


def test_monitor_keeps_an_existing_output_unless_forced(tmp_path):
    # `monitor --output power.parquet` run twice replaced the first run's samples without a word.
    out = tmp_path / "power.parquet"
    out.write_bytes(b"an earlier run's samples")
    r = run("monitor", "--simulate", "--duration", "0.1", "--interval", "0.1", "--output", str(out))
    assert r.exit_code == 2, r.output
    assert "exists" in r.output and "--force" in r.output
    assert out.read_bytes() == b"an earlier run's samples"
    r = run("monitor", "--simulate", "--duration", "0.1", "--interval", "0.1", "--output", str(out), "--force")
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).num_rows > 0


def test_monitor_keeps_an_output_made_while_it_ran_and_its_own_samples_too(tmp_path, monkeypatch):
    # The file was checked at the start only: a second `monitor --output power.parquet` started meanwhile (or any
    # file made there during the run) was replaced at the end without a word.
    from powerprof import monitor as mon

    out = tmp_path / "power.parquet"
    real = mon.run_monitor

    def meanwhile(*a, **kw):
        out.write_bytes(b"another run's samples")
        return real(*a, **kw)

    monkeypatch.setattr(mon, "run_monitor", meanwhile)
    r = run("monitor", "--simulate", "--duration", "0.2", "--interval", "0.1", "--output", str(out))
    assert r.exit_code == 0, r.output
    assert out.read_bytes() == b"another run's samples"
    (mine,) = [p for p in tmp_path.iterdir() if p.suffix == ".parquet" and p != out]
    assert mine.name.startswith("power-") and mine.suffix == ".parquet" and pq.read_table(mine).num_rows > 0
    said = " ".join(r.output.split())
    assert f"{out} appeared while monitor ran and is kept" in said and str(mine) in said, said


def test_monitor_unknown_profile_fails_clearly():
    r = CliRunner().invoke(main, ["monitor", "--simulate", "rtx9999", "--duration", "0.1"])
    assert r.exit_code == 2 and "rtx9999" in r.output


def test_monitor_rows_show_energy_since_start_and_the_cap_reason_by_name():
    from powerprof.monitor import run_monitor
    from powerprof.rig import Rig
    from powerprof.sim.gpu import Phase

    ticks = []
    with Rig("seed-16g") as rig:
        src = rig.sources
        g = rig.nvml.gpus[0]
        g.set_limit_w(180)  # on the simulated card directly: nothing persisted, nothing to restore
        g.set_phase(Phase("decode", 0.45))
        timeline = run_monitor(src, interval_s=0.2, duration_s=0.4, on_tick=lambda k, rows: ticks.append((k, rows)))
    assert [k for k, _ in ticks] == [0, 1, 2]
    first, last = ticks[0][1], ticks[-1][1]
    assert first["gpus"][0]["energy_j"] == 0.0 and first["cpus"][0]["energy_j"] == 0.0
    gpu = last["gpus"][0]
    assert "SwPowerCap" in gpu["reasons"] and gpu["power_w"] <= 180.0 + 1e-6
    assert {s.source for s in timeline.samples()} == {"nvml", "rapl", "host"}
    # Over the time the two readings were taken: on a loaded host tick 2 is read late, and its energy is larger.
    t_ns = {s.seq: s.t_mono_ns for s in timeline.samples() if s.source == "nvml"}
    assert gpu["energy_j"] == pytest.approx(gpu["power_w"] * (t_ns[2] - t_ns[0]) / 1e9, rel=0.1)
    assert last["cpus"][0]["energy_j"] > 0 and last["host"] is not None


def test_monitor_duration_keeps_its_ticks_when_the_caller_is_late_to_stop():
    # A loaded machine: the caller is slow after the last tick, and the sampler takes tick 3 meanwhile.
    # `--duration 0.2 --interval 0.1` is ticks 0..2; the late tick must not land in the output.
    from powerprof.monitor import run_monitor
    from powerprof.rig import Rig

    def slow_after_last(k, _rows):
        if k == 2:
            time.sleep(0.35)

    with Rig("a100-40g") as rig:
        timeline = run_monitor(rig.sources, interval_s=0.1, duration_s=0.2, on_tick=slow_after_last)
    seqs = sorted({s.seq for s in timeline.samples() if s.source == "nvml"})
    assert seqs == [0, 1, 2]


def test_devices_warns_while_a_killed_sweep_left_a_limit_to_restore():
    # A controller process sets a limit and is SIGKILLed: its restore file stays behind.
    child = Path(__file__).parent / "control" / "control_child.py"
    p = subprocess.Popen([sys.executable, str(child), "--count", "1", "--gpus", "0", "--levels", "200", "--repeat", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(20, p.kill)  # bound the wait even if the child never steps
    timer.start()
    try:
        assert any(line.startswith("STEPPED 200") for line in p.stdout), p.stderr.read()
    finally:
        timer.cancel()
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=20)
    (rfile,) = Path(os.environ["POWERPROF_STATE_DIR"]).glob("restore-*.json")

    r = run("devices", "--simulate")
    assert r.exit_code == 0, r.output
    assert f"Warning: powerprof (pid {p.pid}" in r.output and "simulated GPU" in r.output
    assert f"powerprof restore --restore-file {rfile}" in r.output
    assert r.output.index("Warning:") < r.output.index("gpu0")  # the warning comes first
    r = run("devices", "--simulate", "--json")
    note = json.loads(r.output)["restore_note"]
    assert f"pid {p.pid}" in note and "original power limit 300 W" in note

    assert run("restore", "--simulate", "--restore-file", str(rfile)).exit_code == 0
    r = run("devices", "--simulate", "--json")
    assert json.loads(r.output)["restore_note"] is None and json.loads(r.output)["gpus"][0]["power_limit_w"] == 300


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_monitor_stopped_by_a_signal_still_writes_its_samples(tmp_path, sig):
    # SIGTERM (kill, `timeout`, systemd) or SIGHUP (a closed terminal) used to end monitor with no
    # file at all: every sample of the run was lost. Now they are written as on Ctrl-C, then 128 + signum.
    out = tmp_path / "m.parquet"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "monitor", "--simulate", "--plain",
                          "--interval", "0.1", "--output", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert p.stdout.readline()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err and f"stopped by {sig.name}" in err
    assert pq.read_table(out).num_rows > 0


@pytest.mark.parametrize("args", [
    ["monitor", "--simulate", "--duration", "inf"],  # was an OverflowError traceback
    ["monitor", "--simulate", "--duration", "nan"],
    ["monitor", "--simulate", "--interval", "nan"],  # nan passes 0.02 <= x <= 10 (every comparison is false)
    ["trace", "{tmp}/t.jsonl", "--rate", "nan"],  # wrote a trace of NaN arrival times, exit 0
    ["replay", "{tmp}/t.jsonl", "--simulate", "--time-scale", "nan"],
    ["analyze", "{tmp}", "--eta", "nan"],  # was a ValueError from the policy after the runs were read (exit 1)
])
def test_nan_and_inf_are_usage_errors_that_write_nothing(tmp_path, args):
    r = CliRunner().invoke(main, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.exit_code == 2 and "is not a finite number" in r.output, r.output
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("as_json", [True, False])
@pytest.mark.parametrize("stderr_too", [False, True])
def test_monitor_whose_reader_goes_away_still_writes_its_samples(tmp_path, as_json, stderr_too):
    # `monitor --json --output F | head -3`: the closed pipe ended monitor before F was written, every
    # sample lost. Now it is written as on Ctrl-C, and the exit is SIGPIPE's 141 with no traceback.
    out = tmp_path / "m.csv"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "monitor", "--simulate", "--interval", "0.1",
                          "--json" if as_json else "--plain", "--output", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_too else subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert p.stdout.readline()
        p.stdout.close()  # what `head -3` does after its third line
        err = "" if stderr_too else p.stderr.read()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if not stderr_too:
        assert "wrote" in err and str(out) in err
    rows = pcsv.read_csv(out).num_rows
    assert rows >= 3


def _wait_for(cond, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _flushed_gpu_rows(parts: Path) -> int:
    try:
        t = pq.read_table(parts, columns=["device"])
    except (OSError, pa.ArrowInvalid):
        return 0
    return t.column("device").to_pylist().count("gpu0")


@pytest.mark.parametrize("name", ["m.parquet", "m.csv"])
def test_monitor_killed_by_sigkill_keeps_its_samples_up_to_the_last_flush(tmp_path, name):
    # `--output` was written only at the end: a kill -9, an OOM kill or a power cut lost every sample of the
    # session. Now the samples are written as they come, each part a whole Parquet file, so what a killed
    # monitor leaves is readable and misses at most the last few seconds.
    out = tmp_path / name
    parts = tmp_path / f"{name}.parts"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "monitor", "--simulate", "--plain",
                          "--interval", "0.1", "--output", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _flushed_gpu_rows(parts) >= 15)  # some flushes happened while it ran
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        killed_at_utc = time.time()
    finally:
        if p.poll() is None:
            p.kill()
    assert not out.exists()  # never combined: no half file under the user's name
    t = pq.read_table(parts)  # every file the folder holds is whole Parquet
    assert t.schema.names == SAMPLES.names and t.schema.metadata[b"simulated"] == b"true"
    d = t.to_pydict()
    seqs = [s for s, dev in zip(d["seq"], d["device"]) if dev == "gpu0"]
    assert len(seqs) >= 15 and seqs == list(range(len(seqs)))  # from the start, none twice, none missing
    last_utc = max(d["time_utc"]).timestamp()
    assert killed_at_utc - last_utc < 15.0  # a few seconds lost (flush every 2 s; margin for a loaded machine)
    # A second monitor of that name will not bury them: it refuses, says where they are, and leaves them.
    r = run("monitor", "--simulate", "--duration", "0.1", "--interval", "0.1", "--output", str(out), "--force")
    assert r.exit_code == 2 and f"{name}.parts" in r.output and "kill" in r.output, r.output
    assert pq.read_table(parts).num_rows == t.num_rows and not out.exists()
    # Nothing combined them for the user: the refusal names the command that does, and it writes the file asked for.
    assert f"powerprof monitor --recover {out}" in " ".join(r.output.split()), r.output
    r = run("monitor", "--recover", str(out))
    assert r.exit_code == 0, r.output
    got = pq.read_table(out) if name.endswith(".parquet") else pcsv.read_csv(
        out, convert_options=pcsv.ConvertOptions(column_types=SAMPLES))
    assert got.schema.names == SAMPLES.names and got.num_rows == t.num_rows
    if name.endswith(".parquet"):
        assert got.schema.metadata[b"simulated"] == b"true" and got.schema.metadata[b"powerprof_command"] == b"monitor"
    key = ["seq", "device", "source"]
    assert got.select(key).sort_by([(c, "ascending") for c in key]).to_pylist() == \
        t.select(key).sort_by([(c, "ascending") for c in key]).to_pylist()
    assert got.column("power_w").to_pylist() == t.column("power_w").to_pylist()  # the parts' order, each row once
    assert f"wrote {t.num_rows} rows" in r.output and not parts.exists()
    assert sorted(x.name for x in tmp_path.iterdir() if x.name != "state") == [name]  # no parts, no temporaries


def test_monitor_recover_refuses_what_it_cannot_do_and_changes_nothing(tmp_path):
    out = tmp_path / "m.parquet"
    r = run("monitor", "--recover", str(out))  # nothing to recover
    assert r.exit_code == 2 and "m.parquet.parts" in r.output and "nothing to recover" in r.output, r.output
    assert [x for x in tmp_path.iterdir() if x.name != "state"] == []
    parts = tmp_path / "m.parquet.parts"
    parts.mkdir()
    rows = [{"seq": i, "device": "gpu0", "source": "nvml", "power_w": 100.0 + i} for i in range(4)]
    part = pa.Table.from_pylist(rows, schema=pa.schema([SAMPLES.field(c) for c in rows[0]]))
    pq.write_table(part, parts / "part-000001.parquet")
    out.write_bytes(b"earlier samples")
    r = run("monitor", "--recover", str(out))  # F exists: kept unless --force, the parts too
    assert r.exit_code == 2 and "exists" in r.output and "--force" in r.output, r.output
    assert out.read_bytes() == b"earlier samples" and (parts / "part-000001.parquet").exists()
    (parts / "part-000002.parquet").write_bytes(b"not parquet")  # a damaged part: nothing written, parts kept
    r = run("monitor", "--recover", str(out), "--force")
    assert r.exit_code == 1 and "part-000002.parquet" in r.output and "Traceback" not in r.output, r.output
    assert out.read_bytes() == b"earlier samples" and len(list(parts.glob("part-*.parquet"))) == 2
    (parts / "part-000002.parquet").unlink()
    r = run("monitor", "--recover", str(out), "--force")
    assert r.exit_code == 0, r.output
    t = pq.read_table(out)
    assert t.schema.names == SAMPLES.names and t.column("power_w").to_pylist() == [100.0, 101.0, 102.0, 103.0]
    assert not parts.exists()


def test_monitor_recover_removes_only_the_parts_it_read(tmp_path):
    # It removed the whole FILE.parts folder: a user's notes.txt and sub/keep.txt in it were gone.
    out = tmp_path / "m.parquet"
    parts = tmp_path / "m.parquet.parts"
    (parts / "sub").mkdir(parents=True)
    rows = [{"seq": i, "device": "gpu0", "source": "nvml", "power_w": 100.0 + i} for i in range(4)]
    part = pa.Table.from_pylist(rows, schema=pa.schema([SAMPLES.field(c) for c in rows[0]]))
    pq.write_table(part, parts / "part-000001.parquet")
    (parts / ".part-000002.parquet.123.abcd.tmp").write_bytes(b"a killed flush's temporary")  # the monitor's own
    (parts / "notes.txt").write_text("mine")
    (parts / "sub" / "keep.txt").write_text("mine too")
    r = run("monitor", "--recover", str(out))
    assert r.exit_code == 0, r.output
    assert pq.read_table(out).num_rows == 4
    assert sorted(str(p.relative_to(parts)) for p in parts.rglob("*")) == ["notes.txt", "sub", "sub/keep.txt"]
    assert (parts / "notes.txt").read_text() == "mine" and (parts / "sub" / "keep.txt").read_text() == "mine too"
    said = " ".join(r.output.split())
    assert "left: 2 other files in" in said and str(parts) in said, said


def test_monitor_stopped_cleanly_leaves_one_file_and_no_parts(tmp_path):
    (tmp_path / "o").mkdir()
    out = tmp_path / "o" / "m.parquet"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "monitor", "--simulate", "--plain",
                          "--interval", "0.1", "--output", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "o" / "m.parquet.parts"
    try:
        _wait_for(lambda: _flushed_gpu_rows(parts) >= 5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert [x.name for x in out.parent.iterdir()] == ["m.parquet"]  # no parts, no temporaries
    t = pq.read_table(out)
    rows = t.to_pylist()
    seqs = [r["seq"] for r in rows if r["device"] == "gpu0"]
    # A tick a starved sampler missed is stored as such (no reading, its error says so), not as gpu0's row: every tick
    # is either (at 0.1 s on a loaded host, tick 1 once was).
    missed = {r["seq"] for r in rows if r["source"] == "nvml" and r["error"] and r["device"] != "gpu0"}
    assert len(seqs) >= 5 and seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert sorted(set(seqs) | missed) == list(range(max(seqs) + 1)), (seqs, missed)
    assert f"wrote {t.num_rows} rows" in err


def test_monitor_without_output_keeps_no_samples_in_memory(monkeypatch):
    # Every sample of a `monitor` left running for days stayed in memory, though nothing would ever write them.
    from powerprof import monitor as mon

    kept = []
    real = mon.run_monitor

    def spy(*a, **kw):
        tl = real(*a, **kw)
        kept.append(len(tl))
        return tl

    monkeypatch.setattr(mon, "run_monitor", spy)
    r = run("monitor", "--simulate", "--duration", "0.3", "--interval", "0.1", "--plain")
    assert r.exit_code == 0, r.output
    assert r.output.count("gpu0 power=") == 4 and kept == [0]  # four ticks shown, none kept


def test_monitor_recover_leaves_the_parts_of_a_monitor_still_running(tmp_path):
    # The parts of a live monitor are not a killed one's: combining and removing them would lose what it writes next.
    out = tmp_path / "m.parquet"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "monitor", "--simulate", "--plain",
                          "--interval", "0.1", "--output", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    parts = tmp_path / "m.parquet.parts"
    try:
        _wait_for(lambda: _flushed_gpu_rows(parts) >= 3)
        r = run("monitor", "--recover", str(out))
        assert r.exit_code == 1 and "still running" in r.output, r.output
        assert parts.is_dir() and not out.exists()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert out.exists() and not parts.exists()


def test_monitor_refuses_plain_and_json_together(tmp_path):
    # `monitor --json --plain` quietly printed JSON lines: one output form a run, said.
    r = run("monitor", "--json", "--plain", "--duration", "1", "--simulate")
    assert r.exit_code == 2 and "--plain and --json" in r.output, r.output


def test_devices_on_the_simulator_with_a_state_folder_that_is_a_file_says_so(tmp_path, monkeypatch):
    # The review's case: NotADirectoryError from the simulated powercap folder, a traceback; `sweep` said it already.
    (tmp_path / "statefile").write_text("x")
    monkeypatch.setenv("POWERPROF_STATE_DIR", str(tmp_path / "statefile"))
    r = CliRunner().invoke(main, ["devices", "--simulate"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (r.output, r.exception)
    assert "is a file, not a folder" in r.output, r.output
