"""A continuous-batching server in virtual time on the simulated GPU's physics: a day of traffic in seconds.

The live simulated server (sim/server.py) sleeps through every step in real time; this one
jumps from event to event (an arrival, a prefill step, a sequence finishing, a control tick) and
runs the decode steps in between in one go, summing their times as an arithmetic series (each
step reads `tokens_per_step` more context per sequence). Same costs (sim/batching.py: step time
at the top clock, prefill chunks, the batch's compute share) and the same DVFS under the cap
(sim/gpu.py, tabulated per level over the compute share), so its energy and latency agree with
the live server's in expectation; speculative acceptance is taken at its mean instead of drawn.
The level (power limit in W, or a locked SM clock in MHz) can change at every tick: the
controller sees a `Tick` and answers the level for the next one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import batching, knobs
from .gpu import IDLE, Phase, SimGpu
from .profiles import GpuProfile

SHARE_GRID = np.linspace(0.0, 1.0, 401)


@dataclass(frozen=True)
class LevelTable:
    """DVFS outcome at one level over SHARE_GRID: speed relative to f_max and board power; and the idle card's power."""

    level: float
    speed: np.ndarray
    power_w: np.ndarray
    idle_w: float  # what SimGpu idles at there: a locked clock moves it (sim/gpu.py `_idle_held`), a power limit not

    def at(self, share: float) -> tuple[float, float]:
        return float(np.interp(share, SHARE_GRID, self.speed)), float(np.interp(share, SHARE_GRID, self.power_w))


def level_table(profile: GpuProfile, level: float, knob: str = "power") -> LevelTable:
    """What SimGpu does at this power limit (or locked clock) for every compute share."""
    gpu = SimGpu(profile, 0, "GPU-virtual", clock_ns=lambda: 0)
    if knob == "power":
        gpu.set_limit_w(level)
    else:
        gpu.set_locked_clocks((int(level), int(level)))
    speed, power = [], []
    for s in SHARE_GRID:
        gpu.set_phase(Phase("decode", float(s)))
        speed.append(gpu.speed_factor(float(s)))
        power.append(gpu.read()["power_w"])
    gpu.set_phase(IDLE)
    return LevelTable(level, np.array(speed), np.array(power), float(gpu.read()["power_w"]))


@dataclass(frozen=True)
class Tick:
    """What happened in one control period (the controller's view; times in virtual seconds)."""

    t_start_s: float
    t_end_s: float
    level: float
    energy_j: float
    tokens: float
    arrivals: int
    finished: np.ndarray  # indexes of the requests that finished in it
    ttft_s: np.ndarray  # of those requests
    tpot_s: np.ndarray  # of those with 2+ tokens
    # Time integrals over the tick (request-seconds) of the requests arrived and not finished, and of those with
    # no first token yet (queued or in prefill): what the daemon's proxy counts (daemon/inflight.py).
    in_flight_s: float = 0.0
    awaiting_s: float = 0.0


@dataclass
class RunResult:
    """Per request (by trace index): arrival, first token, last token (s); totals; the level over time."""

    arrival_s: np.ndarray
    first_s: np.ndarray
    last_s: np.ndarray
    output_tokens: np.ndarray
    prompt_tokens: np.ndarray
    energy_j: float
    tokens: float
    duration_s: float
    level_time_s: dict  # level → seconds spent at it

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        """(last − first) / (tokens − 1); NaN for one-token requests."""
        n = self.output_tokens - 1
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, (self.last_s - self.first_s) / np.maximum(n, 1), np.nan)

    @property
    def j_per_token(self) -> float:
        return self.energy_j / self.tokens


