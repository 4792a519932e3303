"""The one data entry point of training: `open_training_data` decides between prepared rows
(``jsonl:`` / ShareGPT / HF / ``prepared:``: data/prepare.py, captured online by the target) and
precomputed features (``precomputed:DIR``: pipeline/precompute.py), and loads the target in the
order each needs: prepared data first from the tokenizer alone (a data mistake shows before the
target's weights load), precomputed features after the target (they are checked against it).

Prepared rows are memory-mapped (data/prepared_store.py): a rank holds the rows its batches copy
out, and the ranks of a node share one page cache of them. Under torchrun every rank calls this;
load_prepared lets one process per cache directory build a missing cache while the others wait
for it (data/prepare.py `build_lock`), so the ranks of a node never build the same rows twice."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_train.data import load_prepared
from dflash_train.data.prepared_store import RowCounts, count_rows
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.objectives import Objective, capture_layer_ids
from dflash_train.pipeline.precomputed import PrecomputedFeatures, PrecomputeError
from dflash_train.targets import Target, load_tokenizer

log = logging.getLogger("dflash_train")


@dataclass
class TrainingData:
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    document_ids: torch.Tensor
    heldout: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    precomputed: PrecomputedFeatures | None = None  # set: batches come from these features, not the target
    counts: RowCounts | None = None  # prepare's counts of the rows (None: counted here, see row_counts)

    @property
    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.input_ids, self.loss_mask, self.document_ids

    def row_counts(self) -> RowCounts:
        """The counts training needs from all the rows: prepare's, else counted a chunk at a time."""
        return self.counts if self.counts is not None else count_rows(*self.rows)


def open_training_data(cfg, load_target: Callable[[Any], Target], given_target: Target | None = None,
                       split: bool = False) -> tuple[TrainingData, Target]:
    """(the training rows, the target) for `cfg`. `load_target(tokenizer or None)`: the caller's way
    to load the target (the whole model, or the head-only one of a trainer rank); `given_target`: one
    already loaded (the demo), used instead. `split`: a split layout's trainer (its batches come from the
    target ranks)."""
    src = cfg.data.parsed_source
    if src.kind == "precomputed":
        target = given_target or load_target(None)
        return open_precomputed(cfg, src.path, target, split), target
    if given_target is not None:
        tokenizer, family = given_target.tokenizer, given_target.family
    else:
        tokenizer, family = load_tokenizer(cfg.target)
    p = load_prepared(cfg, tokenizer, family)
    data = TrainingData(p.input_ids, p.loss_mask, p.document_ids, p.heldout, p.stats, counts=p.counts)
    log.info("data: %s", data.stats)
    return data, given_target or load_target(tokenizer)


def open_precomputed(cfg, path: str, target: Target, split: bool = False) -> TrainingData:
    """The features under `path`, checked against the target and the drafter/objective of `cfg`."""
    pre = PrecomputedFeatures(Path(path))
    drafter_ids = list(DrafterConfig.from_target(cfg.model, target).target_layer_ids)
    want = capture_layer_ids(drafter_ids, target.num_layers, Objective.from_train_config(cfg.train))
    if pre.layer_ids[:len(drafter_ids)] != drafter_ids:
        raise PrecomputeError(
            f"{path} holds target layers {pre.layer_ids} but this drafter reads {drafter_ids}; "
            f"set model.target_layer_ids={pre.layer_ids}")
    if pre.layer_ids != want:
        has_final = pre.layer_ids == drafter_ids + [target.num_layers]
        raise PrecomputeError(
            f"{path} holds target layers {pre.layer_ids}, train.loss={cfg.train.loss} reads {want}: "
            + ("the features hold the final hidden state, which this objective does not read; precompute "
               "again without it" if has_final else
               "this objective needs the target's final hidden state; run `dflash-train precompute` with "
               f"train.loss={cfg.train.loss}"))
    if pre.index["hidden_size"] != target.hidden_size:
        raise PrecomputeError(f"{path} was captured from a target with hidden size {pre.index['hidden_size']}, "
                              f"not {target.hidden_size}")
    if split:
        raise PrecomputeError("precomputed features are read by the trainers themselves: under torchrun use "
                              "pipeline.layout=colocated (or pipeline.layout=split with an online source)")
    stats = dict(pre.index.get("data_stats", {}), source=f"precomputed:{path}", rows=len(pre.input_ids))
    data = TrainingData(pre.input_ids, pre.loss_mask, pre.document_ids, pre.heldout(), stats, precomputed=pre)
    log.info("data: %s", data.stats)
    return data
