"""Anchors, blocks, labels/weights and the chunked DFlash loss.

Block anchored at a: inputs [token a, MASK x (bs-1)] at positions a..a+bs-1;
position k (1..bs-1) is trained to predict token a+k (SAME-position labels;
predicting a+k+1 is the classic silent bug) with weight

    exp(-(k-1)/gamma) * loss_mask[a+k] * in_bounds(a+k) * same_document(a, a+k) * anchor_valid

and loss = sum(w * CE) / sum(w). The lm_head (vocab ~262K for Gemma) dominates
the cost, so logits are produced chunk by chunk and never all at once; the
gradient of each chunk w.r.t. the drafter hidden is computed right there in the
forward, by hand (2 matmuls per chunk: logits and dlogits @ W; no saved [N, V]
tensor, no recompute, the softmax gradient written in place into the logits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from dflash_train.model.lookup import seed_blocks
from dflash_train.model.objectives import Objective, chunk_terms, dpace_weights
from dflash_train.model.target import TargetHead

# gamma of the method for the published block sizes
_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """7 for bs 16, 5 for bs 10, 4 for bs 8 (the method). Other sizes: piecewise-linear
    through (8, 4), (10, 5), (16, 7), extended with the end slopes (0.5 below 10,
    1/3 above 10), floored at 1. So bs 2 -> 1, bs 4 -> 2, bs 32 -> 12.33."""
    bs = int(block_size)
    if bs in _GAMMA:
        return _GAMMA[bs]
    g = 4.0 + 0.5 * (bs - 8) if bs < 10 else 5.0 + (bs - 10) / 3.0
    return max(1.0, g)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, weighted mean of the objective's term (has grad)
    weight_sum: torch.Tensor  # scalar, sum of weights (no grad): the normaliser of `total`
    total: torch.Tensor  # scalar, sum of weight * term (has grad); loss = total / weight_sum
    correct: torch.Tensor  # [bs-1] long: argmax == label among supervised positions, per block position k=1..bs-1
    count: torch.Tensor  # [bs-1] long: supervised positions per block position
    num_blocks: torch.Tensor  # scalar long: valid anchors
    # DFlash 2: the selector's metric sums (model/dflash2.py SELECTOR_SUMS), device tensors
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def sample_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator,
    offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, up to num_anchors positions a drawn uniformly without replacement among the valid
    ones (loss_mask[a] and loss_mask[a+1], same document, not padding). `offset` [B, T] (0 or 1
    at valid positions) draws every offset-0 position before any offset-1 one (on_policy.py).

    Returns anchors [B, A] long and valid [B, A] bool, A = num_anchors: valid anchors first,
    ascending, then padding (anchor 0, valid False). Randomness comes ONLY from `generator`
    (one torch.rand of [B, T] on the generator's device), so a saved generator state
    replays the same anchors. block_size is accepted for the interface; a block that runs
    past the row end or its document is still valid (those positions weigh 0).
    """
    del block_size
    B, T = loss_mask.shape
    dev = loss_mask.device
    lm = loss_mask.bool()
    ok = torch.zeros(B, T, dtype=torch.bool, device=dev)
    if T >= 2:
        ok[:, :-1] = lm[:, :-1] & lm[:, 1:] & (document_ids[:, :-1] == document_ids[:, 1:]) & (document_ids[:, :-1] >= 0)
    A = int(num_anchors)
    # random keys; invalid positions get key 4 (> any rand + offset) so they sort last
    keys = torch.rand(B, T, generator=generator, device=generator.device)
    if keys.device != dev:
        # CPU generator, CUDA batch: pinned + non_blocking so the copy does not sync the host
        if dev.type == "cuda":
            keys = keys.pin_memory()
        keys = keys.to(dev, non_blocking=True)
    if offset is not None:
        keys = keys + offset.to(keys.dtype)
    keys = torch.where(ok, keys, torch.full_like(keys, 4.0))
    if A > T:
        keys = torch.cat([keys, keys.new_full((B, A - T), 5.0)], dim=1)
    picked_keys, picked = torch.topk(keys, A, dim=1, largest=False, sorted=True)
    valid = picked_keys < 3.0
    # ascending positions with padding last: sort by (valid first, position)
    order_key = torch.where(valid, picked, picked.new_full(picked.shape, T + A + 1))
    order_key, _ = torch.sort(order_key, dim=1)
    valid = order_key <= T
    anchors = torch.where(valid, order_key, torch.zeros_like(order_key))
    return anchors.long(), valid


