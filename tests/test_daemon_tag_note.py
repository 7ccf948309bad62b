"""A tag row says why a figure of it is empty or may be partial (its `energy_note`), as request and interval rows do.

Before, a tag row had no note column: a null `cpu_energy_j` (no RAPL on the host, or a RAPL read missing), a null
`gpu_energy_j` (a GPU unread), a null `gpu_j_per_token` (no proxied tokens), GPU energy integrated from power readings,
a `server_count` saying bypass traffic may be undercounted, a window cut by the daemon's shutdown: nothing in the row
said why, or the fix (docs/data.md, daemon_tags; docs/daemon.md, Datasets)."""

from __future__ import annotations


import pytest
from click.testing import CliRunner

from powerprof.cli import main
from powerprof.collectors.cputime import CpuTimeReading
from powerprof.collectors.rapl import RaplReading
from powerprof.daemon.ledger import Ledger
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.streams import Counts
from powerprof.daemon.ticks import Waker

from support import LedgerReading as R, RowSink as Sink  # noqa: E402

S = 1_000_000_000


def _gpu(led, t_s, energy_j, power_w=300.0):
    led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(energy_j, power_w)])


def _cpu(led, t_s, cpu_j, host_s=None, server_s=None):
    """A RAPL read (package energy) and, where given, a CPU-time read at `t_s`, as the sampler's ticks give them."""
    led.add_rapl_sample(int(t_s * S), [RaplReading("package-0", "package", 0, cpu_j, None)])
    if host_s is not None:
        led.add_cputime_sample(int(t_s * S), CpuTimeReading(host_s, server_s, 0.0))


def _request(led, t0_s, t1_s, n=10):
    """A proxied request live over [t0, t1], decoding n tokens, ended and counted."""
    tr = RequestTrace(1, "POST", "/completion", "t", int(t0_s * S), 0, api="llamacpp", stream=True)
    led.on_start(tr)
    tr.first_ns = int((t0_s + 0.05) * S)
    for j in range(n):
        led.on_tokens(tr, int((t0_s + 0.05 + (t1_s - t0_s - 0.1) * j / n) * S), 1)
    tr.last_ns, tr.end_ns = int((t1_s - 0.05) * S), int(t1_s * S)
    tr.counts = Counts(generated_tokens=n, prompt_tokens=10, model=None, stop_reason=None, token_source="usage")
    led.on_end(tr)


def _tag(led, sink, seconds=3, rapl=None, request=True, gpu=None):
    """A tag "job" over [0, seconds] s of 300 W on one GPU, a request inside it; `rapl(k)` feeds RAPL at second k."""
    led.open_tag("job", 0, 0)
    for k in range(seconds + 1):
        if rapl is not None:
            rapl(k)
        (gpu or _gpu)(led, k, 300.0 * k)
    if rapl is not None:
        rapl(seconds + 1)  # a RAPL read past the window's end: its last interval is not held for one
    if request:
        _request(led, 0.2, seconds - 0.2)
    led.close_tag("job", seconds * S, seconds * S)
    led.advance(int((seconds + 3) * S))
    (row,) = sink.rows["tags"]
    return row


def test_a_tag_without_rapl_says_why_its_cpu_energy_is_empty():
    # The daemon on a host without RAPL (or RAPL not readable): every tag's cpu_energy_j is null, and nothing said why.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)  # no RAPL on this host
    row = _tag(led, sink)
    assert row["gpu_energy_j"] == pytest.approx(900.0) and row["cpu_energy_j"] is None
    note = row.get("energy_note")
    assert note and "CPU energy not read" in note and "no RAPL" in note and "fix:" in note, row


