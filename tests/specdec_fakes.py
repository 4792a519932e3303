"""Test helpers for speculative decoding (used by tests/test_eval_*.py, test_export_reference.py).

* `bias_target_towards`: edits a (tiny, random) target in place so that one
  token is frequent but not certain, like a real LM's frequent tokens, so a
  random drafter whose masked slots predict that token gets a MIX of full,
  partial and zero acceptance with the real target forward (cache, attention,
  sliding windows all intact).
* `slot_prediction`: the token a near-identity drafter predicts for its masked
  slots given a mask token (argmax lm_head(rmsnorm(embed(mask)))).
* `OracleDrafter`: implements the drafter inference interface
  (new_cache / extend_context / draft_block / cfg) and proposes the target's
  own greedy continuation except at chosen positions, so acceptance lengths
  are known in advance; it checks every context extension against the
  target's features of the full greedy sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash_train.model.drafter_config import DrafterConfig


@torch.no_grad()
def bias_target_towards(target, token: int, alpha: float, anti: float = 0.0, seed: int = 0) -> None:
    """Add a shared random direction b to every input embedding row and point the
    lm_head row of `token` along b (length `alpha`); `anti` subtracts anti*b from
    `token`'s own input embedding (so it does not simply repeat forever)."""
    E = target.model.get_input_embeddings().weight
    W = target.lm_head_weight
    g = torch.Generator().manual_seed(seed)
    b = (torch.randn(E.shape[1], generator=g) * E.float().std()).to(E.dtype).to(E.device)
    E += b
    W[token] = alpha * b / b.norm()
    if anti:
        E[token] -= anti * b


@torch.no_grad()
def slot_prediction(target, mask_token_id: int, eps: float = 1e-6) -> int:
    e = target.embed(torch.tensor([mask_token_id])).float()
    h = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps)
    return int(target.logits(h.to(target.dtype)).argmax(-1)[0])


@dataclass
class _OracleCfg:
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_seeds: str = "none"
    architecture: str = "dflash"
    served_block_len = DrafterConfig.served_block_len  # the real rule, not a copy


@dataclass
class _OracleCache:
    length: int = 0
    features: list[torch.Tensor] = field(default_factory=list)


class OracleDrafter:
    """Proposes `sequence[a + k]` for block slot k of the block anchored at a,
    except where `wrong(a + k)` is True (then a different token).

    `sequence` [N] is the full plain-greedy sequence (prompt + output);
    `reference_features` [N, K*H] the target's features of it (checked on
    every `extend_context`, so only the anchor and accepted tokens - whose
    features are then exactly the plain ones - may be passed).
    """

    def __init__(self, target, sequence: torch.Tensor, reference_features: torch.Tensor,
                 block_size: int, layer_ids: list[int], mask_token_id: int,
                 wrong: Callable[[int], bool], atol: float = 1e-4):
        self.target = target
        self.cfg = _OracleCfg(block_size, list(layer_ids), mask_token_id)
        self.sequence = sequence.tolist()
        self.ref = reference_features
        self.wrong = wrong
        self.atol = atol
        self.extend_calls: list[tuple[int, int]] = []
        W = target.lm_head_weight.detach().float()
        self._hidden = W / W.norm(dim=-1, keepdim=True) * 50.0  # a hidden state whose argmax is that token
        top = target.logits(self._hidden.to(target.dtype)).argmax(-1)
        self._ok = top == torch.arange(W.shape[0], device=top.device)

    def restrict_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits  # the oracle drafts over the whole vocabulary

    def new_cache(self) -> _OracleCache:
        return _OracleCache()

    def extend_context(self, cache: _OracleCache, features_new: torch.Tensor, start_position: int) -> None:
        n = int(features_new.shape[1])
        s = int(start_position)
        assert s == cache.length, f"context extension at {s}, cache holds {cache.length} positions"
        ref = self.ref[s:s + n].to(features_new.dtype)
        assert torch.allclose(features_new[0], ref, atol=self.atol, rtol=1e-4), (
            f"context features at positions {s}..{s + n - 1} differ from the plain sequence's")
        cache.length = s + n
        self.extend_calls.append((s, n))

    def _token_at(self, pos: int) -> int:
        t = self.sequence[pos] if pos < len(self.sequence) else 0
        if self.wrong(pos):
            t = (t + 1) % self._hidden.shape[0]
        while not bool(self._ok[t]):  # pick a token the lm_head can express as argmax
            t = (t + 1) % self._hidden.shape[0]
        return t

    def draft_block(self, cache: _OracleCache, block_embeds: torch.Tensor, anchor_position: int) -> torch.Tensor:
        a = int(anchor_position)
        assert a == cache.length, f"block anchored at {a} but the context holds {cache.length} positions"
        n = int(block_embeds.shape[1])
        toks = [self.sequence[a] if a < len(self.sequence) else 0] + [self._token_at(a + k) for k in range(1, n)]
        return self._hidden[torch.tensor(toks)][None].to(block_embeds.dtype)

    def expected_token(self, pos: int) -> int:
        return self._token_at(pos)


def simulate_acceptance(sequence: list[int], n_prompt: int, max_new_tokens: int, block_size: int,
                        proposal: Callable[[int], int], stop_token_ids: set[int] | None = None) -> list[int]:
    """The reference loop's acceptance lengths for a drafter proposing `proposal(pos)`
    against a target whose greedy sequence is `sequence` (prompt + output)."""
    stops = stop_token_ids or set()
    max_length = n_prompt + max_new_tokens
    start = n_prompt
    out: list[int] = []
    if sequence[start] in stops:
        return out
    while start + 1 < max_length:
        vs = min(block_size, max_length - start)
        acc = 0
        while acc < vs - 1 and proposal(start + acc + 1) == sequence[start + acc + 1]:
            acc += 1
        produced = min(acc + 1, max_length - start - 1)
        hit = [i for i in range(1, produced + 1) if sequence[start + i] in stops]
        if hit:
            produced = hit[0]
        out.append(produced)
        start += produced
        if hit:
            break
    return out
