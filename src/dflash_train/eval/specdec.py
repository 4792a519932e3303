"""Real speculative decoding with a DFlash drafter against the real target.

Same semantics as the reference `dflash.model.dflash_generate` (PyPI dflash
0.1.0), which is what SGLang / vLLM serve:

* prefill the prompt (positions 0..n-1) through the target with a KV cache;
  the first new token comes from the last prompt logits; the context features
  of the prompt (target layers `target_layer_ids`, HF ``hidden_states[i + 1]``)
  go into the drafter's context cache.
* each step, at ``start`` (the position of the last produced token): the block
  is ``[token at start, MASK x (bs - 1)]`` at positions ``start..start+bs-1``
  (a ``block_seeds: prompt_lookup`` drafter gets the prompt-lookup proposal of
  prompt + output so far written over the masks it covers, as in training);
  the drafter sees context strictly before ``start`` plus the block and fills
  the bs - 1 masked slots in one forward; ONE target forward over the block
  verifies them. Greedy: accepted = matching prefix; the target's own next
  token after it is the bonus. Sampling (temperature > 0): standard lossless
  speculative sampling (accept draft token x with prob min(1, p(x)/q(x)); at the
  first rejection sample from normalised max(0, p - q); if all are accepted the
  bonus comes from p at the last position).
* produced = accepted + 1 (capped by max_new_tokens, cut after a stop token);
  the target cache is cropped to the new start; the verify forward's features
  of the anchor and the accepted tokens (NOT the bonus, which the target has
  not seen yet) extend the drafter's context.

A DFlash 2 drafter drafts with its candidate selector (the path through each
slot's unary top-k, argmax or sampled left to right from the anchor, as the
reference ``propose``); rejection sampling then uses the q rows the path was
drawn from.

``acceptance_lengths`` are the per-step ``produced`` counts, exactly as the
reference reports them; tau = their mean.

Speed (CPU, issue 12): the target runs as its decoder (KV cache, hidden
states) followed by `Target.inference_logits` over only the rows that are
needed (the last prompt position; the verify block; the drafter's masked
slots): on CPU that head reads the 262K x H weight once per call however many
rows it has, where MKL's small-batch sgemm took ~4x a one-row pass for a
block. Plain decoding uses the very same decoder + head, so its tokens/s is
a fair baseline. A verify step does one host sync (the drafts and the target's
argmax come back together) and no torch.isin.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from dflash_train.model.lookup import seed_blocks

__all__ = [
    "speculative_generate",
    "plain_generate",
    "rejection_sample",
    "sampling_probs",
    "acceptance_histogram",
    "tau_of",
]


# --------------------------------------------------------------------------- helpers


def _drafter_cfg(drafter):
    cfg = getattr(drafter, "cfg", None)
    if cfg is None:
        cfg = getattr(drafter, "config", None)
    if cfg is None:
        raise TypeError("drafter has no .cfg (DrafterConfig)")
    return cfg


def _make_target_cache(hf_model, rollback: bool = True, block_size: int | None = None):
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    # sliding-window layers keep past states until crop(), so a rejected draft can be rolled back;
    # linear-attention layers (Qwen3.5, Qwen3-Next) keep the recurrent state after each of the last
    # `block_size` tokens so a verify block can be cut back to its accepted prefix;
    # plain decoding never rolls back (and never crops): its sliding layers keep only their window
    if rollback and hasattr(cache, "activate_past_recording"):
        try:
            cache.activate_past_recording(recurrent_states_to_keep=block_size)
        except TypeError:  # a transformers without linear-attention caches
            cache.activate_past_recording()
    return cache


def _cache_kw(hf_model) -> str:
    """transformers >= 5.2x names the KV-cache argument `cache` (`past_key_values` is deprecated)."""
    import inspect

    try:
        params = inspect.signature(hf_model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _crop_to(cache, length: int) -> None:
    """Drop cached positions >= length (crop(0) still shrinks sliding layers to their working size)."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of length {cache.get_seq_length()} to {length}")
    cache.crop(-remove)


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Iterable[int], n: int | None = None) -> torch.Tensor:
    """Concatenated outputs of the selected target layers (HF hidden_states[i + 1]), first n positions."""
    return torch.cat([hidden_states[int(i) + 1][:, :n] for i in layer_ids], dim=-1)


