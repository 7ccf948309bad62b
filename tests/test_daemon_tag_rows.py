"""A tag window's energy against the interval rows over it: apart by up to a counter refresh's energy at an edge (docs/data.md, daemon_tags)."""

from __future__ import annotations

import pytest

from powerprof.daemon import tagedge
from powerprof.daemon.ledger import Ledger

from support import LedgerReading as R, RowSink as Sink  # noqa: E402

S = 1_000_000_000
POWER_W = 100.0
REFRESH_S = 0.02


def _counter_j(t_s: float) -> float:
    """One GPU at 100 W whose energy counter refreshes every 20 ms: a read shows its last refresh."""
    return POWER_W * (round(t_s * 1e6) // round(REFRESH_S * 1e6)) * REFRESH_S


def test_a_read_between_the_stop_call_and_the_next_refresh_puts_the_calls_last_joules_in_the_row_after_it():
    # tests/test_daemon_e2e.py held the tag to the rows inside it and the one its stop call falls in, and failed 1 run
    # in 25 beside two CPU hogs (0.77 J over them): a sample read 0.5 ms after the call still showed the refresh before
    # the call, so the rows put what the GPUs drew from that refresh to the call after the call's row, where the tag,
    # whose stop edge is the next refresh placed back to the call, rightly counts it.
    sink = Sink()
    led = Ledger("d", 0, 1, sink, grace_s=0.1)
    for t_s in (0.0, 0.25):
        led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(_counter_j(t_s), POWER_W)])
    start_s = 0.30  # its start edge: a counters-only read
    assert led.add_gpu_edge(int(start_s * S), int(start_s * S), [_counter_j(start_s)]) is not None
    led.open_tag("w", int(start_s * S), int(start_s * S), held=True)
    for t_s in (0.5, 0.75, 1.0):
        led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(_counter_j(t_s), POWER_W)])
    call_s, edge_s = 1.015, 1.021  # the stop call, 15 ms after the refresh at 1.000; its held edge after 1.020's
    led.add_gpu_sample(int(1.0155 * S), int(1.0155 * S), [R(_counter_j(1.0155), POWER_W)])  # still 1.000's value
    assert led.add_gpu_edge(int(edge_s * S), int(edge_s * S), [_counter_j(edge_s)]) is not None
    fresh = [tagedge.Refresh(int(1.02 * S), _counter_j(1.02))]  # the first refresh after the call, and the next
    after = [tagedge.Refresh(int(1.04 * S), _counter_j(1.04))]
    trim = tagedge.stop_trim_j((int(call_s * S),), (_counter_j(call_s),), fresh, after, (_counter_j(edge_s),))
    held_s = edge_s - call_s
    led.close_tag("w", int(edge_s * S), int(edge_s * S), stop_edge=tagedge.StopEdge(trim, held_s), held=True)
    for t_s in (1.25, 1.5):
        led.add_gpu_sample(int(t_s * S), int(t_s * S), [R(_counter_j(t_s), POWER_W)])
    led.advance(int(2.0 * S))
    (tag,) = sink.rows["tags"]
    assert tag["t_end_utc"] == pytest.approx(call_s * S, abs=1)
    assert tag["gpu_energy_j"] == pytest.approx(POWER_W * (call_s - start_s))  # the truth from its start to the call
    rows = sink.rows["intervals"]
    inside = sum(r["gpu_energy_j"] for r in rows if r["t_start_utc"] >= tag["t_start_utc"]
                 and r["t_end_utc"] <= tag["t_end_utc"])
    last = sum(r["gpu_energy_j"] for r in rows if r["t_start_utc"] < tag["t_end_utc"] < r["t_end_utc"])
    # the rows to the call's stop at the 1.0155 s read, which shows the counter at 1.000: 1.5 J short, of a 2 J refresh
    assert tag["gpu_energy_j"] - (inside + last) == pytest.approx(POWER_W * (call_s - 1.0))
    assert tag["gpu_energy_j"] - (inside + last) <= POWER_W * REFRESH_S
