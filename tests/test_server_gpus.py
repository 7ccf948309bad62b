"""The GPUs the server runs on against the GPUs measured: a server GPU left out of the measurement stops a sweep or a
measure before anything changes (its energy would be in no figure, its limit not stepped), a measured GPU the server
does not use is said, and a launched server is put on the measured GPUs (workload/placement.py, rig.py)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.workload.client import RequestParams
from powerprof.workload.load import Prompt

PROMPTS = [Prompt("p0", "hello there"), Prompt("p1", "tell me more")]


def _restore_files():
    state = os.environ.get("POWERPROF_STATE_DIR")
    return [f for f in os.listdir(state) if f.endswith(".json")] if state and os.path.isdir(state) else []


def test_sweep_on_one_gpu_of_a_server_on_two_stops_before_any_limit_and_names_the_other(tmp_path):
    from powerprof.cli import main

    # The simulated server runs on both simulated GPUs (its process on both lists); the sweep measures GPU 1 alone.
    r = CliRunner().invoke(main, ["sweep", "--simulate", "--gpus", "1", "--limits", "300,220", "--max-time", "4",
                                  "--max-tokens", "16", "--out", str(tmp_path / "x")],
                           env={"POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 2, r.output
    assert "the server also runs on GPU 0 (GPU-" in r.output and "--gpus 0,1" in r.output, r.output
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())  # nothing measured, nothing written
    sim = SimNVML("seed-16g", count=2)  # the state file the sweep used: no limit moved, no restore pending
    assert [g.limit_w for g in sim.gpus] == [g.profile.default_limit_w for g in sim.gpus]
    assert not _restore_files()


def test_measure_json_says_the_refusal_as_one_json_object(tmp_path):
    from powerprof.cli import main

    # A host of two simulated cards, powerprof shown GPU 1 alone; the simulated server runs on both.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--requests", "2", "--max-tokens", "16",
                                  "--json", "--out", str(tmp_path / "m")],
                           env={"CUDA_VISIBLE_DEVICES": "1", "POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 2, r.output
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert obj["ok"] is False and obj["exit_code"] == 2 and "the server also runs on GPU 0 (GPU-" in obj["error"], obj
    assert not (tmp_path / "m").exists()


def test_measure_of_a_gpu_subset_refuses_a_server_on_a_hidden_gpu(tmp_path, monkeypatch):
    from powerprof.workload.measure import run_measure
    from powerprof.workload.placement import GpuPlacementError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # measure measures the GPUs powerprof is shown
    sim = SimNVML("seed-16g", count=2, state_path=None)
    with Rig("seed-16g", nvml=sim, sim_gpu_count=2, sim_server_gpus=[0, 1]) as rig:
        with pytest.raises(GpuPlacementError) as e:
            run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=PROMPTS, n_requests=2, concurrencies=[1],
                        params=RequestParams(max_tokens=16), warmup=0, interval_s=0.2)
    # The fix is sweep's, --gpus (which measure takes too, over CUDA_VISIBLE_DEVICES), not a CUDA_VISIBLE_DEVICES to set.
    assert f"GPU 0 ({sim.gpus[0].uuid})" in str(e.value) and "add it: --gpus 0,1" in str(e.value), str(e.value)
    assert "CUDA_VISIBLE_DEVICES=" not in str(e.value)


def test_measure_takes_gpus_as_sweep_does_and_measures_those(tmp_path):
    from powerprof.cli import main

    # measure had no --gpus: the GPUs measured were those CUDA_VISIBLE_DEVICES showed, and `--gpus 1` was "No such
    # option". Now GPU 1 of two is measured (the simulated server on it, as a server launched with --gpus is).
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--requests", "2",
                                  "--max-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "m" / "run.json").read_text())
    sim = SimNVML("seed-16g", count=2, state_path=None)
    assert [(g["index"], g["uuid"]) for g in meta["gpus"]] == [(1, sim.gpus[1].uuid)], meta["gpus"]
    assert not [n for n in meta["notes"] if "server also runs" in n or "server's processes" in n], meta["notes"]
    # A UUID names the same GPU.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--gpus", sim.gpus[1].uuid,
                                  "--requests", "2", "--max-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "u")])
    assert r.exit_code == 0, r.output
    assert [g["index"] for g in json.loads((tmp_path / "u" / "run.json").read_text())["gpus"]] == [1]


@pytest.mark.parametrize("value, said", [
    ("5", "GPU index 5 does not exist: this machine has 2 GPU(s) (0-1)"),
    ("GPU-ffffffff", "'GPU-ffffffff' names no GPU or MIG instance on this machine"),
    ("one", "expected NVML indexes like 0 or 0,1, or UUIDs"),
])
def test_measure_refuses_a_gpu_that_is_not_there_as_sweep_does(tmp_path, value, said):
    from powerprof.cli import main

    # The same --gpus, the same refusal (exit 2, before anything is measured or written), in the same words.
    got = {}
    for cmd in (["measure", "--requests", "2"], ["sweep", "--limits", "300"]):
        r = CliRunner().invoke(main, [*cmd, "--simulate", "seed-16g,seed-16g", "--gpus", value, "--max-tokens", "16",
                                      "--out", str(tmp_path / cmd[0])])
        assert r.exit_code == 2, (cmd, r.output)
        assert said in r.output and "Traceback" not in r.output, (cmd, r.output)
        assert not (tmp_path / cmd[0]).exists(), cmd
        got[cmd[0]] = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert got["measure"] == got["sweep"], got


def test_measure_on_one_gpu_of_a_server_on_two_stops_and_names_the_other(tmp_path):
    from powerprof.cli import main

    # The simulated server on both GPUs, measure given GPU 1: refused before any request (exit 2), GPU 0 named with
    # its UUID and the fix, as a sweep refuses it; nothing written.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--requests", "2",
                                  "--max-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "m")],
                           env={"POWERPROF_SIM_SERVER_GPUS": "0,1"})
    sim = SimNVML("seed-16g", count=2, state_path=None)
    assert r.exit_code == 2, r.output
    assert f"the server also runs on GPU 0 ({sim.gpus[0].uuid})" in r.output and "add it: --gpus 0,1" in r.output, r.output
    assert "nothing was measured" in r.output and "--allow-unmeasured-server-gpus" in r.output, r.output
    assert not (tmp_path / "m").exists()
    # With the way past it, measured anyway and said in the run's notes.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--requests", "2",
                                  "--max-tokens", "16", "--warmup", "0", "--out", str(tmp_path / "a"),
                                  "--allow-unmeasured-server-gpus"], env={"POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 0, r.output
    notes = json.loads((tmp_path / "a" / "run.json").read_text())["notes"]
    assert any(n.startswith("measured anyway (--allow-unmeasured-server-gpus): the server also runs on GPU 0") for n in notes)


def test_a_server_measure_launches_is_shown_only_the_gpus_measured(tmp_path, monkeypatch):
    import socket

    from powerprof.workload.launcher import LaunchError
    from powerprof.workload.measure import run_measure

    # measure's --gpus goes where sweep's does: a --launch'ed server's CUDA_VISIBLE_DEVICES is the measured GPUs' UUIDs.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = tmp_path / "env.txt"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = (f"{sys.executable} -c \"import os, sys; open({str(seen)!r}, 'w')"
              ".write(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')); sys.exit(3)\"")
    sim = SimNVML("seed-16g", count=3, state_path=None)
    with Rig("seed-16g", nvml=sim, gpus=[2]) as rig:
        with pytest.raises(LaunchError, match="exited with code 3"):
            run_measure(rig, url=f"http://127.0.0.1:{port}", launch=launch, launch_timeout_s=20, out_dir=tmp_path / "m",
                        prompts=PROMPTS, n_requests=2, concurrencies=[1], params=RequestParams(max_tokens=16), warmup=0)
    assert seen.read_text() == sim.gpus[2].uuid


def test_sweep_and_measure_share_one_gpus_option():
    from powerprof.cli import main

    # One definition, so the two cannot drift apart in parsing or words (help text, callback, the way past the check).
    def opt(cmd, name):
        (o,) = [p for p in main.commands[cmd].params if p.name == name]
        return o

    for name in ("gpus", "allow_unmeasured_server_gpus"):
        a, b = opt("sweep", name), opt("measure", name)
        assert (a.opts, a.help, a.callback) == (b.opts, b.help, b.callback), name


def test_a_measured_gpu_the_server_does_not_use_is_said_with_the_fix(tmp_path):
    from powerprof.workload.measure import run_measure

    sim = SimNVML("seed-16g", count=2, state_path=None)
    with Rig("seed-16g", nvml=sim, sim_gpu_count=2, sim_server_gpus=[0]) as rig:
        res = run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=PROMPTS, n_requests=2, concurrencies=[1],
                          params=RequestParams(max_tokens=16), warmup=0, interval_s=0.2)
    (note,) = [n for n in res.notes if "holds none of the server's processes" in n]
    assert note.startswith(f"GPU 1 ({sim.gpus[1].uuid})") and "idle power" in note, note
    meta = json.loads((tmp_path / "m" / "run.json").read_text())
    assert note in meta["notes"]


def test_a_server_on_exactly_the_measured_gpus_says_nothing_new(tmp_path):
    from powerprof.workload.measure import run_measure

    sim = SimNVML("seed-16g", count=2, state_path=None)
    with Rig("seed-16g", nvml=sim, sim_gpu_count=2) as rig:
        res = run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=PROMPTS, n_requests=2, concurrencies=[1],
                          params=RequestParams(max_tokens=16), warmup=0, interval_s=0.2)
    assert not [n for n in res.notes if "server's processes" in n or "server also runs" in n], res.notes


def test_a_launched_server_is_shown_only_the_measured_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sim = SimNVML("seed-16g", count=3, state_path=None)
    with Rig("seed-16g", nvml=sim, gpus=[0, 2]) as rig:
        rig.sources
        env = rig._launch_env()
    assert env["CUDA_VISIBLE_DEVICES"] == f"{sim.gpus[0].uuid},{sim.gpus[2].uuid}"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # The user's own setting is kept, and said where it names other GPUs than --gpus.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with Rig("seed-16g", nvml=sim, gpus=[0, 2]) as rig:
        rig.sources
        assert rig._launch_env() is None
        assert any("CUDA_VISIBLE_DEVICES=1 (yours" in n and "GPU(s) 1," in n for n in rig.notes), rig.notes
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{sim.gpus[2].uuid},{sim.gpus[0].uuid}")
    with Rig("seed-16g", nvml=sim, gpus=[0, 2]) as rig:
        rig.sources
        assert rig._launch_env() is None and not [n for n in rig.notes if "CUDA_VISIBLE" in n]  # the same GPUs
    # Without --gpus the environment is left as it is (the server sees what powerprof sees).
    with Rig("seed-16g", nvml=sim) as rig:
        rig.sources
        assert rig._launch_env() is None


def _two_gpu_daemon(tmp_path, gpus: str, server_gpus: str, **env):
    """A daemon over the simulated two-GPU host, daemon.gpus = `gpus`, the simulated server on `server_gpus`."""
    from daemon_helpers import DaemonProc, sim_env

    cfg = tmp_path / "daemon.toml"
    cfg.write_text(f"[daemon]\ngpus = {gpus}\n")
    return DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "seed-16g", "--sim-gpus", "2",
                      "--interval", "0.25", "--flush-interval", "0.5",
                      env={**sim_env(tmp_path), "POWERPROF_SIM_SERVER_GPUS": server_gpus, **env})


def _post_completions(d, n: int, max_tokens: int) -> None:
    """`n` completions through the daemon's proxy, one after another."""
    import urllib.request

    for _ in range(n):
        body = json.dumps({"prompt": "hello", "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(d.info["proxy"] + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=60).read()


def _serve_and_stop(d, n: int, max_tokens: int) -> str:
    """`n` completions through the daemon's proxy, then the daemon stopped (exit 0 checked); its output."""
    try:
        _post_completions(d, n, max_tokens)
    finally:
        rc = d.stop()
    out = d.output()
    assert rc == 0, out[-3000:]
    return out


def test_daemon_sampling_one_gpu_of_a_server_on_two_says_so_and_marks_its_rows(tmp_path):
    from daemon_helpers import read_dataset

    d = _two_gpu_daemon(tmp_path, "[1]", "0,1")
    tag = [sys.executable, "-m", "powerprof.cli", "tag"]
    try:
        subprocess.run(tag + ["start", "t", "--socket", d.info["tags"]], check=True, capture_output=True, timeout=60)
        _post_completions(d, 3, 24)
        subprocess.run(tag + ["stop", "t", "--socket", d.info["tags"]], check=True, capture_output=True, timeout=60)
    finally:
        rc = d.stop()
    out = d.output()
    assert rc == 0, out
    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    said = f"server-gpu-unsampled: the server also runs on GPU 0 ({sim.gpus[0].uuid}), which is not measured"
    assert said in out and "gpus = [0, 1]" in out, out[-3000:]
    intervals, reqs = read_dataset(tmp_path / "data", "intervals"), read_dataset(tmp_path / "data", "requests")
    assert len(intervals) and intervals["energy_note"].str.contains("server-gpu-unsampled").all()
    assert len(reqs) == 3 and reqs["energy_note"].str.contains("server-gpu-unsampled").all(), reqs["energy_note"]
    (tag_note,) = read_dataset(tmp_path / "data", "tags")["energy_note"]
    assert "server-gpu-unsampled" in tag_note, tag_note
    # `analyze` leaves those requests out of its J/token, and says so with the fix.
    from powerprof.analysis.fleet import fleet_summary, notes

    (host,) = fleet_summary([str(tmp_path / "data")]).to_pylist()
    # On a loaded host a request's intervals may also say their bypass count may be low (a scrape late): such a request
    # is counted with those (bypass_uncertain_requests), still out of J/token. Every one of the three is out, and said.
    assert host["uncertain_requests"] + host["bypass_uncertain_requests"] == 3, host
    assert host["gpu_j_per_token"] is None, host
    if host["uncertain_requests"]:
        assert any("server-gpu-unsampled (given energy" in n and "daemon.gpus" in n
                   for n in notes(fleet_summary([str(tmp_path / "data")]))), notes(fleet_summary([str(tmp_path / "data")]))


def test_daemon_sampling_every_gpu_of_the_server_marks_nothing(tmp_path):
    from daemon_helpers import DaemonProc, read_dataset, sim_env

    d = DaemonProc(tmp_path / "data", "--simulate", "seed-16g", "--sim-gpus", "2", "--interval", "0.25",
                   "--flush-interval", "0.5", env=sim_env(tmp_path))
    time.sleep(1.5)
    rc = d.stop()
    assert rc == 0 and "server-gpu-unsampled" not in d.output()
    intervals = read_dataset(tmp_path / "data", "intervals")
    assert not intervals["energy_note"].fillna("").str.contains("server-gpu-unsampled").any()


def test_a_daemon_on_every_gpu_of_a_two_gpu_server_knows_they_serve_and_flags_no_row_for_it(tmp_path):
    from daemon_helpers import read_dataset

    # A tensor-parallel server on GPUs 0 and 1, daemon.gpus = [0, 1]. Before, nothing told the ledger which GPUs serve
    # (daemon.gpus chose only those sampled): until the GPUs' power judged them each row was flagged, the fix its note
    # named (daemon.gpus) the one already set: 20 of 44 rows in 20 s (4 of 43 on a quieter host). Now the placement
    # check's finding (the server's processes on both) is taken from the first interval.
    d = _two_gpu_daemon(tmp_path, "[0, 1]", "0,1")
    out = _serve_and_stop(d, 10, 48)
    reqs = read_dataset(tmp_path / "data", "requests")
    assert len(reqs) == 10
    assert not reqs["energy_note"].fillna("").str.contains("GPU serving none of its work").any(), reqs["energy_note"]
    # Said once, whence (before, again at every close once all GPUs served: 15 times in 20 s).
    runs_on = [line for line in out.splitlines() if "the proxied work runs on" in line]
    assert len(runs_on) == 1 and "every sampled GPU takes part (the server's processes" in runs_on[0], runs_on
    assert "serve the proxied work is not known" not in out


def test_a_daemon_gpus_of_several_gpus_tells_nothing_of_which_serve(tmp_path):
    from daemon_helpers import read_dataset

    # daemon.gpus = [0, 1], the server on GPU 0 alone, its processes not findable (another pid namespace: the lookup
    # made to fail). Before, daemon.gpus was told as every named GPU serving, unchecked: GPU 1's idle draw in every row,
    # unflagged (the review's daemon: 93 of 94 rows, +7.7% median). It chooses the GPUs sampled only: which serve stays
    # undecided, the rows flagged, until the GPUs' power judges.
    (tmp_path / "sc").mkdir()
    (tmp_path / "sc" / "sitecustomize.py").write_text(
        "from powerprof.workload import serverprocs\n"
        "serverprocs.ServerProcesses.__call__ = lambda self: (None, 'hidden by the test')\n")
    path = os.pathsep.join([str(tmp_path / "sc"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
                            *sys.path])
    d = _two_gpu_daemon(tmp_path, "[0, 1]", "0", PYTHONPATH=path)
    out = _serve_and_stop(d, 3, 48)
    reqs = read_dataset(tmp_path / "data", "requests")
    assert len(reqs) == 3
    assert reqs["energy_note"].fillna("").str.contains("GPU serving none of its work").all(), reqs["energy_note"]
    assert "serve the proxied work is not known" in out and "taken as the server's GPUs" not in out


def test_the_daemon_names_the_gpus_that_serve_by_nvml_index_and_uuid(caplog):
    import logging

    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.proxy import RequestTrace
    from powerprof.daemon.streams import Counts
    from support import LedgerReading as R, RowSink as Sink

    # daemon.gpus = [2, 5]: the work runs on GPU 2, GPU 5 draws no more when it runs. The log said "[0]" and "[1]",
    # list positions, where "[1]" meant GPU 5.
    caplog.set_level(logging.INFO)
    S = 1_000_000_000
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1, gpu_names=["gpu2 (GPU-aaa)", "gpu5 (GPU-bbb)"])
    e, t = [0.0, 0.0], 0
    for _ in range(8):
        led.add_gpu_sample(t * S, t * S, [R(e[0], 70.0), R(e[1], 70.0)])
        e, t = [e[0] + 70.0, e[1] + 70.0], t + 1
    for k in range(12):
        tr = RequestTrace(100 + k, "POST", "/completion", "t", int((t - 0.001) * S), 0, api="llamacpp", stream=True)
        led.on_start(tr)
        for j in range(10):
            led.on_tokens(tr, int((t + 0.05 + 0.09 * j) * S), 1)
        tr.first_ns, tr.last_ns, tr.end_ns = int((t + 0.05) * S), int((t + 0.86) * S), int((t + 0.999) * S)
        tr.counts = Counts(generated_tokens=10, prompt_tokens=0, model=None, stop_reason=None, token_source="usage")
        led.on_end(tr)
        led.add_gpu_sample(t * S, t * S, [R(e[0], 400.0), R(e[1], 70.0)])
        e, t = [e[0] + 400.0, e[1] + 70.0], t + 1
        led.advance(int((t - 0.5) * S))
    (line,) = [r.getMessage() for r in caplog.records if "the proxied work runs on" in r.getMessage()]
    assert "runs on sampled GPU(s) gpu2 (GPU-aaa);" in line and "GPU(s) gpu5 (GPU-bbb) draw no more" in line, line


def _two_gpu_server(engine_gpu: int, engine_bytes: int, other_gpu: int, other_bytes: int):
    """A simulated host of two GPUs with the server's engine (pid 4242) on one and a child (4243) on the other."""
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(engine_gpu, 4242, engine_bytes, lambda: 1.0)
    sim.add_process(other_gpu, 4243, other_bytes, lambda: 0.0)
    return sim


def test_a_small_helper_context_on_an_unmeasured_gpu_is_a_note_not_a_refusal():
    from powerprof.workload.placement import find_placement, judge_placement

    # The engine holds 14 GiB on GPU 1; a child touched CUDA once (PyTorch's default device): 300 MiB on GPU 0. It
    # read "the server also runs on GPU 0 …; add it: --gpus 0,1" and refused the sweep and the measure (exit 2).
    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    assert p.unmeasured == {} and p.unmeasured_text() is None
    notes: list[str] = []
    judge_placement(p, notes)
    (note,) = notes
    assert f"a helper context of 300 MiB on GPU 0 ({sim.gpus[0].uuid})" in note and "not counted as serving" in note


def test_real_use_on_an_unmeasured_gpu_is_still_refused_small_model_split_included():
    from powerprof.workload.placement import GpuPlacementError, find_placement, judge_placement

    # A small model split over two GPUs (400 MiB each): each GPU's share is its largest, so both serve.
    sim = _two_gpu_server(1, 400 << 20, 0, 400 << 20)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    assert list(p.unmeasured) == [0]
    # 2 GiB beside 14 GiB: over the 1 GiB bound, serving.
    sim = _two_gpu_server(1, 14 << 30, 0, 2 << 30)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    with pytest.raises(GpuPlacementError) as e:
        judge_placement(p, [])
    assert "--gpus 0,1" in str(e.value) and "--allow-unmeasured-server-gpus" in str(e.value)
    notes: list[str] = []
    judge_placement(p, notes, allow=True)
    assert notes and notes[0].startswith("measured anyway (--allow-unmeasured-server-gpus): the server also runs on GPU 0")


def test_measure_allow_unmeasured_server_gpus_measures_and_says_so_in_run_json(tmp_path):
    from powerprof.cli import main

    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--requests", "2", "--max-tokens", "16",
                                  "--allow-unmeasured-server-gpus", "--out", str(tmp_path / "m")],
                           env={"CUDA_VISIBLE_DEVICES": "1", "POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "m" / "run.json").read_text())
    assert any(n.startswith("measured anyway (--allow-unmeasured-server-gpus): the server also runs on GPU 0")
               for n in meta["notes"]), meta["notes"]


def _daemon_sampling_gpu1_of_a_server_on_two():
    """(simulated NVML, the server-process lookup's answer to change, the daemon's placement state) for
    Daemon._check_placement: the upstream (pid 4242, 8 GiB on each) on GPUs 0 and 1, the daemon sampling GPU 1."""
    from types import SimpleNamespace

    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    for i in (0, 1):
        sim.add_process(i, 4242, 8 << 30, lambda: 1.0)
    answer = [({4242}, None)]
    d = SimpleNamespace(_server_procs=lambda: answer[0], collector=SimpleNamespace(nvml=sim, infos=[sim.gpus[1]]),
                        gpu_uuids={1: sim.gpus[1].uuid}, _unsampled=(),
                        ledger=SimpleNamespace(unsampled_note=None, tell_serving=lambda *a, **k: None),
                        _idle_said=False, _helper_said=False)
    return sim, answer, d


def test_the_daemon_keeps_the_unsampled_flag_while_nothing_can_be_told_and_clears_it_on_evidence():
    from powerprof.daemon.service import Daemon

    # The upstream on GPUs 0 and 1, the daemon sampling GPU 1. Then a restart: nothing listens for a moment, so the
    # server's processes cannot be found (find_placement: None). That cleared the flag ("runs on sampled GPUs only
    # again") and rows closed for up to 30 s after were unmarked, GPU 0 still unsampled.
    sim, answer, d = _daemon_sampling_gpu1_of_a_server_on_two()
    Daemon._check_placement(d)
    assert d._unsampled == (0,) and d.ledger.unsampled_note.startswith("server-gpu-unsampled: the server also runs on GPU 0")
    answer[0] = (None, "nothing listens on port 8000")  # restarting
    Daemon._check_placement(d)
    assert d._unsampled == (0,) and d.ledger.unsampled_note is not None
    answer[0] = ({4242}, None)  # back, still on GPU 0: still flagged
    Daemon._check_placement(d)
    assert d._unsampled == (0,) and d.ledger.unsampled_note is not None
    sim.remove_process(0, 4242)  # positive evidence: only on the sampled GPU now
    Daemon._check_placement(d)
    assert d._unsampled == () and d.ledger.unsampled_note is None


def test_the_daemon_does_not_flag_rows_for_a_helper_context(caplog):
    import logging
    from types import SimpleNamespace

    from powerprof.daemon.service import Daemon

    caplog.set_level(logging.INFO)
    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)
    d = SimpleNamespace(_server_procs=lambda: ({4242, 4243}, None),
                        collector=SimpleNamespace(nvml=sim, infos=[sim.gpus[1]]), gpu_uuids={1: sim.gpus[1].uuid},
                        _unsampled=(), ledger=SimpleNamespace(unsampled_note=None, tell_serving=lambda *a, **k: None),
                        _idle_said=False, _helper_said=False)
    Daemon._check_placement(d)
    assert d._unsampled == () and d.ledger.unsampled_note is None
    assert any("a helper context of 300 MiB on GPU 0" in r.getMessage() for r in caplog.records)


def _two_gpu_stand_in(sim, led):
    """A stand-in daemon's state for Daemon._check_placement: sampling GPUs 0 and 1 of `sim`, the server's pids
    4242 and 4243, its ledger `led`."""
    from types import SimpleNamespace

    return SimpleNamespace(_server_procs=lambda: ({4242, 4243}, None),
                           collector=SimpleNamespace(nvml=sim, infos=sim.gpus[:2]),
                           gpu_uuids={i: sim.gpus[i].uuid for i in (0, 1)}, _unsampled=(), ledger=led,
                           _idle_said=False, _helper_said=False)


def _checked_twice(count, procs, asserted=None):
    """The placement check run twice on a stand-in daemon sampling GPUs 0 and 1 of `count` simulated GPUs, the
    server's `procs` ((gpu, pid, bytes) each) on them, daemon.serving_gpus `asserted`: (sim, its ledger, the daemon)."""
    import numpy as np

    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from support import RowSink as Sink

    sim = SimNVML("seed-16g", count=count, state_path=None)
    sim.nvmlInit()
    for gpu, pid, size in procs:
        sim.add_process(gpu, pid, size, lambda: 1.0)
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    if asserted is not None:
        d._serving_asserted = np.array(asserted)
    Daemon._check_placement(d)
    Daemon._check_placement(d)
    return sim, led, d


def test_the_daemon_tells_its_ledger_the_sampled_gpus_the_servers_processes_hold(monkeypatch):
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from support import LedgerReading as R, RowSink as Sink

    # Sampling GPUs 0 and 1, the server's engine on GPU 1, a helper context on GPU 0: GPU 1 alone serves, from the
    # first interval on, no judgement from power awaited (before: every GPU's energy the work's until then, each row
    # flagged). A GPU whose process list NVML cannot give tells nothing.
    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    Daemon._check_placement(d)
    for x in range(3):
        led.add_gpu_sample(x * 10**9, x * 10**9, [R(60.0 * x, 60.0), R(300.0 * x, 300.0)])
        led.advance(x * 10**9)
    assert led.learner.serving.tolist() == [False, True] and led.totals.serving_mask == (False, True)
    from powerprof.collectors import nvml as nvml_mod

    real = nvml_mod.gpu_processes
    monkeypatch.setattr(nvml_mod, "gpu_processes", lambda nv, h: None if h.index == 0 else real(nv, h))
    d.ledger, d._helpers_seen = Ledger("d", 0, 2, Sink(), grace_s=0.1), {}
    Daemon._check_placement(d)
    assert d.ledger._told_serving[0] is None  # withdrawn: nothing told


@pytest.mark.parametrize("sizes", [(800 << 20, 0), (700 << 20, 700 << 20)])
def test_a_model_under_a_helpers_bound_is_told_where_it_runs(sizes):
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from support import RowSink as Sink

    # A small model (800 MiB: a 1B Q4 llama-server) on GPU 0, GPU 1 empty; or a 700 + 700 MiB TP=2. find_placement
    # counts each serving (the largest context, or its equal, needs no samples). Before, every GPU told serving had to
    # hold 1 GiB of the server's: nothing told, the rows flagged until the power judged (for good under an even load).
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    for g, b in enumerate(sizes):
        if b:
            sim.add_process(g, 4242 + g, b, lambda: 1.0)
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    Daemon._check_placement(d)
    assert led._told_serving[0].tolist() == [b > 0 for b in sizes] and not led._told_serving[2]


def test_a_small_models_bare_context_on_another_gpu_is_told_provisional_and_the_rows_stay_flagged(caplog):
    import logging

    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from powerprof.storage.schema import UNSURE_FLAG
    from support import RowSink as Sink

    # An 800 MiB model on GPU 0 (a 1B Q4 llama-server) and a bare 300 MiB CUDA context of its on GPU 1, idle:
    # find_placement counts GPU 1 serving by its share (>= a tenth of the largest) without its samples. Before, told
    # [T, T] not provisional: the rows unflagged with GPU 1's idle draw in. Now provisional: the rows flagged until the
    # GPUs' power judges the same, the log says why once.
    caplog.set_level(logging.INFO)
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(0, 4242, 800 << 20, lambda: 1.0)
    sim.add_process(1, 4243, 300 << 20, lambda: 0.0)
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    Daemon._check_placement(d)
    Daemon._check_placement(d)
    assert led._told_serving[0].tolist() == [True, True] and led._told_serving[2]
    assert sum("its samples not looked at" in r.getMessage() for r in caplog.records) == 1
    _one_request_beside(led, 60.0)
    assert led.learner.serving is None
    row = sink.rows["requests"][0]
    assert UNSURE_FLAG in (row["energy_note"] or ""), row


def test_a_server_on_no_sampled_gpu_withdraws_the_telling_and_the_log_says_why_once(caplog):
    import logging

    # Sampling GPUs 0 and 1 of three, the server's 14 GiB on GPU 2 alone: nothing told. Before, the log said nothing of
    # it (docs/daemon.md said it did); only the unsampled GPU's warning stood.
    caplog.set_level(logging.INFO)
    _, led, _ = _checked_twice(3, [(2, 4242, 14 << 30)])
    assert led._told_serving[0] is None
    said = [r.getMessage() for r in caplog.records if "not told from the server's processes alone" in r.getMessage()]
    assert len(said) == 1 and "on no sampled GPU" in said[0], said


def test_unread_samples_on_a_gpu_not_sampled_leave_the_sampled_ones_told(monkeypatch):
    import pynvml
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from support import RowSink as Sink

    # Sampling GPUs 0 and 1 of three: the server's 14 GiB on GPU 0, a 300 MiB context of its on GPU 2 (not sampled)
    # whose per-process samples NVML cannot give. Before, any unread sample withdrew the telling: told nothing; now
    # the sampled GPUs' evidence is whole: told [T, F] (GPU 2 counted serving, the unsampled flag says so).
    sim = SimNVML("seed-16g", count=3, state_path=None)
    sim.nvmlInit()
    sim.add_process(0, 4242, 14 << 30, lambda: 1.0)
    sim.add_process(2, 4243, 300 << 20, lambda: 0.0)

    def no(*_a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(sim, "nvmlDeviceGetProcessUtilization", no)
    monkeypatch.setattr(sim, "nvmlDeviceGetProcessesUtilizationInfo", no)
    led = Ledger("d", 0, 2, Sink(), grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    Daemon._check_placement(d)
    assert led._told_serving[0].tolist() == [True, False]
    assert d._unsampled == (2,)


@pytest.mark.parametrize("scene", ["missed-worker", "samples-unread"])
def test_a_serving_mask_the_check_cannot_back_is_not_told_and_the_rows_stay_flagged(scene, monkeypatch):
    import pynvml
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.metrics import GpuSnapshot, Snapshot, make_registry, render
    from powerprof.daemon.service import Daemon
    from powerprof.storage.schema import UNSURE_FLAG
    from support import RowSink as Sink

    # Both GPUs draw with the work, a wrong told mask in either direction. missed-worker: the server's engine (4242)
    # on GPU 0 and a tensor-parallel worker the daemon does not find as the server's (a Ray worker, no descendant:
    # 9999) on GPU 1: told [T, F], the rows' GPU 1 energy dropped (-33% in a review's scene). samples-unread: a 300 MiB
    # idle context of the server's on GPU 1 whose per-process samples NVML cannot give: told [T, T] (GPU 1 serving
    # none: +20%). Now nothing is told: which serve stays undecided, the request's row flagged, and /metrics has no
    # powerprof_gpu_serving meanwhile.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(0, 4242, 14 << 30, lambda: 1.0)
    if scene == "missed-worker":
        sim.add_process(1, 9999, 14 << 30, lambda: 1.0)
    else:
        sim.add_process(1, 4243, 300 << 20, lambda: 0.0)

    def no(*_a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    if scene == "samples-unread":
        monkeypatch.setattr(sim, "nvmlDeviceGetProcessUtilization", no)
        monkeypatch.setattr(sim, "nvmlDeviceGetProcessesUtilizationInfo", no)
    sink = Sink()
    led = Ledger("d", 0, 2, sink, grace_s=0.1)
    d = _two_gpu_stand_in(sim, led)
    Daemon._check_placement(d)
    _one_request_beside(led, 250.0)
    assert led.learner.serving is None and led.totals.serving_undecided
    row = sink.rows["requests"][0]
    assert UNSURE_FLAG in (row["energy_note"] or "") and "serve the proxied work" in row["energy_note"], row
    from powerprof.daemon.service import gpu_serving  # what _update_snapshot gives each GPU's gauge

    gpus = tuple(GpuSnapshot(k, f"GPU-{k}", "seed-16g", None, None, None, None, 0.0, serving=gpu_serving(led.totals, k))
                 for k in range(2))
    text = render(make_registry(SimpleNamespace(snapshot=Snapshot(gpus=gpus)))).decode()
    assert not [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "powerprof_gpu_serving"]


def test_an_asserted_mask_the_servers_processes_contradict_is_told_provisional_and_warned_once(caplog):
    import logging

    from powerprof.daemon.service import Daemon

    # daemon.serving_gpus = [0, 1]; the check's evidence whole, the server's engine on GPU 0 alone: the two disagree,
    # so the assertion is told provisional (the rows flagged until the power judges the same), warned once, naming the
    # key. A worker of the server's then seen on GPU 1: agreed, told as asserted.
    caplog.set_level(logging.INFO)
    sim, led, d = _checked_twice(2, [(0, 4242, 14 << 30)], asserted=[True, True])
    assert led._told_serving[0].tolist() == [True, True] and led._told_serving[1] == "daemon.serving_gpus"
    assert led._told_serving[2]
    warned = [r.getMessage() for r in caplog.records if "daemon.serving_gpus asserts" in r.getMessage()]
    assert len(warned) == 1 and "fix: correct daemon.serving_gpus" in warned[0], warned
    sim.add_process(1, 4243, 14 << 30, lambda: 1.0)
    Daemon._check_placement(d)
    assert led._told_serving[0].tolist() == [True, True] and not led._told_serving[2]


def test_the_kept_judgement_is_read_back_only_for_its_gpus_and_upstream_and_never_from_anothers_file(tmp_path):
    from powerprof.daemon import servingstate

    # Kept in the data dir as opentags.py keeps its windows; read back for the same GPUs (in order) and upstream only.
    # Not acted on: a symlink, another user's file or one others may write (root reads it), a file not of its form.
    uuids, up = ["GPU-a", "GPU-b"], "http://127.0.0.1:8000"
    assert servingstate.load(tmp_path, uuids, up) is None
    servingstate.save(tmp_path, uuids, up, [True, False])
    mask, saved_s = servingstate.load(tmp_path, uuids, up)
    assert mask == [True, False] and saved_s > 0
    assert servingstate.load(tmp_path, uuids[::-1], up) is None and servingstate.load(tmp_path, uuids, "http://x") is None
    p = servingstate.path_in(tmp_path)
    if os.geteuid() == 0:  # another user's file, root reading
        os.chown(p, 65534, 65534)
        assert servingstate.load(tmp_path, uuids, up) is None
        os.chown(p, 0, 0)
    else:  # this user's, read as another (not root)
        assert servingstate.load(tmp_path, uuids, up, euid=os.geteuid() + 1) is None
    os.chmod(p, 0o666)
    assert servingstate.load(tmp_path, uuids, up) is None
    os.chmod(p, 0o600)
    os.rename(p, tmp_path / "real.json")
    os.symlink(tmp_path / "real.json", p)
    assert servingstate.load(tmp_path, uuids, up) is None
    p.unlink()
    p.write_text('{"uuids": ["GPU-a", "GPU-b"], "upstream": "http://127.0.0.1:8000", "serving": [1, 0], "saved_s": 1}')
    assert servingstate.load(tmp_path, uuids, up) is None


@pytest.mark.parametrize("content", [b"[1, 2]", b"42", b'"x"', b"null", b"[" * 30000 + b"]" * 30000,
                                     *(('{"uuids": ["GPU-a", "GPU-b"], "upstream": "http://127.0.0.1:8000", "serving": '
                                        '[true, false], "saved_s": %s}' % x).encode()
                                       for x in ("NaN", "Infinity", "-Infinity", "1e300", "-5", "0"))],
                         ids=["list", "number", "string", "null", "deep", "nan", "inf", "-inf", "1e300", "neg", "zero"])
def test_a_kept_judgement_file_of_another_shape_or_time_is_warned_and_not_used(tmp_path, content, caplog):
    # Valid JSON that is not an object crashed the daemon's start (AttributeError; RecursionError when deep); a saved
    # time not finite or not plausible was taken, then raised where the ledger's close formats it (a review's repro).
    from powerprof.daemon import servingstate

    p = servingstate.path_in(tmp_path)
    p.write_bytes(content)
    os.chmod(p, 0o600)
    caplog.set_level(logging.WARNING, logger="powerprof.daemon.servingstate")
    assert servingstate.load(tmp_path, ["GPU-a", "GPU-b"], "http://127.0.0.1:8000") is None
    assert any("cannot read" in r.getMessage() for r in caplog.records)


def test_the_kept_judgement_is_written_0600_whatever_the_umask_so_the_next_start_reads_it(tmp_path):
    # Under umask 002 (many distributions' users' default) it was 664, and every later start refused the daemon's own
    # file as writable by group.
    from powerprof.daemon import servingstate

    old = os.umask(0o002)
    try:
        servingstate.save(tmp_path, ["GPU-a"], "http://x", [True])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(servingstate.path_in(tmp_path)).st_mode) == 0o600
    assert servingstate.load(tmp_path, ["GPU-a"], "http://x")[0] == [True]


def test_the_judged_mask_is_kept_off_the_callers_thread_latest_wins_and_written_at_close(tmp_path, monkeypatch):
    # The save (a write, two fsyncs: 22.5 ms measured) ran inside the ledger's close on the event loop, blocking the
    # proxy at each new mask, unbounded however often it flipped (a review's flip.py: 4 saves in 900 s). Now handed to
    # one thread holding one waiting mask: put never waits on the disk; masks superseded while a write runs are not
    # written; close writes the last one.
    import threading

    from powerprof.daemon import servingstate

    gate, written = threading.Event(), []
    real = servingstate.save

    def slow(data_dir, uuids, upstream, serving):
        gate.wait(10)
        written.append(list(serving))
        real(data_dir, uuids, upstream, serving)

    monkeypatch.setattr(servingstate, "save", slow)
    keeper = servingstate.Keeper(tmp_path, ["GPU-a", "GPU-b"], "http://x")
    t0 = time.monotonic()
    for mask in ([True, False], [True, True], [False, True], [True, False], [False, True]):
        keeper.put(mask)
    assert time.monotonic() - t0 < 1.0 and written == []  # the first write is held at the gate: nothing blocked
    gate.set()
    keeper.close()
    assert written[-1] == [False, True] and len(written) <= 2, written
    assert servingstate.load(tmp_path, ["GPU-a", "GPU-b"], "http://x")[0] == [False, True]
    keeper.put([True, True])  # after close: not written, nothing started
    assert servingstate.load(tmp_path, ["GPU-a", "GPU-b"], "http://x")[0] == [False, True]


def test_a_save_that_raises_other_than_oserror_is_logged_once_and_the_keeper_goes_on(tmp_path, monkeypatch, caplog):
    # Keeper._run caught nothing save did not: a RuntimeError killed its thread, every later mask never kept, no file,
    # only threading's traceback on stderr (a review's keeper.py: 1 save tried of 2). Now logged (WARNING, once per
    # kind of error) and the next mask written.
    import logging

    from powerprof.daemon import servingstate

    real, tried = servingstate.save, []

    def flaky(data_dir, uuids, upstream, serving):
        tried.append(list(serving))
        if len(tried) <= 2:
            raise RuntimeError("boom")
        real(data_dir, uuids, upstream, serving)

    monkeypatch.setattr(servingstate, "save", flaky)
    caplog.set_level(logging.WARNING, logger="powerprof.daemon.servingstate")
    keeper = servingstate.Keeper(tmp_path, ["GPU-a", "GPU-b"], "http://x")
    for mask in ([True, False], [True, True], [False, True]):
        keeper.put(mask)
        deadline = time.monotonic() + 5
        while len(tried) < [[True, False], [True, True], [False, True]].index(mask) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    keeper.close()
    assert tried == [[True, False], [True, True], [False, True]], tried
    assert servingstate.load(tmp_path, ["GPU-a", "GPU-b"], "http://x")[0] == [False, True]
    said = [r for r in caplog.records if "cannot keep which GPUs serve" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and said[0].exc_info, said


def test_the_last_judged_mask_is_kept_at_stop_even_where_the_ledgers_close_all_raises(tmp_path, monkeypatch):
    # The keeper was closed after ledger.close_all on the stop path: close_all raising skipped it, the last mask lost.
    import asyncio

    from powerprof.daemon import servingstate
    from powerprof.daemon.config import load_config
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML

    closed = []
    monkeypatch.setattr(servingstate.Keeper, "close", lambda self, timeout_s=5.0: closed.append(True))

    def boom(self, *a, **k):
        raise RuntimeError("close_all failed")

    monkeypatch.setattr(Ledger, "close_all", boom)
    sim = SimNVML("a100-40g", count=2, state_path=None)
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "proxy.listen": "", "metrics.listen": "",
        "daemon.restore_on_start": False, "daemon.interval_s": 0.25, "tags.socket": str(tmp_path / "pp.sock")})
    daemon = Daemon(cfg, Rig("a100-40g", nvml=sim))

    async def go():
        task = asyncio.create_task(daemon.run())
        deadline = asyncio.get_running_loop().time() + 20
        while daemon._serving_keeper is None and not task.done():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        daemon._request_stop()
        with pytest.raises(RuntimeError, match="close_all failed"):
            await task

    asyncio.run(go())
    assert closed == [True]


def test_a_telling_that_crosses_a_close_taking_the_last_one_is_kept_for_the_next_close():
    import threading

    from powerprof.daemon.ledger import Ledger
    from support import LedgerReading as R, RowSink as Sink

    # The placement check tells from its own thread; the ledger's close takes the telling waiting. A second telling
    # landing between the close's read of the first and its reset of the slot was lost (the close reset the slot after
    # it): the stale first mask stood. Here the second telling is made from another thread at the very read (the
    # slot's getter), as the check's thread would; the close may hold it back (a lock) but must not drop it.
    crossing: list = []

    class Crossed(Ledger):
        @property
        def _told_serving(self):
            told = self.__dict__.get("_slot")
            if told is not None and not crossing:
                crossing.append(threading.Thread(
                    target=self.tell_serving, args=([False, True], "the check's next telling")))
                crossing[0].start()
                crossing[0].join(0.5)  # done at once where nothing holds it back: the race the lock closes
            return told

        @_told_serving.setter
        def _told_serving(self, told):
            self.__dict__["_slot"] = told

    led = Crossed("d", 0, 2, Sink(), grace_s=0.1)
    led.tell_serving([True, True], "the check's first telling")
    for x in range(3):
        led.add_gpu_sample(x * 10**9, x * 10**9, [R(300.0 * x, 300.0), R(300.0 * x, 300.0)])
        led.advance(x * 10**9)
    assert crossing, "the close read no telling"
    crossing[0].join(5)
    for x in range(3, 6):
        led.add_gpu_sample(x * 10**9, x * 10**9, [R(300.0 * x, 300.0), R(300.0 * x, 300.0)])
        led.advance(x * 10**9)
    # Before the lock: [True, True] (the second telling lost, the first standing); now the second's, at the next close.
    assert led.learner.serving is not None and led.learner.serving.tolist() == [False, True]


def _ledger_trace(rid: int, at_s: float):
    from powerprof.daemon.proxy import RequestTrace

    return RequestTrace(rid, "POST", "/completion", "t", int(at_s * 1e9), 0, api="llamacpp", stream=True)


def _ledger_end(led, tr, end_s: float) -> None:
    from powerprof.daemon.streams import Counts

    for k in range(20):
        led.on_tokens(tr, int((0.3 + 0.2 * k) * 1e9), 1)
    tr.first_ns, tr.last_ns, tr.end_ns = int(0.3 * 1e9), int(4.1 * 1e9), int(end_s * 1e9)
    tr.counts = Counts(generated_tokens=20, prompt_tokens=5, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)


def _one_request_beside(led, gpu1_w: float) -> None:
    """One request 0.2-4.5 s on a 2-GPU ledger, GPU 0 at 300 W and GPU 1 at `gpu1_w` for 5 one-second samples, closed."""
    from support import LedgerReading as R

    tr = _ledger_trace(1, 0.2)
    led.on_start(tr)
    for x in range(5):
        led.add_gpu_sample(x * 10**9, x * 10**9, [R(300.0 * x, 300.0), R(gpu1_w * x, gpu1_w)])
        led.advance(x * 10**9)
    _ledger_end(led, tr, 4.5)
    led.close_all(6 * 10**9)


def test_simulate_with_gpus_puts_the_simulated_server_on_the_selected_gpus(tmp_path):
    from powerprof.cli import main

    # A mixed simulated host: one kind at a time is the advice (docs/control.md), and --gpus 1 then refused "the
    # server also runs on GPU 0 … add it: --gpus 0,1", whose advice led back to the first refusal; no CLI path put the
    # simulated server on a subset. Now it runs on the selected GPUs, as a server launched with --gpus does.
    r = CliRunner().invoke(main, ["sweep", "--simulate", "h200-141g,l4-24g", "--gpus", "1", "--limits", "72,60",
                                  "--max-time", "2", "--min-requests", "2", "--max-requests", "2", "--warmup", "0",
                                  "--idle-s", "0.5", "--max-tokens", "16", "--out", str(tmp_path / "x")],
                           env={"POWERPROF_SIM_SERVER_GPUS": None})
    assert r.exit_code == 0, r.output
    assert "server also runs" not in r.output
    # measure, shown GPU 1 of two by CUDA_VISIBLE_DEVICES, and the daemon sampling GPU 1: the server is there alone.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--requests", "2", "--max-tokens", "16",
                                  "--out", str(tmp_path / "m")],
                           env={"CUDA_VISIBLE_DEVICES": "1", "POWERPROF_SIM_SERVER_GPUS": None})
    assert r.exit_code == 0, r.output
    with Rig("seed-16g", gpus=[1], sim_gpu_count=2, nvml=SimNVML("seed-16g", count=2, state_path=None)) as rig:
        rig.sources
        srv = rig.default_upstream()
        assert srv and [g.index for g in rig._sim_servers[0].gpus] == [1]


