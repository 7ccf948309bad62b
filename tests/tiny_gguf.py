"""A tiny random-weight llama GGUF written with the `gguf` package, for tests against real servers.

Four layers, 512 wide, a byte-level vocabulary plus a few words: a few ms a token on one core,
so nothing is downloaded and tokens arrive one by one even on a loaded machine.
"""

from __future__ import annotations

import numpy as np


# Fill-in-the-middle control tokens (llama-server's /infill refuses a model without them).
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def write_tiny_llama(path, n_embd=512, n_layer=4, n_head=4, n_ff=1536, seed=0, fim=False) -> None:
    """fim: with fill-in-the-middle tokens, for /infill (appended: the other tokens keep their ids)."""
    import gguf

    rng = np.random.default_rng(seed)
    words = "the of and to in is that for it as with on was power energy token GPU watt clock speed".split()
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581" + w for w in words] + words
    types = [2, 3, 3] + [6] * 256 + [1] * (2 * len(words))
    scores = [0.0] * 259 + [-float(i) for i in range(2 * len(words))]
    n_plain = len(tokens)
    if fim:
        tokens += list(FIM_TOKENS)
        types += [3] * len(FIM_TOKENS)
        scores += [0.0] * len(FIM_TOKENS)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("powerprof-tiny-random")
    w.add_context_length(512)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if fim:
        for key, tok in zip(("fim_pre", "fim_suf", "fim_mid"), FIM_TOKENS):
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(tok))

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    out = rand(len(tokens), n_embd)
    # EOS and the byte tokens get logit 0 while the best of ~40 random word logits is above it:
    # greedy decoding never stops early, and every token is a whole word, so the server streams
    # one token per chunk (byte tokens can be held back and merged into one chunk).
    out[2:259] = 0.0
    out[n_plain:] = 0.0  # FIM tokens are never generated either
    w.add_tensor("output.weight", out)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for name in ("q", "k", "v", "output"):
            w.add_tensor(f"blk.{i}.attn_{name}.weight", rand(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
