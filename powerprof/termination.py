"""One latch for the signals that end a run, so a swallowed exit cannot keep the run going.

The signal handlers (the launcher's, the limit controller's) raise an exit exception at
whatever line the main thread is on. Library code that catches broadly (an HTTP client turning
any error in its parser into a failed request, say) can swallow it, and the run would go on
with the next request. The handlers also note the signal here, and the load loop calls
`raise_if_terminated()` before each request, so the exit happens at the next one at the latest.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading

_noted: list[int] = []


def _signals(*names: str) -> tuple[int, ...]:
    return tuple(getattr(signal, n) for n in names if hasattr(signal, n))


# Every signal whose default action ends the process and that a user, a shell or a tool can send: each is taken as a
# termination that restores (exit 128 + signal). Before, only INT, TERM, HUP and USR1 were: SIGQUIT (Ctrl-backslash, a key
# on the terminal), SIGUSR2 or SIGALRM ended a sweep or the tuner at once with the GPU left capped, the restore file
# kept and nothing said (exit -3/-12/-14). SIGXCPU (ulimit -t) and SIGVTALRM too. Not SIGKILL/SIGSTOP (cannot be
# caught), nor the faults (SIGSEGV, SIGBUS...): `powerprof restore` covers those.
EXTRA_END_SIGNALS = _signals("SIGQUIT", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGVTALRM")


class Terminated(SystemExit):
    """powerprof received SIGTERM, SIGHUP or another run-ending signal but SIGINT: exit with 128 + signum, with no traceback."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def note(signum: int) -> None:
    """Record that a run-ending signal arrived (the first one wins)."""
    if not _noted:
        _noted.append(signum)


def raise_if_terminated() -> None:
    """Re-raise the exit for a signal noted earlier: KeyboardInterrupt for SIGINT, else Terminated."""
    if _noted:
        if _noted[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(_noted[0])


# The run-ending signals a handler of ours (the launcher's, the limit controller's) may be set for. SIGINT too: its
# KeyboardInterrupt raised inside a task's step ended the loop with the main task's exception never retrieved
# (asyncio printed "Task exception was never retrieved" and a traceback on a Ctrl-C mid-sweep, seen in CI).
_RUN_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1) + EXTRA_END_SIGNALS


def run(coro):
    """`asyncio.run(coro)`, but a run-ending signal never raises inside the event loop's machinery.

    A Python signal handler that raises runs wherever the main thread is; inside asyncio's own
    bookkeeping (a task being woken or cancelled) the exception can leave a task "cancelling" for
    ever and the run hung after SIGTERM (seen once under load: `measure --launch` still running
    long after the signal). While the loop runs, each signal that has a Python handler is taken by
    the loop instead (a normal callback): the signal is noted, the earlier handler is called there
    (the limit controller restores the GPUs in it) with its exit held, the main task is cancelled,
    and the exit is raised once the loop has unwound."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(coro)
    held = {sig: h for sig in _RUN_SIGNALS if callable(h := signal.getsignal(sig))}
    if not held:
        return asyncio.run(coro)
    fired: list[int] = []

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def on_signal(sig: int) -> None:
            note(sig)
            fired.append(sig)
            try:
                held[sig](sig, None)
            except BaseException:  # its exit (Terminated, SystemExit) is raised below, outside the loop
                pass
            task.cancel()

        for sig in held:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            return await coro
        except asyncio.CancelledError:
            if fired:
                return None  # unwound; the exit is raised once asyncio.run has returned
            raise
        finally:
            for sig, h in held.items():
                loop.remove_signal_handler(sig)
                signal.signal(sig, h)

    out = asyncio.run(main())
    if fired:
        raise_if_terminated()
    return out


def exit_for(signum: int) -> BaseException:
    """The exit a run-ending signal asks for: KeyboardInterrupt for SIGINT, else Terminated (128 + signum)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


_EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) + EXTRA_END_SIGNALS


@contextlib.contextmanager
def _handled_by(handler):
    """`handler` for SIGINT, SIGTERM, SIGHUP and the EXTRA_END_SIGNALS inside (main thread only; an ignored one stays ignored, as nohup's
    SIGHUP), the earlier handlers back afterwards."""
    old = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in _EXIT_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    old[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def exits_latched():
    """SIGINT, SIGTERM and SIGHUP raise the run's exit once; a repeat while that exit unwinds (the run keeping
    what it finished) is only noted, as the limit controller's handler does: a second Ctrl-C must not cut the
    keeping short."""
    raised: list[int] = []

    def on_signal(signum, _frame):
        note(signum)
        if not raised:
            raised.append(signum)
            raise exit_for(signum)

    with _handled_by(on_signal):
        yield


@contextlib.contextmanager
def exits_held():
    """While the files a run keeps are written: SIGINT, SIGTERM and SIGHUP are noted, not raised, so a signal
    cannot leave run.json without its table. Yields the signals that came in; the caller raises
    `exit_for(first)` afterwards, or not when an exit is already under way."""
    got: list[int] = []

    def hold(signum, _frame):
        note(signum)
        got.append(signum)

    with _handled_by(hold):
        yield got


@contextlib.contextmanager
def signals_raise():
    """SIGTERM and SIGHUP raise Terminated inside, as Ctrl-C raises KeyboardInterrupt, so the
    caller can clean up and say what was kept; their earlier handlers are back afterwards."""

    def on_signal(signum, _frame):
        note(signum)
        raise Terminated(signum)

    held = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGHUP) + EXTRA_END_SIGNALS}
    try:
        yield
    finally:
        for sig, h in held.items():
            signal.signal(sig, h)


def stopped_how(e: BaseException) -> str:
    """How a run was stopped, in words: "interrupted" (Ctrl-C) or "stopped by SIGTERM" (a Terminated's signal)."""
    return "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped by {signal.Signals(e.signum).name}"


def exit_inside(e: BaseException) -> BaseException | None:
    """The exit a library turned into an error of its own, to raise in its place; None if `e` is none.

    DuckDB reports a KeyboardInterrupt raised while it reads a registered Python object as an
    InvalidInputException naming it, and Ctrl-C during a query as InterruptException or a
    RuntimeError "Query interrupted": caught as
    a read error, Ctrl-C would read "samples.parquet cannot be read: move it aside"."""
    text = str(e)
    if type(e).__name__ != "InterruptException" and not any(
            x in text for x in ("KeyboardInterrupt", "Terminated", "Query interrupted")):
        return None
    if _noted and _noted[0] != signal.SIGINT:
        return Terminated(_noted[0])
    return KeyboardInterrupt()


def clear() -> None:
    """Forget a noted signal (for a process that handled it and carries on, like a test runner)."""
    _noted.clear()
