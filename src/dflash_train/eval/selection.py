"""Which held-out prompts an evaluation uses: the first `n` whose formatted
prompt fits `max_prompt_tokens` (the row length the drafter trained at), so
tau is measured where the drafter was trained and a 4000-token ShareGPT paste
does not dominate the eval's time."""
from __future__ import annotations

from typing import Any, Sequence


def pick_eval_prompts(heldout: Sequence[Any], num_prompts: int, target, max_prompt_tokens: int) -> list[str]:
    from dflash_train.eval.command import encode_prompts, heldout_prompts

    out: list[str] = []
    for text in heldout_prompts(heldout, len(heldout)):
        ids, _ = encode_prompts(target, [text])
        if ids and len(ids[0]) <= max_prompt_tokens:
            out.append(text)
        if len(out) >= num_prompts:
            break
    return out
