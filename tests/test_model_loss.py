"""Anchors, labels/weights, the chunked loss and its gradients."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dflash_train.model import (
    default_gamma,
    dflash_loss,
    expected_acceptance_length,
    make_blocks,
    sample_anchors,
)
from test_model_fakes import FakeTarget, batch, packed_row, tiny_drafter


# --------------------------------------------------------------------------- anchors


def test_sample_anchors_valid_sorted_reproducible():
    ids, lm, docs = batch([packed_row([20, 15, 9], 50, seed=s) for s in range(3)])
    lm[2] = False
    lm[2, 10:13] = True  # only anchors 10 and 11 are valid in row 2
    g = torch.Generator().manual_seed(7)
    anchors, valid = sample_anchors(lm, docs, 8, 4, g)
    assert anchors.shape == valid.shape == (3, 8) and anchors.dtype == torch.long
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:] & (docs[:, :-1] == docs[:, 1:]) & (docs[:, :-1] >= 0)
    for b in range(3):
        a = anchors[b][valid[b]]
        n_ok = int(ok[b].sum())
        assert len(a) == min(8, n_ok)
        assert ok[b, a].all()
        assert torch.all(a[1:] > a[:-1])  # ascending, distinct
        assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)  # padding last
        assert (anchors[b][~valid[b]] == 0).all()
    assert anchors[2][valid[2]].tolist() == [10, 11]
    # the generator alone drives it: same state -> same anchors; resumable from a saved state
    state = torch.Generator().manual_seed(7).get_state()
    g2 = torch.Generator()
    g2.set_state(state)
    a2, v2 = sample_anchors(lm, docs, 8, 4, g2)
    assert torch.equal(a2, anchors) and torch.equal(v2, valid)
    a3, _ = sample_anchors(lm, docs, 8, 4, g2)  # next step: resampled
    assert not torch.equal(a3, anchors)
    # more anchors than positions: padded, no error
    a4, v4 = sample_anchors(lm[:, :6], docs[:, :6], 10, 4, torch.Generator().manual_seed(0))
    assert a4.shape == (3, 10) and int(v4.sum()) <= 15


def test_sample_anchors_uniform():
    lm = torch.zeros(1, 20, dtype=torch.bool)
    lm[0, 5:16] = True  # valid anchors 5..14 (10 of them)
    docs = torch.zeros(1, 20, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(20)
    n = 3000
    for _ in range(n):
        a, v = sample_anchors(lm, docs, 3, 4, g)
        counts[a[v]] += 1
    freq = counts / n
    assert (freq[:5] == 0).all() and (freq[15:] == 0).all()
    assert torch.allclose(freq[5:15], torch.full((10,), 0.3), atol=0.04)


# --------------------------------------------------------------------------- labels and weights


def hand_case():
    # T=12: document 0 = positions 0..6, document 1 = 7..10, padding at 11
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 0]])
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1]])
    anchors = torch.tensor([[2, 3, 8, 0]])
    valid = torch.tensor([[True, True, True, False]])
    return ids, lm, docs, anchors, valid


def expected_hand(gamma):
    e = [math.exp(-(k - 1) / gamma) for k in (1, 2, 3)]
    labels = [[13, 14, 15], [14, 15, 16], [19, 20, 0], [11, 12, 13]]
    # anchor 2: 3,4 supervised, 5 not (loss_mask 0)
    # anchor 3: 4 yes, 5 no, 6 yes          anchor 8: 9, 10 yes, 11 padding (other doc)
    # anchor 0 is padding: nothing
    sup = [[1, 1, 0], [1, 0, 1], [1, 1, 0], [0, 0, 0]]
    weights = [[s * e[j] for j, s in enumerate(row)] for row in sup]
    return torch.tensor([labels]), torch.tensor([weights]), torch.tensor([sup], dtype=torch.bool)


def labels_match(labels, weights, gamma):
    want_l, want_w, sup = expected_hand(gamma)
    return bool(torch.equal(labels[sup], want_l[sup]) and torch.allclose(weights, want_w))


def test_labels_and_weights_hand_computed():
    ids, lm, docs, anchors, valid = hand_case()
    block_ids, labels, weights, sup = make_blocks(ids, lm, docs, anchors, valid, 4, 99, 2.0)
    assert block_ids.tolist() == [[12, 99, 99, 99, 13, 99, 99, 99, 18, 99, 99, 99, 10, 99, 99, 99]]
    assert labels_match(labels, weights, 2.0)
    assert torch.equal(sup, expected_hand(2.0)[2])
    # the classic bug, next-position labels (a+k+1), must fail the same check
    shifted = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
    _, bad_labels, bad_w, _ = make_blocks(shifted, lm, docs, anchors, valid, 4, 99, 2.0)
    assert not labels_match(bad_labels, bad_w, 2.0)


def test_default_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(2) == 1.0 and default_gamma(4) == 2.0
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)


def test_expected_acceptance_length():
    assert expected_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert expected_acceptance_length(torch.tensor([0.5, 0.5])) == pytest.approx(1.75)
    assert expected_acceptance_length([0.0, 1.0]) == 1.0


class Oracle(torch.nn.Module):
    """A 'drafter' that outputs one-hot(token at position a+k+shift): with same-position labels,
    shift 0 gets every supervised position right, shift 1 (the bug) gets ~nothing right."""

    def __init__(self, input_ids, vocab, shift, bs):
        super().__init__()
        self.ids, self.V, self.shift = input_ids, vocab, shift
        self.cfg = SimpleNamespace(block_size=bs, mask_token_id=vocab - 1, block_seeds="none")
        self.fc = torch.nn.Linear(1, 1)  # dtype probe
        self.scale = torch.nn.Parameter(torch.tensor(20.0))

    def forward(self, block_embeds, anchors, valid, docs, features=None, backend=None):
        B, A = anchors.shape
        bs = self.cfg.block_size
        pos = (anchors[:, :, None] + torch.arange(bs) + self.shift).clamp(max=self.ids.shape[1] - 1)
        tok = torch.gather(self.ids, 1, pos.view(B, -1))
        return F.one_hot(tok, self.V).float() * self.scale


@pytest.mark.parametrize("shift,expect_right", [(0, True), (1, False)])
def test_loss_uses_same_position_labels_end_to_end(shift, expect_right):
    V = 40
    t = FakeTarget(vocab_size=V, hidden_size=V)
    t.head.data = torch.eye(V)  # logits = hidden
    ids, lm, docs = batch([packed_row([30, 20], 50, seed=s, vocab=V) for s in range(2)])
    oracle = Oracle(ids, V, shift, 8)
    out = dflash_loss(oracle, t, ids, lm, docs, torch.zeros(2, 50, 1), num_anchors=12,
                      generator=torch.Generator().manual_seed(0))
    acc = out.correct.sum().item() / out.count.sum().item()
    if expect_right:
        assert torch.equal(out.correct, out.count) and out.loss.item() < 1e-6
    else:
        assert acc < 0.3 and out.loss.item() > 1.0


# --------------------------------------------------------------------------- loss, chunks, gradients


def setup_loss(softcap=30.0, mult=0.7, trainable_target=False, layer_types=("full_attention", "sliding_attention")):
    t = FakeTarget(vocab_size=50, hidden_size=32, embed_scale=32**0.5, output_multiplier=mult,
                   final_logit_softcapping=softcap, trainable=trainable_target)
    d = tiny_drafter(layer_types=layer_types, sliding_window=3, block_size=4, std=0.1)
    ids, lm, docs = batch([packed_row([18, 14], 40, seed=1), packed_row([40], 40, seed=2)])
    feats = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(3))
    return t, d, ids, lm, docs, feats


def naive_loss(d, t, ids, lm, docs, feats, anchors, gamma, subset=None):
    """Everything at once, straight from the definition: full logits, plain CE."""
    bs = d.cfg.block_size
    block_ids, labels, weights, _ = make_blocks(ids, lm, docs, *anchors, bs, d.cfg.mask_token_id, gamma)
    hid = d(t.embed(block_ids), *anchors, docs, features=feats, backend="sdpa")
    B, A = anchors[0].shape
    h = hid.view(B, A, bs, -1)[:, :, 1:].reshape(-1, hid.shape[-1])
    logits = t.logits(h)
    lab, w = labels.reshape(-1), weights.reshape(-1)
    if subset is not None:
        inside = torch.isin(lab, subset)
        logits = logits[:, subset]
        lab = torch.searchsorted(subset, lab).clamp(max=len(subset) - 1)
        w = w * inside
    ce = F.cross_entropy(logits, lab, reduction="none")
    return (ce * w).sum() / w.sum()


def grads(d):
    return {n: p.grad.clone() for n, p in d.named_parameters()}


def test_chunked_equals_unchunked_and_naive():
    t, d, ids, lm, docs, feats = setup_loss()
    anchors = sample_anchors(lm, docs, 9, 4, torch.Generator().manual_seed(0))
    results = []
    # chunks of 1, 2, all blocks, and 7 rows (element cap; chunks cross block boundaries)
    for chunk, cap in ((1, 1 << 25), (2, 1 << 25), (1000, 1 << 25), (1000, 7 * 50)):
        d.zero_grad()
        out = dflash_loss(d, t, ids, lm, docs, feats, 9, None, gamma=3.0, chunk_blocks=chunk, anchors=anchors,
                          max_chunk_logits=cap)
        (2.0 * out.loss).backward()  # a scaled upstream gradient must pass through
        results.append((out, grads(d)))
    d.zero_grad()
    ref = naive_loss(d, t, ids, lm, docs, feats, anchors, 3.0)
    (2.0 * ref).backward()
    ref_g = grads(d)
    for out, g in results:
        torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)
        for n in g:
            torch.testing.assert_close(g[n], ref_g[n], atol=1e-6, rtol=1e-5)
    assert torch.equal(results[0][0].correct, results[2][0].correct)
    assert results[0][0].count.shape == (3,) and results[0][0].num_blocks.item() == int(anchors[1].sum())


def test_vocab_subset():
    t, d, ids, lm, docs, feats = setup_loss()
    anchors = sample_anchors(lm, docs, 9, 4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = dflash_loss(d, t, ids, lm, docs, feats, 9, None, anchors=anchors)
        all_ids = dflash_loss(d, t, ids, lm, docs, feats, 9, None, anchors=anchors, vocab_subset=torch.arange(50))
        torch.testing.assert_close(all_ids.loss, full.loss, atol=1e-6, rtol=1e-6)
        assert torch.equal(all_ids.correct, full.correct) and torch.equal(all_ids.count, full.count)
        subset = torch.arange(0, 50, 2)
        part = dflash_loss(d, t, ids, lm, docs, feats, 9, None, anchors=anchors, vocab_subset=subset, chunk_blocks=2)
        want = naive_loss(d, t, ids, lm, docs, feats, anchors, default_gamma(4), subset=subset)
        torch.testing.assert_close(part.loss, want, atol=1e-6, rtol=1e-6)
        assert torch.equal(part.count, full.count)  # out-of-subset labels still count (as misses)
        assert part.weight_sum < full.weight_sum


def test_gradients_reach_every_drafter_param_and_not_the_target():
    t, d, ids, lm, docs, feats = setup_loss(trainable_target=True)
    docs = docs.to(torch.int32)  # the packed-row dtype of data/
    out = dflash_loss(d, t, ids, lm, docs, feats, 9, torch.Generator().manual_seed(0), chunk_blocks=2)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
    assert t.embedding.weight.grad is None and t.head.grad is None


def test_padding_only_batch_is_finite():
    t, d, ids, lm, docs, feats = setup_loss()
    lm[:] = False
    out = dflash_loss(d, t, ids, lm, docs, feats, 4, torch.Generator().manual_seed(0))
    assert out.loss.item() == 0.0 and out.num_blocks.item() == 0 and out.count.sum().item() == 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters())


def test_logits_never_materialised_at_once(monkeypatch):
    """The lm_head only ever sees one chunk of rows: peak memory follows the chunk, not anchors x bs x vocab."""
    import dflash_train.model.loss as L

    t, d, ids, lm, docs, feats = setup_loss()
    seen = []
    real = L.chunk_terms
    monkeypatch.setattr(L, "chunk_terms", lambda h, *a: (seen.append(h.shape[0]), real(h, *a))[1])
    out = dflash_loss(d, t, ids, lm, docs, feats, 9, torch.Generator().manual_seed(0), chunk_blocks=2)
    out.loss.backward()
    n = 2 * 9 * 3
    assert max(seen) == 2 * 3 and sum(seen) == n  # one pass over every row, 2 blocks at a time, no recompute


def test_bfloat16_step_runs_close_to_fp32():
    t, d, ids, lm, docs, feats = setup_loss()
    anchors = sample_anchors(lm, docs, 6, 4, torch.Generator().manual_seed(0))
    ref = dflash_loss(d, t, ids, lm, docs, feats, 6, None, anchors=anchors).loss.item()
    d = d.to(torch.bfloat16)
    out = dflash_loss(d, t, ids, lm, docs, feats, 6, None, anchors=anchors, chunk_blocks=2)
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and abs(out.loss.item() - ref) < 0.05 * abs(ref)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all()
               for p in d.parameters())


def test_wrapped_drafter_and_autocast():
    """The trainer passes the drafter wrapped (DDP: .module) and runs under bf16 autocast."""

    class Wrapper(torch.nn.Module):  # stands in for DistributedDataParallel
        def __init__(self, m):
            super().__init__()
            self.module = m

        def forward(self, *a, **k):
            return self.module(*a, **k)

    t, d, ids, lm, docs, feats = setup_loss()
    anchors = sample_anchors(lm, docs, 6, 4, torch.Generator().manual_seed(0))
    ref = dflash_loss(d, t, ids, lm, docs, feats, 6, None, anchors=anchors).loss
    out = dflash_loss(Wrapper(d), t, ids, lm, docs, feats, 6, None, anchors=anchors).loss
    assert torch.equal(out, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dflash_loss(Wrapper(d), t, ids, lm, docs, feats, 6, None, anchors=anchors)
        with torch.no_grad():  # flex (eager, forward only on CPU) under autocast too
            flex = dflash_loss(d, t, ids, lm, docs, feats, 6, None, anchors=anchors, backend="flex")
    out.loss.backward()
    assert abs(out.loss.item() - ref.item()) < 0.05 * ref.item()
    assert abs(flex.loss.item() - ref.item()) < 0.05 * ref.item()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters())
