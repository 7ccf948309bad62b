"""The daemon's attribution where the stream does not reach the proxy as the server sent it: a buffering proxy or
gateway between the server and the daemon's proxy (nginx `proxy_buffering on`, a compressing middleware) that holds a
streamed answer back and delivers it in one burst at its end. Against the simulator's truth (`delivery="buffered"`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from _attribution import mixed_trace, run_mixed, score_mixed  # noqa: E402
from support import side_by_side  # noqa: E402
from powerprof.daemon.config import load_config  # noqa: E402
from powerprof.daemon.inflight import InFlight  # noqa: E402
from powerprof.daemon.ledger import Ledger  # noqa: E402
from powerprof.daemon.metrics import TagLimiter  # noqa: E402
from powerprof.daemon.proxy import RequestTrace  # noqa: E402
from powerprof.daemon.service import Daemon  # noqa: E402

S = 1_000_000_000


def _stream(d, rid: int, arrival_ns: int, token_ns: list[int]) -> RequestTrace:
    """A streamed chat request through the daemon's recorder: one token at each of `token_ns`, then its end."""
    return _pieces(d, rid, arrival_ns, [(t, 1) for t in token_ns])


def test_a_stream_delivered_in_one_burst_gives_no_time_per_output_token():
    # Its tokens passed the proxy microseconds apart: (last - first) / (tokens - 1) is the burst's, not the server's
    # decode (the tuner's guard reads this histogram's p95: a buffered stream's ~0 s said any power cap was free).
    # Before: 100 tokens within 1 ms gave a TPOT of 10 µs. Its TTFT (arrival -> first token at the proxy, the
    # client's wait) stays.
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight, d.tags = InFlight(0), TagLimiter()
    d.ledger = Ledger("t", 0, 1, lambda *a: None)
    _stream(d, 1, 1 * S, [3 * S + k * 10_000 for k in range(100)])
    st = d.latency.states()
    assert st["tpot_seconds"].n == 0 and st["ttft_seconds"].n == 1
    _stream(d, 2, 4 * S, [4 * S + 50_000_000 + k * 20_000_000 for k in range(100)])  # streamed: 20 ms a token
    st = d.latency.states()
    assert st["tpot_seconds"].n == 1 and st["tpot_seconds"].total == pytest.approx(0.02)


def _pieces(d, rid: int, arrival_ns: int, pieces: list[tuple[int, int]], sequences: int = 1,
            counts=None) -> RequestTrace:
    """A streamed chat request whose tokens come in `pieces` (instant, tokens), then its end (with the server's
    `counts`, where given); `sequences` generated side by side (`n` choices)."""
    tr = RequestTrace(request_id=rid, method="POST", endpoint="/v1/chat/completions", tag=None, arrival_ns=arrival_ns,
                      arrival_wall_ns=arrival_ns, api="openai-chat", stream=True)
    if sequences > 1:
        tr.extra["sequences"] = sequences
    d.on_start(tr)
    for t, n in pieces:
        if tr.first_ns is None:
            tr.first_ns = tr.first_wall_ns = t
        tr.last_ns = tr.last_wall_ns = t
        tr.tokens_seen += n
        d.on_tokens(tr, t, n)
    tr.counts = counts if counts is not None else tr.counts
    tr.end_ns = tr.end_wall_ns = pieces[-1][0] + 1000
    d.on_end(tr)
    return tr


def test_a_slow_stream_whose_reads_merge_two_tokens_keeps_its_time_per_output_token():
    # An overloaded server: a step every 150 ms, its chunks read two at a time every 300 ms. Each piece of 2 tokens
    # 300 ms after the one before reads as a burst held back on its way (`_held_burst`), placed as such (its energy
    # right either way); its TPOT was dropped as a burst's, and the tuner's TPOT guard went blind exactly where TPOT
    # was bad (a new user's overloaded replay: 30 of 640 requests had a TPOT, at 15 ms, where the client saw 312 ms).
    # The pace after its first piece is the server's: (last - first) / (tokens after the first piece).
    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight, d.tags = InFlight(0), TagLimiter()
    d.ledger = Ledger("t", 0, 1, lambda *a: None)
    tr = _pieces(d, 1, 1 * S, [(int(1.5 * S) + k * 300_000_000, 2) for k in range(20)])
    assert d.ledger.requests[tr.request_id].bursts == 19  # every piece after the first taken for a held burst
    st = d.latency.states()
    assert st["tpot_seconds"].n == 1 and st["tpot_seconds"].total == pytest.approx(0.15, rel=0.01)
    # Where the pieces cannot tell the server's pace, no TPOT (as for one burst): a 4 kB hop's bursts (its first piece
    # held itself, 50 tokens; then 125 a piece), and one held body read in two parts 150 ms apart (it gave 0.75 ms for
    # the server's 20: the read's delay over the body's rest), or a held first piece with its tail ms apart (0.15 ms).
    for rid, pieces in ((2, [(11 * S + k * 2_500_000_000, 50 if k == 0 else 125) for k in range(5)]),
                        (3, [(19 * S, 200), (19 * S + 150_000_000, 200)]),
                        (4, [(29 * S, 300), (29 * S + 5_000_000, 1), (29 * S + 10_000_000, 1), (29 * S + 15_000_000, 98)])):
        _pieces(d, rid, (rid * 10 - 2) * S, pieces)
        assert d.latency.states()["tpot_seconds"].n == 1, rid


