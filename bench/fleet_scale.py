"""Bench: `powerprof analyze` (fleet_summary) and `powerprof export` over N nodes' daemon datasets, beside a plain DuckDB GROUP BY.

Writes N simulated nodes' daemon data folders with the daemon's own store (powerprof.daemon.store.DatasetStore
with powerprof.daemon.service.datasets(): its folders, flush files and host column), 8 days each: each node's first
rows go through the store's flush (`part-*.parquet`, the daemon's standard-library writer), the bulk through the
store's own file writer as its hourly compaction leaves them (`compact-*.parquet`, pyarrow ZSTD, sorted by time),
which is what a node's folder holds after a day (the store's row-at-a-time flush writes ~20 k rows/s: too slow
for millions). `--synced` adds a second fleet whose every row is also in a flush file beside its compacted file
(`aws s3 sync` without --delete): every row twice, the summary's dedupe at work.

Each step runs in a fresh process (peak RSS is its own: VmHWM) and prints wall time, CPU time (the process's
user + system: on a shared machine steadier than wall) and peak RSS, side by side:
`duckdb-groupby` is the engine baseline, one plain DuckDB GROUP BY host over the same files (the requests' and
the intervals' sums, no dedupe, no checks) on the same engine settings as the summary (powerprof's connect():
256 MB memory limit, 4 threads); `fleet-summary` is `powerprof analyze`'s fleet query (analysis/fleet.py
fleet_summary: copies counted once, conflicts refused, NaN rows left out); `export` is `powerprof export` of
every table to Parquet (analysis/export.py: copies found, written once). The summary's per-host requests,
tokens and energy are checked against the generator's truth: a wrong figure fails the bench.

    .venv/bin/python bench/fleet_scale.py [--nodes 8] [--scales 100k:125k,1M:1.25M] [--synced]
        [--steps duckdb-groupby,fleet-summary,export] [--dir /tmp/powerprof-bench-fleet] [--keep] [--before DIR]

--before DIR runs each powerprof step a second time, right before this code's, with the `powerprof` package of DIR
(a checkout of the code before a change: `git worktree add /tmp/before main`), on the same files, printed as
`step@before` beside it with the ratios after/before: a before-and-after in one run, on one machine's load.

A scale is REQUESTS:INTERVALS per node (k and M suffixes).
"""

from __future__ import annotations

import argparse
import json
import os
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

from powerprof.daemon.service import datasets
from powerprof.daemon.store import COMPACT_PREFIX, PART_PREFIX, DatasetStore, write_file_atomic
from powerprof.storage.schema import arrow_schema

DAYS = 8
T0_US = int(datetime(2026, 1, 15, tzinfo=timezone.utc).timestamp() * 1e6)
DAY_US = 86_400_000_000
THROUGH_STORE = 200  # each node's first rows of each table go through the store's own flush


def parse_count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _table(name: str, cols: dict, n: int) -> pa.Table:
    schema = arrow_schema(next(d for d in datasets() if d.name == name).columns)
    return pa.Table.from_arrays([pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(n, f.type)
                                 for f in schema], schema=schema)


