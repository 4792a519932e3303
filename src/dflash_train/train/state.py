"""What a checkpoint holds of a training run, and putting it back: the drafter's tensors
and the optimizer (full tensors gathered with torch.distributed.checkpoint under FSDP2, so
a checkpoint is the same files whichever sharding wrote it), the scheduler, `TrainState`,
every trainer rank's RNG streams and the data order's state. Every trainer rank calls
`checkpoint_payload` at the same step (it runs collectives)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.checkpoint import capture_rng_state, restore_rng_state
from dflash_train.errors import UserError
from dflash_train.utils import code_version

STATE_FORMAT = 1


@dataclass
class TrainState:
    """Everything besides module/optimizer tensors that a bit-exact resume needs."""

    step: int = 0
    tokens: int = 0
    samples: int = 0
    blocks: int = 0
    consecutive_skips: int = 0
    skipped_total: int = 0
    best_tau: float | None = None
    order_state: dict[str, Any] = field(default_factory=dict)


def _sharding(ctx) -> str:
    return "fsdp2" if ctx.fsdp else "replicated"


def recipe_of(train_cfg) -> dict[str, str]:
    """What a checkpoint's optimizer state and progress are only valid for: the objective and
    the optimizer (checkpoints written before they were options: ce_decay / adamw)."""
    return {"loss": train_cfg.loss, "optimizer": train_cfg.optimizer}


def check_recipe(path: Path, objects: dict, train_cfg) -> None:
    """UserError naming both when this run's objective or optimizer is not the checkpoint's."""
    saved = dict({"loss": "ce_decay", "optimizer": "adamw"}, **(objects.get("recipe") or {}))
    now = recipe_of(train_cfg)
    for key in ("loss", "optimizer"):
        if saved[key] != now[key]:
            raise UserError(f"checkpoint {path} was trained with train.{key}={saved[key]}, this run asks for "
                            f"train.{key}={now[key]}: a resume keeps the {key}; set train.{key}={saved[key]} "
                            f"or start a new --run-dir (or --resume never)")


def checkpoint_payload(drafter: torch.nn.Module, optimizer, scheduler, state: TrainState, ctx,
                       generators: dict[str, torch.Generator], recipe: dict | None = None) -> tuple[dict, dict]:
    """(tensors, objects) for CheckpointManager.save (see checkpoint/manager.py for "objects")."""
    train_state = state.__dict__.copy()
    train_state["order_state"] = ctx.combine_order_states(state.order_state)
    rng_per_trainer = ctx.gather_objects(capture_rng_state(generators))
    if ctx.fsdp:  # gather full tensors (a collective over the trainer ranks)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        tensors = get_model_state_dict(drafter, options=full)
        optim_state = get_optimizer_state_dict(drafter, optimizer, options=full)
    else:
        tensors = dict(drafter.state_dict())
        optim_state = optimizer.state_dict()
    objects = {
        "format": STATE_FORMAT,
        "sharding": _sharding(ctx),
        "optimizer": optim_state,
        "scheduler": scheduler.state_dict(),
        "train_state": train_state,
        "rng": rng_per_trainer,
        "recipe": recipe or {"loss": "ce_decay", "optimizer": "adamw"},
    }
    return tensors, objects


def checkpoint_meta(state: TrainState, cfg, drafter_cfg, world_size: int) -> dict:
    """The manifest's `meta`: the full resolved config is what the resume rule compares against."""
    return {"step": state.step, "config_hash": cfg.hash(), "config": cfg.to_dict(), "code_version": code_version(),
            "drafter_config": drafter_cfg.to_dict(), "target_path": cfg.target.path, "tokens": state.tokens,
            "world_size": world_size}


def restore_payload(path: Path, tensors: dict, objects: dict, drafter: torch.nn.Module, optimizer, scheduler,
                    ctx, generators: dict[str, torch.Generator], log) -> TrainState:
    """Put a loaded checkpoint back (drafter, optimizer, scheduler, this rank's RNG streams) and
    return its TrainState. UserError when the checkpoint does not fit this drafter or sharding."""
    own = drafter.state_dict()
    names = set(own)
    if "draft_vocab" in names and "draft_vocab" not in tensors:
        # written before checkpoints carried the draft vocabulary: the one computed from the same
        # rows now (train.vocab_subset is a deterministic function of them) is the one it trained on
        tensors = {**tensors, "draft_vocab": own["draft_vocab"]}
    if set(tensors) != names:
        missing, unexpected = sorted(names - set(tensors)), sorted(set(tensors) - names)
        raise UserError(f"checkpoint {path} does not fit this drafter: missing {missing}, unexpected {unexpected}")
    saved_sharding = objects.get("sharding", "replicated")
    if saved_sharding != _sharding(ctx):
        raise UserError(f"checkpoint {path} was written with sharding '{saved_sharding}'; resume it with the "
                        f"same train.sharding")
    if ctx.fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(drafter, tensors, options=full)
        set_optimizer_state_dict(drafter, optimizer, objects["optimizer"], options=full)
    else:
        drafter.load_state_dict(tensors, strict=True)
        optimizer.load_state_dict(objects["optimizer"])
    scheduler.load_state_dict(objects["scheduler"])
    rng = objects["rng"]
    if len(rng) != ctx.num_trainers:
        log.warning("checkpoint was written by %d trainer ranks, now %d: RNG streams restart from rank 0's",
                    len(rng), ctx.num_trainers)
    restore_rng_state(rng[ctx.trainer_index if ctx.trainer_index < len(rng) else 0], generators)
    return TrainState(**objects["train_state"])
