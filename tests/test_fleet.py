"""Fleet scale: 8 simulated nodes' daemon datasets analysed and exported in one call; every row
carries its host; docs/fleet.md's DuckDB query gives the same per-host figures."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.analysis.export import export
from powerprof.analysis.fleet import FleetError, fleet_summary
from powerprof.cli import main
from powerprof.daemon.service import datasets
from powerprof.daemon.store import DatasetStore

ROOT = Path(__file__).resolve().parents[1]
NODES = 8
T0_NS = 1_768_478_400 * 10**9  # 2026-01-15 12:00 UTC


def _node(root: Path, k: int) -> dict:
    """One node's daemon data folder written by the daemon's own store; returns its true totals."""
    store = DatasetStore(root, datasets(), host=f"node-{k}")
    n_req = 10 + k
    reqs = [{"daemon_id": f"d{k}", "request_id": i, "t_arrival_utc": T0_NS + i * 10**9, "outcome": "ok" if i else "client_disconnected",
             "generated_tokens": 100 + k, "gpu_energy_j": 50.0 + k, "attributed_tokens": 100.0 + k, "ttft_s": 0.1}
            for i in range(n_req)]
    ivals = [{"daemon_id": f"d{k}", "t_start_utc": T0_NS + i * 10**9, "t_end_utc": T0_NS + (i + 1) * 10**9,
              "duration_s": 1.0, "kind": "idle" if i % 4 == 0 else "decode", "gpu_energy_j": 300.0 + k}
             for i in range(40)]
    store.append("requests", reqs)
    store.append("intervals", ivals)
    store.append("samples", [{"time_utc": T0_NS, "t_mono_s": 0.0, "source": "nvml", "device": "gpu0", "power_w": 300.0}])
    assert store.flush()
    return {"requests": n_req, "failed": 1, "tokens": n_req * (100 + k), "gpu_j": 40 * (300.0 + k),
            "idle_j": 10 * (300.0 + k), "jpt": (50.0 + k) / (100.0 + k)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    base = tmp_path_factory.mktemp("fleet")
    truth = {f"node-{k}": _node(base / f"node-{k}", k) for k in range(NODES)}
    return base, truth


def _check(rows: list[dict], truth: dict) -> None:
    assert [r["host"] for r in rows] == sorted(truth)
    for r in rows:
        t = truth[r["host"]]
        assert r["requests"] == t["requests"] and r["failed_requests"] == t["failed"]
        assert r["generated_tokens"] == t["tokens"]
        assert r["gpu_energy_j"] == pytest.approx(t["gpu_j"]) and r["idle_gpu_energy_j"] == pytest.approx(t["idle_j"])
        assert r["gpu_j_per_token"] == pytest.approx(t["jpt"])


def test_every_daemon_row_carries_its_host(fleet):
    base, _ = fleet
    for table in ("samples", "requests", "intervals"):
        t = pq.read_table(next((base / "node-3" / table).rglob("*.parquet")))
        assert set(t.column("host").to_pylist()) == {"node-3"}, table


def test_eight_nodes_in_one_call(fleet):
    base, truth = fleet
    _check(fleet_summary([str(base / "node-*")]).to_pylist(), truth)


def test_analyze_cli_takes_a_glob_of_node_datasets(fleet, tmp_path):
    base, truth = fleet
    res = CliRunner().invoke(main, ["analyze", str(base / "node-*"), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert all(h in res.output for h in truth) and f"all {NODES} hosts" in res.output
    _check(pq.read_table(tmp_path / "fleet.parquet").to_pylist(), truth)


def test_a_node_named_twice_counts_once(fleet, tmp_path):
    # `analyze node-3 node-3/` (or a glob plus a path) doubled that node's requests, tokens and energy.
    base, truth = fleet
    res = CliRunner().invoke(main, ["analyze", str(base / "node-*"), str(base / "node-3") + "/", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    _check(pq.read_table(tmp_path / "fleet.parquet").to_pylist(), truth)


def test_export_unions_the_nodes_tables(fleet, tmp_path):
    base, truth = fleet
    files = export([str(base / f"node-{k}") for k in range(NODES)], "parquet", tmp_path / "out", columns=["host", "request_id"])
    req = pq.read_table(tmp_path / "out" / "requests.parquet")
    assert req.num_rows == sum(t["requests"] for t in truth.values())
    assert set(req.column("host").to_pylist()) == set(truth)
    assert {p.name for p in files} >= {"requests.parquet", "intervals.parquet", "samples.parquet"}


def test_export_reads_a_uri_through_pyarrow_filesystems(fleet, tmp_path):
    base, truth = fleet
    export([(base / "node-2").as_uri()], "csv", tmp_path / "uri")
    text = (tmp_path / "uri" / "requests.csv").read_text()
    assert text.count("node-2") == truth["node-2"]["requests"]


def test_docs_duckdb_query_gives_the_same_figures(fleet):
    """The DuckDB form in docs/fleet.md, run as written over the 8 nodes."""
    base, truth = fleet
    doc = (ROOT / "docs" / "fleet.md").read_text()
    sql = re.search(r"```sql duckdb\n(.*?)```", doc, re.S).group(1)
    sql = sql.replace("/var/lib/powerprof-fleet", str(base))
    con = duckdb.connect()
    rows = con.execute(sql).fetchall()
    cols = [d[0] for d in con.description]
    rows = [dict(zip(cols, r)) for r in rows]
    assert [r["host"] for r in rows] == sorted(truth)
    for r in rows:
        assert r["gpu_j_per_token"] == pytest.approx(truth[r["host"]]["jpt"])
        assert r["gpu_energy_j"] == pytest.approx(truth[r["host"]]["gpu_j"])


def test_not_a_daemon_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(FleetError, match="matches nothing"):
        fleet_summary([str(tmp_path / "nothing-*")])
    (tmp_path / "x").mkdir()
    with pytest.raises(FleetError, match="not a daemon dataset"):
        fleet_summary([str(tmp_path / "x")])


# --- overlapping and older datasets (review s29) --------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_copy_of_a_node_in_another_folder_counts_once(fleet, tmp_path):
    # A backup copy of node-1 beside the fleet glob doubled node-1's requests, tokens and energy, silently.
    base, truth = fleet
    _copy(base / "node-1", tmp_path / "backup-node-1")
    res = CliRunner().invoke(main, ["analyze", str(base / "node-*"), str(tmp_path / "backup-node-1"),
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    _check(pq.read_table(tmp_path / "out" / "fleet.parquet").to_pylist(), truth)
    assert "counted once" in res.output and "node-1" in res.output


def test_files_compaction_merged_beside_the_merged_file_count_once(fleet, tmp_path):
    # `aws s3 sync` without --delete keeps a node's flush files after compaction merged them into one:
    # the copy holds every row twice (and a reader racing a compaction sees both for a moment).
    base, truth = fleet
    node = _copy(base / "node-2", tmp_path / "node-2")
    for table in ("requests", "intervals"):
        for f in list((node / table).rglob("part-*.parquet")):
            f.with_name("compact-20260116T000000000000-1.parquet").write_bytes(f.read_bytes())
    rows = fleet_summary([str(node)]).to_pylist()
    _check(rows, {"node-2": truth["node-2"]})
    assert rows[0]["duplicate_requests"] == truth["node-2"]["requests"] and rows[0]["duplicate_intervals"] == 40


def test_a_host_key_in_a_folder_above_does_not_rename_the_nodes(fleet, tmp_path):
    # DuckDB's hive partitioning read `host=laptop` in the path above the datasets as every row's host:
    # all nodes became one host "laptop" with the fleet's sums.
    base, truth = fleet
    above = tmp_path / "host=laptop"
    for k in range(NODES):
        _copy(base / f"node-{k}", above / f"node-{k}")
    _check(fleet_summary([str(above / "node-*")]).to_pylist(), truth)


def _without_host(src: Path, dst: Path) -> Path:
    """A node's requests and intervals as a daemon wrote them before the `host` column existed."""
    for table in ("requests", "intervals"):
        for f in (src / table).rglob("*.parquet"):
            out = dst / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pq.read_table(f).drop_columns(["host"]), out)
    return dst