def test_a_launched_server_given_a_mig_instance_is_shown_that_instance_not_its_parent_gpu(monkeypatch):
    from powerprof.sim.mig import MigNVML

    # --gpus MIG-…: CUDA_VISIBLE_DEVICES was the parent GPU's UUID, so the server got whichever instance CUDA listed
    # first while the note said it "sees only the measured GPU(s)".
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nv = MigNVML(SimNVML("a100-40g", count=2, state_path=None), {1: 3})
    nv.nvmlInit()
    second = nv.mig_uuids(1)[1]
    with Rig("a100-40g", nvml=nv, gpus=[second[:16]]) as rig:  # a prefix, as nvidia-smi -L's may be typed
        assert rig.sources.nvml.indexes == [1]
        env = rig._launch_env()
        assert env["CUDA_VISIBLE_DEVICES"] == second, env["CUDA_VISIBLE_DEVICES"]
        assert any("MIG instances as named" in n and second in n for n in rig.notes), rig.notes
    # A whole GPU beside it is still named by its own UUID.
    with Rig("a100-40g", nvml=nv, gpus=[0, second]) as rig:
        rig.sources
        assert rig._launch_env()["CUDA_VISIBLE_DEVICES"] == f"{nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(0))},{second}"


def test_a_host_process_bearing_a_server_pid_number_is_not_taken_for_the_server():
    import psutil

    from powerprof.workload.placement import find_placement

    # A container's own pid namespace: NVML lists the host's pids, and a host process (Xorg) bears the number of the
    # server's pid here. It read "the server also runs on GPU 0" and refused the sweep.
    me = os.getpid()
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(0, me, 4 << 30, lambda: 1.0, name="/usr/lib/xorg/Xorg")
    assert find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({me}, None)) is None  # nothing of the server's: unknown
    # The server's own process, named as this namespace names it, is still found; so is one NVML names not at all.
    sim.add_process(1, me + 1, 4 << 30, lambda: 1.0)
    exe = psutil.Process(me).exe()
    sim.remove_process(0, me)
    sim.add_process(0, me, 4 << 30, lambda: 1.0, name=exe)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({me, me + 1}, None))
    assert list(p.unmeasured) == [0] and 1 in p.server


