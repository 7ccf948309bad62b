"""Learns what each kind of work costs in energy, online, per GPU setting, from closed intervals (NNLS).

Each interval's counter energy is modelled as

    E = idle_w·duration + step_j·steps + decode_j·tokens + prefill_j·prompt_tokens + ctx_j·ctx_ktokens

(prefill_tokens: the prompt tokens the server computed, a prefix-cache hit none; ctx_ktokens: Σ over decoded
tokens of their own sequence's context in thousands of tokens, a cached prompt in it all the same), fitted by
non-negative least squares (exact, by its active sets: see `_nnls`) over a rolling window of the most recent
intervals that have an exact counter and little bypass traffic, separately for each setting of the
sampled GPUs (their power limits: a cap changes what a token costs). The fit is used once it is
mature (enough busy intervals, R² high enough); until then `attribution.WorkCosts()` (the
documented fixed ratio) splits the intervals. Idle power is the median of the window's runs of
idle intervals, each summed to at least IDLE_MIN_S (measured, not fitted), the last MIN_IDLE kept past
the window until new runs replace them, where there are some, and the fit's intercept is held at it; without them the intercept is fitted too. How fast prompts
are prefilled (where their work is placed: just before their first token) follows from the fit:
the power the GPUs draw above idle when busy (the window's median) over the fitted energy of a
prompt token.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass

from itertools import combinations

import numpy as np

from .attribution import DEFAULT_PREFILL_TOK_S, WorkCosts

FEATURES = ("duration_s", "steps", "decode_tokens", "prefill_tokens", "ctx_ktokens")
WINDOW = 900  # intervals: 15 minutes at 1 Hz
MIN_BUSY = 30  # busy intervals in the window before the fit is used
MIN_R2 = 0.9  # over the window's busy intervals
MIN_IDLE = 5  # idle runs (below) before their median power is the idle power (until then the median of those seen is)
# The last MIN_IDLE runs stay past the window until new runs replace them: steady traffic with idle gaps of 0.1-0.25 s
# makes no run, and with none left the busy intervals' idle time went to their requests (+21% median, unflagged, on
# the simulated vLLM). A GPU's idle draw at a fixed setting does not change with traffic.
# The idle power is learned from runs of consecutive idle intervals, summed until they are this long (each run one
# reading; a busy or unusable interval ends a run, its part dropped), early or late: a counter refreshed every 100 ms
# (H200) reads an idle interval of a few ms as 0 J or a whole refresh (0 W or 300-1000 W for 78 W), and the daemon's
# first interval, or one cut by a request's edge, is often that short; summed, the refresh one missed is in the next
# (the differences add up to the run's). Three refreshes bound one refresh's error to a third of the run (0.34-0.41 s
# intervals read 62-84 W on the simulated H200); 0.5 s left the simulated SGLang's first streams with none (+78% to
# +95%). A run that read 0 J is a counter read stale (energy._stale_if_flat: a GPU never draws nothing): it teaches none.
IDLE_MIN_S = 0.3
# An idle run held for a busy reading to tell the SM clock locks (`CostLearner.lock_told`) is filed to its setting, the
# locks as last told, once none has for this long: short requests that fall between the samples (0.1 s every 2 s at
# 0.5 s sampling) are never read busy, and held for good every row was flagged (40 of 40, idle power never learned). A
# lock changed unseen for this long goes to the old setting's idle, the known limit (docs/daemon.md, Attribution, idle).
LOCK_WAIT_S = 60.0
REFIT_EVERY = 10  # intervals added between fits
CTX = FEATURES.index("ctx_ktokens")
# The context cost's band (`ctx_band`), standard errors either side: ~95% of a normal estimate's spread. Its decode and
# context costs trade: on the simulated H200 beside two CPU hogs (tests/test_daemon_prefix_cache.py's llama.cpp scene)
# runs fitted 0.0 to 0.113 J per token per 1000 tokens of context, the decode cost 0.29 to 0.12 J a token, and the
# long-context turns read -7.4% to +15.4% in sum, unsaid; the rows that lean on it now say how far (docs/daemon.md).
CTX_BAND_SE = 2.0
MIN_BUSY_GPU = 5  # busy intervals before a GPU's part in the work is judged
# A GPU whose median busy-interval power rises above its idle median by less than this share of the
# GPU that rises most does none of the proxied work (a GPU no server uses, or one whose load is its
# own): its energy is idle, not the requests'. Tensor- and pipeline-parallel GPUs of one engine rise
# together, far above this.
SERVING_SHARE = 0.1
# Before MIN_IDLE idle intervals (steady traffic, the real daemon's intervals not cut at the gaps: one idle interval in
# 80 s), the rise is judged from the busy intervals alone: each GPU's power over them fitted (least squares) to the
# interval's work rates, its rise the spread the work explains; judged once MIN_BUSY busy intervals are in and the
# work explains at least this share of the variance of the GPU it moves most (too even a load judges nothing).
# Before, two GPUs, one serving nothing, steady traffic: never judged, every row +18.8% median, unflagged.
MIN_R2_SERVING = 0.5
# The reason the live J/token's left-out counters give an interval split before which of several GPUs serve was known
# (the requests' rows say UNSURE_FLAG: rowtext._gpus_undecided).
GPUS_UNDECIDED_REASON = "gpus-undecided"


class LockedSetting(tuple):
    """A setting (the GPUs' power limits, the tuple) where some GPU's SM clock is locked: `clocks`, each GPU's lock in
    MHz or None (collectors/limitwatch.ClockLockSigns). A lock can move the idle draw (`_idle_held` in sim/gpu.py, the
    public reports there), so it is another setting with its own idle power; equal only to one with the same locks."""

    clocks: tuple

    def __new__(cls, limits_w, clocks):
        self = super().__new__(cls, limits_w)
        self.clocks = tuple(clocks)
        return self

    def __eq__(self, other):
        return tuple.__eq__(self, other) and getattr(other, "clocks", None) == self.clocks

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((tuple(self), self.clocks))

    def __reduce__(self):
        return LockedSetting, (tuple(self), self.clocks)


def setting_of(limits_w: tuple, clocks: tuple) -> tuple:
    """The setting of GPUs at power limits `limits_w` with SM clock locks `clocks` (MHz, None: none): the limits
    alone where no GPU is locked."""
    return LockedSetting(limits_w, clocks) if any(c is not None for c in clocks) else tuple(limits_w)


def busy_rise_w(power_w: np.ndarray, rates: np.ndarray, least: int = MIN_BUSY,
                min_r2: float = MIN_R2_SERVING) -> np.ndarray | None:
    """Per GPU, the standard deviation of its busy-interval power (K, G) that the intervals' work rates (K, F) explain
    (least squares with an intercept), at most the GPU's whose power the work explains best (R²); None with fewer than
    `least` intervals, or where the work explains less than `min_r2` of even that GPU's (a load too even to tell a
    serving GPU by)."""
    if len(power_w) < least:
        return None
    x = np.column_stack([np.ones(len(rates)), rates])
    coef = np.linalg.lstsq(x, power_w, rcond=None)[0]
    explained_w = (x @ coef).std(axis=0)
    total_w = power_w.std(axis=0)
    r2 = np.divide(explained_w ** 2, total_w ** 2, out=np.zeros_like(total_w), where=total_w > 0)
    best = int(np.argmax(r2))
    if r2[best] < min_r2:
        return None
    # Capped: a GPU of its own load, wide, may have more watts explained by chance than a serving one has; uncapped it
    # would raise the bar the others are judged by.
    return np.minimum(explained_w, explained_w[best])


@dataclass(frozen=True)
class Fit:
    coef: tuple  # per FEATURES: W (idle), J/step, J/token, J/prompt token, J/(token·ktoken of context)
    n: int
    n_busy: int
    r2: float | None
    rel_rmse: float | None
    mature: bool
    reason: str  # why not mature ("" when it is)
    # The work costs (FEATURES[1:]) at the context cost CTX_BAND_SE standard errors above, then below, the fitted one,
    # the others moved with it as the fit trades them (`ctx_band`); () where it cannot be told.
    ctx_band: tuple = ()


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares, exact, for the few columns of FEATURES.

    The optimum is the plain least-squares solution on its own support, so the feasible
    (all ≥ 0) support-restricted solution with the least residual is it: 2^k small solves for k
    columns. Not `scipy.optimize.nnls` because importing scipy.optimize costs the daemon ~40 MiB of
    its resident memory (docs/benchmarks-history.md, Soak, second pass), for a 5-column problem.
    """
    # Columns scaled to unit norm: token counts and seconds differ by orders of magnitude.
    norm = np.linalg.norm(x, axis=0)
    cols = np.flatnonzero(norm > 0)
    coef = np.zeros(x.shape[1])
    if cols.size == 0:
        return coef
    xs = x[:, cols] / norm[cols]
    best, best_rss = np.zeros(cols.size), float(y @ y)
    for k in range(1, cols.size + 1):
        for support in combinations(range(cols.size), k):
            sol = np.linalg.lstsq(xs[:, support], y, rcond=None)[0]
            if (sol < 0).any():
                continue
            r = y - xs[:, support] @ sol
            rss = float(r @ r)
            if rss < best_rss:
                best_rss, best = rss, np.zeros(cols.size)
                best[list(support)] = sol
    coef[cols] = best / norm[cols]
    return coef


