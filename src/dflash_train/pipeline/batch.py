"""The unit that flows from the target stage to the trainer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor      # [B, T] int64
    loss_mask: torch.Tensor      # [B, T] bool, assistant tokens only
    document_ids: torch.Tensor   # [B, T] int32, -1 = padding
    features: torch.Tensor       # [B, T, K*H] captured target layers (target dtype)
    positions: list[int] = field(default_factory=list)      # data-order positions of the rows
    order_state: dict[str, Any] = field(default_factory=dict)  # data order state after these rows

    def to(self, device: torch.device, non_blocking: bool = False) -> "TrainBatch":
        return TrainBatch(
            self.input_ids.to(device, non_blocking=non_blocking),
            self.loss_mask.to(device, non_blocking=non_blocking),
            self.document_ids.to(device, non_blocking=non_blocking),
            self.features.to(device, non_blocking=non_blocking),
            list(self.positions),
            dict(self.order_state),
        )
