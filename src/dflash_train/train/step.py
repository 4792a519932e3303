"""THE training step (`TrainStep`), the unit `train` runs and `bench` times: the optimizer
(train/optim.py) and lr schedule, forward + chunked DFlash loss + backward per micro-batch
(gradients accumulate, DDP no_sync, autocast), one normalisation of the accumulated
gradient, gradient clipping, the skip of non-finite steps agreed by all ranks, the
optimizer and scheduler step; it returns a `StepResult`. The loop around it
(train/run.py) decides when to stop, log, evaluate and checkpoint.

Normalisation: each micro-batch backpropagates its UNNORMALISED sum of weight * term;
`scale_gradients` then divides by the sum of weights over every micro-batch of the
step and every trainer rank. So the update is the gradient of the weighted mean over the
whole step's batch, whatever its split into micro-batches and ranks (DDP averages the
ranks' gradients: hence the factor num_trainers)."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflash_train.model.loss import LossOutput, dflash_loss, unwrap
from dflash_train.model.on_policy import on_policy_anchors
from dflash_train.model.objectives import Objective
from dflash_train.train.optim import make_optimizer
from dflash_train.train.schedule import make_scheduler


def capped_anchors(num_anchors: int, row_len: int) -> int:
    """A row of T tokens has at most T-1 anchor positions: more anchors only add padding blocks
    (weight 0) that cost time, so the count is capped (same losses), with a warning."""
    most = max(1, row_len - 1)
    if num_anchors > most:
        logging.getLogger("dflash_train").warning(
            "train.num_anchors=%d capped to %d: a row of %d tokens has at most %d anchor positions (more only add "
            "empty blocks; the losses are the same)", num_anchors, most, row_len, most)
        return most
    return num_anchors


def loss_and_backward(model, target, batch, train_cfg, num_anchors: int, generator: torch.Generator,
                      vocab_subset: torch.Tensor | None = None, grad_accum: int = 1,
                      objective: Objective | None = None, on_policy: bool = False) -> LossOutput:
    """Forward + loss of one micro-batch (a TrainBatch on the model's device) and the backward
    of its unnormalised total (see the module doc; `grad_accum` is kept for callers, the
    normalisation by the step's weight sum replaces the division by it). The caller holds
    autocast / no_sync around it and calls `scale_gradients` after the last micro-batch."""
    del grad_accum
    objective = objective or Objective.from_train_config(train_cfg)
    anchors, sums = None, {}
    if on_policy:  # train.anchors=on_policy: where decoding with the current drafter goes (model/on_policy.py)
        width = int(unwrap(model).fc.weight.shape[1])  # the teacher objectives' extra channels are not its input
        a, v, sums = on_policy_anchors(model, target, batch.input_ids, batch.loss_mask, batch.document_ids,
                                       batch.features[..., :width], num_anchors, generator, vocab_subset)
        anchors = (a, v)
    out = dflash_loss(
        model, target, batch.input_ids, batch.loss_mask, batch.document_ids, batch.features,
        num_anchors=num_anchors, generator=generator, gamma=train_cfg.loss_gamma,
        chunk_blocks=train_cfg.loss_chunk_blocks, vocab_subset=vocab_subset,
        selector_loss_weight=train_cfg.selector_loss_weight,
        objective=objective, anchors=anchors,
        unseeded_fraction=train_cfg.unseeded_fraction,
    )
    out.total.backward()
    out.extra.update(sums)
    return out


def scale_gradients(drafter: torch.nn.Module, total_weight: torch.Tensor, num_trainers: int) -> None:
    """grad *= num_trainers / total_weight, on the device: the step's one normalisation (the module doc),
    with `total_weight` the step's weight summed over every micro-batch and trainer rank."""
    scale = num_trainers / total_weight.clamp_min(1e-12)
    for p in drafter.parameters():
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.device))


