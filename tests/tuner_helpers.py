"""A stand-in for the daemon's /metrics: the daemon's own exposition code over counters the test advances per scrape."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from powerprof.daemon.inflight import InFlightState
from powerprof.daemon.latency import RequestLatency
from powerprof.daemon.metrics import GpuSnapshot, Snapshot, make_registry, render


INTERVALS_PER_SCRAPE = 10


class FakeDaemon:
    """Each scrape adds `per_scrape` finished requests at `tpot_s` (80 tokens each) and the energy they cost.

    mode: "ok" | "down" (HTTP 503) | "frozen" (nothing moves, as a daemon whose loop stalled) | "upstream" (the
    inference server is failing: the proxy's upstream failures climb)."""

    def __init__(self, per_scrape: int = 20, tpot_s: float = 0.03, j_per_token: float = 1.0, gpu=None,
                 in_flight: float = 4.0, awaiting: float = 1.0, accounts_behind: int = 0, aside_j: float = 0.0,
                 j_per_token_at: dict | None = None):
        """gpu: () → (uuid, power limit W) the daemon reports for its one GPU (default a fixed GPU-fake at 300 W).
        in_flight, awaiting: the requests in flight and awaiting a first token since the last scrape, on the
        real clock as the daemon's (settable between scrapes).
        accounts_behind: the energy accounts (closed intervals) this many scrapes behind the tokens and the limit gauge,
        as a daemon whose sampler lags or whose intervals are held (prompt lengths, the server's counter): each
        scrape's energy is what was spent that many scrapes before, at the limit then (`released_from_w`), and the
        daemon says how far behind its accounts are (`behind_s`: seconds; None exposes nothing, as an older daemon).
        aside_j: a second GPU serving none of the traffic spends this much idle energy per scrape, in the daemon's idle
        energy and its powerprof_gpu_idle_energy_not_serving_joules_total, over INTERVALS_PER_SCRAPE intervals of 1 s;
        `aside_unread` (settable between scrapes) is the share of the next scrape's intervals it gives no reading over,
        as a daemon counts them (its powerprof_gpu_energy_unknown_seconds_total) and leaves its energy out of both;
        `aside_lost` (settable): unread now, so no limit gauge (the accounts lag: `aside_unread` apart).
        `aside_serving` (settable): the daemon judges that GPU serving the traffic (as before its first judgement of
        which serve, when every GPU's energy is the work's): its energy is not in the not-serving counter, and each
        scrape after a change of it counts one in powerprof_gpu_serving_changes_total, its powerprof_gpu_serving
        series following.
        j_per_token_at: {limit W: J/token} where the levels cost differently (default `j_per_token` at every one).
        `unread` (settable between scrapes): the serving GPU gives no energy reading (its limit still read): its
        energy series goes, its unread seconds and powerprof_gpu_energy_unknown_intervals_total climb, no energy counts."""
        self.accounts_behind = accounts_behind
        self.aside_j, self.aside_unread, self.aside_lost = aside_j, 0.0, False  # lost: no limit gauge now
        self.aside_serving = self._aside_served = False
        self.serving_changes = 0
        self.j_per_token_at = j_per_token_at or {}
        self.idle = self.aside_unknown_s = self.aside_energy = 0.0
        self.unread, self.unknown_s, self.unknown_intervals = False, 0.0, 0
        self._unreleased: list[tuple[float, float]] = []  # (energy J, the limit W it was spent at), oldest first
        self.released_from_w: set = set()  # the limits the energy released by the latest scrape was spent at
        self.behind_s: float | None = None
        self.in_flight, self.awaiting = in_flight, awaiting
        # The ages of unfinished streamed requests (settable between scrapes); `old`: a daemon without those gauges.
        self.oldest_awaiting_s = self.longest_silence_s = 0.0
        self.old = False
        self.queue = [0.0, 0.0, 0.0]  # the integrals and their clock
        self._queue_t = time.monotonic()
        self.gpu = gpu or (lambda: ("GPU-fake", 300.0))
        self.per_scrape = per_scrape
        self.tpot_s = tpot_s
        self.j_per_token = j_per_token
        self.mode = "ok"
        self.latency = RequestLatency()
        self.tokens = 0.0
        self.energy = 0.0
        self.finished = 0
        self.upstream_failures = 0
        self.gpu_energy = 0.0
        self.scrapes = 0
        self.snapshot = Snapshot()
        self._lock = threading.Lock()
        self._registry = make_registry(self)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body, code = fake._scrape()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _scrape(self):
        with self._lock:
            self.scrapes += 1
            if self.mode == "down":
                return b"daemon unavailable\n", 503
            if self.mode != "frozen":
                for k in range(self.per_scrape):
                    t0 = 10**9 * self.finished
                    self.latency.observe(t0, t0 + 200_000_000, t0 + 200_000_000 + int(self.tpot_s * 79 * 1e9), 80, 400)
                    self.finished += 1
                self.tokens += 80 * self.per_scrape
                spent = self.j_per_token_at.get(self.gpu()[1], self.j_per_token) * 80 * self.per_scrape
                if self.aside_j:
                    n = INTERVALS_PER_SCRAPE
                    k = round(n * self.aside_unread)
                    self.idle += self.aside_j * (n - k) / n
                    if self.aside_serving != self._aside_served:
                        self.serving_changes += 1
                        self._aside_served = self.aside_serving
                    if not self.aside_serving:
                        self.aside_energy += self.aside_j * (n - k) / n
                    self.aside_unknown_s += k * 1.0
                if self.accounts_behind:
                    self._unreleased.append((spent * self.gpu()[1] / 300.0, self.gpu()[1]))  # J/token ∝ limit
                    out, self._unreleased = (self._unreleased[:-self.accounts_behind],
                                             self._unreleased[-self.accounts_behind:])
                    self.energy += sum(e for e, _ in out)
                    self.released_from_w = {w for _, w in out}
                elif self.unread:
                    self.unknown_s += INTERVALS_PER_SCRAPE * 1.0
                    self.unknown_intervals += INTERVALS_PER_SCRAPE
                else:
                    self.energy += spent
                if not self.unread:
                    self.gpu_energy += self.j_per_token * 80 * self.per_scrape + 50.0  # plus idle power between requests
                if self.mode == "upstream":
                    self.upstream_failures += 5
                q, now = self.queue, time.monotonic()
                q[0] += self.in_flight * (now - self._queue_t)
                q[1] += self.awaiting * (now - self._queue_t)
                q[2] += now - self._queue_t
                self._queue_t = now
            uuid, limit_w = self.gpu()
            aside = (GpuSnapshot(1, "GPU-aside", "fake", None, None, None, None if self.aside_lost else limit_w,
                                 self.aside_energy,
                                 energy_unknown_s=self.aside_unknown_s, energy_unread=self.aside_unread > 0,
                                 serving=self._aside_served),) \
                if self.aside_j else ()
            self.snapshot = Snapshot(
                gpus=(GpuSnapshot(0, uuid, "fake", 200.0, 1500.0, 9000.0, limit_w, self.gpu_energy,
                                  energy_unknown_s=self.unknown_s, energy_unread=self.unread, serving=True),) + aside,
                gpu_unknown_intervals=self.unknown_intervals,
                energy_by_dest_j=(self.energy, self.idle, 0.0),
                idle_not_serving_j=self.aside_energy,
                serving_changes=self.serving_changes,
                tokens_by_tag={"": self.tokens},
                requests_by_tag={("", "ok"): float(self.finished)},
                proxy_upstream_failures=self.upstream_failures,
                latency=self.latency.states(),
                inflight=InFlightState(round(self.in_flight), round(self.awaiting), *self.queue,
                                       self.oldest_awaiting_s, self.longest_silence_s),
                accounts_behind_s=self.behind_s,
            )
            body = render(self._registry)
            if self.old:
                body = b"".join(line for line in body.splitlines(keepends=True)
                                if b"oldest_awaiting" not in line and b"stream_silence" not in line)
            return body, 200

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def sim_gpu(nvml=None):
    """FakeDaemon's `gpu` for the simulated seed card: `nvml`'s GPU 0, or the shared simulator state a subprocess uses."""
    from powerprof.sim.nvml import SimNVML

    def read():
        if nvml is not None:
            return nvml.gpus[0].uuid, nvml.gpus[0].limit_w
        sim = SimNVML("seed-16g")
        sim.nvmlInit()
        h = sim.nvmlDeviceGetHandleByIndex(0)
        return sim.nvmlDeviceGetUUID(h), sim.nvmlDeviceGetPowerManagementLimit(h) / 1000

    return read
