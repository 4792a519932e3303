"""Replay (training-path acceptance on known greedy outputs) equals real speculative decoding:
the training forward + teacher-forced capture see what the decoder sees, so a gap between
training accuracy and real tau is not a feature / position / mask mismatch."""
from __future__ import annotations

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.replay import replay_acceptance, replay_drafts, walk_acceptance
from dflash_train.eval.specdec import plain_generate, speculative_generate
from specdec_fakes import bias_target_towards, slot_prediction
from dflash_train.model import DFlashDrafter, DrafterConfig
from dflash_train.targets import load_target

PROMPTS = ["Hello! How can I help", "The quick brown fox", "Write a short poem about the sea."]


def test_walk_acceptance_hand_example():
    out = [9, 9, 1, 2, 3, 4, 5, 6]  # prompt of 2, new tokens 1..6
    drafts = {2: [2, 3, 7], 5: [5, 6, 0], 4: [5, 6]}
    # anchor 2: accepts 2,3 then bonus (4) -> 3 tokens; anchor 5: accepts 5? no: output[6]=5 -> yes, 6 -> yes, end
    assert walk_acceptance(out, 2, lambda s: drafts[s]) == [3, 2]
    assert walk_acceptance(out, 2, lambda s: []) == [1] * 5
    assert walk_acceptance(out, 7, lambda s: []) == []


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_replay_equals_speculative_decoding(tiny_target_factory, family):
    t = load_target(TargetConfig(path=str(tiny_target_factory(family)), device="cpu", dtype="float32"))
    if family == "qwen3":
        tok = 100
        bias_target_towards(t, tok, alpha=5.0, anti=1.0)
        prompts = PROMPTS
        mc = dict(layer_types=["full_attention"])
    else:  # the tiny gemma repeats tokens; a sliding layer with a window shorter than the block
        x0 = t.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
        tok = int(plain_generate(t, x0, 4, [])[0, -1])
        prompts = PROMPTS[:1]
        mc = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == tok)
    dr = DFlashDrafter(DrafterConfig.from_target(ModelConfig(num_layers=2, block_size=8, mask_token_id=mask, **mc),
                                                 t), seed=0).eval()
    seen = []
    for text in prompts:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        spec, acc = speculative_generate(dr, t, x, 20, [])
        assert replay_acceptance(dr, t, spec[0].tolist(), x.shape[1]) == acc
        seen += acc
    assert max(seen) > 2 and len(set(seen)) > 1, seen  # a non-trivial mix of acceptance lengths


def test_replay_at_k_uses_the_engines_shorter_block_and_equals_decoding_at_k(tiny_target_factory):
    """Served at k < block_size - 1 an engine drafts from [token, MASK x k] (vLLM: 1 + k query
    tokens), and a block's attention is bidirectional, so the first k drafts of a whole block are
    not what it proposes. Replay at k equals real decoding at k from that shorter block; the whole
    block's first k drafts differ on a 2-layer drafter."""
    t = load_target(TargetConfig(path=str(tiny_target_factory("qwen3")), device="cpu", dtype="float32"))
    # weights large enough that the drafts vary (a 0.02-init drafter drafts one token everywhere)
    dr = DFlashDrafter(DrafterConfig.from_target(ModelConfig(num_layers=2, block_size=8, init_std=0.5), t), seed=0).eval()
    assert dr.cfg.served_block_len(3) == 4 and dr.cfg.served_block_len(7) is None and dr.cfg.served_block_len(None) is None
    x = t.tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    out = torch.cat([x[0], torch.randint(0, t.vocab_size, (40,), generator=torch.Generator().manual_seed(0))]).tolist()
    short = replay_drafts(dr, t, out, x.shape[1], k=3)
    whole = replay_drafts(dr, t, out, x.shape[1])
    assert short.shape == (len(out) - 1 - x.shape[1], 3) and whole.shape[1] == 7
    assert not torch.equal(short, whole[:, :3]), "the whole block's first 3 drafts equal the 4-token block's"

    tok = 100  # a target that accepts drafts, for a non-trivial decoding walk
    bias_target_towards(t, tok, alpha=5.0, anti=1.0)
    mask = next(m for m in range(t.vocab_size) if slot_prediction(t, m) == tok)
    dr = DFlashDrafter(DrafterConfig.from_target(ModelConfig(num_layers=2, block_size=8, mask_token_id=mask), t),
                       seed=0).eval()
    seen = []
    for text in PROMPTS:
        x = t.tokenizer(text, return_tensors="pt").input_ids
        spec, acc = speculative_generate(dr, t, x, 20, [], k=3)
        assert replay_acceptance(dr, t, spec[0].tolist(), x.shape[1], k=3) == acc
        seen += acc
    assert max(seen) == 4 and len(set(seen)) > 1, seen  # k 3: at most 3 accepted + 1 a step
