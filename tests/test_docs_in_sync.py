"""The documentation's most drift-prone facts, held to the code: a user who reads a default, a metric,
a column or a link in docs/ gets what the code does (tests/test_schema_docs.py holds data.md's main
tables, tests/test_daemon_observability.py that every exported metric is named in daemon.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from powerprof.daemon.config import SPEC
from powerprof.daemon.inflight import InFlightState
from powerprof.daemon.latency import RequestLatency
from powerprof.daemon.metrics import GpuSnapshot, Snapshot, make_registry, render
from powerprof.storage import schema

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _section(path: Path, heading: str) -> list[str]:
    """The lines of the `## heading` section (up to the next heading of that level)."""
    lines = path.read_text().splitlines()
    level = heading.split(" ", 1)[0]
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"^#{{1,{len(level)}}} ", lines[i])), len(lines))
    return lines[start:end]


def _table(lines: list[str]) -> list[list[str]]:
    """The body rows of the first Markdown table in `lines`, as cells."""
    rows = [ln for ln in lines if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    return [c for c in cells[1:] if not set("".join(c)) <= {"-", " "}]


# --- daemon.md, Configuration: every key, its default and whether SIGHUP applies it -------------------


def _config_rows() -> dict[str, tuple[str, bool]]:
    """{section.key: (documented default, live)} from daemon.md's configuration table; a row naming
    several keys gives each its comma-separated default in turn."""
    out = {}
    for cells in _table(_section(DOCS / "daemon.md", "## Configuration")):
        keys = re.findall(r"`([a-z_]+\.[a-z_]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")] if len(keys) > 1 else [cells[1]]
        assert len(defaults) == len(keys), f"daemon.md: row {cells[0]} gives {len(defaults)} defaults"
        for key, default in zip(keys, defaults):
            out[key] = (default, cells[2] == "yes")
    return out


def _shown(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def test_every_config_key_is_documented_with_its_default_and_reload():
    rows = _config_rows()
    keys = {f"{s}.{k}": spec for s, keys in SPEC.items() for k, spec in keys.items()}
    assert set(rows) == set(keys), ("docs/daemon.md's configuration table and config.SPEC differ: "
                                    f"undocumented {sorted(set(keys) - set(rows))}, unknown {sorted(set(rows) - set(keys))}")
    for name, spec in keys.items():
        default, live = rows[name]
        assert live == spec.reloadable, f"{name}: docs say live={live}, SIGHUP reload is {spec.reloadable}"
        if spec.default == "":
            continue  # an empty default means "derived" (the data dir, the upstream, ...): the docs say from what
        documented = default.strip("`")
        if isinstance(spec.default, float):
            assert float(documented) == spec.default, f"{name}: docs say {default}, the default is {spec.default}"
        else:
            assert documented == _shown(spec.default), f"{name}: docs say {default}, the default is {spec.default}"


# --- daemon.md, Prometheus metrics: every name in the table is exported, with that type and labels ------


def _exposition() -> dict:
    """Every family the daemon can export: a snapshot with each optional part present."""
    latency = RequestLatency()
    latency.observe(0, 100_000_000, 600_000_000, 11, 40)
    holder = type("H", (), {})()
    holder.snapshot = Snapshot(
        gpus=(GpuSnapshot(0, "GPU-x", "gpu", 100.0, 1.0, 1.0, 300.0, 5.0, serving=True),), cpu_energy_j=1.0,
        joules_per_token=0.5, server_tokens=3.0, tokens_by_tag={"a": 1}, requests_by_tag={("a", "ok"): 1},
        energy_by_dest_j=(80.0, 15.0, 5.0), tokens_closed=100.0, tokens_attributed=100.0,
        work_costs={"source": "fitted", "idle_w": 60.0, "step_j": 0.9, "decode_j": 0.2,
                    "prefill_per_decode": 0.04, "r2": 0.99, "rel_rmse": 0.03},
        proxy_worker_restarts={"exited": 1}, latency=latency.states(),
        inflight=InFlightState(1, 0, 1.0, 0.5, 2.0), sources={"nvml": (1, 0.001, 0, 0)}, other_cpu_pct=5.0,
        accounts_behind_s=0.4)
    text = render(make_registry(holder)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _metric_rows() -> list[tuple[str, set[str] | None, str]]:
    """(name, its labels where the table gives them, type cell) for each metric in the table."""
    out = []
    for cells in _table(_section(DOCS / "daemon.md", "## Prometheus metrics")):
        for m in re.finditer(r"`((?:powerprof|process)_[a-z_]+)(\{([a-z_,]+)\})?`", cells[0]):
            out.append((m.group(1), set(m.group(3).split(",")) if m.group(3) else None, cells[1]))
    return out


def test_every_documented_metric_is_exported_with_its_type_and_labels():
    fams = _exposition()
    rows = _metric_rows()
    assert len(rows) > 40
    for shown, labels, typ in rows:
        name = shown[: -len("_total")] if shown.endswith("_total") else shown
        assert name in fams, f"docs/daemon.md names {shown}, which the daemon does not export"
        f = fams[name]
        if f.type == "counter":
            assert shown.endswith("_total"), f"{shown} is a counter: Prometheus shows it as {name}_total"
        if typ:
            assert typ == f.type, f"docs/daemon.md says {shown} is a {typ!r}, it is a {f.type}"
        if labels is not None:
            exported = {k for s in f.samples for k in s.labels} - {"le"}
            assert labels == exported, f"{shown}: docs say labels {sorted(labels)}, exported {sorted(exported)}"


# --- data.md: the tables test_schema_docs.py does not parse ---------------------------------------


def test_tuner_decisions_columns_are_documented_with_their_types():
    rows = _table(_section(DOCS / "data.md", "## tuner decisions"))
    assert [(c[0], c[1]) for c in rows] == [(n, str(schema.arrow_type(t))) for n, t in schema.TUNER_DECISIONS_COLUMNS]


def test_daemon_samples_are_the_samples_columns_then_host_then_daemon_id_as_data_md_says():
    text = " ".join(_section(DOCS / "data.md", "## daemon_samples"))
    assert "columns of `samples` above, then `host`" in text and "then `daemon_id`" in text and "then `simulated`" in text
    assert schema.DAEMON_SAMPLES_COLUMNS == schema.SAMPLES_COLUMNS + [("host", "string"), ("daemon_id", "string"),
                                                                      ("simulated", "bool")]



def test_the_row_keys_data_md_states_are_the_ones_analyze_and_export_use():
    from powerprof.analysis.rowkeys import KEYS, TUNER_COLUMNS, TUNER_KEY

    text = " ".join(_section(DOCS / "data.md", "## daemon_samples"))
    for table, key in KEYS.items():
        assert f"{table} `{', '.join(key)}`" in text, table
        assert set(key) <= {c for c, _ in schema.COLUMNS[schema.DAEMON_DATASETS[table]]}, table
    assert f"tuner decisions `{', '.join(TUNER_KEY)}`" in text
    assert set(TUNER_KEY) | set(TUNER_COLUMNS) <= {c for c, _ in schema.TUNER_DECISIONS_COLUMNS}

def _emitted_level_flags() -> set[str]:
    """The flags stats.levels_table can write into a levels row's `flags`, read from its source."""
    src = (ROOT / "powerprof" / "analysis" / "stats.py").read_text()
    return set(re.findall(r'flags\.append\("([a-z-]+)"\)', src)) | set(
        re.findall(r'\("([a-z-]+)", "(?:cap_not_engaged|thermal_throttle)"\)', src))


