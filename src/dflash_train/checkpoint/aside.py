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
* A resume (`set_aside_newer`): every checkpoint with a higher step than the
  one resumed from (``--resume RUN/checkpoints/step-N`` of an older one: an
  abandoned timeline; or newer ones that do not verify) is moved to
  ``<ckpt_dir>.set-aside-<UTC time>/`` before training, with a copy of
  ``metrics.jsonl`` as it was, so the choice is on disk at once: a process
  killed before its first save resumes the chosen timeline with
  ``--resume auto``, not the newer abandoned one.

When the checkpoint ``best`` points at is moved aside, ``best`` is re-pointed
at the remaining checkpoint with the highest tau recorded in ``metrics.jsonl``
(eval lines), or removed when none has one; a ``latest`` left dangling points
at the newest remaining complete checkpoint (`repair_links`). Both are logged.

If ``checkpoints`` is a symlink, the directory it points to is the one moved
aside (the link keeps pointing at a fresh, empty directory on the same storage).
Moves are renames where possible (shutil.move copies across file systems).
"""
from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from dflash_train.rundir import (
    BEST,
    CHECKPOINTS_DIR,
    LATEST,
    METRICS_FILE,
    TMP_PREFIX,
    fsync_dir,
    list_checkpoints,
    read_link,
    recorded_taus,
    set_link,
    verify_checkpoint,
)

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


def repair_links(ckpt_dir: Path, log: Log, metrics_path: Path | None = None) -> None:
    """Re-point (or remove) a ``best`` / ``latest`` link whose checkpoint is gone (moved aside).

    ``best``: the remaining complete checkpoint with the highest recorded tau (the
    earliest of equal ones, as training marks only a strict improvement), else the
    link is removed. ``latest``: the newest remaining complete checkpoint, else removed."""
    import os

    ckpt_dir = Path(ckpt_dir)
    for name in (LATEST, BEST):
        link = ckpt_dir / name
        if not link.is_symlink() or read_link(ckpt_dir, name) is not None:
            continue
        old = os.readlink(link)
        complete = [(s, p) for s, p in list_checkpoints(ckpt_dir) if not verify_checkpoint(p, check_hashes=False)]
        new, why = None, ""
        if name == LATEST and complete:
            new, why = complete[-1][1], "the newest remaining checkpoint"
        elif name == BEST:
            taus = recorded_taus(metrics_path)
            scored = [(taus[s], -s, p) for s, p in complete if s in taus]
            if scored:
                tau, _, new = max(scored)
                why = f"recorded tau {tau:.3f}, the highest among the remaining checkpoints"
        if new is not None:
            set_link(ckpt_dir, name, new)
            log(f"checkpoint: {name} pointed at {Path(old).name}, which was moved aside; {name} -> {new.name} ({why})")
        else:
            link.unlink()
            fsync_dir(ckpt_dir)
            none = "no remaining checkpoint has a recorded tau" if name == BEST else "no complete checkpoint remains"
            log(f"checkpoint: removed the {name} link: it pointed at {Path(old).name}, which was moved aside, and "
                f"{none}")


def set_aside_newer(ckpt_dir: Path, resumed: Path, step: int, log: Log, metrics_path: Path | None = None) -> Path | None:
    """At a resume from `resumed` (at `step`): move the ``step-*`` dirs of `ckpt_dir` with a
    higher step to ``<ckpt_dir>.set-aside-<UTC time>/`` (plus a copy of `metrics_path`), make
    ``latest`` point at `resumed` when it lies in `ckpt_dir`, repair ``best``. Durable (fsync'd)
    before it returns, so a later ``--resume auto`` continues from `resumed`. Returns the place,
    or None when nothing was newer."""
    ckpt_dir = Path(ckpt_dir)
    resumed = Path(resumed)
    newer = [(s, p) for s, p in list_checkpoints(ckpt_dir) if s > step and p.resolve() != resumed.resolve()]
    if not newer:
        return None
    dest = aside_path(ckpt_dir, "set-aside")
    for _, p in newer:
        move_into(p, dest)
    copied = ""
    if metrics_path is not None and Path(metrics_path).is_file():
        shutil.copy2(metrics_path, dest / Path(metrics_path).name)
        copied = f" and a copy of {Path(metrics_path).name}"
    fsync_dir(dest)
    fsync_dir(ckpt_dir)
    fsync_dir(dest.parent)
    if resumed.resolve().parent == ckpt_dir.resolve() and read_link(ckpt_dir, LATEST) != resumed:
        set_link(ckpt_dir, LATEST, resumed)
    names = ", ".join(p.name for _, p in newer)
    log(f"resume from step {step} ({resumed}): moved the newer checkpoint{'s' if len(newer) > 1 else ''} {names}"
        f"{copied} aside to {dest}, so that a later --resume auto continues from step {step} (nothing deleted; "
        f"remove it yourself once it is no longer needed)")
    repair_links(ckpt_dir, log, metrics_path)
    return dest
