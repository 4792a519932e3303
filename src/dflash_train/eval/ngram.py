"""Prompt lookup (n-gram drafting): the free speculative-decoding baseline.

What vLLM (``method: ngram``), SGLang (``NGRAM``) and transformers
(``prompt_lookup_num_tokens``) do without any draft model: the draft for the
next tokens is copied from earlier in the prompt + generated text.

The rule (`propose`), on the sequence ``s`` = prompt + tokens generated so far:

* for n = max_ngram, ..., min_ngram (3, 2, 1 by default) take the trailing
  n-gram ``s[-n:]`` and look for its MOST RECENT earlier occurrence
  ``s[i:i+n] == s[-n:]`` with ``i < len(s) - n`` (any occurrence except the
  trailing n-gram itself; occurrences may overlap it, e.g. ``[1, 1, 1, 1]``);
* the first (longest) n with an occurrence wins; the proposal is the up to
  ``k`` tokens that followed it, ``s[i+n : i+n+k]`` (fewer when the sequence
  ends first, at least one);
* no occurrence at any n: no proposal (an empty list).

`ngram_generate` is greedy speculative decoding with these proposals and the
target's KV cache, with the semantics of `specdec.speculative_generate`: each
step ONE target forward verifies ``[last token, proposal...]``; accepted = the
matching prefix of the proposal, plus the target's own next token (the bonus);
produced = accepted + 1 (capped by max_new_tokens, cut after a stop token).
A step with no proposal is a plain one-token step (produced = 1). The output
equals plain greedy decoding token for token; ``acceptance_lengths`` are the
per-step produced counts and tau = their mean, comparable with a drafter's tau
at the same number of draft tokens (k = block_size - 1).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from dflash_train.model.lookup import lookup_proposals
from dflash_train.eval.specdec import _crop_to, _make_target_cache, _TargetRunner

__all__ = ["propose", "ngram_generate"]


def propose(tokens, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `k` draft tokens by prompt lookup on `tokens` (prompt + generated; list,
    1-D array or tensor); [] when the trailing n-gram occurs nowhere earlier for
    any n in max_ngram..min_ngram. See the module docstring for the rule; the one
    implementation is `model.lookup.lookup_proposals` (anchor = the last token)."""
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    s = torch.as_tensor(tokens, dtype=torch.long).detach().cpu().reshape(1, -1)
    if k < 1 or s.shape[1] < 2:
        return []
    anchor = torch.tensor([[s.shape[1] - 1]])
    drafts = lookup_proposals(s, torch.zeros_like(s), anchor, int(k), int(max_ngram), int(min_ngram))[0, 0]
    return drafts[drafts >= 0].tolist()


@torch.inference_mode()
def ngram_generate(
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None,
    k: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> tuple[torch.Tensor, list[int]]:
    """Greedy speculative decoding with prompt-lookup drafts of up to `k` tokens.

    Returns (output_ids [1, n + generated], acceptance_lengths), like
    `speculative_generate`; the output equals `plain_generate` (temperature 0).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if k < 1:
        raise ValueError("k (draft tokens per step) must be >= 1")
    model = target.model
    device = target.device
    input_ids = input_ids.to(device)
    n = int(input_ids.shape[1])
    max_length = n + int(max_new_tokens)
    stops = set(int(s) for s in (stop_token_ids or []))

    # seq[:start + 1] = prompt + produced tokens; seq[start] is the last one (not yet in the cache)
    seq = np.zeros(max_length + 1, dtype=np.int64)
    seq[:n] = input_ids[0].cpu().numpy()
    cache = _make_target_cache(model, block_size=k + 1)
    run = _TargetRunner(target)  # the same target forward + head as DFlash and plain decoding
    logits, _ = run(input_ids, torch.arange(n, device=device)[None], cache, 1, False)
    seq[n] = int(torch.argmax(logits[0, -1]).item())
    del logits

    acceptance_lengths: list[int] = []
    start = n
    stopped = int(seq[n]) in stops
    while start + 1 < max_length and not stopped:
        draft = propose(seq[:start + 1], min(int(k), max_length - start - 1), max_ngram, min_ngram)
        vs = 1 + len(draft)
        block = torch.tensor([[int(seq[start])] + draft], dtype=torch.long, device=device)
        pos = torch.arange(start, start + vs, device=device)[None]
        logits, _ = run(block, pos, cache, vs, False)
        posterior = torch.argmax(logits[0], dim=-1).tolist()  # [vs]
        del logits
        accepted = 0
        while accepted < len(draft) and draft[accepted] == posterior[accepted]:
            accepted += 1
        new = draft[:accepted] + [posterior[accepted]]
        produced = min(accepted + 1, max_length - start - 1)
        for j, tok in enumerate(new[:produced]):
            if tok in stops:
                produced = j + 1
                stopped = True
                break
        seq[start + 1:start + 1 + produced] = new[:produced]
        start += produced
        _crop_to(cache, start)
        acceptance_lengths.append(produced)

    out_ids = torch.from_numpy(seq[:min(start + 1, max_length)].copy())[None]
    return out_ids.to(device=device, dtype=input_ids.dtype), acceptance_lengths
