"""Scrape the inference server's own token counters: a cross-check and a view of unproxied traffic.

- vLLM: `vllm:generation_tokens_total` on /metrics, updated every engine step.
- SGLang: `sglang:generation_tokens_total` on /metrics (moves when a request finishes).
- llama.cpp: `/slots`, whose per-slot `n_decoded` moves while a request decodes (its /metrics
  counter `llamacpp:tokens_predicted_total` moves only when a request ends).

Parsing is pure (text/JSON in, numbers out); `Scraper` does the HTTP and keeps the state needed
to turn snapshots into token deltas.
"""

from __future__ import annotations

import json
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("powerprof.daemon.scrape")

SERVERS = ("auto", "vllm", "sglang", "llamacpp", "none")
COUNTERS = {"vllm": "vllm:generation_tokens_total", "sglang": "sglang:generation_tokens_total"}


def counter_total(text: str, name: str) -> float | None:
    """Sum of a counter over all its label sets; None when the metric is absent."""
    base = name[: -len("_total")] if name.endswith("_total") else name
    total, seen = 0.0, False
    for fam in text_string_to_metric_families(text):
        if fam.name not in (base, name):
            continue
        for s in fam.samples:
            if s.name == name or (s.name == base and fam.type != "counter"):
                total += s.value
                seen = True
    return total if seen else None


def slot_progress(slots) -> dict[int, tuple[object, int]]:
    """{slot id: (task id, n_decoded)} from llama.cpp's /slots JSON."""
    out = {}
    if not isinstance(slots, list):
        return out
    for s in slots:
        if not isinstance(s, dict):
            continue
        sid = s.get("id")
        task = s.get("id_task", s.get("task_id"))
        n = s.get("n_decoded")
        if n is None:
            n = (s.get("next_token") or [{}])[0].get("n_decoded") if isinstance(s.get("next_token"), list) else None
        if isinstance(sid, int) and isinstance(n, (int, float)):
            out[sid] = (task, int(n))
    return out


def slots_delta(prev: dict[int, tuple[object, int]], now: dict[int, tuple[object, int]]) -> int:
    """Tokens decoded between two /slots snapshots. A slot whose task changed restarted from 0;
    tokens of a task that started and ended between two scrapes are not seen (documented)."""
    d = 0
    for sid, (task, n) in now.items():
        old = prev.get(sid)
        if old is None or old[0] != task or n < old[1]:
            d += n
        else:
            d += n - old[1]
    return d


class Scraper:
    """Polls one server. `await scrape()` → tokens generated since the previous call, or None."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, server: str = "auto"):
        if server not in SERVERS:
            raise ValueError(f"scrape.server must be one of {', '.join(SERVERS)}, not {server!r}")
        self.session = session
        self.base = base_url.rstrip("/")
        self.server = server
        self.kind: str | None = None if server == "auto" else server
        self._last_total: float | None = None
        self._slots: dict | None = None
        self.total = 0.0  # tokens the server reported since the daemon started
        self.errors = 0
        self.last_error: str | None = None

    async def _get(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.text()

    async def _detect(self) -> str | None:
        try:
            status, text = await self._get("/metrics")
            if status == 200:
                for kind, name in COUNTERS.items():
                    if name.split(":")[0] + ":" in text:
                        return kind
            status, text = await self._get("/slots")
            if status == 200 and isinstance(json.loads(text), list):
                return "llamacpp"
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError):
            return None
        return None

    async def scrape(self) -> float | None:
        if self.server == "none":
            return None
        try:
            if self.kind is None:
                self.kind = await self._detect()
                if self.kind is None:
                    return None
                log.info("scraping %s token counters at %s", self.kind, self.base)
            if self.kind == "llamacpp":
                status, text = await self._get("/slots")
                if status != 200:
                    raise ValueError(f"/slots answered {status}")
                now = slot_progress(json.loads(text))
                delta = slots_delta(self._slots, now) if self._slots is not None else 0
                self._slots = now
            else:
                status, text = await self._get("/metrics")
                if status != 200:
                    raise ValueError(f"/metrics answered {status}")
                total = counter_total(text, COUNTERS[self.kind])
                if total is None:
                    raise ValueError(f"{COUNTERS[self.kind]} missing from /metrics")
                prev, self._last_total = self._last_total, total
                # A restart of the server zeroes its counter: count from zero again.
                delta = 0.0 if prev is None else (total - prev if total >= prev else total)
        except (aiohttp.ClientError, OSError, ValueError, TimeoutError) as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            if self.errors <= 3 or self.errors % 100 == 0:
                log.warning("scraping %s failed (%d so far): %s", self.base, self.errors, self.last_error)
            return None
        self.total += delta
        return float(delta)
