"""A concurrent batch's achieved concurrency against the simulated server's truth: a batch whose streams decoded
apart (one sent late by a starved client) is marked, never stored as a figure at the concurrency it asked for."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

import powerprof.workload.load as load
from powerprof.arrival import fix_for, reason_group
from powerprof.sim.nvml import SimNVML
from powerprof.sim.server import SimServer
from powerprof.workload.client import RequestParams
from powerprof.workload.load import builtin_prompts, detect, run_load
from powerprof.workload.rows import ACHIEVED_CONCURRENCY_SHARE, MIN_TOGETHER_TOKENS_PER_STREAM, batch_problem, window_rows
from support import true_batch_figures


def true_mean_streams(truth: list[dict]) -> float:
    return true_batch_figures(truth)[1]


def _batch(monkeypatch, late_s: float):
    """One batch of three streams on the simulated server, the third sent `late_s` after the others (a client whose
    event loop was starved); its rows and the server's truth."""
    real = load.send_request

    async def late(*a, **kw):
        if kw["request_id"] == 2:
            await asyncio.sleep(late_s)
        return await real(*a, **kw)

    monkeypatch.setattr(load, "send_request", late)
    with SimServer(SimNVML("a100-40g", state_path=None), n_slots=4) as s:
        info = detect(s.url)
        recs = run_load(info, builtin_prompts("short"), 3, 3, RequestParams(max_tokens=48), warmup=0)
        truth = list(s.truth)
    assert all(r.ok for r in recs) and len(truth) == 3
    rows, (b,) = window_rows(recs, None, "run", info)
    (row,) = [r for r in rows if r["window_kind"] == "batch"]
    return row, recs, truth, b


def test_a_batch_whose_third_stream_was_sent_late_is_marked_not_stored_as_concurrency_3(monkeypatch):
    # Sent 0.3 s late into a ~0.6 s decode, the third stream decoded with the others for about half the time: the
    # batch's throughput was ~2 streams' (165 tok/s against ~234 at 3 on this card), and it was stored as
    # concurrency 3, stream-timed, with nothing said.
    row, recs, truth, b = _batch(monkeypatch, late_s=0.3)
    truth_tok_s, truth_mean = true_batch_figures(truth)
    # The arithmetic was right: what the streams delivered over the measured intervals; its label was not.
    # (Timed by a client in real time: starved of CPU beside a loaded suite it read the last tokens late, -7.9% once.)
    assert b.tok_s == pytest.approx(truth_tok_s, rel=0.12)
    assert truth_mean < ACHIEVED_CONCURRENCY_SHARE * 3  # the premise: the server really ran them apart
    assert row["concurrency"] == 3
    assert row["mean_streams"] == pytest.approx(truth_mean, abs=0.15)
    # No figure at a concurrency the batch did not have, whatever else was wrong with it.
    assert row["timing"] == "untrusted"
    assert row["decode_tok_s"] is None and row["gpu_j_per_token"] is None
    if all(batch_problem(r) is None for r in recs):  # (a loaded host can also leave a stream untimed: that reason wins)
        reason = row["timing_reason"]
        assert f"on average {row['mean_streams']:.1f} of 3 streams decoded at once" in reason, reason
        assert "starved" in fix_for(reason_group(reason)), fix_for(reason_group(reason))


def test_a_batch_sent_together_keeps_its_figure_and_says_its_concurrency(monkeypatch):
    row, recs, truth, _ = _batch(monkeypatch, late_s=0.0)
    assert row["mean_streams"] == pytest.approx(true_mean_streams(truth), abs=0.1)
    assert row["mean_streams"] >= ACHIEVED_CONCURRENCY_SHARE * 3
    if all(batch_problem(r) is None for r in recs):
        assert row["timing"] == "stream" and row["decode_tok_s"] > 0, row["timing_reason"]


def _ended_apart_batch(prompt_set: str):
    """One batch of four streams sent together to a server that gets no ignore_eos (the simulated vLLM taken for a TGI
    server: powerprof sends it neither ignore_eos nor min_tokens), so each stops at its own end-of-text; its row, its
    BatchWindow, its records and the server's truth."""
    with SimServer(SimNVML("a100-40g", state_path=None), n_slots=8, flavour="vllm") as s:
        info = dataclasses.replace(detect(s.url), kind="tgi")
        recs = run_load(info, builtin_prompts(prompt_set), 4, 4, RequestParams(max_tokens=64), warmup=0)
        truth = list(s.truth)
    assert all(r.ok for r in recs) and len(truth) == 4
    rows, (b,) = window_rows(recs, None, "run", info)
    (row,) = [r for r in rows if r["window_kind"] == "batch"]
    return row, b, recs, truth


