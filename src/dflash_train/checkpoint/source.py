"""The one reader of a drafter on disk: a run dir (its ``latest``, or ``best``), a checkpoint
dir, the ``RUN_DIR/best`` / ``RUN_DIR/latest`` shorthands, or an export dir (config.json +
model.safetensors, written by export.py) as a `DrafterSource` (config, weights, step, target,
provenance), with the one rule that finds the run's config beside it (`run_config_of`).
`resolve_drafter_source` accepts them all; eval/source.py adds the target and the held-out
prompts (what eval, serve-bench, the suites, the demo and compare start from)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import json

import torch

from dflash_train.config import ConfigError, RunConfig, read_run_config
from dflash_train.errors import UserError
from dflash_train.model.dflash2 import from_export_names
from dflash_train.model.drafter import DrafterConfig
from dflash_train.model.hf_config import drafter_config_from_hf
from dflash_train.rundir import (
    BEST,
    CHECKPOINTS_DIR,
    LATEST,
    MANIFEST_FILE,
    MODEL_FILE,
    CheckpointError,
    find_resumable,
    read_link,
    read_manifest,
    run_dir_of_checkpoint,
    verify_checkpoint,
)
from dflash_train.serving_check import D2T

# an export dir's files (export.py writes them)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


# tensors the drafter never owns (the target's); dropped defensively
_FOREIGN = ("embed_tokens", "lm_head")


def clean_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's own tensors under their plain names (no ``model.`` prefix, no embed_tokens/lm_head)."""
    out = {}
    for k, v in sd.items():
        if k.startswith("model."):
            k = k[len("model."):]
        if any(f in k for f in _FOREIGN):
            continue
        out[k] = v
    return out


@dataclass
class DrafterSource:
    """A drafter found on disk: its config, weights and where it came from."""

    kind: str  # "checkpoint" | "export"
    path: Path  # the checkpoint dir or export dir actually read
    config: Any  # DrafterConfig
    state_dict: dict[str, torch.Tensor]
    run_dir: Path | None = None
    step: int | None = None
    target_path: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _target_path_from_run(run_dir: Path | None) -> str | None:
    """Provenance only: a damaged config.yaml names no target."""
    try:
        cfg = read_run_config(run_dir)
    except (ConfigError, OSError):
        return None
    return cfg.target.path if cfg is not None else None


def load_checkpoint_source(ckpt: Path) -> DrafterSource:
    """The drafter of one checkpoint dir, verified (sha256) first."""
    from safetensors.torch import load_file

    try:
        problems = verify_checkpoint(ckpt, check_hashes=True)
        if problems:
            raise UserError(f"checkpoint {ckpt} failed verification: " + "; ".join(problems[:3]))
        man = read_manifest(ckpt)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    meta = man.get("meta") or {}
    dc = meta.get("drafter_config")
    if not isinstance(dc, dict):
        raise UserError(f"{ckpt / MANIFEST_FILE}: meta has no drafter_config; cannot rebuild the drafter")
    try:
        cfg = DrafterConfig.from_dict(dc)
    except (TypeError, ValueError) as e:
        raise UserError(f"{ckpt / MANIFEST_FILE}: invalid drafter_config: {e}") from None
    try:
        sd = load_file(str(ckpt / MODEL_FILE))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types: name the file
        raise UserError(f"{ckpt / MODEL_FILE}: cannot load: {e}") from None
    run_dir = run_dir_of_checkpoint(ckpt)
    target = meta.get("target_path") or _target_path_from_run(run_dir)
    step = man.get("step", meta.get("step"))
    return DrafterSource(
        kind="checkpoint", path=ckpt, config=cfg, state_dict=clean_state_dict(sd), run_dir=run_dir,
        step=step, target_path=target, meta=meta,
    )


