"""The frozen target model wrapper: embedding, logits, layer capture, the mask token.
Loading lives in `dflash_train.targets.loading` (the GGUF cache in `targets.gguf`).

The mask token (`Target.mask_token_id`): the rule of `targets.mask_token`.

Capture (`Target.capture`): packed rows hold several documents. Every
document gets position ids restarting at 0 and a block-diagonal causal mask
(per attention type: sliding-window layers get the window too), given to the
model as explicit 4-D masks, so each document's features equal running that
document alone. Padding (document id -1) attends only to itself and its
features are zero. Forward hooks on the selected decoder layers record their
OUTPUT (HF ``hidden_states[i + 1]``; for the LAST layer HF applies the final
norm to ``hidden_states[L]``, capture returns the raw layer output); the hook
of the deepest selected layer raises a private exception that ends the
forward there, so later layers, the final norm and the lm_head never run.
The hooks are registered once and act only inside a capture call of the
same thread: several worker threads may capture concurrently.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from dflash_train.config import ConfigError
from dflash_train.targets.mask_token import choose_mask_token_id

log = logging.getLogger(__name__)


class TargetError(ConfigError):
    """A target that cannot be loaded or used as asked (a user-fixable problem)."""


FAMILY_BY_MODEL_TYPE = {"gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3": "qwen3", "llama": "llama"}
# attention layer types capture builds 4-D block-diagonal masks for; any other (linear_attention,
# mamba, ...) makes capture run each document alone (Target.per_document_capture)
_MASKABLE_LAYER_TYPES = {"full_attention", "sliding_attention"}


class _StopForward(Exception):
    pass


# --------------------------------------------------------------------------- masks


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at 0 at every change of document id (padding runs too)."""
    B, T = document_ids.shape
    idx = torch.arange(T, device=document_ids.device).expand(B, T)
    start = torch.ones_like(document_ids, dtype=torch.bool)
    start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def document_attention_mask(document_ids: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """[B, 1, T, T] bool, True = may attend: causal, same document, inside the
    sliding window when given (q - k < window, as HF counts it); padding (-1)
    attends only to itself so no row is empty."""
    B, T = document_ids.shape
    d = document_ids
    q = torch.arange(T, device=d.device)
    causal = q[None, :] <= q[:, None]  # [T(q), T(k)]
    if sliding_window is not None:
        causal = causal & (q[:, None] - q[None, :] < sliding_window)
    same = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    allowed = same & causal[None]
    eye = torch.eye(T, dtype=torch.bool, device=d.device)[None]
    allowed = allowed | (eye & (d[:, :, None] < 0))
    return allowed[:, None]


# --------------------------------------------------------------------------- target


class Target:
    """A frozen causal LM with the interface the drafter's side reads (model/target.py
    `DecodingTarget`, declared there)."""

    def __init__(self, model, tokenizer, family: str | None = None, source: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        cfg = model.config
        self.hf_config = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        hc = self.hf_config
        self.family = family or FAMILY_BY_MODEL_TYPE.get(hc.model_type, hc.model_type)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_layers = int(hc.num_hidden_layers)
        self.hidden_size = int(hc.hidden_size)
        emb = model.get_input_embeddings()
        self.vocab_size = int(emb.weight.shape[0])
        if hasattr(emb, "scalar_embed_scale"):
            self.embed_scale = float(emb.scalar_embed_scale)
        elif isinstance(getattr(emb, "embed_scale", None), (int, float, torch.Tensor)):
            self.embed_scale = float(emb.embed_scale)
        else:
            self.embed_scale = 1.0
        mult = 1.0
        if getattr(hc, "logit_scale", None):  # Cohere-style: logits * scale
            mult *= float(hc.logit_scale)
        if getattr(hc, "logits_scaling", None):  # Granite-style: logits / scaling
            mult /= float(hc.logits_scaling)
        self.output_multiplier = mult
        cap = getattr(hc, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap else None
        self._mask_token_id = choose_mask_token_id(tokenizer, self.vocab_size) if tokenizer is not None else None
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = self.decoder.layers
        self.layer_types = list(getattr(hc, "layer_types", None) or [])
        self.sliding_window = getattr(hc, "sliding_window", None)
        # the dtype engines serve this target in (its config.json's dtype; set by load_target),
        # what the drafter's export is stored in; None = the dtype it runs in here
        self.serving_dtype: str | None = None
        self._tls = threading.local()
        self._hook_lock = threading.Lock()
        self._hooked = False

    # ------------------------------------------------------------------ basics

    @property
    def mask_token_id(self) -> int:
        if self._mask_token_id is None:
            raise TargetError(
                f"no mask token found for target {self.source or self.family} (no mask/unused/reserved token, "
                "no spare embedding row); set model.mask_token_id"
            )
        return self._mask_token_id

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Exactly the target's own input embedding (Gemma's sqrt(H) scale included)."""
        with torch.no_grad():
            return self.model.get_input_embeddings()(ids.to(self.device))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden) * output_multiplier, then tanh soft-capping when the target has it.
        Differentiable with respect to `hidden` (the weight is frozen)."""
        return self._finish_logits(F.linear(hidden, self.lm_head_weight))

    def _finish_logits(self, out: torch.Tensor) -> torch.Tensor:
        if self.output_multiplier != 1.0:
            out = out * self.output_multiplier
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            out = torch.tanh(out / c) * c
        return out

    # ------------------------------------------------------------------ decoding (inference only)

    def inference_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` for decoding (no autograd): the lm_head of a few rows (a verify block, a
        draft block, one plain token) at the cost of ONE pass over the weight.

        On CPU in float32, MKL's sgemm with a handful of rows and Gemma's 262K-row
        lm_head runs 3-5x slower than one pass over the weight (8 rows: ~4x the time
        of 1 row), so the head runs as a oneDNN matmul on a copy of the weight
        pre-packed once for small batches (``torch.ops.mkldnn``; +1 weight copy in
        memory while the target decodes, ~671 MB for Gemma 3 270M; see
        `release_inference_cache`). Each row's logits are then bitwise the same
        whatever the number of rows (1 for plain decoding, 8 for a verify block),
        and differ from `logits` by float rounding only (~1e-6 relative).
        Elsewhere (CUDA, bf16, no oneDNN, ``DFLASH_TRAIN_PACKED_LM_HEAD=0``) it is
        exactly `logits`.
        """
        packed = self._packed_lm_head(hidden)
        if packed is None:
            return self.logits(hidden)
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
        return self._finish_logits(out.view(*shape[:-1], out.shape[-1]))

    _PACK_BATCH = 8  # oneDNN packing hint: small batches (1..16 rows run at ~one weight pass)

    def _packed_lm_head(self, hidden: torch.Tensor):
        """The oneDNN-packed lm_head weight, (re)built when the weight changed; None when not applicable."""
        w = self.lm_head_weight
        if (hidden.device.type != "cpu" or w.device.type != "cpu" or w.dtype != torch.float32
                or hidden.dtype != torch.float32 or (hidden.requires_grad and torch.is_grad_enabled())):
            return None
        state = getattr(self, "_packed_head", None)
        if state == "off":
            return None
        key = (w.data_ptr(), w._version, tuple(w.shape))
        if state is not None and state[0] == key:
            return state[1]
        if state is None and (os.environ.get("DFLASH_TRAIN_PACKED_LM_HEAD", "1") in ("0", "false", "no")
                              or not torch.backends.mkldnn.is_available()
                              or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
            self._packed_head = "off"
            return None
        self._packed_head = None  # drop a stale copy before building the new one
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self._PACK_BATCH)
                probe = hidden.detach().reshape(-1, hidden.shape[-1])[:1].contiguous()
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
                want = F.linear(probe, w)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()) + 1e-6):
                raise RuntimeError(f"packed lm_head differs from F.linear by {float((got - want).abs().max()):.3g}")
        except Exception as e:  # noqa: BLE001 - any failure: the plain F.linear head
            log.warning("packed lm_head unavailable, using F.linear: %s", e)
            self._packed_head = "off"
            return None
        self._packed_head = (key, packed)
        return packed

    @contextlib.contextmanager
    def packed_head_for_generate(self):
        """Inside: the HF model's own `generate` runs its lm_head as the packed matmul of
        `inference_logits` (same logits up to float rounding; regeneration at batch 16
        ran ~5x faster here, bench/regen_speed.py). Outside, or where packing does not
        apply, the model is untouched."""
        model = self.model
        head = model.get_output_embeddings()
        probe = torch.zeros(1, head.weight.shape[1], dtype=head.weight.dtype, device=head.weight.device)
        if self._packed_lm_head(probe) is None or getattr(head, "bias", None) is not None:
            yield
            return
        target = self

        class _PackedHead(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.weight = head.weight  # what get_output_embeddings() callers read

            def forward(self, hidden: torch.Tensor) -> torch.Tensor:
                packed = target._packed_lm_head(hidden)
                if packed is None:
                    return F.linear(hidden, self.weight)
                flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
                out = torch.ops.mkldnn._linear_pointwise(flat, packed, None, "none", [], "")
                return out.view(*hidden.shape[:-1], out.shape[-1])

        model.set_output_embeddings(_PackedHead())
        try:
            yield
        finally:
            model.set_output_embeddings(head)

    def release_inference_cache(self) -> None:
        """Free the packed lm_head copy (it is rebuilt on the next `inference_logits`)."""
        if getattr(self, "_packed_head", None) != "off":
            self._packed_head = None

    # ------------------------------------------------------------------ capture

    def _ensure_hooks(self) -> None:
        """One permanent forward hook per decoder layer; it acts only inside a
        capture call of the SAME thread (thread-local state), so concurrent
        captures from several worker threads and plain model use (generation,
        eval) are unaffected."""
        if getattr(self, "_hooked", False):
            return
        with self._hook_lock:
            if getattr(self, "_hooked", False):
                return

            def make_hook(i: int):
                def hook(_mod, _inp, out):
                    active = getattr(self._tls, "active", None)
                    if active is None:
                        return None
                    wanted, last, store = active
                    if i in wanted:
                        store[i] = out[0] if isinstance(out, (tuple, list)) else out
                    if i == last:
                        raise _StopForward
                    return None

                return hook

            self._hook_handles = [layer.register_forward_hook(make_hook(i)) for i, layer in enumerate(self.layers)]
            self._hooked = True

    def remove_hooks(self) -> None:
        for h in getattr(self, "_hook_handles", []):
            h.remove()
        self._hook_handles, self._hooked = [], False

    def _masks(self, document_ids: torch.Tensor) -> Any:
        impl = getattr(self.model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise TargetError(f"capture needs the sdpa or eager attention implementation, not {impl!r}")

        def convert(m: torch.Tensor) -> torch.Tensor:
            if impl == "sdpa":
                return m
            return torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill(~m, torch.finfo(self.dtype).min)

        types = set(self.layer_types)
        unknown = types - _MASKABLE_LAYER_TYPES
        if unknown:
            raise TargetError(f"capture does not know the attention layer types {sorted(unknown)} of this target")
        if types:
            masks = {}
            for t in types:
                win = self.sliding_window if t == "sliding_attention" else None
                masks[t] = convert(document_attention_mask(document_ids, win))
            if len(masks) == 1:
                return next(iter(masks.values()))
            return masks
        win = None
        if self.sliding_window and getattr(self.hf_config, "use_sliding_window", True):
            win = self.sliding_window
        return convert(document_attention_mask(document_ids, win))

    def capture(self, input_ids: torch.Tensor, document_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
        """[B, T, K*H]: the OUTPUT of each layer in `layer_ids` (HF hidden_states[i+1]),
        concatenated in the given order; each document computed as if alone;
        padding positions (document id -1) are zero. A normal (non-inference)
        tensor in the target's dtype on the target's device. Layer id `num_layers`
        is the final hidden state (after the final norm: what the lm_head reads,
        `logits(it)` = the model's logits); asking for it runs the whole forward."""
        layer_ids = [int(i) for i in layer_ids]
        if not layer_ids:
            raise ValueError("capture needs at least one layer id")
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise TargetError(f"target layer ids {bad} out of range for a {self.num_layers}-layer target")
        if input_ids.shape != document_ids.shape or input_ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and document_ids {tuple(document_ids.shape)} must both be [B, T]")
        ids = input_ids.to(self.device, torch.long)
        doc = document_ids.to(self.device, torch.long)
        if self.per_document_capture:
            feats = self._capture_per_document(ids, doc, layer_ids)
        else:
            with torch.inference_mode():
                store = self._forward_to(ids, self._masks(doc), document_positions(doc), layer_ids)
            # outside inference mode: the result is a normal tensor usable in autograd graphs
            feats = torch.cat([store[i] for i in layer_ids], dim=-1)
        pad = (doc < 0).unsqueeze(-1)
        if bool(pad.any()):
            feats = feats.masked_fill(pad, 0)
        return feats

    def _forward_to(self, ids, mask, pos, layer_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """One decoder forward that stops after the deepest of `layer_ids`; their outputs by layer id."""
        wanted = set(layer_ids)
        store: dict[int, torch.Tensor] = {}
        self._ensure_hooks()
        # the final hidden state (id num_layers) is the decoder's output: no early stop then
        self._tls.active = (wanted, max(wanted), store)
        try:
            try:
                out = self.decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
                if self.num_layers in wanted:
                    store[self.num_layers] = out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state
            except _StopForward:
                pass
        finally:
            self._tls.active = None
        if set(store) != wanted:
            raise RuntimeError(f"capture: hooks fired for layers {sorted(store)}, expected {sorted(wanted)}")
        return store

    @property
    def per_document_capture(self) -> bool:
        """True when some layers cannot take the block-diagonal 4-D mask (linear attention, state-space
        layers: they run over the whole row and ignore it): each packed document is then captured
        in its own forward, which is by construction that document run alone."""
        return bool(set(self.layer_types) - _MASKABLE_LAYER_TYPES)

    def _capture_per_document(self, ids, doc, layer_ids: Sequence[int]) -> torch.Tensor:
        if not getattr(self, "_per_document_logged", False):
            self._per_document_logged = True
            log.info("target %s has %s layers, which ignore 4-D attention masks: each packed document is "
                     "captured in its own forward (its features equal running it alone)",
                     self.source or self.family, sorted(set(self.layer_types) - _MASKABLE_LAYER_TYPES))
        B, T = ids.shape
        feats = None
        rows = doc.tolist()
        with torch.inference_mode():
            for r in range(B):
                s = 0
                while s < T:
                    e = s
                    while e < T and rows[r][e] == rows[r][s]:
                        e += 1
                    if rows[r][s] >= 0:
                        store = self._forward_to(ids[r:r + 1, s:e], None,
                                                 torch.arange(e - s, device=ids.device)[None], layer_ids)
                        part = torch.cat([store[i] for i in layer_ids], dim=-1)[0]
                        if feats is None:
                            feats = torch.zeros(B, T, part.shape[-1], dtype=part.dtype, device=part.device)
                        feats[r, s:e] = part
                    s = e
        if feats is None:  # only padding
            feats = torch.zeros(B, T, len(layer_ids) * self.hidden_size, dtype=self.dtype, device=self.device)
        return feats.clone()

    def __repr__(self) -> str:
        return (f"Target(family={self.family}, layers={self.num_layers}, hidden={self.hidden_size}, "
                f"vocab={self.vocab_size}, dtype={self.dtype}, device={self.device}, source={self.source!r})")


# --------------------------------------------------------------------------- loading