def test_a_tag_a_rapl_read_is_missing_in_says_why_its_cpu_energy_is_empty():
    # RAPL read at 0 and 1 s, then its reads stop: the window's later intervals have no CPU energy, so the tag's is
    # null (a sum of the rest would be too small: 30 J of the window's 90 J), and the row said nothing of why.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, rapl=True, rapl_hold_s=0.5)
    row = _tag(led, sink, rapl=lambda k: _cpu(led, k - 0.001, 30.0 * k) if k <= 1 else None)
    assert row["cpu_energy_j"] is None and row["gpu_energy_j"] == pytest.approx(900.0)
    note = row.get("energy_note") or ""
    assert note.startswith("CPU energy unknown") and "this window" in note and "RAPL" in note and "fix:" in note, row
    # the same words the interval rows use for the same cause (one builder)
    iv_notes = [r["energy_note"] for r in sink.rows["intervals"] if r["cpu_energy_j"] is None]
    assert iv_notes and all(n.split(" (")[0].split(" covered")[0] == note.split(" covered")[0] for n in iv_notes)


def test_a_whole_tag_says_nothing():
    # RAPL and the host's CPU time read, a counter, tokens through the proxy, no server scraped (server_count off:
    # said by that column alone, as interval rows do): every figure whole, so no note.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, rapl=True)
    row = _tag(led, sink, rapl=lambda k: _cpu(led, k - 0.001, 30.0 * k, 1.05 * k, 1.0 * k))
    assert row["cpu_energy_j"] == pytest.approx(90.0) and row["other_cpu_pct"] is not None
    assert row["gpu_j_per_token"] is not None and row["energy_method"] == "counter"
    assert row["server_count"] == "off" and row["closed_by"] == "stop"
    assert row.get("energy_note", "missing") is None, row


def test_a_tag_a_gpu_gave_no_energy_for_says_why_once():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)

    def lost(led, t_s, energy_j):  # the GPU falls off the bus after 1 s
        led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(None, None) if t_s >= 2 else R(energy_j, 300.0)])

    row = _tag(led, sink, gpu=lost)
    assert row["gpu_energy_j"] is None and row["gpu_j_per_token"] is None and row["unproxied_energy_j"] is None
    note = row["energy_note"]
    assert note.startswith("GPU energy unknown") and "this window" in note and "fix:" in note, note
    assert "J/token" not in note  # the J/token is empty for the same reason: said once


def test_a_tag_without_proxied_tokens_says_why_it_has_no_j_per_token():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    row = _tag(led, sink, request=False)
    assert row["proxy_tokens"] == 0 and row["gpu_j_per_token"] is None and row["gpu_energy_j"] == pytest.approx(900.0)
    note = row["energy_note"]
    assert "no J/token" in note and "no tokens were seen through the proxy" in note and "fix:" in note, note


def test_a_tag_whose_server_count_may_be_low_says_so_with_the_fix():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True  # the server is scraped, but not read yet: its bypass traffic unknown
    row = _tag(led, sink)
    assert row["server_count"] == "unread"
    note = row["energy_note"]
    assert "bypass-uncounted" in note and "unread" in note and "fix: start the server before the daemon" in note, note
    assert "unproxied_energy_j" in note and "gpu_j_per_token" in note


def test_a_tag_cut_by_the_daemons_shutdown_says_so():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.open_tag("job", 0, 0)
    for k in range(3):
        _gpu(led, k, 300.0 * k)
    _request(led, 0.2, 1.8)
    led.close_all(int(2.0 * S))
    (row,) = sink.rows["tags"]
    assert row["closed_by"] == "shutdown"
    note = row["energy_note"]
    assert "shutdown" in note and "powerprof tag stop" in note and "fix:" in note, note


