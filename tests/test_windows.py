"""Decode-window arithmetic on hand-made timelines whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.windows import concurrent_throughput, decode_window, measured_intervals, tokens_in_intervals

MS = 1_000_000


def test_decode_window_excludes_the_prefill_token():
    t = np.array([100, 110, 120, 130]) * MS
    w = decode_window(t, np.ones(4, dtype=int))
    assert w.t_first_ns == 100 * MS and w.t_last_ns == 130 * MS
    assert w.decode_tokens == 3
    assert w.decode_tok_s == pytest.approx(3 / 0.030)


def test_decode_window_uses_the_servers_total_when_given_and_handles_empty():
    t = np.array([0, 10, 20]) * MS
    assert decode_window(t, np.array([1, 2, 1]), generated=6).decode_tokens == 5
    assert decode_window(np.array([5 * MS]), np.array([1])).decode_tok_s is None
    assert decode_window(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).t_first_ns is None


def test_intervals_exclude_any_prefill():
    # A: sent 0, first 10, last 100. B: sent 50, first 60, last 150.
    iv = measured_intervals([0, 50 * MS], [10 * MS, 60 * MS], [100 * MS, 150 * MS])
    assert iv.tolist() == [[10 * MS, 50 * MS], [60 * MS, 150 * MS]]


def test_blocked_spans_of_failed_attempts_are_excluded():
    iv = measured_intervals([0], [10 * MS], [100 * MS], blocked=[(40 * MS, 70 * MS)])
    assert iv.tolist() == [[10 * MS, 40 * MS], [70 * MS, 100 * MS]]


def test_tokens_in_intervals_is_half_open_on_the_left():
    t = np.array([10, 20, 30]) * MS
    assert tokens_in_intervals(t, np.ones(3), np.array([[10 * MS, 30 * MS]])) == 2


def test_aggregate_is_wall_clock_not_sum_of_rates():
    # Seed 000's mistake in miniature: two requests served one after the other (one slot).
    # Each decodes 100 tokens in 1 s, so each "rate" is 100 tok/s and their sum 200, but the
    # server only ever produced 100 tok/s. B waits (prefill to the client) while A decodes.
    ta = 0.1 + np.arange(101) * 0.01
    tb = 1.2 + np.arange(101) * 0.01
    a = (0, (ta * 1e9).astype(np.int64), np.ones(101), None)
    b = (0, (tb * 1e9).astype(np.int64), np.ones(101), None)
    agg = concurrent_throughput([a, b])
    rates = [decode_window(r[1], r[2]).decode_tok_s for r in (a, b)]
    assert sum(rates) == pytest.approx(200, rel=1e-6)
    assert agg.tok_s == pytest.approx(100, rel=1e-6)
    assert agg.intervals.tolist() == [[int(tb[0] * 1e9), int(tb[-1] * 1e9)]]


def test_a_batchs_pieces_shorter_than_the_counters_refresh_are_left_out_of_its_figures_by_length():
    """Two streams decoding together 0.1-1.1 s, a stale read blocking 0.15-0.2 s: the batch's decode splits into a
    50 ms piece and a 0.9 s one. No energy reading resolves the 50 ms piece (profiler.COUNTER_REFRESH_MAX_NS), so a
    batch holding it would have no figure at all; with `min_interval_ns` the piece is left out of the tokens, the time
    and the energy alike (chosen by its length, before any reading), and the batch is measured over the rest. Where
    every piece is short, they are all kept (the profiler then says why there is no figure)."""
    t = (0.1 + np.arange(101) * 0.01) * 1e9
    reqs = [(0, t.astype(np.int64), np.ones(101), None) for _ in range(2)]
    blocked = [(int(0.15e9), int(0.2e9))]
    whole = concurrent_throughput(reqs, blocked)
    assert [int(b - a) for a, b in whole.intervals] == [50_000_000, 900_000_000]
    agg = concurrent_throughput(reqs, blocked, min_interval_ns=100_000_000)
    assert agg.intervals.tolist() == [[int(0.2e9), int(1.1e9)]]
    assert agg.measured_s == pytest.approx(0.9) and agg.decode_tokens == pytest.approx(2 * 90)
    assert agg.tok_s == pytest.approx(200, rel=1e-6) and agg.max_streams == 2
    short = concurrent_throughput(reqs, [(int(0.15e9), int(1.05e9))], min_interval_ns=100_000_000)
    assert [int(b - a) for a, b in short.intervals] == [50_000_000, 50_000_000]


def test_aggregate_of_truly_parallel_streams_adds_up():
    t = (0.1 + np.arange(51) * 0.02) * 1e9
    reqs = [(0, t.astype(np.int64), np.ones(51), None) for _ in range(4)]
    agg = concurrent_throughput(reqs)
    assert agg.tok_s == pytest.approx(4 * 50, rel=1e-6)


def test_an_aggregate_knows_how_many_streams_ever_decoded_together():
    # One slot: B waits for A, so no instant had both decoding; a "concurrency 2" figure from it would be one
    # stream's figure under another label (the sweep marks such a batch untrusted: workload/rows.batch_row).
    ta = (0.1 + np.arange(101) * 0.01) * 1e9
    tb = (1.2 + np.arange(101) * 0.01) * 1e9
    one_slot = concurrent_throughput([(0, ta.astype(np.int64), np.ones(101), None),
                                      (0, tb.astype(np.int64), np.ones(101), None)])
    assert one_slot.max_streams == 1
    tc = (0.15 + np.arange(101) * 0.01) * 1e9
    two_slots = concurrent_throughput([(0, ta.astype(np.int64), np.ones(101), None),
                                       (0, tc.astype(np.int64), np.ones(101), None)])
    assert two_slots.max_streams == 2


def test_an_aggregate_says_how_many_streams_decoded_together_on_average():
    # A and B decode over [100, 1100] ms; C, sent late at 500 ms, is in prefill until 600 and decodes until 1600.
    # Measured: [100, 500] two streams, [600, 1100] three, [1100, 1600] C alone: (2·0.4 + 3·0.5 + 1·0.5) / 1.4 = 2.0
    # streams on average, though all three did decode together at one instant (max_streams 3).
    ab = np.linspace(100, 1100, 101).astype(np.int64) * MS
    c = np.linspace(600, 1600, 101).astype(np.int64) * MS
    one = np.ones(101)
    agg = concurrent_throughput([(0, ab, one, None), (0, ab, one, None), (500 * MS, c, one, None)])
    assert agg.max_streams == 3
    assert agg.mean_streams == pytest.approx(2.0, rel=1e-6)
    together = concurrent_throughput([(0, ab, one, None)] * 3)
    assert together.mean_streams == pytest.approx(3.0)
    # C started late: until the first stream's end only 2 + 3 of 3 streams decoded on average, not all of them.
    assert agg.start_mean_streams == pytest.approx((2 * 0.4 + 3 * 0.5) / 0.9, rel=1e-6)


def test_streams_that_started_together_and_ended_apart_have_a_span_where_all_of_them_decode():
    # Four streams sent together, first tokens at 100 ms, 20 ms a token, stopped at their end-of-text after 256, 200,
    # 120 and 60 tokens (a server sent no ignore_eos): 2.48 streams on average over the batch, though they started
    # together (4.0 up to the first end). Over [100 ms, the 60-token stream's end] all four decode: 4 × 50 tok/s.
    reqs = []
    for n in (256, 200, 120, 60):
        arr = (100 + 20 * np.arange(n)).astype(np.int64) * MS
        reqs.append((0, arr, np.ones(n, dtype=np.int64), n))
    agg = concurrent_throughput(reqs)
    assert agg.mean_streams == pytest.approx(2.478, abs=0.01)
    assert agg.start_mean_streams == pytest.approx(4.0)
    assert agg.together_ns == (100 * MS, (100 + 20 * 59) * MS)
    together = concurrent_throughput(reqs, within=agg.together_ns)
    assert together.tok_s == pytest.approx(200.0)
    assert together.mean_streams == pytest.approx(4.0) and together.max_streams == 4
    assert together.measured_s == pytest.approx(1.18) and together.decode_tokens == 4 * 59


def test_overlapping_windows_are_found_in_any_order_and_missing_ones_never_are():
    from powerprof.workload.rows import overlapping

    # A long window holding two short ones; one after all of them; one with no window; two touching end to start.
    edges = [(5, 6), (0, 10), (20, 30), None, (1, 2), (30, 40)]
    assert overlapping(edges) == [True, True, False, False, True, False]
    assert overlapping([(0, 10), (2, 12), (11, 13)]) == [True, True, True]  # 11 < 12: the third overlaps the second
    assert overlapping([]) == [] and overlapping([None, (0, 1)]) == [False, False]
