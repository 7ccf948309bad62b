"""`powerprof tune` on the simulated GPU behind a stand-in daemon: it moves the limit, records why, and every fault ends at
the reference level or the original limit."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prometheus_client import generate_latest

from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML
from powerprof.tuner.observe import (DaemonCounters, ObserveError, energy_moved, fetch_metrics, parse_counters,
                                     serving_change, window_between)
from powerprof.tuner import policy
from powerprof.tuner.policy import TunerConfig
from powerprof.tuner.runner import TuneRunner
from support import sim_limit_w
from powerprof.daemon.metrics import GpuSnapshot, make_registry, render
from tuner_helpers import FakeDaemon, sim_gpu

LEVELS = (150, 200, 250, 300)


def _cfg(**kw):
    base = dict(levels=LEVELS, reference=300, tpot_p95_ms=100.0, tick_s=10, window_s=20, dwell_s=20, min_requests=10,
                guard_s=30, guard_min_requests=5, stale_s=30, max_explore_share=1.0, backoff_s=20)
    base.update(kw)
    return TunerConfig(**base)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _limit_w(nvml) -> float:
    return nvml.gpus[0].limit_w


def _drive(runner, clock, ticks):
    for _ in range(ticks):
        clock.t += runner.cfg.tick_s
        runner.tick()


def _below_reference(runner, clock, nvml):
    _drive(runner, clock, 12)
    assert _limit_w(nvml) < 300, [d.reason for d in runner.tuner.decisions]


def test_the_daemon_exposition_reads_back_as_the_window_it_describes():
    with FakeDaemon(per_scrape=20, tpot_s=0.05) as fd:
        a = parse_counters(fetch_metrics(fd.url), 0.0)
        b = parse_counters(fetch_metrics(fd.url), 10.0)
    w = window_between(a, b, 300.0)
    assert w.requests == 20 and w.tokens == 1600 and w.energy_j == pytest.approx(1600.0)
    assert w.prompt_tokens == 8000 and w.output_tokens == 1600
    assert sum(w.tpot_counts) == 20 and sum(w.ttft_counts) == 20
    with pytest.raises(ObserveError, match="backwards"):
        window_between(b, a, 300.0)
    with pytest.raises(ObserveError, match="lack"):
        parse_counters("# nothing here\n", 0.0)
    with pytest.raises(ObserveError, match="cannot read"):
        fetch_metrics("http://127.0.0.1:1/metrics", timeout_s=1)


def test_the_tuner_does_not_take_an_unread_proxy_for_a_quiet_server():
    with FakeDaemon() as fd:
        text = fetch_metrics(fd.url)
    assert "powerprof_proxy_workers_unread 0.0" in text
    parse_counters(text, 0.0)  # none unread: read as before
    text = text.replace("powerprof_proxy_workers_unread 0.0", "powerprof_proxy_workers_unread 1.0")
    with pytest.raises(ObserveError, match="restart the daemon"):
        parse_counters(text, 0.0)


def test_the_queue_integrals_read_back_as_exact_means_and_are_validated():
    with FakeDaemon(in_flight=6.0, awaiting=2.0) as fd:
        text_a = fetch_metrics(fd.url)
        time.sleep(0.3)
        text_b = fetch_metrics(fd.url)
        fd.awaiting = 100.0  # more awaiting a first token than in flight: not the daemon's figures
        time.sleep(0.1)
        text_bad = fetch_metrics(fd.url)
    a, b = parse_counters(text_a, 0.0), parse_counters(text_b, 0.3)
    w = window_between(a, b, 300.0)
    assert w.queue_clock_s == pytest.approx(0.3, abs=0.2)
    assert w.in_flight_s / w.queue_clock_s == pytest.approx(6.0) and w.awaiting_s / w.queue_clock_s == pytest.approx(2.0)
    with pytest.raises(ObserveError, match="exceeds"):
        parse_counters(text_bad, 1.0)
    for family in ("powerprof_requests_in_flight_seconds", "powerprof_requests_awaiting_first_token_seconds",
                   "powerprof_requests_queue_clock_seconds"):
        cut = "\n".join(x for x in text_b.splitlines() if not x.startswith(family) and family not in x) + "\n"
        with pytest.raises(ObserveError, match="lack"):
            parse_counters(cut, 0.3)
    with pytest.raises(ObserveError, match="backwards"):
        window_between(a, dataclasses.replace(b, in_flight_s=a.in_flight_s - 1), 300.0)
    with pytest.raises(ObserveError, match="not a clock"):
        window_between(a, dataclasses.replace(b, queue_clock_s=a.queue_clock_s + 100), 300.0)
    with pytest.raises(ObserveError, match="awaiting"):
        window_between(a, dataclasses.replace(b, awaiting_s=a.awaiting_s + w.in_flight_s + 1), 300.0)
    with pytest.raises(ObserveError, match="larger than its requests"):
        window_between(a, dataclasses.replace(b, in_flight_s=a.in_flight_s + 10_000), 300.0)


@pytest.mark.parametrize("queue_ratio", [0.0, 3.0])
def test_a_queue_growing_at_the_daemon_moves_the_live_tuner_up_before_any_request_finishes_late(tmp_path, queue_ratio):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml), in_flight=4.0) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(queue_ratio=queue_ratio, queue_s=30), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0),
                            ctl=ctl, gpus=[0], out_dir=tmp_path / "decisions", clock=clock,
                            gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 30)
        before = _limit_w(nvml)
        assert before < 300, [d.reason for d in runner.tuner.decisions]
        fd.in_flight = 20.0  # five times the usual in flight; the requests that finish are as quick as ever
        _drive(runner, clock, 3)
        queue = [d for d in runner.tuner.decisions if "in flight" in d.reason]
        if queue_ratio == 0:
            assert not queue and _limit_w(nvml) <= before
            return
        assert queue and queue[0].from_level == before and queue[0].to_level > before
        assert _limit_w(nvml) > before
    rows = pq.read_table(tmp_path / "decisions").to_pylist()
    assert any("in flight" in r["reason"] and r["applied"] for r in rows)


@pytest.mark.parametrize("fault", ["down", "frozen", "upstream"])
def test_lost_figures_send_the_gpu_back_to_the_reference_level(tmp_path, fault):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            out_dir=tmp_path / "decisions", clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _below_reference(runner, clock, nvml)
        fd.mode = fault
        _drive(runner, clock, 2)
        assert _limit_w(nvml) < 300  # within stale_s nothing is decided on a hiccup
        _drive(runner, clock, 3)
        assert _limit_w(nvml) == 300
        assert runner.tuner.decisions[-1].action == "stale"
        text = generate_latest(runner.metrics.registry).decode()
        assert "powerprof_tuner_stale 1.0" in text and 'powerprof_tuner_level{knob="power"} 300.0' in text
        fd.mode = "ok"
        _drive(runner, clock, 3)
        assert any(d.action == "resume" for d in runner.tuner.decisions)
    rows = pq.read_table(tmp_path / "decisions").to_pylist()
    stale = [r for r in rows if r["action"] == "stale"]
    assert len(stale) == 1 and stale[0]["to_level"] == 300 and stale[0]["applied"] and stale[0]["reason"]
    # Which GPUs by UUID too: index 0 is another GPU once the node renumbers (the rows said "0" alone).
    assert {(r["gpus"], r["gpu_uuids"]) for r in rows} == {("0", nvml.gpus[0].uuid)}
    assert _limit_w(nvml) == 300  # the controller put back the original limit on leaving


def test_the_kill_switch_pins_the_reference_and_the_original_limit_comes_back(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(280)  # the operator's own limit before the tuner
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid], kill_path=tmp_path / "killed")
        runner.start()
        # The start row goes from where the GPU was (the operator's 280 W) to the reference, as the stop row goes back:
        # it said "start 300→300".
        first = runner.tuner.decisions[0]
        assert (first.action, first.from_level, first.to_level) == ("start", 280, 300), first
        _below_reference(runner, clock, nvml)
        runner.on_sigusr1()
        runner.check_kill()
        assert _limit_w(nvml) == 300
        _drive(runner, clock, 20)
        assert _limit_w(nvml) == 300
        runner.stop_row()
    assert _limit_w(nvml) == 280
    assert (tmp_path / "killed").exists()  # persisted: a restart must not silently clear it
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        again = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                           clock=clock, gpu_uuids=[nvml.gpus[0].uuid], kill_path=tmp_path / "killed")
        again.start()
        _drive(again, clock, 12)
        assert _limit_w(nvml) == 300 and again.tuner.state == "killed"
    assert [d.action for d in again.tuner.decisions][:2] == ["start", "kill"]
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        resumed = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                             clock=clock, gpu_uuids=[nvml.gpus[0].uuid], kill_path=tmp_path / "killed", clear_kill=True)
        resumed.start()
        _below_reference(resumed, clock, nvml)  # --resume: tuning again
    assert not (tmp_path / "killed").exists()


def test_a_skipped_stray_lock_check_is_in_the_start_row_not_only_on_stderr(tmp_path):
    # The sweep keeps a skipped check in run.json; the tuner said it on stderr alone, gone with the journal's rotation.
    nvml = SimNVML("seed-16g", state_path=None)
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        ctl.stray_lock_check_skipped = "skipped: budget (/proc/4242/fd)"  # what refuse_stray_locks returns past budget
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=Clock(), gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        runner.stop_row()
    first = runner.tuner.decisions[0]
    assert first.action == "start" and "skipped: budget (/proc/4242/fd)" in first.reason, first
    assert "lock folder" in first.reason


def test_dry_run_judges_only_the_limit_the_gpu_has_and_never_claims_a_level(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(250)  # the operator's limit: what every dry-run window really measures
    clock = Clock()
    with FakeDaemon(gpu=sim_gpu(nvml)) as fd:
        runner = TuneRunner(_cfg(dry_run=True), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=None,
                            gpus=[0], out_dir=tmp_path / "d", clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 12)
        runner.stop_row()
    assert _limit_w(nvml) == 250  # nothing done
    rows = pq.read_table(tmp_path / "d").to_pylist()
    verdicts = [r for r in rows if r["action"] not in ("start", "stop")]
    assert verdicts and not any(r["applied"] for r in rows)
    # No trial is recommended (it would be measured at 250 W and judged as another level): only what the guard
    # would do at 250 W, labelled 250 W.
    assert {r["action"] for r in verdicts} == {"hold"}, verdicts
    assert all(r["from_level"] == 250 and "dry run at the GPUs' 250 W" in r["reason"] for r in verdicts)
    text = generate_latest(runner.metrics.registry).decode()
    assert "powerprof_tuner_level{" not in text and 'powerprof_tuner_observed_level{knob="power"} 250.0' in text


def test_a_window_at_another_limit_than_intended_is_not_judged(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    stuck = sim_gpu(nvml)
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=lambda: (stuck()[0], 300.0)) as fd, \
            rig.controller([0]) as ctl:  # the daemon keeps reading 300 W whatever is set (a limit that did not take)
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 30)
    ds = list(runner.tuner.decisions)
    assert not any(d.action == "accept" for d in ds), [d.reason for d in ds]  # no verdict on a level never measured
    assert any(d.action == "stale" and "not the" in d.reason and "intended" in d.reason for d in ds)


def test_how_far_the_daemons_accounts_are_behind_reads_back_and_an_older_daemon_reads_as_unknown():
    with FakeDaemon() as fd:
        assert parse_counters(fetch_metrics(fd.url), 0.0).accounts_behind_s is None  # a daemon without the gauge
        fd.behind_s = 12.5
        assert parse_counters(fetch_metrics(fd.url), 0.0).accounts_behind_s == 12.5


def test_a_window_whose_energy_the_daemon_accounted_before_the_level_was_set_is_not_in_its_energy_verdict(tmp_path):
    # The daemon's energy comes from its closed intervals, its tokens and limit gauge from now: a sampler late on a
    # loaded host, or intervals held for prompt lengths (up to 30 s) and the server's counter, keep the accounts seconds
    # behind. The verdict left out only the window that straddles the change: with the accounts three ticks behind,
    # the 250 W trial was judged on 300 W joules and the 200 W one on 250 W joules, a J/token of neither level.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    spent_at: dict[int, set] = {}
    judged: list[tuple[float, set]] = []
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml), accounts_behind=3) as fd, \
            rig.controller([0]) as ctl:
        fd.behind_s = 3 * 10.0 + 1.0  # three ticks' energy not yet accounted, and a second of grace
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        tuner = runner.tuner
        observe, judge = tuner.observe, tuner._judge

        def watched(w):
            spent_at[id(w)] = set(fd.released_from_w)
            return observe(w)

        def judging(t, out):
            stat = judge(t, out)
            if stat is not None:  # the windows the verdict rested on (the pending ones but the first, as _judge pools)
                judged.extend((w.level, spent_at[id(w)]) for w in used[0])
            return stat

        used = [[]]
        merge = policy.merge

        def merged(ws):
            used[0] = list(ws)
            return merge(ws)

        tuner.observe, tuner._judge = watched, judging
        policy.merge = merged
        try:
            runner.start()
            _drive(runner, clock, 40)
        finally:
            policy.merge = merge
    assert {lv for lv, _ in judged} - {300}, [d.reason for d in tuner.decisions]  # it did judge levels below
    mixed = [(lv, src) for lv, src in judged if src != {lv}]
    assert not mixed, mixed  # every window a verdict rests on: energy spent at its own level


def test_a_trial_whose_energy_the_daemon_never_accounts_ends_and_says_so():
    # The daemon's accounts fall ever further behind (an accounting step failing at every pass, a hold that never
    # lets go): every window after the move straddles it, so none is in the energy verdict. Before, the trial at
    # 200 W went on for 200 ticks (2000 s) with no decision and no word, its 197 windows kept; now it ends as a trial
    # too thin to judge, back at the level before, and says why.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        fd.behind_s = 0.5
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 6)
        n = len(runner.tuner.decisions)
        for _ in range(90):  # past ACCOUNTS_CATCH_UP_S (600 s) after the move
            fd.behind_s += runner.cfg.tick_s  # stuck: each tick's energy never accounted
            _drive(runner, clock, 1)
        new = list(runner.tuner.decisions)[n:]
        assert any("accounted" in d.reason for d in new), [(d.action, d.reason) for d in new]
        assert runner.tuner.state != "trial" or len(runner.tuner._pending) < 70, runner.tuner.state


def test_a_daemon_measuring_other_gpus_is_not_believed(tmp_path):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon() as fd, rig.controller([0]) as ctl:  # reports GPU-fake
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 12)
        assert _limit_w(nvml) == 300
    assert [d.action for d in runner.tuner.decisions] == ["start", "stale"]
    assert "measures GPUs GPU-fake" in runner.tuner.decisions[-1].reason


def _add_after(prefix: str, line: str):
    """A mutation of the exposition: `line` added after the sample line starting with `prefix`."""
    def mutate(text: str) -> str:
        out = []
        for ln in text.splitlines():
            out.append(ln)
            if ln.startswith(prefix):
                out.append(line)
        return "\n".join(out) + "\n"
    return mutate


def _gpu_read_twice(text: str) -> str:
    """The tuned GPU's limit read a second time, at 300 W, before the true reading."""
    out = []
    for ln in text.splitlines():
        if ln.startswith("powerprof_gpu_power_limit_watts{"):
            out.append(ln.replace('gpu="0"', 'gpu="1"').rsplit(" ", 1)[0] + " 300.0")
        out.append(ln)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("mutate,why", [
    # Each sample finite, their sum inf: the window's inf - inf crashed the loop (ValueError out of tick).
    (_add_after("powerprof_requests_total{", 'powerprof_requests_total{outcome="ok",tag="a"} 1.7e308\n'
                'powerprof_requests_total{outcome="ok",tag="b"} 1.7e308'), "implausible value"),
    (_add_after("powerprof_tokens_generated_total{", 'powerprof_tokens_generated_total{tag="x"} 1e300'),
     "implausible value"),  # finite but no count: was believed
    (_add_after("powerprof_tokens_generated_total{", 'powerprof_tokens_generated_total{tag="x"} NaN'),
     "implausible value"),
    (_add_after("powerprof_tokens_generated_total{", 'powerprof_tokens_generated_total{tag="x"} -5'),
     "implausible value"),
    (_add_after("powerprof_tokens_generated_total{", 'powerprof_tokens_generated_total{tag="x"} +Inf'),
     "implausible value"),
    (_add_after("powerprof_tokens_generated_total{", 'powerprof_tokens_generated_total{tag="x"} true'),
     "unreadable metrics"),
    # The same GPU read twice: which one was believed depended on the order (the last one was).
    (_gpu_read_twice,
     "appears twice"),
    # The idle part of the energy missing (a renamed label): was read as free energy.
    (lambda t: "\n".join(ln for ln in t.splitlines()
                         if not ln.startswith('powerprof_gpu_energy_attributed_joules_total{to="idle"}')),
     "want one sample each"),
    # No _sum: was read as 0 prompt tokens and the window judged.
    (lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith("powerprof_request_prompt_tokens_sum")),
     "want one _sum"),
    # A proxy worker serving unread after an upgrade in place: requests and latencies stood still while energy moved,
    # so windows were judged with 0 requests, the guard (below guard_min_requests) never backed off, and the GPU
    # stayed at the trial limit with the users' latency unguarded.
    (lambda t: t.replace("powerprof_proxy_workers_unread 0.0", "powerprof_proxy_workers_unread 1.0"),
     "proxy traffic is unread"),
])
def test_garbage_from_the_daemon_is_refused_with_its_reason_and_ends_at_the_reference(tmp_path, mutate, why):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    bad = []
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters((bad[0] if bad else str)(fetch_metrics(fd.url, 2)), 0.0),
                            ctl=ctl, gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _below_reference(runner, clock, nvml)
        bad.append(mutate)
        _drive(runner, clock, 5)  # past stale_s (30 s): never a verdict on those figures, and no crash
        assert _limit_w(nvml) == 300
        d = runner.tuner.decisions[-1]
        assert d.action == "stale" and d.to_level == 300 and why in d.reason, [x.reason for x in runner.tuner.decisions]
    assert _limit_w(nvml) == 300  # the original limit


