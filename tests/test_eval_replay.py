"""Replay (training-path acceptance on known greedy outputs) equals real speculative decoding:
the training forward + teacher-forced capture see what the decoder sees, so a gap between
training accuracy and real tau is not a feature / position / mask mismatch."""
from __future__ import annotations

import pytest
import torch

from dflash_train.config import ModelConfig, TargetConfig
from dflash_train.eval.replay import replay_acceptance, walk_acceptance
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
