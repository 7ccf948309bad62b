"""Fleet scale: 8 simulated nodes' daemon datasets analysed and exported in one call; every row
carries its host; docs/fleet.md's DuckDB query gives the same per-host figures."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from powerprof.analysis.export import export
from powerprof.analysis.fleet import FleetError, fleet_summary, notes, tag_notes, tag_summary
from powerprof.cli import main
from powerprof.daemon.service import datasets
from powerprof.daemon.store import DatasetStore

ROOT = Path(__file__).resolve().parents[1]
NODES = 8
T0_NS = 1_768_478_400 * 10**9  # 2026-01-15 12:00 UTC


def _node(root: Path, k: int, simulated: bool | None = None, daemon: str | None = None) -> dict:
    """One node's daemon data folder written by the daemon's own store; returns its true totals."""
    store = DatasetStore(root, datasets(), host=f"node-{k}", simulated=simulated)
    n_req = 10 + k
    daemon = daemon or f"d{k}"
    reqs = [{"daemon_id": daemon, "request_id": i, "t_arrival_utc": T0_NS + i * 10**9,
             "t_end_utc": T0_NS + i * 10**9 + 5 * 10**8, "outcome": "ok" if i else "client_disconnected",
             "generated_tokens": 100 + k, "gpu_energy_j": 50.0 + k, "attributed_tokens": 100.0 + k, "ttft_s": 0.1}
            for i in range(n_req)]
    ivals = [{"daemon_id": daemon, "t_start_utc": T0_NS + i * 10**9, "t_end_utc": T0_NS + (i + 1) * 10**9,
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


def test_a_fleet_out_whose_parent_is_missing_is_refused_as_a_sweeps(fleet, tmp_path):
    # fleet.write_out made the whole tree (`mkdir -p`) of a mistyped --out; sweep, analyze and export refuse it.
    base, _ = fleet
    out = tmp_path / "typo" / "out"
    res = CliRunner().invoke(main, ["analyze", str(base / "node-0"), "--out", str(out)])
    assert res.exit_code == 2 and f"mkdir -p {out.parent}" in " ".join(res.output.split()), res.output
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("under", ["afile", "dangling"])
def test_a_fleet_out_under_a_file_or_a_dangling_link_is_refused_naming_it(fleet, tmp_path, under, monkeypatch):
    # fleet analyze --out afile/F or dang/F (dang -> a missing folder) ended in a NotADirectoryError or
    # FileNotFoundError traceback from write_out (exit 1): missing_parent let a parent that exists as no folder through.
    # As a user who is not root (the as-root check, which refuses the dangling link itself, off).
    import powerprof.trust

    monkeypatch.setattr(powerprof.trust, "untrusted_out_dir", lambda *a, **k: None)
    base, _ = fleet
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "deeper")
    for cmd in (["analyze", str(base / "node-0")], ["analyze", str(base / "node-0"), "--json"]):
        res = CliRunner().invoke(main, [*cmd, "--out", str(tmp_path / under / "F")])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (said, res.exception)
        assert f"'{tmp_path / under}' is a" in said and "not a folder" in said and "Fix:" in said, said
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "gone").exists()


def test_a_fleet_out_that_cannot_be_written_says_why_without_a_traceback(fleet, tmp_path, monkeypatch):
    # write_out's OSError (a full disk, a read-only folder) was uncaught: a traceback, exit 1.
    import errno

    from powerprof.storage import runs as storage_runs

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "F" / "fleet.parquet"))

    monkeypatch.setattr(storage_runs, "atomic_write_table", full)
    base, _ = fleet
    res = CliRunner().invoke(main, ["analyze", str(base / "node-0"), "--out", str(tmp_path / "F")])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (said, res.exception)
    assert "cannot write the fleet summary" in said and "No space left on device" in said, said


def test_a_simulated_hosts_figures_are_marked_and_said_beside_real_ones(fleet, tmp_path):
    # A daemon --simulate's folder synced beside real nodes' was summed as a real host, unmarked (session 46's
    # walkthrough): its row says (sim), a note says so, and that the all line adds it to real figures.
    base, truth = fleet
    _node(tmp_path / "node-9", 9, simulated=True)
    res = CliRunner().invoke(main, ["analyze", str(base / "node-0"), str(tmp_path / "node-9")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert any(ln.startswith("node-9 (sim) ") for ln in lines) and any(ln.startswith("node-0 ") for ln in lines)
    assert not any(ln.startswith("node-0 (sim)") for ln in lines)
    said = [ln for ln in lines if "simulated GPU" in ln]
    assert len(said) == 1 and "node-9 (sim): 40 intervals" in said[0] and "adds them to real hosts'" in said[0], said
    alone = CliRunner().invoke(main, ["analyze", str(tmp_path / "node-9")])
    assert "node-9 (sim) " in alone.output and "simulated GPU" in alone.output and "adds them" not in alone.output
    assert fleet_summary([str(base / "node-0")]).column("simulated_intervals").to_pylist() == [0]  # before the column
    # One host that ran `daemon --simulate` and then the real daemon on one data dir: two rows, never one blend of
    # both under the simulator's mark (9 J/token and 1 read 5, session 46's review).
    both = tmp_path / "both"
    _node(both, 5, simulated=True)
    _node(both / "real", 5, simulated=False, daemon="d5-real")
    for table in ("requests", "intervals"):
        for f in (both / "real" / table).rglob("*.parquet"):
            dst = both / table / f.parent.name / ("real-" + f.name)
            dst.parent.mkdir(parents=True, exist_ok=True)
            f.rename(dst)
    rows = {r["host"]: r for r in fleet_summary([str(both)]).to_pylist()}
    assert set(rows) == {"node-5", "node-5 (sim)"}, rows.keys()
    assert rows["node-5"]["simulated_intervals"] == 0 and rows["node-5 (sim)"]["simulated_intervals"] == 40
    assert rows["node-5"]["requests"] == rows["node-5 (sim)"]["requests"] == 15


def test_a_host_missing_a_table_prints_unknown_and_its_simulated_rows_are_said(fleet, tmp_path):
    # A simulated node synced without its intervals/ (a partial sync) printed `0.000   nan` for its GPU kWh and idle %,
    # and the note on the simulator's figures named only the real-looking hosts with simulated intervals: the
    # `(sim)` host with request rows alone was counted as real. A node without requests/ printed 0 requests, 0 tokens
    # where the JSON says null (unknown).
    import shutil

    base, _ = fleet
    _node(tmp_path / "noint", 9, simulated=True)
    shutil.rmtree(tmp_path / "noint" / "intervals")
    res = CliRunner().invoke(main, ["analyze", str(base / "node-0"), str(tmp_path / "noint")])
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("node-9 (sim)")).split()
    assert row[2:] == ["19", "2071", "-", "-", "100%", f"{59 / 109:.3f}"], row
    assert "nan" not in res.output.lower(), res.output
    every = next(ln for ln in res.stdout.splitlines() if ln.startswith("all 2 hosts")).split()
    assert every[5:7] == ["-", "-"], every  # node-0's GPU energy alone is no total for both
    said = [ln for ln in res.stderr.splitlines() if "simulated GPU" in ln]
    assert len(said) == 1 and "node-9 (sim): 0 intervals, 19 requests" in said[0], said
    assert "adds them to real hosts'" in said[0], said
    gone = [ln for ln in res.stderr.splitlines() if "no interval rows" in ln]
    assert len(gone) == 1 and "node-9 (sim)" in gone[0] and "intervals/" in gone[0], res.stderr
    row = {r["host"]: r for r in fleet_summary([str(tmp_path / "noint")]).to_pylist()}["node-9 (sim)"]
    assert row["simulated_requests"] == 19 and row["simulated_intervals"] == 0 and row["gpu_energy_j"] is None
    _node(tmp_path / "noreq", 1)
    shutil.rmtree(tmp_path / "noreq" / "requests")
    res = CliRunner().invoke(main, ["analyze", str(base / "node-0"), str(tmp_path / "noreq")])
    assert res.exit_code == 0, res.output
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("node-1 ")).split()
    assert row[1:3] == ["-", "-"] and row[3] == f"{40 * 301 / 3.6e6:.3f}", row
    every = next(ln for ln in res.stdout.splitlines() if ln.startswith("all 2 hosts")).split()
    assert every[3:5] == ["-", "-"], every
    gone = [ln for ln in res.stderr.splitlines() if "no request rows" in ln]
    assert len(gone) == 1 and "node-1" in gone[0] and "requests/" in gone[0], res.stderr
    assert "simulated GPU" not in res.output


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


def test_a_folder_with_a_sweeps_run_and_daemon_datasets_is_refused_not_read_as_one_of_them(fleet, tmp_path):
    # A daemon once given a run directory as its data dir: `analyze` of the folder showed the daemon's summary in the
    # run's stead, `export` the run's tables without the daemon's, neither saying the other was there.
    from synthetic_runs import make_run, seed_truth

    base, _ = fleet
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=6, seed=1)
    _copy(base / "node-1", tmp_path / "both")
    for f in run.iterdir():
        if f.is_file():
            (tmp_path / "both" / f.name).write_bytes(f.read_bytes())
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for args in (["analyze", str(tmp_path / "both")], ["analyze", str(base / "node-0"), str(tmp_path / "both")],
                 ["analyze", str(tmp_path / "both"), "--out", str(tmp_path / "o")],
                 ["export", str(tmp_path / "both"), "--format", "csv", "--out", str(tmp_path / "x")]):
        res = CliRunner().invoke(main, args)
        said = " ".join(res.output.split())
        assert res.exit_code == 1 and "holds both a sweep's run" in said and str(tmp_path / "both") in said, res.output
        assert "Traceback" not in res.output
    with pytest.raises(FleetError, match="holds both a sweep's run"):
        fleet_summary([str(tmp_path / "both")])
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written
    # Each apart is read as before.
    assert CliRunner().invoke(main, ["analyze", str(run), "--bootstrap", "100", "--json"]).exit_code == 0
    assert CliRunner().invoke(main, ["analyze", str(base / "node-1")]).exit_code == 0


def test_a_fleet_summary_is_never_written_into_a_sweeps_run_folder(fleet, tmp_path):
    # `analyze NODE --out RUN` put fleet.parquet among the run's tables, which `export RUN` then gave as the run's.
    base, _ = fleet
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    res = CliRunner().invoke(main, ["analyze", str(base / "node-1"), "--out", str(run)])
    assert res.exit_code == 2 and "sweep's run directory" in " ".join(res.output.split()), res.output
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]


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


def test_an_interval_whose_energy_no_gpus_could_draw_is_left_out_and_said(tmp_path):
    # An interval of 1 s with gpu_energy_j = 1e15 (a counter read across a driver reload, an edited file) was summed:
    # the host printed 277777777 kWh. More than MAX_HOST_GPU_POWER_W over its duration is no draw: left out, said.
    from powerprof.analysis.fleet import MAX_HOST_GPU_POWER_W

    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("intervals", [{"daemon_id": "d0", "t_start_utc": T0_NS + (100 + i) * 10**9,
                                "t_end_utc": T0_NS + (101 + i) * 10**9, "duration_s": d, "kind": "decode",
                                "gpu_energy_j": e} for i, (e, d) in enumerate(((1e15, 1.0), (50.0, 0.0),
                                                                               (MAX_HOST_GPU_POWER_W * 2.0, 1.0)))])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_energy_j"] == pytest.approx(truth["gpu_j"]) and r["invalid_intervals"] == 3
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    said = " ".join(res.stderr.split())
    assert res.exit_code == 0 and "3 intervals" in said and f"{MAX_HOST_GPU_POWER_W / 1000:g} kW" in said, res.output
    assert "277777" not in res.stdout, res.stdout


def test_a_dataset_without_rows_says_so(tmp_path):
    # A daemon folder with empty requests/ and intervals/ (a daemon that never flushed) printed
    # "all 0 hosts ... nan" and exited 0.
    for table in ("requests", "intervals"):
        (tmp_path / "n" / table).mkdir(parents=True)
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1 and "no request or interval rows" in res.output, res.output
    assert not (tmp_path / "out").exists()


# --- export writes a row read twice once (review s29: analyze counted it once, export still wrote it twice) --------

def _sync_kept_merged_files(node: Path) -> None:
    """What `aws s3 sync` without --delete leaves: the flush files beside the file compaction merged them into."""
    for table in ("requests", "intervals", "tags", "costs", "samples"):
        for f in list((node / table).rglob("part-*.parquet")):
            f.with_name("compact-20260116T000000000000-1.parquet").write_bytes(f.read_bytes())


def _energy(table) -> float:
    return sum(v for v in table.column("gpu_energy_j").to_pylist() if v is not None)


def test_export_writes_a_copied_nodes_rows_once(fleet, tmp_path):
    # A backup copy of node-1 beside the glob: node-1's 11 requests and 40 intervals were written twice, and a
    # spreadsheet summing the exported energy doubled node-1's, silently.
    base, truth = fleet
    _copy(base / "node-1", tmp_path / "backup-node-1")
    res = CliRunner().invoke(main, ["export", str(base / "node-*"), str(tmp_path / "backup-node-1"),
                                    "--format", "parquet", "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    req = pq.read_table(tmp_path / "out" / "requests.parquet")
    ivals = pq.read_table(tmp_path / "out" / "intervals.parquet")
    assert req.num_rows == sum(t["requests"] for t in truth.values())
    assert _energy(ivals) == pytest.approx(sum(t["gpu_j"] for t in truth.values()))
    # The fixture's samples carry no daemon_id: a row without a key is its own, never taken for a copy.
    assert pq.read_table(tmp_path / "out" / "samples.parquet").num_rows == NODES + 1
    # Said on stderr, with how many and where from.
    assert "requests: 11 rows found more than once were written once" in res.stderr, res.stderr
    assert "intervals: 40 rows" in res.stderr and "node-1: 40" in res.stderr
    assert str(tmp_path / "backup-node-1") in res.stderr


@pytest.mark.parametrize("fmt", ["csv", "xlsx", "parquet"])
def test_export_writes_flush_files_a_sync_kept_once(fleet, tmp_path, fmt):
    base, truth = fleet
    node = _copy(base / "node-2", tmp_path / "node-2")
    _sync_kept_merged_files(node)
    out = tmp_path / ("o.xlsx" if fmt == "xlsx" else "o")
    res = CliRunner().invoke(main, ["export", str(node), "--format", fmt, "--out", str(out)])
    assert res.exit_code == 0, res.output
    if fmt == "xlsx":
        import pandas as pd

        sheets = pd.read_excel(out, sheet_name=None)
        req, ivals = sheets["requests"], sheets["intervals"]
    elif fmt == "csv":
        import pandas as pd

        req, ivals = pd.read_csv(out / "requests.csv"), pd.read_csv(out / "intervals.csv")
    else:
        req, ivals = pq.read_table(out / "requests.parquet").to_pandas(), pq.read_table(out / "intervals.parquet").to_pandas()
    energy = next(c for c in ivals.columns if c.startswith("gpu_energy_j"))
    assert len(req) == truth["node-2"]["requests"] and len(ivals) == 40
    assert ivals[energy].sum() == pytest.approx(truth["node-2"]["gpu_j"])
    assert sorted(req[next(c for c in req.columns if c.startswith("request_id"))]) == list(range(12))
    arrival = list(req[next(c for c in req.columns if c.startswith("t_arrival_utc"))])
    assert arrival == sorted(arrival)  # in time order, as compaction leaves a day's rows
    assert f"node-2: {truth['node-2']['requests']} (in {node})" in res.stderr, res.stderr


def test_export_after_a_real_compaction_beside_its_flush_files(tmp_path):
    # The daemon's own compaction (pyarrow, ZSTD) rewrites the flush files (flatparquet, GZIP): the copies must
    # compare equal row for row, or a sync-kept copy would read as a conflict.
    store = DatasetStore(tmp_path / "n", datasets(), host="n")
    for k in range(3):
        store.append("requests", [{"daemon_id": "d", "request_id": 10 * k + i, "t_arrival_utc": T0_NS + i,
                                   "gpu_energy_j": 1.5 + i, "attributed_tokens": 3.0, "outcome": "ok"} for i in range(10)])
        store.append("intervals", [{"daemon_id": "d", "t_start_utc": T0_NS + (10 * k + i) * 10**9,
                                    "t_start_mono_s": 10.0 * k + i + 0.123456789, "duration_s": 1.0,
                                    "gpu_energy_j": 7.25, "kind": "decode"} for i in range(10)])
        assert store.flush()
    flushed = {f: f.read_bytes() for f in (tmp_path / "n").rglob("part-*.parquet")}
    assert store.compact() > 0
    assert not any(f.exists() for f in flushed)
    for f, data in flushed.items():  # the sync's copy still has them
        f.write_bytes(data)
    res = CliRunner().invoke(main, ["export", str(tmp_path / "n"), "--format", "parquet", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "o" / "requests.parquet").num_rows == 30
    ivals = pq.read_table(tmp_path / "o" / "intervals.parquet")
    assert ivals.num_rows == 30 and _energy(ivals) == pytest.approx(30 * 7.25)
    assert "requests: 30 rows found more than once" in res.stderr


def test_export_refuses_one_key_with_two_different_rows(fleet, tmp_path):
    # The same request of the same daemon with two energies: one of them is wrong and nothing says which.
    base, _ = fleet
    edited = _copy(base / "node-3", tmp_path / "node-3-edited")
    f = next((edited / "requests").rglob("*.parquet"))
    t = pq.read_table(f)
    energy = t.column("gpu_energy_j").to_pylist()
    energy[4] = energy[4] * 2
    pq.write_table(t.set_column(t.column_names.index("gpu_energy_j"), "gpu_energy_j", pa.array(energy)), f)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["export", str(base / "node-3"), str(edited), "--format", "csv", "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "requests: 1 key(s) (daemon_id, request_id) hold rows that differ" in res.output, res.output
    assert "daemon_id=d3, request_id=4" in res.output and str(edited) in res.output
    assert not out.exists()


def test_xlsx_row_limit_counts_the_rows_written(fleet, tmp_path, monkeypatch):
    # The sheet's limit was checked against the rows read (duplicates too): a selection that fits once written
    # was refused. Above the limit it is still refused, never truncated.
    from powerprof.analysis import export as ex

    base, truth = fleet
    node = _copy(base / "node-2", tmp_path / "node-2")
    _sync_kept_merged_files(node)
    monkeypatch.setattr(ex, "XLSX_MAX_ROWS", 40)
    (path,) = ex.export(node, "xlsx", tmp_path / "a.xlsx")
    from openpyxl import load_workbook

    assert len(list(load_workbook(path, read_only=True)["intervals"].iter_rows())) == 41
    monkeypatch.setattr(ex, "XLSX_MAX_ROWS", 39)
    with pytest.raises(ex.ExportError, match="intervals has 40 rows in the selection; a sheet holds 39"):
        ex.export(node, "xlsx", tmp_path / "b.xlsx")
    assert not (tmp_path / "b.xlsx").exists()


def test_export_of_some_columns_without_the_key_still_writes_each_row_once(fleet, tmp_path):
    base, truth = fleet
    node = _copy(base / "node-2", tmp_path / "node-2")
    _sync_kept_merged_files(node)
    out = tmp_path / "e.parquet"
    export([node / "intervals"], "parquet", out, columns=["gpu_energy_j"], time_from="2026-01-15T12:00:10Z")
    t = pq.read_table(out)
    assert t.column_names == ["gpu_energy_j"] and t.num_rows == 30
    assert _energy(t) == pytest.approx(30 * 302.0)


def test_duckdb_draws_no_progress_bar_among_the_file_names_export_prints():
    # Past 2 s a query drew DuckDB's progress bar on stdout, where `export` prints the files it wrote.
    from powerprof.analysis.engine import connect

    with connect() as con:
        assert con.execute("SELECT current_setting('enable_progress_bar')").fetchall() == [(False,)]


def test_analyze_refuses_one_key_with_two_different_rows_as_export_does(fleet, tmp_path):
    # analyze counted such a key once with either row's energy (any_value): a figure nothing vouched for.
    base, _ = fleet
    edited = _copy(base / "node-3", tmp_path / "node-3-edited")
    f = next((edited / "intervals").rglob("*.parquet"))
    t = pq.read_table(f)
    energy = t.column("gpu_energy_j").to_pylist()
    energy[7] = energy[7] + 1000
    pq.write_table(t.set_column(t.column_names.index("gpu_energy_j"), "gpu_energy_j", pa.array(energy)), f)
    res = CliRunner().invoke(main, ["analyze", str(base / "node-3"), str(edited), "--out", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    assert "1 interval key(s)" in res.output and "hold rows that differ" in res.output, res.output
    assert not (tmp_path / "out" / "fleet.parquet").exists()


def test_analyze_refuses_one_key_written_by_two_hosts(fleet, tmp_path):
    # A copy of node-3's rows whose host column says node-9 (a restored backup relabelled, a host renamed by hand):
    # the key was summed under the smaller host name, and the other host's sums silently lacked it.
    base, _ = fleet
    edited = _copy(base / "node-3", tmp_path / "node-3-relabelled")
    for f in (edited / "requests").rglob("*.parquet"):
        t = pq.read_table(f)
        pq.write_table(t.set_column(t.column_names.index("host"), "host", pa.array(["node-9"] * t.num_rows)), f)
    res = CliRunner().invoke(main, ["analyze", str(base / "node-3"), str(edited)])
    assert res.exit_code == 1, res.output
    # Both hosts named, and what differs: the host, not the values (it read "hold rows that differ (hosts: node-3)").
    assert "written by two hosts (node-3 and node-9)" in res.output, res.output
    assert "hold rows that differ" not in res.output, res.output


def test_export_with_a_copied_node_writes_what_the_fleet_alone_does(fleet, tmp_path):
    # A backup copy among the sources changes nothing written: the same rows, in the same order, as the export of
    # the fleet without it (before, copies sent a table through a sort by time, interleaving the nodes' rows).
    base, _ = fleet
    _copy(base / "node-1", tmp_path / "backup-node-1")
    export([str(base / "node-*")], "parquet", tmp_path / "alone", tz="UTC")
    notes: list[str] = []
    export([str(base / "node-*"), str(tmp_path / "backup-node-1")], "parquet", tmp_path / "with", tz="UTC", notes=notes)
    assert any("rows found more than once were written once" in n for n in notes), notes
    for table in ("requests", "intervals"):  # (the fixture's samples have no key: each written as it is)
        assert pq.read_table(tmp_path / "with" / f"{table}.parquet").equals(
            pq.read_table(tmp_path / "alone" / f"{table}.parquet")), table


def test_export_refuses_files_that_change_between_finding_copies_and_writing(fleet, tmp_path, monkeypatch):
    # Copies are marked by their place in the scan: a file replaced between that read and the write (a compaction
    # or a sync running) must not shift the places and leave other rows out, silently: the export is refused.
    import powerprof.analysis.export as ex

    base, _ = fleet
    backup = _copy(base / "node-1", tmp_path / "backup-node-1")
    find = ex.find_copies

    def find_then_change(src, filt):
        out = find(src, filt)
        if src.name == "intervals":
            f = next((backup / "intervals").rglob("*.parquet"))
            pq.write_table(pq.read_table(f).slice(1), f.with_name("new.tmp"))  # one row fewer, renamed over it
            f.with_name("new.tmp").replace(f)
        return out

    monkeypatch.setattr(ex, "find_copies", find_then_change)
    res = CliRunner().invoke(main, ["export", str(base / "node-*"), str(backup), "--format", "parquet",
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code != 0 and "table intervals" in res.output, res.output
    assert not (tmp_path / "out" / "intervals.parquet").exists()


def test_the_write_refuses_a_scan_of_another_length_than_the_one_copies_were_marked_in(fleet, tmp_path):
    # pyarrow errors on a file replaced under its cached footer; a scan that still yields another number of rows
    # (files added or gone) meets the row count find_copies took.
    import powerprof.analysis.export as ex

    base, _ = fleet
    _copy(base / "node-1", tmp_path / "backup-node-1")
    srcs = ex.expand([str(base / "node-*"), str(tmp_path / "backup-node-1")])
    src = next(s for s in ex.union_sources([ex.find_sources(s) for s in srcs]) if s.name == "intervals")
    copies = ex.find_copies(src, None)
    assert copies.dropped == 40 and copies.rows == 40 * (NODES + 1)
    for rows in (copies.rows - 1, copies.rows + 1):
        copies.rows = rows
        with pytest.raises(ex.ExportError, match="changed while the export read them"):
            list(ex._Once(src, src.dataset.schema.names, None, copies, 64).to_batches())


def test_the_write_refuses_a_file_rewritten_with_as_many_rows_in_another_order(fleet, tmp_path):
    # The row count alone cannot tell a file rewritten under its name with the same rows reordered: the marked
    # places would then leave other rows out. Each file's size and modification time are compared too.
    import os

    import powerprof.analysis.export as ex

    base, _ = fleet
    backup = _copy(base / "node-1", tmp_path / "backup-node-1")
    srcs = ex.expand([str(base / "node-*"), str(backup)])
    src = next(s for s in ex.union_sources([ex.find_sources(s) for s in srcs]) if s.name == "intervals")
    copies = ex.find_copies(src, None)
    f = next((backup / "intervals").rglob("*.parquet"))
    t = pq.read_table(f)
    st = os.stat(f)
    pq.write_table(t.take(list(range(t.num_rows))[::-1]), f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    # Read afresh (a scan that opens the files again; the same dataset object would fail on its cached footer).
    again = next(s for s in ex.union_sources([ex.find_sources(s) for s in srcs]) if s.name == "intervals")
    with pytest.raises(ex.ExportError, match="changed while the export read them"):
        list(ex._Once(again, again.dataset.schema.names, None, copies, 64).to_batches())


def test_docs_duckdb_query_keeps_rows_written_before_daemon_id_each(fleet, tmp_path):
    """Rows a daemon wrote before `daemon_id` existed have no key: fleet_summary keeps each (rowkeys.keyless_sql).
    docs/fleet.md's `DISTINCT ON (daemon_id, request_id)` took every such row with the same request_id, across nodes,
    for one: two older nodes' 10 + 11 requests read as 11 (beside a newer node), tokens and energy lost without a word."""
    base, truth = fleet
    top = tmp_path / "fleet"
    for k in (0, 1):
        for table in ("requests", "intervals"):
            for f in (base / f"node-{k}" / table).rglob("*.parquet"):
                out = top / f"node-{k}" / f.relative_to(base / f"node-{k}")
                out.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(pq.read_table(f).drop_columns(["daemon_id"]), out)
    _copy(base / "node-2", top / "node-2")  # a newer node beside them: the column is there, null in their rows
    code = {r["host"]: r for r in fleet_summary([str(top / f"node-{k}") for k in range(3)]).to_pylist()}
    assert {h: r["requests"] for h, r in code.items()} == {f"node-{k}": truth[f"node-{k}"]["requests"] for k in range(3)}
    sql = re.search(r"```sql duckdb\n(.*?)```", (ROOT / "docs" / "fleet.md").read_text(), re.S).group(1)
    con = duckdb.connect()
    rows = con.execute(sql.replace("/var/lib/powerprof-fleet", str(top))).fetchall()
    cols = [d[0] for d in con.description]
    for r in (dict(zip(cols, r)) for r in rows):
        assert r["requests"] == code[r["host"]]["requests"], r
        assert r["generated_tokens"] == code[r["host"]]["generated_tokens"], r
        assert r["gpu_energy_j"] == pytest.approx(code[r["host"]]["gpu_energy_j"]), r


