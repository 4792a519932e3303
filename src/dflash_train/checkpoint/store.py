"""Loading a committed checkpoint. The on-disk layout, the manifest, verification and
resume selection are the run-directory protocol (dflash_train.rundir), shared with
`status`, `stop`, `export` and the deploy agent.

One committed checkpoint (``CKPT_DIR/step-NNNNNNNN/``)::

    model.safetensors   the tensors handed to CheckpointManager.save (safetensors)
    state.pt            torch.save of the plain `objects` dict (optimizer, scheduler,
                        rng, data order...); loadable with torch.load(weights_only=True)
    manifest.json       written LAST: format_version, step, code_version, config_hash,
                        created_at, tensors {name: {shape, dtype}}, files {name: {size,
                        sha256}}, meta
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_train.rundir import (
    MODEL_FILE,
    STATE_FILE,
    CheckpointError,
    read_manifest,
    resolve_checkpoint_path,
    verify_checkpoint,
)


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu", weights_only: bool = True, verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors, objects, manifest) of the checkpoint at `path`, verified first.

    Raises CheckpointError naming the offending file when verification fails.
    `path` may also be a checkpoints dir containing a ``latest`` link, or a
    run dir containing ``checkpoints/latest``.
    """
    from safetensors.torch import load_file

    path = resolve_checkpoint_path(Path(path))
    if verify:
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} failed verification: " + "; ".join(problems))
    manifest = read_manifest(path)
    device = str(map_location) if isinstance(map_location, torch.device) else map_location
    try:
        tensors = load_file(str(path / MODEL_FILE), device=device)
    except Exception as e:  # noqa: BLE001 - re-raise with the file name
        raise CheckpointError(f"{path / MODEL_FILE}: cannot load: {e}") from e
    try:
        objects = torch.load(path / STATE_FILE, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path / STATE_FILE}: cannot load: {e}") from e
    return tensors, objects, manifest
