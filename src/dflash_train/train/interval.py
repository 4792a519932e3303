"""What one logging interval of the training loop adds up: per-position acceptance, mean loss,
tokens and samples per second, DFlash 2 selector and on-policy sums. Kept on the device until
the interval's record is built (one host read per interval, not per step)."""
from __future__ import annotations

import time

import torch

from dflash_train.model.dflash2 import selector_metrics
from dflash_train.model.loss import expected_acceptance_length
from dflash_train.model.on_policy import on_policy_metrics


class IntervalMeter:
    def __init__(self, block_size: int, device: torch.device) -> None:
        self.acc_correct = torch.zeros(block_size - 1, device=device)
        self.acc_count = torch.zeros(block_size - 1, device=device)
        self.loss_sum = torch.zeros((), device=device)
        self.loss_n = 0
        self.sums: dict[str, torch.Tensor] = {}  # DFlash 2 (model/dflash2.py) and on-policy extras
        self.tokens = self.samples = 0
        self.t0 = time.perf_counter()

    def add_micro(self, out) -> None:
        """One micro-batch's StepOutput (train/step.py)."""
        self.acc_correct += out.correct.detach().float()
        self.acc_count += out.count.detach().float()
        for k, v in out.extra.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v.clone()

    def add_step(self, step_loss: torch.Tensor, finite: bool, n_tokens: int, n_samples: int) -> None:
        if finite:
            self.loss_sum += step_loss
            self.loss_n += 1
        self.tokens += n_tokens
        self.samples += n_samples

    def exclude(self, seconds: float) -> None:
        """Time spent on something that is not training (the in-training eval)."""
        self.t0 += seconds

    def record(self, step: int, step_loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, tokens: int,
               skipped: int) -> dict:
        """The interval's metrics.jsonl record; starts the next interval."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        # the interval's one host read: acceptance per position, then the supervised predictions
        # ((anchor, block position) pairs that carried loss: what trainers are compared by)
        *acc, supervised = torch.cat([self.acc_correct / self.acc_count.clamp_min(1), self.acc_count.sum().view(1)]).tolist()
        rec = {
            "step": step,
            "loss": float(step_loss),
            "loss_mean": float(self.loss_sum / max(self.loss_n, 1)),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "expected_tau": float(expected_acceptance_length(torch.tensor(acc))),
            "tokens_per_s": self.tokens / dt,
            "samples_per_s": self.samples / dt,
            "supervised": int(supervised),
            "supervised_per_s": supervised / dt,
            "tokens": tokens,
            "skipped": skipped,
            "time": time.time(),
        }
        for k, a in enumerate(acc, start=1):
            rec[f"acc_{k}"] = a
        rec.update(selector_metrics(self.sums))
        rec.update(on_policy_metrics(self.sums))
        self.sums.clear()
        self.acc_correct.zero_(); self.acc_count.zero_(); self.loss_sum.zero_()
        self.loss_n = self.tokens = self.samples = 0
        self.t0 = time.perf_counter()
        return rec