def test_nodes_written_before_the_host_column_stay_apart(fleet, tmp_path):
    # Files without the column failed with a DuckDB binder error; with it null, two nodes merged into one
    # "(unknown)" row whose J/token blended both.
    base, truth = fleet
    old = [_without_host(base / f"node-{k}", tmp_path / f"old-{k}") for k in (1, 5)]
    rows = fleet_summary([str(p) for p in old]).to_pylist()
    assert len(rows) == 2
    for r, k in zip(rows, (1, 5)):
        assert r["host"] == f"(unknown) {tmp_path / f'old-{k}'}"
        assert r["requests"] == truth[f"node-{k}"]["requests"]
        assert r["gpu_j_per_token"] == pytest.approx(truth[f"node-{k}"]["jpt"])
        assert r["gpu_energy_j"] == pytest.approx(truth[f"node-{k}"]["gpu_j"])


def test_older_files_under_host_partitions_take_the_partition_name(fleet, tmp_path):
    base, truth = fleet
    _without_host(base / "node-4", tmp_path / "host=node-4")
    rows = fleet_summary([str(tmp_path / "host=node-4")]).to_pylist()
    assert [r["host"] for r in rows] == ["node-4"]
    assert rows[0]["gpu_energy_j"] == pytest.approx(truth["node-4"]["gpu_j"])


