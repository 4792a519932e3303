"""The sections of a run's config that say how it runs: train (length, optimiser, objective,
device), pipeline (the target / trainer layout), checkpoint, eval, logging and demo; and `Section`,
the strict base of every section. `config.py` composes them with the model, target and data
sections into `RunConfig` and loads it (YAML + overrides, ConfigError naming the key).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DEFAULT_MAX_STEPS = 200


class TrainConfig(Section):
    # how long, one of the two: max_steps optimizer steps, or epochs passes over the training rows
    # (steps = ceil(epochs * rows / global batch), worked out and logged at start-up: train/schedule.py;
    # a float, so a large data set can be trained for half an epoch). Neither: max_steps 200
    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    lr: float = Field(6e-4, gt=0, le=1.0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_fraction: float = Field(0.04, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, gt=0)
    grad_accum: int = Field(1, ge=1)
    batch_size: int = Field(2, ge=1)
    num_anchors: int = Field(32, ge=1)
    seed: int = 0
    # None -> the method's rule (7 for bs 16, 5 for bs 10, 4 for bs 8)
    loss_gamma: float | None = Field(None, gt=0)
    # blocks per lm_head chunk in the loss: bounds peak memory
    loss_chunk_blocks: int = Field(64, ge=1)
    # restrict the loss softmax to the K most frequent supervised tokens (0 = full vocab)
    vocab_subset: int = Field(0, ge=0)
    # the training objective (model/objectives.py): ce_decay = DFlash cross-entropy with
    # position decay; dpace = cross-entropy with D-PACE dynamic position weights; distill =
    # KL from the target's own distribution; lk_alpha / lk_lambda = LK acceptance losses.
    # distill and lk_* capture the target's final hidden state too (the forward runs to the end)
    loss: Literal["ce_decay", "dpace", "distill", "lk_alpha", "lk_lambda"] = "ce_decay"
    # distill / lk_*: weight c of the hard-label cross-entropy mixed in: (1-c)*objective + c*CE
    loss_ce_weight: float = Field(0.0, ge=0, le=1)
    # D-PACE smoothing a: position weights from (1-a)*p(label) + a
    loss_dpace_alpha: float = Field(0.5, ge=0, le=1)
    # LK^lambda: lambda = exp(-eta * acceptance), the KL share
    loss_lk_eta: float = Field(3.0, gt=0)
    # where the loss's blocks are anchored: uniform over the supervised positions, or on_policy =
    # the anchors greedy speculative decoding with the current drafter visits on the training
    # answers (model/on_policy.py; + one no-grad drafter forward over every position per step),
    # from step on_policy_start * max_steps on (0: from the start; a finished run can be resumed
    # with train.anchors=on_policy and a larger max_steps as a second, on-policy phase)
    anchors: Literal["uniform", "on_policy"] = "uniform"
    # model.block_seeds=prompt_lookup: the fraction of blocks trained with masks only (drawn per
    # block each step), so the drafter still drafts where no seed is given (SGLang / vLLM)
    unseeded_fraction: float = Field(0.0, ge=0, le=1)
    on_policy_start: float = Field(0.5, ge=0, le=1)
    # adamw, or muon: Muon (torch.optim.Muon) on 2-D matrices at lr * muon_lr_mult, AdamW on the rest
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr_mult: float = Field(10.0, gt=0)
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "bfloat16"] = "float32"
    compile: bool = False
    # recompute each drafter layer's activations in the backward instead of keeping them
    # (torch.utils.checkpoint): less memory at the 8B shape for ~1/3 more drafter compute
    activation_checkpointing: bool = False
    # trainer ranks under torchrun: replicated drafter (DDP) or sharded (FSDP2, for large drafters)
    sharding: Literal["ddp", "fsdp2"] = "ddp"
    max_consecutive_skips: int = Field(5, ge=1)
    # wall-clock budget; 0 = none. Stops like a signal: at a step boundary, with a checkpoint.
    max_seconds: float = Field(0, ge=0)
    # DFlash 2: weight alpha of the selector's K-way cross-entropy added to the DFlash loss
    selector_loss_weight: float = Field(1.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _default_length(cls, data: Any) -> Any:
        # the default lives here, not on the field: a config that names epochs has max_steps unset
        if isinstance(data, dict) and data.get("max_steps") is None and data.get("epochs") is None:
            return {**data, "max_steps": DEFAULT_MAX_STEPS}
        return data

    @model_validator(mode="after")
    def _check_objective(self) -> "TrainConfig":
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError(f"train.max_steps={self.max_steps} and train.epochs={self.epochs:g} are both set; "
                             "a run is as long as one of them: add train.max_steps=null to train by epochs "
                             "(or train.epochs=null to train by steps)")
        if self.loss_ce_weight > 0 and self.loss not in ("distill", "lk_alpha", "lk_lambda"):
            raise ValueError(f"loss_ce_weight mixes cross-entropy into distill / lk_alpha / lk_lambda; "
                             f"train.loss={self.loss} has no such mix (set train.loss_ce_weight=0)")
        if self.optimizer == "muon" and self.sharding == "fsdp2":
            raise ValueError("optimizer=muon with sharding=fsdp2 is not supported (the checkpoint's optimizer "
                             "state is gathered for AdamW only); use sharding=ddp or optimizer=adamw")
        return self


class PipelineConfig(Section):
    # under torchrun: colocated = every rank holds the target and a drafter replica (the one-process
    # pipeline on each rank, drafters data-parallel); split = target ranks serve trainer ranks
    # (target_ranks / target_tp_size below). The rule for choosing: pipeline/layout.py
    layout: Literal["colocated", "split"] = "split"
    queue_depth: int = Field(8, ge=1, le=1024)
    num_target_workers: int = Field(1, ge=1, le=16)
    # layout=split: how many ranks run the target (the rest train)
    target_ranks: int = Field(1, ge=0)
    # under torchrun: ranks that hold ONE target together, tensor parallel (a divisor of target_ranks;
    # target_ranks / target_tp_size targets serve in parallel). See docs/architecture.md "torchrun".
    target_tp_size: int = Field(1, ge=1)
    # cache target features in memory across epochs (small CPU runs)
    cache_features: bool = False


class CheckpointConfig(Section):
    every_steps: int = Field(50, ge=1)
    keep_last: int = Field(2, ge=1)
    async_save: bool = True
    grace_seconds: float = Field(30.0, gt=0)


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)  # 0 = no in-training eval
    num_prompts: int = Field(4, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(0.0, ge=0)


class LoggingConfig(Section):
    every_steps: int = Field(10, ge=1)
    tensorboard: bool = True
    progress: Literal["auto", "rich", "plain", "none"] = "auto"


class DemoConfig(Section):
    """Only `dflash-train demo` reads these: how much data the target rewrites, with what, and
    who judges the drafter."""

    regenerate_conversations: int = Field(64, ge=1)
    regenerate_tokens: int = Field(64, ge=1)
    regenerate_batch: int = Field(16, ge=1)
    # vllm: one batched vLLM run writes the answers (~191 tok/s vs ~30 for our loop on 2 cores);
    # trainer: our own decoding loop (a target vLLM cannot load)
    regenerate_engine: Literal["vllm", "trainer"] = "vllm"
    # engine: the export served by vLLM (plain, n-gram, DFlash; the engine's counters);
    # eval: our own speculative decoding (a target vLLM cannot serve DFlash for, e.g. Gemma 3)
    judge: Literal["engine", "eval"] = "engine"
    # draft tokens per step when the engine judges, for n-gram and DFlash alike; 0: block_size - 1.
    # On CPU the verify forward's cost grows with k (docs/benchmarks.md). auto: the fastest k of a
    # short sweep in the engine first (engine/k_sweep.py)
    serve_k: Literal["auto"] | int = 0
    # items of each benchmark suite (MT-Bench: both turns, HumanEval) served beside the held-out
    # prompts in the same engine runs, for report.md's per-suite rows; 0: none (judge: engine only)
    suite_prompts: int = Field(8, ge=0)

    @field_validator("serve_k", mode="before")
    @classmethod
    def _serve_k(cls, v):
        # one message for every wrong value (the union alone reports one line per member)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError("draft tokens per step: a number >= 0 (0: block_size - 1) or auto")
