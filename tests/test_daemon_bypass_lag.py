"""The ledger's leftovers in the bypass count (docs/daemon.md, "A server restart", its limits): a proxy delay of its own
that never drains within LAG_S, a piece of one step placed at its stamp, and an end's re-placing put back past a
restart's cut into intervals already closed. Each is measured against the truth of a synthetic feed (scrapes, a proxy
worker's pieces), as tests/test_daemon_bypass_partial.py drives the ledger: its figure is right, or its row says it may
not be (`server_count`, the request's note), never `complete` and wrong."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.daemon.ledger import Ledger
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.streams import Counts
from test_daemon_bypass_partial import S, _R, _read_pieces_due, _Sink


def _streams_at(led, feeds, t: float, end_after_s: float) -> None:
    """At `t` s: each stream of `feeds` ((trace, pieces)) started once it arrived, its pieces due read, and ended
    `end_after_s` after its last."""
    for tr, pieces in feeds:
        if tr.request_id not in led.requests and tr.end_ns is None and t >= tr.arrival_ns / S:
            led.on_start(tr)
        _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= pieces[-1][0] + end_after_s:
            tr.end_ns = tr.end_wall_ns = int(pieces[-1][0] * S)
            led.on_end(tr)


def _scrape(led, t: float, gen, prev_t, prev_total) -> tuple[float, float]:
    """The server's counter read at t (`gen`: its tokens' instants): the window since the last read, added."""
    count = float((gen <= t).sum())
    led.add_server_tokens(int(t * S), 0.0 if prev_t is None else count - prev_total,
                          None if prev_t is None else int(prev_t * S))
    return t, count


def _streams(rate: float, phase_s: float, delay_s: float = 0.003, seqs: int = 1, record_s: float = 0.02,
             streams=((1.0, 4.0), (8.0, 11.0)), bypass=(), measured_s: float | None = None, keep: list | None = None,
             late=None, sample_s: float = 0.25):
    """A ledger fed proxied streams of `rate` steps/s (`seqs` tokens a step: one per sequence) over `streams` ((start s,
    end s) each), shipped by a proxy worker in `record_s` records, each stamped `delay_s` after its last token (the
    worker's record, plus any delay of its own: a loaded host's event loop), scrapes every 0.1 s offset by `phase_s`,
    0.25 s GPU samples. `bypass`: the instants of tokens sent straight to the server. `measured_s`: the lateness of the
    proxy's event loop the daemon measures, at every sample (None: not measured). `keep`: the sink is appended to it
    (its request rows). `late`: how late the proxy's loop runs at each instant, s, beyond `delay_s` (a loaded host whose
    lateness changes): a token counted at t is read at t + delay_s + late(t) (the tokens of a loop that woke late read
    in one go, never before those read earlier), and the daemon measures it every 0.25 s as its tick does: a measure
    due at t taken at t + delay_s + late(t), saying that much (measured_s is then not used). `sample_s`: the GPU
    samples' period; 0.1 puts them at the scrapes, each interval row then one scrape window's. Returns (interval rows
    sorted by start, the truth: every bypass token's instant)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    if keep is not None:
        keep.append(sink)
    feeds, counted = [], []
    for i, (a, b) in enumerate(streams):
        steps = a + np.arange(int(round((b - a) * rate))) / rate
        counted.append(np.repeat(steps, seqs))  # the server counts each sequence's token at its step
        rec = np.floor((steps - a) / record_s + 1e-9)
        pieces = [(float(steps[rec == j].max()) + delay_s, int((rec == j).sum()) * seqs) for j in np.unique(rec)]
        if late is not None:
            read: list = []
            for ts, n in pieces:
                ts = max(ts + late(ts - delay_s), read[-1][0] if read else 0.0)
                if read and read[-1][0] == ts:
                    read[-1] = (ts, read[-1][1] + n)
                else:
                    read.append((ts, n))
            pieces = read
        tr = RequestTrace(i + 1, "POST", "/completion", None, int((a - 0.05) * S), int((a - 0.05) * S), api="llamacpp",
                          stream=True)
        tr.extra["sequences"] = seqs
        tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
        feeds.append((tr, pieces))
    gen = np.concatenate(counted + [np.asarray(bypass, dtype=float)])
    t_last = max(p[-1][0] for _, p in feeds)
    prev_t, prev_total = None, 0.0
    beats = [] if late is None else sorted((d + delay_s + late(d), delay_s + late(d)) for d in np.arange(0.0, t_last + 4, 0.25))
    for k in range(int((t_last + 4) / 0.005)):
        t = round(k * 0.005, 6)
        _streams_at(led, feeds, t, 0.001)
        while beats and beats[0][0] <= t:
            led.note_proxy_delay(int(beats[0][0] * S), beats[0][1])
            beats.pop(0)
        if (k - (round(phase_s / 0.005) if sample_s == 0.1 else 0)) % round(sample_s / 0.005) == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 50 == 0:
            if measured_s is not None and late is None:
                led.note_proxy_delay(int(t * S), measured_s)
        if (k - round(phase_s / 0.005)) % 20 == 0 and t >= 0.5:
            prev_t, prev_total = _scrape(led, t, gen, prev_t, prev_total)
        led.advance(int(t * S), int(t * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"]), np.asarray(bypass, dtype=float)


def _said(rows) -> list:
    return [(r["t_start_mono_s"], r["server_tokens"], r["server_count"]) for r in rows if r["server_tokens"]]


@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("delay_s", [0.03, 0.05, 0.1])
def test_a_proxy_delay_of_its_own_reads_as_bypass_tokens_only_in_rows_that_say_so(delay_s, measured):
    """The proxy reads each record `delay_s` after the server counted its tokens (a loaded host's event loop; the
    records' own 20 ms are placed over the time since the previous one, not this): the server's count stays that
    delay's tokens ahead of the proxy's for as long as a stream runs, never drains within LAG_S, and the stream's first
    windows read it as bypass tokens that never ran. Before, in rows saying `complete` (300 tokens/s, two streams: 18,
    30 and 60 of 0 for delays of 30, 50 and 100 ms, whatever the scrapes' phase). Now those rows say `proxy_lag`, the
    delay measured on the proxy's loop or not (then up to LAG_S)."""
    for phase_s in (0.0, 0.035, 0.07):
        rows, _ = _streams(300, phase_s, delay_s=delay_s, measured_s=delay_s if measured else None)
        # No bypass traffic ran: every such token is the proxy's lag. A token a stream at most in rows that say
        # `complete`: what a record's own delay moves whatever the placing (LAG_TOKENS).
        assert sum(r["server_tokens"] or 0 for r in rows if r["server_count"] == "complete") <= 2 + 1e-6, (
            delay_s, phase_s, _said(rows))
        assert any("proxy_lag" in r["server_count"] for r in rows if r["server_tokens"]), _said(rows)
        # Both streams' starts, each time: the level of the lag is not held past CREDIT_S between them.
        assert sum(r["server_tokens"] or 0 for r in rows) <= 2 * delay_s * 300 + 2 + 1e-6, _said(rows)


@pytest.mark.parametrize("measured_s", [None, 0.003])
def test_a_piece_of_one_step_a_sequence_reads_as_bypass_only_in_rows_that_say_so(measured_s):
    """A stream of 16 sequences at 30 steps a second: each record is one step, 16 tokens, placed at its stamp (3 ms
    after the server counted it). Scrapes in that phase with the steps (every 0.1 s, three steps apart) each fell in
    those 3 ms: the server 16 tokens ahead at every window, read as 16 bypass tokens at the stream's start, `complete`.
    Now that row says `proxy_lag`, the proxy's delay measured (3 ms: those 16 tokens come within it) or not; out of
    that phase, nothing is read."""
    for phase_s in np.arange(0.0, 0.1, 0.01):
        rows, _ = _streams(30, float(phase_s), seqs=16, streams=((1.0, 4.0),), measured_s=measured_s)
        assert sum(r["server_tokens"] or 0 for r in rows if r["server_count"] == "complete") <= 1 + 1e-6, (
            phase_s, _said(rows))
        assert sum(r["server_tokens"] or 0 for r in rows) <= 16 + 1e-6


@pytest.mark.parametrize("delay_s", [0.003, 0.05])
def test_a_real_bypass_stream_beside_a_lagging_proxy_still_counts(delay_s):
    """A bypass stream of 100 tokens (20 a second, from 2 s to 7 s) beside the proxied streams: its count is kept
    (within 2 tokens, less what the lag added, which the rows say), and a `complete` row holds what ran there."""
    bypass = 2.0 + np.arange(100) / 20.0
    for phase_s in (0.0, 0.035, 0.07):
        rows, truth = _streams(300, phase_s, delay_s=delay_s, bypass=bypass)
        got = sum(r["server_tokens"] or 0 for r in rows)
        lag = 2 * delay_s * 300
        assert 100 - 2 - 1e-6 <= got <= 100 + lag + 2 + 1e-6, (delay_s, phase_s, got, _said(rows))
        for r in rows:
            if r["server_count"] == "complete":
                a, b = r["t_start_mono_s"], r["t_start_mono_s"] + r["duration_s"]
                true = float(((truth > a) & (truth <= b)).sum())
                # A scrape window's tokens are spread over its 0.1 s: a token or two across an interval's edge.
                assert abs((r["server_tokens"] or 0) - true) <= 2 + 1e-6, (delay_s, phase_s, a, r["server_tokens"], true)


def _cut_burst(end_s: float, rest: int = 0):
    """A request that arrived (5.9 s) before a server restart (6.2 s, down until 7.0 s: the last scrape before it at
    6.0 s, the first after at 6.75 s) reaches the proxy in one burst of 40 tokens stamped 7.1 s, read before that first
    scrape was added (7.15 s: a slow read, dated at its midpoint); the intervals close past 7.0 s (an edge read at
    7.05 s, the scrape hold's 10 s) before its end at `end_s`. `rest`: tokens of a second piece at 7.12 s (the burst is
    then its first, placed back at its end by `_first_burst`). Returns its request row and the ledger."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    tr = RequestTrace(1, "POST", "/completion", None, int(5.9 * S), int(5.9 * S), api="llamacpp", stream=True)
    tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    prev_t, prev_c = None, 0.0
    for k in range(int(20 / 0.05) + 1):
        t = round(k * 0.05, 6)
        if abs(t - 5.9) < 1e-9:
            led.on_start(tr)
        if abs(t - 7.05) < 1e-9:
            led.add_gpu_edge(int(7.05 * S), int(7.05 * S), [705.0])
        if abs(t - 7.1) < 1e-9:
            tr.first_ns = tr.last_ns = int(7.1 * S)
            tr.tokens_seen = 40
            led.on_tokens(tr, int(7.1 * S), 40)
        if rest and abs(t - 7.1) < 1e-9:  # 20 ms after the burst, in the same step of this feed
            tr.last_ns = int(7.12 * S)
            tr.tokens_seen += rest
            led.on_tokens(tr, int(7.12 * S), rest)
        if abs(t - 7.15) < 1e-9:
            led.add_server_tokens(int(6.75 * S), 0.0, int(6.0 * S), partial=("server_restart",))
            prev_t, prev_c = 6.75, 0.0
        if abs(t - end_s) < 1e-9:
            tr.end_ns = tr.end_wall_ns = int(t * S)
            tr.counts = Counts(generated_tokens=40 + rest, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
            led.on_end(tr)
        if abs(t - round(t)) < 1e-9:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if abs(t / 0.25 - round(t / 0.25)) < 1e-9 and t >= 0.5 and not (6.0 < t < 7.2):
            c = 40.0 if t <= 6.0 else 0.0  # the old process counted the 40 before it died; the new one nothing
            led.add_server_tokens(int(t * S), 0.0 if prev_t is None else max(c - prev_c, 0.0),
                                  None if prev_t is None else int(prev_t * S))
            prev_t, prev_c = t, c
        led.advance(int(t * S))
    led.close_all(int(20 * S))
    [row] = sink.rows["requests"]
    return row, led


@pytest.mark.parametrize("rest", [0, 2])
@pytest.mark.parametrize("end_s", [8.5, 17.05, 17.5, 19.0])
def test_an_ends_re_placing_past_a_restarts_cut_into_closed_intervals_is_late_and_said(end_s, rest):
    """At its end the burst is spread back over its run (`_spread_burst`), put back no later than the restart's first
    scrape (6.75 s, `_at_server_pace`). Ending once the intervals had closed past that (17.05 s, 17.5 s), every event
    landed before the first open interval: spent with the next close outside every interval, its 40 tokens were in no
    interval's energy and not late, its row silent (0 of 40 attributed, no error); as a first burst with a second
    piece (`_first_burst`) likewise. Now they are late, and said."""
    row, led = _cut_burst(end_s, rest)
    late = led.late_tokens
    assert row["attributed_tokens"] + late == pytest.approx(40.0 + rest), (row["attributed_tokens"], late)
    if late:
        assert f"{late:g} token(s) arrived after their interval had closed" in (row["error"] or ""), row["error"]


@pytest.mark.parametrize("with_stream", [False, True])
def test_bypass_traffic_beginning_with_a_proxied_stream_on_a_proxy_on_time_is_complete(with_stream):
    """Bypass traffic that begins and ends as proxied streams do (bursty traffic, some of it straight to the server)
    reads as a proxy lag would: without a measure of the proxy's delay its windows say `proxy_lag`, as nothing tells
    them apart. With the proxy's loop measured on time (3 ms: a record's own delay, placed back) they are `complete`,
    and counted."""
    bypass = np.concatenate([1.0 + np.arange(60) / 20.0, 8.0 + np.arange(60) / 20.0]) if with_stream else ()
    for phase_s in (0.0, 0.035, 0.07):
        rows, truth = _streams(300, phase_s, bypass=bypass, measured_s=0.003)
        assert {r["server_count"] for r in rows} - {"unscraped", "unread"} == {"complete"}, (phase_s, _said(rows))
        got = sum(r["server_tokens"] or 0 for r in rows)
        assert len(truth) - 2 - 1e-6 <= got <= len(truth) + 2 + 1e-6, (phase_s, got, _said(rows))
    if with_stream:
        rows, _ = _streams(300, 0.0, bypass=bypass)  # not measured: up to LAG_S
        assert any("proxy_lag" in r["server_count"] for r in rows), _said(rows)


def test_a_lag_within_its_share_of_a_busy_window_is_counted_not_marked():
    """A proxy 4 ms late (measured: a loaded host's loop, often 5-30 ms) beside streams of 1000 tokens/s moves about 4
    of the 100 tokens of each 0.1 s scrape window where a stream begins or ends. Before, over a token marked the row
    `proxy_lag` and left its requests out of J/token (on a host with two CPU hogs, 1 run in 3 of
    tests/test_daemon_tag_bypass.py: its tag left out of analyze for 2-4 tokens of a window of 179-302). Now a row is
    marked where the lag may move more than a token and more than LAG_SHARE of its window's count: unmarked, the lag
    it holds is within a token plus that share of each window's tokens (docs/daemon.md, "A server restart")."""
    from powerprof.daemon.reconcile import LAG_SHARE, LAG_TOKENS

    bound = LAG_TOKENS + LAG_SHARE * 1000 * 0.1  # a stream's start: its window's 100 tokens
    for phase_s in (0.0, 0.035, 0.07):
        rows, _ = _streams(1000, phase_s, delay_s=0.004, measured_s=0.004)
        # No bypass traffic ran: every bypass token is the proxy's lag, two streams' starts and ends.
        assert sum(r["server_tokens"] or 0 for r in rows if r["server_count"] == "complete") <= 2 * bound + 1e-6, (
            phase_s, _said(rows))
        if phase_s == 0.0:
            # In phase with the scrapes a stream's start reads the lag's 6 tokens in a window of 100: within the share,
            # counted. Its end's window holds a few tokens, the lag it drains more than its share: still marked.
            assert {c for _, n, c in _said(rows)} == {"complete"}, _said(rows)
            assert any("proxy_lag" in r["server_count"] for r in rows), _said(rows)
    # A lag over the share is still marked: 20 ms late, 21 tokens a stream.
    rows, _ = _streams(1000, 0.0, delay_s=0.02, measured_s=0.02)
    assert sum(r["server_tokens"] or 0 for r in rows if r["server_count"] == "complete") <= 2 * bound + 1e-6, _said(rows)
    assert any("proxy_lag" in r["server_count"] for r in rows if r["server_tokens"]), _said(rows)


@pytest.mark.parametrize("stall", [(2.93, 3.02), (2.95, 3.04)])
def test_a_stall_of_the_proxys_loop_at_a_scrape_is_marked_though_the_rest_of_its_lookahead_ran_on_time(stall):
    """The proxy's loop stands still for 90 ms across a scrape (a loaded host; under the 100 ms a held burst is placed
    back from), beside a steady bypass stream of 100 tokens/s: the server counted tokens the proxy read only after it,
    and that window's level held them as bypass tokens, the next window's hid as many. The daemon measured the stall
    (its 0.25 s tick woke late), but the mark took the least delay measured over the window's 1 s lookahead, on time
    elsewhere: before, the rows either side of the scrape said `complete` and held 30 and 20 bypass tokens for 25 each
    (a scrape window 5 over and 5 under, 2 tokens its bound). Now the delay is the one at the window's own edge, and
    they say `proxy_lag`; a `complete` row holds what ran there."""
    a, b = stall
    bypass = 1.0 + np.arange(500) / 100.0
    for phase_s in (0.0, 0.07):
        rows, truth = _streams(300, phase_s, streams=((1.0, 6.0),), bypass=bypass,
                               late=lambda t: b - t if a <= t <= b else 0.0)
        assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=2), _said(rows)
        for r in rows:
            lo, hi = r["t_start_mono_s"], r["t_start_mono_s"] + r["duration_s"]
            if r["server_count"] == "complete" and 1.5 <= lo and hi <= 5.5:  # away from the bypass stream's ends
                true = float(((truth > lo) & (truth <= hi)).sum())
                assert abs((r["server_tokens"] or 0) - true) <= 2 + 1e-6, (stall, phase_s, lo, r["server_tokens"], true)
        assert any("proxy_lag" in r["server_count"] for r in rows if 2.75 <= r["t_start_mono_s"] <= 3.0), _said(rows)


def test_a_request_given_energy_of_a_proxy_lag_row_says_its_share_may_be_off_either_way():
    """Its note says the count may be low or high, and the fix (a host with CPU to spare), not only that bypass
    traffic's energy may be in its share."""
    kept: list = []
    rows, _ = _streams(300, 0.0, delay_s=0.05, measured_s=0.05, keep=kept)
    assert any("proxy_lag" in r["server_count"] for r in rows)
    notes = [r["energy_note"] or "" for r in kept[0].rows["requests"]]
    said = [n for n in notes if "proxy_lag" in n]
    assert said and all("may be low or high" in n and "CPU to spare" in n for n in said), notes


def test_proxy_workers_heartbeats_give_the_ledger_how_late_their_loops_ran():
    """With proxy.workers > 1 the proxy's loops are the workers': each heartbeat carries how late its timer woke, and
    the daemon gives the ledger the most of its workers' latest (a silent one at least its silence past its beat)."""
    import time

    from powerprof.daemon.workers import _STATS, BEAT_S, LATE, ProxyWorkers, Unframer, frame

    class Rec:
        def __init__(self):
            self.delays = []

        def note_proxy_delay(self, t_ns, delay_s):
            self.delays.append(delay_s)

    rec = Rec()
    workers = ProxyWorkers(2, "http://unused", "127.0.0.1", 0, recorder=rec, proxy_kwargs={}, header_timeout_s=10,
                           idle_timeout_s=10)
    for w in workers.workers:
        w.proc, w.heard_s, w.said_hello = object(), time.monotonic(), True  # both running, just heard
    stats = [0] * len(_STATS)
    stats[LATE] = 50_000  # 50 ms late
    (msg,) = Unframer().feed(frame(("beat", 9, [], tuple(stats))))
    workers._replay(workers.workers[0], msg)
    assert rec.delays == [pytest.approx(0.05)]
    workers.workers[1].heard_s = time.monotonic() - 2.0  # silent 2 s: stopped, its last beat said nothing
    workers._replay(workers.workers[0], msg)
    assert rec.delays[-1] >= 2.0 - BEAT_S
    # A worker restarted 2 s ago, still starting (no hello): it serves nothing, so its silence is no delay.
    workers.workers[1].said_hello = False
    workers._replay(workers.workers[0], msg)
    assert rec.delays[-1] == pytest.approx(0.05)


def _window_rows_off(rows, truth, lo_s: float = 1.5, hi_s: float = 5.5) -> list:
    """The `complete` rows (one a scrape window: `_streams(sample_s=0.1)`) away from the bypass stream's ends whose
    bypass count is off the truth by more than what an unmarked row keeps: a token plus LAG_SHARE of the window's
    server count (docs/daemon.md, "A server restart")."""
    from powerprof.daemon.reconcile import LAG_SHARE, LAG_TOKENS

    off = []
    for r in rows:
        a, b = r["t_start_mono_s"], r["t_start_mono_s"] + r["duration_s"]
        if r["server_count"] == "complete" and lo_s <= a and b <= hi_s:
            got, true = r["server_tokens"] or 0.0, float(((truth > a) & (truth <= b)).sum())
            if abs(got - true) > LAG_TOKENS + LAG_SHARE * (r["proxy_tokens"] + got) + 1e-6:
                off.append((round(a, 3), round(got, 1), true))
    return off


@pytest.mark.parametrize("stall", [(2.93, 3.08), (2.9, 3.1), (2.95, 3.25)])
def test_a_stall_of_100_ms_or_more_placed_back_as_a_held_burst_beside_bypass_traffic_keeps_its_windows_counts(stall):
    """The proxy's loop stands still 150-300 ms beside a steady bypass stream of 100 tokens/s: the stall's tokens come
    in one piece over 100 ms after the one before, placed back as a held burst (`_held_burst`) at the server's pace.
    That pace was the server's whole count, bypass tokens too (400 tokens/s for the stream's 300), and the part after
    the latest scrape got only what the scraped windows left: the burst crowded before that scrape, windows there
    read 0-6 bypass tokens of 10, others up to 24 of 10, rows `complete`. Now the pace is the proxied share (the count
    less the recent windows' bypass pace), and every `complete` window holds what ran there, within its bound."""
    a, b = stall
    bypass = 1.0 + np.arange(500) / 100.0
    for phase_s in (0.0, 0.035, 0.07):
        rows, truth = _streams(300, phase_s, streams=((1.0, 6.0),), bypass=bypass, sample_s=0.1,
                               late=lambda t: b - t if a <= t <= b else 0.0)
        assert _window_rows_off(rows, truth) == [], (stall, phase_s, _said(rows))
        assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=2), _said(rows)


@pytest.mark.parametrize("late", ["fall", "stall"])
def test_the_bypass_tokens_a_falling_lag_hides_in_the_next_windows_are_marked_there(late):
    """The proxy's delay falls (a loaded host's loop catching up: 150 ms to none over a second; or a 90 ms stall, the
    window after it) beside a steady bypass stream of 100 tokens/s: the server's count was that delay's tokens ahead
    of the proxy's, and as it falls the proxy's count catches up, the gap rising by less than the bypass tokens that
    ran. The levels held the lag, so the windows of the fall read 4-5 bypass tokens of 10 each (the stall's next
    window 4 of 10), rows `complete`: only a window whose own lookahead took the lag out said `proxy_lag`. Now a window
    whose count the lag's fall since the window before may have lowered by more than its bound says so."""
    if late == "fall":
        def lateness(t):  # rises over 2-3 s to 150 ms, holds, falls to none over 3.5-4.5 s
            return 0.15 * min(max(t - 2.0, 0.0), 1.0) if t < 3.5 else max(0.0, 0.15 * (4.5 - t))
    else:
        def lateness(t):
            return 3.01 - t if 2.92 <= t <= 3.01 else 0.0
    bypass = 1.0 + np.arange(500) / 100.0
    for phase_s in (0.0, 0.035, 0.07):
        rows, truth = _streams(300, phase_s, streams=((1.0, 6.0),), bypass=bypass, sample_s=0.1, late=lateness)
        assert _window_rows_off(rows, truth) == [], (late, phase_s, _said(rows))
        assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=2), _said(rows)


