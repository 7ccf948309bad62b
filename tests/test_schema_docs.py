"""docs/data.md documents every Parquet column with its real type, so users can trust it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from powerprof.storage.schema import TABLES

DOC = Path(__file__).resolve().parent.parent / "docs" / "data.md"


def _doc_tables() -> dict[str, dict[str, str]]:
    """{section: {column: type}} from each `## name` section's Markdown table."""
    out: dict[str, dict[str, str]] = {}
    section = None
    for line in DOC.read_text().splitlines():
        m = re.match(r"^## (\w+)", line)
        if m:
            section = m.group(1)
            out[section] = {}
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section and line.startswith("|") and len(cells) >= 4 and cells[0] not in ("column", "---"):
            if not set(cells[0]) <= {"-"}:
                out[section][cells[0]] = cells[1]
    return out


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_column_is_documented_with_its_type(name):
    docs = _doc_tables()
    assert name in docs, f"docs/data.md has no '## {name}' section"
    schema = TABLES[name]
    assert list(docs[name]) == schema.names, f"{name}: columns in docs/data.md differ from the schema"
    for field in schema:
        assert docs[name][field.name] == str(field.type), f"{name}.{field.name}"


@pytest.mark.parametrize("section", ["daemon_requests", "daemon_intervals", "daemon_tags"])
def test_the_energy_note_entries_name_the_serving_asserted_flag(section):
    # The daemon writes SERVING_ASSERTED_FLAG on request, interval and tag rows; data.md's energy_note entries never
    # named it (a review's finding), the intervals' ending "Null: every figure whole" as if no such note existed.
    from powerprof.storage.schema import SERVING_ASSERTED_FLAG

    text = DOC.read_text()
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    (entry,) = [line for line in body.splitlines() if line.startswith("| energy_note |")]
    assert f"{SERVING_ASSERTED_FLAG}: " in entry, section


def test_samples_are_documented():
    assert "samples" in _doc_tables()


def test_export_headers_carry_the_unit_data_md_gives():
    # `decode_j` is J per token (a fit's coefficient), not J: the csv/xlsx header said "(J)"; `concurrency`,
    # `server_prompt_n` … said none (session 46's spreadsheet walkthrough). Timestamps say their zone instead.
    from powerprof.analysis.export import header  # noqa: PLC0415

    wrong = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 4 or not re.fullmatch(r"[a-z][a-z0-9_]*", cells[0]):
            continue
        col, typ, unit = cells[:3]
        if typ.startswith("timestamp") or unit in ("", "-") or col == "column":
            continue
        want = f"{col} ({'degC' if unit == '°C' else unit})"  # headers are ASCII (docs/analysis.md)
        if header(col, "UTC") != want:
            wrong.append((header(col, "UTC"), want))
    assert not wrong, wrong


# --- fleet.parquet, fleet_tags.parquet: `analyze` of daemon datasets (powerprof/analysis/fleet.py) --------------


@pytest.fixture(scope="module")
def fleet_out(tmp_path_factory):
    """`analyze DIR --out OUT` over one daemon data folder with requests, intervals and a tag window; returns
    ({section: fleet_summary's or tag_summary's schema}, OUT)."""
    from click.testing import CliRunner

    from powerprof.analysis.fleet import fleet_summary, tag_summary
    from powerprof.cli import main
    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import DatasetStore

    base = tmp_path_factory.mktemp("fleetdocs")
    t0 = 1_768_478_400 * 10**9  # 2026-01-15 12:00 UTC
    store = DatasetStore(base / "node", datasets(), host="node-0")
    store.append("requests", [{"daemon_id": "d0", "request_id": 1, "t_arrival_utc": t0, "t_end_utc": t0 + 10**9,
                               "outcome": "ok", "generated_tokens": 100, "gpu_energy_j": 50.0,
                               "attributed_tokens": 100.0, "ttft_s": 0.1}])
    store.append("intervals", [{"daemon_id": "d0", "t_start_utc": t0 + i * 10**9, "t_end_utc": t0 + (i + 1) * 10**9,
                                "duration_s": 1.0, "kind": "decode" if i else "idle", "gpu_energy_j": 300.0,
                                "server_count": "complete"} for i in range(3)])
    store.append("tags", [{"daemon_id": "d0", "name": "exp", "t_start_utc": t0, "t_end_utc": t0 + 2 * 10**9,
                           "duration_s": 2.0, "gpu_energy_j": 600.0, "unproxied_energy_j": 0.0, "proxy_tokens": 100.0,
                           "server_count": "complete"}])
    assert store.flush()
    out = base / "out"
    res = CliRunner().invoke(main, ["analyze", str(base / "node"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return {"fleet": fleet_summary([str(base / "node")]).schema,
            "fleet_tags": tag_summary([str(base / "node")]).schema}, out


@pytest.mark.parametrize("section", ["fleet", "fleet_tags"])
def test_fleet_tables_are_documented_with_the_columns_and_types_analyze_writes(fleet_out, section):
    # data.md said it documents every Parquet file powerprof writes; fleet.parquet and fleet_tags.parquet had no
    # section. Held both to what fleet_summary / tag_summary return and to the file `analyze --out` writes.
    import pyarrow.parquet as pq

    schemas, out = fleet_out
    docs = _doc_tables()
    assert section in docs, f"docs/data.md has no '## {section}' section"
    documented = list(docs[section].items())
    assert documented == [(f.name, str(f.type)) for f in schemas[section]], \
        f"{section}: docs/data.md's columns or types differ from what analyze returns"
    written = pq.read_schema(out / f"{section}.parquet")
    assert documented == [(f.name, str(f.type)) for f in written], f"{section}.parquet differs from docs/data.md"