def test_every_level_flag_is_named_in_the_schema_comment_and_data_md():
    emitted = _emitted_level_flags()
    assert {"one-window", "no-measured-windows", "cap-not-engaged", "thermal"} <= emitted, emitted
    lines = (ROOT / "powerprof" / "storage" / "schema.py").read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith('("flags", STR)'))
    comment = lines[at] if "#" in lines[at] else lines[at - 1]  # beside the column or on the line above it
    named = set(re.findall(r"[a-z]+(?:-[a-z]+)*", comment.split("#", 1)[1].split(":", 1)[1]))
    assert emitted <= named, f"schema.py's flags comment omits {sorted(emitted - named)}"
    for section in ("## levels", "## analysis"):
        row = next(c for c in _table(_section(DOCS / "data.md", section)) if c[0] == "flags")
        documented = set(re.findall(r"[a-z]+(?:-[a-z]+)*", row[3].split(":", 1)[1].split("(")[0]))
        assert emitted <= documented, f"data.md {section}: flags omits {sorted(emitted - documented)}"


# --- links between the docs ---------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


_PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: p.name)
def test_links_between_the_docs_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name} links to {target}: no such heading in {dest.name}"


_CODE = sorted((ROOT / "powerprof").rglob("*.py"))
_WRITTEN_MD = {"report.md", "gpu_check.md"}  # files `analyze` and bench/gpu_check.py write; no pages


