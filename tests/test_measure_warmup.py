"""The warm-up runs as the measured batches do: a server's first batch of a size it has not run is slow."""

from __future__ import annotations

import pytest

from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams
from powerprof.workload.load import builtin_prompts, run_load, warmup_streams
from powerprof.workload.measure import measure

PARAMS = RequestParams(max_tokens=32)


def test_warmup_is_whole_batches_of_the_concurrency():
    assert [warmup_streams(w, 4) for w in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [warmup_streams(w, 1) for w in (0, 1, 2)] == [0, 1, 2]


def test_the_warmup_of_a_run_at_4_is_one_batch_of_4_sent_at_once():
    srv = SimServer(n_slots=4).start()
    try:
        recs = run_load(srv.url, builtin_prompts("short"), 4, 4, PARAMS, warmup=1)
    finally:
        srv.stop()
    warm = [r for r in recs if r.warmup]
    measured = [r for r in recs if not r.warmup]
    assert len(warm) == 4 and len({r.batch_id for r in warm}) == 1 and all(r.concurrency == 4 for r in warm)
    assert len(measured) == 4 and {r.batch_id for r in measured}.isdisjoint({r.batch_id for r in warm})
    # At once: every warm-up stream was sent before the first one ended.
    assert max(r.t_send_ns for r in warm) < min(r.t_end_ns for r in warm)
    assert all(r.ok for r in recs) and sorted(r.request_id for r in recs) == list(range(8))


def _stream_rate(recs) -> float:
    """The measured streams' mean decode rate, tokens after the first over first to last token (client side)."""
    rates = [(r.generated_tokens - 1) / ((r.t_last_ns - r.t_first_ns) / 1e9) for r in recs]
    return sum(rates) / len(rates)


def test_a_servers_cold_first_batch_of_8_is_the_warmups_not_the_measured_one():
    """A server whose first batch at each size runs 3x slower (as an eager `transformers` server on the H200 did:
    docs/hardware.md). measure at 1 and 8 on a fresh server: every step of its measured batch of 8 is a warm one, and
    its streams decode as fast as on the same server warm. Before, its one warm-up request ran at concurrency 1
    only: the single measured batch of 8 was the cold one (its streams at 0.36 of the warm rate)."""
    srv = SimServer(n_slots=8, cold_batch_factor=3.0, cold_batch_steps=8).start()
    try:
        rates = []
        for _ in range(2):  # fresh, then warm
            res = measure(srv.url, prompts=builtin_prompts("short"), n_requests=8, concurrencies=(1, 8), params=PARAMS,
                          warmup=1, watch_others=False)
            warm = [r for r in res.records if r.warmup]
            assert sorted(r.concurrency for r in warm) == [1] + [8] * 8, [r.concurrency for r in warm]
            at8 = [r for r in res.records if r.concurrency == 8 and not r.warmup and r.ok]
            assert len(at8) == 8
            rates.append(_stream_rate(at8))
            if not rates[1:]:
                # The server's own step log: no step of the measured batch of 8 is among the first 8 at that size.
                b8 = sorted(t0 for t0, _, kind, b, _ in srv.steps if kind == "decode" and b == 8)
                sent = min(r.t_send_ns for r in at8)
                assert sum(1 for t0 in b8 if t0 < sent) >= srv.cold_batch_steps, (len(b8), srv.cold_batch_steps)
    finally:
        srv.stop()
    fresh, again = rates
    # Cold it reads ~1/3; a loaded host's stalls move either by tens of percent at most.
    assert fresh > 0.6 * again, rates
