"""Energy attribution: every joule lands in exactly one place; busy intervals are split by work."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.daemon import attribution as A

S = 1_000_000_000
NEVER = A.NEVER


def _run(edges_s, energy, reqs, tokens, server=None, prompt=None, ctx=None, costs=None):
    """reqs: (arrival, first, last, end) in seconds, None = not yet; tokens: (t, req, n)."""
    conv = lambda v: NEVER if v is None else int(v * S)  # noqa: E731
    cols = list(zip(*reqs)) if reqs else [(), (), (), ()]
    arr = [np.array([conv(v) for v in c], dtype=np.int64) for c in cols]
    t = np.array([int(x[0] * S) for x in tokens], dtype=np.int64)
    r = np.array([x[1] for x in tokens], dtype=np.int64)
    n = np.array([x[2] for x in tokens], dtype=float)
    return A.attribute(np.array([int(e * S) for e in edges_s]), np.array(energy, float), *arr, t, r, n, server,
                       prompt_tokens=prompt, tok_ctx=None if ctx is None else np.array(ctx, float), costs=costs)


def test_decode_energy_splits_by_tokens_in_each_interval():
    # Two requests decode through [0,1) and [1,2): 3:1 tokens in the first, 1:1 in the second.
    reqs = [(-1.0, -0.5, 1.9, 1.95), (-1.0, -0.4, 1.8, 1.85)]
    toks = [(0.1, 0, 2), (0.5, 0, 1), (0.6, 1, 1), (1.2, 0, 1), (1.3, 1, 1)]
    a = _run([0, 1, 2], [100.0, 60.0], reqs, toks)
    assert list(a.kind) == [A.DECODE, A.DECODE]
    assert a.request_energy[:, 0] == pytest.approx([75 + 30, 25 + 30])
    assert a.request_tokens == pytest.approx([4, 2])


def test_requests_idle_and_unproxied_sum_to_the_total_and_every_token_is_attributed():
    rng = np.random.default_rng(3)
    edges = np.arange(0, 31, dtype=float)
    energy = rng.uniform(20, 300, size=30)
    reqs, toks = [], []
    for i in range(40):
        arr = rng.uniform(0, 25)
        first = arr + rng.uniform(0.05, 1.5)
        last = first + rng.uniform(0, 4)
        reqs.append((arr, first, last, last + 0.01))
        for tt in np.linspace(first, last, 10):
            toks.append((tt, i, int(rng.integers(1, 4))))
    server = np.where(rng.uniform(size=30) < 0.3, 5.0, 0.0)
    for costs in (None, A.WorkCosts(step_j=2.0, decode_j=0.5, prefill_j=0.01, ctx_j=0.1, idle_w=30.0)):
        a = _run(edges, energy, reqs, toks, server=server, prompt=rng.integers(1, 3000, 40), costs=costs)
        d = a.by_dest[:, 0]
        assert a.request_energy[:, 0].sum() == pytest.approx(d[A.TO_REQUESTS])
        assert d.sum() == pytest.approx(energy.sum())
        assert a.dest[:, :, 0].sum(axis=1) == pytest.approx(energy)  # exact in every interval
        assert a.request_tokens.sum() == pytest.approx(sum(x[2] for x in toks))
        assert d[A.TO_UNPROXIED] > 0


def test_a_prefill_interval_is_split_by_work_not_kept_aside():
    # Request 1 decodes 10 tokens in [0,1) while request 0 prefills 1000 prompt tokens there.
    reqs = [(0.2, 0.9, 2.5, 2.6), (-1, -0.5, 0.95, 0.96)]
    toks = [(0.05 + 0.09 * i, 1, 1) for i in range(10)] + [(0.9, 0, 1), (1.5, 0, 1), (2.5, 0, 1)]
    costs = A.WorkCosts(decode_j=1.0, prefill_j=0.01)
    a = _run([0, 1, 3], [50.0, 40.0], reqs, toks, prompt=[1000, 0], costs=costs)
    assert list(a.kind) == [A.PREFILL, A.DECODE]
    # [0,1): work 1000·0.01 + 1 (its first token) = 11 against 10.
    assert a.request_energy[:, 0] == pytest.approx([50 * 11 / 21 + 40.0, 50 * 10 / 21])
    assert a.features[0, 3] == pytest.approx(1000.0)


def test_the_context_term_and_the_step_term_weigh_work():
    reqs = [(-1, -0.5, 0.9, 0.95), (-1, -0.5, 0.9, 0.95)]
    toks = [(0.1, 0, 1), (0.1, 1, 1), (0.5, 0, 1), (0.5, 1, 1)]
    ctx = [4000, 0, 4001, 1]  # request 0 decodes at a long context
    a = _run([0, 1], [100.0], reqs, toks, ctx=ctx, costs=A.WorkCosts(step_j=2.0, decode_j=1.0, ctx_j=0.25))
    w0 = 2.0 * 2 * 0.5 + 2 * 1.0 + 0.25 * (4.0 + 4.001)
    w1 = 2.0 * 2 * 0.5 + 2 * 1.0 + 0.25 * (0.0 + 0.001)
    assert a.request_energy[:, 0] == pytest.approx([100 * w0 / (w0 + w1), 100 * w1 / (w0 + w1)])
    assert a.features[0, 1] == pytest.approx(2.0)  # two steps: the most tokens any request got


def test_the_context_costs_band_gives_each_request_its_figure_at_either_end():
    """The fit's context cost at its band's two ends (workmodel.ctx_band: the decode cost the other way) splits the same
    intervals again: the long-context request's figure rises with it, the short one's falls, the sum stays the
    interval's. Before, the split at the fitted costs alone: nothing said how far either could be off."""
    reqs = [(-1, -0.5, 0.9, 0.95), (-1, -0.5, 0.9, 0.95)]
    toks = [(0.1, 0, 1), (0.1, 1, 1), (0.5, 0, 1), (0.5, 1, 1)]
    ctx = [4000, 0, 4001, 1]
    band = ((2.0, 0.5, 0.05, 0.5), (2.0, 1.5, 0.05, 0.0))
    a = _run([0, 1], [100.0], reqs, toks, ctx=ctx,
             costs=A.WorkCosts(step_j=2.0, decode_j=1.0, ctx_j=0.25, ctx_band=band))
    mid = a.request_energy[:, 0]
    for (step, dec, _, c), got in zip(band, a.band_j.T):
        w0, w1 = step + 2 * dec + c * 8.001, step + 2 * dec + c * 0.001
        assert got == pytest.approx([100 * w0 / (w0 + w1), 100 * w1 / (w0 + w1)])
    assert a.band_j[0, 0] > mid[0] > a.band_j[0, 1] and a.band_j[1, 0] < mid[1] < a.band_j[1, 1]
    assert a.band_j.sum(axis=0) == pytest.approx([100.0, 100.0])
    assert _run([0, 1], [100.0], reqs, toks, ctx=ctx, costs=A.WorkCosts(ctx_j=0.25)).band_j is None


