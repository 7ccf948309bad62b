"""The ledger's prefix-cache bookkeeping driven directly: a cached count said early in a stream (with its prompt
length) places the prefill at the part computed; one said only at the end, after its prefill's intervals closed,
marks the request; each request's known hits are counted once against the server's counter; and what is kept for
that check stays bounded."""

from __future__ import annotations

import json

import pytest

from powerprof.daemon.ledger import CACHE_KEEP_S, Ledger
from powerprof.daemon.proxy import RequestTrace
from powerprof.daemon.streams import Counts
from powerprof.workload.stream import StreamParser

from support import LedgerReading as _R, RowSink as _Sink  # noqa: E402

S = 1_000_000_000
UNSAID = "prefix-cache-unsaid"  # storage/schema.py CACHE_UNSAID_FLAG
LATE = "prefix-cache-late"  # storage/schema.py CACHE_LATE_FLAG


def _feed(led, t_s, energy_j):
    led.add_gpu_sample(int(t_s * S), int(t_s * S), [_R(energy_j, 200.0)])


def _llama(rid, arrival_s):
    return RequestTrace(rid, "POST", "/completion", "t", int(arrival_s * S), 0, api="llamacpp", stream=True)


def _early_prompt_run(cached_early: bool):
    """A: a 1000-token prompt, 900 of it cached, streaming 9 s; B: a 100-token prompt, done in 1 s. Both prompts are
    said on the first event (continuous usage, SGLang /generate); the fixed-ratio model costs a prompt token at
    0.05 of a decoded one over the same 1 s, so the truth is A 900 J, B 100 J (the simulator's own split)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = _llama(1, 0.1), _llama(2, 0.2)
    for tr in (a, b):
        led.on_start(tr)
    a.extra["prompt_tokens"], b.extra["prompt_tokens"] = 1000, 100
    if cached_early:
        a.extra["cached_tokens"], b.extra["cached_tokens"] = 900, 0
    _feed(led, 0.0, 0.0)
    a.first_ns = b.first_ns = int(1.0 * S)
    e = 0.0
    for sec in range(1, 12):
        for k in range(10):
            t = int((sec + 0.09 * k) * S)
            if sec < 10:
                led.on_tokens(a, t, 1)
                a.last_ns = t
            if sec < 2:
                led.on_tokens(b, t, 1)
                b.last_ns = t
        if sec == 2:
            b.end_ns = int(1.95 * S)
            b.counts = Counts(generated_tokens=10, prompt_tokens=100, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=0)
            led.on_end(b)
        if sec == 10:
            a.end_ns = int(9.95 * S)
            a.counts = Counts(generated_tokens=90, prompt_tokens=1000, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=900)
            led.on_end(a)
        e += 100.0
        _feed(led, float(sec), e)
        led.advance(int((sec + 0.5) * S))
    led.close_all(int(12 * S))
    return sink.rows["intervals"], {r["request_id"]: r for r in sink.rows["requests"]}, led


def test_a_cached_count_said_early_costs_the_prefill_at_the_part_computed():
    # Before: the early prompt released the prefill at 1000 tokens, the end's 900 cached came after its interval
    # closed: the first interval's prefill_tokens 1100 (truth 200), B 59.1 J (truth 100, -41%), A 940.9 (900).
    ivs, rq, led = _early_prompt_run(cached_early=True)
    assert ivs[0]["prefill_tokens"] == 200
    assert abs(rq[2]["gpu_energy_j"] - 100.0) < 1.0 and abs(rq[1]["gpu_energy_j"] - 900.0) < 1.0
    assert not (rq[1]["energy_note"] or "").count(LATE) and not (rq[2]["energy_note"] or "").count(LATE)
    assert led.totals.flagged_requests[LATE] == 0


def test_a_cached_count_said_only_after_its_prefill_closed_marks_the_request():
    # Before: A's row said cached_prompt_tokens=900 and nothing else, its prefill charged at the whole prompt.
    _ivs, rq, _led = _early_prompt_run(cached_early=False)
    note = rq[1]["energy_note"] or ""
    assert note.startswith("approximate:") and LATE in note and "900" in note and "fix:" in note
    assert rq[1]["cached_prompt_tokens"] == 900


def test_the_request_beside_a_late_cached_count_is_marked_and_counted():
    # B ran beside A's prefill in the interval that closed with A's prompt costed whole (1100 prefill tokens, truth
    # 200): it was given 59.1 J (truth 100 J, -41%). Before, its row said nothing (it ended at 1.95 s, its row
    # written long before A's end said the 900 cached at 9.95 s) and /metrics counted no late row.
    _ivs, rq, led = _early_prompt_run(cached_early=False)
    b = rq[2]
    assert b["gpu_energy_j"] < 0.7 * 100.0  # still under-charged (not corrected): said, not silent
    note = b["energy_note"] or ""
    assert note.startswith("approximate:") and LATE in note and "900" in note and "fix:" in note, note
    assert "low" in note
    assert led.totals.flagged_requests[LATE] == 2  # A's row and B's


def _edge_run(cached_early: bool):
    """C1 and C2 (100-token prompts, counts said early) end at 1.005 s, just past the edge at 1 s: C1's last token at
    0.998 s, C2's at 1.002 s. A arrives at 1.1 s, its 1000-token prompt said early, its 900 cached said at its end
    (3.05 s, after the interval with its prefill, 1-2 s, closed) unless `cached_early`. Rows by request id."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    c1, c2, a = _llama(1, 0.05), _llama(2, 0.05), _llama(3, 1.1)
    _feed(led, 0.0, 0.0)
    for c, last_s in ((c1, 0.998), (c2, 1.002)):
        led.on_start(c)
        c.extra["prompt_tokens"], c.extra["cached_tokens"] = 100, 0
        c.first_ns = int(0.3 * S)
        for t in [0.3 + 0.1 * k for k in range(7)] + [last_s]:
            led.on_tokens(c, int(t * S), 1)
            c.last_ns = int(t * S)
        c.end_ns = int(1.005 * S)
        c.counts = Counts(generated_tokens=8, prompt_tokens=100, model=None, stop_reason=None, token_source="usage",
                          cached_tokens=0)
        led.on_end(c)
    e = 0.0
    for sec in range(1, 5):
        if sec == 1:
            led.on_start(a)
            a.extra["prompt_tokens"] = 1000
            if cached_early:
                a.extra["cached_tokens"] = 900
            a.first_ns = int(1.9 * S)
            for t in [1.9 + 0.1 * k for k in range(11)]:
                led.on_tokens(a, int(t * S), 1)
                a.last_ns = int(t * S)
        if sec == 3:
            a.end_ns = int(3.05 * S)
            a.counts = Counts(generated_tokens=11, prompt_tokens=1000, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=900)
            led.on_end(a)
        e += 100.0
        _feed(led, float(sec), e)
        led.advance(int((sec + 0.5) * S))
    led.close_all(int(6 * S))
    return {r["request_id"]: r for r in sink.rows["requests"]}


