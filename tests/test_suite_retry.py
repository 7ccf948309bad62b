"""The suite's own retry rule (tests/conftest.py, docs/testing.md): a failed test gets one more try, and that try
starts from a fresh run of its module's shared fixtures, not the run that failed; a test that fails twice fails."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).resolve().parent / "conftest.py").read_text()

MODULE = '''
import itertools
import pytest

RUNS = itertools.count(1)
SEEN = []

@pytest.fixture(scope="module")
def scenario():
    n = next(RUNS)
    yield n
    SEEN.append(("closed", n))

def test_first(scenario):
    SEEN.append(("first", scenario))

def test_figure(scenario):
    SEEN.append(("figure", scenario))
    assert scenario >= {need}

def test_after(scenario):
    SEEN.append(("after", scenario))
    assert SEEN[:{k}] == {expect}
'''


@pytest.mark.parametrize("need, outcome", [(2, dict(passed=3, rerun=1)), (3, dict(passed=2, failed=1, rerun=1))])
def test_a_failed_test_is_tried_once_more_on_a_fresh_module_run(pytester, monkeypatch, need, outcome):
    # need 2: fails on the first run's figures, passes on the second's; need 3: fails on both (a regression stays
    # red). Either way the retry sees a new run (the first closed before it), and so do the tests after it.
    expect = [("first", 1), ("figure", 1), ("closed", 1), ("figure", 2), ("after", 2)]
    monkeypatch.delenv("POWERPROF_TEST_RERUNS", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_scenario=MODULE.format(need=need, k=len(expect), expect=expect))
    res = pytester.runpytest("-rR", "-p", "no:cacheprovider")
    assert {k: v for k, v in res.parseoutcomes().items() if k != "seconds"} == outcome, res.stdout.str()
    res.stdout.fnmatch_lines(["RERUN test_scenario.py::test_figure"])
    res.stdout.fnmatch_lines(["*retried once*", "test_scenario.py::test_figure: assert 1 >= *"])  # what failed


def test_retries_can_be_turned_off(pytester, monkeypatch):
    monkeypatch.setenv("POWERPROF_TEST_RERUNS", "0")
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_scenario=MODULE.format(need=2, k=0, expect=[]))
    res = pytester.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(passed=2, failed=1)
    assert "rerun" not in res.parseoutcomes()
