"""The target zoo: tiny random targets of every decoder family users train drafters for.

`build_zoo_target(out_dir, family)` writes a local HF directory (config.json,
random weights, a byte-level BPE tokenizer with the family's chat tokens and a
chat template of the family's style) built offline from the pinned
transformers' own config classes: hidden 64, 4 layers, vocab <= 512, 2-4
experts for MoE families. Hybrid families alternate linear and full attention
so both kinds are captured.

`ZOO` lists the families (name -> model_type in transformers' CONFIG_MAPPING);
`available()` every family as a pytest parameter, those the installed transformers lacks
marked skipped with the reason.
"""
from __future__ import annotations

import json
from pathlib import Path

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
_LINEAR = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (model_type, config kwargs, chat style)
ZOO: dict[str, tuple[str, dict, str]] = {
    "llama": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 1024}}, "llama3"),
    "qwen2": ("qwen2", {}, "chatml"),
    "qwen3": ("qwen3", {}, "chatml"),
    "qwen3_moe": ("qwen3_moe", dict(_MOE), "chatml"),
    "qwen3_5": ("qwen3_5_text", dict(_LINEAR), "chatml"),
    "qwen3_5_moe": ("qwen3_5_moe_text", {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32}, "chatml"),
    "qwen3_next": ("qwen3_next", {**_LINEAR, **_MOE, "shared_expert_intermediate_size": 32}, "chatml"),
    "gemma3": ("gemma3_text", {"sliding_window": 6, "query_pre_attn_scalar": 16, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}, "gemma"),
    "gemma4": ("gemma4_text", {"sliding_window": 6, "vocab_size_per_layer_input": None, "hidden_size_per_layer_input": 8,
                               "num_kv_shared_layers": 0, "global_head_dim": 16, "tie_word_embeddings": True,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}, "gemma"),
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                            "layer_types": ["sliding_attention", "full_attention"] * 2}, "harmony"),
    "mistral": ("mistral", {"sliding_window": None}, "mistral"),
    "phi3": ("phi3", {}, "phi3"),
    "glm4_moe": ("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1}, "glm"),
    "deepseek_v3": ("deepseek_v3", {"head_dim": 8, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                                    "moe_intermediate_size": 32, "first_k_dense_replace": 1}, "deepseek"),
    # the text part of a VLM: the whole Qwen3-VL (tiny vision tower) is saved; the target is its language model
    "qwen3_vl": ("qwen3_vl", {}, "chatml"),
}

# chat style -> (special tokens, kwargs of the tokenizer, chat template or None)
_ROLE_TEMPLATE = (
    "{{- BOS }}{%- for message in messages %}"
    "{{- OPEN + message['role'] + MID + message['content'] + CLOSE }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- OPEN + 'assistant' + MID }}{%- endif %}"
)


def _tpl(bos: str, open_: str, mid: str, close: str) -> str:
    q = lambda s: "'" + s.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"  # noqa: E731
    return (_ROLE_TEMPLATE.replace("BOS", q(bos)).replace("OPEN", q(open_)).replace("MID", q(mid))
            .replace("CLOSE", q(close)))


STYLES = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>"],
               dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
               _tpl("", "<|im_start|>", "\n", "<|im_end|>\n")),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|reserved_special_token_0|>"],
               dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>"),
               _tpl("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>")),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused0>"],
              dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>"),
              None),
    "harmony": (["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>",
                 "<|channel|>", "<|reserved_200000|>"],
                dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"),
                _tpl("", "<|start|>", "<|message|>", "<|end|>")),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[control_8]"],
                dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
                "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST]' + m['content'] + "
                "'[/INST]' }}{%- elif m['role'] == 'assistant' %}{{- m['content'] + '</s>' }}{%- else %}"
                "{{- '[INST]' + m['content'] + '[/INST]' }}{%- endif %}{%- endfor %}"),
    "phi3": (["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
             dict(bos_token="<s>", eos_token="<|end|>", pad_token="<|endoftext|>", unk_token="<unk>"),
             _tpl("", "<|", "|>\n", "<|end|>\n")),
    "glm": (["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "[MASK]"],
            dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>"),
            _tpl("[gMASK]<sop>", "<|", "|>\n", "<|endoftext|>")),
    "deepseek": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<|fim_pad|>"],
                 dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>",
                      pad_token="<｜end▁of▁sentence｜>"),
                 "{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'assistant' %}"
                 "{{- '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}{%- else %}"
                 "{{- '<｜User｜>' + m['content'] }}{%- endif %}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"),
}


def available() -> list:
    """Every family of ZOO, as pytest parameters: those the installed transformers lacks are
    skipped with the reason (listed in the run's summary), never dropped silently."""
    import pytest
    import transformers
    from transformers import CONFIG_MAPPING

    return [pytest.param(f, marks=() if mt in CONFIG_MAPPING else pytest.mark.skip(
        reason=f"transformers {transformers.__version__} has no model_type {mt!r} (zoo family {f!r})"))
            for f, (mt, _, _) in ZOO.items()]


def _tokenizer(style: str, vocab_size: int = 420):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_target import CORPUS

    specials, kw, template = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kw)
    if template:
        fast.chat_template = template
    fast.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in kw.values()]})
    return fast


def build_zoo_target(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

    model_type, extra, style = ZOO[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(style)
    vocab = ((len(tok) + 63) // 64) * 64
    ids = dict(pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
               eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id)
    kw = {**COMMON, **extra, "vocab_size": vocab, **ids}
    if family == "gemma4":
        kw["vocab_size_per_layer_input"] = vocab
    if family == "qwen3_vl":
        text = {k: v for k, v in kw.items() if k not in ("tie_word_embeddings",)}
        cfg = CONFIG_MAPPING[model_type](
            text_config=text, tie_word_embeddings=False,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]))
        cls = AutoModelForImageTextToText
    else:
        cfg = CONFIG_MAPPING[model_type](**kw)
        cls = AutoModelForCausalLM
    torch.manual_seed(seed)
    impl = "eager" if family == "gpt_oss" else "sdpa"
    model = cls.from_config(cfg, attn_implementation=impl)
    with torch.no_grad():  # larger-than-default random weights so layers differ visibly
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "dflash_zoo.json").write_text(json.dumps({"family": family, "model_type": model_type}) + "\n")
    return out
