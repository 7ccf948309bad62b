"""Energy over an interval from cumulative counters or power samples: pure functions over arrays."""

from __future__ import annotations

import numpy as np


def unwrap_resets(e_j: np.ndarray) -> np.ndarray:
    """Make a cumulative counter monotonic across resets (driver reload zeroes the GPU counter).

    After a drop the counter restarts near zero, so the energy between the last reading before
    and the first after is unknown; we add nothing for it, which undercounts at most one interval.
    """
    e = np.asarray(e_j, dtype=float)
    if e.size < 2:
        return e.copy()
    d = np.diff(e)
    drops = d < 0
    if not drops.any():
        return e.copy()
    # After a reset the new reading itself is energy since the reset: keep it, add what was lost.
    offsets = np.concatenate([[0.0], np.cumsum(np.where(drops, e[:-1], 0.0))])
    return e + offsets


def interp_at(t_ns: np.ndarray, y: np.ndarray, at_ns: float) -> float:
    """Linear interpolation of a cumulative series at an instant; NaN outside the sampled span."""
    t = np.asarray(t_ns, dtype=np.int64)
    if t.size == 0 or at_ns < t[0] or at_ns > t[-1]:
        return float("nan")
    # Work relative to the first point: int64 ns timestamps lose precision as float64 otherwise.
    return float(np.interp(float(at_ns - t[0]), (t - t[0]).astype(float), np.asarray(y, dtype=float)))


