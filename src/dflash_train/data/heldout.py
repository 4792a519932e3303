"""The held-out conversations of a run, whatever its data source: what every evaluation of the
run draws its prompts from (eval/prompts.py `eval_prompts`) and the trainer never trains on.

Those of its ORIGINAL data: a regenerated file (``data.regenerated``) holds the training
conversations' rewritten answers, not the held-out split, so it is set aside here. A source
conversation is held out by the fixed hash split (`sources.is_heldout`); ``prepared:DIR`` keeps
its held-out conversations beside its rows, ``precomputed:DIR`` in its index.json (written by
pipeline/precompute.py with the held-out conversations of the data it was made from).
"""
from __future__ import annotations

import json
from pathlib import Path

from dflash_train.data.prepare import load_prepared, read_source_conversations
from dflash_train.data.sources import Conversation, is_heldout
from dflash_train.errors import UserError


def heldout_of_index(index: dict) -> list[Conversation]:
    """The held-out conversations a precompute directory's index.json records."""
    return [Conversation.from_json(c) for c in index.get("heldout", [])]


def read_precomputed_heldout(path: Path) -> list[Conversation]:
    """The held-out conversations a precompute directory was made with (its index.json; the
    shards are not read)."""
    idx = Path(path) / "index.json"
    try:
        index = json.loads(idx.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{idx}: cannot read the precomputed features' index: {e}") from None
    return heldout_of_index(index)


def heldout_conversations(cfg, target) -> list[Conversation]:
    """The held-out conversations of run config `cfg` (module docstring); `target`: anything with
    .tokenizer and .family (a prepared source is read with them)."""
    d = cfg.data
    kind = d.parsed_source.kind
    if kind == "precomputed":
        return read_precomputed_heldout(Path(d.parsed_source.path))
    source = cfg.model_copy(deep=True)
    source.data.regenerated = None
    if kind == "prepared":
        return load_prepared(source, target.tokenizer, target.family).heldout
    return [c for c in read_source_conversations(source)[0] if is_heldout(c, d.heldout_fraction)]
