"""Prompt lookup, vectorised: the n-gram proposal at many anchors of many rows at once.

The rule (what vLLM ``ngram``, SGLang ``NGRAM`` and transformers'
``prompt_lookup_num_tokens`` propose), for the anchor at position a of a row,
on ``s`` = the anchor's document up to and including a:

* for n = max_ngram, ..., min_ngram take the trailing n-gram ``s[a-n+1 .. a]``
  and find its MOST RECENT earlier occurrence, ending at e < a (occurrences may
  overlap the trailing one) and starting inside the same document;
* the first (longest) n with an occurrence wins; the proposal is the up to k
  tokens that followed it, ``s[e+1 .. min(e+k, a)]`` (never past the anchor: at
  decoding time nothing later exists);
* no occurrence at any n: no proposal.

This is the ONE definition: `eval/ngram.py` drafts with it (the baseline) and a
drafter with ``block_seeds: prompt_lookup`` reads it in its block inputs, in
training (`loss.make_blocks`), replay and decoding alike. Positions without a
proposed token are -1.
"""
from __future__ import annotations

import torch

__all__ = ["lookup_proposals", "seed_blocks", "BLOCK_SEEDS", "NO_TOKEN"]

NO_TOKEN = -1


def _shifted(x: torch.Tensor, j: int) -> torch.Tensor:
    """x[:, e - j] at every e (NO_TOKEN - 1 where e - j < 0, equal to no token)."""
    if j == 0:
        return x
    T = x.shape[1]
    j = min(j, T)  # an n-gram longer than the row: every position is before its start
    pad = x.new_full((x.shape[0], j), NO_TOKEN - 1)
    return torch.cat([pad, x[:, :T - j]], dim=1)


def lookup_proposals(
    input_ids: torch.Tensor,
    document_ids: torch.Tensor,
    anchors: torch.Tensor,
    k: int,
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> torch.Tensor:
    """[B, A, k] prompt-lookup proposals at `anchors` [B, A] of rows `input_ids` [B, T]
    (documents `document_ids` [B, T], contiguous; negative = padding, never matched);
    NO_TOKEN (-1) where nothing is proposed. See the module docstring for the rule."""
    if min_ngram < 1 or max_ngram < min_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    B, T = input_ids.shape
    A = anchors.shape[1]
    dev = input_ids.device
    x = input_ids.long()
    docs = document_ids.to(dev).long()
    anchors = anchors.to(dev).long().clamp(0, max(T - 1, 0))
    out = torch.full((B, A, int(k)), NO_TOKEN, dtype=torch.long, device=dev)
    if k < 1 or T < 2:
        return out
    e = torch.arange(T, device=dev)
    doc_a = docs.gather(1, anchors)  # [B, A]
    earlier = e[None, None, :] < anchors[:, :, None]  # occurrence ends before the anchor
    best_end = torch.full((B, A), -1, dtype=torch.long, device=dev)
    match = torch.ones(B, A, T, dtype=torch.bool, device=dev)
    for j in range(int(max_ngram)):  # match over the trailing j+1 tokens, built up one token at a time
        tail = anchors - j
        tail_tok = x.gather(1, tail.clamp(min=0))
        tail_ok = (tail >= 0) & (docs.gather(1, tail.clamp(min=0)) == doc_a) & (doc_a >= 0)
        match &= _shifted(x, j)[:, None, :] == tail_tok[:, :, None]
        n = j + 1
        if n < min_ngram:
            continue
        start = e - j  # where an occurrence ending at e starts
        same_doc = (start >= 0)[None, None, :] & (_shifted(docs, j)[:, None, :] == doc_a[:, :, None])
        hit = match & earlier & same_doc & tail_ok[:, :, None]
        last = torch.where(hit, e[None, None, :], e.new_full((), -1)).amax(-1)  # most recent end, -1: none
        best_end = torch.where(last >= 0, last, best_end)  # a longer n (later in this loop) wins
    follow = best_end[:, :, None] + 1 + torch.arange(int(k), device=dev)  # [B, A, k] positions proposed
    ok = (best_end[:, :, None] >= 0) & (follow <= anchors[:, :, None])
    tokens = x.gather(1, follow.clamp(max=T - 1).view(B, -1)).view(B, A, int(k))
    return torch.where(ok, tokens, out)


BLOCK_SEEDS = ("none", "prompt_lookup")


def seed_blocks(block_ids: torch.Tensor, input_ids: torch.Tensor, document_ids: torch.Tensor,
                anchors: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks [B, A, bs] ([token a, MASK x (bs-1)]) with the prompt-lookup proposal at `anchors`
    written over the masks it covers (a ``block_seeds: prompt_lookup`` drafter's input: it
    drafts by denoising the proposal, keeping, correcting or completing it). `keep` [B, A]
    bool: blocks to seed (False: left as masks, what an engine that does not seed gives)."""
    bs = int(block_ids.shape[-1])
    proposals = lookup_proposals(input_ids, document_ids, anchors, bs - 1)
    if keep is not None:
        proposals = torch.where(keep[:, :, None], proposals, proposals.new_full((), NO_TOKEN))
    seeded = block_ids.clone()
    seeded[:, :, 1:] = torch.where(proposals >= 0, proposals, block_ids[:, :, 1:])
    return seeded