def node_tables(k: int, n_req: int, n_int: int, seed: int) -> tuple[pa.Table, pa.Table]:
    """One node's requests and intervals over DAYS days, time-sorted (the daemon's own ids and clocks)."""
    rng = np.random.default_rng(seed + k)
    host, daemon = f"node-{k}", f"d{k}"
    # Requests: numbered by the daemon, spread over the days.
    t_us = T0_US + np.sort(rng.integers(0, DAYS * DAY_US, n_req))
    toks = rng.integers(16, 512, n_req)
    energy = toks * (0.3 + 0.01 * k) * np.exp(rng.normal(0, 0.1, n_req))
    ok = rng.random(n_req) >= 0.01
    req = _table("requests", {
        "daemon_id": [daemon] * n_req, "request_id": np.arange(n_req), "host": [host] * n_req,
        "t_arrival_utc": t_us, "t_first_utc": t_us + 80_000, "t_last_utc": t_us + 80_000 + toks * 12_000,
        "t_end_utc": t_us + 81_000 + toks * 12_000, "ttft_s": np.full(n_req, 0.08), "decode_s": toks * 0.012,
        "method": ["POST"] * n_req, "endpoint": ["/v1/completions"] * n_req, "api": ["openai"] * n_req,
        "model": ["bench"] * n_req, "stream": np.ones(n_req, bool), "status": np.where(ok, 200, 499).astype(np.int32),
        "outcome": np.where(ok, "ok", "client_disconnected"), "prompt_tokens": rng.integers(10, 2000, n_req).astype(np.int32),
        "generated_tokens": toks.astype(np.int32), "decode_tokens": (toks - 1).astype(np.int32),
        "token_source": ["usage"] * n_req, "tokens_estimated": np.zeros(n_req, bool),
        "gpu_energy_j": energy, "attributed_tokens": toks.astype(float), "gpu_j_per_token": energy / toks,
    }, n_req)
    # Intervals: back to back over the days, one kind each, the daemon's monotonic start beside its wall clock.
    dur_s = DAYS * 86_400 / n_int
    start_s = np.arange(n_int) * dur_s
    power = 300.0 + 10 * k + rng.normal(0, 5, n_int)
    kind = np.where(rng.random(n_int) < 0.25, "idle", "decode")
    ival = _table("intervals", {
        "daemon_id": [daemon] * n_int, "host": [host] * n_int, "t_start_utc": T0_US + (start_s * 1e6).astype(np.int64),
        "t_end_utc": T0_US + ((start_s + dur_s) * 1e6).astype(np.int64), "t_start_mono_s": 1000.0 + start_s,
        "duration_s": np.full(n_int, dur_s), "kind": kind, "gpu_energy_j": power * dur_s, "energy_method": ["counter"] * n_int,
        "avg_gpu_power_w": power,
    }, n_int)
    return req, ival


def truth_of(req: pa.Table, ival: pa.Table) -> dict:
    import pyarrow.compute as pc

    ok = pc.equal(req.column("outcome"), "ok")
    return {"requests": req.num_rows, "intervals": ival.num_rows, "failed_requests": req.num_rows - pc.sum(ok).as_py(),
            "generated_tokens": pc.sum(req.column("generated_tokens")).as_py(),
            "gpu_energy_j": pc.sum(ival.column("gpu_energy_j")).as_py()}


def write_node(root: Path, k: int, req: pa.Table, ival: pa.Table, synced: bool) -> None:
    """One node's data folder: the store's folders and first flush, then a compacted file per day."""
    store = DatasetStore(root, datasets(), host=f"node-{k}", daemon_id=f"d{k}")
    for name, t in (("requests", req), ("intervals", ival)):
        store.append(name, t.slice(0, THROUGH_STORE).to_pylist())
    assert store.flush(), store.last_error
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    for name, t, col in (("requests", req, "t_arrival_utc"), ("intervals", ival, "t_start_utc")):
        rest = t.slice(THROUGH_STORE)
        day = (rest.column(col).cast(pa.int64()).to_numpy() - T0_US) // DAY_US
        for d in range(DAYS):
            part = rest.filter(pa.array(day == d))
            if not part.num_rows:
                continue
            folder = root / name / f"date={datetime.fromtimestamp((T0_US + d * DAY_US) / 1e6, timezone.utc).date()}"
            folder.mkdir(parents=True, exist_ok=True)
            write_file_atomic(folder / f"{COMPACT_PREFIX}{stamp}-{os.getpid()}.parquet", part)
            if synced:  # the flush files compaction merged, kept by a sync without --delete: the same rows again
                for i, chunk in enumerate(np.array_split(np.arange(part.num_rows), 4)):
                    write_file_atomic(folder / f"{PART_PREFIX}{stamp}-{os.getpid()}-{900000 + i}.parquet",
                                      part.take(pa.array(chunk)))