def _dripping_server():
    """An endpoint that sends its headers, then one byte every half second forever."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=drip, args=(c,), daemon=True).start()

    def drip(c):
        try:
            c.recv(1000)
            c.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
            while True:
                c.sendall(b"#")
                time.sleep(0.5)
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}/metrics"


def test_a_dripping_endpoint_neither_hangs_the_scrape_nor_holds_off_stale_and_kill(tmp_path):
    import threading

    srv, url = _dripping_server()
    try:
        t0 = time.monotonic()
        with pytest.raises(ObserveError, match="took more than"):
            fetch_metrics(url, timeout_s=1.0)
        assert time.monotonic() - t0 < 15  # bounded by the deadline (+ one socket read), not by the endpoint
        nvml = SimNVML("seed-16g", state_path=None)
        with Rig("seed-16g", nvml=nvml) as rig, rig.controller([0]) as ctl:
            # A read that never returns at all: the loop's own clock must still act.
            never = threading.Event()
            runner = TuneRunner(_cfg(tick_s=0.1, stale_s=0.5), lambda: never.wait(3600), ctl=ctl, gpus=[0],
                                gpu_uuids=[nvml.gpus[0].uuid])
            stop = threading.Event()
            th = threading.Thread(target=runner.run, args=(stop,), daemon=True)
            th.start()
            deadline = time.monotonic() + 30
            while runner.tuner.state != "stale" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert runner.tuner.state == "stale"
            runner.on_sigusr1()
            while runner.tuner.state != "killed" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert runner.tuner.state == "killed" and _limit_w(nvml) == 300
            stop.set()
            th.join(30)
            assert not th.is_alive()
            never.set()
    finally:
        srv.close()


# --- the command, as a process -------------------------------------------------------------------

def _start_tune(tmp_path, fd):
    cfg = tmp_path / "tune.toml"
    cfg.write_text('[tuner]\nlevels = "150,200,250,300"\ntpot_p95_ms = 100\ntick_s = 0.2\nwindow_s = 0.3\n'
                   "dwell_s = 0.4\nmin_requests = 5\nguard_s = 1\nguard_min_requests = 5\nstale_s = 5\n"
                   "max_explore_share = 1.0\nexplore_horizon_s = 60\nregime_s = 30\n")
    cfg.chmod(0o644)
    out = tmp_path / "decisions"
    proc = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", fd.url,
                             "--config", str(cfg), "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tune exited early: {proc.stderr.read()}")
        if out.exists() and any(r["action"] == "explore" for f in out.rglob("*.parquet") for r in pq.read_table(f).to_pylist()):
            return proc, out
        time.sleep(0.1)
    proc.kill()
    pytest.fail("the tuner never explored")


@pytest.fixture
def operator_limit():
    sim = SimNVML("seed-16g")
    sim.nvmlInit()
    sim.nvmlDeviceSetPowerManagementLimit(sim.nvmlDeviceGetHandleByIndex(0), 280_000)
    assert sim_limit_w() == 280
    return 280.0


# SIGQUIT, SIGUSR2, SIGALRM: killed the tuner with the GPU capped and nothing said (exit -3/-12/-14).
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2,
                                 signal.SIGALRM], ids=lambda s: s.name)
def test_a_stop_signal_ends_at_the_original_limit(tmp_path, operator_limit, sig):
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, out = _start_tune(tmp_path, fd)
        try:
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + sig, err  # SIGINT was click's "Aborted!", exit 1
    assert "Traceback" not in err and "Aborted" not in err, err
    # Each decision is a line on stderr (root's journal under systemd); they went nowhere but the dataset.
    assert re.search(r"INFO powerprof\.tune: explore 300→\d+ .*\(applied\)", err), err
    assert re.search(r"INFO powerprof\.tune: stop \d+→%g " % operator_limit, err), err
    assert sim_limit_w() == operator_limit
    rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert rows[-1]["action"] == "stop" and rows[-1]["to_level"] == operator_limit
    assert "the original limits are back" in err, err


def test_sigkill_then_restore_puts_the_original_limit_back(tmp_path, operator_limit):
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, _ = _start_tune(tmp_path, fd)  # returns once it explored: a trial level was set
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # Killed while it held some level of its own (a trial, or 300 W after a back-off: ticks race the kill on a
    # loaded machine), never the operator's: the restore file is what brings that back.
    assert sim_limit_w() != operator_limit
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "restore", "--simulate"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sim_limit_w() == operator_limit


def test_sigusr1_goes_to_the_reference_and_holds_while_running(tmp_path, operator_limit):
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, out = _start_tune(tmp_path, fd)
        try:
            proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not any(
                    r["action"] == "kill" for f in out.rglob("*.parquet") for r in pq.read_table(f).to_pylist()):
                time.sleep(0.05)
            assert sim_limit_w() == 300.0
            proc.send_signal(signal.SIGUSR1)  # the kill switch sent twice (hostile4): the same hold, nothing more
            time.sleep(1.5)  # ticks go on; the reference stays
            assert sim_limit_w() == 300.0 and proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert sim_limit_w() == operator_limit
    rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert rows[-1]["action"] == "stop" and rows[-1]["to_level"] == operator_limit  # the final restore, recorded
    assert [r["action"] for r in rows].count("kill") == 1


_FAST = ('[tuner]\ntick_s = 0.2\nwindow_s = 0.3\ndwell_s = 0.4\nmin_requests = 5\nguard_s = 1\n'
         'guard_min_requests = 5\nstale_s = 5\n')


def test_a_daemon_url_where_nothing_answers_is_said_at_once(tmp_path, operator_limit):
    # A typo in the port: the tuner printed its start line, then nothing for as long as it ran (exit 0); only the
    # decisions dataset held, 30 s in, a stale row with the reason.
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sk.getsockname()[1]}/metrics"
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", url,
                        "--levels", "150,300", "--tpot-p95-ms", "100", "--dry-run", "--duration", "3",
                        "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"cannot read {url}" in r.stderr, r.stderr
    assert r.stderr.count(f"cannot read {url}") == 1  # said once, not every tick
    assert "no figures ever read from the daemon" in r.stderr, r.stderr  # and at the end: nothing was judged
    assert sim_limit_w() == operator_limit


def test_dry_run_needs_no_privilege_and_changes_nothing(tmp_path, monkeypatch, operator_limit):
    monkeypatch.setenv("POWERPROF_SIM_UNPRIVILEGED", "1")  # the simulator refuses every set, as for a normal user
    cfg = tmp_path / "fast.toml"
    cfg.write_text(_FAST)
    out = tmp_path / "d"
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc = subprocess.Popen([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", fd.url,
                                 "--config", str(cfg), "--levels", "150,200,250,300", "--tpot-p95-ms", "100", "--dry-run",
                                 "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            rows: list = []
            while time.monotonic() < deadline and proc.poll() is None and not any(r["action"] == "hold" for r in rows):
                time.sleep(0.1)
                rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err  # as docs/tuner.md says for every run
    assert "dry run" in err and "Traceback" not in err
    rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert rows[0]["action"] == "start" and not any(r["applied"] for r in rows)
    holds = [r for r in rows if r["action"] == "hold"]
    assert holds and all(r["from_level"] == operator_limit for r in holds)  # judged at the limit really on the GPU
    assert rows[-1]["action"] == "stop"
    assert sim_limit_w() == operator_limit


@pytest.mark.parametrize("args,toml,msg", [
    (["--levels", "150,999", "--tpot-p95-ms", "100"], None, "999"),
    (["--levels", "150,300"], None, "set an SLO: tpot_p95_ms and/or ttft_p95_ms ([tuner] in the config, or --tpot-p95-ms"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--reference", "200"], None, "not one of the levels"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\ntick_s = inf\n", "tick_s"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nstale_s = inf\n", "stale_s"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nguard_ratio = 1e9\n", "guard_ratio"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\ntick_s = 20\n", "two ticks"),
    (["--levels", "150,300", "--tpot-p95-ms", "1e300"], None, "guard would never fire"),  # was accepted: no back-off
    (["--levels", "150,300", "--ttft-p95-ms", "70000"], "[tuner]\nguard_ratio = 2.0\n", "under 65536 ms"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--out", "/proc/x"], None, "cannot write"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--metrics-port", "BUSY"], None, "--metrics-port"),
    # The hostile-input battery (hostile4): every one refused before a controller opens.
    (["--levels", "", "--tpot-p95-ms", "100"], None, "no power levels given"),
    (["--levels", "300", "--tpot-p95-ms", "100"], None, "at least two distinct levels"),
    (["--levels", "150,150,300", "--tpot-p95-ms", "100"], None, "duplicates"),
    (["--levels", "1,300", "--tpot-p95-ms", "100"], None, "outside the allowed range"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--reference", "80%"], None, "not one of the levels"),
    (["--levels", "150,300", "--tpot-p95-ms", "100", "--reference", "fast"], None, "tuner.reference"),
    (["--levels", "150,300", "--tpot-p95-ms", "nan"], None, "--tpot-p95-ms"),
    (["--levels", "150,300", "--tpot-p95-ms", "0"], None, "--tpot-p95-ms"),
    (["--levels", "150,300", "--ttft-p95-ms", "-1"], None, "--ttft-p95-ms"),
    (["--levels", "150,300", "--tpot-p95-ms", "100ms"], None, "without its unit"),
    (["--tpot-p95-ms", "100"], "[tuner]\nlevels = []\n", "no power levels given"),
    (["--tpot-p95-ms", "100"], "[tuner]\nlevels = [150, true]\n", "True"),
    (["--levels", "150,300"], "[tuner]\ntpot_p95_ms = \"fast\"\n", "tuner.tpot_p95_ms: a number"),
    (["--levels", "150,300"], "[tuner]\ntpot_p95_ms = nan\n", "positive number of milliseconds"),
    (["--levels", "150,300"], "[tuner]\ntpot_p95_ms = -5\n", "positive number of milliseconds"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\ndwell_s = 0\n", "tuner.dwell_s: must be positive"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\ndwell_s = 1e12\n", "tuner.dwell_s: at most"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nmax_explore_share = 2\n", "max_explore_share"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nmax_step = 0\n", "at least 1"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nreference = 275\n", "not one of the levels"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\nbogus = 1\n", "unknown key(s) in [tuner]: bogus"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner]\n[daemon]\n", "unknown section(s) daemon"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "tuner = 5\n", "[tuner] table"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], "[tuner\n", "not valid TOML"),
    (["--levels", "150,300", "--tpot-p95-ms", "100"], b"[tuner]\n# \xff\n", "not valid TOML"),
])
def test_bad_tuner_settings_exit_2_and_change_nothing(tmp_path, operator_limit, args, toml, msg):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    args = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in args]
    if toml is not None:
        (tmp_path / "t.toml").write_bytes(toml if isinstance(toml, bytes) else toml.encode())
        args += ["--config", str(tmp_path / "t.toml")]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "d")]
    try:
        r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics",
                            "http://127.0.0.1:1/metrics", "--duration", "2", *args], capture_output=True, text=True,
                           timeout=60)  # --duration: a setting wrongly accepted ends the run (exit 0), not the test
    finally:
        busy.close()
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert sim_limit_w() == operator_limit  # not even the reference was set
    assert not list((tmp_path / "state").rglob("restore-*.json"))


@pytest.mark.parametrize("url", ["http://10.0.0.1:9464/metrics", "http://example.com/metrics", "ftp://127.0.0.1/x",
                                 "http://user:pw@127.0.0.1:9464/metrics"])
def test_a_daemon_url_off_loopback_is_refused(url, operator_limit):
    # With a user and password (the hostile battery's): the loopback check passed, urllib then resolved
    # "user:pw@127.0.0.1" as a host name, never read it, and logged the password every 10 s.
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", url,
                        "--levels", "150,300", "--tpot-p95-ms", "100"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "loopback" in r.stderr or "http://" in r.stderr or "no user or password" in r.stderr
    assert sim_limit_w() == operator_limit


def test_the_scrape_follows_no_redirect_and_no_proxy(monkeypatch):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    import threading

    class Redirect(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "http://10.0.0.1/metrics")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ObserveError, match="redirect"):
            fetch_metrics(f"http://127.0.0.1:{srv.server_address[1]}/metrics", timeout_s=5)
    finally:
        srv.shutdown()
        srv.server_close()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")  # a proxy that would refuse: unused, so the read works
    with FakeDaemon() as fd:
        assert "powerprof_tokens_generated" in fetch_metrics(fd.url, 5)


def test_a_config_file_others_can_write_is_refused_as_root(tmp_path):
    import os

    from powerprof.trust import read_trusted
    from powerprof.tuner.policy import TunerConfigError
    from powerprof.tuner.setup import load_table

    me = os.geteuid()
    conf = tmp_path / "conf"
    conf.mkdir(mode=0o755)
    conf.chmod(0o755)
    f = conf / "tuner.toml"
    f.write_text("[tuner]\ntpot_p95_ms = 100\n")
    f.chmod(0o666)
    with pytest.raises(TunerConfigError, match="owned by uid|writable by group or others"):
        load_table(f, euid=0)
    f.chmod(0o644)
    assert read_trusted(f, euid=me) == b"[tuner]\ntpot_p95_ms = 100\n"  # the check itself, for whoever runs the tests
    if me == 0:
        assert load_table(f, euid=0) == {"tpot_p95_ms": 100}
    link = conf / "link.toml"
    link.symlink_to(f)
    assert read_trusted(link, euid=me) == f.read_bytes()  # a link only this user could have made is followed
    if me == 0:  # as anyone else, load_table(euid=0) already refuses the user-owned folder
        os.lchown(link, 65534, 65534)  # but never one another user owns, even to a good file
        with pytest.raises(TunerConfigError, match="symlink .* is owned by uid 65534"):
            load_table(link, euid=0)
    conf.chmod(0o775)  # someone in the group could swap the file
    with pytest.raises(PermissionError, match="writable by group or others"):
        read_trusted(f, euid=me)
    conf.chmod(0o755)
    with pytest.raises(TunerConfigError, match="only \\[tuner\\]"):
        f.write_text("[daemon]\nx = 1\n")
        load_table(f, euid=f.stat().st_uid)


def test_the_kill_switch_is_never_written_through_a_symlink(tmp_path):
    """A kill file planted as a symlink (a folder another user could write) must not make root truncate its target."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "killed").symlink_to(victim)
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid], kill_path=tmp_path / "killed")
        runner.kill_requested.set()
        runner.check_kill()
        assert runner.tuner.state == "killed" and _limit_w(nvml) == 300  # the pin holds all the same
    assert victim.read_text() == "precious\n"


