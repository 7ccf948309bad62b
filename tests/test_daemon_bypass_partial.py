"""Rows whose bypass count may be low say so: a late first read of the server's counters, a server restart.

Before, only the process-wide `powerprof_server_tokens_partial{reason}` gauge and a log line said the server's
count may be low; the interval rows (their `server_tokens`, `unproxied_energy_j`) and the requests beside them
looked whole. Now each interval says how far its count covers it (`server_count`), each request given energy of
such an interval says so in `energy_note` (`bypass-uncounted`), and `analyze` counts them apart (docs/daemon.md,
"The baseline"; docs/data.md, daemon_intervals)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from click.testing import CliRunner

from powerprof.analysis.fleet import fleet_summary
from powerprof.cli import main
from powerprof.daemon.ledger import Ledger
from powerprof.daemon.reconcile import LAG_SHARE, PROXY_LAG, USAGE_VOTE_S
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.scrape import Scraper
from powerprof.daemon.service import datasets
from powerprof.daemon.store import DatasetStore
from powerprof.daemon.streams import Counts

from support import LedgerReading as _R, RowSink as _Sink  # noqa: E402

S = 1_000_000_000
PER_STEP = 4


def _trace(rid, arrival_s):
    tr = RequestTrace(rid, "POST", "/completion", "t", int(arrival_s * S), int(arrival_s * S), api="llamacpp", stream=True)
    tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    return tr


def _run(restart_at_s: float | None, late_first_read_s: float | None = None, until_s: float = 16.0, down_s: float = 0.5,
         slots_only: bool = False, bypass_stride: int = 4, idle_w: float | None = None, j_per_token: float = 0.25,
         keep: list | None = None, tags: tuple = (), stall: tuple[float, float] | None = None, read_early_s: float = 0.0,
         proxied_until_s: float = np.inf, then_at_s: float | None = None, delay_s: float = 0.0,
         tail_lost_s: float = 0.0):
    """A ledger fed as the daemon feeds it: 1 s GPU samples (100 J each), scrapes every 0.25 s, proxied streams at
    160 tokens/s (four streams' worth, 4 tokens a step) and bypass traffic at 10 tokens/s from 1 s on. `restart_at_s`: the server restarts there (the old
    process's tokens after the scrape before are lost, its counter counts from 0 again) and is down `down_s` (scrapes
    fail: the restart's window spans them). `late_first_read_s`: the server's counters are first read there, after
    the daemon's ready, with tokens already counted. `slots_only`: every scrape says so (a llama-server without
    --metrics). `bypass_stride`: a bypass token every that many server steps (4: 10 tokens/s). `idle_w`: the GPU
    draws this plus `j_per_token` for every token it generates, proxied or not (the truth a J/token is held to);
    None: 100 J each second whatever ran. `keep`: the ledger is appended to it. `tags`: (name, start s, stop s) tag
    windows opened and closed at those scrape ticks. `stall`: (t0, t1) the proxy's event loop stalls (a loaded host): the
    tokens generated in [t0, t1) it sees at t1, and a scrape meanwhile finds the server's count ahead. `read_early_s`: the
    server's counter is read that long before the scrape's stamp (the daemon stamps a GET's midpoint): the proxied tokens
    of that last stretch are placed in the window, counted in the next. `proxied_until_s`: no proxied tokens from then
    on. `then_at_s`: a second restart there, down `down_s` too. `delay_s`: the proxy's loop measured that late at every
    tick (a loaded host), its tokens seen on time all the same. `tail_lost_s`: the proxied tokens of that last stretch
    before `proxied_until_s` are never counted (a llama-server without --metrics: its /slots read missed them). Returns
    (interval rows, request rows, true bypass tokens per 1 s interval)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True  # as the daemon sets it when it scrapes a server
    if keep is not None:
        keep.append(led)
    dt = 0.025
    gen = np.arange(1.0, until_s - 2.0, dt)  # server steps
    downs = [(r, r + down_s) for r in (restart_at_s, then_at_s) if r is not None] or [(np.inf, np.inf)]
    up = np.all([(gen < a) | (gen >= b) for a, b in downs], axis=0)
    bypass = gen[up][::bypass_stride]  # 10 tokens/s by default
    proxied = gen[up & (gen < proxied_until_s)]  # 160 tokens/s: 4 tokens a step (PER_STEP)
    # Streams of 2 s each through the proxy; a restart cuts the one running.
    traces, cur = [], None
    server_total = 0.0
    prev_t, prev_total = None, None
    first_read = late_first_read_s if late_first_read_s is not None else 0.5
    for k in range(int(until_s / 0.25) + 1):
        t = k * 0.25
        # When the proxy saw each token (`proxied`: when the server generated and counted it).
        seen = proxied if stall is None else np.where((proxied >= stall[0]) & (proxied < stall[1]), stall[1], proxied)
        for gen_ts, ts in zip(proxied[(seen > t - 0.25) & (seen <= t)], seen[(seen > t - 0.25) & (seen <= t)]):
            if cur is None or gen_ts - cur.arrival_ns / S >= 2.0 or any(cur.arrival_ns / S < a <= gen_ts
                                                                         for a, _ in downs):
                if cur is not None:
                    cur.end_ns = cur.end_wall_ns = cur.last_ns
                    cur.counts = Counts(generated_tokens=int(cur.tokens_seen), prompt_tokens=20, model=None,
                                        stop_reason=None, token_source="usage")
                    led.on_end(cur)
                cur = _trace(len(traces) + 1, ts - 0.01)
                traces.append(cur)
                led.on_start(cur)
            cur.first_ns = cur.first_ns or int(ts * S)
            cur.last_ns = int(ts * S)
            cur.tokens_seen += PER_STEP
            led.on_tokens(cur, int(ts * S), PER_STEP)
        if stall is None or not (stall[0] <= t < stall[1]):
            # How late the proxy's loop ran, as the daemon measures it: on time, but for a stall (nothing measured in
            # it, then its length at once).
            led.note_proxy_delay(int(t * S), t - stall[0] if stall is not None and stall[1] <= t < stall[1] + 0.25
                                 else delay_s)
        for name, t0, t1 in tags:
            if t == t0:
                led.open_tag(name, int(t * S), int(t * S))
            if t == t1:
                led.close_tag(name, int(t * S), int(t * S))
        if t == int(t):
            spent = (100.0 * t if idle_w is None else
                     idle_w * t + j_per_token * (PER_STEP * (proxied <= t).sum() + (bypass <= t).sum()))
            led.add_gpu_sample(int(t * S), int(t * S), [_R(float(spent))])
        # What the server's counter says at t: its process's tokens since it started.
        born = max([b for _, b in downs if t >= b], default=0.0)
        count = float(PER_STEP * ((proxied > born) & (proxied <= t - read_early_s)
                                  & ~((proxied > proxied_until_s - tail_lost_s) & (proxied < proxied_until_s))).sum()
                      + ((bypass > born) & (bypass <= t)).sum())
        readable = not any(a <= t < b for a, b in downs)
        if readable and t >= first_read:
            if prev_total is None:
                led.add_server_tokens(int(t * S), 0.0, None,
                                      partial=("late_baseline",) if late_first_read_s is not None and count else ())
            else:
                restarted = count < prev_total
                delta = count if restarted else count - prev_total
                led.add_server_tokens(int(t * S), delta, int(prev_t * S),
                                      partial=(("server_restart",) if restarted else ()) + (("slots_only",) if slots_only else ()))
            prev_t, prev_total = t, count
        led.advance(int(t * S))
    cur.end_ns = cur.end_wall_ns = cur.last_ns
    cur.counts = Counts(generated_tokens=int(cur.tokens_seen), prompt_tokens=20, model=None, stop_reason=None,
                        token_source="usage")
    led.on_end(cur)
    led.close_all(int(until_s * S))
    edges = np.arange(0, until_s + 1)
    true_bypass = np.histogram(bypass, bins=edges)[0].astype(float)
    return sink.rows["intervals"], sink.rows["requests"], true_bypass


def test_the_intervals_across_a_server_restart_say_their_bypass_count_may_be_low_and_the_rest_are_complete():
    rows, reqs, truth = _run(restart_at_s=6.2, down_s=2.0)
    got = {int(round(r["t_start_mono_s"])): r for r in rows}
    # The restart's window runs from the last scrape before it (6.0 s) to the first after it (8.25 s, once up):
    # the old process's bypass tokens in (6.0, 6.2] are in no count, and nothing can say how many.
    for k in (6, 7, 8):
        assert got[k]["server_count"] == "server_restart", got[k]
    for k in (2, 3, 4, 10, 11, 12):
        assert got[k]["server_count"] == "complete", (k, got[k]["server_count"])
    # The requests given energy of those intervals say so; the others do not.
    marked = {r["request_id"] for r in reqs if "bypass-uncounted" in (r["energy_note"] or "")}
    live = {r["request_id"] for r in reqs
            if r["t_arrival_utc"] / S < 9.0 and r["t_end_utc"] / S > 6.0}
    assert marked == live and marked, (marked, live)
    note = next(r["energy_note"] for r in reqs if r["request_id"] in marked)
    assert "server_restart" in note and "unproxied" in note, note


def test_bypass_traffic_after_a_restart_is_not_hidden_by_the_old_servers_lost_tail():
    """The proxy saw the old process's last proxied tokens; the new counter never counts them. The server-minus-proxy
    level fell by them at the restart, and for CREDIT_S (3 s) after it the bypass tokens only made it up again: they
    were hidden (their energy went to the proxied requests). The level now starts afresh at a restart."""
    rows, _, truth = _run(restart_at_s=6.2, down_s=0.5)
    assert [r["server_count"] for r in rows[5:8]] == ["server_restart", "server_restart", "complete"]
    # The windows just before the restart look LAG_S ahead for their level into the proxy's tokens after the last scrape
    # before it, which are the proxy's lag or this lost tail (nothing tells which: the lag case is
    # test_a_proxy_lagging_the_server_at_a_restart_makes_no_bypass_tokens_up). The tail lowers their count: the interval
    # before the restart may read low (0 of 10 here; 5 of 10 once, and it said nothing), and says so.
    assert rows[5]["server_tokens"] <= truth[5]
    after = [r for r in rows if r["t_start_mono_s"] >= 7.0 - 1e-6 and r["t_start_mono_s"] < 12.0]
    stored = sum(r["server_tokens"] for r in after)
    true = float(truth[7:12].sum())
    # Before: 35 of 50 (the old process's last 32 proxied tokens hid as many bypass tokens after it); now all.
    assert stored == pytest.approx(true), (stored, true)


def test_a_late_first_read_marks_the_intervals_before_and_across_it():
    rows, reqs, truth = _run(restart_at_s=None, late_first_read_s=3.5)
    got = {int(round(r["t_start_mono_s"])): r for r in rows}
    for k in (0, 1, 2):  # wholly before the first read, closed before it: no count at all
        assert got[k]["server_tokens"] is None and got[k]["server_count"] == "unread", got[k]
    assert got[3]["server_tokens"] is not None and got[3]["server_count"] == "late_baseline", got[3]
    assert got[3]["server_tokens"] < truth[3]  # the part before the read is in the baseline: low, and said
    for k in range(4, 12):
        assert got[k]["server_count"] == "complete", got[k]
    early = [r for r in reqs if r["t_arrival_utc"] / S < 4.0]
    later = [r for r in reqs if r["t_arrival_utc"] / S >= 5.0 and r["t_end_utc"] / S < 14.0]
    assert early and all("bypass-uncounted" in (r["energy_note"] or "") for r in early), [r["energy_note"] for r in early]
    assert any("late_baseline" in r["energy_note"] for r in early), [r["energy_note"] for r in early]
    assert later and not any("bypass-uncounted" in (r["energy_note"] or "") for r in later)


def test_intervals_without_any_count_say_why_and_a_whole_run_says_complete():
    for scraping, said in ((True, "unread"), (False, "off")):  # a server not read yet; a daemon that scrapes none
        sink = _Sink()
        led = Ledger("d", 0, 1, sink, grace_s=0.1)
        led.scraping = scraping
        for k in range(4):
            led.add_gpu_sample(k * S, k * S, [_R(100.0 * k)])
            led.advance(k * S)
        led.close_all(4 * S)
        assert [r["server_count"] for r in sink.rows["intervals"]] == [said] * 3
    rows, _, _ = _run(restart_at_s=None)
    assert {r["server_count"] for r in rows[:-1]} == {"complete"}, [r["server_count"] for r in rows]


def test_a_proxy_lagging_the_server_at_a_restart_makes_no_bypass_tokens_up():
    """The proxy sees a token a little after the server counts it (a loaded host). At the last scrape before a restart
    the server's count was ahead by that lag; the windows before a restart did not look past it for their level, so
    the lag stayed in the gap as bypass tokens that never ran, in an interval that said `complete` (against the real
    llama-server: 134 tokens counted since a restart for the 100 sent, 34 of them the proxy's lag on the stream the
    restart cut). The proxy's tokens after the last scrape are that lag or the old process's lost tail, which nothing
    tells apart: taken as lag, the count may be low there, and those intervals say so."""
    for stride in (4, 10**9):  # bypass traffic at 10 tokens/s; none at all
        # The proxy stalls for 0.2 s across the last scrape before the restart (6.0 s): 24 tokens behind there.
        rows, _, truth = _run(restart_at_s=6.2, down_s=0.5, stall=(5.85, 6.05), bypass_stride=stride)
        for r in rows[2:12]:  # from 2 s: the first bypass token (at 1.0 s) is counted in the window before its bin
            k = int(round(r["t_start_mono_s"]))
            # The 24 proxied tokens the stall held read as bypass here before: 34 where 10 ran, 24 where none did.
            assert r["server_tokens"] <= truth[k] + 1e-6, (stride, k, r["server_tokens"], truth[k], r["server_count"])
            if r["server_tokens"] < truth[k] - 1e-6:
                assert "server_restart" in r["server_count"], (stride, k, r["server_tokens"], truth[k])
        assert [r["server_count"] for r in rows[4:8]] == ["complete", "server_restart", "server_restart", "complete"]



@pytest.mark.parametrize("restart_at_s,proxied_until_s", [(None, 8.5), (None, np.inf), (6.2, 7.2), (6.2, np.inf)])
def test_a_counter_read_before_its_stamp_owes_the_proxys_tokens_and_their_recovery_is_no_bypass(restart_at_s,
                                                                                                 proxied_until_s):
    """The server's counter is read 0.1 s before the scrape's stamp (the daemon stamps a GET's midpoint; llama-server's
    /metrics is read before /slots): the proxy's last 16 tokens of each window are placed there and counted in the next,
    a negative gap that lasts while the proxy's pace does, and is recovered where its streams end. Held past CREDIT_S,
    or made the reference at a restart (the levels start afresh there, from a level whose lookahead took in the new
    process's first dip), that recovery read as 16 bypass tokens where 1 ran, in rows saying `complete`. A negative gap
    is carried forward now and netted against the rise its recovery makes."""
    rows, _, truth = _run(restart_at_s=restart_at_s, down_s=0.5, read_early_s=0.1, bypass_stride=10**9,
                          proxied_until_s=proxied_until_s)
    got = np.array([r["server_tokens"] or 0.0 for r in rows])
    assert got.sum() <= truth.sum() + 1e-6, ([(round(x, 1), r["server_count"]) for x, r in zip(got, rows)], truth)
    assert got.sum() >= truth.sum() - 1.0, ([(round(x, 1), r["server_count"]) for x, r in zip(got, rows)], truth)
    for x, r in zip(got, rows):
        k = int(round(r["t_start_mono_s"]))
        # Within a token (LAG_TOKENS): the one bypass token that ran may be booked a window late.
        assert x <= truth[k] + 1.0 or r["server_count"] != "complete", (k, x, truth[k], r["server_count"])
    # With bypass traffic beside it (10 tokens/s), every row's count that says `complete` is right to the token.
    rows, _, truth = _run(restart_at_s=restart_at_s, down_s=0.5, read_early_s=0.1, proxied_until_s=proxied_until_s)
    for r in rows[2:]:  # from 2 s: the first bypass token (at 1.0 s) is counted in the window before its bin
        k = int(round(r["t_start_mono_s"]))
        if r["server_count"] == "complete":
            assert r["server_tokens"] == pytest.approx(truth[k], abs=1.0), (k, r["server_tokens"], truth[k])


def _sim(drop: float = 0.0, drop_at: float = 5.0, until_s: float = 24.0, alt: bool = True, bypass_from: float = 1.0,
         pace_fall_at: float = np.inf, burst=None, early: float = 0.0, skip: tuple = (), every: float = 0.25,
         proxied_until: float = np.inf, keep: list | None = None, get_s: float | None = None,
         drop_until: float = np.inf, dips: tuple = ()):
    """A ledger fed with streams of 2 s through the proxy, 4 tokens a 25 ms step (2 from `pace_fall_at` on, and every
    other 0.25 s with `alt`), scraped every 0.25 s but at the times in `skip`, the counter read `early` s before its
    stamp. Bypass traffic: a token a step from `bypass_from`, or the tokens at the times `burst`. `drop`: the counter
    falls by that many at `drop_at` for good; the scraper then counts from its highest reading (as scrape.py does:
    the first dip unsaid, the next `counter_below`, each window's tokens those beyond that reading). Returns
    (interval rows, true bypass tokens per 1 s interval). `every`: the scrape interval (from a baseline at 0.5 s);
    `proxied_until`: the proxied streams' tokens end there; `keep`: the ledger is appended to it. `get_s`: each
    scrape's GET is that long, its midpoint the stamp, and the ledger is told (as the daemon tells it: `read_ns`);
    None: not told. `drop_until`: the counter is back from then on (a multi-process page's dip, not a loss). `dips`:
    further falls, (tokens, from_s, back_s) each."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    if keep is not None:
        keep.append(led)
    read = {} if get_s is None else None
    gen = np.arange(1.0, until_s - 2.0, 0.025)
    gen = gen[gen < proxied_until]
    per = np.where((np.floor(gen / 0.25).astype(int) % 2 == 1) & alt, 2, 4)
    per = np.where(gen >= pace_fall_at, 2, per)
    bypass = gen[gen >= bypass_from] if burst is None else np.asarray(burst, dtype=float)
    cur, n = None, 0
    prev_t, high, dipped = None, None, False

    def end(tr):
        tr.end_ns = tr.end_wall_ns = tr.last_ns
        tr.counts = Counts(generated_tokens=int(tr.tokens_seen), prompt_tokens=20, model=None, stop_reason=None,
                           token_source="usage")
        led.on_end(tr)
    for k in range(int(until_s / 0.25) + 1):
        t = k * 0.25
        m = (gen > t - 0.25) & (gen <= t)
        for ts, p in zip(gen[m], per[m]):
            if cur is None or ts - cur.arrival_ns / S >= 2.0:
                if cur is not None:
                    end(cur)
                n += 1
                cur = _trace(n, ts - 0.01)
                led.on_start(cur)
            cur.first_ns = cur.first_ns or int(ts * S)
            cur.last_ns = int(ts * S)
            cur.tokens_seen += int(p)
            led.on_tokens(cur, int(ts * S), int(p))
        led.note_proxy_delay(int(t * S), 0.0)
        if t == int(t):
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        count = float(per[gen <= t - early].sum() + (bypass <= t).sum()) - (drop if drop_at <= t < drop_until else 0.0)
        count -= sum(d for d, a, b in dips if a <= t < b)
        if t >= 0.5 and t not in skip and (t == 0.5 or round(t / every, 6) == int(round(t / every, 6))):
            if get_s is not None:
                read = {"read_ns": (int((t - get_s / 2) * S), int((t + get_s / 2) * S))}
            if high is None:
                led.add_server_tokens(int(t * S), 0.0, None, **read)
                high, prev_t = count, t
            elif count < high and not dipped:
                dipped = True
            elif count < high:
                led.add_server_tokens(int(t * S), 0.0, int(prev_t * S), partial=("counter_below",), **read)
                prev_t = t
            else:
                dipped = False
                led.add_server_tokens(int(t * S), count - high, int(prev_t * S), **read)
                high, prev_t = count, t
        led.advance(int(t * S))
    end(cur)
    led.close_all(int(until_s * S))
    return sink.rows["intervals"], np.histogram(bypass, bins=np.arange(0, until_s + 1))[0].astype(float)


def _wrong_complete(rows, truth, tol: float = 1.0) -> list:
    """(second, server_tokens, truth) of each row from 2 s on that says `complete` and is off by over `tol`."""
    out = []
    for r in rows:
        k = int(round(r["t_start_mono_s"]))
        if k >= 2 and r["server_count"] == "complete" and abs((r["server_tokens"] or 0.0) - truth[k]) > tol:
            out.append((k, r["server_tokens"], truth[k]))
    return out


@pytest.mark.parametrize("drop", [0.0, 200.0])
def test_a_bypass_burst_as_a_proxied_stream_ends_is_not_hidden_after_a_counter_fall(drop):
    """A 200-token fall of the counter (`counter_below`: lost for good) lowered the reference once the levels before
    it aged out, and was owed: 7 s later, where the proxy's pace fell, a 20-token bypass burst was netted against it,
    0 in a row saying `complete`. A known loss makes what is owed near it doubtful: it never nets, and where it would
    have, the row says proxy_lag."""
    rows, truth = _sim(drop=drop, alt=False, pace_fall_at=12.0, burst=12.0 + 0.00625 * np.arange(1, 21))
    assert not _wrong_complete(rows, truth)


@pytest.mark.parametrize("size", [20, 60])
def test_a_counter_fall_owed_is_not_repaid_out_of_bypass_traffic_35_s_later(size):
    """The owe had no age: 35 s after the fall, the pace's fall netted a 20-token burst against it (0, `complete`)."""
    at_s = 40.0
    rows, truth = _sim(drop=200.0, alt=False, pace_fall_at=at_s, burst=at_s + 0.002 * np.arange(1, size + 1),
                       until_s=at_s + 8)
    assert not _wrong_complete(rows, truth)


def test_a_missed_scrape_hides_no_bypass_request_as_repayment():
    """The repayment's bound compared the proxy's token counts of windows of different lengths: a missed scrape (a
    0.5 s window, then a 0.25 s one) read as the pace's fall, and a 12-token bypass request beside it was taken as the
    recovery of a read made early (0 where 12 ran), the stream's end then showing 12 that never ran, both `complete`.
    Rates are compared now."""
    rows, truth = _sim(alt=False, burst=10.3 + 0.005 * np.arange(1, 13), early=0.1, skip=(10.0,))
    assert not _wrong_complete(rows, truth)


@pytest.mark.parametrize("stride", [1, 4])
@pytest.mark.parametrize("proxied_until_s", [7.0, 7.2, 7.5, 8.0, 9.0, np.inf])
@pytest.mark.parametrize("down_s", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("read_early_s", [0.0, 0.1])
def test_a_restart_scene_books_no_wrong_count_in_a_row_saying_complete(stride, proxied_until_s, down_s, read_early_s):
    """Restarts at 6.2 s, down 0.2-1 s, the counter read on time or 0.1 s early, bypass traffic at 40 or 10 tokens/s,
    the proxy's streams ending at times around it or running on: every row saying `complete` is right to a token
    (down 0.2 s, read early, 40 tokens/s, streams running on: 12 where none ran at their end, `complete`)."""
    rows, _, truth = _run(restart_at_s=6.2, down_s=down_s, read_early_s=read_early_s, bypass_stride=stride,
                          proxied_until_s=proxied_until_s)
    bad = [(int(round(r["t_start_mono_s"])), r["server_tokens"], truth[int(round(r["t_start_mono_s"]))])
           for r in rows[2:] if r["server_count"] == "complete"
           and abs((r["server_tokens"] or 0) - truth[int(round(r["t_start_mono_s"]))]) > 1.0]
    assert not bad, bad


@pytest.mark.parametrize("stride", [1, 4])
@pytest.mark.parametrize("proxied_until_s", [11.0, np.inf])
@pytest.mark.parametrize("down_s", [0.2, 0.5])
@pytest.mark.parametrize("then_at_s", [8.2, 9.7])
def test_two_restarts_in_a_row_book_no_wrong_count_in_a_row_saying_complete(stride, proxied_until_s, down_s, then_at_s):
    """A second restart 2 or 3.5 s after the first, the counter read 0.1 s early: each restart's new process owes
    afresh (the old one's owes go with its counter). Before, 4 of these 16 scenes had a row saying `complete` off:
    12 where none ran at the streams' end, 8 where 10 ran after the second restart."""
    rows, _, truth = _run(restart_at_s=6.2, then_at_s=then_at_s, down_s=down_s, read_early_s=0.1, bypass_stride=stride,
                          proxied_until_s=proxied_until_s)
    assert not _wrong_complete(rows, truth)


def test_a_tag_windows_note_says_its_figures_may_be_off_either_way_where_its_count_may_be():
    """Its note said the count "may be low or high" (server_restart), then that unproxied_energy_j "may be low and
    gpu_j_per_token high": one way, against its own first words."""
    kept: list = []
    _run(restart_at_s=6.2, down_s=2.0, keep=kept, tags=(("across", 5.0, 10.0),))
    note = {r["name"]: r for r in kept[0].emit.rows["tags"]}["across"]["energy_note"]
    assert "may be low or high" in note and "unproxied_energy_j may be low or high" in note, note
    assert "unproxied_energy_j may be low and" not in note, note


def _read_pieces_due(led, tr, pieces, t: float) -> None:
    """The proxy's reads due in the 5 ms step ending at `t`: each (time s, tokens) piece 1 ms after it is stamped."""
    for ts, n in pieces:
        if t - 0.005 < ts + 0.001 <= t:
            tr.first_ns = tr.first_ns or int(ts * S)
            tr.last_ns = int(ts * S)
            tr.tokens_seen += n
            led.on_tokens(tr, int(ts * S), n)


@pytest.mark.parametrize("stall,down_s", [((5.2, 6.6), 1.0), ((4.8, 6.4), 0.5), ((5.0, 7.0), 1.5)])
def test_a_proxy_stalled_across_a_restart_makes_no_bypass_tokens_up(stall, down_s):
    """The proxy (its worker processes stopped, a loaded host) reads nothing from before the restart until after the
    server went down: the old process's last tokens reach it in one burst while the server is down, and the windows of
    the stall, some over LAG_S before the restart, saw the server's count run ahead. That lag read as bypass tokens that
    never ran, in rows saying `complete` or only that their count may be low (against the real llama-server, its
    proxy's two workers stopped 0.4 s across the restart: 230 counted since it for the 100 sent; here 48, 71 and 119
    where none ran). Every interval's count now errs low, never high, and says server_restart where it was lowered."""
    for stride in (4, 10**9):  # bypass traffic at 10 tokens/s; none at all
        rows, _, truth = _run(restart_at_s=6.2, down_s=down_s, stall=stall, bypass_stride=stride)
        for r in rows[2:12]:
            k = int(round(r["t_start_mono_s"]))
            assert r["server_tokens"] <= truth[k] + 1e-6, (stride, k, r["server_tokens"], truth[k], r["server_count"])
            if r["server_tokens"] < truth[k] - 1e-6:
                assert "server_restart" in r["server_count"], (stride, k, r["server_tokens"], truth[k])
        # From the second after the restart's window on, the count is whole again.
        after = [r for r in rows if 6.2 + down_s + 1.0 <= r["t_start_mono_s"] < 13.0]
        assert after and all(r["server_count"] == "complete" for r in after), [r["server_count"] for r in after]
        k0 = int(after[0]["t_start_mono_s"] + 0.5)
        assert sum(r["server_tokens"] for r in after) == pytest.approx(truth[k0:k0 + len(after)].sum())


def _worker_stalled_across_restart(rate: float, stall_s: float, stop_s: float, read_s: float, down_s: float,
                                  first_n: int = 0, arrival_s: float = 0.95, first_read_s: float | None = None,
                                  phase_s: float = 0.0, checks: dict | None = None, split_s: float | None = None):
    """A ledger fed as the daemon feeds it from proxy worker processes: one stream of `rate` tokens/s from 1 s, shipped
    in 20 ms records, scrapes every 0.1 s, 0.25 s GPU samples. The worker is stopped at 1.5 s (a loaded host), the server
    `stall_s + stop_s` later (its stop took `stop_s`); the worker resumes then and reads the old process's last tokens
    `read_s` later, in one burst stamped then (its record says so; its heartbeat held the intervals). The server is back
    `down_s` after its stop; 0.3 s after the scrape that tells the restart, 100 bypass tokens run at 400/s. Returns the
    interval rows (the only bypass tokens: those 100).
    `first_n`: the stream's first piece holds its first that many tokens (a loaded host: a burst). `arrival_s`: when it
    arrived. `first_read_s`: the counters were read once at 0.5 s (the baseline, before the daemon's ready: no window),
    and the scrape loop's first pass came only at that time (a loaded host). `phase_s`: the scrapes' offset. `checks`:
    filled with the proxied tokens each scrape window held when resolved (`windows`: (start s, end s, tokens)) and the
    tokens listed for the stream in all (`listed`) and placed for it (`placed`) at its end. `split_s`: the worker reads
    those last tokens in two pieces, the second (half of them) that much after the first, and the stream ends with it."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    gen = 1.0 + np.arange(450) / rate  # when the old process generated (and counted) each token
    stop = 1.5 + stall_s + stop_s
    gen = gen[gen < stop]
    t_read, up = stop + read_s, stop + down_s
    early = gen[gen < 1.48]  # shipped on time, 20 ms at a time
    first, rest = early[:first_n], early[first_n:]
    pieces = [(float(first.max()) + 0.003, int(first.size))] if first_n else []
    pieces += [(float(rest[b == i].max()) + 0.003, int((b == i).sum()))
               for b in [np.floor((rest - 1.0) / 0.02 + 1e-9)] for i in np.unique(b)]
    tail = int(gen.size - early.size)
    if split_s is None:
        pieces.append((t_read, tail))
    else:
        pieces += [(t_read, tail - tail // 2), (t_read + split_s, tail // 2)]
    t_end = pieces[-1][0]
    tr = RequestTrace(1, "POST", "/completion", None, int(arrival_s * S), int(arrival_s * S), api="llamacpp", stream=True)
    led.on_start(tr)
    if checks is not None:
        checks["windows"] = []
        resolve = led.recon.resolve_spans

        def spied(upto_ns, force=False):  # each window's proxied tokens, as the ledger held them when it resolved it
            todo = [sp for sp in led.recon.server_spans if sp.bypass_tokens is None]
            resolve(upto_ns, force)
            checks["windows"] += [(sp.t0_ns / S, sp.t1_ns / S,
                                   sum(n for t, n in led.recon.proxied if sp.t0_ns < t <= sp.t1_ns))
                                  for sp in todo if sp.bypass_tokens is not None]
        led.recon.resolve_spans = spied
    prev_t = prev_total = told = bypass = None
    prev_old = True
    for k in range(int((max(t_end, up) + 6) / 0.005)):
        t = round(k * 0.005, 6)
        _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= t_end + 0.001:  # cut by the restart: ended with the burst, no counts
            tr.end_ns = tr.end_wall_ns = int(t_end * S)
            tr.counts = Counts(generated_tokens=None, prompt_tokens=None, model=None, stop_reason=None,
                               token_source="stream")
            led.on_end(tr)
            if checks is not None:
                r = led.requests[1]
                checks["listed"] = sum(n for _, n in led.recon.proxied)
                checks["placed"] = r.spent + sum(r.ev_n) + r.late
        if told is not None and bypass is None and t >= told + 0.3:
            bypass = t + np.arange(100) / 400.0
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        # The scrape loop's first pass after the baseline comes at `first_read_s` (none before it).
        waiting = first_read_s is not None and prev_t is not None and led.recon.server_upto_ns is None and t < first_read_s
        if (k - round(phase_s / 0.005)) % 20 == 0 and t >= 0.5 and (t < stop or t >= up) and not waiting:
            count = float((gen <= t).sum()) if t < stop else float(0 if bypass is None else (bypass <= t).sum())
            restarted = prev_t is not None and t >= up and prev_old
            if prev_t is None and first_read_s is None:
                led.add_server_tokens(int(t * S), 0.0, None)
            elif prev_t is None:
                pass  # the baseline, read before the daemon's ready: the count starts there, no window yet
            else:
                led.add_server_tokens(int(t * S), count if restarted else count - prev_total, int(prev_t * S),
                                      partial=("server_restart",) if restarted else ())
            told = t if restarted else told
            prev_t, prev_total, prev_old = t, count, t < stop
        held = 1.48 <= t < t_read + 0.001  # the stopped worker's heartbeat holds the intervals
        led.advance(int(t * S), int((1.48 if held else t) * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"])


@pytest.mark.parametrize("rate,stall_s,stop_s,read_s,down_s", [
    # Before: bypass tokens counted before the restart's first marked interval where none ran, and since it for 100.
    (300, 1.0, 0.02, 1.5, 3.0),  # the burst read with the server down, the stall over LAG_S long: 94, and 115
    (150, 1.0, 1.0, 1.5, 3.0),  # a slow stop: 82, and 103
    (300, 0.4, 1.0, 3.0, 0.5),  # read once the new process ran the bypass traffic: 76, and 28
])
def test_a_proxy_workers_burst_read_across_a_restart_is_placed_where_the_old_process_counted_it(
        rate, stall_s, stop_s, read_s, down_s):
    """The stopped worker reads the old process's last tokens in one burst, placed back over the stall at the server's
    pace (`_held_burst`). The time after the latest scrape (the server down, unknown then) was taken at the last
    window's pace: it took most of the tokens, and the stall's windows, where the server had counted them, got too few:
    their rise read as bypass tokens that never ran, in rows saying `complete` (94 before the restart, none ran). Read after the new
    process had run bypass traffic, they were placed at its pace, over those windows: the bypass tokens hid there and
    the old ones read as bypass before the restart. Now the bypass count is the 100 tokens that ran, after the restart,
    and nowhere high."""
    rows = _worker_stalled_across_restart(rate, stall_s, stop_s, read_s, down_s)
    said = [i for i, r in enumerate(rows) if "server_restart" in (r["server_count"] or "")]
    assert said, [r["server_count"] for r in rows]
    before = sum(r["server_tokens"] or 0 for r in rows[:said[0]])
    since = sum(r["server_tokens"] or 0 for r in rows[said[0]:])
    after = [r for r in rows[said[-1] + 1:]]
    # The first token, counted by the server 3 ms before the proxy saw it, may read as 1 bypass token at 1 s.
    assert before <= 1.0 + 1e-6 and since == pytest.approx(100, abs=1e-6), (before, since)
    assert sum(r["server_tokens"] for r in after) == pytest.approx(100, abs=1e-6)
    assert {r["server_count"] for r in after} == {"complete"}


# A small deterministic sweep: (tokens/s, arrival s, stall s, read after the stop s, down s, the scrapes' offset s).
_FIRST_BURST_SWEEP = [(300, 0.95, 0.4, 0.05, 0.5, 0.0), (300, 0.5, 1.0, 0.05, 2.0, 0.05), (100, 0.95, 1.0, 0.6, 0.5, 0.0),
                      (100, 0.5, 0.4, 0.6, 2.0, 0.05), (300, 0.95, 1.0, 0.6, 0.5, 0.05), (100, 0.95, 0.4, 0.05, 2.0, 0.0)]


def _assert_read_across_the_restart(rows, checks, rate, stall_s, case) -> None:
    """What a stalled-across-a-restart feed must read: every token of the stream placed and listed once, no window
    below zero proxied tokens, and the only bypass traffic (100 tokens after the restart) counted there alone."""
    assert not [w for w in checks["windows"] if w[2] < -1e-6], (case, checks["windows"])
    truth = float(((1.0 + np.arange(450) / rate) < 1.5 + stall_s + 0.02).sum())
    assert checks["placed"] == pytest.approx(truth) and checks["listed"] == pytest.approx(truth), (case, checks)
    said = [i for i, r in enumerate(rows) if "server_restart" in (r["server_count"] or "")]
    assert said, (case, [r["server_count"] for r in rows])
    before = sum(r["server_tokens"] or 0 for r in rows[:said[0]])
    since = sum(r["server_tokens"] or 0 for r in rows[said[0]:])
    # The first token may read as 1 before (the server counts it before the proxy sees it), and a window's share of a
    # first burst move a token or two between windows, in marked rows.
    assert before <= 2.0 and since == pytest.approx(100, abs=3), (case, before, since)
    after = rows[said[-1] + 1:]
    assert sum(r["server_tokens"] for r in after) == pytest.approx(100, abs=1e-6), case
    # The last interval may end past the last scrape (this feed stops without the daemon's final read): marked so.
    assert {r["server_count"] for r in after} - {"unscraped"} == {"complete"}, case


@pytest.mark.parametrize("first_read_s", [None, 1.2, 1.4])
def test_a_stream_whose_first_piece_was_a_burst_stalled_across_a_restart_books_no_phantom_bypass(first_read_s):
    """Its first piece already a burst (31 tokens: a loaded host), its worker stopped across a server restart: at its end
    its tokens before the stall are placed again from its arrival (`_first_burst`), their first placing taken out of the
    scrape windows' list. The scrape loop's first pass after the baseline read (a loaded host: `first_read_s`) came
    after its first pieces, which were in no list: taken out all the same, the first window held -25 (and -10) proxied
    tokens, counted as bypass tokens that never ran (since the restart 131 and 179 for the 100 sent; against the real
    llama-server 156, the test's one failing run in 14). Now every window holds what was placed there (never negative),
    the stream's listed tokens are its tokens, and the bypass count is the truth, within 2 tokens in marked rows."""
    for rate, arrival_s, stall_s, read_s, down_s, phase_s in _FIRST_BURST_SWEEP:
        case = (rate, arrival_s, stall_s, read_s, down_s, phase_s, first_read_s)
        checks: dict = {}
        rows = _worker_stalled_across_restart(rate, stall_s, 0.02, read_s, down_s, first_n=31, arrival_s=arrival_s,
                                              first_read_s=first_read_s, phase_s=phase_s, checks=checks)
        _assert_read_across_the_restart(rows, checks, rate, stall_s, case)


# (tokens/s, stall s, read after the stop s, down s, first piece's tokens, the scrapes' offset s): both pieces read once
# the server is back, the second 0.3 s after the first. The second case's scrapes fall just after each 20 ms record: 4
# bypass tokens before the restart where none ran, until a record's tokens were placed over its 20 ms (a constant proxy
# lag; test_a_steady_streams_constant_proxy_lag_...).
_TWO_PIECE_SWEEP = [(300, 1.0, 2.1, 2.0, 0, 0.0), (300, 1.0, 2.1, 2.0, 0, 0.05), (300, 0.4, 0.6, 0.5, 31, 0.0),
                    (100, 1.0, 1.5, 0.5, 0, 0.0), (100, 0.4, 3.0, 2.0, 31, 0.05), (100, 1.0, 0.6, 0.5, 31, 0.05),
                    (100, 0.4, 1.5, 0.5, 0, 0.05)]


def test_a_stalled_workers_two_pieces_read_after_a_restart_are_placed_where_the_old_process_counted_them():
    """The stopped worker reads the old process's last tokens in two pieces 0.3 s apart, both once the server is back.
    The first was placed no later than the first scrape after the restart; the second, placed from the first piece's
    read on, fell in the new process's windows, at its pace (the restart's cut applied only to a placing that began
    before the restart's window ended): the stall's windows, where the old process had counted it, read it as bypass
    tokens that never ran (up to 117 before the restart), and it hid the new process's bypass tokens (48 to 95 of 100
    after the restart's marked rows, `complete`). Now every token of a request that arrived before a restart is placed
    no later than the first scrape after it, and windows closed without them say `server_restart`."""
    for rate, stall_s, read_s, down_s, first_n, phase_s in _TWO_PIECE_SWEEP:
        case = (rate, stall_s, read_s, down_s, first_n, phase_s)
        checks: dict = {}
        rows = _worker_stalled_across_restart(rate, stall_s, 0.02, read_s, down_s, first_n=first_n, phase_s=phase_s,
                                              checks=checks, split_s=0.3)
        _assert_read_across_the_restart(rows, checks, rate, stall_s, case)


def _one_request_across_restart(arrival_s: float, gen: np.ndarray, pieces: list, non_stream: bool = False,
                                stop_s: float = 2.59, up_s: float = 3.09):
    """A ledger fed as `_worker_stalled_across_restart` feeds it, for one request the old process served: it generated
    (and counted) its tokens at `gen` (s); a stalled proxy worker reads them in `pieces` ((stamp s, tokens); a
    non-streamed body: (first s, 0) then (read s, tokens), as `proxy._body_done` dates it), its heartbeat holding the
    intervals from its piece before the last (or the arrival) to the last. The server dies at `stop_s` and is back at
    `up_s` (its counter from 0); 0.3 s after the scrape that tells the restart, 100 bypass tokens run at 400/s (the
    only bypass traffic). Scrapes every 0.1 s from 0.5 s, GPU samples every 0.25 s. Returns (interval rows, the bypass
    tokens' times)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    tr = RequestTrace(1, "POST", "/completion", None, int(arrival_s * S), int(arrival_s * S), api="llamacpp",
                      stream=not non_stream)
    if non_stream:
        tr.extra["spread"] = True
    led.on_start(tr)
    t_end = pieces[-1][0]
    stalled = (pieces[-2][0] if len(pieces) > 1 else arrival_s, t_end + 0.001)
    prev_t = prev_total = told = None
    bypass = np.array([])
    prev_old = True
    for k in range(int((max(t_end, up_s) + 6) / 0.005)):
        t = round(k * 0.005, 6)
        if non_stream:  # the body's first instant and tokens are known at once, at its read
            if tr.end_ns is None and t >= t_end + 0.001:
                tr.first_ns, tr.last_ns, tr.tokens_seen = int(pieces[0][0] * S), int(t_end * S), int(pieces[-1][1])
        else:
            _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= t_end + 0.001:
            tr.end_ns = tr.end_wall_ns = int(t_end * S)
            tr.counts = Counts(generated_tokens=None, prompt_tokens=None, model=None, stop_reason=None,
                               token_source="stream")
            led.on_end(tr)
        if told is not None and not bypass.size and t >= told + 0.3:
            bypass = t + np.arange(100) / 400.0
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 20 == 0 and t >= 0.5 and (t < stop_s or t >= up_s):
            count = float((gen <= t).sum()) if t < stop_s else float((bypass <= t).sum())
            restarted = prev_t is not None and t >= up_s and prev_old
            if prev_t is None:
                led.add_server_tokens(int(t * S), 0.0, None)
            else:
                led.add_server_tokens(int(t * S), count if restarted else count - prev_total, int(prev_t * S),
                                      partial=("server_restart",) if restarted else ())
            told = t if restarted else told
            prev_t, prev_total, prev_old = t, count, t < stop_s
        held = stalled[0] <= t < stalled[1]
        led.advance(int(t * S), int((stalled[0] if held else t) * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"]), bypass


def _assert_never_high_and_low_only_marked(rows, bypass, case, exact: bool) -> None:
    """Each interval's bypass count against the truth (`bypass`' tokens in it): never high, low only where its row says
    `server_restart` (a token of margin: the server counts a token a step before the proxy sees it). `exact`: also the
    100 bypass tokens counted since the restart's first marked row, none before it, and the rows after the marked ones
    `complete` and whole."""
    for r in rows:
        truth = float(((bypass >= r["t_start_mono_s"]) & (bypass < r["t_start_mono_s"] + r["duration_s"])).sum())
        got = r["server_tokens"] or 0.0
        assert got <= truth + 1.0, (case, r["t_start_mono_s"], got, truth, r["server_count"])
        if got < truth - 1.0:
            assert "server_restart" in (r["server_count"] or ""), (case, r["t_start_mono_s"], got, truth)
    if exact:
        said = [i for i, r in enumerate(rows) if "server_restart" in (r["server_count"] or "")]
        assert said, (case, [r["server_count"] for r in rows])
        before = sum(r["server_tokens"] or 0 for r in rows[:said[0]])
        since = sum(r["server_tokens"] or 0 for r in rows[said[0]:])
        assert before <= 1.0 and since == pytest.approx(100, abs=2), (case, before, since)
        after = rows[said[-1] + 1:]
        assert sum(r["server_tokens"] or 0 for r in after) == pytest.approx(100, abs=2), case
        assert {r["server_count"] for r in after} - {"unscraped"} == {"complete"}, case


@pytest.mark.parametrize("read_s,body_s", [(3.2, None), (4.0, None), (3.2, 1.59), (4.0, 1.59)])
def test_a_non_streamed_answer_of_the_old_process_read_after_a_restart_is_placed_where_it_was_counted(read_s, body_s):
    """A non-streamed answer the old process decoded (300 tokens/s from 1.0 s until it died at 2.59 s), its body read
    by a stalled worker once the new process ran (3.2 s, 4.0 s). Its tokens were spread over [first, last] (from the
    arrival, or from the read less llama.cpp's decode time), the restart's cut never applied: with timings, read at
    4.0 s, 225 bypass tokens before the restart where none ran (rows `complete`) and 0 of the 100 after it; without,
    98 and 2. Now placed no later than the restart's first scrape, at the old process's pace: 0 and 100."""
    gen = np.arange(1.0, 2.59, 1 / 300.0)
    first_s = 0.95 if body_s is None else read_s - body_s  # as proxy._body_done dates it
    rows, bypass = _one_request_across_restart(0.95, gen, [(first_s, 0), (read_s, int(gen.size))], non_stream=True)
    _assert_never_high_and_low_only_marked(rows, bypass, (read_s, body_s), exact=True)


@pytest.mark.parametrize("read_s", [3.2, 4.0])
@pytest.mark.parametrize("non_stream", [False, True])
def test_a_request_that_arrived_inside_a_restarts_scrape_window_books_no_bypass_unmarked(read_s, non_stream):
    """A stream that arrived at 2.505 s, after the last scrape before the server died (2.5 s, dead at 2.59 s): either
    process may have served it, and nothing tells which. Here the old one did (25 tokens), and a stalled worker read
    them at once after the restart: the cut applied only to requests that arrived before the restart's window began,
    so they were spread into the new process's windows, hiding its bypass traffic (75 of 100 counted read at 4.0 s,
    rows `complete`; a non-streamed body so, 89 of 100). Now the windows such a request's tokens are placed back over
    (and CREDIT_S after its last) say `server_restart`: low, if anything, and said."""
    gen = np.arange(2.51, 2.59, 1 / 300.0)
    pieces = [(2.505, 0), (read_s, int(gen.size))] if non_stream else [(read_s, int(gen.size))]
    rows, bypass = _one_request_across_restart(2.505, gen, pieces, non_stream=non_stream)
    _assert_never_high_and_low_only_marked(rows, bypass, (read_s, non_stream), exact=False)


def test_tokens_of_a_request_from_before_a_restart_read_after_its_windows_closed_go_to_no_new_window():
    """A stream served by the old process (100 tokens/s from 1 s, the server down at 1.5 s, back by 2.0 s) whose
    worker reads 5 more tokens at 3.5 s, after the restart's window and its intervals closed (the windows are pruned
    then): placed at 3.5 s they fell in the new process's windows as proxied tokens, where they would hide its bypass
    tokens. Now they are placed at the restart's first scrape, late (said on the request's row), in no later window."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3, prompt_hold_s=0.5, max_hold_s=0.5)
    led.scraping = True
    tr = RequestTrace(1, "POST", "/completion", None, int(0.95 * S), int(0.95 * S), api="llamacpp", stream=True)
    led.on_start(tr)
    gen = 1.0 + np.arange(50) / 100.0
    for k in range(800):
        t = round(k * 0.005, 6)
        if t in gen or t == 3.5:
            n = 1 if t < 3.5 else 5
            tr.first_ns, tr.last_ns = tr.first_ns or int(t * S), int(t * S)
            tr.tokens_seen += n
            led.on_tokens(tr, int(t * S), n)
        if t == 3.505:
            tr.end_ns = tr.end_wall_ns = int(3.5 * S)
            tr.counts = Counts(generated_tokens=None, prompt_tokens=None, model=None, stop_reason=None,
                               token_source="stream")
            led.on_end(tr)
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 20 == 0 and t >= 0.5 and not 1.5 <= t < 2.0:
            if t == 0.5:
                led.add_server_tokens(int(t * S), 0.0, None)
            elif t == 2.0:  # the new process's first scrape: nothing counted yet
                led.add_server_tokens(int(t * S), 0.0, int(1.4 * S), partial=("server_restart",))
            else:
                led.add_server_tokens(int(t * S), float(((gen > t - 0.1 + 1e-9) & (gen <= t)).sum()),
                                      int((t - 0.1) * S))
        led.advance(int(t * S), int(t * S))
    led.close_all(int(4.0 * S))
    rows = sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"])
    assert sum(r["proxy_tokens"] for r in rows if r["t_start_mono_s"] >= 2.0 - 1e-9) == 0, rows
    [req] = sink.rows["requests"]
    assert "5 token(s) arrived after their interval had closed" in (req["error"] or ""), req


