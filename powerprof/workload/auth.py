"""The API key of a server started with `--api-key` (llama-server, vLLM, SGLang), from the environment."""

from __future__ import annotations

import os
import re

API_KEY_ENV = "POWERPROF_API_KEY"


# The longest key sent: servers refuse a header past 8-16 KiB (a 100,000-character key came back as a 431, read as
# "neither llama.cpp nor OpenAI-compatible"); real keys are tens of characters.
MAX_API_KEY_CHARS = 4096


class ApiKeyError(ValueError):
    """$POWERPROF_API_KEY holds what no HTTP header can carry: the message names the variable, never the key."""


def api_key_given(env=None) -> bool:
    return bool((os.environ if env is None else env).get(API_KEY_ENV, "").strip())


def api_key(env=None) -> str:
    """The key from $POWERPROF_API_KEY, spaces at its ends dropped ('' without one), checked once here for every
    reader: one line of printable ASCII, at most MAX_API_KEY_CHARS. A line break or control character was aiohttp's
    "Potential header injection attack", naming no variable. ApiKeyError says which character, never the key."""
    key = (os.environ if env is None else env).get(API_KEY_ENV, "").strip()
    if len(key) > MAX_API_KEY_CHARS:
        raise ApiKeyError(f"{API_KEY_ENV} is {len(key)} characters long: an API key is at most {MAX_API_KEY_CHARS} "
                          "(servers refuse a longer header); set it to the key alone")
    for i, c in enumerate(key):
        if " " <= c <= "~":
            continue
        what = ("a line break" if c in "\r\n" else "a control character" if ord(c) < 32 or ord(c) == 127
                else "a character that is not ASCII")
        raise ApiKeyError(f"{API_KEY_ENV} holds {what} (character {i + 1} of {len(key)}): an API key travels in an "
                          "HTTP header (Authorization: Bearer KEY) and must be one line of printable ASCII; set it to "
                          "the key alone (the key is not shown here)")
    return key


def auth_headers(env=None) -> dict[str, str]:
    """`Authorization: Bearer KEY` from $POWERPROF_API_KEY, on every request powerprof sends a server (runs, the
    daemon's scrapes): an environment variable, not a flag, so the key is in no process listing. {} without it."""
    key = api_key(env)
    return {"Authorization": f"Bearer {key}"} if key else {}


# An HTTP field name (RFC 9110 token), and not one HTTP itself or the server's access rests on: a tag in Host,
# Content-Length, Transfer-Encoding or Connection changes how the request is framed or routed; in Authorization,
# Proxy-Authorization or Cookie it replaces the API key or credentials; in Content-Type how the body is read.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,128}")
RESERVED_HEADERS = ("Host", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "Proxy-Connection",
                    "TE", "Trailer", "Upgrade", "Expect", "Content-Type", "Content-Encoding", "Authorization",
                    "Proxy-Authorization", "Cookie")
_RESERVED = {h.lower() for h in RESERVED_HEADERS}


def check_tag_header(name) -> str:
    """The header a tag travels in, as replay's --tag-header and the daemon's proxy.tag_header take it; ValueError
    saying why otherwise. '' and 'Bad Header' were aiohttp tracebacks in replay, a newline "Potential header injection
    attack", and Authorization or Host were taken by both (the tag then replaced the API key, or made a second Host)."""
    shown = repr(name) if len(str(name)) <= 40 else repr(str(name)[:40]) + f"… ({len(str(name))} characters)"
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise ValueError(f"{shown} is not an HTTP header name: 1-128 ASCII letters, digits or !#$%&'*+-.^_`|~ (no spaces, "
                         "colons or line breaks), e.g. X-Powerprof-Tag")
    if name.lower() in _RESERVED:
        raise ValueError(f"{shown} is a header HTTP or the server's access needs for itself (one of "
                         f"{', '.join(RESERVED_HEADERS)}): a tag there would replace it; use one of your own, "
                         "e.g. X-Powerprof-Tag")
    return name
