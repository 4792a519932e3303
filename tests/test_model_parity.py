"""Numerical parity with the reference implementation (PyPI dflash 0.1.0, dflash.model.DFlashDraftModel)."""
from __future__ import annotations

import pytest
import torch

from dflash_train.model import DFlashDrafter, DrafterConfig

H, K, BS, CTX = 32, 2, 4, 9


def reference_model(layer_types, sliding_window, seed=0):
    from transformers import Qwen3Config
    from dflash.model import DFlashDraftModel

    cfg = Qwen3Config(
        vocab_size=50, hidden_size=H, intermediate_size=64, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=256,
        use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
        layer_types=list(layer_types), num_target_layers=8,
        dflash_config={"target_layer_ids": [1, 5], "block_size": BS, "mask_token_id": 49},
    )
    cfg.block_size = BS
    ref = DFlashDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random everywhere, norms away from 1, so any mismatch shows
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return ref


def ours_from(ref, layer_types, sliding_window) -> DFlashDrafter:
    cfg = DrafterConfig(
        hidden_size=H, num_layers=len(layer_types), num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
        layer_types=list(layer_types), sliding_window=sliding_window, block_size=BS, mask_token_id=49,
        target_layer_ids=[1, 5], num_target_layers=8, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50,
    )
    ours = DFlashDrafter(cfg).eval()
    sd = {k: v for k, v in ref.state_dict().items() if not k.startswith("rotary_emb.")}
    ours.load_state_dict(sd, strict=True)
    return ours


CASES = [(("full_attention",), None), (("sliding_attention",), 3), (("sliding_attention",), 6),
         (("full_attention", "sliding_attention"), 5)]


@pytest.mark.parametrize("layer_types,W", CASES)
def test_one_block_with_context_matches_reference(layer_types, W):
    ref = reference_model(layer_types, W)
    assert all(l.self_attn.is_causal == (lt == "sliding_attention") for l, lt in zip(ref.layers, layer_types))
    ours = ours_from(ref, layer_types, W)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, CTX + BS, K * H, generator=g)
    noise = torch.randn(1, BS, H, generator=g)
    with torch.no_grad():
        # as dflash_generate: context 0..CTX-1, block at CTX..CTX+BS-1
        want = ref(position_ids=torch.arange(CTX + BS)[None], noise_embedding=noise, target_hidden=feats[:, :CTX])
        cache = ours.new_cache()
        ours.extend_context(cache, feats[:, :CTX], 0)
        got_inf = ours.draft_block(cache, noise, CTX)
        # training layout: the same block as anchor CTX of a row of length CTX+BS (later context masked)
        got_train = ours(noise, torch.tensor([[CTX]]), torch.tensor([[True]]), torch.zeros(1, CTX + BS, dtype=torch.long),
                         features=feats, backend="sdpa")
    torch.testing.assert_close(got_inf, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_train, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer_types,W", [CASES[0], CASES[3]])
def test_cached_steps_match_reference(layer_types, W):
    """Two decode steps with the reference's own DynamicCache protocol (crop to start after each draft)."""
    from dflash.model import _crop_to, _make_cache

    ref = reference_model(layer_types, W, seed=2)
    ours = ours_from(ref, layer_types, W)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 20, K * H, generator=g)
    pos = torch.arange(40)[None]
    ref_cache, cache = _make_cache(ref.config), ours.new_cache()
    start, hidden_start = CTX, 0
    with torch.no_grad():
        for produced in (3, 2):
            noise = torch.randn(1, BS, H, generator=g)
            th = feats[:, hidden_start:start]
            want = ref(position_ids=pos[:, start - th.shape[1]:start + BS], noise_embedding=noise,
                       target_hidden=th, past_key_values=ref_cache, use_cache=True)
            _crop_to(ref_cache, start)
            ours.extend_context(cache, th, hidden_start)
            got = ours.draft_block(cache, noise, start)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            hidden_start, start = start, start + produced


@pytest.mark.parametrize("layer_types,W", [CASES[0], CASES[3]])
def test_export_config_builds_the_reference(layer_types, W):
    """ours -> hf_config_dict -> Qwen3Config -> reference model with our state_dict == our outputs."""
    from transformers import Qwen3Config
    from dflash.model import DFlashDraftModel

    ref0 = reference_model(layer_types, W, seed=4)
    ours = ours_from(ref0, layer_types, W)
    from dflash_train.model.hf_config import drafter_config_from_hf, hf_config_dict

    d = hf_config_dict(ours.cfg)  # the one definition of the exported config
    assert drafter_config_from_hf(d) == ours.cfg  # and its one reader (checkpoint.source.load_export's)
    ref = DFlashDraftModel(Qwen3Config(**d)).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("rotary_emb.") for k in missing)
    assert ref.target_layer_ids == [1, 5] and ref.block_size == BS and ref.mask_token_id == 49
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, CTX, K * H, generator=g)
    noise = torch.randn(1, BS, H, generator=g)
    with torch.no_grad():
        want = ref(position_ids=torch.arange(CTX + BS)[None], noise_embedding=noise, target_hidden=feats)
        cache = ours.new_cache()
        ours.extend_context(cache, feats, 0)
        torch.testing.assert_close(ours.draft_block(cache, noise, CTX), want, atol=1e-5, rtol=1e-5)