@pytest.mark.parametrize("bypass_per_s", [0, 100])
def test_a_loop_growing_late_is_marked_at_each_window_it_may_move(bypass_per_s):
    """The proxy's loop grows late over a second (none to 150 ms over 2-3 s, then held), beside a bypass stream or none:
    between two of the daemon's measures (0.25 s apart) the delay at a window's edge is anywhere between them, and the
    mark takes the most and least they allow. Taken as the least over the window's 1 s lookahead, 6 of that second's 10
    windows held 4 bypass tokens where none ran, unmarked; interpolated between the two measures (fewer marks on a
    loaded host's jitter), a window there still held 3 of none, or 14 of 10, unmarked. Every `complete` window holds
    what ran there, within its bound."""
    bypass = 1.0 + np.arange(5 * bypass_per_s) / bypass_per_s if bypass_per_s else ()
    for phase_s in (0.0, 0.035, 0.07):
        rows, truth = _streams(300, phase_s, streams=((1.0, 6.0),), bypass=bypass, sample_s=0.1,
                               late=lambda t: 0.15 * min(max(t - 2.0, 0.0), 1.0))
        assert _window_rows_off(rows, truth) == [], (bypass_per_s, phase_s, _said(rows))


@pytest.mark.parametrize("bypass_per_s", [100, 300])
@pytest.mark.parametrize("change", ["stops", "starts"])
def test_bypass_traffic_that_stops_or_starts_with_a_held_burst_keeps_its_windows_counts_or_says_so(change, bypass_per_s):
    """A 150 ms stall of the proxy's loop placed back as a held burst (`_held_burst`) just as a bypass stream stops, or
    starts. The pace took out the bypass pace of the windows resolved in the last LAG_S: those ending 1-2 s before the
    burst (a window resolves once its 1 s lookahead is scraped), so a stream that stopped just before the stall had its
    pace taken from windows that had none, the burst's share there clamped to 0 (30 of 0 bypass tokens beside 0 of 30
    and 0 of 23), and one that began up to 2 s before it was taken for none (0-5 and 17-20 of 10), rows `complete`: 143
    windows over 252 runs, none marked. Now the pace is that of the windows just before the burst (their own counts,
    resolved or not), and where the server's count over the burst's span still contradicts it (the bypass traffic
    changed with the stall), the windows it spans say `proxy_lag`. Every `complete` window holds what ran there, within
    its bound; a change 0.5 s or more before the stall marks nothing."""
    a = 3.013
    b = a + 0.15
    for offset_s in (-1.5, -0.5, -0.2, -0.1, 0.0, 0.1):  # the bypass stream's change, from the stall's start
        edge = a + offset_s
        if change == "stops":
            bypass = 1.0 + np.arange(int(round((edge - 1.0) * bypass_per_s))) / bypass_per_s
        else:
            bypass = edge + np.arange(int(round((6.0 - edge) * bypass_per_s))) / bypass_per_s
        for phase_s in (0.0, 0.035, 0.07):
            rows, truth = _streams(300, phase_s, streams=((1.0, 6.0),), bypass=bypass, sample_s=0.1,
                                   late=lambda t: b - t if a <= t <= b else 0.0)
            assert _window_rows_off(rows, truth) == [], (change, bypass_per_s, offset_s, phase_s, _said(rows))
            assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=2), _said(rows)
            if offset_s <= -0.5:
                assert not any("proxy_lag" in r["server_count"] for r in rows), (offset_s, phase_s, _said(rows))