def generate(base: Path, nodes: int, n_req: int, n_int: int, synced: bool, seed: int = 0) -> dict:
    truth = {}
    for k in range(nodes):
        req, ival = node_tables(k, n_req, n_int, seed)
        truth[f"node-{k}"] = truth_of(req, ival)
        write_node(base / "clean" / f"node-{k}", k, req, ival, False)
        if synced:
            write_node(base / "synced" / f"node-{k}", k, req, ival, True)
    (base / "truth.json").write_text(json.dumps(truth))
    return truth


def _baseline(fleet: Path) -> list[tuple]:
    """The engine baseline: per host, the plain sums over every row of the files (copies summed twice)."""
    from powerprof.analysis.engine import connect

    def src(table: str) -> str:
        return f"read_parquet('{fleet}/*/{table}/**/*.parquet', hive_partitioning = false, union_by_name = true)"

    with connect() as con:
        return con.execute(f"""
            WITH r AS (SELECT host, count(*) AS requests, count(*) FILTER (WHERE outcome <> 'ok') AS failed_requests,
                              sum(generated_tokens) AS generated_tokens, sum(gpu_energy_j) AS attributed_gpu_energy_j,
                              sum(attributed_tokens) AS attributed_tokens, approx_quantile(ttft_s, 0.5) AS ttft_p50_s
                       FROM {src('requests')} GROUP BY host),
                 i AS (SELECT host, sum(gpu_energy_j) AS gpu_energy_j,
                              sum(gpu_energy_j) FILTER (WHERE kind = 'idle') AS idle_gpu_energy_j,
                              sum(duration_s) / 3600 AS hours, min(t_start_utc), max(t_end_utc)
                       FROM {src('intervals')} GROUP BY host)
            SELECT * FROM i FULL OUTER JOIN r USING (host) ORDER BY host""").fetchall()


