"""A run-ending signal during an asyncio run: the earlier handler runs, the run unwinds, the exit comes after."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from powerprof import termination


@pytest.fixture
def handler():
    """A handler like the launcher's: it raises the run's exit. Restored afterwards."""
    calls = []

    def h(signum, frame):
        calls.append(signum)
        raise termination.Terminated(signum)

    old = signal.signal(signal.SIGTERM, h)
    termination.clear()
    yield h, calls
    signal.signal(signal.SIGTERM, old)
    termination.clear()


def test_sigterm_during_a_run_calls_the_handler_unwinds_the_tasks_then_exits_143(handler):
    h, calls = handler
    unwound = []

    async def busy():
        async def worker(k):
            try:
                while True:  # many tasks waking often: where a raise inside asyncio's own steps did harm
                    await asyncio.sleep(0.001)
            finally:
                unwound.append(k)

        tasks = [asyncio.create_task(worker(k)) for k in range(20)]
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    with pytest.raises(termination.Terminated) as e:
        termination.run(busy())
    assert e.value.code == 128 + signal.SIGTERM
    assert calls == [signal.SIGTERM]  # the earlier handler ran (the controller restores the GPUs in it)
    assert sorted(unwound) == list(range(20))  # every task unwound before the exit
    assert signal.getsignal(signal.SIGTERM) is h  # and the handler is back for what follows


@pytest.fixture
def controller_handler():
    """Held handlers like the limit controller's (`_on_signal`): note the signal, then raise the exit at whatever
    line the main thread is on (KeyboardInterrupt for SIGINT, SystemExit(128 + signum) else). Restored afterwards."""
    calls = []

    def h(signum, frame):
        calls.append(signum)
        termination.note(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, h) for s in (signal.SIGINT, signal.SIGTERM)}
    termination.clear()
    yield h, calls
    for s, o in old.items():
        signal.signal(s, o)
    termination.clear()


@pytest.mark.parametrize("sig, exit_type", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, termination.Terminated)])
def test_a_signal_inside_a_tasks_step_unwinds_the_task_and_exits_after_the_loop_closed(controller_handler, caplog, capsys,
                                                                                       sig, exit_type):
    # Deterministic form of the Ctrl-C race fixed in 5cfcf35: the signal is raised inside the step of one of a batch
    # of gathered requests (raise_signal runs a Python handler before it returns), where a Ctrl-C mid-sweep used to
    # land by chance. The held handler's KeyboardInterrupt then ended the loop from inside that task, and asyncio
    # logged "Task exception was never retrieved" with a traceback (CI, test_signals_mid_sweep_..._levels[2-130]).
    import gc
    import logging

    h, calls = controller_handler
    gc.collect()  # another test's garbage must not log into this one
    caplog.clear()
    seen = {"unwound": 0, "requests_unwound": []}

    async def request(k):
        try:
            await asyncio.sleep(0.01 * k)  # each in a later step of its task, not its first
            if k == 1:
                signal.raise_signal(sig)
            await asyncio.sleep(3600)
        finally:
            seen["requests_unwound"].append(k)

    async def main():
        seen["loop"] = asyncio.get_running_loop()
        try:
            await asyncio.gather(*(request(k) for k in range(3)))  # a batch, as the load sends it
        finally:
            seen["unwound"] += 1  # the sweep writes its finished levels here

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        try:
            termination.run(main())
        except BaseException as e:  # noqa: BLE001: the exit type is the assertion
            got, closed = type(e), seen["loop"].is_closed()
        else:
            got = closed = None
        gc.collect()  # an exception never retrieved is logged when its task is collected
    assert got is exit_type
    assert closed  # raised once the loop had unwound and closed, not from inside it
    assert calls == [sig]  # the held handler ran once (the controller restores the GPUs in it)
    assert seen["unwound"] == 1 and sorted(seen["requests_unwound"]) == [0, 1, 2]
    assert signal.getsignal(sig) is h
    said = caplog.text + capsys.readouterr().err
    assert "never retrieved" not in said and "Traceback" not in said, said


def test_without_a_handler_of_ours_it_is_plain_asyncio_run():
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        async def value():
            return 42

        assert termination.run(value()) == 42
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)


def test_ctrl_c_inside_a_duckdb_read_is_not_taken_for_a_damaged_file(tmp_path, monkeypatch):
    # DuckDB reports a KeyboardInterrupt raised while it reads a registered Arrow object as an
    # InvalidInputException; `analyze` then said "samples.parquet: cannot be read as Parquet ... move it aside".
    import duckdb
    import pyarrow as pa
    import pytest as _pytest

    from powerprof.analysis import engine
    from powerprof.analysis.report import analyze_run
    from synthetic_runs import make_run, seed_truth

    def ctrl_c_in_the_scan(con, rel, *a, **k):
        def batches():
            yield pa.record_batch({"x": [1]})
            raise KeyboardInterrupt

        con.register("stream", pa.RecordBatchReader.from_batches(pa.schema({"x": pa.int64()}), batches()))
        con.execute("SELECT count(*) FROM stream").fetchall()

    with _pytest.raises(duckdb.InvalidInputException):  # what DuckDB itself raises
        ctrl_c_in_the_scan(duckdb.connect(), None)
    run = make_run(tmp_path / "run", seed_truth(), levels=(220, 300), n_requests=3)
    monkeypatch.setattr(engine, "scan", ctrl_c_in_the_scan)
    with _pytest.raises(KeyboardInterrupt):
        analyze_run([run], n_boot=100, plots=False)
    assert termination.exit_inside(ValueError("column x: bad value")) is None
    # Ctrl-C during a query itself: DuckDB raises a RuntimeError of its own.
    assert isinstance(termination.exit_inside(RuntimeError("Query interrupted")), KeyboardInterrupt)
