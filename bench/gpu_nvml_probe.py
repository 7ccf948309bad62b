"""Read-only probe of what NVML reads cost on a real GPU, and whether they slow a decode beside them.

The first hardware check (docs/hardware.md) found `nvmlDeviceGetTotalEnergyConsumption` costing
milliseconds of CPU per call on an H200, a thousand times the other reads. This probe answers the
questions that raises, in one short run (~2 minutes with the 8B model):

1. Which way of reading the energy counter is cheap: the direct call, or the same counter through
   `nvmlDeviceGetFieldValues` (fields 83 TOTAL_ENERGY_CONSUMPTION and 191 ENERGY)? Wall and CPU time per
   call (median, p99), each one's refresh interval under tight polling, and whether they agree.
2. Does polling slow the server? A random-weight Llama (bench/gpu_check_server.build_model) decodes
   a fixed number of tokens at batch 1 and 8 while another process polls one NVML read at a given rate
   (none, the counter at 1/10/50 Hz, the field at 50 Hz, average power at 50 Hz). Time per decode step
   for each, in alternating order, two rounds.

Never calls a setter (gpu_check.install_guard in both processes). Writes nvml_probe.json to --out.

    python bench/gpu_nvml_probe.py --out DIR                       # real GPU (needs torch + transformers)
    python bench/gpu_nvml_probe.py --out DIR --simulate --model tiny   # smoke test on the simulator, CPU model
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_check import install_guard  # noqa: E402

FI_TOTAL_ENERGY = 83
FI_ENERGY = 191
FI_POWER_INSTANT = 186
FI_SW_POWER_CAP_NS = 74  # time spent held by the power cap since boot: a counter, where sampled bits guess

POLLERS = {  # name -> (call, rate_hz)
    "none": (None, 0.0),
    "counter_1hz": ("total_energy", 1.0),
    "counter_10hz": ("total_energy", 10.0),
    "counter_50hz": ("total_energy", 50.0),
    "field83_50hz": ("field83", 50.0),
    "power_usage_50hz": ("power_usage", 50.0),
}


def open_nvml(simulate: str | None):
    if simulate:
        from powerprof.sim.nvml import SimNVML

        nvml = SimNVML(simulate, count=1)
    else:
        import pynvml as nvml
    nvml.nvmlInit()
    return nvml


def reader(nvml, h, name: str):
    """One NVML read by name, returning a number (mJ, mW) or raising NVMLError."""
    if name == "total_energy":
        return lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)
    if name == "power_usage":
        return lambda: nvml.nvmlDeviceGetPowerUsage(h)
    if name == "power_limit":
        return lambda: nvml.nvmlDeviceGetPowerManagementLimit(h)
    if name == "enforced_limit":
        return lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h)
    fields = {"field83": [FI_TOTAL_ENERGY], "field191": [FI_ENERGY], "field186": [FI_POWER_INSTANT],
              "field83_186": [FI_TOTAL_ENERGY, FI_POWER_INSTANT],
              "field74": [FI_SW_POWER_CAP_NS]}[name]

    def read_fields():
        vals = nvml.nvmlDeviceGetFieldValues(h, fields)
        v = vals[0]
        if getattr(v, "nvmlReturn", 0) != 0:
            raise RuntimeError(f"field {fields[0]} returned {v.nvmlReturn}")
        vt = getattr(v, "valueType", None)
        u = v.value
        return {1: u.uiVal, 2: u.ulVal, 3: u.ullVal, 4: u.sllVal, 0: u.dVal}.get(vt, u.ullVal)

    return read_fields


def cost(fn, n: int) -> dict:
    wall, cpu, err = np.empty(n), np.empty(n), None
    for k in range(n):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            fn()
        except Exception as e:  # not supported here: still timed, and named
            err = f"{type(e).__name__}: {e}"[:120]
        wall[k], cpu[k] = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
    return {"n": n, "wall_us_median": round(float(np.median(wall)) / 1e3, 2),
            "wall_us_p99": round(float(np.percentile(wall, 99)) / 1e3, 2),
            "cpu_us_median": round(float(np.median(cpu)) / 1e3, 2),
            "cpu_us_p99": round(float(np.percentile(cpu, 99)) / 1e3, 2), "error": err}


def refresh(fn, seconds: float) -> dict:
    """Tight polling: how often the value changes (median ms between changes), and its last value."""
    t_end = time.perf_counter() + seconds
    last, changes, first = None, [], None
    while time.perf_counter() < t_end:
        try:
            v = fn()
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:120]}
        now = time.perf_counter()
        if first is None:
            first = (now, v)
        if last is not None and v != last[1]:
            changes.append(now)
        last = (now, v)
    d = np.diff(changes) * 1e3
    rate = (last[1] - first[1]) / (last[0] - first[0]) if last and last[0] > first[0] else None
    return {"changes": len(changes), "interval_ms_median": round(float(np.median(d)), 2) if d.size else None,
            "last_value": last[1] if last else None, "rate_per_s": round(rate, 3) if rate is not None else None}


def poll(simulate, index, call, rate_hz, stop, out_q):
    """The poller process: `call` at `rate_hz` until stopped; reports each call's wall time."""
    install_guard(None)
    nvml = open_nvml(simulate)
    fn = reader(nvml, nvml.nvmlDeviceGetHandleByIndex(index), call)
    period, ts, nxt = 1.0 / rate_hz, [], time.perf_counter()
    while not stop.is_set():
        t0 = time.perf_counter_ns()
        try:
            fn()
        except Exception:
            pass
        ts.append(time.perf_counter_ns() - t0)
        nxt += period
        stop.wait(max(0.0, nxt - time.perf_counter()))
    a = np.array(ts or [0]) / 1e3
    out_q.put({"calls": len(ts), "wall_us_median": round(float(np.median(a)), 1),
               "wall_us_p99": round(float(np.percentile(a, 99)), 1)})


