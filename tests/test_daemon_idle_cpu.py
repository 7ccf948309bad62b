"""The idle daemon's accounting loop does no work a reader cannot see: the /metrics snapshot is built once per new
sample and at each scrape, not at every one of the loop's four passes a sampling interval (issue 13's CPU target)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

import powerprof.daemon.service as service
from powerprof.daemon.config import load_config
from powerprof.daemon.ledger import Ledger
from powerprof.daemon.reconcile import LAG_S
from powerprof.daemon.service import Daemon
from powerprof.rig import Rig
from powerprof.sim.nvml import SimNVML


def _daemon(tmp_path, interval_s: float) -> Daemon:
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": interval_s, "daemon.flush_interval_s": 30.0,
        "proxy.listen": "", "metrics.listen": "127.0.0.1:0", "daemon.restore_on_start": False,
    })
    return Daemon(cfg, Rig("a100-40g", gpus=[0, 1], nvml=SimNVML("a100-40g", count=2, state_path=None)))


async def _wait(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_idle_passes_do_not_rebuild_the_snapshot_and_a_scrape_reads_the_state_of_its_moment(tmp_path, monkeypatch):
    d = _daemon(tmp_path, interval_s=1.0)
    builds, passes, gpu_samples = [0], [0], [0]
    real_snapshot, real_advance = service.Snapshot, None  # the loop's own, counted

    def counted_snapshot(*a, **k):
        builds[0] += 1
        return real_snapshot(*a, **k)

    monkeypatch.setattr(service, "Snapshot", counted_snapshot)
    real_on_sample = d._on_sample

    def on_sample(s):
        if s.source == "nvml":
            gpu_samples[0] += 1
        real_on_sample(s)

    d._on_sample = on_sample  # subscribed by run(): counts the sampler's NVML ticks

    async def main():
        nonlocal real_advance
        task = asyncio.create_task(d.run())
        await _wait(lambda: "metrics" in d.urls and d.ledger is not None)
        real_advance = d.ledger.advance

        def advance(*a, **k):
            passes[0] += 1
            return real_advance(*a, **k)

        d.ledger.advance = advance
        await _wait(lambda: passes[0] >= 1)
        b0, s0, p0 = builds[0], gpu_samples[0], passes[0]
        await _wait(lambda: passes[0] >= p0 + 12)  # three seconds of passes at 4 Hz
        b1, s1, p1 = builds[0], gpu_samples[0], passes[0]
        # A scrape reads the daemon's state at that moment, not a snapshot up to a pass old.
        d.requests_by_tag[("probe-tag", "ok")] += 7
        async with aiohttp.ClientSession() as http:
            async with http.get(d.urls["metrics"] + "/metrics") as resp:
                text = await resp.text()
        d.stop_event.set()
        return (b1 - b0, s1 - s0, p1 - p0), text, await task

    (built, sampled, passed), text, rc = asyncio.run(asyncio.wait_for(main(), 90))
    assert rc == 0
    # At most two builds a sampling interval (the pass that drains its sample, the pass that closes its interval),
    # plus one at the edge of the count; never one per pass (12 passes, about 3 samples).
    assert passed >= 12 and built <= 2 * sampled + 1, (built, sampled, passed)
    probe = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.labels.get("tag") == "probe-tag" and s.name.startswith("powerprof_requests")]
    assert probe == [7.0], probe


def _cpu_energy_whole_history(led, t):
    """The interval CPU energy as computed from the whole RAPL history (the code before it read only the recent reads)."""
    from powerprof.energy import epoch_broken, interp_at, unwrap_resets

    ct = np.fromiter(led.cpu_t, dtype=np.int64)
    ce = unwrap_resets(np.fromiter(led.cpu_e, dtype=float))
    out = np.diff(np.array([interp_at(ct, ce, int(x)) for x in t]))
    out[epoch_broken(ct, np.fromiter(led.cpu_epoch, dtype=np.int64), t[:-1], t[1:])] = np.nan
    return out


def _edge_delays_whole_history(led, edges, reach_ns):
    """The proxy's delay bounds at each edge from every measure kept (the code before it read only the recent ones)."""
    dt = np.array([t for t, _ in led.recon.delays], dtype=np.int64)
    dx = np.array([x for _, x in led.recon.delays], dtype=float)
    stood = dt - np.rint(dx * 1e9).astype(np.int64)
    most, least = [], []
    for s, i, j in zip(edges.tolist(), np.searchsorted(dt, edges, "left").tolist(),
                       np.searchsorted(dt, edges + reach_ns, "right").tolist()):
        if j <= i:
            most.append(None)
            least.append(None)
            continue
        near = [float(dx[i])] + ([float(dx[i - 1])] if i > 0 and dt[i - 1] >= s - reach_ns else [])
        inside = stood[i:j] <= s
        still = float((dt[i:j][inside] - s).max()) / 1e9 if inside.any() else 0.0
        most.append(min(max(max(near), still), LAG_S))
        least.append(min(max(min(near), still), LAG_S))
    return most, least