def test_a_window_whose_placed_proxied_tokens_came_out_below_none_is_marked_not_counted_as_bypass(caplog):
    """The guard behind the invariant above: should a placing ever take out of a scrape window more of the proxy's tokens
    than were listed there (a fault: simulated here by a listed -50 in a window of 20), the window's rise read as
    bypass tokens that never ran (50 here, rows `complete`). Now it books none there, says `misplaced` in
    server_count on its intervals (their requests leave J/token, `bypass-uncounted`) and logs the fault."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    tr = RequestTrace(1, "POST", "/completion", None, int(0.9 * S), int(0.9 * S), api="llamacpp", stream=True)
    led.on_start(tr)
    count, prev = 0, None
    for k in range(601):  # 10 ms steps to 6 s: 200 tokens/s from 1 s to 4 s, no bypass traffic
        t = round(k * 0.01, 6)
        if 1.0 <= t < 4.0:
            tr.first_ns = tr.first_ns or int(t * S)
            tr.last_ns = int(t * S)
            tr.tokens_seen += 2
            count += 2
            led.on_tokens(tr, int(t * S), 2)
        if t >= 4.0 and tr.end_ns is None:
            tr.end_ns = tr.end_wall_ns = tr.last_ns
            tr.counts = Counts(generated_tokens=count, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
            led.on_end(tr)
        if t == 2.05:
            led.recon.proxied.append((int(t * S), -50.0))  # the fault
        if k % 25 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 10 == 0 and t >= 0.5:
            led.add_server_tokens(int(t * S), 0.0 if prev is None else float(count - prev[1]),
                                  None if prev is None else int(prev[0] * S))
            prev = (t, count)
        led.advance(int(t * S))
    led.close_all(int(6.0 * S))
    rows = sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"])
    assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(0, abs=1e-6), [r["server_tokens"] for r in rows]
    marked = [r["t_start_mono_s"] for r in rows if "misplaced" in (r["server_count"] or "")]
    assert marked == [2.0], [(r["t_start_mono_s"], r["server_count"]) for r in rows]
    assert {r["server_count"] for r in rows if 1.0 <= r["t_start_mono_s"] < 5.0 and r["t_start_mono_s"] != 2.0} == {
        "complete"}
    assert any("below none" in m for m in caplog.messages), caplog.messages
    (req,) = sink.rows["requests"]
    assert "bypass-uncounted" in (req["energy_note"] or "") and "misplaced" in req["energy_note"], req["energy_note"]


# --- the scraper: what tells a restart ------------------------------------------------------------------------------


class _Page(Scraper):
    def __init__(self, kind, pages):
        super().__init__(session=None, base_url="http://x", server=kind)
        self.pages = list(pages)

    async def _get(self, path):
        return 200, self.pages.pop(0)


def _vllm(tokens, start_s=None):
    page = f"# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name=\"m\"}} {tokens}\n"
    if start_s is not None:
        page += f"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {start_s}\n"
    return page


def _scrapes(sc, n):
    async def go():
        out = []
        for _ in range(n):
            out.append((await sc.scrape(), sc.window_partial))
        return out

    return asyncio.run(go())


def test_a_restart_is_told_by_the_counter_going_back_or_by_a_new_process_start_time(caplog):
    back = _Page("vllm", [_vllm(1000), _vllm(1100), _vllm(40)])
    # A new vLLM process that counted more than the old reading before the first scrape after it: its start time.
    passed = _Page("vllm", [_vllm(100, 1e9), _vllm(150, 1e9), _vllm(400, 1e9 + 30)])
    with caplog.at_level(logging.WARNING, logger="powerprof.daemon.scrape"):
        assert _scrapes(back, 3) == [(0.0, ()), (100.0, ()), (40.0, ("server_restart",))]
        assert _scrapes(passed, 3) == [(0.0, ()), (50.0, ()), (400.0, ("server_restart",))]
    assert "server_restart" in back.partial and "server_restart" in passed.partial
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("restarted" in m and "unproxied" in m for m in said), said


def test_a_restart_nothing_can_tell_is_the_documented_limit():
    """SGLang's page has no process start time (nor has llama.cpp's): a new process whose counter has passed the old
    reading by the first scrape after it reads as traffic. Pinned here as the limit docs/daemon.md states."""
    sg = "# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{{model_name=\"m\"}} {}\n"
    sc = _Page("sglang", [sg.format(100), sg.format(150), sg.format(400)])
    assert _scrapes(sc, 3) == [(0.0, ()), (50.0, ()), (250.0, ())]
    assert "server_restart" not in sc.partial


def test_a_restart_the_proxys_refused_connects_saw_is_said_where_no_scrape_found_it_down():
    """The limit's scene (100, 150, a restart no scrape saw, 400) where the daemon's proxy forwards to the same server
    and its connects were refused between the second and third pages: that is the server found down, as a refused
    scrape is. Before, the proxy's refusals were not the scraper's: 250 counted in a window said whole; now the count
    kept (no token made up) and said (counter_below), the window's death proven (refused). A refusal before the last
    believed page's answer was read says nothing of the page after it."""
    import time

    sg = "# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{{model_name=\"m\"}} {}\n"
    box: list = []

    def take():
        out = list(box)
        box.clear()
        return out

    async def go(early):
        sc = _Page("sglang", [sg.format(100), sg.format(150), sg.format(400), sg.format(450)])
        sc.refusals = take
        out = []
        for i in range(4):
            if i == 1 and early:
                await asyncio.sleep(0.002)  # 150 is past FASTEST_SERVER_TOKENS_PER_S x the time since only within 150 µs
                box.append(int(time.monotonic() * 1e9))  # before the second page: taken at its scrape, said there
            out.append((await sc.scrape(), sc.window_partial, sc.window_down_refused))
            if i == 1 and not early:
                await asyncio.sleep(0.002)
                box.append(int(time.monotonic() * 1e9))  # after the second page's answer, before the third's GET
                await asyncio.sleep(0.002)
        return out, sc

    got, sc = asyncio.run(go(early=False))
    assert got == [(0.0, (), False), (50.0, (), False), (250.0, ("counter_below",), True), (50.0, (), False)], got
    assert "counter_below" in sc.partial and sc.restarts == 0
    got, sc = asyncio.run(go(early=True))
    assert got[2] == (250.0, (), False) and got[1] == (50.0, ("counter_below",), True), got