def test_a_tag_named_as_a_flag_is_quoted_as_given_and_moves_no_figure_of_analyze(tmp_path):
    # A tag's name is the client's (the tag socket's: 1-128 of [A-Za-z0-9_.:@/-], so every flag analyze LIKE-matches is
    # one), and a window closed at shutdown quotes it in its note's fix. Quoted as given, not through
    # schema.outside_text: `powerprof tag stop NAME` runs as written, and no figure of analyze reads a tag row's note
    # (its tag table judges a window by server_count and its figures; requests' and intervals' notes never hold a tag's
    # name). Tried: the same window under each such flag's name reads the same as under "job", and the hosts' alike.
    from powerprof.analysis import fleet
    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import DatasetStore
    from powerprof.daemon.tagapi import check_name

    flags = sorted({v for k, v in vars(fleet).items() if k.endswith("_FLAG") and isinstance(v, str)})
    assert {"uncertain-uncounted", "bypass-uncounted", "no-counter-short", "before-first-read"} <= set(flags), flags

    def analysed(names):
        sink = Sink()
        led = Ledger("d", 0, 1, sink, grace_s=0.3)
        for name in names:
            led.open_tag(check_name(name), 0, 0)
        for k in range(3):
            _gpu(led, k, 300.0 * k)
        _request(led, 0.2, 1.8)
        led.close_all(int(2.0 * S))
        out = tmp_path / str(len(names))
        store = DatasetStore(out, datasets(), host="h")
        for table in ("requests", "intervals", "tags"):
            store.append(table, sink.rows[table])
        assert store.flush()
        tags = {r.pop("name"): r for r in fleet.tag_summary([str(out)]).to_pylist()}
        return fleet.fleet_summary([str(out)]).to_pylist(), tags, {r["name"]: r["energy_note"] for r in sink.rows["tags"]}

    hosts, tags, _ = analysed(["job"])
    flagged_hosts, flagged_tags, notes = analysed(["job", *flags])
    assert tags["job"]["counted_windows"] == 1 and tags["job"]["gpu_energy_j"] > 0, tags
    assert flagged_hosts == hosts, (flagged_hosts, hosts)
    for flag in flags:
        assert f"fix: powerprof tag stop {flag} before" in notes[flag], notes[flag]
        assert flagged_tags[flag] == tags["job"], (flag, flagged_tags[flag], tags["job"])


def test_a_tag_read_without_an_energy_counter_says_so():
    # A GPU with no counter (Pascal: instant power only): the window's energy is integrated from power readings.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    row = _tag(led, sink, gpu=lambda led, t_s, e: led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(None, 300.0)]))
    assert row["energy_method"] == "power_integration" and row["gpu_energy_j"] == pytest.approx(900.0)
    note = row["energy_note"]
    assert "without an energy counter" in note and "power readings" in note and "fix:" in note, note


def test_tag_stop_prints_the_rows_note_once(monkeypatch):
    # The daemon's answer carries the row's energy_note: `tag stop` prints it, and its own bypass line (for a daemon
    # older than the note) is not printed beside it: each fact once.
    import json

    import powerprof.daemon.tagapi as tagapi

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    row = _tag(led, sink, request=False)
    answer = {"ok": True, **{k: row[k] for k in ("name", "duration_s", "gpu_energy_j", "cpu_energy_j",
                                                 "unproxied_energy_j", "proxy_tokens", "gpu_j_per_token",
                                                 "server_count", "energy_note")}}
    monkeypatch.setattr(tagapi, "send_tag", lambda socket, action, name: answer)
    res = CliRunner().invoke(main, ["tag", "stop", "job", "--socket", "/nonexistent"])
    assert res.exit_code == 0, res.output
    assert "CPU energy not read" in res.stderr and "no J/token" in res.stderr, res.stderr
    assert res.stderr.count("bypass") == row["energy_note"].count("bypass"), res.stderr
    assert res.stderr.count("no tokens were seen") == 1 and "no tokens were seen" not in res.stdout, res.output
    d = json.loads(CliRunner().invoke(main, ["tag", "stop", "job", "--socket", "/nonexistent", "--json"]).stdout)
    assert d["energy_note"] == row["energy_note"]