def test_export_matches_a_pandas_reference_over_random_copied_fleets(tmp_path):
    """40 random fleets (non-ASCII hosts, copies in other folders and in the same file, keys with nulls, NaN and -0.0
    energies, a copy 1 ns apart): export writes what drop_duplicates on (daemon_id, request_id) keeps plus every
    keyless row, and refuses exactly the fleets where one key holds rows that differ."""
    from export_reference import one

    got = [one(seed, tmp_path) for seed in range(40)]
    assert not [g for g in got if g.startswith("FAIL")], got
    assert "refused-ok" in got and got.count("ok") >= 30, got


@pytest.mark.parametrize("flag, note, energy_j, fix", [
    # The daemon marks a short request's energy on a GPU without an energy counter (it rests on the idle power taken
    # out of a mostly idle interval) and leaves it out of its own J/token; the fleet summary summed it in, at up to
    # twice its energy, with nothing said.
    ("no-counter-short", "no-counter-short: 90% of its GPU energy ...", 500.0, "energy counter"),
    # A request live before the daemon's first GPU read (its start's NVML read failed) has the energy before that read
    # in no interval: its figure is low. Before, the summary summed it in, lowering the host's J/token, unsaid.
    ("before-first-read", "before-first-read: it arrived 0.50 s before ...", 0.1, "start's GPU read failed"),
    # A row whose figure may be read either way, nothing measured saying which: a run-on a found-down scrape may have
    # cut (nearly all of it too much if so). Before,
    # only its note's prose said so, and the summary summed it in (400 J for what may have been 2.5 J).
    ("uncertain-uncounted", "approximate: ...; uncertain-uncounted: a scrape 0.03 s after ...; fix: scrape the "
                            "server's own port", 400.0, "the fix its energy_note names"),
])
def test_requests_flagged_uncertain_are_left_out_of_j_per_token_and_said(tmp_path, flag, note, energy_j, fix):
    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 100 + i, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 10, "gpu_energy_j": energy_j, "attributed_tokens": 10.0,
                               "ttft_s": 0.1, "energy_note": note} for i in range(3)])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_j_per_token"] == pytest.approx(truth["jpt"])
    assert r["uncertain_requests"] == 3 and r["requests"] == truth["requests"] + 3
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0 and flag in res.stderr and "node-0: 3" in res.stderr, res.output
    assert fix in res.stderr, res.stderr  # each flag's own fix


