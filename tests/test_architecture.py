"""The shape of the code, enforced: one door chooses what is real, and imports only point down."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "powerprof"

# Lower layers never import higher ones; areas on one layer are siblings and do not import each other.
# Data flows collectors → sampler → windows/energy → storage → analysis → report; commands sit on top.
LAYERS = [
    {"arrival"},  # how tokens arrived and the timing rule: pure, imports nothing of ours; windows builds on it
    {"powerprof", "paths", "privilege", "trust", "termination", "pipes", "errtext", "energy", "windows", "terminal_plot"},  # pure helpers, no state
    {"collectors", "sim"},  # read one source each; the simulator imports only the helpers
    {"profiler", "storage"},
    {"workload", "control"},
    {"analysis", "daemon"},
    {"sweep", "monitor", "tuner"},  # tuner: the live power-limit tuner (reads the daemon, drives control)
    {"grid"},  # configuration sweeps: a Sweep per server configuration
    {"progress"},  # what sweep shows on a terminal
    {"rig"},  # the one door
    {"cli"},
    {"entry"},  # the console command's first code: `tune`'s early SIGUSR1, then the CLI
    {"__main__"},  # `python -m powerprof`: the same command, through entry
]
RANK = {area: i for i, areas in enumerate(LAYERS) for area in areas}
DOOR = {"powerprof.rig", "powerprof.cli"}


def _modules():
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        yield p, ".".join(parts), is_pkg


def _imports(path: Path, module: str, is_pkg: bool):
    """(line, imported module) for every powerprof import in the file, relative ones resolved."""
    package = module if is_pkg else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == "powerprof" or t.startswith("powerprof."):
                yield node.lineno, t


def _area(module: str) -> str:
    parts = module.split(".")
    area = parts[1] if len(parts) > 1 else "powerprof"
    return area if area in RANK else "powerprof"  # `from powerprof import __version__`


MODULES = list(_modules())


def test_every_area_has_a_layer():
    areas = {m.split(".")[1] for _, m, _ in MODULES if m.count(".") >= 1}
    assert areas <= set(RANK), f"areas without a layer in this test: {sorted(areas - set(RANK))}"


def test_only_the_door_imports_the_simulator():
    bad = [
        f"{m}:{line} imports {t}"
        for p, m, is_pkg in MODULES
        if m not in DOOR and _area(m) != "sim"
        for line, t in _imports(p, m, is_pkg)
        if _area(t) == "sim"
    ]
    assert not bad, "the simulator is chosen at the door (powerprof/rig.py) only:\n" + "\n".join(bad)


def test_no_simulate_parameter_below_the_door():
    bad = []
    for p, m, _ in MODULES:
        if m in DOOR:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
                if "simulate" in names:
                    bad.append(f"{m}:{node.lineno} {node.name}(simulate=...)")
    assert not bad, "layers take what the door gives them, not a `simulate` switch:\n" + "\n".join(bad)


def test_imports_only_point_down():
    bad = []
    for p, m, is_pkg in MODULES:
        src = _area(m)
        for line, t in _imports(p, m, is_pkg):
            dst = _area(t)
            if dst == src:
                continue
            if RANK[dst] >= RANK[src]:
                bad.append(f"{m}:{line} imports {t} ({src} is on layer {RANK[src]}, {dst} on {RANK[dst]})")
    assert not bad, "imports must point down the layers:\n" + "\n".join(bad)


@pytest.mark.parametrize("path,module,is_pkg", MODULES, ids=[m for _, m, _ in MODULES])
def test_every_module_says_its_one_job_first(path, module, is_pkg):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if is_pkg and not path.read_text().strip():
        return  # an empty package marker
    assert doc and doc.strip(), f"{module} has no docstring saying what it does"


def test_every_nvml_call_goes_through_the_gateway():
    """No `x.nvmlSomething(...)` call outside collectors/gateway.py (and the simulator, which is NVML):
    readings use gw.query (None where NVML cannot answer), must-haves and setters gw.call."""
    bad = []
    for p, m, _ in MODULES:
        if m == "powerprof.collectors.gateway" or _area(m) == "sim":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("nvml"):
                bad.append(f"{m}:{node.lineno} calls .{node.func.attr}()")
    assert not bad, "call NVML through powerprof.collectors.gateway:\n" + "\n".join(bad)
