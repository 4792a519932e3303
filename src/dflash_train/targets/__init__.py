"""Frozen target models: loading (HF dir, GGUF, embedded Gemma 3 270M), layer
capture by forward hooks, embedding / lm_head / soft-cap, the mask token
rule. See `dflash_train.targets.model` (tiny random targets for tests: tests/tiny_target.py)."""
from dflash_train.targets.model import (
    Target,
    TargetError,
    choose_mask_token_id,
    document_attention_mask,
    document_positions,
    embedded_gguf_path,
    load_target,
    load_tokenizer,
    resolve_dtype,
)

__all__ = [
    "Target",
    "TargetError",
    "choose_mask_token_id",
    "document_attention_mask",
    "document_positions",
    "embedded_gguf_path",
    "load_target",
    "load_tokenizer",
    "resolve_dtype",
]
