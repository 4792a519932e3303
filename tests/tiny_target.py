"""Tiny random targets for tests: a local HF directory, built offline.

`make_tiny_target(out_dir, family)` writes `config.json`, random weights
(`save_pretrained`) and a real byte-level BPE tokenizer trained with the
`tokenizers` library on a small built-in English corpus (vocab ~400-500,
so any UTF-8 text round-trips exactly). Each family gets its chat special
tokens:

* ``qwen3``: ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos),
  ``<|fim_pad|>``; a Qwen-style chat_template.
* ``llama``: ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (pad),
  ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>`` (eos),
  ``<|reserved_special_token_0|>``; a Llama-3-style chat_template.
* ``gemma3``: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4,
  ``<start_of_turn>``, ``<end_of_turn>``, ``<unused0>``; NO chat_template
  (like the real Gemma 3 GGUF). Layers alternate sliding/full attention with a
  small sliding window so window effects show in short tests.

Nothing is downloaded. The result is deterministic for a given seed.
"""
from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("qwen3", "llama", "gemma3")

CORPUS = """\
The quick brown fox jumps over the lazy dog. A user asks a question and the assistant answers it.
Hello! How can I help you today? Please explain how speculative decoding works.
Speculative decoding lets a small draft model propose several tokens, and the large target model
verifies them all in one forward pass. Accepted tokens are kept; the first mismatch is replaced.
Write a short poem about the sea. The sea is wide and blue, the waves roll in and out again.
What is the capital of France? The capital of France is Paris. What is two plus two? It is four.
Python is a programming language. def add(a, b): return a + b. for i in range(10): print(i)
Thank you very much! You are welcome. Could you summarize this text in one sentence, please?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # % & * + = < >
Training a model requires data, a loss function, an optimizer and patience. The learning rate matters.
I think the answer is yes, but it depends on the details. Let me think step by step about this problem.
Once upon a time there was a little robot who wanted to learn how to read books in the library.
"""

_FAMILY_SPECIALS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>"],
    "llama": [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
        "<|eot_id|>", "<|reserved_special_token_0|>",
    ],
    "gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>"],
}

QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _build_tokenizer(family: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = _FAMILY_SPECIALS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    kw: dict = {"clean_up_tokenization_spaces": False}
    if family == "qwen3":
        kw.update(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN3_TEMPLATE)
    elif family == "llama":
        kw.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>",
                  chat_template=LLAMA_TEMPLATE)
    else:
        kw.update(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    # the remaining specials must never be split by BPE
    extra = [s for s in specials if s not in {kw.get("bos_token"), kw.get("eos_token"), kw.get("pad_token"),
                                               kw.get("unk_token"), kw.get("mask_token")}]
    fast.add_special_tokens({"additional_special_tokens": extra})
    return fast


def _build_config(family: str, vocab: int, num_layers: int, hidden_size: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate_size: int, sliding_window: int, tok,
                  softcap: float | None = None):
    common = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=2048, rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id,
    )
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3Config(tie_word_embeddings=False, **common), Qwen3ForCausalLM
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaConfig(tie_word_embeddings=False, **common), LlamaForCausalLM
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    cfg = Gemma3TextConfig(
        tie_word_embeddings=True, sliding_window=sliding_window, layer_types=layer_types,
        query_pre_attn_scalar=head_dim, final_logit_softcapping=softcap, **common,
    )
    return cfg, Gemma3ForCausalLM


def make_tiny_target(
    out_dir: str | Path,
    family: str = "qwen3",
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    sliding_window: int = 6,
    tokenizer_vocab: int = 480,
    final_logit_softcapping: float | None = None,
    speaks: str | None = None,
) -> Path:
    """Write a tiny random target of `family` to `out_dir` (created) and return it.

    Gemma3 layers alternate sliding (window `sliding_window`) and full attention;
    `final_logit_softcapping` applies to gemma3 only.
    The model's vocab_size is the tokenizer's size rounded up to a multiple of
    64 (so, like real Qwen, a few embedding rows are beyond the tokenizer).

    `speaks`: the only characters the model's greedy answers can hold (every other lm_head row is
    zero, so its logit 0 never wins over ~90 random ones). With `tokenizer_vocab` at the byte
    alphabet (256 + specials: no merges), each such character is one token and an answer's text
    encodes back to exactly the ids the target emitted: a drafter trained on the target's own
    answers (which go through text) learns what the engine will verify.
    """
    import torch

    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; use one of {FAMILIES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(family, tokenizer_vocab)
    vocab = ((len(tok) + 63) // 64) * 64
    cfg, cls = _build_config(family, vocab, num_layers, hidden_size, num_heads, num_kv_heads, head_dim,
                             intermediate_size, sliding_window, tok, final_logit_softcapping)
    torch.manual_seed(seed)
    model = cls(cfg)
    # larger-than-default random weights so layers differ visibly in tests
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        if speaks is not None:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[tok.convert_tokens_to_ids(list(speaks))] = True
            model.get_output_embeddings().weight[~keep] = 0.0
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "dflash_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return out
