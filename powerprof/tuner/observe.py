"""The tuner's input: the daemon's /metrics, read over HTTP as untrusted text (bounded, validated), turned into Windows.

The daemon runs unprivileged and the tuner as root, so the tuner never opens a file the daemon
wrote: it scrapes the daemon's Prometheus endpoint (loopback), reads at most MAX_BYTES, and
refuses anything it cannot vouch for (a missing family, buckets that are not the daemon's,
counters that went backwards, non-finite or negative values). Two scrapes make a Window.
"""

from __future__ import annotations

import ipaddress
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from powerprof.daemon.latency import LATENCY_EDGES_S
from powerprof.errtext import error_text, one_line

from .policy import Window

MAX_BYTES = 4 * 1024 * 1024
# A counter past 2^53 is no count a float holds exactly, and 2^53 J is 28,000 years at 10 kW: larger is not the
# daemon's. It also keeps every sum of the samples a body of MAX_BYTES can hold finite (two 1.7e308 made inf, and a
# window of inf - inf crashed the tuner).
MAX_COUNTER = float(2**53)
SCRAPE_DEADLINE_S = 5.0  # the whole scrape, not each socket read: a dripping endpoint is a failed scrape


class ObserveError(RuntimeError):
    """The daemon's figures cannot be read or trusted; the message says why."""


@dataclass(frozen=True)
class DaemonCounters:
    """Cumulative counters of one scrape (t_s: the tuner's monotonic clock when it was read)."""

    t_s: float
    # The GPUs serving the traffic: their energy given to requests and idle (the proxied traffic's share). Not the
    # idle energy of GPUs serving none of it: the tuned level does not move it, and its leaving while such a GPU is
    # unread (and coming back) would read as a level's saving (or cost).
    energy_j: float
    tokens: float
    finished: float
    active: float
    prompt_tokens: float
    output_tokens: float
    ttft_cum: tuple[float, ...]  # cumulative bucket counts over LATENCY_EDGES_S, then +Inf
    tpot_cum: tuple[float, ...]
    upstream_failures: float = 0.0  # requests the proxy could not deliver (the inference server is down)
    gpu_energy_j: float = 0.0  # all GPU energy since the daemon started: it moves while the daemon samples
    gpu_limits_w: dict = field(default_factory=dict)  # gpu_uuid → the power limit the daemon reads on it
    # Time integrals of the proxied requests in flight and awaiting a first token (request-seconds), over
    # queue_clock_s seconds of the daemon's clock: the queue, seen before its requests finish late.
    in_flight_s: float = 0.0
    awaiting_s: float = 0.0
    queue_clock_s: float = 0.0
    # Now, among streamed requests still in flight: the oldest one's wait for a first token and the longest silence
    # since a last token (seconds; None: a daemon older than these gauges, which cannot show unfinished requests).
    oldest_awaiting_s: float | None = None
    longest_silence_s: float | None = None
    # How far the energy counters (closed intervals) were behind the read (None: a daemon older than the gauge): the
    # energy of a window between two reads was spent over the same span this much earlier.
    accounts_behind_s: float | None = None
    # Intervals whose GPU energy is unknown (a GPU unread: out of the daemon's energy totals) since it started; None: a
    # daemon older than the counter. A window in which it moved read its energy low, and is not judged.
    energy_unknown_intervals: float | None = None
    # gpu_energy_j per GPU (gpu_uuid → J): a GPU the daemon cannot read has no series until it reads again, so the sum
    # can fall; whether the daemon samples is told by the GPUs in both scrapes (empty: compare the sums).
    gpu_energies_j: dict = field(default_factory=dict)
    # Per GPU (gpu_uuid) the seconds of closed intervals it gave no energy reading over: rising, the daemon samples
    # (closes intervals) though it reads no energy there.
    gpu_unknown_s: dict = field(default_factory=dict)
    # Times the daemon changed which GPUs serve the traffic since it started (None: a daemon older than the counter):
    # each moves a GPU's idle energy into or out of energy_j, so a window in which it rose straddles two bases.
    serving_changes: float | None = None
    # Per GPU, named as the daemon's notes name it ('gpu1 (GPU-…)': NVML index and UUID), whether its energy is in
    # energy_j (powerprof_gpu_serving; None: a daemon older than the gauge; empty: it names none, not knowing which of
    # several GPUs serve, every GPU's energy in energy_j): which GPUs a serving change moved.
    serving_gpus: dict | None = None


