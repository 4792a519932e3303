"""On-policy anchors: train where greedy speculative decoding with the CURRENT drafter goes.

Greedy DFlash decoding drafts one block at an anchor, keeps the matching prefix plus the
target's token, and drafts the next block at the position after it. Every context it
drafts from is the target's own output, so on target-written answers (`regenerate`,
greedy) the decoding's states are the training rows themselves: what is on-policy is
WHICH anchors decoding visits - the start of each answer and every position right
after a rejection (Draft-OPD, arXiv 2605.29343, replays drafting from such
"verification-exposed error positions"; with a DFlash drafter the target-assisted
rollout needs no new generation, the training row is it).

`on_policy_anchors` drafts a block at every candidate anchor of the rows in one no-grad
forward, walks each answer span the way decoding does (accept the matching prefix, jump
past it) and picks the training anchors among the visited positions first, the other
candidates after (uniformly at random within each group, one torch.rand of [B, T] from
the generator, like `sample_anchors`, so a saved generator state replays them).
Proposals are the argmax over the loss's vocabulary (`vocab_subset` when set).
"""
from __future__ import annotations

import torch

from dflash_train.model.acceptance import matching_prefix, walk
from dflash_train.model.lookup import seed_blocks
from dflash_train.model.loss import _head, sample_anchors, unwrap


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: positions `sample_anchors` may draw (supervised, followed by a supervised
    token of the same document)."""
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    if lm.shape[1] >= 2:
        ok[:, :-1] = lm[:, :-1] & lm[:, 1:] & (document_ids[:, :-1] == document_ids[:, 1:]) & (document_ids[:, :-1] >= 0)
    return ok


@torch.no_grad()
def draft_everywhere(drafter, target, input_ids, document_ids, features, ok, vocab_subset=None,
                     max_chunk_logits: int = 1 << 27, seeded: bool | None = None,
                     block_len: int | None = None) -> torch.Tensor:
    """[B, T, bs-1] the drafter's greedy drafts at every position where `ok` (others: -1), from
    one forward: what decoding would propose there given the same context (eval/replay.py).
    block_len: blocks of that many tokens instead of block_size (bs = block_len), as an engine
    drafting k = block_len - 1 tokens builds them.

    Full vocabulary: the target's logits, and a DFlash 2 drafter's selector path, as decoding
    drafts. With `vocab_subset`: the argmax over the subset (the loss's vocabulary).
    seeded: prompt-lookup seeds in the blocks (None: as the drafter's ``block_seeds`` says;
    False: masks only, what an engine that does not seed gives)."""
    core = unwrap(drafter)
    bs = int(block_len or core.cfg.block_size)
    B, T = input_ids.shape
    A = max(1, int(ok.sum(1).max()))
    # all candidates of a row, ascending, padded with position 0 (valid False)
    pos = torch.arange(T, device=ok.device).expand(B, T)
    anchors = torch.sort(torch.where(ok, pos, pos + T), dim=1).values[:, :A]
    valid = anchors < T
    anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
    block = torch.full((B, A, bs), int(core.cfg.mask_token_id), dtype=torch.long, device=input_ids.device)
    block[:, :, 0] = torch.gather(input_ids, 1, anchors)
    if seeded is None:
        seeded = core.cfg.block_seeds == "prompt_lookup"
    if seeded:
        block = seed_blocks(block, input_ids, document_ids, anchors)
    dtype = core.fc.weight.dtype
    embeds = target.embed(block.view(B, A * bs)).to(dtype)
    hidden = core(embeds, anchors, valid, document_ids, features=features.to(dtype), block_len=bs)
    h = hidden.view(B * A, bs, -1)[:, 1:]  # [B*A, bs-1, H]
    first = block[:, :, 0].reshape(-1)
    selector = getattr(core, "candidate_selector", None) if vocab_subset is None else None
    V = int(target.lm_head_weight.shape[0]) if vocab_subset is None else int(vocab_subset.numel())
    step = max(1, max_chunk_logits // ((bs - 1) * V))
    preds = torch.empty(B * A, bs - 1, dtype=torch.long, device=h.device)
    for s in range(0, B * A, step):
        hs = h[s:s + step]
        if vocab_subset is None:
            logits = target.logits(hs)
            preds[s:s + step] = selector.select(hs, logits, first[s:s + step], 0.0)[0] if selector is not None \
                else logits.argmax(-1)
        else:  # the target's multiplier and soft-cap are monotone: the argmax of the raw product is the same
            W = _head(target, vocab_subset)[0]
            preds[s:s + step] = vocab_subset.to(h.device).long()[(hs.to(W.dtype) @ W.T).argmax(-1)]
    out = torch.full((B, T, bs - 1), -1, dtype=torch.long, device=input_ids.device)
    rows = torch.arange(B, device=ok.device)[:, None].expand(B, A)
    out[rows[valid], anchors[valid]] = preds.view(B, A, bs - 1)[valid]
    return out


def visited_anchors(input_ids: torch.Tensor, ok: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the anchors greedy decoding visits when it writes each answer span.

    A span starts at a valid anchor whose previous position is not one (the answer's first
    token, which the target's prefill gives); the decoding walk over it is the one greedy
    acceptance (`acceptance.walk`), with each anchor's matching prefix computed for all anchors
    at once."""
    B, T = ok.shape
    k = torch.arange(1, drafts.shape[-1] + 1, device=ok.device)
    truth = input_ids[:, (torch.arange(T, device=ok.device)[:, None] + k).clamp(max=T - 1)]  # [B, T, bs-1]
    match = matching_prefix(drafts, truth).tolist()  # the draft's matching prefix per anchor
    okl = ok.tolist()
    rows: list[int] = []
    cols: list[int] = []
    for b in range(B):
        s = 0
        while s < T:
            if not okl[b][s]:
                s += 1
                continue
            end = s  # the span's valid anchors are s..end-1; its last token, at `end`, ends decoding
            while end < T and okl[b][end]:
                end += 1
            for anchor, _ in walk(s, end, match[b].__getitem__):
                rows.append(b)
                cols.append(anchor)
            s = end
    visited = torch.zeros_like(ok)
    visited[rows, cols] = True
    return visited


def on_policy_anchors(drafter, target, input_ids, loss_mask, document_ids, features, num_anchors: int,
                      generator: torch.Generator, vocab_subset=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(anchors [B, A], valid [B, A], sums): the anchors decoding visits first, then the other
    valid ones, each group in random order; A = num_anchors. sums (device scalars, summed over
    a logging interval by the trainer): op_visited, op_candidates (see `on_policy_metrics`)."""
    ok = valid_anchor_mask(loss_mask, document_ids)
    drafts = draft_everywhere(drafter, target, input_ids, document_ids, features, ok, vocab_subset)
    visited = visited_anchors(input_ids, ok, drafts)
    # sample_anchors draws the visited anchors (keys in [0, 1)) before the others ([1, 2))
    anchors, valid = sample_anchors(loss_mask, document_ids, num_anchors, int(unwrap(drafter).cfg.block_size),
                                    generator, offset=(~visited).float())
    return anchors, valid, {"op_visited": visited.sum(), "op_candidates": ok.sum()}


def on_policy_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """metrics.jsonl fields of on-policy steps: `on_policy_tau`, tokens per decoding step of the
    current drafter walked along the training answers (every valid anchor is one drafted
    token position; each visit is one target forward), and the fraction of anchors visited."""
    if "op_visited" not in sums:
        return {}
    visited, cand = float(sums["op_visited"]), float(sums["op_candidates"])
    return {"on_policy_tau": cand / max(visited, 1.0), "on_policy_visited_frac": visited / max(cand, 1.0)}