def test_time_no_request_was_live_in_is_idle_at_the_idle_power():
    # One short request from 0.2 s to 0.5 s in a 1 s interval of 100 J; idle power 40 W.
    reqs = [(0.2, 0.3, 0.45, 0.5)]
    toks = [(0.3, 0, 1), (0.45, 0, 9)]
    a = _run([0, 1], [100.0], reqs, toks, costs=A.WorkCosts(idle_w=40.0))
    assert a.by_dest[A.TO_IDLE, 0] == pytest.approx(40.0 * 0.7)
    assert a.request_energy[0, 0] == pytest.approx(100.0 - 28.0)


def test_bypass_tokens_in_a_busy_interval_get_their_share():
    reqs = [(-1, -0.5, 0.9, 0.95)]
    toks = [(0.1, 0, 5), (0.5, 0, 5)]
    a = _run([0, 1], [90.0], reqs, toks, server=np.array([20.0]))
    assert a.by_dest[A.TO_UNPROXIED, 0] == pytest.approx(60.0)
    assert a.request_energy[0, 0] == pytest.approx(30.0)


def test_several_energy_columns_share_weights():
    reqs = [(-1, -0.5, 0.9, 0.95), (-1, -0.5, 0.9, 0.95)]
    toks = [(0.1, 0, 3), (0.2, 1, 1)]
    a = _run([0, 1], np.array([[40.0, 8.0]]), reqs, toks)
    assert a.request_energy == pytest.approx(np.array([[30.0, 6.0], [10.0, 2.0]]))