def make_blocks(input_ids, loss_mask, document_ids, anchors, anchor_valid, block_size, mask_token_id, gamma):
    """Block input ids [B, A*bs], labels [B, A, bs-1] (token a+k), weights [B, A, bs-1], supervised [B, A, bs-1]."""
    B, T = input_ids.shape
    A = anchors.shape[1]
    bs = int(block_size)
    dev = input_ids.device
    block_ids = torch.full((B, A, bs), int(mask_token_id), dtype=torch.long, device=dev)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    k = torch.arange(1, bs, device=dev)
    pos = anchors[:, :, None] + k  # [B, A, bs-1] the SAME position a+k
    in_bounds = pos < T
    posc = pos.clamp(max=T - 1).reshape(B, -1)
    labels = torch.gather(input_ids, 1, posc).view(B, A, bs - 1)
    lm = torch.gather(loss_mask.bool(), 1, posc).view(B, A, bs - 1)
    doc_t = torch.gather(document_ids, 1, posc).view(B, A, bs - 1)
    doc_a = torch.gather(document_ids, 1, anchors)[:, :, None]
    supervised = in_bounds & lm & (doc_t == doc_a) & anchor_valid[:, :, None]
    decay = torch.exp(-(k.float() - 1.0) / float(gamma))
    weights = decay * supervised.float()
    return block_ids.view(B, A * bs), labels, weights, supervised


