"""The daemon's attribution of streams held back on their way (a buffering hop: one burst at the end, or nginx's 4 kB
bursts) beside bypass traffic straight to the server that is steady, starts and stops, or comes in clumps, against the
simulator's truth (bench/buffered_bypass.py; docs/daemon.md, "A stream held back on its way"). The server's count in
a held span is the held streams' and the bypass traffic's together, and where the bypass traffic changes inside the
span nothing tells which part is whose: the figures may be off, and the rows must say so, never `complete` and wrong."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from buffered_bypass import run_case, score  # noqa: E402

# |requests' summed error|, |unproxied / bypass truth - 1| bounds per (delivery, bypass). Measured, two runs each on a
# loaded 2-core machine (vLLM, 40 chat and messages streams at 4/s beside ~1300-1850 J of bypass requests):
# one burst  steady -0.8/-5.8%, +2.0/+5.6%; starts and stops -8.0/-7.3%, +10.7/+11.0%; clumps -17.1/-18.6%, +25.1/+28.1%
# 4 kB       steady +0.6/+1.6%, +0.8/-0.5%; starts and stops -0.9/-4.0%, +4.7/+7.7%;  clumps -3.8/-6.1%, +5.3/+9.2%
# and a third run each, once windows of a burst's span whose pace the server's count contradicts say so (ledger):
# one burst -5.8%, +5.5%; -9.7%, +12.9%; -11.2%, +18.7%; 4 kB +1.8%, -0.8%; -2.1%, +4.7%; -2.8%, +8.0%.
# The bounds leave about half as much again: a guard against this getting worse, not a statement that it is good
# (the rows say they may be off: below).
BOUNDS = {
    ("one-burst", "steady"): (0.12, 0.12), ("one-burst", "onoff"): (0.15, 0.20), ("one-burst", "clumps"): (0.30, 0.40),
    ("4kB", "steady"): (0.06, 0.06), ("4kB", "onoff"): (0.10, 0.15), ("4kB", "clumps"): (0.12, 0.18),
}


@pytest.mark.slow
# Three of the six cases (23 s each; the bench runs all six): one burst beside each kind of bypass traffic, where the
# figures are furthest off, and 4 kB bursts beside traffic that starts and stops.
@pytest.mark.parametrize("delivery, case", [("one-burst", "steady"), ("one-burst", "clumps"), ("4kB", "onoff")])
def test_held_back_streams_beside_bypass_traffic_are_off_only_where_their_rows_say_so(tmp_path, delivery, case):
    s = run_case(delivery, case, data_dir=tmp_path)
    print(delivery, case, {k: v for k, v in s.items() if k != "worst_rows"})
    assert abs(s["conservation_err"]) <= 0.001, s
    req_bound, unproxied_bound = BOUNDS[(delivery, case)]
    assert abs(s["requests_err"]) <= req_bound, s
    assert abs(s["unproxied_err"]) <= unproxied_bound, s
    # No row off its truth by over 10% without a mark: every one says `approximate:` (its burst, with the fix), and
    # nearly all `proxy_lag` too (a bypass count that may be low or high: `analyze` leaves them out of J/token).
    # Measured: 17-32 of 40 rows off by over 10% (per-row median 8-24%, p95 24-63%; with no bypass traffic 10% and
    # 32%: short answers placed over their queue and prefill), none unmarked, 0-3 of them without `proxy_lag`.
    assert s["rows_off_unmarked"] == 0, s
    assert s["rows_off_no_lag_mark"] <= max(3, 0.25 * s["rows_off"]), s
    # The intervals that say `complete` hold their bypass count within a token and 5% of their count (what an unmarked
    # row keeps, plus what a scrape window spread over an interval's edge moves: bench/buffered_bypass.py), but for a
    # few tokens: measured 0-1 intervals of ~35, at most ~20 tokens of ~2000. One burst beside clumps left 0-5 intervals
    # a run, up to 81 of 2326 tokens (3.5%; a burst whose span the clump's pace left no room for, spread evenly and
    # unmarked: tests/test_daemon_bypass_lag.py); now those windows say `proxy_lag`: 0 intervals in 6 runs.
    share = 0.03
    assert s["complete_off_tokens"] <= share * s["bypass_tokens"], s


def _scored(tok_s: np.ndarray, windows_s: list[tuple[float, float]], edges_s: list[float], extra: dict) -> dict:
    """score() of a run of no requests: bypass tokens at `tok_s`, the server's count read over `windows_s` and spread
    evenly over each (the daemon's rule), intervals between `edges_s` all `complete`, `extra` tokens more in some."""
    ns = 1_000_000_000
    tok = np.sort((tok_s * ns).astype(np.int64))
    win = np.array([(int(a * ns), int(b * ns)) for a, b in windows_s], dtype=np.int64)
    rows = []
    for k, (a, b) in enumerate(zip(edges_s, edges_s[1:])):
        got = extra.get(k, 0.0)
        for w0, w1 in windows_s:
            n = float(((tok_s > w0) & (tok_s <= w1)).sum())
            got += n * max(0.0, min(b, w1) - max(a, w0)) / (w1 - w0)
        rows.append({"t_start_utc": pd.Timestamp(int(a * ns), tz="UTC"), "t_end_utc": pd.Timestamp(int(b * ns), tz="UTC"),
                     "server_tokens": got, "proxy_tokens": 0.0, "server_count": "complete"})
    o = SimpleNamespace(requests=pd.DataFrame({"true_j": [1.0], "gpu_energy_j": [1.0], "energy_note": [None]}),
                        intervals=pd.DataFrame(rows), bypass_tokens=tok, scrape_windows_ns=win, bypass_truth_j=1.0,
                        unproxied_j=1.0)
    return score(o)


def test_a_scrape_window_of_seconds_spread_over_an_interval_edge_is_the_daemons_rule_not_a_fault():
    # Bypass traffic at 185 tokens/s that stops at 1.0 s, scraped every 0.25 s until a scrape is 2 s late (a loaded
    # host; a failed GET waits 2 s): the daemon spreads that window's 46 tokens over its 2 s, 40 of them past the
    # interval edge at 1.0 s where none ran. The scorer allowed only what a 0.25 s window moves (at most 12): beside a
    # loaded suite and CPU hogs one `complete` interval of 7 runs of the test below read 60 bypass tokens for 26 so
    # (windows of 0.56-0.68 s), over its bound. What the daemon's rule moves in the run's own windows is now allowed.
    tok = np.arange(1, 186) / 185.0
    windows = [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 2.75), (2.75, 3.0)]
    s = _scored(tok, windows, [0.0, 1.0, 2.0, 3.0], {})
    assert s["intervals_complete_off"] == 0 and s["complete_off_tokens"] == 0, s
    # Tokens beyond that spread are still off: 20 more in the last interval (17 of the late window's spread there).
    s = _scored(tok, windows, [0.0, 1.0, 2.0, 3.0], {2: 20.0})
    assert s["intervals_complete_off"] == 1, s
    # Scraped on time, the 23 tokens the late window put in the middle interval are off: what is allowed is what the
    # run's own windows move, not a looser bound.
    on_time = [(k * 0.25, (k + 1) * 0.25) for k in range(12)]
    assert _scored(tok, on_time, [0.0, 1.0, 2.0, 3.0], {})["intervals_complete_off"] == 0
    assert _scored(tok, on_time, [0.0, 1.0, 2.0, 3.0], {1: 23.0})["intervals_complete_off"] == 1


