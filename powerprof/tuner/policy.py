"""The tuner's policy: from windows of live traffic to the next level, with the reason (pure functions and one state class).

The same object runs live (`tuner/runner.py`) and in virtual time on the simulator
(`bench/tuner_eval.py`); it never reads a clock, it is told the time. The algorithm is in
docs/tuner.md: a paired local search per traffic regime (measure the incumbent level, try one
neighbour for a dwell, keep it only if it saves at least `min_gain` J/token with the SLO's
headroom kept), a guard that backs off to the reference level at once when a window's p95
threatens the SLO, bounded exploration, and a memory per regime (arrival rate × length mix).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field, fields

import numpy as np

from powerprof.daemon.attribution import DEFAULT_PREFILL_PER_DECODE
from powerprof.daemon.latency import LATENCY_EDGES_S


BUCKET_ERROR = 0.13  # a quantile read from the daemon's latency buckets is within ±13% of the truth (daemon/latency.py)
# Longest a level waits for a window whose energy the daemon accounted at it (`Window.energy_straddles`) before its trial
# ends too thin to judge (or 4 windows, where longer): 5 times the daemon's longest hold (Ledger max_hold_s, 120 s: a
# non-streamed request's intervals; fixed, no daemon setting changes it, so nothing here to derive from a config), so
# held accounts catch up well before it and only accounts that stay behind end a trial.
ACCOUNTS_CATCH_UP_S = 600.0


class TunerConfigError(ValueError):
    """A bad [tuner] section: the message names the key and what is accepted."""


@dataclass(frozen=True)
class TunerConfig:
    """The [tuner] section once its levels are resolved to numbers (W, or MHz for knob = "clock")."""

    levels: tuple[float, ...]  # allowed levels, ascending
    reference: float  # where the guard, the kill switch and every fault go; one of `levels`
    tpot_p95_ms: float | None = None
    ttft_p95_ms: float | None = None
    knob: str = "power"  # power (limit in W) | clock (locked SM clock in MHz)
    tick_s: float = 10.0  # how often the runner reads the daemon (one Window per tick)
    window_s: float = 300.0  # a judgement needs this much traffic at one level…
    min_requests: int = 30  # …and this many finished requests (up to 4 windows are pooled)
    dwell_s: float = 300.0  # minimum time at a level before it is judged or left (the guard excepted)
    accept_ratio: float = 0.6  # a trial level is kept only with its p95 ≤ this × SLO (the tail of window p95s is ~1.7× their median)
    accept_windows: int = 3  # a trial whose p95 lands between accept_ratio and hold_ratio is judged again, up to this
    # many windows, and kept on their mean: one 5-minute p95 is a single noisy draw
    hold_ratio: float = 0.8  # a held level whose window p95 passes this × SLO goes one level up (the band is the hysteresis)
    guard_ratio: float = 1.0  # back off at once when the last guard_s's p95 exceeds this × SLO
    guard_s: float = 300.0  # the SLO's own window: shorter p95s swing far more than the SLO does
    guard_min_requests: int = 30
    guard_ticks: int = 1  # consecutive ticks over it before backing off
    trial_guard_s: float = 60.0  # a trial whose p95 over this long (with guard_min_requests) passes hold_ratio ends early
    hold_confirm: int = 2  # judgements in a row past hold_ratio before a held level moves up; one past the middle
    # of the hold_ratio–guard_ratio band, or with the work per second grown past hold_growth × what the level was
    # judged fine under, moves it at once (a growing load does not wait for a second window)
    hold_growth: float = 1.1
    trend_s: float = 1800.0  # the load's trend: work per second over the last trend_s against the trend_s before
    ramp_growth: float = 1.10  # past this the load is ramping (a diurnal rise), and while it ramps:
    rise_ratio: float = 0.8  # a level below the reference (held or measured) goes one up at any tick whose guard-window
    # p95 passes this × SLO: a rising load breaks a held level within minutes, before its next judgement
    steady_rise_ratio: float = 0.0  # the same tick rise whether or not the load ramps, at this × SLO (0: off; tenth
    # attempt, docs/tuner-evaluation.md: a held level below the oracle breaks on a burst between two judgements)
    steady_rise_bar: bool = False  # that rise also bars the level it leaves, as a back-off does (eleventh attempt)
    ramp_restore_above: int = 2  # a guard back-off restores this many levels above the one that broke (else 1)
    ramp_descend: bool = False  # no trial below (a level that passes now fails as the load keeps growing)
    # Tried in the sixth version and left off (docs/tuner-evaluation.md: no fewer windows beyond the tuning seeds' one):
    break_restore_above: int = 1  # a guard back-off on a p95 past the SLO by more than the buckets' error restores this
    # many levels above the one that broke (else one)
    drain_s: float = 0.0  # a trial below ended early: hold one level above its incumbent this long while its slow
    # requests drain, then the incumbent (0: straight back to the incumbent)
    trial_blame_s: float = 0.0  # a trial below ended early: a guard back-off at its incumbent within this long after is
    # charged to the trial's queue (already barred), not the incumbent: no strike, no bar (0: off; thirteenth attempt)
    # The early signal (off by default: docs/tuner-evaluation.md, seventh version): the requests in flight, which grow as soon
    # as the server falls behind, before any of them finishes late.
    queue_ratio: float = 0.0  # a level below the reference whose mean in flight over the last queue_s passes this ×
    # its usual (the median over its judged windows in the regime) goes one level up; a trial ends (0: off)
    queue_s: float = 300.0
    # Requests that never finish never reach the p95 the guard reads: a stalled server shows no violation at all. A
    # streamed request still waiting for its first token past stall_ttft_ratio × the TTFT SLO (2: at 1 the p95's
    # allowed few late requests fired it on 0.07–0.49% of ticks at levels that keep the SLO on the bench's traces, at
    # 2 on none; docs/tuner.md), or a stream silent past stall_tpot_ratio × the TPOT SLO (100: longer than any pause
    # of a working server's schedule), at a level below the reference, backs off at once (0: off).
    stall_ttft_ratio: float = 2.0
    stall_tpot_ratio: float = 100.0
    # The latency model (eighth attempt): per length mix, log(p95/SLO) against the level and log(work per second), fitted
    # from every judged window at any level (LatencyModel), and the load's trend extrapolated model_horizon_s ahead.
    model_descend: bool = False  # a held level tries the level below as soon as the model puts that one within
    # accept_ratio with model_z spreads to spare under the load expected (not while the load ramps, as any trial below)
    model_descend_trend_max: float = 1.0  # model descents only while the load's trend (load_growth) is at most this: a
    # flat or falling load (ninth attempt: a descent on a rising load that has not yet read as a ramp broke later)
    model_no_redescend: bool = False  # no model descent (nor a search it began) to a level left for the one above as too
    # slow within reprobe_s: a descent onto a level sent up minutes before broke it again (twelfth attempt; measured and
    # left off, docs/tuner-evaluation.md: a net window more for 0.3 points of J/token on 40 held-out seeds)
    model_skip: bool = False  # no trial below of a level seen in this length mix whose expected p95 is past accept_ratio
    model_rise: bool = False  # a level below the reference goes one up once the model puts it past hold_ratio under the
    # load expected (measured in the eighth attempt and left off: docs/tuner-evaluation.md)
    model_z: float = 1.0  # residual spreads of margin for a descent
    model_horizon_s: float = 600.0  # how far ahead the load's trend is extrapolated (0: the load now)
    model_min_windows: int = 8  # judged windows in the length mix before the model is used
    model_memory_s: float = 14400.0  # windows older than this are forgotten
    blame_ratio: float = 1.7  # the reference's own p95 during a back-off past this × its usual p95/SLO in the regime:
    # a burst, and the load, not the level, is blamed (1.7: the 90th percentile of 5-minute p95s over their median)
    strikes: int = 1  # back-offs at one level within strike_s before it is barred (below it too) for reprobe_s
    strike_s: float = 1800.0
    min_gain: float = 0.05  # a level above must save this share of J/token to be kept…
    max_loss: float = 0.10  # …a level below is kept unless it costs more than this share (docs/tuner.md: the prior;
    # 0.10: the 5th percentile of the change in J/work between consecutive 5-minute windows at one level is −9 to −10%)
    energy_pairs: int = 2  # paired comparisons an energy verdict rests on when the first refuses a trial below that kept
    # the SLO: 2 goes back to the incumbent for a fresh window, tries the level again and judges on the mean of the
    # two gains (1: one pair, the fifth version; fourteenth attempt, docs/tuner-evaluation.md: one pair's gain has a
    # standard deviation of 7.5–8.3 points against its true value, so a level truly 7% cheaper was refused past −10%)
    energy_pairs_up: bool = False  # …and when the first keeps a trial above on its saving (min_gain)
    prefill_weight: float = DEFAULT_PREFILL_PER_DECODE  # a prompt token's work in generated tokens
    max_step: int = 1  # levels per exploratory move
    max_explore_share: float = 0.5  # of the last explore_horizon_s spent on trials
    explore_horizon_s: float = 3600.0
    reprobe_s: float = 3600.0  # a converged regime re-tries its neighbours this often
    backoff_s: float = 120.0  # hold the reference this long after a back-off
    regime_ratio: float = 1.6  # regime bins: arrival rate and mean lengths in steps of this factor
    regime_margin: float = 0.5  # of a bin: a shift must go this far past the bin's edge
    regime_s: float = 300.0  # a shift must hold this long before the regime changes
    stale_s: float = 30.0  # no fresh daemon figures for this long: back to the reference
    dry_run: bool = False

    def __post_init__(self):
        errs = []
        lv = tuple(float(x) for x in self.levels)
        if len(lv) < 2 or any(b <= a for a, b in zip(lv, lv[1:])):
            errs.append("tuner.levels: want at least two distinct levels, ascending")
        if self.reference not in lv:
            errs.append(f"tuner.reference: {self.reference:g} is not one of the levels ({', '.join(f'{x:g}' for x in lv)})")
        if self.tpot_p95_ms is None and self.ttft_p95_ms is None:
            errs.append("tuner: set an SLO: tpot_p95_ms and/or ttft_p95_ms ([tuner] in the config, or --tpot-p95-ms / "
                        "--ttft-p95-ms, in milliseconds)")
        for k in ("tpot_p95_ms", "ttft_p95_ms"):
            v = getattr(self, k)
            if v is not None and not (math.isfinite(v) and v > 0):
                errs.append(f"tuner.{k}: must be a positive number of milliseconds")
        if self.knob not in ("power", "clock"):
            errs.append("tuner.knob: power or clock")
        for k in ("tick_s", "window_s", "dwell_s", "guard_s", "explore_horizon_s", "reprobe_s", "backoff_s",
                  "regime_s", "stale_s", "strike_s", "trial_guard_s", "trend_s", "model_memory_s"):
            if not getattr(self, k) > 0:
                errs.append(f"tuner.{k}: must be positive seconds")
        if not (self.queue_ratio == 0 or 1 < self.queue_ratio <= 10):
            errs.append("tuner.queue_ratio: 0 (off) or a ratio in (1, 10]")
        if not 0 < self.queue_s <= 30 * 86400 or (self.queue_ratio > 0 and self.queue_s > self.guard_s):
            errs.append("tuner.queue_s: positive seconds, at most guard_s (the queue is read from the guard's window)")
        if not (self.stall_ttft_ratio == 0 or 1 <= self.stall_ttft_ratio <= 10):
            errs.append("tuner.stall_ttft_ratio: 0 (off) or a ratio in [1, 10] (under 1 a request within the SLO would count)")
        if not (self.stall_tpot_ratio == 0 or 10 <= self.stall_tpot_ratio <= 1000):
            errs.append("tuner.stall_tpot_ratio: 0 (off) or a ratio in [10, 1000] (under 10 a working server's pause "
                        "would read as a stall)")
        if not 0 <= self.drain_s <= 30 * 86400:
            errs.append("tuner.drain_s: seconds, 0 (off) to 30 days")
        if not 0 <= self.trial_blame_s <= 30 * 86400:
            errs.append("tuner.trial_blame_s: seconds, 0 (off) to 30 days")
        if not 0 <= self.model_horizon_s <= 30 * 86400:
            errs.append("tuner.model_horizon_s: seconds, 0 (the load now) to 30 days")
        if not 0 <= self.model_z <= 5:
            errs.append("tuner.model_z: residual spreads in [0, 5]")
        if not 0.5 <= self.model_descend_trend_max <= 10:
            errs.append("tuner.model_descend_trend_max: a ratio in [0.5, 10]")
        if not 0 < self.accept_ratio <= self.hold_ratio <= self.guard_ratio:
            errs.append("tuner: want 0 < accept_ratio ≤ hold_ratio ≤ guard_ratio")
        if not 0 <= self.min_gain < 0.5 or not 0 <= self.max_loss < 0.5:
            errs.append("tuner.min_gain, tuner.max_loss: a share in [0, 0.5)")
        if not 0 <= self.max_explore_share <= 1:
            errs.append("tuner.max_explore_share: a share in [0, 1]")
        if not 1 <= self.blame_ratio <= 10 or not 1 <= self.hold_growth <= 10 or not 1 <= self.ramp_growth <= 10:
            errs.append("tuner.blame_ratio, tuner.hold_growth, tuner.ramp_growth: a ratio in [1, 10]")
        if not self.accept_ratio <= self.rise_ratio <= self.guard_ratio:
            errs.append("tuner.rise_ratio: want accept_ratio ≤ rise_ratio ≤ guard_ratio")
        if not (self.steady_rise_ratio == 0 or self.accept_ratio <= self.steady_rise_ratio <= self.guard_ratio):
            errs.append("tuner.steady_rise_ratio: 0 (off) or accept_ratio ≤ steady_rise_ratio ≤ guard_ratio")
        if min(self.max_step, self.min_requests, self.guard_min_requests, self.guard_ticks, self.strikes,
               self.hold_confirm, self.accept_windows, self.energy_pairs, self.ramp_restore_above,
               self.break_restore_above, self.model_min_windows) < 1 \
                or not 0 <= self.prefill_weight <= 10:
            errs.append("tuner.max_step, min_requests, guard_min_requests, guard_ticks, strikes, hold_confirm, "
                        "accept_windows, energy_pairs, ramp_restore_above, break_restore_above, model_min_windows: "
                        "at least 1; "
                        "0 ≤ prefill_weight ≤ 10")
        if self.energy_pairs > 4:
            errs.append("tuner.energy_pairs: 1 (off) to 4")
        if not self.regime_ratio > 1 or not 0 <= self.regime_margin < 1:
            errs.append("tuner.regime_ratio > 1 and 0 ≤ regime_margin < 1")
        if errs:
            raise TunerConfigError("; ".join(errs))
        object.__setattr__(self, "levels", lv)
        object.__setattr__(self, "reference", float(self.reference))

    @property
    def unit(self) -> str:
        return "W" if self.knob == "power" else "MHz"


# Keys of the [tuner] TOML section, besides `levels` (a spec the controller resolves) and `reference`.
CONFIG_KEYS = {f.name for f in fields(TunerConfig)} - {"levels", "reference"}


@dataclass(frozen=True)
class Window:
    """The traffic of one stretch at one level: counts summed, latency as histogram counts over LATENCY_EDGES_S
    (per bucket, the last one above the top edge), of the requests that finished in it."""

    t_end_s: float
    duration_s: float
    level: float
    tokens: float
    energy_j: float
    arrivals: int
    requests: int
    prompt_tokens: float  # summed over the finished requests
    output_tokens: float
    ttft_counts: tuple[int, ...]
    tpot_counts: tuple[int, ...]
    # The queue, every request in flight and not only those that finished: time integrals (request-seconds) of
    # the requests in flight and of those awaiting a first token, over queue_clock_s of the daemon's clock
    # (None: no figure). in_flight_s / queue_clock_s is the mean number in flight.
    in_flight_s: float | None = None
    awaiting_s: float | None = None
    queue_clock_s: float | None = None
    # Requests that have not finished, at the window's end (gauges, not sums; None: the daemon gives none): the
    # oldest streamed request's wait for its first token, and the longest silence of a stream past its first.
    oldest_awaiting_s: float | None = None
    longest_silence_s: float | None = None
    # Its energy was (partly) spent before its level was set: the daemon's energy accounts lag its tokens (a late
    # sampler, intervals held), so the guard reads it, the energy verdict leaves it out (`_judge`).
    energy_straddles: bool = False


def mean_in_flight(w: Window) -> tuple[float, float] | None:
    """(mean requests in flight, mean awaiting a first token) over the window; None without the figures."""
    if w.in_flight_s is None or w.awaiting_s is None or not w.queue_clock_s:
        return None
    return w.in_flight_s / w.queue_clock_s, w.awaiting_s / w.queue_clock_s


def merge(ws: list[Window]) -> Window:
    """Several windows as one (their level is the last one's: callers pool windows of one level)."""
    q = None if any(w.queue_clock_s is None or w.in_flight_s is None or w.awaiting_s is None for w in ws) else \
        (sum(w.in_flight_s for w in ws), sum(w.awaiting_s for w in ws), sum(w.queue_clock_s for w in ws))
    return Window(
        t_end_s=ws[-1].t_end_s,
        duration_s=sum(w.duration_s for w in ws),
        level=ws[-1].level,
        tokens=sum(w.tokens for w in ws),
        energy_j=sum(w.energy_j for w in ws),
        arrivals=sum(w.arrivals for w in ws),
        requests=sum(w.requests for w in ws),
        prompt_tokens=sum(w.prompt_tokens for w in ws),
        output_tokens=sum(w.output_tokens for w in ws),
        ttft_counts=tuple(int(x) for x in np.sum([w.ttft_counts for w in ws], axis=0)),
        tpot_counts=tuple(int(x) for x in np.sum([w.tpot_counts for w in ws], axis=0)),
        in_flight_s=q[0] if q else None, awaiting_s=q[1] if q else None, queue_clock_s=q[2] if q else None,
        oldest_awaiting_s=ws[-1].oldest_awaiting_s, longest_silence_s=ws[-1].longest_silence_s,  # now, not summed
        energy_straddles=any(w.energy_straddles for w in ws),
    )


def unfinished_threat(w: Window, cfg: TunerConfig, at_level_s: float = math.inf) -> tuple[str, float] | None:
    """Why requests that have not finished threaten the SLO at the window's end, with the worst one's wait or silence
    in seconds (None: none does, that SLO is not set, or the daemon gives no such figure). Only the time at the level
    in force counts (`at_level_s`): a request queued, or a stream paused, under the level before is not its doing."""
    if cfg.ttft_p95_ms is not None and cfg.stall_ttft_ratio > 0 and w.oldest_awaiting_s is not None:
        slo_s = cfg.ttft_p95_ms / 1000
        if min(w.oldest_awaiting_s, at_level_s) > cfg.stall_ttft_ratio * slo_s:
            return (f"a streamed request has waited {w.oldest_awaiting_s:.1f} s for its first token, unfinished "
                    f"({w.oldest_awaiting_s / slo_s:.0%} of the TTFT SLO)"), w.oldest_awaiting_s
    if cfg.tpot_p95_ms is not None and cfg.stall_tpot_ratio > 0 and w.longest_silence_s is not None:
        slo_s = cfg.tpot_p95_ms / 1000
        if min(w.longest_silence_s, at_level_s) > cfg.stall_tpot_ratio * slo_s:
            return (f"a stream has sent no token for {w.longest_silence_s:.1f} s, unfinished "
                    f"({w.longest_silence_s / slo_s:.0f}× the TPOT SLO; stalled past {cfg.stall_tpot_ratio:g}×)"), \
                w.longest_silence_s
    return None


def histogram_counts(values_s, edges=LATENCY_EDGES_S) -> tuple[int, ...]:
    """Per-bucket counts of `values_s` (the bench's exact latencies through the daemon's buckets)."""
    idx = np.searchsorted(np.asarray(edges), np.asarray(values_s, dtype=float), side="left")
    return tuple(int(x) for x in np.bincount(idx, minlength=len(edges) + 1))


def histogram_quantile(counts, q: float, edges=LATENCY_EDGES_S) -> float | None:
    """The q-quantile, linear within its bucket (as Prometheus's histogram_quantile); None without data.
    Above the top edge it answers the top edge: a floor, flagged by being the largest value possible."""
    c = np.asarray(counts, dtype=float)
    n = c.sum()
    if n <= 0:
        return None
    cum = np.cumsum(c)
    rank = q * n
    k = int(np.searchsorted(cum, rank, side="left"))
    if k >= len(edges):
        return float(edges[-1])
    lo = 0.0 if k == 0 else edges[k - 1]
    below = 0.0 if k == 0 else cum[k - 1]
    return float(lo + (edges[k] - lo) * ((rank - below) / c[k] if c[k] > 0 else 1.0))


def j_per_token(w: Window) -> float | None:
    return w.energy_j / w.tokens if w.tokens > 0 else None


def j_per_work(w: Window, prefill_weight: float) -> float | None:
    """Energy per unit of work, a prompt token counting `prefill_weight` of a generated one: what levels are
    compared by. J/token alone swings with the prompts that happen to fall in a window (docs/tuner.md)."""
    work = w.tokens + prefill_weight * w.prompt_tokens
    return w.energy_j / work if work > 0 else None


def slo_ratio(w: Window, cfg: TunerConfig, complete: bool = False) -> float | None:
    """The worst of p95 TTFT / its SLO and p95 TPOT / its SLO over the window (None without requests).

    complete: None unless every SLO set has a figure (to judge a level); otherwise the worst of those
    there are (for the guard, which acts on any breach it can see)."""
    worst = None
    for counts, slo_ms in ((w.tpot_counts, cfg.tpot_p95_ms), (w.ttft_counts, cfg.ttft_p95_ms)):
        if slo_ms is None:
            continue
        p = histogram_quantile(counts, 0.95)
        if p is None:
            if complete:
                return None
            continue
        r = p * 1000.0 / slo_ms
        worst = r if worst is None else max(worst, r)
    return worst


def predict_ratio(here: float, above: float | None = None) -> float:
    """The p95/SLO ratio expected one level below, from the ratio measured here and (when known) one level above:
    the step from above to here repeated (a geometric extrapolation: the tail grows at least as fast going
    down, as queueing compounds the slower step), never less than here, and × 1.25 when only here is known."""
    if above is None or above <= 0:
        return here * 1.25
    return here * max(here / above, 1.0)


class LatencyModel:
    """How a length mix's window p95 depends on the level and the load, from every judged window at any level.

    y = log(p95/SLO) against x = log(work per second), per level i: y = a_i + b_i x, each level's slope fitted
    on its own windows and shrunk towards the slope pooled over every level (a level seen at one load only has
    the pooled one), its offset the median of y − b_i x (robust to the odd burst). A level never seen is
    interpolated between the levels seen on either side of it, taken as fast as the highest seen above them all,
    and below them all the step between the two above it repeated (at least × 1.25); no level is predicted
    faster than the one above it. The residual spread is 1.4826 × the median absolute residual, blended with
    DEFAULT_SD while there are fewer than 20 windows, never under MIN_SD. Windows older than `memory_s` are
    dropped. Pure: it is told the time."""

    MAX_Y = math.log(4.0)  # a p95 four times the SLO or more is "far over": the top bucket's floor says no more
    MIN_SD = 0.10
    # A window p95's log spread about its level's line: 0.13–0.47 per level on the simulator's stationary trace
    # (docs/tuner-evaluation.md, eighth attempt).
    DEFAULT_SD = 0.30

    def __init__(self, memory_s: float, n_levels: int, shrink: float = 0.25):
        self.memory_s = memory_s
        self.n_levels = n_levels
        self.shrink = shrink  # Σ(x − x̄)² worth of the pooled slope in a level's own fit
        self.obs: deque[tuple[float, int, float, float]] = deque()  # (t, level index, x, y)
        self._fit: tuple | None = None

    def add(self, t: float, i: int, work_per_s: float, ratio: float) -> None:
        if not (work_per_s > 0 and ratio > 0 and math.isfinite(work_per_s) and math.isfinite(ratio)):
            return
        self.obs.append((t, i, math.log(work_per_s), min(math.log(ratio), self.MAX_Y)))
        self._fit = None
        self._expire(t)  # bounded by memory_s even when nothing reads it

    def _expire(self, t: float) -> None:
        while self.obs and self.obs[0][0] < t - self.memory_s:
            self.obs.popleft()
            self._fit = None

    def count(self, t: float, i: int | None = None) -> int:
        self._expire(t)
        return sum(1 for o in self.obs if i is None or o[1] == i)

    def fit(self, t: float) -> tuple[dict, float, float]:
        """({level: (offset, slope, windows)}, pooled slope, residual spread)."""
        self._expire(t)
        if self._fit is not None:
            return self._fit
        by: dict = {}
        for _, i, x, y in self.obs:
            by.setdefault(i, []).append((x, y))
        sxx = sxy = 0.0
        for pts in by.values():
            if len(pts) < 2:
                continue
            xs, ys = np.array(pts).T
            dx, dy = xs - xs.mean(), ys - np.median(ys)
            sxx += float(dx @ dx)
            sxy += float(dx @ dy)
        pooled = max(0.0, sxy / sxx) if sxx > 1e-9 else 1.0
        levels, res = {}, []
        for i, pts in by.items():
            xs, ys = np.array(pts).T
            dx = xs - xs.mean()
            b = max(0.0, (float(dx @ (ys - ys.mean())) + self.shrink * pooled) / (float(dx @ dx) + self.shrink))
            a = float(np.median(ys - b * xs))
            levels[i] = (a, b, len(pts))
            res.extend(ys - a - b * xs)
        n = len(res)
        mad = 1.4826 * float(np.median(np.abs(res))) if n else self.DEFAULT_SD
        # Few windows: their spread is not yet known; lean on the simulator's (shrunk away by 20 windows).
        sd = max(self.MIN_SD, (n * mad + max(0, 20 - n) * self.DEFAULT_SD) / max(n + max(0, 20 - n), 1))
        self._fit = (levels, pooled, sd)
        return self._fit

    def predict(self, t: float, i: int, work_per_s: float) -> tuple[float, float] | None:
        """(expected log(p95/SLO) at level `i` under this load, residual spread); None with no window at all."""
        levels, pooled, sd = self.fit(t)
        if not levels or not work_per_s > 0:
            return None
        x = math.log(work_per_s)
        known = {j: a + b * x for j, (a, b, _) in levels.items()}
        ks = sorted(known)
        mu: dict = {}
        for j in range(self.n_levels - 1, -1, -1):
            if j in known:
                m = known[j]
            elif j > ks[-1]:
                m = known[ks[-1]]  # above every level seen: taken as fast as the highest seen (it is no slower)
            elif j > ks[0]:  # between two levels seen: interpolated
                lo, hi = max(k for k in ks if k < j), min(k for k in ks if k > j)
                m = known[lo] + (known[hi] - known[lo]) * (j - lo) / (hi - lo)
            else:  # below every level seen: the step from the two above repeated, at least × 1.25
                step = mu[j + 1] - mu[j + 2] if j + 2 in mu else 0.0
                m = mu[j + 1] + max(step, math.log(1.25))
            mu[j] = max(m, mu.get(j + 1, -math.inf))  # a lower level is never faster
        return min(mu[i], self.MAX_Y), sd


def work_rate(key: tuple[int, ...], cfg: TunerConfig) -> float:
    """Work per second at a regime bin's centre: arrivals × (output + prefill_weight × prompt tokens)."""
    rate, prompt, output = (cfg.regime_ratio ** (k + 0.5) for k in key)
    return rate * (output + cfg.prefill_weight * prompt)


def regime_features(w: Window) -> tuple[float, float, float] | None:
    """(log arrival rate, log mean prompt tokens, log mean output tokens); None when too thin to say."""
    if w.duration_s <= 0 or w.arrivals <= 0 or w.requests <= 0:
        return None
    return (math.log(w.arrivals / w.duration_s), math.log(max(w.prompt_tokens / w.requests, 1.0)),
            math.log(max(w.output_tokens / w.requests, 1.0)))


def regime_key(feat: tuple[float, ...], ratio: float) -> tuple[int, ...]:
    step = math.log(ratio)
    return tuple(int(math.floor(f / step)) for f in feat)


def outside(feat: tuple[float, ...], key: tuple[int, ...], ratio: float, margin: float) -> bool:
    """True when the features lie beyond `key`'s bin by more than `margin` of a bin on some axis."""
    step = math.log(ratio)
    return any(f / step < k - margin or f / step > k + 1 + margin for f, k in zip(feat, key))


def describe_key(key: tuple[int, ...] | None, ratio: float) -> str:
    if key is None:
        return "unknown"
    lo = [ratio**k for k in key]
    return f"rate~{lo[0]:.2g}/s prompt~{lo[1]:.0f} out~{lo[2]:.0f}"


@dataclass(frozen=True)
class Decision:
    """One thing the tuner did or concluded. `to_level` equals `from_level` for verdicts that move nothing."""

    t_s: float
    action: str  # start | explore | accept | reject | backoff | restore | hold | regime | kill | stale | resume | thin
    from_level: float
    to_level: float
    reason: str
    regime: str
    j_per_token: float | None = None
    slo_ratio: float | None = None


@dataclass
class _LevelStat:
    j_per_token: float
    slo_ratio: float
    t_s: float
    j_per_work: float
    work_per_s: float = 0.0  # the traffic judged: (output + prefill_weight × prompt tokens) of its requests / s
    in_flight: float | None = None  # mean requests in flight over the judged windows (None: no figure)


@dataclass
class _Regime:
    key: tuple[int, ...] | None
    best: int | None = None  # index of the level to hold
    floor: int = 0  # lowest index not known to break the SLO
    floor_t: float = -math.inf  # when the floor was last raised
    bars: dict = field(default_factory=dict)  # index → (times found too slow, barred until): the floor's backoff
    ratios: dict = field(default_factory=dict)  # index → deque of (t, p95/SLO) judgements, for predictions
    queues: dict = field(default_factory=dict)  # index → deque of (t, mean in flight) of the same judgements

    def floor_at(self, t: float) -> int:
        """The lowest level above every level still barred at `t`."""
        return 1 + max((i for i, (_, until) in self.bars.items() if until > t), default=-1)

    def note(self, i: int, stat: _LevelStat) -> None:
        self.stats[i] = stat
        self.ratios.setdefault(i, deque(maxlen=12)).append((stat.t_s, stat.slo_ratio))
        if stat.in_flight is not None:
            self.queues.setdefault(i, deque(maxlen=12)).append((stat.t_s, stat.in_flight))

    def typical_in_flight(self, i: int, since_s: float) -> float | None:
        """The median of level `i`'s judged windows' mean requests in flight since `since_s`."""
        xs = [x for t, x in self.queues.get(i, ()) if t >= since_s]
        return float(np.median(xs)) if xs else None

    def typical_ratio(self, i: int, since_s: float) -> float | None:
        """The median p95/SLO of level `i`'s judgements since `since_s` (one window's p95 is a noisy draw)."""
        xs = [x for t, x in self.ratios.get(i, ()) if t >= since_s]
        return float(np.median(xs)) if xs else None
    rejected: dict = field(default_factory=dict)  # index → time a trial of it was rejected
    costly: dict = field(default_factory=dict)  # index → time a trial of it was rejected on energy (not too slow)
    strikes: dict = field(default_factory=dict)  # index → times the guard backed off from it
    sent_up: dict = field(default_factory=dict)  # index → last time it was left for a level above, as too slow
    stats: dict = field(default_factory=dict)  # index → latest _LevelStat
    converged_t: float | None = None
    reprobe_from: int | None = None  # the level a re-probe started from…
    quiet: int = 0  # …and how many re-probes in a row ended back there (each doubles the next interval)


class Tuner:
    """The state: current level, what it is doing (measure | trial | drain | hold | backoff | killed | stale), per-regime memory.

    Feed `observe(window)` one tick at a time (windows at one level: the caller splits at level
    changes); it returns the decisions of that tick (often none). `level` is where the knob
    should be. `kill()` pins the reference until `resume()`; `stale()` goes to the reference
    until figures come back."""

    def __init__(self, cfg: TunerConfig, t_s: float = 0.0):
        self.cfg = cfg
        self.ref = cfg.levels.index(cfg.reference)
        self.idx = self.ref
        self.state = "measure"
        self.since_s = t_s  # the current level's start
        self.state_since_s = t_s
        self.regimes: dict = {}
        self.regime = self._regime(None)
        self._cand_since = None
        self._recent: deque[Window] = deque()  # every level, for the regime features
        self._guard: deque[Window] = deque()  # the current level's last guard_s
        self._pending: list[Window] = []  # the current level's windows not yet judged
        self._incumbent: _LevelStat | None = None  # the baseline a trial is compared with
        self._incumbent_idx: int | None = None
        self._direction = -1
        self._up_tried = False
        self._threat_ticks = 0
        self._ref_threatened = False
        self._undo: tuple | None = None  # (floor, floor_t, best, bars) before the last back-off
        self._threat_idx: int | None = None  # the level the last back-off left
        self._early_end: tuple[float, int] | None = None  # (when, incumbent) of the last trial below ended early
        self._ref_typical: float | None = None  # the reference's median p95/SLO in the regime, at the last back-off
        self._trial_ratios: list[float] = []  # the trial's p95/SLO judgements so far
        self._repair: tuple[int, int, list[float]] | None = None  # (trial level, incumbent, energy gains so far): a
        # trial's energy verdict waiting for another pair (energy_pairs)
        self._stall_said = False  # an unfinished request's threat at the reference is recorded (once while it lasts)
        self._model_search = False  # the search in progress began with a model descent (until it holds or backs off)
        self._work: deque[tuple[float, float, float]] = deque()  # (t_end, duration, work) per tick, every level
        self._held_ok: list[_LevelStat] = []  # judgements of the current level within the holding band
        self._backoff_tail: list[Window] = []  # the reference's windows in the back-off's second half
        self._trials: deque[tuple[float, float]] = deque()  # (start, end) of trials
        self.models: dict = {}  # length mix (the regime key's prompt and output bins) → LatencyModel
        self._mix_since: float | None = None  # when the current length mix began (the load forecast reads from then)
        self.explore_s = 0.0  # total time spent on trials
        self.decisions: deque[Decision] = deque(maxlen=10_000)  # the latest, for callers; a live run keeps its dataset

    # --- what callers read ------------------------------------------------------------------

    @property
    def level(self) -> float:
        return self.cfg.levels[self.idx]

    @property
    def reference(self) -> float:
        return self.cfg.reference

    @property
    def regime_name(self) -> str:
        return describe_key(self.regime.key, self.cfg.regime_ratio)

    def progress(self, t: float) -> str:
        """What the level in force is doing and waits for, in one line: a live run says it between decisions (a
        judgement needs window_s of traffic and min_requests finished requests, which can take many minutes)."""
        cfg = self.cfg
        what = {"measure": "measuring", "trial": "trying", "hold": "holding", "drain": "draining at",
                "backoff": "backed off to", "killed": "pinned (kill switch) at", "stale": "without figures, at"}
        line = f"{what.get(self.state, self.state)} {self._fmt(self.level)} for {t - self.state_since_s:.0f} s"
        if self.state == "backoff":
            return f"{line}; back-off ends after {cfg.backoff_s:.0f} s"
        if self.state == "drain":
            return f"{line}; back to the incumbent after {cfg.drain_s:.0f} s"
        if self.state not in ("measure", "trial", "hold"):
            return line
        # The windows the next judgement pools (_judge): the first straddles the change, some wait for the accounts.
        usable = [w for w in self._pending[1:] if not w.energy_straddles]
        got = merge(usable) if usable else None
        held_s = got.duration_s if got else 0.0
        finished = got.requests if got else 0
        more = []
        if t - self.since_s < cfg.dwell_s:
            more.append(f"none before {cfg.dwell_s:.0f} s at the level")
        if got is not None and finished and slo_ratio(got, cfg, complete=True) is None:
            more.append("no latency figure yet for every SLO set")
        return (f"{line}; the next judgement has {held_s:.0f} s of traffic ({cfg.window_s:.0f} s needed) and "
                f"{finished} finished requests ({cfg.min_requests} needed)" + "".join(f"; {m}" for m in more))

    # --- inputs -----------------------------------------------------------------------------

    def observe(self, w: Window) -> list[Decision]:
        out: list[Decision] = []
        if self.state in ("killed",):
            return out
        if self.state == "stale":
            out.append(self._decide(w.t_end_s, "resume", self.idx, "daemon figures are back: hold the reference, then resume"))
            self._enter("backoff", w.t_end_s)
            self.since_s = w.t_end_s  # the back-off's hold counts from now
        if self.state == "trial":
            self.explore_s += w.duration_s
        self._work.append((w.t_end_s, w.duration_s, w.output_tokens + self.cfg.prefill_weight * w.prompt_tokens))
        while self._work and self._work[0][0] <= w.t_end_s - 2 * self.cfg.trend_s:
            self._work.popleft()
        self._track_regime(w, out)
        if out and out[-1].action == "regime" and self.state != "backoff":
            return out
        self._guard.append(w)
        while self._guard and self._guard[0].t_end_s <= w.t_end_s - self.cfg.guard_s:
            self._guard.popleft()
        g = merge(list(self._guard))
        ratio = slo_ratio(g, self.cfg) if g.requests >= self.cfg.guard_min_requests else None
        # Over half the guard's window, or at once when far over: a p95 of a few seconds of traffic swings widely.
        threat = ratio is not None and ratio > self.cfg.guard_ratio and (
            g.duration_s >= self.cfg.guard_s / 2 or ratio > 2 * self.cfg.guard_ratio)
        self._threat_ticks = self._threat_ticks + 1 if threat else 0
        if threat and self.state == "backoff":
            self._ref_threatened = True
        if self.state == "backoff" and self.idx == self.ref and w.t_end_s - w.duration_s >= \
                self.since_s + self.cfg.backoff_s / 2:
            # The back-off's second half: requests finishing in its first half were mostly served at the level left.
            self._backoff_tail.append(w)
        if self._threat_ticks >= self.cfg.guard_ticks and self.idx != self.ref:
            self._threatened(w.t_end_s, ratio, out)
            return out
        if self._unfinished(w, out):
            return out
        if self.state in ("hold", "measure") and ratio is not None and self.idx < self.ref \
                and ratio > self.cfg.rise_ratio and g.duration_s >= self.cfg.guard_s / 2:
            growth = self.load_growth(w.t_end_s)
            if growth is not None and growth > self.cfg.ramp_growth:
                self._rise(w.t_end_s, ratio, growth, out)
                return out
        if self.cfg.steady_rise_ratio > 0 and self.state in ("hold", "measure") and ratio is not None \
                and self.idx < self.ref and ratio > self.cfg.steady_rise_ratio and g.duration_s >= self.cfg.guard_s / 2:
            # Tenth attempt: a burst takes a held level past the band between two judgements; one level up now.
            if self.cfg.steady_rise_bar:
                # Eleventh: barred as a back-off would bar it, so the next re-probe does not go lower than it.
                self._bar(self.regime, self.idx, w.t_end_s)
            self._rise(w.t_end_s, ratio, None, out)
            return out
        if self.cfg.model_rise and self.state in ("hold", "measure") and self.idx < self.ref \
                and w.t_end_s - self.since_s >= self.cfg.guard_s / 2 and self._model_rise(w.t_end_s, out):
            return out
        if self.cfg.queue_ratio > 0 and self.idx < self.ref and self.state in ("hold", "measure", "trial"):
            if self._queue_threat(w.t_end_s, out):
                return out
        if self.state == "trial" and g.duration_s >= self.cfg.trial_guard_s and g.requests >= self.cfg.guard_min_requests:
            # A trial is a bet on headroom: a p95 already past the holding band ends it before it costs a window
            # over the SLO (a trial held for its whole dwell was the main source of those in the first descent).
            early = slo_ratio(g, self.cfg)
            if early is not None and early > self.cfg.hold_ratio:
                self._reject(w.t_end_s, out, f"p95 at {early:.0%} of the SLO after {g.duration_s:.0f} s (a trial "
                                             f"ends past {self.cfg.hold_ratio:.0%})", too_slow=True, early=True)
                return out
        self._pending.append(w)
        self._step(w.t_end_s, out)
        return out

    def load_growth(self, t: float, h: float | None = None) -> float | None:
        """Work per second over the last `h` (trend_s) against the `h` before it (None until both are seen)."""
        h = self.cfg.trend_s if h is None else h
        now = [(d, x) for te, d, x in self._work if te > t - h]
        before = [(d, x) for te, d, x in self._work if t - 2 * h < te <= t - h]
        dn, db = sum(d for d, _ in now), sum(d for d, _ in before)
        if dn < h / 2 or db < h / 2:
            return None
        wb = sum(x for _, x in before) / db
        return (sum(x for _, x in now) / dn) / wb if wb > 0 else None

    # --- the latency model (eighth attempt) ------------------------------------------------------

    def _model(self) -> LatencyModel | None:
        """The current length mix's model (None before the first regime is named)."""
        if self.regime.key is None:
            return None
        mix = self.regime.key[1:]
        if mix not in self.models:
            self.models[mix] = LatencyModel(self.cfg.model_memory_s, len(self.cfg.levels))
        return self.models[mix]

    def _note(self, r: _Regime, i: int, stat: _LevelStat) -> None:
        r.note(i, stat)
        if (m := self._model()) is not None and stat.work_per_s > 0:
            m.add(stat.t_s, i, stat.work_per_s, stat.slo_ratio)

    def load_expected(self, t: float) -> float | None:
        """The most work per second expected between now and model_horizon_s ahead: this length mix's mean over the
        last trend_s (at least guard_s/2 of it), which is the load trend_s/2 ago, carried forward at the load's trend
        (load_growth) when one is known: to now when it falls, to the horizon when it grows."""
        cfg = self.cfg
        h = cfg.trend_s
        since = self._mix_since if self._mix_since is not None else -math.inf
        now = [(d, x) for te, d, x in self._work if te > max(t - h, since)]
        dn = sum(d for d, _ in now)
        if dn < cfg.guard_s / 2:
            return None
        w = sum(x for _, x in now) / dn
        g = self.load_growth(t) if since <= t - 2 * h else None
        if g is None or not g > 0:
            return w
        return w * g ** ((h / 2 + (cfg.model_horizon_s if g > 1 else 0.0)) / h)

    def _model_predict(self, t: float, i: int, own: bool = False) -> tuple[float, float, float] | None:
        """(expected p95/SLO at level `i` under the load expected, its log spread, the load) from the current length
        mix's model once it has model_min_windows windows (and with `own`, one of level `i` itself); else None."""
        m = self._model()
        if m is None or m.count(t) < self.cfg.model_min_windows or (own and m.count(t, i) == 0):
            return None
        load = self.load_expected(t)
        if load is None:
            return None
        p = m.predict(t, i, load)
        return None if p is None else (math.exp(p[0]), p[1], load)

    def _model_safe(self, t: float, j: int) -> tuple[bool, str]:
        """Whether level `j` is expected within accept_ratio with model_z spreads to spare, and why."""
        p = self._model_predict(t, j)
        if p is None:
            return False, "no latency model yet"
        top = p[0] * math.exp(self.cfg.model_z * p[1])
        return top <= self.cfg.accept_ratio, (f"the latency model expects {self._fmt(self.cfg.levels[j])} at {p[0]:.0%} "
                                              f"of the SLO (×{math.exp(self.cfg.model_z * p[1]):.2f}: {top:.0%}) "
                                              f"under {p[2]:.0f} work/s")

    def _model_rise(self, t: float, out: list[Decision]) -> bool:
        """Feed-forward: the level expected past hold_ratio under the load expected goes one level up before its p95
        shows it (the regime's best with it); True when it moved."""
        p = self._model_predict(t, self.idx, own=True)
        if p is None or p[0] <= self.cfg.hold_ratio:
            return False
        r = self.regime
        r.best = self.idx + 1 if r.best is None else max(r.best, self.idx + 1)
        out.append(self._move(t, "backoff", self.idx + 1, f"the latency model expects p95 at {p[0]:.0%} of the SLO "
                                                          f"here under {p[2]:.0f} work/s (past {self.cfg.hold_ratio:.0%}): "
                                                          "one level up"))
        if self.state == "hold":
            r.converged_t = t
        self._enter(self.state, t)
        return True

    def _model_descend(self, t: float, stat: _LevelStat, out: list[Decision]) -> bool:
        """A held level, just judged within the band, tries the level below at once when the model expects that one
        within accept_ratio with model_z spreads to spare (the held judgement is the trial's incumbent)."""
        cfg, r = self.cfg, self.regime
        j = self.idx - cfg.max_step
        if j < 0 or j < r.floor_at(t) or stat.slo_ratio > cfg.hold_ratio or not self._budget_ok(t):
            return False
        if j in r.costly and t - r.costly[j] < cfg.reprobe_s:
            return False  # refused on energy lately: the model says nothing about that
        if self._sent_up_lately(j, t):
            return False  # left as too slow lately: its own p95 said so, whatever the model now expects
        g = self.load_growth(t)
        if not cfg.ramp_descend and g is not None and g > cfg.ramp_growth:
            return False  # no trial below while the load ramps (item 6), whatever the model says
        if g is not None and g > cfg.model_descend_trend_max:
            return False  # only on a flat or falling load: a rise not yet read as a ramp breaks the level later
        ok, why = self._model_safe(t, j)
        if not ok:
            return False
        if g is not None:
            why += f", the load ×{g:.2f} in {cfg.trend_s:g} s"
        r.rejected.pop(j, None)
        r.floor = r.floor_at(t)
        r.reprobe_from = self.idx
        self._incumbent, self._incumbent_idx = stat, self.idx
        self._direction, self._up_tried = -1, True
        out.append(self._move(t, "explore", j, f"try down one level: {why} (incumbent {stat.j_per_token:.3g} J/token)",
                              stat))
        self._trials.append((t, math.inf))
        self._enter("trial", t)
        self._trial_ratios = []
        self._model_search = True
        return True

    def _unfinished(self, w: Window, out: list[Decision]) -> bool:
        """The guard's view of requests that have not finished (`unfinished_threat`): below the reference, back to it at
        once (True); at the reference, nowhere to go: recorded once while it lasts, and during a back-off, when it began
        at the reference, the level left is not blamed."""
        t = w.t_end_s
        threat = unfinished_threat(w, self.cfg, t - self.since_s)
        if threat is None:
            self._stall_said = False
            return False
        why, worst_s = threat
        if self.idx != self.ref:
            self._threatened(t, None, out, what=why)
            return True
        if self.state == "backoff" and worst_s <= t - self.since_s:
            self._ref_threatened = True
        if not self._stall_said:
            self._stall_said = True
            out.append(self._decide(t, "hold", self.idx, f"SLO threatened: {why}; at the reference already: nowhere "
                                                         "to go"))
        return False

    def _sent_up_lately(self, j: int, t: float) -> bool:
        """model_no_redescend: level `j` was left for a level above, as too slow, within reprobe_s."""
        up = self.regime.sent_up.get(j)
        return self.cfg.model_no_redescend and up is not None and t - up < self.cfg.reprobe_s

    def _queue_threat(self, t: float, out: list[Decision]) -> bool:
        """The early signal: the mean in flight over the last queue_s at this level (at least half of it seen) past
        queue_ratio × its usual in this regime (a trial with no history of its own: its incumbent's). A held or
        measured level goes one level up, a trial ends as one found too slow; True when it acted."""
        cfg, r = self.cfg, self.regime
        recent = [w for w in self._guard if w.t_end_s > t - cfg.queue_s]
        if not recent or sum(w.duration_s for w in recent) < cfg.queue_s / 2:
            return False
        q = mean_in_flight(merge(recent))
        if q is None:
            return False
        usual = r.typical_in_flight(self.idx, t - cfg.reprobe_s)
        if usual is None and self.state == "trial" and self._incumbent_idx is not None:
            usual = r.typical_in_flight(self._incumbent_idx, t - cfg.reprobe_s)
        if usual is None or usual <= 0 or q[0] <= cfg.queue_ratio * usual:
            return False
        why = (f"{q[0]:.1f} requests in flight over the last {cfg.queue_s:g} s, {q[0] / usual:.1f}× this level's usual "
               f"{usual:.1f} (past {cfg.queue_ratio:g}×)")
        if self.state == "trial":
            self._reject(t, out, why, too_slow=True, early=True)
            return True
        r.best = self.idx + 1 if r.best is None else max(r.best, self.idx + 1)
        out.append(self._move(t, "backoff", self.idx + 1, f"queue growing: {why}: one level up"))
        if self.state == "hold":
            r.converged_t = t
        self._enter(self.state, t)
        return True

    def _rise(self, t: float, ratio: float, growth: float | None, out: list[Decision]) -> None:
        """A rising load (or, with growth None, steady_rise_ratio) has taken the level's p95 past rise_ratio: one level
        up now, the regime's best with it."""
        r = self.regime
        r.best = self.idx + 1 if r.best is None else max(r.best, self.idx + 1)
        why = (f"load rising: work per second ×{growth:.2f} on the {self.cfg.trend_s:g} s before, " if growth is not None
               else "")
        out.append(self._move(t, "backoff", self.idx + 1, f"{why}p95 at {ratio:.0%} of the SLO over the last "
                                                          f"{self.cfg.guard_s:g} s: one level up"))
        if self.state == "hold":
            r.converged_t = t
        self._enter(self.state, t)

    def note(self, t_s: float, action: str, reason: str) -> Decision:
        """Record something the caller did at the current level (the start, say)."""
        return self._decide(t_s, action, self.idx, reason)

    def energy_basis_changed(self, t_s: float, why: str) -> list[Decision]:
        """The daemon re-decided which GPUs serve the traffic (`why` says how): a GPU's idle energy came into the
        figure the levels are weighed by, or left it, so energy judged before is on another basis than energy after.
        The windows at this level so far are left out of its energy verdict (the caller leaves out the one straddling
        the change); every regime's energy memory goes (each level's last figures, the levels refused on energy, a
        trial's pairs waiting for another), so no level judged before is weighed against one judged after; what was
        learnt of latency (too slow, bars, p95 models) stands, as the basis moves no latency. A trial, whose incumbent
        was judged on the other basis, ends back at the incumbent without a verdict (`thin`); otherwise a `hold` row
        says it."""
        self._pending = [dataclasses.replace(w, energy_straddles=True) for w in self._pending]
        self._repair = None
        for r in {id(x): x for x in (*self.regimes.values(), self.regime)}.values():
            r.stats.clear()
            for i, at in list(r.costly.items()):
                if r.rejected.get(i) == at:  # refused on energy alone: that verdict was on the old basis
                    del r.rejected[i]
            r.costly.clear()
        if self.state == "killed":
            return []  # pinned: no window is judged, so none is left out (resume measures afresh)
        if self.state == "trial":
            back = self._incumbent_idx if self._incumbent_idx is not None else self.ref
            self._end_trial(t_s)
            d = self._move(t_s, "thin", back, f"{why}: the trial's energy cannot be weighed against "
                                              f"{self._fmt(self.cfg.levels[back])}'s, judged on the other basis: back "
                                              "to it, to measure both again")
            self._enter("measure", t_s)
            return [d]
        return [self._decide(t_s, "hold", self.idx, f"{why}: this window and the ones before it at this level are "
                                                     "left out of its energy verdict, and every level's energy "
                                                     "figures judged before are forgotten, to be measured again")]

    def kill(self, t_s: float, why: str = "kill switch (SIGUSR1)") -> Decision:
        d = self._move(t_s, "kill", self.ref, why + ": back to the reference and hold")
        self._enter("killed", t_s)
        return d

    def resume(self, t_s: float) -> Decision:
        d = self._decide(t_s, "resume", self.idx, "resumed: measure from here")
        self._enter("measure", t_s)
        return d

    def stale(self, t_s: float, why: str) -> Decision | None:
        """No trustworthy figures (daemon down, metrics stalled): back to the reference until they return."""
        if self.state in ("stale", "killed"):
            return None
        d = self._move(t_s, "stale", self.ref, why + ": back to the reference until figures return")
        self._enter("stale", t_s)
        return d

    # --- the machine ------------------------------------------------------------------------

    def _step(self, t: float, out: list[Decision]) -> None:
        cfg = self.cfg
        r = self.regime
        if self.state == "drain":
            if t - self.since_s >= cfg.drain_s:
                out.append(self._move(t, "restore", self._incumbent_idx, "the ended trial's slow requests have drained: "
                                                                         "back to the incumbent"))
                self._enter("measure", t)
            return
        if self.state == "backoff":
            if t - self.since_s >= cfg.backoff_s:
                tail = merge(self._backoff_tail) if self._backoff_tail else None
                tail_ratio = slo_ratio(tail, cfg) if tail and tail.requests >= cfg.guard_min_requests else None
                if tail_ratio is not None and self._ref_typical is not None \
                        and tail_ratio > cfg.blame_ratio * self._ref_typical:
                    # The reference itself far slower than it usually is in this regime: a burst. (Over the SLO it
                    # could only show after half the guard's window, longer than the back-off: on steady traffic
                    # that test alone never fired.)
                    self._ref_threatened = True
                if self._ref_threatened and self._undo is not None:
                    # The reference broke the SLO too: the load did it, not the level; keep what was learnt.
                    r.floor, r.floor_t, r.best, r.bars = self._undo
                    out.append(self._decide(t, "hold", self.idx, "the reference was over the SLO too during the "
                                                                 "back-off: the load, not the level, is blamed"))
                self._undo, self._ref_threatened = None, False
                target = r.best if r.best is not None and r.best >= r.floor else None
                if target is not None and target != self.idx:
                    out.append(self._move(t, "restore", target, "back-off over: return to the regime's best level"))
                    self._enter("hold", t)
                    r.converged_t = t
                else:
                    self._enter("measure", t)
            return
        if self.state == "hold":
            if r.converged_t is not None and t - r.converged_t >= cfg.reprobe_s * 2 ** min(r.quiet, 2):
                r.rejected.clear()
                self._up_tried = False
                r.reprobe_from = self.idx
                self._enter("measure", t)
            else:
                # Held levels are judged too: headroom shrinking as the load grows moves one level up
                # (the band between accept_ratio and the guard is the hysteresis).
                stat = self._judge(t, out)
                if stat is not None:
                    self._note(r, self.idx, stat)
                    over = self._over_hold(r, stat)
                    if not over and stat.slo_ratio <= cfg.hold_ratio:
                        self._held_ok.append(stat)
                    if over and self.idx < len(cfg.levels) - 1:
                        r.best = self.idx + 1
                        out.append(self._move(t, "backoff", self.idx + 1,
                                              f"p95 at {stat.slo_ratio:.0%} of the SLO, above the {cfg.hold_ratio:.0%} "
                                              "a held level may reach: one level up", stat))
                        r.converged_t = t
                    elif cfg.model_descend and not over:
                        self._model_descend(t, stat, out)
                return
        judged = self._judge(t, out)
        if judged is None:
            return
        stat = judged
        self._note(r, self.idx, stat)
        if stat.slo_ratio <= cfg.hold_ratio:
            self._held_ok.append(stat)
        if self.state == "measure":
            # The level in force is judged against the holding band; only trials must show the full headroom.
            if stat.slo_ratio > cfg.hold_ratio and self.idx < len(cfg.levels) - 1:
                self._bar(r, self.idx, t)
                if r.best is not None and r.best <= self.idx:
                    r.best = None
                out.append(self._move(t, "backoff", self.idx + 1,
                                      f"p95 at {stat.slo_ratio:.0%} of the SLO, above the {cfg.hold_ratio:.0%} a held level "
                                      "may reach: one level up", stat))
                self._enter("measure", t)
                return
            self._incumbent, self._incumbent_idx = stat, self.idx
            if r.best is None or stat.slo_ratio <= cfg.accept_ratio:
                r.best = self.idx
            if self._repair is not None:
                j, inc, gains = self._repair
                g = self.load_growth(t)
                if inc == self.idx and j >= r.floor_at(t) and self._budget_ok(t) \
                        and not (j < inc and not cfg.ramp_descend and g is not None and g > cfg.ramp_growth):
                    self._start_trial(t, j, out, f"pair {len(gains) + 1} of its energy verdict")
                    return
                self._repair = None
            self._next_trial(t, out)
            return
        if self.state == "trial":
            inc = self._incumbent
            gain = 1.0 - stat.j_per_work / inc.j_per_work if inc and inc.j_per_work > 0 else 0.0
            self._trial_ratios.append(stat.slo_ratio)
            seen = float(np.mean(self._trial_ratios))
            if cfg.accept_ratio < seen and stat.slo_ratio <= cfg.hold_ratio \
                    and len(self._trial_ratios) < cfg.accept_windows and self._budget_ok(t):
                # Within the holding band: one window's p95 is a noisy draw; judge again, on the mean.
                return
            ok = seen <= cfg.accept_ratio
            n = len(self._trial_ratios)
            p95 = f"{seen:.0%} of the SLO" + (f" (mean of {n} windows)" if n > 1 else "")
            down = self.idx < self._incumbent_idx
            need = -cfg.max_loss if down else cfg.min_gain
            pairs = self._repair[2] if self._repair is not None and self._repair[:2] == (self.idx, self._incumbent_idx) \
                else []
            if ok and pairs:
                gain = float(np.mean(pairs + [gain]))
            if ok and (gain < need) == down and (down or cfg.energy_pairs_up) and len(pairs) + 1 < cfg.energy_pairs \
                    and self._budget_ok(t):
                # The verdict rests on energy alone (a level below kept the SLO but costs more, or one above saves):
                # one pair's gain is a noisy draw. Back to the incumbent for a fresh window, then this level again.
                verdict = (f"costs {-gain:.1%} more, past the {cfg.max_loss:.0%} allowed" if down
                           else f"saves {gain:.1%}, past the {cfg.min_gain:.0%} needed")
                self._repair = (self.idx, self._incumbent_idx, pairs + [gain])
                self._end_trial(t)
                out.append(self._move(t, "explore", self._incumbent_idx,
                                      f"{self._fmt(cfg.levels[self.idx])} {verdict} on {len(pairs) + 1} pair(s) of "
                                      f"windows: back to {self._fmt(cfg.levels[self._incumbent_idx])} to pair them "
                                      "again before the energy verdict", stat))
                self._enter("measure", t)
                return
            self._repair = None
            n_pairs = f" (mean of {len(pairs) + 1} pairs)" if ok and pairs else ""
            if ok and gain >= need:
                out.append(self._decide(t, "accept", self.idx,
                                        f"{gain:+.1%} J/token saved against {self._fmt(cfg.levels[self._incumbent_idx])}"
                                        f"{n_pairs}, p95 at {p95}", stat))
                r.best = self.idx
                self._incumbent, self._incumbent_idx = stat, self.idx
                self._end_trial(t)
                self._enter("measure", t, keep_pending=True)
                self._next_trial(t, out)
                return
            why = (f"p95 at {p95} (keep ≤ {cfg.accept_ratio:.0%})" if not ok
                   else f"saves {gain:+.1%} J/token{n_pairs}, under the {need:+.0%} needed")
            self._reject(t, out, why, too_slow=not ok, stat=stat)

    def _reject(self, t: float, out: list[Decision], why: str, too_slow: bool, stat: _LevelStat | None = None,
                early: bool = False) -> None:
        """End the trial in force: back to its incumbent; a level below it found too slow is barred. A trial below
        ended early (`early`) leaves slow requests queued: with drain_s, one level above the incumbent drains them."""
        r, cfg = self.regime, self.cfg
        self._repair = None
        down = self.idx < self._incumbent_idx
        if too_slow and down:
            self._bar(r, self.idx, t)
        r.rejected[self.idx] = t
        if not too_slow:
            r.costly[self.idx] = t
        back = self._incumbent_idx
        drain = early and down and cfg.drain_s > 0 and back < self.ref  # never above the reference
        if drain:
            # The trial's queue finishes at the incumbent otherwise: its slow requests still broke the SLO window, and
            # could make the incumbent's own guard fire minutes later (docs/tuner-evaluation.md, sixth version).
            back += 1
            why += f"; {self._fmt(cfg.levels[back])} for {cfg.drain_s:g} s while its slow requests drain"
        self._end_trial(t)
        self._early_end = (t, back) if early and down and not drain else None
        out.append(self._move(t, "reject", back, f"trial rejected: {why}", stat))
        self._enter("drain" if drain else "measure", t)
        if self._direction < 0:
            self._direction = +1
        else:
            self._up_tried = True

    def _judge(self, t: float, out: list[Decision]) -> _LevelStat | None:
        """A judgement once the level has been held for its dwell and the pooled windows are enough."""
        cfg = self.cfg
        if t - self.since_s < cfg.dwell_s:
            return None
        # The first window straddles the change; so does any whose energy the daemon accounted from before it.
        usable = [w for w in self._pending[1:] if not w.energy_straddles]
        if not usable:
            # Every window since the move has energy the daemon accounted from before it. Its accounts catch up within
            # their holds (Ledger max_hold_s, 120 s at most); ever further behind (an accounting step failing at every pass), this waited
            # for ever: a trial held its level with no decision and no word, every window kept (200 ticks, 197).
            waited_s = sum(x.duration_s for x in self._pending[1:])
            if waited_s >= max(4 * cfg.window_s, ACCOUNTS_CATCH_UP_S):
                self._thin(t, out, f"no window in {waited_s:.0f} s had its energy accounted at this level (the "
                                   "daemon's energy accounts stay behind it: powerprof_accounts_behind_seconds): "
                                   "cannot judge")
            return None
        w = merge(usable)
        if w.duration_s < cfg.window_s:
            return None
        # Every configured SLO needs its own figure: a missing p95 (one-token answers, no first token seen)
        # cannot be judged, and is never taken as 0% of the SLO.
        ratio = slo_ratio(w, cfg, complete=True)
        if w.requests < cfg.min_requests or w.tokens <= 0 or ratio is None:
            if w.duration_s < 4 * cfg.window_s:
                return None
            self._thin(t, out, f"only {w.requests} requests in {w.duration_s:.0f} s: too little to judge"
                               if w.requests < cfg.min_requests or w.tokens <= 0
                               else f"no latency figure for every SLO set in {w.duration_s:.0f} s: cannot judge")
            return None
        self._pending = self._pending[-1:]
        q = mean_in_flight(w)
        return _LevelStat(w.energy_j / w.tokens, ratio, t, j_per_work(w, cfg.prefill_weight) or w.energy_j / w.tokens,
                          (w.output_tokens + cfg.prefill_weight * w.prompt_tokens) / w.duration_s,
                          q[0] if q is not None else None)

    def _thin(self, t: float, out: list[Decision], why: str) -> None:
        """What the level held has not been enough to judge for 4 windows: a trial ends back at the level before it
        (`why` its decision's reason); the windows are let go in any state."""
        self._pending = self._pending[-1:]
        if self.state == "trial":
            back = self._incumbent_idx if self._incumbent_idx is not None else self.ref
            self._end_trial(t)
            out.append(self._move(t, "thin", back, why))
            self._enter("hold", t)
            self.regime.converged_t = t

    def _next_trial(self, t: float, out: list[Decision]) -> None:
        cfg, r = self.cfg, self.regime
        r.floor = r.floor_at(t)
        skipped = ""
        for d in (self._direction, -self._direction):
            if d > 0 and self._up_tried:
                continue
            j = self.idx + d * cfg.max_step
            j = max(0, min(len(cfg.levels) - 1, j))
            known = r.stats.get(j)
            mine = r.stats.get(self.idx)
            # Memory: a level above measured recently at more energy per unit of work needs no new trial.
            costlier = (d > 0 and known is not None and mine is not None and t - known.t_s < cfg.reprobe_s
                        and known.j_per_work >= mine.j_per_work * (1 - cfg.min_gain))
            if j == self.idx or j < r.floor or costlier or (j in r.rejected and t - r.rejected[j] < cfg.reprobe_s):
                if d > 0:
                    self._up_tried = True
                continue
            if d < 0 and self._model_search and self._sent_up_lately(j, t):
                # A search the model began goes no further down than its own first step could.
                skipped = f"{self._fmt(cfg.levels[j])} not tried: left as too slow within {cfg.reprobe_s:g} s"
                continue
            if d < 0 and not cfg.ramp_descend and (g := self.load_growth(t)) is not None and g > cfg.ramp_growth:
                skipped = f"{self._fmt(cfg.levels[j])} not tried: the load is ramping (×{g:.2f} in {cfg.trend_s:g} s)"
                continue
            if d < 0 and cfg.model_skip and (p := self._model_predict(t, j, own=True)) is not None \
                    and p[0] > cfg.accept_ratio:
                skipped = (f"{self._fmt(cfg.levels[j])} not tried: the latency model expects p95 at {p[0]:.0%} of the "
                           f"SLO under {p[2]:.0f} work/s")
                continue
            if d < 0:
                here, above = (r.typical_ratio(i, t - cfg.reprobe_s) for i in (self.idx, self.idx + cfg.max_step))
                guess = predict_ratio(here, above) if here is not None else None
                if guess is not None and guess > cfg.guard_ratio:
                    # Predicted to break the SLO outright: its trial would most likely only cost an SLO window.
                    skipped = (f"{self._fmt(cfg.levels[j])} not tried: p95 predicted at {guess:.0%} of the SLO")
                    continue
            if not self._budget_ok(t):
                out.append(self._decide(t, "hold", self.idx, "exploration budget spent: hold until the reprobe time"))
                self._enter("hold", t)
                r.converged_t = t
                self._direction = -1
                return
            self._direction = d
            self._start_trial(t, j, out)
            return
        if r.reprobe_from is not None:
            r.quiet = r.quiet + 1 if r.reprobe_from == self.idx else 0
            r.reprobe_from = None
        why = f"; {skipped}" if skipped else ""
        out.append(self._decide(t, "hold", self.idx, f"converged: hold until the traffic shifts or the reprobe time{why}"))
        self._enter("hold", t)
        r.converged_t = t
        self._direction = -1

    def _start_trial(self, t: float, j: int, out: list[Decision], why: str = "") -> None:
        d = "down" if j < self.idx else "up"
        out.append(self._move(t, "explore", j, f"try {d} one level{': ' + why if why else ''} (incumbent "
                                               f"{self._incumbent.j_per_token:.3g} J/token)", self._incumbent))
        self._trials.append((t, math.inf))
        self._enter("trial", t)
        self._trial_ratios = []

    def _bar(self, r: _Regime, i: int, t: float, hard: bool = False) -> None:
        """Level `i` (and every level below) found too slow: `i` is barred for reprobe_s, doubled for each
        earlier time it was found so in this regime and once more when it broke the SLO itself (`hard`, a
        guard back-off on a p95 past the SLO by more than the buckets' error), up to 8×: a level that keeps breaking the SLO is re-probed ever more rarely rather
        than every hour (in stationary traffic it will break it again)."""
        n = r.bars.get(i, (0, 0.0))[0] + (2 if hard else 1)
        r.bars[i] = (n, t + self.cfg.reprobe_s * 2 ** min(n - 1, 3))
        r.floor, r.floor_t = max(r.floor, i + 1), t
        r.quiet, r.reprobe_from = 0, None

    def _budget_ok(self, t: float) -> bool:
        h = self.cfg.explore_horizon_s
        while self._trials and self._trials[0][1] < t - h:
            self._trials.popleft()
        spent = sum(min(e, t) - max(s, t - h) for s, e in self._trials)
        return spent <= self.cfg.max_explore_share * h - self.cfg.dwell_s

    def _end_trial(self, t: float) -> None:
        if self._trials and self._trials[-1][1] == math.inf:
            self._trials[-1] = (self._trials[-1][0], t)

    def _over_hold(self, r: _Regime, stat: _LevelStat) -> bool:
        """A held level leaves the holding band: this judgement past the middle of hold_ratio–guard_ratio, or the
        last `hold_confirm` judgements since it was set all past hold_ratio (one window's p95 is a noisy draw)."""
        if stat.slo_ratio <= self.cfg.hold_ratio:
            return False
        if stat.slo_ratio > (self.cfg.hold_ratio + self.cfg.guard_ratio) / 2:
            return True
        ok = [x.work_per_s for x in self._held_ok if x.t_s > self.since_s]
        if ok and stat.work_per_s > self.cfg.hold_growth * float(np.median(ok)):
            return True
        last = [x for t, x in r.ratios.get(self.idx, ()) if t > self.since_s][-self.cfg.hold_confirm:]
        return len(last) >= self.cfg.hold_confirm and all(x > self.cfg.hold_ratio for x in last)

    def _threatened(self, t: float, ratio: float | None, out: list[Decision], what: str | None = None) -> None:
        """Back to the reference at once: the guard's p95 at `ratio` × the SLO, or `what` (requests not finished)."""
        r = self.regime
        cfg = self.cfg
        self._undo, self._ref_threatened = (r.floor, r.floor_t, r.best, dict(r.bars)), False
        # While draining an ended trial's queue (or, with trial_blame_s, soon after one ended at its incumbent) the slow
        # requests are the trial's (already barred), not this level's.
        shielded = self.state == "drain" or (
            cfg.trial_blame_s > 0 and self._early_end is not None and self.idx == self._early_end[1]
            and t - self._early_end[0] <= cfg.trial_blame_s and self.state != "trial")
        self._threat_idx = self.idx if not shielded else None
        xs = [x for _, x in r.ratios.get(self.ref, ())]
        self._ref_typical = float(np.median(xs)) if xs else None
        self._backoff_tail = []
        hits = [x for x in r.strikes.get(self.idx, []) if x > t - cfg.strike_s] + [t]
        if not shielded:
            r.strikes[self.idx] = hits
        barred = (len(hits) >= cfg.strikes or self.state == "trial") and not shielded
        if barred:
            # A p95 within the buckets' error of the SLO may not have broken it: barred as a level found too slow. So is
            # a level left for a request not finished: one request late is not yet the p95 broken.
            hard = ratio is not None and ratio > cfg.guard_ratio * (1 + BUCKET_ERROR)
            self._bar(r, self.idx, t, hard=hard)
            growth = self.load_growth(t)
            above = max(cfg.ramp_restore_above if growth is not None and growth > cfg.ramp_growth else 1,
                        cfg.break_restore_above if hard else 1)
            if r.best is not None and r.best < r.floor + above - 1:
                # hysteresis: after the back-off, return one level above the one that threatened (more while the
                # load ramps: the level just above it breaks next, minutes later)
                r.best = min(r.floor + above - 1, len(cfg.levels) - 1)
        self._end_trial(t)
        then = ("barred for now" if barred else f"strike {len(hits)} of {cfg.strikes}") if not shielded \
            else "the ended trial's queue, not this level: not barred"
        what = what or f"p95 at {ratio:.0%} of the SLO over the last {cfg.guard_s:g} s"
        out.append(self._move(t, "backoff", self.ref, f"SLO threatened: {what}; back to the reference at once ({then})"))
        self._enter("backoff", t)
        self._direction, self._up_tried = -1, False

    def _track_regime(self, w: Window, out: list[Decision]) -> None:
        cfg = self.cfg
        self._recent.append(w)
        while self._recent and self._recent[0].t_end_s <= w.t_end_s - cfg.regime_s:
            self._recent.popleft()
        seen = merge(list(self._recent))
        feat = regime_features(seen)
        if feat is None:
            return
        if self.regime.key is None:
            if seen.duration_s < cfg.regime_s / 2:
                return  # the first regime is named from minutes of traffic, not from the first tick's few requests
            self.regime.key = regime_key(feat, cfg.regime_ratio)
            self.regimes[self.regime.key] = self.regime
            return
        if not outside(feat, self.regime.key, cfg.regime_ratio, cfg.regime_margin):
            self._cand_since = None
            return
        if self._cand_since is None:
            self._cand_since = w.t_end_s
        if w.t_end_s - self._cand_since < cfg.regime_s:
            return
        key = regime_key(feat, cfg.regime_ratio)
        started, self._cand_since = self._cand_since, None
        old, old_key = self.regime_name, self.regime.key
        moved_backoff = False
        if self._undo is not None and self.regime.floor_t >= started - cfg.guard_s:
            # A back-off while the traffic was already shifting is the new traffic's, not the old regime's.
            r0 = self.regime
            r0.floor, r0.floor_t, r0.best, r0.bars = self._undo
            self._undo, moved_backoff = None, True
        self.regime = self._regime(key)
        if old_key is None or key[1:] != old_key[1:]:
            self._mix_since = started  # another length mix: the load forecast starts again
        if self.state == "backoff":
            # The reference is held for backoff_s whatever the traffic does; at its end the new regime's best
            # level (if any) is restored. A back-off moved off the old regime is charged to the new one.
            if moved_backoff and self._threat_idx is not None:
                self._bar(self.regime, self._threat_idx, w.t_end_s, hard=True)
                if self.regime.best is not None and self.regime.best < self.regime.floor:
                    self.regime.best = self.regime.floor
            self._undo, self._ref_threatened = None, False
            out.append(self._decide(w.t_end_s, "regime", self.idx, f"traffic shifted from {old} during a back-off: "
                                                                  "the reference is held for the rest of it"))
            return
        self._end_trial(w.t_end_s)
        self._up_tried, self._direction, self._repair = False, -1, None
        r = self.regime
        if r.best is not None and r.best >= r.floor:
            out.append(self._move(w.t_end_s, "regime", r.best, f"traffic shifted from {old}; this regime was seen "
                                                                f"before: its best level"))
            self._enter("hold", w.t_end_s)
            r.converged_t = w.t_end_s
        elif old_key is not None and (up := self._shift_steps(old_key, key)) > 0 and self.idx < len(cfg.levels) - 1:
            # More work per second than the level was verified under, and nothing known: up before exploring.
            to = min(self.idx + up, len(cfg.levels) - 1)
            out.append(self._move(w.t_end_s, "regime", to, f"traffic shifted from {old} to more work per second: "
                                                          f"{to - self.idx} level(s) up, then re-explore"))
            self._enter("measure", w.t_end_s)
        else:
            out.append(self._move(w.t_end_s, "regime", self.idx, f"traffic shifted from {old}: re-explore from here"))
            self._enter("measure", w.t_end_s)

    # --- helpers ----------------------------------------------------------------------------

    def _shift_steps(self, old_key: tuple[int, ...], key: tuple[int, ...]) -> int:
        """Levels to go up on entering an unknown regime: one per bin (regime_ratio) of growth in work per
        second (arrivals × (output + prefill_weight × prompt), at the bins' centres), at most max_step × 2."""
        grow = work_rate(key, self.cfg) / work_rate(old_key, self.cfg)
        if grow <= 1.0:
            return 0
        return min(max(1, int(math.log(grow) / math.log(self.cfg.regime_ratio) + 0.5)), 2 * self.cfg.max_step)

    def _regime(self, key) -> _Regime:
        if key not in self.regimes:
            self.regimes[key] = _Regime(key)
        return self.regimes[key]

    def _enter(self, state: str, t: float, keep_pending: bool = False) -> None:
        if state in ("hold", "backoff", "killed", "stale"):
            self._model_search = False
            self._repair = None  # a search interrupted: the next one starts afresh
        self.state = state
        self.state_since_s = t
        if not keep_pending:
            self._pending = []

    def _fmt(self, v: float) -> str:
        return f"{v:g} {self.cfg.unit}"

    def _decide(self, t: float, action: str, to_idx: int, reason: str, stat: _LevelStat | None = None) -> Decision:
        d = Decision(t, action, self.level, self.cfg.levels[to_idx], reason, self.regime_name,
                     stat.j_per_token if stat else None, stat.slo_ratio if stat else None)
        self.decisions.append(d)
        return d

    def _move(self, t: float, action: str, to_idx: int, reason: str, stat: _LevelStat | None = None) -> Decision:
        d = self._decide(t, action, to_idx, reason, stat)
        if action == "backoff" and to_idx > self.idx and self.state != "drain":
            # Every move up as too slow is a back-off row; a drain level's back-off is the ended trial's queue, not its own.
            self.regime.sent_up[self.idx] = t
        if to_idx != self.idx:
            self.idx = to_idx
            self.since_s = t
            self._held_ok = []
            self._pending = []
            self._guard.clear()
        return d


def config_from_table(table: dict, levels: list[float], reference: float | None = None) -> TunerConfig:
    """A TunerConfig from a parsed [tuner] table (unknown keys rejected) and the resolved levels."""
    unknown = sorted(set(table) - CONFIG_KEYS - {"levels", "reference"})
    if unknown:
        raise TunerConfigError(f"unknown key(s) in [tuner]: {', '.join(unknown)}; known: "
                               f"levels, reference, {', '.join(sorted(CONFIG_KEYS))}")
    kw = {}
    types = {f.name: f.type for f in fields(TunerConfig)}
    for k, v in table.items():
        if k in ("levels", "reference"):
            continue
        want = types[k]
        if "bool" in str(want):
            if not isinstance(v, bool):
                raise TunerConfigError(f"tuner.{k}: true or false")
        elif "str" in str(want):
            if not isinstance(v, str):
                raise TunerConfigError(f"tuner.{k}: a string")
        elif "int" in str(want):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TunerConfigError(f"tuner.{k}: an integer")
        elif not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TunerConfigError(f"tuner.{k}: a number")
        kw[k] = v
    lv = sorted(float(x) for x in levels)
    ref = float(reference) if reference is not None else lv[-1]
    return TunerConfig(levels=tuple(lv), reference=ref, **kw)
