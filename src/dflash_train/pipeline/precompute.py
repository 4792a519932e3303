"""Offline mode: `dflash-train precompute` writes the target's captured
features to disk; `train` with `data.source=precomputed:DIR` trains from them.

Layout of DIR:
  index.json                 format, target, layer ids, dtype, rows, per-shard sha256,
                             the held-out conversations (for eval prompts)
  shard-NNNNN.safetensors    input_ids [n,T] int64, loss_mask [n,T] uint8,
                             document_ids [n,T] int32, features [n,T,K*H] (dtype)

With train.loss distill / lk_alpha / lk_lambda the layer ids end with the target's
layer count: the final hidden state (what the lm_head reads), H more channels, so
features are [n,T,(K+1)*H]. Size per token: (K or K+1) * H * (2 for bf16 / 4 for fp32)
bytes, e.g. Gemma 3 270M (H 640, K 2): 2560 B/token in bf16, 3840 with the final state;
an 8B target (H 4096, K 5): 40 KiB/token, 48 KiB with it. The teacher's logits are never
stored: the loss recomputes them chunk by chunk through the target's lm_head.

Rows are captured one at a time (as the online pipeline does with
`pipeline.cache_features`), so in float32 the offline features equal the
online ones bit for bit. The index is written last: a directory without it
is incomplete.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_train.data import load_prepared
from dflash_train.data.sources import Conversation
from dflash_train.errors import UserError, parse_file
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.objectives import Objective, capture_layer_ids
from dflash_train.pipeline.batch import TrainBatch
from dflash_train.rundir import atomic_write_json, sha256_file
from dflash_train.storage import writing
from dflash_train.targets import load_target
from dflash_train.utils import save_safetensors

log = logging.getLogger("dflash_train")
FORMAT = 1
PRECOMPUTED = "precomputed:"  # the data.source prefix of precomputed features
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class PrecomputeError(UserError):
    pass


def precompute_features(cfg, out: Path, dtype: str = "bfloat16", rows_per_shard: int = 256,
                        progress=None) -> Path:
    if dtype not in DTYPES:
        raise PrecomputeError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = Path(out)
    if (out / "index.json").exists():
        raise PrecomputeError(f"{out} already holds precomputed features (index.json); choose another --out")
    # a refused write is one line; without index.json (written last) nothing here reads as features
    again = "index.json is written last, so the same command starts these features again once that is fixed"
    with writing(out, "creating", hint=again):
        out.mkdir(parents=True, exist_ok=True)
    target = load_target(cfg.target)

    # the drafter's layers, plus (for train.loss distill / lk_*) the final hidden state: layer id
    # == the target's layer count, H more channels per token (see docs/architecture.md)
    layer_ids = capture_layer_ids(DrafterConfig.from_target(cfg.model, target).target_layer_ids,
                                  target.num_layers, Objective.from_train_config(cfg.train))
    data = load_prepared(cfg, target.tokenizer, target.family)
    n = data.num_rows
    shards: list[dict[str, Any]] = []
    for s, start in enumerate(range(0, n, rows_per_shard)):
        stop = min(n, start + rows_per_shard)
        ids, mask, docs = (x[start:stop] for x in (data.input_ids, data.loss_mask, data.document_ids))
        feats = []
        for j in range(stop - start):
            with torch.inference_mode():
                f = target.capture(ids[j:j + 1].to(target.device), docs[j:j + 1].to(target.device), layer_ids)
            feats.append(f.to(DTYPES[dtype]).cpu())
            if progress:
                progress(start + j + 1, n)
        name = f"shard-{s:05d}.safetensors"
        # save_safetensors: umask-respecting permissions (save_file alone creates 0600)
        with writing(out / name, hint=again):
            save_safetensors({"input_ids": ids.contiguous(), "loss_mask": mask.to(torch.uint8).contiguous(),
                              "document_ids": docs.to(torch.int32).contiguous(),
                              "features": torch.cat(feats).contiguous()}, out / name)
        shards.append({"file": name, "start": start, "rows": stop - start, "sha256": sha256_file(out / name)})
    index = {
        "format": FORMAT,
        "target": cfg.target.path,
        "layer_ids": list(layer_ids),
        "hidden_size": target.hidden_size,
        "dtype": dtype,
        "max_tokens": data.max_tokens,
        "num_rows": n,
        "shards": shards,
        "data_stats": {k: v for k, v in data.stats.items() if k != "skipped_examples"},
        "heldout": [c.to_json() for c in data.heldout],
    }
    with writing(out / "index.json", hint=again):
        atomic_write_json(out / "index.json", index)
    return out


def precompute_command(cfg, out: Path, dtype: str, rows_per_shard: int) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]capturing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task("rows", total=None)
        path = precompute_features(cfg, out, dtype, rows_per_shard,
                                   progress=lambda d, t: bar.update(task, completed=d, total=t))
    index = json.loads((path / "index.json").read_text())
    console.print(f"wrote {index['num_rows']} rows in {len(index['shards'])} shard(s), layers {index['layer_ids']}, "
                  f"{index['dtype']} -> {path}\ntrain from it with: data.source=precomputed:{path}")


def read_precomputed_heldout(path: Path) -> list[Conversation]:
    """The held-out conversations a precompute directory was made with (its index.json; the
    shards are not read)."""
    idx = Path(path) / "index.json"
    try:
        index = json.loads(idx.read_text())
    except (OSError, ValueError) as e:
        raise PrecomputeError(f"{idx}: cannot read the precomputed features' index: {e}") from None
    return [Conversation.from_json(c) for c in index.get("heldout", [])]


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
        return [Conversation.from_json(c) for c in self.index.get("heldout", [])]

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