def test_interval_energy_uses_the_counter_and_falls_back_to_power_on_reset():
    t = np.array([0, 1, 2, 3]) * S
    counter = np.array([1000.0, 1100.0, 5.0, 105.0])  # driver reload between samples 1 and 2
    power = np.array([100.0, 100.0, 120.0, 100.0])
    e, exact = A.interval_energy_j(counter, t, power)
    assert e == pytest.approx([100.0, 110.0, 100.0])
    assert list(exact) == [True, False, True]
    e, exact = A.interval_energy_j(np.full(4, np.nan), t, power)
    assert e == pytest.approx([100.0, 110.0, 110.0]) and not exact.any()


def test_per_token_is_nan_without_tokens():
    assert np.isnan(A.per_token(5.0, 0.0))
    assert A.per_token(6.0, 3.0) == pytest.approx(2.0)


def test_bad_edges_are_rejected():
    with pytest.raises(ValueError, match="increasing"):
        _run([0, 1, 1], [1.0, 1.0], [], [])


def test_a_queued_prompt_is_prefilled_just_before_its_first_token_not_over_the_wait():
    # Request 0 decodes through [0,3); request 1 arrives at 0.2, waits in the server's queue and
    # gets its first token at 2.5: its 2000-token prompt ran in [2.3, 2.5) at 10k tokens/s, so the
    # intervals of the wait are request 0's alone.
    reqs = [(-1.0, -0.5, 2.95, 2.96), (0.2, 2.5, 2.9, 2.95)]
    toks = [(0.1 * k, 0, 1) for k in range(30)] + [(2.5, 1, 1), (2.9, 1, 1)]
    costs = A.WorkCosts(decode_j=1.0, prefill_j=0.01, prefill_tok_s=10_000.0)
    a = _run([0, 1, 2, 3], [100.0, 100.0, 130.0], reqs, toks, prompt=[0, 2000], costs=costs)
    assert a.dest[:2, A.TO_REQUESTS, 0] == pytest.approx([100.0, 100.0])
    assert a.features[:, 3] == pytest.approx([0.0, 0.0, 2000.0])
    share = 130.0 * (20 + 2) / (10 + 20 + 2)  # [2,3): 10 tokens of request 0; 2000 prompt tokens, 2 tokens
    assert a.request_energy[1, 0] == pytest.approx(share)


def test_a_prompt_whose_first_token_is_past_the_last_edge_is_counted_once_over_two_calls():
    # The ledger closes intervals in batches: a first token after this batch's last edge leaves the
    # prompt's later part to the next batch, never the whole prompt to both.
    costs = A.WorkCosts(prefill_tok_s=1000.0)  # 1000 prompt tokens: [0.5, 1.5)
    reqs = [(0.0, 1.5, 1.9, 1.95)]
    first = _run([0, 1], [50.0], reqs, [], prompt=[1000], costs=costs)
    second = _run([1, 2], [50.0], reqs, [(1.5, 0, 1), (1.9, 0, 1)], prompt=[1000], costs=costs)
    assert first.features[0, 3] + second.features[0, 3] == pytest.approx(1000.0)
    assert first.features[0, 3] == pytest.approx(500.0)


def test_a_request_only_waiting_beside_bypass_work_gets_none_of_it():
    # [0,1): request 0 waits in the queue (no tokens, prompt not placed there) while bypass traffic
    # decodes: the interval's work is the bypass tokens', all of it unproxied.
    reqs = [(0.5, 1.5, 1.9, 1.95)]
    a = _run([0, 1, 2], [80.0, 60.0], reqs, [(1.5, 0, 1), (1.9, 0, 1)], server=[10.0, 0.0], prompt=[10],
             costs=A.WorkCosts(prefill_tok_s=1000.0))
    assert a.dest[0, A.TO_UNPROXIED, 0] == pytest.approx(80.0)
    assert a.request_energy[0, 0] == pytest.approx(60.0)


