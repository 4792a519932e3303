"""THE resume rule (README "Resuming", docs/architecture.md "Resume rule").

When a run resumes from a checkpoint, every key of the resolved config is compared with the
config recorded in that checkpoint's manifest. Keys matching one of `RESUME_MAY_CHANGE`'s
patterns may change: the new value is applied and logged, one line each. Every other key
(model.*, train.seed / batch_size / num_anchors / dtype / loss / optimizer, data.* contents,
target.path / dtype, pipeline.target_ranks ...) may not: resume is refused naming the key
with its old and new value.
"""
from __future__ import annotations

import json
from typing import Any

from dflash_train.config import ConfigError, RunConfig

RESUME_MAY_CHANGE: tuple[str, ...] = (
    "name",
    "train.max_steps", "train.epochs", "train.max_seconds", "train.max_consecutive_skips",
    # the lr schedule: lr(step) = train.lr * factor(step; steps, warmup_fraction, min_lr_ratio), steps =
    # max_steps or the epochs' steps (train/schedule.py), recomputed with the new values from the first
    # step after the resume
    "train.lr", "train.min_lr_ratio", "train.warmup_fraction",
    # placement / speed only
    "train.device", "train.compile", "train.activation_checkpointing", "train.loss_chunk_blocks",
    "target.device",
    # which positions anchor the blocks: an on-policy phase may follow a uniform one
    "train.anchors", "train.on_policy_start",
    "data.cache_dir",
    "pipeline.queue_depth", "pipeline.num_target_workers", "pipeline.cache_features",
    "checkpoint.*", "eval.*", "logging.*", "demo.*",
)
LR_SCHEDULE_KEYS = ("train.lr", "train.min_lr_ratio", "train.warmup_fraction", "train.max_steps", "train.epochs")


def may_change_on_resume(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in RESUME_MAY_CHANGE)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(old: dict[str, Any], new: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, old value, new value) of every key whose value differs; keys the old
    config does not record (an older schema) are not compared."""
    a, b = _flatten(old), _flatten(new.to_dict())
    return [(k, a[k], b[k]) for k in b if k in a and json.dumps(a[k]) != json.dumps(b[k])]


def check_resume_config(old: dict[str, Any], new: RunConfig, where: str) -> list[str]:
    """Apply THE resume rule: raise ConfigError (one line per refused key) when a key
    that may not change differs from `old` (the config recorded with the checkpoint
    `where`); else return one log line per changed key."""
    changes = config_changes(old, new)
    refused = [c for c in changes if not may_change_on_resume(c[0])]
    if refused:
        raise ConfigError("\n".join(
            f"{k} cannot change on resume: {where} was trained with {k}={json.dumps(o)}, now {json.dumps(n)}; "
            f"keep {json.dumps(o)} or use a new --run-dir" for k, o, n in refused))
    lines = []
    for k, o, n in changes:
        effect = ""
        if k in LR_SCHEDULE_KEYS:
            effect = " (the lr schedule is recomputed with it from the resumed step on)"
        lines.append(f"resume: {k} changed {json.dumps(o)} -> {json.dumps(n)}: applied{effect}")
    return lines
