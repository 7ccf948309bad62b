"""A minimal OpenAI-compatible streaming server over a random-weight Llama model, for bench/gpu_check.py only.

Not part of the product: it exists so the hardware check can put a real decode load on a GPU with no
network and no model download. The model is built in memory from a `transformers` LlamaConfig with
random weights (bf16 on a GPU, float32 and tiny on a CPU); tokens are bytes of the prompt in, ids out,
so no tokenizer is needed. Requests that arrive within `--gather-ms` (100 ms) of each other are decoded as one
batch (static batching: `powerprof measure` sends each concurrency level as one batch), and every
generated token is streamed the moment the generator hands it over.

Endpoints: GET /health, GET /v1/models, POST /v1/completions and /v1/chat/completions (stream or not,
`stream_options.include_usage`), GET /gpu_check/batches (the generator's own timing per batch), POST
/gpu_check/pulse (a square-wave matmul load for the sensor-coverage part). The last
token's chunk carries llama.cpp-style `timings` taken by the generator itself (prompt_ms: request start
to first token; predicted_ms: first to last token), which `powerprof measure` stores next to its own
stream timing.

    python bench/gpu_check_server.py --size 8b --port 0 --ready-file /tmp/ready.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

try:  # generate() only calls put() and end(), but some versions check the base class
    from transformers.generation.streamers import BaseStreamer
except ImportError:  # transformers missing: main() says so when it builds the model
    BaseStreamer = object

# Llama-architecture shapes (Llama 3.x family); random weights, so only the shapes matter.
SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
# No torch, no model: a fixed time per step. The server, batching, streaming and timing paths are the same,
# so CI (which has no torch) runs them end to end; only the GPU load is missing.
FAKE = "fake"
PAD_ID, BOS_ID, EOS_ID, BYTE_OFFSET = 0, 1, 2, 3
MAX_PROMPT_TOKENS = 2048
OWNER = "powerprof-gpu-check"


def encode(text: str) -> list[int]:
    """Byte-level ids with a BOS: no tokenizer to download, and prompt length tracks text length."""
    return [BOS_ID] + [BYTE_OFFSET + b for b in text.encode("utf-8")[: MAX_PROMPT_TOKENS - 1]]


def token_text(token_id: int) -> str:
    return f" t{token_id}"


@dataclass
class Job:
    """One request: its prompt ids, how many tokens it wants, and where its tokens go."""

    ids: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    t_submit_ns: int = field(default_factory=time.monotonic_ns)
    token_t_ns: list[int] = field(default_factory=list)
    gone: bool = False  # the client went away: stop generating for it

    @property
    def finished(self) -> bool:
        return self.gone or len(self.token_t_ns) >= self.max_tokens

    def timings(self) -> dict:
        t = self.token_t_ns
        n = len(t)
        span_ms = (t[-1] - t[0]) / 1e6 if n > 1 else 0.0
        return {
            "prompt_n": len(self.ids),
            "prompt_ms": (t[0] - self.t_submit_ns) / 1e6 if n else None,
            "predicted_n": n,
            "predicted_ms": span_ms,
            # (n - 1) tokens over first-to-last: the first token comes out of prefill.
            "predicted_per_second": (n - 1) / (span_ms / 1e3) if span_ms > 0 else None,
        }


def build_model(size: str, device: str):
    """A random-weight LlamaForCausalLM, initialised directly on `device` (bf16 on GPU, float32 on CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=4096, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                      pad_token_id=PAD_ID, tie_word_embeddings=False)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.eval()
    model.generation_config.pad_token_id = PAD_ID
    n_params = sum(p.numel() for p in model.parameters())
    return model, n_params, str(dtype).replace("torch.", "")


class FakeModel:
    """A torch-free stand-in for generate(): `step_ms` per decode step (more with a bigger batch), ids from the prompt."""

    dtype = "none"

    def __init__(self, step_ms: float = 8.0, per_seq_ms: float = 0.5, prefill_ms_per_token: float = 0.02):
        self.step_s, self.per_seq_s, self.prefill_s = step_ms / 1e3, per_seq_ms / 1e3, prefill_ms_per_token / 1e3

    def decode(self, batch: list["Job"], n_new: int, streamer) -> None:
        import numpy as np

        streamer.put(None)  # the prompt, as generate() hands it over first
        time.sleep(self.prefill_s * sum(len(j.ids) for j in batch))
        for k in range(n_new):
            time.sleep(self.step_s + self.per_seq_s * len(batch))
            streamer.put(np.array([BYTE_OFFSET + (len(j.ids) + k) % 256 for j in batch]))
        streamer.end()


class _AllGone(Exception):
    """Every client of a batch disconnected: generate() is stopped by raising through the streamer."""