def test_where_nobody_has_work_the_live_requests_share_by_live_time():
    # [0,1): neither request has a token or a prompt there; request 0 is live 0.8 s, request 1 0.2 s.
    reqs = [(0.2, 1.2, 1.5, 1.6), (0.8, 1.2, 1.5, 1.6)]
    a = _run([0, 1, 2], [50.0, 40.0], reqs, [(1.2, 0, 1), (1.5, 0, 1), (1.2, 1, 1), (1.5, 1, 1)])
    assert a.request_energy[:, 0] == pytest.approx([40.0 + 20.0, 10.0 + 20.0])


def test_a_request_of_two_choices_counts_one_step_for_its_two_tokens_a_step():
    # Request 0 has two choices (n = 2: two sequences in the batch, two tokens a step); request 1 one. Ten steps
    # in [0,1): 20 tokens of request 0, 10 of request 1. Before: the interval's steps were the most tokens any
    # request got (20), twice the truth; each step's cost went to the interval twice (n = 2 chat +4.7% to +8.5%
    # over its truth on bench/attribution_mixed.py).
    reqs = [(-1, -0.5, 0.95, 0.96), (-1, -0.5, 0.95, 0.96)]
    toks = [(0.05 + 0.1 * k, 0, 2) for k in range(10)] + [(0.05 + 0.1 * k, 1, 1) for k in range(10)]
    costs = A.WorkCosts(step_j=3.0, decode_j=1.0)
    conv = [np.array([int(r[i] * S) for r in reqs], dtype=np.int64) for i in range(4)]
    t = np.array([int(x[0] * S) for x in toks], dtype=np.int64)
    r = np.array([x[1] for x in toks], dtype=np.int64)
    n = np.array([x[2] for x in toks], dtype=float)
    a = A.attribute(np.array([0, S]), np.array([100.0]), *conv, t, r, n, costs=costs, sequences=np.array([2, 1]))
    assert a.features[0, 1] == pytest.approx(10.0)
    # The steps' cost is shared by the sequences in them, so by tokens: 2:1, as the decode cost.
    assert a.request_energy[:, 0] == pytest.approx([100 * 2 / 3, 100 / 3])
    # Without the request's sequences (an old caller) each request is one sequence, as before.
    assert A.attribute(np.array([0, S]), np.array([100.0]), *conv, t, r, n, costs=costs).features[0, 1] == 20.0


def _rates_bounded(a, run, rates, ratios=A.PREFILL_PER_DECODE_RANGE):
    """Where each request's share of a ratio-split interval at (ratio, rate) falls outside share_lo..share_hi."""
    out = []
    cols = a.ratio_split
    for v in rates:
        for r in ratios:
            s = run(A.WorkCosts(prefill_j=r, prefill_tok_s=v)).share[:, cols]
            if np.any(s > a.share_hi[:, cols] + 1e-9) or np.any(s < a.share_lo[:, cols] - 1e-9):
                out.append((v, r, s.round(3).tolist(), a.share_lo[:, cols].round(3).tolist(),
                            a.share_hi[:, cols].round(3).tolist()))
    return out


