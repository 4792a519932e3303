"""THE decoding loop of speculative decoding against the real target: `decode`, with a
`BlockProposer` drafting each block (a DFlash drafter, seeded or not, DFlash 2 through its
selector: eval/specdec.py; prompt lookup: eval/ngram.py) and the one greedy acceptance
(model/acceptance.py). Semantics: eval/specdec.py's docstring (the reference
`dflash.model.dflash_generate`).

Each step at ``start`` (the position of the last produced token): the proposer writes
``[token at start, drafts...]`` (up to ``max_length - start - 1`` drafts); ONE target forward
verifies the block; greedy: accepted = `accepted_prefix` of the drafts against the target's
argmax, the target's next token is the bonus; sampling (temperature > 0, proposers that give
their q): lossless rejection sampling (`rejection_sample`). produced = `produced_of` (accepted
+ 1, capped, cut after a stop token); the proposer gets the verify forward's features of the
produced positions (when it asked for features); the target cache is cropped to the new start.

Also here: the target forward itself (`TargetRunner`: decoder + `Target.inference_logits` over
only the rows needed; what plain decoding runs too, so its tokens/s is a fair baseline), the
KV cache with rollback, and the sampling helpers.
"""
from __future__ import annotations

import inspect
from typing import Iterable, Protocol, Sequence

import torch
from transformers import DynamicCache

from dflash_train.model.acceptance import accepted_prefix, produced_of

__all__ = ["BlockProposer", "decode", "plain_generate", "TargetRunner", "rejection_sample", "sampling_probs",
           "sample_rows", "layer_features", "make_target_cache", "crop_cache"]