def loopback_reason(url: str) -> str | None:
    """Why `url` is not a loopback http(s) URL the tuner may read (None when it is): root steers GPUs by its answer."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return "--daemon-metrics must be an http:// or https:// URL"
    if u.username is not None or u.password is not None:
        # urllib resolves "user:pw@127.0.0.1" as a host name: never read, and the password in every retry's log line.
        return ("--daemon-metrics: give no user or password in the URL (the daemon's /metrics asks for none, and it "
                "would be logged)")
    host = u.hostname
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return f"--daemon-metrics: {host} is not a loopback address (127.0.0.1, ::1 or localhost)"
        except ValueError:
            return f"--daemon-metrics: {host} is not a loopback address (127.0.0.1, ::1 or localhost)"
    return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} refused", headers, fp)


# No proxies from the environment (http_proxy would send root's input through someone else), no redirects.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def fetch_metrics(url: str, timeout_s: float = SCRAPE_DEADLINE_S) -> str:
    """The exposition text, at most MAX_BYTES, read within `timeout_s` in all (ObserveError beyond, or on any failure).

    urlopen's timeout bounds each socket read, not the request: the body is read in chunks against a monotonic
    deadline. (Headers dripped slower than the timeout can still hold this call: the runner reads in a worker
    thread and keeps its own time, so stale figures and the kill switch never wait on it.)"""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    n = 0
    try:
        with _OPENER.open(url, timeout=timeout_s) as r:  # noqa: S310 (loopback http(s) checked by the caller)
            while n <= MAX_BYTES:
                if time.monotonic() > deadline:
                    raise ObserveError(f"{url} took more than {timeout_s:g} s to answer: not a usable scrape")
                b = r.read1(65536)
                if not b:
                    break
                chunks.append(b)
                n += len(b)
    except ObserveError:
        raise
    except Exception as e:  # noqa: BLE001 (every failure is the same to the tuner: no figures)
        raise ObserveError(f"cannot read {url}: {error_text(e)}") from None
    body = b"".join(chunks)
    if len(body) > MAX_BYTES:
        raise ObserveError(f"{url} answered more than {MAX_BYTES} bytes: not the daemon's metrics")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ObserveError(f"{url} answered text that is not UTF-8") from None


def parse_counters(text: str, t_s: float) -> DaemonCounters:
    """The counters the tuner needs from one exposition; ObserveError if any is missing or implausible."""
    fam = {}
    try:
        for f in text_string_to_metric_families(text):
            fam[f.name] = f
    except Exception as e:  # noqa: BLE001 (malformed exposition)
        raise ObserveError(f"unreadable metrics: {error_text(e)}") from None

    def need(name):
        if name not in fam:
            raise ObserveError(f"the daemon's metrics lack {name} (the daemon has not taken its first sample "
                               "yet, or is older than the tuner)")
        return fam[name].samples

    def num(v) -> float:
        v = float(v)
        if not math.isfinite(v) or v < 0 or v > MAX_COUNTER:
            raise ObserveError(f"implausible value {v!r} in the daemon's metrics")
        return v

    # A proxy worker serving whose records the daemon cannot read (an upgrade in place under it): traffic flows, but
    # every proxied figure (latencies, requests, upstream failures, in flight) stands still while energy moves, so
    # windows would be judged quiet and the latency guard, below its minimum of requests, would never back off.
    unread = [num(s.value) for s in fam["powerprof_proxy_workers_unread"].samples] \
        if "powerprof_proxy_workers_unread" in fam else []
    if any(v > 0 for v in unread):
        raise ObserveError("the daemon's proxy traffic is unread (powerprof_proxy_workers_unread: powerprof was "
                           "upgraded under the running daemon), so its requests and latencies stand still: restart the "
                           "daemon")
    parts = [(s.labels.get("to"), num(s.value)) for s in need("powerprof_gpu_energy_attributed_joules")
             if s.name.endswith("_total") and s.labels.get("to") in ("requests", "idle")]
    if sorted(to for to, _ in parts) != ["idle", "requests"]:  # a part missing would read as free energy
        raise ObserveError("powerprof_gpu_energy_attributed_joules: want one sample each to=\"requests\" and "
                           f"to=\"idle\", got {sorted(str(to) for to, _ in parts)}")
    aside = [num(s.value) for s in need("powerprof_gpu_idle_energy_not_serving_joules") if s.name.endswith("_total")]
    if len(aside) != 1:
        raise ObserveError(f"powerprof_gpu_idle_energy_not_serving_joules: want one sample, got {len(aside)}")
    energy = sum(v for _, v in parts) - aside[0]
    if energy < -1e-6 * max(1.0, aside[0]):  # a part of the idle energy larger than it: not the daemon's
        raise ObserveError("powerprof_gpu_idle_energy_not_serving_joules_total exceeds the idle and requests' energy: "
                           "not the daemon's figures")
    energy = max(energy, 0.0)
    tokens = sum(num(s.value) for s in need("powerprof_tokens_generated") if s.name.endswith("_total"))
    finished = sum(num(s.value) for s in need("powerprof_requests") if s.name.endswith("_total"))
    active = sum(num(s.value) for s in need("powerprof_proxy_active_requests"))

    def hist(name):
        b = [(s.labels.get("le"), num(s.value)) for s in need(name) if s.name.endswith("_bucket")]
        total = [num(s.value) for s in need(name) if s.name.endswith("_sum")]
        les = [x for x, _ in b]
        want = [repr(float(e)) for e in LATENCY_EDGES_S] + ["+Inf"]
        if name.endswith("seconds") and [_le(x) for x in les] != [_le(x) for x in want]:
            raise ObserveError(f"{name} has buckets the tuner does not know (daemon version mismatch)")
        cum = tuple(v for _, v in b)
        if any(b2 < b1 for b1, b2 in zip(cum, cum[1:])):
            raise ObserveError(f"{name}: buckets are not cumulative")
        if len(total) != 1:  # none would read as 0 tokens, several as one series' sum
            raise ObserveError(f"{name}: want one _sum, got {len(total)}")
        return cum, total[0]

    ttft, _ = hist("powerprof_request_ttft_seconds")
    tpot, _ = hist("powerprof_request_tpot_seconds")
    _, prompt = hist("powerprof_request_prompt_tokens")
    _, output = hist("powerprof_request_output_tokens")
    upstream = sum(num(s.value) for s in need("powerprof_proxy_upstream_failures") if s.name.endswith("_total"))
    per_gpu = [(s.labels.get("gpu_uuid", ""), num(s.value)) for s in need("powerprof_gpu_energy_joules")
               if s.name.endswith("_total")]
    gpu = sum(v for _, v in per_gpu)
    limits: dict = {}
    for s in need("powerprof_gpu_power_limit_watts"):
        u = s.labels.get("gpu_uuid", "")
        if u in limits:  # two readings of one GPU: which is believed would be the exposition's order
            raise ObserveError(f"powerprof_gpu_power_limit_watts: GPU {u or '(no gpu_uuid)'} appears twice")
        limits[u] = num(s.value)

    def one(name):
        v = [num(s.value) for s in need(name) if s.name.endswith("_total")]
        if len(v) != 1:
            raise ObserveError(f"{name}: want one sample, got {len(v)}")
        return v[0]

    in_flight, awaiting, clock = (one(f"powerprof_requests_{k}_seconds")
                                  for k in ("in_flight", "awaiting_first_token", "queue_clock"))
    # Awaiting a first token is a part of being in flight: its integral cannot be the larger (1 µs of slack
    # for the two floats' rounding).
    if awaiting > in_flight + 1e-6:
        raise ObserveError("powerprof_requests_awaiting_first_token_seconds_total exceeds "
                           "powerprof_requests_in_flight_seconds_total: not the daemon's figures")

    def gauge(name):  # optional: a daemon older than it still gives every other figure
        if name not in fam:
            return None
        v = [num(s.value) for s in fam[name].samples]
        if len(v) != 1:
            raise ObserveError(f"{name}: want one sample, got {len(v)}")
        return v[0]

    oldest, silence = (gauge(f"powerprof_requests_{k}_seconds")
                       for k in ("oldest_awaiting_first_token", "longest_stream_silence"))
    unknown = ([num(s.value) for s in fam["powerprof_gpu_energy_unknown_intervals"].samples if s.name.endswith("_total")]
               if "powerprof_gpu_energy_unknown_intervals" in fam else [])
    return DaemonCounters(t_s, energy, tokens, finished, active, prompt, output, ttft, tpot, upstream, gpu, limits,
                          in_flight, awaiting, clock, oldest, silence, gauge("powerprof_accounts_behind_seconds"),
                          sum(unknown) if unknown else None, gpu_energies_j=dict(per_gpu),
                          gpu_unknown_s={s.labels.get("gpu_uuid", ""): num(s.value)
                                         for s in (fam["powerprof_gpu_energy_unknown_seconds"].samples
                                                   if "powerprof_gpu_energy_unknown_seconds" in fam else ())
                                         if s.name.endswith("_total")},
                          serving_changes=one("powerprof_gpu_serving_changes")
                          if "powerprof_gpu_serving_changes" in fam else None,
                          serving_gpus={f"gpu{s.labels.get('gpu', '?')} ({s.labels.get('gpu_uuid', '')})": num(s.value) > 0
                                        for s in fam["powerprof_gpu_serving"].samples}
                          if "powerprof_gpu_serving" in fam else None)


def energy_moved(a: DaemonCounters, b: DaemonCounters) -> bool:
    """Whether the daemon sampled from `a` to `b`: a GPU's energy rose, on a GPU in both scrapes where they name their
    GPUs, as a GPU unread has no series (its counter would stand still), and one leaving took its whole count out of
    the sum (a window refused as "not moved" on a daemon sampling on); or a GPU's unread time rose, the daemon closing
    intervals it read no energy over: every GPU unread is told by window_between's refusal, with its fix, not as a
    stalled daemon."""
    if any(v > a.gpu_unknown_s[u] for u, v in b.gpu_unknown_s.items() if u in a.gpu_unknown_s):
        return True
    both = a.gpu_energies_j.keys() & b.gpu_energies_j.keys()
    if both:
        return any(b.gpu_energies_j[u] > a.gpu_energies_j[u] for u in both)
    return b.gpu_energy_j > a.gpu_energy_j


def serving_change(a: DaemonCounters, b: DaemonCounters) -> str | None:
    """Why the window from `a` to `b` is on no one energy basis (None: it is, or the daemon does not say): the daemon
    re-decided which GPUs serve the traffic in it, moving a GPU's idle energy into or out of energy_j."""
    if a.serving_changes is None or b.serving_changes is None or b.serving_changes <= a.serving_changes:
        return None
    n = b.serving_changes - a.serving_changes
    return (f"the daemon changed which GPUs serve the traffic ({n:.0f} time(s) in this window, "
            f"powerprof_gpu_serving_changes_total{_serving_moved(a.serving_gpus, b.serving_gpus)}): a GPU's idle "
            "energy came into or left the energy the levels are weighed by")