def test_a_small_context_that_works_is_serving_not_a_helper():
    from powerprof.workload.placement import GpuPlacementError, find_placement, judge_placement

    # 14 GiB on GPU 1 and a 700 MiB reranker on GPU 0 running real inference (behind the same port): by memory alone
    # it read "a helper context" and was never refused, its full-power draw in no figure.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 14 << 30, lambda: 1.0)
    sim.add_process(0, 4243, 700 << 20, lambda: 0.9)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    assert list(p.unmeasured) == [0] and not p.helpers
    with pytest.raises(GpuPlacementError):
        judge_placement(p, [])


def test_a_small_context_whose_work_nvml_cannot_say_is_serving(monkeypatch):
    import pynvml

    from powerprof.workload.placement import find_placement

    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)

    def no(*_a):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(sim, "nvmlDeviceGetProcessUtilization", no)
    monkeypatch.setattr(sim, "nvmlDeviceGetProcessesUtilizationInfo", no)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    assert list(p.unmeasured) == [0] and not p.helpers


def _sample_reads_answer(monkeypatch, answers) -> None:
    """NVML's per-process sample reads answer from `answers` in turn (None: the read fails, as pynvml's does when
    samples arrive between its two calls; a dict: those samples), then as they are."""
    from powerprof.collectors import nvml as nvml_mod

    real = nvml_mod.process_util
    left = list(answers)

    def util(nvml, h, since):
        if left:
            a = left.pop(0)
            return (None, "nvmlDeviceGetProcessUtilization: INSUFFICIENT_SIZE") if a is None else (a, "test")
        return real(nvml, h, since)

    monkeypatch.setattr(nvml_mod, "process_util", util)