def epoch_broken(t_ns: np.ndarray, epoch: np.ndarray, t0_ns, t1_ns) -> np.ndarray:
    """Whether [t0, t1] reaches across a change of epoch (bumped whenever a counter delta was dropped).

    The reads used at the edges are the last at or before t0 and the first at or after t1. The
    energy of a dropped delta was never counted, so a difference across it would be a smaller,
    real-looking number: such a window is missing instead. Vectorised over t0/t1.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    ep = np.asarray(epoch)
    i = np.clip(np.searchsorted(t, t0_ns, side="right") - 1, 0, t.size - 1)
    j = np.clip(np.searchsorted(t, t1_ns, side="left"), 0, t.size - 1)
    return ep[i] != ep[j]


def counter_went_back(t_ns: np.ndarray, e_j: np.ndarray, t0_ns, t1_ns) -> bool:
    """Whether the counter fell anywhere between the reads used for [t0, t1] (see `epoch_broken`).

    A reset (driver reload) loses the energy between the last read before it and the reset, and a
    counter that steps back a little would, unwrapped, jump forward by everything it had counted:
    a difference across either is a wrong number, so such a window has no counter energy."""
    t = np.asarray(t_ns, dtype=np.int64)
    if t.size < 2:
        return False
    i = int(np.clip(np.searchsorted(t, t0_ns, side="right") - 1, 0, t.size - 1))
    j = int(np.clip(np.searchsorted(t, t1_ns, side="left"), 0, t.size - 1))
    return bool(j > i and (np.diff(np.asarray(e_j, dtype=float)[i : j + 1]) < 0).any())


def counter_energy_j(t_ns: np.ndarray, e_j: np.ndarray, t0_ns: int, t1_ns: int, epoch: np.ndarray | None = None) -> float:
    """Energy between two instants from a cumulative counter read at (or around) them.

    NaN across an epoch break (see `epoch_broken`) when the reads carry an epoch, where the
    counter fell between the reads used (`counter_went_back`), and where it did not move (`_stale_if_flat`).
    """
    if epoch is not None and np.size(t_ns) and epoch_broken(t_ns, epoch, t0_ns, t1_ns):
        return float("nan")
    if counter_went_back(t_ns, e_j, t0_ns, t1_ns):
        return float("nan")
    e = unwrap_resets(e_j)
    return _stale_if_flat(interp_at(t_ns, e, t1_ns) - interp_at(t_ns, e, t0_ns), t0_ns, t1_ns)


def _stale_if_flat(energy_j: float, t0_ns: int, t1_ns: int) -> float:
    """NaN for a counter difference of 0 J (or less) over a window of positive length: a GPU or CPU package never
    draws nothing, so the reads used held one refresh's value (a 55 ms window between two reads of a 100 ms
    refresh, on a loaded host). 0 J there is staleness, not energy: no counter figure, and the caller takes
    the power readings instead or says the window has none."""
    return float("nan") if t1_ns > t0_ns and not energy_j > 0 else float(energy_j)


# The start edge's power is measured from its read over at least this long (or up to the end edge's read, whichever
# comes first): the counter refreshes every 10-100 ms, so the slope between two reads a few ms apart is noise.
EDGE_POWER_BASE_NS = 200_000_000


def counter_window_energy_j(t_ns: np.ndarray, e_j: np.ndarray, t0_ns: int, t1_ns: int,
                            epoch: np.ndarray | None = None, period_ns: int = 0, phase_ns: int = 0) -> float:
    """Energy over a window whose start is a power step (a decode window: prefill or idle -> decode), from a
    cumulative counter read after each edge.

    The start edge's read lands a few ms after its event (16-66 ms on a loaded host), and a straight line from the
    read before (a tick up to a second earlier) charges the stretch [edge, read] the mean of both sides' power: the
    window came out low by (decode - prefill/idle power) x the delay. So the start's energy is placed from its read
    (the first at or after t0) with the power measured from that read onward, on the window's side of the step: over
    EDGE_POWER_BASE_NS, or up to the first read at or after t1. It stays between the reads either side (the counter
    only rises). With no read inside the window the straight line is all there is.

    The end edge keeps the straight line. Its mirror (the read after t1, less the power after the step times its
    delay) is right for a counter read fresh, but a counter read is up to one refresh old (10-100 ms): the read
    after the end then still holds part of the window, and the correction took that out too (+1.3% J/token at 3 s
    windows on a simulated H200, 100 ms refresh, reads 60 ms late). What the end leaves: docs/benchmarks.md, "Energy
    windows at power steps, on a loaded host". Given the counter's refresh grid (`counter_refresh_grid`: period_ns,
    phase_ns) both edges are placed from values dated at their own refresh (`_gridded_window_energy_j`) instead,
    where at least two values fall inside the window; with fewer (a 1 s window on a 100 ms refresh read late) the
    placement above, as without a grid (neither it nor the straight line between the dated values is right there:
    docs/benchmarks.md). NaN where `counter_energy_j` gives NaN, and where the placed figure is 0 J (`_stale_if_flat`)."""
    base = counter_energy_j(t_ns, e_j, t0_ns, t1_ns, epoch)
    if np.isnan(base):
        return base
    if period_ns > 0:
        gridded = _gridded_window_energy_j(t_ns, e_j, t0_ns, t1_ns, period_ns, phase_ns)
        if gridded is not None:
            return _stale_if_flat(gridded, t0_ns, t1_ns)
    t = np.asarray(t_ns, dtype=np.int64)
    e = unwrap_resets(e_j)
    i = int(np.searchsorted(t, t0_ns, side="left"))  # the start edge's read
    c = int(np.searchsorted(t, t1_ns, side="left"))  # the end edge's read
    if i >= c or c >= t.size or t[i] == t0_ns:
        return base
    m = min(int(np.searchsorted(t, t[i] + EDGE_POWER_BASE_NS, side="left")), c)
    p_w = (e[m] - e[i]) / (t[m] - t[i]) * 1e9
    e0 = e[i] - p_w * (t[i] - t0_ns) / 1e9
    if i > 0:
        e0 = max(e0, e[i - 1])
    return _stale_if_flat(interp_at(t, e, t1_ns) - min(e0, e[i]), t0_ns, t1_ns)


def _gridded_window_energy_j(t_ns, e_j, t0_ns: int, t1_ns: int, period_ns: int, phase_ns: int) -> float | None:
    """`counter_window_energy_j` on a known refresh grid: each read dated at its value's own instant
    (`counter_value_instants_ns`), so both edges are placed from the first and last values inside the window with
    the power measured inside it (over EDGE_POWER_BASE_NS), never past the values either side. None with fewer
    than two values inside: there is no power inside the window to place an edge with."""
    t = counter_value_instants_ns(t_ns, period_ns, phase_ns)
    e = unwrap_resets(e_j)
    keep = np.concatenate([[True], np.diff(t) > 0])  # reads of one refresh: its first
    t, e = t[keep], e[keep]
    ins = np.flatnonzero((t >= t0_ns) & (t <= t1_ns))
    if ins.size < 2:
        return None
    i, j = int(ins[0]), int(ins[-1])
    m = min(int(np.searchsorted(t, t[i] + EDGE_POWER_BASE_NS, side="left")), j)
    e0 = e[i] - (e[m] - e[i]) / (t[m] - t[i]) * (t[i] - t0_ns)
    e0 = min(max(e0, e[i - 1]) if i > 0 else e0, e[i])
    m = max(int(np.searchsorted(t, t[j] - EDGE_POWER_BASE_NS, side="right")) - 1, i)
    e1 = e[j] + (e[j] - e[m]) / (t[j] - t[m]) * (t1_ns - t[j])
    e1 = max(min(e1, e[j + 1]) if j + 1 < t.size else e1, e[j])
    return float(e1 - e0)


# The refresh periods tried by `counter_refresh_grid`: drivers refresh the counter every 10-100 ms (field notes), a
# real H200 every 100 ms (docs/hardware.md).
COUNTER_PERIODS_NS = (10_000_000, 20_000_000, 25_000_000, 50_000_000, 100_000_000)
GRID_STEP_NS = 1_000_000  # phases tried 1 ms apart: a refresh placed within 1 ms moves a window by < 0.1% at 1 s


def counter_value_instants_ns(t_ns: np.ndarray, period_ns: int, phase_ns: int) -> np.ndarray:
    """When each counter read's value was current: its last refresh at or before the read, on a grid of refreshes
    every `period_ns` from `phase_ns` (the read itself where period_ns is 0: a counter taken as fresh)."""
    t = np.asarray(t_ns, dtype=np.int64)
    return t if period_ns <= 0 else t - (t - phase_ns) % period_ns


def _bend(t_ns: np.ndarray, e_j: np.ndarray) -> float:
    """How far three reads in a row are off a straight line (|slope change| over slope sum), at its 30% quantile:
    at reads dated at their values' true instants, stretches of steady power give 0, and the quantile keeps out
    the triples across a power step (a window's edges)."""
    k = np.concatenate([[True], np.diff(t_ns) > 0])
    t, e = t_ns[k].astype(float), e_j[k]
    if t.size < 3:
        return float("nan")
    p1 = (e[1:-1] - e[:-2]) / (t[1:-1] - t[:-2])
    p2 = (e[2:] - e[1:-1]) / (t[2:] - t[1:-1])
    return float(np.quantile(np.abs(p1 - p2) / np.maximum(p1 + p2, 1e-300), 0.3))


def counter_refresh_grid(t_ns: np.ndarray, e_j: np.ndarray, margin: float = 1.0) -> tuple[int, int]:
    """(period_ns, phase_ns) of a cumulative counter's refresh grid, estimated from its reads: the grid on which the
    reads, each dated at its last refresh (`counter_value_instants_ns`), bend least (`_bend`). A read up to one
    refresh old dated at the read puts a power step's energy up to a refresh late, which a window's edges charge
    to the wrong side. Needs reads at random phases against the grid (a profiler's edge reads); (0, 0) where the
    reads cannot tell (too few, or no grid bends less than taking each read as fresh, or, with `margin` < 1, the
    best period's bend is not under `margin` times every other period's best: periods that fit about as well)."""
    t = np.asarray(t_ns, dtype=np.int64)
    e = unwrap_resets(e_j)
    if t.size < 8:
        return 0, 0
    rel = t - t[0]
    best = (_bend(rel, e), 0, 0)
    if not np.isfinite(best[0]):
        return 0, 0
    per_period = {0: best[0]}  # each period's least bend (0: every read taken as fresh)
    for period in COUNTER_PERIODS_NS:
        for phase in range(0, period, GRID_STEP_NS):
            b = _bend(counter_value_instants_ns(rel, period, phase), e)
            per_period[period] = min(per_period.get(period, b), b)
            if b < best[0]:
                best = (b, period, phase)
    b, period, phase = best
    if period and any(other < b / margin for p, other in per_period.items() if p not in (0, period)):
        return 0, 0
    return period, int((t[0] + phase) % period) if period else 0


def edge_read_delay_s(t_ns: np.ndarray, t0_ns: int, t1_ns: int) -> float:
    """How long after its edge the later of a window's two edge reads came: the first read at or after each edge
    (0 for an edge with no read after it)."""
    t = np.asarray(t_ns, dtype=np.int64)
    out = 0.0
    for edge in (t0_ns, t1_ns):
        k = int(np.searchsorted(t, edge, side="left"))
        if k < t.size:
            out = max(out, (int(t[k]) - edge) / 1e9)
    return out


def integrate_power_j(t_ns: np.ndarray, p_w: np.ndarray, t0_ns: int, t1_ns: int) -> float:
    """Trapezoid integral of power samples over [t0, t1], interpolating at the edges.

    NaN when the samples do not cover the interval: an extrapolated number would look exact.
    """
    t = np.asarray(t_ns, dtype=np.int64)
    p = np.asarray(p_w, dtype=float)
    ok = ~np.isnan(p)
    t, p = t[ok], p[ok]
    if t.size < 2 or t0_ns < t[0] or t1_ns > t[-1] or t1_ns < t0_ns:
        return float("nan")
    base = t[0]
    ts = (t - base).astype(float)
    a, b = float(t0_ns - base), float(t1_ns - base)
    inside = (ts > a) & (ts < b)
    xs = np.concatenate([[a], ts[inside], [b]])
    ys = np.concatenate([[np.interp(a, ts, p)], p[inside], [np.interp(b, ts, p)]])
    return _trapezoid(ys, xs) / 1e9


def instant_power_energy_j(t_ns: np.ndarray, p_w: np.ndarray, t0_ns: int, t1_ns: int,
                           after_event: np.ndarray | None = None) -> float:
    """Energy over the window [t0, t1] from instant power readings, for the profiler and the daemon alike.

    Power steps at events (a request's first token, its last, another request joining or leaving the batch),
    and a window's edges are events. A reading taken on demand right after an event (`after_event`: a window
    edge's read, 1-4 ms late) already shows the other side of its step; a straight line to it from the reading
    before (a 1 Hz tick up to a second earlier) spreads the step over that second. That took J/token 19% under
    the truth at 1 s decode windows and 33% at 0.3 s (simulated A100 without a counter: the read after the last
    token is idle power; bench/window_accuracy.py --steps, docs/benchmarks.md). So:

    - up to a reading taken after an event, the reading before holds (the step is at the event, just before it);
    - between other readings (periodic ticks, which land anywhere in the load) the straight line;
    - the window's own edges are held at the nearest reading inside it: the first for [t0, first], the last for
      [last, t1] (what the window drew, not what came before or after it).

    With no reading inside the window (its edge reads failed and no tick fell inside) the line between the
    readings either side is all there is. An interval between two periodic readings (the daemon's, where
    `after_event` is None) is the plain trapezoid. NaN when the readings do not reach both edges: an
    extrapolated number would look exact. A trailing average is not instant power: `trailing_average_energy_j`
    dates it first and interpolates it across the edges."""
    t = np.asarray(t_ns, dtype=np.int64)
    p = np.asarray(p_w, dtype=float)
    ev = np.zeros(t.size, bool) if after_event is None else np.asarray(after_event, dtype=bool)
    ok = ~np.isnan(p)
    t, p, ev = t[ok], p[ok], ev[ok]
    if t.size < 2 or t0_ns < t[0] or t1_ns > t[-1] or t1_ns < t0_ns:
        return float("nan")
    inside = (t >= t0_ns) & (t <= t1_ns)
    if not inside.any():
        return integrate_power_j(t, p, t0_ns, t1_ns)
    ts, ps, evs = t[inside] - t0_ns, p[inside], ev[inside]  # relative: int64 ns lose precision as float64
    # A step just before each reading taken after an event: the reading before holds up to it.
    steps = np.flatnonzero(evs[1:]) + 1
    ts = np.insert(ts, steps, ts[steps])
    ps = np.insert(ps, steps, ps[steps - 1])
    xs = np.concatenate([[0], ts, [t1_ns - t0_ns]]).astype(float)
    ys = np.concatenate([[ps[0]], ps, [ps[-1]]])
    return _trapezoid(ys, xs) / 1e9


def _trapezoid(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.trapezoid(y, x)) if hasattr(np, "trapezoid") else float(np.trapz(y, x))


def shift_average_power(t_ns: np.ndarray, window_s: float) -> np.ndarray:
    """A trailing-average reading describes the middle of its window: move it back by half."""
    return np.asarray(t_ns, dtype=np.int64) - int(window_s * 1e9 / 2)


def trailing_average_energy_j(t_ns: np.ndarray, p_avg_w: np.ndarray, window_s: float, t0_ns: int, t1_ns: int) -> float:
    """Energy over [t0, t1] from trailing-average power readings (nvmlDeviceGetPowerUsage: the mean of the
    `window_s` before each read), for the profiler and the daemon alike.

    Each reading is dated at the middle of its window (`shift_average_power`) and the shifted series is
    integrated; the last reading also speaks for the half-window from its shifted time to its read (it has
    seen it). Integrated unshifted, every interval takes the energy of half a window earlier: a request's
    energy lands after it. NaN without a window (window_s <= 0: the reading is instant power) or where the
    readings do not cover [t0, t1]."""
    t = np.asarray(t_ns, dtype=np.int64)
    y = np.asarray(p_avg_w, dtype=float)
    ok = ~np.isnan(y)
    t, y = t[ok], y[ok]
    if t.size < 2 or window_s <= 0:
        return float("nan")
    half = int(window_s * 1e9 / 2)
    t = shift_average_power(t, window_s)
    t, y = np.append(t, t[-1] + half), np.append(y, y[-1])
    return integrate_power_j(t, y, t0_ns, t1_ns)


def trailing_average_interval_energy_j(t_ns: np.ndarray, p_avg_w: np.ndarray, window_s: float, t0_ns: int,
                                       t1_ns: int) -> float:
    """Energy over [t0, t1] where a trailing-average reading was taken at t1 (the daemon's interval edges): that
    reading is the energy of the `window_s` before t1 over the window, so the interval's energy is it, less the
    part of the window before t0 (an interval shorter than the window) or plus the part of the interval before the
    window (a longer one), those parts from `trailing_average_energy_j`. An interval one window long (the daemon's
    1 Hz sampling of a 1 s average) is thus the reading itself: exact where the average is a true mean of its
    window. The shifted integration alone spreads each second's energy over three intervals (1/8, 3/4, 1/8): a
    short request alone left a quarter of its energy above idle in the idle seconds either side of it. NaN where
    there is no reading at t1 or the parts are not covered; never below zero (a part estimated too high)."""
    t = np.asarray(t_ns, dtype=np.int64)
    y = np.asarray(p_avg_w, dtype=float)
    at = np.flatnonzero((t == t1_ns) & ~np.isnan(y))
    if at.size == 0 or window_s <= 0 or t1_ns <= t0_ns:
        return float("nan")
    w_ns = int(window_s * 1e9)
    seen = float(y[at[-1]]) * window_s  # the energy of [t1 - window, t1]
    start = t1_ns - w_ns
    if start == t0_ns:
        return seen
    part = (trailing_average_energy_j(t, y, window_s, start, t0_ns) if start < t0_ns
            else trailing_average_energy_j(t, y, window_s, t0_ns, start))
    if np.isnan(part):
        return float("nan")
    return max(seen - part, 0.0) if start < t0_ns else seen + part


# The coarsest refresh of a GPU energy counter: drivers refresh it every 10-100 ms, and a real H200
# refreshed every 100 ms (docs/hardware.md). A card's own refresh is not known in advance.
COUNTER_STEP_S = 0.1
# Below this share a median's rounding is under the ~1% the counter resolves anyway (LOW_CONFIDENCE_S).
ROUNDING_TOL = 0.01
# Windows of L = R / (2 · tol) keep that rounding under tol: 5 s at a 100 ms refresh.
ROUNDED_WINDOW_S = COUNTER_STEP_S / (2 * ROUNDING_TOL)
# A level whose median counter-read decode window spans fewer refreshes than this is flagged short-windows whatever
# its median and pooled figures say: each window reads a whole number of refresh steps and its edges a few ms late
# (profiler.EDGE_BIAS_WINDOW_S), a bias every window shares, so neither the CI nor median vs pooled can see it. The
# simulated H200 (100 ms refresh) with --max-tokens 48: 0.3 s windows, each -3..-12% or +19..+24%, the level's
# median J/token and power 7-10% low with a +-1.2% CI. The refresh is the one the sweep estimated from the run's counter
# reads (profiler.EnergyTimeline.counter_refresh_s, levels.parquet counter_refresh_s); where none was (too few reads,
# a run written before the column) the coarsest drivers use, COUNTER_STEP_S, is assumed: 1 s.
SHORT_WINDOW_REFRESHES = 10
SHORT_COUNTER_WINDOW_S = SHORT_WINDOW_REFRESHES * COUNTER_STEP_S


def short_counter_window_s(refresh_s: float | None) -> float:
    """The median counter window under which a level is flagged short-windows: SHORT_WINDOW_REFRESHES refreshes of
    `refresh_s` (the estimated refresh, s), of COUNTER_STEP_S where it is unknown."""
    r = refresh_s if refresh_s is not None and np.isfinite(refresh_s) and refresh_s > 0 else COUNTER_STEP_S
    return SHORT_WINDOW_REFRESHES * r


def max_tokens_for_windows(tok_s: float) -> int:
    """The --max-tokens (a multiple of 64) that gives one request decoding at `tok_s` (its own rate, not the
    batch's) a ROUNDED_WINDOW_S window; 0 at no rate."""
    return int(np.ceil(ROUNDED_WINDOW_S * max(tok_s, 0.0) / 64) * 64)


def counter_rounding_bound(window_s: float) -> float:
    """Largest share by which the median J/token of decode windows about `window_s` long can miss
    the truth on a counter that moves in COUNTER_STEP_S steps: a window of k·R + f reads k or k + 1
    steps, and a median lands on one of the two instead of their mean, so up to R/(2L). The pooled
    figure (energy summed ÷ tokens summed) is not biased by it: the rounding averages out over the
    windows' phases against the refresh."""
    # No counter-read window (power integration only): nothing was rounded by a counter.
    return COUNTER_STEP_S / (2 * window_s) if np.isfinite(window_s) and window_s > 0 else 0.0


def within_prompt_offset(j_per_token: np.ndarray, prompts: np.ndarray) -> float:
    """Median of each window's J/token over its own prompt's mean, minus 1 (NaN without two windows of one
    prompt). Windows of one prompt (same greedy tokens, same length) differ only by noise and the counter's
    rounding, so this is off zero where the median sits on one rounding, but not where the median and the
    pooled mean differ because prompts differ in cost (the prompt mix: no rounding in that). Windows
    without a prompt id count as one prompt."""
    j = np.asarray(j_per_token, dtype=float)
    keys = np.array(["" if p is None else str(p) for p in prompts], dtype=object)
    ratios = []
    for key in set(keys):
        g = j[keys == key]
        if g.size >= 2 and np.mean(g) > 0:
            ratios.append(g / np.mean(g))
    return float(np.median(np.concatenate(ratios)) - 1) if ratios else float("nan")


def median_off_by_rounding(median: float, pooled: float, half_width: float, window_s: float,
                           prompt_offset: float = float("nan")) -> bool:
    """Whether a median J/token is off its pooled figure by more than its CI half-width (J/token;
    NaN: no CI) and ROUNDING_TOL, by no more than the counter's rounding of windows `window_s` long
    can explain: the median sits on one rounding of short windows and the CI cannot see it."""
    if not (np.isfinite(median) and np.isfinite(pooled)) or pooled <= 0:
        return False
    gap = abs(median - pooled) / pooled
    half = abs(half_width) / pooled if np.isfinite(half_width) else 0.0
    if not max(ROUNDING_TOL, half) < gap <= counter_rounding_bound(window_s):
        return False
    # The same gap within prompts (`within_prompt_offset`), or it is the prompt mix's, not the counter's.
    return not np.isfinite(prompt_offset) or abs(prompt_offset) > ROUNDING_TOL
