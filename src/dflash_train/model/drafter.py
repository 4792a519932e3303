"""The DFlash drafter: Qwen3-layout decoder layers with KV injection of target features.

Numerically the same as the reference `dflash.model.DFlashDraftModel` (PyPI
dflash 0.1.0), see tests/test_model_parity.py. Differences are in layout only:
training runs MANY blocks (anchors) of a row in one forward, with keys
[context ; all blocks] and the mask from `masks.py`; inference keeps a context
KV cache (`new_cache` / `extend_context` / `draft_block`).

The drafter owns no embedding and no lm_head (the target's are used); its
state_dict names are the export names (`layers.0.self_attn.q_proj.weight`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`, ...). A drafter with a draft
vocabulary (``cfg.draft_vocab_size``) also holds ``draft_vocab``: the target ids it
drafts over, sorted (a buffer, so checkpoints carry it; `restrict_logits` applies it).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from torch.utils.checkpoint import checkpoint

from dflash_train.model import masks as M
from dflash_train.model import rope as R
from dflash_train.model.drafter_config import (  # noqa: F401 - re-exported: the drafter's config
    DFLASH2_DEFAULTS,
    DFLASH2_KEYS,
    SERVING_ONLY_FIELDS,
    DrafterConfig,
    default_target_layer_ids,
)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin for arbitrary (per-token) positions, fp32 like Qwen3RotaryEmbedding;
    the frequencies (and yarn's scale) of `rope` (see model/rope.py)."""

    def __init__(self, head_dim: int, rope: dict[str, Any], max_position_embeddings: int):
        super().__init__()
        inv_freq, self.scale = R.inv_freq_and_scale(rope, head_dim, max_position_embeddings)
        # non-persistent: not part of the export / state_dict
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [..., D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, n, D]; cos/sin [B, n, D] (per row positions)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, D
        self.layer_type = layer_type
        self.q_proj = nn.Linear(H, self.nh * D, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * D, bias=False)
        self.o_proj = nn.Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.scale = D**-0.5

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of x [B, n, H] -> [B, nkv, n, D] (k_norm + RoPE on k). Same weights for context and block."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.nkv, self.d)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.nkv, self.d).transpose(1, 2)
        return _rope(k, cos, sin), v

    def q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, n, self.nh, self.d)).transpose(1, 2)
        return _rope(q, cos, sin)

    def attend(self, q, k, v, mask) -> torch.Tensor:
        """q [B, nh, Q, D], k/v [B, nkv, KV, D]; mask: dense bool [B,1,Q,KV] or a flex BlockMask."""
        if q.dtype != v.dtype:
            # under autocast, q/k leave the fp32-weighted norms/RoPE in fp32 while v is the
            # autocast dtype; flex_attention needs one dtype (SDPA would cast the same way)
            q, k = q.to(v.dtype), k.to(v.dtype)
        if mask is None or isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.nh != self.nkv)
        else:
            out = _flex_attention(q, k, v, mask, self.scale, self.nh != self.nkv)
        B, _, Q, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))


