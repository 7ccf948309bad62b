"""Honest warnings about an analysis: what the numbers cannot claim and what to measure next."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from powerprof.collectors.cputime import BUSY_HOST_FIX, BUSY_HOST_FLAG, busy_host_text
from powerprof.energy import ROUNDED_WINDOW_S, SHORT_WINDOW_REFRESHES, max_tokens_for_windows, short_counter_window_s
from powerprof.profiler import POWER_EDGE_BIAS_WINDOW_S
from powerprof.workload.servercount import FOREIGN_FIX, FOREIGN_FLAG

from .fits import ModelFit
from .stats import FEW_WINDOWS_FLAG, INSTANT_POWER_FLAG, MIN_CI_WINDOWS, NO_BUSY_FLAG, SHORT_WINDOWS_FLAG, LevelSeries
from .sweetspot import Choice, loss_text

TARGET_CI_PCT = 2.0  # the sweep's default --target-ci, as a percentage
UNSTABLE_SHARE = 0.8  # a choice picked by fewer bootstrap replicates than this is uncertain
POOR_FIT_R2 = 0.9


@dataclass(frozen=True)
class Finding:
    kind: str  # edge | between-levels | no-clear-saving | cap-not-engaged | energy-resolution | short-windows | wide-ci | one-window | few-windows | few-prompts | unstable-choice | thermal | failed | fit | unstored | untrusted-timing | impossible-figures | implausible-samples | interrupted | forced-pool | reference | busy-host | foreign-traffic | instant-power
    message: str
    levels: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "message": self.message, "levels": list(self.levels)}



def _levels_word(values) -> str:
    return "level" if len(values) == 1 else "levels"

def _fmt(v: float, unit: str) -> str:
    return f"{v:g} {unit}"


def _unit(kind: str) -> str:
    return "MHz" if kind == "sm_clock" else "W"


def _step(levels: np.ndarray) -> float:
    d = np.diff(np.sort(levels))
    return float(np.median(d)) if d.size else 20.0


def edge_findings(series: LevelSeries, choices: dict[str, Choice], card_range=(None, None),
                  not_engaged: set[float] = frozenset(), several_gpus: bool = False) -> list[Finding]:
    """Choices at the edge of the measured range (say which levels to add), or between levels.
    card_range: the limits every GPU of the run accepts (analyze.card_range); several_gpus: it is several GPUs'."""
    lv = np.sort(series.level_values)
    unit = _unit(series.level_kind)
    step = _step(lv)
    lo_card, hi_card = card_range
    out = []
    low = [p for p, c in choices.items() if c.at_low_edge]
    high = [p for p, c in choices.items() if c.at_high_edge and p != "budget"]
    if low:
        floor = lo_card if lo_card is not None else 0.0
        add = [v for v in (lv[0] - step / 2, lv[0] - step) if v >= floor - 1e-9]
        if lo_card is not None and not add and lv[0] > lo_card:
            add = [lo_card]
        if add:
            out.append(Finding("edge", (
                f"{', '.join(low)}: optimum at the lowest level measured ({_fmt(lv[0], unit)}); the best may lie "
                f"below. Add {_levels_word(add)} {', '.join(_fmt(round(v), unit) for v in add)}"
                + (f" ({'every GPU of the run accepts' if several_gpus else 'the card accepts'} down to "
                   f"{_fmt(lo_card, unit)})." if lo_card is not None else ".")),
                tuple(float(round(v)) for v in add)))
        else:
            out.append(Finding("edge", f"{', '.join(low)}: optimum at the card's lowest accepted setting "
                                       f"({_fmt(lv[0], unit)}); nothing lower can be measured.", (float(lv[0]),)))
    if high and lv[-1] not in not_engaged:
        ceil = hi_card if hi_card is not None else math.inf
        add = [v for v in (lv[-1] + step / 2, lv[-1] + step) if v <= ceil + 1e-9]
        if add:
            out.append(Finding("edge", (
                f"{', '.join(high)}: optimum at the highest level measured ({_fmt(lv[-1], unit)}); add "
                f"{_levels_word(add)} {', '.join(_fmt(round(v), unit) for v in add)} to see whether more is better."),
                tuple(float(round(v)) for v in add)))
    for p, c in choices.items():
        if c.interpolated_value is None or c.at_low_edge:
            continue
        if abs(c.interpolated_value - c.level_value) >= max(step / 4, 1.0):
            out.append(Finding("between-levels", (
                f"{p}: between the measured levels the curve puts this optimum near "
                f"{_fmt(c.interpolated_value, unit)} (measured choice {_fmt(c.level_value, unit)}); "
                f"measure {_fmt(c.interpolated_value, unit)} to confirm."), (c.interpolated_value,)))
    return out


BLIND_GPU_FIX = ("the simulated GPU does not see the real server's work (`--simulate` beside `--server`): its power and "
                 "clocks answer no request, so no limit binds and no reading is busy; these figures show the method "
                 "only. Fix: sweep the real GPU (no --simulate), or the simulated server (no --server)")


