"""Bench: `powerprof analyze` and `powerprof export` on 10 million sample rows and 100,000 windows.

Writes a synthetic run directory (8 power-limit levels, 4 GPUs sampled ~8 Hz), then runs each
step in a fresh process and prints wall time, the process's peak RSS (ru_maxrss), Arrow's peak pool
allocation and, with --tracemalloc, the numpy/Python peak (tracing slows the steps, so it is off
by default). Side by side: `load-whole` loads
samples.parquet whole (what streaming saves); `duckdb-query` is the engine baseline, one plain
DuckDB GROUP BY over the file (per-level means, medians, energy span, OR of clock reasons, no
window filter); `sample-scan` is the analysis's own sample stage (per-level figures inside the
measured windows plus the timeline, analysis/loading.sample_level_figures); `analyze` is the
whole command.

`--requests N` adds a daemon dataset of N requests (8 days, hive-partitioned) twice: `clean/` as compaction
leaves it, `synced/` with the merged flush files beside it (`aws s3 sync` without --delete: every row twice).
The steps `export-daemon-clean` and `export-daemon-synced` export its requests to Parquet (each row once).

    .venv/bin/python bench/analysis_scale.py [--samples 10000000] [--windows 100000] [--dir /tmp/pp-bench]
        [--steps load-whole,duckdb-query,sample-scan,analyze,export-csv] [--keep]
    .venv/bin/python bench/analysis_scale.py --requests 5000000 --steps export-daemon-clean,export-daemon-synced
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from powerprof.storage.runs import RunWriter
from powerprof.storage.schema import DAEMON_REQUESTS, SAMPLES, WINDOWS

LEVELS = np.array([160.0, 180, 200, 220, 240, 260, 280, 300])
DEVICES = 4
T0_US = int(datetime(2026, 1, 15, tzinfo=timezone.utc).timestamp() * 1e6)


def generate(path: Path, n_samples: int, n_windows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    per_level = n_windows // LEVELS.size
    lv = np.repeat(LEVELS, per_level)
    tok = 87.0 * (np.minimum(lv, 275) / 275) ** 0.33 * np.exp(rng.normal(0, 0.01, lv.size))
    power = np.minimum(lv, 275) * np.exp(rng.normal(0, 0.01, lv.size))
    dur = 255 / tok
    start = np.concatenate([[0.0], np.cumsum(dur + 0.25)[:-1]])
    first_us = T0_US + (start * 1e6).astype(np.int64)
    last_us = first_us + (dur * 1e6).astype(np.int64)
    n = lv.size
    w = pa.table({
        "run_id": pa.array(["bench"] * n), "level_kind": pa.array(["power_limit"] * n), "level_value": lv,
        "repeat": pa.array(np.zeros(n, np.int32)), "window_kind": pa.array(["request"] * n),
        "request_id": np.arange(n), "concurrency": pa.array(np.ones(n, np.int32)), "warmup": np.zeros(n, bool),
        "status": pa.array(["ok"] * n), "model": pa.array(["bench.gguf"] * n),
        "t_first_utc": pa.array(first_us, pa.timestamp("us", tz="UTC")),
        "t_last_utc": pa.array(last_us, pa.timestamp("us", tz="UTC")), "decode_s": dur,
        "decode_tokens": pa.array(np.full(n, 255, np.int32)), "decode_tok_s": tok, "gpu_energy_j": power * dur,
        "avg_gpu_power_w": power, "gpu_j_per_token": power * dur / 255, "energy_method": pa.array(["counter"] * n),
    })
    w = pa.Table.from_arrays([w.column(f.name) if f.name in w.column_names else pa.nulls(n, f.type) for f in WINDOWS],
                             schema=WINDOWS)
    writer = RunWriter(path, {"run_id": "bench", "gpu_name": "Bench GPU", "model": "bench.gguf", "min_limit_w": 150,
                              "max_limit_w": 320, "default_limit_w": 300, "simulated": True})
    writer.write("windows", w)
    total_s = float(start[-1] + dur[-1])
    ticks = n_samples // DEVICES
    sp = pq.ParquetWriter(path / "samples.parquet", SAMPLES, compression="zstd")
    chunk = 1 << 18
    for a in range(0, ticks, chunk):
        k = np.arange(a, min(a + chunk, ticks))
        t = np.repeat(k * total_s / ticks, DEVICES)
        level = LEVELS[np.minimum(np.searchsorted(start, t, side="right") - 1, n - 1) // per_level]
        m = t.size
        cols = {
            "time_utc": pa.array(T0_US + (t * 1e6).astype(np.int64), pa.timestamp("us", tz="UTC")),
            "t_mono_s": t, "seq": np.repeat(k, DEVICES), "source": pa.array(["nvml"] * m),
            "device": pa.array(np.tile([f"gpu{i}" for i in range(DEVICES)], k.size)),
            "power_w": np.minimum(level, 275) * (1 + rng.normal(0, 0.01, m)), "sm_clock_mhz": 2000 + level,
            "mem_clock_mhz": np.full(m, 10251.0), "clock_event_reasons": np.where(level < 275, 4, 0),
            "enforced_limit_w": level, "level_kind": pa.array(["power_limit"] * m), "level_value": level,
        }
        sp.write_table(pa.Table.from_arrays(
            [cols[f.name] if f.name in cols else pa.nulls(m, f.type) for f in SAMPLES], schema=SAMPLES))
    sp.close()


def generate_daemon(base: Path, n_requests: int, days: int = 8, seed: int = 0) -> None:
    """A daemon dataset's requests: `clean/` one compacted file a day; `synced/` the same plus the day's rows as
    the 8 flush files compaction merged (a sync without --delete kept them): every row twice."""
    rng = np.random.default_rng(seed)
    schema = DAEMON_REQUESTS
    per_day = n_requests // days
    for d in range(days):
        i = np.arange(d * per_day, (d + 1) * per_day)
        t_us = T0_US + d * 86_400_000_000 + (i - d * per_day) * (86_400_000_000 // per_day)  # spread over the day
        toks = rng.integers(16, 512, i.size)
        energy = toks * 0.3 * np.exp(rng.normal(0, 0.1, i.size))
        m = i.size
        cols = {
            "daemon_id": pa.array(["d0"] * m), "request_id": i, "host": pa.array(["node-0"] * m),
            "t_arrival_utc": pa.array(t_us, pa.timestamp("us", tz="UTC")),
            "t_first_utc": pa.array(t_us + 80_000, pa.timestamp("us", tz="UTC")),
            "t_last_utc": pa.array(t_us + 80_000 + toks * 12_000, pa.timestamp("us", tz="UTC")),
            "t_end_utc": pa.array(t_us + 81_000 + toks * 12_000, pa.timestamp("us", tz="UTC")),
            "ttft_s": np.full(m, 0.08), "decode_s": toks * 0.012, "method": pa.array(["POST"] * m),
            "endpoint": pa.array(["/v1/completions"] * m), "model": pa.array(["bench"] * m),
            "outcome": pa.array(["ok"] * m), "status": pa.array(np.full(m, 200, np.int32)),
            "prompt_tokens": pa.array(rng.integers(10, 2000, m).astype(np.int32)),
            "generated_tokens": pa.array(toks.astype(np.int32)), "decode_tokens": pa.array((toks - 1).astype(np.int32)),
            "gpu_energy_j": energy, "attributed_tokens": toks.astype(float), "gpu_j_per_token": energy / toks,
        }
        t = pa.Table.from_arrays([cols[f.name] if f.name in cols else pa.nulls(m, f.type) for f in schema], schema=schema)
        day = datetime.fromtimestamp(T0_US / 1e6 + d * 86_400, timezone.utc).date()
        for kind in ("clean", "synced"):
            folder = base / kind / "requests" / f"date={day}"
            folder.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, folder / "compact-20260116T000000000000-1.parquet", compression="zstd")
        for k, part in enumerate(np.array_split(np.arange(m), 8)):
            pq.write_table(t.take(part), base / "synced" / "requests" / f"date={day}" / f"part-{k:06d}.parquet",
                           compression="gzip")


def child(step: str, run: str, out: str) -> None:
    import tracemalloc

    prepared = None
    if step == "sample-scan":
        # Windows read beforehand: the stage compared with the DuckDB query is the scan of the samples.
        from powerprof.analysis.loading import read_run_info, read_windows, sample_level_figures

        runs = [read_run_info(run)]
        prepared = (runs, read_windows(runs))
    if TRACEMALLOC:
        tracemalloc.start()  # slows Python-level allocation several fold: wall times are then not comparable
    t = time.perf_counter()
    if step == "analyze":
        from powerprof.analysis.report import analyze_run

        analyze_run([run], out, n_boot=2000)
    elif step == "export-csv":
        from powerprof.analysis.export import export

        export(Path(run) / "samples.parquet", "csv", Path(out) / "samples.csv", tz="UTC")
    elif step.startswith("export-daemon-"):
        from powerprof.analysis.export import export

        notes: list[str] = []
        (path,) = export(Path(run).parent / "daemon" / step.removeprefix("export-daemon-"), "parquet",
                         Path(out) / "requests.parquet", tz="UTC", notes=notes)
        rows_written = pq.ParquetFile(path).metadata.num_rows
    elif step == "load-whole":
        pq.read_table(Path(run) / "samples.parquet")
    elif step == "duckdb-query":
        import duckdb

        duckdb.connect().execute(f"""
            SELECT level_kind, level_value, avg(power_w), median(power_w), avg(sm_clock_mhz), median(sm_clock_mhz),
                   max(energy_j) - min(energy_j), bit_or(clock_event_reasons), count(*)
            FROM read_parquet('{Path(run) / "samples.parquet"}') WHERE source = 'nvml'
            GROUP BY 1, 2""").fetchall()
    elif step == "sample-scan":
        sample_level_figures(*prepared)
    wall = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory() if TRACEMALLOC else (0, float("nan"))
    print(json.dumps({"step": step, "wall_s": wall, "rows_written": locals().get("rows_written"), "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1024, "tracemalloc_peak_mib": peak / 2**20,
                      "arrow_peak_mib": pa.default_memory_pool().max_memory() / 2**20}))


TRACEMALLOC = "--tracemalloc" in sys.argv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=10_000_000)
    ap.add_argument("--windows", type=int, default=100_000)
    ap.add_argument("--dir", default="/tmp/powerprof-bench-analysis")
    ap.add_argument("--steps", default="load-whole,duckdb-query,sample-scan,analyze,export-csv")
    ap.add_argument("--requests", type=int, default=0, help="also a daemon dataset of this many requests (see above)")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the generated run directory")
    ap.add_argument("--tracemalloc", action="store_true", help="also report the numpy/Python peak (slows the steps)")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    base = Path(a.dir)
    run = base / "run"
    if a.requests and not (a.keep and (base / "daemon" / "synced").exists()):
        shutil.rmtree(base / "daemon", ignore_errors=True)
        t = time.perf_counter()
        generate_daemon(base / "daemon", a.requests)
        print(f"generated {a.requests:,} requests (clean) and {2 * a.requests:,} rows (synced) in "
              f"{time.perf_counter() - t:.1f} s")
    if not (a.keep and (run / "samples.parquet").exists()) and any(not x.startswith("export-daemon")
                                                                    for x in a.steps.split(",")):
        shutil.rmtree(run, ignore_errors=True)
        base.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        generate(run, a.samples, a.windows)
        print(f"generated {a.samples:,} sample rows, {a.windows:,} windows in {time.perf_counter() - t:.1f} s; "
              f"samples.parquet {(run / 'samples.parquet').stat().st_size / 2**20:.0f} MiB")
    results = {}
    for step in a.steps.split(","):
        out = base / step
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        p = subprocess.run([sys.executable, __file__, "--child", step, str(run), str(out)]
                           + (["--tracemalloc"] if a.tracemalloc else []), capture_output=True,
                           text=True, timeout=3600)
        if p.returncode != 0:
            print(f"{step:12s} FAILED (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
            continue
        results[step] = json.loads(p.stdout.strip().splitlines()[-1])
        r = results[step]
        print(f"{step:12s} wall {r['wall_s']:7.1f} s  peak RSS {r['maxrss_mib']:7.0f} MiB  "
              f"tracemalloc peak {r['tracemalloc_peak_mib']:6.0f} MiB  arrow peak {r['arrow_peak_mib']:6.0f} MiB"
              + (f"  rows written {r['rows_written']:,}" if r.get("rows_written") is not None else ""))
    if {"load-whole", "analyze"} <= set(results):
        ratio = results["load-whole"]["maxrss_mib"] / results["analyze"]["maxrss_mib"]
        print(f"peak RSS, loading samples whole vs the whole analysis: {ratio:.1f}x")
    if {"duckdb-query", "sample-scan"} <= set(results):
        ratio = results["sample-scan"]["wall_s"] / results["duckdb-query"]["wall_s"]
        print(f"sample-scan vs the plain DuckDB query over the same file: {ratio:.2f}x the wall time")
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