class _TargetRunner:
    """One target forward with the KV cache -> (logits of the last `keep` positions, hidden states).

    A `Target` runs as decoder + `Target.inference_logits` (the head only over the
    rows asked for, packed on CPU); anything else (a bare target object with
    .model) as the CausalLM forward with logits_to_keep, as before. The decoder
    path computes exactly what the CausalLM forward does (its last_hidden_state
    is the final-normed one the lm_head reads; hidden_states are the same tuple)."""

    def __init__(self, target):
        self.model = target.model
        decoder = getattr(target, "decoder", None)
        self.head = getattr(target, "inference_logits", None)
        self.split = decoder is not None and self.head is not None
        self.fwd = decoder if self.split else self.model
        self.ck = _cache_kw(self.fwd)

    def __call__(self, ids, positions, cache, keep: int, hidden_states: bool):
        kw = {self.ck: cache}
        if hidden_states:
            kw["output_hidden_states"] = True
        if self.split:
            out = self.fwd(input_ids=ids, position_ids=positions, use_cache=True, **kw)
            h = out.last_hidden_state
            logits = self.head(h[:, -keep:] if keep < h.shape[1] else h)
        else:
            out = self.fwd(ids, position_ids=positions, use_cache=True, logits_to_keep=keep, **kw)
            logits = out.logits
        return logits, (out.hidden_states if hidden_states else None)


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / float(temperature), dim=-1)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.view(probs.shape[:-1])


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    return _sample(sampling_probs(logits, temperature), generator)


def _gen_for(device: torch.device, generator: torch.Generator | None) -> torch.Generator | None:
    """Sampling uses the generator's device; reuse it when it matches, else None (global RNG)."""
    if generator is None:
        return None
    if generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device}, tensors on {device}")
    return generator


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Lossless speculative sampling for one block.

    draft_tokens [g] (sampled from draft_probs), draft_probs [g, V] (q), target_probs
    [g + 1, V] (p at the g draft positions and one more for the bonus).
    Returns (accepted, next_token): the first `accepted` drafts are kept and
    `next_token` follows them (a residual sample at the first rejection, or
    the bonus from p[g] if all were accepted).
    """
    g = int(draft_tokens.shape[0])
    idx = draft_tokens.long()[:, None]
    p = target_probs[:g].gather(-1, idx)[:, 0]
    q = draft_probs.gather(-1, idx)[:, 0]
    u = torch.rand(g, generator=generator, device=p.device, dtype=p.dtype) if g else p.new_zeros(0)
    ok = (u * q < p).to(torch.int64)
    accepted = int(ok.cumprod(0).sum().item()) if g else 0
    if accepted == g:
        return accepted, int(_sample(target_probs[g], generator).item())
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    if float(total) > 0:
        residual = residual / total
    else:  # p == q exactly at this position: sample p
        residual = target_probs[accepted]
    return accepted, int(_sample(residual, generator).item())


def acceptance_histogram(acceptance_lengths: Iterable[int], block_size: int) -> dict[int, int]:
    """{tokens produced per verify step (1..block_size): number of steps}."""
    hist = {k: 0 for k in range(1, int(block_size) + 1)}
    for a in acceptance_lengths:
        hist[int(a)] = hist.get(int(a), 0) + 1
    return hist


def tau_of(acceptance_lengths: Sequence[int]) -> float:
    return float(sum(acceptance_lengths)) / len(acceptance_lengths) if acceptance_lengths else float("nan")


# --------------------------------------------------------------------------- generation


@torch.inference_mode()
def plain_generate(
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plain autoregressive decoding with the target's KV cache (the baseline).

    Returns [1, n + generated] (prompt included); stops after a stop token
    (kept) or after max_new_tokens new tokens. Same target forward and cache type
    as the speculative loop (`_TargetRunner`: a DynamicCache, the head over the
    last row only), minus the sliding layers' rollback record it never needs.
    """
    model = target.model
    device = target.device
    input_ids = input_ids.to(device)
    n = input_ids.shape[1]
    gen = _gen_for(device, generator)
    stops = set(int(s) for s in (stop_token_ids or []))
    cache = _make_target_cache(model, rollback=False)
    run = _TargetRunner(target)
    positions = torch.arange(n + int(max_new_tokens), device=device)[None]
    logits, _ = run(input_ids, positions[:, :n], cache, 1, False)
    tok = _pick(logits[:, -1], temperature, gen)  # [1]
    tokens = [int(tok.item())]
    while len(tokens) < max_new_tokens and tokens[-1] not in stops:
        p = n + len(tokens) - 1
        logits, _ = run(tok[:, None], positions[:, p:p + 1], cache, 1, False)
        tok = _pick(logits[:, -1], temperature, gen)
        tokens.append(int(tok.item()))
    return torch.cat([input_ids, torch.tensor([tokens], device=device, dtype=input_ids.dtype)], dim=1)