def _one_burst_after_a_clump(clump_per_s: float, sample_s: float = 0.25):
    """A ledger fed as the daemon feeds it (scrapes every 0.25 s, GPU samples every `sample_s`): a clump of bypass
    traffic at `clump_per_s` tokens/s over 1-2.1 s, then none; a stream arriving at 2.0 s, queued behind the clump until
    2.5 s, decoding 120 tokens/s to 3.0 s, that reaches the proxy in one burst at its end (a buffering hop). Returns
    (interval rows sorted by start, the truth: every bypass token's instant)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    bypass = 1.0 + np.arange(int(1.1 * clump_per_s)) / clump_per_s
    steps = 2.5 + np.arange(60) / 120.0
    gen = np.concatenate([bypass, steps])
    tr = RequestTrace(1, "POST", "/completion", None, int(2.0 * S), int(2.0 * S), api="llamacpp", stream=True)
    tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
    pieces = [(3.0, 60)]
    prev_t, prev_total = None, 0.0
    for k in range(int(7.0 / 0.005)):
        t = round(k * 0.005, 6)
        if tr.request_id not in led.requests and tr.end_ns is None and t >= 2.0:
            led.on_start(tr)
        _read_pieces_due(led, tr, pieces, t)
        if tr.end_ns is None and t >= 3.002:
            tr.end_ns = tr.end_wall_ns = int(3.0 * S)
            led.on_end(tr)
        if k % round(sample_s / 0.005) == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
        if k % 50 == 0 and t >= 0.5:
            prev_t, prev_total = _scrape(led, t, gen, prev_t, prev_total)
        led.advance(int(t * S), int(t * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"]), bypass


@pytest.mark.parametrize("clump_per_s", [300, 500])
def test_a_burst_whose_span_the_bypass_pace_before_it_leaves_no_room_for_says_so(clump_per_s):
    """A stream held back by a buffering hop arrives as a clump of bypass requests winds down and reaches the proxy in
    one burst. Its tokens are placed at the server's pace less the bypass pace of the windows just before its span (the
    clump's, 300-500 tokens/s); the server counted only the stream's 120 tokens/s there, so that pace left the burst no
    room in any window, and the burst was spread evenly, unmarked: over the clump's tail and its queue (2.0-2.5 s) as
    much as its decode, a window of its decode reading 14 bypass tokens of none (300 tokens/s: one over the clump's
    tail too), rows `complete` (the one burst beside clumps of tests/test_daemon_buffered_bypass.py: 4 intervals, 71 of
    2326 bypass tokens, one 10.8 of none). A span the server's count says no room for contradicts the pace as much as one it says too little room for:
    its windows say `proxy_lag`, or hold what ran there within their bound."""
    rows, truth = _one_burst_after_a_clump(clump_per_s, sample_s=0.25)
    assert _window_rows_off(rows, truth, lo_s=1.5, hi_s=3.5) == [], _said(rows)
    assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=2), _said(rows)


def _held_streams(spans, bypass=(), steps_per_s: float = 30.0):
    """A ledger fed as the daemon feeds it (scrapes and GPU samples every 0.25 s): streams of a continuous-batching
    server, each (arrival s, end s) decoding one token a step at `steps_per_s` from 50 ms after its arrival, each
    reaching the proxy in one burst at its end (a buffering hop), beside `bypass` tokens' instants sent straight to the
    server; the proxy's loop measured 3 ms late (on time). Returns (interval rows sorted by start, the truth: every
    bypass token's instant)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.3)
    led.scraping = True
    feeds, counted = [], []
    for i, (a, b) in enumerate(spans):
        steps = a + 0.05 + np.arange(int((b - a - 0.05) * steps_per_s)) / steps_per_s
        counted.append(steps)
        tr = RequestTrace(i + 1, "POST", "/completion", None, int(a * S), int(a * S), api="llamacpp", stream=True)
        tr.counts = Counts(generated_tokens=None, prompt_tokens=20, model=None, stop_reason=None, token_source="usage")
        feeds.append((tr, [(b, len(steps))]))
    bypass = np.asarray(bypass, dtype=float)
    gen = np.concatenate(counted + [bypass])
    t_end = max(b for _, b in spans) + 4.0
    prev_t, prev_total = None, 0.0
    for k in range(int(t_end / 0.005)):
        t = round(k * 0.005, 6)
        _streams_at(led, feeds, t, 0.002)
        if k % 50 == 0:
            led.add_gpu_sample(int(t * S), int(t * S), [_R(100.0 * t)])
            led.note_proxy_delay(int(t * S), 0.003)  # the proxy's loop on time, as the daemon's tick measures it
            if t >= 0.5:
                prev_t, prev_total = _scrape(led, t, gen, prev_t, prev_total)
        led.advance(int(t * S), int(t * S))
    led.close_all(int(t * S))
    return sorted(sink.rows["intervals"], key=lambda r: r["t_start_mono_s"]), bypass