def _look_under_load_with_util(monkeypatch, answers):
    """The first look (samples read: GPU 0's 300 MiB context idle, a helper) and a LookUnderLoad over the same
    simulated host whose per-process sample reads answer from `answers` in turn (None: the read fails as pynvml's does
    when samples arrive between its two calls), then as they are."""
    from powerprof.workload import placement

    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)
    procs = lambda: ({4242, 4243}, None)  # noqa: E731
    first = placement.find_placement(sim, {1: sim.gpus[1].uuid}, procs)
    assert 0 in first.helpers
    _sample_reads_answer(monkeypatch, answers)
    return placement.LookUnderLoad(sim, {1: sim.gpus[1].uuid}, procs, first, allow=False, stopped="stopped")


def test_one_failed_sample_read_under_load_is_retried_not_taken_for_the_servers_work(monkeypatch):
    # One INSUFFICIENT_SIZE (samples arriving between pynvml's two calls, likelier under load) counted GPU 0 serving
    # and stopped the run, saying "NVML's samples now show the server's work there".
    look = _look_under_load_with_util(monkeypatch, [None])
    assert look() == []


def test_sample_reads_failing_under_load_refuse_in_words_that_say_so(monkeypatch):
    from powerprof.workload.placement import UTIL_TRIES, GpuPlacementError

    look = _look_under_load_with_util(monkeypatch, [None] * UTIL_TRIES)
    with pytest.raises(GpuPlacementError) as e:
        look()
    said = str(e.value)
    assert "NVML's per-process samples could not be read now" in said and "INSUFFICIENT_SIZE" in said, said
    assert "show the server's work" not in said, said


