"""`python -m powerprof.sim.serve`: the simulated server as a process with llama-server's knobs.

    python -m powerprof.sim.serve --profile seed-16g --port 8080 --spec-draft-n-max 3 -np 2 -c 16384

It is what `sweep --launch` starts on the simulated rig: it drives the simulated GPUs named by the
shared state file (`$POWERPROF_SIM_STATE`), publishes what they run so the sweeping process reads
the power of its work, and follows the power limits that process sets. A configuration that does
not fit the card's memory exits at start with llama.cpp's out-of-memory lines (sim/knobs.py).
"""

from __future__ import annotations

import argparse
import sys

from . import knobs
from .nvml import SimNVML
from .profiles import DEFAULT_PROFILE, PROFILES, get_profile
from .server import FLAVOURS, SimServer, until_signalled

SETTINGS_POLL_S = 0.02  # how soon a power limit set by another process slows this server


# SGLang's --tool-call-parser names as the simulator streams them (SimServer's tool_call_parser): its JSON detectors
# alike (True), the two that hold a call's text by name. A bare flag (before: an on/off switch) is a JSON detector.
TOOL_CALL_PARSERS = {"qwen25": True, "llama3": True, "mistral": True, "deepseekv3": "deepseekv3",
                     "qwen3_coder": "qwen3_coder"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m powerprof.sim.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES))
    ap.add_argument("--flavour", default="llamacpp", choices=list(FLAVOURS),
                    help="which server's wire formats and /metrics it speaks")
    ap.add_argument("--spec-draft-n-max", "--draft", "--draft-max", dest="draft", type=int, default=None,
                    help="draft tokens per step (0: no speculative decoding; default: the profile's)")
    ap.add_argument("-np", "--parallel", dest="n_slots", type=int, default=1, help="slots (concurrent sequences)")
    ap.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=16384, help="context tokens, all slots together")
    ap.add_argument("--loading-s", type=float, default=0.0, help="seconds /health answers 503 (model loading)")
    ap.add_argument("--decode-tok-s", type=float, default=None, help="single-stream speed at the profile's draft count")
    ap.add_argument("--prefill-tok-s", type=float, default=None, help="prompt tokens per second (default: the profile's)")
    ap.add_argument("--reasoning-tokens", type=int, default=0,
                    help="vllm/sglang: a thinking model behind --reasoning-parser, each chat answer thinking this many "
                         "tokens first (docs/simulator.md, Thinking, tool calls and chat echo)")
    ap.add_argument("--tool-call-parser", nargs="?", const="qwen25", default=None, choices=sorted(TOOL_CALL_PARSERS),
                    help="sglang: stream forced tool calls as this SGLang parser does: a JSON detector's (qwen25, "
                         "llama3, mistral; the default of a bare flag) a step a chunk, deepseekv3's whole once closed, "
                         "qwen3_coder's a parameter once closed (SimServer's tool_call_parser)")
    a = ap.parse_args(argv)
    if a.n_slots < 1 or a.ctx_size < 1 or (a.draft is not None and a.draft < 0) or a.reasoning_tokens < 0:
        ap.error("-np and -c must be at least 1, the draft count and --reasoning-tokens at least 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    profile = get_profile(a.profile)
    draft = profile.workload.draft_n_max if a.draft is None else a.draft
    if not profile.workload.speculative:
        draft = 0
    plan = knobs.memory_plan(profile, draft, a.n_slots, a.ctx_size)
    print(f"simulated llama_context: n_ctx = {a.ctx_size}, n_seq_max = {a.n_slots}, draft = {draft}", flush=True)
    print(f"simulated CUDA0 RS buffer size = {plan.state_bytes / knobs.MIB:.2f} MiB, "
          f"KV buffer size = {plan.kv_bytes / knobs.MIB:.2f} MiB", flush=True)
    if not plan.fits:
        print(plan.oom_message(), file=sys.stderr, flush=True)
        return 1
    nvml = SimNVML(profile.key)
    nvml.publish_load()
    srv = SimServer(nvml, flavour=a.flavour, host=a.host, port=a.port, n_slots=a.n_slots, loading_s=a.loading_s,
                    decode_tok_s=a.decode_tok_s, prefill_tok_s=a.prefill_tok_s, draft_n_max=draft, n_ctx=a.ctx_size,
                    reasoning_tokens=a.reasoning_tokens,
                    tool_call_parser=TOOL_CALL_PARSERS.get(a.tool_call_parser, False))
    with srv:
        print(f"simulated server listening on {srv.url}", flush=True)
        until_signalled(SETTINGS_POLL_S, nvml.sync_settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