def level_findings(levels: pa.Table, target_ci_pct: float | None = None, max_time_s: float | None = None,
                   max_requests: int | None = None, repeats: int = 1, blind_gpu: bool = False,
                   trace: bool = False) -> list[Finding]:
    """Per-level problems: cap not engaged, wide CIs, thermal throttling, failed requests.

    target_ci_pct, max_time_s, max_requests, repeats: the sweep's settings (run.json), so the advice
    for a wide CI aims at the run's own target and names the limit that stopped the level. blind_gpu: a simulated
    GPU beside a real server (run.json `sim_beside_real_server`): the cap and idle findings say that, not their fixes
    for hardware (lower the limits, check --gpus). trace: a `--trace` run (run.json `trace`), whose one window per level
    is the replay itself."""
    rows = levels.to_pylist()
    out = []
    unit = _unit(rows[0]["level_kind"]) if rows else "W"
    ne = [r for r in rows if r.get("cap_not_engaged")]
    if ne:
        vals = tuple(r["level_value"] for r in ne)
        # Several GPUs: each one's own power against its own limit (avg_gpu_power_w is all of them together).
        power = ", ".join(f"{r['level_value']:g} W: {r['cap_not_engaged_gpus']}" if r.get("cap_not_engaged_gpus")
                          else f"{r['level_value']:g} W: {r['avg_gpu_power_w']:.0f} W" for r in ne
                          if r.get("cap_not_engaged_gpus") or r.get("avg_gpu_power_w") is not None)
        bound = [r for r in rows if not r.get("cap_not_engaged") and r.get("avg_gpu_power_w") is not None]
        # Only the highest level, above levels that bound: the card ran there as if unlimited, which is what the
        # others are compared with. "What differs between these levels is not the limit's effect" read as if the
        # whole comparison were void (the README's seed sweep: 300 W at 275 W, 180-260 W all bound).
        top_only = len(ne) == 1 and bound and ne[0]["level_value"] > max(r["level_value"] for r in bound)
        head = (f"cap not engaged at {', '.join(_fmt(v, unit) for v in vals)}: the GPU drew less than the limit "
                f"({power}) and never reported a power-cap clock event, so the limit did not hold the GPU back there: ")
        if blind_gpu:
            msg = head + BLIND_GPU_FIX + "."
        elif top_only:
            msg = head + ("it ran as if unlimited, so its figures are the card's own, the baseline the lower levels "
                          "(where the limit bound) are compared with. Nothing to fix; a level between the highest that "
                          "bound and this one would show where the limit starts to bind.")
        else:
            msg = head + ("what differs between these levels (run-to-run variation, temperature, boost clocks) is not "
                          "the limit's effect" if len(ne) > 1 else "its figures are the GPU's own, not this limit's") + (
                ". Lower the limits, or lock the SM clock instead (powerprof sweep --clocks).")
        out.append(Finding("cap-not-engaged", msg, vals))
    part = [r for r in rows if r.get("cap_not_engaged_gpus") and not r.get("cap_not_engaged")]
    if part:
        vals = tuple(r["level_value"] for r in part)
        out.append(Finding("cap-partly-engaged", (
            "cap bound on some GPUs only: " + "; ".join(f"at {_fmt(r['level_value'], unit)} not on {r['cap_not_engaged_gpus']}"
                                                       for r in part)
            + ": those GPUs drew less than the limit and never reported a power-cap clock event, so the level's "
            "change came from the other GPUs (the slowest sets the pace of a model split across them). "
            "To cap each GPU where it binds, lock the SM clock instead (powerprof sweep --clocks)."), vals))
    coarse = [r for r in rows if r["flags"] and "energy-resolution" in r["flags"].split(",")]
    if coarse:
        out.append(Finding("energy-resolution", _energy_resolution_message(coarse, unit),
                           tuple(r["level_value"] for r in coarse)))
    short = [r for r in rows if r["flags"] and SHORT_WINDOWS_FLAG in r["flags"].split(",")]
    if short:
        out.append(Finding(SHORT_WINDOWS_FLAG, _short_windows_message(short, unit),
                           tuple(r["level_value"] for r in short)))
    instant = [r for r in rows if r["flags"] and INSTANT_POWER_FLAG in r["flags"].split(",")]
    if instant:
        out.append(Finding(INSTANT_POWER_FLAG, _instant_power_message(instant, unit),
                           tuple(r["level_value"] for r in instant)))
    wide = [r for r in rows if r.get("ci_reached_pct") is not None and r["flags"] and "wide-ci" in r["flags"]]
    target = target_ci_pct if target_ci_pct else TARGET_CI_PCT
    for r in wide:
        out.append(Finding("wide-ci", _wide_ci_message(r, unit, target, max_time_s, max_requests, repeats),
                           (r["level_value"],)))
    # Rounds of the same few prompts: more of them pin J/token down for these prompts only.
    few = [r for r in wide if r.get("n_prompts") and r["n_prompts"] < (r.get("n_requests") or 0)]
    if few:
        k = max(r["n_prompts"] for r in few)
        out.append(Finding("few-prompts", (
            f"the requests at {', '.join(_fmt(r['level_value'], unit) for r in few)} repeat {k} distinct "
            f"prompt{'s' if k > 1 else ''}: more rounds narrow the J/token CI for these prompts only; to speak for "
            "a wider workload, add distinct prompts (--prompt-set mixed, --prompts FILE)."),
            tuple(r["level_value"] for r in few)))
    one = [r for r in rows if r["flags"] and "one-window" in r["flags"].split(",")]
    if one:
        out.append(Finding("one-window", _one_window_message(one, rows, unit, trace and repeats <= 1),
                           tuple(r["level_value"] for r in one)))
    few_w = [r for r in rows if r["flags"] and FEW_WINDOWS_FLAG in r["flags"].split(",")]
    if few_w:
        out.append(Finding(FEW_WINDOWS_FLAG, _few_windows_message(few_w, unit, max_requests, max_time_s), tuple(r["level_value"] for r in few_w)))
    th = [r["level_value"] for r in rows if r.get("thermal_throttle")]
    if th:
        out.append(Finding("thermal", (
            f"thermal throttling at {', '.join(_fmt(v, unit) for v in th)}: the clock fell for heat, not for "
            "the limit, so these levels are slower than the limit alone makes them. Improve cooling or "
            "let the card cool between levels, then measure again."), tuple(th)))
    busy = [r for r in rows if r["flags"] and BUSY_HOST_FLAG in r["flags"].split(",")]
    if busy:
        worst = max(busy, key=lambda r: r["other_cpu_pct"])

        def at(r):
            return "the settings as they are" if r["level_value"] is None else _fmt(r["level_value"], unit)

        out.append(Finding(BUSY_HOST_FLAG, (
            f"GPU+CPU J/token at {', '.join(at(r) for r in busy)}: "
            f"{busy_host_text(worst['other_cpu_pct'])} (the most, at {at(worst)}). The GPU "
            f"figures are not affected. Fix: {BUSY_HOST_FIX}."), tuple(r["level_value"] for r in busy)))
    foreign = [r for r in rows if r["flags"] and FOREIGN_FLAG in r["flags"].split(",")]
    if foreign:
        gave_up = [r for r in foreign if "foreign-traffic" in (r.get("stop_rule") or "").split(",")]
        out.append(Finding(FOREIGN_FLAG, (
            f"others' work beside the sweep at {', '.join(_fmt(r['level_value'], unit) for r in foreign)}: another "
            "client's requests on the server, or another process's kernels on the GPU, ran during some of its windows "
            "(windows.parquet `foreign_traffic` says what showed it); those windows are left out of every figure"
            + (f"; at {', '.join(_fmt(r['level_value'], unit) for r in gave_up)} they went on for the level's whole "
               "budget, so its figures rest on an incomplete round and no policy chooses it" if gave_up else
               " and their prompts were measured again")
            + f". Fix: {FOREIGN_FIX}."), tuple(r["level_value"] for r in foreign)))
    idle = [r for r in rows if r["flags"] and NO_BUSY_FLAG in r["flags"].split(",")]
    if idle:
        out.append(Finding(NO_BUSY_FLAG, (
            f"no SM or memory clock figure at {', '.join(_fmt(r['level_value'], unit) for r in idle)}: every GPU "
            "reading inside the level's measured windows was idle (GpuIdle, or 0% utilisation), and an idle reading "
            "shows the clock's floor, not the level's, so the clock figures take busy readings only. The GPU did no "
            "work the sampler saw while tokens were counted: " + (BLIND_GPU_FIX + "." if blind_gpu else
            "a server on another GPU than the one measured, or windows too short for a reading (interval_s). Fix: "
            "check that --gpus names the server's GPU (nvidia-smi shows its process) and measure the level again.")),
            tuple(r["level_value"] for r in idle)))
    failed = [r for r in rows if r.get("n_failed")]
    if failed:
        out.append(Finding("failed", "failed requests (not counted): " + ", ".join(
            f"{_fmt(r['level_value'], unit)}: {r['n_failed']}" for r in failed) + ".",
            tuple(r["level_value"] for r in failed)))
    return out