def peak_rss_mib() -> float:
    """This process's peak RSS since its exec (VmHWM). Not ru_maxrss: Linux carries the parent's peak over a
    fork and exec into the child's, so every step read as the generator's 1190 MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: no fork carry-over to undo


def child(step: str, fleet: str, out: str) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu0 = ru.ru_utime + ru.ru_stime
    t = time.perf_counter()
    result: dict = {}
    if step == "duckdb-groupby":
        rows = _baseline(Path(fleet))
        result["hosts"] = {r[0]: {"requests": r[6], "gpu_energy_j": r[1]} for r in rows}
    elif step == "fleet-summary":
        from powerprof.analysis.fleet import fleet_summary

        rows = fleet_summary([f"{fleet}/node-*"]).to_pylist()
        result["hosts"] = {r["host"]: {c: r[c] for c in ("requests", "failed_requests", "generated_tokens",
                                                         "gpu_energy_j", "duplicate_requests", "duplicate_intervals")}
                           for r in rows}
    elif step == "export":
        from powerprof.analysis.export import export

        notes: list[str] = []
        paths = export(sorted(str(p) for p in Path(fleet).glob("node-*")), "parquet", Path(out), tz="UTC", notes=notes)
        result["rows_written"] = {p.stem: pq.ParquetFile(p).metadata.num_rows for p in paths}
    else:
        raise SystemExit(f"unknown step {step}")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    result.update(step=step, wall_s=time.perf_counter() - t, cpu_s=ru.ru_utime + ru.ru_stime - cpu0, maxrss_mib=peak_rss_mib())
    print(json.dumps(result))


def check(step: str, r: dict, truth: dict, synced: bool) -> list[str]:
    """What in a step's result disagrees with the generator's truth (the baseline sums copies: not checked then)."""
    bad = []
    if step == "fleet-summary" or (step == "duckdb-groupby" and not synced):
        if sorted(r["hosts"]) != sorted(truth):
            return [f"hosts {sorted(r['hosts'])} != {sorted(truth)}"]
        for h, t in truth.items():
            got = r["hosts"][h]
            for c, v in t.items():
                if c in got and not np.isclose(got[c], v, rtol=1e-9):
                    bad.append(f"{h} {c}: {got[c]} != {v}")
    if step == "export":
        want = {t: sum(v[t] for v in truth.values()) for t in ("requests", "intervals")}
        for table, n in want.items():
            if r["rows_written"].get(table) != n:
                bad.append(f"export {table}: {r['rows_written'].get(table)} rows written, {n} in the fleet")
    return bad


def run_step(step: str, fleet: Path, out: Path, timeout_s: float, code: str | None = None) -> dict | str:
    """One step in a fresh process; `code`: the folder whose `powerprof` package it imports (default: this one's)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ)
    if code:
        env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [env.get("PYTHONPATH")])])
    try:
        p = subprocess.run([sys.executable, __file__, "--child", step, str(fleet), str(out)], capture_output=True,
                           text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout_s:.0f} s"
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        return f"FAILED (exit {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--scales", default="100k:125k,1M:1.25M", help="REQUESTS:INTERVALS per node, comma-separated")
    ap.add_argument("--synced", action="store_true", help="also every row twice (flush files kept beside compaction)")
    ap.add_argument("--steps", default="duckdb-groupby,fleet-summary,export")
    ap.add_argument("--dir", default="/tmp/powerprof-bench-fleet")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per step")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the generated datasets")
    ap.add_argument("--before", help="a folder with the powerprof package before a change: each powerprof step "
                    "is also run with it, beside this code's")
    ap.add_argument("--child", nargs=3)
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    failures = 0
    for scale in a.scales.split(","):
        n_req, n_int = (parse_count(x) for x in scale.split(":"))
        base = Path(a.dir) / f"{a.nodes}x{n_req}x{n_int}"
        if a.keep and (base / "truth.json").exists() and (not a.synced or (base / "synced").exists()):
            truth = json.loads((base / "truth.json").read_text())
        else:
            shutil.rmtree(base, ignore_errors=True)
            t = time.perf_counter()
            truth = generate(base, a.nodes, n_req, n_int, a.synced)
            size = sum(f.stat().st_size for f in (base / "clean").rglob("*.parquet")) / 2**20
            print(f"generated {a.nodes} nodes x ({n_req:,} requests + {n_int:,} intervals) = "
                  f"{a.nodes * (n_req + n_int):,} rows, {size:.0f} MiB, in {time.perf_counter() - t:.1f} s"
                  + (" (and the synced copy)" if a.synced else ""))
        for kind in ("clean", "synced") if a.synced else ("clean",):
            results = {}
            runs = [(step, code) for step in a.steps.split(",")
                    for code in ([a.before] if a.before and step != "duckdb-groupby" else []) + [None]]
            for step, code in runs:
                r = run_step(step, base / kind, base / f"out-{step}", a.timeout, code)
                step = step + ("@before" if code else "")
                label = f"{kind:6s} {step:22s}"
                if isinstance(r, str):
                    print(f"{label} {r}")
                    failures += 1
                    continue
                results[step] = r
                bad = check(step.split("@")[0], r, truth, kind == "synced")
                print(f"{label} wall {r['wall_s']:7.2f} s  CPU {r['cpu_s']:7.2f} s  peak RSS {r['maxrss_mib']:6.0f} MiB"
                      + (f"  rows written {r['rows_written']}" if "rows_written" in r else "")
                      + (f"  WRONG: {'; '.join(bad[:3])}" if bad else ""))
                failures += bool(bad)
            base_r = results.get("duckdb-groupby")
            for step in ("fleet-summary", "export"):
                if base_r and step in results:
                    r = results[step]
                    print(f"{kind:6s} {step} vs the plain GROUP BY: {r['wall_s'] / base_r['wall_s']:.2f}x the wall "
                          f"time, {r['cpu_s'] / base_r['cpu_s']:.2f}x the CPU time, "
                          f"{r['maxrss_mib'] / base_r['maxrss_mib']:.2f}x the peak RSS")
                if f"{step}@before" in results and step in results:
                    r, b = results[step], results[f"{step}@before"]
                    print(f"{kind:6s} {step} after / before: {r['wall_s'] / b['wall_s']:.2f}x the wall time, "
                          f"{r['cpu_s'] / b['cpu_s']:.2f}x the CPU time, {r['maxrss_mib'] / b['maxrss_mib']:.2f}x "
                          "the peak RSS")
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