# --- analyze: uncertain intervals and requests are counted apart, never folded in silently ---------------------------

T0_NS = 1_768_478_400 * 10**9


def _node(root, with_column=True):
    store = DatasetStore(root, datasets(), host="node-0")
    ivals = []
    for i in range(20):
        row = {"daemon_id": "d0", "t_start_utc": T0_NS + i * S, "t_end_utc": T0_NS + (i + 1) * S, "t_start_mono_s": float(i),
               "duration_s": 1.0, "kind": "decode", "gpu_energy_j": 300.0}
        if with_column:
            row["server_count"] = "server_restart" if i in (6, 7) else "complete"
        ivals.append(row)
    reqs = [{"daemon_id": "d0", "request_id": i, "t_arrival_utc": T0_NS + i * S, "outcome": "ok",
             "generated_tokens": 100, "gpu_energy_j": 900.0 if i in (6, 7) else 100.0, "attributed_tokens": 100.0,
             "ttft_s": 0.1, "energy_note": ("bypass-uncounted: 100% of its GPU energy ..." if i in (6, 7) else None)}
            for i in range(10)]
    store.append("intervals", ivals)
    store.append("requests", reqs)
    assert store.flush()


def test_analyze_counts_intervals_whose_bypass_count_may_be_low_and_leaves_their_requests_out_of_j_per_token(tmp_path):
    _node(tmp_path / "n")
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["bypass_uncertain_intervals"] == 2 and r["bypass_uncertain_gpu_energy_j"] == pytest.approx(600.0)
    assert r["bypass_unknown_intervals"] == 0
    assert r["gpu_j_per_token"] == pytest.approx(1.0)  # the 8 requests whose count covered them whole
    assert r["bypass_uncertain_requests"] == 2
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    assert "node-0: 2 intervals" in res.stderr and "server_restart" in res.stderr, res.stderr
    assert "bypass-uncounted" in res.stderr, res.stderr