@pytest.mark.parametrize("page", _PAGES + _CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_named_in_text_exist(page):
    """A page named in prose, a --help text or a message (`see docs/fleet.md`, `daemon.md's table`) is there: an
    unlinked name is followed by hand too (architecture.md's heading named a design.md the repository never had)."""
    for name in re.findall(r"(?<![\w/.-])(?:docs/)?([a-z][a-z0-9_-]*\.md)\b", page.read_text()):
        if name not in _WRITTEN_MD:
            assert (DOCS / name).exists(), f"{page.relative_to(ROOT)} names {name}, which is not in docs/"


def _section_names(path: Path) -> list[str]:
    """What a page's sections and named paragraphs are called: its headings, and the bold or italic words that
    open a paragraph or a list item (`**A server restart.**`, `- *Prompts are known.*`), without backticks."""
    names, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        if m := re.match(r"^#+\s+(.*)", line):
            names.append(m.group(1))
        names += [a or b for a, b in re.findall(r"(?:^|\s)\*\*([^*]+)\*\*|(?:^|- )\*([^*]+)\*", line)]
    return [n.replace("`", "").strip().lower() for n in names]


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: p.name)
def test_sections_named_in_quotes_exist(page):
    """`docs/workload.md "Against real servers"`, `daemon.md, "A server restart"`: the page has a heading or a
    named paragraph that begins so (a renamed section left such a pointer to nothing, and no link check sees it)."""
    text = " ".join(page.read_text().split())
    for name, quoted in re.findall(r"(?:docs/)?([a-z][a-z0-9_-]*\.md)\)?,? \(?\"([^\"]{3,100})\"", text):
        want = quoted.replace("`", "").strip().lower()
        assert any(n.startswith(want) for n in _section_names(DOCS / name)), (
            f"{page.name} points at {name} \"{quoted}\": no heading or named paragraph there begins so")


# --- dependencies.md: exactly pyproject's dependencies, each with its reason --------------------------


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}


def test_dependencies_md_lists_exactly_pyprojects_dependencies():
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    page = (DOCS / "dependencies.md").read_text()
    table = {}
    for cells in _table(page.splitlines()):
        for name in cells[0].split(","):
            table[re.match(r"\s*([A-Za-z0-9_.-]+)", name).group(1).lower()] = cells[1]
    assert set(table) == _requirement_names(project["dependencies"]), "dependencies.md's table and pyproject differ"
    assert all(len(why) > 10 for why in table.values()), "every dependency says why it is there"
    test_only = page.split("Test-only:", 1)[1].lower()
    for name in _requirement_names(project["optional-dependencies"]["test"]):
        assert name in test_only, f"test dependency {name} is not explained in dependencies.md"


# --- daemon.md: figures that follow from constants --------------------------------------------------


def test_work_model_maturity_is_stated_as_the_code_has_it():
    from powerprof.daemon.workmodel import MIN_BUSY, MIN_R2, WINDOW

    text = " ".join((DOCS / "daemon.md").read_text().split())
    assert f"at least {MIN_BUSY} busy intervals in the window, R² ≥ {MIN_R2:g}" in text
    assert f"over the last {WINDOW} intervals" in text


def test_buffer_cap_under_the_shipped_unit_is_the_one_daemon_md_gives():
    from powerprof.daemon.service import datasets
    from powerprof.daemon.store import MAX_BUFFERED_ROWS, buffer_cap_rows

    unit = (ROOT / "systemd" / "powerprof.service").read_text()
    memory_max_mib = int(re.search(r"^MemoryMax=(\d+)M$", unit, re.M).group(1))
    cap = buffer_cap_rows(memory_max_mib << 20, len(datasets()))
    text = " ".join((DOCS / "daemon.md").read_text().split())
    assert f"i.e. {cap} rows per dataset under the shipped unit, {MAX_BUFFERED_ROWS} without a limit" in text


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: p.name)
def test_files_the_docs_name_exist(page):
    """A `powerprof/daemon/store.py`, `daemon/store.py`, `bench/x.py` or `tests/y.py` a page names is there."""
    areas = "powerprof|bench|tests|daemon|sim|collectors|control|storage|analysis|workload|tuner"
    named = re.findall(rf"`((?:{areas})/(?:[\w.-]+/)*[\w.-]+\.(?:py|sh)|systemd/[\w.-]+)`", page.read_text())
    for rel in named:
        assert (ROOT / rel).exists() or (ROOT / "powerprof" / rel).exists(), f"{page.name} names {rel}, which is not there"


def test_sweep_md_gives_the_daemons_missing_parent_refusal_the_exit_daemon_md_gives():
    # sweep.md said an --out with no parent is refused "(exit 2 ...) as the daemon's --data-dir is", when the daemon's
    # was a start-up error, exit 1. Now the config's check refuses it, at --check and at start, exit 2
    # (test_an_explicit_data_dir_whose_parent_is_missing_is_refused_and_nothing_is_made): both pages say so.
    daemon = " ".join((DOCS / "daemon.md").read_text().split())
    assert "`--data-dir /nonexistent/dir/x` is refused at `--check` and at start (exit 2, nothing made)" in daemon
    sweep = " ".join((DOCS / "sweep.md").read_text().split())
    said = sweep[sweep.index("as the daemon's `--data-dir` is"):][:120]
    assert said.startswith("as the daemon's `--data-dir` is (at its `--check` too"), said