def clip_gradients(drafter: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip in place; the total norm before clipping, as a plain tensor (FSDP2 gives a DTensor)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return grad_norm


# --------------------------------------------------------------------------- the one train step


class _OneProcess:
    """What a DistContext answers when there is a single trainer (bench, tests)."""

    num_trainers = 1

    def no_sync(self, model):
        return contextlib.nullcontext()

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass
class StepResult:
    """What one optimizer step did, read from the device once (the step's one host sync).
    `finite` is the same on every trainer rank (it is computed from all-reduced sums and the
    all-reduced gradient): when False the update was skipped (the lr schedule still advanced)."""

    loss: float                  # the step's loss: weighted mean over every micro-batch and trainer rank
    grad_norm: float             # total gradient norm before clipping
    finite: bool
    micro: list[LossOutput]      # each micro-batch's output (acceptance counts, extras; this rank's)
    batches: list                # the TrainBatches consumed; the last one's order_state is the data position
    num_tokens: int              # tokens (not padding) over every trainer rank
    num_samples: int             # rows over every trainer rank
    busy_s: float                # computing (waiting for batches excluded)
    seconds: float               # the whole step, waits included
    stop: bool = False           # some trainer rank voted to stop after this step (`stop_vote`)


class TrainStep:
    """THE training step, in the shape of torchtitan's ``train_step`` /
    ``forward_backward_step``: zero the gradients; per micro-batch (``train.grad_accum``)
    the forward + loss + backward under DDP ``no_sync`` (all but the last) and autocast
    (``train.dtype=bfloat16``); one normalisation of the accumulated gradient over the
    step's weight (`scale_gradients`); clipping; the finite-loss agreement of every
    trainer rank (non-finite: the update is skipped); optimizer and scheduler step.
    The Trainer runs it, `bench` times it (and `compare` trains its variants with the
    Trainer). `build` makes the optimizer, scheduler and objective the same way for both."""

    def __init__(self, model, drafter, target, train_cfg, optimizer, scheduler, objective: Objective,
                 num_anchors: int, anchor_gen: torch.Generator, vocab_subset: torch.Tensor | None = None,
                 ctx=None, device: torch.device | None = None) -> None:
        self.model, self.drafter, self.target, self.cfg = model, drafter, target, train_cfg
        self.optimizer, self.scheduler, self.objective = optimizer, scheduler, objective
        self.num_anchors, self.anchor_gen, self.vocab_subset = num_anchors, anchor_gen, vocab_subset
        self.ctx = ctx if ctx is not None else _OneProcess()
        self.device = device if device is not None else next(drafter.parameters()).device

    @classmethod
    def build(cls, drafter, target, train_cfg, num_anchors: int, anchor_gen: torch.Generator,
              vocab_subset: torch.Tensor | None = None, ctx=None, model=None) -> "TrainStep":
        """The step with its optimizer (train/optim.py), lr schedule and objective from `train_cfg`.
        `model`: the DDP / FSDP2 wrapper of `drafter` (wrap before: FSDP2 replaces the parameters)."""
        optimizer = make_optimizer(drafter, train_cfg)
        objective = Objective.from_train_config(train_cfg)
        scheduler = make_scheduler(optimizer, train_cfg.max_steps, train_cfg.warmup_fraction, train_cfg.min_lr_ratio)
        return cls(model if model is not None else drafter, drafter, target, train_cfg, optimizer, scheduler,
                   objective, num_anchors, anchor_gen, vocab_subset, ctx)

    def autocast(self):
        if self.cfg.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, batch, on_policy: bool = False) -> LossOutput:
        """One micro-batch (already on the device): forward + loss + backward, under autocast."""
        with self.autocast():
            return loss_and_backward(self.model, self.target, batch, self.cfg, self.num_anchors, self.anchor_gen,
                                     self.vocab_subset, self.cfg.grad_accum, self.objective, on_policy=on_policy)

    def __call__(self, next_batch: Callable[[], Any], on_policy: bool = False,
                 stop_vote: Callable[[], bool] | None = None) -> StepResult:
        """One optimizer step over ``train.grad_accum`` batches taken from `next_batch()`.
        `stop_vote()`, asked just before the step's all-reduce: this rank wants to stop after this
        step; the vote rides on the step's one collective, so every rank learns it at once."""
        t_step = time.perf_counter()
        accum = self.cfg.grad_accum
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        weight = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        batches, micro, busy = [], [], 0.0
        for i in range(accum):
            batch = next_batch().to(self.device, non_blocking=True)
            batches.append(batch)
            t_busy = time.perf_counter()
            with self.ctx.no_sync(self.model) if i < accum - 1 else contextlib.nullcontext():
                out = self.forward_backward(batch, on_policy)
            total += out.total.detach().float()
            weight += out.weight_sum.float()
            tokens += (batch.document_ids >= 0).sum()
            micro.append(out)
            busy += time.perf_counter() - t_busy
        t_busy = time.perf_counter()
        vote = float(stop_vote()) if stop_vote is not None else 0.0
        # ONE collective for the step: [weight, loss total, tokens, stop votes] summed over trainer ranks
        sums = self.ctx.all_reduce_sum_(torch.stack([weight, total, tokens, torch.full((), vote, device=self.device)]))
        scale_gradients(self.drafter, sums[0], self.ctx.num_trainers)  # the module doc's normalisation
        grad_norm = clip_gradients(self.drafter, self.cfg.grad_clip)
        loss = sums[1] / sums[0].clamp_min(1e-12)
        # the same on every rank: the sums are all-reduced, the gradients were (DDP / FSDP2)
        finite_t = torch.isfinite(loss) & torch.isfinite(grad_norm)
        # ONE host sync for the step (the seed's batched .item())
        finite, loss_v, norm_v, tokens_v, votes = torch.stack(
            [finite_t.float(), loss, grad_norm.float().to(self.device), sums[2], sums[3]]).tolist()
        if finite:
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        busy += time.perf_counter() - t_busy
        return StepResult(loss_v, norm_v, bool(finite), micro, batches, num_tokens=int(tokens_v),
                          num_samples=sum(b.input_ids.shape[0] for b in batches) * self.ctx.num_trainers,
                          busy_s=busy, seconds=time.perf_counter() - t_step, stop=votes > 0)