# Overlapping held streams: each one ending while others are still held, as 40 streams at 4/s behind a buffering hop.
HELD_SPANS = ((1.0, 3.0), (1.3, 2.2), (1.6, 2.6), (2.0, 3.4), (2.4, 3.0), (2.7, 3.9))


def test_held_streams_with_no_bypass_traffic_keep_their_windows_unmarked():
    """Streams held back to their end by a buffering hop, overlapping, no bypass traffic at all. A burst's placing took
    out the bypass pace of the windows just before its span, each the server's count less the proxy's tokens there,
    and those held the tokens of the streams still held (counted by the server, not yet seen by the proxy): a bypass
    pace where none ran, the burst's span said to hold fewer tokens than it did, and its windows said `proxy_lag`
    (tests/test_daemon_buffered_bypass.py's run with no bypass: 40 of 40 rows marked, their figures left out). Now
    the windows hold no bypass tokens and say `complete`."""
    rows, truth = _held_streams(HELD_SPANS)
    assert not any("proxy_lag" in r["server_count"] for r in rows), _said(rows)
    assert _window_rows_off(rows, truth, lo_s=0.5, hi_s=6.0) == [], _said(rows)
    # At most a token a stream where none ran: its 50 ms of queue and prefill placed as decode (measured 2.8 tokens
    # beside 201 generated).
    assert sum(r["server_tokens"] or 0 for r in rows) <= len(HELD_SPANS), _said(rows)