def test_a_request_marked_uncertain_and_bypass_uncounted_is_counted_once_in_the_bypass_column_and_said(tmp_path):
    # A row carrying both uncertain-uncounted and bypass-uncounted is counted in bypass_uncertain_requests only; the
    # docs said uncertain_requests counted it and analyze's stderr said nothing of where it went.
    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 100, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 10, "gpu_energy_j": 400.0, "attributed_tokens": 10.0, "ttft_s": 0.1,
                               "energy_note": "approximate: x; bypass-uncounted: late; uncertain-uncounted: a scrape"},
                              {"daemon_id": "d0", "request_id": 101, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 10, "gpu_energy_j": 400.0, "attributed_tokens": 10.0, "ttft_s": 0.1,
                               "energy_note": "approximate: x; uncertain-uncounted: a scrape"}])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_j_per_token"] == pytest.approx(truth["jpt"])
    assert r["uncertain_requests"] == 1 and r["bypass_uncertain_requests"] == 1, r
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    said = " ".join(res.stderr.split())
    assert res.exit_code == 0 and "those also marked bypass-uncounted are counted in its line, not here" in said, said
    doc = " ".join((ROOT / "docs" / "fleet.md").read_text().split())
    assert "counts both per host" not in doc
    assert "a row also marked `bypass-uncounted` is counted in `bypass_uncertain_requests` only" in doc, doc


def test_requests_whose_gpu_energy_is_unknown_are_left_out_of_j_per_token_and_said(tmp_path):
    # The daemon writes gpu_energy_j empty (never 0) for a request a GPU gave no energy reading over (its energy_note says
    # "GPU energy unknown"), with its tokens. The summary summed those tokens under the other requests' energy: 10 such
    # requests beside node-0's 10 measured ones read 0.250 J/token against the true 0.500, and nothing said so.
    from powerprof.daemon.rowtext import GPU_MISSING_NOTE

    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 100 + i, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 100, "gpu_energy_j": None, "attributed_tokens": 100.0,
                               "ttft_s": 0.1, "energy_note": GPU_MISSING_NOTE} for i in range(10)])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_j_per_token"] == pytest.approx(truth["jpt"])
    assert r["unknown_energy_requests"] == 10 and r["requests"] == truth["requests"] + 10
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    assert re.search(r"all 1 host .* 0\.500\s*$", res.stdout, re.M), res.stdout  # the total line, the same rule
    # Beside the totals (every request's tokens), the share the J/token rests on: 1000 of the tokens are not in it.
    on = re.search(r"all 1 host .* (\d+)%\s+0\.500\s*$", res.stdout, re.M)
    share = 100 * r["attributed_tokens"] / r["generated_tokens"]
    assert on and int(on.group(1)) == round(share) < 100 and "J/tok on: the share of the tokens" in res.stdout, res.stdout
    assert "GPU energy is unknown" in res.stderr and "node-0: 10" in res.stderr and "nvidia-smi" in res.stderr, res.stderr


def test_requests_the_proxy_answered_before_forwarding_are_counted_failed_and_out_of_the_energy_figures(tmp_path):
    # The daemon writes a row for a request it answered before forwarding (a 408 for its body, a client gone mid-body, a
    # proxy_error): no energy, no tokens, its energy_note "no share: not forwarded". The summary counts them among the
    # failed requests, and its energy and J/token figures are the measured requests' alone.
    truth = _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 100 + i, "t_arrival_utc": T0_NS, "outcome": outcome,
                               "status": status, "generated_tokens": None, "gpu_energy_j": None, "attributed_tokens": 0.0,
                               "energy_note": "no share: not forwarded (the server never saw it; its error says why), "
                                              "so no GPU work of it"}
                              for i, (outcome, status) in enumerate([("client_timeout", 408), ("client_disconnected", None),
                                                                     ("proxy_error", 500)])])
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    assert r["gpu_j_per_token"] == pytest.approx(truth["jpt"]) and r["generated_tokens"] == truth["tokens"]
    assert r["requests"] == truth["requests"] + 3 and r["failed_requests"] == truth["failed"] + 3
    assert not r["unknown_energy_requests"] and not r["invalid_requests"], r
    assert r["not_forwarded_requests"] == 3, r  # counted apart, and said by analyze
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0 and "answered before forwarding them" in res.stderr and "node-0: 3" in res.stderr, res.output


def test_the_fleet_total_j_per_token_leaves_out_a_hosts_tokens_without_energy(fleet, tmp_path):
    # A node whose requests all lack their energy shows "-" for its own J/token, but the total line summed its tokens
    # under the other nodes' energy: node-0 (0.500) and such a node read 0.250 for all hosts.
    store = DatasetStore(tmp_path / "blind", datasets(), host="blind")
    store.append("requests", [{"daemon_id": "b", "request_id": i, "t_arrival_utc": T0_NS, "outcome": "ok",
                               "generated_tokens": 100, "gpu_energy_j": None, "attributed_tokens": 100.0,
                               "ttft_s": 0.1} for i in range(10)])
    assert store.flush()
    res = CliRunner().invoke(main, ["analyze", str(fleet[0] / "node-0"), str(tmp_path / "blind")])
    assert res.exit_code == 0, res.output
    assert re.search(r"^blind .* -\s*$", res.stdout, re.M) and re.search(r"all 2 hosts .* 0\.500\s*$", res.stdout, re.M), \
        res.stdout


def test_a_named_dataset_without_rows_beside_others_is_said_not_silently_dropped(fleet, tmp_path):
    # A node whose daemon has not flushed yet, named beside a node with rows, vanished from the table ("all 1 hosts")
    # with nothing said; alone it is an error (test_a_dataset_without_rows_says_so).
    for table in ("requests", "intervals"):
        (tmp_path / "new-node" / table).mkdir(parents=True)
    for extra in ([], ["--json"]):
        res = CliRunner().invoke(main, ["analyze", str(fleet[0] / "node-0"), str(tmp_path / "new-node"), *extra])
        assert res.exit_code == 0, res.output
        assert f"{tmp_path / 'new-node'}: no request or interval rows" in res.stderr, res.stderr
    assert "all 1 host " in CliRunner().invoke(main, ["analyze", str(fleet[0] / "node-0"), str(tmp_path / "new-node")]).stdout


# --- a file analyze and export cannot read alike (review hostile3) ------------------------------------------------