def _short_windows_message(rows: list[dict], unit: str) -> str:
    """Why the figures of levels read on counter windows under 10 refreshes are not trusted, and the fix."""
    lengths = ", ".join(f"{_fmt(r['level_value'], unit)}: {r['counter_window_s']:.2f} s" for r in rows
                        if r.get("counter_window_s") is not None)
    refresh = [r.get("counter_refresh_s") for r in rows]
    known = [x for x in refresh if x is not None]
    need_s = max(short_counter_window_s(x) for x in refresh)
    how = (f"{need_s:g} s: {SHORT_WINDOW_REFRESHES} × the {max(known) * 1000:.0f} ms refresh estimated from the run's "
           "counter reads" if len(known) == len(refresh) else
           f"{need_s:g} s at a 100 ms refresh, the coarsest drivers use (an H200's): the run's own refresh is not "
           "known (too few counter reads to estimate it)")
    rates = _stream_rates(rows)
    need = int(math.ceil(need_s * max(rates) / 64) * 64) if rates else 0
    ref = [r for r in rows if r.get("reference")]
    return (
        f"median decode window read on the GPU energy counter shorter than {SHORT_WINDOW_REFRESHES} of its refreshes "
        f"({how}): {lengths}. Each window reads a whole number of refresh steps and its edges a few ms after its power "
        "steps, a bias all its windows share (a simulated H200 at 0.3 s: J/token and power 7-10% low under a ±1.2% CI), "
        "which neither the CI nor the pooled figure can see. "
        + _unchosen(ref, "saving is against its figure")
        + f", and no CI target ended them. Fix: longer requests, so each window spans {SHORT_WINDOW_REFRESHES} "
        + "refreshes or more: "
        + (f"--max-tokens {need} or more ({need_s:g} s windows at {max(rates):.0f} tokens/s; "
           f"{ROUNDED_WINDOW_S:g} s windows for ~1%: --max-tokens {max_tokens_for_windows(max(rates))})." if need
           else f"--max-tokens giving windows of {need_s:g} s or more.")
    )


def _stream_rates(rows: list[dict]) -> list[float]:
    """Each level's decode tokens a second per stream (its rate over its concurrency): what a window's length in
    tokens is reckoned from."""
    return [r["decode_tok_s"] / max(int(r.get("concurrency") or 1), 1) for r in rows if r.get("decode_tok_s")]


