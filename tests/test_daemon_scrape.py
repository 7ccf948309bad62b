"""Parsing the servers' own token counters, and when the daemon scrapes them."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest

from powerprof.daemon.scrape import (
    Cadence, Scraper, burst_start_ns, counter_total, histogram_sum_count, llamacpp_generated, slot_progress, slot_tasks,
    slots_delta)
from powerprof.daemon.ticks import Waker

VLLM = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="a"} 1200.0
vllm:generation_tokens_total{model_name="b"} 34.0
# HELP vllm:num_requests_running Number of requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 3.0
"""

SGLANG = """# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 77.0
"""


def test_counter_sums_label_sets_and_is_none_when_absent():
    assert counter_total(VLLM, "vllm:generation_tokens_total") == 1234.0
    assert counter_total(SGLANG, "sglang:generation_tokens_total") == 77.0
    assert counter_total(VLLM, "sglang:generation_tokens_total") is None


def test_llamacpp_slots_count_progress_and_new_tasks():
    a = slot_progress([{"id": 0, "id_task": 5, "n_decoded": 10}, {"id": 1, "id_task": 6, "n_decoded": 3}])
    b = slot_progress([{"id": 0, "id_task": 5, "n_decoded": 25}, {"id": 1, "id_task": 9, "n_decoded": 4}])
    # slot 0 moved 15; slot 1 started a new task that has decoded 4 so far
    assert slots_delta(a, b) == 19
    assert slots_delta(b, b) == 0
    assert slot_progress({"not": "a list"}) == {}


def test_an_idle_slot_is_not_in_flight_even_if_it_keeps_its_last_count():
    # llama-server resets n_decoded to 0 at the end of a request; older builds kept it.
    kept = slot_progress([{"id": 0, "id_task": 5, "is_processing": False, "next_token": [{"n_decoded": 300}]}])
    assert llamacpp_generated(1000.0, kept) == 1000.0
    busy = slot_progress([{"id": 0, "id_task": 5, "is_processing": True, "next_token": [{"n_decoded": 44}]}])
    assert llamacpp_generated(1000.0, busy) == 1044.0


class _Replay(Scraper):
    """A Scraper whose llama-server answers from a script of (counter or None, slots or None[, the counter read again
    after /slots: the first's if not given]), one step a scrape; `gets` lists every path asked."""

    def __init__(self, script):
        super().__init__(session=None, base_url="http://x", server="llamacpp")
        self.script = list(script)
        self.step = None
        self.gets: list[str] = []
        self._slots_read = False

    async def scrape(self):
        self._slots_read = False
        return await super().scrape()

    async def _get(self, path):
        self.gets.append(path)
        if path == "/metrics":
            if self._slots_read:  # read again in the same scrape (Scraper._scrape_llamacpp)
                self.read_at_third = self.read_ns  # what the count's stamp was when the counter was read again
                c = self.step[2] if len(self.step) > 2 else self.step[0]
            else:
                self.step = self.script.pop(0)
                c = self.step[0]
            return (200, f"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total {c}\n") if c is not None else (501, "")
        self._slots_read = True
        slots = self.step[1]
        return (200, json.dumps(slots)) if slots is not None else (501, "")


def _slot(task, n, busy=True):
    return [{"id": 0, "id_task": task, "is_processing": busy, "next_token": [{"n_decoded": n}]}]


def _run(sc, n):
    async def go():
        return [await sc.scrape() for _ in range(n)]

    return asyncio.run(go())


def test_llamacpp_counts_every_token_from_the_counter_plus_slots():
    sc = _Replay([
        (0, _slot(1, 0, busy=False)),  # baseline
        (0, _slot(1, 40)),  # request 1 decoding
        (300, _slot(1, 0, busy=False)),  # it ended with 300: the 260 /slots never showed are counted
        (300, _slot(2, 0, busy=False)),  # request 2 started and ended between scrapes ...
        (350, _slot(2, 0, busy=False)),  # ... and the counter has its 50
        (350, _slot(3, 100)),
        (350, None),  # request 3 ended between the two reads: /slots answered 0 too late for the counter
        (500, _slot(3, 0, busy=False)),
    ])
    deltas = _run(sc, 8)
    assert deltas == [0.0, 40.0, 260.0, 0.0, 50.0, 100.0, 0.0, 50.0]
    assert sc.total == 500.0  # exactly what the server generated after the baseline


def test_a_llamacpp_answer_that_ended_between_the_counter_and_slots_reads_says_what_the_count_may_lack():
    # llama-server's counter counts an answer at its end, /slots its tokens while it runs: one that ends after the
    # counter's read and before /slots' is in neither, its tokens (all made before) counted a scrape late, a whole
    # answer across a window's edge (beside two CPU hogs and another test, a 103-token one inside a 2.6 ms scrape left
    # two intervals `complete` at 152.5 and 285.7 bypass tokens where 218 and 225 ran). Where /slots changed otherwise
    # than by decoding on, the counter is read again: its rise is the most the count lacks (`window_read_missed`),
    # which the ledger weighs (tests/test_daemon_ledger.py). Before, nothing said it.
    sc = _Replay([
        (0, _slot(1, 0, busy=False)),  # baseline
        (0, _slot(1, 40)),  # request 1 decoding: two GETs, nothing missed
        (0, _slot(1, 0, busy=False), 120),  # it ended between the reads: the counter read again has its 120
        (120, _slot(1, 0, busy=False)),  # counted a scrape late; the server still: two GETs
        (120, _slot(2, 30), 120),  # request 2 started: looked again, nothing ended
    ])

    async def go():
        out = []
        for _ in range(5):
            n = len(sc.gets)
            sc.read_at_third = None
            out.append((await sc.scrape(), sc.window_read_missed, len(sc.gets) - n))
            # The count's stamp (`read_ns`, the daemon's GET span for it) ends before the counter's second read.
            assert sc.read_ns is not None and (out[-1][2] == 3) == (sc.read_at_third is not None), sc.read_at_third
            assert sc.read_at_third is None or sc.read_at_third == sc.read_ns, (sc.read_at_third, sc.read_ns)
        return out

    assert asyncio.run(go()) == [(0.0, 0.0, 2), (40.0, 0.0, 2), (0.0, 120.0, 3), (80.0, 0.0, 2), (30.0, 0.0, 3)]
    assert sc.total == 150.0  # the count itself is as before: exactly what the server generated
    # The counter's second read unreadable fails no scrape: the ended slot's last count is the least it lacks.
    failing = _Replay([(0, _slot(1, 0, busy=False)), (0, _slot(1, 40)), (0, _slot(1, 0, busy=False), None)])
    assert _run(failing, 3) == [0.0, 40.0, 0.0] and failing.window_read_missed == 40.0



def test_a_llamacpp_counters_second_read_comes_before_the_wait_for_the_proxy_workers_refusals():
    # proxy.workers > 1: each scrape waits for the workers' refusals (ProxyWorkers.wait_refusals, up to 40 ms past its
    # start). Waited for before the counter's second read, that read's rise held the answers that ended in the wait,
    # which /slots had shown (the count lacks none of them), and the ledger said proxy_lag for them needlessly: here
    # 160 where 120 may be missing. Now the second read comes first, then the wait.
    sc = _Replay([
        (0, _slot(1, 0, busy=False)),  # baseline
        (0, _slot(1, 40)),  # request 1 decoding: nothing ended
        (0, _slot(1, 0, busy=False), 120),  # it ended between the counter's read and /slots': 120 may be missing
    ])
    waited = []
    get = sc._get

    async def counted_get(path):
        if path == "/metrics" and not sc._slots_read:
            waited.clear()  # a scrape's first read: the wait is this scrape's from here on
        status, page = await get(path)
        if waited and path == "/metrics" and sc._slots_read:  # an answer of 40 tokens ended in the wait
            page = page.replace(" 120\n", " 160\n")
        return status, page

    async def wait(at_ns, timeout_s):
        waited.append(len(sc.gets))
        sc.gets.append("wait")

    sc._get = counted_get
    sc.refusals, sc.refusals_wait, sc.refusals_late_s = (lambda: []), wait, 60.0
    assert _run(sc, 3) == [0.0, 40.0, 0.0]
    assert sc.gets[-4:] == ["/metrics", "/slots", "/metrics", "wait"], sc.gets
    assert sc.window_read_missed == 120.0