def test_the_look_under_load_reads_the_samples_since_the_load_began(monkeypatch):
    from powerprof.workload import placement

    # Work early in a long first batch (or a trace's first replay), idle over its last HELPER_LOOK_S: read over the
    # last HELPER_LOOK_S only, it went unseen. Here the samples show work only to a read reaching back to the load's
    # start, and the look window is shortened so that its last HELPER_LOOK_S do not.
    began_us = time.time_ns() // 1000 - 5_000_000  # the load began 5 s ago
    look = _look_under_load_with_util(monkeypatch, [])
    from powerprof.collectors import nvml as nvml_mod

    real = nvml_mod.process_util

    def util(nvml, h, since):
        if h is not None and since <= began_us:
            return {4243: {"sm": 60.0}}, "test"
        return real(nvml, h, since)

    monkeypatch.setattr(nvml_mod, "process_util", util)
    monkeypatch.setattr(placement, "HELPER_LOOK_S", 1.0)
    with pytest.raises(placement.GpuPlacementError) as e:
        look(began_us * 1000)
    assert "NVML's samples now show the server's work there" in str(e.value)


def test_the_helper_note_says_its_draw_is_not_measured():
    from powerprof.workload.placement import find_placement

    sim = _two_gpu_server(1, 14 << 30, 0, 300 << 20)
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    text = p.helper_text()
    assert "its draw, not measured, is in no figure" in text and "small draw" not in text
    assert "no work" in text


def test_the_daemon_says_once_why_the_unsampled_flag_stands_after_checks_that_tell_nothing(caplog):
    import logging

    from powerprof.daemon.service import UNKNOWN_CHECKS_SAY, Daemon

    # The upstream flagged on GPU 0 (unsampled), then never found again (it moved to another host): every later row
    # kept server-gpu-unsampled and analyze dropped them all, with no log line saying why.
    caplog.set_level(logging.INFO)
    sim, answer, d = _daemon_sampling_gpu1_of_a_server_on_two()
    Daemon._check_placement(d)
    flagged = d.ledger.unsampled_note
    answer[0] = (None, "nothing listens on port 8000")
    for _ in range(UNKNOWN_CHECKS_SAY - 1):
        Daemon._check_placement(d)
    assert d.ledger.unsampled_note == flagged
    assert not any("cannot be told" in r.getMessage() for r in caplog.records)
    for _ in range(3):
        Daemon._check_placement(d)
    said = [r.getMessage() for r in caplog.records if "cannot be told" in r.getMessage()]
    assert len(said) == 1 and "nothing listens on port 8000" in said[0] and "restart the daemon" in said[0], said
    note = d.ledger.unsampled_note
    assert note.startswith("server-gpu-unsampled: ") and "cannot be told since" in note and "GPU 0" in note, note
    answer[0] = ({4242}, None)  # found again, still on GPU 0: the plain flag again
    Daemon._check_placement(d)
    assert d.ledger.unsampled_note == flagged


@pytest.mark.parametrize("value", ["5", "-1", "0,2"])
def test_sim_server_gpus_out_of_range_is_a_clear_error_not_a_traceback(tmp_path, value):
    from powerprof.cli import main

    # =5 on one GPU raised IndexError in sim/server.py with a traceback; =-1 ran the server on GPU 1 silently.
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--requests", "2", "--max-tokens", "16",
                                  "--out", str(tmp_path / "m")], env={"POWERPROF_SIM_SERVER_GPUS": value})
    assert r.exit_code != 0 and not isinstance(r.exception, IndexError), (r.output, r.exception)
    assert f"POWERPROF_SIM_SERVER_GPUS={value!r}" in r.output and "0 to 1" in r.output, r.output
    assert "Traceback" not in r.output


