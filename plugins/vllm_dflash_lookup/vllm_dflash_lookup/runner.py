"""The patches (vLLM 0.32's V1 model runner, CPU and CUDA builds alike: GPUModelRunner is the base
of CPUModelRunner).

`GPUModelRunner.propose_draft_token_ids` is where the DFlash proposer is asked for a block. Around
it, for each request of the batch, the context the next block follows is read on the host: the
tokens the runner already holds (`input_batch.token_ids_cpu[:num_tokens_no_spec]`) and this step's
accepted + bonus tokens (`sampled_token_ids`, -1 = rejected). Then:

* seed: `DFlashProposer.set_inputs_first_pass` writes the block [next token, mask x k]; lookup's
  proposal goes over the masks it covers, before the drafter's forward;
* gate: after the drafter, rows whose lookup match is long enough get lookup's continuation (and,
  past it, the drafter's own tokens); with probabilistic drafts, those positions get one-hot draft
  probabilities (a deterministic proposal), so rejection sampling stays exact.

Cost per step: one device-to-host copy of the sampled tokens (bookkeeping makes the same sync right
after) and a numpy scan of each request's context (3 vectorised passes).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from .proposal import lookup

logger = logging.getLogger("vllm.dflash_lookup")


def contexts(runner, sampled_token_ids) -> list[np.ndarray | None]:
    """Per batch row, every token up to and including the next block's first one; None where this
    step produced no token to follow (a chunk of a prefill)."""
    batch = runner.input_batch
    n = batch.num_reqs
    if torch.is_tensor(sampled_token_ids):
        sampled = sampled_token_ids[:n].cpu().numpy()
        discard = runner.discard_request_mask.np[:n]
        new = [None if discard[i] else row[row >= 0] for i, row in enumerate(sampled)]
    else:
        new = [np.asarray(row, dtype=np.int64) if row else None for row in sampled_token_ids[:n]]
    out = []
    for i, tail in enumerate(new):
        if tail is None or len(tail) == 0:
            out.append(None)
            continue
        held = batch.token_ids_cpu[i, :batch.num_tokens_no_spec[i]]
        out.append(np.concatenate([held, tail]))
    return out


def gate(drafts: torch.Tensor, ctxs, min_match: int, probs: torch.Tensor | None = None) -> int:
    """Lookup's continuation over the rows of `drafts` [reqs, k] whose match is >= `min_match`, in
    place; the number of rows replaced."""
    k = drafts.shape[1]
    rows, cols, vals = [], [], []
    for i, ctx in enumerate(ctxs[:drafts.shape[0]]):
        if ctx is None:
            continue
        tokens, match = lookup(ctx, k)
        if tokens and match >= min_match:
            rows += [i] * len(tokens)
            cols += range(len(tokens))
            vals += tokens
    if rows:
        r = torch.tensor(rows, device=drafts.device)
        c = torch.tensor(cols, device=drafts.device)
        v = torch.tensor(vals, device=drafts.device, dtype=drafts.dtype)
        drafts[r, c] = v
        if probs is not None:
            probs[r, c] = 0
            probs[r, c, v] = 1
    return len(set(rows))


def seed(input_ids: torch.Tensor, ctxs, k: int) -> None:
    """Lookup's proposal over the mask slots of the DFlash query blocks in `input_ids` (request-major,
    1 + k slots each: the next token, then the masks), in place."""
    idx, vals = [], []
    for i, ctx in enumerate(ctxs):
        if ctx is None:
            continue
        tokens, _ = lookup(ctx, k)
        base = i * (1 + k) + 1
        idx += range(base, base + len(tokens))
        vals += tokens
    if idx:
        input_ids[torch.tensor(idx, device=input_ids.device)] = torch.tensor(
            vals, device=input_ids.device, dtype=input_ids.dtype)


def install(modes: frozenset[str], min_match: int) -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    propose = GPUModelRunner.propose_draft_token_ids

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, DFlashProposer):
            return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if self.use_async_scheduling:
            # the host copy of the last step's tokens is a placeholder there: DFlash alone
            if not getattr(self, "_dflash_lookup_warned", False):
                logger.warning("dflash-lookup needs --no-async-scheduling; drafting with DFlash alone")
                self._dflash_lookup_warned = True
            return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        ctxs = contexts(self, sampled_token_ids)
        drafter._dflash_lookup_contexts = ctxs if "seed" in modes else None
        try:
            drafts = propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        finally:
            drafter._dflash_lookup_contexts = None
        if "gate" in modes and torch.is_tensor(drafts) and drafts.shape[1] > 0:
            gate(drafts, ctxs, min_match, self._draft_probs)
        return drafts

    first_pass = DFlashProposer.set_inputs_first_pass

    def set_inputs_first_pass(self, *args, **kwargs):
        out = first_pass(self, *args, **kwargs)
        ctxs = getattr(self, "_dflash_lookup_contexts", None)
        if ctxs is not None and self.num_speculative_tokens > 0:
            seed(self.input_ids, ctxs, self.num_speculative_tokens)
        return out

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    DFlashProposer.set_inputs_first_pass = set_inputs_first_pass
