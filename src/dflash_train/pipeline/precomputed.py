"""Precomputed features on disk: the layout `dflash-train precompute` writes
(pipeline/precompute.py) and its reader, what `train` with `data.source=precomputed:DIR` uses.

Layout of DIR:
  index.json                 format, target, layer ids, dtype, rows, per-shard sha256,
                             the held-out conversations (for eval prompts)
  shard-NNNNN.safetensors    input_ids [n,T] int64, loss_mask [n,T] uint8,
                             document_ids [n,T] int32, features [n,T,K*H] (dtype)
  shard-NNNNN.json           the shard's completion record: its rows, sha256, the sha256 of
                             its input rows and the settings that decide its content

With train.loss distill / lk_alpha / lk_lambda the layer ids end with the target's
layer count: the final hidden state (what the lm_head reads), H more channels, so
features are [n,T,(K+1)*H]. Size per token: (K or K+1) * H * (2 for bf16 / 4 for fp32)
bytes, e.g. Gemma 3 270M (H 640, K 2): 2560 B/token in bf16, 3840 with the final state;
an 8B target (H 4096, K 5): 40 KiB/token, 48 KiB with it. The teacher's logits are never
stored: the loss recomputes them chunk by chunk through the target's lm_head.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_train.data.heldout import heldout_of_index
from dflash_train.errors import UserError, parse_file
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.rundir import sha256_file

FORMAT = 1


class PrecomputeError(UserError):
    pass


class PrecomputedFeatures:
    """Reads a precompute directory; verifies every shard's checksum on open."""
    def __init__(self, path: Path, verify: bool = True) -> None:
        self.path = Path(path)
        idx = self.path / "index.json"
        self.index = parse_file(idx, json.loads, PrecomputeError,
                                f"{self.path}: no index.json (not a precompute directory, or incomplete)",
                                lambda e: f"{idx}: not valid JSON ({e})", (json.JSONDecodeError,))
        if self.index.get("format") != FORMAT:
            raise PrecomputeError(f"{idx}: format {self.index.get('format')} is not {FORMAT}")
        parts = {k: [] for k in ("input_ids", "loss_mask", "document_ids")}
        self._row_shard: list[tuple[int, int]] = []
        for si, sh in enumerate(self.index["shards"]):
            f = self.path / sh["file"]
            if not f.is_file():
                raise PrecomputeError(f"{f}: shard missing")
            if verify and sha256_file(f) != sh["sha256"]:
                raise PrecomputeError(f"{f}: checksum mismatch (corrupt or modified shard)")
            with safe_open(str(f), framework="pt") as st:
                for k in parts:
                    parts[k].append(st.get_tensor(k))
            self._row_shard += [(si, j) for j in range(sh["rows"])]
        self.input_ids = torch.cat(parts["input_ids"])
        self.loss_mask = torch.cat(parts["loss_mask"]).bool()
        self.document_ids = torch.cat(parts["document_ids"])
        self._handles: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def layer_ids(self) -> list[int]:
        return list(self.index["layer_ids"])

    def heldout(self):
        return heldout_of_index(self.index)

    def features(self, rows: list[int]) -> torch.Tensor:
        out = []
        with self._lock:
            for r in rows:
                si, j = self._row_shard[r]
                h = self._handles.get(si)
                if h is None:
                    h = self._handles[si] = safe_open(str(self.path / self.index["shards"][si]["file"]), framework="pt")
                out.append(h.get_slice("features")[j:j + 1])
        return torch.cat(out)


class PrecomputedBatchSource:
    """`BatchSource` over a precompute directory: no target forward at all."""
    device = torch.device("cpu")

    def __init__(self, pre: PrecomputedFeatures, order, batch_size: int, feature_dtype: torch.dtype) -> None:
        self.pre, self.order, self.batch_size, self.feature_dtype = pre, order, batch_size, feature_dtype

    def next_positions(self) -> tuple[list[int], dict]:
        positions = self.order.next_positions(self.batch_size)
        return positions, self.order.state_dict()

    def make_batch(self, positions: list[int], order_state: dict) -> TrainBatch:
        rows = self.order.rows_for(positions)
        idx = torch.as_tensor(rows, dtype=torch.long)
        feats = self.pre.features(rows).to(self.feature_dtype)
        return TrainBatch(self.pre.input_ids[idx], self.pre.loss_mask[idx], self.pre.document_ids[idx], feats,
                          list(positions), dict(order_state))
