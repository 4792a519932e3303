"""Deterministic, resumable data order over packed rows.

Epoch e visits all rows in the order ``torch.randperm(num_rows)`` drawn from a
``torch.Generator`` seeded with a hash of (seed, e). A *position* is a global
counter over epochs: position p is row ``perm(p // num_rows)[p % num_rows]``.
`next_positions(n)` hands out the next n positions (crossing epoch
boundaries); `state_dict()` is ``{"seed", "epoch", "position", "num_rows"}``
(position = index inside the epoch) and restoring it continues with exactly
the same positions.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from dflash_train.data.sources import DataError


def _epoch_seed(seed: int, epoch: int) -> int:
    h = hashlib.sha256(f"dflash-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(h[:8], "big") & ((1 << 63) - 1)


class DataOrder:
    def __init__(self, num_rows: int, seed: int = 0):
        if num_rows < 1:
            raise ValueError("DataOrder needs at least one row")
        self.num_rows = int(num_rows)
        self.seed = int(seed)
        self._next = 0  # global position of the next row to hand out
        self._perm_epoch = -1
        self._perm: list[int] = []

    @property
    def epoch(self) -> int:
        return self._next // self.num_rows

    @property
    def position(self) -> int:
        """Global position of the next row to hand out."""
        return self._next

    def permutation(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_rows, generator=g).tolist()
            self._perm_epoch = epoch
        return self._perm

    def next_positions(self, n: int) -> list[int]:
        out = list(range(self._next, self._next + n))
        self._next += n
        return out

    def rows_for(self, positions: list[int]) -> list[int]:
        """Row indices of global positions."""
        return [self.permutation(p // self.num_rows)[p % self.num_rows] for p in positions]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "epoch": self._next // self.num_rows,
                "position": self._next % self.num_rows, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        n = int(state.get("num_rows", self.num_rows))
        if n != self.num_rows:
            raise DataError(f"the checkpoint's data order is for {n} rows, the data now has {self.num_rows}: "
                            "the training data (data.source / data.regenerated) changed since the checkpoint; "
                            "restore it, or train into a new run dir")
        self.seed = int(state["seed"])
        self._next = int(state["epoch"]) * self.num_rows + int(state["position"])
        self._perm_epoch = -1

    def __repr__(self) -> str:
        return f"DataOrder(num_rows={self.num_rows}, seed={self.seed}, state={self.state_dict()})"


class RankSlice:
    """One rank's share of a global `DataOrder` (the colocated layout): each batch of n rows is
    slice [rank*n, (rank+1)*n) of the next world*n positions, so W ranks with batch n see exactly
    the rows one process with batch W*n sees, and every rank holds the same order state."""

    def __init__(self, order: DataOrder, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a world of {world}")
        self.order, self.rank, self.world = order, rank, world

    def next_positions(self, n: int) -> list[int]:
        return self.order.next_positions(n * self.world)[self.rank * n:(self.rank + 1) * n]

    def rows_for(self, positions: list[int]) -> list[int]:
        return self.order.rows_for(positions)

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)