class _Streamer(BaseStreamer):
    """transformers streamer: generate() calls put() with the prompt once, then each step's (batch,) tokens."""

    def __init__(self, jobs: list[Job], on_step):
        self.jobs = jobs
        self.on_step = on_step
        self._prompt_seen = False
        self.step = 0

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if all(j.gone for j in self.jobs):
            raise _AllGone()
        t = time.monotonic_ns()
        ids = value.reshape(-1).tolist()
        self.step += 1
        self.on_step(t)
        for job, tok in zip(self.jobs, ids):
            if not job.finished:
                job.token_t_ns.append(t)
                job.loop.call_soon_threadsafe(job.out.put_nowait, int(tok))
                if len(job.token_t_ns) == job.max_tokens:
                    job.loop.call_soon_threadsafe(job.out.put_nowait, None)

    def end(self) -> None:
        for job in self.jobs:
            if not job.finished:
                job.loop.call_soon_threadsafe(job.out.put_nowait, None)


class Engine:
    """One generator thread: gathers requests into a batch, runs generate(), streams tokens out."""

    def __init__(self, model, device: str, max_batch: int = 8, gather_s: float = 0.1):
        self.model, self.device = model, device
        self.max_batch, self.gather_s = max_batch, gather_s
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.batches: list[dict] = []  # the generator's own timing of each batch
        self._pulse_x = None
        self._thread = threading.Thread(target=self._run, name="gpu-check-engine", daemon=True)

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.jobs.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            first = self.jobs.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.gather_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    job = self.jobs.get(timeout=max(left, 0.0)) if left > 0 else self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self.jobs.put(None)
                    break
                batch.append(job)
            try:
                self._generate(batch)
            except _AllGone:
                pass
            except Exception as e:  # a failed batch ends its streams with an error, the server lives on
                print(f"gpu_check_server: batch failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                for job in batch:
                    job.loop.call_soon_threadsafe(job.out.put_nowait, e)

    def pulse(self, on_ms: float, period_ms: float, seconds: float, phase_ms: float = 0.0) -> dict:
        """Square-wave load: matmuls for on_ms at the start of every period, idle otherwise.

        For the sensor-coverage part of the check: a power sensor that sees only part of each period
        (Yang et al., SC'24) reports different energy for the same bursts at different phases.
        """
        if isinstance(self.model, FakeModel):
            raise RuntimeError("the fake model puts no load on any device: no pulse")
        import torch

        if self._pulse_x is None:
            n = 4096 if self.device.startswith("cuda") else 256
            self._pulse_x = torch.randn(n, n, device=self.device, dtype=self.model.dtype)
        x = self._pulse_x
        sync = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)
        period_ns, on_ns = int(period_ms * 1e6), int(on_ms * 1e6)
        t0 = time.monotonic_ns() + int(phase_ms * 1e6)
        n_periods = max(1, int(seconds * 1e3 / period_ms))
        busy_ns = 0
        matmuls = 0
        with torch.inference_mode():
            for k in range(n_periods):
                start = t0 + k * period_ns
                while (left := start - time.monotonic_ns()) > 0:
                    time.sleep(left / 1e9)
                b0 = time.monotonic_ns()
                while time.monotonic_ns() - b0 < on_ns:
                    x @ x
                    sync()
                    matmuls += 1
                busy_ns += time.monotonic_ns() - b0
        return {"bursts": n_periods, "busy_s": busy_ns / 1e9, "matmuls": matmuls}

    def _generate(self, batch: list[Job]) -> None:
        width = max(len(j.ids) for j in batch)
        n_new = max(j.max_tokens for j in batch)
        steps: list[int] = []
        streamer = _Streamer(batch, steps.append)
        t0 = time.monotonic_ns()
        aborted = False
        try:
            if isinstance(self.model, FakeModel):
                self.model.decode(batch, n_new, streamer)
            else:
                self._generate_torch(batch, width, n_new, streamer)
        except _AllGone:
            aborted = True  # its timing up to here is still the generator's own, so it is logged
            raise
        finally:
            rec = {"batch_size": len(batch), "prompt_tokens_max": width, "steps": len(steps), "aborted": aborted,
                   "t_start_ns": t0, "t_first_ns": steps[0] if steps else None, "t_last_ns": steps[-1] if steps else None}
            if len(steps) > 1:
                span = (steps[-1] - steps[0]) / 1e9
                rec["decode_s"] = span
                # Every row of a batch decodes every step (same max_tokens, as powerprof's measure sends).
                rec["decode_tok_s"] = len(batch) * (len(steps) - 1) / span
                rec["step_ms_median"] = sorted(b - a for a, b in zip(steps, steps[1:]))[(len(steps) - 1) // 2] / 1e6
            self.batches.append(rec)

    def _generate_torch(self, batch: list[Job], width: int, n_new: int, streamer: "_Streamer") -> None:
        import torch

        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for k, j in enumerate(batch):  # left padding: every row's last prompt token is aligned
            ids[k, width - len(j.ids):] = torch.tensor(j.ids)
            mask[k, width - len(j.ids):] = 1
        with torch.inference_mode():
            # min_new_tokens keeps EOS out, so every request gets exactly what it asked for.
            self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                                max_new_tokens=n_new, min_new_tokens=n_new, streamer=streamer, pad_token_id=PAD_ID)


