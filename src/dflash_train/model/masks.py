"""The ONE DFlash attention mask, as a FlexAttention `mask_mod`, and its two backends.

Training lays a row out as keys = [T context positions ; A*bs block tokens] and
queries = the A*bs block tokens (block i = anchor i, token k of it at position
anchors[i] + k). `dflash_mask_mod` says which key a query may see:

* context key t: same document as the anchor, t STRICTLY < anchor (the feature
  at the anchor itself already encodes the next token), and for
  sliding_attention layers inside the window that counts the query itself:
  (anchor + k) - t < W, i.e. t >= anchor + k - (W - 1)  (reference `_attention_mask`).
* block key (i', k'): only its own block, i' == i. Keyed on the anchor INDEX,
  so two anchors closer than bs never see each other's block. full_attention:
  bidirectional inside the block; sliding_attention: causal (k' <= k) and the
  same window k - k' < W.
* padding blocks (anchor_valid False) see only themselves (q sees kv == itself).
  Why: a row with no visible key makes SDPA return NaN, and NaN * 0 weight is
  still NaN in the loss and its gradient. A self-only row is finite and the
  loss gives those positions weight 0, so they contribute exactly nothing.

`dense_mask` evaluates the very same function on broadcast index tensors (SDPA,
CPU, fallback); `flex_block_mask` hands it to `create_block_mask` (CUDA).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import create_block_mask

FULL = "full_attention"
SLIDING = "sliding_attention"


def document_ids_from_lengths(lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """[n] document lengths -> [total] ids 0,0,..,1,1,..; positions past the sum get -1 (padding).

    Vectorised with repeat_interleave (no python loop over documents).
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    if total is not None:
        if ids.numel() > total:
            raise ValueError(f"document lengths sum to {ids.numel()} > total {total}")
        ids = torch.cat([ids, ids.new_full((total - ids.numel(),), -1)])
    return ids


def dflash_mask_mod(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    layer_type: str = FULL,
    sliding_window: int | None = None,
    context_len: int | None = None,
) -> Callable:
    """Build `mask_mod(b, h, q_idx, kv_idx) -> bool` for one layer type.

    anchors [B, A] long, anchor_valid [B, A] bool, document_ids [B, T] (the
    context's documents; T = context_len unless given, kv_idx < T is context).
    Only tensor ops that work both under vmap (flex) and on broadcast index
    tensors (dense) are used; every gather index is clamped in range.
    """
    if layer_type not in (FULL, SLIDING):
        raise ValueError(f"unknown layer type {layer_type!r}")
    if layer_type == SLIDING and sliding_window is None:
        raise ValueError("sliding_attention needs a sliding_window")
    bs = int(block_size)
    T = int(document_ids.shape[1] if context_len is None else context_len)
    A = int(anchors.shape[1])
    # Always at least one column so the clamped gathers below are legal even
    # with an empty context (inference at anchor 0).
    docs = document_ids if document_ids.shape[1] > 0 else document_ids.new_zeros(document_ids.shape[0], 1)
    t_max = docs.shape[1] - 1
    sliding = layer_type == SLIDING
    W = int(sliding_window) if sliding else 0

    def mask_mod(b, h, q_idx, kv_idx):
        blk = torch.clamp(q_idx // bs, max=A - 1)
        k = q_idx % bs
        a = anchors[b, blk]
        ok = anchor_valid[b, blk]

        # context part
        is_ctx = kv_idx < T
        t = torch.clamp(kv_idx, max=t_max)
        ctx = is_ctx & ok & (kv_idx < a) & (docs[b, t] == docs[b, torch.clamp(a, max=t_max)])
        ctx = ctx & (docs[b, t] >= 0)
        if sliding:
            ctx = ctx & (a + k - kv_idx < W)

        # block part: own block only (by anchor index), padding sees itself only. j < 0 on
        # context keys gives a negative blk2 (never own); no clamp: it indexes nothing, and
        # inductor fails on a clamp followed by // when compiling create_block_mask (torch 2.13)
        j = kv_idx - T
        blk2 = j // bs
        k2 = j % bs
        own = (~is_ctx) & (blk2 == blk)
        in_block = ok
        if sliding:
            in_block = in_block & (k2 <= k) & (k - k2 < W)
        own = own & (in_block | (k2 == k))
        return ctx | own

    return mask_mod


def dense_mask(mask_mod: Callable, B: int, q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Evaluate `mask_mod` on broadcast indices -> bool [B, 1, q_len, kv_len] (True = visible) for SDPA."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv).expand(B, 1, q_len, kv_len)


@functools.cache
def _compiled_create_block_mask():
    # what create_block_mask(_compile=True) does (the reference DFlash seed's call; torch 2.13
    # deprecates the flag for this). A new mask_mod closure each step does not recompile: dynamo
    # guards on its code and on the closure's ints (block size, T, A, window), fixed in a run.
    return torch.compile(create_block_mask)


def flex_block_mask(mask_mod: Callable, B: int, q_len: int, kv_len: int, device=None, compile: bool = False):
    """The same `mask_mod` as a FlexAttention BlockMask (heads broadcast: H=None); `compile`:
    built by one fused kernel instead of materialising the [B, q_len, kv_len] mask eagerly."""
    build = _compiled_create_block_mask() if compile else create_block_mask
    return build(mask_mod, B, None, q_len, kv_len, device=device)


def build_masks(
    layer_types: list[str],
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    document_ids: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
    backend: str,
    context_len: int | None = None,
    compile: bool | None = None,
) -> dict[str, object]:
    """One mask per distinct layer type (shared by all layers of that type), for one step.

    compile: build flex BlockMasks compiled (default: on CUDA; on CPU flex is for tests only and
    inductor's CPU code for the padded mask fails on bool vectors, torch 2.13)."""
    B, A = anchors.shape
    if compile is None:
        compile = anchors.is_cuda
    T = int(document_ids.shape[1] if context_len is None else context_len)
    q_len, kv_len = A * block_size, T + A * block_size
    out: dict[str, object] = {}
    for lt in dict.fromkeys(layer_types):
        mod = dflash_mask_mod(anchors, anchor_valid, document_ids, block_size, lt, sliding_window, T)
        if backend == "flex":
            out[lt] = flex_block_mask(mod, B, q_len, kv_len, device=anchors.device, compile=compile)
        elif backend == "sdpa":
            out[lt] = dense_mask(mod, B, q_len, kv_len, device=anchors.device)
        else:
            raise ValueError(f"unknown attention backend {backend!r}; use 'sdpa' or 'flex'")
    return out