def test_docs_duckdb_query_counts_a_copy_once_and_keeps_the_hosts(fleet, tmp_path):
    """docs/fleet.md's query over a synced fleet that kept merged flush files, under a `host=` folder."""
    base, truth = fleet
    top = tmp_path / "host=analyst"
    for k in range(NODES):
        _copy(base / f"node-{k}", top / f"node-{k}")
    for table in ("requests", "intervals"):
        f = next((top / "node-0" / table).rglob("part-*.parquet"))
        f.with_name("compact-20260116T000000000000-1.parquet").write_bytes(f.read_bytes())
    sql = re.search(r"```sql duckdb\n(.*?)```", (ROOT / "docs" / "fleet.md").read_text(), re.S).group(1)
    con = duckdb.connect()
    rows = con.execute(sql.replace("/var/lib/powerprof-fleet", str(top))).fetchall()
    cols = [d[0] for d in con.description]
    rows = [dict(zip(cols, r)) for r in rows]
    assert [r["host"] for r in rows] == sorted(truth)
    for r in rows:
        assert r["requests"] == truth[r["host"]]["requests"]
        assert r["gpu_energy_j"] == pytest.approx(truth[r["host"]]["gpu_j"])


def test_rows_with_impossible_energy_or_tokens_are_left_out_and_counted(tmp_path):
    # A NaN interval made the host's energy NaN with no reason given; a negative one (a counter read
    # across a driver reload by another tool) silently lowered it; so did NaN or negative request figures.
    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("intervals", [{"daemon_id": "d0", "t_start_utc": T0_NS + (100 + i) * 10**9,
                                "t_end_utc": T0_NS + (101 + i) * 10**9, "duration_s": 1.0, "kind": "decode",
                                "gpu_energy_j": v} for i, v in enumerate((float("nan"), -5e6, float("inf")))])
    store.append("requests", [{"daemon_id": "d0", "request_id": 100 + i, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 100, "gpu_energy_j": e, "attributed_tokens": t, "ttft_s": 0.1}
                              for i, (e, t) in enumerate(((float("nan"), 100.0), (-50.0, 100.0), (50.0, -3.0)))])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_energy_j"] == pytest.approx(truth["gpu_j"])
    assert r["gpu_j_per_token"] == pytest.approx(truth["jpt"])
    assert r["invalid_intervals"] == 3 and r["invalid_requests"] == 3
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0 and "left out" in res.stderr and "nan" not in res.stdout.lower(), res.output


def test_a_dataset_without_rows_says_so(tmp_path):
    # A daemon folder with empty requests/ and intervals/ (a daemon that never flushed) printed
    # "all 0 hosts ... nan" and exited 0.
    for table in ("requests", "intervals"):
        (tmp_path / "n" / table).mkdir(parents=True)
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "no request or interval rows" in res.output, res.output
    assert not (tmp_path / "out").exists()