class Server:
    """The HTTP side: OpenAI-compatible completions streamed from the Engine."""

    def __init__(self, engine: Engine, model_name: str, info: dict):
        self.engine, self.model_name, self.info = engine, model_name, info

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/gpu_check/batches", self.batches)
        app.router.add_post("/gpu_check/pulse", self.pulse)
        return app

    async def health(self, request):
        return web.json_response({"status": "ok"})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": OWNER, **self.info}]})

    async def batches(self, request):
        return web.json_response({"batches": self.engine.batches})

    async def pulse(self, request):
        b = await request.json()
        res = await asyncio.to_thread(self.engine.pulse, float(b["on_ms"]), float(b["period_ms"]), float(b["seconds"]),
                                      float(b.get("phase_ms", 0.0)))
        return web.json_response(res)

    async def completions(self, request):
        return await self._serve(request, chat=False)

    async def chat(self, request):
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool):
        try:
            body = await request.json()
            if chat:
                prompt = "\n".join(str(m.get("content", "")) for m in body["messages"])
            else:
                prompt = body["prompt"] if isinstance(body["prompt"], str) else str(body["prompt"][0])
            max_tokens = int(body.get("max_tokens") or 16)
            if not 1 <= max_tokens <= 4096:
                raise ValueError("max_tokens must be 1-4096")
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}", "type": "invalid_request_error"}},
                                     status=400)
        loop = asyncio.get_running_loop()
        job = Job(encode(prompt), max_tokens, loop, asyncio.Queue())
        self.engine.jobs.put(job)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            toks = await self._collect(job)
            if isinstance(toks, Exception):
                return web.json_response({"error": {"message": str(toks)}}, status=500)
            text = "".join(token_text(t) for t in toks)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return web.json_response({"id": rid, "object": kind, "created": created, "model": self.model_name,
                                      "choices": [choice], "usage": self._usage(job), "timings": job.timings()})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def send(obj) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(text: str | None, finish: str | None = None, **extra) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created,
                    "model": self.model_name, "choices": [choice], **extra}

        if chat:
            await send(chunk(None) | {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        sent = 0
        try:
            while True:
                item = await job.out.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    await send({"error": {"message": f"{type(item).__name__}: {item}"}})
                    return resp
                sent += 1
                last = sent == job.max_tokens
                if last:
                    await send(chunk(token_text(item), "length", timings=job.timings()))
                else:
                    await send(chunk(token_text(item)))
            if include_usage:
                await send({"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                            "usage": self._usage(job)})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:  # the client left (the check's background load stops this way)
            pass
        finally:
            job.gone = True  # finished or disconnected: either way its tokens are no longer wanted
        return resp

    @staticmethod
    def _usage(job: Job) -> dict:
        n = len(job.token_t_ns)
        return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n}

    @staticmethod
    async def _collect(job: Job):
        toks = []
        while True:
            item = await job.out.get()
            if item is None or isinstance(item, Exception):
                return toks if item is None else item
            toks.append(item)


def _load(size: str | None, device: str, t0: float):
    """Build and warm the random-weight model; its shape, dtype and load time for the report."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    size = size or ("8b" if device.startswith("cuda") else "tiny")
    torch.manual_seed(0)
    model, n_params, dtype = build_model(size, device)
    # One short generate compiles nothing but allocates the caches and loads the kernels.
    warm = Engine(model, device, max_batch=1)
    warm_loop = asyncio.new_event_loop()
    job = Job(encode("warm up"), 4, warm_loop, asyncio.Queue())
    warm._generate([job])
    warm_loop.close()
    info = {"size": size, "params": n_params, "dtype": dtype, "device": device, "load_s": round(time.monotonic() - t0, 2),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__}
    if device.startswith("cuda"):
        info["cuda_device"] = torch.cuda.get_device_name(torch.device(device))
    return size, device, model, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES) + [FAKE], default=None,
                    help=f"Model shape (default: 8b on a GPU, tiny on CPU); {FAKE}: no torch, a fixed time per step.")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (written to --ready-file).")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--gather-ms", type=float, default=100.0,
                    help="How long a batch waits for more requests (it starts at once when full).")
    ap.add_argument("--ready-file", default=None, help="Write {url, ...} here as JSON once serving.")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    if a.size == FAKE:
        size, device, model = FAKE, "none", FakeModel()
        info = {"size": size, "params": 0, "dtype": model.dtype, "device": device, "load_s": 0.0}
    else:
        size, device, model, info = _load(a.size, a.device, t0)
    engine = Engine(model, device, a.max_batch, a.gather_ms / 1e3).start()
    server = Server(engine, f"random-llama-{size}", info)

    async def serve() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, a.host, a.port)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{a.host}:{port}"
        ready = {"url": url, **info}
        print(json.dumps(ready), flush=True)
        if a.ready_file:
            with open(a.ready_file + ".tmp", "w") as f:
                json.dump(ready, f)
            import os

            os.replace(a.ready_file + ".tmp", a.ready_file)
        stop = asyncio.Event()
        for s in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(s, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