def test_analyze_reads_intervals_written_before_the_column_as_unknown_not_complete(tmp_path):
    _node(tmp_path / "n", with_column=False)
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["bypass_unknown_intervals"] == 20 and r["bypass_uncertain_intervals"] == 0
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0 and "node-0: 20" in res.stderr and "unknown" in res.stderr, res.stderr


def test_a_slots_only_server_marks_its_intervals_but_leaves_its_requests_in_j_per_token():
    # Every interval of a llama-server without --metrics (its default) may miss bypass tokens; flagging each request
    # would leave all of them out of J/token for a loss only bypass traffic causes. The intervals say it.
    rows, reqs, _ = _run(restart_at_s=None, slots_only=True)
    counted = [r for r in rows if r["server_tokens"] is not None and r["t_start_mono_s"] < 12]
    assert counted and all(r["server_count"] == "slots_only" for r in counted), [r["server_count"] for r in counted]
    assert reqs and not any("bypass-uncounted" in (r["energy_note"] or "") for r in reqs
                            if r["t_end_utc"] < 12 * S), [r["energy_note"] for r in reqs]


@pytest.mark.parametrize("tail_lost_s", [0.2, 0.0])
def test_a_slots_only_servers_intervals_on_a_loaded_host_do_not_say_a_lag_may_have_hidden_bypass_tokens(tail_lost_s):
    """The proxy's loop measured 50 ms late throughout (a loaded host), a llama-server without --metrics, its /slots
    missing the last `tail_lost_s` of the proxied traffic: where that traffic ends, the lag the levels held falls, and
    the gap with it (the lost tail, or the lag itself): read as bypass tokens the lag may have hidden (count low), which
    `slots_only` says already. Before, 2 intervals (1 without a lost tail) said `proxy_lag,slots_only` and 2 rows
    bypass-uncounted, left out of J/token (a real llama-server beside two CPU hogs: 2 runs in 6,
    tests/test_real_llama_server.py). A lag that may have made bypass tokens (count high) still says proxy_lag."""
    rows, reqs, _ = _run(restart_at_s=None, slots_only=True, proxied_until_s=7.0, delay_s=0.05, tail_lost_s=tail_lost_s)
    counted = [r for r in rows if r["server_tokens"] is not None and r["t_start_mono_s"] < 12]
    assert counted and all(r["server_count"] == "slots_only" for r in counted), [r["server_count"] for r in counted]
    assert reqs and not any("bypass-uncounted" in (r["energy_note"] or "") for r in reqs), \
        [r["energy_note"] for r in reqs]
    # The high side kept: a 0.3 s stall's lag read as bypass tokens where the proxy catches up.
    rows, _, _ = _run(restart_at_s=None, slots_only=True, stall=(3.0, 3.3))
    assert sum(r["server_count"] == "proxy_lag,slots_only" for r in rows) == 2, [r["server_count"] for r in rows]


# --- the live J/token gauge: the rule analyze follows ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["late_baseline", "server_restart"])
def test_the_live_j_per_token_leaves_out_intervals_whose_bypass_count_may_be_low_and_counts_them(case):
    """The GPU draws 50 W plus 0.25 J a token, proxied or bypass alike, and bypass traffic is a fifth of the tokens:
    every token's true share is 0.5 J. Intervals whose bypass count is low give the requests the bypass traffic's
    energy too (0.62 J/token in those after a late first read). Before, `powerprof_joules_per_token` took them in:
    0.567 (+13%) after a late first read at 8 s, 0.529 (+6%) across a 2 s restart, marked nowhere, while `analyze`
    leaves their requests out. Now the gauge leaves those intervals out by the same rule (schema.bypass_count_low),
    0.501 and 0.499, and counts them by reason."""
    led_kept: list = []
    kw = dict(bypass_stride=1, idle_w=50.0, j_per_token=0.25, keep=led_kept)
    if case == "late_baseline":
        rows, _, _ = _run(restart_at_s=None, late_first_read_s=8.0, **kw)
    else:
        rows, _, _ = _run(restart_at_s=6.2, down_s=2.0, **kw)
    truth = (50.0 + 0.25 * 200) / 200  # J/s over tokens/s, every token alike: 0.5
    led = led_kept[0]
    low = [r for r in rows if r["server_count"] not in ("complete", "off", "slots_only") and r["proxy_tokens"] > 0]
    assert low, [r["server_count"] for r in rows]
    got = led.totals.j_per_token
    assert got == pytest.approx(truth, rel=0.03), (got, truth)
    n_iv, n_tok = led.totals.jpt_left_out["bypass-uncounted"]
    assert n_iv == len(low) and n_tok == pytest.approx(sum(r["proxy_tokens"] for r in low)), (n_iv, n_tok, len(low))
    # The intervals it took in are the complete ones, whose requests' figure is the truth too.
    kept = [r for r in rows if r["server_count"] == "complete" and r["proxy_tokens"] > 0]
    assert sum(r["requests_energy_j"] for r in kept) / sum(r["proxy_tokens"] for r in kept) == pytest.approx(truth, rel=0.03)


def test_the_gauge_and_its_left_out_counters_are_on_metrics():
    from powerprof.daemon.metrics import Snapshot, SnapshotCollector

    class _H:
        snapshot = Snapshot(joules_per_token=0.5, jpt_left_out={"bypass-uncounted": (3, 480.0),
                                                                "uncertain-uncounted": (2, 160.0)})

    fams = {f.name: f for f in SnapshotCollector(_H()).collect()}
    got = {(f.name, s.labels.get("reason")): s.value for n in ("intervals", "tokens")
           for f in [fams[f"powerprof_joules_per_token_left_out_{n}"]] for s in f.samples}
    # uncertain-uncounted: after a client's leave under scrape.server = none (Ledger._unplaced); before, not shown.
    assert got == {("powerprof_joules_per_token_left_out_intervals", "bypass-uncounted"): 3,
                   ("powerprof_joules_per_token_left_out_intervals", "no-counter-short"): 0,
                   ("powerprof_joules_per_token_left_out_intervals", "uncertain-uncounted"): 2,
                   ("powerprof_joules_per_token_left_out_intervals", "gpus-undecided"): 0,
                   ("powerprof_joules_per_token_left_out_tokens", "bypass-uncounted"): 480.0,
                   ("powerprof_joules_per_token_left_out_tokens", "no-counter-short"): 0,
                   ("powerprof_joules_per_token_left_out_tokens", "uncertain-uncounted"): 160.0,
                   ("powerprof_joules_per_token_left_out_tokens", "gpus-undecided"): 0}, got
    doc = fams["powerprof_joules_per_token"].documentation
    assert "bypass-uncounted" in doc and "uncertain-uncounted" in doc, doc
    # Its causes said: before, only "after a client's leave", while the review's batch-API scene left 1,099 of 1,200
    # intervals out as uncertain-uncounted beside whole answers past their hold, no client leaving.
    left = fams["powerprof_joules_per_token_left_out_intervals"].documentation
    assert "whole answer still in flight past the daemon's hold" in left and "batch" in left, left
    assert "whole answer still in flight past the daemon's hold" in doc, doc


def test_the_scrape_none_fix_says_the_rows_beside_a_long_whole_answer_leave_j_per_token():
    # The fix a may-be-low count offers (schema.BYPASS_NONE_FIX, on usage_above_counter's error too) promised the rows
    # stay in J/token under scrape.server = none: not those beside a whole answer in flight past the 120 s hold, flagged.
    from powerprof.storage.schema import bypass_count_fix
    fix = bypass_count_fix("usage_above_counter")
    assert "stay in J/token, but for those beside a whole (unstreamed) answer still in flight 120 s" in fix, fix


def test_tag_rows_say_how_far_the_server_count_covers_their_intervals():
    """A tag's energy is its intervals'; before, its row said nothing of whether their bypass count was whole, so a
    tag across a restart read as well founded as one in a quiet stretch. Its `server_count` now joins its intervals'."""
    led_kept: list = []
    _run(restart_at_s=6.2, down_s=2.0, keep=led_kept, tags=(("across", 5.0, 10.0), ("after", 10.0, 13.0)))
    rows = {r["name"]: r for r in led_kept[0].emit.rows["tags"]}
    assert rows["across"]["server_count"] == "server_restart", rows["across"]
    assert rows["after"]["server_count"] == "complete", rows["after"]


def test_a_tags_server_count_joins_its_intervals_reasons_and_an_empty_one_is_unknown():
    from powerprof.daemon.rowtext import tag_server_count
    from powerprof.storage.schema import bypass_count_low

    assert tag_server_count({"complete"}) == "complete" and tag_server_count({"off"}) == "off"
    assert tag_server_count({"complete", "unscraped", "late_baseline,unscraped"}) == "late_baseline,unscraped"
    assert tag_server_count({"unread", "complete"}) == "unread"
    assert tag_server_count(set()) is None and bypass_count_low(None)  # unknown: never complete


def test_analyze_gives_each_tags_j_per_token_and_leaves_out_windows_whose_count_may_be_low(tmp_path):
    """`analyze` on a daemon folder read no tag rows: a user who tagged a job (`powerprof tag start/stop`) got no figure
    for it. Now each tag name gets its energy less bypass traffic's over its proxied tokens, against the truth of the
    GPU's draw (50 W plus 0.25 J a token, proxied or bypass), and a window across a server restart (its count may be low) is left out of it
    and counted apart, as the requests are."""
    from powerprof.analysis.fleet import tag_notes, tag_summary

    kept: list = []
    idle_w, jpt, until_s = 50.0, 0.25, 16.0
    windows = (("across", 5.0, 10.0), ("job", 10.0, 12.0), ("job", 12.0, 13.0), ("job", 2.0, 4.0))
    ivals, reqs, _ = _run(restart_at_s=6.2, down_s=2.0, idle_w=idle_w, j_per_token=jpt, keep=kept, tags=windows,
                          until_s=until_s)
    tags = kept[0].emit.rows["tags"]
    assert len(tags) == 4
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    for name, rows in (("intervals", ivals), ("requests", reqs), ("tags", tags)):
        store.append(name, rows)
    assert store.flush()
    # The truth, as _run draws it: the GPU's energy over a window and the proxied tokens generated in it.
    gen = np.arange(1.0, until_s - 2.0, 0.025)
    up = (gen < 6.2) | (gen >= 8.2)
    proxied, bypass = gen[up], gen[up][::4]

    def truth(spans):
        # Every token's share of the window's energy, proxied or bypass alike (the live gauge's truth above): the
        # bypass traffic's part (unproxied_energy_j) is not the proxied tokens'. Before the tag rows carried it, the
        # tags' J/token was all the energy over the proxied tokens: 0.578 here against 0.544.
        e = sum(idle_w * (b - a) + jpt * (PER_STEP * ((proxied > a) & (proxied <= b)).sum()
                                          + ((bypass > a) & (bypass <= b)).sum()) for a, b in spans)
        return e / sum(PER_STEP * ((proxied > a) & (proxied <= b)).sum() + ((bypass > a) & (bypass <= b)).sum()
                       for a, b in spans)

    got = {r["name"]: r for r in tag_summary([str(tmp_path / "n")]).to_pylist()}
    job = got["job"]
    assert job["windows"] == 3 and job["counted_windows"] == 3
    true_jpt = truth([(10.0, 12.0), (12.0, 13.0), (2.0, 4.0)])
    assert job["gpu_j_per_token"] == pytest.approx(true_jpt, rel=0.02), (job["gpu_j_per_token"], true_jpt)
    across = got["across"]
    assert across["counted_windows"] == 0 and across["gpu_j_per_token"] is None and across["gpu_energy_j"] is None
    assert across["bypass_uncertain_windows"] == 1 and "server_restart" in across["bypass_uncertain_reasons"]
    assert any("node-0 across: 1 of 1" in n and "server_restart" in n for n in tag_notes(tag_summary([str(tmp_path / "n")])))
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stdout.splitlines() if " job " in x)
    assert f"{job['gpu_j_per_token']:.3f}" in line, res.stdout
    assert next(x for x in res.stdout.splitlines() if " across " in x).rstrip().endswith("-"), res.stdout
    assert "node-0 across: 1 of 1" in res.stderr, res.stderr
    assert (tmp_path / "a" / "fleet_tags.parquet").exists()