@pytest.mark.skipif(sys.platform != "linux" or __import__("os").geteuid() != 0, reason="the check is root's")
@pytest.mark.parametrize("which", ["out", "state"])
def test_root_refuses_folders_another_user_could_write(tmp_path, monkeypatch, operator_limit, which):
    """As root, the decisions folder and the state folder (kill switch, locks, restore file) must be root's alone:
    a symlink planted in either would make root write anywhere. Refused before anything is set (exit 2)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777 if which == "out" else 0o777)  # sticky or not: the folder itself must be root's alone
    out = shared / "decisions" if which == "out" else tmp_path / "d"
    if which == "state":
        monkeypatch.setenv("POWERPROF_STATE_DIR", str(shared / "powerprof"))
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics",
                        "http://127.0.0.1:1/metrics", "--levels", "150,300", "--tpot-p95-ms", "100", "--out", str(out),
                        "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "refusing to write there as root" in r.stderr and str(shared) in r.stderr and "Traceback" not in r.stderr
    assert sim_limit_w() == operator_limit
    assert not (shared / "decisions").exists() and not (shared / "powerprof").exists()  # nothing made there


def test_an_exception_in_the_policy_ends_at_the_original_limit(tmp_path):
    """A bug in the policy ends the run (a traceback, exit 1, systemd restarts it), never with the GPU left capped."""
    import threading

    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(280)
    cfg = _cfg(tick_s=0.05, stale_s=5)
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd:
        with pytest.raises(ZeroDivisionError), rig.controller([0]) as ctl:
            runner = TuneRunner(cfg, lambda: parse_counters(fetch_metrics(fd.url, 2), time.monotonic()), ctl=ctl,
                                gpus=[0], out_dir=tmp_path / "d", gpu_uuids=[nvml.gpus[0].uuid])

            def broken(w):
                ctl.set_power_limit_w(150)  # the bug strikes with the GPU at the lowest level
                raise ZeroDivisionError("a policy bug")

            runner.tuner.observe = broken
            runner.run(threading.Event(), duration_s=60)
        assert _limit_w(nvml) == 280
    rows = pq.read_table(tmp_path / "d").to_pylist()
    assert rows[-1]["action"] == "stop" and rows[-1]["to_level"] == 280


def test_a_second_tune_on_the_same_gpu_changes_nothing_and_keeps_the_kill_switch(tmp_path, operator_limit):
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, out = _start_tune(tmp_path, fd)
        try:
            proc.send_signal(signal.SIGUSR1)
            killed = tmp_path / "state" / "powerprof" / "tuner-killed"
            deadline = time.monotonic() + 20
            # The kill is persisted first, then the reference set: on a loaded machine one poll can fall between.
            while time.monotonic() < deadline and not (killed.exists() and sim_limit_w() == 300.0):
                time.sleep(0.05)
            assert killed.exists() and sim_limit_w() == 300.0
            r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics", fd.url,
                                "--config", str(tmp_path / "tune.toml"), "--out", str(tmp_path / "second"), "--resume"],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 1 and "already being controlled" in r.stderr, r.stderr
            assert killed.exists()  # --resume of a tune that never held the GPU clears nothing
            assert sim_limit_w() == 300.0 and proc.poll() is None  # the first still holds the reference
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert sim_limit_w() == operator_limit


def test_a_kill_switch_sent_while_the_tuner_starts_is_kept_and_persisted(tmp_path):
    """`tune` installs a KillSwitch first: a SIGUSR1 before the config is read, or while the controller's handler holds
    SIGUSR1 (it restores and exits 138, and systemd restarts the tuner), is persisted, so the restart starts killed.
    Before, the first ended the process by SIGUSR1's default action and the second exited 138, the kill lost."""
    import os

    from powerprof.tuner.runner import KillSwitch

    killed = tmp_path / "killed"
    switch = KillSwitch()
    prev = signal.signal(signal.SIGUSR1, switch)
    try:
        signal.raise_signal(signal.SIGUSR1)  # before the config says where the file goes (or that it is a dry run)
        assert switch.requested.is_set() and not killed.exists()
        switch.arm(killed)
        assert killed.exists()
        killed.unlink()
        nvml = SimNVML("seed-16g", state_path=None)
        nvml.gpus[0].set_limit_w(280)
        with Rig("seed-16g", nvml=nvml) as rig:
            with pytest.raises(SystemExit) as e, rig.controller([0]) as ctl:
                ctl.set_power_limit_w(150)
                signal.raise_signal(signal.SIGUSR1)  # the controller's handler, before the runner's is installed
            assert e.value.code == 128 + signal.SIGUSR1 and _limit_w(nvml) == 280
        assert killed.exists()
        # The runner the CLI builds takes the same event: it starts killed.
        clock = Clock()
        with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
            os.unlink(killed)
            runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                                clock=clock, gpu_uuids=[nvml.gpus[0].uuid], kill_path=killed,
                                kill_requested=switch.requested)
            runner.start()
            _drive(runner, clock, 12)
            assert runner.tuner.state == "killed" and _limit_w(nvml) == 300 and killed.exists()
    finally:
        signal.signal(signal.SIGUSR1, prev)


