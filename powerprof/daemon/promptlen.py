"""A prompt's length where the server never says it: from the request body, at this server's own tokens per character.

A stream cut by its client (or one without `usage`) never tells the prompt's length, and without it
the prompt's prefill energy went to the requests beside it. The proxy keeps the size of the body's
prompt (its characters, never the text; or the count of a prompt given as token ids), and the ledger
turns characters into tokens at the ratio of the requests whose server did count them: tokens ≈ a +
b · characters, fitted over the last requests of that endpoint (the chat template's own tokens are
`a`). Before any such request: CHARS_PER_TOKEN characters a token (English text, BPE tokenizers).
"""

from __future__ import annotations

import json
from collections import deque
from itertools import chain, compress, repeat
from operator import contains, is_

import numpy as np

from powerprof.storage.schema import outside_text

CHARS_PER_TOKEN = 4.0  # until this server has counted some prompts: English text, common BPE tokenizers
KEEP = 256  # requests per endpoint the ratio is learned from
MIN_FIT = 16  # requests before the intercept (template tokens) is fitted rather than the ratio of sums
SPREAD_MIN = 3  # counted prompts before a ratio's spread is known (PromptLengths.spread)
SPREAD_FLOOR = 0.1  # the least relative spread assumed: a few alike prompts show less than the traffic's


def prompt_shape(doc: dict, api: str | None) -> tuple[int | None, int | None, str | None, int]:
    """prompt_size's three and prompt_count's one from a single pass over the body's prompt (the proxy's: a 1 MiB batch
    body's 262k prompts read twice over held its event loop ~0.4 s)."""
    kinds = None
    if api in PROMPT_FIELD_APIS:
        p = prompt_field(doc, api)[1]
        if isinstance(p, list) and p:
            kinds = _item_types(p)
    chars, ids, unsized = prompt_size(doc, api, kinds)
    # An empty id list in a batch is no prompt run (prompt_count).
    return chars, ids, unsized, (len(p) - (p.count([]) if list in kinds else 0)
                                 if kinds is not None and int not in kinds else 1)


