"""Checks before a training run loads anything, all of which write nothing, so a refused
start changes nothing on disk: the run dir is a writable directory no live trainer holds,
the checkpoint to resume from (verified) and THE resume rule (resume_rule.RESUME_MAY_CHANGE),
the devices, the data paths, the target's files and the drafter's fit to the target."""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.checkpoint import (
    CheckpointError,
    find_resumable,
    read_manifest,
    resolve_checkpoint_path,
    verify_checkpoint,
)
from dflash_train.config import ConfigError, RunConfig, read_run_config
from dflash_train.errors import UserError
from dflash_train.pipeline.layout import check_layout
from dflash_train.resume_rule import check_resume_config
from dflash_train.rundir import RunDir, RunDirBusy, check_not_busy
from dflash_train.targets import check_target_files

log = logging.getLogger("dflash_train")


class TrainError(UserError):
    """A run cannot start or continue for a reason the user can act on."""


@dataclass
class ResumePlan:
    """The checkpoint this start resumes from (None: a fresh start) and the config recorded with it
    (None: none recorded, or a fresh start)."""

    path: Path | None = None
    config: dict | None = None


def check_run_dir(run_dir: Path) -> None:
    """The run dir (and what the trainer writes in it) is a writable directory; one line if not."""
    rd = run_dir
    writes = RunDir(rd).writes()
    for p in writes:
        if p.exists() and not p.is_dir():
            raise TrainError(f"--run-dir {rd}: {p} is a file, not a directory")
    base = rd
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise TrainError(f"--run-dir {rd}: {base} is not a directory")
    for p in (base,) + writes[1:]:
        if p.is_dir() and not _writable(p):
            raise TrainError(f"--run-dir {rd}: {p} is not writable (read-only file system or permissions)")


def refuse_busy(run_dir: Path) -> None:
    """Read-only: refuse a run dir a live trainer holds before looking at anything else."""
    try:
        check_not_busy(run_dir)
    except RunDirBusy as e:
        raise TrainError(str(e)) from None


def preflight(cfg: RunConfig, run_dir: Path, resume_arg: str, check_target: bool) -> ResumePlan:
    """Everything that can be checked before loading data or the target: devices, the layout, the checkpoint
    to resume from and the resume rule, data paths, and (`check_target`: no target was given)
    the target's files, layer ids / mask token against the target's config.json."""
    for key, dev in (("train.device", cfg.train.device), ("target.device", cfg.target.device)):
        if dev == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"{key}=cuda but no CUDA GPU is available here (torch.cuda.is_available() is "
                              f"False); use {key}=auto or cpu")
    check_layout(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    plan = ResumePlan(choose_checkpoint(run_dir, resume_arg))
    if plan.path is not None:
        old = recorded_config(run_dir, plan.path)
        if old is None:
            log.warning("checkpoint %s records no config (written by an older version): config changes on "
                        "resume cannot be checked", plan.path)
        else:
            plan.config = old
            for line in check_resume_config(old, cfg, f"checkpoint {plan.path}"):
                log.info("%s", line)
    d = cfg.data
    source_path = d.parsed_source.local_path
    data_paths = [("data.source", d.source, source_path)] if source_path is not None else []
    if d.regenerated:
        data_paths.append(("data.regenerated", d.regenerated, Path(d.regenerated).expanduser()))
    for key, spec, path in data_paths:
        if not path.exists():
            raise ConfigError(f"{key}={spec}: {path} not found")
    if check_target:
        shape = check_target_files(cfg.target)
        if shape:
            check_target_fit(cfg, shape.get("num_layers"), shape.get("vocab_size"), ConfigError)
    return plan


def check_target_fit(cfg: RunConfig, num_layers: int | None, vocab_size: int | None, err=None) -> None:
    """model.target_layer_ids, model.init_from_target_layers and model.mask_token_id lie inside the target
    (its layers, its embedding rows): checked before the weights load."""
    err = err or TrainError
    m = cfg.model
    where = f"target {cfg.target.path}"
    for key in ("target_layer_ids", "init_from_target_layers"):
        ids = getattr(m, key)
        bad = [i for i in ids if not 0 <= i < num_layers] if num_layers and ids is not None else []
        if bad:
            raise err(f"model.{key}={ids}: {bad} out of range for {where} with "
                      f"{num_layers} layers (valid ids 0..{num_layers - 1})")
    if vocab_size and m.mask_token_id is not None and m.mask_token_id >= vocab_size:
        raise err(f"model.mask_token_id={m.mask_token_id} out of range: {where} has {vocab_size} embedding rows "
                  f"(valid ids 0..{vocab_size - 1})")


def check_mask_unused(mask_token_id: int, token_counts) -> None:
    """The mask token must never be a real token of the data: the drafter could not tell a masked
    slot from that token (the id is chosen automatically for tokenizers without a mask token).
    `token_counts`: each id's occurrences in the rows (`RowCounts.token_counts`)."""
    n = int(token_counts[mask_token_id]) if 0 <= mask_token_id < len(token_counts) else 0
    if n:
        raise TrainError(f"model.mask_token_id={mask_token_id} occurs {n} times in the training data; "
                         "set model.mask_token_id to a token id the data never uses")


def choose_checkpoint(run_dir: Path, resume_arg: str) -> Path | None:
    """The checkpoint this start resumes from (verified), or None for a fresh start."""
    if resume_arg == "never":
        return None
    if resume_arg == "auto":
        return find_resumable(RunDir(run_dir).checkpoints, log=log.warning)
    given = Path(resume_arg)
    if not given.exists():
        raise TrainError(f"--resume {given}: no such checkpoint (give auto, never, or a checkpoint directory)")
    if not given.is_dir():
        raise TrainError(f"--resume {given} is a file; give a checkpoint directory (RUN/checkpoints/step-N), "
                         f"a run dir, auto or never")
    try:
        path = resolve_checkpoint_path(given)
    except CheckpointError as e:
        raise TrainError(f"--resume {given}: {e}") from None
    problems = verify_checkpoint(path)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise TrainError(f"--resume {path}: not a valid checkpoint: {problems[0]}{more}")
    return path


def recorded_config(run_dir: Path, ckpt: Path) -> dict | None:
    """The full config recorded in the checkpoint's manifest; for checkpoints written
    before manifests carried it, RUN/config.yaml when its hash matches the manifest's."""
    man = read_manifest(ckpt)
    cfg = (man.get("meta") or {}).get("config")
    if isinstance(cfg, dict):
        return cfg
    try:
        old = read_run_config(run_dir)
    except ConfigError:
        old = None
    if isinstance(old, RunConfig) and old.hash() == man.get("config_hash"):
        return old.to_dict()
    return None


def _writable(d: Path) -> bool:
    """Can this process create a file in directory `d`? (tried, so a read-only mount
    or an immutable dir counts even for root)"""
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-probe-"):
            return True
    except OSError:
        return False