def test_a_column_stored_as_text_in_one_file_is_refused_naming_the_file_by_analyze_and_export(tmp_path):
    # gpu_energy_j as VARCHAR in one file (an edited or foreign file): analyze exited 1 with DuckDB's "Binder Error ...
    # isfinite(VARCHAR)"; export said "Unable to merge ... double vs string" naming only the folder. Both now name the
    # file, the column, its type, the type the daemon writes, and the fix, with the same sentence.
    _node(tmp_path / "n", 0)
    good = next((tmp_path / "n" / "requests").rglob("*.parquet"))
    t = pq.read_table(good)
    i = t.schema.get_field_index("gpu_energy_j")
    bad = good.with_name("part-edited.parquet")
    pq.write_table(t.set_column(i, "gpu_energy_j", pa.array([str(v) for v in t.column(i).to_pylist()])), bad)
    said = []
    for args in (["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "a")],
                 ["export", str(tmp_path / "n"), "--format", "csv", "--out", str(tmp_path / "e")]):
        res = CliRunner().invoke(main, args)
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and "Binder Error" not in text and "Traceback" not in text, res.output
        assert str(bad) in text and "gpu_energy_j" in text and "string" in text and "float64" in text, res.output
        assert "move the file out" in text, res.output
        said.append(text)
        assert not (tmp_path / args[-1]).exists()
    assert said[0] == said[1]


def test_a_stray_file_is_left_out_by_analyze_and_export_alike_and_said(tmp_path):
    # What the dataset's files are was decided twice: DuckDB's `**/*.parquet` read a hidden `.x.parquet` and a
    # `_x.parquet` (analyze counted their rows), pyarrow's folder scan skipped those but read `part-x.parquet.tmp` (a
    # copy cut short), on which export failed. One rule now (storage/datafiles.py): `*.parquet`, nothing hidden; the
    # stray is named by both, the hidden files (temporaries, markers) left out without a word.
    truth = _node(tmp_path / "n", 0)
    good = next((tmp_path / "n" / "requests").rglob("*.parquet"))
    good.with_name("part-x.parquet.tmp").write_bytes(good.read_bytes()[:200])
    for name in (".part-y.parquet", "_part-z.parquet"):  # rows of requests that are not the dataset's
        t = pq.read_table(good)
        t = t.set_column(t.schema.get_field_index("request_id"), "request_id",
                         pa.array([1000 + v for v in t.column("request_id").to_pylist()], pa.int64()))
        pq.write_table(t, good.with_name(name))
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    _check(pq.read_table(tmp_path / "a" / "fleet.parquet").to_pylist(), {"node-0": truth})
    assert "part-x.parquet.tmp" in res.stderr and "not read" in res.stderr, res.stderr
    res = CliRunner().invoke(main, ["export", str(tmp_path / "n"), "--format", "parquet", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "e" / "requests.parquet").num_rows == truth["requests"]
    assert "part-x.parquet.tmp" in res.stderr and "not read" in res.stderr, res.stderr
    assert ".part-y" not in res.output and "_part-z" not in res.output


def test_a_categorical_text_column_is_text_to_analyze_and_export_alike(tmp_path):
    # A file rewritten with pandas' category dtype stores outcome as dictionary<string>: the same text to DuckDB, but
    # export's type rule saw "dictionary<values=string, ...>" where the daemon writes string and refused the dataset.
    truth = _node(tmp_path / "n", 0)
    for f in (tmp_path / "n" / "requests").rglob("*.parquet"):
        t = pq.ParquetFile(f).read()
        i = t.schema.get_field_index("outcome")
        pq.write_table(t.set_column(i, "outcome", t.column(i).dictionary_encode()), f)
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    _check(pq.read_table(tmp_path / "a" / "fleet.parquet").to_pylist(), {"node-0": truth})
    res = CliRunner().invoke(main, ["export", str(tmp_path / "n"), "--format", "parquet", "--out", str(tmp_path / "e")])
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "e" / "requests.parquet").num_rows == truth["requests"]


# --- requests and tag windows given energy of an interval left out (review revsweep2) ------------------------------

def _over_bound_interval(node: Path, start_s: float = 100.0) -> None:
    """One interval of node-0 whose energy no host's GPUs could draw (1e15 J over 1 s: a counter read across a
    driver reload), from T0 + start_s."""
    store = DatasetStore(node, datasets(), host="node-0")
    store.append("intervals", [{"daemon_id": "d0", "t_start_utc": T0_NS + int(start_s * 10**9),
                                "t_end_utc": T0_NS + int((start_s + 1) * 10**9), "duration_s": 1.0, "kind": "decode",
                                "gpu_energy_j": 1e15}])
    assert store.flush()


def test_requests_live_in_an_interval_left_out_are_left_out_of_j_per_token_and_said(tmp_path):
    # The summary left the 1e15 J interval out of the host's energy, but the requests the daemon gave a share of it
    # (3e14 J each: finite, positive, so no "invalid request") fed J/token: the host read 1.5e12 J/token.
    truth = _node(tmp_path / "n", 0)
    _over_bound_interval(tmp_path / "n")
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 100 + i, "t_arrival_utc": T0_NS + a,
                               "t_end_utc": T0_NS + e, "outcome": "ok", "generated_tokens": 100,
                               "gpu_energy_j": 3e14 if inside else 50.0, "attributed_tokens": 100.0, "ttft_s": 0.1}
                              for i, (a, e, inside) in enumerate((
                                  (99 * 10**9, 100 * 10**9 + 5 * 10**8, True),   # into it
                                  (100 * 10**9 + 2 * 10**8, 100 * 10**9 + 7 * 10**8, True),  # inside it
                                  (100 * 10**9 + 5 * 10**8, 103 * 10**9, True),  # out of it
                                  (102 * 10**9, 103 * 10**9, False),  # after it: measured, kept
                                  (98 * 10**9, 99 * 10**9 + 5 * 10**8, False)))])  # before it: kept
    assert store.flush()
    [r] = fleet_summary([str(tmp_path / "n")]).to_pylist()
    n = truth["requests"]
    assert r["gpu_j_per_token"] == pytest.approx((50.0 * (n + 2)) / (100.0 * (n + 2)))
    assert r["invalid_interval_requests"] == 3 and r["requests"] == n + 5 and r["invalid_intervals"] == 1
    assert r["unknown_energy_requests"] == 0 and r["invalid_requests"] == 0
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n")])
    assert res.exit_code == 0, res.output
    assert re.search(r"all 1 host .* 0\.500\s*$", res.stdout, re.M), res.stdout
    said = " ".join(res.stderr.split())
    assert "live in an interval left out" in said and "node-0: 3" in said, said


def test_tag_windows_over_an_interval_left_out_are_left_out_of_their_tag_and_said(tmp_path):
    # The same for a tag window: its gpu_energy_j sums its intervals', the over-bound one's 1e15 J among them, and
    # the tag read 1e13 J/token.
    from powerprof.analysis.fleet import tag_notes, tag_summary

    _node(tmp_path / "n", 0)
    _over_bound_interval(tmp_path / "n")
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("tags", [{"daemon_id": "d0", "name": "exp", "t_start_utc": T0_NS + a * 10**9,
                           "t_end_utc": T0_NS + (a + 5) * 10**9, "duration_s": 5.0, "gpu_energy_j": e,
                           "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete"}
                          for a, e in ((10, 200.0), (98, 1e15 + 200.0))])
    assert store.flush()
    [t] = tag_summary([str(tmp_path / "n")]).to_pylist()
    assert t["windows"] == 2 and t["counted_windows"] == 1 and t["invalid_interval_windows"] == 1
    assert t["gpu_j_per_token"] == pytest.approx(2.0)
    said = " ".join(" ".join(tag_notes(tag_summary([str(tmp_path / "n")]))).split())
    assert "node-0 exp: 1 of 2" in said and "interval left out" in said, said


def test_tag_windows_whose_edges_may_be_off_are_left_out_of_their_tag_and_said(tmp_path):
    # A window whose row says edges-late (its edges' energy may be off past the tolerance, here by any amount) or
    # edges-unheld was counted in its tag's figures with nothing said: one clean 2.0 J/token window beside an
    # edges-late one read 2 of 2 counted, 4.0 J/token, no note (the hostile review's repro_analyze.py).
    _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("tags", [{"daemon_id": "d0", "name": "exp", "t_start_utc": T0_NS + a * 10**9,
                           "t_end_utc": T0_NS + (a + 5) * 10**9, "duration_s": 5.0, "gpu_energy_j": e,
                           "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete",
                           "energy_note": note}
                          for a, e, note in (
                              (10, 200.0, None),
                              (20, 600.0, "edges-late: ... gpu_energy_j and gpu_j_per_token may be off by any amount"),
                              (30, 900.0, "estimated from power readings; edges-unheld: a GPU's energy counter did not "
                                          "move within 0.3 s"))]
                 # a tag named like a flag, said in its closed-at-shutdown note's fix: counted, its name not read
                 + [{"daemon_id": "d0", "name": "x; edges-late: y", "t_start_utc": T0_NS + 40 * 10**9,
                     "t_end_utc": T0_NS + 45 * 10**9, "duration_s": 5.0, "gpu_energy_j": 300.0,
                     "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete",
                     "energy_note": "closed at shutdown: the daemon stopped ...; fix: powerprof tag stop x; edges-late: "
                                    "y before stopping the daemon"}])
    assert store.flush()
    t, named = tag_summary([str(tmp_path / "n")]).to_pylist()
    assert named["counted_windows"] == 1 and named["edges_uncertain_windows"] == 0, named
    assert t["windows"] == 3 and t["counted_windows"] == 1 and t["edges_uncertain_windows"] == 2, t
    assert t["gpu_j_per_token"] == pytest.approx(2.0) and t["edges_uncertain_gpu_energy_j"] == pytest.approx(1500.0)
    said = " ".join(" ".join(tag_notes(tag_summary([str(tmp_path / "n")]))).split())
    assert "node-0 exp: 2 of 3, 1500.0 J" in said and "edges-late" in said and "edges-unheld" in said, said


def _hostile_fleet(root: Path) -> Path:
    """8 nodes; node-2 and node-5 hold a row each rule of `powerprof fleet` leaves out of a figure."""
    for k in range(NODES):
        _node(root / f"node-{k}", k)
    for k, t in ((2, 100), (5, 200)):
        store = DatasetStore(root / f"node-{k}", datasets(), host=f"node-{k}")
        iv = lambda s, e, d=1.0: {"daemon_id": f"d{k}", "t_start_utc": T0_NS + s * 10**9, "t_end_utc": T0_NS + int((s + d) * 10**9),  # noqa: E731
                                  "duration_s": d, "kind": "decode", "gpu_energy_j": e}
        store.append("intervals", [iv(t, 1e15), iv(t + 10, float("nan")), iv(t + 20, -5.0), iv(t + 30, 50.0, 0.0),
                                   iv(t + 40, 400.0)])
        rq = lambda i, a, e, energy=50.0, tokens=100.0, note=None: {  # noqa: E731
            "daemon_id": f"d{k}", "request_id": 1000 + i, "t_arrival_utc": T0_NS + int(a * 10**9),
            "t_end_utc": T0_NS + int(e * 10**9), "outcome": "ok", "generated_tokens": 100, "gpu_energy_j": energy,
            "attributed_tokens": tokens, "ttft_s": 0.1, "energy_note": note}
        store.append("requests", [
            rq(0, t - 0.5, t + 0.5, energy=3e14), rq(1, t + 10.2, t + 10.4), rq(2, t + 29.0, t + 31.0),
            rq(3, t + 40.1, t + 40.9, energy=float("nan")), rq(4, t + 40.1, t + 40.9, tokens=-1.0),
            rq(5, t + 40.1, t + 40.9, energy=None), rq(6, t + 40.1, t + 40.9, note="no-counter-short: 90% ..."),
            rq(7, t + 40.1, t + 40.9, note="approximate: x; bypass-uncounted: late"),
            rq(8, t + 40.1, t + 40.9, energy=0.1, note="before-first-read: 0.5 s"),
            rq(9, t + 40.1, t + 40.9, energy=200.0),  # the one more request measured whole: kept
            rq(10, t + 40.1, t + 40.9, energy=400.0, note="approximate: x; uncertain-uncounted: a scrape 0.03 s")])
        assert store.flush()
    return root


def _docs_query(name: str) -> str:
    doc = (ROOT / "docs" / "fleet.md").read_text()
    return re.search(rf"```{name}\n(.*?)```", doc, re.S).group(1)


def _rows_of(con, sql) -> dict:
    rows = con.execute(sql).fetchall()
    cols = [d[0] for d in con.description]
    return {r[0]: dict(zip(cols, r)) for r in rows}


def test_the_documented_queries_apply_the_summarys_rules(tmp_path):
    # docs/fleet.md's hand-written queries summed every row: a NaN interval made a host's energy NaN, the 1e15 J one
    # printed 277777777 kWh, and flagged, unknown-energy and over-bound-interval requests fed J/token. Run as written
    # over 8 nodes, two of them holding such rows, they give `powerprof fleet`'s figures; the Spark SQL / Trino
    # statement is run by DuckDB over views named as its tables.
    base = _hostile_fleet(tmp_path / "fleet")
    code = {r["host"]: r for r in fleet_summary([str(base / "node-*")]).to_pylist()}
    assert code["node-2"]["invalid_intervals"] == 4 and code["node-2"]["invalid_interval_requests"] == 3
    con = duckdb.connect()
    got = {"duckdb": _rows_of(con, _docs_query("sql duckdb").replace("/var/lib/powerprof-fleet", str(base)))}
    for t in ("requests", "intervals"):
        con.execute(f"CREATE VIEW pp_{t} AS SELECT * FROM read_parquet('{base}/*/{t}/**/*.parquet', "
                    "hive_partitioning = false, union_by_name = true)")
    got["spark"] = _rows_of(con, _docs_query("sql spark"))
    for engine, rows in got.items():
        assert sorted(rows) == sorted(code), engine
        for host, r in rows.items():
            c = code[host]
            for col in ("requests", "generated_tokens", "gpu_energy_j", "idle_gpu_energy_j", "gpu_j_per_token"):
                assert r[col] == pytest.approx(c[col]), (engine, host, col, r[col], c[col])
            assert r["intervals_left_out"] == c["invalid_intervals"], (engine, host)


