"""The README's promise: its test command is exactly what CI runs."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    readme = _commands((ROOT / "README.md").read_text())
    assert len(readme) >= 2, "the README's top must show the run command and the test command"
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci == [readme[1]]
