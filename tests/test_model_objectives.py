"""Every train.loss objective against a naive, obviously-correct version: full [N, V]
logits, plain torch ops, autograd for the gradients; the chunked path never holds more
than one chunk of rows."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_train.model import dflash_loss, make_blocks, sample_anchors
from dflash_train.model.objectives import OBJECTIVES, Objective, capture_layer_ids, dpace_weights
from test_model_fakes import FakeTarget, batch, packed_row, tiny_drafter

H = 32  # FakeTarget hidden size; the drafter reads 2 layers = 64 channels, the teacher the next 32


def setup():
    t = FakeTarget(vocab_size=50, hidden_size=H, embed_scale=H**0.5, output_multiplier=0.7,
                   final_logit_softcapping=30.0)
    d = tiny_drafter(layer_types=("full_attention",), block_size=4, std=0.1)
    ids, lm, docs = batch([packed_row([18, 14], 40, seed=1), packed_row([40], 40, seed=2)])
    lm[0, 20:23] = False  # a hole inside some blocks: D-PACE must skip it
    g = torch.Generator().manual_seed(3)
    feats = torch.cat([torch.randn(2, 40, 2 * H, generator=g), 2.0 * torch.randn(2, 40, H, generator=g)], dim=-1)
    anchors = sample_anchors(lm, docs, 9, 4, torch.Generator().manual_seed(0))
    return t, d, ids, lm, docs, feats, anchors


def naive(obj: Objective, d, t, ids, lm, docs, feats, anchors, gamma=3.0):
    bs = d.cfg.block_size
    block_ids, labels, weights, sup = make_blocks(ids, lm, docs, *anchors, bs, d.cfg.mask_token_id, gamma)
    hid = d(t.embed(block_ids), *anchors, docs, features=feats[..., :2 * H], backend="sdpa")
    B, A = anchors[0].shape
    z = t.logits(hid.view(B, A, bs, -1)[:, :, 1:].reshape(-1, H))
    y = labels.reshape(-1)
    ce = F.cross_entropy(z, y, reduction="none")
    # teacher: the target's final state at position a+k-1 predicts token a+k; written as a loop
    rows = []
    for b in range(B):
        for a in range(A):
            for k in range(1, bs):
                rows.append(feats[b, min(int(anchors[0][b, a]) + k - 1, 39), 2 * H:])
    zt = t.logits(torch.stack(rows)).detach()
    logp, logp_t = F.log_softmax(z, -1), F.log_softmax(zt, -1)
    kl = (logp_t.exp() * (logp_t - logp)).sum(-1)
    alpha = torch.minimum(logp.exp(), logp_t.exp()).sum(-1)
    if obj.kind in ("ce_decay", "dpace"):
        term = ce
    elif obj.kind == "distill":
        term = kl
    elif obj.kind == "lk_alpha":
        term = -torch.log(alpha.clamp_min(1e-5))
    else:
        lam = torch.exp(-obj.lk_eta * alpha.detach())
        term = lam * kl + (1 - lam) * (1 - alpha)
    if obj.ce_weight:
        term = (1 - obj.ce_weight) * term + obj.ce_weight * ce
    w = weights.reshape(-1)
    if obj.kind == "dpace":  # the definition, one block at a time
        q = torch.exp(-ce.detach()).view(-1, bs - 1).tolist()
        s = sup.reshape(-1, bs - 1).tolist()
        ws = []
        for qb, sb in zip(q, s):
            smooth = [(1 - obj.dpace_alpha) * qk + obj.dpace_alpha if sk else 1.0 for qk, sk in zip(qb, sb)]
            prefix = [math.prod(smooth[:m + 1]) for m in range(bs - 1)]
            ws += [sum(prefix[m] for m in range(k, bs - 1) if sb[m]) if sb[k] else 0.0 for k in range(bs - 1)]
        w = torch.tensor(ws)
    return (term * w).sum() / w.sum()


CASES = [Objective("ce_decay"), Objective("dpace"), Objective("dpace", dpace_alpha=0.0), Objective("distill"),
         Objective("distill", ce_weight=0.3), Objective("lk_alpha"), Objective("lk_lambda"),
         Objective("lk_lambda", lk_eta=1.0, ce_weight=0.5)]


@pytest.mark.parametrize("obj", CASES, ids=lambda o: f"{o.kind}-c{o.ce_weight}-a{o.dpace_alpha}-e{o.lk_eta}")
def test_objective_matches_naive_with_gradients(obj):
    t, d, ids, lm, docs, feats, anchors = setup()
    d.zero_grad()
    want = naive(obj, d, t, ids, lm, docs, feats, anchors)
    (3.0 * want).backward()
    ref = {n: p.grad.clone() for n, p in d.named_parameters()}
    # one block per chunk, 5 rows per chunk (chunks cut through blocks), everything at once
    for chunk, cap in ((1, 1 << 25), (1000, 5 * 50 * (6 if obj.needs_teacher else 1)), (1000, 1 << 25)):
        d.zero_grad()
        out = dflash_loss(d, t, ids, lm, docs, feats if obj.needs_teacher else feats[..., :2 * H], 9, None,
                          gamma=3.0, chunk_blocks=chunk, anchors=anchors, max_chunk_logits=cap, objective=obj)
        (3.0 * out.loss).backward()
        torch.testing.assert_close(out.loss, want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.total / out.weight_sum, out.loss.detach(), atol=1e-7, rtol=1e-6)
        for n, p in d.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-4, msg=f"{obj} {n} chunk {chunk}")


def test_objectives_differ_from_each_other():
    """The comparisons above could pass with one formula for all: they must not agree."""
    t, d, ids, lm, docs, feats, anchors = setup()
    with torch.no_grad():
        vals = {k: float(dflash_loss(d, t, ids, lm, docs, feats if Objective(k).needs_teacher else feats[..., :2 * H],
                                     9, None, anchors=anchors, objective=Objective(k)).loss) for k in OBJECTIVES}
    assert len({round(v, 4) for v in vals.values()}) == len(OBJECTIVES), vals


def test_dpace_weights_hand_computed():
    q = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.9, 0.2]])
    sup = torch.tensor([[True, True, True], [True, True, True], [True, False, True]])
    w = dpace_weights(q, sup, 0.5)
    # q = 0: s = .5 -> prefix .5, .25, .125 -> suffix sums .875, .375, .125
    assert torch.allclose(w[0], torch.tensor([0.875, 0.375, 0.125]))
    assert torch.allclose(w[1], torch.tensor([3.0, 2.0, 1.0]))  # perfect drafter: k-th weighs bs-k
    # unsupervised middle: 1 in the product, 0 in the sum, 0 weight; s1 = .75, s3 = .6
    assert torch.allclose(w[2], torch.tensor([0.75 + 0.75 * 0.6, 0.0, 0.75 * 0.6]))


def test_teacher_objectives_never_materialise_all_logits(monkeypatch):
    import dflash_train.model.loss as L

    t, d, ids, lm, docs, feats, anchors = setup()
    seen = []
    real = L.chunk_terms
    monkeypatch.setattr(L, "chunk_terms", lambda h, *a: (seen.append(h.shape[0]), real(h, *a))[1])
    out = dflash_loss(d, t, ids, lm, docs, feats, 9, None, anchors=anchors, chunk_blocks=2,
                      objective=Objective("lk_lambda"))
    out.loss.backward()
    assert max(seen) == 2 * 3 and sum(seen) == 2 * 9 * 3  # 2 blocks at a time, each row once
    seen.clear()
    dflash_loss(d, t, ids, lm, docs, feats, 9, None, anchors=anchors, chunk_blocks=64, max_chunk_logits=6 * 50 * 4,
                objective=Objective("distill")).loss.backward()
    assert max(seen) == 4  # the element cap holds with the teacher's extra buffers counted


def test_teacher_objective_without_final_state_is_refused():
    t, d, ids, lm, docs, feats, anchors = setup()
    with pytest.raises(ValueError, match="final hidden state"):
        dflash_loss(d, t, ids, lm, docs, feats[..., :2 * H], 9, None, anchors=anchors, objective=Objective("distill"))


def test_capture_layer_ids():
    assert capture_layer_ids([1, 5], 8, Objective("ce_decay")) == [1, 5]
    assert capture_layer_ids([1, 5], 8, Objective("dpace")) == [1, 5]
    assert capture_layer_ids([1, 5], 8, Objective("lk_alpha")) == [1, 5, 8]
