"""Energy attribution: every joule lands in exactly one place, split by tokens where decoding."""

from __future__ import annotations

import numpy as np
import pytest

from powerprof.daemon import attribution as A

S = 1_000_000_000
NEVER = A.NEVER


def _run(edges_s, energy, reqs, tokens, server=None):
    """reqs: (arrival, first, last, end) in seconds, None = not yet; tokens: (t, req, n)."""
    conv = lambda v: NEVER if v is None else int(v * S)  # noqa: E731
    cols = list(zip(*reqs)) if reqs else [(), (), (), ()]
    arr = [np.array([conv(v) for v in c], dtype=np.int64) for c in cols]
    t = np.array([int(x[0] * S) for x in tokens], dtype=np.int64)
    r = np.array([x[1] for x in tokens], dtype=np.int64)
    n = np.array([x[2] for x in tokens], dtype=float)
    return A.attribute(np.array([int(e * S) for e in edges_s]), np.array(energy, float), *arr, t, r, n, server)


def test_decode_energy_splits_by_tokens_in_each_interval():
    # Two requests decode through [0,1) and [1,2): 3:1 tokens in the first, 1:1 in the second.
    reqs = [(-1.0, -0.5, 1.9, 1.95), (-1.0, -0.4, 1.8, 1.85)]
    toks = [(0.1, 0, 2), (0.5, 0, 1), (0.6, 1, 1), (1.2, 0, 1), (1.3, 1, 1)]
    a = _run([0, 1, 2], [100.0, 60.0], reqs, toks)
    assert list(a.kind) == [A.DECODE, A.DECODE]
    assert a.request_energy[:, 0] == pytest.approx([75 + 30, 25 + 30])
    assert a.request_tokens == pytest.approx([4, 2])


def test_prefill_idle_and_requests_sum_to_the_total():
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
    a = _run(edges, energy, reqs, toks)
    assert a.request_energy[:, 0].sum() + a.by_kind[A.IDLE, 0] + a.by_kind[A.PREFILL, 0] == pytest.approx(energy.sum())
    assert a.by_kind[A.DECODE, 0] == pytest.approx(a.request_energy[:, 0].sum())
    assert a.total[0] == pytest.approx(energy.sum())


def test_an_interval_with_any_prefill_is_prefill_and_gives_no_request_energy():
    reqs = [(0.2, 1.5, 2.5, 2.6), (-1, -0.5, 0.9, 0.95)]
    toks = [(0.3, 1, 1), (0.8, 1, 1), (1.5, 0, 1), (2.5, 0, 1)]
    a = _run([0, 1, 2, 3], [50.0, 40.0, 30.0], reqs, toks)
    assert list(a.kind) == [A.PREFILL, A.PREFILL, A.DECODE]
    assert a.request_energy[:, 0] == pytest.approx([30.0, 0.0])
    assert a.by_kind[A.PREFILL, 0] == pytest.approx(90.0)


def test_decoding_without_a_token_in_the_interval_splits_equally():
    # A slow step straddles [1,2): both requests are mid-decode but no token arrives there.
    reqs = [(-1, -0.5, 2.5, 2.6), (-1, -0.5, None, None)]
    toks = [(0.5, 0, 1), (0.6, 1, 1), (2.2, 0, 1)]
    a = _run([0, 1, 2], [10.0, 8.0], reqs, toks)
    assert a.kind[1] == A.DECODE
    assert a.request_energy[:, 0] == pytest.approx([5 + 4, 5 + 4])


def test_idle_and_unproxied_intervals():
    a = _run([0, 1, 2, 3], [20.0, 21.0, 22.0], [], [], server=np.array([0.0, 5.0, 0.0]))
    assert list(a.kind) == [A.IDLE, A.UNPROXIED, A.IDLE]
    assert a.by_kind[:, 0] == pytest.approx([42.0, 0.0, 0.0, 21.0])


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
