"""The real-server tests cannot pass in CI by skipping: a missing llama-cpp-python fails there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _collect(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    # A llama_cpp that is not there, as after a failed build, ahead of any installed one.
    broken = tmp_path / "broken"
    (broken / "llama_cpp").mkdir(parents=True)
    (broken / "llama_cpp" / "__init__.py").write_text("raise ModuleNotFoundError('simulated failed llama-cpp-python build', name='llama_cpp')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(broken), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--collect-only",
         str(ROOT / "tests" / "test_real_server.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


def test_ci_fails_when_llama_cpp_cannot_be_imported(tmp_path):
    r = _collect(tmp_path, "true")
    assert r.returncode not in (0, 5), r.stdout + r.stderr
    assert "simulated failed llama-cpp-python build" in r.stdout + r.stderr


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_missing_llama_cpp_skips_and_says_why(tmp_path, ci):
    r = _collect(tmp_path, ci)
    assert r.returncode in (0, 5), r.stdout + r.stderr
    assert "with CI=true this is a failure" in r.stdout
