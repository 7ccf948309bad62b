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


def test_without_a_handler_of_ours_it_is_plain_asyncio_run():
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        async def value():
            return 42

        assert termination.run(value()) == 42
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, old)
