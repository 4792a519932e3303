"""The drafter's training step, the unit `train` runs and `bench` times: AdamW
(weight decay on matrices only), forward + chunked DFlash loss + backward per
micro-batch (gradients accumulate), gradient clipping. The loop around it
(train/run.py) adds accumulation, DDP no_sync, autocast, the skip of
non-finite steps agreed by all ranks, and the lr schedule."""
from __future__ import annotations

import torch

from dflash_train.model.loss import LossOutput, dflash_loss


def make_optimizer(drafter: torch.nn.Module, train_cfg) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, p in drafter.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=1e-8,
    )


def loss_and_backward(model, target, batch, train_cfg, num_anchors: int, generator: torch.Generator,
                      vocab_subset: torch.Tensor | None = None, grad_accum: int = 1) -> LossOutput:
    """Forward + loss of one micro-batch (a TrainBatch on the model's device) and the
    backward of loss / grad_accum; the caller holds autocast / no_sync around it."""
    out = dflash_loss(
        model, target, batch.input_ids, batch.loss_mask, batch.document_ids, batch.features,
        num_anchors=num_anchors, generator=generator, gamma=train_cfg.loss_gamma,
        chunk_blocks=train_cfg.loss_chunk_blocks, vocab_subset=vocab_subset,
        selector_loss_weight=getattr(train_cfg, "selector_loss_weight", 1.0),
    )
    (out.loss / grad_accum).backward()
    return out


def clip_gradients(drafter: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip in place; the total norm before clipping, as a plain tensor (FSDP2 gives a DTensor)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), max_norm)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return grad_norm
