"""bench/fleet_scale.py at a tiny scale: it generates daemon datasets the summary reads, runs every step side by
side, and fails on a figure that disagrees with its generator's truth (the full-size figures are in
docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import fleet_scale  # noqa: E402

from powerprof.daemon.service import datasets  # noqa: E402
from powerprof.storage.schema import arrow_schema  # noqa: E402

pytestmark = pytest.mark.slow  # 12 steps, each a fresh process: ~40 s on a loaded 2-core machine


def test_bench_runs_every_step_on_clean_and_synced_fleets(tmp_path, capsys):
    assert fleet_scale.main(["--nodes", "2", "--scales", "300:400", "--synced", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for kind in ("clean", "synced"):
        for step in ("duckdb-groupby", "fleet-summary", "export"):
            line = next(x for x in out.splitlines() if x.startswith(f"{kind:6s} {step} "))
            assert "wall" in line and "peak RSS" in line and "WRONG" not in line, line
        assert f"{kind:6s} fleet-summary vs the plain GROUP BY:" in out
    assert not (tmp_path / "2x300x400").exists()  # removed without --keep


def test_before_runs_each_step_with_the_other_code_beside_this_ones(tmp_path, capsys):
    repo = Path(__file__).resolve().parent.parent  # the same code as "before": the ratios read about 1
    assert fleet_scale.main(["--nodes", "1", "--scales", "200:300", "--steps", "duckdb-groupby,export",
                             "--before", str(repo), "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for step in ("export@before", "export"):
        line = next(x for x in out.splitlines() if x.startswith(f"clean  {step} "))
        assert "CPU" in line and "WRONG" not in line, line
    assert "clean  export after / before:" in out and "duckdb-groupby@before" not in out


def test_generated_folders_are_the_daemons(tmp_path):
    """The bulk files have the daemon's schema and sit beside the store's own flush files."""
    truth = fleet_scale.generate(tmp_path, 1, 300, 400, synced=False)
    node = tmp_path / "clean" / "node-0"
    for name in ("requests", "intervals"):
        files = sorted((node / name).rglob("*.parquet"))
        assert any(f.name.startswith("part-") for f in files) and any(f.name.startswith("compact-") for f in files)
        want = arrow_schema(next(d for d in datasets() if d.name == name).columns)
        assert all(pq.read_schema(f).equals(want) for f in files), name
        assert sum(pq.ParquetFile(f).metadata.num_rows for f in files) == truth["node-0"][name]


def test_a_wrong_figure_fails_the_bench():
    truth = {"node-0": {"requests": 10, "intervals": 5, "generated_tokens": 100, "gpu_energy_j": 50.0}}
    r = {"hosts": {"node-0": {"requests": 20, "generated_tokens": 100, "gpu_energy_j": 50.0}}}
    assert fleet_scale.check("fleet-summary", r, truth, synced=True) == ["node-0 requests: 20 != 10"]
    assert fleet_scale.check("export", {"rows_written": {"requests": 10, "intervals": 4}}, truth, False)
