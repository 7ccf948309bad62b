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
