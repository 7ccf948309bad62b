"""One-shot, read-only hardware check of powerprof on a real NVIDIA GPU (or the simulator): JSON + Markdown.

    python bench/gpu_check.py --out DIR                     # real GPU (NVML index 0)
    python bench/gpu_check.py --out DIR --simulate          # simulated H200 and simulated server
    python bench/gpu_check.py --out DIR --simulate --quick  # the same in ~40 s (the test)

What it does (docs/hardware.md says what each figure means):
1. `powerprof devices --json` and `powerprof monitor --duration 20`, output kept as printed.
2. The cost of every NVML call our collector makes (found by recording the calls it really makes),
   median and p99 over 1000 calls, in µs; the sampler's cost per tick, direct and as a running thread.
3. The energy counter against integrated instant power and integrated 1 s average power, idle and
   under load, at 50 Hz and at 1 Hz (every 50th sample of the same run), plus how often the driver
   really updates the counter, the instant power and the average.
4. A real decode load: bench/gpu_check_server.py (a random-weight Llama model in transformers, bf16)
   on the GPU, then powerprof's measure at concurrency 1 and 8 with the Profiler on the same NVML:
   J/token, decode tok/s against the generator's own timing, clock-event reasons and power against
   the limit while decoding; plus `powerprof measure` through the CLI as a user runs it.
5. `powerprof sweep --dry-run`: plan, permission check, restore-file path.
6. Never calls an NVML setter: every setter of pynvml (and of the simulator) is replaced, in this
   process and in every CLI subprocess, by one that records the call and raises; the report lists
   such calls (there must be none) and compares every limit before and after.

One process, plus CLI subprocesses of powerprof (run through `gpu_check.py cli ...` so they carry the
same guard) and the decode server. A time budget (default 270 s) skips what would overrun, saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench helpers (sampler_cost) import by file name

SETTER_LOG_ENV = "POWERPROF_GPU_CHECK_SETTER_LOG"
READ_VERBS = frozenset({"Get", "Is", "Query", "Validate", "Init", "Shutdown", "Error"})
WRITE_VERBS = frozenset({"Set", "Reset", "Clear", "Modify", "Remove", "Create", "Destroy", "Register", "Discover", "Free"})
DEFAULT_PROFILE = "h200-141g"


# --- 6. the guard: no NVML setter runs -----------------------------------------------------------


def is_setter(name: str) -> bool:
    """True for an NVML entry point that changes something: its first verb word writes.

    `nvmlDeviceSetPowerManagementLimit`, `nvmlDeviceResetGpuLockedClocks`, `nvmlDeviceClearEccErrorCounts`
    are setters; `nvmlDeviceGetResetStatus` is not (its verb is Get). Constants (NVML_*) never are.
    """
    if not name.startswith("nvml"):
        return False
    for word in re.findall(r"[A-Z][a-z0-9]*", name[4:]):
        if word in READ_VERBS:
            return False
        if word in WRITE_VERBS:
            return True
    return False


class SetterCalled(RuntimeError):
    """An NVML setter was called during the read-only check. Not an NVMLError, so nothing swallows it."""


def install_guard(log_path: str | os.PathLike | None) -> list[str]:
    """Replace every setter of pynvml and of the simulator's SimNVML with one that logs and raises."""
    import pynvml

    targets = [pynvml]
    try:
        from powerprof.sim.nvml import SimNVML

        targets.append(SimNVML)
    except ImportError:
        pass
    patched = []
    for target in targets:
        for name in dir(target):
            if is_setter(name) and callable(getattr(target, name, None)):
                setattr(target, name, _raiser(name, log_path))
                patched.append(f"{getattr(target, '__name__', target)}.{name}")
    return patched


def _raiser(name: str, log_path):
    def setter_called(*args, **kwargs):
        rec = {"call": name, "pid": os.getpid(), "argv": sys.argv[1:],
               "stack": traceback.format_stack(limit=8)[:-1]}
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        raise SetterCalled(f"{name} called during the read-only hardware check")

    return setter_called


def setter_calls(log_path: Path) -> list[dict]:
    if not log_path.exists():
        return []
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]


def read_settings(nvml, indexes: list[int]) -> list[dict]:
    """Every setting the product can change, read-only, to compare before and after."""
    out = []
    for i in indexes:
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        row = {"index": i}
        for key, fn, div in (("power_limit_w", "nvmlDeviceGetPowerManagementLimit", 1000),
                             ("enforced_limit_w", "nvmlDeviceGetEnforcedPowerLimit", 1000)):
            try:
                row[key] = getattr(nvml, fn)(h) / div
            except Exception as e:
                row[key] = f"unreadable: {type(e).__name__}"
        if getattr(nvml, "simulated", False):
            row["locked_clocks_mhz"] = nvml.locked_clocks_mhz(i)
        out.append(row)
    return out


# --- helpers ---------------------------------------------------------------------------------------


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


def _num(v, nd=3):
    return None if v is None or (isinstance(v, float) and not np.isfinite(v)) else round(float(v), nd)


class Budget:
    """Seconds left of the check's time budget; parts that would overrun are skipped, with the reason."""

    def __init__(self, total_s: float):
        self.t0 = time.monotonic()
        self.total_s = total_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total_s - self.elapsed()


