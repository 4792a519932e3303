"""config.json, the serving form of a `DrafterConfig`, both ways: `hf_config_dict` writes it
(a transformers 5.x Qwen3Config plus the DFlash keys SGLang, vLLM and the reference package
read), `drafter_config_from_hf` is THE reader (ours, or the public DFlash layout with the
DFlash keys at the top level). `export.py` puts them in files; nothing else maps the keys.

The reader raises KeyError (a missing key, named) or ValueError / TypeError (a bad value);
`checkpoint.source.load_export_source` turns both into one line naming the file.
"""
from __future__ import annotations

from typing import Any

from dflash_train.model.drafter_config import DFLASH2_KEYS, DrafterConfig, default_target_layer_ids
from dflash_train.model.masks import FULL, SLIDING

DFLASH_ARCH = "DFlashDraftModel"
DFLASH2_ARCH = "DFlash2DraftModel"


def is_dflash2(d: dict[str, Any]) -> bool:
    """A config.json dict of a DFlash 2 drafter (what the engines switch DFlash 2 on from)."""
    return DFLASH2_ARCH in (d.get("architectures") or [])


def hf_config_dict(cfg: DrafterConfig, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exported config.json for a `DrafterConfig` (transformers 5.x Qwen3Config + DFlash keys)."""
    sliding = SLIDING in cfg.layer_types
    dflash: dict[str, Any] = {
        "mask_token_id": int(cfg.mask_token_id),
        "target_layer_ids": [int(i) for i in cfg.target_layer_ids],
    }
    if float(cfg.input_embedding_scale) != 1.0:
        dflash["input_embedding_scale"] = float(cfg.input_embedding_scale)
    if float(cfg.output_multiplier) != 1.0:
        dflash["output_multiplier"] = float(cfg.output_multiplier)
    if cfg.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if cfg.block_seeds != "none":
        # engines that do not know the key ignore it and draft from masks only
        dflash["block_seeds"] = cfg.block_seeds
    rope = dict(cfg.rope_parameters)
    rope_theta = float(rope["rope_theta"])
    out: dict[str, Any] = {
        "architectures": [DFLASH_ARCH],
        "model_type": "qwen3",
        "num_hidden_layers": int(cfg.num_layers),
        "hidden_size": int(cfg.hidden_size),
        "intermediate_size": int(cfg.intermediate_size),
        "num_attention_heads": int(cfg.num_heads),
        "num_key_value_heads": int(cfg.num_kv_heads),
        "head_dim": int(cfg.head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(cfg.rms_norm_eps),
        # transformers 5.x (and vLLM) read rope_parameters; SGLang and 4.x-based code read rope_theta (+ rope_scaling)
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": int(cfg.vocab_size),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "initializer_range": float(cfg.init_std),
        "num_target_layers": int(cfg.num_target_layers),
        "block_size": int(cfg.block_size),
        "layer_types": list(cfg.layer_types),
        # Qwen3Config drops sliding_window unless use_sliding_window is true
        "use_sliding_window": bool(sliding),
        "sliding_window": int(cfg.sliding_window) if sliding else None,
        "max_window_layers": int(cfg.num_layers),
        "tie_word_embeddings": False,
        "use_cache": True,
        # the target's serving dtype (SGLang's --dtype auto reads it; a float32 config would run in float16);
        # torch_dtype for transformers 4.x-based readers
        "dtype": cfg.serving_dtype,
        "torch_dtype": cfg.serving_dtype,
        "dflash_config": dflash,
    }
    if rope["rope_type"] != "default":
        out["rope_scaling"] = rope  # what SGLang's get_rope_config and transformers 4.x read
    if float(cfg.output_multiplier) != 1.0:
        out["logit_scale"] = float(cfg.output_multiplier)  # vLLM's DFlash LogitsProcessor scale
    if cfg.draft_vocab_size:
        # vLLM's DFlash loader: an lm_head of this many rows and the d2t offsets in the weights
        out["draft_vocab_size"] = int(cfg.draft_vocab_size)
    if cfg.architecture == "dflash2":  # what the reference DFlash2DraftModel reads
        out["architectures"] = [DFLASH2_ARCH]
        for k in DFLASH2_KEYS:
            dflash[k] = int(getattr(cfg, k))
    if extra:
        out["dflash_train"] = extra
    return out


def drafter_config_from_hf(d: dict[str, Any]) -> DrafterConfig:
    """`DrafterConfig` from an exported config.json dict (ours, or the public DFlash layout):
    the inverse of `hf_config_dict`. Absent keys take the values `hf_config_dict` would not
    have written: no sliding window without sliding layers, the method's target layers,
    init_std = initializer_range (0.02)."""
    dfc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dfc.get(name, d.get(name, default))

    n_layers = int(d["num_hidden_layers"])
    hidden = int(d["hidden_size"])
    heads = int(d["num_attention_heads"])
    num_target_layers = int(d["num_target_layers"])
    layer_types = d.get("layer_types") or [FULL] * n_layers
    rope = d.get("rope_parameters") or {}
    layer_ids = pick("target_layer_ids") or default_target_layer_ids(num_target_layers, n_layers)
    mask_id = pick("mask_token_id")
    if mask_id is None:
        raise KeyError("dflash_config.mask_token_id")
    softcap = pick("final_logit_softcapping")
    dflash2 = is_dflash2(d)
    return DrafterConfig(
        architecture="dflash2" if dflash2 else "dflash",
        **{k: (int(pick(k)) if dflash2 and pick(k) is not None else None) for k in DFLASH2_KEYS},
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        intermediate_size=int(d["intermediate_size"]),
        layer_types=list(layer_types),
        sliding_window=int(d["sliding_window"]) if SLIDING in layer_types and d.get("sliding_window") else None,
        block_size=int(pick("block_size", 16)),
        mask_token_id=int(mask_id),
        target_layer_ids=[int(i) for i in layer_ids],
        num_target_layers=num_target_layers,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        rope_parameters=dict(rope) if rope else None,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        serving_dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
        vocab_size=int(d.get("vocab_size", 0)),
        input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
        output_multiplier=float(pick("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap),
        init_std=float(d.get("initializer_range", 0.02)),
        block_seeds=str(pick("block_seeds", "none")),
        # a draft_vocab_size equal to the vocabulary (EAGLE-style configs write it so) is no draft vocabulary
        draft_vocab_size=(int(d["draft_vocab_size"]) if d.get("draft_vocab_size")
                          and int(d["draft_vocab_size"]) != int(d.get("vocab_size", 0)) else 0),
    )