@pytest.mark.parametrize("bypass", ["steady", "stops", "starts", "clumps"])
def test_held_streams_beside_bypass_traffic_keep_their_windows_counts_or_say_so(bypass):
    """The same held streams beside bypass traffic (100 tokens/s throughout, or stopping or starting at 2.2 s, inside
    the held spans; or clumps of 30 tokens every 0.6 s): a burst's bypass pace now leaves out the windows other held
    streams may hold tokens of, and a span whose count says fewer tokens than the burst holds is no longer marked where
    no bypass pace was taken out. Every `complete` window still holds what ran there, within its bound (measured: none
    off; steady 0 rows `proxy_lag`, 7 before; the others 12, as before)."""
    truth = {"steady": 0.5 + np.arange(450) / 100.0, "stops": 0.5 + np.arange(170) / 100.0,
             "starts": 2.2 + np.arange(280) / 100.0,
             "clumps": np.sort(np.repeat(np.arange(1.2, 4.0, 0.6), 30) + np.tile(np.arange(30) / 200.0, 5))}[bypass]
    rows, truth = _held_streams(HELD_SPANS, bypass=truth)
    assert _window_rows_off(rows, truth, lo_s=0.5, hi_s=6.0) == [], _said(rows)
    assert sum(r["server_tokens"] or 0 for r in rows) == pytest.approx(len(truth), abs=len(HELD_SPANS)), _said(rows)


def test_a_request_alone_beside_bypass_traffic_split_by_the_fixed_ratio_says_so():
    # Bypass tokens are costed beside a proxied request by the same ratio: alone among proxied requests in its intervals,
    # its share there still rests on it while the fit is not mature (before, only proxied neighbours counted). The
    # second stream, with no bypass traffic and no neighbour, takes its intervals' work whatever the ratio: no note.
    kept: list = []
    _streams(100, 0.0, bypass=np.arange(2.0, 3.0, 0.01), keep=kept)
    notes = {r["request_id"]: r["energy_note"] or "" for r in kept[0].rows["requests"]}
    assert "or bypass traffic did), split among them by the fixed ratio" in notes[1], notes[1]
    assert "fixed ratio" not in notes[2], notes[2]
