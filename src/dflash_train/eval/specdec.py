"""Real speculative decoding with a DFlash drafter against the real target.

Same semantics as the reference `dflash.model.dflash_generate` (PyPI dflash
0.1.0), which is what SGLang / vLLM serve:

* prefill the prompt (positions 0..n-1) through the target with a KV cache;
  the first new token comes from the last prompt logits; the context features
  of the prompt (target layers `target_layer_ids`, HF ``hidden_states[i + 1]``)
  go into the drafter's context cache.
* each step, at ``start`` (the position of the last produced token): the block
  is ``[token at start, MASK x (bs - 1)]`` at positions ``start..start+bs-1``
  (a ``block_seeds: prompt_lookup`` drafter gets the prompt-lookup proposal of
  prompt + output so far written over the masks it covers, as in training);
  the drafter sees context strictly before ``start`` plus the block and fills
  the bs - 1 masked slots in one forward; ONE target forward over the block
  verifies them. Greedy: accepted = matching prefix; the target's own next
  token after it is the bonus. Sampling (temperature > 0): standard lossless
  speculative sampling (accept draft token x with prob min(1, p(x)/q(x)); at the
  first rejection sample from normalised max(0, p - q); if all are accepted the
  bonus comes from p at the last position).
* produced = accepted + 1 (capped by max_new_tokens, cut after a stop token);
  the target cache is cropped to the new start; the verify forward's features
  of the anchor and the accepted tokens (NOT the bonus, which the target has
  not seen yet) extend the drafter's context.

A DFlash 2 drafter drafts with its candidate selector (the path through each
slot's unary top-k, argmax or sampled left to right from the anchor, as the
reference ``propose``); rejection sampling then uses the q rows the path was
drawn from.

``acceptance_lengths`` are the per-step ``produced`` counts, exactly as the
reference reports them; tau = their mean.

The loop itself is eval/decoding.py `decode` (shared with prompt lookup, eval/ngram.py);
here is the DFlash drafter's side of it (`DrafterProposer`).

Speed (CPU, issue 12): the target runs as its decoder (KV cache, hidden
states) followed by `Target.inference_logits` over only the rows that are
needed (the last prompt position; the verify block; the drafter's masked
slots): on CPU that head reads the 262K x H weight once per call however many
rows it has, where MKL's small-batch sgemm took ~4x a one-row pass for a
block. Plain decoding uses the very same decoder + head, so its tokens/s is
a fair baseline. A verify step does one host sync (the drafts and the target's
argmax come back together) and no torch.isin.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from dflash_train.eval.decoding import (
    decode,
    layer_features,
    plain_generate,
    rejection_sample,
    sample_rows,
    sampling_probs,
)
from dflash_train.model.lookup import seed_blocks

__all__ = [
    "speculative_generate",
    "plain_generate",
    "rejection_sample",
    "sampling_probs",
    "acceptance_histogram",
    "tau_of",
    "DrafterProposer",
]


def acceptance_histogram(acceptance_lengths: Iterable[int], block_size: int) -> dict[int, int]:
    """{tokens produced per verify step (1..block_size): number of steps}."""
    hist = {k: 0 for k in range(1, int(block_size) + 1)}
    for a in acceptance_lengths:
        hist[int(a)] = hist.get(int(a), 0) + 1
    return hist


def tau_of(acceptance_lengths: Sequence[int]) -> float:
    return float(sum(acceptance_lengths)) / len(acceptance_lengths) if acceptance_lengths else float("nan")


class DrafterProposer:
    """A DFlash drafter as `decode`'s `BlockProposer`: the block ``[token at start, MASK x (bs-1)]``
    (a ``block_seeds: prompt_lookup`` drafter: the prompt-lookup proposal written over the masks,
    as in training) drafted in one forward from its context cache; DFlash 2 through its candidate
    selector. The verify forward's features of the produced positions extend the context.
    k: k draft tokens a step from a block of k + 1, as an engine serving the drafter at k builds it."""

    needs_features = True

    def __init__(self, drafter, target, k: int | None = None) -> None:
        cfg = drafter.cfg
        self.drafter, self.target = drafter, target
        self.bs = self.max_block = cfg.served_block_len(k) or int(cfg.block_size)
        self.layer_ids = list(cfg.target_layer_ids)
        self.pad_token_id = int(cfg.mask_token_id)
        self.seeded = cfg.block_seeds == "prompt_lookup"
        self.selector = getattr(drafter, "candidate_selector", None)  # DFlash 2 only (model/dflash2.py)
        self.cache = self.no_docs = None

    def begin(self, hidden_states, prompt_ids: torch.Tensor, first: int) -> None:
        self.cache = self.drafter.new_cache()
        self.drafter.extend_context(self.cache, layer_features(hidden_states, self.layer_ids), 0)
        self.anchor = torch.zeros(1, 1, dtype=torch.long, device=prompt_ids.device)

    def draft(self, output_ids, start, room, temperature, generator):
        vs = min(self.bs, room + 1)  # >= 2 here
        block = output_ids[:, start:start + vs].clone()
        if self.seeded:  # the prompt-lookup proposal in the masked slots (model/lookup.py), as in training
            if self.no_docs is None:
                self.no_docs = torch.zeros_like(output_ids)
            block = seed_blocks(block[:, None], output_ids[:, :start + 1], self.no_docs[:, :start + 1],
                                self.anchor.fill_(start))[:, 0]
        embeds = self.target.embed(block)
        hidden = self.drafter.draft_block(self.cache, embeds, start)[:, 1:vs]
        draft_logits = self.drafter.restrict_logits(self.target.inference_logits(hidden.to(embeds.dtype)))
        q = None
        if self.selector is not None:  # DFlash 2: the selector's path through the unary top-k
            path, candidates, q_top = self.selector.select(hidden, draft_logits, block[:, 0], temperature, generator)
            block[:, 1:] = path
            if temperature > 0:  # q: the rows the path was drawn from, over the whole vocabulary
                q = torch.zeros(draft_logits.shape, dtype=q_top.dtype, device=block.device).scatter_(-1, candidates, q_top)
        elif temperature > 0:
            q = sampling_probs(draft_logits, temperature)  # [1, vs-1, V]
            block[:, 1:] = sample_rows(q, generator)
        else:
            block[:, 1:] = torch.argmax(draft_logits, dim=-1)
        return block, q

    def advance(self, hidden_states, start, produced, new_tokens) -> None:
        # context features of the anchor + accepted tokens (positions start..start+produced-1)
        self.drafter.extend_context(self.cache, layer_features(hidden_states, self.layer_ids, produced), start)


def speculative_generate(drafter, target, *args, k: int | None = None, **kwargs) -> tuple[torch.Tensor, list[int]]:
    """DFlash speculative decoding: `decode` with the drafter as the proposer (k: draft tokens a
    step, default block_size - 1); the rest of the arguments are decode's (input_ids,
    max_new_tokens, stop_token_ids, temperature, generator).
    Returns (output_ids [1, n + generated], acceptance_lengths).

    Greedy (temperature 0) output equals `plain_generate` token for token;
    temperature > 0 is distributed exactly as plain sampling from the target.
    """
    return decode(target, DrafterProposer(drafter, target, k), *args, **kwargs)