def test_analyze_and_the_daemons_rule_agree_on_a_slots_only_server_across_a_restart(tmp_path):
    """One dataset, two paths: `analyze` (FLEET_SQL in DuckDB) and the daemon's own rule in Python
    (schema.bypass_count_low, which flags the requests and drives the live J/token gauge). A llama-server without
    --metrics (every interval `slots_only`) restarts at 6.2 s for 2 s (`server_restart,slots_only`). Before, analyze
    called all 16 intervals "may be low" (bypass_uncertain_intervals 16, where the rule leaves out 4)
    while keeping their requests in J/token, as the rule does: the table and its note said one thing, the J/token
    another. Now both count the same intervals left out, and the `slots_only` ones apart as measured in part."""
    from powerprof.storage.schema import BYPASS_LOW_FLAG, SERVER_COUNT_UNREAD, UNSURE_FLAG, bypass_count_low

    kept: list = []
    ivals, reqs, _ = _run(restart_at_s=6.2, down_s=2.0, slots_only=True, bypass_stride=1, idle_w=50.0,
                          j_per_token=0.25, keep=kept)
    truth = (50.0 + 0.25 * 200) / 200  # every token's share, proxied or bypass alike: 0.5 J/token
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("intervals", ivals)
    store.append("requests", reqs)
    assert store.flush()
    [h] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    # The Python path over the same rows: the one rule, applied row by row.
    unknown = [r for r in ivals if r["server_count"] in (None, SERVER_COUNT_UNREAD)]
    low = [r for r in ivals if bypass_count_low(r["server_count"]) and r not in unknown]
    kept_in = [r for r in ivals if not bypass_count_low(r["server_count"]) and r["server_count"] != "complete"]
    assert low and all("slots_only" in r["server_count"] and "server_restart" in r["server_count"] for r in low)
    assert kept_in and {r["server_count"] for r in kept_in} == {"slots_only"}
    # Not the rows flagged uncertain-uncounted either (analyze leaves them out): the first request, split before the
    # idle power was measured, holds the first second's idle time.
    sure = [r for r in reqs if r["outcome"] == "ok" and BYPASS_LOW_FLAG not in (r["energy_note"] or "")
            and UNSURE_FLAG not in (r["energy_note"] or "") and r["gpu_energy_j"] is not None]
    py_jpt = sum(r["gpu_energy_j"] for r in sure) / sum(r["attributed_tokens"] for r in sure)
    assert h["gpu_j_per_token"] == pytest.approx(py_jpt, rel=1e-9)
    # Against the truth: the gauge and the requests' figure within 3%. Before the first request's row was flagged (it
    # took the whole first second's GPU energy, its start in it, no other work, no idle power measured yet: 0.52
    # against 0.50, kept in), the requests' figure was within 6%.
    assert kept[0].totals.j_per_token == pytest.approx(truth, rel=0.03), kept[0].totals.j_per_token
    assert h["gpu_j_per_token"] == pytest.approx(truth, rel=0.03), (h["gpu_j_per_token"], truth)
    assert h["bypass_uncertain_requests"] == sum(BYPASS_LOW_FLAG in (r["energy_note"] or "") for r in reqs) > 0
    assert h["bypass_uncertain_intervals"] == len(low), (h["bypass_uncertain_intervals"], len(low))
    assert h["bypass_uncertain_gpu_energy_j"] == pytest.approx(sum(r["gpu_energy_j"] for r in low))
    assert h["bypass_unknown_intervals"] == len(unknown)
    assert h["bypass_unmeasured_intervals"] == len(kept_in)
    # The gauge's left-out intervals are the rule's low ones that had tokens.
    assert kept[0].totals.jpt_left_out["bypass-uncounted"][0] == sum(
        r["proxy_tokens"] > 0 for r in low + unknown)
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    [said_low] = [n for n in res.stderr.split("\n") if f"node-0: {len(low)} intervals" in n]
    assert "may be low" in said_low and "server_restart" in said_low and "keep the server from restarting" in said_low
    [said_part] = [n for n in res.stderr.split("\n") if f"node-0: {len(kept_in)} intervals" in n]
    assert "in part" in said_part and "may be low" not in said_part and "--metrics" in said_part, said_part


def test_a_tag_window_whose_count_may_be_low_reads_like_an_exact_one_so_it_is_left_out_whole(tmp_path):
    """Could a subset of the tag windows left out for their count be kept? Their J/token is exact only where no bypass
    traffic ran, and their rows read the same either way: over a late first read at 3.5 s, the window 2-5 s reads
    0.5625 J/token exact without bypass traffic and 0.560 against the true 0.500 (+12%) with bypass traffic a fifth of
    the tokens, both `late_baseline,unread`. So the whole window is left out, and analyze's note says why and the fix."""
    from powerprof.analysis.fleet import tag_notes, tag_summary
    from powerprof.storage.schema import bypass_count_low

    got = {}
    for stride in (1, 10**9):  # bypass traffic 40 tokens/s beside 160 proxied; none
        kept: list = []
        _run(restart_at_s=None, late_first_read_s=3.5, bypass_stride=stride, idle_w=50.0, j_per_token=0.25, keep=kept,
             tags=(("w", 2.0, 5.0),))
        [row] = kept[0].emit.rows["tags"]
        gen = np.arange(1.0, 14.0, 0.025)
        prox = PER_STEP * ((gen > 2.0) & (gen <= 5.0)).sum()
        byp = ((gen[::stride] > 2.0) & (gen[::stride] <= 5.0)).sum()
        # The proxied tokens' share of the GPU's draw (50 W plus 0.25 J a token, proxied or bypass alike).
        truth = (50.0 * 3.0 + 0.25 * (prox + byp)) / (prox + byp)
        got[stride] = (row, truth)
    (with_bypass, truth_b), (without, truth_0) = got[1], got[10**9]
    assert with_bypass["server_count"] == without["server_count"] and bypass_count_low(without["server_count"])
    assert without["gpu_j_per_token"] == pytest.approx(truth_0, rel=0.005)  # exact: no bypass traffic to miss
    assert with_bypass["gpu_j_per_token"] > 1.08 * truth_b, (with_bypass["gpu_j_per_token"], truth_b)  # +12%
    store = DatasetStore(tmp_path, datasets(), host="node-0")
    store.append("tags", [with_bypass])
    store.append("intervals", [{"daemon_id": "d", "t_start_utc": T0_NS, "t_end_utc": T0_NS + S, "t_start_mono_s": 0.0,
                                "duration_s": 1.0, "kind": "idle", "gpu_energy_j": 50.0, "server_count": "complete"}])
    assert store.flush()
    t = tag_summary([str(tmp_path)])
    [r] = t.to_pylist()
    assert r["counted_windows"] == 0 and r["gpu_j_per_token"] is None and r["bypass_uncertain_windows"] == 1
    [note] = [n for n in tag_notes(t) if "node-0 w: 1 of 1" in n]
    assert "nothing says" in note and "start the server before the daemon" in note and "scrape.server = none" in note


def _steady_stream(rate: float, phase_s: float, bypass_at_s: float | None = None, bypass_n: int = 0):
    """A ledger fed one proxied stream of `rate` tokens/s from 1 s to 6 s, shipped by a proxy worker in 20 ms records
    (each stamped 3 ms after its last token), scrapes every 0.1 s offset by `phase_s`, 0.25 s GPU samples, no restart;
    the proxy's delay measured at 3 ms (reconcile.PROXY_LAG: unmeasured, a record's lag draining reads as a proxy's).
    `bypass_n` tokens straight to the server at 400/s from `bypass_at_s`. Returns the interval rows."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    gen = 1.0 + np.arange(int(5 * rate)) / rate  # when the server generated (and counted) each token
    b = np.floor((gen - 1.0) / 0.02 + 1e-9)
    pieces = [(float(gen[b == i].max()) + 0.003, int((b == i).sum())) for i in np.unique(b)]
    bypass = (bypass_at_s + np.arange(bypass_n) / 400.0) if bypass_n else np.zeros(0)
    tr = RequestTrace(1, "POST", "/completion", None, int(0.95 * S), int(0.95 * S), api="llamacpp", stream=True)
    tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    led.on_start(tr)
    t_end, prev_t, prev_total = pieces[-1][0], None, 0.0
    for k in range(int((t_end + 4) / 0.005)):
        t = round(k * 0.005, 6)
        _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= t_end + 0.001:
            tr.end_ns = tr.end_wall_ns = int(t_end * S)
            led.on_end(tr)
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
            led.note_proxy_delay(int(t * S), 0.003)  # the proxy's loop on time, as the daemon measures it
        if (k - round(phase_s / 0.005)) % 20 == 0 and t >= 0.5:
            count = float((gen <= t).sum() + (bypass <= t).sum())
            led.add_server_tokens(int(t * S), 0.0 if prev_t is None else count - prev_total,
                                  None if prev_t is None else int(prev_t * S))
            prev_t, prev_total = t, count
        led.advance(int(t * S), int(t * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"])



def test_a_steady_streams_constant_proxy_lag_reads_as_no_bypass_and_a_small_bypass_stream_still_counts():
    """A proxy worker ships a stream's tokens in 20 ms records; with the scrapes in a fixed phase with them, every scrape
    fell just after a record: the server had counted up to a record's tokens the proxy had not read, at every window,
    so the lag never drained within LAG_S and the stream's first windows read it as bypass tokens that never ran, in
    rows saying `complete` (300 tokens/s: up to 5 of 0, by phase). Now a record's tokens are placed over the time since
    the one before: at most a token generated within the proxy's 3 ms delay before a scrape reads as 1. A bypass stream of a
    record's size (5 tokens) beside it is still counted, within that token, whatever the phase."""
    for phase_s in np.arange(0.0, 0.1, 0.005):
        rows = _steady_stream(300, float(phase_s))
        got = sum(r["server_tokens"] or 0 for r in rows)
        assert got <= 1.0 + 1e-6, (phase_s, [(r["t_start_mono_s"], r["server_tokens"]) for r in rows if r["server_tokens"]])
        assert {r["server_count"] for r in rows} - {"unscraped", "unread"} == {"complete"}, phase_s
        rows = _steady_stream(300, float(phase_s), bypass_at_s=3.013, bypass_n=5)
        # Never low, at most that token high, and its 5 tokens where they ran (the scrape window around 3.013 s is
        # spread over its 0.1 s, so over the intervals beside 3 s).
        got = sum(r["server_tokens"] or 0 for r in rows)
        assert 5 - 1e-6 <= got <= 6 + 1e-6, (phase_s, got)
        near = sum(r["server_tokens"] or 0 for r in rows if 2.75 <= r["t_start_mono_s"] < 3.25)
        assert near >= 5 - 1e-6, (phase_s, [(r["t_start_mono_s"], r["server_tokens"]) for r in rows])


