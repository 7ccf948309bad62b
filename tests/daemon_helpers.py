"""Start `powerprof daemon` as a real subprocess on the simulator, and read what it wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyarrow.dataset as pads

READY_TIMEOUT_S = 180  # a loaded machine (CI beside other jobs on 2 cores) took over 60 s to import and bind


class DaemonProc:
    def __init__(self, data_dir: Path, *args: str, env: dict | None = None):
        self.data_dir = Path(data_dir)
        self.info_path = self.data_dir / "daemon.json"
        self.log_path = self.data_dir.parent / f"daemon-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "powerprof.cli", "daemon", "--data-dir", str(self.data_dir),
               "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", *args]
        self.log = open(self.log_path, "wb")
        # faulthandler: a daemon not ready in time is sent SIGABRT and its threads' stacks land in the log,
        # telling a hang from a slow machine.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})})
        self.info = self._wait_ready()

    def _wait_ready(self) -> dict:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.output()}")
            try:
                info = json.loads(self.info_path.read_text())
                if info.get("pid") == self.proc.pid:
                    return info
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        self.proc.send_signal(signal.SIGABRT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        raise RuntimeError(f"daemon not ready in {READY_TIMEOUT_S} s; its output and stacks:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log.close()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


def read_dataset(data_dir: Path, name: str):
    base = Path(data_dir) / name
    if not base.exists():
        return None
    return pads.dataset(base, format="parquet", partitioning="hive").to_table().to_pandas()


def energy_books_j(data_dir: Path) -> tuple[float, float]:
    """(requests + idle + unproxied energy, the GPU counters' total over the run), in J: the daemon's
    conservation, which must hold to rounding."""
    reqs, intervals = read_dataset(data_dir, "requests"), read_dataset(data_dir, "intervals")
    samples = read_dataset(data_dir, "samples")
    gpu = samples[samples["source"] == "nvml"]
    measured = sum(g["energy_j"].max() - g["energy_j"].min() for _, g in gpu.groupby("gpu_index"))
    parts = reqs["gpu_energy_j"].sum() + intervals["idle_energy_j"].sum() + intervals["unproxied_energy_j"].sum()
    return float(parts), float(measured)


def sim_env(tmp_path: Path) -> dict:
    return {"POWERPROF_SIM_STATE": str(tmp_path / "sim.json"), "PYTHONUNBUFFERED": "1"}


def open_long_stream(proxy_url: str):
    """A streamed 5000-token completion through the proxy, already flowing: a request in flight to stop the daemon under."""
    body = json.dumps({"prompt": "long", "n_predict": 5000, "ignore_eos": True, "stream": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request(proxy_url + "/completion", data=body, method="POST"), timeout=30)
    r.read1(200)
    return r