def test_the_daemons_stop_answer_carries_the_note_and_none_while_not_final():
    import asyncio
    from types import SimpleNamespace

    from powerprof.daemon.service import Daemon

    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)

    async def edge(label):
        return (5 * S if "stop" in label else 1 * S), 0

    fake = SimpleNamespace(waker=Waker(), ledger=led, _edge=edge, cfg=SimpleNamespace(get=lambda sec, key: 0.01),
                           _lost_tags={}, _save_open_tags=lambda: None)
    asyncio.run(Daemon.tag_start(fake, "x"))
    out = asyncio.run(Daemon.tag_stop(fake, "x"))
    # not final: the note says so, and the row's energy_note (of sums so far) is not given
    assert "not final" in out["note"] and "energy_note" in out and out["energy_note"] is None
    led = Ledger("d", 0, 1, Sink(), grace_s=0.1)
    for k in range(6):  # samples up to 5 s, not yet closed: the window's answer waits for them
        _gpu(led, k, 300.0 * k)
    fake = SimpleNamespace(waker=Waker(), ledger=led, _edge=edge, cfg=SimpleNamespace(get=lambda sec, key: 0.01),
                           _lost_tags={}, _save_open_tags=lambda: None)

    async def stop():
        async def sampler():  # the daemon's next sample closes the window's intervals
            await asyncio.sleep(0.01)
            _gpu(led, 6, 1800.0)
            led.advance(int(6.5 * S))

        task = asyncio.create_task(sampler())
        out = await Daemon.tag_stop(fake, "x")
        await task
        return out

    asyncio.run(Daemon.tag_start(fake, "x"))
    out = asyncio.run(stop())
    assert out["gpu_energy_j"] == pytest.approx(1200.0) and "no RAPL" in out["energy_note"], out


def test_a_tag_with_no_interval_inside_is_unknown_not_zero():
    # A window between two samples 1 s apart, shorter than half of it (its edges' on-demand reads failed, so no edge
    # of its own): no interval's midpoint is inside, so it gathered nothing. Before: gpu_energy_j 0.0 at 300 W, said
    # nowhere.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _gpu(led, 0, 0.0)
    led.open_tag("blink", int(0.1 * S), int(0.1 * S))
    led.close_tag("blink", int(0.3 * S), int(0.3 * S))
    _gpu(led, 1, 300.0)
    _gpu(led, 2, 600.0)
    led.advance(int(5 * S))
    (row,) = sink.rows["tags"]
    assert row["gpu_energy_j"] is None and row["gpu_j_per_token"] is None and row["cpu_energy_j"] is None, row
    note = row["energy_note"]
    assert note.startswith("no interval inside") and "fix:" in note and "no J/token" not in note, note


def test_a_tag_open_at_a_shutdown_before_any_sample_ends_at_the_wall_clock_not_1970():
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.open_tag("early", int(0.1 * S), 1_764_000_000 * S)
    led.close_all(int(0.5 * S), 1_764_000_000 * S + int(0.4 * S))
    (row,) = sink.rows["tags"]
    assert row["t_end_utc"] == 1_764_000_000 * S + int(0.4 * S) and row["closed_by"] == "shutdown", row
    assert row["gpu_energy_j"] is None and "no interval inside" in row["energy_note"], row


