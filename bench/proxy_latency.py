"""Proxy cost: latency added per request, throughput, and the proxy's own CPU per token and request.

    .venv/bin/python bench/proxy_latency.py [--streams 1,64,256] [--pace 256x25] [--requests-per-stream 8]
                                            [--workers 1,2] [--arrivals herd,staggered,batched] [--rounds 2]
                                            [--baseline /work/main] [--bare] [--proxy-alone] [--nginx] [--tokens 32]
                                            [--api llamacpp|sglang|chat|completions|messages]

An upstream process serves deterministic SSE streams (`--tokens` per response, 32 unless told; `--api sglang`:
SGLang's /generate, whose every event repeats the text and output_ids so far, not llama.cpp's /completion); the
real daemon (`powerprof daemon --simulate --upstream URL`, recording and attribution on) runs in another
process. For each case the same load goes direct and through the proxy, alternating, and the
table gives median/p95 time to first byte and total time, and requests and tokens per second.
Machine noise affects both sides alike; read the ratios.

Cases: the stress bench (`--streams`: tokens 2 ms apart, every process sharing the machine's
cores) and a GPU-like pace (`--pace STREAMSxGAP_MS`: 256 streams at 25 ms per token, about
40 tokens/s each, as a batched GPU server emits them). CPU: the daemon process's user+system time
during the proxied runs, minus its simulator threads (`sim-*`) and minus its idle rate measured
before (sampling, flushes), divided by the tokens and requests that passed.

`--arrivals herd,staggered,batched` (the GPU-like case; stress cases are herds): herd = every
stream's requests start at the same instant and, all taking the same time, stay in lockstep, so
all streams' next requests arrive at once (each proxy's per-request cost is serialized across
the herd: the hardest case for the first byte); staggered = each stream's first request waits a
random time within one request's duration (same draws for direct and proxy), so arrivals spread
out as under independent clients, each stream's tokens on its own 25 ms clock; batched =
staggered starts, and every stream's tokens on one shared 25 ms clock, as a batching server
emits a token for every running request at each decode step (the chunks reach the proxy
together). All are printed, labelled.

`--baseline /work/main`: a second daemon runs from that source tree (`before`) beside this
tree's (`after`), both measured in the same rounds.

`--bare`: a bare TCP relay (bench/proxy_floor.py's: uvloop protocols, each read written on, no
HTTP, no counting) in its own process is measured as one more path in the same rounds: what any
forwarder in a separate process adds on this machine, whatever it does per byte. `--proxy-alone`:
`Proxy` with a null recorder in its own process (`alone`; no ledger, sampler or flushes), so
what the daemon around the proxy adds shows apart. `--nginx`: nginx (bench/_nginx.py: one worker process,
`proxy_buffering off`, HTTP/1.1 keep-alive upstream, a config generated in the bench's temp dir, started
and stopped by the bench; skipped, saying so, where nginx is not installed) as one more path: what a
native forwarder costs per token on this machine, its worker's CPU read per thread like the others'.

`--workers 1,2`: one daemon per value (`proxy.workers`: 1 = the proxy in the daemon, N > 1 = N
proxy processes on SO_REUSEPORT whose records the daemon replays), all started at once; each
round runs direct, then each daemon's proxy in turn. CPU then sums the daemon and its worker
processes (all of them, per thread, minus the simulator's threads and the idle rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _daemon import wait_for_daemon_info  # bench/ is on sys.path when a bench runs
from _nginx import start_nginx

TOKENS = 32
GAP_S = 0.002
APIS = ("llamacpp", "sglang", "chat", "completions", "messages")  # the upstream's dialects (--api)
# Each dialect's path: llama.cpp's /completion, SGLang's /generate, and vLLM's OpenAI and Anthropic routes.
API_PATHS = {"llamacpp": "/completion", "sglang": "/generate", "chat": "/v1/chat/completions",
             "completions": "/v1/completions", "messages": "/v1/messages"}


def upstream_main(port_file: str) -> None:
    from aiohttp import web

    async def completion(request):
        doc = json.loads(await request.read())
        gap_s = float(doc.get("gap_ms", GAP_S * 1e3)) / 1e3
        tokens = int(doc.get("n_predict", TOKENS))
        steps = bool(doc.get("steps"))  # tokens on one shared clock, as a batching server's decode steps
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            await resp.write(b'data: {"content":"tok ","tokens":[%d],"stop":false}\n\n' % i)
            await asyncio.sleep(gap_s - time.monotonic() % gap_s if steps else gap_s)
        await resp.write(b'data: {"content":"","stop":true,"tokens_predicted":%d}\n\n' % tokens)
        await resp.write_eof()
        return resp

    async def generate(request):
        """SGLang's /generate as its http_server writes it (orjson, compact): each event the text and output_ids so
        far and meta_info with the running completion_tokens; the last with its finish_reason, then [DONE]."""
        doc = json.loads(await request.read())
        gap_s = float(doc.get("gap_ms", GAP_S * 1e3)) / 1e3
        tokens = int(doc.get("sampling_params", {}).get("max_new_tokens", TOKENS))
        steps = bool(doc.get("steps"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        text, ids, t0 = [], [], time.monotonic()
        for i in range(1, tokens + 1):
            text.append(b" tok")
            ids.append(b"%d" % (100_000 + 7919 * i % 50_000))  # token ids of a 150k vocabulary: 6 digits
            fr = b'{"type":"length","length":%d}' % tokens if i == tokens else b"null"
            await resp.write(b'data: {"text":"%b","output_ids":[%b],"meta_info":{"id":"4f1c2b7a9e8d4c3b",'
                             b'"finish_reason":%b,"prompt_tokens":5,"weight_version":"default","completion_tokens":%d,'
                             b'"cached_tokens":0,"e2e_latency":%.4f}}\n\n'
                             % (b"".join(text), b",".join(ids), fr, i, time.monotonic() - t0))
            if i < tokens:
                await asyncio.sleep(gap_s - time.monotonic() % gap_s if steps else gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def openai(request):
        """vLLM's OpenAI streams as its serving_chat / serving_completion write them: chat opens with a role chunk,
        one content (completions: text) chunk a token, the finish chunk, a usage chunk (stream_options'
        include_usage), then [DONE]."""
        doc = json.loads(await request.read())
        gap_s = float(doc.get("gap_ms", GAP_S * 1e3)) / 1e3
        tokens = int(doc.get("max_tokens", TOKENS))
        steps = bool(doc.get("steps"))
        chat = request.path.endswith("/chat/completions")
        head = (b'{"id":"chatcmpl-4f1c2b7a9e8d4c3b","object":"chat.completion.chunk","created":1764000000,'
                b'"model":"m","choices":[{"index":0,' if chat else
                b'{"id":"cmpl-4f1c2b7a9e8d4c3b","object":"text_completion","created":1764000000,"model":"m",'
                b'"choices":[{"index":0,')
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:
            await resp.write(b'data: ' + head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                             b'"finish_reason":null}]}\n\n')
        for i in range(tokens):
            last = i == tokens - 1
            fr = b'"length"' if last else b"null"
            body = (b'"delta":{"content":" tok"},"logprobs":null,"finish_reason":%b}]}' if chat else
                    b'"text":" tok","logprobs":null,"finish_reason":%b,"stop_reason":null}]}') % fr
            await resp.write(b"data: " + head + body + b"\n\n")
            if not last:
                await asyncio.sleep(gap_s - time.monotonic() % gap_s if steps else gap_s)
        await resp.write(b'data: ' + head.split(b'"choices"')[0] + b'"choices":[],"usage":{"prompt_tokens":5,'
                         b'"total_tokens":%d,"completion_tokens":%d}}\n\n' % (5 + tokens, tokens))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def messages(request):
        """Anthropic's Messages stream as vLLM's /v1/messages writes it: named events, message_start with the
        prompt's usage, one content_block_delta a token, message_delta with the output count, message_stop."""
        doc = json.loads(await request.read())
        gap_s = float(doc.get("gap_ms", GAP_S * 1e3)) / 1e3
        tokens = int(doc.get("max_tokens", TOKENS))
        steps = bool(doc.get("steps"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_4f1c2b7a9e8d4c3b",'
                         b'"type":"message","role":"assistant","content":[],"model":"m","stop_reason":null,'
                         b'"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":0}}}\n\n'
                         b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
                         b'"content_block":{"type":"text","text":""}}\n\n')
        for i in range(tokens):
            await resp.write(b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                             b'"delta":{"type":"text_delta","text":" tok"}}\n\n')
            if i < tokens - 1:
                await asyncio.sleep(gap_s - time.monotonic() % gap_s if steps else gap_s)
        await resp.write(b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
                         b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens",'
                         b'"stop_sequence":null},"usage":{"output_tokens":%d}}\n\n'
                         b'event: message_stop\ndata: {"type":"message_stop"}\n\n' % tokens)
        await resp.write_eof()
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/completion", completion)
        app.router.add_post("/generate", generate)
        app.router.add_post("/v1/chat/completions", openai)
        app.router.add_post("/v1/completions", openai)
        app.router.add_post("/v1/messages", messages)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(run())


async def load(url: str, streams: int, per_stream: int, gap_s: float = GAP_S, tokens: int = TOKENS,
               stagger_s: float = 0.0, seed: int = 0, steps: bool = False, api: str = "llamacpp") -> dict:
    """`stagger_s` > 0: each stream's first request waits a random time in [0, stagger_s) (the same
    draws for every path, by `seed`), so the streams' requests arrive spread out instead of as one herd.
    `steps`: the upstream sends every stream's tokens on one shared clock of `gap_s` (decode steps).
    `api`: llamacpp (/completion, a token an event), sglang (/generate, each event its text and ids so far), chat,
    completions or messages (vLLM's /v1/chat/completions, /v1/completions, /v1/messages: a token an event)."""
    import random

    import aiohttp

    ttfb, total = [], []
    rng = random.Random(seed)
    delays = [rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0 for _ in range(streams)]
    if api not in APIS:
        raise SystemExit(f"--api: one of {', '.join(APIS)}, not {api!r}")
    path = API_PATHS[api]
    pace = {"stream": True, "gap_ms": gap_s * 1e3, "steps": steps}
    body = json.dumps({"prompt": "bench", "n_predict": tokens, **pace} if api == "llamacpp" else
                      {"text": "bench", "sampling_params": {"max_new_tokens": tokens}, **pace} if api == "sglang" else
                      {"model": "m", "messages": [{"role": "user", "content": "bench"}], "max_tokens": tokens,
                       "stream_options": {"include_usage": True}, **pace} if api == "chat" else
                      {"model": "m", "prompt": "bench", "max_tokens": tokens, "stream_options": {"include_usage": True},
                       **pace} if api == "completions" else
                      {"model": "m", "messages": [{"role": "user", "content": "bench"}], "max_tokens": tokens, **pace})
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(delay_s):
            if delay_s:
                await asyncio.sleep(delay_s)
            for _ in range(per_stream):
                t0 = time.perf_counter()
                async with s.post(url + path, data=body) as r:
                    first = None
                    async for _chunk in r.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                t1 = time.perf_counter()
                ttfb.append(first - t0)
                total.append(t1 - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(d) for d in delays))
        wall = time.perf_counter() - t0
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    n = streams * per_stream
    return {"ttfb_p50_ms": 1e3 * statistics.median(ttfb), "ttfb_p95_ms": 1e3 * q(ttfb, 0.95),
            "total_p50_ms": 1e3 * statistics.median(total), "total_p95_ms": 1e3 * q(total, 0.95),
            "req_s": n / wall, "tok_s": n * tokens / wall}


