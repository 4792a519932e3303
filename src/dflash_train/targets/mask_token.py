"""The mask token rule (`choose_mask_token_id`; `Target.mask_token_id` asks it), first match wins:

1. ``tokenizer.mask_token`` when set (Gemma: ``<mask>`` = 4);
2. a vocabulary token literally named ``<mask>``, ``[MASK]``, ``<MASK>`` or ``<|mask|>``;
3. the lowest-id reserved/unused token (``<unused0>``, ``[unused0]``,
   ``<|reserved_special_token_0|>``, ``<|reserved_0|>`` ...);
4. the first embedding row beyond the tokenizer (``len(tokenizer)`` when the
   model's vocab_size is larger, as for Qwen3: 151669 - the id the public
   DFlash Qwen3 drafters use);
5. ``<|fim_pad|>`` (a Qwen token never produced in chat);
6. the highest-id added special token that is none of bos/eos/pad/unk and that the chat
   template does not write (SmolLM2: ``<empty_output>`` = 16, one of its StarCoder-era code
   tokens that chat text never holds). An unused token rather than a trained mask embedding
   because both engines embed the mask slots through the shared embedding row of
   ``mask_token_id`` (vLLM's optional ``mask_embedding.pt`` has no SGLang counterpart); the
   trainer checks that the chosen id never occurs in the training data;
otherwise `TargetError` asking for ``model.mask_token_id``.
"""
from __future__ import annotations

import re

_MASK_NAMES = ("<mask>", "[MASK]", "<MASK>", "<|mask|>")
_UNUSED_RE = re.compile(r"^(<unused\d+>|\[unused\d+\]|<\|reserved_special_token_\d+\|>|<\|reserved_\d+\|>|<reserved_\d+>)$")


def choose_mask_token_id(tokenizer, vocab_size: int | None = None) -> int | None:
    """The mask token id by the documented rule; None when no rule applies."""
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and (vocab_size is None or mid < vocab_size):
        return int(mid)
    vocab = tokenizer.get_vocab()
    for name in _MASK_NAMES:
        if name in vocab:
            return int(vocab[name])
    unused = [i for t, i in vocab.items() if _UNUSED_RE.match(t)]
    if unused:
        return int(min(unused))
    if vocab_size is not None and vocab_size > len(tokenizer):
        return int(len(tokenizer))
    if "<|fim_pad|>" in vocab:
        return int(vocab["<|fim_pad|>"])
    return _unused_special_token(tokenizer, vocab_size)


def _unused_special_token(tokenizer, vocab_size: int | None) -> int | None:
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else " ".join(map(str, template))
    roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("bos", "eos", "pad", "unk")}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    spare = [i for i, t in decoder.items()
             if getattr(t, "special", False) and i not in roles and str(t) not in template
             and (vocab_size is None or i < vocab_size)]
    return int(max(spare)) if spare else None