def _serving_moved(a: dict | None, b: dict | None) -> str:
    """Which GPUs' energy came into the serving GPUs' figure and which left it between two scrapes (powerprof_gpu_serving),
    as '; joined: …; left: …'; what the scrapes cannot show said instead."""
    if a is None or b is None:
        return "; the daemon names no GPUs (older than powerprof_gpu_serving)"
    # The gauge without samples: the daemon did not know which of several GPUs serve, every GPU's energy the work's
    # (docs/daemon.md, metrics): the GPUs the other end names, each in the figure.
    a, b = (a or {g: True for g in b}), (b or {g: True for g in a})
    joined = sorted(g for g, on in b.items() if on and not a.get(g, False))
    left = sorted(g for g, on in a.items() if on and not b.get(g, False))
    if not joined and not left:
        return "; the same GPUs serve at both ends of the window: changed and changed back within it"

    def named(gs):  # at most 8 named: the daemon's labels are its words, kept to a line
        return ", ".join(one_line(g, 80) for g in gs[:8]) + (f" and {len(gs) - 8} more" if len(gs) > 8 else "")

    return (f"; joined: {named(joined)}" if joined else "") + (f"; left: {named(left)}" if left else "")


def _le(x: str) -> float:
    return math.inf if x == "+Inf" else round(float(x), 9)


