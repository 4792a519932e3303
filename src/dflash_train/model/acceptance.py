"""Greedy acceptance, the one definition, and the `Proposer` protocol it walks.

Greedy speculative decoding at an anchor s (the position of the last produced token): the
proposer drafts tokens for s+1, s+2, ...; ONE target forward verifies them; the accepted drafts
are the longest prefix equal to the target's own tokens (`accepted_prefix`), then the target's
next token follows (the bonus), so a step produces accepted + 1 tokens, at most what is left and
cut after a stop token (`produced_of`); decoding moves to s + produced.

Everything that counts acceptance uses these: real decoding (eval/decoding.py: DFlash drafters,
seeded or not, and prompt lookup), replay of a known output (eval/replay.py), prompt lookup on
known outputs (compare.py) and the on-policy anchors (model/on_policy.py, whose matching prefixes
come vectorised from `matching_prefix`).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class Proposer(Protocol):
    """What drafts the tokens after an anchor of a sequence it knows (a known output, or the
    output so far): a drafter's drafts at every anchor from one training forward (replay,
    on-policy), prompt lookup. Real decoding's stateful proposers (eval/decoding.py
    `BlockProposer`) draft through the same acceptance."""

    def propose(self, anchor: int, k: int) -> Sequence[int]:
        """Up to `k` draft tokens for positions anchor+1, anchor+2, ... (may be empty)."""
        ...


class KnownDrafts:
    """A `Proposer` over drafts computed beforehand: `drafts[i]` for anchor `first + i`."""

    def __init__(self, drafts: Sequence[Sequence[int]], first: int = 0) -> None:
        self.drafts, self.first = drafts, int(first)

    def propose(self, anchor: int, k: int) -> Sequence[int]:
        return list(self.drafts[anchor - self.first])[:k]


def accepted_prefix(draft: Sequence[int], verified: Sequence[int]) -> int:
    """How many leading draft tokens equal the target's own tokens at the same positions."""
    a = 0
    for d, v in zip(draft, verified):
        if int(d) != int(v):
            break
        a += 1
    return a


def matching_prefix(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """`accepted_prefix` of every row at once: drafts, truth [..., k] -> [...] int64."""
    return (drafts == truth).long().cumprod(-1).sum(-1)


def produced_of(accepted: int, room: int, new_tokens: Sequence[int] = (), stops=()) -> tuple[int, bool]:
    """(tokens the step produces, whether it produced a stop token): accepted + 1 (the bonus),
    at most `room`, cut after the first stop token among `new_tokens` (the step's tokens)."""
    produced = min(int(accepted) + 1, int(room))
    if stops:
        for i, t in enumerate(list(new_tokens)[:produced]):
            if t in stops:
                return i + 1, True
    return produced, False


def walk(start: int, last: int, accepted_at: Callable[[int], int]) -> list[tuple[int, int]]:
    """(anchor, produced) of every verify step of greedy decoding that writes positions up to
    `last`, the first anchor at `start`; accepted_at(s): the accepted drafts at anchor s."""
    s, steps = int(start), []
    while s < last:
        produced, _ = produced_of(accepted_at(s), last - s)
        steps.append((s, produced))
        s += produced
    return steps


def walk_acceptance(output: Sequence[int], n_prompt: int,
                    proposer: Proposer | Callable[[int], Sequence[int]]) -> list[int]:
    """Acceptance lengths of greedy speculative decoding that produced `output` (prompt + new
    tokens) with `proposer` (a `Proposer`, or a function anchor -> drafts). The first new token
    (position n_prompt) comes from the prefill, as in real decoding."""
    T = len(output)
    if hasattr(proposer, "propose"):
        def drafts(s: int) -> Sequence[int]:
            return proposer.propose(s, T - 1 - s)
    else:
        drafts = proposer
    return [p for _, p in walk(n_prompt, T - 1, lambda s: accepted_prefix(drafts(s), output[s + 1:]))]