def test_analyze_of_a_fleet_folder_names_its_datasets_and_the_glob(tmp_path):
    # `analyze fleet`, a folder holding one dataset per node (as docs/fleet.md lays them out), said only
    # "windows.parquet is missing".
    for k in range(2):
        _node(tmp_path / "fleet" / f"node-{k}", k)
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "fleet")])
    assert r.exit_code != 0 and "holds daemon datasets (node-0, node-1)" in r.output, r.output
    assert f"powerprof analyze '{tmp_path / 'fleet'}/*'" in r.output and "windows.parquet is missing" not in r.output
    ok = CliRunner().invoke(main, ["analyze", str(tmp_path / "fleet" / "*")])  # the glob it gives works
    assert ok.exit_code == 0 and "all 2 hosts" in ok.stdout, ok.output


def test_the_share_a_j_per_token_rests_on_never_rounds_to_all_or_none():
    # 99.6% printed "100%" beside a footnote that said requests were left out.
    from powerprof.analysis.fleet import render_summary

    def row(att_tok, tok):
        return {"host": "h", "requests": 10, "generated_tokens": tok, "gpu_energy_j": 100.0, "idle_gpu_energy_j": 1.0,
                "gpu_j_per_token": 0.5, "attributed_tokens": att_tok, "attributed_gpu_energy_j": 0.5 * att_tok}

    for att, tok, said in ((996.0, 1000, ">99%"), (4.0, 1000, "<1%"), (500.0, 1000, "50%"), (1000.0, 1000, "100%")):
        first = render_summary(pa.Table.from_pylist([row(att, tok)])).splitlines()[1].split()
        assert first[-2] == said, (att, first)


def test_the_summaries_times_are_utc_whatever_the_sessions_zone(tmp_path, monkeypatch):
    # fleet.parquet's and fleet_tags.parquet's t_first_utc, t_last_utc came out `timestamp[us, tz=Etc/UTC]`: DuckDB's
    # session zone, the host's (`Asia/Tokyo` under TZ=Asia/Tokyo), where every other powerprof file has `tz=UTC`.
    from contextlib import contextmanager
    from datetime import datetime, timezone

    from powerprof.analysis import fleet as fleet_module

    real = fleet_module.connect

    @contextmanager
    def in_tokyo(*args, **kwargs):
        with real(*args, **kwargs) as con:
            con.execute("SET TimeZone = 'Asia/Tokyo'")
            yield con

    monkeypatch.setattr(fleet_module, "connect", in_tokyo)
    _node(tmp_path / "n", 0)
    store = DatasetStore(tmp_path / "n", datasets(), host="node-0")
    store.append("tags", [{"daemon_id": "d0", "name": "exp", "t_start_utc": T0_NS + 10 * 10**9,
                           "t_end_utc": T0_NS + 15 * 10**9, "duration_s": 5.0, "gpu_energy_j": 200.0,
                           "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete"}])
    assert store.flush()
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "n"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    utc = pa.timestamp("us", tz="UTC")

    def at(s):
        return datetime.fromtimestamp(T0_NS // 10**9 + s, timezone.utc)

    for name, first, last in (("fleet", at(0), at(40)), ("fleet_tags", at(10), at(15))):
        t = pq.read_table(tmp_path / "out" / f"{name}.parquet")
        assert [t.schema.field(c).type for c in ("t_first_utc", "t_last_utc")] == [utc, utc], (name, t.schema)
        assert (t.column("t_first_utc")[0].as_py(), t.column("t_last_utc")[0].as_py()) == (first, last), name


def test_the_summary_says_which_idle_share_it_prints_within_80_columns(fleet):
    # `idle %` is the intervals of kind idle, whole (idle_gpu_energy_j); the intervals' idle_energy_j summed adds the
    # idle time inside busy ones and reads higher (3.45% beside 3.3%): nothing said which the table printed.
    from powerprof.analysis.fleet import render_summary

    base, _ = fleet
    out = render_summary(fleet_summary([str(base / "node-*")]))
    assert all(len(line) <= 80 for line in out.splitlines()), out
    said = " ".join(out.split())
    assert "idle %: the GPU energy of intervals with nothing live (kind idle), whole" in said, out
    assert "idle_energy_j summed adds the idle time in busy ones" in said, out


GPU_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def _daemon_rows(root: Path, daemon: str, gpus: str | None, t0_s: float, n: int, interval_j: float,
                 request_j: float) -> None:
    """One daemon's rows on host `vm` (its GPU set `gpus`, None: written before gpu_uuids): n one-second intervals
    from t0_s, one request of 10 tokens in each."""
    store = DatasetStore(root, datasets(), host="vm", gpu_uuids=gpus)
    t0 = T0_NS + int(t0_s * 10**9)
    store.append("requests", [{"daemon_id": daemon, "request_id": i, "t_arrival_utc": t0 + i * 10**9,
                               "t_end_utc": t0 + i * 10**9 + 5 * 10**8, "outcome": "ok", "generated_tokens": 10,
                               "gpu_energy_j": request_j, "attributed_tokens": 10.0, "ttft_s": 0.1,
                               "energy_note": None} for i in range(n)])
    store.append("intervals", [{"daemon_id": daemon, "t_start_utc": t0 + i * 10**9, "t_end_utc": t0 + (i + 1) * 10**9,
                                "t_start_mono_s": float(i), "duration_s": 1.0, "kind": "decode",
                                "gpu_energy_j": interval_j, "server_count": "off"} for i in range(n)])
    assert store.flush()


def test_daemons_on_different_gpu_sets_of_one_host_are_a_row_each_not_one_blend(tmp_path):
    # One host: a daemon on GPU B (15.6 J/token), then one on GPUs A and B (31.3 J/token), one after the other. Before:
    # one row `vm` whose J/token, 23.4, was neither's, and no note.
    _daemon_rows(tmp_path / "d1", "one", GPU_B, 0, 6, 200.0, 156.0)
    _daemon_rows(tmp_path / "d2", "two", f"{GPU_A},{GPU_B}", 100, 6, 400.0, 313.0)
    rows = {r["host"]: r for r in fleet_summary([str(tmp_path / "d1"), str(tmp_path / "d2")]).to_pylist()}
    assert sorted(rows) == ["vm [GPU-aaaaaaaa GPU-bbbbbbbb]", "vm [GPU-bbbbbbbb]"]
    assert rows["vm [GPU-bbbbbbbb]"]["gpu_j_per_token"] == pytest.approx(15.6)
    assert rows["vm [GPU-aaaaaaaa GPU-bbbbbbbb]"]["gpu_j_per_token"] == pytest.approx(31.3)
    assert not any(r["double_counted_intervals"] for r in rows.values())
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "d1"), str(tmp_path / "d2")])
    assert res.exit_code == 0, res.output
    assert "a row per set" in res.output and "double counting" not in res.output
    assert "all 1 host (2 GPU sets)" in res.output  # the total line: one machine, not "all 2 hosts"


def test_two_daemons_at_once_on_a_shared_gpu_are_said_to_count_it_twice(tmp_path):
    # Two daemons over the same 30 s, both sampling GPU B. Before: hours and energy summed from both, unsaid.
    _daemon_rows(tmp_path / "d3", "three", GPU_B, 0, 30, 200.0, 150.0)
    _daemon_rows(tmp_path / "d4", "four", f"{GPU_A},{GPU_B}", 0.5, 30, 400.0, 300.0)
    rows = {r["host"]: r for r in fleet_summary([str(tmp_path / "d3"), str(tmp_path / "d4")]).to_pylist()}
    assert rows["vm [GPU-bbbbbbbb]"]["double_counted_intervals"] == 30
    assert rows["vm [GPU-aaaaaaaa GPU-bbbbbbbb]"]["double_counted_intervals"] == 30
    assert rows["vm [GPU-bbbbbbbb]"]["double_counted_gpu_energy_j"] == pytest.approx(6000.0)
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "d3"), str(tmp_path / "d4")])
    assert res.exit_code == 0, res.output
    assert "double counting" in res.output and "three,four" in res.output.replace("four,three", "three,four")


def test_two_daemons_at_once_on_disjoint_gpus_count_nothing_twice(tmp_path):
    _daemon_rows(tmp_path / "d3", "three", GPU_A, 0, 10, 200.0, 150.0)
    _daemon_rows(tmp_path / "d4", "four", GPU_B, 0.5, 10, 200.0, 150.0)
    rows = fleet_summary([str(tmp_path / "d3"), str(tmp_path / "d4")]).to_pylist()
    assert len(rows) == 2 and not any(r["double_counted_intervals"] for r in rows)


def _label(host: str, gpu_uuids: str | None) -> str:
    """`analyze`'s row name for a host and GPU set: each UUID to its first 8 hex digits (GPU-aaaaaaaa)."""
    return host + (f" [{' '.join(u[:12] for u in gpu_uuids.split(','))}]" if gpu_uuids else "")


def test_the_documented_queries_give_a_row_per_gpu_set_of_a_host(tmp_path):
    # One host, two daemons at once on GPU A and on GPU B (nothing shared), GPU A's with an interval left out (1e15 J)
    # over 3.2-3.3 s, GPU B's with a request of its own over that time. docs/fleet.md's queries grouped by host alone:
    # one row `vm` blending both sets' energy and J/token, and GPU B's request left out of J/token for GPU A's interval.
    # Run as written, each gives `powerprof fleet`'s row per set.
    _daemon_rows(tmp_path / "fleet" / "a", "one", GPU_A, 0, 6, 200.0, 150.0)
    _daemon_rows(tmp_path / "fleet" / "b", "two", GPU_B, 0, 6, 400.0, 300.0)
    store = DatasetStore(tmp_path / "fleet" / "a", datasets(), host="vm", gpu_uuids=GPU_A)
    store.append("intervals", [{"daemon_id": "one", "t_start_utc": T0_NS + 32 * 10**8, "t_end_utc": T0_NS + 33 * 10**8,
                                "t_start_mono_s": 3.2, "duration_s": 0.1, "kind": "decode", "gpu_energy_j": 1e15,
                                "server_count": "off"}])
    assert store.flush()
    store = DatasetStore(tmp_path / "fleet" / "b", datasets(), host="vm", gpu_uuids=GPU_B)
    store.append("requests", [{"daemon_id": "two", "request_id": 99, "t_arrival_utc": T0_NS + 31 * 10**8,
                               "t_end_utc": T0_NS + 34 * 10**8, "outcome": "ok", "generated_tokens": 10,
                               "gpu_energy_j": 900.0, "attributed_tokens": 10.0, "ttft_s": 0.1, "energy_note": None}])
    assert store.flush()
    base = tmp_path / "fleet"
    code = {r["host"]: r for r in fleet_summary([str(base / "*")]).to_pylist()}
    assert sorted(code) == ["vm [GPU-aaaaaaaa]", "vm [GPU-bbbbbbbb]"]
    assert code["vm [GPU-aaaaaaaa]"]["invalid_interval_requests"] == 1  # GPU A's request 3
    assert code["vm [GPU-bbbbbbbb]"]["invalid_interval_requests"] == 0
    assert code["vm [GPU-bbbbbbbb]"]["gpu_j_per_token"] == pytest.approx((6 * 300.0 + 900.0) / 70.0)
    con = duckdb.connect()
    duck = _docs_query("sql duckdb").replace("/var/lib/powerprof-fleet", str(base))
    got = {"duckdb": con.execute(duck).fetchall()}
    cols = {"duckdb": [d[0] for d in con.description]}
    for t in ("requests", "intervals"):
        con.execute(f"CREATE VIEW pp_{t} AS SELECT * FROM read_parquet('{base}/*/{t}/**/*.parquet', "
                    "hive_partitioning = false, union_by_name = true)")
    got["spark"] = con.execute(_docs_query("sql spark")).fetchall()
    cols["spark"] = [d[0] for d in con.description]
    for engine, rows in got.items():
        rows = [dict(zip(cols[engine], r)) for r in rows]
        by = {_label(r["host"], r.get("gpu_uuids")): r for r in rows}
        assert len(by) == len(rows) and sorted(by) == sorted(code), (engine, rows)
        for label, r in by.items():
            c = code[label]
            for col in ("requests", "generated_tokens", "gpu_energy_j", "idle_gpu_energy_j", "gpu_j_per_token"):
                assert r[col] == pytest.approx(c[col]), (engine, label, col, r[col], c[col])
            assert r["intervals_left_out"] == c["invalid_intervals"], (engine, label)
            assert r["requests_out_of_j_per_token"] == c["invalid_interval_requests"], (engine, label)


