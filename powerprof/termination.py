"""One latch for the signals that end a run, so a swallowed exit cannot keep the run going.

The signal handlers (the launcher's, the limit controller's) raise an exit exception at
whatever line the main thread is on. Library code that catches broadly (an HTTP client turning
any error in its parser into a failed request, say) can swallow it, and the run would go on
with the next request. The handlers also note the signal here, and the load loop calls
`raise_if_terminated()` before each request, so the exit happens at the next one at the latest.
"""

from __future__ import annotations

import signal

_noted: list[int] = []


class Terminated(SystemExit):
    """powerprof received SIGTERM or SIGHUP: exit with 128 + signum, with no traceback."""

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


def clear() -> None:
    """Forget a noted signal (for a process that handled it and carries on, like a test runner)."""
    _noted.clear()