def run_cli(args: list[str], out_dir: Path, timeout_s: float, env: dict | None = None) -> dict:
    """`powerprof ARGS` as a subprocess carrying the setter guard; output kept as printed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "cli", *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env or os.environ.copy(),
                           cwd=out_dir)
        rc, so, se = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        so = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        se = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return {"command": "powerprof " + " ".join(args), "rc": rc, "seconds": round(time.monotonic() - t0, 2),
            "stdout": so, "stderr": se[-4000:]}


# --- 1. devices and monitor ---------------------------------------------------------------------------


def check_devices_monitor(ctx) -> dict:
    dev = run_cli(["devices", "--json", *ctx.sim_flag], ctx.out, 60, ctx.cli_env)
    try:
        dev["json"] = json.loads(dev["stdout"])
    except ValueError:
        dev["json"] = None
    mon = run_cli(["monitor", "--duration", f"{ctx.monitor_s:g}", *ctx.sim_flag], ctx.out, ctx.monitor_s + 60, ctx.cli_env)
    mon["lines"] = len(mon["stdout"].splitlines())
    return {"devices": dev, "monitor": mon}


# --- 2. NVML call cost and sampler cost -------------------------------------------------------------


class RecordingNVML:
    """Passes every call through to `inner` and records (phase, name, args): the calls the collector makes."""

    def __init__(self, inner):
        self._inner = inner
        self.phase = "probe"
        self.calls: list[tuple[str, str, tuple]] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not (name.startswith("nvml") and callable(attr)):
            return attr

        def call(*args, **kwargs):
            self.calls.append((self.phase, name, args))
            return attr(*args, **kwargs)

        return call


def _describe_args(args) -> str:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.append("[" + ",".join(str(x) for x in a) + "]")
        elif isinstance(a, int):
            out.append(str(a))
        else:
            out.append("h")
    return ", ".join(out)


def time_call(fn, args, n: int) -> dict:
    """Median and p99 of n calls in µs; a call that raises is timed too and its error named."""
    ts = np.empty(n)
    err = None
    for k in range(n):
        t = time.perf_counter_ns()
        try:
            fn(*args)
        except Exception as e:  # NVMLError: not supported on this GPU; still a real cost
            err = type(e).__name__
        ts[k] = time.perf_counter_ns() - t
    return {"median_us": _num(np.median(ts) / 1e3, 2), "p99_us": _num(np.percentile(ts, 99) / 1e3, 2),
            "max_us": _num(ts.max() / 1e3, 1), "error": err}


def check_nvml_cost(ctx) -> dict:
    from powerprof.collectors.nvml import NvmlCollector
    from powerprof.collectors.sampler import Sampler
    from sampler_cost import direct

    rec = RecordingNVML(ctx.nvml)
    recorded = NvmlCollector(rec, [ctx.index])
    rec.phase = "tick"  # window edges (Profiler.mark) take the same full read
    recorded.read()
    recorded.close()
    used: dict[tuple, list[str]] = {}  # (name, args) -> the phases that make the call
    for phase, name, args in rec.calls:
        if name in ("nvmlInit", "nvmlShutdown"):
            continue
        phases = used.setdefault((name, _describe_args(args)), [])
        if phase not in phases:
            phases.append(phase)
    firsts = {}
    for phase, name, args in rec.calls:
        firsts.setdefault((name, _describe_args(args)), args)
    calls = []
    for (name, shown), phases in used.items():
        r = time_call(getattr(ctx.nvml, name), firsts[(name, shown)], ctx.n_calls)
        calls.append({"call": f"{name}({shown})", "phases": phases, **r})
    tick_calls = [c for c in calls if "tick" in c["phases"]]
    # The costs of a whole read on the bare NVML handle, without the recording wrapper's overhead.
    col = NvmlCollector(ctx.nvml, [ctx.index])
    per, wall, cpu = direct([col], ctx.n_ticks)
    # The running sampler: process CPU per tick at 50 Hz, thread wake-ups included.
    s = Sampler([col], interval_s=0.02)
    c0, w0 = time.process_time(), time.monotonic()
    with s:
        time.sleep(ctx.sampler_s)
    c1, w1 = time.process_time(), time.monotonic()
    ticks = (w1 - w0) / 0.02
    per_tick_cpu_us = (c1 - c0) / ticks * 1e6
    col.close()
    return {
        "n_calls": ctx.n_calls,
        "calls": calls,
        "tick_calls_per_gpu": sum(1 for p, n, _ in rec.calls if p == "tick" and n not in ("nvmlInit", "nvmlShutdown")),
        "tick_calls_distinct": len(tick_calls),
        "sum_of_tick_call_medians_us": _num(sum(c["median_us"] for c in tick_calls), 1),
        "read_one_gpu": {"ticks": ctx.n_ticks, "wall_median_us": _num(statistics.median(wall), 1),
                         "wall_p99_us": _num(pct(wall, 99), 1), "cpu_median_us": _num(statistics.median(cpu), 1),
                         "cpu_p99_us": _num(pct(cpu, 99), 1)},
        "sampler_50hz": {"seconds": ctx.sampler_s, "cpu_per_tick_us": _num(per_tick_cpu_us, 1),
                         "cpu_pct_at_1hz": _num(per_tick_cpu_us / 1e6 * 100, 4),
                         "cpu_pct_at_50hz": _num(per_tick_cpu_us * 50 / 1e6 * 100, 3),
                         "missed": sum(s.missed.values()), "errors": sum(s.errors.values())},
    }


# --- 3. energy counter against power ------------------------------------------------------------------


def _instant_mw(nvml, h):
    v = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
    if v.nvmlReturn != nvml.NVML_SUCCESS:
        return None, None
    from powerprof.collectors.nvml import _field_value

    return _field_value(nvml, v), int(v.timestamp)


def _try(fn, *a):
    try:
        return fn(*a)
    except Exception:
        return None


def sample_series(nvml, h, rate_hz: float, duration_s: float) -> dict:
    """Counter, instant power and average power on one drift-free schedule."""
    n = int(duration_s * rate_hz) + 1
    period = int(1e9 / rate_hz)
    t = np.zeros(n, dtype=np.int64)
    e = np.full(n, np.nan)
    p = np.full(n, np.nan)
    a = np.full(n, np.nan)
    d = np.zeros(n, dtype=np.int64)  # ns from each read's stamp to its counter's value in hand
    start = time.monotonic_ns()
    for k in range(n):
        due = start + k * period
        while (left := due - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        t[k] = time.monotonic_ns()
        mj = _try(nvml.nvmlDeviceGetTotalEnergyConsumption, h)
        d[k] = time.monotonic_ns() - t[k]
        mw = (_try(_instant_mw, nvml, h) or (None, None))[0]
        amw = _try(nvml.nvmlDeviceGetPowerUsage, h)
        e[k] = mj / 1e3 if mj is not None else np.nan
        p[k] = mw / 1e3 if mw is not None else np.nan
        a[k] = amw / 1e3 if amw is not None else np.nan
    return {"t": t, "e": e, "p": p, "a": a, "d": d}


def compare_energy(s: dict, step: int, avg_window_s: float, truth_fn=None) -> dict:
    """Energy over the same interval by the counter, integrated instant power and integrated average."""
    from powerprof.energy import counter_energy_j, integrate_power_j, shift_average_power

    t, e, p, a = s["t"][::step], s["e"][::step], s["p"][::step], s["a"][::step]
    shift = int(avg_window_s * 1e9 / 2)
    # The shifted average covers [t0 - shift, t1 - shift]: compare over the span all three cover.
    t0, t1 = int(t[0]), int(t[-1]) - shift
    # How late the counter's value may be behind its stamp at the interval's edges (a read preempted on a loaded host
    # holds energy past its stamp: a 4-5% error over 4 s at 330 W once, from reads ~170 ms late): the reads at t0 and
    # either side of t1, where the counter is interpolated.
    d = s["d"][::step] if "d" in s else np.zeros(len(t), dtype=np.int64)
    k1 = int(np.searchsorted(t, t1))
    edge = [0, max(k1 - 1, 0), min(k1, len(t) - 1)]
    out = {"samples": int(len(t)), "interval_s": _num((t1 - t0) / 1e9, 3),
           "edge_read_delay_s": _num(float(d[edge].max()) / 1e9, 4)}
    if t1 <= t0:
        return out | {"error": "interval too short"}
    ce = counter_energy_j(t, e, t0, t1) if np.isfinite(e).sum() >= 2 else float("nan")
    ie = integrate_power_j(t, p, t0, t1)
    ae = integrate_power_j(shift_average_power(t, avg_window_s), a, t0, t1)
    dur = (t1 - t0) / 1e9
    out.update({
        "counter_j": _num(ce), "instant_integrated_j": _num(ie), "average_integrated_j": _num(ae),
        "counter_avg_power_w": _num(ce / dur, 2),
        "instant_vs_counter": _num(ie / ce, 4) if ce and np.isfinite(ce) else None,
        "average_vs_counter": _num(ae / ce, 4) if ce and np.isfinite(ce) else None,
        "instant_power_w_median": _num(np.nanmedian(p), 1) if np.isfinite(p).any() else None,
        "instant_power_w_p5_p95": [_num(np.nanpercentile(p, 5), 1), _num(np.nanpercentile(p, 95), 1)]
        if np.isfinite(p).any() else None,
    })
    if truth_fn is not None:
        tr = truth_fn(t0, t1)
        out["true_j"] = _num(tr)
        out["counter_vs_true"] = _num(ce / tr, 4) if tr else None
    return out


def update_intervals(nvml, h, duration_s: float) -> dict:
    """How often the driver refreshes each reading: poll tightly, keep the instants a value changed."""
    changes = {"counter": [], "instant_power": [], "instant_power_timestamp": [], "average_power": []}
    last = {k: None for k in changes}
    polls, gap_max, prev = 0, 0, None
    end = time.monotonic_ns() + int(duration_s * 1e9)
    while (now := time.monotonic_ns()) < end:
        polls += 1
        # A change is seen up to one gap between polls late: a host that starves the poller (a gap near the refresh)
        # stretches the intervals it reads, so the longest gap is given beside them.
        gap_max, prev = max(gap_max, now - prev) if prev is not None else 0, now
        inst_mw, inst_ts = _try(_instant_mw, nvml, h) or (None, None)
        vals = {"counter": _try(nvml.nvmlDeviceGetTotalEnergyConsumption, h), "instant_power": inst_mw,
                # the field's own timestamp (µs) says when the driver took the sample
                "instant_power_timestamp": inst_ts, "average_power": _try(nvml.nvmlDeviceGetPowerUsage, h)}
        for k, v in vals.items():
            if v is not None and v != last[k]:
                if last[k] is not None:
                    changes[k].append(v if k == "instant_power_timestamp" else now)
                last[k] = v
    out = {"poll_s": duration_s, "polls": polls, "poll_gap_ms_max": _num(gap_max / 1e6, 2)}
    for k, xs in changes.items():
        unit = 1e3 if k == "instant_power_timestamp" else 1e6  # µs timestamps vs ns
        d = np.diff(np.asarray(xs, dtype=float)) / unit if len(xs) >= 2 else np.array([])
        out[k] = {"changes": len(xs), "interval_ms_median": _num(np.median(d), 2) if d.size else None,
                  "interval_ms_p10_p90": [_num(np.percentile(d, 10), 2), _num(np.percentile(d, 90), 2)] if d.size else None}
    return out


def check_energy(ctx, state: str) -> dict:
    h = ctx.nvml.nvmlDeviceGetHandleByIndex(ctx.index)
    s = sample_series(ctx.nvml, h, 50.0, ctx.energy_s)
    res = {
        "state": state,
        "at_50hz": compare_energy(s, 1, ctx.avg_window_s, ctx.truth_fn),
        "at_1hz": compare_energy(s, 50, ctx.avg_window_s, ctx.truth_fn),
        "update_intervals": update_intervals(ctx.nvml, h, ctx.poll_s),
    }
    return res


class BackgroundLoad:
    """`streams` concurrent streaming requests, each re-sent when it ends, until stop()."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        self.url, self.streams, self.max_tokens = url, streams, max_tokens
        self.tokens = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._flowing = threading.Event()  # set when the first token of any stream arrives
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self):
        from powerprof.workload.client import RequestParams, detect_server, new_session, send_request

        async with new_session() as s:
            server = await detect_server(s, self.url)
            params = RequestParams(max_tokens=self.max_tokens)

            async def one(k):
                while not self._stop.is_set():
                    r = await send_request(s, server, f"Background load stream {k}: tell a long story.", params,
                                           edge_hook=lambda label: self._flowing.set())
                    self.tokens += r.generated_tokens
                    if r.error:
                        self.errors.append(r.error)
                        await asyncio.sleep(0.2)

            tasks = [asyncio.create_task(one(k)) for k in range(self.streams)]
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self):
        self._thread.start()
        if not self._flowing.wait(60):
            raise RuntimeError(f"background load: no token in 60 s ({'; '.join(self.errors[:3]) or 'no error'})")
        time.sleep(1.0)  # let power settle past its first ramp
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)