def true_together_tok_s(truth: list[dict]) -> tuple[float, float]:
    """The server's own decode tok/s over the span where all the streams decode ([the last first emission, the first
    last one]), and the tokens it emitted there."""
    t0 = max(t["emissions"][0][0] for t in truth)
    t1 = min(t["emissions"][-1][0] for t in truth)
    tokens = sum(n for t in truth for te, n in t["emissions"][1:] if t0 < te <= t1)
    return tokens / ((t1 - t0) / 1e9), tokens


def test_a_batch_whose_streams_ended_apart_is_measured_where_all_of_them_decode():
    # The medium prompts stop at 22, 29, 39 and 49 tokens. Before, 2.9 of 4 streams decoded at once on average over
    # the batch, so it was left out, "one sent or started late (a client starved of CPU…)": wrong (they were sent
    # and started together), with fixes that could not help; on such a server nearly every batch was left out.
    row, b, recs, truth = _ended_apart_batch("medium")
    lengths = sorted(t["generated"] for t in truth)
    assert len(set(lengths)) == 4 and lengths[0] >= 20  # the premise: they stopped apart, all four for 20 tokens
    truth_tok_s, truth_tokens = true_together_tok_s(truth)
    if any(batch_problem(r) for r in recs):
        pytest.skip("a loaded host left a stream untimed (that reason wins); nothing to say of the batch's ends")
    # A figure at concurrency 4, the server's over the span where all four decoded (simulated A100: ~284 tok/s).
    assert row["timing"] == "stream", row["timing_reason"]
    assert row["concurrency"] == 4 and row["mean_streams"] >= ACHIEVED_CONCURRENCY_SHARE * 4
    assert row["decode_tok_s"] == pytest.approx(truth_tok_s, rel=0.05)
    # Its tokens: those of the span all four decode in, less what trimming a stale edge read cut off (a loaded host
    # delivered one late: 75 of 83, its rate still within 5%), never more than the span held.
    assert 0.85 * truth_tokens - 4 <= row["decode_tokens"] <= truth_tokens + 4, (row["decode_tokens"], truth_tokens)
    assert b.ended_apart


def test_a_batch_whose_streams_ended_apart_too_soon_says_so_and_the_right_fix():
    # The short prompts stop at 16, 29, 33 and 57 tokens: all four decode together for 15 tokens each, too few.
    row, b, recs, truth = _ended_apart_batch("short")
    assert min(t["generated"] for t in truth) < MIN_TOGETHER_TOKENS_PER_STREAM + 1  # the premise
    assert row["timing"] == "untrusted" and row["decode_tok_s"] is None and row["gpu_j_per_token"] is None
    if any(batch_problem(r) for r in recs):
        pytest.skip("a loaded host left a stream untimed (that reason wins); nothing to say of the batch's ends")
    reason = row["timing_reason"]
    assert "ended apart" in reason and "16, 29, 33, 57 tokens" in reason and "tgi" in reason, reason
    assert "late" not in reason and "starved" not in reason, reason
    fix = fix_for(reason_group(reason))
    assert "ignore_eos" in fix and "starved" not in fix, fix
    assert "ended apart" in reason_group(reason)


def test_a_batchs_method_is_not_named_by_a_trailing_piece_shorter_than_the_counters_refresh():
    # A 3 s batch plus a 30 ms trailing piece (a stream's stale last reads split it): the piece takes instant power
    # (shorter than the counter's refresh), and labelled the whole batch power_integration, low_confidence, its
    # tokens "on power" in measure's notes. Named by what holds its time: counter. A piece that holds a real share
    # of it still names its method.
    from powerprof.profiler import METHOD_COUNTER, METHOD_POWER, EnergyResult
    from powerprof.workload import rows

    class Stub:
        def energy_between(self, t0, t1):
            m = METHOD_POWER if t1 - t0 < 100_000_000 or t0 >= 10**10 else METHOD_COUNTER
            return EnergyResult(t0, t1, (300.0 * (t1 - t0) / 1e9,), (m,), None)

    S = 1_000_000_000
    gpu, _, method, *_ = rows._energy_over(Stub(), np.array([[0, 3 * S], [3 * S + 10**8, 3 * S + 13 * 10**7]]))
    assert method == METHOD_COUNTER and gpu == pytest.approx(909.0)
    _, _, method, *_ = rows._energy_over(Stub(), np.array([[0, 3 * S], [10**10, 10**10 + S]]))
    assert method == METHOD_POWER