def test_only_the_requests_that_took_energy_beside_a_late_count_are_marked():
    # The flake (tests/test_daemon_prefix_cache.py, 1 quiet CI run): a chat whose span ([arrival, end]) reached 1 ms
    # into an interval with a late turn's prefill read as beside it, and its row said no prefix-cache-late. Its last
    # token came before that interval: it did no work there, took none of its energy, and its figure is the one an
    # early count gives. Marked is every request whose figure the late count changed (C2, its last token 2 ms into
    # it), and only those: C1's note would be a false warning.
    late, early = _edge_run(cached_early=False), _edge_run(cached_early=True)
    assert LATE in (late[3]["energy_note"] or "")  # the set-up: A's own count said late
    c1, c2 = late[1], late[2]
    assert abs(c1["gpu_energy_j"] - early[1]["gpu_energy_j"]) < 1e-6, (c1["gpu_energy_j"], early[1]["gpu_energy_j"])
    assert LATE not in (c1["energy_note"] or ""), c1["energy_note"]
    assert c2["gpu_energy_j"] < early[2]["gpu_energy_j"] - 1.0  # under-charged beside A's prefill costed whole...
    note = c2["energy_note"] or ""
    assert LATE in note and "900" in note and "fix:" in note, note  # ...and said


def test_a_long_stream_beside_a_late_count_says_it_after_thousands_more_went_by():
    # A (1000-token prompt said early, 900 cached said only at its end, 1.95 s) beside B's start; B streams on while
    # 4500 short requests go by, each saying 10 cached tokens late (its prefill's interval closed before its end). The
    # late counts were kept in a table of the latest 4096, read at B's row: A's had left it and B's note named 10
    # tokens, not A's 900 (and B kept the id of every request it was ever beside, growing with its life). Told to B
    # as A settles.
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    a, b = _llama(1, 0.1), _llama(2, 0.2)
    for tr in (a, b):
        led.on_start(tr)
    a.extra["prompt_tokens"], b.extra["prompt_tokens"], b.extra["cached_tokens"] = 1000, 100, 0
    _feed(led, 0.0, 0.0)
    a.first_ns = b.first_ns = int(1.0 * S)
    per_s, n_short, rid, e = 100, 4500, 3, 0.0
    batches: dict[int, list] = {}
    last_s = 3 + n_short // per_s + 3
    for sec in range(1, last_s + 1):
        for k in range(10):
            t = int((sec + 0.09 * k) * S)
            led.on_tokens(b, t, 1)
            b.last_ns = t
            if sec < 2:
                led.on_tokens(a, t, 1)
                a.last_ns = t
        if sec == 2:
            a.end_ns = int(1.95 * S)
            a.counts = Counts(generated_tokens=10, prompt_tokens=1000, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=900)
            led.on_end(a)
        for q in batches.pop(sec - 2, []):  # ended after their prefill's interval closed: their count comes late
            q.end_ns = q.last_ns + int(2.0 * S)
            q.counts = Counts(generated_tokens=1, prompt_tokens=100, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=10)
            led.on_end(q)
        if 3 <= sec < 3 + n_short // per_s:
            for k in range(per_s):
                q = _llama(rid, sec + k / per_s)
                rid += 1
                led.on_start(q)
                q.extra["prompt_tokens"] = 100  # said early (continuous usage), its cached count not
                q.first_ns = q.last_ns = int((sec + k / per_s + 0.004) * S)
                led.on_tokens(q, q.first_ns, 1)
                batches.setdefault(sec, []).append(q)
        if sec == last_s:
            b.end_ns = int((sec + 0.95) * S)
            b.counts = Counts(generated_tokens=10 * last_s, prompt_tokens=100, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=0)
            led.on_end(b)
        e += 100.0
        _feed(led, float(sec), e)
        led.advance(int((sec + 0.5) * S))
    led.close_all(int((last_s + 3) * S))
    rq = {r["request_id"]: r for r in sink.rows["requests"]}
    assert len(rq) == n_short + 2
    assert sum(LATE in (r["energy_note"] or "") for r in rq.values()) > 4096  # the set-up: that many late counts
    note = rq[2]["energy_note"] or ""
    assert LATE in note and "that 900 of its prompt tokens" in note, note


