"""Others sharing what a sweep measures: another process's kernels on a simulated GPU, another client's requests on a server.

    by = GpuBystander(nvml, index=0, power_w=60, share=0.3).start()   # a training job beside the server
    cl = ClientBystander(url, max_tokens=64).start()                  # a colleague's script on the same server
    ...; by.stop(); cl.stop()

Chosen at the door (`Rig.sim_bystander_gpu`, `Rig.sim_bystander_client`); nothing below it knows they exist,
as on a real host, where only the GPU's process list and the server's own counters show them.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request


class GpuBystander:
    """A process working on one simulated GPU beside the server: its kernels take `share` of the GPU's time (the
    server slows by that share) and draw `power_w` more; `mem_share` is the share of the memory bandwidth it
    streams without SM time (copy engines: a KV cache or weights offloaded over PCIe, a peer copy), which slows
    the server's memory-bound decode and draws the memory's watts (the GPU model's, not `power_w`);
    `enc_share`/`dec_share` keep the video engines busy (NVENC/NVDEC: `power_w` is theirs). All zero is a
    process that holds memory and runs nothing (a notebook with a model loaded, idle)."""

    def __init__(self, nvml, index: int = 0, power_w: float = 60.0, share: float = 0.3, pid: int | None = None,
                 used_bytes: int = 2 << 30, mem_share: float = 0.0, enc_share: float = 0.0, dec_share: float = 0.0):
        self.nvml = nvml
        self.index = index
        self.share = float(share)
        self.mem_share = float(mem_share)
        self.enc_share, self.dec_share = float(enc_share), float(dec_share)
        self.power_w = float(power_w) if (share > 0 or enc_share > 0 or dec_share > 0) else 0.0
        self.pid = os.getppid() if pid is None else int(pid)  # a process that is neither powerprof nor the server
        self.used_bytes = used_bytes
        self.running = False
        self.active_ns: list[list[int]] = []  # [start, stop] monotonic ns of each time it ran (truth for tests)

    def _util(self) -> tuple[float, float, float, float]:
        """(SM, memory, encoder, decoder) shares its NVML samples say: its kernels' memory traffic is half their
        share, as the server's own process's samples say of its kernels (sim/nvml.py)."""
        if not self.running:
            return 0.0, 0.0, 0.0, 0.0
        return self.share, min(1.0, self.mem_share + 0.5 * self.share), self.enc_share, self.dec_share

    def start(self) -> "GpuBystander":
        self.nvml.gpus[self.index].set_bystander(self.power_w, self.share, self.mem_share)
        self.nvml.add_process(self.index, self.pid, self.used_bytes, lambda: self.share if self.running else 0.0,
                              util=self._util)
        self.running = True
        self.active_ns.append([time.monotonic_ns(), 0])
        return self

    def stop(self) -> None:
        if not self.running:
            return
        self.nvml.remove_process(self.index, self.pid)  # while it still runs: its last samples show its share
        self.running = False
        self.nvml.gpus[self.index].set_bystander(0.0, 0.0, 0.0)
        self.active_ns[-1][1] = time.monotonic_ns()


class ClientBystander:
    """Another client of the server: sends requests (`max_tokens` each, `gap_s` apart) from its own thread until
    stopped; `requests`/`tokens` count what it got."""

    def __init__(self, url: str, max_tokens: int = 64, gap_s: float = 0.0, api: str = "llamacpp"):
        self.url = url.rstrip("/")
        self.max_tokens = max_tokens
        self.gap_s = gap_s
        self.api = api
        self.requests = 0
        self.tokens = 0
        self.errors: list[str] = []
        self.intervals_ns: list[tuple[int, int]] = []  # (sent, answered) monotonic ns of each request (truth for tests)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _one(self) -> None:
        if self.api == "llamacpp":
            path, body = "/completion", {"prompt": "Another client's question about the weather.",
                                         "n_predict": self.max_tokens, "ignore_eos": True, "cache_prompt": False}
        else:
            path, body = "/v1/completions", {"prompt": "Another client's question about the weather.",
                                             "max_tokens": self.max_tokens, "ignore_eos": True}
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        t0 = time.monotonic_ns()
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
        self.intervals_ns.append((t0, time.monotonic_ns()))
        n = out.get("tokens_predicted") or (out.get("usage") or {}).get("completion_tokens") or 0
        self.requests += 1
        self.tokens += int(n)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._one()
            except Exception as e:  # noqa: BLE001 - a bystander's failure is its own; it tries again
                self.errors.append(f"{type(e).__name__}: {e}")
                self._stop.wait(0.2)
            self._stop.wait(self.gap_s)

    def start(self) -> "ClientBystander":
        self._thread = threading.Thread(target=self._run, name="sim-bystander-client", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