def fresh_counter_mj(nvml, h, wait_s: float = 0.3) -> tuple[float, int, int]:
    """The counter the moment it refreshes: a read taken just after an update carries no lag. Also the ns from the
    start of the last read that still saw the old value to the stamp: the refresh came somewhere in that gap (a poller
    starved on a loaded host stamps it that late)."""
    before = time.monotonic_ns()
    first = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    end = time.monotonic_ns() + int(wait_s * 1e9)
    while time.monotonic_ns() < end:
        t = time.monotonic_ns()
        v = nvml.nvmlDeviceGetTotalEnergyConsumption(h)
        if v != first:
            now = time.monotonic_ns()
            return float(v), now, now - before
        before = t
    now = time.monotonic_ns()
    return float(first), now, now - before


def sim_pulse(gpu, on_ms: float, period_ms: float, seconds: float, phase_ms: float = 0.0) -> dict:
    """The simulated GPU's square-wave load (the server's /gpu_check/pulse on a real one)."""
    from powerprof.sim.gpu import IDLE, Phase

    period_ns, on_ns = int(period_ms * 1e6), int(on_ms * 1e6)
    t0 = time.monotonic_ns() + int(phase_ms * 1e6)
    n = max(1, int(seconds * 1e3 / period_ms))
    busy = 0
    for k in range(n):
        while (left := t0 + k * period_ns - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        b0 = time.monotonic_ns()
        gpu.set_phase(Phase("decode", 1.0))
        while (left := b0 + on_ns - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        gpu.set_phase(IDLE)
        busy += time.monotonic_ns() - b0
    return {"bursts": n, "busy_s": busy / 1e9}


def http_pulse(url: str):
    import urllib.request

    def pulse(on_ms, period_ms, seconds, phase_ms=0.0):
        body = json.dumps({"on_ms": on_ms, "period_ms": period_ms, "seconds": seconds, "phase_ms": phase_ms}).encode()
        req = urllib.request.Request(url + "/gpu_check/pulse", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=seconds + 60) as r:
            return json.load(r)

    return pulse


def check_sensor_coverage(ctx) -> dict:
    """Short bursts at several phases of a 100 ms period: does the counter see every burst alike?

    Yang et al. (SC'24) found the A100/H100 sensor averages ~25 ms of every ~100 ms: the same burst
    then counts fully or not at all depending on its phase. A counter that integrates everything gives
    every phase the same energy per burst, equal to what continuous load predicts for its busy time.
    """
    n, h = ctx.nvml, ctx.nvml.nvmlDeviceGetHandleByIndex(ctx.index)

    def energy_of(fn):
        e0, t0, g0 = fresh_counter_mj(n, h)
        res = fn()
        time.sleep(0.15)  # the last burst's tail reaches the counter
        e1, t1, g1 = fresh_counter_mj(n, h)
        return (e1 - e0) / 1e3, t0, t1, res, g0 + g1

    idle_j, a, b, _, _ = energy_of(lambda: time.sleep(1.0))
    idle_w = idle_j / ((b - a) / 1e9)
    period = ctx.pulse_period_ms
    cont_j, a, b, cont, _ = energy_of(lambda: ctx.pulse(period, period, ctx.pulse_s, 0.0))
    busy_excess_w = (cont_j - idle_w * (b - a) / 1e9) / cont["busy_s"]
    runs = []
    for k in range(ctx.pulse_phases):
        phase = k * period / ctx.pulse_phases
        j, a, b, res, gaps = energy_of(lambda: ctx.pulse(ctx.pulse_on_ms, period, ctx.pulse_s, phase))
        excess = j - idle_w * (b - a) / 1e9
        expected = busy_excess_w * res["busy_s"]
        run = {"phase_ms": _num(phase, 1), "bursts": res["bursts"], "busy_s": _num(res["busy_s"], 4),
               "excess_j": _num(excess), "seen_vs_expected": _num(excess / expected, 3) if expected > 0 else None,
               # where in the two polls' gaps the refreshes came is not known: the truth's span is that uncertain
               "interval_s": _num((b - a) / 1e9, 4), "edge_poll_gaps_s": _num(gaps / 1e9, 4)}
        if ctx.truth_fn is not None:
            run["counter_vs_true"] = _num(j / ctx.truth_fn(a, b), 4)
        runs.append(run)
    seen = [r["seen_vs_expected"] for r in runs if r["seen_vs_expected"] is not None]
    return {
        "period_ms": period, "on_ms": ctx.pulse_on_ms, "run_s": ctx.pulse_s,
        "idle_w": _num(idle_w, 2), "continuous_busy_excess_w": _num(busy_excess_w, 2), "runs": runs,
        "seen_vs_expected_median": _num(statistics.median(seen), 3) if seen else None,
        "seen_vs_expected_min_max": [_num(min(seen), 3), _num(max(seen), 3)] if seen else None,
    }


# --- 4. decode load and measure ----------------------------------------------------------------------


def _generator_rates(ctx, batch_size: int, since_ns: int) -> dict:
    """The generator's own decode tok/s for batches of `batch_size`: its batch log, or the simulator's step log."""
    if ctx.sim_server is not None:
        steps = [(t0, t1, n) for t0, t1, kind, b, n in ctx.sim_server.steps
                 if kind == "decode" and b == batch_size and t0 >= since_ns]
        dur = sum(t1 - t0 for t0, t1, _ in steps) / 1e9
        return {"source": "simulator step log", "steps": len(steps),
                "tok_s": _num(sum(n for *_, n in steps) / dur, 2) if dur else None}
    import urllib.request

    with urllib.request.urlopen(ctx.url + "/gpu_check/batches", timeout=10) as r:
        batches = [b for b in json.load(r)["batches"]
                   if b["batch_size"] == batch_size and b["t_start_ns"] >= since_ns and not b.get("aborted")]
    rates = [b["decode_tok_s"] for b in batches if b.get("decode_tok_s")]
    steps_ms = [b["step_ms_median"] for b in batches if b.get("step_ms_median")]
    return {"source": "generator batch log", "batches": len(rates),
            "tok_s": _num(statistics.median(rates), 2) if rates else None,
            "step_ms_median": _num(statistics.median(steps_ms), 3) if steps_ms else None}


def fit_max_tokens(ctx, left_s: float) -> tuple[int, str | None]:
    """Tokens per request that let both measures finish in the time left, from the load's own step rate."""
    if ctx.sim_server is not None:
        return ctx.max_tokens, None
    import urllib.request

    try:
        with urllib.request.urlopen(ctx.url + "/gpu_check/batches", timeout=10) as r:
            steps_ms = [b["step_ms_median"] for b in json.load(r)["batches"] if b.get("step_ms_median")]
    except Exception:
        return ctx.max_tokens, None
    if not steps_ms:
        return ctx.max_tokens, None
    step_s = max(steps_ms) / 1e3  # the slowest batch seen: a bound on one request's step
    # This part: warm-up + n requests at c=1, a warm-up batch + n/8 batches at c=8; the CLI measure after it: about
    # half that.
    per_token_s = step_s * ((1 + ctx.n_requests) + (1 + ctx.n_requests / 8)) * 1.5
    fit = int((left_s - 45) / per_token_s)
    if fit >= ctx.max_tokens:
        return ctx.max_tokens, None
    n = max(32, fit)
    return n, f"max_tokens cut from {ctx.max_tokens} to {n}: a decode step takes {step_s * 1e3:.0f} ms here"


def check_decode(ctx) -> dict:
    from powerprof.collectors.nvml import clock_event_reason_names
    from powerprof.profiler import Profiler
    from powerprof.workload.client import RequestParams
    from powerprof.workload.load import builtin_prompts
    from powerprof.workload.measure import measure
    from powerprof.workload.rows import batch_problem, batch_windows

    readings = []
    profiler = Profiler(ctx.nvml, [ctx.index], interval_s=0.1)
    profiler.sampler.subscribe(lambda s: readings.append((s.t_mono_ns, s.data[0])) if s.source == "nvml" and s.data else None)
    t_start = time.monotonic_ns()
    max_tokens, why = fit_max_tokens(ctx, ctx.budget.left())
    ctx.cli_max_tokens = min(ctx.cli_max_tokens, max(16, max_tokens // 2))
    with profiler:
        res = measure(ctx.url, prompts=builtin_prompts("short"), n_requests=ctx.n_requests, concurrencies=(1, 8),
                      params=RequestParams(max_tokens=max_tokens), warmup=1, profiler=profiler)
    out = {"server": {"kind": res.server.kind, "api": res.server.api, "model": res.server.model},
           "max_tokens": max_tokens, "n_requests": ctx.n_requests, "note": why, "aborted": res.aborted,
           "concurrency": []}
    h = ctx.nvml.nvmlDeviceGetHandleByIndex(ctx.index)
    max_sm = _try(ctx.nvml.nvmlDeviceGetMaxClockInfo, h, ctx.nvml.NVML_CLOCK_SM)
    for summ in res.summaries:
        c = summ.concurrency
        recs = [r for r in res.records if r.concurrency == c and not r.warmup and r.ok and r.t_last_ns]
        rows = [r for r in res.rows if r["concurrency"] == c and not r["warmup"] and r["window_kind"] == "request"]
        entry = {"concurrency": c, "n_ok": summ.n_ok, "n_failed": summ.n_failed,
                 "decode_tok_s": _num(summ.decode_tok_s, 2), "gpu_j_per_token": _num(summ.gpu_j_per_token, 4),
                 "energy_method": summ.energy_method,
                 "low_confidence_windows": sum(1 for r in res.rows if r["concurrency"] == c and r["low_confidence"] and not r["warmup"]),
                 "token_source": sorted({str(r["token_source"]) for r in rows}),
                 # Windows the figures left out (a client starved on a loaded host times its streams apart), and why.
                 "left_out_windows": sorted({str(r.get("timing_reason")) for r in res.rows if r["concurrency"] == c
                                             and not r["warmup"] and r.get("timing") == "untrusted"})}
        server_rates = [r["server_predicted_per_second"] for r in rows if r["server_predicted_per_second"]]
        entry["server_timings_tok_s_median"] = _num(statistics.median(server_rates), 2) if server_rates else None
        if recs:
            since = min(r.t_send_ns for r in recs)
            size = max(sum(1 for r in recs if r.batch_id == b) for b in {r.batch_id for r in recs})
            entry["batch_size"] = size
            try:
                entry["generator"] = _generator_rates(ctx, size, since)
            except Exception as e:
                entry["generator"] = {"error": f"{type(e).__name__}: {e}"}
            g = entry["generator"].get("tok_s")
            entry["measured_vs_generator"] = _num(summ.decode_tok_s / g, 4) if g and summ.decode_tok_s else None
            # Only samples taken while a measured request was decoding (not the gaps between requests).
            spans = [(r.t_first_ns, r.t_last_ns) for r in recs]
            inside = [x for t, x in readings if any(a <= t <= b for a, b in spans)]
            entry["during_decode"] = _power_figures(inside, max_sm, clock_event_reason_names)
            if ctx.truth_fn is not None and summ.gpu_j_per_token is not None:
                # The simulator's true energy over exactly the intervals measure counted.
                if c == 1:
                    # Over the window each figure used (the timing rule's edges and tokens), trusted ones only.
                    tms = [tm for tm in (r.timing for r in recs) if tm is not None and tm.kind != "untrusted"]
                    true_j = sum(ctx.truth_fn(tm.t0_ns, tm.t1_ns) for tm in tms)
                    toks = sum(tm.decode_tokens for tm in tms)
                else:
                    # Trusted batches only, as the summary counts them: a batch with a member whose stream
                    # could not be timed has no figure (a loaded CI run read 0.435 against a 'true' 0.395
                    # J/token from every batch).
                    bws = [b for b in batch_windows(recs) if b.intervals.size and not any(
                        batch_problem(r) for r in recs if r.batch_id == b.batch_id and r.ok)]
                    true_j = sum(ctx.truth_fn(int(t0), int(t1)) for b in bws for t0, t1 in b.intervals)
                    toks = sum(b.decode_tokens for b in bws)
                entry["true_j_per_token"] = _num(true_j / toks, 4) if toks else None
        out["concurrency"].append(entry)
    out["elapsed_s"] = _num((time.monotonic_ns() - t_start) / 1e9, 1)
    return out


def _power_figures(readings, max_sm, reason_names) -> dict:
    if not readings:
        return {"samples": 0}
    p = [r.power_w for r in readings if r.power_w is not None]
    a = [r.power_avg_w for r in readings if r.power_avg_w is not None]
    lim = [r.enforced_limit_w for r in readings if r.enforced_limit_w is not None]
    sm = [r.sm_clock_mhz for r in readings if r.sm_clock_mhz is not None]
    reasons: dict[str, int] = {}
    n_reason = 0
    for r in readings:
        names = reason_names(r.clock_event_reasons)
        if names is None:
            continue
        n_reason += 1
        for name in names or ["none"]:
            reasons[name] = reasons.get(name, 0) + 1
    limit = statistics.median(lim) if lim else None
    pmax = max(p) if p else None
    cap = reasons.get("SwPowerCap", 0) / n_reason if n_reason else None
    return {
        "samples": len(readings),
        "instant_power_w_median": _num(statistics.median(p), 1) if p else None,
        "instant_power_w_p95": _num(pct(p, 95), 1) if p else None,
        "instant_power_w_max": _num(pmax, 1),
        "average_power_w_median": _num(statistics.median(a), 1) if a else None,
        "enforced_limit_w": _num(limit, 1),
        "power_over_limit_median": _num(statistics.median(p) / limit, 3) if p and limit else None,
        "sm_clock_mhz_median": _num(statistics.median(sm), 0) if sm else None,
        "sm_clock_max_mhz": max_sm,
        "clock_event_reasons_share": {k: _num(v / n_reason, 3) for k, v in sorted(reasons.items())} if n_reason else None,
        "cap_binds": None if cap is None else bool(cap > 0.05 or (pmax is not None and limit and pmax > 0.95 * limit)),
        "sw_power_cap_share": _num(cap, 3),
    }


def check_cli_measure(ctx) -> dict:
    args = ["measure", "--requests", "8", "--max-tokens", str(ctx.cli_max_tokens), "--concurrency", "1,8",
            "--out", str(ctx.out / "cli_measure")]
    args += ctx.sim_flag if ctx.sim_server is not None else ["--server", ctx.url]
    return run_cli(args, ctx.out, 120, ctx.cli_env)


# --- 4b. the daemon in front of the same server -------------------------------------------------------------


def check_daemon(ctx) -> dict:
    """The daemon (proxy, 1 Hz sampler, attribution) in front of the decode server, in this process on this GPU.

    Requests at concurrency 1, then 8 at once, each tagged by phase; the daemon's own dataset is then read back:
    every request is a row, with its GPU energy or the reason it has none; its J/token beside measure's (part 4,
    decode only: the daemon's also carries its prefill); its interval cadence on this GPU's ~3 ms counter read; on
    the simulator, its energy against the simulated GPU's truth. In this process so that the daemon reads the
    same NVML (and, simulated, the same GPU the server drives); the daemon's loop carries the client too, whose
    few streams cost it little.
    """
    import shutil
    import tempfile

    data = ctx.out / "daemon_data"
    shutil.rmtree(data, ignore_errors=True)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    sock_dir = tempfile.mkdtemp(prefix="pp-")  # a Unix socket's path is at most 107 bytes: not under a long --out
    try:
        res = asyncio.run(_daemon_run(ctx, data, Path(sock_dir) / "tags.sock"))
    finally:
        for sig, h in handlers.items():  # the daemon's loop took them over; a timeout must still end the check
            signal.signal(sig, h)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if res.pop("_signalled"):
        # SIGTERM (the run's timeout) or Ctrl-C came while the daemon held the handlers: it stopped the daemon; the
        # check stops as it would have (its cleanup ends the decode server), not on to the next parts.
        raise SystemExit(143)
    res.update(_daemon_dataset(ctx, data, res.pop("_t0_ns"), res.pop("_spans"), res.pop("_counter")))
    return res


async def _daemon_run(ctx, data: Path, tag_socket: Path) -> dict:
    import aiohttp

    from powerprof.daemon.config import load_config
    from powerprof.daemon.service import Daemon
    from powerprof.rig import Rig
    from powerprof.workload.client import RequestParams, detect_server, send_request

    cfg = load_config(None, env={}, overrides={
        "daemon.data_dir": str(data), "daemon.interval_s": 1.0, "daemon.flush_interval_s": 1.0,
        "daemon.restore_on_start": False, "daemon.gpus": [ctx.index], "proxy.listen": "127.0.0.1:0",
        "proxy.upstream": ctx.url, "metrics.listen": "127.0.0.1:0", "tags.socket": str(tag_socket),
        # The check's server has no /metrics: nothing counts bypass tokens (its intervals say `off`, as documented).
        "scrape.server": "none"})
    d = Daemon(cfg, Rig(ctx.simulate or None, gpus=[ctx.index], nvml=ctx.nvml))
    task = asyncio.create_task(d.run())
    deadline = time.monotonic() + 30
    while "proxy" not in d.urls and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if "proxy" not in d.urls:
        if task.done():
            task.result()  # its start-up error, as it is
        raise RuntimeError("the daemon did not listen within 30 s")
    url = d.urls["proxy"]
    params = RequestParams(max_tokens=ctx.daemon_max_tokens)
    spans: list[tuple[str, int, int, int]] = []  # (phase, sent ns, ended ns, tokens)
    errors: list[str] = []
    h = ctx.nvml.nvmlDeviceGetHandleByIndex(ctx.index)
    counter: dict[str, tuple[float, int, int]] = {}  # phase: (J by this process's own fresh counter reads, t0, t1)

    async def phase(tag: str, concurrency: int, n: int) -> None:
        async with aiohttp.ClientSession(headers={"X-Powerprof-Tag": tag}) as s:
            server = await detect_server(s, url)
            loop = asyncio.get_running_loop()
            e0, t0, _ = await loop.run_in_executor(None, fresh_counter_mj, ctx.nvml, h)

            async def one(k: int):
                r = await send_request(s, server, f"Daemon check {tag} {k}: tell a long story.", params)
                if r.error:
                    errors.append(f"{tag}: {r.error}")
                else:
                    spans.append((tag, r.t_send_ns, r.t_end_ns, r.generated_tokens))

            for first in range(0, n, concurrency):
                if d.stop_event.is_set():  # a signal stopped the daemon: nothing more to send through it
                    return
                await asyncio.gather(*(one(k) for k in range(first, min(n, first + concurrency))))
            e1, t1, _ = await loop.run_in_executor(None, fresh_counter_mj, ctx.nvml, h)
            counter[tag] = ((e1 - e0) / 1e3, t0, t1)

    t_load = time.monotonic()
    await phase("c1", 1, ctx.daemon_requests)
    await asyncio.sleep(1.5)  # an idle interval between the phases
    await phase("c8", 8, 8)
    load_s = time.monotonic() - t_load
    # Until every request's intervals have closed and its row is written (bounded: a loaded host is slow).
    deadline = time.monotonic() + 30
    while d.ledger is not None and d.ledger.requests and time.monotonic() < deadline and not d.stop_event.is_set():
        await asyncio.sleep(0.1)
    open_left = len(d.ledger.requests) if d.ledger is not None else None
    edge_reads = d.edge_reads
    signalled = d.stop_event.is_set()  # by a signal: nothing here sets it before this line
    d.stop_event.set()
    rc = await asyncio.wait_for(task, 60)
    return {"exit": rc, "load_s": _num(load_s, 1), "max_tokens": ctx.daemon_max_tokens, "client_errors": errors[:5],
            "requests_open_at_stop": open_left, "edge_reads": edge_reads, "_t0_ns": d.t0_ns, "_spans": spans,
            "_counter": counter, "_signalled": signalled}


def _daemon_dataset(ctx, data: Path, t0_ns: int, spans: list, counter: dict) -> dict:
    """What the daemon wrote, beside what the client saw and (simulated) the GPU's truth."""
    import pyarrow.dataset as ds

    def table(name):
        path = data / name
        return ds.dataset(str(path), format="parquet", partitioning="hive").to_table().to_pylist() if path.exists() else []

    # The tagged requests that carry tokens (the client's server detection passes through too, as GETs).
    reqs = [r for r in table("requests") if r["tag"] in ("c1", "c8") and r["api"] is not None]
    ivs = table("intervals")
    out: dict = {"requests_sent": {t: sum(1 for s in spans if s[0] == t) for t in ("c1", "c8")},
                 "rows": {t: sum(1 for r in reqs if r["tag"] == t) for t in ("c1", "c8")},
                 "outcomes": dict(sorted(Counter(r["outcome"] for r in reqs).items())),
                 "rows_without_energy": sum(1 for r in reqs if r["gpu_energy_j"] is None),
                 "notes": dict(sorted(Counter((r["energy_note"] or "")[:100] or None for r in reqs).items(), key=str)),
                 "tokens_client_vs_rows": {t: [sum(s[3] for s in spans if s[0] == t),
                                               sum(r["generated_tokens"] or 0 for r in reqs if r["tag"] == t)]
                                           for t in ("c1", "c8")},
                 "phases": {}}
    for t in ("c1", "c8"):
        rows = [r for r in reqs if r["tag"] == t and r["gpu_energy_j"] is not None and r["attributed_tokens"]]
        e = sum(r["gpu_energy_j"] for r in rows)
        toks = sum(r["attributed_tokens"] for r in rows)
        ph = {"rows_with_energy": len(rows), "gpu_energy_j": _num(e, 2), "attributed_tokens": _num(toks, 1),
              "gpu_j_per_token": _num(e / toks, 4) if toks else None,
              "ttft_s_median": _num(statistics.median([r["ttft_s"] for r in rows if r["ttft_s"] is not None] or [float("nan")]), 3)}
        if t in counter and len(rows) == out["requests_sent"][t]:
            # This process's own counter reads, fresh (just after a refresh), around the phase: its requests'
            # energy plus the idle power over the moments none was live (reads to the first send, between
            # requests, last end to the read), at part 3's idle power with the model loaded.
            counter_j, c0, c1 = counter[t]
            live = _union_s([(a, b) for tag, a, b, _ in spans if tag == t])
            idle_s = (c1 - c0) / 1e9 - live
            idle_w = _get(ctx.report, "energy_idle", "at_50hz", "counter_avg_power_w")
            ph.update(counter_j=_num(counter_j, 2), live_s=_num(live, 3), idle_s=_num(idle_s, 3))
            if idle_w is not None and counter_j > idle_w * idle_s:
                ph["energy_vs_counter"] = _num(e / (counter_j - idle_w * idle_s), 4)
        try:
            since = min(a for tag, a, _, _ in spans if tag == t)
            ph["generator_tok_s"] = _generator_rates(ctx, 1 if t == "c1" else 8, since).get("tok_s")
        except Exception as exc:  # a figure beside the others: its absence is said, the part goes on
            ph["generator_tok_s"] = f"unread: {type(exc).__name__}"
        if ctx.truth_fn is not None and t == "c1":
            # One request at a time: its energy is the GPU's from its arrival to its end (the edges' reads).
            true_j = sum(ctx.truth_fn(a, b) for tag, a, b, _ in spans if tag == t)
            ph["true_gpu_energy_j"] = _num(true_j, 2)
            ph["energy_vs_true"] = _num(e / true_j, 4) if true_j and len(rows) == out["requests_sent"][t] else None
        out["phases"][t] = ph
    if ivs:
        dur = [r["duration_s"] for r in ivs]
        by_kind: dict = {}
        for r in ivs:
            by_kind[r["kind"]] = _num((by_kind.get(r["kind"]) or 0) + (r["gpu_energy_j"] or 0), 2)
        gpu = [r["gpu_energy_j"] for r in ivs if r["gpu_energy_j"] is not None]
        split = sum((r["requests_energy_j"] or 0) + (r["idle_energy_j"] or 0) + (r["unproxied_energy_j"] or 0)
                    for r in ivs if r["gpu_energy_j"] is not None)
        out["intervals"] = {"n": len(ivs), "duration_s_total": _num(sum(dur), 2), "duration_s_median": _num(statistics.median(dur), 3), "duration_s_max": _num(max(dur), 3),
                            "energy_method": sorted({str(r["energy_method"]) for r in ivs}),
                            "server_count": sorted({str(r["server_count"]) for r in ivs}),
                            "gpu_energy_j_by_kind": by_kind, "without_gpu_energy": len(ivs) - len(gpu),
                            "split_vs_total": _num(split / sum(gpu), 6) if gpu and sum(gpu) else None}
        if ctx.truth_fn is not None and gpu:
            t_a = t0_ns + int(min(r["t_start_mono_s"] for r in ivs) * 1e9)
            t_b = t0_ns + int(max(r["t_start_mono_s"] + r["duration_s"] for r in ivs) * 1e9)
            out["intervals"]["total_vs_true"] = _num(sum(gpu) / ctx.truth_fn(t_a, t_b), 4) if len(gpu) == len(ivs) else None
    dec = {x["concurrency"]: x for x in _get(ctx.report, "decode", "concurrency") or []}
    for c, t in ((1, "c1"), (8, "c8")):
        m = _get(dec, c, "gpu_j_per_token")
        dj = out["phases"][t]["gpu_j_per_token"]
        out["phases"][t]["measure_decode_j_per_token"] = m
        out["phases"][t]["daemon_vs_measure"] = _num(dj / m, 3) if dj and m else None
    return out


def _union_s(spans: list[tuple[int, int]]) -> float:
    """Seconds covered by at least one of the (start ns, end ns) spans."""
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e9


# --- 5. sweep dry-run ------------------------------------------------------------------------------------


def check_sweep_dry_run(ctx) -> dict:
    args = ["sweep", "--dry-run", "--limits", "100%,85%,70%", "--gpus", str(ctx.index)]
    args += ctx.sim_flag if ctx.simulate else ["--server", ctx.url or "http://127.0.0.1:9"]
    return run_cli(args, ctx.out, 60, ctx.cli_env)


# --- the run ----------------------------------------------------------------------------------------------


def start_decode_server(ctx, size: str | None, device: str) -> subprocess.Popen:
    ready = ctx.out / "server_ready.json"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "gpu_check_server.py"), "--ready-file", str(ready), "--device", device]
    if size:
        cmd += ["--size", size]
    env = os.environ.copy()
    if device != "cpu":
        # The server's cuda:0 is the NVML index we measure.
        if env.get("CUDA_VISIBLE_DEVICES") is None:
            env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(ctx.index))
        # else: whoever set it chose the GPU; the check measures the first one it makes visible
    log = open(ctx.out / "server.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_server(ctx, proc, timeout_s: float) -> dict:
    ready = ctx.out / "server_ready.json"
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            tail = (ctx.out / "server.log").read_text()[-2000:]
            raise RuntimeError(f"decode server exited with {proc.returncode}: {tail}")
        time.sleep(0.2)
    raise RuntimeError(f"decode server not ready after {timeout_s:g} s")


def write_reports(report: dict, out: Path) -> None:
    """Both files, rewritten after every part: a run killed by its timeout still leaves what it measured."""
    tmp = out / ".gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out / "gpu_check.json")
    (out / "gpu_check.md").write_text(markdown(report))


def section(report: dict, name: str, budget: Budget, need_s: float, fn, *args):
    """Run one part; record its result, its error, or why it was skipped."""
    if budget.left() < need_s:
        report[name] = {"skipped": f"time budget: {budget.left():.0f} s left, this part needs ~{need_s:.0f} s"}
        print(f"[gpu_check] {name}: skipped (budget)", flush=True)
        return None
    t0 = time.monotonic()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        res = fn(*args)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res["section_s"] = round(time.monotonic() - t0, 2)
    report[name] = res
    write_reports(report, report["meta"]["out"])
    print(f"[gpu_check] {name} done in {res['section_s']:.1f} s" + (f": {res['error']}" if "error" in res else ""), flush=True)
    return res


def run_check(a) -> dict:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "setter_calls.jsonl"
    log.unlink(missing_ok=True)
    # A timeout's SIGTERM unwinds like an exception, so the decode server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budget = Budget(a.budget_s)
    patched = install_guard(log)
    ctx = SimpleNamespace()  # what every part needs: NVML, GPU index, server URL, durations
    ctx.out, ctx.index, ctx.simulate, ctx.quick, ctx.budget = out, a.gpu, a.simulate, a.quick, budget
    q = a.quick
    ctx.monitor_s = 3.0 if q else 20.0
    ctx.n_calls = 1000
    ctx.n_ticks = 100 if q else 300
    ctx.sampler_s = 1.0 if q else 3.0
    ctx.energy_s = 4.0 if q else 10.0
    ctx.poll_s = 0.5 if q else 2.0
    ctx.n_requests = 8
    ctx.daemon_requests = 4 if q else 6  # at concurrency 1 through the daemon, then 8 at once
    ctx.report = None  # set below: the daemon part reads the decode part's figures
    ctx.pulse_period_ms, ctx.pulse_on_ms = 100.0, 20.0 if q else 10.0
    ctx.pulse_s, ctx.pulse_phases = (0.6, 3) if q else (2.0, 6)
    ctx.max_tokens = 64 if q else 128
    ctx.cli_max_tokens = 32 if q else 64
    ctx.cli_env = dict(os.environ, **{SETTER_LOG_ENV: str(log)})
    ctx.sim_flag = ["--simulate", a.simulate] if a.simulate else []
    ctx.truth_fn = None
    ctx.sim_server = None
    ctx.url = None
    report: dict = {"meta": {
        "powerprof_gpu_check": 1, "simulated": bool(a.simulate), "profile": a.simulate, "quick": q,
        "argv": sys.argv[1:], "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(), "python": platform.python_version(), "gpu_index": a.gpu,
        "setters_guarded": len(patched), "out": out, "complete": False,
    }}
    from powerprof import __version__

    report["meta"]["powerprof_version"] = __version__
    ctx.report = report
    if a.simulate:
        from powerprof.sim.nvml import SimNVML

        a.gpu = a.gpu or 0
        ctx.nvml = SimNVML(a.simulate, count=a.gpu + 1, record_history=True)
        gpu = ctx.nvml.gpus[a.gpu]
        ctx.truth_fn = lambda t0, t1: gpu.true_energy_at_j(t1) - gpu.true_energy_at_j(t0)
    else:
        import pynvml

        ctx.nvml = pynvml
    from powerprof.collectors.nvml import NvmlCollector

    try:
        ctx.nvml.nvmlInit()
        if a.gpu is None:  # the first GPU CUDA_VISIBLE_DEVICES lets this process use, as NVML numbers it
            from powerprof.collectors.nvml import visible_indexes

            visible = visible_indexes(ctx.nvml)
            if not visible:
                raise RuntimeError("no visible GPU (NVML sees none, or CUDA_VISIBLE_DEVICES hides them all)")
            a.gpu = visible[0]
        ctx.index = report["meta"]["gpu_index"] = a.gpu
        probe = NvmlCollector(ctx.nvml, [a.gpu])
    except Exception as e:
        # Nothing below can run without the GPU; say why instead of leaving no report at all.
        which = "the GPU" if a.gpu is None else f"GPU {a.gpu}"
        report["meta"]["error"] = f"{which} not reachable through NVML: {type(e).__name__}: {e}"
        report["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
        write_reports(report, out)
        return report
    ctx.avg_window_s = probe.infos[0].power_avg_window_s
    report["meta"]["gpu_name"] = probe.infos[0].name
    report["meta"]["driver_version"] = probe.infos[0].driver_version
    report["meta"]["supports"] = probe.infos[0].supports
    report["meta"]["power_avg_window_s"] = ctx.avg_window_s
    probe.close()
    settings_before = read_settings(ctx.nvml, [a.gpu])
    # The decode server loads its model while devices/monitor run.
    proc = None
    model = a.model or (None if not a.simulate else "sim")
    if model != "sim":
        device = "cpu" if a.simulate else "cuda"
        proc = start_decode_server(ctx, model, device)
        (out / "server.pid").write_text(str(proc.pid))  # gpu_check_run.sh ends it if we are killed
    try:
        # monitor runs while the model loads (its first seconds show the load); idle figures come after.
        section(report, "devices_monitor", budget, ctx.monitor_s + 10, check_devices_monitor, ctx)
        try:
            if proc is not None:
                report["server"] = wait_server(ctx, proc, max(10.0, min(a.server_timeout_s, budget.left() - 60)))
                ctx.url = report["server"]["url"]
            else:
                from powerprof.sim.server import SimServer

                ctx.sim_server = SimServer(ctx.nvml, n_slots=8).start()
                ctx.url = ctx.sim_server.url
                report["server"] = {"url": ctx.url, "kind": "powerprof simulated server", "profile": a.simulate}
        except Exception as e:
            report["server"] = {"error": f"{type(e).__name__}: {e}"}
        section(report, "nvml_cost", budget, 10, check_nvml_cost, ctx)
        section(report, "energy_idle", budget, ctx.energy_s + ctx.poll_s + 3, check_energy, ctx,
                "idle (decode model loaded)" if proc is not None else "idle")
        if a.simulate:
            ctx.pulse = lambda *args: sim_pulse(ctx.nvml.gpus[a.gpu], *args)
        elif ctx.url:
            ctx.pulse = http_pulse(ctx.url)
        if a.simulate or ctx.url:
            need = (ctx.pulse_phases + 1) * (ctx.pulse_s + 0.6) + 2
            section(report, "sensor_coverage", budget, need, check_sensor_coverage, ctx)
        else:
            report["sensor_coverage"] = {"skipped": "no decode server to run the GPU load"}
        if ctx.url:
            def loaded():
                with BackgroundLoad(ctx.url, 8, 2048 if not q else 256) as load:
                    r = check_energy(ctx, "decode load, 8 streams")
                r["load_requests_finished_tokens"], r["load_errors"] = load.tokens, load.errors[:5]
                return r

            section(report, "energy_load", budget, ctx.energy_s + ctx.poll_s + 10, loaded)
            section(report, "decode", budget, 40 if q else 90, check_decode, ctx)
            section(report, "cli_measure", budget, 20 if q else 40, check_cli_measure, ctx)
            ctx.daemon_max_tokens = _get(report, "decode", "max_tokens") or ctx.max_tokens
            section(report, "daemon", budget, 25 if q else 60, check_daemon, ctx)
        else:
            for name in ("energy_load", "decode", "cli_measure", "daemon"):
                report[name] = {"skipped": "no decode server: " + report["server"].get("error", "")}
        section(report, "sweep_dry_run", budget, 10, check_sweep_dry_run, ctx)
    finally:
        if ctx.sim_server is not None:
            ctx.sim_server.stop()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            (out / "server.pid").unlink(missing_ok=True)
    settings_after = read_settings(ctx.nvml, [a.gpu])
    calls = setter_calls(log)
    report["safety"] = {"setters_guarded": len(patched), "setter_calls": calls, "settings_before": settings_before,
                        "settings_after": settings_after, "settings_unchanged": settings_before == settings_after,
                        "ok": not calls and settings_before == settings_after}
    ctx.nvml.nvmlShutdown()
    report["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    report["meta"]["complete"] = True
    write_reports(report, out)
    return report


# --- Markdown ------------------------------------------------------------------------------------------------


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return " – ".join(_cell(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    return f"{v:g}" if isinstance(v, float) else str(v)


def _table(head: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_cell(x) for x in r) + " |" for r in rows]
    return out + [""]


def _status(sec) -> list[str]:
    if sec is None:
        return ["(not run)", ""]
    if "skipped" in sec:
        return [f"**Skipped:** {sec['skipped']}", ""]
    if "error" in sec:
        return [f"**Failed:** `{sec['error']}`", ""]
    return []


def _get(r: dict, *path):
    for k in path:
        if isinstance(r, dict):
            r = r.get(k)
        elif isinstance(r, list) and isinstance(k, int) and -len(r) <= k < len(r):
            r = r[k]
        else:
            return None
    return r


def _call(r: dict, name: str) -> str | None:
    for x in _get(r, "nvml_cost", "calls") or []:
        if x["call"].startswith(name + "("):
            return f"{_cell(x['median_us'])} / {_cell(x['p99_us'])}"
    return None


def _pair(*vals) -> str | None:
    return None if all(v is None for v in vals) else " / ".join(_cell(v) for v in vals)


def summary_rows(r: dict) -> list[list]:
    """The headline figures, in the order of docs/hardware.md's results table."""
    m = r["meta"]
    upd = lambda state, k: _get(r, state, "update_intervals", k, "interval_ms_median")  # noqa: E731
    dec = {x["concurrency"]: x for x in _get(r, "decode", "concurrency") or []}
    dd = lambda c, k: _get(dec.get(c) or {}, "during_decode", k)  # noqa: E731
    sc = _get(r, "sensor_coverage", "seen_vs_expected_min_max")
    sw = _get(r, "sweep_dry_run", "stdout") or ""
    levels = next((ln.split(":", 1)[1].strip() for ln in sw.splitlines() if ln.startswith("Power limit levels")), None)
    s = r.get("safety") or {}
    return [
        ["GPU, driver", f"{m.get('gpu_name')}, {m.get('driver_version')}"],
        ["readings supported", f"{sum(bool(v) for v in (m.get('supports') or {}).values())} of {len(m.get('supports') or {})}"],
        ["NVML µs median / p99: FieldValues(186)", _call(r, "nvmlDeviceGetFieldValues")],
        ["NVML µs median / p99: TotalEnergyConsumption", _call(r, "nvmlDeviceGetTotalEnergyConsumption")],
        ["NVML µs median / p99: PowerUsage", _call(r, "nvmlDeviceGetPowerUsage")],
        ["NVML µs median / p99: CurrentClocksEventReasons", _call(r, "nvmlDeviceGetCurrentClocksEventReasons")],
        ["calls per tick; read() wall median / p99 µs", _pair(_get(r, "nvml_cost", "tick_calls_per_gpu"),
                                                             _get(r, "nvml_cost", "read_one_gpu", "wall_median_us"),
                                                             _get(r, "nvml_cost", "read_one_gpu", "wall_p99_us"))],
        ["sampler CPU per tick at 50 Hz µs; CPU % at 1 Hz", _pair(_get(r, "nvml_cost", "sampler_50hz", "cpu_per_tick_us"),
                                                                 _get(r, "nvml_cost", "sampler_50hz", "cpu_pct_at_1hz"))],
        ["counter update interval ms, idle / load", _pair(upd("energy_idle", "counter"), upd("energy_load", "counter"))],
        ["instant power update ms (value / driver timestamp), load",
         _pair(upd("energy_load", "instant_power"), upd("energy_load", "instant_power_timestamp"))],
        ["idle power by counter W", _get(r, "energy_idle", "at_50hz", "counter_avg_power_w")],
        ["instant/counter, average/counter at 50 Hz, load", _pair(_get(r, "energy_load", "at_50hz", "instant_vs_counter"),
                                                                  _get(r, "energy_load", "at_50hz", "average_vs_counter"))],
        ["instant/counter, average/counter at 1 Hz, load", _pair(_get(r, "energy_load", "at_1hz", "instant_vs_counter"),
                                                                 _get(r, "energy_load", "at_1hz", "average_vs_counter"))],
        ["bursts: seen/expected across phases, min – max", _cell(sc) if sc else None],
        ["decode model, load s", _pair(_get(r, "server", "size") or _get(r, "server", "kind"), _get(r, "server", "load_s"))],
        ["decode tok/s c=1, measure / generator", _pair(_get(dec, 1, "decode_tok_s"), _get(dec, 1, "generator", "tok_s"))],
        ["decode tok/s c=8, measure / generator", _pair(_get(dec, 8, "decode_tok_s"), _get(dec, 8, "generator", "tok_s"))],
        ["GPU J/token c=1 / c=8", _pair(_get(dec, 1, "gpu_j_per_token"), _get(dec, 8, "gpu_j_per_token"))],
        ["power while decoding W c=1 / c=8; enforced limit", _pair(dd(1, "instant_power_w_median"), dd(8, "instant_power_w_median"),
                                                                  dd(8, "enforced_limit_w"))],
        ["cap binds c=1 / c=8; reasons at c=8", _pair(dd(1, "cap_binds"), dd(8, "cap_binds"), dd(8, "clock_event_reasons_share"))],
        ["daemon: rows / requests sent; rows without energy", _pair(
            sum((_get(r, "daemon", "rows") or {}).values()) if _get(r, "daemon", "rows") else None,
            sum((_get(r, "daemon", "requests_sent") or {}).values()) if _get(r, "daemon", "requests_sent") else None,
            _get(r, "daemon", "rows_without_energy"))],
        ["daemon GPU J/token c=1 / c=8; its requests' energy ÷ the counter's over them", _pair(
            _get(r, "daemon", "phases", "c1", "gpu_j_per_token"), _get(r, "daemon", "phases", "c8", "gpu_j_per_token"),
            _get(r, "daemon", "phases", "c1", "energy_vs_counter"), _get(r, "daemon", "phases", "c8", "energy_vs_counter"))],
        ["sweep --dry-run levels", levels],
        ["read-only verdict", None if not s else ("OK" if s.get("ok") else "VIOLATION")
         + f" ({len(s.get('setter_calls', []))} setter calls, settings unchanged: {s.get('settings_unchanged')})"],
    ]


def markdown(r: dict) -> str:
    m = r["meta"]
    L = [f"# powerprof hardware check: {m.get('gpu_name') or 'no GPU'}", ""]
    if m.get("error"):
        L += [f"**Failed to start:** {m['error']}", ""]
    elif not m.get("complete"):
        L += ["**Incomplete:** the run stopped before its end (timeout or crash); what is below was measured.", ""]
    if m["simulated"]:
        L += [f"**Simulated** ({m['profile']}): these figures exercise the check, they say nothing about real hardware.", ""]
    L += _table(["what", "value"], [["GPU", f"{m.get('gpu_name')} (NVML index {m['gpu_index']})"],
                                    ["driver", m.get("driver_version")], ["powerprof", m.get("powerprof_version")],
                                    ["started (UTC)", m["started_utc"]], ["took", f"{m.get('elapsed_s')} s"],
                                    ["readings supported", ", ".join(k for k, v in (m.get("supports") or {}).items() if v)],
                                    ["average power window", f"{m.get('power_avg_window_s')} s"]])
    L += ["## Summary (the rows of docs/hardware.md's results table)", ""]
    L += _table(["figure", "value"], summary_rows(r))
    s = r.get("safety", {})
    L += ["## 6. Read-only", ""]
    L += _table(["setters guarded", "setter calls", "settings unchanged", "verdict"],
                [[s.get("setters_guarded"), len(s.get("setter_calls", [])), s.get("settings_unchanged"),
                  "OK" if s.get("ok") else "**VIOLATION**"]])
    L += _table(["", "power limit W", "enforced W"],
                [["before", x.get("power_limit_w"), x.get("enforced_limit_w")] for x in s.get("settings_before", [])]
                + [["after", x.get("power_limit_w"), x.get("enforced_limit_w")] for x in s.get("settings_after", [])])
    dm = r.get("devices_monitor")
    L += ["## 1. `powerprof devices --json` and `monitor`", ""] + _status(dm)
    if dm and "devices" in dm:
        for key in ("devices", "monitor"):
            x = dm[key]
            L += [f"`{x['command']}` → rc {x['rc']} in {x['seconds']} s", "", "```", x["stdout"].rstrip()[-6000:], "```", ""]
            if x["stderr"].strip():
                L += ["stderr:", "```", x["stderr"].rstrip()[-1500:], "```", ""]
    c = r.get("nvml_cost")
    L += ["## 2. NVML call cost", ""] + _status(c)
    if c and "calls" in c:
        L += [f"{c['n_calls']} calls each; made at: probe (once at start), tick (every sample, and every window edge).", ""]
        L += _table(["call", "made at", "median µs", "p99 µs", "max µs", "error"],
                    [[x["call"], ", ".join(x["phases"]), x["median_us"], x["p99_us"], x["max_us"], x["error"]]
                     for x in c["calls"]])
        o, sp = c["read_one_gpu"], c["sampler_50hz"]
        L += _table(["sampler cost (one GPU)", "value"], [
            ["calls per tick", c["tick_calls_per_gpu"]], ["sum of their medians", f"{c['sum_of_tick_call_medians_us']} µs"],
            ["read(): wall median / p99", f"{o['wall_median_us']} / {o['wall_p99_us']} µs"],
            ["read(): CPU median / p99", f"{o['cpu_median_us']} / {o['cpu_p99_us']} µs"],
            ["running sampler, CPU per tick", f"{sp['cpu_per_tick_us']} µs"],
            ["CPU at 1 Hz / 50 Hz", f"{sp['cpu_pct_at_1hz']} % / {sp['cpu_pct_at_50hz']} %"],
            ["missed / errors at 50 Hz", f"{sp['missed']} / {sp['errors']}"]])
    L += ["## 3. Energy counter vs integrated power", ""]
    rows = []
    upd = []
    for key in ("energy_idle", "energy_load"):
        e = r.get(key)
        L += _status(e)
        if not e or "at_50hz" not in e:
            continue
        for rate in ("at_50hz", "at_1hz"):
            x = e[rate]
            rows.append([e["state"], rate[3:], x.get("interval_s"), x.get("counter_j"), x.get("instant_integrated_j"),
                         x.get("average_integrated_j"), x.get("instant_vs_counter"), x.get("average_vs_counter"),
                         x.get("counter_avg_power_w"), x.get("counter_vs_true")])
        u = e["update_intervals"]
        for k in ("counter", "instant_power", "instant_power_timestamp", "average_power"):
            upd.append([e["state"], k, u[k]["changes"], u[k]["interval_ms_median"], u[k]["interval_ms_p10_p90"],
                        u.get("poll_gap_ms_max")])
    if rows:
        L += _table(["state", "rate", "interval s", "counter J", "instant∫ J", "average∫ J", "instant/counter",
                     "average/counter", "counter W", "counter/true (sim)"], rows)
        L += ["Observed update interval (tight polling; instant power from the driver's own sample timestamps):", ""]
        L += _table(["state", "reading", "changes", "median ms", "p10 – p90 ms", "longest poll gap ms"], upd)
    sc = r.get("sensor_coverage")
    L += ["### Does the sensor see every burst?", ""] + _status(sc)
    if sc and "runs" in sc:
        L += [f"Bursts of {sc['on_ms']} ms every {sc['period_ms']} ms for {sc['run_s']} s at {len(sc['runs'])} phases; "
              f"idle {sc['idle_w']} W, continuous load {sc['continuous_busy_excess_w']} W above idle. "
              f"seen/expected = the counter's energy above idle ÷ what continuous load predicts for the busy time "
              f"(1: every burst counted; a sensor that sees 25% of each period spreads it between ~0 and ~4 by phase).", ""]
        L += _table(["phase ms", "bursts", "busy s", "excess J", "seen/expected", "counter/true (sim)"],
                    [[x["phase_ms"], x["bursts"], x["busy_s"], x["excess_j"], x["seen_vs_expected"], x.get("counter_vs_true")]
                     for x in sc["runs"]])
    d = r.get("decode")
    L += ["## 4. Decode load and measure", ""]
    sv = r.get("server") or {}
    L += [f"Server: `{json.dumps({k: v for k, v in sv.items() if k != 'url'})}`", ""] + _status(d)
    if d and "concurrency" in d:
        L += [f"{d['n_requests']} requests of {d['max_tokens']} tokens per concurrency"
              + (f" ({d['note']})" if d.get("note") else "") + ".", ""]
        L += _table(["concurrency", "ok", "decode tok/s (measure)", "generator tok/s", "measure/generator",
                     "server timings tok/s", "GPU J/token", "true J/token (sim)", "method", "low-confidence windows"],
                    [[x["concurrency"], x["n_ok"], x["decode_tok_s"], (x.get("generator") or {}).get("tok_s"),
                      x.get("measured_vs_generator"), x.get("server_timings_tok_s_median"), x["gpu_j_per_token"],
                      x.get("true_j_per_token"), x["energy_method"], x["low_confidence_windows"]]
                     for x in d["concurrency"]])
        L += _table(["concurrency", "power W median / p95 / max", "avg power W", "enforced limit W", "power/limit",
                     "SM MHz (max)", "cap binds", "clock-event reasons (share of samples)"],
                    [[x["concurrency"], f"{dd.get('instant_power_w_median')} / {dd.get('instant_power_w_p95')} / "
                      f"{dd.get('instant_power_w_max')}", dd.get("average_power_w_median"), dd.get("enforced_limit_w"),
                      dd.get("power_over_limit_median"), f"{dd.get('sm_clock_mhz_median')} ({dd.get('sm_clock_max_mhz')})",
                      dd.get("cap_binds"), dd.get("clock_event_reasons_share")]
                     for x in d["concurrency"] for dd in [x.get("during_decode") or {}]])
    cm = r.get("cli_measure")
    if cm:
        L += _status(cm)
        if "command" in cm:
            L += [f"`{cm['command']}` → rc {cm['rc']}", "", "```", cm["stdout"].rstrip(), "```", ""]
    dm = r.get("daemon")
    L += ["## 4b. The daemon in front of the same server", ""] + _status(dm)
    if dm and "phases" in dm:
        L += [f"{sum(dm['requests_sent'].values())} requests of {dm['max_tokens']} tokens through the daemon's proxy "
              f"(tag c1: one at a time; c8: eight at once), 1 Hz sampling, in {dm['load_s']} s; daemon exit "
              f"{dm['exit']}, {dm['edge_reads']} on-demand edge reads, rows still open at the stop: "
              f"{dm['requests_open_at_stop']}; client errors: {dm['client_errors'] or 'none'}.", ""]
        L += _table(["phase", "sent", "rows", "rows with energy", "tokens client / rows", "GPU J", "J/token",
                     "counter J over the phase (live s, idle s)", "energy ÷ (counter − idle)", "generator tok/s",
                     "measure's decode J/token (part 4)", "median TTFT s", "energy/true (sim)"],
                    [[t, dm["requests_sent"][t], dm["rows"][t], ph["rows_with_energy"], dm["tokens_client_vs_rows"][t],
                      ph["gpu_energy_j"], ph["gpu_j_per_token"],
                      f"{_cell(ph.get('counter_j'))} ({_cell(ph.get('live_s'))}, {_cell(ph.get('idle_s'))})",
                      ph.get("energy_vs_counter"), ph.get("generator_tok_s"), ph.get("measure_decode_j_per_token"),
                      ph["ttft_s_median"], ph.get("energy_vs_true")]
                     for t, ph in dm["phases"].items()])
        L += _table(["outcomes", "rows without energy", "energy notes (first 100 characters: rows)"],
                    [[dm["outcomes"], dm["rows_without_energy"], dm["notes"]]])
        iv = dm.get("intervals")
        if iv:
            L += _table(["intervals", "duration s median / max", "energy method", "server count", "GPU J by kind",
                         "requests+idle+bypass / total", "total/true (sim)"],
                        [[iv["n"], f"{iv['duration_s_median']} / {iv['duration_s_max']}", iv["energy_method"],
                          iv["server_count"], iv["gpu_energy_j_by_kind"], iv["split_vs_total"], iv.get("total_vs_true")]])
    sw = r.get("sweep_dry_run")
    L += ["## 5. `powerprof sweep --dry-run`", ""] + _status(sw)
    if sw and "command" in sw:
        L += [f"`{sw['command']}` → rc {sw['rc']}", "", "```", (sw["stdout"] + sw["stderr"]).rstrip(), "```", ""]
    return "\n".join(L) + "\n"


def cli_main(args: list[str]) -> int:
    """`gpu_check.py cli ARGS`: powerprof's CLI with every NVML setter guarded (logged, raising)."""
    install_guard(os.environ.get(SETTER_LOG_ENV))
    from powerprof.cli import main

    try:
        main(args=args, prog_name="powerprof")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cli"]:
        return cli_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="Folder for gpu_check.json, gpu_check.md and the logs.")
    ap.add_argument("--gpu", type=int, default=None,
                    help="NVML index of the GPU to check (default: the first one CUDA_VISIBLE_DEVICES allows).")
    ap.add_argument("--simulate", nargs="?", const=DEFAULT_PROFILE, default=None,
                    help=f"Simulated GPU profile (default {DEFAULT_PROFILE}) and, unless --model, the simulated server.")
    ap.add_argument("--model", choices=["tiny", "1b", "3b", "8b", "fake"], default=None,
                    help="Decode server model shape (default 8b on a GPU; with --simulate: the simulated server). "
                         "fake: bench/gpu_check_server.py without torch, a fixed time per step (tests its paths in CI).")
    ap.add_argument("--quick", action="store_true", help="Shorter phases (the simulator test).")
    ap.add_argument("--budget-s", type=float, default=270.0, help="Skip parts that would overrun this many seconds.")
    ap.add_argument("--server-timeout-s", type=float, default=180.0, help="Longest wait for the model to load.")
    a = ap.parse_args(argv)
    report = run_check(a)
    if "error" in report["meta"]:
        print(f"[gpu_check] {report['meta']['error']}; wrote {Path(a.out) / 'gpu_check.md'}", flush=True)
        return 3
    s = report["safety"]
    print(f"[gpu_check] wrote {Path(a.out) / 'gpu_check.json'} and gpu_check.md in {report['meta']['elapsed_s']} s; "
          f"read-only: {'OK' if s['ok'] else 'VIOLATION'}", flush=True)
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    if failed:
        print(f"[gpu_check] parts that failed: {', '.join(failed)}", flush=True)
    return 0 if s["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())
