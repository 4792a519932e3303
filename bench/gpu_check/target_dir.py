"""A random-weight Qwen3 target directory with a tokenizer, built offline (nothing downloaded):
the tokenizer is a byte-level BPE trained on a few sentences (the same recipe as the tests'
tests/tiny_target.py, copied so bench/ does not import tests/), the model has any width."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>"]
_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Accepted tokens are kept and the first mismatch is replaced.",
    "The waves roll in and out again under a wide blue sky.",
    "It depends on the details, so let me think step by step.",
    "Once upon a time there was a little robot who wanted to read.",
    "A small draft model proposes several tokens at once.",
    "The capital of France is Paris, a city of art and light.",
    "Training requires data, a loss function, an optimizer and patience.",
    "for i in range(10): print(i)",
    "Thank you very much, you are welcome!",
]
_SUBJECTS = ["the sea", "a robot", "Paris", "python code", "the moon", "a small cat", "the library", "a train"]


def build_tokenizer(vocab_size: int = 480):
    """A Qwen-style fast tokenizer (chat template, <|im_end|> eos, <|fim_pad|> spare special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_SENTENCES + [f"Tell me about {s}." for s in _SUBJECTS], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=_TEMPLATE)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|fim_pad|>"]})
    return fast


def make_target_dir(out: Path, shape: dict, dev: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write config.json, random weights (initialised on `dev`, saved in `dtype`) and the tokenizer.
    shape: hidden, layers, heads, kv_heads, head_dim, inter, vocab (>= the tokenizer's size)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    if shape["vocab"] < len(tok):
        raise ValueError(f"vocab {shape['vocab']} < the tokenizer's {len(tok)} tokens")
    cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["inter"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    with torch.device(dev):  # 2B parameters at the real width: initialise where it is fast
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """n ShareGPT-shape conversations, deterministic for a seed."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        turns = []
        for _ in range(1 + i % 2):
            s = rng.choice(_SUBJECTS)
            turns.append({"from": "human", "value": f"Tell me about {s}."})
            turns.append({"from": "gpt", "value": f"About {s}: " + " ".join(rng.choice(_SENTENCES)
                                                                             for _ in range(rng.randint(3, 8)))})
        lines.append(json.dumps({"id": f"gpu-check-{i:04d}", "conversations": turns}))
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path