def decode_step_ms(model, torch, batch: int, n_new: int, device: str) -> float:
    ids = torch.randint(300, 400, (batch, 32), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                       do_sample=False)
    sync()
    return (time.perf_counter() - t0) * 1e3 / n_new


def interference(a, report, out):
    import torch

    from gpu_check_server import build_model

    device = "cpu" if a.simulate else "cuda"
    t0 = time.perf_counter()
    model, n_params, dtype = build_model(a.model, device)
    report["model"] = {"size": a.model, "params": n_params, "dtype": dtype, "load_s": round(time.perf_counter() - t0, 1)}
    for b in (1, 8):
        decode_step_ms(model, torch, b, a.tokens, device)  # warm-up: kernels, allocator, cache
    ctx = mp.get_context("spawn")
    rows = []
    for rnd in range(a.rounds):
        names = list(POLLERS) if rnd % 2 == 0 else list(reversed(POLLERS))
        for name in names:
            call, rate = POLLERS[name]
            stop, q, proc = ctx.Event(), ctx.Queue(), None
            if call:
                proc = ctx.Process(target=poll, args=(a.simulate, a.gpu, call, rate, stop, q), daemon=True)
                proc.start()
                time.sleep(1.0)  # the poller's NVML init and first reads
            row = {"round": rnd, "poller": name}
            for b in (1, 8):
                row[f"step_ms_b{b}"] = round(decode_step_ms(model, torch, b, a.tokens, device), 3)
            if proc:
                stop.set()
                try:
                    row["poller_calls"] = q.get(timeout=10)
                except Exception as e:
                    row["poller_calls"] = {"error": type(e).__name__}
                proc.join(5)
            rows.append(row)
            print(f"[probe] round {rnd} {name}: {row}", flush=True)
            report["interference"] = rows
            (out / "nvml_probe.json").write_text(json.dumps(report, indent=1))
    base = {b: np.median([r[f"step_ms_b{b}"] for r in rows if r["poller"] == "none"]) for b in (1, 8)}
    report["interference_summary"] = {
        name: {f"b{b}_vs_none": round(float(np.median([r[f"step_ms_b{b}"] for r in rows if r["poller"] == name])
                                             / base[b]), 4) for b in (1, 8)} for name in POLLERS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--simulate", nargs="?", const="h200-141g", default=None)
    ap.add_argument("--model", default="8b", choices=["tiny", "1b", "3b", "8b"])
    ap.add_argument("--tokens", type=int, default=48, help="New tokens per timed decode.")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-decode", action="store_true", help="Costs and refresh only.")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    guarded = install_guard(None)
    nvml = open_nvml(a.simulate)
    h = nvml.nvmlDeviceGetHandleByIndex(a.gpu)
    report = {"simulated": bool(a.simulate), "setters_guarded": len(guarded), "pid": os.getpid(),
              "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        report["gpu"] = {"name": str(nvml.nvmlDeviceGetName(h)), "driver": str(nvml.nvmlSystemGetDriverVersion())}
    except Exception as e:
        report["gpu"] = {"error": type(e).__name__}
    names = ["total_energy", "field83", "field191", "field186", "field83_186", "power_usage", "power_limit",
             "enforced_limit", "field74"]
    report["cost"] = {n: cost(reader(nvml, h, n), a.calls) for n in names}
    print("[probe] cost", json.dumps(report["cost"]), flush=True)
    report["refresh"] = {n: refresh(reader(nvml, h, n), 1.5) for n in ("total_energy", "field83", "field191")}
    try:
        report["sw_power_cap_ns_now"] = reader(nvml, h, "field74")()
    except Exception as e:
        report["sw_power_cap_ns_now"] = f"{type(e).__name__}: {e}"[:120]
    print("[probe] refresh", json.dumps(report["refresh"]), flush=True)
    (out / "nvml_probe.json").write_text(json.dumps(report, indent=1))
    if not a.no_decode:
        interference(a, report, out)
        report["cost_after_decode"] = {n: cost(reader(nvml, h, n), a.calls // 3) for n in ("total_energy", "field83")}
    report["complete"] = True
    (out / "nvml_probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("cost", "refresh", "interference_summary") if k in report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
