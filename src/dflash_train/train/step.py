"""The drafter's training step, the unit `train` runs and `bench` times: the optimizer
(train/optim.py), forward + chunked DFlash loss + backward per micro-batch (gradients
accumulate), one normalisation of the accumulated gradient, gradient clipping. The loop
around it (train/run.py) adds accumulation, DDP no_sync, autocast, the skip of non-finite
steps agreed by all ranks, and the lr schedule.

Normalisation: each micro-batch backpropagates its UNNORMALISED sum of weight * term;
`normalise_gradients` then divides by the sum of weights over every micro-batch of the
step and every trainer rank. So the update is the gradient of the weighted mean over the
whole step's batch, whatever its split into micro-batches and ranks (DDP averages the
ranks' gradients: hence the factor num_trainers)."""
from __future__ import annotations

import torch

from dflash_train.model.loss import LossOutput, dflash_loss, unwrap
from dflash_train.model.on_policy import on_policy_anchors
from dflash_train.model.objectives import Objective
from dflash_train.train.optim import make_optimizer  # noqa: F401 - the trainer's and bench's entry point


def loss_and_backward(model, target, batch, train_cfg, num_anchors: int, generator: torch.Generator,
                      vocab_subset: torch.Tensor | None = None, grad_accum: int = 1,
                      objective: Objective | None = None, on_policy: bool = False) -> LossOutput:
    """Forward + loss of one micro-batch (a TrainBatch on the model's device) and the backward
    of its unnormalised total (see the module doc; `grad_accum` is kept for callers, the
    normalisation by the step's weight sum replaces the division by it). The caller holds
    autocast / no_sync around it and calls `normalise_gradients` after the last micro-batch."""
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
        selector_loss_weight=getattr(train_cfg, "selector_loss_weight", 1.0),
        objective=objective, anchors=anchors,
        unseeded_fraction=getattr(train_cfg, "unseeded_fraction", 0.0),
    )
    out.total.backward()
    out.extra.update(sums)
    return out


def normalise_gradients(drafter: torch.nn.Module, weight_sum: torch.Tensor | float, ctx=None) -> float:
    """Divide the accumulated gradients by the step's total weight (this rank's `weight_sum`
    summed over trainer ranks by `ctx`), times the number of trainer ranks whose gradients
    DDP / FSDP averaged. Returns the total weight (0 for a batch with nothing supervised:
    the gradients stay 0)."""
    local = float(weight_sum)
    total = ctx.sum_over_trainers(local) if ctx is not None else local
    n = ctx.num_trainers if ctx is not None else 1
    scale = n / max(total, 1e-12)
    for p in drafter.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    return total


def clip_gradients(drafter: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip in place; the total norm before clipping, as a plain tensor (FSDP2 gives a DTensor)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return grad_norm
