"""Resuming a run, around the payload restore of train/state.py: the checkpoint must fit the
drafter derived now, THE resume rule for the lr schedule, and what the run dir keeps of the
timeline a resume abandons (checkpoints set aside, metrics lines after the step dropped)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash_train.checkpoint import CheckpointError, load_checkpoint
from dflash_train.checkpoint.aside import set_aside_for_fresh_start, set_aside_newer
from dflash_train.errors import UserError
from dflash_train.model.dflash2 import architecture_mismatch
from dflash_train.model.drafter import SERVING_ONLY_FIELDS
from dflash_train.resume_rule import LR_SCHEDULE_KEYS, config_changes
from dflash_train.rundir import RunDir
from dflash_train.storage import writing
from dflash_train.train.metrics import truncate_metrics
from dflash_train.train.preflight import TrainError
from dflash_train.train.schedule import lr_factor
from dflash_train.train.state import TrainState, check_recipe, restore_payload

log = logging.getLogger("dflash_train")


def resume_run(plan, cfg, drafter_cfg, step, ctx, generators: dict, run_dir: Path, resume_arg: str,
               total_steps: int) -> TrainState | None:
    """Put back the checkpoint `plan` names (chosen and verified by preflight) into `step`'s drafter,
    optimizer and scheduler and this rank's RNG `generators`; its TrainState. A fresh start (None)
    sets what an earlier run left aside first (the leader). `total_steps`: the run's step count now
    (train.max_steps, or what train.epochs makes of the rows: train/schedule.py)."""
    path = plan.path
    if path is None:
        if ctx.is_leader:
            keep_fresh_start_aside(run_dir, resume_arg)
        return None
    try:
        tensors, objects, manifest = load_checkpoint(path)
    except CheckpointError as e:
        raise TrainError(f"cannot resume: {e}") from None
    refused = drafter_mismatch(manifest, drafter_cfg, path, cfg.target.path)
    if refused:
        raise TrainError(refused)
    try:
        check_recipe(path, objects, cfg.train)
        state = restore_payload(path, tensors, objects, step.drafter, step.optimizer, step.scheduler, ctx, generators,
                                log)
    except UserError as e:
        raise TrainError(str(e)) from None
    apply_schedule_changes(step.scheduler, step.optimizer, plan.config, cfg, total_steps)
    log.info("resumed from %s at step %d (%d tokens trained)", path, state.step, state.tokens)
    if ctx.is_leader:
        settle_timeline(run_dir, path, state.step)
    return state


def drafter_mismatch(manifest: dict, drafter_cfg, path: Path, target_path: str) -> str | None:
    """Why the checkpoint at `path` does not fit `drafter_cfg` (one line), or None when it fits."""
    saved = (manifest.get("meta") or {}).get("drafter_config")
    if not isinstance(saved, dict):
        return None
    refused = architecture_mismatch(saved, drafter_cfg, path)
    if refused:
        return refused
    now = drafter_cfg.to_dict()
    diff = [k for k in now if k in saved and k not in SERVING_ONLY_FIELDS
            and json.dumps(saved[k], sort_keys=True) != json.dumps(now[k], sort_keys=True)]
    if not diff:
        return None
    k = diff[0]
    return (f"checkpoint {path} does not fit this drafter: {k} was {json.dumps(saved[k])}, "
            f"now {json.dumps(now[k])} (target {target_path} differs from the one "
            f"the run was trained against?)" + (f"; also {diff[1:]}" if diff[1:] else ""))


def apply_schedule_changes(scheduler, optimizer, resume_config: dict | None, cfg, total_steps: int) -> None:
    """THE resume rule for the lr schedule: lr(step) = train.lr * lr_factor(step; total_steps,
    warmup_fraction, min_lr_ratio) with the CURRENT values (`total_steps`: train.max_steps, or the
    steps of train.epochs). The restored scheduler keeps its step count; when a schedule key changed
    (train.epochs among them), its base lr becomes the new train.lr and the lr of the next step is
    recomputed (unchanged config: restored as saved, bit-exact)."""
    if resume_config is None:
        return
    if not any(k in LR_SCHEDULE_KEYS for k, _, _ in config_changes(resume_config, cfg)):
        return
    t = cfg.train
    s = scheduler.last_epoch
    # lr_mult: Muon's groups run at train.lr * muon_lr_mult (train/optim.py)
    scheduler.base_lrs = [t.lr * g.get("lr_mult", 1.0) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["initial_lr"] = t.lr * g.get("lr_mult", 1.0)
        g["lr"] = g["initial_lr"] * lr_factor(s, total_steps, t.warmup_fraction, t.min_lr_ratio)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    log.info("resume: lr schedule recomputed at step %d: lr %.3g (train.lr %.3g, %d steps)", s,
             optimizer.param_groups[0]["lr"], t.lr, total_steps)


def keep_fresh_start_aside(run_dir: Path, resume_arg: str) -> None:
    """Fresh start: keep, never delete, what an earlier start left (checkpoint/aside.py)."""
    with writing(run_dir, "moving the earlier checkpoints and metrics aside in"):
        set_aside_for_fresh_start(run_dir, resume_arg, log.warning)


def settle_timeline(run_dir: Path, resumed_from: Path, step: int) -> None:
    """The choice of checkpoint is on disk before training: newer ones (an abandoned timeline,
    or ones that do not verify) are moved aside now, not at the first save; metrics.jsonl
    loses the lines logged after `step` (they are produced again)."""
    rd = RunDir(run_dir)
    with writing(rd.checkpoints, "moving newer checkpoints aside in"):
        set_aside_newer(rd.checkpoints, resumed_from, step, log.warning, rd.metrics)
    with writing(rd.metrics):
        dropped = truncate_metrics(rd.metrics, step)
    if dropped:
        log.info("metrics.jsonl: dropped %d lines logged after step %d (they are produced again)", dropped, step)