def prompt_size(doc: dict, api: str | None, kinds: set | None = None) -> tuple[int | None, int | None, str | None]:
    """(characters of the prompt's text, token ids given as the prompt, None) from a JSON request body, a batch of
    prompts' summed (`prompt_count` says how many); (None, None, what) where the body does not say its size, `what` the
    part that does not (an image part: its tokens are not its characters; a shape not known), for its row
    (rowtext.prompt_unread). Only lengths are taken; `kinds`: the prompt list's item types where taken already."""
    if api in ("openai-chat", "anthropic-messages"):
        msgs = doc.get("messages")
        if not isinstance(msgs, list):
            return None, None, "a `messages` that is not a list"
        n, why = _content_chars(doc.get("system")) if api == "anthropic-messages" else (0, None)
        for m in msgs:
            if why is not None:
                break
            if not isinstance(m, dict):
                return None, None, "a message that is not an object"
            k, why = _content_chars(m.get("content"))
            n += k + _tool_call_chars(m.get("tool_calls"))
        return _with_tools(n, why, doc)
    if api == "openai-responses":
        for key in STATEFUL_FIELDS:
            if doc.get(key):  # the server runs its stored turns before `input`: their length is nowhere here
                return None, None, stateful_reason(key)
        inp = doc.get("input")
        n, why = _content_chars(doc.get("instructions"))
        for item in inp if isinstance(inp, list) else [inp]:
            if why is not None:
                break
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(item, str):
                k = len(item)
            elif isinstance(item, dict) and (kind in (None, "message") or "role" in item):
                k, why = _content_chars(item.get("content"))
            elif kind == "function_call":
                k = sum(len(item[f]) for f in ("name", "arguments") if isinstance(item.get(f), str))
            elif kind == "function_call_output":
                k, why = _content_chars(item.get("output"))
            elif kind == "reasoning":
                k, why = _content_chars(item.get("summary"))
            else:
                return None, None, (f"an input item of type '{outside_text(kind)}'" if isinstance(kind, str)
                                    else "an input item of no known shape")
            n += k
        return _with_tools(n, why, doc)
    if api == "llamacpp" and any(doc.get(k) is not None for k in ("input_prefix", "input_suffix", "input_extra")):
        return _infill_size(doc)
    if api in PROMPT_FIELD_APIS:
        field, p = prompt_field(doc, api)
        media = next((k for k in ("image_data", "audio_data", "video_data") if doc.get(k)), None)
        if media is not None:  # SGLang's (and older llama.cpp's) media beside the text: their tokens are not characters
            return None, None, f"`{media}` beside the prompt"
        if isinstance(p, str):
            return len(p), None, None
        if p is None:
            return None, None, f"no `{field}` (the prompt given otherwise: embeddings, multimodal data)"
        if isinstance(p, dict) and api in MIXED_APIS:  # llama-server's one prompt as an object (`prompt_string`)
            return _mixed_size([p], field, False)
        if not (isinstance(p, list) and p):
            kinds = set()  # an empty list, an object: no shape read
        elif kinds is None:
            kinds = _item_types(p)
        # One prompt of ids; or a batch (vLLM, SGLang, llama.cpp: each prompt a request of its own, the usage their
        # sum): summed.
        if kinds == {int}:
            return None, len(p), None
        if kinds == {str}:
            return sum(map(len, p)), None, None
        if kinds == {list} and min(map(len, p)) > 0 and set(map(type, chain.from_iterable(p))) == {int}:
            return None, sum(map(len, p)), None
        if api in MIXED_APIS and kinds:
            return _mixed_size(p, field, int in kinds, kinds)
        mixed = int in kinds
        return None, None, f"a `{field}` of no shape read here ({'ids and text mixed' if mixed else 'its items'})"
    return None, None, f"a body of the {api} API (the proxy reads no prompt size from its bodies)"


MIXED_APIS = ("llamacpp", "openai-completions")  # llama-server's /completion and /v1/completions (vLLM refuses a mix)


def _mixed_size(p: list, field: str, one: bool, kinds: set | None = None) -> tuple[int | None, int | None, str | None]:
    """llama-server's prompt lists of more than one kind (its tokenize_input_prompts): a list with a token id at its top
    (`one`: `kinds` its item types, taken already) is one prompt of ids and text mixed; else each item is a prompt: text, ids, ids and text mixed, or an object
    whose `prompt_string` is one of those (with `multimodal_data`, media: not sized). The ids are their tokens; the
    text's characters are estimated as any text's (PromptLengths.estimate); a float or bool in a list of ids and text is
    an id to it too (converted: measured). Any other item, one llama-server refuses (a float among ids without text, a
    null, a list in a list of ids, a batch item of text alone), gives no size; the first such item, or object with
    media, in the list's order says why.

    Counted in C-level passes (types, counts, compress) and numpy sums per item, not element by element: it runs on
    the proxy's event loop, and a Python loop over a 1 MiB body held it 219 ms (one prompt) and 454 ms (a batch of
    131k [0, "a"] prompts), against 117 ms and 218 ms before such bodies were sized."""
    items = [p] if one else p
    tops = list(map(type, items))
    media = None  # the index of the first object with media
    if dict in tops:
        at = list(compress(range(len(items)), map(is_, tops, repeat(dict))))
        objs = [items[i] for i in at]
        has = list(map(contains, objs, repeat("multimodal_data")))
        media = at[has.index(True)] if True in has else None
        items = list(items)
        for i, v in zip(at, map(dict.get, objs, repeat("prompt_string"))):
            items[i] = v
        tops = list(map(type, items))
    chars = sum(map(len, compress(items, map(is_, tops, repeat(str)))))
    # Any top item neither text nor a list: refused (the first such, in order).
    bad = None if set(tops) <= {str, list} else next(i for i, t in enumerate(tops) if t is not str and t is not list)
    lists = list(compress(items, map(is_, tops, repeat(list))))
    ids = 0
    if lists:
        flat = list(chain.from_iterable(lists)) if len(lists) > 1 else lists[0]
        types = list(map(type, flat))  # list.count on it compares identities in C; a set of types hashes each
        n_str = types.count(str)
        ids = len(flat) - n_str
        chars += _str_chars(flat, types, n_str)
        k = (None if _mixed_ok(kinds) else 0) if one and kinds else _first_refused(lists, types, n_str)
        if k is not None:  # the first refused list prompt, its index among the top items
            i = k if len(lists) == len(tops) else list(compress(range(len(tops)), map(is_, tops, repeat(list))))[k]
            bad = i if bad is None else min(bad, i)
    if media is not None and (bad is None or media <= bad):  # its media said before its prompt_string is read
        return None, None, f"a `{field}` item's `multimodal_data` (media: its tokens are not characters)"
    if bad is not None:
        return None, None, f"a `{field}` of no shape read here ({'ids and text mixed' if one else 'its items'})"
    # Ids alone: no text to estimate. Text alone, even none (an empty prompt_string): its characters, 0 as a "" prompt.
    return (None if ids and not chars else chars), ids or None, None


