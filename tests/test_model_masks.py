"""The one DFlash mask: element-by-element against a brute-force python reference, and flex == SDPA."""
from __future__ import annotations

import pytest
import torch

from dflash_train.model import build_masks, dense_mask, dflash_mask_mod, document_ids_from_lengths
from test_model_fakes import tiny_drafter


def ref_visible(anchors, valid, docs, bs, layer_type, W, T, b, q, kv) -> bool:
    """The rule of docs/dflash-method.md, written as plainly as possible."""
    i, k = divmod(q, bs)
    a = anchors[b][i]
    if kv < T:  # context key at position t = kv
        t = kv
        if not valid[b][i]:
            return False
        if not (t < a and docs[b][t] == docs[b][a] and docs[b][t] >= 0):
            return False
        if layer_type == "sliding_attention" and not t >= a + k - (W - 1):
            return False
        return True
    i2, k2 = divmod(kv - T, bs)  # block key
    if i2 != i:
        return False
    if not valid[b][i]:
        return k2 == k  # padding: itself only
    if layer_type == "sliding_attention":
        return k2 <= k and k - k2 < W
    return True


def random_case(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, A, bs = 3, 40, 7, 4
    docs, anchors, valid = [], [], []
    for b in range(B):
        lengths = [int(x) for x in torch.randint(3, 15, (4,), generator=g)]
        d = document_ids_from_lengths(torch.tensor(lengths), max(T, sum(lengths)))[:T]
        docs.append(d)
        ends = torch.cumsum(torch.tensor(lengths), 0) - 1
        ends = ends[ends < T - 1]
        # anchors: some random, some adjacent (closer than bs), some at document ends
        a = torch.randint(0, T - 1, (A,), generator=g)
        a[1] = (a[0] + 1).clamp(max=T - 2)
        a[2] = (a[0] + 2).clamp(max=T - 2)
        if len(ends):
            a[3] = ends[0]
            a[4] = ends[-1]
        anchors.append(a)
        v = torch.rand(A, generator=g) < 0.8
        if b == 2:
            v[:] = False  # a padding-only row
        valid.append(v)
    return torch.stack(anchors), torch.stack(valid), torch.stack(docs), bs


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layer_type,W", [("full_attention", None), ("sliding_attention", 1),
                                          ("sliding_attention", 3), ("sliding_attention", 9),
                                          ("sliding_attention", 100)])
def test_mask_matches_bruteforce(seed, layer_type, W):
    anchors, valid, docs, bs = random_case(seed)
    B, A = anchors.shape
    T = docs.shape[1]
    mask = dense_mask(dflash_mask_mod(anchors, valid, docs, bs, layer_type, W), B, A * bs, T + A * bs)
    assert mask.shape == (B, 1, A * bs, T + A * bs)
    al, vl, dl = anchors.tolist(), valid.tolist(), docs.tolist()
    ref = torch.tensor([[[ref_visible(al, vl, dl, bs, layer_type, W, T, b, q, kv) for kv in range(T + A * bs)]
                         for q in range(A * bs)] for b in range(B)])
    assert torch.equal(mask[:, 0], ref)
    # every query row sees at least itself: no NaN from SDPA on fully masked rows
    assert mask.any(-1).all()


def test_mask_matches_reference_attention_mask():
    """One block, one document, context 0..a-1: the reference `_attention_mask` visibility."""
    from dflash.model import _attention_mask

    bs, a = 6, 11
    q = torch.zeros(1, 1, bs, 2)
    k = torch.zeros(1, 1, a + bs, 2)
    for lt, W in [("full_attention", None), ("sliding_attention", 4), ("sliding_attention", 2)]:
        mod = dflash_mask_mod(torch.tensor([[a]]), torch.tensor([[True]]), torch.zeros(1, a, dtype=torch.long),
                              bs, lt, W)
        ours = dense_mask(mod, 1, bs, a + bs)
        causal = lt == "sliding_attention"
        ref = _attention_mask(q, k, is_causal=causal, sliding_window=W)
        assert torch.equal(ours, ref.expand_as(ours)), lt


def test_document_ids_from_lengths():
    d = document_ids_from_lengths(torch.tensor([2, 3, 1]), 8)
    assert d.tolist() == [0, 0, 1, 1, 1, 2, -1, -1]
    assert document_ids_from_lengths(torch.tensor([2, 1])).tolist() == [0, 0, 1]
    with pytest.raises(ValueError):
        document_ids_from_lengths(torch.tensor([5, 5]), 8)


def test_masks_shared_per_layer_type():
    anchors, valid, docs, bs = random_case(0)
    m = build_masks(["sliding_attention", "full_attention", "sliding_attention"], anchors, valid, docs, bs, 3, "sdpa")
    assert set(m) == {"sliding_attention", "full_attention"}


def test_flex_forward_matches_sdpa():
    """Eager flex_attention on CPU (forward only) with the BlockMask of the same mask_mod == dense SDPA."""
    torch.manual_seed(0)
    d = tiny_drafter(layer_types=("full_attention", "sliding_attention"), sliding_window=3, block_size=4).eval()
    anchors, valid, docs, bs = random_case(3)
    B, A = anchors.shape
    T = docs.shape[1]
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(B, T, 2 * 32, generator=g)
    emb = torch.randn(B, A * bs, 32, generator=g)
    with torch.no_grad():
        out_sdpa = d(emb, anchors, valid, docs, features=feats, backend="sdpa")
        out_flex = d(emb, anchors, valid, docs, features=feats, backend="flex")
    assert torch.isfinite(out_sdpa).all()
    # padding blocks included: they see only themselves under both backends
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)
