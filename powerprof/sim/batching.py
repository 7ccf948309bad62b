"""Continuous batching for the simulated server: the step-level cost model and each request's true energy.

One engine step runs, together, a chunk of prefill (prompts in arrival order, up to a token
budget) and one decode step of every sequence already past its prefill. Its time at the top SM
clock is

    t = base_s + per_seq_s·n + per_prefill_token_s·p + per_ctx_token_s·c

with n the sequences in the step (decoding or prefilling), p the prompt tokens prefilled and c
the context tokens (prompt + generated so far) of the decoding sequences: the weights are read
once per step (base), each sequence adds its own vectors, each prompt token its matmuls, each
context token its KV-cache reads. The step's true energy (the simulated GPU's exact integral over
the step) is split among its sequences by their cost: each its own terms plus an equal share of
base_s. A request's true energy is the sum of its shares (docs/simulator.md). Nothing outside
the simulator and the benches reads these costs; the daemon has to learn them from counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerprof.sim import knobs

PREFILL_COMPUTE_SHARE = 0.9  # a prefill step is compute-bound
PREFILL_BUDGET_TOKENS = 2048  # prompt tokens one step may prefill (chunked prefill)
CONTEXT_SHARE_AT_4K = 0.2  # a sequence at 4096 tokens of context takes this much longer per step (batch 1)


@dataclass(frozen=True)
class StepCosts:
    """Seconds at the top SM clock. `from_workload` derives them from a profile's workload."""

    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_ctx_token_s: float

    @classmethod
    def from_workload(cls, wl, draft: int, decode_tok_s: float | None = None, prefill_tok_s: float | None = None,
                      compute_share: float | None = None) -> "StepCosts":
        """Costs of an engine with `draft` draft tokens (0: plain decode) on workload `wl`; the
        speeds and share default to the workload's."""
        # Batch-1 decode takes the serial engine's single-stream step (sim/knobs.py: at the
        # profile's own draft, expected tokens per step / decode_tok_s, so one stream decodes at
        # decode_tok_s); each extra stream adds compute_share·batch_growth of it (the serial
        # engine's batch model), so both engines agree at every batch size.
        step1 = knobs.decode_step_s(wl, draft, decode_tok_s)
        share = wl.decode_compute_share if compute_share is None else compute_share
        per_seq = step1 * share * wl.batch_compute_growth
        return cls(
            base_s=step1 - per_seq,
            per_seq_s=per_seq,
            per_prefill_token_s=1.0 / (prefill_tok_s or wl.prefill_tok_s),
            per_ctx_token_s=step1 * CONTEXT_SHARE_AT_4K / 4096,
        )

    def seq_costs_s(self, prefill_tokens: np.ndarray, ctx_tokens: np.ndarray) -> np.ndarray:
        """Each sequence's cost in one step (its own terms plus an equal share of base_s).

        prefill_tokens: prompt tokens it prefills in the step (0 when decoding); ctx_tokens: its
        context when it decodes in the step (0 when prefilling)."""
        p = np.asarray(prefill_tokens, dtype=float)
        c = np.asarray(ctx_tokens, dtype=float)
        n = p.size
        if n == 0:
            return np.zeros(0)
        return self.base_s / n + self.per_seq_s + self.per_prefill_token_s * p + self.per_ctx_token_s * c

    def step_s(self, prefill_tokens: np.ndarray, ctx_tokens: np.ndarray) -> float:
        """The step's time at the top SM clock: the sum of its sequences' costs."""
        return float(self.seq_costs_s(prefill_tokens, ctx_tokens).sum())

    def compute_share(self, prefill_tokens: np.ndarray, decode_share: float) -> tuple[str, float]:
        """(phase kind, compute share) of a step: prefill time is compute-bound, the rest decodes at
        `decode_share` (the batch's share)."""
        p = float(np.sum(prefill_tokens))
        n = np.asarray(prefill_tokens).size
        total = self.base_s + self.per_seq_s * n + self.per_prefill_token_s * p
        t_prefill = self.per_prefill_token_s * p
        share = (PREFILL_COMPUTE_SHARE * t_prefill + decode_share * (total - t_prefill)) / total if total > 0 else 0.0
        decoding = np.count_nonzero(np.asarray(prefill_tokens) == 0)
        return ("decode" if decoding else "prefill"), share


def plan_prefill(remaining: list[int], budget: int = PREFILL_BUDGET_TOKENS) -> list[int]:
    """Prompt tokens to prefill this step for each waiting sequence, first come first served."""
    out, left = [], budget
    for r in remaining:
        take = max(0, min(int(r), left))
        out.append(take)
        left -= take
    return out


def shares(costs_s: np.ndarray, energy_j: float) -> np.ndarray:
    """A step's energy split by its sequences' costs (their true energy in that step)."""
    c = np.asarray(costs_s, dtype=float)
    total = c.sum()
    return c * (energy_j / total) if total > 0 else np.zeros_like(c)