@pytest.mark.slow
def test_a_burst_placed_where_bypass_traffic_winds_down_inside_its_span_says_so(tmp_path):
    # llama.cpp, one burst, steady bypass traffic that ends while the last streams are held: their bursts were placed at
    # the bypass pace of before their span (185 tokens/s where it fell to none), and the span's check allowed 5% of its
    # whole count, over what one window may hold unmarked. Before: 3 and 4 intervals `complete` with their bypass count
    # over its bound (32 and 34 of 1898 tokens; a window 34 of 17, one 8 of 0).
    s = run_case("one-burst", "steady", data_dir=tmp_path, flavour="llamacpp")
    print({k: v for k, v in s.items() if k != "worst_rows"})
    assert abs(s["conservation_err"]) <= 0.001, s
    # After: the windows of such a span say `proxy_lag`; measured 0 and 1 intervals left (0 and 5.5 tokens).
    assert s["intervals_complete_off"] <= 1 and s["complete_off_tokens"] <= 0.006 * s["bypass_tokens"], s


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "target not met in every run: 0-2 of 40 rows `proxy_lag` in 3 of 6 runs, 35 in the others, where the proxy's-lag "
    "test (docs/daemon.md, 'A server restart') goes 0.2-2 tokens over its bound on a window of under 60 tokens, or a "
    "4 kB stream at the run's start has its span over-said by the pace; a marked window marks every held row over it"))
@pytest.mark.parametrize("delivery", ["one-burst", "4kB"])
def test_held_back_streams_with_no_bypass_traffic_keep_most_rows_in_the_figures(tmp_path, delivery):
    # With no bypass traffic there is none to hide or make up: a row saying `proxy_lag` is left out of J/token for
    # nothing. Before: 35-40 of 40 rows in 5 runs (a burst's bypass pace read from windows other held streams still
    # held tokens of; tests/test_daemon_bypass_lag.py pins that at the ledger). The figures stay right either way.
    s = run_case(delivery, "none", data_dir=tmp_path)
    print(delivery, {k: v for k, v in s.items() if k != "worst_rows"})
    assert abs(s["conservation_err"]) <= 0.001, s
    assert s["rows_off_unmarked"] == 0 and s["intervals_complete_off"] == 0, s
    assert s["rows_lag_said"] <= 10, s