def test_llamacpp_restart_counts_from_zero_and_slots_only_still_works():
    sc = _Replay([(900, _slot(1, 0, False)), (950, _slot(1, 0, False)), (20, _slot(1, 5))])
    assert _run(sc, 3) == [0.0, 50.0, 25.0]  # after a restart: everything since it
    only_slots = _Replay([(None, _slot(1, 10)), (None, _slot(1, 30)), (None, _slot(2, 7))])
    assert _run(only_slots, 3) == [0.0, 20.0, 7.0]
    # /slots alone misses each request's tail: the count says it may be low; counter + slots does not, but its
    # restart lost the old process's tokens after the last scrape before it: that says so (and that window only).
    assert set(only_slots.partial) == {"slots_only"} and set(sc.partial) == {"server_restart"}
    assert only_slots.window_partial == ("slots_only",) and sc.window_partial == ("server_restart",)


def test_a_count_that_may_be_low_says_why_what_it_costs_and_the_fix_in_the_log_and_on_metrics(caplog):
    """The log and /metrics said the count may be low and why, not what a low count costs: bypass traffic it
    misses is not in `unproxied`, its energy charged to the proxied requests or idle."""
    from types import SimpleNamespace

    from powerprof.daemon.metrics import Snapshot, make_registry, render

    late = _Replay([(120, _slot(1, 0, busy=False)), (130, _slot(1, 0, busy=False))])
    late.ready = True  # first read after the daemon's ready, 120 tokens already counted
    slots = _Replay([(None, _slot(1, 10)), (None, _slot(1, 30))])
    with caplog.at_level("WARNING", logger="powerprof.daemon.scrape"):
        _run(late, 2), _run(slots, 2)
    assert set(late.partial) == {"late_baseline"} and set(slots.partial) == {"slots_only"}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # once each
    for line, fix in zip(lines, ("start the server before the daemon", "start llama-server with --metrics")):
        assert line.startswith("scraped server count may be low: ") and "not in `unproxied`" in line, line
        assert f"(fix: {fix}" in line, line
    text = render(make_registry(SimpleNamespace(snapshot=Snapshot(server_tokens=130.0,
                                                                   server_tokens_partial=("slots_only",))))).decode()
    help_line = next(x for x in text.splitlines() if x.startswith("# HELP powerprof_server_tokens_partial "))
    assert "bypass traffic it misses is not in unproxied" in help_line and "the fix" in help_line, help_line
    assert 'powerprof_server_tokens_partial{reason="slots_only"} 1.0' in text, text


# --- cadence: fast while something moves, slow once the server and the proxy are still ---------


def test_cadence_slows_when_still_and_speeds_at_once_on_a_counter_rise_or_a_request():
    c = Cadence(fast_s=0.25, idle_s=2.0, still_s=5.0)
    assert c.due(0.0, busy=False)  # the first scrape at once
    c.scraped(0.0, 0.0)  # the baseline counts as movement: fast for the first still_s
    assert c.period_s(4.9) == 0.25 and c.due(0.25, busy=False)
    for t in (0.25, 0.5, 4.75):
        c.scraped(t, 0.0)  # the counter never moves
    assert c.period_s(5.0) == 2.0
    assert not c.due(5.0, busy=False) and not c.due(5.5, busy=False)
    assert c.due(6.75, busy=False)  # one idle period after the last scrape
    # Still, the loop polls once a second (poll_s): at 6.0 the next poll (7.0) would make the window 2.25 s, past the
    # idle period and its slack, so the scrape is due at 6.0 (a shorter window, and the next ones on the poll's grid).
    assert c.poll_s(6.0, busy=False) == 1.0 and c.due(6.0, busy=False)
    c.scraped(6.75, 0.0)
    # A slow scrape sees the counter rise: the next one is one fast period later, not two seconds.
    c.scraped(8.75, 12.0)
    assert c.period_s(8.8) == 0.25 and c.due(9.0, busy=False)
    c.scraped(9.0, 0.0)
    assert c.period_s(13.7) == 0.25 and c.period_s(13.8) == 2.0  # still again 5 s after the rise
    c.scraped(13.8, 0.0)
    # A proxied request switches to fast at the next poll, the counter still unmoved.
    assert not c.due(14.0, busy=False)
    assert c.due(14.1, busy=True)
    c.scraped(14.1, 0.0)
    assert c.due(14.35, busy=False)  # and stays fast for still_s after the proxy went quiet
    # A failed scrape (None) is no movement; idle_s at or below fast_s keeps the fast period.
    c.scraped(25.0, None)
    assert c.period_s(25.0) == 2.0
    c.idle_s = 0.1
    assert c.period_s(25.0) == 0.25


def test_a_burst_after_stillness_is_placed_back_from_the_rate_that_follows():
    s = 1_000_000_000
    # 2 s window, 100 tokens, the next window runs 200 tokens/s: the burst began 0.5 s before its end.
    assert burst_start_ns(0, 2 * s, 100.0, 200.0 / s) == 1.5 * s
    assert burst_start_ns(0, 2 * s, 1000.0, 200.0 / s) == 0  # more than the rate allows: the whole window
    assert burst_start_ns(0, 2 * s, 100.0, 0.0) == 0  # the burst ended within it: no rate, spread evenly
    assert burst_start_ns(0, 2 * s, 0.0, 200.0 / s) == 0


class _Cfg:
    def __init__(self, **scrape_keys):
        self.keys = scrape_keys

    def get(self, section, key):
        assert section == "scrape"
        return self.keys[key]


class _FakeScraper:
    """What Daemon._scrape_loop reads of a Scraper, its windows plain (no restart, partial count or missed read); a
    class attribute or `scrape` overridden by a test's subclass says what it tests."""
    kind, finished, window_partial, cache_hits, served = "vllm", None, (), None, None
    restart_by_fall = False  # Scraper.restart_by_fall
    window_each_step = False  # Scraper.window_each_step
    window_down_ns = None  # Scraper.window_down_ns
    window_down_refused = False  # Scraper.window_down_refused
    window_read_missed = 0.0  # Scraper.window_read_missed
    window_past_reach = False  # Scraper.window_past_reach
    vllm_v1 = False  # Scraper.vllm_v1: best_of refused or ignored (not read here)

    async def scrape(self):
        return 10.0


def _window_ledger(keep=lambda w: (w.since, w.t, w.d), busy: bool = True, **fields):
    """A ledger the scrape loop hands its windows to: `spans` gets keep(w) of each (w: add_server_tokens' arguments by
    name), no prefix-cache check; `busy`: a proxied request live (the loop scrapes fast)."""
    ledger = types.SimpleNamespace(requests={1: object()} if busy else {}, tags={}, closed_tags=[], spans=[], **fields)
    ledger.add_cache_hits = lambda since, t, hits: None

    def add_server_tokens(t, d, since, at_finish, finished=None, partial=(), read_ns=None, served=None,
                          restart_by_fall=False, down_ns=None, down_refused=False, read_missed=0.0, past_reach=False,
                          dead_from_ns=None):
        ledger.spans.append(keep(types.SimpleNamespace(
            t=t, d=d, since=since, at_finish=at_finish, finished=finished, partial=partial, read_ns=read_ns,
            served=served, restart_by_fall=restart_by_fall, down_ns=down_ns, down_refused=down_refused,
            read_missed=read_missed, past_reach=past_reach)))

    ledger.add_server_tokens = add_server_tokens
    return ledger


def _scrape_loop_me(scraper, ledger, interval_s: float = 0.02, idle_interval_s: float = 0.02):
    """The daemon as Daemon._scrape_loop reads it (`self`), over `scraper` and `ledger`."""
    return types.SimpleNamespace(waker=Waker(), config_waker=Waker(), scraper=scraper, ledger=ledger,
                                 cfg=_Cfg(interval_s=interval_s, idle_interval_s=idle_interval_s), stop_event=None,
                                 _scrape_since_ns=None)


def _run_scrape_loop(scraper, ledger, done, interval_s: float = 0.02, idle_interval_s: float = 0.02,
                     poll_s: float = 0.02) -> None:
    """Daemon._scrape_loop over `scraper` and `ledger` until done() (30 s at most), then stopped: an exception that
    ended the loop is raised here."""
    from powerprof.daemon.service import Daemon

    me = _scrape_loop_me(scraper, ledger, interval_s, idle_interval_s)

    async def go():
        me.stop_event = asyncio.Event()
        task = asyncio.create_task(Daemon._scrape_loop(me))
        t = time.monotonic()
        while not done() and not task.done() and time.monotonic() - t < 30:
            await asyncio.sleep(poll_s)
        me.stop_event.set()
        await asyncio.wait_for(task, 5)  # raises the loop's own exception, if it died of one

    asyncio.run(go())