def _unchosen(ref: list, against: str) -> str:
    """That no policy chooses the levels flagged, save the reference among them (whose figure the savings are against)."""
    return "No policy chooses these levels" + (
        f" but the reference (keeping the default is always a choice), and every {against}" if ref else "")


def _measured_windows(r: dict) -> int:
    """A level row's measured windows: those its J/token rests on (n_windows) and those timed alone, with no energy
    figure (n_windows_tok_s_only; null in rows written before it, whose n_windows counted them)."""
    return int(r.get("n_windows") or 0) + int(r.get("n_windows_tok_s_only") or 0)


def _one_window_message(one: list[dict], rows: list[dict], unit: str, trace: bool) -> str:
    """Why the levels `one` rest on a single window, and the fix that fits: a trace replayed once per level (replay
    it more often), else each level's own cause, failed requests, windows left out, or a level stopped after one (it
    said "a trace replayed once" and "--repeats 3" of a sweep whose windows had failed). The recommendation has no
    resampling spread only where every measured level has one window; otherwise these levels hold still in it."""
    spread = ("the recommendation no resampling spread" if all(_measured_windows(r) <= 1 for r in rows)
              else "resampling holds their figures still, so the choice's 95% range leaves out their uncertainty")
    if trace:
        return (f"one measured window at {', '.join(_fmt(r['level_value'], unit) for r in one)} (a trace replayed "
                f"once per level): its J/token has no confidence interval and {spread}; replay each level more than "
                "once (--repeats 3) to get them.")
    said, fixes = [], []
    for r in one:
        ok, failed = int(r.get("n_requests") or 0), int(r.get("n_failed") or 0)
        n_windows = _measured_windows(r)
        if n_windows > 1:  # several windows timed, one with energy: stats.levels_table
            said.append(f"{_fmt(r['level_value'], unit)} (its J/token rests on 1 of its {n_windows} measured windows: "
                        "the others carry no GPU energy figure, energy_method none in windows.parquet)")
            fixes.append("the run's notes say why those windows have no energy, and the fix (powerprof devices says "
                         "what the GPU can report)")
            continue
        # Requests and windows are one to one at concurrency 1 only (above it, a window is a batch).
        left = ok - 1 if (r.get("concurrency") or 1) == 1 and ok > 1 else 0
        why = []
        if failed:
            why.append(f"{failed} of its {ok + failed} requests failed")
            fixes.append("see why the requests failed (the failed finding counts them; the server's log says why: a "
                         "prompt past its context, a crash)")
        if left:
            why.append(f"{left} of its {ok} measured requests left out")
            fixes.append("the findings above say why its windows were left out, and their fixes")
        if not why:
            why.append("the level stopped after one " + ("request" if (r.get("concurrency") or 1) == 1 else "batch"))
            # From what stopped it: "the level stopped on its budget" was said of levels --max-requests stopped.
            cause, fix = _more_windows_fix(r, None, None)
            fixes.append(f"{fix} (it {cause})" if cause else fix)
        said.append(f"{_fmt(r['level_value'], unit)} ({'; '.join(why)})")
    fixes.append(f"measure again with --min-requests {MIN_CI_WINDOWS} or more and the time to reach it")
    # Where every such level timed several windows, its tok/s has its CI: only the J/token rests on one.
    energy_only = all(_measured_windows(r) > 1 for r in one)
    head, what = ("one window with a J/token", "its J/token has") if energy_only else ("one measured window",
                                                                                       "its J/token and tok/s have")
    return (f"{head} at {', '.join(said)}: {what} no confidence interval, and "
            f"{spread}. Fix: {'; '.join(dict.fromkeys(fixes))}.")


def _few_windows_message(rows: list[dict], unit: str, max_requests: int | None = None,
                         max_time_s: float | None = None) -> str:
    """Why a CI from 2-4 windows is no 95% CI, and each level's fix from what stopped it: it said "a longer --max-time
    (the level stopped on its time budget)" of levels --max-requests had stopped, and "--min-requests 5" beside a
    --max-requests 4 the CLI refuses it with."""
    counts = ", ".join(f"{_fmt(r['level_value'], unit)}: {r['n_windows']}" for r in rows)
    # Each window count present once (two levels of 2 windows said "50.0% at 2; 50% at 2, ..." before).
    covers = ", ".join(f"{(1 - 2.0 ** (1 - n)) * 100:g}% at {n}" for n in sorted({int(r["n_windows"]) for r in rows}))
    by_fix: dict[tuple, list[str]] = {}
    for r in rows:
        by_fix.setdefault(_more_windows_fix(r, max_requests, max_time_s), []).append(_fmt(r["level_value"], unit))
    fixes = "; ".join(f"{', '.join(levels)} {cause}: {fix}" if cause else fix for (cause, fix), levels in by_fix.items())
    return (
        f"fewer than {MIN_CI_WINDOWS} measured windows ({counts}): the bootstrap CI of a median of n windows covers "
        f"the truth at most 1 - 2^(1-n) of the time (here {covers}), not the 95% "
        f"it is labelled, so its ± is narrower than it should be. Fix: {fixes}.")


