"""The drafter's configuration: `DrafterConfig` (what the drafter computes and how it is served),
derived from a run's `ModelConfig` and its target (`from_target`), the method's default target
layers, and the four DFlash 2 sizes named once (`DFLASH2_KEYS`). Its serving form, config.json,
is `model/hf_config.py`."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

from dflash_train.model import masks as M
from dflash_train.model import rope as R
from dflash_train.model.lookup import BLOCK_SEEDS
from dflash_train.model.target import TargetHead


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The method's rule: one draft layer -> [L // 2]; else N evenly spaced from 1 to L-3, rounded."""
    L, N = int(num_target_layers), int(num_draft_layers)
    if N == 1:
        return [L // 2]
    start, end = 1, L - 3
    span = end - start
    # python round (banker's) on purpose: the reference build_target_layer_ids uses it
    return [round(start + (i * span) / (N - 1)) for i in range(N)]


# DrafterConfig fields that describe how the drafter is served, not what it computes in training:
# a resume may see them change (e.g. the target re-saved in another dtype)
SERVING_ONLY_FIELDS = ("serving_dtype", "max_position_embeddings")

# THE four DFlash 2 sizes, named as the reference DFlash2DraftModel names them (config.json's
# dflash_config, DrafterConfig, ModelConfig), and their values when not given: two taps,
# 16-channel groups, rank 256 over the top 16, as the published DFlash 2 checkpoints
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_DEFAULTS = (2, 16, 256, 16)


@dataclass
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: list[str]
    sliding_window: int | None
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    vocab_size: int = 0
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    init_std: float = 0.02
    # the RoPE the drafter trains with and exports (model/rope.py); None = default RoPE at rope_theta
    rope_parameters: dict[str, Any] | None = None
    # the dtype the engines serve the drafter in = the target's own dtype on disk (export writes it)
    serving_dtype: str = "float32"
    # "dflash" | "dflash2" (model/dflash2.py); the four DFlash 2 keys are None for "dflash"
    architecture: str = "dflash"
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # what fills the block's masked slots before the drafter denoises them: "none" (masks only,
    # the method) or "prompt_lookup" (the n-gram proposal where there is one, model/lookup.py)
    block_seeds: str = "none"
    # train.vocab_subset's size for a "dflash" drafter: it drafts over those target ids only (the
    # drafter's `draft_vocab` buffer; exported as draft_vocab_size + d2t + its lm_head rows,
    # which vLLM reads); 0 = the target's whole vocabulary
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        self._check_architecture()
        if self.block_seeds not in BLOCK_SEEDS:
            raise ValueError(f"block_seeds {self.block_seeds!r} is not one of {', '.join(BLOCK_SEEDS)}")
        if self.rope_parameters is None:
            self.rope_parameters = R.default_rope(self.rope_theta)
        # sorted keys: the same dict whether built here or read back from a manifest (compared as JSON)
        self.rope_parameters = dict(sorted(self.rope_parameters.items()))
        self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
        if self.rope_parameters.get("rope_type", "default") not in R.SUPPORTED_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_parameters.get('rope_type')!r}")
        if self.serving_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"serving_dtype {self.serving_dtype!r} is not float32, bfloat16 or float16")
        if len(self.layer_types) == 1 and self.num_layers > 1:
            self.layer_types = list(self.layer_types) * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for lt in self.layer_types:
            if lt not in (M.FULL, M.SLIDING):
                raise ValueError(f"unknown layer type {lt!r}")
        if M.SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")
        if self.draft_vocab_size < 0 or (self.vocab_size and self.draft_vocab_size > self.vocab_size):
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} outside 0..{self.vocab_size}")
        if self.draft_vocab_size and self.architecture != "dflash":
            raise ValueError("draft_vocab_size applies to architecture dflash only")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside 0..{self.num_target_layers - 1}")

    def served_block_len(self, k: int | None) -> int | None:
        """The block an engine builds to draft k tokens: [token, MASK x k] (vLLM's DFlash proposer
        queries 1 + num_speculative_tokens positions), so k + 1 when k < block_size - 1; None: the
        whole block. Attention inside a block is bidirectional, so the masks past k change the
        first k drafts, a deeper drafter's by much (2 layers, HumanEval at k 3: 1.50 from the whole
        block, 1.32 in vLLM). DFlash 2's convolution runs over whole blocks: it keeps them."""
        if k is None or k + 1 >= int(self.block_size) or self.architecture != "dflash":
            return None
        return int(k) + 1

    def _check_architecture(self) -> None:
        if self.architecture == "dflash":
            set_keys = [k for k in DFLASH2_KEYS if getattr(self, k) is not None]
            if set_keys:
                raise ValueError(f"{', '.join(set_keys)} apply to architecture dflash2 only")
        elif self.architecture == "dflash2":
            for k, default in zip(DFLASH2_KEYS, DFLASH2_DEFAULTS):
                if getattr(self, k) is None:
                    setattr(self, k, default)
                if int(getattr(self, k)) < 1:
                    raise ValueError(f"{k} must be >= 1")
            if self.hidden_size % self.conv_group_size:
                raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of conv_group_size {self.conv_group_size}")
            if self.vocab_size and self.selector_top_k > self.vocab_size:
                raise ValueError(f"selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}")
        else:
            raise ValueError(f"unknown architecture {self.architecture!r}: dflash or dflash2")

    @property
    def num_context_layers(self) -> int:
        return len(self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown DrafterConfig keys: {sorted(unknown)}")
        return cls(**{k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()})

    @classmethod
    def from_target(cls, model_cfg, target: TargetHead) -> "DrafterConfig":
        """ModelConfig + a target (model/target.py `TargetHead`); None sizes -> the target's."""
        hf = target.hf_config
        H = int(target.hidden_size)
        num_heads = model_cfg.num_heads or int(getattr(hf, "num_attention_heads"))
        num_kv = model_cfg.num_kv_heads or int(getattr(hf, "num_key_value_heads", None) or num_heads)
        head_dim = model_cfg.head_dim or getattr(hf, "head_dim", None) or H // num_heads
        inter = model_cfg.intermediate_size or int(getattr(hf, "intermediate_size"))
        layer_ids = model_cfg.target_layer_ids
        if layer_ids is None:
            layer_ids = default_target_layer_ids(target.num_layers, model_cfg.num_layers)
        mask_id = model_cfg.mask_token_id if model_cfg.mask_token_id is not None else target.mask_token_id
        if mask_id is None:
            raise ValueError("no mask_token_id: set model.mask_token_id or use a target that defines one")
        softcap = target.final_logit_softcapping
        hf_max = getattr(hf, "max_position_embeddings", None)
        max_pos = model_cfg.max_position_embeddings or (int(hf_max) if isinstance(hf_max, int) else 32768)
        if model_cfg.rope_theta is not None:  # an explicit choice: plain RoPE at that theta
            rope = R.default_rope(model_cfg.rope_theta)
        else:
            rope, note = R.select_rope(hf)
            if note:
                logging.getLogger(__name__).warning("drafter RoPE: %s", note)
        serving = target.serving_dtype or str(target.dtype).replace("torch.", "")
        return cls(
            architecture=model_cfg.architecture,
            **{k: getattr(model_cfg, k) for k in DFLASH2_KEYS},
            hidden_size=H,
            num_layers=model_cfg.num_layers,
            num_heads=int(num_heads),
            num_kv_heads=int(num_kv),
            head_dim=int(head_dim),
            intermediate_size=int(inter),
            layer_types=model_cfg.resolved_layer_types(),
            sliding_window=model_cfg.sliding_window,
            block_size=model_cfg.block_size,
            mask_token_id=int(mask_id),
            target_layer_ids=list(layer_ids),
            num_target_layers=int(target.num_layers),
            rms_norm_eps=model_cfg.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            rope_parameters=rope,
            max_position_embeddings=int(max_pos),
            serving_dtype=serving,
            vocab_size=int(target.vocab_size),
            input_embedding_scale=float(target.embed_scale),
            output_multiplier=float(target.output_multiplier),
            final_logit_softcapping=None if softcap is None else float(softcap),
            init_std=model_cfg.init_std,
            block_seeds=model_cfg.block_seeds,
        )