def test_a_tag_says_when_its_unproxied_energy_is_count_less_streams_surplus(tmp_path):
    # Streams asking no usage, several tokens a chunk (the simulated vLLM's speculative steps): the proxy counts one a
    # chunk, the server's counter more, and the surplus's energy lands in the window's unproxied_energy_j. `tag stop`
    # printed it as "bypass traffic" with every request proxied, its note silent (session 46's smoke walkthrough).
    import json as _json
    import subprocess
    import sys
    import urllib.request

    from daemon_helpers import DaemonProc, sim_env

    env = sim_env(tmp_path)
    d = DaemonProc(tmp_path / "data", "--simulate", "--interval", "0.25", "--flush-interval", "0.5", env=env)
    try:
        tag = [sys.executable, "-m", "powerprof.cli", "tag"]
        subprocess.run(tag + ["start", "plain", "--socket", d.info["tags"]], check=True, capture_output=True, timeout=30,
                       env=env)
        body = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        for _ in range(3):
            req = urllib.request.Request(d.info["proxy"] + "/v1/chat/completions", data=_json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            urllib.request.urlopen(req, timeout=60).read()
        stop = subprocess.run(tag + ["stop", "plain", "--socket", d.info["tags"], "--json"], capture_output=True,
                              text=True, timeout=60, env=env)
    finally:
        d.stop()
    out = _json.loads(stop.stdout)
    if not out["unproxied_energy_j"]:
        pytest.skip(f"the simulated server sent one token a chunk this time: nothing in unproxied to say ({out})")
    assert "request(s) in this window carried no token counts" in (out["energy_note"] or ""), out


def test_a_tag_window_shorter_than_the_h200_counters_refresh_is_measured_not_zero(tmp_path, monkeypatch):
    # An H200's energy counter refreshes every 100 ms: a window's edges read at its start and stop calls held one
    # refresh's value or two. Jobs of one 2-token stream (~45 ms) each in its own window read 0.000 J and 0 J/token in 3
    # of 8 windows, method counter, no note; 30-token jobs (~250 ms) 15-32% low (a hostile review against the
    # simulator's truth). Each edge is now held until the counter refreshed after it (daemon/tagedge.py): against the
    # simulator's truth between the window's start edge and its stop call, within a refresh's few joules.
    import asyncio
    import time

    import aiohttp

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer
    from powerprof.workload.replay import prompt_text

    nvml = SimNVML("h200-141g", state_path=None)
    srv = SimServer(nvml, flavour="vllm", n_slots=8, batching="continuous").start()
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 0.5, "daemon.flush_interval_s": 1.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": srv.url, "metrics.listen": "",
        "daemon.restore_on_start": False, "tags.socket": str(tmp_path / "pp.sock")})
    daemon = Daemon(cfg, Rig("h200-141g", nvml=nvml, host=False))
    gpu = nvml.gpus[0]
    got, edges, instants = [], [], []
    held_edge = daemon._edge

    async def edge(label):  # the truth at the window's own instants: its start edge, its stop call
        t, wall, stop, held = await held_edge(label)
        edges.append(gpu.recent_energy_at_j(t - int(stop.held_s * 1e9) if stop is not None else t))
        instants.append((t, stop.held_s if stop is not None else 0.0))  # a stop's: its held edge, its hold after the call
        return t, wall, stop, held

    daemon._edge = edge
    # Each counter refresh an edge's poll saw is dated between the reads around it (tagedge.wait_refresh): the energy
    # the GPU drew between the simulator's refresh (its counter on a grid of energy_counter_update_s) and that date is
    # what the date being off moves the window's figure by, at the power there.
    from powerprof.daemon import tagedge

    grid_ns = int(gpu.profile.energy_counter_update_s * 1e9)
    misdated_j, polled = [], tagedge.wait_refresh

    def wait_refresh(*args, **kwargs):
        out = polled(*args, **kwargs)
        for r in out[0] if out is not None else ():
            base = r.at_ns // grid_ns * grid_ns  # the grid instant whose energy the new value is
            true_ns = min((base + j * grid_ns for j in (-1, 0, 1)),
                          key=lambda t: abs(gpu.recent_energy_at_j(t) - r.value_j))
            misdated_j.append(abs(gpu.recent_energy_at_j(r.at_ns) - gpu.recent_energy_at_j(true_ns)))
        return out

    monkeypatch.setattr(tagedge, "wait_refresh", wait_refresh)

    async def go():
        task = asyncio.create_task(daemon.run())
        while "proxy" not in daemon.urls:
            assert not task.done(), "the daemon ended before it listened"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.6)
        async with aiohttp.ClientSession() as s:
            for k in range(6):
                n = 2 if k % 3 else 30
                misdated_j.clear()
                await daemon.tag_start(f"job{k}")
                body = {"messages": [{"role": "user", "content": prompt_text(300, 40000 + k)}], "max_tokens": n,
                        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
                async with s.post(daemon.urls["proxy"] + "/v1/chat/completions", json=body) as r:
                    await r.read()
                ans = await daemon.tag_stop(f"job{k}")
                (t0, _), (t1, held_s) = instants[-2:]
                got.append((k, n, edges[-1] - edges[-2], ans, (t1 - t0) / 1e9, held_s, sum(misdated_j)))
                await asyncio.sleep(0.13 + 0.03 * k)  # the next window at another phase of the refresh
        daemon.stop_event.set()
        await task

    try:
        asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        srv.stop()
    for k, n, true_j, ans, to_held_s, held_s, misdated in got:
        what = (k, n, round(true_j, 2), ans, to_held_s, held_s, round(misdated, 2))
        assert ans["gpu_energy_j"] is not None and ans["gpu_j_per_token"] is not None, what
        # A held edge's counter is a poll's few ms stale and the stop's trim placed at the power after it: ~1-2 J on a
        # 2-core host polling every few ms; before, -100% (0 J) to -35% on the 2-token jobs and -15..-32% on the
        # 30-token ones. A starved poll (beside CPU hogs: reads 10-100 ms apart, a read's own instant ms off) dates a
        # refresh up to 25 ms off, ~120 W there, and the window moves by the power there times that: 4 of 90 windows
        # over 25% or 3 J beside CPU hogs (-8.1 J of 28.6 J, -6.2 J of 17.4 J), unflagged. The row now bounds that from
        # its reads' dates and says edges-late where the bound is over 25% and 3 J (docs/daemon.md).
        late = "edges-late" in (ans["energy_note"] or "")
        assert late or abs(ans["gpu_energy_j"] - true_j) < max(0.25 * true_j, 3.0), what
        # To the stop call, not to its held edge (a poll to a refresh after it): the start edge to the held stop edge,
        # less its hold. Not a fixed bound (it was < 0.2 s for a 2-token job, ~45 ms quiet): a loaded host stretches
        # the job, and the window with it (0.20-0.30 s in 3 of 16 runs beside two CPU hogs).
        assert held_s > 0 and ans["duration_s"] == pytest.approx(to_held_s - held_s, abs=1e-6), what


def test_a_short_tag_whose_edges_could_not_be_held_has_no_gpu_figure_not_zero():
    # A counter that did not move within the hold (stalled) leaves the edges read at the calls: a window under the
    # counter's refresh then read one refresh's value at both ends, 0 J. No figure, the reason and the fix.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _gpu(led, 0, 0.0)
    led.open_tag("blink", int(1.00 * S), int(1.00 * S), held=False)
    _gpu(led, 1.0, 300.0)
    _gpu(led, 1.05, 300.0)  # its stop edge: the same refresh's value
    led.close_tag("blink", int(1.05 * S), int(1.05 * S), held=False)
    _request(led, 1.01, 1.04, n=2)
    _gpu(led, 2, 600.0)
    led.advance(int(5 * S))
    (row,) = sink.rows["tags"]
    assert row["gpu_energy_j"] is None and row["gpu_j_per_token"] is None and row["energy_method"] == "none", row
    assert row["energy_note"].startswith("edges-unheld: shorter than the energy counter's refresh"), row["energy_note"]
    assert "fix:" in row["energy_note"]


def _scripted_edges(start_reads_s, stop_call_s, stop_reads_s, power_w=200.0, grid_s=0.1):
    """A tag window's held edges through tagedge's own polling, on a counter refreshing every `grid_s` at a steady
    `power_w`, read at the scripted instants (s: a start call at the first of `start_reads_s`, a stop call at
    `stop_call_s`); (its GPU energy as the daemon figures it, the truth from the start edge's read to the stop call,
    the start and stop edges as tagedge.StopEdge)."""
    import math

    from powerprof.collectors.nvml import CounterRead
    from powerprof.daemon import tagedge

    now = [0]
    script = []

    def read():
        t = now[0]
        got = CounterRead([power_w * grid_s * math.floor(t / S / grid_s + 1e-9)])
        got.t_mono_ns, got.t_half_ns = (t,), (0,)
        return t, t, got

    def sleep(_s):
        now[0] = script.pop(0)

    def held(reads_s):
        script[:] = [int(t * S) for t in reads_s[1:]]
        now[0] = int(reads_s[0] * S)
        return read()

    first = held(start_reads_s)
    r1 = tagedge.wait_refresh(read, tuple(first[2]), first[2].t_mono_ns, lambda: now[0], sleep)
    r2 = tagedge.wait_refresh(read, tuple(f.value_j for f in r1[0]), tagedge.still_at(r1[1], r1[0]), lambda: now[0],
                              sleep)
    start = tagedge.StopEdge(tagedge.start_trim_j(r1[0], r2[0], r2[1]), 0.0,
                             tagedge.start_misdated_j(r1[0], r2[0], r2[1]), tagedge.off_ms(r1[0], r2[0]))
    t_start = r2[1][0]
    call = held([stop_call_s] + list(stop_reads_s))
    s1 = tagedge.wait_refresh(read, tuple(call[2]), call[2].t_mono_ns, lambda: now[0], sleep)
    s2 = tagedge.wait_refresh(read, tuple(f.value_j for f in s1[0]), tagedge.still_at(s1[1], s1[0]), lambda: now[0],
                              sleep)
    at0 = call[2].t_mono_ns
    stop = tagedge.StopEdge(tagedge.stop_trim_j(at0, tuple(call[2]), s1[0], s2[0], tuple(s1[1][2])),
                            (s1[1][0] - at0[0]) / S, tagedge.stop_misdated_j(at0, tuple(call[2]), s1[0], s2[0]),
                            tagedge.off_ms(s1[0], s2[0]))
    gpu_j = s1[1][2][0] - r2[1][2][0] - start.trim_j[0] - stop.trim_j[0]
    return gpu_j, power_w * (stop_call_s - t_start / S), start, stop, (t_start, s1[1][0])


def _polls(t0_s, t1_s, every_s=0.002):
    return [round(t0_s + k * every_s, 6) for k in range(int(round((t1_s - t0_s) / every_s)) + 1)]


@pytest.mark.parametrize("starved", [False, True])
def test_a_tag_window_whose_edge_reads_came_late_says_how_far_its_energy_may_be_off(starved):
    # Beside CPU hogs the daemon's counter polls came 10-100 ms apart, so the refresh an edge holds was dated up to
    # 25 ms off: 2-token windows on a simulated H200 read -8.1 J of 28.6 J and -6.2 J of 17.4 J, unflagged. Here a
    # 40 ms window at 200 W (8 J): the read before the start edge's second refresh (at 0.2 s) comes at 0.197 s and
    # the next only at 0.249 s, so that refresh is dated 0.223 s and the start trim's power is off with it. Before:
    # 13.6 J for 8 J (+70%), no note; now the row says edges-late, with how far off it may be. Polled every 2 ms
    # (quiet), the same window is within 1% and says nothing.
    start_reads = _polls(0.005, 0.197) + (_polls(0.249, 0.4) if starved else _polls(0.199, 0.4))
    gpu_j, true_j, start, stop, (t0_ns, t1_ns) = _scripted_edges(start_reads, 0.289 if starved else 0.239,
                                                                 _polls(0.291, 0.5))
    misdated_j = sum(start.misdated_j) + sum(stop.misdated_j)
    assert abs(gpu_j - true_j) <= misdated_j + 1e-9, (gpu_j, true_j, misdated_j)  # the bound holds
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _gpu(led, 0, 0.0, 200.0)
    led.add_gpu_edge(t0_ns, t0_ns, [200.0 * t0_ns / S])  # the edges as the daemon's: counters-only reads
    led.open_tag("job", t0_ns, t0_ns, held=True, start_edge=start)
    _request(led, t0_ns / S + 0.001, t1_ns / S - stop.held_s - 0.001, n=2)
    led.add_gpu_edge(t1_ns, t1_ns, [200.0 * t1_ns / S])
    led.close_tag("job", t1_ns, t1_ns, stop_edge=stop, held=True)
    for k in range(1, 4):
        _gpu(led, k, 200.0 * k, 200.0)
    led.advance(int(6 * S))
    (row,) = sink.rows["tags"]
    note = row["energy_note"] or ""
    if starved:
        assert abs(gpu_j - true_j) > max(0.25 * true_j, 3.0), (gpu_j, true_j)  # off beyond the tags' tolerance
        assert note.startswith("edges-late: the daemon's counter reads at this window's edges came far apart"), row
        assert "dated only to within 26 ms" in note and "may be off by up to" in note and "fix:" in note, note
        assert row["gpu_energy_j"] is not None  # kept, and said
    else:
        assert abs(gpu_j - true_j) < 0.01 * true_j and misdated_j < 1.0, (gpu_j, true_j, misdated_j)
        assert "edges-late" not in note, note


def test_a_tag_window_whose_refreshes_dates_could_span_a_refresh_says_its_energy_is_unbounded_not_a_number():
    # Driver calls stalled inside the reads (a loaded host) date a start edge's two refreshes, 100 ms apart, to within
    # 50 and 60 ms: the power over them is unbounded. A 1 ms floor on their span said "up to 316 J" of a 14 J window
    # (seen beside other tests), a number no bound supports. Now: off by any amount, and why.
    from powerprof.daemon import tagedge

    r1, r2 = tagedge.Refresh(0, 20.0, 50_000_000), tagedge.Refresh(100_000_000, 40.0, 60_000_000)
    from powerprof.collectors.nvml import CounterRead

    edge = CounterRead([40.0])
    edge.t_mono_ns = (110_000_000,)
    (bound_j,) = tagedge.start_misdated_j([r1], [r2], (110_000_000, 0, edge))
    assert bound_j == float("inf")
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _gpu(led, 0, 0.0, 200.0)
    led.add_gpu_edge(int(0.11 * S), int(0.11 * S), [22.0])
    led.open_tag("job", int(0.11 * S), int(0.11 * S), held=True,
                 start_edge=tagedge.StopEdge((0.0,), 0.0, (bound_j,), 60.0))
    _request(led, 0.12, 0.3, n=2)
    led.add_gpu_edge(int(0.31 * S), int(0.31 * S), [62.0])
    led.close_tag("job", int(0.31 * S), int(0.31 * S), stop_edge=tagedge.StopEdge((0.0,), 0.0, (0.1,), 1.0), held=True)
    for k in range(1, 4):
        _gpu(led, k, 200.0 * k, 200.0)
    led.advance(int(6 * S))
    (row,) = sink.rows["tags"]
    assert "edges-late" in row["energy_note"] and "may be off by any amount" in row["energy_note"], row
    assert "inf" not in row["energy_note"], row["energy_note"]


def test_a_tag_windows_edges_late_share_is_of_the_least_it_may_hold_not_of_its_own_figure():
    # A 40 J window whose edges may be 9 J off may truly hold 31 J: 9 J is 29% of that. Held to 25% of its own 40 J
    # (10 J) it said nothing: an over-read figure widened its own allowance.
    from powerprof.daemon import tagedge

    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    _gpu(led, 0, 0.0, 200.0)
    led.add_gpu_edge(int(0.11 * S), int(0.11 * S), [22.0])
    led.open_tag("job", int(0.11 * S), int(0.11 * S), held=True, start_edge=tagedge.StopEdge((0.0,), 0.0, (9.0,), 20.0))
    _request(led, 0.12, 0.3, n=2)
    led.add_gpu_edge(int(0.31 * S), int(0.31 * S), [62.0])
    led.close_tag("job", int(0.31 * S), int(0.31 * S), stop_edge=tagedge.StopEdge((0.0,), 0.0, (0.0,), 1.0), held=True)
    for k in range(1, 4):
        _gpu(led, k, 200.0 * k, 200.0)
    led.advance(int(6 * S))
    (row,) = sink.rows["tags"]
    assert row["gpu_energy_j"] == pytest.approx(40.0), row
    assert "edges-late" in (row["energy_note"] or "") and "up to 9 J" in row["energy_note"], row
