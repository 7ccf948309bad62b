"""A randomized daemon fleet for export: copies across folders and within files, keyless rows, NaN, -0.0, 1 ns apart;
its expected rows from pandas drop_duplicates on the key (review4)."""
import math, random, shutil, sys, tempfile
from pathlib import Path
import numpy as np, pandas as pd, pyarrow as pa, pyarrow.parquet as pq
from powerprof.analysis.export import export, ExportError

T0 = 1_768_478_400 * 10**9
SCHEMA = pa.schema([("host", pa.string()), ("daemon_id", pa.string()), ("request_id", pa.int64()),
                    ("t_arrival_utc", pa.timestamp("ns", tz="UTC")), ("gpu_energy_j", pa.float64()),
                    ("generated_tokens", pa.int64())])

def write(path, rows, schema=SCHEMA):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=random.choice([3, 7, 1000]))

def one(seed, tmp):
    rnd = random.Random(seed); random.seed(seed)
    hosts = ["node-ä", "节点-1", "node-2"]
    base = []
    for h in hosts:
        for i in range(rnd.randint(0, 30)):
            did = rnd.choice([f"d-{h}", None]) if rnd.random() < 0.1 else f"d-{h}"
            rid = None if rnd.random() < 0.1 else i
            e = rnd.choice([1.0, 2.5, float("nan"), -0.0, 0.0, None, 1e300])
            base.append({"host": h, "daemon_id": did, "request_id": rid, "t_arrival_utc": T0 + i * 10**9 + rnd.choice([0, 1, 999]),
                         "gpu_energy_j": e, "generated_tokens": rnd.randint(0, 5)})
    # files: each host's rows split into flush files; then copies: whole folder, part file, a row inside the same file
    files = {}
    for h in hosts:
        rows = [r for r in base if r["host"] == h]
        rnd.shuffle(rows)
        k = 0
        while rows:
            n = rnd.randint(1, 10)
            files[f"{h}/requests/date=2026-01-15/part-{k}.parquet"] = rows[:n]; rows = rows[n:]; k += 1
    extra = {}
    for name, rows in list(files.items()):
        if rnd.random() < 0.3:  # a copy in another folder
            extra["backup-" + name] = [dict(r) for r in rows]
        if rnd.random() < 0.2 and rows:  # a row twice in the same file
            r = rnd.choice(rows)
            rows.append(dict(r))
        if rnd.random() < 0.15 and rows:  # a copy equal except -0.0/0.0 or NaN
            r = dict(rnd.choice(rows))
            if isinstance(r["gpu_energy_j"], float) and r["gpu_energy_j"] == 0.0:
                r["gpu_energy_j"] = -r["gpu_energy_j"]
            extra[name.replace("part-", "compact-")] = extra.get(name.replace("part-", "compact-"), []) + [r]
    files.update(extra)
    conflict_expected = False
    if rnd.random() < 0.15:  # a conflicting copy: sub-microsecond time difference
        name = rnd.choice(list(files)); rows = files[name]
        if rows:
            r = dict(rnd.choice(rows)); r["t_arrival_utc"] += 1
            files[name.replace("part-", "late-")] = [r]
            keyed = r["daemon_id"] is not None and r["request_id"] is not None
            conflict_expected = keyed
    root = tmp / f"s{seed}"
    for name, rows in files.items():
        write(root / name, rows)
    srcs = sorted({str(root / n.split("/requests/")[0]) for n in files})
    allrows = pd.DataFrame([r for rows in files.values() for r in rows], columns=SCHEMA.names)
    if not len(allrows):
        return "empty"
    keyless = allrows.daemon_id.isna() | allrows.request_id.isna()
    keyed = allrows[~keyless]
    # reference: conflict if a key has rows that differ (NaN == NaN, -0.0 == 0.0)
    g = keyed.fillna({"gpu_energy_j": -12345.678}).astype({"t_arrival_utc": "int64"}, errors="ignore")
    nun = g.groupby(["daemon_id", "request_id"], dropna=False).nunique(dropna=False)
    ref_conflict = bool((nun > 1).any().any())
    ref = pd.concat([keyed.drop_duplicates(["daemon_id", "request_id"]), allrows[keyless]])
    out = tmp / f"o{seed}"
    try:
        export(srcs, "parquet", out, tz="UTC", notes=[])
    except ExportError as e:
        if ref_conflict:
            return "refused-ok"
        return f"FAIL: refused but no conflict: {e}"
    if ref_conflict:
        return "FAIL: conflict not refused"
    got = pq.read_table(out / "requests.parquet").to_pandas()[SCHEMA.names]
    def canon(df):
        df = df.copy(); df["gpu_energy_j"] = df.gpu_energy_j.map(lambda v: "nan" if v is not None and v != v else ("none" if v is None or pd.isna(v) else repr(abs(v) if v == 0 else v)))
        df["t_arrival_utc"] = df.t_arrival_utc.map(lambda t: t if isinstance(t, int) else t.value)
        df["request_id"] = df.request_id.map(lambda v: None if pd.isna(v) else int(v))
        df["daemon_id"] = df.daemon_id.map(lambda v: None if pd.isna(v) else v)
        return sorted(tuple(str(x) for x in row) for row in df.values.tolist())
    a, b = canon(got), canon(ref)
    if a != b:
        return f"FAIL: rows differ got {len(a)} ref {len(b)}"
    return "ok"

