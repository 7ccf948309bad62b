"""Many nodes' daemon datasets as one: per-host energy, tokens and J/token, as DuckDB queries.

Sources are daemon data folders (each with `requests/`, `intervals/`, ... hive-partitioned by
date), globs of them, or object-store URIs (s3://, gs://, az://, https:// through DuckDB's httpfs
extension). Every daemon row carries its `host`, so the folders need no particular layout. The
SQL here is the one docs/fleet.md shows; the same query runs on Spark or Trino over the same files.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pyarrow as pa

from .engine import connect, to_arrow

URI_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfss://", "http://", "https://", "hf://")


class FleetError(ValueError):
    """Bad fleet input: the message says what and how to fix it."""


def is_uri(s: str) -> bool:
    return str(s).startswith(URI_SCHEMES)


def expand_sources(sources) -> list[str]:
    """Local globs expanded (sorted), URIs kept as given (DuckDB globs them remotely)."""
    out: list[str] = []
    for s in sources:
        s = str(s)
        if is_uri(s):
            out.append(s.rstrip("/"))
        elif glob.has_magic(s):
            hits = sorted(glob.glob(s))
            if not hits:
                raise FleetError(f"{s}: the pattern matches nothing")
            out.extend(hits)
        else:
            out.append(s)
    # A source named twice (a glob and a path, a trailing slash) would count its rows twice.
    unique: dict[str, str] = {}
    for s in out:
        unique.setdefault(s if is_uri(s) else str(Path(s).resolve()), s)
    return list(unique.values())


def is_daemon_dataset(path: str) -> bool:
    """A daemon data folder: it has a requests/ or intervals/ dataset (URIs are taken as such)."""
    if is_uri(path):
        return True
    p = Path(path)
    return p.is_dir() and any((p / d).is_dir() for d in ("requests", "intervals"))


def table_files(sources: list[str], table: str) -> list[str]:
    """The Parquet globs of one daemon table under each source; local sources must have it."""
    out = []
    for s in sources:
        if is_uri(s):
            out.append(f"{s}/{table}/**/*.parquet")
        elif any((Path(s) / table).rglob("*.parquet")):
            out.append(str(Path(s) / table / "**" / "*.parquet"))
    return out


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def read_sql(files: list[str]) -> str:
    """DuckDB table expression over several datasets' files of one table: hive `date` partitions,
    columns matched by name (files written before the `host` column read it as NULL)."""
    return (f"read_parquet([{', '.join(_quote(f) for f in files)}], hive_partitioning = true, "
            "union_by_name = true)")


# One row per host: what its proxy served, what its GPUs spent, and what the two give per token.
# The same statement, with read_parquet replaced by a table over the same hive layout, is the
# Spark SQL / Trino query of docs/fleet.md.
FLEET_SQL = """
WITH r AS (
    SELECT coalesce(host, '(unknown)') AS host,
           count(*) AS requests,
           count(*) FILTER (WHERE outcome <> 'ok') AS failed_requests,
           CAST(sum(generated_tokens) AS BIGINT) AS generated_tokens,
           sum(gpu_energy_j) AS attributed_gpu_energy_j,
           sum(attributed_tokens) AS attributed_tokens,
           approx_quantile(ttft_s, 0.5) AS ttft_p50_s
    FROM {requests} GROUP BY 1
), i AS (
    SELECT coalesce(host, '(unknown)') AS host,
           sum(gpu_energy_j) AS gpu_energy_j,
           sum(gpu_energy_j) FILTER (WHERE kind = 'idle') AS idle_gpu_energy_j,
           sum(duration_s) / 3600 AS hours,
           min(t_start_utc) AS t_first_utc,
           max(t_end_utc) AS t_last_utc
    FROM {intervals} GROUP BY 1
)
SELECT host, requests, failed_requests, generated_tokens, gpu_energy_j, idle_gpu_energy_j,
       attributed_gpu_energy_j, attributed_tokens,
       attributed_gpu_energy_j / nullif(attributed_tokens, 0) AS gpu_j_per_token,
       ttft_p50_s, hours, t_first_utc, t_last_utc
FROM i FULL OUTER JOIN r USING (host)
ORDER BY host
"""

_EMPTY = {"requests": "(SELECT NULL::VARCHAR AS host, NULL::VARCHAR AS outcome, NULL::INT AS generated_tokens, "
                      "NULL::DOUBLE AS gpu_energy_j, NULL::DOUBLE AS attributed_tokens, NULL::DOUBLE AS ttft_s "
                      "WHERE false)",
          "intervals": "(SELECT NULL::VARCHAR AS host, NULL::DOUBLE AS gpu_energy_j, NULL::VARCHAR AS kind, "
                       "NULL::DOUBLE AS duration_s, NULL::TIMESTAMPTZ AS t_start_utc, "
                       "NULL::TIMESTAMPTZ AS t_end_utc WHERE false)"}


def fleet_summary(sources) -> pa.Table:
    """Per-host summary over several daemon datasets (folders, globs, URIs): one query, out of core."""
    srcs = expand_sources(sources)
    if not srcs:
        raise FleetError("give at least one daemon dataset folder, glob or URI")
    bad = [s for s in srcs if not is_daemon_dataset(s)]
    if bad:
        raise FleetError(f"{', '.join(bad)}: not a daemon dataset (no requests/ or intervals/ folder)")
    parts = {}
    for table in ("requests", "intervals"):
        files = table_files(srcs, table)
        parts[table] = read_sql(files) if files else _EMPTY[table]
    with connect() as con:
        try:
            return to_arrow(con, FLEET_SQL.format(**parts))
        except Exception as e:  # duckdb.Error and IO errors: say which sources, keep the reason
            from powerprof import termination  # noqa: PLC0415

            if (stop := termination.exit_inside(e)) is not None:
                raise stop from None
            raise FleetError(f"cannot read the datasets {', '.join(srcs)}: {e}") from None


def render_summary(t: pa.Table) -> str:
    """A plain-text table of the per-host summary, then the fleet's totals."""
    rows = t.to_pylist()
    lines = [f"{'host':20s} {'requests':>9s} {'tokens':>11s} {'GPU kWh':>9s} {'idle %':>7s} {'J/token':>8s}"]
    tot_e = tot_idle = tot_att = tot_att_tok = 0.0
    tot_tok = tot_req = 0
    for r in rows:
        e, idle = r["gpu_energy_j"] or 0.0, r["idle_gpu_energy_j"] or 0.0
        jpt = r["gpu_j_per_token"]
        lines.append(f"{r['host'][:20]:20s} {r['requests'] or 0:9d} {r['generated_tokens'] or 0:11d} {e / 3.6e6:9.3f} "
                     f"{100 * idle / e if e else float('nan'):7.1f} {'-' if jpt is None else f'{jpt:.3f}':>8s}")
        tot_e, tot_idle = tot_e + e, tot_idle + idle
        tot_tok, tot_req = tot_tok + (r["generated_tokens"] or 0), tot_req + (r["requests"] or 0)
        tot_att += r["attributed_gpu_energy_j"] or 0.0
        tot_att_tok += r["attributed_tokens"] or 0.0
    jpt = f"{tot_att / tot_att_tok:.3f}" if tot_att_tok else "-"
    lines.append(f"{'all ' + str(len(rows)) + ' hosts':20s} {tot_req:9d} {tot_tok:11d} {tot_e / 3.6e6:9.3f} "
                 f"{100 * tot_idle / tot_e if tot_e else float('nan'):7.1f} {jpt:>8s}")
    return "\n".join(lines)
