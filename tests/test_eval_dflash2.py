"""Speculative decoding with a DFlash 2 drafter: it drafts with its candidate selector; greedy output
equals plain greedy; sampling is lossless; the reference `dflash_generate` with our export reproduces
our outputs and acceptance lengths (greedy, and sampled with the same random draws)."""
from __future__ import annotations

import time

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.specdec import plain_generate, sampling_probs, speculative_generate
from dflash_train.export import write_export
from dflash_train.model import DrafterConfig
from dflash_train.model.dflash2 import build_drafter
from dflash_train.targets import load_target
from specdec_fakes import bias_target_towards, slot_prediction

# the reference package is installed by `make test` (Makefile): a broken install fails here, never skips
import dflash  # noqa: E402
import dflash.model as dm  # noqa: E402

PROMPTS = ["Hello! How can I help", "The quick brown fox", "Write a short poem about the sea."]


@pytest.fixture(autouse=True)
def _cpu_timing(monkeypatch):
    monkeypatch.setattr(dm, "_cuda_time", time.perf_counter)  # the reference times with cuda.synchronize()


def _setup(tiny_target_factory, family="qwen3", block_size=8, selector_scale=0.7):
    t = load_target(TargetConfig(path=str(tiny_target_factory(family)), device="cpu", dtype="float32"))
    bias_target_towards(t, 100, alpha=5.0, anti=1.0)  # token 100 frequent; a mask whose slots predict it
    mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == 100)
    extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5) if family == "gemma3" else {}
    mc = ModelConfig(num_layers=2, block_size=block_size, mask_token_id=mask, architecture="dflash2",
                     selector_rank=8, selector_top_k=6, conv_group_size=16, **extra)
    dr = build_drafter(DrafterConfig.from_target(mc, t), seed=1).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # convolutions off the identity, a selector whose pair term matters
        for name, p in dr.named_parameters():
            if "_conv." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            elif name.startswith("candidate_selector."):
                p.copy_(selector_scale * torch.randn(p.shape, generator=g))
    return t, dr


def _spy_selector(dr):
    """Record, per draft step, whether the selected path differs from the unary argmax."""
    sel = dr.candidate_selector
    orig = sel.select
    differs = []

    def spy(hidden, logits, anchor_ids, temperature, generator=None):
        out = orig(hidden, logits, anchor_ids, temperature, generator)
        differs.append(bool((out[0] != logits.argmax(-1)).any()))
        return out

    sel.select = spy
    return differs


# selector scale: qwen3 0.7 -> the selector re-ranks the drafts of ~60 % of the steps and blocks are still
# accepted up to 8 tokens; the Gemma-family target (sliding layer, scaled embeddings) at 0.6 (above that
# its selector overrides every step and nothing is accepted)
@pytest.mark.parametrize("family,scale", [("qwen3", 0.7), ("gemma3", 0.6)])
def test_greedy_equals_plain_and_the_reference_reproduces_it(tmp_path, tiny_target_factory, family, scale):
    t, dr = _setup(tiny_target_factory, family, selector_scale=scale)
    out = write_export(dr.cfg, dr.state_dict(), tmp_path / "export")
    ref = dflash.DFlash2DraftModel.from_pretrained(str(out)).eval()
    differs = _spy_selector(dr)
    eos = [t.tokenizer.eos_token_id]
    all_acc = []
    for text in PROMPTS:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        ours, acc = speculative_generate(dr, t, x, 24, eos)
        r = dm.dflash_generate(ref, t.model, x, 24, eos, return_stats=True)
        assert torch.equal(ours, r.output_ids), text
        assert acc == r.acceptance_lengths, text
        assert torch.equal(ours, plain_generate(t, x, 24, eos)), text
        all_acc += acc
    assert max(all_acc) > 2, all_acc  # drafts were accepted
    if family == "qwen3":
        assert any(differs) and not all(differs), differs  # the selector changed some drafts, not all


def test_sampled_reference_reproduces_ours_with_the_same_draws(tmp_path, tiny_target_factory):
    t, dr = _setup(tiny_target_factory, "qwen3")
    out = write_export(dr.cfg, dr.state_dict(), tmp_path / "export")
    ref = dflash.DFlash2DraftModel.from_pretrained(str(out)).eval()
    x = t.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    all_acc = []
    for seed in range(3):
        torch.manual_seed(seed)
        ours, acc = speculative_generate(dr, t, x, 20, [], temperature=0.8)  # global RNG, as the reference
        torch.manual_seed(seed)
        r = dm.dflash_generate(ref, t.model, x, 20, [], temperature=0.8, return_stats=True)
        assert torch.equal(ours, r.output_ids) and acc == r.acceptance_lengths, seed
        all_acc += acc
    assert max(all_acc) > 1, all_acc


def test_sampling_is_lossless_with_the_selector(tiny_target_factory):
    """T=1: the 2nd generated token (decided by the first verify step: accepted draft, residual
    or bonus, against the selector's q rows) is distributed as the target's exact marginal."""
    t, dr = _setup(tiny_target_factory, "qwen3", block_size=4)
    x = t.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    n = x.shape[1]
    T = 1.0
    with torch.inference_mode():
        p1 = sampling_probs(t.model(x).logits[0, -1], T)
        V = p1.shape[0]
        batch = torch.cat([x.expand(V, n), torch.arange(V)[:, None]], dim=1)
        p2_given = torch.cat([sampling_probs(t.model(batch[i:i + 128]).logits[:, -1], T) for i in range(0, V, 128)])
    exact2 = (p1[:, None] * p2_given).sum(0)
    N = 400
    gen = torch.Generator().manual_seed(0)
    second, accepted_any = [], 0
    for _ in range(N):
        out, acc = speculative_generate(dr, t, x, 3, [], temperature=T, generator=gen)
        second.append(int(out[0, n + 1]))
        accepted_any += acc[0] > 1
    emp = torch.bincount(torch.tensor(second), minlength=V).float() / N
    top = exact2.topk(4).indices
    cells_e = torch.cat([exact2[top], (1 - exact2[top].sum())[None]])
    cells_o = torch.cat([emp[top], (1 - emp[top].sum())[None]])
    assert cells_e[0] > 0.1
    assert (cells_o - cells_e).abs().max() < 0.08, (cells_o, cells_e)  # > 3 sigma at N=400
    assert 0 < accepted_any < N


def test_replay_walks_the_selector_path_as_decoding_does(tiny_target_factory):
    """Replay (training forward at every anchor; what `dflash-train compare` measures) gives the acceptance
    lengths of real speculative decoding for a DFlash 2 drafter whose selector re-ranks drafts."""
    from dflash_train.eval.replay import replay_acceptance

    t, dr = _setup(tiny_target_factory, "qwen3", selector_scale=0.7)
    differs = _spy_selector(dr)
    for text in PROMPTS[:2]:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        out, acc = speculative_generate(dr, t, x, 24, [])
        assert replay_acceptance(dr, t, out[0].tolist(), x.shape[1]) == acc, text
    assert any(differs)