def _as_before_gpu_uuids(folder: Path) -> None:
    """Rewrite a daemon folder's files as an older daemon wrote them: no gpu_uuids column at all."""
    for f in folder.rglob("*.parquet"):
        t = pq.read_table(f)
        if "gpu_uuids" in t.column_names:
            pq.write_table(t.drop_columns(["gpu_uuids"]), f)


def _samples(root: Path, daemon: str, gpus: list[str]) -> None:
    """The samples a daemon wrote beside its rows (host `vm`): one nvml row per GPU it sampled, with its UUID."""
    store = DatasetStore(root, datasets(), host="vm")
    store.append("samples", [{"daemon_id": daemon, "time_utc": T0_NS, "t_mono_s": 0.0, "seq": 0, "source": "nvml",
                              "device": f"gpu{i}", "gpu_index": i, "gpu_uuid": g, "power_w": 70.0}
                             for i, g in enumerate(gpus)])
    assert store.flush()


def test_rows_written_before_gpu_uuids_are_read_and_their_gpu_set_said_unknown(tmp_path):
    # Two daemons at once whose GPUs nothing says (no gpu_uuids, no samples). Before: their 20 overlapping intervals
    # were counted in double_counted_intervals and said to "count it twice", a false alarm where each had its own GPU.
    _daemon_rows(tmp_path / "d3", "three", None, 0, 10, 200.0, 150.0)
    _daemon_rows(tmp_path / "d4", "four", None, 0.5, 10, 200.0, 150.0)
    _as_before_gpu_uuids(tmp_path)
    (row,) = fleet_summary([str(tmp_path / "d3"), str(tmp_path / "d4")]).to_pylist()
    assert row["host"] == "vm" and row["gpu_set_unknown_intervals"] == 20
    assert row["double_counted_intervals"] == 0
    assert row["maybe_double_counted_intervals"] == 20  # two daemons at once, their GPUs unknown: they may share one
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "d3"), str(tmp_path / "d4")])
    assert res.exit_code == 0, res.output
    assert "GPU set unknown" in res.output and "may count a GPU twice" in res.output
    assert "double counting:" not in res.output


def test_rows_written_before_gpu_uuids_take_their_gpu_set_from_the_daemons_samples(tmp_path):
    # The same two daemons, each on a GPU of its own, their samples beside: each GPU set is read from them. Before: one
    # row `vm`, 20 intervals said to count a GPU twice.
    _daemon_rows(tmp_path / "d3", "three", None, 0, 10, 200.0, 150.0)
    _daemon_rows(tmp_path / "d4", "four", None, 0.5, 10, 200.0, 150.0)
    _samples(tmp_path / "d3", "three", [GPU_A])
    _samples(tmp_path / "d4", "four", [GPU_B])
    _as_before_gpu_uuids(tmp_path)
    rows = {r["host"]: r for r in fleet_summary([str(tmp_path / "d3"), str(tmp_path / "d4")]).to_pylist()}
    assert sorted(rows) == ["vm [GPU-aaaaaaaa]", "vm [GPU-bbbbbbbb]"]
    assert all(r["gpu_set_unknown_intervals"] == 0 and r["double_counted_intervals"] == 0
               and r["maybe_double_counted_intervals"] == 0 for r in rows.values())
    assert all(r["gpu_j_per_token"] == pytest.approx(15.0) for r in rows.values())


def test_an_upgraded_hosts_old_rows_join_its_new_ones_of_the_same_gpu_set(tmp_path):
    # One host, the same daemon.gpus before and after an upgrade: old rows (no gpu_uuids), then new ones on GPU B.
    # Before: two rows `vm` and `vm [GPU-bbbbbbbb]`, said to be "different GPU sets" though the set was the same.
    _daemon_rows(tmp_path / "old", "old", None, 0, 6, 200.0, 150.0)
    _as_before_gpu_uuids(tmp_path / "old")
    _daemon_rows(tmp_path / "new", "new", GPU_B, 100, 6, 200.0, 150.0)
    src = [str(tmp_path / "old"), str(tmp_path / "new")]
    # Without the old daemon's samples its set stays unknown: said by that note, not as a different set.
    res = CliRunner().invoke(main, ["analyze", *src])
    assert res.exit_code == 0, res.output
    assert "GPU set unknown" in res.output and "different GPU sets" not in res.output
    assert "all 1 host (1 GPU set, 1 unknown)" in res.output  # before: "(2 GPU sets)"
    _samples(tmp_path / "old", "old", [GPU_B])
    (row,) = fleet_summary(src).to_pylist()
    assert row["host"] == "vm [GPU-bbbbbbbb]" and row["requests"] == 12 and row["gpu_set_unknown_intervals"] == 0
    res = CliRunner().invoke(main, ["analyze", *src])
    assert res.exit_code == 0, res.output
    assert "different GPU sets" not in res.output and "GPU set unknown" not in res.output


def _cost_fit(root: Path, daemon: str, gpus: str | None, t_s: float, limits: str, locks: str = "") -> None:
    """One fit of the work model as the daemon's ledger emits it (Ledger._costs_row's columns), written by the daemon's
    store on host `vm` with its GPU set `gpus`."""
    store = DatasetStore(root, datasets(), host="vm", gpu_uuids=gpus)
    store.append("costs", [{"daemon_id": daemon, "time_utc": T0_NS + int(t_s * 10**9), "power_limits_w": limits,
                            "sm_clock_locks_mhz": locks,
                            "n_intervals": 900, "n_busy": 600, "r2": 0.97, "rel_rmse": 0.04, "mature": True,
                            "not_mature_reason": None, "idle_w": 70.0, "step_j": 0.5, "decode_j": 0.3,
                            "prefill_j": 0.02, "ctx_j_per_ktoken": 0.01}])
    assert store.flush()


def test_cost_fits_carry_their_gpu_set_and_older_ones_read_it_as_null(tmp_path):
    # Two daemons on one host, GPU B and GPUs A+B, each fitting its costs at 300 W: their costs rows said no GPU set,
    # so a fit joined to the requests or intervals of one set could as well be the other's (both `vm`, both "300").
    # Beside them a fit written before the column: read whole, its set null (unknown), as the other datasets' are.
    _cost_fit(tmp_path / "d1", "one", GPU_B, 0, "300")
    _cost_fit(tmp_path / "d2", "two", f"{GPU_A},{GPU_B}", 0, "300,300")
    _cost_fit(tmp_path / "old", "old", None, 50, "300")
    _as_before_gpu_uuids(tmp_path / "old")
    (old,) = (tmp_path / "old" / "costs").rglob("*.parquet")
    assert "gpu_uuids" not in pq.read_schema(old).names
    paths = export([str(tmp_path / d) for d in ("d1", "d2", "old")], "parquet", tmp_path / "out")
    costs = {p.stem: pq.read_table(p) for p in paths}["costs"]
    got = {r["daemon_id"]: r["gpu_uuids"] for r in costs.to_pylist()}
    assert got == {"one": GPU_B, "two": f"{GPU_A},{GPU_B}", "old": None}, got
    # The column as the other datasets' have it: same type, same value as the daemon's intervals rows.
    from powerprof.storage.schema import DAEMON_TABLES

    assert DAEMON_TABLES["costs"].field("gpu_uuids") == DAEMON_TABLES["intervals"].field("gpu_uuids")


def test_cost_fits_carry_their_clock_locks_and_older_ones_read_them_as_null(tmp_path):
    # A locked fit and an unlocked one at the same limits (idle 99.7 and 78 W on the simulated H200) were one "300"
    # setting in the stored rows. Now sm_clock_locks_mhz tells them apart; a file written before the column reads null.
    _cost_fit(tmp_path / "d1", "one", GPU_B, 0, "300", "1395")
    _cost_fit(tmp_path / "d2", "two", GPU_B, 0, "300")
    _cost_fit(tmp_path / "old", "old", GPU_B, 50, "300")
    for f in (tmp_path / "old").rglob("*.parquet"):
        pq.write_table(pq.read_table(f).drop_columns(["sm_clock_locks_mhz"]), f)
    paths = export([str(tmp_path / d) for d in ("d1", "d2", "old")], "parquet", tmp_path / "out")
    costs = {p.stem: pq.read_table(p) for p in paths}["costs"]
    got = {r["daemon_id"]: r["sm_clock_locks_mhz"] for r in costs.to_pylist()}
    assert got == {"one": "1395", "two": "", "old": None}, got


def test_the_overlap_count_is_every_interval_overlapping_another_daemons_as_matched_pair_by_pair():
    # _overlaps matches by a merge (ASOF on the other daemon's running latest end), not pair by pair (quadratic: 80k
    # intervals a daemon took 27 s): the same intervals and energy as every pair compared, on intervals that touch at
    # their edges (no overlap), overlap one another within a daemon, repeat a start, or lack an end.
    import random

    from powerprof.analysis.fleet import _overlaps
    rnd = random.Random(7)
    rows = []
    for d in ("one", "two"):
        for _ in range(300):
            s = rnd.randrange(0, 2000)
            e = None if rnd.random() < 0.03 else s + rnd.choice([0, 1, 3, 10, 40])
            rows.append(("vm", d, "GPU-b", s, e, float(rnd.randrange(1, 100))))
    con = duckdb.connect()
    con.execute("CREATE TABLE iv (host VARCHAR, daemon_id VARCHAR, gpu_uuids VARCHAR, t_start_utc BIGINT, "
                "t_end_utc BIGINT, gpu_energy_j DOUBLE)")
    con.executemany("INSERT INTO iv VALUES (?, ?, ?, ?, ?, ?)", rows)
    got, maybe = _overlaps(con, "iv")
    assert not maybe
    def hit(x, other):
        return x[4] is not None and any(y[4] is not None and y[3] < x[4] and x[3] < y[4] for y in other)
    one = [r for r in rows if r[1] == "one"]
    two = [r for r in rows if r[1] == "two"]
    want = [r for r in one if hit(r, two)] + [r for r in two if hit(r, one)]
    assert got["vm"][0] == len(want) > 0
    assert got["vm"][1] == pytest.approx(sum(r[5] for r in want))


def test_tag_windows_written_before_gpu_uuids_are_counted_as_every_sampled_gpus_energy(tmp_path):
    # A tag's windows written before gpu_uuids hold every sampled GPU's energy; the daemon now writes the serving GPUs'.
    # Before: both summed into one J/token, unsaid.
    def tag(root, daemon, gpus, t0, e):
        store = DatasetStore(root, datasets(), host="vm", gpu_uuids=gpus)
        store.append("tags", [{"daemon_id": daemon, "name": "exp", "t_start_utc": T0_NS + t0 * 10**9,
                               "t_end_utc": T0_NS + (t0 + 5) * 10**9, "duration_s": 5.0, "gpu_energy_j": e,
                               "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete"}])
        assert store.flush()
    tag(tmp_path / "old", "old", None, 10, 280.0)
    _as_before_gpu_uuids(tmp_path / "old")
    _samples(tmp_path / "old", "old", [GPU_A, GPU_B])
    tag(tmp_path / "new", "new", f"{GPU_A},{GPU_B}", 100, 200.0)
    src = [str(tmp_path / "old"), str(tmp_path / "new")]
    (t,) = tag_summary(src).to_pylist()
    assert t["counted_windows"] == 2 and t["all_gpus_windows"] == 1
    said = " ".join(tag_notes(tag_summary(src)))
    assert "written before gpu_uuids" in said and "every sampled GPU's energy" in said and "vm [GPU-aaaaaaaa GPU-bbbbbbbb] exp: 1 of 2 counted" in said


def test_unreadable_samples_leave_old_rows_gpu_sets_unknown_and_are_named(tmp_path):
    # One junk file among the samples, old rows (no gpu_uuids) beside. Before: fleet, analyze and tag failed entirely
    # ("cannot read the datasets ...: No magic bytes found"), though fleet never needs the samples but for old rows' sets.
    _daemon_rows(tmp_path / "d3", "three", None, 0, 10, 200.0, 150.0)
    _as_before_gpu_uuids(tmp_path)
    _samples(tmp_path / "d3", "three", [GPU_A])
    (good,) = sorted((tmp_path / "d3").rglob("samples/**/*.parquet"))
    (good.parent / "zz-broken.parquet").write_bytes(b"not parquet at all")
    t = fleet_summary([str(tmp_path / "d3")])
    (row,) = t.to_pylist()
    assert row["host"] == "vm" and row["gpu_set_unknown_intervals"] == 10 and row["requests"] == 10
    said = " ".join(notes(t))
    assert "samples" in said and "zz-broken.parquet" in said and "unknown" in said
    assert tag_summary([str(tmp_path / "d3")]).num_rows == 0
    res = CliRunner().invoke(main, ["analyze", str(tmp_path / "d3")])
    assert res.exit_code == 0, res.output
    assert res.output.count("zz-broken.parquet") == 1  # one note, not one from the rows and one from the tags



