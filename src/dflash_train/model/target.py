"""The Target interface: what the drafter's side reads of the frozen target LLM, declared once.

`targets.model.Target` (a whole HF model), the head-only target of trainer ranks
(targets/head_only.py) and a tensor-parallel group's target implement it; so does the tests'
`FakeTarget` (tests/test_model_fakes.py). Three layers, each adding to the one before:

* `TargetHead`: embedding, lm_head (+ output multiplier and soft-cap) and the sizes a
  `DrafterConfig` is derived from: what training's loss and a trainer rank need;
* `CapturingTarget`: + `capture` (the selected layers' outputs of packed rows): what replay and
  on-policy anchors need;
* `DecodingTarget`: + the HF model, its decoder, `inference_logits`, the tokenizer and chat
  family: what real decoding (eval/decoding.py) and the eval prompts need.

Structural (`typing.Protocol`): an implementation need not inherit from these;
`isinstance(x, DecodingTarget)` checks that the names are there (runtime_checkable).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class TargetHead(Protocol):
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    num_layers: int
    hf_config: Any  # the text config (heads, head_dim, intermediate size, RoPE, context length)
    embed_scale: float  # Gemma's sqrt(H); 1.0 elsewhere (embed applies it)
    output_multiplier: float  # logits = lm_head(h) * output_multiplier (then soft-cap)
    final_logit_softcapping: float | None
    serving_dtype: str | None  # the dtype engines serve the target in; None = `dtype`

    @property
    def mask_token_id(self) -> int: ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's own input embedding (its scale included)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(hidden) * output_multiplier, soft-capped; differentiable in `hidden`."""
        ...


@runtime_checkable
class CapturingTarget(TargetHead, Protocol):
    def capture(self, input_ids: torch.Tensor, document_ids: torch.Tensor,
                layer_ids: Sequence[int]) -> torch.Tensor:
        """[B, T, K*H]: the outputs of layers `layer_ids` (HF hidden_states[i + 1]) of packed rows."""
        ...


@runtime_checkable
class DecodingTarget(CapturingTarget, Protocol):
    model: Any  # the HF causal LM (its config builds the KV cache)
    decoder: Any  # its decoder: last_hidden_state (final-normed) + hidden_states, with a KV cache
    tokenizer: Any
    family: str | None  # the chat format's family (data/template.py)

    def inference_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` for decoding (no autograd), each row independent of the row count."""
        ...
