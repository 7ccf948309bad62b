"""Bench: the proxy's request-body inspection of big prompt batches against the JSON parse alone, side by side.

    python bench/inspect_body.py

`inspect_request_body` runs on the proxy's event loop, so its time is time every live stream waits. Bodies of 1 MiB:
262,000 one-character prompts, 174,000 one-id prompts, SGLang's 262,000 texts; llama.cpp's ids and text mixed
(one prompt of 524,000 ids and a text, 131,000 [0, "a"] prompts, 40,000 prompt_string objects). Best of 7 each; the ratio to the parse
is the figure (the parse is the floor: the body must be parsed to be read). Nothing is asserted here
(tests/test_daemon_proxy.py checks what the inspection reads from such bodies).
"""

from __future__ import annotations

import json
import time

from powerprof.daemon.proxy import inspect_request_body

BODIES = (("262k one-char prompts", {"prompt": ["a"] * 262000}, "openai-completions"),
          ("174k one-id prompts", {"prompt": [[1]] * 174000}, "openai-completions"),
          ("SGLang 262k texts", {"text": ["a"] * 262000}, "sglang"),
          # llama.cpp's ids and text mixed (promptlen._mixed_size): one prompt, and a batch of mixed prompts.
          ("llama.cpp mixed prompt", {"prompt": [0] * 524000 + ["a"]}, "llamacpp"),
          ("131k [0,\"a\"] prompts", {"prompt": [[0, "a"]] * 131000}, "llamacpp"),
          ("40k prompt_string objs", {"prompt": [{"prompt_string": [0, "a"]}] * 40000}, "llamacpp"))


def main() -> None:
    print(f"{'body':<24} {'MiB':>5} {'parse ms':>9} {'inspect ms':>11} {'ratio':>6}")
    for name, doc, api in BODIES:
        body = json.dumps(doc, separators=(",", ":")).encode()
        parse_s = inspect_s = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            json.loads(body)
            t1 = time.perf_counter()
            inspect_request_body(body, "", api, {})
            t2 = time.perf_counter()
            parse_s, inspect_s = min(parse_s, t1 - t0), min(inspect_s, t2 - t1)
        print(f"{name:<24} {len(body) / 2**20:>5.2f} {parse_s * 1e3:>9.1f} {inspect_s * 1e3:>11.1f} "
              f"{inspect_s / parse_s:>6.1f}")


if __name__ == "__main__":
    main()