def test_the_daemons_words_reach_roots_log_and_dataset_as_one_short_line(tmp_path):
    """A label the daemon sends (here its GPU's UUID) is quoted in the stale row's reason: never a newline that would
    forge a line in root's journal, never kilobytes."""
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    forged = "GPU-x\nroot: kill switch cleared by --resume " + "A" * 5000
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=lambda: (forged, 300.0)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid], out_dir=tmp_path / "d")
        runner.start()
        _drive(runner, clock, 5)
    d = runner.tuner.decisions[-1]
    assert d.action == "stale" and "measures GPUs GPU-x\\nroot" in d.reason
    assert "\n" not in d.reason and len(d.reason) < 700 and "its energy is not these GPUs" in d.reason, d.reason


# --- SIGUSR1 before the CLI is imported ---------------------------------------------------------------------------

_EARLY_CFG = ('[tuner]\nlevels = "150,200,250,300"\ntpot_p95_ms = 100\ntick_s = 0.2\nwindow_s = 0.3\ndwell_s = 0.4\n'
              'min_requests = 5\nguard_s = 1\nguard_min_requests = 5\nstale_s = 5\nmax_explore_share = 1.0\n'
              'explore_horizon_s = 60\nregime_s = 30\n')


def _sigusr1_caught(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    except OSError:
        pass
    return False


def _killed_from_the_start(tmp_path, proc, out, operator_limit):
    """The tuner kept running, killed from its first row: the kill persisted, the reference held, no trial ever made;
    SIGTERM then puts the operator's limit back."""
    killed = tmp_path / "state" / "powerprof" / "tuner-killed"
    try:
        deadline = time.monotonic() + 60
        rows: list = []
        while time.monotonic() < deadline and not any(r["action"] == "kill" for r in rows):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
            rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        time.sleep(1.5)  # ticks go on: still no trial
        rows = [r for f in sorted(out.rglob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        assert proc.poll() is None and killed.exists() and sim_limit_w() == 300.0
        assert [r["action"] for r in rows][:2] == ["start", "kill"] and "explore" not in {r["action"] for r in rows}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert sim_limit_w() == operator_limit and killed.exists()


def test_a_kill_switch_sent_while_the_cli_is_imported_is_kept_and_persisted(tmp_path, operator_limit):
    """The console command (powerprof.entry) records SIGUSR1 before it imports the CLI; `tune`'s KillSwitch takes it
    on. Here it lands exactly in that window, when click is being imported: before, SIGUSR1's default action ended
    the process there (and systemd restarted it tuning, the kill lost)."""
    cfg = tmp_path / "tune.toml"
    cfg.write_text(_EARLY_CFG)
    out = tmp_path / "decisions"
    hook = ("import os, signal, sys\n"
            "class AtClick:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'click':\n"
            "            sys.meta_path.remove(self)\n"
            "            os.kill(os.getpid(), signal.SIGUSR1)\n"
            "        return None\n"
            "sys.meta_path.insert(0, AtClick())\n"
            "sys.argv[0] = 'powerprof'\n"
            "from powerprof.entry import main\n"
            "sys.exit(main())\n")
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc = subprocess.Popen([sys.executable, "-c", hook, "tune", "--simulate", "--daemon-metrics", fd.url, "--config",
                                 str(cfg), "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _killed_from_the_start(tmp_path, proc, out, operator_limit)


def test_a_kill_switch_sent_right_after_spawn_is_kept_and_persisted(tmp_path, operator_limit):
    """SIGUSR1 as soon as the new process catches it at all: the console command's first code, within tens of
    milliseconds of the interpreter starting (before, the first line of `tune`, most of a second later)."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["powerprof"] == "powerprof.entry:main"  # the installed `powerprof` runs it first
    cfg = tmp_path / "tune.toml"
    cfg.write_text(_EARLY_CFG)
    out = tmp_path / "decisions"
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc = subprocess.Popen([sys.executable, "-m", "powerprof.entry", "tune", "--simulate", "--daemon-metrics",
                                 fd.url, "--config", str(cfg), "--out", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not _sigusr1_caught(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline
        proc.send_signal(signal.SIGUSR1)
        _killed_from_the_start(tmp_path, proc, out, operator_limit)


def test_other_commands_are_untouched_by_the_early_handler():
    r = subprocess.run([sys.executable, "-m", "powerprof.entry", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "powerprof" in r.stdout
    r = subprocess.run([sys.executable, "-c", "import signal, sys; sys.argv = ['powerprof', 'devices', '--help']\n"
                        "from powerprof.entry import main\n"
                        "try:\n    main()\nexcept SystemExit:\n    pass\n"
                        "print(signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)"], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.strip().endswith("True"), r.stdout + r.stderr


# --- the decisions' day folders, checked before each write as root ---------------------------------------------------

def _today() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")


def _plant(out, how, victim):
    """Today's and tomorrow's day folder (a test may cross midnight UTC) as another user could leave them."""
    import datetime as dt

    for day in {_today(), (dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)).strftime("%Y-%m-%d")}:
        d = out / f"date={day}"
        if how == "symlink":
            d.symlink_to(victim, target_is_directory=True)
        else:
            d.mkdir()
            d.chmod(0o777)


@pytest.mark.parametrize("how", ["symlink", "other-writable"])
def test_a_planted_day_folder_is_never_written_and_the_original_limit_comes_back(tmp_path, how):
    """As root (simulated with euid 0), the decisions are never written into a `date=` folder that is a symlink or that
    another user could write: the row is not written, the reason is said, the run ends and the controller puts the
    original limit back."""
    import os

    from powerprof.tuner.runner import OutDirError

    out = tmp_path / "decisions"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    _plant(out, how, victim)
    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(280)
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd:
        with pytest.raises(OutDirError) as e, rig.controller([0]) as ctl:
            runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                                clock=Clock(), gpu_uuids=[nvml.gpus[0].uuid], out_dir=out, euid=0)
            runner.run(__import__("threading").Event(), duration_s=60)
        assert _limit_w(nvml) == 280
    assert f"date={_today()}" in str(e.value) and "not writing the decisions" in str(e.value)
    if os.geteuid() == 0:  # as anyone else the folder is refused for its owner first
        assert ("is a symlink" if how == "symlink" else "writable by group or others") in str(e.value)
    assert list(victim.iterdir()) == [] and not list(out.rglob("*.parquet"))
    # And a day folder the tuner makes itself never comes out writable by others, whatever the umask.
    fresh = tmp_path / "fresh"
    old = os.umask(0)
    try:
        with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
            TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0], clock=Clock(),
                       gpu_uuids=[nvml.gpus[0].uuid], out_dir=fresh).start()
    finally:
        os.umask(old)
    assert (fresh / f"date={_today()}").stat().st_mode & 0o777 == 0o755


@pytest.mark.skipif(sys.platform != "linux" or __import__("os").geteuid() != 0, reason="the check is root's")
def test_root_refuses_a_planted_day_folder_at_start_and_one_made_unsafe_while_running(tmp_path, operator_limit):
    """The command as root: a planted `date=` folder is refused before anything is set (exit 2); one made writable by
    others while the tuner runs ends it at the next row (exit 2, the original limit back, the reason said)."""
    out = tmp_path / "decisions"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    _plant(out, "symlink", victim)
    args = [sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--levels", "150,200,250,300",
            "--tpot-p95-ms", "100", "--out", str(out)]
    r = subprocess.run(args + ["--daemon-metrics", "http://127.0.0.1:1/metrics"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "refusing to write in date=" in r.stderr and "is a symlink" in r.stderr, r.stderr
    assert sim_limit_w() == operator_limit and list(victim.iterdir()) == []
    for d in out.iterdir():
        d.unlink()
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, out = _start_tune(tmp_path, fd)  # running, below the reference: it explored
        try:
            for d in out.iterdir():
                d.chmod(0o777)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 2 and "not writing the decisions" in err and "writable by group or others" in err, err
    assert "Traceback" not in err and sim_limit_w() == operator_limit


# --- requests that never finish ----------------------------------------------------------------------------------

@pytest.mark.parametrize("stall", ["waiting", "silent"])
def test_a_server_that_stalls_sends_the_live_tuner_to_the_reference(tmp_path, stall):
    """Every request that finishes meets the SLO, but one streamed request waits past twice the TTFT SLO for its first
    token (or a stream goes silent past 100 × the TPOT SLO): the daemon's gauges show it and the tuner backs off."""
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(ttft_p95_ms=5000.0), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid], out_dir=tmp_path / "d")
        runner.start()
        _below_reference(runner, clock, nvml)
        if stall == "waiting":
            fd.oldest_awaiting_s = 30.0
        else:
            fd.longest_silence_s = 30.0
        _drive(runner, clock, 2)  # past the bound at the level in force whenever it was set
        assert _limit_w(nvml) == 300 and runner.tuner.state == "backoff"
        assert runner.metrics.sees_unfinished._value.get() == 1
    d = [r for r in pq.read_table(tmp_path / "d").to_pylist() if r["action"] == "backoff"][-1]
    assert "unfinished" in d["reason"] and d["to_level"] == 300, d["reason"]


def test_a_daemon_without_the_unfinished_gauges_is_said_once_and_tuning_goes_on(caplog):
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        fd.old = True
        runner = TuneRunner(_cfg(ttft_p95_ms=5000.0), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        with caplog.at_level("WARNING", logger="powerprof.tune"):
            _below_reference(runner, clock, nvml)  # as before those gauges existed
        said = [r for r in caplog.records if "cannot see a stalled server" in r.getMessage()]
        assert len(said) == 1 and runner.metrics.sees_unfinished._value.get() == 0


def test_each_decision_row_carries_its_tuner_and_its_number(tmp_path):
    # The row's key (tuner_id, seq; analysis/rowkeys.py): a copy of the folder among export's sources is written
    # once. The decision time is no key: one tick's decisions share it to the microsecond.
    from powerprof.tuner.policy import Decision
    from powerprof.tuner.runner import DecisionLog

    out = tmp_path / "decisions"
    for run in range(2):  # the tuner restarted on the same folder
        log = DecisionLog(out, [0], "power")
        for i in range(3):
            log.add(Decision(1.0, "hold", 300.0, 300.0, f"run {run}, decision {i}", "r0"), 0.0, True)
            if i:
                log.flush()
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 6 and len({(r["tuner_id"], r["seq"]) for r in rows}) == 6
    by_tuner: dict[str, list] = {}
    for r in rows:
        by_tuner.setdefault(r["tuner_id"], []).append((r["seq"], r["reason"]))
    assert len(by_tuner) == 2
    for decided in by_tuner.values():
        assert [s for s, _ in sorted(decided)] == [0, 1, 2]
        assert [why.rsplit(" ", 1)[1] for _, why in sorted(decided)] == ["0", "1", "2"]


def _unit_size(value: str) -> int:
    """A systemd size (512M, 1G, bytes) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", value.strip())
    assert m, value
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


def test_the_tuner_runs_within_its_units_memory_and_task_limits_with_room(tmp_path):
    # Before: powerprof-tune.service had no MemoryMax or TasksMax: a tuner that leaked (its regime memory, a dataset
    # writer) grew into the host's memory beside the inference server, as root. Now the unit bounds it with room over
    # what it uses while exploring: a cgroup OOM kill ends it like a kill -9, and ExecStopPost's restore puts the
    # original limit back (no MemoryHigh: throttled, it would hold a trial limit with its guard slowed).
    from pathlib import Path

    unit = {}
    for line in (Path(__file__).resolve().parents[1] / "systemd" / "powerprof-tune.service").read_text().splitlines():
        k, eq, v = line.partition("=")
        if eq and not line.startswith("#"):
            unit[k.strip()] = v.strip()
    assert "MemoryMax" in unit and "TasksMax" in unit, "the tuner's unit bounds neither memory nor tasks"
    assert "MemoryHigh" not in unit
    peak_kib = threads = 0
    with FakeDaemon(gpu=sim_gpu()) as fd:
        proc, _ = _start_tune(tmp_path, fd)
        try:
            deadline = time.monotonic() + 5  # explore, accept and hold: the live loop's working set
            while time.monotonic() < deadline and proc.poll() is None:
                status = dict(line.split(":", 1) for line in open(f"/proc/{proc.pid}/status").read().splitlines())
                peak_kib = max(peak_kib, int(status["VmHWM"].split()[0]))
                threads = max(threads, int(status["Threads"]))
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.communicate(timeout=30)
    assert peak_kib > 0 and threads > 0
    assert 2 * (peak_kib << 10) <= _unit_size(unit["MemoryMax"]), (peak_kib >> 10, unit["MemoryMax"])
    assert 4 * threads <= int(unit["TasksMax"]), (threads, unit["TasksMax"])


def test_a_live_run_says_what_its_level_waits_for_between_decisions(caplog):
    # A judgement needs window_s of traffic and min_requests finished requests: minutes of silence on a quiet server
    # read as a hung tuner (session 45's walkthrough). Once a window without a decision, one line says how far it is.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(per_scrape=3, gpu=sim_gpu(nvml)) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(min_requests=500), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        with caplog.at_level("INFO", logger="powerprof.tune"):
            _drive(runner, clock, 6)
    said = [r.getMessage() for r in caplog.records if "next judgement" in r.getMessage()]
    assert 2 <= len(said) <= 3, said  # 60 s of ticks, a window of 20 s: once a window, not once a tick
    assert said[-1].startswith("measuring 300 W for "), said
    held_s, finished = map(int, re.search(r"has (\d+) s of traffic \(20 s needed\) and (\d+) finished requests "
                                          r"\(500 needed\)", said[-1]).groups())
    assert 20 <= held_s <= 50 and 3 <= finished < 500, said[-1]
    assert not [d for d in runner.tuner.decisions if d.action != "start"], runner.tuner.decisions


def test_a_dry_run_says_what_its_next_verdict_waits_for(caplog):
    # 60 s of a dry run on the defaults (a verdict needs guard_s / 2 of traffic and guard_min_requests) said nothing
    # past its start line (session 46's smoke walkthrough).
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon(per_scrape=1, gpu=sim_gpu(nvml)) as fd:
        runner = TuneRunner(_cfg(dry_run=True, guard_min_requests=500), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0),
                            ctl=None, gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        with caplog.at_level("INFO", logger="powerprof.tune"):
            _drive(runner, clock, 6)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dry run: the next verdict has")]
    assert 2 <= len(said) <= 3 and "(15 s needed)" in said[-1] and "(500 needed)" in said[-1], said


def _fail_writes_from_the_first_explore(runner_mod, written: list):
    """runner's atomic_write_table as a disk that fills: rows up to the first `explore` are written (their to_levels
    in `written`), that write and every later one fail with ENOSPC."""
    import errno

    real = runner_mod.atomic_write_table
    full = []

    def write(path, table, *a, **k):
        rows = table.to_pylist()
        if full or any(r["action"] == "explore" for r in rows):
            full.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, table, *a, **k)
        written.extend(r["to_level"] for r in rows)

    return write


def test_a_full_out_disk_stops_the_tuner_before_it_moves_a_level_it_cannot_record(tmp_path, monkeypatch):
    # Session 47's review: the move 250→200 was applied, then its row's write failed (ENOSPC) with a traceback, exit 1:
    # the move and the stop row never recorded, and systemd restarted it every 10 s. Rows are written before their
    # move now, and a write that fails is OutDirError (exit 2, not restarted) saying the fix.
    import powerprof.tuner.runner as runner_mod
    from powerprof.tuner.runner import OutDirError

    written: list = []
    monkeypatch.setattr(runner_mod, "atomic_write_table", _fail_writes_from_the_first_explore(runner_mod, written))
    nvml = SimNVML("seed-16g", state_path=None)
    nvml.gpus[0].set_limit_w(280)
    applied: list = []
    out = tmp_path / "decisions"
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd:
        with pytest.raises(OutDirError) as e, rig.controller([0]) as ctl:
            real_set = ctl.set_power_limit_w
            ctl.set_power_limit_w = lambda w: (applied.append(w), real_set(w))[1]
            clock = Clock()
            runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                                clock=clock, gpu_uuids=[nvml.gpus[0].uuid], out_dir=out)
            runner.start()
            _drive(runner, clock, 40)
        assert _limit_w(nvml) == 280  # the controller put the original back
    assert applied == [300] and written == [300]  # the start, recorded; the explore neither written nor made
    msg = " ".join(str(e.value).split())
    assert "cannot write the tuner's decisions" in msg and "No space left on device" in msg, msg
    assert "free space there, or give another --out" in msg, msg


def test_tune_on_a_full_out_disk_exits_2_with_the_fix_and_no_traceback(tmp_path, operator_limit):
    # The command: exit 2 (the unit's RestartPreventExitStatus=2: systemd does not restart it into the same wall), one
    # line with the cause and the fix, the original limit back.
    restart_prevented = re.search(r"^RestartPreventExitStatus=(.*)$", (Path(__file__).parents[1] / "systemd" /
                                  "powerprof-tune.service").read_text(), re.M).group(1).split()
    assert "2" in restart_prevented
    cfg = tmp_path / "tune.toml"
    cfg.write_text('[tuner]\nlevels = "150,200,250,300"\ntpot_p95_ms = 100\ntick_s = 0.2\nwindow_s = 0.3\n'
                   "dwell_s = 0.4\nmin_requests = 5\nguard_s = 1\nguard_min_requests = 5\nstale_s = 5\n"
                   "max_explore_share = 1.0\nexplore_horizon_s = 60\nregime_s = 30\n")
    out = tmp_path / "decisions"
    code = ("import sys, powerprof.tuner.runner as r\n"
            "sys.path.insert(0, %r)\n"
            "from test_tuner_live import _fail_writes_from_the_first_explore\n"
            "r.atomic_write_table = _fail_writes_from_the_first_explore(r, [])\n"
            "from powerprof.cli import main\n"
            "sys.argv = ['powerprof'] + sys.argv[1:]\n"
            "main()\n") % str(Path(__file__).parent)
    with FakeDaemon(gpu=sim_gpu()) as fd:
        r = subprocess.run([sys.executable, "-c", code, "tune", "--simulate", "--daemon-metrics", fd.url, "--config",
                            str(cfg), "--out", str(out), "--duration", "30"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: --out ") and "No space left on device" in last and "free space there" in last, last
    assert last.endswith("the original limits are back"), last
    assert sim_limit_w() == operator_limit


def test_a_normal_stop_says_the_gpu_is_back_at_its_original_limit(tmp_path, operator_limit):
    # A run ended by --duration said nothing of the GPU; only a signal's stop did.
    r = subprocess.run([sys.executable, "-m", "powerprof.cli", "tune", "--simulate", "--daemon-metrics",
                        "http://127.0.0.1:1/metrics", "--levels", "150,300", "--tpot-p95-ms", "100", "--out",
                        str(tmp_path / "d"), "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == f"GPU 0 back at its original {operator_limit:g} W limit", r.stderr
    assert sim_limit_w() == operator_limit


def test_a_window_with_an_interval_whose_gpu_energy_is_unknown_is_not_judged():
    # A GPU unread in an interval leaves its energy out of the daemon's totals (its idle, or the kinds'): before, such a
    # window read low and was judged as measured.
    with FakeDaemon(per_scrape=20, tpot_s=0.05) as fd:
        a = parse_counters(fetch_metrics(fd.url), 0.0)
        b = parse_counters(fetch_metrics(fd.url), 10.0)
    assert a.energy_unknown_intervals == 0.0  # the daemon's counter, read
    window_between(a, b, 300.0)
    with pytest.raises(ObserveError, match="no energy reading"):
        window_between(a, dataclasses.replace(b, energy_unknown_intervals=3.0), 300.0)
    # A daemon older than the counter: nothing to check, the window stands.
    window_between(dataclasses.replace(a, energy_unknown_intervals=None),
                   dataclasses.replace(b, energy_unknown_intervals=None), 300.0)


def test_the_refusal_of_a_window_with_a_serving_gpu_unread_says_it_persists_and_the_fix():
    # Before: "... the window reads low: not usable", every window alike while the GPU stayed lost, with nothing saying
    # that it lasts until the GPU reads again or what to do.
    with FakeDaemon(per_scrape=20, tpot_s=0.05) as fd:
        a = parse_counters(fetch_metrics(fd.url), 0.0)
        b = parse_counters(fetch_metrics(fd.url), 10.0)
    with pytest.raises(ObserveError) as e:
        window_between(a, dataclasses.replace(b, energy_unknown_intervals=3.0), 300.0)
    said = str(e.value)
    assert "serving" in said and "every window" in said and "until" in said and "daemon.gpus" in said


def test_a_gpu_whose_energy_series_goes_while_unread_is_no_stalled_daemon():
    # The daemon leaves out the energy series of a GPU it cannot read (powerprof_gpu_energy_joules_total: never a still
    # counter). The tuner's check that the daemon samples compared the sums: the GPU's whole count leaving read as
    # energy that went down, "its sampling stalled?", on a daemon sampling on.
    with FakeDaemon(per_scrape=20, tpot_s=0.05) as fd:
        a = parse_counters(fetch_metrics(fd.url), 0.0)
        b = parse_counters(fetch_metrics(fd.url), 10.0)
    assert a.gpu_energies_j == {"GPU-fake": a.gpu_energy_j}  # read per GPU
    a = dataclasses.replace(a, gpu_energies_j={"GPU-fake": a.gpu_energy_j, "GPU-1": 5000.0},
                            gpu_energy_j=a.gpu_energy_j + 5000.0)
    assert b.gpu_energy_j < a.gpu_energy_j and energy_moved(a, b)  # GPU 1 unread in b: GPU 0 rose
    assert not energy_moved(b, b)
    none_read = dataclasses.replace(b, gpu_energies_j={}, gpu_energy_j=0.0)
    assert not energy_moved(a, none_read)  # none read and no unread time counted: the sums, which fell
    # None read, the daemon counting their unread time: it samples (window_between says why the window is refused).
    assert energy_moved(a, dataclasses.replace(none_read, gpu_unknown_s={"GPU-fake": a.gpu_unknown_s["GPU-fake"] + 10}))


def test_every_gpu_unread_is_refused_with_its_fix_not_as_a_stalled_daemon(tmp_path):
    # The one GPU serving the traffic gives no energy reading (its limit still read): its series goes, nothing's energy
    # moves. Before: "the daemon's GPU energy has not moved (its sampling stalled?)", not the refusal that names the
    # GPU serving the traffic unread and the fix (daemon.gpus).
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml)) as fd, rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid])
        runner.start()
        _drive(runner, clock, 2)
        fd.unread = True
        _drive(runner, clock, 12)
    (d,) = [d for d in runner.tuner.decisions if d.action == "stale"]
    assert "serving the traffic give no energy reading" in d.reason and "daemon.gpus" in d.reason, d.reason
    assert "stalled" not in d.reason


def test_an_idle_gpus_energy_read_in_part_of_a_window_is_in_no_verdict(tmp_path):
    # A GPU serving none of the traffic (600 J of idle energy a window) is lost for a while; the daemon's accounts lag,
    # so the first window taken again holds half of its idle energy. Its energy is no level's: the tuner's is the
    # serving GPU's alone, 1 J/token, whether it reads or not. Before: its idle energy was in the tuner's figure, that
    # window left out in a hold row and the verdict 2200 / 1600 (and, before that, 1.28, the half window pooled).
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml), aside_j=600.0) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"])
        runner.start()
        ref = runner.tuner.ref
        _drive(runner, clock, 2)  # a first window, both GPUs read
        fd.aside_lost, fd.aside_unread = True, 1.0
        _drive(runner, clock, 1)  # refused: its limit unread
        fd.aside_lost = False
        _drive(runner, clock, 1)  # refused: the window began while it was lost
        fd.aside_unread = 0.5
        _drive(runner, clock, 1)  # the accounts catch up: half of this window's intervals without it
        fd.aside_unread = 0.0
        first = None
        for _ in range(6):
            _drive(runner, clock, 1)
            if ref in runner.tuner.regime.stats:
                first = runner.tuner.regime.stats[ref]
                break
    assert first is not None, [d.reason for d in runner.tuner.decisions]
    assert first.j_per_token == pytest.approx(1600 / 1600)
    assert [d.action for d in runner.tuner.decisions if d.action in ("hold", "thin")] == [], \
        [d.reason for d in runner.tuner.decisions]


def test_a_trial_across_an_idle_gpus_loss_is_judged_on_the_serving_gpus_energy(tmp_path):
    # 250 W costs 1.3 J/token against 1.0 at 300 W; a GPU serving none of the traffic spends 600 J a window beside it
    # and its energy reads fail from the trial's second window on. Before: the trial read 1.3 against 1.375 J/token
    # (the incumbent with that GPU's energy), "saves"; then, ended back at the incumbent without a verdict (thin).
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, \
            FakeDaemon(gpu=sim_gpu(nvml), aside_j=600.0, j_per_token_at={250.0: 1.3}) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(levels=(250, 300)), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"])
        runner.start()
        for _ in range(20):
            _drive(runner, clock, 1)
            if runner.tuner.state == "trial":
                break
        assert runner.tuner.state == "trial" and runner.tuner.level == 250, [d.reason for d in runner.tuner.decisions]
        _drive(runner, clock, 1)
        fd.aside_unread = 0.5
        _drive(runner, clock, 1)
        fd.aside_unread = 1.0
        _drive(runner, clock, 8)
    acts = [(d.action, d.to_level) for d in runner.tuner.decisions]
    assert ("accept", 250) not in acts and not any(a == "thin" for a, _ in acts), \
        [d.reason for d in runner.tuner.decisions]
    verdict = [d for d in runner.tuner.decisions if d.from_level == 250 and d.to_level == 300]
    assert verdict and "250 W costs 30.0% more" in verdict[0].reason, [d.reason for d in runner.tuner.decisions]


def test_a_trial_across_the_daemons_first_judgement_of_which_gpus_serve_is_not_judged_on_two_bases(tmp_path):
    # 250 W costs 1.3 J/token against 1.0 at 300 W; a second GPU spends 1200 J a window (0.75 J/token) beside them, in
    # the work's energy until the daemon first judges which GPUs serve (here: during the trial), then out of it. Before:
    # nothing on /metrics said so: the trial read 1.3 against the incumbent's 1.75 J/token and was accepted, "saving"
    # that GPU's idle energy; levels judged before the change were weighed against ones after.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, \
            FakeDaemon(gpu=sim_gpu(nvml), aside_j=1200.0, j_per_token_at={250.0: 1.3}) as fd, \
            rig.controller([0]) as ctl:
        fd.aside_serving = fd._aside_served = True  # not judged yet: every GPU's energy is the work's
        runner = TuneRunner(_cfg(levels=(250, 300)), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"])
        runner.start()
        for _ in range(20):
            _drive(runner, clock, 1)
            if runner.tuner.state == "trial":
                break
        assert runner.tuner.state == "trial" and runner.tuner.level == 250, [d.reason for d in runner.tuner.decisions]
        assert runner.tuner.regime.stats, "the incumbent's figures were judged on the first basis"
        _drive(runner, clock, 1)
        fd.aside_serving = False  # the daemon's first judgement: that GPU serves none of the traffic
        _drive(runner, clock, 12)
    ds = runner.tuner.decisions
    acts = [(d.action, d.to_level) for d in ds]
    assert ("accept", 250) not in acts, [d.reason for d in ds]
    thin = [d for d in ds if d.action == "thin"]
    assert len(thin) == 1 and thin[0].to_level == 300 and "changed which GPUs serve" in thin[0].reason, \
        [d.reason for d in ds]
    # Named as the daemon's notes name GPUs (NVML index and UUID): before, the row counted the change, named nothing.
    assert "; left: gpu1 (GPU-aside)" in thin[0].reason and "joined" not in thin[0].reason, thin[0].reason
    # Measured again on one basis, the trial is refused on its own energy.
    verdict = [d for d in ds if d.t_s > thin[0].t_s and d.from_level == 250 and d.to_level == 300]
    assert verdict and "250 W costs 30.0% more" in verdict[0].reason, [d.reason for d in ds]


def test_an_idle_gpu_unread_for_a_second_every_30_s_leaves_the_tuner_converging(tmp_path):
    # An NVML hiccup on a GPU serving none of the traffic, 1 s of every 30 s. Before: each window holding it ended the
    # trial under way (thin) or left the level's windows out (hold): 13 explore / 13 thin / 14 hold over 120 ticks,
    # flipping 250 <-> 300 W, never converging, no row saying so.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, \
            FakeDaemon(gpu=sim_gpu(nvml), aside_j=600.0, j_per_token_at={250.0: 0.8, 200.0: 0.7, 150.0: 0.65}) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"])
        runner.start()
        for k in range(60):
            fd.aside_unread = 0.1 if k % 3 == 2 else 0.0  # 1 of the window's 10 intervals, every third window
            _drive(runner, clock, 1)
    acts = [d.action for d in runner.tuner.decisions]
    assert acts.count("accept") == 3 and "thin" not in acts and acts[-1] == "hold", acts
    assert runner.tuner.level == 150
    jpt = [d.j_per_token for d in runner.tuner.decisions if d.action == "accept"]
    assert jpt == pytest.approx([0.8, 0.7, 0.65]), jpt  # the serving GPU's alone, as without the hiccups


def test_a_second_idle_gpu_read_in_part_while_another_is_unread_throughout_moves_no_figure():
    # GPU A (serving none of the traffic) unread throughout, GPU B (serving none) unread over 30-70% of some windows:
    # the energy the tuner reads is the serving GPU's, the same in every window. Before: B's idle energy was in it, and
    # the partial-window test (some of the windows' intervals with an idle GPU unread, not all) missed B's windows, as
    # A made every interval one: windows holding 30-70% of B's energy were judged, unsaid.
    with FakeDaemon() as fd:
        fetch_metrics(fd.url)
        base = fd.snapshot  # its latency histograms and in-flight figures

    def snap(b_energy, b_unknown_s, requests_j):
        return dataclasses.replace(base, gpus=(GpuSnapshot(0, "GPU-S", "fake", 200.0, 1.0, 1.0, 300.0, requests_j),
                              GpuSnapshot(1, "GPU-A", "fake", None, None, None, None, 0.0, energy_unknown_s=100.0,
                                          energy_unread=True),
                              GpuSnapshot(2, "GPU-B", "fake", None, None, None, 300.0, b_energy,
                                          energy_unknown_s=b_unknown_s)),
                        energy_by_dest_j=(requests_j, b_energy, 0.0), idle_not_serving_j=b_energy,
                        tokens_by_tag={"": requests_j})

    class Holder:
        snapshot = None

    h = Holder()
    reg = make_registry(h)
    seen = []
    b_e = b_s = 0.0
    for k, share in enumerate([0.0, 0.3, 0.7, 0.3, 0.0]):
        b_e += 600.0 * (1 - share)
        b_s += 10.0 * share
        h.snapshot = snap(b_e, b_s, 1000.0 * (k + 1))
        seen.append(parse_counters(render(reg).decode(), float(k)))
    assert [b.energy_j - a.energy_j for a, b in zip(seen, seen[1:])] == pytest.approx([1000.0] * 4)


def test_a_tuned_gpu_the_daemon_cannot_read_is_said_as_such_not_as_other_gpus(tmp_path):
    # Before: "the daemon measures GPUs <the others>, the tuner tunes <all>: its energy is not these GPUs'", for a GPU
    # the daemon samples and lost.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with Rig("seed-16g", nvml=nvml) as rig, FakeDaemon(gpu=sim_gpu(nvml), aside_j=600.0) as fd, \
            rig.controller([0]) as ctl:
        runner = TuneRunner(_cfg(), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=ctl, gpus=[0],
                            clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"])
        runner.start()
        fd.aside_lost, fd.aside_unread = True, 1.0
        _drive(runner, clock, 5)
    d = runner.tuner.decisions[-1]
    assert d.action == "stale" and "reads no power limit on GPU GPU-aside now" in d.reason, d.reason
    assert "not these GPUs" not in d.reason
    # It lasts while the GPU is lost: the row says how to tune on without it (before, only "until it reads again").
    assert "daemon.gpus leaving it out" in d.reason and "--gpus leaving it out" in d.reason, d.reason


def test_a_dry_runs_j_per_token_is_the_serving_gpus_whatever_an_idle_gpu_reads(tmp_path):
    # Before: its verdict rows' J/token held a GPU serving none of the traffic's idle energy (2200 / 1600), and gave
    # none once a window held part of it.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon(gpu=sim_gpu(nvml), aside_j=600.0) as fd:
        runner = TuneRunner(_cfg(dry_run=True), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=None,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"], out_dir=tmp_path / "d")
        runner.start()
        _drive(runner, clock, 4)
        t_mixed = clock.t + runner.cfg.tick_s
        fd.aside_unread = 0.5
        _drive(runner, clock, 1)
        fd.aside_unread = 1.0
        _drive(runner, clock, 2)
        runner.stop_row()
    rows = [r for r in pq.read_table(tmp_path / "d").to_pylist() if r["action"] not in ("start", "stop")]
    before = [r for r in rows if r["t_mono_s"] < t_mixed - runner.t0_s]
    after = [r for r in rows if r["t_mono_s"] >= t_mixed - runner.t0_s]
    assert before and after and all(r["j_per_token"] == pytest.approx(1600 / 1600) for r in before + after), rows

def test_a_not_serving_idle_energy_above_the_idle_and_requests_energy_is_refused():
    # The serving GPUs' energy is requests + idle less it: a larger one is not the daemon's (it would read as negative
    # energy, a level "saving" more than it spent).
    with FakeDaemon() as fd:
        text = fetch_metrics(fd.url)
    assert parse_counters(text, 0.0).energy_j > 0
    bad = re.sub(r"(?m)^powerprof_gpu_idle_energy_not_serving_joules_total .*$",
                 "powerprof_gpu_idle_energy_not_serving_joules_total 1e9", text)
    with pytest.raises(ObserveError, match="not_serving_joules_total exceeds"):
        parse_counters(bad, 0.0)
    with pytest.raises(ObserveError, match="lack powerprof_gpu_idle_energy_not_serving_joules"):
        parse_counters(re.sub(r"(?m)^.*powerprof_gpu_idle_energy_not_serving_joules.*\n", "", text), 0.0)


def test_a_dry_runs_j_per_token_never_pools_energy_from_both_sides_of_a_serving_change(tmp_path):
    # A second GPU spends 1200 J a window (0.75 J/token) in the work's energy until the daemon first judges which GPUs
    # serve, then out of it: 1.75 J/token before, 1.0 after. Before: a dry run's verdict over its guard stretch pooled
    # windows of both bases and recorded a J/token neither side had (1.25, 1.375), unflagged.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon(gpu=sim_gpu(nvml), aside_j=1200.0) as fd:
        fd.aside_serving = fd._aside_served = True  # not judged yet: every GPU's energy is the work's
        runner = TuneRunner(_cfg(dry_run=True), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=None,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid, "GPU-aside"], out_dir=tmp_path / "d")
        runner.start()
        _drive(runner, clock, 5)
        fd.aside_serving = False  # the daemon's first judgement: that GPU serves none of the traffic
        _drive(runner, clock, 8)
        runner.stop_row()
    rows = [r for r in pq.read_table(tmp_path / "d").to_pylist() if r["action"] not in ("start", "stop")]
    jpt = [r["j_per_token"] for r in rows]
    assert 1.75 in jpt and 1.0 in jpt, rows  # both bases were judged, each on its own
    assert all(x is None or x in (pytest.approx(1.75), pytest.approx(1.0)) for x in jpt), jpt
    # A verdict whose stretch held the change says its J/token is over the windows after it alone.
    cut = [r for r in rows if "changed which GPUs serve" in r["reason"]]
    assert cut and all(r["j_per_token"] in (None, pytest.approx(1.0)) for r in cut), rows
    assert all("left: gpu1 (GPU-aside)" in r["reason"] for r in cut), rows


def test_a_serving_change_names_the_gpus_that_joined_and_left_or_says_it_cannot():
    # Before: "the daemon changed which GPUs serve the traffic (1 time(s) ...)", naming none of them.
    def at(changes, serving):
        return DaemonCounters(0.0, 0, 0, 0, 0, 0, 0, (), (), 0, 0, {}, serving_changes=changes, serving_gpus=serving)

    a = at(1, {"gpu0 (GPU-a)": True, "gpu1 (GPU-b)": False})
    why = serving_change(a, at(2, {"gpu0 (GPU-a)": False, "gpu1 (GPU-b)": True}))
    assert "; joined: gpu1 (GPU-b); left: gpu0 (GPU-a)" in why, why
    assert "changed back within it" in serving_change(a, at(3, dict(a.serving_gpus)))
    assert "names no GPUs" in serving_change(at(1, None), at(2, None))
    assert serving_change(a, at(1, dict(a.serving_gpus))) is None
    # The gauge left out while the daemon does not know which of several GPUs serve (every GPU's energy the work's):
    # the GPUs the other end names were all in the figure.
    assert "changes_total; left: gpu1 (GPU-b))" in serving_change(at(0, {}), a), serving_change(at(0, {}), a)


def test_a_dry_runs_verdict_is_of_the_level_the_gpus_have_never_pooled_with_the_one_before(tmp_path):
    # The operator moves the limit 300 → 250 W under a dry run (250 W costs 1.3 J/token, 300 W 1.0). Before: the
    # verdict labelled 250 W pooled the guard's stretch across the move, its J/token (1.2) and p95 partly 300 W's.
    nvml = SimNVML("seed-16g", state_path=None)
    clock = Clock()
    with FakeDaemon(gpu=sim_gpu(nvml), j_per_token_at={250.0: 1.3}) as fd:
        runner = TuneRunner(_cfg(dry_run=True), lambda: parse_counters(fetch_metrics(fd.url, 2), 0.0), ctl=None,
                            gpus=[0], clock=clock, gpu_uuids=[nvml.gpus[0].uuid], out_dir=tmp_path / "d")
        runner.start()
        _drive(runner, clock, 5)
        nvml.gpus[0].set_limit_w(250)
        _drive(runner, clock, 8)
        runner.stop_row()
    rows = [r for r in pq.read_table(tmp_path / "d").to_pylist() if r["action"] not in ("start", "stop")]
    want = {300: 1.0, 250: 1.3}
    assert {r["from_level"] for r in rows} == {300, 250}, rows
    assert all(r["j_per_token"] == pytest.approx(want[r["from_level"]]) for r in rows), \
        [(r["from_level"], r["j_per_token"]) for r in rows]


def test_a_dry_run_that_never_read_the_daemon_says_so_in_its_stop_row(tmp_path, caplog):
    # The hostile battery's: a wrong --daemon-metrics (nothing listening, or /health) ran its --duration out and exited
    # 0, its dataset the start and stop rows alone, no word at the end. Now its stop row and the log say it.
    import logging

    def unread():
        raise ObserveError("http://127.0.0.1:9/metrics was not read: connection refused")

    clock = Clock()
    runner = TuneRunner(_cfg(dry_run=True), unread, ctl=None, gpus=[0], out_dir=tmp_path / "decisions", clock=clock)
    runner.start()
    _drive(runner, clock, 3)
    with caplog.at_level(logging.WARNING):
        runner.stop_row()
    stop = pq.read_table(tmp_path / "decisions").to_pylist()[-1]
    assert stop["action"] == "stop" and "no figures were ever read from the daemon" in stop["reason"], stop
    assert any("nothing was judged" in r.getMessage() for r in caplog.records)