class CpuMeter:
    """The daemon's CPU seconds (and its proxy workers') without its simulator threads, per thread from
    /proc/<pid>/task/*/schedstat (nanoseconds on the CPU; the clock-tick counts of /proc/<pid>/stat are too
    coarse for one request). A worker restarted mid-run would lose its predecessor's time: none is expected."""

    def __init__(self, pid: int):
        self.pid = pid

    def pids(self) -> list[int]:
        kids = []
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.pid:
                        kids.append(int(p.name))
                except (OSError, ValueError, IndexError):
                    continue
        return [self.pid, *kids]

    def own_s(self) -> float:
        return sum(self.split_s())

    def split_s(self) -> tuple[float, float]:
        """(the daemon's own process, its children summed)."""
        out = [0, 0]
        for pid in self.pids():
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            for task in tasks:
                try:
                    if (task / "comm").read_text().startswith("sim-"):
                        continue
                    out[pid != self.pid] += int((task / "schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # the thread ended
        return out[0] / 1e9, out[1] / 1e9


def run_case(label: str, direct: str, proxies: dict, streams: int, per_stream: int, gap_s: float, rounds: int,
             meters: dict, idle_rates: dict, stagger_s: float = 0.0, steps: bool = False, tokens: int = TOKENS,
             api: str = "llamacpp") -> dict:
    """`proxies`, `meters`, `idle_rates`: by name (one per daemon). Returns by name: ratio to direct, added
    ttfb and per-token time at p50, CPU per token and per request."""
    res = {"direct": [], **{name: [] for name in proxies}}
    cpu_s = dict.fromkeys(proxies, 0.0)
    kids_s = dict.fromkeys(proxies, 0.0)  # of which the worker processes
    names = list(proxies)
    for i in range(rounds):
        # Direct first, then the proxies in an order rotated each round: none is always the last.
        order = names[i % len(names):] + names[:i % len(names)]
        for name, url in (("direct", direct), *((n, proxies[n]) for n in order)):
            if name != "direct":
                (p0, k0), t0 = meters[name].split_s(), time.perf_counter()
            res[name].append(asyncio.run(load(url, streams, per_stream, gap_s, tokens, stagger_s=stagger_s, seed=i,
                                              steps=steps, api=api)))
            if name != "direct":
                p1, k1 = meters[name].split_s()
                cpu_s[name] += max(0.0, p1 + k1 - p0 - k0 - idle_rates[name] * (time.perf_counter() - t0))
                kids_s[name] += k1 - k0
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in res.items()}
    for name in res:
        m = med[name]
        print(f"{label:>18s}  {name:9s}  {m['ttfb_p50_ms']:11.2f}  {m['ttfb_p95_ms']:11.2f}  "
              f"{m['total_p50_ms']:12.2f}  {m['total_p95_ms']:12.2f}  {m['req_s']:7.1f}  {m['tok_s']:7.0f}")
    d = med["direct"]
    n_req = rounds * streams * per_stream
    out = {}
    for name in proxies:
        p = med[name]
        out[name] = r = {"ratio": p["tok_s"] / d["tok_s"], "ttfb_ms": p["ttfb_p50_ms"] - d["ttfb_p50_ms"],
                         "per_token_ms": (p["total_p50_ms"] - d["total_p50_ms"]) / tokens, "tok_s": p["tok_s"],
                         "cpu_us_token": 1e6 * cpu_s[name] / (n_req * tokens), "cpu_us_request": 1e6 * cpu_s[name] / n_req,
                         "workers_us_token": 1e6 * kids_s[name] / (n_req * tokens)}
        split = (f" (workers {r['workers_us_token']:.1f}, the daemon's replay and accounts "
                 f"{r['cpu_us_token'] - r['workers_us_token']:.1f})" if r["workers_us_token"] > 0 and name != "nginx"
                 else "")  # nginx's CPU is its worker's (its master idles)
        print(f"{label:>18s}  {name:9s} added ttfb {r['ttfb_ms']:+.2f} ms, {r['per_token_ms']:+.3f} ms per token (p50); "
              f"throughput proxy/direct {r['ratio']:.2f}; proxy CPU {r['cpu_us_token']:.1f} us/token{split}, "
              f"{r['cpu_us_request']:.0f} us/request")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="1,64,256", help="stress cases: concurrent streams, tokens 2 ms apart")
    ap.add_argument("--pace", default="256x25", help="GPU-like case STREAMSxGAP_MS; empty to skip")
    ap.add_argument("--requests-per-stream", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help="tokens per streamed response (32: short answers, per-request work weighs most; "
                         "256: a chat answer's length, per-request work spread over more tokens)")
    ap.add_argument("--api", default="llamacpp", choices=APIS,
                    help="the upstream's dialect: llamacpp (/completion, one token an event), sglang (SGLang's "
                         "/generate: each event repeats the text and output_ids so far), or vLLM's chat, completions "
                         "or messages (/v1/chat/completions, /v1/completions, /v1/messages)")
    ap.add_argument("--rounds", type=int, default=2, help="direct/proxy alternations per case")
    ap.add_argument("--workers", default="1", help="proxy.workers of each daemon to compare, e.g. 1,2")
    ap.add_argument("--arrivals", default="herd,staggered,batched",
                    help="GPU-like case: herd (every stream's requests start at once and stay in lockstep), "
                         "staggered (each stream starts at a random phase of one request's duration), "
                         "batched (staggered starts, every stream's tokens on one shared decode-step clock)")
    ap.add_argument("--baseline", default="",
                    help="a source tree (e.g. /work/main) whose daemon runs beside this one's, as 'before'")
    ap.add_argument("--bare", action="store_true",
                    help="also a bare TCP relay (bench/proxy_floor.py's: no HTTP, no counting) as one more path: "
                         "the floor for any forwarder in its own process on this machine")
    ap.add_argument("--proxy-alone", action="store_true",
                    help="also `Proxy` with a null recorder in its own process (bench/proxy_floor.py's 'proxy'): "
                         "the proxy without the daemon around it")
    ap.add_argument("--nginx", action="store_true",
                    help="also nginx (one worker, proxy_buffering off, keep-alive upstream) as one more path: "
                         "what a native forwarder costs per token here; skipped with a message if not installed")
    a = ap.parse_args()
    workers = [int(x) for x in a.workers.split(",") if x]
    arrivals = [x for x in a.arrivals.split(",") if x]
    if any(x not in ("herd", "staggered", "batched") for x in arrivals):
        raise SystemExit(f"--arrivals: herd, staggered and/or batched, not {a.arrivals!r}")
    trees = [("", os.environ.get("PYTHONPATH", ""))]
    if a.baseline:
        if not (Path(a.baseline) / "powerprof" / "daemon" / "proxy.py").is_file():
            raise SystemExit(f"--baseline {a.baseline}: no powerprof/daemon/proxy.py there")
        trees = [("before", str(Path(a.baseline).resolve())), ("after", str(Path(__file__).resolve().parent.parent))]
    tmp = Path(tempfile.mkdtemp(prefix="powerprof-bench-"))
    port_file = tmp / "port"
    up = subprocess.Popen([sys.executable, __file__, "--upstream", str(port_file)])
    daemons = {}
    try:
        for _ in range(400):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        direct = f"http://127.0.0.1:{port_file.read_text()}"
        infos = {}
        for tree, pythonpath in trees:
            for w in workers:
                name = "proxy" if len(workers) == 1 else f"workers={w}"
                name = f"{tree}:{name}" if tree and len(workers) > 1 else (tree or name)
                key = f"{tree}{w}"
                data = tmp / f"data-{key}"
                env = {**os.environ, "POWERPROF_SIM_STATE": str(tmp / f"sim-{key}.json"),
                       "POWERPROF_PROXY_WORKERS": str(w), "PYTHONPATH": pythonpath}
                daemons[name] = subprocess.Popen(
                    [sys.executable, "-m", "powerprof.cli", "daemon", "--simulate", "--upstream", direct, "--data-dir",
                     str(data), "--listen", "127.0.0.1:0", "--metrics-listen", "", "--tag-socket",
                     str(tmp / f"t{key}.sock")],
                    stdout=open(tmp / f"daemon-{key}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                    cwd=pythonpath if tree else None)  # `-m` puts the working directory first on sys.path
                infos[name] = data
        proxies = {name: wait_for_daemon_info(data)["proxy"] for name, data in infos.items()}
        for name, kind, wanted in (("bare", "bare", a.bare), ("alone", "proxy", a.proxy_alone)):
            if not wanted:
                continue
            relay_file = tmp / f"{name}-port"
            daemons[name] = subprocess.Popen([sys.executable, str(Path(__file__).with_name("proxy_floor.py")), "--relay",
                                              port_file.read_text(), str(relay_file), kind])
            for _ in range(600):
                if relay_file.exists() and relay_file.read_text():
                    break
                time.sleep(0.05)
            proxies[name] = f"http://127.0.0.1:{relay_file.read_text()}"
        if a.nginx:
            started = start_nginx(int(port_file.read_text()), tmp)
            if isinstance(started, str):
                print(f"--nginx: {started}")
            else:  # the master's CPU and its worker's, summed (the master idles)
                daemons["nginx"], proxies["nginx"] = started
        asyncio.run(load(direct, 4, 2, api=a.api))
        for url in proxies.values():
            asyncio.run(load(url, 4, 2, api=a.api))  # warm every path
        meters = {name: CpuMeter(p.pid) for name, p in daemons.items()}
        c0, t0 = {n: m.own_s() for n, m in meters.items()}, time.perf_counter()
        time.sleep(3.0)
        idle = {n: (m.own_s() - c0[n]) / (time.perf_counter() - t0) for n, m in meters.items()}
        print(f"{a.tokens} tokens per streamed response ({a.api}); {a.requests_per_stream} requests per stream; "
              f"medians of "
              f"{a.rounds} alternating rounds; idle CPU (subtracted): "
              + ", ".join(f"{n} {100 * r:.2f} % of a core" for n, r in idle.items())
              + f"; {os.cpu_count()} CPUs shared by the upstream, the load generator and every daemon")
        print("              case  path       ttfb_p50_ms  ttfb_p95_ms  total_p50_ms  total_p95_ms    req_s    tok_s")
        results = {}
        for streams in [int(x) for x in a.streams.split(",") if x]:
            label = f"{streams}@{GAP_S * 1e3:g}ms"
            results[label] = run_case(label, direct, proxies, streams, a.requests_per_stream, GAP_S, a.rounds,
                                      meters, idle, tokens=a.tokens, api=a.api)
        if a.pace:
            n, gap_ms = (float(x) for x in a.pace.split("x"))
            for mode in arrivals:
                # staggered: random phases over one request's duration, so arrivals are spread evenly
                stagger_s = a.tokens * gap_ms / 1e3 if mode != "herd" else 0.0
                results[f"pace {mode}"] = run_case(f"{int(n)}@{gap_ms:g}ms {mode}", direct, proxies, int(n),
                                                   a.requests_per_stream, gap_ms / 1e3, a.rounds, meters, idle,
                                                   stagger_s=stagger_s, steps=mode == "batched", tokens=a.tokens,
                                                   api=a.api)
        print("summary (issue 13 targets in brackets):")
        for k, by in results.items():
            note = "  [stress: >= 0.90; before this change 0.62 at 64 streams]" if k.startswith("64@") else ""
            if k.startswith("pace"):
                note = "  [>= 0.99x, ttfb <= +0.5 ms, <= +0.2 ms per token]"
            for name, r in by.items():
                print(f"  {k:>14s} {name:9s}: throughput {r['ratio']:.2f}x direct, ttfb {r['ttfb_ms']:+.2f} ms, "
                      f"{r['per_token_ms']:+.3f} ms/token, proxy CPU {r['cpu_us_token']:.1f} us/token "
                      f"[<= 10], {r['cpu_us_request']:.0f} us/request{note}")
            if len(by) > 1:
                (n1, r1), *rest = by.items()
                print(f"  {k:>14s} " + "; ".join(f"{n}/{n1}: throughput {r['tok_s'] / r1['tok_s']:.2f}x, CPU per token "
                                                 f"{r['cpu_us_token'] / r1['cpu_us_token']:.2f}x" for n, r in rest))
    finally:
        for p in daemons.values():
            p.terminate()
        for p in daemons.values():
            p.wait(60)
        up.terminate()
        up.wait(10)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--upstream":
        upstream_main(sys.argv[2])
    else:
        main()
