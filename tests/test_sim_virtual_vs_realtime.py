"""The virtual-time server (sim/virtual.py, the tuner bench's model) against the real-time simulated server on one trace.

The tuner's evaluation figures come from `VirtualServer`; the live path is `SimServer` (continuous
batching, 64 slots: the daemon's `--simulate` upstream) over HTTP on the simulated GPU's clock.
Both are replayed the same trace at three power limits, and per level the energy per token,
the saturated decode throughput and the TTFT/TPOT p50/p95 must agree.

Time-scaled so it fits in a test: the card's decode and prefill speeds are multiplied by SCALE
and the trace's arrival times divided by it (the same profile goes to both servers), so every
duration shrinks by SCALE, power is unchanged, and J/token shrinks by SCALE alike on both sides.
The three levels run at once, each on its own simulated GPU and server.

Tolerances (why): J/token and throughput within 3%: the two differ only in speculative
acceptance (drawn per sequence live, its mean in virtual time: about 0.5% on these
~20,000 tokens) and the live engine's schedule catch-up; the levels compared are 15–30%
apart, so a wrong DVFS table or step cost shows.

Latency percentiles: the live server's, on its engine's step schedule, against the virtual server's
given the requests when the live one received them. Not against the trace, and not from the
emission times as such: the live side's input and output both move with the host's load, and a
p95 of the ~160 requests rests on the 8 slowest, each a long wait behind a long prefill whose
length turns on which step a request lands in. Two effects, each several % on a busy machine, that
the `_Lateness` probe (a 5 ms sleep in a thread) does not see:
- the client delivers the trace late: arrivals after their trace time p95 15-40 ms, max 100-400 ms
  with busy loops beside the test, which reorders who waits behind whom (virtual time on the trace as
  the server received it moved the TTFT p95 by +5% at 220 and 300 W against the trace itself);
- the server's loop wakes late: a first token's step ends on schedule, but it is emitted when the
  loop gets to it, up to 80-200 ms later with the probe at 4-11 ms; each emission records that
  lateness (`emission_late_ns`), and a request the late loop admitted into a step that began on the
  schedule before it arrived records that start (`t_prefill_start_sched_ns`).
A CI run failed on both at once (probe 1.0 ms; the server's emitted TTFT p95 +12.7% over virtual
time on the trace at 220 W, +9.4% at 300 W). Repeated runs (quiet, two and three busy loops) show
no model difference: on the same arrivals and the schedule the TTFT p95s agree within -3.8..+0.9%
(p50 -5.5..+0.1%: the late loop's early admission saves up to a step); the emitted TTFT p95 against
virtual time on the trace spread -2..+13%. Bounds: TTFT within 10% plus 3 ms (scaled time: about
the spread three times over, and a request landing one short step later), TPOT p50 10% and p95 20%
plus 0.3 ms (the acceptance draws move a request's TPOT by ~7%; the p95 rests on the few short
answers whose decode shared a step with a long prefill: +3 to +8% measured). The host's load is
out of these figures, so they are not widened by it.

What the client sees adds the HTTP hop and its own loop: judged against the same reference within
the bounds above plus 3 ms plus twice its loop's lateness (a 5 ms asyncio sleep's oversleep,
measured in the clients' loop), and its TTFT p95 not at all (see the check). J/token and the
burst's throughput are judged against virtual time on the trace, the burst's bound widened by the
process's lateness (`_Lateness`) and the burst's arrival spread; the report prints the lateness used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from powerprof.sim.nvml import SimNVML
from powerprof.sim.profiles import get_profile
from powerprof.sim.server import SimServer
from powerprof.sim.virtual import VirtualServer
from powerprof.workload.client import RequestParams, detect_server, new_session
from powerprof.workload.replay import replay_async
from powerprof.workload.trace import TraceRequest, synthetic

SCALE = 8.0
LEVELS_W = (150.0, 220.0, 300.0)
BURST_AT_S = 270.0  # unscaled: after the chat and long-prompt parts have drained
BURST_N = 32


# A live server loop this far behind its step schedule admits a burst's requests into other steps than the
# virtual server's: that level is not judged (358 ms passed once, 464 ms read +9.4% on the burst's throughput).
LOOP_LATE_MAX_S = 0.4

def _profile():
    base = get_profile("seed-16g")
    wl = base.workload
    return dataclasses.replace(base, workload=dataclasses.replace(
        wl, decode_tok_s=wl.decode_tok_s * SCALE, prefill_tok_s=wl.prefill_tok_s * SCALE))


def _trace() -> list[TraceRequest]:
    """Two minutes of chat (the tuner bench's stationary mix), two of long documents (its shifted mix),
    then a burst of BURST_N requests at once to measure saturated decode throughput; times unscaled."""
    chat = synthetic(120, 1.0, prompt_median=400, output_median=80, seed=3)
    long = synthetic(48, 0.4, prompt_median=1500, prompt_sigma=0.8, output_median=250, output_sigma=0.6, seed=4)
    long = [dataclasses.replace(r, t_s=125.0 + r.t_s) for r in long if r.t_s < 120.0]
    burst = [TraceRequest(t_s=BURST_AT_S + 0.001 * i, prompt_tokens=200, output_tokens=200) for i in range(BURST_N)]
    # Both servers take arrivals in order: the chat part's tail may overlap the long part's head.
    return sorted(chat + long, key=lambda r: r.t_s) + burst


def _figures(ttft_s, tpot_s, energy_j, tokens, burst_tokens, burst_span_s) -> dict:
    """Latency percentiles over the chat and long-prompt parts (the burst only measures throughput: its
    requests arrive 0.1 ms apart, closer than HTTP delivers them)."""
    return {
        "j_per_token": energy_j / tokens,
        "burst_tok_s": burst_tokens / burst_span_s,
        "ttft_p50_s": float(np.percentile(ttft_s, 50)), "ttft_p95_s": float(np.percentile(ttft_s, 95)),
        "tpot_p50_s": float(np.nanpercentile(tpot_s, 50)), "tpot_p95_s": float(np.nanpercentile(tpot_s, 95)),
    }


class _Lateness:
    """How late this process wakes from a 5 ms sleep, sampled in a thread while the live servers
    run: the same GIL and cores their event loops wait for. The real-time side is only as exact
    as this; the checks widen by it rather than fail on a busy machine (or pass on luck)."""

    def __init__(self):
        self.late_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(0.005)
            self.late_s.append(time.monotonic() - t - 0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def p95_s(self) -> float:
        return float(np.percentile(self.late_s, 95)) if self.late_s else 0.0


def _tpot(first_sched, last_sched, tokens):
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(tokens > 1, (last_sched - first_sched) / np.maximum(tokens - 1, 1), np.nan)


def _virtual_latency(vs: VirtualServer, arrival_s: np.ndarray, trace, lv: float) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT, TPOT) per request of the virtual server at level `lv` given the trace's requests at `arrival_s`
    (the times the live server stamped them, on the trace's axis): the queue the live engine really served."""
    order = np.argsort(arrival_s, kind="stable")  # HTTP may deliver two close requests out of order
    pt = np.array([r.prompt_tokens for r in trace])[order]
    ot = np.array([r.output_tokens for r in trace])[order]
    r = vs.run(arrival_s[order], pt, ot, lambda tk: lv, lv)
    ttft, tpot = np.empty(len(trace)), np.empty(len(trace))
    ttft[order], tpot[order] = r.ttft_s, r.tpot_s
    return ttft, tpot


def _virtual(profile, trace) -> dict:
    arr = np.array([r.t_s for r in trace])
    pt = np.array([r.prompt_tokens for r in trace])
    ot = np.array([r.output_tokens for r in trace])
    vs = VirtualServer(profile, LEVELS_W)
    out = {}
    n = len(trace) - BURST_N
    for lv in LEVELS_W:
        r = vs.run(arr, pt, ot, lambda tk, lv=lv: lv, lv)
        # The live side counts energy from the first request's send: leave out the idle lead-in.
        energy = r.energy_j - profile.idle_power_w * arr[0]
        span = float(r.last_s[n:].max() - arr[n:].min())
        out[lv] = _figures(r.ttft_s[:n], r.tpot_s[:n], energy, r.tokens, float(ot[n:].sum()), span)
    return out


async def _live_level(profile, trace, lv: float) -> tuple[dict, dict, dict, np.ndarray, np.ndarray]:
    """At one level: (figures from the server's own emission times; the same on the engine's step schedule,
    below; figures as the client saw them; each request's client TTFT minus its server TTFT: the HTTP hop and
    the client's own lateness; each request's arrival on that schedule, on the trace's axis)."""
    nvml = SimNVML(profile, state_path=None)
    nvml.gpus[0].set_limit_w(lv)
    srv = SimServer(nvml, flavour="vllm", n_slots=64, batching="continuous").start()
    try:
        # The session every run uses (client.new_session): its own (aiohttp's 15 s keep-alive, no reuse trace) reused
        # connections idle ~5 s as the server's idle close fired, the long part's last answers 5 s before the burst;
        # a loaded host's late loop let the close cross the burst's requests, which failed unanswered (docs/workload.md).
        async with new_session() as s:
            info = await detect_server(s, srv.url, None)
            e0 = nvml.gpus[0].true_energy_j()
            recs = await replay_async(s, info, trace, RequestParams(),
                                      extra_headers=lambda i: {"X-Sim-Request-Id": str(i)})
            e1 = nvml.gpus[0].true_energy_j()
    finally:
        srv.stop()
    assert all(r.record.ok for r in recs), [r.record.error for r in recs if not r.record.ok][:3]
    tokens = sum(r.record.generated_tokens for r in recs)
    assert tokens == sum(r.output_tokens for r in trace)  # ignore-EOS: every trace length generated in full
    n = len(trace) - BURST_N
    truth = {int(t["client_id"]): t for t in srv.truth}
    assert sorted(truth) == list(range(len(trace)))
    t = [truth[i] for i in range(len(trace))]
    arrive = np.array([x["t_arrive_ns"] for x in t]) / 1e9
    first = np.array([x["emissions"][0][0] for x in t]) / 1e9
    last = np.array([x["emissions"][-1][0] for x in t]) / 1e9
    gen = np.array([x["generated"] for x in t])
    server = _figures((first - arrive)[:n], _tpot(first, last, gen)[:n], e1 - e0, tokens, float(gen[n:].sum()),
                      float(last[n:].max() - arrive[n:].min()))
    # On the engine's step schedule, the GPU's own timeline (sim/server.py: a late loop's steps are caught up, not
    # lost): a token's step ended `emission_late_ns` before the loop woke to emit it, and a loop late past a step's
    # scheduled start admits into it what arrived meanwhile: on that timeline such a request arrived at that start.
    arrive_sched = np.minimum(arrive, np.array([x["t_prefill_start_sched_ns"] for x in t]) / 1e9)
    first_sched = np.maximum(first - np.array([x["emission_late_ns"][0] for x in t]) / 1e9, arrive_sched)
    last_sched = np.maximum(last - np.array([x["emission_late_ns"][-1] for x in t]) / 1e9, first_sched)
    sched = _figures((first_sched - arrive_sched)[:n], _tpot(first_sched, last_sched, gen)[:n], e1 - e0, tokens,
                     float(gen[n:].sum()), float(last_sched[n:].max() - arrive_sched[n:].min()))
    sched["max_late_s"] = max(max(x["emission_late_ns"]) for x in t) / 1e9
    sched["stalled_s"] = sum(now - was for was, now in srv.schedule_restarts) / 1e9
    # The burst's requests reach the live server as fast as HTTP delivers them (the virtual one takes
    # them 0.1 ms apart): a late one starts its tokens late, which can lengthen the burst by as much.
    server["burst_arrival_spread_s"] = float(arrive[n:].max() - arrive[n:].min())
    c = [r.record for r in recs]
    c_first = np.array([r.t_first_ns for r in c]) / 1e9
    c_last = np.array([r.t_last_ns for r in c]) / 1e9
    c_send = np.array([r.t_send_ns for r in c]) / 1e9
    c_end = np.array([r.t_end_ns for r in c]) / 1e9
    client = _figures((c_first - c_send)[:n], _tpot(c_first, c_last, gen)[:n], e1 - e0, tokens,
                      float(gen[n:].sum()), float(c_end[n:].max() - c_send[n:].min()))
    arrival_s = arrive_sched - arrive[0] + trace[0].t_s
    return server, sched, client, ((c_first - c_send) - (first - arrive))[:n], arrival_s


# (relative, absolute s) per percentile, on the step schedule (the module's docstring). TTFT: a request landing one
# short step later or sooner. TPOT: its p95 rests on short answers whose drawn acceptance moves it ±13% between
# server seeds (the virtual side takes the mean).
TOLERANCE = {"ttft_p50_s": (0.10, 0.003), "ttft_p95_s": (0.10, 0.003),
             "tpot_p50_s": (0.10, 0.0003), "tpot_p95_s": (0.20, 0.0003)}
CLIENT_EXTRA_S = {"ttft_p50_s": 0.003, "ttft_p95_s": 0.003, "tpot_p50_s": 0.0, "tpot_p95_s": 0.0}  # the HTTP hop
# Above this client-loop lateness (p95) the client's first tokens wait behind several late wake-ups in
# a row (its send, the server's read, the head, the chunk; and the GIL between them): a loaded run
# (load 5.5 on 2 cores, lateness 10.5 ms) put the client's TTFT p50 32-43 ms over the server's while
# the server's own agreed with virtual time. There the client's TTFT is not judged against virtual
# time, only against the server's own per request (never before it), and the report says so.
CLIENT_TTFT_JUDGED_MAX_LATE_S = 0.005


def _compare(a: dict, b: dict, extra: dict | None = None, late_s: float = 0.0) -> list[str]:
    bad = []
    for k, (rel, abs_s) in TOLERANCE.items():
        # The client's first token is late by its loop's lateness; a TPOT spreads its last token's over the answer.
        slack = 2 * late_s if k.startswith("ttft") else late_s / 4
        if abs(b[k] - a[k]) > rel * a[k] + abs_s + (extra or {}).get(k, 0.0) + slack:
            bad.append(f"{k}: virtual {a[k] * 1e3:.3f} ms, live {b[k] * 1e3:.3f} ms ({b[k] / a[k] - 1:+.1%})")
    return bad


@pytest.mark.slow
def test_virtual_time_server_agrees_with_the_real_time_simulated_server():
    profile = _profile()
    trace = [dataclasses.replace(r, t_s=r.t_s / SCALE) for r in _trace()]
    virtual = _virtual(profile, trace)

    loop_late_s: list[float] = []

    async def all_levels():
        # The clients stamp their times on this one loop, shared by the three replays: a callback
        # queued behind the others' chunks is late by more than the process's oversleep (the thread
        # above does not wait for the loop). Measured in the loop itself, for the client checks.
        done = asyncio.Event()

        async def probe():
            while not done.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.005)
                loop_late_s.append(time.monotonic() - t - 0.005)

        task = asyncio.create_task(probe())
        try:
            return await asyncio.gather(*[_live_level(profile, trace, lv) for lv in LEVELS_W])
        finally:
            done.set()
            await task

    with _Lateness() as lateness:
        live = dict(zip(LEVELS_W, asyncio.run(all_levels())))
    late_s = lateness.p95_s()
    client_late_s = max(late_s, float(np.percentile(loop_late_s, 95)) if loop_late_s else 0.0)
    report, bad = [f"process lateness p95 {late_s * 1e3:.1f} ms, client loop {client_late_s * 1e3:.1f} ms",
                   "latencies: virtual on the trace / virtual on the arrivals served / server on its step schedule "
                   "(judged against the one before) / server as emitted / client"], []
    judge_client_ttft = client_late_s <= CLIENT_TTFT_JUDGED_MAX_LATE_S
    if not judge_client_ttft:
        report.append(f"client TTFT not judged against virtual time: client loop lateness p95 "
                      f"{client_late_s * 1e3:.1f} ms > {CLIENT_TTFT_JUDGED_MAX_LATE_S * 1e3:g} ms (a loaded "
                      f"machine); checked against the server's own TTFT per request instead")
    vs = VirtualServer(profile, LEVELS_W)
    n = len(trace) - BURST_N
    stalled: list[str] = []
    for lv in LEVELS_W:
        v, (s, sched, c, hop, arrival_s) = virtual[lv], live[lv]
        if sched["stalled_s"] > 0:
            # The host stopped the server's loop past its catch-up (sim/server.py STEP_CATCH_UP_NS): the simulated
            # GPU sat in its phase meanwhile, so its energy, throughput and latencies hold the host's stall.
            stalled.append(f"{lv:g} W not judged: the host stalled the live server's loop beyond its schedule's "
                           f"catch-up, {sched['stalled_s']:.2f} s in all")
            report.append(stalled[-1])
            continue
        if sched["max_late_s"] > LOOP_LATE_MAX_S:
            # Within the catch-up, but the burst's own requests were admitted that late: the steps it ran in are not
            # the virtual server's (a loaded full suite: 464 ms behind, the burst +9.4% on the step schedule).
            stalled.append(f"{lv:g} W not judged: the host held the live server's loop "
                           f"{sched['max_late_s'] * 1e3:.0f} ms behind its step schedule")
            report.append(stalled[-1])
            continue
        # The reference for latency: the virtual server given the requests when the live one received them.
        ttft, tpot = _virtual_latency(vs, arrival_s, trace, lv)
        served = {k: float(np.percentile(ttft[:n], q)) for k, q in (("ttft_p50_s", 50), ("ttft_p95_s", 95))}
        served |= {k: float(np.nanpercentile(tpot[:n], q)) for k, q in (("tpot_p50_s", 50), ("tpot_p95_s", 95))}
        lag_s = arrival_s - np.array([r.t_s for r in trace])
        report.append(f"{lv:g} W: client TTFT - server TTFT per request p50 {np.median(hop) * 1e3:.1f} ms, "
                      f"min {hop.min() * 1e3:.1f} ms; arrivals after their trace time p95 "
                      f"{np.percentile(lag_s[:n], 95) * 1e3:.1f} ms, max {lag_s[:n].max() * 1e3:.1f} ms")
        if hop.min() < -0.001:  # a first token the client saw before the server sent it: a stamping bug
            bad.append(f"{lv:g} W client saw a first token {-hop.min() * 1e3:.1f} ms before the server sent it")
        report.append(f"{lv:g} W: " + ", ".join(f"{k} {v[k]:.4g}" for k in ("j_per_token", "burst_tok_s"))
                      + f" (live burst_tok_s {sched['burst_tok_s']:.4g} on the step schedule, {s['burst_tok_s']:.4g} "
                      "as emitted), " + ", ".join(
            f"{k} {v[k]:.4g}/{served[k]:.4g}/{sched[k]:.4g}/{s[k]:.4g}/{c[k]:.4g}" for k in TOLERANCE))
        # The burst's span moves by its first and last tokens' lateness: 3% plus that share of it.
        spread_s = max(s["burst_arrival_spread_s"] - 0.001 * (BURST_N - 1), 0.0)
        report.append(f"{lv:g} W: burst arrivals spread over {s['burst_arrival_spread_s'] * 1e3:.1f} ms; the server's "
                      f"loop at most {sched['max_late_s'] * 1e3:.1f} ms behind its step schedule")
        tol = {"j_per_token": 0.03,
               "burst_tok_s": 0.03 + (4 * late_s + spread_s) * v["burst_tok_s"] / (BURST_N * 200)}
        # The burst's throughput on the engine's step schedule (the simulated GPU's own timeline): as emitted it
        # holds the host's lateness too, whose p95 the tolerance takes but not its worst (a loaded full suite: the
        # loop 358 ms behind once, the burst as emitted -6.5%).
        live_fig = {"j_per_token": s["j_per_token"], "burst_tok_s": sched["burst_tok_s"]}
        for k in ("j_per_token", "burst_tok_s"):
            if abs(live_fig[k] / v[k] - 1) > tol[k]:
                bad.append(f"{lv:g} W {k}: virtual {v[k]:.4g}, live {live_fig[k]:.4g} ({live_fig[k] / v[k] - 1:+.1%})")
        bad += [f"{lv:g} W server {x}" for x in _compare(served, sched)]
        client_bad = _compare(served, c, CLIENT_EXTRA_S, client_late_s)
        # The client's TTFT p95 is not judged against virtual time: it rests on 4-5 requests, and when a burst's
        # first tokens meet the client loop at its busiest those few wait on it, a moment the lateness probe's own
        # p95 misses (a loaded suite run: probe 1.7 ms, client p95 +14.0% over virtual, the server's own +6.2%).
        # The server's own p95 is judged above; the client's p50, and its TTFT never before the server's, here.
        bad += [f"{lv:g} W client {x}" for x in client_bad
                if not x.startswith("ttft_p95") and (judge_client_ttft or not x.startswith("ttft"))]
    print("\n" + "\n".join(report))
    assert not bad, "\n".join(bad + report)
    # The comparison has teeth: the levels differ by far more than the tolerance.
    assert virtual[150.0]["j_per_token"] < 0.8 * virtual[300.0]["j_per_token"]
    assert virtual[150.0]["burst_tok_s"] < 0.9 * virtual[300.0]["burst_tok_s"]
    if stalled:
        pytest.skip("; ".join(stalled) + " (a machine too busy for the real-time side: rerun on a quieter one)")
