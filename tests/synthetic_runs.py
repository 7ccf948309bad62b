"""Synthetic sweep run directories with a known truth: a test fixture for the analysis.

A `Truth` gives decode tok/s, GPU power and SM clock as functions of the level; requests scatter
around it with multiplicative noise. Warm-up and failed rows carry absurd values on purpose:
an analysis that counted them would be visibly wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from powerprof.collectors.clock_reasons import REASON_HW_THERMAL, REASON_SW_POWER_CAP
from powerprof.sim.gpu import Phase, SimGpu
from powerprof.sim.profiles import get_profile
from powerprof.storage.runs import RunWriter
from powerprof.storage.schema import SAMPLES, WINDOWS

from powerprof.analysis.stats import summarize_levels


@dataclass(frozen=True)
class Truth:
    """Noise-free behaviour of a card at a level (vectorised over levels)."""

    tok_s: Callable[[np.ndarray], np.ndarray]
    power_w: Callable[[np.ndarray], np.ndarray]
    sm_clock_mhz: Callable[[np.ndarray], np.ndarray]
    gpu_name: str = "Synthetic GPU"
    min_limit_w: float = 100.0
    max_limit_w: float = 400.0
    default_limit_w: float = 300.0

    def j_per_token(self, levels) -> np.ndarray:
        lv = np.asarray(levels, dtype=float)
        return self.power_w(lv) / self.tok_s(lv)


def seed_truth(profile: str = "seed-16g") -> Truth:
    """The simulator's physics for a profile (seed-16g: the seed's 300 → 220 W study)."""
    p = get_profile(profile)
    c = p.workload.decode_compute_share

    def at(levels):
        gpu = SimGpu(p, 0, "GPU-synthetic", clock_ns=lambda: 0)
        gpu.set_phase(Phase("decode", c))
        out = []
        for L in np.atleast_1d(levels):
            gpu.set_limit_w(float(L))
            r = gpu.read()
            out.append((p.workload.decode_tok_s * gpu.speed_factor(), r["power_w"], r["sm_clock_mhz"]))
        return np.array(out, dtype=float).reshape(-1, 3)

    return Truth(
        tok_s=lambda L: at(L)[:, 0],
        power_w=lambda L: at(L)[:, 1],
        sm_clock_mhz=lambda L: at(L)[:, 2],
        gpu_name=p.name,
        min_limit_w=p.min_limit_w,
        max_limit_w=p.max_limit_w,
        default_limit_w=p.default_limit_w,
    )


def bowl_truth(l_opt_w: float = 230.0, j_opt: float = 2.5, curvature: float = 3.0, t_max: float = 100.0,
               l_sat_w: float = 290.0, alpha: float = 0.35) -> Truth:
    """J/token a parabola with its minimum at `l_opt_w`; tok/s a saturating power law (T_max above l_sat_w)."""

    def tok(L):
        L = np.asarray(L, dtype=float)
        return t_max * (np.minimum(L, l_sat_w) / l_sat_w) ** alpha

    def jpt(L):
        L = np.asarray(L, dtype=float)
        return j_opt * (1 + curvature * ((L - l_opt_w) / l_opt_w) ** 2)

    return Truth(
        tok_s=tok,
        power_w=lambda L: jpt(L) * tok(L),
        sm_clock_mhz=lambda L: 600 + 1800 * (np.minimum(np.asarray(L, float), l_sat_w) / l_sat_w),
        gpu_name="Synthetic bowl GPU",
        min_limit_w=100.0,
        max_limit_w=400.0,
        default_limit_w=350.0,
    )


def make_run(
    out_dir: Path,
    truth: Truth,
    levels=(180, 220, 260, 300),
    n_requests: int = 30,
    noise: float = 0.01,
    seed: int = 0,
    run_id: str | None = None,
    model: str = "synthetic-model.gguf",
    repeats: int = 1,
    concurrency: int = 1,
    n_warmup: int = 2,
    n_failed: int = 1,
    decode_tokens: int = 255,
    sample_period_s: float = 1.0,
    thermal_levels=(),
    start: datetime | None = None,
) -> Path:
    """Write samples/windows/levels Parquet and run.json like a sweep would; returns the directory."""
    rng = np.random.default_rng(seed)
    run_id = run_id or f"synthetic-{seed}"
    t0 = start or datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc)
    lv = np.asarray(levels, dtype=float)
    tok_true, p_true, f_true = truth.tok_s(lv), truth.power_w(lv), truth.sm_clock_mhz(lv)
    windows, samples = [], []
    t = 0.0  # seconds since the run's start
    req_id = 0
    for rep in range(repeats):
        for li in np.argsort(-lv):  # descending, as the sweep visits by default
            L = float(lv[li])
            level_t0 = t
            for k in range(n_warmup + n_requests + n_failed):
                warm = k < n_warmup
                failed = k >= n_warmup + n_requests
                tok = tok_true[li] * np.exp(rng.normal(0, noise))
                pw = p_true[li] * np.exp(rng.normal(0, noise))
                if warm:  # a cold cache: absurdly slow; counting it would show
                    tok, pw = tok / 3, pw * 2
                decode_s = decode_tokens / tok
                ttft = 0.2
                send = t
                first = send + ttft
                last = first + decode_s
                energy = pw * decode_s
                row = {
                    "run_id": run_id, "level_kind": "power_limit", "level_value": L, "repeat": rep,
                    "window_kind": "request", "request_id": req_id, "batch_id": req_id, "concurrency": 1,
                    "warmup": warm, "status": "failed" if failed else "ok", "api": "llamacpp", "model": model,
                    "prompt_id": f"p{k % 4}", "t_send_utc": t0 + timedelta(seconds=send),
                    "t_first_utc": t0 + timedelta(seconds=first), "t_last_utc": t0 + timedelta(seconds=last),
                    "ttft_s": ttft, "prompt_tokens": 64,
                }
                if failed:
                    row.update(error="server closed the stream", decode_tok_s=tok * 100, gpu_j_per_token=0.001)
                else:
                    row.update(
                        decode_s=decode_s, generated_tokens=decode_tokens + 1, decode_tokens=decode_tokens,
                        decode_tok_s=tok, gpu_energy_j=energy, cpu_energy_j=25.0 * decode_s, energy_method="counter",
                        avg_gpu_power_w=pw, gpu_j_per_token=energy / decode_tokens,
                        total_j_per_token=(energy + 25.0 * decode_s) / decode_tokens, idle_gpu_power_w=22.0,
                        above_idle_gpu_j_per_token=(energy - 22.0 * decode_s) / decode_tokens,
                        stop_reason="length", low_confidence=decode_s < 3.0,
                    )
                windows.append(row)
                req_id += 1
                t = last + 0.05
            if concurrency > 1:
                windows.extend(_batch_rows(run_id, L, rep, concurrency, tok_true[li], p_true[li], n_requests,
                                           decode_tokens, noise, rng, model, t0, level_t0))
            samples.extend(_level_samples(L, level_t0, t, p_true[li], f_true[li], truth, sample_period_s,
                                          L in thermal_levels, rng, t0))
            t += 2.0
    w = pa.Table.from_pylist(windows, schema=WINDOWS)
    s = pa.Table.from_pylist(samples, schema=SAMPLES)
    meta = {
        "run_id": run_id, "kind": "sweep", "gpu_name": truth.gpu_name, "gpu_uuid": "GPU-synthetic-0", "model": model,
        "min_limit_w": truth.min_limit_w, "max_limit_w": truth.max_limit_w,
        "default_limit_w": truth.default_limit_w, "level_kind": "power_limit", "levels": [float(x) for x in lv],
        "simulated": True, "synthetic": True, "command": "tests/synthetic_runs.py:make_run",
        "started_utc": t0.isoformat(),
    }
    writer = RunWriter(Path(out_dir), meta)
    writer.write("samples", s)
    writer.write("windows", w)
    writer.write("levels", summarize_levels(w, truth.default_limit_w, run_id=run_id, n_boot=500, seed=seed))
    return Path(out_dir)


def _batch_rows(run_id, L, rep, conc, tok1, pw, n, decode_tokens, noise, rng, model, t0, level_t0):
    """Concurrent batches: aggregate tok/s grows sublinearly with concurrency, power a little."""
    rows = []
    for b in range(max(2, n // conc)):
        tok = tok1 * conc**0.7 * np.exp(rng.normal(0, noise))
        p = pw * 1.05 * np.exp(rng.normal(0, noise))
        dur = decode_tokens * conc / tok
        rows.append({
            "run_id": run_id, "level_kind": "power_limit", "level_value": L, "repeat": rep, "window_kind": "batch",
            "batch_id": 10_000 + b, "concurrency": conc, "warmup": False, "status": "ok", "model": model,
            "t_first_utc": t0 + timedelta(seconds=level_t0), "t_last_utc": t0 + timedelta(seconds=level_t0 + dur),
            "decode_s": dur, "decode_tokens": decode_tokens * conc, "decode_tok_s": tok, "gpu_energy_j": p * dur,
            "avg_gpu_power_w": p, "gpu_j_per_token": p / tok, "energy_method": "counter",
        })
    return rows


def _level_samples(L, t_start, t_end, power, clock, truth, period, thermal, rng, t0):
    ts = np.arange(t_start, t_end, period)
    engaged = power >= 0.95 * L
    reasons = (REASON_SW_POWER_CAP if engaged else 0) | (REASON_HW_THERMAL if thermal else 0)
    return [
        {
            "time_utc": t0 + timedelta(seconds=float(x)), "t_mono_s": float(x), "seq": i, "source": "nvml",
            "device": "gpu0", "gpu_index": 0, "gpu_uuid": "GPU-synthetic-0",
            "power_w": float(power * (1 + rng.normal(0, 0.01))), "power_avg_w": float(power),
            "sm_clock_mhz": float(clock), "mem_clock_mhz": 10251.0, "gpu_util_pct": 100.0,
            "temperature_c": 88.0 if thermal else 65.0, "power_limit_w": float(L), "enforced_limit_w": float(L),
            "clock_event_reasons": reasons, "level_kind": "power_limit", "level_value": float(L),
        }
        for i, x in enumerate(ts)
    ]


def counter_windows(profile: str, limit_w: float, window_s: float, n: int = 400, seed: int = 0,
                    counter_step_s: float | None = None, run_id: str = "counter-0") -> tuple[list[dict], float]:
    """Decode windows of about `window_s` each on the simulated card at `limit_w`, their energy read
    from its energy counter at the edges as the profiler does (the counter moves in refresh steps),
    in virtual time. Four prompts draw slightly different power; the client's turn and the prefill
    before each window take random times, so windows start at any phase of the refresh. Returns (window rows, the true pooled
    J/token: the simulator's true energy summed ÷ tokens summed)."""
    import dataclasses

    p = get_profile(profile)
    if counter_step_s is not None:
        p = dataclasses.replace(p, energy_counter_update_s=counter_step_s)
    clock = [10**12]
    gpu = SimGpu(p, 0, "GPU-counter", clock_ns=lambda: clock[0], limit_w=limit_w, record_history=True)
    rng = np.random.default_rng(seed)
    rows, true_j, tokens_all = [], 0.0, 0
    for k in range(n):
        share = p.workload.decode_compute_share * (1 + 0.2 * (k % 4))
        # Back to back as a load generator sends them: the client's turn (idle), then the prefill.
        clock[0] += int(rng.uniform(0.001, 0.005) * 1e9)
        gpu.set_phase(Phase("prefill", 0.9))
        clock[0] += int(rng.uniform(0.003, 0.03) * 1e9)
        gpu.set_phase(Phase("decode", share))
        tok_s = p.workload.decode_tok_s * gpu.speed_factor()
        tokens = max(int(round(window_s * tok_s)), 1)
        decode_s = tokens / tok_s
        t0, e0 = clock[0], gpu.counter_energy_j()
        clock[0] += int(decode_s * 1e9)
        e = gpu.counter_energy_j() - e0
        true_j += gpu.true_energy_at_j(clock[0]) - gpu.true_energy_at_j(t0)
        tokens_all += tokens
        gpu.set_phase(Phase("idle"))
        rows.append({
            "run_id": run_id, "level_kind": "power_limit", "level_value": float(limit_w), "repeat": 0,
            "window_kind": "request", "request_id": k, "batch_id": k, "concurrency": 1, "warmup": False,
            "status": "ok", "prompt_id": f"p{k % 4}", "decode_s": decode_s, "decode_tokens": tokens,
            "generated_tokens": tokens + 1, "decode_tok_s": tok_s, "gpu_energy_j": e, "energy_method": "counter",
            "avg_gpu_power_w": e / decode_s, "gpu_j_per_token": e / tokens, "cpu_energy_j": None,
            "timing": "stream", "low_confidence": decode_s < 10.0,
        })
    return rows, true_j / tokens_all


def make_concurrent_run(out_dir: Path, truth: Truth, concurrency: int, **kw) -> Path:
    """A `sweep --concurrency N` run (N > 1): its batch windows alone, as the sweep writes (make_run adds requests at
    concurrency 1 beside them, a second series)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out = make_run(out_dir, truth, concurrency=concurrency, **kw)
    w = pq.read_table(out / "windows.parquet")
    batches = w.filter(pc.equal(w["window_kind"], "batch"))
    pq.write_table(batches, out / "windows.parquet")
    pq.write_table(summarize_levels(batches, truth.default_limit_w, run_id=batches["run_id"][0].as_py(), n_boot=200),
                   out / "levels.parquet")
    return out


def make_grid_run(out_dir: Path, truths: dict, levels=(180, 220, 260, 300), n_requests: int = 12,
                  level_edits=None, levels_done=None, seed: int = 0) -> Path:
    """A configuration sweep's run directory (powerprof/grid.py) with one knob, `draft`: truths is
    {draft value: Truth}; each configuration is a make_run at its own hour, its rows tagged as
    the grid tags them. level_edits {(draft, level): {column: value}} overwrite levels rows (the
    sweep's own flags: thermal_throttle, flags; config_status, config_error); levels_done [[level, repeat, config_id, None]]
    replaces the list of finished visits (default: every one)."""
    import json

    import pyarrow.parquet as pq

    from powerprof.storage.schema import LEVELS, rows_to_table, with_knob_columns

    out_dir = Path(out_dir)
    windows, lv, samples, meta = [], [], [], None
    t0 = datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc)
    for i, (draft, truth) in enumerate(truths.items()):
        part = make_run(out_dir.parent / f".{out_dir.name}-draft{draft}", truth, levels=levels, n_requests=n_requests,
                        seed=seed + i, run_id=f"grid-{seed}", start=t0 + timedelta(hours=i))
        tag = {"config_id": f"draft={draft}", "context_tokens": None, "knob_draft": draft}
        windows += [{**r, **tag} for r in pq.read_table(part / "windows.parquet").to_pylist()]
        for r in pq.read_table(part / "levels.parquet").to_pylist():
            r.update(tag, config_status="ok")
            r.update((level_edits or {}).get((draft, r["level_value"]), {}))  # may overwrite config_status
            lv.append(r)
        samples.append(pq.read_table(part / "samples.parquet"))
        meta = meta or json.loads((part / "run.json").read_text())
    done = levels_done if levels_done is not None else [
        [float(v), 0, f"draft={d}", None] for d in truths for v in levels]
    writer = RunWriter(out_dir, {**meta, "levels_done": done})
    writer.write("samples", pa.concat_tables(samples))
    writer.write("windows", with_knob_columns(pa.Table.from_pylist(
        [{k: v for k, v in r.items() if k != "knob_draft"} for r in windows], schema=WINDOWS), windows))
    writer.write("levels", with_knob_columns(rows_to_table(LEVELS, lv), lv))
    return out_dir


def replicate_windows(rng: np.random.Generator, tok_s, j_per_token, levels=(180, 220, 260, 300), n_prompts: int = 5,
                      rounds: int = 1, noise: float = 0.02, spread: float = 0.2, slow_window: bool = False,
                      prompt_ids: bool = True, prompt_factor=None) -> pa.Table:
    """One sweep's measured windows drawn around known per-level medians, for coverage studies.

    Every level gets `rounds` whole rounds of the same `n_prompts` prompts (as the sweep sends them):
    prompt p's cost factor f_p (log-uniform over ±spread/2, or `prompt_factor`) divides its tok/s and
    multiplies its J/token at every level; each window adds independent lognormal noise of sd `noise`
    to its tok/s and to its power (J/token = power ÷ tok/s). slow_window: one window per level runs at
    half speed (J/token ×1.5). The median tok/s and J/token of a level's mixture are its
    `tok_s`/`j_per_token` times one common factor, so the true speed loss and saving between levels
    are exactly those of the inputs (truth_level_median gives the absolute medians)."""
    lv = np.asarray(levels, float)
    f = (np.exp(rng.uniform(-spread / 2, spread / 2, n_prompts)) if prompt_factor is None
         else np.asarray(prompt_factor, float))
    n = f.size * rounds
    cols = {k: [] for k in ("level_value", "decode_tok_s", "gpu_j_per_token", "prompt_id")}
    for li, L in enumerate(lv):
        fp = np.tile(f, rounds)
        et, ep = rng.normal(0, noise, n), rng.normal(0, noise, n)
        tok = tok_s[li] / fp * np.exp(et)
        j = j_per_token[li] * fp * np.exp(ep - et)
        if slow_window:
            k = rng.integers(n)
            tok[k], j[k] = tok[k] / 2, j[k] * 1.5
        cols["level_value"] += [float(L)] * n
        cols["decode_tok_s"] += list(tok)
        cols["gpu_j_per_token"] += list(j)
        cols["prompt_id"] += [f"p{p}" if prompt_ids else None for p in np.tile(np.arange(f.size), rounds)]
    m = len(cols["level_value"])
    return pa.table({
        "run_id": pa.array(["cov"] * m), "level_kind": pa.array(["power_limit"] * m),
        "level_value": pa.array(cols["level_value"], pa.float64()), "window_kind": pa.array(["request"] * m),
        "concurrency": pa.array([1] * m, pa.int32()), "warmup": pa.array([False] * m), "status": pa.array(["ok"] * m),
        "decode_tok_s": pa.array(cols["decode_tok_s"], pa.float64()),
        "gpu_j_per_token": pa.array(cols["gpu_j_per_token"], pa.float64()),
        "energy_method": pa.array(["counter"] * m), "prompt_id": pa.array(cols["prompt_id"], pa.string()),
    })


def truth_level_median(value: float, prompt_factor, noise: float, sign: int = 1) -> float:
    """The median of one level's window mixture in replicate_windows (prompts equally weighted,
    lognormal noise): `value`·f_p^sign·exp(noise term) mixed over p. J/token (sign +1) carries
    two noise terms (power ÷ tok/s), tok/s (sign −1) one."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    lf = sign * np.log(np.asarray(prompt_factor, float))
    s = noise * (np.sqrt(2) if sign > 0 else 1.0)
    if s == 0:
        return float(value * np.exp(np.median(lf)))
    cdf = lambda x: float(np.mean(norm.cdf((x - lf) / s))) - 0.5  # noqa: E731
    return float(value * np.exp(brentq(cdf, lf.min() - 10 * s, lf.max() + 10 * s)))