def _mixed_ok(kinds: set) -> bool:
    """A list prompt's item types llama-server takes: an id, and only ids and text, or ids, text and floats or bools."""
    return int in kinds and (kinds <= {int, str} or {int, str} <= kinds <= {int, str, float, bool})


_TYPE_CODE = {int: "i", str: "s", float: "f", bool: "f"}  # else "x": a type llama-server refuses in a prompt of ids


def _first_refused(lists: list, types: list, n_str: int) -> int | None:
    """The index of the first list prompt llama-server refuses (None: none), `types` their items' flattened: one takes
    an id in it, and only ids and text, or ids, text and floats or bools (converted); an empty one is a task of no
    tokens (measured on b11434: answered 200, nothing prefilled or generated)."""
    if len(lists) == 1:
        n_int, n_fb = types.count(int), types.count(float) + types.count(bool)
        ok = not types or (n_int > 0 and n_int + n_str + n_fb == len(types) and (n_fb == 0 or n_str > 0))
        return None if ok else 0
    codes = np.frombuffer("".join(map(_TYPE_CODE.get, types, repeat("x"))).encode("ascii"), np.uint8)
    ends = np.cumsum(np.fromiter(map(len, lists), np.int64, len(lists)))
    starts = ends - np.fromiter(map(len, lists), np.int64, len(lists))

    def per_item(code: str) -> np.ndarray:  # each list prompt's count of items of that code
        cs = np.concatenate(([0], np.cumsum(codes == ord(code), dtype=np.int64)))
        return cs[ends] - cs[starts]

    ok = (ends == starts) | ((per_item("i") > 0) & (per_item("x") == 0) & ((per_item("f") == 0) | (per_item("s") > 0)))
    return None if ok.all() else int(np.argmin(ok))


def _str_chars(flat: list, types: list, n_str: int) -> int:
    """The characters of the `n_str` strings among `flat` (`types` theirs): found by C-level scans where few."""
    if n_str == 0:
        return 0
    if n_str > 64:
        return sum(map(len, compress(flat, map(is_, types, repeat(str)))))
    n, at = 0, -1
    for _ in range(n_str):
        at = types.index(str, at + 1)
        n += len(flat[at])
    return n


STATEFUL_FIELDS = ("previous_response_id", "conversation")  # a Responses turn whose history the server keeps


def stateful_reason(key: str) -> str:
    """The unsized reason of a stateful Responses turn (rowtext gives its own fix for it)."""
    return f"a `{key}` (the stored conversation is not in the body)"