def window_between(a: DaemonCounters, b: DaemonCounters, level: float) -> Window:
    """The traffic between two scrapes. ObserveError when a counter went backwards (the daemon restarted)."""
    fields = ("energy_j", "tokens", "finished", "prompt_tokens", "output_tokens", "in_flight_s", "awaiting_s",
              "queue_clock_s")
    if b.t_s <= a.t_s or any(getattr(b, f) < getattr(a, f) for f in fields) or \
            any(y < x for x, y in zip(a.ttft_cum + a.tpot_cum, b.ttft_cum + b.tpot_cum)):
        raise ObserveError("the daemon's counters went backwards (restarted?): this window is not usable")
    clock = b.queue_clock_s - a.queue_clock_s
    if clock > 2 * (b.t_s - a.t_s) + 1.0:
        raise ObserveError(f"the daemon's queue clock moved {clock:.1f} s in {b.t_s - a.t_s:.1f} s: not a clock")
    if (b.awaiting_s - a.awaiting_s) > (b.in_flight_s - a.in_flight_s) + 1e-6:
        raise ObserveError("more request-seconds awaiting a first token than in flight: not the daemon's figures")
    # The integrals' means must be counts the daemon could hold: at most every request seen in flight throughout.
    if clock > 0 and (b.in_flight_s - a.in_flight_s) > clock * (b.active + a.active + (b.finished - a.finished) + 1):
        raise ObserveError("the daemon's in-flight integral is larger than its requests could make it")

    def per_bucket(ca, cb):
        d = [y - x for x, y in zip(ca, cb)]
        return (int(round(d[0])),) + tuple(int(round(d[k] - d[k - 1])) for k in range(1, len(d)))

    if (a.energy_unknown_intervals is not None and b.energy_unknown_intervals is not None
            and b.energy_unknown_intervals > a.energy_unknown_intervals):
        # Counted by the daemon only where a GPU serving the traffic (or any, before it judged which serve) is unread:
        # a lost GPU serving none leaves the requests' energy whole and the window judged (docs/tuner.md).
        raise ObserveError(f"{b.energy_unknown_intervals - a.energy_unknown_intervals:.0f} interval(s) in this window "
                           "had a GPU serving the traffic give no energy reading (lost or failing reads: the daemon's "
                           "log and powerprof_gpu_energy_unknown_intervals_total): their energy is out of its totals, "
                           "so the window reads low: not usable; every window is refused so until that GPU reads again "
                           "(powerprof devices, nvidia-smi -q), or the daemon is restarted with daemon.gpus leaving it "
                           "out")
    fin = b.finished - a.finished
    if not all(math.isfinite(getattr(b, f) - getattr(a, f)) for f in fields + ("active",)):
        raise ObserveError("the daemon's counters are not finite numbers: this window is not usable")
    return Window(
        t_end_s=b.t_s, duration_s=b.t_s - a.t_s, level=level, tokens=b.tokens - a.tokens, energy_j=b.energy_j - a.energy_j,
        arrivals=max(0, int(round(fin + b.active - a.active))), requests=int(round(fin)),
        prompt_tokens=b.prompt_tokens - a.prompt_tokens, output_tokens=b.output_tokens - a.output_tokens,
        ttft_counts=per_bucket(a.ttft_cum, b.ttft_cum), tpot_counts=per_bucket(a.tpot_cum, b.tpot_cum),
        in_flight_s=b.in_flight_s - a.in_flight_s, awaiting_s=b.awaiting_s - a.awaiting_s,
        queue_clock_s=b.queue_clock_s - a.queue_clock_s,
        oldest_awaiting_s=b.oldest_awaiting_s, longest_silence_s=b.longest_silence_s)