def test_a_failing_prefix_cache_check_does_not_end_the_scrape_loop():
    """The window's hits are checked (ledger.add_cache_hits) before its tokens are placed, in the scrape loop, which
    catches nothing of the ledger's: one exception there ended the loop for good, unsaid until shutdown ("task failed
    at shutdown"), and every interval after it closed `unscraped`. The check is let go for that window, logged, and the
    tokens are still counted."""

    class FakeScraper(_FakeScraper):
        cache_hits = 5.0

    ledger = _window_ledger(checks=0)

    def add_cache_hits(since, t, hits):
        ledger.checks += 1
        if ledger.checks == 2:
            raise ValueError("a fault in the check")

    ledger.add_cache_hits = add_cache_hits
    # Until five checks (the first window has none): on a loaded host a late scrape is a held slow window, placed
    # as two spans (its still part and its burst), so the spans alone reached five after four checks.
    _run_scrape_loop(FakeScraper(), ledger, lambda: ledger.checks >= 5)
    assert len(ledger.spans) >= 5 and ledger.checks >= 5
    assert all(a[1] == b[0] for a, b in zip(ledger.spans[1:], ledger.spans[2:]))  # each window where the last ended


def _burst_woken_by_a_request(monkeypatch, arrived_before_ns: int, death=None, flags=None,
                              dead_from=None) -> tuple[int, list]:
    """Still (idle period), then 20 tokens counted and a request live that wakes the scrape (arrived
    `arrived_before_ns` before it: a proxy worker's record read late), then fast windows of 10 tokens each (200 tokens
    a second at 0.05 s: the 20 took about 0.1 s by that rate). The wake's time and the windows given the ledger.
    `death(woken_ns)`: the burst's window's (partial, down_ns, down_refused); `flags` gets each window's
    (partial, restart_by_fall, down_ns, down_refused), `dead_from` its dead_from_ns."""
    from powerprof.daemon import scrape as scrape_mod
    from powerprof.daemon.service import Daemon

    monkeypatch.setattr(scrape_mod, "STILL_S", 0.3)  # still after 0.3 s, not 5

    class FakeScraper(_FakeScraper):
        rise, calls = 0.0, 0

        async def scrape(self):
            self.calls += 1
            said = death(woken[0]) if death is not None and self.rise == 20.0 else ((), None, False)
            self.window_partial, self.window_down_ns, self.window_down_refused = said
            return self.rise

    woken = [0]
    ledger = types.SimpleNamespace(requests={}, tags={}, closed_tags=[], spans=[], dead_from=[])
    ledger.add_cache_hits = lambda since, t, hits: None

    def add_server_tokens(t, d, since, at_finish, finished=None, partial=(), read_ns=None, served=None,
                          restart_by_fall=False, down_ns=None, down_refused=False, read_missed=0.0, past_reach=False,
                          dead_from_ns=None):
        ledger.spans.append((since, t, d))
        ledger.dead_from.append(dead_from_ns)
        if flags is not None:
            flags.append((partial, restart_by_fall, down_ns, down_refused))

    ledger.add_server_tokens = add_server_tokens
    me = types.SimpleNamespace(waker=Waker(), config_waker=Waker(), cfg=_Cfg(interval_s=0.05, idle_interval_s=2.0),
                               scraper=FakeScraper(), ledger=ledger, stop_event=None,
                               _scrape_since_ns=time.monotonic_ns())

    async def go():
        me.stop_event = asyncio.Event()
        task = asyncio.create_task(Daemon._scrape_loop(me))
        t0 = time.monotonic()
        # Still, scraped at the idle period (a window 0.9 s long or more, nothing counted); then 0.5 s into the next
        # (the idle scrapes come 1 s apart or more).
        while not any(t - since >= 0.9e9 for since, t, _ in ledger.spans) and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.02)
        while True:
            calls = me.scraper.calls
            await asyncio.sleep(0.5)
            if me.scraper.calls == calls:
                break
        # 20 bypass tokens begun just before a request that arrives now and wakes the scrape; then fast windows of 10
        # tokens each (200 tokens a second at 0.05 s): the 20 took about 0.1 s.
        woken_ns = woken[0] = time.monotonic_ns()
        me.scraper.rise = 20.0
        ledger.requests[1] = types.SimpleNamespace(trace=types.SimpleNamespace(arrival_ns=woken_ns - arrived_before_ns))
        me.waker.wake()
        while me.scraper.calls == calls and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.002)
        me.scraper.rise = 10.0
        while not [x for x in ledger.spans if x[2] == 20.0] and time.monotonic() - t0 < 20:
            await asyncio.sleep(0.02)
        me.stop_event.set()
        await asyncio.wait_for(task, 5)
        return woken_ns

    woken_ns = asyncio.run(go())
    if dead_from is not None:
        dead_from.extend(ledger.dead_from)
    return woken_ns, ledger.spans


def test_a_burst_the_first_request_after_a_stillness_wakes_the_scrape_on_is_placed_back_not_spread(monkeypatch):
    """A slow (idle-period) window whose scrape a request's arrival woke is still a slow one: its rise is held and
    placed back from the next window's rate (`burst_start_ns`), not spread over the whole window. Before, `still` was read
    after `Cadence.due` had counted that request live, so such a window never was: bypass tokens begun just before the
    first request were spread over the idle window (tests/test_daemon_buffered_bypass.py's wind-down scene beside CPU
    hogs: intervals before any traffic `complete` with 1.5 to 7 bypass tokens where none ran)."""
    woken_ns, spans = _burst_woken_by_a_request(monkeypatch, 0)
    burst = [x for x in spans if x[2] == 20.0]
    assert burst, spans
    # Its window 0.5 s long or more, the burst placed over its last part (about 0.1 s), the part before it given empty
    # (before: all of it, 20 tokens from the window's start, 0.5 s or more before the request).
    assert burst[0][0] > woken_ns - 0.45e9, ((burst[0][0] - woken_ns) / 1e9, spans[-4:])
    assert [x for x in spans if x[1] == burst[0][0] and x[2] == 0.0], spans[-4:]


def test_a_held_burst_begins_no_later_than_the_request_that_woke_its_scrape(monkeypatch):
    """A request told the daemon late (a proxy worker's record, 0.3 s after its arrival on a loaded host) wakes a slow
    window whose count already holds its first tokens: the held burst begins no later than its arrival, where its
    tokens the proxy placed begin. Before, the next window's faster rate put all 20 in its last ~0.1 s, 0.2 s after the
    arrival: the request's tokens placed before had no count under them (counter_below), and the count after read as
    bypass tokens (tests/test_daemon_delivery.py's two-proxy-worker scenes: unproxied energy)."""
    woken_ns, spans = _burst_woken_by_a_request(monkeypatch, int(0.3e9))
    burst = [x for x in spans if x[2] == 20.0]
    assert burst, spans
    arrived_ns = woken_ns - int(0.3e9)
    assert burst[0][0] <= arrived_ns, ((burst[0][0] - arrived_ns) / 1e9, spans[-4:])
    assert [x for x in spans if x[1] == burst[0][0] and x[2] == 0.0], spans[-4:]  # the window's part before: empty


@pytest.mark.parametrize("down_s,refused", [(-0.3, False), (-0.3, True), (None, False), (-0.05, True), (0.001, True)])
def test_a_held_window_gives_its_death_with_one_part_alone(monkeypatch, down_s, refused):
    """A held slow window saying a restart (or a refused down scrape) was given the ledger as two parts, each with the
    restart and the down scrape: the part the down scrape is not in read down=None, "the start time said a restart",
    and cut a running SGLang batch's span from 31.6 s to 5.5 s after its arrival (batchfix8's review, fault 3). Now
    the part it falls in takes it (`service.held_death_part`), the other says the restart by the fall alone (flagged,
    no death); a refused one in the burst the page says no restart of goes with the burst part, its death's window
    from the held window's start (dead_from_ns): given whole, its 20 tokens were spread over the idle window, its
    intervals `complete` (tests/test_daemon_ledger.py: 120 J unproxied for 25); with no down scrape (a restart the
    page said, its intervals flagged server_restart), or one after its scrape, the window is given whole."""
    flags, dead_from = [], []

    def death(woken_ns):
        down = None if down_s is None else woken_ns + int(down_s * 1e9)
        return ((() if refused else ("server_restart",)), down, refused)

    woken_ns, spans = _burst_woken_by_a_request(monkeypatch, 0, death, flags, dead_from)
    i = next(k for k, x in enumerate(spans) if x[2] == 20.0)
    deaths = [f for f in flags if (f[0] and not f[1]) or f[3]]
    assert len(deaths) == 1, list(zip(spans, flags))[-4:]
    if down_s == -0.3:  # in the part before the burst: that part takes it
        assert spans[i - 1][1] == spans[i][0] and spans[i - 1][2] == 0.0, spans[-4:]
        assert (flags[i - 1][0], *flags[i - 1][2:]) == death(woken_ns) and flags[i][1:] == (True, None, False), flags
    elif down_s == -0.05:  # in the burst, no restart said: the burst part takes it, from the window's start
        assert spans[i - 1][1] == spans[i][0] and spans[i - 1][2] == 0.0, spans[-4:]
        assert spans[i][1] - spans[i][0] < 0.4e9 and spans[i - 1][1] - spans[i - 1][0] > 0.4e9, spans[-4:]
        assert (flags[i][0], *flags[i][2:]) == death(woken_ns) and flags[i - 1][1:] == (True, None, False), flags
        assert dead_from[i] == spans[i - 1][0], (dead_from[-4:], spans[-4:])
    else:  # given whole: the window from the idle scrape before
        assert spans[i - 1][2] == 0.0 and spans[i - 1][1] == spans[i][0] and spans[i][1] - spans[i][0] > 0.4e9, spans
        assert flags[i][0] == death(woken_ns)[0] and flags[i][2:] == death(woken_ns)[1:], flags[-4:]