def test_a_time_per_output_token_is_per_sequence_and_in_the_servers_count():
    from powerprof.daemon import streams

    d = Daemon(load_config(None, env={}), rig=None)
    d.inflight, d.tags = InFlight(0), TagLimiter()
    d.ledger = Ledger("t", 0, 1, lambda *a: None)
    # n = 4 choices, a step every 20 ms giving each one token: 4 tokens a piece. Divided by every sequence's tokens,
    # the TPOT read 4.9 ms.
    _pieces(d, 1, 1 * S, [(2 * S + k * 20_000_000, 4) for k in range(50)], sequences=4)
    st = d.latency.states()["tpot_seconds"]
    assert st.n == 1 and st.total == pytest.approx(0.02, rel=0.03), st.total
    first = st.total
    # Counted one token a chunk, the server's usage 8 tokens a chunk (speculative decoding), an overloaded server's
    # reads two chunks every 320 ms (20 ms a token): the first piece is scaled to the server's count with the rest.
    _pieces(d, 2, 10 * S, [(11 * S + k * 320_000_000, 2) for k in range(30)],
            counts=streams.Counts(480, 10, None, "stop", "usage", tokens_estimated=True))
    st = d.latency.states()["tpot_seconds"]
    assert st.n == 2 and st.total - first == pytest.approx(29 * 0.32 / (480 - 16), rel=0.001), st.total  # 0.020 s


def _chat_and_messages():
    """Chat and messages streams, 40 requests at 4/s."""
    return mixed_trace(40, 4.0, seed=7, kinds=("chat", "messages"), weights=(0.5, 0.5))


# The several-bursts hops (a test's parameter), by scene name.
HOPS = {"hop-4kB": {"burst_bytes": 4096}, "hop-timer": {"burst_bytes": None, "burst_every_s": 0.5}}


@pytest.fixture(scope="module")
def scenes(request, tmp_path_factory):
    """The module's single-proxy scenes, two at a time, each its own simulated vLLM (or llama.cpp) and daemon in a
    process of its own (tests/support.py side_by_side): each took ~23-26 s alone, mostly real time slept through.
    Each test reads its own scene's Outcome. The two proxy-worker scenes (three processes each) stay in the pytest
    process, one at a time, after the pool's scenes are all read: beside seven other scenes (three of this pool and
    test_daemon_chat_shapes' three) their buffered case put 2.7% of the requests' energy in unproxied against 1.5%."""
    mk = tmp_path_factory.mktemp
    jobs = {
        # Chat (an OpenAI stream: its scrape windows wait while its prompt is unsaid) and messages (Anthropic's: they
        # did not), 40 requests at 4/s on the simulated vLLM, every answer held back whole and sent at its end.
        "buffered": (run_mixed, (_chat_and_messages(),),
                     dict(data_dir=mk("buffered"), flavour="vllm", server={"delivery": "buffered"})),
        # The same held-back chat streams on the simulated llama.cpp: each answer's `timings` say where its decode
        # ran, so its span is right; what is left to get right is how its tokens are placed inside that span.
        "buffered_llamacpp": (run_mixed, (mixed_trace(40, 4.0, seed=7, kinds=("chat",), weights=(1.0,)),),
                              dict(data_dir=mk("buffered-llamacpp"), flavour="llamacpp",
                                   server={"delivery": "buffered"})),
        **{name: (run_mixed, (_chat_and_messages(),),
                  dict(data_dir=mk(name), flavour="vllm", server={"delivery": "bursts", **hop}))
           for name, hop in HOPS.items()},
    }
    return side_by_side(request, jobs, max_processes=2)


@pytest.fixture(scope="module")
def buffered(scenes):
    o = scenes["buffered"].result()
    return o, score_mixed(o)