def _worker_silent_then_killed(silent_s: float, kill_s: float, beats: bool = True, rate: float = 300.0):
    """A ledger fed as the daemon feeds it from proxy worker processes: one stream of `rate` tokens/s from 1 s (450
    tokens, scrapes every 0.1 s, 0.25 s GPU samples), shipped in 20 ms records, each worker's heartbeat noting how late
    its loop ran (on time) every 0.25 s (`beats`). At `silent_s` the workers stop (a loaded host) and send nothing more:
    the server decodes the stream on and counts it, the proxy reads none of it, and no delay is measured. At `kill_s`
    the daemon's watchdog kills them and records the stream interrupted (its tokens since never read); their records no
    longer hold the intervals. No bypass traffic runs at all. Returns the interval rows."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    gen = 1.0 + np.arange(450) / rate  # when the server generated (and counted) each token
    shipped = gen[gen < silent_s - 0.02]
    pieces = [(float(shipped[b == i].max()) + 0.003, int((b == i).sum()))
              for b in [np.floor((shipped - 1.0) / 0.02 + 1e-9)] for i in np.unique(b)]
    tr = RequestTrace(1, "POST", "/completion", None, int(0.95 * S), int(0.95 * S), api="llamacpp", stream=True)
    led.on_start(tr)
    prev_t = prev_total = None
    for k in range(int((kill_s + 4) / 0.005)):
        t = round(k * 0.005, 6)
        _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= kill_s:  # the watchdog's kill: in flight in it, recorded as interrupted
            tr.end_ns = tr.end_wall_ns = int(t * S)
            tr.counts = Counts(generated_tokens=None, prompt_tokens=None, model=None, stop_reason=None,
                               token_source="stream")
            led.on_end(tr)
        if beats and k % 50 == 0 and not silent_s <= t < kill_s:
            led.note_proxy_delay(int(t * S), 0.0)
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 20 == 0 and t >= 0.5:
            count = float((gen <= t).sum())
            led.add_server_tokens(int(t * S), 0.0 if prev_t is None else count - prev_total,
                                  None if prev_t is None else int(prev_t * S))
            prev_t, prev_total = t, count
        held = silent_s - 0.02 <= t < kill_s  # the silent workers' watermark holds the intervals until the kill
        led.advance(int(t * S), int(((silent_s - 0.02) if held else t) * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"])


@pytest.mark.parametrize("silent_s,kill_s", [(1.5, 12.5), (1.5, 3.0), (1.2, 5.0)])
def test_a_proxy_silent_past_the_lag_reach_books_no_bypass_in_a_row_saying_complete(silent_s, kill_s):
    """The proxy's workers stopped mid-stream (a loaded host) for longer than the LAG_S a window looks ahead, and killed
    by the daemon's watchdog: the server counted the stream's tokens on, the proxy read none. Their silence measured no
    delay, so the windows took none for the proxy's lag (LAG_S where unmeasured, but only as the tokens the proxy read
    over it: none), and the stream's tokens read as bypass tokens that never ran, rows `complete` (against the real
    llama-server, its two workers stopped across a restart that took 10 s, killed at 11 s: 314 for none). A window whose
    edge the proxy was silent past, having been measured before, now says `proxy_lag` where it counts any bypass token:
    its count may be that lag (the rows stay out of J/token, said)."""
    rows = _worker_silent_then_killed(silent_s, kill_s)
    # No bypass traffic ran: a row counting any (more than the token a record's delay moves) must say its count may be off.
    high = [(r["t_start_mono_s"], r["server_tokens"], r["server_count"]) for r in rows
            if (r["server_tokens"] or 0) > 1.0 and r["server_count"] == "complete"]
    assert not high, high
    assert any("proxy_lag" in (r["server_count"] or "") for r in rows), [r["server_count"] for r in rows]
    # Before the stall the rows are whole and count nothing.
    early = [r for r in rows if r["t_start_mono_s"] + r["duration_s"] <= silent_s - 1.0 - 1e-6 and r["t_start_mono_s"] >= 1.0]
    assert all(r["server_count"] == "complete" and (r["server_tokens"] or 0) <= 1.0 for r in early), early


def test_a_proxy_that_never_measured_a_delay_is_judged_as_before():
    """Without any delay measure at all (a ledger fed by a caller that measures none), nothing says the proxy went
    silent: its windows are judged as before (LAG_S's reach, by the tokens the proxy read over it)."""
    rows = _worker_silent_then_killed(1.5, 3.0, beats=False)
    assert not any("proxy_lag" in (r["server_count"] or "") for r in rows if r["t_start_mono_s"] < 1.0)


def test_a_proxy_lagging_the_server_before_an_outage_longer_than_the_scrape_hold_makes_no_bypass_tokens_up():
    """As test_a_proxy_lagging_the_server_at_a_restart_makes_no_bypass_tokens_up, but the server stays down 11 s: past
    the 10 s an interval waits for the server's counter, so the windows of the second before the outage were resolved
    (forced) before any scrape past their 1 s reach, and before the restart was told. The proxy's lag at the last scrape
    stayed in their level as bypass tokens: 31 where 10 ran, 21 where none did (rows `proxy_lag`); against the real
    llama-server, whose old process took 10 s to exit, 110.5 counted for the 100 sent. The proxy's tokens since the last
    scrape are that lag or tokens the server counted after it (or, restarted, lost): taken as lag, as at a restart, the
    count is never high there, and where it is lowered the row says `unscraped`."""
    for stride in (4, 10**9):
        rows, _, truth = _run(restart_at_s=6.2, down_s=11.0, stall=(5.85, 6.05), bypass_stride=stride, until_s=22.0)
        for r in rows[2:8]:
            k = int(round(r["t_start_mono_s"]))
            assert r["server_tokens"] <= truth[k] + 1e-6, (stride, k, r["server_tokens"], truth[k], r["server_count"])
            if r["server_tokens"] < truth[k] - 1e-6:
                assert {"unscraped", "server_restart"} & set(r["server_count"].split(",")), (stride, k, r)


def _usage_over_chunks(says, bypass_per_s, until_s=12.0, chunks=1, every_s=0.1, counted=None):
    """A `chunks`-token stream every `every_s` whose final usage says `says`; the server's counter counts the chunks'
    tokens (the truth; `counted` a request where given) plus `bypass_per_s` bypass tokens a second. Returns the interval rows, the request rows and the
    bypass tokens that ran each second."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    starts = np.arange(1.0, until_s - 2.0, every_s)
    bypass = np.arange(1.0, until_s - 2.0, 1.0 / bypass_per_s) if bypass_per_s else np.array([])
    prev_t = None
    prev_count = 0.0
    n = 0
    live = {}
    i = 0
    ev = sorted([(s, "start") for s in starts] + [(s + 0.02, "tok") for s in starts] + [(s + 0.03, "end") for s in starts])
    for k in range(int(until_s / 0.25) + 1):
        t = k * 0.25
        while i < len(ev) and ev[i][0] <= t:
            ts, what = ev[i]
            i += 1
            key = round(ts - {"start": 0.0, "tok": 0.02, "end": 0.03}[what], 6)
            if what == "start":
                n += 1
                tr = _trace(n, ts)
                live[key] = tr
                led.on_start(tr)
            elif what == "tok":
                tr = live[key]
                tr.first_ns = tr.last_ns = int(ts * S)
                tr.tokens_seen += chunks
                led.on_tokens(tr, int(ts * S), chunks)
            else:
                tr = live.pop(key)
                tr.end_ns = tr.end_wall_ns = int(ts * S)
                tr.extra["held_end_ns"] = int(ts * S)
                tr.counts = Counts(generated_tokens=says, prompt_tokens=20, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        led.note_proxy_delay(int(t * S), 0.0)
        if t == int(t):
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        count = float((chunks if counted is None else counted) * (starts + 0.02 <= t).sum() + (bypass <= t).sum())
        if t >= 0.5:
            led.add_server_tokens(int(t * S), 0.0 if prev_t is None else count - prev_count,
                                  None if prev_t is None else int(prev_t * S))
            prev_t, prev_count = t, count
        led.advance(int(t * S))
    led.close_all(int(until_s * S))
    truth = np.histogram(bypass, bins=np.arange(0, until_s + 1))[0].astype(float)
    return sink.rows["intervals"], sink.rows["requests"], truth


@pytest.mark.parametrize("says", [1, 4])
@pytest.mark.parametrize("bypass_per_s", [0.0, 30.0, 50.0])
def test_a_servers_usage_3_over_its_chunks_hides_no_bypass_traffic_in_complete_rows(says, bypass_per_s):
    """Up to COUNT_SLACK_TOKENS of a stream's usage beyond its chunks are placed as proxied (SGLang's end-of-text
    token, a self-closing call's trailing tokens): right where the server's counter counted them too. A server whose
    usage says 3 more than it counted (1-token streams every 0.1 s, usage 4) hid 30 bypass tokens/s behind them, rows
    2-9 `server_tokens` 0 and `complete`, and with none, 240 tokens never counted placed in `complete` rows. Where
    the slack-placed tokens exceed a token plus 5% of a window's server count, it says usage_beyond_chunks."""
    rows, _, truth = _usage_over_chunks(says, bypass_per_s)
    assert not _wrong_complete(rows, truth)
    if says == 4:
        assert not any(r["server_count"] == "complete" for r in rows if 2 <= r["t_start_mono_s"] < 9), rows
        assert all("usage_beyond_chunks" in r["server_count"] for r in rows if 2 <= r["t_start_mono_s"] < 9)
    else:
        assert all(r["server_count"] == "complete" for r in rows if 2 <= r["t_start_mono_s"] < 9)


def test_honest_sglang_one_end_of_text_token_beyond_100_token_chunks_stays_complete_and_exact():
    """SGLang's usage counts the end-of-text token, which no chunk carries, and so does its counter: 1 slack token of
    101 a request, under 1% of a window's count, stays `complete`, its bypass count exact."""
    rows, _, truth = _usage_over_chunks(101, 30.0, chunks=100, counted=101)
    # Against the same run with no slack (usage and counter 100): the same figures. (Its row 9 reads 31.6 for 30 in
    # both: the 100-token single-chunk streams are spread back as bursts, the last one's tail there; not this check's.)
    base, _, _ = _usage_over_chunks(100, 30.0, chunks=100, counted=100)
    assert [r["server_tokens"] for r in rows] == pytest.approx([r["server_tokens"] for r in base], abs=1e-6)
    assert not _wrong_complete([r for r in rows if r["t_start_mono_s"] < 9], truth)
    mid = [r for r in rows if 1 <= r["t_start_mono_s"] <= 9]
    assert mid and all(r["server_count"] == "complete" for r in mid), [r["server_count"] for r in mid]


@pytest.mark.parametrize("at_s", [3.0, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 8.0, 10.0])
def test_a_counter_read_early_repays_no_more_at_a_pace_fall_than_its_lag_holds(at_s):
    """The owe of a counter read 0.1 s early nets at a fall of the proxy's pace as far as the fall of its rate can
    repay: bounded by that fall over the window's length (80 tokens), the whole owe (16) was netted where the true
    recovery was 8, the owe spent, and at the stream's end the real 8-token recovery read as bypass tokens that never
    ran (rows 21 = 2 and 22 = 6, `complete`). The read-early span is at most LAG_S: the bound is the fall over it."""
    rows, truth = _sim(alt=False, early=0.1, pace_fall_at=at_s, burst=at_s + 0.00625 * np.arange(1, 21))
    assert not _wrong_complete(rows, truth)


@pytest.mark.parametrize("proxied_until", [10.0, 12.5, 17.5, 27.5])
def test_at_a_5_s_scrape_interval_an_exact_read_early_repayment_at_the_next_scrape_stays_complete(proxied_until):
    """Scraped every 5 s, the counter read 0.1 s early: the reference falls by 16 at the 10 s scrape (owed), and the
    streams' end repays it. Two faults: a stream ending inside a 5 s window took its own owe away before the window
    could net it (owes were bounded by the proxy's tokens within LAG_S of the window's END: none there), and its
    recovery of 16 read as bypass tokens that never ran (3.2 in each of five rows, `complete`); and an owe repaid past
    CREDIT_S (3 s) said proxy_lag, so even an exact repayment at the next scrape (5 s on) was flagged. Bounded at the
    window's start before it nets, and aged by max(CREDIT_S, 1.5 scrape intervals): repaid at the next scrape (the end
    at 10 or 12.5 s), its window stays complete and exact (0); repaid two or more scrapes on (17.5, 27.5 s), proxy_lag."""
    rows, truth = _sim(alt=False, early=0.1, every=5.0, proxied_until=proxied_until, until_s=proxied_until + 18.0,
                       burst=[])
    assert not _wrong_complete(rows, truth)
    w0 = 5.0 * np.floor(proxied_until / 5.0)  # the window of the streams' end: it repays
    win = [r for r in rows if w0 - 1e-6 <= r["t_start_mono_s"] < w0 + 5.0 - 1e-6]
    assert len(win) == 5, win
    if proxied_until <= 15.0:
        assert all(r["server_count"] == "complete" and r["server_tokens"] == pytest.approx(0.0, abs=1e-6) for r in win), \
            [(r["server_count"], r["server_tokens"]) for r in win]
    else:
        assert all(PROXY_LAG in r["server_count"] for r in win), [r["server_count"] for r in win]


@pytest.mark.parametrize("burst_at", [15.5, 130.0])
def test_an_overpay_marks_a_rise_right_after_it_not_one_minutes_later_on_an_idle_server(burst_at):
    """Scraped every 5 s, read 0.1 s early, the streams ending at 14.5 s: their window nets the whole owe (16) where the
    fall of the proxy's rate recovers 1.6, and keeps 14.4 as overpaid (`_overpaid`): the next rise may be a recovery
    the owe no longer holds, and says proxy_lag (a 20-token bypass burst at 15.5 s). Before, that overpay never aged:
    the server idle from then on, a 20-token bypass burst two minutes later (130 s) said proxy_lag too, its count exact
    and left out of J/token. The dip an overpay stands for is bounded as the owe is, by the proxy's tokens within
    LAG_S of the scrape: gone with them, and the later burst is judged on its own (complete, 20)."""
    rows, truth = _sim(alt=False, early=0.1, every=5.0, proxied_until=14.5, until_s=140.0,
                       burst=burst_at + 0.01 * np.arange(1, 21))
    w0 = 5.0 * np.floor(burst_at / 5.0)
    win = [r for r in rows if w0 - 1e-6 <= r["t_start_mono_s"] < w0 + 5.0 - 1e-6]
    assert len(win) == 5 and sum(r["server_tokens"] for r in win) == pytest.approx(20.0, abs=1e-6), win
    want = "proxy_lag" if burst_at < 20 else "complete"
    assert all(r["server_count"] == want for r in win), [r["server_count"] for r in win]
    assert all(r["server_count"] == "complete" for r in rows if r["t_start_mono_s"] < 15.0), \
        [(r["t_start_mono_s"], r["server_count"]) for r in rows if r["t_start_mono_s"] < 15.0]


@pytest.mark.parametrize("alt", [True, False])
def test_a_counter_read_anywhere_in_a_slow_get_leaves_no_wrong_row_complete(alt):
    """Steady bypass traffic (40 tokens/s) beside the proxy's streams, their pace alternating (160 and 80 tokens/s each
    0.25 s) or not, the counter read 0.1 s before the stamp of a GET 0.2 s long (its midpoint). Told nothing of the GET,
    the owe's netting left row 21 at 41 for 39 and row 22 at 6 where none ran, both `complete` (the alternating pace;
    steady, 11 where none ran, said). Told each GET's span (`read_ns`), the ledger knows the proxy's tokens inside it
    (24 to 32 at an edge: 16 before the stamp, 8 or 16 after) may or may not be in the count, more than a row's
    tolerance (a token plus 5% of its ~160 server tokens): each row whose count they may move so says `proxy_lag`.
    The figures are the same either way (the GET moves no token, it marks)."""
    rows, truth = _sim(alt=alt, early=0.1, get_s=0.2)
    untold, _ = _sim(alt=alt, early=0.1)
    assert [r["server_tokens"] for r in rows] == [r["server_tokens"] for r in untold]
    assert not _wrong_complete(rows, truth), [(r["server_tokens"], r["server_count"]) for r in rows]
    assert all("proxy_lag" in r["server_count"] for r in rows if 2 <= r["t_start_mono_s"] < 23)
    # A GET of 4 ms (the counter read inside it): the tokens it may move are within the tolerance, rows `complete`.
    rows, truth = _sim(alt=alt, early=0.0, get_s=0.004)
    assert not _wrong_complete(rows, truth)
    assert all(r["server_count"] == "complete" for r in rows if 2 <= r["t_start_mono_s"] < 24), \
        [r["server_count"] for r in rows]


# --- the windows after a restart told by the fall alone say fall_unconfirmed, which the ledger never takes for one ----


def _marked_run(monkeypatch, mark_after: bool, reason: str):
    """`_run` with a restart at 6.2 s, every window after the restart's own marked `reason` where `mark_after` (as the
    scraper marks them after a restart told by the counter's fall alone)."""
    orig = Ledger.add_server_tokens
    seen = {"r": False}

    def wrapped(self, t_ns, delta, since_ns, at_finish=False, finished=None, partial=(), read_ns=None):
        if "server_restart" in partial:
            seen["r"] = True
        elif seen["r"] and mark_after:
            partial = (*partial, reason)
        return orig(self, t_ns, delta, since_ns, at_finish, finished, partial=partial, read_ns=read_ns)

    monkeypatch.setattr(Ledger, "add_server_tokens", wrapped)
    keep: list = []
    rows, reqs, truth = _run(restart_at_s=6.2, down_s=0.5, until_s=16.0, keep=keep)
    return rows, reqs, truth, keep[0]


def test_windows_marked_fall_unconfirmed_after_a_restart_keep_the_figures(monkeypatch):
    # Before, the scraper marked those windows server_restart, which the ledger takes for a restart in each (levels
    # started afresh, owed tokens replaced, tokens moved to the restart's cut): bypass over 7-14 s read 922 where 69
    # ran, a request's energy -47% (188.2 → 99.0 J). fall_unconfirmed says the count may be low or high, nothing more.
    rows0, reqs0, truth, _ = _marked_run(monkeypatch, False, "fall_unconfirmed")
    monkeypatch.undo()
    rows1, reqs1, _, _ = _marked_run(monkeypatch, True, "fall_unconfirmed")
    e0 = {r["request_id"]: r["gpu_energy_j"] for r in reqs0}
    e1 = {r["request_id"]: r["gpu_energy_j"] for r in reqs1}
    assert e0 and all(e1[i] == pytest.approx(e0[i], rel=0.05) for i in e0)
    b0 = sum(r["server_tokens"] or 0.0 for r in rows0[7:14])
    b1 = sum(r["server_tokens"] or 0.0 for r in rows1[7:14])
    assert b1 == pytest.approx(b0, abs=1.0), (b0, b1, float(truth[7:14].sum()))
    # And said: each of those rows may be low or high, left out of J/token.
    assert all("fall_unconfirmed" in r["server_count"] for r in rows1[8:14]), [r["server_count"] for r in rows1]


@pytest.mark.parametrize("chunks,every_s", [(20, 0.04), (30, 0.04), (50, 0.04), (30, 0.1), (50, 0.1)])
def test_an_honest_end_of_text_token_at_normal_lengths_leaves_the_windows_complete(chunks, every_s):
    """SGLang's usage and counter both count its end-of-text token, which no chunk carries: answers of 20 tokens and
    more, one every 40 or 100 ms, stay `complete` (a rule that marked a window wherever the placed tokens ran ahead of
    the counter by the tolerance marked all of them: placing jitter, the surplus cancelling out of it)."""
    base, _, _ = _usage_over_chunks(chunks, 0.0, chunks=chunks, counted=chunks, every_s=every_s)
    rows, _, _ = _usage_over_chunks(chunks + 1, 0.0, chunks=chunks, counted=chunks + 1, every_s=every_s)
    mid = [r for r in rows if 2 <= r["t_start_mono_s"] < 9]
    assert all(r["server_count"] == "complete" for r in base if 2 <= r["t_start_mono_s"] < 9)
    assert mid and all(r["server_count"] == "complete" for r in mid), [r["server_count"] for r in mid]


def _at_finish(get_ms: float, seed: int, ntok: int = 50, per_s: float = 10.0):
    """SGLang's counter (moves by a request's tokens when it finishes). Proxied requests of `ntok` tokens (a token
    every 20 ms, the proxy seeing each 10 ms after the server made it), arriving at random (`per_s` a second) over
    2-18 s; no bypass traffic at all. Scraped every 0.25 s, each GET `get_ms` long (its midpoint the stamp, told as
    read_ns; 0: not told), the counter read at a uniformly random instant inside it. Returns the rows of 4-19 s."""
    from test_daemon_ledger import _feed, _trace

    rng = np.random.default_rng(seed)
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for k in range(25):
        _feed(led, float(k), 100.0 * k)
    reqs = []
    for i, a in enumerate(np.sort(rng.uniform(2.0, 18.0, int(16 * per_s)))):
        tr = _trace(i + 1, a)
        tr.extra["prompt_tokens"] = 8
        gen = (a + 0.02 * np.arange(1, ntok + 1)) * S
        reqs.append([tr, gen, gen + S // 100, False])
    fin = [(int(g[-1]), ntok, (g[-1] - tr.arrival_ns) / S) for tr, g, _, _ in reqs]
    prev, counted, prev_read = None, 0, 0
    for t in np.arange(4, 22 * 4) * (S // 4):
        for q in reqs:
            tr, gen, seen, started = q
            if not started and tr.arrival_ns <= t:
                led.on_start(tr)
                q[3] = True
            for ts in seen[(seen > t - S // 4) & (seen <= t)]:
                tr.first_ns = tr.first_ns or int(ts)
                tr.last_ns = int(ts)
                tr.tokens_seen += 1
                led.on_tokens(tr, int(ts), 1)
            if q[3] and tr.end_ns is None and seen[-1] <= t:
                tr.end_ns = int(seen[-1])
                led.on_end(tr)
        read = int(t + rng.uniform(-get_ms / 2, get_ms / 2) * 1e6)
        n = sum(k for f, k, _ in fin if f <= read)
        ended = [d for f, _, d in fin if prev_read < f <= read]
        kw = {"read_ns": (int(t - get_ms / 2 * 1e6), int(t + get_ms / 2 * 1e6))} if get_ms else {}
        led.add_server_tokens(int(t), float(n - counted), prev, at_finish=True, finished=(len(ended), sum(ended)), **kw)
        prev, counted, prev_read = int(t), n, read
        led.advance(int(t))
    led.close_all(int(22.0 * S))
    return [r for r in sink.rows["intervals"] if 4 <= r["t_start_mono_s"] < 19]


@pytest.mark.parametrize("get_ms", [4.0, 10.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_at_finish_counter_read_in_a_fast_get_leaves_its_exact_rows_complete(get_ms, seed):
    """No bypass traffic: every row's count is exact (0) wherever in the GET the counter was read, and `complete` with
    the GET untold. Told a 4 ms GET, a request's 50 tokens finishing inside it exceeded a row's tolerance (a token + 5%
    of ~500) and the row said proxy_lag: 13-20% of rows (10 requests/s) left out of J/token for nothing (review s51).
    At-finish, a request's finish is taken at the proxy's last token, already some ms off the server's count: the
    levels take a finish on either side of an edge within that, so a GET under GET_FINISH_SLACK_S adds nothing."""
    rows = _at_finish(get_ms, seed)
    assert all(abs(r["server_tokens"] or 0.0) <= 1e-6 for r in rows), [(r["t_start_mono_s"], r["server_tokens"])
                                                                        for r in rows]
    assert all(r["server_count"] == "complete" for r in _at_finish(0.0, seed))
    marked = [(r["t_start_mono_s"], r["server_count"]) for r in rows if r["server_count"] != "complete"]
    assert not marked, marked


def test_an_at_finish_counter_read_in_a_slow_get_leaves_no_wrong_row_complete():
    # A 200 ms GET: a request finishing inside it may fall in either window, past what the levels take: marked.
    rows = _at_finish(200.0, 0)
    wrong = [(r["t_start_mono_s"], r["server_tokens"], r["server_count"]) for r in rows
             if abs(r["server_tokens"] or 0.0) > 1.0 + 0.05 * 500]
    assert all(c != "complete" for _, _, c in wrong), wrong


def _proxied_per_s(until_s: float = 24.0) -> np.ndarray:
    """The proxied tokens per 1 s row of `_sim(alt=False)`: 4 a 25 ms step from 1 s to until_s - 2."""
    gen = np.arange(1.0, until_s - 2.0, 0.025)
    return np.histogram(gen, bins=np.arange(0, until_s + 1), weights=np.full(gen.size, 4.0))[0]


@pytest.mark.parametrize("drop", [100.0, 200.0])
@pytest.mark.parametrize("early,get_s", [(0.0, None), (0.002, 0.004)])
def test_steady_bypass_after_a_counter_below_loss_is_not_hidden_in_a_complete_row(drop, early, get_s):
    """The counter loses `drop` tokens for good at 5 s (the scraper counts from its highest reading: the windows below
    it say counter_below) while bypass traffic runs steadily at 40 tokens/s beside the proxy's 160. The rows after the
    counter passes its old reading say `complete`, and each must be right to a token + 5% of its server count."""
    rows, truth = _sim(drop=drop, alt=False, early=early, get_s=get_s)
    px = _proxied_per_s()
    bad = [(int(r["t_start_mono_s"]), r["server_tokens"], truth[int(r["t_start_mono_s"])]) for r in rows
           if r["t_start_mono_s"] >= 2 and r["server_count"] == "complete"
           and abs((r["server_tokens"] or 0.0) - truth[int(r["t_start_mono_s"])])
           > 1.0 + 0.05 * (truth[int(r["t_start_mono_s"])] + px[int(r["t_start_mono_s"])])]
    assert not bad, bad


@pytest.mark.parametrize("until", [5.5, 5.75, 6.0])
def test_a_dip_that_comes_back_is_no_loss_and_makes_no_bypass_tokens_up(until):
    """A multi-process page's dip (100 tokens short from 5 s, back at `until`): the scraper counts 0 in the windows
    below its highest reading and the page that passes it counts their tokens. The LAG_S after the fall wins back what
    it lacked against the proxy's tokens: no loss, nothing added back (added back, as a loss, the dip's 100 tokens were
    counted twice: 480 bypass tokens over 2-12 s where 400 ran). Every row saying `complete` is never high. (Row 4
    read 0 for 40, `complete`, its 40 in row 5, which said proxy_lag: the dip, left in the gap, lowered the levels of
    the windows before it. Now added back over its run and taken back where it came back, row 4 reads 30,
    `counter_below`: test_a_one_page_dip_back_within_the_second_leaves_no_row_wrong_and_complete.)"""
    rows, truth = _sim(drop=100.0, alt=False, drop_until=until)
    px = _proxied_per_s()
    assert not [r for r in rows if r["t_start_mono_s"] >= 2 and r["server_count"] == "complete"
                and (r["server_tokens"] or 0.0) - truth[int(r["t_start_mono_s"])]
                > 1.0 + 0.05 * (truth[int(r["t_start_mono_s"])] + px[int(r["t_start_mono_s"])])]
    got = sum(r["server_tokens"] or 0.0 for r in rows if 2 <= r["t_start_mono_s"] < 12)
    assert got == pytest.approx(float(truth[2:12].sum()), abs=2.0), (got, float(truth[2:12].sum()))


def _proxied_px(alt):
    g = np.arange(1.0, 22.0, 0.025)
    w = np.where((np.floor(g / 0.25).astype(int) % 2 == 1) & alt, 2, 4)
    return np.histogram(g, bins=np.arange(0, 25), weights=w)[0]


def _wrong_complete_rows(rows, truth, px, from_s=2):
    return [(int(r["t_start_mono_s"]), r["server_tokens"], float(truth[int(r["t_start_mono_s"])])) for r in rows
            if from_s <= r["t_start_mono_s"] < 21 and r["server_count"] == "complete"
            and abs((r["server_tokens"] or 0.0) - truth[int(r["t_start_mono_s"])])
            > 1.0 + 0.05 * (truth[int(r["t_start_mono_s"])] + px[int(r["t_start_mono_s"])])]


def test_a_loss_read_through_50ms_gets_beside_an_alternating_pace_is_judged_as_a_whole_run():
    """Production path (GET told). 300 tokens lost for good at 5 s, proxied pace alternating 160/80 tokens/s,
    bypass 40/s, each GET 50 ms, counter read 20 ms before the stamp. Before 9ffa170: no wrong `complete` row
    (rows 7-10 proxy_lag). After: row 7 reads 20 for 40, `complete`."""
    rows, truth = _sim(drop=300.0, alt=True, get_s=0.05, early=0.02)
    assert not _wrong_complete_rows(rows, truth, _proxied_px(True))


@pytest.mark.parametrize("early", [0.0, 0.1])
def test_a_200_token_loss_beside_an_alternating_pace_with_no_get_told_is_judged_as_a_whole_run(early):
    """No GET told. Rows from 7 s on: before 9ffa170 row 7 said proxy_lag (20 for 40); after it says `complete`.
    (Row 6, 30 for 40 `complete` with no read early, was wrong before and after it; now 40, `counter_below`:
    test_the_page_that_passes_a_lost_counters_highest_reading_is_not_short_and_complete.)"""
    rows, truth = _sim(drop=200.0, alt=True, early=early)
    assert not _wrong_complete_rows(rows, truth, _proxied_px(True), from_s=7)


@pytest.mark.parametrize("until", [6.5, 7.0])
def test_a_dip_back_after_1_5_to_2_s_is_not_counted_twice(until):
    """A 100-token one-page dip at 5 s, back at `until`: bypass over 2-12 s must total what ran (400).
    Before: 400 (misplaced, in wrong `complete` rows); after: 480 (the dip booked as a loss AND its recovery
    booked as bypass, in a row reading 140 for 40 that says `complete`)."""
    rows, truth = _sim(drop=100.0, alt=False, drop_until=until)
    got = sum(r["server_tokens"] or 0.0 for r in rows if 2 <= r["t_start_mono_s"] < 12)
    assert got == pytest.approx(float(truth[2:12].sum()), abs=2.0), (got, float(truth[2:12].sum()))


def _lagged_end(lag_s, until_s=16.0):
    """Proxied 160 tokens/s in 2 s streams and bypass 40/s, both ending at until_s - 2; the proxy sees each token
    lag_s after the server counted it (its loop on time: note_proxy_delay says 0). No loss anywhere."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    gen = np.arange(1.0, until_s - 2.0, 0.025)
    seen = gen + lag_s
    cur, n, prev_t, prev_c = None, 0, None, None

    def end(tr):
        tr.end_ns = tr.end_wall_ns = tr.last_ns
        tr.counts = Counts(generated_tokens=int(tr.tokens_seen), prompt_tokens=20, model=None, stop_reason=None,
                           token_source="usage")
        led.on_end(tr)
    for k in range(int(until_s / 0.25) + 1):
        t = k * 0.25
        for ts in seen[(seen > t - 0.25) & (seen <= t)]:
            if cur is None or ts - cur.arrival_ns / S >= 2.0:
                if cur is not None:
                    end(cur)
                n += 1
                cur = _trace(n, ts - 0.01)
                led.on_start(cur)
            cur.first_ns = cur.first_ns or int(ts * S)
            cur.last_ns = int(ts * S)
            cur.tokens_seen += 4
            led.on_tokens(cur, int(ts * S), 4)
        led.note_proxy_delay(int(t * S), 0.0)
        if t == int(t):
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        c = float(5 * (gen <= t).sum())  # 4 proxied + 1 bypass a step
        if t >= 0.5:
            led.add_server_tokens(int(t * S), 0.0 if prev_c is None else c - prev_c,
                                  None if prev_t is None else int(prev_t * S))
            prev_t, prev_c = t, c
        led.advance(int(t * S))
    end(cur)
    led.close_all(int(until_s * S))
    return sink.rows["intervals"]


@pytest.mark.parametrize("lag_s", [0.05, 0.1])
def test_traffic_ending_under_a_steady_unmeasured_lag_is_no_counter_below(lag_s):
    """Nothing lost: the proxy's last tokens arrive lag_s after the counter counted them. Before: no row says
    counter_below. After: row 14 (0 for 0, exact) says counter_below."""
    rows = _lagged_end(lag_s)
    assert not [(r["t_start_mono_s"], r["server_count"]) for r in rows if "counter_below" in r["server_count"]]


def _sglang_short(ntok: int, surplus: int, counted: int, bypass_per_s: float = 0.0, seed: int = 0,
                  per_s: float = 4.0, until_s: float = 22.0, delays: bool = True, then: tuple | None = None,
                  steady_from_s: float | None = None, restart_at_s: float | None = None,
                  said_at: tuple | None = None, late: tuple | None = None, span_s: float = 16.0,
                  calls: tuple | None = None):
    """SGLang's counter (a request's tokens counted at its finish, with the finished requests' number and durations:
    scrape.Scraper.finished). Streams of `ntok` chunks (a token every 20 ms, the proxy seeing each 10 ms later), `per_s`
    a second at random over 2-18 s, each ending a step after its last chunk with a usage of `ntok + surplus` (SGLang's
    end-of-text token: 1; a self-closing call's trailing tokens with it: 3); the counter counts `ntok + counted` of each
    (honest: `counted == surplus`). Bypass requests of 30 tokens, `bypass_per_s` tokens a second, finish at random.
    Scraped every 0.25 s; `then` (surplus, counted, from_s): those of the streams arriving from from_s on;
    `steady_from_s`: from then on a 5-token bypass request finishes in the middle of every window as well;
    `restart_at_s`: the scrape then says the server restarted; `said_at` (t_s, reason): the scrape then says that
    (counter_below: the scraper's sign of a restart its page did not tell); `late` (k, lag_s): every k-th stream reaches
    the proxy lag_s after the server finished it, unmeasured (a buffering hop); `calls` (k, surplus, counted): every
    k-th stream's, from the first; `span_s`: the streams arrive over
    2 s to 2 + span_s (until_s then 6 s past that at least). Returns the interval rows of 3 s to 2 + span_s and all the
    request rows."""
    rng = np.random.default_rng(seed)
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    end_s = 2.0 + span_s
    until_s = max(until_s, end_s + 4.0)
    for k in range(int(until_s) + 3):
        led.add_gpu_sample(int(k * S), int(k * S), [_R(100.0 * k)])
    reqs = []
    for i, a in enumerate(np.sort(rng.uniform(2.0, end_s, int(span_s * per_s)))):
        tr = RequestTrace(i + 1, "POST", "/v1/chat/completions", "t", int(a * S), int(a * S), api="llamacpp",
                          stream=True)
        tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
        lag_ns = int(late[1] * S) if late is not None and i % late[0] == 0 else 0
        seen = (a + 0.02 * np.arange(1, ntok + 1)) * S + S // 100 + lag_ns
        says, counts = (then[0], then[1]) if then is not None and a >= then[2] else (surplus, counted)
        if calls is not None and i % calls[0] == 0:
            says, counts = calls[1], calls[2]
        reqs.append([tr, seen, False, int(seen[-1] + 0.02 * S), says, counts, lag_ns])
    fin = [(q[3] - S // 100 - q[6], ntok + q[5], (q[3] - q[6] - q[0].arrival_ns) / S) for q in reqs]
    fin += [(int(f * S), 30, 0.6) for f in rng.uniform(2.5, end_s, int(span_s * bypass_per_s / 30))]
    if steady_from_s is not None:
        fin += [(int(f * S), 5, 0.1) for f in np.arange(steady_from_s, end_s, 0.25) + 0.125]
    prev, counted_n = None, 0
    for t in np.arange(4, int(until_s) * 4) * (S // 4):
        for q in reqs:
            tr, seen, started, end, says, _, _ = q
            if not started and tr.arrival_ns <= t:
                led.on_start(tr)
                q[2] = True
            for ts in seen[(seen > t - S // 4) & (seen <= t)]:
                tr.first_ns = tr.first_ns or int(ts)
                tr.last_ns = int(ts)
                tr.tokens_seen += 1
                led.on_tokens(tr, int(ts), 1)
            if q[2] and tr.end_ns is None and end <= t:
                tr.end_ns = tr.end_wall_ns = tr.extra["held_end_ns"] = end
                tr.counts = Counts(generated_tokens=ntok + says, prompt_tokens=20, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        if delays:
            led.note_proxy_delay(int(t), 0.0)
        n = sum(x for f, x, _ in fin if f <= t)
        ended = [d for f, _, d in fin if t - S // 4 < f <= t]
        said = ("server_restart",) if restart_at_s is not None and t == int(restart_at_s * S) else ()
        if said_at is not None and t == int(said_at[0] * S):
            said = (*said, said_at[1])
        led.add_server_tokens(int(t), float(n - counted_n), prev, at_finish=True, finished=(len(ended), sum(ended)),
                              partial=said)
        prev, counted_n = int(t), n
        led.advance(int(t))
    led.close_all(int((until_s + 1) * S))
    return [r for r in sink.rows["intervals"] if 3 <= r["t_start_mono_s"] < end_s], sink.rows["requests"]


@pytest.mark.parametrize("ntok", [10, 25, 40])
@pytest.mark.parametrize("surplus", [1, 3])
@pytest.mark.parametrize("bypass_per_s", [0.0, 30.0])
def test_honest_sglang_short_answers_stay_complete_once_its_counter_is_seen_to_count_their_usage_only_tokens(
        ntok, surplus, bypass_per_s):
    """SGLang's short answers (4 a second, 10-40 tokens) whose usage says 1 token (its end-of-text) or 3 (a self-closing
    call's trailing tokens with it) beyond their chunks, its counter counting them too. Per window nothing tells that
    from a usage that over-says, so a window whose such tokens exceeded a token plus 5% of its server count said
    usage_beyond_chunks: with 3 a stream, 14-15 of 15 interval rows and 63-64 of 64 request rows at 10 and 25 tokens, 12
    of 15 and 59 of 64 at 40 (9 and 50 beside 30 bypass tokens/s); with 1, 3 of 15 and 17 of 64 at 10 tokens, 1 and 5 at
    40. The counter's finished-request count says when no bypass request finished in a window: there its rise is the
    proxied streams' tokens, with those tokens (counted) or without (not). Once seen counted (USAGE_COUNTED_VOTES such
    windows of that many a stream, none seen short), the windows are not marked: now 0-2 of the 15 interval rows and
    0-13 of the 64 request rows, all before 5 s (before 3 such windows came)."""
    rows, reqs = _sglang_short(ntok, surplus, surplus, bypass_per_s)
    late = [(r["t_start_mono_s"], r["server_count"]) for r in rows if r["t_start_mono_s"] >= 5]
    assert all(c == "complete" for _, c in late), late
    assert len(reqs) == 64
    marked = [r["request_id"] for r in reqs
              if "bypass-uncounted" in str(r["energy_note"]) and r["t_arrival_utc"] >= 5 * S]
    assert not marked, marked


@pytest.mark.parametrize("ntok", [10, 25, 40])
@pytest.mark.parametrize("bypass_per_s", [0.0, 30.0])
def test_an_at_finish_server_whose_usage_over_says_its_counter_stays_marked_and_never_complete_wrong(ntok,
                                                                                                   bypass_per_s):
    """The same streams, usage 3 beyond their chunks, the counter counting none of the 3: beside bypass traffic as
    many bypass tokens hide behind them. Its clean windows (no bypass request finished) read its rise 3 a stream short
    of the proxied tokens: never learned counted, and once seen short 3 times every window holding any such token says
    usage_beyond_chunks. By the tolerance alone, 40-token answers beside 30 bypass tokens/s left 6 of 15 rows
    `complete`, 3 of them off past the bound below (15, 76 and 67.5 for 30, 90 and 85: a window's bound is its own, and
    a row's 4 took more); now 15 of 15 are marked. No row
    saying `complete` reads further from the honest server's same run (the figures the ledger gives with nothing
    hidden) than the rule's bound, a token plus 5% of the row's server count."""
    rows, _ = _sglang_short(ntok, 3, 0, bypass_per_s)
    honest, _ = _sglang_short(ntok, 3, 3, bypass_per_s)
    assert len(rows) == len(honest)
    wrong = [(r["t_start_mono_s"], r["server_tokens"], h["server_tokens"]) for r, h in zip(rows, honest)
             if r["server_count"] == "complete"
             and abs((r["server_tokens"] or 0.0) - (h["server_tokens"] or 0.0))
             > 1.0 + LAG_SHARE * ((h["server_tokens"] or 0.0) + h["proxy_tokens"])]
    assert not wrong, wrong
    said = [r["server_count"] for r in rows]
    assert sum("usage_beyond_chunks" in c for c in said) >= 0.6 * len(rows), said


def test_without_the_proxys_delay_measured_nothing_is_learned_and_short_answers_stay_marked():
    """Where the proxy's delay is not measured, a stream's finish may sit past a window's edge at the server by any
    lag: no window tells, and they are marked as before."""
    rows, _ = _sglang_short(25, 3, 3, 0.0, delays=False)
    assert all("usage_beyond_chunks" in r["server_count"] for r in rows)


def test_a_counter_seen_counting_one_usage_only_token_is_not_taken_to_count_three():
    """A counter that counts the end-of-text token but not a call's other 2 trailing tokens (as if its usage over-said
    those): seen counting 1 a stream over 2-10 s, then from 10 s 3-a-stream answers beside a 5-token bypass request
    finishing in every window (so no window tells again). Each may hide 2 bypass tokens: on the word of the 1-a-stream
    windows they would read `complete`; they stay usage_beyond_chunks, as before the rule."""
    rows, _ = _sglang_short(25, 1, 1, 0.0, then=(3, 1, 10.0), steady_from_s=10.0)
    early = [r["server_count"] for r in rows if 5 <= r["t_start_mono_s"] < 10]
    assert early and all(c == "complete" for c in early), early
    late = [r["server_count"] for r in rows if r["t_start_mono_s"] >= 11]
    assert late and all("usage_beyond_chunks" in c for c in late), late


def test_what_was_seen_of_a_counter_is_forgotten_at_its_restart():
    """Seen counting a call's 3 trailing tokens over 2-10 s, the server restarts at 10 s as a build whose counter counts
    none of them, a 5-token bypass request finishing in every window from then on (so no window tells again): each
    window may hide 3 of its 5 bypass tokens. Its windows are judged afresh, by the tolerance: usage_beyond_chunks."""
    rows, _ = _sglang_short(25, 3, 3, 0.0, then=(3, 0, 9.6), steady_from_s=10.0, restart_at_s=10.0)
    early = [r["server_count"] for r in rows if 5 <= r["t_start_mono_s"] < 9]
    assert early and all(c == "complete" for c in early), early
    late = [r["server_count"] for r in rows if r["t_start_mono_s"] >= 11]
    assert late and all("usage_beyond_chunks" in c for c in late), late


def test_what_was_seen_of_a_counter_is_forgotten_where_the_scraper_saw_a_restart_its_page_did_not_tell():
    """As above, but the restart is one SGLang's page cannot tell (no start time; a counter fallen by under half, read
    below its highest reading at two pages): the scraper says counter_below at 10 s. Kept (review s52), the votes of
    before left rows 10-17 `complete` reading 0-13 bypass tokens for 20: judged afresh, they say usage_beyond_chunks."""
    rows, _ = _sglang_short(25, 3, 3, 0.0, then=(3, 0, 9.6), steady_from_s=10.0, said_at=(10.0, "counter_below"))
    early = [r["server_count"] for r in rows if 5 <= r["t_start_mono_s"] < 9]
    assert early and all(c == "complete" for c in early), early
    late = [r["server_count"] for r in rows if r["t_start_mono_s"] >= 11]
    assert late and all("usage_beyond_chunks" in c for c in late), late


def test_a_verdict_on_a_counter_lapses_where_no_window_tells_again():
    """A counter whose counting changed with no sign at all (a new build unseen by any scrape, the steady bypass
    traffic after it leaving no window that tells): what was seen before is believed for USAGE_VOTE_S at most, then the
    windows are judged by the tolerance again. Before, believed for the daemon's life (rows 10 s on `complete`, 0-13
    bypass tokens for 20)."""
    rows, _ = _sglang_short(25, 3, 3, 0.0, then=(3, 0, 9.6), steady_from_s=10.0, span_s=48.0)
    lapsed = [r["server_count"] for r in rows if r["t_start_mono_s"] >= 9.6 + USAGE_VOTE_S + 1]
    assert len(lapsed) >= 5 and all("usage_beyond_chunks" in c for c in lapsed), lapsed


def test_an_honest_counters_few_windows_timed_wrong_do_not_mark_its_rows_for_good():
    """Honest SGLang over 2 minutes (100-token answers 4 a second, 30-token bypass requests 1 a second), one stream in
    8 reaching the proxy 150 ms after the server finished it, a delay the proxy's loop did not measure (a buffering
    hop): now and then such a stream lands in a window where a bypass request finished, and the window votes "short".
    Kept for the daemon's life, those votes outweighed 90 exact ones: 70 of 115 rows and 288 of 464 requests marked,
    every row from 47 s on (review s52). Votes of the latest USAGE_VOTE_S only, and a few short among many exact: 10%
    at most marked (1 and 3 before the counted rule)."""
    rows, reqs = _sglang_short(100, 1, 1, 30.0, seed=1, late=(8, 0.15), span_s=116.0)
    marked = [r["t_start_mono_s"] for r in rows if "usage_beyond_chunks" in r["server_count"]]
    assert len(rows) >= 110 and len(marked) <= 0.1 * len(rows), (len(marked), len(rows), marked)
    marked_reqs = [r["request_id"] for r in reqs if "bypass-uncounted" in str(r["energy_note"])]
    assert len(reqs) >= 450 and len(marked_reqs) <= 0.1 * len(reqs), (len(marked_reqs), len(reqs))


def test_a_counter_short_of_calls_trailing_tokens_leaves_the_windows_of_its_counted_end_of_text_token_complete():
    """Plain answers (1 token beyond the chunks, counted) and every 6th a call (3 beyond, the counter counting 1 of
    them): the calls' windows vote short of 3, the plain answers' windows exact for 1. The calls' windows are marked
    (2 bypass tokens may hide behind each); a row where no call finished stays `complete`. With one short tally for all
    numbers (review s52), the calls' votes marked every window holding an end-of-text token too: row 16 s, no call
    finishing in it, said usage_beyond_chunks."""
    rows, reqs = _sglang_short(100, 1, 1, 30.0, calls=(6, 3, 1))
    call_ends = np.array([r["t_end_utc"] for r in reqs if (r["request_id"] - 1) % 6 == 0], dtype=float) / S
    quiet = [(r["t_start_mono_s"], r["server_count"]) for r in rows
             if not ((call_ends >= r["t_start_mono_s"] - 0.1) & (call_ends < r["t_start_mono_s"] + 1.1)).any()]
    assert quiet and all(c == "complete" for _, c in quiet), quiet
    # From 14 s (three of the calls' windows have voted short by then):
    late_calls = [r["server_count"] for r in rows if r["t_start_mono_s"] >= 14
                  and ((call_ends >= r["t_start_mono_s"] + 0.1) & (call_ends < r["t_start_mono_s"] + 0.9)).any()]
    assert late_calls and all("usage_beyond_chunks" in c for c in late_calls), late_calls


def _px_of(alt, proxied_until=np.inf, pace_fall_at=np.inf):
    """The proxied tokens per 1 s row of `_sim` with these settings."""
    g = np.arange(1.0, 22.0, 0.025)
    g = g[g < proxied_until]
    w = np.where((np.floor(g / 0.25).astype(int) % 2 == 1) & alt, 2, 4)
    w = np.where(g >= pace_fall_at, 2, w)
    return np.histogram(g, bins=np.arange(0, 25), weights=w)[0]


@pytest.mark.parametrize("get_s", [None, 0.004])
@pytest.mark.parametrize("scene", [dict(early=0.0), dict(early=0.1), dict(proxied_until=6.5), dict(pace_fall_at=6.1),
                                   dict(skip=(5.5, 5.75)), dict(skip=(6.0, 6.25, 6.5, 6.75))])
def test_the_page_that_passes_a_lost_counters_highest_reading_is_not_short_and_complete(scene, get_s):
    """200 tokens lost for good at 5 s beside an alternating proxied pace and bypass traffic at 40 tokens/s. The
    scraper counts the page that passes its highest reading from that reading: short of its own tokens by what was
    left of the loss, within the run's tolerance of the proxy's tokens (bypass traffic fills it), so no run took it in.
    Before: row 6 read 30 for 40 (`complete`; 38 read 0.1 s early, within the bound), 10 for 20 where the streams end
    at 6.5 s, 8 for 40 with the scrapes of 6-6.75 s missed. Now that page, short of the proxy's tokens and the bypass
    pace before the run by over its tolerance, is of the run: its shortfall added back, row 6 reads 40 (45 read early),
    `counter_below`."""
    if get_s is not None and scene.get("early"):
        pytest.skip("a read early is told by the GET's span")
    rows, truth = _sim(drop=200.0, alt=True, get_s=get_s, **scene)
    px = _px_of(True, scene.get("proxied_until", np.inf), scene.get("pace_fall_at", np.inf))
    assert not _wrong_complete_rows(rows, truth, px)


@pytest.mark.parametrize("alt", [False, True])
@pytest.mark.parametrize("drop", [50.0, 100.0, 200.0])
def test_a_one_page_dip_back_within_the_second_leaves_no_row_wrong_and_complete(drop, alt):
    """A multi-process page's dip of `drop` tokens at 5 or 5.1 s, back 0.25-0.75 s later (the scraper's first page
    below its highest reading unsaid, the next ones counter_below, or at 50 a page merely flat). The run's shortfall,
    won back in the second after it, was left in the gap: the 1 s lookahead of the windows before it took it into their
    levels as the proxy's lag (0 or 10 of their 40 bypass tokens), and the window it came back in read it as bypass
    (80-90 for 40). Before, over these 24 scenes each (72 in all): 64 wrong rows saying `complete` in 42 scenes (row 4
    at 0 for 40 beside row 5 at 90 for 40, both `complete`, a 50-token dip). Now none: the dip is added back over its
    run (counter_below) and taken back out of the windows it came back in (proxy_lag), and the bypass tokens of 2-12 s
    still total what ran. Energy is conserved in every row."""
    wrong, totals = [], []
    for drop_at in (5.0, 5.1):
        for back_s in (0.25, 0.5, 0.75):
            for get_s in (None, 0.004):
                rows, truth = _sim(drop=drop, alt=alt, drop_at=drop_at, drop_until=drop_at + back_s, get_s=get_s)
                wrong += [(drop_at, back_s, get_s, w) for w in _wrong_complete_rows(rows, truth, _px_of(alt))]
                got = sum(r["server_tokens"] or 0.0 for r in rows if 2 <= r["t_start_mono_s"] < 12)
                if abs(got - float(truth[2:12].sum())) > 2.0:
                    totals.append((drop_at, back_s, get_s, got))
                for r in rows:
                    assert r["requests_energy_j"] + (r["idle_energy_j"] or 0.0) + r["unproxied_energy_j"] \
                        == pytest.approx(r["gpu_energy_j"] or 0.0, abs=1e-6), r
    assert not wrong, wrong
    assert not totals, totals


@pytest.mark.parametrize("drop_at", [5.1, 5.2])
@pytest.mark.parametrize("drop", [100.0, 200.0])
def test_a_loss_beside_an_alternating_pace_with_no_get_told_is_not_taken_for_a_read_early(drop, drop_at):
    """No GET told: a counter read up to 1 s early may lack the proxy's tokens of the stretch before a run's end and hold
    those before its start. That was bounded by the rise of the proxy's rate from the window before the run to its last
    window, over 1 s: beside a pace alternating 160/80 tokens/s each 0.25 s, 80 tokens, where a read early leaves at
    most 20. A loss at 5.1 or 5.2 s went unjudged (its run's shortfall 70 of 80 allowed): rows 4 and 6 read 10 for 40,
    `complete` (200 lost: row 4 10 for 40). Now the bound is the proxy's own tokens (the most P(t-e, t] - P(s-e, s] over
    e up to 1 s): the loss is judged, and the windows before the run whose level the part left in the gap (what a read
    early may explain) lowered say counter_below: rows 4-5 (and 6 at 200) say so, row 6 reads 40 `complete` at 100."""
    rows, truth = _sim(drop=drop, alt=True, drop_at=drop_at)
    assert not _wrong_complete_rows(rows, truth, _px_of(True))


@pytest.mark.parametrize("drop,alt,back_s", [(40.0, False, 0.25), (40.0, False, 0.5), (20.0, True, 0.25)])
def test_a_one_page_dip_with_no_bypass_traffic_beside_it_leaves_its_rows_complete(drop, alt, back_s):
    """The page flat for a scrape at 5 s (a dip of one window's proxied tokens: the scraper sees no fall) and no bypass
    traffic: nothing hides behind the dip's lookahead, and its return stays under the reference, every row `complete`
    and exact, before and now. Added back (as beside bypass traffic), the dip marked rows 4 and 5 (`counter_below`,
    `proxy_lag`): so it marked every dip the proxy's placing jitter makes, 13 more rows of 72 scenes of random lags."""
    rows, truth = _sim(drop=drop, alt=alt, drop_until=5.0 + back_s, bypass_from=30.0)
    got = [(r["t_start_mono_s"], r["server_tokens"], r["server_count"]) for r in rows if 2 <= r["t_start_mono_s"] < 21]
    assert all(c == "complete" and abs(n or 0.0) <= 1.0 for _, n, c in got), got


def test_a_dip_back_after_the_second_beside_an_alternating_pace_with_no_get_told_books_no_bypass_unmarked():
    """A 50-token dip at 5 s back at 6.5 s, no bypass traffic, no GET told, the proxied pace alternating 160/80
    tokens/s. Added back as a loss, its return (70 counted for 20 placed) is taken back out of it only beyond what a read
    early may hold: that was the fall of the proxy's rate over 1 s, 80 tokens between an alternating pace's windows,
    so the return stayed: row 6 read 50 (49) bypass tokens for none, `complete`. Now the most a read up to 1 s early
    holds beyond the window's own tokens, from the proxy's own tokens (20 here): row 6 reads 21 and says proxy_lag."""
    rows, truth = _sim(drop=50.0, alt=True, drop_until=6.5, bypass_from=30.0)
    assert not _wrong_complete_rows(rows, truth, _px_of(True))


def test_two_dips_in_a_row_with_no_bypass_traffic_book_no_bypass_tokens_unmarked():
    """No bypass traffic, the proxied pace alternating 160/80 tokens/s, no GET told: a 100-token dip 5.0-5.5 s, then a
    200-token one 5.75-6.25 s. The bypass pace before the second run was taken from the windows of the second before
    it, the first dip's return among them (80 counted for 20 proxied: 240 tokens/s): with it the second dip was judged
    a loss and added back, and its passing page's return (100 for 40) within the proxy's tokens and that pace, its 60
    booked as bypass tokens: row 6 read 60 for 0, `complete` (review s52). A window within 1 s after a run is no
    bypass pace: row 6 reads 20 and says proxy_lag, as before the dip rules."""
    rows, truth = _sim(dips=((100.0, 5.0, 5.5), (200.0, 5.75, 6.25)), alt=True, burst=[])
    assert not _wrong_complete_rows(rows, truth, _px_of(True))


def _jittered_loss(seed: int, drop: float, drop_at: float, until_s: float = 20.0):
    """Streams at random times (2 a second, 5-200 tokens at 50 tokens/s, chunks of 5, up to 20 ms late to the proxy),
    random bypass tokens 40/s, the counter losing `drop` tokens at `drop_at` for good, scraped every 0.25 s as `_sim`
    does (the scraper counting from its highest reading), no GET told. Returns rows, true bypass and proxied tokens
    per 1 s row."""
    rng = np.random.default_rng(seed)
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    ev, gens = [], []
    for i, a in enumerate(np.sort(rng.uniform(1.0, until_s - 4.0, int(2.0 * (until_s - 5.0))))):
        n = int(rng.integers(5, 200))
        g = a + 0.05 + np.arange(1, n + 1) / 50.0
        gens.append(g)
        lag = rng.uniform(0, 0.02)
        ev.append((a, 0, i, 0))
        for j in range(0, n, 5):
            jj = min(n, j + 5)
            ev.append((g[jj - 1] + lag + rng.uniform(0, 0.005), 1, i, jj - j))
        ev.append((g[-1] + lag + 0.006, 2, i, n))
    ev.sort()
    allg = np.concatenate(gens)
    bypass = np.sort(rng.uniform(1.0, until_s - 2.0, int(40.0 * (until_s - 3.0))))
    trs, e = {}, 0
    prev_t, high, dipped = None, None, False
    for k in range(int(until_s / 0.25) + 1):
        t = k * 0.25
        while e < len(ev) and ev[e][0] <= t:
            ts, kind, i, n = ev[e]
            e += 1
            if kind == 0:
                trs[i] = _trace(i + 1, ts)
                led.on_start(trs[i])
                continue
            tr = trs[i]
            if kind == 1:
                tr.first_ns = tr.first_ns or int(ts * S)
                tr.last_ns = int(ts * S)
                tr.tokens_seen += n
                led.on_tokens(tr, int(ts * S), n)
            else:
                tr.end_ns = tr.end_wall_ns = int(ts * S)
                tr.counts = Counts(generated_tokens=n, prompt_tokens=20, model=None, stop_reason=None,
                                   token_source="usage")
                led.on_end(tr)
        led.note_proxy_delay(int(t * S), 0.0)
        if t == int(t):
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        count = float((allg <= t).sum() + (bypass <= t).sum()) - (drop if drop_at <= t else 0.0)
        if t >= 0.5:
            if high is None:
                led.add_server_tokens(int(t * S), 0.0, None)
                high, prev_t = count, t
            elif count < high and not dipped:
                dipped = True
            elif count < high:
                led.add_server_tokens(int(t * S), 0.0, int(prev_t * S), partial=("counter_below",))
                prev_t = t
            else:
                dipped = False
                led.add_server_tokens(int(t * S), count - high, int(prev_t * S))
                high, prev_t = count, t
        led.advance(int(t * S))
    led.close_all(int(until_s * S))
    bins = np.arange(0, until_s + 1)
    return (sink.rows["intervals"], np.histogram(bypass, bins=bins)[0].astype(float),
            np.histogram(allg, bins=bins)[0].astype(float))


def test_a_loss_among_jittered_streams_marks_the_rows_after_it_whose_figure_what_its_reads_may_explain_lowers():
    """200 tokens lost for good at 5.1 s among jittered streams, no GET told. The run's no-GET read-early allowance
    (`_read_early_most`, a random walk's most over 1 s: 50 tokens) and its own bypass tokens are not added back: 103 of
    200 are, the rest left in the gap, and the reference held from before the run stood above row 6's level by it: row
    6 read 15.8 for 41, `complete` (review s52). Whether a read early or the loss, nothing tells: a window after the run
    whose figure that part would raise past its tolerance says counter_below."""
    rows, truth, px = _jittered_loss(7, drop=200.0, drop_at=5.1)
    assert not _wrong_complete_rows(rows, truth, px)