def _more_windows_fix(r: dict, max_requests: int | None, max_time_s: float | None) -> tuple[str | None, str]:
    """(what stopped level row `r`, None unknown; what gives it MIN_CI_WINDOWS windows), from its flags and stop_rule
    (sweep.stop_reason). Above concurrency 1 a window is a batch, so that many windows take about as many times the
    requests."""
    rules = set(filter(None, (r.get("stop_rule") or "").split(",")))
    c = max(int(r.get("concurrency") or 1), 1)
    need = f"{MIN_CI_WINDOWS * c}" if c == 1 else f"about {MIN_CI_WINDOWS * c}"
    if "interrupted" in (r.get("flags") or "").split(","):
        return "interrupted", "let the level finish (measure it again and let the sweep run to its end)"
    if "max-requests" in rules:
        return (f"stopped at --max-requests{f' {max_requests}' if max_requests else ''}",
                f"raise it to {need} or more (and --min-requests with it)")
    if "max-time" in rules:
        return (f"stopped on --max-time{f' {max_time_s:g} s' if max_time_s else ''}",
                f"a longer --max-time (a level stops on it once it has 2 windows), and --min-requests {need} or more")
    if rules & {"ci-reached", "paired-ci-reached"}:
        return "stopped with its CI judged reached", f"--min-requests {need} or more"
    if "trace-replayed" in rules:
        return "replayed the trace", f"--repeats {MIN_CI_WINDOWS} or more"
    if "foreign-traffic" in rules:
        return ("gave up on others' work beside it", "measure while nothing else runs on the GPU (the foreign-traffic "
                                                     "finding)")
    return None, (f"a longer --max-time or a higher --max-requests, and --min-requests {MIN_CI_WINDOWS} or more with "
                  "the time to reach it")


def _energy_resolution_message(rows: list[dict], unit: str) -> str:
    """Why the median J/token of these levels is off (energy.counter_rounding_bound) and the fix."""
    gaps = ", ".join(
        f"{_fmt(r['level_value'], unit)}: {r['gpu_j_per_token']:.4g} vs {r['gpu_j_per_token_pooled']:.4g} "
        f"({(r['gpu_j_per_token'] / r['gpu_j_per_token_pooled'] - 1) * 100:+.1f}%"
        + (f", CI ±{r['ci_reached_pct']:.1f}%" if r.get("ci_reached_pct") is not None else "") + ")"
        for r in rows)
    window_s = ROUNDED_WINDOW_S
    rates = _stream_rates(rows)
    need = max_tokens_for_windows(max(rates)) if rates else None
    ref = [r for r in rows if r.get("reference")]
    return (
        f"median J/token off the pooled figure (energy summed ÷ tokens summed, gpu_j_per_token_pooled) by more "
        f"than its CI: {gaps}. The decode windows are short against the GPU energy counter's refresh (10-100 ms): "
        "each window reads a whole number of refresh steps, and the median of windows of one length lands on one "
        "rounding instead of their mean, a bias the CI cannot see; the pooled figure averages it out. "
        + _unchosen(ref, "energy saving is against its biased median")
        + ". Fix: longer requests, so each window spans many refreshes: "
        + (f"--max-tokens {need} or more ({window_s:g} s windows at {max(rates):.0f} tokens/s)." if need
           else f"--max-tokens giving windows of {window_s:g} s or more.")
    )


def _instant_power_message(rows: list[dict], unit: str) -> str:
    """Why J/token integrated from instant power over short windows is biased (profiler.POWER_EDGE_BIAS_WINDOW_S)."""
    rates = _stream_rates(rows)
    need = max_tokens_for_windows(max(rates)) if rates else 0
    need = int(math.ceil(need * POWER_EDGE_BIAS_WINDOW_S / ROUNDED_WINDOW_S / 64) * 64) if need else 0
    return (
        f"J/token at {', '.join(_fmt(r['level_value'], unit) for r in rows)} is integrated from power readings "
        "(energy_method power_integration: this GPU has no energy counter, or it broke over those windows, or, in runs "
        "before windows shorter than its refresh were left without a figure, they were), at 1 Hz "
        "and at each window's edges, over "
        f"decode windows under {POWER_EDGE_BIAS_WINDOW_S:g} s. A card refreshes that reading every ~100 ms, so the "
        "read just after a window's first token can still show the power before it: on the simulated A100 that "
        "biased pooled J/token by up to -4% at 1 s windows and -10% at 0.3 s (-0.65% at 5 s), unevenly across "
        "levels, so savings between them carry it too. Fix: longer requests, "
        + (f"--max-tokens {need} or more ({POWER_EDGE_BIAS_WINDOW_S:g} s windows at {max(rates):.0f} tokens/s)."
           if need else f"--max-tokens giving windows of {POWER_EDGE_BIAS_WINDOW_S:g} s or more.")
    )


def _wide_ci_message(r: dict, unit: str, target_pct: float, max_time_s: float | None,
                     max_requests: int | None, repeats: int) -> str:
    n = max(int(r["n_requests"] or 0), 2)
    ci = r["ci_reached_pct"]
    # The CI half-width shrinks as 1/sqrt(n): (ci/target)^2 times the requests reach the target.
    scale = (ci / target_pct) ** 2
    need = int(math.ceil(n * scale))
    head = (f"{_fmt(r['level_value'], unit)}: J/token known only to ±{ci:.1f}% ({n} requests); "
            f"about {need} requests would reach ±{target_pct:g}%")
    rules = set(filter(None, (r.get("stop_rule") or "").split(",")))
    advice = []
    if "max-time" in rules:
        if max_time_s:
            # Requests per second the level achieved over all its visits (repeats x pooled runs),
            # and the time per visit that, at that rate, gathers `need` requests in all.
            visits = max(int(repeats or 1), 1) * max(int(r.get("n_runs") or 1), 1)
            rate = n / (max_time_s * visits)
            secs = int(math.ceil(need / rate / visits))
            advice.append(f"stopped by --max-time {max_time_s:g} s at about {rate:.2g} requests/s: "
                          f"--max-time {secs} would fit them")
        else:
            advice.append(f"stopped by --max-time: raise it about {scale:.1f}-fold")
    if "max-requests" in rules or ("max-time" in rules and max_requests and need > max_requests):
        advice.append(f"--max-requests {need}")
    if not advice and rules == {"ci-reached"}:
        # The sweep's own check passed; the analysis' bootstrap is wider. Force more requests.
        advice.append(f"the sweep judged its target reached; --min-requests {need} forces more")
    if not advice:
        advice.append(f"--max-requests {need}")
    return f"{head} ({'; '.join(advice)})."