STATEFUL_REASONS = frozenset(map(stateful_reason, STATEFUL_FIELDS))
RESPONSE_ID_MAX = 256  # characters of a previous_response_id kept: a key of Ledger.response_context


def stateful_turn(doc: dict, api: str | None) -> tuple[str, int | None] | None:
    """(its previous_response_id, the characters of the rest of its prompt: its instructions and input, None where not
    sizeable) of a Responses turn that names its previous turn (and no `conversation`, whose items the proxy never
    sees); None for any other body. The server prefills the stored turn (its input, instructions and output) before
    these."""
    prev = doc.get("previous_response_id") if api == "openai-responses" else None
    if not isinstance(prev, str) or not prev or doc.get("conversation"):
        return None
    chars = prompt_size({k: v for k, v in doc.items() if k != "previous_response_id"}, api)[0]
    return prev[:RESPONSE_ID_MAX], chars


def uncarried_chars(doc: dict, api: str | None) -> int | None:
    """Characters of a Responses body's prompt that a later turn naming it (previous_response_id) does not prefill
    again: its `tools`' JSON (vLLM's construct_tool_dicts renders each request's own tools, none stored with the turn)
    and its `instructions` (vLLM's construct_input_messages drops the stored turn's system messages since
    vllm-project/vllm#37727). None: none, or not a Responses body."""
    if api != "openai-responses":
        return None
    tools = doc.get("tools")
    n = len(json.dumps(tools, separators=(",", ":"))) if isinstance(tools, list) and tools else 0
    k, why = _content_chars(doc.get("instructions"))
    return (n + (k if why is None else 0)) or None


def tools_if_none(doc: dict, api: str | None) -> int | None:
    """Characters of a chat's or Responses body's `tools` (in its prompt_size) where its tool_choice is "none": whether
    the server renders them is its own (SGLang's chat never; vLLM's chat not with --exclude-tools-when-tool-choice-none;
    vLLM's Responses path: before the flag's parameter came to construct_tool_dicts never, since always, as
    serving.py's _make_request passes it none), learned by the ledger from such prompts it counted. None: no such."""
    tools = doc.get("tools")
    if api not in ("openai-chat", "openai-responses") or doc.get("tool_choice") != "none":
        return None
    return len(json.dumps(tools, separators=(",", ":"))) if isinstance(tools, list) and tools else None


def _infill_size(doc: dict) -> tuple[int | None, None, str | None]:
    """llama.cpp's /infill: its prompt is the extra chunks (each its filename and text), the prefix, the suffix and
    an optional `prompt` after the prefix (server's format_infill), with its fill-in-the-middle tokens (`a`)."""
    n = 0
    for f in ("input_prefix", "input_suffix", "prompt"):
        v = doc.get(f)
        if isinstance(v, str):
            n += len(v)
        elif v is not None:
            return None, None, f"an `{f}` that is not text"
    extra = doc.get("input_extra")
    for chunk in extra if isinstance(extra, list) else ([] if extra is None else [None]):
        if not (isinstance(chunk, dict) and isinstance(chunk.get("text"), str)
                and isinstance(chunk.get("filename", ""), str)):
            return None, None, "an `input_extra` chunk of no shape read here"
        n += len(chunk["text"]) + len(chunk.get("filename", ""))
    return n, None, None