class VirtualServer:
    """One simulated card behind a continuous-batching engine with `n_slots` sequences at once."""

    def __init__(self, profile: GpuProfile, levels, knob: str = "power", n_slots: int = 64):
        wl = profile.workload
        self.profile = profile
        self.knob = knob
        self.n_slots = n_slots
        d = wl.draft_n_max if wl.speculative else 0
        self.costs = batching.StepCosts.from_workload(wl, d)
        self.c = wl.decode_compute_share
        self.growth = wl.batch_compute_growth
        self.tokens_per_step = knobs.expected_tokens_per_step(wl, d)
        self.tables = {float(lv): level_table(profile, float(lv), knob) for lv in levels}

    def _share(self, prefill: np.ndarray, n_dec: int) -> float:
        c_b = self.c * (1.0 + self.growth * (max(n_dec, 1) - 1))
        return self.costs.compute_share(prefill, c_b / ((1.0 - self.c) + c_b))[1]

    def run(self, arrival_s, prompt_tokens, output_tokens, control: Callable[[Tick], float], level0: float,
            tick_s: float = 10.0) -> RunResult:
        """Serve the trace; `control(tick)` is called every `tick_s` and returns the next level."""
        arr = np.asarray(arrival_s, dtype=float)
        pt = np.asarray(prompt_tokens, dtype=int)
        ot = np.maximum(np.asarray(output_tokens, dtype=int), 1)
        n = arr.size
        first = np.full(n, np.nan)
        last = np.full(n, np.nan)
        costs, tps = self.costs, self.tokens_per_step
        level = float(level0)
        table = self.tables[level]
        t = 0.0
        nxt = 0  # next arrival
        waiting: list[int] = []
        pre: list[list[int]] = []  # [request, prompt tokens prefilled]
        dec_ids: list[int] = []
        dec_rem = np.zeros(0)
        dec_ctx = np.zeros(0)
        done = 0
        energy = tokens = 0.0
        level_time: dict = {}
        tick_end = tick_s
        tick_t0, tick_e0, tick_tok0, tick_arr0 = 0.0, 0.0, 0.0, 0
        finished_in_tick: list[int] = []
        # The queue's integrals, exact: ∫(arrived − finished) and ∫(arrived − first token seen) over each tick, from
        # the counts at its start and the times of what happened in it (arrivals from the trace itself).
        cum_arr = np.concatenate([[0.0], np.cumsum(arr)])
        n_first = 0
        firsts_in_tick: list[float] = []
        ends_in_tick: list[float] = []
        tick_first0 = tick_done0 = 0

        def close_tick(now: float) -> None:
            nonlocal tick_end, tick_t0, tick_e0, tick_tok0, tick_arr0, level, table, finished_in_tick
            nonlocal firsts_in_tick, ends_in_tick, tick_first0, tick_done0
            f = np.array(finished_in_tick, dtype=int)
            multi = f[ot[f] > 1]
            span = now - tick_t0
            a0, a1 = (int(np.searchsorted(arr, x, side="right")) for x in (tick_t0, now))
            arrived_s = a0 * span + (a1 - a0) * now - (cum_arr[a1] - cum_arr[a0])
            firsts_s = tick_first0 * span + len(firsts_in_tick) * now - sum(firsts_in_tick)
            ends_s = tick_done0 * span + len(ends_in_tick) * now - sum(ends_in_tick)
            tk = Tick(tick_t0, now, level, energy - tick_e0, tokens - tick_tok0, nxt - tick_arr0, f,
                      first[f] - arr[f], (last[multi] - first[multi]) / (ot[multi] - 1),
                      max(0.0, arrived_s - ends_s), max(0.0, arrived_s - firsts_s))
            tick_first0, tick_done0 = n_first, done
            firsts_in_tick, ends_in_tick = [], []
            level_time[level] = level_time.get(level, 0.0) + (now - tick_t0)
            new = float(control(tk))
            if new != level:
                level, table = new, self.tables[new]
            tick_t0, tick_e0, tick_tok0, tick_arr0 = now, energy, tokens, nxt
            finished_in_tick = []
            while tick_end <= now:
                tick_end += tick_s

        while done < n:
            while nxt < n and arr[nxt] <= t:
                waiting.append(nxt)
                nxt += 1
            while waiting and len(pre) + len(dec_ids) < self.n_slots:
                pre.append([waiting.pop(0), 0])
            if not pre and not dec_ids:
                t_next = arr[nxt] if nxt < n else math.inf
                if t_next >= tick_end:
                    energy += table.idle_w * (tick_end - t)
                    t = tick_end
                    close_tick(t)
                    continue
                energy += table.idle_w * (t_next - t)
                t = t_next
                continue
            if pre:
                need = [max(int(pt[i]), 1) for i, _ in pre]
                chunk = batching.plan_prefill([nd - k for nd, (_, k) in zip(need, pre)])
                p = np.array([k for k in chunk if k > 0] + [0] * len(dec_ids), dtype=float)
                ctx = np.concatenate([np.zeros(sum(1 for k in chunk if k > 0)), dec_ctx])
                speed, power = table.at(self._share(p, len(dec_ids)))
                dt = costs.step_s(p, ctx) / speed
                t += dt
                energy += power * dt
                # Decoding sequences get their step's tokens, then prefill progress.
                got = np.minimum(dec_rem, tps)
                dec_rem = dec_rem - got
                dec_ctx = dec_ctx + got
                tokens += float(got.sum())
                still = []
                for (i, k), c, nd in zip(pre, chunk, need):
                    k += c
                    if k >= nd:
                        first[i] = t
                        n_first += 1
                        firsts_in_tick.append(t)
                        tokens += 1.0
                        if ot[i] <= 1:
                            last[i] = t
                            done += 1
                            finished_in_tick.append(i)
                            ends_in_tick.append(t)
                        else:
                            dec_ids.append(i)
                            dec_rem = np.append(dec_rem, float(ot[i] - 1))
                            dec_ctx = np.append(dec_ctx, float(pt[i] + 1))
                    else:
                        still.append([i, k])
                pre = still
            else:
                m = len(dec_ids)
                speed, power = table.at(self._share(np.zeros(m), m))
                a = (costs.base_s + costs.per_seq_s * m + costs.per_ctx_token_s * float(dec_ctx.sum())) / speed
                b = costs.per_ctx_token_s * m * tps / speed
                k_fin = int(np.ceil(float(dec_rem.min()) / tps - 1e-9))
                horizon = tick_end - t
                if nxt < n and len(dec_ids) < self.n_slots:
                    horizon = min(horizon, arr[nxt] - t)
                k = max(1, min(k_fin, _steps_to_cover(a, b, horizon)))
                dt = a * k + b * k * (k - 1) / 2
                t += dt
                energy += power * dt
                got = np.minimum(dec_rem, k * tps)
                dec_rem = dec_rem - got
                dec_ctx = dec_ctx + got
                tokens += float(got.sum())
            fin = np.flatnonzero(dec_rem <= 1e-9)
            if fin.size:
                for j in fin:
                    i = dec_ids[j]
                    last[i] = t
                    finished_in_tick.append(i)
                    ends_in_tick.append(t)
                done += fin.size
                keep = np.flatnonzero(dec_rem > 1e-9)
                dec_ids = [dec_ids[j] for j in keep]
                dec_rem, dec_ctx = dec_rem[keep], dec_ctx[keep]
            if t >= tick_end:
                close_tick(t)
        close_tick(t)
        return RunResult(arr, first, last, ot, pt, energy, tokens, t, level_time)


def _steps_to_cover(a: float, b: float, span_s: float) -> int:
    """Smallest k ≥ 1 with a·k + b·k(k−1)/2 ≥ span_s (steps of time a, a+b, a+2b, …)."""
    if span_s <= a:
        return 1
    if b <= 0:
        return int(math.ceil(span_s / a))
    # b/2 k² + (a − b/2) k − span = 0
    hb = b / 2
    k = (-(a - hb) + math.sqrt((a - hb) ** 2 + 4 * hb * span_s)) / (2 * hb)
    return max(1, int(math.ceil(k - 1e-9)))
