"""Drafter config, state_dict names, init, and training forward == block-by-block cached inference."""
from __future__ import annotations


import pytest
import torch

from dflash_train.config import ModelConfig
from dflash_train.model import DFlashDrafter, DrafterConfig, default_target_layer_ids
from test_model_fakes import FakeTarget, batch, packed_row, tiny_config, tiny_drafter


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(18, 1) == [9]
    assert default_target_layer_ids(36, 1) == [18]
    from dflash.model import build_target_layer_ids

    for L in (8, 18, 28, 36, 64):
        for N in (1, 2, 3, 5, 8):
            assert default_target_layer_ids(L, N) == build_target_layer_ids(L, N)


def test_from_target_defaults_and_overrides():
    t = FakeTarget(vocab_size=50, hidden_size=32, num_layers=18, embed_scale=32**0.5,
                   output_multiplier=0.5, final_logit_softcapping=30.0, mask_token_id=7)
    cfg = DrafterConfig.from_target(ModelConfig(num_layers=2), t)
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (32, 4, 2, 8, 64)
    assert cfg.layer_types == ["full_attention"] * 2
    assert cfg.target_layer_ids == default_target_layer_ids(18, 2)
    assert cfg.num_target_layers == 18 and cfg.vocab_size == 50 and cfg.mask_token_id == 7
    assert cfg.input_embedding_scale == pytest.approx(32**0.5)
    assert cfg.output_multiplier == 0.5 and cfg.final_logit_softcapping == 30.0
    mc = ModelConfig(num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=40, block_size=8,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                     target_layer_ids=[0, 3, 4], mask_token_id=3)
    cfg = DrafterConfig.from_target(mc, t)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (2, 1, 16, 40)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 5
    assert cfg.target_layer_ids == [0, 3, 4] and cfg.mask_token_id == 3 and cfg.block_size == 8
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ValueError):
        DrafterConfig.from_target(ModelConfig(num_layers=1, target_layer_ids=[18]), t)


def test_state_dict_names_are_export_names():
    d = DFlashDrafter(tiny_config(layer_types=("full_attention", "sliding_attention"), sliding_window=3))
    names = set(d.state_dict())
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected
    assert d.state_dict()["fc.weight"].shape == (32, 2 * 32)
    assert "rotary.inv_freq" in dict(d.named_buffers())  # present, but not persistent


def test_init_is_deterministic():
    a = DFlashDrafter(tiny_config(init_std=0.02), seed=3)
    b = DFlashDrafter(tiny_config(init_std=0.02), seed=3)
    c = DFlashDrafter(tiny_config(init_std=0.02), seed=4)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.fc.weight, c.fc.weight)
    assert a.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a.norm.weight, torch.ones(32))


@pytest.mark.parametrize("layer_types,W", [(("full_attention",), None),
                                           (("sliding_attention", "full_attention"), 3)])
def test_training_forward_equals_cached_inference(layer_types, W):
    """Many anchors in one training forward == one draft_block per anchor on a context cache.

    Each anchor's inference context is its own document's positions < anchor (a document
    starting at s is replayed as a fresh sequence: RoPE is relative, so the shift is exact
    up to rounding). Anchors are closer than bs, at document ends, and include padding.
    """
    bs = 4
    d = tiny_drafter(layer_types=layer_types, sliding_window=W, block_size=bs).eval()
    T = 30
    ids, lm, docs = batch([packed_row([13, 10], T, seed=1), packed_row([30], T, seed=2)])
    anchors = torch.tensor([[0, 3, 4, 12, 13, 20, 22], [1, 2, 9, 17, 25, 28, 0]])
    valid = torch.tensor([[True] * 7, [True] * 6 + [False]])
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, T, 64, generator=g)
    emb = torch.randn(2, anchors.shape[1] * bs, 32, generator=g)
    with torch.no_grad():
        out = d(emb, anchors, valid, docs, features=feats, backend="sdpa")
    assert torch.isfinite(out).all()
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            if not valid[b, i]:
                continue
            s = int((docs[b] == docs[b, a]).nonzero()[0])  # start of the anchor's document
            cache = d.new_cache()
            if a - s > 5:  # exercise incremental extension too
                d.extend_context(cache, feats[b:b + 1, s:s + 5], 0)
                d.extend_context(cache, feats[b:b + 1, s + 5:a], 5)
            else:
                d.extend_context(cache, feats[b:b + 1, s:a], 0)
            hid = d.draft_block(cache, emb[b:b + 1, i * bs:(i + 1) * bs], a - s)
            torch.testing.assert_close(hid[0], out[b, i * bs:(i + 1) * bs], atol=2e-5, rtol=1e-5)


def test_cache_crop_and_reextend():
    d = tiny_drafter(layer_types=("sliding_attention",), sliding_window=5).eval()
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 20, 64, generator=g)
    emb = torch.randn(1, 4, 32, generator=g)
    full = d.new_cache()
    d.extend_context(full, feats[:, :12], 0)
    ref = d.draft_block(full, emb, 12)
    # a longer cache, cropped back; and extend from an earlier position (implicit crop)
    c = d.new_cache()
    d.extend_context(c, torch.randn(1, 16, 64, generator=g), 0)
    d.extend_context(c, feats[:, :12], 0)
    assert c.length == 12
    torch.testing.assert_close(d.draft_block(c, emb, 12), ref, atol=0, rtol=0)
    d.extend_context(c, feats[:, 12:18], 12)
    c.crop(12)
    torch.testing.assert_close(d.draft_block(c, emb, 12), ref, atol=1e-6, rtol=1e-6)
    # anchor below the cache length: only positions < anchor are seen
    d.extend_context(c, feats[:, 12:18], 12)
    c8 = d.new_cache()
    d.extend_context(c8, feats[:, :8], 0)
    torch.testing.assert_close(d.draft_block(c, emb, 8), d.draft_block(c8, emb, 8), atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        d.draft_block(c8, emb, 9)
    with pytest.raises(ValueError):
        d.extend_context(c8, feats[:, :2], 10)
    # empty context (anchor 0) is fine
    assert torch.isfinite(d.draft_block(d.new_cache(), emb, 0)).all()
