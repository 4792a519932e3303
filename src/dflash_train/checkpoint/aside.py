"""Checkpoints are set aside, never deleted, unless the user asked for exactly that.

Two cases move checkpoints out of the way instead of removing them:

* A fresh start (step 0) in a run dir that already holds checkpoints or
  metrics: ``--resume auto`` when no checkpoint verifies, or ``--resume never``.
  ``RUN_DIR/checkpoints/`` (step dirs, ``latest``/``best`` links, leftovers)
  is renamed to ``RUN_DIR/checkpoints.<why>-<UTC time>/`` and
  ``RUN_DIR/metrics.jsonl`` is moved into it, so the new run's steps never mix
  with the old run's; a new empty ``checkpoints/`` is created. ``<why>`` is
  ``unreadable`` (there were step dirs and none verified) or ``previous``.
* Retention after a commit (CheckpointManager): a checkpoint with a higher step
  than the one just saved (an abandoned timeline after resuming from an older
  checkpoint), one that does not verify, or an older copy of a step saved again
  is moved to ``<ckpt_dir>.set-aside-<UTC time>/`` (one per manager, created
  on first use) so it can no longer win `find_resumable`. Only complete
  checkpoints past ``keep_last`` are deleted (what the config asked for).

If ``checkpoints`` is a symlink, the directory it points to is the one moved
aside (the link keeps pointing at a fresh, empty directory on the same storage).
Moves are renames where possible (shutil.move copies across file systems).
"""
from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from dflash_train.checkpoint.store import TMP_PREFIX, list_checkpoints

Log = Callable[[str], None]


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def aside_path(base: Path, why: str) -> Path:
    """An unused sibling ``<base>.<why>-<UTC time>[-N]`` of `base` (resolved)."""
    real = Path(base).resolve()
    stem = f"{real.name}.{why}-{_stamp()}"
    cand = real.parent / stem
    n = 1
    while cand.exists() or cand.is_symlink():
        n += 1
        cand = real.parent / f"{stem}-{n}"
    return cand


def move_into(src: Path, dest_dir: Path) -> Path:
    """Move `src` into `dest_dir` (created if needed) under its own name, or
    ``<name>-N`` if that is taken. Returns the new path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    n = 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = dest_dir / f"{src.name}-{n}"
    shutil.move(str(src), str(dest))
    return dest


def set_aside_for_fresh_start(run_dir: Path, resume: str, log: Log) -> Path | None:
    """Before a fresh start in `run_dir` (`resume` is the ``--resume`` value that
    led to it, "auto" or "never"): move ``checkpoints/`` and ``metrics.jsonl`` to
    ``checkpoints.<unreadable|previous>-<UTC time>/`` (see the module docstring).

    Returns the new place, or None when there was nothing to keep (no checkpoint
    entries besides ``.tmp-*`` leftovers, no non-empty metrics.jsonl).
    """
    from dflash_train.control.run_record import CHECKPOINTS_DIR, METRICS_FILE
    from dflash_train.utils import fsync_dir

    run_dir = Path(run_dir)
    ckpt = run_dir / CHECKPOINTS_DIR
    metrics = run_dir / METRICS_FILE
    has_ckpt = ckpt.is_dir() and any(not p.name.startswith(TMP_PREFIX) for p in ckpt.iterdir())
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    if not (has_ckpt or has_metrics):
        return None
    n_steps = len(list_checkpoints(ckpt)) if has_ckpt else 0
    unreadable = resume == "auto" and n_steps > 0
    dest = aside_path(ckpt, "unreadable" if unreadable else "previous")
    if ckpt.is_dir():
        real = ckpt.resolve()
        shutil.move(str(real), str(dest))
        real.mkdir()
    else:
        dest.mkdir(parents=True)
    if metrics.is_file():
        shutil.move(str(metrics), str(dest / METRICS_FILE))
    fsync_dir(run_dir)
    fsync_dir(dest.parent)
    kept = [f"{n_steps} checkpoint{'s' if n_steps != 1 else ''}"] if has_ckpt else []
    if has_metrics:
        kept.append(METRICS_FILE)
    reason = ("--resume auto: no checkpoint of this run verifies" if unreadable else
              "--resume never" if resume == "never" else "--resume auto: no checkpoint to resume from")
    log(f"fresh start at step 0 ({reason}): moved the earlier {' and '.join(kept) or 'checkpoints/'} aside to "
        f"{dest} (nothing deleted; remove it yourself once it is no longer needed)")
    return dest