@functools.cache
def _compiled_flex_attention():
    # one wrapper per process. A new BlockMask (and mask_mod closure) each step does not
    # recompile: dynamo guards on the mask_mod's code and closure ints, not on the objects
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(q, k, v, block_mask, scale, gqa):
    """Compiled flex_attention on CUDA; inside a compiled region (train.compile) the region's own
    graph takes flex_attention as it is (no nested wrapper); eager on CPU (tests)."""
    compiled = q.is_cuda and not torch.compiler.is_compiling()
    fn = _compiled_flex_attention() if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = Attention(cfg, layer_type)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, q_rope, kv_rope, ctx_kv, mask):
        """x [B, Q, H] block stream; ctx_kv: this layer's context (k, v) (NOT input-normed, as in the reference)."""
        h = self.input_layernorm(x)
        q = self.self_attn.q(h, *q_rope)
        kb, vb = self.self_attn.kv(h, *kv_rope)
        k = torch.cat([ctx_kv[0], kb], dim=2)
        v = torch.cat([ctx_kv[1], vb], dim=2)
        x = x + self.self_attn.attend(q, k, v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_step(layer: Layer, x, context, ctx_rope, q_rope, mask):
    """One layer of the training forward: its context keys/values, then the layer. The unit that
    train.compile compiles and train.activation_checkpointing recomputes (so the context k/v
    activations are not kept either)."""
    ctx_kv = layer.self_attn.kv(context, *ctx_rope)
    return layer(x, q_rope, q_rope, ctx_kv, mask)


# --------------------------------------------------------------------------- inference cache


class DrafterCache:
    """Per layer context keys/values [B, nkv, n, D] (after k_norm and RoPE), positions 0..length-1."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def crop(self, n: int) -> None:
        """Keep the first n context positions (e.g. after a rejected draft)."""
        if n < 0 or n > self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {n}")
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :, :n]
                self.v[i] = self.v[i][:, :, :n]
        self.length = n


# --------------------------------------------------------------------------- the model


class DFlashDrafter(nn.Module):
    layer_class = Layer  # DFlash 2 (model/dflash2.py) swaps in its layer with convolutions

    def __init__(self, cfg: DrafterConfig, seed: int | None = 0, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        H, K = cfg.hidden_size, cfg.num_context_layers
        self.layers = nn.ModuleList([self.layer_class(cfg, lt) for lt in cfg.layer_types])
        self.fc = nn.Linear(K * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_parameters, cfg.max_position_embeddings)
        self.build_extra_modules(cfg)
        # set by prepare_for_training (train.compile / train.activation_checkpointing)
        self.layer_step = layer_step
        self.activation_checkpointing = False
        if cfg.draft_vocab_size:
            # filled by training (train.vocab_subset) or by loading a checkpoint / export
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size, dtype=torch.long))
        if generator is None:
            generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
        self.init_weights(generator)

    def build_extra_modules(self, cfg: DrafterConfig) -> None:
        """Modules registered after the backbone (DFlash 2: the candidate selector)."""

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """N(0, init_std) for every Linear, ones for every RMSNorm; drawn on CPU in state_dict order,
        so the same seed gives the same weights on any device."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, self.cfg.init_std, generator=generator)
                p.copy_(w)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    def restrict_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary draft logits -> -inf outside the draft vocabulary (in place; a no-op
        without one): the argmax and softmax the engines take over draft_vocab_size rows."""
        if self.cfg.draft_vocab_size:
            outside = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
            outside[self.draft_vocab.to(logits.device)] = False
            logits.masked_fill_(outside, float("-inf"))
        return logits

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """[B, T, K*H] concatenated target layer outputs -> [B, T, H] shared by all layers."""
        return self.hidden_norm(self.fc(features))

    def _dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ------------------------------------------------------------------ training

    def prepare_for_training(self, *, compile: bool, activation_checkpointing: bool) -> None:
        """train.compile: the training forward runs `layer_step` torch.compiled, one graph for all
        layers (their weights are graph inputs, so state_dict names are unchanged); the mask and
        anchor code around it stays eager, and so does inference (draft_block, evals).
        train.activation_checkpointing: each layer_step runs under torch.utils.checkpoint in a
        training forward with grad: its activations are recomputed in the backward."""
        self.layer_step = torch.compile(layer_step) if compile else layer_step
        self.activation_checkpointing = bool(activation_checkpointing)

    def build_masks(self, anchors, anchor_valid, document_ids, backend: str | None = None,
                    block_len: int | None = None):
        """One mask per layer type for this step (shared by all layers of that type)."""
        if backend is None:
            backend = "flex" if anchors.is_cuda else "sdpa"
        return M.build_masks(
            self.cfg.layer_types, anchors, anchor_valid, document_ids,
            block_len or self.cfg.block_size, self.cfg.sliding_window, backend,
        )

    def forward(
        self,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        document_ids: torch.Tensor,
        *,
        features: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        masks: dict | None = None,
        backend: str | None = None,
        block_len: int | None = None,
    ) -> torch.Tensor:
        """Training forward over many blocks per row.

        block_embeds [B, A*bs, H] (block i = anchor i); anchors/anchor_valid [B, A];
        document_ids [B, T]; exactly one of features [B, T, K*H] (raw) or context
        [B, T, H] (already fused). Returns the final-normed hidden [B, A*bs, H].
        backend: "sdpa" (dense bool mask) | "flex" (BlockMask); default flex on CUDA.
        block_len: blocks shorter than block_size (bs = block_len): what an engine serving k draft
        tokens feeds, [token, MASK x k] (vLLM's DFlash), for replay at that k.
        """
        if (features is None) == (context is None):
            raise ValueError("pass exactly one of features= or context=")
        if context is None:
            context = self.fuse_context(features)
        B, T, _ = context.shape
        bs = block_len or self.cfg.block_size
        A = anchors.shape[1]
        if block_embeds.shape[1] != A * bs:
            raise ValueError(f"block_embeds has {block_embeds.shape[1]} tokens, expected A*bs = {A * bs}")
        if masks is None:
            masks = self.build_masks(anchors, anchor_valid, document_ids, backend, bs)

        dtype = block_embeds.dtype
        q_pos = (anchors[:, :, None] + torch.arange(bs, device=anchors.device)).reshape(B, A * bs)
        ctx_pos = torch.arange(T, device=anchors.device).expand(B, T)
        q_rope = self.rotary(q_pos, dtype)
        ctx_rope = self.rotary(ctx_pos, context.dtype)

        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        x = block_embeds
        for layer in self.layers:
            args = (layer, x, context, ctx_rope, q_rope, masks[layer.layer_type])
            x = checkpoint(self.layer_step, *args, use_reentrant=False) if recompute else self.layer_step(*args)
        return self.norm(x)

    # ------------------------------------------------------------------ inference

    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers))

    @torch.no_grad()
    def extend_context(self, cache: DrafterCache, features_new: torch.Tensor, start_position: int) -> None:
        """Append context positions start..start+n-1 (features [B, n, K*H]); a start below the
        cache length first crops the cache (the old tail was a rejected draft's context)."""
        start = int(start_position)
        if start > cache.length:
            raise ValueError(f"context gap: cache holds {cache.length} positions, extend starts at {start}")
        if start < cache.length:
            cache.crop(start)
        ctx = self.fuse_context(features_new.to(self._dtype()))
        B, n, _ = ctx.shape
        pos = torch.arange(start, start + n, device=ctx.device).expand(B, n)
        rope = self.rotary(pos, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.kv(ctx, *rope)
            cache.k[i] = k if cache.k[i] is None else torch.cat([cache.k[i], k], dim=2)
            cache.v[i] = v if cache.v[i] is None else torch.cat([cache.v[i], v], dim=2)
        cache.length = start + n

    @torch.no_grad()
    def draft_block(self, cache: DrafterCache, block_embeds: torch.Tensor, anchor_position: int) -> torch.Tensor:
        """One block at positions anchor..anchor+bs-1 -> final-normed hidden [B, bs, H].

        Sees cached context positions < anchor and its own block; the mask comes
        from the same `dflash_mask_mod` as training (one anchor, one document).
        block_embeds = target.embed([token at anchor, MASK x (bs-1)]); then
        target.logits(hidden[:, 1:]) are the drafts for positions anchor+1..anchor+bs-1.
        A block shorter than bs (end of generation) is fine.
        """
        a = int(anchor_position)
        if a > cache.length:
            raise ValueError(f"anchor {a} beyond the cached context ({cache.length} positions)")
        B, n, _ = block_embeds.shape
        dev = block_embeds.device
        anchors = torch.full((B, 1), a, dtype=torch.long, device=dev)
        valid = torch.ones(B, 1, dtype=torch.bool, device=dev)
        docs = torch.zeros(B, a, dtype=torch.long, device=dev)
        masks = {}
        for lt in dict.fromkeys(self.cfg.layer_types):
            mod = M.dflash_mask_mod(anchors, valid, docs, n, lt, self.cfg.sliding_window, a)
            masks[lt] = M.dense_mask(mod, B, n, a + n, device=dev)
        pos = torch.arange(a, a + n, device=dev).expand(B, n)
        rope = self.rotary(pos, block_embeds.dtype)
        x = block_embeds.to(self._dtype())
        for i, layer in enumerate(self.layers):
            if cache.k[i] is None:
                empty = x.new_zeros(B, layer.self_attn.nkv, 0, layer.self_attn.d)
                ctx_kv = (empty, empty)
            else:
                ctx_kv = (cache.k[i][:, :, :a], cache.v[i][:, :, :a])
            x = layer(x, rope, rope, ctx_kv, masks[layer.layer_type])
        return self.norm(x)