def _old_tag(root, daemon, t0, e):
    store = DatasetStore(root, datasets(), host="vm")
    store.append("tags", [{"daemon_id": daemon, "name": "exp", "t_start_utc": T0_NS + t0 * 10**9,
                           "t_end_utc": T0_NS + (t0 + 5) * 10**9, "duration_s": 5.0, "gpu_energy_j": e,
                           "unproxied_energy_j": 0.0, "proxy_tokens": 100.0, "server_count": "complete"}])
    assert store.flush()
    _as_before_gpu_uuids(root)


def test_an_old_tag_window_on_a_one_gpu_host_is_no_false_alarm(tmp_path):
    # Written before gpu_uuids, its samples saying one GPU: every sampled GPU's energy IS the serving GPU's. Before:
    # all_gpus_windows 1 and the note that its J/token reads high.
    _old_tag(tmp_path / "old", "old", 10, 200.0)
    _samples(tmp_path / "old", "old", [GPU_A])
    (t,) = tag_summary([str(tmp_path / "old")]).to_pylist()
    assert t["host"] == "vm [GPU-aaaaaaaa]" and t["counted_windows"] == 1
    assert t["all_gpus_windows"] == 0 and t["maybe_all_gpus_windows"] == 0
    assert not any("every sampled GPU" in n for n in tag_notes(tag_summary([str(tmp_path / "old")])))


def test_an_old_tag_window_of_unknown_gpu_set_may_read_high(tmp_path):
    # No samples: the set is unknown, so the window may hold a GPU serving none of the work: said as "may".
    _old_tag(tmp_path / "old", "old", 10, 200.0)
    (t,) = tag_summary([str(tmp_path / "old")]).to_pylist()
    assert t["all_gpus_windows"] == 0 and t["maybe_all_gpus_windows"] == 1
    said = " ".join(tag_notes(tag_summary([str(tmp_path / "old")])))
    assert "may read high" in said and "vm exp: 1 of 1 counted" in said


def test_analyze_out_into_a_nodes_own_dataset_folder_is_refused(tmp_path):
    # fleet.parquet written among a node's dataset folders made `export` of that folder read it alone: the requests,
    # intervals and samples left out, exit 0, unsaid.
    node = tmp_path / "node-1"
    _node(node, 1)
    r = CliRunner().invoke(main, ["analyze", str(node), "--out", str(node)])
    assert r.exit_code != 0 and "daemon's datasets" in r.output, r.output
    assert not (node / "fleet.parquet").exists()


# --- analyze --out of daemon datasets: what is in the folder (review rvA) ------------------------------------------

@pytest.mark.parametrize("name", ["fleet.parquet", "fleet_tags.parquet"])
def test_analyze_out_never_replaces_a_file_it_did_not_write(tmp_path, name):
    # A person's text file out/fleet.parquet was replaced by the summary, exit 0, nothing said; a sweep's analyze
    # refuses files of its names that no analysis wrote (exit 2).
    _node(tmp_path / "node-0", 0)
    _old_tag(tmp_path / "node-0", "d0", 10, 200.0)
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("my precious notes")
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "node-0"), "--out", str(out)])
    assert r.exit_code == 2 and name in r.output and "no powerprof fleet summary" in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == "my precious notes"


def test_analyze_out_replaces_its_own_summary_and_leaves_no_stale_tags(tmp_path):
    # `analyze nodeA --out Y` then `analyze nodeB --out Y` (nodeB without tags) left fleet.parquet of nodeB beside
    # fleet_tags.parquet of nodeA: the pair in one folder from two calls.
    _node(tmp_path / "a", 0)
    _old_tag(tmp_path / "a", "d0", 10, 200.0)
    _node(tmp_path / "b", 1)
    out = tmp_path / "out"
    assert CliRunner().invoke(main, ["analyze", str(tmp_path / "a"), "--out", str(out)]).exit_code == 0
    assert (out / "fleet_tags.parquet").exists()
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "b"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert pq.read_table(out / "fleet.parquet").column("host").to_pylist() == ["node-1"]
    assert sorted(p.name for p in out.iterdir()) == ["fleet.parquet"]
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "a"), "--out", str(out)])  # and back: both replaced
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["fleet.parquet", "fleet_tags.parquet"]


def test_export_of_a_fleet_folder_is_refused_as_analyze_refuses_it(tmp_path):
    # `export fleet` (one dataset per node in it) wrote node-0.csv and node-1.csv, each every table's columns mixed
    # (requests, intervals, samples, tags), with notes of "columns written before they existed", exit 0; `analyze
    # fleet` refused it. A glob whose hit is a symlink back to that folder did the same.
    for k in range(2):
        _node(tmp_path / "fleet" / f"node-{k}", k)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "fleet").symlink_to(tmp_path / "fleet")
    for given in (tmp_path / "fleet", tmp_path / "links" / "*"):
        r = CliRunner().invoke(main, ["export", str(given), "--format", "csv", "--out", str(tmp_path / "x")])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and "holds daemon datasets (node-0, node-1)" in flat, r.output
        assert "powerprof export '" in flat and "/fleet/*'" in flat and "Traceback" not in r.output, r.output
        assert not (tmp_path / "x").exists()
    ok = CliRunner().invoke(main, ["export", str(tmp_path / "fleet" / "*"), "--format", "csv", "--out", str(tmp_path / "x")])
    assert ok.exit_code == 0 and (tmp_path / "x" / "requests.csv").exists(), ok.output


def test_export_of_a_daemon_dataset_beside_a_sweep_run_is_refused_as_analyze_refuses_it(tmp_path):
    # `export nodeA runs/r2` wrote one samples.csv of 240 daemon rows and 309 sweep rows, with a note calling host,
    # daemon_id and simulated "empty in the 309 rows written before those columns existed", exit 0; `analyze` of
    # the same two refuses the mix (exit 1).
    from synthetic_runs import make_run, seed_truth  # noqa: PLC0415

    _node(tmp_path / "node-0", 0)
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    for given in ([tmp_path / "node-0", run], [run, tmp_path / "node-0"]):
        r = CliRunner().invoke(main, ["export", *map(str, given), "--format", "csv", "--out", str(tmp_path / "x")])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and f"{tmp_path / 'node-0'} is a daemon dataset" in flat and str(run) in flat, r.output
        assert "export it on its own" in flat and "Traceback" not in r.output, r.output
        assert not (tmp_path / "x").exists()
        assert CliRunner().invoke(main, ["analyze", *map(str, given)]).exit_code == 1


def test_export_of_a_daemon_dataset_beside_a_sweep_runs_file_is_refused_as_the_folder_is(tmp_path):
    # `export nodeA runs/r2/samples.parquet` (a run's one table, in its folder or copied out of it, whose name is a
    # daemon table's) wrote one samples.csv of both, the run's rows said to lack `host` as "written before the column
    # existed", exit 0; `export runs/r2 nodeA/samples` (the dataset's one table) the same. Refused as `export nodeA
    # runs/r2` is, with the text `analyze` gives the mix.
    import shutil  # noqa: PLC0415

    from synthetic_runs import make_run, seed_truth  # noqa: PLC0415

    _node(tmp_path / "node-0", 0)
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    (tmp_path / "loose").mkdir()
    shutil.copy(run / "samples.parquet", tmp_path / "loose" / "samples.parquet")
    sweep_files = [run / "samples.parquet", run / "windows.parquet", tmp_path / "loose" / "samples.parquet"]
    cases = [([tmp_path / "node-0", f], tmp_path / "node-0", f) for f in sweep_files]
    cases += [([f, tmp_path / "node-0"], tmp_path / "node-0", f) for f in sweep_files[:1]]
    cases += [([run, tmp_path / "node-0" / "samples"], tmp_path / "node-0" / "samples", run)]
    for given, dataset, other in cases:
        r = CliRunner().invoke(main, ["export", *map(str, given), "--format", "csv", "--out", str(tmp_path / "x")])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and f"{dataset} is a daemon dataset" in flat and str(other) in flat, r.output
        assert "export it on its own" in flat and "Traceback" not in r.output, r.output
        assert not (tmp_path / "x").exists()
    # The one text both commands give: `analyze nodeA runs/r2` says it with analyze's command in it.
    r = CliRunner().invoke(main, ["analyze", str(tmp_path / "node-0"), str(run)])
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and f"{tmp_path / 'node-0'} is a daemon dataset, not a sweep's run, given with the sweep run {run}" in flat, r.output
    e = CliRunner().invoke(main, ["export", str(tmp_path / "node-0"), str(run), "--format", "csv", "--out", str(tmp_path / "x")])
    assert " ".join(e.output.split()).replace(": export it", ": analyze it").split(" (powerprof")[0] == flat.split(" (powerprof")[0]
    # A file of the dataset's own, or a Parquet file of another name, is no mix: exported as before.
    part = next((tmp_path / "node-0" / "samples").rglob("*.parquet"))
    for given in ([tmp_path / "node-0", part], [run, part]):
        ok = CliRunner().invoke(main, ["export", *map(str, given), "--format", "csv", "--out", str(tmp_path / "y")])
        assert ok.exit_code == 0, ok.output
        shutil.rmtree(tmp_path / "y")


def test_analyze_names_the_source_that_is_wrong_not_the_dataset_beside_it(tmp_path):
    # `analyze NODE typo` and `analyze NODE emptydir` said "NODE is a daemon dataset, not a sweep's run: analyze it on
    # its own", the bad path never named.
    _node(tmp_path / "node-0", 0)
    (tmp_path / "emptydir").mkdir()
    for bad, said in ((tmp_path / "typo-nonexistent", "no such run directory or daemon data folder"),
                      (tmp_path / "emptydir", "is not a powerprof run directory")):
        r = CliRunner().invoke(main, ["analyze", str(tmp_path / "node-0"), str(bad)])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and f"{bad}" in flat and said in flat, r.output
        assert "is a daemon dataset" not in flat, r.output


