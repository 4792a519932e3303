"""train.vocab_subset: the loss over the k most frequent supervised tokens only."""
from __future__ import annotations

import torch


def vocab_subset_from_rows(input_ids: torch.Tensor, loss_mask: torch.Tensor, k: int) -> torch.Tensor | None:
    """The k most frequent supervised tokens (ties broken by id): a deterministic
    function of the training rows, so it needs no checkpointing."""
    if k <= 0:
        return None
    sup = input_ids[loss_mask.bool()]
    counts = torch.bincount(sup, minlength=int(input_ids.max()) + 1)
    k = min(k, int((counts > 0).sum()))
    # stable: sort by (-count, id)
    order = torch.argsort(-counts.double() + torch.arange(len(counts), dtype=torch.double) / (len(counts) + 1))
    return torch.sort(order[:k]).values
