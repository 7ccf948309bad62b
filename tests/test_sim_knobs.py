"""The simulator's server knobs: draft count, slots and context; the server as its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request


from powerprof.sim import knobs
from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile
from powerprof.sim.server import SimServer
from support import free_port


def test_seed_card_draft_3_is_fastest_and_acceptance_falls_with_draft():
    wl = get_profile("seed-16g").workload
    speeds = {d: knobs.relative_speed(wl, d) for d in range(0, 6)}
    assert max(speeds, key=speeds.get) == 3
    rates = [(knobs.expected_tokens_per_step(wl, d) - 1) / d for d in range(1, 6)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert 0.6 < rates[2] < 0.7  # the seed measured 65% at draft 3


def test_seed_memory_formula_rejects_draft_5_at_np_4_and_96k_context():
    p = get_profile("seed-16g")
    plan = knobs.memory_plan(p, 3, 4, 16384)
    assert plan.state_bytes == 4 * 4 * 150 * 1024**2  # the seed's 2394 MiB RS buffer, rounded to 150 MiB
    assert plan.fits
    assert knobs.memory_plan(p, 4, 4, 16384).fits
    assert not knobs.memory_plan(p, 5, 4, 16384).fits
    assert not knobs.memory_plan(p, 3, 8, 16384).fits  # MTP at np 8 did not fit either
    assert knobs.memory_plan(p, 3, 1, 80 * 1024).fits and not knobs.memory_plan(p, 3, 1, 96 * 1024).fits
    assert "out of memory" in knobs.memory_plan(p, 5, 4, 16384).oom_message()


def _decode_rate(srv: SimServer, prompt: str, n: int = 40) -> float:
    body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True}).encode()
    with urllib.request.urlopen(urllib.request.Request(srv.url + "/completion", body), timeout=60) as r:
        t = json.loads(r.read())["timings"]
    return t["predicted_n"] / t["predicted_ms"] * 1000, t


def test_served_draft_count_and_context_change_speed_and_draft_figures():
    nvml = SimNVML("seed-16g", state_path=None)
    rates = {}
    for d in (1, 3):
        with SimServer(nvml, decode_tok_s=400, draft_n_max=d, seed=1) as s:
            rates[d], t = _decode_rate(s, "hello world", 120)
            assert t["draft_n"] % d == 0 and 0 < t["draft_n_accepted"] < t["draft_n"]
    assert rates[3] > rates[1]
    with SimServer(nvml, decode_tok_s=400, draft_n_max=0) as s:
        _, t = _decode_rate(s, "hello")
        assert "draft_n" not in t
    with SimServer(nvml, decode_tok_s=400, prefill_tok_s=1e6, draft_n_max=3, n_ctx=200_000, n_slots=1) as s:
        short, _ = _decode_rate(s, "word " * 10, 60)
        long_, _ = _decode_rate(s, "word " * 60_000, 60)
    assert long_ < short / 1.2  # 60K context: (1 + 60K/160K) slower per step


def test_tokenize_endpoints_count_like_the_prompt_counter():
    nvml = SimNVML("a100-40g", state_path=None)
    for flavour, body, key in (("llamacpp", {"content": "one two, three"}, "tokens"), ("vllm", {"prompt": "one two, three"}, "count")):
        with SimServer(nvml, flavour=flavour, decode_tok_s=400) as s:
            # Sent as JSON, as vLLM's /tokenize requires (its validate_json_request: urllib's form type is a 400).
            req = urllib.request.Request(s.url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                out = json.loads(r.read())
            n = len(out[key]) if key == "tokens" else out[key]
            assert n == (4 if flavour == "llamacpp" else 5)  # vLLM adds BOS by default


def _serve(args, tmp_path, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-m", "powerprof.sim.serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_serve_process_that_does_not_fit_exits_with_oom(tmp_path):
    p = _serve(["--profile", "seed-16g", "--port", str(free_port()), "--draft", "5", "-np", "4"], tmp_path)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "out of memory" in out and "RS buffer size = 3600.00 MiB" in out


def test_serve_process_drives_the_sweeping_process_gpu_and_follows_its_limit(tmp_path):
    follower = SimNVML("seed-16g")  # the conftest points the state file into tmp
    follower.nvmlInit()
    h = follower.nvmlDeviceGetHandleByIndex(0)
    port = free_port()
    p = _serve(["--profile", "seed-16g", "--port", str(port), "--draft", "3", "-np", "1", "--decode-tok-s", "100"], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "sim.serve did not come up"
                time.sleep(0.1)
        idle_w = follower.nvmlDeviceGetPowerUsage(h) / 1000
        body = json.dumps({"prompt": "x", "n_predict": 400, "ignore_eos": True, "stream": True}).encode()
        resp = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/completion", body), timeout=60)
        resp.readline()
        time.sleep(0.5)
        field = follower.nvmlDeviceGetFieldValues(h, [follower.NVML_FI_DEV_POWER_INSTANT])[0]
        busy_w = field.value.uiVal / 1000
        assert busy_w > idle_w + 100  # decode on the seed card draws ~275 W, idle 22 W
        follower.nvmlDeviceSetPowerManagementLimit(h, 200_000)
        time.sleep(0.3)
        field = follower.nvmlDeviceGetFieldValues(h, [follower.NVML_FI_DEV_POWER_INSTANT])[0]
        assert field.value.uiVal / 1000 <= 200.5
        resp.read()
        time.sleep(0.3)
        assert follower.nvmlDeviceGetPowerUsage(h) / 1000 < busy_w  # the server went idle: so did the GPU
    finally:
        follower.nvmlDeviceSetPowerManagementLimit(h, 300_000)
        p.terminate()
        p.wait(30)


def test_vllm_speculative_counters_come_through_the_metrics():
    from powerprof.workload.specdecode import spec_decode_counts

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=400, draft_n_max=3) as s:
        assert spec_decode_counts(s.url) == (0.0, 0.0)
        body = json.dumps({"prompt": "hello there", "max_tokens": 60, "ignore_eos": True}).encode()
        req = urllib.request.Request(s.url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).read()
        drafts, accepted = spec_decode_counts(s.url)
        assert drafts > 0 and drafts % 3 == 0 and 0 < accepted < drafts
    with SimServer(SimNVML("a100-40g", state_path=None), flavour="llamacpp", decode_tok_s=400) as s:
        assert spec_decode_counts(s.url) is None  # no such counters: no figure, not a zero


def test_until_signalled_ticks_until_sigterm_and_puts_the_old_handler_back():
    # sim.serve's main loop: it must end on SIGTERM wherever the signal lands (an Event.set() in the
    # handler once deadlocked it in a CI run) and leave the process's handlers as they were.
    import os
    import signal
    import threading

    from powerprof.sim.server import until_signalled

    before = signal.getsignal(signal.SIGTERM)
    for delay_s in (0.0, 0.003, 0.011, 0.05):
        ticks, timers = [], []

        def tick(delay_s=delay_s):
            ticks.append(1)
            if len(ticks) == 1:  # our handler is in place: the signal comes from another thread, at any point
                timers.append(threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGTERM)))
                timers[0].start()

        t0 = time.monotonic()
        until_signalled(0.002, tick)
        timers[0].join()
        assert time.monotonic() - t0 < delay_s + 1.0
        assert signal.getsignal(signal.SIGTERM) is before