def ctx_band(x: np.ndarray, y: np.ndarray, coef: np.ndarray, held: bool) -> tuple:
    """The fitted work costs (FEATURES[1:]) at the context cost `CTX_BAND_SE` standard errors above and below the fit
    `coef` of `y` on `x` (the intercept held at coef[0] where `held`), the other costs moved with it along their
    covariance with it (where the context cost is high the decode cost is low: long-context work pays what short work
    gives up), each kept ≥ 0; () with too few busy intervals or a singular design, or where the context or decode cost
    sits at its bound (0): the NNLS fit is one-sided there, and a ±SE band held the truth in 0 of 9 such fits (a
    review's band_cover.py; 94% of the interior ones): its rows then say no band.

    The covariance is the least-squares one on the fit's support (its positive costs),
    heteroskedasticity-robust (HC1): an interval's error grows with its work (tokens a late proxy read moved across
    its edges), not the same in each."""
    if coef[CTX] <= 0 or coef[2] <= 0:
        return ()
    cols = [j for j in range(0 if not held else 1, x.shape[1]) if coef[j] > 0]
    busy = (x[:, 2] > 0) | (x[:, 3] > 0)
    xb = x[busy][:, cols]
    dof = xb.shape[0] - len(cols)
    if dof <= 0:
        return ()
    res = y[busy] - x[busy] @ coef
    try:
        inv = np.linalg.inv(xb.T @ xb)
    except np.linalg.LinAlgError:
        return ()
    cov = inv @ (xb.T * res**2) @ xb @ inv * (xb.shape[0] / dof)
    k = cols.index(CTX)
    if not np.all(np.isfinite(cov)) or cov[k, k] <= 0:
        return ()
    move = np.zeros(x.shape[1])
    move[cols] = cov[:, k] / np.sqrt(cov[k, k]) * CTX_BAND_SE
    return tuple(tuple(float(c) for c in np.maximum(coef + sign * move, 0.0)[1:]) for sign in (1.0, -1.0))