def test_the_range_of_shares_bounds_every_prefill_rate_between_its_ends_not_only_the_ends():
    # b's 6324-token prompt (first token at 3, arrived at 0) beside a's 100 tokens decoded in [1, 2), the only interval
    # the ratio splits. At 10 000 tokens/s the prompt is placed in [2.37, 3): none of it in [1, 2); at 1000 tokens/s it
    # starts at b's arrival, a third of it (2108) in [1, 2); at 3162 tokens/s it starts at 1 and all of [1, 2) is
    # prefill, 3162 tokens there: more than either end places. share_lo/share_hi were taken at the two ends only, so
    # b's most (0.68 of [1, 2) at a prompt token 0.1 of a decoded one) fell short of its 0.76 at 3162 tokens/s, and the
    # row's "its figure would be ... to +M%" said a range a rate inside it leaves.
    reqs = [(1.0, 1.05, 1.99, 1.995), (0.0, 3.0, 3.5, 3.6)]
    toks = [(1.05 + 0.0094 * j, 0, 1) for j in range(100)] + [(3.0 + 0.1 * j, 1, 1) for j in range(5)]

    def run(costs=None):
        return _run([0, 1, 2, 3, 4], [100.0] * 4, reqs, toks, prompt=np.array([0.0, 6324.0]), costs=costs)

    a = run()
    assert a.ratio_split.tolist() == [False, True, False, False]
    mid = run(A.WorkCosts(prefill_j=0.1, prefill_tok_s=3162.0))
    assert mid.share[1, 1] == pytest.approx(0.76, abs=0.01)
    assert a.share_hi[1, 1] >= mid.share[1, 1] - 1e-9 and a.share_lo[0, 1] <= mid.share[0, 1] + 1e-9
    assert not _rates_bounded(a, run, np.geomspace(A.PREFILL_TOK_S_SLOW, A.DEFAULT_PREFILL_TOK_S, 40))


def test_the_range_of_shares_bounds_every_prefill_rate_and_ratio_in_it_on_random_traffic():
    # Requests of random prompts, arrivals, queue waits and decodes over 0.25 s intervals, some beside bypass tokens:
    # each one's share of every ratio-split interval at any rate and ratio inside the range lies within its least and
    # most (the ratio's ends and every rate at which a prompt's start crosses an interval's edge or its arrival).
    rng = np.random.default_rng(7)
    for _ in range(12):
        n = int(rng.integers(2, 6))
        reqs, toks = [], []
        for i in range(n):
            arr = float(rng.uniform(0, 3))
            first = arr + float(rng.uniform(0.05, 2.5))
            last = first + float(rng.uniform(0.1, 1.5))
            reqs.append((arr, first, last, last + 0.01))
            toks += [(t, i, 1) for t in np.linspace(first, last, int(rng.integers(2, 40)))]
        prompt = rng.integers(0, 8000, n).astype(float)
        edges = np.arange(0, 7.01, 0.25)
        server = np.where(rng.uniform(size=edges.size - 1) < 0.2, 5.0, 0.0)

        def run(costs=None):
            return _run(edges, [50.0] * (edges.size - 1), reqs, toks, server=server, prompt=prompt, costs=costs)

        a = run()
        assert not _rates_bounded(a, run, np.geomspace(A.PREFILL_TOK_S_SLOW, A.DEFAULT_PREFILL_TOK_S, 25),
                                  (0.01, 0.03, 0.05, 0.1))


def test_an_interval_shared_by_live_time_that_a_slow_prefill_would_give_one_request_is_in_the_range():
    # a decodes with a slow step over [1, 2) (tokens at 0.5 and 2.5, none in it); b's 1500-token prompt, due at 2.2,
    # is placed at 10 000 tokens/s in [2.05, 2.2): no work in [1, 2), so a and b share it by live time. At 1000
    # tokens/s b's prefill runs from 0.7 and all of [1, 2) is b's work. Only one request "worked" there at any rate,
    # so ratio_split left it out and neither row's range said that half the interval rests on the rate.
    reqs = [(0.0, 0.5, 2.5, 2.6), (0.2, 2.2, 2.4, 2.45)]
    toks = [(0.5, 0, 1), (2.5, 0, 1), (2.2, 1, 1), (2.4, 1, 1)]
    a = _run([0, 1, 2, 3], [100.0] * 3, reqs, toks, prompt=np.array([0.0, 1500.0]))
    assert a.share[:, 1] == pytest.approx([0.5, 0.5])  # by live time: both live through it
    assert a.ratio_split[1]
    assert a.share_lo[0, 1] == pytest.approx(0.0) and a.share_hi[1, 1] == pytest.approx(1.0)
