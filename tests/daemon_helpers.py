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
    """A streamed 5000-token completion through the proxy, already flowing: a request in flight to stop the daemon under.
    On /v1/completions, which every flavour serves (the daemon's own simulated server is vLLM's, which has no
    /completion), each chunk saying the running count (vLLM's continuous usage), as native /completion's chunks did."""
    body = json.dumps({"prompt": "long", "max_tokens": 5000, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()
    req = urllib.request.Request(proxy_url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # vLLM refuses urllib's form type
    r = urllib.request.urlopen(req, timeout=30)
    r.read1(200)
    return r


# A conversation's opening of ~420 tokens (vLLM's tokenizer in tests/tiny_hf_llama.py), over 2 of vLLM's KV blocks on
# CPU (128 tokens): later turns find at least 256 tokens cached.
OPENING = "The machine serves a language model to many users, one token after another. " * 25


def note_of(row: dict) -> str:
    """A request row's energy_note, '' where null."""
    return row["energy_note"] if isinstance(row["energy_note"], str) else ""


def _post_json(url: str, body: dict, headers: dict) -> tuple[int, bytes]:
    import urllib.error

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def converse(base: str, name: str, turns: int = 3, continuous: bool = False, max_tokens: int = 8) -> list[dict]:
    """One chat conversation of `turns` turns, each resending the whole history: streamed (usage asked, and the running
    usage on every chunk where `continuous`), the second answered whole; each tagged name-k. The usage of each."""
    # Its own first words (the time): nothing of it cached before, even on a server an earlier run used.
    messages = [{"role": "system", "content": f"{name} {time.time_ns()}: {OPENING}"}]
    usages = []
    for k in range(turns):
        messages.append({"role": "user", "content": f"Question {k}: how much energy does a token cost?"})
        stream = k != 1
        opts = {"include_usage": True, **({"continuous_usage_stats": True} if continuous else {})}
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream": stream, **({"stream_options": opts} if stream else {})}
        status, raw = _post_json(base + "/v1/chat/completions", body, {"X-Powerprof-Tag": f"{name}-{k}"})
        assert status == 200, raw[:300]
        if stream:
            docs = [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")]
            text = "".join((c.get("delta") or {}).get("content") or "" for d in docs for c in d.get("choices") or [])
            (usage,) = [d["usage"] for d in docs if d.get("usage") and not d.get("choices")]
        else:
            answer = json.loads(raw)
            text, usage = answer["choices"][0]["message"]["content"], answer["usage"]
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
    return usages


def daemon_conversation(upstream: str, tmp_path: Path, name: str, turns: int = 3,
                        metric: str = "powerprof_requests_cache_unsaid_total", **ask) -> tuple[dict, list[dict], float]:
    """`converse` through a daemon (simulated GPU, scraping every 0.25 s) in front of `upstream` (`ask`: converse's
    continuous, max_tokens): its request rows by tag, the usages, and its /metrics `metric` once every turn's row is
    written."""
    from powerprof.daemon.scrape import counter_total

    data = tmp_path / name
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text("[scrape]\ninterval_s = 0.25\n")
    d = DaemonProc(data, "--config", str(cfg), "--simulate", "--upstream", upstream, "--interval", "0.25",
                   "--flush-interval", "0.25", env=sim_env(tmp_path))
    try:
        usages = converse(d.info["proxy"], name, turns, **ask)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the rows are written once their intervals close and a scrape is past them
            rows = read_dataset(data, "requests")
            if rows is not None and len(rows) >= turns:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the turns' rows not written in 60 s:\n{d.output()[-3000:]}")
        page = urllib.request.urlopen(d.info["metrics"] + "/metrics", timeout=10).read().decode()
        unsaid = counter_total(page, metric)
    finally:
        rc = d.stop()
    assert rc == 0, d.output()
    rows = {r["tag"]: r for r in read_dataset(data, "requests").to_dict("records")}
    assert len(rows) == turns, sorted(rows)
    return rows, usages, unsaid
