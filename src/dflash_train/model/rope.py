"""RoPE of the drafter: taken from the target, computed like transformers, served like it was trained.

The drafter's positions are the target's positions, so it uses the target's
RoPE settings (``rope_parameters``: ``rope_type``, ``rope_theta`` and the
scaling keys of that type) and exports exactly what it trained with. SGLang
(``get_rope`` with ``rope_theta`` / ``rope_scaling``) and vLLM (``get_rope``
with ``rope_parameters``) rebuild it from the exported config.json.

`select_rope(hf_config)` picks the settings from a target's (text) config:

* per-layer-type tables (Gemma 3/4: ``{"full_attention": {...},
  "sliding_attention": {...}}``): the ``full_attention`` entry (the drafter's
  layers see the whole context; the engines apply one RoPE to all draft layers);
* types whose frequencies do not depend on the sequence length
  (``default``, ``linear``, ``llama3``, ``yarn``) are kept with their keys;
  others (``dynamic``, ``longrope``, ``proportional``, M-RoPE sections) become
  ``default`` with the target's ``rope_theta`` and the reason is returned, so
  the drafter trains and exports one plain, well-defined RoPE.

`inv_freq_and_scale(rope, head_dim, max_pos)` computes the inverse frequencies
and the attention scaling (yarn's mscale; 1.0 otherwise) with transformers'
own ``ROPE_INIT_FUNCTIONS``, so the reference package (which builds
``Qwen3RotaryEmbedding`` from the exported config) computes the same numbers.
"""
from __future__ import annotations

from typing import Any

import torch

SUPPORTED_TYPES = ("default", "linear", "llama3", "yarn")
# keys each kept type needs (besides rope_type / rope_theta)
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
}
DEFAULT_THETA = 1_000_000.0


def default_rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": float(theta)}


def _theta_of(d: dict[str, Any] | None, hf_config) -> float | None:
    if d and d.get("rope_theta") is not None:
        return float(d["rope_theta"])
    v = getattr(hf_config, "rope_theta", None)
    return float(v) if isinstance(v, (int, float)) else None


def select_rope(hf_config) -> tuple[dict[str, Any], str | None]:
    """(rope_parameters for the drafter, note or None) from a target's text config."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = getattr(hf_config, "rope_scaling", None)
        params = dict(params) if isinstance(params, dict) else {}
    if params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    params = dict(params)
    theta = _theta_of(params, hf_config) or DEFAULT_THETA
    rtype = params.get("rope_type") or params.get("type") or "default"
    note = None
    if rtype not in SUPPORTED_TYPES:
        note = f"target RoPE type {rtype!r} is not one the drafter can train and export; using default RoPE, theta {theta:g}"
        return default_rope(theta), note
    if params.get("mrope_section") is not None or params.get("mrope_interleaved"):
        note = "target uses M-RoPE (text positions equal on all sections = plain RoPE); the drafter uses default RoPE"
    if float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        note = (f"target rotates part of each head (partial_rotary_factor {params['partial_rotary_factor']}); "
                "the drafter rotates whole heads")
    out = {"rope_type": rtype, "rope_theta": theta}
    for k in _KEYS[rtype]:
        if params.get(k) is not None:
            out[k] = params[k]
    if rtype == "linear" and "factor" not in out:
        return default_rope(theta), note
    return out, note


def inv_freq_and_scale(rope: dict[str, Any], head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """float32 inverse frequencies [head_dim / 2] and the cos/sin scale of `rope`."""
    rtype = rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta", DEFAULT_THETA))
    if rtype == "default":
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported drafter rope_type {rtype!r}; use one of {SUPPORTED_TYPES}")
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = Qwen3Config(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                      max_position_embeddings=int(max_position_embeddings), rope_parameters=dict(rope))
    inv, scale = ROPE_INIT_FUNCTIONS[rtype](cfg, torch.device("cpu"))
    return inv.float(), float(scale)
