"""What a simulated vLLM or SGLang chat request's parsers and template make of it: its stream's deltas, its tools' prompt.

Read from vLLM's and SGLang's `serving_chat.py` (docs/simulator.md, Thinking, tool calls and chat echo): what a
reasoning parser and a tool-call parser make of a step's new text (thinking, tool-call arguments, vLLM's chat echo), and
the tools' schemas a chat template renders into the prompt. Every token here is a generated token, counted in
usage as any other; only how (and whether) a step's tokens show in a chunk differs. Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# A required (or, on SGLang, a named) tool call is a JSON array the model writes: `[{"name": "f", "parameters": `
# takes these tokens before either server's partial-JSON parser knows the function's name, and sends nothing.
TOOL_HEAD_TOKENS = 4

# A simulated qwen3_coder call's parameter, `<parameter=name>`, its value and `</parameter>`, in tokens: what its
# detector holds at most (a value of some 13 tokens between the tags).
QWEN3_CODER_PARAM_TOKENS = 16

# What the arguments open with, sent with the first argument token (the simulator's words then follow as its value).
ARGS_OPEN = '{"q": "'


@dataclass
class ChatShape:
    """One chat choice's stream plan. `step(pieces)` → the deltas of one engine step's tokens (each token's text),
    none where the real server sends no chunk for them; `tail()` → SGLang's held-back arguments at the finish."""

    flavour: str  # "vllm" | "sglang"
    # Its thinking, then the end of thinking (DeepSeek-R1's and Qwen3's `</think>`: one generated token whose text
    # neither server streams: vLLM's reasoning parser answers a step of it alone with no delta, so no chunk; SGLang's
    # detector strips it), then the answer (0: no thinking).
    reasoning_tokens: int = 0
    # The reasoning delta's key: SGLang's "reasoning_content"; vLLM's "reasoning" (since vllm-project/vllm#27752,
    # November 2025), "reasoning_content" before, "both" in its deprecation window (the text under both keys: #27752's
    # DeltaMessage validator copied reasoning into reasoning_content, until #33402 removed it, January 2026).
    reasoning_field: str = "reasoning_content"
    tool: str | None = None  # "named" | "required": the answer is a tool call's arguments
    tool_name: str = "f"
    pos: int = 0  # tokens stepped so far
    named: bool = False  # the call's id and name were sent
    held: str = ""  # SGLang: argument text not yet streamed (its parser holds the newest back)
    carry: str = ""  # vLLM: the answer text of the step that ended the thinking, sent with the next delta
    # SGLang's deepseekv3 detector (`--tool-call-parser deepseekv3`): a call matches its pattern only once the model has
    # written the arguments' closing fence, so its name and arguments go out together then; a call cut by max_tokens
    # before it is never sent, nor its tokens said in any running count (no `_check_for_unstreamed_tool_args` chunk
    # either: its detector never recorded the call). False: the JSON detectors' one step late.
    hold_call: bool = False
    # `hold_call`: the tokens stepped when the call's closing fence is written (its request's natural end less the
    # tokens the model writes after it: deepseekv3's `<｜tool▁call▁end｜>`, `<｜tool▁calls▁end｜>` and its end of
    # sentence, 3, each in no chunk), where the call goes out with that step's running usage. None: at the finish.
    close_at: int | None = None
    # SGLang's qwen3_coder detector (`--tool-call-parser qwen3_coder`, with `hold_call`): the name goes out once
    # `<function=name>` is parsed, then each parameter's value only once its `</parameter>` is written: a parameter
    # (tag, value, closing tag) every this many tokens. A call cut by max_tokens leaves its open parameter in no chunk.
    # None: deepseekv3's whole call at its closing fence.
    param_tokens: int | None = None
    closed: bool = False  # `hold_call`: the call's end went out

    def _split(self, pieces: list[str]) -> tuple[str, bool, str]:
        """(thinking text, the end of thinking was in this step, answer text) of a step's token pieces."""
        think, answer, ended = [], [], False
        for p in pieces:
            k = self.pos
            self.pos += 1
            if k < self.reasoning_tokens:
                think.append(p)
            elif self.reasoning_tokens and k == self.reasoning_tokens:
                ended = True
            else:
                answer.append(p)
        return "".join(think), ended, "".join(answer)

    def _answer_pos(self) -> int:
        """Answer tokens stepped so far (those after the thinking and its end)."""
        return max(self.pos - (self.reasoning_tokens + 1 if self.reasoning_tokens else 0), 0)

    def step(self, pieces: list[str], final: bool = False) -> list[dict]:
        """The deltas of a step whose tokens' texts are `pieces` (`final`: the request's last step)."""
        before = self._answer_pos()
        think, ended, answer = self._split(pieces)
        in_think = self.reasoning_tokens > 0 and before == 0 and not answer and not ended  # a step of thinking alone
        out: list[dict] = []
        if think or (in_think and pieces):
            # A step of thinking (an empty piece too: vLLM's parser gives reasoning_content "" for it).
            if self.reasoning_field == "both":
                out.append({"reasoning": think, "reasoning_content": think})
            else:
                out.append({self.reasoning_field: think})
        if self.flavour == "vllm" and self.tool is None:
            if answer or (not in_think and pieces and not ended):
                if out:
                    out[0]["content"] = answer  # vLLM: the step that ends the thinking carries both
                else:
                    out.append({"content": answer})
            return out
        if self.flavour == "sglang" and self.tool is None:
            if answer:  # SGLang: a chunk of its own after the thinking's, and none for an empty text
                out.append({"content": answer})
            return out
        if ended and self.flavour == "vllm":
            self.carry = answer  # sent with the next step's arguments (serving_chat's current_text)
            return out
        return out + self._tool(self.carry + answer, before, self._answer_pos(), final)

    def _tool(self, text: str, before: int, after: int, final: bool) -> list[dict]:
        self.carry = ""
        head = TOOL_HEAD_TOKENS if (self.tool == "required" or self.flavour == "sglang") else 0
        if after <= head:
            return []  # the array's opening and the name: nothing parsed yet
        args = (ARGS_OPEN if before <= head else "") + text
        if self.flavour == "sglang" and self.hold_call:
            if self.closed:
                return []  # the call went out: the tokens after its closing tag have no text to send
            out = []
            if self.param_tokens and not self.named:
                self.named = True
                out.append(self._call("", first=True))  # qwen3_coder: `<function=name>` parsed, the name sent
            self.held += args  # its closing tag not yet written: nothing matched, nothing sent (tail: at the end)
            if self.close_at is not None and self.pos >= self.close_at:
                return out + self._held_out()  # written in this step: matched, the call's rest sent now
            if self.param_tokens and (after - head) // self.param_tokens > max(before - head, 0) // self.param_tokens:
                return out + self._held_out(end=False)  # a `</parameter>` in this step: that value sent
            return out
        if self.flavour == "sglang":
            out = []
            if not self.named:
                self.named = True
                out.append(self._call("", first=True))  # the name once complete, with empty arguments
            args, self.held = self.held, args  # streamed one step late: its newest text may be partial JSON
            if args:
                out.append(self._call(args))
            return out
        if self.tool == "required" and final and self.named:
            return []  # vLLM: the text closing the array is filtered out; only the finish is sent
        first, self.named = not self.named, True
        return [self._call(args, first)]

    def _call(self, args: str, first: bool = False) -> dict:
        if self.flavour == "sglang":  # a pydantic dump: every field, null where unset
            call = {"id": "call_sim0" if first else None, "index": 0, "type": "function",
                    "function": {"name": self.tool_name if first else None, "arguments": args}}
            return {"role": None, "content": None, "reasoning_content": None, "tool_calls": [call]}
        if first:  # vLLM's exclude_unset dump: the id, type and name on the call's first delta only
            return {"tool_calls": [{"id": "chatcmpl-tool-sim0", "type": "function", "index": 0,
                                    "function": {"name": self.tool_name, "arguments": args}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": args}}]}

    def tail(self, stop: str | None = None) -> list[dict]:
        """SGLang's `_check_for_unstreamed_tool_args`: at the finish, the arguments its parser still held, in a chunk
        sent without usage; vLLM: nothing (its arguments went out with their steps). `hold_call`: a call that closed
        (`stop` not "length"), name and arguments, sent with the running usage as at the step that closed it (the
        real one's closing tokens after it: `close_at` sends it at its step instead); one cut by max_tokens, nothing."""
        if self.hold_call and self.flavour == "sglang":
            if not self.held or stop == "length" or self.closed:
                return []
            return self._held_out()
        if self.flavour != "sglang" or not self.held:
            return []
        held, self.held = self.held, ""
        return [self._call(held + '"}')]  # with the object's close, which no step's text had

    def _held_out(self, end: bool = True) -> list[dict]:
        """A held call's text once matched: its name where not yet sent, then the arguments held so far (`end`: the
        call's last, with the object's close, which no step's text had)."""
        out = [] if self.named else [self._call("", first=True)]
        self.named, self.closed = True, self.closed or end
        held, self.held = self.held + ('"}' if end else ""), ""
        return out + [self._call(held)]

    def finish_reason(self, fr: str) -> str:
        """vLLM says "tool_calls" once it streamed a call, whatever stopped it; SGLang only for a natural stop."""
        if self.tool is None or not self.named:
            return fr
        return "tool_calls" if (self.flavour == "vllm" or fr == "stop") else fr


def wanted_tool(body: dict, flavour: str, tool_parser: bool) -> tuple[str | None, str]:
    """("named" | "required" | None, the function's name) for a chat request: a tool call is streamed where the
    request carries `tools` and forces one (tool_choice "required", or a named function), on vLLM as it is (structured
    output), on SGLang only when started with a tool-call parser (`tool_parser`). "auto" is not modelled."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not tools:
        return None, ""
    tc = body.get("tool_choice")
    first = tools[0].get("function", {}) if isinstance(tools[0], dict) else {}
    name = first.get("name", "f") if isinstance(first, dict) else "f"
    if flavour == "sglang" and not tool_parser:
        return None, ""
    if tc == "required":
        return "required", str(name)
    if isinstance(tc, dict) and isinstance(tc.get("function"), dict) and tc["function"].get("name"):
        return "named", str(tc["function"]["name"])
    return None, ""


def tools_in_prompt(body: dict, flavour: str, exclude_none: bool = False) -> str:
    """The text a chat template adds to the prompt for the request's `tools` (their schemas, as compact JSON here):
    vLLM renders them unless tool_choice is "none" and it runs with --exclude-tools-when-tool-choice-none
    (`exclude_none`), SGLang unless tool_choice is "none"; "" on llama.cpp (not modelled)."""
    tools = body.get("tools")
    if flavour not in ("vllm", "sglang") or not isinstance(tools, list) or not tools:
        return ""
    if (flavour == "sglang" or exclude_none) and body.get("tool_choice") == "none":
        return ""
    return "\n" + json.dumps(tools, separators=(",", ":"))


def thinks(body: dict, reasoning_tokens: int) -> int:
    """The thinking tokens of a chat request on a server started with a reasoning parser and a thinking model:
    `reasoning_tokens`, unless the request turns thinking off (Qwen3's `chat_template_kwargs.enable_thinking: false`,
    whose template then closes the thinking in the prompt) or asks SGLang not to separate it (`separate_reasoning:
    false`: its thinking is then content, not modelled apart)."""
    kw = body.get("chat_template_kwargs")
    if isinstance(kw, dict) and kw.get("enable_thinking") is False:
        return 0
    return max(int(reasoning_tokens), 0)


def chat_echo(body: dict) -> str:
    """vLLM's chat `echo: true`: the last message's content, where its role is the answer's (the assistant's, or with
    `add_generation_prompt: false` the last message's own); "" where none is sent."""
    if body.get("echo") is not True:
        return ""
    msgs = body.get("messages")
    last = msgs[-1] if isinstance(msgs, list) and msgs else None
    if not isinstance(last, dict):
        return ""
    if body.get("add_generation_prompt", True) is not False and last.get("role") != "assistant":
        return ""
    c = last.get("content")
    if isinstance(c, list):
        c = "\n".join(p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
    return c if isinstance(c, str) else ""


def responses_call(body: dict, flavour: str) -> str | None:
    """The function a Responses request forces a call of (its flat `tools`, `tool_choice` "required" or
    {"type": "function", "name": …}), on vLLM (structured output, as its chat's); None: a message. "auto" is not
    modelled (a message, as a chat's); nor SGLang's Responses calls."""
    tools = body.get("tools")
    if flavour != "vllm" or not isinstance(tools, list) or not tools:
        return None
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str) and tc["name"]:
        return tc["name"]
    if tc == "required":
        name = tools[0].get("name") if isinstance(tools[0], dict) else None
        return name if isinstance(name, str) and name else "f"
    return None


@dataclass
class ResponseShape:
    """One Responses answer's output items, as vLLM's serving_responses makes them: its thinking (a `reasoning` item:
    `reasoning_tokens`, then one end-of-thinking token whose text neither item holds), then a `message`'s text, or
    where the request forces one (`call`), a `function_call`'s arguments. `step(pieces)` → (thinking, answer) text of
    one engine step's tokens."""

    reasoning_tokens: int = 0
    call: str | None = None
    pos: int = 0  # tokens stepped so far
    thinking: str = ""  # the reasoning item's text so far
    answer: str = ""  # the message's text or the call's arguments so far

    def step(self, pieces: list[str]) -> tuple[str, str]:
        think, answer = [], []
        for p in pieces:
            k = self.pos
            self.pos += 1
            if k < self.reasoning_tokens:
                think.append(p)
            elif not (self.reasoning_tokens and k == self.reasoning_tokens):
                answer.append(p)
        t, a = "".join(think), "".join(answer)
        self.thinking += t
        self.answer += a
        return t, a

    def reasoning_in(self, generated: int) -> int:
        """Of `generated` tokens, the thinking's (usage.output_tokens_details.reasoning_tokens)."""
        return min(self.reasoning_tokens, max(generated, 0))

    def carried(self) -> str:
        """The text a later turn naming this one prefills again: its message's, never its thinking nor a function
        call (vLLM's responses/utils.py construct_input_messages adds only the stored output's ResponseOutputMessage
        items; "We skip the reasoning output")."""
        return "" if self.call is not None else self.answer