def test_the_grid_placement_stop_is_a_run_stop_with_the_back_line_not_a_usage_error(tmp_path):
    from powerprof.cli import main

    # The grid found the server on GPU 0 partway through: the stop read under click's "Usage: … Try --help" banner,
    # with no word that the GPU's limit was back, and run.json's notes known only at the end never written.
    r = CliRunner().invoke(main, ["sweep", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--limits", "300,220",
                                  "--context-tokens", "64,128", "--max-time", "4", "--max-tokens", "16",
                                  "--out", str(tmp_path / "g")], env={"POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 2, r.output
    assert "Usage:" not in r.output and "--help" not in r.output, r.output
    assert "the server also runs on GPU 0 (GPU-" in r.output and "--gpus 0,1" in r.output, r.output
    assert "no GPU setting was changed" in r.output or "back at its original limit" in r.output, r.output
    sim = SimNVML("seed-16g", count=2)
    assert [g.limit_w for g in sim.gpus] == [g.profile.default_limit_w for g in sim.gpus]
    assert not _restore_files()
    meta = json.loads((tmp_path / "g" / "run.json").read_text())
    assert any("the server also runs on GPU 0" in n for n in meta["notes"]), meta["notes"]


def test_same_process_claims_no_match_from_an_empty_name_or_a_short_prefix(monkeypatch):
    import psutil

    from powerprof.collectors import nvml as nvml_mod
    from powerprof.workload import placement

    class P:
        def __init__(self, pid):
            pass

        def name(self):
            return "python3"

        def exe(self):
            return "/usr/bin/python3"

        def cmdline(self):
            return ["python3", "-m", "vllm"]

    monkeypatch.setattr(psutil, "Process", P)
    # NVML's `python` (another namespace's process) against this one's `python3`: a prefix, not the same name.
    monkeypatch.setattr(nvml_mod, "process_name", lambda _n, _pid: "/usr/bin/python")
    assert placement._same_process(None, 4242) is False
    monkeypatch.setattr(nvml_mod, "process_name", lambda _n, _pid: "/usr/bin/python3 -m vllm")
    assert placement._same_process(None, 4242) is True
    # The kernel's 15-character cut: a prefix of 15 characters still matches.
    monkeypatch.setattr(nvml_mod, "process_name", lambda _n, _pid: "/opt/VLLM::EngineCore")
    P.name = lambda self: "VLLM::EngineCor"
    P.exe = lambda self: "/x/VLLM::EngineCor"
    P.cmdline = lambda self: ["VLLM::EngineCor"]
    assert placement._same_process(None, 4242) is True
    # A name of spaces only is "cannot tell" (counted as the server's, as an unreadable one), not a match by prefix.
    monkeypatch.setattr(nvml_mod, "process_name", lambda _n, _pid: "   ")
    assert placement._same_process(None, 4242) is True


def _small_model_busy_under_load(monkeypatch, sim, index: int):
    """A small model of the simulated server's (its pid, 300 MiB) on GPU `index`, idle until the load begins and
    working while it runs: its NVML samples show work while the server has been busy within HELPER_LOOK_S (NVML's
    buffer of per-process samples, read since a timestamp). Before the load it is an idle small context: a helper's.
    Returns the server's busy moments (cleared: idle again)."""
    from powerprof.rig import Rig as RigClass
    from powerprof.workload.placement import HELPER_LOOK_S

    last_busy: list[float] = []
    real = RigClass._set_busy

    def set_busy(self, busy):
        last_busy.append(time.monotonic())
        real(self, busy)

    monkeypatch.setattr(RigClass, "_set_busy", set_busy)
    sim.add_process(index, os.getpid(), 300 << 20,
                    lambda: 1.0 if last_busy and time.monotonic() - last_busy[-1] < HELPER_LOOK_S else 0.0)
    return last_busy  # cleared: idle for HELPER_LOOK_S again


def test_a_small_model_idle_before_the_sweep_and_busy_under_its_load_stops_it_with_the_limit_put_back(tmp_path,
                                                                                                     monkeypatch):
    from powerprof import sweep as sweep_mod
    from powerprof.sweep import PlacementStop, run_sweep
    from powerprof.workload import placement

    # The engine on GPU 1 (measured), a 300 MiB draft/embedding model of the same server on GPU 0, idle during the one
    # look before the load: taken for a helper, GPU 0 left unmeasured while the load worked it, and the sweep ran to
    # the end with J/token missing GPU 0's energy, said nowhere.
    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    _small_model_busy_under_load(monkeypatch, sim, 0)
    at_look: list = []
    real_find = placement.find_placement

    def spy(nvml, measured, procs, **kw):
        at_look.append(sim.gpus[1].limit_w)
        return real_find(nvml, measured, procs, **kw)

    monkeypatch.setattr(placement, "find_placement", spy)
    monkeypatch.setattr(sweep_mod, "find_placement", spy)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        with pytest.raises(PlacementStop) as e:
            run_sweep(rig, levels_spec="200,250", out_dir=tmp_path / "s", params=RequestParams(max_tokens=16),
                      prompts=PROMPTS, idle_s=0, interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=1)
    said = str(e.value)
    # The first check's words, GPU 0 named with the fix, and why it is found only now.
    assert f"the server also runs on GPU 0 ({sim.gpus[0].uuid}), which is not measured" in said, said
    assert "add it: --gpus 0,1" in said and "--allow-unmeasured-server-gpus" in said, said
    assert "found once the load ran on GPU 0" in said and "taken for a helper's" in said, said
    assert e.value.exit_code == 2
    # Looked at once before the load (limit untouched) and once under it, at the first level's (capped).
    assert at_look[0] == 300.0 and len(at_look) == 2 and at_look[1] in (200.0, 250.0), at_look
    # The limit it had set is back, and no restore is pending.
    assert [g.limit_w for g in SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json").gpus] == [300.0, 300.0]
    assert not _restore_files()
    meta = json.loads((tmp_path / "s" / "run.json").read_text())
    assert not meta.get("levels_done") and any("found once the load ran" in n for n in meta["notes"]), meta
    import pyarrow.parquet as pq

    windows = pq.read_table(tmp_path / "s" / "windows.parquet").to_pylist() if (tmp_path / "s" / "windows.parquet").exists() else []
    assert not [w for w in windows if w["status"] == "ok" and not w["warmup"]], windows


def test_an_allowed_sweep_drops_the_helper_note_the_look_under_load_contradicts(tmp_path, monkeypatch):
    from powerprof.sweep import run_sweep

    # With --allow-unmeasured-server-gpus, run.json kept the first look's "a helper context … no work there" for GPU 0
    # beside the look under load's "measured anyway … the server also runs on GPU 0".
    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    _small_model_busy_under_load(monkeypatch, sim, 0)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        run_sweep(rig, levels_spec="250", out_dir=tmp_path / "s", params=RequestParams(max_tokens=16),
                  prompts=PROMPTS, idle_s=0, interval_s=0.2, min_requests=2, max_requests=2, warmup_requests=1,
                  allow_unmeasured_server_gpus=True)
    notes = json.loads((tmp_path / "s" / "run.json").read_text())["notes"]
    assert any("measured anyway" in n and "found once the load ran on GPU 0" in n for n in notes), notes
    assert not any("helper context of 300 MiB on GPU 0" in n for n in notes), notes


def test_an_allowed_grid_drops_the_helper_note_the_look_under_load_contradicts(tmp_path, monkeypatch):
    from powerprof.cli import main

    _small_model_on_gpu0_under_load(monkeypatch)
    r = CliRunner().invoke(main, ["sweep", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--limits", "250",
                                  "--context-tokens", "64", "--max-time", "3", "--max-tokens", "16", "--idle-s", "0.5",
                                  "--allow-unmeasured-server-gpus", "--out", str(tmp_path / "g")],
                           env={"POWERPROF_SIM_SERVER_GPUS": "1"})
    assert r.exit_code == 0, r.output
    notes = json.loads((tmp_path / "g" / "run.json").read_text())["notes"]
    assert any("measured anyway" in n and "found once the load ran on GPU 0" in n for n in notes), notes
    assert not any("helper context of 300 MiB on GPU 0" in n for n in notes), notes


def test_a_small_model_idle_before_measure_and_busy_under_its_load_is_refused_or_said_when_allowed(tmp_path,
                                                                                                   monkeypatch):
    from powerprof.workload.measure import run_measure
    from powerprof.workload.placement import GpuPlacementError

    # As for the sweep: the one look before the load took GPU 0's idle 300 MiB model for a helper, and measure
    # reported GPU 1's J/token alone while the load worked both.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    busy = _small_model_busy_under_load(monkeypatch, sim, 0)
    kw = dict(url=None, prompts=PROMPTS, n_requests=2, concurrencies=[1], params=RequestParams(max_tokens=16),
              warmup=1, interval_s=0.2)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        with pytest.raises(GpuPlacementError) as e:
            run_measure(rig, out_dir=tmp_path / "m", **kw)
    said = str(e.value)
    assert f"the server also runs on GPU 0 ({sim.gpus[0].uuid}), which is not measured" in said, said
    assert "add it: --gpus 0,1" in said and "found once the load ran on GPU 0" in said, said
    assert "measure stopped, nothing kept" in said and "--allow-unmeasured-server-gpus" in said, said
    assert not (tmp_path / "m").exists()
    # Allowed: measured, and the notes say what was found once the load ran.
    busy.clear()
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        res = run_measure(rig, out_dir=tmp_path / "a", allow_unmeasured_server_gpus=True, **kw)
    notes = json.loads((res.out_path / "run.json").read_text())["notes"]
    assert any(n.startswith("measured anyway (--allow-unmeasured-server-gpus): the server also runs on GPU 0")
               and "found once the load ran on GPU 0" in n for n in notes), notes
    # The first look's note calling GPU 0 a helper's, with no work there, is replaced: not said beside the stop's.
    assert not any("helper context of 300 MiB on GPU 0" in n for n in notes), notes


def test_a_stop_during_measures_look_under_load_keeps_no_unchecked_batch(tmp_path, monkeypatch):
    from powerprof.workload import placement
    from powerprof.workload.measure import run_measure

    # With no warm-up the first measured batch is finished (and counted as kept) before the look under load runs on
    # it: a Ctrl-C during that look kept the batch, never checked, its notes calling GPU 0 a helper.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    _small_model_busy_under_load(monkeypatch, sim, 0)

    def interrupted(self, *_a):
        raise KeyboardInterrupt()

    monkeypatch.setattr(placement.LookUnderLoad, "__call__", interrupted)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        with pytest.raises(KeyboardInterrupt):
            run_measure(rig, url=None, out_dir=tmp_path / "m", prompts=PROMPTS, n_requests=4, concurrencies=[1],
                        params=RequestParams(max_tokens=16), warmup=0, interval_s=0.2)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("grid", [False, True])
def test_a_small_model_working_only_under_load_stops_the_sweep_or_grid_exit_2_with_the_limit_put_back(tmp_path,
                                                                                                      monkeypatch, grid):
    from powerprof.cli import main

    # The server (each configuration's, in a grid) is looked at as it answers, idle: its 300 MiB model on GPU 0 read as
    # a helper's, and the sweep measured GPU 1 alone while the load worked GPU 0 too.
    real_init = SimNVML.nvmlInit

    def init(self, *a, **k):
        real_init(self, *a, **k)
        if len(self.gpus) == 2 and not getattr(self, "_small_added", False):
            self._small_added = True
            _small_model_busy_under_load(monkeypatch, self, 0)

    monkeypatch.setattr(SimNVML, "nvmlInit", init)
    r = CliRunner().invoke(main, ["sweep", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--limits", "220,250",
                                  *(["--context-tokens", "64,128"] if grid else []), "--max-time", "4",
                                  "--max-tokens", "16", "--idle-s", "0.5", "--out", str(tmp_path / "g")],
                           env={"POWERPROF_SIM_SERVER_GPUS": "1"})
    assert r.exit_code == 2, r.output
    assert ("configuration " in r.output) == grid and "the server also runs on GPU 0 (GPU-" in r.output, r.output
    assert "Usage:" not in r.output, r.output  # a stop partway through, said as one
    assert "found once the load ran on GPU 0" in r.output and "--gpus 0,1" in r.output, r.output
    assert "back at its original limit" in r.output, r.output
    sim = SimNVML("seed-16g", count=2)
    assert [g.limit_w for g in sim.gpus] == [g.profile.default_limit_w for g in sim.gpus]
    assert not _restore_files()
    meta = json.loads((tmp_path / "g" / "run.json").read_text())
    assert any("found once the load ran" in n for n in meta["notes"]), meta["notes"]
    # Stopped at the first (configuration's) first batch: no level of a wrongly scoped measurement kept (before, a plain
    # sweep ran to its end; a grid's first configuration ran whole and was kept, the second one's check refusing then).
    assert not meta.get("levels_done"), meta.get("levels_done")


def _small_model_on_gpu0_under_load(monkeypatch):
    """Every 2-GPU SimNVML opened gets a small model of the server's on GPU 0, idle until the load (as above)."""
    real_init = SimNVML.nvmlInit

    def init(self, *a, **k):
        real_init(self, *a, **k)
        if len(self.gpus) == 2 and not getattr(self, "_small_added", False):
            self._small_added = True
            _small_model_busy_under_load(monkeypatch, self, 0)

    monkeypatch.setattr(SimNVML, "nvmlInit", init)


def test_measures_stop_under_load_is_a_plain_stop_in_measures_words(tmp_path, monkeypatch):
    from powerprof.cli import main

    # measure's look under load stopped under click's "Usage: … Try --help" banner (sweep's had been removed as wrong
    # for a stop partway), and said GPU 0's "limit not stepped" of a command that steps nothing.
    _small_model_on_gpu0_under_load(monkeypatch)
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--requests", "2",
                                  "--max-tokens", "16", "--out", str(tmp_path / "m")],
                           env={"POWERPROF_SIM_SERVER_GPUS": "1"})
    assert r.exit_code == 2, r.output
    assert "found once the load ran on GPU 0" in r.output and "measure stopped, nothing kept" in r.output, r.output
    assert "Usage:" not in r.output and "Try " not in r.output, r.output
    assert "not stepped" not in r.output and "would be in no figure (J/token low)" in r.output, r.output
    assert not (tmp_path / "m").exists()


def test_a_clock_sweeps_refusal_says_its_clock_not_its_limit(tmp_path):
    from powerprof.cli import main

    r = CliRunner().invoke(main, ["sweep", "--simulate", "seed-16g,seed-16g", "--gpus", "1", "--clocks", "900,1200",
                                  "--out", str(tmp_path / "c")], env={"POWERPROF_SIM_SERVER_GPUS": "0,1"})
    assert r.exit_code == 2, r.output
    assert "its clock not stepped" in r.output and "limit not stepped" not in r.output, r.output


def test_the_daemon_flags_rows_within_seconds_of_the_server_reaching_an_unsampled_gpu():
    import asyncio

    from support import LedgerReading as R, RowSink as Sink

    # The daemon samples GPU 1, where the upstream (pid 4242) runs; then the server reaches GPU 0 (a worker, a second
    # model). The check ran every 30 s: rows closed for up to 30 s after were unflagged, GPU 0's energy in none.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    sink = Sink()
    d = _stand_in_daemon(sim, lambda: ({4242}, None), sink)
    assert d.ledger.unsampled_note is None
    S, e = 1_000_000_000, 0.0

    def run_ledger(t0: int, t1: int) -> None:
        nonlocal e
        for t in range(t0, t1):
            d.ledger.add_gpu_sample(t * S, t * S, [R(e, 200.0)])
            e += 200.0
        d.ledger.advance(int((t1 - 0.5) * S))

    run_ledger(0, 4)
    before = list(sink.rows["intervals"])
    assert before and not any("server-gpu-unsampled" in (r.get("energy_note") or "") for r in before)

    # The server reaches GPU 0, not sampled.
    took = asyncio.run(_seconds_to_flag(d, lambda: sim.add_process(0, 4242, 8 << 30, lambda: 1.0)))
    # Noticed within a few list-reading periods, not at the next 30 s check: the bound is loose (a loaded CI host's
    # two cores delay the executor's hops by seconds) yet half the 30 s it was before.
    assert d.ledger.unsampled_note is not None and took <= NOTICED_S, took
    assert d.ledger.unsampled_note.startswith("server-gpu-unsampled: the server also runs on GPU 0")
    run_ledger(4, 8)
    after = sink.rows["intervals"][len(before):]
    assert after and all("server-gpu-unsampled" in (r.get("energy_note") or "") for r in after), after


# The daemon's tests of noticing the server on a new GPU: noticed within NOTICED_S (a few PLACEMENT_LIST_S periods with
# a loaded host's slack), waited for up to WAIT_S; the 30 s check alone (PLACEMENT_CHECK_S) misses both.
NOTICED_S = 15.0
WAIT_S = 20.0


def _stand_in_daemon(sim, server_procs, sink=None):
    """The daemon's own placement methods on a stand-in's state: sampling GPU 1 of `sim`, the server's pids from
    `server_procs()`, its ledger writing to `sink`; checked once, as at its start."""
    from types import SimpleNamespace

    from powerprof.daemon import service
    from powerprof.daemon.ledger import Ledger
    from powerprof.daemon.ticks import Waker
    from support import RowSink as Sink

    class D(SimpleNamespace):
        def __getattr__(self, name):
            return getattr(service.Daemon, name).__get__(self)

    d = D(_server_procs=server_procs, collector=SimpleNamespace(nvml=sim, infos=[sim.gpus[1]]),
          gpu_uuids={1: sim.gpus[1].uuid},
          _unsampled=(), ledger=Ledger("d", 0, 1, Sink() if sink is None else sink, grace_s=0.1), _idle_said=False,
          _helper_said=False, config_waker=Waker())
    service.Daemon._check_placement(d)
    return d


async def _seconds_to_flag(d, change) -> float:
    """The daemon's placement loop run past its first pass (2 list reads, nothing flagged), then `change()`: how long
    until its rows are flagged (WAIT_S at most)."""
    import asyncio

    from powerprof.daemon import service

    d.stop_event = asyncio.Event()
    loop_task = asyncio.create_task(service.Daemon._placement_loop(d))
    await asyncio.sleep(2 * service.PLACEMENT_LIST_S + 0.5)
    assert d.ledger.unsampled_note is None
    t0 = time.monotonic()
    change()
    while d.ledger.unsampled_note is None and time.monotonic() - t0 < WAIT_S:
        await asyncio.sleep(0.05)
    took = time.monotonic() - t0
    d.stop_event.set()
    d.config_waker.wake()
    await asyncio.wait_for(loop_task, 5)
    return took


def test_daemon_flags_a_worker_that_starts_as_a_small_context_and_grows(tmp_path):
    import asyncio

    # A new CUDA worker of the server's on GPU 0 (not sampled) first holds only its context (400 MiB, no kernels):
    # judged a helper. Then it loads its weights (8 GiB) and works, its pid unmoved. Keyed on pids alone, the daemon
    # saw no list change and its rows stayed unflagged until the 30 s check (29.3 s late).
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    d = _stand_in_daemon(sim, lambda: ({4242, 4343}, None))
    work = [0.0]
    sim.add_process(0, 4343, 400 << 20, lambda: work[0])  # the context only: a helper's look

    def grow():
        sim._procs[0][4343].used_bytes = 8 << 30  # weights loaded, serving
        work[0] = 1.0

    took = asyncio.run(_seconds_to_flag(d, grow))
    assert d.ledger.unsampled_note is not None and took <= NOTICED_S, took
    assert d.ledger.unsampled_note.startswith("server-gpu-unsampled: the server also runs on GPU 0")


def test_daemon_flags_a_small_context_that_begins_working(tmp_path):
    import asyncio

    # A small model of the server's (400 MiB) on GPU 0, not sampled, idle at the daemon's start (a helper's look),
    # then worked by a request: no pid moves and no size crosses the bound; the check is kept due at every list read
    # while a context on an unsampled GPU is judged a helper.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    work = [0.0]
    sim.add_process(0, 4242, 400 << 20, lambda: work[0])
    d = _stand_in_daemon(sim, lambda: ({4242}, None))
    assert d.ledger.unsampled_note is None and d._helper_said
    took = asyncio.run(_seconds_to_flag(d, lambda: work.__setitem__(0, 1.0)))
    assert d.ledger.unsampled_note is not None and took <= NOTICED_S, took


def test_a_trace_sweep_looks_again_after_its_first_replay(tmp_path, monkeypatch):
    from powerprof.sweep import PlacementStop, run_sweep
    from powerprof.workload.trace import synthetic

    # sweep --trace replays a whole trace per level: its look under load follows the first replay, before its rows.
    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    _small_model_busy_under_load(monkeypatch, sim, 0)
    trace = synthetic(4, 2.0, prompt_median=20, output_median=16, output_range=(12, 20), seed=4)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig, rig.sim_server() as srv:
        with pytest.raises(PlacementStop) as e:
            run_sweep(rig, levels_spec="200,250", url=srv.url, trace=trace, trace_meta={}, out_dir=tmp_path / "t",
                      idle_s=0, interval_s=0.2)
    assert "found once the load ran on GPU 0" in str(e.value) and "--gpus 0,1" in str(e.value), str(e.value)
    assert [g.limit_w for g in SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json").gpus] == [300.0, 300.0]
    assert not _restore_files()
    assert not json.loads((tmp_path / "t" / "run.json").read_text()).get("levels_done")


def _daemon_with_a_helper_on_unsampled_gpu0(monkeypatch, answers):
    """A daemon sampling GPU 1 of a server (pid 4242) with an idle 400 MiB context on GPU 0, judged a helper by its
    first check; then the per-process sample reads answer from `answers` in turn (None: the read fails, as pynvml's
    does when samples arrive between its two calls), then as they are."""
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    sim.add_process(0, 4242, 400 << 20, lambda: 0.0)
    procs = [({4242}, None)]
    d = _stand_in_daemon(sim, lambda: procs[0])
    assert d.ledger.unsampled_note is None and d._helper_unsampled
    _sample_reads_answer(monkeypatch, answers)
    return d, procs


def test_a_failed_sample_read_in_the_daemons_check_does_not_flag_a_helpers_gpu(monkeypatch, caplog):
    import logging

    from powerprof.daemon import service
    from powerprof.workload.placement import UTIL_TRIES

    caplog.set_level(logging.INFO)
    # One INSUFFICIENT_SIZE at a 2-s check (kept due while the helper stands) counted GPU 0 serving: rows flagged and
    # dropped by analyze for ~30 s, "add it to daemon.gpus ... restart" logged, and the 2-s checks stopped.
    d, _ = _daemon_with_a_helper_on_unsampled_gpu0(monkeypatch, [None])
    service.Daemon._check_placement(d)
    assert d.ledger.unsampled_note is None and d._helper_unsampled
    # Every read of a check failing: unknown, the helper's state kept (not serving), the check kept due...
    d, _ = _daemon_with_a_helper_on_unsampled_gpu0(monkeypatch, [None] * UTIL_TRIES)
    service.Daemon._check_placement(d)
    assert d.ledger.unsampled_note is None and d._helper_unsampled
    assert not any("add it to daemon.gpus" in r.getMessage() for r in caplog.records)
    # ...but not for ever: reads failing at UNREAD_HELPER_CHECKS checks in a row, nothing shows it idle any more.
    d, _ = _daemon_with_a_helper_on_unsampled_gpu0(monkeypatch, [None] * UTIL_TRIES * service.UNREAD_HELPER_CHECKS)
    for _ in range(service.UNREAD_HELPER_CHECKS - 1):
        service.Daemon._check_placement(d)
        assert d.ledger.unsampled_note is None
    service.Daemon._check_placement(d)
    assert d.ledger.unsampled_note is not None and "could not be read" in d.ledger.unsampled_note, d.ledger.unsampled_note


def test_the_daemons_checks_that_tell_nothing_do_not_keep_the_helpers_2s_checks_for_ever(monkeypatch):
    from powerprof.daemon import service

    # The server away (no listener: find_placement None) while a helper stood: the check stayed due at every 2-s list
    # read for as long as it was away, a full check each time.
    d, procs = _daemon_with_a_helper_on_unsampled_gpu0(monkeypatch, [])
    procs[0] = (None, "nothing listens on port 8000")
    for _ in range(service.HELPER_UNKNOWN_CHECKS - 1):
        service.Daemon._check_placement(d)
        assert d._helper_unsampled  # a moment's failure keeps the quick re-checks
    service.Daemon._check_placement(d)
    assert not d._helper_unsampled
    procs[0] = ({4242}, None)  # back (its lists changed, so checked): the helper's quick re-checks again
    service.Daemon._check_placement(d)
    assert d._helper_unsampled and d.ledger.unsampled_note is None


def test_measures_stop_line_says_which_of_its_reasons_kept_nothing(tmp_path, monkeypatch):
    from powerprof.cli import main
    from powerprof.workload import placement

    # A Ctrl-C during the look under load, the first (unwarmed) batch finished: the line said "no measured request had
    # finished, or the look ... had not answered", though requests had finished and it was the look.
    def interrupted(self, *_a, **_k):
        raise KeyboardInterrupt()

    monkeypatch.setattr(placement.LookUnderLoad, "__call__", interrupted)
    out = tmp_path / "m"
    r = CliRunner().invoke(main, ["measure", "--simulate", "seed-16g", "--requests", "2", "--concurrency", "1",
                                  "--warmup", "0", "--max-tokens", "16", "--out", str(out)])
    assert r.exit_code == 130, r.output
    assert (f"nothing was written to {out} (the look at the server's GPUs after the first batch had not answered: the "
            "finished batch was never checked, so none of it is kept)") in r.output, r.output
    assert "no measured request had finished" not in r.output, r.output
    assert not out.exists()


def test_a_small_model_the_first_batch_does_not_reach_stops_the_sweep_at_the_level_that_works_it(tmp_path,
                                                                                              monkeypatch):
    from powerprof.sweep import PlacementStop, run_sweep
    from powerprof.workload.placement import HELPER_LOOK_S

    # A small model of the server's on GPU 0 (unmeasured) idle through the look before the load and through the first
    # level, worked once the sweep reaches 200 W (a router's replica the first level's batches did not reach). The
    # sweep looked again once, after the first batch: GPU 0 stayed a "helper" for the whole run and the 200 W level
    # was kept without its energy, said nowhere.
    from powerprof.rig import Rig as RigClass

    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    last_busy: list[float] = []
    real = RigClass._set_busy

    def set_busy(self, busy):
        last_busy.append(time.monotonic())
        real(self, busy)

    monkeypatch.setattr(RigClass, "_set_busy", set_busy)
    sim.add_process(0, os.getpid(), 300 << 20,
                    lambda: 1.0 if sim.gpus[1].limit_w == 200.0 and last_busy
                    and time.monotonic() - last_busy[-1] < HELPER_LOOK_S else 0.0)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        with pytest.raises(PlacementStop) as e:
            run_sweep(rig, levels_spec="250,200", out_dir=tmp_path / "s", params=RequestParams(max_tokens=16),
                      prompts=PROMPTS, idle_s=0, interval_s=0.2, min_requests=2, max_requests=4, warmup_requests=1)
    said = str(e.value)
    assert f"the server also runs on GPU 0 ({sim.gpus[0].uuid}), which is not measured" in said, said
    assert "add it: --gpus 0,1" in said and "--allow-unmeasured-server-gpus" in said, said
    assert "found once the load ran on GPU 0" in said, said
    # The level it struck, and the finished one kept.
    assert "the sweep stopped at level 200 W: none of that level kept, the finished level (250 W) kept" in said, said
    assert e.value.exit_code == 2
    assert [g.limit_w for g in SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json").gpus] == [300.0, 300.0]
    assert not _restore_files()
    meta = json.loads((tmp_path / "s" / "run.json").read_text())
    assert [lv[0] for lv in meta.get("levels_done")] == [250.0], meta.get("levels_done")


def test_the_look_under_load_reads_only_the_process_lists_while_nothing_small_stands(monkeypatch):
    from powerprof.workload import placement

    # Every batch is looked at: with the server's processes all on measured GPUs and no helper-sized context, a
    # batch whose process lists are the last look's runs no find_placement (no sample reads, no pid matching).
    sim = _two_gpu_server(0, 8 << 30, 1, 8 << 30)
    procs = lambda: ({4242, 4243}, None)  # noqa: E731
    monkeypatch.setattr(placement, "_same_process", lambda _n, _pid: True)
    first = placement.find_placement(sim, {0: sim.gpus[0].uuid, 1: sim.gpus[1].uuid}, procs)
    look = placement.LookUnderLoad(sim, {0: sim.gpus[0].uuid, 1: sim.gpus[1].uuid}, procs, first, allow=False,
                                   stopped="stopped")
    for _ in range(5):
        assert look() == []
    assert (look.looks, look.full_looks) == (5, 1)
    # A new process on a GPU: judged again at once.
    sim.add_process(1, 4244, 8 << 30, lambda: 1.0)
    assert look() == [] and look.full_looks == 2
    look.rearm()  # a restarted server: its processes found again
    assert look() == [] and look.full_looks == 3


def test_a_server_process_seen_only_as_an_mps_client_is_on_its_gpu(monkeypatch):
    import pynvml

    from powerprof.collectors.nvml import gpu_processes
    from powerprof.workload.placement import find_placement

    # Under NVIDIA MPS the server's processes are MPS clients: NVML lists them by
    # nvmlDeviceGetMPSComputeRunningProcesses only. The compute and graphics lists alone missed the engine's 8 GiB
    # on GPU 0: a sweep of --gpus 1 ran with GPU 0's energy in no figure, said nowhere.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 14 << 30, lambda: 1.0)
    sim.add_process(0, 4243, 8 << 30, lambda: 1.0, mps=True)
    assert gpu_processes(sim, sim.nvmlDeviceGetHandleByIndex(0)) == {4243: 8 << 30}
    p = find_placement(sim, {1: sim.gpus[1].uuid}, lambda: ({4242, 4243}, None))
    assert p.unmeasured == {0: sim.gpus[0].uuid}, p
    assert "the server also runs on GPU 0" in p.unmeasured_text() and "--gpus 0,1" in p.unmeasured_text()

    # Bindings without the call, or a driver or GPU that does not support it: the compute list still answers.
    h1 = sim.nvmlDeviceGetHandleByIndex(1)
    monkeypatch.setattr(sim, "nvmlDeviceGetMPSComputeRunningProcesses", None, raising=False)
    assert gpu_processes(sim, h1) == {4242: 14 << 30}

    def unsupported(_h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(sim, "nvmlDeviceGetMPSComputeRunningProcesses", unsupported)
    assert gpu_processes(sim, h1) == {4242: 14 << 30}


def _placement_loop_for(monkeypatch, d, seconds: float, changes: dict | None = None,
                        wall_base: float | None = None) -> list[tuple[float, bool]]:
    """The daemon's placement loop over `seconds` of a simulated clock (each list read PLACEMENT_LIST_S on, no real
    wait), `changes` ({t: change()}) made as the clock passes t: (t, flagged) at each full check. wall_base: the wall
    clock (time.time_ns, everywhere) follows the simulated one from that epoch second, for samples judged by time."""
    import asyncio

    from powerprof.daemon import service

    clock = [0.0]
    changes = dict(changes or {})

    class FakeTime:
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def monotonic():
            return clock[0]

    async def fake_sleep(period_s, _waker):
        clock[0] += period_s
        for t in [t for t in changes if t <= clock[0]]:
            changes.pop(t)()
        if clock[0] > seconds:
            d.stop_event.set()
        await asyncio.sleep(0)

    monkeypatch.setattr(service, "time", FakeTime())
    monkeypatch.setattr(service, "sleep_on_grid", fake_sleep)
    if wall_base is not None:
        monkeypatch.setattr(time, "time_ns", lambda: int((wall_base + clock[0]) * 1e9))
    checks: list[tuple[float, bool]] = []

    def check():
        service.Daemon._check_placement(d)
        checks.append((clock[0], d.ledger.unsampled_note is not None))

    d._check_placement = check
    d.stop_event = asyncio.Event()
    asyncio.run(service.Daemon._placement_loop(d))
    return checks


def test_the_daemons_checks_back_off_while_a_helper_stands_unchanged(monkeypatch):
    # An idle 400 MiB context of the server's on GPU 0 (not sampled), there for the daemon's life: the full check
    # (host process tree, every GPU's list, the samples) ran at every 2 s list read: 30 a minute, for ever.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    sim.add_process(0, 4242, 400 << 20, lambda: 0.0)
    d = _stand_in_daemon(sim, lambda: ({4242}, None))
    assert d._helper_unsampled and d.ledger.unsampled_note is None
    checks = _placement_loop_for(monkeypatch, d, 60.0)
    assert len(checks) <= 6, checks  # 2, 4, 8, 16, 32 s: doubling to the 30 s check
    assert not any(flagged for _t, flagged in checks)


@pytest.mark.parametrize("change", ["grows", "works"])
def test_a_backed_off_helper_that_grows_or_works_is_flagged_at_the_next_list_read(monkeypatch, change):
    # Backed off (40 s in: the next full check 30 s away), the helper context loads weights (8 GiB) or begins working
    # (a small model a request reached): flagged at the next 2 s list read, not at the backed-off check.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    work = [0.0]
    sim.add_process(0, 4242, 400 << 20, lambda: work[0])
    d = _stand_in_daemon(sim, lambda: ({4242}, None))

    def grow():
        if change == "grows":
            sim._procs[0][4242].used_bytes = 8 << 30
        work[0] = 1.0

    checks = _placement_loop_for(monkeypatch, d, 60.0, {40.0: grow})
    flagged = [t for t, f in checks if f]
    assert flagged and flagged[0] <= 40.0 + 2.0, checks


def _quick_reads_fail(monkeypatch, d) -> None:
    """NVML's per-process samples unreadable (INSUFFICIENT_SIZE: samples arrived between pynvml's sizing call and its
    read) at every light look (`_helper_moved`) of the stand-in daemon `d`, readable at its full checks."""
    from powerprof.collectors import nvml as cn

    real, quick = cn.process_util, [False]

    def process_util(nvml, h, since_us):
        if quick[0]:
            return None, "nvmlDeviceGetProcessUtilization: NVML_ERROR_INSUFFICIENT_SIZE"
        return real(nvml, h, since_us)

    monkeypatch.setattr(cn, "process_util", process_util)
    light = d._helper_moved  # the daemon's own, bound to the stand-in

    def helper_moved():
        quick[0] = True
        try:
            return light()
        finally:
            quick[0] = False

    d._helper_moved = helper_moved


def test_a_light_look_that_cannot_read_the_samples_runs_the_full_check(monkeypatch):
    # Backed off, the 400 MiB helper on unsampled GPU 0 begins working at 40 s while every light look's sample read
    # fails: that look said "not moved", and the rows were flagged only at the 62 s backed-off check, 40-62 s
    # unflagged though missing GPU 0's energy. A failed light read now runs the full check at that list read.
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    work = [0.0]
    sim.add_process(0, 4242, 400 << 20, lambda: work[0])
    d = _stand_in_daemon(sim, lambda: ({4242}, None))
    _quick_reads_fail(monkeypatch, d)
    checks = _placement_loop_for(monkeypatch, d, 90.0, {40.0: lambda: work.__setitem__(0, 1.0)})
    flagged = [t for t, f in checks if f]
    assert flagged and flagged[0] <= 40.0 + 2.0, checks


def test_a_backed_off_full_check_reads_the_samples_since_the_last_check(monkeypatch):
    # Backed off to 30 s, the full check read the last 20 s of samples only: a helper's work from 33 to 40 s, between
    # the checks at 32 and 62 s, fell in neither window, and with the light looks blind to it (their reads failing)
    # the rows were never flagged. The full check now reads from the last check's start.
    from powerprof.collectors import nvml as cn

    base = 1.8e9  # the wall clock's epoch second at the simulated clock's 0
    burst = (base + 33.0, base + 40.0)

    def process_util(nvml, h, since_us):
        now = time.time_ns() / 1e9
        if h == nvml.nvmlDeviceGetHandleByIndex(0) and since_us / 1e6 < burst[1] and now > burst[0]:
            return {4242: {"sm": 90.0}}, "simulated"
        return {}, "simulated"

    monkeypatch.setattr(cn, "process_util", process_util)
    sim = SimNVML("seed-16g", count=2, state_path=None)
    sim.nvmlInit()
    sim.add_process(1, 4242, 8 << 30, lambda: 1.0)
    sim.add_process(0, 4242, 400 << 20, lambda: 0.0)
    d = _stand_in_daemon(sim, lambda: ({4242}, None))
    d._helper_moved = lambda: False  # the light looks see nothing: only the full checks' windows are judged here
    checks = _placement_loop_for(monkeypatch, d, 120.0, wall_base=base)
    flagged = [t for t, f in checks if f]
    assert flagged and flagged[0] <= 62.0 + 2.0, checks


def test_the_look_under_loads_cheap_path_is_taken_only_for_the_same_server_pids(monkeypatch):
    # The first batch's look found the server's processes partly (serverprocs drops a root's children where psutil
    # raises): only the engine on measured GPU 1, nothing small, so its lists were kept as settled. Every later
    # batch, the lists unchanged, took the lists-only path: the child's 8 GiB on GPU 0, now found, never judged, and
    # the sweep finished with GPU 0's energy in no figure, unsaid.
    from powerprof.workload import placement

    sim = _two_gpu_server(0, 8 << 30, 1, 8 << 30)
    monkeypatch.setattr(placement, "_same_process", lambda _n, _pid: True)
    lists = placement._process_lists(sim)
    on0, on1 = set(lists[0]), set(lists[1])
    answer = [(on1, None)]
    measured = {1: sim.gpus[1].uuid}
    first = placement.find_placement(sim, measured, lambda: answer[0])
    look = placement.LookUnderLoad(sim, measured, lambda: answer[0], first, allow=False, stopped="stopped")
    assert look() == [] and look() == [] and look.full_looks == 1  # the same pids and lists: the cheap path
    answer[0] = (on0 | on1, None)
    with pytest.raises(placement.GpuPlacementStop) as e:
        look()
    assert "GPU 0" in str(e.value)


def test_a_stop_at_a_repeated_levels_later_visit_names_the_visit_and_the_visits_kept(tmp_path, monkeypatch):
    # --repeats 2: the small model on GPU 0 is worked only at 200 W's second visit. The stop said "the sweep stopped
    # at level 200 W: none of that level kept, the finished levels (200, 250 W) kept": 200 W both dropped and kept.
    # The first visit of 200 W is kept (levels_done): the words now name visits by their repeat.
    from powerprof.rig import Rig as RigClass
    from powerprof.sweep import PlacementStop, run_sweep
    from powerprof.workload.placement import HELPER_LOOK_S

    sim = SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json")
    last_busy: list[float] = []
    seq: list[float] = []  # the limits set, in order, each once a run of batches
    real = RigClass._set_busy

    def set_busy(self, busy):
        last_busy.append(time.monotonic())
        if not seq or seq[-1] != sim.gpus[1].limit_w:
            seq.append(sim.gpus[1].limit_w)
        real(self, busy)

    monkeypatch.setattr(RigClass, "_set_busy", set_busy)
    sim.add_process(0, os.getpid(), 300 << 20,
                    lambda: 1.0 if sim.gpus[1].limit_w == 200.0 and seq.count(200.0) >= 2 and last_busy
                    and time.monotonic() - last_busy[-1] < HELPER_LOOK_S else 0.0)
    with Rig("seed-16g", nvml=sim, gpus=[1], sim_server_gpus=[1]) as rig:
        with pytest.raises(PlacementStop) as e:
            run_sweep(rig, levels_spec="250,200", repeats=2, out_dir=tmp_path / "s",
                      params=RequestParams(max_tokens=16), prompts=PROMPTS, idle_s=0, interval_s=0.2,
                      min_requests=2, max_requests=4, warmup_requests=1)
    said = str(e.value)
    assert [g.limit_w for g in SimNVML("seed-16g", count=2, state_path=tmp_path / "sim.json").gpus] == [300.0, 300.0]
    done = json.loads((tmp_path / "s" / "run.json").read_text()).get("levels_done")
    assert [200.0, 0] in done and [200.0, 1] not in done, done
    reps: dict = {}
    for level, repeat in done:
        reps.setdefault(level, []).append(repeat + 1)
    kept = "; ".join(f"{x:g} W (repeat{'s' if len(reps[x]) > 1 else ''} {', '.join(map(str, sorted(reps[x])))})"
                     for x in sorted(reps))
    assert (f"the sweep stopped at level 200 W (repeat 2): none of that visit kept, the finished visits ({kept}) kept"
            in said), (said, done)