def test_the_daemon_scrape_loop_gives_the_ledger_each_gets_span():
    """The server reads its counter anywhere in the GET, and the window's end is stamped at the GET's midpoint: the
    ledger is given the GET's start and end with each window (`read_ns`), so the proxy's tokens inside it can be
    judged (docs/daemon.md, "A counter read before its stamp"). Before, it had the midpoint alone."""
    class FakeScraper(_FakeScraper):
        kind = "llamacpp"

        async def scrape(self):
            await asyncio.sleep(0.03)  # a GET that takes 30 ms (longer on a loaded host)
            return 10.0

    ledger = _window_ledger(keep=lambda w: (w.t, w.d, w.read_ns))
    _run_scrape_loop(FakeScraper(), ledger, lambda: len(ledger.spans) >= 4)
    read = [(t, r) for t, d, r in ledger.spans if d > 0]  # (a held slow window's split point, 0 tokens, is no read)
    assert len(read) >= 3, ledger.spans
    for t, r in read:
        assert r is not None, ledger.spans
        assert r[1] - r[0] >= 0.025e9 and abs((r[0] + r[1]) // 2 - t) <= 1, (t, r)


def test_the_daemon_scrape_loop_stamps_the_counters_read_not_the_wait_for_the_proxy_workers_refusals():
    """proxy.workers = 2, one idle (its clock said only at its heartbeat): each scrape waits after its page for the
    workers' refusals, up to REFUSALS_LATE_S (40 ms) past its start (Scraper._take_refusals). The window's stamp and
    `read_ns` are the GET's (Scraper.read_ns), not the scrape's: stamped around the whole scrape, they held the wait,
    the window's end placed ~20 ms past the read, and the proxied tokens inside read as more than the server counted
    (rows over-flagged, left out of J/token)."""
    import aiohttp

    from powerprof.daemon.service import Daemon
    from powerprof.daemon.workers import _STATS, ProxyWorkers, _WorkerLink, frame

    gets, waits = [], []

    class Paged(Scraper):
        served = 0

        async def _get(self, path):
            t0 = time.monotonic_ns()
            await asyncio.sleep(0.002)
            Paged.served += 10
            gets.append((t0, time.monotonic_ns()))
            return 200, (f'# TYPE sglang:generation_tokens_total counter\n'
                         f'sglang:generation_tokens_total{{model_name="m"}} {Paged.served}\n')

    ledger = _window_ledger(keep=lambda w: (w.t, w.d, w.read_ns))

    async def go():
        workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=None, proxy_kwargs={},
                               header_timeout_s=10, idle_timeout_s=10)
        for w in workers.workers:
            w.transport = types.SimpleNamespace(close=lambda: None)
            _WorkerLink(workers, w).data_received(frame(([], [], [], [], (0,) * len(_STATS), [], time.monotonic_ns(), [])))

        async def wait(at_ns, timeout_s):  # the real wait, timed
            t = time.monotonic_ns()
            await workers.wait_refusals(at_ns, timeout_s)
            waits.append((t, time.monotonic_ns()))

        async with aiohttp.ClientSession() as s:
            sc = Paged(s, "http://x", "sglang")
            sc.refusals, sc.refusals_wait, sc.refusals_late_s = workers.take_refusals, wait, workers.refusals_late_s
            me = _scrape_loop_me(sc, ledger)
            me.stop_event = asyncio.Event()
            task = asyncio.create_task(Daemon._scrape_loop(me))
            t = time.monotonic()
            while len(ledger.spans) < 4 and not task.done() and time.monotonic() - t < 30:
                await asyncio.sleep(0.02)
            me.stop_event.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert len(ledger.spans) >= 4, ledger.spans
    for (t, d, r), get, waited in zip(ledger.spans, gets, waits):
        # each scrape waited (no worker's clock passed its start): the wait is long, the read short, after it
        assert waited[1] - waited[0] >= 0.01e9, (get, waited)
        assert r is not None and r[0] <= get[0] and get[1] <= r[1] <= waited[0], (r, get, waited)
        assert t == (r[0] + r[1]) // 2, (t, r)


def test_the_daemon_scrape_loop_gives_the_ledger_when_a_scrape_found_the_server_down():
    """A restart's window says when its first scrape found the server down (Scraper.window_down_ns): the ledger places
    the dead process's run-ons' end from it (`Ledger._run_on_cut_ns`), so the loop must hand it on with the window; and
    whether its page was back past a new process's reach (Scraper.window_past_reach: no run-on is cut at that death)."""
    class FakeScraper(_FakeScraper):
        kind, window_partial = "sglang", ("server_restart",)
        window_down_ns = 123_456_789
        window_past_reach = True

    ledger = _window_ledger(keep=lambda w: (w.down_ns, w.past_reach))
    _run_scrape_loop(FakeScraper(), ledger, lambda: len(ledger.spans) >= 2)
    assert ledger.spans and set(ledger.spans) == {(123_456_789, True)}, ledger.spans


def test_the_daemon_scrape_loop_follows_the_cadence(monkeypatch):
    """The daemon's own loop: slow while nothing moves, fast while the ledger holds proxied requests
    and right after a counter rise. Bounds are counts and lower bounds on gaps (a loaded machine only
    makes sleeps longer), and the fast cases are given far more time than fast needs."""
    from powerprof.daemon import scrape as scrape_mod
    from powerprof.daemon.service import Daemon

    monkeypatch.setattr(scrape_mod, "STILL_S", 0.5)
    fast_s, idle_s = 0.1, 1.0
    calls: list[float] = []
    deltas: list[float] = []  # scripted counter rises, taken one per scrape

    class FakeScraper(_FakeScraper):
        kind = "sglang"  # a counter that moves at request end: the ledger is told so with every window
        finished = (1.0, 2.5)  # and the requests finished in it with their summed seconds (e2e latency histogram)
        # nothing makes its windows' counts low; its prefix-cache counter not known (the ledger is told so with every
        # window); its page shows no finished-request count (an SGLang's)

        async def scrape(self):
            calls.append(time.monotonic())
            return deltas.pop(0) if deltas else 0.0

    ledger = _window_ledger(keep=lambda w: (w.since, w.t, w.d, w.at_finish, w.finished), busy=False)
    me = _scrape_loop_me(FakeScraper(), ledger, fast_s, idle_s)

    async def until(pred, limit_s):
        t = time.monotonic()
        while not pred() and time.monotonic() - t < limit_s:
            await asyncio.sleep(0.02)

    async def go():
        me.stop_event = asyncio.Event()
        task = asyncio.create_task(Daemon._scrape_loop(me))
        try:
            # Still: fast for STILL_S after the first scrape, then one scrape per idle period.
            t0 = time.monotonic()
            await asyncio.sleep(3.0)
            still = [t for t in calls if t - calls[0] > 0.5 + fast_s]
            span_s = time.monotonic() - t0
            assert len(still) >= 1, calls
            assert all(b - a >= idle_s - fast_s / 2 - 0.01 for a, b in zip(still, still[1:])), calls
            # Always-fast would scrape ~30 times here; the cadence at most 6 + one per idle period.
            assert len(calls) <= 0.5 / fast_s + 2 + span_s / (idle_s - fast_s / 2), calls
            # Proxied requests in the ledger: fast at once. Six scrapes would take 4.75 s or more slow.
            n, t1 = len(calls), time.monotonic()
            ledger.requests[1] = object()
            await until(lambda: len(calls) >= n + 6, 10.0)
            assert len(calls) >= n + 6 and calls[n + 5] - t1 < 5 * (idle_s - fast_s / 2), calls[n:]
            ledger.requests.clear()
            # Still again, then the counter rises at one slow scrape: the next three follow fast.
            await asyncio.sleep(2.5)
            assert calls[-1] - calls[-2] >= idle_s - fast_s / 2 - 0.01
            n = len(calls)
            deltas.extend([40.0, 20.0])
            await until(lambda: len(calls) >= n + 4, 10.0)
            assert len(calls) >= n + 4 and calls[n + 3] - calls[n] < 3 * (idle_s - fast_s / 2), calls[n:]
        finally:
            me.stop_event.set()
            await asyncio.wait_for(task, 5)
        # Every scrape reached the ledger, each window starting where the previous one ended.
        spans = ledger.spans
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert sum(s[2] for s in spans) == 60.0
        assert all(s[3] is True for s in spans)
        # The slow window's 40 tokens were placed where the next window's rate (20 per fast window)
        # says the burst began: two next-windows before its end, the rest of it left empty.
        k = next(i for i, s in enumerate(spans) if s[2] == 40.0)
        (_, start, empty, _, none), (_, end, _, _, fin), (_, t_next, _, _, _) = spans[k - 1], spans[k], spans[k + 1]
        assert empty == 0.0 and abs((end - start) - 2 * (t_next - end)) <= 2, spans[k - 1: k + 2]
        # The requests that finished go with the window of their tokens (held or not), none with its empty start.
        assert none is None and fin == (1.0, 2.5)
        assert all(s[4] == (1.0, 2.5) for s in spans if s[2] > 0)

    asyncio.run(go())


