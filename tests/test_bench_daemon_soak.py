"""bench/daemon_soak.py's --rps traffic: served by the daemon's simulated server (vLLM's), and a soak none of whose
requests is served stops, saying why, rather than print figures of a daemon with no traffic."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import daemon_soak  # noqa: E402

from powerprof.sim.nvml import SimNVML  # noqa: E402
from powerprof.sim.server import SimServer  # noqa: E402


def _run(t: daemon_soak.Traffic, until) -> None:
    th = threading.Thread(target=t.run)
    th.start()
    deadline = time.monotonic() + 20
    while not until() and time.monotonic() < deadline:
        time.sleep(0.05)
    t.stop.set()
    th.join(40)


def test_the_soak_traffic_is_served_by_the_daemons_simulated_vllm():
    # Before: llama.cpp's /completion in urllib's form type, which vLLM answers 404 (and 400 for the type); the
    # OSError was swallowed and the --rps soak ran no generation, unsaid.
    with SimServer(SimNVML("seed-16g", state_path=None), flavour="vllm", n_slots=64, batching="continuous",
                   decode_tok_s=2000.0) as srv:
        t = daemon_soak.Traffic(srv.url, 20.0, threading.Event())
        _run(t, lambda: t.served + t.failed >= 3)
        generated = len(srv.truth)
    assert t.failed == 0 and t.served >= 3, t.last_error
    assert generated >= 3
    assert t.check("after").startswith(f"after: {t.served} requests served, 0 failed")


def test_a_soak_with_no_request_served_stops_and_says_why():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing listens there
    t = daemon_soak.Traffic(f"http://127.0.0.1:{port}", 20.0, threading.Event())
    _run(t, lambda: t.failed >= 2)
    for early in (True, False):
        with pytest.raises(SystemExit, match=r"after: --rps 20.0: no request served through the proxy \(\d+ failed; "
                                             r"last: .*Connection refused"):
            t.check("after", early=early)
    idle = daemon_soak.Traffic("http://127.0.0.1:9", 20.0, threading.Event())  # none sent yet
    assert idle.check("after", early=True) == "after: 0 requests served, 0 failed"
    with pytest.raises(SystemExit, match="none sent"):
        idle.check("after")
