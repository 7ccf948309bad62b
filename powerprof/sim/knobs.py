"""The simulated server's own knobs: speculative draft count, slots and context, and what they cost.

Three effects of the seed's study (seed 000), as pure functions of a profile's `WorkloadDefaults`:

- **Speculative decoding.** The k-th draft token of a step is accepted, given that all before it
  were, with probability `a_k = a_1 − decay·(k−1)`; a step yields `1 + Σ_k Π_{j≤k} a_j` tokens on
  average and costs `1 + draft_cost·d` times a plain step (the draft head's forward passes and the
  wider verification batch). Beyond some draft count acceptance falls faster than the batch gains:
  on the seed card draft 3 is fastest for one stream.
- **Memory.** Weights and buffers, KV cache for the context, and recurrent-state snapshots:
  `slots × (draft + 1) × state size` (~150 MiB per sequence on the seed's hybrid model). A
  configuration that needs more than the card has fails at start, as llama.cpp does.
- **Context.** Each decode step reads the weights once and every sequence's KV cache: step time
  grows as `1 + Σ context / ctx_tokens_double`.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2


def acceptance_chain(wl, draft: int) -> list[float]:
    """Conditional acceptance probability of each draft position 1..draft."""
    return [max(0.0, min(1.0, wl.draft_acceptance - wl.draft_acceptance_decay * k)) for k in range(draft)]


def expected_tokens_per_step(wl, draft: int) -> float:
    """Tokens one decode step yields on average: the verified token plus the accepted drafts."""
    out, p = 1.0, 1.0
    for a in acceptance_chain(wl, draft):
        p *= a
        out += p
    return out


def step_cost(wl, draft: int) -> float:
    """Time of one speculative step relative to a plain decode step."""
    return 1.0 + wl.draft_cost * draft


def relative_speed(wl, draft: int) -> float:
    """Single-stream decode speed at this draft count relative to plain decode."""
    return expected_tokens_per_step(wl, draft) / step_cost(wl, draft)


def decode_step_s(wl, draft: int, decode_tok_s: float | None = None) -> float:
    """One single-stream decode step at f_max and a short context, with `draft` draft tokens.

    decode_tok_s (default the profile's) is quoted at the profile's own draft count, so a plain
    step takes relative_speed(own)/decode_tok_s and a step at the profile's own draft takes
    expected_tokens_per_step(own)/decode_tok_s: one stream decodes at decode_tok_s, whatever the
    engine (serial or continuous batching)."""
    own = wl.draft_n_max if wl.speculative else 0
    plain_step_s = relative_speed(wl, own) / (decode_tok_s or wl.decode_tok_s)
    return step_cost(wl, draft) * plain_step_s


def context_factor(wl, context_tokens: float) -> float:
    """Step time relative to an empty context: KV reads of every sequence on top of the weights."""
    if not wl.ctx_tokens_double:
        return 1.0
    return 1.0 + max(0.0, context_tokens) / wl.ctx_tokens_double


@dataclass(frozen=True)
class MemoryPlan:
    """What a configuration asks of the card's memory, in bytes."""

    weights_bytes: int
    kv_bytes: int
    state_bytes: int  # recurrent-state snapshots: slots × (draft + 1) × state size
    total_bytes: int  # the card

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes

    @property
    def fits(self) -> bool:
        return self.need_bytes <= self.total_bytes

    def oom_message(self) -> str:
        """The failure as llama.cpp logs it (the buffer that did not fit), plus the arithmetic."""
        short = (self.need_bytes - self.total_bytes) / MIB
        return (
            f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {self.state_bytes / MIB:.2f} MiB on device 0: "
            f"cudaMalloc failed: out of memory\n"
            f"llama_init_from_model: failed to allocate RS buffer (weights {self.weights_bytes / MIB:.0f} MiB + "
            f"KV {self.kv_bytes / MIB:.0f} MiB + recurrent state {self.state_bytes / MIB:.0f} MiB = "
            f"{self.need_bytes / MIB:.0f} MiB > {self.total_bytes / MIB:.0f} MiB, {short:.0f} MiB short)\n"
            f"common_init_from_params: failed to create context: out of memory"
        )


def memory_plan(profile, draft: int, n_slots: int, ctx_size: int) -> MemoryPlan:
    """Memory of a server with `n_slots` slots, `draft` draft tokens and `ctx_size` context tokens in all."""
    wl = profile.workload
    snapshots = draft + 1 if draft > 0 else 1
    return MemoryPlan(
        weights_bytes=int(wl.weights_bytes),
        kv_bytes=int(wl.kv_bytes_per_token * ctx_size),
        state_bytes=int(n_slots * snapshots * wl.state_bytes_per_seq),
        total_bytes=int(profile.memory_total_bytes),
    )