@torch.inference_mode()
def speculative_generate(
    drafter,
    target,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """DFlash speculative decoding. Returns (output_ids [1, n + generated], acceptance_lengths).

    Greedy (temperature 0) output equals `plain_generate` token for token;
    temperature > 0 is distributed exactly as plain sampling from the target.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    cfg = _drafter_cfg(drafter)
    bs = int(cfg.block_size)
    layer_ids = list(cfg.target_layer_ids)
    mask_id = int(cfg.mask_token_id)
    model = target.model
    device = target.device
    target_logits = getattr(target, "inference_logits", None) or target.logits
    gen = _gen_for(device, generator)
    selector = getattr(drafter, "candidate_selector", None)
    input_ids = input_ids.to(device)
    n = int(input_ids.shape[1])
    max_length = n + int(max_new_tokens)
    stops = set(int(s) for s in (stop_token_ids or []))

    # output buffer: positions >= the last produced one hold MASK, so a block is a plain slice
    output_ids = torch.full((1, max_length + 1), mask_id, dtype=torch.long, device=device)
    output_ids[:, :n] = input_ids
    positions = torch.arange(max_length + 1, device=device)[None]

    tcache = _make_target_cache(model, block_size=bs)
    run = _TargetRunner(target)
    logits, hs = run(input_ids, positions[:, :n], tcache, 1, True)
    first = _pick(logits[:, -1], temperature, gen)
    output_ids[:, n] = first
    dcache = drafter.new_cache()
    drafter.extend_context(dcache, _features(hs, layer_ids), 0)
    del logits, hs
    _crop_to(tcache, n)

    seeded = getattr(cfg, "block_seeds", "none") == "prompt_lookup"
    no_docs = torch.zeros_like(output_ids)
    anchor = torch.zeros(1, 1, dtype=torch.long, device=device)
    acceptance_lengths: list[int] = []
    start = n
    stopped = bool(stops) and int(first.item()) in stops
    while start + 1 < max_length and not stopped:
        vs = min(bs, max_length - start)  # >= 2 here
        block = output_ids[:, start:start + vs].clone()
        if seeded:  # the prompt-lookup proposal in the masked slots (model/lookup.py), as in training
            block = seed_blocks(block[:, None], output_ids[:, :start + 1], no_docs[:, :start + 1],
                                anchor.fill_(start))[:, 0]
        embeds = target.embed(block)
        hidden = drafter.draft_block(dcache, embeds, start)[:, 1:vs]
        draft_logits = target_logits(hidden.to(embeds.dtype))
        if selector is not None:  # DFlash 2: the selector's path through the unary top-k (model/dflash2.py)
            path, candidates, q_top = selector.select(hidden, draft_logits, block[:, 0], temperature, gen)
            block[:, 1:] = path
            if temperature > 0:  # q: the rows the path was drawn from, over the whole vocabulary
                q = torch.zeros(draft_logits.shape, dtype=q_top.dtype, device=device).scatter_(-1, candidates, q_top)
        elif temperature > 0:
            q = sampling_probs(draft_logits, temperature)  # [1, vs-1, V]
            block[:, 1:] = _sample(q, gen)
        else:
            block[:, 1:] = torch.argmax(draft_logits, dim=-1)
        del draft_logits

        logits, hs = run(block, positions[:, start:start + vs], tcache, vs, True)
        if temperature > 0:
            p = sampling_probs(logits[0], temperature)  # [vs, V]
            accepted, nxt = rejection_sample(block[0, 1:], q[0], p, gen)
            output_ids[:, start + 1:start + accepted + 1] = block[:, 1:accepted + 1]
            output_ids[0, start + accepted + 1] = nxt
            new_tokens = block[0, 1:accepted + 1].tolist() + [nxt] if stops else []
        else:
            posterior = torch.argmax(logits[0], dim=-1)  # [vs]
            # the one host sync of the step: the drafts and the target's tokens together
            both = torch.cat([block[0, 1:], posterior]).tolist()
            drafts, post = both[:vs - 1], both[vs - 1:]
            accepted = 0
            while accepted < vs - 1 and drafts[accepted] == post[accepted]:
                accepted += 1
            # accepted drafts == the target's own tokens, then its bonus: posterior[:accepted + 1]
            output_ids[0, start + 1:start + accepted + 2] = posterior[:accepted + 1]
            new_tokens = post[:accepted + 1]
        produced = min(accepted + 1, max_length - start - 1)
        if stops:
            hit = next((i for i, t in enumerate(new_tokens[:produced]) if t in stops), None)
            if hit is not None:
                produced = hit + 1
                stopped = True
        # context features of the anchor + accepted tokens (positions start..start+produced-1)
        drafter.extend_context(dcache, _features(hs, layer_ids, produced), start)
        del logits, hs
        start += produced
        _crop_to(tcache, start)
        acceptance_lengths.append(produced)

    return output_ids[:, :min(start + 1, max_length)].clone(), acceptance_lengths