def test_parsers_say_the_cached_count_as_early_as_the_prompt():
    # SGLang /generate repeats meta_info.cached_tokens on every event (read from its bytes too: the quick path).
    p = StreamParser("sglang-generate", count_only=True)
    ids = []
    for k in range(3):
        ids.append(k)
        ev = {"text": "x" * (k + 1), "output_ids": ids[:], "meta_info": {
            "id": "a", "prompt_tokens": 1000, "completion_tokens": k + 1, "cached_tokens": 900,
            "finish_reason": None}, "index": 0}
        p.count(b"data: " + json.dumps(ev).encode() + b"\n\n")
        assert (p.prompt_tokens, p.cached_tokens) == (1000, 900)
    # OpenAI continuous usage with prompt details (vLLM --enable-prompt-tokens-details).
    p = StreamParser("openai-chat", count_only=True)
    for k in range(2):
        ev = {"id": "x", "object": "chat.completion.chunk",
              "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
              "usage": {"prompt_tokens": 1000, "completion_tokens": k + 1, "total_tokens": 1001 + k,
                        "prompt_tokens_details": {"cached_tokens": 900}}}
        p.count(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
        assert (p.prompt_tokens, p.cached_tokens) == (1000, 900)
    # Without details: the prompt early, no cached count (None, never 0).
    p = StreamParser("openai-chat", count_only=True)
    ev = {"id": "x", "object": "chat.completion.chunk",
          "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
          "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}}
    p.count(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
    assert (p.prompt_tokens, p.cached_tokens) == (1000, None)


def test_hits_kept_for_the_check_stay_bounded_where_the_server_has_no_counter():
    # llama.cpp says cache_n on every answer and has no prefix-cache counter (add_cache_hits gets None): before,
    # every request's known hits were kept for ever (3000 over 600 s, growing with the traffic).
    led = Ledger("d", 0, 1, _Sink(), grace_s=0.1)
    led.scraping = True
    _feed(led, 0.0, 0.0)
    e, rid = 0.0, 0
    for sec in range(1, 601):
        for k in range(5):
            rid += 1
            tr = _llama(rid, sec - 1 + 0.1 * k)
            led.on_start(tr)
            tr.first_ns = tr.last_ns = tr.end_ns = int((sec - 1 + 0.1 * k + 0.05) * S)
            led.on_tokens(tr, tr.first_ns, 1)
            tr.counts = Counts(generated_tokens=1, prompt_tokens=500, model=None, stop_reason=None,
                               token_source="timings", cached_tokens=400)
            led.on_end(tr)
        led.add_server_tokens(int(sec * S), 5.0, int((sec - 1) * S))
        led.add_cache_hits(int((sec - 1) * S), int(sec * S), None)
        e += 100.0
        _feed(led, float(sec), e)
        led.advance(int((sec + 0.5) * S))
    kept = led._cache_known
    assert kept and (kept[-1][1] - kept[0][0]) / S <= CACHE_KEEP_S + 2.0
    assert len(kept) <= 5 * (CACHE_KEEP_S + 2.0)


def _vllm(rid, arrival_s):
    return RequestTrace(rid, "POST", "/v1/completions", "t", int(arrival_s * S), 0, api="openai-completions",
                        stream=True)


def _straddle_run(with_a: bool):
    """vLLM without --enable-prompt-tokens-details. A (n=2: its 2nd choice finds the prompt cached, 999 hits the
    daemon knows) is scheduled at once, counted in the first scrape window, and gives its first token 2.8 s later;
    B reuses 800 cached tokens it never says, counted in the third window, which A's arrival → first-token span
    also overlaps."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    _feed(led, 0.0, 0.0)
    a, b = _vllm(1, 0.1), _vllm(2, 2.2)
    a.extra.update(choices=2, sequences=2)
    reqs = [(a, 2.9, 3.5), (b, 2.4, 3.4)] if with_a else [(b, 2.4, 3.4)]
    for q, *_ in reqs:
        led.on_start(q)
    e = 0.0
    for sec in range(1, 7):
        for q, f, end in reqs:
            for k in range(10):
                t = int((sec - 1 + 0.1 * k) * S)
                if int(f * S) <= t < int(end * S):
                    q.first_ns = q.first_ns or t
                    q.last_ns = t
                    q.tokens_seen += 1
                    led.on_tokens(q, t, 1)
            if q.end_ns is None and end <= sec:
                q.end_ns = int(end * S)
                q.counts = Counts(generated_tokens=q.tokens_seen, prompt_tokens=1000, model=None, stop_reason=None,
                                  token_source="usage")
                led.on_end(q)
        hits = {1: 999.0 if with_a else 0.0, 3: 800.0}.get(sec, 0.0)
        led.add_cache_hits(int((sec - 1) * S), int(sec * S), hits)
        led.add_server_tokens(int(sec * S), 0.0, int((sec - 1) * S))
        e += 100.0
        _feed(led, float(sec), e)
        led.advance(int((sec + 0.5) * S))
    led.close_all(int(8 * S))
    return {r["request_id"]: r for r in sink.rows["requests"]}


def test_a_requests_known_hits_are_counted_once_not_in_every_window_its_span_touches():
    # Before: A's 999 known hits went to all three windows of its span, hiding B's 800 unsaid ones: B's note None.
    alone = _straddle_run(with_a=False)
    assert UNSAID in (alone[2]["energy_note"] or "")
    beside = _straddle_run(with_a=True)
    assert UNSAID in (beside[2]["energy_note"] or "") and "800" in beside[2]["energy_note"]


def _step(led, plan, reqs, started, now: float, tick: int, details: bool = True, continuous: bool = False) -> int:
    """One 0.1 s tick of `plan` ({id: (arrival, first token, end, prompt, cached)} in seconds) through the ledger: starts,
    a token each (every 0.5 s after 10 s), ends with their counts (the cached count said only with `details`;
    `continuous`: the prompt's length said on the first token). Returns the tokens streamed."""
    n = 0
    for rid, (arr, first, end, prompt, cached) in plan.items():
        q = reqs[rid]
        if rid not in started and arr <= now:
            led.on_start(q)
            started.add(rid)
        if first <= now < end and (now < 10 or tick % 5 == 0):
            t = int(now * S)
            if q.first_ns is None and continuous:
                q.extra["prompt_tokens"] = prompt
            q.first_ns = q.first_ns or t
            q.last_ns = t
            q.tokens_seen += 1
            led.on_tokens(q, t, 1)
            n += 1
        if q.end_ns is None and end <= now:
            q.end_ns = int(end * S)
            q.counts = Counts(generated_tokens=q.tokens_seen, prompt_tokens=prompt, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=cached if details else None)
            led.on_end(q)
    return n


def _pending_run(details: bool, continuous: bool = False, ends: dict | None = None, scrape_s: float = 2.0):
    """vLLM streams, the server's counter scraped every 2 s. C (0.1 → 1.45 s, 50 prompt tokens) and A (0.2 → 0.85 s,
    100) hit nothing; B arrives at 1.2 s, reuses 900 cached tokens of its 1000 (counted in the first scrape window,
    0 → 2 s, beside A's and C's prefills) and streams to 5.05 s, where its final usage says them (details) or not.
    continuous: every stream says its prompt's length on its first token (continuous usage), its cached count only at
    its end (as vLLM's running usage does). ends: {id: end s} for streams made longer (a token every 0.5 s after 10 s).
    scrape_s: the scrape period (the hits are in the window ending at 2 s)."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    # id: (arrival, first token, end, prompt, cached)
    plan = {1: (0.2, 0.4, 0.85, 100, 0), 2: (1.2, 1.5, 5.05, 1000, 900), 3: (0.1, 0.3, 1.45, 50, 0)}
    for rid, end in (ends or {}).items():
        plan[rid] = (*plan[rid][:2], end, *plan[rid][3:])
    last_s = max(p[2] for p in plan.values())
    reqs = {rid: _vllm(rid, p[0]) for rid, p in plan.items()}
    started, e, window_tokens = set(), 0.0, 0.0
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(0, 0.0)  # the scraper's baseline read
    for tick in range(1, max(91, int(last_s * 10) + 40)):
        now = tick / 10
        window_tokens += _step(led, plan, reqs, started, now, tick, details, continuous)
        if tick % 10 == 0:
            e += 100.0
            _feed(led, now, e)
        if tick % round(scrape_s * 10) == 0:
            since, t = int((now - scrape_s) * S), int(now * S)
            led.add_cache_hits(since, t, 900.0 if tick == 20 else 0.0)
            led.add_server_tokens(t, window_tokens, since)
            window_tokens = 0.0
        led.advance(int((now + 0.05) * S))
        for iv in sink.rows["intervals"]:  # when each interval row was written (the ledger's clock)
            iv.setdefault("_written_s", now + 0.05)
    led.close_all(int(max(9.5, last_s + 4.5) * S))
    return sink.rows["intervals"], {r["request_id"]: r for r in sink.rows["requests"]}, led


def _unsaid_flagged(ivs, rq):
    return ({rid for rid, r in rq.items() if UNSAID in (r["energy_note"] or "")},
            [round(iv["t_start_mono_s"]) for iv in ivs if UNSAID in (iv["energy_note"] or "")])


def test_a_count_said_at_a_streams_end_after_a_scrape_flags_nothing():
    # vLLM with --enable-prompt-tokens-details, streams without continuous usage: every answer says its cached count.
    # At the 2 s scrape B, still streaming, had its 900 hits counted and said nothing yet (it says them at 5.05 s, in
    # its final usage). Before: A and C (given energy of the interval with their prefill beside those hits) and that
    # interval (0-1 s, closed before B's end) said prefix-cache-unsaid, its fix already followed; the counter said 2.
    ivs, rq, led = _pending_run(details=True)
    assert set(rq) == {1, 2, 3} and rq[2]["cached_prompt_tokens"] == 900
    assert _unsaid_flagged(ivs, rq) == (set(), [])
    assert led.totals.flagged_requests[UNSAID] == 0
    # Every interval's row still comes, once, in order.
    starts = [iv["t_start_mono_s"] for iv in ivs]
    assert starts == sorted(starts) and len(starts) == len(set(starts)) >= 8


def test_a_server_that_never_says_its_counts_is_still_flagged_when_the_stream_ends():
    # The same without the details flag: B's end says no count, so its 900 hits stay unsaid: B (its prompt costed
    # whole), A and C beside it, and the intervals with prefill in that scrape window say so, as before.
    ivs, rq, led = _pending_run(details=False)
    rows, flagged_ivs = _unsaid_flagged(ivs, rq)
    assert rows == {1, 2, 3} and "900" in rq[2]["energy_note"] and "fix:" in rq[1]["energy_note"]
    assert flagged_ivs == [0, 1]
    assert led.totals.flagged_requests[UNSAID] == 3


@pytest.mark.parametrize("long_id", [1, 2])
def test_a_stream_longer_than_the_hits_are_kept_is_still_flagged(long_id):
    # The scrape windows' hits are kept CACHE_KEEP_S (300 s). A request judged at its row (beside unsaid hits while
    # their requests were live: A; or its own hits unsaid: B) streaming past that found the windows pruned: review s37
    # saw A ending at 320 s stored 31.5 kJ unflagged and the counter one low. Judged before the windows are pruned.
    ivs, rq, led = _pending_run(details=False, ends={long_id: 320.0})
    rows, _ = _unsaid_flagged(ivs, rq)
    assert rows == {1, 2, 3}, {rid: r["energy_note"] for rid, r in rq.items()}
    assert led.totals.flagged_requests[UNSAID] == 3


def test_a_long_stream_ending_just_before_its_hits_are_pruned_is_still_flagged():
    # B (its 900 hits never said) ends at 303.95 s; the scrape at 304 s prunes the 0-2 s window holding its hits before
    # the interval of its end closes. What live requests keep to judge is judged before that prune, but an ended one
    # still waiting for its interval's close (or its row parked) was passed over: its row found the window gone and
    # said nothing, the counter one low.
    ivs, rq, led = _pending_run(details=False, ends={2: 303.95})
    rows, _ = _unsaid_flagged(ivs, rq)
    assert rows == {1, 2, 3}, {rid: r["energy_note"] for rid, r in rq.items()}
    assert "900" in rq[2]["energy_note"]
    assert led.totals.flagged_requests[UNSAID] == 3


def test_a_count_said_late_marks_the_late_case_not_the_unsaid_one():
    # Continuous usage: B's prompt was said early, its count at its end, after the intervals over its prefill closed.
    # Those requests say prefix-cache-late (its fix); before, all three and both intervals over the window said
    # prefix-cache-unsaid too, whose fix (the details flag) was already followed, and the counter counted 3.
    ivs, rq, led = _pending_run(details=True, continuous=True)
    assert LATE in (rq[2]["energy_note"] or "")
    assert _unsaid_flagged(ivs, rq) == (set(), [])
    assert led.totals.flagged_requests[UNSAID] == 0


def _row_delays_s(ivs):
    """Each interval row's write time less its end (the ledger's clock; close_all's rows left out)."""
    return [iv["_written_s"] - iv["t_start_mono_s"] - iv["duration_s"] for iv in ivs if "_written_s" in iv]


def test_a_server_that_never_says_counts_does_not_hold_rows_for_its_live_streams():
    # vLLM's default (prefix caching on, no --enable-prompt-tokens-details): no answer says a cached count. Streams say
    # their prompt on their first token (continuous usage: no prompt hold), the counter is scraped every second. C
    # ends at 2.5 s, after the 2 s scrape counted 900 hits, and says no count: B's end (5.05 s) cannot say its count
    # either. Before, the interval rows over the window waited for B's end, and every row behind them too (the 0-1 s
    # row written at 6.05 s, 5.05 s after its end); the verdict after the wait was the same. Now decided as C's end
    # says no count.
    ivs, rq, led = _pending_run(details=False, continuous=True, ends={3: 2.5}, scrape_s=1.0)
    assert _unsaid_flagged(ivs, rq) == ({1, 2, 3}, [0, 1])  # flagged as before
    assert led.totals.flagged_requests[UNSAID] == 3
    delays = _row_delays_s(ivs)
    assert len(delays) >= 8 and max(delays) < 2.5, delays
    assert [iv["t_start_mono_s"] for iv in ivs] == sorted(iv["t_start_mono_s"] for iv in ivs)


def test_a_server_that_says_its_counts_keeps_the_wait_for_its_live_streams():
    # The same with the details flag: C's end says 0 cached, so B's end may say its hits (it says 900): the rows wait
    # for it and nothing is flagged unsaid.
    ivs, rq, led = _pending_run(details=True, continuous=True, ends={3: 2.5}, scrape_s=1.0)
    assert _unsaid_flagged(ivs, rq) == (set(), [])
    assert led.totals.flagged_requests[UNSAID] == 0
    assert max(_row_delays_s(ivs)) > 4.0  # the 0-1 s row waited for B's end (5.05 s)


def _many_live_run(n: int, hits: float, until_s: float = 24.0):
    """n vLLM streams arriving over the first 10 s (the details flag on: no answer has yet said it lacks counts), each
    live to `until_s`; the server's counter scraped every 2 s, each window `hits` hits. Returns the ledger at the end
    of that and the bytes tracemalloc saw it hold more than before (all streams still live)."""
    import gc
    import tracemalloc

    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(0, 0.0)
    reqs = [_vllm(i + 1, 0.05 + 10.0 * i / n) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    started, e = 0, 0.0
    for tick in range(1, int(until_s * 2) + 1):
        now = tick / 2
        while started < n and reqs[started].arrival_ns <= now * S:
            led.on_start(reqs[started])
            started += 1
        for q in reqs[:started]:
            t = int(now * S)
            q.extra.setdefault("prompt_tokens", 100)  # said on its first token (continuous usage: no prompt hold)
            q.first_ns = q.first_ns or t
            q.last_ns = t
            q.tokens_seen += 1
            led.on_tokens(q, t, 1)
        if tick % 2 == 0:
            e += 100.0
            _feed(led, now, e)
        if tick % 4 == 0:
            led.add_cache_hits(int((now - 2) * S), int(now * S), hits)
            led.add_server_tokens(int(now * S), float(started * 4), int((now - 2) * S))
        led.advance(int((now + 0.05) * S))
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return led, held


def test_what_the_rows_wait_for_stays_small_with_many_live_streams():
    # Many live streams beside unsaid hits (their ends may yet say them). Before, each request given energy in a
    # waiting interval kept its own set of the live ids, and each parked interval row another: 400 streams held 115k
    # ids, 6.5 MB more than the same run with no hits (1000 streams: 717k ids, 48.7 MB). Now a count per wait: 0.65 MB
    # (1000: 1.6 MB, their `cache_unsure` entries mostly), growing with the streams, not with their square.
    n = 400
    led, held = _many_live_run(n, 900.0, until_s=16.0)
    _, quiet = _many_live_run(n, 0.0, until_s=16.0)  # no hits: nothing waits
    assert led._iv_parked, "the set-up must leave interval rows waiting for the live streams"
    assert held - quiet < 2_000_000, (held, quiet)


def _crossed_run(a_first: bool):
    """vLLM with --enable-prompt-tokens-details: every answer says its cached count. B (0.2 → first token 0.8 s, 300
    of its 400 prompt tokens cached) is scheduled at 0.3 s, in the first scrape window (0 → 1 s); A (0.5 → 1.2 s, 200
    of 300 cached) waits in the queue and is scheduled at 1.1 s, in the second (1 → 2 s): the counter reads 300, then
    200. A's span meets both windows, B's only the first. Both stream on past the scrapes and say their counts at
    their end: A first (2.5 s, then B at 3.0 s), or the other way round."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    # id: (arrival, first token, end, prompt, cached)
    plan = {1: (0.5, 1.2, 2.5 if a_first else 3.0, 300, 200), 2: (0.2, 0.8, 3.0 if a_first else 2.5, 400, 300)}
    reqs = {rid: _vllm(rid, p[0]) for rid, p in plan.items()}
    started, e = set(), 0.0
    _feed(led, 0.0, 0.0)
    led.add_server_tokens(0, 0.0)
    window_tokens = 0.0
    for tick in range(1, 80):
        now = tick / 10
        window_tokens += _step(led, plan, reqs, started, now, tick)
        if tick % 10 == 0:
            e += 100.0
            _feed(led, now, e)
            since, t = int((now - 1) * S), int(now * S)
            led.add_cache_hits(since, t, {10: 300.0, 20: 200.0}.get(tick, 0.0))
            led.add_server_tokens(t, window_tokens, since)
            window_tokens = 0.0
        led.advance(int((now + 0.05) * S))
    led.close_all(int(9 * S))
    return sink.rows["intervals"], {r["request_id"]: r for r in sink.rows["requests"]}, led


@pytest.mark.parametrize("a_first", [True, False], ids=["A-ends-first", "B-ends-first"])
def test_said_counts_of_requests_whose_spans_cross_are_matched_whatever_order_they_end_in(a_first):
    # Every hit the counter read was said: nothing is flagged. Before, a request's said count went to the earliest
    # window of its span with room, in the order the requests ended: A took B's 300 in the first window, B's count
    # found it full, and A's own 200 in the second read as unsaid: A, B and the interval 1-2 s said
    # prefix-cache-unsaid with the details flag on (a loaded host: 135 of 250 rows of a simulated vLLM run).
    ivs, rq, led = _crossed_run(a_first)
    assert set(rq) == {1, 2} and rq[1]["cached_prompt_tokens"] == 200 and rq[2]["cached_prompt_tokens"] == 300
    assert _unsaid_flagged(ivs, rq) == (set(), []), {rid: r["energy_note"] for rid, r in rq.items()}
    assert led.totals.flagged_requests[UNSAID] == 0


def _whole_then_stream_run(details: bool):
    """A chat's two cached turns on vLLM, as 0.32 on CPU ran them (tests/test_real_vllm.py): W answered whole
    (arrival 1.1 s, end 2.4 s; its tokens spread from its arrival, its first unseen), S streamed (arrival 2.5 s, first
    token 3.3 s, end 3.6 s), 384 cached each. vLLM counts a hit on /metrics with the output of the step that admitted
    the request, beside its first token: W's in the scrape window [2, 3] s, S's in [3, 4] s."""
    sink = _Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    led.scraping = True
    _feed(led, 0.0, 0.0)
    w = RequestTrace(1, "POST", "/v1/chat/completions", "w", int(1.1 * S), 0, api="openai-chat", stream=False)
    s = RequestTrace(2, "POST", "/v1/chat/completions", "s", int(2.5 * S), 0, api="openai-chat", stream=True)
    cached = 384 if details else None
    e = 0.0
    for tenth in range(1, 61):
        t = int(tenth * S / 10)
        if tenth == 11:
            led.on_start(w)
        if tenth == 24:  # as the proxy's _body_done sets a whole answer: its tokens spread over arrival → end
            w.first_ns, w.last_ns, w.tokens_seen, w.end_ns = w.arrival_ns, t, 8, t
            w.extra["spread"] = True
            w.counts = Counts(generated_tokens=8, prompt_tokens=511, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=cached)
            led.on_end(w)
        if tenth == 25:
            led.on_start(s)
        if 33 <= tenth < 36:
            s.first_ns = s.first_ns or t
            s.last_ns = t
            s.tokens_seen += 1
            led.on_tokens(s, t, 1)
        if tenth == 36:
            s.end_ns = t
            s.counts = Counts(generated_tokens=3, prompt_tokens=555, model=None, stop_reason=None,
                              token_source="usage", cached_tokens=cached)
            led.on_end(s)
        if tenth % 10 == 0:
            sec = tenth // 10
            led.add_cache_hits(int((sec - 1) * S), int(sec * S), {3: 384.0, 4: 384.0}.get(sec, 0.0))
            led.add_server_tokens(int(sec * S), 0.0, int((sec - 1) * S))
            e += 100.0
            _feed(led, float(sec), e)
            led.advance(int((sec + 0.5) * S))
    led.close_all(int(8 * S))
    return sink.rows["intervals"], {r["request_id"]: r for r in sink.rows["requests"]}


def test_a_whole_answers_hit_counted_after_its_arrival_is_matched_to_its_said_count():
    # Before: a whole answer's hit span was its arrival alone (its first_ns, where its tokens were spread from): its
    # 384 said met no window, the window of its hit took S's count, and S's own hit read unsaid: S flagged, and the
    # intervals over it, with every count said (vLLM 0.32: said-1 and said-2).
    ivs, rq = _whole_then_stream_run(details=True)
    assert [rq[k]["cached_prompt_tokens"] for k in (1, 2)] == [384, 384]
    assert _unsaid_flagged(ivs, rq) == (set(), []), _unsaid_flagged(ivs, rq)
    # Not said: the whole answer's own prompt is flagged (before, only a share beside S's, where the intervals fell so).
    ivs, rq = _whole_then_stream_run(details=False)
    for k in (1, 2):
        assert "in the scrape window(s) over its prefill" in (rq[k]["energy_note"] or ""), rq[k]["energy_note"]