def saving_within_noise(choice: Choice, table: pa.Table, reference_value: float) -> tuple[float, float] | None:
    """The energy-saving CI (low, high, %) of a choice that is not the reference and whose saving the CI
    does not tell from none (low ≤ 0); None otherwise. On a flat J/token curve the least J/token
    within the budget is whichever level the noise favoured: it was recommended as "2.9% less energy"
    at a real slowdown, though the truth was no saving at all."""
    if choice.level_value == reference_value:
        return None
    for r in table.to_pylist():
        if r["level_value"] == choice.level_value:
            lo, hi = r.get("energy_saving_pct_ci_low"), r.get("energy_saving_pct_ci_high")
            if lo is not None and hi is not None and lo <= 0:
                return float(lo), float(hi)
    return None


def saving_findings(choices: dict[str, Choice], table: pa.Table, reference_value: float, unit: str,
                    primary: str) -> list[Finding]:
    """The recommended level's saving is within noise: say so, and that the reference loses nothing."""
    c = choices.get(primary)
    ci = saving_within_noise(c, table, reference_value) if c is not None else None
    if ci is None:
        return []
    return [Finding("no-clear-saving", (
        f"{primary}: {c.level_value:g} {unit} saves {c.energy_saving_pct:.1f}% energy per token, 95% CI "
        f"[{ci[0]:.1f}, {ci[1]:.1f}]%: not told from no saving, at "
        f"{loss_text(c.speed_loss_pct, c.params.get('max_slowdown') if c.policy == 'budget' else None)}% slower. Keep "
        f"{reference_value:g} {unit}, or measure more requests per level (more distinct prompts) to settle it."),
        (c.level_value,))]


def choice_findings(choices: dict[str, Choice], unit: str = "W") -> list[Finding]:
    out = []
    for p, c in choices.items():
        if c.stability < UNSTABLE_SHARE:
            out.append(Finding("unstable-choice", (  # "260 in 67% ..., between 220 and 260" had no unit
                f"{p}: uncertain choice: {_fmt(c.level_value, unit)} in {c.stability:.0%} of bootstrap resamples, "
                f"95% of them between {_fmt(c.ci_low, unit)} and {_fmt(c.ci_high, unit)}; more requests per level "
                "would settle it."),
                (c.ci_low, c.ci_high)))
    return out


def timing_findings(windows) -> list[Finding]:
    """Windows left out of every figure because their token timing could not be trusted (arrival.py)."""
    from collections import Counter

    from powerprof.arrival import left_out_text, reason_group

    from .stats import _col, figure_kind, window_masks

    measured, _, _ = window_masks(windows)
    timing = _col(windows, "timing", object)
    reasons = _col(windows, "timing_reason", object)
    warm = _col(windows, "warmup", bool)
    status = _col(windows, "status", object)
    # Only windows of the kind the figures use (requests at concurrency 1, batches above, a trace run's replays).
    kind = figure_kind(windows)
    bad = [i for i in range(windows.num_rows) if timing[i] == "untrusted" and not warm[i] and status[i] in (None, "ok")
           and kind[i]]
    if not bad:
        return []
    groups = Counter(reason_group(reasons[i]) for i in bad)
    return [Finding("untrusted-timing", left_out_text(dict(groups), len(bad) + int(measured.sum()), "every figure",
                                                      "their token timing cannot be trusted"))]


def impossible_findings(windows) -> list[Finding]:
    """Windows left out of every figure because a figure in them cannot be or contradicts its parts
    (stats.impossible_reasons), counted among the windows that would otherwise be measured, per reason and level."""
    from .stats import _col, eligible_windows, impossible_reasons

    eligible = eligible_windows(windows)
    reasons = {why: rows & eligible for why, rows in impossible_reasons(windows).items()}
    bad = np.zeros(windows.num_rows, bool)
    for rows in reasons.values():
        bad |= rows
    if not bad.any():
        return []
    kinds = _col(windows, "level_kind", object)
    values = _col(windows, "level_value")
    per = {}
    for k, v in zip(kinds[bad], values[bad]):
        per[(k, v)] = per.get((k, v), 0) + 1
    where = ", ".join(f"{_fmt(v, _unit(k))}: {n}" for (k, v), n in sorted(per.items(), key=lambda x: (str(x[0][0]), x[0][1])))
    why = "; ".join(f"{why} ({int(rows.sum())})" for why, rows in reasons.items() if rows.any())
    return [Finding("impossible-figures", (
        f"{int(bad.sum())} of {int(eligible.sum())} windows left out of every figure ({where}): {why}. No measurement "
        "writes these: windows.parquet was changed or damaged; measure those levels again."),
        tuple(sorted({float(v) for v in values[bad]})))]