def test_a_long_running_daemons_closes_read_only_recent_history_with_the_same_figures():
    """An hour of RAPL reads and of the proxy's delays (their histories full): each close reads only the tail it needs
    (the idle cost no longer grows with uptime), and the CPU energy and the bypass lag bounds are those of the whole
    history, across a counter reset, an epoch change and a stall of the proxy's loop."""
    led = Ledger("d", 0, 1, lambda *a: None, rapl=True)
    s = 10**9
    rng = np.random.default_rng(7)
    e, epoch = 0.0, 0
    for k in range(5000):  # past the history's 4096: the oldest have left it
        e = 3.0 if k == 4500 else e + 40.0 + rng.random()  # a reset (the counter restarts near zero)
        epoch += k == 4700  # a dropped delta
        led.cpu_t.append(k * s + int(rng.integers(0, 1000)))
        led.cpu_e.append(e)
        led.cpu_epoch.append(epoch)
    for k in range(20000):
        led.recon.delays.append((k * s // 4, 0.9 if 19000 <= k < 19004 else float(rng.random()) * 0.01))
    for t0 in (100, 4400, 4498, 4699, 4990, 4999):
        t = np.array([t0 * s + s // 3 + k * s for k in range(4)], dtype=np.int64)
        # The same NaNs; the values to rounding (after a reset every cumulative value carries its offset, 1e-13 apart)
        np.testing.assert_allclose(led._cpu_energy(t), _cpu_energy_whole_history(led, t), rtol=1e-9)
    for t0 in (0, 4000, 4749, 4990, 5010):
        edges = np.array([t0 * s + k * s // 2 for k in range(5)], dtype=np.int64)
        assert led.recon.edge_delays_s(edges, s) == _edge_delays_whole_history(led, edges, s)


def test_a_close_whose_counters_are_all_exact_has_each_gpus_own_energy_and_method():
    # The all-exact close takes every GPU's counter differences at once (the call per GPU was 0.4 ms of an idle close's
    # ~3 ms): the same energies, to the bit, and the same methods as `interval_energy_j` per GPU.
    from powerprof.daemon import attribution as attr
    from powerprof.daemon.ledger import _Edge
    from powerprof.profiler import METHOD_COUNTER

    rng = np.random.default_rng(7)
    led = Ledger("d", 0, 8, lambda *a: None)
    t = np.cumsum(rng.integers(900_000_000, 1_100_000_000, 4)).astype(np.int64)
    counters = np.cumsum(rng.uniform(40.0, 400.0, (4, 8)), axis=0) + rng.uniform(1e3, 1e6, 8)
    edges = [_Edge(int(t[k]), int(t[k]), counters[k], rng.uniform(40, 400, 8), (300.0,) * 8, np.zeros(8, np.int64))
             for k in range(4)]
    got_t, per_gpu, methods = led._energy(edges)
    assert got_t.tolist() == t.tolist() and methods == [METHOD_COUNTER] * 3
    for g in range(8):
        want, exact = attr.interval_energy_j(counters[:, g], t, np.array([e.power_w[g] for e in edges]),
                                             np.ones(3, bool))
        assert exact.all() and per_gpu[:, g].tolist() == want.tolist()


def _recording(asked: list, who_of=None):
    """A sleep_on_grid that records (who, period, its deadline, when it ended, whether a waker could end it)."""
    import sys

    import powerprof.daemon.ticks as ticks

    def recording(who):
        async def sleep(period_s, waker=None):
            loop = asyncio.get_running_loop()
            caller = sys._getframe(1).f_code.co_name  # the loop that sleeps
            now = loop.time()
            d = await ticks.sleep_on_grid(period_s, waker)
            asked.append((who if who != "daemon" else caller, period_s, now + period_s - now % period_s, loop.time(),
                          waker is not None))
            return d
        return sleep
    return recording


def test_the_idle_daemons_periodic_loops_wake_on_one_grid(tmp_path, monkeypatch):
    # Each wake-up of the idle loop costs its thread CPU whatever it runs: the accounting loop (4 a second), the scrape
    # loop (4) and the connection guard (1) each slept a period after their own work and drifted apart, 9 wake-ups a
    # second. Each now sleeps to the next multiple of its period on the loop's clock: their instants coincide. Idle (no
    # request, no tag; the server's counter still) the accounting and scrape loops sleep a whole second (ticks.py).
    import powerprof.daemon.guard as guard
    import powerprof.daemon.scrape as scrape

    monkeypatch.setattr(scrape, "STILL_S", 0.5)  # still from half a second on (5 s)
    asked: list = []
    recording = _recording(asked)
    monkeypatch.setattr(service, "sleep_on_grid", recording("daemon"))
    monkeypatch.setattr(guard, "sleep_on_grid", recording("guard"))
    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 30.0,
        "proxy.listen": "127.0.0.1:0", "proxy.upstream": "http://127.0.0.1:9", "metrics.listen": "",
        "daemon.restore_on_start": False, "proxy.header_timeout_s": 2.0,
    })
    d = Daemon(cfg, Rig("a100-40g", gpus=[0], nvml=SimNVML("a100-40g", count=1, state_path=None)))

    async def main():
        task = asyncio.create_task(d.run())
        await _wait(lambda: sum(1 for w, p, *_ in asked if w == "_tick_loop" and p == 1.0) >= 3
                    and sum(1 for w, p, *_ in asked if w == "_scrape_loop" and p == 1.0) >= 3
                    and any(w == "guard" for w, *_ in asked))
        d.stop_event.set()
        return await task

    assert asyncio.run(asyncio.wait_for(main(), 90)) == 0
    periods = {(w, p) for w, p, *_ in asked}
    assert ("_tick_loop", 1.0) in periods and ("_scrape_loop", 1.0) in periods and ("guard", 0.5) in periods, periods
    # Every deadline on the 0.25 s grid, which the others are part of.
    for who, period, deadline, *_ in asked:
        assert abs(deadline - 0.25 * round(deadline / 0.25)) < 1e-3, (who, period, deadline)


def test_a_request_ends_the_idle_loops_sleep_at_once(tmp_path, monkeypatch):
    # The idle accounting and scrape loops sleep a second; a request through the proxy must not wait for their next
    # pass to get the fast periods (its intervals closed at the quarter second, the server scraped every 0.25 s while it
    # runs): its arrival ends both sleeps (Daemon.waker).
    import powerprof.daemon.scrape as scrape
    from powerprof.sim.server import SimServer
    from support import free_port

    monkeypatch.setattr(scrape, "STILL_S", 0.5)
    asked: list = []
    monkeypatch.setattr(service, "sleep_on_grid", _recording(asked)("daemon"))
    with SimServer(SimNVML("a100-40g", state_path=None), decode_tok_s=50.0, prefill_tok_s=2000.0) as srv:
        port = free_port()
        cfg = load_config(None, env={}, overrides={
            "daemon.data_dir": str(tmp_path / "data"), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 30.0,
            "proxy.listen": f"127.0.0.1:{port}", "proxy.upstream": srv.url, "metrics.listen": "",
            "daemon.restore_on_start": False,
        })
        d = Daemon(cfg, Rig("a100-40g", gpus=[0], nvml=SimNVML("a100-40g", count=1, state_path=None)))

        async def main():
            loop = asyncio.get_running_loop()
            task = asyncio.create_task(d.run())
            await _wait(lambda: sum(1 for w, p, *_ in asked if w == "_tick_loop" and p == 1.0) >= 2
                        and sum(1 for w, p, *_ in asked if w == "_scrape_loop" and p == 1.0) >= 2)
            # Half-way between two of the idle loops' wake-ups.
            await asyncio.sleep((0.5 - loop.time() % 1.0) % 1.0 or 1.0)
            t_sent = loop.time()
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/completion",
                                  json={"prompt": "the power", "n_predict": 20, "stream": True}) as r:
                    assert r.status == 200
                    await r.read()
            d.stop_event.set()
            await task
            return t_sent

        t_sent = asyncio.run(asyncio.wait_for(main(), 90))
    for loop_name in ("_tick_loop", "_scrape_loop"):
        cut = [(p, dl, end) for w, p, dl, end, woken in asked if w == loop_name and woken and t_sent <= end < dl - 0.1]
        assert cut, (loop_name, t_sent, [a for a in asked if a[0] == loop_name][-6:])  # its idle sleep ended early
        fast = [end for w, p, dl, end, _ in asked if w == loop_name and p == 0.25 and end > t_sent]
        assert fast, loop_name  # then at the fast period while the request ran


def test_an_idle_sleep_ended_by_the_waker_returns_the_sleep_until_the_wake_not_the_loops_lateness_after_it():
    # The accounting loop takes (its time asleep - what sleep_on_grid returns) as the proxy's loop lateness
    # (note_proxy_delay, read by the ledger's bypass-lag check). Woken early, it returned the time until it ran again:
    # a loop that stalled between the wake (a request's arrival) and that pass measured 0 s late for it.
    from powerprof.daemon.ticks import Waker, sleep_on_grid

    async def main():
        loop = asyncio.get_running_loop()
        waker = Waker()

        def wake_then_stall():
            waker.wake()
            time.sleep(0.3)  # the loop busy after the wake (a burst of arrivals, a slow callback)

        loop.call_later(0.1, wake_then_stall)
        asleep = time.monotonic()
        slept = await sleep_on_grid(10_000.0, waker)  # a grid point far off: only the waker ends it
        return slept, time.monotonic() - asleep - slept

    slept, late = asyncio.run(main())
    assert 0.05 <= slept < 0.25 and late >= 0.25, (slept, late)


def test_the_idle_accounting_loop_passes_often_enough_for_a_short_systemd_watchdog(monkeypatch):
    # The watchdog is pinged from the accounting loop's passes, every WatchdogSec/2. Idle, the loop passes once a
    # second: with WatchdogSec=2 s a ping could come 2 s after the last one (a pass a hair short of the ping's time, the
    # next a second later) and systemd killed an idle daemon; at 4 passes a second it held down to ~0.6 s.
    import types

    from powerprof.daemon.ticks import Waker

    asked: list[float] = []

    async def sleep(period_s, waker=None):
        asked.append(period_s)
        me.stop_event.set()
        return period_s

    monkeypatch.setattr(service, "sleep_on_grid", sleep)
    ledger = types.SimpleNamespace(requests={}, tags={}, closed_tags=[], edges=[], advance=lambda *a: None)
    me = types.SimpleNamespace(cfg=types.SimpleNamespace(get=lambda sec, key: 1.0), ledger=ledger, proxy=None,
                               waker=Waker(), reload_requested=False, _drain=lambda: 0, _update_snapshot=lambda: None,
                               _watchdog=lambda now: None, _wd_period=1.0)  # WatchdogSec=2

    async def run(wd_period):
        me._wd_period = wd_period
        me.stop_event = asyncio.Event()
        await Daemon._tick_loop(me)

    asyncio.run(run(None))
    assert asked[-1] == 1.0  # no watchdog: once a second
    asyncio.run(run(1.0))
    assert asked[-1] <= 0.5, asked  # at most half the ping period: a ping is never a whole period late
    asyncio.run(run(60.0))
    assert asked[-1] == 1.0
