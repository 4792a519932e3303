"""train.vocab_subset: the loss over the k most frequent supervised tokens only."""
from __future__ import annotations

import numpy as np
import torch


def vocab_subset_from_counts(supervised_counts, k: int) -> torch.Tensor | None:
    """The k most frequent supervised tokens (ties broken by id) of `supervised_counts` (each id's
    supervised occurrences, `RowCounts.supervised_counts`): a deterministic function of the training
    rows, so it needs no checkpointing."""
    if k <= 0:
        return None
    counts = torch.from_numpy(np.asarray(supervised_counts, dtype=np.int64))
    k = min(k, int((counts > 0).sum()))
    # stable: sort by (-count, id)
    order = torch.argsort(-counts.double() + torch.arange(len(counts), dtype=torch.double) / (len(counts) + 1))
    return torch.sort(order[:k]).values

