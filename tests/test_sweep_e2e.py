"""`powerprof sweep` end to end on the simulator: crash safety, signals, bad input, the CLI's plan and
notes (accuracy against ground truth and the seed's figures: test_sweep_accuracy.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.sweep import run_sweep as _run_sweep
from powerprof.workload.client import RequestParams
from support import sim_limit_w, true_batch_figures


def run_sweep(*, sim, **kw):
    """A sweep through the door on the simulated GPU `sim` (a SimNVML the test can inspect)."""
    with Rig(sim.profile.key, nvml=sim) as rig:
        return _run_sweep(rig, **kw)


def _powerprof(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "powerprof.cli", *args], capture_output=True, text=True, env=env, **kw)


def test_bad_levels_change_nothing_and_exit_nonzero(tmp_path):
    for bad in ("100,220", "abc", "220,220", "", "-5", "999W"):
        r = _powerprof("sweep", "--limits", bad, "--simulate", "--out", str(tmp_path / "x"), "--idle-s", "0")
        assert r.returncode != 0, bad
        assert "150" in r.stderr and "320" in r.stderr or "Error" in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    assert sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0)) == 300_000


@pytest.mark.parametrize("extra", [[], ["--dry-run"]])
def test_clock_levels_on_one_supported_clock_are_refused_before_anything_changes(tmp_path, extra):
    # The simulated card's SM clocks are 15 MHz apart (NVML's supported-clock list): a lock at 1505 runs at 1500.
    r = _powerprof("sweep", "--clocks", "1500,1505", "--simulate", "--out", str(tmp_path / "x"), "--idle-s", "0", *extra)
    assert r.returncode == 2, r.stderr
    assert "'1505' (1505 MHz) and '1500' (1500 MHz) both run at 1500 MHz on GPU 0" in r.stderr, r.stderr
    assert "Nothing was changed" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x").exists()
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    assert sim.gpus[0].locked_clocks_mhz is None


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path):
    r = _powerprof("sweep", "--limits", "200,80%", "--simulate", "--dry-run", "--out", str(tmp_path / "x"))
    assert r.returncode == 0, r.stderr
    assert "200" in r.stdout and "240" in r.stdout, r.stdout
    assert not (tmp_path / "x").exists()
    # Neither is the default (300 W): the plan says what every "slower" will then be against, before the run.
    said = " ".join(r.stdout.split())
    assert "The default limit (300 W) is not among them" in said and "against the highest level, 240 W" in said, said
    for near in ("200,300", "200,299"):  # 299 W: within the limits' tolerance of 300, which a sweep refuses beside it
        r = _powerprof("sweep", "--limits", near, "--simulate", "--dry-run", "--out", str(tmp_path / "x"))
        assert r.returncode == 0 and "default limit (300 W) is not" not in " ".join(r.stdout.split()), r.stdout


def test_dry_run_prints_the_launch_command_as_it_will_run(tmp_path):
    # The plan went through rich markup: "[lora.gguf]" was read as a style tag and left out of the command shown.
    r = _powerprof("sweep", "--limits", "300", "--simulate", "--dry-run", "--server", "http://127.0.0.1:9",
                   "--launch", "llama-server -m m.gguf -md {d} --lora-scaled [lora.gguf] 0.5", "--vary", "d=1,2")
    assert r.returncode == 0, r.stderr
    # Shown as a shell would read it (each word quoted where needed: the grid splits the template into words).
    assert "-md 1 --lora-scaled '[lora.gguf]' 0.5" in r.stdout, r.stdout


def _start_sweep_and_wait_for_a_level(out):
    cmd = [sys.executable, "-m", "powerprof.cli", "sweep", "--limits", "180,220,260,300", "--order", "asc",
           "--simulate", "--out", str(out), "--idle-s", "0.5", "--max-tokens", "48", "--min-requests", "4",
           "--max-requests", "4", "--warmup", "0", "--interval", "0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        lv = out / "levels.parquet"
        if lv.exists() and pq.read_table(lv).num_rows >= 1:
            time.sleep(0.3)  # somewhere inside the second level
            return proc
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the sweep never finished a level")


def test_two_ctrl_cs_in_quick_succession_exit_cleanly_with_the_limit_back(tmp_path):
    # Two Ctrl-Cs within ~10 ms: the second struck while the first's handler was putting the GPU back
    # (a restore inside the restore: a hang on the simulator's lock, a traceback on real GPUs), or while
    # the first's exit unwound through the sweep's last write. Which one it hits is down to timing: the
    # controller tests pin both deterministically; this is the whole command's exit, end to end.
    gap_s = 0.003
    out = tmp_path / "run"
    proc = _start_sweep_and_wait_for_a_level(out)
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(gap_s)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "interrupted: every GPU is back at its original limit" in err, err
    assert sim_limit_w() == 300.0
    assert 180.0 in set(pq.read_table(out / "levels.parquet").to_pandas().level_value)


def test_kill_9_mid_sweep_keeps_finished_levels_and_restore_brings_the_limit_back(tmp_path):
    out = tmp_path / "run"
    proc = _start_sweep_and_wait_for_a_level(out)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    levels = pq.read_table(out / "levels.parquet").to_pandas()
    assert 180.0 in set(levels.level_value)
    assert pq.read_table(out / "windows.parquet").num_rows >= 4
    assert sim_limit_w() != 300.0  # killed while capped
    r = _powerprof("restore", "--simulate")
    assert r.returncode == 0, r.stderr
    assert sim_limit_w() == 300.0


# SIGUSR1 too: `kill -USR1` aimed at the tuner must not leave a sweep's GPU capped (its default action kills outright).
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130), (signal.SIGHUP, 128 + signal.SIGHUP),
                                      (signal.SIGUSR1, 128 + signal.SIGUSR1),
                                      # SIGQUIT (Ctrl-backslash on a terminal), SIGUSR2, SIGALRM killed it with the GPU capped, the
                                      # restore file kept and nothing said (exit -3/-12/-14).
                                      (signal.SIGQUIT, 128 + signal.SIGQUIT), (signal.SIGUSR2, 128 + signal.SIGUSR2),
                                      (signal.SIGALRM, 128 + signal.SIGALRM)], ids=lambda v: getattr(v, "name", str(v)))
def test_signals_mid_sweep_restore_the_limit_and_keep_finished_levels(tmp_path, sig, code):
    out = tmp_path / "run"
    proc = _start_sweep_and_wait_for_a_level(out)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err, err
    assert sim_limit_w() == 300.0  # put back by the sweep itself, no `powerprof restore` needed
    assert 180.0 in set(pq.read_table(out / "levels.parquet").to_pandas().level_value)
    # It said nothing of where the levels went (SIGTERM), or "finished levels are in the run directory" (Ctrl-C).
    done = len(json.loads((out / "run.json").read_text())["levels_done"])
    flat = "".join(err.split())  # the console wraps a long path
    assert "".join(f"stopped: {done} finished level{'s' if done > 1 else ''} kept in {out}".split()) in flat, err
    # Ctrl-C said the GPU was back; SIGTERM, SIGHUP and SIGUSR1 said nothing of it.
    assert "every GPU is back at its original limit" in err, err


def test_clock_sweep_where_the_power_cap_never_binds(tmp_path):
    # On an H200-like card decode draws far under any cap; locking the SM clock is the knob that works.
    sim = SimNVML("h200-141g")
    out = tmp_path / "clocks"
    run_sweep(levels_spec="1980,1200", level_kind="sm_clock", sim=sim,
                        out_dir=out, params=RequestParams(max_tokens=64), idle_s=0, interval_s=0.5,
                        min_requests=3, max_requests=3, warmup_requests=0)
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert set(levels.index) == {1980.0, 1200.0}
    assert levels.loc[1200.0, "sm_clock_mhz"] <= 1200.0
    assert levels.loc[1200.0, "avg_gpu_power_w"] < levels.loc[1980.0, "avg_gpu_power_w"]
    assert levels.loc[1200.0, "speed_loss_pct"] > 0
    assert sim.locked_clocks_mhz(0) is None  # released at the end


def test_a_plain_sweeps_levels_carry_its_draft_counts(tmp_path):
    # Speculative decoding (the seed card's MTP): every window had draft_n and draft_n_accepted, the levels' columns
    # were null outside a --vary sweep, read as "not measured" (session 46's spreadsheet walkthrough).
    sim = SimNVML("seed-16g")
    out = tmp_path / "run"
    run_sweep(levels_spec="300,220", sim=sim, out_dir=out, params=RequestParams(max_tokens=48), idle_s=0,
              interval_s=0.5, min_requests=3, max_requests=3, warmup_requests=0)
    assert _powerprof("analyze", str(out)).returncode == 0  # the analysis carries the levels' sweep-only columns
    w = pq.read_table(out / "windows.parquet").to_pylist()
    for name in ("levels", "analysis/analysis"):
        for lv in pq.read_table(out / f"{name}.parquet").to_pylist():
            mine = [r for r in w if r["level_value"] == lv["level_value"] and not r["warmup"] and r["status"] == "ok"]
            assert lv["draft_n"] == sum(r["draft_n"] for r in mine) > 0, (name, lv["draft_n"])
            assert lv["draft_n_accepted"] == sum(r["draft_n_accepted"] for r in mine) > 0
            assert lv["draft_acceptance"] == pytest.approx(lv["draft_n_accepted"] / lv["draft_n"])
            assert lv["draft_source"] == "timings"


def test_concurrent_sweep_uses_wall_clock_batches(tmp_path, sim_server):
    sim = SimNVML("a100-40g")
    out = tmp_path / "conc"
    run_sweep(levels_spec="400,250", sim=sim, out_dir=out,
                        params=RequestParams(max_tokens=48), idle_s=0, interval_s=0.5, concurrency=3,
                        min_requests=2, max_requests=2, warmup_requests=0)
    w = pq.read_table(out / "windows.parquet").to_pandas()
    batches = w[w.window_kind == "batch"].sort_values("batch_id")
    assert len(batches) == 4 and (batches.status == "ok").all()
    # The server's truth per batch, in the order they ran (each batch ends before the next is sent).
    truth = sorted(sim_server[0].truth, key=lambda t: t["t_arrive_ns"])
    assert len(truth) == 12
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    for k, (_, b) in enumerate(batches.iterrows()):
        true_tok_s, true_streams = true_batch_figures(truth[3 * k:3 * k + 3])
        # Whatever the host did to the client, the batch says how many streams really decoded together ...
        assert b.mean_streams == pytest.approx(true_streams, abs=0.15)
        if b.timing != "stream":
            # ... and one the host kept from running as three at once (a stream sent late: it once measured under
            # 1.5x a single stream's rate as "concurrency 3") or left untimed has no figure and says why.
            assert b.timing_reason and b.decode_tok_s != b.decode_tok_s and b.gpu_j_per_token != b.gpu_j_per_token
            continue
        # A trusted batch ran as three streams, and its wall-clock aggregate is what the server delivered over
        # its intervals (never a sum of rates), its energy over exactly those intervals.
        assert b.mean_streams >= 0.95 * 3
        assert b.decode_tok_s == pytest.approx(true_tok_s, rel=0.05)
        assert b.gpu_j_per_token == b.gpu_energy_j / b.decode_tokens
    for value in (400.0, 250.0):
        b = batches[(batches.level_value == value) & (batches.timing == "stream")]
        assert int(levels.loc[value, "concurrency"]) == 3
        if len(b):
            assert levels.loc[value, "decode_tok_s"] == pytest.approx(b.decode_tokens.sum() / b.decode_s.sum(), rel=0.05)
    sim.nvmlInit()
    assert sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0)) == 400_000


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--limits", "200", "--out", "/proc/powerprof-cannot-create"], "cannot create the run directory"),
        (["--limits", "200", "--gpus", "-1"], "--gpus"),
        (["--limits", "200", "--clocks", "900"], "exactly one of --limits or --clocks"),
        # --simulate with --server is a simulated GPU beside a real server: here nothing answers.
        (["--limits", "200", "--server", "http://127.0.0.1:9"], "no server answers at http://127.0.0.1:9"),
        (["--limits", "200", "--server", "127.0.0.1:9", "--launch", "sleep 600"], "not an http:// or https:// URL"),
        # Options of the other kind of sweep were ignored without a word: --duration is no time limit, and a
        # --vary template with --trace was launched with its {NAME} in it.
        (["--limits", "200", "--duration", "5"], "only used with --trace: --duration"),
        (["--limits", "200", "--trace", "{trace}", "--concurrency", "4", "--max-time", "5"],
         "not used with --trace (the trace sets the requests, their lengths and arrivals; each level replays it once "
         "per --repeats): --concurrency, --max-time"),
    ],
)
def test_bad_sweep_arguments_fail_cleanly_without_touching_the_gpu(args, needle, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t_s": 0, "prompt_tokens": 8, "output_tokens": 8}\n')
    r = _powerprof("sweep", "--simulate", "--idle-s", "0", *[a.format(trace=trace) for a in args])
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    assert sim.nvmlDeviceGetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0)) == 300_000


def test_simulated_gpu_beside_a_real_server_is_allowed_and_labelled(tmp_path):
    """`sweep --simulate --server URL`: the hint for a machine without a GPU works, and says the GPU is simulated."""
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=200.0) as srv:  # stands in for a real server
        r = _powerprof("sweep", "--limits", "400,250", "--simulate", "a100-40g", "--server", srv.url, "--idle-s", "0",
                       "--max-tokens", "32", "--min-requests", "2", "--max-requests", "2", "--warmup", "0",
                       "--out", str(tmp_path / "mixed"))
    assert r.returncode == 0, r.stderr
    assert "SIMULATED GPU (a100-40g) beside a real server" in " ".join(r.stdout.split())
    assert (tmp_path / "mixed" / "levels.parquet").exists()
    meta = json.loads((tmp_path / "mixed" / "run.json").read_text())
    assert meta["simulated"] is True and meta["sim_beside_real_server"] is True
    # The report says what is real and what is not, and the findings the blind GPU causes say that, not hardware's
    # fixes ("Lower the limits", "check that --gpus names the server's GPU": session 46's walkthrough).
    report = (tmp_path / "mixed" / "analysis" / "report.md").read_text()
    assert "a simulated GPU beside a real server: token timing is the server's" in report
    said = " ".join(r.stdout.split()) + " ".join(report.split())
    assert "Lower the limits" not in said and "names the server's GPU" not in said, said[-3000:]
    assert "the simulated GPU does not see the real server's work" in said, said[-3000:]
    # The prompt set it sent, by its texts (analyze's pooling check compares it; the windows show only ids and lengths).
    from powerprof.workload.load import builtin_prompts, prompt_set_record

    assert meta["prompt_set"] == prompt_set_record(builtin_prompts("short"))


def test_the_live_ci_is_the_tables_ci(tmp_path):
    # One level's ±CI is one number: the progress line, the stopping rule and levels.parquet compute it
    # from the same windows with the same resamples.
    from powerprof.sweep import UI

    class Recorder(UI):
        done: dict = {}

        def level_done(self, visit, live):
            Recorder.done[visit.level_value] = live["ci_pct"]

    sim = SimNVML("a100-40g")
    out = tmp_path / "ci"
    run_sweep(levels_spec="400,250", sim=sim, out_dir=out, params=RequestParams(max_tokens=24), idle_s=0,
              interval_s=0.5, min_requests=6, max_requests=6, warmup_requests=0, ui=Recorder())
    levels = pq.read_table(out / "levels.parquet").to_pandas().set_index("level_value")
    assert set(Recorder.done) == {400.0, 250.0}
    for value, live_pct in Recorder.done.items():
        assert live_pct == pytest.approx(levels.loc[value, "ci_reached_pct"], rel=1e-9), value


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_measure_stopped_early_keeps_what_finished_or_leaves_nothing(tmp_path, sig, code):
    # Ctrl-C printed click's bare "Aborted!" with exit 1; SIGTERM killed it silently and left the empty --out folder;
    # then it wrote nothing at all. A real signal to the real process: which requests finished by then depends on the
    # machine, so both outcomes are checked for what each must say (tests/test_workload_http.py pins each one).
    out = tmp_path / "m"
    proc = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "measure", "--simulate", "--out", str(out),
                             "--requests", "200", "--max-tokens", "48"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:  # made just before the first request
            time.sleep(0.05)
        assert out.exists(), proc.stderr.read() if proc.poll() is not None else "measure never made --out"
        time.sleep(3.0)
        proc.send_signal(sig)
        stdout, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "Aborted!" not in err, err
    if not out.exists():
        assert f"nothing was written to {out} (no measured request had finished" in err
        return
    meta = json.loads((out / "run.json").read_text())
    (level,) = meta["interrupted"]["concurrencies"]
    assert meta["interrupted"]["exit_code"] == code and level["requests_planned"] == 200
    rows = pq.read_table(out / "windows.parquet").to_pylist()
    assert len([r for r in rows if not r["warmup"]]) == level["requests_kept"] > 0
    assert f"1: {level['requests_kept']} of 200 requests" in err and f"written to {out}" in err
    assert "decode tok/s" in stdout


def test_ctrl_c_during_the_end_analysis_says_the_run_is_complete(tmp_path, monkeypatch):
    # Ctrl-C while the finished sweep imported scipy or fitted its curves printed click's bare "Aborted!"
    # (exit 1), though every level was stored and only the report was missing.
    from click.testing import CliRunner

    import powerprof.analysis.report as report
    from powerprof.cli import main

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(report, "analyze_run", interrupted)
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["sweep", "--limits", "220,300", "--simulate", "--out", str(out), "--idle-s", "0",
                                  "--max-tokens", "32", "--min-requests", "2", "--max-requests", "2", "--warmup", "0"])
    assert r.exit_code == 130, r.output
    assert f"interrupted during the analysis: the run is complete in {out}; make its report with: powerprof analyze " \
           f"{out}" in " ".join(r.stderr.split())
    assert len(json.loads((out / "run.json").read_text())["levels_done"]) == 2


def test_ctrl_c_after_the_last_level_says_where_the_finished_run_is(tmp_path, monkeypatch):
    # Ctrl-C between the last level and the analysis (the GPUs being put back, the last flush) said only
    # "interrupted: ...": not that every level was kept, nor where; caught inside DuckDB it was a traceback.
    from click.testing import CliRunner

    from support import ctrl_c_once_the_gpus_are_back

    from powerprof.cli import main

    ctrl_c_once_the_gpus_are_back(monkeypatch)
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["sweep", "--limits", "220,300", "--simulate", "--out", str(out), "--idle-s", "0",
                                  "--max-tokens", "32", "--min-requests", "2", "--max-requests", "2", "--warmup", "0"])
    assert r.exit_code == 130, r.output
    flat = "".join(r.stderr.split())
    assert "".join(f"stopped: 2 finished levels kept in {out} (powerprof analyze {out})".split()) in flat, r.stderr
    assert "Traceback" not in r.output


def test_a_sweep_whose_reader_has_gone_still_finishes_and_writes_its_report(tmp_path):
    # `sweep ... 2>&1 | true`: the first print after the levels (a note) hit the closed pipe and rich
    # exited 1 there, before the analysis: no report, no word, the status of a failure. A closed pipe
    # now silences the output, not the work: the sweep finishes, writes its report, and exits 141.
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "sweep", "--limits", "180,300", "--simulate",
                          "--out", str(out), "--idle-s", "0.5", "--max-tokens", "48", "--min-requests", "4",
                          "--max-requests", "4", "--warmup", "0", "--interval", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    p.stdout.close()  # the reader is gone before the first line
    try:
        assert p.wait(timeout=180) == 141
    finally:
        if p.poll() is None:
            p.kill()
    assert set(pq.read_table(out / "levels.parquet").to_pandas().level_value) == {180.0, 300.0}
    assert (out / "analysis" / "report.md").exists()
    assert sim_limit_w() == 300.0


def test_a_trace_sweep_whose_reader_has_gone_keeps_sweeping(tmp_path):
    # `sweep --trace ... | head -3`: the closed pipe stopped the sweep after its first level
    # ("Error: [Errno 32] Broken pipe", exit 1), the other levels never measured.
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t_s": {0.05 * i}, "prompt_tokens": 8, "output_tokens": 8}}\n' for i in range(4)))
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "sweep", "--trace", str(trace), "--limits", "180,240,300",
                          "--simulate", "--out", str(out), "--idle-s", "0.5", "--interval", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(4):  # the trace line, the rates' legend, the header, the first level
            assert p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read()
        p.wait(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 141, err
    assert "Traceback" not in err and "Broken pipe" not in err, err
    assert set(pq.read_table(out / "levels.parquet").to_pandas().level_value) == {180.0, 240.0, 300.0}
    assert sim_limit_w() == 300.0