@pytest.mark.slow
def test_a_stream_delivered_in_one_burst_is_spread_over_its_run_and_says_so(buffered):
    # Before: every token placed where the burst passed the proxy, at the end; the server's counter ran ahead of the
    # proxy's all that while and its tokens went to `unproxied` as bypass traffic (there was none), and the rows said
    # nothing: requests -38% of their true energy (chat -26%, messages -52%), unproxied 22% of it. Spread evenly: -6%
    # (chat -3%, messages -9%), unproxied 6% (the server's counter rose beyond the proxy's where the spread placed too
    # few tokens, and those rises passed for bypass). At the server's pace (`_at_server_pace`): -1 to +0.5% (each kind
    # within 2%), unproxied 0.3-0.8%.
    o, s = buffered
    assert abs(s["conservation_err"]) <= 0.001
    assert s["requests_est_j"] == pytest.approx(s["requests_true_j"], rel=0.04), s
    # Unproxied energy (there is no bypass traffic): 9.5-16 J of 1890 J at a load of 4-5, of which 0-3.8 J in intervals
    # that say `complete`, the rest `proxy_lag` or `counter_below` (the proxy behind the server's counter); a suite on
    # 2 cores once put 59 J there in all. What no interval says stays under 1%; the whole, said or not, under 5%.
    iv = o.intervals
    silent_j = iv.loc[iv["server_count"] == "complete", "unproxied_energy_j"].sum()
    assert silent_j < 0.01 * s["requests_true_j"], (silent_j, s)
    assert s["unproxied_j"] < 0.05 * s["requests_true_j"], s
    for kind in ("chat", "messages"):
        m = s["kinds_all"][kind]
        # 16 runs two side by side: chat -0.0 to +2.0%, messages -0.4 to -4.5%; a full suite on 2 cores once -6.3%.
        # Spread evenly (not at the server's pace) messages read -9%; placed at the burst, -52%.
        assert m["n"] >= 10 and m["no_share"] == 0 and abs(m["sum_err"]) < 0.08, (kind, m)
    notes = o.requests["energy_note"]
    assert notes.notna().all() and notes.str.contains("one burst").all(), notes.value_counts().head()
    assert notes.str.contains("proxy_buffering").all()
    print({k: round(s["kinds_all"][k]["sum_err"], 3) for k in s["kinds_all"]}, s["requests_est_j"] / s["requests_true_j"] - 1,
          s["unproxied_j"] / s["requests_true_j"])


@pytest.fixture(scope="module")
def buffered_llamacpp(scenes):
    o = scenes["buffered_llamacpp"].result()
    return o, score_mixed(o)


@pytest.mark.slow
def test_a_burst_is_spread_at_the_servers_pace_not_evenly(buffered_llamacpp):
    # A continuous-batching server gives each sequence one token a step, and its steps slow as its batch grows: a long
    # answer decoded alone, then beside 30 others, then alone again got most of its tokens in the lone stretches. Spread
    # evenly over its decode, too few were placed there and too many in the crowded middle; the server's counter rose
    # beyond the proxy's in the lone stretches and those rises were taken for bypass traffic (there was none).
    # Before: 52-63 tokens to unproxied, 4.2-6.5% of the requests' true energy; the requests -4 to -6%.
    o, s = buffered_llamacpp
    assert abs(s["conservation_err"]) <= 0.001
    # Quiet and beside two CPU hogs 0.3-0.6%; a full suite beside two hogs once 1.9%: the proxy's own lag, within
    # the bound an unmarked window keeps (1 token and 5% of its count: docs/daemon.md). Before the fix 4.2-6.5%, in
    # intervals that said `complete`. A suite beside four more test runs (load ~10) once put 3.5% there, the
    # requests -4.4%: a proxy that far behind the server, in windows that say `proxy_lag` (rows all say `approximate:`
    # already). So: what no interval says stays under 3%; the whole, said or not, under 5%.
    iv = o.intervals
    silent_j = iv.loc[iv["server_count"] == "complete", "unproxied_energy_j"].sum()
    assert silent_j < 0.03 * s["requests_true_j"], (silent_j, s)
    assert s["unproxied_j"] < 0.05 * s["requests_true_j"], s
    assert s["requests_est_j"] == pytest.approx(s["requests_true_j"], rel=0.05), s
    assert o.requests["energy_note"].str.contains("one burst").all()
    print(s["requests_est_j"] / s["requests_true_j"] - 1, s["unproxied_j"] / s["requests_true_j"])


