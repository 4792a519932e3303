"""The pipeline's source: data order + packed rows + the frozen target."""
from __future__ import annotations

import threading

import torch

from dflash_train.pipeline.batch import TrainBatch


class TargetBatchSource:
    """Produces `TrainBatch`es: next rows in data order, target features captured.

    With `cache_features`, each row's features are computed once and reused in
    later epochs (for small CPU runs where the target forward dominates). The
    cache holds exactly what the target produced, so results do not change.
    """

    def __init__(self, rows, order, target, layer_ids: list[int], batch_size: int,
                 cache_features: bool = False) -> None:
        self.input_ids, self.loss_mask, self.document_ids = rows
        self.order = order
        self.target = target
        self.layer_ids = list(layer_ids)
        self.batch_size = batch_size
        self.device = target.device
        self._cache: dict[int, torch.Tensor] | None = {} if cache_features else None
        self._cache_lock = threading.Lock()

    def next_positions(self) -> tuple[list[int], dict]:
        positions = self.order.next_positions(self.batch_size)
        return positions, self.order.state_dict()

    def rows(self, positions: list[int]) -> torch.Tensor:
        return torch.as_tensor(self.order.rows_for(positions), dtype=torch.long)

    def make_batch(self, positions: list[int], order_state: dict) -> TrainBatch:
        idx = self.rows(positions)
        ids, mask, docs = self.input_ids[idx], self.loss_mask[idx], self.document_ids[idx]
        feats = self._features(idx, ids, docs)
        return TrainBatch(ids, mask, docs, feats, list(positions), dict(order_state))

    def _features(self, idx: torch.Tensor, ids: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        if self._cache is not None:
            with self._cache_lock:
                hit = [self._cache.get(int(i)) for i in idx]
            if all(h is not None for h in hit):
                return torch.stack(hit).to(self.device)
        if self._cache is None:
            return self._capture(ids, docs)
        # one row at a time: a row's features then never depend on which rows
        # shared its batch, so cached and fresh features are bit-identical
        feats = torch.cat([self._capture(ids[j:j + 1], docs[j:j + 1]) for j in range(len(idx))])
        with self._cache_lock:
            for j, i in enumerate(idx.tolist()):
                self._cache[i] = feats[j].cpu()
        return feats

    def _capture(self, ids: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            feats = self.target.capture(ids.to(self.device), docs.to(self.device), self.layer_ids)
        return feats.clone()  # a normal tensor, usable outside inference mode
