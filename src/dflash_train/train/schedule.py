"""How long a run is and its learning-rate schedule: THE step count of `train.max_steps` or
`train.epochs` (`step_budget`, with the start-up line saying what it means in rows, tokens and
epochs), linear warmup, cosine decay to min_lr_ratio * lr over those steps."""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from dflash_train.data.prepared_store import SCAN_TOKENS


def warmup_steps(max_steps: int, warmup_fraction: float) -> int:
    return max(1, int(round(warmup_fraction * max_steps))) if warmup_fraction > 0 else 0


def lr_factor(step: int, max_steps: int, warmup_fraction: float, min_lr_ratio: float) -> float:
    warmup = warmup_steps(max_steps, warmup_fraction)
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(opt: torch.optim.Optimizer, max_steps: int, warmup_fraction: float,
                   min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, max_steps, warmup_fraction, min_lr_ratio)
    )


@dataclass(frozen=True)
class StepBudget:
    """The optimizer steps a run takes and what they mean: `rows` training rows of `tokens` tokens
    (padding not counted) per epoch, `global_batch` rows per step over every data-parallel rank."""

    steps: int
    rows: int
    tokens: int
    global_batch: int
    batch_parts: str  # "batch_size 2 x grad_accum 2 x 4 ranks", or "" when the global batch is batch_size
    epochs: float | None  # set: `steps` were worked out from train.epochs
    warmup: int

    def line(self) -> str:
        """The start-up line: the step count with the rows, tokens and epochs behind it, and the lr schedule."""
        gb = f"global batch {self.global_batch:,}" + (f" ({self.batch_parts})" if self.batch_parts else "")
        lr = (f"lr warmup {self.warmup:,} steps, cosine to step {self.steps:,}" if self.warmup
              else f"lr cosine from step 0 to step {self.steps:,}")
        if self.epochs is not None:
            return (f"epochs {self.epochs:g} = {self.rows:,} rows x {self.epochs:g} / {gb} = {self.steps:,} steps "
                    f"({round(self.epochs * self.tokens):,} tokens); {lr}")
        seen = self.steps * self.global_batch
        return (f"max_steps {self.steps:,} x {gb} = {seen:,} rows = {seen / self.rows:.2f} epochs of {self.rows:,} "
                f"rows ({round(seen / self.rows * self.tokens):,} tokens); {lr}")


def step_budget(train_cfg, document_ids: torch.Tensor, data_parallel: int, tokens: int | None = None) -> StepBudget:
    """`train.max_steps` as it is, or ceil(epochs * rows / global batch) steps for `train.epochs`, over
    the training rows of `document_ids` ([rows, T], -1 = padding); the global batch is batch_size x
    grad_accum x `data_parallel` (trainer ranks: each takes its own batch_size rows per micro-batch,
    a colocated rank its slice of the global order). `tokens`: the rows' real tokens when already
    counted (`RowCounts.real_tokens`: then `document_ids` is not read, only its length)."""
    t = train_cfg
    rows = len(document_ids)
    if tokens is None:  # a chunk of rows at a time: no [rows, T] temporary
        step = max(1, SCAN_TOKENS // max(1, int(document_ids.shape[1])))
        tokens = sum(int((document_ids[r:r + step] >= 0).sum()) for r in range(0, rows, step))
    global_batch = t.batch_size * t.grad_accum * data_parallel
    if t.epochs is not None:
        # exact arithmetic on the epochs as written (0.1 x 30 / 3 is 1 step, not 2)
        steps = max(1, math.ceil(Fraction(repr(float(t.epochs))) * rows / global_batch))
    else:
        steps = int(t.max_steps)
    parts = [f"batch_size {t.batch_size}"] + ([f"grad_accum {t.grad_accum}"] if t.grad_accum > 1 else []) \
        + ([f"{data_parallel} ranks"] if data_parallel > 1 else [])
    return StepBudget(steps=steps, rows=int(rows), tokens=int(tokens), global_batch=global_batch,
                      batch_parts=" x ".join(parts) if len(parts) > 1 else "", epochs=t.epochs,
                      warmup=warmup_steps(steps, t.warmup_fraction))