@pytest.mark.slow
@pytest.mark.parametrize("scene", list(HOPS), ids=["full-4kB", "timer-0.5s"])
def test_a_stream_delivered_in_several_bursts_is_placed_back_and_says_so(scenes, scene):
    # A hop that passes its buffer on when it fills (nginx's 4 kB) or on a timer: several bursts a stream. Before: the
    # proxy took the whole stream for one burst (each gap came after a piece of many tokens) and spread it evenly
    # from arrival, its row saying "one burst" or nothing (1 and 5 rows of 40); the bursts' tokens were generated
    # before each arrived, the server's count ran ahead and passed for bypass: requests -8.5% / -11.7% of their true
    # energy, unproxied 9.3% / 12.7% of it (messages -9% / -18%); at the server's pace alone -3.8% / -1.6%, 4.6% /
    # 2.0%. After: each burst spread over the time before it at the server's pace, the windows held meanwhile:
    # -0.1% / -0.2%, unproxied 0.5% / 0.4%, and every row says it.
    o = scenes[scene].result()  # _chat_and_messages() through the hop HOPS[scene] on the simulated vLLM
    s = score_mixed(o)
    assert abs(s["conservation_err"]) <= 0.001
    assert s["requests_est_j"] == pytest.approx(s["requests_true_j"], rel=0.03), s
    # 0.4-0.6% as a rule; a full suite on 2 cores once 1.52% (4 kB). Under 2% still tells the fixes apart (at the
    # server's pace alone 4.6% / 2.0%, before 9.3% / 12.7%).
    assert s["unproxied_j"] < 0.02 * s["requests_true_j"], s
    for kind in ("chat", "messages"):
        m = s["kinds_all"][kind]
        assert m["n"] >= 10 and m["no_share"] == 0 and abs(m["sum_err"]) < 0.05, (kind, m)
    notes = o.requests["energy_note"].fillna("")
    assert notes.str.contains("approximate:").all() and notes.str.contains(r"in (?:one burst|\d+ bursts)", regex=True).all(), notes.value_counts()
    assert notes.str.contains("proxy_buffering").all()


@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["buffered", "bursts"])
def test_held_back_streams_through_two_proxy_workers_are_found_placed_and_said(tmp_path, delivery):
    # proxy.workers = 2 (SO_REUSEPORT processes shipping records, tokens coalesced over 20 ms, the daemon replaying
    # them into its one ledger): the deliveries count crosses the link with the end, the bursts as coalesced records.
    # Measured first time: the same figures as in-process (buffered -0.3%, unproxied 0.4%; 4 kB bursts +0.1%, 0.4%).
    o = run_mixed(mixed_trace(40, 4.0, seed=7, kinds=("chat", "messages"), weights=(0.5, 0.5)), data_dir=tmp_path,
                  flavour="vllm", server={"delivery": delivery}, config={"proxy.workers": 2})
    s = score_mixed(o)
    assert "proxy workers: 2" in o.notes, o.notes
    assert abs(s["conservation_err"]) <= 0.001
    assert s["requests_est_j"] == pytest.approx(s["requests_true_j"], rel=0.03), s
    # Unproxied energy (there is no bypass traffic): what no interval says (`complete`) under 1%, as in-process above.
    # Beside two CPU hogs (load 10-12 on 2 cores), buffered, 12 runs: 0-41.7 J of ~1890 J in all (2.2%; CI twice 37-38
    # J, over the 1.5% this bound was), 0-9.2 J (0.5%) of it `complete`, the rest in intervals saying `proxy_lag` or
    # `counter_below` (left out of J/token, the rows `bypass-uncounted`); in-process beside the same hogs 0-11.4 J, none
    # `complete`. Not the record link: the scrape windows waited for every burst's end record (resolved after it). It
    # follows how late the proxy read each burst after the server sent it (one run in-process read them 9 ms late at
    # the median, 22 at p90: 11.4 J; one with two workers 0.7 and 4.8 ms: 0 J), more often with two workers (10 of 12
    # runs over 10 J, in-process 1 of 6: more processes on the loaded host). So, said or not, under 5% as in-process;
    # the 4 kB bursts (4 runs: 0-15.8 J, 0.8%) under 1.5% still.
    iv = o.intervals
    silent_j = iv.loc[iv["server_count"] == "complete", "unproxied_energy_j"].sum()
    assert silent_j < 0.01 * s["requests_true_j"], (silent_j, s)
    assert s["unproxied_j"] < (0.05 if delivery == "buffered" else 0.015) * s["requests_true_j"], s
    notes = o.requests["energy_note"].fillna("")
    assert len(notes) == 40 and notes.str.contains(r"in (?:one burst|\d+ bursts)", regex=True).all(), notes.value_counts()
    assert notes.str.contains("proxy_buffering").all()
