"""Speculative-decoding counts a server keeps in its Prometheus metrics (vLLM's spec_decode counters).

llama.cpp reports drafts per request in `timings` (the windows carry them); vLLM only as
server-wide counters, so a configuration's figures are the counters' difference across it.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from .auth import auth_headers

DRAFT_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_decode_counts(base_url: str, timeout_s: float = 10.0) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) the server counted since it started, or None without such counters."""
    try:
        req = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=auth_headers())
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            text = r.read().decode("utf-8", "replace")
    except OSError:
        return None
    totals = {name: None for name in DRAFT_COUNTERS}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name in totals:
                vals = [s.value for s in fam.samples if s.name.endswith("_total")]
                if vals:
                    totals[fam.name] = float(sum(vals))
    except ValueError:
        return None
    drafts, accepted = (totals[n] for n in DRAFT_COUNTERS)
    return None if drafts is None or accepted is None else (drafts, accepted)
