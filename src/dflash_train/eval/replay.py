"""Replay: greedy acceptance lengths of a drafter on KNOWN target outputs, through the TRAINING path.

Greedy speculative decoding is deterministic: the target's output for a prompt
does not depend on the drafter, only the number of verify steps does. So given
the target's greedy output, the acceptance lengths follow from the drafter's
proposals at the anchors the decoding visits. Replay computes the features the
way training does (`Target.capture` on the whole sequence, one document),
drafts a block at EVERY candidate anchor in one training forward (anchors
n..T-2), then walks the decoding with the one greedy acceptance (model/acceptance.py
`walk_acceptance`: at anchor s, accepted = matching prefix of the draft against the output,
produced = accepted + 1, next anchor s + produced).

Uses:
* a train/decode consistency check: replayed acceptance equals the acceptance
  of real speculative decoding (`speculative_generate`) on the same prompts
  whenever teacher-forced features equal incrementally decoded ones (exact up to
  float noise; a test holds it to equality on tiny targets), so a gap between
  training accuracy and real tau on the training answers is NOT a feature or
  position mismatch if replay agrees with decoding;
* a cheap tau estimate in recipe searches: one drafter forward per prompt, no
  target verify forwards.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dflash_train.model.acceptance import KnownDrafts, walk_acceptance
from dflash_train.model.on_policy import draft_everywhere

__all__ = ["replay_drafts", "replay_acceptance", "walk_acceptance"]


@torch.no_grad()
def replay_drafts(drafter, target, output: Sequence[int], n_prompt: int, seeded: bool | None = None,
                  k: int | None = None) -> torch.Tensor:
    """[T - 1 - n_prompt, k or bs - 1] greedy drafts at anchors n_prompt..T-2 from one training
    forward (seeded: see `draft_everywhere`; k: from the block an engine drafts k tokens with)."""
    device = target.device
    seq = torch.tensor([list(output)], dtype=torch.long, device=device)
    T = seq.shape[1]
    doc = torch.zeros(1, T, dtype=torch.int32, device=device)
    feats = target.capture(seq, doc, drafter.cfg.target_layer_ids)
    ok = torch.zeros(1, T, dtype=torch.bool, device=device)
    ok[0, int(n_prompt):T - 1] = True
    # a drafter with a draft vocabulary drafts over it, as the engines serve it
    drafts = draft_everywhere(drafter, target, seq, doc, feats, ok, getattr(drafter, "draft_vocab", None),
                              seeded=seeded, block_len=drafter.cfg.served_block_len(k))
    return drafts[0, int(n_prompt):T - 1, :k]


def replay_acceptance(drafter, target, output: Sequence[int], n_prompt: int, seeded: bool | None = None,
                      k: int | None = None) -> list[int]:
    """Acceptance lengths the drafter gets on the target's known greedy `output` (prompt + new tokens);
    seeded=False: a ``block_seeds: prompt_lookup`` drafter drafting from masks only; k: k draft
    tokens a step, from the block of k + 1 an engine builds for them (`DrafterConfig.served_block_len`)."""
    if len(output) - 1 <= n_prompt:
        return []
    drafts = replay_drafts(drafter, target, output, n_prompt, seeded, k).tolist()
    return walk_acceptance(output, n_prompt, KnownDrafts(drafts, first=n_prompt))
