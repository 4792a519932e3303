"""Frozen target models: loading (HF dir, GGUF, embedded Gemma 3 270M), layer
capture by forward hooks, embedding / lm_head / soft-cap, the mask token
rule (`targets.mask_token`). The wrapper: `dflash_train.targets.model`; loading:
`targets.loading`; the GGUF cache: `targets.gguf` (tiny random targets for tests:
tests/tiny_target.py)."""
from dflash_train.targets.gguf import converted_dir, embedded_gguf_path
from dflash_train.targets.loading import (TokenizerOnly, check_target_files, load_target, load_tokenizer, resolve_dtype,
                                          served_target_dir)
from dflash_train.targets.mask_token import choose_mask_token_id
from dflash_train.targets.model import Target, TargetError, document_attention_mask, document_positions

__all__ = [
    "Target",
    "TargetError",
    "TokenizerOnly",
    "check_target_files",
    "choose_mask_token_id",
    "document_attention_mask",
    "document_positions",
    "converted_dir",
    "embedded_gguf_path",
    "load_target",
    "load_tokenizer",
    "resolve_dtype",
    "served_target_dir",
]
