"""The daemon's request latency histograms, which the tuner judges the SLO by."""

from __future__ import annotations

import pytest

from powerprof.daemon.latency import RequestLatency


def test_ttft_and_tpot_from_a_streamed_request():
    lat = RequestLatency()
    lat.observe(0, 200_000_000, 1_200_000_000, 11, 50)  # first token at 0.2 s, ten more over 1 s
    s = lat.states()
    assert s["ttft_seconds"].n == 1 and s["ttft_seconds"].total == pytest.approx(0.2)
    assert s["tpot_seconds"].n == 1 and s["tpot_seconds"].total == pytest.approx(0.1)
    assert s["output_tokens"].n == 1 and s["prompt_tokens"].total == 50


def test_an_unseen_first_token_gives_no_ttft_rather_than_zero():
    # A non-streamed answer with no server timing: its tokens are spread from the arrival, so its
    # "first token" time is the arrival. A TTFT of 0 would meet any TTFT SLO; none is recorded.
    lat = RequestLatency()
    lat.observe(0, 0, 1_000_000_000, 11, 50, first_seen=False)
    s = lat.states()
    assert s["ttft_seconds"].n == 0
    assert s["tpot_seconds"].n == 1  # (an upper bound: the span includes the prefill)
