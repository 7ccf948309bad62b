"""One line for an exception (`Type: message`, never `Type: ` with nothing after it), or for text from outside.

A timeout from asyncio.wait_for or an aiohttp total timeout is a TimeoutError with no message,
and `f"{type(e).__name__}: {e}"` logged `TimeoutError: ` alone. Such an exception is described
by what its type means, and by its cause where that has words; the caller adds what it was doing
(the URL, the timeout) when it knows.
"""

from __future__ import annotations

import asyncio

# Most specific first: ConnectionResetError is a ConnectionError is an OSError.
_MEANINGS: tuple[tuple[type[BaseException], str], ...] = (
    (TimeoutError, "timed out: no answer within the time allowed"),  # asyncio.TimeoutError too (3.11+)
    (asyncio.CancelledError, "cancelled (the task was stopped, usually at shutdown)"),
    (asyncio.IncompleteReadError, "the other side closed the connection mid-message"),
    (ConnectionResetError, "the other side reset the connection"),
    (BrokenPipeError, "the other side closed the connection while we wrote"),
    (ConnectionRefusedError, "connection refused: nothing listens there"),
    (ConnectionError, "the connection failed"),
    (EOFError, "the other side closed the connection before the end"),
    (MemoryError, "out of memory"),
    (AssertionError, "an internal check failed (a bug in powerprof: please report it)"),
    (StopIteration, "an iterator ended early (a bug in powerprof: please report it)"),
)


def error_text(e: BaseException) -> str:
    """`Type: message`; with no message, `Type: what the type means`, plus its cause where that has words."""
    name = type(e).__name__
    msg = str(e).strip()
    if msg:
        return f"{name}: {msg}"
    meaning = next((m for t, m in _MEANINGS if isinstance(e, t)), "it gave no message")
    cause = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    if cause is not None and str(cause).strip():
        meaning += f" (from {error_text(cause)})"
    return f"{name}: {meaning}"


def one_line(text: str, limit: int = 500) -> str:
    """Text from outside (a daemon's answer, a GPU label, an HTTP reason, a parser's quote) as one printable line of at
    most `limit` characters: in a log or a terminal a newline would forge a line and an escape sequence would act."""
    s = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return s if len(s) <= limit else s[: limit - 1] + "…"