def resolve_checkpoint_source(path: str | Path, prefer_best: bool = False) -> DrafterSource | None:
    """RUN_DIR (checkpoints/latest, or `best` with prefer_best) or a checkpoint dir; `path` may
    also be RUN_DIR/checkpoints or name ``RUN_DIR/best`` / ``RUN_DIR/latest``. None when `path`
    is a directory holding no checkpoint; UserError (one clear line) when it is missing, not a
    directory, or a checkpoint that does not verify."""
    p = Path(path)
    if not p.exists():
        # RUN_DIR/best or RUN_DIR/latest shorthand
        if p.name in (BEST, LATEST) and (p.parent / CHECKPOINTS_DIR).is_dir():
            t = read_link(p.parent / CHECKPOINTS_DIR, p.name)
            if t is None:
                raise UserError(f"{p.parent / CHECKPOINTS_DIR / p.name}: no such checkpoint link")
            return load_checkpoint_source(t)
        raise UserError(f"drafter path not found: {p}")
    if not p.is_dir():
        raise UserError(f"drafter path is not a directory: {p} (give a RUN_DIR, checkpoint dir or export dir)")
    if (p / MANIFEST_FILE).is_file():
        return load_checkpoint_source(p)
    for base in (p / CHECKPOINTS_DIR, p):
        if not base.is_dir():
            continue
        names = (BEST, LATEST) if prefer_best else (LATEST,)
        for name in names:
            t = read_link(base, name)
            if t is not None:
                return load_checkpoint_source(t)
        found = find_resumable(base, log=lambda m: None) if any(base.glob("step-*")) else None
        if found is not None:
            return load_checkpoint_source(found)
    return None


# --------------------------------------------------------------------------- export dirs


def load_export_source(path: Path) -> DrafterSource:
    """The drafter of an export dir (config.json + model.safetensors), under our own tensor names."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise UserError(f"{cfg_file}: missing (not an export dir)")
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg_file}: not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise UserError(f"{cfg_file}: not a JSON object")
    try:
        cfg = drafter_config_from_hf(d)
    except KeyError as e:
        raise UserError(f"{cfg_file}: missing key {e.args[0]!r}; not a DFlash drafter config") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{cfg_file}: invalid DFlash drafter config: {e}") from None
    wf = path / WEIGHTS_FILE
    if not wf.is_file():
        raise UserError(f"{wf}: missing")
    try:
        sd = load_file(str(wf))
    except Exception as e:  # noqa: BLE001 - name the file
        raise UserError(f"{wf}: cannot load: {e}") from None
    prov = d.get("dflash_train") or {}
    if cfg.draft_vocab_size and D2T in sd:
        sd["draft_vocab"] = sd.pop(D2T) + torch.arange(cfg.draft_vocab_size)
    return DrafterSource(
        kind="export", path=path, config=cfg, state_dict=from_export_names(clean_state_dict(sd)), step=prov.get("step"),
        target_path=prov.get("target_path"), meta=prov,
    )


def load_export(path: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(DrafterConfig, state_dict) of an export dir (config.json + model.safetensors)."""
    src = load_export_source(Path(path))
    return src.config, src.state_dict


def resolve_drafter_source(path: str | Path, prefer_best: bool = False) -> DrafterSource:
    """An export dir, or what `resolve_checkpoint_source` finds: RUN_DIR (checkpoints/latest, or
    `best` with prefer_best), a checkpoint dir, RUN_DIR/checkpoints, ``RUN_DIR/best`` /
    ``RUN_DIR/latest``. Raises the CLI's UserError (one clear line) otherwise."""
    p = Path(path)
    if p.is_dir() and not (p / MANIFEST_FILE).is_file() and (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file():
        return load_export_source(p)
    src = resolve_checkpoint_source(p, prefer_best=prefer_best)
    if src is None:
        raise UserError(
            f"{p}: not a run dir (no checkpoints/latest), checkpoint dir (no manifest.json) "
            f"or export dir (no config.json + model.safetensors)"
        )
    return src


def run_config_of(src: DrafterSource) -> RunConfig | None:
    """THE rule for the run config of a drafter (its target, its held-out prompts): the source's
    run dir, else, for an export, the run it sits in (RUN/export) or the run of the checkpoint it
    was exported from (its recorded ``source``). None when none of them holds a config.yaml."""
    cands = [src.run_dir] if src.run_dir is not None else []
    if src.kind == "export":
        cands.append(Path(src.path).resolve().parent)
        if src.meta.get("source"):
            cands += list(Path(src.meta["source"]).resolve().parents[:2])
    for d in cands:
        cfg = read_run_config(d)
        if cfg is not None:
            return cfg
    return None
