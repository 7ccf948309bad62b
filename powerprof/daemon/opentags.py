"""Open tag windows kept on disk, so that one open when the daemon dies (kill -9, a crash, a watchdog restart) is said and
written at the next start, never lost without a word.

A clean stop closes every open window itself (`closed_by = shutdown`) and removes the file. A daemon that did not stop
cleanly leaves it: the next start writes one tags row per window it names, `closed_by = lost`, its start time and no
figure (its end, the samples past it and the energy of its intervals died with that daemon), and removes it. The file
lives in the data dir (the daemon's own, checked at start), hidden, so no reader takes it for a table.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

from powerprof.storage.atomic import atomic_path

from .tagapi import NAME_RE

log = logging.getLogger("powerprof.daemon.opentags")

FILE_NAME = ".open-tags.json"
MAX_BYTES = 1 << 20  # 256 open windows (MAX_OPEN_TAGS) of 128-character names fit many times over

LOST_NOTE = ("lost: the daemon stopped without closing this window (killed, crashed, or restarted by its watchdog), so its "
             "end and every figure of it died with that daemon (daemon_id); the samples dataset holds the GPU counters up "
             "to the stop; fix: stop tags before stopping the daemon (systemctl stop closes them: closed_by shutdown), and "
             "start this one again")


def path_in(data_dir: Path) -> Path:
    return Path(data_dir) / FILE_NAME


def save(data_dir: Path, daemon_id: str, open_tags: dict[str, int]) -> None:
    """The windows open now ({name: start wall ns}); the file goes when none is. Never raises: a tag is served whether
    or not this is written (its failure is logged)."""
    p = path_in(data_dir)
    try:
        if not open_tags:
            p.unlink(missing_ok=True)
            return
        with atomic_path(p) as tmp:
            tmp.write_text(json.dumps({"daemon_id": daemon_id, "open": open_tags}))
    except OSError as e:
        log.warning("cannot keep the open tag windows in %s (%s): one open when the daemon dies will not be said at the "
                    "next start", p, e.strerror or e)


def take_lost(data_dir: Path) -> tuple[str | None, dict[str, int]]:
    """(the daemon that left them, {name: start wall ns}) from a file a daemon that did not stop cleanly left; the file
    is removed. ({} where there is none, or it cannot be read: said in the log.)"""
    p = path_in(data_dir)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, {}
    except OSError as e:
        log.warning("cannot read %s (%s): windows open when the last daemon stopped are not known", p, e.strerror or e)
        return None, {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = os.read(fd, MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            raise ValueError(f"over {MAX_BYTES} bytes")
        doc = json.loads(raw)
        who, named = doc.get("daemon_id"), doc.get("open")
        if not isinstance(named, dict):
            raise ValueError("no `open` object")
        lost = {k: v for k, v in named.items() if isinstance(k, str) and NAME_RE.match(k) and type(v) is int and v > 0}
        return (who if isinstance(who, str) else None), lost
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s): windows open when the last daemon stopped are not known", p, e)
        return None, {}
    finally:
        os.close(fd)
        try:
            p.unlink()
        except OSError:
            pass


def lost_rows(daemon_id: str | None, lost: dict[str, int]) -> list[dict]:
    """One tags row per lost window: its start, no end and no figure, `closed_by = lost`, the note saying why."""
    return [{"daemon_id": daemon_id, "name": name, "t_start_utc": wall0_ns, "t_end_utc": None, "duration_s": None,
             "gpu_energy_j": None, "cpu_energy_j": None, "unproxied_energy_j": None, "proxy_tokens": None,
             "gpu_j_per_token": None, "closed_by": "lost", "server_count": None, "energy_note": LOST_NOTE}
            for name, wall0_ns in sorted(lost.items())]