class _ChunkedObjective(torch.autograd.Function):
    """sum_i w_i * term_i over chunks of rows (objectives.py); saves only d(sum)/dh [N, H].

    The gradient is computed in the forward, chunk by chunk, so one [chunk, V] logits
    buffer (a few for the teacher objectives) exists at a time and nothing is recomputed;
    backward just scales the saved gradient. Each chunk's per-row gradients are kept
    unweighted until every row is done, then scaled by the row weights: D-PACE weights
    depend on the other positions of the block. Also returns argmax-correct flags and the
    weights used (no grad). W is the frozen lm_head (never gets a gradient).
    """

    @staticmethod
    def forward(ctx, hidden, teacher, labels, weights, chunk_rows, head, objective, block_rows, need_grad):
        W, mult, cap = head
        N = hidden.shape[0]
        terms = torch.zeros(N, dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(N, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if need_grad else None
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            t_h = teacher[s:e] if teacher is not None else None
            term, g, pred = chunk_terms(hidden[s:e].detach(), t_h, W, labels[s:e], objective, mult, cap, need_grad)
            terms[s:e] = term
            correct[s:e] = pred == labels[s:e]
            if need_grad:
                grad[s:e] = g
        if objective.kind == "dpace":
            q = torch.exp(-terms).view(-1, block_rows)
            weights = dpace_weights(q, (weights > 0).view(-1, block_rows), objective.dpace_alpha).reshape(-1)
        weights = weights.float()
        total = (terms * weights).sum()
        if need_grad:
            grad.mul_(weights.to(grad.dtype)[:, None])
        ctx.save_for_backward(grad if need_grad else hidden.new_zeros(0))
        ctx.mark_non_differentiable(correct, weights)
        return total, correct, weights

    @staticmethod
    def backward(ctx, grad_total, grad_correct, grad_weights):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None, None, None


def _head(target: TargetHead, vocab_subset: torch.Tensor | None):
    """(lm_head rows, multiplier, soft-cap) as in target.logits: lm_head, then the target's
    multiplier and soft-cap. Both are elementwise, so a subset's logits equal the full
    logits restricted to those ids."""
    W = target.lm_head_weight.detach()
    if vocab_subset is not None:
        W = W[vocab_subset]
    mult = float(target.output_multiplier)
    cap = target.final_logit_softcapping
    cap = float(cap) if cap is not None and float(cap) > 0 else None
    return W, mult, cap


def subset_labels(labels: torch.Tensor, vocab_subset: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab labels -> indices into vocab_subset; -1 where the label is outside it."""
    subset = vocab_subset.to(labels.device).long()
    lookup = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
    lookup[subset] = torch.arange(subset.numel(), device=labels.device)
    return lookup[labels]


def split_teacher(features: torch.Tensor, drafter_width: int, anchors: torch.Tensor, block_size: int):
    """(the drafter's features [B, T, K*H], teacher hidden rows [B*A*(bs-1), H]): the target's
    final hidden state that predicts block position k of the block anchored at a sits at
    position a+k-1 (next-token prediction), taken from the channels after the drafter's."""
    if features.shape[-1] <= drafter_width:
        raise ValueError(f"this objective needs the target's final hidden state in the features: got "
                         f"{features.shape[-1]} channels, the drafter alone reads {drafter_width}")
    B, T, _ = features.shape
    final = features[..., drafter_width:]
    k = torch.arange(block_size - 1, device=anchors.device)
    pos = (anchors[:, :, None] + k).clamp(max=T - 1).reshape(B, -1)  # a .. a+bs-2
    rows = torch.gather(final, 1, pos[:, :, None].expand(-1, -1, final.shape[-1]))
    return features[..., :drafter_width], rows.reshape(-1, final.shape[-1])


def unwrap(model):
    """The DFlashDrafter inside DDP (.module) and/or torch.compile (._orig_mod) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def dflash_loss(
    drafter,
    target,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    features: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    gamma: float | None = None,
    chunk_blocks: int = 64,
    vocab_subset: torch.Tensor | None = None,
    backend: str | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_chunk_logits: int = 1 << 25,
    selector_loss_weight: float = 1.0,
    objective: Objective | None = None,
    unseeded_fraction: float = 0.0,
) -> LossOutput:
    """The DFlash training loss of one batch ([B, T] rows, features [B, T, K*H]).

    anchors: optional precomputed (anchors, valid) (tests); else sampled with `generator`.
    backend: attention backend for the drafter ("sdpa" | "flex"; default flex on CUDA).
    vocab_subset: LongTensor of allowed ids; the softmax runs over those only, labels
    outside weigh 0 and count as misses in `correct`.
    max_chunk_logits: cap on one chunk's logits elements (memory bound for huge vocabularies).
    objective: the training objective (model/objectives.py; default ce_decay). The teacher
    objectives read the target's final hidden state as the LAST H channels of `features`
    (capture with the final layer, see objectives.capture_layer_ids); the drafter gets the rest.
    unseeded_fraction: with ``block_seeds: prompt_lookup``, the share of blocks left as masks
    (drawn from `generator` after the anchors).
    No host syncs: correct/count/num_blocks stay device tensors.
    """
    core = unwrap(drafter)  # attributes from the drafter itself; the call goes through the wrapper (DDP hooks)
    cfg = core.cfg
    bs = cfg.block_size
    if gamma is None:
        gamma = default_gamma(bs)
    dev = input_ids.device
    document_ids = document_ids.to(dev)
    if anchors is None:
        anchors = sample_anchors(loss_mask, document_ids, num_anchors, bs, generator)
    anc, valid = anchors
    block_ids, labels, weights, supervised = make_blocks(
        input_ids, loss_mask, document_ids, anc, valid, bs, cfg.mask_token_id, gamma
    )
    if cfg.block_seeds == "prompt_lookup":
        B, A = anc.shape
        keep = None
        if unseeded_fraction > 0:
            keep = torch.rand(B, A, generator=generator, device=generator.device).to(dev) >= unseeded_fraction
        block_ids = seed_blocks(block_ids.view(B, A, bs), input_ids, document_ids, anc, keep).view(B, A * bs)
    objective = objective or Objective()
    if not objective.decay_weights:
        weights = supervised.float()
    dtype = core.fc.weight.dtype
    teacher = None
    if objective.needs_teacher:
        features, teacher = split_teacher(features, int(core.fc.weight.shape[1]), anc, bs)
    with torch.no_grad():  # the target is frozen: never let a gradient reach its embedding
        block_embeds = target.embed(block_ids).to(dtype)
    hidden = drafter(block_embeds, anc, valid, document_ids, features=features.to(dtype), backend=backend)
    B, A = anc.shape
    H = hidden.shape[-1]
    h = hidden.view(B, A, bs, H)[:, :, 1:].reshape(-1, H)  # block positions 1..bs-1
    flat_labels = labels.reshape(-1)
    flat_w = weights.reshape(-1)
    if vocab_subset is None:
        ce_labels, head = flat_labels, _head(target, None)
    else:
        vocab_subset = vocab_subset.to(dev).long()
        ce_labels = subset_labels(flat_labels, vocab_subset, int(target.lm_head_weight.shape[0]))
        head = _head(target, vocab_subset)
    flat_w = flat_w * (ce_labels >= 0)  # labels outside the subset weigh 0
    # chunk = chunk_blocks blocks, made smaller if needed so one chunk's logits stay
    # under max_chunk_logits elements (262K vocab x 64 blocks x 15 would be 1 GB fp32)
    V = int(target.lm_head_weight.shape[0]) if vocab_subset is None else int(vocab_subset.numel())
    # the teacher objectives hold ~6 [rows, V] buffers at once (logits, probabilities of both)
    cap_elems = max_chunk_logits // (6 if objective.needs_teacher else 1)
    rows = max(1, min(max(1, chunk_blocks) * (bs - 1), cap_elems // max(1, V)))
    need_grad = torch.is_grad_enabled() and h.requires_grad
    total, correct, used_w = _ChunkedObjective.apply(h, teacher, ce_labels, flat_w, rows, head, objective, bs - 1,
                                                     need_grad)
    correct = correct & (ce_labels >= 0)  # out-of-subset labels count as misses
    weight_sum = used_w.sum()
    # clamp: a batch with nothing supervised gives loss 0 (not NaN); the trainer can skip it
    loss = total / weight_sum.clamp(min=1e-12)
    extra: dict[str, torch.Tensor] = {}
    if hasattr(core, "selector_loss"):  # DFlash 2: + weight * the candidate selector's K-way CE
        sel, extra = core.selector_loss(h, block_ids.view(B, A, bs)[:, :, 0], labels, flat_w, supervised, head, rows,
                                        vocab_subset, None if vocab_subset is None else ce_labels)
        loss = loss + selector_loss_weight * sel
        # `total` is what the trainer backpropagates and divides by the step's weight sum
        total = total + selector_loss_weight * sel * weight_sum.detach()
    sup = supervised.view(B * A, bs - 1)
    corr = correct.view(B * A, bs - 1) & sup
    return LossOutput(
        loss=loss,
        weight_sum=weight_sum.detach(),
        total=total,
        correct=corr.sum(0),
        count=sup.sum(0),
        num_blocks=valid.sum(),
        extra=extra,
    )


def expected_acceptance_length(acc_per_pos: Sequence[float] | torch.Tensor) -> float:
    """tau estimate from per-position accuracies: 1 + sum_k prod_{j<=k} acc_j.

    acc_j = accuracy at block position j given correct inputs; a draft is accepted up to
    the first miss, plus the target's bonus token (the 1). It treats positions as
    independent, so it is an estimate; real speculative decoding is the measure.
    """
    acc = torch.as_tensor(acc_per_pos, dtype=torch.float64).flatten().cpu()
    return float(1.0 + torch.cumprod(acc, 0).sum())