def fit_costs(x: np.ndarray, y: np.ndarray, min_busy: int = MIN_BUSY, min_r2: float = MIN_R2,
              idle_w: float | None = None) -> Fit:
    """NNLS of interval energy `y` on `x` (columns FEATURES); quality over the busy rows.

    With `idle_w` (measured on idle intervals) the intercept is held at it and only the costs of
    work are fitted: busy intervals far outnumber idle ones and would otherwise trade intercept
    against the costs."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    busy = (x[:, 2] > 0) | (x[:, 3] > 0)
    n_busy = int(busy.sum())
    if x.shape[0] < 2:
        return Fit((0.0,) * len(FEATURES), x.shape[0], n_busy, None, None, False, "no intervals yet")
    if idle_w is not None:
        coef = np.concatenate([[idle_w], _nnls(x[:, 1:], y - idle_w * x[:, 0])])
    else:
        coef = _nnls(x, y)
    r2 = rel = None
    if n_busy >= 2:
        res = y[busy] - x[busy] @ coef
        tot = y[busy] - y[busy].mean()
        ss_tot = float(tot @ tot)
        r2 = 1.0 - float(res @ res) / ss_tot if ss_tot > 0 else None
        mean = float(y[busy].mean())
        rel = float(np.sqrt(np.mean(res**2))) / mean if mean > 0 else None
    if n_busy < min_busy:
        reason = f"{n_busy} busy intervals of {min_busy}"
    elif r2 is None or r2 < min_r2:
        reason = f"R² {r2 if r2 is None else round(r2, 3)} below {min_r2}"
    elif coef[1] + coef[2] <= 0:
        reason = "no per-token cost found"
    else:
        reason = ""
    band = ctx_band(x, y, coef, idle_w is not None) if reason == "" else ()
    return Fit(tuple(float(c) for c in coef), int(x.shape[0]), n_busy, r2, rel, reason == "", reason, band)


class CostLearner:
    """Rolling windows of (features, energy) per setting; `costs(setting)` → the WorkCosts to split with."""

    def __init__(self, window: int = WINDOW, min_busy: int = MIN_BUSY, min_r2: float = MIN_R2):
        self.window = window
        self.min_busy = min_busy
        self.min_r2 = min_r2
        self._x: dict = {}
        self._y: dict = {}
        self._since: dict = {}
        self._n: dict = {}  # intervals ever added per setting (the window holds the last `window`)
        # (its last interval's number, its power, its first's, its power per GPU) of each run that teaches it
        self._idle: dict = {}
        # The run of consecutive idle intervals being summed: (setting, its first's number, J, s, J per GPU), or None.
        self._spell: tuple | None = None
        # The same powers kept sorted: the median is read off the middle, where np.median over the window sorted it
        # all at every close (half a millisecond of the idle daemon's ~3 ms close, cold, on the development VM).
        self._idle_sorted: dict = {}
        self._idle_runs = 0  # runs that taught an idle power, all settings
        self._idle_latest: dict = {}  # per setting: the number (of `_idle_runs`) of its latest run
        # Idle runs closed where no busy reading has told the SM clock locks yet (`lock_told`): (its end ns, its
        # setting, its entry in `_idle`), filed once one tells the locks held, dropped where one tells a change.
        self._held: deque = deque(maxlen=window)
        self._told_ns: int | None = None  # the locks are told up to this instant (None: not yet)
        self.held_since_ns: int | None = None  # the end of the oldest idle run held now (None: none held)
        self._untold: tuple | None = None  # (from, to) ns: the latest span a lock may have changed in (its runs dropped)
        self._lock_blind = False  # no reading shows a lock (`lock_told(None)`): every run is filed as it closes
        # Runs filed by `lock_untold` (no busy reading told their locks): (its end ns, its setting, its entry in `_idle`),
        # taken back out where a busy reading then tells a change since the last telling by a reading (`_confirmed_ns`).
        self._unconfirmed: deque = deque(maxlen=window)
        self._confirmed_ns: int | None = None  # the latest instant a busy reading told the locks held
        self._yg: dict = {}  # per setting: each interval's energy per GPU (the window's rows)
        self._g_idle: deque = deque(maxlen=window)  # per-GPU power of idle intervals, all settings
        self._g_busy: deque = deque(maxlen=window)  # and of busy ones
        self._g_busy_rates: deque = deque(maxlen=window)  # the busy ones' work per second (steps, tokens, ...)
        self._g_busy_n = 0  # busy intervals ever added to _g_busy
        self._g_busy_judged = 0  # _g_busy_n at the last judgement from busy intervals alone
        self.serving: np.ndarray | None = None  # (G,) the GPUs doing the proxied work; None: not known yet (all)
        # Where `serving` came from: None (not known), "told" (`tell_serving`: from outside, not judged yet), "judged"
        # (from the GPUs' power, `_judge_gpus`, nothing told), "both" (the two agree) or "disagree" (serving None).
        self.serving_from: str | None = None
        self.told: np.ndarray | None = None  # the mask told (`tell_serving`), None: none
        # The told mask is provisional (`tell_serving`): taken only once the power judges the same, undecided till then.
        self.told_provisional = False
        self.judged: np.ndarray | None = None  # the mask the GPUs' power judged last, None: not judged yet
        self.fits: dict = {}

    def add(self, setting, features: np.ndarray, energy_j: np.ndarray, usable: np.ndarray,
            ends_ns: np.ndarray | None = None) -> Fit | None:
        """Add intervals of one setting; returns a new Fit when one was made (every REFIT_EVERY).

        energy_j: (K,) the interval energy, or (K, G) per GPU: then the fit and the idle power are
        of the GPUs doing the proxied work (`serving`), judged from the same intervals. ends_ns: (K,) each interval's
        end: an idle run then teaches its setting only once the SM clock locks are told there (`lock_told`)."""
        xs = self._x.setdefault(setting, deque(maxlen=self.window))
        ys = self._y.setdefault(setting, deque(maxlen=self.window))
        yg = self._yg.setdefault(setting, deque(maxlen=self.window))
        idle = self._idle.setdefault(setting, deque())
        srt = self._idle_sorted.setdefault(setting, [])
        eg = np.asarray(energy_j, dtype=float)
        eg = eg[:, None] if eg.ndim == 1 else eg
        mask = self._mask(eg.shape[1])
        added = 0
        ends = [None] * len(eg) if ends_ns is None else [int(x) for x in ends_ns]
        for f, g, ok, end_ns in zip(np.asarray(features, dtype=float), eg, usable, ends):
            e = float(g[mask].sum())
            if not (ok and np.all(np.isfinite(g)) and np.all(np.isfinite(f))):
                self._spell = None  # a gap in the run of idle intervals
                continue
            xs.append(f)
            ys.append(e)
            yg.append(g)
            if f[0] > 0 and eg.shape[1] > 1:
                if f[2] > 0 or f[3] > 0:
                    self._g_busy.append(g / f[0])
                    self._g_busy_rates.append(f[1:] / f[0])
                    self._g_busy_n += 1
                elif not f[1:].any() and np.all(g > 0):
                    # Each idle interval, short or not (steady traffic makes no run: none was judged), its medians
                    # bearing a refresh more or less; a stale 0 J read is left out (an unused GPU's idle draw would
                    # read as a rise).
                    self._g_idle.append(g / f[0])
            added += 1
            self._n[setting] = n = self._n.get(setting, 0) + 1
            if f[1:].any():
                self._spell = None
            elif f[0] > 0:
                # Kept as they come, so the idle median costs no pass over the whole window per interval.
                first, spell_j, spell_s, spell_g = (self._spell[1:] if self._spell is not None and
                                                    self._spell[0] == setting else (n, 0.0, 0.0, 0.0))
                spell_j, spell_s, spell_g = spell_j + e, spell_s + float(f[0]), spell_g + g
                self._spell = (setting, first, spell_j, spell_s, spell_g)
                if spell_s >= IDLE_MIN_S:
                    self._spell = None
                    if spell_j > 0:
                        self._idle_run(setting, (n, spell_j / spell_s, first, spell_g / spell_s), end_ns)
        while len(idle) > MIN_IDLE and idle[0][0] <= self._n.get(setting, 0) - self.window:
            del srt[bisect_left(srt, idle.popleft()[1])]  # left the window
        if added and eg.shape[1] > 1:
            self._judge_gpus()  # at every close, not every fit: a busy interval split over an idle GPU is wrong
        self._since[setting] = self._since.get(setting, 0) + added
        if self._since[setting] < REFIT_EVERY or not xs:
            return None
        self._since[setting] = 0
        fit = fit_costs(np.array(xs), np.array(ys), self.min_busy, self.min_r2, idle_w=self._idle_median(setting))
        self.fits[setting] = fit
        return fit

    def _idle_run(self, setting, run: tuple, end_ns: int | None) -> None:
        """A run of idle intervals closed: it teaches `setting` where the locks are told at its end (or cannot be),
        is dropped where a lock may have changed before its end unseen, and is held till a reading tells otherwise."""
        if end_ns is None or self._lock_blind or (self._told_ns is not None and end_ns <= self._told_ns):
            self._file_idle(setting, run)
        elif self._confirmed_ns is None and self._untold is None:
            # No reading told the locks yet (the daemon's start): filed at once as the locks the first telling will say, and taken
            # back out where it says a change (`_unconfirmed`, as `lock_untold`'s). Held instead, short requests that
            # no busy sample caught learned no idle power for LOCK_WAIT_S: a vLLM one-token answer +73% (its idle
            # split in), the self-closing tool call +126%, at every start (tests/test_daemon_chat_shapes.py).
            self._file_idle(setting, run)
            self._unconfirmed.append((end_ns, setting, run))
        elif self._untold is None or not self._untold[0] < end_ns <= self._untold[1]:
            self._held.append((end_ns, setting, run))
        self._held_changed()

    def _held_changed(self) -> None:
        self.held_since_ns = self._held[0][0] if self._held else None

    def _unfile_idle(self, setting, run: tuple) -> None:
        idle = self._idle.get(setting)
        if idle is None or not any(r is run for r in idle):
            return  # left the window already
        idle.remove(run)  # in place: `add` holds the deque; an equal run is the same to the median
        srt = self._idle_sorted[setting]
        del srt[bisect_left(srt, run[1])]

    def _file_idle(self, setting, run: tuple) -> None:
        self._idle.setdefault(setting, deque()).append(run)
        insort(self._idle_sorted.setdefault(setting, []), run[1])
        self._idle_runs += 1
        self._idle_latest[setting] = self._idle_runs

    def lock_told(self, t_ns: int | None, changed: bool = False, untold: bool = False) -> None:
        """A busy reading at `t_ns` told the GPUs' SM clock locks (collectors/limitwatch.ClockLockSigns.told): held
        (the held idle runs up to it teach their setting) or `changed` (a lock was set, moved or released somewhere
        since the last telling, unseen by the idle readings: the runs between teach nothing). t_ns None: no reading
        shows a lock (no clock or reasons read), so every run is filed as it closes.

        An idle card shows no lock (it sits at its idle clock), so a lock set or released while it idles is seen only at
        the next busy readings. Filed at once, the runs between went to the other setting's idle median: a lock set in a
        38 s idle left 118 runs at 99.7 W in the unlocked median (78 W true), every row after the release -7.6%,
        unflagged (docs/daemon.md, Attribution, idle)."""
        self._lock_blind = t_ns is None
        if t_ns is None:
            while self._held:
                _, setting, run = self._held.popleft()
                self._file_idle(setting, run)
            self._held_changed()
            return
        if changed:
            since = self._confirmed_ns if self._confirmed_ns is not None else -1
            self._untold = (since, t_ns)
            self._held = deque((h for h in self._held if h[0] > t_ns), maxlen=self._held.maxlen)
            self._held_changed()
            # Runs `lock_untold` filed after the last reading that told the locks may be of the changed lock: kept,
            # a lock set in a 200 s idle left 340 runs at 99.7 W in the unlocked median (78 W true), every row after
            # the release split with it -27.8% idle, unflagged.
            for end_ns, setting, run in self._unconfirmed:
                if end_ns > since:
                    self._unfile_idle(setting, run)
            self._unconfirmed.clear()
            return
        if not untold:
            self._confirmed_ns = t_ns if self._confirmed_ns is None else max(self._confirmed_ns, t_ns)
            self._unconfirmed = deque((u for u in self._unconfirmed if u[0] > t_ns), maxlen=self._unconfirmed.maxlen)
        self._told_ns = t_ns if self._told_ns is None else max(self._told_ns, t_ns)
        while self._held and self._held[0][0] <= self._told_ns:
            end_ns, setting, run = self._held.popleft()
            self._file_idle(setting, run)
            if untold:
                self._unconfirmed.append((end_ns, setting, run))
        self._held_changed()

    def lock_untold(self, t_ns: int) -> None:
        """A sample at `t_ns` told nothing of the locks: the held runs that ended LOCK_WAIT_S or more before it are
        filed to their setting (the locks as last told), as if told there: a lock changed unseen so long is the known
        limit, not a reason to learn no idle power at all."""
        self.lock_told(t_ns - int(LOCK_WAIT_S * 1e9), untold=True)

    def _mask(self, n_gpus: int) -> np.ndarray:
        if self.serving is None or self.serving.size != n_gpus:
            return np.ones(n_gpus, bool)
        return self.serving

    def _judge_gpus(self) -> None:
        """Which GPUs do the proxied work: those whose median power in busy intervals rises above
        their own idle median by at least SERVING_SHARE of the most any GPU rises. A GPU no server
        uses (or running load of its own, present idle or busy) draws the same either way; its
        energy is then idle, and the window's energies are re-summed over the GPUs that work. Before MIN_IDLE
        idle intervals, the rise is the busy power the work explains (`busy_rise_w`)."""
        if len(self._g_busy) < MIN_BUSY_GPU:
            return
        if len(self._g_idle) >= MIN_IDLE:
            rise = np.median(np.array(self._g_busy), axis=0) - np.median(np.array(self._g_idle), axis=0)
        else:
            # Every REFIT_EVERY busy intervals, not every close: the fit over the window costs ~0.4 ms (900 intervals).
            if self._g_busy_n - self._g_busy_judged < REFIT_EVERY:
                return
            self._g_busy_judged = self._g_busy_n
            rise = busy_rise_w(np.array(self._g_busy), np.array(self._g_busy_rates))
            if rise is None:
                return
        top = float(rise.max())
        if top <= 0:
            return
        self.judged = rise >= SERVING_SHARE * top
        self._decide()

    def tell_serving(self, serving: np.ndarray | None, provisional: bool = False) -> None:
        """The GPUs doing the proxied work as told from outside (the daemon's placement check, where its evidence is
        whole: service._check_placement), None: nothing told (any earlier telling withdrawn). A told mask is taken until
        the GPUs' power judges them (`_judge_gpus`); then the two must agree: where they differ, neither is picked (a
        missed worker, a foreign server following the traffic) and `serving` is None, every row flagged (`_decide`).
        provisional: a mask whose evidence has a known gap (another process's large context on a GPU told idle, whose
        load may follow the traffic): not taken alone, `serving` None (rows flagged) until the power judges the same."""
        told = None if serving is None else np.asarray(serving, dtype=bool)
        self.told = told if told is not None and told.any() else None
        self.told_provisional = bool(provisional) and self.told is not None
        self._decide()

    def _decide(self) -> None:
        """`serving` from the told mask and the judged one: the one there is, or both where they agree; None where they
        disagree (serving_from "disagree"). Before, a judgement overrode a told mask and stood, and a told mask stood
        unchecked until judged: a wrong one of either left rows unflagged, -33%..+50% (a review's ledger scenes)."""
        told, judged = self.told, self.judged
        if told is not None and judged is not None and not np.array_equal(told, judged):
            self.serving_from = "disagree"
            self._set_serving(None)
            return
        if told is not None and judged is None and self.told_provisional:
            # Not taken alone: the power judging alone, with nothing told, took a foreign server's load following the
            # traffic for the work's (+50% unflagged, a review's ledger scene); told and waiting, the rows are flagged.
            self.serving_from = "provisional"
            self._set_serving(None)
            return
        self.serving_from = ("told" if told is not None and judged is None else "judged" if told is None and judged is
                             not None else "both" if told is not None else None)
        self._set_serving(told if told is not None else judged)

    def _set_serving(self, serving: np.ndarray | None) -> None:
        """`serving` from now on (None: not known, every GPU's energy the work's), the windows' energies re-summed."""
        if serving is None if self.serving is None else (serving is not None and np.array_equal(serving, self.serving)):
            return
        self.serving = serving

        def over(g: np.ndarray) -> float:  # a GPU's energies summed over the working GPUs (every one: not known)
            return float(g[serving].sum()) if serving is not None and g.size == serving.size else float(g.sum())
        for setting, yg in self._yg.items():
            ys = self._y[setting]
            ys.clear()
            ys.extend(over(g) for g in yg)
            # Each run of idle intervals that taught the idle power, re-summed over the working GPUs (kept ones
            # past the window too: each holds its power per GPU).
            idle = self._idle[setting]
            kept = [(n, over(gw), first, gw) for n, _, first, gw in idle]
            idle.clear()
            idle.extend(k for k in kept if k[1] > 0)
            self._idle_sorted.setdefault(setting, [])[:] = sorted(k[1] for k in idle)
        held = [(e, s, (n, over(gw), first, gw)) for e, s, (n, _, first, gw) in self._held]
        self._held = deque((h for h in held if h[2][1] > 0), maxlen=self._held.maxlen)
        self._held_changed()
        self._spell = None

    def _idle_median(self, setting, least: int = MIN_IDLE) -> float | None:
        """Median power of the window's idle runs (IDLE_MIN_S) and the last MIN_IDLE, None with fewer than `least`."""
        srt = self._idle_sorted.get(setting)
        if not srt or len(srt) < least:
            return None
        # np.median's own figure: the middle value, or the mean of the middle two ((a + b) / 2, as its mean of two).
        mid = len(srt) // 2
        return float(srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2)

    def _early_idle_w(self, setting) -> float | None:
        """Before MIN_IDLE idle intervals: the median power of those seen, None with none."""
        return self._idle_median(setting, least=1)

    def _other_limit_idle_w(self, setting) -> float | None:
        """The idle power last measured at another setting of the same GPUs, where each GPU's idle draw there is below
        its limit in `setting` (None where none is, or a limit is unread).

        A limit caps power; an idle GPU draws below it, so the limit does not change its idle draw (checked here: each
        GPU's idle draw there below its limit now), and setting it leaves clocks and persistence as they were. A setting
        is power limits and SM clock locks: a lock can move the idle draw, so only a setting with the same locks
        (`LockedSetting.clocks`) lends its idle power. Before, after a limit's change the busy intervals' time with no
        request live went to the requests until a run of idle intervals closed at the new limit or the fit there
        matured: under steady traffic (idle gaps 0.1-0.25 s, never a run) every row for ~31 s flagged
        `uncertain-uncounted`, out of J/token (docs/daemon.md, Attribution, idle)."""
        try:
            limit_w = np.array(setting, dtype=float)  # an unread limit (None) reads NaN
        except (TypeError, ValueError):
            return None
        if limit_w.ndim != 1 or not np.all(np.isfinite(limit_w)):
            return None
        clocks = getattr(setting, "clocks", None)
        others = [s for s in self._idle_latest if s != setting and len(s) == len(setting) and self._idle.get(s)
                  and getattr(s, "clocks", None) == clocks]
        if not others:
            return None
        latest = max(others, key=lambda s: self._idle_latest[s])
        per_gpu_w = np.median(np.array([gw for *_, gw in self._idle[latest]]), axis=0)
        if per_gpu_w.shape != limit_w.shape or not np.all(per_gpu_w < limit_w):
            return None
        return self._early_idle_w(latest)

    def idle_w(self, setting) -> float | None:
        measured = self._idle_median(setting)
        if measured is not None:
            return measured
        fit = self.fits.get(setting)
        return fit.coef[0] if fit is not None and fit.mature else None

    def prefill_tok_s(self, setting, prefill_j: float, idle_w: float | None) -> float:
        """Prompt tokens a second: the busy intervals' median power above idle over the energy of a
        prompt token (the default rate where either is unknown)."""
        xs = self._x.get(setting)
        if not xs or idle_w is None or prefill_j <= 0:
            return DEFAULT_PREFILL_TOK_S
        x = np.array(xs)
        y = np.array(self._y[setting])
        busy = ((x[:, 2] > 0) | (x[:, 3] > 0)) & (x[:, 0] > 0)
        if not busy.any():
            return DEFAULT_PREFILL_TOK_S
        above_w = float(np.median(y[busy] / x[busy, 0])) - idle_w
        return above_w / prefill_j if above_w > 0 else DEFAULT_PREFILL_TOK_S

    def costs(self, setting) -> WorkCosts:
        fit = self.fits.get(setting)
        # Until MIN_IDLE idle runs are seen, the median of those seen (each at least IDLE_MIN_S long) splits the busy
        # intervals: with none, a request arriving 5.5 ms before a 0.93 s interval's end took all its idle energy (+34%
        # to +42% on the simulated SGLang, unflagged); with a few-ms one counted, -72% to +175% (docs/daemon.md, idle).
        idle = self.idle_w(setting)
        idle = self._early_idle_w(setting) if idle is None else idle
        idle = self._other_limit_idle_w(setting) if idle is None else idle
        if fit is None or not fit.mature:
            return WorkCosts(idle_w=idle)
        _, step, dec, pre, ctx = fit.coef
        return WorkCosts(step_j=step, decode_j=dec, prefill_j=pre, ctx_j=ctx, idle_w=idle,
                         prefill_tok_s=self.prefill_tok_s(setting, pre, idle), source="fitted", ctx_band=fit.ctx_band)