def no_energy_findings(windows) -> list[Finding]:
    """Measured windows without a GPU energy (gpu_energy_j and gpu_j_per_token missing) beside others that have one:
    they count in tok/s but in no J/token figure. One such window left its level's J/token over the others alone,
    unsaid. Not said where no window has an energy (energy_method none: that is said as such)."""
    from .stats import _col, _j_per_token, window_masks

    measured = window_masks(windows)[0]
    if not measured.any():
        return []
    method = _col(windows, "energy_method", object)
    has = np.isfinite(_j_per_token(windows))
    without = measured & ~has & np.array([m not in (None, "none") for m in method], dtype=bool)
    if not without.any() or not (measured & has).any():
        return []
    kinds, values = _col(windows, "level_kind", object), _col(windows, "level_value")
    per: dict = {}
    for k, v in zip(kinds[without], values[without]):
        per[(k, v)] = per.get((k, v), 0) + 1
    where = ", ".join(f"{_fmt(v, _unit(k))}: {n}" for (k, v), n in sorted(per.items(), key=lambda x: (str(x[0][0]), x[0][1])))
    return [Finding("no-energy", (
        f"{int(without.sum())} of {int(measured.sum())} measured windows have no GPU energy ({where}): gpu_energy_j and "
        "gpu_j_per_token are missing, so they count in tok/s but in no J/token figure, which is over the other windows "
        "alone. A sweep writes an energy for every window it keeps: windows.parquet was changed or damaged, or an "
        "energy read failed; measure those levels again if their J/token matters."),
        tuple(sorted({float(v) for v in values[without]})))]


def unmeasured_level_findings(runs, windows) -> list[Finding]:
    """The plan's visits a run never measured: levels (run.json settings.levels) with no measured window at all, and,
    where every level has some, a repeat (settings.repeats) or a configuration (a grid's `configs_planned`) of a level
    with none. A sweep killed (kill -9, a crash) before them was analysed as if they had never been asked for; a
    repeat or configuration missing was not said at all. Configurations that failed are config-not-measured's."""
    from .stats import _col, window_masks

    measured = window_masks(windows)[0]
    run_id, value, repeat = _col(windows, "run_id", object), _col(windows, "level_value"), _col(windows, "repeat")
    config, context = _col(windows, "config_id", object, None), _col(windows, "context_tokens")
    out = []
    for r in runs:
        st = r.meta.get("settings") if isinstance(r.meta.get("settings"), dict) else {}
        kind, planned = st.get("level_kind"), st.get("levels")
        if kind not in ("power_limit", "sm_clock") or not isinstance(planned, list):
            continue
        mine = np.array([x == r.run_id for x in run_id], dtype=bool) if windows.num_rows else np.zeros(0, bool)
        if not mine.any():
            if len(runs) > 1:
                continue
            mine = np.ones(windows.num_rows, bool)  # windows written under another run id: all of them are the run's
        idx = np.flatnonzero(measured & mine & np.isfinite(value))
        got = value[idx]
        levels = list(dict.fromkeys(float(v) for v in planned if v is not None))
        missing = [v for v in levels if not np.any(np.abs(got - v) < 1e-6)]
        unit = "MHz" if kind == "sm_clock" else "W"
        prefix = f"{r.path}: " if len(runs) > 1 else ""
        parts = []
        if missing:
            one = len(missing) == 1
            parts.append(
                f"{', '.join(_fmt(v, unit) for v in missing)} {'was' if one else 'were'} planned (run.json "
                f"settings.levels) but {'has' if one else 'have'} no measured window: the run stopped before "
                f"{'it' if one else 'them'} (killed or cut short), or every window there was left out; the figures and "
                f"the recommendation are over the levels measured alone. Measure {'it' if one else 'them'} to complete "
                "the curve.")
        # Each visit the plan holds: (level, repeat, configuration, context), as run.json levels_done names them.
        cells = {(round(float(value[i]), 6), int(repeat[i]) if np.isfinite(repeat[i]) else 0, config[i],
                  None if not np.isfinite(context[i]) else int(context[i])) for i in idx}
        reps = st.get("repeats") if isinstance(st.get("repeats"), int) and st.get("repeats") > 0 else 1
        # Configuration by configuration, pass by pass, as the run goes (its levels in settings.levels' order).
        gaps = [(v, k, c, n) for c, n in _planned_configs(r.meta) for k in range(reps) for v in levels
                if v not in missing and (round(v, 6), k, c, n) not in cells]
        if gaps:
            shown = [_gap_name(v, k, reps, c, n, unit) for v, k, c, n in gaps]
            shown = "; ".join(shown[:8]) + (f"; and {len(shown) - 8} more" if len(shown) > 8 else "")
            parts.append(
                f"{len(gaps)} planned visit{'s' if len(gaps) > 1 else ''} of measured levels "
                f"{'has' if len(gaps) == 1 else 'have'} no measured window ({shown}): the run stopped before "
                f"{'it' if len(gaps) == 1 else 'them'} (killed or cut short), or every window there was left out; those "
                f"levels' figures rest on the {'repeats' if reps > 1 else 'visits'} measured alone, so they are not "
                "compared over the same plan as the others. Measure the run again (or the missing visits) to complete it.")
        if parts:
            out.append(Finding("unmeasured-levels", prefix + " ".join(parts),
                               tuple(dict.fromkeys(missing + [v for v, *_ in gaps]))))
    return out


def _planned_configs(meta: dict) -> list[tuple]:
    """(config_id, context_tokens) of each configuration a run planned and began measuring: run.json `configs_planned`
    (a grid's whole plan), else its `configs` (those begun), less those that failed (config-not-measured says them);
    [(None, None)] for a plain sweep."""
    planned = meta.get("configs_planned")
    if not isinstance(planned, list):
        planned = [[c.get("config_id"), c.get("context_tokens")] for c in meta.get("configs") or [] if isinstance(c, dict)]
    failed = {(c.get("config_id"), c.get("context_tokens")) for c in meta.get("configs") or []
              if isinstance(c, dict) and c.get("status") not in (None, "ok")}
    out = [(c[0], c[1]) for c in planned if isinstance(c, (list, tuple)) and len(c) == 2 and tuple(c) not in failed]
    return list(dict.fromkeys(out)) or ([(None, None)] if not planned else [])


