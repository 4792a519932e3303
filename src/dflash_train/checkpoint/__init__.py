"""Atomic, manifest-verified, asynchronous checkpoints; retention; resume selection.

Public API (see manager.py / store.py / rng.py and dflash_train.rundir for the details)::

    mgr = CheckpointManager(ckpt_dir, keep_last, async_save=True, log=print)
    mgr.save(step, tensors, objects, meta)   # snapshot now, write in the background
    mgr.wait(); mgr.raise_failure(); mgr.abandon(); mgr.mark_best(step)
    mgr.last_committed_step, mgr.last_committed_path, mgr.last_stats (SaveStats)
    FollowerCheckpoints()                    # the same calls on a rank that writes nothing

    find_resumable(ckpt_dir, log) -> Path | None      # newest that verifies
    load_checkpoint(path, map_location="cpu") -> (tensors, objects, manifest)
    verify_checkpoint(path) -> list[str]              # [] = valid
    capture_rng_state(extra_generators) / restore_rng_state(state, extra_generators)
    CheckpointError, CheckpointWriteError (a refused write: also a one-line UserError)
"""
from dflash_train.checkpoint.follower import FollowerCheckpoints
from dflash_train.checkpoint.manager import CheckpointManager, CheckpointWriteError, SaveStats
from dflash_train.checkpoint.rng import capture_rng_state, restore_rng_state
from dflash_train.checkpoint.store import load_checkpoint
from dflash_train.rundir import (
    BEST,
    LATEST,
    CheckpointError,
    find_resumable,
    list_checkpoints,
    read_link,
    read_manifest,
    resolve_checkpoint_path,
    step_dir_name,
    verify_checkpoint,
)

__all__ = [
    "BEST",
    "LATEST",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointWriteError",
    "FollowerCheckpoints",
    "SaveStats",
    "capture_rng_state",
    "find_resumable",
    "list_checkpoints",
    "load_checkpoint",
    "read_link",
    "read_manifest",
    "resolve_checkpoint_path",
    "restore_rng_state",
    "step_dir_name",
    "verify_checkpoint",
]
