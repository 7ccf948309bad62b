"""Shared by the daemon benches: wait for a started daemon to publish where it listens."""

from __future__ import annotations

import json
import time
from pathlib import Path


def wait_for_daemon_info(data_dir: Path, timeout_s: float = 30.0) -> dict | None:
    """daemon.json once the daemon has written it (listen addresses), or None after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads((Path(data_dir) / "daemon.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return None
