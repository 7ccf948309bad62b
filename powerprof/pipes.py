"""A closed stdout or stderr (`| head`, a reader gone): stop writing there, keep the work, exit 141 as SIGPIPE would.

Python ignores SIGPIPE, so a write to a pipe whose reader has gone raises BrokenPipeError
wherever it happens: mid-run, before a command has written what it measured. The commands catch
it, silence the stream (its descriptor then points at /dev/null, so later writes and the flush
at exit succeed and go nowhere), finish or stop as their docs say, and exit EXIT_PIPE with no
traceback.
"""

from __future__ import annotations

import os
import select
import signal
import sys

import click

EXIT_PIPE = 128 + signal.SIGPIPE  # 141: what a shell reports for a writer that SIGPIPE ended


def closed(stream) -> bool:
    """True when the stream is a pipe or socket whose reader has gone (poll reports an error or hang-up)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    p = select.poll()
    p.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked for
    try:
        return any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in p.poll(0))
    except OSError:
        return False


def silence(stream) -> None:
    """Point the stream's descriptor at /dev/null."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def silence_closed() -> bool:
    """Silence stdout and stderr where their reader has gone; True if either had."""
    gone = [s for s in (sys.stdout, sys.stderr) if closed(s)]
    for s in gone:
        silence(s)
    return bool(gone)


def echo(message: str, err: bool = False) -> bool:
    """click.echo that a closed stream cannot turn into an exception: it is silenced, and False says so."""
    try:
        click.echo(message, err=err)
        return True
    except BrokenPipeError:
        silence(sys.stderr if err else sys.stdout)
        return False


def echo_err(message: str) -> bool:
    return echo(message, err=True)