def test_analyze_reads_a_file_uri_as_its_folder_and_names_a_uri_it_cannot_read(tmp_path):
    # `analyze file:///…/node` said "file:/…: no such run directory" (the path mangled by Path) while export read it;
    # hdfs:// and a bare s3:// the same way.
    truth = _node(tmp_path / "node-0", 0)
    r = CliRunner().invoke(main, ["analyze", f"file://{tmp_path / 'node-0'}", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    _check(pq.read_table(tmp_path / "a" / "fleet.parquet").to_pylist(), {"node-0": truth})
    for uri, said in (("hdfs://namenode/pp/node-0", "not hdfs://"), ("s3://", "names no bucket"),
                      ("file://otherhost/pp", "another host")):
        r = CliRunner().invoke(main, ["analyze", uri])
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and f"Error: {uri}:" in flat and said in flat, r.output
        assert "no such run directory" not in flat and "Traceback" not in r.output, r.output


def _extension_store(monkeypatch, tmp_path, answers: bool):
    """DuckDB's connections made to fetch extensions from a local port, with no extension installed: a port that takes
    connections and never answers (a network that drops them, a proxy that hangs), or one nothing listens on."""
    import socket  # noqa: PLC0415

    import duckdb  # noqa: PLC0415

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    if answers:
        s.listen(64)
    real = duckdb.connect

    def connect(*a, config=None, **k):
        return real(*a, config={**(config or {}), "extension_directory": str(tmp_path / "ext"),
                                "custom_extension_repository": f"http://127.0.0.1:{s.getsockname()[1]}"}, **k)

    monkeypatch.setattr(duckdb, "connect", connect)
    return s


@pytest.mark.timeout(200)
@pytest.mark.parametrize("hangs", [True, False])
def test_analyze_of_a_uri_without_httpfs_and_network_is_a_clear_error_within_the_limit(tmp_path, monkeypatch, hangs):
    # `analyze gs://…` with httpfs not installed and a network that took connections and never answered (a proxy, a
    # firewall dropping them) said nothing for 2 min 2 s while DuckDB tried to download httpfs, then a 5-line error.
    import time  # noqa: PLC0415

    from powerprof.analysis import engine  # noqa: PLC0415

    store = _extension_store(monkeypatch, tmp_path, answers=hangs)
    monkeypatch.setattr(engine, "HTTPFS_INSTALL_LIMIT_S", 3)
    t0 = time.monotonic()
    with store:
        r = CliRunner().invoke(main, ["analyze", "gs://nobucket-xyz/pp", "--out", str(tmp_path / "a")])
    assert time.monotonic() - t0 < 30
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert flat.startswith("Error: gs://nobucket-xyz/pp: cannot read: DuckDB reads object-store URIs through its httpfs "
                           "extension, not installed here"), r.output
    assert ("did not finish in 3 s" if hangs else "failed (") in flat and "install_extension('httpfs')" in flat, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "a").exists()




def _httpfs_loads() -> bool:
    try:
        duckdb.connect().execute("LOAD httpfs")
        return True
    except duckdb.Error:
        return False


class _StallingS3:
    """A local S3 endpoint that lists one Parquet file under any prefix, then stalls half way through every body:
    a remote that takes the connection and stops sending (a dead peer behind a load balancer, a proxy that hangs)."""

    def __init__(self):
        import http.server  # noqa: PLC0415
        import socketserver  # noqa: PLC0415
        import threading  # noqa: PLC0415

        self.stop = threading.Event()
        data = b"PAR1" + bytes(4096) + b"PAR1"
        stop = self.stop

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _head(self, code, length, extra=()):
                self.send_response(code)
                for k, v in (("Content-Length", str(length)), ("Accept-Ranges", "bytes"), *extra):
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self):
                self._head(200, len(data)) if self.path.split("?")[0].endswith(".parquet") else self._head(404, 0)

            def do_GET(self):
                from urllib.parse import parse_qs, urlsplit  # noqa: PLC0415

                q = parse_qs(urlsplit(self.path).query)
                if "list-type" in q:
                    key = q.get("prefix", [""])[0] + "date=2026-01-01/part-0.parquet"
                    body = ("<?xml version='1.0' encoding='UTF-8'?><ListBucketResult><Name>b</Name><KeyCount>1</KeyCount>"
                            "<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated><Contents><Key>" + key + "</Key>"
                            f"<LastModified>2026-01-01T00:00:00.000Z</LastModified><Size>{len(data)}</Size></Contents>"
                            "</ListBucketResult>").encode()
                    self._head(200, len(body), (("Content-Type", "application/xml"),))
                    self.wfile.write(body)
                    return
                body = data
                if rng := self.headers.get("Range"):
                    a, b = rng.split("=")[1].split("-")
                    body = data[int(a):int(b) + 1]
                self._head(206 if rng else 200, len(body))
                self.wfile.write(body[:len(body) // 2])
                self.wfile.flush()
                stop.wait(120)  # the rest never comes

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not _httpfs_loads(), reason="DuckDB's httpfs extension is not installed here")
def test_analyze_of_a_uri_whose_remote_stalls_mid_body_is_a_clear_error_within_the_limit(tmp_path, monkeypatch):
    # A remote that took the connection and stopped sending mid-body held `analyze s3://…` for DuckDB's own bound
    # (http_timeout 30 s, 3 retries with backoff: over 2 min), then said "IO Error: Failed to read connection": not
    # what timed out, nor what to do. Now powerprof sets the bound itself and names it, the URI and the fix.
    import time  # noqa: PLC0415

    from powerprof.analysis import engine  # noqa: PLC0415

    monkeypatch.setattr(engine, "HTTP_TIMEOUT_S", 2, raising=False)
    real = engine.httpfs_refusal
    with _StallingS3() as s3:

        def local_s3(con):
            why = real(con)
            for setting in (f"s3_endpoint = '127.0.0.1:{s3.server.server_address[1]}'", "s3_use_ssl = false",
                            "s3_url_style = 'path'", "s3_region = 'us-east-1'"):
                con.execute(f"SET {setting}")
            return why

        monkeypatch.setattr(engine, "httpfs_refusal", local_s3)
        t0 = time.monotonic()
        r = CliRunner().invoke(main, ["analyze", "s3://b/ds", "--out", str(tmp_path / "a")])
        took = time.monotonic() - t0
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert flat.startswith("Error: s3://b/ds: cannot read: the remote stopped sending (nothing for 2 s"), r.output
    assert "copy the dataset to a local folder" in flat, r.output
    assert took < 30, took
    assert not (tmp_path / "a").exists()


def test_httpfs_reads_are_bounded_once_it_loads_and_a_stall_is_said_as_such():
    # Where httpfs is not installed (CI: no network) the stalling-remote test above is skipped; this runs everywhere.
    from powerprof.analysis import engine  # noqa: PLC0415

    class Con:
        def __init__(self):
            self.said = []

        def execute(self, sql):
            self.said.append(sql)
            return self

    con = Con()
    assert engine.httpfs_refusal(con) is None
    assert con.said == ["LOAD httpfs", f"SET http_timeout = {engine.HTTP_TIMEOUT_S}",
                        f"SET http_retries = {engine.HTTP_RETRIES}"]
    why = "IO Error: Failed to read connection error for HTTP GET to 'http://h/x.parquet'"
    said = engine.http_stall_refusal(why)
    assert said.startswith("the remote stopped sending (nothing for 30 s, asked 3 times") and said.endswith(
        f"(DuckDB: {why})"), said
    assert engine.http_stall_refusal("Binder Error: Referenced column x not found") is None
    assert engine.http_stall_refusal("IO Error: Connection timed out for 'http://h/x.parquet'") is not None


@pytest.mark.parametrize("why", [
    # DuckDB's own texts (httpfs 1.x) for a missing file and a non-Parquet one, the URI quoted in them: a bucket or
    # folder named "timeout…" made both read "the remote stopped sending (nothing for 30 s …)", the wrong fix.
    'HTTP Error: Unable to connect to URL "http://h/timeout-study/requests/missing.parquet": 404 (Not Found).',
    "Invalid Input Error: No magic bytes found at end of file 's3://gpu-timeouts/x.parquet'",
    "HTTP Error: Request returned HTTP 504 for HTTP HEAD to 'http://timed-out.example/x.parquet'",
    "IO Error: No files found that match the pattern s3://timeouts/failed-to-read-connection/x.parquet",
    # DuckDB's LINE 1 context cuts the SQL's quoted local path short, its quote never closed: the path's "timeouts"
    # read as a stall (b_duckdb_stall.py, session 57's review), a missing local folder said as a remote that stalled.
    'IO Error: No files found that match the pattern "/root/s57/h-rev4/gpu-timeouts/requests/*.parquet"\n\n'
    "LINE 1: SELECT * FROM read_parquet(['/root/s57/h-rev4/gpu-timeouts/requests/*...\n"
    "                      ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "IO Error: Cannot open file '/srv/gpu-timeouts/requests/x.parquet\nsecond line",  # a quote never closed
])
def test_a_timeout_in_the_uri_is_no_stall(why):
    from powerprof.analysis import engine  # noqa: PLC0415

    assert engine.http_stall_refusal(why) is None, why


def test_a_stall_with_duckdbs_line_context_is_still_a_stall():
    from powerprof.analysis import engine  # noqa: PLC0415

    why = ("IO Error: Failed to read connection error for HTTP GET to 'http://h/x.parquet'\n\n"
           "LINE 1: SELECT * FROM read_parquet(['http://h/x.parquet', '/srv/a/...\n            ^^^^")
    assert engine.http_stall_refusal(why) is not None


def test_a_stray_file_behind_a_uri_is_named_with_its_table_folder(tmp_path):
    # Exported through file://, the note named "file:///…/node-0/date=…/part-x.parquet.tmp": requests/ left out.
    _node(tmp_path / "node-0", 0)
    good = next((tmp_path / "node-0" / "requests").rglob("*.parquet"))
    good.with_name("part-x.parquet.tmp").write_bytes(good.read_bytes()[:200])
    rel = good.with_name("part-x.parquet.tmp").relative_to(tmp_path / "node-0")
    r = CliRunner().invoke(main, ["export", f"file://{tmp_path / 'node-0'}", "--format", "csv",
                                  "--out", str(tmp_path / "x")])
    assert r.exit_code == 0, r.output
    assert f"file://{tmp_path / 'node-0' / rel}" in r.stderr, r.stderr


@pytest.mark.parametrize("table", ["requests", "intervals"])
def test_a_foreign_file_in_a_daemon_table_is_refused_naming_it(tmp_path, table):
    # A Parquet file with none of the table's columns (another tool's, or one misplaced) in requests/: `analyze` counted
    # its 2 rows as 2 requests of a host "(unknown) NODE" ("written before rows carried their host"), and `export`
    # wrote them as request rows with every column empty; both exit 0.
    _node(tmp_path / "node-0", 0)
    part = next((tmp_path / "node-0" / table).rglob("*.parquet"))
    foreign = part.with_name("part-foreign.parquet")
    pq.write_table(pa.table({"x": ["a", "b"], "power_w": ["hot", "cold"]}), foreign)
    for args in (["analyze", str(tmp_path / "node-0"), "--out", str(tmp_path / "a")],
                 ["export", str(tmp_path / "node-0"), "--format", "csv", "--out", str(tmp_path / "x")]):
        r = CliRunner().invoke(main, args)
        flat = " ".join(r.output.split())
        assert r.exit_code == 1 and f"{foreign}: none of its columns (x, power_w) is a column of {table}" in flat, r.output
        assert "move it out of the dataset folder" in flat and "Traceback" not in r.output, r.output
        assert not (tmp_path / "a").exists() and not (tmp_path / "x").exists()


def test_export_of_a_daemon_dataset_with_a_run_inside_says_so(tmp_path):
    # A sweep's run inside a daemon's data dir (data/r1; the daemon refuses no run below it): `export data` said "data:
    # a folder of runs (r1), not a run or a daemon dataset: give the runs themselves, e.g. 'data/*'", which named the
    # dataset no dataset and, followed, gave its table folders one by one.
    from synthetic_runs import make_run, seed_truth  # noqa: PLC0415

    _node(tmp_path / "data", 0)
    make_run(tmp_path / "data" / "r1", seed_truth(), levels=(220, 300), n_requests=4)
    r = CliRunner().invoke(main, ["export", str(tmp_path / "data"), "--format", "csv", "--out", str(tmp_path / "x")])
    flat = " ".join(r.output.split())
    assert r.exit_code == 1 and f"{tmp_path / 'data'} holds a daemon's datasets and the sweep run r1" in flat, r.output
    assert f"move the run out of it (e.g. mv {tmp_path / 'data' / 'r1'} " in flat and "not a run or a daemon" not in flat
    assert not (tmp_path / "x").exists()
    ok = CliRunner().invoke(main, ["analyze", str(tmp_path / "data")])  # the daemon's tables alone: the run is no table
    assert ok.exit_code == 0, ok.output


def test_analyze_out_inside_a_daemon_dataset_is_refused(tmp_path):
    # `analyze NODE --out NODE/requests` wrote fleet.parquet among the request files: the next `analyze NODE` read its
    # row as one more request (host, gpu_energy_j of the whole summary), 11 requests at 6.250 J/token where there were
    # 10 at 0.500, exit 0. A sweep's analysis there (`analyze RUN --out NODE/requests`) the same.
    from synthetic_runs import make_run, seed_truth  # noqa: PLC0415

    _node(tmp_path / "node-0", 0)
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=4)
    files = sorted(str(p) for p in (tmp_path / "node-0").rglob("*"))
    for src in (tmp_path / "node-0", run):
        for out in (tmp_path / "node-0" / "requests", tmp_path / "node-0" / "reports" / "new"):
            r = CliRunner().invoke(main, ["analyze", str(src), "--out", str(out), "--bootstrap", "100"])
            flat = " ".join(r.output.split())
            assert r.exit_code == 2 and f"--out {out} is inside the daemon dataset {tmp_path / 'node-0'}" in flat, r.output
            assert "give another folder with --out" in flat and "Traceback" not in r.output, r.output
            assert sorted(str(p) for p in (tmp_path / "node-0").rglob("*")) == files


def test_the_httpfs_download_child_imports_no_duckdb_py_from_the_working_directory(tmp_path, monkeypatch):
    # The child that downloads httpfs ran `python -c …`, which puts the working directory first on sys.path: a
    # duckdb.py another user planted in the folder root ran `analyze https://…` from ran as root.
    import duckdb  # noqa: PLC0415

    from powerprof.analysis import engine  # noqa: PLC0415

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    marker = tmp_path / "PWNED"
    (cwd / "duckdb.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit(1)\n")
    monkeypatch.chdir(cwd)
    store = _extension_store(monkeypatch, tmp_path, answers=False)
    monkeypatch.setattr(engine, "HTTPFS_INSTALL_LIMIT_S", 20)
    with store:
        why = engine.httpfs_refusal(duckdb.connect())
    assert not marker.exists(), "the child imported the working directory's duckdb.py"
    assert why is not None and "failed (" in why and "No module named" not in why, why
