"""Learning-rate schedule: linear warmup, cosine decay to min_lr_ratio * lr."""
from __future__ import annotations

import math

import torch


def lr_factor(step: int, max_steps: int, warmup_fraction: float, min_lr_ratio: float) -> float:
    warmup = max(1, int(round(warmup_fraction * max_steps))) if warmup_fraction > 0 else 0
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(opt: torch.optim.Optimizer, max_steps: int, warmup_fraction: float,
                   min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, max_steps, warmup_fraction, min_lr_ratio)
    )