def _gap_name(level: float, rep: int, reps: int, config_id, context_tokens, unit: str) -> str:
    """`260 W, repeat 2 of 3`, `draft=2 at 260 W`, `draft=2 (8192 context tokens) at 260 W, repeat 1 of 2`."""
    at = _fmt(level, unit)
    if config_id is not None or context_tokens is not None:
        ctx = f" ({context_tokens} context tokens)" if context_tokens is not None else ""
        at = f"{config_id or 'the server as launched'}{ctx} at {at}"
    return at + (f", repeat {rep + 1} of {reps}" if reps > 1 else "")


def nothing_measured_text(windows, failed: int) -> str:
    """Why no window at any level is measured, each reason with its count and its fix: the failed requests (the
    server's answers), and the windows left out of every figure (untrusted timing, others' work beside them,
    impossible figures). Every reason is named: a run whose streams all came through a buffering proxy (every
    window untrusted) was told "0 requests failed ... fix the server"."""
    from .stats import _col, eligible_windows, figure_kind, foreign_windows

    warm = _col(windows, "warmup", bool)
    status = _col(windows, "status", object)
    timing = _col(windows, "timing", object)
    # Windows of the kind the figures take (requests at concurrency 1, batches above, a trace run's replay rows alone:
    # its request rows counted too said 18 windows of 2 replays), not warm-up, succeeded: what was left out, and why.
    usable = ~warm & np.array([st in (None, "ok") for st in status], dtype=bool) & figure_kind(windows)
    foreign = usable & foreign_windows(windows)
    untrusted = usable & ~foreign & np.array([t == "untrusted" for t in timing], dtype=bool)
    parts = []
    if failed:
        parts.append(f"{failed} requests failed (status not ok): the windows' error column says why (the server's "
                     "answer); fix the server and measure again")
    if untrusted.any():
        parts.extend(f.message for f in timing_findings(windows))
    if foreign.any():
        parts.append(f"{int(foreign.sum())} windows ran beside others' work (windows.parquet foreign_traffic says "
                     f"what showed it) and are left out of every figure; fix: {FOREIGN_FIX}")
    if (eligible_windows(windows)).any():
        parts.extend(f.message for f in impossible_findings(windows))
    if not parts:
        parts.append("every window is warm-up or missing; measure the levels again")
    return "no measured windows at any level: " + "; ".join(parts)


def sample_findings(implausible: dict) -> list[Finding]:
    """Sensor readings left out of the per-level sensor figures as implausible (engine.PLAUSIBLE_POWER_FACTOR), one
    finding per samples file: how many of how many, at which levels, the bound, and the fix.
    implausible: {samples path: {"max_limit_w", "levels": {(level_kind, level_value): engine.LevelSums}}}."""
    from .engine import PLAUSIBLE_POWER_FACTOR  # noqa: PLC0415

    out = []
    for path, d in implausible.items():
        sums = d["levels"]
        parts = []
        for what, bad_of, n_of, rule in (
                ("GPU power", lambda s: s.power_bad_n, lambda s: s.power_n + s.power_bad_n,
                 "zero, negative, not a number or over " + (
                     f"{PLAUSIBLE_POWER_FACTOR * d['max_limit_w']:g} W ({PLAUSIBLE_POWER_FACTOR:g}× the card's highest "
                     f"limit, {d['max_limit_w']:g} W)" if d.get("max_limit_w") else
                     f"{PLAUSIBLE_POWER_FACTOR:g}× the sample's own power limit") + ", which no board draws"),
                ("SM clock", lambda s: s.clock_bad_n, lambda s: s.clock_n + s.clock_bad_n, "negative or not a number")):
            bad = sum(bad_of(s) for s in sums.values())
            if not bad:
                continue
            where = ", ".join(f"{_fmt(v, _unit(k))}: {bad_of(s)}" for (k, v), s in
                              sorted(sums.items(), key=lambda x: (str(x[0][0]), x[0][1])) if bad_of(s))
            parts.append(f"{bad} of {sum(n_of(s) for s in sums.values())} {what} readings ({where}): {rule}")
        levels = tuple(sorted({float(v) for (_, v), s in sums.items() if s.power_bad_n or s.clock_bad_n}))
        out.append(Finding("implausible-samples", (
            f"{path}: {'; '.join(parts)}. They are left out of the levels' sensor figures (sample power, clocks, the "
            "cap-not-engaged rule); the windows' J/token and tok/s do not use them. A sensor glitch or an edited file: "
            "fix: check the GPU's readings (nvidia-smi -q -d POWER,CLOCK) and measure those levels again if many are "
            "left out."), levels))
    return out


def fit_findings(fits: dict[str, ModelFit]) -> list[Finding]:
    out = []
    for q, f in fits.items():
        if not f.ok:
            out.append(Finding("fit", f"no {q} model: {f.message}"))
        elif f.r2 is not None and f.r2 < POOR_FIT_R2:
            out.append(Finding("fit", (
                f"the {f.model} model fits {q} poorly (R² = {f.r2:.2f}); trust the measured levels and the "
                "monotone interpolation, not the model's extrapolation.")))
    return out