def _content_chars(c) -> tuple[int, str | None]:
    """(characters, None) of a message's content: text, or a list of parts whose text is their tokens' (text, a tool's
    use or result, a refusal, a reasoning summary); (0, what) where a part's tokens are not its characters (an image,
    audio, a file) or its shape is not known. None is empty (an assistant's tool calls alone)."""
    if c is None:
        return 0, None
    if isinstance(c, str):
        return len(c), None
    if not isinstance(c, list):
        return 0, "a message content that is neither text nor a list of parts"
    n = 0
    for part in c:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):
            n += len(part)  # vLLM takes a bare string as a text part
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            n += len(part["text"])  # text, input_text, output_text, summary_text
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            n += len(part["refusal"])
        elif kind == "thinking" and isinstance(part.get("thinking"), str):
            n += len(part["thinking"])
        elif kind == "tool_use":  # Messages: the call, rendered as its name and input's JSON
            n += len(part["name"]) if isinstance(part.get("name"), str) else 0
            n += len(json.dumps(part.get("input"), separators=(",", ":")))
        elif kind == "tool_result":
            k, why = _content_chars(part.get("content"))
            if why is not None:
                return 0, why
            n += k
        elif isinstance(kind, str):
            return 0, f"a content part of type '{outside_text(kind)}'"  # an image or audio part: its tokens are not characters
        else:
            return 0, "a content part of no known shape"
    return n, None


def _with_tools(n: int, why: str | None, doc: dict) -> tuple[int | None, None, str | None]:
    """A chat's size with its `tools`: the template renders the schemas into the prompt (its wording around them
    unknown: their JSON's size)."""
    if why is not None:
        return None, None, why
    tools = doc.get("tools")
    if isinstance(tools, list) and tools:
        n += len(json.dumps(tools, separators=(",", ":")))
    return n, None, None


def prompt_count(doc: dict, api: str | None) -> int:
    """How many prompts a body's batch holds (a completions prompt list, SGLang's `text` or `input_ids` list): each
    has its template's own tokens (`a` of the fit), and runs as a request of its own (proxy.request_sequences); 1 for
    any other body. A list holding a token id at its top is one prompt (ids, or llama.cpp's ids and text mixed). An
    empty id list in a batch is not counted: llama-server ends its task at once, nothing prefilled or decoded (vLLM
    and SGLang refuse it)."""
    if api in PROMPT_FIELD_APIS:
        p = prompt_field(doc, api)[1]
        if isinstance(p, list) and p and int not in (kinds := _item_types(p)):
            return len(p) - (p.count([]) if list in kinds else 0)
    return 1


def empty_prompts(doc: dict, api: str | None) -> int:
    """The empty id lists in a completions batch: llama-server's tasks of no tokens, each answered (a result, an index)
    but ended at once, nothing prefilled or decoded (measured on b11434); 0 for any other body (vLLM and SGLang refuse
    them)."""
    if api not in MIXED_APIS:
        return 0
    p = prompt_field(doc, api)[1]
    return p.count([]) if isinstance(p, list) and p and int not in _item_types(p) else 0


PROMPT_FIELD_APIS = ("openai-completions", "llamacpp", "sglang-generate")


def prompt_field(doc: dict, api: str) -> tuple[str, object]:
    """(name, value) of a PROMPT_FIELD_APIS body's prompt, read one way for its size, its count and its sequences:
    SGLang's `text`, or where null `input_ids`; llama.cpp's `prompt`, or where null `content`; else `prompt`."""
    if api == "sglang-generate":
        field = "text" if doc.get("text") is not None else "input_ids"
    else:
        field = "content" if api == "llamacpp" and doc.get("prompt") is None else "prompt"
    return field, doc.get(field)


def _item_types(p: list) -> set:
    """The types of a list's items, in one C-level pass (a 1 MiB batch body's 262k prompts: a per-item Python test
    held the proxy's event loop ~0.4 s). A bool is its own type, never an id."""
    return set(map(type, p))


def _tool_call_chars(calls) -> int:
    """Characters of a history message's tool calls: each function's name and arguments (rendered into the prompt)."""
    n = 0
    for call in calls if isinstance(calls, list) else ():
        f = call.get("function") if isinstance(call, dict) else None
        if isinstance(f, dict):
            n += sum(len(f[k]) for k in ("name", "arguments") if isinstance(f.get(k), str))
    return n


