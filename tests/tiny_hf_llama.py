"""A tiny random-weight Llama in Hugging Face format, built locally: nothing is downloaded.

The tokenizer is a byte-level BPE trained with `tokenizers` on a few sentences; the model has
random weights (transformers' LlamaConfig, a few small layers). It generates nonsense, which is
all a timing test needs: real tokens from a real server at a real pace.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "A data centre operator wants to know how much energy each generated token costs.",
    "The machine serves a language model to many users, one token after another.",
    "Each step reads the weights of the model from memory and samples the next token.",
    "Power limits, clocks and memory bandwidth decide how fast decoding runs.",
] * 20


def build(path: Path, vocab_size: int = 512, hidden: int = 1024, layers: int = 4, heads: int = 16, max_pos: int = 4096) -> Path:
    """Write config, weights and tokenizer into `path` (created); returns it. Head size 64: vLLM's CPU
    attention supports 32, 64, 80, ... (16 is refused). ~200 MB of weights: slow enough (~100 tok/s
    on one core) that vLLM's engine, not its HTTP front end, sets the pace."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    # A chat template so /v1/chat/completions works: plain role-prefixed lines.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok.get_vocab()),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    (path / "powerprof-tiny.json").write_text(json.dumps({"built_by": "tests/tiny_hf_llama.py"}))
    return path


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
