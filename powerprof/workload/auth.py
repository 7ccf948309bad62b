"""The API key of a server started with `--api-key` (llama-server, vLLM, SGLang), from the environment."""

from __future__ import annotations

import os

API_KEY_ENV = "POWERPROF_API_KEY"


def api_key_given(env=None) -> bool:
    return bool((os.environ if env is None else env).get(API_KEY_ENV, "").strip())


def auth_headers(env=None) -> dict[str, str]:
    """`Authorization: Bearer KEY` from $POWERPROF_API_KEY, on every request powerprof sends a server (runs, the
    daemon's scrapes): an environment variable, not a flag, so the key is in no process listing. {} without it."""
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    return {"Authorization": f"Bearer {key}"} if key else {}