def make_target_cache(hf_model, rollback: bool = True, block_size: int | None = None):
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
    try:
        params = inspect.signature(hf_model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def crop_cache(cache, length: int) -> None:
    """Drop cached positions >= length (crop(0) still shrinks sliding layers to their working size)."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of length {cache.get_seq_length()} to {length}")
    cache.crop(-remove)


def layer_features(hidden_states: Sequence[torch.Tensor], layer_ids: Iterable[int], n: int | None = None) -> torch.Tensor:
    """Concatenated outputs of the selected target layers (HF hidden_states[i + 1]), first n positions."""
    return torch.cat([hidden_states[int(i) + 1][:, :n] for i in layer_ids], dim=-1)


class TargetRunner:
    """One target forward with the KV cache -> (logits of the last `keep` positions, hidden states).

    A `Target` (targets/protocol.py `DecodingTarget`: .decoder + .inference_logits) runs as
    decoder + `inference_logits` (the head only over the rows asked for, packed on CPU); a
    bare CausalLM holder (.model only: the tests' hand-made models) as the CausalLM forward
    with logits_to_keep. The decoder
    path computes exactly what the CausalLM forward does (its last_hidden_state
    is the final-normed one the lm_head reads; hidden_states are the same tuple)."""

    def __init__(self, target):
        self.model = target.model
        self.split = hasattr(target, "decoder") and hasattr(target, "inference_logits")
        self.head = target.inference_logits if self.split else None
        self.fwd = target.decoder if self.split else self.model
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


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.multinomial(flat, 1, generator=generator)
    return out.view(probs.shape[:-1])


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    return sample_rows(sampling_probs(logits, temperature), generator)


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
        return accepted, int(sample_rows(target_probs[g], generator).item())
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    if float(total) > 0:
        residual = residual / total
    else:  # p == q exactly at this position: sample p
        residual = target_probs[accepted]
    return accepted, int(sample_rows(residual, generator).item())


class BlockProposer(Protocol):
    """What drafts each block of `decode` (stateful: it may keep a context of its own)."""

    needs_features: bool  # the prefill and verify forwards return the target's hidden states for it
    pad_token_id: int  # what fills the output buffer past the last produced token (a drafter's mask)
    max_block: int  # the longest block it verifies (1 + drafts): the target cache keeps that many states

    def begin(self, hidden_states, prompt_ids: torch.Tensor, first: int) -> None:
        """After the prefill: its hidden states (when asked for), the prompt [1, n], the first new token."""
        ...

    def draft(self, output_ids: torch.Tensor, start: int, room: int, temperature: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(block [1, 1 + g]: the token at `start` and g <= room drafts, q [1, g, V] or None)
        from output_ids[:, :start + 1] (prompt + produced tokens). q: the draft distribution the
        drafts were sampled from (temperature > 0); None = greedy drafts."""
        ...

    def advance(self, hidden_states, start: int, produced: int, new_tokens: Sequence[int]) -> None:
        """A step produced `produced` tokens after `start` (`new_tokens`, host ints; with features:
        the verify forward's hidden states, of which positions start..start+produced-1 are context)."""
        ...


@torch.inference_mode()
def decode(target, proposer: BlockProposer, input_ids: torch.Tensor, max_new_tokens: int,
           stop_token_ids: Sequence[int] | None = None, temperature: float = 0.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[int]]:
    """Speculative decoding with `proposer`. Returns (output_ids [1, n + generated], acceptance_lengths)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if temperature < 0:
        raise ValueError("temperature must be >= 0")
    device = target.device
    gen = _gen_for(device, generator)
    input_ids = input_ids.to(device)
    n = int(input_ids.shape[1])
    max_length = n + int(max_new_tokens)
    stops = set(int(s) for s in (stop_token_ids or []))
    feats = bool(proposer.needs_features)

    # output buffer: positions past the last produced one hold the pad (a drafter's MASK), so a block is a slice
    output_ids = torch.full((1, max_length + 1), int(proposer.pad_token_id), dtype=torch.long, device=device)
    output_ids[:, :n] = input_ids
    positions = torch.arange(max_length + 1, device=device)[None]

    tcache = make_target_cache(target.model, block_size=int(proposer.max_block))
    run = TargetRunner(target)
    logits, hs = run(input_ids, positions[:, :n], tcache, 1, feats)
    first = _pick(logits[:, -1], temperature, gen)
    output_ids[:, n] = first
    first_token = int(first.item())
    proposer.begin(hs, input_ids, first_token)
    del logits, hs
    crop_cache(tcache, n)

    acceptance_lengths: list[int] = []
    start = n
    stopped = first_token in stops
    while start + 1 < max_length and not stopped:
        block, q = proposer.draft(output_ids, start, max_length - start - 1, temperature, gen)
        vs = int(block.shape[1])
        logits, hs = run(block, positions[:, start:start + vs], tcache, vs, feats)
        if temperature > 0 and q is not None:
            p = sampling_probs(logits[0], temperature)  # [vs, V]
            accepted, nxt = rejection_sample(block[0, 1:], q[0], p, gen)
            output_ids[:, start + 1:start + accepted + 1] = block[:, 1:accepted + 1]
            output_ids[0, start + accepted + 1] = nxt
            new_tokens = block[0, 1:accepted + 1].tolist() + [nxt]
        else:
            posterior = torch.argmax(logits[0], dim=-1)  # [vs]
            # the one host sync of the step: the drafts and the target's tokens together
            both = torch.cat([block[0, 1:], posterior]).tolist()
            drafts, post = both[:vs - 1], both[vs - 1:]
            accepted = accepted_prefix(drafts, post)
            # accepted drafts == the target's own tokens, then its bonus: posterior[:accepted + 1]
            output_ids[0, start + 1:start + accepted + 2] = posterior[:accepted + 1]
            new_tokens = post[:accepted + 1]
        produced, stopped = produced_of(accepted, max_length - start - 1, new_tokens, stops)
        proposer.advance(hs, start, produced, new_tokens)
        del logits, hs
        start += produced
        crop_cache(tcache, start)
        acceptance_lengths.append(produced)

    return output_ids[:, :min(start + 1, max_length)].clone(), acceptance_lengths


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
    as the speculative loop (`TargetRunner`: a DynamicCache, the head over the
    last row only), minus the sliding layers' rollback record it never needs.
    """
    model = target.model
    device = target.device
    input_ids = input_ids.to(device)
    n = input_ids.shape[1]
    gen = _gen_for(device, generator)
    stops = set(int(s) for s in (stop_token_ids or []))
    cache = make_target_cache(model, rollback=False)
    run = TargetRunner(target)
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