# --- a failed scrape says what failed ---------------------------------------------------------------


def test_a_scrape_that_times_out_says_where_how_long_and_what_it_means(monkeypatch, caplog):
    # The daemon logged `TimeoutError: ` and nothing after it: aiohttp's total timeout has no message.
    import aiohttp
    from aiohttp import web
    from proxy_helpers import serve_here

    import powerprof.daemon.scrape as scrape

    monkeypatch.setattr(scrape, "SCRAPE_TIMEOUT_S", 0.3, raising=False)

    release = None

    async def hang(request):
        await release.wait()  # longer than any scrape timeout: let go only as the test ends
        return web.Response(text="")

    async def go():
        nonlocal release
        release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/metrics", hang)
        runner, url = await serve_here(app)
        try:
            async with aiohttp.ClientSession() as s:
                sc = Scraper(s, url, "vllm")
                return await sc.scrape(), sc, url
        finally:
            release.set()
            await runner.cleanup()

    with caplog.at_level("WARNING", logger="powerprof.daemon.scrape"):
        delta, sc, url = asyncio.run(go())
    assert delta is None and sc.errors == 1
    for text in (sc.last_error, caplog.text):
        assert f"GET {url}/metrics" in text and "within 0.3 s" in text, text
        assert "busy or hung" in text and "retried" in text, text


# --- the baseline: taken before the daemon says it is ready ------------------------------------------


def _server_count(metrics_url: str, want: float, limit_s: float = 20.0, still_s: float = 3.0) -> tuple[float | None, str]:
    """The daemon's scraped server count once it reaches `want`; or once it says it may be low (`late_baseline`: the
    baseline took some of the tokens in, so it cannot reach `want`) and has not moved for `still_s` (its last move
    came ~2 s after the one before, between these tests' scrapes held 1 s each; such a count was waited on until
    `limit_s`, 8 s, in full); or once `limit_s` passed (a loaded host delays scrapes)."""
    import re
    import urllib.request

    deadline = time.monotonic() + limit_s
    last, since = None, time.monotonic()
    while True:
        text = urllib.request.urlopen(metrics_url + "/metrics", timeout=10).read().decode()
        got = re.search(r"^powerprof_server_tokens_generated_total (\S+)$", text, re.M)
        n = float(got.group(1)) if got else None
        now = time.monotonic()
        if n != last:
            last, since = n, now
        low_and_still = n is not None and "late_baseline" in _partial(text) and now - since >= still_s
        if (n is not None and n >= want) or low_and_still or now > deadline:
            return n, text
        time.sleep(0.3)


def test_a_direct_request_sent_as_soon_as_the_daemon_is_ready_is_counted_whole(tmp_path):
    """A loaded host held the daemon's first scrape (its baseline) until a direct request sent at its ready had
    decoded tokens: the baseline took them in, and the count stayed low for good (1169 of 1200 once). The baseline
    is now read before the daemon says it is ready: held 0.6 s a read, the count is still exact."""
    import json
    import urllib.request

    from daemon_helpers import DaemonProc, sim_env
    from proxy_helpers import held_answers
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=100.0, draft_n_max=0) as srv:
        held, stop = held_answers(srv.url, hold_s=0.6, for_s=3.0)
        cfg = tmp_path / "p.toml"
        cfg.write_text(f'[scrape]\ninterval_s = 0.1\nurl = "{held}"\n')
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", srv.url,
                       "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            body = {"prompt": "direct", "n_predict": 150, "ignore_eos": True, "stream": False}
            req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            assert json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens_predicted"] == 150
            n, metrics = _server_count(d.info["metrics"], 150)
        finally:
            rc = d.stop()
            stop()
    assert rc == 0, d.output()
    assert n == 150, n  # the server's own counter is exact: so is the count
    assert _partial(metrics) == set(), metrics


def _partial(metrics: str) -> set[str]:
    import re

    return set(re.findall(r'^powerprof_server_tokens_partial\{reason="(\w+)"\} 1', metrics, re.M))


