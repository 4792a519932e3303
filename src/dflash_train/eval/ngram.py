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

`ngram_generate` is greedy speculative decoding with these proposals (`PromptLookup`, a
`BlockProposer` of the one decoding loop, eval/decoding.py `decode`), with the semantics of
`specdec.speculative_generate`: each
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

import torch

from dflash_train.eval.decoding import decode
from dflash_train.model.lookup import lookup_proposals

__all__ = ["propose", "PromptLookup", "ngram_generate"]


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


class PromptLookup:
    """Prompt lookup as a `Proposer` of a token sequence it holds (a known output, or decoding's
    output so far) and as `decode`'s `BlockProposer` (greedy; no features)."""

    needs_features = False
    pad_token_id = 0

    def __init__(self, tokens=(), k: int = 15, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if k < 1:
            raise ValueError("k (draft tokens per step) must be >= 1")
        self.tokens = [int(t) for t in tokens]
        self.k, self.max_ngram, self.min_ngram = int(k), int(max_ngram), int(min_ngram)
        self.max_block = self.k + 1

    def propose(self, anchor: int, k: int) -> list[int]:
        return propose(self.tokens[:anchor + 1], min(self.k, int(k)), self.max_ngram, self.min_ngram)

    # ------------------------------------------------------------------ decode's BlockProposer

    def begin(self, hidden_states, prompt_ids: torch.Tensor, first: int) -> None:
        self.tokens = prompt_ids[0].tolist() + [int(first)]

    def draft(self, output_ids, start, room, temperature, generator):
        block = torch.tensor([[self.tokens[start]] + self.propose(start, room)], dtype=torch.long,
                             device=output_ids.device)
        return block, None

    def advance(self, hidden_states, start, produced, new_tokens) -> None:
        del self.tokens[start + 1:]
        self.tokens += list(new_tokens[:produced])


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
    return decode(target, PromptLookup((), k, max_ngram, min_ngram), input_ids, max_new_tokens,
                  stop_token_ids)
