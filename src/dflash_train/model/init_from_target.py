"""Initialise drafter layers from target decoder layers (model.init_from_target_layers).

The drafter has the target's width, so a target layer's attention, MLP and norms fit a drafter
layer as they are. What does not carry over: `fc` / `hidden_norm` (no target counterpart, they
stay random) and the per-head q/k RMSNorms of the drafter's Qwen3 layout, which Llama-style
targets lack. Targets with q/k norms (Qwen3) give theirs; for the others `qk_norm` picks:

* ``ones``: the norms' weights stay 1: every head's q and k have RMS 1, so attention logits are
  at most sqrt(head_dim) and the copied projections' scale is lost;
* ``match``: the weights are set to the projection's expected per-head RMS on unit-RMS inputs
  (sqrt(mean_c sum_j (W[c, j] * g_j)^2), g = the layer's input_layernorm weight): data-free, the
  target's attention-logit scale is kept as far as its inputs are normalised.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

_COPIED = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


class InitFromTargetError(ValueError):
    """The target's layers cannot initialise this drafter; the message names the key."""


def _expected_head_rms(proj: torch.Tensor, norm_weight: torch.Tensor) -> float:
    w = proj.float() * norm_weight.float()[None, :]
    return float(w.pow(2).sum(1).mean().sqrt())


@torch.no_grad()
def init_layers_from_target(drafter: nn.Module, target_layers: Sequence[nn.Module], layer_ids: Sequence[int],
                            qk_norm: str = "ones") -> list[str]:
    """Copy target layer `layer_ids[i]` into drafter layer i (one id for all layers when given one).
    Returns one line per drafter layer saying what it got (for the run log)."""
    key = "model.init_from_target_layers"
    ids = list(layer_ids) * (len(drafter.layers) if len(layer_ids) == 1 else 1)
    if len(ids) != len(drafter.layers):
        raise InitFromTargetError(f"{key}={list(layer_ids)}: give 1 id or one per drafter layer "
                                  f"({len(drafter.layers)})")
    bad = [i for i in ids if not 0 <= i < len(target_layers)]
    if bad:
        raise InitFromTargetError(f"{key}={list(layer_ids)}: {bad} out of range for a target with "
                                  f"{len(target_layers)} layers (valid ids 0..{len(target_layers) - 1})")
    report = []
    for d_layer, t_id in zip(drafter.layers, ids):
        t_layer = target_layers[t_id]
        t_state = t_layer.state_dict()
        if any(n.endswith("feedforward_layernorm.weight") for n in t_state):
            # Gemma: four norms per layer, (1 + w) norm weights, no place for them in this layout
            raise InitFromTargetError(f"{key}: target layer {t_id} has a Gemma-style layout (pre/post feedforward "
                                      "norms); only Llama / Qwen-style layers can initialise the drafter")
        if any(n.endswith("_proj.bias") for n in t_state):
            raise InitFromTargetError(f"{key}: target layer {t_id} has projection biases; the drafter's "
                                      "projections have none")
        d_state = d_layer.state_dict()
        for name in _COPIED:
            if name not in t_state:
                raise InitFromTargetError(f"{key}: target layer {t_id} has no {name}")
            if t_state[name].shape != d_state[name].shape:
                raise InitFromTargetError(f"{key}: target layer {t_id}'s {name} is {tuple(t_state[name].shape)}, "
                                          f"the drafter's {tuple(d_state[name].shape)} (leave model sizes unset "
                                          "to take the target's)")
            d_state[name].copy_(t_state[name])
        attn = d_layer.self_attn
        if "self_attn.q_norm.weight" in t_state:
            attn.q_norm.weight.copy_(t_state["self_attn.q_norm.weight"])
            attn.k_norm.weight.copy_(t_state["self_attn.k_norm.weight"])
            how = "target's q/k norms"
        elif qk_norm == "match":
            g = t_state["input_layernorm.weight"]
            for norm, proj in ((attn.q_norm, t_state["self_attn.q_proj.weight"]),
                               (attn.k_norm, t_state["self_attn.k_proj.weight"])):
                norm.weight.fill_(_expected_head_rms(proj, g))
            how = f"q/k norms matched ({float(attn.q_norm.weight[0]):.2f}, {float(attn.k_norm.weight[0]):.2f})"
        else:
            attn.q_norm.weight.fill_(1.0)
            attn.k_norm.weight.fill_(1.0)
            how = "q/k norms 1"
        report.append(f"target layer {t_id} ({how})")
    return report


def init_from_target(drafter: nn.Module, target, model_cfg) -> list[str]:
    """model.init_from_target_layers: copy target layers into a fresh drafter (a resume then loads the
    checkpoint over them); the names of what was copied. InitFromTargetError when it cannot be done."""
    layers = getattr(target, "layers", None)  # a head-only target (embedding + lm_head) has none
    if layers is None:
        raise InitFromTargetError("model.init_from_target_layers needs the target's decoder layers on the trainer; "
                                  "this trainer rank holds the embedding and lm_head only (pipeline.layout=split)")
    return init_layers_from_target(drafter, layers, model_cfg.init_from_target_layers, model_cfg.init_qk_norm)