def test_a_baseline_read_after_ready_from_a_server_that_has_counted_says_the_count_may_be_low(tmp_path):
    """The server comes up after the daemon (its counters unreadable at the ready) and serves a direct request before
    the daemon's first read of them: that read takes the request's tokens in. The count is then exact or says it may
    be low (`late_baseline` on /metrics), never silently low."""
    import json
    import urllib.request

    from daemon_helpers import DaemonProc, sim_env
    from proxy_helpers import held_answers
    from support import free_port
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    port = free_port()
    # Each read held 1 s: the first that reaches the server comes ~1-2 s after it is up, the request well under way.
    held, stop = held_answers(f"http://127.0.0.1:{port}", hold_s=1.0, for_s=600.0)
    cfg = tmp_path / "p.toml"
    cfg.write_text(f'[scrape]\ninterval_s = 0.1\nurl = "{held}"\n')
    try:
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", f"http://127.0.0.1:{port}",
                       "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            with SimServer(SimNVML("seed-16g", state_path=None), port=port, decode_tok_s=100.0, draft_n_max=0) as srv:
                body = {"prompt": "direct", "n_predict": 150, "ignore_eos": True, "stream": False}
                req = urllib.request.Request(srv.url + "/completion", data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                assert json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens_predicted"] == 150
                n, metrics = _server_count(d.info["metrics"], 150, limit_s=8.0)
        finally:
            rc = d.stop()
    finally:
        stop()
    assert rc == 0, d.output()
    # Exact only if the first read beat the request's first token (a loaded host can hold the request that long).
    assert (n == 150 and _partial(metrics) == set()) or (n < 150 and _partial(metrics) == {"late_baseline"}), (n, metrics)
    if n < 150:
        assert "scraped server count may be low" in d.output()


def test_a_request_proxied_while_the_baseline_is_read_is_counted_or_said(tmp_path):
    """The proxy listened before the baseline was read: on a vLLM slow to answer its counters (each read held
    1.5 s, within BASELINE_WAIT_S), a request proxied at the daemon's start ran wholly inside that read, the baseline
    took its tokens in, and the count said 10 of 150 with nothing on /metrics (`ready` was not yet set). The
    baseline is now read before the proxy listens: the request is counted whole, or the count says it may be low."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from daemon_helpers import DaemonProc, sim_env
    from proxy_helpers import held_answers
    from support import free_port
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    port = free_port()
    got: list = []

    def client():
        body = json.dumps({"model": "m", "prompt": "early", "max_tokens": 150, "ignore_eos": True}).encode()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # sent as soon as the proxy's port takes it
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                got.append(json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"])
                return
            except urllib.error.URLError as e:
                if not isinstance(e.reason, ConnectionRefusedError):
                    got.append(e)
                    return
                time.sleep(0.01)

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", decode_tok_s=100.0, draft_n_max=0) as srv:
        held, stop = held_answers(srv.url, hold_s=1.5, for_s=8.0)
        cfg = tmp_path / "p.toml"
        cfg.write_text(f'[scrape]\ninterval_s = 0.1\nurl = "{held}"\n')
        th = threading.Thread(target=client, daemon=True)
        th.start()
        d = None
        try:
            d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", srv.url,
                           "--listen", f"127.0.0.1:{port}", "--interval", "0.25", "--flush-interval", "0.5",
                           env=sim_env(tmp_path))
            th.join(60)
            assert got == [150], got
            n, metrics = _server_count(d.info["metrics"], 150, limit_s=15.0)
        finally:
            rc = d.stop() if d is not None else None
            stop()
    assert rc == 0, d.output()
    assert (n == 150 and _partial(metrics) == set()) or (n < 150 and _partial(metrics) == {"late_baseline"}), (n, metrics)


# --- SGLang: its token counter is absent from /metrics until its first request finishes ------------------------


def _sglang_bypass_count(server: str) -> tuple[float, dict, int]:
    """The daemon's scraper beside a simulated SGLang started with --skip-server-warmup (its /metrics empty: the
    multiprocess collector shows no family until first set): the baseline read before the ready, then one request
    of 50 tokens straight to the server. (tokens counted, partial reasons, scrape errors)."""
    import aiohttp

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    async def go(url):
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, url, server)
            await sc.scrape()  # the daemon's baseline read, before it says it is ready
            sc.ready = True
            body = {"text": "bypass", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body) as r:
                assert (await r.json())["meta_info"]["completion_tokens"] == 50
            await sc.scrape()
            return sc.total, dict(sc.partial), sc.errors

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", sglang_warmup=False,
                   decode_tok_s=200.0, draft_n_max=0) as srv:
        return asyncio.run(go(srv.url))


def test_histogram_sum_count_sums_label_sets_and_needs_both():
    page = ("# TYPE sglang:e2e_request_latency_seconds histogram\n"
            'sglang:e2e_request_latency_seconds_bucket{le="1.0",model_name="a"} 1.0\n'
            'sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="a"} 2.0\n'
            'sglang:e2e_request_latency_seconds_sum{model_name="a"} 3.5\n'
            'sglang:e2e_request_latency_seconds_count{model_name="a"} 2.0\n'
            'sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="b"} 1.0\n'
            'sglang:e2e_request_latency_seconds_sum{model_name="b"} 0.5\n'
            'sglang:e2e_request_latency_seconds_count{model_name="b"} 1.0\n')
    assert histogram_sum_count(page, "sglang:e2e_request_latency_seconds") == (3.0, 4.0)
    assert histogram_sum_count(SGLANG, "sglang:e2e_request_latency_seconds") is None
    no_sum = "\n".join(ln for ln in page.splitlines() if "_sum" not in ln) + "\n"
    assert histogram_sum_count(no_sum, "sglang:e2e_request_latency_seconds") is None
    with pytest.raises(ValueError, match="_sum"):
        histogram_sum_count(page.replace("} 3.5", "} -1"), "sglang:e2e_request_latency_seconds")


def test_the_scraper_says_how_many_requests_finished_and_how_long_they_ran():
    """SGLang's e2e latency histogram rises with its token counter: the scraper gives the rise (requests, seconds),
    which the ledger spreads bypass tokens back over (docs/daemon.md, Bypass traffic)."""
    import aiohttp

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    async def go(url):
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, url, "sglang")
            await sc.scrape()
            first = sc.finished
            body = {"text": "bypass", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
            t = time.monotonic()
            async with s.post(url + "/generate", json=body) as r:
                await r.read()
            took = time.monotonic() - t
            await sc.scrape()
            return first, sc.finished, took

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", decode_tok_s=200.0, draft_n_max=0) as srv:
        first, finished, took = asyncio.run(go(srv.url))
    assert first is None  # the baseline: nothing counted yet
    assert finished[0] == 1.0 and 0.2 <= finished[1] <= took + 0.01, (finished, took)


def test_an_idle_sglang_counts_its_first_request_whole_not_as_a_late_baseline():
    """SGLang's sglang:generation_tokens_total is a labelled counter of prometheus_client's multiprocess mode: it is
    not on /metrics at all until a request finishes (with --skip-server-warmup; otherwise its warm-up's). Before, the
    daemon beside an idle SGLang found no counter (auto: no SGLang at all; `sglang`: an error a scrape), took the
    first request's 50 tokens as its baseline and counted 0 of them, flagged late_baseline. A counter absent from a
    server known to be SGLang has counted nothing yet: it reads 0, and the first request is counted whole."""
    for server in ("auto", "sglang"):
        total, partial, errors = _sglang_bypass_count(server)
        assert (total, partial, errors) == (50.0, {}, 0), server


# --- review4: "absent reads 0" only on SGLang's own page with nothing finished yet ----------------------------

GATEWAY_PAGE = ("# TYPE http_requests_total counter\nhttp_requests_total{code=\"200\"} 12.0\n"
                "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n")
# An SGLang page whose token counter is not there under the name powerprof reads (another version's name), though
# requests have finished: the counters SGLang sets with it at a request's end are there.
RENAMED_PAGE = ("# TYPE sglang:num_requests_total counter\nsglang:num_requests_total{model_name=\"m\"} 3.0\n"
                "# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total{model_name=\"m\"} 30.0\n")
# A fresh SGLang (--skip-server-warmup) whose first request is in prefill: its scheduler logged, nothing finished.
FRESH_PAGE = "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"m\",tp_rank=\"0\"} 0.0\n"
# The same with --enable-metrics' HTTP middleware (utils/common.py, add_prometheus_track_response_middleware): every
# HTTP request counted, this scrape and powerprof's detection included; nothing finished.
FRESH_HTTP_PAGE = ('# TYPE sglang:http_requests_total counter\n'
                   'sglang:http_requests_total{endpoint="/v1/models",method="GET"} 1.0\n'
                   'sglang:http_requests_total{endpoint="/metrics",method="GET"} 1.0\n'
                   '# TYPE sglang:http_responses_total counter\n'
                   'sglang:http_responses_total{endpoint="/v1/models",method="GET",status_code="200"} 1.0\n'
                   '# TYPE sglang:http_requests_active gauge\n'
                   'sglang:http_requests_active{endpoint="/metrics",method="GET"} 1.0\n')
# Requests finished (collector.py's observe_one_finished_request observes sglang:num_retractions with its token
# counter), the counters under other names.
RETRACTIONS_PAGE = ('# TYPE sglang:num_retractions histogram\n'
                    'sglang:num_retractions_bucket{le="0.0",model_name="m"} 3.0\n'
                    'sglang:num_retractions_bucket{le="+Inf",model_name="m"} 3.0\n'
                    'sglang:num_retractions_count{model_name="m"} 3.0\nsglang:num_retractions_sum{model_name="m"} 0.0\n')


class _Says(Scraper):
    """A Scraper whose server says it is SGLang (/v1/models) and answers /metrics with `page`, no /slots."""

    def __init__(self, server, page):
        super().__init__(session=None, base_url="http://x", server=server)
        self.page = page

    async def _get(self, path):
        if path == "/metrics":
            return 200, self.page
        if path == "/v1/models":
            return 200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "sglang"}]})
        return 404, ""


def test_an_sglang_page_without_its_counter_reads_0_only_when_nothing_has_finished():
    """A server that says it is SGLang but whose /metrics is not SGLang's own page (a gateway in front of it answers
    /metrics with its own families), or an SGLang page on which requests have finished but the token counter is not
    there (another version's name): before, the absent counter read 0 at every scrape, so every token served beside
    the proxy (bypass traffic) was counted as none, with no error and no flag. It must stay unknown (a failed scrape,
    counted, with the reason), as any missing counter is; only SGLang's own page with nothing finished reads 0."""
    for server in ("auto", "sglang"):
        for page in (GATEWAY_PAGE, RENAMED_PAGE, RETRACTIONS_PAGE):
            sc = _Says(server, page)
            got = [asyncio.run(sc.scrape()) for _ in range(3)]
            assert got == [None] * 3 and sc.errors == 3, (server, page, got)
            assert "sglang:generation_tokens_total" in sc.last_error, sc.last_error
        for page in ("", FRESH_PAGE, FRESH_HTTP_PAGE):
            sc = _Says(server, page)
            assert [asyncio.run(sc.scrape()) for _ in range(2)] == [0.0, 0.0] and sc.errors == 0, (server, page)


def test_an_sglang_without_enable_metrics_shows_no_server_count_not_zero(tmp_path):
    """SGLang without --enable-metrics answers /metrics 404: every scrape fails (counted, logged). The daemon still
    showed powerprof_server_tokens_generated_total 0 on its own /metrics while the server served 50 tokens beside
    the proxy: a zero for "never read". A count never read is absent."""
    import json
    import re
    import urllib.request

    from daemon_helpers import DaemonProc, sim_env
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    with SimServer(SimNVML("seed-16g", state_path=None), flavour="sglang", serve_metrics=False, decode_tok_s=200.0,
                   draft_n_max=0) as srv:
        cfg = tmp_path / "p.toml"
        cfg.write_text('[scrape]\ninterval_s = 0.1\nserver = "sglang"\n')
        d = DaemonProc(tmp_path / "data", "--config", str(cfg), "--simulate", "--upstream", srv.url,
                       "--interval", "0.25", "--flush-interval", "0.5", env=sim_env(tmp_path))
        try:
            body = {"text": "bypass", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
            req = urllib.request.Request(srv.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            assert json.loads(urllib.request.urlopen(req, timeout=60).read())["meta_info"]["completion_tokens"] == 50
            time.sleep(1.0)  # several scrapes (0.1 s apart), each failing: what the count would be is settled
            metrics = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        finally:
            rc = d.stop()
    assert rc == 0, d.output()
    assert not re.search(r"^powerprof_server_tokens_generated_total ", metrics, re.M), metrics


class _SlotsPage(Scraper):
    """A llama-server without --metrics whose /slots answers the raw texts of `pages` in turn (one per scrape)."""

    def __init__(self, pages, server="llamacpp"):
        super().__init__(session=None, base_url="http://x", server=server)
        self.pages = list(pages)

    async def _get(self, path):
        if path == "/slots":
            return 200, self.pages.pop(0)
        return (404, "")


def _real_slot(i, task, n, prompt=""):
    """One slot as llama-server shows it (its params trimmed): the running request's prompt text included."""
    return {"id": i, "id_task": task, "n_ctx": 4096, "speculative": False, "is_processing": n > 0,
            "params": {"n_predict": -1, "temperature": 0.8, "samplers": ["top_k", "top_p", "min_p", "temperature"],
                       "lora": [], "stop": []},
            "prompt": prompt, "next_token": [{"has_next_token": n > 0, "n_remain": -1, "n_decoded": n}]}


def test_a_huge_slots_page_is_refused_without_decoding_it_and_never_read_as_zero(caplog):
    # Before: a 16 MiB /slots of ~40,000 slots was decoded whole in the event loop the proxy shares (~0.15-0.25 s of
    # CPU per scrape, up to 4 scrapes a second: proxied streams stalled). Now it is refused before the decode, the
    # scrape failed (its window unscraped), said with the reason, and the next sane page counts on from the last.
    small = json.dumps([_real_slot(0, 7, 10)])
    huge = json.dumps([_real_slot(i, 100 + i, 3) for i in range((16 << 20) // len(small) + 1)])
    assert len(huge) >= 16 << 20
    c0 = time.process_time()
    json.loads(huge)
    decode_s = time.process_time() - c0
    sc = _SlotsPage([small, huge, json.dumps([_real_slot(0, 7, 25)])])
    assert _run(sc, 1) == [0.0]  # the baseline
    c0 = time.process_time()
    refused = _run(sc, 1)
    scrape_s = time.process_time() - c0
    assert refused == [None], "a page that is refused must never read as 0 tokens"
    assert sc.errors == 1 and "1024" in sc.last_error and "/slots" in sc.last_error
    assert "scraping http://x failed" in caplog.text
    # Wide margin for a loaded machine: a cheap count is ~20x cheaper than the decode it avoids.
    assert scrape_s < decode_s / 4, (scrape_s, decode_s)
    assert _run(sc, 1) == [15.0] and sc.total == 15.0  # counted on from the last page read


def test_a_slots_page_made_long_by_prompt_texts_is_still_counted():
    # Not a byte cap: 32 slots whose running requests' prompts make the page 16 MiB are read and counted.
    prompt = "the \"quoted\" prompt text, é\n" * ((16 << 20) // 32 // 30)
    pages = [json.dumps([_real_slot(i, i, 0, prompt) for i in range(32)]),
             json.dumps([_real_slot(i, i, 5, prompt) for i in range(32)])]
    assert len(pages[1]) >= 16 << 20
    sc = _SlotsPage(pages)
    assert _run(sc, 2) == [0.0, 160.0] and sc.errors == 0


def test_a_huge_slots_page_is_still_detected_as_llama_server_and_its_scrape_said_failed():
    # Before the fix's refusal reached detection, a refused /slots would have left the server undetected: scrapes that
    # returned nothing and counted no error (server_count unread, the reason nowhere).
    huge = json.dumps([_real_slot(i, i, 3) for i in range(2000)])
    sc = _SlotsPage([huge, huge], server="auto")
    assert _run(sc, 1) == [None]
    assert sc.kind == "llamacpp" and sc.errors == 1 and "1024" in sc.last_error


def test_a_prefix_cache_check_failing_at_every_scrape_is_logged_the_first_three_then_every_hundredth(caplog):
    """A fault in the check at every window logged its traceback at every scrape (each second, for as long as the
    daemon ran): the first three, then every hundredth, as the loop's other repeated faults."""
    import logging

    class FakeScraper(_FakeScraper):
        cache_hits = 5.0

    ledger = _window_ledger()

    faults = []

    def add_cache_hits(since, t, hits):
        faults.append(t)
        raise ValueError("a fault in the check")

    ledger.add_cache_hits = add_cache_hits
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon"):
        _run_scrape_loop(FakeScraper(), ledger, lambda: len(ledger.spans) >= 12, 0.01, 0.01, poll_s=0.01)
    said = [r for r in caplog.records if "prefix-cache hits failed" in r.getMessage()]
    # 3, and one more per hundred (a starved checker may see the loop run on past 100)
    assert len(ledger.spans) >= 12 and len(said) == 3 + len(faults) // 100, [r.getMessage() for r in said]
    assert "(1 so far)" in said[0].getMessage() and "(3 so far)" in said[2].getMessage()


@pytest.mark.parametrize("phase_s", [0.0, 0.25, 0.5, 0.75])
def test_the_still_scrape_loops_first_idle_scrape_is_not_later_than_the_idle_period(phase_s):
    # Still, the loop polls once a second (Cadence.poll_s) on the loop clock's grid; the last fast scrape falls on any
    # quarter second. Polled only at whole seconds, the first idle scrape after one at x.25 came 2.75 s after it, not
    # within the 2 s idle period (and its half fast period of slack). Simulated on a virtual clock, as the loop polls.
    import math

    fast_s, idle_s, scrape_s = 0.25, 2.0, 0.01
    c = Cadence(fast_s, idle_s, still_s=5.0)
    t, scrapes = 0.0, []
    busy_until = 10.0 + phase_s  # proxied requests until here: fast, then still for 5 s, then idle
    while t < 40.0:
        busy = t < busy_until
        if c.due(t, busy):
            scrapes.append(t)
            t += scrape_s
            c.scraped(t, 0.0)
        poll = c.poll_s(t, busy)
        t = (math.floor(t / poll + 1e-9) + 1) * poll + 0.001  # the next grid point, a hair late as timers are
    gaps = [b - a for a, b in zip(scrapes, scrapes[1:])]
    assert max(gaps) <= idle_s + fast_s / 2 + scrape_s + 0.01, [(round(a, 3), round(g, 3)) for a, g in zip(scrapes, gaps)]
    # and it does poll at the idle instants once idle: no more scrapes than one per idle period after the stillness
    late = [s for s in scrapes if s > busy_until + 5.0 + idle_s + 1.0]
    assert all(g >= idle_s - fast_s / 2 - 0.01 for g in (b - a for a, b in zip(late, late[1:]))), late


def test_a_reload_applies_new_scrape_periods_at_once_not_after_the_old_period(tmp_path):
    """SIGHUP from a 5 s scrape period to 0.2 s while a tag is open: the next scrape follows the reload at once.
    Before, the busy scrape loop slept out the old period (a bare sleep no waker ends): up to 5 s here, up to an
    hour with the key's largest value, of bypass tokens placed in windows the new period was set to shorten."""
    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    nvml = SimNVML("a100-40g", state_path=None)
    srv = SimServer(nvml, n_slots=4).start()
    conf = tmp_path / "pp.toml"

    def write(period_s: float) -> None:
        conf.write_text(f'[daemon]\ndata_dir = "{tmp_path / "data"}"\ninterval_s = 0.25\nflush_interval_s = 0.5\n'
                        f'restore_on_start = false\n[proxy]\nlisten = "127.0.0.1:0"\nupstream = "{srv.url}"\n'
                        f'[metrics]\nlisten = ""\n[tags]\nsocket = "{tmp_path / "pp.sock"}"\n'
                        f'[scrape]\nserver = "auto"\ninterval_s = {period_s}\nidle_interval_s = {period_s}\n')

    write(5.0)
    d = Daemon(load_config(str(conf), env={}), Rig("a100-40g", nvml=nvml, host=False), config_path=str(conf))
    scrapes: list[float] = []

    async def go():
        task = asyncio.create_task(d.run())
        while "proxy" not in d.urls or d.scraper is None:
            assert not task.done(), "the daemon ended before it listened"
            await asyncio.sleep(0.05)
        scrape = d.scraper.scrape

        async def counted():
            scrapes.append(time.monotonic())
            return await scrape()

        d.scraper.scrape = counted
        # A tag open: the loops busy (as with requests live), the scrape loop's fast sleep, which no request wakes.
        d.ledger.open_tag("reload", time.monotonic_ns(), time.time_ns())
        try:
            deadline = time.monotonic() + 30
            while not scrapes and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert scrapes, "no scrape at the old 5 s period within 30 s"
            write(0.2)
            t_reload = time.monotonic()
            d._request_reload()  # what SIGHUP runs
            while len(scrapes) < 4 and time.monotonic() - t_reload < 8:
                await asyncio.sleep(0.02)
        finally:
            d.stop_event.set()
            await asyncio.wait_for(task, 30)
        return t_reload

    try:
        t_reload = asyncio.run(asyncio.wait_for(go(), 90))
    finally:
        srv.stop()
    after = [t - t_reload for t in scrapes if t > t_reload]
    # At the new period: the first within a second of the reload (a loaded host's stalls included), not ~5 s on.
    assert len(after) >= 3 and after[0] < 1.0, (after, d.cfg.get("scrape", "interval_s"))


def test_a_windows_prefix_cache_hits_are_checked_over_every_instant_its_reads_may_have_come():
    """A hit counted between two reads of the counter is checked against the requests whose hit span (arrival to first
    token) meets the scrape window it lands in. Each window ran from the previous scrape's midpoint to this one's, but
    a read comes anywhere in its GET, and a loaded host resumes the loop late after it (a GET of 200 ms, the read at its
    start here): a request that arrived and got its first token between a read and that scrape's midpoint had its hit
    counted in the next window, which begins after its span, and it was matched to none: flagged prefix-cache-unsaid
    though its answer said it (vLLM with --enable-prompt-tokens-details, a loaded full suite). Now a window's hits are
    checked from the previous scrape's start to this one's end: every instant between the two reads."""
    reads: list[int] = []

    class SlowScraper(_FakeScraper):  # reads its counter at once, answered 0.2 s later (a loaded host)
        cache_hits = 5.0

        async def scrape(self):
            reads.append(time.monotonic_ns())
            await asyncio.sleep(0.2)
            return 1.0

    ledger = _window_ledger(hit_windows=[])
    ledger.add_cache_hits = lambda since, t, hits: ledger.hit_windows.append((since, t))
    ledger.add_server_tokens = lambda *a, **k: None
    _run_scrape_loop(SlowScraper(), ledger, lambda: len(ledger.hit_windows) >= 4)
    windows = [w for w in ledger.hit_windows if w[0] is not None]
    assert len(windows) >= 3, ledger.hit_windows
    for since, t in windows:
        # Each window spans two consecutive reads whole: the one before (its hits' earliest instant) and its own.
        assert any(since <= a and b <= t for a, b in zip(reads, reads[1:])), (since, t, reads)


def test_a_slow_scrape_while_requests_run_is_one_window_not_a_burst_after_stillness():
    """A window longer than 1.5 fast periods whose counter rose was taken for a slow (idle-period) window ending a
    stillness: its tokens were placed at its end, at the next window's rate (`burst_start_ns`), and none before. A
    loaded host makes a window long while traffic runs all along (a GET of 0.2 s, a late loop): against the real
    llama-server, a stream's 47 tokens of a 0.26 s window put in its last 0.08 s, the proxy's tokens in the 0.18 s before
    read as 45 more than the server counted, and the rise back booked 33 bypass tokens where none ran (133 counted since
    the restart for the 100 sent, the rows saying only `server_restart`: "may be low"; also 128.9, and the CI's 110).
    A window scraped at the fast period (requests live, or the counter moving) is spread over its time as any other."""
    class SlowScraper(_FakeScraper):  # every read answered 0.2 s late (a loaded host), the counter rising 10 a window
        kind = "llamacpp"

        async def scrape(self):
            await asyncio.sleep(0.2)
            return 10.0

    ledger = _window_ledger()
    _run_scrape_loop(SlowScraper(), ledger, lambda: len(ledger.spans) >= 5, 0.05, 2.0)
    windows = [w for w in ledger.spans if w[0] is not None]
    assert len(windows) >= 4, ledger.spans
    # Each window whole: its 10 tokens over its whole time, none split into a still part and a burst.
    assert all(d == 10.0 for _, _, d in windows), windows
    assert all(a[1] == b[0] for a, b in zip(windows, windows[1:])), windows


class _Pages(Scraper):
    """A Scraper whose server answers /metrics from a list of pages, one a scrape."""

    def __init__(self, pages, server="vllm"):
        super().__init__(session=None, base_url="http://x", server=server)
        self.pages = list(pages)

    async def _get(self, path):
        return 200, self.pages.pop(0)


def _vllm_page(tok: float, done: dict, running: float, waiting: float, gen: float | None = None) -> str:
    """A vLLM /metrics page as 0.32 writes it: every sample labelled, its finished requests by finish reason; `gen`:
    its finished requests' generated tokens (the vllm:request_generation_tokens histogram's _sum; None: no histogram)."""
    lines = ["# TYPE vllm:generation_tokens_total counter",
             f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {tok}',
             "# TYPE vllm:request_success_total counter"]
    lines += [f'vllm:request_success_total{{engine="0",finished_reason="{k}",model_name="m"}} {v}' for k, v in done.items()]
    lines += ["# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}',
              "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}']
    if gen is not None:
        lines += ["# TYPE vllm:request_generation_tokens histogram",
                  f'vllm:request_generation_tokens_bucket{{engine="0",le="+Inf",model_name="m"}} {sum(done.values())}',
                  f'vllm:request_generation_tokens_count{{engine="0",model_name="m"}} {sum(done.values())}',
                  f'vllm:request_generation_tokens_sum{{engine="0",model_name="m"}} {gen}']
    return "\n".join(lines) + "\n"


def test_the_scraper_reads_vllms_finished_and_running_requests_beside_its_token_counter():
    # The reconciler's proof that no bypass request ran over a quiet stretch (reconcile._judge_usage_below) rests on
    # them: finished summed over finish reasons, running and queued summed, the finished requests' generated tokens
    # (the histogram's _sum); None where the page shows no such books, or not all of them.
    sc = _Pages([_vllm_page(0, {"stop": 0, "length": 0}, 0, 0, 0), _vllm_page(40, {"stop": 1, "length": 2}, 1, 1, 30),
                 _vllm_page(60, {"stop": 2, "length": 2}, 0, 0),
                 "# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total 80\n"])
    assert _run(sc, 1) == [0.0] and sc.served == (0.0, 0.0, 0.0)
    assert _run(sc, 1) == [40.0] and sc.served == (3.0, 2.0, 30.0)
    assert _run(sc, 1) == [20.0] and sc.served is None  # no vllm:request_generation_tokens histogram
    assert _run(sc, 1) == [20.0] and sc.served is None  # an older vLLM's page: no finished-request counter


def _llamacpp_scraped_twice(slots: bool):
    """A Scraper after two scrapes of the simulated llama-server, /slots served or not."""
    import aiohttp

    from powerprof.sim.nvml import SimNVML
    from powerprof.sim.server import SimServer

    async def go(srv):
        async with aiohttp.ClientSession() as s:
            sc = Scraper(s, srv.url, "llamacpp")
            await sc.scrape()
            await sc.scrape()
            return sc

    with SimServer(SimNVML("seed-16g", state_path=None), decode_tok_s=100.0, draft_n_max=0) as srv:
        srv.serve_slots = slots
        return asyncio.run(go(srv))


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "no_slots"])
def test_a_llamacpp_scrape_says_whether_its_count_moves_every_step(slots):
    """Only a scrape that read /slots' progress has a count that moves every decode step (`Scraper.window_each_step`,
    the ledger's `count_each_step`): a still one then says nothing decoded. With `--no-slots` the counter alone moves
    only as a request ends, so a run-on still decoding read as ended (the simulated llama.cpp's rows 8 and 11 s after
    the leave +135%/+133%, unflagged)."""
    assert _llamacpp_scraped_twice(slots).window_each_step is slots


@pytest.mark.parametrize("slots", [True, False], ids=["slots", "no_slots"])
def test_a_llamacpp_scrape_hands_its_slots_tasks_to_the_ledger(slots):
    """The latest scrape's /slots as {slot id: (task id, busy)} (`Scraper.window_slots`, the ledger's `window_slots`):
    a run-on's span with no known end closes once its slot moved on. None without /slots: the ledger keeps the still
    count's rule."""
    seen = _llamacpp_scraped_twice(slots).window_slots
    if slots:
        assert seen and all(busy is False for _, busy in seen.values()), seen  # nothing sent: every slot idle
    else:
        assert seen is None
    assert slot_tasks([{"id": 0, "id_task": 7, "is_processing": True}, {"id": 1, "id_task": 3, "is_processing": False},
                       {"id": "x"}]) == {0: (7, True), 1: (3, False)}
