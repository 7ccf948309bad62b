"""A small simulated inference server for `powerprof daemon --simulate`, driving the simulated GPUs.

Stop-gap until the workload issue's `powerprof.sim.server.SimServer` lands on main.
TODO(lead, at merge): make `powerprof daemon --simulate` start SimServer instead and delete this
module (its `/_sim/sent/{nonce}` echo is used by tests/test_daemon_e2e.py to compare the bytes the
server sent with the bytes the client received; keep an equivalent there or in the tests).

Speaks llama.cpp's `/completion` and the OpenAI `/v1/completions` and `/v1/chat/completions`
dialects, streamed (SSE) or not; `/health`, `/slots` (live `n_decoded`) and a vLLM-style
`/metrics` generation counter. While any request is in prefill the GPUs run a prefill phase,
otherwise a decode phase whose compute share grows with the batch, otherwise idle; token pacing
follows the GPU's speed factor, so a power cap slows it down as on real hardware.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import OrderedDict

from aiohttp import web

from powerprof.sim.gpu import IDLE, Phase

WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "watt", "joule", "token", "clock", "decode", "cap", "sweet")
SENT_KEEP = 4096


class SimUpstream:
    def __init__(self, nvml, model: str = "sim-model", seed: int = 0):
        self.nvml = nvml
        self.gpus = list(nvml.gpus)
        self.model = model
        self.seed = seed
        self.workload = nvml.profile.workload
        self.prefilling = 0
        self.decoding = 0
        self.generated_total = 0
        self.slots: dict[int, dict] = {}
        self._next_task = 0
        self.sent: OrderedDict[str, bytes] = OrderedDict()

    # --- the GPU side --------------------------------------------------------------------------

    def _compute_share(self) -> float:
        c = self.workload.decode_compute_share
        n = max(self.decoding, 1)
        return 1.0 - (1.0 - c) / (1.0 + self.workload.batch_compute_growth * (n - 1) / 4)

    def _update_phase(self) -> None:
        if self.prefilling:
            phase = Phase("prefill", 0.9)
        elif self.decoding:
            phase = Phase("decode", round(self._compute_share(), 3))
        else:
            phase = IDLE
        for g in self.gpus:
            g.set_phase(phase)

    def _token_delay_s(self) -> float:
        g = self.gpus[0]
        speed = g.speed_factor(self._compute_share())
        # Batching: per-stream speed falls slowly with the batch while the aggregate rises.
        per_stream = self.workload.decode_tok_s * speed / (1.0 + 0.04 * max(self.decoding - 1, 0))
        return 1.0 / per_stream

    # --- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/slots", self.get_slots)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/_sim/sent/{nonce}", self.get_sent)
        app.router.add_post("/completion", self.generate)
        app.router.add_post("/completions", self.generate)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def health(self, _r):
        return web.json_response({"status": "ok"})

    async def get_slots(self, _r):
        return web.json_response([dict(id=k, **v) for k, v in sorted(self.slots.items())])

    async def metrics(self, _r):
        text = (
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="{self.model}"}} {float(self.generated_total)}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def get_sent(self, request):
        body = self.sent.get(request.match_info["nonce"])
        if body is None:
            return web.json_response({"error": "unknown nonce"}, status=404)
        return web.Response(body=body, content_type="application/octet-stream")

    def _remember(self, nonce: str | None, data: bytes) -> None:
        if not nonce:
            return
        self.sent[nonce] = self.sent.get(nonce, b"") + data
        self.sent.move_to_end(nonce)
        while len(self.sent) > SENT_KEEP:
            self.sent.popitem(last=False)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            doc = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON", "code": 400}}, status=400)
        path = request.path
        api = "llamacpp" if path in ("/completion", "/completions") else (
            "openai-chat" if path.endswith("chat/completions") else "openai-completions")
        if api == "openai-chat":
            prompt = "".join(str(m.get("content", "")) for m in doc.get("messages", []) if isinstance(m, dict))
        else:
            prompt = str(doc.get("prompt", ""))
        n_predict = int(doc.get("n_predict", doc.get("max_tokens", 16)) or 16)
        stream = bool(doc.get("stream", False))
        include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
        nonce = request.headers.get("X-Sim-Nonce")
        rng = random.Random(hashlib.sha256(f"{self.seed}/{prompt}".encode()).digest())
        prompt_n = max(1, len(prompt) // 4)
        self._next_task += 1
        task = self._next_task
        slot = min(set(range(len(self.slots) + 1)) - set(self.slots))
        self.slots[slot] = {"id_task": task, "n_decoded": 0, "is_processing": True}
        t_send = time.monotonic()
        resp = None
        self.prefilling += 1
        self._update_phase()
        in_prefill = True
        try:
            speed = self.gpus[0].speed_factor(0.9)
            await asyncio.sleep(prompt_n / (self.workload.prefill_tok_s * speed))
            self.prefilling -= 1
            in_prefill = False
            self.decoding += 1
            self._update_phase()
            t_first = time.monotonic()
            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)
                if api == "openai-chat":
                    await self._send(resp, nonce, self._chunk(api, task, None, role=True))
            pieces = []
            for i in range(n_predict):
                if i:
                    await asyncio.sleep(self._token_delay_s())
                word = rng.choice(WORDS) + " "
                pieces.append(word)
                self.generated_total += 1
                self.slots[slot]["n_decoded"] = i + 1
                if stream:
                    await self._send(resp, nonce, self._chunk(api, task, word, token_id=rng.randrange(32000), i=i))
            t_last = time.monotonic()
            timings = {
                "prompt_n": prompt_n,
                "prompt_ms": (t_first - t_send) * 1e3,
                "predicted_n": n_predict,
                "predicted_ms": (t_last - t_first) * 1e3,
                "predicted_per_second": (n_predict - 1) / (t_last - t_first) if t_last > t_first else None,
            }
            usage = {"prompt_tokens": prompt_n, "completion_tokens": n_predict, "total_tokens": prompt_n + n_predict}
            if stream:
                for part in self._final_chunks(api, task, n_predict, prompt_n, timings, usage, include_usage):
                    await self._send(resp, nonce, part)
                await resp.write_eof()
                return resp
            body = json.dumps(self._whole(api, task, "".join(pieces), n_predict, prompt_n, timings, usage)).encode()
            self._remember(nonce, body)
            return web.Response(body=body, content_type="application/json")
        finally:
            if in_prefill:
                self.prefilling -= 1
            else:
                self.decoding -= 1
            self.slots.pop(slot, None)
            self._update_phase()

    async def _send(self, resp, nonce, data: bytes) -> None:
        self._remember(nonce, data)
        await resp.write(data)

    def _chunk(self, api, task, text, role=False, token_id=0, i=0) -> bytes:
        if api == "llamacpp":
            doc = {"index": 0, "content": text, "tokens": [token_id], "stop": False, "id_slot": 0,
                   "tokens_predicted": i + 1, "tokens_evaluated": 0}
        elif api == "openai-chat":
            delta = {"role": "assistant", "content": None} if role else {"content": text}
            doc = {"id": f"chatcmpl-{task}", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        else:
            doc = {"id": f"cmpl-{task}", "object": "text_completion", "created": 0, "model": self.model,
                   "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

    def _final_chunks(self, api, task, n, prompt_n, timings, usage, include_usage) -> list[bytes]:
        def sse(doc):
            return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"

        if api == "llamacpp":
            return [sse({"index": 0, "content": "", "stop": True, "model": self.model, "tokens_predicted": n,
                         "tokens_evaluated": prompt_n, "stop_type": "limit", "timings": timings})]
        key = "delta" if api == "openai-chat" else "text"
        empty = {} if api == "openai-chat" else ""
        obj = "chat.completion.chunk" if api == "openai-chat" else "text_completion"
        out = [sse({"id": f"cmpl-{task}", "object": obj, "created": 0, "model": self.model,
                    "choices": [{"index": 0, key: empty, "finish_reason": "length"}], "timings": timings})]
        if include_usage:
            out.append(sse({"id": f"cmpl-{task}", "object": obj, "created": 0, "model": self.model, "choices": [],
                            "usage": usage}))
        out.append(b"data: [DONE]\n\n")
        return out

    def _whole(self, api, task, text, n, prompt_n, timings, usage) -> dict:
        if api == "llamacpp":
            return {"content": text, "model": self.model, "tokens_predicted": n, "tokens_evaluated": prompt_n,
                    "stop": True, "stop_type": "limit", "timings": timings}
        if api == "openai-chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = "text_completion"
        return {"id": f"cmpl-{task}", "object": obj, "created": 0, "model": self.model, "choices": [choice],
                "usage": usage, "timings": timings}