class PromptLengths:
    """Learns tokens per character from requests whose server counted their prompt; estimates the rest."""

    def __init__(self, keep: int = KEEP):
        self.seen: dict[str, deque] = {}
        self.learned: dict[str, int] = {}  # api → requests learned from, all told
        self._fit: dict[str, tuple[int, float, float]] = {}  # api → (learned when fitted, a, b)
        self.keep = keep

    def learn(self, api: str | None, chars: int | None, tokens: float | None, prompts: int = 1,
              ids: int | None = None) -> None:
        """A prompt the server counted; a batch of `prompts` as its mean prompt (the fit's `a` is a prompt's). `ids`: the
        token ids given beside its text (llama.cpp's mixed prompts), taken out of the count: the ratio is the text's."""
        if ids is not None and tokens is not None:
            tokens -= ids
        if api is None or chars is None or tokens is None or chars <= 0 or tokens <= 0:
            return
        k = float(max(prompts, 1))
        self.seen.setdefault(api, deque(maxlen=self.keep)).append((chars / k, tokens / k))
        self.learned[api] = self.learned.get(api, 0) + 1

    def _coef(self, api: str) -> tuple[float, float, int]:
        d = self.seen.get(api)
        if not d:
            return 0.0, 1.0 / CHARS_PER_TOKEN, 0
        fit = self._fit.get(api)
        if fit is not None and self.learned[api] - fit[0] < 8:  # refitted every 8 requests: estimates are rare
            return fit[1], fit[2], len(d)
        x = np.array([c for c, _ in d])
        y = np.array([t for _, t in d])
        a, b = 0.0, float(y.sum() / x.sum())
        if len(d) >= MIN_FIT and x.std() > 0.1 * x.mean():
            b1, a1 = np.polyfit(x, y, 1)
            if b1 > 0 and a1 >= 0:
                a, b = float(a1), float(b1)
        self._fit[api] = (self.learned[api], a, b)
        return a, b, len(d)

    def spread(self, api: str) -> float | None:
        """How far this API's counted prompts lie from its fit, relatively (three standard deviations, at least
        SPREAD_FLOOR); None until SPREAD_MIN were counted."""
        d = self.seen.get(api)
        if d is None or len(d) < SPREAD_MIN:
            return None
        a, b, _ = self._coef(api)
        rel = [t / max(a + c * b, 1e-9) - 1.0 for c, t in d]
        return max(3.0 * float(np.std(rel)), SPREAD_FLOOR)

    def per_char(self, api: str) -> float:
        """Tokens a character of this API's prompts, as learned (no template's tokens: a part of a prompt's)."""
        return self._coef(api)[1]

    def estimate(self, api: str | None, chars: int | None, ids: int | None,
                 prompts: int = 1) -> tuple[float, str] | None:
        """(tokens, how) for a prompt the server did not count, a batch's `prompts` summed (each with the template's
        `a`); None when the body gave no size. Ids and text mixed (llama.cpp): the ids plus the text's estimate."""
        if ids is not None and chars is None:
            return float(ids), f"the request's {ids} prompt token ids"
        if chars is None or api is None:
            return None
        if ids is not None:
            text = self.estimate(api, chars, None, prompts)
            return ids + text[0], f"the request's {ids} prompt token ids and {text[1]}"
        k = max(prompts, 1)
        of = f" of {k} prompts" if k > 1 else ""
        a, b, n = self._coef(api)
        if n == 0:
            return max(1.0, chars * b), (f"{chars} prompt characters{of} at {CHARS_PER_TOKEN:g} characters a token (a "
                                          "default: no prompt of this endpoint that the server counted has been "
                                          "learned from yet)")
        return max(1.0, k * a + chars * b), (f"{chars} prompt characters{of} at {a:.1f} + {b:.3f} tokens a character"
                                              f"{' each' if k > 1 else ''}, as this server counted its last {n} such "
                                              "prompts")
