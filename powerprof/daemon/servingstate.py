"""Which sampled GPUs the last daemon's power judged serving the proxied work, kept on disk across restarts.

Kept in the data dir (the daemon's own, checked at start), hidden, keyed by the sampled GPUs' UUIDs (in order) and the
upstream: a file of other GPUs or another upstream is not used. Read back as a provisional mask only (docs/daemon.md,
Attribution, Assumptions, "One engine"): nothing at a start shows the server is still on the GPUs it was on (a
container restarted onto another GPU behind the same port), so the rows stay flagged until the power judges again; the
file lets the log say whether that judgement is the last run's or not. Opened as opentags.py opens its file (never
through a symlink, a regular file, its size capped), and not acted on where another user could have written it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import stat
import threading
import time
from pathlib import Path

from powerprof.storage.atomic import atomic_path

log = logging.getLogger("powerprof.daemon.servingstate")

FILE_NAME = ".serving-gpus.json"
MAX_BYTES = 1 << 16  # a mask of a few hundred GPUs and their UUIDs fits many times over
# How far past now a saved time may be and still be read (a clock stepped back since): the log formats it as a date, and
# NaN, inf or 1e300 there raised inside the ledger's close (a review: one interval's energy lost from live rows).
SAVED_AHEAD_S = 86400.0


def path_in(data_dir: Path) -> Path:
    return Path(data_dir) / FILE_NAME


def save(data_dir: Path, uuids: list[str], upstream: str, serving: list[bool]) -> None:
    """The mask the power judged (`serving`, over the sampled GPUs `uuids`) behind `upstream`. Never raises: the
    attribution goes on whether or not it is kept (its failure is logged)."""
    p = path_in(data_dir)
    try:
        with atomic_path(p) as tmp:
            # 0600 whatever the umask: load refuses a group- or other-writable file (under umask 002, 664: every later
            # start refused the daemon's own file).
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
            tmp.write_text(json.dumps({"uuids": list(uuids), "upstream": upstream,
                                       "serving": [bool(x) for x in serving], "saved_s": time.time()}))
    except OSError as e:
        log.warning("cannot keep which GPUs serve in %s (%s): the next start will not say whether its judgement is "
                    "this one's", p, e.strerror or e)


class Keeper:
    """`save` off the caller's thread: the ledger's close runs on the event loop, and a save (a write and two fsyncs,
    22.5 ms measured, more on a busy disk) blocked the proxy at each new mask judged. One thread, one waiting mask,
    the latest (a mask superseded before its write is never written): bounded however often the judgement flips."""

    def __init__(self, data_dir: Path, uuids: list[str], upstream: str):
        self._args = (Path(data_dir), list(uuids), upstream)
        self._waiting: list[bool] | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._said: set[str] = set()  # the kinds of save failure already logged (once each)

    def put(self, serving: list[bool]) -> None:
        """Keeps `serving` soon (any thread; never blocks on the disk)."""
        with self._cond:
            self._waiting = list(serving)
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="powerprof-serving-keep", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stopping:
                    self._cond.wait()
                mask, self._waiting = self._waiting, None
                if mask is None:
                    return
            # save catches OSError; anything else killed this thread, every later mask silently never kept (a review's
            # keeper.py: a RuntimeError, then no file, one save tried). The next mask is tried all the same.
            try:
                save(*self._args, mask)
            except Exception as e:
                if type(e).__name__ not in self._said:
                    self._said.add(type(e).__name__)
                    log.warning("cannot keep which GPUs serve in %s: the next start will not say whether its judgement "
                                "is this one's (said once per kind of error)", path_in(self._args[0]), exc_info=True)

    def close(self, timeout_s: float = 5.0) -> None:
        """Writes the mask still waiting (at most `timeout_s` on the thread) and stops it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)


def load(data_dir: Path, uuids: list[str], upstream: str, euid: int | None = None) -> tuple[list[bool], float] | None:
    """(the mask, when it was saved) a daemon of these GPUs and this upstream saved, or None: none, another key's
    (said at INFO), or one not read (said as a warning: not a regular file, another user's or writable by others,
    not of this form)."""
    p = path_in(data_dir)
    euid = os.geteuid() if euid is None else euid
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read %s (%s): the last run's judgement of which GPUs serve is not known", p, e.strerror or e)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        # Another user's file, or one others may write, could say any mask: never acted on (root's rule for its state,
        # as for the data dir's folders: lock_data_dir).
        if st.st_uid not in {0, euid}:
            raise ValueError(f"owned by uid {st.st_uid}, not this daemon's user")
        if st.st_mode & 0o022:
            raise ValueError(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
        raw = os.read(fd, MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        doc = json.loads(raw)
        if not isinstance(doc, dict):  # valid JSON of another shape ([], 42, null) crashed the start
            raise ValueError("not of this form")
        serving, saved_s = doc.get("serving"), doc.get("saved_s")
        if not (isinstance(serving, list) and all(type(x) is bool for x in serving)
                and isinstance(saved_s, (int, float)) and not isinstance(saved_s, bool)
                and math.isfinite(saved_s) and 0 < saved_s <= time.time() + SAVED_AHEAD_S):
            raise ValueError("not of this form")
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past the parser's depth
        log.warning("cannot read %s (%s): the last run's judgement of which GPUs serve is not used", p, e)
        return None
    finally:
        os.close(fd)
    if doc.get("uuids") != list(uuids) or doc.get("upstream") != upstream or len(serving) != len(uuids):
        log.info("%s is of other GPUs or another upstream: the last run's judgement of which GPUs serve is not used", p)
        return None
    return serving, float(saved_s)
